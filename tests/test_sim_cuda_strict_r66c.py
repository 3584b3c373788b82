"""The simulated CUDA runtime refuses what the CUDA documents forbid (r66c audit).

Each test calls the simulated libcudart directly, as a CUDA program would, and checks one
rule the simulator accepted before r66c:

* the legacy stream beside a capture (CUDA Programming Guide, "CUDA Graphs" > "Prohibited and
  Unhandled Operations": "When any stream in the same context is being captured, and it was not
  created with cudaStreamNonBlocking, any attempted use of the legacy stream is invalid"):
  cudaMallocAsync there, and cudaStreamWaitEvent there when the wait is a no-op (event never
  recorded, or complete), returned cudaSuccess;
* the context of that rule is the stream's device: a blocking stream of device 1 that joined a
  capture begun on device 0 left device 1's legacy stream, cudaStreamIsCapturing(legacy) and
  cudaDeviceSynchronize ("synchronize ... a device ... when any associated stream is in capture
  mode") usable;
* cudaStreamGetCaptureInfo: "If edgeData_out is non-NULL then dependencies_out must be as
  well"; the graph and node array it cannot give (no graph object exists until
  cudaStreamEndCapture) were written as NULL;
* cudaFree of cudaMallocAsync memory whose cudaFreeAsync is still queued (cudaFree: "if
  cudaFree(devPtr) has already been called before, an error is returned") returned cudaSuccess
  and took the bytes off the device twice.
"""

import threading

import pytest

from accel import sim
from accel._ffi._cudart import ffi
from test_sim_cuda import NULL_STREAM, end_capture, event, gate, malloc, ok, stream

GLOBAL, RELAXED = 0, 2                # cudaStreamCaptureMode
BLOCKING, NON_BLOCKING = 0, 1         # cudaStreamDefault / cudaStreamNonBlocking
POOL_USED_CURRENT = 7                 # cudaMemPoolAttrUsedMemCurrent


@pytest.fixture
def lib():
    sim.reset()
    yield sim.open_library("cudart")
    sim.reset()


def relaxed(lib):
    mode = ffi.new("int *", RELAXED)
    ok(lib.cudaThreadExchangeStreamCaptureMode(mode))


def pool_used(lib, device=0):
    pool = ffi.new("cudaMemPool_t *")
    ok(lib.cudaDeviceGetDefaultMemPool(pool, device))
    v = ffi.new("unsigned long long *")
    ok(lib.cudaMemPoolGetAttribute(pool[0], POOL_USED_CURRENT, v))
    return v[0]


def free_bytes(lib):
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    ok(lib.cudaMemGetInfo(free, total))
    return free[0]


# -- the legacy stream beside a blocking capture --------------------------------------------

def test_malloc_async_on_the_legacy_stream_beside_a_blocking_capture_is_refused(lib):
    s = stream(lib, flags=BLOCKING)
    ok(lib.cudaStreamBeginCapture(s, GLOBAL))
    p = ffi.new("void **")
    assert lib.cudaMallocAsync(p, 256, NULL_STREAM) == lib.cudaErrorStreamCaptureImplicit
    assert end_capture(lib, s)[0] == lib.cudaErrorStreamCaptureInvalidated
    assert pool_used(lib) == 0                      # nothing allocated (read after the capture: r68d)
    ok(lib.cudaMallocAsync(p, 256, NULL_STREAM))    # no capture: the legacy stream allocates
    ok(lib.cudaFreeAsync(p[0], NULL_STREAM))
    ok(lib.cudaDeviceSynchronize())


def test_malloc_async_on_the_legacy_stream_beside_a_non_blocking_capture_works(lib):
    s = stream(lib, flags=NON_BLOCKING)             # does not sync with the legacy stream
    ok(lib.cudaStreamBeginCapture(s, GLOBAL))
    p = ffi.new("void **")
    ok(lib.cudaMallocAsync(p, 256, NULL_STREAM))
    ok(lib.cudaFreeAsync(p[0], NULL_STREAM))
    rc, _graph = end_capture(lib, s)
    ok(rc)


@pytest.mark.parametrize("recorded", [False, True], ids=["never_recorded", "complete"])
def test_a_no_op_wait_on_the_legacy_stream_beside_a_blocking_capture_is_refused(lib, recorded):
    s, other = stream(lib, flags=BLOCKING), stream(lib, flags=NON_BLOCKING)
    e = event(lib)
    if recorded:
        ok(lib.cudaEventRecord(e, other))
        ok(lib.cudaStreamSynchronize(other))        # complete: the wait would be a no-op
    ok(lib.cudaStreamBeginCapture(s, RELAXED))
    assert lib.cudaStreamWaitEvent(NULL_STREAM, e, 0) == lib.cudaErrorStreamCaptureImplicit
    assert end_capture(lib, s)[0] == lib.cudaErrorStreamCaptureInvalidated
    ok(lib.cudaStreamWaitEvent(NULL_STREAM, e, 0))  # no capture: a no-op again


# -- the rule is per device: a stream that joined a capture begun elsewhere -----------------

def _join_device_1_blocking_stream(lib):
    """A relaxed capture begun on a non-blocking stream of device 0, joined by a blocking stream
    of device 1 (cudaStreamWaitEvent on an event recorded in the capture); device 0 current.
    Returns (origin, joined stream of device 1)."""
    ok(lib.cudaSetDevice(1))
    s1 = stream(lib, flags=BLOCKING)
    ok(lib.cudaSetDevice(0))
    s0 = stream(lib, flags=NON_BLOCKING)
    e = event(lib)
    ok(lib.cudaStreamBeginCapture(s0, RELAXED))
    ok(lib.cudaEventRecord(e, s0))
    ok(lib.cudaStreamWaitEvent(s1, e, 0))           # s1 (device 1) joins the capture
    return s0, s1


def test_device_1_legacy_stream_is_refused_while_its_blocking_stream_is_in_a_device_0_capture(lib):
    s0, _s1 = _join_device_1_blocking_stream(lib)
    ok(lib.cudaSetDevice(1))
    d1 = malloc(lib, 16)
    status = ffi.new("enum cudaStreamCaptureStatus *")
    assert lib.cudaStreamIsCapturing(NULL_STREAM, status) == lib.cudaErrorStreamCaptureImplicit
    assert lib.cudaMemsetAsync(d1, 0, 16, NULL_STREAM) == lib.cudaErrorStreamCaptureImplicit
    ok(lib.cudaSetDevice(0))
    assert end_capture(lib, s0)[0] == lib.cudaErrorStreamCaptureInvalidated


def test_device_0_legacy_stream_is_not_blocked_by_device_1s_blocking_stream(lib):
    s0, _s1 = _join_device_1_blocking_stream(lib)
    relaxed(lib)                                    # (cudaMalloc during a capture)
    d0 = malloc(lib, 16)
    status = ffi.new("enum cudaStreamCaptureStatus *")
    ok(lib.cudaStreamIsCapturing(NULL_STREAM, status))
    ok(lib.cudaMemsetAsync(d0, 0, 16, NULL_STREAM))  # device 0's legacy stream: no blocking stream captures
    rc, _graph = end_capture(lib, s0)
    ok(rc)


def test_device_synchronize_of_a_device_whose_stream_joined_a_capture_is_refused(lib):
    s0, _s1 = _join_device_1_blocking_stream(lib)
    relaxed(lib)                                    # relaxed mode allows unsafe calls, not this
    ok(lib.cudaSetDevice(1))
    assert lib.cudaDeviceSynchronize() == lib.cudaErrorStreamCaptureUnsupported
    ok(lib.cudaSetDevice(0))
    assert end_capture(lib, s0)[0] == lib.cudaErrorStreamCaptureInvalidated


# -- cudaStreamGetCaptureInfo ------------------------------------------------------------------

def test_capture_info_edge_data_needs_dependencies_and_no_graph_is_made_up(lib):
    s = stream(lib)
    ok(lib.cudaStreamBeginCapture(s, GLOBAL))
    status = ffi.new("enum cudaStreamCaptureStatus *")
    edges = ffi.new("cudaGraphEdgeData **")
    deps = ffi.new("cudaGraphNode_t **")
    graph = ffi.new("cudaGraph_t *")
    n = ffi.new("size_t *")
    N = ffi.NULL
    # "If edgeData_out is non-NULL then dependencies_out must be as well"
    assert lib.cudaStreamGetCaptureInfo(s, status, N, N, N, edges, n) == lib.cudaErrorInvalidValue
    # the graph being captured into and the node array: not simulated, refused (were NULL)
    assert lib.cudaStreamGetCaptureInfo(s, status, N, graph, N, N, N) == lib.cudaErrorNotSupported
    assert lib.cudaStreamGetCaptureInfo(s, status, N, N, deps, N, n) == lib.cudaErrorNotSupported
    ok(lib.cudaStreamGetCaptureInfo(s, status, N, N, N, N, n))     # status and count: as before
    assert status[0] == 1 and n[0] == 0                            # cudaStreamCaptureStatusActive
    rc, _graph = end_capture(lib, s)
    ok(rc)                                          # the refused queries left the capture alone


# -- cudaFree after cudaFreeAsync ----------------------------------------------------------------

def test_cudafree_of_memory_whose_free_async_is_queued_is_a_double_free(lib):
    sim.configure(delay_us=1)                       # work runs on the stream workers
    s = stream(lib)
    p = ffi.new("void **")
    ok(lib.cudaMallocAsync(p, 4096, s))
    ok(lib.cudaStreamSynchronize(s))
    before = free_bytes(lib)
    g = gate(lib, s, 66)                            # holds the free below in the queue
    ok(lib.cudaFreeAsync(p[0], s))
    # (before r66c cudaFree waited for the device, so the gate opens by itself shortly)
    opener = threading.Timer(0.3, g.set)
    opener.start()
    try:
        assert lib.cudaFree(p[0]) == lib.cudaErrorInvalidValue
    finally:
        g.set()
        opener.join()
    ok(lib.cudaDeviceSynchronize())
    assert free_bytes(lib) == before                # the device's count taken once, by the pool
    assert pool_used(lib) == 0


# -- an event wait node on an event last recorded in an ended capture ---------------------------

def test_launch_of_a_wait_node_on_an_event_of_an_ended_capture_is_refused(lib):
    a, b = stream(lib), stream(lib)
    d = malloc(lib, 16)
    e = event(lib)
    ok(lib.cudaStreamBeginCapture(a, GLOBAL))
    ok(lib.cudaEventRecord(e, a))                   # a plain record: a node of graph A
    rc, graph_a = end_capture(lib, a)
    ok(rc)
    ok(lib.cudaStreamBeginCapture(b, GLOBAL))
    ok(lib.cudaStreamWaitEvent(b, e, 1))            # cudaEventWaitExternal: an event wait node
    ok(lib.cudaMemsetAsync(d, 7, 16, b))
    rc, graph_b = end_capture(lib, b)
    ok(rc)
    x = ffi.new("cudaGraphExec_t *")
    ok(lib.cudaGraphInstantiate(x, graph_b, 0))
    # the event stands for a node of graph A: what the wait node would wait for is undocumented
    # (a plain cudaStreamWaitEvent on it is cudaErrorInvalidValue on an H200)
    ok(lib.cudaMemset(d, 0, 16))
    assert lib.cudaGraphLaunch(x[0], b) == lib.cudaErrorInvalidValue
    ok(lib.cudaStreamSynchronize(b))
    assert bytes(ffi.buffer(ffi.cast("char *", d), 16)) == bytes(16)    # nothing was queued
    ok(lib.cudaEventRecord(e, a))                   # recorded on a stream again: the launch waits for it
    ok(lib.cudaGraphLaunch(x[0], b))
    ok(lib.cudaStreamSynchronize(b))
    assert bytes(ffi.buffer(ffi.cast("char *", d), 16)) == b"\x07" * 16
    for g in (graph_a, graph_b):
        ok(lib.cudaGraphDestroy(g))
    ok(lib.cudaGraphExecDestroy(x[0]))
