"""Realistic user programs, r69c: what a demanding torch.accelerator user writes, run on the CUDA,
Level Zero ("xpu") and Metal ("mps") simulators, with device 1 used while device 0 stays current
wherever a second device exists.

Earlier rounds (test_user_programs*.py, _r41 .. _r68c) took loader rings, ring all-reduce by
hand, graphs replayed from threads, OOM loops, fork pools and DLPack.  These take six new ones:

1. a long-running service: 5,000 requests (800 unless ACCEL_TEST_THOROUGH) from a thread pool (plus requests served by a thread of
   their own, and requests that fail half way), each making a short-lived Stream and Event,
   allocating, copying host -> device -> host and dropping everything, some kept alive for a
   while as keep-alive sessions.  accel's internal state (every container reachable from its
   modules: the census of test_container_census_r63h), the simulator's handles, the Python
   objects of accel's classes, threads and registered hooks stay bounded by the live objects:
   the same after 5,000 requests as after 500;
2. an apex-style double-buffered prefetcher: the loader fills two pinned rows (each rewritten
   only after the event of the copy that last read it), the prefetcher uploads the next batch on
   a side stream of device 1 while device 0 is current, the consumer's stream waits for it and
   ``record_stream``s the batch, which is then dropped with the kernel queued; every batch's
   results (device 1, and a cross-device copy to device 0) equal numpy's under a per-operation
   delay;
3. a step drawing Philox numbers from a Generator (two registered graph-safe states) and the
   default generator, with temporaries from a MemPool, captured into that MemPool on device 1,
   replayed 40 times with the states read and rewound between replays (get_state/set_state,
   manual_seed, graphsafe_set_state), reset and recaptured with another size, every replay
   equal to the same step run eagerly from cloned states (Level Zero: its fills cannot be
   captured, a CaptureError, so the fills run eagerly around the replayed kernels; Metal: no
   capture at all);
4. memory debugging: ``_record_memory_history`` on both devices while a workload grows under
   ``set_per_process_memory_fraction`` on device 1 to an OutOfMemoryError, recovered by freeing
   and ``empty_cache`` (classic segments too on CUDA); at every stage ``memory_snapshot``
   describes every live Buffer exactly (its address, size, requested size and the frame that
   allocated it) and nothing else, the history's alloc/free/oom records match the program's own
   ledger, and ``memory_summary`` shows the counters;
5. a pool of 8 worker threads, each with its own stream on alternating devices, sharing a buffer
   cache (a buffer goes back with an event, the next taker's stream waits for it), calling
   ``synchronize`` while others queue work and raising mid-way with work queued: bounded joins,
   correct data, nothing leaked;
6. accidents: a stream of device 1 used under ``device_index(0)``, an event recorded on one
   device and waited on (and re-recorded) on another, a Buffer closed, dropped or left in a
   cycle while a slow copy still reads it (pinned sources and destinations dropped too, with
   ``empty_host_cache`` meanwhile), every object closed twice (a new buffer at the old address
   must survive), the parent's objects used and closed in a fork child: each a clear exception
   naming the bad value (the fork error is torch's exact message, which names the runtime, not
   the object), or correct data where the use is legal, and everything still usable afterwards.

No accel bug was found by these programs (r69c); one found later is a strict xfail naming the
cause.
"""

import collections
import concurrent.futures as cf
import gc
import re
import sys
import threading
import traceback

import numpy as np
import pytest

import accel
from accel import _finalize, _lazy
from conftest import SIMS, THOROUGH, run_forked, use_sim
from test_container_census_r63h import census, grown
from test_container_census_r63h import settle as census_settle
from test_user_programs import JOIN_S, _devices, live_objects, process_state, settle
from test_user_programs2 import accel_object_count
from test_user_programs_r56 import saxpy  # noqa: F401  (fixture: the saxpy kernel per simulator)
from test_user_programs_r66b import (_dev_stats, _host_stats, _inc, _last, _run_twice, _slow,
                                     check_stat_invariants, uniform_f32)
from test_user_kernels import expected as saxpy_np

MiB = 1 << 20
GRAPH_SIMS = [s for s in SIMS if s != "mps"]


def _blocks(n: int) -> int:
    return (n + 255) // 256


def _trace(exc) -> str:
    return "".join(traceback.format_exception(exc))


def _hooks() -> tuple:
    """The lengths of the registries a program must not grow: gc callbacks, stream-destroy hooks,
    OOM observers, lazy-init queues and reset hooks, owned handle releases, pending releases."""
    from accel import streams
    from accel.memory import _oom_hooks
    return (len(gc.callbacks), len(streams._destroy_hooks), len(_oom_hooks._oom_observers), len(_lazy._queued),
            len(_lazy._seeds), len(_lazy._reset_hooks), len(_finalize.owned), len(_finalize.pending))


def _threads() -> list:
    """The program's threads (the simulator's per-device worker threads start on first use)."""
    return sorted(t.name for t in threading.enumerate() if not t.name.startswith("accel-sim"))


# -- 1. a long-running service: 5,000 requests ---------------------------------------------------
#: The default run: checkpoints at 300 and 800 requests (500 requests between them, each of the eight
#: ways 60+ times; 300 is the first checkpoint at which the keep-alive window is full) (r74d trim).
N_REQUESTS, CHECKPOINT, KEEP_ALIVE = (5000, 500, 6) if THOROUGH else (800, 300, 6)


class _Cycle:
    """A request object left in a reference cycle: what it holds goes at a collection."""

    def __init__(self, *objs):
        self.objs = objs
        self.me = self


class ClientError(Exception):
    pass


@pytest.mark.parametrize("kind", SIMS)
def test_service_5000_requests_state_bounded_by_live_objects(monkeypatch, kind, frozen_heap):
    """A request handler, served by a pool of 4 threads: each request makes a Stream and an Event
    on one of the devices (device 0 stays current in the main thread), allocates a Buffer on the
    stream, uploads the request's bytes (pageable or from a pinned array, blocking or not),
    downloads them back (blocking, ``non_blocking`` with its event, or through ``copy_to`` into
    pinned memory) and checks them; and drops everything, eight ways in turn: plain (the stream
    looked up again by ``stream_id``), pinned and asynchronous through a DLPack import, inside
    ``with stream`` (on CUDA read through a ``Stream.from_handle`` wrapper), ``record_stream``
    onto the default stream with the stream closed first, a reference cycle left to the
    collector, a client error raised with a copy queued, a thread of its own that ends with its
    stream current, and a MemPool with a Generator fill checked against a numpy Philox.  Every
    tenth request's stream, event and buffer on the last device stay alive as a keep-alive
    session (a window of 6).

    After 500 requests and after 5,000, with the window full, the simulator's handles and the
    count of accel's objects by class are the same; with the window emptied, every container
    reachable from accel's modules (the r63h census) is no larger after 5,000 than after 500,
    memory is back to 0 on every device and in the pinned cache, and the threads, gc callbacks,
    hooks, observers and release registries are what they were."""
    # frozen_heap (r74d trim): its collections scan only what the test makes, not the whole heap
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    devs = _devices()
    state = process_state()
    R = accel.random
    keep = collections.deque(maxlen=KEEP_ALIVE)
    keep_lock = threading.Lock()

    def payload(i):
        n = 64 + (i * 37) % 3000
        return np.random.default_rng([69, i]).integers(0, 256, n, dtype=np.uint8)

    def serve(i):
        d = devs[(i // 8) % len(devs)]
        x = payload(i)
        n = x.size
        s = accel.Stream(d)
        e = accel.Event(enable_timing=bool(i % 2))
        b = accel.Buffer(n, device=d, stream=s)
        way = i % 8
        if way == 0:
            b.copy_from(x, stream=s)
            e.record(s)
            # the stream found again by its id (torch's Stream(stream_id=, device_index=, device_type=))
            again = accel.Stream(stream_id=s.stream_id, device_index=d, device_type=s.device_type)
            assert again is s
            out = b.to_numpy(stream=again)
        elif way == 1:
            pin = accel.empty_pinned(n, np.uint8)
            pin[:] = x
            b.copy_from(pin, stream=s, non_blocking=True)
            e.record(s)
            imported = accel.from_dlpack(b)               # a DLPack consumer's non-owning view
            out, done = imported.to_numpy(stream=s, non_blocking=True)
            done.synchronize()
            assert e.query()
        elif way == 2:
            with s:
                assert accel.current_stream(d) is s
                b.copy_from(x, non_blocking=True)
                e.record()
                # CUDA: another library's wrapper of the same handle (torch's ExternalStream)
                reader = accel.Stream.from_handle(s.handle, d) if kind == "cuda" else s
                out = b.to_numpy(stream=reader)
            assert accel.current_stream(d) is not s
        elif way == 3:
            b.copy_from(x, stream=s, non_blocking=True)
            e.record(s)
            default = accel.current_stream(d)
            default.wait_event(e)
            b.record_stream(default)
            s.close()                                  # the buffer outlives its stream
            out = accel.empty_pinned(n, np.uint8)
            b.copy_to(out, stream=default, non_blocking=True)
            default.synchronize()
        elif way == 4:
            b.copy_from(x, stream=s, non_blocking=True)
            e.record(s)
            e.synchronize()
            out = b.to_numpy(stream=s)
            _Cycle(s, e, b)                             # left to the collector
        elif way == 5:
            b.copy_from(x, stream=s, non_blocking=True)
            e.record(s)
            try:
                raise ClientError(f"request {i}: bad header")   # objects referenced by the traceback
            except ClientError as exc:
                assert "bad header" in str(exc)
            out = b.to_numpy(stream=s)
        elif way == 6:
            box = []

            def own_thread():
                try:
                    accel.set_stream(s)                  # left current: the thread ends with it
                    b.copy_from(x, non_blocking=True)
                    e.record()
                    box.append(b.to_numpy())
                except BaseException as exc:             # pragma: no cover - reported below
                    box.append(exc)
            t = threading.Thread(target=own_thread, name=f"request{i}")
            t.start()
            t.join(JOIN_S)
            assert not t.is_alive(), f"request {i}'s thread hung"
            out = box[0]
            if isinstance(out, BaseException):
                raise out
        else:
            with accel.device_index(d):
                pool = accel.MemPool()
            gen = R.Generator(d, seed=i)
            with accel.use_mem_pool(pool, device=d):
                r = accel.Buffer(4 * 64, device=d, stream=s)
            R.uniform_(r, generator=gen)
            b.copy_from(x, stream=s, non_blocking=True)
            e.record(s)
            got = r.to_numpy(np.float32)                  # the fill ran on the current stream
            assert np.array_equal(got, uniform_f32(i, 0, 64)), i
            out = b.to_numpy(stream=s)
            del pool, gen, r
        assert np.array_equal(out, x), (i, way)
        if i % 10 == 0 and way not in (3, 4) and d == devs[-1]:
            # (one device only: the threads finish requests out of order, and the window's
            # make-up must not depend on which ones it ends with)
            fixed = accel.Buffer(4096, device=d, stream=s)
            with keep_lock:
                keep.append((s, e, fixed))
        return way

    def run(first, last):
        with cf.ThreadPoolExecutor(4, thread_name_prefix="handler") as pool:
            futs = [pool.submit(serve, i) for i in range(first, last)]
            done, pending = cf.wait(futs, timeout=120)
            assert not pending, f"{len(pending)} requests hung"
            for f in futs:
                exc = f.exception()
                assert exc is None, _trace(exc)
        gc.collect()
        _finalize.drain()
        for d in devs:
            accel.synchronize(d)

    def window_full():
        assert len(keep) == KEEP_ALIVE
        settle()
        gc.collect()        # empty_cache forgets a dead MemPool's pool: a cycle (its free lists name it)
        return live_objects(), accel_object_count()

    def window_empty():
        with keep_lock:
            keep.clear()
        census_settle()
        for d in devs:
            assert accel.memory.memory_allocated(d) == 0, (d, accel.memory.memory_allocated(d))
            check_stat_invariants(d, "service")
        assert _host_stats() == (0, 0, 0)
        return census()

    run(0, 100)                                         # warm-up: first-use caches (RNG kernels)
    window_empty()
    hooks0, live0, threads0 = _hooks(), live_objects(), _threads()
    run(100, CHECKPOINT)
    full_a = window_full()
    census_a = window_empty()
    run(CHECKPOINT, N_REQUESTS)
    full_b = window_full()
    diff = {k: (full_a[1].get(k), v) for k, v in full_b[1].items() if v != full_a[1].get(k)}
    diff.update({k: (v, None) for k, v in full_a[1].items() if k not in full_b[1]})
    assert full_b[0] == full_a[0] and not diff, ("a full keep-alive window holds other objects after 5,000 "
                                                 "requests", full_a[0], full_b[0], diff)
    census_b = window_empty()
    assert grown(census_a, census_b) == {}
    assert live_objects() == live0
    assert _hooks() == hooks0
    assert _threads() == threads0
    sim_threads = [t.name for t in threading.enumerate() if t.name.startswith("accel-sim")]
    assert len(sim_threads) <= 2 * len(devs), sim_threads      # the simulator's per-device workers
    assert process_state() == state


# -- 2. an apex-style double-buffered prefetcher onto device 1 --------------------------------------
class Loader:
    """Batches staged in two pinned rows: a row is rewritten only after the event of the copy that
    last read it (``release``)."""

    def __init__(self, n: int, batches: int, seed: int):
        self.n, self.batches, self.seed = n, batches, seed
        self.rows = accel.empty_pinned((2, n), np.float32)
        self.read = [None, None]       # the event of the last copy that read each row

    def batch(self, b: int) -> np.ndarray:
        return np.random.default_rng([69, self.seed, b]).integers(-512, 512, self.n).astype(np.float32)

    def __iter__(self):
        for b in range(self.batches):
            row = b % 2
            if self.read[row] is not None:
                self.read[row].synchronize()           # the upload that read this row is done
            self.rows[row] = self.batch(b)
            yield b, row, self.rows[row]

    def release(self, row: int, event) -> None:
        self.read[row] = event


class Prefetcher:
    """NVIDIA apex's ``data_prefetcher``: the next batch is uploaded on a side stream while the
    current one is consumed; ``next()`` makes the consumer's stream wait and marks the batch used
    there (``record_stream``)."""

    def __init__(self, loader: Loader, dev: int):
        self.loader, self.dev = loader, dev
        self.it = iter(loader)
        self.stream = accel.Stream(dev)
        self.preload()

    def preload(self):
        try:
            self.b, row, host = next(self.it)
        except StopIteration:
            self.next_batch = None
            return
        with self.stream:
            self.next_batch = accel.Buffer(host.nbytes, device=self.dev)   # on the side stream
            self.next_batch.copy_from(host, non_blocking=True)
            self.loader.release(row, self.stream.record_event())

    def next(self):
        consumer = accel.current_stream(self.dev)
        consumer.wait_stream(self.stream)
        batch, b = self.next_batch, getattr(self, "b", None)
        if batch is not None:
            batch.record_stream(consumer)
        self.preload()
        return b, batch


@pytest.mark.parametrize("kind", SIMS)
def test_double_buffered_prefetch_pinned_side_stream_on_device1(monkeypatch, kind, saxpy):
    """The training loop runs with device 0 current; its data lives on device 1 (the last
    device).  Each step takes the prefetched batch, accumulates ``acc += 1 * batch`` and
    ``scaled = 0.5 * batch + 0`` with the user kernel on device 1's current stream, drops the
    batch (its memory may be reused by the next upload only after the kernels ran:
    ``record_stream``), sends ``scaled`` to device 0 (device 0's stream waits for an event of
    device 1's) and downloads both into pinned memory without blocking.  Under a per-operation
    delay every batch's ``scaled`` and running ``acc`` equal numpy's, the pinned rows were never
    rewritten under a copy, device 0 stayed current, and memory, the pinned cache and the
    footprint are back where they were."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    dev = _last()
    n, batches = 4096, 10
    state = process_state()

    def program(run):
        K = saxpy(dev)
        settle()
        base = {d: _dev_stats(d) for d in _devices()}
        loader = Loader(n, batches, run)
        acc = accel.Buffer(4 * n, device=dev).fill_(0)
        results = []
        with _slow(2000):
            pf = Prefetcher(loader, dev)
            b, batch = pf.next()
            while batch is not None:
                assert accel.current_device_index() == 0
                work = accel.current_stream(dev)
                scaled = accel.Buffer(4 * n, device=dev, stream=work).fill_(0, stream=work)
                accel.launch(K, _blocks(n), 256, np.float32(1.0), batch, acc, n, stream=work)
                accel.launch(K, _blocks(n), 256, np.float32(0.5), batch, scaled, n, stream=work)
                del batch                                # freed with both kernels queued
                done = work.record_event()
                on0 = accel.Buffer(4 * n, device=0)
                accel.current_stream(0).wait_event(done)  # an event of device 1 on device 0's stream
                on0.copy_from(scaled, non_blocking=True)
                got0 = on0.to_numpy(np.float32, non_blocking=True)
                got_acc = acc.to_numpy(np.float32, non_blocking=True)
                results.append((b, got0, got_acc))
                del scaled, on0
                b, batch = pf.next()
            pf = None
        total = np.zeros(n, np.float32)
        for b, (scaled0, ev0), (acc_now, ev1) in results:
            ev0.synchronize()
            ev1.synchronize()
            x = loader.batch(b)
            total = saxpy_np(1.0, x, total)
            assert np.array_equal(scaled0, saxpy_np(0.5, x, np.zeros(n, np.float32))), (run, b)
            assert np.array_equal(acc_now, total), (run, b, np.flatnonzero(acc_now != total)[:8])
        assert [r[0] for r in results] == list(range(batches))
        assert process_state() == state
        del acc, results, loader, K, scaled0, acc_now, ev0, ev1, got0, got_acc
        settle()
        assert {d: _dev_stats(d) for d in _devices()} == base
        assert _host_stats()[0] == 0

    _run_twice(program)


# -- 3. a Philox step captured into a MemPool, replayed with graph-safe states moved between -------
@pytest.mark.parametrize("kind", SIMS)
def test_rng_step_captured_into_mempool_replayed_with_state_moves(monkeypatch, kind, saxpy):
    """A noisy-update step on device 1 (device 0 current): temporaries ``x`` and ``w`` (a MemPool's
    memory), ``x ~ U`` from the job's Generator, ``w ~ U`` from a second state of it (switched in
    with graphsafe_set_state), ``out ~ U`` from device 1's default generator, then
    ``out = 2 x + out`` and ``out = -w + out`` with the user kernel.  On CUDA the whole step is
    captured into the MemPool (``Graph(pool=pool.id)``) with both states registered; Level Zero
    refuses the capture of a fill (CaptureError, the graph left empty and the states unmoved), so
    its graph holds the kernels and the fills run eagerly before each replay; Metal has no
    capture (NotImplementedError) and runs the step eagerly.

    40 replays; between them the program saves and restores the first state (get_state /
    set_state: the next replay repeats the numbers), reseeds the second (manual_seed), draws
    eagerly from the second through the generator switched to it, points the generator at an
    unregistered clone (replays keep drawing from the registered states) and rewinds the default
    generator (set_rng_state).  Every replay equals the same step run eagerly from clones of the
    states (byte for byte) and a numpy Philox.  Then reset, recapture with another size into the
    same pool, 10 more replays; the pool's use count and memory follow; at the end everything
    is released."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    dev = _last()
    R = accel.random
    state = process_state()

    def program(run):
        K = saxpy(dev)
        settle()
        base = _dev_stats(dev)
        with accel.device_index(dev):
            pool = accel.MemPool()
        seeds = {"A": 6900 + run, "B": 6901 + run, "D": 6902 + run}
        R.manual_seed_all(seeds["D"])
        home = R.get_rng_state(0).copy()
        gen = R.Generator(dev, seed=seeds["A"])
        stA = gen.graphsafe_get_state()
        stB = gen.clone_state()
        stB.manual_seed(seeds["B"])
        model = {k: [seeds[k], 0] for k in seeds}     # (seed, offset) the oracle follows
        cap = accel.Stream(dev)

        def fills(n, x, w, out):
            R.uniform_(x, generator=gen)
            gen.graphsafe_set_state(stB)
            R.uniform_(w, generator=gen)
            gen.graphsafe_set_state(stA)
            R.uniform_(out)

        def kernels(n, x, w, out):
            accel.launch(K, _blocks(n), 256, np.float32(2.0), x, out, n)
            accel.launch(K, _blocks(n), 256, np.float32(-1.0), w, out, n)

        def eager_twin(n):
            """The step run eagerly from clones of the three states (as they are now)."""
            ga, gb = stA.clone_state(), stB.clone_state()
            gd = R.Generator(dev, seed=model["D"][0])
            gd.set_offset(R.default_generator(dev).get_offset())
            with accel.device_index(dev):
                x, w, out = (accel.Buffer(4 * n) for _ in range(3))
                R.uniform_(x, generator=ga)
                R.uniform_(w, generator=gb)
                R.uniform_(out, generator=gd)
                kernels(n, x, w, out)
                return out.to_numpy(np.float32)

        def oracle(n):
            u = {}
            for k in ("A", "B", "D"):
                u[k] = uniform_f32(model[k][0], model[k][1], n)
                model[k][1] += _inc(n)
            return saxpy_np(-1.0, u["B"], saxpy_np(2.0, u["A"], u["D"]))

        def capture(g, n, out):
            """Capture the step into ``g``; returns the persistent inputs an eager part needs."""
            if kind == "mps":
                with pytest.raises(NotImplementedError, match="MPS has no stream capture"):
                    with accel.graph(g, stream=cap):
                        pass
                return None
            g.register_generator_state(stA)
            g.register_generator_state(stB)
            if kind == "cuda":
                with accel.graph(g, stream=cap):
                    x, w = accel.Buffer(4 * n, device=dev), accel.Buffer(4 * n, device=dev)
                    fills(n, x, w, out)
                    kernels(n, x, w, out)
                    del x, w                              # temporaries: the pool keeps them for replays
                return None
            x = accel.Buffer(4 * n, device=dev)
            offsets = (stA.get_offset(), stB.get_offset())
            with pytest.raises(accel.CaptureError, match="cannot be captured on xpu"):
                with accel.graph(g, stream=cap):
                    R.uniform_(x, generator=gen)
            assert (stA.get_offset(), stB.get_offset()) == offsets and repr(g) == "<accel.Graph empty>"
            with accel.use_mem_pool(pool, device=dev):
                x, w = accel.Buffer(4 * n, device=dev), accel.Buffer(4 * n, device=dev)
            with accel.graph(g, stream=cap):
                kernels(n, x, w, out)
            return x, w

        def step(g, n, out, inputs):
            if kind == "cuda":
                g.replay()
                return
            with accel.device_index(dev):
                if kind == "mps":
                    x, w = accel.Buffer(4 * n), accel.Buffer(4 * n)
                    fills(n, x, w, out)
                    kernels(n, x, w, out)
                else:
                    fills(n, *inputs, out)
                    g.replay()

        for n, replays in ((3001, 40), (1500, 10)):
            out = accel.Buffer(4 * n, device=dev)
            g = accel.Graph(pool=pool.id)
            inputs = capture(g, n, out)
            if kind != "mps":
                assert pool.use_count() == 2                      # the MemPool and the graph
            assert (stA.get_offset(), stB.get_offset()) == (model["A"][1], model["B"][1])
            saved = None
            for i in range(replays):
                if i % 5 == 1:
                    saved = (stA.get_state(), [*model["A"]])
                if i % 7 == 3:
                    stB.manual_seed(seeds["B"] + 1000 * i)
                    model["B"] = [seeds["B"] + 1000 * i, 0]
                if i % 6 == 2:
                    z = accel.Buffer(4 * 257, device=dev)
                    gen.graphsafe_set_state(stB)
                    R.uniform_(z, generator=gen)               # an eager draw from the second state
                    gen.graphsafe_set_state(stA)
                    assert np.array_equal(z.to_numpy(np.float32), uniform_f32(*model["B"], 257))
                    model["B"][1] += _inc(257)
                    del z
                if i % 4 == 3:
                    saved_def = R.get_rng_state(dev)
                    R.uniform_(accel.Buffer(4 * 64, device=dev))
                    R.set_rng_state(saved_def, dev)             # rewound: the draw never happened
                stray = None
                if i % 3 == 0 and kind != "mps":
                    stray = gen.clone_state()
                    gen.graphsafe_set_state(stray)              # replays keep drawing from stA
                twin = eager_twin(n) if kind != "mps" or stray is None else None
                if stray is not None and kind == "xpu":
                    gen.graphsafe_set_state(stA)                # xpu's fills are eager: back first
                step(g, n, out, inputs)
                if stray is not None:
                    assert stray.get_offset() == model["A"][1]  # the clone never moved
                    gen.graphsafe_set_state(stA)
                want = oracle(n)
                got = out.to_numpy(np.float32)
                assert np.array_equal(got, want), (run, n, i, np.flatnonzero(got != want)[:8])
                if twin is not None:
                    assert np.array_equal(got, twin), (run, n, i, "eager twin")
                assert (stA.get_offset(), stB.get_offset()) == (model["A"][1], model["B"][1]), (run, n, i)
                assert R.default_generator(dev).get_offset() == model["D"][1], (run, n, i)
                if i % 5 == 1:
                    stA.set_state(saved[0])                      # the next replay repeats these numbers
                    model["A"] = saved[1]
                assert accel.current_device_index() == 0
            if kind != "mps":
                g.reset()
                assert pool.use_count() == 1
            del g, inputs, out
            gc.collect()
            live = [b for seg in pool.snapshot() for b in seg["blocks"] if b["state"] == "active_allocated"]
            assert live == [], (run, n, live)                   # no temporary outlived its graph
        if dev != 0:                                     # (Metal: the one device is both)
            assert np.array_equal(R.get_rng_state(0), home)
        assert process_state() == state
        del pool, gen, stA, stB, cap, K
        settle()
        assert _dev_stats(dev) == base

    _run_twice(program)


# -- 4. memory debugging: history, snapshot and summary around an OOM under a memory fraction ----
def _round512(nbytes: int) -> int:
    return max(512, (nbytes + 511) // 512 * 512)


def _new_tracked(ledger: dict, nbytes: int, d: int, stream=None):
    """A Buffer the program keeps in its own ledger: address -> (buffer, line that allocated it)."""
    buf, line = accel.Buffer(nbytes, device=d, stream=stream), sys._getframe().f_lineno
    ledger[buf.ptr] = (buf, line)
    return buf


def _check_snapshot_exact(ledger: dict, devs, where: str, pending=()) -> None:
    """The snapshot lists exactly the program's live buffers as active_allocated blocks (address,
    requested size, rounded size, the allocating frame; the same frames from
    ``_allocation_traceback``), ``pending`` (addresses freed with a use still queued) as
    active_pending_free, every block inside its segment with the segment's blocks tiling it, and
    the counters agree (check_stat_invariants)."""
    segs = accel.memory.memory_snapshot()
    for d in devs:
        mine = {ptr: v for ptr, v in ledger.items() if v[0].device_index == d}
        allocated, pend = {}, set()
        for seg in (s for s in segs if s["device"] == d):
            at = seg["address"]
            for b in seg["blocks"]:
                assert b["address"] == at, (where, d, "blocks must tile their segment", seg["address"], b)
                at += b["size"]
                if b["state"] == "active_allocated":
                    allocated[b["address"]] = b
                elif b["state"] == "active_pending_free":
                    pend.add(b["address"])
            assert at == seg["address"] + seg["total_size"], (where, d, "blocks must fill their segment")
            assert seg["allocated_size"] == sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        assert set(allocated) == set(mine), (where, d, "snapshot lists other blocks than the live buffers",
                                              sorted(set(allocated) ^ set(mine)))
        for ptr, (buf, line) in mine.items():
            b = allocated[ptr]
            assert b["requested_size"] == buf.nbytes, (where, d, b, buf.nbytes)
            assert b["size"] == _round512(buf.nbytes), (where, d, b, buf.nbytes)
            top = b["frames"][0]
            assert (top["filename"], top["line"], top["name"]) == (__file__, line, "_new_tracked"), (where, top)
            assert accel.memory._allocation_traceback(ptr) == b["frames"], (where, ptr)
        assert pend <= {p for p in pending if p not in mine}, (where, d, sorted(pend))
        check_stat_invariants(d, where)


def _check_history(ledger: dict, devs) -> None:
    """The history's last alloc at each live buffer's address has its size, with no free after
    it, and allocs minus frees equal the live count, on every device."""
    for d in devs:
        trace = accel.memory._snapshot()["device_traces"][d]
        last = {}
        for e in trace:
            if e["action"] in ("alloc", "free_requested", "free_completed"):
                last.setdefault(e["addr"], []).append((e["action"], e["size"]))
        for ptr, (buf, _) in ledger.items():
            if buf.device_index == d:
                events = last[ptr]
                allocs = [i for i, (a, _) in enumerate(events) if a == "alloc"]
                assert events[allocs[-1]] == ("alloc", buf.nbytes), (d, ptr, events)
                assert all(a == "alloc" for a, _ in events[allocs[-1]:]), (d, ptr, events)
        actions = [e["action"] for e in trace]
        live_n = sum(1 for b, _ in ledger.values() if b.device_index == d)
        assert actions.count("alloc") - actions.count("free_requested") == live_n, (d, live_n)


def _torch_size(size: int) -> str:
    """torch's memory_summary cell for ``size`` in its row's current column (_format_size)."""
    pref, prefix = size, "B  "
    for new_prefix in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if pref < 768 * 1024:
            break
        prefix, size, pref = new_prefix, size // 1024, pref / 1024
    return f"{size:6d} {prefix}"


_DEBUG_CASES = [(k, c) for k, c in (("cuda", ""), ("cuda", "expandable_segments:False"), ("xpu", ""), ("mps", ""))
                if k in SIMS]


@pytest.mark.parametrize("kind,conf", _DEBUG_CASES)
def test_memory_debugging_history_snapshot_summary_around_oom(monkeypatch, kind, conf):
    """A model whose activations grow until device 1 (device 0 current) is full under a 40 MiB
    ``set_per_process_memory_fraction``, with ``_record_memory_history("all")`` on: device 0 holds
    a few small buffers meanwhile, and some of device 1's buffers are freed while a copy on a
    slow side stream still reads them (``active_pending_free`` until it ran).  The program keeps
    a ledger of every live buffer and the line that allocated it.  Before, at and after the
    OutOfMemoryError (caught; half the activations dropped, ``empty_cache``, then the other half,
    ``empty_cache``, the failed size allocated again) the snapshot describes every live buffer
    exactly and nothing else; the history's last alloc at each live address has its size and no
    free after it, its "oom" entries equal the caught errors (rounded size, free memory, frame),
    and allocs minus frees equal the live count; ``memory_summary`` shows the OOM count and the current allocated bytes;
    the error names the device and the size tried.  Finally history off, cap lifted: the
    history is empty and memory back to the start."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": conf} if conf else {}
    use_sim(monkeypatch, kind, **env)
    accel.set_device_index(0)
    devs = _devices()
    dev = devs[-1]
    settle()
    base = {d: _dev_stats(d) for d in devs}
    ooms0 = accel.memory.memory_stats(dev)["num_ooms"]
    total = accel.memory.get_memory_info(dev)[1]
    accel.memory._record_memory_history("all", max_entries=100_000, clear_history=True)
    accel.memory.set_per_process_memory_fraction(40 * MiB / total, dev)
    ledger, pending = {}, set()
    side = accel.Stream(dev)
    host = np.arange(256 * 1024, dtype=np.uint8)
    for i in range(4):
        _new_tracked(ledger, 1000 + 512 * i, 0).fill_(i)
    _check_snapshot_exact(ledger, devs, "start")
    caught = []
    with _slow(3000):
        sink = _new_tracked(ledger, host.nbytes, dev, stream=side)
        for step in range(100):
            size = (256 * 1024) << (step % 4)              # 256 KiB .. 2 MiB activations
            try:
                act = _new_tracked(ledger, size + 100 * step, dev)
            except accel.OutOfMemoryError as exc:
                caught.append((size + 100 * step, str(exc), exc.observer_args))
                break
            if step % 5 == 4:
                # a read on the slow side stream, then the buffer dropped: its block is pending
                side.wait_stream(accel.current_stream(dev))
                sink.copy_from(act.as_array(np.uint8, (host.nbytes,)), stream=side, non_blocking=True)
                del ledger[act.ptr]
                pending.add(act.ptr)
                del act
                _check_snapshot_exact(ledger, devs, f"step {step} pending", pending)
            act = None
        else:
            pytest.fail("no OutOfMemoryError under a 40 MiB cap")
    side.synchronize()
    assert len(caught) == 1
    tried, msg, args = caught[0]
    assert f"GPU {dev} " in msg and "out of memory" in msg and "Tried to allocate" in msg, msg
    assert args is not None and args[0] == dev and args[1] >= tried, args
    _check_snapshot_exact(ledger, devs, "at OOM", pending)
    trace = accel.memory._snapshot()["device_traces"][dev]
    ooms = [e for e in trace if e["action"] == "oom"]
    assert len(ooms) == 1 and ooms[0]["size"] == _round512(tried), ooms      # torch: the rounded size
    assert ooms[0]["frames"][0]["name"] == "_new_tracked", ooms[0]["frames"][:2]
    assert ooms[0]["device_free"] == args[3], (ooms[0], args)
    # recover: drop every other activation (snapshot checked), then the rest; empty the cache;
    # allocate the failed size again.  (Half is not enough in general: the freed holes between
    # live blocks are each smaller than the failed request, the largest so far.)
    acts = sorted(p for p, (b, _) in ledger.items() if b.device_index == dev and b is not sink)
    for ptr in acts[::2]:
        del ledger[ptr]
    gc.collect()
    reserved_before = accel.memory.memory_reserved(dev)
    accel.memory.empty_cache()
    assert accel.memory.memory_reserved(dev) <= reserved_before
    _check_snapshot_exact(ledger, devs, "half freed, empty_cache")
    for ptr in acts[1::2]:
        del ledger[ptr]
    gc.collect()
    accel.memory.empty_cache()
    _check_snapshot_exact(ledger, devs, "all activations freed, empty_cache")
    assert accel.memory.memory_reserved(dev) <= 4 * MiB, accel.memory.memory_reserved(dev)   # the sink's
    again = _new_tracked(ledger, tried, dev)
    again.fill_(7)
    _check_snapshot_exact(ledger, devs, "recovered")
    _check_history(ledger, devs)
    st = accel.memory.memory_stats(dev)
    assert st["num_ooms"] - ooms0 == 1
    summary = accel.memory.memory_summary(dev)
    m = re.search(r"OOMs: (\d+)", summary)
    assert m and int(m.group(1)) == st["num_ooms"], summary[:400]
    row = next(line for line in summary.splitlines() if line.startswith("| Allocated memory"))
    assert _torch_size(st["allocated_bytes.all.current"]) in row, (row, st["allocated_bytes.all.current"])
    # done: history off, cap lifted, everything released
    del again, sink, side, ledger
    accel.memory._record_memory_history(None)
    accel.memory.set_per_process_memory_fraction(1.0, dev)
    assert all(t == [] for t in accel.memory._snapshot()["device_traces"])
    settle()
    assert {d: _dev_stats(d) for d in devs} == base


# -- 5. eight worker threads sharing a buffer cache, with synchronize and failures mid-way --------
class BufferCache:
    """A user's cache of device buffers shared by threads: a buffer goes back with an event of the
    stream that used it last, and the next taker's stream waits for that event."""

    def __init__(self):
        self.lock = threading.Lock()
        self.free = collections.defaultdict(list)
        self.hits = 0

    def take(self, nbytes: int, stream):
        d = stream.device_index
        with self.lock:
            shelf = self.free[(d, nbytes)]
            item = shelf.pop() if shelf else None
            self.hits += item is not None
        if item is None:
            return accel.Buffer(nbytes, device=d, stream=stream)
        buf, used = item
        stream.wait_event(used)
        return buf

    def give(self, buf, stream) -> None:
        used = stream.record_event()
        with self.lock:
            self.free[(buf.device_index, buf.nbytes)].append((buf, used))

    def clear(self) -> None:
        with self.lock:
            self.free.clear()


class TaskFailed(Exception):
    pass


@pytest.mark.parametrize("kind", SIMS)
def test_worker_pool_shares_buffer_cache_with_failures_and_synchronize(monkeypatch, kind, saxpy):
    """Eight worker threads, worker ``k`` with its own stream on device ``k % devices`` (device 0
    current in the main thread), take 96 tasks from a queue.  A task takes two buffers from the
    shared cache (made on another worker's stream, last used there), uploads ``x``, zeroes ``y``,
    computes ``y = 2 x + y`` with the kernel, gives ``x`` back to the cache *with the kernel still
    queued*, downloads ``y`` and gives it back too.  Every fifth task calls
    ``accel.synchronize`` of its device mid-way while the others queue work; every seventh raises
    after its kernel was queued (its buffers dropped with work in flight, never returned).  Under a
    per-operation delay: every result equals numpy's (a taker that did not wait for the giver's
    event would overwrite ``x`` under the kernel), exactly the failing tasks failed, the cache
    was hit, every worker ends within the bounded join, and memory, handles and accel's
    footprint are back where they were once the cache is emptied."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    devs = _devices()
    n_workers, n_tasks = 8, 96
    sizes = (1024, 2048, 3072)
    state = process_state()

    def program(run):
        K = {d: saxpy(d) for d in devs}
        settle()
        base = {d: _dev_stats(d) for d in devs}
        cache = BufferCache()
        tasks = collections.deque(range(n_tasks))
        lock = threading.Lock()
        results, failures, crashed = {}, {}, []

        def data(t):
            n = sizes[t % len(sizes)]
            return np.random.default_rng([69, run, t]).integers(-1000, 1000, n).astype(np.float32)

        def task(t, s):
            d = s.device_index
            x = data(t)
            n = x.size
            a = cache.take(4 * n, s)
            y = cache.take(4 * n, s)
            a.copy_from(x, stream=s, non_blocking=True)
            y.fill_(0, stream=s)
            accel.launch(K[d], _blocks(n), 256, np.float32(2.0), a, y, n, stream=s)
            if t % 7 == 3:
                raise TaskFailed(f"task {t} failed with its kernel queued")
            cache.give(a, s)                              # the kernel may still be reading it
            del a
            if t % 5 == 0:
                accel.synchronize(d)
            out = y.to_numpy(np.float32, stream=s)
            cache.give(y, s)
            return out

        def worker(k):
            try:
                d = devs[k % len(devs)]
                s = accel.Stream(d)
                while True:
                    with lock:
                        if not tasks:
                            break
                        t = tasks.popleft()
                    try:
                        if t % 2:
                            with s:
                                results[t] = task(t, s)
                        else:
                            results[t] = task(t, s)
                    except TaskFailed as exc:
                        failures[t] = str(exc)
                    assert accel.current_device_index() == 0 and accel.current_stream(d) is not s
                if k % 2:
                    s.close()
            except BaseException as exc:
                crashed.append(exc)

        with _slow(300):
            threads = [threading.Thread(target=worker, args=(k,), name=f"worker{k}") for k in range(n_workers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(JOIN_S)
            assert not [t.name for t in threads if t.is_alive()], "workers hung (deadlock?)"
        assert not crashed, _trace(crashed[0])
        failing = {t for t in range(n_tasks) if t % 7 == 3}
        assert set(failures) == failing and set(results) == set(range(n_tasks)) - failing
        for t, got in results.items():
            x = data(t)
            assert np.array_equal(got, saxpy_np(2.0, x, np.zeros_like(x))), (run, t)
        assert cache.hits > n_tasks // 2, cache.hits
        assert process_state() == state
        cache.clear()
        del cache, results, K, threads
        settle()
        assert {d: _dev_stats(d) for d in devs} == base

    _run_twice(program)


# -- 6. accidents: wrong device, wrong event, buffers closed in use, double frees, fork ----------
def _raises(exc_type, call, *words):
    """``call()`` raises ``exc_type`` whose message names every one of ``words``."""
    with pytest.raises(exc_type) as info:
        call()
    msg = str(info.value)
    assert all(w in msg for w in words), (msg, words)
    return info.value


@pytest.mark.parametrize("kind", SIMS)
def test_stream_of_another_device_under_device_index(monkeypatch, kind, saxpy):
    """Under ``device_index(0)`` a stream of device 1 passed where device 0's was meant: a Buffer
    of device 0 allocated on it, filled, copied or downloaded on it, device 0's kernel launched on
    it, device 1's kernel given device 0's buffer, the stream passed as a device.  Each is a
    ValueError/TypeError naming both devices (or the stream), the buffer's bytes unchanged.  The
    legal uses work and leave device 0 current: a device-1 buffer filled on it, device 1's kernel
    launched on it, ``with stream`` (device 1 inside, 0 after), ``set_stream`` (device 1's current
    stream, device 0 restored by the context)."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    devs = _devices()
    if len(devs) < 2:
        pytest.skip("one device: no stream of another device (Metal)")
    state = process_state()
    K0, K1 = saxpy(0), saxpy(1)
    n = 256
    s1 = accel.Stream(1)
    b0 = accel.Buffer(4 * n, device=0).copy_from(np.arange(n, dtype=np.float32))
    b1 = accel.Buffer(4 * n, device=1).fill_(0)
    x = np.full(n, 3, np.float32)
    with accel.device_index(0):
        _raises(ValueError, lambda: accel.Buffer(64, device=0, stream=s1), "device 1", "device 0")
        for call in (lambda: b0.fill_(1, stream=s1), lambda: b0.copy_from(x, stream=s1),
                     lambda: b0.to_numpy(stream=s1), lambda: b0.copy_to(np.empty(n, np.float32), stream=s1)):
            _raises(ValueError, call, "stream is on device 1", "buffer is on device 0")
        _raises(ValueError, lambda: accel.launch(K0, 1, 256, 1.0, b0, b0, n, stream=s1),
                "stream is on device 1", "loaded on device 0")
        _raises(ValueError, lambda: accel.launch(K1, 1, 256, 1.0, b0, b1, n, stream=s1),
                "memory of device 0", "loaded on device 1")
        for call in (lambda: accel.synchronize(s1), lambda: accel.current_stream(s1)):
            _raises(TypeError, call, repr(s1))
        assert accel.current_device_index() == 0
        assert np.array_equal(b0.to_numpy(np.float32), np.arange(n, dtype=np.float32))
        # the legal uses
        b1.copy_from(x, stream=s1)
        accel.launch(K1, 1, 256, 2.0, b1, b1, n, stream=s1)    # b1 = 2 b1 + b1
        assert np.array_equal(b1.to_numpy(np.float32, stream=s1), np.full(n, 9, np.float32))
        with s1:
            assert accel.current_device_index() == 1 and accel.current_stream() is s1
            accel.launch(K1, 1, 256, 1.0, b1, b1, n)
        assert accel.current_device_index() == 0 and accel.current_stream(1) is not s1
        with accel.device_index(0):
            accel.set_stream(s1)
            assert accel.current_device_index() == 1
        assert accel.current_device_index() == 0 and accel.current_stream(1) is s1
        assert np.array_equal(b1.to_numpy(np.float32), np.full(n, 18, np.float32))   # on s1, current now
        accel.set_stream(accel.default_stream(1))
        accel.set_device_index(0)
    assert process_state() == state


@pytest.mark.parametrize("kind", SIMS)
def test_event_recorded_on_one_device_used_on_another(monkeypatch, kind):
    """An event recorded after a slow fill on device 0 is waited on by a stream of device 1, which
    then copies the filled buffer across: the copy sees the fill (the wait orders across devices).
    Recording that event again on device 1's stream, or timing it against a device-1 event, is an
    InvalidDeviceError naming both devices; the event still works on device 0 afterwards
    (query, synchronize, record again, elapsed_time with a device-0 event)."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    devs = _devices()
    if len(devs) < 2:
        pytest.skip("one device (Metal)")
    state = process_state()
    n = 1 << 16
    s0, s1 = accel.Stream(0), accel.Stream(1)
    src = accel.Buffer(n, device=0, stream=s0)
    dst = accel.Buffer(n, device=1, stream=s1).fill_(0, stream=s1)
    e = accel.Event(enable_timing=True)
    with _slow(2000):
        for v in (1, 2, 3, 4):
            src.fill_(v, stream=s0)                       # each slow: the last one lands late
        e.record(s0)
        s1.wait_event(e)                                  # a device-1 stream waits for device 0
        dst.copy_from(src, stream=s1)
    assert (dst.to_numpy(stream=s1) == 4).all()
    _raises(accel.InvalidDeviceError, lambda: e.record(s1), "device 0", "device 1")
    other = accel.Event(enable_timing=True)
    other.record(s1)
    other.synchronize()
    _raises(accel.InvalidDeviceError, lambda: e.elapsed_time(other), "device 0", "device 1")
    assert e.query()
    e.synchronize()
    later = accel.Event(enable_timing=True)
    src.fill_(5, stream=s0)
    e.record(s0)
    later.record(s0)
    later.synchronize()
    assert e.elapsed_time(later) >= 0.0
    assert (src.to_numpy(stream=s0) == 5).all()
    assert process_state() == state


@pytest.mark.parametrize("how", ["close", "drop", "cycle"])
@pytest.mark.parametrize("kind", SIMS)
def test_buffer_closed_or_dropped_while_a_slow_copy_reads_it(monkeypatch, kind, how):
    """A buffer allocated on the default stream of the last device is read by a slow copy queued
    on a side stream, and then closed (or its last reference dropped, or left in a reference
    cycle and collected) at once; the program goes on allocating the same size on the default
    stream and overwriting it.  The copy's destination holds the original bytes (the allocator
    kept the block from reuse until the side stream's work ran); a pinned source dropped with its
    upload queued, and a pinned destination dropped with its download queued (``empty_host_cache``
    called meanwhile; new pinned arrays written meanwhile keep their bytes), likewise.  Using the
    closed buffer is a RuntimeError naming it; memory is back to where it was."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    dev = _last()
    state = process_state()
    settle()
    base = _dev_stats(dev)
    n = 1 << 18
    side = accel.Stream(dev)
    pattern = np.random.default_rng(69).integers(0, 256, n, dtype=np.uint8)
    dst = accel.Buffer(n, device=dev, stream=side)
    up = accel.Buffer(n, device=dev, stream=side)
    with _slow(3000):
        src = accel.Buffer(n, device=dev).copy_from(pattern)
        side.wait_stream(accel.current_stream(dev))
        for _ in range(3):
            dst.fill_(0, stream=side)                     # slow work ahead of the copy
        dst.copy_from(src, stream=side, non_blocking=True)
        pin = accel.empty_pinned(n, np.uint8)
        pin[:] = pattern[::-1]
        up.copy_from(pin, stream=side, non_blocking=True)
        down = accel.empty_pinned(n, np.uint8)
        dst.copy_to(down, stream=side, non_blocking=True)     # a download into pinned memory...
        del down                                               # ...whose array is dropped at once
        kept = src
        if how == "close":
            src.close()
        elif how == "cycle":
            _Cycle(src)
        del src, pin
        if how == "cycle":
            gc.collect()
        accel.memory.empty_host_cache()                  # must not give back blocks still in use
        fresh = []
        for _ in range(3):
            z = accel.Buffer(n, device=dev)
            z.fill_(0xEE)
            again = accel.empty_pinned(n, np.uint8)
            again[:] = 0x11
            fresh.append(again)
            del z, again
    side.synchronize()
    assert all((a == 0x11).all() for a in fresh)         # no pending download landed in them
    del fresh
    assert np.array_equal(dst.to_numpy(stream=side), pattern)
    assert np.array_equal(up.to_numpy(stream=side), pattern[::-1])
    if how == "close":
        _raises(RuntimeError, lambda: kept.fill_(1), repr(kept), "was closed")
        _raises(RuntimeError, lambda: kept.to_numpy(), "was closed")
    del kept, dst, up, side
    assert process_state() == state
    settle()
    assert _dev_stats(dev) == base


@pytest.mark.parametrize("kind", SIMS)
def test_everything_closed_twice_frees_once(monkeypatch, kind, saxpy):
    """Double frees a user makes: a Buffer closed, a new one of the same size allocated (it gets
    the same address), then the first closed again, left by ``with`` and dropped; an alias over
    the second (``Buffer.from_ptr``) closed twice; a Stream, an Event, a Module, a Graph
    (``reset`` twice) and a MemPool dropped after ``use_mem_pool``: the second release must not
    free what now lives at the address.  The live buffer keeps its bytes, the counters count it
    once and go back to the start."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    dev = _last()
    state = process_state()
    settle()
    base = _dev_stats(dev)
    n = 4096
    first = accel.Buffer(n, device=dev)
    addr = first.ptr
    first.close()
    second = accel.Buffer(n, device=dev).fill_(0x5A)
    assert second.ptr == addr                              # the cache hands the block out again
    first.close()
    _raises(RuntimeError, first.__enter__, "was closed")     # ``with first:`` refuses a closed one
    del first
    gc.collect()
    alias = accel.Buffer.from_ptr(second.ptr, n, device=dev)
    alias.close()
    alias.close()
    del alias
    s = accel.Stream(dev)
    s.close()
    s.close()
    e = accel.Event()
    e.record(accel.current_stream(dev))
    e.close()
    e.close()
    k = saxpy(dev)
    k.module.close()
    k.module.close()
    _raises(ValueError, lambda: accel.launch(k, 1, 256, 1.0, second, second, 16), "closed")
    with accel.device_index(dev):
        pool = accel.MemPool()
    with accel.use_mem_pool(pool, device=dev):
        pooled = accel.Buffer(n, device=dev)
    pooled.close()
    pooled.close()
    del pool, pooled
    if kind != "mps":
        g = accel.Graph()
        with accel.graph(g, stream=accel.Stream(dev)):
            second.fill_(0x5A)
        g.reset()
        g.reset()
        del g
    gc.collect()
    assert np.array_equal(second.to_numpy(), np.full(n, 0x5A, np.uint8))
    st = accel.memory.memory_stats(dev)
    assert st["allocation.all.current"] - base[3] == 1, st["allocation.all.current"]
    assert st["allocated_bytes.all.current"] - base[0] == _round512(n)
    check_stat_invariants(dev, "double frees")
    del second, k
    assert process_state() == state
    settle()
    assert _dev_stats(dev) == base


@pytest.mark.parametrize("kind", SIMS)
def test_parent_objects_in_a_fork_child(monkeypatch, kind):
    """A child forked while the parent has a slow copy queued on a side stream of the last device:
    every use of the parent's objects (Buffer, view, Stream, Event, Generator draw, MemPool,
    Graph) and every close of them is torch's fork RuntimeError, the host-side queries work
    (nbytes, pinned data, device_count, memory_allocated 0), dropping them all and collecting
    cycles prints nothing.  The parent's copy lands, its objects work, its counters are
    unchanged."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    dev = _last()
    name = {"cuda": "CUDA", "xpu": "XPU", "mps": "MPS"}[kind]
    fork_msg = (f"Cannot re-initialize {name} in forked subprocess. To use {name} with multiprocessing, "
                f"you must use the 'spawn' start method")
    n = 1 << 16
    side = accel.Stream(dev)
    src = accel.Buffer(n, device=dev).fill_(0x33)
    dst = accel.Buffer(n, device=dev, stream=side)
    e = accel.Event()
    gen = accel.random.Generator(dev, seed=3)
    with accel.device_index(dev):
        pool = accel.MemPool()
    pin = accel.empty_pinned(n, np.uint8)
    pin[:] = 7
    view = src.as_array(np.uint8, (n,))
    g = None
    if kind != "mps":
        g = accel.Graph()
        with accel.graph(g, stream=accel.Stream(dev)):
            dst.fill_(0x44)
    stats = _dev_stats(dev)
    with _slow(3000):
        side.wait_stream(accel.current_stream(dev))
        dst.copy_from(src, stream=side, non_blocking=True)
        e.record(side)

        def child():
            bad = []
            calls = {"to_numpy": src.to_numpy, "fill": lambda: src.fill_(1), "ptr": lambda: src.ptr,
                     "close": src.close, "view": view.to_numpy, "sync": side.synchronize,
                     "query": side.query, "stream close": side.close, "with": side.__enter__,
                     "event query": e.query, "event sync": e.synchronize, "event close": e.close,
                     "draw": lambda: accel.random.uniform_(dst, generator=gen),
                     "pool": pool.snapshot, "pool use": lambda: accel.use_mem_pool(pool, device=dev).__enter__(),
                     "new buffer": lambda: accel.Buffer(16), "synchronize": accel.synchronize}
            if g is not None:
                calls.update({"replay": g.replay, "reset": g.reset})
            for what, call in calls.items():
                try:
                    call()
                    bad.append(f"{what}: no error")
                except RuntimeError as exc:
                    if str(exc) != fork_msg:
                        bad.append(f"{what}: {exc}")
            if src.nbytes != n or not (pin == 7).all() or accel.device_count() != len(_devices()):
                bad.append("host-side queries")
            if accel.memory.memory_allocated(dev) != 0:
                bad.append("memory_allocated in the child")
            for what in bad:
                print(what, file=sys.stderr)
            _Cycle(src, dst, side, e, gen, pool, view, g)
            return 1 if bad else 0
        code = run_forked(child, timeout=30)
    assert code == 0
    e.synchronize()
    assert (dst.to_numpy(stream=side) == 0x33).all()
    if g is not None:
        g.replay()
        assert (dst.to_numpy() == 0x44).all()
    assert _dev_stats(dev) == stats
    accel.random.uniform_(dst, generator=gen)
    assert np.array_equal(dst.to_numpy(np.float32), uniform_f32(3, 0, n // 4))     # on the current stream, as the fill
