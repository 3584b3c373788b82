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
import sys
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

from .. import _finalize, _lazy, _locks, backends, streams
from ..streams import on_device
from . import _async, _config, _guards, _mempool, _oom_hooks, _snapfmt
from ._caching import DeviceCachingAllocator
from ._host import HostCachingAllocator
from ._mempool import MemPool, use_mem_pool

__all__ = [
    "DeviceCachingAllocator", "HostCachingAllocator", "device_allocator", "host_allocator",
    "empty_cache", "empty_host_cache", "get_memory_info", "memory_allocated", "max_memory_allocated",
    "memory_reserved", "max_memory_reserved", "memory_stats", "reset_accumulated_memory_stats",
    "reset_peak_memory_stats", "memory_summary", "memory_snapshot", "record_history", "dump_snapshot",
    "set_per_process_memory_fraction", "get_per_process_memory_fraction", "host_memory_stats",
    "reset_peak_host_memory_stats", "reset_accumulated_host_memory_stats", "MemPool", "use_mem_pool",
    "set_allocator_settings", "get_allocator_settings", "attach_out_of_memory_observer",
    "detach_out_of_memory_observer",
]

# accel._locks.Lock: a collection inside the first allocator of a device (an allocation, a vendor
# call) may run a user's __del__ that allocates there; it gets the finalizer error, not a wait on
# a lock its own thread holds (r68i)
_lock = _locks.Lock("making a device's caching allocator")
_settings_lock = _locks.Lock("set_allocator_settings")  # one at a time (taken before _lock)
_allocators: Dict[int, DeviceCachingAllocator] = {}
_host: Optional[HostCachingAllocator] = None
_history: Optional[_snapfmt.HistoryOptions] = None    # while recording


def _reset(keep_settings: bool = False) -> None:
    global _host, _history
    with _lock:
        _allocators.clear()
        _host = None
        _guards.forget_captures()
        _config._warned.clear()      # a fresh start warns again about ignored allocator options
        if not keep_settings:        # (a forked child keeps them: process state, as torch's)
            _config._runtime = None  # the options are read from the environment again
            _oom_hooks._oom_observers.clear()
            # the history option too: a child forked before init records as the parent asked
            # (r67h: _record_memory_history() at the top of a script, then a fork: the child's
            # snapshot had no trace); its own allocators start recording when they are made
            _history = None


def _after_fork_in_child() -> None:
    # The parent's cached device memory is not usable in a forked child; forgetting
    # the allocators makes the next use go through lazy_init, which raises the
    # clear "forked subprocess" error instead of handing out the parent's pointers.
    # (_lock and _settings_lock are fresh here: accel._locks renews every Lock in a child)
    _reset(keep_settings=True)      # the options and observers are process state: the child keeps them


def _forget_stream(backend, index: int, handle: int, blocking: bool) -> bool:
    # accel.streams calls this just before destroying an owned stream (see on_stream_destroy)
    for alloc in list(_allocators.values()):
        if alloc._be is backend and not alloc.forget_stream(handle, index, blocking):
            return False
    host = _host
    if host is not None and host._be is backend and not host.forget_stream(handle, index, blocking):
        return False
    return True


def _release_unified(backend, caller) -> None:
    """The out-of-memory retry of ``caller`` (a caching allocator of ``backend``, its lock held)
    where pinned and device memory are one pool (``Backend.pinned_shares_device_memory``: Metal):
    the cached memory of the other allocators of ``backend`` goes back too, as torch's MPS
    allocator frees every cached pool, the shared buffers that back pinned memory included,
    before it reports out of memory (MPSHeapAllocatorImpl::release_cached_buffers).

    Never waits for their locks (their own retries call here holding theirs: waiting could
    deadlock): one busy keeps its cache.  Their errors (a failed free) stay theirs: the block
    stays cached and counted, for their empty_cache to report; ``caller``'s OOM is what counts."""
    others = [_host] + list(_allocators.values())
    for alloc in others:
        if alloc is None or alloc is caller or alloc._be is not backend:
            continue
        release = getattr(alloc, "release_cached_nowait", None)   # (not an AsyncPoolAllocator)
        if release is not None:
            try:
                release()
            except Exception:
                pass


_oom_hooks._release_unified = _release_unified
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
    if device_index.__class__ is int:      # (True and 1.0 hash as 1: only an int takes the fast path)
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
    # (_settings_lock first: an allocator made while set_allocator_settings runs waits for it
    # and starts with the new options)
    with _settings_lock, _lock:
        alloc = _allocators.get(device_index)
        if alloc is None:
            if _config._runtime is None:
                # read once, as torch parses its options at load: a later change of the
                # environment changes no device's options (set_allocator_settings does)
                _config._runtime = _config.current()
            # backend:cudaMallocAsync gives an AsyncPoolAllocator (same interface)
            alloc = _async.create_allocator(be, device_index, _config._runtime)
            if _history is not None:
                _start_history(alloc, _history, clear=False)
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


def _form(device_index) -> None:
    """Refuse, without counting devices or initializing, a device argument that is wrong
    whatever the device count: a wrong type (TypeError), a malformed string or a negative index
    (InvalidDeviceError).  The queries run this before init, where torch's return without
    resolving their argument: another device type or an index past the count stays a no-op
    there, and the same mistake raises before init as after."""
    from .. import _device
    if isinstance(device_index, str) or _device.is_torch_device(device_index):
        # (a torch.device as the accel.device it names, as its string: r69j, torch.device("cpu")
        # was refused where "cpu" was taken)
        index = _device.device(device_index).index
    elif isinstance(device_index, _device.device):
        index = device_index.index
    else:
        index = _device.parse_index(device_index)     # ints; TypeError for anything else
    if index is not None and index < 0:
        _device.check_range(index)                     # the error, with the valid range


def _resolve_early(device_index) -> Optional[int]:
    """The index a device argument names (None: the current device), every check done
    without initializing the runtime (devices are counted): a call that then initializes
    refuses a bad argument first, so a refused call leaves the process as it was."""
    from .. import _device
    index = _device.parse_index(device_index)
    if index is not None:
        _device.check_range(index)
    return index


def set_per_process_memory_fraction(fraction: float, device=None) -> None:
    """Cap the caching allocator of ``device`` (None: the current device) at ``fraction`` of
    the device's total memory, from now on; torch.cuda's function, with its errors.

    ``fraction`` must be a float in 0..1 (0.0 is valid: every new segment then fails):
    ``TypeError("Invalid type for fraction argument, must be `float`")`` and
    ``ValueError("Invalid fraction value: ... Allowed range: 0~1")`` otherwise.  Memory
    already reserved is kept; a request that would pass the cap frees the cache, retries,
    then raises ``accel.OutOfMemoryError`` ("... X allowed; ...").  Initializes the runtime.
    ``per_process_memory_fraction`` in ``ACCEL_ALLOC_CONF`` sets the starting value.
    A refused argument initializes nothing.
    """
    if not isinstance(fraction, float):
        raise TypeError(f"Invalid type for fraction argument, must be `float`, got "
                        f"{type(fraction).__name__} {fraction!r}")
    if not 0.0 <= fraction <= 1.0:           # NaN fails too
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    _resolve_early(device)
    _lazy.lazy_init()
    device_allocator(_index(device)).set_memory_fraction(fraction)


def set_allocator_settings(settings: str) -> None:
    """Change the caching allocator's options, on every device, from now on: torch's
    ``torch._C._accelerator_setAllocatorSettings`` (``torch.cuda.memory._set_allocator_settings``
    before torch 2.10).

    ``settings`` is written as ``ACCEL_ALLOC_CONF`` is (PyTorch's option names), e.g.
    ``"expandable_segments:False,garbage_collection_threshold:0.6"``.  As in torch, each call sets
    ``max_split_size_mb``, ``roundup_power2_divisions`` and ``garbage_collection_threshold`` back
    to their defaults unless it names them, and leaves every other option as it was unless it
    names it.  ``per_process_memory_fraction``, when named, caps every device (as
    :func:`set_per_process_memory_fraction` on each).  ``backend`` and ``policy`` cannot change
    (they may be named with their current values).

    Memory already allocated stays as it was made: segments made with expandable segments keep
    serving the requests they fit after ``expandable_segments:False`` (and go back to the device
    on :func:`empty_cache` and before a new segment is made past the cap), and classic segments
    after ``True``.  Options for ``backend:cudaMallocAsync``: only the fraction acts.

    ``AllocatorConfigError`` (a ValueError and RuntimeError) for an unknown option, a bad value
    or a change of a fixed one; TypeError for a non-str.  A refused call changes nothing.  The
    runtime is not initialized: called before it starts, the options are those every allocator
    starts with."""
    if not isinstance(settings, str):
        raise TypeError(f"set_allocator_settings() takes a str such as 'max_split_size_mb:128', "
                        f"got {type(settings).__name__} {settings!r}")
    settings = str.__str__(settings)      # a plain str: it goes into snapshots (pickled)
    with _settings_lock:
        with _lock:
            before = _config.current()
            allocators = list(_allocators.values())
        new, named = _config.changed(before, settings)
        keep_fraction = "per_process_memory_fraction" not in named
        for alloc in allocators:      # every refusal before anything changes
            _config.check_fixed(alloc.config, new)
        olds = [alloc.config for alloc in allocators]
        done = []
        try:
            for alloc in allocators:
                done.append(alloc)
                # a device's own fraction (set_per_process_memory_fraction) stays unless named
                alloc.set_config(new, keep_fraction)
            _config._runtime = new
        except BaseException:
            # (a KeyboardInterrupt) every device back to its options: all or none
            for alloc, old in zip(done, olds):
                alloc.set_config(old)
            raise


def get_allocator_settings() -> str:
    """The option string last given to :func:`set_allocator_settings`, else the one read from
    the environment (``ACCEL_ALLOC_CONF``, then ``PYTORCH_CUDA_ALLOC_CONF``, ``PYTORCH_HIP_ALLOC_CONF``,
    ``PYTORCH_ALLOC_CONF``),
    else ``""``: torch's ``torch._C._accelerator_getAllocatorSettings``."""
    return _config.current().text


#: torch.cuda.memory's name for set_allocator_settings
_set_allocator_settings = set_allocator_settings


def attach_out_of_memory_observer(observer) -> None:
    """Call ``observer(device, bytes_tried, allowed_bytes, free_bytes)`` whenever a device
    allocator raises :class:`accel.OutOfMemoryError` (after freeing its cache and retrying), on
    every device: torch's ``torch._C._cuda_attach_out_of_memory_observer``.  ``allowed_bytes`` is
    the per_process_memory_fraction's cap, or the device's total memory when there is none.

    Observers run in the allocating thread once the allocator's lock is released, in the order
    attached, before the error propagates: one may query or free memory.  An observer's own
    exception propagates instead, with the OutOfMemoryError as its ``__context__``.  The refusal
    of a request of 1 EB or more (before the cache is looked at, as torch) calls none."""
    if not callable(observer):
        raise TypeError(f"observer must be callable (device, bytes_tried, allowed_bytes, free_bytes), "
                        f"got {type(observer).__name__} {observer!r}")
    _oom_hooks._oom_observers.append(observer)


def detach_out_of_memory_observer(observer) -> None:
    """Stop calling ``observer`` (attached with :func:`attach_out_of_memory_observer`; torch has
    no detach).  ValueError when it is not attached."""
    try:
        _oom_hooks._oom_observers.remove(observer)
    except ValueError:
        raise ValueError(f"observer {observer!r} is not attached (attach_out_of_memory_observer)") from None


def _set_memory_metadata(metadata: str) -> None:
    """Record ``metadata`` as ``user_metadata`` on every memory-history entry of the current
    device from now on ("" clears it): torch.cuda.memory's ``_set_memory_metadata``.  Initializes
    the runtime (the current device's allocator)."""
    if not isinstance(metadata, str):
        raise TypeError(f"_set_memory_metadata() takes a str, got {type(metadata).__name__} {metadata!r}")
    device_allocator(_index(None)).set_user_metadata(metadata)


def _get_memory_metadata() -> str:
    """The current device's metadata set by :func:`_set_memory_metadata` ("" for none)."""
    return device_allocator(_index(None)).user_metadata()


def get_per_process_memory_fraction(device=None) -> float:
    """The fraction of ``device``'s memory its caching allocator may reserve (1.0 unless
    set by :func:`set_per_process_memory_fraction` or ``per_process_memory_fraction`` in
    ``ACCEL_ALLOC_CONF``).  Initializes the runtime, as torch's (not for a refused argument)."""
    _resolve_early(device)
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
    allocates from a private pool.  An entry of the API (accel._finalize): releases deferred
    by a collection (an Event, a Stream, a Buffer freed in it) are done first, also while no
    allocator exists yet."""
    if not _lazy.is_initialized():
        return
    if _finalize.pending:
        _finalize.drain()
    if (_config._runtime or _config.current()).backend != "cudaMallocAsync":
        # torch makes a DeviceCachingAllocator for every device at init and emptyCache walks
        # them all, each counting num_sync_all_streams; one made here touches no device
        # (cudaMallocAsync's emptyCache walks only the devices it initialized, as here)
        for index in range(_lazy.lazy_init().count()):
            if index not in _allocators:
                device_allocator(index)
    for alloc in list(_allocators.values()):
        alloc.empty_cache()


def empty_host_cache() -> None:
    """Unpin cached pinned host memory whose work has completed.  Releases deferred by a
    collection are done first (see :func:`empty_cache`)."""
    if _finalize.pending:
        _finalize.drain()
    if _host is not None:
        _host.empty_cache()


def get_memory_info(device_index=None, /) -> Tuple[int, int]:
    """(free, total) bytes of the device, as the runtime reports them; initializes (not for
    a refused argument)."""
    _resolve_early(device_index)
    be = _lazy.lazy_init()
    with on_device(be, _index(device_index)):
        return tuple(be.mem_info())


def memory_stats(device_index=None, /) -> "OrderedDict[str, Any]":
    """The allocator statistics with torch 2.13's ``torch.cuda.memory_stats()`` keys, sorted:
    123, and 12 per private pool.

    ``{allocation,segment,active,inactive_split,allocated_bytes,reserved_bytes,
    active_bytes,inactive_split_bytes,requested_bytes}.{all,small_pool,large_pool}.
    {current,peak,allocated,freed}``, ``oversize_{allocations,segments}.*``,
    ``num_alloc_retries``, ``num_ooms``, ``num_sync_all_streams``,
    ``num_device_alloc``, ``num_device_free`` (device allocations and frees: cudaMalloc and
    cudaFree, and, as torch counts them, each map and unmap of expandable-segment pages;
    :meth:`DeviceCachingAllocator.map_stats` counts the driver calls), ``max_split_size``
    (-1: unlimited), ``num_oom_rejections`` (requests refused at once under
    ``throw_on_cudamalloc_oom``), and for each private pool (MemPool or graph pool) id ``(a, b)``
    ``reserved_bytes_by_private_pools.a_b.{all,small_pool,large_pool}.{current,peak,allocated,freed}``:
    the reserved bytes of the pool's own segments (the entry of the pool that went last stays,
    current 0, until another goes or :func:`reset_accumulated_memory_stats`).
    An empty OrderedDict before the runtime is initialized (a malformed argument raises
    then too, see :func:`_form`).
    """
    if not _lazy.is_initialized():
        _form(device_index)
        return OrderedDict()
    return device_allocator(_index(device_index)).stats()


def memory_stats_as_nested_dict(device=None) -> dict:
    """:func:`memory_stats` as nested dicts (``torch.cuda.memory_stats_as_nested_dict(device=None)``,
    whose keyword it takes): ``stats["allocated_bytes"]["all"]["current"]``, scalars at the top,
    and ``reserved_bytes_by_private_pools`` keyed by pool id tuples.  ``{}`` before the runtime
    is initialized."""
    if not _lazy.is_initialized():
        _form(device)
        return {}
    alloc = device_allocator(_index(device))
    nested: dict = {}
    for key, value in alloc.stats().items():
        if key.startswith("reserved_bytes_by_private_pools."):
            continue
        *path, last = key.split(".")
        node = nested
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    nested["reserved_bytes_by_private_pools"] = alloc.private_pool_stats()
    return nested


def _stat(key: str, device_index) -> int:
    if not _lazy.is_initialized():
        _form(device_index)
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
    else:
        _form(device_index)


def reset_peak_memory_stats(device_index=None, /) -> None:
    """Set every ``peak`` to the current value."""
    if _lazy.is_initialized():
        device_allocator(_index(device_index)).reset_peak_stats()
    else:
        _form(device_index)


def memory_summary(device=None, abbreviated: bool = False) -> str:
    """A human-readable table of :func:`memory_stats` (torch's layout) of ``device`` (None:
    the current device).  Before init the table is empty and nothing is initialized; the
    argument is checked as after."""
    from ._summary import summary
    if _lazy.is_initialized():
        index = _index(device)
        stats = device_allocator(index).stats()
        name = _lazy.lazy_init().name
    else:
        index, stats = _resolve_early(device), {}
        if index is None:
            index = 0                        # the current device until init
        be = backends.select()
        name = be.name if be is not None else "accelerator"
    return summary(stats, index, name, abbreviated)


def record_history(enabled=True, context: Optional[str] = "all", stacks=True, max_entries: int = 100_000,
                   device=None, clear_history: bool = False, compile_context: bool = False,
                   global_record_annotations: bool = False, skip_actions: Optional[List[str]] = None) -> None:
    """Record allocation events, and the Python stacks behind them, on every device, for
    :func:`memory_snapshot`, :func:`dump_snapshot`, ``python -m accel.memory viz`` and torch's
    ``python -m torch.cuda._memory_viz``.  The arguments are torch 2.13's
    ``torch.cuda.memory._record_memory_history`` (also :func:`_record_memory_history`), in its
    order, with accel's defaults and spellings too:

    * ``enabled``: ``"all"`` or True records the newest ``max_entries`` events (default
      100000; torch's is sys.maxsize); ``"state"`` keeps one, for the stacks of live memory;
      None or False stops and forgets the history and every stack.
    * ``context``: which stacks are kept: ``"state"`` only those of live blocks and segments;
      ``"alloc"`` also in the trace (a free carries its allocation's stack); ``"all"`` (the
      default) a free or release carries its own caller's stack; None none.
    * ``stacks``: ``"python"``, ``"all"`` (accel has only Python frames) or True: as
      ``context`` says; False: no stacks at all.
    * ``clear_history``: forget the events recorded so far.  ``skip_actions``: action names
      not to record (``"alloc"``, ``"free_requested"``, ``"free_completed"``,
      ``"segment_alloc"``, ``"segment_free"``, ``"segment_map"``, ``"segment_unmap"``,
      ``"oom"``).
    * ``device``, ``compile_context``, ``global_record_annotations``: accepted for torch's
      signature, no effect (torch too records on every device; accel has no torch.compile
      context nor record_function annotations).

    A stack lists ``{filename, line, name}`` innermost first, from the first frame outside
    accel.  Keeping one costs about 0.12 us per frame of the caller's stack (4 us at 32
    frames; under context "all" a free walks its stack too); with history off nothing is
    walked.  Bad values raise ValueError/TypeError naming them, and change nothing.
    """
    global _history
    options = _snapfmt.history_options(enabled, context, stacks, max_entries, skip_actions)
    with _lock:
        _history = options
        allocators = list(_allocators.values())
    for alloc in allocators:
        if options is None:
            alloc.record_history(False)
        else:
            _start_history(alloc, options, clear_history)


def _start_history(alloc, options: "_snapfmt.HistoryOptions", clear: bool) -> None:
    if isinstance(alloc, DeviceCachingAllocator):
        alloc.record_history(True, options.max_entries, options.context > 0, context=options.context,
                             skip_actions=options.skip, clear_history=clear)
    else:                                    # backend:cudaMallocAsync keeps alloc/free events only
        if clear:
            alloc.record_history(False)
        alloc.record_history(True, options.max_entries, options.context > 0)


def _record_memory_history(enabled="all", *args, **kwargs) -> None:
    """torch's ``torch.cuda.memory._record_memory_history``, both forms: with ``enabled`` a
    bool, torch's legacy arguments ``(enabled, record_context=True, trace_alloc_max_entries=1,
    trace_alloc_record_context=False, device=None, record_context_cpp=False,
    clear_history=False, compile_context=False, global_record_annotations=False,
    skip_actions=None)``; else ``(enabled="all", context="all", stacks="all",
    max_entries=sys.maxsize, device=None, clear_history=False, compile_context=False,
    global_record_annotations=False, skip_actions=None)`` as :func:`record_history`."""
    if isinstance(enabled, bool):
        _record_memory_history_legacy(enabled, *args, **kwargs)
    else:
        _record_memory_history_impl(enabled, *args, **kwargs)


def _record_memory_history_legacy(enabled: bool, record_context: bool = True, trace_alloc_max_entries: int = 1,
                                  trace_alloc_record_context: bool = False, device=None,
                                  record_context_cpp: bool = False, clear_history: bool = False,
                                  compile_context: bool = False, global_record_annotations: bool = False,
                                  skip_actions: Optional[List[str]] = None) -> None:
    # torch/csrc/cuda/memory_snapshot.cpp: ALLOC when trace_alloc_record_context, else STATE
    # when record_context, else NEVER
    context = "alloc" if trace_alloc_record_context else "state" if record_context else None
    record_history(enabled, context, "python", trace_alloc_max_entries, device, clear_history,
                   compile_context, global_record_annotations, skip_actions)


def _record_memory_history_impl(enabled: Optional[str] = "all", context: Optional[str] = "all",
                                stacks: str = "all", max_entries: int = sys.maxsize, device=None,
                                clear_history: bool = False, compile_context: bool = False,
                                global_record_annotations: bool = False,
                                skip_actions: Optional[List[str]] = None) -> None:
    record_history(enabled, context, stacks, max_entries, device, clear_history, compile_context,
                   global_record_annotations, skip_actions)


def _snapshot(device=None, augment_with_fx_traces: bool = False) -> dict:
    """torch's ``torch.cuda.memory._snapshot()``: every device's segments (with blocks and
    their ``frames``), one list of trace entries per device, ``allocator_settings`` and
    ``external_annotations``; the layout is described in :mod:`accel.memory._snapfmt`.
    ``device`` and ``augment_with_fx_traces`` are accepted as torch's (torch also snapshots
    every device; accel has no FX-generated frames to augment)."""
    segments: List[dict] = []
    traces: List[list] = []
    settings = None
    if _lazy.is_initialized():
        count = _lazy.lazy_init().count()
        for index in sorted(_allocators):
            alloc = _allocators[index]
            snap = alloc.snapshot()
            segments.extend(snap["segments"])
            while len(traces) < index:
                traces.append([])
            traces.append(snap["device_traces"])
            if settings is None:
                settings = (alloc.allocator_settings() if isinstance(alloc, DeviceCachingAllocator)
                            else _snapfmt.allocator_settings(alloc.config, False))
        while len(traces) < count:
            traces.append([])
    if settings is None:      # no allocator yet: the run-time settings, if any (the environment is not parsed here)
        settings = _snapfmt.allocator_settings(_config._runtime or _config.AllocConfig(), False)
    return {"segments": segments, "device_traces": traces, "allocator_settings": settings,
            "external_annotations": []}


def _allocation_traceback(data_ptr: int) -> Optional[List[dict]]:
    """torch 2.13's ``torch.cuda.memory._allocation_traceback``: the stack (frames, innermost
    first, as in a snapshot) that allocated the live block starting at ``data_ptr`` on any
    device, or None when no device allocator holds such a block or no stack was kept for it
    (history not recorded with stacks when it was allocated: see :func:`record_history`)."""
    if not isinstance(data_ptr, int) or isinstance(data_ptr, bool):
        raise TypeError(f"data_ptr must be an int (a device address), got {type(data_ptr).__name__} {data_ptr!r}")
    for alloc in list(_allocators.values()):
        found = alloc.allocation_frames(data_ptr)
        if found is not None:
            return found
    return None


def memory_snapshot(mempool_id: Optional[Tuple[int, int]] = None, include_traces: bool = True) -> List[dict]:
    """Every segment of every device with its blocks (torch.cuda.memory_snapshot
    layout: address, total_size, allocated_size, segment_type, is_expandable, frames,
    blocks with state, requested_size and, while :func:`record_history` keeps stacks, the
    allocation's ``frames``).  With ``mempool_id`` (a :class:`MemPool`'s or graph's pool id)
    only that pool's segments, as torch 2.13 (``(0, 0)``, torch's id for none, gives every segment);
    ``include_traces`` is accepted as torch's."""
    segments = _snapshot()["segments"]
    if mempool_id is None:
        return segments
    try:
        wanted = _mempool.check_pool_id(mempool_id)    # as Graph(pool=): numpy integers too
    except (TypeError, ValueError):
        raise TypeError(f"memory_snapshot(mempool_id=...) takes a pool id, a tuple of two ints such as "
                        f"MemPool().id, got {mempool_id!r}") from None
    if wanted == (0, 0):        # torch passes (0, 0) for None: every segment (r68g)
        return segments
    return [seg for seg in segments if tuple(seg["segment_pool_id"]) == wanted]


def dump_snapshot(path) -> None:
    """Write :func:`_snapshot` to ``path`` as torch's ``_dump_snapshot`` does: a pickle
    (protocol 4, which ``python -m torch.cuda._memory_viz`` and pytorch.org/memory_viz read),
    or JSON when the name ends in ``.json``.  ``python -m accel.memory viz`` draws it."""
    _snapfmt.dump(_snapshot(), path)


def _dump_snapshot(filename="dump_snapshot.pickle", augment_with_fx_traces: bool = False) -> None:
    """torch's ``torch.cuda.memory._dump_snapshot``: :func:`dump_snapshot` with torch's
    default name (``augment_with_fx_traces`` is accepted; accel has no FX frames)."""
    dump_snapshot(filename)
