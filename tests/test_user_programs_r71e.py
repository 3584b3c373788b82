"""Realistic user programs, r71e: torch.accelerator code as a demanding user writes it, run on the
CUDA, Level Zero ("xpu", two devices) and Metal ("mps", one device) simulators; every result is
compared with numpy, and after each program memory, the simulator's objects and the process
state (current device and streams) are back where they started.

Earlier rounds (test_user_programs*.py, _r41 .. _r70e) took loader rings, a 5,000-request
service, GPipe, graphs replayed from threads, OOM loops and batch-size searches, fork pools and
DLPack round trips.  These take ten programs not written before:

1. data parallelism by hand: each device computes its gradient on its own compute stream; a
   reduce-scatter then an all-gather move *halves* of the gradients between the devices through
   C-contiguous ``as_array`` views at an offset (``Buffer.copy_from(view_of_other_device)``), on
   per-device communication streams ordered only by events of the other device; the reduction
   kernels write into views (``launch`` takes an ``ArrayView`` for a pointer).  Four SGD steps:
   both replicas equal numpy's float32 parameters bit for bit, under a per-operation delay;
2. a producer thread on device 1 and a consumer thread on device 0: the producer's buffers are
   dropped as soon as they are queued, the consumer copies them across, ``record_stream``s them
   and drops them with the copy in flight, then downloads into a ring of pinned rows that torch
   reads zero-copy (``torch.from_dlpack`` of the pinned array) after each row's event; timing
   events around the consumer's work and the misuses of timing (other device, no timing flag);
3. graph reset and recapture while the first capture's static output is still held by the user:
   the old output keeps its last replay's bytes through the new capture's replays (no aliasing
   with the new pool), its pool segment stays while it lives and goes when it dies; a second
   graph shares a MemPool with eager ``use_mem_pool`` allocations between replays;
4. a user-written ``fork_rng(devices=...)`` (torch.random.fork_rng's recipe over
   ``get_rng_state``/``set_rng_state``) around draws on both devices, a user Generator of the last
   device with ``clone_state``/``graphsafe_set_state`` snapshots (and drawing on device 0's
   memory, as torch allows), a state copied from device 0 to the last device, and a thread drawing from the Generator while the main thread draws from the
   default one: every draw equals a numpy Philox at the offset it should have;
5. two threads driving both devices into ``OutOfMemoryError`` at once under different
   ``set_per_process_memory_fraction`` caps (expandable and classic segments): each error and
   observer call names its own device and cap, no device reserves past its cap, each thread
   recovers by freeing half, and ``num_ooms`` is one per device;
6. two threads capturing graphs on the two devices *at the same time* (``capture_begin`` /
   ``capture_end`` in ``thread_local`` mode, as torch users do to capture per-device graphs in
   parallel), each allocating inside its capture, then replaying concurrently with new inputs;
7. (CUDA) a kernel compiled by NVRTC (``accel.compile``) with a mixed signature (i32, f64, ptr),
   loaded on device 1 while device 0 is current (a negative int needs the signed type named:
   PTX says .u32 for int, and the refusal says how), launched eagerly and inside a capture,
   and its misuses (a stream of another device, a wrong argument, a compile error);
8. a worker forked after init: it falls back to numpy on the documented error and reports
   through a pipe; the parent's draws and memory are untouched.  The RNG queries there answer
   where torch's raise the fork error (strict xfail, the one accel bug found);
9. pinned arrays handed to torch (``torch.from_dlpack``) that outlive their numpy array: the host
   cache does not hand the block out again while torch holds it, asynchronous downloads from
   device 1 land in it, and the host counters go back to zero when torch lets go; a device
   Buffer asked for host memory (``numpy.from_dlpack(buf, device="cpu")``) is a BufferError;
10. a captured step on device 0 that pulls a shard from device 1 (a cross-device copy inside the
    capture): without a warm-up copy, expandable segments refuse it with a CaptureError that
    says what to do, the capture is left discarded and the graph reusable; after the suggested
    ``add_peer`` it captures, and replays ordered by events of device 1's upload stream read
    every new shard.

Program 10 also ran (by hand) under ``expandable_segments:False`` (no refusal there), an OOM inside a capture
on device 1 and ``MemPool(use_on_oom=True)`` under a cap were checked the same way, and the calls
a child forked after init makes were compared one by one with torch.cuda's: only the RNG queries
differ (program 8's xfail).
"""

import contextlib
import gc
import os
import queue
import threading

import numpy as np
import pytest

import accel
from conftest import SIMS, run_forked, use_sim
from test_user_kernels import expected as saxpy_np
from test_user_programs import JOIN_S, _devices, live_objects, process_state, settle
from test_user_programs_r56 import saxpy  # noqa: F401  (fixture: the saxpy kernel per simulator)
from test_user_programs_r66b import _slow, check_stat_invariants, uniform_f32

MiB = 1 << 20
GRAPH_SIMS = [s for s in SIMS if s != "mps"]
TWO_DEVICE_SIMS = [s for s in SIMS if s != "mps"]


def _blocks(n: int) -> int:
    return (n + 255) // 256


def _baseline():
    settle()
    return live_objects(), tuple(accel.memory.memory_allocated(d) for d in _devices())


def _check_baseline(base, where="") -> None:
    settle()
    assert tuple(accel.memory.memory_allocated(d) for d in _devices()) == base[1], where
    assert live_objects() == base[0], where
    assert accel.memory.host_memory_stats()["allocated_bytes.current"] == 0, where
    for d in _devices():
        assert accel.memory.memory_reserved(d) == 0 or accel.memory.memory_allocated(d) > 0, (where, d)


def _run_threads(*targets):
    errors = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as exc:          # reported below
                errors.append(exc)
        return run
    threads = [threading.Thread(target=wrap(t), name=f"r71e-{i}") for i, t in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"threads hung: {hung}"
    if errors:
        raise errors[0]


# -- 1. data parallelism by hand: reduce-scatter and all-gather of halves through views ----------
@pytest.mark.parametrize("kind", TWO_DEVICE_SIMS)
def test_data_parallel_sgd_reduce_scatter_all_gather_through_views(monkeypatch, kind, saxpy):
    """Device 0 current throughout; device 1's buffers are made with ``device=1``.  Each step:
    each device d computes ``g_d = a_d x_d`` on its compute stream; device d owns half d of the
    gradient: its communication stream waits for the *other* device's compute event, pulls the
    other device's half d (a view at an offset) into a receive buffer, and the compute stream
    adds it into its own half d through a view (``launch`` with an ArrayView argument); then
    each device pulls the other's reduced half into a staging buffer and copies it into the
    other half of its gradient (a same-device view copy); finally ``p_d += -lr/2 * g_d``.  Every
    buffer a step made is dropped with its work queued (``record_stream`` on the streams of
    both devices).  After 4 steps both replicas equal numpy's float32 result bit for bit."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    devs = (0, 1)
    k = {d: saxpy(d) for d in devs}
    base = _baseline()
    state = process_state()
    n = 4096
    half = n // 2
    lr = np.float32(0.125)
    rng = np.random.default_rng(71)
    p_np = rng.integers(-100, 100, n).astype(np.float32)
    a = {0: np.float32(0.5), 1: np.float32(-1.5)}
    xs = [{d: rng.integers(-64, 64, n).astype(np.float32) for d in devs} for _ in range(4)]

    with _slow(100):
        comp = {d: accel.Stream(d) for d in devs}
        comm = {d: accel.Stream(d) for d in devs}
        params = {d: accel.Buffer(4 * n, device=d, stream=comp[d]).copy_from(p_np, stream=comp[d]) for d in devs}
        for step in range(4):
            g = {}
            done = {}
            for d in devs:
                g[d] = accel.Buffer(4 * n, device=d, stream=comp[d]).fill_(0, stream=comp[d])
                xb = accel.Buffer(4 * n, device=d, stream=comp[d]).copy_from(xs[step][d], stream=comp[d],
                                                                             non_blocking=True)
                accel.launch(k[d], _blocks(n), 256, a[d], xb, g[d], n, stream=comp[d])
                del xb
                done[d] = comp[d].record_event()
            # reduce-scatter: device d owns half d
            for d in devs:
                o = 1 - d
                comm[d].wait_event(done[o])                       # the other device's event
                recv = accel.Buffer(4 * half, device=d, stream=comm[d])
                recv.copy_from(g[o].as_array(np.float32, (half,), offset=4 * half * d), stream=comm[d],
                               non_blocking=True)
                g[o].record_stream(comm[d])
                comp[d].wait_event(comm[d].record_event())
                recv.record_stream(comp[d])
                own = g[d].as_array(np.float32, (half,), offset=4 * half * d)
                accel.launch(k[d], _blocks(half), 256, np.float32(1), recv, own, half, stream=comp[d])
                del recv, own
            reduced = {d: comp[d].record_event() for d in devs}
            # all-gather: device d takes the other's reduced half o
            for d in devs:
                o = 1 - d
                comm[d].wait_event(reduced[o])
                comm[d].wait_event(reduced[d])
                stage = accel.Buffer(4 * half, device=d, stream=comm[d])
                stage.copy_from(g[o].as_array(np.float32, (half,), offset=4 * half * o), stream=comm[d],
                                non_blocking=True)
                g[o].record_stream(comm[d])
                g[d].as_array(np.float32, (half,), offset=4 * half * o).copy_from(stage, stream=comm[d])
                comp[d].wait_event(comm[d].record_event())
                del stage
            for d in devs:
                accel.launch(k[d], _blocks(n), 256, np.float32(-lr * np.float32(0.5)), g[d], params[d], n,
                             stream=comp[d])
            del g
        got = {d: params[d].to_numpy(np.float32, stream=comp[d]) for d in devs}

    for step in range(4):
        gd = {d: saxpy_np(a[d], xs[step][d], np.zeros(n, np.float32)) for d in devs}
        full = np.empty(n, np.float32)
        for d in devs:
            sl = slice(half * d, half * (d + 1))
            full[sl] = saxpy_np(1.0, gd[1 - d][sl], gd[d][sl])
        p_np = saxpy_np(np.float32(-lr * np.float32(0.5)), full, p_np)
    for d in devs:
        assert np.array_equal(got[d], p_np), d
    assert process_state() == state
    for d in devs:
        check_stat_invariants(d, "data parallel")
    del params, comp, comm, done, reduced
    _check_baseline(base, "data parallel")


# -- 2. producer on device 1, consumer on device 0, pinned ring read by torch zero-copy ----------
@pytest.mark.parametrize("kind", TWO_DEVICE_SIMS)
def test_producer_consumer_across_devices_into_pinned_ring_read_by_torch(monkeypatch, kind, saxpy):
    """A producer thread (``device_index(1)``, side stream) makes item i as ``y = i x + b`` in a
    new Buffer and hands ``(buffer, event)`` through a bounded queue, keeping no reference.  The
    consumer thread (device 0, its own stream) waits for the event, pulls the buffer to device
    0, ``record_stream``s it on its stream and drops it with the copy in flight, downloads into
    row i % 3 of a pinned ring with ``copy_to(non_blocking=True)`` after that row's previous
    reader (torch) is done, and records the row's event.  The main thread reads each row through
    one ``torch.from_dlpack`` view of the ring made at the start, after the row's event.  Timing
    events bracket the consumer's work; ``elapsed_time`` against an event of device 1, and
    between events without ``enable_timing``, are refused with messages that say why."""
    torch = pytest.importorskip("torch")
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    k1 = saxpy(1)
    base = _baseline()
    state = process_state()
    n, items, R = 1024, 12, 3
    rng = np.random.default_rng(712)
    x_np = rng.integers(-50, 50, n).astype(np.float32)
    b_np = rng.integers(-9, 9, n).astype(np.float32)
    handoff = queue.Queue(maxsize=2)
    rows = queue.Queue()
    ring = accel.empty_pinned((R, n), np.float32)
    t_ring = torch.from_dlpack(ring)                  # zero copy: torch reads accel's pinned rows
    assert t_ring.data_ptr() == ring.ctypes.data
    row_free = [threading.Event() for _ in range(R)]
    for e in row_free:
        e.set()
    timing = {}

    def producer():
        with accel.device_index(1):
            s1 = accel.Stream()
            with s1:
                x = accel.Buffer(4 * n).copy_from(x_np, non_blocking=True)
                for i in range(items):
                    y = accel.Buffer(4 * n).copy_from(b_np, non_blocking=True)
                    accel.launch(k1, _blocks(n), 256, np.float32(i), x, y, n)
                    handoff.put((i, y, s1.record_event()), timeout=JOIN_S)
                    del y
                timing["dev1"] = accel.Event(enable_timing=True)
                timing["dev1"].record()
                handoff.put(None, timeout=JOIN_S)
                del x

    def consumer():
        s0 = accel.Stream(0)
        start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
        start.record(s0)
        while True:
            item = handoff.get(timeout=JOIN_S)
            if item is None:
                break
            i, y, ev = item
            del item
            s0.wait_event(ev)
            local = accel.Buffer(4 * n, device=0, stream=s0).copy_from(y, stream=s0, non_blocking=True)
            y.record_stream(s0)
            del y                                     # freed with the copy in flight
            r = i % R
            assert row_free[r].wait(JOIN_S), "torch never released the row"
            row_free[r].clear()
            local.copy_to(ring[r], stream=s0, non_blocking=True)
            del local
            rows.put((i, r, s0.record_event()))
        end.record(s0)
        timing["start"], timing["end"] = start, end
        rows.put(None)

    got = {}

    def reader():
        while True:
            item = rows.get(timeout=JOIN_S)
            if item is None:
                break
            i, r, ev = item
            ev.synchronize()
            got[i] = t_ring[r].clone().numpy()        # torch's copy of the row, then hand it back
            row_free[r].set()

    with _slow(80):
        _run_threads(producer, consumer, reader)

    for i in range(items):
        assert np.array_equal(got[i], saxpy_np(float(i), x_np, b_np)), i
    start, end, other = timing["start"], timing["end"], timing["dev1"]
    assert start.elapsed_time(end) >= 0.0
    with pytest.raises(accel.InvalidDeviceError, match="device") as info:
        start.elapsed_time(other)
    assert "1" in str(info.value) and "0" in str(info.value)
    plain0, plain1 = accel.Event(), accel.Event()
    s = accel.current_stream(0)
    plain0.record(s)
    plain1.record(s)
    with pytest.raises(ValueError, match="enable_timing"):
        plain0.elapsed_time(plain1)
    assert process_state() == state
    check_stat_invariants(0, "pipeline")
    check_stat_invariants(1, "pipeline")
    del t_ring, ring, start, end, other, timing, plain0, plain1, s, info   # (info's traceback holds events)
    _check_baseline(base, "pipeline")


# -- 3. reset and recapture while the old capture's static output is still held -----------------
def _pool_bytes(dev, pool) -> int:
    return sum(s["total_size"] for s in accel.memory.memory_snapshot()
               if s["device"] == dev and tuple(s["segment_pool_id"]) == tuple(pool))


@pytest.mark.parametrize("kind", GRAPH_SIMS)
def test_graph_reset_recapture_while_old_static_output_is_held(monkeypatch, kind, saxpy):
    """On the last device while device 0 is current: g captures ``out1 = 3 x`` (a temporary and
    the static output allocated in its private pool) and is replayed; the program keeps out1 and
    calls ``g.reset()``.  out1 keeps its bytes and its pool segment.  g is captured again with
    twice the size (a new private pool) and replayed 5 times with new inputs while out1 is read
    after each replay: out1 never changes, and the new outputs equal numpy's.  A second graph h
    captures into a MemPool made on the last device, whose blocks the program also allocates
    eagerly with ``use_mem_pool`` between h's replays.  Dropping everything gives back every byte
    and leaves no segment of any of the pools."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    dev = _devices()[-1]
    kern = saxpy(dev)
    base = _baseline()
    state = process_state()
    n = 2048
    rng = np.random.default_rng(713)
    side = accel.Stream(dev)
    cur = accel.current_stream(dev)
    sx = accel.Buffer(4 * n, device=dev)
    sx2 = accel.Buffer(8 * n, device=dev)
    side.wait_stream(cur)
    with side:                                          # warm-up off the capture
        t = accel.Buffer(8 * n).fill_(0)
        accel.launch(kern, _blocks(2 * n), 256, np.float32(1), sx2, t, 2 * n)
        del t
    cur.wait_stream(side)

    g = accel.Graph()
    with side, g:
        tmp = accel.Buffer(4 * n).fill_(0)
        accel.launch(kern, _blocks(n), 256, np.float32(3), sx, tmp, n)
        out1 = accel.Buffer(4 * n).copy_from(tmp)
        del tmp
    pool1 = g.pool()
    x1 = rng.integers(-100, 100, n).astype(np.float32)
    sx.copy_from(x1, stream=cur)
    g.replay()
    v1 = out1.to_numpy(np.float32, stream=cur)
    assert np.array_equal(v1, saxpy_np(3.0, x1, np.zeros(n, np.float32)))
    g.reset()
    settle()
    assert np.array_equal(out1.to_numpy(np.float32, stream=cur), v1), "reset changed a live output"
    assert _pool_bytes(dev, pool1) > 0, "the pool went while out1 lives in it"

    with side, g:                                       # recapture, another size
        tmp = accel.Buffer(8 * n).fill_(0)
        accel.launch(kern, _blocks(2 * n), 256, np.float32(-2), sx2, tmp, 2 * n)
        out2 = accel.Buffer(8 * n).copy_from(tmp)
        del tmp
    assert g.pool() != pool1
    for it in range(5):
        x2 = rng.integers(-100, 100, 2 * n).astype(np.float32)
        sx2.copy_from(x2, stream=cur)
        g.replay()
        assert np.array_equal(out2.to_numpy(np.float32, stream=cur),
                              saxpy_np(-2.0, x2, np.zeros(2 * n, np.float32))), it
        assert np.array_equal(out1.to_numpy(np.float32, stream=cur), v1), it

    with accel.device_index(dev):
        mp = accel.MemPool()
    h = accel.Graph(pool=mp.id)
    with side, h:
        out3 = accel.Buffer(4 * n).fill_(0)
        accel.launch(kern, _blocks(n), 256, np.float32(0.5), sx, out3, n)
    assert _pool_bytes(dev, mp.id) > 0
    eager = []
    for it in range(4):
        x = rng.integers(-100, 100, n).astype(np.float32)
        sx.copy_from(x, stream=cur)
        h.replay()
        with accel.use_mem_pool(mp, device=dev):
            e = accel.Buffer(4 * n, device=dev).copy_from(out3, stream=cur)
        eager.append((e, saxpy_np(0.5, x, np.zeros(n, np.float32))))
    for e, want in eager:
        assert np.array_equal(e.to_numpy(np.float32, stream=cur), want)
    assert process_state() == state
    check_stat_invariants(dev, "recapture")
    del eager, e, h, out3
    del g, out1, out2
    settle()
    assert _pool_bytes(dev, pool1) == 0
    del mp
    settle()
    assert not [s for s in accel.memory.memory_snapshot() if tuple(s["segment_pool_id"]) != (0, 0)]
    del sx, sx2, side, cur
    _check_baseline(base, "recapture")


# -- 4. fork_rng by hand over both devices, a user Generator's snapshots, a drawing thread -------
@contextlib.contextmanager
def fork_rng(devices):
    """torch.random.fork_rng's recipe: save every named device's state, restore it on exit."""
    R = accel.random
    saved = [(d, R.get_rng_state(d)) for d in devices]
    try:
        yield
    finally:
        for d, st in saved:
            R.set_rng_state(st, d)


def _offset_of(state) -> int:
    return int(np.frombuffer(bytes(np.asarray(state)), np.int64)[1])


def _seed_of(state) -> int:
    return int(np.frombuffer(bytes(np.asarray(state)), np.uint64)[0])


@pytest.mark.parametrize("kind", SIMS)
def test_fork_rng_generators_and_a_drawing_thread_across_devices(monkeypatch, kind):
    """Seeds every device, then: a draw on the last device (while device 0 is current); inside
    ``fork_rng([0, last])`` a reseed of device 0 and draws on both devices; after it, the draws
    continue exactly where they were before the block.  A Generator of the last device
    snapshotted with ``clone_state`` and rewound with ``graphsafe_set_state`` repeats its draw;
    used on a buffer of another device it draws there from its own stream (torch checks the
    device type only).  Device 0's state set
    on the last device makes it draw device 0's numbers.  A thread drawing 10 times from the
    Generator while the main thread draws from device 0's default generator: each sequence is
    the numpy Philox stream at consecutive offsets, undisturbed by the other."""
    use_sim(monkeypatch, kind)
    R = accel.random
    accel.set_device_index(0)
    last = _devices()[-1]
    for d in _devices():            # first use loads the RNG kernels (kept for the process)
        R.uniform_(accel.Buffer(16, device=d))
    base = _baseline()
    state = process_state()
    n = 1000

    def draw(dev, gen=None):
        b = accel.Buffer(4 * n, device=dev)
        R.uniform_(b, generator=gen)
        return b.to_numpy(np.float32)

    R.manual_seed_all(71)
    first = draw(last)
    assert np.array_equal(first, uniform_f32(71, 0, n))
    step = _offset_of(R.get_rng_state(last))
    assert step > 0 and step % 4 == 0
    with fork_rng([0, last]):
        R.manual_seed(5)                          # the current device only
        assert np.array_equal(draw(0), uniform_f32(5, 0, n))
        inside = draw(last)
        assert np.array_equal(inside, uniform_f32(71, step, n) if last else uniform_f32(5, step, n))
        assert _seed_of(R.get_rng_state(0)) == 5
    assert _seed_of(R.get_rng_state(0)) == 71 and _offset_of(R.get_rng_state(0)) == (step if last == 0 else 0)
    after = draw(last)
    assert np.array_equal(after, uniform_f32(71, step, n)), "fork_rng did not restore the last device"
    if last:
        assert np.array_equal(draw(0), uniform_f32(71, 0, n))

    gen = R.Generator(device=last, seed=2024)
    snap = gen.clone_state()
    a = draw(last, gen)
    gen.graphsafe_set_state(snap)
    assert np.array_equal(draw(last, gen), a)
    assert np.array_equal(a, uniform_f32(2024, 0, n))
    if last != 0:
        # a generator of another device draws too, as torch's (which checks the device type only)
        off = gen.get_offset()
        other = accel.Buffer(4 * n, device=0)
        R.uniform_(other, generator=gen)
        assert np.array_equal(other.to_numpy(np.float32), uniform_f32(2024, off, n))
        assert gen.get_offset() == off + step
        del other
        R.set_rng_state(R.get_rng_state(0), last)
        assert np.array_equal(draw(last), draw(0))

    R.manual_seed(9)
    gen.manual_seed(77)
    mine, theirs = [], []

    def drawer():
        for _ in range(10):
            theirs.append(draw(last, gen))

    t = threading.Thread(target=drawer)
    t.start()
    for _ in range(10):
        mine.append(draw(0))
    t.join(JOIN_S)
    assert not t.is_alive()
    for i in range(10):
        assert np.array_equal(mine[i], uniform_f32(9, i * step, n)), i
        assert np.array_equal(theirs[i], uniform_f32(77, i * step, n)), i
    assert process_state() == state
    del gen, snap, t
    _check_baseline(base, "rng")


# -- 5. both devices out of memory at once, from two threads -------------------------------------
@pytest.mark.parametrize("kind", TWO_DEVICE_SIMS)
@pytest.mark.parametrize("conf", ["", "expandable_segments:False"])
def test_two_threads_drive_both_devices_out_of_memory_at_once(monkeypatch, kind, conf):
    """Device 0 capped at 40 MiB and device 1 at 24 MiB (``set_per_process_memory_fraction``).
    A thread per device, on its own stream, allocates 4 MiB buffers (each filled with its own
    byte) until ``OutOfMemoryError``; both wait until both have failed, then free every second
    buffer and allocate as many again, which must succeed.  Each error message and each observer
    call names its own device and that device's cap; no device reserves more than its cap; the
    kept buffers still hold their bytes; ``num_ooms`` is one per device; the main thread's device
    and streams are untouched; lifting the caps and freeing gives every byte back."""
    use_sim(monkeypatch, kind, **({"ACCEL_ALLOC_CONF": conf} if conf else {}))
    accel.set_device_index(0)
    base = _baseline()
    state = process_state()
    chunk = 4 * MiB
    caps = {0: 40 * MiB, 1: 24 * MiB}
    for d, cap in caps.items():
        total = accel.get_device_properties(d).total_memory
        accel.memory.set_per_process_memory_fraction(cap / total, d)
    seen = []

    def observer(device, tried, allowed, free):
        seen.append((threading.current_thread().name, device, tried, allowed))

    accel.memory.attach_out_of_memory_observer(observer)
    both_failed = threading.Barrier(2, timeout=JOIN_S)
    out = {}

    def worker(d):
        def run():
            with accel.device_index(d):
                s = accel.Stream()
                with s:
                    held = []
                    try:
                        for _ in range(64):
                            held.append(accel.Buffer(chunk).fill_(d + 1))
                    except accel.OutOfMemoryError as exc:
                        out[d, "msg"] = str(exc)
                    else:
                        out[d, "msg"] = None
                    out[d, "count"] = len(held)
                    out[d, "peak_reserved"] = accel.memory.memory_reserved(d)
                    both_failed.wait()
                    kept = held[1::2]
                    freed = len(held) - len(kept)
                    del held
                    again = [accel.Buffer(chunk).fill_(d + 101) for _ in range(freed)]
                    out[d, "kept"] = [b.to_numpy() for b in kept]
                    out[d, "again"] = [b.to_numpy() for b in again]
                    del kept, again
                s.synchronize()
        run.__name__ = f"dev{d}"
        return run

    try:
        _run_threads(worker(0), worker(1))
    finally:
        accel.memory.detach_out_of_memory_observer(observer)
    for d, cap in caps.items():
        msg = out[d, "msg"]
        assert msg is not None, f"device {d} never ran out under a {cap >> 20} MiB cap"
        assert f"GPU {d}" in msg, msg
        assert 0 < out[d, "count"] * chunk <= cap, (d, out[d, "count"])
        assert out[d, "peak_reserved"] <= cap, (d, out[d, "peak_reserved"])
        assert all((a == d + 1).all() for a in out[d, "kept"]), d
        assert all((a == d + 101).all() for a in out[d, "again"]), d
        assert accel.memory.memory_stats(d)["num_ooms"] == 1, d
    by_device = sorted((dev, allowed) for _, dev, _, allowed in seen)
    assert [dev for dev, _ in by_device] == [0, 1], seen
    for dev, allowed in by_device:
        assert caps[dev] - MiB <= allowed <= caps[dev], (dev, allowed)
    assert process_state() == state
    for d in caps:
        check_stat_invariants(d, "oom threads")
        accel.memory.set_per_process_memory_fraction(1.0, d)
    del out
    _check_baseline(base, "oom threads")


# -- 6. two threads capture graphs on the two devices at the same time ----------------------------
@pytest.mark.parametrize("kind", GRAPH_SIMS)
@pytest.mark.parametrize("mode", ["thread_local", "relaxed"])
def test_two_threads_capture_on_two_devices_at_once_then_replay_concurrently(monkeypatch, kind, mode, saxpy):
    """Thread d (``device_index(d)``) warms up on its side stream, then, inside ``with s:``,
    ``g.capture_begin()``; both threads meet at a barrier while *both* captures are underway,
    allocate a temporary and a static output inside their capture (each from its own private
    pool), launch, and ``capture_end()``.  Then each replays its graph 12 times with new inputs,
    concurrently with the other, each result equal to numpy's; no capture is left underway, the
    main thread's device and streams are untouched, and everything comes back."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    devs = (0, 1)
    k = {d: saxpy(d) for d in devs}
    base = _baseline()
    state = process_state()
    n = 1024
    both_capturing = threading.Barrier(2, timeout=JOIN_S)
    both_ended = threading.Barrier(2, timeout=JOIN_S)
    results = {}

    def worker(d):
        def run():
            rng = np.random.default_rng([71, d])
            a = np.float32(d + 0.5)
            with accel.device_index(d):
                s = accel.Stream()
                sx = accel.Buffer(4 * n)
                s.wait_stream(accel.current_stream())
                with s:
                    w = accel.Buffer(4 * n).fill_(0)
                    accel.launch(k[d], _blocks(n), 256, a, sx, w, n)
                    del w
                    s.synchronize()
                    g = accel.Graph(capture_error_mode=mode)
                    g.capture_begin()
                    try:
                        both_capturing.wait()
                        assert accel.is_current_stream_capturing()
                        tmp = accel.Buffer(4 * n).fill_(0)
                        accel.launch(k[d], _blocks(n), 256, a, sx, tmp, n)
                        out = accel.Buffer(4 * n).copy_from(tmp)
                        del tmp
                    finally:
                        g.capture_end()
                    assert not accel.is_current_stream_capturing()
                both_ended.wait()
                cur = accel.current_stream()
                got = []
                for it in range(12):
                    x = rng.integers(-100, 100, n).astype(np.float32)
                    sx.copy_from(x, stream=cur)
                    g.replay()
                    got.append((x, out.to_numpy(np.float32, stream=cur)))
                results[d] = (a, got)
                del g, out, sx, s
        return run

    with _slow(50):
        _run_threads(worker(0), worker(1))
    for d in devs:
        a, got = results[d]
        for it, (x, y) in enumerate(got):
            assert np.array_equal(y, saxpy_np(a, x, np.zeros(n, np.float32))), (d, it)
    assert process_state() == state
    del results
    _check_baseline(base, "parallel captures")


# -- 7. (CUDA) an NVRTC-compiled kernel with a mixed signature, on device 1, eager and captured ---
SCALE_SHIFT_SRC = r'''
extern "C" __global__ void scale_shift(int n, double alpha, const float *x, float *y, int shift)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = (float)(alpha * (double)x[i]) + (float)shift;
}
'''


def _scale_shift_ref(grid, block, view, n, alpha, x, y, shift):
    n = min(n, grid[0] * block[0])
    xs = view(x, 4 * n, np.float32)
    view(y, 4 * n, np.float32)[:] = (np.float64(alpha) * xs.astype(np.float64)).astype(np.float32) + np.float32(shift)


def _scale_shift_np(n, alpha, x, shift):
    return (np.float64(alpha) * x[:n].astype(np.float64)).astype(np.float32) + np.float32(shift)


def test_nvrtc_kernel_mixed_signature_on_device1_eager_and_captured(monkeypatch):
    """``accel.compile`` (real NVRTC) turns CUDA C with an int, a double, two pointers and an int
    into PTX; the program registers its reference and loads the module on device 1 while device
    0 is current.  Launched with a negative int and no signature it is refused with a message
    naming the signature to pass (PTX declares a C int as .u32); with it, it runs on a side
    stream of device 1.  The program then captures a launch into a graph
    and replays it with new inputs and ``n`` smaller than the buffers (the tail stays as it
    was).  Misuse: a stream of device 0, a float where the int goes, too few arguments, and a
    source that does not compile (``CompileError`` naming the program)."""
    from accel import sim
    from test_nvrtc import _nvrtc_or_skip
    _nvrtc_or_skip()
    use_sim(monkeypatch, "cuda")
    accel.set_device_index(0)
    base = _baseline()
    state = process_state()
    try:
        prog = accel.compile(SCALE_SHIFT_SRC, name="scale_shift.cu")
    except RuntimeError as exc:
        if "nvrtc" in str(exc).lower() and "install" in str(exc).lower():
            pytest.skip(str(exc))
        raise
    sim.register_kernel("scale_shift", _scale_shift_ref, "i32, f64, ptr, ptr, i32")
    try:
        mod = accel.Module(prog.ptx, device=1)
        n = 3000
        rng = np.random.default_rng(717)
        s1 = accel.Stream(1)
        x = accel.Buffer(4 * n, device=1, stream=s1)
        y = accel.Buffer(4 * n, device=1, stream=s1)
        xs = rng.standard_normal(n).astype(np.float32)
        x.copy_from(xs, stream=s1)
        y.fill_(0, stream=s1)
        # PTX declares a C int as .u32: a negative int needs the signed type named, and says so
        with pytest.raises(ValueError, match=r"name its type"):
            accel.launch(mod.function("scale_shift"), _blocks(n), 256, n, 1.0 / 3.0, x, y, -7, stream=s1)
        kern = mod.function("scale_shift", "i32, f64, ptr, ptr, i32")
        accel.launch(kern, _blocks(n), 256, n, 1.0 / 3.0, x, y, -7, stream=s1)
        assert np.array_equal(y.to_numpy(np.float32, stream=s1), _scale_shift_np(n, 1.0 / 3.0, xs, -7))
        assert accel.current_device_index() == 0

        with pytest.raises(ValueError, match="device 1"):
            accel.launch(kern, _blocks(n), 256, n, 1.0, x, y, 0, stream=accel.current_stream(0))
        with pytest.raises(TypeError, match="scale_shift"):
            accel.launch(kern, _blocks(n), 256, float(n), 1.0, x, y, 0, stream=s1)
        with pytest.raises((TypeError, ValueError), match="scale_shift"):
            accel.launch(kern, _blocks(n), 256, n, 1.0, x, y, stream=s1)

        g = accel.Graph()
        m = n - 100
        with s1, g:
            accel.launch(kern, _blocks(m), 256, m, 2.5, x, y, 3)
        tail = y.to_numpy(np.float32, stream=s1)[m:]
        for it in range(5):
            xs = rng.standard_normal(n).astype(np.float32)
            x.copy_from(xs, stream=s1)
            with s1:
                g.replay()
            got = y.to_numpy(np.float32, stream=s1)
            assert np.array_equal(got[:m], _scale_shift_np(m, 2.5, xs, 3)), it
            assert np.array_equal(got[m:], tail), it

        with pytest.raises(accel.CompileError) as info:
            accel.compile(SCALE_SHIFT_SRC.replace("(float)shift;", "(float)shift"), name="broken.cu")
        assert "broken.cu" in str(info.value)
        assert process_state() == state
        del g, x, y, s1, kern, mod
    finally:
        sim.unregister_kernel("scale_shift")
    _check_baseline(base, "nvrtc")


# -- 8. a worker forked after init falls back to numpy; the parent goes on -----------------------
def test_worker_forked_after_init_falls_back_to_numpy_parent_untouched(monkeypatch):
    """The parent seeds, draws on device 1, keeps a Buffer there and a pinned array, and forks a
    worker (a DataLoader-style worker with the 'fork' start method).  In the worker, as in torch:
    ``device_count()`` and ``is_available()`` answer, ``is_initialized()`` is False, seeding
    raises nothing, and every call that needs the device (a new Buffer, the current device,
    properties, the parent's Buffer) raises the fork error, which names
    the runtime and 'spawn'.  The worker computes with numpy from the inherited pinned array and
    reports through a pipe.  The parent's memory, its RNG offset and its Buffer's bytes are as
    before."""
    use_sim(monkeypatch, "cuda")
    R = accel.random
    accel.set_device_index(0)
    base = _baseline()
    R.manual_seed_all(33)
    n = 512
    b = accel.Buffer(4 * n, device=1)
    R.uniform_(b)
    drawn = b.to_numpy(np.float32)
    pinned = accel.empty_pinned(n, np.float32)
    pinned[:] = np.arange(n, dtype=np.float32)
    state_before = bytes(np.asarray(R.get_rng_state(1)))
    allocated = (accel.memory.memory_allocated(0), accel.memory.memory_allocated(1))
    r, w = os.pipe()

    def child():
        os.close(r)
        report = []

        def attempt(name, fn):
            try:
                value = fn()
                report.append(f"{name}=ok:{value!r}")
            except Exception as exc:
                report.append(f"{name}={type(exc).__name__}:{exc}")
        attempt("count", accel.device_count)
        attempt("available", accel.is_available)
        attempt("initialized", accel.is_initialized)
        attempt("seed", lambda: R.manual_seed(3))
        attempt("seed_all", lambda: R.manual_seed_all(3))
        attempt("buffer", lambda: accel.Buffer(16))
        attempt("current", accel.current_device_index)
        attempt("props", lambda: accel.get_device_properties(1).name)
        attempt("parent_buffer", lambda: b.to_numpy(np.float32))
        attempt("numpy", lambda: float((pinned * 2).sum()))
        os.write(w, "\n".join(report).encode())
        os.close(w)
        return 0

    code = run_forked(child, timeout=30)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        lines = f.read().decode().split("\n")
    assert code == 0, lines
    rep = dict(line.split("=", 1) for line in lines)
    assert rep["count"] == "ok:2", rep
    assert rep["available"] == "ok:True", rep
    assert rep["initialized"] == "ok:False", rep
    assert rep["numpy"] == f"ok:{float((np.arange(n, dtype=np.float32) * 2).sum())!r}", rep
    for call in ("seed", "seed_all"):
        assert rep[call] == "ok:None", (call, rep[call])
    for call in ("buffer", "current", "props", "parent_buffer"):
        assert rep[call].startswith("RuntimeError:Cannot re-initialize CUDA in forked subprocess"), (call, rep[call])
        assert "'spawn'" in rep[call], rep[call]
    assert bytes(np.asarray(R.get_rng_state(1))) == state_before
    assert (accel.memory.memory_allocated(0), accel.memory.memory_allocated(1)) == allocated
    assert np.array_equal(b.to_numpy(np.float32), drawn)
    assert np.array_equal(pinned, np.arange(n, dtype=np.float32))
    R.uniform_(b)
    assert np.array_equal(b.to_numpy(np.float32), uniform_f32(33, _offset_of(state_before), n))
    del b, pinned
    _check_baseline(base, "fork worker")


# (r71e found; fixed in session 31)
def test_rng_queries_in_a_worker_forked_after_init_raise_the_fork_error():
    """torch.cuda.get_rng_state, initial_seed and get_rng_state_all begin with ``_lazy_init()``,
    so in a child forked after initialization each raises "Cannot re-initialize CUDA in forked
    subprocess" (torch 2.13, torch/cuda/random.py), and ``manual_seed`` there is only queued
    (``is_initialized()`` is False in a bad fork, so ``_lazy_call`` queues it) and never seen.
    A DataLoader worker that derives its seeds from ``get_rng_state()`` fails loudly under
    torch; under accel it silently reads state it cannot use."""
    import subprocess
    import sys
    code = r"""
import os, numpy as np, accel
R = accel.random
R.manual_seed_all(33)
b = accel.Buffer(64, device=1)
R.uniform_(b)
pid = os.fork()
if pid == 0:
    out = []
    R.manual_seed(3)
    for name, fn in [("get_rng_state", lambda: R.get_rng_state(1)), ("initial_seed", R.initial_seed),
                     ("get_rng_state_all", R.get_rng_state_all)]:
        try:
            fn()
            out.append(name + "=answered")
        except RuntimeError as exc:
            out.append(name + "=" + ("fork error" if "forked subprocess" in str(exc) else str(exc)))
    print(";".join(out), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""
    env = dict(os.environ, ACCEL_SIM="cuda", ACCEL_SIM_DEVICES="2")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "get_rng_state=fork error;initial_seed=fork error;get_rng_state_all=fork error"


# -- 9. pinned arrays that torch keeps after numpy let go ----------------------------------------
@pytest.mark.parametrize("kind", SIMS)
def test_pinned_arrays_kept_by_torch_after_numpy_drops_them(monkeypatch, kind):
    """A loader allocates pinned rows with ``accel.empty_pinned``, hands each to torch with
    ``torch.from_dlpack`` and drops its numpy array at once, with an asynchronous download from
    the last device (``copy_to(non_blocking=True)``) still queued into it: the download lands in
    the memory torch reads after the row's event; a new pinned
    array made while torch holds the others never aliases them (writing it changes no torch
    tensor).  ``host_memory_stats`` counts torch's rows as allocated until torch drops them,
    then zero.  A device Buffer asked for as host memory (``numpy.from_dlpack(buf,
    device="cpu")``) raises BufferError saying accel does not copy on export."""
    torch = pytest.importorskip("torch")
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    last = _devices()[-1]
    base = _baseline()
    n, rows = 2048, 4
    s = accel.Stream(last)
    bufs = [accel.Buffer(4 * n, device=last, stream=s) for _ in range(rows)]
    want = []
    for i, b in enumerate(bufs):
        v = (np.arange(n, dtype=np.float32) + 1000 * i)
        b.copy_from(v, stream=s, non_blocking=True)
        want.append(v)
    held, addrs, events = [], [], []
    for b in bufs:
        row = accel.empty_pinned(n, np.float32)
        b.copy_to(row, stream=s, non_blocking=True)
        events.append(s.record_event())
        t = torch.from_dlpack(row)
        assert t.data_ptr() == row.ctypes.data
        addrs.append(row.ctypes.data)
        held.append(t)
        del row, t                      # numpy lets go; torch keeps the memory
    gc.collect()
    assert accel.memory.host_memory_stats()["allocated_bytes.current"] >= rows * 4 * n
    other = accel.empty_pinned(n, np.float32)
    lo, hi = other.ctypes.data, other.ctypes.data + other.nbytes
    assert not any(lo < a + 4 * n and a < hi for a in addrs), "a pinned block torch holds was handed out again"
    other[:] = -1
    for i, (t, ev) in enumerate(zip(held, events)):
        ev.synchronize()
        assert np.array_equal(t.numpy(), want[i]), i
    assert np.from_dlpack(bufs[0].as_array(np.float32), device="cpu").shape == (n,)   # a host copy (r80b)
    del held, other, t, events, ev, bufs, b, s
    gc.collect()
    _check_baseline(base, "pinned torch")


# -- 10. a captured step that pulls a shard from the other device ----------------------------------
@pytest.mark.parametrize("kind", GRAPH_SIMS)
def test_captured_step_pulls_a_shard_from_the_other_device(monkeypatch, kind):
    """Device 0 current.  The step (captured on a side stream of device 0) copies a device-1
    shard into a temporary of the graph's pool and from there into a static output.  The first
    attempt has no warm-up: device 1's expandable-segment memory cannot be opened to device 0
    during a capture, and the CaptureError names the fix (a warm-up copy or
    ``device_allocator(1).add_peer(0)``); nothing is left capturing and the graph captures
    again once the program follows it.  Then, 6 times: device 1's upload stream writes a new
    shard, device 0's current stream waits for its event, the graph replays, the upload stream
    waits for the replay's event before the next write; every output equals its shard, under
    a per-operation delay."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    base = _baseline()
    state = process_state()
    n = 4096
    src1 = accel.Buffer(4 * n, device=1)
    out0 = accel.Buffer(4 * n, device=0)
    side = accel.Stream(0)
    g = accel.Graph()

    def step():
        tmp = accel.Buffer(4 * n).copy_from(src1)          # device 1 -> device 0, captured
        out0.copy_from(tmp)

    with pytest.raises(accel.CaptureError, match=r"add_peer\(0\)"):
        with side, g:
            step()
    assert not side.is_capturing() and not accel.is_current_stream_capturing()
    accel.memory.device_allocator(1).add_peer(0)
    with side, g:
        step()
    up1 = accel.Stream(1)
    cur0 = accel.current_stream(0)
    got = []
    with _slow(100):
        for i in range(6):
            src1.copy_from(np.full(n, i, np.float32), stream=up1, non_blocking=True)
            cur0.wait_event(up1.record_event())
            g.replay()
            up1.wait_event(cur0.record_event())
            got.append(out0.to_numpy(np.float32, stream=cur0))
    for i, a in enumerate(got):
        assert (a == i).all(), i
    assert process_state() == state
    del g, src1, out0, side, up1, cur0
    _check_baseline(base, "cross-device capture")
