"""Adversarial concurrency, third part (r27): a Stream closed by one thread while another begins a
graph capture on it or passes its handle through a DLPack / __cuda_array_interface__ handshake,
and a non-owning Buffer (from_ptr, from_dlpack) closed while another thread's call still uses it,
on device 1 (not the current device) where the work allows.

The interleavings are forced as in test_concurrency_adversarial.py: a backend method (or a module
function) is wrapped so that one thread stops inside it until the other has done its part.  The
simulator hands a destroyed stream's handle to the next stream made (as an H200 does), so a
destroy that does not wait for a use in flight shows as ``s2.handle == h1``."""

import threading
import weakref

import numpy as np
import pytest

import accel
import accel.sim
import accel.streams
from test_concurrency_adversarial import WAIT_S, _Pause, _cuda, _join, _settled_counts
from test_concurrency_adversarial2 import kernel  # noqa: F401  (fixture: r26_fill(p, n) on device 1)
from torch_port_util import hold

DEV = 1     # the device the work runs on; device 0 stays current in the closing thread
N = 4096
def _stream_kept_while_paused(s1, pause, t, out, after_join=None, raised_nothing=True) -> None:
    """Thread ``t`` is paused inside a backend call that was handed ``s1``'s handle: close s1 and
    make s2 on its device (s2 must not get the handle while the call still uses it), let ``t``
    finish (then ``after_join()``), and check it raised nothing (unless ``raised_nothing`` is False)."""
    h1 = s1.handle
    s1.close()
    s2 = accel.Stream(DEV)
    try:
        assert s2.handle != h1, "s1's handle went to s2 while another thread's call still used it"
    finally:
        pause.go.set()
        _join([t])
        if after_join is not None:
            after_join()
        s2.close()
    if raised_nothing:
        assert "exc" not in out, out


# -- 1. Graph.capture_begin against Stream.close -----------------------------------------------
def test_capture_begun_between_close_checking_and_claiming_the_stream(monkeypatch):
    """A's s.close() found no capture on s and stops before claiming it; the main thread begins a
    capture on s (device 1).  Before: A then destroyed the capturing stream (the driver refused,
    invalidating the capture: capture_end raised CaptureError).  Now close() re-checks after its
    claim and refuses; the capture goes on."""
    _cuda(monkeypatch)
    before = _settled_counts()
    s = accel.Stream(DEV)
    buf = accel.Buffer(N, DEV)
    pause = _Pause(monkeypatch, accel.streams.stream, "_claim_close")
    t, out = pause.run(s.close)
    g = accel.Graph()
    with s:
        g.capture_begin()
        try:
            pause.go.set()
            _join([t])
            buf.fill_(6)
        finally:
            g.capture_end()
    assert isinstance(out.get("exc"), RuntimeError) and "capture" in str(out["exc"]), out
    assert not s.closed
    buf.fill_(0)
    g.replay()
    accel.synchronize(DEV)
    assert np.array_equal(buf.to_numpy(), np.full(N, 6, np.uint8))
    g.reset()
    s.close()
    buf.close()
    accel.memory.empty_cache()
    assert _settled_counts() == before


def test_stream_closed_while_another_thread_begins_a_capture_on_it(monkeypatch):
    """B is inside g.capture_begin() on s1 (device 1), holding s1's handle (the graph pool is
    being set up); A closes s1 and makes s2.  Before: s1 was destroyed at once, s2 got its handle
    and B's capture began on s2.  Now the close waits for capture_begin, which refuses the stream
    closed meanwhile (nothing is left capturing) and then lets it go."""
    be = _cuda(monkeypatch)
    before = _settled_counts()
    s1 = accel.Stream(DEV)
    g = accel.Graph()
    pause = _Pause(monkeypatch, accel.memory.device_allocator(DEV), "begin_allocate_to_pool")

    def begin():
        with s1:
            g.capture_begin()
    def end_any_capture():
        if g._stream is not None:
            with g._stream:
                g.capture_end()
    t, out = pause.run(begin)
    _stream_kept_while_paused(s1, pause, t, out, after_join=end_any_capture, raised_nothing=False)
    assert isinstance(out.get("exc"), RuntimeError) and "closed" in str(out["exc"]), out
    assert not be.captures_underway()
    accel.synchronize(DEV)      # would fail while a capture were underway
    accel.memory.empty_cache()
    assert _settled_counts() == before, "the closed stream was not destroyed after capture_begin"


# -- 2. DLPack / CAI handshakes hold the streams they pass on --------------------------------
def test_last_use_stream_closed_while_another_thread_exports_the_buffer(monkeypatch):
    """B is inside buf.__dlpack__(stream=<device 1's default stream>), recording the event on
    buf's last-use stream s1; A closes s1 and makes s2: s2 must not get s1's handle."""
    be = _cuda(monkeypatch)
    before = _settled_counts()
    s1 = accel.Stream(DEV)
    buf = accel.Buffer(N, DEV).fill_(3, stream=s1)
    pause = _Pause(monkeypatch, be, "event_record")
    t, out = pause.run(lambda: buf.__dlpack__(stream=accel.default_stream(DEV)))
    _stream_kept_while_paused(s1, pause, t, out)
    del out["value"]    # the capsule, dropped unconsumed
    buf.close()
    accel.memory.empty_cache()
    assert _settled_counts() == before


def test_consumer_stream_closed_while_another_thread_exports_to_it(monkeypatch):
    """B is inside buf.__dlpack__(stream=s1), making s1 wait for buf's last-use stream; A closes
    s1 and makes s2: s2 must not get s1's handle (it would wait in s1's place)."""
    be = _cuda(monkeypatch)
    before = _settled_counts()
    buf = accel.Buffer(N, DEV).fill_(3)
    s1 = accel.Stream(DEV)
    pause = _Pause(monkeypatch, be, "stream_wait_event")
    t, out = pause.run(lambda: buf.__dlpack__(stream=s1))
    _stream_kept_while_paused(s1, pause, t, out)
    del out["value"]
    buf.close()
    accel.memory.empty_cache()
    assert _settled_counts() == before


@pytest.mark.parametrize("how", ["current", "given"])
def test_stream_closed_while_another_thread_imports_on_it(monkeypatch, how):
    """B runs accel.from_dlpack(producer) with s1 as its stream (device 1's current stream of B,
    or stream=s1; device 0 stays current), and stops where the producer makes s1 wait for its
    work; A closes s1 and makes s2: s2 must not get s1's handle."""
    be = _cuda(monkeypatch)
    before = _settled_counts()
    producer = accel.Buffer(N, DEV).fill_(5)
    s1 = accel.Stream(DEV)

    def work():
        if how == "given":
            return accel.from_dlpack(producer, stream=s1)
        accel.set_stream(s1)
        accel.set_device_index(0)
        try:
            return accel.from_dlpack(producer)
        finally:
            accel.set_stream(accel.default_stream(DEV))
            accel.set_device_index(0)
    pause = _Pause(monkeypatch, be, "stream_wait_event")
    t, out = pause.run(work)
    _stream_kept_while_paused(s1, pause, t, out)
    imported = out.pop("value")
    assert np.array_equal(imported.to_numpy(), np.full(N, 5, np.uint8))
    imported.close()
    producer.close()
    accel.memory.empty_cache()
    assert _settled_counts() == before


def test_producer_stream_closed_while_another_thread_copies_from_its_array_interface(monkeypatch):
    """B copies into a view from an object exposing another buffer's __cuda_array_interface__,
    whose stream is accel's s1, and stops recording the event on s1; A closes s1 and makes s2:
    s2 must not get s1's handle."""
    be = _cuda(monkeypatch)
    before = _settled_counts()
    s1 = accel.Stream(DEV)
    src = accel.Buffer(N, DEV).fill_(4, stream=s1)
    dst = accel.Buffer(N, DEV)

    class Foreign:
        __cuda_array_interface__ = src.__cuda_array_interface__
    assert Foreign.__cuda_array_interface__["stream"] == s1.handle
    pause = _Pause(monkeypatch, be, "event_record")
    t, out = pause.run(lambda: dst.as_array(np.uint8).copy_from(Foreign()))
    _stream_kept_while_paused(s1, pause, t, out)
    accel.synchronize(DEV)
    assert np.array_equal(dst.to_numpy(), np.full(N, 4, np.uint8))
    src.close()
    dst.close()
    accel.memory.empty_cache()
    assert _settled_counts() == before


# -- 3. a non-owning buffer's release waits for every use ----------------------------------------

class _Owner:
    """What a from_ptr buffer keeps alive; ``released`` says whether the gated work had run when
    accel let it go."""


def _watch_release(monkeypatch, owner, gate, sync_name: str):
    """An Event set when accel either lets ``owner`` go or starts waiting for work (backend
    ``sync_name``) before that; ``seen`` gets, at the owner's release, whether ``gate`` was set
    (the gated work may have run)."""
    decided, seen = threading.Event(), []
    weakref.finalize(owner, lambda: (seen.append(gate.is_set()), decided.set()))
    be = accel._lazy.lazy_init()
    real = getattr(be, sync_name)

    def wrapped(*args, **kwargs):
        decided.set()
        return real(*args, **kwargs)
    monkeypatch.setattr(be, sync_name, wrapped)
    return decided, seen


def test_non_owning_buffer_closed_while_another_thread_launches_on_it(monkeypatch, kernel):
    """B launches a kernel on from_ptr buffer fb on stream s2 (held busy) and stops inside the
    launch; A closes fb (the release is left to B's call).  B's use of s2 is recorded after the
    kernel was queued.  Before: the release waited only for the streams known at close(), so the
    owner was let go while the kernel on s2 had not run.  Now it waits for s2 too."""
    be = accel._lazy.lazy_init()
    base = accel.Buffer(N, DEV)
    s2 = accel.Stream(DEV)
    owner = _Owner()
    fb = accel.Buffer.from_ptr(base.ptr, N, DEV, owner=owner)
    gate = hold(s2)
    decided, seen = _watch_release(monkeypatch, owner, gate, "stream_synchronize")
    del owner
    pause = _Pause(monkeypatch, be, "launch")
    t, out = pause.run(lambda: accel.launch(kernel, 1, 1, fb, N, stream=s2))
    fb.close()
    pause.go.set()
    try:
        assert decided.wait(WAIT_S)
    finally:
        gate.set()
        _join([t])
    assert "exc" not in out, out
    assert seen == [True], "the owner was let go before the kernel queued on the buffer had run"
    assert np.array_equal(base.to_numpy(), np.full(N, 9, np.uint8))
    s2.close()
    base.close()


def test_non_owning_buffer_used_on_a_stream_closed_since(monkeypatch):
    """fb (from_ptr) is filled on s2 (held busy), s2 is closed (its work still runs), then fb is
    closed in another thread.  Before: the release skipped the closed stream and let the owner go
    at once.  Now it waits for the closed stream's work (its device)."""
    be = _cuda(monkeypatch)
    base = accel.Buffer(N, DEV)
    s2 = accel.Stream(DEV)
    owner = _Owner()
    fb = accel.Buffer.from_ptr(base.ptr, N, DEV, owner=owner)
    gate = hold(s2)
    decided, seen = _watch_release(monkeypatch, owner, gate, "device_synchronize")
    del owner
    fb.fill_(2, stream=s2)
    s2.close()
    out = {}

    def close():
        try:
            fb.close()
        except BaseException as exc:    # noqa: BLE001 - reported by the test
            out["exc"] = exc
    t = threading.Thread(target=close)
    t.start()
    try:
        assert decided.wait(WAIT_S)
    finally:
        gate.set()
        _join([t])
    assert "exc" not in out, out
    assert seen == [True], "the owner was let go while the fill on the closed stream had not run"
    accel.synchronize(DEV)
    assert np.array_equal(base.to_numpy(), np.full(N, 2, np.uint8))
    base.close()
    assert be is accel._lazy.lazy_init()
