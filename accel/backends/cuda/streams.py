"""Streams and events (a mixin of :class:`accel.backends.cuda.CudaBackend`).

Streams are non-blocking (cudaStreamCreateWithPriority); handle 0 is the legacy default stream
of the *current* device, shared by every device's default stream (``shared_default_stream``).
A foreign handle (torch's, CuPy's) is taken as it is, its device asked of cudaStreamGetDevice
where the runtime has it (12.8+); cudaStreamPerThread is refused, since it names another stream
in every thread.  Events are cudaEventCreateWithFlags; inside a capture an "external" record or
wait becomes an event record node or an external wait (cudaEventRecordExternal /
cudaEventWaitExternal, invalid outside a capture).  The handles made here keep their cdata in
``_handles`` (:mod:`.runtime`), read inline on the hot paths (query, record, memset).
"""

from __future__ import annotations

from typing import Optional, Tuple

# Integer #defines and cudaError_t values from driver_types.h (CUDA 13).
_STREAM_NON_BLOCKING = 0x01        # cudaStreamNonBlocking
_EVENT_BLOCKING_SYNC = 0x01        # cudaEventBlockingSync
_EVENT_DISABLE_TIMING = 0x02       # cudaEventDisableTiming
_EVENT_RECORD_EXTERNAL = 0x01      # cudaEventRecordExternal
_EVENT_WAIT_EXTERNAL = 0x01        # cudaEventWaitExternal
_ERR_NOT_READY = 600
_ERR_INVALID_RESOURCE_HANDLE = 400
# cudaStreamLegacy / cudaStreamPerThread (driver_types.h): aliases, not streams of their own
_STREAM_LEGACY, _STREAM_PER_THREAD = 1, 2


class CudaStreamsMixin:
    """Streams and events; state lives in ``CudaBackend.__init__``."""

    def stream_create(self, priority: int = 0) -> int:
        p = self.ffi.new("cudaStream_t *")
        self._check(self.lib.cudaStreamCreateWithPriority(p, _STREAM_NON_BLOCKING, priority),
                    "cudaStreamCreateWithPriority")
        handle = self._as_int(p[0])
        self._handles[handle] = p[0]
        return handle

    def stream_destroy(self, stream: int) -> None:
        self._check(self.lib.cudaStreamDestroy(self._cast("cudaStream_t", stream)), "cudaStreamDestroy")
        self._handles.pop(stream, None)

    def default_stream(self, index: int) -> int:
        return 0  # the legacy default stream; each device's is selected by the current device

    def foreign_stream(self, stream: int) -> Tuple[int, Optional[int]]:
        if stream in (0, _STREAM_LEGACY):
            return 0, None      # the legacy default stream of the current device, as handle 0
        if stream == _STREAM_PER_THREAD:
            raise ValueError("handle 2 is cudaStreamPerThread, which names another stream in every host "
                             "thread: accel keys cached memory and events by the handle value, so it cannot "
                             "wrap it; create a stream (accel.Stream()) or pass a created stream's handle")
        from ..._ffi import has_symbol
        if not has_symbol(self.lib, "cudaStreamGetDevice"):
            return stream, None     # before CUDA 12.8 the runtime cannot say (nor can torch)
        out = self.ffi.new("int *")
        rc = self.lib.cudaStreamGetDevice(self._cast("cudaStream_t", stream), out)
        if rc == _ERR_INVALID_RESOURCE_HANDLE:
            self.lib.cudaGetLastError()     # reported here: clear the thread's last-error slot
            raise ValueError(f"{stream:#x} is not a live CUDA stream (cudaStreamGetDevice: "
                             f"cudaErrorInvalidResourceHandle); pass the cudaStream_t of a stream that "
                             f"exists, and keep it alive while accel uses it")
        self._check(rc, "cudaStreamGetDevice")
        return stream, out[0]

    def stream_priority_range(self) -> Tuple[int, int]:
        least, greatest = self.ffi.new("int *"), self.ffi.new("int *")
        self._check(self.lib.cudaDeviceGetStreamPriorityRange(least, greatest),
                    "cudaDeviceGetStreamPriorityRange")
        return least[0], greatest[0]

    def stream_synchronize(self, stream: int) -> None:
        self._check(self.lib.cudaStreamSynchronize(self._cast("cudaStream_t", stream)),
                    "cudaStreamSynchronize")

    def stream_query(self, stream: int) -> bool:
        # Hot path (polled): the cached cdata read inline (_cast's lookup), _check only on failure.
        rc = self.lib.cudaStreamQuery(self._handles.get(stream) or self._cast("cudaStream_t", stream))
        if rc:
            if rc == _ERR_NOT_READY:
                return False
            self._check(rc, "cudaStreamQuery")
        return True

    def stream_wait_event(self, stream: int, event: int, external: bool = False) -> None:
        # As torch's CUDAEvent::block: cudaEventWaitExternal only while the stream captures
        # (cuda.h, CUevent_wait_flags: the flag "is invalid when used outside of capture").
        flags = _EVENT_WAIT_EXTERNAL if external and self.stream_is_capturing(stream) else 0
        self._check(self.lib.cudaStreamWaitEvent(self._cast("cudaStream_t", stream),
                                                 self._cast("cudaEvent_t", event), flags),
                    "cudaStreamWaitEvent")

    # -- events ----------------------------------------------------------------
    def event_create(self, enable_timing: bool = False, blocking: bool = False) -> int:
        flags = (0 if enable_timing else _EVENT_DISABLE_TIMING) | (_EVENT_BLOCKING_SYNC if blocking else 0)
        p = self.ffi.new("cudaEvent_t *")
        self._check(self.lib.cudaEventCreateWithFlags(p, flags), "cudaEventCreateWithFlags")
        handle = self._as_int(p[0])
        self._handles[handle] = p[0]
        return handle

    def event_destroy(self, event: int) -> None:
        self._check(self.lib.cudaEventDestroy(self._cast("cudaEvent_t", event)), "cudaEventDestroy")
        self._handles.pop(event, None)

    def event_record(self, event: int, stream: int, external: bool = False) -> None:
        if external and self.stream_is_capturing(stream):
            # An event record node (torch's CUDAEvent::record with external_): cuda.h,
            # CUevent_record_flags: cudaEventRecordExternal "is invalid when used outside of capture".
            self._check(self.lib.cudaEventRecordWithFlags(self._cast("cudaEvent_t", event),
                                                          self._cast("cudaStream_t", stream),
                                                          _EVENT_RECORD_EXTERNAL), "cudaEventRecordWithFlags")
            return
        # Hot path: the cached cdata read inline (_cast's lookup), _check only on failure.
        # (the legacy default stream, 0, is NULL with no _cast call: a record on the current stream)
        handles = self._handles
        rc = self.lib.cudaEventRecord(handles.get(event) or self._cast("cudaEvent_t", event),
                                      handles.get(stream) or (self._cast("cudaStream_t", stream) if stream
                                                              else self.ffi.NULL))
        if rc:
            self._check(rc, "cudaEventRecord")

    def event_synchronize(self, event: int) -> None:
        self._check(self.lib.cudaEventSynchronize(self._cast("cudaEvent_t", event)), "cudaEventSynchronize")

    def event_query(self, event: int) -> bool:
        rc = self.lib.cudaEventQuery(self._cast("cudaEvent_t", event))
        if rc == _ERR_NOT_READY:
            return False
        self._check(rc, "cudaEventQuery")
        return True

    def event_elapsed_ms(self, start: int, end: int) -> float:
        ms = self.ffi.new("float *")
        self._check(self.lib.cudaEventElapsedTime(ms, self._cast("cudaEvent_t", start),
                                                  self._cast("cudaEvent_t", end)), "cudaEventElapsedTime")
        return ms[0]
