"""Realistic user programs, sixth round (r58): threads using both devices at once.

Earlier rounds (test_user_programs.py, test_user_programs2.py, _r41, _r42, _r56) took loader
rings, pipelines across devices, graphs replayed from threads, MemPools, OOM, fork and DLPack.
These are programs whose threads use both devices at the same time: a thread pool whose tasks
enter ``with accel.device_index(d)`` / ``with stream:`` blocks interleaved with each other's; a
data-parallel step with one worker thread per device exchanging gradients through peer copies
and cross-device event waits under a memory fraction, while a coordinator synchronizes, empties
caches and reads stats and snapshots; a graph captured on device 1 in each capture_error_mode
while another thread works on device 0; allocator settings, fractions and peak resets changed
while other threads allocate (and roundup_power2_divisions tuned with blocks alive, which
left the allocator's stats wrong before the fix of r58); producers whose streams close with work queued and
whose blocks are freed by a consumer thread.  Each also runs with an exception raised half way.  Results
are checked against numpy; afterwards state is bounded by live objects (no growth when the
program runs again), no thread hangs (join timeouts), and misuse raises a clear error and
changes nothing.
"""

import concurrent.futures
import queue
import threading

import numpy as np
import pytest

import accel
from conftest import SIMS, THOROUGH, use_sim
from test_user_programs_r56 import saxpy  # noqa: F401 (the fixture)
from test_user_programs import JOIN_S, _devices, allocated, join_all, live_objects, process_state, settle

MiB = 1 << 20
#: rounds of four pool tasks (program 1): the default keeps 2 of THOROUGH's 6 (r74c); 8 tasks
#: still take every stream choice (i % 3, (i // 2) % 2, i % 2) and every raising/clean branch
ROUNDS = 6 if THOROUGH else 2
#: buffers each allocating thread makes (program 4): the default keeps 8 of THOROUGH's 30 (r74c);
#: still every size of the cycle of 7 per thread and the keep-3 window, and the controller still
#: cycles through all settings (it runs at least len(_SETTINGS) rounds)
ALLOCS = 30 if THOROUGH else 8


def _host_live() -> int:
    return accel.memory.host_memory_stats()["allocated_bytes.current"]


def _baseline():
    settle()
    return live_objects(), allocated()


def _check_baseline(base, where: str = "") -> None:
    settle()
    assert allocated() == base[1], where
    assert live_objects() == base[0], where
    assert _host_live() == 0, where


def _two_devices(kind: str, monkeypatch) -> None:
    use_sim(monkeypatch, kind)
    if len(_devices()) < 2:
        pytest.skip(f"{kind} simulator exposes one device (Metal has one system device)")


class Boom(Exception):
    """The exception a program raises half way (program 6 of the brief)."""


def _thread_state() -> tuple:
    """This thread's current device and current stream of each device."""
    return (accel.current_device_index(),) + tuple(accel.current_stream(d) for d in _devices())


# -- 1. a thread pool whose tasks interleave device and stream blocks ---------------------------
@pytest.mark.parametrize("fail", [False, True], ids=["clean", "raising"])
@pytest.mark.parametrize("kind", SIMS)
def test_thread_pool_tasks_never_leak_device_or_stream(monkeypatch, kind, fail):
    """A ThreadPoolExecutor of four threads runs 24 tasks (8 by default: ROUNDS) in rounds of four that all sit inside
    their blocks at once (a barrier): each enters ``with accel.device_index(d)`` and then
    ``with stream:`` of one of two streams per device shared by the tasks (sometimes a stream of
    the other device, which moves the current device), uploads, fills, downloads and checks its
    data against numpy, and leaves.  A pool thread's state when a task starts must be what a
    new thread has (device 0, default streams): no task's device or stream leaks into the next
    task of the same thread, nor into the main thread (device 1 and its own stream current
    throughout).  With ``fail`` every other task raises inside its stream block; the caller
    gets the exception and nothing else changes.  Run twice: the live objects do not grow."""
    use_sim(monkeypatch, kind)
    devs = _devices()
    base = _baseline()
    main_stream = accel.Stream(devs[-1])
    accel.set_stream(main_stream)             # the main thread: last device, its own stream
    main_state = _thread_state()
    streams = {d: [accel.Stream(d), accel.Stream(d)] for d in devs}
    fresh = (0,) + tuple(accel.default_stream(d) for d in devs)
    n = 4096
    workers = 4

    def task(i, barrier):
        start = _thread_state()
        assert start == fresh, f"task {i} started with {start}, not a new thread's {fresh}"
        d = devs[i % len(devs)]
        s = streams[devs[(i // 2) % len(devs)] if i % 3 == 0 else d][i % 2]
        with accel.device_index(d):
            assert accel.current_device_index() == d
            with s:
                barrier.wait(JOIN_S)          # all four tasks of the round inside their blocks
                assert accel.current_device_index() == s.device_index
                assert accel.current_stream() is s and accel.current_stream(s.device_index) is s
                host = np.arange(n, dtype=np.float32) * (i + 1)
                buf = accel.Buffer(4 * n)     # current device, current stream
                assert buf.device_index == s.device_index
                buf.copy_from(host, non_blocking=True)
                half = buf.as_array(np.float32, (n // 2,), offset=2 * n)
                assert (half.to_numpy() == host[n // 2:]).all()
                buf.fill_(i % 251)
                out = buf.to_numpy()
                barrier.wait(JOIN_S)          # and still all inside, in another order now
                assert accel.current_stream() is s and accel.current_device_index() == s.device_index
                if fail and i % 2:
                    raise Boom(f"task {i}")
            assert accel.current_device_index() == d
            assert accel.current_stream(s.device_index) == accel.default_stream(s.device_index)
        assert _thread_state() == fresh
        assert (out == i % 251).all(), i
        return i

    def run():
        results, errors = [], []
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="task") as pool:
            for r in range(ROUNDS):
                barrier = threading.Barrier(workers)
                futs = [pool.submit(task, r * workers + k, barrier) for k in range(workers)]
                for f in futs:
                    try:
                        results.append(f.result(JOIN_S))
                    except Boom as exc:
                        errors.append(str(exc))
                assert _thread_state() == main_state
        want = list(range(ROUNDS * workers))
        if fail:
            assert errors == [f"task {i}" for i in want if i % 2]
            want = [i for i in want if not i % 2]
        else:
            assert not errors, errors
        assert results == want

    run()
    settle()
    live = live_objects()
    run()
    settle()
    assert live_objects() == live
    assert _thread_state() == main_state
    # misuse: leaving a stream block that this thread never entered
    with pytest.raises(RuntimeError, match="without a matching __enter__ on this thread"):
        streams[devs[0]][0].__exit__(None, None, None)
    assert _thread_state() == main_state
    accel.set_stream(accel.default_stream(devs[-1]))
    accel.set_device_index(0)
    del streams, main_stream, main_state
    _check_baseline(base)


# -- 2. data parallel over both devices: a worker thread per device, a coordinator --------------
def _check_stats(d: int, cap: int) -> None:
    """One memory_stats read of device d: every peak at least its current value, nothing
    reserved past the cap, allocated within reserved."""
    stats = accel.memory.memory_stats(d)
    for key, value in stats.items():
        if key.endswith(".current"):
            assert stats[key[:-len("current")] + "peak"] >= value, (d, key, value)
    assert stats["allocated_bytes.all.current"] <= stats["reserved_bytes.all.current"] <= cap, stats


def _check_snapshot(cap: int) -> None:
    """A memory_snapshot taken while both workers allocate: well formed, within the cap."""
    snap = accel.memory.memory_snapshot()
    for seg in snap:
        assert seg["device"] in (0, 1)
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"], seg
        assert seg["allocated_size"] <= seg["total_size"]
    for d in (0, 1):
        assert sum(seg["total_size"] for seg in snap if seg["device"] == d) <= cap


@pytest.mark.parametrize("fail", [False, True], ids=["clean", "raising"])
@pytest.mark.parametrize("kind", [s for s in SIMS if s != "mps"])
def test_data_parallel_workers_exchange_gradients_through_peer_copies(monkeypatch, kind, fail, saxpy):
    """One worker thread per device, each with a compute and a communication stream, under a
    per-process memory fraction of 16 MiB on both devices.  Each step, each worker uploads its
    gradient on its compute stream and posts it with an event; after a barrier it waits on the
    peer's event on its communication stream (a cross-device event wait), copies the peer's
    gradient across (a peer copy), marks the peer's buffer used there (record_stream with a
    stream of another device), adds it to its own with saxpy, and updates its parameters
    (p -= lr * g).  A coordinator thread meanwhile synchronizes both devices, empties the caches
    and reads memory_stats and memory_snapshot.  Every summed gradient and both parameter copies
    equal numpy's; with ``fail`` worker 1 raises in step 3 (after allocating), breaks the
    barrier, and worker 0 stops with BrokenBarrierError.  Afterwards memory and vendor objects
    are at the baseline; a second run grows nothing."""
    _two_devices(kind, monkeypatch)
    accel.set_device_index(0)
    kernel = {d: saxpy(d) for d in (0, 1)}
    from test_user_kernels import expected
    base = _baseline()
    state = process_state()
    cap = 16 * MiB
    fractions = [accel.memory.get_per_process_memory_fraction(d) for d in (0, 1)]
    for d in (0, 1):
        accel.memory.set_per_process_memory_fraction(cap / accel.get_memory_info(d)[1], d)
    # the default keeps 4 of THOROUGH's 6 steps (r74c): worker 1 still raises in step 3, after
    # three full exchanges, and a clean run still has a step after it
    n, steps, lr = 1 << 16, (6 if THOROUGH else 4), np.float32(0.25)
    rng = np.random.default_rng(58)
    grads = rng.standard_normal((2, steps, n)).astype(np.float32)
    init = rng.standard_normal(n).astype(np.float32)

    def run():
        mailbox = [None, None]
        barrier = threading.Barrier(2)
        stop = threading.Event()
        errors, results, params = [], {0: [], 1: []}, {}

        def worker(d):
            try:
                with accel.device_index(d):
                    compute, comm = accel.Stream(d), accel.Stream(d)
                    param = accel.Buffer(4 * n, stream=compute).copy_from(init, stream=compute)
                    for step in range(steps):
                        grad = accel.Buffer(4 * n, stream=compute)
                        grad.copy_from(grads[d, step], stream=compute, non_blocking=True)
                        mailbox[d] = (grad, compute.record_event())
                        if fail and d == 1 and step == 3:
                            raise Boom("worker 1 in step 3")
                        barrier.wait(JOIN_S)
                        peer_grad, peer_ready = mailbox[1 - d]
                        comm.wait_event(peer_ready)                      # an event of the other device
                        recv = accel.Buffer(4 * n, stream=comm)
                        recv.copy_from(peer_grad, stream=comm, non_blocking=True)   # peer copy
                        peer_grad.record_stream(comm)                    # a stream of another device
                        del peer_grad, peer_ready
                        compute.wait_stream(comm)
                        # recv += grad (the peer may still be reading grad: only read it here)
                        accel.launch(kernel[d], (n + 255) // 256, 256, np.float32(1.0), grad, recv, n,
                                     stream=compute)
                        recv.record_stream(compute)
                        accel.launch(kernel[d], (n + 255) // 256, 256, -lr, recv, param, n, stream=compute)
                        barrier.wait(JOIN_S)                             # both took the peer's gradient
                        mailbox[d] = None
                        del grad                                         # freed while the peer's copy may run
                        results[d].append(recv.to_numpy(np.float32, stream=compute))
                        del recv
                    params[d] = param.to_numpy(np.float32, stream=compute)
                    del param
                    comm.close()                                         # possibly with work queued
            except threading.BrokenBarrierError:
                errors.append((d, "broken"))
            except BaseException as exc:
                errors.append((d, exc))
                barrier.abort()
            finally:
                mailbox[d] = None

        def coordinator():
            try:
                while not stop.is_set():
                    for d in (0, 1):
                        accel.synchronize(d)
                        _check_stats(d, cap)
                    accel.memory.empty_cache()
                    _check_snapshot(cap)
                    accel.memory.memory_summary(1)
            except BaseException as exc:
                errors.append(("coordinator", exc))

        coord = threading.Thread(target=coordinator, name="coordinator")
        coord.start()
        workers = [threading.Thread(target=worker, args=(d,), name=f"worker{d}") for d in (0, 1)]
        for t in workers:
            t.start()
        join_all(workers)
        stop.set()
        join_all([coord])
        return errors, results, params

    def check(errors, results, params):
        if fail:
            assert len(errors) == 2 and (0, "broken") in errors, errors
            assert [type(exc) for d, exc in errors if d == 1] == [Boom], errors
            # worker 0 may see the barrier broken as it leaves step 2's last wait (Barrier's
            # abort while draining), before it appended step 2's sum
            assert len(results[1]) == 3 and len(results[0]) in (2, 3), results
            assert not params
        else:
            assert not errors, errors
            assert len(results[0]) == len(results[1]) == steps
        p = init
        for step in range(len(results[1])):
            want = grads[0, step] + grads[1, step]
            for d in (0, 1):
                if step < len(results[d]):
                    assert (results[d][step] == want).all(), (d, step)
            p = expected(-lr, want, p)
        if not fail:
            assert (params[0] == p).all() and (params[1] == p).all()

    check(*run())
    assert process_state() == state
    settle()
    live = live_objects()
    check(*run())
    assert process_state() == state
    settle()
    assert live_objects() == live
    for d in (0, 1):
        assert accel.memory.max_memory_reserved(d) <= cap
        accel.memory.set_per_process_memory_fraction(fractions[d], d)
    _check_baseline(base)


# -- 3. a graph captured on device 1 while another thread works on device 0 --------------------
#: what the device-0 thread does while device 1 captures, and whether CUDA counts it among the
#: "potentially unsafe" calls that a global-mode capture of another thread prohibits (CUDA
#: Programming Guide, "Prohibited and Unhandled Operations"; cudaStreamBeginCapture): a blocking
#: copy synchronizes its stream, a query or synchronize of an event, a stream or the device.
#: The allocation is not: accel relaxes the thread's mode around cudaMalloc while any capture is
#: underway (torch's cudaMallocMaybeCapturing), and with expandable segments it maps memory.
_B_STEPS = (("alloc", False), ("upload", True), ("record", False), ("query", True), ("event sync", True),
            ("stream query", True), ("device sync", True), ("download", True), ("stats", False),
            ("snapshot", False), ("free", False))


def _b_steps(keep: list, seen: list, n: int, value: int):
    ev = accel.Event(0)
    s0 = accel.current_stream(0)
    return {
        "alloc": lambda: keep.append(accel.Buffer(n, device=0)),
        "upload": lambda: keep[0].copy_from(np.full(n, value, np.uint8)),
        "record": lambda: ev.record(s0),
        "query": ev.query,
        "event sync": ev.synchronize,
        "stream query": s0.query,
        "device sync": lambda: accel.synchronize(0),
        "download": lambda: seen.append(keep[0].to_numpy()),
        "stats": lambda: _check_stats(0, 1 << 62),
        "snapshot": accel.memory.memory_snapshot,
        "free": keep.clear,
    }


@pytest.mark.parametrize("fail", [False, True], ids=["clean", "raising"])
@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
@pytest.mark.parametrize("kind", [s for s in SIMS if s != "mps"])
def test_capture_on_device1_while_a_thread_works_on_device0(monkeypatch, kind, mode, fail):
    """Thread A warms up and captures a step on device 1 with accel.graph(capture_error_mode=
    mode); while the capture is underway, thread B (device 0) allocates a new 3 MiB block,
    uploads, records, queries and synchronizes an event, queries its stream, synchronizes the
    device, downloads, reads stats and a snapshot, frees, and calls empty_cache.

    CUDA's rules: thread_local and relaxed captures ignore other threads, so every call of B
    works and the graph replays the step; a global capture prohibits B's potentially unsafe
    calls, each of which raises CaptureError, and invalidates the capture, whose end raises
    CaptureError (then the graph is empty).  empty_cache is refused in every mode
    (CaptureError naming an allocator), as torch's allocator asserts no capture is underway,
    and empties nothing.  With ``fail`` A's body raises half way instead.  Afterwards
    B's calls all work, A captures again in the same mode and replays, and the state is at the
    baseline (a second run grows nothing)."""
    _two_devices(kind, monkeypatch)
    accel.set_device_index(0)
    with accel.device_index(1):
        accel.graphs._side_stream()     # accel.graph()'s side stream, kept per device (as torch's)
    base = _baseline()
    state = process_state()
    n, big = 1 << 14, 3 * MiB

    def run():
        inside, b_done = threading.Event(), threading.Event()
        got, errors = {}, []

        def capture():
            try:
                with accel.device_index(1):
                    src = accel.Buffer(4 * n).copy_from(np.arange(n, dtype=np.float32))
                    dst = accel.Buffer(4 * n).fill_(0)
                    g = accel.Graph()
                    try:
                        with accel.graph(g, capture_error_mode=mode):
                            tmp = accel.Buffer(4 * n)
                            tmp.copy_from(src, non_blocking=True)
                            inside.set()
                            b_done.wait(JOIN_S)
                            if fail:
                                raise Boom("half way through the capture")
                            dst.copy_from(tmp, non_blocking=True)
                            del tmp
                        got["A"] = "ok"
                    except (accel.CaptureError, Boom) as exc:
                        got["A"] = exc
                    assert not accel.is_current_stream_capturing()
                    assert "empty" in repr(g) or got["A"] == "ok", repr(g)
                    if got["A"] == "ok":
                        for _ in range(3):
                            g.replay()
                        got["replayed"] = dst.to_numpy(np.float32).copy()
                    # captured again in the same mode, nothing else running: it works
                    g.reset()
                    dst.fill_(0)
                    with accel.graph(g, capture_error_mode=mode):
                        dst.copy_from(src, non_blocking=True)
                    g.replay()
                    got["again"] = dst.to_numpy(np.float32).copy()
                    del g, src, dst
            except BaseException as exc:
                errors.append(exc)
            finally:
                inside.set()

        def work():
            try:
                inside.wait(JOIN_S)
                keep = []
                reserved = accel.memory.memory_reserved(0)
                outcome = []
                for name, fn in _b_steps(keep, [], big, 7).items():
                    try:
                        fn()
                        outcome.append((name, "ok"))
                    except accel.CaptureError as exc:
                        outcome.append((name, str(exc)))
                keep.clear()
                accel.memory.memory_allocated(0)
                with pytest.raises(accel.CaptureError, match=r"empty_cache\(\) is not allowed while a stream "
                                   r"capture is underway \(device [01]'s allocator\); call it after capture_end"):
                    accel.memory.empty_cache()
                assert accel.memory.memory_reserved(0) >= reserved     # nothing emptied on device 0
                got["B"] = outcome
            except BaseException as exc:
                errors.append(exc)
            finally:
                b_done.set()

        threads = [threading.Thread(target=capture, name="capture"), threading.Thread(target=work, name="work")]
        for t in threads:
            t.start()
        join_all(threads)
        assert not errors, errors[0]
        # everything B did works now that no capture is underway
        seen = []
        for name, fn in _b_steps([], seen, big, 9).items():
            fn()
        accel.memory.empty_cache()
        return got, seen

    def check(got, seen):
        assert len(seen) == 1 and (seen[0] == 9).all()
        assert (got["again"] == np.arange(n, dtype=np.float32)).all()
        prohibited = mode == "global"
        for (name, unsafe), (done, outcome) in zip(_B_STEPS, got["B"]):
            assert name == done
            if unsafe and prohibited:
                assert outcome != "ok" and "captur" in outcome, (name, outcome)
            else:
                assert outcome == "ok", (name, outcome)
        if fail:
            assert isinstance(got["A"], Boom), got["A"]
        elif prohibited:
            assert isinstance(got["A"], accel.CaptureError) and "invalidated" in str(got["A"]).lower(), got["A"]
        else:
            assert got["A"] == "ok"
            assert (got["replayed"] == np.arange(n, dtype=np.float32)).all()

    check(*run())
    assert process_state() == state
    settle()
    live = live_objects()
    check(*run())
    assert process_state() == state
    settle()
    assert live_objects() == live
    _check_baseline(base)


# -- 4. allocator settings, memory fractions and peak resets changed while threads allocate -----
#: (the roundup_power2_divisions changes once made the stats go below zero here, intermittently:
#: program 5 is the deterministic form)
_SETTINGS = ("expandable_segments:False", "expandable_segments:True",
             "garbage_collection_threshold:0.8,max_split_size_mb:24", "roundup_power2_divisions:4",
             "garbage_collection_threshold:0.6", "expandable_segments:False,roundup_power2_divisions:[256:8,>:2]",
             "expandable_segments:False,max_split_size_mb:32", "roundup_power2_divisions:1", "")


def _check_snapshot_agrees() -> None:
    """With no thread allocating: every device's snapshot agrees with its counters."""
    snap = accel.memory.memory_snapshot()
    for d in _devices():
        segs = [s for s in snap if s["device"] == d]
        active = sum(b["size"] for s in segs for b in s["blocks"] if b["state"] == "active_allocated")
        stats = accel.memory.memory_stats(d)
        assert stats["allocated_bytes.all.current"] == active, d
        assert stats["reserved_bytes.all.current"] == sum(s["total_size"] for s in segs), d
        for key, value in stats.items():
            if key.endswith(".current"):
                assert stats[key[:-len("current")] + "peak"] >= value, (d, key)


@pytest.mark.parametrize("fail", [False, True], ids=["clean", "raising"])
@pytest.mark.parametrize("kind", SIMS)
def test_settings_fractions_and_peak_resets_while_threads_allocate(monkeypatch, kind, fail):
    """Two threads per device allocate buffers of 4 KiB to 25 MiB (on a stream of their own),
    fill them with numpy data and check it, keeping a few alive; a controller thread meanwhile
    cycles set_allocator_settings (expandable segments off and on, max_split_size_mb,
    garbage_collection_threshold), sets each device's memory fraction (never
    below what the workload needs), resets peak and accumulated stats, and reads memory_stats
    (every peak at least its current value in each read); its misuses (a fraction of 1.5, a
    change of ``backend``) raise and change nothing.  With ``fail`` a worker raises with its
    buffers alive.  Afterwards each snapshot agrees with the counters, the settings are the
    defaults again, and memory and vendor objects return to the baseline."""
    use_sim(monkeypatch, kind)
    devs = _devices()
    base = _baseline()
    state = process_state()
    settings0 = accel.memory.get_allocator_settings()
    fractions0 = [accel.memory.get_per_process_memory_fraction(d) for d in devs]
    sizes = (4096, 20000, 1 << 20, 3 * MiB + 512, 6 * MiB, 4096, 25 * MiB)

    def run():
        stop = threading.Event()
        errors = []
        failed = []

        def worker(tid):
            d = devs[tid % len(devs)]
            try:
                s = accel.Stream(d)
                keep = []
                for i in range(ALLOCS):
                    n = sizes[(tid + i) % len(sizes)]
                    host = np.full(n, (tid * 31 + i) % 256, np.uint8)
                    buf = accel.Buffer(n, device=d, stream=s).copy_from(host, stream=s)
                    out = buf.to_numpy(stream=s)
                    assert (out == host).all(), (tid, i, n)
                    keep.append(buf)
                    if len(keep) > 3:
                        keep.pop(0)
                    if fail and tid == 1 and i == ALLOCS // 2:
                        raise Boom(f"worker {tid}")
                del keep, buf
            except Boom as exc:
                failed.append(str(exc))
            except BaseException as exc:
                errors.append(exc)

        def controller():
            try:
                i = 0
                while not stop.is_set() or i < len(_SETTINGS):
                    accel.memory.set_allocator_settings(_SETTINGS[i % len(_SETTINGS)])
                    d = devs[i % len(devs)]
                    accel.memory.set_per_process_memory_fraction((0.5, 0.05, 1.0)[i % 3], d)
                    accel.memory.reset_peak_memory_stats(d)
                    if i % 4 == 0:
                        accel.memory.reset_accumulated_memory_stats(d)
                    _check_stats(d, 1 << 62)
                    now = accel.memory.get_allocator_settings()
                    with pytest.raises(ValueError, match="Invalid fraction value: 1.5"):
                        accel.memory.set_per_process_memory_fraction(1.5, d)
                    with pytest.raises(ValueError):
                        accel.memory.set_allocator_settings("backend:cudaMallocAsync")
                    assert accel.memory.get_allocator_settings() == now
                    i += 1
            except BaseException as exc:
                errors.append(exc)

        ctl = threading.Thread(target=controller, name="controller")
        ctl.start()
        workers = [threading.Thread(target=worker, args=(t,), name=f"alloc{t}") for t in range(2 * len(devs))]
        for t in workers:
            t.start()
        join_all(workers)
        stop.set()
        join_all([ctl])
        assert not errors, errors[0]
        assert failed == (["worker 1"] if fail else [])
        for d in devs:
            accel.synchronize(d)
        _check_snapshot_agrees()
        accel.memory.set_allocator_settings(settings0 or "expandable_segments:True")
        for d, f in zip(devs, fractions0):
            accel.memory.set_per_process_memory_fraction(f, d)
        _check_snapshot_agrees()

    run()
    assert process_state() == state
    settle()
    live = live_objects()
    run()
    assert process_state() == state
    settle()
    assert live_objects() == live
    _check_baseline(base)


# -- 5. roundup_power2_divisions tuned while blocks are allocated -------------------------------
@pytest.mark.parametrize("kind", SIMS)
def test_roundup_divisions_tuned_with_blocks_alive_keeps_stats_exact(monkeypatch, kind):
    """A user tunes the allocator half way through a run: requests of 600,000 bytes are alive
    on both devices (each splits a fresh 2 MiB classic segment) when
    ``set_allocator_settings("roundup_power2_divisions:4")`` is called; they are freed, the
    same requests are made and freed again under the new rounding (655,360-byte blocks), and
    the cache is emptied.  Then nothing is allocated or reserved, and every current counter
    (inactive_split_bytes included) is 0, as the snapshot says.  CUDA and Level Zero run with
    classic segments (expandable_segments:False), Metal has only those."""
    env = {} if kind == "mps" else {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    use_sim(monkeypatch, kind, **env)
    devs = _devices()
    base = _baseline()
    settings0 = accel.memory.get_allocator_settings()
    n = 600_000
    host = np.arange(n, dtype=np.uint8)
    try:
        live = [accel.Buffer(n, device=d).copy_from(host) for d in devs for _ in range(2)]
        accel.memory.set_allocator_settings("roundup_power2_divisions:4")
        for buf in live:
            assert (buf.to_numpy() == host).all()
        del live, buf
        again = [accel.Buffer(n, device=d).copy_from(host) for d in devs for _ in range(2)]
        assert all((b.to_numpy() == host).all() for b in again)
        del again
        settle()
        _check_snapshot_agrees()
        for d in devs:
            stats = accel.memory.memory_stats(d)
            assert accel.memory.memory_reserved(d) == 0
            assert {k: v for k, v in stats.items() if k.endswith(".current") and v} == {}, d
    finally:
        accel.memory.set_allocator_settings(settings0)
    _check_baseline(base)


# -- 6. producers on both devices whose streams close with work queued; consumers free ----------
@pytest.mark.parametrize("fail", [False, True], ids=["clean", "raising"])
@pytest.mark.parametrize("kind", [s for s in SIMS if s != "mps"])
def test_cross_device_producers_close_streams_consumers_free(monkeypatch, kind, fail):
    """A producer thread per device makes a stream per batch, allocates a block on it, uploads
    a pinned batch and fills half of it (work kept queued by a per-operation delay), records an
    event, hands block and event to the consumer thread of the other device, and closes the
    stream at once.  Each consumer waits for the event on its own stream (a cross-device wait),
    copies the block to its device, marks the producer's block used on its stream
    (record_stream on a stream of another device than the block's closed one) and drops it, so
    the block is freed on the consumer thread while the copy may be queued; it downloads into
    pinned memory and checks against numpy.  A new allocation on the producer's device must not
    be overwritten by the queued copy.  Consumers close their streams with downloads queued at
    the end.  With ``fail`` the consumer of device 0 raises half way: its producer stops, what
    was handed over is dropped.  Memory, pinned memory and vendor objects return to baseline."""
    from accel.sim import core
    _two_devices(kind, monkeypatch)
    accel.set_device_index(0)
    base = _baseline()
    state = process_state()
    n, batches = 8192, 8

    def run():
        queues = {d: queue.Queue(maxsize=2) for d in (0, 1)}   # into the consumer of device d
        stop = {d: threading.Event() for d in (0, 1)}
        errors, results, failed = [], {0: [], 1: []}, []

        def producer(d):
            dest = 1 - d
            try:
                for b in range(batches):
                    if stop[dest].is_set():
                        break
                    s = accel.Stream(d)
                    host = accel.empty_pinned(n, np.uint8)
                    host[:] = (d * 100 + b) % 251
                    buf = accel.Buffer(n, device=d, stream=s).copy_from(host, stream=s, non_blocking=True)
                    buf.as_array(np.uint8, (n // 2,)).copy_from(np.full(n // 2, b, np.uint8), stream=s)
                    ev = s.record_event()
                    s.close()                               # with the upload possibly queued
                    del host, s
                    queues[dest].put((b, buf, ev), timeout=JOIN_S)
                    del buf, ev
            except BaseException as exc:
                errors.append(exc)
            finally:
                queues[dest].put(None, timeout=JOIN_S)

        def consumer(d):
            try:
                s = accel.Stream(d)
                while True:
                    item = queues[d].get(timeout=JOIN_S)
                    if item is None:
                        break
                    b, buf, ev = item
                    del item
                    s.wait_event(ev)                         # an event of the other device
                    mine = accel.Buffer(n, device=d, stream=s).copy_from(buf, stream=s, non_blocking=True)
                    buf.record_stream(s)
                    del buf, ev                              # freed here, the copy maybe queued
                    # a new block on the producer's device must not see the copy's source change
                    probe = accel.Buffer(n, device=1 - d).fill_(0xEE)
                    out = accel.empty_pinned(n, np.uint8)
                    mine.copy_to(out, stream=s, non_blocking=True)
                    results[d].append((b, out, s.record_event(), probe))
                    del mine, out, probe
                    if fail and d == 0 and b == batches // 2:
                        raise Boom("consumer 0")
                s.close()                                    # with downloads queued
            except Boom as exc:
                failed.append(str(exc))
                stop[d].set()
                while queues[d].get(timeout=JOIN_S) is not None:   # let the producer finish
                    pass
            except BaseException as exc:
                errors.append(exc)

        core.configure(delay_us=200)
        try:
            threads = [threading.Thread(target=f, args=(d,), name=f"{f.__name__}{d}")
                       for d in (0, 1) for f in (producer, consumer)]
            for t in threads:
                t.start()
            join_all(threads)
        finally:
            core.configure(delay_us=0)
        assert not errors, errors[0]
        assert failed == (["consumer 0"] if fail else [])
        for d in (0, 1):
            src = 1 - d
            got = [b for b, *_ in results[d]]
            assert got == list(range(len(got))) and (fail and d == 0 or len(got) == batches), (d, got)
            for b, out, ev, probe in results[d]:
                ev.synchronize()
                want = np.full(n, (src * 100 + b) % 251, np.uint8)
                want[:n // 2] = b
                assert (out == want).all(), (d, b)
                assert (probe.to_numpy() == 0xEE).all(), (d, b)
        results.clear()

    run()
    assert process_state() == state
    settle()
    live = live_objects()
    run()
    assert process_state() == state
    settle()
    assert live_objects() == live
    _check_baseline(base)
