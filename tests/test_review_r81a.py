"""r81a: adversarial review of the lead's fixes edb6282 (copies on DLPack export), 2987123 (a graph
replay pins its buffers and records its stream), 8bfcdf9 (launch pins Buffer subclasses), 14d7210
(streams: subclass blocks, a handle reissued after a foreign reset, wrappers anchoring accel's own
streams) and 1ca8ce9 (Graph.reset forgets an invalid handle; primary context state asked each time),
seen from accel's public API on the simulators.
"""

import gc
import os
import sys
import threading
import warnings

import numpy as np
import pytest

import accel
from accel import Graph, _dlpack
from accel._dlpack import FLAG_IS_COPIED, FLAG_READ_ONLY

import test_interrupt_allocator as tia
from conftest import use_sim

DEV = 1


@pytest.fixture
def cuda(monkeypatch):
    use_sim(monkeypatch, "cuda")
    accel.set_device_index(0)
    accel._lazy.lazy_init()
    return "cuda"


def _capture(stream, work, g=None):
    g = Graph() if g is None else g
    with stream:
        g.capture_begin()
        try:
            work()
        finally:
            g.capture_end()
    return g


def _calls():
    return dict(accel.sim.calls())


def _delta(before, after):
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


# == 2987123: a replay pins its captured buffers ==================================================

_PINS = os.path.abspath(sys.modules["accel.buffer.pins"].__file__)
_GRAPH = os.path.abspath(sys.modules["accel.graphs.graph_class"].__file__)


def _replay_setup():
    with accel.device_index(DEV):
        bufs = [accel.Buffer(512).fill_(0) for _ in range(3)]
        accel.synchronize()
        s, r = accel.Stream(), accel.Stream()
        g = _capture(s, lambda: [b.fill_(i + 1) for i, b in enumerate(bufs)])
    return bufs, r, g


def _replay(g, r):
    with accel.device_index(DEV), r:
        g.replay()


# r81a: accel.graphs.graph_class.Graph.replay / accel.buffer.pins.pin_noted: a Ctrl-C inside
# pin_noted (at its loop's back jump, or as _begin_use returns) leaves the pins it took with no owner:
# replay's `pinned` is still () and pin_noted's list is lost, so the finally unpins nothing; the
# buffer's close() then leaves its memory to a pin that never ends (never freed). Same for a Ctrl-C
# inside unpin_noted's loop.
# r81a, fixed in session 39: graph_class.Graph.replay/pins.pin_noted: a Ctrl-C inside pin_noted or
# unpin_noted leaves a pin behind, close() never frees
def test_a_ctrl_c_anywhere_in_replays_pinning_leaves_no_pin(cuda):
    bufs, r, g = _replay_setup()
    with tia._Inject(0, {_PINS, _GRAPH}) as counting:
        _replay(g, r)
    accel.synchronize()
    assert all(not b._pins for b in bufs)
    total = counting.count
    assert total > 0
    leaked = []
    for n in range(1, total + 1):
        try:
            with tia._Inject(n, {_PINS, _GRAPH}) as inj:
                _replay(g, r)
        except KeyboardInterrupt:
            pass
        accel.synchronize()
        if any(b._pins for b in bufs):
            leaked.append(inj.site)
            for b in bufs:
                b._pins.clear()
    assert not leaked, f"pins left behind by a Ctrl-C at {leaked} of {total} points"


_CONFS = [None, "expandable_segments:True", "backend:cudaMallocAsync"]


def _conf_sim(monkeypatch, conf, var="ACCEL_ALLOC_CONF"):
    env = {"ACCEL_SIM_DELAY_US": 2000}
    if conf is not None:
        env[var] = conf
    use_sim(monkeypatch, "cuda", **env)
    accel.set_device_index(0)
    accel._lazy.lazy_init()


@pytest.mark.parametrize("conf", _CONFS)
@pytest.mark.parametrize("where", ["capture", "allocation", "other"])
def test_a_block_closed_after_a_replay_is_not_reused_before_the_replay_ran(monkeypatch, conf, where):
    _conf_sim(monkeypatch, conf, "PYTORCH_CUDA_ALLOC_CONF" if conf and "Async" in conf else "ACCEL_ALLOC_CONF")
    with accel.device_index(DEV):
        b = accel.Buffer(1 << 16).fill_(0)
        accel.synchronize()
        s, r = accel.Stream(), accel.Stream()
        g = _capture(s, lambda: b.fill_(7))
        stream = {"capture": s, "allocation": accel.current_stream(), "other": r}[where]
        with stream:
            g.replay()
        assert b.last_stream == stream
        assert not b._pins
        b.close()
        # the next allocation of the same size, filled on the current stream: the replay's fill of 7
        # must not land on it
        n = accel.Buffer(1 << 16).fill_(9)
        accel.synchronize()
        assert set(n.to_numpy().tolist()) == {9}
        n.close()
        del g
        gc.collect()
        accel.synchronize()
        accel.memory.empty_cache()
        assert accel.memory.memory_allocated(DEV) == 0


def test_a_graph_on_device_1_replayed_while_device_0_is_current(cuda):
    with accel.device_index(DEV):
        b = accel.Buffer(512).fill_(0)
        accel.synchronize()
        s = accel.Stream()
        g = _capture(s, lambda: b.fill_(4))
    assert accel.current_device_index() == 0
    g.replay()
    assert accel.current_device_index() == 0
    assert b.last_stream == accel.current_stream(DEV)
    accel.synchronize(DEV)
    assert set(b.to_numpy().tolist()) == {4}
    assert not b._pins


def test_a_thousand_replays_grow_nothing(cuda):
    bufs, r, g = _replay_setup()
    other = accel.Stream(device=DEV)
    for i in range(20):
        _replay(g, r if i % 2 else other)
    accel.synchronize(DEV)
    gc.collect()
    state0 = accel.sim.state()
    mem0 = accel.memory.memory_allocated(DEV)
    for i in range(1000):
        _replay(g, r if i % 2 else other)
    accel.synchronize(DEV)
    gc.collect()
    state1 = accel.sim.state()
    assert state1.events == state0.events
    assert state1.streams == state0.streams
    assert all(not b._pins for b in bufs)
    assert accel.memory.memory_allocated(DEV) == mem0
    for b in bufs:
        b.close()
    del g
    gc.collect()
    accel.synchronize()
    accel.memory.empty_cache()
    assert accel.memory.memory_allocated(DEV) == 0
    assert accel.sim.state().live_allocations.get(DEV, 0) == 0


def test_a_buffer_closed_by_another_thread_during_the_launch_is_freed_after_it(cuda, monkeypatch):
    bufs, r, g = _replay_setup()
    backend = accel._lazy.lazy_init()
    real = backend.graph_launch
    seen = {}

    def launch(exec_, handle):
        t = threading.Thread(target=bufs[0].close)
        t.start()
        t.join(5)
        assert not t.is_alive()
        seen["during"] = accel.memory.memory_allocated(DEV)
        return real(exec_, handle)

    monkeypatch.setattr(backend, "graph_launch", launch)
    mem0 = accel.memory.memory_allocated(DEV)
    _replay(g, r)
    monkeypatch.setattr(backend, "graph_launch", real)
    assert seen["during"] == mem0        # kept by the replay's pin
    assert bufs[0]._closed and not bufs[0]._pins
    accel.synchronize()
    assert accel.memory.memory_allocated(DEV) == mem0 - 512


def test_a_private_pool_buffer_is_read_after_replays_on_another_stream(cuda):
    with accel.device_index(DEV):
        src = accel.Buffer(512).fill_(3)
        accel.synchronize()
        s, r = accel.Stream(), accel.Stream()
        out = {}
        g = _capture(s, lambda: out.setdefault("t", accel.Buffer(512).copy_from(src)))
        t = out.pop("t")
        src.fill_(5)
        with r:
            g.replay()
        assert t.last_stream == r
        r.synchronize()
        assert set(t.to_numpy().tolist()) == {5}
        t.close()
        g.reset()
        del g
        src.close()
        gc.collect()
        accel.synchronize()
        accel.memory.empty_cache()
        assert accel.memory.memory_allocated(DEV) == 0


# == edb6282: copies on export ======================================================================

def _sim(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    accel._lazy.lazy_init()


def _baseline(index=0):
    gc.collect()
    accel.synchronize()
    return accel.memory.memory_allocated(index), len(_dlpack._exports)


# r81a: accel._dlpack.exporting.export_device_copy: with stream=None during a capture the copy is
# queued (captured) before out.__dlpack__ refuses the legacy consumer stream; the refusal says
# "nothing was exported" but the graph keeps a memcpy into a buffer closed at once (a block of the
# graph's pool that a later capture sharing it may be given).  CUDA Runtime API, cudaStreamIsCapturing:
# "When a blocking stream is capturing, the legacy stream is in an unusable state until the blocking
# stream capture is terminated" (so stream=None must be refused, but before anything is queued).
# r81a, fixed in session 39: exporting.export_device_copy: a copy=True export refused during a capture
# (stream=None) leaves its copy captured in the graph
def test_a_refused_copy_export_during_a_capture_captures_nothing(cuda):
    b = accel.Buffer(64).fill_(3)
    accel.synchronize()
    s = accel.Stream()
    g = Graph()
    with s:
        g.capture_begin()
        try:
            b.fill_(7)
            before = _calls()
            with pytest.raises(accel.CaptureError):
                b.__dlpack__(copy=True)
            after = _calls()
        finally:
            g.capture_end()
    assert "cudaMemcpyAsync" not in _delta(before, after)
    assert "cudaMalloc" not in _delta(before, after)


# r81a: accel._dlpack.exporting.export_device_copy orders the copy with sync_for_consumer(buffer,
# <the capturing stream>), which refuses a buffer last used outside the capture; the same copy by
# Buffer.copy_from is captured fine, and the refusal advises "pass stream=-1" to a call that did.
# Array API __dlpack__, copy: "If True, the function must always copy (performed by the producer)";
# stream -1: "producer must not perform any synchronization".
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
# r81a, fixed in session 39: exporting.export_device_copy: copy=True, stream=-1 during a capture
# refused where Buffer.copy_from captures the same copy; its message advises the stream=-1 that was
# passed
def test_a_copy_export_during_a_capture_works_as_copy_from_does(cuda):
    b = accel.Buffer(64).fill_(3)
    accel.synchronize()
    s = accel.Stream()
    g = Graph()
    with s:
        g.capture_begin()
        try:
            capsule = b.__dlpack__(copy=True, stream=-1)
        finally:
            g.capture_end()
    g.replay()
    accel.synchronize()
    assert set(accel.from_dlpack(capsule).to_numpy().tolist()) == {3}


def test_a_refused_copy_export_before_the_copy_leaves_the_capture_valid(cuda):
    b = accel.Buffer(64).fill_(3)
    accel.synchronize()
    s = accel.Stream()
    g = Graph()
    with s:
        g.capture_begin()
        try:
            with pytest.raises(accel.CaptureError):
                b.__dlpack__(dl_device=(1, 0))
        finally:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)   # the empty graph's warning
                g.capture_end()


def test_a_captured_copy_export_with_no_sync_is_a_correct_captured_copy(cuda):
    b = accel.Buffer(64).fill_(3)
    accel.synchronize()
    s = accel.Stream()
    g = Graph()
    with s:
        g.capture_begin()
        try:
            b.fill_(7)
            capsule = b.__dlpack__(copy=True, stream=-1, max_version=(1, 0))
        finally:
            g.capture_end()
    b.fill_(1)
    g.replay()
    accel.synchronize()
    t = _dlpack.parse(capsule)
    assert t.flags & FLAG_IS_COPIED and not t.flags & FLAG_READ_ONLY
    assert set(accel.from_dlpack(capsule).to_numpy().tolist()) == {7}


@pytest.mark.parametrize("versioned", [False, True])
def test_a_copy_export_dropped_or_consumed_returns_memory(cuda, versioned):
    b = accel.Buffer(64).fill_(3)
    base = _baseline()
    mv = (1, 0) if versioned else None
    c = b.__dlpack__(copy=True, max_version=mv)
    t = _dlpack.parse(c)
    assert t.data != b.ptr
    if versioned:
        assert t.flags & FLAG_IS_COPIED and not t.flags & FLAG_READ_ONLY
    del c, t
    assert _baseline() == base
    c = b.__dlpack__(copy=True, max_version=mv)
    x = accel.from_dlpack(c)
    with pytest.raises(BufferError):
        accel.from_dlpack(c)
    assert set(x.to_numpy().tolist()) == {3}
    del x, c
    assert _baseline() == base


def test_a_copy_export_of_a_read_only_import_is_writable_and_flagged(cuda):
    b = accel.Buffer(64).fill_(3)
    accel.synchronize()
    c = b.__dlpack__(max_version=(1, 0))
    from accel._dlpack.abi import DLManagedTensorVersioned
    DLManagedTensorVersioned.from_address(_dlpack.parse(c).address).flags |= FLAG_READ_ONLY
    ro = accel.from_dlpack(c)
    assert ro._readonly
    with pytest.raises(BufferError):
        ro.__dlpack__()                     # a legacy capsule cannot say read-only
    legacy = ro.__dlpack__(copy=True)       # a copy is the consumer's: legacy is fine
    assert _dlpack.parse(legacy).data != ro.ptr
    v = _dlpack.parse(ro.__dlpack__(copy=True, max_version=(1, 0)))
    assert v.flags & FLAG_IS_COPIED and not v.flags & FLAG_READ_ONLY
    view = ro.as_array(np.uint8, (4, 4), (16, 1))
    v = _dlpack.parse(view.__dlpack__(copy=True, max_version=(1, 0)))
    assert v.flags & FLAG_IS_COPIED and not v.flags & FLAG_READ_ONLY
    assert v.shape == (4, 4) and v.strides in (None, (4, 1))


def test_copy_exports_of_empty_0d_and_zero_stride_views(cuda):
    b = accel.Buffer(64)
    b.as_array(np.float32).copy_from(np.arange(16, dtype=np.float32))
    base = _baseline()
    z = _dlpack.parse(accel.Buffer(0).__dlpack__(copy=True))
    assert z.shape == (0,)
    assert _dlpack.parse(b.as_array(np.float32, (0,)).__dlpack__(copy=True)).shape == (0,)
    c = b.as_array(np.float32, (), offset=12).__dlpack__(copy=True, max_version=(1, 0))
    assert _dlpack.parse(c).shape == ()
    assert accel.from_dlpack(c).to_numpy().view(np.float32).tolist() == [3.0]
    c = b.as_array(np.float32, (4, 3), (0, 8), offset=4).__dlpack__(copy=True)
    t = _dlpack.parse(c)
    assert t.shape == (4, 3) and t.strides in (None, (3, 1))
    assert accel.from_dlpack(c).to_numpy().view(np.float32).tolist() == [1.0, 3.0, 5.0] * 4
    del c, t, z
    assert _baseline() == base


def test_a_copy_export_of_device_1_while_device_0_is_current(cuda):
    with accel.device_index(DEV):
        b = accel.Buffer(64).fill_(5)
        s1 = accel.Stream()
    s0 = accel.Stream()
    base = _baseline(DEV)
    for stream in (None, -1, 1, 2, s1.handle, s1):
        c = b.__dlpack__(copy=True, stream=stream)
        assert accel.current_device_index() == 0
        t = _dlpack.parse(c)
        assert (t.device_type, t.device_id) == b.__dlpack_device__()
        x = accel.from_dlpack(c)
        assert set(x.to_numpy().tolist()) == {5}
        del x, c, t
    for bad, exc in ((0, ValueError), (-2, ValueError), (True, TypeError), (1.0, TypeError)):
        before = accel.memory.memory_allocated(DEV)
        with pytest.raises(exc):
            b.__dlpack__(copy=True, stream=bad)
        assert accel.memory.memory_allocated(DEV) == before
    # an accel.Stream of the other device: as the zero-copy export takes it
    b.__dlpack__(stream=s0)
    b.__dlpack__(copy=True, stream=s0)
    assert accel.current_device_index() == 0
    assert _baseline(DEV) == base


def test_a_copy_export_that_runs_out_of_memory_leaves_nothing(cuda):
    b = accel.Buffer(12 << 20).fill_(1)
    base = _baseline()
    live = accel.sim.state().live_allocations
    accel.memory.set_per_process_memory_fraction(0.0)
    try:
        for kw in ({}, {"max_version": (1, 0)}):
            with pytest.raises(accel.OutOfMemoryError):
                b.__dlpack__(copy=True, **kw)
            with pytest.raises(accel.OutOfMemoryError):
                b.as_array(np.float32, (4, 4), (64, 4)).__dlpack__(copy=True, **kw)
    finally:
        accel.memory.set_per_process_memory_fraction(1.0)
    assert _baseline() == base
    assert accel.sim.state().live_allocations == live
    assert not b._pins


def test_a_copy_export_of_a_buffer_closed_by_another_thread_meanwhile(cuda, monkeypatch):
    from accel._dlpack import exporting
    b = accel.Buffer(4096).fill_(1)
    base = _baseline()
    real = exporting.sync_for_consumer

    def closing(buffer, stream):
        real(buffer, stream)
        t = threading.Thread(target=buffer.close)
        t.start()
        t.join(5)
        assert not t.is_alive()

    monkeypatch.setattr(exporting, "sync_for_consumer", closing)
    with pytest.raises(RuntimeError, match="closed"):
        b.__dlpack__(copy=True)
    monkeypatch.setattr(exporting, "sync_for_consumer", real)
    gc.collect()
    accel.synchronize()
    assert accel.memory.memory_allocated(0) == base[0] - 4096
    assert len(_dlpack._exports) == base[1]


@pytest.mark.parametrize("kind", ["xpu", "mps"])
def test_copy_exports_on_xpu_and_mps(monkeypatch, kind):
    _sim(monkeypatch, kind)
    b = accel.Buffer(64).fill_(6)
    base = _baseline()
    for kw in ({}, {"max_version": (1, 0)}, {"stream": -1}):
        c = b.__dlpack__(copy=True, **kw)
        t = _dlpack.parse(c)
        assert t.data != b.ptr
        assert (t.device_type, t.device_id) == b.__dlpack_device__()
        if kw.get("max_version"):
            assert t.flags & FLAG_IS_COPIED and not t.flags & FLAG_READ_ONLY
        assert set(accel.from_dlpack(c).to_numpy().tolist()) == {6}
        del c, t
    with pytest.raises(ValueError):
        b.__dlpack__(copy=True, stream=5)
    host = np.from_dlpack(b, device="cpu")
    assert set(host.tolist()) == {6}
    del host
    assert _baseline() == base


# == 14d7210: streams ===============================================================================

def test_wrappers_of_accels_streams_keep_nothing_beyond_their_life(cuda):
    base = accel.sim.state().streams
    for _ in range(200):
        s = accel.Stream()
        w = accel.Stream.from_handle(s.handle)
        assert w == s and w._anchor is s
        del s, w
    gc.collect()
    assert accel.sim.state().streams == base
    s = accel.Stream()
    w = accel.Stream.from_handle(s.handle)
    del s
    gc.collect()
    assert accel.sim.state().streams == base + 1      # the wrapper's anchor keeps it alive
    b = accel.Buffer(64)
    with w:
        b.fill_(2)
    w.synchronize()
    assert set(b.to_numpy().tolist()) == {2}
    w.close()
    gc.collect()
    assert accel.sim.state().streams == base          # its last wrapper gone: destroyed
    del w
    gc.collect()
    assert accel.sim.state().streams == base


def test_close_of_accels_stream_destroys_it_while_a_wrapper_lives(cuda):
    base = accel.sim.state().streams
    s = accel.Stream()
    w = accel.Stream.from_handle(s.handle)
    s.close()
    assert accel.sim.state().streams == base
    with pytest.raises((accel.AcceleratorError, ValueError, RuntimeError)):
        w.synchronize()
    w.close()


# r81a: accel.streams.foreign._foreign_stream / Stream._check_alive: a wrapper anchored on accel's own
# Stream (14d7210) goes on naming the handle after that Stream's close() destroyed it; once the runtime
# reissues the handle to a new accel stream, the wrapper's work silently lands on that stranger's
# stream. accel knows (w._anchor._closed) and could refuse, as it refuses a closed stream.  CUDA Runtime
# API, cudaStreamDestroy: "Use of the handle after this call is undefined behavior."
# r81a, fixed in session 39: streams.foreign/Stream._check_alive: a wrapper of accel's own stream
# closed by its owner queues work on the stream that got the reissued handle
def test_a_wrapper_of_a_closed_accel_stream_refuses_work_after_the_handle_is_reissued(cuda):
    s = accel.Stream()
    h = s.handle
    w = accel.Stream.from_handle(h)
    s.close()
    s2 = accel.Stream()
    assert s2.handle == h           # the simulator reissues the freed handle (as the driver may)
    b = accel.Buffer(64)
    with pytest.raises((RuntimeError, ValueError)):
        with w:
            b.fill_(1)


def test_a_handle_reissued_after_accels_own_close_or_collection_is_not_forgotten(cuda):
    base = accel.sim.state().streams
    s = accel.Stream()
    h = s.handle
    s.close()
    s2 = accel.Stream()
    assert s2.handle == h and not s2._closed
    del s
    gc.collect()
    s3 = accel.Stream()
    h3 = s3.handle
    del s3
    gc.collect()
    s4 = accel.Stream()
    assert s4.handle == h3 and not s4._closed
    b = accel.Buffer(64)
    with s4:
        b.fill_(3)
    s4.synchronize()
    assert set(b.to_numpy().tolist()) == {3}
    assert accel.sim.state().streams == base + 2
    s2.close()
    s4.close()
    assert accel.sim.state().streams == base


def test_a_subclass_and_a_user_context_manager_around_a_stream_restore_the_current_stream(cuda):
    d = accel.current_stream()
    s, t = accel.Stream(), accel.Stream()

    class Ctx:
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            return self.s.__enter__()

        def __exit__(self, *exc):
            return self.s.__exit__(*exc)

    class Sub(accel.Stream):
        def __enter__(self):
            return super().__enter__()

        def __exit__(self, *exc):
            return super().__exit__(*exc)

    with Ctx(s):
        assert accel.current_stream() == s
        with t:
            assert accel.current_stream() == t
        assert accel.current_stream() == s
    assert accel.current_stream() == d
    u = Sub()

    def gen():
        with u:
            yield 1
        yield 2

    g = gen()
    next(g)
    assert accel.current_stream() == u
    th = threading.Thread(target=g.close)
    th.start()
    th.join(5)
    assert not th.is_alive()
    assert accel.current_stream() == d


# == 1ca8ce9: a handle a foreign reset destroyed; primary context state ===============================

def _foreign_reset(device=0):
    lib = accel.sim.open_library("cudart")
    before = accel._lazy._initialized_backend.get_device()
    assert lib.cudaSetDevice(device) == 0
    assert lib.cudaDeviceReset() == 0
    assert lib.cudaSetDevice(before) == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_the_warning_of_a_reset_after_a_foreign_reset(cuda):
    x = accel.Buffer(64).fill_(1)
    s = accel.Stream()
    g = _capture(s, lambda: x.fill_(2))
    g.replay()
    accel.synchronize()
    _foreign_reset(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g.reset()
    texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(texts) == 1
    assert "exec" in texts[0] and "cudaDeviceReset" in texts[0] and "cudaErrorInvalidResourceHandle" in texts[0]
    assert accel.sim.state().graph_execs == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g.reset()                   # nothing left: no second warning
    del s
    gc.collect()


def test_a_reset_that_failed_otherwise_keeps_the_handle_and_is_retried(cuda):
    x = accel.Buffer(64).fill_(1)
    s = accel.Stream()
    g = _capture(s, lambda: x.fill_(2))
    g.replay()
    accel.synchronize()
    assert accel.sim.state().graph_execs == 1
    accel.sim.inject_error("cudaGraphExecDestroy", 999)      # cudaErrorUnknown
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(accel.AcceleratorError):
            g.reset()
        assert accel.sim.state().graph_execs == 1
        g.reset()
    assert accel.sim.state().graph_execs == 0
    _capture(s, lambda: x.fill_(5), g)
    g.replay()
    accel.synchronize()
    assert set(x.to_numpy().tolist()) == {5}


def test_a_device_scope_asks_the_primary_context_state_once(cuda):
    accel.Buffer(64).fill_(1)
    with accel.device_index(1):
        pass
    before = _calls()
    for _ in range(10):
        with accel.device_index(1):
            pass
    d = _delta(before, _calls())
    assert d.get("cuDevicePrimaryCtxGetState") == 10
    assert "cuDeviceGet" not in d and "cudaGetDriverEntryPoint" not in d
    assert d.get("cudaSetDevice") == 20


def test_xpu_a_block_closed_after_a_replay_on_another_queue_is_not_reused_early(monkeypatch):
    use_sim(monkeypatch, "xpu", ACCEL_SIM_DELAY_US=2000)
    accel.set_device_index(0)
    with accel.device_index(DEV):
        b = accel.Buffer(1 << 16).fill_(0)
        accel.synchronize()
        s, r = accel.Stream(), accel.Stream()
        g = _capture(s, lambda: b.fill_(7))
        with r:
            g.replay()
        assert b.last_stream == r and not b._pins
        b.close()
        n = accel.Buffer(1 << 16).fill_(9)
        accel.synchronize()
        assert set(n.to_numpy().tolist()) == {9}


class _Cycle:
    def __init__(self, g):
        self.g, self.me = g, self


def test_replays_racing_allocations_whose_collections_drop_graphs_do_not_deadlock(cuda):
    """The replay takes the allocator's lock (record_noted) under the graph's launch lock; a
    collection in a malloc (the allocator's lock held) that drops or resets graphs must not wait for
    a launch lock."""
    bufs, r, g = _replay_setup()
    stop = threading.Event()
    errors = []

    def churn():
        try:
            with accel.device_index(DEV):
                s2 = accel.Stream()
                while not stop.is_set():
                    x = accel.Buffer(512).fill_(1)
                    _Cycle(_capture(s2, lambda: x.fill_(2)))
                    _Cycle(g)               # a cycle holding the replayed graph too
                    gc.collect()
                    x.close()
        except Exception as exc:            # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(300):
            _replay(g, r)
    finally:
        stop.set()
        t.join(5)
    assert not t.is_alive(), "deadlock"
    assert not errors
    accel.synchronize()
    assert all(not b._pins for b in bufs)


def test_copy_export_dl_device_forms(cuda):
    with accel.device_index(DEV):
        b = accel.Buffer(64).fill_(8)
    own = b.__dlpack_device__()
    t = _dlpack.parse(b.__dlpack__(dl_device=own, copy=True, max_version=(1, 0)))
    assert t.data != b.ptr and t.flags & FLAG_IS_COPIED and (t.device_type, t.device_id) == own
    t = _dlpack.parse(b.__dlpack__(dl_device=own, copy=False, max_version=(1, 0)))
    assert t.data == b.ptr and not t.flags & FLAG_IS_COPIED
    before = accel.memory.memory_allocated(DEV)
    with pytest.raises(BufferError):
        b.__dlpack__(dl_device=(own[0], 0), copy=True)
    with pytest.raises(ValueError):
        b.__dlpack__(dl_device=(1, 0), copy=False)
    with pytest.raises(TypeError):
        b.__dlpack__(copy=1)
    del t
    gc.collect()
    assert accel.memory.memory_allocated(DEV) == before
    host = _dlpack.parse(b.__dlpack__(dl_device=(1, 0), max_version=(1, 0)))
    assert host.device_type == 1 and host.flags & FLAG_IS_COPIED and not host.flags & FLAG_READ_ONLY
