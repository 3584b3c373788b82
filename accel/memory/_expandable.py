"""Expandable segments: one growing virtual address range per (stream, pool) of the
general cache, backed by physical pages mapped and unmapped on demand (issue 15 item 2;
torch's ``ExpandableSegment`` in ``c10/cuda/CUDACachingAllocator.cpp``).

A segment is a reservation (``vmm_reserve``) of ``size`` bytes at ``base``.  Its
blocks tile the whole reservation, in address order, as a doubly linked list like a
classic segment's; a block is allocated, pending, free (cached, in a free list) or
*unmapped* (no physical memory behind it, in no free list).  Mappings are runs of
pages: one ``vmm_create`` of ``n`` pages mapped once (``vmm_map``), so a trace needs
few map calls; a mapping is unmapped only whole, because cuMemUnmap refuses a
sub-range of a mapping (CUDA Driver API, cuMemUnmap: "cannot unmap a sub-range";
the simulator enforces it).

Invariants (checked by ``tests/test_memory_expandable.py`` after every operation):

* E1  the blocks of a segment tile ``[base, base + size)`` exactly, without gaps;
* E2  no two adjacent blocks are both free, nor both unmapped (merged eagerly);
* E3  a mapping lies entirely inside mapped (non-unmapped) blocks, and every mapped
      byte belongs to exactly one mapping: the mappings tile the mapped blocks;
* E4  an unmapped block starts and ends on page (granularity) boundaries;
* E5  reserved bytes (the stats) == the sum of the sizes of all mappings;
* E6  nothing is mapped or unmapped while a stream capture is underway (the backend
      refuses: a capture-time miss in the general cache takes a classic segment);
* E7  before a mapping is unmapped, the work that may touch it completed (cuMemUnmap does
      not wait for queued work): the streams owning the free blocks it lies in were
      synchronized (a free block's only queued work is its own stream's: uses recorded on
      other streams keep a block pending), or the whole device where accel cannot vouch
      for one of those handles (``_exp_quiesce``); for the free pieces of a destroyed
      stream's segment, the event covering that stream's work completed
      (``_exp_unmap_idle``);
* E8  (retired: small requests now share the large pool's range, E12, where a small block
      may cross a page boundary as any block does);
* E9  physical memory is created and mapped in pieces (``pieces``): a new page the request's
      block does not cover whole (it shares it with a neighbour, or with the free tail
      after the block) is a piece of its own; the pages the block covers whole are cut
      into equal runs of at most footprint / ``PIECE_SHARE`` pages (at least one), the
      footprint being the most memory ever reserved, this grow included.  A mapping is
      unmapped only whole, so a shared page, the one most likely to stay pinned by a
      neighbour after the block is freed, never pins the block's other pages; a piece a
      live block pins holds back at most about 1/32 of the footprint, while a big block of
      a big footprint still needs few map calls;
* E10 reserved memory passes its high-water mark only after every free piece was
      unmapped (``_exp_unmap``), or while a capture is underway (classic segments);
* E11 reservations are bounded by live streams: a destroyed stream's segment joins the
      default stream's lists once its work is done, its free pieces are unmapped then, and
      its reservation is freed once nothing in it is mapped (blocks still allocated keep it),
      or kept as the allocator's one spare range, which the next new segment takes instead
      of reserving (a stream made per step reserves once, not per step);
      empty_cache frees every reservation with nothing mapped, the spare too; a first request that
      fails leaves no reservation behind; a reservation the driver refuses for want of
      address space (out of memory from cuMemAddressReserve / zeVirtualMemReserve, the
      device's memory untouched) sends that miss to a classic segment, and the stream's
      next miss asks again;
* E12 one address range per stream for every request size: once the general cache uses
      expandable segments, requests of at most 1 MiB take the large pool's free lists and
      segment, best fit among all its mapped free blocks (graph private pools, MemPools,
      capture-time misses and ``policy:torch`` keep both pools).  Their blocks are the large pool's, in
      the stats too, as every block of a segment is (torch's memory_stats agree with
      memory_snapshot segment by segment, and test_cuda_multigpu checks that they do).
      Why: a small pool of its own maps pages that hold a few small blocks beside the large
      pool's partly used pages; on the 33 traces and their perturbed copies
      (``tools/replay_trace.py --perturb``) the shared range put 30 % fewer replays over
      1.08x peak live and needed a third fewer map calls, at the cost of workloads whose
      small blocks outlive the large ones they were placed among (a DLRM-like model).
* E13 a request carved out of a larger free block takes the end of it that touches fewer
      pages no other live block holds (``high_end_pins_fewer``), the low end on a tie.  A free
      block's end that is not page-aligned shares its page with a live (or pending) neighbour
      (a free neighbour would have merged; an unmapped one ends on a page boundary, E4), so
      that page is held anyway; the low end by habit pinned a page the high end did not need,
      and the unmap pass could not take it back while the block lived.  Measured on the
      perturbed populations (``tools/replay_trace.py --perturb``): 198 replays over 1.15x peak
      live 15 -> 11, over 1.08 59 -> 58, worst 1.273 -> 1.243; with 9 copies over 1.08 98 -> 93.
      A block just mapped goes where ``_exp_create`` planned its pieces for (the same test).
* E14 the stats count an expandable segment's mapped bytes as reserved, but the segment in no
      ``segment.*`` counter and its free blocks in no ``inactive_split*`` one, as torch's
      allocator does (``alloc_block`` returns before counting a segment for an expandable
      block; ``free_block``: "fully free pages of expandable blocks can always be freed ... so we
      simply just exclude expandable segments from inactive_split").  torch's own consistency
      check of memory_stats against memory_snapshot (test_cuda_multigpu) counts the same way,
      and accel, unlike torch, lets classic segments (MemPools, captures) live beside them.

Measured with ``tools/replay_trace.py --corpus`` and ``--holdout`` (11 corpus traces and 22
recorded after the tuning): pieces aligned to a buddy scheme regardless of the block pinned
whole runs behind shared pages (three of the first seven held-out traces over 1.08x peak
allocated, up to 1.133x); single pages for everything need up to 370 map calls; this rule
keeps map calls near the buddy scheme's (at most 215) and leaves eight of the 33 traces over
1.08x, each from slack inside pages that live blocks pin (README, "The allocator on real
traces", which also lists the placement changes tried against it and rejected).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Dict, List, Optional, Tuple

from .._errors import AcceleratorError, CaptureError, OutOfMemoryError
from . import _config
from ._snapfmt import CTX_ALL as _CTX_ALL, Symbols as _Symbols, stack as _stack
from ._stats import RESERVED_BYTES
from ._blocks import (SMALL_SIZE, _FREE, _MASK, _POOL_NAME, _SHIFT, _SMALL, _Block, _FreeList, _NoAddressRange,
                      _list_edits, _snapshot_block)

UNMAPPED = 3       # block state (after _blocks' _FREE, _ALLOCATED, _PENDING)
PIECE_SHARE = 32   # a piece is at most the footprint over this (E9)


class Segment:
    """One reservation and its mappings (start address -> (size, handle))."""

    __slots__ = ("base", "size", "kind", "head", "holes", "maps", "starts", "mapped")

    def __init__(self, base: int, size: int, kind: int):
        self.base = base
        self.size = size
        self.kind = kind                      # _SMALL or _LARGE (fixed; blocks may change lists)
        self.head = None                      # first block of the chain
        self.holes = set()                    # its unmapped blocks (place looks only at these)
        self.maps: Dict[int, Tuple[int, int]] = {}
        self.starts: List[int] = []           # sorted mapping starts
        self.mapped = 0                       # bytes mapped

    def maps_within(self, lo: int, hi: int) -> List[Tuple[int, int]]:
        """Mappings (start, size) lying entirely inside ``[lo, hi)``."""
        out = []
        i = bisect_left(self.starts, lo)
        starts = self.starts
        while i < len(starts) and starts[i] < hi:
            a = starts[i]
            n = self.maps[a][0]
            if a + n <= hi:
                out.append((a, n))
            i += 1
        return out

    def blocks(self):
        block = self.head
        while block is not None:
            yield block
            block = block.next


def place(seg: Segment, size: int, gran: int, free_state: int):
    """Where to map pages so that ``size`` bytes become one free block: the hole
    (unmapped block) needing the fewest new bytes, joined with a free neighbour; ties
    go to the lowest address.  Returns ``(hole, addr, need)`` or None.

    Why holes and not only the end: unmapping free pages in the middle (to stay under
    the high-water mark) leaves holes; refilling the best-fitting one keeps the
    address range compact and reuses the free neighbours' bytes, so fewer new bytes
    are mapped than at the end."""
    best = None
    for hole in seg.holes:
        before = hole.prev.size if hole.prev is not None and hole.prev.state == free_state else 0
        after = hole.next.size if hole.next is not None and hole.next.state == free_state else 0
        options = []
        need = -(-max(size - before, 0) // gran) * gran
        if need <= hole.size:
            options.append((need, hole.ptr))                          # grow the free block before
        need = -(-max(size - after, 0) // gran) * gran
        if need <= hole.size:
            options.append((need, hole.ptr + hole.size - need))       # grow the free block after
        if before + hole.size + after >= size:
            options.append((hole.size, hole.ptr))                     # fill the hole, join both
        for need, addr in options:
            if need == 0:
                continue
            if best is None or (need, addr) < (best[2], best[1]):
                best = (hole, addr, need)
    return best


def joined(hole, addr: int, need: int, free_state: int):
    """The free neighbours ``(before, after)`` (each a block or None) that the ``need`` bytes
    mapped at ``addr`` inside unmapped block ``hole`` join: the free block ending where the new
    pages start, and the one starting where they end."""
    before = (hole.prev if addr == hole.ptr and hole.prev is not None and hole.prev.state == free_state
              else None)
    after = (hole.next if addr + need == hole.ptr + hole.size and hole.next is not None
             and hole.next.state == free_state else None)
    return before, after


def high_end_pins_fewer(a: int, b: int, size: int, gran: int) -> bool:
    """Whether ``size`` bytes at the high end of the free block ``[a, b)`` touch fewer pages
    that no live block holds than at its low end (E13).  An end of the block that is not
    page-aligned shares its page with a live neighbour: that page costs nothing."""
    if not b % gran:
        return False          # the high end's last page would be a page of its own
    first = a // gran         # the block's first page, held by the left neighbour if a % gran
    last = (b - 1) // gran    # its last page, held by the right neighbour
    left_held = a % gran != 0
    low_last = (a + size - 1) // gran
    low = low_last - first + 1 - left_held - (low_last == last and (not left_held or last != first))
    high_first = (b - size) // gran
    high = last - high_first + 1 - 1 - (left_held and high_first == first and first != last)
    return high < low


def pieces(addr: int, need: int, gran: int, lo: int, hi: int, most: int) -> List[Tuple[int, int]]:
    """Split the ``need`` bytes mapped at ``addr`` into pieces ``[(address, size)]`` (E9),
    for a request whose block will be ``[lo, hi)``: the pages wholly inside the block in
    equal runs of at most ``most`` pages, every other page alone."""
    end = addr + need
    first = max(addr, lo + (-(lo - addr) % gran))      # pages are aligned as addr is
    last = min(end, hi - (hi - addr) % gran)
    if last <= first:
        return [(a, gran) for a in range(addr, end, gran)]
    out = [(a, gran) for a in range(addr, first, gran)]
    n = (last - first) // gran
    runs = -(-n // most)
    at = first
    for i in range(runs):
        size = (n * (i + 1) // runs - n * i // runs) * gran
        out.append((at, size))
        at += size
    out += [(a, gran) for a in range(last, end, gran)]
    return out


def _smallest_first(victims: list, excess: int) -> list:
    """Of the free pieces ``victims`` (``(address, size, segment, free block)``), those of the
    smallest free blocks first (then by address), until their bytes cover ``excess``."""
    victims.sort(key=lambda v: (v[3].size, v[0]))
    chosen = []
    for v in victims:
        chosen.append(v)
        excess -= v[1]
        if excess <= 0:
            break
    return chosen


class ExpandableSegments:
    """The caching allocator's expandable segments (E1-E14 above), as methods of
    :class:`~accel.memory._caching.DeviceCachingAllocator`, whose state (``self._exp_segs``,
    the free lists, the stats, the lock the callers hold) they use."""

    # Free blocks of an expandable segment live in the ordinary free lists (best fit over
    # mapped free space); unmapped blocks are in no list and not in self._blocks.
    def _use_expandable(self) -> bool:
        use = self._expandable
        if use is None:
            use, gran = self._decide_expandable(self._config)
            if use:
                self._gran = gran
            self._expandable = use
            self._one_range = use and not self._torch_policy     # torch's rules keep two (E12)
        return use

    def _decide_expandable(self, config: _config.AllocConfig) -> Tuple[bool, int]:
        """Whether ``config`` gives expandable segments on this device, and the granularity."""
        want = config.expandable_segments
        if want is None:
            # on where the backend has virtual memory; policy:torch keeps torch's default (off)
            want = not self._torch_policy
        if want and self._be.supports_vmm:
            with self._on_device():
                if self._be.vmm_supported(self._index):
                    return True, self._be.vmm_granularity(self._index)
        return False, 0

    def _exp_new(self, fl: _FreeList) -> Segment:
        """Reserve the address range of ``fl``'s expandable segment: the device's total
        memory rounded up to the granularity, so it can grow as far as the device can."""
        gran = self._gran
        # made first, recorded as the reserve returns (no call before the append): a
        # KeyboardInterrupt finds no reservation or a recorded one
        seg = Segment(0, 0, fl.kind)
        hole = _Block(0, 0, fl, None, None)
        hole.state = UNMAPPED
        hole.seg = seg
        seg.head = hole
        seg.holes.add(hole)
        with self._on_device():
            size = self._exp_range
            if not size:    # the device's total memory does not change: asked once, not per stream
                size = self._exp_range = -(-self._be.mem_info()[1] // gran) * gran
            base = self._exp_spare
            if base:
                self._exp_spare = 0     # taken with plain stores only, up to the append
            else:
                base = self._be.vmm_reserve(self._index, size)
            seg.base = hole.ptr = base
            seg.size = hole.size = size
            fl.exp = seg
            fl.segments += 1
            self._exp_segs.append(seg)
        return seg

    def _exp_create(self, seg: Segment, plan, size: int, fl: _FreeList) -> Optional[List[Tuple[int, int, int]]]:
        """Physical memory for the ``need`` bytes at ``addr`` that ``plan`` (from place)
        maps for a request of ``size`` from ``fl``, one handle per piece (E9):
        ``[(address, size, handle)]``, or None when the device (or the
        per_process_memory_fraction cap) has no room.  Nothing is kept on any failure.

        Interrupt safety: each handle waits in ``_unreleased`` (counted as reserved) from the
        moment its create returns until _exp_map records its mapping, so a KeyboardInterrupt
        anywhere leaves it to the next _exp_release instead of losing it."""
        hole, addr, need = plan
        if self._config.per_process_memory_fraction < 1.0:
            if self._cur[RESERVED_BYTES] + need > self._allowed_bytes():
                return None
        # the request's block: the end malloc will take (E13) of the free block _exp_map makes
        # (the new pages joined with the free blocks before and after them)
        before, after = joined(hole, addr, need, _FREE)
        lo = before.ptr if before is not None else addr
        end = addr + need + (after.size if after is not None else 0)
        if (end - lo - size >= fl.split_min and size < self._max_split
                and high_end_pins_fewer(lo, end, size, self._gran)):
            lo = end - size
        made = []
        kind = seg.kind
        unreleased = self._unreleased
        cur, peak = self._cur, self._peak
        r, rk = RESERVED_BYTES, RESERVED_BYTES + kind
        try:
            with self._on_device():
                gran = self._gran
                most = max(self._reserved_hw, cur[r] + need) // (gran * PIECE_SHARE) or 1   # E9
                for a, n in pieces(addr, need, gran, lo, lo + size, most):
                    item = (a, n)
                    handle = self._be.vmm_create(self._index, n)
                    # recorded with no call in between (CPython checks for a signal after a call)
                    cur[r] += n
                    cur[rk] += n
                    if cur[r] > peak[r]:
                        peak[r] = cur[r]
                    if cur[rk] > peak[rk]:
                        peak[rk] = cur[rk]
                    unreleased.append((handle, n, kind, None))
                    made.append(item + (handle,))
        except OutOfMemoryError:
            self._be.clear_error()
            self._exp_discard()
            return None
        except BaseException:
            self._exp_discard()
            raise
        return made

    def _exp_discard(self) -> None:
        """Release what ``_unreleased`` holds (unmapping what is still mapped) while the error
        of a failed grow propagates: one whose unmap or release fails waits there, counted
        as reserved, for the next unmap."""
        try:
            self._exp_release()
        except Exception:
            self._be.clear_error()

    def _exp_grow(self, size: int, nbytes: int, fl: _FreeList) -> _Block:
        """No mapped free block fits: map a run of pages into ``fl``'s segment.  Free
        mappings are unmapped first when the new pages would lift reserved memory above
        its high-water mark; on OOM every free mapping of the device is unmapped and the
        create retried once."""
        if any(u[3] is not None for u in self._unreleased):
            # A piece of a grow undone while its unmap was refused (a capture began in another
            # thread between two pieces) is still mapped where its segment now has a hole, which
            # place() may pick: unmap it first (a failure propagates; nothing was changed).
            self._exp_release()
        seg = fl.exp
        if seg is None:
            try:
                seg = self._exp_new(fl)
            except OutOfMemoryError:
                # cuMemAddressReserve / zeVirtualMemReserve out of memory: the process's virtual
                # address space is full (each range is the device's whole memory), not the device
                self._be.clear_error()
                raise _NoAddressRange() from None
            try:
                return self._exp_grow_in(seg, size, nbytes, fl)
            finally:
                if seg.mapped == 0:
                    # a first request that failed, or that a cached block served after all
                    # (_passed_over), leaves no reservation behind
                    self._exp_drop(seg)
        return self._exp_grow_in(seg, size, nbytes, fl)

    def _exp_grow_in(self, seg: Segment, size: int, nbytes: int, fl: _FreeList) -> _Block:
        gran = self._gran
        plan = place(seg, size, gran, _FREE)
        if self._config.throw_on_cudamalloc_oom:
            # (no plan: the request is larger than the range, the device's whole memory)
            need = plan[2] if plan is not None else size
            cached = self._passed_over(fl, size, need)
            if cached is not None:
                return cached
            self._reject_past_cap(need, size)
        if plan is not None:
            excess = self._cur[RESERVED_BYTES] + plan[2] - self._reserved_hw
            if excess > 0:
                plan = self._exp_unmap_enough(seg, size, excess)
                if plan is None or self._cur[RESERVED_BYTES] + plan[2] > self._reserved_hw:
                    self._exp_unmap()
                    self._release_until(excess, largest_first=False)     # classic segments, if any
                    plan = place(seg, size, gran, _FREE)
        handle = self._exp_create(seg, plan, size, fl) if plan is not None else None
        if handle is None:
            if self._pending_events or self._deferred:
                self._synchronize_and_free_events()
                block = self._find(fl, size)
                if block is not None:
                    return block
            self._scalars["num_alloc_retries"] += 1
            self._reap_orphans()
            self._exp_unmap()
            self._release_segments()
            plan = place(seg, size, gran, _FREE)
            handle = self._exp_create(seg, plan, size, fl) if plan is not None else None
            if handle is None:
                cached = self._passed_over(fl, size, None)
                if cached is not None:
                    return cached
                # the OOM names the segment the request's own pool would ask for, as torch's
                return self._oom(size, self._segment_size(size, _SMALL if size <= SMALL_SIZE else fl.kind), fl)
        return self._exp_map(seg, fl, plan, handle)

    def _exp_map(self, seg: Segment, fl: _FreeList, plan, pieces) -> _Block:
        """Map ``pieces`` (from _exp_create, waiting in ``_unreleased``) where ``plan`` says and
        return the free block that now fits (counted, in its free list, as _find returns one).

        Interrupt safety: a piece is marked mapped in ``_unreleased`` as its map returns; once
        all are mapped, the new block, its merges, the free list, the segment's mappings and
        the counters are computed, then published with plain stores (no call, so no
        KeyboardInterrupt between them), which also takes the pieces out of ``_unreleased``."""
        hole, addr, need = plan
        unreleased = self._unreleased
        kind = seg.kind
        try:
            with self._on_device():
                for a, n, handle in pieces:
                    i = unreleased.index((handle, n, kind, None))
                    try:
                        self._be.vmm_map(a, n, handle, self._index)
                    except BaseException as exc:
                        # a piece whose access could not be set nor its mapping undone is still mapped
                        if getattr(exc, "still_mapped", False):
                            unreleased[i] = (handle, n, kind, a)
                        raise
                    unreleased[i] = (handle, n, kind, a)
                    for peer in self._peers:
                        self._be.vmm_set_access(a, n, peer)
        except BaseException:
            self._exp_discard()
            raise
        # ---- compute
        # the free neighbours the new pages join leave their lists before links change
        before, after = joined(hole, addr, need, _FREE)
        keys = fl.keys
        gone_keys = []
        for nb in (before, after):
            if nb is not None:
                gone_keys.append(nb.size << _SHIFT | nb.ptr)
        block = _Block(addr, need, fl, None, None)
        block.seg = seg
        start = before if before is not None else block
        size = need + (before.size if before is not None else 0) + (after.size if after is not None else 0)
        at_start = addr == hole.ptr
        hole_left = hole.size - need
        # (the packed counters do not move: a free block of an expandable segment is no inactive
        # split block, as in torch, and a segment is counted only when classic, E14)
        (d1, d2), (p1, k1), _ = _list_edits(keys, gone_keys, (size << _SHIFT | start.ptr,))
        new_maps = {a: (n, handle) for a, n, handle in pieces}
        new_starts = sorted(new_maps)          # one run: no mapping starts inside the hole
        i_start = bisect_left(seg.starts, new_starts[0])
        made = {(handle, n, kind, a) for a, n, handle in pieces}
        left_unreleased = [u for u in unreleased if u not in made]
        holes_gone = set() if hole_left else {hole}
        hw = max(self._reserved_hw, self._cur[RESERVED_BYTES])
        n_maps = self._scalars["num_device_map"] + len(pieces)
        # ---- publish (no call until the history below)
        if at_start:
            block.prev, block.next = hole.prev, hole
            if hole.prev is not None:
                hole.prev.next = block
            else:
                seg.head = block
            hole.prev = block
            hole.ptr += need
            hole.size -= need
        else:
            block.prev, block.next = hole, hole.next
            if hole.next is not None:
                hole.next.prev = block
            hole.next = block
            hole.size -= need
        if not hole_left:                         # filled: the hole goes
            if hole.prev is not None:
                hole.prev.next = hole.next
            else:
                seg.head = hole.next
            if hole.next is not None:
                hole.next.prev = hole.prev
        self._blocks[addr] = block
        if before is not None:
            before.size += block.size
            before.next = block.next
            if block.next is not None:
                block.next.prev = before
            del self._blocks[addr]
            block = before
        if after is not None:
            block.size += after.size
            block.next = after.next
            if after.next is not None:
                after.next.prev = block
            del self._blocks[after.ptr]
        if block.prev is not None:                # see malloc's whole-segment `undo`
            block.prev.undo = 0
        if block.next is not None:
            block.next.undo = 0
        block.undo = 0
        # in-place edits, each one bytecode (see _list_edits)
        seg.holes -= holes_gone
        seg.maps |= new_maps
        seg.starts[i_start:i_start] = new_starts
        seg.mapped += need
        unreleased[:] = left_unreleased
        self._reserved_hw = hw
        if d1 >= 0:
            del keys[d1]
        if d2 >= 0:
            del keys[d2]
        keys[p1:p1] = (k1,)
        self._scalars["num_device_map"] = n_maps
        self._scalars["num_device_alloc"] += 1      # one per segment_map event, as torch counts it
        if self._history is not None:
            st = None
            if self._ctx:
                st = _stack()
                for a, _, _ in pieces:
                    self._seg_frames[a] = st
            self._trace("segment_map", addr, need, fl.stream, st)
        return block

    def _exp_unmap(self) -> int:
        """Unmap every free piece (whole mappings only, E3) of every expandable segment,
        after waiting for their streams' work (E7).  Never called during a capture
        (E6).  Returns the bytes unmapped.

        Why every free piece and not just enough: this runs only where reserved memory
        would pass its high-water mark even after ``_exp_unmap_enough`` (and on empty_cache and
        the OOM retry), and after it the only mapped free bytes left share a piece with live
        blocks, so ``place``, which maps the fewest new bytes, packs the new block against live
        ones (E10)."""
        self._exp_release()
        victims = self._exp_free_pieces()
        if not victims:
            self._exp_drop_orphans()
            return 0
        done = self._exp_unmap_pieces(victims, synchronize=True)
        self._exp_drop_orphans()
        return done

    def _exp_free_pieces(self) -> list:
        """Every free piece (a whole mapping inside a free block) of every expandable segment:
        ``[(address, size, segment, free block)]``, free lists in order (block size, address)."""
        victims = []
        blocks = self._blocks
        gran = self._gran
        # A destroyed stream's blocks wait, in no live list, for the event covering its work
        # (_forget_stream); they are unmapped once they joined the default stream.  Only free
        # blocks of a page or more can hold a whole mapping: the rest of each sorted list is
        # skipped, so this costs the same with thousands of small blocks cached.
        for pair in self._general.values():
            for fl in pair:
                keys = fl.keys
                for i in range(bisect_left(keys, gran << _SHIFT), len(keys)):
                    block = blocks[keys[i] & _MASK]
                    seg = block.seg
                    if seg is not None:
                        for addr, n in seg.maps_within(block.ptr, block.ptr + block.size):
                            victims.append((addr, n, seg, block))
        return victims

    def _exp_unmap_enough(self, seg: Segment, size: int, excess: int):
        """A grow of ``seg`` for ``size`` bytes would lift reserved memory ``excess`` bytes past its
        high-water mark: unmap free pieces (E7: after their streams' work), those of the smallest
        free blocks first, until their bytes cover ``excess``, and return ``place``'s new plan; or
        None, nothing done, when all the free pieces together do not cover it.  The caller unmaps
        every free piece (``_exp_unmap``) when the plan still passes the mark (E10).

        Why not every free piece, as before: in a loop whose steps each reach the mark, unmapping
        every free piece gave back pages the next few requests mapped again (a diffusion
        sampler: about 20 MiB unmapped and 18 MiB mapped back in single pages each step, 286 map
        calls on perturbed copies, the limit being 200).  The largest free blocks are the ones a
        later request of a recurring size fits; the smallest are the fragments no request fits.
        Measured (r65h, 2026-12-06) with ``tools/replay_trace.py --corpus --holdout --policy none
        --variant e=expandable_segments:True --perturb 5``, peak reserved / peak live, before ->
        after: 246 replays mean 1.062 -> 1.061, over 1.08 67 -> 66, over 1.15 16 -> 14, worst 1.243
        both, most map calls 286 -> 193; as recorded no trace worse, 9 -> 8 over 1.08 (diffusion
        sampler 1.170 -> 1.137, TCN 1.084 -> 1.076, mobilenet eval 1.030 -> 1.010), most map calls
        196 -> 166; device synchronizes over the 246 replays 1,523 -> 1,815.  Other orders: largest
        piece first 65 / 14 / 193 map calls but 257 against 182 over three passes; address order 65
        / 17 / 215; largest free block first 67 / 15 / 284; a margin (unmap twice or four times the
        excess) 67 / 16-17 / 227-239; after a partial pass that falls short, more pieces in the same
        order instead of all 66 / 16, diffusion sampler 1.170."""
        victims = self._exp_free_pieces()
        if sum(v[1] for v in victims) < excess:
            return None
        self._exp_unmap_pieces(_smallest_first(victims, excess), synchronize=True)
        return place(seg, size, self._gran, _FREE)

    def _exp_release_over(self, budget: int) -> None:
        """``release_threshold`` for expandable segments: free pieces beyond ``budget`` bytes are
        unmapped, those of the smallest free blocks first (as ``_exp_unmap_enough``), after a
        wait for their streams' work (E7).  Never during a capture (E6: the caller's ``unless_capturing``)."""
        victims = self._exp_free_pieces()
        excess = sum(v[1] for v in victims) - budget
        if excess <= 0:
            return
        self._exp_unmap_pieces(_smallest_first(victims, excess), synchronize=True)
        self._exp_drop_orphans()

    def _exp_unmap_pieces(self, victims: list, synchronize: bool) -> int:
        """Unmap the free pieces ``victims`` (``(address, size, segment, free block)``, each a
        whole mapping) and release their physical memory; their streams' work waited for first when
        ``synchronize`` (E7).  Returns the bytes unmapped.  On a failure what was unmapped
        before it is released (or waits in ``_unreleased``, counted) and the error propagates."""
        # highest address first: unmapping splits a free block, keeping its low part
        victims.sort(key=lambda v: -v[0])
        done = 0
        try:
            with self._on_device():
                if synchronize:
                    self._exp_quiesce(victims)
                for addr, n, seg, block in victims:
                    self._exp_unmap_one(seg, block, addr, n)
                    done += n
        except BaseException:
            try:
                self._exp_release()          # what was unmapped before the failure
            except Exception:
                self._be.clear_error()       # stays counted in _unreleased; the first error propagates
            raise
        self._exp_release()                  # the physical memory of every unmapped piece, in one pass
        return done

    def _exp_quiesce(self, victims: list) -> None:
        """E7: wait for the queued work that may touch the free blocks of ``victims``: that of
        the streams owning them, as torch does (``ExpandableSegment::unmapHandles``:
        cudaStreamSynchronize of the segment's stream), so that an allocation never waits for
        unrelated work on the device, another library's included (r73e).  The whole device
        instead when the free lists of a stream were made for one that was neither the default
        one nor one accel hears of before it is destroyed (``_FreeList.vouched``,
        ``streams.announced``): a raw handle its owner destroyed unannounced would make the
        stream's synchronize fail, or, its value handed to a new stream, wait for the wrong one
        (tests/test_memory_streams.py's scenario, tests/test_review_r75g.py)."""
        pools = {v[3].pool for v in victims}
        if all(fl.vouched for fl in pools):
            for stream in {fl.stream for fl in pools}:
                self._be.stream_synchronize(stream)
        else:
            self._be.device_synchronize()

    def _exp_unmap_idle(self, segs: List[Segment]) -> None:
        """Unmap the free pieces of destroyed streams' segments ``segs`` once the work of those
        streams is known complete (_rehome runs when the event covering it did), so that their
        reservations go (E11: bounded by live streams, not by every stream ever made).  No device
        synchronize is needed (E7): a free block of a segment is touched by no queued work but its
        own stream's, which is done; uses recorded on other streams keep a block pending, not
        free.  Best effort: a vendor error leaves the rest for the next unmap pass."""
        gran = self._gran
        victims = []
        for seg in segs:
            for block in seg.blocks():
                if block.state == _FREE and block.size >= gran:
                    victims += [(addr, n, seg, block) for addr, n in seg.maps_within(block.ptr, block.ptr + block.size)]
        if not victims:
            return
        try:
            self._exp_unmap_pieces(victims, synchronize=False)
        except Exception:
            self._be.clear_error()              # what is still mapped waits in _unreleased, counted

    def _exp_drop(self, seg: Segment, keep: bool = True) -> None:
        """Free the reservation of a segment with nothing mapped (one unmapped block).  A
        failure keeps the segment, to be freed at a later unmap; it is not raised, as this
        runs while another error propagates or as housekeeping.

        With ``keep``, the range becomes the allocator's one spare when it has none (E11):
        the next new segment takes it instead of reserving, so a program that makes a stream
        per step does not reserve and free a device-sized range at every step.

        A segment holding a piece of an undone grow that waits, still mapped, in ``_unreleased``
        is kept until that piece is unmapped: Level Zero's zeVirtualMemFree unmaps it behind our
        back (cuMemAddressFree refuses), and the piece's later unmap would hit the range's next
        reservation."""
        end = seg.base + seg.size
        if any(u[3] is not None and seg.base <= u[3] < end for u in self._unreleased):
            return
        # forgotten first, freed last, as _free_segments does (an interrupt as the free starts
        # may leak the reservation; a freed range is never kept, to be mapped into)
        fl = seg.head.pool
        before = self._exp_segs
        after = [s for s in before if s is not seg]
        grows = fl.exp is seg
        if keep and not self._exp_spare and seg.size == self._exp_range:
            self._exp_segs = after
            fl.segments -= 1
            if grows:
                fl.exp = None
            self._exp_spare = seg.base
            return
        try:
            with self._on_device():
                self._exp_segs = after
                fl.segments -= 1
                if grows:
                    fl.exp = None
                self._be.vmm_free(seg.base, seg.size)
        except AcceleratorError:
            self._be.clear_error()
            self._exp_segs = before
            fl.segments += 1
            if grows:
                fl.exp = seg

    def _exp_drop_orphans(self, every: bool = False) -> None:
        """Free the reservations with nothing mapped that no stream grows any more (a
        destroyed stream's segment joined the default stream's lists, E11), or ``every``
        one with nothing mapped (empty_cache: the next miss reserves again)."""
        for seg in [seg for seg in self._exp_segs
                    if seg.mapped == 0 and (every or seg.head.pool.exp is not seg)]:
            self._exp_drop(seg, keep=not every)
        if every and self._exp_spare:
            spare = self._exp_spare
            try:
                with self._on_device():
                    self._exp_spare = 0         # forgotten first, freed last, as _exp_drop does
                    self._be.vmm_free(spare, self._exp_range)
            except AcceleratorError:
                self._be.clear_error()
                self._exp_spare = spare

    def _exp_unmap_one(self, seg: Segment, block: _Block, addr: int, n: int) -> None:
        """Turn the free piece ``[addr, addr + n)`` of ``block`` into a hole; its mapping moves
        to ``_unreleased``, still mapped, for the caller's ``_exp_release`` to unmap (the caller
        synchronized the device, E7) and release.

        Interrupt safety: computed first, then published with plain stores and the append
        last, so a KeyboardInterrupt finds the piece either still in the segment or in
        ``_unreleased`` (a hole whose mapping waits there is never mapped again before it
        was unmapped: see _exp_grow)."""
        fl = block.pool
        kind = seg.kind
        handle = seg.maps[addr][1]
        end = block.ptr + block.size
        prev, nxt = block.prev, block.next
        keys = fl.keys
        gone_key = block.size << _SHIFT | block.ptr
        new_keys = []
        hole = _Block(addr, n, fl, None, None)
        hole.state = UNMAPPED
        hole.seg = seg
        # left part: the block itself, shrunk; or nothing; right part: a new block, or nothing
        left = block if addr > block.ptr else None
        lsize = addr - block.ptr
        right = None
        rsize = end - addr - n
        if rsize:
            right = _Block(addr + n, rsize, fl, None, None)
            right.seg = seg
            new_keys.append(rsize << _SHIFT | right.ptr)
        if left is not None:
            new_keys.append(lsize << _SHIFT | left.ptr)
        # (the packed counters do not move: expandable blocks are no inactive split ones, E14)
        (d1, d2), (p1, k1), (p2, k2) = _list_edits(keys, (gone_key,), new_keys)
        # the hole merges with unmapped neighbours (E2)
        lo_h = prev if left is None and prev is not None and prev.state == UNMAPPED else None
        hi_h = nxt if right is None and nxt is not None and nxt.state == UNMAPPED else None
        holes_gone = {hi_h} if hi_h is not None else set()
        hole_new = {hole} if lo_h is None else set()      # (lo_h is one already)
        i_start = bisect_left(seg.starts, addr)
        mapped = seg.mapped - n
        frames = self._seg_frames
        st = frames.get(addr)
        # ---- publish (no call until the append)
        if left is not None:
            block.size = lsize
            block.undo = 0
            left.next = hole
            hole.prev = left
            first = left
        else:
            del self._blocks[block.ptr]
            first = hole
        if right is not None:
            self._blocks[right.ptr] = right
            right.prev = hole
            hole.next = right
            last = right
        else:
            last = hole
        first.prev = prev
        last.next = nxt
        if prev is not None:
            prev.next = first
        else:
            seg.head = first
        if nxt is not None:
            nxt.prev = last
        if lo_h is not None:
            lo_h.size += hole.size
            lo_h.next = hole.next
            if hole.next is not None:
                hole.next.prev = lo_h
            hole = lo_h
        if hi_h is not None:
            hole.size += hi_h.size
            hole.next = hi_h.next
            if hi_h.next is not None:
                hi_h.next.prev = hole
        if hole.prev is not None:
            hole.prev.undo = 0
        if hole.next is not None:
            hole.next.undo = 0
        # in-place edits, each one bytecode (no call: no signal check between them), so the
        # lists stay shared and nothing here is proportional to the blocks cached
        seg.holes -= holes_gone
        seg.holes |= hole_new
        del seg.maps[addr]
        del seg.starts[i_start]
        seg.mapped = mapped
        del keys[d1]
        if d2 >= 0:
            del keys[d2]
        if p1 >= 0:
            keys[p1:p1] = (k1,)
        if p2 >= 0:
            keys[p2:p2] = (k2,)
        if addr in frames:
            del frames[addr]
        self._unreleased.append((handle, n, kind, addr))       # the last change: a call
        if self._history is not None:
            self._trace("segment_unmap", addr, n, fl.stream, _stack() if self._ctx >= _CTX_ALL else st)

    def _exp_release(self) -> None:
        """Unmap (where still mapped) and release what ``_unreleased`` holds; a handle whose
        unmap or release fails stays there, counted as reserved (the device still holds it),
        and is released again at the next unmap.  Each vendor call's result is recorded with
        plain stores as it returns (no KeyboardInterrupt in between)."""
        unreleased = self._unreleased
        if not unreleased:
            return      # (no device scope: it would make an unused device's context, r71c)
        cur, freed = self._cur, self._freed
        scalars = self._scalars
        with self._on_device():
            while unreleased:
                handle, n, kind, addr = unreleased[-1]
                if addr is not None:
                    # Marked unsure while the unmap runs: after a KeyboardInterrupt there (as it
                    # returns, in the backend) the retry cannot tell whether it unmapped, and
                    # takes a refusal as done; the address is in our own reservation, where
                    # nothing maps while this entry waits.
                    again = addr in self._unsure
                    marked = self._unsure | {addr}
                    self._unsure = marked
                    try:
                        self._be.vmm_unmap(addr, n)
                    except CaptureError:
                        self._unsure = marked - {addr}
                        raise
                    except AcceleratorError:
                        if not again:
                            self._unsure = marked - {addr}
                            raise
                        self._be.clear_error()      # an earlier try unmapped it
                    unreleased[-1] = (handle, n, kind, None)
                    self._unsure = marked - {addr}
                    scalars["num_device_unmap"] += 1
                    scalars["num_device_free"] += 1     # (one per segment_unmap event, as torch)
                # forgotten first, released last (plain stores between): an interrupt as the
                # release starts may leak this handle, but a released handle (whose value the
                # driver may give to the next create) is never released again
                r, rk = RESERVED_BYTES, RESERVED_BYTES + kind
                del unreleased[-1]
                cur[r] -= n
                cur[rk] -= n
                freed[r] += n
                freed[rk] += n
                try:
                    self._be.vmm_release(handle)
                except Exception:
                    cur[r] += n
                    cur[rk] += n
                    freed[r] -= n
                    freed[rk] -= n
                    unreleased.append((handle, n, kind, None))
                    raise

    def _exp_snapshot(self, exp: Segment, symbols: _Symbols) -> List[dict]:
        """torch reports each mapped run of an expandable segment as a segment with
        ``is_expandable``; its ``frames`` are those of the allocation that mapped its first
        pages (a run starts at a mapping's start, E3)."""
        out = []
        seg = None
        for block in exp.blocks():
            if block.state == UNMAPPED:
                seg = None
                continue
            if seg is None:
                fl = block.pool
                seg = {"device": self._index, "address": block.ptr, "total_size": 0,
                       "allocated_size": 0, "active_size": 0, "requested_size": 0,
                       "stream": fl.stream, "segment_type": _POOL_NAME[exp.kind],
                       "segment_pool_id": (0, 0), "is_expandable": True,
                       "frames": symbols.frames(self._seg_frames.get(block.ptr)), "blocks": []}
                out.append(seg)
            seg["total_size"] += block.size
            _snapshot_block(seg, block, symbols)
        return out

