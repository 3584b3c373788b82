"""A stateful, model-based test of accel's public API on two devices (r60).

A hypothesis ``RuleBasedStateMachine`` drives public calls on either device in any order:
Buffers (alloc 1 B..8 MiB, close, fill_, copy_from a host array / a pinned array / another
Buffer / an ArrayView, across devices, strided ArrayView writes, copy_to a pinned array,
record_stream with a reuse after the free), Streams (create, close, wait_event, wait_stream,
synchronize, query, set_stream), Events (create, record, query, synchronize, wait,
elapsed_time), the current device and stream (set_device_index, ``with stream:`` and ``with
accel.device_index(d):`` blocks left open across steps and left in LIFO order), the memory API
(empty_cache, set_per_process_memory_fraction with the out-of-memory it implies,
set_allocator_settings, reset_peak_memory_stats, MemPool and ``use_mem_pool`` blocks), graphs
(capture a fill and a copy on a side stream, replay, reset; CUDA and XPU) and the RNG
(manual_seed, get/set_rng_state, uniform_ fills computed by the host Philox reference).

The model keeps every live Buffer's expected bytes (and which bytes are known), which objects
are live or closed, the current device, each device's current stream, the context stack and
each device's (seed, offset).  After every step: each live Buffer reads back as modelled (all
devices synchronized first); memory_stats agree with memory_snapshot segment by segment
(torch's _check_memory_stat_consistency, tests/torch_port_util.expected_memory_stats); the
active blocks of the snapshot are exactly the live Buffers and allocated_bytes.all.current is
the sum of their sizes; the current device, current streams and RNG states are the model's.
Use of a closed object raises RuntimeError naming it as closed and changes nothing.  At
teardown everything is closed and the simulator and accel's objects are back to the baseline.

Runs per configuration: CUDA (expandable segments, classic segments, backend:cudaMallocAsync),
XPU and Metal (one device).  Deterministic by default (derandomize); ACCEL_STATEFUL_EXAMPLES=N
runs N random examples per configuration instead.
"""

import collections
import gc
import os
import warnings

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings, strategies as st  # noqa: E402
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, initialize, invariant, multiple,  # noqa: E402
                                 precondition, rule, run_state_machine_as_test)

import accel  # noqa: E402
import accel.memory as M  # noqa: E402
import accel.random as R  # noqa: E402
from accel import _finalize, sim  # noqa: E402
from conftest import THOROUGH, use_sim  # noqa: E402
from test_refusals_r58 import CONFIGS  # noqa: E402  (name -> (simulator, ACCEL_ALLOC_CONF))
from torch_port_util import expected_memory_stats  # noqa: E402

pytestmark = pytest.mark.usefixtures("frozen_heap")

KiB, MiB = 1 << 10, 1 << 20


_LONG = int(os.environ.get("ACCEL_STATEFUL_EXAMPLES", "0") or 0)
# default: 6 derandomized examples of 30 steps per config (every rule still ran, counted over the
# 5 configs); THOROUGH: 25 x 40
SETTINGS = settings(max_examples=_LONG or (25 if THOROUGH else 6), stateful_step_count=40 if THOROUGH or _LONG else 30,
                    deadline=None, derandomize=not _LONG,
                    database=None, report_multiple_bugs=False, suppress_health_check=list(HealthCheck), print_blob=True)

SIZES = st.one_of(st.integers(1, 4 * KiB), st.integers(1, MiB),
                  st.sampled_from([64, 512, 4096, 2 * MiB, 2 * MiB + 1, 3 * MiB, 5 * MiB + 7, 8 * MiB]))
ALLOC_SETTINGS = ["expandable_segments:False", "expandable_segments:True", "max_split_size_mb:20",
                  "roundup_power2_divisions:4", "garbage_collection_threshold:0.6",
                  "expandable_segments:False,max_split_size_mb:40,roundup_power2_divisions:[256:8,>:2]", ""]


def _philox_words_rounded(words: int) -> int:
    return -(-words // 4) * 4


class Buf:
    def __init__(self, obj, dev, nbytes):
        self.obj, self.dev, self.nbytes = obj, dev, nbytes
        self.data = np.zeros(nbytes, np.uint8)
        self.known = np.zeros(nbytes, bool)
        self.closed = False
        self.graphs = []            # graphs whose captured work names this buffer

    def set(self, sl, values):
        self.data[sl] = values
        self.known[sl] = True

    def __repr__(self):
        return f"Buf(dev={self.dev}, n={self.nbytes}{', closed' if self.closed else ''})"


class Str:
    def __init__(self, obj, dev, default=False):
        self.obj, self.dev, self.default, self.closed = obj, dev, default, False

    def __repr__(self):
        return f"Str(dev={self.dev}{', default' if self.default else ''}{', closed' if self.closed else ''})"


class Ev:
    def __init__(self, obj, timing):
        self.obj, self.timing = obj, timing
        self.dev = None             # the device of its first record
        self.closed = False

    def __repr__(self):
        return f"Ev(timing={self.timing}, dev={self.dev}{', closed' if self.closed else ''})"


class Pool:
    def __init__(self, obj, dev):
        self.obj, self.dev = obj, dev


class Gr:
    def __init__(self, obj, dev):
        self.obj, self.dev = obj, dev
        self.ops = None             # captured work: [("fill", Buf, v) | ("copy", dst, src)]

    @property
    def stale(self):
        return self.ops is not None and any(op[1].closed or (op[0] == "copy" and op[2].closed) for op in self.ops)


def light_fingerprint(n):
    """What a refused call on a closed object must leave as it was."""
    fp = {}
    for d in range(n):
        fp[f"stats{d}"] = dict(M.memory_stats(d))
        fp[f"stream{d}"] = accel.current_stream(d)
        fp[f"rng{d}"] = R.get_rng_state(d).tobytes()
    fp["snapshot"] = M.memory_snapshot()
    fp["device"] = accel.current_device_index()
    state = vars(sim.state())
    for key in ("calls", "config"):
        state.pop(key)
    fp["sim"] = state
    return fp


def live_handles(kind):
    st_ = sim.state()
    if kind == "cuda":
        return {"allocations": sum(st_.live_allocations.values()), "host": st_.host_allocations,
                "streams": st_.streams, "events": st_.events, "graphs": st_.graphs,
                "graph_execs": st_.graph_execs, "captures": st_.captures}
    if kind == "xpu":
        return {k: v for k, v in vars(st_).items()
                if k.startswith("ze_live_") and "event" not in k} | {"ze_device_used": st_.ze_device_used}
    from accel.sim import metal
    return dict(metal.state().live_counts())


_USER_TYPES = ("Buffer", "ArrayView", "Stream", "Event", "Graph", "MemPool", "Generator")


def open_objects(exclude=()):
    """accel's user-facing objects alive and not closed (those in the weak set ``exclude`` left out)."""
    gc.collect()
    out = collections.Counter()
    for o in gc.get_objects():
        t = type(o)
        if t.__name__ in _USER_TYPES and _accel_module(t):
            if not getattr(o, "_closed", False) and o not in exclude:
                out[t.__name__] += 1
    return out


def _accel_module(t) -> bool:
    mod = str(getattr(t, "__module__", ""))
    return mod.startswith("accel") and not mod.startswith("accel.sim")


class _Known(dict):
    """The objects alive at the baseline, by id (held, so that no id is reused)."""

    def __contains__(self, o):
        return dict.__contains__(self, id(o))


def weak_all_objects():
    gc.collect()
    known = _Known()
    for o in gc.get_objects():
        t = type(o)
        if t.__name__ in _USER_TYPES and _accel_module(t):
            known[id(o)] = o
    return known


def settle(n):
    gc.collect()
    _finalize.drain()
    for d in range(n):
        accel.synchronize(d)
    M.empty_cache()
    M.empty_host_cache()
    _finalize.drain()


class APIMachine(RuleBasedStateMachine):
    config = None           # set by the test: key of CONFIGS
    monkeypatch = None

    buffers = Bundle("buffers")
    streams = Bundle("streams")
    events = Bundle("events")
    graphs = Bundle("graphs")
    pools = Bundle("pools")
    states = Bundle("rng_states")

    def __init__(self):
        super().__init__()
        kind, conf = CONFIGS[self.config]
        env = {"ACCEL_SIM_DEVICES": 2}
        if conf:
            env["ACCEL_ALLOC_CONF"] = conf
        self.kind = use_sim(self.monkeypatch, kind, **env)
        self.asyncpool = "cudaMallocAsync" in conf
        self.n = accel.device_count()
        self.graphs_ok = kind != "mps"
        # touch everything once so that the baseline holds the runtime's own objects
        for d in range(self.n):
            with accel.Buffer(16, d) as warm:
                R.uniform_(warm)        # the RNG kernels load once per process (Metal: a library)
            accel.current_stream(d)
        accel.set_device_index(0)
        settle(self.n)
        self.base_handles = live_handles(kind)
        self.base_weak = weak_all_objects()
        self.base_objects = open_objects(self.base_weak)
        self.cur_dev = 0
        self.defaults = [Str(accel.default_stream(d), d, default=True) for d in range(self.n)]
        self.cur_stream = {d: self.defaults[d] for d in range(self.n)}
        self.ctx = []               # (kind, cm, saved, what)
        self.bufs, self.strs, self.evs, self.grs, self.mempools = [], [], [], [], []
        self.rng = {}
        for d in range(self.n):
            s = R.get_rng_state(d)
            self.rng[d] = (int.from_bytes(s[:8].tobytes(), "little"), int.from_bytes(s[8:].tobytes(), "little"))
        self.caps = {d: None for d in range(self.n)}
        self.pinned = []
        self.records = []           # every record made: their objects are dropped at teardown

    # -- helpers ---------------------------------------------------------------------------
    def dev(self, d):
        return d % self.n

    def live(self, items):
        return [x for x in items if not x.closed]

    def current_pool(self, dev):
        for kind_, _cm, _saved, what in reversed(self.ctx):
            if kind_ == "pool" and what.dev == dev:
                return what
        return None

    def _stream_of(self, dev, s):
        """A live stream of ``dev`` from the bundle pick, or the current stream."""
        if s is not None and not s.closed and s.dev == dev:
            return s
        return None

    # -- a few objects to start with ------------------------------------------------------
    @initialize(target=buffers, sizes=st.lists(SIZES, min_size=2, max_size=5), devs=st.lists(st.integers(0, 1),
                                                                                          min_size=5, max_size=5))
    def init_buffers(self, sizes, devs):
        return multiple(*[self.alloc(d, n, False) for n, d in zip(sizes, devs)])

    @initialize(target=streams, d=st.integers(0, 1))
    def init_streams(self, d):
        return multiple(self.new_stream(d, 0), self.new_stream(1 - d, 0))

    @initialize(target=events, timing=st.booleans())
    def init_events(self, timing):
        return multiple(self.new_event(timing), self.new_event(True))

    # -- buffers ---------------------------------------------------------------------------
    @rule(target=buffers, d=st.integers(0, 1), nbytes=st.integers(1, 64 * KiB))
    def alloc_small(self, d, nbytes):
        return self.alloc(d, nbytes, False)

    @rule(target=buffers, d=st.integers(0, 1), nbytes=SIZES, with_stream=st.booleans())
    def alloc(self, d, nbytes, with_stream):
        d = self.dev(d)
        cap = self.caps[d]
        before_alloc, before_reserved = M.memory_allocated(d), M.memory_reserved(d)
        try:
            obj = accel.Buffer(nbytes, d, stream=self.cur_stream[d].obj if with_stream else None)
        except accel.OutOfMemoryError:
            assert cap is not None, f"out of memory without a memory fraction ({nbytes} bytes on {d})"
            assert M.memory_allocated(d) == before_alloc
            return multiple()
        if cap is not None:
            # The fraction caps what the allocator reserves from the device (torch: the check in
            # DeviceCachingAllocator::alloc_block, before a new segment); a request served from
            # memory already cached fits whatever the cap is now (a cap lowered below reserved).
            reserved = M.memory_reserved(d)
            assert reserved <= before_reserved or reserved <= cap, (
                f"reserved {reserved} bytes on device {d} past the cap {cap} for {nbytes} bytes "
                f"(reserved {before_reserved} before)")
        b = Buf(obj, d, nbytes)
        self.bufs.append(b)
        self.records.append(b)
        return b

    @rule(b=buffers)
    def close_buffer(self, b):
        b.obj.close()
        b.closed = True

    @rule(b=buffers, value=st.integers(0, 255), s=st.none() | streams)
    def fill(self, b, value, s):
        if b.closed:
            return self._refused(lambda: b.obj.fill_(value))
        s = self._stream_of(b.dev, s)
        b.obj.fill_(value, stream=None if s is None else s.obj)
        b.set(slice(None), value)

    @rule(b=buffers, seed=st.integers(0, 2**32), non_blocking=st.booleans(), pinned=st.booleans())
    def copy_from_host(self, b, seed, non_blocking, pinned):
        host = np.random.default_rng(seed).integers(0, 256, b.nbytes, dtype=np.uint8)
        if b.closed:
            return self._refused(lambda: b.obj.copy_from(host))
        if pinned:
            src = accel.empty_pinned((b.nbytes,), np.uint8)
            src[:] = host
            self.pinned.append(src)
        else:
            src = host
        b.obj.copy_from(src, non_blocking=non_blocking)
        b.set(slice(None), host)

    @rule(dst=buffers, src=buffers, non_blocking=st.booleans(), offset=st.integers(0, 4096))
    def copy_between(self, dst, src, non_blocking, offset):
        """dst.copy_from(src) when the sizes match, else from a uint8 ArrayView of src at an offset."""
        if dst.closed or src.closed:
            return self._refused(lambda: dst.obj.copy_from(src.obj))
        if src.nbytes == dst.nbytes:
            dst.obj.copy_from(src.obj, non_blocking=non_blocking)
            if src is not dst:
                dst.data[:] = src.data
                dst.known[:] = src.known
            return
        if src.nbytes < dst.nbytes:
            return
        offset = offset % (src.nbytes - dst.nbytes + 1)
        view = src.obj.as_array(np.uint8, (dst.nbytes,), offset=offset)
        dst.obj.copy_from(view, non_blocking=non_blocking)
        dst.data[:] = src.data[offset:offset + dst.nbytes]
        dst.known[:] = src.known[offset:offset + dst.nbytes]

    @rule(b=buffers, seed=st.integers(0, 2**32), offset=st.integers(0, 1 << 23), stride=st.integers(1, 5),
          count=st.integers(1, 3000))
    def write_view(self, b, seed, offset, stride, count):
        """A strided uint8 ArrayView of b written from the host."""
        if b.closed:
            return
        offset %= b.nbytes
        count = min(count, (b.nbytes - offset - 1) // stride + 1)
        host = np.random.default_rng(seed).integers(0, 256, count, dtype=np.uint8)
        view = b.obj.as_array(np.uint8, (count,), strides=(stride,), offset=offset)
        view.copy_from(host)
        b.set(slice(offset, offset + stride * (count - 1) + 1, stride), host)

    @rule(dst=buffers, src=buffers, offset=st.integers(0, 1 << 23), count=st.integers(1, 5000))
    def view_to_view(self, dst, src, offset, count):
        """ArrayView.copy_from(another ArrayView) of another buffer of the same device."""
        if dst.closed or src.closed or dst is src or dst.dev != src.dev:
            return
        count = min(count, dst.nbytes, src.nbytes)
        doff = offset % (dst.nbytes - count + 1)
        soff = (offset // 3) % (src.nbytes - count + 1)
        dst.obj.as_array(np.uint8, (count,), offset=doff).copy_from(src.obj.as_array(np.uint8, (count,), offset=soff))
        dst.data[doff:doff + count] = src.data[soff:soff + count]
        dst.known[doff:doff + count] = src.known[soff:soff + count]

    @rule(b=buffers, non_blocking=st.booleans())
    def copy_to_pinned(self, b, non_blocking):
        if b.closed:
            return self._refused(lambda: b.obj.to_numpy())
        out = accel.empty_pinned((b.nbytes,), np.uint8)
        b.obj.copy_to(out, non_blocking=non_blocking)
        accel.synchronize(b.dev)
        k = b.known
        assert (out[k] == b.data[k]).all(), "copy_to a pinned array differs from the model"

    @rule(b=buffers, s=streams)
    def record_stream(self, b, s):
        if b.closed:
            return self._refused(lambda: b.obj.record_stream(self.defaults[b.dev].obj))
        if s.closed or s.dev != b.dev:
            return
        b.obj.record_stream(s.obj)

    @rule(d=st.integers(0, 1), nbytes=SIZES, value=st.integers(0, 255))
    def side_use_then_reuse(self, d, nbytes, value):
        """Fill a buffer on a side stream made slow, record_stream it there, free it, and fill a
        new buffer of the size on the current stream: the slow fill must not land in it."""
        d = self.dev(d)
        if self.caps[d] is not None:
            return
        from accel.sim import core
        s = accel.Stream(d)
        b = accel.Buffer(nbytes, d)
        old = core.configure(delay_us=300).delay_us if hasattr(core, "configure") else None
        try:
            b.fill_(value, stream=s)
            b.record_stream(s)
            b.close()
            fresh = accel.Buffer(nbytes, d)
            fresh.fill_((value + 1) % 256)
        finally:
            core.configure(delay_us=old or 0)
        s.close()
        got = fresh.to_numpy()
        assert (got == (value + 1) % 256).all(), "a freed block was reused before its side-stream fill ran"
        fresh.close()

    # -- streams and events ----------------------------------------------------------------
    @rule(target=streams, d=st.integers(0, 1), priority=st.sampled_from([0, -1]))
    def new_stream(self, d, priority):
        s = Str(accel.Stream(self.dev(d), priority=priority), self.dev(d))
        self.strs.append(s)
        self.records.append(s)
        return s

    @rule(target=streams, d=st.integers(0, 1))
    def default_stream(self, d):
        return self.defaults[self.dev(d)]

    @rule(s=streams)
    def close_stream(self, s):
        if s.default:
            with pytest.raises(RuntimeError, match="default stream"):
                s.obj.close()
            return
        s.obj.close()       # idempotent
        s.closed = True
        if self.cur_stream[s.dev] is s:
            self.cur_stream[s.dev] = self.defaults[s.dev]

    @rule(s=streams, e=events)
    def stream_wait_event(self, s, e):
        if s.closed:
            return self._refused(lambda: s.obj.wait_event(self._any_event()))
        if e.closed:
            return self._refused(lambda: s.obj.wait_event(e.obj))
        s.obj.wait_event(e.obj)

    @rule(s=streams, other=streams)
    def stream_wait_stream(self, s, other):
        if s.closed or other.closed:
            return self._refused(lambda: s.obj.wait_stream(other.obj))
        s.obj.wait_stream(other.obj)

    @rule(s=streams)
    def stream_sync_query(self, s):
        if s.closed:
            return self._refused(s.obj.synchronize)
        s.obj.query()
        s.obj.synchronize()
        assert s.obj.query() is True

    @rule(s=streams)
    def set_stream(self, s):
        if s.closed:
            return self._refused(lambda: accel.set_stream(s.obj))
        accel.set_stream(s.obj)
        self.cur_dev = s.dev
        self.cur_stream[s.dev] = s

    @rule(target=events, timing=st.booleans())
    def new_event(self, timing):
        e = Ev(accel.Event(enable_timing=timing), timing)
        self.evs.append(e)
        self.records.append(e)
        return e

    @rule(e=events, s=st.none() | streams)
    def record_event(self, e, s):
        if e.closed:
            return self._refused(e.obj.record)
        if s is not None and s.closed:
            return self._refused(lambda: e.obj.record(s.obj))
        dev = self.cur_dev if s is None else s.dev
        if e.dev is not None and e.dev != dev:
            before = light_fingerprint(self.n)
            with pytest.raises(accel.InvalidDeviceError, match="belongs to device"):
                e.obj.record(None if s is None else s.obj)
            assert light_fingerprint(self.n) == before
            return
        e.obj.record(None if s is None else s.obj)
        e.dev = dev

    @rule(e=events, s=st.none() | streams)
    def event_wait(self, e, s):
        if e.closed:
            return self._refused(e.obj.wait)
        if s is not None and s.closed:
            return
        e.obj.wait(None if s is None else s.obj)

    @rule(e=events)
    def event_sync_query(self, e):
        if e.closed:
            return self._refused(e.obj.synchronize)
        e.obj.query()
        e.obj.synchronize()
        assert e.obj.query() is True

    @rule(a=events, b=events)
    def elapsed(self, a, b):
        if a.closed or b.closed:
            if a.closed or b.dev is not None:   # (else test_elapsed_time_to_a_closed_unrecorded_event)
                self._refused(lambda: a.obj.elapsed_time(b.obj))
            return
        if not (a.timing and b.timing):
            with pytest.raises(ValueError, match="enable_timing"):
                a.obj.elapsed_time(b.obj)
            return
        if a.dev is None or b.dev is None or a.dev != b.dev:
            with pytest.raises((RuntimeError, ValueError)):
                a.obj.elapsed_time(b.obj)
            return
        a.obj.synchronize()
        b.obj.synchronize()
        assert isinstance(a.obj.elapsed_time(b.obj), float)

    @rule(e=events)
    def close_event(self, e):
        e.obj.close()
        e.closed = True

    def _any_event(self):
        return accel.Event()

    # -- current device and context blocks -------------------------------------------------
    @rule(d=st.integers(0, 1))
    def set_device(self, d):
        accel.set_device_index(self.dev(d))
        self.cur_dev = self.dev(d)

    @rule(s=streams)
    def enter_stream(self, s):
        if s.closed:
            return self._refused(lambda: s.obj.__enter__())
        saved = (self.cur_dev, self.cur_stream[s.dev])
        s.obj.__enter__()
        self.ctx.append(("stream", s.obj, saved, s))
        self.cur_dev = s.dev
        self.cur_stream[s.dev] = s

    @rule(d=st.integers(0, 1))
    def enter_device(self, d):
        cm = accel.device_index(self.dev(d))
        cm.__enter__()
        self.ctx.append(("device", cm, self.cur_dev, None))
        self.cur_dev = self.dev(d)

    @precondition(lambda self: self.ctx)
    @rule()
    def exit_block(self):
        kind_, cm, saved, what = self.ctx.pop()
        cm.__exit__(None, None, None)
        if kind_ == "stream":
            dev, stream = saved
            self.cur_stream[what.dev] = self.defaults[what.dev] if stream.closed else stream
            self.cur_dev = dev
        elif kind_ == "device":
            self.cur_dev = saved

    # -- memory ----------------------------------------------------------------------------
    @rule()
    def empty_cache(self):
        M.empty_cache()

    @rule(d=st.integers(0, 1), cap_mib=st.sampled_from([None, 4, 16, 48]))
    def memory_fraction(self, d, cap_mib):
        d = self.dev(d)
        total = M.get_memory_info(d)[1]
        if cap_mib is None:
            M.set_per_process_memory_fraction(1.0, d)
            self.caps[d] = None
        else:
            M.set_per_process_memory_fraction(cap_mib * MiB / total, d)
            self.caps[d] = int(cap_mib * MiB / total * total)

    @rule(conf=st.sampled_from(ALLOC_SETTINGS))
    def allocator_settings(self, conf):
        M.set_allocator_settings(conf)
        assert M.get_allocator_settings() == conf

    @rule(d=st.integers(0, 1))
    def reset_peaks(self, d):
        d = self.dev(d)
        M.reset_peak_memory_stats(d)
        stats = M.memory_stats(d)
        for key, value in stats.items():
            if key.endswith(".current"):
                peak = key[:-len("current")] + "peak"
                if peak in stats:
                    assert stats[peak] == value, (key, value, stats[peak])

    @precondition(lambda self: not self.asyncpool)
    @rule(target=pools, d=st.integers(0, 1))
    def new_pool(self, d):
        d = self.dev(d)
        with accel.device_index(d):
            pool = accel.MemPool()
        assert pool.device_index == d
        p = Pool(pool, d)
        self.mempools.append(p)
        self.records.append(p)
        return p

    @rule(p=pools)
    def enter_pool(self, p):
        cm = M.use_mem_pool(p.obj, p.dev)
        if any(k == "pool" and what is p for k, _cm, _s, what in self.ctx):
            # torch's beginAllocateToPool: one route per pool at a time
            with pytest.raises(RuntimeError, match="already recording"):
                cm.__enter__()
            return
        cm.__enter__()
        self.ctx.append(("pool", cm, None, p))

    # -- graphs ----------------------------------------------------------------------------
    def new_graph(self, d):
        d = self.dev(d)
        with accel.device_index(d):
            g = Gr(accel.Graph(), d)
        self.grs.append(g)
        self.records.append(g)
        return g

    @precondition(lambda self: self.graphs_ok)
    @rule(target=graphs, dst=buffers, src=st.none() | buffers, value=st.integers(0, 255), s=st.none() | streams)
    def capture(self, dst, src, value, s):
        """Capture dst.fill_ (and a copy from src) on a side stream into a reset graph of dst's
        device (a new one when none is)."""
        if dst.closed:
            return multiple()
        g = next((g for g in self.grs if g.dev == dst.dev and g.ops is None), None)
        made_graph = g is None
        if made_graph:
            g = self.new_graph(dst.dev)
        if src is not None and (src.closed or src.dev != g.dev or src.nbytes != dst.nbytes or src is dst):
            src = None
        side = s.obj if s is not None and not s.closed and not s.default and s.dev == g.dev else None
        made = side is None
        if made:
            side = accel.Stream(g.dev)
        side.wait_stream(accel.current_stream(g.dev))
        try:
            with side, g.obj:
                dst.obj.fill_(value)
                if src is not None:
                    dst.obj.copy_from(src.obj, non_blocking=True)
        except accel.OutOfMemoryError:
            # the generator's graph-safe holders are allocated as the capture begins: under a cap
            assert self.caps[g.dev] is not None, "a capture ran out of memory without a memory fraction"
            return g if made_graph else multiple()
        finally:
            if made:
                side.close()
        g.ops = [("fill", dst, value)] + ([("copy", dst, src)] if src is not None else [])
        return g if made_graph else multiple()

    @rule(g=graphs)
    def replay(self, g):
        if g.ops is None or g.stale:
            return
        g.obj.replay()
        for op in g.ops:
            if op[0] == "fill":
                op[1].set(slice(None), op[2])
            else:
                op[1].data[:] = op[2].data
                op[1].known[:] = op[2].known

    @rule(g=graphs)
    def reset_graph(self, g):
        g.obj.reset()
        g.ops = None

    # -- RNG -------------------------------------------------------------------------------
    @rule(seed=st.integers(0, 2**64 - 1))
    def manual_seed(self, seed):
        R.manual_seed(seed)
        self.rng[self.cur_dev] = (seed, 0)

    @rule(target=states, d=st.integers(0, 1))
    def get_state(self, d):
        d = self.dev(d)
        return R.get_rng_state(d).copy()

    @rule(state=states, d=st.integers(0, 1))
    def set_state(self, state, d):
        d = self.dev(d)
        R.set_rng_state(state, d)
        self.rng[d] = (int.from_bytes(state[:8].tobytes(), "little"), int.from_bytes(state[8:].tobytes(), "little"))

    @rule(b=buffers, f64=st.booleans(), low=st.sampled_from([0.0, -2.0, 10.0]))
    def uniform(self, b, f64, low):
        dtype = "float64" if f64 else "float32"
        size = 8 if f64 else 4
        if b.closed or b.nbytes % size or b.nbytes > 2 * MiB:
            return      # (a closed buffer: test_uniform_on_a_closed_buffer_is_refused_first)
        from accel.random import _fills
        plan = _fills.plan_uniform(b.nbytes, dtype, low, low + 3.0)
        seed, offset = self.rng[b.dev]
        R.uniform_(b.obj, dtype, low, low + 3.0)
        expected = np.ascontiguousarray(plan.host(seed, offset)).view(np.uint8)
        b.set(slice(None), expected)
        self.rng[b.dev] = (seed, offset + _philox_words_rounded(plan.words))

    # -- refusals --------------------------------------------------------------------------
    def _refused(self, fn):
        before = light_fingerprint(self.n)
        with pytest.raises(RuntimeError, match="closed"):
            fn()
        after = light_fingerprint(self.n)
        assert before == after, [k for k in before if before[k] != after[k]]

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def check(self):
        for d in range(self.n):
            accel.synchronize(d)
        for b in self.bufs:
            if b.closed:
                continue
            got = b.obj.to_numpy()
            k = b.known
            if not (got[k] == b.data[k]).all():
                bad = np.flatnonzero((got != b.data) & k)
                raise AssertionError(f"{b}: {bad.size} bytes differ from the model, first at {bad[0]}: "
                                     f"got {got[bad[0]]}, want {b.data[bad[0]]}")
        assert accel.current_device_index() == self.cur_dev
        for d in range(self.n):
            assert accel.current_stream(d) is self.cur_stream[d].obj or accel.current_stream(d) == self.cur_stream[d].obj, \
                (d, accel.current_stream(d), self.cur_stream[d])
            s = R.get_rng_state(d)
            assert (int.from_bytes(s[:8].tobytes(), "little"), int.from_bytes(s[8:].tobytes(), "little")) == self.rng[d]
        snap = M.memory_snapshot()
        expected = expected_memory_stats(snap)
        for d in range(self.n):
            stats = M.memory_stats(d)
            live = [b for b in self.bufs if not b.closed and b.dev == d]
            # each captured graph of the device holds its default generator's graph-safe seed and
            # offset (two 8-byte holders of its own, torch 2.13's per-capture state), allocated as
            # the capture begins, freed with the graph
            holders = 2 * sum(g.ops is not None and g.dev == d for g in self.grs)
            if self.asyncpool:
                assert not [s for s in snap if s["device"] == d]
                assert stats["allocation.all.current"] == len(live) + holders
                assert stats["requested_bytes.all.current"] == sum(b.nbytes for b in live) + 8 * holders
                continue
            for key, value in expected[d].items():
                assert stats[key] == value, (d, key, stats[key], value)
            for key in ("allocated_bytes.all.current", "reserved_bytes.all.current", "active_bytes.all.current",
                        "segment.all.current", "allocation.all.current"):
                assert stats[key] == expected[d].get(key, 0), (d, key, stats[key], expected[d].get(key, 0))
            active = {blk["address"]: blk["size"] for s in snap if s["device"] == d for blk in s["blocks"]
                      if blk["state"] == "active_allocated"}
            ptrs = {b.obj.ptr: b for b in live}
            extra = set(active) - set(ptrs)
            assert len(extra) == holders and all(active[p] == 512 for p in extra), \
                (d, holders, sorted(extra), sorted(set(ptrs) - set(active)))
            assert set(ptrs) <= set(active), (d, sorted(set(ptrs) - set(active)))
            for ptr, b in ptrs.items():
                assert active[ptr] >= b.nbytes
            assert stats["allocated_bytes.all.current"] == sum(active.values())
            assert M.memory_allocated(d) == sum(active.values())
            assert sum(active[p] for p in ptrs) == sum(active.values()) - 512 * holders
        self.pinned.clear()

    def teardown(self):
        while self.ctx:
            kind_, cm, _saved, _what = self.ctx.pop()
            cm.__exit__(None, None, None)
        for b in self.bufs:
            b.obj.close()
        for s in self.strs:
            s.obj.close()
        for e in self.evs:
            e.obj.close()
        for g in self.grs:
            g.obj.reset()
        for d in range(self.n):
            M.set_per_process_memory_fraction(1.0, d)
        for rec in self.records:
            rec.obj = None
        self.bufs = self.strs = self.evs = self.grs = self.mempools = self.pinned = self.records = None
        self.defaults = self.cur_stream = self.ctx = None
        settle(self.n)
        for d in range(self.n):
            assert M.memory_allocated(d) == 0, d
            assert M.memory_reserved(d) == 0, (d, M.memory_reserved(d))
        assert live_handles(self.kind) == self.base_handles
        assert open_objects(self.base_weak) == self.base_objects


@pytest.mark.parametrize("config", list(CONFIGS))
def test_api_state_machine(monkeypatch, config):
    machine = type(f"APIMachine_{config.replace('-', '_')}", (APIMachine,),
                   {"config": config, "monkeypatch": monkeypatch})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        run_state_machine_as_test(machine, settings=SETTINGS)


# -- deterministic reproductions of what the machine found --------------------------------------
def test_uniform_on_a_closed_buffer_is_refused_first(sim_backend):
    """uniform_ on a closed Buffer raises its 'was closed' RuntimeError and changes nothing, as
    fill_ does, whatever the buffer's size (found by the state machine: a refused uniform_ of a
    closed buffer loaded the RNG module; a 3-byte one was a ValueError about float32)."""
    n = accel.device_count()
    accel.Buffer(16).close()
    problems = []
    for nbytes in (64, 3):
        b = accel.Buffer(nbytes)
        b.close()
        before = light_fingerprint(n)
        try:
            R.uniform_(b)
            problems.append(f"{nbytes} B: accepted")
        except RuntimeError as exc:
            if "closed" not in str(exc):
                problems.append(f"{nbytes} B: {exc}")
        except Exception as exc:
            problems.append(f"{nbytes} B: {type(exc).__name__}: {exc}")
        after = light_fingerprint(n)
        if before != after:
            problems.append(f"{nbytes} B: state changed: {[k for k in before if before[k] != after[k]]}")
    assert not problems, problems


def test_elapsed_time_to_a_closed_unrecorded_event(sim_backend):
    """elapsed_time with a closed end event names it as closed (found by the state machine: a
    closed, never-recorded end event gave 'Both events must be recorded')."""
    start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    start.record()
    end.close()
    with pytest.raises(RuntimeError, match="closed"):
        start.elapsed_time(end)
