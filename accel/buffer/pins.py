"""Pins: the memory of a Buffer stays while a call or an export uses it.

A Buffer method that hands the memory to the backend (a copy, a fill, a stream use: the
``_in_use`` wrapper of :mod:`.buffer_class`), and accel code that queues work on a Buffer
(kernel launches, random fills: :func:`_begin_use`/:func:`_end_use`), hold a pin on it for the
call; a DLPack export holds one (:class:`_Pin`) until its deleter runs.  A close() in another
thread meanwhile closes the buffer for accel's use but leaves the memory to the last pin, which
releases it (``Buffer._deferred``, taken by exactly one caller).

The uses a queued copy makes of a stream are noted once its work was queued (:class:`_Noting`),
so a refused vendor call changes nothing; a note that fails drains the stream
(:func:`_drain`).  :func:`_released` drops an export mark (``streams._ExportMark``).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from .. import _finalize as _fin
from .. import _lazy
from ..backends._signals import deferred
from ..streams import Stream, _capture_events
from .capture import captured_table, note_captured
from .release import _free, _free_from_finalizer

if TYPE_CHECKING:
    from .buffer_class import Buffer


def _call_pinned(held, method, self, args, kwargs):
    """``method(self, *args, **kwargs)`` with a pin on each Buffer of ``held`` until it returns."""
    keys = [_begin_use(b) for b in held]
    try:
        return method(self, *args, **kwargs)
    finally:
        for b, key in zip(held, keys):
            _end_use(b, key)


def _begin_use(buf) -> object:
    key = object()
    buf._pins.add(id(key))
    return key


def _end_use(buf, key) -> None:
    buf._pins.discard(id(key))
    if buf._deferred and not buf._pins and buf._pid == _fin.pid and buf._backend is _lazy._initialized_backend:
        call = buf._unpinned_release()      # closed by another thread meanwhile: the last use frees
        if call is not None:
            _fin.finalize(call[0], *call[1])


@deferred
def pin_noted(refs, pinned: list) -> None:
    """Pin the live Buffers among ``refs`` (weak references: a graph's, ``capture.note_captured``)
    for a replay, appending ``(buffer, key)`` to the caller's ``pinned`` (for :func:`record_noted`
    and :func:`unpin_noted`); one closed before its pin (maybe freed already) is left out.  With
    signals deferred, into the caller's list: a Ctrl-C leaves every pin taken where the caller's
    ``finally`` finds it (r81a)."""
    for ref in refs:
        buf = ref()
        if buf is None or buf._closed:
            continue
        key = _begin_use(buf)
        if buf._closed:
            _end_use(buf, key)
            continue
        pinned.append((buf, key))


def record_noted(pinned, stream: Stream) -> None:
    """After a replay queued on ``stream``: each pinned buffer's use of it, as a call's
    (``Buffer._record``: the allocator keeps the block from reuse until the replay ran, and the
    stream becomes the buffer's last-use stream) (r73e, r80a)."""
    for buf, _ in pinned:
        buf._record(stream)


@deferred
def unpin_noted(pinned: list) -> None:
    """End the pins :func:`pin_noted` took, emptying ``pinned`` (signals deferred: all of them)."""
    while pinned:
        buf, key = pinned.pop()
        _end_use(buf, key)


def _released(mark) -> None:
    """Release an export mark (``streams._ExportMark``) or nothing; None, for the caller's variable."""
    if mark is not None:
        mark.release()
    return None


def _drain(stream: Stream) -> None:
    """Wait for ``stream`` on an error path, keeping the error being raised."""
    try:
        stream.synchronize()
    except Exception:
        pass


class _Noting:
    """``with _Noting(stream, buf, ...) as noting:`` around the vendor calls that queue a copy on
    ``stream`` reading or writing the Buffers given; the body sets ``noting.queued = True`` after
    each call that queued work.  The buffers' uses of ``stream`` (the allocator's record_stream,
    the last-use stream: ``Buffer._record``) are noted as the block ends, once the work was
    queued, so a vendor call that refused the copy (an Exception, nothing queued) leaves them as
    they were.  They are noted too when the block raises after something was queued, or is
    interrupted (a KeyboardInterrupt may land as a call returns, after it queued): the uses then
    cover whatever may run.  A note that fails drains the stream (its work is then done: nothing
    is left to protect) and its error propagates.

    The caller holds a pin on each buffer (``_in_use``) and a hold on the stream (``_Hold``), as
    ``_record`` asks: a close() of a buffer by another thread meanwhile still records the use."""

    __slots__ = ("stream", "buffers", "queued", "captured")

    def __init__(self, stream: Stream, *buffers: "Buffer"):
        self.stream, self.buffers, self.queued, self.captured = stream, buffers, False, None

    def __enter__(self) -> "_Noting":
        if self.stream._foreign:
            # before anything is queued: a destroyed one's handle may name another stream by now
            # (and, recorded, would fail every later free of the memory: see Buffer._record)
            self.stream._check_alive()
        if _capture_events:
            self.captured = captured_table(self.stream)     # before anything is queued: it may raise
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is not None and issubclass(kind, Exception) and not self.queued:
            return False        # refused before anything was queued: nothing to note
        try:
            for buf in self.buffers:
                buf._record(self.stream)
            if self.captured is not None:
                note_captured(self.captured, self.buffers)
        except BaseException:
            _drain(self.stream)
            raise
        return False


class _Pin:
    """Held by a DLPack export of a Buffer: the buffer's memory outlives an explicit close()
    until the export's deleter drops the pin (see Buffer.close).  No lock: set.add/discard and
    list.pop are atomic, and the release goes through accel._finalize's rules."""

    __slots__ = ("_buf",)

    def __init__(self, buf: Buffer):
        self._buf = buf
        buf._pins.add(id(self))

    def __del__(self, _finalizing=sys.is_finalizing):
        if _finalizing():
            return      # interpreter exit: module globals may be gone; the process takes it all
        try:
            buf = self._buf
            buf._pins.discard(id(self))
            if buf._pid != _fin.pid or buf._backend is not _lazy._initialized_backend:
                return      # a forked child, or a runtime that was reset: nothing of the parent's is freed
            call = buf._unpinned_release() if buf._deferred else None
            if call is not None:
                # a finalizer: the free must not wait for the allocator's lock, which another
                # thread may hold while it waits for a capture gate this thread holds (r68i: a
                # capture_end running an imported buffer's release under the gate deadlocked
                # with a close() on another thread)
                fn = _free_from_finalizer if call[0] is _free else call[0]
                _fin.finalize(fn, *call[1])
        except KeyboardInterrupt:
            _fin.RAISE_AGAIN[_fin.interrupt_key()]    # a Ctrl-C handled in here reaches the program (r62)
