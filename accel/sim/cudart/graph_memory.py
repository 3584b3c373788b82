"""Graph memory nodes: cudaMallocAsync / cudaFreeAsync on a capturing stream, the
allocations' lifetimes across instantiate, launch and destroy, and each device's graph memory
attributes (the model is accel/sim/_graph_mem.py).
"""

from __future__ import annotations

from .. import _graph_mem, _memory, core
from .state import (
    _AUTO_FREE_ON_LAUNCH, _DEVICE_LAUNCH, Capture, Graph, GraphExec, Runtime, Stream, _accounted,
    cudaErrorInvalidDevice, cudaErrorInvalidValue, cudaErrorMemoryAllocation, cudaErrorNotSupported,
    cudaErrorStreamCaptureUnsupported, cudaSuccess, _oom,
)
from .common import _enqueue, _invalidate, _is_null, _put, _put_ptr, _unsafe_call, _wait_device
from .pools import _GraphAllocation, _default_pool, _pool_value


# cudaGraphInstantiate: "Valid flags are: cudaGraphInstantiateFlagAutoFreeOnLaunch, ...DeviceLaunch,
# ...UseNodePriority"; Upload (2) is "Only supported by cudaGraphInstantiateWithParams" (driver_types.h).
_GRAPH_INSTANTIATE_FLAGS = 0xD
#: What a graph instantiated for device launch may hold (cudaGraphInstantiate: "kernel nodes, memcpy
#: nodes, memset nodes, and child graph nodes"; it "cannot be empty").
_DEVICE_LAUNCH_NODES = frozenset({"kernel", "memcpy", "memset"})
_GRAPH_MEM_ATTRS = {0: "used", 1: "used_high", 2: "reserved", 3: "reserved_high"}   # cudaGraphMemAttributeType


def _capture_malloc(R: Runtime, devPtr, size: int, s: Stream) -> int:
    """cudaMallocAsync on a capturing stream: an allocation node, its address fixed now, on the
    stream's device, with the access the device's default pool grants now.  Out of memory
    (cudaGraphAddMemAllocNode lists cudaErrorOutOfMemory) when injected, or when the size can
    never fit the device; nothing is added then."""
    if _oom and core.take_oom():
        return cudaErrorMemoryAllocation
    dev = R.devices[s.device]
    if _accounted(size) > R.cfg.memory - dev.reserved:
        return cudaErrorMemoryAllocation
    try:
        a = _memory.allocate(size, _memory.DEVICE, s.device)
    except MemoryError:
        return cudaErrorMemoryAllocation
    cap = s.capture
    ga = _GraphAllocation(a, dict(_default_pool(R, s.device).access), cap)

    def alloc_node():
        ga.live = True
    alloc_node.ga = ga
    if not _put_ptr(devPtr, ga.key):
        return cudaErrorInvalidValue
    with R.mlock:
        R.gmem.allocs[ga.base] = ga
    R.mem.add(ga)
    rc, _seq = _enqueue(R, s, alloc_node, "mem_alloc", f"cudaMallocAsync {size} bytes at 0x{ga.base:x}")
    if rc:                  # the capture was invalidated meanwhile: no node, no address
        with R.mlock:
            R.gmem.allocs.pop(ga.base, None)
        R.mem.remove(ga)
        return rc
    with R.clock:
        ga.node = cap.tails[s][0]
    return cudaSuccess


def _ordered_after(cap: Capture, s: Stream, node: int) -> bool:
    """True when ``s``'s next captured operation follows node ``node`` of ``cap``."""
    seen, stack = set(), list(cap.tails.get(s, ()))
    while stack:
        n = stack.pop()
        if n == node:
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(cap.nodes[n].deps)
    return False


def _capture_free(R: Runtime, ga: _GraphAllocation, s: Stream) -> int:
    """cudaFreeAsync of a graph allocation on a capturing stream: a free node.  The allocation
    must be one of this capture, not freed in it yet, and the free ordered after its
    allocation node (cudaGraphAddMemAllocNode: "the allocation can be accessed by nodes ordered
    after the allocation node but before the free node ... they can only be freed once in the
    owning graph").  Freeing another graph's allocation in a capture is not simulated (refused,
    cudaErrorInvalidValue, as everything else here)."""
    cap = s.capture
    with R.clock:
        if ga.capture is not cap or ga.freed_in_graph or not _ordered_after(cap, s, ga.node):
            return cudaErrorInvalidValue

    def free_node():
        ga.live = False
    free_node.ga = ga
    rc, _seq = _enqueue(R, s, free_node, "mem_free", f"cudaFreeAsync 0x{ga.base:x}")
    if not rc:
        ga.freed_in_graph = True
    return rc


def _graph_free_async(R: Runtime, ga: _GraphAllocation, s: Stream) -> int:
    """cudaFreeAsync of a graph allocation outside capture: it must be allocated (a launch made
    it and no free was issued since: cudaGraphAddMemAllocNode, "Allocations which are not freed
    in the same graph can be freed by passing the allocation to cudaMemFreeAsync or
    cudaMemFree"); the docs leave freeing one that is not allocated undefined, so it is
    refused (cudaErrorInvalidValue).  A later launch of its graph waits for this free."""
    with R.mlock:
        if not ga.outstanding:
            return cudaErrorInvalidValue
        ga.outstanding = False

    def run():
        ga.live = False
        R.gmem.release_if_unused(R, ga)
    rc, seq = _enqueue(R, s, run, "free", "cudaFreeAsync")
    if rc:
        with R.mlock:
            ga.outstanding = True
        return rc
    ga.pending = (s.q, seq) if seq else None
    return cudaSuccess


def _graph_free_now(R: Runtime, ga: _GraphAllocation) -> int:
    """cudaFree of a graph allocation: ends it "immediately upon the synchronous cudaFree() call"
    (Programming Guide, Graph Memory Nodes) after the device's queued work, as cudaFree waits."""
    with R.mlock:
        if not ga.outstanding:
            return cudaErrorInvalidValue
        ga.outstanding = False
    _wait_device(R, ga.device)
    ga.live = False
    R.gmem.release_if_unused(R, ga)
    return cudaSuccess


def _graph_allocs(nodes) -> list:
    return [n.fn.ga for n in nodes if n.kind == "mem_alloc"]


def _graph_mem_captured(R: Runtime, cap: Capture, graph) -> None:
    """cudaStreamEndCapture: the capture's allocations belong to ``graph`` now, or (None: the
    capture failed) their addresses go back."""
    allocs = _graph_allocs(cap.nodes)
    for ga in allocs:
        ga.capture = None
        if graph is not None:
            ga.refs += 1
    if graph is None:
        for ga in allocs:
            R.gmem.release_if_unused(R, ga)


def _graph_mem_instantiate(R: Runtime, g: Graph, flags: int):
    """(rc, ExecMem or None) for cudaGraphInstantiate of ``g``.  cudaGraphInstantiate: "If graph
    contains any allocation or free nodes, there can be at most one executable graph in existence
    for that graph at a time.  An attempt to instantiate a second executable graph before
    destroying the first with cudaGraphExecDestroy will result in an error" (which one the docs
    do not say: cudaErrorNotSupported, measured on an H100, tests/conformance/
    cuda_h100_2026-12-05.json, scenario graph_mem_second_instantiation, driver 580.159.04,
    libcudart 13.0, whether or not the graph frees its allocations); DeviceLaunch "cannot be used in conjunction with
    cudaGraphInstantiateFlagAutoFreeOnLaunch"; unknown flags are refused."""
    if flags & ~_GRAPH_INSTANTIATE_FLAGS or \
            flags & (_AUTO_FREE_ON_LAUNCH | _DEVICE_LAUNCH) == _AUTO_FREE_ON_LAUNCH | _DEVICE_LAUNCH:
        return cudaErrorInvalidValue, None
    if flags & _DEVICE_LAUNCH and (not g.nodes or any(n.kind not in _DEVICE_LAUNCH_NODES for n in g.nodes)):
        return cudaErrorInvalidValue, None
    if not R.gmem.allocs:
        return cudaSuccess, None
    allocs = _graph_allocs(g.nodes)
    if not allocs:
        return cudaSuccess, None
    if any(ga.exec is not None for ga in allocs):
        return cudaErrorNotSupported, None      # measured on an H100 (see above)
    if flags & _DEVICE_LAUNCH:
        return cudaErrorNotSupported, None      # device launch is not simulated
    return cudaSuccess, _graph_mem.ExecMem(allocs, bool(flags & _AUTO_FREE_ON_LAUNCH))


def _graph_mem_bind(R: Runtime, x: GraphExec, em) -> None:
    R.gmem.execs[x] = em
    for ga in em.allocs:
        ga.exec = em
        ga.refs += 1


def _graph_mem_before_launch(R: Runtime, em, s: Stream):
    """(rc, newly mapped) before cudaGraphLaunch of a graph with allocation nodes.

    cudaGraphLaunch: "If any allocations created by graphExec remain unfreed (from a previous
    launch) and graphExec was not instantiated with cudaGraphInstantiateFlagAutoFreeOnLaunch,
    the launch will fail with cudaErrorInvalidValue."  Physical memory is mapped for the launch;
    without room it fails with cudaErrorMemoryAllocation (no code is documented for that) and
    nothing changes.  The launch is ordered after frees of its allocations issued on other
    streams and after its previous launch ("Each launch is ordered behind ... any previous
    launches of graphExec"), so no lifetime of one launch overlaps the next.  Launched into a
    capture it would be a child graph, which "can only be used in a child node if the ownership
    is moved to the parent": refused."""
    if s.capture is not None:
        _invalidate(R, s.capture)
        return cudaErrorStreamCaptureUnsupported, ()
    with R.mlock:
        if not em.auto_free and any(ga.outstanding for ga in em.unfreed):
            return cudaErrorInvalidValue, ()
        mapped = R.gmem.map(R, em.allocs)
    if mapped is None:
        return cudaErrorMemoryAllocation, ()
    points = [ga.pending for ga in em.allocs if ga.pending is not None and ga.pending[0].done < ga.pending[1]]
    if em.last is not None and em.last[0] is not s.q and em.last[0].done < em.last[1]:
        points.append(em.last)
    if points:
        s.q.submit(None, points, False)
    return cudaSuccess, mapped


def _graph_mem_after_launch(R: Runtime, em, s: Stream, rc: int, mapped) -> None:
    with R.mlock:
        if rc:
            for ga in mapped:
                R.gmem.unmap(ga)
            return
        for ga in em.unfreed:
            ga.outstanding = True       # AutoFreeOnLaunch freed the previous one: allocated again
        for ga in em.allocs:
            ga.pending = None
        em.last = (s.q, s.q.enqueued)


def _graph_mem_exec_destroyed(R: Runtime, em) -> None:
    """The executable graph is gone once its queued launches ran; its allocations' addresses
    go back unless their graph or a live allocation still holds them."""
    if em.last is not None:
        em.last[0].wait(em.last[1])
    with R.mlock:
        for ga in em.allocs:
            ga.exec = None
            ga.refs -= 1
    for ga in em.allocs:
        R.gmem.release_if_unused(R, ga)


def _graph_mem_graph_destroyed(R: Runtime, g: Graph) -> None:
    if not R.gmem.allocs:
        return
    allocs = _graph_allocs(g.nodes)
    with R.mlock:
        for ga in allocs:
            ga.refs -= 1
    for ga in allocs:
        R.gmem.release_if_unused(R, ga)


def _graph_mem_call_in_capture(R) -> int:
    """(r68d) cudaDeviceGraphMemTrim and cudaDevice{Get,Set}GraphMemAttribute inside a global or
    thread-local capture (common._unsafe_call's rule): the Runtime API pages are silent on
    capture.  The device's graph memory is a pool like the stream-ordered ones, whose attribute
    calls are "potentially unsafe" on the hardware (NVIDIA/cccl PR 11360: they "fail with
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidate the capture"), and trimming gives memory
    back to the OS as cudaFree does: refused alike (900, the capture invalidated; relaxed mode
    allows them).  Before r68d they were accepted in any capture."""
    return _unsafe_call(R) if R.captures else 0


def cudaDeviceGraphMemTrim(R, device):
    """CUDA Runtime API, cudaDeviceGraphMemTrim: "Free unused memory that was cached on the
    specified device for use with graphs back to the OS.  Blocks which are not in use by a graph
    that is either currently executing or scheduled to execute are freed"."""
    if not (0 <= device < len(R.devices)):
        return cudaErrorInvalidDevice
    rc = _graph_mem_call_in_capture(R)
    if rc:
        return rc
    with R.mlock:
        R.gmem.trim(R, device)
    return cudaSuccess


def cudaDeviceGetGraphMemAttribute(R, device, attr, value):
    """CUDA Runtime API, cudaDeviceGetGraphMemAttribute: UsedMemCurrent ("currently associated
    with graphs": mapped for graph allocations), UsedMemHigh, ReservedMemCurrent ("currently
    allocated for use by the CUDA graphs asynchronous allocator"), ReservedMemHigh."""
    if not (0 <= device < len(R.devices)):
        return cudaErrorInvalidDevice
    which = _GRAPH_MEM_ATTRS.get(attr)
    if which is None or _is_null(value):
        return cudaErrorInvalidValue
    rc = _graph_mem_call_in_capture(R)
    if rc:
        return rc
    with R.mlock:
        got = R.gmem.attribute(device, which)
    _put(value, got, "unsigned long long *")
    return cudaSuccess


def cudaDeviceSetGraphMemAttribute(R, device, attr, value):
    """CUDA Runtime API, cudaDeviceSetGraphMemAttribute: only the two high watermarks, which
    "can only be reset to zero" (to the current value, as the pools' high watermarks)."""
    if not (0 <= device < len(R.devices)):
        return cudaErrorInvalidDevice
    which = _GRAPH_MEM_ATTRS.get(attr)
    if which not in ("used_high", "reserved_high") or _is_null(value) or \
            _pool_value(value, "unsigned long long *") != 0:
        return cudaErrorInvalidValue
    rc = _graph_mem_call_in_capture(R)
    if rc:
        return rc
    with R.mlock:
        R.gmem.reset_high(device, which)
    return cudaSuccess
