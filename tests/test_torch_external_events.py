"""``Event(external=True)``: timing and waiting inside graphs (issue 16, streams and events).

Ports torch's external-event tests -- test/test_cuda.py::TestCuda::test_graph_timing (in
tests/test_torch_cuda_graphs.py), test/test_cuda.py::TestCudaDeviceParametrized::
test_graph_external_wait_and_record and aten/src/ATen/test/cuda_event_test.cpp::
testCUDAExternalEvent -- plus accel's own cases: each replay times its own events, an external
event of the non-current device, query() inside a capture, elapsed_time against an event
recorded outside the graph, and the backends without external events.

Nothing is timed: a gate kernel holds a stream until the test opens it, and a sleep kernel
gives elapsed times a lower bound (time.sleep sleeps at least that long).
"""

import threading
import time

import numpy as np
import pytest

import accel
from accel import Graph, _lazy
from accel._errors import CaptureError
from accel.sim import kernels

from conftest import use_sim

_gates = {}


def _gate_kernel(grid, block, view, gate):
    assert _gates[gate].wait(30), "test gate never opened"


def _sleep_kernel(grid, block, view, flag, us):
    """Sleep ``us`` microseconds, or the u32 at device address ``flag`` when it is not 0."""
    if flag:
        us = int(view(flag, 4, np.uint32)[0])
    time.sleep(us / 1e6)


kernels.register("accel_test_ev_gate", ("u32",), _gate_kernel)
kernels.register("accel_test_ev_sleep", ("ptr", "u32"), _sleep_kernel)
_PTX = (b".version 6.3\n.target sm_75\n.address_size 64\n"
        b".visible .entry accel_test_ev_gate(\n .param .u32 gate\n)\n{\n ret;\n}\n"
        b".visible .entry accel_test_ev_sleep(\n .param .u64 flag,\n .param .u32 us\n)\n{\n ret;\n}\n")


@pytest.fixture
def cuda(monkeypatch):
    """The CUDA simulator with every stream operation on its worker (a gated stream never
    blocks the test's thread)."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=1)
    yield
    for g in _gates.values():
        g.set()


def _function(name):
    backend = _lazy.lazy_init()
    return backend, backend.module_function(backend.module_load(_PTX), name)


def _launch(name, args, stream):
    backend, fn = _function(name)
    with accel.device_index(stream.device_index):      # a launch needs its stream's device current
        backend.launch(fn, (1, 1, 1), (1, 1, 1), args, 0, stream.handle)


def gate(stream, name):
    """Hold ``stream`` (or a capture of it) at a kernel until the returned threading.Event is set."""
    _gates[name] = g = threading.Event()
    _launch("accel_test_ev_gate", [("u32", name)], stream)
    return g


def sleep(stream, us=0, flag=None):
    """Queue a kernel that sleeps ``us`` µs (or the u32 in device Buffer ``flag``) on ``stream``."""
    _launch("accel_test_ev_sleep", [("ptr", flag.ptr if flag is not None else 0), ("u32", us)], stream)


def _u32(buf, value, stream):
    src = np.array([value], np.uint32)
    buf.copy_from(src, stream)


# -- torch's tests -------------------------------------------------------------------------

def test_cuda_event_test__testCUDAExternalEvent(cuda):
    # aten/src/ATen/test/cuda_event_test.cpp::CUDAEventTest.testCUDAExternalEvent: two external
    # events around a sleep in a capture; after a replay elapsed_time between them is positive.
    start_event = accel.Event(enable_timing=True, external=True)
    end_event = accel.Event(enable_timing=True, external=True)
    stream = accel.Stream()
    graph = Graph()
    with stream:
        graph.capture_begin()
        start_event.record()
        sleep(stream, 3000)
        end_event.record()
        graph.capture_end()
    stream.synchronize()
    graph.replay()
    accel.synchronize()
    assert start_event.elapsed_time(end_event) >= 3.0          # the sleep's 3 ms at least


def test_cuda__test_graph_external_wait_and_record(cuda):
    # test/test_cuda.py::TestCudaDeviceParametrized::test_graph_external_wait_and_record: torch's
    # spin-wait kernel on a pinned flag is the gate kernel here, and its non-blocking copy to
    # pinned memory (refused in an accel capture) a device-to-device copy.
    x = accel.Buffer(16)
    x.fill_(1)
    x_copy = accel.Buffer(16)
    x_copy.fill_(0)
    accel.synchronize()
    start_event = accel.Event(external=True)
    end_event = accel.Event(external=True)
    signalling_graph = Graph()
    with accel.graph(signalling_graph, capture_error_mode="relaxed"):
        gate(accel.current_stream(), 1)
        start_event.record()
    # A record during capture is not a record: the event is still the empty set of work.
    assert start_event.query(), "Start event's work should be empty"
    work_graph = Graph()
    with accel.graph(work_graph, capture_error_mode="relaxed"):
        start_event.wait()
        x_copy.copy_from(x, non_blocking=True)
        end_event.record()
    assert (x_copy.to_numpy() == 0).all(), "Copy cannot occur until start_event is recorded"
    try:
        signalling_stream = accel.Stream()
        with signalling_stream:
            signalling_graph.replay()
        work_stream = accel.Stream()
        with work_stream:
            work_graph.replay()
        assert not end_event.query(), "Event record node cannot run until the gate opens"
        assert not work_stream.query()
    finally:
        _gates[1].set()
    end_event.synchronize()
    assert (x_copy.to_numpy() == 1).all(), "Copy should be done once end_event is synchronized"
    assert work_stream.query(), "end_event.synchronize() completing should imply that work_stream is done"


# -- accel's cases -------------------------------------------------------------------------

def test_each_replay_times_its_own_events(cuda):
    s = accel.Stream()
    flag = accel.Buffer(4)
    start = accel.Event(enable_timing=True, external=True)
    end = accel.Event(enable_timing=True, external=True)
    g = Graph()
    with s, g:
        start.record()
        sleep(s, flag=flag)             # sleeps what ``flag`` holds at replay time
        end.record()
    with pytest.raises(accel.AcceleratorError):
        start.elapsed_time(end)         # captured, never replayed: never recorded
    with s:
        _u32(flag, 2000, s)
        g.replay()
    end.synchronize()
    assert start.elapsed_time(end) >= 2.0
    mid = accel.Event(enable_timing=True)
    s.record_event(mid)
    with s:
        _u32(flag, 20000, s)
        g.replay()
    s.synchronize()
    assert start.elapsed_time(end) >= 20.0       # the second replay's own 20 ms
    assert mid.elapsed_time(start) >= 0.0        # start was recorded again, after mid
    assert mid.elapsed_time(end) >= 20.0


def test_elapsed_time_between_an_external_and_a_plain_event(cuda):
    s = accel.Stream()
    before = accel.Event(enable_timing=True)
    start = accel.Event(enable_timing=True, external=True)
    end = accel.Event(enable_timing=True, external=True)
    g = Graph()
    with s, g:
        start.record()
        sleep(s, 5000)
        end.record()
    with s:
        before.record()
        sleep(s, 2000)                  # outside the graph, between ``before`` and the replay
        g.replay()
    after = s.record_event(accel.Event(enable_timing=True))
    after.synchronize()
    assert before.elapsed_time(start) >= 2.0
    assert before.elapsed_time(end) >= 7.0
    assert start.elapsed_time(after) >= 5.0
    assert end.elapsed_time(after) >= 0.0


def test_external_event_of_the_non_current_device(cuda):
    # Device 1's stream captures and replays while device 0 is the current device.
    s1 = accel.Stream(1)
    start = accel.Event(enable_timing=True, external=True)
    end = accel.Event(enable_timing=True, external=True)
    g = Graph()
    with s1, g:
        accel.set_device_index(0)       # record with device 0 current (the capture is on device 1)
        start.record(s1)
        sleep(s1, 3000)
        end.record(s1)
        accel.set_device_index(1)
    assert accel.current_device_index() == 0
    assert start.device == accel.device("cuda", 1)
    g.replay()                          # on device 1's current stream, device 0 stays current
    assert accel.current_device_index() == 0
    end.synchronize()
    assert start.elapsed_time(end) >= 3.0
    # ... and a device-0 graph waits for it: an event wait node across devices
    s0 = accel.Stream(0)
    out = accel.Buffer(8, device=0)
    out.fill_(0)
    accel.synchronize()
    waiter = Graph()
    with s0, waiter:
        end.wait(s0)
        out.fill_(7, s0)
    with accel.device_index(1):
        gate(accel.current_stream(1), 2)
    g.replay()                          # now held behind the gate on device 1
    with s0:
        waiter.replay()
    assert not s0.query()
    assert kernels.read(out.ptr, 8) == b"\0" * 8      # the simulator's memory, read without a sync
    _gates[2].set()
    s0.synchronize()
    assert (out.to_numpy() == 7).all()


def test_query_of_an_external_event_inside_a_capture_follows_the_capture_rule(cuda):
    # CUDA Programming Guide, "Prohibited and Unhandled Operations": cudaEventQuery of any event
    # while a global-mode capture is underway fails and invalidates the capture.
    e = accel.Event(external=True)
    s = accel.Stream()
    g = Graph()
    with pytest.raises(CaptureError):
        with s, g:
            e.record()
            e.query()
    assert accel.is_current_stream_capturing() is False
    # relaxed mode allows it: the captured record node is not a record, so the event is complete
    g2 = Graph(capture_error_mode="relaxed")
    with s, g2:
        e.record()
        assert e.query() is True
        e.synchronize()
    g2.replay()
    e.synchronize()
    assert e.query() is True


def test_plain_event_recorded_in_a_capture_is_still_a_capture_internal_dependency(cuda):
    # The rule external events avoid: a plain event recorded during capture cannot be queried
    # or synchronized afterwards (cudaErrorCapturedEvent).
    e = accel.Event()
    s = accel.Stream()
    g = Graph()
    with s, g:
        e.record()
        accel.Buffer(4, stream=s).fill_(0, s)
    with pytest.raises(CaptureError, match="907|[Cc]aptured"):
        e.query()


def test_outside_capture_external_changes_nothing(cuda):
    s, t = accel.Stream(), accel.Stream(1)
    a = accel.Event(enable_timing=True, external=True)
    b = accel.Event(enable_timing=True, external=True)
    assert a.external is True and accel.Event().external is False
    out = accel.Buffer(4, device=1)
    out.fill_(0, t)
    g = gate(s, 3)
    a.record(s)
    sleep(s, 1000)
    b.record(s)
    b.wait(t)                           # across devices
    out.fill_(9, t)
    assert not a.query() and not t.query()
    g.set()
    t.synchronize()
    assert (out.to_numpy() == 9).all()
    assert a.elapsed_time(b) >= 1.0


def test_graph_keeps_its_external_events_and_refuses_a_closed_one(cuda):
    import gc
    import weakref
    s = accel.Stream()
    e = accel.Event(external=True)
    ref = weakref.ref(e)
    g = Graph()
    with s, g:
        e.record()
    del e
    gc.collect()
    assert ref() is not None            # the graph keeps it: every replay records it
    g.replay()
    ref().synchronize()
    ref().close()
    with pytest.raises(RuntimeError, match="closed"):
        g.replay()
    g.reset()
    gc.collect()
    assert ref() is None                # reset lets it go


def test_external_events_on_backends_without_them(monkeypatch):
    # Level Zero's captures record no events; Metal has no capture: refused at construction,
    # naming the backend, so code written for CUDA fails where it starts.
    for name in ("xpu", "mps"):
        use_sim(monkeypatch, name)
        with pytest.raises(NotImplementedError, match=f"not available on {name}"):
            accel.Event(enable_timing=True, external=True)
        assert accel.Event(enable_timing=True).external is False
        assert not _lazy.is_initialized()       # the check started no runtime


def test_external_record_on_a_stream_outside_the_capture_is_a_plain_record(cuda):
    # torch passes cudaEventRecordExternal when the *current* stream captures, which CUDA rejects
    # for a stream that is not capturing; accel asks the recording stream itself.
    s, other = accel.Stream(), accel.Stream()
    e = accel.Event(external=True)
    g = Graph()
    with s, g:
        accel.Buffer(4, stream=s).fill_(1, s)
        e.record(other)                 # other is not part of the capture
    e.synchronize()                     # a real record: no captured-event error
    assert e.query() is True
    assert g._events == ()              # and no node of the graph keeps it
