"""The simulated CUDA runtime against NVIDIA's documents (r68d audit: stream-ordered pools, graph
memory, peer access), and what accel does under the stricter rules.

Each sim test calls the simulated libcudart directly, as a CUDA program would.  The rules the
simulator broke before r68d:

* Pool calls inside a capture.  The Runtime API pages say nothing; on the hardware
  cudaMemPoolGetAttribute / cudaMemPoolSetAttribute are "potentially unsafe": NVIDIA/cccl PR 11360
  ("Make resolving a default memory pool legal under stream capture"): "while the calling thread
  is inside a global or thread-local stream capture they fail with
  CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidate the capture", while cudaDeviceGetDefaultMemPool
  "is a pure query and is legal under capture".  cudaMemPoolTrimTo, cudaMemPoolSetAccess /
  GetAccess, cudaDeviceGraphMemTrim and cudaDevice{Get,Set}GraphMemAttribute (docs silent; HIP
  refuses the pool ones in a non-relaxed capture) are refused alike: 900, the capture invalidated,
  the thread's relaxed mode allows them.  All were accepted before.
* cudaDeviceReset and peer access (Runtime API, cudaDeviceEnablePeerAccess): peer allocations "will
  remain accessible until access is explicitly disabled using cudaDeviceDisablePeerAccess() or
  either device is reset using cudaDeviceReset()".  Resetting device 0 left device 1's access to
  device 0: its kernels could still touch device 0's memory, and enabling again returned 704.
* cudaFreeAsync racing a use (Runtime API cudaFreeAsync: "The allocation must not be accessed after
  stream execution reaches the free"; Programming Guide, Graph Memory Nodes: "the free operation
  must be ordered after all operations accessing the memory using graph dependencies, CUDA events
  and other stream ordering mechanisms").  A free queued on a stream not ordered after a pending
  copy, memset or kernel of another stream that touches the memory was accepted, and the use
  faulted only if the free happened to run first; it is refused now (1, nothing queued).

The accel tests at the end (backend:cudaMallocAsync) show where accel relied on the first leniency:
its allocator reads and writes pool attributes (memory_stats, memory_allocated, reset_peak_memory_stats,
the allocator's set-up on a device's first use) and grants peers pool access (Buffer.copy_from
across devices) from the capturing thread without switching it to relaxed mode, so on a GPU each of
them failed with 900 and discarded the capture (strict xfails first; the backend now makes its pool
calls in relaxed mode while a capture is underway, CudaMemPoolMixin._pool_call).
"""

import threading

import pytest

import accel
from accel import _lazy, memory, sim
from accel.sim import kernels
from accel._ffi._cudart import ffi
from conftest import use_sim
from test_sim_cuda import _gates, capture, end_capture, event, gate, get_kernel, host_alloc, launch, load, malloc, \
    ok, stream

GLOBAL, THREAD_LOCAL, RELAXED = 0, 1, 2           # cudaStreamCaptureMode
UNSUPPORTED, INVALIDATED = 900, 901               # cudaErrorStreamCaptureUnsupported / Invalidated
INVALID_VALUE, ILLEGAL_ADDRESS = 1, 700
D2H = 2                                            # cudaMemcpyDeviceToHost
RELEASE_THRESHOLD, RESERVED_CURRENT, USED_HIGH = 4, 5, 8   # cudaMemPoolAttr
GRAPH_USED_CURRENT, GRAPH_USED_HIGH = 0, 1         # cudaGraphMemAttributeType
LOCATION_DEVICE, ACCESS_READ_WRITE = 1, 3          # cudaMemLocationTypeDevice / cudaMemAccessFlagsProtReadWrite


@pytest.fixture
def lib():
    sim.reset()
    yield sim.open_library("cudart")
    for g in _gates.values():
        g.set()
    sim.reset()


@pytest.fixture
def async_lib(lib):
    sim.configure(delay_us=1)     # all work through the stream workers (no inline fast path)
    return lib


def pool_of(lib, device=0):
    p = ffi.new("cudaMemPool_t *")
    ok(lib.cudaDeviceGetDefaultMemPool(p, device))
    return p[0]


def exchange_mode(lib, mode):
    m = ffi.new("enum cudaStreamCaptureMode *", mode)
    ok(lib.cudaThreadExchangeStreamCaptureMode(m))
    return m[0]


# -- the calls: each returns its rc; none may change anything when refused ----------------------

def _get_attr(lib):
    return lib.cudaMemPoolGetAttribute(pool_of(lib), RESERVED_CURRENT, ffi.new("unsigned long long *"))


def _set_attr(lib):
    return lib.cudaMemPoolSetAttribute(pool_of(lib), RELEASE_THRESHOLD, ffi.new("unsigned long long *", 1 << 20))


def _trim(lib):
    return lib.cudaMemPoolTrimTo(pool_of(lib), 0)


def _set_access(lib):
    desc = ffi.new("struct cudaMemAccessDesc *")
    desc.location.type, desc.location.id, desc.flags = LOCATION_DEVICE, 1, ACCESS_READ_WRITE
    return lib.cudaMemPoolSetAccess(pool_of(lib), desc, 1)


def _get_access(lib):
    loc = ffi.new("struct cudaMemLocation *")
    loc.type, loc.id = LOCATION_DEVICE, 1
    return lib.cudaMemPoolGetAccess(ffi.new("enum cudaMemAccessFlags *"), pool_of(lib), loc)


def _graph_trim(lib):
    return lib.cudaDeviceGraphMemTrim(0)


def _graph_get_attr(lib):
    return lib.cudaDeviceGetGraphMemAttribute(0, GRAPH_USED_CURRENT, ffi.new("unsigned long long *"))


def _graph_set_attr(lib):
    return lib.cudaDeviceSetGraphMemAttribute(0, GRAPH_USED_HIGH, ffi.new("unsigned long long *", 0))


POOL_CALLS = {"cudaMemPoolGetAttribute": _get_attr, "cudaMemPoolSetAttribute": _set_attr,
              "cudaMemPoolTrimTo": _trim, "cudaMemPoolSetAccess": _set_access, "cudaMemPoolGetAccess": _get_access,
              "cudaDeviceGraphMemTrim": _graph_trim, "cudaDeviceGetGraphMemAttribute": _graph_get_attr,
              "cudaDeviceSetGraphMemAttribute": _graph_set_attr}
CALLS = pytest.mark.parametrize("call", list(POOL_CALLS), ids=list(POOL_CALLS))


# -- pool and graph-memory calls inside a capture ---------------------------------------------------

@CALLS
def test_pool_call_in_a_global_capture_is_refused_and_invalidates_it(lib, call):
    pool_of(lib)                                  # (the default pool's lookup is legal anyway)
    s = stream(lib)
    d = malloc(lib, 64)
    capture(lib, s, GLOBAL)
    ok(lib.cudaMemsetAsync(d, 1, 64, s))
    assert POOL_CALLS[call](lib) == UNSUPPORTED
    rc, graph = end_capture(lib, s)
    assert rc == INVALIDATED and graph == ffi.NULL
    ok(POOL_CALLS[call](lib))                     # allowed once no capture is underway


@CALLS
def test_pool_call_in_a_thread_local_capture_is_refused(lib, call):
    s = stream(lib)
    capture(lib, s, THREAD_LOCAL)
    assert POOL_CALLS[call](lib) == UNSUPPORTED
    assert end_capture(lib, s)[0] == INVALIDATED


@CALLS
def test_pool_call_in_relaxed_thread_mode_or_a_relaxed_capture_is_allowed(lib, call):
    s = stream(lib)
    d = malloc(lib, 64)
    capture(lib, s, GLOBAL)
    ok(lib.cudaMemsetAsync(d, 1, 64, s))
    old = exchange_mode(lib, RELAXED)             # what cccl's __relaxed_capture_scope does
    ok(POOL_CALLS[call](lib))
    exchange_mode(lib, old)
    rc, graph = end_capture(lib, s)
    ok(rc)
    ok(lib.cudaGraphDestroy(graph))
    capture(lib, s, RELAXED)                      # a relaxed capture prohibits nothing
    ok(POOL_CALLS[call](lib))
    rc, graph = end_capture(lib, s)
    ok(rc)
    ok(lib.cudaGraphDestroy(graph))


@pytest.mark.parametrize("call", ["cudaMemPoolGetAttribute", "cudaMemPoolTrimTo", "cudaDeviceGraphMemTrim"])
def test_another_threads_global_capture_refuses_a_global_thread_and_a_thread_local_one_does_not(lib, call):
    for mode, want in ((GLOBAL, UNSUPPORTED), (THREAD_LOCAL, 0)):
        s = stream(lib)
        capture(lib, s, mode)
        got = []
        t = threading.Thread(target=lambda: got.append(POOL_CALLS[call](lib)))
        t.start()
        t.join()
        assert got == [want]
        rc, graph = end_capture(lib, s)
        assert rc == (INVALIDATED if want else 0)
        if not want:
            ok(lib.cudaGraphDestroy(graph))


def test_a_refused_pool_call_changes_nothing(lib):
    s = stream(lib)
    p = ffi.new("void **")
    ok(lib.cudaMallocAsync(p, 4096, s))
    ok(lib.cudaFreeAsync(p[0], s))
    ok(lib.cudaStreamSynchronize(s))
    reserved = ffi.new("unsigned long long *")
    ok(lib.cudaMemPoolGetAttribute(pool_of(lib), RESERVED_CURRENT, reserved))
    assert reserved[0] > 0
    capture(lib, s, GLOBAL)
    assert _trim(lib) == UNSUPPORTED
    assert _set_access(lib) == UNSUPPORTED
    end_capture(lib, s)
    after = ffi.new("unsigned long long *")
    ok(lib.cudaMemPoolGetAttribute(pool_of(lib), RESERVED_CURRENT, after))
    assert after[0] == reserved[0]                # nothing trimmed
    flags = ffi.new("enum cudaMemAccessFlags *")
    loc = ffi.new("struct cudaMemLocation *")
    loc.type, loc.id = LOCATION_DEVICE, 1
    ok(lib.cudaMemPoolGetAccess(flags, pool_of(lib), loc))
    assert flags[0] == 0                          # no access granted


def test_default_pool_lookup_stays_legal_in_a_capture(lib):
    s = stream(lib)
    capture(lib, s, GLOBAL)
    p = ffi.new("cudaMemPool_t *")
    ok(lib.cudaDeviceGetDefaultMemPool(p, 0))     # cccl PR 11360: "a pure query ... legal under capture"
    rc, graph = end_capture(lib, s)
    ok(rc)
    ok(lib.cudaGraphDestroy(graph))


# -- cudaDeviceReset ends peer access in both directions --------------------------------------------

def _fill_kernel(lib):
    rc, mod = load(lib, kernels.TEST_PTX)
    ok(rc)
    rc, k = get_kernel(lib, mod, b"accel_test_fill_u32")
    ok(rc)
    return k


def test_reset_of_the_peer_device_ends_access_to_it(lib):
    ok(lib.cudaSetDevice(1))
    ok(lib.cudaDeviceEnablePeerAccess(0, 0))      # device 1 may touch device 0's memory
    ok(lib.cudaSetDevice(0))
    ok(lib.cudaDeviceReset())                     # "or either device is reset"
    d0 = malloc(lib, 16)
    ok(lib.cudaSetDevice(1))
    assert lib.cudaDeviceDisablePeerAccess(0) == lib.cudaErrorPeerAccessNotEnabled
    ok(lib.cudaDeviceEnablePeerAccess(0, 0))      # enabling again is no longer "already enabled"
    k = _fill_kernel(lib)
    ok(launch(lib, k, [("ptr", d0), ("u64", 4), ("u32", 9)], ffi.cast("cudaStream_t", 0)))
    ok(lib.cudaDeviceSynchronize())
    assert kernels.read(d0, 4) == (9).to_bytes(4, "little")


def test_after_the_peer_reset_a_kernel_touching_its_memory_faults(lib):
    ok(lib.cudaSetDevice(1))
    ok(lib.cudaDeviceEnablePeerAccess(0, 0))
    k = _fill_kernel(lib)
    ok(lib.cudaSetDevice(0))
    ok(lib.cudaDeviceReset())
    d0 = malloc(lib, 16)
    ok(lib.cudaSetDevice(1))
    ok(launch(lib, k, [("ptr", d0), ("u64", 4), ("u32", 9)], ffi.cast("cudaStream_t", 0)))
    assert lib.cudaDeviceSynchronize() == ILLEGAL_ADDRESS
    assert "without peer access" in sim.state().errors[0][1]


def test_reset_of_the_accessing_device_ends_its_own_access(lib):
    ok(lib.cudaDeviceEnablePeerAccess(1, 0))      # device 0 -> device 1
    ok(lib.cudaDeviceReset())
    assert lib.cudaDeviceDisablePeerAccess(1) == lib.cudaErrorPeerAccessNotEnabled


# -- cudaFreeAsync must be ordered after the memory's pending uses -----------------------------------

def _made(lib, s, n=4096):
    p = ffi.new("void **")
    ok(lib.cudaMallocAsync(p, n, s))
    ok(lib.cudaStreamSynchronize(s))
    return p[0]


@pytest.mark.parametrize("use", ["copy", "memset", "kernel_interior_pointer"])
def test_free_not_ordered_after_a_pending_use_on_another_stream_is_refused(async_lib, use):
    lib = async_lib
    a, b = stream(lib), stream(lib)
    p = _made(lib, a)
    g = gate(lib, b, 6811)                        # b is held: its use stays pending
    if use == "copy":
        ok(lib.cudaMemcpyAsync(host_alloc(lib, 4096), p, 4096, D2H, b))
    elif use == "memset":
        ok(lib.cudaMemsetAsync(p, 3, 4096, b))
    else:
        inside = ffi.cast("char *", p) + 64       # an interior pointer names the allocation too
        ok(launch(lib, _fill_kernel(lib), [("ptr", inside), ("u64", 4), ("u32", 5)], b))
    assert lib.cudaFreeAsync(p, a) == INVALID_VALUE          # it could be reached before the use
    used = ffi.new("unsigned long long *")
    ok(lib.cudaMemPoolGetAttribute(pool_of(lib), 7, used))
    assert used[0] == 4096                                    # nothing queued: still allocated
    done = event(lib, flags=2)
    ok(lib.cudaEventRecord(done, b))
    ok(lib.cudaStreamWaitEvent(a, done, 0))                   # the Programming Guide's pattern
    ok(lib.cudaFreeAsync(p, a))
    g.set()
    ok(lib.cudaDeviceSynchronize())
    assert sim.state().errors == []


def test_free_on_the_using_stream_or_after_the_use_ran_is_allowed(async_lib):
    lib = async_lib
    a, b = stream(lib), stream(lib)
    p = _made(lib, a)
    g = gate(lib, b, 6812)
    ok(lib.cudaMemsetAsync(p, 3, 4096, b))
    ok(lib.cudaFreeAsync(p, b))                               # in order on the same stream
    q = _made(lib, a)
    ok(lib.cudaMemsetAsync(q, 3, 4096, b))
    g.set()
    ok(lib.cudaStreamSynchronize(b))
    ok(lib.cudaFreeAsync(q, a))                               # the use has run
    ok(lib.cudaDeviceSynchronize())
    assert sim.state().errors == []


def test_free_after_a_use_on_another_devices_stream_needs_its_event(async_lib):
    lib = async_lib
    a = stream(lib)
    p = _made(lib, a)
    ok(_set_access(lib))                          # device 1 may read device 0's pool memory
    ok(lib.cudaSetDevice(1))
    b1 = stream(lib)
    g = gate(lib, b1, 6813)
    ok(lib.cudaMemcpyAsync(host_alloc(lib, 4096), p, 4096, D2H, b1))   # device 1 copies out of it
    done = event(lib, flags=2)
    ok(lib.cudaEventRecord(done, b1))
    ok(lib.cudaSetDevice(0))
    assert lib.cudaFreeAsync(p, a) == INVALID_VALUE
    ok(lib.cudaStreamWaitEvent(a, done, 0))
    ok(lib.cudaFreeAsync(p, a))
    g.set()
    ok(lib.cudaDeviceSynchronize())
    ok(lib.cudaSetDevice(1))
    ok(lib.cudaDeviceSynchronize())
    assert sim.state().errors == []


# -- accel (backend:cudaMallocAsync) under these rules ----------------------------------------------

@pytest.fixture
def async_backend(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="backend:cudaMallocAsync")
    be = _lazy.lazy_init()
    yield be
    sim.reset()


def _capture_around(body, mode="default", device=0):
    """Capture a fill of a buffer on ``device`` with ``body()`` run inside the capture, replay it,
    and return whether the replay filled the buffer."""
    s = accel.Stream(device=device)
    buf = accel.Buffer(4096, device=device, stream=s)
    buf.fill_(0, s)
    s.synchronize()
    g = accel.Graph(capture_error_mode=mode)
    with s, g:
        buf.fill_(3, s)
        body()
    g.replay()
    s.synchronize()
    return bool((buf.to_numpy() == 3).all())


def test_relaxed_capture_lets_accel_read_pool_stats(async_backend):
    assert _capture_around(lambda: memory.memory_stats(0), mode="relaxed")


def test_memory_stats_inside_a_capture_keeps_the_capture(async_backend):
    assert _capture_around(lambda: memory.memory_stats(0))


def test_memory_allocated_inside_a_capture_keeps_the_capture(async_backend):
    assert _capture_around(lambda: memory.memory_allocated(0))


def test_reset_peak_memory_stats_inside_a_capture_keeps_the_capture(async_backend):
    assert _capture_around(lambda: memory.reset_peak_memory_stats(0))


def test_first_use_of_another_devices_allocator_inside_a_capture_keeps_the_capture(async_backend):
    kept = []
    assert _capture_around(lambda: kept.append(accel.Buffer(4096, device=1)))
    accel.synchronize(1)


def test_copy_from_another_devices_pool_inside_a_capture_keeps_the_capture(async_backend):
    src = accel.Buffer(4096, device=1)
    src.fill_(3)
    accel.synchronize(1)
    s = accel.Stream(device=0)
    dst = accel.Buffer(4096, device=0, stream=s)
    dst.fill_(0, s)
    s.synchronize()
    g = accel.Graph()
    with s, g:
        dst.copy_from(src, s, non_blocking=True)
    g.replay()
    s.synchronize()
    assert (dst.to_numpy() == 3).all()


def test_accel_frees_pool_memory_after_its_uses_on_other_streams(async_backend):
    # accel notes a buffer's uses on other streams (copy_from) and orders its cudaFreeAsync after
    # them: the r68d race rule refuses nothing here, on one device or across two.
    sim.configure(delay_us=2000)
    s1, s2 = accel.Stream(), accel.Stream()
    a = accel.Buffer(1 << 14, stream=s1)
    a.fill_(1, s1)
    b = accel.Buffer(1 << 14, stream=s2)
    s1.synchronize()
    b.copy_from(a, s2, non_blocking=True)
    a.close()                                     # freed on s1 while s2's copy may be pending
    c = accel.Buffer(1 << 14, device=1)
    c.fill_(2)
    accel.synchronize(1)
    d = accel.Buffer(1 << 14, device=0, stream=s1)
    d.copy_from(c, s1, non_blocking=True)
    c.close()                                     # device 1's memory, used by device 0's stream
    accel.synchronize(0)
    accel.synchronize(1)
    assert (b.to_numpy() == 1).all() and (d.to_numpy() == 2).all()
    assert sim.state().errors == []
