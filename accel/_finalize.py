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

**An interrupted ``__del__`` (r53).**  CPython runs a pending signal handler when a Python
function starts, so a Ctrl-C that became due just before an object's last reference went is
raised at its ``__del__``'s first instruction, printed and ignored: the release never ran, and
the handle stayed alive until the runtime's teardown.  So the handles of live owned Streams,
Events and kernel Modules are also registered in :data:`owned` (:func:`own`): key -> (weak
reference, release function, its arguments).  The weak reference is to a *token*, an untracked
cffi pointer object that only the owner holds, and its callback is ``pending.append``, a C
method: no Python code, so no signal handler, runs in it.  The token dies only when its owner is
freed: the collector clears the weak references to its garbage before it runs the finalizers (a
weak reference to the owner would fire there, also for an owner another finalizer then
resurrects), but an untracked object is no part of that garbage; it goes when the owner is
freed, at the collection's end.  Every release of the handle (``close``, ``__del__``, a
collection's :func:`finalize_later`, a retry) passes the key down to the vendor call, which
takes the entry out of :data:`owned` (one ``dict.pop``) just before it starts
(:func:`destroy_owned`); a path that finds the entry gone does nothing.  The entry's weak
reference dies with it, so the callback runs only for an owner freed with its entry still
there, and :func:`drain` (the next entry of the API, after any collection) takes the entry and
releases the handle, once.  The take and the vendor call run with signals deferred (r55,
:mod:`accel.backends._signals`), as do a handle's creation and its registration: an interrupt
lands before the take (the release is left to the registry) or after the vendor call returned
(the entry is gone), so a handle is never destroyed twice (which could destroy the recycled
handle of a live object) and none is left that nobody destroys.  In a forked child and for a
reset runtime the registry is dropped.
"""

from __future__ import annotations

import _thread
import itertools
import os
import signal
import threading
import weakref
from collections import deque
from typing import Callable, Optional, Tuple

import _cffi_backend

from . import _lazy, _locks
from ._errors import AcceleratorError
from ._locks import collecting_here, collection_running, forget_collection
from .backends._signals import deferred
from .backends.base import Backend

__all__ = ["pending", "drain", "release", "finalize", "finalize_later", "release_on_del", "defer", "collecting", "pid",
           "forked_error", "no_drain", "releases_settled", "owned", "own", "key_of", "destroy_owned", "registered"]

#: Releases waiting for a safe point: (function, args) tuples, and the _Owned weak references of
#: owners freed with their registered release not taken (:data:`owned`).
pending: deque = deque()
#: Threads inside drain() (a thread in it does not enter it again): a release one took from
#: ``pending`` may not have run yet.
_drainers: set = set()
#: The process accel objects created now belong to (os.getpid(), refreshed at fork).
pid = os.getpid()

_tls = threading.local()

#: The releases of the handles of live owned Streams, Events and kernel Modules (see the module
#: docstring, r53): key -> (its _Owned weak reference, fn, args).  An entry goes when a release
#: of the owner's takes it (destroy_owned), or drain() for an owner freed without one.
owned: dict = {}
_keys = itertools.count(1).__next__
_ffi = _cffi_backend.FFI()
_VOIDP = _ffi.typeof("void *")
_token = _ffi.cast
_freed = pending.append     # the weak references' callback: a C method (runs no signal handler)


class _Owned(weakref.ref):
    """The registry's weak reference to an owner's token, carrying the entry's key; appended to
    :data:`pending` by its callback when the token dies with an entry still registered."""
    __slots__ = ("key",)


def own(fn: Callable, *args) -> Tuple[int, object]:
    """Register the release ``fn(*args)`` of a new handle, for :func:`drain` to run once the
    owner is freed without a release having taken it; returns ``(key, token)``, which the owner
    keeps (its only reference to the token).  The owner's own releases pass the key on to
    :func:`destroy_owned`.  The entry is stored last, after every point where an interrupt can
    land: an entry exists only for a token the caller receives (an entry whose token died with
    this frame would release a handle its owner still uses)."""
    token = _token(_VOIDP, 0)
    ref = _Owned(token, _freed)
    key = _keys()
    ref.key = key
    mine = (key, token)
    owned[key] = (ref, fn, args)
    return mine


def destroy_owned(key: int, destroy: Callable, *args) -> None:
    """``destroy(*args)``, the vendor call that destroys the handle registered under ``key`` (0:
    none registered), taking its entry out of :data:`owned` as it starts: nothing when another
    path took it (or the registry was dropped: a reset runtime).  The take and the vendor call
    run with signals deferred (r55), so that an interrupt lands before both (the entry is left
    to :func:`drain`) or after both (the entry is gone: never destroyed twice), never between
    them (a handle nobody destroys).  A vendor error puts the entry back (the handle is still
    alive; a retry takes it again) and names the key and the vendor call on the error, for
    :func:`drain` to give the handle up when a retry fails too."""
    if not key:
        destroy(*args)
        return
    _destroy_taken(key, destroy, args)


@deferred
def _destroy_taken(key: int, destroy: Callable, args: tuple) -> None:
    entry = owned.pop(key, None)
    if entry is None:
        return
    try:
        destroy(*args)
    except AcceleratorError as exc:
        owned[key] = entry
        exc._accel_owned = (key, destroy)
        raise


def key_of(mine: Optional[tuple]) -> int:
    """The registry key of the release registered by :func:`own` (``mine`` its result), for the
    owner's releases to pass on to :func:`destroy_owned`; 0 when nothing was registered."""
    return mine[0] if mine is not None else 0


def registered(mine: Optional[tuple]) -> bool:
    """Whether the release registered by :func:`own` (``mine`` its result; None: nothing was
    registered) has not been taken by :func:`destroy_owned`: its handle was not destroyed (an
    explicit close() that failed may then leave the object open)."""
    return mine is None or mine[0] in owned


def collecting() -> bool:
    """True while the cyclic garbage collector runs on the calling thread (so the code running
    now may be a finalizer the collector started inside one of accel's locks)."""
    return collecting_here()


def defer(fn: Callable, *args) -> None:
    """Run the release ``fn(*args)`` at the next safe point (see the module docstring), as a
    finalizer's: a failed vendor call is tried once more (r67f: a stream destroy deferred by a
    busy allocator was reported as "failed twice" at its first failure, and leaked)."""
    pending.append((finalize, (fn,) + args))


def drain() -> None:
    """Run the deferred releases now (and the registered releases of owners freed without one,
    :data:`owned`).  Call only where this thread holds no accel or vendor lock; does nothing while a collection runs (in any thread), when this thread is already
    draining, inside a :data:`no_drain` section, or while this thread holds the live backend's
    capture gate."""
    section = getattr(_tls, "nodrain", None)
    me = threading.get_ident()
    if collection_running() or me in _drainers or (section is not None and section._is_owned()):
        return      # (any thread's collection: the releases it deferred may be for its garbage)
    gate = getattr(getattr(_lazy._initialized_backend, "capture_gate", None), "_is_owned", None)
    if gate is not None and gate():
        # user code run inside accel (a gc callback, a signal handler) calling the API while this
        # thread holds the capture gate: a release run here (a DLPack deleter freeing a Buffer)
        # would wait for a lock another thread holds while it waits for the gate (r69a, r70g)
        return
    try:
        # before the first popleft: a release is in pending or counted here; inside the try, so
        # a KeyboardInterrupt as the add returns still takes this thread out again
        _drainers.add(me)
        while True:
            try:
                item = pending.popleft()
            except IndexError:
                return
            if type(item) is _Owned:
                # an owner freed with its release never taken (a Ctrl-C as its __del__ began):
                # released as its finalizer would have (a vendor error: tried once more)
                entry = owned.pop(getattr(item, "key", 0), None)   # (no key: own() interrupted)
                if entry is None:
                    continue
                item = (finalize, (entry[1],) + entry[2])
            fn, args = item
            if _stale(fn, args):
                continue
            try:
                fn(*args)
            except AcceleratorError as exc:
                # the retry failed too: what it releases leaks (and leaves the registry)
                key, call = getattr(exc, "_accel_owned", (0, fn))
                owned.pop(key, None)
                _report_leak(call, exc)
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
        pending.append((finalize, (fn,) + args))    # (a failed vendor call: tried once more)
        return
    if pending:
        drain()
    if not _stale(fn, args):
        fn(*args)


def finalize(fn: Callable, *args) -> None:
    """A finalizer's release: run ``fn(*args)`` now, errors swallowed, or defer it while a
    collection runs on this thread (as ``finalize(fn, *args)``: drain() takes an item's failure
    for its last, so a deferred release queued bare got one attempt, r67d)."""
    if _locks._running and collecting():
        pending.append((finalize, (fn,) + args))
        return
    if _stale(fn, args):
        return
    try:
        fn(*args)
    except AcceleratorError:
        pending.append((fn, args))  # a failed vendor call: tried once more at the next drain
    except Exception:
        pass    # interpreter shutdown or a runtime already torn down


class _RaiseAgain(dict):
    """``RAISE_AGAIN[interrupt_key()]``, the last statement of a finalizer's ``except
    KeyboardInterrupt:``, trips SIGINT again (``_thread.interrupt_main``), so a Ctrl-C whose
    handler ran inside the finalizer reaches the program: CPython discards an exception leaving
    ``__del__`` or a cffi destructor ("Exception ignored in ...").  Not a call: CPython runs a
    pending signal's handler as a call returns, which would still be inside the finalizer; a
    subscript that reaches ``__missing__`` calls it with no such check, so the handler runs at
    the first check point after the finalizer returned, in the program's code (r62)."""
    __missing__ = staticmethod(_thread.interrupt_main)


RAISE_AGAIN = _RaiseAgain({0: None})


def interrupt_key() -> int:
    """SIGINT in the main thread (the only one that runs signal handlers, so a KeyboardInterrupt
    there came from Ctrl-C); elsewhere 0, a key RAISE_AGAIN holds: an asynchronous exception
    injected into another thread is not turned into a Ctrl-C of the main one."""
    return signal.SIGINT if threading.current_thread() is threading.main_thread() else 0


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
    owned.clear()       # (their weak references go with the entries: no callback runs)


def _reset() -> None:
    pending.clear()     # releases for a runtime that is gone
    owned.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
_lazy.register_reset_hook(_reset)
