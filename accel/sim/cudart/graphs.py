"""Stream capture and CUDA graphs: begin and end a capture (modes, joins, invalidation),
capture queries, instantiate, launch (event record / wait nodes included), destroy, node
listing and DOT output.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

from .. import core
from ..core import ffi
from .state import (
    _CAPTURE_GLOBAL, _CAPTURE_RELAXED, _CAPTURE_THREAD_LOCAL, _EVENT_DISABLE_TIMING, _NULL, _STATUS_ACTIVE,
    _STATUS_INVALIDATED, _STATUS_NONE, Capture, Graph, GraphExec, Node, Rec, Runtime, Stream, _addr,
    cudaErrorCapturedEvent, cudaErrorIllegalState, cudaErrorInvalidDeviceFunction,
    cudaErrorInvalidResourceHandle, cudaErrorInvalidValue, cudaErrorNotSupported, cudaErrorOperatingSystem,
    cudaErrorStreamCaptureImplicit, cudaErrorStreamCaptureInvalidated, cudaErrorStreamCaptureUnjoined,
    cudaErrorStreamCaptureUnmatched, cudaErrorStreamCaptureUnsupported, cudaErrorStreamCaptureWrongThread,
    cudaSuccess,
)
from .common import (
    _async_unusable, _c_string, _enqueue, _freed_ranges, _implicit_deps, _invalidate, _is_null, _legacy_captured,
    _legacy_conflict, _lookup, _put, _put_ptr, _stream, _unmade_pointers, _unsafe_call,
)
from .graph_memory import (
    _graph_mem_after_launch, _graph_mem_before_launch, _graph_mem_bind, _graph_mem_captured,
    _graph_mem_exec_destroyed, _graph_mem_graph_destroyed, _graph_mem_instantiate,
)


# -- capture and graphs -----------------------------------------------------------------

def cudaStreamBeginCapture(R, stream, mode):
    s = _stream(R, stream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    if s.legacy:
        return cudaErrorStreamCaptureUnsupported
    if mode not in (_CAPTURE_GLOBAL, _CAPTURE_THREAD_LOCAL, _CAPTURE_RELAXED):
        return cudaErrorInvalidValue
    with R.clock:
        if s.capture is not None:
            return cudaErrorIllegalState
        cap = Capture(next(R.capture_ids), s, mode, threading.get_ident(), s.device)
        s.capture = cap
        R.captures.add(cap)
    return cudaSuccess


def _unjoined(cap: Capture) -> bool:
    """True when some stream's last captured work does not flow into the origin's tail."""
    reach = set()
    stack = list(cap.tails.get(cap.origin, ()))
    while stack:
        n = stack.pop()
        if n not in reach:
            reach.add(n)
            stack.extend(cap.nodes[n].deps)
    return any(not set(t) <= reach for st, t in cap.tails.items() if st is not cap.origin)


def cudaStreamEndCapture(R, stream, pGraph):
    s = _stream(R, stream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    if _is_null(pGraph):
        return cudaErrorInvalidValue
    with R.clock:
        cap = s.capture
        if cap is None:
            return cudaErrorIllegalState
        if cap.origin is not s:
            cap.status = _STATUS_INVALIDATED
            return cudaErrorStreamCaptureUnmatched
        # A global or thread_local capture must be ended by the thread that began it (Runtime API,
        # cudaStreamEndCapture: cudaErrorStreamCaptureWrongThread).  The call from another thread
        # still ends the capture: measured on an H200 (driver 580.159.04, libcudart 13.0;
        # tools/cuda_conformance.py, capture_end_other_thread_global), the stream then reports no
        # capture and the capturing thread's own cudaStreamEndCapture fails with
        # cudaErrorIllegalState.  What was captured is discarded.
        wrong_thread = cap.mode != _CAPTURE_RELAXED and cap.thread != threading.get_ident()
        for st in cap.tails:
            if st.capture is cap:
                st.capture = None
        cap.ended = True
        R.captures.discard(cap)
        _put_ptr(pGraph, _NULL)
        g = None
        if wrong_thread:
            rc = cudaErrorStreamCaptureWrongThread
        elif cap.status != _STATUS_ACTIVE:
            rc = cudaErrorStreamCaptureInvalidated
        elif _unjoined(cap):
            rc = cudaErrorStreamCaptureUnjoined
        else:
            rc = cudaSuccess
            g = Graph(R.new_handle(), tuple(cap.nodes), cap.id, cap.device)
    if R.gmem.allocs:
        _graph_mem_captured(R, cap, g)      # graph memory nodes: owned by the graph, or given back
    if rc:
        return rc
    Runtime.put(R.graphs, g)
    _put_ptr(pGraph, g.key)
    return cudaSuccess


def cudaStreamIsCapturing(R, stream, pCaptureStatus):
    s = _stream(R, stream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    if _is_null(pCaptureStatus):
        return cudaErrorInvalidValue
    if s.legacy and R.captures and _legacy_captured(R, s.device):
        # cudaStreamIsCapturing: on cudaStreamLegacy "while a blocking stream in the same device is
        # capturing, it will return cudaErrorStreamCaptureImplicit" (a stream of the device that
        # joined a capture begun on another device counts: common._blocks_legacy)
        return cudaErrorStreamCaptureImplicit
    cap = s.capture
    _put(pCaptureStatus, _STATUS_NONE if cap is None else cap.status, "int *")
    return cudaSuccess


def cudaStreamGetCaptureInfo(R, stream, captureStatus_out, id_out=None, graph_out=None,
                             dependencies_out=None, edgeData_out=None, numDependencies_out=None):
    s = _stream(R, stream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    if _is_null(captureStatus_out):
        return cudaErrorInvalidValue
    if not _is_null(edgeData_out) and _is_null(dependencies_out):
        # cudaStreamGetCaptureInfo (CUDA 12.3+): "If edgeData_out is non-NULL then dependencies_out
        # must be as well" (r66c: accepted before); no code is named: cudaErrorInvalidValue
        return cudaErrorInvalidValue
    if s.legacy and R.captures and _legacy_captured(R, s.device):
        # "If called on cudaStreamLegacy (the "null stream") while a stream not created with
        # cudaStreamNonBlocking is capturing, returns cudaErrorStreamCaptureImplicit"
        return cudaErrorStreamCaptureImplicit
    cap = s.capture
    if cap is not None and cap.status == _STATUS_ACTIVE and not (_is_null(graph_out) and _is_null(dependencies_out)):
        # graph_out: "the graph being captured into", dependencies_out: "the array of nodes" the
        # next captured node will depend on.  The simulator has no graph or node objects until
        # cudaStreamEndCapture; it wrote NULL for both (and a count with no array), which a caller
        # would go on to use as a graph and a node array (r66c).  Not simulated: refused.
        return cudaErrorNotSupported
    _put(captureStatus_out, _STATUS_NONE if cap is None else cap.status, "int *")
    if cap is not None:
        if not _is_null(id_out):
            _put(id_out, cap.id, "unsigned long long *")
        if not _is_null(graph_out):
            _put_ptr(graph_out, _NULL)      # (invalidated: "valid data" only while active)
        if not _is_null(dependencies_out):
            _put_ptr(dependencies_out, _NULL)
        if not _is_null(edgeData_out):
            _put_ptr(edgeData_out, _NULL)
        if not _is_null(numDependencies_out):
            _put(numDependencies_out, len(cap.tails.get(s, ())), "size_t *")
    return cudaSuccess


def cudaStreamGetCaptureInfo_v2(R, stream, captureStatus_out, id_out, graph_out, dependencies_out,
                                numDependencies_out):
    """CUDA 12.x (what its headers call cudaStreamGetCaptureInfo): the outputs of the
    CUDA 13 call without edgeData.  Exported by the 12.x libraries only."""
    return cudaStreamGetCaptureInfo(R, stream, captureStatus_out, id_out, graph_out, dependencies_out,
                                    None, numDependencies_out)


def cudaThreadExchangeStreamCaptureMode(R, mode):
    if _is_null(mode):
        return cudaErrorInvalidValue
    try:
        new = mode[0]
    except TypeError:
        new = ffi.cast("int *", _addr(mode))[0]
    if new not in (_CAPTURE_GLOBAL, _CAPTURE_THREAD_LOCAL, _CAPTURE_RELAXED):
        return cudaErrorInvalidValue
    old = R.tls.capture_mode
    R.tls.capture_mode = new
    _put(mode, old, "int *")
    return cudaSuccess


def _launch_with_events(R: Runtime, x: GraphExec, s: Stream, freed: tuple = ()) -> int:
    """cudaGraphLaunch of a graph with event record / wait nodes, as stream operations in
    capture order: each record node records its event when the launch reaches it (timestamp
    and completion, cudaGraphAddEventRecordNode: "Each launch of the graph will record
    event"), each wait node waits for its event's record current at this launch (or for a
    record node earlier in the same launch, which stream order already covers).  Everything
    is checked before anything is queued, so a refused launch queues nothing."""
    if s.capture is not None:
        # Launching into a capture makes the graph a child graph node; what event nodes do
        # there the docs do not say (cudaGraphAddChildGraphNode lists only the node kinds it
        # refuses), so the simulator refuses it.
        _invalidate(R, s.capture)
        return cudaErrorStreamCaptureUnsupported
    steps = []
    recorded = set()
    for kind, arg in x.plan:
        if kind == "work":
            steps.append((kind, arg, None))
            continue
        if R.events.get(arg.handle) is not arg:
            # The node's event was destroyed (its handle may name another event by now): what
            # the launch would record or wait for the docs do not say, so it is refused.
            return cudaErrorInvalidResourceHandle
        if kind == "record":
            recorded.add(id(arg))
            steps.append((kind, arg, None))
            continue
        r = arg.rec
        if id(arg) in recorded or r is None:
            continue            # recorded earlier in this launch, or never: nothing more to wait for
        if r.cap is not None:
            if r.cap.ended:
                # The event was last recorded in a capture that has ended (it stands for a node of
                # that graph).  What an event wait node waits for then, the docs do not say
                # (cudaGraphAddEventWaitNode: "wait for all work captured in event"); a plain
                # cudaStreamWaitEvent on such an event is cudaErrorInvalidValue on an H200 (see
                # events._wait_captured_event).  r66c: the launch skipped the wait; refused the same
                # way now, nothing queued.
                return cudaErrorInvalidValue
            return cudaErrorCapturedEvent
        if r.q.done < r.seq:
            steps.append((kind, arg, (r.q, r.seq)))
    if s.legacy and R.captures:
        rc = _legacy_conflict(R, s.device)
        if rc:
            return rc
    deps = list(_implicit_deps(R, s)) if (s.legacy or s.blocking) else []
    deps += _after_previous_launch(x)
    q = s.q
    x.launches += 1
    for kind, arg, point in steps:
        if kind == "work":
            q.submit(_replay(arg, freed), deps, True)
        elif kind == "record":
            rec = Rec()
            rec.q = q
            rec.seq = q.submit(None if arg.flags & _EVENT_DISABLE_TIMING else rec.stamp, deps, False)
            arg.rec = rec
        else:
            q.submit(None, deps + [point], False)
        deps = []               # later steps follow the first in stream order
    x.last = (q, q.enqueued)
    return cudaSuccess


def _after_previous_launch(x: GraphExec) -> list:
    """cudaGraphLaunch: "Only one instance of graphExec may be executing at a time. Each launch
    is ordered behind both any previous work in stream and any previous launches of graphExec."
    The dependency on the latest launch (on whatever stream), while it has not run."""
    last = x.last
    if last is None or last[0].done >= last[1]:
        return []
    return [last]


def _stale_copy(R: Runtime, n: Node, s: Stream, also=()) -> bool:
    """Whether copy or memset node ``n`` touches cudaMallocAsync memory freed (cudaFreeAsync) or not
    yet made for work queued on ``s`` now (common._unmade); ``also``: the points its event wait
    ancestors wait for (:func:`_wait_points`)."""
    allocs = getattr(n.fn, "allocs", None) if n.kernel is None else None
    if not allocs:
        return False
    return any(_async_unusable(R, a, s, also) for a in allocs)


def _wait_points(R: Runtime, x: GraphExec) -> dict:
    """node id -> the (queue, seq) records that the event wait nodes it depends on (directly or
    through other nodes) wait for at a launch now.  cudaMallocAsync: "Stream query, stream
    synchronize, and CUDA events can be used to guarantee that the allocation operation completes
    before work submitted in a separate stream runs"; an event wait node (cudaGraphAddEventWaitNode,
    cudaEventWaitExternal in a capture) is such an event wait for the nodes after it, so a launch
    ordered after an allocation only through its own wait node is not refused (r65a: it was).  A
    wait for a record made by the same launch, or never made, adds nothing (as the launch itself)."""
    points, recorded = {}, set()
    for n in x.nodes:       # capture order: every dependency comes before its node
        mine = set()
        for d in n.deps:
            mine |= points.get(d, frozenset())
        if n.event is not None:
            if n.kind == "event_record":
                recorded.add(id(n.event))
            elif id(n.event) not in recorded:
                r = n.event.rec
                if r is not None and r.cap is None and r.q.done < r.seq:
                    mine.add((r.q, r.seq))
        points[n.id] = frozenset(mine)
    return points


def _replay(nodes: Sequence[Node], freed: tuple = ()):
    """One launch's run of ``nodes``; ``freed``: the memory cudaFreeAsync freed before the launch
    was queued, which its kernel nodes may not touch (common._freed_ranges)."""
    def run():
        delay = core.delay_s
        for i, node in enumerate(nodes):
            if node.fn is not None:
                if delay and i:
                    time.sleep(delay)
                if freed and node.kernel is not None:
                    node.fn(freed)
                else:
                    node.fn()
    return run


def cudaGraphInstantiate(R, pGraphExec, graph, flags=0):
    g = _lookup(R.graphs, graph)
    if g is None:
        return cudaErrorInvalidResourceHandle
    if _is_null(pGraphExec):
        return cudaErrorInvalidValue
    rc, em = _graph_mem_instantiate(R, g, flags)
    if rc:
        return rc
    x = GraphExec(R.new_handle(), g.nodes, g.device)
    if em is not None:
        _graph_mem_bind(R, x, em)
    Runtime.put(R.execs, x)
    _put_ptr(pGraphExec, x.key)
    return cudaSuccess


def cudaGraphInstantiateWithFlags(R, pGraphExec, graph, flags=0):
    return cudaGraphInstantiate(R, pGraphExec, graph, flags)


def cudaGraphLaunch(R, graphExec, stream):
    x = _lookup(R.execs, graphExec)
    s = _stream(R, stream)
    if x is None or s is None:
        return cudaErrorInvalidResourceHandle
    # CUDA Programming Guide, "Multi-Device System" (Stream and Event Behavior): a launch into a
    # stream not associated with the current device fails; a graph exec belongs to its device.
    if s.device != R.tls.device or x.device != s.device:
        return cudaErrorInvalidResourceHandle
    cap = s.capture
    if cap is not None:
        # A graph launched into a stream being captured: measured on an H200 (driver 580.159.04,
        # libcudart 13.0; tools/cuda_conformance.py, capture_graph_launch_inside) the launch returns
        # cudaErrorStreamCaptureUnsupported and the capture is invalidated.
        _invalidate(R, cap)
        return cudaErrorStreamCaptureUnsupported
    for lib in x.libraries:
        if lib.unloaded:
            # cudaLibraryUnload / cuModuleUnload (CUDA Runtime and Driver API): "Use of the handle
            # after this call is undefined behavior"; a graph still launching one of the module's
            # kernels would run freed code.  The docs name no error for it: the simulator refuses
            # the launch with the one an unknown kernel gets (cudaLaunchKernel).
            return cudaErrorInvalidDeviceFunction
    waits = _wait_points(R, x) if (R.making and x.plan is not None) else {}
    if R.making and any(n.kernel is not None and _unmade_pointers(R, n.fn.ptrs, s, waits.get(n.id, ()))
                        for n in x.nodes):
        # cudaMallocAsync: "The allocation must not be accessed until the allocation operation
        # completes": a kernel node is passed cudaMallocAsync memory whose allocation the launch's
        # stream is not ordered after (its order was not known at capture).  No code is
        # documented: refused (cudaErrorInvalidValue), as cudaLaunchKernel is, nothing queued.
        return cudaErrorInvalidValue
    if (R.making or R.freeing) and any(_stale_copy(R, n, s, waits.get(n.id, ())) for n in x.nodes):
        # A copy or memset node on cudaMallocAsync memory a cudaFreeAsync freed before this launch
        # ("accessing the memory from any subsequent work launched on the GPU ... results in
        # undefined behavior") or whose allocation this stream is not ordered after ("must not be
        # accessed until the allocation operation completes"): refused (cudaErrorInvalidValue), as
        # cudaMemcpyAsync / cudaMemsetAsync refuse them outside a graph, nothing queued.
        return cudaErrorInvalidValue
    em = R.gmem.execs.get(x) if R.gmem.execs else None
    if em is not None:
        rc, mapped = _graph_mem_before_launch(R, em, s)
        if rc:
            return rc
    freed = _freed_ranges(R) if R.freeing else ()
    if x.plan is not None:
        rc = _launch_with_events(R, x, s, freed)
    else:
        x.launches += 1
        rc, seq = _enqueue(R, s, _replay(x.nodes, freed), "graph", f"graph exec {x.handle:#x}",
                           after=_after_previous_launch(x))
        if seq:
            x.last = (s.q, seq)
    if em is not None:
        _graph_mem_after_launch(R, em, s, rc, mapped)
    return rc


def _graph_destroy_in_capture(R: Runtime) -> int:
    """cudaGraphExecDestroy / cudaGraphDestroy while a capture is underway.  The CUDA docs list
    neither among the calls prohibited during capture, but the driver refuses them: PyTorch
    PR 161037 ("Disable GC when capturing CUDA Graphs": destroying a graph while capturing
    another gives "operation not permitted when stream is capturing" from CUDAGraph::reset and
    breaks the capture), NVIDIA Warp issue 992 ("Deleting a CUDA graph breaks capture").
    Refused as the other potentially unsafe calls (900, capture invalidated; relaxed mode
    allows them)."""
    return _unsafe_call(R) if R.captures else cudaSuccess


def cudaGraphExecDestroy(R, graphExec):
    x = _lookup(R.execs, graphExec)
    if x is None:
        return cudaErrorInvalidResourceHandle
    rc = _graph_destroy_in_capture(R)
    if rc:
        return rc
    Runtime.drop(R.execs, x)
    em = R.gmem.execs.pop(x, None) if R.gmem.execs else None
    if em is not None:
        _graph_mem_exec_destroyed(R, em)
    return cudaSuccess


def cudaGraphDestroy(R, graph):
    g = _lookup(R.graphs, graph)
    if g is None:
        return cudaErrorInvalidResourceHandle
    rc = _graph_destroy_in_capture(R)
    if rc:
        return rc
    Runtime.drop(R.graphs, g)
    _graph_mem_graph_destroyed(R, g)
    return cudaSuccess


def cudaGraphGetNodes(R, graph, nodes, numNodes):
    g = _lookup(R.graphs, graph)
    if g is None:
        return cudaErrorInvalidResourceHandle
    if _is_null(numNodes):
        return cudaErrorInvalidValue
    if not _is_null(nodes):
        return cudaErrorInvalidValue    # node handles are not simulated; count only
    _put(numNodes, len(g.nodes), "size_t *")
    return cudaSuccess


def dot_text(g: Graph) -> str:
    """The DOT description cudaGraphDebugDotPrint writes for ``g``."""
    gid = f"graph_{g.capture_id}"
    lines = ["digraph dot {", f"subgraph cluster_{g.capture_id} {{",
             f'label="{gid}" graph[style="dashed"];']
    for n in g.nodes:
        label = f"{n.id}\\n{n.kind.upper()}\\n{n.label}"
        lines.append(f'"{gid}_node_{n.id}"[style="solid" shape="rectangle" label="{label}"];')
    for n in g.nodes:
        for d in n.deps:
            lines.append(f'"{gid}_node_{d}" -> "{gid}_node_{n.id}";')
    lines += ["}", "}", ""]
    return "\n".join(lines)


def cudaGraphDebugDotPrint(R, graph, path, flags):
    g = _lookup(R.graphs, graph)
    if g is None:
        return cudaErrorInvalidResourceHandle
    p = _c_string(path)
    if not p:
        return cudaErrorInvalidValue
    try:
        with open(p, "w") as f:
            f.write(dot_text(g))
    except OSError:
        return cudaErrorOperatingSystem
    return cudaSuccess

