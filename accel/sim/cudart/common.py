"""What most calls share: writing through out-pointers, resolving stream and other handles,
the rules of stream capture every call obeys (potentially unsafe calls, implicit dependencies on
the legacy stream, invalidation), queueing work on a stream, and closing streams.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Tuple

from .. import _memory
from ..core import ffi
from .state import (
    _CAPTURE_GLOBAL, _CAPTURE_RELAXED, _CHARP, _LEGACY, _PER_THREAD, _STATUS_ACTIVE, _STATUS_INVALIDATED,
    _VOIDPP, Capture, Node, Runtime, Stream, _addr, cudaErrorStreamCaptureImplicit,
    cudaErrorStreamCaptureInvalidated, cudaErrorStreamCaptureUnsupported,
)


def _put_ptr(p, key) -> bool:
    """Write pointer/handle ``key`` (void* cdata) through out-pointer ``p``; False if p is NULL."""
    if p is None:
        return False
    try:
        p[0] = key
        return True
    except RuntimeError:    # cffi: "cannot dereference null pointer"
        return False
    except TypeError:
        a = _addr(p)
        if not a:
            return False
        ffi.cast(_VOIDPP, a)[0] = key
        return True


def _is_null(p) -> bool:
    return p is None or (p.__class__ is int and p == 0) or (p.__class__ is not int and p == ffi.NULL)


def _put(p, value, ctype="int *") -> None:
    try:
        p[0] = value
    except TypeError:
        ffi.cast(ctype, _addr(p))[0] = value


def _c_string(x) -> Optional[str]:
    if isinstance(x, bytes):
        return x.split(b"\0", 1)[0].decode()
    if isinstance(x, str):
        return x
    if _is_null(x):
        return None
    return ffi.string(ffi.cast(_CHARP, x)).decode()


def _stream(R: Runtime, x):
    try:
        s = R.streams.get(x)
    except TypeError:
        return None
    if s.__class__ is Stream:
        return s
    if s is _LEGACY:
        return R.devices[R.tls.device].legacy
    if s is _PER_THREAD:
        return _per_thread_stream(R)
    return None


class _PerThreadStreams(dict):
    """{device: Stream} of cudaStreamPerThread for one host thread.  When the thread exits its
    thread-local state goes, and these streams are handed to the runtime to close (a plain
    list.append: a finalizer must not take a lock the collecting thread may hold)."""

    __slots__ = ("dead",)

    def __init__(self, dead: list):
        super().__init__()
        self.dead = dead

    def __del__(self):
        self.dead.extend(self.values())


def _per_thread_stream(R: Runtime) -> Stream:
    tls = R.tls
    d = tls.device
    table = tls.per_thread
    if table is None:
        table = tls.per_thread = _PerThreadStreams(R.dead_per_thread)
    s = table.get(d)
    if s is None:
        if R.dead_per_thread:
            _sweep_finished_threads(R)
        s = Stream(R.new_handle(), d, 0, 0)
        s.q = R.engine.queue(f"cuda{d}-per-thread-{threading.get_ident():x}", s)
        dev = R.devices[d]
        with R.lock:
            dev.queues[s.q] = None
            dev.blocking.append(s)
        table[d] = s
    return s


def _lookup(table, x):
    try:
        return table.get(x)
    except TypeError:
        return None


# -- stream ordering and capture ------------------------------------------------------

def _implicit_deps(R: Runtime, s: Stream):
    """Legacy-stream semantics: the points a new operation on ``s`` must wait for."""
    if s.legacy:
        return [(b.q, b.q.enqueued) for b in R.devices[s.device].blocking if b.q.done < b.q.enqueued]
    if s.blocking:
        lq = R.devices[s.device].legacy.q
        if lq.done < lq.enqueued:
            return ((lq, lq.enqueued),)
    return ()


def _ordered_after(R: Runtime, s: Stream, point, also=()) -> bool:
    """Whether work queued on ``s`` now would run after ``point`` (queue, seq): the point is
    complete, or on ``s``'s queue, or a wait still pending on ``s`` (a cudaStreamWaitEvent, the
    legacy stream's implicit synchronization), directly or through other queues' pending waits,
    reaches it.  A pending operation's dependencies are all that can still hold it back: a point
    it depends on that completed cannot have depended on ``point``, which has not.  ``also``:
    more (queue, seq) points the work will wait for (r65a: the records a graph's event wait
    nodes wait for, cudaGraphAddEventWaitNode, which order the nodes depending on them)."""
    q0, seq0 = point
    if q0.done >= seq0 or s.q is q0:
        return True
    with R.engine.lock:
        # (r68j) Asked again under the lock, where the workers complete operations: the walk below
        # sees only pending operations, so a point and the waits ordering ``s`` after it that
        # completed since the check above (this thread preempted: heavy load) read as unordered,
        # and cudaFreeAsync was refused 1 after a cudaStreamWaitEvent (Runtime API: "Makes all
        # future work submitted to stream wait for all work captured in event") or beside the
        # legacy stream's implicit synchronization ("Stream synchronization behavior").  Under the
        # lock, a pending point's every pending successor is still queued (an operation completes
        # only after its dependencies, and under this lock).
        if q0.done >= seq0:
            return True
        todo = [(s.q, s.q.enqueued)] + list(_implicit_deps(R, s)) + list(also)
        seen: Dict[object, int] = {}
        while todo:
            q, k = todo.pop()
            if q is q0:
                if k >= seq0:
                    return True
                continue
            if q.done >= k or seen.get(q, 0) >= k:
                continue
            below = seen.get(q, 0)
            seen[q] = k
            for seq, _fn, deps, _work in q.ops:
                if below < seq <= k:
                    todo.extend(deps)
    return False


def _unmade(R: Runtime, a, s: Stream, also=()) -> bool:
    """Whether ``a`` is cudaMallocAsync memory that work queued on ``s`` now could touch before
    the allocating stream reaches the allocation.  CUDA Runtime API, cudaMallocAsync: "The
    allocation must not be accessed until the allocation operation completes"; "Stream query,
    stream synchronize, and CUDA events can be used to guarantee that the allocation operation
    completes before work submitted in a separate stream runs"."""
    if a is None or s.capture is not None:
        return False    # captured work runs at a graph launch: its order is not known here
    point = R.making.get(a.base)
    return point is not None and point[1] is not None and not _ordered_after(R, s, point, also)


def _async_unusable(R: Runtime, a, s: Stream, also=()) -> bool:
    """Whether work queued on ``s`` now may not touch allocation ``a`` (None: none): cudaMallocAsync
    memory a pending cudaFreeAsync freed (Runtime.freed_async), or not yet made (:func:`_unmade`)."""
    return a is not None and (R.freed_async(a) or (bool(R.making) and _unmade(R, a, s, also)))


def _unmade_pointers(R: Runtime, ptrs, s: Stream, also=()) -> bool:
    """Whether a kernel launched on ``s`` now with the pointer arguments ``ptrs`` would be handed
    cudaMallocAsync memory whose allocation ``s`` is not ordered after (:func:`_unmade`).  CUDA
    Runtime API, cudaMallocAsync: "The allocation must not be accessed until the allocation
    operation completes".  What such a launch does is not documented (the kernel would touch memory
    the pool may not have mapped yet): the simulator refuses it, cudaErrorInvalidValue, nothing
    queued.  Only the pointers the kernel is passed are seen (a pointer the kernel reads from
    memory is not)."""
    if not R.making or s.capture is not None:
        return False
    find = R.mem.find
    return any(p and _unmade(R, find(p), s, also) for p in ptrs)


def _freed_ranges(R: Runtime) -> tuple:
    """The [base, end) ranges of cudaMallocAsync memory a cudaFreeAsync freed that its stream has
    not reached yet (``R.freeing``), for work queued now.  CUDA Runtime API, cudaFreeAsync: "After
    this API returns, accessing the memory from any subsequent work launched on the GPU or querying
    its pointer attributes results in undefined behavior"; a kernel queued now that touches one of
    them faults (:func:`guard_freed`), whichever stream it runs on and whenever the free runs."""
    if not R.freeing:
        return ()
    while True:
        try:
            bases = tuple(R.freeing)
            break
        except RuntimeError:        # the set changed during the copy (a free ran): again
            continue
    out = []
    for b in bases:
        a = R.mem.by_key.get(b)
        if a is not None:           # (gone: the free ran; the memory is no allocation's any more)
            out.append((a.base, a.end))
    return tuple(out)


def guard_freed(view, freed: tuple, device: int):
    """``view`` (a kernel's view of memory) that faults on the ranges ``freed``
    (:func:`_freed_ranges` at the launch): cudaErrorIllegalAddress (700, sticky), as a device
    touching memory that is no longer allocated ("an invalid memory address")."""
    from .. import kernels
    addr_of = _memory.addr_of

    def v(ptr, nbytes, dtype=None):
        addr = addr_of(ptr)
        for b, e in freed:
            if addr < e and b < addr + max(nbytes, 1):
                raise kernels.MemoryRangeError(
                    f"a kernel on device {device} touched 0x{addr:x}, memory a cudaFreeAsync freed before "
                    f"the kernel was launched (cudaFreeAsync: \"accessing the memory from any subsequent work "
                    f"launched on the GPU ... results in undefined behavior\")")
        return view(ptr, nbytes, dtype)
    return v


def _blocks_legacy(cap: Capture, device: int) -> bool:
    """Whether capture ``cap`` holds a blocking stream of ``device`` (its origin, or a stream of
    any device that joined it by waiting on one of its events).  CUDA Programming Guide, "CUDA
    Graphs" > "Prohibited and Unhandled Operations": "When any stream in the same context is being
    captured, and it was not created with cudaStreamNonBlocking, any attempted use of the legacy
    stream is invalid.  This is because the legacy stream handle at all times encompasses these
    other streams".  The context is the stream's device, not the capture's origin (r66c: a blocking
    stream of device 1 joined to a capture begun on device 0 left device 1's legacy stream usable,
    and made device 0's legacy stream unusable though it does not encompass it)."""
    return any(st.blocking and st.device == device for st in list(cap.tails))


def _legacy_conflict(R: Runtime, device: int) -> int:
    """Using the legacy stream while a blocking stream of its device captures is
    invalid (it would depend on the capture): invalidate those captures
    (cudaErrorStreamCaptureImplicit; :func:`_blocks_legacy`)."""
    rc = 0
    with R.clock:
        for cap in list(R.captures):
            if _blocks_legacy(cap, device):
                cap.status = _STATUS_INVALIDATED
                rc = cudaErrorStreamCaptureImplicit
    return rc


def _legacy_captured(R: Runtime, device: int) -> bool:
    """Whether a capture underway holds a blocking stream of ``device`` (a query of the legacy
    stream then returns cudaErrorStreamCaptureImplicit: cudaStreamIsCapturing,
    cudaStreamGetCaptureInfo)."""
    return any(_blocks_legacy(c, device) for c in list(R.captures))


def _unsafe_call(R: Runtime) -> int:
    """0, or cudaErrorStreamCaptureUnsupported after invalidating the captures that prohibit
    a "potentially unsafe" call by this thread now.

    CUDA Runtime API, cudaStreamBeginCapture / cudaThreadExchangeStreamCaptureMode: in global
    mode (the default), a thread with an ongoing non-relaxed capture of its own, or while any
    other thread has a global-mode capture underway, is prohibited from potentially unsafe
    calls; thread-local mode ignores other threads' captures; relaxed mode allows them.  The
    unsafe calls (CUDA Programming Guide, "CUDA Graphs" > "Prohibited and Unhandled
    Operations"; torch's allocator relies on this list): cudaMalloc/cudaHostAlloc/cudaFree/
    cudaFreeHost, cudaEventQuery/cudaEventSynchronize of any event, cudaStreamQuery/
    cudaStreamSynchronize of streams not being captured, cudaDeviceSynchronize, and
    synchronous cudaMemcpy/cudaMemset.  A prohibited call fails and invalidates the capture
    (cudaStreamEndCapture then returns cudaErrorStreamCaptureInvalidated)."""
    mode = R.tls.capture_mode
    if mode == _CAPTURE_RELAXED:
        return 0
    me = threading.get_ident()
    rc = 0
    with R.clock:
        for cap in list(R.captures):
            if cap.thread == me:
                hit = cap.mode != _CAPTURE_RELAXED
            else:
                hit = mode == _CAPTURE_GLOBAL and cap.mode == _CAPTURE_GLOBAL
            if hit:
                cap.status = _STATUS_INVALIDATED
                rc = cudaErrorStreamCaptureUnsupported
    return rc


def _invalidate(R: Runtime, cap: Optional[Capture]) -> None:
    if cap is not None and not cap.ended:
        with R.clock:
            cap.status = _STATUS_INVALIDATED


def _enqueue(R: Runtime, s: Stream, fn, kind: str, label: str, work: bool = True, event=None, kernel=None,
             after=()):
    """Run ``fn`` in stream order on ``s`` (or record it, if ``s`` is capturing), and after the
    points ``after`` (of other queues).  Returns (rc, seq); seq is 0 for captured or failed
    operations."""
    cap = s.capture
    if cap is not None:
        with R.clock:
            if cap.status != _STATUS_ACTIVE:
                return cudaErrorStreamCaptureInvalidated, 0
            node = Node(len(cap.nodes), kind, label, fn, cap.tails.get(s, ()), event, kernel)
            cap.nodes.append(node)
            cap.tails[s] = (node.id,)
        return 0, 0
    if s.legacy and R.captures:
        rc = _legacy_conflict(R, s.device)
        if rc:
            return rc, 0
    deps = _implicit_deps(R, s) if (s.legacy or s.blocking) else ()
    return 0, s.q.submit(fn, list(deps) + list(after) if after else deps, work)


def _wait_device(R: Runtime, device: int) -> None:
    for q in list(R.devices[device].queues):
        if q.done < q.enqueued:
            q.wait()


def _device_captures(R: Runtime, device: int) -> List[Capture]:
    """The captures underway with a stream of ``device`` (begun there, or joined by one of its
    streams).  CUDA Programming Guide, "CUDA Graphs" > "Prohibited and Unhandled Operations": "It
    is also invalid to query the execution status of or synchronize a broader handle which
    encompasses an active stream capture, such as a device or context handle when any associated
    stream is in capture mode" (r66c: only captures begun on ``device`` were counted)."""
    return [c for c in list(R.captures) if c.device == device or any(st.device == device for st in list(c.tails))]


# -- error names ---------------------------------------------------------------------

_strings: Dict[Tuple[str, int], object] = {}


def _cstr(kind: str, code: int, text: str):
    key = (kind, code)
    c = _strings.get(key)
    if c is None:
        c = _strings.setdefault(key, ffi.new("char[]", text.encode()))
    return c


def _destroy_stream(R: Runtime, s: Stream) -> None:
    Runtime.drop(R.streams, s)
    R.free_streams.append(s.handle)
    _close_stream(R, s)


def _close_stream(R: Runtime, s: Stream) -> None:
    s.destroyed = True
    if s.capture is not None:
        _invalidate(R, s.capture)
    with R.lock:
        # r67c: a blocking stream stays among the device's blocking streams until its queued work
        # has run (Runtime._on_retire forgets it then; at once when nothing is queued).  CUDA
        # Runtime API, cudaStreamDestroy: "In case the device is still doing work in the stream
        # stream when cudaStreamDestroy() is called, the function will return immediately and the
        # resources associated with stream will be released automatically once the device has
        # completed all work in stream"; "Stream synchronization behavior": the legacy default
        # stream "synchronizes with all other streams in the same CUcontext except for non-blocking
        # streams".  That work is still the context's, so the legacy stream (its operations,
        # cudaStreamQuery, cudaStreamSynchronize) waits for it; before, it overtook the work.
        R.engine.close(s.q)     # queued work still runs; then the engine and device forget it


def _sweep_finished_threads(R: Runtime) -> None:
    """Close the per-thread default streams of threads that have exited (queued by
    _PerThreadStreams.__del__, which takes no lock), so they leave every table."""
    dead = R.dead_per_thread
    while dead:
        try:
            s = dead.pop()
        except IndexError:
            break
        _close_stream(R, s)
