"""The Metal backend's host-side writes wait for every stream's GPU work (r62).

Apple, MTLBuffer.h: "The contents become undefined if both the CPU and GPU write to the same
buffer without a synchronizing action between those writes.  This is true even when the regions
written do not overlap."  accel's caching allocator carves many Buffers out of one MTLBuffer,
and the backend writes some ranges on the CPU (an unaligned fill or copy: Metal's blits take
multiples of 4).  It synchronized only the stream of the write: another stream could still be
writing another block of the same MTLBuffer on the GPU."""

import pytest

import accel
from accel import _lazy
from conftest import use_sim


@pytest.mark.parametrize("how", ["memset", "memcpy"])
def test_an_unaligned_host_write_waits_for_other_streams_on_the_same_mtlbuffer(monkeypatch, how):
    use_sim(monkeypatch, "mps", ACCEL_SIM_DELAY_US="2000")
    be = _lazy.lazy_init()
    a, b = accel.Buffer(64), accel.Buffer(64)
    assert be._resolve(a.ptr, 64)[0] is be._resolve(b.ptr, 64)[0], "the test needs one MTLBuffer"
    s1, s2 = accel.Stream(), accel.Stream()
    for i in range(20):
        b.fill_(i, stream=s2)          # GPU writes of the same MTLBuffer, queued on s2
    src = accel.Buffer(64, stream=s1)
    if how == "memset":
        be.memset_async(a.ptr + 1, 7, 3, s1.handle)
    else:
        be.memcpy_async(a.ptr + 1, src.ptr + 1, 3, s1.handle)
    assert s2.query(), "the CPU wrote the MTLBuffer while another stream's GPU writes to it were queued"
    accel.synchronize()
