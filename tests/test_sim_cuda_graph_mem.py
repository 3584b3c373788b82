"""Graph memory nodes in the simulated CUDA runtime (issue 15 item 5): cudaMallocAsync and
cudaFreeAsync on a capturing stream become allocation and free nodes, the relaunch rule
(cudaGraphInstantiateFlagAutoFreeOnLaunch), the graph allocator's own memory (not the
default pool's: counted against the device, reported by cudaDeviceGetGraphMemAttribute,
returned by cudaDeviceGraphMemTrim), and the pools' peer access (cudaMemPoolSetAccess)."""

import pytest

from accel import sim
from accel._ffi._cudart import ffi

from test_sim_cuda import ok, read, stream

AUTO_FREE = 1                                        # cudaGraphInstantiateFlagAutoFreeOnLaunch
USED, USED_HIGH, RESERVED, RESERVED_HIGH = 0, 1, 2, 3  # cudaGraphMemAttributeType
D2H, D2D = 2, 3
GLOBAL, RELAXED = 0, 2
NONE, READ, READ_WRITE = 0, 1, 3                     # cudaMemAccessFlags
LOCATION_DEVICE = 1                                  # cudaMemLocationTypeDevice
MiB = 1 << 20


@pytest.fixture
def lib():
    sim.reset()
    sim.configure(memory="64M")
    yield sim.open_library("cudart")
    sim.reset()


def malloc_async(lib, n, s):
    p = ffi.new("void **")
    ok(lib.cudaMallocAsync(p, n, s))
    return p[0]


def end_capture(lib, s):
    g = ffi.new("cudaGraph_t *")
    ok(lib.cudaStreamEndCapture(s, g))
    return g[0]


def instantiate(lib, graph, flags=0):
    x = ffi.new("cudaGraphExec_t *")
    ok(lib.cudaGraphInstantiate(x, graph, flags))
    return x[0]


def graph_mem(lib, device, attr):
    v = ffi.new("unsigned long long *")
    ok(lib.cudaDeviceGetGraphMemAttribute(device, attr, v))
    return v[0]


def pool_of(lib, device=0):
    p = ffi.new("cudaMemPool_t *")
    ok(lib.cudaDeviceGetDefaultMemPool(p, device))
    return p[0]


def pool_stat(lib, pool, attr):
    v = ffi.new("unsigned long long *")
    ok(lib.cudaMemPoolGetAttribute(pool, attr, v))
    return v[0]


def free_bytes(lib):
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    ok(lib.cudaMemGetInfo(free, total))
    return free[0]


def node_count(lib, graph):
    n = ffi.new("size_t *")
    ok(lib.cudaGraphGetNodes(graph, ffi.NULL, n))
    return n[0]


def fetch(lib, ptr, n):
    host = ffi.new("char[]", n)
    rc = lib.cudaMemcpy(host, ptr, n, D2H)
    return rc, ffi.buffer(host, n)[:]


def access_descs(*entries):
    descs = ffi.new("struct cudaMemAccessDesc[]", len(entries))
    for d, (kind, device, flags) in zip(descs, entries):
        d.location.type = kind
        d.location.id = device
        d.flags = flags
    return descs


def access_of(lib, pool, device):
    flags = ffi.new("enum cudaMemAccessFlags *")
    loc = ffi.new("struct cudaMemLocation *")
    loc.type = LOCATION_DEVICE
    loc.id = device
    ok(lib.cudaMemPoolGetAccess(flags, pool, loc))
    return flags[0]


# -- allocation and free nodes -----------------------------------------------------------------

def test_alloc_and_free_nodes_replay_from_graph_memory(lib):
    s = stream(lib)
    out = ffi.new("void **")
    ok(lib.cudaMalloc(out, 1024))
    pool = pool_of(lib)
    ok(lib.cudaStreamBeginCapture(s, GLOBAL))
    tmp = malloc_async(lib, 1000, s)                 # an allocation node: the address is known now
    ok(lib.cudaMemsetAsync(tmp, 7, 1000, s))
    ok(lib.cudaMemcpyAsync(out[0], tmp, 1000, D2D, s))
    ok(lib.cudaFreeAsync(tmp, s))                    # a free node
    graph = end_capture(lib, s)
    assert node_count(lib, graph) == 4
    # graph memory is its own: nothing comes from (or shows in) the default pool, and nothing
    # is mapped before a launch
    assert pool_stat(lib, pool, 5) == pool_stat(lib, pool, 7) == 0      # reserved / used current
    assert [graph_mem(lib, 0, a) for a in (USED, RESERVED)] == [0, 0]
    before = free_bytes(lib)
    x = instantiate(lib, graph)
    for _ in range(3):                               # freed in the graph: every launch may follow
        ok(lib.cudaMemsetAsync(out[0], 0, 1024, s))
        ok(lib.cudaGraphLaunch(x, s))
        ok(lib.cudaStreamSynchronize(s))
        assert read(out[0], 1000) == b"\x07" * 1000
    assert graph_mem(lib, 0, USED) == graph_mem(lib, 0, RESERVED) == 1024
    assert graph_mem(lib, 0, RESERVED_HIGH) == 1024
    assert free_bytes(lib) == before - 1024          # counted against the device
    assert pool_stat(lib, pool, 5) == 0
    ok(lib.cudaGraphExecDestroy(x))
    ok(lib.cudaGraphDestroy(graph))
    # the graph allocator keeps the memory until trimmed
    assert graph_mem(lib, 0, USED) == 0 and graph_mem(lib, 0, RESERVED) == 1024
    ok(lib.cudaDeviceGraphMemTrim(0))
    assert graph_mem(lib, 0, RESERVED) == 0 and free_bytes(lib) == before
    ok(lib.cudaFree(out[0]))
    ok(lib.cudaStreamDestroy(s))
    assert sim.state().errors == []


def test_allocation_outside_its_lifetime_faults(lib):
    """Before the allocation node runs (no launch yet) the address is not usable: a copy
    from it faults (cudaErrorIllegalAddress, sticky)."""
    s = stream(lib)
    ok(lib.cudaStreamBeginCapture(s, GLOBAL))
    tmp = malloc_async(lib, 256, s)
    ok(lib.cudaMemsetAsync(tmp, 1, 256, s))
    ok(lib.cudaFreeAsync(tmp, s))
    graph = end_capture(lib, s)
    instantiate(lib, graph)
    rc, _ = fetch(lib, tmp, 256)
    assert rc == lib.cudaErrorIllegalAddress
    assert "freed memory" in sim.state().errors[0][1] or "lifetime" in sim.state().errors[0][1]


def test_unfreed_allocation_and_the_relaunch_rule(lib):
    s = stream(lib)
    ok(lib.cudaStreamBeginCapture(s, GLOBAL))
    p = malloc_async(lib, 256, s)
    ok(lib.cudaMemsetAsync(p, 5, 256, s))
    graph = end_capture(lib, s)
    x = instantiate(lib, graph)
    ok(lib.cudaGraphLaunch(x, s))
    rc, data = fetch(lib, p, 256)                    # usable after the launch, in stream order
    ok(rc)
    assert data == b"\x05" * 256
    # cudaGraphLaunch: unfreed allocations of a previous launch and no AutoFreeOnLaunch
    assert lib.cudaGraphLaunch(x, s) == lib.cudaErrorInvalidValue
    assert lib.cudaGetLastError() == lib.cudaErrorInvalidValue
    ok(lib.cudaFreeAsync(p, s))                      # freed outside the graph: it may run again
    ok(lib.cudaGraphLaunch(x, s))
    ok(lib.cudaFree(p))                              # cudaFree ends a graph allocation too
    assert lib.cudaFreeAsync(p, s) == lib.cudaErrorInvalidValue     # not allocated now
    # at most one executable graph of a graph with memory nodes at a time (cudaErrorNotSupported on
    # an H100: tests/conformance/cuda_h100_2026-12-05.json, scenario graph_mem_second_instantiation)
    y = ffi.new("cudaGraphExec_t *")
    assert lib.cudaGraphInstantiate(y, graph, 0) == lib.cudaErrorNotSupported
    ok(lib.cudaGraphExecDestroy(x))
    auto = instantiate(lib, graph, AUTO_FREE)
    for _ in range(3):                               # each launch frees the previous allocation
        ok(lib.cudaGraphLaunch(auto, s))
    ok(lib.cudaStreamSynchronize(s))
    assert graph_mem(lib, 0, USED) == 256            # one allocation, at one fixed address
    ok(lib.cudaGraphExecDestroy(auto))
    ok(lib.cudaGraphDestroy(graph))
    # the last launch's allocation outlives its graph until it is freed
    rc, data = fetch(lib, p, 256)
    ok(rc)
    assert data == b"\x05" * 256
    ok(lib.cudaFreeAsync(p, s))
    ok(lib.cudaStreamSynchronize(s))
    ok(lib.cudaDeviceGraphMemTrim(0))
    assert graph_mem(lib, 0, RESERVED) == 0 and sim.state().errors == []
    ok(lib.cudaStreamDestroy(s))


def test_frees_the_docs_do_not_allow_are_refused(lib):
    s, side = stream(lib), stream(lib)
    fork = ffi.new("cudaEvent_t *")
    ok(lib.cudaEventCreateWithFlags(fork, 2))
    regular = malloc_async(lib, 256, s)
    ok(lib.cudaStreamBeginCapture(s, RELAXED))
    ok(lib.cudaEventRecord(fork[0], s))
    ok(lib.cudaStreamWaitEvent(side, fork[0], 0))    # side joins the capture before the allocation
    # cudaFreeAsync: "during stream capture ... must be passed the address of a graph allocation"
    assert lib.cudaFreeAsync(regular, s) == lib.cudaErrorInvalidValue
    p = malloc_async(lib, 256, s)
    # a free node not ordered after the allocation node (side forked before it): refused
    assert lib.cudaFreeAsync(p, side) == lib.cudaErrorInvalidValue
    ok(lib.cudaFreeAsync(p, s))
    assert lib.cudaFreeAsync(p, s) == lib.cudaErrorInvalidValue      # freed twice in the graph
    q = malloc_async(lib, 256, s)
    ok(lib.cudaEventRecord(fork[0], side))
    ok(lib.cudaStreamWaitEvent(s, fork[0], 0))       # join side back
    graph = end_capture(lib, s)
    assert lib.cudaFreeAsync(q, s) == lib.cudaErrorInvalidValue      # no launch allocated it yet
    x = instantiate(lib, graph)
    ok(lib.cudaGraphLaunch(x, s))
    # freed in its own graph: "cannot be freed outside the owning graph"
    assert lib.cudaFreeAsync(p, s) == lib.cudaErrorInvalidValue
    ok(lib.cudaFreeAsync(q, s))
    ok(lib.cudaFreeAsync(regular, s))
    ok(lib.cudaStreamSynchronize(s))
    ok(lib.cudaGraphExecDestroy(x))
    ok(lib.cudaGraphDestroy(graph))
    assert sim.state().errors == []


def test_capture_allocation_oom_changes_nothing(lib):
    s = stream(lib)
    ok(lib.cudaStreamBeginCapture(s, GLOBAL))
    p = ffi.new("void **")
    assert lib.cudaMallocAsync(p, 128 * MiB, s) == lib.cudaErrorMemoryAllocation    # more than the device
    sim.inject_oom()
    assert lib.cudaMallocAsync(p, 256, s) == lib.cudaErrorMemoryAllocation
    assert lib.cudaGetLastError() == lib.cudaErrorMemoryAllocation
    ok(lib.cudaMallocAsync(p, 256, s))               # the capture goes on
    ok(lib.cudaFreeAsync(p[0], s))
    graph = end_capture(lib, s)
    assert node_count(lib, graph) == 2
    ok(lib.cudaGraphDestroy(graph))


def test_launch_without_room_fails_and_changes_nothing(lib):
    s = stream(lib)
    ok(lib.cudaStreamBeginCapture(s, GLOBAL))
    tmp = malloc_async(lib, 8 * MiB, s)
    ok(lib.cudaMemsetAsync(tmp, 3, 8 * MiB, s))
    ok(lib.cudaFreeAsync(tmp, s))
    x = instantiate(lib, end_capture(lib, s))
    hog = ffi.new("void **")
    ok(lib.cudaMalloc(hog, free_bytes(lib) - 4 * MiB))
    before = free_bytes(lib)
    assert lib.cudaGraphLaunch(x, s) == lib.cudaErrorMemoryAllocation   # no room to map it
    assert free_bytes(lib) == before and graph_mem(lib, 0, RESERVED) == 0
    ok(lib.cudaFree(hog[0]))
    ok(lib.cudaGraphLaunch(x, s))
    ok(lib.cudaStreamSynchronize(s))
    assert graph_mem(lib, 0, RESERVED) == 8 * MiB
    ok(lib.cudaGraphExecDestroy(x))
    assert sim.state().errors == []


def test_graph_memory_attributes_and_trim(lib):
    s = stream(lib)
    ok(lib.cudaStreamBeginCapture(s, GLOBAL))
    p = malloc_async(lib, MiB, s)
    graph = end_capture(lib, s)
    x = instantiate(lib, graph, AUTO_FREE)
    ok(lib.cudaGraphLaunch(x, s))
    ok(lib.cudaStreamSynchronize(s))
    ok(lib.cudaDeviceGraphMemTrim(0))                # the allocation is in use: it stays
    assert graph_mem(lib, 0, USED) == graph_mem(lib, 0, RESERVED) == MiB
    ok(lib.cudaFreeAsync(p, s))
    ok(lib.cudaStreamSynchronize(s))
    ok(lib.cudaDeviceGraphMemTrim(0))                # unused now (its graph is not running)
    assert graph_mem(lib, 0, USED) == graph_mem(lib, 0, RESERVED) == 0
    assert graph_mem(lib, 0, USED_HIGH) == graph_mem(lib, 0, RESERVED_HIGH) == MiB
    zero, one = ffi.new("unsigned long long *", 0), ffi.new("unsigned long long *", 1)
    ok(lib.cudaDeviceSetGraphMemAttribute(0, USED_HIGH, zero))       # reset to the current value
    ok(lib.cudaDeviceSetGraphMemAttribute(0, RESERVED_HIGH, zero))
    assert graph_mem(lib, 0, USED_HIGH) == graph_mem(lib, 0, RESERVED_HIGH) == 0
    assert lib.cudaDeviceSetGraphMemAttribute(0, USED_HIGH, one) == lib.cudaErrorInvalidValue
    assert lib.cudaDeviceSetGraphMemAttribute(0, USED, zero) == lib.cudaErrorInvalidValue
    v = ffi.new("unsigned long long *")
    assert lib.cudaDeviceGetGraphMemAttribute(7, USED, v) == lib.cudaErrorInvalidDevice
    assert lib.cudaDeviceGetGraphMemAttribute(0, 9, v) == lib.cudaErrorInvalidValue
    assert lib.cudaDeviceGetGraphMemAttribute(0, USED, ffi.NULL) == lib.cudaErrorInvalidValue
    assert lib.cudaDeviceGraphMemTrim(7) == lib.cudaErrorInvalidDevice
    ok(lib.cudaGraphExecDestroy(x))
    ok(lib.cudaGraphDestroy(graph))


def test_capture_on_device_1_while_0_is_current(lib):
    ok(lib.cudaSetDevice(1))
    s1 = stream(lib)
    ok(lib.cudaSetDevice(0))
    ok(lib.cudaStreamBeginCapture(s1, GLOBAL))
    p = malloc_async(lib, 4096, s1)                  # from the stream's device, not the current one
    # (a memset, unlike a copy, needs its stream's device current: accel/sim/cudart/copies.py)
    assert lib.cudaMemsetAsync(p, 2, 4096, s1) == lib.cudaErrorInvalidResourceHandle
    ok(lib.cudaSetDevice(1))
    ok(lib.cudaMemsetAsync(p, 2, 4096, s1))
    ok(lib.cudaSetDevice(0))
    graph = end_capture(lib, s1)
    attrs = ffi.new("struct cudaPointerAttributes *")
    ok(lib.cudaPointerGetAttributes(attrs, p))
    assert attrs.device == 1
    x = instantiate(lib, graph, AUTO_FREE)
    assert lib.cudaGraphLaunch(x, s1) == lib.cudaErrorInvalidResourceHandle   # device 1 not current
    ok(lib.cudaSetDevice(1))
    ok(lib.cudaGraphLaunch(x, s1))
    ok(lib.cudaGraphLaunch(x, s1))
    ok(lib.cudaStreamSynchronize(s1))
    rc, data = fetch(lib, p, 4096)
    ok(rc)
    assert data == b"\x02" * 4096
    assert graph_mem(lib, 1, USED) == 4096 and graph_mem(lib, 0, USED) == 0
    ok(lib.cudaFree(p))
    ok(lib.cudaGraphExecDestroy(x))
    ok(lib.cudaGraphDestroy(graph))
    ok(lib.cudaDeviceGraphMemTrim(1))
    assert graph_mem(lib, 1, RESERVED) == 0 and sim.state().errors == []


# -- peer access to pool memory -----------------------------------------------------------------

def test_pool_access_lets_a_peer_copy(lib):
    pool0 = pool_of(lib, 0)
    assert access_of(lib, pool0, 0) == READ_WRITE and access_of(lib, pool0, 1) == NONE
    s0 = stream(lib)
    p = malloc_async(lib, 4096, s0)
    ok(lib.cudaMemsetAsync(p, 9, 4096, s0))
    ok(lib.cudaStreamSynchronize(s0))
    # refused lists change nothing: a location that is not a device, a device out of range,
    # an unknown flag, the owner's own access (the codes an H100 returns: tests/conformance/
    # cuda_h100_2026-12-05.json, scenario pool_rules_one_device)
    for bad, code in [((0, 1, READ_WRITE), lib.cudaErrorInvalidValue),
                      ((2, 0, READ_WRITE), lib.cudaErrorNotSupported),            # the host
                      ((LOCATION_DEVICE, 7, READ_WRITE), lib.cudaErrorInvalidDevice),
                      ((LOCATION_DEVICE, 1, 2), lib.cudaErrorInvalidValue),
                      ((LOCATION_DEVICE, 0, READ), lib.cudaErrorNotSupported),
                      ((LOCATION_DEVICE, 0, NONE), lib.cudaErrorInvalidDevice)]:
        assert lib.cudaMemPoolSetAccess(pool0, access_descs((LOCATION_DEVICE, 1, READ_WRITE), bad), 2) \
            == code, bad
        assert access_of(lib, pool0, 1) == NONE
    ok(lib.cudaMemPoolSetAccess(pool0, access_descs((LOCATION_DEVICE, 1, READ_WRITE)), 1))
    assert access_of(lib, pool0, 1) == READ_WRITE
    # the copy runs on device 1's stream and reads device 0's pool memory
    ok(lib.cudaSetDevice(1))
    s1 = stream(lib)
    q = malloc_async(lib, 4096, s1)
    ok(lib.cudaMemcpyAsync(q, p, 4096, D2D, s1))
    ok(lib.cudaStreamSynchronize(s1))
    rc, data = fetch(lib, q, 4096)
    ok(rc)
    assert data == b"\x09" * 4096
    # a graph allocation gets the pool's access at capture time (Programming Guide, Graph
    # Memory Nodes, "Peer Access with Stream Capture")
    ok(lib.cudaSetDevice(0))
    ok(lib.cudaStreamBeginCapture(s0, GLOBAL))
    g_alloc = malloc_async(lib, 4096, s0)
    ok(lib.cudaMemsetAsync(g_alloc, 4, 4096, s0))
    x = instantiate(lib, end_capture(lib, s0), AUTO_FREE)
    ok(lib.cudaGraphLaunch(x, s0))
    ok(lib.cudaStreamSynchronize(s0))
    ok(lib.cudaMemPoolSetAccess(pool0, access_descs((LOCATION_DEVICE, 1, NONE)), 1))   # later change: no effect on it
    ok(lib.cudaSetDevice(1))
    ok(lib.cudaMemcpyAsync(q, g_alloc, 4096, D2D, s1))
    ok(lib.cudaStreamSynchronize(s1))
    assert read(q, 4096) == b"\x04" * 4096
    assert sim.state().errors == []


def test_peer_without_pool_access_faults(lib):
    """Pool memory does not follow cudaDeviceEnablePeerAccess (Programming Guide, Stream
    Ordered Memory Allocator, "Device Accessibility for Multi-GPU Support"): a copy on device
    1 reading device 0's pool memory without cudaMemPoolSetAccess faults."""
    s0 = stream(lib)
    p = malloc_async(lib, 4096, s0)
    ok(lib.cudaStreamSynchronize(s0))
    ok(lib.cudaSetDevice(1))
    ok(lib.cudaDeviceEnablePeerAccess(0, 0))
    s1 = stream(lib)
    q = ffi.new("void **")
    ok(lib.cudaMalloc(q, 4096))
    ok(lib.cudaMemcpyAsync(q[0], p, 4096, D2D, s1))
    assert lib.cudaStreamSynchronize(s1) == lib.cudaErrorIllegalAddress
    assert "cudaMemPoolSetAccess" in sim.state().errors[0][1]
