"""The :class:`Stream` class, and :class:`on_device`, the device guard of every call that needs a
device current.  Where the backend's default stream is one handle for every device (CUDA's
legacy stream 0), every call on a default stream runs with its device current
(``Stream._shared``); created streams carry their device in the handle.  ``with stream:`` keeps
its entries on the thread's stack (accel.streams.current), matched at exit by the frame that
entered it."""

from __future__ import annotations

import contextlib
import operator
import sys
from types import CodeType
from typing import Optional, Tuple

from .. import _finalize as _fin
from .. import _lazy
from .._copying import refuse_copies as _refuse_copies
from .._device import DeviceLike, check_range, check_stream_range, device, device_index
from .._errors import AcceleratorError
from ..backends._signals import deferred as _signals_deferred
from ..backends.base import Backend
from . import _state
from ._state import _foreign, _live_streams, _stacks
from .destroy import _destroy
from .uses import _claim_close, _close_release, _closed_during_use, _drop_anchor, _Use

#: torch's c10::DeviceType numbers of accel's accelerators (Stream.device_type).
_DEVICE_TYPES = {"cuda": 1, "xpu": 12, "mps": 13}
#: Frames that can be suspended inside a with block and resumed on another thread: code flags
#: CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR (inspect's values; inspect is not imported
#: for them, as it costs milliseconds at import).
_SUSPENDABLE = 0x20 | 0x80 | 0x200
_CONTEXTLIB = contextlib.__file__


def _block_frame(stream: "Stream"):
    """The frame running the ``with`` statement, for the caller of Stream.__enter__/__exit__: past
    contextlib's frames, because ExitStack.enter_context calls __enter__ and ExitStack.__exit__
    calls __exit__ (from the one frame that holds the ExitStack's with statement) (r75e), and,
    for a Stream subclass, past its own code on the way from the with statement to the base
    class's method: methods, helpers, property accessors, decorators' wrappers (r80a, r82a,
    r83a).  A generator or coroutine frame is never passed: a block left from another thread (a
    generator closed there) is found by that frame, the with statement's.  (Frames are matched
    by code, never by reading ``f_locals``: in CPython < 3.13 that keeps a snapshot of the with
    statement's locals, a deleted Stream among them, alive until the frame returns.)"""
    frame = sys._getframe(2)
    codes = _subclass_codes(type(stream)) if type(stream) is not Stream else ()
    while frame.f_back is not None and (
            frame.f_code.co_filename == _CONTEXTLIB
            or (frame.f_code in codes and not frame.f_code.co_flags & _SUSPENDABLE)):
        frame = frame.f_back
    return frame


def _subclass_codes(cls: type) -> set:
    """The code objects a Stream subclass (and its mixins) defines, read now (a method patched
    after the class's first block counts: r83a): its functions, static and class methods,
    property accessors, and the functions a decorator's wrapper wraps (``__wrapped__``) or closes
    over.  What cannot be read (a lazy proxy whose reads raise) is passed over (r84a, r85a)."""
    codes: set = set()
    seen: dict = {}
    for klass in cls.__mro__:
        if klass is not Stream and klass is not object:
            for value in list(vars(klass).values()):
                try:
                    if isinstance(value, property):
                        for accessor in (value.fget, value.fset, value.fdel):
                            _add_codes(accessor, codes, seen)
                    else:
                        _add_codes(getattr(value, "__func__", value), codes, seen)
                except Exception:       # noqa: BLE001 (see the docstring)
                    continue
    return codes


def _add_codes(fn, codes: set, seen: dict, depth: int = 0) -> None:
    """Add ``fn``'s code, then those of what it wraps or closes over, up to 4 steps from a class
    attribute; each function walked again only from a shorter path (r84a: functions closing over
    one another were walked once per path; r85a: one first met at the limit hid what it wraps)."""
    try:
        code = getattr(fn, "__code__", None)
    except Exception:       # noqa: BLE001 (a proxy)
        return
    if type(code) is not CodeType or depth > 4 or seen.get(id(fn), 5) <= depth:
        return
    seen[id(fn)] = depth
    codes.add(code)
    try:
        inner = [getattr(fn, "__wrapped__", None)]
    except Exception:       # noqa: BLE001
        inner = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            inner.append(cell.cell_contents)
        except Exception:   # noqa: BLE001 (an empty cell: ValueError)
            continue
    for item in inner:
        _add_codes(item, codes, seen, depth + 1)


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
        # A handle names one live object in the process (a cudaStream_t, a command list): any
        # device's wrapper of it is stale, its stream destroyed behind accel's back (r82a: a
        # foreign reset of device 0 let device 1's next stream reuse the handle)
        for other in range(backend.count()):
            stale = _live_streams.get((other, handle))
            if stale is not None:
                _forget_destroyed(stale)
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
        from .._device import _as_index
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
              anchor: Optional[object] = None) -> "Stream":
        """A Stream object for a handle accel does not own: a default stream, or (``foreign``,
        or with an ``anchor``: a _ForeignAnchor, or accel's own Stream of the handle, kept alive)
        one that :meth:`close` only forgets."""
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
            held = _state._tls.__dict__.get("held")
            if held and id(self) in held:
                return      # closed by another thread during this thread's _Hold: valid until it ends
            raise RuntimeError(f"{self!r} was closed; create a new Stream")

    def _check_alive(self) -> None:
        """For a foreign wrapper (:meth:`from_handle`): ValueError when the runtime says the
        stream is no longer alive (its owner destroyed it while accel still wraps it)."""
        anchor = self._anchor
        if isinstance(anchor, Stream) and anchor._closed:
            # a wrapper of accel's own stream, closed since: its handle may name a newer stream (r81a)
            raise ValueError(f"{self!r} cannot be used: it wraps {anchor!r}, which was closed (its handle may "
                             f"name another stream by now); nothing was done")
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
        if self._foreign:
            self._check_alive()     # before the record on ``stream``: nothing done when refused
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
        entry = _Entry(None, None, self, id(_block_frame(self)))
        stack = _state._tls.__dict__.get("stack")
        if stack is None:
            stack = _new_stack()
        while True:
            # The saved device and stream are read after every allocation above, and again when a
            # collection during the reads closed a block of this thread (a generator suspended in
            # one): that block's exit restored what it saved, which this entry must save in turn,
            # not the dead block's stream (r75e; torch's StreamContext has the same window)
            changes = stack.changes
            device, current = backend.get_device(), current_stream(self._index)
            with stack.lock:
                if stack.changes == changes:
                    entry.device, entry.stream = device, current
                    stack.append(entry)
                    break
        try:
            set_stream(self)
        except BaseException:
            with stack.lock:             # __exit__ will not run: leave no entry for another one to pop
                if entry in stack:       # (by identity: _Entry has no __eq__)
                    stack.remove(entry)
                    stack.changes += 1
            raise
        return self

    def __exit__(self, *exc) -> None:
        caller = _block_frame(self)
        frame = id(caller)
        mine = _state._tls.__dict__.get("stack")
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
                if caller.f_code.co_flags & _SUSPENDABLE:
                    # a generator or coroutine entered the block on a thread that has ended since
                    # (no stack holds its entry): that thread's streams went with it, and this
                    # thread's were never changed by the block, so nothing is left to restore
                    return
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
        table = getattr(_state._tls, "current", None)
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


def _forget_destroyed(stale: Stream) -> None:
    """``stale``'s handle was destroyed behind accel's back and the runtime has just given it to a
    new stream (accel's close() forgets a handle before destroying it): a foreign library's
    cudaDeviceReset "destroys and cleans up all resources associated with the current device"
    (CUDA Runtime API).  ``stale`` is closed without a destroy, so its close() or collection leaves
    the new stream alone (r80a)."""
    _fin.owned.pop(_fin.key_of(getattr(stale, "_own", None)), None)
    stale._closed = True


class _NoScope:
    __slots__ = ()

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        pass


_NO_SCOPE = _NoScope()


# (at the end: these modules use Stream, and it uses them, at call time)
from .current import (_Entry, _new_stack, _Stack, _take_matching, current_stream, default_stream,  # noqa: E402
                      set_stream)
from .event import Event  # noqa: E402
from .foreign import _as_stream, _foreign_stream, check_handle_bits  # noqa: E402
