"""Session 34's own checks of the exporter's stream obligations (accel/_dlpack/ordering.py
order_after_other_uses, accel/streams.py _ExportMark): the stream a ``__cuda_array_interface__``
or ``__dlpack__`` consumer is given orders after the buffer's work on every stream, and an
exported stream outlives a close() while the buffer lives.  On device 1 while device 0 is
current."""

import gc

import pytest

import accel
from accel import streams as _streams
from conftest import SIMS, use_sim
from torch_port_util import hold

pytestmark = pytest.mark.usefixtures("frozen_module_heap")


@pytest.fixture
def d1(monkeypatch):
    if "cuda" not in SIMS:
        pytest.skip("ACCEL_TEST_SIMS leaves out cuda")
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DEVICES=2, ACCEL_SIM_DELAY_US=50)
    return 1


def _done(handle, index):
    backend = accel._lazy.lazy_init()
    with _streams.on_device(backend, index):
        return backend.stream_query(handle)


@pytest.mark.parametrize("how", ["cai", "dlpack"])
def test_the_allocation_stream_pending_work_is_covered(d1, how):
    """The buffer is filled on its allocation stream A (held there) and then read on B: the
    stream handed over waits for A's fill too, not only for B."""
    a, b, consumer = accel.Stream(d1), accel.Stream(d1), accel.Stream(d1)
    buf = accel.Buffer(256, device=d1, stream=a)
    out = accel.Buffer(256, device=d1, stream=b)
    gate = hold(a)
    try:
        buf.fill_(7, stream=a)
        out.copy_from(buf, stream=b, non_blocking=True)     # (b's copy does not wait for a: torch's rule)
        b.synchronize()
        if how == "cai":
            handle = buf.__cuda_array_interface__["stream"]
        else:
            buf.__dlpack__(stream=consumer.handle, max_version=(1, 0))
            handle = consumer.handle
        waits = not _done(handle, d1)
    finally:
        gate.set()
    accel.synchronize(d1)
    assert waits and accel.current_device_index() == 0


def test_no_wait_is_queued_for_streams_whose_work_is_done(d1):
    """Streams with nothing queued are not waited for: reading the interface queues no event
    wait (it is read at every consumer call)."""
    a, b = accel.Stream(d1), accel.Stream(d1)
    buf = accel.Buffer(256, device=d1, stream=a).fill_(1, stream=a)
    accel.Buffer(256, device=d1, stream=b).copy_from(buf, stream=b)
    accel.synchronize(d1)
    alloc = accel.memory.device_allocator(d1)
    calls = []
    real = alloc.order_after
    alloc.order_after = lambda *args: calls.append(args) or real(*args)
    try:
        for _ in range(3):
            assert buf.__cuda_array_interface__["stream"] == b.handle
    finally:
        del alloc.order_after
    assert calls == []


def test_a_closed_exported_stream_is_destroyed_with_the_buffer(d1):
    """The exported stream's destroy waits for the buffer (close() or collection), then runs:
    the handle goes back to the driver, and no mark is left on the stream."""
    for end in ("close", "collect"):
        side = accel.Stream(d1)
        buf = accel.Buffer(64, device=d1, stream=side).fill_(1, stream=side)
        handle = buf.__cuda_array_interface__["stream"]
        side.close()
        assert side._releases and side._busy            # destroy deferred to the buffer's end
        later = accel.Stream(d1)
        assert later.handle != handle
        if end == "close":
            buf.close()
        else:
            del buf
            gc.collect()
        assert not side._busy and not side._releases    # destroyed now
        later.close()


def test_a_second_export_moves_the_mark(d1):
    """An export naming another stream keeps the first one's mark too (r73e/r75a: CAI v3
    "Lifetime management", the first consumer may still use its stream), one mark per stream
    however many exports (state bounded by live objects), all dropped by the buffer's close."""
    s1, s2 = accel.Stream(d1), accel.Stream(d1)
    buf = accel.Buffer(64, device=d1, stream=s1).fill_(1, stream=s1)
    buf.__cuda_array_interface__
    assert len(s1._busy) == 1
    buf.fill_(2, stream=s2)
    assert buf.__cuda_array_interface__["stream"] == s2.handle
    buf.__cuda_array_interface__
    assert len(s1._busy) == 1 and len(s2._busy) == 1
    s1.close()
    assert s1._releases                                 # held back while the buffer lives
    buf.close()
    assert not s1._busy and not s1._releases and not s2._busy


def test_export_inside_a_capture_of_the_exported_stream_refuses_nothing(d1):
    """A buffer used on two streams, read on a stream being captured: the consumer's work is
    captured (it runs at a replay), so no wait on the other stream is queued or refused."""
    a, s = accel.Stream(d1), accel.Stream(d1)
    buf = accel.Buffer(256, device=d1, stream=a).fill_(3, stream=a)
    accel.synchronize(d1)
    g = accel.Graph()
    with s, g:
        buf.fill_(4, stream=s)
        cai = buf.__cuda_array_interface__
        assert cai["stream"] == s.handle
        assert accel.is_current_stream_capturing()
    g.replay()
    accel.synchronize(d1)
    assert set(buf.to_numpy().tolist()) == {4}
    del g
    gc.collect()


def test_a_closed_allocation_stream_is_waited_for_once(d1):
    """A buffer allocated on a stream closed since: its queued work is waited for by a device
    synchronize at the first export only (a closed stream queues nothing more), not at every read
    of the interface."""
    side = accel.Stream(d1)
    buf = accel.Buffer(256, device=d1, stream=side).fill_(5, stream=side)
    side.close()
    backend = accel._lazy.lazy_init()
    calls = []
    real = backend.device_synchronize
    backend.device_synchronize = lambda: calls.append(1) or real()
    try:
        buf.__cuda_array_interface__
        first = len(calls)
        for _ in range(3):
            buf.__cuda_array_interface__
            buf.__dlpack__(stream=-1)
    finally:
        del backend.device_synchronize
    assert first >= 1 and len(calls) == first
    assert set(buf.to_numpy().tolist()) == {5}
