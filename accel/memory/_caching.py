"""The per-device caching allocator.

Device memory is obtained from the backend in *segments* and handed out as
*blocks*: a block is a range of a segment, either allocated, free (cached,
reusable), or pending (freed by the user but still in use by work on other
streams until its events complete).  Blocks of a segment form a doubly linked
list in address order; free neighbours are always merged, so a segment never
holds two adjacent free blocks.

Free blocks live in free lists keyed by (owner pool, stream, small/large):
each list is a sorted ``list`` of ints ``size << 64 | ptr``, so ``bisect``
finds the best fit (smallest adequate size, then lowest address) in
O(log n) without any third-party sorted container.  A block is only ever
reused on the stream it was allocated for; ``record_stream`` makes its
release wait for events recorded on the other streams at free time
(``_uses``: the stream uses and their events, shared with the pinned allocator).

Policy.  PyTorch's rules (``c10/cuda/CUDACachingAllocator.cpp``) are the
baseline and selectable with ``ACCEL_ALLOC_CONF=policy:torch``.  The default
``accel`` policy differs where PyTorch loses memory to fragmentation:

* large segments are the request rounded up to 2 MiB (the device's page
  granule), not 20 MiB for every request under 10 MiB; a request whose rounding
  would waste over a quarter of its segment, once such sizes recur, gets a segment
  for two to four of them (``_packed_segment_size``);
* a large block is split whenever the rest is at least 512 bytes (PyTorch
  keeps up to 1 MiB of slack inside the block);
* release-before-grow: a new segment that would lift reserved memory above
  its high-water mark is paid for by first returning unused cached segments
  to the device (the smallest that covers the excess alone, else smallest
  first), so a fragmented cache cannot make the footprint creep upwards;
* a small request that would still lift reserved memory past that mark with a
  new 2 MiB small segment takes the high end of a free large-pool block instead
  (``_small_in_large``); below the mark the pools stay apart, as in torch.

On the shared training traces this keeps peak reserved within 6 % of peak
allocated (PyTorch's rules: 4-32 %); see ``tools/replay_trace.py``.  These rules'
methods, each with its measurements, are ``_classic``'s.

Where the backend has virtual memory (CUDA, Level Zero) the general cache grows
*expandable segments* instead, by default (``expandable_segments:False`` keeps the
classic segments above; ``policy:torch`` keeps torch's default, off): one reserved
address range per stream, for small and large requests alike, whose pages are mapped
and unmapped on demand, so fragmentation across segments costs no physical memory
(``_expandable``: the invariants E1-E14 and the methods that keep them; within 8 % of peak
allocated on 10 of 11 recorded traces, 32 of 41 with the held-out ones).  A block carved out of a larger free block of
such a segment takes the end that touches fewer pages no live block holds (E13).  Graph
private pools and misses during a capture keep classic segments.  Which requests a private pool
(a graph's or a MemPool's) serves, and when its memory may leave it (P1, P2), are
``_private_pools``'s: the pools' routes, use counts and reserved-bytes entries.

Streams are forgotten when they are destroyed (``forget_stream``, called by
``accel.streams`` just before the handle is destroyed, because the driver
hands the value to the next stream): an event is recorded on the dying
stream, its free lists are set aside until that event completes, and then
join the device's default-stream lists.  Nothing stays keyed by a dead
handle, so a new stream with a recycled handle inherits nothing.

While any stream capture is underway, events are neither queried nor
synchronized and no memory goes back to the device (those calls would
invalidate a global-mode capture); frees that need events are deferred and
handled once no capture is underway, as torch does.

The hot path (a cache hit) takes one lock, one ``bisect`` and one ``insort``,
and updates all hot statistics with a couple of big-int additions (see
``_stats.LANE``), memoized per size since training repeats its sizes.

Invariants of classic segments (what ``tests/test_memory_allocator.check_invariants``
asserts after every operation, as CUDACachingAllocator.cpp lists its own):

1. The blocks of a segment tile it in address order (``prev``/``next``), every
   size a multiple of 512; no two neighbours are both free.
2. Every block of a segment belongs to the segment's free list (owner, stream,
   small/large), whatever the request it serves: a small request placed in a large
   segment (``_small_in_large``) is a large-pool block, in the stats too.
3. A free list's keys are sorted and are exactly its free blocks; allocated and
   pending blocks are in no list.  Only whole free segments go back to the device.
4. Small requests (<= 1 MiB) use small-pool blocks, large requests large-pool
   blocks, except (2): a small request reaches a large-pool block only when a new
   small segment would lift reserved memory past its high-water mark after
   release-before-grow, and then takes the high end of the best-fitting block, so
   the block's low part can still merge with its lower neighbour.
5. Reserved memory passes its high-water mark only when no whole free segment is
   left to release (release-before-grow) or a block must be made while a capture
   is underway.  Blocks of ``max_split_size`` or more are never split, and the
   classic rules never place anything in an expandable segment.
6. The policy ``torch`` follows PyTorch's rules: no release-before-grow, no (4).
7. (Both kinds of segment.)  An allocated block's ``ref`` is the weak reference malloc was
   given to its owner (or None), set in the step that hands the block out; every free clears
   it in the step that frees.  A block whose owner is gone while it is still allocated was
   lost to a KeyboardInterrupt (as malloc returned, or as the owner's ``__del__`` began):
   ``_reap_orphans`` frees it in empty_cache and before an out-of-memory retry.
"""

from __future__ import annotations

import operator
import threading
import time
from bisect import bisect_left, insort
from collections import deque
from functools import partial
from typing import Dict, List, Optional, Tuple

from .._device import check_range
from .._errors import AcceleratorError, CaptureError, OutOfMemoryError
from .._finalize import drain as _drain_finalizers, pending as _finalizers, releases_settled as _releases_settled
from .. import _locks

from ..backends._signals import deferred as _signals_deferred
from ..streams import announced, on_device
from . import _config, _oom_hooks, _stats
from ._snapfmt import CTX_ALL as _CTX_ALL, CTX_ALLOC as _CTX_ALLOC, Symbols as _Symbols
from ._snapfmt import allocator_settings as _allocator_settings, stack as _stack, trace_entry as _trace_entry
from ._blocks import (
    MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, SMALL_SIZE, _ALLOCATED, _FREE, _GUARD, _LANES, _LARGE, _MASK, _PACK_FIELDS, _PENDING, _POOL_NAME, _SHIFT, _SMALL, _Block, _FreeList,
    _NoAddressRange, _snapshot_block,
)
from ._requests import _ONE_EXA_BYTES, _check_size, _exabyte_error
from ._guards import capture_underway, gate_owned, probe, unless_capturing
from ._uses import (add_use, check_stream_live, check_use, cover, drop_done_gates, gates_back, order_after,
                    record_uses, recorded, stream_done, stream_uses, taken, uses_forgotten, without)
from ._classic import ClassicSegments
from ._private_pools import PrivatePools, _PrivatePool
from ._expandable import ExpandableSegments, Segment as _ExpSegment, high_end_pins_fewer as _high_end_pins_fewer
from ._stats import (ACTIVE, ACTIVE_BYTES, ALLOCATED_BYTES, ALLOCATION, LANE_MASK, OVERSIZE_ALLOCATIONS,
                     OVERSIZE_SEGMENTS, RESERVED_BYTES, SEGMENT, raise_peaks, unpack)

class _Retired:
    """Free lists of a destroyed stream, waiting for the work it had queued (one event)."""

    __slots__ = ("lists", "events")

    def __init__(self, lists):
        self.lists = lists          # [(owner pool or None, (small, large))]
        self.events = 1


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    # torch's roundup_power2_next_division: split [2^k, 2^(k+1)) into `divisions` steps.
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


@_signals_deferred
def _queue_wait(owner, waiter: int, stream: int, device: int) -> None:
    """:meth:`DeviceCachingAllocator.order_after`'s vendor calls, with signals deferred (short,
    none waits: a Ctrl-C as an event's create returns would lose it): a cached event of
    ``device`` recorded on ``stream`` where it lies (a wait queued by cudaStreamWaitEvent is not
    changed by a later record or destroy of the event: CUDA Runtime API, cudaStreamWaitEvent)
    and waited for by ``waiter``.  When the cache had none, the one made for it is destroyed
    after the wait, and kept in the cache when that fails (empty_cache destroys it, or reports
    the failure and keeps it): the call leaves as many live events as it found."""
    be = owner._be
    fresh = not owner._event_cache.get(device)
    event = recorded(owner, stream, device)
    with on_device(be, owner._index):
        be.stream_wait_event(waiter, event)
    if fresh:
        cache = owner._event_cache[device]
        if cache and cache[-1] == event:    # (the only one: made for this wait)
            del cache[-1]
            try:
                with on_device(be, device):
                    be.event_destroy(event)
            except Exception:       # (the wait is queued: not the caller's failure)
                cache.append(event)


class DeviceCachingAllocator(ClassicSegments, ExpandableSegments, PrivatePools):
    """Caching allocator for one device; every method is thread-safe.

    Normally obtained with :func:`accel.memory.device_allocator`; constructing
    one directly (as ``tools/replay_trace.py`` does, to compare policies in one
    process) gives an independent cache over the same backend.

    ``malloc(nbytes, stream)`` returns a device pointer (0 for 0 bytes) usable on
    ``stream``; ``free(ptr)`` returns it to the cache; ``record_stream(ptr, s)``
    says the block is also used on ``s``; ``order_after(waiter, s)`` makes ``waiter`` wait on
    the device for ``s``'s work so far.  ``begin_allocate_to_pool`` /
    ``end_allocate_to_pool`` / ``release_pool`` route graph-capture allocations
    to private pools (``_private_pools``).  ``empty_cache()`` returns unused segments to the device.
    """

    def __init__(self, backend, device_index: int, config: Optional[_config.AllocConfig] = None):
        self._be = backend
        self._index = device_index
        self._config = config = config if config is not None else _config.current()
        self._lock = _locks.OwnedLock()   # (an RLock only to tell its holder: probe refuses re-entry)
        self._gate_owned = gate_owned(backend)
        self._blocks: Dict[int, _Block] = {}
        self._segments: Dict[int, int] = {}          # base ptr -> segment size
        # classic segments that became wholly free (base ptr -> block), checked when read:
        # release-before-grow looks at these instead of every cached block
        self._whole: Dict[int, _Block] = {}
        # classic segments (base ptrs) of destroyed streams that joined a live pool's default
        # lists, no capture using the pool: each joins the general cache once wholly free (_rehome)
        self._pool_orphans: set = set()
        self._general: Dict[int, Tuple[_FreeList, _FreeList]] = {}
        self._routes: Dict[int, _PrivatePool] = {}   # capturing stream -> private pool
        self._origins: Dict[int, _PrivatePool] = {}  # streams of begin_allocate_to_pool
        self._origin_ids: Dict[int, int] = {}        # origin stream -> its capture id, once known
        self._private: Dict[tuple, _PrivatePool] = {}
        # torch 2.13's reserved_bytes_by_private_pools: pool id -> reserved bytes of the pool's
        # segments as [current, peak, allocated, freed] x (all, small, large), flat (computed by
        # _private_pools's _pool_stat_after; _NO_POOL_STAT before the first segment); the entry of
        # the pool that went last outlives it (current 0: torch keeps every gone pool's until a
        # reset), so this stays bounded by the live pools (_private_pools._DEAD_POOL_STATS)
        self._pool_reserved: Dict[tuple, List[int]] = {}
        # use_mem_pool: thread ident -> its pools, innermost last (torch's thread filter)
        self._threads: Dict[int, List[_PrivatePool]] = {}
        self._oom_pools: List[_PrivatePool] = []     # MemPool(use_on_oom=True), in creation order
        self._pending: List[_Block] = []             # freed, waiting for events
        self._pending_events: List[tuple] = []       # (event, device, _Block or _Retired)
        self._deferred: List[_Block] = []            # freed during capture, events not yet recorded
        self._used_on: Dict[int, set] = {}           # stream -> blocks whose uses name it
        # device -> events for reuse (completed; or recorded by a forget or free that an
        # interrupt or an error stopped: recording again is reuse); see _uses.recorded
        self._event_cache: Dict[int, List[int]] = {}
        self._default_stream: Optional[int] = None
        # history (record_history): records (action, addr, size, stream, time_us, stack, metadata), see
        # _snapfmt.trace_entry; _ctx is the torch RecordContext level (_snapfmt.CTX_*)
        self._history: Optional[deque] = None
        self._user_metadata = ""       # recorded with each history entry (torch's user_metadata)
        self._ctx = 0
        self._skip: frozenset = frozenset()
        # stack of the allocation that made a segment (classic: its base; expandable: each
        # mapping's start), while history keeps stacks
        self._seg_frames: Dict[int, list] = {}
        self._allowed: Optional[int] = None
        self._reserved_hw = 0          # most memory ever reserved (not reset by reset_peak_stats)
        self._spare: Optional[_Block] = None     # a block object a merge retired, reused by a split
        self._recent_misses = deque(maxlen=64)    # _packed_segment_size: sizes of recent large misses
        self._miss_ref = None     # malloc's owner reference while a miss runs (_small_in_large publishes it)
        # config, cached as attributes for the hot path
        self._torch_policy = config.policy == "torch"
        self._max_split = config.max_split_size
        self._release_threshold = config.release_threshold
        # torch splits a large block only when more than 1 MiB is left over
        self._large_split_min = SMALL_SIZE + 1 if self._torch_policy else MIN_BLOCK_SIZE
        self._pow2 = any(d > 1 for d in config.roundup_power2_divisions)
        # Statistics.  Each counter has current, peak, freed and base values;
        # "allocated" is derived as current - base + freed (base = current at the
        # last reset of accumulated stats).  Segment/reserved/oversize counters
        # change only on slow paths and live in lists; the hot ones are packed.
        self._cur, self._peak, self._base, self._freed = _stats.empty_counters()
        self._s_cur = self._s_base = self._s_freed = 0
        self._s_peak_guarded = _GUARD      # packed peaks with every lane's guard bit set
        self._s_peak_ok = 0                # a packed current value known to be <= the peaks
        self._s_peak_ok_free = 0           # the same, for _free_block
        # pending (freed, events outstanding) blocks per pool, for the derived "active" stats
        self._pend = [0, 0, 0, 0, 0, 0]       # count all/small/large, bytes all/small/large
        self._pend_base = [0, 0, 0, 0, 0, 0]
        self._active_peak = [0, 0, 0, 0, 0, 0]
        self._scalars = {"num_alloc_retries": 0, "num_ooms": 0, "num_sync_all_streams": 0,
                         "num_device_alloc": 0, "num_device_free": 0, "num_oom_rejections": 0}
        self._special = False     # True when malloc/free must take the general (slow) path
        self._update_special()
        # expandable segments (see _expandable): decided at the first miss
        self._expandable: Optional[bool] = None
        self._one_range = False   # expandable: small requests use the large pool's lists (E12)
        self._gran = 0
        self._exp_range = 0     # an expandable segment's reservation: the device's memory, rounded to _gran
        self._exp_spare = 0     # a freed segment's range kept for the next new one (E11), or 0
        self._exp_segs: List[_ExpSegment] = []
        self._scalars["num_device_map"] = 0
        self._scalars["num_device_unmap"] = 0
        self._peers: List[int] = []    # devices granted access to every mapping (torch's peers_)
        # physical memory to give back: (handle, bytes, pool, address still mapped or None)
        self._unreleased: List[Tuple[int, int, int, Optional[int]]] = []
        self._unsure: frozenset = frozenset()    # addresses of _unreleased whose unmap was under way

    # ------------------------------------------------------------------ public API
    @property
    def device_index(self) -> int:
        """The device this allocator serves."""
        return self._index

    @property
    def config(self) -> _config.AllocConfig:
        """The options in effect (ACCEL_ALLOC_CONF and set_allocator_settings, parsed)."""
        return self._config

    def set_memory_fraction(self, fraction: float) -> None:
        """Cap reserved memory at ``fraction`` (0..1, checked by the caller) of the device's
        total from now on: torch's ``setMemoryFraction``.  Memory already reserved stays;
        the next segment that would pass the cap fails (free the cache, retry, then OOM)."""
        with probe(self._lock, "set_memory_fraction", self._gate_owned):
            self._config = self._config._replace(per_process_memory_fraction=float(fraction))
            self._allowed = None

    def set_config(self, config: _config.AllocConfig, keep_fraction: bool = False) -> None:
        """Use the options ``config`` from now on (:func:`accel.memory.set_allocator_settings`);
        with ``keep_fraction``, this device's per_process_memory_fraction stays as it is.
        AllocatorConfigError when its ``policy`` or ``backend`` differs (fixed at the start).

        What exists stays as it was made: an oversize block stays whole, a segment keeps its
        kind (expandable segments made before ``expandable_segments:False`` keep serving the
        requests that fit them, and are unmapped on empty_cache, before a grow and on the
        out-of-memory retry; classic segments made before ``True`` likewise).  The oversize
        counters are recounted under the new ``max_split_size``, so that each free counts down
        what it counted up; after a ``roundup_power2_divisions`` change the memos of what a
        request size counts are dropped (a size seen before may round to another block size).

        Interrupt safety: everything is computed first (calls; nothing changed yet), then
        published all at once (``_locks.publish``), so a KeyboardInterrupt leaves the old options
        or the new ones, never a mix.  set_config is idempotent: applying a config again makes the
        allocator consistent with it whatever it held before (accel.memory's rollback)."""
        _config.check_fixed(self._config, config)
        if _finalizers:
            _drain_finalizers()
        with probe(self._lock, "set_config", self._gate_owned):
            old = self._config
            if keep_fraction:
                config = config._replace(per_process_memory_fraction=old.per_process_memory_fraction)
            max_split = config.max_split_size
            pow2 = any(d > 1 for d in config.roundup_power2_divisions)
            steps = [partial(setattr, self, "_max_split", max_split),
                     partial(setattr, self, "_release_threshold", config.release_threshold),
                     partial(setattr, self, "_pow2", pow2),
                     partial(setattr, self, "_allowed", None)]
            cur, peak, freed = self._cur, self._peak, self._freed
            for stat, n in self._oversize_counts(max_split).items():
                change = n - cur[stat]
                steps.append(partial(operator.setitem, cur, stat, n))
                if change > 0:                  # counted as allocated, as _count_up would
                    steps.append(partial(operator.setitem, peak, stat, max(peak[stat], n)))
                elif change < 0:                # counted as freed, as _count_down would
                    steps.append(partial(operator.setitem, freed, stat, freed[stat] - change))
            watch = config.release_threshold is not None
            for pair in self._general.values():
                for fl in pair:
                    steps.append(partial(setattr, fl, "watch_whole", watch))
            if config.roundup_power2_divisions != old.roundup_power2_divisions:
                # a request size may now round to another block size: what it counted is not known
                for fl in self._all_free_lists():
                    steps.append(fl.alloc_deltas.clear)
                # and the whole-segment split memo of every block, allocated ones too: one allocated
                # now is freed by free()'s fast path with its memo kept, and the next malloc of the
                # same request would pair it with a block size of the old rounding
                for block in self._blocks.values():
                    if block.undo:
                        steps.append(partial(setattr, block, "undo", 0))
            if self._expandable is not None:
                # decided again now, not at the next miss: malloc picks a free list by it (E12)
                use, gran = self._decide_expandable(config)
                steps += [partial(setattr, self, "_expandable", use),
                          partial(setattr, self, "_one_range", use and not self._torch_policy)]
                if use:        # (kept when off: the segments made stay, unmapped with it)
                    steps.append(partial(setattr, self, "_gran", gran))
            steps.append(partial(setattr, self, "_special", self._needs_special(pow2, max_split)))
            steps.append(partial(setattr, self, "_config", config))
            _locks.publish(steps)

    def _oversize_counts(self, limit: int) -> Dict[int, int]:
        """What OVERSIZE_ALLOCATIONS and OVERSIZE_SEGMENTS count under the limit ``limit``: the
        allocated blocks and the classic segments at or over it (a free counts down by the limit
        then)."""
        return {OVERSIZE_ALLOCATIONS: sum(1 for b in self._blocks.values() if b.state == _ALLOCATED and b.size >= limit),
                OVERSIZE_SEGMENTS: sum(1 for n in self._segments.values() if n >= limit)}

    def _all_free_lists(self) -> List[_FreeList]:
        """Every free list: the general cache's, the private pools', and destroyed streams'
        waiting for their work (_Retired)."""
        out = []
        for pair in self._general.values():
            out += pair
        for pool in self._private.values():
            for pair in pool.lists.values():
                out += pair
        for item in self._pending_events:
            target = item[2]
            if isinstance(target, _Retired):
                for _, pair in target.lists:
                    out += pair
        return out

    def malloc(self, nbytes: int, stream: Optional[int] = None, ref=None) -> int:
        """Allocate ``nbytes`` on ``stream`` (a backend stream handle; None = the device's
        default stream).  Returns the device pointer, 0 for ``nbytes == 0``.

        ``ref``: a weak reference to the object that will own the memory (a Buffer), kept with
        the block until it is freed: should the owner die without freeing it (a KeyboardInterrupt
        as this call returns, or as the owner's ``__del__`` starts), empty_cache and the
        out-of-memory retry free it (_reap_orphans).

        Raises TypeError/ValueError for a non-int or negative size and
        ``accel.OutOfMemoryError`` when the device is full even after the cache
        was released.
        """
        if type(nbytes) is not int or nbytes <= 0 or nbytes >= _ONE_EXA_BYTES:
            nbytes = _check_size(nbytes)
            if nbytes == 0:
                return 0
            if nbytes >= _ONE_EXA_BYTES:        # before the cache is touched, as torch
                raise _exabyte_error(self._be.name)
        size = (nbytes + 511) & -512       # multiple of 512 (at least 512)
        if stream is None:
            stream = self._get_default_stream()
        if _finalizers:            # frees finalizers left for a safe point (accel._finalize)
            _drain_finalizers()
        lock = self._lock
        if _locks._running or lock._is_owned() or self._gate_owned():     # see _guards.probe
            lock = probe(lock, "malloc", self._gate_owned)
        try:
            with lock:     # not acquire() + try: a KeyboardInterrupt as acquire returns would keep it
                special = self._special
                # The block found is still in its free list (fl.keys[i]) whichever path found it,
                # so a KeyboardInterrupt before the hand-out below leaves it cached.
                if special:
                    if self._pow2:
                        size = self._round_pow2(nbytes)
                    self._miss_ref = ref          # for a block _small_in_large hands out (its publish)
                    block, fl, i = self._find_special(size, nbytes, stream)
                    if i < 0:
                        return block.ptr          # _small_in_large handed it out
                else:
                    lists = self._general.get(stream)
                    if lists is None:
                        lists = self._new_lists(stream, None)
                    fl = lists[size > SMALL_SIZE or self._one_range]      # (small, large)
                    keys = fl.keys
                    i = bisect_left(keys, size << _SHIFT)
                    try:
                        block = self._blocks[keys[i] & _MASK]
                    except IndexError:               # nothing cached is big enough
                        block = None      # the miss runs outside this handler: its errors carry no IndexError
                    if block is None:
                        self._miss_ref = ref      # for a block _small_in_large hands out (its publish)
                        block = self._malloc_miss(size, nbytes, fl)
                        if block.state == _ALLOCATED:
                            return block.ptr          # _small_in_large handed it out
                        fl = block.pool      # a small request may get a large-pool block
                        i = self._slot(block)
                    else:
                        if (size > SMALL_SIZE and block.next is None and block.prev is None
                                and block.size >= 2 * size):
                            other = self._split_instead(fl, i, block)
                            if other is not None:
                                block = other
                                i = self._slot(block)
                            elif self._grow_instead(size, block, fl):
                                self._miss_ref = ref      # (as for a miss: _small_in_large is not reached)
                                block = self._malloc_miss(size, nbytes, fl)
                                if block.state == _ALLOCATED:
                                    return block.ptr
                                fl = block.pool
                                i = self._slot(block)
                # Hand the block out, splitting off the rest when it is worth keeping.
                # (Inlined: this is the hot path.)  Interrupt safety (Ctrl-C): everything is
                # computed first (calls may be interrupted: nothing changed yet), then published
                # with plain stores, which CPython runs with no signal check between them; the
                # one call that changes state (insort) comes last.  The compute part may write
                # the block's scratch fields (stat, undo, requested: a free block's are only
                # read by the whole-segment `undo` test below, to which they stay consistent),
                # a spare block object's fields, and the packed peaks (raised early: a peak may
                # then count an allocation a KeyboardInterrupt stopped, never less than one made).
                keys = fl.keys
                rest = block.size - size
                if rest >= fl.split_min and size < self._max_split:
                    if block.seg is not None:
                        # E13: the high end when it touches fewer pages no live block holds.  Tested
                        # only where the low end would touch one (most splits fit in the page the
                        # left neighbour holds: no call then)
                        gran = self._gran
                        x = block.ptr % gran
                        if ((x == 0 or x + size > gran) and (block.ptr + block.size) % gran
                                and _high_end_pins_fewer(block.ptr, block.ptr + block.size, size, gran)):
                            block = self._hand_out_high(block, fl, i, size, nbytes, ref)
                            if special:
                                self._after_take(block, fl)
                            return block.ptr
                    tptr = block.ptr + size
                    nxt = block.next
                    tail = self._spare
                    if tail is None:
                        tail = _Block(tptr, rest, fl, block, nxt)
                    else:
                        # reuse the block object the last merge retired (saves an allocation)
                        self._spare = None
                        tail.ptr = tptr
                        tail.size = rest
                        tail.pool = fl
                        tail.prev = block
                        tail.next = nxt
                    tail.seg = block.seg
                    key = rest << _SHIFT | tptr
                    w = 0
                    if nxt is not None or block.prev is not None:
                        # (undo cleared before stat changes: a stale undo must never pair with a
                        # new stat, in a block left free by an interrupt here)
                        block.undo = 0
                        v = block.stat = fl.alloc_deltas.get(nbytes) or fl.alloc_delta(size, nbytes)
                        if block.seg is None:   # (expandable blocks are no inactive split ones, as torch's)
                            # an inactive split block shrinks by `size`
                            w = fl.shrink_deltas.get(size) or fl.shrink_delta(size)
                            v -= w
                    elif block.undo and block.requested == nbytes:
                        # This whole segment was split for the same request last time
                        # (a whole block always has the segment's size), so block.stat
                        # and the change are the same as then.
                        v = block.undo
                    else:
                        block.undo = 0
                        v = block.stat = fl.alloc_deltas.get(nbytes) or fl.alloc_delta(size, nbytes)
                        # a new inactive split block appears
                        v += fl.split_deltas.get(rest) or fl.split_delta(rest)
                        # When free() finds the segment as [block][free rest] again, it
                        # subtracts exactly this (the rest is as large as now).
                        block.undo = v
                    block.requested = nbytes
                    cur = self._s_cur + v
                    # The lane-wise peak test costs three big-int operations; a repeated
                    # alloc/free cycle reaches the same `cur` every time, so first compare
                    # with the last value that passed it.
                    if cur != self._s_peak_ok:
                        if (self._s_peak_guarded - cur) & _GUARD != _GUARD:
                            self._s_peak_guarded = raise_peaks(self._s_peak_guarded, cur, _GUARD)
                        self._s_peak_ok = cur
                    # The tail's key is smaller than the block's, so it usually sorts into
                    # the block's own slot (always when nothing smaller is cached): then
                    # overwrite it instead of a delete plus an insort.
                    move = i > 0 and keys[i - 1] > key
                    # publish (no call until the insort)
                    if nxt is not None:
                        nxt.prev = tail
                    block.next = tail
                    block.size = size
                    self._blocks[tptr] = tail
                    block.state = _ALLOCATED
                    block.ref = ref
                    if w:
                        self._s_freed += w
                    self._s_cur = cur
                    if move:
                        del keys[i]
                        insort(keys, key)
                    else:
                        keys[i] = key
                else:
                    size = block.size
                    block.undo = 0
                    v = block.stat = fl.lanes(1 | size << 64 | nbytes << 128)
                    w = 0
                    if (block.prev is not None or block.next is not None) and block.seg is None:
                        # an inactive split block becomes active
                        w = fl.split_deltas.get(size) or fl.split_delta(size)
                        v -= w
                    block.requested = nbytes
                    cur = self._s_cur + v
                    if cur != self._s_peak_ok:
                        if (self._s_peak_guarded - cur) & _GUARD != _GUARD:
                            self._s_peak_guarded = raise_peaks(self._s_peak_guarded, cur, _GUARD)
                        self._s_peak_ok = cur
                    # publish (no call)
                    del keys[i]
                    block.state = _ALLOCATED
                    block.ref = ref
                    self._s_freed += w
                    self._s_cur = cur
                if special:
                    self._after_take(block, fl)
                return block.ptr
        except OutOfMemoryError as exc:
            # torch calls its observers after unlocking ("which might need hold the GIL")
            if _oom_hooks._oom_observers and exc.observer_args is not None:
                _oom_hooks._notify_oom(exc)
            raise

    def _find_special(self, size: int, nbytes: int, stream: int) -> Tuple[_Block, _FreeList, int]:
        """malloc's search while a capture routes allocations, blocks wait for events,
        an oversize limit is configured, or history is recorded."""
        pool = self._routes.get(stream)
        if pool is None and self._origins:
            pool = self._joined_pool(stream)
        if pool is None and self._threads:
            # a capture's route wins over use_mem_pool's: its graph holds its pool alive
            pools = self._threads.get(threading.get_ident())
            if pools:
                pool = pools[-1]
        if pool is not None:
            lists = pool.lists.get(stream) or self._new_lists(stream, pool)
        else:
            lists = self._general.get(stream) or self._new_lists(stream, None)
        if self._pending_events or self._deferred:
            unless_capturing(self._be, self._resume_events)
        fl = lists[size > SMALL_SIZE or (pool is None and self._one_range)]
        block = self._find(fl, size) or self._malloc_miss(size, nbytes, fl)
        if block.state == _ALLOCATED:
            return block, block.pool, -1      # _small_in_large handed it out
        return block, block.pool, self._slot(block)     # a small request may get a large-pool block

    @staticmethod
    def _slot(block: _Block) -> int:
        """The index of the free ``block``'s key in its free list (it is there)."""
        return bisect_left(block.pool.keys, block.size << _SHIFT | block.ptr)

    def _after_take(self, block: _Block, fl: _FreeList) -> None:
        if block.size >= self._max_split:
            self._count_up(OVERSIZE_ALLOCATIONS, 1)
        if self._pending:
            self._track_active_peak(fl.kind)
        if self._history is not None:
            st = None
            if self._ctx:
                st = block.frames = _stack()
            # torch records the size asked (orig_size), as for the frees
            self._trace("alloc", block.ptr, block.requested, fl.stream, st, fl.owner)

    def _update_special(self) -> None:
        self._special = self._needs_special(self._pow2, self._max_split)

    def _needs_special(self, pow2: bool, max_split: int) -> bool:
        """Whether malloc/free must take the general path, with the rounding and split options
        ``pow2`` and ``max_split``."""
        return bool(self._routes or self._threads or self._pending_events or self._pending or self._deferred
                    or pow2 or self._history is not None or max_split != _config.UNLIMITED)

    def free(self, ptr: int) -> None:
        """Return ``ptr`` (from :meth:`malloc`) to the cache; 0 is a no-op.

        ValueError naming the pointer for a double free or a pointer this
        allocator did not hand out; the allocator state is then unchanged.
        """
        if _finalizers:
            _drain_finalizers()
        lock = self._lock
        if _locks._running or lock._is_owned() or self._gate_owned():     # see _guards.probe
            lock = probe(lock, "free", self._gate_owned)
        with lock:     # not acquire() + try: a KeyboardInterrupt as acquire returns would keep it
            block = self._blocks.get(ptr)
            if block is None or block.state != _ALLOCATED:
                if ptr == 0 and type(ptr) is int:
                    return
                raise self._not_allocated(ptr, block)
            if self._special or block.uses:
                self._free_locked(block)
                return
            nxt = block.next
            fl = block.pool
            if (block.prev is not None or nxt is None or nxt.next is not None or nxt.state != _FREE
                    or fl.watch_whole or block.seg is not None):
                self._free_block(block, block.stat)     # _free_locked's common case (expandable blocks)
                return
            # Fast path, _free_block inlined for the common case of a block split off
            # the front of a whole free segment: merging it with the free rest makes
            # the segment whole again (so no inactive split block is left, and no peak
            # can rise).
            # Computed first, then published with plain stores and the insort last (see malloc).
            keys = fl.keys
            size = nxt.size
            j = bisect_left(keys, size << _SHIFT | nxt.ptr)
            # the allocation and the inactive split rest go away (malloc's block.undo
            # when it split this block off the whole segment)
            dec = block.undo or block.stat + (fl.split_deltas.get(size) or fl.split_delta(size))
            size += block.size
            key = size << _SHIFT | block.ptr
            move = j + 1 < len(keys) and keys[j + 1] < key   # see _free_block
            block.state = _FREE
            block.ref = None
            del self._blocks[nxt.ptr]
            block.size = size
            block.next = None
            self._spare = nxt
            self._s_freed += dec
            self._s_cur -= dec
            if block.seg is None:
                self._whole[block.ptr] = block
            if move:
                del keys[j]
                insort(keys, key)
            else:
                keys[j] = key

    def release_cached_nowait(self) -> bool:
        """Return the cached segments to the device, as the out-of-memory retry does, for the
        pinned allocator's retry on a backend whose pinned memory is device memory
        (accel.memory._release_unified).  Never waits: False, nothing done, when the lock is busy
        (the other allocator holds its own lock meanwhile, and this one's retry may be waiting
        for it)."""
        return _locks.run_locked(self._lock, False, self._release_cached)

    def _release_cached(self) -> None:
        with self._be.capture_gate:
            if self._routes or capture_underway(self._be):
                return          # event queries and frees would invalidate the capture
            self._reap_orphans()
            if self._pending_events:
                self._process_events()
            self._release_segments()
            if self._exp_segs:
                self._exp_unmap()
            self._update_special()

    def free_nowait(self, ptr: int) -> bool:
        """:meth:`free` for a finalizer, which never waits for the lock: False, nothing done,
        when it is busy (this thread may be the holder: the collector ran a ``__del__`` inside
        malloc, unknown to accel when a Ctrl-C cut its "start" callback); the caller defers."""
        return _locks.run_locked(self._lock, False, self._free_ptr_locked, ptr)

    def _free_ptr_locked(self, ptr: int) -> None:
        block = self._blocks.get(ptr)
        if block is None or block.state != _ALLOCATED:
            if ptr == 0 and type(ptr) is int:
                return
            raise self._not_allocated(ptr, block)
        self._free_locked(block)

    def _free_locked(self, block: _Block) -> None:
        """free() of an allocated ``block`` past the fast path, the lock held."""
        if self._special:
            if block.size >= self._max_split:
                self._count_down(OVERSIZE_ALLOCATIONS, 1)
            if self._history is not None:
                # torch: the free's own stack under context "all", else the allocation's
                st = _stack() if self._ctx >= _CTX_ALL else block.frames
                self._trace("free_requested", block.ptr, block.requested, block.pool.stream, st, block.pool.owner)
                if not block.uses:
                    self._trace("free_completed", block.ptr, block.requested, block.pool.stream, st,
                                block.pool.owner)
            if not block.uses:
                block.frames = None     # a pending block keeps its allocation's stack, as torch's
        if block.uses:
            self._free_with_uses(block)
        else:
            self._free_block(block, block.stat)

    def _reap_orphans(self) -> None:
        """Free the allocated blocks whose owner (weakly referenced by malloc's ``ref``) is gone
        without freeing them, the lock held.  CPython lets a KeyboardInterrupt land where no
        ordering can help: as this allocator's malloc returns, before the Buffer stores the
        pointer, and as a Buffer's ``__del__`` starts (printed and ignored: the release never
        runs).  Such a block would count as allocated for good; here (empty_cache, the
        out-of-memory retry) it is freed as its owner would have.  A block is freed once:
        each free clears ``ref`` in the step that frees it.

        Only when no release can be on its way (``_finalize.releases_settled``), checked after
        the scan: an owner that died since then (the collector, or a finalizer finding this
        lock busy) has its release pending, or its collection running, by the time of the check."""
        orphans = [b for b in self._blocks.values()
                   if b.ref is not None and b.state == _ALLOCATED and b.ref() is None]
        if orphans and _releases_settled():
            for block in orphans:
                self._free_locked(block)

    def record_stream(self, ptr: int, stream: int, device_index: Optional[int] = None) -> None:
        """Mark the allocated block at ``ptr`` as used on ``stream`` (of device
        ``device_index``, default this allocator's): after :meth:`free` it is reused only
        once the work queued on ``stream`` by then has completed.  TypeError/ValueError for a
        stream that is no handle or a device index naming no device (nothing is recorded)."""
        device = check_use(self._be, stream, device_index, self._index)
        check_stream_live(self._be, stream, device)
        with probe(self._lock, "record_stream", self._gate_owned):
            block = self._blocks.get(ptr)
            if block is None or block.state != _ALLOCATED:
                raise self._not_allocated(ptr, block)
            fl = block.pool
            if stream == fl.stream and device == self._index and self._live_list(fl):
                return      # the block's own stream: its free is ordered after that work already
            add_use(self, block, stream, device)

    def stream_uses(self, ptr: int) -> Tuple[List[Tuple[int, int]], List[Tuple[object, int]]]:
        """The uses :meth:`record_stream` noted on the allocated block at ``ptr``:
        ``(streams, closed)``, the ``(handle, device)`` of each live stream, and ``(record,
        device)`` of each stream destroyed since (its work covered by an event; the same record
        while the use is kept).  ``([], [])`` for an address that is no allocated block.  For an
        exporter (``accel._dlpack.order_after_other_uses``)."""
        return stream_uses(self, ptr, lambda: self._blocks.get(ptr), lambda block: block.state == _ALLOCATED)

    def order_after(self, waiter: int, stream: int, device_index: Optional[int] = None) -> bool:
        """``waiter`` (a stream of this allocator's device) waits on the device for the work
        queued on ``stream`` (of device ``device_index``, default this allocator's) so far,
        through one of the cached events: nothing for the caller to own or destroy (a graph RNG
        replay orders itself after the holders' last use this way, r66h).  True when the wait is
        queued, or when ``stream`` is being captured (no wait is safe there: recording into it
        would join ``waiter`` to the capture; the caller goes on unordered).  False when it
        could not be queued (the error already cleared in the runtime): the caller waits on the
        host instead.

        Locking as :func:`~accel.memory._uses.order_after`'s.  The vendor calls run with signals
        deferred and the event stays in the cache from its creation until its destroy
        (:func:`~accel.memory._uses.recorded`), so a KeyboardInterrupt leaves nothing to release."""
        return order_after(self, waiter, stream, device_index, partial(_queue_wait, self))

    def _live_list(self, fl: _FreeList) -> bool:
        """Whether ``fl`` is a free list of a live stream, not one of a destroyed stream waiting
        for its work (_Retired), whose handle value the driver may have given to a new stream
        (r64a: a use by that new stream was taken for the block's own and dropped, and the block
        was reused under the new stream's queued work)."""
        lists = (fl.owner.lists if fl.owner is not None else self._general).get(fl.stream)
        return lists is not None and (fl is lists[0] or fl is lists[1])

    def forget_stream(self, stream: int, device_index: Optional[int] = None, blocking: bool = True) -> bool:
        """``stream`` (of device ``device_index``, default this allocator's) is about to be
        destroyed; the driver may give its handle value to the next stream.  Work it has
        queued is covered by an event recorded now: blocks it used wait for that event,
        and its free lists join the default stream's once the event completed.

        With ``blocking=False`` (a finalizer) nothing waits for the lock: returns False
        when the lock is busy, else True."""
        device = self._index if device_index is None else device_index
        return _locks.run_locked(self._lock, blocking, self._forget_stream, stream, device)

    def _forget_stream(self, stream: int, device: int) -> None:
        # Covered first, forgotten after: every event is recorded (or the stream waited for)
        # before anything changes, so when neither an event nor a wait covers the stream's
        # work, everything stays keyed by the (still live) stream, the events recorded so far
        # go back to the cache, and the error propagates.
        # Interrupt safety: what changes is computed, then published in one step
        # (_locks.publish), so a KeyboardInterrupt leaves the stream wholly known (its events in
        # the cache: they leave it in the publish, see _uses.recorded; Stream.close() tries again) or
        # wholly forgotten.
        owners = [(None, self._general)] + [(pool, pool.lists) for pool in self._private.values()]
        retire = [(owner, lists[stream]) for owner, lists in owners
                  if stream in lists and (lists[stream][0].segments or lists[stream][1].segments)]
        users = self._used_on.get(stream) or ()
        covers = [(block, use) for block in users for use in (block.uses or ())
                  if type(use) is tuple and use[0] == stream]
        gates = []
        done = []
        try:
            try:
                idle = bool(retire or covers) and stream_done(self, stream, device)
                if retire:
                    gates.append(None if idle else cover(self, stream, device, gates))
                for _, use in covers:
                    gates.append(None if idle and use[1] == device else cover(self, stream, use[1], gates))
                steps = []
                if retire:
                    retired = _Retired(retire)
                    gate = gates[0]
                    if gate is None:
                        # the stream was synchronized: nothing to wait for (its own step, first:
                        # an interrupt after it leaves empty lists, forgotten by the next try)
                        self._rehome(retired)
                    else:
                        steps.append(partial(setattr, self, "_pending_events",
                                             self._pending_events + [(gate.event, device, retired)]))
                        steps += taken(self, [gate])
                        steps.append(partial(setattr, self, "_special", True))
                steps += uses_forgotten(self, stream, covers, gates[1:] if retire else gates)
                steps.append(partial(setattr, self, "_general", without(self._general, stream)))
                steps += [partial(setattr, pool, "lists", without(lists, stream))
                          for pool, lists in owners[1:] if stream in lists]
                steps.append(partial(setattr, self, "_routes", without(self._routes, stream)))
                steps.append(partial(done.append, True))
                _locks.publish(steps)
            except BaseException:
                if not done:
                    gates_back(self, gates)
                raise
        finally:
            self._update_special()

    def reachable_from(self, ptr: int, index: int) -> bool:
        """Whether device ``index``, once :meth:`add_peer` let it in, reads the block at ``ptr``
        directly: always here (add_peer grants access to every mapping, now and later)."""
        return True

    def add_peer(self, index: int) -> None:
        """Let device ``index`` access this device's memory, now and later (torch's
        ``ExpandableSegment::addPeer``): memory mapped through virtual memory is accessible
        only by the devices granted access (CUDA Driver API, cuMemSetAccess), unlike
        cudaMalloc memory.  Call it before work on device ``index`` touches memory of this
        allocator (a copy queued on its stream, a kernel with peer access).  A no-op for this
        device itself, a device already added, an allocator without mappings yet, and a device
        that cannot access this one (``can_access_peer`` False: copies between the two are
        staged by the driver)."""
        if type(index) is not int:
            raise TypeError(f"add_peer: device index must be an int, got {type(index).__name__}")
        if index == self._index or index in self._peers:
            return
        # refused now: a peer is granted access to every later mapping, so a bad one would
        # fail each of them (cuMemSetAccess: CUDA_ERROR_INVALID_DEVICE)
        check_range(index, self._be, "add_peer: ")
        if not self._be.can_access_peer(index, self._index):
            # no access can be granted to a device that cannot reach this one (cuMemSetAccess:
            # CUDA_ERROR_INVALID_DEVICE, and every later mapping would fail); copies between the
            # two go through the driver's staged path, as torch grants only peers that can (r71p)
            return
        lock = self._lock
        if _locks._running or lock._is_owned() or self._gate_owned():     # see _guards.probe
            lock = probe(lock, "add_peer", self._gate_owned)
        with lock:     # not acquire() + try: a KeyboardInterrupt as acquire returns would keep it
            if index in self._peers:
                return
            if any(seg.maps for seg in self._exp_segs):
                if capture_underway(self._be):
                    # E6: the access is a virtual-memory call (refused during a capture); a copy
                    # captured now would fault at replay without it
                    raise CaptureError(
                        f"add_peer: device {index} cannot be granted access to device {self._index}'s "
                        f"expandable-segment memory while a stream capture is underway (the virtual-memory "
                        f"access call, {self._be.vmm_access_call}, is not allowed then); "
                        f"copy between the two devices once before the capture (a warm-up), or call accel.memory.device_allocator({self._index}).add_peer({index}) "
                        f"before the capture begins")
                with self._on_device():
                    for seg in self._exp_segs:
                        for addr in seg.starts:
                            self._be.vmm_set_access(addr, seg.maps[addr][0], index)
            self._peers.append(index)

    def empty_cache(self) -> None:
        """Return every unused cached segment to the device (after waiting for the
        events of pending blocks).  CaptureError while a capture allocates to a pool."""
        if _finalizers:
            _drain_finalizers()
        with probe(self._lock, "empty_cache", self._gate_owned), self._be.capture_gate:
            if self._routes or capture_underway(self._be):
                # synchronizing events and cudaFree would invalidate a global-mode capture
                raise CaptureError("empty_cache() is not allowed while a stream capture is underway "
                                   f"(device {self._index}'s allocator); call it after capture_end() (a capture "
                                   "on any device blocks it: its event synchronizes and frees would invalidate "
                                   "a global-mode capture)")
            self._reap_orphans()
            self._synchronize_and_free_events()
            drop_done_gates(self, self._blocks.values())
            self._release_segments()
            self._exp_unmap()
            self._exp_drop_orphans(every=True)
            # the retired block object a split would reuse still names its old free list and
            # neighbours (a destroyed stream's, a freed segment's): not kept past empty_cache
            self._spare = None
            for device, events in list(self._event_cache.items()):
                with on_device(self._be, device):
                    while events:
                        # taken out first: a KeyboardInterrupt as the destroy returns must not
                        # leave a destroyed event cached (cudaErrorInvalidResourceHandle later).
                        # No call between (a pop() is one): only an interrupt exactly as the
                        # destroy starts may lose the event, as a free's start its memory.
                        event = events[-1]
                        del events[-1]
                        try:
                            self._be.event_destroy(event)
                        except Exception:
                            events.append(event)      # a failure keeps it for the next try
                            raise
                # the device's list goes too: an emptied cache holds nothing, whichever devices'
                # events it held since the last empty_cache (an interrupt here leaves it empty)
                del self._event_cache[device]

    def stats(self) -> "dict":
        """The torch.cuda.memory_stats() keys as an OrderedDict (sorted)."""
        if _finalizers:
            _drain_finalizers()
        with probe(self._lock, "stats", self._gate_owned):
            cur, peak, base, freed = self._columns()
            allocated = [c - b + f for c, b, f in zip(cur, base, freed)]
            pend, pend_base = self._pend, self._pend_base
            for q in range(3):
                for stat, src, k in ((ACTIVE, ALLOCATION, q), (ACTIVE_BYTES, ALLOCATED_BYTES, 3 + q)):
                    cur[stat + q] = cur[src + q] + pend[k]
                    peak[stat + q] = max(peak[src + q], self._active_peak[k])
                    allocated[stat + q] = allocated[src + q]
                    freed[stat + q] = freed[src + q] - (pend[k] - pend_base[k])
            scalars = dict(self._scalars)
            scalars.pop("num_device_map")       # accel's own counters: see map_stats()
            scalars.pop("num_device_unmap")
            scalars["max_split_size"] = -1 if self._max_split == _config.UNLIMITED else self._max_split
            pools = {pool_id: list(st) for pool_id, st in self._pool_reserved.items()}
        return _stats.flatten(cur, peak, allocated, freed, scalars, pools)

    def map_stats(self) -> dict:
        """Backend map/unmap calls of the expandable segments so far (accel's own keys,
        kept out of :meth:`stats`, which has exactly torch's keys):
        ``{"num_device_map": n, "num_device_unmap": m}``; reset by reset_accumulated_stats."""
        with probe(self._lock, "map_stats", self._gate_owned):
            return {"num_device_map": self._scalars["num_device_map"],
                    "num_device_unmap": self._scalars["num_device_unmap"]}

    def _columns(self):
        """(current, peak, base, freed) lists with the packed counters unpacked."""
        columns = []
        for plain, packed in ((self._cur, self._s_cur), (self._peak, self._s_peak_guarded ^ _GUARD),
                              (self._base, self._s_base), (self._freed, self._s_freed)):
            out = list(plain)
            lanes = unpack(packed, _LANES)
            for q in range(3):
                for f, stat in enumerate(_PACK_FIELDS):
                    out[stat + q] = lanes[5 * q + f]
            columns.append(out)
        return columns

    def reset_peak_stats(self) -> None:
        """Peaks become the current values (torch's resetPeakStats)."""
        with probe(self._lock, "reset_peak_stats", self._gate_owned):
            self._peak[:] = self._cur
            for st in self._pool_reserved.values():
                st[3:6] = st[0:3]
            self._s_peak_guarded = self._s_cur | _GUARD
            self._s_peak_ok = self._s_peak_ok_free = self._s_cur
            lanes = unpack(self._s_cur, _LANES)
            for q in range(3):
                self._active_peak[q] = lanes[5 * q] + self._pend[q]
                self._active_peak[3 + q] = lanes[5 * q + 1] + self._pend[3 + q]

    def reset_accumulated_stats(self) -> None:
        """Zero the allocated/freed counters and the retry/OOM/device call counts."""
        with probe(self._lock, "reset_accumulated_stats", self._gate_owned):
            self._base[:] = self._cur
            self._freed[:] = [0] * len(self._freed)
            self._s_base, self._s_freed = self._s_cur, 0
            self._pend_base[:] = self._pend
            for name in self._scalars:
                self._scalars[name] = 0
            for pool_id in list(self._pool_reserved):
                if pool_id in self._private:
                    self._pool_reserved[pool_id][6:] = [0] * 6
                else:
                    del self._pool_reserved[pool_id]     # a dead pool's entry: all zeros now

    def record_history(self, enabled: bool, max_entries: int = 100_000, stacks: bool = True, *,
                       context: int = _CTX_ALL, skip_actions: frozenset = frozenset(),
                       clear_history: bool = False) -> None:
        """Start (or stop) recording alloc/free events with time stamps for snapshots, keeping
        the newest ``max_entries``; ``stacks`` also keeps Python stacks, as much as ``context``
        (torch's RecordContext level, :mod:`accel.memory._snapfmt`) says; the actions in
        ``skip_actions`` are not recorded; ``clear_history`` forgets what was recorded.
        Stopping forgets the history and every stack.  (Arguments as
        :func:`accel.memory.record_history` checked them.)"""
        ctx = context if stacks else 0
        with probe(self._lock, "record_history", self._gate_owned):
            if enabled:
                kept = self._history if self._history is not None and not clear_history else ()
                self._history = deque(kept, maxlen=max_entries)
                self._ctx = ctx
                self._skip = frozenset(skip_actions)
            else:
                self._history = None
                self._ctx = 0
                self._skip = frozenset()
            if not self._ctx:
                for block in self._blocks.values():
                    block.frames = None
                self._seg_frames.clear()
            self._update_special()

    def set_user_metadata(self, metadata: str) -> None:
        """Record ``metadata`` as ``user_metadata`` with every history entry from now on ("" for
        none): torch's ``setUserMetadata``."""
        if not isinstance(metadata, str):
            raise TypeError(f"metadata must be a str, got {type(metadata).__name__} {metadata!r}")
        self._user_metadata = str.__str__(metadata)      # a plain str (a subclass would go into pickles)

    def user_metadata(self) -> str:
        """What :meth:`set_user_metadata` set last ("" for none)."""
        return self._user_metadata

    def allocator_settings(self) -> dict:
        """torch's ``allocator_settings`` of a snapshot, for this allocator."""
        with probe(self._lock, "allocator_settings", self._gate_owned):
            expandable = self._expandable
            if expandable is None:       # not decided before the first miss: what it would be
                want = self._config.expandable_segments
                expandable = (not self._torch_policy if want is None else want) and self._be.supports_vmm
            return _allocator_settings(self._config, expandable)

    def allocation_frames(self, ptr: int) -> Optional[list]:
        """The frames of the stack that allocated the live block at ``ptr`` (innermost first),
        or None: no such block, or no stack kept for it (accel.memory._allocation_traceback)."""
        with probe(self._lock, "allocation_frames", self._gate_owned):
            block = self._blocks.get(ptr)
            if block is None or block.state != _ALLOCATED or not block.frames:
                return None
            return _Symbols().frames(block.frames)

    def snapshot(self) -> dict:
        """``{"segments": [...], "device_traces": [...]}`` in torch's snapshot layout
        (:mod:`accel.memory._snapfmt`): segments and blocks with ``frames`` (empty without a
        stack), trace entries with ``frames`` while history keeps stacks in the trace."""
        symbols = _Symbols()
        with probe(self._lock, "snapshot", self._gate_owned):
            segments = []
            seg_frames = self._seg_frames
            for base in sorted(self._segments):
                head = self._blocks[base]
                fl = head.pool
                seg = {"device": self._index, "address": base, "total_size": self._segments[base],
                       "allocated_size": 0, "active_size": 0, "requested_size": 0,
                       "stream": fl.stream, "segment_type": _POOL_NAME[fl.kind],
                       "segment_pool_id": fl.owner.id if fl.owner is not None else (0, 0),
                       "is_expandable": False, "frames": symbols.frames(seg_frames.get(base)), "blocks": []}
                block = head
                while block is not None:
                    _snapshot_block(seg, block, symbols)
                    block = block.next
                segments.append(seg)
            for exp in self._exp_segs:
                segments.extend(self._exp_snapshot(exp, symbols))
            segments.sort(key=lambda seg: seg["address"])
            records = list(self._history) if self._history is not None else []
            if self._history is not None:
                # torch (c10/cuda/CUDACachingAllocator.cpp): the device allocator's snapshot() ends
                # with record_trace(SNAPSHOT, 0, total_active, ...), after the trace was read, so
                # later traces line up with the snapshots taken during them
                self._trace("snapshot", 0, sum(seg["active_size"] for seg in segments), 0)
        traces = [_trace_entry(record, symbols) for record in records]
        return {"segments": segments, "device_traces": traces}

    # ------------------------------------------------------------------ hot-path helpers
    def _free_block(self, block: _Block, dec: int, completing: bool = False,
                    events: Optional[list] = None, cache: Optional[list] = None) -> None:
        """Merge a block that is no longer in use with free neighbours and cache it;
        ``dec`` is the packed allocation counters still to subtract (0 if done).
        ``completing``: a pending block, which leaves ``_pending`` (and ``_deferred``) and the
        pending counts in the same step, and the last entry of ``events`` (its last event)
        with it, that event joining ``cache`` (the cache of completed events of its device).

        Interrupt safety (Ctrl-C): everything is computed first, then published with plain
        stores and the one state-changing call (insort) last, as in malloc."""
        fl = block.pool
        keys = fl.keys
        prev = block.prev
        nxt = block.next
        # inactive split blocks are classic segments' (torch leaves expandable segments out of
        # inactive_split: their free pages can always go back)
        classic = block.seg is None
        if not completing and (prev is None or prev.state != _FREE):
            # The common case, kept short: the previous block does not merge.
            if nxt is not None and nxt.state == _FREE:
                n = nxt.size
                j = bisect_left(keys, n << _SHIFT | nxt.ptr)
                if classic:
                    dec += fl.split_deltas.get(n) or fl.split_delta(n)
                size = block.size + n
                after = nxt.next
                key = size << _SHIFT | block.ptr
                move = j + 1 < len(keys) and keys[j + 1] < key
            else:
                j = -1
                size = block.size
                after = nxt
                key = size << _SHIFT | block.ptr
                move = True
            if prev is not None or after is not None:
                cur = self._s_cur - dec
                if classic:
                    cur += fl.split_deltas.get(size) or fl.split_delta(size)
                if cur != self._s_peak_ok_free:    # see malloc (a memo of its own: the two alternate)
                    if (self._s_peak_guarded - cur) & _GUARD != _GUARD:
                        self._s_peak_guarded = raise_peaks(self._s_peak_guarded, cur, _GUARD)
                    self._s_peak_ok_free = cur
                # publish (no call until the insort)
                block.state = _FREE
                block.ref = None
                if j >= 0:
                    del self._blocks[nxt.ptr]
                    self._spare = nxt
                    block.size = size
                    block.next = after
                    if after is not None:
                        after.prev = block
                self._s_freed += dec
                self._s_cur = cur
                if not move:
                    keys[j] = key
                else:
                    if j >= 0:
                        del keys[j]
                    insort(keys, key)
                if fl.watch_whole and block.seg is not None:
                    self._whole_segment_free(block)     # release_threshold: free pages count (r72c)
                return
            cur = self._s_cur - dec
            # publish (no call until the insort)
            block.state = _FREE
            block.ref = None
            if j >= 0:
                del self._blocks[nxt.ptr]
                self._spare = nxt
                block.size = size
                block.next = after
            self._s_freed += dec
            self._s_cur = cur
            if block.seg is None:
                self._whole[block.ptr] = block
            if not move:
                keys[j] = key
            else:
                if j >= 0:
                    del keys[j]
                insort(keys, key)
            if fl.watch_whole:
                self._whole_segment_free(block)
            return
        size = block.size
        start = block
        after = nxt
        lo = hi = -1        # slots of merged neighbours' keys, lo < hi
        if prev is not None and prev.state == _FREE:
            n = prev.size
            lo = bisect_left(keys, n << _SHIFT | prev.ptr)
            # a merged neighbour is an inactive split block that goes away
            if classic:
                dec += fl.split_deltas.get(n) or fl.split_delta(n)
            size += n
            start = prev
        if nxt is not None and nxt.state == _FREE:
            n = nxt.size
            j = bisect_left(keys, n << _SHIFT | nxt.ptr)
            if classic:
                dec += fl.split_deltas.get(n) or fl.split_delta(n)
            size += n
            after = nxt.next
            if lo < 0:
                lo = j
            elif j < lo:
                lo, hi = j, lo
            else:
                hi = j
        key = size << _SHIFT | start.ptr
        # The merged block's key is larger than a merged neighbour's, so it usually sorts
        # into that slot (lo, once the other one, hi, is deleted): overwrite it instead of a
        # delete plus an insort.
        if lo < 0:
            move = True
        else:
            k = lo + 1
            if k == hi:
                k += 1
            move = k < len(keys) and keys[k] < key
        split = start.prev is not None or after is not None
        if split and classic:
            # the merged block is itself an inactive split block (peaks raised early, as malloc's)
            cur = self._s_cur - dec + (fl.split_deltas.get(size) or fl.split_delta(size))
            if cur != self._s_peak_ok_free:    # see malloc (a memo of its own: the two alternate)
                if (self._s_peak_guarded - cur) & _GUARD != _GUARD:
                    self._s_peak_guarded = raise_peaks(self._s_peak_guarded, cur, _GUARD)
                self._s_peak_ok_free = cur
        else:
            cur = self._s_cur - dec
        if completing:
            if events is not None:
                last = (events[-1][0],)
            p = fl.kind
            pend = list(self._pend)
            pend[0] -= 1
            pend[p] -= 1
            pend[3] -= block.size
            pend[3 + p] -= block.size
            pending = [b for b in self._pending if b is not block]
            deferred = [b for b in self._deferred if b is not block]
            # publish (no call until the insort)
            self._pend = pend
            self._pending = pending
            self._deferred = deferred
            block.events = 0
            if events is not None:
                del events[-1]
                cache += last       # a list's in-place concatenation: no call
        # publish (no call until the insort)
        block.state = _FREE
        block.ref = None
        if start is not block:
            del self._blocks[block.ptr]
            self._spare = block
        if after is not nxt:
            del self._blocks[nxt.ptr]
            self._spare = nxt
        start.size = size
        start.next = after
        if after is not None:
            after.prev = start
        self._s_freed += dec
        self._s_cur = cur
        if hi >= 0:
            del keys[hi]
        if split:
            if move:
                if lo >= 0:
                    del keys[lo]
                insort(keys, key)
            else:
                keys[lo] = key
            return
        if start.seg is None:
            self._whole[start.ptr] = start
        if move:
            if lo >= 0:
                del keys[lo]
            insort(keys, key)
        else:
            keys[lo] = key
        if fl.watch_whole:
            self._whole_segment_free(start)

    def _whole_segment_free(self, block: _Block) -> None:
        """A segment became entirely free: a released private pool hands it to the
        general cache; a release_threshold may return it to the device."""
        fl = block.pool
        owner = fl.owner
        if owner is not None:
            # A destroyed stream's list waits for the event covering the stream's work; _rehome
            # then moves the segment (to the general cache, as here, once the pool is released).
            if owner.released() and fl in owner.lists.get(fl.stream, ()):
                self._move_to_general(block)
                self._forget_private_if_empty(owner)
            elif block.ptr in self._pool_orphans and not owner.captured:
                self._move_to_general(block)        # a destroyed stream's (see _rehome)
            else:
                return
        # (r72c: a segment a released pool handed to the general cache is cached there too)
        if self._release_threshold is not None:
            self._apply_release_threshold()

    # ------------------------------------------------------------------ slow paths
    def _count_up(self, stat: int, n: int, p: int = 0) -> None:
        cur = self._cur
        peak = self._peak
        for k in ((stat, stat + p) if p else (stat,)):
            cur[k] += n
            if cur[k] > peak[k]:
                peak[k] = cur[k]

    def _count_down(self, stat: int, n: int, p: int = 0) -> None:
        for k in ((stat, stat + p) if p else (stat,)):
            self._cur[k] -= n
            self._freed[k] += n

    def _track_active_peak(self, p: int) -> None:
        lanes, pend, peak = unpack(self._s_cur, _LANES), self._pend, self._active_peak
        for k in (0, p):
            peak[k] = max(peak[k], lanes[5 * k] + pend[k])
            peak[3 + k] = max(peak[3 + k], lanes[5 * k + 1] + pend[3 + k])

    def _allocated_bytes(self) -> int:
        return (self._s_cur >> 64) & LANE_MASK

    def _round_pow2(self, nbytes: int) -> int:
        divisions = self._config.divisions_for(nbytes)
        if divisions > 1 and nbytes > MIN_BLOCK_SIZE * divisions:
            return _roundup_power2_next_division(nbytes, divisions)
        return (nbytes + 511) & ~511

    def _oversize_mismatch(self, size: int, found: int) -> bool:
        # torch's get_free_block: never hand an oversize block to a normal request,
        # and an oversize request takes a block at most max_non_split_rounding larger.
        if size < self._max_split:
            return found >= self._max_split
        return found >= size + self._config.max_non_split_rounding

    def _find(self, fl: _FreeList, size: int, grow_instead: bool = True) -> Optional[_Block]:
        keys = fl.keys
        i = bisect_left(keys, size << _SHIFT)
        if i == len(keys):
            return None
        block = self._blocks[keys[i] & _MASK]
        if self._max_split != _config.UNLIMITED and self._oversize_mismatch(size, block.size):
            return None
        if size > SMALL_SIZE and block.next is None and block.prev is None and block.size >= 2 * size:
            other = self._split_instead(fl, i, block)
            if other is not None:
                return other
            if grow_instead and self._grow_instead(size, block, fl):
                # as malloc's hot path: the request's own segment (the miss path), so that
                # recording history, pending events, a MemPool context or roundup_power2_divisions
                # (malloc's other path, through here) do not change where a request goes
                return None
        return block       # still listed: malloc takes it out as it hands it out

    def _passed_over(self, fl: _FreeList, size: int, need: Optional[int]) -> Optional[_Block]:
        """Where the miss cannot grow by ``need`` bytes (past the cap; None: at all, a capture
        under way or the device full after the retry): the cached block best fit finds for
        ``size``, which _grow_instead may have passed over for a new segment, or None.  Checked
        before a rejection or an OutOfMemoryError is counted and reported, by the classic miss
        path and expandable segments' grow (r67a: a 4 MiB request beside a free 64 MiB
        capture-time segment was refused)."""
        if need is not None and self._cur[RESERVED_BYTES] + need <= self._allowed_bytes():
            return None
        return self._find(fl, size, grow_instead=False)

    def _malloc_miss(self, size: int, nbytes: int, fl: _FreeList) -> _Block:
        """No cached block fits: wait for pending blocks, grow, or free the cache and retry.
        Returns a free block that fits, in its free list (which may be another list than ``fl``'s:
        see _small_in_large and _oom), as _find does.  No capture begins meanwhile
        (Backend.capture_gate): what it may do depends on whether one is underway."""
        with self._be.capture_gate:
            return self._malloc_miss_gated(size, nbytes, fl)

    def _malloc_miss_gated(self, size: int, nbytes: int, fl: _FreeList) -> _Block:
        capturing = capture_underway(self._be)
        if capturing:
            # a miss _grow_instead chose (a capture began since): the cached block, as best fit
            cached = self._passed_over(fl, size, None)
            if cached is not None:
                return cached
        if self._pending_events and not capturing:
            self._process_events()
            block = self._find(fl, size)
            if block is not None:
                return block
        if fl.owner is None and not capturing and self._use_expandable():
            # graph private pools and capture-time misses keep classic segments (E6)
            if fl.kind == _SMALL:
                # the first miss of all decided for expandable segments: one address range
                # per stream, small requests included (E12)
                fl = self._general[fl.stream][1]
                block = self._find(fl, size)
                if block is not None:
                    return block
            try:
                with self._on_device():     # one device switch for the grow's driver calls, not one each
                    return self._exp_grow(size, nbytes, fl)
            except CaptureError:
                # Another thread began a capture after `capturing` was read: the driver now
                # refuses virtual-memory calls, and _exp_grow undid what it had made.  Take a
                # classic segment, as any capture-time miss does.
                capturing = True
            except _NoAddressRange:
                pass            # a classic segment, below; the next miss asks for a range again
        if fl.kind == _SMALL and not capturing and not self._torch_policy and fl.split_min <= SMALL_SIZE:
            block = self._small_in_large(size, nbytes, fl)     # (never for a no_split MemPool)
            if block is not None:
                return block
        seg_size = own_size = self._segment_size(size, fl.kind)
        if fl.kind == _LARGE and not self._torch_policy and size < MIN_LARGE_ALLOC and fl.split_min <= size:
            # (a no_split MemPool hands a block out whole: a packed segment would be one block)
            seg_size = self._packed_segment_size(size, seg_size)
        if self._config.throw_on_cudamalloc_oom:
            cached = self._passed_over(fl, size, own_size)
            if cached is not None:
                return cached
            self._reject_past_cap(own_size, size)
        if not capturing:
            self._before_grow(seg_size)
        block = self._device_alloc(seg_size, fl)
        if block is None and seg_size > own_size:
            # a segment for several requests is a bigger ask: a cap or a full device may still
            # leave room for the request's own
            seg_size = own_size
            block = self._device_alloc(seg_size, fl)
        if block is None and (self._pending_events or self._deferred) and not capturing:
            self._synchronize_and_free_events()
            block = self._find(fl, size)
            if block is not None:
                return block
        if block is None and not capturing:
            self._scalars["num_alloc_retries"] += 1
            self._reap_orphans()
            self._release_segments()
            if self._exp_segs:
                # free pages of expandable segments count too, as in torch's release_cached_blocks:
                # a MemPool's miss (classic segments) beside the general cache's range, or segments
                # kept after set_allocator_settings("expandable_segments:False")
                self._exp_unmap()
            if self._be.pinned_shares_device_memory and _oom_hooks._release_unified is not None:
                # Metal: cached pinned blocks hold the same memory (r73g); see _release_unified
                _oom_hooks._release_unified(self._be, self)
            block = self._device_alloc(seg_size, fl)
        if block is None:
            # the retry could not free the cached block _grow_instead passed over (another
            # thread's use, a cap it alone does not satisfy)
            cached = self._passed_over(fl, size, None)
            if cached is not None:
                return cached
            return self._oom(size, seg_size, fl)
        if self._history is not None:
            st = None
            if self._ctx:
                st = self._seg_frames[block.ptr] = _stack()
            self._trace("segment_alloc", block.ptr, seg_size, fl.stream, st, fl.owner)
        return block

    def _reject_past_cap(self, nbytes: int, size: int) -> None:
        """throw_on_cudamalloc_oom (torch 2.13, PR #179473): a request whose device allocation of
        ``nbytes`` (a new segment, or an expandable segment's new pages) would take reserved memory
        past the cap (per_process_memory_fraction of the device's total; the total when no
        fraction is set) is refused at once, before the allocation and before anything is freed:
        OutOfMemoryError, counted in num_oom_rejections (not in num_ooms; the out-of-memory
        observers are not called).  Nothing changes otherwise."""
        reserved = self._cur[RESERVED_BYTES]
        allowed = self._allowed_bytes()
        if reserved + nbytes <= allowed:
            return
        self._scalars["num_oom_rejections"] += 1
        fmt = _stats.format_size
        raise OutOfMemoryError(
            f"{self._be.name.upper()} out of memory. Allocation was preemptively rejected because it would "
            f"exceed per_process_memory_fraction limit. Requested size: {fmt(size)} (a new allocation of "
            f"{fmt(nbytes)} on device {self._index}, with {fmt(reserved)} reserved by accel and "
            f"{fmt(allowed)} allowed). accel refused it before any device allocation and kept its cache "
            f"(throw_on_cudamalloc_oom:True); free memory, call empty_cache(), raise the fraction, or set "
            f"throw_on_cudamalloc_oom:False to free the cache and retry instead.")

    def _allowed_bytes(self) -> int:
        if self._allowed is None:
            with self._on_device():
                total = self._be.mem_info()[1]
            self._allowed = int(total * self._config.per_process_memory_fraction)
        return self._allowed

    _backend_oom: Optional[OutOfMemoryError] = None   # the last mem_alloc OOM, until reported

    def _device_alloc(self, nbytes: int, fl: _FreeList) -> Optional[_Block]:
        """A new segment from the backend, counted, as one whole free block in ``fl``, or None
        when the device (or the per_process_memory_fraction cap) is out of memory.

        Interrupt safety: the block and the counters' new values are made before the backend
        call, and recorded right after it returns with plain stores (CPython checks for a
        signal only after a call): a KeyboardInterrupt either finds no segment or a recorded one."""
        self._backend_oom = None
        if self._config.per_process_memory_fraction < 1.0:
            if self._cur[RESERVED_BYTES] + nbytes > self._allowed_bytes():
                return None
        block = _Block(0, nbytes, fl, None, None)
        kind = fl.kind
        cur, peak = self._cur, self._peak
        nc, npk, _ = self._seg_change(kind, 1, nbytes, nbytes >= self._max_split)
        hw = max(self._reserved_hw, nc[2])
        scalars = self._scalars
        owner = fl.owner
        pool_stat = self._pool_stat_after(owner.id, kind, nbytes) if owner is not None else None
        try:
            with self._on_device():
                ptr = self._be.mem_alloc(nbytes)
                block.ptr = ptr
                self._blocks[ptr] = block
                self._segments[ptr] = nbytes
                fl.segments += 1
                cur[SEGMENT], cur[SEGMENT + kind], cur[RESERVED_BYTES], cur[RESERVED_BYTES + kind], \
                    cur[OVERSIZE_SEGMENTS] = nc
                peak[SEGMENT], peak[SEGMENT + kind], peak[RESERVED_BYTES], peak[RESERVED_BYTES + kind], \
                    peak[OVERSIZE_SEGMENTS] = npk
                self._reserved_hw = hw
                scalars["num_device_alloc"] += 1
                if pool_stat is not None:
                    self._pool_reserved[owner.id] = pool_stat
                # a whole free segment until malloc takes it (an entry no longer whole and free
                # is dropped by _whole_free_segments): an interrupt before then leaves it releasable
                self._whole[ptr] = block
                insort(fl.keys, nbytes << _SHIFT | ptr)      # the last change: a call
        except OutOfMemoryError as exc:
            # handled here (free the cache and retry, or a torch-style OOM): leave no stale
            # cudaErrorMemoryAllocation for another library's next error check
            self._be.clear_error()
            # the runtime's reason (e.g. Metal's maxBufferLength): the OOM's cause.  Kept without
            # its traceback: the frames (and through f_back every caller's, the Buffer being
            # built among them) would live until the next miss drops it here, under this lock,
            # and a Buffer's finalizer would then wait on the lock this thread holds.
            self._backend_oom = exc.with_traceback(None)
            return None
        return block

    def _seg_change(self, kind: int, nseg: int, nbytes: int, noversize: int):
        """The new values of the counters a segment (or mapping) change moves: SEGMENT and
        RESERVED_BYTES of "all" and pool ``kind``, then OVERSIZE_SEGMENTS, each by (``nseg``,
        ``nseg``, ``nbytes``, ``nbytes``, ``noversize``); as three lists (current, peak, freed)
        in that order, for the caller to store with one unpacking assignment each (no call, so
        no KeyboardInterrupt between them)."""
        idx = (SEGMENT, SEGMENT + kind, RESERVED_BYTES, RESERVED_BYTES + kind, OVERSIZE_SEGMENTS)
        delta = (nseg, nseg, nbytes, nbytes, int(noversize))
        cur, peak, freed = self._cur, self._peak, self._freed
        nc = [cur[k] + d for k, d in zip(idx, delta)]
        return (nc, [max(peak[k], c) for k, c in zip(idx, nc)],
                [freed[k] - d if d < 0 else freed[k] for k, d in zip(idx, delta)])

    def _whole_free_segments(self) -> List[_Block]:
        """Free blocks that span a whole classic segment, in the general cache and in private
        pools no graph uses any more, by size (then pool kind, then address).

        Only the segments ``_free_block`` saw become whole (``_whole``) are looked at, so
        a miss past the high-water mark costs the same with 20,000 blocks cached as with
        200 (``_bench.scaling_cost``); an entry no longer whole and free is dropped here."""
        blocks = self._blocks
        whole = []
        stale = []
        for ptr, block in self._whole.items():
            if (blocks.get(ptr) is not block or block.ptr != ptr or block.state != _FREE
                    or block.prev is not None or block.next is not None or block.seg is not None):
                stale.append(ptr)
                continue
            fl = block.pool
            owner = fl.owner
            if owner is None:
                lists = self._general
            elif owner.use_count == 0 and self._private.get(owner.id) is owner:
                lists = owner.lists
            else:
                continue                    # a pool a graph still uses keeps its segments
            if fl not in lists.get(fl.stream, ()):
                continue                    # a destroyed stream's list, until _rehome
            keys = fl.keys
            key = block.size << _SHIFT | ptr
            i = bisect_left(keys, key)
            if i < len(keys) and keys[i] == key:
                whole.append(block)
        for ptr in stale:
            del self._whole[ptr]
        whole.sort(key=lambda b: (b.size, b.pool.kind, b.ptr))
        return whole

    def _release_segments(self) -> None:
        """Return every whole free segment to the device."""
        self._release_blocks(self._whole_free_segments())

    def _release_blocks(self, victims: List[_Block]) -> None:
        if not victims:
            return
        try:
            with self._on_device():
                self._free_segments(victims)
        finally:
            for pool in [pool for pool in self._private.values() if pool.use_count == 0]:
                self._forget_private_if_empty(pool)

    def _free_segments(self, victims: List[_Block]) -> None:
        """Return whole free classic segments to the device.  Each is forgotten first (plain
        stores, no KeyboardInterrupt between them) and freed last: an interrupt as the free
        starts may leak that one segment, but a freed segment is never kept, to be handed out
        or freed again (its address may already be someone else's).  A failed free puts it
        back: it stays cached (and counted)."""
        cur, freed = self._cur, self._freed
        for block in victims:
            fl = block.pool
            ptr = block.ptr
            kind = fl.kind
            key = block.size << _SHIFT | ptr
            j = bisect_left(fl.keys, key)
            nc, _, nf = self._seg_change(kind, -1, -block.size, -(block.size >= self._max_split))
            oc, _, of = self._seg_change(kind, 0, 0, 0)
            owner = fl.owner
            if owner is not None:
                old_stat = self._pool_reserved.get(owner.id)
                pool_stat = self._pool_stat_after(owner.id, kind, -block.size)
            whole = ptr in self._whole
            st = self._seg_frames.get(ptr)
            self._pool_orphans.discard(ptr)     # (a call: before the stores below)
            del fl.keys[j]
            del self._blocks[ptr]
            del self._segments[ptr]
            if whole:
                del self._whole[ptr]
            fl.segments -= 1
            cur[SEGMENT], cur[SEGMENT + kind], cur[RESERVED_BYTES], cur[RESERVED_BYTES + kind], \
                cur[OVERSIZE_SEGMENTS] = nc
            freed[SEGMENT], freed[SEGMENT + kind], freed[RESERVED_BYTES], freed[RESERVED_BYTES + kind], \
                freed[OVERSIZE_SEGMENTS] = nf
            if owner is not None:
                self._pool_reserved[owner.id] = pool_stat
            try:
                self._be.mem_free(ptr)
            except Exception:
                if owner is not None:
                    if old_stat is not None:
                        self._pool_reserved[owner.id] = old_stat
                    else:
                        del self._pool_reserved[owner.id]
                self._blocks[ptr] = block
                self._segments[ptr] = block.size
                if whole:
                    self._whole[ptr] = block
                fl.segments += 1
                cur[SEGMENT], cur[SEGMENT + kind], cur[RESERVED_BYTES], cur[RESERVED_BYTES + kind], \
                    cur[OVERSIZE_SEGMENTS] = oc
                freed[SEGMENT], freed[SEGMENT + kind], freed[RESERVED_BYTES], freed[RESERVED_BYTES + kind], \
                    freed[OVERSIZE_SEGMENTS] = of
                insort(fl.keys, key)
                raise
            self._scalars["num_device_free"] += 1
            if ptr in self._seg_frames:
                del self._seg_frames[ptr]
            if self._history is not None:
                # torch: the releasing call's stack under context "all", else the segment's
                self._trace("segment_free", block.ptr, block.size, fl.stream,
                            _stack() if self._ctx >= _CTX_ALL else st, fl.owner)

    def _apply_release_threshold(self) -> None:
        # (during a capture, cudaFree would invalidate it; the next free does it)
        unless_capturing(self._be, self._release_over_threshold)

    def _release_over_threshold(self) -> None:
        cached = sum(block.size for block in self._whole_free_segments())
        if cached > self._release_threshold:
            self._release_until(cached - self._release_threshold, largest_first=True)
            cached = sum(block.size for block in self._whole_free_segments())
        if self._exp_segs:
            # expandable segments' free pages count too (r72c: a wholly free range stayed mapped)
            self._exp_release_over(max(self._release_threshold - cached, 0))

    # ------------------------------------------------------------------ streams and events
    def _free_with_uses(self, block: _Block) -> None:
        """Free an allocated block used on other streams: it becomes pending, waiting in
        ``_deferred`` until the events of its uses are recorded (at once, or once no capture
        is underway).  Published with plain stores (no KeyboardInterrupt in between)."""
        p = block.pool.kind
        size = block.size
        pend = list(self._pend)
        pend[0] += 1
        pend[p] += 1
        pend[3] += size
        pend[3 + p] += size
        # the allocation goes now, its requested bytes once the block is free (_complete), as
        # torch's free() and free_block() count them
        stat = block.stat - block.pool.lanes(block.requested << 128)
        block.state = _PENDING
        block.ref = None
        self._s_cur -= stat
        self._s_freed += stat
        self._pend = pend
        self._pending += (block,)
        self._deferred += (block,)
        self._special = True
        # An event recorded on a capturing stream cannot be queried afterwards, and none may be
        # queried during a capture: deferred then, as torch's insert_events_deferred_until_no_capture
        try:
            unless_capturing(self._be, self._insert_events, block)
        finally:
            self._update_special()

    def _insert_events(self, block: _Block) -> None:
        """Record an event on every stream that used the freed (pending) ``block``, which waits in
        ``_deferred`` meanwhile; it is reused once they all completed (see ``_uses.record_uses``)."""
        record_uses(self, block, self._pending_events)
        if block.events == 0:
            self._complete(block)        # takes it out of _deferred as it frees it
        else:
            deferred = [b for b in self._deferred if b is not block]
            self._deferred = deferred

    def _insert_deferred(self, strict: bool) -> None:
        """Record the events of the blocks in ``_deferred`` (freed during a capture, or whose
        use could be neither recorded nor waited for).  A block that fails again stays
        there; the first error propagates when ``strict``, after the others were handled."""
        error = None
        for block in list(self._deferred):
            try:
                self._insert_events(block)
            except Exception as exc:
                error = error or exc
        if error is not None and strict:
            raise error

    def _done(self, item) -> None:
        if type(item) is _Retired:
            self._rehome(item)
        elif not item.uses:         # else a use still waits in _deferred for its event
            self._complete(item)

    def _rehome(self, retired: _Retired, events: Optional[list] = None, cache: Optional[list] = None) -> None:
        """The destroyed stream's work completed: its segments join the default stream's lists.
        ``events``: a list whose last entry is the retired lists' event, taken out in the same
        step, the event joining ``cache`` (the cache of completed events of its device).
        Computed first, published in one step (_locks.publish): a KeyboardInterrupt leaves every
        segment in the destroyed stream's lists (still waiting for the event) or every one
        moved.  Then, each a step of its own that a later call also makes: the
        reservations left with nothing mapped are freed, a released pool's whole segments go
        to the general cache."""
        default = self._get_default_stream()
        steps = []
        released = []
        drop = False
        dead = []           # the destroyed stream's expandable segments
        # Segments of a live pool no capture used (a MemPool's): no stream made later can take
        # them from the default stream's lists (accel's streams are new handles, not torch's
        # recycled pool of 32), so each joins the general cache once wholly free, where the
        # default stream reuses it and empty_cache or an OOM retry frees it (r63h: 30
        # short-lived streams allocating 4 KiB each from one MemPool filled a 64 MiB device).
        orphans = []
        for owner, pair in retired.lists:
            lists = owner.lists if owner is not None else self._general
            targets = lists.get(default) or self._new_lists(default, owner)
            orphaned = owner is not None and not owner.captured and not owner.released()
            for fl, target in zip(pair, targets):
                if not fl.segments:
                    continue
                for base in self._segments:
                    block = self._blocks[base]
                    if block.pool is fl:
                        if orphaned:
                            orphans.append(base)
                        while block is not None:
                            steps.append(partial(setattr, block, "pool", target))
                            block = block.next
                if fl.exp is not None:
                    # every block of an expandable segment is in its stream's lists, so the
                    # first block says whose it is: the other streams' segments are not walked
                    for seg in self._exp_segs:
                        if seg.head.pool is fl:
                            steps += [partial(setattr, block, "pool", target) for block in seg.blocks()]
                            dead.append(seg)
                    if target.exp is None:
                        steps.append(partial(setattr, target, "exp", fl.exp))
                    steps.append(partial(setattr, fl, "exp", None))
                    drop = True
                steps.append(partial(setattr, target, "segments", target.segments + fl.segments))
                steps.append(partial(setattr, fl, "segments", 0))
                if fl.keys:
                    steps.append(partial(operator.setitem, target.keys, slice(None), sorted(target.keys + fl.keys)))
                    steps.append(partial(operator.setitem, fl.keys, slice(None), []))
            if owner is not None and owner.released():   # see release_pool
                released.append((owner, targets))
        if events is not None:
            steps.append(partial(operator.delitem, events, -1))
            steps.append(partial(cache.append, events[-1][0]))
        steps.append(partial(setattr, retired, "events", 0))
        _locks.publish(steps)
        if dead:
            unless_capturing(self._be, self._exp_unmap_idle, dead)
        if drop:
            self._exp_drop_orphans()
        if orphans:
            self._pool_orphans.update(orphans)
            for base in orphans:
                block = self._blocks[base]
                if block.state == _FREE and block.next is None:
                    self._move_to_general(block)
        for owner, targets in released:
            for fl in targets:
                for key in list(fl.keys):
                    block = self._blocks[key & _MASK]
                    if block.prev is None and block.next is None:
                        self._move_to_general(block)
            self._forget_private_if_empty(owner)

    def _complete(self, block: _Block, events: Optional[list] = None, cache: Optional[list] = None) -> None:
        """A pending block's work is done: cache it.  ``events``: a list whose last entry is
        the block's last event, taken out as the block is freed, the event joining ``cache``
        (see _free_block)."""
        if self._history is not None:
            self._trace("free_completed", block.ptr, block.requested, block.pool.stream, block.frames,
                        block.pool.owner)
        block.frames = None
        self._free_block(block, block.pool.lanes(block.requested << 128), True, events, cache)
        self._update_special()

    def _resume_events(self) -> None:
        """No capture is underway (any more): record the events of frees deferred during
        one, and free pending blocks whose events completed.  A deferred block that fails
        again stays deferred without an error here (the caller's work is not about it);
        empty_cache reports it."""
        if self._deferred:
            self._insert_deferred(strict=False)
        if self._pending_events:
            self._process_events()
        self._update_special()

    def _process_events(self) -> None:
        """Free pending blocks whose events have all completed (non-blocking).  Never
        called while a capture is underway (a query would invalidate it)."""
        events, self._pending_events = self._pending_events, []
        query = self._be.event_query
        try:
            while events:
                entry = events[-1]
                if query(entry[0]):
                    self._event_done(events)
                else:
                    self._pending_events.append(entry)
                    del events[-1]
        finally:
            self._pending_events += events

    def _event_done(self, events: list) -> None:
        """The last entry of ``events`` (event, device, block or _Retired) completed: take it
        out, count it, cache the event.  With no call between taking it out, the count and the
        event's return to the cache (the last event of a block frees it in the same step, in
        _free_block; a destroyed stream's moves its lists, in _rehome), so a KeyboardInterrupt
        never leaves a block waiting for nothing, nor loses the event (until r54 the event was
        cached last, after _rehome's or _complete's further calls: an interrupt in those lost
        it, one live event in the runtime each)."""
        event, device, item = events[-1]
        cache = self._event_cache.get(device)
        if cache is None:
            cache = self._event_cache[device] = []
        if type(item) is _Retired:
            self._rehome(item, events, cache)      # (one event each)
        elif item.events == 1 and not item.uses:
            self._complete(item, events, cache)
        else:
            del events[-1]
            item.events -= 1
            cache += (event,)       # a list's in-place concatenation: no call
            if item.events == 0:
                self._done(item)

    def _synchronize_and_free_events(self) -> None:
        """Wait for every pending block's events and free the blocks (torch's
        synchronize_and_free_events; counted in num_sync_all_streams).  Never called
        while a capture is underway."""
        self._scalars["num_sync_all_streams"] += 1       # every call, as torch counts
        try:
            if self._deferred:
                self._insert_deferred(strict=True)
        finally:
            self._wait_for_events()

    def _wait_for_events(self) -> None:
        if not self._pending_events:
            return
        events, self._pending_events = self._pending_events, []
        try:
            while events:
                event, device, item = events[-1]
                try:
                    self._be.event_synchronize(event)
                except AcceleratorError:
                    # The work before the event failed (a Metal command buffer in error) or the
                    # wait did: the failure is its owner's to see at its own synchronize; the
                    # block only needs the work to have ended, which a query tells.
                    if not self._be.event_query(event):
                        raise
                self._event_done(events)
        finally:
            self._pending_events += events

    # ------------------------------------------------------------------ free lists
    def _new_lists(self, stream: int, owner: Optional[_PrivatePool]) -> Tuple[_FreeList, _FreeList]:
        if isinstance(stream, bool) or not isinstance(stream, int):
            raise TypeError(f"stream must be a backend stream handle (int), got {type(stream).__name__} "
                            f"{stream!r}; pass Stream.handle")
        if not 0 <= stream < 1 << 64:       # as check_use: kept, it would cache blocks no stream reuses
            raise ValueError(f"stream must be a backend stream handle (an int in [0, 2**64)), got {stream!r}; "
                             f"pass Stream.handle")
        watch = owner is not None or self._release_threshold is not None
        whole = owner is not None and owner.no_split      # a remainder is never split off
        lists = (_FreeList(stream, _SMALL, owner, _ONE_EXA_BYTES if whole else MIN_BLOCK_SIZE, watch),
                 _FreeList(stream, _LARGE, owner, _ONE_EXA_BYTES if whole else self._large_split_min, watch))
        # Whether accel hears of the stream's destroy before it happens (the default stream, a
        # live accel Stream, a wrapped foreign one), told now, when the lists are made: a raw
        # handle destroyed unannounced whose value a later accel Stream took must not be
        # vouched for by that stream (r75g; _exp_quiesce synchronizes the device for it)
        vouched = stream == self._get_default_stream() or announced(self._index, stream)
        lists[0].vouched = lists[1].vouched = vouched
        (owner.lists if owner is not None else self._general)[stream] = lists
        return lists

    # ------------------------------------------------------------------ misc
    def _get_default_stream(self) -> int:
        if self._default_stream is None:
            self._default_stream = self._be.default_stream(self._index)
        return self._default_stream

    def _on_device(self):
        """Backend calls are device-scoped: make this allocator's device current."""
        return on_device(self._be, self._index)

    def _trace(self, action: str, addr: int, size: int, stream: int, st=None, owner=None) -> None:
        """Record an event (a tuple; snapshot() makes torch's dict of it).  Under context
        "alloc" or "all" every entry carries a stack (empty when none was kept).  ``owner``: the
        private pool of the memory (None: the general cache), its id torch 2.13's ``pool_id``."""
        if action in self._skip:
            return
        self._history.append((action, addr, size, stream, time.monotonic_ns() // 1000,
                              (st or ()) if self._ctx >= _CTX_ALLOC else None, self._user_metadata,
                              owner.id if owner is not None else (0, 0)))

    def _oom(self, size: int, tried: int, fl: _FreeList) -> _Block:
        """The device is full: a request of the general cache takes a fitting free block of a
        MemPool(use_on_oom=True) of its stream (none grows for it), as torch; else raise."""
        if self._oom_pools and fl.owner is None:
            for pool in self._oom_pools:
                lists = pool.lists.get(fl.stream)
                block = self._find(lists[fl.kind - 1], size) if lists is not None else None
                if block is not None:
                    return block
        raise self._out_of_memory(size, tried, fl.stream, fl.owner)

    def _out_of_memory(self, size: int, tried: int, stream: int, owner=None) -> OutOfMemoryError:
        """Count an OOM, record torch's ``oom`` trace entry (the rounded ``size`` asked and the
        device's free bytes) and return the error to raise."""
        self._scalars["num_ooms"] += 1
        try:
            with self._on_device():
                free, total = self._be.mem_info()
        except Exception:  # the report must not hide the OOM itself
            free = total = 0
        if self._history is not None:
            self._trace("oom", free, size, stream, _stack() if self._ctx >= _CTX_ALLOC else None, owner)
        err = OutOfMemoryError(self._oom_message(tried, free, total))
        err.__cause__, self._backend_oom = self._backend_oom, None
        # (the allowed bytes as the message gives them, _allowed_bytes)
        allowed = self._allowed_bytes() if self._config.per_process_memory_fraction < 1.0 else total
        err.observer_args = (self._index, tried, allowed, free)
        return err

    def _not_allocated(self, ptr, block) -> Exception:
        if type(ptr) is not int:
            return TypeError(f"pointer must be an int, got {type(ptr).__name__} {ptr!r}")
        if block is not None and block.state == _PENDING:
            return ValueError(f"pointer {ptr:#x} was already freed (double free; the block is "
                              f"waiting for work on other streams) on device {self._index}")
        if block is not None:
            return ValueError(f"pointer {ptr:#x} is not allocated (double free?) on device {self._index}")
        return ValueError(f"pointer {ptr:#x} was not allocated by the caching allocator of "
                          f"device {self._index} (foreign or interior pointer)")

    def _oom_message(self, tried: int, free: int, total: int) -> str:
        """torch's OOM text (c10/cuda/CUDACachingAllocator.cpp, DeviceCachingAllocator::malloc,
        TORCH_CHECK_WITH(OutOfMemoryError, ...)): "CUDA out of memory. Tried to allocate X. GPU n
        has a total capacity of T of which F is free. [A allowed; ]Of the allocated memory ...",
        so log scrapers written for torch match.  The amounts say "by accel" where torch's say
        "by PyTorch", and the advice names ACCEL_ALLOC_CONF.

        ``tried`` is the segment size the request needed (``_segment_size`` of the rounded
        request), the quantity torch prints (``format_size(alloc_size)``, alloc_size =
        get_allocation_size(round_size(n)), with or without expandable segments).  Under
        policy:torch that is torch's number for the same request: 2 MiB up to 1 MiB, 20 MiB
        below 10 MiB, else the request rounded up to 2 MiB.  Under accel's own policy it is
        the segment accel sizes: 2 MiB up to 1 MiB, else the request rounded up to 2 MiB.
        (Requests of 1 EB or more never get here: malloc refuses them first.)  ``free`` and
        ``total`` are the device's, as the runtime reported them (0 if it could not)."""
        name = self._be.name.upper()
        fmt = _stats.format_size
        allocated = self._allocated_bytes()
        reserved = self._cur[RESERVED_BYTES]
        allowed = cap = ""
        fraction = self._config.per_process_memory_fraction
        if fraction < 1.0:
            allowed = f"{fmt(self._allowed_bytes())} allowed; "
            if self._allowed_bytes() < reserved + tried:
                # (after torch's text, which names no cause: which knob refused it, r73g)
                cap = (f" The per-process memory fraction {fraction:g} caps this process: raise it with "
                       f"set_per_process_memory_fraction (1.0 lifts it).")
        return (f"{name} out of memory. Tried to allocate {fmt(tried)}. GPU {self._index} "
                f"has a total capacity of {fmt(total)} of which {fmt(free)} is free. {allowed}"
                f"Of the allocated memory {fmt(allocated)} is allocated by accel, and "
                f"{fmt(reserved - allocated)} is reserved by accel but unallocated. If reserved but "
                f"unallocated memory is large try setting ACCEL_ALLOC_CONF=max_split_size_mb:N "
                f"(or garbage_collection_threshold:0.8) to avoid fragmentation.{cap}")
