"""Graph private pools and MemPools: the routes to them, their use counts, when their memory leaves.

A mixin of :class:`~accel.memory._caching.DeviceCachingAllocator`, as ``_classic``'s and
``_expandable``'s are: the state lives there (``_private``: pool id -> :class:`_PrivatePool`;
``_routes``/``_origins``/``_origin_ids``: capturing streams and the streams that joined their
capture; ``_threads``: use_mem_pool's thread routes; ``_oom_pools``; ``_pool_reserved``:
``reserved_bytes_by_private_pools``), and malloc's general (not hot) path, ``_find_special``,
asks :meth:`~PrivatePools._joined_pool` for a stream with no route of its own while a capture is
routing.  These methods are torch's PrivatePool bookkeeping (``beginAllocateToPool``,
``createOrIncrefPool``, ``releasePool``, ``endAllocateToPool``), plus what accel adds:

* a pool's free lists hold its blocks only: no request outside the pool looks there, except in
  a MemPool(use_on_oom=True) on an out-of-memory (``_oom_pools``); a pool a use_mem_pool thread
  route names takes no second route (torch's "already recording to mempool_id");
* P1: once nothing uses it, a pool whose graphs were replayed on a stream other than that of its
  only free lists (:meth:`~PrivatePools.pool_used_on`) is kept from the general cache; any
  other joins it, segment by segment as they become wholly free (:meth:`~PrivatePools.release_pool`
  says why);
* P2: a pool a capture allocated from keeps its free blocks while it lives (a replay may still
  write a temporary freed during the capture);
* a pool is forgotten once nothing uses it and it holds no segment, and
  ``reserved_bytes_by_private_pools`` keeps the entry of the last gone pool only
  (:data:`_DEAD_POOL_STATS`), so state stays bounded by the live pools.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from functools import partial
from typing import Dict, List, Optional, Tuple

from .._errors import CaptureError
from .. import _locks
from . import _stats
from ._blocks import _MASK, _SHIFT, _SMALL, _Block, _FreeList
from ._guards import count_captures, pool_captures, probe, unless_capturing
from ._requests import _check_pool_id
from ._uses import check_use


class _PrivatePool:
    """Memory of graph captures and MemPools sharing one pool id (torch's PrivatePool)."""

    __slots__ = ("id", "use_count", "lists", "no_split", "replays", "kept", "captured")

    def __init__(self, pool_id):
        self.id = pool_id
        self.use_count = 0
        # a capture allocated from it: a free block may be a temporary its graph's replays still
        # write (freed during the capture), so none leaves the pool while the pool lives (P2)
        self.captured = False
        self.lists: Dict[int, Tuple[_FreeList, _FreeList]] = {}
        self.no_split = False     # MemPool(no_split=True): blocks are handed out whole
        # streams its graphs were replayed on (DeviceCachingAllocator.pool_used_on; two at most:
        # the second already says "not only the stream of its free lists")
        self.replays: Optional[set] = None
        self.kept = False         # released, its memory kept from the general cache (P1, release_pool)

    def released(self) -> bool:
        """Released, and its whole free segments may join the general cache (P1)."""
        return self.use_count == 0 and not self.kept


#: a private pool's reserved_bytes_by_private_pools entry before its first segment
_NO_POOL_STAT = (0,) * 12
#: how many gone pools' entries reserved_bytes_by_private_pools keeps (the last one: what a program
#: reads right after a pool goes; state stays bounded by the live pools)
_DEAD_POOL_STATS = 1


class PrivatePools:
    """The private-pool bookkeeping of DeviceCachingAllocator (see the module docstring)."""

    def _joined_pool(self, stream: int) -> Optional[_PrivatePool]:
        """The private pool of the capture ``stream`` joined through an event wait, if any
        (torch maps cudaStreamGetCaptureInfo's capture id to the pool the same way)."""
        capture_id = self._be.capture_id
        ident = capture_id(stream)
        if ident is None:
            return None
        for origin, pool in self._origins.items():
            known = self._origin_ids.get(origin)
            if known is None:
                known = capture_id(origin)
                if known is None:
                    continue
                self._origin_ids[origin] = known
            if known == ident:
                self._routes[stream] = pool
                return pool
        return None

    def begin_allocate_to_pool(self, pool_id: Tuple[int, int], stream: Optional[int] = None, *,
                               thread: Optional[int] = None) -> None:
        """From now on, allocations on ``stream`` come from private pool ``pool_id``
        (created on first use; several graphs may share one id), and its use count goes up.

        With ``thread`` (a ``threading.get_ident()``) instead of ``stream``: that thread's
        allocations on every stream, innermost route first (torch's
        beginAllocateCurrentThreadToPool, for ``use_mem_pool``).  A thread route is no
        capture: events, empty_cache and frees go on as usual.  A pool a thread route
        names takes no second route, as torch's "already recording to mempool_id"."""
        pool_id = _check_pool_id(pool_id)
        if (stream is None) == (thread is None):
            raise TypeError("begin_allocate_to_pool takes a stream or thread= (one of them)")
        with probe(self._lock, "begin_allocate_to_pool", self._gate_owned):
            if any(p.id == pool_id for pools in self._threads.values() for p in pools) or (
                    thread is not None and any(p.id == pool_id for p in self._routes.values())):
                raise RuntimeError(f"beginAllocateToPool: already recording to mempool_id {pool_id}: "
                                   f"a use_mem_pool or capture routes allocations to it already; a pool "
                                   f"takes one route at a time (use another MemPool)")
            if thread is None and stream in self._routes:
                raise CaptureError(f"stream {stream:#x} already allocates to private pool "
                                   f"{self._routes[stream].id}; end that capture first")
            pool = self._private.get(pool_id)
            if pool is None:
                pool = self._private[pool_id] = _PrivatePool(pool_id)
            pool.use_count += 1
            if thread is not None:
                self._threads.setdefault(thread, []).append(pool)
            else:
                pool.captured = True
                self._routes[stream] = self._origins[stream] = pool
                self._origin_ids.pop(stream, None)
                count_captures(1)
            self._update_special()

    def create_pool(self, pool_id: Tuple[int, int], *, use_on_oom: bool = False, no_split: bool = False) -> None:
        """Create private pool ``pool_id`` with use count 1, or add 1 to an existing one's
        (torch's createOrIncrefPool, for a MemPool).  ``use_on_oom``: a request outside the
        pool that finds the device full takes a free block of the pool instead of failing;
        ``no_split``: the pool hands blocks out whole."""
        pool_id = _check_pool_id(pool_id)
        with probe(self._lock, "create_pool", self._gate_owned):
            pool = self._private.get(pool_id)
            if pool is None:
                pool = self._private[pool_id] = _PrivatePool(pool_id)
                pool.no_split = bool(no_split)
            pool.use_count += 1
            if use_on_oom and pool not in self._oom_pools:
                self._oom_pools.append(pool)

    def pool_use_count(self, pool_id: Tuple[int, int]) -> int:
        """How many graphs, MemPools and active use_mem_pool hold private pool ``pool_id``
        (0 for none)."""
        pool = self._private.get(_check_pool_id(pool_id))
        return pool.use_count if pool is not None else 0

    def end_allocate_to_pool(self, pool_id: Tuple[int, int]) -> None:
        """Stop routing allocations to ``pool_id`` (the capture ended)."""
        pool_id = _check_pool_id(pool_id)
        with probe(self._lock, "end_allocate_to_pool", self._gate_owned):
            # computed, then published in one step (a KeyboardInterrupt leaves every route or none)
            routes = {s: pool for s, pool in self._routes.items() if pool.id != pool_id}
            ended = [s for s, pool in self._origins.items() if pool.id == pool_id]
            origins = {s: pool for s, pool in self._origins.items() if pool.id != pool_id}
            origin_ids = {s: i for s, i in self._origin_ids.items() if s not in ended}
            threads = {t: kept for t, kept in ((t, [p for p in pools if p.id != pool_id])
                                               for t, pools in self._threads.items()) if kept}
            _locks.publish([partial(setattr, self, "_routes", routes), partial(setattr, self, "_origins", origins),
                            partial(setattr, self, "_origin_ids", origin_ids),
                            partial(setattr, self, "_threads", threads)]
                           + [pool_captures.pop for _ in ended])
            if self._deferred or self._pending_events:
                unless_capturing(self._be, self._resume_events)
            self._update_special()

    def pool_used_on(self, pool_id: Tuple[int, int], stream: int, device_index: Optional[int] = None) -> None:
        """A launch of a graph whose memory is private pool ``pool_id`` is queued on ``stream``
        (of device ``device_index``, default this allocator's): accel.graphs calls it at every
        replay, before the launch.  A pool replayed on a stream other than that of its free
        lists is kept from the general cache once released (P1 in :meth:`release_pool`).
        TypeError/ValueError as record_stream's for a bad stream or device; ValueError for a
        pool nothing holds."""
        device = check_use(self._be, stream, device_index, self._index)
        pool_id = _check_pool_id(pool_id)
        lock = self._lock
        if _locks._running or lock._is_owned() or self._gate_owned():     # see _guards.probe
            lock = probe(lock, "pool_used_on", self._gate_owned)
        with lock:
            pool = self._private.get(pool_id)
            if pool is None or pool.use_count <= 0:
                raise ValueError(f"pool_used_on: no private pool {pool_id} held on device {self._index} "
                                 f"(released, or never created)")
            replays = pool.replays
            if replays is None:
                pool.replays = {(stream, device)}
            elif len(replays) < 2:
                replays.add((stream, device))

    def release_pool(self, pool_id: Tuple[int, int], *, mempool: bool = False) -> None:
        """A graph (or use_mem_pool) using ``pool_id`` ended.  When nothing uses the pool any
        more, its segments go back to the general cache as soon as all their blocks
        are free (segments still holding live blocks follow when those are freed), unless:

        P1.  A pool whose graphs were replayed on a stream other than that of its free lists
             (:meth:`pool_used_on`; a pool with free lists on several streams: on any stream) is
             kept from the general cache once released, as torch keeps every released pool
             (releasePool only makes it graph_pools_freeable; release_cached_blocks cudaFrees its
             unsplit blocks): a replay queued there may still read and write its memory, and the
             next allocation on its stream is not ordered after that replay.  Its segments stay
             in its free lists, where no request looks: reserved, listed in the snapshot with the
             pool's id, and returned to the device by empty_cache, release-before-grow (and E10's
             unmap before a grow), the release threshold and the out-of-memory retry.  A device
             free (cudaFree, zeMemFree) waits for the device's queued work first, so the memory
             can be handed out again only after every replay ran.  (Before r61h the segments
             joined the general cache at once: the next allocation on the capture stream got the
             graph's temporary, which a replay queued on another stream then overwrote.)  A
             replay on the stream of the pool's only free lists is ordered before the next
             allocation there: such a pool joins the general cache as before.

        ``mempool``: the pool's MemPool died (torch's ~MemPool: releasePool, then
        emptyCache of the pool): it serves no OOM any more, and when nothing else uses
        it its whole free segments go back to the device (unless a capture is underway)."""
        pool_id = _check_pool_id(pool_id)
        with probe(self._lock, "release_pool", self._gate_owned):
            pool = self._private.get(pool_id)
            if pool is None:
                raise ValueError(f"release_pool: no private pool {pool_id} on device {self._index}")
            if pool.use_count <= 0:
                raise ValueError(f"release_pool: private pool {pool_id} was already released")
            if pool.use_count == 1 and pool.replays and not pool.kept:
                lists = list(pool.lists)
                if len(lists) != 1 or pool.replays != {(lists[0], self._index)}:
                    pool.kept = True        # (before the count: a new count 0 is never handed over)
            pool.use_count -= 1
            if mempool and pool in self._oom_pools:
                self._oom_pools.remove(pool)
            if pool.use_count == 0:
                whole = self._whole_of(pool)
                if pool.released():
                    for block in whole:
                        self._move_to_general(block)
                if mempool and whole:
                    # a kept pool's too: the device free waits for the device (P1)
                    unless_capturing(self._be, self._release_blocks, whole)
                self._forget_private_if_empty(pool)

    def _whole_of(self, pool: _PrivatePool) -> List[_Block]:
        """The whole free classic segments in ``pool``'s free lists."""
        out = []
        for fl in [fl for pair in pool.lists.values() for fl in pair]:
            for key in fl.keys:
                block = self._blocks[key & _MASK]
                if block.prev is None and block.next is None:
                    out.append(block)
        return out

    def _move_to_general(self, block: _Block) -> None:
        """A whole free segment of a released private pool joins the general cache: both free
        lists are computed first and published with plain stores (no KeyboardInterrupt
        between them)."""
        fl = block.pool
        lists = self._general.get(fl.stream) or self._new_lists(fl.stream, None)
        target = lists[0] if fl.kind == _SMALL else lists[1]
        owner = fl.owner
        pool_stat = self._pool_stat_after(owner.id, fl.kind, -block.size) if owner is not None else None
        key = block.size << _SHIFT | block.ptr
        src = list(fl.keys)
        del src[bisect_left(src, key)]
        dst = list(target.keys)
        insort(dst, key)
        fl.keys[:] = src
        target.keys[:] = dst
        block.pool = target
        fl.segments -= 1
        target.segments += 1
        if pool_stat is not None:
            self._pool_reserved[owner.id] = pool_stat      # (its bytes leave the pool's share)
        self._pool_orphans.discard(block.ptr)

    def _forget_private_if_empty(self, pool: _PrivatePool) -> None:
        if pool.use_count == 0 and self._private.get(pool.id) is pool:
            if not any(self._blocks[b].pool.owner is pool for b in self._segments):
                del self._private[pool.id]
                dead = [k for k in self._pool_reserved if k not in self._private]
                for k in dead[:-_DEAD_POOL_STATS]:
                    del self._pool_reserved[k]

    def _pool_stat_after(self, pool_id: tuple, kind: int, n: int) -> List[int]:
        """Pool ``pool_id``'s reserved_bytes_by_private_pools entry once ``n`` bytes of a ``kind``
        segment joined it (n > 0) or left it (n < 0): a new list, stored by the caller."""
        new = list(self._pool_reserved.get(pool_id) or _NO_POOL_STAT)
        for q in (0, kind):
            new[q] += n
            if n > 0:
                new[6 + q] += n
                if new[q] > new[3 + q]:
                    new[3 + q] = new[q]
            else:
                new[9 + q] -= n
        return new

    def private_pool_stats(self) -> Dict[tuple, dict]:
        """torch 2.13's ``reserved_bytes_by_private_pools``: for each private pool (MemPool or
        graph pool, by id) that held segments, the reserved bytes of its segments as
        ``{all,small_pool,large_pool}: {current,peak,allocated,freed}``.  The entry of the pool
        that went last stays, current 0, until another pool goes or reset_accumulated_stats
        (torch keeps every gone pool's until a reset: a program that makes graphs in a loop
        would grow it without bound)."""
        with probe(self._lock, "private_pool_stats", self._gate_owned):
            return {pool_id: {name: dict(zip(_stats.STAT_FIELDS, st[q::3]))
                              for q, name in enumerate(_stats.POOL_NAMES)}
                    for pool_id, st in self._pool_reserved.items()}
