"""Events and waits between streams: create, record (also into a capture), query, synchronize,
elapsed time, and cudaStreamWaitEvent (external waits and captured events included).
"""

from __future__ import annotations

from .state import (
    _EVENT_DISABLE_TIMING, _EVENT_INTERPROCESS, _EVENT_RECORD_EXTERNAL, _EVENT_WAIT_EXTERNAL,
    _STATUS_ACTIVE, _STATUS_INVALIDATED, Event, Rec, Runtime, Stream, cudaErrorCapturedEvent,
    cudaErrorIllegalState, cudaErrorInvalidResourceHandle, cudaErrorInvalidValue, cudaErrorNotReady,
    cudaErrorStreamCaptureImplicit, cudaErrorStreamCaptureInvalidated, cudaErrorStreamCaptureIsolation,
    cudaErrorStreamCaptureMerge, cudaErrorStreamCaptureUnsupported, cudaSuccess,
)
from .common import (
    _enqueue, _implicit_deps, _invalidate, _is_null, _legacy_conflict, _lookup, _put, _put_ptr, _stream,
    _unsafe_call,
)


def cudaStreamWaitEvent(R, stream, event, flags=0):
    s = _stream(R, stream)
    e = _lookup(R.events, event)
    if s is None or e is None:
        return cudaErrorInvalidResourceHandle
    if flags & ~_EVENT_WAIT_EXTERNAL:
        return cudaErrorInvalidValue
    if flags & _EVENT_WAIT_EXTERNAL:
        return _external_wait(R, s, e)
    r = e.rec
    if s.legacy and R.captures and (r is None or r.cap is None):
        # CUDA Programming Guide, "CUDA Graphs" > "Prohibited and Unhandled Operations": while a
        # blocking stream of the device captures, "any attempted use of the legacy stream is
        # invalid" -- a wait that is a no-op (the event never recorded, or its work already done)
        # included (r66c: those returned cudaSuccess).  (An event of a capture: below, 906 too.)
        rc = _legacy_conflict(R, s.device)
        if rc:
            return rc
    if r is None:
        return cudaSuccess      # never recorded: the wait is a no-op
    if r.cap is not None:
        return _wait_captured_event(R, s, r)
    cap = s.capture
    if cap is not None:
        if cap.status != _STATUS_ACTIVE:
            return cudaErrorStreamCaptureInvalidated
        # Guide, "Cross-stream Dependencies and Events": waiting on a non-captured event from a
        # capturing stream is invalid without cudaEventWaitExternal.
        _invalidate(R, cap)
        return cudaErrorStreamCaptureIsolation
    if r.q.done >= r.seq:
        return cudaSuccess      # already complete: nothing to wait for
    deps = list(_implicit_deps(R, s))
    deps.append((r.q, r.seq))
    s.q.submit(None, deps, work=False)
    return cudaSuccess


def _external_wait(R: Runtime, s: Stream, e: Event) -> int:
    """cudaStreamWaitEvent(stream, event, cudaEventWaitExternal): an event wait node.

    CUDA Runtime API, cudaStreamWaitEvent: "cudaEventWaitExternal: Event is captured in the
    graph as an external event node when performing stream capture"; cuda.h, CUevent_wait_flags:
    the flag "is invalid when used outside of capture".  The node waits, at each launch, for
    the event's record current at that launch (cudaGraphAddEventWaitNode: "The graph node will
    wait for all work captured in event"), whether or not the event was ever recorded when
    the wait was captured."""
    cap = s.capture
    if cap is None:
        # Outside capture: cudaErrorIllegalState, measured on an H100,
        # tests/conformance/cuda_h100_2026-12-05.json, scenario event_external_outside_capture
        # (driver 580.159.04, libcudart 13.0); the Runtime API names no code for it.
        return cudaErrorIllegalState
    r = e.rec
    if r is not None and r.cap is not None and not r.cap.ended:
        # The event was last recorded inside a capture underway (a capture-internal
        # dependency, Guide "Cross-stream Dependencies and Events"): what an event wait node on
        # it would wait for at launch the docs do not say, so the simulator refuses it.
        _invalidate(R, cap)
        return cudaErrorStreamCaptureUnsupported
    return _enqueue(R, s, None, "event_wait", f"event {e.handle:#x}", event=e)[0]


def _wait_captured_event(R: Runtime, s: Stream, r: Rec) -> int:
    cap = r.cap
    with R.clock:
        if cap.ended:
            # The event was last recorded in a capture that has ended: it stands for a graph node,
            # not for work on a stream (cudaErrorCapturedEvent: "The operation is not permitted on
            # an event which was last recorded in a capturing stream"; Programming Guide, "CUDA
            # Graphs" > "Cross-stream Dependencies and Events").  What waiting on it does is not
            # documented: refused (and a capture doing it is invalidated) until it is recorded again,
            # with the code an H200 returns (driver 580.159.04, libcudart 13.0;
            # tools/cuda_conformance.py, capture_wait_event_of_ended_capture).
            if s.capture is not None and not s.capture.ended:
                s.capture.status = _STATUS_INVALIDATED
            return cudaErrorInvalidValue
        if s.legacy:
            cap.status = _STATUS_INVALIDATED
            return cudaErrorStreamCaptureImplicit
        if s.capture is None:           # fork: s joins the capture
            s.capture = cap
            cap.tails[s] = tuple(r.nodes)
            return cudaSuccess
        if s.capture is not cap:
            s.capture.status = _STATUS_INVALIDATED
            cap.status = _STATUS_INVALIDATED
            return cudaErrorStreamCaptureMerge
        if cap.status != _STATUS_ACTIVE:
            return cudaErrorStreamCaptureInvalidated
        cap.tails[s] = tuple(sorted(set(cap.tails.get(s, ())) | set(r.nodes)))
        return cudaSuccess


# -- events --------------------------------------------------------------------------------

def cudaEventCreateWithFlags(R, event, flags):
    if _is_null(event) or flags & ~0x7 or (flags & _EVENT_INTERPROCESS and not flags & _EVENT_DISABLE_TIMING):
        return cudaErrorInvalidValue
    e = Event(R.new_handle(R.free_events), flags, R.tls.device)
    Runtime.put(R.events, e)
    _put_ptr(event, e.key)
    return cudaSuccess


def cudaEventCreate(R, event):
    return cudaEventCreateWithFlags(R, event, 0)


def cudaEventDestroy(R, event):
    e = _lookup(R.events, event)
    if e is None:
        return cudaErrorInvalidResourceHandle
    Runtime.drop(R.events, e)
    R.free_events.append(e.handle)
    return cudaSuccess


def cudaEventRecord(R, event, stream=None):
    e = _lookup(R.events, event)
    s = _stream(R, stream)
    if e is None or s is None or e.device != s.device:   # event and stream must share a context
        return cudaErrorInvalidResourceHandle
    rec = Rec()
    cap = s.capture
    if cap is not None:
        with R.clock:
            if cap.status != _STATUS_ACTIVE:
                return cudaErrorStreamCaptureInvalidated
            rec.cap = cap
            rec.nodes = cap.tails.get(s, ())
        e.rec = rec
        return cudaSuccess
    if s.legacy and R.captures:
        rc = _legacy_conflict(R, s.device)
        if rc:
            return rc
    q = s.q
    rec.q = q
    rec.seq = q.submit(None if e.flags & _EVENT_DISABLE_TIMING else rec.stamp,
                       _implicit_deps(R, s) if (s.legacy or s.blocking) else (), False)
    e.rec = rec
    return cudaSuccess


def cudaEventRecordWithFlags(R, event, stream=None, flags=0):
    """cudaEventRecordDefault records as cudaEventRecord; cudaEventRecordExternal during stream
    capture adds an event record node (CUDA Runtime API, cudaEventRecordWithFlags: "Event is
    captured in the graph as an external event node when performing stream capture") and
    leaves the event as it was: each launch of the graph records it (cudaGraphAddEventRecordNode:
    "Each launch of the graph will record event").  cuda.h, CUevent_record_flags: the flag "is
    invalid when used outside of capture"."""
    if flags & ~_EVENT_RECORD_EXTERNAL:
        return cudaErrorInvalidValue
    if not flags:
        return cudaEventRecord(R, event, stream)
    e = _lookup(R.events, event)
    s = _stream(R, stream)
    if e is None or s is None or e.device != s.device:   # event and stream must share a context
        return cudaErrorInvalidResourceHandle
    if s.capture is None:
        # cudaErrorIllegalState, measured on an H100, tests/conformance/cuda_h100_2026-12-05.json,
        # scenario event_external_outside_capture (driver 580.159.04, libcudart 13.0); the
        # Runtime API names no code for it.
        return cudaErrorIllegalState
    return _enqueue(R, s, None, "event_record", f"event {e.handle:#x}", event=e)[0]


def _captured_event(R: Runtime, r: Rec) -> int:
    if r.cap.ended:
        # An event last recorded in a capture that has ended: cudaErrorInvalidValue on an H200
        # (driver 580.159.04, libcudart 13.0; tools/cuda_conformance.py,
        # capture_wait_event_of_ended_capture), cudaErrorCapturedEvent while the capture is underway.
        return cudaErrorInvalidValue
    _invalidate(R, r.cap)
    return cudaErrorCapturedEvent


def cudaEventQuery(R, event):
    e = _lookup(R.events, event)
    if e is None:
        return cudaErrorInvalidResourceHandle
    r = e.rec
    if r is not None and r.cap is not None:
        return _captured_event(R, r)
    if R.captures:
        rc = _unsafe_call(R)
        if rc:
            return rc
    if r is None:
        return cudaSuccess
    if r.q.done < r.seq:
        return cudaErrorNotReady
    return R.sticky


def cudaEventSynchronize(R, event):
    e = _lookup(R.events, event)
    if e is None:
        return cudaErrorInvalidResourceHandle
    r = e.rec
    if r is not None and r.cap is not None:
        return _captured_event(R, r)
    if R.captures:
        rc = _unsafe_call(R)
        if rc:
            return rc
    if r is None:
        return cudaSuccess
    r.q.wait(r.seq)
    return R.sticky


def cudaEventElapsedTime(R, ms, start, end):
    a, b = _lookup(R.events, start), _lookup(R.events, end)
    if a is None or b is None:
        return cudaErrorInvalidResourceHandle
    if _is_null(ms):
        return cudaErrorInvalidValue
    # CUDA Programming Guide, "Multi-Device System": "cudaEventElapsedTime() will fail if the
    # two input events are associated to different devices."
    if (a.flags | b.flags) & _EVENT_DISABLE_TIMING or a.device != b.device:
        return cudaErrorInvalidResourceHandle
    ra, rb = a.rec, b.rec
    if ra is None or rb is None:
        return cudaErrorInvalidResourceHandle   # never recorded
    if ra.cap is not None or rb.cap is not None:
        return _captured_event(R, ra if ra.cap is not None else rb)
    if ra.q.done < ra.seq or rb.q.done < rb.seq:
        return cudaErrorNotReady
    _put(ms, (rb.ts - ra.ts) / 1e6, "float *")
    return cudaSuccess
