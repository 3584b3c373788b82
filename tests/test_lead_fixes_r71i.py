"""Fixes of session 31 (helper r71i) beside r71a's: module locks held across calls that allocate,
where a collection may run a user's gc callback (or ``__del__``) that calls accel again on the
same thread.

* ``kernels._launch._device_limits`` held the plain ``_limits_lock`` across the backend's
  ``launch_limits`` query: the query now runs outside the lock (held for a ``setdefault`` only).
* ``random._device.kernel_functions`` holds ``_lock`` across the kernels' load (``module_load``):
  it is an ``accel._locks.Lock`` now, so the re-entry is refused (AcceleratorError) instead of
  waiting forever on its own thread.
* ``buffer.release._release_foreign``: a ``from_ptr`` owner closed with no gate held still goes at once.

A possible hang runs in a forked child under a watchdog (faulthandler ends it, exit 1).
Work is on device 1 (device 0 current).
"""

import faulthandler

import pytest

import accel
from accel import _finalize, _lazy
from accel.kernels import _launch
from accel.random import _device
from conftest import run_forked, use_sim

DEV = 1
CHILD_S = 20.0
HANG_S = 3.0


def _child(body) -> int:
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    try:
        return body()
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_launch_limits_queried_outside_the_lock(monkeypatch, kind):
    """User code run inside the backend's launch_limits query (a gc callback at an allocation
    there) asks for another device's limits: answered, nothing waits on the thread's own lock."""
    use_sim(monkeypatch, kind)

    def body():
        be = _lazy.lazy_init()      # (in the child: a runtime initialized before a fork is the parent's)
        _launch._limits.clear()
        real = be.launch_limits
        inner = []

        def launch_limits(index):
            if not inner:
                inner.append(None)
                inner.append(_launch._device_limits(be, 0))     # (as a gc callback would)
            return real(index)

        monkeypatch.setattr(be, "launch_limits", launch_limits)
        lim = _launch._device_limits(be, DEV)
        ok = (isinstance(inner[1], dict) and "max_grid" in lim and _launch._device_limits(be, DEV) is lim
              and _launch._device_limits(be, 0) is inner[1])
        return 0 if ok else 4

    code = run_forked(lambda: _child(body), CHILD_S)
    assert code == 0, f"the child hung or failed (status {code}; stacks on stderr)"


def test_philox_load_reentered_is_refused_not_hung(monkeypatch):
    """User code run inside the Philox kernels' load (module_load, under random._device._lock)
    that loads them for another device: refused with AcceleratorError, never a hang; the outer
    load goes on, and the other device loads them later."""
    use_sim(monkeypatch, "cuda")

    def body():
        be = _lazy.lazy_init()
        _device._functions.clear()
        real = be.module_load
        inner = []

        def module_load(image):
            if not inner:
                inner.append(None)
                try:
                    inner.append(_device.kernel_functions(be, 0))    # (as a gc callback would)
                except accel.AcceleratorError as exc:
                    inner.append(exc)
            return real(image)

        monkeypatch.setattr(be, "module_load", module_load)
        fns = _device.kernel_functions(be, DEV)
        monkeypatch.setattr(be, "module_load", real)
        later = _device.kernel_functions(be, 0)
        ok = isinstance(inner[1], accel.AcceleratorError) and fns and later
        return 0 if ok else 4

    code = run_forked(lambda: _child(body), CHILD_S)
    assert code == 0, f"the child hung or failed (status {code}; stacks on stderr)"


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_a_from_ptr_owner_goes_at_close_when_no_gate_is_held(monkeypatch, kind):
    """Guard for the after_gate hand-off of a from_ptr owner: with no gate held, close() drops
    the owner before it returns (no safe point needed)."""
    use_sim(monkeypatch, kind)
    _lazy.lazy_init()
    mem = accel.Buffer(4096, device=DEV)
    noted = []

    class Owner:
        def __del__(self):
            noted.append("gone")

    wrapped = accel.Buffer.from_ptr(mem.ptr, 4096, device=DEV, owner=Owner())
    wrapped.close()
    assert noted == ["gone"]
    assert not any(fn is _finalize.finalize and args and getattr(args[0], "__name__", "") == "_drop"
                   for fn, args in list(_finalize.pending))
    mem.close()
