"""Realistic user programs, r73a: three programs as a torch.accelerator user writes them, run on the
CUDA and Level Zero ("xpu") simulators with two devices; every result is compared with numpy, and
after each program the allocator's counters, ``memory_snapshot()`` and the simulator's objects
agree with what is still alive (nothing, at the end).

Earlier rounds (test_user_programs*.py, _r41 .. _r72b) took loader rings, GPipe, a worker-owned
graph per thread (r67h), OOM loops, fork pools and DLPack.  These take:

1. an inference server: two worker threads per device, each with its own Stream, serving requests
   of varying sizes padded to buckets; one graph per (device, bucket), captured once by the first
   worker that needs it (``thread_local`` mode, under a capture lock) into *one* graph pool shared
   by every bucket of every device (``accel.graph(g, pool=handle)``); inputs staged through
   pinned host buffers with ``non_blocking`` copies; the two workers of a device order their use
   of its static buffers with Events only (the lock is released before the work ran); a third
   thread calls ``memory.empty_cache()`` (under the capture lock), ``memory_stats()`` and
   ``memory_snapshot()`` meanwhile; at the end every Stream and Graph is dropped and
   ``memory_stats()`` / ``memory_snapshot()`` agree and show nothing allocated;
2. a training loop on device 1 while device 0 stays current: the optimizer state in a MemPool
   (``use_mem_pool(pool, device=1)``), gradients uploaded on a side stream and handed to the
   compute stream with ``record_stream``, activations kept alive while
   ``set_per_process_memory_fraction`` is lowered step by step until an OutOfMemoryError, then
   recovery (activations freed, ``empty_cache``, the fraction left low) and more steps: the
   weights equal numpy's at every check, the pool's blocks never move;
3. a generator- and context-manager-heavy program: ``with accel.Stream(d):`` / ``with stream:``
   nested across devices inside generators, exceptions raised at every depth, generators
   abandoned mid-iteration (closed, dropped, dropped inside another ``with``, collected as a
   cycle, closed while a newer block is still entered): the current device and the current
   stream of each device are restored exactly, in the main thread and in a worker thread.

Every thread is joined with a timeout and asserted finished.
"""

import gc
import threading

import numpy as np
import pytest

import accel
from conftest import use_sim
from test_user_kernels import expected as saxpy_np
from test_user_programs import JOIN_S, _devices, live_objects, process_state, settle
from test_user_programs_r56 import saxpy  # noqa: F401  (fixture: the saxpy kernel per simulator)
from test_user_programs_r66b import _slow, check_stat_invariants

MiB = 1 << 20
KINDS = ("cuda", "xpu")


def _blocks(n: int) -> int:
    return (n + 255) // 256


def _run_threads(targets, timeout=JOIN_S):
    """Run each callable in a thread of its own; every thread must finish within ``timeout``;
    the first exception is raised here."""
    errors = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as exc:          # raised below, in the test's thread
                errors.append(exc)
        return run
    threads = [threading.Thread(target=wrap(t), name=f"r73a-{i}", daemon=True) for i, t in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"threads hung: {hung}"
    if errors:
        raise errors[0]


def _snapshot_totals(d: int):
    """(segments, reserved bytes, allocated bytes, active blocks) of device ``d`` in memory_snapshot()."""
    segs = [s for s in accel.memory.memory_snapshot() if s["device"] == d]
    blocks = [b for s in segs for b in s["blocks"]]
    return (len(segs), sum(s["total_size"] for s in segs),
            sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
            sum(1 for b in blocks if b["state"] == "active_allocated"))


def _stats_agree_with_snapshot(d: int, where: str = "") -> None:
    """memory_stats(d) and memory_snapshot() tell the same story.  (Segments are compared by
    bytes: an expandable segment is listed once per mapped range, as torch's snapshot does.)"""
    check_stat_invariants(d, where)
    if _async():
        return          # its snapshot has no segments (torch's CudaMallocAsyncAllocator)
    st = accel.memory.memory_stats(d)
    segs, reserved, allocated, active = _snapshot_totals(d)
    assert (st["reserved_bytes.all.current"], st["allocated_bytes.all.current"],
            st["allocation.all.current"]) == (reserved, allocated, active), (where, d)
    assert (segs == 0) == (st["segment.all.current"] == 0), (where, d, segs)


def _async() -> bool:
    return "cudaMallocAsync" in accel.memory.get_allocator_settings()


# -- 1. an inference server: bucketed graphs in one shared pool, two workers per device -----------
BUCKETS = (64, 256, 1024)
SCALE = {64: 2.0, 256: -0.5, 1024: 3.0}


def _bucket(n: int) -> int:
    return next(b for b in BUCKETS if b >= n)


def _oracle(bucket: int, x: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """The captured body: t = a x + bias; out = t; out = 1 x + out (float32, as the kernel)."""
    t = saxpy_np(SCALE[bucket], x, bias)
    return saxpy_np(1.0, x, t)


class DeviceModel:
    """Per device: the kernel, the static inputs, biases and outputs of each bucket's graph,
    the graphs (captured on first use), a lock for enqueuing and the event of the last work
    queued on the static buffers (the next request's stream waits for it)."""

    def __init__(self, dev, kernel, pool):
        self.dev, self.kernel, self.pool = dev, kernel, pool
        self.lock = threading.Lock()
        self.last = None
        self.graphs, self.outs = {}, {}
        self.bias_host = {b: ((np.arange(b, dtype=np.float32) % 17) - 8 + dev) / 4 for b in BUCKETS}
        self.x = {b: accel.Buffer(4 * b, device=dev).fill_(0) for b in BUCKETS}
        self.bias = {b: accel.Buffer(4 * b, device=dev).copy_from(self.bias_host[b]) for b in BUCKETS}
        self.captures = 0

    def capture(self, b, capture_lock):
        """Capture bucket ``b``'s graph (called with self.lock held): a temporary and the output
        are allocated inside the capture, from the shared pool."""
        with capture_lock:
            cs = accel.Stream(self.dev)
            if self.last is not None:
                cs.wait_event(self.last)
            g = accel.Graph()
            with accel.graph(g, pool=self.pool, stream=cs, capture_error_mode="thread_local"):
                tmp = accel.Buffer(4 * b, device=self.dev)
                tmp.copy_from(self.bias[b], non_blocking=True)
                accel.launch(self.kernel, _blocks(b), 256, np.float32(SCALE[b]), self.x[b], tmp, b)
                out = accel.Buffer(4 * b, device=self.dev)
                out.copy_from(tmp, non_blocking=True)
                accel.launch(self.kernel, _blocks(b), 256, np.float32(1.0), self.x[b], out, b)
                del tmp                          # its block goes back to the shared pool
            self.graphs[b], self.outs[b] = g, out
            self.captures += 1


def _serve_one(model, stream, pinned_in, pinned_out, x, capture_lock):
    n = x.size
    b = _bucket(n)
    pin_in, pin_out = pinned_in[b], pinned_out[b]
    pin_in[:n] = x
    pin_in[n:] = 0
    pin_out[:] = np.nan
    with model.lock:
        if b not in model.graphs:
            model.capture(b, capture_lock)
        if model.last is not None:
            stream.wait_event(model.last)          # the other worker's replay still reads x[b]
        model.x[b].copy_from(pin_in, stream=stream, non_blocking=True)
        with stream:
            model.graphs[b].replay()
        model.outs[b].copy_to(pin_out, stream=stream, non_blocking=True)
        done = stream.record_event()
        model.last = done
    done.synchronize()                             # outside the lock: the other worker goes on
    got = pin_out[:n].copy()
    want = _oracle(b, x, model.bias_host[b][:n])
    return np.array_equal(got, want), b


@pytest.mark.parametrize("kind,conf", [("cuda", ""), ("cuda", "expandable_segments:False"),
                                       ("cuda", "backend:cudaMallocAsync"), ("xpu", "")])
def test_inference_server_bucketed_graphs_shared_pool_two_workers_per_device(monkeypatch, kind, conf, saxpy):
    """Four workers (two per device; a worker's thread keeps the *other* device current) each
    serve 24 requests of seeded random sizes 1..1024 through pinned staging buffers of their
    own: pad to the bucket, upload non_blocking on the worker's stream after the device's last
    event, replay the bucket's graph there, download non_blocking, record an event, and only
    then release the device's lock; the response is read after the event.  The graphs of all
    buckets on both devices share one pool (``graph_pool_handle()``), each captured exactly
    once.  A control thread loops over memory_stats / memory_snapshot / empty_cache (the last
    under the capture lock) until the workers finish.  Every response equals numpy's; then the
    graphs, streams, events and buffers are dropped: memory_stats and memory_snapshot agree at
    every step and show nothing allocated, and after empty_cache nothing reserved."""
    use_sim(monkeypatch, kind, **({"PYTORCH_ALLOC_CONF": conf} if conf else {}))
    accel.set_device_index(0)
    devs = _devices()
    assert len(devs) == 2
    settle()
    base_live = live_objects()
    state = process_state()
    pool = accel.graphs.graph_pool_handle()
    models = {d: DeviceModel(d, saxpy(d), pool) for d in devs}
    capture_lock = threading.Lock()
    stop = threading.Event()
    results, control_rounds = [], [0]
    per_worker = 24

    def worker(t):
        dev = devs[t % 2]
        accel.set_device_index(devs[(t + 1) % 2])       # the worker's device is not current
        before = process_state()
        stream = accel.Stream(dev)
        pinned_in = {b: accel.empty_pinned(b, np.float32) for b in BUCKETS}
        pinned_out = {b: accel.empty_pinned(b, np.float32) for b in BUCKETS}
        rng = np.random.default_rng([73, t])
        for i in range(per_worker):
            n = int(rng.choice([rng.integers(1, 65), rng.integers(65, 257), rng.integers(257, 1025)]))
            x = (rng.integers(-64, 64, n) / 8).astype(np.float32)
            ok, b = _serve_one(models[dev], stream, pinned_in, pinned_out, x, capture_lock)
            results.append((t, i, n, b, ok))
        assert process_state() == before
        del stream, pinned_in, pinned_out

    def control():
        while not stop.is_set():
            for d in devs:
                st = accel.memory.memory_stats(d)
                assert st["allocated_bytes.all.current"] <= st["reserved_bytes.all.current"]
            accel.memory.memory_snapshot()
            with capture_lock:                           # empty_cache during a capture is refused
                accel.memory.empty_cache()
            accel.memory.empty_host_cache()
            control_rounds[0] += 1

    control_thread = threading.Thread(target=control, name="r73a-control", daemon=True)
    control_thread.start()
    try:
        with _slow(10 if kind == "cuda" else 0):        # queued work really is queued (CUDA)
            _run_threads([lambda t=t: worker(t) for t in range(4)])
    finally:
        stop.set()
        control_thread.join(JOIN_S)
    assert not control_thread.is_alive(), "control thread hung"
    assert control_rounds[0] >= 1
    assert len(results) == 4 * per_worker
    bad = [r for r in results if not r[4]]
    assert not bad, f"wrong responses: {bad[:5]}"
    served = {(t % 2, b) for t, _, _, b, _ in results}
    for d in devs:
        assert models[d].captures == len({b for dd, b in served if dd == d})
        assert set(models[d].graphs) == {b for dd, b in served if dd == d}
    assert process_state() == state
    # the graphs share the pool: its segments are listed under the one id, on each device
    for d in devs:
        accel.synchronize(d)
        pool_segs = [s for s in accel.memory.memory_snapshot(mempool_id=pool) if s["device"] == d]
        assert bool(pool_segs) != _async(), f"device {d}: no segment of the shared pool"
        assert all(tuple(s["segment_pool_id"]) == tuple(pool) for s in pool_segs)
        _stats_agree_with_snapshot(d, "after serving")
    # shutdown with a last request in flight on each device: its stream, its graph and the
    # static buffers are dropped as soon as the work is queued; the response still arrives
    finals = []
    with _slow(2000 if kind == "cuda" else 0):
        for d in devs:
            m = models[d]
            b = max(m.graphs)
            x = (np.arange(b) % 13 - 6).astype(np.float32) / 2
            pin_in, pin_out = accel.empty_pinned(b, np.float32), accel.empty_pinned(b, np.float32)
            pin_in[:] = x
            pin_out[:] = np.nan
            last = accel.Stream(d)
            last.wait_event(m.last)
            m.x[b].copy_from(pin_in, stream=last, non_blocking=True)
            with last:
                m.graphs[b].replay()
            m.outs[b].copy_to(pin_out, stream=last, non_blocking=True)
            finals.append((last.record_event(), pin_in, pin_out, _oracle(b, x, m.bias_host[b])))
            del last
            m.graphs.clear()                 # a replay still queued
            m.outs.clear()
            m.last = None
            m.x.clear()
            m.bias.clear()
        for done, _, pin_out, want in finals:
            done.synchronize()
            assert np.array_equal(pin_out, want)
    del finals, done, pin_in, pin_out, _
    for d in devs:
        accel.synchronize(d)
        _stats_agree_with_snapshot(d, "graphs and buffers dropped")
    del models, m
    gc.collect()
    for d in devs:
        accel.synchronize(d)
        st = accel.memory.memory_stats(d)
        assert st["allocated_bytes.all.current"] == 0, d
        _stats_agree_with_snapshot(d, "all dropped")
        assert _snapshot_totals(d)[2:] == (0, 0)
    accel.memory.empty_cache()
    for d in devs:
        st = accel.memory.memory_stats(d)
        # blocks freed with uses on the workers' streams stay active until their events are
        # processed (torch: process_events, in malloc and emptyCache)
        assert st["reserved_bytes.all.current"] == st["active_bytes.all.current"] == 0, d
        assert _snapshot_totals(d) == (0, 0, 0, 0), d
    assert accel.memory.memory_snapshot(mempool_id=pool) == []
    settle()
    assert live_objects() == base_live
    assert accel.memory.host_memory_stats()["allocated_bytes.current"] == 0


# -- 2. a training loop on device 1 (device 0 current): MemPool state, record_stream, fraction OOM --
TRAIN_CONFS = [("cuda", ""), ("cuda", "expandable_segments:False"), ("xpu", "")]


def _pool_blocks(pool) -> dict:
    """address -> state of every block in ``pool``'s segments."""
    return {b["address"]: b["state"] for s in pool.snapshot() for b in s["blocks"]}


@pytest.mark.parametrize("kind,conf", TRAIN_CONFS)
def test_training_on_device1_mempool_state_fraction_oom_then_recovers(monkeypatch, kind, conf, saxpy):
    """SGD with momentum (m += g; w -= lr m, both through the user kernel) on device 1 while
    device 0 stays current in the main thread.  w and m are allocated under
    ``use_mem_pool(pool, device=1)`` (a helper thread allocating meanwhile does not land in the
    pool); each step uploads its gradient from a pinned ring row on a side stream, the compute
    stream waits on the upload's event, the gradient gets ``record_stream(compute)`` and is
    dropped with the kernels queued.  Each step also keeps a 3 MiB activation alive and lowers
    device 1's fraction to what is reserved plus a shrinking slack, until an allocation raises
    OutOfMemoryError.  The program then frees the activations, empties the cache and retries
    the step under the same low fraction, then runs more steps.  Then the model grows a layer
    whose weights and state are allocated under ``use_mem_pool`` with 6 MiB left: the
    OutOfMemoryError raised inside the block ends the route (``use_count()`` back to 1, the next
    allocation lands outside the pool); with more room the same allocations land in the pool and
    both layers train.  After every step the weights and state equal numpy's; the pool's blocks
    stay where they were; device 0 is never touched; at the end everything is freed and nothing
    is reserved.  (``launch`` and ``copy_from`` note their streams' uses themselves, so the
    record_stream calls are what a careful user adds, not what keeps the results right.)"""
    env = {"PYTORCH_ALLOC_CONF": conf} if conf else {}
    use_sim(monkeypatch, kind, **env)
    accel.set_device_index(0)
    d = 1
    settle()
    base_live = live_objects()
    state = process_state()
    total = accel.memory.get_memory_info(d)[1]
    kernel = saxpy(d)
    n = 32 * 1024
    lr = np.float32(1 / 64)
    rng = np.random.default_rng(7301)
    w_np = (rng.integers(-256, 256, n) / 16).astype(np.float32)
    m_np = np.zeros(n, np.float32)

    with accel.device_index(d):
        pool = accel.MemPool()
    assert pool.device_index == d
    compute, side = accel.Stream(d), accel.Stream(d)
    helper_bufs = []
    with accel.use_mem_pool(pool, device=d):
        w = accel.Buffer(4 * n, device=d, stream=compute).copy_from(w_np, stream=compute)
        m = accel.Buffer(4 * n, device=d, stream=compute).fill_(0, stream=compute)
        # another thread's allocations go where they always go
        _run_threads([lambda: helper_bufs.append(accel.Buffer(4 * n, device=d))])
    assert accel.current_device_index() == 0
    blocks = _pool_blocks(pool)
    assert blocks.get(w.ptr) == "active_allocated" and blocks.get(m.ptr) == "active_allocated", blocks
    assert helper_bufs[0].ptr not in blocks
    del helper_bufs
    ring = accel.empty_pinned((2, n), np.float32)
    ring_done = [None, None]
    acts, ooms, history = [], [], []

    def step(i):
        """One step; the oracle advances only when the step's work was queued whole."""
        g_host = (rng.integers(-64, 64, n) / 32).astype(np.float32)
        act = accel.Buffer(3 * MiB, device=d, stream=compute)       # forward: kept for "backward"
        act.fill_(i & 0xFF, stream=compute)
        slot = i % 2
        if ring_done[slot] is not None:
            ring_done[slot].synchronize()                           # the row's last upload is done
        ring[slot] = g_host
        g = accel.Buffer(4 * n, device=d, stream=side)
        g.copy_from(ring[slot], stream=side, non_blocking=True)
        ring_done[slot] = side.record_event()
        compute.wait_event(ring_done[slot])
        g.record_stream(compute)
        accel.launch(kernel, _blocks(n), 256, np.float32(1.0), g, m, n, stream=compute)
        accel.launch(kernel, _blocks(n), 256, -lr, m, w, n, stream=compute)
        del g                                   # freed with both kernels queued
        acts.append(act)
        oracle["m"] = saxpy_np(1.0, g_host, oracle["m"])
        oracle["w"] = saxpy_np(-lr, oracle["m"], oracle["w"])

    oracle = {"m": m_np, "w": w_np}

    def check(where):
        assert np.array_equal(m.to_numpy(np.float32, stream=compute), oracle["m"]), where
        assert np.array_equal(w.to_numpy(np.float32, stream=compute), oracle["w"]), where
        assert _pool_blocks(pool).get(w.ptr) == "active_allocated", where
        assert _pool_blocks(pool).get(m.ptr) == "active_allocated", where
        assert accel.memory.memory_allocated(0) == 0, where
        assert process_state() == state, where
        history.append(where)

    with _slow(1000):                           # the kernels run well after the next upload is queued
        i = 0
        slack = 48 * MiB
        while not ooms:
            assert i < 24, "the fraction never ran out"
            accel.memory.set_per_process_memory_fraction(
                min(1.0, (accel.memory.memory_reserved(d) + slack) / total), d)
            slack = max(0, slack - 8 * MiB)
            try:
                step(i)
            except accel.OutOfMemoryError as exc:
                ooms.append(exc)
            else:
                i += 1
            if i % 4 == 0 or ooms:
                check(f"step {i}")
        exc = ooms[0]
        msg = str(exc)
        assert "out of memory" in msg.lower() and "allowed" in msg, msg
        assert accel.memory.memory_stats(d)["num_ooms"] >= 1
        assert accel.memory.memory_stats(0)["num_ooms"] == 0
        del exc, ooms[:]
        # recovery: free the activations, empty the cache, retry under the same low fraction
        low = accel.memory.get_per_process_memory_fraction(d)
        acts.clear()
        accel.memory.empty_cache()
        _stats_agree_with_snapshot(d, "after recovery")
        for _ in range(4):
            step(i)
            acts.pop()                           # this time the activations are freed at once
            i += 1
        check(f"recovered at step {i}")
        assert accel.memory.get_per_process_memory_fraction(d) == low
    assert not ooms
    # the model grows a layer: its weights and state go to the pool too, under a cap that
    # leaves 6 MiB: the second 4 MiB tensor finds the device full inside use_mem_pool
    n2 = 1 << 20
    w2_np = (np.arange(n2) % 251 - 125).astype(np.float32) / 8
    compute.synchronize()
    accel.memory.empty_cache()
    accel.memory.set_per_process_memory_fraction((accel.memory.memory_reserved(d) + 6 * MiB) / total, d)
    layer = []
    with pytest.raises(accel.OutOfMemoryError):
        with accel.use_mem_pool(pool, device=d):
            layer.append(accel.Buffer(4 * n2, device=d, stream=compute).copy_from(w2_np, stream=compute))
            layer.append(accel.Buffer(4 * n2, device=d, stream=compute).fill_(0, stream=compute))
    assert pool.use_count() == 1                  # the route ended with the exception
    outside = accel.Buffer(4096, device=d, stream=compute)
    assert outside.ptr not in _pool_blocks(pool)
    del outside, layer[:]
    accel.memory.empty_cache()
    accel.memory.set_per_process_memory_fraction((accel.memory.memory_reserved(d) + 16 * MiB) / total, d)
    with accel.use_mem_pool(pool, device=d):
        w2 = accel.Buffer(4 * n2, device=d, stream=compute).copy_from(w2_np, stream=compute)
        m2 = accel.Buffer(4 * n2, device=d, stream=compute).fill_(0, stream=compute)
    assert _pool_blocks(pool).get(w2.ptr) == _pool_blocks(pool).get(m2.ptr) == "active_allocated"
    m2_np = np.zeros(n2, np.float32)
    for k in range(2):
        g2_np = ((np.arange(n2) + k) % 7 - 3).astype(np.float32) / 4
        g2 = accel.Buffer(4 * n2, device=d, stream=side).copy_from(g2_np, stream=side, non_blocking=True)
        compute.wait_stream(side)
        g2.record_stream(compute)
        accel.launch(kernel, _blocks(n2), 256, np.float32(1.0), g2, m2, n2, stream=compute)
        accel.launch(kernel, _blocks(n2), 256, -lr, m2, w2, n2, stream=compute)
        del g2
        m2_np = saxpy_np(1.0, g2_np, m2_np)
        w2_np = saxpy_np(-lr, m2_np, w2_np)
        step(i)
        acts.pop()
        i += 1
    check("two layers")
    assert np.array_equal(w2.to_numpy(np.float32, stream=compute), w2_np)
    assert np.array_equal(m2.to_numpy(np.float32, stream=compute), m2_np)
    _stats_agree_with_snapshot(d, "two layers")
    accel.memory.set_per_process_memory_fraction(1.0, d)
    del w, m, w2, m2, ring, ring_done, acts
    compute.synchronize()
    del compute, side, kernel
    gc.collect()
    accel.synchronize(d)
    accel.memory.empty_cache()
    assert pool.snapshot() == [] or all(b["state"] == "inactive" for s in pool.snapshot() for b in s["blocks"])
    del pool
    gc.collect()
    accel.memory.empty_cache()
    for dd in _devices():
        _stats_agree_with_snapshot(dd, "end")
        assert accel.memory.memory_reserved(dd) == 0, dd
    assert process_state() == state
    settle()
    assert live_objects() == base_live


# -- 3. generators and context managers: current device and streams restored exactly ------------
class Boom(Exception):
    pass


_state = process_state


def _batches(dev, count, n, log, stream=None):
    """A data generator that works on its own stream of ``dev`` (entered with ``with``) and
    yields each batch with that stream current."""
    s = stream if stream is not None else accel.Stream(dev)
    with s:
        assert accel.current_device_index() == dev and accel.current_stream(dev) == s
        for i in range(count):
            buf = accel.Buffer(4 * n, device=dev).fill_(i + 1)        # on s, the current stream
            log.append(("yield", dev, i))
            yield i, buf
            assert accel.current_stream(dev) == s, "the consumer's blocks leaked into the generator"
        log.append(("done", dev))


def _nested(depth_to_raise, results):
    """``with`` blocks nested across both devices; raises Boom at ``depth_to_raise``."""
    a = accel.Stream(1)
    with a:                                                    # depth 1: device 1 current
        assert (accel.current_device_index(), accel.current_stream(1)) == (1, a)
        if depth_to_raise == 1:
            raise Boom(1)
        with accel.Stream(0) as b:                             # depth 2: device 0, b current
            assert (accel.current_device_index(), accel.current_stream(0), accel.current_stream(1)) == (0, b, a)
            x = accel.Buffer(256, device=1, stream=a).fill_(7, stream=a)
            if depth_to_raise == 2:
                raise Boom(2)
            with a:                                            # depth 3: a again (re-entered)
                assert accel.current_device_index() == 1
                y = accel.Buffer(256).fill_(9)                 # device 1's current stream: a
                assert y.device_index == 1
                if depth_to_raise == 3:
                    raise Boom(3)
            assert accel.current_device_index() == 0
            with accel.device_index(1):                        # depth 4: device 1 current ...
                with b:                                        # ... and b (device 0) entered in it
                    assert accel.current_device_index() == 0
                    if depth_to_raise == 4:
                        raise Boom(4)
                assert accel.current_device_index() == 1
                if depth_to_raise == 5:
                    raise Boom(5)
            results.append((x.to_numpy(stream=a), y.to_numpy(stream=a)))
    assert accel.current_device_index() == 0 or depth_to_raise == 0


def _context_program(n, log):
    """The program of the test below, run in the calling thread; returns its numbers."""
    start = _state()
    got = []
    # nested blocks with an exception at every depth (0: none)
    for depth in range(6):
        results = []
        try:
            _nested(depth, results)
        except Boom as exc:
            assert exc.args == (depth,)
        else:
            assert depth == 0
            assert np.all(results[0][0] == 7) and np.all(results[0][1] == 9)
        assert _state() == start, f"depth {depth}"
    # a for loop broken mid-iteration: the generator is dropped (and closed) at the break
    for i, buf in _batches(1, 5, n, log):
        got.append(buf.to_numpy(np.uint8))
        if i == 1:
            break
    assert _state() == start
    # two generators zipped across devices, abandoned: the older one exits first (out of order)
    for (i, b0), (j, b1) in zip(_batches(0, 4, n, log), _batches(1, 4, n, log)):
        assert accel.current_device_index() == 1
        got.append(b0.to_numpy(np.uint8))
        got.append(b1.to_numpy(np.uint8))
        if i == 2:
            break
    assert _state() == start
    # abandoned inside a newer ``with`` of the other device, then the newer block raises
    g = _batches(1, 3, n, log)
    next(g)
    try:
        with accel.Stream(0) as c:
            del g                                           # the generator's block exits first
            assert accel.current_stream(0) == c and accel.current_device_index() == 0
            raise Boom("newer")
    except Boom:
        pass
    assert _state() == start
    # closed explicitly, and an exception thrown into a suspended generator
    g = _batches(0, 3, n, log)
    next(g)
    g.close()
    assert _state() == start
    g = _batches(1, 3, n, log)
    next(g)
    with pytest.raises(Boom):
        g.throw(Boom("thrown"))
    assert _state() == start
    # a generator raising from inside its own block on the second batch
    def failing():
        for i, buf in _batches(1, 5, n, log):
            if i == 1:
                raise Boom("in generator")
            yield buf
    with pytest.raises(Boom):
        for buf in failing():
            got.append(buf.to_numpy(np.uint8))
    assert _state() == start
    # kept alive only by a reference cycle: its block exits when the collector runs (here)
    g = _batches(0, 3, n, log, stream=accel.Stream(0))
    next(g)
    holder = [g]
    holder.append(holder)
    inside = _state()
    del g, holder
    assert _state() == inside                # not collected yet: its stream is still current
    gc.collect()
    assert _state() == start
    # finished normally
    for i, buf in _batches(0, 2, n, log):
        got.append(buf.to_numpy(np.uint8))
    assert _state() == start
    return got


@pytest.mark.parametrize("kind", KINDS)
def test_generators_and_nested_stream_contexts_restore_state_on_both_devices(monkeypatch, kind):
    """A data pipeline written with generators that each work inside ``with stream:`` of their
    device, and step code nesting ``with accel.Stream(d) as s:``, ``with s:`` (re-entered),
    ``device_index`` and the other device's stream: exceptions at every depth, a loop broken
    mid-iteration, two zipped generators abandoned (the older exits first), a generator dropped
    inside a newer ``with`` that then raises, ``close()``, ``throw()``, a generator that raises
    from inside its block, and one kept by a reference cycle until ``gc.collect()``.  After each,
    the current device and both devices' current streams are exactly what they were (device 0
    current with a side stream of its own current).  The same program runs in a worker thread
    (its own state; the main thread's untouched), and every batch holds its bytes."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    settle()
    base_live = live_objects()
    side0 = accel.Stream(0)
    accel.set_stream(side0)
    start = _state()
    assert start[:2] == (0, (side0, accel.default_stream(1)))
    n = 1024
    log = []
    got = _context_program(n, log)
    assert _state() == start
    # the same in a worker thread, which starts with its own (default) state
    worker_got, worker_start = [], []

    def worker():
        worker_start.append(_state())
        worker_got.extend(_context_program(n, []))
        assert _state() == worker_start[0]
    _run_threads([worker])
    assert _state() == start
    assert worker_start[0][0] == 0 and worker_start[0][1] == tuple(accel.default_stream(d) for d in _devices())
    want = [np.full(4 * n, v, np.uint8) for v in (1, 2, 1, 1, 2, 2, 3, 3, 1, 1, 2)]
    assert len(got) == len(want) == len(worker_got)
    for k, (a, b, c) in enumerate(zip(got, worker_got, want)):
        assert np.array_equal(a, c) and np.array_equal(b, c), k
    assert ("done", 0) in log and log.count(("done", 1)) == 0
    accel.set_stream(accel.default_stream(0))
    del side0, start
    settle()
    assert live_objects() == base_live


def test_generator_finalized_on_another_thread_says_so_and_its_thread_recovers(monkeypatch):
    """A generator entered ``with stream:`` in thread A and was handed to thread B, which drops
    it: its block exits on B, where it was not entered.  Since r75d the exit takes the block's
    entry out of A's stack (state bounded by live objects, r72e): A's stream of the device is
    restored, A's current device stays (only a thread sets its own; torch restores nothing on
    A).  What must hold: B's state is untouched, nothing is raised, and A can set its device
    back and go on using ``with`` blocks that restore exactly."""
    import queue
    import sys
    use_sim(monkeypatch, "cuda")
    accel.set_device_index(0)
    handoff, dropped = queue.Queue(), threading.Event()
    seen, unraisable = {}, []

    def gen():
        s = accel.Stream(1)
        with s:
            yield s
            yield s

    def thread_a():
        start = _state()
        g = gen()
        s = next(g)
        handoff.put(g)
        del g
        assert dropped.wait(JOIN_S)
        seen["a_after"] = _state()
        seen["a_start"] = start
        assert accel.current_stream(1) == accel.default_stream(1) and accel.current_device_index() == 1
        del s
        # the thread sets its state back by hand and goes on
        accel.set_stream(accel.default_stream(1))
        accel.set_device_index(0)
        assert _state() == start
        with accel.Stream(1) as t:
            with accel.Stream(0):
                assert accel.current_stream(1) == t
        assert _state() == start

    def thread_b():
        seen["b_start"] = _state()
        g = handoff.get(timeout=JOIN_S)
        del g                                     # finalized here: its block exits on B
        seen["b_after"] = _state()
        dropped.set()

    old = sys.unraisablehook
    sys.unraisablehook = lambda u: unraisable.append((u.exc_type, str(u.exc_value)))
    try:
        _run_threads([thread_a, thread_b])
    finally:
        sys.unraisablehook = old
    assert seen["b_after"] == seen["b_start"]
    assert seen["a_after"] != seen["a_start"]
    assert not unraisable, unraisable
