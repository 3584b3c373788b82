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

import os
import sys
import threading
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
    global _initialized, _initialized_backend, ready
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
    global _initialized, _initialized_backend, _in_bad_fork, ready
    with _lock:
        for hook in list(_reset_hooks):
            hook()
        _queued.clear()
        _seeds.clear()
        _initialized = False
        _initialized_backend = ready = None
        _in_bad_fork = False
        backends.reset()


def _drop_stale_imports() -> None:
    """In a forked child: forget accel's imports another thread of the parent was in the middle
    of (a lazy one: the backend module at the first call, ``accel.memory`` at its first use).
    CPython keeps each module's import lock across fork, held by a thread the child does not
    have, so the child's first import of that module would wait for good (r67h: a
    multiprocessing 'fork' pool replacing a worker while the main thread made its first call).
    The lock leaves ``importlib._bootstrap._module_locks`` (the next import makes a new one) and
    the half-run module ``sys.modules``, so the child imports it afresh.  Best effort: the table
    is CPython's own (3.9 to 3.13 keep it); only ``accel`` modules are touched."""
    try:
        from importlib import _bootstrap
        locks = _bootstrap._module_locks
    except (ImportError, AttributeError):
        return
    me = threading.get_ident()
    for name, ref in list(locks.items()):
        if name != "accel" and not name.startswith("accel."):
            continue
        lock = ref()
        owner = getattr(lock, "owner", None)
        if owner is None or owner == me:
            continue
        locks.pop(name, None)
        module = sys.modules.get(name)
        if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False):
            del sys.modules[name]
            parent, _, attr = name.rpartition(".")
            if getattr(sys.modules.get(parent), attr, None) is module:
                delattr(sys.modules[parent], attr)


def _after_fork_in_child() -> None:
    global _in_bad_fork, _lock, ready
    _drop_stale_imports()
    # The parent may have held the lock while forking; the child gets a fresh one.
    _lock = threading.RLock()
    # Counting through the runtime (CUDA without NVML, MIG UUIDs) starts the driver
    # as init does (cudaGetDeviceCount runs cuInit): the child can't use it either.
    if _initialized or backends.started_drivers():
        _in_bad_fork = True
        ready = None


os.register_at_fork(after_in_child=_after_fork_in_child)
