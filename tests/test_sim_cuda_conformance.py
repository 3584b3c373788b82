"""The CUDA simulator against real GPUs: never more lenient, call by call.

tests/conformance/ holds what the real runtime returned for every call of
tools/cuda_conformance.py's scenarios: on an H200 (driver 580.159.04, libcudart 13.0, 2026-12-04,
95 scenarios) and on an H100 (the same driver and runtime, 2026-12-05, all 136).  The same
scenarios run here on the simulator; a call the simulator accepts where a GPU refused is a
simulator bug (a test on the simulator would pass where the program fails on hardware).  The
simulator may be stricter (it refuses what the documents leave undefined); those calls are listed
in accel/sim/README.md.  The tests after the first pin the rules those runs brought to light.
"""

import json
import os
import sys

import pytest

from accel import sim
from accel._ffi._cudart import ffi
from test_sim_cuda import _in_thread, capture, end_capture, event, lib, malloc, ok, stream  # noqa: F401
from test_sim_cuda_strict import memset_graph

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import cuda_conformance as conformance  # noqa: E402

CONFORMANCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conformance")
RECORDINGS = ("cuda_h200_2026-12-04.json", "cuda_h100_2026-12-05.json")

#: Scenarios whose real run killed the process (no return codes came back), with the call that
#: did it and the code the simulator answers instead: a program must never make that call.
CRASHED_ON_GPU = {
    # H100, 2026-12-05: the process ended with SIGSEGV; every step before the launch had run on
    # the H200 and H100 before (launch_in_capture_and_graph_after_unload shares them).
    "launch_after_library_unload": ("launch after unload", 98),
}


def _recorded(name):
    with open(os.path.join(CONFORMANCE, name)) as fh:
        return {k: v for k, v in json.load(fh).items() if not k.startswith("_")}


@pytest.mark.parametrize("recording", RECORDINGS)
def test_the_simulator_is_never_more_lenient_than_the_recorded_gpu(lib, recording):
    real = _recorded(recording)
    # scenarios added since the recording wait for the next GPU run (python tools/cuda_conformance.py --real)
    assert set(real) <= set(conformance.SCENARIOS), "a recorded scenario was renamed or removed: re-record"
    results = {}
    for name in real:
        sim.reset()
        results[name] = conformance.run_one(name, real=False)
    crashed = {name for name, res in real.items() if str(res.get("error", "")).startswith("exit -11")}
    assert crashed <= set(CRASHED_ON_GPU), f"a scenario crashed on the GPU: {sorted(crashed - set(CRASHED_ON_GPU))}"
    lenient = {name: [row for row in rows if row[0] in ("sim_lenient", "steps_differ", "error")]
               for name, rows in conformance.compare(results, real).items() if name not in crashed}
    assert not {k: v for k, v in lenient.items() if v}
    for name in crashed:
        label, code = CRASHED_ON_GPU[name]
        assert dict(results[name]["steps"])[label] == code, (name, results[name]["steps"])


def test_ending_a_global_capture_from_another_thread_ends_it(lib):
    # Measured on the H200 (scenario capture_end_other_thread_global): cudaStreamEndCapture from a
    # thread other than the one that began a global-mode capture returns
    # cudaErrorStreamCaptureWrongThread AND the capture is over: the stream reports no capture and
    # the capturing thread's own cudaStreamEndCapture then fails with cudaErrorIllegalState.
    s = stream(lib)
    d = malloc(lib, 16)
    capture(lib, s, lib.cudaStreamCaptureModeGlobal)
    ok(lib.cudaMemsetAsync(d, 1, 4, s))
    assert _in_thread(lambda: end_capture(lib, s)[0]) == lib.cudaErrorStreamCaptureWrongThread
    status = ffi.new("enum cudaStreamCaptureStatus *")
    ok(lib.cudaStreamIsCapturing(s, status))
    assert status[0] == lib.cudaStreamCaptureStatusNone
    assert end_capture(lib, s)[0] == lib.cudaErrorIllegalState
    p = ffi.new("void **")
    ok(lib.cudaMalloc(p, 16))                  # no capture underway any more
    ok(lib.cudaFree(p[0]))


def test_launching_a_graph_into_a_capturing_stream_is_refused(lib):
    # Measured on the H200 (scenario capture_graph_launch_inside): cudaGraphLaunch into a stream
    # being captured returns cudaErrorStreamCaptureUnsupported and invalidates the capture.
    _, x = memset_graph(lib, stream(lib), malloc(lib, 16))
    s = stream(lib)
    capture(lib, s)
    assert lib.cudaGraphLaunch(x, s) == lib.cudaErrorStreamCaptureUnsupported
    assert end_capture(lib, s)[0] == lib.cudaErrorStreamCaptureInvalidated
    lib.cudaGetLastError()
    ok(lib.cudaGraphLaunch(x, s))              # outside a capture it runs
    ok(lib.cudaStreamSynchronize(s))


def test_an_event_of_an_ended_capture_is_an_invalid_value(lib):
    # Measured on the H200 (scenario capture_wait_event_of_ended_capture): waiting on or querying
    # an event last recorded in a capture that has ended returns cudaErrorInvalidValue.
    s, other = stream(lib), stream(lib)
    ev = event(lib)
    d = malloc(lib, 16)
    capture(lib, s)
    ok(lib.cudaMemsetAsync(d, 1, 4, s))
    ok(lib.cudaEventRecord(ev, s))
    ok(end_capture(lib, s)[0])
    assert lib.cudaStreamWaitEvent(other, ev, 0) == lib.cudaErrorInvalidValue
    assert lib.cudaEventQuery(ev) == lib.cudaErrorInvalidValue
    lib.cudaGetLastError()
    ok(lib.cudaEventRecord(ev, other))         # recorded again outside a capture: usable
    ok(lib.cudaStreamWaitEvent(s, ev, 0))
    ok(lib.cudaEventSynchronize(ev))


def test_every_scenario_runs_to_its_end_on_the_simulator(lib):
    # The scenarios not yet recorded on a GPU still have to run, so the next GPU run records them.
    for name in conformance.SCENARIOS:
        sim.reset()
        result = conformance.run_one(name, real=False)
        assert "error" not in result and result["steps"], (name, result)


def test_observation_rows_are_compared_but_never_fail():
    # Rows whose label ends in "?" (and " status" rows) are values the runs saw, not return codes:
    # the comparison lists a difference as "differs", which the first test does not count.
    sim_run = {"s": {"steps": [["cudaMalloc", 0], ["blocks per SM?", 32], ["x status", 1]]}}
    gpu_run = {"s": {"steps": [["cudaMalloc", 0], ["blocks per SM?", 16], ["x status", 2]]}}
    assert conformance.compare(sim_run, gpu_run) == {"s": [["differs", 1, "blocks per SM?", 32, 16],
                                                           ["differs", 2, "x status", 1, 2]]}
    gpu_run["s"]["steps"][0][1] = 2
    assert conformance.compare(sim_run, gpu_run)["s"][0] == ["sim_lenient", 0, "cudaMalloc", 0, 2]


# -- rules the CUDA 13.0 headers state that the simulator had not enforced (found by r29's scenarios) --

def test_entry_point_by_version_newer_than_the_driver_is_an_invalid_value(lib):
    # cuda_runtime_api.h, cudaGetDriverEntryPointByVersion: "If the specified CUDA version is
    # greater than the driver version, the API will return cudaErrorInvalidValue."
    drv = ffi.new("int *")
    ok(lib.cudaDriverGetVersion(drv))
    fp = ffi.new("void **")
    st = ffi.new("enum cudaDriverEntryPointQueryResult *")
    assert lib.cudaGetDriverEntryPointByVersion(b"cuLaunchKernel", fp, drv[0] + 10, 0, st) == lib.cudaErrorInvalidValue
    lib.cudaGetLastError()
    ok(lib.cudaGetDriverEntryPointByVersion(b"cuLaunchKernel", fp, drv[0], 0, st))
    assert fp[0] != ffi.NULL


def test_instantiate_takes_only_its_documented_flags(lib):
    # cuda_runtime_api.h, cudaGraphInstantiate: "Valid flags are: cudaGraphInstantiateFlagAutoFreeOnLaunch,
    # ... DeviceLaunch, ... UseNodePriority" (driver_types.h: Upload is "Only supported by
    # cudaGraphInstantiateWithParams"); a device-launch graph "cannot be empty and must contain at
    # least one kernel, memcpy, or memset node" and may hold only kernel, memcpy, memset and child nodes.
    s = stream(lib)
    d = malloc(lib, 16)
    capture(lib, s)
    ok(lib.cudaMemsetAsync(d, 1, 4, s))
    rc, graph = end_capture(lib, s)
    ok(rc)
    x = ffi.new("cudaGraphExec_t *")
    assert lib.cudaGraphInstantiate(x, graph, lib.cudaGraphInstantiateFlagUpload) == lib.cudaErrorInvalidValue
    lib.cudaGetLastError()
    capture(lib, s)
    rc, empty = end_capture(lib, s)
    ok(rc)
    assert lib.cudaGraphInstantiate(x, empty, lib.cudaGraphInstantiateFlagDeviceLaunch) == lib.cudaErrorInvalidValue
    lib.cudaGetLastError()
    e = event(lib)
    capture(lib, s)
    ok(lib.cudaMemsetAsync(d, 1, 4, s))
    ok(lib.cudaEventRecordWithFlags(e, s, lib.cudaEventRecordExternal))
    rc, with_event = end_capture(lib, s)
    ok(rc)
    assert lib.cudaGraphInstantiate(x, with_event, lib.cudaGraphInstantiateFlagDeviceLaunch) == lib.cudaErrorInvalidValue
    lib.cudaGetLastError()
    ok(lib.cudaGraphInstantiate(x, graph, lib.cudaGraphInstantiateFlagUseNodePriority))
