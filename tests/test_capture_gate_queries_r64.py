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

import weakref

import pytest

import accel
from accel import memory

from conftest import use_sim
from test_capture_windows_r64b import (_kept_buffer_on_closed_stream, _pending_block_then, _pinned_pending, _Race,
                                       _run, _warm, _watch_allocator_checks)

# The window-opening harness and the scenarios are r64b's (test_capture_windows_r64b.py), which
# also runs them on Level Zero and with the capture on the same device; here each runs under
# every allocator of CUDA (caching with expandable or classic segments, cudaMallocAsync).
SCENARIOS = {
    "malloc-processes-events": lambda: _pending_block_then(lambda _: accel.Buffer(1 << 16).close()),
    "empty-cache-synchronizes": lambda: _pending_block_then(lambda _: memory.device_allocator(0).empty_cache()),
    "closed-stream-idle-check": _kept_buffer_on_closed_stream,
    "pinned-events": _pinned_pending,
}


@pytest.mark.parametrize("conf", ["", "expandable_segments:False", "backend:cudaMallocAsync"],
                         ids=lambda v: v or "default")
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_an_allocator_query_on_device_0_does_not_invalidate_a_capture_on_device_1(monkeypatch, scenario, conf):
    use_sim(monkeypatch, "cuda", **({"ACCEL_ALLOC_CONF": conf} if conf else {}))
    _warm()
    race = _Race()
    _watch_allocator_checks(monkeypatch, race)
    _run(race, 1, *SCENARIOS[scenario]())
    assert race.opened, "no check before a query: the test did not open its window"
    race.assert_clean()


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
