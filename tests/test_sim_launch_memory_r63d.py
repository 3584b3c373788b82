"""Kernel launches on stream-ordered memory, and freed pinned host memory (session r63d).

1. A kernel (cudaLaunchKernel, the driver's cuLaunchKernel, a kernel node of a graph launch) on
   cudaMallocAsync memory:
   a. memory a cudaFreeAsync freed before the launch was queued (the free still queued on another
      stream, or already run): cudaFreeAsync, "After this API returns, accessing the memory from
      any subsequent work launched on the GPU ... results in undefined behavior"; a device touching
      memory that is no longer its allocation faults (cudaErrorIllegalAddress 700, sticky), so the
      kernel faults when it touches it, whichever stream it runs on.
   b. memory whose allocation point the launch's stream is not ordered after: cudaMallocAsync,
      "The allocation must not be accessed until the allocation operation completes"; no code is
      documented for it, so the launch is refused (cudaErrorInvalidValue, CUDA_ERROR_INVALID_VALUE
      from cuLaunchKernel), nothing queued.  The allocating stream, a stream ordered by an event,
      and any stream once the point ran still launch.
2. Pinned host memory (cudaHostAlloc / cudaMallocHost; Level Zero zeMemAllocHost) is carved out of a
   reserved address range of its own (accel/sim/_memory.py, the pinned range), so a copy naming a
   cudaFreeHost'd pointer is refused (cudaErrorInvalidValue) instead of being taken for pageable
   host memory (a real cudaFreeHost unmaps it); numpy arrays and malloc'd memory still copy, and
   the freed pages go back to the host.

Codes (driver_types.h): cudaErrorInvalidValue 1, cudaErrorIllegalAddress 700.
"""

import ctypes
import sys

import numpy as np
import pytest

import accel
from accel import sim
from accel._ffi._cudart import ffi
from accel.sim import _memory, kernels
from accel.sim.cudart import state as cudart_state
from conftest import run_forked, use_sim
from test_sim_cuda import _gates, gate, get_kernel, launch, load, malloc, ok, stream

INVALID_VALUE, ILLEGAL_ADDRESS, NOT_READY = 1, 700, 600
HOST_TO_HOST, H2D, D2H, D2D, DEFAULT = 0, 1, 2, 3, 4            # cudaMemcpyKind
RELAXED = 2                                                     # cudaStreamCaptureModeRelaxed
POOL_USED_CURRENT = 7                                           # cudaMemPoolAttrUsedMemCurrent
_gate_ids = iter(range(63_400, 63_500))


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


def _fill_kernel(lib):
    rc, mod = load(lib, kernels.TEST_PTX)
    ok(rc)
    rc, k = get_kernel(lib, mod, b"accel_test_fill_u32")
    ok(rc)
    return k


def _fill(lib, k, p, s, n=1024, value=7):
    return launch(lib, k, [("ptr", ffi.cast("void *", p)), ("u64", n), ("u32", value)], s)


def _host_read(lib, p, n) -> bytes:
    out = bytearray(n)
    ok(lib.cudaMemcpy(ffi.from_buffer(out), p, n, D2H))
    return bytes(out)


def _pool_used(lib, device):
    pool = ffi.new("cudaMemPool_t *")
    ok(lib.cudaDeviceGetDefaultMemPool(pool, device))
    used = ffi.new("unsigned long long *")
    ok(lib.cudaMemPoolGetAttribute(pool[0], POOL_USED_CURRENT, used))
    return used[0]


def _graph_of_fill(lib, k, p, n=1024, value=9):
    """An executable graph of one kernel node filling ``p`` (captured on a stream of the current
    device, relaxed mode)."""
    c = stream(lib)
    ok(lib.cudaStreamBeginCapture(c, RELAXED))
    ok(_fill(lib, k, p, c, n, value))
    g = ffi.new("cudaGraph_t *")
    ok(lib.cudaStreamEndCapture(c, g))
    x = ffi.new("cudaGraphExec_t *")
    ok(lib.cudaGraphInstantiate(x, g[0], 0))
    return x[0]


# -- 1a. memory freed before the launch ------------------------------------------------------------

@pytest.mark.parametrize("device", [0, 1])
def test_kernel_on_memory_whose_free_is_queued_elsewhere_faults(lib, device):
    """The free waits behind a gate on stream s; a kernel launched afterwards on another stream
    would run first and write into the memory: it faults (700) instead."""
    ok(lib.cudaSetDevice(device))
    s, other = stream(lib), stream(lib)
    g = gate(lib, s, next(_gate_ids))
    k = _fill_kernel(lib)
    p = _malloc_async(lib, 4096, other)
    ok(lib.cudaStreamSynchronize(other))
    ok(lib.cudaFreeAsync(p, s))
    assert _fill(lib, k, p, other) == 0       # the device faults when the kernel runs
    # the fault is sticky and asynchronous: a call made after it may report it already
    assert lib.cudaSetDevice(0) in (0, ILLEGAL_ADDRESS)
    assert lib.cudaStreamSynchronize(other) == ILLEGAL_ADDRESS
    assert lib.cudaGetLastError() == ILLEGAL_ADDRESS        # sticky
    assert "touched" in sim.state().errors[0][1]
    g.set()


@pytest.mark.parametrize("device", [0, 1])
def test_kernel_on_memory_whose_free_ran_faults(lib, device):
    ok(lib.cudaSetDevice(device))
    other = stream(lib)
    k = _fill_kernel(lib)
    p = _malloc_async(lib, 4096, other)
    ok(lib.cudaFreeAsync(p, other))
    ok(lib.cudaStreamSynchronize(other))
    assert _fill(lib, k, p, other) == 0
    # the fault is sticky and asynchronous: a call made after it may report it already
    assert lib.cudaSetDevice(0) in (0, ILLEGAL_ADDRESS)
    assert lib.cudaStreamSynchronize(other) == ILLEGAL_ADDRESS


@pytest.mark.parametrize("device", [0, 1])
def test_graph_kernel_node_on_memory_freed_before_the_launch_faults(lib, device):
    ok(lib.cudaSetDevice(device))
    s, other = stream(lib), stream(lib)
    k = _fill_kernel(lib)
    p = _malloc_async(lib, 4096, other)
    ok(lib.cudaStreamSynchronize(other))
    x = _graph_of_fill(lib, k, p)
    ok(lib.cudaGraphLaunch(x, other))          # before the free: fine
    ok(lib.cudaStreamSynchronize(other))
    assert _host_read(lib, p, 8) == b"\x09\x00\x00\x00" * 2
    g = gate(lib, s, next(_gate_ids))
    ok(lib.cudaFreeAsync(p, s))
    assert lib.cudaGraphLaunch(x, other) == 0
    # the fault is sticky and asynchronous: a call made after it may report it already
    assert lib.cudaSetDevice(0) in (0, ILLEGAL_ADDRESS)
    assert lib.cudaStreamSynchronize(other) == ILLEGAL_ADDRESS
    g.set()


def test_kernel_launched_before_the_free_still_runs(lib):
    """Work queued before the cudaFreeAsync may use the memory ("subsequent work" is what it
    forbids): a kernel launched on another stream, then the free ordered after it by an event."""
    ok(lib.cudaSetDevice(1))
    s, other = stream(lib), stream(lib)
    k = _fill_kernel(lib)
    p = _malloc_async(lib, 4096, other)
    ok(lib.cudaStreamSynchronize(other))
    g = gate(lib, other, next(_gate_ids))
    ok(_fill(lib, k, p, other, value=5))
    e = ffi.new("cudaEvent_t *")
    ok(lib.cudaEventCreateWithFlags(e, 2))
    ok(lib.cudaEventRecord(e[0], other))
    ok(lib.cudaStreamWaitEvent(s, e[0], 0))
    ok(lib.cudaFreeAsync(p, s))
    ok(lib.cudaSetDevice(0))
    g.set()
    ok(lib.cudaStreamSynchronize(s))
    ok(lib.cudaEventDestroy(e[0]))
    assert sim.state().errors == [] and sim.state().live_allocations == {}


# -- 1b. memory not made yet on the launch's stream --------------------------------------------

@pytest.mark.parametrize("device", [0, 1])
def test_kernel_on_unmade_memory_is_refused_at_launch(lib, device):
    from test_vmm import D, Driver
    ok(lib.cudaSetDevice(device))
    s, other, third = stream(lib), stream(lib), stream(lib)
    g = gate(lib, s, next(_gate_ids))
    k = _fill_kernel(lib)
    p = _malloc_async(lib, 4096, s)
    used = _pool_used(lib, device)
    assert _fill(lib, k, p, other) == INVALID_VALUE
    assert lib.cudaGetLastError() == INVALID_VALUE
    inner = _memory.addr_of(p) + 256
    assert launch(lib, k, [("ptr", ffi.cast("void *", inner)), ("u64", 4), ("u32", 1)], other) == INVALID_VALUE
    assert lib.cudaGetLastError() == INVALID_VALUE
    # the driver's cuLaunchKernel, through its entry point, on a module of this device's context
    drv = Driver()
    mod, fn = D.new("CUmodule *"), D.new("CUfunction *")
    assert drv.cuModuleLoadData(mod, D.from_buffer(bytearray(kernels.TEST_PTX + b"\0"))) == 0
    assert drv.cuModuleGetFunction(fn, mod[0], b"accel_test_fill_u32") == 0
    vals = [D.new("uint64_t *", _memory.addr_of(p)), D.new("uint64_t *", 1024), D.new("uint32_t *", 3)]
    argv = D.new("void *[]", [D.cast("void *", v) for v in vals])
    assert drv.cuLaunchKernel(fn[0], 1, 1, 1, 32, 1, 1, 0, D.cast("CUstream", int(ffi.cast("uintptr_t", other))),
                              argv, D.NULL) == 1                     # CUDA_ERROR_INVALID_VALUE
    assert lib.cudaStreamQuery(other) == 0                            # nothing was queued
    assert _pool_used(lib, device) == used
    assert lib.cudaGetLastError() == 0     # (the driver call sets no runtime error)
    # the allocating stream, and a stream ordered by an event recorded after the allocation
    ok(_fill(lib, k, p, s, value=3))
    e = ffi.new("cudaEvent_t *")
    ok(lib.cudaEventCreateWithFlags(e, 2))
    ok(lib.cudaEventRecord(e[0], s))
    ok(lib.cudaStreamWaitEvent(third, e[0], 0))
    ok(_fill(lib, k, ffi.cast("char *", p) + 2048, third, n=512, value=4))
    assert drv.cuLaunchKernel(fn[0], 1, 1, 1, 32, 1, 1, 0, D.cast("CUstream", int(ffi.cast("uintptr_t", third))),
                              argv, D.NULL) == 0
    assert lib.cudaStreamQuery(third) == NOT_READY
    ok(lib.cudaSetDevice(0))
    g.set()
    ok(lib.cudaStreamSynchronize(third))
    ok(lib.cudaSetDevice(device))
    assert _host_read(lib, p, 4096) == b"\x03\x00\x00\x00" * 1024
    # made: any stream launches on it
    ok(_fill(lib, k, p, other, value=6))
    ok(lib.cudaStreamSynchronize(other))
    assert _host_read(lib, p, 8) == b"\x06\x00\x00\x00" * 2
    assert cudart_state.runtime().making == {}
    ok(lib.cudaFreeAsync(p, other))
    ok(lib.cudaStreamSynchronize(other))
    assert drv.cuModuleUnload(mod[0]) == 0
    ok(lib.cudaEventDestroy(e[0]))
    ok(lib.cudaSetDevice(0))
    assert sim.state().errors == [] and sim.state().live_allocations == {}


@pytest.mark.parametrize("device", [0, 1])
def test_graph_kernel_node_on_unmade_memory_is_refused_at_launch(lib, device):
    ok(lib.cudaSetDevice(device))
    s, other = stream(lib), stream(lib)
    g = gate(lib, s, next(_gate_ids))
    k = _fill_kernel(lib)
    p = _malloc_async(lib, 4096, s)
    x = _graph_of_fill(lib, k, p)              # captured work is not checked: its order is the launch's
    assert lib.cudaGraphLaunch(x, other) == INVALID_VALUE
    assert lib.cudaGetLastError() == INVALID_VALUE
    assert lib.cudaStreamQuery(other) == 0
    ok(lib.cudaGraphLaunch(x, s))              # the allocating stream
    ok(lib.cudaSetDevice(0))
    g.set()
    ok(lib.cudaStreamSynchronize(s))
    ok(lib.cudaSetDevice(device))
    ok(lib.cudaGraphLaunch(x, other))          # made
    ok(lib.cudaStreamSynchronize(other))
    assert _host_read(lib, p, 8) == b"\x09\x00\x00\x00" * 2
    ok(lib.cudaGraphExecDestroy(x))
    ok(lib.cudaFreeAsync(p, other))
    ok(lib.cudaStreamSynchronize(other))
    ok(lib.cudaSetDevice(0))
    assert sim.state().errors == [] and sim.state().live_allocations == {}


@pytest.mark.parametrize("device", [0, 1])
def test_graph_copy_and_memset_nodes_on_freed_or_unmade_memory_are_refused(lib, device):
    """Captured copies and memsets were not checked (their order is the launch's); at the launch
    they are, as cudaMemcpyAsync / cudaMemsetAsync are outside a graph: cudaErrorInvalidValue,
    nothing queued."""
    ok(lib.cudaSetDevice(device))
    s, other, c = stream(lib), stream(lib), stream(lib)
    q = malloc(lib, 4096)
    p = _malloc_async(lib, 4096, other)
    ok(lib.cudaStreamSynchronize(other))
    execs = []
    for capture in (lambda: lib.cudaMemsetAsync(p, 4, 4096, c),
                    lambda: lib.cudaMemcpyAsync(q, p, 4096, DEFAULT, c),
                    lambda: lib.cudaMemcpyAsync(p, q, 4096, DEFAULT, c)):
        ok(lib.cudaStreamBeginCapture(c, RELAXED))
        ok(capture())
        g, x = ffi.new("cudaGraph_t *"), ffi.new("cudaGraphExec_t *")
        ok(lib.cudaStreamEndCapture(c, g))
        ok(lib.cudaGraphInstantiate(x, g[0], 0))
        ok(lib.cudaGraphLaunch(x[0], other))           # live and made: runs
        execs.append(x[0])
    ok(lib.cudaStreamSynchronize(other))
    gt = gate(lib, s, next(_gate_ids))
    ok(lib.cudaFreeAsync(p, s))                         # queued behind the gate
    for x in execs:
        assert lib.cudaGraphLaunch(x, other) == INVALID_VALUE
    assert lib.cudaStreamQuery(other) == 0
    p2 = _malloc_async(lib, 4096, s)                    # not made on `other` (s is still gated)
    execs2 = []
    for capture in (lambda: lib.cudaMemsetAsync(p2, 4, 4096, c),
                    lambda: lib.cudaMemcpyAsync(q, p2, 4096, DEFAULT, c)):
        ok(lib.cudaStreamBeginCapture(c, RELAXED))
        ok(capture())
        g, x = ffi.new("cudaGraph_t *"), ffi.new("cudaGraphExec_t *")
        ok(lib.cudaStreamEndCapture(c, g))
        ok(lib.cudaGraphInstantiate(x, g[0], 0))
        assert lib.cudaGraphLaunch(x[0], other) == INVALID_VALUE
        ok(lib.cudaGraphLaunch(x[0], s))               # the allocating stream may
        execs2.append(x[0])
    assert lib.cudaGetLastError() == INVALID_VALUE
    ok(lib.cudaSetDevice(0))
    gt.set()
    ok(lib.cudaStreamSynchronize(s))
    ok(lib.cudaSetDevice(device))
    for x in execs + execs2:
        ok(lib.cudaGraphExecDestroy(x))
    ok(lib.cudaFreeAsync(p2, s))
    ok(lib.cudaStreamSynchronize(s))
    ok(lib.cudaFree(q))
    ok(lib.cudaSetDevice(0))
    assert sim.state().errors == [] and sim.state().live_allocations == {}


def test_accel_async_allocator_kernels_across_streams(monkeypatch):
    """accel's backend:cudaMallocAsync allocator: memory allocated on a side stream of device 1
    (device 0 current) and filled by random kernels on the current stream after wait_stream, then
    by a graph replay: accel orders its kernels after the allocation, so nothing is refused."""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="backend:cudaMallocAsync", ACCEL_SIM_DELAY_US="1")
    import accel.random
    with accel.device_index(1):
        side = accel.Stream()
        for _ in range(3):
            with side:
                buf = accel.Buffer(1 << 14)
            accel.current_stream().wait_stream(side)
            accel.random.manual_seed(3)
            accel.random.uniform_(buf)
            buf.record_stream(accel.current_stream())
            first = buf.to_numpy(np.float32)
            buf.close()
            assert ((first >= 0) & (first < 1)).all()
        accel.synchronize()
    assert accel.current_device_index() == 0
    assert sim.state().errors == []


# -- 2. pinned host memory ---------------------------------------------------------------------------

def _freed_pinned_copies(device: int) -> int:
    """Forked child (a copy that is not refused writes into unmapped memory): free one of two
    neighbouring pinned allocations, then copy into, out of and inside it every way, with device
    memory of ``device`` (device 0 current).  Exit 0: all refused and the neighbour intact; 3: one
    was accepted."""
    sim.reset()
    lib = sim.open_library("cudart")
    ok(lib.cudaSetDevice(device))
    s = stream(lib)
    d = malloc(lib, 4096)
    ok(lib.cudaSetDevice(0))
    hp, hq = ffi.new("void **"), ffi.new("void **")
    ok(lib.cudaHostAlloc(hp, 4096, 0))
    ok(lib.cudaMallocHost(hq, 4096))
    p, q = hp[0], hq[0]
    ctypes.memset(_memory.addr_of(q), 7, 4096)
    ok(lib.cudaFreeHost(p))
    if not _memory.in_pinned_range(_memory.addr_of(p)) or _memory.in_device_range(_memory.addr_of(p)):
        return 4
    host = np.zeros(4096, np.uint8)
    h = ffi.cast("void *", host.ctypes.data)
    inner = ffi.cast("char *", p) + 1024
    calls = [lambda: lib.cudaMemcpy(p, h, 4096, k) for k in (HOST_TO_HOST, DEFAULT)]
    calls += [lambda: lib.cudaMemcpy(h, p, 4096, k) for k in (HOST_TO_HOST, DEFAULT)]
    calls += [lambda: lib.cudaMemcpy(d, p, 4096, k) for k in (H2D, DEFAULT)]
    calls += [lambda: lib.cudaMemcpy(p, d, 4096, k) for k in (D2H, DEFAULT)]
    calls += [lambda: lib.cudaMemcpyAsync(p, d, 4096, k, s) for k in (D2H, DEFAULT)]
    calls += [lambda: lib.cudaMemcpyAsync(d, inner, 256, k, s) for k in (H2D, DEFAULT)]
    calls += [lambda: lib.cudaMemcpy(q, p, 4096, DEFAULT), lambda: lib.cudaMemcpy(p, q, 4096, DEFAULT)]
    for call in calls:
        if call() != INVALID_VALUE:
            return 3
        lib.cudaGetLastError()
    ok(lib.cudaStreamSynchronize(s))
    if ffi.buffer(ffi.cast("char *", q), 4096)[:] != b"\x07" * 4096 or sim.state().errors:
        return 5
    return 0


@pytest.mark.parametrize("device", [0, 1])
def test_copies_naming_freed_pinned_memory_are_refused(monkeypatch, device):
    use_sim(monkeypatch, "cuda")
    assert run_forked(lambda: _freed_pinned_copies(device)) == 0


def test_pinned_memory_lives_in_its_own_range_and_copies(lib):
    """Pinned memory is host memory in the pinned range (not the device range); pageable memory
    (numpy, malloc) is in neither and still copies; a freed pinned block's address is handed out
    again, as the host heap would."""
    ok(lib.cudaSetDevice(1))
    s = stream(lib)
    d = malloc(lib, 4096)
    ok(lib.cudaSetDevice(0))
    hp = ffi.new("void **")
    ok(lib.cudaHostAlloc(hp, 4096, 0))
    a = _memory.addr_of(hp[0])
    assert a % 256 == 0 and _memory.in_pinned_range(a, 4096) and not _memory.in_device_range(a, 4096)
    src = np.arange(4096, dtype=np.uint32).astype(np.uint8)
    assert not _memory.in_pinned_range(src.ctypes.data, 4096)
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    raw = libc.malloc(4096)
    try:
        assert not _memory.in_pinned_range(raw, 4096)
        ctypes.memmove(a, src.ctypes.data, 4096)
        ok(lib.cudaMemcpyAsync(d, hp[0], 4096, H2D, s))
        ok(lib.cudaMemcpyAsync(ffi.cast("void *", raw), d, 4096, DEFAULT, s))
        ok(lib.cudaStreamSynchronize(s))
        assert ctypes.string_at(raw, 4096) == src.tobytes()
        out = np.zeros(4096, np.uint8)
        ok(lib.cudaMemcpy(ffi.cast("void *", out.ctypes.data), hp[0], 4096, HOST_TO_HOST))
        assert (out == src).all()
    finally:
        libc.free(ctypes.c_void_p(raw))
    ok(lib.cudaFreeHost(hp[0]))
    ok(lib.cudaHostAlloc(hp, 4096, 0))
    assert _memory.addr_of(hp[0]) == a
    ok(lib.cudaFreeHost(hp[0]))
    ok(lib.cudaFree(d))
    assert sim.state().errors == [] and sim.state().live_allocations == {}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _freed_pinned_pages_go_back() -> int:
    sim.reset()
    lib = sim.open_library("cudart")
    ok(lib.cudaSetDevice(1))
    n = 256 << 20
    hp, keep = ffi.new("void **"), ffi.new("void **")
    for neighbour in (True, False):
        if neighbour:
            ok(lib.cudaMallocHost(keep, 4096))
        before = _rss()
        ok(lib.cudaHostAlloc(hp, n, 0))
        ctypes.memset(_memory.addr_of(hp[0]), 0x5A, n)
        if _rss() - before < n // 2:
            return 4        # the measure does not see the pages
        ok(lib.cudaFreeHost(hp[0]))
        if _rss() - before > 16 << 20:
            return 3
        if neighbour:
            ok(lib.cudaFreeHost(keep[0]))
    return 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_freed_pinned_memory_goes_back_to_the_host(monkeypatch):
    use_sim(monkeypatch, "cuda")
    assert run_forked(_freed_pinned_pages_go_back) == 0


def test_ze_host_usm_is_in_the_pinned_range_and_freed_is_refused(monkeypatch):
    """Level Zero's zeMemAllocHost memory comes from the pinned range too; its copies take USM
    only (ze_api.h, zeMemFree: "The application must ensure the device is not currently
    referencing the memory before it is freed"), so a zeMemFree'd host pointer is refused."""
    from accel._ffi._ze import ffi as zffi
    from test_sim_ze_metal_strict import Ze
    monkeypatch.setenv("ACCEL_SIM", "xpu")
    sim.reset()
    try:
        z = Ze()
        zl = z.lib
        cl = z.immediate(dev=1)
        desc = zffi.new("ze_host_mem_alloc_desc_t *", {"stype": zl.ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC})
        hp = zffi.new("void **")
        assert zl.zeMemAllocHost(z.ctx, desc, 4096, 0, hp) == 0
        assert _memory.in_pinned_range(_memory.addr_of(hp[0]), 4096)
        live = z.alloc(4096, dev=1)
        assert zl.zeMemFree(z.ctx, hp[0]) == 0
        bad = zl.ZE_RESULT_ERROR_INVALID_ARGUMENT
        for dst, src in ((live, hp[0]), (hp[0], live)):
            assert zl.zeCommandListAppendMemoryCopy(cl, dst, src, 4096, zffi.NULL, 0, zffi.NULL) == bad
        assert zl.zeCommandListDestroy(cl) == 0
        assert zl.zeMemFree(z.ctx, live) == 0
    finally:
        sim.reset()


def test_public_pinned_memory_on_every_simulator(sim_backend):
    """accel.empty_pinned arrays copy to and from device 1 (device 0 current) asynchronously on
    every simulator; CUDA's and Level Zero's are in the pinned range."""
    dev = 1 if accel.device_count() > 1 else 0
    h = accel.empty_pinned(1 << 14, np.float32)
    h[:] = np.arange(1 << 14, dtype=np.float32)
    if sim_backend != "mps":    # (Metal's pinned memory is a shared-storage MTLBuffer: device memory the host reads)
        assert not _memory.in_device_range(h.ctypes.data, h.nbytes)
        assert _memory.in_pinned_range(h.ctypes.data, h.nbytes)
    with accel.device_index(dev):
        buf = accel.Buffer(h.nbytes)
        buf.copy_from(h, non_blocking=True)
        out = accel.empty_pinned(1 << 14, np.float32)
        buf.copy_to(out, non_blocking=True)
        accel.synchronize()
    assert accel.current_device_index() == 0
    assert (out == h).all()
    buf.close()
    del h, out
    assert sim.state().errors == []
