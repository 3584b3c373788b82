"""``accel.memory``: the caching allocators and ``torch.accelerator.memory``.

Other layers allocate through::

    alloc = accel.memory.device_allocator(device_index)   # per device, lazily created
    ptr = alloc.malloc(nbytes, stream)                     # stream: backend stream handle
    alloc.record_stream(ptr, other_stream); alloc.free(ptr)
    alloc.begin_allocate_to_pool(pool_id, stream) / end_allocate_to_pool(pool_id) / release_pool(pool_id)
    host = accel.memory.host_allocator()                   # pinned host memory, process-wide

The query functions follow ``torch.accelerator.memory``: they take
``device_index`` (an int, a string such as ``"cuda:0"``, an ``accel.device``,
or None for the current device) positionally, and none of them initializes
the runtime: before initialization ``memory_stats()`` is an empty
``OrderedDict`` and the scalar queries return 0.  ``get_memory_info``
initializes, as torch's does.

The allocator is configured with ``ACCEL_ALLOC_CONF`` (PyTorch option names;
see :mod:`accel.memory._config`).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

from .. import _lazy, backends, streams
from ..streams import on_device
from . import _async, _caching, _config
from ._caching import DeviceCachingAllocator
from ._host import HostCachingAllocator

__all__ = [
    "DeviceCachingAllocator", "HostCachingAllocator", "device_allocator", "host_allocator",
    "empty_cache", "empty_host_cache", "get_memory_info", "memory_allocated", "max_memory_allocated",
    "memory_reserved", "max_memory_reserved", "memory_stats", "reset_accumulated_memory_stats",
    "reset_peak_memory_stats", "memory_summary", "memory_snapshot", "record_history", "dump_snapshot",
    "set_per_process_memory_fraction", "get_per_process_memory_fraction", "host_memory_stats",
    "reset_peak_host_memory_stats", "reset_accumulated_host_memory_stats",
]

_lock = threading.Lock()
_allocators: Dict[int, DeviceCachingAllocator] = {}
_host: Optional[HostCachingAllocator] = None
_history: Optional[Tuple[int, bool]] = None    # (max_entries, stacks) while recording


def _reset() -> None:
    global _host, _history
    with _lock:
        _allocators.clear()
        _host = None
        _history = None
        _caching._forget_captures()
        _config._warned.clear()      # a fresh start warns again about ignored allocator options


def _after_fork_in_child() -> None:
    # The parent's cached device memory is not usable in a forked child; forgetting
    # the allocators makes the next use go through lazy_init, which raises the
    # clear "forked subprocess" error instead of handing out the parent's pointers.
    global _lock
    _lock = threading.Lock()
    _reset()


def _forget_stream(backend, index: int, handle: int, blocking: bool) -> bool:
    # accel.streams calls this just before destroying an owned stream (see on_stream_destroy)
    for alloc in list(_allocators.values()):
        if alloc._be is backend and not alloc.forget_stream(handle, index, blocking):
            return False
    host = _host
    if host is not None and host._be is backend and not host.forget_stream(handle, index, blocking):
        return False
    return True


_lazy.register_reset_hook(_reset)
os.register_at_fork(after_in_child=_after_fork_in_child)
streams.on_stream_destroy(_forget_stream)


def device_allocator(device_index: int) -> DeviceCachingAllocator:
    """The caching allocator of device ``device_index`` (created, and the runtime
    initialized, on first use).  ValueError for an index that names no device, or
    for ``backend:cudaMallocAsync`` on a backend or device without a memory pool.

    With ``ACCEL_ALLOC_CONF=backend:cudaMallocAsync`` it is an
    :class:`~accel.memory._async.AsyncPoolAllocator` (the same interface, over the
    driver's stream-ordered pool)."""
    alloc = _allocators.get(device_index)
    if alloc is not None:
        return alloc
    if isinstance(device_index, bool) or not hasattr(type(device_index), "__index__"):
        raise TypeError(f"device_allocator() takes an int device index, got {device_index!r}")
    device_index = device_index.__index__()     # numpy integers too
    be = _lazy.lazy_init()
    count = be.count()
    if not 0 <= device_index < count:
        raise ValueError(f"device index {device_index} is out of range: {count} {be.name} "
                         f"device(s) visible (valid indices 0..{count - 1})")
    with _lock:
        alloc = _allocators.get(device_index)
        if alloc is None:
            # backend:cudaMallocAsync gives an AsyncPoolAllocator (same interface)
            alloc = _async.create_allocator(be, device_index)
            if _history is not None:
                alloc.record_history(True, *_history)
            _allocators[device_index] = alloc
    return alloc


def host_allocator() -> HostCachingAllocator:
    """The process-wide pinned host caching allocator."""
    global _host
    if _host is None:
        with _lock:
            if _host is None:
                _host = HostCachingAllocator()
    return _host


def _index(device_index) -> int:
    from .. import _device
    return _device.checked_index(device_index, optional=True)


def set_per_process_memory_fraction(fraction: float, device=None) -> None:
    """Cap the caching allocator of ``device`` (None: the current device) at ``fraction`` of
    the device's total memory, from now on; torch.cuda's function, with its errors.

    ``fraction`` must be a float in 0..1 (0.0 is valid: every new segment then fails):
    ``TypeError("Invalid type for fraction argument, must be `float`")`` and
    ``ValueError("Invalid fraction value: ... Allowed range: 0~1")`` otherwise.  Memory
    already reserved is kept; a request that would pass the cap frees the cache, retries,
    then raises ``accel.OutOfMemoryError`` ("... X allowed; ...").  Initializes the runtime.
    ``per_process_memory_fraction`` in ``ACCEL_ALLOC_CONF`` sets the starting value.
    """
    _lazy.lazy_init()
    index = _index(device)
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if not 0.0 <= fraction <= 1.0:           # NaN fails too
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    alloc = device_allocator(index)
    setter = getattr(alloc, "set_memory_fraction", None)
    if setter is None:
        raise NotImplementedError(
            f"set_per_process_memory_fraction: the {type(alloc).__name__} (backend:"
            f"{alloc.config.backend}) reads per_process_memory_fraction only at start; set "
            f"ACCEL_ALLOC_CONF=backend:{alloc.config.backend},per_process_memory_fraction:{fraction} instead")
    setter(fraction)


def get_per_process_memory_fraction(device=None) -> float:
    """The fraction of ``device``'s memory its caching allocator may reserve (1.0 unless
    set by :func:`set_per_process_memory_fraction` or ``per_process_memory_fraction`` in
    ``ACCEL_ALLOC_CONF``).  Initializes the runtime, as torch's."""
    _lazy.lazy_init()
    return float(device_allocator(_index(device)).config.per_process_memory_fraction)


def host_memory_stats() -> "OrderedDict[str, Any]":
    """The pinned host allocator's statistics with torch 2.13's keys, flattened and sorted:
    ``{allocations,allocated_bytes,active_requests,active_bytes}.{current,peak,allocated,freed}``
    (blocks owned, their bytes, blocks handed out, their bytes), ``num_host_alloc``,
    ``num_host_free`` and ``{host_alloc_time,host_free_time}.{total,max,min,count,avg}``
    (microseconds).  An empty OrderedDict before the runtime is initialized, as torch's."""
    if not _lazy.is_initialized():
        return OrderedDict()
    flat = []
    for key, value in host_allocator().torch_stats().items():
        if isinstance(value, dict):
            flat.extend((f"{key}.{sub}", v) for sub, v in value.items())
        else:
            flat.append((key, value))
    return OrderedDict(sorted(flat))


def reset_peak_host_memory_stats() -> None:
    """Set every ``peak`` of :func:`host_memory_stats` to the current value."""
    host_allocator().reset_peak_stats()


def reset_accumulated_host_memory_stats() -> None:
    """Zero the ``allocated``/``freed`` counters and the timings of :func:`host_memory_stats`."""
    host_allocator().reset_accumulated_stats()


def empty_cache() -> None:
    """Return unused cached device memory of every device to the runtime.

    No-op before initialization.  ``accel.CaptureError`` while a graph capture
    allocates from a private pool."""
    if not _lazy.is_initialized():
        return
    for alloc in list(_allocators.values()):
        alloc.empty_cache()


def empty_host_cache() -> None:
    """Unpin cached pinned host memory whose work has completed."""
    if _host is not None:
        _host.empty_cache()


def get_memory_info(device_index=None, /) -> Tuple[int, int]:
    """(free, total) bytes of the device, as the runtime reports them; initializes."""
    be = _lazy.lazy_init()
    with on_device(be, _index(device_index)):
        return tuple(be.mem_info())


def memory_stats(device_index=None, /) -> "OrderedDict[str, Any]":
    """The allocator statistics with ``torch.cuda.memory_stats()``'s 122 keys, sorted.

    ``{allocation,segment,active,inactive_split,allocated_bytes,reserved_bytes,
    active_bytes,inactive_split_bytes,requested_bytes}.{all,small_pool,large_pool}.
    {current,peak,allocated,freed}``, ``oversize_{allocations,segments}.*``,
    ``num_alloc_retries``, ``num_ooms``, ``num_sync_all_streams``,
    ``num_device_alloc``, ``num_device_free``, ``max_split_size`` (-1: unlimited).
    An empty OrderedDict before the runtime is initialized.
    """
    if not _lazy.is_initialized():
        return OrderedDict()
    return device_allocator(_index(device_index)).stats()


def _stat(key: str, device_index) -> int:
    if not _lazy.is_initialized():
        return 0
    return memory_stats(device_index).get(key, 0)


def memory_allocated(device_index=None, /) -> int:
    """Bytes currently allocated (``allocated_bytes.all.current``); 0 before init."""
    return _stat("allocated_bytes.all.current", device_index)


def max_memory_allocated(device_index=None, /) -> int:
    """Peak allocated bytes since start or the last reset_peak_memory_stats."""
    return _stat("allocated_bytes.all.peak", device_index)


def memory_reserved(device_index=None, /) -> int:
    """Bytes held by the caching allocator (``reserved_bytes.all.current``)."""
    return _stat("reserved_bytes.all.current", device_index)


def max_memory_reserved(device_index=None, /) -> int:
    """Peak reserved bytes since start or the last reset_peak_memory_stats."""
    return _stat("reserved_bytes.all.peak", device_index)


def reset_accumulated_memory_stats(device_index=None, /) -> None:
    """Zero the ``allocated``/``freed`` counters and the retry/OOM/call counts."""
    if _lazy.is_initialized():
        device_allocator(_index(device_index)).reset_accumulated_stats()


def reset_peak_memory_stats(device_index=None, /) -> None:
    """Set every ``peak`` to the current value."""
    if _lazy.is_initialized():
        device_allocator(_index(device_index)).reset_peak_stats()


def memory_summary(device=None, abbreviated: bool = False) -> str:
    """A human-readable table of :func:`memory_stats` (torch's layout)."""
    from ._summary import summary
    if _lazy.is_initialized():
        index = _index(device)
        stats = device_allocator(index).stats()
        name = _lazy.lazy_init().name
    else:
        index, stats = 0, {}
        be = backends.select()
        name = be.name if be is not None else "accelerator"
    return summary(stats, index, name, abbreviated)


def record_history(enabled: bool = True, *, max_entries: int = 100_000, stacks: bool = True) -> None:
    """Record allocation events (and Python stacks of allocations when ``stacks``)
    on every device, for :func:`memory_snapshot` and ``python -m accel.memory viz``."""
    global _history
    if isinstance(max_entries, bool) or not hasattr(type(max_entries), "__index__"):
        raise TypeError(f"record_history: max_entries must be an int >= 1, got "
                        f"{type(max_entries).__name__} {max_entries!r}")
    max_entries = max_entries.__index__()
    if max_entries < 1:
        raise ValueError(f"record_history: max_entries must be >= 1, got {max_entries}; pass the number of "
                         f"allocation events to keep (default 100000)")
    with _lock:
        _history = (max_entries, bool(stacks)) if enabled else None
        allocators = list(_allocators.values())
    for alloc in allocators:
        alloc.record_history(enabled, max_entries, stacks)


def _snapshot() -> dict:
    segments: List[dict] = []
    traces: List[list] = []
    if _lazy.is_initialized():
        for index in sorted(_allocators):
            snap = _allocators[index].snapshot()
            segments.extend(snap["segments"])
            while len(traces) < index:
                traces.append([])
            traces.append(snap["device_traces"])
    return {"segments": segments, "device_traces": traces}


def memory_snapshot() -> List[dict]:
    """Every segment of every device with its blocks (torch.cuda.memory_snapshot
    layout: address, total_size, allocated_size, segment_type, blocks with state and,
    while :func:`record_history` is on, the allocation's ``frames``)."""
    return _snapshot()["segments"]


def dump_snapshot(path: str) -> None:
    """Write segments and recorded history as JSON for ``python -m accel.memory viz``."""
    import json
    with open(path, "w") as fh:
        json.dump(_snapshot(), fh)
