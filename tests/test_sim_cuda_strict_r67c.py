"""The simulated CUDA runtime and driver against NVIDIA's documents (r67c audit: virtual memory,
stream-ordered pools, events and streams across devices).

Each test calls the simulated libcudart (and the driver functions cudaGetDriverEntryPointByVersion
hands out) directly, as a CUDA program would.  The rules the simulator broke before r67c:

* cuMemAddressReserve (CUDA Driver API, Virtual Memory Management): "The size and address
  parameters must be a multiple of the host page size"; the address hint was ignored whatever it
  was, so a hint off the host page was accepted;
* cudaMemPoolTrimTo (CUDA Runtime API, Stream Ordered Memory Allocator): minBytesToKeep -- "If the
  pool has less than minBytesToKeep reserved, the TrimTo operation is a no-op.  Otherwise the pool
  will be guaranteed to have at least minBytesToKeep bytes reserved after the operation"; the
  simulator trimmed to the whole pages *below* the bound, leaving less reserved than asked;
* cudaStreamDestroy (CUDA Runtime API): "In case the device is still doing work in the stream
  stream when cudaStreamDestroy() is called, the function will return immediately and the
  resources associated with stream will be released automatically once the device has completed
  all work in stream"; with "Stream synchronization behavior" (the legacy default stream
  "synchronizes with all other streams in the same CUcontext except for non-blocking streams"),
  work already queued on a destroyed blocking stream is still work the legacy stream waits for.
  The simulator dropped the stream from the device's blocking streams at the destroy, so the
  legacy stream overtook that work (a copy on it read stale memory, its query said idle).

The rest checks behaviour the documents allow and the simulator already had, in the areas audited
(the stricter rules there have their tests in test_vmm.py, test_sim_cuda_pools.py,
test_sim_cuda.py and test_sim_cuda_strict.py).
"""

import mmap
import threading

import pytest

from accel import sim
from accel._ffi._cudart import ffi
from accel.sim import _vmm
from test_sim_cuda import NULL_STREAM, _gates, event, gate, host_alloc, malloc, ok, stream
from test_vmm import D, G, INVALID_VALUE, SUCCESS, Driver

PAGE = mmap.PAGESIZE                  # the host page size
BLOCKING, NON_BLOCKING = 0, 1         # cudaStreamDefault / cudaStreamNonBlocking
D2H = 2                               # cudaMemcpyDeviceToHost
POOL = {"reserved": 5, "used": 7}     # cudaMemPoolAttrReservedMemCurrent / UsedMemCurrent


@pytest.fixture
def lib():
    sim.reset()
    yield sim.open_library("cudart")
    for g in _gates.values():
        g.set()
    sim.reset()


@pytest.fixture
def drv(lib):
    if not _vmm.supported():
        pytest.skip("this host cannot play virtual memory (mmap)")
    return Driver()


def pool_of(lib, device=0):
    p = ffi.new("cudaMemPool_t *")
    ok(lib.cudaDeviceGetDefaultMemPool(p, device))
    return p[0]


def pool_stat(lib, pool, name):
    v = ffi.new("unsigned long long *")
    ok(lib.cudaMemPoolGetAttribute(pool, POOL[name], v))
    return v[0]


def free_bytes(lib, device=0):
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    cur = ffi.new("int *")
    ok(lib.cudaGetDevice(cur))
    ok(lib.cudaSetDevice(device))
    ok(lib.cudaMemGetInfo(free, total))
    ok(lib.cudaSetDevice(cur[0]))
    return free[0]


# -- virtual memory: cuMemAddressReserve's address --------------------------------------------

@pytest.mark.parametrize("hint", [1, PAGE // 2, 64 * G + 8], ids=["byte", "half_page", "granule_plus_8"])
def test_reserve_refuses_an_address_hint_off_the_host_page(drv, hint):
    p = D.new("CUdeviceptr_v2 *")
    assert drv.cuMemAddressReserve(p, G, 0, hint, 0) == INVALID_VALUE
    assert sim.state().vmm_reservations == 0          # nothing reserved


def test_reserve_takes_a_page_aligned_address_as_a_hint(drv):
    # "If addr is 0, then the driver chooses the address ...; when it is non-zero then the driver
    # treats it as a hint": a page-aligned hint is accepted, wherever the range ends up.
    p = D.new("CUdeviceptr_v2 *")
    assert drv.cuMemAddressReserve(p, 2 * G, 0, 0x7F0000000000, 0) == SUCCESS
    assert p[0] % G == 0
    assert drv.cuMemAddressFree(p[0], 2 * G) == SUCCESS
    assert drv.cuMemAddressReserve(p, 2 * G, 4 * G, PAGE, 0) == SUCCESS    # with an alignment
    assert p[0] % (4 * G) == 0
    assert drv.cuMemAddressFree(p[0], 2 * G) == SUCCESS


# -- stream-ordered pools: cudaMemPoolTrimTo keeps at least minBytesToKeep ---------------------

def _pool_with_free_pages(lib, pages):
    """Device 0's pool holding ``pages`` granules, none of them in use."""
    s = stream(lib)
    p = ffi.new("void **")
    ok(lib.cudaMallocAsync(p, pages * G, s))
    ok(lib.cudaFreeAsync(p[0], s))
    ok(lib.cudaStreamSynchronize(s))
    ok(lib.cudaStreamDestroy(s))
    pool = pool_of(lib)
    assert pool_stat(lib, pool, "reserved") == pages * G and pool_stat(lib, pool, "used") == 0
    return pool


@pytest.mark.parametrize("keep", [G + 1, 3 * G - 1, 3 * G // 2], ids=["page_plus_1", "three_pages_less_1",
                                                                       "page_and_a_half"])
def test_trim_keeps_at_least_min_bytes_to_keep(lib, keep):
    before = free_bytes(lib)
    pool = _pool_with_free_pages(lib, 4)
    ok(lib.cudaMemPoolTrimTo(pool, keep))
    reserved = pool_stat(lib, pool, "reserved")
    assert reserved >= keep                           # the documented guarantee
    # the simulator's pool holds whole pages: the fewest that keep the bound
    assert reserved == -(-keep // G) * G
    assert free_bytes(lib) == before - reserved       # what was trimmed went back to the device
    ok(lib.cudaMemPoolTrimTo(pool, 0))
    assert pool_stat(lib, pool, "reserved") == 0 and free_bytes(lib) == before


def test_trim_to_more_than_is_reserved_is_a_no_op(lib):
    pool = _pool_with_free_pages(lib, 2)
    ok(lib.cudaMemPoolTrimTo(pool, 5 * G))            # "less than minBytesToKeep reserved": no-op
    assert pool_stat(lib, pool, "reserved") == 2 * G
    ok(lib.cudaMemPoolTrimTo(pool, 2 * G))            # exactly what is reserved: all of it kept
    assert pool_stat(lib, pool, "reserved") == 2 * G


def test_trim_never_releases_memory_in_use(lib):
    s = stream(lib)
    p = ffi.new("void **")
    ok(lib.cudaMallocAsync(p, G + 4096, s))           # two pages backing live bytes
    pool = pool_of(lib)
    ok(lib.cudaMemPoolTrimTo(pool, 0))
    assert pool_stat(lib, pool, "reserved") == 2 * G  # "cannot release ... outstanding allocations"
    ok(lib.cudaFreeAsync(p[0], s))
    ok(lib.cudaStreamSynchronize(s))
    ok(lib.cudaMemPoolTrimTo(pool, 0))
    assert pool_stat(lib, pool, "reserved") == 0


# -- stream-ordered pools across devices (allowed; checked for the record) -------------------

def test_malloc_async_takes_the_pool_of_the_streams_device_and_frees_on_another_devices_stream(lib):
    # cudaMallocAsync: the memory comes from the pool of the stream's device, whatever device is
    # current; cudaFreeAsync names no device rule, only stream order (it is ordered by an event).
    ok(lib.cudaSetDevice(1))
    s1 = stream(lib)
    ok(lib.cudaSetDevice(0))
    s0 = stream(lib)
    p = ffi.new("void **")
    ok(lib.cudaMallocAsync(p, 4096, s1))              # device 0 current, device 1's stream
    assert pool_stat(lib, pool_of(lib, 1), "used") == 4096
    assert pool_stat(lib, pool_of(lib, 0), "used") == 0
    made = event(lib, flags=2)                        # device 0's event cannot be recorded on s1
    assert lib.cudaEventRecord(made, s1) == lib.cudaErrorInvalidResourceHandle
    ok(lib.cudaSetDevice(1))
    made = event(lib, flags=2)
    ok(lib.cudaEventRecord(made, s1))
    ok(lib.cudaSetDevice(0))
    ok(lib.cudaStreamWaitEvent(s0, made, 0))          # device 0's stream waits for device 1's event
    ok(lib.cudaFreeAsync(p[0], s0))                   # freed on device 0's stream, in order
    ok(lib.cudaStreamSynchronize(s0))
    assert pool_stat(lib, pool_of(lib, 1), "used") == 0


# -- streams: a destroyed stream's queued work is still the legacy stream's to wait for --------

@pytest.fixture
def async_lib(lib):
    sim.configure(delay_us=1)     # all work through the stream workers (no inline fast path)
    return lib


def test_legacy_stream_waits_for_the_queued_work_of_a_destroyed_blocking_stream(async_lib):
    lib = async_lib
    d = malloc(lib, 64)
    ok(lib.cudaMemset(d, 0, 64))
    s = stream(lib, flags=BLOCKING)
    g = gate(lib, s, 6701)                            # s is held
    ok(lib.cudaMemsetAsync(d, 7, 64, s))
    ok(lib.cudaStreamDestroy(s))                      # returns at once; the work stays queued
    assert lib.cudaStreamQuery(NULL_STREAM) == lib.cudaErrorNotReady
    out = host_alloc(lib, 64)                         # pinned: the copy does not block the host
    ok(lib.cudaMemcpyAsync(out, d, 64, D2H, NULL_STREAM))   # ordered after the memset
    assert lib.cudaStreamQuery(NULL_STREAM) == lib.cudaErrorNotReady
    g.set()
    ok(lib.cudaStreamSynchronize(NULL_STREAM))
    assert bytes(ffi.buffer(ffi.cast("char *", out), 64)) == b"\x07" * 64
    ok(lib.cudaDeviceSynchronize())


def test_legacy_stream_synchronize_waits_for_a_destroyed_blocking_stream(async_lib):
    lib = async_lib
    d = malloc(lib, 64)
    ok(lib.cudaMemset(d, 0, 64))
    s = stream(lib, flags=BLOCKING)
    g = gate(lib, s, 6702)
    ok(lib.cudaMemsetAsync(d, 9, 64, s))
    ok(lib.cudaStreamDestroy(s))
    waiter = ffi.new("unsigned char[64]")
    done = threading.Event()

    def sync():
        ok(lib.cudaStreamSynchronize(NULL_STREAM))
        done.set()
    t = threading.Thread(target=sync)
    t.start()
    assert not done.wait(0.2)                         # still held by the destroyed stream's work
    g.set()
    t.join(30)
    assert done.is_set()
    ok(lib.cudaMemcpy(waiter, d, 64, D2H))
    assert bytes(waiter) == b"\x09" * 64


def test_a_destroyed_non_blocking_stream_does_not_hold_the_legacy_stream(async_lib):
    lib = async_lib
    s = stream(lib, flags=NON_BLOCKING)
    g = gate(lib, s, 6703)
    ok(lib.cudaStreamDestroy(s))
    ok(lib.cudaStreamQuery(NULL_STREAM))              # non-blocking streams never did
    g.set()
    ok(lib.cudaDeviceSynchronize())


def test_destroyed_blocking_streams_leave_the_device_once_their_work_ran(async_lib):
    from accel.sim import cudart
    lib = async_lib
    R = cudart.runtime() or (lib.cudaGetDeviceCount(ffi.new("int *")), cudart.runtime())[1]
    blocking = len(R.devices[0].blocking)
    s = stream(lib, flags=BLOCKING)
    g = gate(lib, s, 6704)
    ok(lib.cudaStreamDestroy(s))
    assert len(R.devices[0].blocking) == blocking + 1    # its work still holds the legacy stream
    g.set()
    ok(lib.cudaDeviceSynchronize())
    assert len(R.devices[0].blocking) == blocking        # drained: forgotten
    idle = stream(lib, flags=BLOCKING)
    ok(lib.cudaStreamDestroy(idle))                      # nothing queued: forgotten at once
    assert len(R.devices[0].blocking) == blocking


# -- events across devices (allowed and refused; checked for the record) ----------------------

def test_events_across_devices(async_lib):
    lib = async_lib
    e0 = event(lib)                                   # device 0's
    ok(lib.cudaSetDevice(1))
    s1 = stream(lib)
    # Programming Guide, "Multi-Device System" > Stream and Event Behavior: "cudaEventRecord() will
    # fail if the input event and input stream are associated to different devices" -- the legacy
    # stream of the current device (1) included
    assert lib.cudaEventRecord(e0, s1) == lib.cudaErrorInvalidResourceHandle
    assert lib.cudaEventRecord(e0, NULL_STREAM) == lib.cudaErrorInvalidResourceHandle
    # "cudaEventQuery() or cudaEventSynchronize() will succeed even if the input event is
    # associated to a device that is different from the current device"; never recorded: success
    # (cudaEventRecord: "Before the first call ... an event represents an empty set of work")
    ok(lib.cudaEventQuery(e0))
    ok(lib.cudaEventSynchronize(e0))
    # "cudaStreamWaitEvent() will succeed even if the input stream and input event are associated
    # to different devices"; and it orders: s1's work waits for device 0's
    ok(lib.cudaSetDevice(0))
    s0 = stream(lib)
    g = gate(lib, s0, 6705)
    ok(lib.cudaEventRecord(e0, s0))
    ok(lib.cudaStreamWaitEvent(s1, e0, 0))
    ok(lib.cudaSetDevice(1))
    e1 = event(lib)
    ok(lib.cudaEventRecord(e1, s1))
    assert lib.cudaEventQuery(e1) == lib.cudaErrorNotReady   # behind device 0's gate
    ms = ffi.new("float *")
    # "cudaEventElapsedTime() will fail if the two input events are associated to different devices"
    g.set()
    ok(lib.cudaEventSynchronize(e1))
    assert lib.cudaEventElapsedTime(ms, e0, e1) == lib.cudaErrorInvalidResourceHandle
    untimed = event(lib, flags=2)                     # cudaEventDisableTiming
    ok(lib.cudaEventRecord(untimed, s1))
    ok(lib.cudaEventSynchronize(untimed))
    assert lib.cudaEventElapsedTime(ms, e1, untimed) == lib.cudaErrorInvalidResourceHandle
    ok(lib.cudaSetDevice(0))
