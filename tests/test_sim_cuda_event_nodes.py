"""External events in the simulated CUDA runtime: event record and event wait nodes.

CUDA Runtime API, cudaEventRecordWithFlags / cudaStreamWaitEvent: with
cudaEventRecordExternal / cudaEventWaitExternal during stream capture the event is
"captured in the graph as an external event node"; cudaGraphAddEventRecordNode: "Each
launch of the graph will record event"; cudaGraphAddEventWaitNode: "The graph node will
wait for all work captured in event".  cuda.h (CUevent_record_flags, CUevent_wait_flags):
both flags are "invalid when used outside of capture".

Nothing here is timed: a gate kernel holds a stream until the test opens it, and a sleep
kernel gives elapsed times a lower bound (time.sleep sleeps at least that long).
"""

import threading
import time

import pytest

from accel import sim
from accel.sim import cudart, kernels
from accel._ffi._cudart import ffi

_gates = {}


def _gate_kernel(grid, block, view, gate):
    assert _gates[gate].wait(30), "test gate never opened"


def _sleep_kernel(grid, block, view, flag, us):
    """Sleep ``us`` microseconds, or the u32 at device address ``flag`` when it is not 0."""
    import numpy as np
    if flag:
        us = int(view(flag, 4, np.uint32)[0])
    time.sleep(us / 1e6)


kernels.register("accel_test_ext_gate", ("u32",), _gate_kernel)
kernels.register("accel_test_ext_sleep", ("ptr", "u32"), _sleep_kernel)
PTX = (b".version 6.3\n.target sm_75\n.address_size 64\n"
       b".visible .entry accel_test_ext_gate(\n .param .u32 gate\n)\n{\n ret;\n}\n"
       b".visible .entry accel_test_ext_sleep(\n .param .u64 flag,\n .param .u32 us\n)\n{\n ret;\n}\n")

EXTERNAL = 1            # cudaEventRecordExternal == cudaEventWaitExternal (driver_types.h)
NULL_STREAM = ffi.cast("cudaStream_t", 0)


@pytest.fixture
def lib():
    sim.reset()
    sim.configure(delay_us=1)       # every operation through the stream workers (no inline run)
    _loaded.clear()
    lib = sim.open_library("cudart")
    for name in (b"accel_test_ext_gate", b"accel_test_ext_sleep"):
        _kernel(lib, name)
    yield lib
    for g in _gates.values():
        g.set()
    sim.reset()


def ok(rc):
    assert rc == 0, f"{ffi.string(cudart.cudaGetErrorName(rc)).decode()} ({rc})"


def stream(lib, flags=1):
    p = ffi.new("cudaStream_t *")
    ok(lib.cudaStreamCreateWithPriority(p, flags, 0))
    return p[0]


def event(lib, flags=0):
    p = ffi.new("cudaEvent_t *")
    ok(lib.cudaEventCreateWithFlags(p, flags))
    return p[0]


def malloc(lib, n):
    p = ffi.new("void **")
    ok(lib.cudaMalloc(p, n))
    return p[0]


def read(ptr, n):
    return kernels.read(ptr, n)


_CT = {"ptr": "void **", "u32": "uint32_t *"}


_loaded = {}


def _kernel(lib, name):
    """The kernel ``name`` of the test module (loaded once per test, before any capture)."""
    if name in _loaded:
        return _loaded[name]
    p = ffi.new("cudaLibrary_t *")
    ok(lib.cudaLibraryLoadData(p, ffi.new("char[]", PTX), ffi.NULL, ffi.NULL, 0, ffi.NULL, ffi.NULL, 0))
    k = ffi.new("cudaKernel_t *")
    ok(lib.cudaLibraryGetKernel(k, p[0], name))
    _loaded[name] = k[0]
    return k[0]


def launch(lib, name, args, s):
    values = [ffi.new(_CT[t], v) for t, v in args]
    argv = ffi.new("void *[]", [ffi.cast("void *", v) for v in values])
    return lib.cudaLaunchKernel(ffi.cast("void *", _kernel(lib, name)), ffi.new("dim3 *", (1, 1, 1))[0],
                                ffi.new("dim3 *", (1, 1, 1))[0], argv, 0, s)


def gate(lib, s, name):
    """Queue a kernel on ``s`` that holds it until the returned threading.Event is set."""
    _gates[name] = g = threading.Event()
    ok(launch(lib, b"accel_test_ext_gate", [("u32", name)], s))
    return g


def sleep(lib, s, us=0, flag=None):
    ok(launch(lib, b"accel_test_ext_sleep", [("ptr", flag or ffi.NULL), ("u32", us)], s))


def capture(lib, s, mode=0):
    ok(lib.cudaStreamBeginCapture(s, mode))


def end_capture(lib, s):
    g = ffi.new("cudaGraph_t *")
    rc = lib.cudaStreamEndCapture(s, g)
    return rc, g[0]


def instantiate(lib, graph):
    x = ffi.new("cudaGraphExec_t *")
    ok(lib.cudaGraphInstantiate(x, graph, 0))
    return x[0]


def captured(lib, s, body, mode=0):
    """Capture ``body()`` on ``s`` and return the instantiated graph."""
    capture(lib, s, mode)
    body()
    rc, graph = end_capture(lib, s)
    ok(rc)
    return instantiate(lib, graph)


def elapsed(lib, a, b):
    ms = ffi.new("float *")
    ok(lib.cudaEventElapsedTime(ms, a, b))
    return ms[0]


def node_count(lib, graph):
    n = ffi.new("size_t *")
    ok(lib.cudaGraphGetNodes(graph, ffi.NULL, n))
    return n[0]


# -- recording ----------------------------------------------------------------------------

def test_external_record_in_capture_is_a_node_and_leaves_the_event_alone(lib):
    s = stream(lib)
    e = event(lib)
    d = malloc(lib, 8)
    capture(lib, s)
    ok(lib.cudaMemsetAsync(d, 1, 8, s))
    ok(lib.cudaEventRecordWithFlags(e, s, EXTERNAL))
    # not a captured event: the capture is still valid after using it from the host...
    rc, graph = end_capture(lib, s)
    ok(rc)
    assert node_count(lib, graph) == 2                  # the memset and the event record node
    # ... and until a launch records it, the event is the empty set of work (cudaEventRecord:
    # "Before the first call ..., an event represents an empty set of work").
    ok(lib.cudaEventQuery(e))
    ok(lib.cudaEventSynchronize(e))
    ms = ffi.new("float *")
    assert lib.cudaEventElapsedTime(ms, e, e) == lib.cudaErrorInvalidResourceHandle   # never recorded


def test_external_record_flags_outside_capture_are_invalid(lib):
    s = stream(lib)
    e = event(lib)
    # cuda.h CUevent_record_flags: CU_EVENT_RECORD_EXTERNAL "is invalid when used outside of capture":
    # cudaErrorIllegalState on an H100 (tests/conformance/cuda_h100_2026-12-05.json, scenario
    # event_external_outside_capture)
    assert lib.cudaEventRecordWithFlags(e, s, EXTERNAL) == lib.cudaErrorIllegalState
    assert lib.cudaEventRecordWithFlags(e, s, 2) == lib.cudaErrorInvalidValue
    ok(lib.cudaEventQuery(e))                          # nothing was recorded
    ok(lib.cudaEventRecordWithFlags(e, s, 0))          # cudaEventRecordDefault: a plain record
    ok(lib.cudaEventSynchronize(e))


def test_plain_record_with_flags_in_capture_stays_a_captured_event(lib):
    s = stream(lib)
    e = event(lib)
    capture(lib, s)
    ok(lib.cudaEventRecordWithFlags(e, s, 0))
    assert lib.cudaEventQuery(e) == lib.cudaErrorCapturedEvent     # the current rule, unchanged
    assert end_capture(lib, s)[0] == lib.cudaErrorStreamCaptureInvalidated


def test_record_node_needs_the_events_device(lib):
    e0 = event(lib)
    ok(lib.cudaSetDevice(1))
    s1 = stream(lib)
    capture(lib, s1)
    assert lib.cudaEventRecordWithFlags(e0, s1, EXTERNAL) == lib.cudaErrorInvalidResourceHandle
    ok(end_capture(lib, s1)[0])


def test_each_launch_records_the_event_with_its_own_time(lib):
    s = stream(lib)
    start, end, mid = event(lib), event(lib), event(lib)
    flag = malloc(lib, 4)
    ok(lib.cudaMemset(flag, 0, 4))

    def body():
        ok(lib.cudaEventRecordWithFlags(start, s, EXTERNAL))
        sleep(lib, s, flag=flag)
        ok(lib.cudaEventRecordWithFlags(end, s, EXTERNAL))

    x = captured(lib, s, body)
    kernels.write(flag, (2000).to_bytes(4, "little"))              # first launch sleeps 2 ms
    ok(lib.cudaGraphLaunch(x, s))
    ok(lib.cudaEventSynchronize(end))
    first = elapsed(lib, start, end)
    assert first >= 2.0
    ok(lib.cudaEventRecord(mid, s))
    ok(lib.cudaStreamSynchronize(s))
    kernels.write(flag, (20000).to_bytes(4, "little"))             # the second 20 ms
    ok(lib.cudaGraphLaunch(x, s))
    ok(lib.cudaStreamSynchronize(s))
    assert elapsed(lib, start, end) >= 20.0
    assert elapsed(lib, mid, start) >= 0.0          # start was recorded again, after mid


def test_record_node_completes_in_stream_order(lib):
    s = stream(lib)
    e = event(lib, lib.cudaEventDisableTiming)

    def body():
        gate(lib, s, 1)
        ok(lib.cudaEventRecordWithFlags(e, s, EXTERNAL))

    x = captured(lib, s, body)
    ok(lib.cudaGraphLaunch(x, s))
    assert lib.cudaEventQuery(e) == lib.cudaErrorNotReady          # the launch recorded it
    _gates[1].set()
    ok(lib.cudaEventSynchronize(e))
    ok(lib.cudaStreamSynchronize(s))


def test_record_node_mid_graph_releases_waiters_before_the_graph_ends(lib):
    s, other = stream(lib), stream(lib)
    e = event(lib, lib.cudaEventDisableTiming)
    d = malloc(lib, 4)
    ok(lib.cudaMemset(d, 0, 4))

    def body():
        ok(lib.cudaMemsetAsync(d, 7, 4, s))
        ok(lib.cudaEventRecordWithFlags(e, s, EXTERNAL))
        gate(lib, s, 2)

    x = captured(lib, s, body)
    ok(lib.cudaGraphLaunch(x, s))
    ok(lib.cudaStreamWaitEvent(other, e, 0))
    ok(lib.cudaStreamSynchronize(other))           # returns while the graph still holds the gate
    assert read(d, 4) == b"\x07" * 4
    assert lib.cudaStreamQuery(s) == lib.cudaErrorNotReady
    _gates[2].set()
    ok(lib.cudaStreamSynchronize(s))


# -- waiting ------------------------------------------------------------------------------

def test_wait_node_waits_for_a_record_made_after_capture(lib):
    # test/test_cuda.py::TestCudaDeviceParametrized::test_graph_external_wait_and_record, in
    # simulator calls: the event is never recorded when the waiting graph is captured.
    sig_s, work_s = stream(lib), stream(lib)
    start, end = event(lib, lib.cudaEventDisableTiming), event(lib, lib.cudaEventDisableTiming)
    x, y = malloc(lib, 4), malloc(lib, 4)
    ok(lib.cudaMemset(x, 1, 4))
    ok(lib.cudaMemset(y, 0, 4))

    def signalling():
        gate(lib, sig_s, 3)
        ok(lib.cudaEventRecordWithFlags(start, sig_s, EXTERNAL))

    def work():
        ok(lib.cudaStreamWaitEvent(work_s, start, EXTERNAL))
        ok(lib.cudaMemcpyAsync(y, x, 4, lib.cudaMemcpyDeviceToDevice, work_s))
        ok(lib.cudaEventRecordWithFlags(end, work_s, EXTERNAL))

    sig_x = captured(lib, sig_s, signalling, mode=2)
    ok(lib.cudaEventQuery(start))                   # a record node is not a record
    work_x = captured(lib, work_s, work, mode=2)
    ok(lib.cudaGraphLaunch(sig_x, sig_s))
    ok(lib.cudaGraphLaunch(work_x, work_s))
    assert lib.cudaEventQuery(end) == lib.cudaErrorNotReady
    assert read(y, 4) == b"\x00" * 4                # the copy waits for the signalling graph
    _gates[3].set()
    ok(lib.cudaEventSynchronize(end))
    assert read(y, 4) == b"\x01" * 4
    ok(lib.cudaStreamQuery(work_s))


def test_wait_node_uses_the_record_current_at_launch(lib):
    a, b, w = stream(lib), stream(lib), stream(lib)
    e = event(lib, lib.cudaEventDisableTiming)
    x = captured(lib, w, lambda: ok(lib.cudaStreamWaitEvent(w, e, EXTERNAL)))
    ok(lib.cudaGraphLaunch(x, w))                   # e never recorded: nothing to wait for
    ok(lib.cudaStreamSynchronize(w))
    g = gate(lib, a, 4)
    ok(lib.cudaEventRecord(e, a))
    ok(lib.cudaGraphLaunch(x, w))                   # waits for the record on a
    ok(lib.cudaEventRecord(e, b))                   # a later record does not change that launch
    ok(lib.cudaEventSynchronize(e))
    assert lib.cudaStreamQuery(w) == lib.cudaErrorNotReady
    g.set()
    ok(lib.cudaStreamSynchronize(w))


def test_wait_node_across_devices(lib):
    ok(lib.cudaSetDevice(1))
    s1 = stream(lib)
    e1 = event(lib, lib.cudaEventDisableTiming)
    ok(lib.cudaSetDevice(0))
    s0 = stream(lib)
    d = malloc(lib, 4)
    ok(lib.cudaMemset(d, 0, 4))
    x = captured(lib, s0, lambda: (ok(lib.cudaStreamWaitEvent(s0, e1, EXTERNAL)),
                                   ok(lib.cudaMemsetAsync(d, 5, 4, s0))))
    ok(lib.cudaSetDevice(1))
    g = gate(lib, s1, 5)                            # a launch needs its stream's device current
    ok(lib.cudaSetDevice(0))
    ok(lib.cudaEventRecord(e1, s1))                 # device 1's event and stream, device 0 current
    ok(lib.cudaGraphLaunch(x, s0))
    assert lib.cudaStreamQuery(s0) == lib.cudaErrorNotReady
    assert read(d, 4) == b"\x00" * 4
    g.set()
    ok(lib.cudaStreamSynchronize(s0))
    assert read(d, 4) == b"\x05" * 4


def test_external_wait_flag_outside_capture_is_invalid(lib):
    s, t = stream(lib), stream(lib)
    e = event(lib)
    ok(lib.cudaEventRecord(e, t))
    # cuda.h CUevent_wait_flags: CU_EVENT_WAIT_EXTERNAL "is invalid when used outside of capture":
    # cudaErrorIllegalState on an H100 (tests/conformance/cuda_h100_2026-12-05.json, scenario
    # event_external_outside_capture)
    assert lib.cudaStreamWaitEvent(s, e, EXTERNAL) == lib.cudaErrorIllegalState
    assert lib.cudaStreamWaitEvent(s, e, 2) == lib.cudaErrorInvalidValue
    ok(lib.cudaStreamWaitEvent(s, e, 0))


def test_external_wait_on_an_event_recorded_in_the_same_capture_is_refused(lib):
    # The docs say nothing of an event wait node on a capture-internal record: refused.
    s = stream(lib)
    e = event(lib)
    capture(lib, s)
    ok(lib.cudaEventRecord(e, s))
    assert lib.cudaStreamWaitEvent(s, e, EXTERNAL) == lib.cudaErrorStreamCaptureUnsupported
    assert end_capture(lib, s)[0] == lib.cudaErrorStreamCaptureInvalidated


# -- launching ----------------------------------------------------------------------------

def test_launch_refuses_a_destroyed_event_and_queues_nothing(lib):
    s = stream(lib)
    e = event(lib)
    d = malloc(lib, 4)
    ok(lib.cudaMemset(d, 0, 4))
    x = captured(lib, s, lambda: (ok(lib.cudaMemsetAsync(d, 9, 4, s)),
                                  ok(lib.cudaEventRecordWithFlags(e, s, EXTERNAL))))
    ok(lib.cudaEventDestroy(e))
    again = event(lib)                              # may get the destroyed handle's value back
    assert lib.cudaGraphLaunch(x, s) == lib.cudaErrorInvalidResourceHandle
    ok(lib.cudaStreamSynchronize(s))
    assert read(d, 4) == b"\x00" * 4
    ok(lib.cudaEventQuery(again))


def test_event_nodes_in_a_graph_launched_during_capture_are_refused(lib):
    s, c = stream(lib), stream(lib)
    e = event(lib)
    x = captured(lib, s, lambda: ok(lib.cudaEventRecordWithFlags(e, s, EXTERNAL)))
    capture(lib, c)
    assert lib.cudaGraphLaunch(x, c) == lib.cudaErrorStreamCaptureUnsupported
    assert end_capture(lib, c)[0] == lib.cudaErrorStreamCaptureInvalidated


def test_dot_names_the_event_nodes(lib, tmp_path):
    s = stream(lib)
    e = event(lib)
    capture(lib, s)
    ok(lib.cudaStreamWaitEvent(s, e, EXTERNAL))
    ok(lib.cudaEventRecordWithFlags(e, s, EXTERNAL))
    rc, graph = end_capture(lib, s)
    ok(rc)
    assert node_count(lib, graph) == 2
    path = tmp_path / "g.dot"
    ok(lib.cudaGraphDebugDotPrint(graph, str(path).encode(), 1))
    dot = path.read_text()
    assert "EVENT_WAIT" in dot and "EVENT_RECORD" in dot and "->" in dot
