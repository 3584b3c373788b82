"""How a Buffer's memory goes back.

Owned memory goes back to the device allocator it came from (:func:`_free`); a finalizer never
waits for the allocator's lock (:func:`_free_from_finalizer` defers the free to the next safe
point instead).  A non-owning buffer (``Buffer.from_ptr``, :func:`accel.from_dlpack`) frees
nothing: its release waits for the work queued on the streams it was used on, then drops its
owner (a DLPack capsule's deleter runs then, once), after the last capture when one is
underway (:func:`_release_foreign`).  Every release goes through ``accel._finalize``'s rules
(a runtime reset since, a forked child, a collection).
"""

from __future__ import annotations

from .. import _finalize as _fin
from .. import _lazy


def _free(backend, alloc, ptr: int) -> None:
    # ``backend`` first: accel._finalize drops the release when that runtime was reset since (a
    # new runtime's allocator may hold a live block at the same address).  ``alloc``: the
    # allocator the buffer came from (one per device until a runtime reset).
    alloc.free(ptr)


def _free_from_finalizer(backend, alloc, ptr: int) -> None:
    # A finalizer never waits for the allocator's lock (this thread may hold it: see
    # DeviceCachingAllocator.free_nowait); a busy lock defers the free to the next safe point.
    nowait = getattr(alloc, "free_nowait", None)       # (cudaMallocAsync's allocator has none)
    if nowait is None:
        alloc.free(ptr)
    elif not nowait(ptr):
        _fin.defer(_free, backend, alloc, ptr)


def _release_foreign(owner, backend, streams) -> None:
    """Hand a non-owning buffer's memory back: wait for the work queued on the streams it was
    used on (skipped for a runtime that was reset, and for a stream another library captures),
    then release ``owner`` (a DLPack capsule's deleter runs here, once).  A stream closed since
    still runs its queued work (cudaStreamDestroy returns at once) but takes no more calls: its
    device is synchronized instead.  While a capture is underway the whole release waits for the
    end of the last capture (the backend's queue of releases, run by the thread that ends it): a
    synchronize would invalidate another thread's global-mode capture, and no capture begins
    between the check and the waits (``backend.capture_gate``)."""
    from ..streams import _after_captures
    queued = False
    try:
        if backend is _lazy._initialized_backend:
            with backend.capture_gate:
                queued = _after_captures(backend, _release_foreign, owner, backend, streams)
                if not queued:
                    _wait_for_uses(backend, streams)
    finally:
        from .._dlpack import Imported
        if not queued and isinstance(owner, Imported):
            # (after the gate: the producer's deleter may free an accel Buffer, r69a)
            backend.after_gate(owner.release)
        elif not queued and owner is not None:
            # a from_ptr owner: its last reference (the caller's arguments) dies as this returns,
            # maybe under an outer hold of the gate (a gc callback that closed the Buffer inside a
            # free that holds it; r71a), and its __del__ may free an accel Buffer as a deleter may:
            # while this thread holds the gate, a reference waits for the next safe point
            from ..backends.base import _drop
            backend.after_gate(_drop, owner)


def _wait_for_uses(backend, streams) -> None:
    """_release_foreign's waits, no capture underway (errors dropped: the owner is released all
    the same)."""
    for stream in streams:
        try:
            if stream.closed:
                from .._dlpack import wait_for_closed
                wait_for_closed(backend, stream)
            elif not stream.is_capturing():
                stream.synchronize()
        except Exception:
            pass    # a failed wait (sticky error): the owner is released all the same


def _release_foreign_uses(owner, backend, uses: dict) -> None:
    """_release_foreign with the streams of ``uses`` as they are when it runs (a call in flight at
    close() notes its stream when its work is queued; during a collection, a finalizer that ran
    after the buffer's own may have used it on another stream)."""
    streams = tuple(uses.values())
    uses.clear()    # a closed buffer keeps no Stream alive (collection destroys a stream no one holds)
    _release_foreign(owner, backend, streams)
