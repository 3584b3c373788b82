"""The simulated CUDA runtime against NVIDIA's documents (r69d audit: peer access, pool attributes,
stream queries, device reset and memsets across devices), and what accel does under the stricter rules.

Each sim test calls the simulated libcudart directly, as a CUDA program would.  The rules the
simulator broke before r69d:

* cudaDeviceEnablePeerAccess / cudaDeviceDisablePeerAccess inside a stream capture.  The Runtime API
  pages are silent on capture; the calls are not stream operations ("On success, all allocations from
  peerDevice will immediately be accessible by the current device"): they change, at once and for the
  whole context, what every kernel may touch, so no graph can hold them, like cudaMemPoolSetAccess
  and cuMemSetAccess, which the simulator already refuses as potentially unsafe (r68d).  Refused
  alike now: 900, the capture invalidated, the thread's relaxed mode allows them.  Both were
  accepted before.
* The pool reuse attributes (cudaMemPoolSetAttribute: cudaMemPoolReuseFollowEventDependencies,
  ...AllowOpportunistic, ...AllowInternalDependencies, "(value type = int) Allow ... (default
  enabled)") are on/off switches; the page says nothing of other values.  2 or -1 were read as 1;
  refused now (cudaErrorInvalidValue, nothing changed).
* cudaStreamGetPriority / cudaStreamGetFlags / cudaStreamGetDevice with a NULL out-pointer raised a
  Python RuntimeError out of the simulated library instead of returning an error (the pages list
  cudaErrorInvalidValue among the returns); cudaErrorInvalidValue now.
* cudaDeviceReset while a capture is underway ("Explicitly destroys and cleans up all resources
  associated with the current device": it frees memory, as cudaFree, a potentially unsafe call, and
  destroys the capturing streams; Programming Guide, CUDA Graphs, Prohibited and Unhandled
  Operations: it is invalid to "synchronize a broader handle which encompasses an active stream
  capture, such as a device or context handle").  The simulator invalidated the capture and reset the
  device anyway, destroying the capture's origin stream: the capture could never be ended, so every
  later potentially unsafe call (cudaMalloc, ...) in global mode returned 900 for the rest of the
  process.  Refused now as cudaDeviceSynchronize is: 900, the capture invalidated, nothing reset.
* A memset by one device into another device's cudaMalloc memory without peer access.  The Runtime
  API says peer allocations become accessible with cudaDeviceEnablePeerAccess ("all allocations from
  peerDevice will immediately be accessible by the current device") and is silent on memsets into
  them before; kernels already faulted there (cudaErrorIllegalAddress), cudaMemsetAsync /
  cudaMemset did not (the README listed it as still lenient).  Now the memset is queued and faults
  when it runs (700, sticky), as a kernel's store would; with peer access it runs.

The accel tests at the end run accel's own calls on the paths the rules touch.
"""

import threading

import pytest

import accel
from accel import sim
from accel._ffi._cudart import ffi
from conftest import use_sim
from test_sim_cuda import _gates, capture, end_capture, malloc, ok, stream

GLOBAL, THREAD_LOCAL, RELAXED = 0, 1, 2           # cudaStreamCaptureMode
UNSUPPORTED, INVALIDATED = 900, 901               # cudaErrorStreamCaptureUnsupported / Invalidated
INVALID_VALUE, ILLEGAL_ADDRESS = 1, 700
ALREADY_ENABLED, NOT_ENABLED = 704, 705           # cudaErrorPeerAccessAlreadyEnabled / NotEnabled
REUSE_ATTRS = {"cudaMemPoolReuseFollowEventDependencies": 1, "cudaMemPoolReuseAllowOpportunistic": 2,
               "cudaMemPoolReuseAllowInternalDependencies": 3}


@pytest.fixture
def lib():
    sim.reset()
    yield sim.open_library("cudart")
    for g in _gates.values():
        g.set()
    sim.reset()


def exchange_mode(lib, mode):
    m = ffi.new("enum cudaStreamCaptureMode *", mode)
    ok(lib.cudaThreadExchangeStreamCaptureMode(m))
    return m[0]


def pool_of(lib, device=0):
    p = ffi.new("cudaMemPool_t *")
    ok(lib.cudaDeviceGetDefaultMemPool(p, device))
    return p[0]


def read(ptr, n):
    return ffi.buffer(ffi.cast("char *", ptr), n)[:]


# -- peer access inside a capture -------------------------------------------------------------------

def _enable(lib):
    return lib.cudaDeviceEnablePeerAccess(1, 0)


def _disable(lib):
    return lib.cudaDeviceDisablePeerAccess(1)


PEER_CALLS = pytest.mark.parametrize("call", ["enable", "disable"])


def _prepare(lib, call):
    """Peer access 0 -> 1 as the call expects to find it (off to enable, on to disable)."""
    if call == "disable":
        ok(_enable(lib))
    return _enable if call == "enable" else _disable


def _unchanged(lib, call):
    """The refused call changed nothing: enabling again answers as before the call."""
    if call == "enable":
        ok(_enable(lib))                          # was still off (704 if the refused call had enabled it)
    else:
        assert _enable(lib) == ALREADY_ENABLED    # was still on


@PEER_CALLS
@pytest.mark.parametrize("mode", [GLOBAL, THREAD_LOCAL])
def test_peer_access_call_in_a_capture_is_refused_and_invalidates_it(lib, call, mode):
    fn = _prepare(lib, call)
    s = stream(lib)
    d = malloc(lib, 64)
    capture(lib, s, mode)
    ok(lib.cudaMemsetAsync(d, 1, 64, s))
    assert fn(lib) == UNSUPPORTED
    rc, graph = end_capture(lib, s)
    assert rc == INVALIDATED and graph == ffi.NULL
    _unchanged(lib, call)


@PEER_CALLS
def test_peer_access_call_in_relaxed_thread_mode_or_a_relaxed_capture_is_allowed(lib, call):
    fn = _prepare(lib, call)
    s = stream(lib)
    capture(lib, s, GLOBAL)
    old = exchange_mode(lib, RELAXED)
    ok(fn(lib))
    exchange_mode(lib, old)
    rc, graph = end_capture(lib, s)
    ok(rc)
    ok(lib.cudaGraphDestroy(graph))
    fn = _enable if fn is _disable else _disable  # back the other way, in a relaxed capture
    capture(lib, s, RELAXED)
    ok(fn(lib))
    rc, graph = end_capture(lib, s)
    ok(rc)
    ok(lib.cudaGraphDestroy(graph))


@PEER_CALLS
def test_another_threads_capture_refuses_a_peer_access_call_only_when_global(lib, call):
    fn = _prepare(lib, call)
    s = stream(lib)
    for mode, want in ((THREAD_LOCAL, 0), (GLOBAL, UNSUPPORTED)):
        capture(lib, s, mode)
        got = []
        t = threading.Thread(target=lambda: got.append(fn(lib)))
        t.start()
        t.join()
        assert got == [want]
        rc, graph = end_capture(lib, s)
        assert rc == (INVALIDATED if want else 0)
        if not want:
            ok(lib.cudaGraphDestroy(graph))
            fn = _enable if fn is _disable else _disable


# -- pool reuse attributes are on/off ------------------------------------------------------------------

@pytest.mark.parametrize("attr", list(REUSE_ATTRS), ids=list(REUSE_ATTRS))
def test_pool_reuse_attribute_takes_only_0_or_1(lib, attr):
    a = REUSE_ATTRS[attr]
    pool = pool_of(lib)
    got = ffi.new("int *")
    ok(lib.cudaMemPoolSetAttribute(pool, a, ffi.new("int *", 0)))
    for bad in (2, -1, 255):
        assert lib.cudaMemPoolSetAttribute(pool, a, ffi.new("int *", bad)) == INVALID_VALUE
        ok(lib.cudaMemPoolGetAttribute(pool, a, got))
        assert got[0] == 0                        # nothing changed
    ok(lib.cudaMemPoolSetAttribute(pool, a, ffi.new("int *", 1)))
    ok(lib.cudaMemPoolGetAttribute(pool, a, got))
    assert got[0] == 1


# -- stream queries with a NULL out-pointer -------------------------------------------------------------

@pytest.mark.parametrize("call", ["cudaStreamGetPriority", "cudaStreamGetFlags", "cudaStreamGetDevice"])
def test_stream_query_with_a_null_out_pointer_is_invalid_value(lib, call):
    s = stream(lib)
    for handle in (s, ffi.cast("cudaStream_t", 0)):           # a created stream and the legacy stream
        assert getattr(lib, call)(handle, ffi.NULL) == INVALID_VALUE
    out = ffi.new("unsigned int *") if call == "cudaStreamGetFlags" else ffi.new("int *")
    ok(getattr(lib, call)(s, out))


# -- cudaDeviceReset while a capture is underway ----------------------------------------------------

@pytest.mark.parametrize("mode", [GLOBAL, THREAD_LOCAL, RELAXED])
def test_device_reset_during_a_capture_of_the_device_is_refused_and_resets_nothing(lib, mode):
    d = malloc(lib, 64)
    s = stream(lib)
    capture(lib, s, mode)
    ok(lib.cudaMemsetAsync(d, 7, 64, s))
    assert lib.cudaDeviceReset() == UNSUPPORTED
    rc, graph = end_capture(lib, s)               # the origin stream still exists: the capture ends
    assert rc == INVALIDATED and graph == ffi.NULL
    ok(lib.cudaMemsetAsync(d, 5, 64, s))          # the stream and the memory survived
    ok(lib.cudaStreamSynchronize(s))
    assert read(d, 64) == b"\x05" * 64
    ok(lib.cudaMalloc(ffi.new("void **"), 16))    # no capture left behind to refuse unsafe calls
    ok(lib.cudaDeviceReset())                     # and once no capture is underway the reset runs
    assert lib.cudaStreamSynchronize(s) == 400    # (the stream went with it)


def test_device_reset_during_another_threads_global_capture_is_refused(lib):
    ok(lib.cudaSetDevice(1))
    s1 = stream(lib)                              # the capture is on device 1; the reset is of device 0
    capture(lib, s1, GLOBAL)
    got = []
    t = threading.Thread(target=lambda: got.append(lib.cudaDeviceReset()))
    t.start()
    t.join()
    assert got == [UNSUPPORTED]                   # frees memory, as cudaFree: potentially unsafe
    assert end_capture(lib, s1)[0] == INVALIDATED
    capture(lib, s1, THREAD_LOCAL)                # another thread's thread-local capture of another
    t = threading.Thread(target=lambda: got.append(lib.cudaDeviceReset()))   # device: allowed
    t.start()
    t.join()
    assert got[1:] == [0]
    rc, graph = end_capture(lib, s1)
    ok(rc)
    ok(lib.cudaGraphDestroy(graph))


# -- memsets into another device's memory need peer access -------------------------------------------

@pytest.mark.parametrize("sync", [False, True], ids=["cudaMemsetAsync", "cudaMemset"])
def test_memset_into_peer_memory_without_peer_access_faults(lib, sync):
    ok(lib.cudaSetDevice(1))
    d1 = malloc(lib, 64)
    ok(lib.cudaSetDevice(0))
    if sync:
        assert lib.cudaMemset(d1, 3, 64) == ILLEGAL_ADDRESS
    else:
        s = stream(lib)
        ok(lib.cudaMemsetAsync(d1, 3, 64, s))      # queued: it faults when it runs
        assert lib.cudaStreamSynchronize(s) == ILLEGAL_ADDRESS
    assert read(d1, 64) != b"\x03" * 64
    assert lib.cudaGetLastError() == ILLEGAL_ADDRESS          # sticky, as a kernel's fault


def test_memset_into_peer_memory_with_peer_access_runs(lib):
    ok(lib.cudaSetDevice(1))
    d1 = malloc(lib, 64)
    s1 = stream(lib)
    ok(lib.cudaMemsetAsync(d1, 4, 64, s1))        # device 1's own stream: no peer access needed
    ok(lib.cudaStreamSynchronize(s1))
    ok(lib.cudaSetDevice(0))
    s = stream(lib)
    assert read(d1, 64) == b"\x04" * 64
    ok(lib.cudaDeviceEnablePeerAccess(1, 0))
    ok(lib.cudaMemsetAsync(d1, 3, 64, s))
    ok(lib.cudaStreamSynchronize(s))
    assert read(d1, 64) == b"\x03" * 64
    h = ffi.new("void **")
    ok(lib.cudaHostAlloc(h, 64, 0))               # pinned host memory: reachable from every device
    ok(lib.cudaMemsetAsync(h[0], 9, 64, s))
    ok(lib.cudaStreamSynchronize(s))
    assert read(h[0], 64) == b"\x09" * 64
    ok(lib.cudaFreeHost(h[0]))


def test_captured_memset_into_peer_memory_without_access_faults_at_launch(lib):
    ok(lib.cudaSetDevice(1))
    d1 = malloc(lib, 64)
    # cudaMalloc does not clear memory (CUDA Runtime API, cudaMalloc: "The memory is not cleared"), and
    # the simulator hands back freed bytes: zero them so "unchanged" cannot read an earlier test's 3s.
    ok(lib.cudaMemset(d1, 0, 64))
    ok(lib.cudaDeviceSynchronize())
    ok(lib.cudaSetDevice(0))
    s = stream(lib)
    capture(lib, s, GLOBAL)
    ok(lib.cudaMemsetAsync(d1, 3, 64, s))
    rc, graph = end_capture(lib, s)
    ok(rc)
    x = ffi.new("cudaGraphExec_t *")
    ok(lib.cudaGraphInstantiate(x, graph, 0))
    ok(lib.cudaGraphLaunch(x[0], s))
    assert lib.cudaStreamSynchronize(s) == ILLEGAL_ADDRESS
    assert read(d1, 64) == bytes(64)


# -- accel on these paths ---------------------------------------------------------------------------------

@pytest.fixture
def cuda(monkeypatch):
    use_sim(monkeypatch, "cuda")
    yield
    sim.reset()


@pytest.fixture
def async_backend(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="backend:cudaMallocAsync")
    yield
    sim.reset()


def test_accel_async_allocator_sets_the_reuse_attributes_to_1(async_backend):
    # accel's cudaMallocAsync set-up (accel/memory/_async.py) switches every reuse attribute on with
    # the value 1: the 0/1 rule refuses nothing, on either device.
    for d in (0, 1):
        b = accel.Buffer(4096, device=d)
        b.fill_(d + 1)
        assert (b.to_numpy() == d + 1).all()
    assert sim.state().errors == []


@pytest.mark.parametrize("backend", ["cuda", "async_backend"])
def test_accel_fills_another_devices_buffer_on_that_device(request, backend):
    # Buffer.fill_ memsets on a stream of the buffer's device (its _check_stream refuses another
    # device's stream), so the peer-access rule for memsets never applies to accel.
    request.getfixturevalue(backend)
    accel.set_device_index(0)
    buf = accel.Buffer(4096, device=1)
    buf.fill_(7)
    with pytest.raises(ValueError, match="stream is on device 0"):
        buf.fill_(1, accel.Stream(device=0))
    assert (buf.to_numpy() == 7).all()
    s1 = accel.Stream(device=1)
    g = accel.Graph()
    with s1, g:
        buf.fill_(9, s1)
    g.replay()
    s1.synchronize()
    assert (buf.to_numpy() == 9).all()
    assert sim.state().errors == []


def test_accel_stream_queries_pass_their_out_pointers(cuda):
    s = accel.Stream(device=1, priority=-100)      # clamped to the greatest priority
    least, greatest = accel.Stream.priority_range()
    assert s.priority == greatest and (least, greatest) == (0, -5)
    assert accel.Stream(device=1).priority == 0
