"""The caching allocator's data structures: a block of a segment, the sorted free lists that
find the best fit with ``bisect``, the in-place edits that keep those lists sorted without a
copy, and the packed counter lanes a block's statistics live in (``_stats.LANE``).

Shared by the classic segments (``_caching``) and the expandable ones (``_expandable``); the
invariants the blocks keep are listed in ``_caching``'s docstring (classic) and
``_expandable``'s (E1-E14).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Dict, List

from . import _stats
from ._snapfmt import Symbols as _Symbols
from ._stats import ALLOCATED_BYTES, ALLOCATION, INACTIVE_SPLIT, INACTIVE_SPLIT_BYTES, REQUESTED_BYTES

# PyTorch's constants (c10/core/AllocatorConfig.h).
MIN_BLOCK_SIZE = 512          # kMinBlockSize: every size is rounded to a multiple
SMALL_SIZE = 1 << 20          # kSmallSize: requests up to this use the small pool
SMALL_BUFFER = 2 << 20        # kSmallBuffer: small-pool segment size
MIN_LARGE_ALLOC = 10 << 20    # kMinLargeAlloc
ROUND_LARGE = 2 << 20         # kRoundLarge: large segments are a multiple of this

_SHIFT = 64
_MASK = (1 << 64) - 1
_SMALL, _LARGE = 1, 2          # pool index into the stats lists (0 is "all")
_FREE, _ALLOCATED, _PENDING = 0, 1, 2
_POOL_NAME = {_SMALL: "small", _LARGE: "large"}

# Packed hot-path counters (see _stats.LANE): for pool q (0 all, 1 small, 2 large)
# lanes 5q+0..5q+4 hold allocation count, allocated bytes, requested bytes,
# inactive-split count, inactive-split bytes.  A change for pool p is built in
# the "all" lanes and copied to pool p's lanes with one shift.
_LANES = 15
_GUARD = _stats.guard(_LANES)
_PACK_FIELDS = (ALLOCATION, ALLOCATED_BYTES, REQUESTED_BYTES, INACTIVE_SPLIT, INACTIVE_SPLIT_BYTES)
_POOL_SHIFT = {_SMALL: 5 * 64, _LARGE: 10 * 64}
_ISPLIT = 192            # bit offset of the inactive-split lanes within a pool
_MEMO_LIMIT = 4096


class _NoAddressRange(Exception):
    """No virtual address range could be reserved for a stream's expandable segment."""


class _Block:
    __slots__ = ("ptr", "size", "requested", "stat", "undo", "pool", "prev", "next", "state", "uses",
                 "events", "frames", "seg", "ref")

    def __init__(self, ptr, size, pool, prev, next):
        self.ptr = ptr
        self.size = size
        self.pool = pool
        self.prev = prev
        self.next = next
        self.state = _FREE
        self.requested = 0
        self.stat = 0         # packed counters this allocation added (see _LANES)
        self.undo = 0         # see malloc's whole-segment split
        self.uses = None      # other uses (record_stream): (stream, device) pairs and _Gates
        self.events = 0       # outstanding events while pending
        self.frames = None    # allocation stack (_snapfmt.stack) while history keeps stacks
        self.ref = None       # while allocated: a weak reference to the owner (see _reap_orphans)
        self.seg = None       # the expandable segment (_expandable.Segment) it lies in, else None


class _FreeList:
    """Free blocks of one owner (general cache or a private pool), stream, and size class."""

    __slots__ = ("keys", "stream", "kind", "owner", "split_min", "shift", "alloc_deltas", "split_deltas",
                 "watch_whole", "segments", "exp", "shrink_deltas", "vouched")

    def __init__(self, stream, kind, owner, split_min, watch_whole):
        self.keys: List[int] = []
        self.segments = 0              # segments whose blocks belong to this list
        self.exp = None                # the expandable segment this list grows, once made
        self.stream = stream
        self.vouched = False           # accel hears of the stream's destroy first (see _new_lists)
        self.kind = kind
        self.owner = owner
        self.split_min = split_min     # smallest remainder worth splitting off
        self.watch_whole = watch_whole  # call _whole_segment_free when a segment becomes free
        self.shift = _POOL_SHIFT[kind]
        # Memos of packed counter changes, as training repeats the same sizes:
        # request nbytes -> +1 allocation of round(nbytes); block bytes -> +1 inactive split block.
        self.alloc_deltas: Dict[int, int] = {}
        self.split_deltas: Dict[int, int] = {}
        self.shrink_deltas: Dict[int, int] = {}     # block bytes -> an inactive split block shrinks by them

    def lanes(self, value: int) -> int:
        """A packed change for the "all" lanes, copied to this pool's lanes."""
        return value | value << self.shift

    def alloc_delta(self, size: int, nbytes: int) -> int:
        return _remember(self.alloc_deltas, nbytes, self.lanes(1 | size << 64 | nbytes << 128))

    def shrink_delta(self, nbytes: int) -> int:
        return _remember(self.shrink_deltas, nbytes, self.lanes(nbytes << (_ISPLIT + 64)))

    def split_delta(self, nbytes: int) -> int:
        return _remember(self.split_deltas, nbytes, self.lanes((1 | nbytes << 64) << _ISPLIT))


def _list_edits(keys: List[int], gone, new) -> tuple:
    """The in-place edits that take the sorted ``keys`` to ``sorted(keys - gone + new)``, for at
    most two keys each way: ``((d1, d2), (p1, k1), (p2, k2))``: delete index d1, then d2 (d1 > d2),
    then insert k1 at p1, then k2 at p2; -1 where there is nothing to do.  Why: a caller publishes
    them as plain statements (``del keys[d]``, ``keys[p:p] = (k,)``: no call, so no KeyboardInterrupt
    between them), where copying the list to publish it with one store cost time proportional to
    every block cached, at every map and unmap."""
    dels = sorted((bisect_left(keys, k) for k in gone), reverse=True)
    ins = sorted(((bisect_left(keys, k) - sum(1 for d in dels if keys[d] < k), k) for k in new), reverse=True)
    dels += [-1] * (2 - len(dels))
    ins += [(-1, 0)] * (2 - len(ins))
    return tuple(dels), ins[0], ins[1]


def _remember(memo: Dict[int, int], key: int, value: int) -> int:
    """Store ``value`` in ``memo`` (emptied first when full: bounded whatever the sizes) and return it."""
    if len(memo) >= _MEMO_LIMIT:
        memo.clear()
    memo[key] = value
    return value


def _snapshot_block(seg: dict, block, symbols: _Symbols) -> None:
    """Append ``block`` to snapshot segment ``seg`` (torch's block layout: ``frames`` always,
    empty when no stack was kept) and count it."""
    state = ("active_allocated" if block.state == _ALLOCATED else
             "active_pending_free" if block.state == _PENDING else "inactive")
    entry = {"address": block.ptr, "size": block.size,
             "requested_size": block.requested if block.state != _FREE else 0, "state": state,
             "frames": symbols.frames(block.frames)}
    if block.state == _ALLOCATED:
        seg["allocated_size"] += block.size
    if block.state != _FREE:
        # torch sums the requested size of active blocks, pending ones too (snapshot())
        seg["active_size"] += block.size
        seg["requested_size"] += block.requested
    seg["blocks"].append(entry)
