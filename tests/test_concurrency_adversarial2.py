"""Adversarial concurrency, second part (r26): one thread closes a Buffer or a Stream while
another is inside an ArrayView copy, a random fill, a kernel launch or a graph replay that uses
it, on device 1 (not the current device).

As in test_concurrency_adversarial.py the interleavings are forced: a backend method is wrapped
so that the using thread stops inside the call, just before the vendor call that takes the
memory address or the stream handle, until the closing thread has done its part.  A Buffer
closed meanwhile must keep its memory until the call ends (else the next allocation of the same
size gets it, and the call writes or reads that buffer); a Stream closed meanwhile must keep its
handle until the call ends (else the next stream made gets the handle value, and the call's
work lands on it)."""

import numpy as np
import pytest

import accel
import accel.sim
from test_concurrency_adversarial import _Pause, _cuda, _join, _settled_counts

DEV = 1     # the device the work runs on; device 0 stays current in every thread
N = 4096
PTX = (".version 7.0\n.target sm_50\n.address_size 64\n"
       ".visible .entry r26_fill(.param .u64 p, .param .u64 n)\n{\n ret;\n}\n")


@pytest.fixture
def kernel(monkeypatch):
    """The simulated CUDA runtime and a user kernel r26_fill(ptr p, u64 n) on device 1 that sets
    n bytes at p to 9."""
    _cuda(monkeypatch)

    def fill(grid, block, view, p, n):
        view(p, n, "uint8")[:] = 9
    accel.sim.register_kernel("r26_fill", fill, "ptr, u64", replace=True)
    try:
        yield accel.Module(PTX, device=DEV).function("r26_fill")
    finally:
        accel.sim.unregister_kernel("r26_fill")


def _reuse_after_close(buf, out, t, pause) -> None:
    """``buf`` was closed while thread ``t`` is paused inside a call on it: allocate a buffer of
    the same size on its device and upload other data, let ``t`` go on, then check that the
    new buffer still holds that data and that nothing stays allocated once it is closed."""
    data = np.arange(N, dtype=np.uint8)
    other = accel.Buffer(N, DEV).copy_from(data)
    pause.go.set()
    _join([t])
    accel.synchronize(DEV)
    try:
        assert np.array_equal(other.to_numpy(), data), \
            "the call on the closed buffer reached the memory of the buffer allocated next"
    finally:
        other.close()
    assert "exc" not in out, out
    accel.memory.empty_cache()
    assert accel.memory.memory_allocated(DEV) == 0, "the closed buffer's memory was never freed"


# -- a Buffer closed while another thread's call uses it ---------------------------------------
def test_buffer_closed_while_another_thread_copies_into_a_view_of_it(monkeypatch):
    be = _cuda(monkeypatch)
    buf = accel.Buffer(N, DEV)
    view = buf.as_array(np.uint8)
    pause = _Pause(monkeypatch, be, "memcpy_async")
    t, out = pause.run(lambda: view.copy_from(np.full(N, 7, np.uint8)))
    buf.close()
    _reuse_after_close(buf, out, t, pause)


def test_buffer_closed_while_another_thread_reads_a_view_of_it(monkeypatch):
    """B is inside view.to_numpy(): B must read the closed buffer's bytes, not the next one's."""
    be = _cuda(monkeypatch)
    buf = accel.Buffer(N, DEV).fill_(5)
    view = buf.as_array(np.uint8)
    pause = _Pause(monkeypatch, be, "memcpy_async")
    t, out = pause.run(view.to_numpy)
    buf.close()
    _reuse_after_close(buf, out, t, pause)
    assert np.array_equal(out["value"], np.full(N, 5, np.uint8)), "B read another buffer's memory"


def test_buffer_closed_while_another_thread_copies_a_view_of_it(monkeypatch):
    """The source side: B copies a view of ``src`` into another buffer; A closes ``src``."""
    be = _cuda(monkeypatch)
    src = accel.Buffer(N, DEV).fill_(3)
    dst = accel.Buffer(2 * N, DEV)
    pause = _Pause(monkeypatch, be, "memcpy_async")
    t, out = pause.run(lambda: dst.as_array(np.uint8, (N,)).copy_from(src.as_array(np.uint8)))
    src.close()
    other = accel.Buffer(N, DEV).copy_from(np.arange(N, dtype=np.uint8))
    pause.go.set()
    _join([t])
    assert "exc" not in out, out
    assert np.array_equal(dst.to_numpy()[:N], np.full(N, 3, np.uint8)), "B copied another buffer's memory"
    other.close()
    dst.close()
    accel.memory.empty_cache()
    assert accel.memory.memory_allocated(DEV) == 0


def test_buffer_closed_while_another_thread_fills_it_with_random_numbers(monkeypatch):
    be = _cuda(monkeypatch)
    buf = accel.Buffer(N, DEV)
    pause = _Pause(monkeypatch, be, "launch")
    t, out = pause.run(lambda: accel.random.random_raw_(buf))
    buf.close()
    _reuse_after_close(buf, out, t, pause)


@pytest.mark.parametrize("arg", ["buffer", "view"])
def test_buffer_closed_while_another_thread_launches_a_kernel_on_it(monkeypatch, kernel, arg):
    be, k = accel._lazy.lazy_init(), kernel
    buf = accel.Buffer(N, DEV)
    target = buf if arg == "buffer" else buf.as_array(np.uint32)
    pause = _Pause(monkeypatch, be, "launch")
    t, out = pause.run(lambda: accel.launch(k, 1, 1, target, N))
    buf.close()
    _reuse_after_close(buf, out, t, pause)


# -- a Stream closed while another thread queues work on it -------------------------------------
def _stream_closed_during(monkeypatch, name: str, work, after, before=None) -> None:
    """Thread B runs ``work(s1)`` (s1 a new stream of device 1) and stops inside backend call
    ``name``; A closes s1 and makes s2 on device 1: s2 must not get s1's handle while B still
    queues on it.  B then finishes without error; ``after()`` checks B's result and closes what
    the test made; then s1 is destroyed too (no stream or event is left)."""
    be = accel._lazy.lazy_init()
    if before is None:
        before = _settled_counts()
    s1 = accel.Stream(DEV)
    h1 = s1.handle
    pause = _Pause(monkeypatch, be, name)
    t, out = pause.run(lambda: work(s1))
    s1.close()
    s2 = accel.Stream(DEV)
    try:
        assert s2.handle != h1, f"s1's handle went to s2 while {name} was queueing on s1"
    finally:
        pause.go.set()
        _join([t])
    assert "exc" not in out, out
    s2.close()
    accel.synchronize(DEV)      # B's work on s1 (s1 does not synchronize with the default stream)
    after()
    accel.memory.empty_cache()  # the events the allocator recorded for the buffers' uses on s1
    assert _settled_counts() == before, "the closed stream was not destroyed after the call ended"


def test_stream_closed_while_another_thread_copies_into_a_view_on_it(monkeypatch):
    _cuda(monkeypatch)
    buf = accel.Buffer(N, DEV)

    def after():
        assert np.array_equal(buf.to_numpy(), np.full(N, 7, np.uint8))
        buf.close()
    _stream_closed_during(monkeypatch, "memcpy_async",
                          lambda s: buf.as_array(np.uint8).copy_from(np.full(N, 7, np.uint8), stream=s), after)


def test_stream_closed_while_another_thread_reads_a_view_on_it(monkeypatch):
    _cuda(monkeypatch)
    buf = accel.Buffer(N, DEV).fill_(8)
    got = []

    def after():
        assert np.array_equal(got[0], np.full(N, 8, np.uint8))
        buf.close()
    _stream_closed_during(monkeypatch, "memcpy_async",
                          lambda s: got.append(buf.as_array(np.uint8).to_numpy(stream=s)), after)


def test_stream_closed_while_another_thread_copies_between_devices_on_it(monkeypatch):
    """A copy from device 0 to device 1 on s1 goes on after its memcpy (the barrier back to
    device 0's stream records on s1, then the copy waits for s1): s1 closed meanwhile must not
    make that part fail."""
    _cuda(monkeypatch)
    src = accel.Buffer(N, 0).copy_from(np.full(N, 4, np.uint8))
    dst = accel.Buffer(N, DEV)

    def after():
        assert np.array_equal(dst.to_numpy(), np.full(N, 4, np.uint8))
        src.close()
        dst.close()
    _stream_closed_during(monkeypatch, "memcpy_async", lambda s: dst.copy_from(src, stream=s), after)


def test_stream_closed_while_another_thread_fills_random_numbers_on_it(monkeypatch):
    _cuda(monkeypatch)
    accel.random.manual_seed_all(26)
    buf = accel.Buffer(N, DEV)

    def work(s):
        with s:
            accel.random.random_raw_(buf)

    def after():
        accel.random.manual_seed_all(26)
        want = accel.random.random_raw_(accel.Buffer(N, DEV)).to_numpy()
        assert np.array_equal(buf.to_numpy(), want)
        buf.close()
    _stream_closed_during(monkeypatch, "launch", work, after)


def test_stream_closed_while_another_thread_launches_on_it(monkeypatch, kernel):
    buf = accel.Buffer(N, DEV)

    def after():
        assert np.array_equal(buf.to_numpy(), np.full(N, 9, np.uint8))
        buf.close()
    _stream_closed_during(monkeypatch, "launch", lambda s: accel.launch(kernel, 1, 1, buf, N, stream=s), after)


def test_stream_closed_while_another_thread_replays_a_graph_on_it(monkeypatch):
    _cuda(monkeypatch)
    buf = accel.Buffer(N, DEV)
    g = accel.Graph()
    cap = accel.Stream(DEV)
    # counted before the capture: the graph's RNG order points (accel.random._GraphRNG: an Event
    # recorded after its holders were allocated, then after each replay) go with g.reset()
    before = _settled_counts()
    with cap:
        g.capture_begin()
        try:
            buf.fill_(6)
            accel.random.random_raw_(accel.Buffer(64, DEV))     # a replay prologue too
        finally:
            g.capture_end()
    accel.synchronize(DEV)
    buf.fill_(0)

    def work(s):
        with s:
            g.replay()

    def after():
        accel.synchronize(DEV)
        assert np.array_equal(buf.to_numpy(), np.full(N, 6, np.uint8))
        g.reset()
        buf.close()
    _stream_closed_during(monkeypatch, "graph_launch", work, after, before)
    cap.close()
