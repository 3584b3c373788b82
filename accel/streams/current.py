"""The per-thread current stream: each thread's table of current streams by device (the
device's default stream until set), :func:`current_stream`, :func:`set_stream`,
:func:`default_stream`, and each thread's stack of open ``with stream:`` blocks
(:class:`_Entry`, :class:`_Stack`), which another thread's collection may close
(Stream._exit_elsewhere), so each stack has a lock and all are listed in ``_state._stacks``."""

from __future__ import annotations

import functools
import weakref
from typing import Dict, Optional

from .. import _lazy, _locks
from .._device import DeviceLike
from . import _state
from ._state import _defaults, _drop_stack, _stacks

_defaults_lock = _locks.Lock("making a device's default stream")  # (r68i: a __del__ run inside it)


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
    no collection (and no finalizer that leaves a block) starts inside it.  ``changes`` counts the
    entries taken out (Stream.__enter__ reads the saved state again when a collection closed a
    block meanwhile)."""

    __slots__ = ("lock", "current", "changes", "__weakref__")


def _new_stack() -> _Stack:
    stack = _Stack()
    stack.lock = _locks.Lock("entering or leaving a `with stream:` block")
    stack.current = _current_table()
    stack.changes = 0
    key = id(stack)
    _stacks[key] = weakref.ref(stack, functools.partial(_drop_stack, key=key))
    _state._tls.stack = stack
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
    stack.changes += 1
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


def _current_table() -> Dict[int, Stream]:
    table = getattr(_state._tls, "current", None)
    if table is None:
        table = _state._tls.current = {}
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
        get_device = _lazy.ready_get_device
        index = get_device() if get_device is not None else _lazy.lazy_init().get_device()
    elif type(device) is int and device != -1:
        # (an object's own device, say) checked only when neither table below has it: both
        # hold checked indices only, and default_stream checks the rest as _index_for would
        _lazy.ready or _lazy.lazy_init()    # (initialized, or the forked child's error, first)
        index = device
    else:
        index = _index_for(device, minus_one_current=True)     # (checked before anything starts, r69j)
    try:
        return _state._tls.current[index]
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


# (at the end: stream.py uses these at call time, and these use Stream)
from .foreign import _as_stream  # noqa: E402
from .stream import Stream, _index_for  # noqa: E402
