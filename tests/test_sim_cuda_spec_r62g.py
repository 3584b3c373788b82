"""Calls the simulated CUDA runtime accepts that the CUDA Runtime API reference forbids or leaves
undefined (session r62g), beyond the 136 H100 scenarios (tests/conformance) and the earlier strict
audits.  Each finding quotes the rule; the library is driven as a CUDA program drives it (cdata
out-pointers, integer codes), on device 1 as well as device 0.  Each was a strict xfail first; five
are enforced since r62 (graph launches ordered across streams, work and pointer queries after
cudaFreeAsync refused, cudaFree of pool memory returns it to the pool, cudaHostAlloc flag 0x8
refused), the last two since r63a (accel/sim/README.md): pool memory used on another stream before
cudaMallocAsync's stream reached the allocation is refused, and a cudaFree'd device address is no
longer taken for pageable host memory by copies (device memory is carved out of a reserved address
range, accel/sim/_memory.py).  More cases: tests/test_sim_freed_memory_r63a.py.

Codes (driver_types.h): cudaErrorInvalidValue 1, cudaErrorNotReady 600.
"""

import time

import pytest

from accel import sim
from accel._ffi._cudart import ffi
from conftest import run_forked, use_sim
from test_sim_cuda import _gates, gate, malloc, ok, stream

INVALID_VALUE, NOT_READY = 1, 600
HOST_TO_HOST, DEFAULT = 0, 4                    # cudaMemcpyKind
MEMORY_TYPE_DEVICE = 2                          # cudaMemoryTypeDevice
POOL_USED_CURRENT = 7                           # cudaMemPoolAttrUsedMemCurrent
_gate_ids = iter(range(62_700, 62_800))


@pytest.fixture
def lib(monkeypatch):
    use_sim(monkeypatch, "cuda")
    sim.reset()
    sim.configure(delay_us=1)       # every operation goes through the stream workers
    yield sim.open_library("cudart")
    for g in _gates.values():
        g.set()
    sim.reset()


def _finished_within(lib, s, seconds: float = 0.5) -> bool:
    """Whether stream ``s`` drains within ``seconds`` (never asserts a duration: a stream that must
    stay blocked is polled for a while, one that runs ahead of its order shows up at once)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rc = lib.cudaStreamQuery(s)
        if rc != NOT_READY:
            return rc == 0
        time.sleep(0.01)
    return False


def _gated_stream(lib, device: int):
    """A non-blocking stream of ``device`` held by a gate kernel, and the gate; device 0 current."""
    ok(lib.cudaSetDevice(device))
    s = stream(lib)
    g = gate(lib, s, next(_gate_ids))
    ok(lib.cudaSetDevice(0))
    return s, g


def _malloc_async(lib, n, s):
    p = ffi.new("void **")
    ok(lib.cudaMallocAsync(p, n, s))
    return p[0]


# -- cudaGraphLaunch: launches of one executable graph are ordered ---------------------------------

@pytest.mark.parametrize("device", [0, 1])
def test_launches_of_one_graph_exec_are_ordered_across_streams(lib, device):
    ok(lib.cudaSetDevice(device))
    a, b = stream(lib), stream(lib)
    p = malloc(lib, 256)
    ok(lib.cudaStreamBeginCapture(a, 0))
    ok(lib.cudaMemsetAsync(p, 7, 256, a))
    graph = ffi.new("cudaGraph_t *")
    ok(lib.cudaStreamEndCapture(a, graph))
    x = ffi.new("cudaGraphExec_t *")
    ok(lib.cudaGraphInstantiate(x, graph[0], 0))
    g = gate(lib, a, next(_gate_ids))
    ok(lib.cudaGraphLaunch(x[0], a))          # held behind the gate
    ok(lib.cudaGraphLaunch(x[0], b))          # must wait for the launch on a
    ahead = _finished_within(lib, b)
    g.set()
    ok(lib.cudaDeviceSynchronize())
    ok(lib.cudaGraphExecDestroy(x[0]))
    ok(lib.cudaGraphDestroy(graph[0]))
    assert not ahead, "the second launch of the graph exec ran before the first"


# -- cudaMallocAsync / cudaFreeAsync: stream-ordered lifetime --------------------------------------

@pytest.mark.parametrize("device", [0, 1])
def test_work_queued_after_free_async_is_refused(lib, device):
    s, g = _gated_stream(lib, device)
    ok(lib.cudaSetDevice(device))
    other = stream(lib)                       # (device stays current: memsets go to its streams only)
    p = _malloc_async(lib, 4096, s)
    ok(lib.cudaFreeAsync(p, s))               # the free waits behind the gate
    rc = lib.cudaMemsetAsync(p, 1, 4096, other)
    lib.cudaGetLastError()
    g.set()
    ok(lib.cudaStreamSynchronize(s))
    lib.cudaStreamSynchronize(other)
    assert rc == INVALID_VALUE


@pytest.mark.parametrize("device", [0, 1])
def test_pointer_attributes_after_free_async_are_refused(lib, device):
    s, g = _gated_stream(lib, device)
    p = _malloc_async(lib, 4096, s)
    ok(lib.cudaFreeAsync(p, s))
    attrs = ffi.new("struct cudaPointerAttributes *")
    rc = lib.cudaPointerGetAttributes(attrs, p)
    kind = attrs.type
    lib.cudaGetLastError()
    g.set()
    ok(lib.cudaStreamSynchronize(s))
    assert rc == INVALID_VALUE, f"answered rc={rc}, type={kind}"


@pytest.mark.parametrize("device", [0, 1])
def test_pool_allocation_used_on_another_stream_before_it_is_made_is_refused(lib, device):
    """CUDA Runtime API, cudaMallocAsync: "The allocation must not be accessed until the allocation
    operation completes" (strict xfail in r62g; enforced since r63a, cudart/mempool.py)."""
    s, g = _gated_stream(lib, device)
    ok(lib.cudaSetDevice(device))
    other = stream(lib)                       # (device stays current: memsets go to its streams only)
    p = _malloc_async(lib, 4096, s)           # the allocation operation waits behind the gate
    rc = lib.cudaMemsetAsync(p, 1, 4096, other)
    lib.cudaGetLastError()
    g.set()
    ok(lib.cudaStreamSynchronize(s))
    lib.cudaStreamSynchronize(other)
    ok(lib.cudaFreeAsync(p, s))
    ok(lib.cudaStreamSynchronize(s))
    assert rc == INVALID_VALUE


def test_pool_allocation_used_in_order_is_accepted(lib):
    """What stays valid: the allocating stream, and another stream after an event or a synchronize."""
    ok(lib.cudaSetDevice(1))
    s, other = stream(lib), stream(lib)
    p = _malloc_async(lib, 4096, s)
    ok(lib.cudaMemsetAsync(p, 1, 4096, s))
    ok(lib.cudaStreamSynchronize(s))
    ok(lib.cudaMemsetAsync(p, 2, 4096, other))
    ok(lib.cudaStreamSynchronize(other))
    ok(lib.cudaFreeAsync(p, other))
    ok(lib.cudaStreamSynchronize(other))
    assert sim.state().live_allocations == {}


@pytest.mark.parametrize("device", [0, 1])
def test_cudafree_of_a_pool_allocation_returns_it_to_the_pool(lib, device):
    ok(lib.cudaSetDevice(device))
    s = stream(lib)
    ok(lib.cudaSetDevice(0))
    pool = ffi.new("cudaMemPool_t *")
    ok(lib.cudaDeviceGetDefaultMemPool(pool, device))
    p = _malloc_async(lib, 1 << 20, s)
    ok(lib.cudaStreamSynchronize(s))
    ok(lib.cudaFree(p))
    used = ffi.new("unsigned long long *")
    ok(lib.cudaMemPoolGetAttribute(pool[0], POOL_USED_CURRENT, used))
    assert sim.state().live_allocations == {}
    assert used[0] == 0, f"the pool still counts {used[0]} bytes in use"


# -- cudaHostAlloc flags ---------------------------------------------------------------------------

@pytest.mark.parametrize("device", [0, 1])
def test_host_alloc_refuses_undefined_flag_bits(lib, device):
    ok(lib.cudaSetDevice(device))
    before = sim.state().host_allocations
    p = ffi.new("void **")
    for flags in (0x10, 0x8):
        assert lib.cudaHostAlloc(p, 64, flags) == INVALID_VALUE, hex(flags)
        assert lib.cudaGetLastError() == INVALID_VALUE
    assert sim.state().host_allocations == before


def test_host_alloc_takes_each_documented_flag(lib):
    p = ffi.new("void **")
    for flags in (0, 1, 2, 4, 7):
        ok(lib.cudaHostAlloc(p, 64, flags))
        ok(lib.cudaFreeHost(p[0]))


# -- copies with a freed device pointer ------------------------------------------------------------

def _copy_with_freed_pointer(kind: int, n: int, into: bool) -> int:
    """Forked child: free a device-1 allocation (device 0 current), then cudaMemcpy into or out of
    it.  Exit 0: refused; 3: accepted (the sim copied to or from freed host memory)."""
    sim.reset()
    lib = sim.open_library("cudart")
    ok(lib.cudaSetDevice(1))
    p = malloc(lib, n)
    ok(lib.cudaSetDevice(0))
    ok(lib.cudaFree(p))
    host = ffi.new("char[]", n)
    rc = lib.cudaMemcpy(p, host, n, kind) if into else lib.cudaMemcpy(host, p, n, kind)
    return 0 if rc == INVALID_VALUE else 3


@pytest.mark.parametrize("kind", [HOST_TO_HOST, DEFAULT])
@pytest.mark.parametrize("n", [256, 4 << 20])
@pytest.mark.parametrize("into", [True, False], ids=["into", "from"])
def test_copy_with_a_freed_device_pointer_is_refused(monkeypatch, kind, n, into):
    """A cudaMemcpy (HostToHost or Default) naming a cudaFree'd device address: refused (1), not
    memmoved into freed host memory (r62g's non-strict xfail: glibc abort or SIGSEGV in the child;
    enforced since r63a: device memory is a reserved address range, cudart/copies.py)."""
    use_sim(monkeypatch, "cuda")
    assert run_forked(lambda: _copy_with_freed_pointer(kind, n, into)) == 0


# -- does accel rely on the leniency? --------------------------------------------------------------

def test_accel_async_allocator_never_touches_memory_after_free_async(monkeypatch):
    """The cudaFreeAsync rule made strict inside the simulator (a memset or copy naming a pool
    allocation whose cudaFreeAsync was called is refused with cudaErrorInvalidValue), then accel's
    backend:cudaMallocAsync allocator used across streams of device 1 (device 0 current), with
    record_stream, as test_memory_async does: accel never queues work on freed pool memory, so the
    fix proposed above would not break it."""
    import accel
    from accel import _lazy, memory
    from accel.sim.cudart import copies, state

    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="backend:cudaMallocAsync")
    seen, refused = set(), []

    def pending_free(ptr) -> bool:
        R = state.runtime()
        seen.update(R.async_allocs)
        a = R.mem.find(state._addr(ptr)) if ptr is not None else None
        return a is not None and a.live and a.base in seen and a.base not in R.async_allocs

    real_memset, real_memcpy = copies._memset, copies._memcpy

    def strict_memset(R, devPtr, *args, **kw):
        if pending_free(devPtr):
            refused.append(("memset", devPtr))
            return INVALID_VALUE
        return real_memset(R, devPtr, *args, **kw)

    def strict_memcpy(R, dst, src, *args, **kw):
        if pending_free(dst) or (not isinstance(src, (bytes, bytearray, memoryview)) and pending_free(src)):
            refused.append(("memcpy", dst, src))
            return INVALID_VALUE
        return real_memcpy(R, dst, src, *args, **kw)

    monkeypatch.setattr(copies, "_memset", strict_memset)
    monkeypatch.setattr(copies, "_memcpy", strict_memcpy)
    be = _lazy.lazy_init()
    try:
        alloc = memory.device_allocator(1)
        with accel.streams.on_device(be, 1):
            mine, slow = be.stream_create(), be.stream_create()
        for _ in range(3):
            ptr = alloc.malloc(1 << 16, mine)
            seen.update(state.runtime().async_allocs)
            with accel.streams.on_device(be, 1):      # (a memset needs its stream's device current)
                be.memset_async(ptr, 0xAA, 1 << 16, slow)
            alloc.record_stream(ptr, slow)
            alloc.free(ptr)
        be.stream_synchronize(mine)
        be.stream_synchronize(slow)
        with accel.streams.on_device(be, 1):
            for s in (mine, slow):
                be.stream_destroy(s)
        assert refused == []
        assert sim.state().errors == []
        # the strict rule is live: a raw use after cudaFreeAsync (the free held by a gate) is refused
        lib = sim.open_library("cudart")
        sim.configure(delay_us=1)
        s, g = _gated_stream(lib, 1)
        p = _malloc_async(lib, 4096, s)
        seen.update(state.runtime().async_allocs)
        ok(lib.cudaFreeAsync(p, s))
        ok(lib.cudaSetDevice(1))
        assert lib.cudaMemsetAsync(p, 1, 4096, s) == INVALID_VALUE and refused
        g.set()
        ok(lib.cudaStreamSynchronize(s))
    finally:
        sim.reset()
