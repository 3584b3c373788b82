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
