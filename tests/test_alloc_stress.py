"""Concurrency and long-run stress of the device allocators (r12): several threads on two
simulated devices (CUDA and Level Zero; expandable segments on and off; cudaMallocAsync) drive
malloc/free of mixed sizes on several streams, record_stream then stream destruction, events,
graph captures into private pools (allocations and frees inside the capture, joined streams,
replays, reset or a dropped graph), MemPool / use_mem_pool, empty_cache and per-process memory
fraction changes that force OOM retries.

After every phase (all threads joined) the allocator invariants are checked (classic segments as
``test_memory_allocator.check_invariants``, expandable ones as ``test_memory_expandable.check``,
both at once here since a run holds both kinds), with the simulator's own counts of allocations
and mappings; the allocator's per-stream and per-pool state must name only live streams, pools
and captures (bounded by live objects, not by how many were ever made).  At the end everything
is closed: nothing allocated, nothing reserved, the simulator's streams, events, allocations and
mappings back to where they were before the run.

Each thread's operations come from a seeded ``random.Random``; the interleaving of threads is
the scheduler's.  A failure names the config, phase and thread seed.  ``ACCEL_TEST_STRESS=N``
runs N times as many phases (the default run is a few seconds per config),
``ACCEL_TEST_STRESS_SEED=k`` other seeds, ``ACCEL_TEST_STRESS_THREADS`` / ``_MEMORY`` / ``_DELAY_US``
more threads, another device size, another stream latency.  No timed asserts.
"""

from __future__ import annotations

import gc
import os
import random
import threading
import time
import traceback
import weakref

import pytest

import accel
from accel import _finalize, _lazy, memory, sim
from accel._errors import CaptureError, OutOfMemoryError
from accel.memory import _blocks, _caching, _expandable, _guards
from accel.memory._async import AsyncPoolAllocator
from accel.sim import _vmm
from conftest import THOROUGH, use_sim

MiB = 1 << 20
SCALE = max(1, int(os.environ.get("ACCEL_TEST_STRESS", "1") or 1))
SEED = int(os.environ.get("ACCEL_TEST_STRESS_SEED", "0") or 0)     # another seed: other op sequences
# default run: 2 phases of 40 operations per thread (items and streams still change hands between
# phases once); THOROUGH: 3 phases of 60, as before
PHASES = (3 if THOROUGH else 2) * SCALE
THREADS = int(os.environ.get("ACCEL_TEST_STRESS_THREADS", "3") or 3)
MEMORY = os.environ.get("ACCEL_TEST_STRESS_MEMORY", "1G") or "1G"     # per simulated device
OPS = 60 if THOROUGH else 40
DELAY_US = int(os.environ.get("ACCEL_TEST_STRESS_DELAY_US", "50") or 0)   # latency of each stream operation

CONFIGS = [
    ("cuda", "expandable_segments:True"),
    ("cuda", "expandable_segments:False"),
    ("xpu", "expandable_segments:True"),
    ("xpu", "expandable_segments:False"),
    ("cuda", "backend:cudaMallocAsync"),
]


def _sizes(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.35:
        return rng.randint(1, 64 << 10)
    if r < 0.6:
        return rng.randint(64 << 10, MiB)
    if r < 0.9:
        return rng.randint(MiB + 1, 9 * MiB)
    return rng.randint(10 * MiB, 40 * MiB)


# ------------------------------------------------------------------------------------ checks
def _current(alloc) -> dict:
    """The ``.current`` stats as stats() computes them, read while the caller holds the lock."""
    from accel.memory import _stats as S
    cur = alloc._columns()[0]
    out = {}
    for q, pool in enumerate(S.POOL_NAMES):
        for s, name in enumerate(S.POOLED):
            out[f"{name}.{pool}.current"] = cur[3 * s + q]
        out[f"active.{pool}.current"] = cur[S.ALLOCATION + q] + alloc._pend[q]
        out[f"active_bytes.{pool}.current"] = cur[S.ALLOCATED_BYTES + q] + alloc._pend[3 + q]
    return out


def _check_caching(alloc, locked: bool = False) -> None:
    """Classic segments (check_invariants' rules) and expandable ones (check's E1-E5, E9)
    of one DeviceCachingAllocator, and the stats against the blocks.  ``locked``: the caller
    holds the allocator's lock (a check while other threads run): the current stats only."""
    C = _caching
    blocks = alloc._blocks
    seen = set()
    n = {k: [0, 0, 0] for k in ("alloc", "alloc_b", "req", "seg", "res", "isplit", "isplit_b", "pend", "pend_b")}

    def count(block, q, split):
        for k in (0, q):
            if block.state == C._ALLOCATED:
                n["alloc"][k] += 1
                n["alloc_b"][k] += block.size
                n["req"][k] += block.requested
                assert block.requested <= block.size
            elif block.state == C._PENDING:
                n["pend"][k] += 1
                n["pend_b"][k] += block.size
                n["req"][k] += block.requested     # until the block is free, as torch's
            elif block.state == C._FREE and split:
                n["isplit"][k] += 1
                n["isplit_b"][k] += block.size

    # invariant 7: only an allocated block keeps its owner's reference
    assert all(b.ref is None for b in blocks.values() if b.state != C._ALLOCATED), "a freed block kept its owner reference"
    for base, seg_size in alloc._segments.items():
        block = blocks[base]
        assert block.prev is None and block.seg is None
        fl = block.pool
        q = fl.kind
        end = base
        prev_free = False
        split = block.next is not None
        while block is not None:
            assert block.ptr == end, "classic: blocks tile the segment"
            assert block.size > 0 and block.size % 512 == 0
            assert block.pool is fl, "classic: a segment's blocks share one free list"
            assert blocks[block.ptr] is block
            assert block.state in (C._FREE, C._ALLOCATED, C._PENDING)
            if block.next is not None:
                assert block.next.prev is block
            is_free = block.state == C._FREE
            assert not (is_free and prev_free), "classic: adjacent free blocks not coalesced"
            prev_free = is_free
            seen.add(block.ptr)
            count(block, q, split)
            end += block.size
            block = block.next
        assert end == base + seg_size
        for k in (0, q):
            n["seg"][k] += 1
            n["res"][k] += seg_size
    gran = alloc._gran
    for seg in alloc._exp_segs:
        q = seg.kind
        end = seg.base
        prev_state = None
        mapped = 0
        pools = set()
        for block in seg.blocks():
            assert block.ptr == end, "E1"
            assert block.seg is seg and block.size > 0
            st = block.state
            pools.add(id(block.pool))
            assert not (st == prev_state and st in (C._FREE, _expandable.UNMAPPED)), "E2"
            if st == _expandable.UNMAPPED:
                assert block.ptr % gran == 0 and block.size % gran == 0, "E4"
                assert block.ptr not in blocks
            else:
                assert blocks[block.ptr] is block
                seen.add(block.ptr)
                mapped += block.size
                count(block, q, False)      # E14: no inactive split block (torch's rule)
            prev_state = st
            end += block.size
            if block.next is not None:
                assert block.next.prev is block
        assert end == seg.base + seg.size, "E1"
        assert seg.holes == {b for b in seg.blocks() if b.state == _expandable.UNMAPPED}, "holes record"
        assert len(pools) == 1, "a segment's blocks share one stream's lists"
        assert mapped == seg.mapped == sum(m for m, _ in seg.maps.values()), "E3"
        assert sorted(seg.maps) == seg.starts
        for a, (m, _) in seg.maps.items():
            assert m % gran == 0 and 0 < m // gran <= max(1, alloc._reserved_hw // gran // _expandable.PIECE_SHARE), "E9"
        for k in (0, q):            # E14: reserved bytes, but no segment (torch's rule)
            n["res"][k] += seg.mapped
    for _, m, kind, _ in alloc._unreleased:
        for k in (0, kind):
            n["res"][k] += m
    assert seen == set(blocks), "every block belongs to a segment"
    # free lists: sorted, exactly the free blocks
    listed = set()
    all_lists = list(alloc._general.values()) + [l for p in alloc._private.values() for l in p.lists.values()]
    all_lists += [pair for entry in alloc._pending_events if type(entry[2]) is C._Retired
                  for _, pair in entry[2].lists]
    for pair in all_lists:
        for fl in pair:
            assert fl.keys == sorted(fl.keys)
            limit = _blocks._MEMO_LIMIT
            assert len(fl.alloc_deltas) <= limit and len(fl.split_deltas) <= limit
            for key in fl.keys:
                block = blocks[key & C._MASK]
                assert block.state == C._FREE and block.pool is fl
                assert key >> 64 == block.size
                assert block.ptr not in listed
                listed.add(block.ptr)
    assert listed == {p for p, b in blocks.items() if b.state == C._FREE}, "free lists hold exactly the free blocks"
    owners = [alloc._general] + [p.lists for p in alloc._private.values() if p.use_count == 0]
    scanned = {key & C._MASK for lists in owners for pair in lists.values() for fl in pair for key in fl.keys
               if blocks[key & C._MASK].prev is None and blocks[key & C._MASK].next is None
               and blocks[key & C._MASK].seg is None}
    assert {b.ptr for b in alloc._whole_free_segments()} == scanned, "_whole record"
    assert set(alloc._whole) <= set(alloc._segments)
    assert sorted(map(id, alloc._pending)) == sorted(
        id(b) for b in blocks.values() if b.state == C._PENDING), "_pending is the pending blocks"
    stats = _current(alloc) if locked else alloc.stats()
    for q, pool in enumerate(("all", "small_pool", "large_pool")):
        expect = {"allocation": n["alloc"][q], "allocated_bytes": n["alloc_b"][q],
                  "requested_bytes": n["req"][q], "segment": n["seg"][q], "reserved_bytes": n["res"][q],
                  "inactive_split": n["isplit"][q], "inactive_split_bytes": n["isplit_b"][q],
                  "active": n["alloc"][q] + n["pend"][q], "active_bytes": n["alloc_b"][q] + n["pend_b"][q]}
        for name, value in expect.items():
            assert stats[f"{name}.{pool}.current"] == value, f"{name}.{pool}.current"
            if locked:
                continue
            assert stats[f"{name}.{pool}.peak"] >= value, f"{name}.{pool}.peak"
            assert stats[f"{name}.{pool}.allocated"] - stats[f"{name}.{pool}.freed"] == value, \
                f"{name}.{pool}.allocated - freed"


def _check_async(alloc: AsyncPoolAllocator, locked: bool = False) -> None:
    """The held allocations against accel's counts; ``locked``: the caller holds the lock."""
    held = list(alloc._ptrs.values())
    assert all(a.held for a in held)
    assert all(a.held for dead in alloc._dead.values() for a in dead)    # stale, still counted
    if locked:
        assert alloc._count[0] == len(held) + sum(len(d) for d in alloc._dead.values())
        assert alloc._req[0] == sum(a.size for a in held) + sum(a.size for d in alloc._dead.values() for a in d)
        return
    stats = alloc.stats()
    assert stats["allocation.all.current"] == len(held) + sum(len(d) for d in alloc._dead.values())


def _sim_counts(kind: str) -> dict:
    st = sim.state()
    if kind == "xpu":
        keys = ("ze_live_allocations", "ze_live_events", "ze_live_event_pools", "ze_live_command_lists",
                "ze_live_command_queues", "ze_vmm_reservations", "ze_vmm_handles", "ze_vmm_mappings",
                "ze_vmm_physical_bytes")
    else:
        keys = ("live_allocations", "streams", "events", "graphs", "graph_execs", "captures",
                "vmm_reservations", "vmm_handles", "vmm_mappings", "vmm_physical_bytes")
    return {k: getattr(st, k) for k in keys}


class _Run:
    """Objects alive across phases (handed from thread to thread) and the run's bookkeeping."""

    def __init__(self, kind: str, conf: str, seed: int):
        self.kind, self.conf, self.seed = kind, conf, seed
        self.lock = threading.Lock()
        self.capture_lock = [threading.Lock(), threading.Lock()]     # one capture per device at a time
        self.streams = {0: [], 1: []}        # live accel.Streams the run made
        self.items = []                      # leftovers: ("ptr", dev, ptr) / ("buf", buf) / ("graph", g, pool...)
        self.shared_pools = {0: [], 1: []}   # graph_pool_handle() ids
        self.mempools = {0: [], 1: []}
        self.all_streams = weakref.WeakSet()   # every Stream the run made: the live ones are not closed
        self.all_graphs = weakref.WeakSet()    # every Graph: a live one not reset holds its pool
        self.all_mempools = weakref.WeakSet()
        self.streams_made = 0
        self.graphs_made = 0
        self.ooms = 0
        self.errors = []
        self.mailbox = []                    # items in flight between threads

    def new_stream(self, dev: int):
        s = accel.Stream(device=dev)
        with self.lock:
            self.streams_made += 1
            self.all_streams.add(s)
        return s

    @property
    def caching(self) -> bool:
        return "cudaMallocAsync" not in self.conf


class _Worker:
    """One thread's operations (seeded)."""

    def __init__(self, run: _Run, seed: int, inherited: list):
        self.run = run
        self.rng = random.Random(seed)
        self.seed = seed
        self.items = inherited                 # what this thread holds
        self.streams = {0: [], 1: []}          # streams this thread made (closed or handed over at the end)

    # -- helpers
    def stream(self, dev: int):
        rng = self.rng
        pool = self.streams[dev]
        if not pool or (len(pool) < 3 and rng.random() < 0.3):
            s = self.run.new_stream(dev)
            pool.append(s)
            return s
        r = rng.random()
        if r < 0.15:
            return accel.default_stream(dev)
        return rng.choice(pool)

    def malloc_raw(self, dev: int) -> None:
        s = self.stream(dev)
        try:
            ptr = memory.device_allocator(dev).malloc(_sizes(self.rng), s.handle)
        except OutOfMemoryError:
            self.run.ooms += 1
            return
        self.items.append(["ptr", dev, ptr, s])

    def buffer(self, dev: int) -> None:
        s = self.stream(dev)
        try:
            buf = accel.Buffer(_sizes(self.rng), device=dev, stream=s)
        except OutOfMemoryError:
            self.run.ooms += 1
            return
        buf.fill_(self.rng.randrange(256), stream=s)
        # another stream uses it only after this event: cudaMallocAsync memory "must not be
        # accessed until the allocation operation completes" (a stream may be closed by then)
        self.items.append(["buf", dev, buf, s, s.record_event()])

    def release(self, item, drop_ok=True) -> None:
        what = item[0]
        if what == "ptr":
            memory.device_allocator(item[1]).free(item[2])
        elif what == "buf":
            if drop_ok and self.rng.random() < 0.25:
                item[2] = None              # dropped: its finalizer frees it
            else:
                item[2].close()
        elif what == "graph":
            g = item[2]
            if drop_ok and self.rng.random() < 0.3:
                item[2] = None              # dropped: its finalizer releases the pool
            else:
                g.reset()
            for buf in item[3]:
                buf.close()
        elif what == "mempool":
            item[2] = None

    def record_use(self) -> None:
        live = [it for it in self.items if it[0] in ("ptr", "buf") and it[2] is not None]
        if not live:
            return
        item = self.rng.choice(live)
        dev = item[1]
        other_dev = dev if self.rng.random() < 0.8 else 1 - dev
        other = self.stream(other_dev)
        if item[0] == "buf":
            if other_dev == dev:
                if item[4] is not None:
                    other.wait_event(item[4])           # (see buffer)
                item[2].fill_(7, stream=other)          # a use on another stream: recorded by the buffer
            else:
                item[2].record_stream(other)
        else:
            memory.device_allocator(dev).record_stream(item[2], other.handle, other_dev)

    def close_stream(self) -> None:
        devs = [d for d in (0, 1) if self.streams[d]]
        if not devs:
            return
        dev = self.rng.choice(devs)
        s = self.streams[dev].pop(self.rng.randrange(len(self.streams[dev])))
        in_use = any(it[3] is s for it in self.items if it[0] in ("ptr", "buf") and it[2] is not None)
        if in_use and self.rng.random() < 0.5:
            self.streams[dev].append(s)     # keep it: allocations made on it are still live
            return
        # blocks allocated on it or recorded on it may still be live: the allocator covers them
        for it in self.items:
            if it[0] in ("ptr", "buf") and it[3] is s:
                it[3] = None
        if self.rng.random() < 0.2:
            del s                           # dropped: its finalizer destroys it
        else:
            s.close()

    def events(self) -> None:
        dev = self.rng.choice((0, 1))
        a, b = self.stream(dev), self.stream(dev)
        ev = accel.Event()
        ev.record(a)
        b.wait_event(ev)
        if self.rng.random() < 0.5:
            ev.close()

    def capture(self) -> None:
        rng, run = self.rng, self.run
        dev = rng.choice((0, 1))
        if not run.capture_lock[dev].acquire(False):
            return
        try:
            self._capture(dev)
        finally:
            run.capture_lock[dev].release()

    def _capture(self, dev: int) -> None:
        rng, run = self.rng, self.run
        choice = rng.random()
        pool = None
        if choice < 0.3 and run.shared_pools[dev]:
            pool = rng.choice(run.shared_pools[dev])
        elif choice < 0.4:
            pool = accel.graphs.graph_pool_handle()
            run.shared_pools[dev].append(pool)
        elif choice < 0.55 and run.caching:
            with accel.device_index(dev):
                mp = accel.MemPool()
            with run.lock:
                run.all_mempools.add(mp)
            self.items.append(["mempool", dev, mp, None])
            pool = mp.id
        # a stream of its own: a stream some other thread uses would be captured too
        s = run.new_stream(dev)
        side = run.new_stream(dev)
        g = accel.Graph(pool=pool, capture_error_mode=rng.choice(("thread_local", "relaxed")))
        outputs = []
        with run.lock:
            run.graphs_made += 1
            run.all_graphs.add(g)
        try:
            with s:
                g.capture_begin()
                try:
                    temps = []
                    for _ in range(rng.randint(1, 6)):
                        buf = accel.Buffer(_sizes(rng) // 4 + 1, device=dev, stream=s)
                        buf.fill_(rng.randrange(256), stream=s)
                        (outputs if rng.random() < 0.4 else temps).append(buf)
                        if temps and rng.random() < 0.5:
                            temps.pop(rng.randrange(len(temps))).close()      # freed inside the capture
                    if run.kind == "cuda" and rng.random() < 0.5:
                        # (Level Zero captures record no events)
                        # a second stream joins the capture: its allocations go to the same pool
                        ev = accel.Event()
                        ev.record(s)
                        side.wait_event(ev)
                        buf = accel.Buffer(rng.randint(1, 3 * MiB), device=dev, stream=side)
                        buf.fill_(1, stream=side)
                        back = accel.Event()
                        back.record(side)
                        s.wait_event(back)
                        (outputs if rng.random() < 0.5 else temps).append(buf)
                    for buf in temps:
                        buf.close()
                except BaseException:
                    try:
                        g.capture_end()
                    finally:
                        g.reset()
                        for buf in outputs:
                            buf.close()
                    raise
                g.capture_end()
            for _ in range(rng.randint(0, 3)):
                with s:
                    g.replay()
        except OutOfMemoryError:
            run.ooms += 1
            return
        finally:
            side.close()
            s.close()
        self.items.append(["graph", dev, g, outputs])

    def mempool(self) -> None:
        if not self.run.caching:
            return
        rng = self.rng
        dev = rng.choice((0, 1))
        mps = [it for it in self.items if it[0] == "mempool" and it[1] == dev and it[2] is not None]
        if mps and rng.random() < 0.5:
            mp = rng.choice(mps)[2]
        else:
            with accel.device_index(dev):
                mp = accel.MemPool(use_on_oom=rng.random() < 0.3, no_split=rng.random() < 0.2)
            with self.run.lock:
                self.run.all_mempools.add(mp)
            self.items.append(["mempool", dev, mp, None])
        try:
            with memory.use_mem_pool(mp, device=dev):
                inside = []
                for _ in range(rng.randint(1, 5)):
                    if rng.random() < 0.5:
                        self.buffer(dev)
                    else:
                        self.malloc_raw(dev)
                    if self.items and self.items[-1][0] in ("ptr", "buf") and rng.random() < 0.4:
                        inside.append(self.items.pop())
                for item in inside:
                    self.release(item, drop_ok=False)
        except RuntimeError as exc:
            if "already recording to mempool_id" not in str(exc):
                raise          # another thread's use_mem_pool or capture routes to it now

    def empty_cache(self) -> None:
        try:
            memory.empty_cache()
        except CaptureError:
            pass               # another thread's capture is underway

    def fraction(self) -> None:
        dev = self.rng.choice((0, 1))
        memory.set_per_process_memory_fraction(self.rng.choice((0.05, 0.1, 0.3, 1.0, 1.0)), dev)

    def copy(self) -> None:
        """A copy into a new buffer, often on the other device (the source's allocator then
        grants the destination device access to its mappings: add_peer)."""
        live = [it for it in self.items if it[0] == "buf" and it[2] is not None]
        if not live:
            return
        src = self.rng.choice(live)
        dev = src[1] if self.rng.random() < 0.3 else 1 - src[1]
        s = self.stream(dev)
        try:
            dst = accel.Buffer(src[2].nbytes, device=dev, stream=s)
        except OutOfMemoryError:
            self.run.ooms += 1
            return
        item = ["buf", dev, dst, s, None]
        self.items.append(item)
        try:
            if src[4] is not None:
                s.wait_event(src[4])            # (see buffer)
            dst.copy_from(src[2], stream=s, non_blocking=True)
        except CaptureError:
            # the first copy between the two devices while another thread captures: access to
            # expandable memory cannot be granted then (E6; the error says so)
            pass
        item[4] = s.record_event()

    def mailbox(self) -> None:
        """Hand an item to whichever thread takes it next, or take one: frees (and closes,
        resets) from a thread other than the one that allocated, while both run."""
        run = self.run
        with run.lock:
            if run.mailbox and self.rng.random() < 0.6:
                self.items.append(run.mailbox.pop(0))
                return
        live = [i for i, it in enumerate(self.items) if it[0] in ("ptr", "buf", "graph") and it[2] is not None]
        if live:
            item = self.items.pop(self.rng.choice(live))
            with run.lock:
                run.mailbox.append(item)

    def replay(self) -> None:
        graphs = [it for it in self.items if it[0] == "graph" and it[2] is not None]
        if not graphs:
            return
        item = self.rng.choice(graphs)
        own = self.rng.random() < 0.7
        s = self.stream(item[1]) if own else self.run.new_stream(item[1])
        try:
            with s:
                item[2].replay()
        except OutOfMemoryError:
            self.run.ooms += 1          # cudaMallocAsync: the launch's graph memory did not fit
        finally:
            if not own:
                s.close()

    def query(self) -> None:
        dev = self.rng.choice((0, 1))
        r = self.rng.random()
        if r < 0.4:
            memory.memory_stats(dev)
        elif r < 0.6:
            memory.memory_snapshot()
        elif r < 0.8:
            memory.memory_summary(dev)
        else:
            memory.reset_peak_memory_stats(dev)

    def free_some(self) -> None:
        if not self.items:
            return
        item = self.items.pop(self.rng.randrange(len(self.items)))
        self.release(item)

    OPS = (("malloc_raw", 14), ("buffer", 14), ("free_some", 24), ("record_use", 8), ("close_stream", 5),
           ("events", 4), ("capture", 4), ("mempool", 3), ("empty_cache", 2), ("fraction", 2), ("query", 2),
           ("copy", 4), ("mailbox", 5), ("replay", 3))

    def __call__(self, steps: int) -> None:
        names = [n for n, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        try:
            for _ in range(steps):
                op = self.rng.choices(names, weights)[0]
                if op in ("malloc_raw", "buffer"):
                    getattr(self, op)(self.rng.choice((0, 1)))
                else:
                    getattr(self, op)()
            # hand part of what it holds to the next phase's threads; free the rest here
            keep = []
            for item in self.items:
                if self.rng.random() < 0.5 and item[2] is not None:
                    keep.append(item)
                else:
                    self.release(item)
            self.items[:] = keep
            for dev in (0, 1):
                for s in self.streams[dev]:
                    if any(it[3] is s for it in keep if it[0] in ("ptr", "buf")) and self.rng.random() < 0.5:
                        with self.run.lock:
                            self.run.streams[dev].append(s)
                    else:
                        s.close()
        except BaseException:
            self.run.errors.append(f"thread seed {self.seed}:\n{traceback.format_exc()}")


# ------------------------------------------------------------------------------------ the run
def _live_handles(run: _Run, dev: int) -> set:
    handles = {accel.default_stream(dev).handle}
    # a dropped Stream lives on while a Buffer made on it does
    handles |= {s.handle for s in list(run.all_streams) if s.device_index == dev and not s.closed}
    from accel import graphs
    side = graphs._side_streams.get(dev)
    if side is not None:
        handles.add(side.handle)
    return handles


def _ranges(alloc) -> int:
    """The address ranges an allocator holds: its expandable segments' and its spare (E11)."""
    return len(alloc._exp_segs) + bool(alloc._exp_spare)


def _mappings(run: _Run) -> tuple:
    """(mappings, physical handles) the allocators hold: their segments' mappings, plus the pieces
    of undone grows waiting in _unreleased (some still mapped, when their unmap was refused)."""
    allocs = [memory.device_allocator(d) for d in (0, 1)]
    maps = sum(len(s.maps) for a in allocs for s in a._exp_segs)
    stale = sum(1 for a in allocs for u in a._unreleased if u[3] is not None)
    return maps + stale, maps + sum(len(a._unreleased) for a in allocs)


def _check_phase(run: _Run, where: str, base: dict) -> None:
    gc.collect()
    _finalize.drain()
    for dev in (0, 1):
        alloc = memory.device_allocator(dev)
        with alloc._lock:
            pass
        graphs = [g for g in list(run.all_graphs) if g._index == dev and g._pool is not None]
        if not run.caching:
            _check_async(alloc)
            assert not alloc._routes and alloc._capture is None, where
            # a pool id is counted once per graph holding it; a graph's token is kept while it
            # or its allocations live
            assert sum(alloc._pools.values()) == len(graphs), (where, "pool counts")
            tokens = {id(g._allocs) for g in graphs if g._allocs is not None}
            waiting = {id(a) for _, a in alloc._deferred}
            for record in alloc._records:
                # a released graph's token stays only for a free of its allocations still to retry
                assert id(record) in tokens or any(id(a) in waiting for a in record.allocs.values()), \
                    (where, "a released graph's token kept", record.launches,
                     [(a.held, a.deferred, a.gen) for a in record.allocs.values()])
            assert len(alloc._dead) <= len(alloc._ptrs)
            continue
        _check_caching(alloc)
        # a private pool is used once per live graph captured into it (not reset) and per live
        # MemPool: nothing else holds one once the threads are done
        mempools = [m for m in list(run.all_mempools) if m.device_index == dev]
        held = {}
        for g in graphs:
            held[g._pool] = held.get(g._pool, 0) + 1
        for m in mempools:
            held[m.id] = held.get(m.id, 0) + 1
        counts = {pid: pool.use_count for pid, pool in alloc._private.items() if pool.use_count}
        assert counts == held, (where, "private pool use counts")
        assert all(pool.id in held for pool in alloc._oom_pools), (where, "use_on_oom pool of a dead MemPool")
        # bounded by live objects: nothing keyed by a stream that is gone, no route or thread
        # left behind by a capture or use_mem_pool that ended
        live = _live_handles(run, dev)
        assert set(alloc._general) <= live, (where, "free lists of dead streams")
        for pool in alloc._private.values():
            assert set(pool.lists) <= live, (where, "private free lists of dead streams")
            assert pool.use_count > 0 or any(alloc._blocks[b].pool.owner is pool for b in alloc._segments), \
                (where, "a released, empty private pool is kept")
        # record_stream names streams of either device
        assert set(alloc._used_on) <= live | _live_handles(run, 1 - dev), (where, "_used_on names dead streams")
        assert not alloc._routes and not alloc._origins and not alloc._origin_ids, (where, "capture routes left")
        assert not alloc._threads, (where, "use_mem_pool routes left")
        # E11: a reservation with nothing mapped is one a live stream's list grows (or one
        # waiting for a destroyed stream's work); the others hold mapped memory (counted as reserved)
        growing = {id(fl.exp) for lists in [alloc._general] for pair in lists.values() for fl in pair}
        growing |= {id(fl.exp) for entry in alloc._pending_events if type(entry[2]) is _caching._Retired
                    for _, pair in entry[2].lists for fl in pair}
        waiting = [u[3] for u in alloc._unreleased if u[3] is not None]    # still mapped: kept (_exp_drop)
        for seg in alloc._exp_segs:
            assert seg.mapped or id(seg) in growing or any(seg.base <= a < seg.base + seg.size for a in waiting), \
                (where, "E11: an empty reservation of a dead stream")
        assert not alloc._seg_frames
        for fl in [fl for lists in [alloc._general] + [p.lists for p in alloc._private.values()]
                   for pair in lists.values() for fl in pair]:
            assert fl.exp is None or fl.exp in alloc._exp_segs
    assert not _guards.pool_captures, where
    from accel import streams
    assert not streams._capture_events, (where, "capture events left")
    if run.caching:
        st = _sim_counts(run.kind)
        segs = sum(len(memory.device_allocator(d)._segments) for d in (0, 1))
        if run.kind == "cuda":
            assert sum(st["live_allocations"].values()) - sum(base["live_allocations"].values()) == segs, where
            maps, handles = _mappings(run)
            assert (st["vmm_mappings"], st["vmm_handles"]) == (maps, handles), where
            assert st["vmm_reservations"] == sum(_ranges(memory.device_allocator(d)) for d in (0, 1)), where
        else:
            assert st["ze_live_allocations"] - base["ze_live_allocations"] == segs, where
            maps, handles = _mappings(run)
            assert (st["ze_vmm_mappings"], st["ze_vmm_handles"]) == (maps, handles), where
            assert st["ze_vmm_reservations"] == sum(_ranges(memory.device_allocator(d)) for d in (0, 1)), where


def _phase(run: _Run, phase: int) -> None:
    handed = run.items
    run.items = []
    shares = [[] for _ in range(THREADS)]
    for i, item in enumerate(handed):
        shares[(i + phase) % THREADS].append(item)
    workers = []
    for t in range(THREADS):
        w = _Worker(run, run.seed * 1000 + phase * 10 + t, shares[t])
        for dev in (0, 1):
            # streams handed over by the last phase go to one thread each
            mine = run.streams[dev][t::THREADS]
            w.streams[dev].extend(mine)
        workers.append(w)
    for dev in (0, 1):
        run.streams[dev] = []
    threads = [threading.Thread(target=w, args=(OPS,), name=f"stress-{phase}-{t}") for t, w in enumerate(workers)]
    for t in threads:
        t.start()
    _check_while_running(run, threads, phase)
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), f"{run.kind} {run.conf} phase {phase}: a thread hangs"
    for w in workers:
        run.items.extend(w.items)
    run.items.extend(run.mailbox)
    run.mailbox = []
    assert not run.errors, f"{run.kind} {run.conf} phase {phase}:\n" + "\n".join(run.errors)
    if run.caching:
        for dev in (0, 1):
            memory.set_per_process_memory_fraction(1.0, dev)


def _check_while_running(run: _Run, threads: list, phase: int) -> None:
    """Check the allocators under their locks while the workers run: every operation must
    leave them consistent when it lets the lock go."""
    checks = 0
    try:
        while any(t.is_alive() for t in threads):
            for dev in (0, 1):
                alloc = memory.device_allocator(dev)
                with alloc._lock:
                    if run.caching:
                        _check_caching(alloc, locked=True)
                    else:
                        _check_async(alloc, locked=True)
                checks += 1
            time.sleep(0.003)
    except BaseException:
        run.errors.append(f"check while running, phase {phase}, after {checks} checks:\n{traceback.format_exc()}")


def _close_everything(run: _Run) -> None:
    w = _Worker(run, 0, run.items)
    for item in run.items:
        w.release(item, drop_ok=False)
    run.items = []
    for dev in (0, 1):
        for s in run.streams[dev]:
            s.close()
        run.streams[dev] = []
    run.shared_pools = {0: [], 1: []}
    gc.collect()
    _finalize.drain()
    for dev in (0, 1):
        accel.synchronize(dev)
    memory.empty_cache()


@pytest.fixture(params=CONFIGS, ids=[f"{k}-{c.split(':')[0]}{'' if 'Async' in c else ':' + c.split(':')[1]}"
                                     for k, c in CONFIGS])
def config(request, monkeypatch):
    kind, conf = request.param
    if "expandable_segments:True" in conf and not _vmm.supported():
        pytest.skip("this host cannot play virtual memory (mmap)")
    # queued work takes a while, so frees meet events not yet complete
    use_sim(monkeypatch, kind, ACCEL_ALLOC_CONF=conf, ACCEL_SIM_MEMORY=MEMORY, ACCEL_SIM_DELAY_US=DELAY_US)
    yield kind, conf
    sim.clear_faults()


@pytest.mark.filterwarnings("ignore:The (CUDA|XPU) Graph is empty")     # a capture an OOM cut short
def test_threads_on_two_devices_keep_invariants_and_return_everything(config):
    kind, conf = config
    seed = CONFIGS.index(config) + 1 + 10 * SEED
    run = _Run(kind, conf, seed)
    for dev in (0, 1):
        memory.device_allocator(dev)
        accel.default_stream(dev)
    gc.collect()
    base = _sim_counts(kind)
    for phase in range(PHASES):
        _phase(run, phase)
        _check_phase(run, f"{kind} {conf} after phase {phase}", base)
    _close_everything(run)
    _check_phase(run, f"{kind} {conf} at the end", base)
    for dev in (0, 1):
        stats = memory.memory_stats(dev)
        left = memory.device_allocator(dev)
        left = (left._ptrs.items() if not run.caching else
                [(b.ptr, b.size) for b in left._blocks.values() if b.state != _caching._FREE])
        assert stats["allocation.all.current"] == 0, (dev, [(hex(p), getattr(a, "__slots__", None) and {
            k: getattr(a, k) for k in a.__slots__} if not isinstance(a, int) else a) for p, a in left])
        assert stats["reserved_bytes.all.current"] == 0, dev
        assert stats["requested_bytes.all.current"] == 0, dev
        if run.caching:
            alloc = memory.device_allocator(dev)
            assert not alloc._pending and not alloc._pending_events and not alloc._deferred
            assert not alloc._exp_segs and not alloc._segments and not alloc._blocks and not alloc._whole
            assert not any(alloc._event_cache.values())
            assert not alloc._private, "private pools outlive their graphs and MemPools"
            assert not alloc._oom_pools
        else:
            alloc = memory.device_allocator(dev)
            assert not alloc._records and not alloc._dead and not alloc._pools and not alloc._deferred, [
                (r.released, r.launches, [(hex(p), a.held, a.deferred, a.gen) for p, a in r.allocs.items()])
                for r in alloc._records]
            assert not alloc._doomed and not alloc._ptrs
    print(f"{kind} {conf}: {run.streams_made} streams, {run.graphs_made} graphs, {run.ooms} OOMs, "
          f"stats dev0 {dict((k, v) for k, v in memory.memory_stats(0).items() if k.startswith('num_'))}")
    after = _sim_counts(kind)
    if kind == "xpu":
        # the backend keeps Level Zero event slots pooled for reuse (64 a pool, made as the most
        # events in use at once needs): bounded, but not back to none
        assert after.pop("ze_live_event_pools") <= 2 and after.pop("ze_live_events") <= 128
        base = {k: v for k, v in base.items() if k not in ("ze_live_event_pools", "ze_live_events")}
    assert after == base, (run.streams_made, run.graphs_made)


# ------------------------------------------------------------------------------------ shrunk failures
def _fake(conf: str = "expandable_segments:False"):
    from test_memory_allocator import make
    return make(conf)


def test_released_pool_block_of_a_destroyed_stream_waits_for_its_work():
    """A graph's pool block allocated on a capture stream that is destroyed (its work not yet
    done), then the graph is reset and the block freed: its whole free segment must wait, with
    the destroyed stream's other lists, for the event covering that stream's work, and then join
    the default stream's general lists.  It went straight into general free lists keyed by the
    dead handle: state growing with every capture stream ever made, and a new stream given the
    recycled handle could reuse the memory while the old stream's work still ran on it."""
    from test_memory_allocator import check_invariants
    alloc, be = _fake()
    alloc.begin_allocate_to_pool((1, 0), 101)
    ptr = alloc.malloc(MiB, 101)
    alloc.end_allocate_to_pool((1, 0))
    alloc.forget_stream(101)            # the capture stream is destroyed; its work is still queued
    alloc.release_pool((1, 0))          # the graph is reset
    alloc.free(ptr)
    check_invariants(alloc, be)
    assert 101 not in alloc._general, "free lists keyed by a destroyed stream"
    again = alloc.malloc(MiB, 101)      # a new stream given the recycled handle
    assert again != ptr, "reused before the destroyed stream's work completed"
    alloc.free(again)
    be.complete_events()
    small = alloc.malloc(512, 0)        # processes the event: the segment joins the default stream's
    check_invariants(alloc, be)
    assert 101 in alloc._general        # (the new stream's own lists)
    assert not alloc._private
    alloc.free(small)
    alloc.empty_cache()
    assert be.live == {}


@pytest.fixture(params=["cuda", "xpu"])
def vmm_be(request, monkeypatch):
    if not _vmm.supported():
        pytest.skip("this host cannot play virtual memory (mmap)")
    use_sim(monkeypatch, request.param)
    yield _lazy.lazy_init()
    sim.clear_faults()


def _capture_after_first_map(monkeypatch, be, other):
    """Make be.vmm_map begin a relaxed capture of device 1's stream ``other`` right after its
    first map, as another thread could between two pieces of one grow; returns the list of the
    maps made and the real vmm_map (to put back)."""
    real_map = be.vmm_map
    mapped = []

    def vmm_map(*args):
        real_map(*args)
        mapped.append(args)
        if len(mapped) == 1:                # "another thread" begins a capture now
            be.set_device(1)
            be.capture_begin(other, "relaxed")
            be.set_device(0)

    monkeypatch.setattr(be, "vmm_map", vmm_map)
    return mapped, real_map


def test_grow_cut_short_by_another_threads_capture_leaves_no_mapping_in_a_hole(vmm_be, monkeypatch):
    """Another thread begins a capture between two pieces of one grow: the next piece's map is
    refused (E6), the grow is undone and the request takes a classic segment; the piece already
    mapped cannot be unmapped until the capture ends, so it waits, still mapped, in _unreleased.
    The next grow placed a new mapping over it (the segment saw a hole there) and failed
    with the driver's invalid-value error (cuMemMap over a live mapping)."""
    from accel.memory import _config
    from test_memory_expandable import check
    be = vmm_be
    if be.name == "xpu":
        import test_memory_expandable
        from test_alloc_adversarial import _ZeState
        monkeypatch.setattr(test_memory_expandable, "sim", _ZeState)
    alloc = _caching.DeviceCachingAllocator(be, 1, _config.parse("expandable_segments:True"))
    be.set_device(1)
    other = be.stream_create()
    be.set_device(0)
    big = alloc.malloc(100 * MiB)           # a high-water mark: later grows unmap nothing first
    alloc.free(big)
    alloc.empty_cache()
    mapped, real_map = _capture_after_first_map(monkeypatch, be, other)
    p = alloc.malloc(12 * MiB)              # two pieces; the second is refused
    monkeypatch.setattr(be, "vmm_map", real_map)
    assert len(mapped) == 1 and list(alloc._segments) == [p]
    be.set_device(1)
    be.graph_destroy(be.capture_end(other))
    be.set_device(0)
    alloc.free(p)
    q = alloc.malloc(20 * MiB)              # grows the expandable segment where the pieces were
    check(alloc)
    alloc.free(q)
    alloc.empty_cache()
    check(alloc)
    assert alloc.stats()["reserved_bytes.all.current"] == 0
    be.set_device(1)
    be.stream_destroy(other)
    be.set_device(0)


def _sizes_of(alloc) -> dict:
    """How much state the allocator keeps, container by container."""
    if isinstance(alloc, AsyncPoolAllocator):
        names = ("_ptrs", "_deferred", "_pools", "_routes", "_records", "_dead", "_doomed")
        return {n: len(getattr(alloc, n)) for n in names}
    names = ("_blocks", "_segments", "_whole", "_general", "_routes", "_origins", "_origin_ids", "_private",
             "_threads", "_oom_pools", "_pending", "_pending_events", "_deferred", "_used_on", "_seg_frames",
             "_exp_segs", "_unreleased")
    out = {n: len(getattr(alloc, n)) for n in names}
    out["events cached"] = sum(len(v) for v in alloc._event_cache.values())
    out["private lists"] = sum(len(p.lists) for p in alloc._private.values())
    return out


@pytest.mark.parametrize("kind,conf", CONFIGS, ids=[f"{k}-{c}" for k, c in CONFIGS])
def test_state_does_not_grow_with_streams_and_graphs_ever_made(monkeypatch, kind, conf):
    """Streams, graphs (own pools, a shared pool, a MemPool), events and record_stream uses made
    and dropped over and over, on both devices: after the first rounds the allocators keep as
    much state, and the simulator as many objects, as after many more (nothing is keyed by a
    stream, capture or pool that is gone)."""
    if "expandable_segments:True" in conf and not _vmm.supported():
        pytest.skip("this host cannot play virtual memory (mmap)")
    use_sim(monkeypatch, kind, ACCEL_ALLOC_CONF=conf, ACCEL_SIM_MEMORY="1G", ACCEL_SIM_DELAY_US=DELAY_US)
    caching = "cudaMallocAsync" not in conf
    shared = {dev: accel.graphs.graph_pool_handle() for dev in (0, 1)}
    keep = {dev: accel.Buffer(3 * MiB, device=dev) for dev in (0, 1)}

    def round_(i: int) -> None:
        for dev in (0, 1):
            s, t = accel.Stream(device=dev), accel.Stream(device=1 - dev)
            a = accel.Buffer(MiB + 512 * i % 7, device=dev, stream=s)
            b = accel.Buffer(5 * MiB, device=dev, stream=s)
            a.fill_(1, stream=s)
            a.record_stream(t)
            memory.device_allocator(dev).record_stream(b.ptr, t.handle, 1 - dev)
            ev = accel.Event()
            ev.record(s)
            t.wait_event(ev)
            pool = (None, shared[dev], "mempool")[i % 3]
            mp = None
            if pool == "mempool":
                if not caching:
                    pool = None
                else:
                    with accel.device_index(dev):
                        mp = accel.MemPool()
                    pool = mp.id
                    with memory.use_mem_pool(mp, device=dev):
                        c = accel.Buffer(2 * MiB, device=dev, stream=s)
                    c.close()
            g = accel.Graph(pool=pool, capture_error_mode="thread_local")
            with s:
                g.capture_begin()
                out = accel.Buffer(MiB, device=dev, stream=s)
                tmp = accel.Buffer(4 * MiB, device=dev, stream=s)
                tmp.fill_(2, stream=s)
                out.fill_(3, stream=s)
                tmp.close()
                g.capture_end()
                g.replay()
            t.close()                       # used by a and b, destroyed before they are freed
            a.close()
            s.close()                       # their allocation stream, destroyed after a's free
            if i % 2:
                g.reset()                   # before its output is freed (s's work may still run)
            b.close()
            out.close()
            del g, mp, ev                   # the other graphs go with their finalizers

    def measure():
        gc.collect()
        _finalize.drain()
        for dev in (0, 1):
            accel.synchronize(dev)
        memory.empty_cache()        # cached segments come and go with the high-water mark; drop them
        return ({dev: _sizes_of(memory.device_allocator(dev)) for dev in (0, 1)}, _sim_counts(kind))

    for i in range(6):
        round_(i)
    first = measure()
    # default: 6 more rounds (each pool kind and reset/no-reset twice more); THOROUGH: 18
    for i in range(6, 6 + (18 if THOROUGH else 6) * SCALE):
        round_(i)
    last = measure()
    assert last == first
    for dev in (0, 1):
        keep[dev].close()


def test_reservation_is_not_freed_under_a_piece_still_mapped(vmm_be, monkeypatch):
    """As in test_grow_cut_short_by_another_threads_capture_leaves_no_mapping_in_a_hole, but the
    first grow of a stream's segment is cut short by another thread's capture:
    nothing of the request is in the segment, but the piece mapped first is still mapped (its unmap
    was refused), waiting in _unreleased.  When the stream is destroyed its empty segment is an
    orphan (the default stream grows its own), and freeing that reservation then unmapped the
    waiting piece behind the allocator's back (Level Zero's zeVirtualMemFree unmaps what is mapped)
    or failed; the next unmap of the piece then hit whatever the range held by then."""
    from accel.memory import _config
    from test_memory_expandable import check
    be = vmm_be
    if be.name == "xpu":
        import test_memory_expandable
        from test_alloc_adversarial import _ZeState
        monkeypatch.setattr(test_memory_expandable, "sim", _ZeState)
    alloc = _caching.DeviceCachingAllocator(be, 1, _config.parse("expandable_segments:True"))
    keep = alloc.malloc(3 * MiB)            # the default stream's segment
    be.set_device(1)
    s, other = be.stream_create(), be.stream_create()
    be.set_device(0)
    mapped, real_map = _capture_after_first_map(monkeypatch, be, other)
    p = alloc.malloc(12 * MiB, s)           # s's first grow: two pieces, the second refused
    monkeypatch.setattr(be, "vmm_map", real_map)
    assert len(mapped) == 1 and list(alloc._segments) == [p]
    be.set_device(1)
    be.graph_destroy(be.capture_end(other))
    be.set_device(0)
    alloc.free(p)
    alloc.forget_stream(s, 1)               # s is destroyed: its empty segment is an orphan
    be.set_device(1)
    be.stream_destroy(s)
    be.set_device(0)
    alloc.free(alloc.malloc(512))           # the event covering s completed: the segment rehomed
    check(alloc)
    q = alloc.malloc(40 * MiB)              # the next grow unmaps the waiting piece first
    check(alloc)
    for ptr in (q, keep):
        alloc.free(ptr)
    alloc.empty_cache()
    check(alloc)
    assert alloc.stats()["reserved_bytes.all.current"] == 0
    assert not alloc._exp_segs and not alloc._unreleased
    be.set_device(1)
    be.stream_destroy(other)
    be.set_device(0)


def test_async_output_freed_during_another_capture_is_freed_again_at_reset(monkeypatch):
    """backend:cudaMallocAsync: a graph's output freed while another capture is underway (another
    thread's, on the other device) is deferred, and freed once the capture ends.  A later replay
    allocates it again, with no owner, and the graph's reset must free that copy.  The flushed
    free left the allocation marked deferred, so reset skipped it: the copy stayed allocated
    in graph memory and the graph's token stayed in the allocator for good."""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="backend:cudaMallocAsync")
    s, other = accel.Stream(device=1), accel.Stream(device=0)
    g = accel.Graph()
    with accel.graph(g, stream=s):
        out = accel.Buffer(MiB, device=1, stream=s)
        out.fill_(3, s)
    g.replay()
    h = accel.Graph(capture_error_mode="relaxed")
    with other, pytest.warns(UserWarning, match="Graph is empty"):
        h.capture_begin()                   # "another thread's" capture, on device 0
        out.close()                         # deferred until no capture is underway
        h.capture_end()
    accel.Buffer(512, device=1).close()     # device 1's allocator queues the deferred free now
    g.replay()                              # allocated again, with no owner
    g.reset()                               # must free that copy
    h.reset()
    alloc = memory.device_allocator(1)
    assert not alloc._records, "the graph's token outlives its reset"
    accel.synchronize(1)
    memory.empty_cache()
    be = _lazy.lazy_init()
    with accel.streams.on_device(be, 1):
        assert be.graph_mem_get(1, "reserved_current") == 0, "the graph's output was never freed"
    s.close()
    other.close()


def test_async_stale_graph_output_forgotten_by_a_deferred_free_leaves_the_new_owner_its_free(monkeypatch):
    """backend:cudaMallocAsync: a graph's output (never replayed) is freed during another capture
    (deferred), the graph is reset, and the driver hands the output's address to a new allocation
    before the deferred free is queued: the stale record waits in _dead for whichever owner frees
    first.  The deferred free, queued when the capture ended, forgot it but left it in _dead, so
    the new owner's free took that forgotten record instead of its own: the new allocation stayed
    allocated (and counted) for good.  (The simulator places the new allocation elsewhere; the
    driver's reuse of the address is played by handing the allocator that address for it.)"""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="backend:cudaMallocAsync")
    s, other = accel.Stream(device=1), accel.Stream(device=0)
    g, h = accel.Graph(), accel.Graph(capture_error_mode="relaxed")
    with accel.graph(g, stream=s):
        out = accel.Buffer(MiB, device=1, stream=s)
        out.fill_(3, s)
    alloc = memory.device_allocator(1)
    be = _lazy.lazy_init()
    address = out.ptr
    real_alloc, real_free = be.mem_alloc_async, be.mem_free_async
    alias = {}

    def mem_alloc_async(nbytes, stream):        # the driver reuses the address
        alias[address] = real_alloc(nbytes, stream)
        return address

    with other, pytest.warns(UserWarning, match="Graph is empty"):
        h.capture_begin()                       # another thread's capture, on device 0
        out.close()                             # deferred until no capture is underway
        g.reset()                               # no launch allocated the output: its address is free
        monkeypatch.setattr(be, "mem_alloc_async", mem_alloc_async)
        monkeypatch.setattr(be, "mem_free_async", lambda ptr, stream: real_free(alias.get(ptr, ptr), stream))
        b = alloc.malloc(MiB, s.handle)
        monkeypatch.setattr(be, "mem_alloc_async", real_alloc)
        assert b == address and alloc._dead
        h.capture_end()
    accel.Buffer(512, device=1).close()         # device 1's allocator queues the deferred free now
    alloc.free(b)
    h.reset()
    assert memory.memory_stats(1)["allocation.all.current"] == 0, "the new allocation was never freed"
    assert not alloc._dead and not alloc._ptrs
    accel.synchronize(1)
    memory.empty_cache()
    s.close()
    other.close()
