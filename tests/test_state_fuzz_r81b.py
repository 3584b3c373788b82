"""r81b: a seeded random-program fuzz of accel's memory + stream + graph API on two simulated
devices (most work on device 1 while device 0 is current), checking invariants after every step.

What the earlier state fuzzers do not cover and this one does (tests/test_state_fuzz_r70c.py: bad
calls; r71m: data-modelled walk without pools, snapshots or DLPack exports; r72c: the memory
figures, one fresh private pool per capture): graphs sharing a private pool (``g.pool()`` of an
earlier graph, a ``MemPool``'s id, ``Graph(pool=...)`` and ``accel.graph(g, pool=...)``),
``capture_begin/capture_end`` on a ``with stream`` as well as ``accel.graph``, capture on a
``Stream.from_handle`` wrapper of accel's own stream; replays on the capture stream, on an
output's allocation stream, on other streams of the device (a wrapper too) and from the other
device; graphs reset and graphs dropped with live outputs; allocations on wrapper streams whose
wrappers are then closed; ``record_stream`` then an immediate close or drop; Buffers closed or
dropped (collected); events across devices and ``wait_stream``; ``empty_cache``;
``set_per_process_memory_fraction`` with an allocation past the cap (OutOfMemoryError; allocated
unchanged, ``num_ooms`` + 1; lifting the cap, the same request succeeds); ``reset_peak_memory_stats``;
``memory_snapshot()``; DLPack exports with ``copy=True`` (a device copy) and with
``dl_device=(kDLCPU, 0)`` (a host copy), each dropped unconsumed or consumed (device copy:
``accel.from_dlpack``; host copy: numpy; ``accel.from_dlpack`` of the host capsule refused).

Every program runs under CUDA's three allocator configurations (default expandable segments,
``expandable_segments:False``, ``backend:cudaMallocAsync``, set through
``PYTORCH_CUDA_ALLOC_CONF``) and on XPU (Level Zero).

Invariants after each step, per device: ``memory_allocated <= memory_reserved``; memory_stats
agrees with the scalar queries; no negative counter; every peak >= its current; native allocator:
the snapshot's segments' total_size sums to reserved_bytes, its active_allocated blocks' sizes to
allocated_bytes, active_allocated + active_pending_free to active_bytes, their count to
``allocation.all.current`` (cudaMallocAsync: no segments); no device fault; one random Buffer of
known contents reads back as the numpy model says.  At the end (every object dropped,
gc.collect, synchronize, empty_cache): allocated 0 and reserved 0 on both devices, the
simulator's live streams/events/graphs/execs/captures/allocations as at the start, no
unraisable exception, every Buffer's data right.

A failing program is shrunk (conftest.shrink_plan) and its minimal step list printed.
ACCEL_R81B_PROGRAMS / ACCEL_R81B_STEPS set the size (default 25 programs per configuration x 80
steps; THOROUGH 100 x 150); ACCEL_R81B_DELAY_US=N runs the simulated streams N us late per operation,
which makes a missed ordering show (the bug below was found so; the default run has no delay);
(The fuzz makes that bug's calls since its fix.)

Bug found (a strict xfail first, fixed in session 39; the test at the end): under ``backend:cudaMallocAsync`` a graph output replayed
on another stream than its capture stream is freed on that replay stream with no wait for work
queued on the Buffer's own allocation stream (``_async.AsyncPoolAllocator._replayed`` /
``_free_now``): close() raises cudaErrorInvalidValue from the simulator, a dropped Buffer's
finalizer leaks the memory with an unraisable exception.

Noted, not bugs: ``Stream.from_handle(h)`` of a default stream (NULL handle) without a device
names the current device's (cudaStreamGetDevice's default stream semantics); a refused
allocation may first process the events of blocks freed with stream uses (requested/active
bytes drop, as torch's malloc) and collect dropped Buffers; under cudaMallocAsync
``allocated_bytes`` is the pool's used memory (cudaMemPoolAttrUsedMemCurrent, as torch), which
drops whenever a queued cudaFreeAsync runs.
"""

import collections
import gc
import os
import random
import re
import sys
import time

import numpy as np
import pytest

import accel
import accel.memory as M
from accel import _finalize, _lazy, sim
from conftest import THOROUGH, shrink_plan, use_sim

pytestmark = pytest.mark.usefixtures("frozen_heap")

KiB, MiB = 1 << 10, 1 << 20
PROGRAMS = int(os.environ.get("ACCEL_R81B_PROGRAMS", "0") or 0) or (100 if THOROUGH else 25)
STEPS = int(os.environ.get("ACCEL_R81B_STEPS", "0") or 0) or (150 if THOROUGH else 80)
#: ACCEL_R81B_DELAY_US: each simulated stream operation that late (a missed ordering shows as wrong bytes)
DELAY_US = os.environ.get("ACCEL_R81B_DELAY_US", "")
CONFIGS = {
    "cuda-expandable": ("cuda", {}),
    "cuda-classic": ("cuda", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}),
    "cuda-async": ("cuda", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}),
    "xpu": ("xpu", {}),
}
SIZES = [0, 512, 1000, 4 * KiB, 100 * KiB, 1 * MiB + 1, 3 * MiB]
kDLCPU = 1


class Violation(AssertionError):
    pass


def settle():
    gc.collect()
    _finalize.drain()
    for d in range(accel.device_count()):
        accel.synchronize(d)
    M.empty_cache()
    M.empty_host_cache()
    _finalize.drain()


def live_handles(kind) -> dict:
    st = dict(vars(sim.state()))
    if kind == "cuda":
        return {k: st[k] for k in ("host_allocations", "streams", "events", "graphs", "graph_execs", "captures")} \
            | {"allocations": sum(st["live_allocations"].values())}
    return {k: v for k, v in st.items() if k.startswith("ze_live_") and "event" not in k}


def faults():
    st = vars(sim.state())
    return st.get("errors") or st.get("ze_errors") or []


class Buf:
    def __init__(self, obj, dev, data, where):
        self.obj, self.dev, self.data, self.where = obj, dev, data, where
        self.last = []          # ordering tokens (Stream/Event) of work not yet waited for
        self.closed = False
        self.unbacked = False   # cudaMallocAsync graph output before its first replay
        self.graph_pinned = 0   # graphs that write it (replayed only while it lives)

    @property
    def n(self):
        return self.obj.nbytes if self.obj is not None else 0


class Host:
    """A numpy consumer of a host-copy capsule (numpy.from_dlpack takes objects, not capsules)."""

    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, **kw):
        return self.capsule

    def __dlpack_device__(self):
        return (kDLCPU, 0)


class Program:
    OPS = [("alloc", 6), ("fill", 4), ("copy", 4), ("close", 4), ("record_stream", 2), ("new_stream", 2),
           ("close_stream", 1), ("wrap", 2), ("event", 3), ("wait_stream", 1), ("capture", 3), ("replay", 5),
           ("reset_graph", 1), ("drop_graph", 1), ("pool_alloc", 2), ("empty_cache", 1), ("oom", 1),
           ("reset_peaks", 1), ("dlpack", 3), ("read", 2), ("device", 1), ("collect", 1)]

    def __init__(self, kind, conf):
        self.kind, self.conf = kind, conf
        self.is_async = conf == "cuda-async"
        self.n = accel.device_count()
        assert self.n == 2
        self.log = []
        self.count = collections.Counter()
        # every first-use path (accel.graph's side streams too) before the baselines
        for d in range(2):
            s = accel.Stream(d)
            with accel.Buffer(4 * KiB, d) as warm:
                warm.fill_(1)
                warm.to_numpy()
                g = accel.Graph()
                with accel.graph(g, stream=s):
                    warm.fill_(2)
                g.replay()
                g.reset()
            with accel.device_index(d):
                g = accel.Graph()
                with accel.graph(g):
                    pass
                g.reset()
            s.close()
            del g
        accel.set_device_index(0)
        settle()
        self.base_handles = live_handles(kind)
        self.bufs, self.events, self.graphs, self.pools = [], [], [], []
        self.streams = {d: [] for d in range(2)}
        self.wrappers = {d: [] for d in range(2)}
        self.base = {}          # id(wrapper) -> the Stream it wraps
        self.cur = 0

    # -- helpers -----------------------------------------------------------------------------
    def note(self, text):
        self.log.append(text)

    def live(self, d=None, pred=lambda b: True):
        return [b for b in self.bufs if not b.closed and (d is None or b.dev == d) and pred(b)]

    def usable(self, d=None):
        return self.live(d, lambda b: not b.unbacked)

    def any_stream(self, rng, d, wrappers=True):
        choices = [accel.default_stream(d)] + [s for s in self.streams[d] if not s.closed]
        if wrappers:
            choices += [w for w in self.wrappers[d] if not w.closed]
        return rng.choice(choices)

    def side_stream(self, rng, d):
        side = [s for s in self.streams[d] if not s.closed]
        if not side:
            side = [accel.Stream(d)]
            self.streams[d] += side
        s = rng.choice(side)
        ws = [w for w in self.wrappers[d] if not w.closed and w == s]
        return rng.choice(ws) if ws and rng.random() < 0.5 else s

    def order(self, rng, stream, buf):
        """Order ``stream`` after all work on ``buf`` not yet waited for, as a user must."""
        for tok in buf.last:
            if isinstance(tok, accel.Stream) and tok == stream:
                continue
            if isinstance(tok, accel.Event):
                stream.wait_event(tok)
                continue
            how = rng.randrange(3)
            if how == 0:
                stream.wait_stream(tok)
            elif how == 1:
                ev = accel.Event()
                ev.record(tok)
                ev.wait(stream)
                self.events.append(ev)
            else:
                ev = tok.record_event()
                stream.wait_event(ev)
                self.events.append(ev)
        buf.last = [stream]

    def read(self, b, rng):
        s = accel.current_stream(b.dev)
        self.order(rng, s, b)
        got = b.obj.to_numpy(stream=s)
        if b.data is not None:
            bad = np.flatnonzero(got != b.data)
            if bad.size:
                raise Violation(f"Buffer({b.n}) on {b.dev} ({b.where}): {bad.size} bytes differ, first at {bad[0]}: "
                                f"got {got[bad[0]]}, want {b.data[bad[0]]}")

    def release(self, rng, b, how):
        """Close (or drop) ``b`` the way a correct program does: its allocation stream ordered
        after its other uses, or record_stream on them."""
        alloc = b.obj.stream
        for tok in b.last:
            if isinstance(tok, accel.Stream) and tok != alloc and not tok.closed and rng.random() < 0.5:
                b.obj.record_stream(tok)
                self.count["record_stream before close"] += 1
            elif not (isinstance(tok, accel.Stream) and tok == alloc):
                if isinstance(tok, accel.Event):
                    alloc.wait_event(tok)
                else:
                    alloc.wait_stream(tok)
        if how == "close":
            b.obj.close()
        elif how == "cycle":
            cyc = [b.obj]
            cyc.append(cyc)         # freed by the next collection
        b.obj = None
        b.closed = True
        b.data = None
        b.last = []

    # -- operations ---------------------------------------------------------------------------
    def op_alloc(self, rng):
        d = 1 if rng.random() < 0.7 else 0
        n = rng.choice(SIZES)
        how = rng.randrange(3)
        s = self.any_stream(rng, d)
        if how == 0:
            b = accel.Buffer(n, d, stream=s)
        elif how == 1:
            b = accel.Buffer(n, d)
            s = b.stream
        else:
            with accel.device_index(d), s:
                b = accel.Buffer(n)
        if b.device_index != d or not b.stream == s:
            raise Violation(f"Buffer({n}, {d}) on {s}: device {b.device_index}, stream {b.stream}")
        v = rng.randrange(256)
        b.fill_(v, stream=s)
        buf = Buf(b, d, np.full(n, v, np.uint8), "alloc")
        buf.last = [s]
        self.bufs.append(buf)
        self.note(f"alloc {n} on {d} stream {s.stream_id} fill {v}")

    def op_fill(self, rng):
        bs = self.usable()
        if not bs:
            return
        b = rng.choice(bs)
        s = self.any_stream(rng, b.dev)
        self.order(rng, s, b)
        v = rng.randrange(256)
        if rng.random() < 0.3:
            with s:
                b.obj.fill_(v)
        else:
            b.obj.fill_(v, stream=s)
        b.data = np.full(b.n, v, np.uint8)
        self.note(f"fill {b.n}@{b.dev} {v}")

    def op_copy(self, rng):
        bs = self.usable()
        if not bs:
            return
        src = rng.choice(bs)
        dsts = [b for b in self.usable() if b.n == src.n and b is not src]
        if not dsts:
            return
        dst = rng.choice(dsts)
        s = self.any_stream(rng, dst.dev)
        self.order(rng, s, dst)
        self.order(rng, s, src)
        dst.obj.copy_from(src.obj, stream=s)
        dst.data = None if src.data is None else src.data.copy()
        self.count["copy across devices" if src.dev != dst.dev else "copy"] += 1
        self.note(f"copy {src.n}@{src.dev} -> @{dst.dev}")

    def op_close(self, rng):
        bs = self.live(pred=lambda b: not b.graph_pinned or rng.random() < 0.3)
        if not bs:
            return
        b = rng.choice(bs)
        how = rng.choice(["close", "drop", "cycle"])
        self.release(rng, b, how)
        self.count[f"buffer {how}"] += 1
        self.note(f"{how} buffer@{b.dev} ({b.where})")

    def op_record_stream(self, rng):
        bs = self.usable()
        if not bs:
            return
        b = rng.choice(bs)
        s = self.any_stream(rng, b.dev)
        self.order(rng, s, b)
        v = rng.randrange(256)
        b.obj.fill_(v, stream=s)
        b.obj.record_stream(s)
        b.data = np.full(b.n, v, np.uint8)
        self.count["record_stream"] += 1
        if rng.random() < 0.5 and not b.graph_pinned:
            # freed at once: the memory waits for s (the fill) before another Buffer gets it
            b.last = [t for t in b.last if not (isinstance(t, accel.Stream) and t == s)]
            how = rng.choice(["close", "drop"])
            self.release(rng, b, how)
            self.count["record_stream then free"] += 1
        self.note(f"record_stream {b.dev}")

    def op_new_stream(self, rng):
        d = rng.randrange(2)
        if sum(not s.closed for s in self.streams[d]) >= 3:
            return
        self.streams[d].append(accel.Stream(d, priority=rng.choice([0, -1])))
        self.note(f"stream on {d}")

    def op_close_stream(self, rng):
        d = rng.randrange(2)
        allocating = [b.obj.stream for b in self.live(d)] + [s for gr in self.graphs for s in gr["pinned_streams"]]
        cands = [s for s in self.streams[d] if not s.closed and not any(s == a for a in allocating)]
        if not cands:
            return
        s = rng.choice(cands)
        ev = None
        for b in self.live():
            if any(isinstance(t, accel.Stream) and t == s for t in b.last):
                if ev is None:
                    ev = s.record_event()
                    self.events.append(ev)
                b.last = [ev if (isinstance(t, accel.Stream) and t == s) else t for t in b.last]
        for w in self.wrappers[d]:
            if w == s and not w.closed:
                w.close()
        s.close()
        self.count["close stream"] += 1
        self.note(f"close stream on {d}")

    def op_wrap(self, rng):
        d = rng.randrange(2)
        # (not one a live Buffer was allocated on: Buffer.stream stays that wrapper object)
        live = [w for w in self.wrappers[d] if not w.closed
                and not any(b.obj.stream is w for b in self.live()) and not any(w is gr["stream"] for gr in self.graphs)]
        if live and rng.random() < 0.4:
            w = rng.choice(live)
            base = self.base[id(w)]
            for b in self.live():
                b.last = [base if t is w else t for t in b.last]
            w.close()       # forgets the wrapper only: the stream lives on
            self.count["close wrapper"] += 1
            self.note(f"close wrapper on {d}")
            return
        s = self.any_stream(rng, d, wrappers=False)
        # (device None: the stream's own device; the default stream's handle names the current
        # device's, as cudaStreamGetDevice of NULL does, so that one is wrapped with its device)
        default = s == accel.default_stream(d)
        w = accel.Stream.from_handle(s.handle, d if default or rng.random() < 0.5 else None)
        if w != s or hash(w) != hash(s) or w.device_index != d:
            raise Violation(f"Stream.from_handle({s.handle:#x}) is not the stream: {w} vs {s}")
        self.wrappers[d].append(w)
        self.base[id(w)] = s
        self.count["wrap"] += 1
        self.note(f"wrap stream on {d}")

    def op_event(self, rng):
        a = rng.randrange(2)
        b_dev = rng.randrange(2)
        s_a, s_b = self.any_stream(rng, a), self.any_stream(rng, b_dev)
        ev = accel.Event(enable_timing=rng.random() < 0.3)
        ev.record(s_a)
        if rng.random() < 0.5:
            s_b.wait_event(ev)
        else:
            ev.wait(s_b)
        if rng.random() < 0.3:
            ev.synchronize()
        self.events.append(ev)
        for b in self.live():
            if len(b.last) == 1 and isinstance(b.last[0], accel.Stream) and b.last[0] == s_a:
                b.last = [s_b]
        self.count["event across devices" if a != b_dev else "event"] += 1
        self.note(f"event {a}->{b_dev}")

    def op_wait_stream(self, rng):
        a, o = rng.randrange(2), rng.randrange(2)
        s_a, s_o = self.any_stream(rng, a), self.any_stream(rng, o)
        s_o.wait_stream(s_a)
        for b in self.live():
            if len(b.last) == 1 and isinstance(b.last[0], accel.Stream) and b.last[0] == s_a:
                b.last = [s_o]
        self.note(f"wait_stream {a}->{o}")

    def op_capture(self, rng):
        d = 1 if rng.random() < 0.7 else 0
        s = self.side_stream(rng, d)
        targets = [b for b in self.usable(d) if b.n] if rng.random() < 0.8 else []
        targets = rng.sample(targets, min(len(targets), rng.randrange(0, 4)))
        for b in targets:
            self.order(rng, s, b)
        # the pool: fresh, shared with an earlier graph of the device, or a MemPool's
        shares = [gr for gr in self.graphs if gr["dev"] == d and gr["shareable"]]
        pick = rng.random()
        pool, pool_kind, mp = None, "fresh", None
        if shares and pick < 0.4:
            pool, pool_kind = rng.choice(shares)["g"].pool(), "shared"
        elif pick < 0.6 and not self.is_async:
            with accel.device_index(d):
                mp = M.MemPool()
            pool, pool_kind = mp.id, "mempool"
        ctor_pool = pool is not None and rng.random() < 0.5
        g = accel.Graph(pool=pool) if ctor_pool else accel.Graph()
        free_inside = pool_kind == "fresh" and rng.random() < 0.5
        ops, made = [], []
        # (capture_begin takes no pool: a manual capture into a given pool has it from Graph(pool=))
        manual = rng.random() < 0.4 and (pool is None or ctor_pool)
        if manual:
            cm = s
            cm.__enter__()
            g.capture_begin()
        else:
            cm = accel.graph(g, pool=None if ctor_pool else pool, stream=s)
            cm.__enter__()
        try:
            for b in targets:
                srcs = [x for x in targets if x is not b and x.n == b.n]
                if srcs and rng.random() < 0.4:
                    src = rng.choice(srcs)
                    b.obj.copy_from(src.obj)
                    ops.append(("copy", b, src))
                else:
                    v = rng.randrange(256)
                    b.obj.fill_(v)
                    ops.append(("fill", b, v))
            for nbytes in rng.sample([512, 4 * KiB, 100 * KiB, 1 * MiB + 1], rng.randrange(0, 3)):
                nb = Buf(accel.Buffer(nbytes, d), d, None, "graph output")
                nb.unbacked = self.is_async
                v = rng.randrange(256)
                nb.obj.fill_(v)
                ops.append(("fill", nb, v))
                made.append(nb)
            if free_inside:
                t = accel.Buffer(rng.choice([512, 64 * KiB, 2 * MiB]), d)
                t.fill_(rng.randrange(256))
                t.close()
                self.count["free in capture"] += 1
        finally:
            if manual:
                g.capture_end()
                cm.__exit__(None, None, None)
            else:
                cm.__exit__(None, None, None)
        for nb in made:
            nb.last = [s]
            self.bufs.append(nb)
        touched = list({id(b): b for b in targets + made}.values())
        for b in touched:
            b.graph_pinned += 1
            b.data = None       # unknown until a replay (the capture ran nothing)
        self.graphs.append({"g": g, "dev": d, "ops": ops, "bufs": touched, "stream": s, "made": made,
                            "shareable": not free_inside, "replayed": False, "mp": mp, "pool_id": g.pool(),
                            "pinned_streams": [s]})
        self.count[f"capture ({pool_kind} pool, {'manual' if manual else 'accel.graph'})"] += 1
        self.note(f"capture on {d} ({pool_kind}, manual={manual}): {[(o[0], o[1].n) for o in ops]}")
        if rng.random() < 0.5:
            self.replay(rng, self.graphs[-1])

    def replay(self, rng, gr):
        d = gr["dev"]
        choices = ["current", "other"]
        if not gr["stream"].closed:
            choices.append("capture")
        if any(not nb.obj.stream.closed for nb in gr["made"]):
            choices.append("allocation")
        where = rng.choice(choices)
        if where == "capture":
            s = gr["stream"]
        elif where == "allocation":
            s = rng.choice([nb.obj.stream for nb in gr["made"] if not nb.obj.stream.closed])
        elif where == "current":
            s = accel.current_stream(d)
        else:
            s = self.any_stream(rng, d)
        for b in gr["bufs"]:
            self.order(rng, s, b)
        if rng.random() < 0.5 and self.cur != d:
            with s:
                gr["g"].replay()        # from the other device, d's current stream set to s
        else:
            with accel.device_index(d), s:
                gr["g"].replay()
        for kind, dst, x in gr["ops"]:
            if kind == "fill":
                dst.data = np.full(dst.n, x, np.uint8)
            else:
                dst.data = None if x.data is None else x.data.copy()
        for b in gr["bufs"]:
            b.unbacked = False
            b.last = [s]
        gr["replayed"] = True
        self.count[f"replay on the {where} stream"] += 1
        self.note(f"replay graph of {d} on {where}")

    def op_replay(self, rng):
        grs = [gr for gr in self.graphs if gr["g"] is not None and all(not b.closed for b in gr["bufs"])]
        if grs:
            self.replay(rng, rng.choice(grs))

    def _forget_graph(self, gr):
        self.graphs.remove(gr)
        for b in gr["bufs"]:
            b.graph_pinned -= 1
            if b.unbacked and not b.closed:
                # (cudaMallocAsync: an output never replayed has no memory; it is dropped with its graph)
                b.closed, b.obj = True, None

    def op_reset_graph(self, rng, drop=False):
        if not self.graphs:
            return
        gr = rng.choice(self.graphs)
        if self.is_async and not gr["replayed"] and any(not b.closed for b in gr["made"]):
            return      # known (r72c): test_async_reset_graph_output_address_reused_misattributes_frees
        # the graph's last replay must be done before its memory can be reused: wait on its streams
        for b in gr["bufs"]:
            if not b.closed:
                for t in b.last:
                    t.synchronize()
                b.last = []
        self._forget_graph(gr)
        if drop:
            gr["g"] = None
            gr.clear()
            self.count["drop graph"] += 1
        else:
            gr["g"].reset()
            self.count["reset graph"] += 1
        self.note(f"{'drop' if drop else 'reset'} graph")

    def op_drop_graph(self, rng):
        self.op_reset_graph(rng, drop=True)

    def op_pool_alloc(self, rng):
        if self.is_async:
            with pytest.raises(NotImplementedError):
                M.MemPool()
            return
        d = 1 if rng.random() < 0.7 else 0
        mps = [gr["mp"] for gr in self.graphs if gr["mp"] is not None and gr["mp"].device_index == d]
        if mps and rng.random() < 0.2:
            return      # (allocating in a graph's MemPool would share memory a replay writes)
        mp = self.pools[-1] if self.pools and self.pools[-1].device_index == d and rng.random() < 0.6 else None
        if mp is None:
            with accel.device_index(d):
                mp = M.MemPool(no_split=rng.random() < 0.3)
            self.pools.append(mp)
        n = rng.choice(SIZES[1:])
        with M.use_mem_pool(mp, d):
            b = accel.Buffer(n, d)
        v = rng.randrange(256)
        b.fill_(v)
        buf = Buf(b, d, np.full(n, v, np.uint8), "MemPool")
        buf.last = [b.stream]
        self.bufs.append(buf)
        if rng.random() < 0.3:
            self.pools.remove(mp)       # the MemPool dropped while its Buffer lives
        self.count["pool alloc"] += 1
        self.note(f"MemPool alloc {n} on {d}")

    def op_empty_cache(self, rng):
        if rng.random() < 0.5:
            M.empty_cache()
        else:
            M.device_allocator(rng.randrange(2)).empty_cache()
        self.note("empty_cache")

    def op_oom(self, rng):
        d = 1 if rng.random() < 0.7 else 0
        total = M.get_memory_info(d)[1]
        reserved = M.memory_reserved(d)
        cap = reserved + rng.choice([0, 1, 8]) * MiB + 4 * MiB
        M.set_per_process_memory_fraction(cap / total, d)
        request = cap + 2 * MiB
        # (dropped Buffers in cycles, and frees that wait for a later allocator call: accel may
        # collect and run them before it raises OutOfMemoryError)
        gc.collect()
        _finalize.drain()
        before = M.memory_stats(d)
        try:
            with pytest.raises(accel.OutOfMemoryError):
                accel.Buffer(request, d)
            after = M.memory_stats(d)
            if after["num_ooms"] != before["num_ooms"] + 1:
                raise Violation(f"num_ooms {before['num_ooms']} -> {after['num_ooms']}")
            # (not requested/active bytes: as torch's malloc, the refused call first processes the
            # events of blocks freed with stream uses, which frees them)
            # (cudaMallocAsync: allocated_bytes is the pool's cudaMemPoolAttrUsedMemCurrent, as
            # torch's, which drops when a queued cudaFreeAsync runs on its stream: at any time)
            keys = ("allocation.all.current",) if self.is_async else ("allocated_bytes.all.current",
                                                                      "allocation.all.current")
            for key in keys:
                if after[key] != before[key]:
                    raise Violation(f"a refused allocation changed {key}: {before[key]} -> {after[key]}")
            self.check("after OutOfMemoryError", rng)
        finally:
            M.set_per_process_memory_fraction(1.0, d)
        with accel.Buffer(request, d) as big:       # recovered
            big.fill_(7)
            s = big.stream
            got = big.to_numpy(stream=s)[::MiB]
        if not (got == 7).all():
            raise Violation("the recovered allocation reads back wrong")
        self.count["oom"] += 1
        self.note(f"oom on {d} (cap {cap}, request {request}) and recovery")

    def op_reset_peaks(self, rng):
        d = rng.randrange(2)
        enabled = gc.isenabled()
        gc.disable()
        try:
            _finalize.drain()       # (else memory_stats runs a queued free first: current < peak)
            M.reset_peak_memory_stats(d)
            st = M.memory_stats(d)
        finally:
            if enabled:
                gc.enable()
        for key, value in st.items():
            if key.endswith(".peak"):
                cur = st[key[:-5] + ".current"]
                if value != cur:
                    raise Violation(f"after reset_peak_memory_stats({d}): {key} {value} != current {cur}")
        if M.max_memory_allocated(d) != M.memory_allocated(d):
            raise Violation("max_memory_allocated != memory_allocated after the reset")
        self.note(f"reset peaks {d}")

    def op_dlpack(self, rng):
        bs = [b for b in self.usable() if b.n]
        if not bs:
            return
        b = rng.choice(bs)
        s = accel.current_stream(b.dev)
        self.order(rng, s, b)
        if rng.random() < 0.5:
            cap = b.obj.__dlpack__(copy=True, max_version=(1, 0), stream=s)
            if rng.random() < 0.5:
                del cap
                self.count["device copy dropped"] += 1
                self.note(f"dlpack device copy of {b.n}@{b.dev} dropped")
                return
            imp = accel.from_dlpack(cap)
            del cap
            got = imp.to_numpy()
            if b.data is not None and not np.array_equal(got, b.data):
                raise Violation(f"dlpack device copy of Buffer({b.n}) on {b.dev} reads back wrong")
            if imp.device_index != b.dev or imp.owns_memory:
                raise Violation(f"from_dlpack of a device copy: device {imp.device_index}, owns {imp.owns_memory}")
            if rng.random() < 0.5:
                imp.close()
            del imp
            self.count["device copy consumed"] += 1
            self.note(f"dlpack device copy of {b.n}@{b.dev} consumed")
            return
        cap = b.obj.__dlpack__(dl_device=(kDLCPU, 0), copy=rng.choice([None, True]),
                               max_version=rng.choice([None, (1, 0)]))
        what = rng.randrange(3)
        if what == 0:
            del cap
            self.count["host copy dropped"] += 1
        elif what == 1:
            got = np.from_dlpack(Host(cap))
            if b.data is not None and not np.array_equal(got, b.data):
                raise Violation(f"dlpack host copy of Buffer({b.n}) on {b.dev} reads back wrong")
            self.count["host copy consumed"] += 1
        else:
            before = live_handles(self.kind)
            with pytest.raises(BufferError):
                accel.from_dlpack(cap)
            if live_handles(self.kind) != before:
                raise Violation("a refused from_dlpack of a host capsule changed the live handles")
            self.count["host copy refused"] += 1
        self.note(f"dlpack host copy of {b.n}@{b.dev} ({what})")

    def op_read(self, rng):
        bs = [b for b in self.usable() if b.data is not None]
        if bs:
            self.read(rng.choice(bs), rng)
            self.note("read")

    def op_device(self, rng):
        self.cur = 1 if self.cur == 0 and rng.random() < 0.3 else 0
        accel.set_device_index(self.cur)
        self.note(f"current device {self.cur}")

    def op_collect(self, rng):
        gc.collect()
        self.note("gc.collect")

    # -- invariants ---------------------------------------------------------------------------
    def figures(self):
        """memory_snapshot() and each device's memory_stats of one moment: frees of collected
        Buffers that an allocator call runs first (the finalizer queue) are run before, and
        the snapshot is taken again after the stats until the two agree in time."""
        enabled = gc.isenabled()
        gc.disable()        # (no collection of a dropped cycle's Buffer in the middle)
        try:
            for _ in range(5):
                _finalize.drain()
                snap = M.memory_snapshot()
                stats = [M.memory_stats(d) for d in range(2)]
                scalars = [(M.memory_allocated(d), M.memory_reserved(d)) for d in range(2)]
                if M.memory_snapshot() == snap and [M.memory_stats(d) for d in range(2)] == stats:
                    return snap, stats, scalars
            raise Violation("memory_snapshot/memory_stats never settle")
        finally:
            if enabled:
                gc.enable()

    def check(self, where, rng):
        if faults():
            raise Violation(f"{where}: device fault {faults()}")
        if accel.current_device_index() != self.cur:
            raise Violation(f"{where}: current device {accel.current_device_index()}, not {self.cur}")
        snap, stats, scalars = self.figures()
        for d in range(2):
            st = stats[d]
            alloc, reserved = st["allocated_bytes.all.current"], st["reserved_bytes.all.current"]
            if scalars[d] != (alloc, reserved):
                raise Violation(f"{where}: device {d}: memory_allocated/reserved disagree with memory_stats")
            if alloc > reserved:
                raise Violation(f"{where}: device {d}: memory_allocated {alloc} > memory_reserved {reserved}")
            for key, value in st.items():
                if isinstance(value, (int, float)) and value < 0 and key != "max_split_size":  # (-1: unlimited)
                    raise Violation(f"{where}: device {d}: {key} = {value} < 0")
                if key.endswith(".current") and st.get(key[:-8] + ".peak", value) < value:
                    raise Violation(f"{where}: device {d}: {key[:-8]}.peak < current {value}")
            segs = [s for s in snap if s["device"] == d]
            if self.is_async:
                if segs:
                    raise Violation(f"{where}: device {d}: cudaMallocAsync's snapshot lists segments")
                continue
            total = sum(s["total_size"] for s in segs)
            if total != reserved:
                raise Violation(f"{where}: device {d}: reserved {reserved} != the snapshot's total_size sum {total}")
            blocks = [blk for s in segs for blk in s["blocks"]]
            act = sum(blk["size"] for blk in blocks if blk["state"] == "active_allocated")
            if act != alloc or sum(s["allocated_size"] for s in segs) != alloc:
                raise Violation(f"{where}: device {d}: allocated {alloc} != the snapshot's active blocks {act}")
            active = sum(blk["size"] for blk in blocks if blk["state"] in ("active_allocated", "active_pending_free"))
            if active != st["active_bytes.all.current"]:
                raise Violation(f"{where}: device {d}: active_bytes {st['active_bytes.all.current']} != the "
                                f"snapshot's {active}")
            count = sum(blk["state"] == "active_allocated" for blk in blocks)
            if count != st["allocation.all.current"]:
                raise Violation(f"{where}: device {d}: allocation.all.current {st['allocation.all.current']} != "
                                f"{count} active blocks")
        if not self.is_async:
            # each live MemPool: its snapshot is the segments of its id; its use_count the MemPool
            # itself and the live graphs capturing into it (no use_mem_pool block is open here)
            mps = {id(mp): mp for mp in self.pools + [gr["mp"] for gr in self.graphs if gr["mp"] is not None]}
            for mp in mps.values():
                mine = [s for s in snap if tuple(s["segment_pool_id"]) == tuple(mp.id)]
                theirs = mp.snapshot()
                if sorted(s["address"] for s in theirs) != sorted(s["address"] for s in mine):
                    raise Violation(f"{where}: MemPool {mp.id}: snapshot() {len(theirs)} segments, "
                                    f"memory_snapshot() lists {len(mine)} of its id")
                users = 1 + sum(tuple(gr["pool_id"]) == tuple(mp.id) for gr in self.graphs)
                if mp.use_count() != users:
                    raise Violation(f"{where}: MemPool {mp.id}: use_count() {mp.use_count()}, want {users} "
                                    f"(the MemPool and its live graphs)")
        bs = [b for b in self.usable() if b.data is not None]
        if bs:
            self.read(rng.choice(bs), rng)

    def teardown(self, rng):
        for gr in list(self.graphs):
            self._forget_graph(gr)
            if rng.random() < 0.5:
                gr["g"].reset()
            gr.clear()
        self.graphs = []
        for b in self.live():
            if b.data is not None and not b.unbacked:
                self.read(b, rng)
        for b in self.live():
            self.release(rng, b, rng.choice(["close", "drop"]))
        self.bufs, self.events, self.pools = [], [], []
        b = gr = None
        for d in range(2):
            for w in self.wrappers[d]:
                if not w.closed and rng.random() < 0.5:
                    w.close()
        w = None
        self.wrappers, self.base = {0: [], 1: []}, {}
        self.streams = {0: [], 1: []}
        accel.set_device_index(0)
        self.cur = 0
        settle()
        self.check("teardown", rng)
        for d in range(2):
            if M.memory_allocated(d) or M.memory_reserved(d):
                raise Violation(f"teardown: device {d}: allocated {M.memory_allocated(d)}, "
                                f"reserved {M.memory_reserved(d)}")
        if live_handles(self.kind) != self.base_handles:
            raise Violation(f"teardown: live handles {live_handles(self.kind)} != {self.base_handles}")

    def run(self, plan):
        for i, (name, seed) in enumerate(plan):
            rng = random.Random(seed)
            self.note(f"[{i}] {name}")
            getattr(self, f"op_{name}")(rng)
            self.check(f"step {i} ({name})", rng)
        self.teardown(random.Random(f"teardown-{len(plan)}"))


def make_plan(seed, steps):
    rng = random.Random(f"r81b-{seed}")
    ops = [name for name, w in Program.OPS for _ in range(w)]
    return [(rng.choice(ops), rng.randrange(1 << 30)) for _ in range(steps)]


RUNS = collections.Counter()


def run_program(kind, conf, plan):
    """Run ``plan`` on a fresh simulator; the failure's text, or None."""
    _lazy._reset_for_tests()
    unraisable = []
    old = sys.unraisablehook
    sys.unraisablehook = lambda u: unraisable.append(f"{u.exc_type.__name__}: {u.exc_value} in {u.object!r}")
    prog = None
    try:
        prog = Program(kind, conf)
        prog.run(plan)
        gc.collect()
        if unraisable:
            raise Violation(f"unraisable exceptions: {unraisable[:3]}")
        RUNS.update(prog.count)
        return None
    except Exception as exc:
        tail = "\n  ".join(prog.log[-8:]) if prog else ""
        return f"{type(exc).__name__}: {exc}\n  last ops:\n  {tail}"
    finally:
        sys.unraisablehook = old
        prog = None
        gc.collect()
        _lazy._reset_for_tests()


def failure_key(text):
    """A failure's kind, for the shrinker: its first line without the step and the numbers."""
    first = re.sub(r"step \d+ \(\w+\): ", "", text.split("\n")[0])
    return re.sub(r"\d+", "N", first)[:60]


@pytest.mark.filterwarnings("ignore:The .* Graph is empty")
@pytest.mark.parametrize("conf", list(CONFIGS))
def test_random_programs(monkeypatch, conf):
    kind, env = CONFIGS[conf]
    if DELAY_US:
        env = dict(env, ACCEL_SIM_DELAY_US=DELAY_US)
    use_sim(monkeypatch, kind, ACCEL_SIM_DEVICES=2, **env)
    for seed in range(PROGRAMS):
        plan = make_plan(seed, STEPS)        # (the same programs under every configuration)
        failure = run_program(kind, conf, plan)
        if failure is None:
            RUNS["programs"] += 1
            continue
        deadline = time.monotonic() + 60
        key = failure_key(failure)

        def same(p):
            got = time.monotonic() < deadline and run_program(kind, conf, p)
            return bool(got) and failure_key(got) == key
        small = shrink_plan(plan, same)
        final = run_program(kind, conf, small) or failure
        steps = "\n  ".join(f"{name} (rng seed {s})" for name, s in small)
        pytest.fail(f"{conf} program {seed} fails: {failure}\nminimal step list ({len(small)} of {len(plan)}):\n  "
                    f"{steps}\nits failure: {final}")


def test_the_programs_reached_every_op():
    """Over all the programs above, each op did its work somewhere (skipped unless all ran)."""
    if RUNS["programs"] < PROGRAMS * len(CONFIGS):
        pytest.skip(f"only {RUNS['programs']} programs ran before this test")
    want = {"copy across devices", "buffer close", "buffer drop", "record_stream then free", "close stream", "wrap",
            "close wrapper", "event across devices", "replay on the capture stream", "replay on the allocation stream",
            "replay on the current stream", "replay on the other stream", "reset graph", "drop graph", "pool alloc",
            "oom", "device copy dropped", "device copy consumed", "host copy dropped", "host copy consumed",
            "host copy refused", "free in capture", "capture (shared pool, accel.graph)",
            "capture (mempool pool, manual)", "capture (fresh pool, manual)", "capture (shared pool, manual)",
            "capture (mempool pool, accel.graph)", "capture (fresh pool, accel.graph)", "buffer cycle",
            "record_stream before close"}
    assert want <= set(RUNS), sorted(want - set(RUNS))



# -- what the fuzz found: minimal reproductions -------------------------------------------------
def test_from_handle_of_a_default_stream_without_device_names_the_current_device(monkeypatch):
    """Not a bug (the fuzz first flagged it): ``Stream.from_handle(default_stream(1).handle)``
    while device 0 is current wraps device 0's default stream.  The default stream's handle is
    NULL on every device, and CUDA Runtime API cudaStreamGetDevice: "This function uses
    standard default stream semantics" (NULL: the current device's); with ``device=1`` it is
    device 1's."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DEVICES=2)
    accel.set_device_index(0)
    h = accel.default_stream(1).handle
    assert accel.Stream.from_handle(h).device_index == 0
    w = accel.Stream.from_handle(h, 1)
    assert w == accel.default_stream(1) and w.device_index == 1
    w.close()
    assert not accel.default_stream(1).closed


# r81b, fixed in session 39: memory/_async.py AsyncPoolAllocator._replayed/_free_now: a graph output
# replayed on another stream is freed on that stream, not ordered after work on the Buffer's own
# allocation stream: cudaFreeAsync races it (the simulator refuses: cudaErrorInvalidValue; a dropped
# Buffer's finalizer leaks it)
def test_async_graph_output_replayed_elsewhere_is_freed_after_work_on_its_own_stream(monkeypatch):
    """Found by the fuzz with ACCEL_R81B_DELAY_US=200 (cuda-async program 19: capture, replay on
    the capture stream, replay on the current stream, drop the graph, record_stream op).

    Under ``backend:cudaMallocAsync`` a Buffer allocated in a capture on stream ``s`` has
    ``Buffer.stream == s``; after a replay on another stream ``d`` the allocator records ``d``
    as where the allocation is freed (``_replayed``: ``alloc.stream = stream``).  Work the user
    queues on the Buffer's own stream ``s`` needs no record_stream (torch: the allocation
    stream), yet the free is queued on ``d`` with no wait for ``s``.  CUDA Runtime API,
    cudaFreeAsync: "The allocation must not be accessed after stream execution reaches the
    free."  Here the fill on ``s`` is still queued when ``close()`` frees on ``d``: the simulator
    refuses the free (r68d, cudaErrorInvalidValue) and close() raises; dropped instead of closed,
    the finalizer's free fails twice and the memory leaks (an unraisable exception).  On a GPU the
    pool could hand the memory out while the fill still writes it.  Fix idea: in ``_free_now``
    also make the free stream wait for the allocation's original stream (or free on it after
    it waits for the last replay stream)."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DEVICES=2, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync",
            ACCEL_SIM_DELAY_US=20000)
    s = accel.Stream(1)
    g = accel.Graph()
    with s:
        g.capture_begin()
        out = accel.Buffer(4096, 1)
        out.fill_(1)
        g.capture_end()
    with s:
        g.replay()
    d = accel.current_stream(1)
    d.wait_stream(s)
    with accel.device_index(1):
        g.replay()          # on d
    d.synchronize()
    del g
    gc.collect()
    assert out.stream == s
    out.fill_(2, stream=s)      # on the Buffer's own allocation stream
    try:
        out.close()             # must be queued after the fill: no error
        settle()
        assert not faults()
        assert M.memory_allocated(1) == 0
    finally:
        accel.synchronize(1)
