"""Realistic user programs, r66b: five programs as demanding torch users write them.

Earlier rounds (test_user_programs.py, test_user_programs2.py, _r41, _r42, _r56, _r58, _r62c,
_r62f, _xpu_r62m) took loader rings feeding the main thread, pipelines across devices, graphs
replayed from threads, MemPools, OOM loops, fork and DLPack.  These combine what they did not:

1. a data loader whose pinned ring is *one* pinned array (rows as slots) uploaded by a producer
   thread onto a side stream of the non-current device, consumed by a second worker thread on
   its own stream (never the main thread), each row rewritten only after its upload event, the
   batches sent on to device 0 and downloaded into pinned memory; host-allocator and device
   stats return to their start;
2. gradient accumulation on two devices with a user kernel, gradients freed on another stream
   (record_stream) than the one they were made on and by another thread, with the allocator's
   counters checked against the program's own ledger of live sizes after every step and after
   empty_cache;
3. an inference server: one Graph per batch size captured into one graph_pool_handle pool,
   replayed by several threads on their own streams (ordered by one "pool free" event, as the
   shared pool requires), while a maintenance thread drops and recaptures graphs
   (capture_error_mode="thread_local");
4. a checkpoint/restore with memory history on: a step OOMs under
   set_per_process_memory_fraction, the program catches it, restores the checkpoint (device
   buffers and RNG states) and goes on; snapshot, history and counters agree at every stage;
5. a user kernel mixed with Philox fills from a Generator and the default generator, eager and
   captured (graph-safe states), on device 1 while device 0 is current, checked against a
   Philox4x32-10 written here in numpy (not accel's).

Every result is compared with numpy on the host, byte for byte.  Each program then runs again
and the simulator's live objects, accel's tables and accel's live objects must be what they
were after the first run (test_user_programs2.assert_same_footprint).
"""

import gc
import queue
import threading
import traceback

import numpy as np
import pytest

import accel
from conftest import SIMS, use_sim
from test_user_programs import JOIN_S, _devices, join_all, process_state, settle
from test_user_programs2 import assert_same_footprint, footprint
from test_user_programs_r56 import saxpy  # noqa: F401  (fixture: the saxpy kernel per simulator)
from test_user_kernels import expected as saxpy_np

MiB = 1 << 20


# -- helpers ---------------------------------------------------------------------------------
def _host_stats() -> tuple:
    st = accel.memory.host_memory_stats()
    return st["allocated_bytes.current"], st["allocations.current"], st["active_requests.current"]


def _dev_stats(d) -> tuple:
    st = accel.memory.memory_stats(d)
    return (st["allocated_bytes.all.current"], st["active_bytes.all.current"],
            st["requested_bytes.all.current"], st["allocation.all.current"], st["active.all.current"])


def _native() -> bool:
    """accel's caching allocator (not backend:cudaMallocAsync, whose counters are the driver's)."""
    return "cudaMallocAsync" not in accel.memory.get_allocator_settings()


def check_stat_invariants(d, where="") -> None:
    """What must hold between device ``d``'s counters at any quiet moment: current = allocated -
    freed and current <= peak for every counted stat, allocated <= active <= reserved bytes, and
    the snapshot's segments and blocks add up to the counters."""
    st = accel.memory.memory_stats(d)
    if not _native():
        # backend:cudaMallocAsync reports the driver's used and reserved memory only (torch's
        # CudaMallocAsyncAllocator::getDeviceStats), and its snapshot has no segments
        assert st["allocated_bytes.all.current"] <= st["reserved_bytes.all.current"], (where, d)
        assert st["allocated_bytes.all.current"] <= st["allocated_bytes.all.peak"], (where, d)
        return
    for key, value in st.items():
        if key.endswith(".current"):
            stem = key[:-len(".current")]
            if stem + ".allocated" in st:
                assert value == st[stem + ".allocated"] - st[stem + ".freed"], (where, d, key, value)
            if stem + ".peak" in st:
                assert value <= st[stem + ".peak"], (where, d, key, value, st[stem + ".peak"])
            assert value >= 0, (where, d, key, value)
    assert st["allocated_bytes.all.current"] <= st["active_bytes.all.current"] <= st["reserved_bytes.all.current"], \
        (where, d)
    assert st["requested_bytes.all.current"] <= st["active_bytes.all.current"], (where, d)
    for pool in ("small_pool", "large_pool"):
        for stem in ("allocated_bytes", "active_bytes", "reserved_bytes", "allocation", "segment", "active"):
            key = f"{stem}.{pool}.current"
            if key in st:
                assert st[key] <= st[f"{stem}.all.current"], (where, d, key)
    segs = [seg for seg in accel.memory.memory_snapshot() if seg["device"] == d]
    blocks = [b for seg in segs for b in seg["blocks"]]
    assert sum(seg["total_size"] for seg in segs) == st["reserved_bytes.all.current"], (where, d, "reserved")
    assert sum(b["size"] for b in blocks if b["state"] == "active_allocated") == st["allocated_bytes.all.current"], \
        (where, d, "allocated")
    assert sum(b["size"] for b in blocks if b["state"].startswith("active")) == st["active_bytes.all.current"], \
        (where, d, "active")
    assert sum(1 for b in blocks if b["state"] == "active_allocated") == st["allocation.all.current"], (where, d)


def _trace(exc) -> str:
    """A worker thread's exception with its traceback, for the assertion message."""
    return "".join(traceback.format_exception(exc))


def _last() -> int:
    return _devices()[-1]


def _slow(delay_us: int):
    """A per-operation delay in the simulator, so queued work really is queued."""
    from accel.sim import core

    class _Ctx:
        def __enter__(self):
            core.configure(delay_us=delay_us)

        def __exit__(self, *exc):
            core.configure(delay_us=0)
    return _Ctx()


def _bounded_footprint():
    """footprint(), less accel's tables that are bounded by construction (a deque with a
    maxlen, such as the allocator's window of recent misses): they fill up to their bound."""
    from collections import deque
    live, tables, objs = footprint()
    for d in _devices():
        for name, value in vars(accel.memory.device_allocator(d)).items():
            if isinstance(value, deque) and value.maxlen is not None:
                tables.pop(f"alloc{d}.{name}", None)
    return live, tables, objs


#: accel's tables sized by a peak of work in flight, not by objects made: the XPU backend's event
#: pools (64 slots each) grow when more events are pending at once than ever before, which the
#: threads' scheduling decides (a loaded machine: the second run's peak was higher, r74)
_PEAK_SIZED = {"backend._free_slots", "backend._pools"}


def _run_twice(program):
    """Run ``program`` once, settle, take the footprint, run it again: same footprint.  Where
    only peak-sized tables grew (:data:`_PEAK_SIZED`), a third run must leave the second's
    footprint as it was: a cache that follows a peak settles, a leak grows every run."""
    program(0)
    before = _bounded_footprint()
    program(1)
    after = _bounded_footprint()
    tables0, tables1 = before[1], after[1]
    grew = {k for k, v in tables1.items() if v > tables0.get(k, 0)}
    if grew and grew <= _PEAK_SIZED:
        before = after
        program(2)
        after = _bounded_footprint()
    assert_same_footprint(before, after)


# -- Philox4x32-10 in numpy, written from Random123's philox.h (not accel's code) --------------
_M0, _M1, _W0, _W1, _MASK = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85, 0xFFFFFFFF


def _philox(ctr, key):
    c = [np.asarray(x, np.uint64) for x in ctr]
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
        p0, p1 = np.uint64(_M0) * c[0], np.uint64(_M1) * c[2]
        hi0, lo0 = p0 >> np.uint64(32), p0 & np.uint64(_MASK)
        hi1, lo1 = p1 >> np.uint64(32), p1 & np.uint64(_MASK)
        c = [hi1 ^ c[1] ^ np.uint64(k0), lo1, hi0 ^ c[3] ^ np.uint64(k1), lo0]
    return c


def philox_words(seed: int, offset: int, n: int) -> np.ndarray:
    """Words ``offset .. offset+n`` of curand_init(seed, 0, 0)'s stream (counter = word // 4)."""
    idx = np.arange(offset, offset + n, dtype=np.uint64)
    ctr = idx >> np.uint64(2)
    zero = np.zeros_like(ctr)
    out = np.stack(_philox([ctr & np.uint64(_MASK), ctr >> np.uint64(32), zero, zero],
                           (seed & _MASK, (seed >> 32) & _MASK)), axis=-1)
    return out[np.arange(n), (idx & np.uint64(3)).astype(np.intp)].astype(np.uint32)


def uniform_f32(seed: int, offset: int, n: int) -> np.ndarray:
    """accel.random.uniform_ (float32, [0, 1)): (word >> 8) * 2**-24."""
    return (philox_words(seed, offset, n) >> 8).astype(np.float32) * np.float32(2.0 ** -24)


def test_philox_oracle_known_answers():
    """The oracle above against Random123's known-answer vectors (tests/kat_vectors)."""
    z = [np.uint64(0)] * 4
    assert [int(x) for x in _philox(z, (0, 0))] == [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
    ctr = [np.uint64(v) for v in (0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344)]
    assert [int(x) for x in _philox(ctr, (0xa4093822, 0x299f31d0))] == [0xd16cfe09, 0x94fdcceb, 0x5001e420,
                                                                           0x24126ea1]
    f = [np.uint64(_MASK)] * 4
    assert [int(x) for x in _philox(f, (_MASK, _MASK))] == [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]


# -- 1. pinned rows -> producer thread -> side stream of the non-current device -> consumer ------
@pytest.mark.parametrize("kind", SIMS)
def test_loader_pinned_rows_reused_after_upload_event_consumed_by_worker(monkeypatch, kind):
    """The ring is one pinned array of shape (slots, n): a producer thread writes batch b into
    row b % slots, uploads it non_blocking onto its side stream of the last device (device 0
    stays current in every thread), records an event, and rewrites that row only after the
    event of its previous upload completed.  A consumer *thread* waits each event on its own
    stream, copies the batch into a buffer of its own (the upload's buffer is freed there after
    record_stream), sends it to device 0 (Metal: the same device), and downloads it into a pinned
    array of its own.  Every byte of every batch equals numpy's, the main thread's current device
    and streams never change, and the host and device allocators' stats return to their start."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    dev, home = _last(), 0
    state = process_state()
    n, slots, batches = 3000, 3, 24

    def batch(b):
        return np.random.default_rng(1000 + b).integers(0, 256, n, dtype=np.uint8).view(np.uint8)

    def program(run):
        settle()
        h0 = _host_stats()
        d0 = {d: _dev_stats(d) for d in _devices()}
        ring = accel.empty_pinned((slots, n), np.uint8)
        handoff = queue.Queue(maxsize=slots)
        errors, results = [], []

        def producer():
            try:
                assert accel.current_device_index() == 0
                up = accel.Stream(dev)
                last_upload = [None] * slots
                for b in range(batches):
                    row = b % slots
                    if last_upload[row] is not None:
                        last_upload[row].synchronize()      # the row's previous upload has run
                    ring[row][:] = batch(b)
                    x = accel.Buffer(n, device=dev, stream=up)
                    x.copy_from(ring[row], stream=up, non_blocking=True)
                    ev = accel.Event(dev)
                    ev.record(up)
                    last_upload[row] = ev
                    handoff.put((b, x, ev), timeout=JOIN_S)
                    del x, ev
                assert accel.current_device_index() == 0
            except BaseException as exc:                    # reported by the main thread
                errors.append(exc)
            finally:
                handoff.put(None, timeout=JOIN_S)

        def consumer():
            try:
                cs = accel.Stream(dev)
                hs = accel.Stream(home)
                while True:
                    item = handoff.get(timeout=JOIN_S)
                    if item is None:
                        break
                    b, x, ev = item
                    del item
                    cs.wait_event(ev)
                    y = accel.Buffer(n, device=dev, stream=cs)
                    y.copy_from(x, stream=cs, non_blocking=True)
                    x.record_stream(cs)
                    del x                                   # freed here, made on the producer's stream
                    z = accel.Buffer(n, device=home, stream=hs)
                    hs.wait_stream(cs)
                    z.copy_from(y, stream=hs, non_blocking=True)
                    y.record_stream(hs)
                    del y
                    out = accel.empty_pinned(n, np.uint8)
                    z.copy_to(out, stream=hs, non_blocking=True)
                    results.append((b, out, hs.record_event()))
                    del z, out
                assert accel.current_device_index() == 0
            except BaseException as exc:
                errors.append(exc)
                while handoff.get(timeout=JOIN_S) is not None:   # let the producer finish
                    pass

        threads = [threading.Thread(target=producer, name="producer"),
                   threading.Thread(target=consumer, name="consumer")]
        with _slow(50 if run == 0 else 0):
            for t in threads:
                t.start()
            join_all(threads)
        assert not errors, _trace(errors[0])
        assert [b for b, *_ in results] == list(range(batches))
        for b, out, ev in results:
            ev.synchronize()
            assert np.array_equal(out, batch(b)), (b, np.flatnonzero(out != batch(b))[:8])
        del results, out, ev, ring
        assert process_state() == state
        settle()
        assert _host_stats() == h0
        assert {d: _dev_stats(d) for d in _devices()} == d0

    _run_twice(program)


# -- 2. gradient accumulation on two devices, grads freed elsewhere, a ledger of live sizes ------
def _round512(nbytes: int) -> int:
    return max(512, (nbytes + 511) // 512 * 512)


@pytest.mark.parametrize("kind", SIMS)
def test_grad_accumulation_two_devices_ledger_matches_allocator(monkeypatch, kind, saxpy):
    """Data-parallel training without a framework: one worker thread per device (Metal: two
    workers on its one device) uploads each micro-batch's gradient into a buffer allocated on
    its compute stream, accumulates it with the saxpy kernel (acc += g), copies it for a log
    to pinned memory on its *communication* stream, and hands it to a janitor thread that calls
    record_stream(comm) and frees it: each gradient is freed by another thread than the one
    that made it, after use on another stream than its allocation stream.  The main thread
    then all-reduces the accumulators on device 0 and applies w += -0.5 * acc on every device
    with the kernel.  After every step the allocator's counters equal the program's own ledger
    of live buffers (allocated = sum of 512-rounded sizes at once; active and requested = the
    ledger's once empty_cache has processed the recorded streams' events); weights and logs equal numpy's at every step."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    devs = _devices()
    workers = devs if len(devs) > 1 else [0, 0]          # Metal: both workers on device 0
    state = process_state()
    n_of = [777, 1500]                                    # elements: sizes not multiples of 512
    steps, micro = 3, 4

    def grad(step, m, w):
        return np.random.default_rng([step, m, w]).integers(-8, 8, n_of[w]).astype(np.float32)

    def program(run):
        kernels = {d: saxpy(d) for d in set(workers)}    # the model's kernels, loaded per run
        settle()
        base = {d: _dev_stats(d) for d in devs}
        ledger = {}                                       # id(buffer) -> (device, nbytes)

        def alloc(nbytes, device, stream=None):
            b = accel.Buffer(nbytes, device=device, stream=stream)
            ledger[id(b)] = (device, nbytes)
            return b

        def free(b):
            del ledger[id(b)]

        def check_ledger(where, after_empty=False):
            for d in devs:
                live = [nb for dd, nb in ledger.values() if dd == d]
                got = _dev_stats(d)
                if not _native():                         # the driver's used memory, its own rounding
                    assert got[0] >= base[d][0] + sum(live), (where, d, got)
                    check_stat_invariants(d, where)
                    continue
                want_alloc = base[d][0] + sum(_round512(nb) for nb in live)
                want_req = base[d][2] + sum(live)
                assert got[0] == want_alloc, (where, d, "allocated", got, want_alloc)
                assert got[3] == base[d][3] + len(live), (where, d, "allocation count", got)
                # requested_bytes, like active, counts a freed block until its recorded streams'
                # work is known done (torch: free_block decreases both, after the events)
                assert got[2] >= want_req and got[1] >= got[0], (where, d, got, want_req)
                check_stat_invariants(d, where)
                if after_empty:
                    assert got[2] == want_req, (where, d, "requested", got, want_req)
                    assert got[1] == got[0] and got[4] == got[3], (where, d, "active after empty_cache", got)
                    st = accel.memory.memory_stats(d)
                    assert st["reserved_bytes.all.current"] >= got[0]

        w_host = [np.arange(n, dtype=np.float32) for n in n_of]
        w = [alloc(4 * n, workers[i]).copy_from(w_host[i]) for i, n in enumerate(n_of)]
        acc = [alloc(4 * n, workers[i]).fill_(0) for i, n in enumerate(n_of)]
        check_ledger("start")
        trash = queue.Queue()
        errors = []

        def janitor():
            try:
                while True:
                    item = trash.get(timeout=JOIN_S)
                    if item is None:
                        return
                    g, comm = item
                    del item
                    g.record_stream(comm)
                    free(g)
                    del g
            except BaseException as exc:
                errors.append(exc)

        def worker(i, step, logs):
            try:
                d = workers[i]
                n = n_of[i]
                cs, comm = accel.Stream(d), accel.Stream(d)
                cs.wait_stream(accel.current_stream(d))   # acc was zeroed / updated there
                for m in range(micro):
                    g = alloc(4 * n, d, cs)
                    g.copy_from(grad(step, m, i), stream=cs)
                    accel.launch(kernels[d], (n + 255) // 256, 256, np.float32(1.0), g, acc[i], n, stream=cs)
                    comm.wait_stream(cs)
                    g.copy_to(logs[m], stream=comm, non_blocking=True)
                    trash.put((g, comm))
                    del g
                accel.current_stream(d).wait_stream(cs)
                accel.current_stream(d).wait_stream(comm)
                comm.synchronize()
            except BaseException as exc:
                errors.append(exc)

        want_w = [x.copy() for x in w_host]
        for step in range(steps):
            logs = [[accel.empty_pinned(n, np.float32) for _ in range(micro)] for n in n_of]
            jt = threading.Thread(target=janitor, name="janitor")
            jt.start()
            ws = [threading.Thread(target=worker, args=(i, step, logs[i]), name=f"worker{i}")
                  for i in range(len(n_of))]
            for t in ws:
                t.start()
            join_all(ws)
            trash.put(None)
            join_all([jt])
            assert not errors, _trace(errors[0])
            for i, n in enumerate(n_of):
                for m in range(micro):
                    assert np.array_equal(logs[i][m], grad(step, m, i)), (step, i, m)
            for d in devs:
                accel.synchronize(d)
            check_ledger(f"step {step} after the janitor")

            # all-reduce over the first n_of[0] elements: acc0[:k] += acc1[:k] on device 0, then back
            k = n_of[0]
            r0 = accel.current_stream(0)
            tmp = alloc(4 * k, 0, r0)
            r0.wait_stream(accel.current_stream(workers[1]))
            tmp.copy_from(accel.Buffer.from_ptr(acc[1].ptr, 4 * k, device=workers[1]), stream=r0)
            accel.launch(kernels[workers[0]], (k + 255) // 256, 256, np.float32(1.0), tmp, acc[0], k, stream=r0)
            with accel.device_index(workers[1]):
                s1 = accel.current_stream(workers[1])
                s1.wait_stream(r0)
                accel.Buffer.from_ptr(acc[1].ptr, 4 * k, device=workers[1]).copy_from(acc[0], stream=s1)
                tmp.record_stream(s1)
            free(tmp)
            del tmp
            for i, n in enumerate(n_of):
                d = workers[i]
                with accel.device_index(d):
                    accel.launch(kernels[d], (n + 255) // 256, 256, np.float32(-0.5), acc[i], w[i], n)
                    acc[i].fill_(0)
            # the oracle
            sums = [sum(grad(step, m, i) for m in range(micro)).astype(np.float32) for i in range(len(n_of))]
            red = sums[0][:k] + sums[1][:k]
            sums[0][:k] = red
            sums[1][:k] = red
            for i in range(len(n_of)):
                want_w[i] = saxpy_np(-0.5, sums[i], want_w[i])
                assert np.array_equal(w[i].to_numpy(np.float32), want_w[i]), (step, i)
            check_ledger(f"step {step} after the update")
            accel.memory.empty_cache()
            check_ledger(f"step {step} after empty_cache", after_empty=True)
            del logs
        for b in w + acc:
            free(b)
        del w, acc, b, kernels
        assert process_state() == state
        check_ledger("end")
        settle()
        assert {d: _dev_stats(d) for d in devs} == base
        for d in devs:
            assert accel.memory.memory_reserved(d) == 0 or d not in workers

    _run_twice(program)


def test_xpu_kernel_keeps_no_destroyed_streams(monkeypatch, saxpy):
    """Reduced from program 2 on Level Zero: a loaded kernel launched once on each of a few
    short-lived streams (closed after a sync) keeps each destroyed stream's backend object
    alive while the module lives, so a program's footprint grows with the number of streams
    it ever made (up to 16 per kernel), not with the live ones."""
    from accel.backends.xpu.streams import _Stream
    use_sim(monkeypatch, "xpu")
    kernel = saxpy(0)
    n = 256
    x = accel.Buffer(4 * n).fill_(0)
    y = accel.Buffer(4 * n).fill_(0)

    def streams_alive():
        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o) is _Stream)

    settle()
    before = streams_alive()
    for _ in range(6):
        s = accel.Stream(0)
        accel.launch(kernel, 1, n, np.float32(1.0), x, y, n, stream=s)
        s.synchronize()
        s.close()
        del s
    settle()
    assert streams_alive() == before


# -- 3. inference server: graphs per batch size in one pool, replayed by threads, recaptured -----
@pytest.mark.parametrize("kind", [s for s in SIMS if s != "mps"])
def test_inference_server_graphs_share_a_pool_recaptured_while_serving(monkeypatch, kind, saxpy):
    """A server keeps one Graph per batch size on the last device (device 0 stays current), all
    captured into one ``graph_pool_handle()`` pool: each copies the bias into its static output
    and runs ``y = 2 x + y`` with the user kernel through a temporary allocated (and freed)
    inside the capture, so the graphs share that memory.  Three request threads, each on its
    own stream, replay them; since the pool's memory is shared, a replay waits for the event the
    previous replay (of any graph) recorded, under one lock that also guards the static
    buffers.  Meanwhile a maintenance thread drops a graph and recaptures it into the same pool
    (capture_error_mode="thread_local", the other threads keep working), swapping it in under
    the lock.  Every response equals numpy's; afterwards, dropping the graphs gives every byte
    of the pool back."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    dev = _last()
    state = process_state()
    feat, sizes, per_thread, recaptures = 96, (1, 2, 4, 8), 14, 5
    bias_host = (np.arange(feat, dtype=np.float32) - 40) / 4

    def request(t, i):
        bs = sizes[(t + i) % len(sizes)]
        x = np.random.default_rng([t, i]).integers(-50, 50, (bs, feat)).astype(np.float32) / 8
        return bs, x

    def program(run):
        kernel = saxpy(dev)
        settle()
        a0 = accel.memory.memory_allocated(dev)
        pool = accel.graphs.graph_pool_handle()
        bias = accel.Buffer(4 * feat * max(sizes), device=dev).copy_from(np.tile(bias_host, max(sizes)))
        static_x = {bs: accel.Buffer(4 * bs * feat, device=dev) for bs in sizes}
        static_y = {bs: accel.Buffer(4 * bs * feat, device=dev) for bs in sizes}
        cap_stream = accel.Stream(dev)       # every capture on one stream, as torch.cuda.graph's default

        def capture(bs):
            g = accel.Graph(pool=pool)
            n = bs * feat
            with accel.graph(g, pool=pool, stream=cap_stream, capture_error_mode="thread_local"):
                tmp = accel.Buffer(4 * n)
                tmp.copy_from(static_x[bs], non_blocking=True)
                static_y[bs].copy_from(accel.Buffer.from_ptr(bias.ptr, 4 * n, device=dev), non_blocking=True)
                accel.launch(kernel, (n + 127) // 128, 128, np.float32(2.0), tmp, static_y[bs], n)
                del tmp
            return g

        graphs = {bs: capture(bs) for bs in sizes}
        lock = threading.Condition()
        pool_free = accel.Event(dev)
        pool_free.record(accel.current_stream(dev))
        errors, served = [], []

        def serve(t):
            try:
                st = accel.Stream(dev)
                for i in range(per_thread):
                    bs, x = request(t, i)
                    out = accel.empty_pinned((bs, feat), np.float32)
                    with lock:
                        while bs not in graphs:          # being recaptured
                            lock.wait(JOIN_S)
                        st.wait_event(pool_free)
                        static_x[bs].copy_from(x, stream=st)
                        with st:
                            graphs[bs].replay()
                        static_y[bs].copy_to(out, stream=st, non_blocking=True)
                        pool_free.record(st)
                        done = st.record_event()
                    done.synchronize()                   # the response goes out
                    want = saxpy_np(2.0, x, np.tile(bias_host, (bs, 1)))
                    served.append((t, i, bs, np.array_equal(out, want)))
                    del out, done                        # (each pinned array freed as it is sent)
                assert accel.current_device_index() == 0
            except BaseException as exc:
                errors.append(exc)

        def maintain():
            try:
                for r in range(recaptures):
                    bs = sizes[r % len(sizes)]
                    with lock:
                        old = graphs.pop(bs)
                    # nobody can replay ``old`` now; its replays already queued finish first
                    # (the pool keeps its memory until they did)
                    old.reset()
                    del old
                    new = capture(bs)
                    with lock:
                        graphs[bs] = new
                        lock.notify_all()
                    del new
            except BaseException as exc:
                errors.append(exc)
                for bs in sizes:                 # let the servers finish
                    if bs not in graphs:
                        g = capture(bs)
                        with lock:
                            graphs[bs] = g
                            lock.notify_all()

        threads = [threading.Thread(target=serve, args=(t,), name=f"server{t}") for t in range(3)]
        threads.append(threading.Thread(target=maintain, name="maintenance"))
        with _slow(20 if run == 0 else 0):
            for t in threads:
                t.start()
            join_all(threads)
        assert not errors, _trace(errors[0])
        assert len(served) == 3 * per_thread
        wrong = [(t, i, bs) for t, i, bs, ok in served if not ok]
        assert not wrong, wrong
        assert process_state() == state
        assert accel.memory.memory_allocated(dev) > a0
        accel.synchronize(dev)
        check_stat_invariants(dev, "serving done")
        accel.memory.empty_cache()
        check_stat_invariants(dev, "serving done, cache emptied")
        del graphs, static_x, static_y, bias, pool_free, cap_stream, kernel
        settle()
        assert accel.memory.memory_allocated(dev) == a0
        assert accel.memory.memory_reserved(dev) == 0

    _run_twice(program)


# -- 4. checkpoint / restore around an OOM, with memory history on -------------------------------
def _segments_of(d):
    return [seg for seg in accel.memory.memory_snapshot() if seg["device"] == d]


def _check_snapshot_against_stats(d, where):
    """What a snapshot shows equals what the counters say."""
    check_stat_invariants(d, where)
    if not _native():
        return
    segs = _segments_of(d)
    blocks = [b for seg in segs for b in seg["blocks"]]
    st = accel.memory.memory_stats(d)
    assert sum(seg["total_size"] for seg in segs) == st["reserved_bytes.all.current"], where
    assert sum(b["size"] for b in blocks if b["state"] == "active_allocated") == \
        st["allocated_bytes.all.current"], where
    assert sum(seg["allocated_size"] for seg in segs) == st["allocated_bytes.all.current"], where
    assert sum(1 for b in blocks if b["state"] == "active_allocated") == st["allocation.all.current"], where


@pytest.mark.parametrize("kind", SIMS)
def test_checkpoint_restore_around_oom_with_history(monkeypatch, kind):
    """A training job on the last device (device 0 current) under a 48 MiB cap
    (set_per_process_memory_fraction), with _record_memory_history("all") and an OOM observer.
    Each step draws new weights from the job's Generator and the default generator (weights
    ``w_k = u(gen) + u(default)``, computed on the device from two fills and a copy through the
    host — no kernel), and keeps activations that double every step; a checkpoint (pinned host
    copies of the weights, both RNG states) is taken after each good step.  The step that does
    not fit raises OutOfMemoryError; the program lets go of the step's buffers, restores the
    checkpoint (weights and RNG states), halves the batch and goes on.  Checked: the weights
    after every step equal a Philox oracle's at the restored states; num_ooms, the observer's
    calls and the history's "oom" entries agree; the history's allocs minus frees equal the live
    allocations; the snapshot's segments and blocks equal the counters at every stage; after the
    job (cap lifted, history off) everything is back where it began."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    dev = _last()
    state = process_state()
    R = accel.random
    n_w = 64 * 1024                                      # floats per weight buffer (256 KiB)

    def program(run):
        settle()
        base = _dev_stats(dev)
        st0 = accel.memory.memory_stats(dev)
        total = accel.memory.get_memory_info(dev)[1]
        accel.memory.set_per_process_memory_fraction(48 * MiB / total, dev)
        ooms = []

        def observer(device, alloc, device_allocated, device_free):
            ooms.append((device, alloc))
        accel.memory.attach_out_of_memory_observer(observer)
        accel.memory._record_memory_history("all", max_entries=100_000, clear_history=True)
        gen = R.Generator(dev, seed=1234 + run)
        R.manual_seed_all(77)
        host_w = np.zeros((2, n_w), np.float32)          # the oracle's weights
        oracle = {"gen": (1234 + run, 0), "def": (77, 0)}
        weights = [accel.Buffer(4 * n_w, device=dev).fill_(0) for _ in range(2)]
        ckpt = None

        def take_checkpoint():
            pinned = accel.empty_pinned((2, n_w), np.float32)
            for i, w in enumerate(weights):
                w.copy_to(pinned[i], non_blocking=True)
            accel.synchronize(dev)
            return pinned, gen.get_state(), R.get_rng_state(dev), dict(oracle), host_w.copy()

        def step(batch_mib):
            acts = []
            with accel.device_index(dev):
                for i in range(len(weights)):
                    a = accel.Buffer(4 * n_w)
                    R.uniform_(a, generator=gen)
                    R.uniform_(weights[i])
                    host = a.to_numpy(np.float32) + weights[i].to_numpy(np.float32)
                    weights[i].copy_from(host)
                    acts.append(a)
                for _ in range(4):
                    acts.append(accel.Buffer(batch_mib * MiB // 4))   # the activations kept for backward
            # the oracle: the same draws at the same states
            for i in range(2):
                sg, og = oracle["gen"]
                sd, od = oracle["def"]
                host_w[i] = uniform_f32(sg, og, n_w) + uniform_f32(sd, od, n_w)
                oracle["gen"] = (sg, og + n_w)
                oracle["def"] = (sd, od + n_w)
            return acts

        batch, done, hit = 2, 0, 0
        ckpt = take_checkpoint()
        while done < 6:
            acts = failed = None
            try:
                acts = step(batch)
            except accel.OutOfMemoryError as exc:
                failed = str(exc)
            if failed is None:
                for i, w in enumerate(weights):
                    assert np.array_equal(w.to_numpy(np.float32), host_w[i]), (run, done, i)
                _check_snapshot_against_stats(dev, f"step {done}")
                del acts
                ckpt = take_checkpoint()
                done += 1
                batch *= 2
                continue
            # the OOM: the failed step's buffers are gone with its frame; restore and go on smaller
            hit += 1
            assert "out of memory" in failed and (f"GPU {dev} " in failed or f"device {dev} " in failed), failed
            gc.collect()
            accel.memory.empty_cache()
            _check_snapshot_against_stats(dev, f"after OOM {hit}")
            pinned, gstate, dstate, oracle_saved, host_saved = ckpt
            for i, w in enumerate(weights):
                w.copy_from(pinned[i])
            gen.set_state(gstate)
            R.set_rng_state(dstate, dev)
            oracle.clear()
            oracle.update(oracle_saved)
            host_w[:] = host_saved
            for i, w in enumerate(weights):
                assert np.array_equal(w.to_numpy(np.float32), host_w[i])
            batch //= 4
            assert batch >= 1
        assert hit >= 1
        st = accel.memory.memory_stats(dev)
        assert st["num_ooms"] - st0["num_ooms"] == hit == len(ooms)
        assert all(d == dev for d, _ in ooms)
        trace = accel.memory._snapshot()["device_traces"][dev]
        actions = [e["action"] for e in trace]
        if _native():                      # backend:cudaMallocAsync's history has allocs and frees only
            assert actions.count("oom") == hit
        live = st["allocation.all.current"] - base[3]
        assert actions.count("alloc") - actions.count("free_requested") == live == len(weights)
        del ckpt, weights, pinned, w
        accel.memory._record_memory_history(None)
        accel.memory.detach_out_of_memory_observer(observer)
        accel.memory.set_per_process_memory_fraction(1.0, dev)
        assert accel.memory._snapshot()["device_traces"][dev] == []
        assert process_state() == state
        settle()
        assert _dev_stats(dev) == base
        _check_snapshot_against_stats(dev, "end")
        assert _host_stats()[0] == 0

    _run_twice(program)


# -- 5. a user kernel mixed with Philox fills, eager and captured, on device 1 -------------------
def _inc(n: int) -> int:
    return (n + 3) // 4 * 4


@pytest.mark.parametrize("kind", SIMS)
def test_kernel_with_generator_states_eager_and_captured_on_last_device(monkeypatch, kind, saxpy):
    """A dropout-like step on the last device while device 0 stays current: ``x`` from the
    job's Generator, ``w`` from a second state of it (clone_state, reseeded), ``y`` from the
    device's default generator, then ``y = 2 x + y`` and ``y = -w + y`` with the user kernel and
    a copy to ``out``.  On CUDA the step is captured with both states registered
    (register_generator_state) and the capture switching the generator between them
    (graphsafe_set_state); Level Zero captures the kernels and copy (its fills cannot be
    captured) and the fills run eagerly before each replay; Metal runs the step eagerly.  Between
    steps, eager draws from each state advance it.  Every ``out`` equals the Philox oracle's,
    each state's offset is where the oracle says, and device 0's generator never moved."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    dev = _last()
    R = accel.random
    state = process_state()
    n, steps = 5001, 4                                   # n not a multiple of 4: offsets round up

    def program(run):
        kernel = saxpy(dev)
        settle()
        a0 = accel.memory.memory_allocated(dev)
        R.manual_seed_all(900 + run)
        home_state = R.get_rng_state(0).copy()
        gen = R.Generator(dev, seed=31337 + run)
        alt = gen.clone_state()
        alt.manual_seed(4242 + run)
        state1 = gen.graphsafe_get_state()
        off = {"gen": 0, "alt": 0, "def": 0}
        seeds = {"gen": 31337 + run, "alt": 4242 + run, "def": 900 + run}
        x, w, y, out, z = (accel.Buffer(4 * n, device=dev) for _ in range(5))
        blocks = (n + 255) // 256

        def fills():
            R.uniform_(x, generator=gen)
            gen.graphsafe_set_state(alt)
            R.uniform_(w, generator=gen)
            gen.graphsafe_set_state(state1)
            R.uniform_(y)

        def compute():
            accel.launch(kernel, blocks, 256, np.float32(2.0), x, y, n)
            accel.launch(kernel, blocks, 256, np.float32(-1.0), w, y, n)
            out.copy_from(y, non_blocking=True)

        def want():
            u = {k: uniform_f32(seeds[k], off[k], n) for k in off}
            for k in off:
                off[k] += _inc(n)
            return saxpy_np(-1.0, u["alt"], saxpy_np(2.0, u["gen"], u["def"]))

        def eager_between(i):
            R.uniform_(z, generator=gen)                 # state1
            off["gen"] += _inc(n)
            if i % 2:
                R.uniform_(z, generator=alt)             # the second state, through its own object
                off["alt"] += _inc(n)
            zz = z.to_numpy(np.float32)
            k = "alt" if i % 2 else "gen"
            assert np.array_equal(zz, uniform_f32(seeds[k], off[k] - _inc(n), n)), (run, i, k)

        g = None
        if kind == "cuda":
            g = accel.Graph()
            g.register_generator_state(state1)
            g.register_generator_state(alt)
            with accel.graph(g, stream=accel.Stream(dev)):
                fills()
                compute()
            assert (gen.get_offset(), alt.get_offset()) == (0, 0)      # capture draws nothing
        elif kind == "xpu":
            g = accel.Graph()
            with accel.graph(g, stream=accel.Stream(dev)):
                compute()
        assert accel.current_device_index() == 0

        for i in range(steps):
            eager_between(i)
            if kind == "cuda":
                g.replay()
            else:
                with accel.device_index(dev):
                    fills()
                    if g is None:
                        compute()
                    else:
                        g.replay()
            expect = want()
            got = out.to_numpy(np.float32)
            assert np.array_equal(got, expect), (run, i, np.flatnonzero(got != expect)[:8])
            assert accel.current_device_index() == 0
        assert gen.get_offset() == off["gen"] and state1.get_offset() == off["gen"]
        assert alt.get_offset() == off["alt"]
        assert R.default_generator(dev).get_offset() == off["def"]
        if dev != 0:                                     # (Metal: the one device is both)
            assert np.array_equal(R.get_rng_state(0), home_state)
        assert process_state() == state
        del g, x, w, y, out, z, kernel, gen, alt, state1
        settle()
        assert accel.memory.memory_allocated(dev) == a0

    _run_twice(program)



@pytest.mark.parametrize("kind", [s for s in SIMS if s != "mps"])
def test_replay_while_its_capture_stream_captures_another(monkeypatch, kind):
    """Reduced from program 3 (seen there under backend:cudaMallocAsync, where captures take
    longer; fixed meanwhile by 3ecb155, found independently by r66e): graph A (a fill, no random numbers) is captured on stream ``cs``; a worker thread
    then captures graph B on ``cs`` in thread_local mode, and while it does, the main thread
    replays A on a stream of its own.  torch's replay only writes the generator holders on the
    replay stream (CUDAGraph::replay -> replay_prologue) and launches: both succeed.  accel's
    replay made its stream wait for ``cs`` (the holders' last user) with an event recorded on
    ``cs``, inside B's capture: A's launch failed (900) and B's capture was invalidated.  Every capture
    registers the default generator, so this hit graphs that draw nothing too, and
    accel.graph()'s default (one side stream per device) captures every graph on one stream."""
    use_sim(monkeypatch, kind)
    dev = _last()
    cs = accel.Stream(dev)
    a = accel.Buffer(4096, device=dev)
    b = accel.Buffer(4096, device=dev)
    ga = accel.Graph()
    with accel.graph(ga, stream=cs, capture_error_mode="thread_local"):
        a.fill_(3)
    began, go, errors, kept = threading.Event(), threading.Event(), [], []

    def capture_b():
        try:
            gb = accel.Graph()
            with accel.graph(gb, stream=cs, capture_error_mode="thread_local"):
                b.fill_(4)
                began.set()
                go.wait(JOIN_S)
            kept.append(gb)
        except BaseException as exc:
            errors.append(exc)
        finally:
            began.set()

    t = threading.Thread(target=capture_b, name="capture-b")
    t.start()
    began.wait(JOIN_S)
    st = accel.Stream(dev)
    try:
        with st:
            ga.replay()
    finally:
        go.set()
        join_all([t])
    assert not errors, _trace(errors[0])
    st.synchronize()
    assert (a.to_numpy() == 3).all()
    kept[0].replay()
    accel.synchronize(dev)
    assert (b.to_numpy() == 4).all()
