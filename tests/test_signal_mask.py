"""The simulators block signals in the main thread for each simulated vendor call (accel/sim/core.py,
"atomic for Python signal handlers"); whatever stops a call, the mask must come back as it was.
A signal left blocked stays blocked for the rest of the program, and in every program it starts
(a child inherits the mask): Ctrl-C then does nothing."""

import inspect
import signal
import sys

import pytest

import accel
from conftest import use_sim


def _at_depth(n: int, fn):
    return fn() if n == 0 else _at_depth(n - 1, fn)


def test_a_driver_callback_struck_by_recursionerror_leaves_no_signal_blocked(monkeypatch):
    """A RecursionError striking a simulated driver entry point (a cffi callback, as
    cuGetProcAddress hands it to the runtime) at every depth near the limit: in its body, its
    block, its unblock (a cffi destructor) or its frame.  The destructor took two levels more
    of CPython's recursion count than the block: at the limit the block ran, the destructor's
    RecursionError was printed and ignored, and every signal stayed blocked (r52; first seen
    through r51's observer recursion test and tests/conftest.py's check of the mask)."""
    from accel.sim import core, cuda_driver
    use_sim(monkeypatch, "cuda")
    monkeypatch.setattr(sys, "unraisablehook", lambda args: None)
    accel.device_count()
    rc, ptr = cuda_driver.entry_point("cuGetErrorName", 12000, 12080)
    assert rc == 0
    dffi = cuda_driver._dffi()
    fn = dffi.cast(cuda_driver.SYMBOLS["cuGetErrorName"][0], int(core.ffi.cast("uintptr_t", ptr)))
    out = dffi.new("char **")
    old = sys.getrecursionlimit()
    ran = 0
    for n in range(0, 40):
        sys.setrecursionlimit(old)
        try:
            sys.setrecursionlimit(len(inspect.stack(0)) + 40)
        except RecursionError:
            pytest.skip("this stack is deeper than inspect counts")
        try:
            if _at_depth(n, lambda: fn(0, out)) == 0:
                ran += 1
        except RecursionError:
            pass
        finally:
            sys.setrecursionlimit(old)
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set(), n
        assert core._Deferring.depth == 0
    assert ran
