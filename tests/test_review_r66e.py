"""Adversarial review (r66e) of the accel changes of sessions r65/r66 (d1c4bb1^..5f0da5a).

What each test checks, and why:

* Graph RNG replay ordering (``accel.random._after_last_use``): a replay on stream b of a graph
  whose holders were last used on stream a makes b wait for a.  While a capture is underway that
  wait is ``b.wait_stream(a)``, an event recorded on a and waited for on b.  When a itself is
  the stream being captured (by this thread in relaxed mode, or another thread in
  thread_local mode), the record is captured and the wait makes b join the capture (CUDA
  Programming Guide, "Cross-stream Dependencies and Events": a stream waiting on a captured
  event joins the capture): the replay's cudaGraphLaunch is refused (900), the generator has
  advanced for a replay that never ran, b is left capturing, and the capture is invalidated.
* ``_grow_instead`` (classic segments): a large request whose best fit is a whole free segment
  over four times its own segment takes the miss path for a segment of its own.  Where the miss
  cannot free the cache (a capture underway: no cudaFree; throw_on_cudamalloc_oom: refused before
  any free), the request fails with OutOfMemoryError although the cached segment fits it.
* Level Zero kernel handles (``Module._functions``): a failed unload (zeKernelDestroy ran, then
  zeModuleDestroy failed) leaves the module loaded and clears the handle cache "to be looked up
  again", but ``Module.function`` still returns the cached Kernel with the destroyed handle.
* What was checked and holds (guards): ``with g:`` nested in the same thread's capture, the
  CUDA argument cells after failing launches (per thread, bounded), the shared-memory opt-in of
  ``max_potential_block_size`` under an injected cudaFuncSetAttribute failure and with another
  device current, DLPack's cross-device legacy consumer under an injected event failure, memory
  history's snapshot entries under ``max_entries``, and ``_exp_unmap_enough`` under an injected
  cuMemUnmap failure.
"""

import gc
import struct
import threading

import numpy as np
import pytest

import accel
from accel import memory, sim
from accel import random as R
from accel._errors import AcceleratorError, CaptureError, OutOfMemoryError
from conftest import use_sim
from test_user_kernels import SAXPY_PTX, spirv_module

MiB = 1 << 20


def _state(gen):
    return bytes(gen.get_state().tobytes())


# -- graph RNG replays beside a capture of the holders' last stream -------------------------
def _rng_graph_last_used_on(a):
    """A graph drawing from a registered generator, captured on ``a`` and replayed there once
    (its holders' last use: stream a)."""
    gen = R.Generator(0, seed=5)
    out = accel.Buffer(4096, stream=a)
    R.random_raw_(out, generator=gen)        # the RNG kernels loaded before the capture
    accel.synchronize(0)
    g = accel.Graph()
    with a:
        g.register_generator_state(gen)
        g.capture_begin()
        R.random_raw_(out, generator=gen)
        g.capture_end()
    with a:
        g.replay()
    accel.synchronize(0)
    return g, gen, out


def test_rng_replay_on_another_stream_inside_own_relaxed_capture_leaves_it_intact(monkeypatch):
    use_sim(monkeypatch, "cuda")
    a, b = accel.Stream(0), accel.Stream(0)
    g, gen, out = _rng_graph_last_used_on(a)
    other = accel.Buffer(4096)
    be = a._backend
    g2 = accel.Graph(capture_error_mode="relaxed")
    before = _state(gen)
    refused = None
    with a:
        g2.capture_begin()
        other.fill_(3, stream=a)
        try:
            with b:
                g.replay()               # b is not being captured: the replay may run, or be refused
        except CaptureError as exc:
            refused = exc
        b_capturing = be.stream_is_capturing(b._handle)
        try:
            g2.capture_end()
            ended = None
        except CaptureError as exc:
            ended = exc
    accel.synchronize(0)
    assert not b_capturing, f"the replay stream joined the capture (replay: {refused})"
    assert ended is None, f"the capture was invalidated: {ended}"
    if refused is not None:
        assert _state(gen) == before, "a refused replay advanced the generator"
    g2.replay()
    accel.synchronize(0)
    assert (other.to_numpy(np.uint8) == 3).all()
    for obj in (g, g2):
        obj.reset()
    for obj in (out, other, a, b):
        obj.close()


def test_rng_replay_beside_another_threads_capture_of_its_last_stream(monkeypatch):
    use_sim(monkeypatch, "cuda")
    a, b = accel.Stream(0), accel.Stream(0)
    g, gen, out = _rng_graph_last_used_on(a)
    other = accel.Buffer(4096)
    be = a._backend
    started, go = threading.Event(), threading.Event()
    result = {}

    def capture():
        g2 = accel.Graph(capture_error_mode="thread_local")
        try:
            with a:
                g2.capture_begin()
                other.fill_(3, stream=a)
                started.set()
                go.wait(10)
                g2.capture_end()
            result["capture"] = None
        except Exception as exc:     # noqa: BLE001 (reported by the assert below)
            result["capture"] = exc
        finally:
            started.set()
            result["graph"] = g2

    t = threading.Thread(target=capture)
    t.start()
    assert started.wait(10)
    try:
        with b:
            g.replay()
        replay = None
    except (CaptureError, RuntimeError) as exc:
        replay = exc
    b_capturing = be.stream_is_capturing(b._handle)
    go.set()
    t.join(10)
    accel.synchronize(0)
    assert not b_capturing, f"the replay stream joined the other thread's capture (replay: {replay})"
    assert result["capture"] is None, f"the other thread's capture failed: {result['capture']}"
    result["graph"].reset()
    g.reset()
    for obj in (out, other, a, b):
        obj.close()


def test_rng_replay_on_another_stream_without_capture_is_ordered(monkeypatch):
    """Guard: the plain case (no capture) still draws the next offset on the second stream."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=2000)
    a, b = accel.Stream(0), accel.Stream(0)
    g, gen, out = _rng_graph_last_used_on(a)
    from accel.random import philox
    seed, offset = struct.unpack("<Qq", _state(gen))
    with b:
        g.replay()
    b.synchronize()
    want = philox.raw_words(seed, offset, 1024).astype("<u4").view(np.uint8)
    assert np.array_equal(out.to_numpy(stream=b), want)
    g.reset()
    for obj in (out, a, b):
        obj.close()


# -- _grow_instead where the miss cannot free the cache -------------------------------------
def _big_free_segment_under_cap(cap_mib, stream):
    """A whole free 64 MiB classic segment cached on ``stream``, a 2 MiB small segment cached on
    the current stream (for a capture's RNG holders), the high-water mark 66 MiB, and the
    allocator capped at ``cap_mib``."""
    small = accel.Buffer(1024)
    big = accel.Buffer(64 * MiB, stream=stream)
    small.close()
    big.close()
    total = memory.get_memory_info(0)[1]
    memory.set_per_process_memory_fraction(cap_mib * MiB / total, 0)
    assert sorted(s["total_size"] // MiB for s in memory.memory_snapshot()) == [2, 64]


@pytest.mark.parametrize("mode", ["relaxed", "thread_local", "global"])
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_a_request_the_cached_segment_fits_is_served_during_a_capture(monkeypatch, mode):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="expandable_segments:False")
    a, s2 = accel.Stream(0), accel.Stream(0)
    with a:
        _big_free_segment_under_cap(67, s2)
        g = accel.Graph(capture_error_mode=mode)
        g.capture_begin()
        try:
            y = accel.Buffer(4 * MiB, stream=s2)    # s2 is not captured: the general cache
            y.close()
        finally:
            g.capture_end()
    g.reset()


def test_the_same_request_without_a_capture_is_served(monkeypatch):
    """Guard (the premise of the test above): without a capture the miss frees the big segment."""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="expandable_segments:False")
    a, s2 = accel.Stream(0), accel.Stream(0)
    with a:
        _big_free_segment_under_cap(67, s2)
        y = accel.Buffer(4 * MiB, stream=s2)
    y.close()


def test_throw_on_cudamalloc_oom_serves_a_request_the_cache_fits(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="expandable_segments:False,throw_on_cudamalloc_oom:True")
    big = accel.Buffer(64 * MiB)
    big.close()
    total = memory.get_memory_info(0)[1]
    memory.set_per_process_memory_fraction(66 * MiB / total, 0)
    y = accel.Buffer(4 * MiB)       # torch: served from the cache, no cudaMalloc, nothing rejected
    y.close()
    assert memory.memory_stats(0).get("num_oom_rejections", 0) == 0


# -- Level Zero: a failed unload and the kernel handle cache --------------------------------
FILL = "accel_test_fill_u32"
SIG = "ptr, u64, u32"


def test_a_failed_unload_leaves_the_module_launchable(monkeypatch):
    use_sim(monkeypatch, "xpu")
    m = accel.Module(spirv_module(FILL))
    k = m.function(FILL, SIG)
    out = accel.Buffer(256)
    accel.launch(k, 1, 64, out, 64, 7)
    sim.inject_error("zeModuleDestroy", 0x7FFFFFFE)
    with pytest.raises(AcceleratorError, match="zeModuleDestroy"):
        m.close()
    sim.clear_faults()
    assert not m.closed, "a failed unload leaves the module loaded (close may be tried again)"
    accel.launch(m.function(FILL, SIG), 1, 64, out, 64, 9)
    assert (out.to_numpy(np.uint32)[:64] == 9).all()
    accel.launch(k, 1, 64, out, 64, 11)         # the Kernel the program held through it
    assert (out.to_numpy(np.uint32)[:64] == 11).all()
    m.close()
    out.close()


def test_kernel_lookups_stay_one_handle_per_name(monkeypatch):
    """Guard: Module.function after the last Kernel died reuses the looked-up handle."""
    use_sim(monkeypatch, "xpu")
    m = accel.Module(spirv_module(FILL))
    for _ in range(20):
        m.function(FILL, SIG)
        gc.collect()
    assert sim.state().ze_live_kernels == 1
    m.close()
    assert sim.state().ze_live_kernels == 0


# -- with g: inside the same thread's capture ---------------------------------------------
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_with_graph_inside_own_capture_is_refused_and_the_capture_goes_on(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    s = accel.Stream(0)
    buf = accel.Buffer(4096)
    g, inner = accel.Graph(), accel.Graph()
    with s:
        g.capture_begin()
        buf.fill_(5, stream=s)
        with pytest.raises((CaptureError, RuntimeError)):
            with inner:
                pass
        g.capture_end()
    g.replay()
    accel.synchronize(0)
    assert (buf.to_numpy(np.uint8) == 5).all()
    inner.reset()
    g.reset()
    buf.close()
    s.close()


# -- CUDA argument cells -------------------------------------------------------------------
def test_failing_launches_leave_one_argument_set_and_correct_values(monkeypatch, saxpy_registered):
    use_sim(monkeypatch, "cuda")
    k = accel.Module(SAXPY_PTX).function("saxpy")
    be = k._backend
    x = np.arange(256, dtype=np.float32)
    bx, by = accel.Buffer(1024), accel.Buffer(1024)
    bx.copy_from(x)
    by.copy_from(np.zeros(256, np.float32))
    for name in ("cudaLaunchKernel", "cuLaunchKernel"):
        sim.inject_error(name, 1, times=5)
    for _ in range(5):
        with pytest.raises(AcceleratorError):
            accel.launch(k, 1, 256, 9.5, bx, by, 256)
    sim.clear_faults()
    assert all(len(sets) <= 1 for sets in be._arg_pools.by_count.values())
    accel.launch(k, 1, 256, 2.0, bx, by, 256)
    assert np.array_equal(by.to_numpy(np.float32), 2.0 * x)
    bx.close()
    by.close()


@pytest.fixture
def saxpy_registered():
    from test_user_kernels import saxpy_reference
    sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64")
    yield
    sim.unregister_kernel("saxpy")


# -- max_potential_block_size's opt-in -----------------------------------------------------
def test_occupancy_opt_in_failure_changes_nothing_and_device_stays(monkeypatch):
    use_sim(monkeypatch, "cuda")
    accel.set_device_index(0)
    k = accel.Module(SAXPY_PTX, device=1).function("saxpy")
    sms = accel.get_device_properties(1).multi_processor_count
    for name in ("cudaFuncSetAttribute", "cuFuncSetAttribute"):
        sim.inject_error(name, 1)
    with pytest.raises(AcceleratorError):
        k.max_potential_block_size(dynamic_smem=100 * 1024)
    sim.clear_faults()
    assert k.module._smem_optin == {}
    assert accel.current_device_index() == 0
    assert k.max_potential_block_size(dynamic_smem=100 * 1024) == (2 * sms, 1024)
    assert accel.current_device_index() == 0
    with pytest.raises(ValueError, match="at most"):
        k.max_potential_block_size(dynamic_smem=1 << 30)
    assert k.module._smem_optin == {k.handle: 100 * 1024}    # a refusal lowers nothing


# -- DLPack: another device's legacy stream as the consumer --------------------------------
def test_dlpack_cross_device_legacy_consumer_event_failure_leaves_nothing(monkeypatch):
    use_sim(monkeypatch, "cuda")
    accel.set_device_index(0)
    src = accel.Buffer(4096)
    src.fill_(7)
    accel.set_device_index(1)
    accel.set_device_index(0)
    live = sim.state().events
    legacy1 = accel.default_stream(1) if hasattr(accel, "default_stream") else accel.current_stream(1)
    sim.inject_error("cudaEventRecord", 1)
    with pytest.raises(AcceleratorError):
        accel.from_dlpack(src, stream=legacy1)
    sim.clear_faults()
    gc.collect()
    assert sim.state().events == live
    view = accel.from_dlpack(src, stream=legacy1)
    assert (view.to_numpy(np.uint8) == 7).all()
    view.close()
    src.close()
    assert accel.current_device_index() == 0


# -- memory history: snapshot entries are bounded --------------------------------------------
def test_snapshot_entries_respect_max_entries(monkeypatch):
    use_sim(monkeypatch, "cuda")
    memory._record_memory_history("all", max_entries=3)
    try:
        for _ in range(10):
            accel.Buffer(4096).close()
            memory._snapshot()
        traces = memory._snapshot()["device_traces"][0]
        assert len(traces) <= 3
        assert traces[-1]["action"] == "snapshot"
    finally:
        memory._record_memory_history(None)


# -- expandable segments: _exp_unmap_enough under an unmap failure --------------------------
def test_unmap_enough_failure_keeps_the_allocator_consistent(monkeypatch):
    from accel import _lazy
    from accel.memory import _config
    from accel.memory._caching import DeviceCachingAllocator
    from accel.sim import _vmm
    from test_memory_expandable import check
    if not _vmm.supported():
        pytest.skip("this host cannot play virtual memory (mmap)")
    use_sim(monkeypatch, "cuda")
    be = _lazy.lazy_init()
    alloc = DeviceCachingAllocator(be, 0, _config.parse("expandable_segments:True"))
    f4 = alloc.malloc(4 * MiB)
    l1 = alloc.malloc(2 * MiB)
    f2 = alloc.malloc(2 * MiB)
    l2 = alloc.malloc(2 * MiB)
    big = alloc.malloc(8 * MiB)
    for p in (f4, f2, big):
        alloc.free(p)
    before = check(alloc)
    sim.inject_error("cuMemUnmap", 1)
    with pytest.raises(AcceleratorError, match="cuMemUnmap"):
        alloc.malloc(10 * MiB)
    sim.clear_faults()
    after = check(alloc)
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    x = alloc.malloc(10 * MiB)
    check(alloc)
    for p in (x, l1, l2):
        alloc.free(p)
    check(alloc)
    alloc.empty_cache()
    sim.reset()
