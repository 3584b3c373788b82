"""The destroy of owned streams and events, and the hooks that hear of it first
(:func:`on_stream_destroy`: the allocators forget what they keep by the handle); which handles
accel hears of before they go (:func:`announced`)."""

from __future__ import annotations

from typing import Callable, List

from .. import _finalize as _fin
from ..backends.base import Backend
from ._state import _foreign, _live_streams

_destroy_hooks: List[Callable[[Backend, int, int, bool], bool]] = []


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
