"""r71q: adversarial review of 4803890..47b5e67 (cross-device copies and interop, no-peer machines).

Buffer.__cuda_array_interface__ now makes the buffer's device's current stream wait for a
last-use stream of another device (r71o).  That wait runs in a property getter, which every
``hasattr``/``getattr`` of the interface (CuPy, Numba, accel's own copy_from) calls; the DLPack
handshake doing the same wait (``_dlpack.sync_for_consumer``) refuses up front what would
join or invalidate a capture and holds the last-use stream open.  The tests below show where
the new getter does not.

Spec text relied on (CUDA Programming Guide, "CUDA Graphs"):
- "Cross-stream Dependencies and Events": a stream that waits on an event recorded in a
  capturing stream joins that capture; "It is invalid to wait on a non-captured event from a
  stream which is being captured" (without cudaEventWaitExternal).
- "Prohibited and Unhandled Operations": while a capture is underway on a blocking stream "any
  attempted use of the legacy stream is invalid" (cudaErrorStreamCaptureImplicit, invalidated).
- CUDA Array Interface v3, ``stream``: the consumer synchronizes on that stream before it uses
  the data; reading the attribute is how a consumer learns of the array (``hasattr``).

Two simulated CUDA devices, device 0 current; nothing timed.
"""

import numpy as np
import pytest

import accel
from accel import CaptureError

from conftest import SIMS, use_sim, vendor_calls_made_by


@pytest.fixture(params=["all", "none"])
def cuda2(request, monkeypatch):
    """The CUDA simulator, two devices, with and without peer access (accel/sim/README.md r71g)."""
    if "cuda" not in SIMS:
        pytest.skip("ACCEL_TEST_SIMS leaves out cuda")
    use_sim(monkeypatch, "cuda", ACCEL_SIM_PEER=request.param)
    return request.param


def _pattern(n=256, seed=0):
    return ((np.arange(n) * 7 + seed) % 251).astype(np.uint8)


def _read_in_device1_capture(b0, s1, d1):
    """A copy on capturing stream ``s1`` (device 1) reads device-0 buffer ``b0``: its last use."""
    d1.copy_from(b0, stream=s1, non_blocking=True)
    assert b0.last_stream == s1


def _end(g):
    """End the capture ``with s, g:`` left open by the test body; True when it ended cleanly."""
    try:
        g.capture_end()
    except Exception:       # (an invalidated or unjoined capture)
        return False
    return True


# -- 1. the getter joins device 0's current stream to a capture on device 1 ------------------------
# (r71q found; fixed in session 31)
def test_cai_getter_does_not_pull_device0_stream_into_a_device1_capture(cuda2):
    b0 = accel.Buffer(256).copy_from(_pattern())
    s1 = accel.Stream(1)
    d1 = accel.Buffer(256, device=1, stream=s1)
    d1.copy_from(b0, stream=s1)                 # warm-up: peer access settled before the capture
    s0 = accel.Stream(0)
    accel.set_stream(s0)                        # device 0's current stream: a side stream
    accel.set_device_index(0)
    g = accel.Graph()
    with s1:
        g.capture_begin()
        try:
            _read_in_device1_capture(b0, s1, d1)
            try:
                b0.__cuda_array_interface__    # a consumer (CuPy) looking at the buffer
            except CaptureError:
                pass                            # refusing is fine: joining is not
            joined = s0.is_capturing()
        finally:
            ended = _end(g)
    assert not joined, "reading __cuda_array_interface__ made device 0's current stream join device 1's capture"
    assert ended, "the capture on device 1 could not end after the getter ran"


# (r71q found; fixed in session 31)
def test_cai_getter_does_not_invalidate_a_device1_capture_from_the_legacy_stream(cuda2):
    b0 = accel.Buffer(256).copy_from(_pattern())
    s1 = accel.Stream(1)
    d1 = accel.Buffer(256, device=1, stream=s1)
    d1.copy_from(b0, stream=s1)
    assert accel.current_stream(0) == accel.default_stream(0)
    g = accel.Graph()
    with s1:
        g.capture_begin()
        try:
            _read_in_device1_capture(b0, s1, d1)
            try:
                b0.__cuda_array_interface__
            except CaptureError:
                pass                            # a refusal that leaves the capture going is fine
        finally:
            ended = _end(g)
    assert ended, "reading __cuda_array_interface__ invalidated the capture underway on device 1"
    g.replay()
    s1.synchronize()
    assert (d1.to_numpy(stream=s1) == _pattern()).all()


# -- 2. a refusal from the getter after an event was recorded ---------------------------------------
# (r71q found; fixed in session 31)
def test_cai_getter_refused_in_a_device0_capture_records_nothing_first(cuda2):
    b0 = accel.Buffer(256).copy_from(_pattern())
    s1 = accel.Stream(1)
    accel.Buffer(256, device=1).copy_from(b0, stream=s1)
    assert b0.last_stream == s1                 # not capturing
    s0 = accel.Stream(0)
    g = accel.Graph()
    outcome = {}

    def look():
        try:
            b0.__cuda_array_interface__
            outcome["raised"] = False
        except CaptureError:
            outcome["raised"] = True

    x = accel.Buffer(64)
    with s0:
        g.capture_begin()
        try:
            calls = vendor_calls_made_by(look)
            x.fill_(1, s0)                      # (the capture's own work)
        finally:
            ended = _end(g)
    assert ended
    if outcome["raised"]:
        made = {k: v for k, v in calls.items() if k.startswith("cudaEvent")}
        assert not made, f"the refused getter made/recorded events first: {made}"


# -- 3. a refused copy_from queues a wait on device 1 (through the getter) ---------------------------
# (r71q found; fixed in session 31)
def test_refused_copy_of_a_strided_device1_view_queues_no_wait(cuda2):
    buf1 = accel.Buffer(512, device=1).copy_from(_pattern(512))
    accel.Buffer(512).copy_from(buf1)           # read by device 0: its last-use stream is device 0's
    assert buf1.last_stream.device_index == 0
    view = buf1.as_array("<u2", (16, 8), (32, 4))     # strided: 256 bytes of elements
    dst = accel.Buffer(view.nbytes)

    def refused():
        with pytest.raises(ValueError, match="contiguous"):
            dst.copy_from(view)

    calls = vendor_calls_made_by(refused)
    queued = {k: v for k, v in calls.items() if k in ("cudaStreamWaitEvent", "cudaEventRecord")}
    assert not queued, f"a refused copy queued {queued}"


# -- 4. the last-use stream closed by another thread between the check and the wait ----------------
# (r71q found; fixed in session 31)
def test_cai_getter_survives_the_last_use_stream_closing_meanwhile(cuda2, monkeypatch):
    import accel.buffer.buffer_class as B
    b0 = accel.Buffer(256).copy_from(_pattern())
    s1 = accel.Stream(1)
    accel.Buffer(256, device=1).copy_from(b0, stream=s1)
    assert b0.last_stream == s1
    real = B.current_stream
    closed = []

    def current_stream(*a, **kw):
        # another thread's s1.close() lands here: after the getter's `last.closed` check
        if not closed:
            closed.append(True)
            s1.close()
        return real(*a, **kw)

    monkeypatch.setattr(B, "current_stream", current_stream)
    cai = b0.__cuda_array_interface__
    assert closed
    assert cai["stream"] in (1, accel.current_stream(0).handle)


# -- 5. XPU staged peer copy interrupted right after its first half was queued ----------------------
# (r71q found; fixed in session 31)
def test_xpu_staged_copy_interrupted_as_the_source_read_is_queued_waits_for_it(monkeypatch):
    if "xpu" not in SIMS:
        pytest.skip("ACCEL_TEST_SIMS leaves out xpu")
    use_sim(monkeypatch, "xpu", ACCEL_SIM_PEER="none")
    from accel import _lazy
    be = _lazy.lazy_init()
    a = accel.Buffer(4096, device=1).copy_from(np.full(4096, 5, np.uint8))
    b = accel.Buffer(4096)
    source = be._device(1).default
    real_enqueue, real_sync = be._enqueue, be._sync_stream
    fired, synced = [], []

    def enqueue(s, what, call, *args, **kw):
        seq = real_enqueue(s, what, call, *args, **kw)
        if s is source and call == "zeCommandListAppendMemoryCopy" and not fired:
            fired.append(seq)
            raise KeyboardInterrupt     # delivered as the call returns: the read is queued
        return seq

    def sync(s):
        if fired:                       # the waits after the read was queued
            synced.append(s)
        return real_sync(s)

    monkeypatch.setattr(be, "_enqueue", enqueue)
    monkeypatch.setattr(be, "_sync_stream", sync)
    with pytest.raises(KeyboardInterrupt):
        b.copy_from(a)
    assert fired, "the staged path was not taken"
    assert source in synced, "the interrupted staged copy returned without waiting for the source card's read"
