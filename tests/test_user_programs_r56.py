"""Realistic user programs, fifth round (r56).

Rounds one to four (test_user_programs.py, test_user_programs2.py, test_user_programs_r41.py,
test_user_programs_r42.py) took loader rings, pipelines across devices, graphs replayed from
threads, MemPools, OOM, fork and DLPack keywords.  These combine what they did not: a pinned
pipeline feeding a user kernel on the non-current device and shut down with work queued, a
captured loop body (allocation, RNG, kernel) replayed while the other device works and then
recaptured with another shape into a shared pool, DLPack views at byte offsets across streams
and closed producers with numpy/torch as oracles, allocator settings and memory caps changed
between phases with snapshots checked mid-workload, and fork with live streams, events and
graphs.  Each program checks results against numpy, that state is bounded by live objects
afterwards, and that misuse raises a clear error and changes nothing.
"""

import gc
import queue
import threading

import numpy as np
import pytest

import accel
from conftest import SIMS, not_refused_with, run_forked, use_sim, vendor_calls_made_by
from test_user_programs import JOIN_S, _devices, allocated, join_all, live_objects, process_state, settle

MiB = 1 << 20


@pytest.fixture
def saxpy(request):
    """(image, signature) of the saxpy test kernel for the current simulator, registered."""
    from accel import sim
    from test_user_kernels import SAXPY_MSL, SAXPY_PTX, saxpy_reference, spirv_module
    sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64")

    def make(dev):
        kind = accel.current_accelerator().type          # after the test's use_sim
        image = {"cuda": SAXPY_PTX, "mps": SAXPY_MSL, "xpu": spirv_module("saxpy")}[kind]
        sig = None if kind == "cuda" else "f32, ptr, ptr, u64"
        return accel.Module(image, device=dev).function("saxpy", sig)
    yield make
    sim.unregister_kernel("saxpy")


def _host_live() -> int:
    return accel.memory.host_memory_stats()["allocated_bytes.current"]


def _baseline():
    settle()
    return live_objects(), allocated()


def _check_baseline(base) -> None:
    settle()
    assert allocated() == base[1]
    assert live_objects() == base[0]
    assert _host_live() == 0


# -- 1. pinned producer thread -> device-1 side stream -> user kernel -> pinned results ---------
@pytest.mark.parametrize("kind", SIMS)
def test_pinned_pipeline_into_a_kernel_then_shutdown_mid_flight(monkeypatch, kind, saxpy):
    """A producer thread fills pinned host arrays and copies them non_blocking to the last
    device on its own stream, recording an event per batch; the main thread (device 0 current)
    waits each event on another stream of that device, runs saxpy (y = 2 x + y) there with y
    from a fill, marks x used there (record_stream), drops it, and downloads y into pinned
    memory.  Every result equals numpy's.  Then a second run is abandoned half way: the
    producer stops, every object (streams included) is dropped while copies and kernels may be
    queued (a per-operation delay keeps them queued), and memory, host memory and vendor
    objects return to the baseline."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    dev = _devices()[-1]
    kernel = saxpy(dev)
    base = _baseline()
    state = process_state()
    n = 4096

    def run(batches, stop_after=None):
        handoff = queue.Queue(maxsize=3)
        errors, stop = [], threading.Event()
        prod = accel.Stream(dev)

        def producer():
            try:
                for b in range(batches):
                    if stop.is_set():
                        break
                    h = accel.empty_pinned(n, np.float32)
                    h[:] = np.arange(n, dtype=np.float32) + b
                    x = accel.Buffer(4 * n, device=dev, stream=prod)
                    x.copy_from(h, stream=prod, non_blocking=True)
                    ev = prod.record_event()
                    del h                        # the host block must outlive the queued copy
                    handoff.put((b, x, ev), timeout=JOIN_S)
                    del x, ev
            except BaseException as exc:         # reported below
                errors.append(exc)
            finally:
                handoff.put(None, timeout=JOIN_S)

        t = threading.Thread(target=producer, name="producer")
        t.start()
        cons = accel.Stream(dev)
        done = []
        while True:
            item = handoff.get(timeout=JOIN_S)
            if item is None:
                break
            b, x, ev = item
            del item
            cons.wait_event(ev)
            y = accel.Buffer(4 * n, device=dev, stream=cons).fill_(0, stream=cons)
            accel.launch(kernel, (n + 255) // 256, 256, np.float32(2.0), x, y, n, stream=cons)
            accel.launch(kernel, (n + 255) // 256, 256, np.float32(1.0), x, y, n, stream=cons)
            x.record_stream(cons)
            del x
            out = accel.empty_pinned(n, np.float32)
            y.copy_to(out, stream=cons, non_blocking=True)
            done.append((b, out, cons.record_event(), y))
            del y, out
            if stop_after is not None and len(done) == stop_after:
                stop.set()
                while handoff.get(timeout=JOIN_S) is not None:
                    pass
                break
        join_all([t])
        assert not errors, errors[0]
        assert accel.current_device_index() == 0
        return done, (prod, cons)

    done, streams = run(12)
    assert [b for b, *_ in done] == list(range(12))
    for b, out, ev, y in done:
        ev.synchronize()
        assert (out == 3 * (np.arange(n, dtype=np.float32) + b)).all(), (b, out[:4])
    del done, streams, out, ev, y
    assert process_state() == state
    _check_baseline(base)

    # an abandoned run: objects dropped while their work is queued
    from accel.sim import core
    core.configure(delay_us=300)
    try:
        done, streams = run(50, stop_after=4)
    finally:
        core.configure(delay_us=0)
    assert len(done) == 4
    del done, streams
    gc.collect()
    assert process_state() == state
    _check_baseline(base)


def _saxpy_np(a, x, y):
    """saxpy_reference's arithmetic: one rounding per element."""
    return (np.float64(np.float32(a)) * x.astype(np.float64) + y.astype(np.float64)).astype(np.float32)


# -- 2. a captured loop body (alloc, RNG, kernel) replayed on device 1, recaptured, shared pool --
@pytest.mark.parametrize("kind", [s for s in SIMS if s != "mps"])
def test_captured_step_replayed_beside_eager_work_then_recaptured(monkeypatch, kind, saxpy):
    """The step of a simulation captured once on the last device (device 0 stays current):
    a scratch buffer allocated inside the capture, filled with uniform noise (CUDA; Level Zero
    refuses captured fills, so a fill there), y = 2 x + noise by the user kernel, copied to an
    output.  A second graph sharing the first one's pool post-processes the output.  The pair
    is replayed many times while device 0 does eager RNG work, each replay checked against an
    eager draw at the same RNG state.  Then the first graph is reset and recaptured with twice
    the size into the same pool; misuse (replaying into a capture, reset inside a capture,
    capturing into a graph that holds one) raises and changes nothing."""
    R = accel.random
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    last = _devices()[-1]
    kernel = saxpy(last)
    base = _baseline()
    state = process_state()
    rng = kind == "cuda"
    R.manual_seed_all(11)

    def capture(n, pool):
        xs = np.arange(n, dtype=np.float32)
        x = accel.Buffer(4 * n, device=last).copy_from(xs)
        out = accel.Buffer(4 * n, device=last)
        g = accel.Graph(pool=pool)
        s = accel.Stream(last)
        with accel.graph(g, stream=s):
            assert accel.current_device_index() == last
            noise = accel.Buffer(4 * n)
            if rng:
                R.uniform_(noise)
            else:
                noise.fill_(0)
            accel.launch(kernel, (n + 255) // 256, 256, np.float32(2.0), x, noise, n)
            out.copy_from(noise, non_blocking=True)
            del noise
        assert accel.current_device_index() == 0 and not accel.is_current_stream_capturing()
        return g, x, xs, out

    def post(src, n, pool):
        res = accel.Buffer(4 * n, device=last)
        g = accel.Graph(pool=pool)
        with accel.graph(g, stream=accel.Stream(last)):
            tmp = accel.Buffer(4 * n).fill_(0)
            accel.launch(kernel, (n + 255) // 256, 256, np.float32(0.5), src, tmp, n)
            res.copy_from(tmp, non_blocking=True)
            del tmp
        return g, res

    def expected_noise(st, n):
        if not rng:
            return np.zeros(n, np.float32)
        R.set_rng_state(st, last)
        ref = accel.Buffer(4 * n, device=last)
        R.uniform_(ref)
        return ref.to_numpy(np.float32)

    pool = accel.graphs.graph_pool_handle()
    n = 1024
    g1, x, xs, out = capture(n, pool)
    g2, res = post(out, n, pool)
    assert g1.pool() == g2.pool() == pool
    eager0 = accel.Buffer(4 * 4096, device=0)
    seen = set()
    for i in range(15):
        st = R.get_rng_state(last)
        g1.replay()
        g2.replay()
        with accel.device_index(0):                       # the other device's eager work
            R.normal_(eager0)
            eager0.fill_(i)
        got, got2 = out.to_numpy(np.float32), res.to_numpy(np.float32)
        noise = expected_noise(st, n)
        want = _saxpy_np(2.0, xs, noise)
        assert (got == want).all(), i
        assert (got2 == _saxpy_np(0.5, want, np.zeros(n, np.float32))).all(), i
        assert (eager0.to_numpy() == i).all()
        seen.add(got.tobytes())
    assert len(seen) == (15 if rng else 1)                 # each replay drew new numbers

    # misuse during a capture on the last device: refused, the capture goes on
    s = accel.Stream(last)
    g3 = accel.Graph()
    before = allocated()
    with accel.graph(g3, stream=s):
        with pytest.raises(accel.CaptureError, match="inside a capture"):
            g1.replay()
        with pytest.raises(RuntimeError, match="during capture"):
            g3.reset()
        tmp = accel.Buffer(64).fill_(1)
        del tmp
    g3.replay()
    accel.synchronize(last)
    with pytest.raises(RuntimeError):
        with accel.graph(g1, stream=s):                    # g1 already holds a capture
            pass
    assert process_state() == state
    del g3
    gc.collect()
    assert allocated() == before
    g1.replay()                                            # g1 unchanged by the refusals
    accel.synchronize(last)

    # reset and recapture with another shape into the same (still shared) pool
    g1.reset()
    with pytest.raises(RuntimeError, match="no capture"):
        g1.replay()
    del x                                                  # `out` stays: g2 reads it
    g1b, x2, xs2, out2 = capture(2 * n, pool)
    del g1
    for i in range(5):
        st = R.get_rng_state(last)
        g1b.replay()
        g2.replay()                                        # its pool blocks were not given to g1b
        assert (res.to_numpy(np.float32) == _saxpy_np(0.5, out.to_numpy(np.float32), np.zeros(n, np.float32))).all()
        assert (out2.to_numpy(np.float32) == _saxpy_np(2.0, xs2, expected_noise(st, 2 * n))).all(), i
    assert process_state() == state
    del g1b, g2, x2, out2, res, out, eager0, s
    gc.collect()
    _check_baseline(base)


# -- 3. DLPack round trips: views at byte offsets, other streams, closed producers -------------
@pytest.mark.parametrize("kind", SIMS)
def test_dlpack_views_at_offsets_across_streams_and_closed_producers(monkeypatch, kind):
    """A user hands strided views at odd byte offsets of a last-device buffer to a consumer
    library (accel.from_dlpack, capsules) while the producer's writes are still queued on a
    stream that is not current (a per-operation delay keeps them queued): the consumer's stream
    sees them.  torch CPU tensors (transposed, sliced with a storage offset) go in through typed
    views and must equal numpy; the producer is closed while imports and capsules still hold
    its memory, which stays valid and is freed only after the consumer's queued writes ran (a
    new allocation on another stream must not be overwritten by them); misuse (bad dtype, shape,
    host tensors, closed streams) raises and copies nothing.  Everything returns to baseline."""
    torch = pytest.importorskip("torch")
    from accel import _dlpack
    from accel.sim import core
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    last = _devices()[-1]
    base = _baseline()
    exports = _dlpack.live_exports()
    data = np.arange(256, dtype=np.float32).reshape(16, 16)
    src = accel.Buffer(data.nbytes, device=last).copy_from(data)
    accel.synchronize(last)
    prod, cons = accel.Stream(last), accel.Stream(last)
    core.configure(delay_us=500)
    try:
        for v in (-1, -2, -3):                            # the producer's queued writes
            src.as_array(np.float32, (8, 16), offset=8 * 64).copy_from(np.full((8, 16), v, np.float32),
                                                                        stream=prod)
        want = data.copy()
        want[8:] = -3
        # rows 3, 5, 7, 9 and columns 4, 6, 8: byte offset 3 * 64 + 16, strides of two rows, two floats
        view = src.as_array(np.float32, (4, 3), strides=(128, 8), offset=3 * 64 + 16)
        imp = accel.from_dlpack(view, stream=cons)
        assert imp.device_index == last and imp.ptr == view.ptr and not imp.owns_memory
        got = imp.as_array(np.float32, (4, 3), strides=(128, 8)).to_numpy(stream=cons)
        assert (got == want[3:11:2, 4:10:2]).all(), got
        # a capsule asked for a consumer stream, consumed later
        src.fill_(0, stream=prod)
        src.as_array(np.float32, (16, 16)).copy_from(data * 2, stream=prod)
        cap = view.__dlpack__(stream=cons, max_version=(1, 0))
        again = accel.from_dlpack(cap)
        assert (again.as_array(np.float32, (4, 3), strides=(128, 8)).to_numpy(stream=cons)
                == 2 * data[3:11:2, 4:10:2]).all()
    finally:
        core.configure(delay_us=0)
    # torch CPU tensors in through typed views of the import (the oracle: numpy of the tensor)
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4) * 10
    typed = imp.as_array(np.float32, (4, 3), strides=(128, 8))
    typed.copy_from(t.T)
    assert (view.to_numpy() == t.T.numpy()).all()
    sliced = torch.arange(40, dtype=torch.float32).reshape(4, 10)[:, 5:8]
    assert sliced.storage_offset() == 5
    typed.copy_from(sliced)
    assert (view.to_numpy() == sliced.numpy()).all()
    whole = src.to_numpy(np.float32).reshape(16, 16)
    keep = 2 * data
    keep[3:11:2, 4:10:2] = sliced.numpy()
    assert (whole == keep).all()                           # the gaps between elements untouched
    before = view.to_numpy()
    for bad, exc, text in ((t.T.double(), TypeError, "dtype"), (t.reshape(2, 6), ValueError, "shape"),
                           (torch.ones(4, 3, dtype=torch.bfloat16), (TypeError, RuntimeError), None)):
        with pytest.raises(exc, match=text):
            typed.copy_from(bad)
    with pytest.raises(BufferError, match="host memory"):
        accel.from_dlpack(t)
    closed = accel.Stream(last)
    closed.close()
    with pytest.raises(RuntimeError, match="closed"):
        accel.from_dlpack(view, stream=closed)
    assert (view.to_numpy() == before).all()

    # the producer closed while imports hold the memory; the consumer's queued writes finish first
    src_ptr = src.ptr
    src.close()
    with pytest.raises(RuntimeError, match="closed"):
        view.to_numpy()
    assert (typed.to_numpy() == before).all()              # still the producer's memory
    late = accel.from_dlpack(typed.__dlpack__())           # an export of an import of a closed producer
    assert (late.as_array(np.float32, (4, 3), strides=(128, 8)).to_numpy() == before).all()
    core.configure(delay_us=500)
    try:
        for k in range(4):
            imp.fill_(0x40 + k, stream=cons)               # queued on the consumer's stream
        del typed, imp, again, late, view, cap
        gc.collect()
        with accel.device_index(last):                     # the producer's stream: its block again
            fresh = [accel.Buffer(data.nbytes).fill_(7) for _ in range(4)]   # (or held back until they ran)
        assert all((f.to_numpy() == 7).all() for f in fresh)   # not overwritten by the imports' fills
        accel.synchronize(last)
        assert all((f.to_numpy() == 7).all() for f in fresh), [f.ptr == src_ptr for f in fresh]
    finally:
        core.configure(delay_us=0)
    del fresh, prod, cons, closed, src
    gc.collect()
    assert _dlpack.live_exports() == exports
    _check_baseline(base)


def _check_snapshot(where: str) -> None:
    """Every device's snapshot agrees with its counters: active blocks sum to memory_allocated,
    segments to memory_reserved, each segment's blocks to its size and its allocated_size."""
    snap = accel.memory.memory_snapshot()
    for d in _devices():
        segs = [s for s in snap if s["device"] == d]
        active = sum(b["size"] for s in segs for b in s["blocks"] if b["state"] == "active_allocated")
        assert active == accel.memory.memory_allocated(d), (where, d)
        assert sum(s["total_size"] for s in segs) == accel.memory.memory_reserved(d), (where, d)
        stats = accel.memory.memory_stats(d)
        assert stats["allocated_bytes.all.current"] == active, (where, d)
        for s in segs:
            assert sum(b["size"] for b in s["blocks"]) == s["total_size"], (where, d, s["address"])
            assert s["allocated_size"] == sum(b["size"] for b in s["blocks"] if b["state"] == "active_allocated")


# -- 4. allocator settings changed between phases, a memory cap with OOM, snapshots throughout ---
@pytest.mark.parametrize("kind", SIMS)
def test_allocator_phases_caps_oom_and_snapshots(monkeypatch, kind):
    """A long job changes the allocator's settings between its phases (expandable segments off
    with a split limit and a GC threshold, then on again with a memory fraction for every device),
    caps the last device with set_per_process_memory_fraction and grows a cache there until
    OutOfMemoryError (the OOM observer called, device 0 unaffected, counters unchanged by the
    failed request), frees half and goes on.  A snapshot after every step (work still queued, a
    MemPool and, where there is capture, a graph pool holding blocks) agrees with
    memory_allocated/memory_reserved/memory_stats.  Refused settings change nothing."""
    from accel.sim import core
    M = accel.memory
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    devs = _devices()
    last = devs[-1]
    base = _baseline()
    settings0 = M.get_allocator_settings()
    seen_oom = []

    def observer(device, tried, allowed, free):
        seen_oom.append((device, tried, allowed))

    M.attach_out_of_memory_observer(observer)
    live = []
    rng = np.random.default_rng(5)
    try:
        def phase(name, count):
            streams = [accel.Stream(d) for d in devs]
            for i in range(count):
                d = devs[i % len(devs)]
                size = int(rng.choice([512, 4096, 300_000, 3 * MiB, 9 * MiB]))
                b = accel.Buffer(size, device=d, stream=streams[i % len(devs)])
                b.fill_(i % 256, stream=streams[i % len(devs)])
                live.append((b, i % 256))
                if i % 3 == 2:
                    live.pop(int(rng.integers(len(live))))
                if i % 7 == 0:
                    _check_snapshot(f"{name} {i}")
            _check_snapshot(name)
            for st in streams:                 # later reads are on other streams
                st.synchronize()

        core.configure(delay_us=50)            # work queued while the snapshots are taken
        phase("default", 30)
        M.set_allocator_settings("expandable_segments:False,max_split_size_mb:20,garbage_collection_threshold:0.5")
        phase("classic", 30)
        with accel.device_index(last):
            pool = accel.MemPool()
            with accel.use_mem_pool(pool):
                pooled = [accel.Buffer(s) for s in (1000, 2 * MiB, 5 * MiB)]
        _check_snapshot("mempool")
        if kind != "mps":
            out = accel.Buffer(4096, device=last)
            g = accel.Graph()
            with accel.graph(g, stream=accel.Stream(last)):
                tmp = accel.Buffer(4096).fill_(3)
                keep = accel.Buffer(6 * MiB).fill_(4)
                out.copy_from(tmp, non_blocking=True)
                del tmp
            g.replay()
            assert (keep.to_numpy()[::MiB] == 4).all()
            _check_snapshot("graph pool")
        core.configure(delay_us=0)

        # refused settings change nothing
        for bad in ("backend:cudaMallocAsync" if kind == "cuda" else "policy:torch", "max_split_size_mb:3",
                    "no_such_key:1", "expandable_segments:sometimes"):
            with pytest.raises(ValueError):
                M.set_allocator_settings(bad)
            assert "max_split_size_mb:20" in M.get_allocator_settings()
        with pytest.raises(TypeError):
            M.set_allocator_settings(None)

        # a cap on the last device: grow until OOM, free half, go on
        for b, v in live:
            assert (b.to_numpy()[:64] == v).all()
        M.empty_cache()
        total = accel.get_device_properties(last).total_memory
        cap = M.memory_reserved(last) + 64 * MiB
        M.set_per_process_memory_fraction(cap / total, last)
        cache = []
        with pytest.raises(accel.OutOfMemoryError) as info:
            while True:
                cache.append((accel.Buffer(5 * MiB, device=last).fill_(len(cache) % 256), len(cache) % 256))
                assert len(cache) < 100, "the cap never acted"
        assert seen_oom and seen_oom[-1][0] == last, seen_oom
        assert "allowed" in str(info.value)
        del info
        held = M.memory_allocated(last)
        _check_snapshot("after OOM")
        with pytest.raises(accel.OutOfMemoryError):
            accel.Buffer(5 * MiB, device=last)
        assert M.memory_allocated(last) == held             # a failed request holds nothing
        big0 = accel.Buffer(128 * MiB, device=0).fill_(1) if last != 0 else None   # device 0 is not capped
        del cache[::2]
        cache += [(accel.Buffer(5 * MiB, device=last).fill_(200), 200) for _ in range(len(cache) // 2)]
        assert all((c.to_numpy()[::4096] == v).all() for c, v in cache)
        _check_snapshot("recovered")
        M.set_per_process_memory_fraction(1.0, last)

        # expandable segments again, with a fraction named for every device
        M.set_allocator_settings("expandable_segments:True,per_process_memory_fraction:0.5")
        assert all(M.get_per_process_memory_fraction(d) == 0.5 for d in devs)
        phase("expandable", 30)
        with pytest.raises(accel.OutOfMemoryError):
            accel.Buffer(int(0.6 * total), device=0)
        _check_snapshot("end")
        for b, v in live:
            assert (b.to_numpy()[:64] == v).all()
    finally:
        core.configure(delay_us=0)
        M.detach_out_of_memory_observer(observer)
        M.set_allocator_settings(settings0 or "expandable_segments:True")
        for d in devs:
            M.set_per_process_memory_fraction(1.0, d)
    live.clear()
    del cache, big0, pooled, pool, b, v
    if kind != "mps":
        del g, out, keep
    gc.collect()
    _check_snapshot("dropped")
    _check_baseline(base)


def _fork_message(kind: str) -> str:
    name = kind.upper()
    return f"Cannot re-initialize {name} in forked subprocess"


# -- 5. fork in the middle of a program with a capture underway, imports, pools, pinned memory --
@pytest.mark.parametrize("kind", SIMS)
def test_fork_mid_program_with_capture_imports_and_pools(monkeypatch, kind):
    """A program forks a helper while it holds live streams and events, a graph captured and
    another still being captured on the last device (device 0 current), a MemPool, DLPack imports
    and an unconsumed capsule, and pinned arrays.  The child gets the fork error from every use
    of them (consuming the capsule, reading an import, use_mem_pool, ending the parent's capture,
    replaying, memory info), and dropping them all calls no vendor function.  The parent then
    ends its capture, replays both graphs and gets numpy's results; everything returns to
    baseline.  (The objects live in one dict, so the child's drop frees them.)"""
    from accel import _dlpack, _finalize
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    last = _devices()[-1]
    base = _baseline()
    exports = _dlpack.live_exports()
    data = np.arange(1024, dtype=np.float32)
    o = {"pinned": accel.empty_pinned(1024, np.float32)}
    o["pinned"][:] = data
    o["s"] = accel.Stream(last)
    o["src"] = accel.Buffer(4096, device=last).copy_from(o["pinned"], stream=o["s"], non_blocking=True)
    o["ev"] = o["s"].record_event()
    o["cap"] = o["src"].__dlpack__()
    o["imp"] = accel.from_dlpack(o["src"].as_array(np.float32, (16,), offset=64), stream=o["s"])
    with accel.device_index(last):
        o["pool"] = accel.MemPool()
        with accel.use_mem_pool(o["pool"]):
            o["pooled"] = accel.Buffer(8192).fill_(5)
    graphs = kind != "mps"
    if graphs:
        o["out1"], o["out2"] = accel.Buffer(4096, device=last), accel.Buffer(4096, device=last)
        o["g1"] = accel.Graph()
        with accel.graph(o["g1"], stream=o["s"]):
            o["out1"].copy_from(o["src"], non_blocking=True)
        o["g2"], o["cs"] = accel.Graph(), accel.Stream(last)
        o["cs"].wait_event(o["ev"])
        o["prev"] = accel.current_stream(last)
        with accel.device_index(last):
            accel.set_stream(o["cs"])
            o["g2"].capture_begin()                 # still underway at the fork
        o["tmp"] = accel.Buffer(4096, device=last).fill_(0)    # on cs: into g2's pool
        o["tmp"].copy_from(o["src"], non_blocking=True)
        o["out2"].copy_from(o["tmp"], non_blocking=True)
    state = (accel.current_device_index(), accel.memory.memory_allocated(last))

    def child():
        msg = _fork_message(kind)
        bad = []
        calls = [("from_dlpack(capsule)", lambda: accel.from_dlpack(o["cap"])),
                 ("import.to_numpy", lambda: o["imp"].to_numpy()),
                 ("Buffer.__dlpack__", lambda: o["src"].__dlpack__()),
                 ("use_mem_pool", lambda: accel.use_mem_pool(o["pool"]).__enter__()),
                 ("MemPool.snapshot", lambda: o["pool"].snapshot()),
                 ("Event.query", lambda: o["ev"].query()),
                 ("Stream.wait_event", lambda: o["s"].wait_event(o["ev"])),
                 ("empty_pinned", lambda: accel.empty_pinned(8)),
                 ("get_memory_info", lambda: accel.memory.get_memory_info(last)),
                 ("Buffer.copy_from(pinned)", lambda: o["src"].copy_from(o["pinned"], non_blocking=True))]
        if graphs:
            calls += [("Graph.replay", lambda: o["g1"].replay()), ("Graph.capture_end", lambda: o["g2"].capture_end()),
                      ("Graph.reset", lambda: o["g1"].reset()), ("new capture", lambda: accel.Graph().capture_begin())]
        bad += not_refused_with(calls, msg, exact=False)
        del calls
        made = vendor_calls_made_by(lambda: (o.clear(), gc.collect(), _finalize.drain()))
        if made:
            bad.append(f"the child's drops called the vendor library: {made}")
        if bad:
            import sys
            sys.stderr.write("\n".join(bad) + "\n")
            return 1
        return 0

    gc.collect()
    gc.freeze()
    try:
        assert run_forked(child, timeout=60) == 0, "the child's calls did not all raise the fork error (stderr)"
    finally:
        gc.unfreeze()
    # the parent goes on: its capture is still underway and ends normally
    assert (accel.current_device_index(), accel.memory.memory_allocated(last)) == state
    if graphs:
        assert accel.is_current_stream_capturing() is False     # device 0's current stream
        with accel.device_index(last):
            o["g2"].capture_end()
            accel.set_stream(o["prev"])
        del o["tmp"]
        o["g1"].replay()
        o["g2"].replay()
        assert (o["out1"].to_numpy(np.float32) == data).all() and (o["out2"].to_numpy(np.float32) == data).all()
    assert (o["imp"].to_numpy(np.float32) == data[16:32]).all()
    assert (accel.from_dlpack(o["cap"]).to_numpy(np.float32) == data).all()
    assert (o["pooled"].to_numpy() == 5).all()
    o.clear()
    gc.collect()
    assert _dlpack.live_exports() == exports
    _check_baseline(base)


# -- 6. a helper process forked inside `with stream:` leaves the block in the child -------------
@pytest.mark.parametrize("kind", SIMS)
def test_child_forked_inside_a_stream_block_leaves_it_with_the_fork_error(monkeypatch, kind):
    """A training script forks a checkpoint writer while inside `with stream:` on the last device;
    the child writes host data and leaves the block (sys.exit unwinds it).  Leaving it must give
    the same fork error every other use of an inherited object gives (as leaving
    `with accel.device_index(d):` does), call no vendor function, and leave the child's stack of
    entered streams empty; the parent's block is unaffected."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    last = _devices()[-1]
    s = accel.Stream(last)
    b = accel.Buffer(4096, device=last)
    results = {}

    def child():
        errors = []

        def leave():
            for cm in (s, outer):        # the stream block, then (for comparison) the device block around it
                try:
                    cm.__exit__(None, None, None)
                except RuntimeError as exc:
                    errors.append(str(exc))
                else:
                    errors.append("no error")

        made = vendor_calls_made_by(leave)
        ok = all(_fork_message(kind) in e for e in errors) and not made
        if not ok:
            import sys
            sys.stderr.write(f"{errors}; vendor calls: {made}\n")
        return 0 if ok else 1

    outer = accel.device_index(last)
    with outer:
        with s:
            b.fill_(3)
            results["code"] = run_forked(child, timeout=60)
            assert accel.current_stream(last) == s
        assert accel.current_stream(last) != s
    assert accel.current_device_index() == 0
    assert (b.to_numpy(stream=s) == 3).all()
    assert results["code"] == 0, "the child's exit of the stream block (stderr above)"


# -- 7. a long-running service: the phases above as cycles, internal tables bounded -------------
@pytest.mark.parametrize("kind", SIMS)
def test_service_cycles_keep_internal_tables_flat(monkeypatch, kind, saxpy, frozen_heap):
    # frozen_heap (r74d trim): the soak's 18 collections took 3 of its 4.7 s scanning the whole heap
    """A service handles requests forever: each one changes an allocator setting, caps a device
    and runs into OutOfMemoryError (observer attached), uncaps it, uploads through a pinned array
    to a kernel on the request's device and abandons the result with work queued, exports a view
    at an offset to a consumer after closing the producer, and misuses the kernel (another
    device's buffer, a closed buffer) getting clear errors.  Every container reachable from accel
    (tests/test_soak_objects_r45.census) stays flat from block to block."""
    from test_soak_objects_r45 import soak
    M = accel.memory
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    devs = _devices()
    kernels = {d: saxpy(d) for d in devs}
    ooms = []
    observer = lambda *a: ooms.append(a[0])          # noqa: E731
    M.attach_out_of_memory_observer(observer)
    total = accel.get_device_properties(0).total_memory
    n = 1024
    xs = np.arange(n, dtype=np.float32)

    def cycle(i, d):
        M.set_allocator_settings("garbage_collection_threshold:0.7" if i % 2 else "max_split_size_mb:40")
        M.set_per_process_memory_fraction((M.memory_reserved(d) + 8 * MiB) / total, d)
        with pytest.raises(accel.OutOfMemoryError):
            accel.Buffer(64 * MiB, device=d)
        M.set_per_process_memory_fraction(1.0, d)
        s = accel.Stream(d)
        h = accel.empty_pinned(n, np.float32)
        h[:] = xs
        x = accel.Buffer(4 * n, device=d, stream=s).copy_from(h, stream=s, non_blocking=True)
        y = accel.Buffer(4 * n, device=d, stream=s).fill_(0, stream=s)
        accel.launch(kernels[d], (n + 255) // 256, 256, np.float32(i), x, y, n, stream=s)
        if i % 3 == 0:
            assert (y.to_numpy(np.float32, stream=s) == np.float32(i) * xs).all()
        other = accel.Buffer(16, device=devs[(d + 1) % len(devs)])
        if len(devs) > 1:
            with pytest.raises(ValueError, match="memory of device"):
                accel.launch(kernels[d], 1, 1, 1.0, other, y, 1, stream=s)
        other.close()
        with pytest.raises(RuntimeError, match="closed"):
            accel.launch(kernels[d], 1, 1, 1.0, other, y, 1, stream=s)
        view = y.as_array(np.float32, (4, 4), strides=(64, 8), offset=4 * (i % 7))
        cap = view.__dlpack__(stream=s)
        del view
        y.close()                                     # the capsule keeps the memory
        got = accel.from_dlpack(cap)
        assert got.device_index == d
        got.fill_(i % 256)                            # queued; abandoned with x, h and s
        # (dropped here: work still queued on s and on the current stream)

    try:
        soak(cycle, every=6, blocks=2)
    finally:
        M.detach_out_of_memory_observer(observer)
        M.set_allocator_settings("")
        for d in devs:
            M.set_per_process_memory_fraction(1.0, d)
    assert len(ooms) == 6 * 4 and set(ooms) == set(devs)
    kernels.clear()
    settle()
    assert allocated() == (0,) * len(devs)
