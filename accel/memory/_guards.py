"""When an allocator may act: whether a stream capture is underway, and the lock probe.

Shared by the three allocators (``_caching``'s device caching allocator, ``_host``'s pinned one,
``_async``'s cudaMallocAsync one).  While any capture is underway, event queries and synchronizes,
device frees and synchronous work would invalidate a global-mode capture (CUDA Programming Guide,
"Prohibited and Unhandled Operations"), so each allocator asks :func:`capture_underway` first,
under the backend's capture gate so that no capture begins in between.  Each allocator's ``with``
takes :func:`probe` of its lock: re-entry from a signal handler, gc callback or ``__del__`` is
refused instead of corrupting half-done work.
"""

from __future__ import annotations

from .. import _locks

# Captures begun through begin_allocate_to_pool, not yet ended, over every allocator
# of the process: a global-mode capture on one device forbids event queries on all.  One
# entry each, in a list: append and pop are atomic (no lock), so a _locks.publish step can
# take one out together with the routes it ends.
pool_captures: list = []


def capture_underway(backend) -> bool:
    """True while a stream capture is underway in this process (begun by accel's
    graphs, or through ``backend``): event queries and synchronizes, device
    frees and synchronous work would then invalidate a global-mode capture.
    A capture begun by another library outside the backend is not seen."""
    return bool(pool_captures) or backend.captures_underway() > 0


def unless_capturing(be, fn, *args) -> bool:
    """``fn(*args)`` unless a capture is underway, with no capture beginning in between
    (``be.capture_gate``: fn's queries, synchronizes and frees would invalidate it); whether it ran."""
    with be.capture_gate:
        if capture_underway(be):
            return False
        fn(*args)
        return True


def count_captures(n: int) -> None:
    if n > 0:
        pool_captures.extend([None] * n)
    elif n < 0:
        del pool_captures[n:]


def forget_captures() -> None:
    """The allocators were dropped (lazy reset, fork): so were their captures."""
    del pool_captures[:]


def _never() -> bool:
    return False


def gate_owned(be):
    """"Does this thread hold the lock the backend takes inside allocator paths": the capture
    gate's (a C method); on Metal, which has no gate, its backend lock's (r69h: a gc callback
    run while a copy held it closed a Buffer, as another thread's free held the allocator's lock
    and recorded an event, which waits for the backend lock)."""
    owned = getattr(be.capture_gate, "_is_owned", None)
    if owned is None:
        owned = getattr(getattr(be, "_lock", None), "owned", None)
    return owned or _never


def probe(lock, what: str, gate_owned=_never):
    """What an allocator's ``with`` takes instead of ``lock`` (an RLock) itself.

    * This thread already holds ``lock``: refused.  A signal handler, a gc callback or a
      ``__del__`` that calls accel from inside the allocator would re-enter its half-done work
      (r69h: such calls waited forever on the plain lock of before).
    * The collector runs on this thread, or this thread holds the backend's capture gate
      (``gate_owned``; every path takes an allocator's lock before the gate, so a thread that
      holds the gate and waits for an allocator's lock is user code run inside accel, r69h:
      a gc callback at a collection's "stop", inside a pinned free, closing a device Buffer
      while another thread's free held that device's lock and waited for the gate): a
      bounded ``accel._locks.held``, which waits a bounded time, then raises instead of
      hanging.  Its wait is the hold: a probe that waited, let go, and then took the lock with
      ``with`` let another thread in between (r70a: a free that then waited for the gate this
      thread held, a deadlock).
    * Otherwise ``lock`` itself: ``with`` gets its C methods, which CPython never leaves held on
      a KeyboardInterrupt (BEFORE_WITH enters it with no signal check in between).

    Hot paths call it only when ``_locks._running or lock._is_owned() or gate_owned()``."""
    if lock._is_owned():
        raise _locks.finalizer_error(what, "would re-enter the caching allocator in the middle of "
                                     "this thread's own call (a signal handler, gc callback or __del__ "
                                     "that ran inside it); make the call after it returned")
    if _locks.collecting_here() or gate_owned():
        return _locks.held(lock, what, bounded=True)
    return lock
