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
    # test/test_cuda.py::TestCuda::test_events (flags): interprocess and external events
    # are refused with the reason (accel shares no event between processes; the simulated
    # and real backends record no external event nodes in a capture).
    assert accel.Event(interprocess=False).handle == 0
    with pytest.raises(NotImplementedError, match="interprocess"):
        accel.Event(interprocess=True)
    with pytest.raises(NotImplementedError, match="external"):
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
