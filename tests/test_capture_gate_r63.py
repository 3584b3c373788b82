"""A grow of the allocator on one device never invalidates another thread's capture.

accel refuses or relaxes potentially unsafe calls (cudaMalloc, the cuMem* calls of expandable
segments) while a capture is underway.  The check and the call were not atomic: a thread could
find no capture, another thread begin a global-mode capture, and the first thread's cuMemCreate
invalidate it (cudaErrorStreamCaptureInvalidated at capture_end).  A clean-clone CI run saw it as
a flake of test_concurrency_adversarial's two captures while a third thread allocates.  The
backend now holds one gate from the check through the call, and capture_begin holds it from its
count through cudaStreamBeginCapture.  Here the window is opened on purpose: the growing thread
waits, between its check and its driver call, for the other thread's capture to begin.
"""

from __future__ import annotations

import threading

import accel
from accel import _lazy

from conftest import use_sim

#: how long the growing thread holds its window open for the capture (with the gate, the capture
#: cannot begin meanwhile: the wait times out and the grow goes on, the capture after it)
WINDOW_S = 0.5


def test_a_grow_on_device_0_does_not_invalidate_a_capture_beginning_on_device_1(monkeypatch):
    use_sim(monkeypatch, "cuda")
    be = _lazy.lazy_init()
    for d in (0, 1):
        accel.Buffer(256, device=d).close()
    began, window, grown = threading.Event(), threading.Event(), threading.Event()
    check = type(be)._vmm_not_capturing

    def check_then_wait(self, call):
        check(self, call)                   # no capture underway
        if threading.current_thread().name == "grow" and not window.is_set():
            window.set()
            began.wait(WINDOW_S)            # another thread's capture would begin here
    monkeypatch.setattr(type(be), "_vmm_not_capturing", check_then_wait)
    errors, results = [], []

    def capture():
        try:
            with accel.device_index(1):
                s, src, dst = accel.Stream(), accel.Buffer(4096), accel.Buffer(4096)
                src.copy_from(bytes(range(256)) * 16)
                g = accel.Graph()
                window.wait(10)
                with s:
                    g.capture_begin()
                    began.set()
                    try:
                        grown.wait(10)          # the grow's driver calls ran while this captures
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

    def grow():
        try:
            with accel.device_index(0):
                accel.Buffer(8 << 20).close()   # a miss: the expandable segment maps new pages
        except Exception as exc:            # noqa: BLE001
            errors.append(exc)
        finally:
            grown.set()

    threads = [threading.Thread(target=capture, name="capture"), threading.Thread(target=grow, name="grow")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert window.is_set(), "the grow made no cuMem* call: the test did not open its window"
    assert not errors, errors
    assert results == [True]
