"""The allocators' own event and stream queries never invalidate another thread's capture.

CUDA prohibits "potentially unsafe" calls (cudaEventQuery/Synchronize, cudaStreamQuery/
Synchronize of streams not being captured, cudaFree, ...) while any thread has a global-mode
capture underway: the call fails and invalidates that capture (CUDA Runtime API,
cudaStreamBeginCapture; Programming Guide, "Prohibited and Unhandled Operations").  accel's
allocators check ``capture_underway()`` and then make such calls (the events of freed blocks,
the idle check of a destroyed stream, empty_cache's synchronize, the pinned allocator's events,
cudaMallocAsync's marks).  r63 made the check and the call one step for cudaMalloc and the
cuMem* calls (``CudaBackend.capture_gate``); the queries were left.  Here each query's window is
opened on purpose: the querying thread (device 0) waits, between its check and its call, for
another thread's global-mode capture (device 1) to begin.  With the gate the capture cannot
begin meanwhile: the wait times out, the query goes on, and the capture begins after it.
"""

from __future__ import annotations

import importlib
import threading
import weakref

import pytest

import accel
from accel import memory
from accel.memory import _caching

from conftest import use_sim

#: how long the querying thread holds its window open for the capture
WINDOW_S = 0.5


def _pending_buffer_then(act):
    """A buffer used on a side stream and freed (its block waits for an event), then ``act``."""
    def prepare():
        s = accel.Stream()
        b = accel.Buffer(1 << 16)
        b.fill_(1, stream=s)
        b.record_stream(s)
        b.close()
        return s
    return prepare, act


def _malloc(_):
    accel.Buffer(1 << 16).close()       # a malloc asks whether the pending block's event completed


def _empty_cache(_):
    memory.device_allocator(0).empty_cache()    # synchronizes the pending block's event


def _kept_buffer_on_closed_stream():
    def prepare():
        keep = accel.Buffer(1 << 16)
        s = accel.Stream()
        keep.fill_(2, stream=s)
        keep.record_stream(s)
        return keep, s

    def act(state):
        keep, s = state
        s.close()                       # the idle check queries the dying stream
        keep.close()
    return prepare, act


def _pinned():
    def prepare():
        s = accel.Stream()
        host = accel.empty_pinned(4096)
        dst = accel.Buffer(4096)
        dst.copy_from(host, stream=s, non_blocking=True)
        del host                        # its block waits for an event recorded on s
        return s, dst

    def act(_):
        accel.empty_pinned(4096)        # the pinned allocator queries the pending event
    return prepare, act


SCENARIOS = {
    "malloc-processes-events": lambda: _pending_buffer_then(_malloc),
    "empty-cache-synchronizes": lambda: _pending_buffer_then(_empty_cache),
    "closed-stream-idle-check": _kept_buffer_on_closed_stream,
    "pinned-events": _pinned,
}


@pytest.mark.parametrize("conf", ["", "expandable_segments:False", "backend:cudaMallocAsync"],
                         ids=lambda v: v or "default")
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_an_allocator_query_on_device_0_does_not_invalidate_a_capture_on_device_1(monkeypatch, scenario, conf):
    use_sim(monkeypatch, "cuda", **({"ACCEL_ALLOC_CONF": conf} if conf else {}))
    for d in (0, 1):
        accel.Buffer(256, device=d).close()
    prepare, act = SCENARIOS[scenario]()
    began, window, done = threading.Event(), threading.Event(), threading.Event()
    armed = threading.Event()
    check = _caching.capture_underway

    def check_then_wait(be):
        underway = check(be)
        if (not underway and armed.is_set() and threading.current_thread().name == "query"
                and not window.is_set()):
            opened.append(True)
            window.set()
            began.wait(WINDOW_S)        # another thread's capture would begin here
        return underway
    monkeypatch.setattr(_caching, "capture_underway", check_then_wait)
    monkeypatch.setattr(importlib.import_module("accel.memory._host"), "capture_underway", check_then_wait)
    errors, results, opened = [], [], []

    def capture():
        try:
            with accel.device_index(1):
                s, src, dst = accel.Stream(), accel.Buffer(4096), accel.Buffer(4096)
                src.copy_from(bytes(range(256)) * 16)
                accel.synchronize()
                g = accel.Graph()
                window.wait(10)
                with s:
                    g.capture_begin()
                    began.set()
                    try:
                        done.wait(10)       # the query ran while this captures
                        dst.copy_from(src, non_blocking=True)
                    finally:
                        g.capture_end()
                dst.fill_(0)
                g.replay()
                results.append(dst.to_numpy().tobytes() == bytes(range(256)) * 16)
                g.reset()
                s.close()
        except Exception as exc:            # noqa: BLE001 - reported below
            errors.append(exc)

    def query():
        try:
            with accel.device_index(0):
                state = prepare()
                armed.set()
                act(state)
        except Exception as exc:            # noqa: BLE001
            errors.append(exc)
        finally:
            window.set()
            done.set()

    threads = [threading.Thread(target=capture, name="capture"), threading.Thread(target=query, name="query")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert opened, "no check before a query: the test did not open its window"
    assert not errors, errors
    assert results == [True]


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_a_foreign_buffer_closed_during_a_capture_keeps_its_owner_until_the_capture_ends(monkeypatch, kind):
    # Its release synchronizes the streams it was used on, which a capture forbids: the whole
    # release (waits, then the owner) is queued for the end of the last capture, not dropped.
    use_sim(monkeypatch, kind)
    owner = accel.Buffer(4096)
    owner.fill_(0)
    alive = weakref.ref(owner)
    foreign = accel.Buffer.from_ptr(owner.ptr, 4096, owner=owner)
    del owner
    side = accel.Stream()
    foreign.fill_(5, stream=side)
    with accel.device_index(1):
        s, buf, g = accel.Stream(), accel.Buffer(256), accel.Graph()
        with s:
            g.capture_begin()
            try:
                buf.fill_(1, stream=s)
                foreign.close()
                assert alive() is not None, "the owner went while the capture was underway"
            finally:
                g.capture_end()
        g.replay()
        g.reset()
    assert alive() is None, "the owner was kept after the last capture ended"
    side.close()
