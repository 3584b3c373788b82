"""Addresses of host Python buffers, for copies the runtime performs.

Uses a bare ``_cffi_backend.FFI`` (no declarations, no parser): only the
built-in C types are needed to take a buffer's address and move bytes.
"""

from __future__ import annotations

import functools
import operator
import sys
import weakref

# Imported here, not in the destructors: a pinned array kept in __main__'s globals dies at
# interpreter exit after sys.modules["accel"] was cleared when multiprocessing (torch imports
# it) aliased __main__ as __mp_main__ after accel, and an import there fails (r68c).
from . import _finalize

_ffi = None


def _get_ffi():
    global _ffi
    if _ffi is None:
        import _cffi_backend
        _ffi = _cffi_backend.FFI()
    return _ffi


def address_of(view) -> int:
    """Address of the first byte of a contiguous buffer (kept alive by the caller)."""
    ffi = _get_ffi()
    return int(ffi.cast("uintptr_t", ffi.from_buffer(view)))


def copy_into(address: int, view) -> None:
    """Copy the bytes of ``view`` to host memory at ``address``."""
    ffi = _get_ffi()
    ffi.memmove(ffi.cast("void *", address), view, view.nbytes)


class _Token:
    """Stands for the owner of a pinned block while the allocator holds a weak reference to it
    (see HostCachingAllocator.malloc's ``ref``)."""

    __slots__ = ("__weakref__",)


def _pinned_destructor(be, host, ptr: int, pid: int, token, _cdata) -> None:
    """The destructor of a pinned array's owning cdata (``token``: kept alive until it runs)."""
    try:
        _finalize.finalize(_free_pinned, be, host, ptr, pid)
    except KeyboardInterrupt:
        _finalize.RAISE_AGAIN[_finalize.interrupt_key()]     # a Ctrl-C handled in here reaches the program (r62)


def _free_pinned(backend, host, ptr: int, pid: int, wait: bool = False) -> None:
    """An empty_pinned array's release.  ``backend`` first: accel._finalize drops it for a runtime
    reset since; nothing in a forked child (the block and its events are the parent's runtime's).
    A finalizer never waits for the lock (this thread may hold it: see
    DeviceCachingAllocator.free_nowait): a busy one defers the free to the next safe point."""
    if pid != _finalize.pid:
        return
    if wait:
        host.free(ptr)
    elif not host.free_nowait(ptr):
        _finalize.defer(_free_pinned, backend, host, ptr, pid, True)


def empty_pinned(shape, dtype="uint8"):
    """A new, uninitialized numpy array of ``shape`` and ``dtype`` in pinned (page-locked)
    host memory from accel's host caching allocator, so copies to and from the device can
    run asynchronously (``Buffer.copy_to(out, non_blocking=True)``), as torch's
    ``torch.empty(..., pin_memory=True)``.  The memory returns to the cache when the array
    and every view of it are gone.  Initializes the runtime."""
    import numpy as np
    from . import memory
    try:
        dtype = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"empty_pinned: {exc}; pass a numpy dtype such as numpy.float32 or 'uint8'") from None
    if dtype.hasobject:
        raise TypeError(f"empty_pinned cannot hold dtype {dtype} (Python object references); use a plain dtype")
    if dtype.itemsize == 0 and dtype.names is None:
        raise TypeError(f"empty_pinned: dtype {dtype} has itemsize 0 (an unsized flexible type); pass a sized "
                        f"one such as 'S8' or 'U4'; nothing was allocated")
    try:
        # __index__ only, as numpy: int() truncated 2.5 to 2 and parsed "3"; bools are refused
        ndim = getattr(shape, "ndim", None)             # a 0-d integer array is one dimension
        scalar = ndim == 0 or (ndim is None and (not hasattr(shape, "__iter__") or isinstance(shape, (str, bytes))))
        dims = (shape,) if scalar else tuple(shape)
        if any(isinstance(n, (bool, np.bool_)) for n in dims):
            raise TypeError
        shape = tuple(operator.index(n) for n in dims)
    except TypeError:
        raise TypeError(f"empty_pinned: shape must be an int or a tuple of ints, got {shape!r}; "
                        f"nothing was allocated") from None
    if any(n < 0 for n in shape):
        raise ValueError(f"empty_pinned: negative dimension in shape {shape}")
    count = 1
    for n in shape:
        count *= n
    nbytes = count * dtype.itemsize
    if nbytes > sys.maxsize:
        raise ValueError(f"empty_pinned: array is too big: shape {shape} of {dtype} needs {nbytes} bytes, more "
                         f"than an array can index ({sys.maxsize}); nothing was allocated")
    host = memory.host_allocator()
    if not nbytes:
        # nothing to pin: torch's CachingHostAllocator::allocate(0) returns a null pointer and
        # counts no block (a 0-byte array pinned a 512-byte block before, in the stats too)
        return np.empty(shape, dtype)
    # The allocator keeps a weak reference to `token` with the block, and the destructor below
    # keeps `token` alive: should the block outlive them (a Ctrl-C as malloc returns, or as the
    # destructor starts), the host allocator's empty_cache frees it.
    token = _Token()
    ptr = host.malloc(nbytes, weakref.ref(token))
    ffi = _get_ffi()
    # The cdata owns the block: numpy's base chain (array -> buffer -> cdata) keeps it alive
    # for every view, and its destructor frees it through the finalizer path (no lock wait).
    owner = ffi.gc(ffi.cast("char *", ptr), functools.partial(_pinned_destructor, host._be, host, ptr,
                                                               _finalize.pid, token))
    # a subarray dtype such as ('f4', (2,)) adds its dimensions, as numpy.empty
    items = count * (dtype.itemsize // dtype.base.itemsize if dtype.base.itemsize else 1)
    return np.frombuffer(ffi.buffer(owner, nbytes), dtype=dtype.base, count=items).reshape(shape + dtype.shape)
