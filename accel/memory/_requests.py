"""What every allocator checks of a request before it runs, and the stack it records for it.

Shared by the three allocators (``_caching``'s device caching allocator, ``_host``'s pinned one,
``_async``'s cudaMallocAsync one), so that each refuses a bad request with the same error, as
torch's allocators do: a size that is no int number of bytes or is negative (:func:`_check_size`,
all three), 1 EB or more (:data:`_ONE_EXA_BYTES`, all three; :func:`_exabyte_error`, the device
allocators' error, torch's ``allocate()`` refusal before the allocator runs, so nothing is freed,
synchronized or counted; the pinned one raises its own, naming pinned host memory), a pool id that
is not two ints (:func:`_check_pool_id`, torch's ``MempoolId_t``: ``_private_pools``'s and
``_async``'s pool methods).  :func:`_frames` is the caller's stack as a snapshot's ``frames`` give
it (the cudaMallocAsync allocator's; the device caching allocator keeps the raw stack and
symbolizes it when a snapshot is taken).
"""

from __future__ import annotations

from .._errors import OutOfMemoryError
from ._snapfmt import Symbols as _Symbols, stack as _stack


def _check_size(nbytes) -> int:
    if isinstance(nbytes, bool) or not hasattr(type(nbytes), "__index__"):
        raise TypeError(f"allocation size must be an int number of bytes, got "
                        f"{type(nbytes).__name__} {nbytes!r}")
    nbytes = nbytes.__index__()
    if nbytes < 0:
        raise ValueError(f"allocation size must not be negative, got {nbytes}")
    return nbytes


def _check_pool_id(pool_id) -> tuple:
    if (not isinstance(pool_id, tuple) or len(pool_id) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in pool_id)):
        raise TypeError(f"pool id must be a tuple of two ints (as torch's MempoolId_t), got {pool_id!r}")
    return pool_id


#: torch's one_exa_bytes (CUDACachingAllocator.cpp and CUDAMallocAsyncAllocator.cpp allocate():
#: TORCH_CHECK_WITH(OutOfMemoryError, size < 1152921504606846976, ...) before the allocator runs)
_ONE_EXA_BYTES = 1 << 60


def _exabyte_error(backend_name: str) -> OutOfMemoryError:
    """torch's refusal of a request of 1 EB (2**60 bytes) or more, raised before the
    allocator runs: nothing is freed, synchronized or counted."""
    return OutOfMemoryError(f"{backend_name.upper()} out of memory. Tried to allocate more than 1EB memory.")


def _frames() -> list:
    """The caller's Python stack for a snapshot, as torch records it: innermost frame first,
    starting at the first frame outside the accel package (the user's line that allocated)."""
    return _Symbols().frames(_stack())
