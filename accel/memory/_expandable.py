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
* E7  before a mapping is unmapped, the device was synchronized (cuMemUnmap does not
      wait for queued work), or, for the free pieces of a destroyed stream's segment, the
      event covering that stream's work completed (the only work a free block of it can
      have queued; ``_exp_unmap_idle``);
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
      its reservation is freed once nothing in it is mapped (blocks still allocated keep it);
      empty_cache frees every reservation with nothing mapped; a first request that
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
from typing import Dict, List, Tuple

UNMAPPED = 3       # block state (after _caching's _FREE, _ALLOCATED, _PENDING)
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
