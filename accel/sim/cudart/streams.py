"""Streams: create (flags, priority), destroy, query, synchronize, and their attributes.
"""

from __future__ import annotations

from .. import _engine
from .state import (
    _PRIORITY_GREATEST, _PRIORITY_LEAST, _STREAM_NON_BLOCKING, Runtime, Stream,
    cudaErrorInvalidResourceHandle, cudaErrorInvalidValue, cudaErrorNotReady,
    cudaErrorStreamCaptureUnsupported, cudaSuccess,
)
from .common import (
    _destroy_stream, _invalidate, _is_null, _legacy_conflict, _lookup, _put, _put_ptr, _stream,
    _sweep_finished_threads, _unsafe_call,
)


# -- streams -------------------------------------------------------------------------------

def cudaStreamCreateWithPriority(R, pStream, flags, priority):
    if _is_null(pStream) or flags & ~_STREAM_NON_BLOCKING:
        return cudaErrorInvalidValue
    if R.dead_per_thread:
        _sweep_finished_threads(R)
    d = R.tls.device
    priority = min(_PRIORITY_LEAST, max(_PRIORITY_GREATEST, priority))
    s = Stream(R.new_handle(R.free_streams), d, flags, priority)
    s.q = R.engine.queue(f"cuda{d}-stream-{s.handle:#x}", s)
    dev = R.devices[d]
    with R.lock:
        dev.queues[s.q] = None
        if s.blocking:
            dev.blocking.append(s)
    Runtime.put(R.streams, s)
    _put_ptr(pStream, s.key)
    return cudaSuccess


def cudaStreamCreateWithFlags(R, pStream, flags):
    return cudaStreamCreateWithPriority(R, pStream, flags, 0)


def cudaStreamCreate(R, pStream):
    return cudaStreamCreateWithPriority(R, pStream, 0, 0)


def cudaStreamDestroy(R, stream):
    s = _lookup(R.streams, stream)
    if s.__class__ is not Stream:
        return cudaErrorInvalidResourceHandle
    if s.capture is not None:
        # CUDA Runtime API, cudaStreamDestroy, says nothing of a stream taking part in a capture;
        # destroyed, the capture could never be ended on it (cudaStreamBeginCapture: "Capture must
        # be ended on the same stream in which it was initiated") and would prohibit unsafe calls
        # for good.  Refused: the operation is not permitted while the stream is capturing
        # (cudaErrorStreamCaptureUnsupported), and the capture is invalidated.
        _invalidate(R, s.capture)
        return cudaErrorStreamCaptureUnsupported
    _destroy_stream(R, s)
    return cudaSuccess


def cudaStreamQuery(R, stream):
    s = _stream(R, stream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    if s.capture is not None:
        _invalidate(R, s.capture)
        return cudaErrorStreamCaptureUnsupported
    if R.captures:
        rc = _unsafe_call(R) or (_legacy_conflict(R, s.device) if s.legacy else 0)
        if rc:
            return rc
    q = s.q
    if q.done < q.enqueued:
        return cudaErrorNotReady
    if s.legacy:    # the legacy stream encompasses the device's blocking streams
        for b in R.devices[s.device].blocking:
            if b.q.done < b.q.enqueued:
                return cudaErrorNotReady
    return R.sticky


def cudaStreamSynchronize(R, stream):
    s = _stream(R, stream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    if s.capture is not None:
        _invalidate(R, s.capture)
        return cudaErrorStreamCaptureUnsupported
    if R.captures:
        rc = _unsafe_call(R) or (_legacy_conflict(R, s.device) if s.legacy else 0)
        if rc:
            return rc
    if s.legacy:
        _engine.wait_points([(b.q, b.q.enqueued) for b in R.devices[s.device].blocking])
    s.q.wait()
    return R.sticky


def cudaStreamGetPriority(R, hStream, priority):
    s = _stream(R, hStream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    if _is_null(priority):
        # (r69d) CUDA Runtime API, cudaStreamGetPriority / cudaStreamGetFlags / cudaStreamGetDevice:
        # the out-pointer receives the answer; the pages list cudaErrorInvalidValue among the
        # returns.  A NULL one raised a Python RuntimeError out of the library before r69d.
        return cudaErrorInvalidValue
    _put(priority, s.priority)
    return cudaSuccess


def cudaStreamGetFlags(R, hStream, flags):
    s = _stream(R, hStream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    if _is_null(flags):
        return cudaErrorInvalidValue        # (r69d: see cudaStreamGetPriority)
    _put(flags, s.flags, "unsigned int *")
    return cudaSuccess


def cudaStreamGetDevice(R, hStream, device):
    s = _stream(R, hStream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    if _is_null(device):
        return cudaErrorInvalidValue        # (r69d: see cudaStreamGetPriority)
    _put(device, s.device)
    return cudaSuccess
