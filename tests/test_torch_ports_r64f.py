"""Round r64f: tests PyTorch added to its test files after the copies the earlier ports read,
ported to accel (the runtime surface only: streams, events, graphs, caching allocator, MemPool,
allocator settings, host allocator, RNG state, device queries, lazy init).

Copies read (the newest stored ones; tests/TORCH_PORTS_r64f.md names every test considered):
test/test_cuda.py amolagrawalmeta/pytorch@593047a2 (527 kB, a torch-main copy newer than 2.13),
test_cuda_multigpu.py BakeLab/pytorch@698d5ea3, test_xpu.py BakeLab/pytorch@0eee0536,
test_accelerator.py pytorch/pytorch@006a1148, test_cuda_primary_ctx.py cyyever/pytorch@2ea36a1d,
the OpenReg tests torch_openreg/tests/test_memory.py Khanaksahu/pytorch@5d4abc0f and
licy666/pytorch@fe52e5d4, test_streams.py licy666/pytorch@c27e55ba.

Conventions as tests/TORCH_PORTS.md: a float tensor of n elements is ``accel.Buffer(4 * n)``,
``torch.randn`` an ``accel.random.normal_`` fill, an op between tensors a device-to-device copy,
pinned tensors ``accel.empty_pinned`` arrays, ``torch.cuda._sleep`` / torch's spin-wait kernel
``torch_port_util.hold`` (a gate on the simulated stream: nothing depends on timing).  Test names
are ``test_<torch file>__<torch test>``.  A torch 2.13 feature accel lacks is a strict xfail
whose reason starts with "r64f:"; features newer than torch 2.13 (checked against the installed
torch 2.13.0) are listed in TORCH_PORTS_r64f.md, not ported.
"""

import contextlib
import gc
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

import accel
import accel.random as R
from accel import Buffer, Graph, MemPool, memory, use_mem_pool

from conftest import use_sim
from torch_port_util import hold

MiB = 1 << 20



def _pinned(array) -> bool:
    return bool(memory.host_allocator().owns(array.ctypes.data, max(array.nbytes, 1)))


def _need_two():
    if accel.device_count() < 2:
        pytest.skip(f"{accel.current_accelerator().type} has one device")


def _clone(src: Buffer, stream=None) -> Buffer:
    """``src.clone()`` (also inside a capture): a new Buffer copied in stream order."""
    out = Buffer(src.nbytes, stream=stream)
    out.copy_from(src, stream=stream, non_blocking=True)
    return out


def _active() -> int:
    return memory.memory_stats().get("active.all.current", 0)    # {} before the allocator exists


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(accel.__file__)),
                                                     os.environ.get("PYTHONPATH")) if p)
    return env


def _run_script(script: str, sim: str = "cuda", timeout: float = 60.0, **extra) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=timeout, env=_env(ACCEL_SIM=sim, **extra))
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"subprocess did not finish within {timeout}s (a deadlock?): {exc.cmd!r}")


# ============================================================ test_cuda.py TestCuda: host allocator
def test_cuda__test_host_memory_stats_active_after_free_no_events(sim_backend):
    """A pinned block freed with no copy ever using it goes straight back to the cache: the
    active counters drop to zero on every pin-and-drop cycle (the first cycle makes a new
    block, the second reuses the cached one)."""
    accel.current_device_index()                       # torch.cuda.init(): the stat keys exist
    gc.collect()
    memory.empty_host_cache()
    memory.reset_peak_host_memory_stats()
    memory.reset_accumulated_host_memory_stats()
    for _ in range(2):
        t = accel.empty_pinned(1024 * 1024, np.float32)
        assert _pinned(t)
        del t
        gc.collect()
        stats = memory.host_memory_stats()
        assert stats["active_bytes.current"] == 0
        assert stats["active_requests.current"] == 0


@pytest.mark.parametrize("free_before_sync", [False, True], ids=["synced", "copy_pending"])
def test_cuda__test_host_memory_stats_active_after_event_drain(monkeypatch, free_before_sync):
    """A pinned block used by a non-blocking copy to the device waits for the copy's event;
    empty_host_cache drains the events: active_bytes/active_requests end at 0 and the freed
    counters never go negative.  ``copy_pending``: the array is dropped while the copy is still
    queued (a held stream): its block is not handed out again meanwhile; the drain happens
    after synchronize."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=20)
    accel.current_device_index()
    gc.collect()
    memory.empty_host_cache()
    memory.reset_peak_host_memory_stats()
    memory.reset_accumulated_host_memory_stats()
    for _ in range(2):
        t = accel.empty_pinned(1024 * 1024, np.float32)
        d = Buffer(t.nbytes)
        if free_before_sync:
            gate = hold(accel.current_stream())
            d.copy_from(t, non_blocking=True)
            ptr = t.ctypes.data
            del t
            gc.collect()
            # accel counts a block active from malloc to free (documented in HostCachingAllocator
            # .torch_stats; torch: until its stream uses complete), but never hands it out again
            # while the copy may still read it
            assert memory.host_memory_stats()["active_requests.current"] == 0
            other = accel.empty_pinned(1024 * 1024, np.float32)
            assert other.ctypes.data != ptr
            del other
            gate.set()
        else:
            d.copy_from(t, non_blocking=True)
        accel.synchronize()
        if not free_before_sync:
            del t
        gc.collect()
        memory.empty_host_cache()
        stats = memory.host_memory_stats()
        assert stats["active_bytes.current"] == 0
        assert stats["active_requests.current"] == 0
        assert stats["active_bytes.freed"] >= 0
        assert stats["active_requests.freed"] >= 0
        del d


def test_cuda__test_caching_allocator_alloc_negative_size(sim_backend):
    """torch.cuda.memory.caching_allocator_alloc(-1024) raises ValueError ("Invalid memory size");
    accel's raw allocation entry (memory.device_allocator(i).malloc) and Buffer refuse it as
    ValueError too (accel's wording: "... must not be negative")."""
    with pytest.raises(ValueError):
        memory.device_allocator(0).malloc(-1024)
    with pytest.raises(ValueError):
        Buffer(-1024)


# ============================================================ test_cuda.py TestCuda: lazy init
def test_cuda__test_lazy_call_reentrant_set_rng_state_does_not_deadlock():
    """A _lazy_call made after init runs at once; one whose function itself takes the lazy-init
    path (set_rng_state) must not deadlock on a non-reentrant lock (run in a child process: a
    regression hangs, the timeout fails the test)."""
    script = ("import accel, accel.random as R; from accel import _lazy; "
              "_lazy.lazy_init(); state = R.get_rng_state(); "
              "_lazy.lazy_call(lambda: R.set_rng_state(state)); print('done')")
    proc = _run_script(script)
    assert proc.returncode == 0, proc.stderr
    assert "done" in proc.stdout


def test_cuda__test_lazy_call_reentrant_queued_does_not_deadlock():
    """A queued call that itself calls _lazy_call (manual_seed) while init drains the queue with
    the init lock held must not deadlock, and its seed lands."""
    script = ("import accel, accel.random as R; from accel import _lazy; "
              "_lazy.lazy_call(lambda: R.manual_seed(42)); _lazy.lazy_init(); "
              "print('done', R.initial_seed())")
    proc = _run_script(script)
    assert proc.returncode == 0, proc.stderr
    assert "done 42" in proc.stdout


# ============================================================ test_cuda.py TestCuda: streams, events
def test_cuda__test_stream_invalid_device_index(sim_backend):
    """A stream rebuilt from (stream_id, device_index, device_type) with an index no device has
    is refused with a RuntimeError naming the index, never looked up out of range (torch:
    "Device index must be ..."/"Device index value ..."; accel: "device index N is out of range")."""
    n = accel.device_count()
    device_type = accel.current_stream().device_type
    for di in (-2, -8, n, n + 16, 128):
        with pytest.raises(RuntimeError, match=r"(?i)device index"):
            s = accel.Stream(stream_id=3, device_index=di, device_type=device_type)
            _ = s.handle


def test_cuda__test_external_stream_wraps_null_handle(sim_cuda):
    """ExternalStream(0) wraps the NULL stream (handle 0), not a pooled stream, exactly as
    get_stream_from_external(0) and the device's default stream; devices 0 and 1."""
    for device in (accel.current_device_index(), 1):
        external_stream = accel.ExternalStream(0, device=device)
        from_external = accel.get_stream_from_external(0, device)
        default = accel.default_stream(device)
        assert external_stream.handle == 0
        assert from_external.handle == 0
        assert external_stream.handle == default.handle
        assert external_stream.device == from_external.device == default.device


def test_cuda__test_stream_event_compatibility(sim_backend):
    """torch.cuda.Stream/Event and torch.Stream/Event interoperate through torch.accelerator
    (torch skips its CUDA copy, "Fails with Triton 3.7"; test_xpu.py runs the same body).  accel
    has one Stream and one Event type, so torch's "expected other to be a torch.cuda.Event"
    mismatches cannot arise; what remains: set_stream/current_stream agree on stream_id and
    native_handle, an out-of-range index is refused, timing events recorded on a stream made
    current by ``with``, and a non-stream passed to record/wait is refused."""
    s1, s2 = accel.Stream(), accel.Stream()
    for s in (s1, s2):
        accel.set_stream(s)
        assert accel.current_stream().stream_id == s.stream_id
        assert accel.current_stream().native_handle == s.handle
        assert accel.current_stream().native_handle == s.native_handle
    with pytest.raises(RuntimeError, match=r"Device index value .* is out of index range"):
        accel.current_stream(accel.device_count())
    e1 = accel.Event(enable_timing=True)
    e2 = accel.Event(enable_timing=True)
    e3 = accel.Event(enable_timing=True)
    s3 = accel.Stream()
    with s3:
        assert accel.current_stream() == s3
        e1.record(s3)
        a = Buffer(4000).copy_from(np.ones(1000, np.float32))
        del a
        e2.record(s3)
        e2.synchronize()
        assert e1.elapsed_time(e2) >= 0
        e3.record(s3)
    e3.synchronize()
    assert e1.elapsed_time(e3) >= 0                   # one Event type: torch's mismatch errors cannot arise
    with pytest.raises((TypeError, RuntimeError)):
        e2.record(e2)
    with pytest.raises((TypeError, RuntimeError)):
        e2.wait(e2)
    with pytest.raises((TypeError, RuntimeError)):
        s3.record_event(s3)


def test_cuda__test_event_elapsed_time_restores_device_on_error(sim_backend):
    """A cross-device elapsed_time raises inside the region that switched to the event's
    device; the caller's current device is restored on that throwing path."""
    _need_two()
    accel.set_device_index(0)
    e0 = accel.Event(enable_timing=True)
    e1 = accel.Event(enable_timing=True)
    e0.record(accel.Stream(0))
    e1.record(accel.Stream(1))
    accel.synchronize(0)
    accel.synchronize(1)
    assert accel.current_device_index() == 0
    with pytest.raises(RuntimeError):
        e1.elapsed_time(e0)
    assert accel.current_device_index() == 0
    accel.set_device_index(1)
    with pytest.raises(RuntimeError):
        e0.elapsed_time(e1)
    assert accel.current_device_index() == 1


# ============================================================ test_cuda.py / test_xpu.py: generators
def test_cuda__test_accelerator_default_generator(sim_backend):
    """torch.cuda.default_generators[i] and torch._C._accelerator_getDefaultGenerator(i) are one
    generator (both accel.random.default_generator(i)): same device, same state, a seed set
    through one is the other's, and they stay in sync after seed().  Also test_xpu.py's test of
    the same name; every device."""
    accel.current_device_index()                       # torch.cuda.init()
    for index in range(accel.device_count()):
        cuda_default = R.default_generator(index)
        acc_default = R.default_generator(index)
        assert cuda_default is acc_default
        assert cuda_default.device == acc_default.device == accel.device(accel.current_accelerator().type, index)
        assert np.array_equal(cuda_default.get_state(), acc_default.get_state())
        cuda_default.manual_seed(42)
        assert acc_default.initial_seed() == 42
        cuda_default.seed()
        assert np.array_equal(cuda_default.get_state(), acc_default.get_state())
        assert R.initial_seed(index) == cuda_default.initial_seed()


# ============================================================ test_cuda.py TestCuda: graphs
def test_cuda__test_graph_rng_after_failed_capture(sim_cuda):
    """A capture invalidated by a synchronizing call fails at capture_end; the stream can then
    draw eagerly and capture an RNG fill again, the new graph replays fresh numbers, and nothing
    the failed capture allocated (its RNG holders included) stays live.  torch's ``(x + 1).item()``
    is a copy to pageable memory plus a synchronize; accel refuses the pageable copy before any
    runtime call (the capture goes on: accel/graphs/), so the port makes the synchronize itself."""
    accel.synchronize()
    gc.collect()
    memory.empty_cache()
    baseline = _active()

    stream = accel.Stream()
    graph = Graph()
    x = Buffer(4).fill_(1)
    with stream:
        graph.capture_begin()
        y = _clone(x, stream)                          # x + 1
        with pytest.raises(RuntimeError):
            stream.synchronize()                       # .item(): its synchronize of the capturing stream
        with pytest.raises(RuntimeError):
            graph.capture_end()
    accel.current_stream().wait_stream(stream)

    result = R.normal_(Buffer(16))                     # torch.randn(4) works after the failure
    assert result.nbytes == 16

    new_graph = Graph()
    buf = Buffer(16)
    with stream:
        new_graph.capture_begin()
        tmp = Buffer(16)
        R.normal_(tmp)                                 # buf.copy_(torch.randn_like(buf))
        buf.copy_from(tmp, non_blocking=True)
        new_graph.capture_end()
    accel.current_stream().wait_stream(stream)
    buf.fill_(0)
    new_graph.replay()
    accel.synchronize()
    assert buf.to_numpy().any()

    del graph, new_graph, buf, x, y, result, tmp
    accel.synchronize()
    gc.collect()
    memory.empty_cache()
    assert _active() == baseline, "leaked allocations after the failed capture"


def test_cuda__test_graph_capture_error_releases_reserved_segments(sim_graph_backend):
    """A failed capture (capture_end raises) still releases the graph's private pool at reset():
    memory_reserved() returns to where it was (a leaked pool can show no active bytes and
    still hold reserved segments)."""
    accel.synchronize()
    memory.empty_cache()
    reserved_before = memory.memory_reserved()
    s = accel.Stream()
    s.wait_stream(accel.current_stream())
    g = Graph()
    with s:
        g.capture_begin()
        x = Buffer(32 * MiB)                           # torch.empty(8M floats) in the graph's pool
        with pytest.raises(RuntimeError):
            accel.synchronize()                        # a synchronizing call invalidates the capture
        with pytest.raises(RuntimeError):
            g.capture_end()
    del x
    g.reset()
    del g
    accel.synchronize()
    memory.empty_cache()
    assert memory.memory_reserved() == reserved_before





def test_cuda__test_graph_rng_concurrent_replay_on_different_streams(monkeypatch):
    """Two graphs drawing from one generator, replayed concurrently on two streams: each has its
    own (seed, offset) holders, so they draw what two eager draws after the same seed draw.
    Made deterministic: g0's launch is held on s0 after its replay prologue wrote its offset
    (torch's "in flight"), while g1's prologue and kernels run on s1."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=20)
    seed, nbytes = 1234, 4 * 64
    R.manual_seed(seed)
    ref0 = R.normal_(Buffer(nbytes)).to_numpy(np.float32)
    ref1 = R.normal_(Buffer(nbytes)).to_numpy(np.float32)

    R.manual_seed(seed)
    g0, g1 = Graph(), Graph()
    s_cap = accel.Stream()
    buf0, buf1 = Buffer(nbytes), Buffer(nbytes)
    for g, buf in ((g0, buf0), (g1, buf1)):
        with s_cap:
            g.capture_begin()
            tmp = Buffer(nbytes)
            R.normal_(tmp)                             # buf.copy_(torch.randn_like(buf))
            buf.copy_from(tmp, non_blocking=True)
            del tmp
            g.capture_end()
        accel.current_stream().wait_stream(s_cap)

    s0, s1 = accel.Stream(), accel.Stream()
    buf0.fill_(0)
    buf1.fill_(0)
    s0.wait_stream(accel.current_stream())
    s1.wait_stream(accel.current_stream())
    backend = accel._lazy.lazy_init()
    real_launch, gates = backend.graph_launch, []

    def launch(exec_handle, stream_handle):
        if stream_handle == s0.handle and not gates:
            gates.append(hold(s0))                     # g0's prologue is queued; its kernels wait
        return real_launch(exec_handle, stream_handle)

    monkeypatch.setattr(backend, "graph_launch", launch)
    try:
        with s0:
            g0.replay()
        with s1:
            g1.replay()
        s1.synchronize()
    finally:
        for gate in gates:
            gate.set()
        monkeypatch.setattr(backend, "graph_launch", real_launch)
    accel.synchronize()
    assert np.array_equal(buf1.to_numpy(np.float32), ref1)
    assert np.array_equal(buf0.to_numpy(np.float32), ref0)


def test_cuda__test_graph_rng_replay_record_stream(monkeypatch):
    """The graph's RNG (seed, offset) holders outlive reset() while a replay that reads them is
    still in flight (torch records them on the replay stream), and go back after it ends.
    torch counts small_pool blocks; accel's holders are blocks of its expandable segment's
    large pool (test_torch_graph_pools.py explains), so all pools are counted."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=20)
    accel.synchronize()
    gc.collect()
    memory.empty_cache()
    baseline = _active()

    s = accel.Stream()
    g = Graph()
    buf = Buffer(4 * 32)
    with s:
        g.capture_begin()
        R.uniform_(buf)
        g.capture_end()
    accel.current_stream().wait_stream(s)
    assert _active() - baseline == 3                   # buf + the two RNG holders

    buf.fill_(0)
    g.replay()                                         # reference replay
    accel.synchronize()
    assert buf.to_numpy().any()

    buf.fill_(0)
    s.wait_stream(accel.current_stream())
    gate = hold(s)                                     # torch's spin-wait kernel
    with s:
        g.replay()                                     # in flight behind the gate
    g.reset()
    del g, buf
    gc.collect()
    assert _active() - baseline >= 2, "the RNG holders must outlive reset() while a replay reads them"
    gate.set()
    accel.synchronize()
    gc.collect()
    memory.empty_cache()
    assert _active() == baseline, "RNG holders should be freed after sync + empty_cache"


# ============================================================ test_cuda.py TestCudaAllocator
def test_cuda__test_expandable_segments_empty_cache_wrong_device(monkeypatch):
    """empty_cache() called on a thread whose current device is 0 releases device 1's cached
    expandable pages only after device 1's queued work that uses them is done (it must wait on
    the segment's device, not the caller's).  The held stream stands in for torch's spin-wait
    kernel; the copy's result is intact afterwards."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=20, ACCEL_ALLOC_CONF="expandable_segments:True")
    accel.synchronize(0)
    with accel.device_index(1):
        src = Buffer(48 * MiB).fill_(1)
        gate = hold(accel.current_stream())
        dst = Buffer(48 * MiB)
        dst.copy_from(src, non_blocking=True)
        out = np.empty(48 * MiB, np.uint8)
        check = Buffer(48 * MiB)
        check.copy_from(dst, non_blocking=True)
        del dst                                        # cached, its last use still queued
    started, done, errors = threading.Event(), threading.Event(), []

    def empty_cache_from_device_zero():
        try:
            with accel.device_index(0):
                started.set()
                memory.empty_cache()
        except BaseException as exc:                   # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=empty_cache_from_device_zero, daemon=True)
    thread.start()
    try:
        assert started.wait(10)
        completed_before_release = done.wait(0.3)
    finally:
        gate.set()
        thread.join(30)
    assert not thread.is_alive()
    if errors:
        raise errors[0]
    accel.synchronize(1)
    assert not completed_before_release, "empty_cache() did not wait for work on the segment's device"
    check.copy_to(out)
    assert (out == 1).all()



def test_cuda__test_allocation_traceback(sim_cuda):
    def this_is_a_funky_allocator():
        return R.uniform_(Buffer(4 * 311 * 411))

    try:
        memory.empty_cache()
        memory._record_memory_history("all", stacks="python")
        x = this_is_a_funky_allocator()
        frames = memory._allocation_traceback(x.ptr)
        assert isinstance(frames, list) and len(frames) > 0
        assert "this_is_a_funky_allocator" in [f["name"] for f in frames]
        ptr = x.ptr
        del x
        memory.empty_cache()
        assert memory._allocation_traceback(ptr) is None
    finally:
        memory._record_memory_history(None)



def test_cuda__test_allocation_traceback_no_recording(sim_cuda):
    memory._record_memory_history(None)
    x = Buffer(4 * 64)
    assert memory._allocation_traceback(x.ptr) is None


# ============================================================ test_cuda_multigpu.py
def test_cuda_multigpu__test_graph_destroy_preserves_current_device(sim_graph_backend):
    """A graph captured and replayed on device 1 is destroyed (its last reference dropped) on a
    thread whose current device is 0: the destructor leaves the thread's current device alone."""
    accel.set_device_index(0)
    g = Graph()
    with accel.device_index(1):
        s = accel.Stream()
        a = Buffer(32).fill_(1)
        b = _clone(a)                                  # warm up before capture
        with accel.graph(g, stream=s):
            assert accel.current_device_index() == 1
            b = _clone(a, s)
        g.replay()
        accel.synchronize()
    assert accel.current_device_index() == 0
    del a, b, g, s
    gc.collect()
    assert accel.current_device_index() == 0


# ============================================================ test_cuda_primary_ctx.py
def test_cuda_primary_ctx__test_set_device_0(sim_cuda):
    """CUDA 12's cudaSetDevice creates the device's primary context eagerly, and so does
    set_device(0) (torch._C._cuda_hasPrimaryContext is the simulator's primary_contexts record)."""
    from accel import sim
    accel.device_count()
    assert not sim.state().runtime_initialized        # setUp: no context before the test
    accel.set_device_index(0)
    assert sim.state().primary_contexts[0]


# ============================================================ test_cuda.py TestCachingHostAllocatorConfig
@contextlib.contextmanager
def _pinned_limits(max_round_threshold_mb=None, max_cached_size_mb=None):
    """torch's caching_host_allocator_max_round_threshold_and_max_cached_size: set the pinned
    allocator's limits for the body, then put the defaults back (setUp/tearDown empty the
    host cache)."""
    import warnings
    parts = []
    if max_round_threshold_mb is not None:
        parts.append(f"pinned_max_round_threshold_mb:{max_round_threshold_mb}")
    if max_cached_size_mb is not None:
        parts.append(f"pinned_max_cached_size_mb:{max_cached_size_mb}")
    gc.collect()
    memory.empty_host_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                # accel warns that it ignores them
        memory.set_allocator_settings(",".join(parts))
    try:
        yield
    finally:
        memory.set_allocator_settings("")
        gc.collect()
        memory.empty_host_cache()


def test_cuda__test_max_round_threshold(sim_cuda):
    """A request above pinned_max_round_threshold_mb is not rounded up to a power of two."""
    size_bytes = 129 * MiB
    with _pinned_limits(128, None):
        t = accel.empty_pinned(size_bytes)
        allocated = memory.host_memory_stats()["allocated_bytes.current"]
        assert allocated >= size_bytes
        assert allocated < 256 * MiB
        del t


def test_cuda__test_max_cached_size(sim_cuda):
    """A freed block larger than pinned_max_cached_size_mb goes back to the OS, not the cache."""
    with _pinned_limits(None, 32):
        t = accel.empty_pinned(64 * MiB)
        del t
        gc.collect()
        assert memory.host_memory_stats()["allocations.current"] == 0


def test_cuda__test_both_thresholds(sim_cuda):
    with _pinned_limits(128, 256):
        t = accel.empty_pinned(150 * MiB)
        assert memory.host_memory_stats()["allocated_bytes.current"] < 256 * MiB
        del t
        gc.collect()
        assert memory.host_memory_stats()["allocations.current"] == 1     # cached: under 256 MiB


def test_cuda__test_round_threshold_larger_than_cached_size(sim_cuda):
    """Above the cache limit a request is neither rounded up nor cached."""
    with _pinned_limits(256, 64):
        t = accel.empty_pinned(100 * MiB)
        allocated = memory.host_memory_stats()["allocated_bytes.current"]
        assert allocated >= 100 * MiB
        assert allocated < 128 * MiB
        del t
        gc.collect()
        assert memory.host_memory_stats()["allocations.current"] == 0


def test_cuda__test_unrounded_bucket_no_undersized_reuse(sim_cuda):
    """Unrounded cached blocks share a size bucket; a larger request in the bucket is never
    handed a smaller cached block.  (accel rounds 150 MiB up to 256 MiB, so the 200 MiB request
    may take that block safely: only the threshold is missing.)"""
    with _pinned_limits(128, 1024):
        a = accel.empty_pinned(150 * MiB)
        small_ptr = a.ctypes.data
        del a
        gc.collect()
        b = accel.empty_pinned(200 * MiB)
        assert _pinned(b)
        assert b.ctypes.data != small_ptr


# ============================================================ test_cuda.py TestMemPool
def _limit(free_mib: int, device: int = 0) -> float:
    """torch's _setup_mempool_limited_memory_test: cap the device at what it has reserved now
    plus ``free_mib`` MiB; returns the previous fraction."""
    before = memory.get_per_process_memory_fraction(device)
    memory.empty_cache()
    total = memory.get_memory_info(device)[1]
    memory.set_per_process_memory_fraction((free_mib * MiB + memory.memory_reserved(device)) / total, device)
    return before



def test_cuda__test_pool_id_in_snapshot(sim_cuda):
    try:
        memory.empty_cache()
        memory._record_memory_history("all")
        pool = MemPool()
        with use_mem_pool(pool):
            x = R.uniform_(Buffer(4 * 64))
        ss = memory._snapshot()
        assert any(tuple(seg["segment_pool_id"]) == pool.id for seg in ss["segments"])
        found_trace = any(te.get("pool_id") is not None and tuple(te["pool_id"]) == pool.id and te["action"] == "alloc"
                          for trace in ss["device_traces"] for te in trace)
        assert found_trace, "no alloc trace entry names the MemPool's id"
        del x
    finally:
        memory._record_memory_history(None)


def test_cuda__test_mempool_release_cached_blocks_during_diversion(sim_cuda):
    """An allocation routed into a MemPool (use_mem_pool, no graph capture) that does not fit
    releases the default pool's cached blocks and retries: 60 MiB cached outside plus 60 MiB
    asked inside fit an 80 MiB budget only after that release."""
    before = _limit(80)
    try:
        a = Buffer(60 * MiB)
        del a                                          # cached, still reserved
        pool = MemPool()
        with use_mem_pool(pool):
            b = Buffer(60 * MiB)
        assert b.nbytes == 60 * MiB
        del b, pool
    finally:
        memory.empty_cache()
        memory.set_per_process_memory_fraction(before)


def test_cuda__test_mempool_no_split_erased_on_release(monkeypatch):
    """A no_split pool's 4 MiB allocations each get their own segment; once the pool and its
    blocks are gone nothing is left under its id, and a pool without no_split made afterwards
    shares one segment between two 4 MiB allocations.  torch re-registers the very same id
    with _cuda_beginAllocateCurrentThreadToPool; accel has no allocate-to-pool-by-id entry (ids
    are never reused), so the new pool is a new MemPool."""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="policy:torch,expandable_segments:False")
    gc.collect()
    memory.empty_cache()
    pool = MemPool(no_split=True)
    pool_id = pool.id
    with use_mem_pool(pool):
        a = Buffer(4 * MiB)
        b = Buffer(4 * MiB)
    assert len(pool.snapshot()) == 2
    del a, b, pool
    memory.empty_cache()
    assert memory.memory_snapshot(pool_id) == []
    again = MemPool()
    with use_mem_pool(again):
        c = Buffer(4 * MiB)
        d = Buffer(4 * MiB)
    assert len(memory.memory_snapshot(again.id)) == 1
    del c, d, again


def test_cuda__test_snapshot_include_traces_correctness(sim_backend):
    """memory_snapshot(include_traces=False) reports the same memory state (the allocated
    blocks' total) as with traces; MemPool.snapshot takes include_traces too (the timing half
    of test_snapshot_include_traces prints speedups only: no timed asserts here)."""
    memory.empty_cache()
    memory._record_memory_history("all")
    try:
        pool = MemPool()
        with use_mem_pool(pool):
            tensors = [Buffer(4 * 1024) for _ in range(100)]
            del tensors
        t1, t2, t3 = (Buffer(MiB).fill_(1) for _ in range(3))
        with_traces = memory.memory_snapshot(include_traces=True)
        without_traces = memory.memory_snapshot(include_traces=False)
        assert len(with_traces) > 0 and len(without_traces) > 0

        def total_allocated(segments):
            return sum(block["size"] for seg in segments for block in seg["blocks"]
                       if block["state"] == "active_allocated")

        assert total_allocated(with_traces) == total_allocated(without_traces)
        assert total_allocated(with_traces) >= 3 * MiB
        assert len(pool.snapshot(include_traces=False)) == len(pool.snapshot()) > 0
        del t1, t2, t3
    finally:
        memory._record_memory_history(None)


@pytest.mark.parametrize("conf", ["expandable_segments:True", "policy:torch,expandable_segments:False"])
def test_cuda__test_multi_threads_alloc_in_same_order(monkeypatch, conf):
    """Allocations made by four threads in one order, after a split-and-merge cycle of the
    freed blocks, come back at the same addresses: the free blocks' order does not depend on
    the cycle (torch: segment-level, not per-block, ordering counters).  accel's default
    (expandable segments) and torch's policy with classic segments; accel's own policy with
    classic segments releases whole free segments before it grows (invariant 5 of
    accel/memory/_caching.py), so the 1 MiB splitters' new small segment gives two 2 MiB
    segments back and the second round's 2 MiB blocks come from new ones: not asserted there."""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF=conf)
    gc.collect()        # (garbage of earlier tests collected mid-test would free memory between the rounds)
    thread_count = 4

    def alloc_with_threads(mem_sizes):
        sizes, results, lock = list(mem_sizes), [], threading.Lock()

        def alloc_tensors():
            while True:
                with lock:
                    if not sizes:
                        return
                    sz = sizes.pop()
                    results.append(Buffer(sz))

        threads = [threading.Thread(target=alloc_tensors) for _ in range(thread_count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [b.ptr for b in results]

    accel.current_device_index()
    mem_sizes = [s * 2 * MiB for s in range(1, 5) for _ in range(thread_count)]
    if "policy:torch" in conf:
        # Classic segments come in cudaMalloc's address order, which the driver does not promise
        # to be increasing (the simulator's is not after an earlier test freed memory): a first
        # round makes them, so both rounds compared take cached segments, ordered by address.
        alloc_with_threads(mem_sizes)
    round_1 = alloc_with_threads(mem_sizes)
    splitters = [Buffer(s * MiB) for s in range(1, 5) for _ in range(thread_count)]
    del splitters
    round_2 = alloc_with_threads(mem_sizes)
    assert round_1 == round_2


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_cuda__test_mempool_oom_recovery_releases_cached_blocks(monkeypatch, kind):
    """With half the device's memory cached in the default pool, an allocation of 7/8 of it
    succeeds (the cached blocks are released and the allocation retried), in the default pool
    and inside a user MemPool alike.  (A 1 GiB simulated device; also test_xpu.py's test.)"""
    use_sim(monkeypatch, kind, ACCEL_SIM_MEMORY="1G")
    accel.current_device_index()

    def align_down_2mb(n):
        return n & ~(2 * MiB - 1)

    for label, make_ctx in (("default pool", contextlib.nullcontext),
                            ("user mempool", lambda: use_mem_pool(MemPool()))):
        memory.empty_cache()
        free_before = memory.get_memory_info(0)[0]
        fill_size = align_down_2mb(free_before // 2)
        assert fill_size >= 64 * MiB
        filler = Buffer(fill_size)
        del filler
        alloc_size = align_down_2mb(free_before - free_before // 8)
        try:
            with make_ctx():
                big = Buffer(alloc_size)
                del big
        except accel.OutOfMemoryError as exc:
            pytest.fail(f"[{label}] OOM although the default pool held {fill_size // MiB} MiB of "
                        f"freeable cached blocks: {exc}")
    memory.empty_cache()


def test_cuda__test_mempool_block_free_not_deferred(sim_backend):
    """A block used on a second stream (record_stream) and freed outside any capture is
    reused once its uses are complete (synchronize), in the default pool and in a user
    MemPool: its free is not deferred as if a capture were underway.  Also test_xpu.py's test."""
    memory.empty_cache()
    s2 = accel.Stream()
    nbytes = MiB
    for label, pool_ctx in (("default pool", contextlib.nullcontext()),
                            ("user mempool", use_mem_pool(MemPool()))):
        memory.empty_cache()
        with pool_ctx:
            a = Buffer(nbytes).fill_(1)
            original = a.ptr
            s2.wait_stream(accel.current_stream())
            with s2:
                a.record_stream(s2)
                _ = _clone(a, s2)                      # a + 1 on s2
            del a, _
            accel.synchronize()
            b = Buffer(nbytes)
            new = b.ptr
            del b
        assert new == original, f"[{label}] block not reused after a multi-stream free"


def test_xpu__test_mempool_empty_cache(sim_backend):
    """test_xpu.py's newer body: deleting a MemPool gives its cached segment back (reserved
    drops), while the default pool's cached block stays reserved."""
    memory.empty_cache()
    pool = MemPool()
    x = Buffer(4 * MiB)
    with use_mem_pool(pool):
        y = Buffer(4 * MiB)
    del x, y
    peak_reserved = memory.memory_reserved()
    del pool
    gc.collect()
    after_pool_release = memory.memory_reserved()
    assert after_pool_release < peak_reserved
    assert after_pool_release > 0


def test_xpu__test_oom_mempool_with_limited_memory(sim_graph_backend):
    """use_on_oom: with no memory left (fraction 1e-9), a request outside any pool falls back
    on the use_on_oom pool's free block (never on the other pool's); that pool still serves its
    own context afterwards at the same address."""
    pool_do_not_use = MemPool()
    pool_use = MemPool(use_on_oom=True)
    orig_fraction = memory.get_per_process_memory_fraction()
    try:
        with use_mem_pool(pool_do_not_use):
            a = Buffer(40 * MiB)
        with use_mem_pool(pool_use):
            b = Buffer(40 * MiB)
        b_ptr = b.ptr
        memory.set_per_process_memory_fraction(1e-9)
        with pytest.raises(accel.OutOfMemoryError):
            Buffer(40 * MiB)
        del a, b
        c = Buffer(30 * MiB)                           # falls back on pool_use
        assert c.ptr == b_ptr
        with pytest.raises(accel.OutOfMemoryError):
            Buffer(30 * MiB)                           # pool_do_not_use is never used on OOM
        del c
        with use_mem_pool(pool_use):
            e = Buffer(20 * MiB)
        assert e.ptr == b_ptr
        del e, pool_use, pool_do_not_use
    finally:
        memory.set_per_process_memory_fraction(orig_fraction)
        memory.empty_cache()


# ============================================================ test_xpu.py


@pytest.mark.filterwarnings("ignore:accel. the count before init")
def test_xpu__test_device_count_not_cached_pre_init(monkeypatch):
    """Before init the count follows ZE_AFFINITY_MASK as it changes; init then sees the count
    last given."""
    use_sim(monkeypatch, "xpu")
    r1 = accel.device_count()
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0")
    r2 = accel.device_count()
    Buffer(40)                                         # torch.empty(10, device='xpu')
    assert (r1, r2) == (2, 1)
    assert accel.device_count() == 1


def test_xpu__test_get_device_capability(monkeypatch):
    """torch.accelerator.get_device_capability()'s supported dtypes on an XPU include bool, int
    and float (accel names them as numpy does); float16/float64 where the device has them
    (torch's has_fp16/has_fp64 keys: accel's capability has no such keys, so only presence of
    the names is checked)."""
    use_sim(monkeypatch, "xpu")
    supported = accel.get_device_capability()["supported_dtypes"]
    assert isinstance(supported, set)
    assert {"bool", "int32", "float32"} <= supported


_TELEMETRY_CASES = [
    # (torch test, accel query, check); accel keeps torch.cuda's conventions on every backend:
    # ints, power in milliwatts (torch.xpu returns floats, watts)
    ("test_temperature_returns_float", "temperature", lambda v, total: 0 <= v < 150),
    ("test_clock_rate_returns_float", "clock_rate", lambda v, total: 0 <= v < 5000),
    ("test_power_draw_returns_float", "power_draw", lambda v, total: 0 <= v < 1000 * 1000),
    ("test_utilization_returns_float", "utilization", lambda v, total: 0 <= v <= 100),
    ("test_memory_usage_returns_float", "memory_usage", lambda v, total: 0 <= v <= 100),
    ("test_device_memory_used_returns_int", "device_memory_used",
     lambda v, total: isinstance(v, int) and 0 <= v <= total),
]


@pytest.mark.parametrize("query,check", [c[1:] for c in _TELEMETRY_CASES], ids=[c[0] for c in _TELEMETRY_CASES])
def test_xpu__test_telemetry_queries(monkeypatch, query, check):
    """TestXpu's Sysman queries (torch: through pyzes): plausible values, without initializing
    the runtime.  Units differ: accel answers as torch.cuda does (ints; power_draw in mW)."""
    use_sim(monkeypatch, "xpu")
    value = getattr(accel, query)()
    assert not accel.is_initialized()
    assert isinstance(value, (int, float)) and not isinstance(value, bool)
    assert check(value, accel.get_device_properties().total_memory), (query, value)


def test_xpu__test_list_gpu_processes_returns_string(monkeypatch):
    use_sim(monkeypatch, "xpu")
    info = accel.list_gpu_processes()
    assert isinstance(info, str)
    assert re.search(rf"GPU:\s*{accel.current_device_index()}\b", info)


@pytest.mark.parametrize("mask,expected", [("128", 0), ("0", 1), ("1", 1)])
def test_xpu__test_device_count_respects_affinity_mask(monkeypatch, mask, expected):
    """The count taken without initializing (torch: _device_count_zes, through Sysman) and the
    runtime's after init agree for a mask index out of range (none), device 0 and device 1.
    (torch's COMPOSITE-style "0.0" case checks its pyzes path returns -1: torch-internal.)"""
    use_sim(monkeypatch, "xpu", ZE_AFFINITY_MASK=mask)
    before_init = accel.device_count()
    assert not accel.is_initialized()
    assert before_init == expected
    if expected:
        Buffer(4)
        assert accel.is_initialized()
        assert accel.device_count() == expected


@pytest.mark.parametrize("mask,expected", [("0, 1, 2, -1, 3", 4), ("0, 1, 2, 1", 3), ("1a, 2b", 2),
                                           ("0, 1, 2", 3)])
def test_xpu__test_parse_visible_devices(monkeypatch, mask, expected):
    """The ZE_AFFINITY_MASK cases where torch's _parse_visible_devices and the Level Zero rules
    accel follows (compute-runtime parseAffinityMask, accel/backends/_ze_visible.py) agree: a
    negative entry is skipped, a duplicate counts once.  "1a, 2b" is devices 1 and 2: the driver
    reads each number with std::stoul(s, nullptr, 0) (compute-runtime StringHelpers::toUint32t),
    which stops at the first character that is no digit (r82d; this port said "nothing" before).
    (Six simulated devices.)  torch's "one, two, 3, 4" (all rejected), "2, +3, -0, 5"
    (signs accepted, mask order kept) and its strict mode differ from those rules: not ported."""
    use_sim(monkeypatch, "xpu", ACCEL_SIM_DEVICES=6, ZE_AFFINITY_MASK=mask)
    assert accel.device_count() == expected


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_xpu__test_memory_snapshot(monkeypatch, kind):
    """TestXpu.test_memory_snapshot: the stats implied by memory_snapshot() (torch's
    _check_memory_stat_consistency) equal memory_stats() after every step of the allocation
    generator; on the Level Zero simulator (and CUDA's, as test_cuda_multigpu's port)."""
    from test_torch_cuda_multigpu import _check_memory_stat_consistency, _memory_stats_generator
    use_sim(monkeypatch, kind)
    gc.collect()
    memory.empty_cache()
    for _ in _memory_stats_generator():
        _check_memory_stat_consistency()


def test_xpu__test_1mb_allocation_uses_small_block(monkeypatch):
    """A 1 MiB request (torch's kSmallSize) is served from the small pool's 2 MiB segments:
    a and b live (2 MiB allocated) after five clone-and-add steps, with 4 MiB reserved under
    torch's segment policy."""
    use_sim(monkeypatch, "xpu", ACCEL_ALLOC_CONF="policy:torch,expandable_segments:False")
    gc.collect()
    memory.empty_cache()
    prev_allocated = memory.memory_allocated()
    prev_reserved = memory.memory_reserved()
    a = Buffer(MiB).fill_(1)
    b = _clone(a)
    for i in range(5):
        c = _clone(b)                                  # b.clone()
        b = _clone(c).fill_(2 + i)                     # + 1
        del c
    accel.synchronize()
    assert memory.memory_allocated() == prev_allocated + 2 * MiB
    assert memory.memory_reserved() == prev_reserved + 4 * MiB
    assert memory.memory_stats()["allocation.small_pool.current"] >= 2


def test_xpu__test_graph_empty_cache_after_side_stream_free_during_capture(sim_cuda):
    """A block freed during capture after use on a side stream forked into the capture: its
    release waits for the capture's end (an event recorded in the capture would only signal on
    replay), so the empty_cache() that follows completes (no hang, no error).  CUDA: Level
    Zero captures no cross-stream work."""
    pool = accel.graphs.graph_pool_handle()
    g = Graph(pool=pool)
    capture_stream = accel.Stream()
    side = accel.Stream()
    errors, done = [], threading.Event()

    def body():
        try:
            with capture_stream:
                g.capture_begin()
                x = Buffer(4096).fill_(1)
                side.wait_stream(capture_stream)
                with side:
                    y = _clone(x, side)                # x + 1.0
                    x.record_stream(side)
                    del x
                capture_stream.wait_stream(side)
                del y
                g.capture_end()
            accel.current_stream().wait_stream(capture_stream)
            memory.empty_cache()
        except BaseException as exc:                   # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    assert done.wait(60), "capture with a side-stream free followed by empty_cache() hung"
    if errors:
        raise errors[0]
    g.replay()
    accel.synchronize()


# ============================================================ OpenReg: torch_openreg/tests/test_streams.py
def _t() -> str:
    return accel.current_accelerator().type


def _one() -> int:
    return 1 if accel.device_count() > 1 else 0


def test_openreg_streams__test_stream_context_exception_restore(sim_backend):
    prev = accel.current_stream()
    inner = accel.Stream(device=f"{_t()}:{_one()}")
    with pytest.raises(RuntimeError, match="forced"):
        with inner:
            assert accel.current_stream() == inner
            raise RuntimeError("forced")
    assert accel.current_stream() == prev
    assert accel.current_device_index() == 0


def test_openreg_streams__test_stream_equality(sim_backend):
    stream1 = accel.Stream(device=f"{_t()}:0")
    stream2 = accel.Stream(device=f"{_t()}:0")
    assert stream1 != stream2
    assert stream1 == stream1
    stream3 = accel.Stream(stream_id=stream1.stream_id, device_type=stream1.device_type,
                           device_index=stream1.device_index)
    assert stream1 == stream3


def test_openreg_streams__test_stream_multiple_devices(sim_backend):
    stream0 = accel.Stream(device=f"{_t()}:0")
    stream1 = accel.Stream(device=f"{_t()}:{_one()}")
    assert stream0.device_index == 0
    assert stream1.device_index == _one()
    accel.set_device_index(0)
    accel.set_stream(stream0)
    assert accel.current_stream() == stream0
    accel.set_device_index(_one())
    accel.set_stream(stream1)
    assert accel.current_stream() == stream1
    if accel.device_count() > 1:
        accel.set_device_index(0)
        assert accel.current_stream() == stream0      # each device keeps its own current stream


def test_openreg_streams__test_stream_context_nested(sim_backend):
    stream1 = accel.Stream(device=f"{_t()}:0")
    stream2 = accel.Stream(device=f"{_t()}:0")
    with stream1:
        assert accel.current_stream() == stream1
        with stream2:
            assert accel.current_stream() == stream2
        assert accel.current_stream() == stream1


def test_openreg_streams__test_stream_record_event(sim_backend):
    stream = accel.Stream(device=_t())
    event = stream.record_event()
    assert event is not None
    assert event.device.type == _t()
    stream.synchronize()
    assert event.query()


def test_openreg_streams__test_event_not_ready_until_stream_sync(monkeypatch):
    """TestOpenRegAsyncHelper: an event recorded after a blocking task on a stream is not ready
    until the task is released and the stream synchronized (OpenReg's test gate is hold())."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=20)
    stream = accel.Stream(device=f"{_t()}:0")
    gate = hold(stream)
    try:
        event = accel.Event()
        event.record(stream)
        assert not event.query()
    finally:
        gate.set()
    stream.synchronize()
    assert event.query()


def test_openreg_streams__test_record_data_ptr_on_stream_forwards_to_allocator(monkeypatch):
    """TestOpenRegGuardRecordDataPtrOnStream: recording a tensor's memory on a stream reaches
    the caching allocator: freed while that stream is busy, the block is not handed out again
    on its allocation stream until the stream's work is done."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=20)
    x = Buffer(4 * 64).fill_(1)
    s = accel.Stream()
    gate = hold(s)
    x.record_stream(s)
    ptr = x.ptr
    del x
    y = Buffer(4 * 64)
    assert y.ptr != ptr, "the block was reused while the stream it was recorded on is busy"
    gate.set()
    s.synchronize()
    z = Buffer(4 * 64)
    assert z.ptr == ptr
    del y, z


# ============================================================ OpenReg: torch_openreg/tests/test_memory.py
def _run_threads(target, n, *args):
    errors = []

    def wrapped(i):
        try:
            target(i, *args)
        except BaseException as exc:                   # noqa: BLE001 - collected
            errors.append((i, repr(exc)))

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert errors == [], f"Errors in threads: {errors}"


def _randn(n, device=None) -> Buffer:
    return R.normal_(Buffer(4 * n, device=device))


def test_openreg_memory__test_concurrent_allocations(sim_backend):
    start = memory.memory_allocated()

    def allocate_tensors(thread_id):
        for i in range(50):
            size = 100 + thread_id * 10 + i
            x = Buffer(4 * size)
            assert x.nbytes == 4 * size and x.device.type == _t()

    _run_threads(allocate_tensors, 10)
    gc.collect()
    assert memory.memory_allocated() == start


def test_openreg_memory__test_concurrent_allocations_and_deallocations(sim_backend):
    start = memory.memory_allocated()

    def alloc_dealloc_cycle(thread_id):
        tensors = []
        for i in range(30):
            tensors.append(Buffer(4 * (500 + i * 10)))
            if len(tensors) > 5:
                tensors.pop(0)
        tensors.clear()

    _run_threads(alloc_dealloc_cycle, 8)
    gc.collect()
    assert memory.memory_allocated() == start


def test_openreg_memory__test_concurrent_mixed_operations(sim_backend):
    """Allocate, copy to the host and back, modify, clone, free: from six threads at once."""

    def mixed_operations(thread_id):
        for i in range(40):
            x = _randn(200)
            cpu_copy = x.to_numpy(np.float32)
            back = Buffer(x.nbytes).copy_from(cpu_copy)
            host = cpu_copy * 2 + 2                    # add_(1), mul_(2)
            back.copy_from(host)
            cloned = _clone(back)
            assert np.array_equal(cloned.to_numpy(np.float32), host)
            del x, back, cloned

    _run_threads(mixed_operations, 6)


def test_openreg_memory__test_shared_tensor_across_threads(sim_backend):
    shared = _randn(1000)
    expected = shared.to_numpy(np.float32)

    def read_shared(thread_id):
        for _ in range(50):
            assert np.array_equal(shared.to_numpy(np.float32), expected)

    _run_threads(read_shared, 8)


def test_openreg_memory__test_race_condition_stress(sim_backend):
    start = memory.memory_allocated()

    def rapid_alloc_dealloc(thread_id):
        for i in range(100):
            x = Buffer(4 * (100 + i % 50))
            del x

    _run_threads(rapid_alloc_dealloc, 12)
    gc.collect()
    assert memory.memory_allocated() == start


def test_openreg_memory__test_device_switching_allocation(sim_backend):
    accel.set_device_index(0)
    assert Buffer(400).device_index == 0
    accel.set_device_index(_one())
    assert Buffer(400).device_index == _one()
    accel.set_device_index(0)
    assert Buffer(400).device_index == 0


def test_openreg_memory__test_concurrent_allocation_on_different_devices(sim_backend):
    _need_two()

    def allocate_on_device(device_idx):
        accel.set_device_index(device_idx)
        for i in range(50):
            x = Buffer(4 * (100 + i), device=f"{_t()}:{device_idx}")
            assert x.device_index == device_idx

    _run_threads(allocate_on_device, 2)


def test_openreg_memory__test_device_switching_race_condition(sim_backend):
    """Threads switching their current device while allocating: each thread's allocations land
    on its own current device (the current device is per thread)."""

    def switch_and_allocate(thread_id):
        for i in range(30):
            device_idx = i % 2 if accel.device_count() > 1 else 0
            accel.set_device_index(device_idx)
            x = Buffer(400)
            assert x.device_index == device_idx

    _run_threads(switch_and_allocate, 4)


def test_openreg_memory__test_concurrent_cross_device_copies(sim_backend):
    def copy_between_devices(thread_id):
        for i in range(20):
            x = _randn(100, device=0)
            y = Buffer(x.nbytes, device=_one()).copy_from(x)
            assert np.array_equal(x.to_numpy(np.float32), y.to_numpy(np.float32))
            z = Buffer(y.nbytes, device=0).copy_from(y)
            assert np.array_equal(y.to_numpy(np.float32), z.to_numpy(np.float32))

    _run_threads(copy_between_devices, 4)


def test_openreg_memory__test_concurrent_mixed_device_operations(sim_backend):
    def mixed_device_operations(thread_id):
        for i in range(15):
            x0 = _randn(50, device=0)
            x1 = _randn(50, device=_one())
            x0_to_1 = Buffer(x0.nbytes, device=_one()).copy_from(x0)
            x1_to_0 = Buffer(x1.nbytes, device=0).copy_from(x1)
            assert np.array_equal(x0.to_numpy(np.float32), x0_to_1.to_numpy(np.float32))
            assert np.array_equal(x1.to_numpy(np.float32), x1_to_0.to_numpy(np.float32))

    _run_threads(mixed_device_operations, 6)


def test_openreg_memory__test_pin_memory_view(sim_backend):
    """licy666's TestPinMemory additions: views of a pinned array (a slice, a strided view, a
    reshape) are pinned, and an array sharing the pinned storage is pinned.  torch's
    ``tensor.pin_memory()`` / ``pin_memory("openreg")`` of an existing tensor: no API."""
    pinned = accel.empty_pinned(20, np.float32)
    assert _pinned(pinned)
    assert _pinned(pinned[2:5])
    assert _pinned(pinned[::2])
    assert _pinned(pinned.reshape(4, 5))
    shared = np.frombuffer(pinned, dtype=np.float32)   # .set_(pinned.storage())
    assert _pinned(shared)
    assert not _pinned(np.zeros(20, np.float32))
