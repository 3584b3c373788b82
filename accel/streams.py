"""Streams, events, and the per-thread current stream.

A :class:`Stream` is an ordered queue of device work; an :class:`Event` marks
a point in one, so other streams (``wait_event``) or the host
(``synchronize``) can wait for it.  Both wrap ``int`` handles of the selected
backend, so this module is the same for every runtime.

The *current stream* is kept per thread and per device, defaulting to the
device's default stream, as in CUDA and torch.

Where the backend's default stream is one handle for every device, resolved
against the calling thread's current device (CUDA's legacy stream 0), every
call on a default stream runs with its device current (``Stream._shared``), as
torch's ``CUDAStream`` methods do under a ``DeviceGuard``.  Created streams carry
their device in the handle and need no switch.

**Foreign streams.**  ``Stream.from_handle(handle, device)`` (torch's ``ExternalStream``) wraps
a stream another library made, and :func:`_as_stream` turns anything with the CUDA stream
protocol (``__cuda_stream__() -> (0, handle)``: cuda.core, CuPy, torch) into a Stream wherever
accel takes one.  accel never destroys such a stream.  What accel keys by its handle (the
caching allocator's free lists and stream uses) is forgotten, as for a destroyed stream of its
own (:func:`on_stream_destroy`), when the last accel wrapper of it goes: the driver gives a
destroyed stream's handle value to the next stream it creates, so free lists left keyed by the
handle would be inherited by an unrelated stream while the dead one's work may still run.
torch keeps them (``CUDACachingAllocator`` keys blocks by ``cudaStream_t`` and never forgets an
external one).  The owner must therefore keep the stream alive until accel's wrappers of it
are closed or gone, Buffers allocated on it included (torch asks the same while its
ExternalStream "is being used").
"""

from __future__ import annotations

import functools
import operator
import sys
import threading
import weakref
from typing import Callable, Dict, List, Optional, Tuple

from . import _finalize as _fin
from . import _lazy, _locks
from ._copying import refuse_copies as _refuse_copies
from ._device import DeviceLike, check_range, check_stream_range, device, device_index
from ._errors import AcceleratorError, CaptureError, InvalidDeviceError
from . import backends as _backends
from .backends._signals import deferred as _signals_deferred
from .backends.base import Backend

__all__ = ["Stream", "Event", "current_stream", "set_stream", "default_stream", "on_device"]

_tls = threading.local()
_defaults: Dict[int, "Stream"] = {}
_defaults_lock = _locks.Lock("making a device's default stream")  # (r68i: a __del__ run inside it)
_destroy_hooks: List[Callable[[Backend, int, int, bool], bool]] = []
#: Created streams by (device index, handle), for Stream(stream_id=...).  Weak: a stream no
#: one holds is collected (and its entry goes) before its handle can be handed out again.
_live_streams: "weakref.WeakValueDictionary[Tuple[int, int], Stream]" = weakref.WeakValueDictionary()
#: torch's c10::DeviceType numbers of accel's accelerators (Stream.device_type).
_DEVICE_TYPES = {"cuda": 1, "xpu": 12, "mps": 13}
#: External events recorded or waited on in each capture accel.Graph has underway, by capture
#: id ({id(event): event}), and the accel.Modules whose kernels it launches (accel.launch): the
#: graph that ends the capture keeps them alive, since each of its replays records or waits for
#: them, or launches the kernels.  An entry lives from capture_begin to capture_end.
_capture_events: Dict[int, Dict[int, "Event"]] = {}
#: The anchor of each foreign stream (device index, handle) while an accel wrapper of it lives:
#: every wrapper holds it, and the last one's going forgets the handle (_ForeignAnchor).
_foreign: "weakref.WeakValueDictionary[Tuple[int, int], _ForeignAnchor]" = weakref.WeakValueDictionary()
#: Held to find or make an anchor, and by _forget from its check to its hooks' end (never waited
#: for by a finalizer: run_locked).  An accel._locks.Lock (r71a): the anchor and its weak
#: reference are allocations, and so are the hooks' calls, where a collection may run a user's gc
#: callback or __del__ that wraps a foreign stream: refused, where a plain lock waited forever on
#: its own thread.  (A forked child finds it free: accel._locks.)
_foreign_lock = _locks.Lock("wrapping a foreign stream")
#: Stream handles are pointers: every valid one is below 2**64.
_HANDLE_LIMIT = 1 << 64


def on_stream_destroy(hook: Callable[[Backend, int, int, bool], bool]) -> None:
    """Call ``hook(backend, device_index, handle, blocking)`` just before an owned stream is
    destroyed: the driver hands a destroyed handle's value to the next stream it creates, so
    anything keyed by the handle must forget it first (and may still record on it).  Also
    called, with the stream still alive, when the last accel wrapper of a foreign stream
    (:meth:`Stream.from_handle`) goes: its owner may destroy it from then on.

    From a finalizer ``blocking`` is False: the hook must not wait for a lock (the same
    thread may hold it) and returns False when it cannot run now; the destroy is then
    finished at the next safe point (see accel._finalize).  Otherwise it returns True."""
    _destroy_hooks.append(hook)


def _destroy(backend: Backend, index: int, handle: int, blocking: bool, key: int = 0) -> None:
    """Destroy owned stream ``handle``, registered under ``key`` (accel._finalize.own; 0: the
    registry's own call, or none registered): nothing when another path took it."""
    if key and key not in _fin.owned:
        return      # destroyed, or being destroyed, by another path: its handle may be reused
    if backend.captures_underway() and backend.capture_id(handle) is not None:
        # The stream takes part in a capture (close() refuses then; this is its finalizer, or
        # the registry's release): the destroy, hooks included, waits for the end of the
        # captures.  The hooks would record on the capturing stream (the caching allocator's
        # cover: a captured event, which CUDA refuses to query once the capture has ended), and
        # destroying it would leave the capture without that stream.
        if _after_captures(backend, _fin.finalize, _destroy, backend, index, handle, False, key):
            return
    for hook in _destroy_hooks:
        # A hook that fails (the allocator could neither record an event on the stream nor wait
        # for it) leaves the stream alive: destroying it would leave memory that its queued work
        # may still use with nothing to tell when that work ends.  close() can be tried again.
        if not hook(backend, index, handle, blocking):
            _fin.defer(_destroy, backend, index, handle, True, key)   # the handle stays valid until then
            return
    _fin.destroy_owned(key, backend.stream_destroy, handle)


def announced(index: int, handle: int) -> bool:
    """True when accel hears of stream ``handle`` of device ``index`` before it can be destroyed
    (:func:`on_stream_destroy`): a live accel Stream's, or a foreign stream an accel wrapper
    holds.  A raw handle given to the allocators directly is not: its owner may destroy it
    unannounced, and the driver may hand its value to the next stream."""
    key = (index, handle)
    return key in _live_streams or key in _foreign


def _after_captures(backend: Backend, fn: Callable, *args) -> bool:
    """Queue ``fn(*args)`` for when no capture this process began through ``backend`` is
    underway, and return True; False (nothing queued) when none is, or when the backend keeps no
    such queue (Backend._after_captures: Metal has no captures).  ``fn`` runs in whichever thread
    ends the last capture: it must wait for no lock (a finalizer's release)."""
    queue = getattr(backend, "_after_captures", None)
    return queue is not None and queue(fn, *args)


def _event_destroy(backend: Backend, handle: int, key: int = 0) -> None:
    """Destroy owned event ``handle``, registered under ``key`` (as :func:`_destroy`)."""
    _fin.destroy_owned(key, backend.event_destroy, handle)


def _forget(backend: Backend, index: int, handle: int, blocking: bool) -> None:
    """The last accel wrapper of foreign stream ``handle`` went: run the destroy hooks (the
    allocators forget the handle, covering its queued work with an event), but never destroy
    it.  While the stream is being captured (by its owner) nothing is forgotten: the capture
    may allocate from a graph pool through the handle, and torch forgets nothing either."""
    if backend.captures_underway() and backend.capture_id(handle) is not None:
        return
    # Under _foreign_lock, which _foreign_stream takes to find or make an anchor: no new wrapper
    # of the handle begins between the check and the hooks.  A finalizer waits for no lock.
    if not _locks.run_locked(_foreign_lock, blocking, _forget_unless_wrapped, backend, index, handle, blocking):
        _fin.defer(_forget, backend, index, handle, True)


def _forget_unless_wrapped(backend: Backend, index: int, handle: int, blocking: bool) -> None:
    anchor = _foreign.get((index, handle))
    if anchor is not None and not anchor.dying:
        # Wrapped again since this forget was asked for: a collection clears the weak reference
        # to its garbage anchor before the anchor's __del__ runs and leaves the forget for after
        # the collection (accel._finalize), and a forget a busy hook deferred waits for the next
        # safe point.  The handle's state is the live wrappers' now; the new anchor forgets it.
        return
    for hook in _destroy_hooks:
        if not hook(backend, index, handle, blocking):
            _fin.defer(_forget, backend, index, handle, True)
            return


class _ForeignAnchor:
    """Held by every accel wrapper of one foreign stream; collected with the last of them,
    when accel forgets the handle (:func:`_forget`).  Takes no lock (a finalizer)."""

    __slots__ = ("backend", "index", "handle", "pid", "dying", "__weakref__")

    def __init__(self, backend: Backend, index: int, handle: int):
        self.backend, self.index, self.handle, self.pid = backend, index, handle, _fin.pid
        self.dying = False

    def __del__(self, _finalizing=sys.is_finalizing):
        # First: outside a collection the weak reference in _foreign still finds this anchor
        # while __del__ runs; a new wrapper must make a new anchor, not take (resurrect) this one.
        self.dying = True
        if _finalizing():
            return      # interpreter exit: module globals may be gone; the process takes it all
        try:
            if self.pid == _fin.pid and _lazy.is_initialized():
                _fin.finalize(_forget, self.backend, self.index, self.handle, False)
        except KeyboardInterrupt:
            _fin.RAISE_AGAIN[_fin.interrupt_key()]    # a Ctrl-C handled in here reaches the program (r62)


#: Makes "closed yet? then mark it closed" one step, so two threads closing one Stream or Event
#: destroy its handle once (the driver gives a freed handle value to the next object it makes).
#: Held for no vendor call, so no finalizer ever waits for it; but Event._made registers the
#: handle's destroy under it (_fin.own: allocations, where a collection may run a user's gc
#: callback that closes another Event), so it is an accel._locks.Lock (r71a): that close is
#: refused instead of waiting forever on its own thread.  (A forked child finds it free.)
_close_lock = _locks.Lock("closing a Stream or Event")


#: Serializes an Event's first record (which creates its device event); held across
#: event_create, inside which a collection may run a user's __del__ that records an Event (r68i:
#: it waited on this lock, held by its own thread): accel._locks.Lock refuses that instead.
_create_lock = _locks.Lock("an Event's first record")


class _Use:
    """``with _Use(a, b):`` around a call that passes the handles of Streams or Events ``a`` and
    ``b`` to the backend: raises as on a closed object when one is closed, and while the body
    runs, another thread's close() leaves the handle to the last use in flight to destroy
    (:func:`_close_release`).  A destroy that did not wait would let the driver give the handle
    to the next stream or event made, and the call in flight would act on that one.  No lock:
    ``list.append``/``pop`` are atomic, and each object's ``_busy`` (uses in flight) and
    ``_releases`` (a close's deferred destroy, taken by exactly one caller) are plain lists."""

    __slots__ = ("_objs", "_n")

    def __init__(self, *objs):
        self._objs = objs
        self._n = 0     # marks taken: stored just before each (as _Hold._in: no interrupt point between)

    def __enter__(self) -> None:
        try:
            for obj in self._objs:
                self._n += 1
                obj._busy.append(None)
                if obj._closed:
                    obj._live()     # raises: closed (maybe by another thread just now)
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc) -> None:
        objs = self._objs
        while self._n:
            self._n -= 1        # (a plain store, then the pop: no point between)
            obj = objs[self._n]
            obj._busy.pop()
            if obj._closed:
                _closed_during_use(obj)     # the last use of an object closed meanwhile destroys it


class _Hold:
    """``with _Hold(stream):`` around a whole operation that queues work on ``stream`` (a Buffer
    copy or fill, an ArrayView copy, a random fill, a kernel launch, a graph replay): a use of
    the handle as :class:`_Use` (raises when the stream is closed; another thread's close()
    leaves the destroy to the end of the operation), and, in this thread until the operation
    ends, the stream's own methods and :attr:`Stream.handle` go on working when another thread
    closes it meanwhile (its handle stays valid until then), so the operation completes on the
    stream it began on instead of failing halfway (a copy queued, its synchronize refused).
    Hot paths (Stream.query, Event.record) mark their use inline and need no hold.

    Interrupt safety (r67e): CPython runs a Ctrl-C's handler right after a C call returns and
    as a Python function starts, never between a plain store and the C call after it.  So
    ``_in`` is stored just before each step: 1 as the stream's use mark is appended, 2 as the
    stream goes on this thread's hold stack.  ``__enter__`` takes all or nothing (its handler
    undoes what ``_in`` names, with no call before the mark's pop), and ``__exit__`` drops
    ``_in`` and pops the stack (plain stores) before its one call, the mark's pop, so it can be
    called again to finish.  The with statement's call of it can be stopped as it starts (a
    Python function), having done nothing, and will not be made again: a caller that must not
    leave the mark (Graph.replay, random's ordering) calls it once more while ``_in`` is set."""

    __slots__ = ("_stream", "_held", "_in")

    def __init__(self, stream: "Stream"):
        self._stream = stream
        self._in = 0

    def __enter__(self) -> "Stream":
        stream = self._stream
        held = _tls.__dict__.get("held")
        if held is None:
            held = _tls.held = []
        self._held = held
        key = id(stream)
        busy = stream._busy
        try:
            self._in = 1
            busy.append(None)
            if stream._closed or stream._pid != _fin.pid:
                stream._live()      # raises: closed (maybe by another thread just now), or forked
            self._in = 2            # (after the check: _live lets a stream this thread holds go on)
            held.append(key)        # unique while held: the hold keeps the stream alive
            return stream
        except BaseException:
            if self._in == 2:
                del held[-1]
            self._in = 0
            busy.pop()
            if stream._closed:
                _closed_during_use(stream)
            raise

    def __exit__(self, *exc) -> None:
        state = self._in
        if state:
            self._in = 0
            if state == 2:
                del self._held[-1]  # holds of one thread nest (with statements): the last one is ours
            stream = self._stream
            stream._busy.pop()
            if stream._closed:
                _closed_during_use(stream)


class _ExportMark:
    """A use mark (``_busy``) on a stream that a live object exported, held for as long as this
    mark lives: a close() of the stream meanwhile leaves its destroy to the mark's end, so the
    exported handle names no newer stream.  CAI v3, "Lifetime management" > "Streams": a Producer
    exporting a stream "ensures that the exported stream's lifetime is equal to or surpasses the
    lifetime of the object from which the interface was exported" (Numba keeps it as the imported
    array's stream).  Unlike :class:`_Hold`, it lets no call use the stream once it is closed.
    The exporter takes the mark before it checks that the stream is open (as a use does), so a
    close() in another thread either comes first (the exporter sees it closed) or waits for it.

    Interrupt safety: the stream is stored before the mark's append (a call), and a Ctrl-C's
    handler runs only after that call returns, so a mark appended is always one that ``release``
    or ``__del__`` pops; both pop it and run a destroy it holds back with signals deferred
    (``_drop_export_mark``), so a Ctrl-C cannot land between the two (r73d)."""

    __slots__ = ("_stream",)

    def __init__(self, stream: "Stream"):
        self._stream = stream
        stream._busy.append(None)

    def release(self) -> None:
        """Drop the mark now (the exporter's close()): a close() of the stream meanwhile destroys
        it here, as the end of any use does."""
        _drop_export_mark(self, _fin.finalize)

    def __del__(self, _finalizing=sys.is_finalizing):
        try:
            if not _finalizing():       # (at interpreter exit the process takes it all)
                # A finalizer (the exporter collected, maybe inside a lock this thread holds): the
                # destroy, whose hooks take the allocators' locks, runs at the next safe point
                _drop_export_mark(self, _fin.defer)
        except KeyboardInterrupt:
            # (a Ctrl-C as a call above returned, before the drop's signals were deferred)
            _drop_export_mark(self, _fin.defer)
            _fin.RAISE_AGAIN[_fin.interrupt_key()]    # a Ctrl-C handled in here reaches the program (r62)


@_signals_deferred
def _drop_export_mark(mark: _ExportMark, how) -> None:
    """Pop ``mark``'s use mark once, and run the destroy a close() left to it with ``how``."""
    stream = getattr(mark, "_stream", None)
    if stream is None:
        return      # dropped already, or interrupted before anything was marked
    mark._stream = None
    stream._busy.pop()
    if stream._closed and stream._pid == _fin.pid:
        _closed_during_use(stream, how)


def _hold_open(stream: "Stream") -> "Optional[_Hold]":
    """An entered :class:`_Hold` of ``stream`` (leave it with ``__exit__``), or None when the
    stream is closed (by another thread maybe just now): for callers that then take another way
    (a closed last-use stream is waited for on the host).  Raises as _Hold in a forked child."""
    hold = _Hold(stream)
    try:
        hold.__enter__()
    except RuntimeError:
        if stream._closed and stream._pid == _fin.pid:
            return None
        raise
    return hold


def _closed_during_use(obj, how=_fin.finalize) -> None:
    """After a use of closed ``obj`` ended (its mark popped): the last use runs the deferred destroy
    (with ``how``: a finalizer's defers it).  (The hot paths inline _Use: mark, check _closed,
    call, pop, then this when closed.)"""
    if obj._releases and not obj._busy:
        _run_deferred(obj, how)


def _run_deferred(obj, how) -> None:
    try:
        fn, args = obj._releases.pop()
    except IndexError:
        return      # another thread took it
    how(fn, *args)


def _close_release(obj, fn, *args) -> None:
    """close()'s ``fn(*args)`` (the handle's destroy), now, errors propagating, unless a use of
    the handle is in flight in another thread: then the last such use runs it (errors go the
    way of a finalizer's).  ``obj`` is already marked closed, so no new use starts."""
    releases = obj._releases
    releases.append((fn, args))
    if obj._busy:
        return      # the last use's _closed_during_use() takes it (or took it already)
    _run_deferred(obj, _fin.release)


def _drop_anchor(stream: "Stream") -> None:
    """A foreign wrapper's "destroy" (:meth:`Stream.close`): it lets go of the handle's anchor,
    and with the last wrapper's the anchor goes and accel forgets the handle."""
    stream._anchor = None


def _claim_close(obj) -> bool:
    """Mark ``obj`` (a Stream or Event) closed; False when it already was (another thread's close)."""
    with _close_lock:
        if obj._closed:
            return False
        obj._closed = True
        return True


class on_device:
    """``with on_device(backend, index):`` makes ``index`` the current device for the
    body and restores the previous one, even on exception; one get_device call when
    ``index`` is already current.  (A class, not a generator: it guards hot calls.)"""

    __slots__ = ("_backend", "_index", "_previous")

    def __init__(self, backend: Backend, index: int):
        self._backend, self._index = backend, index

    def __enter__(self) -> None:
        backend = self._backend
        previous = backend.get_device()
        if previous == self._index:
            self._previous = None
            if backend.device_deferred():      # named current, not made current yet: now it is
                backend.set_device(self._index)
        else:
            backend.set_device(self._index)
            self._previous = previous

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            try:
                # CUDA: not if that device has no primary context yet (creating one would hold
                # its memory for a device the work never used); restore_device records it
                self._backend.restore_device(self._previous)
            except AcceleratorError as err:
                # As torch's device guards (c10/cuda/impl/CUDAGuardImpl.h, uncheckedSetDevice:
                # C10_CUDA_CHECK_WARN): a failed restore warns and never raises, so what the body
                # made (a stream, a segment, a recorded event) is not lost to the exception.
                import warnings
                warnings.warn(f"could not make device {self._previous} current again after work on "
                              f"device {self._index} ({err}); device {self._index} stays current",
                              RuntimeWarning, stacklevel=2)


def _index_for(dev: DeviceLike, minus_one_current: bool = False) -> int:
    index = device_index(dev, optional=True)
    if minus_one_current and index == -1 and type(dev) is int:
        # -1 is the current device for the current and default streams, as c10's
        # getCurrentCUDAStream(-1) / getDefaultCUDAStream(-1) (r69j: accel refused it)
        return _lazy.lazy_init().get_device()
    if dev is not None:
        check_stream_range(index)
    return index


@_refuse_copies("share the Stream object itself (it is a handle), or create a new Stream in "
                "the other process")
class Stream:
    """An ordered queue of work on one device.

    ``Stream(device=None, priority=0)`` creates a new stream on ``device``
    (default: the current device); ``Stream(stream_id, device_index, device_type)``
    (positional or keywords, as torch's) gives the live stream those name.  A lower
    ``priority`` number is more urgent,
    as in CUDA.  A priority outside :meth:`priority_range` is clamped into it, as the
    CUDA runtime does (torch.cuda.Stream refuses a positive one and offers only 0 to -3 of
    the device's range; accel gives the whole range).  ``with stream:`` makes it the
    thread's current stream (and its device current) and restores both on exit, even on
    exception.  The stream
    is destroyed by :meth:`close` or when garbage-collected; a closed stream
    raises on use.
    """

    __slots__ = ("_backend", "_index", "_handle", "_owned", "_closed", "_shared", "_pid", "_priority",
                 "_foreign", "_anchor", "_busy", "_releases", "_own", "__weakref__")

    def __new__(cls, device: DeviceLike = None, priority: int = 0, *positional_type: int,
                stream_id: Optional[int] = None, device_index: Optional[int] = None,
                device_type: Optional[int] = None):
        if positional_type:
            # torch's second overload, positional: Stream(stream_id, device_index, device_type)
            if len(positional_type) > 1 or stream_id is not None or device_index is not None \
                    or device_type is not None:
                raise TypeError("Stream(): takes Stream(device=None, priority=0) or Stream(stream_id, "
                                "device_index, device_type), each argument once")
            return cls._rebuild(device, priority, positional_type[0])
        if stream_id is not None or device_index is not None or device_type is not None:
            if device is not None:
                raise TypeError("Stream(): give either device (a new stream) or stream_id, device_index "
                                "and device_type (an existing one), not both")
            return cls._rebuild(stream_id, device_index, device_type)
        if isinstance(priority, bool) or not hasattr(type(priority), "__index__"):
            raise TypeError(f"priority must be an int, got {priority!r}")
        priority = priority.__index__()     # numpy integers too
        backend = _lazy.lazy_init()
        if _fin.pending:
            _fin.drain()
        index = _index_for(device)
        least, greatest = backend.stream_priority_range()
        priority = min(max(priority, greatest), least)  # CUDA clamps out-of-range priorities
        self = super().__new__(cls)
        handle = self._create(backend, index, priority)
        self._priority = priority
        _live_streams[(index, handle)] = self
        return self

    @_signals_deferred
    def _create(self, backend: Backend, index: int, priority: int) -> int:
        """Make the stream's handle and register its destroy (for an interrupted ``__del__``,
        accel._finalize, r53) with signals deferred (r55): from the moment the runtime's create
        returns until the registration is stored, a Ctrl-C would leave a handle nobody destroys."""
        with on_device(backend, index):
            handle = backend.stream_create(priority)
        self._init(backend, index, handle, owned=True)
        self._own = _fin.own(_destroy, backend, index, handle, True)
        return handle

    def _init(self, backend: Backend, index: int, handle: int, owned: bool) -> None:
        self._backend, self._index, self._handle = backend, index, handle
        self._owned, self._closed = owned, False
        self._busy, self._releases = [], []     # see _Use
        self._own = None                        # (key, token) of the destroy's registration
        self._pid = _fin.pid
        self._priority = 0
        self._foreign, self._anchor = False, None
        # The handle names this device's stream only while the device is current.
        self._shared = (not owned and backend.shared_default_stream
                        and handle == backend.default_stream(index))

    @classmethod
    def _rebuild(cls, stream_id, device_index, device_type) -> "Stream":
        """torch's ``Stream(stream_id=, device_index=, device_type=)``: the live stream those
        name (the same object, so it stays equal and keeps the stream alive)."""
        if stream_id is None or device_index is None or device_type is None:
            raise TypeError("Stream(): rebuilding a stream takes all of stream_id, device_index and "
                            "device_type (as a stream's own attributes give them)")
        from ._device import _as_index
        stream_id = _as_index(stream_id, "stream_id")
        index = _as_index(device_index, "device_index")
        kind = _as_index(device_type, "device_type")
        backend = _lazy.lazy_init()
        if kind != _DEVICE_TYPES.get(backend.name):
            raise ValueError(f"Stream(): device_type {kind} is not the current accelerator's "
                             f"({backend.name} = {_DEVICE_TYPES.get(backend.name)}); pass the "
                             f"device_type of a stream of this process")
        check_range(index)
        if stream_id == backend.default_stream(index):
            return default_stream(index)
        stream = _live_streams.get((index, stream_id))
        if stream is None or stream._closed:
            anchor = _foreign.get((index, stream_id))
            if anchor is not None and not anchor.dying:  # a foreign stream accel still wraps: a new wrapper, as torch
                return cls._wrap(backend, index, stream_id, anchor=anchor)
            raise ValueError(f"Stream(): no live accel stream has stream_id {stream_id:#x} on device "
                             f"{backend.name}:{index} (closed, collected, or made by another library); "
                             f"keep the Stream object to use it again, or wrap another library's stream "
                             f"with Stream.from_handle(handle, device)")
        return stream

    @classmethod
    def _wrap(cls, backend: Backend, index: int, handle: int, foreign: bool = False,
              anchor: Optional[_ForeignAnchor] = None) -> "Stream":
        """A Stream object for a handle accel does not own: a default stream, or (``foreign``,
        or with an ``anchor``) one that :meth:`close` only forgets."""
        self = object.__new__(cls)     # not cls.__new__: that creates a stream
        self._init(backend, index, handle, owned=False)
        self._foreign, self._anchor = foreign or anchor is not None, anchor
        return self

    @classmethod
    def from_handle(cls, handle: int, device: DeviceLike = None) -> "Stream":
        """Wrap a stream accel did not create (another library's), as torch's
        ``torch.cuda.ExternalStream(stream_ptr, device)``.

        ``handle`` is the backend's stream handle as an int (CUDA: the ``cudaStream_t``
        value; ``cudaStreamLegacy`` (1) is the default stream, ``cudaStreamPerThread`` (2)
        is refused).  ``device`` (int, str or accel.device; default: the stream's own
        device where the runtime can tell, else the current device) must be the stream's
        device: CUDA 12.8+ checks it with ``cudaStreamGetDevice`` (as does the simulator,
        which knows every live stream); older runtimes cannot, and a wrong device makes later
        work fail as with torch.  On XPU and MPS only handles of accel's own backend can be
        wrapped.

        Each call returns a new Stream, equal (and hashing equal) to every other Stream of
        the same handle and device, as torch's.  accel never destroys the stream:
        :meth:`close` (or collection) of the wrapper only forgets it, and when the last
        wrapper of a handle goes, accel's allocators forget the handle (see the module
        docstring), so the owner must keep the stream alive until then.
        """
        if isinstance(handle, bool) or not hasattr(type(handle), "__index__"):
            raise TypeError(f"Stream.from_handle: handle must be an int (the stream handle, e.g. a "
                            f"cudaStream_t as an int), got {type(handle).__name__} {handle!r}")
        handle = operator.index(handle)
        if handle < 0:
            raise ValueError(f"Stream.from_handle: handle must be >= 0 (a stream handle as an unsigned "
                             f"int), got {handle}")
        check_handle_bits(handle, "Stream.from_handle")
        backend = _lazy.lazy_init()
        if _fin.pending:
            _fin.drain()
        index = None if device is None else _index_for(device)
        return _foreign_stream(backend, handle, index, "Stream.from_handle", reuse=False)

    # -- identity --------------------------------------------------------------
    @property
    def device(self) -> device:
        """The stream's device (torch's ``Stream.device``)."""
        return device(self._backend.name, self._index)

    @property
    def device_index(self) -> int:
        """The index of the stream's device (torch's ``Stream.device_index``)."""
        return self._index

    @property
    def device_type(self) -> int:
        """The device type as torch's ``c10::DeviceType`` number (CUDA 1, XPU 12, MPS 13)."""
        return _DEVICE_TYPES[self._backend.name]

    @property
    def stream_id(self) -> int:
        """The stream's id: with :attr:`device_index` and :attr:`device_type` it rebuilds an
        equal stream, ``Stream(stream_id=, device_index=, device_type=)``.  accel's id is the
        backend handle (a default stream's is its handle too: CUDA's legacy stream is 0)."""
        return self._handle

    @property
    def priority(self) -> int:
        """The stream's priority after clamping to :meth:`priority_range` (lower is more
        urgent); 0 for a default stream."""
        return self._priority

    @staticmethod
    def priority_range() -> Tuple[int, int]:
        """``(least, greatest)`` stream priority of the accelerator, as torch's static
        ``Stream.priority_range()`` (CUDA: cudaDeviceGetStreamPriorityRange); a priority
        outside it is clamped.  Initializes the runtime."""
        return tuple(_lazy.lazy_init().stream_priority_range())

    @property
    def __cuda_stream__(self):
        """The CUDA stream protocol (cuda-python's ``__cuda_stream__() -> (0, handle)``), as
        ``torch.cuda.Stream``; only CUDA streams have it (``hasattr`` is False elsewhere)."""
        if self._backend.name != "cuda":
            raise AttributeError(f"'{type(self).__name__}' object of {self._backend.name} has no "
                                 f"attribute '__cuda_stream__' (a CUDA stream protocol)")
        handle = self.handle
        return lambda: (0, handle)

    @property
    def handle(self) -> int:
        """The backend's stream handle as an int (CUDA: the ``cudaStream_t`` value)."""
        self._live()
        return self._handle

    native_handle = property(handle.fget, doc="torch.Stream's name for :attr:`handle`.")

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (the handle is released; the object refuses use)."""
        return self._closed

    def __eq__(self, other):
        if isinstance(other, Stream):
            if self._closed or other._closed:
                # A closed stream's handle value may name a newer stream now (the driver
                # recycles them): it equals only itself.
                return self is other
            return (self._backend is other._backend and self._index == other._index
                    and self._handle == other._handle)
        return NotImplemented

    def __hash__(self):
        return hash((self._backend.name, self._index, self._handle))

    def __repr__(self):
        state = (" foreign" if self._foreign else "") + (" closed" if self._closed else "")
        return f"<accel.Stream device={self._backend.name}:{self._index} handle={self._handle:#x}{state}>"

    def _live(self) -> None:
        if self._pid != _fin.pid:
            raise _fin.forked_error(self._backend)
        if self._closed:
            held = _tls.__dict__.get("held")
            if held and id(self) in held:
                return      # closed by another thread during this thread's _Hold: valid until it ends
            raise RuntimeError(f"{self!r} was closed; create a new Stream")

    def _check_alive(self) -> None:
        """For a foreign wrapper (:meth:`from_handle`): ValueError when the runtime says the
        stream is no longer alive (its owner destroyed it while accel still wraps it)."""
        try:
            self._backend.foreign_stream(self._handle)
        except ValueError as exc:
            raise ValueError(f"{self!r} cannot be used: {exc}; its owner destroyed it while accel still wraps "
                             f"it (keep the stream alive while accel uses it); nothing was done") from None

    # -- work --------------------------------------------------------------------
    def synchronize(self) -> None:
        """Block the host until all work queued on this stream has completed."""
        self._live()
        busy = self._busy   # _Use(self), inlined: where a Ctrl-C is most likely (a wait), no __exit__
        try:                # call a Ctrl-C could stop as it starts
            busy.append(None)
            if self._closed:
                self._live()
            if self._shared:
                with on_device(self._backend, self._index):
                    self._backend.stream_synchronize(self._handle)
            else:
                self._backend.stream_synchronize(self._handle)
        finally:
            busy.pop()
            if self._closed:
                _closed_during_use(self)

    def query(self) -> bool:
        """True when all work queued on this stream has completed."""
        if self._closed or self._pid != _fin.pid:
            self._live()
        busy = self._busy           # _Use(self), inlined: this is a hot path
        try:
            busy.append(None)       # (inside: a Ctrl-C as it returns is undone by the finally)
            if self._closed:
                self._live()
            if self._shared:
                with on_device(self._backend, self._index):
                    return self._backend.stream_query(self._handle)
            return self._backend.stream_query(self._handle)
        finally:
            busy.pop()
            if self._closed:
                _closed_during_use(self)

    def is_capturing(self) -> bool:
        """True while this stream takes part in a graph capture (cudaStreamIsCapturing)."""
        self._live()
        if not self._backend.supports_graphs:
            return False
        with _Use(self), self._device_scope():
            return self._backend.stream_is_capturing(self._handle)

    def _device_scope(self):
        """The context calls naming this stream run in: its device current where the
        handle needs it (a shared default stream), else nothing to do."""
        if not self._shared:
            return _NO_SCOPE
        backend = self._backend
        if backend.get_device() == self._index and not backend.device_deferred():
            # Already current (a default stream of the current device, the common case): the
            # scope would switch nothing and restore nothing (see on_device.__enter__).
            return _NO_SCOPE
        return on_device(backend, self._index)

    def _current_scope(self):
        """The context a call that must run with this stream's device current runs in (a memset:
        unlike a copy, the CUDA guide does not say it may go to another device's stream, see
        accel/sim/cudart/copies.py cudaMemsetAsync): nothing to do when it is current."""
        backend = self._backend
        if backend.get_device() == self._index and not backend.device_deferred():
            return _NO_SCOPE
        return on_device(backend, self._index)

    def wait_event(self, event: "Event") -> None:
        """Make work queued on this stream after now wait for ``event``'s recorded work."""
        self._live()
        if not isinstance(event, Event):
            raise TypeError(f"wait_event expects an accel.Event, got {type(event).__name__}")
        event.wait(self)

    def wait_stream(self, stream: "Stream") -> None:
        """Make work queued on this stream after now wait for all work queued on ``stream`` so far
        (a Stream, or any object with ``__cuda_stream__``)."""
        self._live()
        stream = _as_stream(stream, "Stream.wait_stream(stream)")
        self.wait_event(stream.record_event())

    def record_event(self, event: Optional["Event"] = None) -> "Event":
        """Record ``event`` (a new one when None) on this stream and return it."""
        self._live()
        if event is None:
            event = Event()
        elif not isinstance(event, Event):
            raise TypeError(f"record_event expects an accel.Event or None, got {type(event).__name__}")
        event.record(self)
        return event

    # -- current-stream context -----------------------------------------------------
    def __enter__(self) -> "Stream":
        self._live()
        backend = self._backend
        # The frame running the with statement: it calls __exit__ too, on whichever thread
        # closes it (see _exit_elsewhere).  (No allocation once the stack lock is held.)
        entry = _Entry(backend.get_device(), current_stream(self._index), self, id(sys._getframe(1)))
        stack = _tls.__dict__.get("stack")
        if stack is None:
            stack = _new_stack()
        with stack.lock:
            stack.append(entry)
        try:
            set_stream(self)
        except BaseException:
            with stack.lock:             # __exit__ will not run: leave no entry for another one to pop
                if entry in stack:       # (by identity: _Entry has no __eq__)
                    stack.remove(entry)
            raise
        return self

    def __exit__(self, *exc) -> None:
        frame = id(sys._getframe(1))
        mine = _tls.__dict__.get("stack")
        # The block this frame entered on this thread; else one it entered on another thread
        # (_exit_elsewhere); else this thread's newest block of this stream, entered by another
        # frame (an ExitStack, a helper that calls __enter__ and __exit__).  Frame first (r75e):
        # a collection run inside this thread's own block of the stream may close another
        # thread's generator suspended in a block of the same stream.
        taken = _take_matching(mine, self, frame) if mine else None
        if taken is None:
            if self._exit_elsewhere(frame, mine):
                return
            taken = _take_matching(mine, self, None) if mine else None
            if taken is None:
                raise self._unmatched_exit()
        entry = taken[0]
        if entry.device is None:
            return      # left out of order: a newer block is still inside, the device stays (_take_out)
        if self._pid != _fin.pid:
            # a child forked inside the block: the entry goes, and no runtime call (r56)
            raise _fin.forked_error(self._backend)
        self._backend.set_device(entry.device)

    def _unmatched_exit(self) -> RuntimeError:
        return RuntimeError(f"{self!r}.__exit__ without a matching __enter__ on this thread: the current "
                            f"stream is per thread, so leave `with stream:` on the thread that entered it")

    def _exit_elsewhere(self, frame: int, mine: Optional["_Stack"]) -> bool:
        """Leave a ``with self:`` block that another thread entered, from the frame that entered
        it: a generator or coroutine suspended inside the block and closed by a collection that
        runs in this thread (CPython collects in whichever thread allocates, and closes the
        generator there).  Its entry is taken out of the entering thread's stack as an
        out-of-order exit there (``_take_out``), so it keeps nothing alive; that thread's
        current device stays (only a thread sets its own), and this thread's current stream
        and device are untouched.  (torch's StreamContext restores its saved streams on the
        exiting thread: the entering thread's streams became this one's.)  False when no
        other thread has such a block."""
        for ref in list(_stacks.values()):      # (a C copy: no thread switch midway)
            stack = ref()
            if stack is not None and stack is not mine and stack and _take_matching(stack, self, frame):
                return True
        return False

    # -- lifetime ------------------------------------------------------------------
    def close(self) -> None:
        """Destroy the stream (queued work still completes).  Idempotent; default streams can't be
        closed.  A foreign stream (:meth:`from_handle`) is not destroyed: its wrapper is closed."""
        if not (self._owned or self._foreign):
            raise RuntimeError("the default stream belongs to the runtime and cannot be closed")
        if self._pid != _fin.pid:
            raise _fin.forked_error(self._backend)
        if self._closed:
            return
        if self._capturing():
            # Destroying a stream that takes part in a capture leaves the capture without an
            # end: every later sync, free and capture in the process would fail.  (A closed
            # foreign wrapper could not end it either.)
            raise self._capture_underway()
        if not _claim_close(self):
            return      # another thread's close() got there first
        if self._capturing():
            # Checked again once claimed: another thread's capture_begin between the check above
            # and the claim began a capture on it (capture_begin checks the claim after beginning,
            # so one of the two always sees the other).
            self._closed = False
            raise self._capture_underway()
        table = getattr(_tls, "current", None)
        if table is not None and table.get(self._index) is self:
            del table[self._index]
        if not self._owned:
            # The last wrapper of the handle: accel forgets it (_ForeignAnchor), which lets its
            # owner destroy it, so only once no call on this wrapper is in flight (the last one
            # drops the anchor as it ends).  (Dropped at once, the allocators forgot the handle
            # while a call in another thread still queued work on it.)
            _close_release(self, _drop_anchor, self)
            return
        if _live_streams.get((self._index, self._handle)) is self:
            del _live_streams[(self._index, self._handle)]     # the driver may reuse the handle
        try:
            _close_release(self, _destroy, self._backend, self._index, self._handle, True, _fin.key_of(self._own))
        except BaseException:
            if _fin.registered(self._own):
                # the destroy never reached the runtime, or failed there: close() again (or the
                # finalizer) retries.  (After an interrupt as it returned, the handle may be
                # another stream's already: closed it stays.)
                self._closed = False
                _live_streams[(self._index, self._handle)] = self
            raise

    def _capturing(self) -> bool:
        """True when this stream takes part in a capture (its handle names no other stream)."""
        backend = self._backend
        return (not self._shared and backend.captures_underway()
                and backend.capture_id(self._handle) is not None)

    def _capture_underway(self) -> RuntimeError:
        return RuntimeError(f"cannot close {self!r}: a graph capture on it is underway; end the capture "
                            f"first (capture_end(), or leave the `with graph:` block), then close it")

    def __del__(self, _finalizing=sys.is_finalizing):
        if _finalizing():
            return      # interpreter exit: module globals may be gone; the process takes it all
        try:
            # Never waits on a lock (hooks try theirs; see accel._finalize); nothing in a forked child.
            if (getattr(self, "_owned", False) and not self._closed and self._pid == _fin.pid
                    and _lazy.is_initialized()):
                # during a collection, open until its cycle is gone: another finalizer may still use it.
                # (A Ctrl-C as this __del__ starts leaves the destroy to the registry: accel._finalize.)
                _fin.release_on_del(self, _destroy, self._backend, self._index, self._handle, False,
                                    _fin.key_of(self._own))
        except KeyboardInterrupt:
            # _live_streams' weak reference to this stream goes now: its callback, Python code run
            # as the stream is freed, would be where the Ctrl-C raised again lands (and is lost)
            key = (getattr(self, "_index", None), getattr(self, "_handle", None))
            if _live_streams.get(key) is self:
                del _live_streams[key]
            _fin.RAISE_AGAIN[_fin.interrupt_key()]    # a Ctrl-C handled in here reaches the program (r62)


class _Entry:
    """One open ``with stream:`` block on a thread's stack: the device and the stream of the
    entered stream's device that were current at its entry (restored at its exit), the stream
    entered, and ``id()`` of the frame that entered it.  Mutable, so that passing saved state on
    (``_take_out``) allocates nothing under the stack's lock."""

    __slots__ = ("device", "stream", "entered", "frame")

    def __init__(self, device: Optional[int], stream: "Stream", entered: "Stream", frame: int):
        self.device, self.stream, self.entered, self.frame = device, stream, entered, frame

    def __repr__(self):
        return f"<with {self.entered!r}: saved device {self.device}, {self.stream!r}>"


class _Stack(list):
    """A thread's open ``with stream:`` blocks, oldest first, with its current-stream table
    (``current``).  ``lock`` is held for each change: another thread's collection may close a
    block of this thread (Stream._exit_elsewhere).  Nothing is allocated while it is held, so
    no collection (and no finalizer that leaves a block) starts inside it."""

    __slots__ = ("lock", "current", "__weakref__")


#: Every thread's _Stack by id, for Stream._exit_elsewhere: a thread's goes with its
#: thread-local data (the weak reference's callback).  (A list is unhashable: no WeakSet.)
_stacks: Dict[int, "weakref.ref[_Stack]"] = {}


def _drop_stack(ref: "weakref.ref[_Stack]", key: int) -> None:
    if _stacks.get(key) is ref:
        del _stacks[key]


def _new_stack() -> _Stack:
    stack = _Stack()
    stack.lock = _locks.Lock("entering or leaving a `with stream:` block")
    stack.current = _current_table()
    key = id(stack)
    _stacks[key] = weakref.ref(stack, functools.partial(_drop_stack, key=key))
    _tls.stack = stack
    return stack


def _take_matching(stack: _Stack, stream: "Stream", frame: Optional[int]) -> Optional[tuple]:
    """Take the newest entry of ``stream`` out of ``stack`` (entered by frame ``frame``, any when
    None): ``_take_out``'s pair, or None when there is none.  The pair is kept by the caller
    until the lock is released: a stream it replaced as current may be the last reference, and
    its ``__del__`` (a collection) must not run under the lock."""
    with stack.lock:
        for k in range(len(stack) - 1, -1, -1):
            entry = stack[k]
            if (frame is None or entry.frame == frame) and (entry.entered is stream or entry.entered == stream):
                return _take_out(stack, k, stream._index)
    return None


def _take_out(stack: _Stack, k: int, index: int) -> tuple:
    """Take entry ``k`` (its stream on device ``index``) out of ``stack``, under its lock, and
    restore what it saved in the stack's thread.  The newest entry restores that thread's stream
    of ``index``; its device is left to the caller (``device`` stays set).  An older one (asyncio
    tasks of one thread, each in its own ``with stream:``, leave in any order; issue r15) passes
    what it saved to the entries entered after it: the next one restores this one's device when
    it exits, and the next one on device ``index`` restores this one's stream.  With none on
    ``index``, that stream is restored now.  The current device stays (a newer block is still
    inside): ``device`` is set to None.  (Restoring the saved pair at once would make a newer
    block's stream, maybe another device's, lose its place: r4's bug.)  Returns ``(entry, the
    stream it replaced)``, for the caller to drop once the lock is released."""
    entry = stack.pop(k)
    if k < len(stack):
        stack[k].device = entry.device
        for j in range(k, len(stack)):
            if stack[j].entered._index == index:
                replaced, stack[j].stream = stack[j].stream, entry.stream
                entry.device = None
                return entry, replaced
        entry.device = None
    table = stack.current
    if entry.stream._closed:
        # Closed in the body: the default stream is current again, as after closing the current
        # stream (restoring it made every later call on the current stream raise).
        return entry, table.pop(index, None)
    replaced = table.get(index)
    table[index] = entry.stream
    return entry, replaced


def ExternalStream(stream_ptr: int, device: DeviceLike = None) -> Stream:
    """torch's name: ``torch.cuda.ExternalStream(stream_ptr, device=None)`` is
    :meth:`Stream.from_handle` (a stream another library owns; accel never destroys it)."""
    return Stream.from_handle(stream_ptr, device)


def get_stream_from_external(data_ptr: int, device: DeviceLike = None) -> Stream:
    """torch's name: ``torch.cuda.get_stream_from_external(data_ptr, device=None)`` (and
    ``torch.xpu.get_stream_from_external``, for a SYCL queue) is :meth:`Stream.from_handle`:
    a :class:`Stream` wrapping a stream another library made and owns.  ``data_ptr`` is the
    stream handle as an int (CUDA: the ``cudaStream_t`` value); ``device`` (default: the
    stream's own device where the runtime can tell, else the current device) must be the
    stream's device, and a wrong one is refused where the runtime can tell.  accel never
    destroys the stream: the owner keeps it alive while a wrapper is in use.  Bad values
    raise as :meth:`Stream.from_handle` does (TypeError, ValueError, InvalidDeviceError)."""
    return Stream.from_handle(data_ptr, device)


class _NoScope:
    __slots__ = ()

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        pass


_NO_SCOPE = _NoScope()


def _current_table() -> Dict[int, Stream]:
    table = getattr(_tls, "current", None)
    if table is None:
        table = _tls.current = {}
    return table


def default_stream(device: DeviceLike = None) -> Stream:
    """The default stream of ``device`` (the current device when None), as
    ``torch.cuda.default_stream(device=None)``."""
    backend = _lazy.lazy_init()
    index = _index_for(device, minus_one_current=True)
    stream = _defaults.get(index)
    if stream is None:
        with _defaults_lock:
            stream = _defaults.get(index)
            if stream is None:
                stream = _defaults[index] = Stream._wrap(backend, index, backend.default_stream(index))
    return stream


def current_stream(device: DeviceLike = None) -> Stream:
    """The calling thread's current stream on ``device`` (the current device when None), as
    ``torch.cuda.current_stream(device=None)`` and ``torch.accelerator.current_stream``."""
    # Hot path (called for every queued operation): no helper calls beyond get_device.
    if device is None:
        index = (_lazy.ready or _lazy.lazy_init()).get_device()
    elif type(device) is int and device != -1:
        # (an object's own device, say) checked only when neither table below has it: both
        # hold checked indices only, and default_stream checks the rest as _index_for would
        _lazy.ready or _lazy.lazy_init()    # (initialized, or the forked child's error, first)
        index = device
    else:
        index = _index_for(device, minus_one_current=True)     # (checked before anything starts, r69j)
    try:
        return _tls.current[index]
    except (AttributeError, KeyError):
        pass
    stream = _defaults.get(index) or default_stream(index)
    _current_table()[index] = stream    # the thread's current stream is the default until set
    return stream


def set_stream(stream: Stream) -> None:
    """Make ``stream`` (a Stream, or any object with ``__cuda_stream__``) the calling thread's
    current stream, switching the current device to the stream's device first (as
    ``torch.accelerator.set_stream``)."""
    stream = _as_stream(stream, "set_stream(stream)")
    stream._live()
    backend = _lazy.lazy_init()
    if stream._backend is not backend:
        raise RuntimeError(f"stream belongs to {stream._backend.name}, "
                           f"but the current accelerator is {backend.name}")
    if backend.get_device() != stream._index:
        backend.set_device(stream._index)
    _current_table()[stream._index] = stream


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
            raise NotImplementedError(
                "Event(interprocess=True): accel has no inter-process events (torch's ipc_handle / "
                "from_ipc_handle); share results between processes through host memory instead")
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
        raise NotImplementedError("Event.ipc_handle(): accel has no inter-process events (Event(interprocess=True) "
                                  "is refused too); share results between processes through host memory instead")

    @classmethod
    def from_ipc_handle(cls, device: DeviceLike, handle: bytes) -> "Event":
        """torch's event from another process's ``ipc_handle()``: refused (NotImplementedError)."""
        raise NotImplementedError("Event.from_ipc_handle(): accel has no inter-process events; share results "
                                  "between processes through host memory instead")

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


def _as_stream(obj, what: str) -> Stream:
    """``obj`` as an accel Stream, for every argument that takes one (``what`` names it in
    errors): a Stream as it is; an object with the CUDA stream protocol
    (``__cuda_stream__() -> (0, handle)``: cuda.core, CuPy and torch streams) as accel's own
    Stream of that handle (a default or accel-created stream) or a new foreign wrapper of it
    (:meth:`Stream.from_handle`, which takes the device from the runtime, else from the
    object's ``device_index``/``device_id``/``device``, else the current device).
    Anything else raises TypeError naming ``what``."""
    if isinstance(obj, Stream):
        return obj
    try:
        protocol = obj.__cuda_stream__
    except AttributeError:
        protocol = None
    if not callable(protocol):
        try:
            shown = repr(obj)
        except Exception:       # noqa: BLE001 - a broken __repr__ must not hide this error
            shown = "(unprintable)"
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise TypeError(f"{what}: expected an accel.Stream or an object with __cuda_stream__ (a cuda.core, "
                        f"CuPy or torch CUDA stream), got {type(obj).__name__} {shown}")
    name = type(obj).__name__
    handle = cuda_stream_handle(obj, what)
    backend = _lazy.lazy_init()
    if backend.name != "cuda":
        # torch.accelerator.set_stream: a stream of another device type is a RuntimeError
        raise InvalidDeviceError(f"{what}: {name} is a CUDA stream (__cuda_stream__) but the accelerator is "
                                 f"{backend.name}; pass an accel.Stream")
    return _foreign_stream(backend, handle, None, what, reuse=True, hint=_device_hint(obj))


def cuda_stream_handle(obj, what: str) -> int:
    """The cudaStream_t that ``obj.__cuda_stream__()`` names, checked: a ``(0, handle)`` tuple
    (version 0, cuda.core's) with an int handle >= 0 that fits in 64 bits; TypeError or
    ValueError naming ``what`` and the value otherwise."""
    name = type(obj).__name__
    value = obj.__cuda_stream__()
    if not isinstance(value, tuple) or len(value) != 2:
        raise TypeError(f"{what}: {name}.__cuda_stream__() returned {value!r}, not the protocol's "
                        f"(version, handle) tuple")
    version, handle = value
    if version != 0:
        raise ValueError(f"{what}: {name}.__cuda_stream__() speaks protocol version {version!r}; accel "
                         f"understands version 0 ((0, cudaStream_t as an int), cuda.core's); wrap the "
                         f"stream with accel.Stream.from_handle(handle, device) instead")
    if isinstance(handle, bool) or not isinstance(handle, int) or handle < 0:
        raise TypeError(f"{what}: {name}.__cuda_stream__() returned handle {handle!r}; the protocol's "
                        f"handle is the cudaStream_t as an int >= 0")
    check_handle_bits(handle, f"{what}: {name}.__cuda_stream__()")
    return handle


def check_handle_bits(handle: int, what: str) -> None:
    """Refuse a stream handle that does not fit in 64 bits: handles are pointers (cudaStream_t),
    and a C cast keeps the low 64 bits, so 2**64 would name the legacy default stream (NULL)."""
    if handle >= _HANDLE_LIMIT:
        raise ValueError(f"{what}: stream handle {handle:#x} does not fit in 64 bits; a stream handle is a "
                         f"pointer-sized unsigned int (cudaStream_t), pass the stream's own handle")


def _device_hint(obj) -> Optional[int]:
    """The device index a foreign stream object states (torch: ``device_index``; CuPy:
    ``device_id``; cuda.core: ``device.device_id``; torch: ``device.index``), or None."""
    for owner, names in ((obj, ("device_index", "device_id")), (None, ("index", "device_id"))):
        if owner is None:
            try:
                owner = obj.device
            except Exception:
                return None
        for attr in names:
            try:
                value = getattr(owner, attr)
            except Exception:
                continue
            if type(value) is int and value >= 0:
                return value
    return None


def _foreign_stream(backend: Backend, handle: int, index: Optional[int], what: str, reuse: bool,
                    hint: Optional[int] = None) -> Stream:
    """A Stream for ``handle`` on device ``index`` (None: the stream's own, else ``hint``, else
    the current device), checked with the backend.  ``reuse``: accel's own Stream object where
    the handle is a default or live accel-created stream; otherwise always a new wrapper."""
    try:
        handle, actual = backend.foreign_stream(handle)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    if actual is not None:
        if index is not None and index != actual:
            raise InvalidDeviceError(f"{what}: stream {handle:#x} belongs to device {actual}, not device "
                                     f"{index}; pass device={actual} (or None)")
        index = actual
    elif index is None:
        if hint is not None:
            check_stream_range(hint)
            index = hint
        else:
            index = backend.get_device()
    key = (index, handle)
    if handle == backend.default_stream(index):
        return default_stream(index) if reuse else Stream._wrap(backend, index, handle, foreign=True)
    own = _live_streams.get(key)
    if own is not None and not own._closed:
        # accel's own stream: its close() forgets the handle, no anchor needed
        return own if reuse else Stream._wrap(backend, index, handle, foreign=True)
    with _foreign_lock:
        anchor = _foreign.get(key)
        if anchor is None or anchor.dying:     # (dying: its __del__ runs, see _ForeignAnchor)
            anchor = _foreign[key] = _ForeignAnchor(backend, index, handle)
    return Stream._wrap(backend, index, handle, anchor=anchor)


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
    from ._device import accelerator_type, is_torch_device, parse_index
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


def _reset() -> None:
    global _tls
    _tls = threading.local()
    _stacks.clear()
    _defaults.clear()
    _live_streams.clear()
    _capture_events.clear()
    _foreign.clear()


_lazy.register_reset_hook(_reset)
