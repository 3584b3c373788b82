"""r75a: the fixes of two r73e interop bugs, at their edges.

- Buffer.__cuda_array_interface__ keeps every exported stream alive while the buffer lives (CAI v3
  "Lifetime management" > "Streams"), one mark per distinct stream, all dropped by close().
- Buffer.__dlpack__ refuses a consumer stream outside the capture its data was last written in
  (the wait would fork it into the capture), and still serves a stream of that capture.
"""

import gc

import pytest

import accel
from accel import _dlpack as D

from test_foreign_consumers_r73e import DEV, N, cuda  # noqa: F401  (the fixture: device 1 data, device 0 current)


def _alive(handle):
    from accel.sim import cudart
    return handle in cudart._R.streams


def test_cai_marks_one_per_distinct_stream_and_close_drops_them(cuda):
    a, b = accel.Stream(DEV), accel.Stream(DEV)
    buf = accel.Buffer(N, device=DEV)
    for i in range(10):
        stream = a if i % 2 else b
        buf.fill_(i, stream=stream)
        assert buf.__cuda_array_interface__["stream"] == stream.handle
    assert (len(a._busy), len(b._busy)) == (1, 1)
    handles = a.handle, b.handle
    a.close()
    b.close()
    assert all(_alive(h) for h in handles), "an exported stream was destroyed while its buffer lives"
    buf.close()
    assert not a._busy and not b._busy
    accel.synchronize(DEV)
    assert not any(_alive(h) for h in handles), "the closed exported streams outlived the buffer's close"


def test_dlpack_during_a_capture_refused_outside_it_served_inside_it(cuda):
    with accel.device_index(DEV):
        s, forked, outside = accel.Stream(), accel.Stream(), accel.Stream()
        buf = accel.Buffer(N, stream=s)
        accel.synchronize()
        live = D.live_exports()
        g = accel.Graph()
        with s:
            g.capture_begin()
            try:
                buf.fill_(3)
                with pytest.raises(accel.CaptureError, match="not capturing"):
                    buf.__dlpack__(stream=outside.handle, max_version=(1, 0))
                assert buf.last_stream == s and D.live_exports() == live
                forked.wait_stream(s)               # joins the capture
                capsule = buf.__dlpack__(stream=forked.handle, max_version=(1, 0))
                buf.fill_(5, stream=forked)
                s.wait_stream(forked)               # and back, so the capture can end
            finally:
                g.capture_end()
        del capsule
        gc.collect()
        assert D.live_exports() == live
        g.replay()
        accel.synchronize()
        assert set(buf.to_numpy().tolist()) == {5}
