"""Reference implementations of device kernels, run by the simulators.

A simulated "module load" only parses kernel names out of the source (PTX
``.entry NAME``, MSL ``kernel void NAME``); launching a kernel runs the
Python function registered here under that name, in the stream's worker, in
stream order::

    from accel.sim import kernels

    def fill(grid, block, view, out, n, value):
        import numpy as np
        view(out, n * 4, np.uint32)[:] = value

    kernels.register("my_fill_u32", ("ptr", "u64", "u32"), fill)

``fn(grid, block, view, *args)``: ``grid``/``block`` are ``(x, y, z)``
tuples, ``view`` is :func:`view`, and ``args`` are the launch arguments
decoded with ``argtypes`` (``"ptr"`` arguments arrive as int addresses).
The reference computes the whole result at once; it need not loop over
blocks.

:func:`lookup` imports ``accel.sim.philox_kernels`` (and the other modules
in :data:`PROVIDERS`) on first use, so those register themselves lazily.
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import Callable, Dict, NamedTuple, Optional, Sequence, Tuple

from . import _memory
from .core import ffi

#: Argument C types a kernel may take (same set as accel.backends.base.KERNEL_ARG_TYPES).
ARG_TYPES = ("ptr", "u32", "i32", "u64", "i64", "f32", "f64")
_ARG_CTYPES = {
    "ptr": ffi.typeof("uintptr_t *"), "u32": ffi.typeof("uint32_t *"), "i32": ffi.typeof("int32_t *"),
    "u64": ffi.typeof("uint64_t *"), "i64": ffi.typeof("int64_t *"), "f32": ffi.typeof("float *"),
    "f64": ffi.typeof("double *"),
}
_VOIDPP = ffi.typeof("void **")

#: Modules that register kernels when imported; imported by the first lookup.
PROVIDERS = ("accel.sim.philox_kernels",)


class MemoryRangeError(ValueError):
    """A reference kernel touched memory outside every live simulated allocation
    (the simulator reports it as cudaErrorIllegalAddress)."""


class MisalignedAddress(MemoryRangeError):
    """A reference kernel read typed elements at an address that is not a multiple of their
    size (CUDA: cudaErrorMisalignedAddress, "the device encountered a load or store instruction
    on a memory address which is not aligned"; Metal, setBuffer:offset:atIndex: "align the offset
    to the data type's size")."""


class Kernel(NamedTuple):
    name: str
    argtypes: Tuple[str, ...]
    fn: Callable


_registry: Dict[str, Kernel] = {}
_lock = threading.Lock()
_providers_loaded = False
#: Serializes the providers' import: the flag is set only once they are registered, so a
#: second thread's lookup waits for them instead of finding nothing (r15).  Reentrant: a
#: provider's import may itself look a kernel up.
_providers_lock = threading.RLock()


def _fresh_lock_in_child() -> None:
    # A parent thread may have held the lock while forking; it does not exist in the child.
    global _lock, _providers_lock
    _lock = threading.Lock()
    _providers_lock = threading.RLock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)


def register(name: str, argtypes: Sequence[str], fn: Callable, *, replace: bool = False) -> None:
    """Register ``fn`` as the reference of kernel ``name`` taking ``argtypes``.

    Registering the same function again is a no-op; a *different* function
    under a taken name raises ValueError unless ``replace=True``.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"kernel name must be a C identifier, got {name!r}")
    argtypes = tuple(argtypes)
    bad = [a for a in argtypes if a not in _ARG_CTYPES]
    if bad:
        raise ValueError(f"kernel {name}: unknown argument type(s) {bad}; expected some of {ARG_TYPES}")
    if not callable(fn):
        raise TypeError(f"kernel {name}: fn must be callable, got {fn!r}")
    with _lock:
        old = _registry.get(name)
        if old is not None and not replace and not _same_function(old.fn, fn):
            raise ValueError(f"kernel {name!r} is already registered by "
                             f"{getattr(old.fn, '__module__', '?')}.{getattr(old.fn, '__qualname__', '?')}; "
                             "pass replace=True to override it")
        _registry[name] = Kernel(name, argtypes, fn)


def _same_function(a, b) -> bool:
    return a is b or (getattr(a, "__module__", None) == getattr(b, "__module__", 0)
                      and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", 0))


def unregister(name: str) -> None:
    """Forget kernel ``name`` (no error if it is not registered)."""
    with _lock:
        _registry.pop(name, None)


def _load_providers() -> None:
    global _providers_loaded
    if _providers_loaded:
        return
    with _providers_lock:
        if _providers_loaded:
            return
        for mod in PROVIDERS:
            try:
                importlib.import_module(mod)
            except ModuleNotFoundError as exc:
                if exc.name != mod:   # the provider exists but one of its imports is missing
                    raise
        _providers_loaded = True


def lookup(name: str) -> Optional[Kernel]:
    """The registered :class:`Kernel` called ``name``, or None."""
    k = _registry.get(name)
    if k is None and not _providers_loaded:
        _load_providers()
        k = _registry.get(name)
    return k


def names() -> Tuple[str, ...]:
    """Every registered kernel name (providers loaded)."""
    _load_providers()
    return tuple(sorted(_registry))


def matches(kernel: Kernel, declared: Sequence[str]) -> bool:
    """True when the reference's argument types read the same bytes as the kernel's declared
    parameters (same count; pointers and 64-bit integers alike, signed and unsigned alike)."""
    from accel._ptx import compatible
    return len(kernel.argtypes) == len(declared) and all(
        compatible(a, b) for a, b in zip(kernel.argtypes, declared))


def decode_args(kernel: Kernel, argv) -> tuple:
    """Read the launch arguments from a ``void **`` array (cdata or address), one per argtype."""
    if not kernel.argtypes:
        return ()
    if _memory.addr_of(argv) == 0:
        raise ValueError(f"kernel {kernel.name} takes {len(kernel.argtypes)} argument(s) but args is NULL")
    arr = ffi.cast(_VOIDPP, argv)
    out = []
    for i, t in enumerate(kernel.argtypes):
        p = arr[i]
        if p == ffi.NULL:
            raise ValueError(f"kernel {kernel.name}: argument {i} ({t}) pointer is NULL")
        out.append(ffi.cast(_ARG_CTYPES[t], p)[0])
    return tuple(out)


def _check_range(ptr: int, nbytes: int) -> None:
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    a = _memory.find_any(ptr)
    if a is None:
        raise MemoryRangeError(f"0x{ptr:x} is not inside a live simulated allocation")
    if ptr + nbytes > a.end:
        raise MemoryRangeError(f"range 0x{ptr:x}+{nbytes} runs {ptr + nbytes - a.end} byte(s) past the end of "
                         f"the {a.size}-byte allocation at 0x{a.base:x}")


def view(ptr: int, nbytes: int, dtype=None):
    """A writable view of ``nbytes`` of simulated memory at ``ptr``.

    Returns a ``memoryview`` of bytes, or with ``dtype`` a numpy array of
    ``nbytes // itemsize`` elements sharing the memory.  ValueError when the
    range is not inside one live simulated allocation (device or pinned).
    """
    ptr = _memory.addr_of(ptr)
    _check_range(ptr, nbytes)
    return view_checked_range(ptr, nbytes, dtype)


def view_checked_range(ptr: int, nbytes: int, dtype=None):
    """:func:`view` of a range the caller checked (a simulator's own rules: peer access, virtual
    memory): a typed view refuses a misaligned address as a device does."""
    buf = ffi.buffer(_memory.char_ptr(ptr), nbytes)
    if dtype is None:
        return memoryview(buf)
    import numpy as np
    dt = np.dtype(dtype)
    if ptr % dt.base.itemsize:
        raise MisalignedAddress(f"0x{ptr:x} is not aligned for {dt} ({dt.base.itemsize}-byte elements)")
    return np.frombuffer(buf, dtype=dt, count=nbytes // dt.itemsize)


def read(ptr: int, nbytes: int) -> bytes:
    """A copy of ``nbytes`` of simulated memory at ``ptr`` (range-checked like :func:`view`)."""
    ptr = _memory.addr_of(ptr)
    _check_range(ptr, nbytes)
    return ffi.buffer(_memory.char_ptr(ptr), nbytes)[:]


def write(ptr: int, data) -> None:
    """Copy ``data`` (bytes-like) into simulated memory at ``ptr`` (range-checked)."""
    ptr = _memory.addr_of(ptr)
    data = memoryview(data).cast("B")
    _check_range(ptr, data.nbytes)
    ffi.memmove(_memory.char_ptr(ptr), data, data.nbytes)


# -- a tiny kernel of our own, to test the launch path -------------------------

def _test_fill_u32(grid, block, view, out, n, value):
    """accel_test_fill_u32(ptr out, u64 n, u32 value): out[i] = value for i < n."""
    import numpy as np
    view(out, n * 4, np.uint32)[:] = value


register("accel_test_fill_u32", ("ptr", "u64", "u32"), _test_fill_u32)

#: PTX text that declares the test kernel (for module-load tests).
TEST_PTX = b"""//
// accel simulator test module
.version 8.0
.target sm_90
.address_size 64

.visible .entry accel_test_fill_u32(
    .param .u64 out,
    .param .u64 n,
    .param .u32 value
)
{
    ret;
}
"""
