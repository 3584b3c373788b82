"""The :class:`Event` class: a marker in a stream's work, created on its first record, and the
external events a capture underway records or waits on (``_capture_events``, which the graph
that ends the capture keeps alive)."""

from __future__ import annotations

import sys
from typing import Dict, Optional

from .. import _finalize as _fin
from .. import _lazy, _locks
from .. import backends as _backends
from .._copying import refuse_copies as _refuse_copies
from .._device import DeviceLike, check_range, device
from .._errors import CaptureError, InvalidDeviceError
from ..backends._signals import deferred as _signals_deferred
from ..backends.base import Backend
from ._state import _capture_events
from .destroy import _event_destroy
from .uses import _close_lock, _close_release, _closed_during_use, _Use

#: Serializes an Event's first record (which creates its device event); held across
#: event_create, inside which a collection may run a user's __del__ that records an Event (r68i:
#: it waited on this lock, held by its own thread): accel._locks.Lock refuses that instead.
_create_lock = _locks.Lock("an Event's first record")


#: An event used with a stream or event of another device raises InvalidDeviceError (torch:
#: RuntimeError; accel before: ValueError; the class is both).  The old private name is kept.
_DeviceMismatchError = InvalidDeviceError


@_refuse_copies("share the Event object itself, or create and record a new Event")
class Event:
    """A marker in a stream's work, for ordering streams and timing.

    ``Event(device=None, *, enable_timing=False, blocking=False, interprocess=False,
    external=False)`` as ``torch.Event``: ``device`` (None: the current accelerator) only
    names the accelerator type, as torch's; the device handle is created at the first
    :meth:`record`, on the recording stream's device, and :attr:`handle` is 0 until then.
    An event never recorded counts as complete (``query()`` True, ``synchronize()`` and
    ``wait()`` return at once), as in torch.  ``interprocess=True`` raises
    NotImplementedError: accel shares no event between processes.

    ``external=True`` (CUDA only, as torch.cuda.Event): recorded or waited on while the stream
    is being captured into a graph, the event becomes an event record (wait) node of the graph
    instead of a dependency inside the capture (cudaEventRecordExternal / cudaEventWaitExternal).
    The capture leaves the event as it was; every replay records it again when it reaches the
    node, so ``start.elapsed_time(end)`` after ``g.replay(); end.synchronize()`` times that
    replay's work between the two records, and a wait node waits for the event's record
    current at each replay (by another stream or another graph's replay).  Outside capture the
    flag changes nothing.  The graph keeps the events of its nodes alive; closing one makes
    later replays raise.  Querying or synchronizing any event while a capture is underway
    follows CUDA's rule (an error that invalidates the capture, except in relaxed mode).
    On XPU (Level Zero, whose captures record no events) and MPS (no capture) construction
    raises NotImplementedError naming the backend, so code written for CUDA fails early.
    """

    __slots__ = ("_backend", "_index", "_handle", "enable_timing", "blocking", "external", "_recorded",
                 "_capture", "_closed", "_pid", "_type", "_late", "_busy", "_releases", "_own", "__weakref__")

    def __init__(self, device: DeviceLike = None, *, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, external: bool = False):
        self._handle = None     # __del__ reads it even when a check below raises
        self._own = None        # (key, token) of the destroy's registration (accel._finalize, r53)
        self._busy, self._releases = [], []     # see _Use
        for name, value in (("enable_timing", enable_timing), ("blocking", blocking),
                            ("interprocess", interprocess), ("external", external)):
            _check_flag(name, value)
        self._type = _event_type(device)
        if interprocess:
            raise _no_interprocess("Event(interprocess=True)")
        if external:
            _check_external(_backends.fallback())
        if _fin.pending:
            _fin.drain()
        self._pid = _fin.pid
        self.enable_timing = bool(enable_timing)
        self.blocking = bool(blocking)
        self.external = bool(external)
        self._backend = None
        self._index = None
        self._recorded = False
        self._capture = None    # the accel.Graph capture the last record was part of, if any
        self._closed = False

    def __repr__(self):
        where = f" device={self._backend.name}:{self._index}" if self._backend is not None else ""
        closed = " closed" if self._closed else ""
        return f"<accel.Event{where} recorded={self._recorded} timing={self.enable_timing}{closed}>"

    @property
    def device(self) -> Optional[device]:
        """The recording stream's device once recorded; before, the accelerator type with no
        index (torch's), or None when no accelerator was found at construction."""
        if self._backend is not None:
            return device(self._backend.name, self._index)
        return device(self._type) if self._type is not None else None

    @property
    def handle(self) -> int:
        """The backend's event handle as an int (CUDA: the ``cudaEvent_t`` value); 0 before the
        first :meth:`record`, as torch's ``event_id`` / ``cuda_event``.  RuntimeError once
        closed, as :attr:`Stream.handle`: the driver gives the value to the next event it makes."""
        if self._closed:
            self._live()
        return self._handle if self._handle is not None else 0

    event_id = property(handle.fget, doc="torch.Event's name for :attr:`handle` (0 before the first record).")

    def _live(self) -> None:
        if self._pid != _fin.pid:
            raise _fin.forked_error(self._backend)
        if self._closed:
            raise RuntimeError(f"{self!r} was closed; create a new Event")

    def _check_device(self, stream: Stream, what: str) -> None:
        if self._index is not None and stream._index != self._index:
            raise _DeviceMismatchError(
                f"cannot {what}: the event belongs to device {self._index} but the stream is on device "
                f"{stream._index}; use an event created on the stream's device")

    def record(self, stream: Optional[Stream] = None) -> None:
        """Record the event at the current end of ``stream`` (the current stream when None)."""
        # Hot path (a record per timed region): _live and _as_stream are called only when their
        # checks have something to say (closed, forked, not an accel Stream).
        if self._closed or self._pid != _fin.pid:
            self._live()
        if stream is None:
            stream = current_stream()
            # The current device's stream: a shared default stream needs no device switch, unless
            # the device is only named current (a deferred restore: on_device makes it current).
            switch = stream._shared and stream._backend.device_deferred()
        else:
            if type(stream) is not Stream:
                stream = _as_stream(stream, "Event.record(stream)")
            switch = stream._shared
        if stream._closed or stream._pid != _fin.pid:
            stream._live()
        if stream._foreign:
            stream._check_alive()   # (r82a: a wrapper of a closed accel stream recorded on its handle's new owner)
        self._check_device(stream, "record")
        mine, theirs = self._busy, stream._busy     # _Use(self, stream), inlined: a hot path
        # each mark taken first thing in its own try (a Ctrl-C as the append returns is undone by
        # that try's finally, and one in the inner finally's call still leaves the outer's pop)
        try:
            mine.append(None)
            try:
                theirs.append(None)
                if self._closed:
                    self._live()
                if stream._closed:
                    stream._live()
                self._record_on(stream, switch)
            finally:
                theirs.pop()
                if stream._closed:
                    _closed_during_use(stream)
        finally:
            mine.pop()
            if self._closed:
                _closed_during_use(self)

    def _record_on(self, stream: "Stream", switch: bool) -> None:
        """record's work; ``switch``: the stream may need its device made current (a shared
        default stream given, or the current one with a deferred device: its _device_scope)."""
        backend = stream._backend
        keep = None
        if self.external:
            _check_external(backend)
            with stream._device_scope():
                keep = _capture_table(backend, stream)  # first: it may raise, nothing done yet
        made = None
        if self._handle is None:
            made = self._create(backend, stream._index)
            self._check_device(stream, "record")    # another thread's first record may have won
        try:
            if self.external:
                with stream._device_scope():
                    backend.event_record(self._handle, stream._handle, external=True)
                if keep is not None:
                    keep[id(self)] = self
            elif switch:
                with stream._device_scope():
                    backend.event_record(self._handle, stream._handle)
            else:
                backend.event_record(self._handle, stream._handle)
        except BaseException:
            if made is not None and not self._recorded:
                self._unmake(made)
            raise
        self._recorded = True
        self._capture = _capture_of(backend, stream) if _capture_events else None

    def _create(self, backend: Backend, index: int) -> Optional[int]:
        """The first record's device event, made once when threads record a new event at once.
        Called inside record's use of this event (its ``_busy`` mark).  The handle when this call
        made it, else None."""
        with _create_lock:
            if self._handle is not None:
                return None
            self._made(backend, index)
            return self._handle

    def _unmake(self, handle: int) -> None:
        """The first record was refused (a capture refusing it, an invalidated capture's 901):
        the event it made is destroyed and the Event is unbound again, as before the record (r70c:
        it stayed bound to that device, and a later record on another device was refused)."""
        with _create_lock, _close_lock:
            if self._handle != handle or self._recorded or self._closed:
                return      # (another thread's record went on with it, or a close() owns it now)
            backend, own = self._backend, self._own
            self._handle = self._backend = self._index = self._own = None
        _event_destroy(backend, handle, _fin.key_of(own))

    @_signals_deferred
    def _made(self, backend: Backend, index: int) -> None:
        """Make the device event and store it with its destroy registered, with signals deferred
        (r55): from the moment the runtime's create returns until the handle is stored, a Ctrl-C
        would leave a handle nobody destroys.

        A close() by another thread since record's open check found no handle to destroy (it
        claims and reads ``_handle`` in one step under _close_lock, as this stores it): the
        record goes on with the handle made, and its destroy is left to the last use in flight
        (:func:`_close_release`; record's own use runs it as it ends), as for a close() during
        any other use.  (Destroyed at once, the record raised 'was closed' though it began on
        an open event.)"""
        with on_device(backend, index):
            handle = backend.event_create(self.enable_timing, self.blocking)
        with _close_lock:
            self._handle, self._backend, self._index = handle, backend, index
            # under the lock: a close() that sees the handle finds it registered
            self._own = _fin.own(_event_destroy, backend, handle)
            closed = self._closed
        if closed:
            # (no use of the handle has ended yet: record's mark is held, so it is not lost)
            self._releases.append((_event_destroy, (backend, handle, _fin.key_of(self._own))))
        elif getattr(self, "_late", False):
            # made by a finalizer after this event's own ran (same garbage): released with it
            _fin.finalize_later(self, _event_destroy, backend, handle, _fin.key_of(self._own))

    def wait(self, stream: Optional[Stream] = None) -> None:
        """Make ``stream`` (the current stream when None) wait for this event's recorded work.
        CaptureError, unless the event is ``external``, for an event last recorded inside a
        capture that has ended (it stands for a graph node), and for a capturing stream waiting
        on an event recorded outside its capture."""
        self._live()
        if stream is None:
            stream = current_stream()
        else:
            stream = _as_stream(stream, "Event.wait(stream)")
        stream._live()
        if stream._foreign:
            stream._check_alive()
        if self._handle is None:
            return
        if self._capture is not None and not self.external and self._capture not in _capture_events:
            self._refuse_captured("Event.wait()")       # its capture has ended (a wait inside it joins it)
        if _capture_events and not self.external:
            cap = _capture_of(self._backend, stream)
            if cap is not None and cap != self._capture:
                # CUDA Programming Guide, "Cross-stream Dependencies and Events": a capturing stream
                # may wait only on events recorded in the same capture (else
                # cudaErrorStreamCaptureIsolation, and the capture is invalidated).
                raise CaptureError(
                    f"{stream!r} is capturing and cannot wait for {self!r}, which was recorded outside "
                    f"the capture (a replay could not wait for it; the driver would refuse and invalidate "
                    f"the capture). Queue the work waited for before capture_begin, or first make its "
                    f"stream wait on the capturing stream (other.wait_stream(capturing)) so that it joins "
                    f"the capture; the capture goes on")
        with _Use(self, stream), stream._device_scope():
            if self.external:
                keep = _capture_table(self._backend, stream)   # first: it may raise
                self._backend.stream_wait_event(stream._handle, self._handle, external=True)
                if keep is not None:
                    keep[id(self)] = self
            else:
                self._backend.stream_wait_event(stream._handle, self._handle)

    def _refuse_captured(self, call: str) -> None:
        # A plain event last recorded inside a capture stands for a node of the graph, not for
        # work on a stream: CUDA refuses to query, synchronize or wait for it (Runtime API,
        # cudaErrorCapturedEvent while the capture is underway; cudaErrorInvalidValue once it has
        # ended, measured on an H200 by tools/cuda_conformance.py), without saying why.
        raise CaptureError(f"{call}: {self!r} was last recorded inside a graph capture, so it stands for a "
                           f"node of the graph, not for work on a stream (CUDA refuses it: cudaErrorCapturedEvent, "
                           f"or cudaErrorInvalidValue once the capture has ended); record it again outside a "
                           f"capture, or make it Event(external=True) so that each replay records it")

    def query(self) -> bool:
        """True when the recorded work has completed (or the event was never recorded).
        CaptureError for an event last recorded inside a graph capture, during it or after it
        ended (it stands for a graph node), unless the event is ``external``."""
        self._live()
        if self._handle is None:
            return True
        if self._capture is not None and not self.external:
            self._refuse_captured("Event.query()")
        busy = self._busy           # _Use(self), inlined: this is a hot path
        try:
            busy.append(None)       # (inside: a Ctrl-C as it returns is undone by the finally)
            if self._closed:
                self._live()
            return self._backend.event_query(self._handle)
        finally:
            busy.pop()
            if self._closed:
                _closed_during_use(self)

    def synchronize(self) -> None:
        """Block the host until the recorded work has completed.  CaptureError for an event
        last recorded inside a graph capture (as :meth:`query`)."""
        self._live()
        if self._handle is not None:
            if self._capture is not None and not self.external:
                self._refuse_captured("Event.synchronize()")
            busy = self._busy   # _Use(self), inlined as Stream.synchronize's
            try:
                busy.append(None)
                if self._closed:
                    self._live()
                self._backend.event_synchronize(self._handle)
            finally:
                busy.pop()
                if self._closed:
                    _closed_during_use(self)

    def ipc_handle(self) -> bytes:
        """torch's inter-process handle: refused (NotImplementedError, a RuntimeError as torch's
        refusal for an event made without ``interprocess=True``); accel has no inter-process events."""
        raise _no_interprocess("Event.ipc_handle()")

    @classmethod
    def from_ipc_handle(cls, device: DeviceLike, handle: bytes) -> "Event":
        """torch's event from another process's ``ipc_handle()``: refused (NotImplementedError)."""
        raise _no_interprocess("Event.from_ipc_handle()")

    def elapsed_time(self, end_event: "Event") -> float:
        """Milliseconds between this event and ``end_event`` (waits for both to complete)."""
        self._live()
        if not isinstance(end_event, Event):
            raise TypeError(f"elapsed_time expects an accel.Event, got {type(end_event).__name__}")
        end_event._live()
        if not (self.enable_timing and end_event.enable_timing):
            raise ValueError("Both events must be created with argument 'enable_timing=True'.")
        if not (self._recorded and end_event._recorded):
            raise ValueError("Both events must be recorded before calculating elapsed time.")
        if end_event._backend is not self._backend or end_event._index != self._index:
            # cudaEventElapsedTime: events of two devices have no common clock.
            raise _DeviceMismatchError(f"elapsed_time needs two events of one device: this event was recorded on "
                             f"device {self._index}, end_event on device {end_event._index}; time each "
                             f"device with its own pair of events")
        with _Use(self, end_event):
            self.synchronize()
            end_event.synchronize()
            return self._backend.event_elapsed_ms(self._handle, end_event._handle)

    def close(self) -> None:
        """Destroy the device event.  Idempotent."""
        if self._pid != _fin.pid:
            raise _fin.forked_error(self._backend)
        if self._closed:
            return
        with _close_lock:       # the claim and the handle read in one step: see _made
            if self._closed:
                return      # another thread's close() got there first
            self._closed = True
            handle, own = self._handle, self._own
        if handle is not None:
            try:
                _close_release(self, _event_destroy, self._backend, handle, _fin.key_of(own))
            except BaseException:
                if _fin.registered(self._own):
                    # not destroyed (as Stream.close): close() again (or the finalizer) retries
                    self._closed = False
                raise

    def __del__(self, _finalizing=sys.is_finalizing):
        if _finalizing():
            return      # interpreter exit: module globals may be gone; the process takes it all
        try:
            if getattr(self, "_closed", True) or self._pid != _fin.pid or not _lazy.is_initialized():
                return
            if _fin.collecting():
                # open until its cycle is gone: another finalizer of it may still use it (even make
                # its device event: _create then queues that handle's release)
                self._late = True
            if self._handle is not None:
                # (a Ctrl-C as this __del__ starts leaves the destroy to the registry: accel._finalize)
                _fin.release_on_del(self, _event_destroy, self._backend, self._handle, _fin.key_of(self._own))
        except KeyboardInterrupt:
            _fin.RAISE_AGAIN[_fin.interrupt_key()]    # a Ctrl-C handled in here reaches the program (r62)


def _capture_of(backend: Backend, stream: Stream) -> Optional[int]:
    """The id of the accel.Graph capture ``stream`` takes part in, or None."""
    if backend.captures_underway():
        ident = backend.capture_id(stream._handle)
        if ident in _capture_events:
            return ident
    return None


def _capture_table(backend: Backend, stream: Stream) -> Optional[Dict[int, Event]]:
    """The external events of the accel.Graph capture ``stream`` takes part in (that graph keeps
    them alive: its replays record or wait for them), or None.  Call in the stream's device scope."""
    ident = _capture_of(backend, stream) if _capture_events else None
    return None if ident is None else _capture_events.get(ident)


def _check_external(backend: Optional[Backend]) -> None:
    """Refuse ``Event(external=True)`` on a backend without external events (None: no
    accelerator found; the first record then fails as any event's would)."""
    if backend is not None and not backend.supports_external_events:
        raise NotImplementedError(f"Event(external=True) is not available on {backend.name}: "
                                  f"{backend.no_external_events_reason}")


def _no_interprocess(call: str) -> NotImplementedError:
    """The refusal of each inter-process event call (``interprocess=True``, torch's ipc_handle and
    from_ipc_handle): one message, naming the call."""
    return NotImplementedError(f"{call}: accel has no inter-process events (Event(interprocess=True), "
                               f"ipc_handle and from_ipc_handle are refused); share results between "
                               f"processes through host memory instead")


def _check_flag(name: str, value) -> None:
    """An Event flag must be a bool (or numpy.bool_), as torch.Event's: Event(enable_timing="no")
    would otherwise make a timing event."""
    kind = type(value)
    if kind is bool or (kind.__name__ in ("bool", "bool_") and kind.__module__ == "numpy"):
        return
    raise TypeError(f"Event(): argument '{name}' must be a bool (True or False), not {kind.__name__} "
                    f"({value!r})")


def _event_type(dev: DeviceLike) -> Optional[str]:
    """The accelerator type an ``Event(device)`` names, checked as torch.Event parses it: the
    type must be the current accelerator's, an index must name a device and is then dropped
    (torch keeps only the type until the first record).  Never initializes the runtime."""
    from .._device import accelerator_type, is_torch_device, parse_index
    if dev is None:
        return accelerator_type()
    if isinstance(dev, bool) or not (isinstance(dev, (str, device)) or is_torch_device(dev)
                                     or hasattr(type(dev), "__index__")):
        raise TypeError(f"Event(): argument 'device' must be a str such as 'cuda:0', an int or "
                        f"accel.device, not {type(dev).__name__} {dev!r}; the flags are keyword-only, "
                        f"e.g. Event(enable_timing=True)")
    index = parse_index(dev)
    if index is not None:
        check_range(index)
    return accelerator_type()


# (at the end: these modules use Event, and it uses them, at call time)
from .current import current_stream  # noqa: E402
from .foreign import _as_stream  # noqa: E402
from .stream import Stream, on_device  # noqa: E402
