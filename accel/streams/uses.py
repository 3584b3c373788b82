"""Uses of a Stream's or Event's handle in flight, and close() during one: :class:`_Use` (one
call), :class:`_Hold` (a whole operation queued on a stream), :class:`_ExportMark` (a stream an
exported object names); a close() meanwhile leaves the destroy to the last use
(:func:`_close_release`, :func:`_closed_during_use`), so the driver never hands the handle to a
newer stream or event while a call still passes it."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Optional

from .. import _finalize as _fin
from .. import _locks
from ..backends._signals import deferred as _signals_deferred
from . import _state

if TYPE_CHECKING:
    from .stream import Stream

#: Makes "closed yet? then mark it closed" one step, so two threads closing one Stream or Event
#: destroy its handle once (the driver gives a freed handle value to the next object it makes).
#: Held for no vendor call, so no finalizer ever waits for it; but Event._made registers the
#: handle's destroy under it (_fin.own: allocations, where a collection may run a user's gc
#: callback that closes another Event), so it is an accel._locks.Lock (r71a): that close is
#: refused instead of waiting forever on its own thread.  (A forked child finds it free.)
_close_lock = _locks.Lock("closing a Stream or Event")


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
        held = _state._tls.__dict__.get("held")
        if held is None:
            held = _state._tls.held = []
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
