"""accel: the ``torch.accelerator`` API in pure Python over vendor runtimes.

Device queries, streams, events, graphs, a caching allocator and Philox RNG,
with the names and semantics of ``torch.accelerator``.  Nothing is built: the
vendor libraries (libcudart + NVML, Level Zero, Metal) are bound at run time
with generated cffi declarations.  ``ACCEL_SIM=cuda|xpu|mps`` runs everything
on a simulated runtime when there is no device.

Importing accel opens no library and initializes no runtime; counting devices
does not initialize either, so a process may still ``fork`` afterwards.
"""

from __future__ import annotations

import threading
import warnings
from typing import Optional

from . import _exit, _lazy, backends as _backends
from ._device import DeviceLike, check_range, device, device_index as _device_index, parse_index as _parse_index
from ._errors import (AcceleratorError, CaptureError, CompileError, DeferredCallError, InvalidDeviceError,
                      KernelImageError, OutOfMemoryError)
from ._lazy import is_initialized
from .buffer import Buffer
from .streams import (Event, ExternalStream, Stream, current_stream, default_stream, get_stream_from_external,
                      on_device as _on_device, set_stream)

__version__ = "0.1.0"

_exit.keep_imports_at_exit()     # a user's __del__ at interpreter exit may still call into accel

__all__ = [
    "AcceleratorError", "Buffer", "CaptureError", "DeferredCallError", "Event", "ExternalStream", "Graph",
    "InvalidDeviceError",
    "KernelImageError",
    "OutOfMemoryError", "Stream", "current_accelerator", "current_device_idx", "current_device_index",
    "current_stream", "default_stream", "device", "device_count", "device_index", "empty_pinned",
    "get_device_capability", "get_device_properties", "get_stream_from_external", "graph", "is_available",
    "is_current_stream_capturing", "is_initialized",
    "memory", "random", "set_device_idx", "set_device_index", "set_stream", "synchronize",
]

# Submodules and names loaded on first use, so `import accel` stays small and numpy-free.
_LAZY = {"memory": ("accel.memory", None), "random": ("accel.random", None),
         "graphs": ("accel.graphs", None), "Graph": ("accel.graphs", "Graph"),
         "graph": ("accel.graphs", "graph"), "sim": ("accel.sim", None),
         "empty_pinned": ("accel._hostmem", "empty_pinned"), "ArrayView": ("accel._array", "ArrayView")}
__all__.append("ArrayView")
_LAZY["from_dlpack"] = ("accel._dlpack", "from_dlpack")    # DLPack in: a non-owning Buffer
__all__.append("from_dlpack")
# torch.cuda's management-library queries (NVML / Sysman) and peer access: accel/_telemetry.py
_TELEMETRY = ("can_device_access_peer", "clock_rate", "device_memory_used", "list_gpu_processes",
              "memory_usage", "power_draw", "temperature", "utilization")
_LAZY.update({name: ("accel._telemetry", name) for name in _TELEMETRY})
__all__ += list(_TELEMETRY)
# torch 2.13 re-exports torch.accelerator.memory's functions at torch.accelerator.*
_MEMORY = ("empty_cache", "empty_host_cache", "get_memory_info", "max_memory_allocated", "max_memory_reserved",
           "memory_allocated", "memory_reserved", "memory_stats", "reset_accumulated_memory_stats",
           "reset_peak_memory_stats")
_LAZY.update({name: ("accel.memory", name) for name in _MEMORY})
__all__ += list(_MEMORY)
# torch.cuda.MemPool / torch.cuda.use_mem_pool: accel/memory/_mempool.py
_LAZY.update(MemPool=("accel.memory", "MemPool"), use_mem_pool=("accel.memory", "use_mem_pool"))
__all__ += ["MemPool", "use_mem_pool"]
# CUDA C++ -> PTX through NVRTC (issue 18): accel/compiler.py.  `compile` shadows the builtin
# inside this module only, as re.compile does.
_LAZY["compile"] = ("accel.compiler", "compile")
__all__ += ["compile", "CompileError"]
# issue 18: user kernels (accel/kernels)
_LAZY.update(Module=("accel.kernels", "Module"), Kernel=("accel.kernels", "Kernel"),
             launch=("accel.kernels", "launch"))
__all__ += ["Module", "Kernel", "launch"]


def __getattr__(name):
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'accel' has no attribute {name!r}") from None
    import importlib
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def device_count() -> int:
    """Number of devices of the current accelerator; 0 without one.  Never initializes the runtime."""
    chosen = _backends.select()
    return chosen.count() if chosen is not None else 0


def is_available() -> bool:
    """True when the current accelerator has at least one device.  Never initializes the runtime."""
    return device_count() > 0


def current_accelerator(check_available: bool = False) -> Optional[device]:
    """The accelerator type as ``device('cuda')`` (no index), or None.

    As a CUDA build of torch on a machine without a GPU, the type is that of
    the first runtime whose library loads even when it has no device;
    ``check_available=True`` returns None in that case.
    """
    chosen = _backends.select()
    if chosen is None:
        if check_available:
            return None
        chosen = _backends.fallback()
        if chosen is None:
            return None
    elif check_available and chosen.count() == 0:
        return None
    return device(chosen.name)


def current_device_index() -> int:
    """Index of the calling thread's current device (initializes the runtime)."""
    return _lazy.lazy_init().get_device()


def set_device_index(device: DeviceLike, /) -> None:
    """Make ``device`` the calling thread's current device.  A negative index is a no-op, as torch."""
    index = _device_index(device)
    if index < 0:
        return
    backend = _lazy.lazy_init()
    check_range(index)
    backend.set_device(index)


def current_device_idx() -> int:
    """Deprecated alias of :func:`current_device_index`."""
    warnings.warn("Use `current_device_index` instead.", FutureWarning, stacklevel=2)
    return current_device_index()


def set_device_idx(device: DeviceLike, /) -> None:
    """Deprecated alias of :func:`set_device_index`."""
    warnings.warn("Use `set_device_index` instead.", FutureWarning, stacklevel=2)
    set_device_index(device)


class device_index:
    """Context manager making ``device`` current in its body and restoring the previous device.

    ``device_index(None)`` does nothing.  ``__enter__`` returns None, as torch's.  One object
    may be entered again while entered (nested, or by another thread): each exit restores
    the device its own thread's innermost entry saved.
    """

    def __init__(self, device: DeviceLike, /):
        self.idx = None if device is None else _device_index(device)
        self.prev_idx = -1
        self._saved = []    # (thread id, previous index) of each entry not yet exited

    def __enter__(self) -> None:
        if self.idx is not None and self.idx >= 0:
            backend = _lazy.lazy_init()
            check_range(self.idx)
            self.prev_idx = previous = backend.get_device()
            # torch's exchangeDevice: a device only recorded current (below) is made current now
            if previous != self.idx or backend.device_deferred():
                backend.set_device(self.idx)
            self._saved.append((threading.get_ident(), previous))

    def __exit__(self, *exc) -> None:
        me = threading.get_ident()
        for i in range(len(self._saved) - 1, -1, -1):
            if self._saved[i][0] == me:
                previous = self._saved.pop(i)[1]
                backend = _lazy.lazy_init()
                # torch's maybeExchangeDevice(prev_idx): back to the saved device whatever the body
                # did; on CUDA one without a primary context is only recorded (restore_device)
                if backend.get_device() != previous:
                    backend.restore_device(previous)
                return


_capabilities: dict = {}


def get_device_properties(device: DeviceLike = None):      # torch.cuda's: device= works
    """The :class:`accel.backends.DeviceProperties` of ``device`` (initializes the runtime)."""
    _parse_index(device)            # a refused argument starts nothing (torch checks it first, r69j)
    backend = _lazy.lazy_init()
    index = _device_index(device, optional=True)
    check_range(index)
    return backend.properties(index)


def get_device_capability(device: DeviceLike = None, /) -> dict:
    """What ``device`` supports: ``supported_dtypes`` (numpy dtype names, torch's key), plus
    ``compute_capability``, ``name``, ``total_memory`` and ``multi_processor_count``.  Cached."""
    _parse_index(device)            # a refused argument starts nothing (torch checks it first, r69j)
    backend = _lazy.lazy_init()
    index = _device_index(device, optional=True)
    key = (backend.name, index)
    cached = _capabilities.get(key)
    if cached is None:
        props = get_device_properties(index)
        cached = _capabilities[key] = {
            "supported_dtypes": set(props.supported_dtypes),
            "compute_capability": props.compute_capability,
            "name": props.name,
            "total_memory": props.total_memory,
            "multi_processor_count": props.multi_processor_count,
        }
    return {k: (set(v) if isinstance(v, set) else v) for k, v in cached.items()}


def is_current_stream_capturing() -> bool:
    """True when the calling thread's current stream is being captured into a graph
    (``torch.cuda.is_current_stream_capturing``).  False before the runtime is initialized
    (no capture can have begun), without initializing it."""
    if not _lazy.is_initialized():
        return False
    return current_stream().is_capturing()


def synchronize(device: DeviceLike = None, /) -> None:
    """Wait for all work on ``device`` (all its streams).  A no-op before the runtime is
    initialized; the argument is checked first either way, as torch's (``synchronize("cpu")``
    is a ValueError before initialization as after, and ``synchronize()`` with no device
    available a RuntimeError)."""
    if not _lazy.is_initialized():
        # torch resolves the device before its no-op check: the current one needs a device
        if _parse_index(device) is None and not is_available():
            raise RuntimeError(_lazy._NO_DEVICE)
        if _lazy.is_in_bad_fork() and _parse_index(device) is None:
            # torch's current-device lookup initializes (the fork error); with an index its
            # _accelerator_synchronizeDevice returns at once, since the child's at-fork handler
            # marks the device as never initialized (set_requires_device_init(kCUDA, true)) (r70e)
            _lazy.lazy_init()
        return
    backend = _lazy.lazy_init()
    index = _device_index(device, optional=True)
    check_range(index)
    from . import _finalize
    if _finalize.pending:
        _finalize.drain()     # a safe point: e.g. a collected graph's capture ends before this waits
    with _on_device(backend, index):
        backend.device_synchronize()


_lazy.register_reset_hook(_capabilities.clear)
