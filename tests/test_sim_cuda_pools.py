"""The functions bound for issue 14 item 2 and simulated: stream-ordered allocation
(cudaMallocAsync / cudaFreeAsync / cudaMemPool*), cudaFuncGetAttributes, and peer access,
at the simulated library level (accel builds nothing on them yet)."""

import pytest

from accel import sim
from accel._ffi._cudart import ffi

from test_sim_cuda import gate, get_kernel, load, ok, stream

ATTR = {"follow": 1, "opportunistic": 2, "internal": 3, "threshold": 4,
        "reserved": 5, "reserved_high": 6, "used": 7, "used_high": 8}


@pytest.fixture
def lib():
    sim.reset()
    sim.configure(memory="64M")
    yield sim.open_library("cudart")
    sim.reset()


def pool_of(lib, device=0):
    p = ffi.new("cudaMemPool_t *")
    ok(lib.cudaDeviceGetDefaultMemPool(p, device))
    return p[0]


def stat(lib, pool, name):
    v = ffi.new("unsigned long long *")
    ok(lib.cudaMemPoolGetAttribute(pool, ATTR[name], v))
    return v[0]


def free_bytes(lib):
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    ok(lib.cudaMemGetInfo(free, total))
    return free[0]


def test_malloc_async_free_async_and_pool_statistics(lib):
    s = stream(lib)
    pool = pool_of(lib)
    assert pool == pool_of(lib) and pool != pool_of(lib, 1)
    before = free_bytes(lib)
    p = ffi.new("void **")
    ok(lib.cudaMallocAsync(p, 1000, s))
    assert p[0] != ffi.NULL
    page = 2 << 20      # the pool's backing grows in whole pages (test below)
    assert stat(lib, pool, "used") == 1024 and stat(lib, pool, "reserved") == page
    assert free_bytes(lib) == before - page
    ok(lib.cudaFreeAsync(p[0], s))
    ok(lib.cudaStreamSynchronize(s))
    assert stat(lib, pool, "used") == 0 and stat(lib, pool, "used_high") == 1024
    # freed memory stays in the pool (reserved) and is reused without growing it
    assert stat(lib, pool, "reserved") == page
    ok(lib.cudaMallocAsync(p, 512, s))
    assert stat(lib, pool, "reserved") == page and stat(lib, pool, "used") == 512
    ok(lib.cudaFreeAsync(p[0], s))
    ok(lib.cudaStreamSynchronize(s))
    ok(lib.cudaMemPoolTrimTo(pool, 0))
    assert stat(lib, pool, "reserved") == 0 and free_bytes(lib) == before
    # the high watermarks reset to 0 only; the current values are read-only
    zero, one = ffi.new("unsigned long long *", 0), ffi.new("unsigned long long *", 1)
    ok(lib.cudaMemPoolSetAttribute(pool, ATTR["used_high"], zero))
    assert stat(lib, pool, "used_high") == 0
    assert lib.cudaMemPoolSetAttribute(pool, ATTR["used_high"], one) == lib.cudaErrorInvalidValue
    assert lib.cudaMemPoolSetAttribute(pool, ATTR["used"], zero) == lib.cudaErrorInvalidValue
    ok(lib.cudaMemPoolSetAttribute(pool, ATTR["threshold"], one))
    assert stat(lib, pool, "threshold") == 1
    flag = ffi.new("int *")
    ok(lib.cudaMemPoolGetAttribute(pool, ATTR["opportunistic"], flag))
    assert flag[0] == 1
    ok(lib.cudaMemPoolSetAttribute(pool, ATTR["opportunistic"], ffi.new("int *", 0)))
    ok(lib.cudaMemPoolGetAttribute(pool, ATTR["opportunistic"], flag))
    assert flag[0] == 0
    ok(lib.cudaStreamDestroy(s))


def test_free_async_runs_in_stream_order(lib):
    sim.configure(delay_us=1)     # all work through the stream workers (no inline fast path)
    s = stream(lib)
    pool = pool_of(lib)
    p = ffi.new("void **")
    ok(lib.cudaMallocAsync(p, 256, s))
    g = gate(lib, s, 1401)     # the stream is blocked
    ok(lib.cudaFreeAsync(p[0], s))
    assert stat(lib, pool, "used") == 256       # queued behind the gate
    g.set()
    ok(lib.cudaStreamSynchronize(s))
    assert stat(lib, pool, "used") == 0


def test_misuse_is_refused(lib):
    s = stream(lib)
    p = ffi.new("void **")
    assert lib.cudaMallocAsync(p, 0, s) == lib.cudaErrorInvalidValue
    assert lib.cudaMallocAsync(ffi.NULL, 16, s) == lib.cudaErrorInvalidValue
    assert lib.cudaMallocAsync(p, 128 << 20, s) == lib.cudaErrorMemoryAllocation
    ok(lib.cudaMalloc(p, 256))
    assert lib.cudaFreeAsync(p[0], s) == lib.cudaErrorInvalidValue   # not from cudaMallocAsync
    ok(lib.cudaFree(p[0]))
    ok(lib.cudaMallocAsync(p, 256, s))
    ok(lib.cudaFreeAsync(p[0], s))
    assert lib.cudaFreeAsync(p[0], s) == lib.cudaErrorInvalidValue   # freed twice
    assert lib.cudaFreeAsync(ffi.NULL, s) == lib.cudaErrorInvalidValue
    assert lib.cudaDeviceGetDefaultMemPool(ffi.new("cudaMemPool_t *"), 7) == lib.cudaErrorInvalidDevice
    bogus = ffi.cast("cudaMemPool_t", 0x1234)
    assert lib.cudaMemPoolTrimTo(bogus, 0) == lib.cudaErrorInvalidResourceHandle
    ok(lib.cudaStreamSynchronize(s))
    ok(lib.cudaStreamDestroy(s))


def test_while_capturing_graph_memory_not_the_pool(lib):
    """During capture cudaMallocAsync makes an allocation node owned by the graph, not the
    pool (tests/test_sim_cuda_graph_mem.py has the rules); the pool's memory cannot be freed
    into a capture."""
    s = stream(lib)
    pool = pool_of(lib)
    p, q = ffi.new("void **"), ffi.new("void **")
    ok(lib.cudaMallocAsync(q, 256, s))
    ok(lib.cudaStreamBeginCapture(s, 2))     # relaxed
    ok(lib.cudaMallocAsync(p, 256, s))
    assert stat(lib, pool, "used") == 256    # q only
    assert lib.cudaFreeAsync(q[0], s) == lib.cudaErrorInvalidValue
    ok(lib.cudaFreeAsync(p[0], s))
    g = ffi.new("cudaGraph_t *")
    ok(lib.cudaStreamEndCapture(s, g))
    ok(lib.cudaGraphDestroy(g[0]))
    ok(lib.cudaFreeAsync(q[0], s))
    ok(lib.cudaStreamDestroy(s))


def test_function_attributes(lib):
    rc, mod = load(lib, b".visible .entry accel_test_gate(\n .param .u32 gate\n)\n{\n ret;\n}\n")
    ok(rc)
    rc, k = get_kernel(lib, mod, b"accel_test_gate")
    ok(rc)
    fn = ffi.cast("void *", k)
    attr = ffi.new("struct cudaFuncAttributes *")
    ok(lib.cudaFuncGetAttributes(attr, fn))
    assert attr.maxThreadsPerBlock == 1024 and attr.maxDynamicSharedSizeBytes == 48 * 1024
    assert attr.preferredShmemCarveout == -1
    ok(lib.cudaFuncSetAttribute(fn, 8, 100 * 1024))    # cudaFuncAttributeMaxDynamicSharedMemorySize
    ok(lib.cudaFuncSetAttribute(fn, 9, 50))            # cudaFuncAttributePreferredSharedMemoryCarveout
    ok(lib.cudaFuncGetAttributes(attr, fn))
    assert attr.maxDynamicSharedSizeBytes == 100 * 1024 and attr.preferredShmemCarveout == 50
    assert lib.cudaFuncGetAttributes(attr, ffi.cast("void *", 0x999)) == lib.cudaErrorInvalidDeviceFunction
    assert lib.cudaFuncGetAttributes(ffi.NULL, fn) == lib.cudaErrorInvalidValue
    ok(lib.cudaLibraryUnload(mod))


def test_peer_access(lib):
    can = ffi.new("int *")
    ok(lib.cudaDeviceCanAccessPeer(can, 0, 1))
    assert can[0] == 1
    ok(lib.cudaSetDevice(0))
    ok(lib.cudaDeviceEnablePeerAccess(1, 0))
    assert lib.cudaDeviceEnablePeerAccess(1, 0) == lib.cudaErrorPeerAccessAlreadyEnabled
    # itself: cudaErrorPeerAccessUnsupported on an H100 (tests/conformance/cuda_h100_2026-12-05.json,
    # scenario peer_access_one_device)
    assert lib.cudaDeviceEnablePeerAccess(0, 0) == lib.cudaErrorPeerAccessUnsupported
    ok(lib.cudaDeviceDisablePeerAccess(1))
    assert lib.cudaDeviceDisablePeerAccess(1) == lib.cudaErrorPeerAccessNotEnabled


def test_pool_backing_grows_and_trims_in_whole_pages(lib):
    """A pool holds physical memory in pages of the allocation granularity (2 MiB), never
    less: 1000 bytes in use reserve a whole page, freed pages go back whole at
    cudaMemPoolTrimTo, and the page holding live bytes stays.  (The simulator reserved exactly
    the bytes asked for, below the physical floor, before this.)"""
    page = 2 << 20
    s = stream(lib)
    pool = pool_of(lib)
    before = free_bytes(lib)
    small, big = ffi.new("void **"), ffi.new("void **")
    ok(lib.cudaMallocAsync(small, 1000, s))
    assert stat(lib, pool, "used") == 1024 and stat(lib, pool, "reserved") == page
    assert free_bytes(lib) == before - page
    ok(lib.cudaMallocAsync(big, 3 * page, s))      # 1024 bytes of the first page are taken
    assert stat(lib, pool, "reserved") == 4 * page
    ok(lib.cudaFreeAsync(big[0], s))
    ok(lib.cudaStreamSynchronize(s))
    # "the pool will be guaranteed to have at least minBytesToKeep bytes reserved after the
    # operation" (CUDA Runtime API, cudaMemPoolTrimTo): whole pages, rounded up (r67c)
    ok(lib.cudaMemPoolTrimTo(pool, page + 1))
    assert stat(lib, pool, "reserved") == 2 * page and free_bytes(lib) == before - 2 * page
    ok(lib.cudaFreeAsync(small[0], s))
    ok(lib.cudaStreamSynchronize(s))
    ok(lib.cudaMemPoolTrimTo(pool, 0))
    assert stat(lib, pool, "reserved") == 0 and free_bytes(lib) == before
