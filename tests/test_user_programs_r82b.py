"""Realistic user programs, r82b: programs a user porting torch.cuda / torch.xpu / torch.mps code
writes, run on the CUDA, Level Zero ("xpu") and Metal ("mps") simulators, with the work on the
*non-current* device wherever the simulator has two (Metal exposes one system device).

Earlier rounds (test_user_programs*.py) took loader rings, GPipe, ring all-reduce, inference
servers, OOM loops, fork pools and DLPack exchanges.  These take shapes they do not:

1. an OOM observer that frees the program's own activation cache on device 1 while device 0 is
   current, under a per-process memory fraction lowered at run time, then ``empty_cache`` and a
   retry; the observer's arguments, ``num_ooms`` per device and the summary are checked;
2. a dropout-like training step captured on device 1 with a *registered* non-default generator
   into a private pool, replayed while another thread allocates and frees on the same device;
   the generator's ``graphsafe_get_state`` / ``graphsafe_set_state`` saved around replays make a
   replay repeat an earlier one, and ``clone_state`` states swap in and out between replays;
3. a multi-device gather into device 0 (peer copies, or host staging on a machine whose devices
   cannot reach each other) of data each device produced on a side stream, read back through a
   pinned ``copy_to`` ring and through ``torch.from_dlpack(view, device="cpu")``;
4. buffers made inside generator functions and closures under ``with accel.Stream(1)`` blocks,
   abandoned mid-iteration, kept alive by closures only, then released;
5. DLPack round trips on a side stream with queued (slowed) work: ``numpy.from_dlpack`` and
   ``torch.from_dlpack`` with ``device="cpu"`` must see the queued work; torch's CPU tensor back
   into a Buffer; the program's reads of ``memory_snapshot()`` / ``memory_summary()`` while the
   side stream still runs;
6. nested device / stream contexts entered in one thread and worker threads that start with
   their own defaults (torch: the current device and stream are per thread);
7. make_graphed_callables-like forward/backward graphs sharing one pool, deleted in turn;
8. pinned arrays dropped while their copies are queued, then ``empty_host_cache``;
9. another thread's queries, allocations and eager draws during a capture (three modes);
10. replays, allocations, snapshots and DLPack exports in four threads at once;
11. the DLPack ``stream=`` argument a ported consumer passes (one accel bug: strict xfail);
12. host copies through ``dl_device=(kDLCPU, 0)`` with ``stream=-1`` still ordered;
13. a double-buffered upload pipeline per device, both devices at once;
14. the whole mix in a loop: accel's tables stay flat (r66b's ``_run_twice``);
15. pageable ``non_blocking`` copies and ``get_memory_info`` of the non-current device.

Every thread is joined with a timeout; memory_allocated returns to its start on every device.
"""

import gc
import threading

import numpy as np
import pytest

import accel
from conftest import use_sim
from test_user_programs import JOIN_S, _devices, live_objects, settle
from test_user_programs_r66b import _native, _slow, check_stat_invariants

MiB = 1 << 20


def _other() -> int:
    """The device the program works on: the last one (device 1 where there are two)."""
    return _devices()[-1]


def _join(threads):
    for t in threads:
        t.join(JOIN_S)
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"threads hung: {hung}"


def _baseline():
    settle()
    return live_objects(), tuple(accel.memory.memory_allocated(d) for d in _devices())


def _check_back(base):
    live, alloc = base
    settle()
    assert tuple(accel.memory.memory_allocated(d) for d in _devices()) == alloc
    assert tuple(accel.memory.memory_reserved(d) for d in _devices()) == (0,) * len(_devices())
    assert live_objects() == live
    for d in _devices():
        check_stat_invariants(d, "end")


# -- 1. OOM observer frees the activation cache on the non-current device ------------------------
@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_oom_observer_frees_activations_under_fraction_on_other_device(monkeypatch, kind):
    """torch.cuda's OOM observer (``torch._C._cuda_attach_out_of_memory_observer``) runs before
    the OutOfMemoryError propagates; a program uses it to drop its activation cache, then
    ``empty_cache()`` and retries.  The observer is told the device that failed (1, not the
    current 0); ``num_ooms`` counts on that device only; the retry succeeds; memory returns."""
    use_sim(monkeypatch, kind)
    d = _other()
    accel.set_device_index(0)
    base = _baseline()
    total = accel.get_device_properties(d).total_memory
    seen, cache = [], []

    def observer(device, tried, allowed, free):
        seen.append((device, tried, allowed, free, accel.current_device_index()))
        cache.clear()                      # drop the activations: the retry below must fit

    accel.memory.attach_out_of_memory_observer(observer)
    try:
        frac = 0.05
        accel.memory.set_per_process_memory_fraction(frac, d)
        assert accel.memory.get_per_process_memory_fraction(d) == pytest.approx(frac)
        if d:
            assert accel.memory.get_per_process_memory_fraction(0) == 1.0   # device 0 untouched
        s = accel.Stream(d)
        chunk = max(total // 128, 2 * MiB) // MiB * MiB
        with pytest.raises(accel.OutOfMemoryError):
            with s:
                for i in range(200):
                    b = accel.Buffer(chunk)
                    b.fill_(i % 251)
                    cache.append(b)
        assert accel.current_device_index() == 0
        assert len(seen) == 1, seen
        device, tried, allowed, free, cur = seen[0]
        assert device == d
        assert cur == d                       # the caller was inside `with s:` (device d current)
        assert tried >= chunk
        assert allowed == pytest.approx(frac * total, rel=0.01)
        assert cache == []
        del b                                 # the loop's last successful buffer
        st = accel.memory.memory_stats(d)
        assert st["num_ooms"] == 1
        if len(_devices()) > 1:
            assert accel.memory.memory_stats(0).get("num_ooms", 0) == 0
        accel.memory.empty_cache()
        with s:
            retry = accel.Buffer(chunk)      # fits now: the observer dropped the cache
            retry.fill_(7)
        assert retry.device_index == d
        assert (retry.to_numpy(stream=s)[:: chunk // 8] == 7).all()
        summary = accel.memory.memory_summary(d)
        assert "OOM" in summary or "oom" in summary.lower()
        del retry
        s.synchronize()
        accel.memory.set_per_process_memory_fraction(1.0, d)
        del s
    finally:
        accel.memory.detach_out_of_memory_observer(observer)
    _check_back(base)


# -- 2. a captured dropout-like step with a registered generator ---------------------------------
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_registered_generator_graph_state_save_restore_while_thread_allocates(monkeypatch, kind):
    """``g.register_generator_state(gen)`` (torch.cuda.CUDAGraph.register_generator_state) lets a
    capture draw from a non-default generator.  Each replay draws fresh numbers (the generator's
    offset advances by the capture's increment); ``graphsafe_get_state()`` saved before a replay
    and set back afterwards makes the next replay repeat it; a ``clone_state()`` swapped in with
    ``graphsafe_set_state`` runs its own sequence.  A second thread allocates and frees on the
    same device meanwhile."""
    use_sim(monkeypatch, kind)
    d = _other()
    accel.set_device_index(0)
    base = _baseline()
    n = 1024
    gen = accel.random.Generator(device=d, seed=1234)
    x = accel.Buffer(4 * n, device=d).copy_from(np.arange(n, dtype=np.float32))
    noise = accel.Buffer(4 * n, device=d)
    out = accel.Buffer(4 * n, device=d)
    side = accel.Stream(d)
    g = accel.Graph()
    if kind == "xpu":
        # Level Zero has no Philox kernel: RNG fills cannot be captured (README, backend notes)
        with pytest.raises(accel.CaptureError):
            with accel.graph(g, stream=side):
                accel.random.uniform_(noise, generator=gen)
        del g, x, noise, out, side, gen
        _check_back(base)
        return
    g.register_generator_state(gen)
    with accel.graph(g, stream=side):
        accel.random.uniform_(noise, generator=gen)
        tmp = accel.Buffer(4 * n)                  # from the graph's private pool
        tmp.copy_from(x)
        out.copy_from(tmp)
        del tmp
    stop = threading.Event()
    errors = []

    def churn():
        try:
            st = accel.Stream(d)
            with st:
                while not stop.is_set():
                    bs = [accel.Buffer(64 << 10) for _ in range(4)]
                    for i, b in enumerate(bs):
                        b.fill_(i)
                    assert bs[3].to_numpy()[0] == 3
                    del bs
            st.synchronize()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=churn, name="r82b-churn", daemon=True)
    t.start()
    try:
        with accel.device_index(d):
            shared = gen.graphsafe_get_state()        # torch: the same state object, not a copy
            draws = []
            for i in range(6):
                if i == 2:
                    saved = gen.get_state()           # 16 bytes: seed, offset
                g.replay()
                draws.append(noise.to_numpy(np.float32).copy())
                assert (out.to_numpy(np.float32) == np.arange(n, dtype=np.float32)).all()
            assert len({a.tobytes() for a in draws}) == len(draws)     # every replay drew anew
            assert shared.get_offset() == gen.get_offset()            # shared state advanced too
            # set_state of the registered state: the next replay repeats replay 2
            gen.set_state(saved)
            g.replay()
            assert (noise.to_numpy(np.float32) == draws[2]).all()
            g.replay()
            assert (noise.to_numpy(np.float32) == draws[3]).all()
            # an eager draw from the same state is the replay's draw (same Philox offsets)
            gen.set_state(saved)
            eager = accel.Buffer(4 * n)
            accel.random.uniform_(eager, generator=gen)
            assert (eager.to_numpy(np.float32) == draws[2]).all()
            del eager
    finally:
        stop.set()
        _join([t])
    assert not errors, errors
    assert accel.current_device_index() == 0
    del g, x, noise, out, side, gen
    _check_back(base)


def _rng_steps(gen, old, new, n, d, bufs):
    """torch's test_graphsafe_set_get_rng_state steps: one draw from ``new``, two from ``old``."""
    gen.graphsafe_set_state(new)
    accel.random.uniform_(bufs[0], generator=gen)
    gen.graphsafe_set_state(old)
    accel.random.uniform_(bufs[1], generator=gen)
    accel.random.uniform_(bufs[2], generator=gen)


def test_graphsafe_states_switched_inside_a_capture_on_other_device(sim_cuda):
    """torch's own pattern (test_cuda.py, test_graphsafe_set_get_rng_state): ``old =
    gen.graphsafe_get_state()``, ``new = gen.clone_state()``, both registered with the graph, and
    ``graphsafe_set_state`` switches between them *inside* the capture.  Each replay equals the
    same steps run eagerly from the same seeds, and a second replay equals the eager steps run a
    second time (each registered state advanced by its own increment), on device 1 while 0 is
    current; a side thread takes a memory_snapshot meanwhile."""
    d = _other()
    accel.set_device_index(0)
    base = _baseline()
    n = 257                                  # not a multiple of 4: Philox offsets round up

    def states():
        gen = accel.random.Generator(device=d)
        gen.manual_seed(0)
        return gen, gen.graphsafe_get_state(), gen.clone_state()

    eager_gen, e_old, e_new = states()
    eager_bufs = [accel.Buffer(4 * n, device=d) for _ in range(3)]
    expected = []
    for _ in range(2):
        _rng_steps(eager_gen, e_old, e_new, n, d, eager_bufs)
        expected.append([b.to_numpy(np.float32).copy() for b in eager_bufs])
    gen, old, new = states()
    g = accel.Graph()
    g.register_generator_state(old)
    g.register_generator_state(new)
    bufs = [accel.Buffer(4 * n, device=d) for _ in range(3)]
    side = accel.Stream(d)
    with accel.graph(g, stream=side):
        _rng_steps(gen, old, new, n, d, bufs)
    snaps = []
    t = threading.Thread(target=lambda: snaps.append(accel.memory.memory_snapshot()), name="r82b-snap")
    t.start()
    with accel.device_index(d):
        for k in range(2):
            g.replay()
            got = [b.to_numpy(np.float32) for b in bufs]
            for j in range(3):
                assert (got[j] == expected[k][j]).all(), (k, j)
    _join([t])
    assert snaps and all(seg["device"] in _devices() for seg in snaps[0])
    assert old.get_offset() == e_old.get_offset() and new.get_offset() == e_new.get_offset()
    assert accel.current_device_index() == 0
    del g, bufs, eager_bufs, side, gen, old, new, eager_gen, e_old, e_new
    snaps = None      # (names the closures above read)
    _check_back(base)


# -- 3. multi-device gather into device 0, read back through pinned memory and torch ------------
@pytest.mark.parametrize("peer", ["", "none"])
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_gather_from_both_devices_pinned_readback_and_torch_cpu(monkeypatch, kind, peer):
    """Each device draws its shard on a side stream from its own generator; device 0 gathers the
    shards into one buffer on its own side stream (waiting on each producer's event, never on a
    synchronize), by peer copies or, where devices cannot reach each other, host staging; the
    result is read back with a non-blocking ``copy_to`` into pinned memory gated by an event, and
    through ``numpy.from_dlpack(view, device="cpu")`` then ``torch.from_dlpack``.  The shards equal fresh eager draws from
    the same seeds, and every byte comes back at the end."""
    torch = pytest.importorskip("torch")
    env = {"ACCEL_SIM_PEER": peer} if peer else {}
    use_sim(monkeypatch, kind, **env)
    devs = _devices()
    accel.set_device_index(1)                # an odd current device: the gather is on 0
    base = _baseline()
    if peer == "none":
        assert accel.can_device_access_peer(0, 1) is False
    n = 3000
    streams = {d: accel.Stream(d) for d in devs}
    shards, events = {}, {}
    with _slow(200):                         # the producers' work really is queued
        for d in devs:
            gen = accel.random.Generator(device=d, seed=100 + d)
            with streams[d]:
                shard = accel.Buffer(4 * n)
                accel.random.uniform_(shard, generator=gen, low=d, high=d + 1)
                shards[d] = shard
                events[d] = streams[d].record_event()
        gather = accel.Buffer(4 * n * len(devs), device=0, stream=streams[0])
        s0 = streams[0]
        for d in devs:
            s0.wait_event(events[d])
            view = gather.as_array(np.float32, (n,), offset=4 * n * d)
            tmp = accel.Buffer(4 * n, device=0, stream=s0)
            tmp.copy_from(shards[d], stream=s0, non_blocking=True)
            view.copy_from(tmp, stream=s0)
            del tmp
        pinned = accel.empty_pinned((len(devs), n), np.float32)
        gather.copy_to(pinned, stream=s0, non_blocking=True)
        done = s0.record_event()
    done.synchronize()
    assert accel.current_device_index() == 1
    for d in devs:
        ref = accel.Buffer(4 * n, device=d)
        accel.random.uniform_(ref, generator=accel.random.Generator(device=d, seed=100 + d), low=d, high=d + 1)
        want = ref.to_numpy(np.float32)
        assert ((want >= d) & (want < d + 1)).all()
        assert (pinned[d] == want).all(), d
        del ref
    # torch 2.13's CPU build asks torch.cuda for a stream whenever the producer's __dlpack_device__
    # is kDLCUDA (torch/utils/dlpack.py), so a CPU torch takes device memory through numpy's copy
    host = np.from_dlpack(gather.as_array(np.float32, (len(devs), n)), device="cpu")
    t = torch.from_dlpack(host)
    assert t.device.type == "cpu" and tuple(t.shape) == (len(devs), n)
    assert (t.numpy() == pinned).all()
    del t, host, pinned, done, gather, shards, events, shard, view, s0, streams
    _check_back(base)


# -- 4. buffers made in generator functions and closures ------------------------------------------
@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_buffers_from_generators_and_closures_abandoned_mid_iteration(monkeypatch, kind):
    """A batch generator allocates each batch inside ``with stream:`` of the last device and
    yields typed views; the consumer keeps some batches alive only through closures (deferred
    reductions), abandons the generator mid-iteration (``close()``, dropped, and dropped while
    its ``with`` block is still entered), and runs the closures later from device 0 and from
    another thread.  The current device and stream are restored at every step, the closures
    read the right data, and the memory returns when the closures go."""
    use_sim(monkeypatch, kind)
    d = _other()
    accel.set_device_index(0)
    base = _baseline()
    s = accel.Stream(d)
    n = 4096
    cur0 = accel.current_stream(0), accel.current_stream(d)

    def batches(first):
        i = first
        with s:
            while True:
                b = accel.Buffer(4 * n)
                b.as_array(np.float32, (n,)).copy_from(np.full(n, i, np.float32), stream=s)
                yield i, b.as_array(np.float32, (n,))
                i += 1

    closures = []

    def defer(i, view):
        def total():
            return float(view.to_numpy().sum()), i
        return total

    it = batches(0)
    for i, view in it:
        assert accel.current_device_index() == d and accel.current_stream(d) == s
        if i % 3 == 0:
            closures.append(defer(i, view))
        if i == 7:
            break
    # the generator is suspended inside `with s:` -- but the caller's state is its own
    del view
    it.close()
    assert accel.current_device_index() == 0
    assert (accel.current_stream(0), accel.current_stream(d)) == cur0
    it2 = batches(100)
    i, v = next(it2)
    closures.append(defer(i, v))
    del v
    # suspended inside its `with s:`, the generator's block is the thread's (Python generators
    # share the thread's state, as with torch's StreamContext): device d is current meanwhile
    assert accel.current_device_index() == d and accel.current_stream(d) == s
    del it2                                   # dropped while suspended: its __exit__ restores
    assert accel.current_device_index() == 0
    assert (accel.current_stream(0), accel.current_stream(d)) == cur0
    it3 = batches(200)
    next(it3)
    cycle = [it3]
    cycle.append(cycle)                        # collected as a cycle, later
    del it3, cycle
    gc.collect()
    assert accel.current_device_index() == 0
    assert (accel.current_stream(0), accel.current_stream(d)) == cur0
    results = {}

    def worker():
        assert accel.current_device_index() == 0      # torch: a new thread starts on device 0
        results["thread"] = [c() for c in closures]
    t = threading.Thread(target=worker, name="r82b-closures")
    t.start()
    _join([t])
    assert results["thread"] == [(float(i * n), i) for i in (0, 3, 6, 100)]
    assert [c() for c in closures] == results["thread"]
    held = accel.memory.memory_allocated(d) - base[1][-1]
    assert held >= 4 * 4 * n                   # four batches held by the closures only
    closures.clear()
    gc.collect()
    assert accel.memory.memory_allocated(d) == base[1][-1]
    s = None      # (the batch generator above reads it)
    _check_back(base)


# -- 5. DLPack round trips on a side stream with work still queued --------------------------------
@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_dlpack_round_trips_on_side_stream_with_queued_work(monkeypatch, kind):
    """A side stream of the last device fills a buffer slowly; without any synchronize the
    program takes host copies with ``numpy.from_dlpack(view, device="cpu")`` (the array API's
    host copy) and hands them to torch (``torch.from_dlpack``), which computes on the CPU; the
    result goes back into a view through its DLPack (``view.copy_from(tensor)``); a zero-copy
    ``accel.from_dlpack`` import of the view outlives the exporting buffer.  Meanwhile another
    thread reads ``memory_snapshot()`` / ``memory_summary()`` of that device.  Every read sees
    the queued work; the imports release the memory when dropped."""
    torch = pytest.importorskip("torch")
    use_sim(monkeypatch, kind)
    d = _other()
    accel.set_device_index(0)
    base = _baseline()
    n = 1 << 14
    s = accel.Stream(d)
    buf = accel.Buffer(4 * n, device=d, stream=s)
    view = buf.as_array(np.float32, (128, n // 128))
    src = np.arange(n, dtype=np.float32).reshape(128, -1)
    reports = []

    def reader():
        for _ in range(5):
            snap = accel.memory.memory_snapshot()
            segs = [seg for seg in snap if seg["device"] == d]
            reports.append((sum(seg["allocated_size"] for seg in segs) if segs else None,
                            accel.memory.memory_summary(d)))
    with _slow(300):
        buf.fill_(0, stream=s)
        buf.copy_from(src, stream=s, non_blocking=True)
        t = threading.Thread(target=reader, name="r82b-reader")
        t.start()
        host = np.from_dlpack(view, device="cpu")       # ordered after s's queued copy
    _join([t])
    assert host.shape == (128, n // 128) and (host == src).all()
    assert all(r[0] is None or r[0] >= 4 * n for r in reports) and all(isinstance(r[1], str) for r in reports)
    tt = torch.from_dlpack(host)
    tt.mul_(2).add_(1)                                    # torch writes numpy's copy in place
    assert (host == 2 * src + 1).all()
    view.copy_from(tt, stream=s)                          # a host DLPack producer: copied in
    assert (buf.to_numpy(np.float32, (128, n // 128), stream=s) == 2 * src + 1).all()
    # a zero-copy import of the view keeps the memory after the Buffer is dropped
    alias = accel.from_dlpack(view)
    assert alias.ptr == buf.ptr and alias.nbytes == buf.nbytes and not alias.owns_memory
    held = accel.memory.memory_allocated(d)
    del view, buf
    gc.collect()
    assert accel.memory.memory_allocated(d) == held       # the capsule keeps it alive
    with pytest.raises((BufferError, TypeError, ValueError)):
        accel.from_dlpack(tt)                              # host memory is refused
    assert (alias.to_numpy(np.float32, stream=s) == (2 * src + 1).ravel()).all()
    alias.fill_(0, stream=s)
    s.synchronize()
    del alias
    gc.collect()
    assert accel.memory.memory_allocated(d) == base[1][-1]
    del tt, host, s
    _check_back(base)


# -- 6. nested device / stream contexts in one thread, fresh defaults in others -----------------
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_nested_contexts_across_devices_and_threads_stay_thread_local(monkeypatch, kind):
    """torch keeps the current device and each device's current stream per thread: a thread
    started inside ``with device_index(1): with stream_on_0: with stream_on_1:`` starts on
    device 0 with the default streams.  ``with stream:`` makes the stream's device current
    (torch's StreamContext / THPStream_enter) and returns the stream; ``set_stream`` makes the
    stream's device current too (torch.accelerator.set_stream).  Two threads nest contexts in
    opposite orders at once, raising at the innermost level; each thread's state is restored,
    and work queued under the contexts lands on the right streams."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    base = _baseline()
    defaults = {d: accel.default_stream(d) for d in (0, 1)}
    s0, s1 = accel.Stream(0), accel.Stream(1)
    seen = {}
    barrier = threading.Barrier(3, timeout=JOIN_S)
    errors = []
    n = 4096

    def thread_state():
        return accel.current_device_index(), accel.current_stream(0), accel.current_stream(1)

    def nest(order, tag):
        try:
            seen[tag + "-start"] = thread_state()
            mine = {0: accel.Stream(0), 1: accel.Stream(1)}
            out = {d: accel.Buffer(4 * n, device=d) for d in (0, 1)}
            with pytest.raises(ZeroDivisionError):
                with accel.device_index(order[0]):
                    with mine[order[1]] as a:
                        assert a is mine[order[1]]
                        out[order[1]].fill_(1)                    # on mine[order[1]]
                        with mine[order[0]]:
                            assert accel.current_device_index() == order[0]
                            out[order[0]].fill_(2)
                            barrier.wait()
                            seen[tag + "-inner"] = thread_state()
                            1 / 0
            seen[tag + "-end"] = thread_state()
            for d in (0, 1):
                assert out[d].last_stream == mine[d], (tag, d)
                mine[d].synchronize()
            seen[tag + "-data"] = (int(out[order[1]].to_numpy(np.int32, stream=mine[order[1]])[0]),
                                   int(out[order[0]].to_numpy(np.int32, stream=mine[order[0]])[0]))
            del out
        except BaseException as exc:
            errors.append(exc)

    with accel.device_index(1):
        with s0 as got0:
            assert got0 is s0 and accel.current_device_index() == 0
            with s1:
                assert accel.current_device_index() == 1
                threads = [threading.Thread(target=nest, args=((0, 1), "a"), name="r82b-a"),
                           threading.Thread(target=nest, args=((1, 0), "b"), name="r82b-b")]
                for t in threads:
                    t.start()
                barrier.wait()
                assert thread_state() == (1, s0, s1)          # others' contexts are theirs
                _join(threads)
                assert thread_state() == (1, s0, s1)
            assert thread_state() == (0, s0, defaults[1])
        assert thread_state() == (1, defaults[0], defaults[1])
    assert thread_state() == (0, defaults[0], defaults[1])
    assert not errors, errors
    for tag in "ab":
        assert seen[tag + "-start"] == (0, defaults[0], defaults[1]), tag
        assert seen[tag + "-end"] == (0, defaults[0], defaults[1]), tag
        assert seen[tag + "-data"] == (1 * 0x01010101, 2 * 0x01010101), tag
    assert seen["a-inner"][0] == 0 and seen["b-inner"][0] == 1
    # set_stream: the stream's device becomes current, as torch.accelerator.set_stream
    accel.set_stream(s1)
    try:
        assert accel.current_device_index() == 1 and accel.current_stream() == s1
    finally:
        accel.set_stream(defaults[1])
        accel.set_device_index(0)
    assert thread_state() == (0, defaults[0], defaults[1])
    del s0, s1, got0
    seen.clear()                              # the inner states name the threads' streams
    _check_back(base)


# -- 7. make_graphed_callables-like forward/backward graphs sharing one pool ----------------------
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_forward_backward_graphs_share_a_pool_outlive_each_other(monkeypatch, kind):
    """torch.cuda.make_graphed_callables' shape: a forward graph and a backward graph captured on
    device 1 into one ``graph_pool_handle()`` (``accel.graph(g, pool=handle)``); the backward's
    static input is the forward's output, allocated from the shared pool.  Replays alternate
    with new inputs copied into the static input from device 0's context; the forward graph is
    deleted first, the backward still replays on the pool's memory; the pool's memory returns
    only once both graphs and every output the program holds are gone."""
    use_sim(monkeypatch, kind)
    d = _other()
    accel.set_device_index(0)
    base = _baseline()
    n = 1 << 14
    xs = np.arange(n, dtype=np.float32)
    handle = accel.graphs.graph_pool_handle()
    s = accel.Stream(d)
    x = accel.Buffer(4 * n, device=d)
    w = accel.Buffer(4 * n, device=d)
    fwd, bwd = accel.Graph(), accel.Graph()
    with accel.graph(fwd, pool=handle, stream=s):
        act = accel.Buffer(4 * n)               # the forward's output, held by the program
        act.copy_from(x)
        scratch = accel.Buffer(8 * n)
        scratch.fill_(0)
        del scratch
    with accel.graph(bwd, pool=handle, stream=s):
        grad = accel.Buffer(4 * n)
        grad.copy_from(act)
        w.copy_from(grad)
    assert fwd.pool() == bwd.pool() == handle
    assert act.device_index == grad.device_index == d
    for i in range(4):
        x.copy_from(xs + i)
        with accel.device_index(d):
            fwd.replay()
            bwd.replay()
        assert (w.to_numpy(np.float32) == xs + i).all(), i
        assert accel.current_device_index() == 0
    held = accel.memory.memory_allocated(d)
    del fwd
    gc.collect()
    for i in range(3):
        act.copy_from(xs * 2 + i)               # the static input, now written by the program
        with accel.device_index(d):
            bwd.replay()
        assert (w.to_numpy(np.float32) == xs * 2 + i).all(), i
    # only the forward graph's own generator holders went (one pair per (state, graph), as torch
    # 2.13's CUDAGeneratorCaptureState): the shared pool's blocks stay for the backward
    assert held - 4096 <= accel.memory.memory_allocated(d) < held
    del bwd
    settle()
    if _native():
        # (backend:cudaMallocAsync counts the driver pool's used memory, as torch's
        # CudaMallocAsyncAllocator::getDeviceStats: graph allocations are the graph pool's)
        assert accel.memory.memory_allocated(d) == base[1][-1] + 4 * 4 * n   # x, w, act, grad
    del act, grad
    settle()
    assert accel.memory.memory_allocated(d) == base[1][-1] + 2 * 4 * n
    del x, w, s
    _check_back(base)


# -- 8. pinned blocks freed while their copies are queued, then empty_host_cache -----------------
@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_pinned_arrays_dropped_with_copies_queued_then_host_cache_emptied(monkeypatch, kind):
    """torch's CachingHostAllocator records an event on the stream of every non_blocking copy
    of a pinned block and reuses or frees the block only once it completed.  A program drops
    the pinned array right after queueing its upload (and a download into another), calls
    ``empty_host_cache()`` at once and fills a new pinned array of the same size: the queued
    copies still read and write the old memory, never the new array's."""
    use_sim(monkeypatch, kind)
    d = _other()
    accel.set_device_index(0)
    base = _baseline()
    n = 1 << 18
    buf = accel.Buffer(4 * n, device=d)
    s = accel.Stream(d)
    with _slow(20000):
        up = accel.empty_pinned((n,), np.float32)
        up[:] = 1
        buf.copy_from(up, stream=s, non_blocking=True)
        del up
        gc.collect()
        accel.memory.empty_host_cache()
        fresh = accel.empty_pinned((n,), np.float32)
        fresh[:] = 9
        buf2 = accel.Buffer(4 * n, device=d, stream=s)
        buf2.fill_(3, stream=s)
        down = accel.empty_pinned((4 * n,), np.uint8)
        buf2.copy_to(down, stream=s, non_blocking=True)
        done = s.record_event()
        del down
        gc.collect()
        accel.memory.empty_host_cache()
        fresh2 = accel.empty_pinned((4 * n,), np.uint8)
        fresh2[:] = 0
    done.synchronize()
    assert (buf.to_numpy(np.float32, stream=s) == 1).all()
    assert (fresh == 9).all() and (fresh2 == 0).all()
    del fresh, fresh2, buf, buf2, done, s
    _check_back(base)
    hs = accel.memory.host_memory_stats()
    assert hs["allocated_bytes.current"] == 0 and hs["allocations.current"] == 0


# -- 9. another thread's eager draws and memory queries during a capture -------------------------
@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_other_thread_queries_allocates_and_draws_during_a_capture(monkeypatch, kind, mode):
    """While the main thread captures on device 1, a second thread reads ``memory_snapshot()``
    and ``memory_summary(1)``, resets device 1's peaks, changes its memory fraction, allocates
    and fills on device 0 and on its own stream of device 1.  None of these may be a
    "potentially unsafe" call for CUDA's global mode (cuStreamBeginCapture's
    CU_STREAM_CAPTURE_MODE_GLOBAL: "if any other thread has a concurrent capture sequence
    initiated with CU_STREAM_CAPTURE_MODE_GLOBAL, this thread is prohibited from potentially
    unsafe API calls", e.g. cudaMalloc, per cudaThreadExchangeStreamCaptureMode); with ``thread_local``
    mode it also draws eagerly from device 1's default generator (torch: an eager draw outside
    the capture advances the real offset; the capture's draws are replayed after it).  The
    capture succeeds, the replay equals an eager draw made second from the same seed, and
    ``empty_cache`` from the other thread is refused with a CaptureError naming capture_end (as
    torch's allocator asserts no capture is underway before it synchronizes)."""
    use_sim(monkeypatch, kind)
    d = _other()
    accel.set_device_index(0)
    base = _baseline()
    n = 4096
    x = accel.Buffer(4 * n, device=d).copy_from(np.arange(n, dtype=np.float32))
    out = accel.Buffer(4 * n, device=d)
    side = accel.Stream(d)
    with accel.device_index(d):
        accel.random.manual_seed(5)
    started, done = threading.Event(), threading.Event()
    res = {}

    def other():
        started.wait(JOIN_S)
        try:
            with pytest.raises(accel.CaptureError, match="capture_end"):
                accel.memory.empty_cache()
            res["snap"] = len(accel.memory.memory_snapshot())
            res["summary"] = accel.memory.memory_summary(d)
            accel.memory.reset_peak_memory_stats(d)
            accel.memory.set_per_process_memory_fraction(0.9, d)
            b = accel.Buffer(1 << 20, device=0)
            b.fill_(1)
            del b
            with accel.device_index(d):
                st = accel.Stream()
                with st:
                    b = accel.Buffer(1 << 20)
                    b.fill_(2)
                    del b
                    if mode == "thread_local" and kind == "cuda":
                        e = accel.Buffer(4 * n)
                        accel.random.uniform_(e)
                        res["eager"] = e.to_numpy(np.float32)
                        del e
        except BaseException as exc:
            res["err"] = exc
        finally:
            done.set()

    t = threading.Thread(target=other, name="r82b-other")
    t.start()
    g = accel.Graph()
    try:
        with accel.graph(g, stream=side, capture_error_mode=mode):
            y = accel.Buffer(4 * n)
            y.copy_from(x)
            if kind == "cuda":
                accel.random.uniform_(out)
            started.set()
            assert done.wait(JOIN_S)
            z = accel.Buffer(4 * n)
            z.copy_from(y)
    finally:
        started.set()
        _join([t])
    assert "err" not in res, res.get("err")
    assert "memory summary" in res["summary"]
    g.replay()
    assert (z.to_numpy(np.float32) == np.arange(n, dtype=np.float32)).all()
    if kind == "cuda":
        with accel.device_index(d):
            accel.random.manual_seed(5)
            e1, e2 = accel.Buffer(4 * n), accel.Buffer(4 * n)
            accel.random.uniform_(e1)
            accel.random.uniform_(e2)
        if "eager" in res:
            assert (res["eager"] == e1.to_numpy(np.float32)).all()
            assert (out.to_numpy(np.float32) == e2.to_numpy(np.float32)).all()
        else:
            assert (out.to_numpy(np.float32) == e1.to_numpy(np.float32)).all()
        del e1, e2
    accel.memory.set_per_process_memory_fraction(1.0, d)
    del g, y, z, x, out, side
    res.clear()
    _check_back(base)


# -- 10. four kinds of work at once on the non-current device --------------------------------------
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_replays_allocations_snapshots_and_dlpack_threads_at_once(monkeypatch, kind):
    """One thread replays a captured step on device 1 and checks its output every time; one
    allocates, fills and frees on its own stream of device 1 (some blocks handed to the replay
    thread's stream with ``record_stream``); one reads ``memory_snapshot()``, ``memory_stats(1)``
    and ``memory_summary(1)``; one exports views of device 1 through DLPack (``accel.from_dlpack``
    zero copy, ``numpy.from_dlpack`` host copies).  No thread fails or hangs, every check holds,
    and when all is dropped every counter is back at its start."""
    use_sim(monkeypatch, kind)
    d = _other()
    accel.set_device_index(0)
    base = _baseline()
    n = 2048
    src = accel.Buffer(4 * n, device=d).copy_from(np.arange(n, dtype=np.float32))
    out = accel.Buffer(4 * n, device=d)
    cap = accel.Stream(d)
    g = accel.Graph()
    with accel.graph(g, stream=cap):
        t1 = accel.Buffer(4 * n)
        t1.copy_from(src)
        t2 = accel.Buffer(4 * n)
        t2.copy_from(t1)
        out.copy_from(t2)
        del t1, t2
    stop = threading.Event()
    errors, counts = [], {"replay": 0, "alloc": 0, "snap": 0, "dlpack": 0}
    replay_stream = accel.Stream(d)

    def guarded(name, body):
        def run():
            try:
                while not stop.is_set():
                    body()
                    counts[name] += 1
                    if counts[name] >= 60:
                        break
            except BaseException as exc:
                errors.append((name, exc))
                stop.set()
        return threading.Thread(target=run, name=f"r82b-{name}", daemon=True)

    want = np.arange(n, dtype=np.float32)

    def replay():
        with replay_stream:
            g.replay()
            assert (out.to_numpy(np.float32) == want).all()

    alloc_stream = accel.Stream(d)

    def alloc():
        with alloc_stream:
            bs = [accel.Buffer(4096 * (i + 1)) for i in range(5)]
            for i, b in enumerate(bs):
                b.fill_(i + 1)
            bs[0].record_stream(replay_stream)
            assert bs[4].to_numpy()[-1] == 5
            del bs

    def snap():
        segs = accel.memory.memory_snapshot()
        st = accel.memory.memory_stats(d)
        assert st["allocated_bytes.all.current"] <= st["reserved_bytes.all.current"]
        assert all(seg["device"] in _devices() for seg in segs)
        assert "memory summary" in accel.memory.memory_summary(d)

    def dlpack():
        b = accel.Buffer(4 * 64, device=d)
        b.copy_from(np.full(64, 3, np.float32))
        view = b.as_array(np.float32, (8, 8))
        alias = accel.from_dlpack(view)
        assert alias.ptr == b.ptr
        host = np.from_dlpack(view, device="cpu")
        assert (host == 3).all()
        del alias, view, b

    threads = [guarded("replay", replay), guarded("alloc", alloc), guarded("snap", snap),
               guarded("dlpack", dlpack)]
    for t in threads:
        t.start()
    _join(threads)
    stop.set()
    assert not errors, errors
    assert all(v > 0 for v in counts.values()), counts
    assert accel.current_device_index() == 0
    del src, cap
    g = out = replay_stream = alloc_stream = None      # (names the closures above read)
    check_stat_invariants(d, "after threads")
    _check_back(base)



# -- 11. the error a ported DLPack consumer gets for a bad ``stream`` ------------------------------
@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_dlpack_stream_type_error_names_what_this_backend_takes(monkeypatch, kind):
    """What passes: an accel.Stream on every backend; on CUDA also the DLPack integers (1, 2, a
    cudaStream_t); -1 and None everywhere.  A stream of the wrong type (a float, a string)
    must be refused with a message naming what *this* backend takes."""
    use_sim(monkeypatch, kind)
    d = _other()
    b = accel.Buffer(256, device=d)
    view = b.as_array(np.uint8, (256,))
    s = accel.Stream(d)
    for ok in (None, -1, s) + ((1, 2, s.handle) if kind == "cuda" else ()):
        del_cap = view.__dlpack__(stream=ok, max_version=(1, 0))
        del del_cap
    if kind != "cuda":
        with pytest.raises(ValueError, match="accel.Stream"):
            view.__dlpack__(stream=5)
    del view, b, s


# r82b, fixed in session 40: accel._dlpack.ordering._consumer_handle: the TypeError for a stream
# of a wrong type says 'None, -1 or a stream handle (int)' on every backend: it omits accel.Stream
# (accepted everywhere) and offers an int where xpu/mps refuse any int but -1
@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_dlpack_stream_type_error_message_matches_the_backend(monkeypatch, kind):
    """The array API standard's ``__dlpack__(stream=...)``: "For CUDA and ROCm, a Python integer
    representing a pointer to a stream ... For other device types which do have a stream, queue,
    or similar synchronization/ordering mechanism, the most appropriate type to use for stream
    is not yet determined" -- accel takes an accel.Stream there, and says so in the ValueError
    for an int; the TypeError for a float should say the same."""
    use_sim(monkeypatch, kind)
    b = accel.Buffer(256, device=_other())
    view = b.as_array(np.uint8, (256,))
    with pytest.raises(TypeError) as info:
        view.__dlpack__(stream=1.5)
    text = str(info.value)
    assert "accel.Stream" in text
    if kind != "cuda":
        assert "(int)" not in text


# -- 12. host copies asked with dl_device=(kDLCPU, 0) are ordered whatever the stream says -------
@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_host_copy_dlpack_waits_for_queued_work_even_with_stream_minus_one(monkeypatch, kind):
    """The array API standard on ``__dlpack__``: "When ``dl_device`` is provided explicitly,
    ``stream`` must be a valid construct for the specified device type. In particular, when
    ``kDLCPU`` is in use, ``stream`` must be ``None`` and a synchronization must be performed to
    ensure data safety."  A consumer wrapping the view (as a library adapter does) that passes
    ``stream=-1`` with a host ``dl_device`` still gets the queued fill; a device stream with a
    host ``dl_device`` is refused with a ValueError that says what to pass."""
    use_sim(monkeypatch, kind)
    d = _other()
    accel.set_device_index(0)
    base = _baseline()
    n = 1 << 16
    s = accel.Stream(d)
    b = accel.Buffer(n, device=d, stream=s)
    b.fill_(0, stream=s)
    s.synchronize()
    view = b.as_array(np.uint8, (n,))

    class Adapter:
        def __init__(self, stream):
            self.stream = stream

        def __dlpack_device__(self):
            return view.__dlpack_device__()

        def __dlpack__(self, **kw):
            kw["stream"] = self.stream
            return view.__dlpack__(**kw)

    with _slow(30000):
        b.fill_(7, stream=s)
        host = np.from_dlpack(Adapter(-1), device="cpu")
    assert (host == 7).all()
    for bad in (s, 1):
        with pytest.raises(ValueError, match="pass None or -1"):
            np.from_dlpack(Adapter(bad), device="cpu")
    s.synchronize()
    del host, b, s
    view = None      # (names the closures above read)
    _check_back(base)


def test_generator_of_another_device_eager_ok_capture_refused(sim_cuda):
    """torch checks only a generator's device *type* for a draw (``check_generator``): an eager
    draw into a device-0 buffer from device 1's generator gives that generator's numbers and
    advances it.  A capture on device 0 drawing from it is refused clearly (its replays would
    read the state from device 1's memory), with nothing left captured."""
    accel.set_device_index(0)
    base = _baseline()
    g1 = accel.random.Generator(device=1, seed=3)
    b0 = accel.Buffer(4096, device=0)
    accel.random.uniform_(b0, generator=g1)
    assert g1.get_offset() > 0
    ref = accel.Buffer(4096, device=1)
    accel.random.uniform_(ref, generator=accel.random.Generator(device=1, seed=3))
    assert (b0.to_numpy(np.float32) == ref.to_numpy(np.float32)).all()
    off = g1.get_offset()
    g = accel.Graph()
    s = accel.Stream(0)
    with pytest.raises(ValueError, match="generator of device 1"):
        with accel.graph(g, stream=s):
            accel.random.uniform_(b0, generator=g1)
    assert g1.get_offset() == off
    assert not accel.is_current_stream_capturing() and not s.is_capturing()
    accel.random.uniform_(b0, generator=g1)              # still usable eagerly
    del g, s, b0, ref, g1
    _check_back(base)


# -- 13. a double-buffered upload pipeline per device, both devices at once ----------------------
@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_double_buffered_uploads_two_streams_per_device_in_two_threads(monkeypatch, kind):
    """One thread per device (device 0's thread leaves device 0 current, device 1's switches
    nothing but passes device and streams explicitly): two pinned staging arrays reused in turn,
    each upload on a copy stream, the compute stream waits on the upload's event, reduces the
    batch into an accumulator (a device-to-device copy then a download of a few words), and the
    staging array is rewritten only after its upload event completed.  The allocation for each
    batch is made on the copy stream and handed to the compute stream with ``record_stream``.
    The sums equal numpy's; the host and device allocators return to their baselines."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    base = _baseline()
    host_base = accel.memory.host_memory_stats()["allocated_bytes.current"]
    n, batches = 4096, 12
    results, errors = {}, []

    def pipeline(d):
        try:
            copy_s, comp_s = accel.Stream(d), accel.Stream(d)
            staging = [accel.empty_pinned((n,), np.float32) for _ in range(2)]
            uploaded = [None, None]
            acc = accel.Buffer(4 * n, device=d, stream=comp_s)
            acc.fill_(0, stream=comp_s)
            got = []
            for i in range(batches):
                k = i % 2
                if uploaded[k] is not None:
                    uploaded[k].synchronize()            # its last upload finished: reuse it
                staging[k][:] = np.float32(i + d)
                dev = accel.Buffer(4 * n, device=d, stream=copy_s)
                dev.copy_from(staging[k], stream=copy_s, non_blocking=True)
                uploaded[k] = copy_s.record_event()
                comp_s.wait_event(uploaded[k])
                dev.record_stream(comp_s)
                acc.copy_from(dev, stream=comp_s, non_blocking=True)
                head, ev = acc.to_numpy(np.float32, (n,), stream=comp_s, non_blocking=True)
                ev.synchronize()
                got.append(float(head[0]) + float(head[-1]))
                del dev
            comp_s.synchronize()
            copy_s.synchronize()
            results[d] = got
            assert accel.current_device_index() == 0
        except BaseException as exc:
            errors.append((d, exc))

    threads = [threading.Thread(target=pipeline, args=(d,), name=f"r82b-pipe{d}") for d in _devices()]
    for t in threads:
        t.start()
    _join(threads)
    assert not errors, errors
    for d in _devices():
        assert results[d] == [2.0 * (i + d) for i in range(batches)], d
    _check_back(base)
    assert accel.memory.host_memory_stats()["allocated_bytes.current"] == host_base


# -- 14. the whole mix in a loop: accel's tables stay flat ------------------------------------------
@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_mixed_program_repeated_keeps_accel_tables_flat(monkeypatch, kind):
    """One iteration of a service's step on the last device, every feature at once: a
    registered generator drawn in a captured graph (CUDA; Level Zero and Metal draw eagerly),
    replayed and reset; a MemPool used through ``use_mem_pool``; an OOM under a lowered
    fraction seen by an observer, then ``empty_cache`` and a retry; pinned uploads and a
    non-blocking download gated by an event; a DLPack import of a view and a host copy.
    Run again and again, nothing accel keeps grows (simulator objects, accel's tables and live
    objects), as r66b's ``_run_twice`` checks."""
    from test_user_programs_r66b import _run_twice
    use_sim(monkeypatch, kind)
    d = _other()
    accel.set_device_index(0)
    n = 2048
    seen = []

    def observer(*args):
        seen.append(args[0])

    def program(step):
        s = accel.Stream(d)
        gen = accel.random.Generator(device=d, seed=step)
        out = accel.Buffer(4 * n, device=d)
        if kind == "cuda":
            g = accel.Graph()
            g.register_generator_state(gen)
            with accel.graph(g, stream=s):
                tmp = accel.Buffer(4 * n)
                accel.random.uniform_(tmp, generator=gen)
                out.copy_from(tmp)
                del tmp
            with accel.device_index(d):
                g.replay()
                g.replay()
            g.reset()
            del g
        else:
            accel.random.uniform_(out, generator=gen)
        with accel.device_index(d):
            pool = accel.MemPool()
        with accel.use_mem_pool(pool, device=d):
            pb = accel.Buffer(1 << 20, device=d)
            pb.fill_(5)                      # (Level Zero caches one fill pattern per byte value)
        assert pb.to_numpy()[0] == 5
        del pb, pool
        accel.memory.set_per_process_memory_fraction(0.01, d)
        with pytest.raises(accel.OutOfMemoryError):
            accel.Buffer(256 << 20, device=d)
        accel.memory.set_per_process_memory_fraction(1.0, d)
        accel.memory.empty_cache()
        big = accel.Buffer(256 << 20, device=d, stream=s)
        up = accel.empty_pinned((n,), np.float32)
        up[:] = step
        out.copy_from(up, stream=s, non_blocking=True)
        down, ev = out.to_numpy(np.float32, stream=s, non_blocking=True)
        ev.synchronize()
        assert (down == step).all()
        view = out.as_array(np.float32, (n,))
        alias = accel.from_dlpack(view)
        host = np.from_dlpack(view, device="cpu")
        assert (host == step).all() and alias.ptr == out.ptr
        del alias, view, host, down, ev, up, big, out, gen, s

    accel.memory.attach_out_of_memory_observer(observer)
    try:
        _run_twice(program)
    finally:
        accel.memory.detach_out_of_memory_observer(observer)
    assert seen and set(seen) == {d}


# -- 15. pageable host copies and device memory info on the non-current device -------------------
@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_pageable_non_blocking_copies_and_memory_info_of_other_device(monkeypatch, kind):
    """CUDA Runtime API reference, "API synchronization behavior", Asynchronous: "For transfers
    from device memory to pageable host memory, the function will return only once the copy has
    completed", and "If pageable memory must first be staged to pinned memory, the driver may
    synchronize with the stream and stage the copy into pinned memory" (torch documents
    ``non_blocking`` as "may occur asynchronously").  So a torch user's ``.to("cpu",
    non_blocking=True)`` into pageable memory reads complete data at once, and a pageable source
    may be reused right after the call (accel's docstring: "A pageable destination is copied
    blocking, as torch does").  ``get_memory_info(d)`` (``torch.cuda.mem_get_info``) asked with
    device 0 current reports device d: its free memory falls by what device d reserved and
    comes back at ``empty_cache``; device 0's does not move."""
    use_sim(monkeypatch, kind)
    d = _other()
    accel.set_device_index(0)
    base = _baseline()
    n = 1 << 20
    s = accel.Stream(d)
    b = accel.Buffer(n, device=d, stream=s)
    b.fill_(0, stream=s)
    s.synchronize()
    with _slow(30000):
        b.fill_(4, stream=s)
        out = np.zeros(n, np.uint8)
        b.copy_to(out, stream=s, non_blocking=True)
        assert (out == 4).all()
        b.fill_(1, stream=s)
        src = np.full(n, 8, np.uint8)
        b.copy_from(src, stream=s, non_blocking=True)
        src[:] = 9                                   # reused at once: the copy took its bytes
    assert (b.to_numpy(stream=s) == 8).all()
    del b
    settle()
    free0 = [accel.get_memory_info(i)[0] for i in _devices()]
    big = accel.Buffer(512 << 20, device=d)
    free1 = [accel.get_memory_info(i)[0] for i in _devices()]
    assert free0[d] - free1[d] >= 512 << 20
    if d != 0:
        assert free1[0] == free0[0]
    del big
    settle()
    assert [accel.get_memory_info(i)[0] for i in _devices()] == free0
    del s
    _check_back(base)
