"""Signals deferred around a backend's short, non-blocking sequences of vendor calls (r38).

A Python signal handler (Ctrl-C's KeyboardInterrupt, a SIGALRM handler that raises) runs in
the main thread between two bytecodes where CPython checks for signals: right after a C call
returns, at a loop's backward jump, at a Python function's start (Python docs, signal module,
"Execution of Python signal handlers").  Where a vendor call *returns* a new object (Metal's
``objc_msgSend`` answering ``blitCommandEncoder``, ``commandBuffer``, ``newBuffer...``) the
backend can store it only one bytecode later, so a handler that runs as the call returns loses
it: an encoder nobody ends, a buffer nobody releases.  No ordering fixes that; the only remedy
is that no handler runs in between.  :func:`deferred` runs a function with the signals that
can have Python handlers blocked in the main thread (the only thread that runs handlers): a
signal arriving meanwhile stays pending in the kernel and its handler runs as the function
returns, as it would after one C call.

Only short sequences that never wait may be deferred: a blocked Ctrl-C during a long wait
would not interrupt it.  Cost: two ``pthread_sigmask`` system calls through cffi per outermost
call (about 1.5 us on Linux x86_64), none in other threads or nested calls.

Limits: a process-directed signal the kernel hands to another thread that does not block it
still trips CPython's flag, and the main thread then runs the handler at its next check even
inside a deferred function (as for the simulators' own deferral, accel/sim/core.py).
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from typing import Callable

import _cffi_backend

__all__ = ["deferred", "blocked"]

_ffi = _cffi_backend.FFI()
_SIG_SIZE = 128          # bytes of sigset_t on glibc (1024 bits); macOS uses 4: the rest is unused


class _State:
    """``depth`` 1 while the main thread runs a deferred function; ``main`` the thread that runs
    Python signal handlers (the forking thread in a forked child)."""
    depth = 0
    main = threading.main_thread().ident


def _load():
    libc = _cffi_backend.load_library(None)
    mask = libc.load_function(_ffi.typeof("int(*)(int, void *, void *)"), "pthread_sigmask")
    delset = libc.load_function(_ffi.typeof("int(*)(void *, int)"), "sigdelset")
    defer = _ffi.new("char[]", _SIG_SIZE)
    libc.load_function(_ffi.typeof("int(*)(void *)"), "sigfillset")(defer)
    # Not deferred: what cannot be blocked, the synchronous faults, and SIGABRT (abort and
    # faulthandler's dump of a hung test must still work).
    for name in ("SIGKILL", "SIGSTOP", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGSYS",
                 "SIGABRT"):
        if hasattr(signal, name):
            delset(defer, getattr(signal, name))
    return mask, defer


_mask, _DEFER = _load()
_OLD = _ffi.new("char[]", _SIG_SIZE)     # the main thread's mask of before the outermost call
_NULL = _ffi.NULL
_BLOCK, _SETMASK = signal.SIG_BLOCK, signal.SIG_SETMASK
_ident = threading.get_ident


def _after_fork_in_child() -> None:
    _State.main, _State.depth = _ident(), 0


os.register_at_fork(after_in_child=_after_fork_in_child)


def deferred(fn: Callable) -> Callable:
    """``fn`` run with signals deferred in the main thread (see the module docstring).

    Ordering, as accel/sim/core.py's DEFERRED_BODY: a handler can run at the wrapper's start or
    as ``_ident()`` returns (nothing done yet), or as the blocking call returns (a signal that
    arrived before it: then inside the ``try``, whose ``finally`` unblocks); afterwards none
    runs until the unblocking call returns, when a pending one runs after ``fn``'s work.
    """
    @functools.wraps(fn)
    def call(*args, **kwargs):
        outer = _ident() == _State.main and not _State.depth
        try:
            if outer:
                _State.depth = 1
                _mask(_BLOCK, _DEFER, _OLD)
            return fn(*args, **kwargs)
        finally:
            if outer:
                _State.depth = 0
                _mask(_SETMASK, _OLD, _NULL)
    return call


def blocked() -> bool:
    """Whether this thread now has SIGINT blocked (tests: no handler can run here)."""
    return signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
