"""Foreign streams (issue 17 item 5): Stream.from_handle (torch's ExternalStream) and objects with
the CUDA stream protocol (``__cuda_stream__() -> (0, handle)``) wherever accel takes a Stream."""

import gc

import numpy as np
import pytest

import accel
from accel import _lazy, sim
from accel._errors import InvalidDeviceError
from conftest import use_sim


class Proto:
    """Only the CUDA stream protocol, as a cuda.core / CuPy stream offers it."""

    def __init__(self, handle, version=0, **attrs):
        self._value = (version, handle)
        self.__dict__.update(attrs)

    def __cuda_stream__(self):
        return self._value


@pytest.fixture
def raw(sim_cuda):
    """A stream made through the backend, as another library would: accel holds no Stream of it."""
    backend = _lazy.lazy_init()
    made = []

    def make(device=0):
        with accel.streams.on_device(backend, device):
            handle = backend.stream_create()
        made.append(handle)
        return handle

    yield make
    gc.collect()
    for handle in made:
        try:
            backend.stream_destroy(handle)
        except Exception:
            pass    # the test destroyed it itself


def _allocator(index=0):
    return accel.memory.device_allocator(index)


def test_from_handle_copies_and_events(raw):
    h = raw()
    s = accel.Stream.from_handle(h)
    assert (s.device_index, s.handle, s.__cuda_stream__()) == (0, h, (0, h))
    buf = accel.Buffer(64, stream=s)
    buf.copy_from(np.arange(64, dtype=np.uint8), stream=s)
    other = accel.Stream()
    e = accel.Event()
    e.record(s)
    e.wait(other)
    out = accel.Buffer(64)
    out.copy_from(buf, stream=other)
    assert (out.to_numpy(stream=other) == np.arange(64)).all()
    s.wait_stream(other)
    s.synchronize()
    assert s.query()


def test_close_never_destroys(raw):
    h = raw()
    streams = sim.state().streams
    s = accel.Stream.from_handle(h)
    s.close()
    s.close()               # idempotent
    assert s.closed
    with pytest.raises(RuntimeError, match="closed"):
        s.synchronize()
    del s
    gc.collect()
    assert sim.state().streams == streams      # the simulator still has it
    _lazy.lazy_init().stream_query(h)          # and it still works
    assert accel.Stream.from_handle(h).query()


def test_new_object_each_time_equal_by_handle(raw):
    h = raw()
    a, b = accel.Stream.from_handle(h), accel.Stream.from_handle(h, device=0)
    assert a is not b and a == b and hash(a) == hash(b)
    a.close()
    assert not b.closed and b.query()        # closing one wrapper leaves the others
    assert "foreign" in repr(b)
    # rebuilt from its ids while a wrapper lives, as torch's Stream(stream_id=...)
    again = accel.Stream(stream_id=b.stream_id, device_index=b.device_index, device_type=b.device_type)
    assert again == b


def test_default_and_own_handles(sim_cuda):
    assert accel.Stream.from_handle(0) == accel.default_stream()
    assert accel.Stream.from_handle(1) == accel.default_stream()  # cudaStreamLegacy
    assert accel.Stream.from_handle(0, device=1) == accel.default_stream(1)
    wrapped = accel.Stream.from_handle(0)
    wrapped.close()                             # a wrapper: closing it closes no runtime stream
    assert not accel.default_stream().closed
    mine = accel.Stream()
    other = accel.Stream.from_handle(mine.handle)
    assert other == mine and other is not mine
    other.close()
    assert not mine.closed and mine.query()    # accel's own stream stays open
    # the protocol gives accel's own objects back for its own handles
    e = accel.Event()
    e.record(Proto(mine.handle))
    e.record(Proto(0))


def test_protocol_object_accepted_everywhere(raw):
    h = raw()
    p = Proto(h)
    buf = accel.Buffer(32, stream=p)
    assert buf.stream.handle == h
    buf.copy_from(np.full(32, 7, np.uint8), stream=p)
    buf.fill_(3, stream=p)
    e = accel.Event()
    e.record(p)
    e.wait(p)
    other = accel.Buffer(32)
    other.record_stream(p)
    accel.Stream().wait_stream(p)
    assert (buf.to_numpy(stream=p) == 3).all()
    previous = accel.current_stream()
    accel.set_stream(p)
    try:
        assert accel.current_stream().handle == h
    finally:
        accel.set_stream(previous)


def test_graph_on_protocol_stream(raw):
    h = raw()
    buf = accel.Buffer(16)
    buf.fill_(0)
    accel.synchronize()
    g = accel.Graph()
    with accel.graph(g, stream=Proto(h)):
        buf.fill_(5)
    g.replay()
    accel.synchronize()
    assert (buf.to_numpy() == 5).all()


def test_close_refused_while_capturing(raw):
    s = accel.Stream.from_handle(raw())
    g = accel.Graph()
    buf = accel.Buffer(16)
    with s:
        g.capture_begin()
        try:
            buf.fill_(1)
            with pytest.raises(RuntimeError, match="capture on it is underway"):
                s.close()
        finally:
            g.capture_end()
    s.close()


@pytest.mark.parametrize("handle, exc, text", [
    (-1, ValueError, ">= 0"), ("1", TypeError, "must be an int"), (1.0, TypeError, "must be an int"),
    (True, TypeError, "must be an int"), (None, TypeError, "must be an int"),
    (0xDEAD0, ValueError, "not a live CUDA stream"), (2, ValueError, "cudaStreamPerThread"),
])
def test_bad_handles(sim_cuda, handle, exc, text):
    with pytest.raises(exc, match=text):
        accel.Stream.from_handle(handle)


def test_destroyed_handle_refused(raw):
    h = raw()
    _lazy.lazy_init().stream_destroy(h)
    with pytest.raises(ValueError, match="Stream.from_handle: .* not a live CUDA stream"):
        accel.Stream.from_handle(h)


def test_bad_devices(raw):
    h = raw()
    with pytest.raises(InvalidDeviceError, match="belongs to device 0, not device 1; pass device=0"):
        accel.Stream.from_handle(h, device=1)
    with pytest.raises(RuntimeError):   # torch's class too
        accel.Stream.from_handle(h, device="cuda:1")
    with pytest.raises((ValueError, RuntimeError), match="out of index range|range"):
        accel.Stream.from_handle(h, device=5)
    with pytest.raises((TypeError, ValueError)):
        accel.Stream.from_handle(h, device=[0])
    with pytest.raises(ValueError):
        accel.Stream.from_handle(h, device="xpu:0")
    assert accel.Stream.from_handle(h, device=accel.device("cuda", 0)).device_index == 0


def test_stream_of_device_1_while_0_is_current(raw):
    h = raw(device=1)
    assert accel.current_device_index() == 0
    s = accel.Stream.from_handle(h)            # the runtime says which device
    assert s.device_index == 1
    assert accel.Stream.from_handle(h, device=1) == s
    buf = accel.Buffer(16, device=1, stream=s)
    buf.copy_from(np.arange(16, dtype=np.uint8), stream=s)
    e = accel.Event()
    e.record(s)
    e.synchronize()
    assert (buf.to_numpy(stream=s) == np.arange(16)).all()
    assert accel.current_device_index() == 0
    with pytest.raises(ValueError, match="device 1 but the buffer is on device 0"):
        accel.Buffer(16, device=0).fill_(1, stream=Proto(h))
    # the protocol object on device 1 too, and a device-0 event refuses it
    with pytest.raises(InvalidDeviceError):
        ev = accel.Event()
        ev.record(accel.current_stream(0))
        ev.record(Proto(h))


def test_two_devices_each_with_a_foreign_stream(raw):
    h0, h1 = raw(0), raw(1)
    s0, s1 = accel.Stream.from_handle(h0), accel.Stream.from_handle(h1)
    assert (s0.device_index, s1.device_index) == (0, 1)
    a = accel.Buffer(8, device=0, stream=s0).copy_from(np.full(8, 4, np.uint8), stream=s0)
    b = accel.Buffer(8, device=1, stream=s1)
    s1.wait_stream(s0)
    b.copy_from(a, stream=s1)
    assert (b.to_numpy(stream=s1) == 4).all()


def test_protocol_errors(sim_cuda):
    e = accel.Event()
    with pytest.raises(TypeError, match=r"Event\.record\(stream\): expected an accel.Stream or an object "
                                        r"with __cuda_stream__.*got list"):
        e.record([])
    with pytest.raises(TypeError, match=r"Buffer\(stream\)"):
        accel.Buffer(8, stream="s")
    with pytest.raises(TypeError, match=r"^stream: .*got int"):
        accel.Buffer(8).fill_(0, stream=5)
    with pytest.raises(ValueError, match="protocol version 1; accel understands version 0"):
        e.record(Proto(0, version=1))
    with pytest.raises(TypeError, match=r"\(version, handle\)"):
        e.wait(type("Bad", (), {"__cuda_stream__": lambda self: 7})())
    with pytest.raises(TypeError, match="handle"):
        e.record(Proto("0x10"))
    with pytest.raises(ValueError, match=r"set_stream\(stream\): .*not a live CUDA stream"):
        accel.set_stream(Proto(0xDEAD0))
    with pytest.raises(TypeError, match=r"graph\(stream\)"):
        with accel.graph(accel.Graph(), stream=object()):
            pass


def test_protocol_device_hint_when_runtime_cannot_tell(monkeypatch):
    # CUDA 12.4 has no cudaStreamGetDevice: the object's own device attribute is used
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CUDA_RUNTIME="12.4")
    backend = _lazy.lazy_init()
    assert backend.foreign_stream(0x1234) == (0x1234, None)
    with accel.streams.on_device(backend, 1):
        h = backend.stream_create()
    try:
        e = accel.Event()
        e.record(Proto(h, device_index=1))      # torch's attribute
        assert e.device.index == 1
        assert accel.Stream.from_handle(h).device_index == 0   # none given: the current device, as torch
    finally:
        gc.collect()
        backend.stream_destroy(h)


def test_foreign_allocator_lists_forgotten_with_last_wrapper(raw):
    h = raw()
    s = accel.Stream.from_handle(h)
    keep = accel.Stream.from_handle(h)
    buf = accel.Buffer(4096, stream=s)
    buf.close()
    assert h in _allocator()._general          # its free list is keyed by the handle
    del buf, s
    gc.collect()
    assert h in _allocator()._general          # another wrapper still lives
    keep.close()
    assert h not in _allocator()._general      # forgotten; never destroyed
    assert accel.streams._foreign.get((0, h)) is None
    _lazy.lazy_init().stream_query(h)


def test_transient_wrappers_leave_no_state(raw):
    h = raw()
    buf = accel.Buffer(256)
    for _ in range(20):
        buf.fill_(1, stream=Proto(h))
        accel.Event().record(Proto(h))
    assert buf.stream.handle != h
    buf.close()
    del buf     # it kept its last-use stream
    gc.collect()
    assert len(accel.streams._foreign) == 0
    assert h not in _allocator()._used_on and h not in _allocator()._general


def test_recycled_handle_inherits_no_free_list(raw, monkeypatch):
    """The owner destroys the stream after accel's wrappers went, and the driver gives its handle
    to a new stream: the old stream's queued work must not race with the new stream's use of the
    memory it freed (torch would hand the new stream the old free list at once)."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=20000)
    backend = _lazy.lazy_init()
    h = backend.stream_create()
    s = accel.Stream.from_handle(h)
    buf = accel.Buffer(4096, stream=s)
    for value in (1, 2, 3, 4, 5):
        buf.fill_(value, stream=s)             # slow work still queued on the old stream
    buf.close()
    del buf, s
    gc.collect()
    backend.stream_destroy(h)                  # its queued work still runs
    h2 = backend.stream_create()
    assert h2 == h                             # the simulator recycles handles, as the driver
    try:
        s2 = accel.Stream.from_handle(h2)
        new = accel.Buffer(4096, stream=s2)
        new.fill_(9, stream=s2)
        accel.synchronize()
        assert (new.to_numpy(stream=s2) == 9).all()
        new.close()
        s2.close()
    finally:
        gc.collect()
        backend.stream_destroy(h2)


def test_other_backends(sim_backend):
    backend = _lazy.lazy_init()
    handle = backend.stream_create()
    try:
        s = accel.Stream.from_handle(handle)
        assert s.handle == handle and s.device_index == 0
        buf = accel.Buffer(16, stream=s).copy_from(np.arange(16, dtype=np.uint8), stream=s)
        assert (buf.to_numpy(stream=s) == np.arange(16)).all()
        s.close()
        backend.stream_query(handle)           # still alive
        with pytest.raises(ValueError, match="Stream.from_handle"):
            accel.Stream.from_handle(0xDEAD0)
        if sim_backend != "cuda":
            with pytest.raises(ValueError, match="is a CUDA stream"):
                accel.Event().record(Proto(handle))
        buf.close()
    finally:
        gc.collect()
        backend.stream_destroy(handle)




def test_external_stream_is_torchs_name_for_from_handle(raw):
    """torch.cuda.ExternalStream(stream_ptr, device=None): accel.ExternalStream is the same wrapper."""
    h = raw(1)
    s = accel.ExternalStream(h, device=1)
    assert isinstance(s, accel.Stream) and s == accel.Stream.from_handle(h, 1) and s.device_index == 1
    b = accel.Buffer(16, device=1)
    b.fill_(5, stream=s)
    assert bytes(b.to_numpy(stream=s)) == b"\x05" * 16
    with pytest.raises(TypeError, match="handle must be an int"):
        accel.ExternalStream("0x10")
