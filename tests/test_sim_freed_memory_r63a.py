"""Freed and not-yet-made device memory in the simulators (session r63a).

1. Simulated device memory is carved out of a reserved address range (accel/sim/_memory.py, the
   device range): an address in it that no live allocation holds is a freed device address, never
   pageable host memory, so cudaMemcpy / cudaMemcpyAsync naming one is refused
   (cudaErrorInvalidValue) instead of memmoving into freed host memory (r62g's finding).  Genuine
   host memory (numpy arrays, cffi and malloc'd buffers, pinned memory) still copies; freed pages go
   back to the host; OOM still comes at ACCEL_SIM_MEMORY.
2. cudaMallocAsync memory may not be touched by work on a stream not ordered after the allocation
   (CUDA Runtime API, cudaMallocAsync: "The allocation must not be accessed until the allocation
   operation completes"); events, the legacy stream's implicit synchronization and synchronizes
   order it.
3. Level Zero already refuses a copy naming a zeMemFree'd USM pointer (ZE_RESULT_ERROR_INVALID_ARGUMENT:
   it takes no pageable memory at all); checked here on device 1.

Codes (driver_types.h): cudaErrorInvalidValue 1, cudaErrorMemoryAllocation 2, cudaErrorNotReady 600.
"""

import ctypes
import sys

import numpy as np
import pytest

import accel
from accel import sim
from accel._ffi._cudart import ffi
from accel.sim import _memory
from accel.sim.cudart import state as cudart_state
from conftest import run_forked, use_sim
from test_sim_cuda import _gates, gate, malloc, ok, stream

INVALID_VALUE, MEMORY_ALLOCATION, NOT_READY = 1, 2, 600
HOST_TO_HOST, H2D, D2H, DEFAULT = 0, 1, 2, 4            # cudaMemcpyKind
POOL_USED_CURRENT = 7                                   # cudaMemPoolAttrUsedMemCurrent
_gate_ids = iter(range(63_100, 63_200))


@pytest.fixture
def lib(monkeypatch):
    use_sim(monkeypatch, "cuda")
    sim.reset()
    sim.configure(delay_us=1)       # every operation goes through the stream workers
    yield sim.open_library("cudart")
    for g in _gates.values():
        g.set()
    sim.reset()


def _malloc_async(lib, n, s):
    p = ffi.new("void **")
    ok(lib.cudaMallocAsync(p, n, s))
    return p[0]


def _host_read(lib, p, n) -> bytes:
    out = bytearray(n)
    ok(lib.cudaMemcpy(ffi.from_buffer(out), p, n, D2H))
    return bytes(out)


# -- 1. the device range ---------------------------------------------------------------------------

def _freed_copies(device: int) -> int:
    """Forked child (a copy that is not refused writes into freed memory): free one of two
    neighbouring allocations of ``device`` (device 0 current), then copy into, out of and inside it
    every way.  Exit 0: all refused and the neighbour intact; 3: one was accepted."""
    sim.reset()
    lib = sim.open_library("cudart")
    ok(lib.cudaSetDevice(device))
    s = stream(lib)
    p, q = malloc(lib, 4096), malloc(lib, 4096)
    ok(lib.cudaMemset(q, 7, 4096))
    ok(lib.cudaSetDevice(0))
    ok(lib.cudaFree(p))
    host = np.zeros(4096, np.uint8)
    h = ffi.cast("void *", host.ctypes.data)
    inner = ffi.cast("char *", p) + 1024
    calls = [lambda: lib.cudaMemcpy(p, h, 4096, k) for k in (HOST_TO_HOST, DEFAULT)]
    calls += [lambda: lib.cudaMemcpy(h, p, 4096, k) for k in (HOST_TO_HOST, DEFAULT)]
    calls += [lambda: lib.cudaMemcpyAsync(p, h, 4096, k, s) for k in (HOST_TO_HOST, DEFAULT)]
    calls += [lambda: lib.cudaMemcpyAsync(h, inner, 256, k, s) for k in (HOST_TO_HOST, DEFAULT)]
    calls += [lambda: lib.cudaMemcpy(q, p, 4096, DEFAULT), lambda: lib.cudaMemcpy(p, q, 4096, DEFAULT)]
    for call in calls:
        if call() != INVALID_VALUE:
            return 3
        lib.cudaGetLastError()
    ok(lib.cudaStreamSynchronize(s))
    if _host_read(lib, q, 4096) != b"\x07" * 4096 or sim.state().errors:
        return 3
    return 0


@pytest.mark.parametrize("device", [0, 1])
def test_copies_naming_a_freed_device_address_are_refused(monkeypatch, device):
    use_sim(monkeypatch, "cuda")
    assert run_forked(lambda: _freed_copies(device)) == 0


@pytest.mark.parametrize("device", [0, 1])
def test_copies_with_genuine_host_memory_still_work(lib, device):
    ok(lib.cudaSetDevice(device))
    s = stream(lib)
    p = malloc(lib, 4096)
    pinned = ffi.new("void **")
    ok(lib.cudaMallocHost(pinned, 4096))
    ok(lib.cudaSetDevice(0))
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    raw = libc.malloc(4096)
    try:
        src = np.arange(4096, dtype=np.uint32).astype(np.uint8)
        for host in (src.ctypes.data, ffi.from_buffer(src), raw, pinned[0]):
            ctypes.memmove(raw, src.ctypes.data, 4096)
            ctypes.memmove(_memory.addr_of(pinned[0]), src.ctypes.data, 4096)
            for kind in (H2D, DEFAULT):
                # (r69d) on p's own device: a memset by device 0 into device 1's memory without peer
                # access faults (cudaDeviceEnablePeerAccess; accel/sim/README.md)
                # (r72) and with its device current: a memset, unlike a copy, needs it (copies.py)
                ok(lib.cudaSetDevice(device))
                ok(lib.cudaMemsetAsync(p, 0, 4096, s))
                ok(lib.cudaSetDevice(0))
                ok(lib.cudaStreamSynchronize(s))
                ok(lib.cudaMemcpy(p, host, 4096, kind))
                assert _host_read(lib, p, 4096) == src.tobytes()
                ok(lib.cudaMemcpyAsync(p, host, 4096, kind, s))
                ok(lib.cudaStreamSynchronize(s))
            out = np.zeros(4096, np.uint8)
            ok(lib.cudaMemcpy(ffi.cast("void *", out.ctypes.data), p, 4096, DEFAULT))
            assert (out == src).all()
        assert not _memory.in_device_range(src.ctypes.data, 4096)
        assert not _memory.in_device_range(raw, 4096)
        assert not _memory.in_device_range(_memory.addr_of(pinned[0]), 4096)
        assert _memory.in_device_range(_memory.addr_of(p))
    finally:
        libc.free(ctypes.c_void_p(raw))
    ok(lib.cudaFree(p))
    ok(lib.cudaFreeHost(pinned[0]))
    assert sim.state().errors == []


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _freed_pages_go_back() -> int:
    """Forked child: 256 MiB of device 1 touched then freed, once with a live neighbour (the
    range stays committed) and once alone; the resident size comes back each time."""
    sim.reset()
    lib = sim.open_library("cudart")
    ok(lib.cudaSetDevice(1))
    n = 256 << 20
    for neighbour in (True, False):
        keep = malloc(lib, 4096) if neighbour else None
        before = _rss()
        p = malloc(lib, n)
        ok(lib.cudaMemset(p, 0x5A, n))
        if _rss() - before < n // 2:
            return 4        # the measure does not see the pages
        ok(lib.cudaFree(p))
        if _rss() - before > 16 << 20:
            return 3
        if keep is not None:
            ok(lib.cudaFree(keep))
    return 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_freed_device_memory_goes_back_to_the_host(monkeypatch):
    use_sim(monkeypatch, "cuda")
    assert run_forked(_freed_pages_go_back) == 0


def test_oom_still_comes_at_the_simulated_size(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_MEMORY="1G")
    sim.reset()
    lib = sim.open_library("cudart")
    try:
        ok(lib.cudaSetDevice(1))
        free, total = ffi.new("size_t *"), ffi.new("size_t *")
        ok(lib.cudaMemGetInfo(free, total))
        assert total[0] == 1 << 30
        room = free[0] // 256 * 256
        p = ffi.new("void **")
        assert lib.cudaMalloc(p, room + 256) == MEMORY_ALLOCATION
        lib.cudaGetLastError()
        half = room // 2 // 256 * 256
        a, b = malloc(lib, half), malloc(lib, room - half)      # every byte
        assert lib.cudaMalloc(p, 256) == MEMORY_ALLOCATION
        lib.cudaGetLastError()
        ok(lib.cudaFree(a))
        c = malloc(lib, half)
        for x in (b, c):
            ok(lib.cudaFree(x))
        ok(lib.cudaSetDevice(0))
        assert sim.state().live_allocations == {}
    finally:
        sim.reset()


def test_device_range_blocks_are_reused_and_zeroed_when_asked():
    """_memory's device range: a freed block's address is taken again, a zeroed block reads zeros
    even where the last user wrote (Metal's newBufferWithLength: "Creates a buffer the method
    clears with zero values"), and the free ranges are bounded by the live blocks."""
    dirty = [_memory.allocate(300, _memory.DEVICE, 1) for _ in range(64)]
    for a in dirty:
        ctypes.memset(a.base, 0xFF, a.size)
    bases = {a.base for a in dirty[::2]}
    del dirty[::2]
    fresh = [_memory.allocate(300, _memory.DEVICE, 1, zeroed=True) for _ in range(32)]
    assert {a.base for a in fresh} & bases
    big = _memory.allocate(3 << 20, _memory.DEVICE, 1, align=1 << 20, zeroed=True)
    assert big.base % (1 << 20) == 0
    for a in fresh + [big]:
        assert _memory.in_device_range(a.base, a.size)
        assert bytes(_memory.ffi.buffer(_memory.char_ptr(a.base), a.size)) == bytes(a.size)
    del fresh, big, dirty, a
    arena = _memory._arena
    assert sum(len(c.starts) for c in arena.chunks) <= len(arena.chunks) + sum(c.live for c in arena.chunks)


def test_public_api_copies_on_every_simulator(sim_backend):
    """accel's own copies between host arrays and device memory, on device 1 (device 0 current)
    where the backend has two devices: still accepted with device memory in the device range."""
    dev = 1 if accel.device_count() > 1 else 0
    src = np.arange(1 << 16, dtype=np.float32)
    with accel.device_index(dev):
        buf = accel.Buffer(src.nbytes)
        buf.copy_from(src)
        other = accel.Buffer(src.nbytes).copy_from(buf)
        out = other.to_numpy(np.float32)
        buf.copy_from(src[::-1].copy(), non_blocking=True)
        back = buf.to_numpy(np.float32)
    assert accel.current_device_index() == 0
    assert (out == src).all() and (back == src[::-1]).all()
    buf.close()
    other.close()
    with pytest.raises(Exception):
        buf.copy_from(src)


# -- 2. cudaMallocAsync: the allocation point ------------------------------------------------------

def _gated(lib, device, flags=1):
    ok(lib.cudaSetDevice(device))
    s = stream(lib, flags)
    g = gate(lib, s, next(_gate_ids))
    ok(lib.cudaSetDevice(0))
    return s, g


def _pool_used(lib, device):
    pool = ffi.new("cudaMemPool_t *")
    ok(lib.cudaDeviceGetDefaultMemPool(pool, device))
    used = ffi.new("unsigned long long *")
    ok(lib.cudaMemPoolGetAttribute(pool[0], POOL_USED_CURRENT, used))
    return used[0]


@pytest.mark.parametrize("device", [0, 1])
def test_unmade_pool_memory_refused_on_another_stream_state_unchanged(lib, device):
    s, g = _gated(lib, device)
    ok(lib.cudaSetDevice(device))             # (current throughout: memsets need their stream's device)
    other = stream(lib)
    p = _malloc_async(lib, 4096, s)
    q = malloc(lib, 4096)
    used = _pool_used(lib, device)
    host = bytearray(4096)
    refused = [lib.cudaMemsetAsync(p, 1, 4096, other),
               lib.cudaMemcpyAsync(q, p, 4096, DEFAULT, other),
               lib.cudaMemcpyAsync(p, q, 4096, DEFAULT, other),
               lib.cudaMemcpyAsync(ffi.from_buffer(host), p, 4096, D2H, other),
               lib.cudaFreeAsync(p, other)]
    assert refused == [INVALID_VALUE] * 5
    assert lib.cudaGetLastError() == INVALID_VALUE
    assert _pool_used(lib, device) == used
    assert lib.cudaStreamQuery(other) == 0      # nothing was queued
    # the allocating stream itself may use it at once
    ok(lib.cudaMemsetAsync(p, 3, 4096, s))
    g.set()
    ok(lib.cudaStreamSynchronize(s))
    # made: every stream may use it now
    ok(lib.cudaMemcpyAsync(q, p, 4096, DEFAULT, other))
    ok(lib.cudaStreamSynchronize(other))
    assert _host_read(lib, q, 4096) == b"\x03" * 4096
    assert cudart_state.runtime().making == {}
    ok(lib.cudaFreeAsync(p, other))
    ok(lib.cudaStreamSynchronize(other))
    ok(lib.cudaFree(q))
    assert sim.state().live_allocations == {} and sim.state().errors == []


@pytest.mark.parametrize("device", [0, 1])
def test_unmade_pool_memory_ordered_by_events_is_accepted(lib, device):
    """cudaMallocAsync: "CUDA events can be used to guarantee that the allocation operation
    completes before work submitted in a separate stream runs": an event recorded after the
    allocation and waited on, directly or through a third stream, orders the use."""
    s, g = _gated(lib, device)
    ok(lib.cudaSetDevice(device))
    direct, middle, far = stream(lib), stream(lib), stream(lib)
    e1, e2 = ffi.new("cudaEvent_t *"), ffi.new("cudaEvent_t *")
    ok(lib.cudaEventCreateWithFlags(e1, 2))
    ok(lib.cudaEventCreateWithFlags(e2, 2))
    p = _malloc_async(lib, 4096, s)           # (device stays current: memsets need their stream's device)
    ok(lib.cudaEventRecord(e1[0], s))
    ok(lib.cudaStreamWaitEvent(direct, e1[0], 0))
    ok(lib.cudaMemsetAsync(p, 5, 2048, direct))
    ok(lib.cudaStreamWaitEvent(middle, e1[0], 0))
    ok(lib.cudaEventRecord(e2[0], middle))
    ok(lib.cudaStreamWaitEvent(far, e2[0], 0))
    ok(lib.cudaMemsetAsync(ffi.cast("char *", p) + 2048, 6, 2048, far))
    assert lib.cudaStreamQuery(direct) == NOT_READY      # held behind the allocation
    g.set()
    for x in (s, direct, far):
        ok(lib.cudaStreamSynchronize(x))
    ok(lib.cudaSetDevice(device))       # (device 0 has no access to device 1's pool)
    assert _host_read(lib, p, 4096) == b"\x05" * 2048 + b"\x06" * 2048
    ok(lib.cudaSetDevice(0))
    ok(lib.cudaFreeAsync(p, far))
    ok(lib.cudaStreamSynchronize(far))
    for e in (e1, e2):
        ok(lib.cudaEventDestroy(e[0]))
    assert sim.state().live_allocations == {} and sim.state().errors == []


def test_legacy_stream_orders_after_a_blocking_streams_allocation(lib):
    """The legacy default stream waits for the device's blocking streams (implicit
    synchronization): pool memory a blocking stream allocated may be used on it at once; a
    non-blocking stream's is not."""
    null = ffi.cast("cudaStream_t", 0)
    ok(lib.cudaSetDevice(1))
    blocking, g1 = _gated(lib, 1, flags=0)
    ok(lib.cudaSetDevice(1))
    p = _malloc_async(lib, 4096, blocking)
    ok(lib.cudaMemsetAsync(p, 9, 4096, null))
    nonblocking, g2 = _gated(lib, 1, flags=1)
    ok(lib.cudaSetDevice(1))
    q = _malloc_async(lib, 4096, nonblocking)
    assert lib.cudaMemsetAsync(q, 9, 4096, null) == INVALID_VALUE
    lib.cudaGetLastError()
    g1.set()
    g2.set()
    ok(lib.cudaDeviceSynchronize())
    assert _host_read(lib, p, 4096) == b"\x09" * 4096
    ok(lib.cudaMemsetAsync(q, 9, 4096, null))
    for x in (p, q):
        ok(lib.cudaFreeAsync(x, null))
    ok(lib.cudaDeviceSynchronize())
    ok(lib.cudaSetDevice(0))
    assert sim.state().live_allocations == {} and sim.state().errors == []


def test_accel_async_allocator_across_streams_is_accepted(monkeypatch):
    """accel's backend:cudaMallocAsync allocator used across streams of device 1 (device 0
    current) with record_stream: accel orders its uses after the allocation."""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="backend:cudaMallocAsync", ACCEL_SIM_DELAY_US="1")
    src = np.arange(1 << 14, dtype=np.float32)
    with accel.device_index(1):
        side = accel.Stream()
        for _ in range(3):
            with side:
                buf = accel.Buffer(src.nbytes)
                buf.copy_from(src, non_blocking=True)
            accel.current_stream().wait_stream(side)
            out = buf.to_numpy(np.float32)
            buf.record_stream(accel.current_stream())
            buf.close()
            assert (out == src).all()
        accel.synchronize()
    assert sim.state().errors == []


# -- 3. Level Zero: zeMemFree'd USM ----------------------------------------------------------------

def test_ze_copy_naming_freed_usm_is_refused(monkeypatch):
    """ze_api.h, zeMemFree: "The application must ensure the device is not currently referencing
    the memory before it is freed"; the simulator's copies take USM allocations only, so a freed
    device (or host) allocation is ZE_RESULT_ERROR_INVALID_ARGUMENT, never host memory."""
    from accel._ffi._ze import ffi
    from test_sim_ze_metal_strict import Ze
    monkeypatch.setenv("ACCEL_SIM", "xpu")
    sim.reset()
    try:
        z = Ze()
        lib = z.lib
        cl = z.immediate(dev=1)
        desc = ffi.new("ze_host_mem_alloc_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC})
        hp = ffi.new("void **")
        assert lib.zeMemAllocHost(z.ctx, desc, 4096, 0, hp) == 0
        live, freed, freed_host = z.alloc(4096, dev=1), z.alloc(4096, dev=1), ffi.new("void **")
        assert lib.zeMemAllocHost(z.ctx, desc, 4096, 0, freed_host) == 0
        assert lib.zeMemFree(z.ctx, freed) == 0
        assert lib.zeMemFree(z.ctx, freed_host[0]) == 0
        assert _memory.in_device_range(_memory.addr_of(freed))
        bad = lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
        for dst, src in ((freed, hp[0]), (hp[0], freed), (live, freed), (freed, live),
                         (live, freed_host[0]), (freed_host[0], live)):
            assert lib.zeCommandListAppendMemoryCopy(cl, dst, src, 4096, ffi.NULL, 0, ffi.NULL) == bad
        assert z.fill(cl, freed, 4096) == bad
        assert lib.zeCommandListAppendMemoryCopy(cl, live, hp[0], 4096, ffi.NULL, 0, ffi.NULL) == 0
        assert lib.zeCommandListHostSynchronize(cl, (1 << 64) - 1) == 0
        assert lib.zeCommandListDestroy(cl) == 0
        for x in (live, hp[0]):
            assert lib.zeMemFree(z.ctx, x) == 0
    finally:
        sim.reset()
