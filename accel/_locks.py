"""Taking accel's locks when the cyclic garbage collector may have re-entered accel.

The collector runs at any Python allocation, so it can start while this thread holds one of
accel's locks (the caching allocator's inside ``malloc``, backend selection's while a backend
module is imported, lazy init's) and run a *user's* ``__del__`` that calls accel again.  accel's
own finalizers defer their work (:mod:`accel._finalize`); a user's call cannot be deferred.
Waiting for the lock would hang forever when this thread is the holder.  A plain
``threading.Lock`` cannot say who holds it, and recording an owner on every hot-path acquire
costs every call, so the check is done only where it can matter: when the lock is busy *and*
the collector is running on this thread.  Then the wait is bounded; if the lock is still busy
the call raises :class:`accel.AcceleratorError` saying why, instead of hanging.  (Another
thread holding the lock that long is possible but rare; the error then says to retry.)
"""

from __future__ import annotations

import _thread
import functools
import gc
import operator
import os
import threading
import weakref
from collections import deque

from ._errors import AcceleratorError

__all__ = ["acquire_into", "collecting_here", "collection_running", "held", "Lock", "module_lock", "RLock", "publish",
           "run_locked", "try_acquire"]

#: How long a call made by the collector on this thread waits for a busy lock.
GC_WAIT_S = 2.0

_get_ident = threading.get_ident


# Which collection runs, and on which thread, told by gc.callbacks that are C callables only.
# CPython prints and ignores an exception raised in a gc callback, and runs a pending signal
# handler when a Python function starts: a Python callback would swallow a Ctrl-C that arrived
# as a collection started or ended (r52: a third of the interrupts in the Ctrl-C program).  A C
# callable runs no bytecode, so the handler runs once the collection returns to the program.
# Each phase passes a fresh info dict; ``setattr(_PHASES, phase, info)`` runs the property
# named after the phase, whose setter is a bound C method of ``_running``:
#   "start": _running[_PHASES] = info       "stop": _running.pop(_PHASES, info)
# so ``_running`` is non-empty exactly while a collection runs, and its value (the start's info
# dict, kept alive there) names that collection.  ``_mine.start`` is the info dict of the last
# collection each thread started (a thread-local), so "here" is an identity test.
_running: dict = {}
_mine = threading.local()


class _Phases:
    __slots__ = ()
    start = property(None, _running.__setitem__)
    stop = property(None, _running.pop)


_PHASES = _Phases()
_CALLBACKS = (functools.partial(setattr, _PHASES), functools.partial(setattr, _mine))


# Interrupt safety (r36): ``with lock:`` must never leave the lock held.  CPython runs a signal's
# handler (a KeyboardInterrupt) right after a C call returns and when a Python function starts,
# so a Python ``__enter__`` can be interrupted after it took the lock (the with statement then
# never calls ``__exit__``) and a Python ``__exit__`` before it releases.  So the with statement
# gets the C methods of the lock inside: ``__enter__`` and ``__exit__`` are properties, which
# the with statement looks up (running the getter: an interrupt there has taken nothing) before
# it calls ``__enter__``.  Only a finalizer run by the collector on this thread gets the Python
# ``acquire`` with its checks (an exception there is printed, not raised, anyway).
def _enter(self):
    if not _running or not collecting_here():
        return self._lock.__enter__
    return self._enter_checked


def _enter_once(self):
    # (Lock: a second hold by its holder goes to _enter_checked(), which refuses it)
    if (not _running or not collecting_here()) and not self._lock._is_owned():
        return self._lock.__enter__
    return self._enter_checked


_exit = property(operator.attrgetter("_lock.__exit__"))


gc.callbacks.extend(_CALLBACKS)

# Steps run by C code with no bytecode in between: CPython runs a Python signal handler (a
# KeyboardInterrupt) only at bytecode boundaries, so none lands between them.  `map` driven by a
# zero-length deque is the C loop (itertools' "consume" recipe); each step is a C callable
# (functools.partial of setattr, operator.setitem, a bound C method), so no Python frame starts.
_consume = deque(maxlen=0).extend
_call = operator.methodcaller("__call__")


def publish(steps) -> None:
    """Run ``steps`` (C callables taking no argument, e.g. ``functools.partial(setattr, obj,
    "name", value)``) all or none with respect to a KeyboardInterrupt: for an update of several
    objects that must never be seen half made (a plain store is one bytecode; a loop of them is
    not, its backward jump checks for a signal)."""
    _consume(map(_call, steps))


def run_locked(lock, blocking: bool, fn, *args) -> bool:
    """``fn(*args)`` with ``lock`` held; True.  With ``blocking=False`` (a finalizer's call)
    nothing waits: False, and ``fn`` not run, when the lock is busy.  A KeyboardInterrupt never
    leaves the lock held (``with``; :func:`try_acquire`)."""
    owned = getattr(lock, "_is_owned", None)
    if owned is not None and owned():
        # an RLock this thread holds: its call is half done, a finalizer must not re-enter it
        if not blocking:
            return False
        raise finalizer_error(getattr(fn, "__qualname__", "a release"),
                              "would re-enter work this thread left half done")
    if blocking:
        with lock:
            fn(*args)
        return True
    got = []
    try:
        try_acquire(lock, got)
        if not got[0]:
            return False
        fn(*args)
    finally:
        if got and got[0]:
            lock.release()
    return True


def try_acquire(lock, out: list) -> None:
    """``lock.acquire(False)`` with its result appended to ``out`` in the same C step: call it
    inside the ``try`` whose ``finally`` releases when ``out == [True]``.  (``got =
    lock.acquire(False)`` can be interrupted as the call returns, before the store: the lock
    is then held and nobody knows.)"""
    _consume(map(out.append, map(lock.acquire, (False,))))


def acquire_into(lock, out: list, timeout: float = -1) -> None:
    """``lock.acquire(True, timeout)`` with its result appended to ``out`` in the same C step, as
    :func:`try_acquire`: the caller knows from ``out`` whether it holds the lock even when a
    KeyboardInterrupt lands as the acquire returns (one that stops the wait takes nothing).  In a
    Python ``__enter__``, call it inside a ``try`` whose ``except BaseException`` releases when
    ``out == [True]`` and re-raises, with no call between the ``try`` and the return (r70a:
    ``got = lock.acquire(...)`` interrupted as the call returned left the lock held for good)."""
    _consume(map(out.append, map(functools.partial(lock.acquire, True), (timeout,))))


def _collection_here():
    """The start info dict of the collection running on the calling thread, else None."""
    now = _running.get(_PHASES)
    return now if now is not None and getattr(_mine, "start", None) is now else None


def collecting_here() -> bool:
    """True while the cyclic garbage collector runs on the calling thread (so the code
    running now is a finalizer, possibly entered from inside accel)."""
    return _collection_here() is not None


def collection_running() -> bool:
    """True while the cyclic garbage collector runs, on any thread."""
    return bool(_running)


def forget_collection() -> None:
    """In a forked child: a collection another thread of the parent was running never ends
    here (that thread does not exist), so none is taken to run."""
    _running.clear()


def finalizer_error(what: str, why: str = "would wait on a lock the thread already holds") -> AcceleratorError:
    return AcceleratorError(
        f"accel: {what} was called from a finalizer (__del__) that the garbage collector ran while "
        f"this thread was inside accel; calling accel again from there {why}.  Do not allocate or initialize accel in __del__ of objects kept in "
        f"reference cycles (use weakref.finalize, or free explicitly); if another thread held "
        f"the lock, retry")


# Every Lock and RLock made, and every object given to renew_in_child, so that a forked child
# gets each one's locks fresh (``_fresh()``): a thread of the parent may have held one at the
# fork, and that thread does not exist in the child (r69a: a pool id's lock had no at-fork hook
# of its own).  Bounded by the live objects.
_all_locks: "weakref.WeakSet" = weakref.WeakSet()


def renew_in_child(obj) -> None:
    """Have ``obj._fresh()`` (which makes its locks anew) called in a forked child, for as long as
    ``obj`` lives; for objects that hold plain ``threading`` locks of their own."""
    _all_locks.add(obj)


class Lock:
    """A non-reentrant lock whose ``with`` refuses its holder and bounds a finalizer's wait, as
    :class:`held` (``what`` names the call in the error): for locks held across calls into the vendor library, where the collector
    may start and run a user's ``__del__`` that calls accel again (issue r18).  A second hold by
    its holder raises instead of waiting forever.  A forked child finds it free
    (:func:`_fresh_in_child`)."""

    __slots__ = ("_lock", "release", "locked", "what", "__weakref__")

    def __init__(self, what: str):
        self.what = what
        self._fresh()
        _all_locks.add(self)

    def _fresh(self) -> None:
        # An RLock only to tell its holder: a second hold by the same thread is user code run
        # inside accel's (a signal handler, a gc callback at a collection's "stop", r69h) and
        # is refused (acquire, _enter_checked) instead of waiting forever on the thread itself.
        self._lock = OwnedLock()
        self.release = self._lock.release
        self.locked = self._lock.locked

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        lock = self._lock
        if lock._is_owned():
            # (busy, as a plain lock held by this thread answers: threading.Condition asks so)
            if not blocking:
                return False
            raise self._reentry_error()
        if lock.acquire(False):
            return True
        if not blocking:
            return False
        if not collecting_here():
            return lock.acquire(True, timeout)
        if lock.acquire(True, GC_WAIT_S if timeout < 0 else min(timeout, GC_WAIT_S)):
            return True
        raise self._error()

    def _error(self) -> Exception:
        return finalizer_error(self.what)

    def _reentry_error(self) -> Exception:
        return finalizer_error(self.what, "would re-enter what this thread left half done (a signal "
                               "handler, gc callback or __del__ that ran inside accel)")

    def _enter_checked(self) -> None:
        """``with``'s acquire off the hot path (see ``_enter_once``): a second hold by the holder is
        refused, and a finalizer run by the collector on this thread waits a bounded time."""
        lock = self._lock
        if lock._is_owned():
            raise self._reentry_error()
        timeout = GC_WAIT_S if collecting_here() else -1
        got: list = []
        try:
            acquire_into(lock, got, timeout)
        except BaseException:
            if got and got[0]:
                lock.release()
            raise
        if not got[0]:
            raise self._error()

    __enter__ = property(_enter_once)
    __exit__ = _exit


class RLock:
    """A ``threading.RLock`` for a backend that calls itself while holding it (the Metal
    backend: one lock over the Objective-C objects it builds a command buffer from).

    Re-entry by the same thread is normal, except from a finalizer: when the collector
    starts inside the outermost hold (at an allocation halfway through a call) and runs a
    user's ``__del__`` that calls accel, that call would re-enter the half-done work (a
    command buffer half encoded or being committed).  It raises :class:`AcceleratorError`
    instead, as :class:`Lock` does.  A hold taken by a finalizer itself (the collector was
    already running on this thread at the outermost acquire) re-enters freely.

    ``with`` takes the C ``threading.RLock`` methods outside a collection (see ``_enter``):
    the owner and depth are the RLock's own; ``_outer_gc`` is the info dict of the collection
    whose finalizer took the outermost hold (None: none), so a stale one never matches."""

    __slots__ = ("_lock", "_outer_gc", "what", "__weakref__")

    def __init__(self, what: str):
        self.what = what
        self._fresh()
        _all_locks.add(self)

    def _fresh(self) -> None:
        self._lock = threading.RLock()
        self._outer_gc = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        here = _collection_here()      # (None outside a collection on this thread)
        lock = self._lock
        if lock._is_owned():
            if here is not None and self._outer_gc is not here:
                raise finalizer_error(self.what, "would re-enter the call this thread left half done")
            lock.acquire()
            return True
        if not lock.acquire(False):
            if not blocking:
                return False
            if here is not None:
                if not lock.acquire(True, GC_WAIT_S if timeout < 0 else min(timeout, GC_WAIT_S)):
                    raise finalizer_error(self.what)
            elif not lock.acquire(True, timeout):
                return False
        self._outer_gc = here
        return True

    def release(self) -> None:
        self._lock.release()

    def _enter_checked(self) -> None:
        """``with``'s acquire for a finalizer run by the collector on this thread (see ``_enter``):
        as :meth:`acquire`, each take stored in the same C step (:func:`acquire_into`)."""
        here = _collection_here()
        lock = self._lock
        inner = lock._is_owned()
        if inner and here is not None and self._outer_gc is not here:
            raise finalizer_error(self.what, "would re-enter the call this thread left half done")
        got: list = []
        try:
            acquire_into(lock, got, GC_WAIT_S if here is not None and not inner else -1)
        except BaseException:
            if got and got[0]:
                lock.release()
            raise
        if not got[0]:
            raise finalizer_error(self.what)
        if not inner:
            self._outer_gc = here       # (plain stores: no interrupt point after the take)

    def owned(self) -> bool:
        """Whether the calling thread holds it."""
        return self._lock._is_owned()

    @property
    def _owner(self):
        """The calling thread's ident while it holds the lock, else None (for tests)."""
        return _get_ident() if self._lock._is_owned() else None

    @property
    def _depth(self) -> int:
        """The calling thread's hold count (0 for a thread that does not hold it)."""
        return self._lock._recursion_count() if self._lock._is_owned() else 0

    __enter__ = property(_enter)
    __exit__ = _exit


class OwnedLock(_thread.RLock):
    """A C ``RLock`` (``with`` stays C code) that can also say whether any thread holds it, as a
    plain lock's ``locked()``.  For the caching allocators' locks: ``_is_owned()`` tells their
    holder, so that re-entry by it (user code run inside accel) is refused instead of waiting
    forever on itself (accel.memory._guards.probe, r69h)."""

    __slots__ = ()

    def locked(self) -> bool:
        if self._is_owned():
            return True
        if self.acquire(False):
            self.release()
            return False
        return True


class held:
    """``with held(lock, "what"):`` is ``with lock:`` (not for hot paths), except that a finalizer
    run by the collector on this thread waits for ``lock`` at most :data:`GC_WAIT_S` and then
    raises :func:`finalizer_error` (``what`` names the call) instead of waiting forever on a lock
    this thread may hold.  ``bounded=True``: the wait is bounded whoever calls, for a call made
    where waiting could be waiting on this thread itself (accel.memory._guards.probe: a thread
    holding the capture gate).  The wait and the hold are one (r70a: a probe that waited, let go
    and then took the lock with ``with`` let another thread in between, which then waited for
    the gate this one held).  Never left held by a KeyboardInterrupt: the take is stored in the
    same C step (:func:`acquire_into`; r70g: backend selection's lock stayed held when one
    landed as ``acquire(False)`` returned), and ``__exit__`` is the lock's C method."""

    __slots__ = ("lock", "what", "bounded")

    def __init__(self, lock, what: str, bounded: bool = False):
        self.lock, self.what, self.bounded = lock, what, bounded

    def __enter__(self) -> None:
        lock = self.lock
        got: list = []
        try:
            acquire_into(lock, got, GC_WAIT_S if self.bounded or collecting_here() else -1)
        except BaseException:
            if got and got[0]:
                lock.release()
            raise
        if not got[0]:
            raise finalizer_error(self.what)

    __exit__ = property(operator.attrgetter("lock.__exit__"))     # (C: never left held)


# Module-level plain locks made anew in a forked child: (module globals, name).
_module_locks: list = []


def module_lock(namespace: dict, name: str):
    """A ``threading.Lock`` stored as ``namespace[name]`` (a module's ``globals()``) and made anew
    there in a forked child, as every Lock and RLock here (r70a: module locks of streams, DLPack,
    launches and device RNG were inherited as the parent's threads left them)."""
    namespace[name] = threading.Lock()
    _module_locks.append((namespace, name))
    return namespace[name]


def _fresh_in_child() -> None:
    for lock in list(_all_locks):
        lock._fresh()
    for namespace, name in _module_locks:
        namespace[name] = threading.Lock()


os.register_at_fork(after_in_child=_fresh_in_child)
