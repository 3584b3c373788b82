#!/usr/bin/env python3
"""What page remapping could reach at best: an idealized model of 2 MiB pages, no allocator.

    python tools/page_model.py                  # corpus and held-out traces, three models
    python tools/page_model.py TRACE.json ...
    python tools/page_model.py --offline        # also the offline planner (lifetimes known)

Physical memory is a set of 2 MiB pages, each with its free byte ranges; a page is
released the moment nothing lives on it.  Requests up to 1 MiB take the best-fitting free
range of a small-pool page (or a new page) and never cross a page.  A larger request takes
the best-fitting free range inside one page if one is big enough, else (model
``stitch``) it is put together from any pages, as a virtual address range mapping a page
twice could: the free end of one page, whole new pages, and the free start of another
(the fewest new pages, then the longest free end used).  Model ``mixed`` also lets small
requests use large-pool pages; model ``pages`` has no stitching (every larger request
takes new pages of its own, as 2 MiB-rounded segments would).

``--offline`` adds model ``offline``: every lifetime known in advance (what no online
allocator has), requests placed in one address range by size, largest first, each into the
smallest gap left by the blocks it overlaps in time (TFLite's "greedy by size" planner); a
page is mapped while any live block touches it.  It is slow (minutes for the corpus).

Printed per trace: peak pages x 2 MiB over peak allocated bytes.  Address space, map
calls and streams are not modelled, and the placement is greedy, so this is neither a
bound for accel's allocator nor the best possible packing; it shows how much of the
overhead is left once partial pages could be recombined freely.
"""

from __future__ import annotations

import argparse
import bisect
import glob
import json
import os
import sys

PAGE = 2 << 20
SMALL = 1 << 20
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Pages:
    def __init__(self):
        self.free = {}      # page -> sorted free ranges [(start, end)]
        self.kind = {}      # page -> 0 small pool, 1 large pool
        self.used = {}      # page -> bytes in use
        self.next = 0

    def new(self, kind: int) -> int:
        page = self.next
        self.next += 1
        self.free[page] = [(0, PAGE)]
        self.kind[page] = kind
        self.used[page] = 0
        return page

    def take(self, page: int, lo: int, hi: int) -> None:
        ranges = self.free[page]
        for i, (a, b) in enumerate(ranges):
            if a <= lo and hi <= b:
                ranges[i:i + 1] = [r for r in ((a, lo), (hi, b)) if r[0] < r[1]]
                self.used[page] += hi - lo
                return
        raise AssertionError("not free")

    def give(self, page: int, lo: int, hi: int) -> None:
        ranges = self.free[page]
        bisect.insort(ranges, (lo, hi))
        merged = []
        for a, b in ranges:
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        self.free[page] = merged
        self.used[page] -= hi - lo
        if self.used[page] == 0:
            del self.free[page], self.used[page], self.kind[page]

    def best_range(self, size: int, kinds) -> list:
        best = None
        for page, ranges in self.free.items():
            if self.kind[page] in kinds:
                for a, b in ranges:
                    if b - a >= size and (best is None or b - a < best[0]):
                        best = (b - a, page, a)
        return [(best[1], best[2], best[2] + size)] if best else None

    def stitched(self, size: int) -> list:
        ends, starts = [], []
        for page, ranges in self.free.items():
            if self.kind[page] == 1 and self.used[page]:
                if ranges and ranges[-1][1] == PAGE:
                    ends.append((PAGE - ranges[-1][0], page))
                if ranges and ranges[0][0] == 0:
                    starts.append((ranges[0][1], page))
        ends.sort()
        starts.sort()
        best = None
        for a, head in [(0, None)] + ends[-8:]:
            whole, b = divmod(size - a, PAGE)
            new, tail = whole, None
            if b:
                i = bisect.bisect_left(starts, (b, -1))
                tail = next((p for _, p in starts[i:] if p != head), None)
                new += tail is None
            if best is None or (new, -a) < best[0]:
                best = ((new, -a), a, head, whole, b, tail)
        _, a, head, whole, b, tail = best
        parts = [(head, PAGE - a, PAGE)] if a else []
        parts += [(self.new(1), 0, PAGE) for _ in range(whole)]
        if b:
            parts.append((tail if tail is not None else self.new(1), 0, b))
        return parts


def run(ops, model: str) -> float:
    pages = Pages()
    live = {}
    cur = peak_alloc = peak_pages = 0
    for op in ops:
        if op[0] != "a":
            for page, lo, hi in live.pop(op[1]):
                pages.give(page, lo, hi)
                cur -= hi - lo
            continue
        size = max(512, (op[2] + 511) // 512 * 512)
        kind = 0 if size <= SMALL else 1
        kinds = (0, 1) if model == "mixed" else (kind,)
        parts = pages.best_range(size, kinds) if size <= PAGE else None
        if parts is None:
            if kind == 0:
                parts = [(pages.new(0), 0, size)]
            elif model == "pages":
                whole, b = divmod(size, PAGE)
                parts = [(pages.new(1), 0, PAGE) for _ in range(whole)]
                parts += [(pages.new(1), 0, b)] if b else []
            else:
                parts = pages.stitched(size)
        for part in parts:
            pages.take(*part)
        live[op[1]] = parts
        cur += size
        peak_alloc = max(peak_alloc, cur)
        peak_pages = max(peak_pages, len(pages.used))
    return peak_pages * PAGE / peak_alloc


def offline(ops) -> float:
    """Model ``offline`` (see the module doc): peak pages x 2 MiB over peak allocated bytes."""
    import numpy as np
    born, sizes, blocks = {}, {}, []            # blocks: (first op, op that frees it, size)
    for t, op in enumerate(ops):
        if op[0] == "a":
            born[op[1]], sizes[op[1]] = t, max(512, (op[2] + 511) // 512 * 512)
        else:
            blocks.append((born.pop(op[1]), t, sizes.pop(op[1])))
    blocks += [(born[k], len(ops), sizes[k]) for k in born]
    if not blocks:
        return 1.0
    start = np.array([b[0] for b in blocks])
    end = np.array([b[1] for b in blocks])
    size = np.array([b[2] for b in blocks], dtype=np.int64)
    offset = np.full(len(blocks), -1, dtype=np.int64)
    for i in sorted(range(len(blocks)), key=lambda i: -blocks[i][2]):
        near = np.nonzero((offset >= 0) & (start < end[i]) & (end > start[i]))[0]
        best, reach = None, 0
        for lo, hi in sorted(zip(offset[near].tolist(), (offset[near] + size[near]).tolist())):
            if lo - reach >= size[i] and (best is None or lo - reach < best[0]):
                best = (lo - reach, reach)
            reach = max(reach, hi)
        offset[i] = best[1] if best else reach
    events = sorted([(int(start[i]), 1, i) for i in range(len(blocks))]
                    + [(int(end[i]), -1, i) for i in range(len(blocks))], key=lambda e: (e[0], e[1]))
    users, live, cur, peak_alloc, peak_pages = {}, 0, 0, 0, 0
    for _, step, i in events:
        for page in range(int(offset[i]) // PAGE, (int(offset[i] + size[i]) - 1) // PAGE + 1):
            users[page] = users.get(page, 0) + step
            live += (step == 1 and users[page] == 1) - (step == -1 and users[page] == 0)
        cur += step * int(size[i])
        peak_alloc = max(peak_alloc, cur)
        peak_pages = max(peak_pages, live)
    return peak_pages * PAGE / peak_alloc


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="*", help="trace files (default: the corpus and held-out traces)")
    parser.add_argument("--offline", action="store_true",
                        help="also the offline planner, every lifetime known (slow: minutes for the corpus)")
    args = parser.parse_args(argv)
    for path in args.traces:
        if not os.path.isfile(path):
            parser.error(f"no such trace file: {path}")
    models = ("pages", "stitch", "mixed") + (("offline",) if args.offline else ())
    paths = args.traces or sorted(
        glob.glob(os.path.join(HERE, "tests/test_memory_traces/*.json"))
        + glob.glob(os.path.join(HERE, "tests/test_memory_traces/holdout/*.json")))
    print(f"{'trace':34s} " + " ".join(f"{m:>7s}" for m in models))
    worst = dict.fromkeys(models, 0.0)
    for path in paths:
        with open(path) as f:
            trace = json.load(f)
        ratios = {m: offline(trace["ops"]) if m == "offline" else run(trace["ops"], m) for m in models}
        for m in models:
            worst[m] = max(worst[m], ratios[m])
        print(f"{trace.get('name', os.path.basename(path)):34s} " + " ".join(f"{ratios[m]:7.3f}" for m in models),
              flush=True)
    print(f"{'worst':34s} " + " ".join(f"{worst[m]:7.3f}" for m in models))
    return 0


if __name__ == "__main__":
    sys.exit(main())
