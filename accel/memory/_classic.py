"""Accel's placement rules for classic segments, and release-before-grow.

A mixin of :class:`~accel.memory._caching.DeviceCachingAllocator`, as ``_expandable``'s is: the
allocator's state lives there, these methods decide where a request goes when it is a classic
segment's (no virtual memory, ``expandable_segments:False``, graph private pools and capture-time
misses).  ``policy:torch`` keeps torch's rules (``c10/cuda/CUDACachingAllocator.cpp``); accel's
differ where torch loses memory to fragmentation, each rule with what it was measured to do on
the corpus of ``tools/replay_trace.py`` in its docstring:

* the size of a new segment: the request rounded up to 2 MiB, or room for two to four requests
  of a size whose rounding wastes over a quarter (:meth:`_packed_segment_size`);
* best fit, except that a whole free segment at least twice the request gives way to a split
  segment's free block (:meth:`_split_instead`) or to a new segment of the request's own size
  (:meth:`_grow_instead`);
* a small request that would lift reserved memory past its high-water mark takes the high end
  of a large-pool free block (:meth:`_small_in_large`);
* release-before-grow: a new segment that would pass the high-water mark is paid for with
  cached whole free segments first (:meth:`_before_grow`, :meth:`_release_for`).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import List, Optional

from . import _config
from ._blocks import (MIN_LARGE_ALLOC, ROUND_LARGE, SMALL_BUFFER, _ALLOCATED, _GUARD, _ISPLIT, _MASK,
                      _SHIFT, _SMALL, _Block, _FreeList)
from ._guards import capture_underway
from ._stats import RESERVED_BYTES, raise_peaks

#: _grow_instead (accel's rules): a whole free classic segment larger than this (torch's kLargeBuffer)
#: is carved for a smaller request only when up to four such requests fill all but 15 % of it.
KEEP_WHOLE_OVER = 20 << 20


def _segment_size_key(block: "_Block") -> int:
    return block.size


class ClassicSegments:
    """The classic-segment rules of DeviceCachingAllocator (see the module docstring)."""

    def _segment_size(self, size: int, kind: int) -> int:
        if kind == _SMALL:
            return SMALL_BUFFER
        if self._torch_policy and size < MIN_LARGE_ALLOC:
            return self._config.large_segment_size      # torch's kLargeBuffer (large_segment_size_mb)
        return (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE

    def _packed_segment_size(self, size: int, seg_size: int) -> int:
        """The size of a new classic segment for the large request ``size`` (under 10 MiB) under
        accel's rules, ``seg_size`` being the request rounded up to 2 MiB: room for k = 2..4 such
        requests, the k whose 2 MiB rounding wastes the smallest share (by at least 5 points),
        when one request's rounding wastes over a quarter of its segment and at least two of the
        last 64 such misses were within 3 % of the size; else ``seg_size``.  Records the miss.

        Why: a request just over a 2 MiB multiple wastes nearly half its segment, and the free
        tail is useless to the next request of the same size (a WaveNet-like trace: 48 blocks of
        2.197 MiB live at the peak, each alone in a 4 MiB segment, 1.571 peak reserved / peak
        live).  Measured (r47) with tools/replay_trace.py --corpus --holdout --policy none
        --variant c=expandable_segments:False --no-capacity --rounds 1, peak reserved / peak
        live, before -> after: --perturb 5 mean 1.203 -> 1.192, over 1.15 113 -> 105 of 198, worst
        1.891 -> 1.653; --perturb 9 1.210 -> 1.196, over 1.15 195 -> 185 of 330; --scale-all mean
        1.193 both, over 1.15 107 -> 101, worst 1.617 -> 1.791; recorded traces WaveNet 1.571 ->
        1.443, 26 -> 25 over 1.08; segment frees over the 33 traces 831 -> 709.  Tried: k up to 2
        (over 1.15: 119) or 3 (112).

        Measured and not adopted (r47): not carving a whole free segment larger than the
        request's own new segment (a new one made, release-before-grow returning the big one).
        With this packing it took the population to mean 1.146, 72 over 1.15, worst 1.468, but
        every such release is a cudaFree or a Metal release after a device synchronize, and in a
        steady loop they recur: 2,708 segment frees over the 33 traces replayed once (709 with
        packing alone) and 14,402 over five passes (1,741), some 140-190 per training step of the
        transformer traces, each a device synchronize.
        """
        recent = self._recent_misses
        near = 0
        for other in recent:
            if abs(other - size) * 100 <= size * 3:
                near += 1
        # recorded even if the segment below is not made (an OOM): bounded (maxlen), statistics only
        recent.append(size)
        if near < 2 or (seg_size - size) * 4 <= seg_size:
            return seg_size
        best, waste = seg_size, (seg_size - size) / seg_size
        for k in range(2, 5):
            packed = (k * size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE
            w = (packed - k * size) / packed
            if w < waste - 0.05:
                best, waste = packed, w
        return best

    def _split_instead(self, fl: _FreeList, i: int, block: _Block) -> Optional[_Block]:
        """Best fit found ``block`` (``fl.keys[i]``), a whole free segment at least twice the
        request: for a classic segment under accel's rules, the smallest larger free block of a
        segment already split, taken out of the list, or None.

        Why: carving a request out of a whole free segment pins all of it (only a whole free
        segment goes back to the device), while the free block of a segment some live block
        already pins costs nothing new.  Measured on the 25 traces of ``tools/replay_trace.py
        --corpus --holdout`` with expandable_segments:False: a beam-search decode 1.486 -> 1.137
        peak reserved over peak allocated, no trace worse.  Only the nearest 64 larger blocks are looked at."""
        if block.seg is not None or self._torch_policy or self._max_split != _config.UNLIMITED:
            return None                     # torch's rules and oversize blocks keep best fit
        keys = fl.keys
        blocks = self._blocks
        for j in range(i + 1, min(len(keys), i + 65)):
            other = blocks[keys[j] & _MASK]
            if other.prev is not None or other.next is not None:
                return other
        return None

    def _grow_instead(self, size: int, block: _Block, fl: _FreeList) -> bool:
        """Best fit found ``block``, a whole free classic segment at least twice the large request
        ``size``, and no split segment has room (_split_instead): under accel's rules, in the
        general cache, True when the segment is over four times the request's own new segment
        (``size`` rounded up to 2 MiB), or over KEEP_WHOLE_OVER and ill-fitting (below), for malloc
        to take the miss path instead: a new segment of the request's own size, release-before-grow
        returning cached whole segments (this one among them: _release_for) only if reserved memory
        would pass its high-water mark, and the out-of-memory retry freeing it if the device or
        the cap is full.

        Why: carving a small request out of a large free segment pins all of it while the request
        lives, and the next request of that segment's size then needs a new segment (a wide & deep
        trace under a cap: a 2 MiB block alone in a 32 MiB segment; a GNN: 7.8 MiB in 36 MiB).
        Measured (r65c) with tools/replay_trace.py --corpus --holdout --policy none --variant
        c=expandable_segments:False, peak reserved / peak live, before -> after: --perturb 5
        (246 replays) mean 1.192 -> 1.174, over 1.15 136 -> 115, worst 1.653 -> 1.554; --perturb 9
        1.194 -> 1.176, over 1.15 236 -> 202 of 410, worst 1.687 -> 1.554; --scale-all mean
        1.197 -> 1.178, over 1.15 134 -> 114; as recorded worst 1.443 -> 1.386, and minimum
        capacity above torch's rules on 5 traces instead of 7.  Segment frees over the 41 traces
        1,029 -> 1,179, and over five passes (--passes 5) 2,496 -> 3,556.  Other thresholds
        (--perturb 5 mean / over 1.15 / traces whose minimum capacity is above torch's): any whole
        free segment larger than the own one (r47's rule) 1.148 / 96 / 8 (tcn 1.175 -> 1.283,
        gpt_small 1.051 -> 1.099) with 4,578 segment frees; over 1.5x 1.160 / 102 / 7; 2x 1.165 /
        101 / 8; 3x 1.177 / 120 / 6; 5x 1.177 / 124 / 5.  Only when the new segment needs no
        release (reserved + own within the high-water mark): 1.182 / 125 / 5, 1,051 frees.

        Also (r68e) when the segment is over KEEP_WHOLE_OVER (20 MiB) and over the request's own
        segment, and up to four requests of this size would leave more than 15 % of it unused: a
        segment made for a large tensor is then not pinned by a 2-8 MiB block beside which no
        request of its own size fits (it stays whole for the next one, or release-before-grow
        returns it), while a segment the request divides well (16 MiB blocks in 32 MiB) is still
        carved: without that test a CNN's 16 MiB blocks passed over its 32 MiB segments and each
        training step freed and remade them (cnn_train: 15 -> 90 segment frees over three passes).
        Measured with tools/replay_trace.py --corpus --holdout --policy none --variant
        c=expandable_segments:False, peak reserved / peak live, together with _release_for's rule:
        --perturb 5 (294 replays) mean 1.1735 -> 1.1668, median 1.1466 -> 1.1401, over 1.15
        142 -> 131, worst 1.554 both; perturbation seeds 6-15 (539 replays) mean 1.1738 -> 1.1679,
        over 1.15 278 -> 265, worst 1.524 both; --passes 3 mean 1.1873 -> 1.1812; segment frees
        7,977 -> 7,919 (--perturb 5) and 2,983 -> 3,007 (--passes 3); minimum capacity lower on 5
        traces (bert_infer_dynamic_padding 1.309 -> 1.124, perceiver_io 1.266 -> 1.190, wide_deep
        1.100 -> 1.014), higher on 3 (mobilenet_eval 1.088 -> 1.107, swin_like 1.101 -> 1.118,
        two_tower 1.021 -> 1.036).  Without the 15 % test: mean 1.1633, over 1.15 128, --passes 3
        mean 1.166, but 3,455 segment frees over three passes (cnn_train's 90 among them)."""
        if block.seg is not None or self._torch_policy or self._max_split != _config.UNLIMITED or fl.owner is not None:
            return False
        # During a capture the miss path frees nothing (no cudaFree), so the new segment could
        # fail where the cached one fits: best fit then (_malloc_miss_gated's `cached` covers a
        # capture that begins after this test)
        own = (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE
        n = block.size
        if n <= 4 * own and (n <= KEEP_WHOLE_OVER or n <= own or (n - min(n // size, 4) * size) * 20 <= n * 3):
            return False
        return not capture_underway(self._be)

    def _small_in_large(self, size: int, nbytes: int, fl: _FreeList) -> Optional[_Block]:
        """A small request whose new 2 MiB small segment would lift reserved memory past
        its high-water mark (even after release-before-grow) takes the high end of the
        best-fitting free block of the same owner and stream's large pool instead, or None.

        Why: a small trace's peak is often a tiny allocation needing a whole small
        segment while the tails of large segments (their 2 MiB rounding) sit free;
        below the mark a small segment costs nothing and keeps the pools apart, as torch
        does (small blocks scattered in large segments pin them).  The high end, so the
        rest of the free block stays next to its lower neighbour and merges with it.
        The block is the large pool's (segment, stats, free list), as every block of a
        segment is.  Oversize and expandable blocks are never used.

        The high end is handed out here, allocated (malloc returns it as it is), in the same
        step as the split (plain stores, no KeyboardInterrupt between them): a split published
        before the hand-out would leave two adjacent free blocks if interrupted.  A block that
        fits exactly is returned free and listed, as _find returns one."""
        reserved = self._cur[RESERVED_BYTES]
        if reserved + SMALL_BUFFER <= self._reserved_hw:
            return None
        whole = sum(block.size for block in self._whole_free_segments())
        if reserved + SMALL_BUFFER - whole <= self._reserved_hw:
            return None                     # releasing whole free segments pays for it
        lists = (fl.owner.lists if fl.owner is not None else self._general).get(fl.stream)
        large = lists[1]
        keys = large.keys
        i = bisect_left(keys, size << _SHIFT)
        if i == len(keys):
            return None
        block = self._blocks[keys[i] & _MASK]
        if block.size >= self._max_split or block.seg is not None:
            return None
        if block.size == size:
            return block                    # malloc takes it as it takes a found block
        high = self._hand_out_high(block, large, i, size, nbytes, self._miss_ref)
        if self._special:
            self._after_take(high, large)
        return high

    def _hand_out_high(self, block: _Block, fl: _FreeList, i: int, size: int, nbytes: int, ref) -> _Block:
        """Split the free ``block`` (``fl.keys[i]``, larger than ``size``) and hand out its high
        ``size`` bytes, allocated for ``nbytes``, owned by ``ref``; the low rest stays free next
        to its lower neighbour.  Returns the new block (the caller runs _after_take).

        Interrupt safety: computed first, then the split and the hand-out published in one step
        with plain stores (no KeyboardInterrupt between them): a split published before the
        hand-out would leave two adjacent free blocks if interrupted."""
        keys = fl.keys
        rest = block.size - size
        was_split = block.prev is not None or block.next is not None
        nxt = block.next
        high = _Block(block.ptr + rest, size, fl, block, nxt)
        high.seg = block.seg
        # packed counters: ``block`` shrinks by ``size``, or, if it was a whole segment, becomes
        # a split block; ``high`` is counted as an inactive split block made and taken, as
        # malloc counts a split block it takes (a classic segment's: expandable blocks are no
        # inactive split ones, as torch's)
        classic = block.seg is None
        w = (fl.split_deltas.get(size) or fl.split_delta(size)) if classic else 0
        high.stat = v = fl.lanes(1 | size << 64 | nbytes << 128)
        high.requested = nbytes
        freed = w
        if was_split:
            shrink = fl.lanes(size << (_ISPLIT + 64)) if classic else 0
            d = v - shrink
            freed += shrink
        else:
            d = v + (fl.split_deltas.get(rest) or fl.split_delta(rest))
        cur = self._s_cur + d
        if (self._s_peak_guarded - cur) & _GUARD != _GUARD:      # raised early, as malloc's
            self._s_peak_guarded = raise_peaks(self._s_peak_guarded, cur, _GUARD)
        # the rest keeps the block's address with a smaller size, so its key sorts at or before
        # the block's slot: usually into it (overwritten), else a delete and an insort (malloc's)
        key = rest << _SHIFT | block.ptr
        move = i > 0 and keys[i - 1] > key
        # publish (no call until the insort)
        block.undo = 0
        if nxt is not None:
            nxt.prev = high
        block.next = high
        block.size = rest
        self._blocks[high.ptr] = high
        high.state = _ALLOCATED
        high.ref = ref
        self._s_cur = cur
        self._s_freed += freed
        if move:
            del keys[i]
            insort(keys, key)
        else:
            keys[i] = key
        return high

    def _before_grow(self, seg_size: int) -> None:
        """Decide whether cached segments go back to the device before a new one is made."""
        reserved = self._cur[RESERVED_BYTES]
        gc = self._config.garbage_collection_threshold
        if gc and reserved + seg_size > gc * self._allowed_bytes():
            self._release_segments()
            return
        if self._torch_policy:
            return
        # Release-before-grow: a new segment that would lift reserved memory above
        # its high-water mark is paid for with unused cached segments first, so
        # fragmentation of the cache cannot make the footprint creep upwards.
        excess = reserved + seg_size - self._reserved_hw
        if excess <= 0:
            return
        self._release_for(excess)

    def _release_for(self, nbytes: int) -> None:
        """Release-before-grow's victims: the smallest whole free segment of ``nbytes`` or more
        alone, else whole free segments smallest first until ``nbytes`` went back (or none is left).

        Smallest first: big segments can still serve most requests by splitting (measured on the
        shared traces: 1.051 vs 1.083 for largest-first on gpt_small).  One segment that covers the
        excess alone, where there is one, rather than several smaller ones: one device free (each
        a device synchronize) instead of several, and the small segments, which more requests fit,
        stay.  Measured alone (r68e, the population of _grow_instead): peak reserved / peak live
        the same (--perturb 5 mean 1.1738 vs 1.1735), segment frees over three passes 2,983 ->
        2,883; with _grow_instead's KEEP_WHOLE_OVER rule see there.  (Tried: largest first, mean
        1.1705 but a recorded worst of 1.424; the subset of least overshoot, 1.1733.)"""
        whole = self._whole_free_segments()       # by size, smallest first
        for block in whole:
            if block.size >= nbytes:
                self._release_blocks([block])
                return
        self._release_until(nbytes, largest_first=False, whole=whole)

    def _release_until(self, nbytes: int, largest_first: bool, whole: Optional[List[_Block]] = None) -> None:
        """Return whole free segments to the device until at least ``nbytes`` went back
        (or none is left); ``whole``: _whole_free_segments(), where the caller has it."""
        victims = []
        if whole is None:
            whole = self._whole_free_segments()
        for block in sorted(whole, key=_segment_size_key, reverse=largest_first):
            if nbytes <= 0:
                break
            victims.append(block)
            nbytes -= block.size
        self._release_blocks(victims)
