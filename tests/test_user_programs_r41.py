"""Realistic user programs, third round (r41).

Rounds one and two (tests/test_user_programs.py, tests/test_user_programs2.py) took a loader
ring, a training loop, fork/spawn, long create/drop loops, a KV cache into OOM, memory history
from threads and table-driven misuse.  These combine features those do not: a two-thread
producer/consumer pipeline across devices, a graph captured on the non-current device and
replayed from other threads, MemPools shared with graph pools under empty_cache, snapshots
taken while other threads allocate, OOM inside streams/pools/captures with recovery, and
multiprocessing children (fork and spawn contexts) of a parent that used the device.
"""

import gc
import queue
import threading

import numpy as np
import pytest

import accel
from test_user_programs import JOIN_S, _devices, allocated, join_all, live_objects, process_state, settle

MiB = 1 << 20


def _run_threads(*targets):
    """Run each callable in its own thread; re-raise the first failure's traceback text."""
    errors = []

    def wrap(fn):
        def body():
            try:
                fn()
            except BaseException:
                import traceback
                errors.append(traceback.format_exc())
        return body

    threads = [threading.Thread(target=wrap(fn), name=getattr(fn, "__name__", "t")) for fn in targets]
    for t in threads:
        t.start()
    join_all(threads)
    assert not errors, errors[0]


# -- 1. producer on device 0, consumer on device 1, events + record_stream ---------------------
def test_two_device_pipeline_producer_consumer(sim_backend):
    """A producer thread (device 0 current) fills buffers on its own stream and hands each with
    an event; a consumer thread (device 1 current) waits the event on its stream, copies the
    buffer to device 1, marks the source used on its stream (record_stream) and drops it while
    the copy may still be queued.  The producer reuses freed memory at once: no result may see
    a later batch's bytes.  Then memory and vendor objects return to the baseline."""
    devs = _devices()
    if len(devs) < 2:
        pytest.skip(f"{sim_backend} simulator exposes one device")
    settle()
    base_live, base_alloc = live_objects(), allocated()
    state = process_state()
    n, batches = 64 << 10, 60
    handoff = queue.Queue(maxsize=4)
    results = {}

    def producer():
        accel.set_device_index(0)
        s = accel.Stream()
        with s:
            for b in range(batches):
                buf = accel.Buffer(n)
                buf.fill_(b % 251)
                ev = s.record_event()
                handoff.put((b, buf, ev), timeout=JOIN_S)
                del buf, ev
        handoff.put(None, timeout=JOIN_S)

    def consumer():
        accel.set_device_index(1)
        s = accel.Stream()
        pending = []
        with s:
            while True:
                item = handoff.get(timeout=JOIN_S)
                if item is None:
                    break
                b, src, ev = item
                s.wait_event(ev)
                dst = accel.Buffer(n)
                dst.copy_from(src, non_blocking=True)
                src.record_stream(s)
                del src, item
                arr, done = dst.to_numpy(non_blocking=True)
                pending.append((b, arr, done, dst))
                if len(pending) > 3:
                    pb, parr, pdone, _ = pending.pop(0)
                    pdone.synchronize()
                    results[pb] = parr
        for pb, parr, pdone, _ in pending:
            pdone.synchronize()
            results[pb] = parr

    _run_threads(producer, consumer)
    assert sorted(results) == list(range(batches))
    for b, arr in results.items():
        assert (arr == b % 251).all(), (b, np.unique(arr))
    assert process_state() == state
    del arr, results
    settle()
    assert allocated() == base_alloc
    assert live_objects() == base_live


# -- 2. capture on device 1 while device 0 is current; replay from other threads ---------------
def test_capture_on_other_device_replay_from_threads(sim_graph_backend):
    """The main thread keeps device 0 current and captures a graph on a device-1 stream
    (accel.graph(g, stream=...)); device 0 stays current throughout.  Worker threads, each with
    device 0 current, replay the graph under `with accel.device_index(1)` and on an explicit
    device-1 stream, one at a time behind a lock, and read the graph's output."""
    devs = _devices()
    if len(devs) < 2:
        pytest.skip("needs two devices")
    accel.set_device_index(0)
    settle()
    base_live, base_alloc = live_objects(), allocated()
    src = accel.Buffer(4096, device=1)
    out = accel.Buffer(4096, device=1)
    s1 = accel.Stream(1)
    g = accel.Graph()
    with accel.graph(g, stream=s1):
        assert accel.current_device_index() == 1      # inside the capture block: its device
        tmp = accel.Buffer(4096)
        tmp.copy_from(src, non_blocking=True)
        out.copy_from(tmp, non_blocking=True)
        del tmp
    assert accel.current_device_index() == 0
    assert not accel.is_current_stream_capturing()
    lock = threading.Lock()
    seen = []

    def worker(k):
        def body():
            accel.set_device_index(0)
            for i in range(10):
                value = (k * 10 + i) % 251
                with lock:
                    with accel.device_index(1):
                        src.fill_(value)
                        g.replay()
                        got = out.to_numpy()
                    seen.append((value, bool((got == value).all())))
            assert accel.current_device_index() == 0
        body.__name__ = f"replayer{k}"
        return body

    _run_threads(*(worker(k) for k in range(3)))
    assert len(seen) == 30 and all(ok for _, ok in seen), [v for v, ok in seen if not ok]
    # a replay with device 0 current and no device-1 stream current still runs on device 1
    src.fill_(7)
    g.replay()
    assert (out.to_numpy() == 7).all()
    del g, src, out, s1
    settle()
    assert allocated() == base_alloc
    assert live_objects() == base_live


def _pool_bytes(pool) -> tuple:
    """(allocated, reserved) bytes of a MemPool as its snapshot tells them."""
    alloc = reserved = 0
    for seg in pool.snapshot():
        reserved += seg["total_size"]
        alloc += sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
    return alloc, reserved


# -- 3. a MemPool shared by use_mem_pool and two graphs, empty_cache in between ---------------
def test_mempool_shared_with_graphs_and_empty_cache(sim_backend):
    """Weights live in a MemPool; two graphs capture into the same pool (Graph(pool=pool.id));
    empty_cache runs after each step, between captures and after the MemPool object is
    dropped while its graphs and buffers live.  use_count follows the holders; replays keep
    working; every byte comes back once the last holder goes."""
    devs = _devices()
    dev = devs[-1]
    accel.set_device_index(dev)
    settle()
    base_live, base_alloc = live_objects(), allocated()
    pool = accel.MemPool()
    assert pool.use_count() == 1
    with accel.use_mem_pool(pool):
        assert pool.use_count() == 2
        weights = accel.Buffer(3 * MiB)
        scratch = accel.Buffer(MiB)
    assert pool.use_count() == 1
    weights.fill_(3)
    del scratch
    accel.memory.empty_cache()            # a live pool's free segments stay
    a, r = _pool_bytes(pool)
    assert a == weights.nbytes and r >= 4 * MiB, (a, r)
    graphs = []
    if sim_backend != "mps":
        s = accel.Stream()
        outs = []
        for k in range(2):
            out = accel.Buffer(MiB)
            g = accel.Graph(pool=pool.id)
            s.wait_stream(accel.current_stream())
            with s, g:
                tmp = accel.Buffer(MiB)
                tmp.fill_(10 + k)
                out.copy_from(tmp, non_blocking=True)
                del tmp
            accel.current_stream().wait_stream(s)
            graphs.append(g)
            outs.append(out)
            accel.memory.empty_cache()
        assert pool.use_count() == 3
        for k, (g, out) in enumerate(zip(graphs, outs)):
            out.fill_(0)
            g.replay()
            assert (out.to_numpy() == 10 + k).all()
        del g, out, s
    del pool                                   # the graphs and `weights` still hold its memory
    gc.collect()
    accel.memory.empty_cache()
    assert (weights.to_numpy()[:: 4096] == 3).all()
    for k, g in enumerate(graphs):
        outs[k].fill_(0)
        g.replay()
        assert (outs[k].to_numpy() == 10 + k).all()
        accel.memory.empty_cache()
    g = None
    del weights
    accel.memory.empty_cache()
    if graphs:
        graphs[0].reset()
        accel.memory.empty_cache()
    del graphs
    outs = None
    settle()
    assert allocated() == base_alloc
    assert accel.memory.memory_reserved(dev) == 0
    assert live_objects() == base_live


# -- 4. memory_snapshot / stats / summary while other threads allocate -----------------------
def test_snapshots_consistent_while_threads_allocate(sim_backend):
    """Two worker threads allocate, fill and free on every device (one under use_mem_pool, one
    recording events on a side stream) while the main thread takes memory_snapshot,
    memory_stats, memory_summary and calls empty_cache in a loop with history recording on.
    Every snapshot is self-consistent (a segment's blocks tile it exactly, addresses
    increase); nothing raises; history is turned off and everything is freed at the end."""
    devs = _devices()
    settle()
    base_live, base_alloc = live_objects(), allocated()
    stop = threading.Event()
    accel.memory.record_history(True, max_entries=500)

    def plain():
        i = 0
        while not stop.is_set() or i < 30:
            d = devs[i % len(devs)]
            b = accel.Buffer(4096 * (1 + i % 7), device=d)
            b.fill_(i % 200)
            assert b.to_numpy()[-1] == i % 200
            del b
            i += 1

    def pooled():
        pools = {}
        for d in devs:
            with accel.device_index(d):
                pools[d] = accel.MemPool()
        i = 0
        while not stop.is_set() or i < 30:
            d = devs[i % len(devs)]
            with accel.device_index(d):
                s = accel.Stream()
                with accel.use_mem_pool(pools[d]):
                    b = accel.Buffer(MiB + 512 * i)
                b.fill_(1, stream=s)
                b.record_stream(s)
                ev = s.record_event()
                del b
                if i % 3 == 0:
                    ev.synchronize()
                del s, ev
            i += 1
        del pools

    def observer():
        try:
            for _ in range(40):
                snap = accel.memory.memory_snapshot()
                for seg in snap:
                    addr = seg["address"]
                    for blk in seg["blocks"]:
                        assert blk["address"] == addr, (seg, blk)
                        addr += blk["size"]
                    assert addr == seg["address"] + seg["total_size"], seg
                for d in devs:
                    st = accel.memory.memory_stats(d)
                    assert st["allocated_bytes.all.current"] <= st["reserved_bytes.all.current"], st
                    accel.memory.memory_summary(d)
                accel.memory.empty_cache()
        finally:
            stop.set()

    try:
        _run_threads(plain, pooled, observer)
    finally:
        accel.memory.record_history(None)
    settle()
    assert allocated() == base_alloc
    assert live_objects() == base_live


# -- 5. a training loop that runs out of memory in a stream, a MemPool and a capture ----------
def test_training_loop_oom_everywhere_recovers(sim_backend):
    """Under set_per_process_memory_fraction a training loop doubles its batch until an
    OutOfMemoryError: raised inside `with stream:`, inside use_mem_pool, and (where the
    backend captures) inside a graph capture.  Each time the program halves the batch and
    continues: the current stream and device, the capture state and the pool's use_count are
    as before, the captured graph of the smaller batch replays correctly, and at the end
    every byte and vendor object comes back."""
    devs = _devices()
    dev = devs[-1]
    accel.set_device_index(dev)
    settle()
    base_live, base_alloc = live_objects(), allocated()
    total = accel.get_memory_info(dev)[1]
    frac = (64 * MiB) / total
    accel.memory.set_per_process_memory_fraction(frac, dev)
    try:
        state = process_state()
        s = accel.Stream()
        pool = accel.MemPool()
        where_oom = []

        def grow(where):
            batch = MiB
            kept = []
            while True:
                try:
                    if where == "stream":
                        with s:
                            b = accel.Buffer(batch)
                            b.fill_(1)
                    elif where == "pool":
                        with accel.use_mem_pool(pool):
                            b = accel.Buffer(batch)
                    else:
                        g = accel.Graph()
                        out = accel.Buffer(4096)
                        with accel.graph(g, stream=s):
                            b = accel.Buffer(batch)
                            b.fill_(5)
                            out.copy_from(accel.Buffer.from_ptr(b.ptr, 4096, owner=b), non_blocking=True)
                            del b
                        out.fill_(0)
                        g.replay()
                        assert (out.to_numpy() == 5).all()
                        b = (g, out)
                except accel.OutOfMemoryError as exc:
                    assert "Tried to allocate" in str(exc) or "Requested" in str(exc), str(exc)
                    where_oom.append(where)
                    break
                kept.append(b)
                del b
                batch *= 2
            assert process_state() == state, where
            assert pool.use_count() == 1, where
            # recover: drop the largest half, go on with a smaller batch
            del kept[len(kept) // 2:]
            accel.memory.empty_cache()
            with s:
                c = accel.Buffer(batch // 4)
                c.fill_(9)
                assert c.to_numpy()[-1] == 9
            del c
            return kept

        keep = [grow("stream"), grow("pool")]
        if sim_backend != "mps":
            keep.append(grow("graph"))
            g, out = keep[-1][-1]
            out.fill_(0)
            g.replay()
            assert (out.to_numpy() == 5).all()
            del g, out
        assert len(where_oom) == len(keep)
        assert accel.memory.memory_stats(dev)["num_ooms"] >= len(keep)
        del keep, pool, s
    finally:
        accel.memory.set_per_process_memory_fraction(1.0, dev)
    settle()
    assert allocated() == base_alloc
    assert live_objects() == base_live


# -- 6. fork (multiprocessing 'fork' and os.fork) while other threads use the device ----------
_FORK_WHILE_BUSY = r'''
    import gc, os, sys, threading
    import multiprocessing as mp
    import numpy as np
    import accel
    devs = accel.device_count()
    kind = accel.current_accelerator().type
    stop = threading.Event()
    errors = []

    def hammer(t):
        try:
            d = t % devs
            accel.set_device_index(d)
            s = accel.Stream()
            pool = accel.MemPool()
            i = 0
            while not stop.is_set():
                with s:
                    b = accel.Buffer(4096 * (1 + i % 5))
                    b.fill_(i % 250)
                    with accel.use_mem_pool(pool):
                        c = accel.Buffer(8192)
                    c.copy_from(np.full(8192, 3, np.uint8), non_blocking=True)
                    b.record_stream(accel.current_stream())
                    ev = s.record_event()
                    del b
                if i % 4 == 0:
                    accel.memory.empty_cache()
                    accel.memory.memory_snapshot()
                ev.synchronize()
                del c, ev
                i += 1
        except BaseException:
            import traceback
            errors.append(traceback.format_exc())

    def child_body(objs):
        # queries that need no runtime work; device use raises the fork error; the inherited
        # objects (made by threads the child does not have) drop quietly
        assert accel.device_count() == devs
        assert accel.is_available() and accel.current_accelerator().type == kind
        try:
            accel.Stream()
        except RuntimeError as exc:
            assert "forked subprocess" in str(exc), exc
        else:
            raise SystemExit("child could use the device")
        objs.clear()
        gc.collect()
        return 0

    def mp_child(code):
        sys.exit(child_body([]))

    threads = [threading.Thread(target=hammer, args=(t,), daemon=True) for t in range(3)]
    for t in threads:
        t.start()
    keep = [accel.Buffer(1024, device=devs - 1).fill_(4), accel.Stream(), accel.Event()]
    ctx = mp.get_context("fork")
    for k in range(6):
        if k % 2:
            p = ctx.Process(target=mp_child, args=(k,))
            p.start()
            p.join(60)
            assert p.exitcode == 0, (k, p.exitcode)
        else:
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = child_body(keep)
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, (k, status)
    stop.set()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "hammer thread hung"
    assert not errors, errors[0]
    assert (keep[0].to_numpy() == 4).all()
    print("OK")
'''


def test_fork_while_threads_use_the_device(sim_backend):
    """A parent whose threads keep allocating, copying, snapshotting and emptying caches forks
    children (os.fork and multiprocessing's 'fork' context) at arbitrary moments: a lock a
    parent thread held at the fork must not hang the child's queries, its refusal to use the
    device, or its dropping of inherited objects; the parent's threads go on unharmed."""
    from test_user_programs import run_program
    proc = run_program(_FORK_WHILE_BUSY, timeout=90)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (proc.stdout, proc.stderr[-3000:])
    assert "Exception ignored" not in proc.stderr, proc.stderr[-3000:]


# -- 7. worker threads that die with their stream current, a pool and a generator -----------
def _worker_round(keep, errors, n=8):
    devs = _devices()

    def worker(i):
        d = i % len(devs)
        try:
            s = accel.Stream(d)
            accel.set_stream(s)                 # left current when the thread ends
            b = accel.Buffer(4096)              # on s, device d
            b.fill_(i % 200)
            if i % 3 == 0:
                pool = accel.MemPool()
                with accel.use_mem_pool(pool):
                    keep.append(accel.Buffer(8192))     # outlives the thread and the pool
            gen = accel.random.Generator(d, seed=i)
            accel.random.uniform_(b, generator=gen)
            accel.Event().record()
            if i % 2:
                raise KeyError("the thread dies with an exception")
        except KeyError:
            pass
        except BaseException:
            import traceback
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=worker, args=(i,), name=f"w{i}") for i in range(n)]
    for t in threads:
        t.start()
    join_all(threads)
    keep.clear()


def test_threads_die_with_state_left_current_bounded(sim_backend):
    """Short-lived worker threads each make a stream and leave it current (set_stream, never
    restored), allocate on it, route one allocation through a MemPool that dies before the
    buffer, draw from a Generator and record an event, and half of them die by an exception.
    After a warm-up, forty more rounds leave the simulator's objects, accel's tables and its
    live objects where they were: a dead thread's current stream is not kept alive."""
    from test_user_programs2 import accel_object_count, accel_tables
    keep, errors = [], []

    def measure():
        settle()
        tables = accel_tables()
        if sim_backend == "xpu":
            # event slots are pooled (one pool of fixed size): slots move between the free and
            # retired lists as streams pass them; the pools themselves must not grow
            be = accel._lazy.lazy_init()
            tables = {k: v for k, v in tables.items() if k not in ("backend._free_slots", "backend._retired")}
            tables["pools"] = len(be._pools)
            # a retired slot keeps the backend records (_Stream, with its Lock) of the streams it
            # waits for until a sweep recycles it: bounded by the fixed pools checked above
            objects = {k: v for k, v in accel_object_count().items() if k not in ("_Stream", "Lock")}
            return live_objects(), tables, objects
        return live_objects(), tables, accel_object_count()

    for _ in range(5):
        _worker_round(keep, errors)
    before = measure()
    for _ in range(40):
        _worker_round(keep, errors)
    after = measure()
    assert not errors, errors[0]
    from test_user_programs2 import assert_same_footprint
    assert_same_footprint(before, after)


# -- 8. typed views as copy sources inside a capture ------------------------------------------
def test_copy_from_a_typed_view_inside_a_capture(sim_graph_backend):
    """A static input written (through a typed view) before the capture is copied into the
    graph's output through a typed view of it, as a user porting `out.copy_(inp.view(...))`
    writes it; the graph replays the copy."""
    settle()
    src = accel.Buffer(4096)
    src.as_array(np.float32).copy_from(np.full(1024, 2.5, np.float32))
    out = accel.Buffer(4096)
    g = accel.Graph()
    with accel.graph(g):
        out.copy_from(src.as_array(np.float32, (1024,)), non_blocking=True)
    out.fill_(0)
    g.replay()
    assert (out.to_numpy(np.float32) == 2.5).all()


# -- 9. two threads capture on two devices at once (thread_local) ------------------------------
def test_two_threads_capture_on_two_devices_thread_local(sim_graph_backend):
    """Thread A captures on device 0 (thread_local mode) and, mid-capture, thread B captures its
    own graph on device 1 in thread_local mode, as a per-device serving warm-up does.  CUDA would let
    B's calls through (neither capture is global), but accel.graph() empties the caches first, as
    torch's does, and device 0's allocator refuses that while its capture allocates to a pool:
    torch's does too (synchronize_and_free_events asserts captures_underway == 0).  B gets a clear
    CaptureError naming the fix; A's capture is unharmed."""
    if len(_devices()) < 2:
        pytest.skip("needs two devices")
    inside, done_b = threading.Event(), threading.Event()
    got = {}

    def capture_a():
        try:
            with accel.device_index(0):
                out, g = accel.Buffer(64), accel.Graph()
                with accel.graph(g, capture_error_mode="thread_local"):
                    out.fill_(1)
                    inside.set()
                    done_b.wait(JOIN_S)
                    out.fill_(2)
                out.fill_(0)
                g.replay()
                got["a"] = int(out.to_numpy()[0])
        finally:
            inside.set()

    def capture_b():
        try:
            inside.wait(JOIN_S)
            with accel.device_index(1):
                out, g = accel.Buffer(64), accel.Graph()
                with pytest.raises(accel.CaptureError, match=r"empty_cache\(\) is not allowed while a stream "
                                   r"capture is underway \(device 0's allocator\); call it after capture_end"):
                    with accel.graph(g, capture_error_mode="thread_local"):
                        out.fill_(3)
                got["b"] = "refused"
        finally:
            done_b.set()

    _run_threads(capture_a, capture_b)
    assert got == {"a": 2, "b": "refused"}
