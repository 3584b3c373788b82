"""Model-based fuzz (r64a) of accel's device allocators through the public API only.

Seeded op sequences (``random.Random(seed)``; each op draws from its own generator, so a
shrinker that drops ops keeps the others' choices) drive ``accel.Buffer`` (allocate, ``fill_``,
``to_numpy``, ``record_stream``, ``close``), ``accel.Stream`` (create; close while its buffers
live and its work is queued), ``accel.memory`` (``memory_stats``, ``memory_snapshot``,
``empty_cache``, ``set_per_process_memory_fraction`` caps that force OutOfMemoryError, also
inside a capture, ``MemPool``/``use_mem_pool``) and ``accel.Graph`` (a few allocations captured
into an own, shared, handle or MemPool pool, some freed in the capture; replayed on the capture
or the default stream; reset), on both simulated CUDA devices (allocating on either device
whichever is current) under each allocator configuration that changes the code path (the
default expandable segments, classic segments, ``backend:cudaMallocAsync``, expandable segments
with ``roundup_power2_divisions:4``), and a smaller run on Level Zero and Metal.

A reference model is kept beside the allocator: every live buffer with its device, size,
stream and a byte tag no other live buffer on its device has.  After every operation:

* no two live allocations overlap (checked exactly at each allocation against the sorted live
  ranges of every device: addresses never move, so that covers every pair);
* no content is lost: a buffer is filled with its tag when allocated and read back in full
  before it is freed; one random live buffer is spot-checked each step (its head, tail, or
  around a 2 MiB page boundary, where a page unmapped or remapped under it would show);
* ``memory_stats``: ``allocation.all.current`` and ``allocated_bytes.all.current`` exactly what
  the model says (accel's rounding, ``_caching.malloc`` / ``_round_pow2``: 512 bytes, or torch's
  power-of-two divisions; the RNG's two 8-byte seed/offset holders per live graph of the
  device; cudaMallocAsync: allocations and requested bytes, counted by accel),
  requested bytes exact when nothing waits for events, ``active >= allocated``,
  ``reserved >= active``, and ``active == allocation`` after ``empty_cache``;
* ``memory_snapshot``: the active_allocated blocks are exactly the live buffers (address, size,
  requested size), as many pending blocks as ``active - allocation``, blocks tile their
  segments, and the segments add up to ``reserved_bytes``;
* a cap that leaves no room is never passed (an allocation that would go past it must raise);
* at the end, with everything freed, synchronized and emptied: reserved 0, no active block,
  and the simulator's live objects (allocations, streams, events, graphs, mappings) as at the
  start (Level Zero: plus whole idle event pools, which its backend keeps).

The simulated streams run with a 200 us delay per operation and record_stream frees are often
followed at once by an allocation of the same size on the same stream, so memory reused before
the recorded work ran shows as lost content.  (A planted bug, record_stream made a no-op, fails
every seed.)  What the sweeps found, shrunk to named tests at the end: a use on a stream whose
handle was recycled from the buffer's closed allocation stream was dropped (an accel bug: it
failed as a strict xfail first, and is fixed; AVOID_RECYCLED_HANDLE_BUG kept the sweeps clear of
it until then), and the simulator gave a graph
allocation's address back at graph destruction before a queued cudaFreeAsync of it ran (fixed).
"""

from __future__ import annotations

import bisect
import gc
import os
import random
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
import pytest

import accel
from accel import memory, sim
from accel._errors import OutOfMemoryError

from conftest import THOROUGH, shrink_plan, use_sim

KiB = 1 << 10
MiB = 1 << 20
HOLDERS, HOLDER_BYTES = 2, 8     # the RNG's seed/offset holders of each live graph (per graph, r64)
PAGE = 2 * MiB          # the simulated VMM granularity (expandable segments map 2 MiB pages)

#: Kept the sweeps clear of the bug test_use_on_a_stream_with_the_closed_streams_handle_keeps_the_block
#: showed while it was open (True), so that they looked for others; fixed since.
AVOID_RECYCLED_HANDLE_BUG = False

CONFS = ["", "expandable_segments:False", "backend:cudaMallocAsync",
         "expandable_segments:True,roundup_power2_divisions:4"]


def _conf_id(conf: str) -> str:
    return conf.replace(":", "=").replace(",", "+") or "default"


# ------------------------------------------------------------------------------------- rounding
def _round_pow2(n: int, divisions: int) -> int:
    """torch's roundup_power2_next_division (c10/cuda/CUDACachingAllocator.cpp), as accel's
    ``_round_pow2`` applies it: only above ``512 * divisions`` bytes, else 512-byte rounding."""
    if divisions > 1 and n > 512 * divisions:
        if n & (n - 1) == 0:
            return n
        floor = 1 << (n.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        low = n & ~(step - 1)
        return n if low == n else low + step
    return max(512, (n + 511) & ~511)


def _pow2_divisions(conf: str) -> int:
    for part in conf.split(","):
        key, _, value = part.partition(":")
        if key.strip() == "roundup_power2_divisions":
            return int(value)
    return 0


# ---------------------------------------------------------------------------------- the model
@dataclass
class Live:
    """One live buffer as the model knows it."""
    key: int
    buf: accel.Buffer
    dev: int
    nbytes: int
    tag: int
    stream: Optional[accel.Stream]     # its allocation stream while open, else None
    graph: Optional["GraphRec"] = None  # the capture that allocated it
    no_split: bool = False              # from a MemPool(no_split=True): block may be larger
    valid: bool = True                  # False: a captured fill not yet replayed
    ptr: int = 0
    dead_handle: Optional[int] = None   # the handle of its allocation stream, once closed


@dataclass
class GraphRec:
    graph: accel.Graph
    dev: int
    stream: accel.Stream
    keys: List[int] = field(default_factory=list)
    frozen: bool = False        # one of its buffers was freed: no more replays (torch's rule)
    reset: bool = False
    no_split: bool = False      # captured into a MemPool(no_split=True)


class Invariant(AssertionError):
    pass


class Fuzz:
    """The allocator under test, driven by one seeded op sequence, with its reference model."""

    def __init__(self, kind: str, conf: str, seed: int, devices: int, ops: int, *,
                 graphs: bool = True, log: Optional[list] = None):
        self.kind, self.conf, self.seed, self.ops = kind, conf, seed, ops
        self.devs = list(range(devices))
        self.rng = random.Random(seed)
        self.async_backend = "cudaMallocAsync" in conf
        self.divisions = _pow2_divisions(conf)
        self.graphs_ok = graphs and kind != "mps"
        self.live: Dict[int, Live] = {}
        self.ranges: List[tuple] = []            # sorted (ptr, end, key) of every live buffer
        self.next_key = 1
        self.streams: Dict[int, List[accel.Stream]] = {d: [] for d in self.devs}
        self.graph_recs: List[GraphRec] = []
        self.mempools: List = []                 # (MemPool, no_split)
        self.log = log if log is not None else []
        self.step = 0
        self.counts: Dict[str, int] = {}

    # -- helpers
    def note(self, what: str) -> None:
        self.log.append(f"{self.step}: {what}")
        name = what.split()[0]
        self.counts[name] = self.counts.get(name, 0) + 1

    def fail(self, msg: str) -> None:
        tail = "\n".join(self.log[-12:])
        raise Invariant(f"[{self.kind} {self.conf or 'default'} seed={self.seed} step={self.step}] {msg}\n"
                        f"last ops:\n{tail}")

    def expected_size(self, lv: Live) -> int:
        return _round_pow2(lv.nbytes, self.divisions)

    def size(self) -> int:
        r = self.rng.random()
        if r < 0.01:
            return 0
        if r < 0.35:
            return self.rng.randint(1, 512)
        if r < 0.55:
            return MiB + self.rng.randint(-2048, 2048)
        if r < 0.7:
            return self.rng.choice([2, 4, 10, 20]) * MiB + self.rng.randint(-1024, 1024)
        if r < 0.85:
            return self.rng.randint(2 * MiB, 20 * MiB)
        return self.rng.randrange(1, 300 * KiB) * 2 + 1       # odd sizes

    def tag_for(self, dev: int) -> int:
        used = {lv.tag for lv in self.live.values() if lv.dev == dev}
        free = [t for t in range(1, 256) if t not in used]
        return self.rng.choice(free)

    def read_stream(self, lv: Live):
        if lv.stream is not None and not lv.stream._closed:
            return lv.stream
        return None         # the current stream of the buffer's device

    def side_streams(self, dev: int) -> List[accel.Stream]:
        return [s for s in self.streams[dev] if not s._closed]

    # -- content checks
    def verify_full(self, lv: Live) -> None:
        if not lv.valid or lv.nbytes == 0:
            return
        data = lv.buf.to_numpy(stream=self.read_stream(lv))
        bad = np.flatnonzero(data != lv.tag)
        if bad.size:
            i = int(bad[0])
            self.fail(f"buffer #{lv.key} (dev {lv.dev}, {lv.nbytes} B at {lv.ptr:#x}) lost its content: "
                      f"{bad.size} byte(s) differ, first at +{i:#x}: {data[i]} != tag {lv.tag}")

    def _window(self, lv: Live):
        """One window of at most 4 KiB: the head, the tail, or around a random 2 MiB page
        boundary inside the buffer (where a page unmapped or remapped under it would show)."""
        n = lv.nbytes
        width = min(n, 4096)
        first = (lv.ptr // PAGE + 1) * PAGE - lv.ptr
        r = self.rng.random()
        if first < n and r < 0.5:
            edge = self.rng.choice(range(first, n, PAGE))
            off = min(max(0, edge - width // 2), n - width)
        elif r < 0.75:
            off = 0
        else:
            off = n - width
        return off, width

    def verify_spot(self, lv: Live) -> None:
        if not lv.valid or lv.nbytes == 0:
            return
        off, length = self._window(lv)
        data = lv.buf.as_array("u1", shape=(length,), offset=off).to_numpy(stream=self.read_stream(lv))
        bad = np.flatnonzero(data != lv.tag)
        if bad.size:
            i = int(bad[0])
            self.fail(f"buffer #{lv.key} (dev {lv.dev}, {lv.nbytes} B at {lv.ptr:#x}) lost its content: "
                      f"byte +{off + i:#x} is {data[i]}, not its tag {lv.tag}")

    # -- model bookkeeping
    def add(self, buf: accel.Buffer, dev: int, nbytes: int, stream, tag: int, graph=None,
            no_split=False, valid=True) -> Live:
        key = self.next_key
        self.next_key += 1
        lv = Live(key, buf, dev, nbytes, tag, stream, graph, no_split, valid, buf.ptr if nbytes else 0)
        if nbytes:
            item = (lv.ptr, lv.ptr + nbytes, key)
            i = bisect.bisect_left(self.ranges, item)
            for j in (i - 1, i):
                if 0 <= j < len(self.ranges):
                    a, b, other = self.ranges[j]
                    if a < lv.ptr + nbytes and lv.ptr < b:
                        o = self.live[other]
                        self.fail(f"new buffer #{key} [{lv.ptr:#x}, {lv.ptr + nbytes:#x}) on dev {dev} overlaps "
                                  f"live buffer #{other} [{a:#x}, {b:#x}) on dev {o.dev}")
            self.ranges.insert(i, item)
        self.live[key] = lv
        if graph is not None:
            graph.keys.append(key)
        return lv

    def remove(self, lv: Live) -> None:
        del self.live[lv.key]
        if lv.nbytes:
            self.ranges.remove((lv.ptr, lv.ptr + lv.nbytes, lv.key))
        if lv.graph is not None:
            lv.graph.frozen = True

    # -- operations
    def op_alloc(self) -> None:
        dev = self.rng.choice(self.devs)
        nbytes = self.size()
        side = self.side_streams(dev)
        stream = self.rng.choice(side) if side and self.rng.random() < 0.4 else None
        pool = None
        pools = [p for p in self.mempools if p[0].device_index == dev]
        if pools and self.rng.random() < 0.2:
            pool = self.rng.choice(pools)
        self.alloc(dev, nbytes, stream, pool)

    def pick(self, pred=lambda lv: True) -> Optional[Live]:
        cands = [lv for lv in self.live.values() if pred(lv)]
        return self.rng.choice(cands) if cands else None

    def op_free(self) -> None:
        lv = self.pick()
        if lv is None:
            return self.op_alloc()
        self.note(f"free #{lv.key} dev={lv.dev} n={lv.nbytes}")
        self.verify_full(lv)
        lv.buf.close()
        self.remove(lv)

    def op_record_stream_free(self) -> None:
        lv = self.pick(lambda lv: lv.nbytes and lv.valid)
        if lv is None:
            return self.op_alloc()
        side = [s for s in self.side_streams(lv.dev) if s is not lv.stream]
        if not side or self.rng.random() < 0.2:
            side.append(self.new_stream(lv.dev))
        if AVOID_RECYCLED_HANDLE_BUG:
            # test_use_on_a_stream_with_the_closed_streams_handle_keeps_the_block: the use would
            # be lost (the runtime gave the closed allocation stream's handle to this one)
            side = [s for s in side if s.handle != lv.dead_handle] or [self.new_stream(lv.dev)]
            if side[0].handle == lv.dead_handle:
                return
        t = self.rng.choice(side)
        k = self.rng.randint(1, 4)
        self.note(f"record_stream_free #{lv.key} dev={lv.dev} n={lv.nbytes} fills={k}")
        self.verify_full(lv)
        for _ in range(k):      # work on t still queued when the buffer is freed
            lv.buf.fill_(lv.tag, stream=t)
        lv.buf.record_stream(t)
        lv.buf.close()
        self.remove(lv)
        if self.rng.random() < 0.6:
            # the same size again on the same stream at once: the freed block is the best fit,
            # and may only be handed out once the fills still queued on t have run
            self.alloc(lv.dev, lv.nbytes, lv.stream)

    def alloc(self, dev: int, nbytes: int, stream, pool=None) -> Live:
        self.note(f"alloc dev={dev} n={nbytes} stream={'side' if stream else 'cur'}"
                  f"{' mempool' if pool else ''}")
        try:
            if pool is not None:
                with accel.device_index(dev), memory.use_mem_pool(pool[0]):
                    buf = accel.Buffer(nbytes, device=dev, stream=stream)
            else:
                buf = accel.Buffer(nbytes, device=dev, stream=stream)
        except OutOfMemoryError:
            self.fail(f"OutOfMemoryError for {nbytes} bytes with no cap set")
        lv = self.add(buf, dev, nbytes, stream, self.tag_for(dev), no_split=bool(pool and pool[1]))
        if nbytes:
            buf.fill_(lv.tag, stream=stream)
        return lv

    def new_stream(self, dev: int) -> accel.Stream:
        s = accel.Stream(dev)
        self.streams[dev].append(s)
        return s

    def op_stream_new(self) -> None:
        dev = self.rng.choice(self.devs)
        self.note(f"stream_new dev={dev}")
        self.new_stream(dev)

    def op_stream_close(self) -> None:
        dev = self.rng.choice(self.devs)
        side = self.side_streams(dev)
        if not side:
            return self.op_stream_new()
        s = self.rng.choice(side)
        mine = [lv for lv in self.live.values() if lv.stream is s]
        self.note(f"stream_close dev={dev} live_on_it={len(mine)}")
        if mine and self.rng.random() < 0.5:
            lv = self.rng.choice(mine)
            if lv.valid and lv.nbytes:
                lv.buf.fill_(lv.tag, stream=s)      # work still queued at the close
        # (the streams are non-blocking, as torch's: the buffers' later reads on the device's
        # current stream are ordered after their writes on s by this wait, nothing else)
        accel.current_stream(dev).wait_stream(s)
        handle = s.handle
        s.close()
        self.streams[dev].remove(s)
        for lv in mine:
            lv.stream = None
            lv.dead_handle = handle

    def op_empty_cache(self) -> None:
        self.note("empty_cache")
        memory.empty_cache()
        for dev in self.devs:
            st = memory.memory_stats(dev)
            if not self.async_backend and st["active.all.current"] != st["allocation.all.current"]:
                self.fail(f"dev {dev}: after empty_cache {st['active.all.current']} active blocks but "
                          f"{st['allocation.all.current']} allocations (pending blocks left)")

    def op_set_device(self) -> None:
        dev = self.rng.choice(self.devs)
        self.note(f"set_device {dev}")
        accel.set_device_index(dev)

    def op_spot(self) -> None:
        lv = self.pick()
        if lv is not None:
            self.verify_full(lv)

    def op_oom(self) -> None:
        dev = self.rng.choice(self.devs)
        total = memory.get_memory_info(dev)[1]
        st = memory.memory_stats(dev)
        reserved = st["reserved_bytes.all.current"]
        used = st["allocated_bytes.all.current"] if not self.async_backend else st["requested_bytes.all.current"]
        room = self.rng.choice([0, 1 * MiB, 4 * MiB, 16 * MiB])
        fraction = min(1.0, (max(reserved, used) + room) / total)
        allowed = int(total * fraction)
        nbytes = self.rng.choice([room + self.rng.randint(1, 8 * MiB), self.rng.randint(1, 2 * MiB),
                                  room + 32 * MiB])
        self.note(f"oom dev={dev} fraction={fraction:.6f} (allowed {allowed}, reserved {reserved}) n={nbytes}")
        memory.set_per_process_memory_fraction(fraction, dev)
        try:
            try:
                buf = accel.Buffer(nbytes, device=dev)
            except OutOfMemoryError:
                buf = None
                self.counts["oom_raised"] = self.counts.get("oom_raised", 0) + 1
            if buf is not None:
                size = nbytes if self.async_backend else _round_pow2(nbytes, self.divisions)
                if used + size > allowed:
                    self.fail(f"dev {dev}: a {nbytes}-byte buffer was allocated past the cap: {used} B in use, "
                              f"{allowed} B allowed")
                lv = self.add(buf, dev, nbytes, None, self.tag_for(dev))
                buf.fill_(lv.tag)
            self.check()
        finally:
            memory.set_per_process_memory_fraction(1.0, dev)

    def op_mempool(self) -> None:
        if self.async_backend:
            return self.op_alloc()
        if self.mempools and self.rng.random() < 0.4:
            pool = self.mempools.pop(self.rng.randrange(len(self.mempools)))
            self.note(f"mempool_drop dev={pool[0].device_index}")
            del pool
            gc.collect()
            return
        dev = self.rng.choice(self.devs)
        no_split = self.rng.random() < 0.3
        self.note(f"mempool_new dev={dev} no_split={no_split}")
        with accel.device_index(dev):
            self.mempools.append((memory.MemPool(no_split=no_split), no_split))

    def op_graph(self) -> None:
        if not self.graphs_ok:
            return self.op_alloc()
        dev = self.rng.choice(self.devs)
        choice = self.rng.random()
        pool = None
        no_split = False
        if choice < 0.2:
            shared = [g for g in self.graph_recs if g.dev == dev and not g.reset]
            if shared:
                other = self.rng.choice(shared)
                pool, no_split = other.graph.pool(), other.no_split
        elif choice < 0.35:
            pool = accel.graphs.graph_pool_handle()
        elif choice < 0.5 and not self.async_backend:
            pools = [p for p in self.mempools if p[0].device_index == dev]
            if pools:
                mp, no_split = self.rng.choice(pools)
                pool = mp.id
        s = self.new_stream(dev)
        g = accel.Graph(pool=pool)
        rec = GraphRec(g, dev, s, no_split=no_split)
        sizes = [self.size() for _ in range(self.rng.randint(1, 4))]
        self.note(f"graph dev={dev} pool={pool} sizes={sizes}")
        made = []
        # sometimes a cap that the capture's allocations may hit: no cache can be released while
        # capturing, so the allocation raises, and the capture must go on undamaged
        capped = self.rng.random() < 0.15
        with s:
            if self.rng.random() < 0.5:
                g.capture_begin()
            else:
                accel.synchronize(dev)
                g.capture_begin()
            try:
                if capped:
                    st = memory.memory_stats(dev)
                    total = memory.get_memory_info(dev)[1]
                    fraction = (st["reserved_bytes.all.current"] + self.rng.choice([0, 2, 8]) * MiB) / total
                    memory.set_per_process_memory_fraction(min(fraction, 1.0), dev)
                    self.note(f"graph_cap fraction={fraction:.6f}")
                for n in sizes:
                    try:
                        buf = accel.Buffer(n)
                    except OutOfMemoryError:
                        if not capped:
                            raise
                        self.note(f"graph_oom n={n}")
                        continue
                    tag = self.tag_for(dev)
                    lv = self.add(buf, dev, n, s, tag, graph=rec, valid=False, no_split=rec.no_split)
                    buf.fill_(tag)
                    made.append(lv)
                    if len(made) > 1 and self.rng.random() < 0.25:
                        gone = made.pop(self.rng.randrange(len(made)))
                        gone.buf.close()           # freed during the capture
                        self.remove(gone)
                        rec.keys.remove(gone.key)
                        rec.frozen = False         # (freed in the capture itself: replays stay valid)
            finally:
                try:
                    with warnings.catch_warnings():
                        # every allocation refused by the cap (or of 0 bytes): nothing captured
                        warnings.filterwarnings("ignore", "The .* Graph is empty", UserWarning)
                        g.capture_end()
                finally:
                    if capped:
                        memory.set_per_process_memory_fraction(1.0, dev)
        self.graph_recs.append(rec)
        self.replay(rec)

    def replay(self, rec: GraphRec) -> None:
        on_capture_stream = self.rng.random() < 0.5 and not rec.stream._closed
        if on_capture_stream:
            with rec.stream:
                rec.graph.replay()
        else:
            with accel.device_index(rec.dev):
                rec.graph.replay()
            accel.current_stream(rec.dev).synchronize()
        for key in rec.keys:
            self.live[key].valid = True

    def op_graph_replay(self) -> None:
        recs = [r for r in self.graph_recs if not r.reset and not r.frozen]
        if not recs:
            return self.op_graph()
        rec = self.rng.choice(recs)
        self.note(f"graph_replay dev={rec.dev}")
        self.replay(rec)

    def op_graph_reset(self) -> None:
        recs = [r for r in self.graph_recs if not r.reset]
        if not recs:
            return self.op_graph()
        rec = self.rng.choice(recs)
        self.note(f"graph_reset dev={rec.dev}")
        rec.graph.reset()
        rec.reset = True
        self.graph_recs.remove(rec)

    # -- invariants
    def check(self) -> None:
        snap = None if self.async_backend else memory.memory_snapshot()
        for dev in self.devs:
            self.check_device(dev, snap)

    def check_device(self, dev: int, snap) -> None:
        st = memory.memory_stats(dev)
        mine = [lv for lv in self.live.values() if lv.dev == dev and lv.nbytes]
        n_alloc = st["allocation.all.current"]
        active = st["active.all.current"]
        alloc_b = st["allocated_bytes.all.current"]
        active_b = st["active_bytes.all.current"]
        reserved = st["reserved_bytes.all.current"]
        requested = st["requested_bytes.all.current"]
        # while a graph of the device is captured and not reset, the default generator's graph
        # seed and offset holders (accel/random/generator.py, torch's seed_extragraph_ and
        # offset_extragraph_) are two 8-byte allocations of the general pool
        holders = HOLDERS * sum(r.dev == dev for r in self.graph_recs)      # a pair per graph
        want_req = sum(lv.nbytes for lv in mine) + HOLDER_BYTES * holders
        if n_alloc != len(mine) + holders:
            self.fail(f"dev {dev}: allocation.all.current {n_alloc}, the model has {len(mine)} live buffers"
                      f" and {holders} RNG holders")
        if self.async_backend:
            if requested != want_req:
                self.fail(f"dev {dev}: requested_bytes.all.current {requested}, live buffers hold {want_req}")
            if not reserved >= alloc_b:
                self.fail(f"dev {dev}: reserved {reserved} < allocated {alloc_b}")
            return
        exact = [lv for lv in mine if not lv.no_split]
        want_alloc = sum(self.expected_size(lv) for lv in exact) + 512 * holders
        if not exact == mine and alloc_b < want_alloc + sum(self.expected_size(lv) for lv in mine if lv.no_split):
            self.fail(f"dev {dev}: allocated_bytes {alloc_b} below what the live buffers need")
        if exact == mine and alloc_b != want_alloc:
            self.fail(f"dev {dev}: allocated_bytes.all.current {alloc_b}, the model expects {want_alloc}")
        if active < n_alloc or active_b < alloc_b:
            self.fail(f"dev {dev}: active {active}/{active_b} B below allocated {n_alloc}/{alloc_b} B")
        if active == n_alloc and requested != want_req:
            self.fail(f"dev {dev}: requested_bytes.all.current {requested}, live buffers asked for {want_req}")
        if reserved < active_b:
            self.fail(f"dev {dev}: reserved {reserved} < active bytes {active_b}")
        # the snapshot
        segs = [s for s in snap if s["device"] == dev]
        blocks = {}
        pending = 0
        total = 0
        for seg in segs:
            at = seg["address"]
            total += seg["total_size"]
            for b in seg["blocks"]:
                if b["address"] != at:
                    self.fail(f"dev {dev}: snapshot blocks do not tile segment {seg['address']:#x} at {at:#x}")
                at += b["size"]
                if b["state"] == "active_allocated":
                    blocks[b["address"]] = b
                elif b["state"] == "active_pending_free":
                    pending += 1
            if at != seg["address"] + seg["total_size"]:
                self.fail(f"dev {dev}: snapshot blocks cover {at - seg['address']} of segment "
                          f"{seg['address']:#x}'s {seg['total_size']} B")
        if total != reserved:
            self.fail(f"dev {dev}: snapshot segments hold {total} B, reserved_bytes.all.current is {reserved}")
        if pending != active - n_alloc:
            self.fail(f"dev {dev}: snapshot has {pending} pending blocks, stats say {active - n_alloc}")
        for lv in mine:
            b = blocks.pop(lv.ptr, None)
            if b is None:
                self.fail(f"dev {dev}: live buffer #{lv.key} ({lv.nbytes} B at {lv.ptr:#x}) is no active "
                          f"block of the snapshot")
            want = self.expected_size(lv)
            if b["size"] != want and not (lv.no_split and b["size"] > want):
                self.fail(f"dev {dev}: buffer #{lv.key} of {lv.nbytes} B is a block of {b['size']} B, expected "
                          f"{want}")
            if b["requested_size"] != lv.nbytes:
                self.fail(f"dev {dev}: buffer #{lv.key}: snapshot requested_size {b['requested_size']}, "
                          f"asked {lv.nbytes}")
        kept = [a for a, b in blocks.items() if b["requested_size"] == HOLDER_BYTES and b["size"] == 512]
        if len(kept) >= holders:
            for a in kept[:holders]:
                del blocks[a]
        if blocks:
            extra = ", ".join(f"{a:#x}+{b['size']}" for a, b in list(blocks.items())[:4])
            self.fail(f"dev {dev}: snapshot has active blocks no live buffer holds: {extra}")

    # -- the run
    OPS = (("alloc", 30), ("free", 18), ("record_stream_free", 8), ("stream_new", 3), ("stream_close", 4),
           ("empty_cache", 3), ("set_device", 3), ("spot", 6), ("oom", 3), ("mempool", 2), ("graph", 2),
           ("graph_replay", 2), ("graph_reset", 2))

    def plan(self) -> List[tuple]:
        """The op sequence: (name, seed of the op's own choices).  Each op draws from its own
        generator, so a shrinker that drops ops keeps the others' choices much as they were."""
        names = [n for n, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        return [(self.rng.choices(names, weights)[0], self.rng.getrandbits(32)) for _ in range(self.ops)]

    def run(self, plan: Optional[List[tuple]] = None) -> None:
        plan = self.plan() if plan is None else plan
        try:
            for self.step, (name, sub) in enumerate(plan):
                self.rng = random.Random(sub)
                if name == "alloc" and len(self.live) > 48:
                    name = "free"
                getattr(self, "op_" + name)()
                self.check()
                lv = self.pick()
                if lv is not None:
                    self.verify_spot(lv)
            self.step = len(plan)
            self.teardown()
        except Invariant:
            raise
        except Exception as exc:
            self.fail(f"{type(exc).__name__}: {exc}")

    def teardown(self) -> None:
        self.note("teardown")
        for lv in list(self.live.values()):
            self.verify_full(lv)
            lv.buf.close()
            self.remove(lv)
        for rec in self.graph_recs:
            rec.graph.reset()
        self.graph_recs.clear()
        self.mempools.clear()
        for dev in self.devs:
            for s in self.streams[dev]:
                s.close()
            self.streams[dev].clear()
        gc.collect()
        for dev in self.devs:
            accel.synchronize(dev)
        memory.empty_cache()
        self.check()
        for dev in self.devs:
            st = memory.memory_stats(dev)
            if st["reserved_bytes.all.current"] or st["active.all.current"]:
                self.fail(f"dev {dev}: everything freed and emptied, yet reserved "
                          f"{st['reserved_bytes.all.current']} B, {st['active.all.current']} active blocks")


# ------------------------------------------------------------------------------ sim live objects
def live_objects(kind: str) -> dict:
    st = sim.state()
    if kind == "cuda":
        keys = ("streams", "events", "graphs", "graph_execs", "captures", "host_allocations",
                "vmm_handles", "vmm_mappings")
        out = {k: getattr(st, k) for k in keys}
        out["allocations"] = dict(st.live_allocations)
        return out
    if kind == "xpu":
        keys = ("ze_live_allocations", "ze_live_events", "ze_live_event_pools", "ze_live_command_lists",
                "ze_live_command_queues", "ze_vmm_handles", "ze_vmm_mappings")
        return {k: getattr(st, k) for k in keys}
    return dict(st.metal_live_objects)


def run_seed(monkeypatch, kind: str, conf: str, seed: int, ops: int, devices: int = 2, delay_us: int = 200,
             graphs: bool = True, plan: Optional[List[tuple]] = None) -> Fuzz:
    env = {"ACCEL_SIM_DELAY_US": delay_us}
    if conf:
        env["ACCEL_ALLOC_CONF"] = conf
    if kind != "mps":
        env["ACCEL_SIM_DEVICES"] = devices
    use_sim(monkeypatch, kind, **env)
    devices = accel.device_count()
    # warm up: the runtime, each device's allocator and first reservation, then empty again
    for dev in range(devices):
        accel.Buffer(1, device=dev).close()
    for dev in range(devices):
        accel.synchronize(dev)
    memory.empty_cache()
    start = live_objects(kind)
    fz = Fuzz(kind, conf, seed, devices, ops, graphs=graphs)
    fz.run(plan)
    end = live_objects(kind)
    if kind == "xpu":
        # The Level Zero backend signals every record with a fresh event from pools of 64
        # (accel/backends/xpu/events.py) that it keeps for the runtime's life: the documented
        # remainder is whole, idle pools, a few of them.
        pools = end["ze_live_event_pools"] - start["ze_live_event_pools"]
        if 0 <= pools <= 4 and end["ze_live_events"] - start["ze_live_events"] == 64 * pools:
            for k in ("ze_live_event_pools", "ze_live_events"):
                end[k] = start[k]
    if end != start:
        fz.fail(f"simulator objects after teardown {end}, at the start {start}")
    return fz


def shrink(kind: str, conf: str, seed: int, ops: int, needle: str, tries: int = 1) -> List[tuple]:
    """Delta-debug a failing seed's plan down to a minimal one whose failure message still holds
    ``needle`` (``tries`` runs per candidate, for failures that depend on timing).  How the
    repros below were found, e.g. ``shrink("cuda", "", 48, 150, "IllegalAddress", tries=4)``
    (with AVOID_RECYCLED_HANDLE_BUG off)."""
    def fails(plan) -> bool:
        for _ in range(tries):
            with pytest.MonkeyPatch.context() as mp:
                for key in [k for k in os.environ if k.startswith("ACCEL_")]:
                    mp.delenv(key)
                try:
                    run_seed(mp, kind, conf, seed, ops, plan=plan)
                except Exception as exc:
                    if needle in f"{type(exc).__name__}: {exc}":
                        return True
                finally:
                    accel._lazy._reset_for_tests()
        return False

    plan = Fuzz(kind, conf, seed, 2, ops).plan()
    assert fails(plan), f"seed {seed} does not fail with {needle!r}"
    return shrink_plan(plan, fails)


# ---------------------------------------------------------------------------------- the sweeps
#: Seeds per allocator configuration in the CUDA sweep, in BATCHES test cases each: sized so that
#: the file runs in well under a minute on a shared 2-core machine.  R64A_FUZZ_SEEDS=200 runs
#: the sweep this file was written with (r64a: 200 to 400 seeds per configuration, 150 ops each,
#: Level Zero and Metal 60 seeds of 100 ops; clean once the two bugs below were set aside).
#: Default: 2 seeds (one per batch) of 100 ops per conf, Level Zero 1 seed per conf (each plan is
#: a prefix-stable draw, so these are the first checks of the fuller runs); THOROUGH: 8 seeds of
#: 150, Level Zero 4; R64A_FUZZ_SEEDS=4 gives the previous default (4 of 150, Level Zero 3).
_SEEDS_ENV = os.environ.get("R64A_FUZZ_SEEDS", "")
CUDA_SEEDS = int(_SEEDS_ENV or ("8" if THOROUGH else "2"))
BATCHES = 2
OPS = 150 if THOROUGH or _SEEDS_ENV else 100
OTHER_SEEDS = max(3, CUDA_SEEDS // 2)
XPU_SEEDS = OTHER_SEEDS if THOROUGH or _SEEDS_ENV else 1


def _run_seeds(monkeypatch, kind, conf, seeds, ops):
    for seed in seeds:
        run_seed(monkeypatch, kind, conf, seed, ops)
        accel._lazy._reset_for_tests()


@pytest.mark.parametrize("batch", range(BATCHES))
@pytest.mark.parametrize("conf", CONFS, ids=_conf_id)
def test_cuda_allocator_model_fuzz(monkeypatch, conf, batch):
    per = -(-CUDA_SEEDS // BATCHES)
    _run_seeds(monkeypatch, "cuda", conf, range(batch * per, min(CUDA_SEEDS, (batch + 1) * per)), OPS)


@pytest.mark.parametrize("conf", ["", "expandable_segments:False"], ids=_conf_id)
def test_xpu_allocator_model_fuzz(monkeypatch, conf):
    _run_seeds(monkeypatch, "xpu", conf, range(1000, 1000 + XPU_SEEDS), 100)


def test_mps_allocator_model_fuzz(monkeypatch):
    _run_seeds(monkeypatch, "mps", "", range(2000, 2000 + OTHER_SEEDS), 100)


# --------------------------------------------------------------------- minimal repros (shrunk)
@pytest.mark.parametrize("kind,conf", [("cuda", "expandable_segments:False"), ("cuda", ""),
                                       ("xpu", "expandable_segments:False"), ("xpu", "")],
                         ids=["cuda-classic", "cuda-expandable", "xpu-classic", "xpu-expandable"])
def test_use_on_a_stream_with_the_closed_streams_handle_keeps_the_block(monkeypatch, kind, conf):
    """Shrunk from the sweep (cuda default seed 48, 150 -> 10 ops).  A buffer allocated on a
    stream that is then closed (work still queued) is used on a new stream, which the runtime
    gives the closed stream's handle (CUDA and Level Zero recycle handles at once), and freed:
    the use must keep its memory from reuse until that work ran.  The allocator drops the use
    (the block's free list is still the closed stream's, keyed by the same handle value), so the
    next allocation gets the memory at once and the queued fills overwrite it (classic
    segments: silently wrong content), or its page is unmapped under them (expandable
    segments: a sticky device fault)."""
    use_sim(monkeypatch, kind, ACCEL_SIM_DELAY_US=200, **({"ACCEL_ALLOC_CONF": conf} if conf else {}))
    s = accel.Stream(0)
    b = accel.Buffer(60, stream=s)
    b.fill_(5, stream=s)
    closed = s.handle
    s.close()                   # its fill still queued: its free lists wait for a gate event
    accel.synchronize(0)
    t = accel.Stream(0)
    assert t.handle == closed, "the simulator recycles the handle (the premise of this test)"
    for _ in range(4):
        b.fill_(5, stream=t)    # queued behind the simulated delay
    b.record_stream(t)
    b.close()
    c = accel.Buffer(60)
    c.fill_(9)
    t.synchronize()
    assert c.to_numpy().tolist() == [9] * 60, "the new buffer was handed memory still written on t"


@pytest.mark.parametrize("conf", ["backend:cudaMallocAsync", ""], ids=["cudaMallocAsync", "native"])
def test_graph_reset_after_freeing_an_output_still_used_on_another_stream(monkeypatch, conf):
    """Shrunk from the sweep (cudaMallocAsync seed 27, 150 -> 21 ops).  A graph's output
    allocation, replayed, written on another stream and freed (the free waits for that stream),
    then the graph reset before that work ran: the work must still find the memory.  Under
    backend:cudaMallocAsync the free is a cudaFreeAsync ordered after the other stream and the
    reset destroys the executable graph; the simulator gave the graph allocation's address back
    at the destroy, before the GPU reached the free, and the queued fills faulted
    (cudaErrorIllegalAddress).  The CUDA Programming Guide, "Graph Memory Nodes": the lifetime
    ends when GPU execution reaches the cudaFreeAsync, and graph destruction does not end it
    (fixed in accel/sim/_graph_mem.py, r64a)."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=200, **({"ACCEL_ALLOC_CONF": conf} if conf else {}))
    s = accel.Stream(0)
    g = accel.Graph()
    with s:
        g.capture_begin()
        out = accel.Buffer(4096)
        out.fill_(1)
        g.capture_end()
    with s:
        g.replay()
    s.synchronize()
    t = accel.Stream(0)
    for _ in range(4):
        out.fill_(2, stream=t)      # queued behind the simulated delay
    out.record_stream(t)
    out.close()
    g.reset()
    t.synchronize()                 # the fills ran on memory still allocated
    assert not sim.state().errors
    again = accel.Buffer(4096, stream=t)
    again.fill_(3, stream=t)
    assert again.to_numpy(stream=t).tolist() == [3] * 4096
    again.close()
    t.close()
    s.close()
    accel.synchronize(0)
    memory.empty_cache()
    assert memory.memory_stats(0)["allocation.all.current"] == 0
