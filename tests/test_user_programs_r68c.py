"""Realistic user programs, r68c: what a demanding torch.accelerator user writes, run on the CUDA,
Level Zero ("xpu") and Metal ("mps") simulators, with the last (never current) device included.

Earlier rounds (test_user_programs*.py, _r41 .. _r67h) took loader rings, cross-device pipelines,
graphs replayed from threads, MemPools, OOM loops, fork and DLPack.  These take what they left:

1. a data-parallel step over every device in one thread: per-device compute and communication
   streams, peer copies of ArrayView chunks, and a *ring* all-reduce written by hand
   (reduce-scatter then all-gather over 2 and 4 simulated devices, chunks written in place
   through ``accel.from_dlpack`` of a view), ordered only by events; every replica equals a numpy
   model of the same additions, byte for byte, under a per-operation delay;
2. a producer thread and a consumer thread sharing a ring of slots (free/ready events both ways,
   handed over through queues) plus a fresh buffer per batch that the consumer frees after
   ``record_stream``: the producer's next allocation must not reuse it before the consumer's
   kernel ran; and worker threads sharing one Generator, each draw at its own offset;
3. a training step captured into a private pool, drawing Philox numbers, replayed 100 times on
   device 1 while device 0 is current: ``memory_stats``, the memory history, the simulator's
   objects and accel's tables must not drift by one entry, and every checkpoint equals a numpy
   Philox oracle;
4. ``set_per_process_memory_fraction`` on device 1, OutOfMemoryError eager *and inside a capture*
   (whose Philox draw must not count), caught, references dropped, ``empty_cache()``, continued
   (under three allocator settings on CUDA); a graph whose memory nodes cannot map at replay
   (backend:cudaMallocAsync on a full device) raises OutOfMemoryError and replays once freed;
5. DLPack/numpy/torch CPU round trips (strided, offset, 0-d, empty, bool, float16, refused
   non-contiguous and bfloat16 sources) on all three simulators;
6. a long loop that keeps a sliding window of live streams, events, modules, generators,
   buffers and graphs: the simulator's handle counts equal a linear model of the *live* window at
   every checkpoint, not only at the end;
7. processes after the device was used: ``os.fork`` from a thread, ``ProcessPoolExecutor`` with
   fork (device tasks get the fork error back, pickled, and the pool survives), forkserver (accel
   preloaded) and spawn (children use device 1, their OutOfMemoryError comes back with its
   attributes);
8. a script that keeps pinned arrays in its globals and imports multiprocessing after accel must
   exit quietly (it printed "Exception ignored" tracebacks: a strict xfail first, r68c).

Every accel bug found is a strict xfail naming the cause.
"""

import collections
import gc
import os
import queue
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

import accel
from conftest import SIMS, THOROUGH, use_sim
from test_user_programs import (JOIN_S, _devices, communicate_or_abort, join_all, live_objects, run_program,
                                process_state, settle)
from test_user_programs2 import accel_object_count, accel_tables, assert_same_footprint
from test_user_programs_r56 import saxpy  # noqa: F401  (fixture: the saxpy kernel per simulator)
from test_user_programs_r66b import (_dev_stats, _inc, _last, _native, _run_twice, _slow,
                                     _trace, check_stat_invariants, uniform_f32)
from test_user_kernels import expected as saxpy_np

MiB = 1 << 20
GRAPH_SIMS = [s for s in SIMS if s != "mps"]


def _blocks(n: int) -> int:
    return (n + 255) // 256


def _conf_env(conf: str) -> dict:
    """The variable a user sets for ``conf``: accel's own keys (policy) only in ACCEL_ALLOC_CONF."""
    if not conf:
        return {}
    return {"ACCEL_ALLOC_CONF" if conf.startswith("policy") else "PYTORCH_CUDA_ALLOC_CONF": conf}


# -- 1. data-parallel step, ring all-reduce by hand over every device ----------------------------
def _ring_model(grads: list, chunk: int) -> np.ndarray:
    """The reduced gradient the ring computes: chunk ``c`` starts on device ``c`` and collects
    the devices after it in ring order, one float32 addition per hop (saxpy with a = 1)."""
    n_dev = len(grads)
    out = np.empty_like(grads[0])
    for c in range(n_dev):
        sl = slice(c * chunk, (c + 1) * chunk)
        acc = grads[c][sl].copy()
        for k in range(1, n_dev):
            acc = saxpy_np(1.0, acc, grads[(c + k) % n_dev][sl])
        out[sl] = acc
    return out


_RING_CASES = [(k, n, c) for k, n, c in (("cuda", 2, ""), ("cuda", 4, ""), ("cuda", 4, "expandable_segments:False"),
                                          ("cuda", 3, "backend:cudaMallocAsync"), ("xpu", 4, ""), ("mps", 1, ""))
               if k in SIMS]


@pytest.mark.parametrize("kind,n_dev,conf", _RING_CASES)
def test_data_parallel_ring_allreduce_by_hand(monkeypatch, kind, n_dev, conf, saxpy):
    """One process drives every device from one thread (device 0 stays current throughout).
    Each step every device uploads its batch on its compute stream, computes ``g = 2 w + x`` with
    the saxpy kernel, then the gradients are all-reduced by a ring written by hand: N - 1
    reduce-scatter hops (device d's comm stream waits for the sender's chunk event, pulls the
    chunk view across with a peer ``Buffer.copy_from``, marks the sender's buffer used there with
    ``record_stream`` and adds it into its own chunk with the kernel on an ArrayView), then
    N - 1 all-gather hops (the chunk copied across straight into the receiver's gradient through
    ``accel.from_dlpack`` of its chunk view).  Each device updates its replica ``w -= lr/N g``.
    Timing events bracket each device's all-reduce.  Every replica's gradient and weights equal
    the numpy ring model byte for byte, under a per-operation delay that keeps work queued; the
    devices report peer access; memory is back to the replicas only after each step; a second
    run leaves the same footprint.  CUDA also runs it with classic segments and with
    backend:cudaMallocAsync (whose pools must grant the peers access) on three devices."""
    env = {"ACCEL_SIM_DEVICES": n_dev} if kind != "mps" else {}
    use_sim(monkeypatch, kind, **env, **_conf_env(conf))
    devs = _devices()
    assert len(devs) == n_dev
    accel.set_device_index(0)
    state = process_state()
    for a in devs:
        for b in devs:
            if a != b:
                assert accel.can_device_access_peer(a, b), (a, b)
    chunk = 1024
    n, steps, lr = chunk * n_dev, 3, np.float32(0.125)

    def program(run):
        K = {d: saxpy(d) for d in devs}
        settle()
        base = {d: _dev_stats(d) for d in devs}
        comp = {d: accel.Stream(d) for d in devs}
        comm = {d: accel.Stream(d) for d in devs}
        rng = np.random.default_rng([68, run, n_dev])
        w_host = rng.standard_normal(n).astype(np.float32)
        W = {d: accel.Buffer(4 * n, device=d, stream=comp[d]).copy_from(w_host, stream=comp[d]) for d in devs}
        replica_bytes = {d: accel.memory.memory_allocated(d) for d in devs}
        with _slow(100):
            for step in range(steps):
                xs = rng.integers(-64, 64, (n_dev, n)).astype(np.float32)
                G, ready, start, end = {}, {}, {}, {}
                for d in devs:
                    g = accel.Buffer(4 * n, device=d, stream=comp[d])
                    g.copy_from(xs[d], stream=comp[d], non_blocking=True)
                    accel.launch(K[d], _blocks(n), 256, np.float32(2.0), W[d], g, n, stream=comp[d])
                    G[d] = g
                    start[d] = accel.Event(enable_timing=True)
                    start[d].record(comp[d])
                    ready[d] = [start[d]] * n_dev          # every chunk: ready after the kernel
                    comm[d].wait_event(start[d])            # the hops add into this device's g too
                for s in range(n_dev - 1):                  # reduce-scatter
                    done = {}
                    for src in devs:
                        dst, c = (src + 1) % n_dev, (src - s) % n_dev
                        comm[dst].wait_event(ready[src][c])
                        recv = accel.Buffer(4 * chunk, device=dst, stream=comm[dst])
                        recv.copy_from(G[src].as_array(np.float32, (chunk,), offset=4 * c * chunk),
                                       stream=comm[dst], non_blocking=True)
                        G[src].record_stream(comm[dst])     # a stream of another device
                        mine = G[dst].as_array(np.float32, (chunk,), offset=4 * c * chunk)
                        accel.launch(K[dst], _blocks(chunk), 256, np.float32(1.0), recv, mine, chunk,
                                     stream=comm[dst])
                        del recv, mine                      # freed with the kernel queued
                        done[(dst, c)] = comm[dst].record_event()
                    for (dst, c), ev in done.items():
                        ready[dst][c] = ev
                for s in range(n_dev - 1):                  # all-gather: device d owns chunk d + 1
                    done = {}
                    for src in devs:
                        dst, c = (src + 1) % n_dev, (src + 1 - s) % n_dev
                        comm[dst].wait_event(ready[src][c])
                        slot = accel.from_dlpack(G[dst].as_array(np.float32, (chunk,), offset=4 * c * chunk))
                        slot.copy_from(G[src].as_array(np.float32, (chunk,), offset=4 * c * chunk),
                                       stream=comm[dst], non_blocking=True)
                        G[src].record_stream(comm[dst])
                        del slot
                        done[(dst, c)] = comm[dst].record_event()
                    for (dst, c), ev in done.items():
                        ready[dst][c] = ev
                for d in devs:
                    comp[d].wait_stream(comm[d])
                    end[d] = accel.Event(enable_timing=True)
                    end[d].record(comp[d])
                    accel.launch(K[d], _blocks(n), 256, -lr / np.float32(n_dev), G[d], W[d], n, stream=comp[d])
                    assert accel.current_device_index() == 0
                grads = [saxpy_np(2.0, w_host, xs[d]) for d in devs]
                total = _ring_model(grads, chunk)
                for d in devs:
                    got = G[d].to_numpy(np.float32, stream=comp[d])
                    assert np.array_equal(got, total), (run, step, d, np.flatnonzero(got != total)[:8])
                    end[d].synchronize()
                    assert start[d].elapsed_time(end[d]) >= 0.0
                w_host = saxpy_np(-lr / np.float32(n_dev), total, w_host)
                del G, g, ready, start, end
                done = ev = None
                for d in devs:
                    assert np.array_equal(W[d].to_numpy(np.float32, stream=comp[d]), w_host), (run, step, d)
                    accel.synchronize(d)
                    assert accel.memory.memory_allocated(d) == replica_bytes[d], (run, step, d)
                    check_stat_invariants(d, f"run {run} step {step}")
        assert process_state() == state
        del W, comp, comm, K
        settle()
        assert {d: _dev_stats(d) for d in devs} == base

    _run_twice(program)


# -- 2. producer and consumer threads sharing slots (events both ways) and record_stream --------
@pytest.mark.parametrize("kind", SIMS)
def test_producer_consumer_threads_share_slots_and_record_stream(monkeypatch, kind, saxpy):
    """A producer thread fills one of three slot buffers on the last device (waiting on its
    stream for the slot's "free" event the consumer recorded), and also allocates a fresh
    ``extra`` buffer per batch on its own stream, filled and handed over with the slot's "ready"
    event; it drops its reference at once.  The consumer thread (device 0 current, its stream on
    the last device) waits for "ready", accumulates ``acc += slot`` and ``acc += extra`` with the
    kernel, calls ``extra.record_stream(consumer)`` and frees it, records the slot's "free" event
    and hands the slot back.  Under a per-operation delay the producer's next ``extra`` would
    reuse the freed memory and overwrite it before the consumer's kernel read it if the
    allocator ignored the recorded use.  ``acc`` (downloaded with ``to_numpy(non_blocking=True)``)
    equals numpy's sum; nothing hangs; memory and the footprint are as before."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    dev = _last()
    n, batches, n_slots = 2048, 12, 3
    state = process_state()

    def batch(b, which):
        return np.random.default_rng([68, b, which]).integers(-1000, 1000, n).astype(np.float32)

    def program(run):
        kernel = saxpy(dev)
        settle()
        base = _dev_stats(dev)
        slots = [accel.Buffer(4 * n, device=dev) for _ in range(n_slots)]
        free_q, ready_q = queue.Queue(), queue.Queue()
        for i in range(n_slots):
            free_q.put((i, None))
        errors, out = [], {}

        def producer():
            try:
                ps = accel.Stream(dev)
                staging = accel.empty_pinned((2, n), np.float32)
                for b in range(batches):
                    i, free_ev = free_q.get(timeout=JOIN_S)
                    if free_ev is not None:
                        ps.wait_event(free_ev)               # the consumer's last read of slot i
                    staging[0] = batch(b, 0)
                    staging[1] = batch(b, 1)
                    slots[i].copy_from(staging[0], stream=ps, non_blocking=True)
                    extra = accel.Buffer(4 * n, device=dev, stream=ps)
                    extra.copy_from(staging[1], stream=ps, non_blocking=True)
                    ready = ps.record_event()
                    ps.synchronize()                          # staging may be rewritten now
                    ready_q.put((b, i, ready, extra))
                    del extra, ready
                assert accel.current_device_index() == 0
            except BaseException as exc:
                errors.append(exc)
            finally:
                ready_q.put(None)

        def consumer():
            try:
                cs = accel.Stream(dev)
                acc = accel.Buffer(4 * n, device=dev, stream=cs).fill_(0, stream=cs)
                while True:
                    item = ready_q.get(timeout=JOIN_S)
                    if item is None:
                        break
                    b, i, ready, extra = item
                    del item
                    cs.wait_event(ready)
                    accel.launch(kernel, _blocks(n), 256, np.float32(1.0), slots[i], acc, n, stream=cs)
                    accel.launch(kernel, _blocks(n), 256, np.float32(1.0), extra, acc, n, stream=cs)
                    extra.record_stream(cs)
                    del extra                                 # freed with the kernel queued
                    free_q.put((i, cs.record_event()))
                    del ready
                host, done = acc.to_numpy(np.float32, stream=cs, non_blocking=True)
                done.synchronize()
                out["acc"] = host.copy()
                assert accel.current_device_index() == 0
            except BaseException as exc:
                errors.append(exc)
                free_q.put((0, None))                         # unblock the producer

        threads = [threading.Thread(target=producer, name="producer"),
                   threading.Thread(target=consumer, name="consumer")]
        with _slow(200):
            for t in threads:
                t.start()
            join_all(threads)
        assert not errors, _trace(errors[0])
        want = np.zeros(n, np.float32)
        for b in range(batches):
            want = saxpy_np(1.0, batch(b, 1), saxpy_np(1.0, batch(b, 0), want))
        assert np.array_equal(out["acc"], want), (run, np.flatnonzero(out["acc"] != want)[:8])
        assert process_state() == state
        del slots, free_q, ready_q, kernel
        settle()
        assert _dev_stats(dev) == base

    _run_twice(program)


@pytest.mark.parametrize("kind", SIMS)
def test_threads_share_one_generator_every_draw_unique(monkeypatch, kind):
    """Four worker threads, each with its own stream on the last device (device 0 current), draw
    40 times each from one shared ``Generator`` (as DataLoader-style workers sharing a seeded
    generator do) under a per-operation delay, and download afterwards.  The 160 draws are
    exactly the Philox oracle's draws at offsets 0, inc, ..., 159 inc in some order (none
    repeated, none skipped: each draw took its own offset), and the generator's offset is past
    all of them."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    dev = _last()
    n, per, workers = 257, 40, 4
    gen = accel.random.Generator(dev, seed=99)
    got, errors = [], []
    lock = threading.Lock()

    def worker():
        try:
            s = accel.Stream(dev)
            bufs = []
            for _ in range(per):
                b = accel.Buffer(4 * n, device=dev, stream=s)
                with s:
                    accel.random.uniform_(b, generator=gen)
                bufs.append(b)
            arrays = [b.to_numpy(np.float32, stream=s).tobytes() for b in bufs]
            with lock:
                got.extend(arrays)
            assert accel.current_device_index() == 0
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, name=f"drawer{k}") for k in range(workers)]
    with _slow(50):
        for t in threads:
            t.start()
        join_all(threads)
    assert not errors, _trace(errors[0])
    want = {uniform_f32(99, i * _inc(n), n).tobytes() for i in range(per * workers)}
    assert len(got) == len(set(got)) == per * workers
    assert set(got) == want
    assert gen.get_offset() == per * workers * _inc(n)


# -- 3. a captured training step with RNG in a private pool, replayed 100 times -----------------
_REPLAY_CASES = [(k, c) for k, c in (("cuda", ""), ("cuda", "backend:cudaMallocAsync"), ("cuda", "policy:torch"),
                                     ("xpu", "")) if k in SIMS]


@pytest.mark.parametrize("kind,conf", _REPLAY_CASES)
def test_captured_step_with_rng_replayed_100_times_no_drift(monkeypatch, kind, conf, saxpy):
    """On device 1 (device 0 current) a step is captured into the graph's private pool: a noise
    buffer drawn from the default generator (Level Zero cannot capture fills: its noise is drawn
    eagerly into a static input before each replay and copied in the graph), a temporary from the
    pool, ``tmp = noise``, ``w += 0.5 tmp``.  The graph is replayed 100 times with memory history
    recording, with an eager draw from the same generator every 10 replays.  After 25
    replays nothing may change (checkpoints 25, 50, 75, 99): ``memory_stats``, the host allocator's
    current stats, the trace's entries, the simulator's objects, accel's tables and objects; the generator's offset and ``w`` follow the numpy
    Philox oracle at every checkpoint.  Reset and dropped, the pool gives its memory back.
    CUDA runs it under accel's allocator, torch's policy and backend:cudaMallocAsync (graph
    memory nodes)."""
    use_sim(monkeypatch, kind, **_conf_env(conf))
    accel.set_device_index(0)
    dev = _last()
    R = accel.random
    mem = accel.memory
    n = 3001
    state = process_state()

    def program(run):
        kernel = saxpy(dev)
        settle()
        base = _dev_stats(dev)
        seed = 5 + run
        R.manual_seed_all(seed)
        home = R.get_rng_state(0).copy()
        gen = R.default_generator(dev)
        w = accel.Buffer(4 * n, device=dev).copy_from(np.zeros(n, np.float32))
        static_x = accel.Buffer(4 * n, device=dev)
        eager = accel.Buffer(4 * n, device=dev)
        side = accel.Stream(dev)
        g = accel.Graph()
        with accel.graph(g, stream=side):
            noise = accel.Buffer(4 * n)
            if kind == "cuda":
                R.uniform_(noise)
            else:
                noise.copy_from(static_x)
            tmp = accel.Buffer(4 * n)
            tmp.copy_from(noise)
            accel.launch(kernel, _blocks(n), 256, np.float32(0.5), tmp, w, n)
            del tmp
        assert gen.get_offset() == 0 and g.pool()[0] != 0
        assert accel.current_device_index() == 0
        w_ref, off = np.zeros(n, np.float32), 0
        mem._record_memory_history("all", max_entries=100_000)
        try:
            ref = None
            for i in range(100):
                with accel.device_index(dev):
                    if kind != "cuda":
                        R.uniform_(static_x)
                    g.replay()
                w_ref = saxpy_np(0.5, uniform_f32(seed, off, n), w_ref)
                off += _inc(n)
                if i % 10 == 5:
                    with accel.device_index(dev):
                        R.uniform_(eager)
                    assert np.array_equal(eager.to_numpy(np.float32), uniform_f32(seed, off, n)), (run, i)
                    off += _inc(n)
                if i % 25 == 0 or i == 99:
                    accel.synchronize(dev)
                    got = w.to_numpy(np.float32)
                    assert np.array_equal(got, w_ref), (run, i, np.flatnonzero(got != w_ref)[:8])
                    assert gen.get_offset() == off, (run, i, gen.get_offset(), off)
                    # (downloads count in the host allocator's accumulated stats, and every
                    # _snapshot() adds a "snapshot" entry to the trace, as torch's)
                    now = (dict(mem.memory_stats(dev)),
                           {k: v for k, v in mem.host_memory_stats().items() if k.endswith(".current")},
                           sum(e["action"] != "snapshot" for t in mem._snapshot()["device_traces"] for e in t),
                           live_objects(), {k: v for k, v in accel_tables().items() if not k.endswith("._history")},
                           accel_object_count())
                    if i == 0:
                        continue                        # (first download: the pinned cache fills)
                    if ref is None:
                        ref = now
                    else:
                        for what, a, b in zip(("stats", "host", "trace", "sim", "tables", "objects"), ref, now):
                            if isinstance(a, dict):
                                diff = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
                                assert not diff, (run, i, what, diff)
                            else:
                                assert a == b, (run, i, what, a, b)
        finally:
            mem._record_memory_history(None)
        assert np.array_equal(R.get_rng_state(0), home)
        assert process_state() == state
        g.reset()
        del g, noise, w, static_x, eager, side, kernel
        settle()
        assert _dev_stats(dev) == base
        assert mem.memory_reserved(dev) == 0

    _run_twice(program)


# -- 4. OutOfMemoryError under a fraction, eager and inside a capture, recovered ----------------
_OOM_CASES = [(k, c) for k, c in (("cuda", ""), ("cuda", "expandable_segments:False"),
                                  ("cuda", "backend:cudaMallocAsync"), ("xpu", ""), ("mps", "")) if k in SIMS]


@pytest.mark.parametrize("kind,conf", _OOM_CASES)
def test_fraction_oom_eager_and_in_capture_recovered_on_last_device(monkeypatch, kind, conf):
    """With a 64 MiB fraction on the last device (device 0 current and untouched) a program
    holds 48 MiB, asks for 32 MiB more and gets OutOfMemoryError naming the device and the
    limit; the OOM observer sees ``(device, bytes, allowed, free)``; only that device's
    ``num_ooms`` moved.  On the graph backends a capture that allocates past the limit raises
    OutOfMemoryError out of ``with accel.graph(...)``: the capture is over (no stream
    capturing, the current stream restored, on CUDA the Philox draw it captured not counted:
    the next eager draw is the generator's first), and once the program drops what it holds, calls
    ``empty_cache()`` and captures a smaller step, that graph replays correctly.  At the end,
    the fraction restored and everything dropped, the device holds nothing."""
    use_sim(monkeypatch, kind, **_conf_env(conf))
    mem = accel.memory
    accel.set_device_index(0)
    dev = _last()
    state = process_state()
    settle()
    seen = []

    def observer(*args):
        seen.append(args)
    mem.attach_out_of_memory_observer(observer)
    try:
        limit = 64 * MiB
        total = accel.get_memory_info(dev)[1]
        mem.set_per_process_memory_fraction(limit / total, dev)
        ooms0 = {d: mem.memory_stats(d).get("num_ooms", 0) for d in _devices()}
        keep = [accel.Buffer(16 * MiB, device=dev).fill_(i + 1) for i in range(3)]
        with pytest.raises(accel.OutOfMemoryError) as info:
            accel.Buffer(32 * MiB, device=dev)
        msg = str(info.value)
        if _native():
            assert f"GPU {dev}" in msg and "Tried to allocate 32.00 MiB" in msg and "64.00 MiB allowed" in msg, msg
        else:   # torch's CudaMallocAsyncAllocator message
            assert f"on device {dev} would exceed allowed memory" in msg and "32.00 MiB" in msg, msg
        assert isinstance(info.value, RuntimeError)
        del info
        assert seen and seen[-1][:3] == (dev, 32 * MiB, limit), seen
        if _native():
            ooms = {d: mem.memory_stats(d)["num_ooms"] for d in _devices()}
            assert ooms[dev] == ooms0[dev] + 1, ooms
            assert all(ooms[d] == ooms0[d] for d in _devices() if d != dev), ooms
        for i in range(len(keep)):
            assert (keep[i].to_numpy() == i + 1).all()
        if kind != "mps":
            R, n = accel.random, 1000
            R.manual_seed_all(21)
            gen = R.default_generator(dev)
            noise = accel.Buffer(4 * n, device=dev)
            side = accel.Stream(dev)
            g = accel.Graph()
            a = big = None
            with pytest.raises(accel.OutOfMemoryError):
                with accel.graph(g, stream=side):
                    if kind == "cuda":                   # (Level Zero captures no fills)
                        R.uniform_(noise)
                    a = accel.Buffer(8 * MiB)
                    a.fill_(1)
                    big = accel.Buffer(40 * MiB)
                    big.fill_(2)
            assert big is None
            assert not side.is_capturing() and not accel.is_current_stream_capturing()
            assert process_state() == state
            # the failed capture drew nothing: the next eager draw is the generator's first
            assert gen.get_offset() == 0
            with accel.device_index(dev):
                R.uniform_(noise)
            assert np.array_equal(noise.to_numpy(np.float32), uniform_f32(21, 0, n))
            # the program lets go of what the failed capture made, frees a third, and goes on
            del g, a, big
            keep.pop()
            gc.collect()
            mem.empty_cache()
            g = accel.Graph()
            with accel.graph(g, stream=side):
                a = accel.Buffer(8 * MiB)
                a.fill_(1)
                big = accel.Buffer(16 * MiB)
                big.fill_(2)
            with accel.device_index(dev):
                g.replay()
                g.replay()
            assert (a.to_numpy() == 1).all() and (big.to_numpy() == 2).all()
            assert mem.max_memory_reserved(dev) <= limit or not _native()
            assert gen.get_offset() == _inc(n)
            del g, a, big, side, noise
        else:
            keep.pop()
            mem.empty_cache()
            more = accel.Buffer(24 * MiB, device=dev).fill_(7)
            assert (more.to_numpy() == 7).all()
            del more
        check_stat_invariants(dev, "after recovery")
        assert process_state() == state
        del keep
        mem.set_per_process_memory_fraction(1.0, dev)
        settle()
        assert mem.memory_allocated(dev) == 0 and mem.memory_reserved(dev) == 0
        assert mem.memory_allocated(0) == 0 or dev == 0
    finally:
        mem.detach_out_of_memory_observer(observer)
        mem.set_per_process_memory_fraction(1.0, dev)


@pytest.mark.skipif("cuda" not in SIMS, reason="CUDA simulator not selected")
def test_graph_memory_replay_oom_under_cuda_malloc_async_then_recovers(monkeypatch):
    """backend:cudaMallocAsync on a 1 GiB device: a graph captured on device 1 allocates 100 MiB
    of graph memory (mapped at each launch) for a temporary.  The program then fills the device
    with eager buffers (OutOfMemoryError ends the loop), ``empty_cache()`` trims the graph's
    memory and more buffers take what it gave back: the next replay cannot map its memory and
    raises OutOfMemoryError (a vendor error, not a hang or a wrong result), with its output
    untouched; once the program frees three buffers the replay works again, and at the end the
    device's free memory is what it was."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_MEMORY="1GiB", PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    mem = accel.memory
    accel.set_device_index(0)
    dev = 1
    free0 = accel.get_memory_info(dev)[0]
    side = accel.Stream(dev)
    out = accel.Buffer(4096, device=dev).fill_(0)
    g = accel.Graph()
    with accel.graph(g, stream=side):
        tmp = accel.Buffer(100 * MiB)
        tmp.fill_(5)
        out.copy_from(tmp.as_array(np.uint8, (4096,)), non_blocking=True)
        del tmp
    with accel.device_index(dev):
        g.replay()
    assert (out.to_numpy() == 5).all()
    out.fill_(0)
    hog = []
    for size in (64 * MiB, 8 * MiB):
        mem.empty_cache()
        with pytest.raises(accel.OutOfMemoryError):
            while True:
                hog.append(accel.Buffer(size, device=dev))
    assert accel.get_memory_info(dev)[0] < 100 * MiB
    with pytest.raises(accel.OutOfMemoryError) as info:
        with accel.device_index(dev):
            g.replay()
    assert "out of memory" in str(info.value), info.value
    del info
    accel.synchronize(dev)
    assert (out.to_numpy() == 0).all()
    assert accel.current_device_index() == 0
    del hog[:3]
    gc.collect()
    mem.empty_cache()
    with accel.device_index(dev):
        g.replay()
    assert (out.to_numpy() == 5).all()
    del hog, g, out, side
    settle()
    assert accel.get_memory_info(dev)[0] == free0 and mem.memory_reserved(dev) == 0


# -- 5. DLPack / numpy / torch CPU round trips --------------------------------------------------
@pytest.mark.parametrize("kind", SIMS)
def test_dlpack_numpy_torch_cpu_round_trips_on_last_device(monkeypatch, kind):
    """Host data of every form a user has goes in and comes back: a torch row (an offset into
    its storage), a 0-d tensor, an empty tensor, a bool mask, float16; strided device views
    (offset, every other column) are exported and imported again with ``accel.from_dlpack``
    (through the object and through a versioned capsule) at the right address and size; a
    pinned download goes to torch and back to numpy without a copy, transposed.  The forms accel
    cannot copy are refused with a message saying what to do, and change nothing: a
    non-contiguous or negatively strided source, bfloat16, a torch tensor as a ``copy_to``
    destination (its ``.numpy()`` works)."""
    torch = pytest.importorskip("torch")
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    dev = _last()
    settle()
    base = (live_objects(), _dev_stats(dev))
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    b = accel.Buffer(4 * 64, device=dev).copy_from(t)
    # accepted forms
    row = accel.Buffer(32, device=dev).copy_from(t[3])
    assert np.array_equal(row.to_numpy(np.float32), t[3].numpy())
    scalar = accel.Buffer(4, device=dev).copy_from(torch.tensor(3.5))
    assert scalar.to_numpy(np.float32).tolist() == [3.5]
    assert accel.Buffer(0, device=dev).copy_from(torch.empty(0)).nbytes == 0
    mask = accel.Buffer(64, device=dev).copy_from(t > 30)
    assert mask.to_numpy(np.bool_).sum() == 33
    half = accel.Buffer(128, device=dev).copy_from(t.to(torch.float16))
    assert np.array_equal(half.to_numpy(np.float16), t.numpy().astype(np.float16).ravel())
    # refused forms, each with its advice, nothing copied
    before = b.to_numpy(np.float32).copy()
    for bad, words in ((t.T, "contiguous"), (t.reshape(-1)[::2], "contiguous"),
                       (np.arange(64, dtype=np.float32)[::-1], "contiguous"),
                       (t.to(torch.bfloat16), "int16")):
        target = b if bad.nbytes == b.nbytes else accel.Buffer(bad.nbytes, device=dev).copy_from(
            np.zeros(bad.nbytes, np.uint8))
        snap = target.to_numpy().copy()
        with pytest.raises((ValueError, TypeError)) as info:
            target.copy_from(bad)
        assert words in str(info.value) and "nothing was copied" in str(info.value), info.value
        assert np.array_equal(target.to_numpy(), snap)
        del info                                       # (its traceback holds the copy's frames)
    assert np.array_equal(b.to_numpy(np.float32), before)
    with pytest.raises(TypeError, match="numpy array"):
        b.copy_to(torch.zeros(64))
    out = torch.zeros(64)
    b.copy_to(out.numpy())
    assert torch.equal(out, t.reshape(-1))
    # strided device views out and back in
    view = b.as_array(np.float32, (4, 4), strides=(64, 8), offset=16)
    assert np.array_equal(view.to_numpy(), 4 + np.add.outer(np.arange(4) * 16, np.arange(4) * 2))
    again = accel.from_dlpack(view)
    assert again.ptr == b.ptr + 16 and again.device_index == dev
    assert again.nbytes == 3 * 64 + 3 * 8 + 4
    capsule = view.__dlpack__(max_version=(1, 0))

    class Holder:                                      # a consumer handing on a capsule it got
        def __dlpack__(self, **kw):
            return capsule

        def __dlpack_device__(self):
            return view.__dlpack_device__()
    again2 = accel.from_dlpack(Holder())
    assert (again2.ptr, again2.nbytes) == (again.ptr, again.nbytes)
    del capsule
    with accel.device_index(dev):
        again2.fill_(0)
    assert np.array_equal(b.to_numpy(np.float32)[4:4 + again.nbytes // 4], np.zeros(again.nbytes // 4))
    del again, again2, view
    # pinned download -> torch (no copy) -> numpy transposed (no copy)
    arr, ev = b.to_numpy(np.float32, (8, 8), non_blocking=True)
    ev.synchronize()
    tt = torch.from_dlpack(arr)
    assert tt.data_ptr() == arr.ctypes.data
    back = np.from_dlpack(tt.T)
    assert back.ctypes.data == arr.ctypes.data and back.strides == (4, 32)
    assert np.array_equal(back, arr.T)
    del arr, ev, tt, back, b, row, scalar, mask, half, target, out
    settle()
    assert (live_objects(), _dev_stats(dev)) == base


# -- 6. a sliding window of live objects: handle counts follow the window ------------------------
@pytest.mark.parametrize("kind", SIMS)
def test_sliding_window_of_objects_handle_counts_follow_live_ones(monkeypatch, kind, saxpy):
    """Each step starts a thread that makes a set of objects on alternating devices (a stream it
    leaves current as it ends, a module and its kernel, a Generator drawing into a buffer
    allocated in a fresh MemPool, a kernel launch, a timing event, a pinned download in flight,
    on CUDA an ExternalStream wrapper of the stream, and on the graph backends a graph captured on
    a temporary stream) and the main thread drops the set made ``WINDOW`` steps before.  The simulator's live handles are measured with 0..WINDOW sets alive during a
    warm-up, and then at every checkpoint of 150 steps they must equal the warm-up's count for
    a full window exactly; with the window emptied they equal the empty count, and accel's tables
    and objects do not grow."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    devs = _devices()
    WINDOW = 2 * len(devs)
    R = accel.random

    def make_in_thread(i, out):
        d = devs[i % len(devs)]
        s = accel.Stream(d)
        accel.set_stream(s)                     # left current: the thread ends with it current
        k = saxpy(d)
        gen = R.Generator(d, seed=i)
        with accel.device_index(d):
            pool = accel.MemPool()
        with accel.use_mem_pool(pool, device=d):
            x = accel.Buffer(4 * 256, device=d, stream=s)
        y = accel.Buffer(4 * 256, device=d, stream=s).fill_(0, stream=s)
        R.uniform_(x, generator=gen)            # on the current stream, s
        accel.launch(k, 1, 256, 1.0, x, y, 256, stream=s)
        e = accel.Event(enable_timing=True)
        e.record(s)
        host = accel.empty_pinned(256, np.float32)
        y.copy_to(host, stream=s, non_blocking=True)
        ext = accel.Stream.from_handle(s.handle, d) if kind == "cuda" else None
        g = None
        if kind != "mps":
            g = accel.Graph()
            with accel.graph(g, stream=accel.Stream(d)):
                accel.launch(k, 1, 256, 2.0, x, y, 256)
        out.extend([s, k, gen, pool, x, y, e, host, ext, g])

    def make(i):
        out = []
        t = threading.Thread(target=make_in_thread, args=(i, out), name=f"maker{i}")
        t.start()
        join_all([t])
        assert len(out) == 10, f"step {i} failed in its thread"
        return out

    def counts():
        settle()
        return live_objects()

    warm = collections.deque(make(i) for i in range(WINDOW))    # first-use caches (RNG kernels)
    warm.clear()
    model = [counts()]
    for i in range(WINDOW):
        warm.append(make(i))
        model.append(counts())
    warm.clear()
    assert counts() == model[0]
    empty = (model[0], accel_tables(), accel_object_count())
    window = collections.deque()
    # by default 50 steps: the window turns over a dozen times, checked at step 25 and at the end
    for i in range(150 if THOROUGH else 50):
        window.append(make(i))
        if len(window) > WINDOW:
            window.popleft()
        if i >= WINDOW and i % 25 == 0:
            assert counts() == model[WINDOW], (i, counts(), model[WINDOW])
            for d in devs:
                check_stat_invariants(d, f"step {i}")
    assert counts() == model[WINDOW]
    window.clear()
    after = counts()
    assert after == model[0], (after, model[0])
    assert_same_footprint((empty[0], empty[1], empty[2]), (after, accel_tables(), accel_object_count()))


# -- 7. process pools after the device was used -------------------------------------------------
_POOLS = r'''
import concurrent.futures as cf, multiprocessing as mp, os, pickle, sys
import numpy as np
import accel

FORK_MSG = None


def host_task(arr):
    return float(arr.sum()), os.getpid()


def device_task(dev):
    b = accel.Buffer(4096, device=dev)
    return b.nbytes


def forked_state(dev):
    """In a forked child: the queries that need no runtime, and the fork error's type."""
    out = {"count": accel.device_count(), "available": accel.is_available()}
    try:
        accel.current_stream(dev)
    except RuntimeError as exc:
        out["stream"] = str(exc)
    return out


def draw_task(args):
    dev, seed, n = args
    accel.random.manual_seed_all(seed)
    b = accel.Buffer(4 * n, device=dev)
    accel.random.uniform_(b)
    return accel.current_device_index(), b.to_numpy(np.float32)


def oom_task(dev):
    accel.memory.set_per_process_memory_fraction(0.001, dev)
    accel.Buffer(256 << 20, device=dev)


def parent_draw(dev, seed, n):
    accel.random.manual_seed_all(seed)
    b = accel.Buffer(4 * n, device=dev)
    accel.random.uniform_(b)
    return b.to_numpy(np.float32)


if __name__ == "__main__":
    kind = accel.current_accelerator().type
    dev = accel.device_count() - 1
    # the parent uses the device: memory, a stream with queued work, pinned memory, an event
    keep = accel.Buffer(1 << 20, device=dev).fill_(5)
    s = accel.Stream(dev)
    s.wait_stream(accel.current_stream(dev))
    keep.fill_(6, stream=s)
    ev = s.record_event()
    pinned = accel.empty_pinned(1024, np.float32)
    pinned[:] = 2
    stats = dict(accel.memory.memory_stats(dev))
    want_fork = ("Cannot re-initialize {0} in forked subprocess. To use {0} with multiprocessing, "
                 "you must use the 'spawn' start method").format({"cuda": "CUDA", "xpu": "XPU", "mps": "MPS"}[kind])

    # 0. os.fork from a thread of the parent while the main thread waits: the child reports the
    # fork error and its inherited pinned sum through a pipe, and leaves by a normal exit
    def fork_from_thread(box):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                accel.Buffer(16, device=dev)
                msg = "no error"
            except RuntimeError as exc:
                msg = str(exc)
            os.write(w, pickle.dumps((msg, float(pinned.sum()))))
            os.close(w)
            sys.exit(0)
        os.close(w)
        data = b""
        while chunk := os.read(r, 1 << 16):
            data += chunk
        os.close(r)
        box.append((pickle.loads(data), os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])))
    import threading
    box = []
    t = threading.Thread(target=fork_from_thread, args=(box,))
    t.start()
    t.join(30)
    assert box == [((want_fork, 2048.0), 0)], box

    # 1. fork pool: host work on inherited memory works; device work comes back as the fork error
    with cf.ProcessPoolExecutor(2, mp_context=mp.get_context("fork")) as pool:
        total, pid = pool.submit(host_task, pinned).result(30)
        assert total == 2048.0 and pid != os.getpid()
        futs = [pool.submit(device_task, dev) for _ in range(3)]
        for f in futs:
            exc = f.exception(30)
            assert type(exc) is RuntimeError and str(exc) == want_fork, repr(exc)
        st = pool.submit(forked_state, dev).result(30)
        assert st["count"] == accel.device_count() and st["available"] and st["stream"] == want_fork, st
        assert pool.submit(host_task, np.ones(10)).result(30)[0] == 10.0   # the pool survived
    # 2. forkserver (accel preloaded into the server: importing starts nothing) and spawn:
    # children start their own runtime and use the last device
    for method in ("forkserver", "spawn"):
        ctx = mp.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload(["numpy", "accel"])
        # a spawn worker costs ~1 s to start: by default one takes every task (ACCEL_TEST_THOROUGH: two)
        workers = 2 if method == "forkserver" or os.environ.get("ACCEL_TEST_THOROUGH", "") not in ("", "0") else 1
        with cf.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            res = list(pool.map(draw_task, [(dev, 77, 1000), (dev, 78, 500), (0, 77, 1000)], timeout=60))
            oom = pool.submit(oom_task, dev).exception(60)
        assert res[0][0] == 0 and res[2][0] == 0, [r[0] for r in res]       # device 0 stays current
        assert np.array_equal(res[0][1], parent_draw(dev, 77, 1000)), method
        assert np.array_equal(res[1][1], parent_draw(dev, 78, 500)), method
        assert np.array_equal(res[2][1], parent_draw(0, 77, 1000)), method
        assert isinstance(oom, accel.OutOfMemoryError), (method, repr(oom))
        assert oom.observer_args is not None and oom.observer_args[0] == dev, (method, oom.observer_args)
        assert oom.observer_args[1] == 256 << 20, oom.observer_args
        assert f"GPU {dev}" in str(oom), str(oom)
    # the parent's objects are intact, its numbers unchanged
    ev.synchronize()
    assert (keep.to_numpy(stream=s) == 6).all()
    assert (pinned == 2).all()
    x = accel.Buffer(4096, device=dev).copy_from(pinned)
    assert (x.to_numpy(np.float32) == 2).all()
    del x
    accel.synchronize(dev)
    now = dict(accel.memory.memory_stats(dev))
    for key in ("allocated_bytes.all.current", "allocation.all.current", "num_ooms"):
        assert now[key] == stats[key], (key, stats[key], now[key])
    print("OK")
'''


@pytest.mark.parametrize("kind", SIMS)
def test_process_pools_fork_forkserver_spawn_after_device_use(monkeypatch, kind, tmp_path):
    """A parent that used the last device (memory, a stream with work queued, pinned memory, an
    event) forks a child from a worker thread (``os.fork``: the fork error and the inherited
    pinned data come back through a pipe, the child exits normally), then runs
    ``concurrent.futures.ProcessPoolExecutor`` three ways.  Fork: a task on inherited
    pinned memory works, device tasks come back as torch's fork RuntimeError (pickled through the
    pool, exact message) and the pool stays usable.  Forkserver and spawn: children start their
    own runtime (the forkserver preloads accel), draw on the last device and device 0 (device 0
    stays current) the same Philox
    numbers as the parent, and a task's OutOfMemoryError under a fraction comes back pickled as
    an OutOfMemoryError with its observer arguments and message.  The parent's objects and
    counters are unchanged; nothing hangs."""
    use_sim(monkeypatch, kind)
    script = tmp_path / "pools_r68c.py"
    script.write_text(_POOLS)
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=str(tmp_path))
    try:
        out, err = communicate_or_abort(proc, 90)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    assert proc.returncode == 0 and out.strip().endswith("OK"), (out, err[-4000:])
    assert "Exception ignored" not in err and "Traceback" not in err, err[-4000:]


# -- 8. pinned arrays left in a script's globals when it imported multiprocessing after accel -----
_PINNED_AT_EXIT = r'''
import numpy as np
{first}
{second}
dev = accel.device_count() - 1
ring = [accel.empty_pinned(1024, np.float32) for _ in range(2)]      # a loader's pinned ring
ring[0][:] = 1
buf = accel.Buffer(4096, device=dev).copy_from(ring[0], non_blocking=True)
last, done = buf.to_numpy(np.float32, non_blocking=True)            # an async download kept
done.synchronize()
assert (last == 1).all()
print("OK")
'''

@pytest.mark.parametrize("order", [
    "multiprocessing_first",
    "accel_first",      # r68c: accel._hostmem imported accel._finalize in its destructors: failed at exit
])
@pytest.mark.parametrize("kind", SIMS)
def test_pinned_arrays_in_globals_exit_quietly_with_multiprocessing(monkeypatch, kind, order):
    """A data-loader script keeps a ring of pinned arrays and an async download in its globals
    and imports multiprocessing (as torch, DataLoader code and process pools do), then simply
    ends.  The interpreter must exit with status 0 and nothing on stderr, whichever of accel
    and multiprocessing it imported first.  Imported after accel, multiprocessing's
    ``__mp_main__`` alias keeps the script's globals alive past the point where
    ``sys.modules['accel']`` is None, and each pinned array's destructor then prints
    "Exception ignored ... ModuleNotFoundError: import of accel halted"."""
    use_sim(monkeypatch, kind)
    first, second = "import accel", "import multiprocessing"
    if order == "multiprocessing_first":
        first, second = second, first
    proc = run_program(_PINNED_AT_EXIT.format(first=first, second=second), timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", (proc.stdout, proc.stderr[-3000:])
    assert proc.stderr == "", proc.stderr[-3000:]
