"""Streams: command queues, their open command buffers, commits, and synchronization.

* **Streams.**  One ``MTLCommandQueue`` per stream (handle 0 is the default
  queue, created at init).  Each stream has one open command buffer that
  collects work; it is committed at every point where the host or another
  stream can observe progress: stream synchronize/query, event record,
  device synchronize, and after ``_MAX_OPS`` commands so long asynchronous
  sequences start running.  Command buffers within a queue, and encoders
  within a command buffer, are ordered by Metal's hazard tracking (the
  buffers are created with the default, tracked, hazard mode).
* **Errors**: a command buffer that ends in ``MTLCommandBufferStatusError`` is reported once,
  by the first call that sees it (a query, a synchronize, an event's synchronize).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from ..._errors import AcceleratorError
from .._signals import deferred
from ._library import _CB_COMPLETED, _CB_ERROR, _CB_ERRORS, _LIBRARY, M_COMMAND_BUFFER, M_COMMIT, M_ERROR, \
    M_NEW_QUEUE, M_STATUS, M_WAIT, M_WAIT_EVENT

_MAX_OPS = 64          # commit a stream's open command buffer after this many commands


class _Committed:
    """A committed MTLCommandBuffer the backend tracks, and whether its failure was reported.

    Each holder (a stream's in-flight list, an event's latest record, a synchronize waiting on
    it) retains ``obj`` once and releases it once; the holders share this record, so a buffer
    that ended in MTLCommandBufferStatusError is reported to the user once, by the first call
    that sees it (stream_query, a synchronize, event_synchronize), and not again by later ones.
    """

    __slots__ = ("obj", "reported")

    def __init__(self, obj: Any):
        self.obj = obj
        self.reported = False


class _Stream:
    __slots__ = ("handle", "queue", "cb", "ops", "inflight")

    def __init__(self, handle: int, queue: Any):
        self.handle = handle
        self.queue = queue          # MTLCommandQueue, owned (+1)
        self.cb = None              # open MTLCommandBuffer, retained; None when nothing pending
        self.ops = 0                # commands encoded into cb
        self.inflight: List[_Committed] = []  # committed, retained, not yet known complete


class StreamsMixin:
    """Streams (``_streams``, ``_orphans``): command buffers, commits, waits, ``device_synchronize``."""

    def device_synchronize(self) -> None:
        self._runtime()
        with self._lock:
            streams = list(self._streams.values())
            if self._orphans.inflight:
                streams.append(self._orphans)
        self._sync_streams(streams)

    def _stream(self, handle: int) -> _Stream:
        st = self._streams.get(handle)
        if st is None:
            if not isinstance(handle, int) or isinstance(handle, bool):
                raise TypeError(f"stream handle must be an int, got {type(handle).__name__}")
            raise self._missing("stream", handle, "use a handle from stream_create or default_stream(0)")
        return st

    def _open_cb(self, st: _Stream) -> Any:
        """The stream's open command buffer (created and retained on first use)."""
        if st.cb is None:
            st.cb = self._new(st.queue, M_COMMAND_BUFFER, "commandBuffer")
            st.ops = 0
        return st.cb

    def _encoded(self, st: _Stream) -> None:
        st.ops += 1
        if st.ops >= _MAX_OPS:
            self._commit(st)

    def _commit(self, st: _Stream) -> Optional[_Committed]:
        """Commit the open command buffer; returns it (still retained, now in flight)."""
        cb = st.cb
        if cb is None:
            return None
        # Interrupt safety: a signal's handler (Ctrl-C) runs as commit returns, the buffer then
        # committed; so it is no longer the open buffer before the call, and is in flight after.
        st.cb = None
        try:
            self._rt.send(cb, M_COMMIT)
        except Exception:
            st.cb = cb              # refused: still the open buffer
            raise
        except BaseException:
            st.inflight.append(_Committed(cb))
            raise
        # Forget buffers already known complete (or failed and reported) so the list stays short.
        cmd = _Committed(cb)
        st.inflight = self._still_running(st.inflight) + [cmd]
        return cmd

    def _still_running(self, cmds: List[_Committed]) -> List[_Committed]:
        """``cmds`` less those complete or failed and reported, which are released."""
        keep = []
        for cmd in cmds:
            status = int(self._rt.send(cmd.obj, M_STATUS))
            if status == _CB_COMPLETED or (status == _CB_ERROR and cmd.reported):
                self._rt.release(cmd.obj)
            else:
                keep.append(cmd)
        return keep

    def _release_committed(self, cmd: Optional[_Committed]) -> None:
        if cmd is not None:
            self._rt.release(cmd.obj)

    def _check_cb(self, cmd: _Committed) -> None:
        """Raise the error of a command buffer that failed, unless it was reported already."""
        rt = self._rt
        if cmd.reported or int(rt.send(cmd.obj, M_STATUS)) != _CB_ERROR:
            return
        with rt.pool():
            code, text = rt.error_text(rt.send(cmd.obj, M_ERROR))
        with self._lock:
            if cmd.reported:
                return   # another thread's call reported it meanwhile
            cmd.reported = True
        raise AcceleratorError.from_call(_LIBRARY, "MTLCommandBuffer", code,
                                         _CB_ERRORS.get(code, "MTLCommandBufferError"), text)

    def _sync_streams(self, streams: List[_Stream]) -> None:
        waits: List[Tuple[_Stream, List[_Committed]]] = []  # each listed buffer retained here
        waited: set = set()
        error = None
        try:
            self._take_waits(streams, waits)
            for st, cmds in waits:
                for cmd in cmds:
                    self._rt.send(cmd.obj, M_WAIT)   # signals not deferred: Ctrl-C ends a long wait
                    waited.add(id(cmd))
                    if error is None:          # one error per call; a later one stays for its event
                        try:
                            self._check_cb(cmd)
                        except AcceleratorError as exc:
                            error = exc
        finally:
            # On every path (an error, or a KeyboardInterrupt when a wait returns): the buffers
            # waited for leave the stream's list, and every retain taken above is given back.
            # A handler can run as _release_waits starts (before it defers signals): then it is
            # called again, as it does nothing twice.
            try:
                self._release_waits(waits, waited)
            except BaseException:
                self._release_waits(waits, waited)
                raise
        if error is not None:
            raise error

    @deferred
    def _take_waits(self, streams: List[_Stream], waits: List[Tuple[_Stream, List[_Committed]]]) -> None:
        """Commit each stream's open buffer; append (stream, its in-flight buffers, each retained)
        to ``waits`` (filled in place: a handler run as this returns loses no retain)."""
        rt = self._rt
        with self._lock, rt.pool():
            for st in streams:
                self._commit(st)
                cmds: List[_Committed] = []
                waits.append((st, cmds))
                for cmd in st.inflight:
                    rt.retain(cmd.obj)
                    cmds.append(cmd)

    @deferred
    def _release_waits(self, waits: List[Tuple[_Stream, List[_Committed]]], waited: set) -> None:
        """Undo :meth:`_take_waits`; ``waits`` is emptied, so a second call does nothing."""
        rt = self._rt
        with self._lock:
            while waits:
                st, cmds = waits.pop()
                remaining = []
                for cmd in st.inflight:
                    if id(cmd) in waited:
                        rt.release(cmd.obj)
                    else:
                        remaining.append(cmd)
                st.inflight = remaining
                for cmd in cmds:
                    rt.release(cmd.obj)

    @deferred
    def stream_create(self, priority: int = 0) -> int:
        with self._lock:        # the device is not released meanwhile (see DiscoveryMixin.properties)
            self._runtime()
            h = self._handle()
            self._streams[h] = _Stream(h, self._new(self._device, M_NEW_QUEUE, "newCommandQueue"))
        return h

    def foreign_stream(self, stream: int) -> Tuple[int, Optional[int]]:
        self._runtime()
        with self._lock:
            known = stream in self._streams
        if not known:
            raise ValueError(f"mps: {stream!r} is not a live stream of accel's Metal backend: its handles "
                             f"name command queues accel keeps, so it can wrap only the ones it created "
                             f"(backend.stream_create, default_stream)")
        return stream, 0

    @deferred
    def stream_destroy(self, stream: int) -> None:
        """Commit what is queued and drop the queue; committed work still completes (as CUDA)."""
        rt = self._runtime()
        if stream == 0:
            raise ValueError("mps: the default stream (0) cannot be destroyed")
        with self._lock:
            st = self._stream(stream)
            self._commit(st)
            del self._streams[stream]
            # Emptied, not just released: a synchronize of this stream waiting in another thread
            # releases what is still listed here when its wait ends (a double release otherwise).
            # The buffers still running move to the orphans, for device_synchronize to wait on.
            inflight, st.inflight = st.inflight, []
            self._orphans.inflight = self._still_running(self._orphans.inflight + inflight)
            rt.release(st.queue)

    def default_stream(self, index: int) -> int:
        self._check_index(index)
        return 0

    def stream_synchronize(self, stream: int) -> None:
        self._runtime()
        with self._lock:
            st = self._stream(stream)
        self._sync_streams([st])

    @deferred
    def stream_query(self, stream: int) -> bool:
        rt = self._runtime()
        with self._lock:
            st = self._stream(stream)
            self._commit(st)
            pending, error = [], None
            for cmd in st.inflight:
                status = int(rt.send(cmd.obj, M_STATUS))
                if status in (_CB_COMPLETED, _CB_ERROR):
                    if status == _CB_ERROR and error is None:
                        # Report it now (unless reported already), as cudaStreamQuery returns the
                        # stream's error: the buffer is forgotten here, so a later synchronize
                        # could not report it.
                        try:
                            self._check_cb(cmd)
                        except AcceleratorError as exc:
                            error = exc
                    rt.release(cmd.obj)
                else:
                    pending.append(cmd)
            st.inflight = pending
            if error is not None:
                raise error
            return not pending

    @deferred
    def stream_idle(self, stream: int) -> bool:
        """Whether every command buffer of ``stream`` has ended (completed or failed), reporting
        nothing: stream_query reports a failed buffer and forgets it, so a close that asked it
        lost the error its synchronize (or, after the destroy, the device's) would have raised."""
        rt = self._runtime()
        with self._lock:
            st = self._stream(stream)
            self._commit(st)
            return all(int(rt.send(cmd.obj, M_STATUS)) in (_CB_COMPLETED, _CB_ERROR) for cmd in st.inflight)

    @deferred
    def stream_wait_event(self, stream: int, event: int) -> None:
        rt = self._runtime()
        with self._lock, rt.pool():
            st = self._stream(stream)
            ev = self._event(event)
            if ev.value == 0:
                return  # never recorded: nothing to wait for (as cudaStreamWaitEvent)
            rt.send(self._open_cb(st), M_WAIT_EVENT, ev.shared, ev.value)
            self._encoded(st)
