"""r61f: the calls the simulator refuses and the H100 accepted (returned 0), row by row
(``python tools/cuda_conformance.py --compare tests/conformance/cuda_h100_2026-12-05.json |
grep sim_stricter``; accel/sim/README.md, "Where the simulator is stricter").

Stricter is allowed, but a refusal can hide how accel behaves when the call succeeds.  Each
test below makes the simulator do what the H100 did for one call (a monkeypatch inside the test,
never a simulator rule relaxed) and checks what accel does then; or, where accel never makes the
call, checks that it does not (a spy on the simulated library).  Verdicts and evidence:
/work/notes/r61f_audit.md.  Device 1 (not current) is exercised as well as device 0.
"""

import gc
import weakref

import numpy as np
import pytest

import accel
from accel import _lazy, sim
from accel.sim import _vmm

from conftest import use_sim

# hundreds of short tests that collect: see conftest.frozen_module_heap
pytestmark = pytest.mark.usefixtures("frozen_module_heap")

MiB = 1 << 20

needs_vmm = pytest.mark.skipif(not _vmm.supported(), reason="this host cannot play virtual memory (mmap)")


@pytest.fixture
def be(monkeypatch):
    use_sim(monkeypatch, "cuda")
    b = _lazy.lazy_init()
    yield b
    from accel import graphs
    graphs._unfinished.clear()      # a graph whose capture_end failed (the xfails) must not reach the next test
    sim.reset()


def _capturing(be, handle) -> bool:
    status = be.ffi.new("enum cudaStreamCaptureStatus *")
    return be.lib.cudaStreamIsCapturing(be._cast("cudaStream_t", handle), status) == 0 and status[0] != 0


def _spy(monkeypatch, be, name):
    """Record the arguments of every call of the simulated ``name`` (then call it)."""
    real = getattr(be.lib, name)
    calls = []

    def spy(*args):
        rc = real(*args)
        calls.append((args, rc))
        return rc
    monkeypatch.setattr(be.lib, name, spy)
    return calls


# -- cudaStreamDestroy of a stream that takes part in a capture (H100: 0, the capture goes on) --------

def h100_stream_destroy(monkeypatch, be) -> list:
    """cudaStreamDestroy of a stream in a capture returns 0 and the capture goes on, as on the H100
    (capture_destroy_joined_stream / capture_destroy_origin_stream).  The simulated stream is left
    alive (the capture still names it); the handles "destroyed" so are listed."""
    real = be.lib.cudaStreamDestroy
    destroyed = []

    def destroy(stream):
        handle = int(be.ffi.cast("uintptr_t", stream))
        if _capturing(be, handle):
            destroyed.append(handle)
            return 0
        return real(stream)
    monkeypatch.setattr(be.lib, "cudaStreamDestroy", destroy)
    return destroyed


def _drop_joined_stream_in_capture(index):
    """A side stream joins a capture, allocates a block of the graph's pool and fills it, joins
    back, and its last accel reference goes inside the capture (Stream.__del__: nothing else
    holds it).  Returns (graph, out buffer, capture stream, weak ref to the side stream, error of
    capture_end or None)."""
    with accel.device_index(index):
        s = accel.Stream()
        out = accel.Buffer(4096, stream=s)
        out.fill_(0, s)
        s.synchronize()
        g = accel.Graph()
        error = None
        with s:
            g.capture_begin()
            side = accel.Stream()
            side.wait_stream(s)
            tmp = accel.Buffer(4096, stream=side)
            tmp.fill_(3, side)
            s.wait_stream(side)
            out.copy_from(tmp, stream=s)
            gone = weakref.ref(side)
            del tmp, side
            gc.collect()
            try:
                g.capture_end()
            except Exception as exc:       # noqa: BLE001 (reported by the caller)
                error = exc
        return g, out, s, gone, error


# Until r61g (strict xfails): accel/streams.py _destroy (the finalizer path of an owned Stream: __del__, the
# registry) destroyed a stream that takes part in a capture, which close() refuses; its destroy hook
# (accel/memory/_caching.py _forget_stream -> cover) first recorded a plain event on the capturing stream, a
# captured event, and _process_events then queried it after the capture: "AcceleratorError: libcudart:
# cudaEventQuery failed with cudaErrorInvalidValue (1)" from capture_end and from every later empty_cache().
# Now the whole destroy waits for the end of the captures.


@pytest.mark.parametrize("index", [0, 1])
def test_stream_dropped_in_capture_h100(be, monkeypatch, index):
    """H100: the destroy returns 0 and the capture goes on: the graph is fine, so capture_end must
    succeed, its replays copy the side stream's fill, and the allocator must stay usable."""
    destroyed = h100_stream_destroy(monkeypatch, be)
    g, out, s, gone, error = _drop_joined_stream_in_capture(index)
    assert gone() is None
    assert error is None, f"capture_end: {type(error).__name__}: {error}"
    with accel.device_index(index), s:
        g.replay()
    s.synchronize()
    assert (out.to_numpy() == 3).all()
    accel.memory.empty_cache()
    del g
    gc.collect()
    accel.memory.empty_cache()
    assert accel.memory.memory_stats(index)["allocated_bytes.all.current"] == 4096     # `out` only
    assert len(destroyed) <= 1


@pytest.mark.parametrize("index", [0, 1])
def test_stream_dropped_in_capture_sim(be, index):
    """The simulator as it is (the destroy refused, the capture invalidated): capture_end may report
    the capture as invalid (CaptureError), but the allocator must stay usable afterwards."""
    g, out, s, gone, error = _drop_joined_stream_in_capture(index)
    assert error is None or isinstance(error, accel.CaptureError), f"{type(error).__name__}: {error}"
    accel.memory.empty_cache()
    with accel.device_index(index):
        b = accel.Buffer(4096)
        b.fill_(1)
        accel.synchronize(index)
        assert (b.to_numpy() == 1).all()
        g2 = accel.Graph()          # the device can capture again
        with s:
            g2.capture_begin()
            b.fill_(4, s)
            g2.capture_end()
            g2.replay()
        s.synchronize()
        assert (b.to_numpy() == 4).all()


@pytest.mark.parametrize("index", [0, 1])
def test_stream_dropped_in_capture_h100_async_allocator(monkeypatch, index):
    """The same with backend:cudaMallocAsync (memory/_async.py forget_stream records nothing a later
    query needs): on the H100 the capture goes on and the graph replays the side stream's fill."""
    use_sim(monkeypatch, "cuda", PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    be = _lazy.lazy_init()
    try:
        destroyed = h100_stream_destroy(monkeypatch, be)
        g, out, s, gone, error = _drop_joined_stream_in_capture(index)
        assert gone() is None and len(destroyed) <= 1      # (0 once the destroy waits for the capture end)
        assert error is None, f"capture_end: {type(error).__name__}: {error}"
        with accel.device_index(index), s:
            g.replay()
        s.synchronize()
        assert (out.to_numpy() == 3).all()
        del g
        gc.collect()
        accel.synchronize(index)
        accel.memory.empty_cache()
        assert accel.memory.memory_stats(index)["allocated_bytes.all.current"] == 4096     # `out` only
    finally:
        from accel import graphs
        graphs._unfinished.clear()
        sim.reset()


@pytest.mark.parametrize("index", [0, 1])
def test_stream_close_in_capture_is_refused_before_the_call(be, monkeypatch, index):
    """close() of a stream in a capture (the origin or a joined one) never reaches
    cudaStreamDestroy: accel refuses first (streams.py Stream.close), so the H100's 0 changes
    nothing there."""
    calls = _spy(monkeypatch, be, "cudaStreamDestroy")
    with accel.device_index(index):
        s = accel.Stream()
        buf = accel.Buffer(4096, stream=s)
        g = accel.Graph()
        with s:
            g.capture_begin()
            side = accel.Stream()
            side.wait_stream(s)
            buf.fill_(2, side)
            s.wait_stream(side)
            for stream in (s, side):
                with pytest.raises(RuntimeError, match="a graph capture on it is underway"):
                    stream.close()
            g.capture_end()
        assert calls == []
        with s:
            g.replay()
        s.synchronize()
        assert (buf.to_numpy() == 2).all()
        side.close()
    assert [rc for _, rc in calls] == [0]


@pytest.mark.parametrize("index", [0, 1])
def test_origin_stream_dropped_in_capture_is_held_until_the_end(be, monkeypatch, index):
    """The capturing (origin) stream: the Graph holds it through the capture, so dropping the
    caller's last reference destroys nothing before capture_end (cudaStreamDestroy of the origin
    is never made in a capture, H100's 0 or the simulator's 900 alike)."""
    calls = _spy(monkeypatch, be, "cudaStreamDestroy")
    with accel.device_index(index):
        buf = accel.Buffer(4096)
        buf.fill_(0)
        accel.synchronize(index)
        g = accel.Graph()
        s = accel.Stream()
        with s:
            g.capture_begin()
        buf.fill_(6, s)
        handle = s.handle
        del s
        gc.collect()
        assert calls == []
        assert _capturing(be, handle)
        with accel.Stream.from_handle(handle, index) as again:
            g.capture_end()
            g.replay()
            again.synchronize()
    assert (buf.to_numpy() == 6).all()
    assert all(rc == 0 for _, rc in calls)


# -- cudaGraphDestroy during another capture (H100: 0; the simulator: 900, that capture invalidated) ---

def _unjoined_end_once(monkeypatch, be) -> None:
    """The first cudaStreamEndCapture fails as for unjoined work (904) and leaves the capture
    underway, which the Runtime API allows for a capture that was not invalidated (only an
    invalidated capture is documented to end on failure): accel/backends/cuda/graphs.py capture_end then
    ends it again and destroys what it captured."""
    real = be.lib.cudaStreamEndCapture
    state = {"n": 0}

    def end(stream, graph):
        state["n"] += 1
        if state["n"] == 1:
            return 904          # cudaErrorStreamCaptureUnjoined
        return real(stream, graph)
    monkeypatch.setattr(be.lib, "cudaStreamEndCapture", end)


def _capture_beside_a_failed_end(index):
    """A capture on device ``index`` goes on while a capture on the other device fails to end
    (``_unjoined_end_once``).  Returns (error of the failed end, error of the other end, buffer)."""
    other = 1 - index
    s_ok, s_bad = accel.Stream(device=index), accel.Stream(device=other)
    b_ok, b_bad = accel.Buffer(4096, device=index), accel.Buffer(4096, device=other)
    b_ok.fill_(0, s_ok)
    s_ok.synchronize()
    g_ok, g_bad = accel.Graph(), accel.Graph()
    with accel.device_index(index), s_ok:
        g_ok.capture_begin()
        b_ok.fill_(7, s_ok)
    bad_error = ok_error = None
    with accel.device_index(other), s_bad:
        g_bad.capture_begin()
        b_bad.fill_(5, s_bad)
        try:
            g_bad.capture_end()
        except accel.CaptureError as exc:
            bad_error = exc
    with accel.device_index(index), s_ok:
        try:
            g_ok.capture_end()
            g_ok.replay()
        except Exception as exc:       # noqa: BLE001 (reported by the caller)
            ok_error = exc
    s_ok.synchronize()
    return bad_error, ok_error, b_ok


@pytest.mark.parametrize("index", [0, 1])
def test_failed_end_beside_another_capture_h100(be, monkeypatch, index):
    """H100: the cleanup's cudaGraphDestroy returns 0 during the other capture, which goes on."""
    monkeypatch.setattr(sim.cudart.graphs, "_graph_destroy_in_capture", lambda R: 0)
    _unjoined_end_once(monkeypatch, be)
    destroys = _spy(monkeypatch, be, "cudaGraphDestroy")
    bad, ok, buf = _capture_beside_a_failed_end(index)
    assert "cudaErrorStreamCaptureUnjoined" in str(bad)
    assert ok is None, f"{type(ok).__name__}: {ok}"
    assert (buf.to_numpy() == 7).all()
    assert destroys and all(rc == 0 for _, rc in destroys)
    assert sim.state().captures == 0


@pytest.mark.parametrize("index", [0, 1])
def test_failed_end_beside_another_capture_sim(be, monkeypatch, index):
    """The simulator as it is (graph destroys refused during a capture, as torch PR 161037 and Warp
    issue 992 report of drivers): the failed end must not break the other device's capture."""
    _unjoined_end_once(monkeypatch, be)
    bad, ok, buf = _capture_beside_a_failed_end(index)
    assert "cudaErrorStreamCaptureUnjoined" in str(bad)
    assert ok is None, f"{type(ok).__name__}: {ok}"
    assert (buf.to_numpy() == 7).all()
    assert sim.state().graphs == 0          # the failed capture's graph destroyed once the other capture ended



@pytest.mark.parametrize("index", [0, 1])
def test_graph_reset_during_another_capture_defers_the_destroys(be, monkeypatch, index):
    """Graph.reset() / a graph's collection while another capture is underway: the backend
    queues cudaGraphExecDestroy/cudaGraphDestroy for the end of the captures (accel/backends/cuda/graphs.py graph_destroy,
    _after_captures), so neither reaches the runtime inside a capture."""
    destroys = _spy(monkeypatch, be, "cudaGraphDestroy")
    exec_destroys = _spy(monkeypatch, be, "cudaGraphExecDestroy")
    with accel.device_index(index):
        s = accel.Stream()
        buf = accel.Buffer(4096, stream=s)
        old = accel.Graph()
        with s, old:
            buf.fill_(1, s)
        old.replay()
        s.synchronize()
        del destroys[:], exec_destroys[:]        # (the capture's own cudaGraphDestroy after instantiating)
        g = accel.Graph()
        with s:
            g.capture_begin()
            buf.fill_(2, s)
            old.reset()
            assert destroys == [] and exec_destroys == []
            g.capture_end()
            g.replay()
        s.synchronize()
    assert (buf.to_numpy() == 2).all()
    assert [rc for _, rc in exec_destroys][:1] == [0]       # old's, once the capture ended
    assert all(rc == 0 for _, rc in destroys + exec_destroys)


# -- cudaGraphLaunch after the kernels' library was unloaded (H100: 0; the simulator: 98) ------------

@pytest.fixture
def saxpy_on(be):
    from test_user_kernels import saxpy_reference
    sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64")
    yield
    sim.unregister_kernel("saxpy")


def _graph_of_saxpy(index):
    from test_user_kernels import SAXPY_PTX, _data, _device_arrays
    n = 256
    x, y = _data(n, 8)
    m = accel.Module(SAXPY_PTX, device=index)
    k = m.function("saxpy")
    s = accel.Stream(device=index)
    with accel.device_index(index):
        bx, by = _device_arrays(x, y, stream=s)
        g = accel.Graph()
        with s, g:
            accel.launch(k, 1, 256, 0.5, bx, by, n)
    return m, g, s, (x, y, by)


@pytest.mark.parametrize("index", [0, 1])
def test_close_racing_a_replay_never_unloads_before_the_launch(be, saxpy_on, monkeypatch, index):
    """A close() in another thread as replay() runs: either replay refuses (the module was closed)
    or the launch is queued before the unload.  Never a cudaGraphLaunch of unloaded kernels
    (H100: 0, undefined; the spy answers 0 as the H100 and records whether the module was loaded)."""
    import threading
    from test_user_kernels import expected
    m, g, s, (x, y, by) = _graph_of_saxpy(index)
    real_launch = be.lib.cudaGraphLaunch
    launched = []

    def launch(graph_exec, stream):
        launched.append(m._handle is not None)
        return real_launch(graph_exec, stream) if m._handle is not None else 0   # H100: 0
    monkeypatch.setattr(be.lib, "cudaGraphLaunch", launch)
    real_graph_launch = be.graph_launch
    closer = threading.Thread(target=m.close)

    def racing(*args):
        closer.start()              # another thread's close() lands here, after replay()'s check
        closer.join(0.5)            # (blocked there, when replay holds the module, until it returns)
        return real_graph_launch(*args)
    monkeypatch.setattr(be, "graph_launch", racing)
    error = None
    with accel.device_index(index), s:
        try:
            g.replay()
        except RuntimeError as exc:
            error = exc
    closer.join()
    s.synchronize()
    assert m.closed
    if error is not None:
        assert "was closed, but this graph launches its kernels" in str(error)
        assert launched == []
    else:
        assert launched == [True]
        assert by.to_numpy("float32", stream=s).tobytes() == expected(0.5, x, y).tobytes()


@pytest.mark.parametrize("index", [0, 1])
def test_replay_after_close_is_refused_before_the_launch(be, saxpy_on, monkeypatch, index):
    """Without a race, replay() of a graph whose module was closed raises before cudaGraphLaunch
    (graphs/graph_class.py replay), so the H100's 0 is never reached."""
    m, g, s, (x, y, by) = _graph_of_saxpy(index)
    calls = _spy(monkeypatch, be, "cudaGraphLaunch")
    m.close()
    with accel.device_index(index), s, pytest.raises(RuntimeError, match="but this graph launches its kernels"):
        g.replay()
    assert calls == []
    s.synchronize()
    assert by.to_numpy("float32", stream=s).tobytes() == y.tobytes()


# -- virtual memory (cuMem*) inside a global capture (H100: 0, the capture goes on) -------------------

_CU_MEM = ("cuMemAddressReserve", "cuMemAddressFree", "cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap",
           "cuMemSetAccess")


def _cu_mem_calls() -> dict:
    return {k: v for k, v in sim.calls().items() if k in _CU_MEM}


def h100_vmm_in_capture(monkeypatch) -> None:
    """Every cuMem* call succeeds during a capture and leaves it valid, as on the H100
    (vmm_during_capture): the simulator's refusal of them is one function."""
    monkeypatch.setattr(sim.cuda_driver, "_unsafe", lambda cudart, R: 0)


@needs_vmm
@pytest.mark.parametrize("h100", [False, True], ids=["sim", "h100"])
@pytest.mark.parametrize("index", [0, 1])
def test_expandable_segments_make_no_vmm_call_in_an_accel_capture(monkeypatch, index, h100):
    """accel never calls cuMem* while its own capture is underway: the allocator takes classic
    segments for capture-time misses (_caching.py _malloc_miss), frees to the graph's pool, and the
    backend refuses any cuMem* itself first (accel/backends/cuda/vmm.py _vmm_not_capturing).  The H100's 0 is
    therefore never reached, and the allocator does the same on both."""
    use_sim(monkeypatch, "cuda", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    if h100:
        h100_vmm_in_capture(monkeypatch)
    try:
        with accel.device_index(index):
            s = accel.Stream()
            warm = accel.Buffer(4 * MiB, stream=s)         # an expandable segment exists
            warm.fill_(1, s)
            s.synchronize()
            del warm
            before = _cu_mem_calls()
            g = accel.Graph()
            with s:
                g.capture_begin()
                big = accel.Buffer(8 * MiB, stream=s)       # a miss during the capture
                big.fill_(9, s)
                small = accel.Buffer(4096, stream=s)
                small.fill_(9, s)
                del big
                g.capture_end()
            assert _cu_mem_calls() == before
            g.replay()
            s.synchronize()
            assert (small.to_numpy() == 9).all()
            del g
            gc.collect()
            accel.memory.empty_cache()
    finally:
        sim.reset()


@needs_vmm
@pytest.mark.parametrize("index", [0, 1])
def test_expandable_segment_grows_in_a_foreign_capture_h100(monkeypatch, index):
    """A capture accel did not begin (another library's, on accel's stream) is not counted by the
    backend, so the allocator may grow an expandable segment in it.  H100: the cuMem* calls return 0
    and the capture goes on; the allocation is served from the segment and stays consistent."""
    use_sim(monkeypatch, "cuda", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    h100_vmm_in_capture(monkeypatch)
    try:
        be = _lazy.lazy_init()
        with accel.device_index(index):
            s = accel.Stream()
            handle = be._cast("cudaStream_t", s.handle)
            assert be.lib.cudaStreamBeginCapture(handle, 0) == 0     # cudaStreamCaptureModeGlobal
            before = _cu_mem_calls()
            buf = accel.Buffer(4 * MiB, stream=s)
            buf.fill_(3, s)
            assert _cu_mem_calls() != before                        # grown inside the capture
            graph = be.ffi.new("cudaGraph_t *")
            assert be.lib.cudaStreamEndCapture(handle, graph) == 0
            assert be.lib.cudaGraphDestroy(graph[0]) == 0
            buf.fill_(5, s)
            s.synchronize()
            assert (buf.to_numpy() == 5).all()
            stats = accel.memory.memory_stats(index)
            assert stats["allocated_bytes.all.current"] == 4 * MiB
            del buf
            accel.memory.empty_cache()
            assert accel.memory.memory_stats(index)["reserved_bytes.all.current"] == 0
        assert sim.state().vmm_mappings == 0
    finally:
        sim.reset()


@needs_vmm
@pytest.mark.parametrize("index", [0, 1])
def test_expandable_segment_in_a_foreign_capture_sim(monkeypatch, index):
    """The simulator as it is: the cuMem* refusal (900) reaches the allocator as CaptureError, which
    _malloc_miss catches and answers with a classic segment (cudaMalloc, refused in the global
    capture too): the caller gets CaptureError, and nothing is left mapped or counted."""
    use_sim(monkeypatch, "cuda", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    try:
        be = _lazy.lazy_init()
        with accel.device_index(index):
            s = accel.Stream()
            handle = be._cast("cudaStream_t", s.handle)
            assert be.lib.cudaStreamBeginCapture(handle, 0) == 0
            with pytest.raises(accel.CaptureError):
                accel.Buffer(4 * MiB, stream=s)
            graph = be.ffi.new("cudaGraph_t *")
            assert be.lib.cudaStreamEndCapture(handle, graph) == 901
            be.clear_error()
            assert accel.memory.memory_stats(index)["allocated_bytes.all.current"] == 0
            buf = accel.Buffer(4 * MiB, stream=s)                 # after the capture: served again
            buf.fill_(2, s)
            s.synchronize()
            assert (buf.to_numpy() == 2).all()
    finally:
        sim.reset()


# -- cuMemUnmap of a range not mapped (H100: 0; the simulator: CUDA_ERROR_INVALID_VALUE) ---------------

@needs_vmm
@pytest.mark.parametrize("h100", [False, True], ids=["sim", "h100"])
@pytest.mark.parametrize("index", [0, 1])
def test_release_retried_after_an_interrupted_unmap(be, monkeypatch, index, h100):
    """_expandable.py _exp_release: a KeyboardInterrupt as cuMemUnmap returned leaves the range
    'unsure'; the retry unmaps it again, which the simulator refuses (taken as done: clear_error)
    and the H100 answers 0.  Both end released, counted once, nothing left mapped."""
    from accel.memory import _config
    from accel.memory._caching import DeviceCachingAllocator
    alloc = DeviceCachingAllocator(be, index, _config.parse("expandable_segments:True"))
    drv = be._vmm()
    real_unmap = drv.fns["cuMemUnmap"]
    if h100:
        def unmap(va, n):
            rc = real_unmap(va, n)
            return 0 if rc == 1 else rc          # CUDA_ERROR_INVALID_VALUE (not mapped) -> 0
        monkeypatch.setitem(drv.fns, "cuMemUnmap", unmap)
    ptr = alloc.malloc(4 * MiB)
    alloc.free(ptr)
    real = be.vmm_unmap
    hits = []

    def interrupted(va, n):
        real(va, n)
        if not hits:
            hits.append(va)
            raise KeyboardInterrupt      # as the call returned: unmapped, the caller cannot tell
    monkeypatch.setattr(be, "vmm_unmap", interrupted)
    with pytest.raises(KeyboardInterrupt):
        alloc.empty_cache()
    assert hits and hits[0] in alloc._unsure
    alloc.empty_cache()
    stats = alloc.stats()
    assert stats["reserved_bytes.all.current"] == 0
    assert not alloc._unreleased and not alloc._unsure
    st = sim.state()
    assert st.vmm_mappings == 0 and st.vmm_handles == 0
    assert be.lib.cudaGetLastError() == 0


# -- stream-ordered allocation (cudaMallocAsync/cudaFreeAsync): arguments accel never passes -----------

@pytest.mark.parametrize("index", [0, 1])
def test_async_allocator_never_makes_the_refused_pool_calls(monkeypatch, index):
    """backend:cudaMallocAsync (memory/_async.py): a 0-byte malloc returns 0 without cudaMallocAsync,
    free(0) is a no-op, only pointers from cudaMallocAsync reach cudaFreeAsync, frees during a capture
    are deferred unless the allocation is the capture's own (then freed on the capture's stream
    after the allocation stream).  So cudaFreeAsync(NULL), of a cudaMalloc pointer, of another
    graph's allocation, unordered, and cudaMallocAsync(0) (H100: 0, the simulator: 1) never happen."""
    use_sim(monkeypatch, "cuda", PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    be = _lazy.lazy_init()
    mallocs = _spy(monkeypatch, be, "cudaMallocAsync")
    frees = _spy(monkeypatch, be, "cudaFreeAsync")
    with accel.device_index(index):
        s, side = accel.Stream(), accel.Stream()
        alloc = accel.memory.device_allocator(index)
        assert alloc.malloc(0) == 0
        alloc.free(0)
        kept = accel.Buffer(4096, stream=s)
        kept.fill_(0, s)
        s.synchronize()
        first = accel.Graph()
        with s:
            first.capture_begin()
            g1 = accel.Buffer(4096, stream=s)           # the first graph's allocation, kept
            g1.fill_(1, s)
            first.capture_end()
        second = accel.Graph()
        with s:
            second.capture_begin()
            del g1                                       # another graph's allocation: deferred
            side.wait_stream(s)
            tmp = accel.Buffer(4096, stream=side)        # allocated on a joined stream
            tmp.fill_(2, side)
            s.wait_stream(side)
            kept.copy_from(tmp, stream=s)
            del tmp                                      # freed in the capture, after its stream
            second.capture_end()
        first.replay()
        second.replay()
        s.synchronize()
        assert (kept.to_numpy() == 2).all()
        del first, second, kept
        gc.collect()
        accel.synchronize(index)
        accel.memory.empty_cache()
    assert all(rc == 0 for _, rc in mallocs + frees), [rc for _, rc in mallocs + frees]
    assert all(args[1] > 0 for args, _ in mallocs)
    assert all(args[0] != be.ffi.NULL for args, _ in frees)
    assert accel.memory.memory_stats(index)["allocated_bytes.all.current"] == 0


# -- copies: kinds, synchronous cudaMemcpy, pageable memory in a capture -----------------------------

@pytest.mark.parametrize("index", [0, 1])
def test_copies_pass_cudaMemcpyDefault_and_never_cudaMemcpy(be, monkeypatch, index):
    """Every copy accel makes is cudaMemcpyAsync with cudaMemcpyDefault (accel/backends/cuda/memory.py memcpy_async), so a
    kind that does not match pinned, pool or mapped memory (H100: 0, the simulator: 1) never
    happens; synchronous cudaMemcpy (overlapping, wrong kind, or in a global capture: H100 0,
    the simulator 1 or 900) is never called (no binding of accel calls it)."""
    asyncs = _spy(monkeypatch, be, "cudaMemcpyAsync")
    syncs = _spy(monkeypatch, be, "cudaMemcpy")
    with accel.device_index(index):
        s = accel.Stream()
        host = np.arange(4096, dtype=np.uint8)
        a, b = accel.Buffer(4096, stream=s), accel.Buffer(4096, stream=s)
        a.copy_from(host, stream=s)
        b.copy_from(a, stream=s)
        pinned = accel.empty_pinned(4096)
        pinned[:] = 7
        a.copy_from(pinned, stream=s, non_blocking=True)
        other = accel.Buffer(4096, device=1 - index)
        other.copy_from(b)
        g = accel.Graph()
        with s:
            g.capture_begin()
            b.copy_from(a, stream=s)
            a.copy_from(pinned, stream=s, non_blocking=True)
            g.capture_end()
            g.replay()
        s.synchronize()
        assert (b.to_numpy() == 7).all() and (other.to_numpy() == host).all()
    assert syncs == []
    assert asyncs and all(args[3] == 4 and rc == 0 for args, rc in asyncs)


@pytest.mark.parametrize("index", [0, 1])
def test_pageable_copy_in_a_capture_is_refused_before_the_call(be, monkeypatch, index):
    """A pageable host copy on a capturing stream (H100: 0; the simulator: 900, capture invalidated)
    is refused by accel before any runtime call (buffer/capture.py _capture_hold), and the capture goes on."""
    asyncs = _spy(monkeypatch, be, "cudaMemcpyAsync")
    with accel.device_index(index):
        s = accel.Stream()
        a = accel.Buffer(4096, stream=s)
        a.fill_(0, s)
        g = accel.Graph()
        with s:
            g.capture_begin()
            for non_blocking in (False, True):
                with pytest.raises(accel.CaptureError, match="unless the CPU memory is pinned"):
                    a.copy_from(np.ones(4096, np.uint8), stream=s, non_blocking=non_blocking)
            a.fill_(8, s)
            g.capture_end()
            assert asyncs == []
            g.replay()
        s.synchronize()
        assert (a.to_numpy() == 8).all()


# -- cudaThreadExchangeStreamCaptureMode with an unknown mode (H100: 0; the simulator: 1) ----------------

@pytest.mark.parametrize("index", [0, 1])
def test_capture_mode_exchange_passes_only_known_modes(be, monkeypatch, index):
    """The only caller (accel/backends/cuda/memory.py _relaxed_capture_mode, around a cudaMalloc/cudaHostAlloc in a
    capture) passes cudaStreamCaptureModeRelaxed and then the mode it got back."""
    calls = _spy(monkeypatch, be, "cudaThreadExchangeStreamCaptureMode")
    with accel.device_index(index):
        s = accel.Stream()
        g = accel.Graph()
        with s:
            g.capture_begin()
            b = accel.Buffer(8 * MiB, stream=s)        # a segment cudaMalloc'ed in the capture
            b.fill_(1, s)
            pinned = accel.empty_pinned(1 << 16)        # cudaHostAlloc in the capture
            g.capture_end()
            g.replay()
        s.synchronize()
        assert (b.to_numpy() == 1).all() and pinned.nbytes == 1 << 16
    assert calls, "no capture-time allocation went through the relaxed mode"
    assert all(rc == 0 for _, rc in calls)
    # each exchange writes the previous mode into its argument: relaxed in, a known mode out
    assert all(args[0][0] in (0, 1, 2) for args, _ in calls)


# -- cudaStreamWaitEvent with the external flag on an event of the same capture ------------------------

@pytest.mark.parametrize("index", [0, 1])
def test_external_event_waited_in_its_own_capture(be, monkeypatch, index):
    """An Event(external=True) recorded inside a capture is recorded with cudaEventRecordExternal
    (an event record node, accel/backends/cuda/streams.py event_record), never plainly, so a wait on it with the external
    flag in the same capture is not the refused case (the simulator: 900 for an event *plainly*
    recorded in the capture; H100: 0): no wait returns 900 and the capture stays valid."""
    waits = _spy(monkeypatch, be, "cudaStreamWaitEvent")
    with accel.device_index(index):
        s, side = accel.Stream(), accel.Stream()
        a = accel.Buffer(4096, stream=s)
        a.fill_(0, s)
        s.synchronize()
        ev = accel.Event(external=True)
        g = accel.Graph()
        with s:
            g.capture_begin()
            side.wait_stream(s)
            a.fill_(4, s)
            ev.record(s)
            ev.wait(side)
            a.fill_(5, side)
            s.wait_stream(side)
            g.capture_end()
            g.replay()
        s.synchronize()
        assert (a.to_numpy() == 5).all()
    assert any(args[2] == 1 for args, _ in waits)
    assert all(rc == 0 for _, rc in waits), [rc for _, rc in waits]


# -- occupancy for a block above 1024 threads (H100: 0; the simulator: 1) ----------------------------

@pytest.mark.parametrize("index", [0, 1])
def test_occupancy_queries_stay_within_the_block_limit(be, saxpy_on, monkeypatch, index):
    """Kernel.max_potential_block_size (kernels/_module.py) clips every block size it asks about
    to min(limit, the device's max threads per block, the kernel's): never above 1024."""
    from test_user_kernels import SAXPY_PTX
    k = accel.Module(SAXPY_PTX, device=index).function("saxpy")
    calls = _spy(monkeypatch, be, "cudaOccupancyMaxActiveBlocksPerMultiprocessor")
    for limit in (0, 1025, 4096, 1 << 20):
        grid, block = k.max_potential_block_size(block_size_limit=limit)
        assert 0 < block <= 1024 and grid > 0
    assert calls and all(0 < args[2] <= 1024 and rc == 0 for args, rc in calls)


# -- cudaGetDeviceCount in a child forked after CUDA started (H100: 0; the simulator: 3) --------------

@pytest.mark.parametrize("index", [0, 1])
def test_forked_child_counts_without_the_runtime(be, index):
    """device_count() in a child forked after init answers from the parent's final count
    (accel/backends/cuda/discovery.py count): the child never calls cudaGetDeviceCount, and lazy_init refuses
    there before any runtime call (_lazy.py), so the H100's 0 is never relied on or reached."""
    from conftest import run_forked, vendor_calls_made_by
    accel.Buffer(64, device=index)

    def child():
        calls = vendor_calls_made_by(lambda: accel.device_count())
        if accel.device_count() != 2 or "cudaGetDeviceCount" in calls:
            return 3
        try:
            accel.Buffer(64, device=index)
        except RuntimeError as exc:
            return 0 if "forked subprocess" in str(exc) else 4
        return 5
    assert run_forked(child) == 0
