"""``MemPool`` and ``use_mem_pool``: user-made private pools of the caching allocator
(``torch.cuda.MemPool`` / ``torch.cuda.use_mem_pool``, torch 2.13).

A MemPool is a private pool of one device's caching allocator, like the pool a graph
capture allocates from, held by the MemPool object (use count 1, as torch's
createOrIncrefPool).  Inside ``with use_mem_pool(pool):`` the allocations of the
*calling thread* on the pool's device, on any stream, come from the pool (other threads
are not routed, as torch's thread filter); blocks freed later, inside or outside, go back
to the pool.  ``pool.id`` is ``(0, n)``, from the counter ``graph_pool_handle()`` uses
(torch's MempoolId_t for user-made pools), so ``Graph(pool=pool.id)`` captures into it.

When the MemPool object dies its pool is released (torch's ~MemPool: releasePool, then
emptyCache of the pool): once no graph uses it either, its whole free segments go back to
the device and segments that still hold live blocks join the general cache when those are
freed.  ``empty_cache()`` leaves a live pool's free segments alone, inside the context or
not, as torch's.

Differences from torch: no pluggable allocator (``allocator`` must be None); when a graph
capture and a ``use_mem_pool`` both route an allocation, the capture's pool wins (torch takes
whichever began last) because the graph keeps its pool alive for its replays; a pool is
bound to the device current at its creation and ``use_mem_pool`` on another device raises
(torch silently makes a second, unowned pool there).
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import sys
import threading
from typing import Iterator, List, Tuple

from .. import _device, _lazy, _locks
from .. import _finalize as _fin
from .._copying import refuse_copies as _refuse_copies
from ..backends._signals import deferred

__all__ = ["MemPool", "use_mem_pool", "new_user_pool_id", "check_pool_id"]

# torch's MempoolId_t (c10/cuda MemPool::graph_pool_handle): ids a user asks for are
# {0, n} (graph_pool_handle, MemPool), the pool a graph makes for itself {n, 0}.
_user_ids = itertools.count(1)
_ids_lock = _locks.Lock("a new pool id")       # (r68i: a __del__ run inside it made a MemPool)


def new_user_pool_id() -> Tuple[int, int]:
    """A fresh user pool id ``(0, n)`` (shared by MemPool and graph_pool_handle)."""
    with _ids_lock:
        return (0, next(_user_ids))


def check_pool_id(pool) -> Tuple[int, int]:
    """``pool`` (a graph's or MemPool's id) as the (int, int) id it must be (numpy integers
    too), or TypeError naming it; ValueError for an id outside [0, 2**64) (r67i: a negative
    one, or past 64 bits, made a pool).  Graph(pool=) and memory_snapshot(mempool_id=) share it."""
    try:
        ids = tuple(operator.index(x) for x in pool if not isinstance(x, bool))
    except TypeError:
        ids = ()
    if len(ids) != 2 or len(tuple(pool)) != 2:
        raise TypeError(f"pool must be a (int, int) tuple from generate_graph_pool_handle() or "
                        f"Graph.pool(), got {pool!r}")
    if not all(0 <= x < 1 << 64 for x in ids):
        raise ValueError(f"pool ids are in [0, 2**64), got {pool!r}; use generate_graph_pool_handle() or "
                         f"Graph.pool()")
    return ids


def _allocator(index: int):
    from . import device_allocator
    return device_allocator(index)


@_refuse_copies("share the MemPool object itself, or create a new MemPool")
class MemPool:
    """A private memory pool of the caching allocator of the current device.

    ``MemPool(allocator=None, use_on_oom=False, no_split=False)``, as torch 2.13:

    * ``allocator``: must be None (accel has no pluggable allocators); anything else raises
      NotImplementedError.
    * ``use_on_oom``: a request outside the pool that finds the device full takes a free
      block of this pool instead of raising OutOfMemoryError.
    * ``no_split``: blocks of this pool are handed out whole, never split.

    Initializes the runtime.  ``id`` is ``(0, n)``; ``use_count()`` counts the MemPool, active
    ``use_mem_pool`` contexts and graphs using the pool; ``snapshot()`` lists its segments
    (torch's ``memory_snapshot`` layout).  NotImplementedError under
    ``backend:cudaMallocAsync`` (its driver pool has no private pools).

    Where accel differs: a segment that a destroyed Stream allocated in the pool leaves the pool
    for the general cache once wholly free, unless a graph capture used the pool.  torch's
    streams come from a fixed pool of handles that later streams reuse; accel's are new each
    time, so no later stream could reuse such a segment.
    """

    def __init__(self, allocator=None, use_on_oom: bool = False, no_split: bool = False):
        if allocator is not None:
            raise NotImplementedError(
                f"MemPool(allocator={allocator!r}): accel has no pluggable allocators (torch's "
                f"CUDAPluggableAllocator); use MemPool() to pool memory of accel's caching allocator")
        for name, value in (("use_on_oom", use_on_oom), ("no_split", no_split)):
            if not isinstance(value, bool):
                raise TypeError(f"MemPool({name}=...) must be a bool, got {type(value).__name__} {value!r}")
        backend = _lazy.lazy_init()
        index = backend.get_device()
        alloc = _allocator(index)
        if not hasattr(alloc, "create_pool"):
            raise NotImplementedError(
                f"MemPool needs accel's caching allocator; {type(alloc).__name__} (backend:"
                f"{alloc.config.backend}) has no private pools: unset backend:{alloc.config.backend} in "
                f"ACCEL_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF")
        pool_id = new_user_pool_id()
        alloc.create_pool(pool_id, use_on_oom=use_on_oom, no_split=no_split)
        self._id = pool_id
        self._index = index
        self._backend = backend
        self._pid = _fin.pid

    @property
    def id(self) -> Tuple[int, int]:
        """The pool's id, ``(0, n)``: pass it as ``Graph(pool=...)`` or ``graph(..., pool=...)``."""
        return self._id

    @property
    def allocator(self):
        """The pool's pluggable allocator: always None in accel."""
        return None

    @property
    def device_index(self) -> int:
        """The device whose allocator holds the pool (the current device at creation)."""
        return self._index

    def use_count(self) -> int:
        """References to the pool: 1 for this object, plus one per active use_mem_pool and
        per graph captured into it and not yet reset."""
        self._check_process()
        return _allocator(self._index).pool_use_count(self._id)

    def snapshot(self, include_traces: bool = True) -> List[dict]:
        """The pool's segments with their blocks, in :func:`accel.memory.memory_snapshot`'s
        layout (``segment_pool_id`` is this id).  ``include_traces`` is accepted as torch's."""
        self._check_process()
        from . import memory_snapshot
        return memory_snapshot(self._id, include_traces)

    def __repr__(self) -> str:
        return f"MemPool(id={self._id}, device_index={self._index})"

    def _check_process(self) -> None:
        if self._pid != _fin.pid:
            raise _fin.forked_error(self._backend)

    def __del__(self, _finalizing=sys.is_finalizing):
        if _finalizing():
            return      # interpreter exit: module globals may be gone; the process takes it all
        try:
            # Never waits on a lock (see accel._finalize); nothing in a forked child.
            if getattr(self, "_backend", None) is not None and self._pid == _fin.pid and _lazy.is_initialized():
                _fin.finalize(_release, self._backend, self._index, self._id)
        except KeyboardInterrupt:
            _fin.RAISE_AGAIN[_fin.interrupt_key()]    # a Ctrl-C handled in here reaches the program (r62)


def _release(backend, index: int, pool_id: Tuple[int, int]) -> None:
    _allocator(index).release_pool(pool_id, mempool=True)


@contextlib.contextmanager
def use_mem_pool(pool: MemPool, device=None) -> Iterator[None]:
    """Route the calling thread's allocations on ``device`` (default: the current device) to
    ``pool`` while the body runs (``torch.cuda.use_mem_pool``).

    Other threads, including ones started in the body, allocate as before.  Contexts nest
    (the innermost pool is used).  TypeError when ``pool`` is not a MemPool; ValueError when
    ``device`` is not the pool's device; RuntimeError when the pool is already in use by
    another use_mem_pool or a graph capture."""
    if not isinstance(pool, MemPool):
        raise TypeError(f"use_mem_pool() takes an accel.MemPool, got {type(pool).__name__} {pool!r}; a pool "
                        f"id tuple goes to Graph(pool=...) instead")
    pool._check_process()
    index = _device.checked_index(device, optional=True)
    if index != pool._index:
        raise ValueError(f"use_mem_pool(pool, device={device!r}): {pool!r} belongs to device {pool._index}, "
                         f"not device {index}; create the pool while device {index} is current "
                         f"(with accel.device_index({index}): pool = accel.MemPool())")
    alloc = _allocator(index)
    routed = []
    try:
        _route(alloc, pool._id, routed)
        yield
    finally:
        if routed:
            _unroute(alloc, pool._id)


# begin_allocate_to_pool publishes the route before its lock is released, so a Ctrl-C could raise
# from it with the route in place, before the try that ends it (r55).  The route is begun and
# noted, and ended and released, with signals deferred (accel/backends/_signals.py): a Ctrl-C
# lands before the begin (nothing to end) or once ``routed`` says it is there.  The window left:
# one exactly as _unroute starts (as for contextlib's __exit__: the route stays).

@deferred
def _route(alloc, pool_id: Tuple[int, int], routed: list) -> None:
    alloc.begin_allocate_to_pool(pool_id, thread=threading.get_ident())
    routed.append(pool_id)


@deferred
def _unroute(alloc, pool_id: Tuple[int, int]) -> None:
    try:
        alloc.end_allocate_to_pool(pool_id)
    finally:
        alloc.release_pool(pool_id)
