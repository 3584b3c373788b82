"""r77a: backend parity.  The same small user programs, through the public API only, on the
simulated CUDA (libcudart), XPU (Level Zero) and MPS (Metal) runtimes, on both devices where the
backend has two (Metal has one: documented, REFERENCE.md "One device, unified memory").

Each program is run in-process: ``use_sim`` (tests/conftest.py) switches the backend with a fresh
runtime, so one test can run a program on all three and compare what a user sees: data, memory
statistics after the program, error types and messages, state after a refused call, the
non-current device, stream/event semantics, RNG numbers and state, graphs.

Differences asserted as documented (plain tests): Metal has no stream capture (accel's
NotImplementedError; torch.mps has no graphs); Metal has one device; stream priority ranges
(CUDA [-5, 0], torch.xpu "mapped to the nearest valid priority" [-1, 1], Metal none: 0); random
fills inside a capture on Level Zero without SPIR-V Philox kernels are refused (DESIGN.md, RNG:
"Level Zero through SPIR-V or the host path", the host path is not capturable); the OOM message
names the backend as torch's ("CUDA out of memory", "XPU ...", "MPS ..."); a capture that forks onto a
side stream and joins back is refused on Level Zero (accel/backends/xpu/graphs.py: no events inside a
capture); the default allocator policy (README "Where accel deliberately differs": expandable segments
on CUDA and Level Zero put requests of at most 1 MiB in the large pool, Metal's classic segments in the
small pool), while under one explicit policy all three give the same allocator trace.

No undocumented difference was found in r77a (no xfails): every program below gives the same
results, statistics, error types and unchanged state after refusals on all three backends.
"""

import gc

import numpy as np
import pytest

import accel
from accel import memory
from accel import random as rnd

from conftest import SIMS, use_sim

DEFAULT_SEED = 67280421310721          # torch's default_rng_seed_val
DLPACK_CODE = {"cuda": 2, "xpu": 14, "mps": 8}     # kDLCUDA, kDLOneAPI, kDLMetal
OOM_NAME = {"cuda": "CUDA", "xpu": "XPU", "mps": "MPS"}


def _devices():
    return range(accel.device_count())


def _stats(d):
    return memory.memory_allocated(d), memory.memory_reserved(d)


def _refusal(fn):
    try:
        fn()
    except Exception as exc:        # noqa: BLE001 - the type is what is compared
        return type(exc).__name__, str(exc)
    return None


# == data and memory statistics ==================================================================
def test_fill_copy_views_and_memory_back_to_baseline_on_each_device(sim_backend):
    """A program on every device, each time while device 0 stays current: fill, copy between
    buffers and through typed views, read back; after closing, allocated is back at its baseline
    with the segment still cached (reserved), and empty_cache returns reserved to the baseline."""
    assert accel.device_count() == (1 if sim_backend == "mps" else 2)
    for d in _devices():
        base = _stats(d)
        a = accel.Buffer(4096, device=d).fill_(3)
        b = accel.Buffer(4096, device=d)
        b.copy_from(a)
        view = b.as_array("f4")
        view.copy_from(np.arange(1024, dtype=np.float32))
        assert (a.to_numpy() == 3).all()
        assert (b.to_numpy("f4") == np.arange(1024, dtype=np.float32)).all()
        assert a.device == accel.device(sim_backend, d) == b.device
        assert memory.memory_allocated(d) - base[0] == 8192
        assert accel.current_device_index() == 0
        del view
        a.close()
        b.close()
        assert memory.memory_allocated(d) == base[0]
        assert memory.memory_reserved(d) > base[1] or base[1] > 0     # cached, not returned
        memory.empty_cache()
        assert _stats(d) == base
        assert memory.max_memory_allocated(d) >= base[0] + 8192


def test_same_program_same_bytes_and_stats_on_every_backend(monkeypatch):
    """One program, run on each simulator in turn in this process: the user sees the same
    data, the same allocated/peak numbers and the same RNG output on every backend and device."""
    seen = {}
    for kind in SIMS:
        use_sim(monkeypatch, kind)
        out = []
        for d in _devices():
            with accel.device_index(d):
                rnd.manual_seed(1234)
                memory.reset_peak_memory_stats(d)
                buf = accel.Buffer(256, device=d)
                rnd.uniform_(buf)
                u = buf.to_numpy("f4").copy()
                rnd.randint_(buf, 0, 100)
                i = buf.to_numpy("i8").copy()
                tmp = accel.Buffer(1000).fill_(7)
                out.append((u.tobytes(), i.tobytes(), memory.memory_allocated(d), memory.max_memory_allocated(d),
                            tmp.to_numpy().sum(), rnd.get_rng_state(d).tobytes()))
                tmp.close()
                buf.close()
        seen[kind] = out
    first = seen[SIMS[0]][0]
    for kind, out in seen.items():
        for per_device in out:
            assert per_device == first, f"{kind} differs from {SIMS[0]}:0"


def test_non_current_device_stats_are_its_own(sim_backend):
    """Work on the last device while device 0 is current touches only that device's numbers;
    reset_peak_memory_stats(d) resets only d."""
    last = accel.device_count() - 1
    other = [d for d in _devices() if d != last]
    before = {d: (memory.memory_allocated(d), memory.max_memory_allocated(d)) for d in other}
    base = memory.memory_allocated(last)
    buf = accel.Buffer(1 << 20, device=last).fill_(1)
    assert memory.memory_allocated(last) == base + (1 << 20)
    assert accel.current_device_index() == 0
    assert {d: (memory.memory_allocated(d), memory.max_memory_allocated(d)) for d in other} == before
    buf.close()
    memory.reset_peak_memory_stats(last)
    assert memory.max_memory_allocated(last) == base
    assert {d: (memory.memory_allocated(d), memory.max_memory_allocated(d)) for d in other} == before
    accel.synchronize(last)
    assert accel.current_device_index() == 0


def test_metal_has_one_device_and_refuses_index_1_naming_it(sim_backend):
    """Documented: Metal has one device.  Every way to name device 1 on mps is an
    InvalidDeviceError naming the index and the count; elsewhere device 1 works."""
    calls = [lambda: accel.Buffer(16, device=1), lambda: accel.Stream(device=1), lambda: accel.set_device_index(1),
             lambda: memory.memory_allocated(1), lambda: rnd.get_rng_state(1), lambda: accel.synchronize(1)]
    for call in calls:
        got = _refusal(call)
        if sim_backend == "mps":
            assert got is not None and got[0] == "InvalidDeviceError" and "1" in got[1] and "1 mps device" in got[1]
        else:
            assert got is None
        accel.set_device_index(0)
    assert accel.current_device_index() == 0


# == refusals: type, message, nothing changed ====================================================
def test_refusals_have_one_type_name_the_value_and_change_nothing(monkeypatch):
    """The same bad calls on every backend: the same exception type, a message naming the bad
    value, and the buffer, current device and allocator statistics as they were."""
    seen = {}
    for kind in SIMS:
        use_sim(monkeypatch, kind)
        buf = accel.Buffer(64).fill_(1)
        base = _stats(0)
        bad = [("nbytes", lambda: accel.Buffer(-1), "-1"),
               ("copy size", lambda: buf.copy_from(np.zeros(128, np.uint8)), "128"),
               ("fill", lambda: buf.fill_(300), "300"),
               ("view", lambda: buf.as_array("f8", shape=(100,)), "(100,)"),
               ("device", lambda: accel.set_device_index(5), "5"),
               ("stream device", lambda: accel.Stream(device=7), "7"),
               ("stats device", lambda: memory.memory_allocated(5), "5"),
               ("fraction", lambda: memory.set_per_process_memory_fraction(1.5), "1.5"),
               ("fraction type", lambda: memory.set_per_process_memory_fraction("x"), "'x'"),
               ("rng size", lambda: rnd.set_rng_state(np.zeros(3, np.uint8)), "3"),
               ("rng dtype", lambda: rnd.set_rng_state(np.zeros(16, np.float32)), "float32"),
               ("uniform range", lambda: rnd.uniform_(buf, low=1.0, high=0.0), "low=1.0"),
               ("randint range", lambda: rnd.randint_(buf, 5, 5), "low=5"),
               ("dtype", lambda: rnd.uniform_(buf, dtype="float16"), "float16")]
        rng = rnd.get_rng_state().copy()
        types = {}
        for name, call, value in bad:
            got = _refusal(call)
            assert got is not None, f"{kind}: {name} accepted"
            assert value in got[1], f"{kind}: {name}: {got}"
            types[name] = got[0]
        assert (buf.to_numpy() == 1).all()
        assert accel.current_device_index() == 0
        assert _stats(0) == base
        assert (rnd.get_rng_state() == rng).all()
        assert memory.get_per_process_memory_fraction() == 1.0
        seen[kind] = types
        buf.close()
    assert all(types == seen[SIMS[0]] for types in seen.values()), seen


def test_closed_objects_refuse_alike(sim_backend):
    d = accel.device_count() - 1
    s = accel.Stream(device=d)
    e = accel.Event()
    b = accel.Buffer(16, device=d)
    for obj in (s, e, b):
        obj.close()
    for call, word in ((s.query, "Stream"), (s.synchronize, "Stream"), (e.query, "Event"), (e.record, "Event"),
                       (b.to_numpy, "Buffer"), (lambda: b.fill_(1), "Buffer")):
        got = _refusal(call)
        assert got is not None and got[0] == "RuntimeError" and "was closed" in got[1] and word in got[1]


def test_oom_under_a_fraction_on_the_last_device(sim_backend):
    """set_per_process_memory_fraction on the last device: a request past it raises
    OutOfMemoryError naming the backend as torch does and the device; nothing stays allocated,
    num_ooms counts it, other devices keep their fraction, and a refused fraction keeps the cap."""
    d = accel.device_count() - 1
    base = _stats(d)
    memory.set_per_process_memory_fraction(0.25, d)
    with pytest.raises(accel.OutOfMemoryError) as info:
        accel.Buffer(3 << 30, device=d)
    assert isinstance(info.value, RuntimeError)
    assert f"{OOM_NAME[sim_backend]} out of memory" in str(info.value) and f"GPU {d}" in str(info.value)
    assert memory.memory_allocated(d) == base[0]
    assert memory.memory_stats(d)["num_ooms"] == 1
    for other in _devices():
        if other != d:
            assert memory.get_per_process_memory_fraction(other) == 1.0
    with pytest.raises(ValueError, match="-0.1"):
        memory.set_per_process_memory_fraction(-0.1, d)
    assert memory.get_per_process_memory_fraction(d) == 0.25
    ok = accel.Buffer(1 << 20, device=d)        # below the cap: still works
    ok.close()
    memory.set_per_process_memory_fraction(1.0, d)
    memory.empty_cache()
    assert _stats(d) == base


# == streams and events ==========================================================================
def test_stream_event_query_synchronize_elapsed_time_on_each_device(sim_backend, monkeypatch):
    use_sim(monkeypatch, sim_backend, ACCEL_SIM_DELAY_US=300)
    for d in _devices():
        s = accel.Stream(device=d)
        start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
        unrecorded = accel.Event()
        # an unrecorded event: complete, and waiting on it is a no-op (torch)
        assert unrecorded.query() is True
        assert unrecorded.synchronize() is None and s.wait_event(unrecorded) is None
        buf = accel.Buffer(1 << 20, device=d)
        start.record(s)
        with s:
            for v in range(1, 4):
                buf.fill_(v)
        end.record(s)
        assert isinstance(s.query(), bool) and isinstance(end.query(), bool)
        s.synchronize()
        assert s.query() is True and end.query() is True and start.query() is True
        assert (buf.to_numpy() == 3).all()
        ms = start.elapsed_time(end)
        assert type(ms) is float and ms >= 0.0
        assert start.device == accel.device(sim_backend, d)
        assert accel.current_device_index() == 0
        assert accel.current_stream(d) == accel.default_stream(d)       # `with s` restored it
        with pytest.raises(ValueError, match="enable_timing=True"):
            accel.Event().elapsed_time(end)
        with pytest.raises(ValueError, match="recorded"):
            accel.Event(enable_timing=True).elapsed_time(end)
        buf.close()


@pytest.mark.parametrize("kind", [s for s in SIMS if s != "mps"])
def test_events_of_two_devices(monkeypatch, kind):
    """Recording an event of device 1 on a device-0 stream, or timing across devices, is an
    InvalidDeviceError (cudaEventRecord / cudaEventElapsedTime rules) with the event unchanged;
    waiting across devices is fine; the current device never moves."""
    use_sim(monkeypatch, kind)
    s0, s1 = accel.Stream(device=0), accel.Stream(device=1)
    e1 = accel.Event(enable_timing=True)
    b1 = accel.Buffer(256, device=1)
    with s1:
        b1.fill_(2)
    e1.record(s1)
    assert e1.device == accel.device(kind, 1) and accel.current_device_index() == 0
    with pytest.raises(accel.InvalidDeviceError, match="device 1.*device 0"):
        e1.record(s0)
    assert e1.device == accel.device(kind, 1)
    e0 = accel.Event(enable_timing=True)
    e0.record(s0)
    e1.synchronize()
    with pytest.raises(accel.InvalidDeviceError, match="device 1.*device 0"):
        e1.elapsed_time(e0)
    s0.wait_event(e1)
    b0 = accel.Buffer(256, device=0)
    b0.copy_from(b1, stream=s0)
    s0.synchronize()
    assert (b0.to_numpy() == 2).all()
    assert accel.current_device_index() == 0


def test_stream_priorities_follow_each_backends_documented_range(sim_backend):
    """Documented difference: CUDA clamps into [-5, 0] (torch.cuda priority_range), torch.xpu
    maps to "the nearest valid priority" of [-1, 1], Metal queues have no priority (0)."""
    expected = {"cuda": (0, -5), "xpu": (1, -1), "mps": (0, 0)}[sim_backend]
    assert accel.Stream.priority_range() == expected
    low, high = expected
    for asked in (-10, -1, 0, 1, 5):
        for d in _devices():
            assert accel.Stream(device=d, priority=asked).priority == min(max(asked, high), low)


# == RNG =========================================================================================
def test_rng_state_round_trips_per_device(sim_backend):
    """manual_seed seeds the current device only (torch); get/set_rng_state round trips on each
    device; a Generator of the last device round trips; refused states change nothing."""
    rnd.manual_seed(7)
    for d in _devices():
        assert rnd.get_rng_state(d)[:8].view(np.uint64)[0] == (7 if d == 0 else DEFAULT_SEED)
        state = rnd.get_rng_state(d).copy()
        buf = accel.Buffer(64, device=d)
        with accel.device_index(d):
            rnd.normal_(buf)
            x = buf.to_numpy("f4").copy()
            assert rnd.get_rng_state(d)[8:].view(np.uint64)[0] > state[8:].view(np.uint64)[0]
            rnd.set_rng_state(state)
            rnd.normal_(buf)
        assert (buf.to_numpy("f4") == x).all()
        after = rnd.get_rng_state(d).copy()
        for bad in (np.zeros(5, np.uint8), [1] * 16, np.zeros(16, np.float32)):
            with pytest.raises((RuntimeError, TypeError)):
                rnd.set_rng_state(bad, d)
            assert (rnd.get_rng_state(d) == after).all()
    assert len(rnd.get_rng_state_all()) == accel.device_count()
    last = accel.device_count() - 1
    gen = rnd.Generator(device=last, seed=11)
    st = gen.get_state()
    out = accel.Buffer(64, device=last)
    rnd.uniform_(out, generator=gen)
    first = out.to_numpy("f4").copy()
    gen.set_state(st)
    rnd.uniform_(out, generator=gen)
    assert (out.to_numpy("f4") == first).all() and gen.initial_seed() == 11
    with pytest.raises(RuntimeError, match="got 3"):
        gen.set_state(st[:3])
    assert gen.get_offset() == 16


# == graphs ======================================================================================
def test_graph_capture_and_replay_on_each_device(sim_graph_backend):
    """Capture on a stream of each device while device 0 is current: the body runs with the
    stream's device current, the capture's memory comes back after reset + empty_cache, an
    exception in the body ends the capture cleanly."""
    for d in _devices():
        s = accel.Stream(device=d)
        out = accel.Buffer(1024, device=d)
        base = _stats(d)
        g = accel.Graph()
        with accel.graph(g, stream=s):
            assert accel.current_device_index() == d and accel.is_current_stream_capturing()
            tmp = accel.Buffer(1024, device=d)
            tmp.fill_(3)
            out.copy_from(tmp)
        assert accel.current_device_index() == 0 and not accel.is_current_stream_capturing()
        out.fill_(0)
        g.replay()
        accel.synchronize(d)
        assert (out.to_numpy() == 3).all()
        with pytest.raises(KeyError):
            with accel.graph(accel.Graph(), stream=s):
                raise KeyError("boom")
        assert not s.is_capturing() and accel.current_stream(d) == accel.default_stream(d)
        del tmp
        g.reset()
        del g
        gc.collect()
        memory.empty_cache()
        assert _stats(d) == base


def test_metal_refuses_capture_cleanly_and_changes_nothing(monkeypatch):
    """Documented: Metal has no stream capture.  Every way in is a NotImplementedError naming
    mps; no capture is left underway, the current stream and the memory statistics are as before,
    the eager path still works."""
    use_sim(monkeypatch, "mps")
    s = accel.Stream()
    buf = accel.Buffer(256).fill_(5)
    base = _stats(0)
    g = accel.Graph()
    with pytest.raises(NotImplementedError, match="MPS has no stream capture"):
        with accel.graph(g, stream=s):
            buf.fill_(9)
    with pytest.raises(NotImplementedError, match="MPS has no stream capture"):
        g.capture_begin()
    with pytest.raises(RuntimeError, match="no capture"):
        g.replay()
    assert not accel.is_current_stream_capturing() and not s.is_capturing()
    assert accel.current_stream() == accel.default_stream()
    assert (buf.to_numpy() == 5).all()
    assert _stats(0) == base
    g.reset()
    buf.fill_(9)
    assert (buf.to_numpy() == 9).all()


def test_random_fill_in_a_capture_cuda_replays_xpu_refuses_cleanly(sim_graph_backend):
    """Documented difference (DESIGN.md RNG): CUDA captures Philox fills (replays draw new
    numbers, the offset advances); Level Zero without SPIR-V kernels uses the host path, which is
    not capturable: a CaptureError naming xpu, with the RNG state, the buffer, the capture state
    and the graph (reusable) all unchanged, and the memory back after empty_cache."""
    d = accel.device_count() - 1
    rnd.manual_seed_all(5)
    s = accel.Stream(device=d)
    g = accel.Graph()
    buf = accel.Buffer(64, device=d).fill_(9)
    base = _stats(d)
    state = rnd.get_rng_state(d).copy()
    with accel.device_index(d):
        if sim_graph_backend == "cuda":
            with accel.graph(g, stream=s):
                rnd.uniform_(buf)
            outs = []
            for _ in range(2):
                g.replay()
                s.synchronize()
                outs.append(buf.to_numpy("f4").copy())
            assert (outs[0] != outs[1]).any()
            assert rnd.get_rng_state(d)[8:].view(np.uint64)[0] > state[8:].view(np.uint64)[0]
            return
        with pytest.raises(accel.CaptureError, match="cannot be captured on xpu"):
            with accel.graph(g, stream=s):
                rnd.uniform_(buf)
    assert (rnd.get_rng_state(d) == state).all()
    assert (buf.to_numpy() == 9).all()
    assert not accel.is_current_stream_capturing() and not s.is_capturing()
    assert accel.current_device_index() == 0
    memory.empty_cache()
    assert _stats(d) == base
    with accel.graph(g, stream=s):
        buf.fill_(4)
    buf.fill_(0)
    g.replay()
    s.synchronize()
    assert (buf.to_numpy() == 4).all()


# == host memory and interop =====================================================================
def test_pinned_round_trip_non_blocking_on_each_device(sim_backend):
    for d in _devices():
        host = accel.empty_pinned(256, "f4")
        host[:] = np.arange(256)
        s = accel.Stream(device=d)
        dev = accel.Buffer(1024, device=d)
        dev.copy_from(host, stream=s, non_blocking=True)
        back = accel.empty_pinned(256, "f4")
        dev.copy_to(back, stream=s, non_blocking=True)
        s.synchronize()
        assert (back == host).all()
        assert accel.current_device_index() == 0
        del host, back
        dev.close()
    gc.collect()
    memory.empty_host_cache()
    stats = memory.host_memory_stats()
    assert stats["allocated_bytes.current"] == 0 and stats["allocations.current"] == 0


def test_dlpack_device_codes_and_shared_bytes_on_each_device(sim_backend):
    for d in _devices():
        buf = accel.Buffer(64, device=d).fill_(4)
        view = buf.as_array("f4")
        assert tuple(view.__dlpack_device__()) == (DLPACK_CODE[sim_backend], d)
        alias = accel.from_dlpack(view)
        assert alias.device == accel.device(sim_backend, d) and not alias.owns_memory
        buf.fill_(6)
        assert (alias.to_numpy() == 6).all()
        assert (np.from_dlpack(view, device="cpu").view(np.uint8) == 6).all()     # copy=None copies (r80b)
        host = np.from_dlpack(view, device="cpu", copy=True)
        assert (host.view(np.uint8) == 6).all()
        del alias, view, host
        gc.collect()


def test_mempool_on_the_last_device(sim_backend):
    d = accel.device_count() - 1
    base = _stats(d)
    with accel.device_index(d):
        pool = memory.MemPool()
    assert pool.device_index == d
    with memory.use_mem_pool(pool, device=d):
        b = accel.Buffer(1000, device=d)
    assert pool.use_count() >= 1 and memory.memory_allocated(d) == base[0] + 1024
    if accel.device_count() > 1:
        with pytest.raises(ValueError, match="device 0"):
            with memory.use_mem_pool(memory.MemPool(), device=d):
                pass
    b.close()
    del b, pool
    gc.collect()
    memory.empty_cache()
    assert _stats(d) == base


# == allocator policy: the documented difference, and parity under one policy ====================
def test_default_allocator_pools_are_the_documented_difference(sim_backend, monkeypatch):
    """README "Where accel deliberately differs": expandable segments by default where the
    backend has virtual memory (CUDA, Level Zero), so a request of at most 1 MiB lands in the
    large pool; Metal gets classic segments, where it lands in the small pool (as torch)."""
    for name in ("ACCEL_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)         # the default policy (an ACCEL_TEST_ALLOC_CONF rerun)
    use_sim(monkeypatch, sim_backend)
    d = accel.device_count() - 1
    small = accel.Buffer(3000, device=d)
    big = accel.Buffer((1 << 20) + 1, device=d)
    st = memory.memory_stats(d)
    small_pool = st["allocated_bytes.small_pool.current"]
    large_pool = st["allocated_bytes.large_pool.current"]
    if sim_backend == "mps":
        assert (small_pool, large_pool) == (3072, 1049088)
        assert st["segment.all.current"] == 2
    else:
        assert (small_pool, large_pool) == (0, 3072 + 1049088)
    small.close()
    big.close()
    memory.empty_cache()
    assert _stats(d) == (0, 0)


@pytest.mark.parametrize("conf", ["expandable_segments:False", "policy:torch"])
def test_one_policy_gives_the_same_allocator_trace_on_every_backend(monkeypatch, conf):
    """Under one allocator policy the same churn (sizes from 100 B to 12 MiB, frees in between)
    on the last device gives identical (allocated, reserved) after every step, the same peaks and
    segment counts on all three backends, and everything back after empty_cache."""
    import random
    traces = {}
    for kind in SIMS:
        use_sim(monkeypatch, kind, ACCEL_ALLOC_CONF=conf)
        d = accel.device_count() - 1
        pick = random.Random(3)
        live, trace = [], []
        for _ in range(80):
            if live and pick.random() < 0.45:
                live.pop(pick.randrange(len(live))).close()
            else:
                live.append(accel.Buffer(pick.choice([100, 5000, 700000, 1 << 20, 3 << 20, 12 << 20]), device=d))
            trace.append(_stats(d))
        st = memory.memory_stats(d)
        trace.append((st["segment.all.peak"], st["reserved_bytes.all.peak"], st["num_alloc_retries"]))
        for b in live:
            b.close()
        memory.empty_cache()
        assert _stats(d) == (0, 0)
        traces[kind] = trace
    first = traces[SIMS[0]]
    assert all(t == first for t in traces.values()), {k: t[-1] for k, t in traces.items()}


# == more of what a user sees on the non-current device ==========================================
def test_fills_without_generator_draw_from_the_buffers_device(sim_backend):
    """A random fill of a buffer on the last device while device 0 is current advances that
    device's default generator (torch: the tensor's device), never device 0's; the same numbers
    as seeding that device and filling with it current."""
    rnd.manual_seed_all(1)
    last = accel.device_count() - 1
    others = {d: rnd.get_rng_state(d).copy() for d in _devices() if d != last}
    before = rnd.get_rng_state(last).copy()
    buf = accel.Buffer(64, device=last)
    rnd.uniform_(buf)
    got = buf.to_numpy("f4").copy()
    assert accel.current_device_index() == 0
    assert all((rnd.get_rng_state(d) == st).all() for d, st in others.items())
    assert not (rnd.get_rng_state(last) == before).all()
    rnd.set_rng_state(before, last)
    with accel.device_index(last):
        rnd.uniform_(buf)
    assert (buf.to_numpy("f4") == got).all()


@pytest.mark.parametrize("kind", [s for s in SIMS if s != "mps"])
def test_stream_of_another_device_is_refused_alike(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    s1 = accel.Stream(device=1)
    b0 = accel.Buffer(16, device=0).fill_(3)
    base = _stats(0)
    for call, match in ((lambda: accel.Buffer(16, device=0, stream=s1), "device 1.*device 0"),
                        (lambda: b0.copy_from(np.zeros(16, np.uint8), stream=s1), "device 1.*device 0"),
                        (lambda: b0.to_numpy(stream=s1), "device 1.*device 0"),
                        (lambda: accel.ExternalStream(s1.handle, device=0), "belongs to device 1")):
        with pytest.raises(ValueError, match=match):
            call()
    assert (b0.to_numpy() == 3).all() and _stats(0) == base and accel.current_device_index() == 0
    wrapped = accel.ExternalStream(s1.handle)
    assert wrapped == s1 and wrapped.device == accel.device(kind, 1)


def test_async_download_returns_an_event_of_the_buffers_device(sim_backend, monkeypatch):
    use_sim(monkeypatch, sim_backend, ACCEL_SIM_DELAY_US=300)
    for d in _devices():
        s = accel.Stream(device=d)
        buf = accel.Buffer(1 << 16, device=d)
        with s:
            buf.fill_(8)
        arr, ev = buf.to_numpy(non_blocking=True, stream=s)
        assert isinstance(ev, accel.Event) and ev.device == accel.device(sim_backend, d)
        ev.synchronize()
        assert ev.query() is True and (arr == 8).all()
        ro = np.zeros(16, np.uint8)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            accel.Buffer(16, device=d).copy_to(ro)
        with pytest.raises(ValueError, match="10 bytes"):
            buf.copy_to(np.zeros(10, np.uint8))
        assert accel.current_device_index() == 0


@pytest.mark.parametrize("kind", [s for s in SIMS if s != "mps"])
def test_fork_join_capture_cuda_replays_xpu_refuses_cleanly(monkeypatch, kind):
    """A capture that forks work onto a side stream and joins it back (torch's documented
    cross-stream capture pattern).  CUDA captures and replays both branches; Level Zero refuses
    it (documented in accel/backends/xpu/graphs.py: events recorded or waited on inside a capture
    raise CaptureError), leaving no capture underway, the buffers untouched, the memory at its
    baseline and the graph reusable, on either device."""
    use_sim(monkeypatch, kind)
    for d in _devices():
        s, side = accel.Stream(device=d), accel.Stream(device=d)
        g = accel.Graph()
        b = accel.Buffer(1024, device=d).fill_(1)
        c = accel.Buffer(1024, device=d).fill_(2)
        base = _stats(d)

        def capture():
            with accel.graph(g, stream=s):
                b.fill_(5)
                side.wait_stream(s)
                with side:
                    c.fill_(6)
                s.wait_stream(side)

        if kind == "cuda":
            capture()
            assert (b.to_numpy() == 1).all() and (c.to_numpy() == 2).all()     # captured, not run
            g.replay()
            s.synchronize()
            assert (b.to_numpy() == 5).all() and (c.to_numpy() == 6).all()
            g.reset()
        else:
            with pytest.raises(accel.CaptureError, match="XPU graph capture cannot"):
                capture()
            assert (b.to_numpy() == 1).all() and (c.to_numpy() == 2).all()
            with pytest.raises(RuntimeError, match="no capture"):
                g.replay()
        assert accel.current_device_index() == 0 and not accel.is_current_stream_capturing()
        assert not s.is_capturing() and not side.is_capturing() and side.query() is True
        gc.collect()
        memory.empty_cache()
        assert _stats(d) == base
        with accel.graph(g, stream=s):
            b.fill_(7)
        b.fill_(0)
        g.replay()
        s.synchronize()
        assert (b.to_numpy() == 7).all()
        g.reset()


def test_a_device_of_another_backend_is_refused_alike_everywhere(monkeypatch):
    """Naming another accelerator's device (or cpu) to any device-taking call: ValueError naming
    the types, on every backend; wrong index types: TypeError; nothing changes the current device."""
    other = {"cuda": "xpu:0", "xpu": "mps:0", "mps": "cuda:0"}
    seen = {}
    for kind in SIMS:
        use_sim(monkeypatch, kind)
        dev = other[kind]
        calls = {"Buffer": lambda: accel.Buffer(8, device=dev), "Stream": lambda: accel.Stream(device=dev),
                 "set_device_index": lambda: accel.set_device_index(dev),
                 "synchronize": lambda: accel.synchronize(dev), "memory_allocated": lambda: memory.memory_allocated(dev),
                 "memory_stats": lambda: memory.memory_stats(dev),
                 "fraction": lambda: memory.set_per_process_memory_fraction(0.5, dev),
                 "get_memory_info": lambda: memory.get_memory_info(dev), "get_rng_state": lambda: rnd.get_rng_state(dev),
                 "Generator": lambda: rnd.Generator(device=dev), "props": lambda: accel.get_device_properties(dev),
                 "current_stream": lambda: accel.current_stream(dev), "cpu": lambda: memory.memory_allocated("cpu"),
                 "float index": lambda: memory.memory_allocated(1.0), "bool index": lambda: accel.Buffer(8, device=True)}
        row = {}
        for name, call in calls.items():
            got = _refusal(call)
            assert got is not None, f"{kind}: {name} accepted {dev}"
            row[name] = got[0]
            if got[0] == "ValueError":
                assert kind in got[1] and (dev.split(":")[0] in got[1] or "cpu" in got[1]), (kind, name, got)
        assert accel.current_device_index() == 0
        assert memory.get_per_process_memory_fraction() == 1.0
        seen[kind] = row
    assert all(row == seen[SIMS[0]] for row in seen.values()), seen
    assert set(seen[SIMS[0]].values()) == {"ValueError", "TypeError"}


def test_freed_block_in_use_on_a_side_stream_is_not_handed_out_early(sim_backend, monkeypatch):
    """A buffer written on a busy side stream and freed (with record_stream, or just used there):
    the allocator hands its bytes to no new buffer of the same size until that work is done, so
    new buffers filled on the default stream keep their values; on every backend, under both
    allocator policies."""
    for conf in ("", "expandable_segments:False"):
        use_sim(monkeypatch, sim_backend, ACCEL_SIM_DELAY_US=300, ACCEL_ALLOC_CONF=conf)
        d = accel.device_count() - 1
        s = accel.Stream(device=d)
        for n in (3000, 2 << 20):
            for record in (True, False):
                x = accel.Buffer(n, device=d)
                with s:
                    for v in range(1, 4):
                        x.fill_(v)
                if record:
                    x.record_stream(s)
                x.close()
                news = [accel.Buffer(n, device=d).fill_(77) for _ in range(2)]
                accel.synchronize(d)
                assert [int(b.to_numpy().min()) for b in news] == [77, 77], (conf, n, record)
                for b in news:
                    b.close()
        memory.empty_cache()
        assert _stats(d) == (0, 0)


@pytest.mark.parametrize("kind", [s for s in SIMS if s != "mps"])
@pytest.mark.parametrize("peer", ["all", "none"])
def test_cross_device_copies_with_and_without_peer_access(monkeypatch, kind, peer):
    """Copies between the two devices both ways (on the destination's side stream too) give the
    same bytes whether or not the devices are peers (README: staged copy without p2p), and leave
    both devices' memory at their baselines."""
    use_sim(monkeypatch, kind, ACCEL_SIM_PEER=peer)
    assert accel.can_device_access_peer(0, 1) is (peer != "none")
    base = [_stats(d) for d in (0, 1)]
    want = np.arange(1024, dtype=np.float32)
    a = accel.Buffer(4096, device=1)
    a.as_array("f4").copy_from(want)
    b = accel.Buffer(4096, device=0)
    b.copy_from(a)
    assert (b.to_numpy("f4") == want).all()
    s1 = accel.Stream(device=1)
    c = accel.Buffer(4096, device=1).fill_(0)
    c.copy_from(b, stream=s1)
    s1.synchronize()
    assert (c.to_numpy("f4") == want).all()
    assert accel.current_device_index() == 0
    for buf in (a, b, c):
        buf.close()
    memory.empty_cache()
    assert [_stats(d) for d in (0, 1)] == base


def test_oom_on_the_last_device_reaches_observers_with_its_index(sim_backend, monkeypatch):
    """A request larger than the (64 MiB) last device: every backend calls the OOM observer once
    with that device's index and the request size, counts num_ooms on that device only, and
    leaves the current device and the allocated bytes as they were."""
    use_sim(monkeypatch, sim_backend, ACCEL_SIM_MEMORY="64M")
    d = accel.device_count() - 1
    seen = []

    def observer(*args):
        seen.append(args[:2])

    memory.attach_out_of_memory_observer(observer)
    try:
        with pytest.raises(accel.OutOfMemoryError, match=f"GPU {d}"):
            accel.Buffer(100 << 20, device=d)
    finally:
        memory.detach_out_of_memory_observer(observer)
    assert seen == [(d, 100 << 20)]
    assert [memory.memory_stats(i)["num_ooms"] for i in _devices()] == [0] * d + [1]
    assert accel.current_device_index() == 0 and memory.memory_allocated(d) == 0
