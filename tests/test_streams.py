"""Streams, events and buffers over every simulated runtime (issue: streams)."""

import threading

import numpy as np
import pytest

import accel
from conftest import use_sim

DELAY_US = 20000  # per simulated op: makes an unordered read observably early


@pytest.fixture
def delayed(sim_backend, monkeypatch):
    monkeypatch.setenv("ACCEL_SIM_DELAY_US", str(DELAY_US))
    return use_sim(monkeypatch, sim_backend)


def _race(order_with_event: bool) -> np.ndarray:
    """s1 fills `src` (slowly, 5 ops); s2 copies src -> dst, ordered by an event or not."""
    s1, s2 = accel.Stream(), accel.Stream()
    src, dst = accel.Buffer(256, stream=s1), accel.Buffer(256, stream=s2)
    src.fill_(0, s1)
    dst.fill_(0, s2)
    s1.synchronize(); s2.synchronize()
    for value in (1, 2, 3, 4, 7):
        src.fill_(value, s1)
    done = s1.record_event()
    if order_with_event:
        s2.wait_event(done)
    src.record_stream(s2)
    accel.Buffer.copy_from(dst, src, stream=s2, non_blocking=True)
    s2.synchronize()
    return dst.to_numpy(stream=s2)


def test_wait_event_orders_streams_under_delay(delayed):
    assert (_race(order_with_event=True) == 7).all()


def test_without_wait_the_race_is_observed(delayed):
    # Proves the test above can fail: the unordered copy reads before the last fill.
    assert not (_race(order_with_event=False) == 7).all()


def test_wait_stream_orders_streams(delayed):
    s1, s2 = accel.Stream(), accel.Stream()
    buf = accel.Buffer(64, stream=s1)
    for value in (1, 2, 9):
        buf.fill_(value, s1)
    s2.wait_stream(s1)
    out = np.zeros(64, np.uint8)
    buf.record_stream(s2)
    buf.copy_to(out, stream=s2)
    assert (out == 9).all()


def test_elapsed_time_positive_and_monotone(delayed):
    s = accel.Stream()
    buf = accel.Buffer(1024, stream=s)
    e0, e1, e2 = (accel.Event(enable_timing=True) for _ in range(3))
    e0.record(s)
    buf.fill_(1, s)
    e1.record(s)
    buf.fill_(2, s)
    buf.fill_(3, s)
    e2.record(s)
    first, total = e0.elapsed_time(e1), e0.elapsed_time(e2)
    assert first > 0
    assert total >= first
    assert e1.elapsed_time(e2) > 0


def test_event_errors(sim_backend):
    e_plain, e_timed = accel.Event(), accel.Event(enable_timing=True)
    with pytest.raises(ValueError, match="enable_timing=True"):
        e_plain.elapsed_time(e_timed)
    with pytest.raises(ValueError, match="must be recorded"):
        e_timed.elapsed_time(accel.Event(enable_timing=True))
    assert e_plain.query()  # never recorded: complete
    e_plain.synchronize()
    e_plain.record()
    e_plain.synchronize()
    assert e_plain.query()
    e_plain.close()
    with pytest.raises(RuntimeError, match="closed"):
        e_plain.record()


def test_query_and_synchronize(delayed):
    s = accel.Stream()
    buf = accel.Buffer(64, stream=s)
    buf.fill_(5, s)
    assert s.query() is False
    s.synchronize()
    assert s.query() is True


def test_current_stream_is_per_thread_and_per_device(sim_backend):
    main_default = accel.current_stream()
    assert main_default == accel.default_stream()
    s = accel.Stream()
    accel.set_stream(s)
    assert accel.current_stream() == s
    seen = {}

    def other():
        seen["before"] = accel.current_stream()
        mine = accel.Stream()
        accel.set_stream(mine)
        seen["after"] = accel.current_stream()
        seen["mine"] = mine

    t = threading.Thread(target=other)
    t.start(); t.join()
    assert seen["before"] == accel.default_stream()
    assert seen["after"] == seen["mine"] != s
    assert accel.current_stream() == s
    if accel.device_count() > 1:
        assert accel.current_stream(1) == accel.default_stream(1)


def test_stream_context_restores_on_exception(sim_backend):
    before = accel.current_stream()
    s = accel.Stream()
    with pytest.raises(ZeroDivisionError):
        with s:
            assert accel.current_stream() == s
            1 / 0
    assert accel.current_stream() == before


def test_stream_context_switches_device(sim_backend):
    if accel.device_count() < 2:
        pytest.skip("needs two devices")
    s = accel.Stream(1)
    with s:
        assert accel.current_device_index() == 1
        assert accel.current_stream() == s
    assert accel.current_device_index() == 0
    assert accel.current_stream(1) == accel.default_stream(1)


def test_set_stream_switches_device(sim_backend):
    if accel.device_count() < 2:
        pytest.skip("needs two devices")
    s = accel.Stream("%s:1" % sim_backend)
    accel.set_stream(s)
    assert accel.current_device_index() == 1
    assert accel.current_stream() == s


def test_stream_identity_and_close(sim_backend):
    s = accel.Stream(priority=-1)
    assert s == s and hash(s) == hash(s)
    assert s != accel.Stream()
    assert isinstance(s.handle, int)
    assert s.device == accel.device(sim_backend, 0)
    accel.set_stream(s)
    s.close()
    s.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        s.synchronize()
    with pytest.raises(RuntimeError, match="closed"):
        accel.set_stream(s)
    assert accel.current_stream() == accel.default_stream()
    with pytest.raises(RuntimeError, match="cannot be closed"):
        accel.default_stream().close()


def test_wrong_device_mixes(sim_backend):
    if accel.device_count() < 2:
        pytest.skip("needs two devices")
    s0, s1 = accel.Stream(0), accel.Stream(1)
    e = accel.Event()
    e.record(s0)
    with pytest.raises(ValueError, match="device 0 but the stream is on device 1"):
        e.record(s1)
    buf = accel.Buffer(16, device=0)
    with pytest.raises(ValueError, match="stream is on device 1"):
        buf.fill_(1, s1)
    with pytest.raises(ValueError, match="stream is on device 1"):
        accel.Buffer(16, device=0, stream=s1)
    s1.wait_event(e)  # cross-device waits are legal, as in CUDA


def test_buffer_round_trips(sim_backend):
    data = np.arange(1000, dtype=np.float32)
    buf = accel.Buffer(data.nbytes)
    buf.copy_from(data)
    assert np.array_equal(buf.to_numpy(np.float32), data)
    buf.copy_from(data[::-1].copy(), non_blocking=True)
    assert np.array_equal(buf.to_numpy("float32", shape=(10, 100)), data[::-1].reshape(10, 100))
    other = accel.Buffer(data.nbytes).copy_from(buf)
    assert np.array_equal(other.to_numpy(np.float32), data[::-1])
    buf.fill_(0xAB)
    assert (buf.to_numpy() == 0xAB).all()
    raw = accel.Buffer(5).copy_from(b"hello")
    assert raw.to_numpy().tobytes() == b"hello"
    assert len(accel.Buffer(0).to_numpy()) == 0


def test_non_blocking_copy_lets_caller_reuse_source(delayed):
    s = accel.Stream()
    buf = accel.Buffer(4096, stream=s)
    src = np.full(4096, 3, np.uint8)
    buf.copy_from(src, non_blocking=True)
    src[:] = 9  # overwritten before the delayed copy runs
    assert (buf.to_numpy() == 3).all()


def test_buffer_bad_input_copies_nothing(sim_backend):
    buf = accel.Buffer(16)
    buf.fill_(7)
    with pytest.raises(ValueError, match="size mismatch"):
        buf.copy_from(np.zeros(8, np.uint8))
    with pytest.raises(ValueError, match="size mismatch"):
        buf.copy_from(accel.Buffer(8))
    with pytest.raises(ValueError, match="not C-contiguous"):
        buf.copy_from(np.zeros((4, 8), np.uint8)[:, ::2])
    with pytest.raises(TypeError, match="cannot copy from"):
        buf.copy_from(12)
    with pytest.raises(ValueError, match="read-only"):
        buf.copy_to(bytes(16))
    with pytest.raises(ValueError, match="byte value"):
        buf.fill_(300)
    assert (buf.to_numpy() == 7).all()
    with pytest.raises(ValueError, match=">= 0"):
        accel.Buffer(-1)
    with pytest.raises(TypeError, match="must be an int"):
        accel.Buffer(3.5)
    buf.close()
    buf.close()
    with pytest.raises(RuntimeError, match="closed"):
        buf.to_numpy()


def test_cuda_array_interface(sim_cuda):
    buf = accel.Buffer(32)
    cai = buf.__cuda_array_interface__
    assert cai["version"] == 3 and cai["data"] == (buf.ptr, False) and cai["shape"] == (32,)
    assert cai["stream"] == 1  # the legacy default stream, as the v3 protocol spells it
    s = accel.Stream()
    buf8 = accel.Buffer(8, stream=s)
    # the last-use stream (issue 17): the allocation stream before any operation, not the current one
    assert buf8.__cuda_array_interface__["stream"] == s.handle
    buf8.fill_(0)
    assert buf8.__cuda_array_interface__["stream"] == 1
