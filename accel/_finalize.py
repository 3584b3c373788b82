"""Finalizers that never wait on a lock, and objects inherited by a forked child.

**Deferred while the collector runs (the choice, and why).**  A finalizer (``__del__`` of a
Buffer, Stream, Event or Graph, and everything it frees: pinned blocks, allocator events) runs
wherever the cyclic garbage collector happens to start, which is any Python allocation in any
thread: inside the caching allocator's critical section, inside a backend call holding the
backend's lock, inside a vendor library (the simulator allocates under its engine lock).
Releasing from there waits on a lock the same thread holds, forever.  Making the release
reentrant instead would need every one of those locks to be reentrant *and* every critical
section to tolerate a nested free halfway through (a split block not yet linked, a free list
mid-update), including the vendor's own, which are not ours to change.  So a release requested
while a collection is running is not done: it is appended to :data:`pending` (a
``collections.deque``, whose ``append``/``popleft`` are atomic and take no lock) and done by
:func:`drain` at the next entry of the API, where the calling thread holds no accel lock:
allocator ``malloc``/``free``/``stats``/``empty_cache`` (device and pinned), Stream and Event
creation and ``close``.  Outside a collection, releases run at once as before, so ``del buf``
still returns memory immediately.

The collector is seen through ``gc.callbacks`` (:mod:`accel._locks` notes the collecting thread
at "start" and clears it at "stop").  Only the thread that runs the collection defers: the
collector runs finalizers in the thread that started it, so another thread's explicit
``close()`` or last ``del`` cannot be inside the lock the collector interrupted, and runs at once (issue r18: while a collection's
finalizer waited on I/O or a stream, every other thread's releases used to be queued and
a loop of allocate/close ran out of memory).  :func:`drain` still waits for the end of any
collection: the releases that collection deferred may be for objects its garbage still uses
(another finalizer of the cycle).  Drained work holds only handles and pointers, never the
finalized object (no resurrection).  A vendor error (:class:`AcceleratorError`) in a
finalizer's release is tried once more at the next drain; when that fails too, the leak is
reported through ``sys.unraisablehook``, as Python reports an error in ``__del__``; other errors
(a runtime torn down) are swallowed.  State stays bounded by live objects: the queue holds only
releases of dead objects and empties at the next entry.

**Fork.**  Objects record the process that created them (:data:`pid`, updated in a forked
child without a system call per check).  In a child every method raises the error
``accel._lazy`` raises for new work there (:func:`forked_error`), and finalizers do nothing: the
handles belong to the parent's runtime, which the child must never call.  The child also drops
the parent's pending releases.

**A reset runtime.**  Tests switch simulators (``_lazy._reset_for_tests``), which drops the
runtime and its backend object.  A release whose backend (its first argument, or the object a
bound method belongs to) is not the live one is dropped: the new runtime recycles handle
values, so the stale handle may name one of its live objects.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from typing import Callable

from . import _lazy, _locks
from ._errors import AcceleratorError
from ._locks import collecting_here, collection_running, forget_collection
from .backends.base import Backend

__all__ = ["pending", "drain", "release", "finalize", "finalize_later", "release_on_del", "defer", "collecting", "pid",
           "forked_error", "no_drain", "releases_settled"]

#: Releases waiting for a safe point: (function, args) tuples.
pending: deque = deque()
#: Threads inside drain() (a thread in it does not enter it again): a release one took from
#: ``pending`` may not have run yet.
_drainers: set = set()
#: The process accel objects created now belong to (os.getpid(), refreshed at fork).
pid = os.getpid()

_tls = threading.local()


def collecting() -> bool:
    """True while the cyclic garbage collector runs on the calling thread (so the code running
    now may be a finalizer the collector started inside one of accel's locks)."""
    return collecting_here()


def defer(fn: Callable, *args) -> None:
    """Run ``fn(*args)`` at the next safe point (see the module docstring)."""
    pending.append((fn, args))


def drain() -> None:
    """Run the deferred releases now.  Call only where this thread holds no accel or vendor
    lock; does nothing while a collection runs (in any thread), when this thread is already
    draining, or inside a :data:`no_drain` section."""
    section = getattr(_tls, "nodrain", None)
    me = threading.get_ident()
    if collection_running() or me in _drainers or (section is not None and section._is_owned()):
        return      # (any thread's collection: the releases it deferred may be for its garbage)
    try:
        # before the first popleft: a release is in pending or counted here; inside the try, so
        # a KeyboardInterrupt as the add returns still takes this thread out again
        _drainers.add(me)
        while True:
            try:
                fn, args = pending.popleft()
            except IndexError:
                return
            if _stale(fn, args):
                continue
            try:
                fn(*args)
            except AcceleratorError as exc:
                _report_leak(fn, exc)   # the retry failed too: what it releases leaks
            except Exception:
                pass    # interpreter shutdown or a runtime already torn down
    finally:
        _drainers.discard(me)


def releases_settled() -> bool:
    """True when no release of a dropped object can still be on its way: none waits in
    :data:`pending`, no drain is running one it took from there, and no collection runs (the
    collector clears the weak references to its garbage *before* it runs their finalizers, which
    then leave the release for after the collection, :func:`finalize_later`).  An allocator may
    then take a block whose owner's weak reference is dead for one never released (a Ctrl-C as
    ``__del__`` began): freeing it earlier lets the late release free the address again, by then
    maybe another owner's, and lets a finalizer of the same garbage read freed memory."""
    return not pending and not _drainers and not collection_running()


class _FailedRelease:
    """Raises its exception from ``__del__``, so that CPython reports it exactly as an error in
    a finalizer (``sys.unraisablehook``: "Exception ignored in ..."), to whatever hook is set."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc

    def __del__(self):
        exc, self.exc = self.exc, None
        raise exc


def _report_leak(fn: Callable, exc: BaseException) -> None:
    """A deferred release failed for the second time (issue r18: it used to be dropped without a
    word): report it through ``sys.unraisablehook`` as Python reports a failing ``__del__``, and
    drop it (a release that keeps failing must not stay queued forever).  The report is a new
    AcceleratorError naming the release; its cause is the vendor error."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    report = AcceleratorError(f"accel: a finalizer's release ({name}) failed twice, the second time at a "
                              f"safe point after the object was gone; what it releases leaks: {exc}")
    report.__cause__ = exc
    _FailedRelease(report)


def _section() -> threading.RLock:
    """This thread's no_drain marker: held while inside a section (held again when nested)."""
    lock = getattr(_tls, "nodrain", None)
    if lock is None:
        lock = _tls.nodrain = threading.RLock()
    return lock


class _NoDrain:
    """The section is this thread's RLock, held: ``with`` takes and gives it back through its C
    methods (the properties below hand them over, as accel._locks.Lock does), so a
    KeyboardInterrupt can never leave a section open, which would stop drain() on this thread
    for good (a Python ``__exit__`` that counted down could be interrupted as it started)."""
    __slots__ = ()

    __enter__ = property(lambda self: _section().__enter__)
    __exit__ = property(lambda self: _section().__exit__)


#: ``with lock, no_drain:`` around a critical section that calls an API entry (an allocator's
#: ``malloc``) which drains: the deferred releases wait for the next safe point instead of
#: running inside the section, where one that takes this lock would change its state halfway
#: through, and one that takes a lock of the same kind (another device's generator) would
#: order the two locks against another thread doing the reverse (issue r18).
no_drain = _NoDrain()


def release(fn: Callable, *args) -> None:
    """An explicit release (``close``, ``reset``): run ``fn(*args)`` now, errors propagating,
    unless a collection is running on this thread (a user's ``__del__`` closing its buffer): then
    defer it.  (``Buffer.close`` inlines the case with no collection, nothing pending and the live
    backend, calling the allocator's free directly: a new condition here belongs there too.)"""
    if _locks._running and collecting():    # (hot path: no call when no collection runs)
        pending.append((fn, args))
        return
    if pending:
        drain()
    if not _stale(fn, args):
        fn(*args)


def finalize(fn: Callable, *args) -> None:
    """A finalizer's release: run ``fn(*args)`` now, errors swallowed, or defer it while a
    collection runs on this thread."""
    if _locks._running and collecting():
        pending.append((fn, args))
        return
    if _stale(fn, args):
        return
    try:
        fn(*args)
    except AcceleratorError:
        pending.append((fn, args))  # a failed vendor call: tried once more at the next drain
    except Exception:
        pass    # interpreter shutdown or a runtime already torn down


def finalize_later(obj, fn: Callable, *args) -> None:
    """The release of ``obj`` (a Buffer, Stream or Event whose ``__del__`` runs while a collection
    runs), left open until the collection is over (issue r15).

    The collector calls the finalizers of one garbage cycle in no particular order (PEP 442), and a
    user's ``__del__`` in the cycle may still use ``obj`` (flush a buffer, synchronize a stream), as
    it may use a torch tensor, whose memory goes at deallocation, after every finalizer.  So the
    object is not marked closed here: the release waits in :data:`pending`, holding only a weak
    reference, and :func:`drain` does it once the object is gone.  An object the collection
    resurrected (a finalizer stored it) is closed then, as one dropped outside a collection."""
    pending.append((_release_if_gone, (weakref.ref(obj), fn, args)))


def release_on_del(obj, fn: Callable, *args) -> None:
    """What ``obj.__del__`` does with its release ``fn(*args)``: outside a collection, mark ``obj``
    closed and :func:`finalize`; during one (on this thread: only the collector runs the
    finalizers of its garbage), leave it open until its cycle is gone (:func:`finalize_later`)."""
    if _locks._running and collecting():
        finalize_later(obj, fn, *args)
        return
    obj._closed = True
    finalize(fn, *args)


def _release_if_gone(ref, fn: Callable, args: tuple) -> None:
    obj = ref()
    if obj is not None:
        # resurrected: its __del__ will not run again, so close it now (no lock: a finalizer's
        # path; an explicit close() since released it already)
        if obj._closed:
            return
        obj._closed = True
        del obj
    finalize(fn, *args)


def _stale(fn: Callable, args: tuple) -> bool:
    """True when the release is for a backend that is no longer the live one (see the module
    docstring: a runtime reset by tests)."""
    owner = args[0] if args else None
    if owner is not None and owner is _lazy._initialized_backend:
        return False    # the live backend (the common case: no isinstance through Backend's ABC)
    if not isinstance(owner, Backend):
        owner = getattr(fn, "__self__", None)
        if not isinstance(owner, Backend):
            return False
    return owner is not _lazy._initialized_backend


def forked_error(backend) -> RuntimeError:
    """The error for using, in a forked child, an object made by the parent (as _lazy's)."""
    name = _lazy.display_name(backend if backend is not None else _lazy._initialized_backend)
    return RuntimeError(f"Cannot re-initialize {name} in forked subprocess. To use {name} with "
                        f"multiprocessing, you must use the 'spawn' start method")


def _after_fork_in_child() -> None:
    global pid, _tls
    pid = os.getpid()
    forget_collection()
    _tls = threading.local()
    _drainers.clear()   # the parent's threads: none runs in the child
    pending.clear()     # the parent's handles: never released by the child


def _reset() -> None:
    pending.clear()     # releases for a runtime that is gone


os.register_at_fork(after_in_child=_after_fork_in_child)
_lazy.register_reset_hook(_reset)
