"""Events: ``MTLSharedEvent`` records, waits and queries; timing from command buffers.

* **Events.**  An ``MTLSharedEvent`` with a monotonically increasing value:
  record encodes ``encodeSignalEvent:value:`` (value+1) at the end of the
  stream's command buffer and commits it; another stream waits with
  ``encodeWaitForEvent:value:``; query compares ``signaledValue``;
  synchronize waits for the command buffer that carries the signal.
* **Timing.**  Metal has no timestamp at a point in a queue, only per command
  buffer ``GPUStartTime``/``GPUEndTime`` (seconds, one GPU clock).  A timing
  event's record ends the command buffer with a 4-byte fill of a scratch
  buffer (so the buffer always does GPU work and carries timestamps) and the
  event's time is that buffer's ``GPUEndTime``.  ``elapsed_ms`` is the
  difference, resolution as Metal reports it.
"""

from __future__ import annotations

from typing import Any, List, Optional

from ..._errors import AcceleratorError
from .._signals import deferred
from ._library import _CB_COMPLETED, _CB_ERROR, _LIBRARY, M_GPU_END, M_NEW_SHARED_EVENT, M_SIGNAL_EVENT, \
    M_SIGNALED_VALUE, M_STATUS, M_WAIT, _InvalidHandle
from .streams import _Committed


class _Event:
    __slots__ = ("handle", "shared", "value", "cb", "timing")

    def __init__(self, handle: int, shared: Any, timing: bool):
        self.handle = handle
        self.shared = shared        # MTLSharedEvent, owned (+1)
        self.value = 0              # value of the latest record; 0 = never recorded
        self.cb: Optional[_Committed] = None  # retained command buffer carrying the latest signal
        self.timing = timing


class EventsMixin:
    """Events (``_events``): record, wait (the stream side is in streams.py), query, elapsed time."""

    def _event(self, handle: int) -> _Event:
        ev = self._events.get(handle)
        if ev is None:
            raise self._missing("event", handle, "use a handle from event_create that was not destroyed")
        return ev

    @deferred
    def event_create(self, enable_timing: bool = False, blocking: bool = False) -> int:
        with self._lock:        # (as StreamsMixin.stream_create)
            self._runtime()
            h = self._handle()
            self._events[h] = _Event(h, self._new(self._device, M_NEW_SHARED_EVENT, "newSharedEvent"),
                                     bool(enable_timing))
        return h

    @deferred
    def event_destroy(self, event: int) -> None:
        rt = self._runtime()
        with self._lock:
            ev = self._event(event)
            del self._events[event]
            self._release_committed(ev.cb)
            rt.release(ev.shared)

    @deferred
    def event_record(self, event: int, stream: int) -> None:
        rt = self._runtime()
        with self._lock, rt.pool():
            ev = self._event(event)
            st = self._stream(stream)
            shared, value, fresh = ev.shared, ev.value, None
            if value and int(rt.send(shared, M_SIGNALED_VALUE)) < value:
                # The latest record is still pending.  A wait encoded for it waits until the
                # event's value "reaches value or higher" (MTLEvent.h), so this record's higher
                # value, signalled first from another stream, would end that wait before the work
                # it waits for (r63e): a new MTLSharedEvent carries this record instead.  The
                # command buffers that wait for or signal the old one retain it.
                fresh = self._new(self._device, M_NEW_SHARED_EVENT, "newSharedEvent")
                shared, value = fresh, 0
            try:
                cb = self._open_cb(st)
                if ev.timing:
                    # Give the command buffer GPU work of its own so it carries timestamps.
                    self._encode_fill(cb, self._scratch, 0, 4, 0)
                rt.send(cb, M_SIGNAL_EVENT, shared, value + 1)
                cmd = self._commit(st)
            except BaseException:
                if fresh is not None:
                    rt.release(fresh)
                raise
            rt.retain(cmd.obj)
            self._release_committed(ev.cb)
            if fresh is not None:
                rt.release(ev.shared)
            ev.shared, ev.value, ev.cb = shared, value + 1, cmd

    def event_synchronize(self, event: int) -> None:
        rt = self._runtime()
        held: List[_Committed] = []
        try:
            self._hold_event_cb(event, held)
            for cmd in held:
                rt.send(cmd.obj, M_WAIT)       # signals not deferred: Ctrl-C ends a long wait
                self._check_cb(cmd)
        finally:
            try:                               # as _sync_streams: again if a handler ran at its start
                self._let_go(held)
            except BaseException:
                self._let_go(held)
                raise

    @deferred
    def _hold_event_cb(self, event: int, held: List[_Committed]) -> None:
        """Append the event's latest command buffer, retained, to ``held`` (none if never recorded)."""
        with self._lock:
            cmd = self._event(event).cb
            if cmd is not None:
                self._rt.retain(cmd.obj)
                held.append(cmd)

    @deferred
    def _let_go(self, held: List[_Committed]) -> None:
        """Release what :meth:`_hold_event_cb` held; ``held`` is emptied (a second call does nothing)."""
        while held:
            self._rt.release(held.pop().obj)

    def event_query(self, event: int) -> bool:
        rt = self._runtime()
        with self._lock:
            ev = self._event(event)
            # A command buffer that failed has ended too (MTLCommandBufferStatusError is final);
            # its error is reported by synchronizing the event or the stream.
            return (ev.value == 0 or int(rt.send(ev.shared, M_SIGNALED_VALUE)) >= ev.value
                    or int(rt.send(ev.cb.obj, M_STATUS)) == _CB_ERROR)

    def event_elapsed_ms(self, start: int, end: int) -> float:
        """Milliseconds between the GPUEndTime of the command buffers ending at each record."""
        rt = self._runtime()
        with self._lock:
            a, b = self._event(start), self._event(end)
            for ev in (a, b):
                if not ev.timing:
                    raise _InvalidHandle(f"mps: event {ev.handle} was created without enable_timing; "
                                         f"create both events with enable_timing=True")
                if ev.cb is None:
                    raise _InvalidHandle(f"mps: event {ev.handle} has not been recorded")
            for ev in (a, b):
                status = int(rt.send(ev.cb.obj, M_STATUS))
                if status == _CB_ERROR:
                    raise AcceleratorError(
                        f"mps: the command buffer of event {ev.handle}'s latest record failed (its error is "
                        f"reported by synchronizing the event or its stream), so it has no GPU time; "
                        f"record it again", library=_LIBRARY, call="GPUEndTime")
                if status != _CB_COMPLETED:
                    raise AcceleratorError(
                        f"mps: event {ev.handle} has not completed; synchronize it before elapsed_time",
                        library=_LIBRARY, call="GPUEndTime", code=600, code_name="NotReady")
            t0 = float(rt.send(a.cb.obj, M_GPU_END))
            t1 = float(rt.send(b.cb.obj, M_GPU_END))
        return (t1 - t0) * 1000.0
