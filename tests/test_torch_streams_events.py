"""torch's stream and event tests, ported to accel (issue 16, first bullet).

Each test names the torch test it ports (file::test); the bodies keep torch's checks
where accel has the same API, on the simulators' two devices, the non-current one too.
"""

import pytest

import accel
from accel import _lazy


def _two_devices():
    if accel.device_count() < 2:
        pytest.skip("needs two devices (the Metal simulator has one)")


# -- events ------------------------------------------------------------------------------

def test_cuda__test_generic_stream_event_signature(sim_backend):
    # test/test_cuda.py::TestCuda::test_generic_stream_event (torch.Event's signature):
    # Event(device=None, *, enable_timing=False, blocking=False, interprocess=False).
    e = accel.Event(sim_backend)
    assert e.enable_timing is False          # was: the device string turned timing on
    assert e.blocking is False
    assert e.device == accel.device(sim_backend)
    assert e.device.index is None            # torch keeps the type only until the first record
    assert e.handle == 0                     # torch's event_id / cuda_event before the first record
    e2 = accel.Event(accel.device(sim_backend, 0), enable_timing=True, blocking=True)
    assert (e2.enable_timing, e2.blocking) == (True, True)
    with pytest.raises(TypeError):
        accel.Event(True)                    # torch: argument 'device' must be torch.device, not bool
    with pytest.raises(TypeError):
        accel.Event(None, True)              # the flags are keyword-only
    other = "xpu" if sim_backend != "xpu" else "cuda"
    with pytest.raises(ValueError, match="doesn't match the current accelerator"):
        accel.Event(other)


def test_cuda__test_events_handle_after_record(sim_backend):
    # test/cpp_extensions/open_registration_extension test_record_event: event_id is 0 before
    # the first record, non-zero after, and two recorded events differ.
    e1, e2 = accel.Event(), accel.Event()
    assert e1.handle == 0 and e2.handle == 0
    s = accel.Stream()
    s.record_event(e1)
    s.record_event(e2)
    assert e1.handle != 0 and e2.handle != 0 and e1.handle != e2.handle
    assert e1.device == accel.device(sim_backend, s.device_index)


def test_cuda__test_event_interprocess_and_external(sim_backend):
    # test/test_cuda.py::TestCuda::test_events (flags): interprocess events are refused with
    # the reason (accel shares no event between processes); external events work on CUDA
    # (tests/test_torch_external_events.py) and are refused, naming the backend, where the
    # backend records no event nodes in a capture (Level Zero) or has no capture (Metal).
    assert accel.Event(interprocess=False).handle == 0
    with pytest.raises(NotImplementedError, match="interprocess"):
        accel.Event(interprocess=True)
    if sim_backend == "cuda":
        e = accel.Event(external=True)
        assert e.external is True and e.handle == 0
        e.record()
        e.synchronize()
    else:
        with pytest.raises(NotImplementedError, match=f"external=True.*{sim_backend}"):
            accel.Event(external=True)


def test_cuda_multigpu__test_events_multi_gpu_elapsed_time(sim_backend):
    # test/test_cuda_multigpu.py::TestCudaMultiGPU::test_events_multi_gpu_elapsed_time:
    # events of two devices have no common clock; torch raises RuntimeError.  accel's error
    # is a ValueError too (what it raised before).
    _two_devices()
    e0 = accel.Event(enable_timing=True)
    e1 = accel.Event(enable_timing=True)
    e0.record(accel.Stream(0))
    e1.record(accel.Stream(1))
    with pytest.raises(RuntimeError):
        e0.elapsed_time(e1)
    with pytest.raises(ValueError):
        e1.elapsed_time(e0)
    # same device, the non-current one: works
    s1 = accel.Stream(1)
    a, b = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    s1.record_event(a)
    s1.record_event(b)
    b.synchronize()
    assert a.elapsed_time(b) >= 0
    assert accel.current_device_index() == 0


def test_cuda__test_events_elapsed_time_errors(sim_backend):
    # test/test_accelerator.py::TestAccelerator::test_event_elapsed_time_behavior (generic
    # torch.Event): ValueErrors with torch's messages.
    e1, e2 = accel.Event(), accel.Event()
    with pytest.raises(ValueError, match="Both events must be created with argument 'enable_timing=True'"):
        e1.elapsed_time(e2)
    e1, e2 = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    with pytest.raises(ValueError, match="Both events must be recorded before calculating elapsed time"):
        e1.elapsed_time(e2)


# -- streams -------------------------------------------------------------------------------

_DEVICE_TYPES = {"cuda": 1, "xpu": 12, "mps": 13}     # c10::DeviceType, as torch's Stream.device_type


def test_cuda__test_generic_stream_event(sim_backend):
    # test/test_cuda.py::TestCuda::test_generic_stream_event: a torch.Stream rebuilt from
    # (stream_id, device_index, device_type) is equal to the original, for each device.
    for index in range(accel.device_count()):
        s = accel.Stream(index)
        assert s.device_index == index
        assert s.device_type == _DEVICE_TYPES[sim_backend]
        assert isinstance(s.stream_id, int)
        rebuilt = accel.Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)
        assert rebuilt == s and hash(rebuilt) == hash(s)
        assert rebuilt.device == accel.device(sim_backend, index)
        d = accel.default_stream(index)
        assert d.stream_id != s.stream_id
        assert accel.Stream(stream_id=d.stream_id, device_index=index, device_type=d.device_type) == d
    assert accel.current_device_index() == 0
    with pytest.raises(TypeError, match="stream_id, device_index and device_type"):
        accel.Stream(stream_id=s.stream_id, device_index=s.device_index)
    with pytest.raises(ValueError, match="device_type"):
        accel.Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=0)
    with pytest.raises(ValueError, match="no live accel stream"):
        accel.Stream(stream_id=s.stream_id + 12345, device_index=s.device_index, device_type=s.device_type)


def test_cuda__test_generic_stream_rebuilt_after_close(sim_backend):
    # A closed stream's handle may be handed to the next stream the driver creates: a rebuild
    # from the stale id must not name the new stream silently.
    s = accel.Stream()
    sid = s.stream_id
    s.close()
    with pytest.raises(ValueError, match="no live accel stream"):
        accel.Stream(stream_id=sid, device_index=0, device_type=_DEVICE_TYPES[sim_backend])


def test_cuda__test_streams_priority(sim_backend):
    # test/test_cuda.py::TestCuda::test_streams_priority: priority_range() is a static
    # (least, greatest) pair; a stream keeps its (clamped) priority; the default stream's is 0.
    low, high = accel.Stream.priority_range()
    assert low >= high
    assert accel.Stream.priority_range() == accel.Stream().priority_range()
    for index in range(accel.device_count()):
        s = accel.Stream(index, priority=high)
        assert s.priority == high and s.device_index == index
        s = accel.Stream(index, priority=low)
        assert s.priority == low
    assert accel.Stream(priority=high - 100).priority == high      # clamped, as CUDA
    assert accel.Stream(priority=low + 100).priority == low
    assert accel.default_stream().priority == 0
    assert accel.current_stream().priority == 0


def test_cuda__test_stream_is_capturing(sim_backend):
    # test/test_cuda.py::TestCuda::test_is_current_stream_capturing (and torch.cuda.graphs'
    # is_current_stream_capturing): False outside a capture, True on the capturing stream.
    assert accel.is_current_stream_capturing() is False     # before init: no runtime started
    assert not _lazy.is_initialized()
    s = accel.Stream()
    assert s.is_capturing() is False
    assert accel.default_stream().is_capturing() is False
    assert accel.is_current_stream_capturing() is False
    if sim_backend == "mps":
        return                                          # Metal has no stream capture
    g = accel.Graph()
    seen = []
    buf = accel.Buffer(16)
    with accel.graph(g):
        buf.fill_(1)
        seen.append((accel.is_current_stream_capturing(), accel.current_stream().is_capturing(),
                     s.is_capturing()))
    assert seen == [(True, True, False)]
    assert accel.is_current_stream_capturing() is False


def test_cuda__test_cuda_stream_protocol(sim_backend):
    # test/test_cuda.py::TestCuda::test_cuda_stream_protocol: __cuda_stream__() -> (0, handle),
    # on CUDA only (other accelerators' streams do not claim the CUDA protocol), for a Stream
    # and for an ExternalStream of its handle.
    s = accel.Stream()
    if sim_backend == "cuda":
        assert s.__cuda_stream__() == (0, s.handle)
        assert accel.default_stream().__cuda_stream__() == (0, 0)
        result = s.__cuda_stream__()
        assert isinstance(result, tuple) and len(result) == 2
        external_stream = accel.ExternalStream(s.handle)
        external_result = external_stream.__cuda_stream__()
        assert external_result[0] == 0
        assert external_result[1] == external_stream.handle == s.handle
    else:
        assert not hasattr(s, "__cuda_stream__")
        assert not hasattr(accel.ExternalStream(s.handle), "__cuda_stream__")
