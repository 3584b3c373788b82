"""Pinned (page-locked) host caching allocator, as torch's CachingHostAllocator.

Blocks come from ``Backend.host_alloc`` (cudaHostAlloc, zeMemAllocHost, a
shared MTLBuffer) in power-of-two sizes and are cached by size after
``free``.

torch 2.13's two limits (``pinned_max_round_threshold_mb``, ``pinned_max_cached_size_mb``,
read from the allocator options in effect at each call, :mod:`accel.memory._config`): a
request above either is not rounded at all (a request at most both is rounded up to a power
of two, ``PowerOf2Ceil``, with no minimum: 100 bytes take a 128-byte block); such a block is
cached in the list of its size's power of two (torch's ``size_index``, ``Log2_64_Ceil``) and
handed only to a request it is at least as large as.  A block above the
cache limit is not cached: once free and its streams' work done, it goes back to the driver
(at once, or as soon as no capture is underway: the next malloc, free or empty_cache).

A block used by asynchronous copies is tied to those streams with
``record_stream``; at ``free`` an event is recorded on each such stream and
the block is reused only after all of them completed.

Events belong to a device and cudaEventRecord needs the event and the stream
on the same one, so events are kept per device and created with the stream's
device current; ``record_stream`` takes the stream's device (default: the
current one).  As in the device allocator, a stream about to be destroyed is
forgotten (``forget_stream``), events are neither queried nor recorded while
a capture is underway, and frees that need events wait until it ended.
"""

from __future__ import annotations

import time
from bisect import bisect_right, insort
from functools import partial
from typing import Dict, List, Optional

from .. import _locks
from . import _config, _oom_hooks
from .._errors import OutOfMemoryError
from .._finalize import drain as _drain_finalizers, pending as _finalizers, releases_settled as _releases_settled
from ..streams import on_device
from ._requests import _ONE_EXA_BYTES, _check_size
from ._guards import capture_underway, gate_owned, probe, unless_capturing
from ._uses import (add_use, check_stream_live, check_use, cover, drop_done_gates, gates_back, record_uses,
                    stream_done, uses_forgotten)

#: torch 2.13's host_memory_stats counters (torch/cuda/memory.py): blocks owned (active +
#: cached), their bytes, blocks handed out, their bytes; each current/peak/allocated/freed
_TORCH_STATS = ("allocations", "allocated_bytes", "active_requests", "active_bytes")


def _bucket(size: int) -> int:
    """The free list of a block of ``size`` bytes: the power of two at or above it (torch's
    ``size_index``); a power-of-two block's is its own size."""
    return 1 << (size - 1).bit_length()


class _HostBlock:
    __slots__ = ("ptr", "size", "bucket", "allocated", "uses", "events", "holds", "ref")

    def __init__(self, ptr, size):
        self.ptr = ptr
        self.size = size
        self.bucket = _bucket(size)       # the key of its free list in HostCachingAllocator._free
        self.allocated = True
        self.uses = None
        self.events = 0
        self.holds = None     # CaptureHolds of graphs whose captured copies read or write it
        self.ref = None       # while allocated: a weak reference to the owner (see _reap_orphans)


class CaptureHold:
    """The pinned blocks the copies captured into one graph read or write (torch's host
    allocator keeps such a block from reuse too: ``TestCachingHostAllocatorCudaGraph``).

    Every replay copies from or into them again, so a held block freed by its owner is
    parked, not reused; each replay's stream becomes a use of the block, and when the
    graph is released (:meth:`release`) the block waits for those uses as after any copy."""

    __slots__ = ("_owner", "device", "blocks")

    def __init__(self, owner: "HostCachingAllocator", device: int):
        self._owner = owner
        self.device = device
        self.blocks: set = set()

    def replayed(self, stream: int) -> None:
        """A replay of the graph was queued on ``stream`` (of the hold's device)."""
        if self.blocks:
            self._owner._hold_replayed(self, stream)

    def release(self) -> None:
        """The graph is gone: its blocks follow the normal free path (idempotent)."""
        if self.blocks:
            self._owner._release_hold(self)


def _counted(tally: list, delta: int) -> list:
    """A torch host_memory_stats counter (current, peak, allocated, freed) changed by ``delta``,
    as a new list: the caller stores it with one subscript (no call, see malloc)."""
    cur, peak, allocated, freed = tally
    cur += delta
    if delta > 0:
        allocated += delta
        peak = max(peak, cur)
    else:
        freed -= delta
    return [cur, peak, allocated, freed]


class HostCachingAllocator:
    """Process-wide pinned host allocator; thread-safe.  See the module docstring."""

    def __init__(self, backend=None):
        self._be = backend
        self._lock = _locks.OwnedLock()   # (to tell its holder: _guards.probe refuses re-entry)
        self._blocks: Dict[int, _HostBlock] = {}
        self._starts: List[int] = []                   # sorted block starts (owns bisects them)
        self._free: Dict[int, List[int]] = {}          # bucket (_bucket) -> ptrs ready for reuse
        # cached blocks past pinned_max_cached_size, to unpin as soon as no capture is underway
        # (_trim; an entry whose block was reused or unpinned since is skipped)
        self._oversize: List[_HostBlock] = []
        self._env_config = None                        # the environment's options (see _limits)
        self._events: List[tuple] = []                 # (event, device, block)
        # freed during a capture (events not recorded yet), or with a use whose event could be
        # neither recorded nor waited for (retried at the next malloc and empty_cache)
        self._deferred: List[_HostBlock] = []
        self._used_on: Dict[int, set] = {}             # stream -> blocks whose uses name it
        self._parked: set = set()                      # freed blocks a graph's captured copies hold
        self._event_cache: Dict[int, List[int]] = {}   # device -> completed events for reuse
        self._stats = {"allocated_bytes": 0, "reserved_bytes": 0, "allocations": 0,
                       "segments": 0, "num_host_alloc": 0, "num_host_free": 0}
        self._tally = {key: [0, 0, 0, 0] for key in _TORCH_STATS}   # current, peak, allocated, freed
        self._timing = {"host_alloc_time": [0, 0, 0, 0],             # total, max, min, count (µs)
                        "host_free_time": [0, 0, 0, 0]}

    def _limits(self) -> tuple:
        """(pinned_max_round_threshold, pinned_max_cached_size) in bytes, of the options in effect:
        the last ``set_allocator_settings``, else the environment's (read once per allocator, as
        the device allocators read it once)."""
        config = _config._runtime
        if config is None:
            config = self._env_config
            if config is None:
                config = self._env_config = _config.from_environment()
        return config.pinned_max_round_threshold, config.pinned_max_cached_size

    def _gate_owned(self) -> bool:
        """Whether this thread holds the backend's capture gate (_guards.probe: a call made
        under it waits for the pinned lock a bounded time, r70g)."""
        be = self._be
        return be is not None and gate_owned(be)()

    def _backend(self):
        if self._be is None:
            from .. import _lazy
            self._be = _lazy.lazy_init()
        return self._be

    def malloc(self, nbytes: int, ref=None) -> int:
        """Pinned host memory of at least ``nbytes`` (0 for 0 bytes); OutOfMemoryError
        when the backend cannot pin more even after the cache was released, or at once for
        1 EB (2**60 bytes) or more, as the device allocator."""
        nbytes = _check_size(nbytes)
        if nbytes == 0:
            return 0
        if nbytes >= _ONE_EXA_BYTES:    # past 2**63 the runtime's size_t argument would overflow
            from .. import _lazy
            name = (self._be if self._be is not None else _lazy.backend()).name.upper()
            raise OutOfMemoryError(f"{name} out of memory. Tried to allocate more than 1EB of pinned "
                                   f"host memory ({nbytes} bytes requested).")
        max_round, max_cached = self._limits()
        if nbytes <= max_round and nbytes <= max_cached:
            size = 1 << (nbytes - 1).bit_length()
        else:                      # torch: not rounded, cached in its power of two's list
            size = nbytes
        be = self._backend()
        if _finalizers:            # releases finalizers left for a safe point (accel._finalize)
            _drain_finalizers()
        with probe(self._lock, "pinned malloc", self._gate_owned):
            if self._events or self._deferred or self._oversize:
                unless_capturing(be, self._resume_events, False)
            # Interrupt safety (Ctrl-C): the new counts are computed first and published with
            # plain stores (CPython checks for a signal only after a call), the one call that
            # changes state last; a new block is recorded as the backend call returns.
            stats, tally = self._stats, self._tally
            requests = _counted(tally["active_requests"], 1)
            ready = self._free.get(_bucket(size))
            i = len(ready) - 1 if ready else -1
            # the last one cached that is large enough: in a power-of-two list, a power-of-two
            # block is, a smaller unrounded one (cached above the round threshold) may not be
            while i >= 0 and self._blocks[ready[i]].size < size:
                i -= 1
            if i >= 0:
                ptr = ready[i]
                block = self._blocks[ptr]
                active = _counted(tally["active_bytes"], block.size)
                del ready[i]
                block.allocated = True
                block.ref = ref
                stats["allocated_bytes"] += block.size
                stats["allocations"] += 1
                tally["active_requests"] = requests
                tally["active_bytes"] = active
                return ptr
            active = _counted(tally["active_bytes"], size)
            block = _HostBlock(0, size)
            block.allocated = True
            block.ref = ref
            allocations = _counted(tally["allocations"], 1)
            allocated = _counted(tally["allocated_bytes"], size)
            try:
                start = time.perf_counter()
                ptr = be.host_alloc(size)
            except OutOfMemoryError:
                be.clear_error()            # handled: no stale error for another library
                with be.capture_gate:       # (no capture begins before the frees)
                    if capture_underway(be):
                        raise               # cudaFreeHost would invalidate the capture
                    self._reap_orphans()
                    self._release_free()
                    if be.pinned_shares_device_memory and _oom_hooks._release_unified is not None:
                        # Metal: the device allocators' cached segments hold the same memory (r73g)
                        _oom_hooks._release_unified(be, self)
                if size > nbytes:
                    # the rounding is for reuse only: the size asked for may still fit where its
                    # power of two does not (Metal: past maxBufferLength, the most one MTLBuffer
                    # holds; r73g); cached in its power of two's list, as an unrounded block is
                    size = nbytes
                    active = _counted(tally["active_bytes"], size)
                    block = _HostBlock(0, size)
                    block.allocated = True
                    block.ref = ref
                allocations = _counted(tally["allocations"], 1)
                allocated = _counted(tally["allocated_bytes"], size)
                start = time.perf_counter()
                ptr = be.host_alloc(size)   # a second failure propagates
            # recorded as the call returns, with no call before the insort
            block.ptr = ptr
            self._blocks[ptr] = block
            stats["reserved_bytes"] += size
            stats["segments"] += 1
            stats["num_host_alloc"] += 1
            stats["allocated_bytes"] += size
            stats["allocations"] += 1
            tally["allocations"] = allocations
            tally["allocated_bytes"] = allocated
            tally["active_requests"] = requests
            tally["active_bytes"] = active
            insort(self._starts, ptr)
            self._time("host_alloc_time", start)
            return ptr

    def free(self, ptr: int) -> None:
        """Return ``ptr`` to the cache (0 is a no-op).  ValueError for a double free
        or a pointer this allocator did not hand out; the state is then unchanged."""
        if _finalizers:
            _drain_finalizers()
        with probe(self._lock, "pinned free", self._gate_owned):
            self._free_ptr_locked(ptr)

    def free_nowait(self, ptr: int) -> bool:
        """:meth:`free` for a finalizer, which never waits for the lock: False, nothing done,
        when it is busy (see DeviceCachingAllocator.free_nowait); the caller defers."""
        return _locks.run_locked(self._lock, False, self._free_ptr_locked, ptr)

    def _free_ptr_locked(self, ptr: int) -> None:
        block = self._blocks.get(ptr)
        if block is None or not block.allocated:
            if ptr == 0 and type(ptr) is int:
                return
            raise self._not_allocated(ptr, block)
        self._free_locked(block)

    def _free_locked(self, block: _HostBlock) -> None:
        """free() of an allocated ``block``, the lock held."""
        # computed first, published with plain stores, the one call last (see malloc)
        ptr = block.ptr
        stats, tally = self._stats, self._tally
        requests = _counted(tally["active_requests"], -1)
        active = _counted(tally["active_bytes"], -block.size)
        ready = self._free.get(block.bucket)
        over = block.size > self._limits()[1]
        block.allocated = False
        block.ref = None
        stats["allocated_bytes"] -= block.size
        stats["allocations"] -= 1
        tally["active_requests"] = requests
        tally["active_bytes"] = active
        if block.holds:
            self._parked.add(block)         # a graph's replays still copy from or into it
        elif not block.uses:
            if ready is None:
                self._free[block.bucket] = [ptr]
            else:
                ready += (ptr,)
            if over:                        # past the cache limit: unpinned now (or after a capture)
                self._oversize += (block,)
                unless_capturing(self._be, self._trim)
        else:
            self._deferred += (block,)      # waits there until its events are recorded
            # (see _guards: no events during a capture); a failure raises, the block stays deferred
            unless_capturing(self._be, self._insert_events, block)
            if self._oversize:              # (its uses were waited for: none to wait for now)
                unless_capturing(self._be, self._trim)

    def release_cached_nowait(self) -> bool:
        """Unpin the cached blocks whose work has completed, for a device allocator's
        out-of-memory retry on a backend whose pinned memory is device memory
        (accel.memory._release_unified).  Never waits: False, nothing done, when the lock is busy
        (see DeviceCachingAllocator.release_cached_nowait)."""
        return _locks.run_locked(self._lock, False, self._release_cached)

    def _release_cached(self) -> None:
        be = self._be
        if be is None:
            return
        with be.capture_gate:
            if capture_underway(be):
                return          # cudaFreeHost would invalidate the capture
            self._reap_orphans()
            if self._events or self._deferred or self._oversize:
                self._resume_events(False)
            self._release_free()

    def _reap_orphans(self) -> None:
        """Free the allocated blocks whose owner (weakly referenced by malloc's ``ref``: an
        empty_pinned array's memory owner, a copy's staging token) is gone without freeing
        them, the lock held: a KeyboardInterrupt as malloc returned, or as the owner's
        destructor started (see DeviceCachingAllocator._reap_orphans, also for why only when
        no release can be on its way)."""
        orphans = [b for b in self._blocks.values() if b.ref is not None and b.allocated and b.ref() is None]
        if orphans and _releases_settled():
            for block in orphans:
                self._free_locked(block)

    def owns(self, address: int, nbytes: int) -> Optional[int]:
        """The block start when ``[address, address + nbytes)`` lies inside one allocated
        pinned block of this allocator, else None (e.g. pageable memory)."""
        with probe(self._lock, "pinned owns", self._gate_owned):
            starts = self._starts
            i = bisect_right(starts, address) - 1     # blocks never overlap: the last start <= address
            if i >= 0:
                ptr = starts[i]
                block = self._blocks[ptr]
                if block.allocated and address + nbytes <= ptr + block.size:
                    return ptr
        return None

    def record_stream(self, ptr: int, stream: int, device_index: Optional[int] = None) -> None:
        """The allocated block at ``ptr`` is used by work on ``stream`` (of device
        ``device_index``, default the current device): after :meth:`free` it waits
        for that work before being reused.  TypeError/ValueError for a stream that is no
        handle or a device index naming no device (nothing is recorded)."""
        be = self._backend()
        device = check_use(be, stream, device_index, None)
        if device is None:
            device = be.get_device()
        check_stream_live(be, stream, device)
        with probe(self._lock, "pinned record_stream", self._gate_owned):
            block = self._blocks.get(ptr)
            if block is None or not block.allocated:
                raise self._not_allocated(ptr, block)
            add_use(self, block, stream, device)

    def capture_hold(self, device: int) -> CaptureHold:
        """A new, empty hold for the copies one graph capture makes (see :class:`CaptureHold`)."""
        return CaptureHold(self, device)

    def hold(self, ptr: int, hold: CaptureHold) -> None:
        """The allocated block at ``ptr`` is read or written by a copy captured into ``hold``'s graph."""
        with probe(self._lock, "pinned hold", self._gate_owned):
            block = self._blocks.get(ptr)
            if block is None or not block.allocated:
                raise self._not_allocated(ptr, block)
            if block.holds is None:
                block.holds = {hold}
            else:
                block.holds.add(hold)
            hold.blocks.add(block)

    def _hold_replayed(self, hold: CaptureHold, stream: int) -> None:
        with probe(self._lock, "pinned hold", self._gate_owned):
            for block in hold.blocks:
                add_use(self, block, stream, hold.device)

    def _release_hold(self, hold: CaptureHold) -> None:
        with probe(self._lock, "pinned hold release", self._gate_owned):
            blocks, hold.blocks = hold.blocks, set()
            error = None
            for block in blocks:
                block.holds.discard(hold)
                if block.holds:
                    continue
                block.holds = None
                if block.allocated or block not in self._parked:
                    continue                # its free takes the normal path
                # out of _parked and into its free list or _deferred in one step (no call)
                parked = self._parked - {block}
                ready = self._free.get(block.bucket)
                over = block.size > self._limits()[1]
                self._parked = parked
                if not block.uses:
                    if ready is None:
                        self._free[block.bucket] = [block.ptr]
                    else:
                        ready += (block.ptr,)
                    if over:
                        self._oversize += (block,)
                    continue
                self._deferred += (block,)
                try:
                    unless_capturing(self._be, self._insert_events, block)
                except Exception as exc:    # the block waits in _deferred; the others go on
                    error = error or exc
            if self._oversize:
                unless_capturing(self._be, self._trim)
            if error is not None:
                raise error

    def forget_stream(self, stream: int, device_index: int, blocking: bool = True) -> bool:
        """``stream`` of device ``device_index`` is about to be destroyed (its handle may
        name the next stream): blocks it used wait for an event recorded on it now.
        Returns False, doing nothing, when ``blocking`` is False and the lock is busy."""
        return _locks.run_locked(self._lock, blocking, self._forget_stream, stream, device_index)

    def _forget_stream(self, stream: int, device_index: int) -> None:
        # Every event first, then the uses replaced: when neither an event nor a wait covers
        # one use, the stream stays alive and may queue more work on every block it used, so
        # no use is replaced (the events recorded so far go back to the cache).  The uses are
        # replaced in one step (_locks.publish): a KeyboardInterrupt leaves all or none.
        covers = [(block, use) for block in self._used_on.get(stream, ())
                  for use in (block.uses or ()) if type(use) is tuple and use[0] == stream]
        gates = []
        done = []
        try:
            idle = bool(covers) and stream_done(self, stream, device_index)
            for _, use in covers:
                gates.append(None if idle and use[1] == device_index else cover(self, stream, use[1], gates))
            _locks.publish(uses_forgotten(self, stream, covers, gates) + [partial(done.append, True)])
        except BaseException:
            if not done:
                gates_back(self, gates)
            raise

    def empty_cache(self) -> None:
        """Unpin every cached block whose work has completed (never waits).  Does nothing
        while a capture is underway (event queries and cudaFreeHost would invalidate it)."""
        if _finalizers:
            _drain_finalizers()
        be = self._be
        if be is None:
            return
        with probe(self._lock, "empty_host_cache", self._gate_owned), be.capture_gate:
            if capture_underway(be):
                return
            self._reap_orphans()
            try:
                self._resume_events(strict=True)
            finally:
                self._release_free()
            drop_done_gates(self, self._blocks.values())
            for device, events in self._event_cache.items():
                with on_device(be, device):
                    while events:
                        event = events.pop()       # first: see DeviceCachingAllocator.empty_cache
                        try:
                            be.event_destroy(event)
                        except Exception:
                            events.append(event)   # a failure keeps it for the next try
                            raise

    def stats(self) -> dict:
        """Bytes and counts: allocated_bytes, reserved_bytes, allocations, segments,
        num_host_alloc, num_host_free, pending (blocks waiting for events)."""
        if _finalizers:
            _drain_finalizers()
        with probe(self._lock, "pinned stats", self._gate_owned):
            out = dict(self._stats)
            out["pending"] = len({id(b) for _, _, b in self._events} | {id(b) for b in self._deferred}
                                 | {id(b) for b in self._parked})
            return out

    def _insert_events(self, block: _HostBlock) -> None:
        """Record an event on every stream that used ``block``, which waits in ``_deferred``
        meanwhile (see ``record_uses``); a block that needs none goes back to its free list
        now, leaving ``_deferred`` in the same step (no call in between)."""
        record_uses(self, block, self._events)
        deferred = [b for b in self._deferred if b is not block]
        ready = self._free.get(block.bucket)
        over = block.size > self._limits()[1]
        self._deferred = deferred
        if block.events == 0:
            if ready is None:
                self._free[block.bucket] = [block.ptr]
            else:
                ready += (block.ptr,)
            if over:                        # unpinned by the caller's _trim
                self._oversize += (block,)

    def _resume_events(self, strict: bool) -> None:
        """Record the events of deferred blocks and reuse blocks whose events completed.
        A deferred block that fails again stays deferred; its error propagates only when
        ``strict`` (empty_cache), after everything else was done."""
        error = None
        for block in list(self._deferred):
            try:
                self._insert_events(block)
            except Exception as exc:
                error = error or exc
        if self._events:
            self._process_events()
        if self._oversize:
            self._trim()
        if error is not None and strict:
            raise error

    def _process_events(self) -> None:
        max_cached = self._limits()[1]         # (a call: before the events leave _events)
        events, self._events = self._events, []
        query = self._be.event_query
        try:
            while events:
                entry = events[-1]
                event, device, block = entry
                if query(event):
                    cache = self._event_cache.get(device)
                    if cache is None:
                        cache = self._event_cache[device] = []
                    ready = self._free.get(block.bucket)
                    # no call from here to the append: see _uses.recorded
                    del events[-1]
                    block.events -= 1
                    if block.events == 0 and not block.uses:   # else deferred: a use waits
                        if ready is None:
                            self._free[block.bucket] = [block.ptr]
                        else:
                            ready += (block.ptr,)
                        if block.size > max_cached:            # unpinned by _resume_events' _trim
                            self._oversize += (block,)
                    cache.append(event)
                else:
                    self._events.append(entry)
                    del events[-1]
        finally:
            self._events += events

    def _release_free(self) -> None:
        for ptrs in self._free.values():
            while ptrs:
                self._unpin(ptrs, len(ptrs) - 1)
        del self._oversize[:]              # (each was cached: unpinned now, or it stays cached)

    def _trim(self) -> None:
        """Unpin the cached blocks of ``_oversize`` (past pinned_max_cached_size when freed), the
        lock held and no capture underway.  Never raises an error of the runtime: a block whose
        cudaFreeHost failed stays cached (and counted), for empty_cache to release or report."""
        oversize = self._oversize
        while oversize:
            block = oversize[-1]
            ptrs = self._free.get(block.bucket)
            # skipped when handed out since (and freed again: listed again) or already unpinned
            i = ptrs.index(block.ptr) if (ptrs and not block.allocated and self._blocks.get(block.ptr) is block
                                          and block.ptr in ptrs) else -1
            del oversize[-1]               # an interrupt from here leaves it cached: no leak
            if i >= 0:
                try:
                    self._unpin(ptrs, i)
                except Exception:
                    pass

    def _unpin(self, ptrs: list, i: int) -> None:
        """Give the cached block ``ptrs[i]`` (an entry of a free list) back to the driver, the
        lock held and no capture underway; a failed cudaFreeHost leaves it pinned, cached and
        counted, and raises."""
        # Forgotten first, freed last, with no call in between the record changes: a
        # KeyboardInterrupt may then leak this one block (interrupted before the free ran)
        # but never leaves a freed block cached, to be freed twice or handed out again.
        ptr = ptrs[i]
        block = self._blocks[ptr]
        starts = self._starts
        j = bisect_right(starts, ptr) - 1
        start = time.perf_counter()
        del ptrs[i]
        del self._blocks[ptr]
        del starts[j]
        stats, tally = self._stats, self._tally
        stats["reserved_bytes"] -= block.size
        stats["segments"] -= 1
        stats["num_host_free"] += 1
        t = tally["allocations"]
        t[0] -= 1
        t[3] += 1
        t = tally["allocated_bytes"]
        t[0] -= block.size
        t[3] += block.size
        try:
            self._be.host_free(ptr)
        except Exception:
            # a failed cudaFreeHost leaves the block pinned: it stays cached (and counted)
            self._blocks[ptr] = block
            insort(starts, ptr)
            ptrs.insert(i, ptr)
            stats["reserved_bytes"] += block.size
            stats["segments"] += 1
            stats["num_host_free"] -= 1
            for key, n in (("allocations", 1), ("allocated_bytes", block.size)):
                tally[key][0] += n
                tally[key][3] -= n
            raise
        self._time("host_free_time", start)

    def _time(self, key: str, start: float) -> None:
        us = int((time.perf_counter() - start) * 1e6)
        timing = self._timing[key]
        timing[0] += us
        timing[1] = max(timing[1], us)
        timing[2] = us if timing[3] == 0 else min(timing[2], us)
        timing[3] += 1

    def torch_stats(self) -> dict:
        """torch 2.13's ``_cuda_hostMemoryStats`` layout (nested): ``allocations``,
        ``allocated_bytes``, ``active_requests``, ``active_bytes`` as {current, peak,
        allocated, freed}; ``num_host_alloc``, ``num_host_free``; ``host_alloc_time`` and
        ``host_free_time`` as {total, max, min, count, avg} in microseconds.  A block counts
        as active from malloc to free (torch: until its stream uses complete)."""
        with probe(self._lock, "pinned stats", self._gate_owned):
            out = {key: dict(zip(("current", "peak", "allocated", "freed"), tally))
                   for key, tally in self._tally.items()}
            # derived from the blocks' counters as torch's getStats does, so that
            # reset_accumulated_stats zeroes them too (r68b)
            out["num_host_alloc"] = out["allocations"]["allocated"]
            out["num_host_free"] = out["allocations"]["freed"]
            for key, (total, most, least, count) in self._timing.items():
                out[key] = {"total": total, "max": most, "min": least, "count": count,
                            "avg": total // count if count else 0}
            return out

    def reset_peak_stats(self) -> None:
        """Set each torch_stats peak to its current value."""
        with probe(self._lock, "pinned stats", self._gate_owned):
            for tally in self._tally.values():
                tally[1] = tally[0]

    def reset_accumulated_stats(self) -> None:
        """Zero the torch_stats allocated/freed counters and the timings."""
        with probe(self._lock, "pinned stats", self._gate_owned):
            for tally in self._tally.values():
                tally[2] = tally[3] = 0
            for timing in self._timing.values():
                timing[:] = [0, 0, 0, 0]

    @staticmethod
    def _not_allocated(ptr, block) -> Exception:
        if type(ptr) is not int:
            return TypeError(f"pointer must be an int, got {type(ptr).__name__} {ptr!r}")
        if block is not None:
            return ValueError(f"pinned host pointer {ptr:#x} is not allocated (double free?)")
        return ValueError(f"pointer {ptr:#x} was not allocated by the pinned host allocator")

