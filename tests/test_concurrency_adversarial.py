"""Adversarial concurrency on the public API (r24): one thread closes a Stream, Event, Buffer
or Module while another is inside a call on it; random fills, device contexts and graph
captures from several threads at once.

The interleavings are forced, not hoped for: a backend method is wrapped so that the using
thread stops inside the call, just before the vendor call that takes the object's handle,
until the closing thread has done its part (threading.Event gates, bounded waits).  The
simulator hands a destroyed stream's or event's handle value to the next one made, last-freed
first, as the driver does, so a destroy that does not wait for a use still in flight makes
that use land on another object: a silent wrong result."""

import gc
import threading

import numpy as np
import pytest

import accel
import accel.sim
from conftest import use_sim
from torch_port_util import hold

WAIT_S = 20.0


def _join(threads) -> None:
    for t in threads:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads), "a thread hung"


def _start(errs: list, work, calls, *barriers) -> list:
    """Start a thread per argument tuple in ``calls`` running ``work``; an exception goes into
    ``errs`` and breaks ``barriers`` (so the other threads stop waiting).  Returns the threads."""
    def guarded(*args):
        try:
            work(*args)
        except BaseException as exc:       # noqa: BLE001
            errs.append(exc)
            for bar in barriers:
                bar.abort()
    threads = [threading.Thread(target=guarded, args=args) for args in calls]
    for t in threads:
        t.start()
    return threads


class _Pause:
    """Wrap ``backend.<name>`` so that its first call from thread ``who`` signals ``inside`` and
    waits for ``go`` before running the real call (with the arguments it was given)."""

    def __init__(self, monkeypatch, backend, name: str):
        self.inside, self.go, self.who, self.seen = threading.Event(), threading.Event(), None, []
        real = getattr(backend, name)

        def wrapped(*args, **kwargs):
            if threading.current_thread() is self.who and not self.seen:
                self.seen.append(args)
                self.inside.set()
                assert self.go.wait(WAIT_S)
            return real(*args, **kwargs)
        monkeypatch.setattr(backend, name, wrapped)

    def run(self, fn):
        """Start ``fn`` in a thread and return (thread, result dict) once it is paused inside."""
        out = {}

        def body():
            try:
                out["value"] = fn()
            except BaseException as exc:       # noqa: BLE001 - reported by the test
                out["exc"] = exc
        t = threading.Thread(target=body)
        self.who = t
        t.start()
        assert self.inside.wait(WAIT_S), "the call never reached the backend"
        return t, out


def _cuda(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=1)
    return accel._lazy.lazy_init()


def _settled_counts():
    gc.collect()
    accel._finalize.drain()
    accel.synchronize(0)
    accel.synchronize(1)
    st = accel.sim.state()
    return st.streams, st.events


def test_event_closed_while_another_thread_records_it(monkeypatch):
    """Thread B is inside e1.record(s); A closes e1 and records a new event e2 on a held stream.
    Before: e1's handle went back to the driver at once, e2 got it, and B's record landed on e2,
    so e2.query() said True while its stream was still held."""
    be = _cuda(monkeypatch)
    free, busy = accel.Stream(), accel.Stream()
    before = _settled_counts()
    e1 = accel.Event()
    e1.record(free)
    pause = _Pause(monkeypatch, be, "event_record")
    t, out = pause.run(lambda: e1.record(free))
    e1.close()
    gate = hold(busy)
    try:
        e2 = accel.Event()
        e2.record(busy)
        pause.go.set()
        _join([t])
        assert not e2.query(), "another thread's record of the closed event e1 completed e2"
    finally:
        gate.set()
    busy.synchronize()
    assert e2.query()
    e2.close()
    assert _settled_counts() == before, "the closed event's handle was not destroyed"


def test_event_closed_while_another_thread_synchronizes_it(monkeypatch):
    """B waits in e1.synchronize(); A closes e1 and makes e2 on a held stream: B must not end
    up waiting for e2 (the handle it was given must stay e1's until B is done)."""
    be = _cuda(monkeypatch)
    s, busy = accel.Stream(), accel.Stream()
    before = _settled_counts()
    e1 = accel.Event()
    e1.record(s)
    pause = _Pause(monkeypatch, be, "event_synchronize")
    t, out = pause.run(e1.synchronize)
    h1 = e1.handle
    e1.close()
    gate = hold(busy)
    try:
        e2 = accel.Event()
        e2.record(busy)
        assert e2.handle != h1, "e1's handle was destroyed (and handed to e2) while B still used it"
        pause.go.set()
        _join([t])
    finally:
        gate.set()
    assert "exc" not in out, out
    busy.synchronize()
    e2.close()
    assert _settled_counts() == before


def test_stream_closed_while_another_thread_synchronizes_it(monkeypatch):
    """B is inside s1.synchronize(); A closes s1 and creates s2: s2 must not get s1's handle
    while B still synchronizes it (B would wait for s2's work instead of s1's)."""
    be = _cuda(monkeypatch)
    before = _settled_counts()
    s1 = accel.Stream()
    h1 = s1.handle
    pause = _Pause(monkeypatch, be, "stream_synchronize")
    t, out = pause.run(s1.synchronize)
    s1.close()
    s2 = accel.Stream()
    try:
        assert s2.handle != h1, "s1's handle was destroyed (and handed to s2) while B still used it"
    finally:
        pause.go.set()
        _join([t])
    assert "exc" not in out, out
    s2.close()
    assert _settled_counts() == before


def test_buffer_closed_while_another_thread_fills_it(monkeypatch):
    """B is inside buf.fill_(7); A closes buf and uploads other data into a new buffer of the
    same size: before, the new buffer got the same memory and B's fill overwrote it."""
    be = _cuda(monkeypatch)
    buf = accel.Buffer(4096)
    pause = _Pause(monkeypatch, be, "memset_async")
    t, out = pause.run(lambda: buf.fill_(7))
    buf.close()
    data = np.arange(4096, dtype=np.uint8)
    other = accel.Buffer(4096).copy_from(data)
    pause.go.set()
    _join([t])
    accel.synchronize()
    assert np.array_equal(other.to_numpy(), data), "the fill of the closed buffer wrote another buffer's memory"
    other.close()
    accel.memory.empty_cache()
    assert accel.memory.memory_allocated(0) == 0


def _pause_after_line(fn, line_text: str):
    """Run ``fn`` in a thread that stops at the first line it runs after the line of ``fn``'s
    source holding ``line_text``, until the returned ``go`` is set; returns (thread, out, go)
    once it stopped there."""
    import inspect
    import sys
    code = fn.__func__.__code__ if hasattr(fn, "__func__") else fn.__code__
    src, first = inspect.getsourcelines(code)
    line = first + next(i for i, text in enumerate(src) if line_text in text)
    inside, go, out, passed = threading.Event(), threading.Event(), {}, []

    def tracer(frame, event, arg):
        if frame.f_code is not code:
            return None

        def local(frame, event, arg):
            if event == "line" and not inside.is_set():
                if passed:
                    inside.set()
                    assert go.wait(WAIT_S)
                elif frame.f_lineno == line:
                    passed.append(line)
            return local
        return local

    def body():
        sys.settrace(tracer)
        try:
            out["value"] = fn()
        except BaseException as exc:       # noqa: BLE001 - reported by the test
            out["exc"] = exc
        finally:
            sys.settrace(None)
    t = threading.Thread(target=body)
    t.start()
    assert inside.wait(WAIT_S), f"never got past {line_text!r}"
    return t, out, go


def test_buffer_closed_by_two_threads_at_once_is_freed_once(monkeypatch):
    """A passes close()'s "already closed?" test and stops; B closes the buffer and allocates
    another of the same size (the same memory); then A goes on.  Before, A freed the memory
    a second time, under B's new buffer: the next allocation got it too."""
    _cuda(monkeypatch)
    buf = accel.Buffer(4096)
    t, out, go = _pause_after_line(buf.close, "if self._closed")
    buf.close()
    other = accel.Buffer(4096)
    go.set()
    _join([t])
    third = accel.Buffer(4096)
    assert third.ptr != other.ptr, "the memory of a live buffer was handed out again"
    assert accel.memory.memory_allocated(0) == 2 * 4096
    other.close()
    third.close()


def test_stream_closed_while_another_thread_fills_a_buffer_on_it(monkeypatch):
    """B is inside buf.fill_(7, stream=s1); A closes s1 and creates s2.  Before (r24 found it,
    r26 fixed it): Buffer, graph, RNG and kernel calls took stream.handle and called the backend
    outside streams._Use, so s1 was destroyed at once and s2 got its handle while B still
    queued on it.  The fill now holds s1 (streams._Hold) and the destroy waits for it."""
    be = _cuda(monkeypatch)
    s1 = accel.Stream()
    h1 = s1.handle
    buf = accel.Buffer(4096, stream=s1)
    pause = _Pause(monkeypatch, be, "memset_async")
    t, out = pause.run(lambda: buf.fill_(7, stream=s1))
    s1.close()
    s2 = accel.Stream()
    try:
        assert s2.handle != h1, "s1's handle went to s2 while a fill was being queued on s1"
    finally:
        pause.go.set()
        _join([t])
        buf.close()
        s2.close()


def test_module_closed_while_another_thread_launches_it(monkeypatch):
    """Module.close waits for a launch in flight (the module's lock): the launch completes, and a
    launch after the close raises ValueError naming the closed module."""
    be = _cuda(monkeypatch)
    ptx = (".version 7.0\n.target sm_50\n.address_size 64\n"
           ".visible .entry r24_touch(.param .u64 p)\n{\n ret;\n}\n")
    ran = []
    accel.sim.register_kernel("r24_touch", lambda grid, block, view, p: ran.append(p), "u64", replace=True)
    try:
        mod = accel.Module(ptx)
        k = mod.function("r24_touch")
        pause = _Pause(monkeypatch, be, "launch")
        t, out = pause.run(lambda: accel.launch(k, 1, 1, 5))
        closer = threading.Thread(target=mod.close)
        closer.start()
        pause.go.set()
        _join([t, closer])
        assert "exc" not in out, out
        accel.synchronize()
        assert ran == [5]
        with pytest.raises(ValueError, match="closed"):
            accel.launch(k, 1, 1, 5)
    finally:
        accel.sim.unregister_kernel("r24_touch")


@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_random_fills_from_threads_take_disjoint_parts_of_the_stream(monkeypatch, kind):
    """Six threads fill 20 buffers each at once from the default generator: together they hold
    exactly the first 6*20*n numbers of the seeded Philox stream, none twice."""
    use_sim(monkeypatch, kind)
    accel.random.manual_seed(123)
    n, threads, rounds = 64, 6, 20
    bar = threading.Barrier(threads)
    outs, errs = [None] * threads, []

    def work(i):
        s = accel.Stream(0)
        bufs = [accel.Buffer(n * 4, 0) for _ in range(rounds)]
        bar.wait(WAIT_S)
        with s:
            for b in bufs:
                accel.random.random_raw_(b)
        outs[i] = [b.to_numpy(np.uint32, stream=s) for b in bufs]
    _join(_start(errs, work, [(i,) for i in range(threads)], bar))
    assert not errs, errs
    got = np.concatenate([a for o in outs for a in o])
    assert len(np.unique(got)) == len(got)
    offset = accel.random.default_generator(0).offset
    accel.random.manual_seed(123)
    ref = accel.Buffer(got.nbytes, 0)
    accel.random.random_raw_(ref)
    assert np.array_equal(np.sort(ref.to_numpy(np.uint32)), np.sort(got))
    assert accel.random.default_generator(0).offset == offset


def test_device_index_contexts_in_threads_stay_per_thread(sim_graph_backend):
    """Eight threads enter device_index(0 or 1) 50 times each at once: inside, each sees its own
    device, allocates there and gets its device's stream; outside, the device it started on."""
    accel.set_device_index(0)
    threads = 8
    bar = threading.Barrier(threads)
    errs = []

    def work(i):
        want = i % 2
        for r in range(50):
            with accel.device_index(want):
                if r == 0:
                    bar.wait(WAIT_S)
                assert accel.current_device_index() == want
                b = accel.Buffer(256)
                assert b.device_index == want and accel.current_stream().device_index == want
                b.close()
            assert accel.current_device_index() == 0
    _join(_start(errs, work, [(i,) for i in range(threads)], bar))
    assert not errs, errs
    assert accel.current_device_index() == 0


def test_two_captures_on_two_devices_while_a_third_thread_allocates(sim_graph_backend):
    """Two threads capture a graph each on their own device at once while a third allocates,
    fills and frees on both devices: both graphs replay the right data, and once everything is
    closed nothing is allocated or reserved."""
    bar, captured = threading.Barrier(3), threading.Barrier(2)
    errs, kept, stop = [], [], threading.Event()

    def capture(d):
        with accel.device_index(d):
            s = accel.Stream()
            want = np.arange(1024, dtype=np.float32) + d
            src, dst = accel.Buffer(4096).copy_from(want), accel.Buffer(4096)
            g = accel.Graph()
            bar.wait(WAIT_S)
            with s:
                # not `with g:`: its empty_cache() is refused while the other thread's capture
                # is underway (CaptureError, as torch.cuda.graph's in the default global mode)
                g.capture_begin()
                try:
                    tmp = accel.Buffer(4096)
                    tmp.copy_from(src, non_blocking=True)
                    dst.copy_from(tmp, non_blocking=True)
                    tmp.fill_(d + 1)
                finally:
                    g.capture_end()
            # the replay's checks synchronize: an unsafe call while the other capture is
            # underway (global mode) would invalidate it, as CUDA's rule says
            captured.wait(WAIT_S)
            dst.fill_(0)
            g.replay()
            accel.synchronize(d)
            assert np.array_equal(dst.to_numpy(np.float32), want)
            kept.append((g, s, src, dst, tmp))

    def allocate():
        bar.wait(WAIT_S)
        for i in range(600):
            if stop.is_set():
                break
            b = accel.Buffer(1024 * (1 + i % 7), i % 2)
            b.fill_(i % 256)
            b.close()
    ts = _start(errs, capture, [(0,), (1,)], bar, captured)
    a = _start(errs, allocate, [()])
    _join(ts)
    stop.set()
    _join(a)
    assert not errs, errs
    for g, s, *bufs in kept:
        g.reset()
        for b in bufs:
            b.close()
        s.close()
    kept.clear()
    gc.collect()
    accel.synchronize(0)
    accel.synchronize(1)
    accel.memory.empty_cache()
    for d in (0, 1):
        assert accel.memory.memory_allocated(d) == 0
        assert accel.memory.memory_reserved(d) == 0
