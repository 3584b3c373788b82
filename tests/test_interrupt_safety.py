"""Ctrl-C at the worst moment: a Python signal handler that raises (KeyboardInterrupt) runs
between two bytecodes of the main thread, so any pure-Python critical section can be cut
anywhere.  Each test here delivers the signal at one chosen point (deterministically: the
process signals itself from a monkeypatched step) and checks the state left behind.

A vendor library is C: a signal arriving during a call only sets CPython's flag and the
handler runs after the call returns (Python docs, ``signal`` module, "Execution of Python
signal handlers").  The simulators must behave the same, so a simulated call either runs
whole or not at all."""

import signal
import threading

import pytest

import accel
from accel import sim
from accel.sim import core


@pytest.fixture
def ctrl_c():
    """``ctrl_c()`` "presses Ctrl-C" now: SIGUSR1, whose handler raises KeyboardInterrupt, sent
    to the calling (main) thread.  (Sent to the process, the kernel may hand a signal the main
    thread holds back to another thread that does not block it, e.g. OpenBLAS's once an earlier
    test used numpy's BLAS; CPython then runs the handler inside the simulated call: the
    simulators' documented limit, accel/sim/core.py.  These tests failed by test order then.)"""
    def handler(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        yield lambda: signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_simulated_call_runs_whole_before_the_handler(ctrl_c):
    """The signal arrives in the middle of a simulated call: the call finishes, then the
    handler raises (as after a C call returns)."""
    done = []

    def vendor_fn(x):
        if not done:
            ctrl_c()
        for _ in range(3):      # backward jumps and calls: where 3.11 runs pending handlers
            len(done)
        done.append(x)
        return 0

    call = core.counted("accelTestInterruptedCall", vendor_fn)
    with pytest.raises(KeyboardInterrupt):
        call(7)
    assert done == [7]
    assert call(8) == 0 and done == [7, 8]      # signals are delivered again afterwards


def test_signal_blocked_before_the_call_is_not_lost(ctrl_c):
    """Signals the caller blocked stay blocked after a simulated call, others are unblocked."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    try:
        core.counted("accelTestNoop", lambda: 0)()
        assert signal.SIGUSR2 in signal.pthread_sigmask(signal.SIG_BLOCK, set())
        assert signal.SIGUSR1 not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})


def test_interrupt_inside_driver_reserve_is_not_error_999(ctrl_c, sim_cuda, monkeypatch):
    """Ctrl-C inside the simulated cuMemAddressReserve (a driver entry point, a cffi callback):
    accel sees KeyboardInterrupt after the call returns, not CUDA_ERROR_UNKNOWN (999, what
    cffi returns from a callback that raised), and the reservation, made whole, is freed again
    by the backend (the caller never got its address)."""
    from accel.sim import _vmm
    from accel import _lazy
    be = _lazy.lazy_init()
    if not be.supports_vmm:
        pytest.skip(be.no_vmm_reason)
    real = _vmm._mmap
    hits = []

    def interrupted_mmap(*args):
        if not hits:
            hits.append(1)
            ctrl_c()
        return real(*args)

    monkeypatch.setattr(_vmm, "_mmap", interrupted_mmap)
    gran = be.vmm_granularity(0)
    before = sim.state().vmm_reservations
    with pytest.raises(KeyboardInterrupt):
        be.vmm_reserve(0, gran)
    # the reservation was made whole, then freed again by the backend (r36): its address never
    # reached the caller, so keeping it would leak it
    assert hits and sim.state().vmm_reservations == before


def test_keyboard_interrupt_in_driver_callback_reaches_the_caller(sim_cuda, monkeypatch):
    """A KeyboardInterrupt that still lands inside a simulated driver call (a cffi callback:
    at its first bytecode, or from a signal a thread the sim does not own took) reaches accel
    as KeyboardInterrupt, not as CUDA_ERROR_UNKNOWN (999) printed and returned by cffi."""
    from accel import _lazy
    from accel.sim import _vmm
    be = _lazy.lazy_init()
    if not be.supports_vmm:
        pytest.skip(be.no_vmm_reason)

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(_vmm, "_mmap", interrupted)
    with pytest.raises(KeyboardInterrupt):
        be.vmm_reserve(0, be.vmm_granularity(0))
    monkeypatch.undo()
    va = be.vmm_reserve(0, be.vmm_granularity(0))      # the driver works on
    be.vmm_free(va, be.vmm_granularity(0))


def test_ctrl_c_as_metal_commit_returns(ctrl_c, monkeypatch):
    """The handler runs as the simulated commit returns (the buffer is committed): accel's
    stream does not keep it as its open command buffer, so the next sync does not commit it
    again (MetalValidationError "already committed" before)."""
    from conftest import use_sim
    from accel.sim import metal
    use_sim(monkeypatch, "mps")
    real = metal.MTLCommandBuffer.m_commit
    hits = []

    def commit(self):
        if not hits:
            hits.append(1)
            ctrl_c()
        return real(self)

    monkeypatch.setattr(metal.MTLCommandBuffer, "m_commit", commit)
    b = accel.Buffer(4096)
    b.fill_(3)
    with pytest.raises(KeyboardInterrupt):
        accel.synchronize()
    assert hits
    b.fill_(5)
    accel.synchronize()
    assert (b.to_numpy() == 5).all()


def test_interrupt_inside_simulated_device_work_finishes_it(sim_cuda):
    """A handler's KeyboardInterrupt raised while the simulator runs a kernel on the caller's
    thread (a signal another thread took, e.g. OpenBLAS's, runs its handler in the main thread
    even while the sim call defers signals): hardware never stops device work for a host
    signal, so the kernel's work completes, the interrupt reaches the caller as the launch
    returns, and the device is not left faulted.  Before: the sim took it for a device fault
    (cudaErrorLaunchFailure, 719, sticky), as the Ctrl-C program showed."""
    import numpy as np
    ptx = b""".version 8.0
.target sm_90
.address_size 64
.visible .entry fill_once(.param .u64 out)
{ ret; }
"""
    runs = []

    def reference(grid, block, view, out):
        runs.append(1)
        if len(runs) == 1:
            raise KeyboardInterrupt        # as a handler would, between two of its bytecodes
        view(out, 16, np.uint8)[:] = 9

    sim.register_kernel("fill_once", reference, "ptr")
    try:
        last = accel.device_count() - 1
        with accel.device_index(last):
            buf = accel.Buffer(16)
            kernel = accel.Module(ptx).function("fill_once")
            with pytest.raises(KeyboardInterrupt):
                accel.launch(kernel, 1, 1, buf)
            accel.synchronize()
            assert runs == [1, 1]
            assert (buf.to_numpy() == 9).all()
    finally:
        sim.unregister_kernel("fill_once")
