"""Lazy runtime initialization, the deferred-call queue, and fork poisoning.

The runtime is initialized on the first call that needs a device, never at
import and never by queries (count, availability, seeding).  Work that must
happen at init (seeding before init, say) is queued with :func:`lazy_call`.

A process that forks after initializing a vendor runtime (or only its driver,
which counting without the management library does) cannot use the
runtime in the child (the driver's threads and contexts do not survive
``fork``); the child gets a clear error at first device use instead of a hang.
This mirrors ``torch/cuda/__init__.py`` and ``device_lazy_init.cpp``.
"""

from __future__ import annotations

import _thread
import os
import sys
import threading
import weakref
from typing import Callable, Dict, List, Optional, Tuple

from . import backends
from ._errors import DeferredCallError
from .backends.base import Backend

_NO_DEVICE = "Cannot access accelerator device when none is available."

_lock = threading.RLock()
_tls = threading.local()
_initialized = False
_initialized_backend: Optional[Backend] = None
#: The initialized backend while it may be used (not in a bad fork), else None:
#: one global read for hot paths such as current_stream().
ready: Optional[Backend] = None
#: ``ready.get_device`` while ``ready`` is set, else None: current_stream()'s one read.
ready_get_device: Optional[Callable[[], int]] = None
_in_bad_fork = False
_queued: List[Tuple[Callable[[], None], List[str]]] = []
#: The latest seed=True and seed_all=True calls, in the order of those latest calls (torch's
#: _LazySeedTracker: manual_seed_all after manual_seed overrides it on every device).
_seeds: Dict[str, Tuple[Callable[[], None], List[str]]] = {}
_reset_hooks: List[Callable[[], None]] = []


def display_name(backend: Optional[Backend]) -> str:
    """"CUDA", "XPU", "MPS" as vendors and torch spell them in messages."""
    return backend.name.upper() if backend is not None else "accelerator"


def backend() -> Backend:
    """The process's backend, uninitialized: the selected one, else the first whose
    library loads (so its init reports the vendor's reason); RuntimeError when none loads."""
    chosen = backends.fallback()
    if chosen is None:
        raise RuntimeError(_NO_DEVICE)
    return chosen


def is_initialized() -> bool:
    """True once the runtime has been initialized in this process (and not poisoned by fork)."""
    return _initialized and not _in_bad_fork


def is_in_bad_fork() -> bool:
    return _in_bad_fork


def lazy_call(fn: Callable[[], None], *, seed: bool = False, seed_all: bool = False) -> None:
    """Run ``fn`` now if the runtime is initialized, else at initialization.

    ``seed``/``seed_all`` calls keep only the latest of their kind (a later
    ``manual_seed`` replaces an earlier one), as torch's ``_lazy_call``.  At init the
    plain calls run first, in order, then the kept seed calls in the order they were
    last made (torch/cuda/__init__.py ``_lazy_init``, torch/_utils.py ``_LazySeedTracker``).
    """
    with _lock:
        if is_initialized():
            fn()
            return
        import traceback  # here, not at import: it pulls in linecache and tokenize
        entry = (fn, traceback.format_stack())
        if seed_all or seed:
            kind = "seed_all" if seed_all else "seed"
            _seeds.pop(kind, None)      # re-inserted last: the order of the latest calls
            _seeds[kind] = entry
        else:
            _queued.append(entry)


def lazy_init() -> Backend:
    """Initialize the selected backend once; return it.

    Raises RuntimeError without a device or in a child forked after init,
    AcceleratorError when the vendor runtime refuses, DeferredCallError when
    a queued call fails.
    """
    global _initialized, _initialized_backend, ready, ready_get_device
    if ready is not None:
        return ready
    chosen = backend()
    if _in_bad_fork:
        raise RuntimeError(
            f"Cannot re-initialize {display_name(chosen)} in forked subprocess. "
            f"To use {display_name(chosen)} with multiprocessing, you must use the 'spawn' start method")
    with _lock:
        if _initialized:
            return chosen
        stage = getattr(_tls, "stage", None)
        if stage == "queue":
            # A queued call asked for the device while init runs its queue.
            return chosen
        if stage == "init":
            # Re-entered from the runtime's init on this thread (the lock is reentrant): only
            # a finalizer the garbage collector ran in the middle of init can do that.
            from ._locks import finalizer_error
            raise finalizer_error(f"{display_name(chosen)} initialization")
        _tls.stage = "init"
        try:
            chosen.init()
            _tls.stage = "queue"
            # as torch's _lazy_init: the seed calls go after the plain ones, and the loop runs
            # _queued itself, not a copy: a queued call that queues another (this thread, stage
            # "queue") appends to it, and the loop runs that one too
            seeds = list(_seeds.values())
            _queued.extend(seeds)
            try:
                for fn, stack in _queued:
                    try:
                        fn()
                    except Exception as exc:
                        name = display_name(chosen)
                        raise DeferredCallError(
                            f"{name} call failed lazily at initialization with error: {exc}\n\n"
                            f"{name} call was originally invoked at:\n\n{''.join(stack)}") from exc
            except BaseException:
                # the next attempt adds the kept seed calls again: take them out (not twice)
                _queued[:] = [e for e in _queued if not any(e is s for s in seeds)]
                raise
            _queued.clear()
            _seeds.clear()
            _initialized_backend = ready = chosen
            ready_get_device = chosen.get_device
            _initialized = True
        finally:
            _tls.stage = None
    return chosen


def register_reset_hook(fn: Callable[[], None]) -> None:
    """Layers with process-wide state (allocators, generators, current streams)
    register a function that forgets it; tests call :func:`_reset_for_tests`."""
    if fn not in _reset_hooks:
        _reset_hooks.append(fn)


def _reset_for_tests() -> None:
    """Forget every piece of process state so a test can switch backend or simulator."""
    global _initialized, _initialized_backend, _in_bad_fork, ready, ready_get_device
    with _lock:
        for hook in list(_reset_hooks):
            hook()
        _queued.clear()
        _seeds.clear()
        _initialized = False
        _initialized_backend = ready = ready_get_device = None
        _in_bad_fork = False
        backends.reset()


def _is_accel(name: str) -> bool:
    return name == "accel" or name.startswith("accel.")


def _fresh_like(old):
    """A new, free lock of ``old``'s kind (3.11's module locks use a plain lock, 3.12+ an RLock)."""
    return _thread.RLock() if isinstance(old, _thread.RLock) else _thread.allocate_lock()


def _free(lock) -> bool:
    """Whether nobody holds ``lock`` (in the child only this thread runs, so trying is safe)."""
    if lock is None:
        return True
    if lock.acquire(False):
        lock.release()
        return True
    return False


def _waits(bootstrap, me: int) -> Dict[int, list]:
    """``_blocking_on`` as {thread: [module locks it waits for]}, the other threads only
    (3.11: a dict of one lock per thread; 3.12+: a _WeakValueDictionary of lists, over ``.data``)."""
    table = getattr(bootstrap, "_blocking_on", None)
    data = getattr(table, "data", table)
    out: Dict[int, list] = {}
    if isinstance(data, dict):
        for tid, value in list(data.items()):
            if isinstance(value, weakref.ref):
                value = value()
            if tid != me and value is not None:
                out[tid] = list(value) if isinstance(value, list) else [value]
    return out


def _forget_waits(bootstrap, me: int) -> None:
    """Drop the waits of threads the child does not have: a new thread of the child may get a
    dead one's identifier, and deadlock detection would follow the dead thread's wait."""
    table = getattr(bootstrap, "_blocking_on", None)
    data = getattr(table, "data", table)
    if not isinstance(data, dict):
        return
    for tid, value in list(data.items()):
        if tid == me:
            continue
        if isinstance(value, weakref.ref):      # 3.12+: empty the list (the weak entry goes with it)
            value = value()
            if isinstance(value, list):
                del value[:]
        else:
            data.pop(tid, None)


def _drop_stale_imports() -> None:
    """In a forked child: undo the imports that other threads of the parent were in the middle
    of when they took part in an import of accel (a lazy one: the backend module at the first
    call, ``accel.memory`` / ``accel.random`` at first use), so that the child's import of any
    of those modules runs afresh instead of waiting for good.

    CPython keeps each module's import lock (``importlib._bootstrap._module_locks``) across fork,
    owned by a thread the child does not have (r67h: a multiprocessing 'fork' pool replacing a
    worker while the main thread made its first call).  The interrupted import is a chain: the
    modules that import accel (a user's module) and those accel's module imports in turn
    (``secrets``, ``json``, ``inspect``: r68f, the child hung on ``import secrets`` in its fresh
    import of ``accel.random``).  So the chain is every lock owned by, or waited for by, a
    thread that owned or waited for an accel module's lock, transitively.  Each lock of the
    chain owned by a gone thread leaves ``_module_locks`` (the next import makes a new one) and
    its half-run module (``__spec__._initializing``) leaves ``sys.modules`` and its package, as
    when an import fails.  Modules other threads were importing, unrelated to accel, stay as
    CPython leaves them.  Besides: a lock no thread owns but that a gone thread left mid-update
    (its inner lock or wake-up lock held) is replaced, and one this thread owns is repaired in
    place; the waits of gone threads are forgotten.

    Runs in an at-fork hook: it must not import (r68f: reading the package attribute through
    ``getattr`` ran ``accel.__getattr__``, which imported the module again inside the hook, before
    ``signal.alarm`` or anything else of the child ran, and hung there) nor raise.  Best effort:
    the tables are CPython's own (3.9 to 3.13 keep them)."""
    bootstrap = sys.modules.get("_frozen_importlib") or sys.modules.get("importlib._bootstrap")
    locks = getattr(bootstrap, "_module_locks", None)
    if not isinstance(locks, dict):
        return
    imp = sys.modules.get("_imp")
    me = threading.get_ident()
    if imp is not None:
        imp.acquire_lock()          # fresh after fork (CPython re-initializes it); reentrant
    try:
        table = {}
        for name, ref in list(locks.items()):
            lock = ref() if callable(ref) else None
            if lock is not None and hasattr(lock, "owner"):
                table[name] = lock
        waits = _waits(bootstrap, me)
        # the chain: locks and gone threads reachable from accel's locks
        chain = {name for name in table if _is_accel(name)}
        gone: set = set()
        while True:
            held = {table[n].owner for n in chain} - {None, me}
            waiting = {tid for tid, ws in waits.items()
                       if any(table.get(getattr(w, "name", None)) is w and w.name in chain for w in ws)}
            new = (held | waiting) - gone
            if not new:
                break
            gone |= new
            chain |= {name for name, lock in table.items() if lock.owner in gone}
            chain |= {w.name for tid in new for w in waits.get(tid, ()) if table.get(getattr(w, "name", None)) is w}
        for name, lock in table.items():
            owner = lock.owner
            dirty = not (_free(lock.lock) and _free(lock.wakeup)) or bool(lock.waiters)
            if owner == me:
                if dirty:           # every waiter is gone; this thread's ownership stands
                    lock.lock, lock.wakeup = _fresh_like(lock.lock), _fresh_like(lock.wakeup)
                    lock.waiters = type(lock.waiters)()
            elif owner is None:
                if dirty:
                    locks.pop(name, None)
            elif name in chain:
                locks.pop(name, None)
                module = sys.modules.get(name)
                if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False):
                    del sys.modules[name]
                    parent, _, attr = name.rpartition(".")
                    namespace = getattr(sys.modules.get(parent), "__dict__", None)
                    # the package's own dict, not getattr: accel's __getattr__ would import
                    if isinstance(namespace, dict) and namespace.get(attr) is module:
                        del namespace[attr]
        _forget_waits(bootstrap, me)
    except Exception:               # noqa: BLE001 (an at-fork hook must not raise)
        pass
    finally:
        if imp is not None:
            imp.release_lock()


def _after_fork_in_child() -> None:
    global _in_bad_fork, _lock, ready, ready_get_device
    _drop_stale_imports()
    # The parent may have held the lock while forking; the child gets a fresh one.
    _lock = threading.RLock()
    # Counting through the runtime (CUDA without NVML, MIG UUIDs) starts the driver
    # as init does (cudaGetDeviceCount runs cuInit): the child can't use it either.
    if _initialized or backends.started_drivers():
        _in_bad_fork = True
        ready = ready_get_device = None


os.register_at_fork(after_in_child=_after_fork_in_child)
