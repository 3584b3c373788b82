"""``ACCEL_ALLOC_CONF=backend:cudaMallocAsync``: device memory from the driver's stream-ordered pool.

The allocator has the interface of :class:`~accel.memory._caching.DeviceCachingAllocator`
and the semantics of torch's ``c10/cuda/CUDAMallocAsyncAllocator.cpp``:

* ``malloc(nbytes, stream)`` is ``cudaMallocAsync`` on ``stream`` from the device's default
  pool; the driver caches and reuses freed memory itself (accel keeps no blocks).
* ``free(ptr)`` is ``cudaFreeAsync`` on the allocation's stream.  When ``record_stream`` named
  other streams, an event is recorded on each of them and the allocation stream waits for it
  first, so the memory goes back to the pool only after all their work queued by then.  (torch
  frees on a per-device "unifying" side stream instead, to spare the allocation stream the
  wait; accel frees on the allocation stream, which needs no stream of its own.)
* The pool's release threshold is set to "keep everything" (``UINT64_MAX``) and the three
  reuse policies are enabled, as torch does; ``empty_cache()`` synchronizes the device and
  calls ``cudaMemPoolTrimTo(pool, 0)``.
* ``stats()`` has torch's keys: ``reserved_bytes.all`` from the pool's
  ``cudaMemPoolAttrReservedMemCurrent/High``, ``allocated_bytes.all`` and ``active_bytes.all``
  from ``UsedMemCurrent/High`` (current and peak, as torch reports them), and accel's own
  counts of allocations and requested bytes (``allocation.all.*``, ``requested_bytes.all.*``:
  torch's ``pytorch_used_bytes``), ``num_ooms``, ``num_device_alloc``/``num_device_free`` (the
  cudaMallocAsync/cudaFreeAsync calls).  The pool is the device's: memory another library
  allocates from it shows in the pool figures too.  The pool's peaks are reset when the
  allocator starts, so they count from then.
* Out of memory (the pool cannot grow, or ``per_process_memory_fraction``, from
  ``ACCEL_ALLOC_CONF`` or ``set_per_process_memory_fraction``, would be passed):
  the runtime's "last error" is cleared and :class:`accel.OutOfMemoryError` raised with
  torch's message; nothing else changes.
* ``snapshot()`` has no segments: the driver's pool keeps no blocks accel could list (torch's
  ``snapshot`` with this backend raises "not meaningful"; accel returns no segments so
  ``memory_snapshot()`` over several devices still works), but ``device_traces`` records
  alloc/free events while ``record_history`` is on.

Graph capture, as torch's allocator.  An allocation on a stream that is being captured is a
``cudaMallocAsync`` in the capture: an allocation node of the graph, whose memory is the
graph's (not the pool's: CUDA Runtime API, cudaMallocAsync), at an address fixed for the
graph's life.  Freeing it during the same capture queues ``cudaFreeAsync`` into the capture (a
free node, on the capture's own stream after the allocation's streams, so the graph stays
joined): every replay then allocates and frees it.  Any other free while a capture is
underway is deferred until none is (torch's "Avoid freeing uncaptured ptrs during CUDA graph
capture": memory made before the capture may still be used by it).  An allocation the capture
leaves allocated is an output: each replay allocates it again at the same address (graphs are
instantiated with ``cudaGraphInstantiateFlagAutoFreeOnLaunch``, as torch's, so the next replay
frees the previous one first); freeing it queues ``cudaFreeAsync`` after the last replay, or
nothing when no replay allocated it yet; what a later replay allocates again, with no owner, is
freed when the graph is reset.  ``Graph(pool=...)`` is accepted and ignored, as torch's
``beginAllocateToPool`` does with this backend; one capture at a time per device.  A peer device
gets access to the pool (``cudaMemPoolSetAccess``) through :meth:`add_peer` before it copies
from it; graph allocations keep the access the pool gave when they were captured.
``empty_cache`` also returns the graph memory no graph uses (``cudaDeviceGraphMemTrim``).
"""

from __future__ import annotations

import time
from collections import deque
from functools import partial
from typing import Dict, List, Optional, Tuple

from .._errors import AcceleratorError, CaptureError, OutOfMemoryError
from .._finalize import drain as _drain_finalizers, pending as _finalizers
from .. import _locks
from ..backends._signals import deferred as _signals_deferred
from ..streams import on_device
from . import _caching, _config, _guards, _oom_hooks, _stats, _uses
from ._requests import _ONE_EXA_BYTES, _check_pool_id, _check_size, _exabyte_error, _frames
from ._stats import ACTIVE_BYTES, ALLOCATED_BYTES, ALLOCATION, REQUESTED_BYTES, RESERVED_BYTES

__all__ = ["AsyncPoolAllocator", "create_allocator", "check_backend"]

#: cudaMemPoolAttrReleaseThreshold that keeps every freed byte in the pool (torch: UINT64_MAX)
KEEP_EVERYTHING = (1 << 64) - 1
_REUSE = ("reuse_follow_event_dependencies", "reuse_allow_opportunistic", "reuse_allow_internal_dependencies")


def check_backend(backend, index: int, config: _config.AllocConfig) -> None:
    """ValueError naming the option and the fix when ``backend`` (device ``index``) has no
    stream-ordered pool for ``backend:cudaMallocAsync``."""
    where = config.source or "ACCEL_ALLOC_CONF"
    if not getattr(backend, "supports_async_alloc", False):
        why = backend.no_async_alloc_reason
    else:
        with on_device(backend, index):
            if backend.async_alloc_supported(index):
                return
        why = (f"{backend.name} device {index} has no memory pools (cudaDevAttrMemoryPoolsSupported "
               f"is 0: a driver or platform without the stream-ordered allocator)")
    raise ValueError(f"{where}: option 'backend:cudaMallocAsync' cannot be used: {why}; remove the option "
                     f"or set backend:native (accel's caching allocator, which works on every backend)")


def create_allocator(backend, index: int, config: Optional[_config.AllocConfig] = None):
    """The device allocator ``config`` asks for (default: ``_config.current()``):
    :class:`AsyncPoolAllocator` for ``backend:cudaMallocAsync``, else a
    :class:`~accel.memory._caching.DeviceCachingAllocator`."""
    config = config if config is not None else _config.current()
    if config.backend == "cudaMallocAsync":
        return AsyncPoolAllocator(backend, index, config)
    return _caching.DeviceCachingAllocator(backend, index, config)


class _Alloc:
    """One live cudaMallocAsync allocation."""
    __slots__ = ("size", "stream", "uses", "deferred", "retry", "frames", "graph", "gen", "held", "ref")

    def __init__(self, size: int, stream: int, graph: Optional["_GraphRecord"] = None, ref=None):
        self.size = size            # bytes asked for (torch's PtrUsage.size)
        self.stream = stream        # where it is freed: the allocation stream
        self.uses = None            # set of (stream, device) and _Mark, from record_stream/forget_stream
        self.deferred = False       # freed during a capture, cudaFreeAsync not yet queued
        self.retry = False          # deferred because its free failed: the owner may free it again
        self.frames = None
        self.graph = graph          # the capture that allocated it (a graph allocation), or None
        self.gen = 0                # graph.launches when it was last freed: allocated iff fewer now
        self.held = True            # in _ptrs (its owner has not freed it)
        self.ref = ref              # a weak reference to the owner (a Buffer), or None (see free)


def _add_use(alloc: _Alloc, use: Tuple[int, int]) -> None:
    """Note the ``(stream, device)`` use on ``alloc``: its free waits for the work queued there."""
    if alloc.uses is None:
        alloc.uses = {use}
    else:
        alloc.uses.add(use)


def _owner_done(alloc: _Alloc) -> bool:
    """Whether the owner of ``alloc`` is freeing it or gone: its weak reference is dead, or the
    Buffer is closed (Buffer.close marks it closed before its free).  Unknown (no reference):
    False."""
    ref = alloc.ref
    if ref is None:
        return False
    owner = ref()
    return owner is None or getattr(owner, "_closed", False)


class _GraphRecord:
    """One capture through this allocator: the token :mod:`accel.graphs` keeps.  Holds the
    graph allocations that outlive the capture and counts the graph's launches, each of which
    allocates them again."""
    __slots__ = ("_owner", "stream", "allocs", "launches", "released", "peers")

    def __init__(self, owner: "AsyncPoolAllocator", stream: int):
        self._owner = owner
        self.stream = stream        # the capture's origin stream: frees during the capture go there
        # the devices the pool let in when the capture began: the graph's allocations keep that
        # access for good (CUDA Programming Guide, Graph Memory Nodes, "Peer Access")
        self.peers = tuple(owner._peers)
        self.allocs: Dict[int, _Alloc] = {}     # ptr -> allocation left allocated by the capture
        self.launches = 0
        self.released = False

    def replayed(self, stream: int) -> None:
        """A launch of the graph was queued on ``stream``: its allocations are allocated again,
        and a free must follow that launch."""
        self._owner._replayed(self, stream)

    def release(self) -> None:
        """The graph was destroyed: free what its launches allocated and nobody holds."""
        self._owner._release_record(self)


class _Mark:
    """An event recorded on a stream that was destroyed (forget_stream): allocations that
    used it, or were made on it, wait for it before their free; destroyed after the last."""
    __slots__ = ("event", "device", "refs", "__weakref__")    # (weakly held by Buffer._drained)

    def __init__(self, event: int, device: int):
        self.event, self.device, self.refs = event, device, 0


class AsyncPoolAllocator:
    """``backend:cudaMallocAsync`` for one device; every method is thread-safe.

    Same interface as :class:`~accel.memory._caching.DeviceCachingAllocator` (see the module
    docstring for what differs).  Construction checks the backend and the device (ValueError
    naming the option when there is no pool) and sets the pool up as torch does."""

    def __init__(self, backend, device_index: int, config: Optional[_config.AllocConfig] = None):
        config = config if config is not None else _config.current()
        check_backend(backend, device_index, config)
        self._be = backend
        self._gate_owned = _guards.gate_owned(backend)    # (_guards.probe: bounded under the gate)
        self._index = device_index
        self._config = config
        self._lock = _locks.OwnedLock()   # (to tell its holder: _guards.probe refuses re-entry)
        self._ptrs: Dict[int, _Alloc] = {}
        self._deferred: List[Tuple[int, _Alloc]] = []    # frees asked for during a capture, or failed
        self._pools: Dict[tuple, int] = {}         # private pool id -> use count (nothing routed)
        self._routes: Dict[int, tuple] = {}        # stream of begin_allocate_to_pool -> pool id
        self._capture: Optional[_GraphRecord] = None    # the capture underway on this device
        self._records: set = set()                 # graphs not released that keep allocations
        self._dead: Dict[int, List[_Alloc]] = {}   # held graph allocations whose address was reused
        self._peers: List[int] = []                # devices given access to the pool (add_peer)
        self._doomed: List[Tuple[int, int]] = []   # (event, device) whose destroy failed
        self._default_stream: Optional[int] = None
        self._history: Optional[deque] = None
        self._user_metadata = ""       # recorded with each history entry (torch's user_metadata)
        self._history_stacks = False
        self._limit: Optional[int] = None
        # accel's counters: allocations and requested bytes (current, peak, allocated, freed)
        self._count = [0, 0, 0, 0]
        self._req = [0, 0, 0, 0]
        self._scalars = {"num_alloc_retries": 0, "num_ooms": 0, "num_sync_all_streams": 0,
                         "num_device_alloc": 0, "num_device_free": 0}
        be, index = backend, device_index
        with on_device(be, index):
            # torch's lazy_init_device: keep everything in the pool, all reuse policies on
            be.mem_pool_set(index, "release_threshold", KEEP_EVERYTHING)
            for name in _REUSE:
                be.mem_pool_set(index, name, 1)
            be.mem_pool_set(index, "reserved_high", 0)     # 0 resets a high-water mark
            be.mem_pool_set(index, "used_high", 0)
            if config.per_process_memory_fraction < 1.0:
                self._limit = int(config.per_process_memory_fraction * be.mem_info()[1])

    # ------------------------------------------------------------------ public API
    @property
    def device_index(self) -> int:
        return self._index

    @property
    def config(self) -> _config.AllocConfig:
        return self._config

    def set_memory_fraction(self, fraction: float) -> None:
        """Cap the bytes this allocator hands out (torch's ``pytorch_used_bytes``) at
        ``fraction`` (0..1, checked by the caller) of the device's total from now on: torch's
        ``CudaMallocAsyncAllocator::setMemoryFraction`` (c10/cuda/CUDAMallocAsyncAllocator.cpp).
        Allocations already made stay; the next one that would pass the cap raises
        :class:`accel.OutOfMemoryError`.  1.0 removes the cap."""
        self._change_config(lambda old: old._replace(per_process_memory_fraction=float(fraction)))

    def set_config(self, config: _config.AllocConfig, keep_fraction: bool = False) -> None:
        """Use the options ``config`` from now on (:func:`accel.memory.set_allocator_settings`):
        only ``per_process_memory_fraction`` acts here (kept as it is with ``keep_fraction``), as
        the module docstring says; the backend and policy cannot change (AllocatorConfigError)."""
        _config.check_fixed(self._config, config)
        if keep_fraction:
            self._change_config(lambda old: config._replace(
                per_process_memory_fraction=old.per_process_memory_fraction))
        else:
            self._change_config(lambda old: config)

    def _change_config(self, make) -> None:
        """Replace the config by ``make(current config)``, under the lock, and the limit with it:
        both are published together (a KeyboardInterrupt leaves both old or both new)."""
        with on_device(self._be, self._index):
            total = self._be.mem_info()[1]
        with _guards.probe(self._lock, "changing the allocator's settings", self._gate_owned):
            config = make(self._config)
            fraction = config.per_process_memory_fraction
            limit = int(fraction * total) if fraction < 1.0 else None
            _locks.publish((partial(setattr, self, "_config", config), partial(setattr, self, "_limit", limit)))

    def malloc(self, nbytes: int, stream: Optional[int] = None, ref=None) -> int:
        """``cudaMallocAsync`` of ``nbytes`` on ``stream`` (a backend stream handle; None = the
        device's default stream).  Returns the pointer, 0 for ``nbytes == 0``.  ``ref`` (the
        owner's weak reference, as the caching allocator takes it) tells, at a free of an address
        two records share, which owner frees (:meth:`_freeing_live`); an owner that dies without
        freeing its memory (a KeyboardInterrupt as this returns) leaks it here.

        On a stream this device's capture (:meth:`begin_allocate_to_pool`) records, the
        allocation is a graph allocation (see the module docstring).

        TypeError/ValueError for a bad size, :class:`accel.OutOfMemoryError` when the pool
        cannot grow or the memory fraction would be passed, :class:`accel.CaptureError` on a
        stream captured by a capture not begun on this device."""
        if type(nbytes) is not int or nbytes <= 0 or nbytes >= _ONE_EXA_BYTES:
            nbytes = _check_size(nbytes)
            if nbytes == 0:
                return 0
            if nbytes >= _ONE_EXA_BYTES:     # torch's allocate() refuses first
                raise _exabyte_error(self._be.name)
        if stream is None:
            stream = self._get_default_stream()
        elif isinstance(stream, bool) or not isinstance(stream, int):
            raise TypeError(f"stream must be a backend stream handle (int), got {type(stream).__name__} "
                            f"{stream!r}; pass Stream.handle")
        elif not 0 <= stream < 1 << 64:      # the runtime binding would wrap it onto another stream
            raise ValueError(f"stream must be a backend stream handle (an int in [0, 2**64)), got {stream!r}; "
                             f"pass Stream.handle")
        if _finalizers:
            _drain_finalizers()
        try:
            with _guards.probe(self._lock, "malloc", self._gate_owned):
                capturing = self._capture_underway()
                if self._deferred and not capturing:
                    # (not strict: an earlier free's error is not this malloc's)
                    self._unless_capturing(self._flush_deferred, False)
                graph = self._capture_of(stream) if capturing else None
                if self._limit is not None and self._req[0] + nbytes > self._limit:
                    raise self._out_of_memory(nbytes)
                be = self._be
                # Interrupt safety (Ctrl-C): the record is made before the call, and the pointer is
                # recorded with plain stores as the call returns; a KeyboardInterrupt before that (as
                # on_device's exit starts) gives the allocation back.
                alloc = _Alloc(nbytes, stream, graph, ref)
                ptr = None
                try:
                    with on_device(be, self._index):
                        ptr = be.mem_alloc_async(nbytes, stream)
                except OutOfMemoryError:
                    # cudaErrorMemoryAllocation is not sticky: clear it so torch in the same process
                    # does not report it again (the backend's check cleared it already; harmless twice)
                    be.clear_error()
                    raise self._out_of_memory(nbytes) from None
                except BaseException:
                    if ptr is not None:
                        self._give_back(ptr, stream)
                    raise
                count, req = self._count, self._req
                self._scalars["num_device_alloc"] += 1
                if ptr in self._ptrs:
                    # a held graph allocation whose graph was reset before any replay allocated it:
                    # its address was given back and now reused (see free)
                    self._dead[ptr] = self._dead[ptr] + [self._ptrs[ptr]] if ptr in self._dead else [self._ptrs[ptr]]
                self._ptrs[ptr] = alloc
                if graph is not None:
                    graph.allocs[ptr] = alloc
                count[0] += 1                    # _up, inlined: plain stores, no signal check
                count[2] += 1
                if count[0] > count[1]:
                    count[1] = count[0]
                req[0] += nbytes
                req[2] += nbytes
                if req[0] > req[1]:
                    req[1] = req[0]
                if self._history is not None:
                    if self._history_stacks:
                        alloc.frames = _frames()
                    self._trace("alloc", ptr, nbytes, stream)
                return ptr
        except OutOfMemoryError as exc:
            if _oom_hooks._oom_observers and exc.observer_args is not None:     # after unlocking, as torch
                _oom_hooks._notify_oom(exc)
            raise

    def _freeing_live(self, ptr: int) -> bool:
        """At a free of ``ptr``, which a live allocation and stale records (graph outputs of a
        graph reset before any replay) share: whether the live one's owner is the one freeing,
        i.e. it is done (closed or gone) while every stale record's owner still lives (r72c:
        the stale record was forgotten in its place, and the live allocation stayed counted and
        held until the older owner went)."""
        live = self._ptrs.get(ptr)
        return (live is not None and live.ref is not None and _owner_done(live)
                and not any(_owner_done(rec) for rec in self._dead[ptr]))

    def free(self, ptr: int) -> None:
        """``cudaFreeAsync`` of ``ptr`` on its allocation stream, after that stream waits for the
        streams ``record_stream`` named; deferred while a capture is underway.  0 is a no-op.

        An allocation made in the capture underway on this device is freed in the capture
        (a free node); a graph allocation no replay allocated is only forgotten.

        A free whose device calls fail (the waits for ``record_stream``'s streams, cudaFreeAsync)
        raises their error, and the allocation waits, still counted, for the next free, malloc
        or empty_cache to try again (or this pointer's next free): the caller (a closed
        Buffer, a finalizer) may never free it again.

        ValueError naming the pointer for a double free or a pointer this allocator did not
        hand out; the allocator state is then unchanged."""
        if _finalizers:
            _drain_finalizers()
        # (the gate: no capture begins between the checks below and the queries of the free)
        with _guards.probe(self._lock, "free", self._gate_owned), self._be.capture_gate:
            if self._dead and ptr in self._dead and not self._freeing_live(ptr):
                # A stale one: forgetting it frees nothing, so whichever owner frees first, no
                # memory goes before its owner is done (at worst one stays held).
                dead = self._dead[ptr]
                done = [k for k, rec in enumerate(dead) if _owner_done(rec)]
                alloc = dead.pop(done[-1] if done else -1)
                if not dead:
                    del self._dead[ptr]
                self._forget(ptr, alloc)
                return
            alloc = self._ptrs.get(ptr)
            if alloc is None or (alloc.deferred and not alloc.retry):
                if ptr == 0 and type(ptr) is int:
                    return
                raise self._not_allocated(ptr, alloc)
            if alloc.retry:
                # its free failed before: this one tries again (now, or after the capture)
                if self._capture_underway():
                    return
                self._deferred.remove((ptr, alloc))
                alloc.deferred = alloc.retry = False
            elif self._history is not None:
                self._trace("free_requested", ptr, alloc.size, alloc.stream)
            if self._capture_underway():
                if alloc.graph is not None and alloc.graph is self._capture:
                    try:
                        self._free_in_capture(ptr, alloc)
                    except BaseException:
                        if alloc.held:      # nothing freed: tried again after the capture (r67d)
                            alloc.deferred = alloc.retry = True
                            self._deferred.append((ptr, alloc))
                        raise
                    return
                alloc.deferred = True
                self._deferred.append((ptr, alloc))
                return
            if self._deferred:
                self._flush_deferred(strict=False)
            try:
                self._free_now(ptr, alloc)
            except BaseException:
                if alloc.held:          # nothing was freed: try again later
                    alloc.deferred = alloc.retry = True
                    self._deferred.append((ptr, alloc))
                raise

    def record_stream(self, ptr: int, stream: int, device_index: Optional[int] = None) -> None:
        """Mark the allocation at ``ptr`` as used on ``stream`` (of device ``device_index``,
        default this allocator's): its free waits for the work queued there by then.  TypeError/
        ValueError for a stream that is no handle or a device index naming no device."""
        device = _uses.check_use(self._be, stream, device_index, self._index)
        _uses.check_stream_live(self._be, stream, device)
        with _guards.probe(self._lock, "record_stream", self._gate_owned):
            alloc = self._ptrs.get(ptr)
            if alloc is None or alloc.deferred:
                raise self._not_allocated(ptr, alloc)
            if stream == alloc.stream and device == self._index:
                return
            _add_use(alloc, (stream, device))

    def stream_uses(self, ptr: int) -> Tuple[List[Tuple[int, int]], List[Tuple[object, int]]]:
        """As :meth:`DeviceCachingAllocator.stream_uses <accel.memory._caching.DeviceCachingAllocator.stream_uses>`."""
        return _uses.stream_uses(self, ptr, lambda: self._ptrs.get(ptr), lambda alloc: not alloc.deferred)

    def forget_stream(self, stream: int, device_index: Optional[int] = None, blocking: bool = True) -> bool:
        """``stream`` (of device ``device_index``) is about to be destroyed: allocations made or
        used on it get an event recorded there now (or the stream is synchronized when that
        fails), and those made on it are freed on the device's default stream after that event.

        With ``blocking=False`` (a finalizer) returns False instead of waiting for the lock."""
        device = self._index if device_index is None else device_index

        def forget() -> None:
            use = (stream, device)
            every = list(self._ptrs.values())
            every += [a for rec in self._records for a in rec.allocs.values() if not a.held]
            made = [a for a in every if device == self._index and a.stream == stream]
            used = [a for a in every if a.uses and use in a.uses]
            if device == self._index:
                self._routes.pop(stream, None)
            if not made and not used:
                return
            self._drop_done_marks(made + used)
            # a stream whose work is done needs no event (r63b; see _uses.stream_done)
            mark = None if _uses.stream_done(self, stream, device) else self._cover(stream, device)
            default = self._get_default_stream()
            for alloc in made:
                alloc.stream = default
                if mark is not None:
                    alloc.uses = (alloc.uses or set()) | {mark}
                    mark.refs += 1
            for alloc in used:
                alloc.uses.discard(use)
                if mark is not None and mark not in alloc.uses:
                    alloc.uses.add(mark)
                    mark.refs += 1
        return _locks.run_locked(self._lock, blocking, forget)

    def begin_allocate_to_pool(self, pool_id: Tuple[int, int], stream: int) -> "_GraphRecord":
        """A capture begins on ``stream`` (accel.graphs).  ``pool_id`` is counted and otherwise
        ignored, as torch's beginAllocateToPool with this backend: allocations on the capture's
        streams are graph allocations (see the module docstring).  Returns the capture's token
        (``replayed(stream)`` after each launch of its graph, ``release()`` when the graph is
        destroyed).  CaptureError while another capture on this device is underway (torch:
        "Only one capture at a time is allowed in a process.")."""
        pool_id = _check_pool_id(pool_id)
        with _guards.probe(self._lock, "begin_allocate_to_pool", self._gate_owned):
            if self._routes:
                busy = next(iter(self._routes))
                raise CaptureError(f"Only one capture at a time is allowed in a process. (backend:cudaMallocAsync: "
                                   f"stream {busy:#x} of device {self._index} is being captured; end that "
                                   f"capture first)")
            self._pools[pool_id] = self._pools.get(pool_id, 0) + 1
            self._routes[stream] = pool_id
            record = self._capture = _GraphRecord(self, stream)
            self._records.add(record)
            _guards.count_captures(1)
            return record

    def end_allocate_to_pool(self, pool_id: Tuple[int, int]) -> None:
        """The capture of ``pool_id`` ended; frees deferred during it are queued once no
        capture is underway."""
        pool_id = _check_pool_id(pool_id)
        with _guards.probe(self._lock, "end_allocate_to_pool", self._gate_owned):
            for stream in [s for s, p in self._routes.items() if p == pool_id]:
                del self._routes[stream]
                _guards.count_captures(-1)
                record = self._capture
                if record is not None and record.stream == stream:
                    self._capture = None
                    if not record.allocs:
                        self._records.discard(record)    # nothing outlives the capture
            if self._deferred:
                self._unless_capturing(self._flush_deferred, False)

    def pool_used_on(self, pool_id: Tuple[int, int], stream: int, device_index: Optional[int] = None) -> None:
        """A launch of a graph of ``pool_id`` is queued on ``stream`` (accel.graphs, at every
        replay).  Nothing to note with this backend: the pool holds no memory, the graph's own
        allocations are the driver's (graph memory, freed once the executable's launches in
        flight completed: cudaGraphExecDestroy), and what a launch allocated and nobody holds is
        freed on its last launch's stream (``replayed``).  ValueError for a pool nothing holds."""
        pool_id = _check_pool_id(pool_id)
        if pool_id not in self._pools:
            raise ValueError(f"pool_used_on: no private pool {pool_id} held on device {self._index} "
                             f"(released, or never created)")

    def release_pool(self, pool_id: Tuple[int, int]) -> None:
        """A graph using ``pool_id`` was destroyed (the pool holds nothing with this backend;
        its allocations go with its token's ``release()``)."""
        pool_id = _check_pool_id(pool_id)
        with _guards.probe(self._lock, "release_pool", self._gate_owned):
            count = self._pools.get(pool_id)
            if count is None:
                raise ValueError(f"release_pool: no private pool {pool_id} on device {self._index} "
                                 f"(or it was already released)")
            if count > 1:
                self._pools[pool_id] = count - 1
            else:
                del self._pools[pool_id]

    def add_peer(self, index: int) -> None:
        """Let device ``index`` read and write this device's pool memory, now and later
        (``cudaMemPoolSetAccess``, as torch's ``enablePeerAccess`` for this backend): pool
        memory is not reached through ``cudaDeviceEnablePeerAccess``.  Call it before work on
        device ``index`` touches memory of this allocator (Buffer.copy_from does).  A no-op for
        this device itself, a device already added, and a device that cannot access this one
        directly (``cudaDeviceCanAccessPeer`` 0: the pool cannot grant it access, and copies
        between the two go through the driver's staged path, as torch only enables peers that
        can)."""
        if type(index) is not int:
            raise TypeError(f"add_peer: device index must be an int, got {type(index).__name__}")
        if index == self._index or index in self._peers:
            return
        with _guards.probe(self._lock, "add_peer", self._gate_owned):
            if index not in self._peers:
                be = self._be
                with on_device(be, self._index):
                    if be.can_access_peer(index, self._index):
                        be.mem_pool_set_access(self._index, index)
                self._peers.append(index)

    def reachable_from(self, ptr: int, index: int) -> bool:
        """Whether device ``index``, once :meth:`add_peer` let it in, reads the allocation at
        ``ptr`` directly: not a graph allocation captured before that (r72b: the copy faulted;
        copy through the driver's staged path instead).  True for memory not from here."""
        alloc = self._ptrs.get(ptr)
        if alloc is not None:
            return alloc.graph is None or index in alloc.graph.peers
        # a pointer inside one (a view, another library's array at an offset; r72g): the graph
        # allocations are few, so they are looked through
        for record in list(self._records):
            if index not in record.peers:
                for base, graph_alloc in list(record.allocs.items()):
                    if base <= ptr < base + graph_alloc.size:
                        return False
        return True

    def empty_cache(self) -> None:
        """Synchronize the device and trim its pool to 0 bytes (``cudaMemPoolTrimTo``), and its
        graph memory (``cudaDeviceGraphMemTrim``; torch leaves that to the driver): every
        unused byte goes back to the device.  Frees and event destroys that failed before are
        tried again first (their error propagates).  CaptureError while a capture is underway."""
        if _finalizers:
            _drain_finalizers()
        with _guards.probe(self._lock, "empty_cache", self._gate_owned), self._be.capture_gate:
            if self._routes or self._capture_underway():
                raise CaptureError("empty_cache() is not allowed while a stream capture is underway "
                                   f"(device {self._index}'s allocator); call it after capture_end() (a capture "
                                   "on any device blocks it: its event synchronizes and frees would invalidate "
                                   "a global-mode capture)")
            if self._deferred:
                self._flush_deferred()
            be = self._be
            with on_device(be, self._index):
                be.device_synchronize()
                self._scalars["num_sync_all_streams"] += 1
                be.mem_pool_trim(self._index, 0)
                be.graph_mem_trim(self._index)      # graph memory no graph uses (not the pool's)
            self._drop_done_marks(list(self._ptrs.values()))
            self._destroy_doomed()

    def stats(self) -> "dict":
        """The torch.cuda.memory_stats() keys (see the module docstring for their sources)."""
        if _finalizers:
            _drain_finalizers()
        be, index = self._be, self._index
        with _guards.probe(self._lock, "stats", self._gate_owned):
            pool = {name: be.mem_pool_get(index, name)
                    for name in ("reserved_current", "reserved_high", "used_current", "used_high")}
            cur, peak, allocated, freed = _stats.empty_counters()
            for stat, (c, p) in ((RESERVED_BYTES, ("reserved_current", "reserved_high")),
                                 (ALLOCATED_BYTES, ("used_current", "used_high")),
                                 (ACTIVE_BYTES, ("used_current", "used_high"))):
                cur[stat], peak[stat] = pool[c], max(pool[p], pool[c])
            for stat, counts in ((ALLOCATION, self._count), (REQUESTED_BYTES, self._req)):
                cur[stat], peak[stat], allocated[stat], freed[stat] = counts
            scalars = dict(self._scalars)
            scalars["max_split_size"] = -1
        return _stats.flatten(cur, peak, allocated, freed, scalars)

    def allocation_frames(self, ptr: int) -> None:
        """None: this backend keeps no allocation's stack outside its history (torch's
        cudaMallocAsync backend has no _allocation_traceback either)."""
        return None

    def private_pool_stats(self) -> dict:
        """``{}``: this backend's pools are the driver's (torch's cudaMallocAsync backend reports
        no reserved_bytes_by_private_pools either)."""
        return {}

    def map_stats(self) -> dict:
        """``{"num_device_map": 0, "num_device_unmap": 0}``: the pool maps nothing accel sees."""
        return {"num_device_map": 0, "num_device_unmap": 0}

    def reset_peak_stats(self) -> None:
        """Peaks become the current values: accel's counters, and the pool's high-water marks
        (set to 0, which the driver takes as "reset to current")."""
        with _guards.probe(self._lock, "reset_peak_stats", self._gate_owned):
            with on_device(self._be, self._index):
                self._be.mem_pool_set(self._index, "reserved_high", 0)
                self._be.mem_pool_set(self._index, "used_high", 0)
            self._count[1] = self._count[0]
            self._req[1] = self._req[0]

    def reset_accumulated_stats(self) -> None:
        """Zero accel's allocated/freed counters and the OOM/call counts (torch's
        cudaMallocAsync backend ignores this call; accel's counters are its own)."""
        with _guards.probe(self._lock, "reset_accumulated_stats", self._gate_owned):
            self._count[2] = self._count[3] = 0
            self._req[2] = self._req[3] = 0
            for name in self._scalars:
                self._scalars[name] = 0

    def set_user_metadata(self, metadata: str) -> None:
        """Record ``metadata`` as ``user_metadata`` with every history entry from now on."""
        if not isinstance(metadata, str):
            raise TypeError(f"metadata must be a str, got {type(metadata).__name__} {metadata!r}")
        self._user_metadata = str.__str__(metadata)      # a plain str (a subclass would go into pickles)

    def user_metadata(self) -> str:
        """What :meth:`set_user_metadata` set last ("" for none)."""
        return self._user_metadata

    def record_history(self, enabled: bool, max_entries: int = 100_000, stacks: bool = True) -> None:
        """Start (or stop) recording alloc/free events (and the Python stack of each
        allocation when ``stacks``) for :meth:`snapshot`'s ``device_traces``."""
        with _guards.probe(self._lock, "record_history", self._gate_owned):
            if enabled:
                self._history = deque(self._history or (), maxlen=max_entries)
                self._history_stacks = stacks
            else:
                self._history = None
                self._history_stacks = False
                for alloc in self._ptrs.values():
                    alloc.frames = None

    def snapshot(self) -> dict:
        """``{"segments": [], "device_traces": [...]}``: the driver's pool has no segments
        accel could list (see the module docstring)."""
        with _guards.probe(self._lock, "snapshot", self._gate_owned):
            traces = list(self._history) if self._history is not None else []
        return {"segments": [], "device_traces": traces}

    # ------------------------------------------------------------------ internals
    def _capture_underway(self) -> bool:
        return bool(self._routes) or _guards.capture_underway(self._be)

    def _capture_of(self, stream: int) -> Optional[_GraphRecord]:
        """The capture record an allocation on ``stream`` belongs to (None: the stream is not
        being captured); CaptureError for a stream captured by a capture this device's
        allocator did not see begin (another device's, or one begun outside accel.Graph)."""
        be = self._be
        if not be.captures_underway():
            return None     # (between begin_allocate_to_pool and the capture's start, as after it)
        with on_device(be, self._index):
            capture = be.capture_id(stream)
            if capture is None:
                return None
            if stream in self._routes:
                return self._capture
            if self._capture is not None and be.capture_id(self._capture.stream) == capture:
                return self._capture
        raise CaptureError(
            f"backend:cudaMallocAsync cannot allocate on stream {stream:#x} of device {self._index}: it is "
            f"being captured by a capture not begun on device {self._index} through accel.Graph, so nothing "
            f"would free the graph's allocation; allocate before the capture, or on a stream of the "
            f"capturing device")

    def _free_now(self, ptr: int, alloc: _Alloc) -> None:
        """Free outside any capture: the allocation stream waits for every use, then
        cudaFreeAsync; a graph allocation no launch allocated (since it was last freed) needs
        no device call.  On an error the allocation stays live (the waits already queued are
        harmless).

        Interrupt safety (Ctrl-C): the allocation is forgotten (dropped from the counts and the
        table) before cudaFreeAsync, as the caching allocator's vendor frees are, so a
        KeyboardInterrupt as it returns never leaves it to be freed twice (one landing as it
        starts may leave that allocation in the pool, unfreed); a free that fails puts it back."""
        graph = alloc.graph
        device_free = graph is None or graph.launches > alloc.gen
        uses, stream = alloc.uses, alloc.stream
        if device_free:
            self._queue_waits(alloc, stream)
        if graph is not None and graph.released:
            graph.allocs.pop(ptr, None)
            if not any(not a.held for a in graph.allocs.values()):
                self._records.discard(graph)
        if device_free:
            self._forget(ptr, alloc, keep_marks=True)   # its marks stay alive until the free is queued
            try:
                with on_device(self._be, self._index):
                    self._be.mem_free_async(ptr, stream)
            except Exception:
                self._unforget(ptr, alloc, uses)
                raise
            self._scalars["num_device_free"] += 1
            if graph is not None:
                alloc.gen = graph.launches
            self._drop_marks(uses)
            return
        self._forget(ptr, alloc)

    def _give_back(self, ptr: int, stream: int) -> None:
        """cudaFreeAsync of an allocation made as a KeyboardInterrupt landed, before it was
        recorded (errors swallowed: the interrupt propagates)."""
        try:
            with on_device(self._be, self._index):
                self._be.mem_free_async(ptr, stream)
        except Exception:
            self._be.clear_error()

    def _queue_waits(self, alloc: _Alloc, stream: int) -> None:
        """``stream`` waits for every use of ``alloc`` (queued again on a retry: harmless)."""
        be = self._be
        with on_device(be, self._index):
            for use in list(alloc.uses or ()):
                if type(use) is _Mark:
                    be.stream_wait_event(stream, use.event)
                elif use != (stream, self._index):
                    self._wait_for(stream, *use)

    def _unforget(self, ptr: int, alloc: _Alloc, uses) -> None:
        """Undo _forget(keep_marks=True) after a failed cudaFreeAsync: live and counted again."""
        alloc.uses = uses
        alloc.held = True
        self._ptrs[ptr] = alloc
        self._up(self._count, 1)
        self._up(self._req, alloc.size)

    def _drop_done_marks(self, allocs) -> None:
        """The marks ``allocs`` (live) hold whose events completed are dropped (the event
        destroyed with its last reference): an allocation that outlives many streams holds
        one mark per stream whose work is still queued, not one per stream it ever saw.  Not
        while a capture is underway (a query would invalidate it).

        Interrupt safety: the queries come first; the new uses, the marks' counts and the events
        left with no reference (into ``_doomed``) are published in one step (_locks.publish), and
        those events are destroyed from ``_doomed``, each leaving it only once destroyed."""
        self._unless_capturing(self._drop_marks_now, allocs)

    def _drop_marks_now(self, allocs) -> None:
        done = {}
        uses = []
        for alloc in allocs:
            marks = [use for use in (alloc.uses or ()) if type(use) is _Mark]
            gone = []
            for mark in marks:
                ok = done.get(mark)
                if ok is None:
                    ok = done[mark] = _uses.event_done(self._be, mark.event)
                if ok:
                    gone.append(mark)
            if gone:
                uses.append((alloc, alloc.uses.difference(gone), gone))
        if uses:
            self._unref([mark for _, _, gone in uses for mark in gone],
                        [partial(setattr, alloc, "uses", rest) for alloc, rest, _ in uses])

    def _drop_marks(self, uses) -> None:
        self._unref([use for use in (uses or ()) if type(use) is _Mark])

    def _unref(self, marks: list, steps: Optional[list] = None) -> None:
        """Each of ``marks`` (a mark once per reference dropped) loses a reference; the events
        left with none are destroyed.  Interrupt safety: the new counts and those events' entry
        into ``_doomed`` are published in one step with the caller's ``steps`` (_locks.publish),
        then ``_doomed`` is emptied (see _destroy_doomed); a failed destroy waits there for
        empty_cache, which reports it."""
        refs = {}
        for mark in marks:
            refs[mark] = refs.get(mark, mark.refs) - 1
        steps = list(steps or ()) + [partial(setattr, mark, "refs", n) for mark, n in refs.items()]
        doomed = [(mark.event, mark.device) for mark, n in refs.items() if n == 0]
        if doomed:
            steps.append(partial(self._doomed.extend, doomed))
        _locks.publish(steps)
        if doomed:
            try:
                self._destroy_doomed()
            except Exception:
                self._be.clear_error()

    def _forget(self, ptr: int, alloc: _Alloc, keep_marks: bool = False) -> None:
        """The owner's free is done: drop ``alloc`` from the counts (once) and its uses
        (``keep_marks``: the caller drops its marks later, _drop_marks)."""
        marks = [use for use in (alloc.uses or ()) if type(use) is _Mark] if not keep_marks else []
        alloc.uses = None
        dead = self._dead.get(ptr)
        if dead and alloc in dead:
            # a stale record forgotten another way (its deferred free): the address's next
            # owner must not take it for its own free
            dead.remove(alloc)
            if not dead:
                del self._dead[ptr]
        if alloc.held:
            mine = self._ptrs.get(ptr) is alloc
            count, req, size = self._count, self._req, alloc.size
            # published with plain stores (_down inlined: no signal check between them)
            alloc.held = False
            if mine:
                del self._ptrs[ptr]
            count[0] -= 1
            count[3] += 1
            req[0] -= size
            req[3] += size
            if self._history is not None:
                self._trace("free_completed", ptr, alloc.size, alloc.stream)
        if marks:
            self._unref(marks)

    def _free_in_capture(self, ptr: int, alloc: _Alloc) -> None:
        """A free node: cudaFreeAsync of an allocation of the capture underway, queued on the
        capture's own stream after the allocation stream and the uses that take part in the
        capture (a use outside it cannot be waited for inside: cudaErrorStreamCaptureIsolation),
        so every stream the free depends on stays joined to the capture."""
        graph = alloc.graph
        origin = graph.stream
        be = self._be
        with on_device(be, self._index):
            if alloc.stream != origin:
                self._wait_for(origin, alloc.stream, self._index)
            for use in list(alloc.uses or ()):
                if type(use) is not _Mark:
                    with on_device(be, use[1]):
                        captured = be.capture_id(use[0]) is not None
                    if captured:
                        self._wait_for(origin, *use)
            be.mem_free_async(ptr, origin)
        self._scalars["num_device_free"] += 1
        graph.allocs.pop(ptr, None)
        self._forget(ptr, alloc)

    def _replayed(self, graph: _GraphRecord, stream: int) -> None:
        # Each allocation of the graph is used by the replay on ``stream``: a use, as a
        # record_stream's, so its free waits for the replay; it is still freed on its allocation
        # stream, where work its owner queues later is ordered (r81b: moved to the replay's stream,
        # the free raced a fill on the Buffer's own stream; CUDA Runtime API, cudaFreeAsync: "The
        # allocation must not be accessed after stream execution reaches the free")
        use = (stream, self._index)
        with _guards.probe(self._lock, "a graph replay", self._gate_owned):
            graph.launches += 1
            for alloc in graph.allocs.values():
                if stream != alloc.stream:
                    _add_use(alloc, use)

    def _release_record(self, graph: _GraphRecord) -> None:
        """Free the allocations of ``graph`` a launch allocated and no owner holds (each
        attempted; the first error propagates).  One whose free fails waits in ``_deferred``
        for the next free, malloc or empty_cache: the graph forgets its token either way."""
        if _finalizers:
            _drain_finalizers()
        # (r69l: a Graph dropped by user code run inside this lock re-entered it once the lock
        # became an RLock; refused now, and _release_own keeps the record for a retry)
        with _guards.probe(self._lock, "releasing a graph's allocations", self._gate_owned):
            graph.released = True
            error = None
            for ptr, alloc in list(graph.allocs.items()):
                if alloc.held or alloc.deferred:
                    continue        # its owner frees it (after the last replay) or forgets it
                try:
                    self._free_now(ptr, alloc)
                except Exception as exc:
                    error = error or exc
                    alloc.deferred = True
                    self._deferred.append((ptr, alloc))
            if not any(not a.held for a in graph.allocs.values()):
                self._records.discard(graph)
            if error is not None:
                raise error

    def order_after(self, waiter: int, stream: int, device_index: Optional[int] = None) -> bool:
        """``waiter`` (a stream of this allocator's device) waits on the device for the work
        queued on ``stream`` (of device ``device_index``, default this allocator's) so far, as
        :meth:`DeviceCachingAllocator.order_after <accel.memory.DeviceCachingAllocator.order_after>`:
        True when queued or when ``stream`` is being captured (nothing is safe to queue), False
        when the caller must wait on the host.  The event is a temporary one, and one whose
        destroy fails waits in ``_doomed`` for empty_cache: nothing for the caller to own."""
        return _uses.order_after(self, waiter, stream, device_index, self._wait_deferred)

    def _wait_for(self, waiter: int, stream: int, device: int) -> None:
        """``waiter`` (a stream of this allocator's device) waits for the work queued on
        ``stream`` (of ``device``) so far.  The event is one of ``_doomed`` when one of that
        device is there (its destroy failed: still live, and nothing else uses it), else a new
        one; either is destroyed after the wait, so a persistently failing cudaEventDestroy keeps
        one event per device in ``_doomed``, not one per wait (r67a: 6 replays, 6 events)."""
        be = self._be
        event = self._undoom(device)
        if event is None:
            with on_device(be, device):          # cudaEventRecord: the event's and stream's device
                event = be.event_create()
        try:
            with on_device(be, device):
                be.event_record(event, stream)
            # The waiter's own device current: its handle may be 0, the legacy stream, which
            # names the current device's (r65a: the other device's legacy stream waited instead,
            # and the free was not ordered after the use)
            with on_device(be, self._index):
                be.stream_wait_event(waiter, event)
        finally:
            # an event destroyed before its work completes is released once it does
            # (CUDA Runtime API, cudaEventDestroy); the wait already holds the dependency
            self._destroy_event(event, device)

    # (a Ctrl-C as an event's create returns would lose it)
    _wait_deferred = _signals_deferred(_wait_for)

    def _cover(self, stream: int, device: int) -> Optional[_Mark]:
        """An event recorded on the dying ``stream``, or None when it could not be recorded
        but the stream was synchronized instead (its work is done)."""
        be = self._be
        with on_device(be, device):
            event = None
            try:
                event = be.event_create()
                be.event_record(event, stream)
                return _Mark(event, device)
            except Exception:
                if event is not None:
                    self._destroy_event(event, device)
                with be.capture_gate:
                    if _guards.capture_underway(be):
                        raise       # synchronizing would invalidate the capture
                    be.stream_synchronize(stream)
        return None

    def _undoom(self, device: int) -> Optional[int]:
        """An event of ``device`` taken out of ``_doomed`` to be used again, or None."""
        doomed = self._doomed
        for i in range(len(doomed) - 1, -1, -1):
            if doomed[i][1] == device:
                return doomed.pop(i)[0]
        return None

    def _destroy_event(self, event: int, device: int) -> None:
        """Destroy ``event`` of ``device``.  One the driver fails to destroy waits in ``_doomed``
        for empty_cache (where the error is reported): it runs after the wait or free it served
        was queued, so raising here would make the caller redo (or forget) work already done."""
        try:
            with on_device(self._be, device):
                self._be.event_destroy(event)
        except Exception:
            self._doomed.append((event, device))

    def _destroy_doomed(self) -> None:
        """Destroy the events in ``_doomed`` (a mark's last reference gone, or a destroy that
        failed before); the first error propagates and leaves the rest for the next empty_cache.
        Each is taken out just before its destroy, with the device set (a destroyed handle must
        never stay, to be destroyed again: the runtime may have given its value to a new event;
        an interrupt exactly as the destroy starts may lose that one, as everywhere in the
        allocators), and put back when the destroy fails."""
        be = self._be
        while self._doomed:
            event, device = self._doomed[-1]
            with on_device(be, device):
                del self._doomed[-1]
                try:
                    be.event_destroy(event)
                except Exception:
                    self._doomed.append((event, device))
                    raise

    def _unless_capturing(self, fn, *args) -> None:
        """``fn(*args)`` unless a capture is underway (this allocator's routes count: see
        _capture_underway), with no capture beginning in between (Backend.capture_gate): its
        queries and frees would invalidate one."""
        with self._be.capture_gate:
            if not self._capture_underway():
                fn(*args)

    def _flush_deferred(self, strict: bool = True) -> None:
        """Queue the frees deferred during a capture or after a failure.  One that fails
        stays deferred; the first error propagates when ``strict``."""
        deferred, self._deferred = self._deferred, []
        error = None
        for ptr, alloc in deferred:
            try:
                self._free_now(ptr, alloc)
            except Exception as exc:
                self._deferred.append((ptr, alloc))
                error = error or exc
            else:
                # no longer waiting: a graph allocation a later launch allocates again is then
                # freed by the graph's release (which skips deferred ones)
                alloc.deferred = alloc.retry = False
        if error is not None and strict:
            raise error

    @staticmethod
    def _up(counts: list, n: int) -> None:
        counts[0] += n
        counts[2] += n
        if counts[0] > counts[1]:
            counts[1] = counts[0]

    @staticmethod
    def _down(counts: list, n: int) -> None:
        counts[0] -= n
        counts[3] += n

    def _get_default_stream(self) -> int:
        if self._default_stream is None:
            self._default_stream = self._be.default_stream(self._index)
        return self._default_stream

    def _trace(self, action: str, addr: int, size: int, stream: int) -> None:
        self._history.append({"action": action, "addr": addr, "size": size, "stream": stream,
                              "compile_context": "", "user_metadata": self._user_metadata,
                              "time_us": time.monotonic_ns() // 1000, "pool_id": (0, 0)})

    def _not_allocated(self, ptr, alloc) -> Exception:
        if type(ptr) is not int:
            return TypeError(f"pointer must be an int, got {type(ptr).__name__} {ptr!r}")
        if alloc is not None:
            why = ("its cudaFreeAsync failed and is tried again at the next free, malloc or empty_cache"
                   if alloc.retry else "its cudaFreeAsync waits for the capture underway to end")
            return ValueError(f"pointer {ptr:#x} was already freed (double free; {why}) on device {self._index}")
        return ValueError(f"pointer {ptr:#x} is not allocated (double free?) or was not allocated by the "
                          f"cudaMallocAsync allocator of device {self._index} (foreign or interior pointer)")

    def _out_of_memory(self, nbytes: int) -> OutOfMemoryError:
        """Count an OOM of ``nbytes`` and return the error to raise (its observer arguments set)."""
        self._scalars["num_ooms"] += 1
        try:
            with on_device(self._be, self._index):
                free, total = self._be.mem_info()
        except AcceleratorError:   # the report must not hide the OOM itself
            free = total = 0
        err = OutOfMemoryError(self._oom_message(nbytes, free, total))
        err.observer_args = (self._index, nbytes, self._limit if self._limit is not None else total, free)
        return err

    def _oom_message(self, nbytes: int, free: int, total: int) -> str:
        fmt = _stats.format_size
        limit = fmt(self._limit) if self._limit is not None else "none (per_process_memory_fraction 1.0)"
        return (f"{self._be.name.upper()} out of memory. Allocation on device {self._index} would exceed "
                f"allowed memory. (out of memory)\n"
                f"Currently allocated     : {fmt(self._req[0])}\n"
                f"Requested               : {fmt(nbytes)}\n"
                f"Device limit            : {fmt(total)}\n"
                f"Free (according to {self._be.name.upper()}): {fmt(free)}\n"
                f"accel limit (set by per_process_memory_fraction in ACCEL_ALLOC_CONF or "
                f"set_per_process_memory_fraction)\n"
                f"                        : {limit}\n"
                f"Free memory that is no longer needed, or call accel.memory.empty_cache() to return the "
                f"pool's unused memory to the device.")
