"""Session 39's fix of r73e: a graph's replay notes the buffers its capture used on the replay
stream (accel.buffer.capture.note_captured; graphs' replay), so an export after a replay on
another stream names the stream where accel's latest work on the memory is queued.

Every use inside a capture is covered: Buffer copies and fills (buffer.pins._Noting), kernel
launches (kernels._launch), random fills (random._device).  The graph keeps only weak references:
bounded by the buffers the capture used, none kept alive.  Device 1 is the data's device while
device 0 stays current; XPU (Level Zero graphs) as well as CUDA.
"""

import gc
import weakref

import numpy as np
import pytest

import accel
from accel import Graph

from conftest import SIMS, use_sim
from torch_port_util import hold
from test_user_kernels import SAXPY_PTX, saxpy_reference, spirv_module

DEV = 1
N = 256


@pytest.fixture(params=[s for s in ("cuda", "xpu") if s in SIMS])
def sim(request, monkeypatch):
    use_sim(monkeypatch, request.param)
    accel.set_device_index(0)
    accel._lazy.lazy_init()
    return request.param


def _saxpy(kind):
    accel.sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64", replace=True)
    if kind == "cuda":
        return accel.Module(SAXPY_PTX, device=DEV).function("saxpy")
    return accel.Module(spirv_module("saxpy"), device=DEV).function("saxpy", "f32, ptr, ptr, u64")


def _captured(stream, work):
    g = Graph()
    with stream:
        g.capture_begin()
        try:
            work()
        finally:
            g.capture_end()
    return g


@pytest.mark.parametrize("use", ["fill_", "copy_from", "launch", "uniform_"])
def test_replay_on_another_stream_becomes_the_last_use_stream(sim, use):
    if sim == "xpu" and use == "uniform_":
        pytest.skip("the Level Zero simulator has no Philox kernels: random fills cannot be captured there")
    with accel.device_index(DEV):
        src = accel.Buffer(N * 4).fill_(0)
        buf = accel.Buffer(N * 4).fill_(0)
        accel.synchronize()
        s, r = accel.Stream(), accel.Stream()
        kernel = _saxpy(sim) if use == "launch" else None
        work = {"fill_": lambda: buf.fill_(7),
                "copy_from": lambda: buf.copy_from(src),
                "launch": lambda: accel.launch(kernel, 1, 64, 2.0, src, buf, N),
                "uniform_": lambda: accel.random.uniform_(buf)}[use]
        g = _captured(s, work)
        assert buf.last_stream == s
        with r:
            g.replay()
        assert buf.last_stream == r, f"{use} captured on {s!r}, replayed on {r!r}: last use {buf.last_stream!r}"
        if use in ("copy_from", "launch"):
            assert src.last_stream == r      # a buffer read by the graph is used by its replays too
        accel.synchronize()
        if kernel is not None:
            accel.sim.unregister_kernel("saxpy")


def test_dlpack_consumer_orders_after_a_replay_on_another_stream(monkeypatch):
    """The consumer stream of ``__dlpack__(stream=...)`` orders after the replay on R: the bytes it
    reads afterwards are the replay's, with R held by a gate until the consumer's read is queued."""
    if "cuda" not in SIMS:
        pytest.skip("ACCEL_TEST_SIMS leaves out cuda")
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=50)
    accel.set_device_index(0)
    with accel.device_index(DEV):
        buf = accel.Buffer(N).fill_(0)
        out = accel.Buffer(N).fill_(1)
        accel.synchronize()
        s, r, consumer = accel.Stream(), accel.Stream(), accel.Stream()
        g = _captured(s, lambda: buf.fill_(7))
        buf.fill_(0, stream=s)
        accel.synchronize()
        gate = hold(r)
        try:
            with r:
                g.replay()
            capsule = buf.__dlpack__(stream=consumer.handle)
            out.copy_from(buf, stream=consumer, non_blocking=True)
            del capsule
        finally:
            gate.set()
        accel.synchronize()
        assert set(out.to_numpy().tolist()) == {7}


def test_the_graph_keeps_no_buffer_alive_and_notes_each_once(sim):
    with accel.device_index(DEV):
        buf = accel.Buffer(N).fill_(0)
        tmp = accel.Buffer(N).fill_(0)
        accel.synchronize()
        s = accel.Stream()

        def work(tmp=tmp):
            for _ in range(50):
                buf.fill_(1)
                tmp.copy_from(buf)

        g = _captured(s, work)
        assert len(g._buffers) == 2
        gone = weakref.ref(tmp)
        del tmp, work
        gc.collect()
        assert gone() is None
        r = accel.Stream()
        with r:
            g.replay()      # (the graph still copies into the freed memory: the user's choice, as in torch)
        accel.synchronize()
        assert buf.last_stream == r
        g.reset()
        assert g._buffers == ()


def test_a_closed_buffer_is_not_noted(sim):
    with accel.device_index(DEV):
        buf = accel.Buffer(N).fill_(0)
        other = accel.Buffer(N).fill_(0)
        accel.synchronize()
        s = accel.Stream()
        g = _captured(s, lambda: (buf.fill_(3), other.fill_(4)))
        accel.synchronize()
        g.reset()               # the graph is gone first: closing the memory it wrote is then safe
        other.close()
        g = _captured(s, lambda: buf.fill_(5))
        r = accel.Stream()
        with r:
            g.replay()
        accel.synchronize()
        assert buf.last_stream == r
        assert np.all(buf.to_numpy() == 5)


def test_a_refused_capture_use_notes_nothing(sim):
    """A fill refused inside a capture (a bad value) leaves no note: the graph's replays do not
    touch the buffer's last-use stream."""
    with accel.device_index(DEV):
        buf = accel.Buffer(N).fill_(0)
        used = accel.Buffer(N).fill_(0)
        accel.synchronize()
        s = accel.Stream()

        def work():
            used.fill_(1)
            with pytest.raises((ValueError, TypeError)):
                buf.fill_(300)

        g = _captured(s, work)
        last = buf.last_stream
        r = accel.Stream()
        with r:
            g.replay()
        accel.synchronize()
        assert buf.last_stream == last and used.last_stream == r
        assert len(g._buffers) == 1


# == r75e: `with stream:` blocks entered through contextlib.ExitStack ===========================
def _in_exit_stack(*streams_):
    import contextlib
    with contextlib.ExitStack() as es:
        for s in streams_:
            es.enter_context(s)
        yield


def test_exit_stack_blocks_closed_on_another_thread_leave_both_devices(sim):
    """Two blocks (device 1, then device 0) entered through one ExitStack in a generator, closed
    by gen.close() on another thread: both entries leave this thread's stack, the other thread's
    streams stay, and this thread's streams are the defaults again."""
    import threading
    from accel import streams
    accel.set_device_index(0)
    s1, s0 = accel.Stream(1), accel.Stream(0)
    gen = _in_exit_stack(s1, s0)
    next(gen)
    assert accel.current_stream(1) == s1 and accel.current_stream(0) == s0
    seen = []

    def close():
        mine = accel.Stream(1)
        accel.set_stream(mine)
        gen.close()
        seen.append(accel.current_stream(1) == mine and accel.current_stream(0) == accel.default_stream(0))
        mine.close()
    t = threading.Thread(target=close)
    t.start()
    t.join(30)
    assert seen == [True]
    assert list(getattr(streams._state._tls, "stack", []) or []) == []
    assert accel.current_stream(0) == accel.default_stream(0) and accel.current_stream(1) == accel.default_stream(1)
    s1.close()
    s0.close()


def test_exit_stack_in_one_frame_closed_in_another_on_the_same_thread(sim):
    import contextlib
    accel.set_device_index(0)
    s = accel.Stream(1)
    es = contextlib.ExitStack()

    def enter():
        es.enter_context(s)
    enter()
    assert accel.current_stream(1) == s
    es.close()
    assert accel.current_stream(1) == accel.default_stream(1)
    assert accel.current_device_index() == 0
    s.close()


# == r80b: copies on export (array API __dlpack__'s copy and dl_device) =========================
@pytest.fixture(params=[s for s in ("cuda", "xpu", "mps") if s in SIMS])
def any_sim(request, monkeypatch):
    use_sim(monkeypatch, request.param)
    accel.set_device_index(0)
    accel._lazy.lazy_init()
    return request.param


def _last_device():
    return accel.device_count() - 1


def test_copy_true_exports_a_device_copy_of_a_strided_view(any_sim):
    from accel import _dlpack
    d = _last_device()
    data = np.arange(64, dtype=np.float32)
    buf = accel.Buffer(data.nbytes, device=d).copy_from(data)
    view = buf.as_array(np.float32, (8, 4), strides=(32, 8), offset=4)
    allocated = accel.memory_allocated(d)
    capsule = view.__dlpack__(copy=True, max_version=(1, 0))
    info = _dlpack.parse(capsule)
    assert (info.device_type, info.device_id) == tuple(view.__dlpack_device__())
    assert info.flags & _dlpack.FLAG_IS_COPIED and not info.flags & _dlpack.FLAG_READ_ONLY
    alias = accel.from_dlpack(capsule)      # consumed: the copy's bytes, C order
    got = alias.as_array(np.float32, (8, 4)).to_numpy()
    want = np.array([[data[1 + 8 * i + 2 * j] for j in range(4)] for i in range(8)])
    assert np.array_equal(got, want) and np.array_equal(view.to_numpy(), want)
    buf.fill_(0)
    assert np.array_equal(alias.as_array(np.float32, (8, 4)).to_numpy(), got)    # not the view's memory
    del alias, info, capsule
    gc.collect()
    accel.synchronize()
    assert accel.memory_allocated(d) == allocated
    assert accel.current_device_index() == 0


def test_copy_true_reads_after_the_buffers_queued_work(monkeypatch):
    """The copy is ordered after a fill still queued on a held side stream."""
    if "cuda" not in SIMS:
        pytest.skip("ACCEL_TEST_SIMS leaves out cuda")
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=50)
    accel.set_device_index(0)
    buf = accel.Buffer(N, device=DEV).fill_(1)
    accel.synchronize(DEV)
    side = accel.Stream(DEV)
    gate = hold(side)
    try:
        buf.fill_(9, stream=side)
        capsule = buf.__dlpack__(copy=True, max_version=(1, 0), stream=-1)
    finally:
        gate.set()
    alias = accel.from_dlpack(capsule)
    accel.synchronize(DEV)
    assert set(alias.to_numpy().tolist()) == {9}
    del alias, capsule


def test_a_bad_stream_with_copy_true_changes_nothing(any_sim):
    from accel import _dlpack
    d = _last_device()
    buf = accel.Buffer(N, device=d).fill_(2)
    side = accel.Stream(d)
    buf.fill_(3, stream=side)
    stats = accel.memory.memory_stats(d)["allocation.all.allocated"]
    before = _dlpack.live_exports()
    for bad, exc in ((0 if any_sim == "cuda" else 5, ValueError), ("1", TypeError), (True, TypeError)):
        with pytest.raises(exc):
            buf.__dlpack__(copy=True, stream=bad)
        assert buf.last_stream == side and _dlpack.live_exports() == before
        assert accel.memory.memory_stats(d)["allocation.all.allocated"] == stats
    side.synchronize()


def test_numpy_reads_device_memory_through_dl_device_cpu(any_sim):
    """numpy.from_dlpack(x, device="cpu") asks __dlpack__(dl_device=(kDLCPU, 0), copy=None)."""
    d = _last_device()
    buf = accel.Buffer(16, device=d).fill_(7)
    assert (np.from_dlpack(buf, device="cpu") == 7).all()
    assert (np.from_dlpack(buf.as_array(np.int32), device="cpu") == 0x07070707).all()
    with pytest.raises(ValueError, match="copy=False"):
        np.from_dlpack(buf, device="cpu", copy=False)
