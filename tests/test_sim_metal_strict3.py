"""Metal simulator and mps backend, third strictness audit (r30): an MTLSharedEvent signal that a
failed command buffer never performed.

A command buffer that ends in MTLCommandBufferStatusError skips its remaining commands, its
``encodeSignalEvent:value:`` included.  A command buffer in another queue that waits for that
value (``encodeWaitForEvent:value:``) then waits for a signal that never comes: Apple's
MTLSharedEvent / MTLCommandBuffer documentation does not say what happens (the GPU's watchdog
ends it).  The simulator used to let the waiter run as if signaled; it now ends the waiter in
MTLCommandBufferStatusError with MTLCommandBufferErrorTimeout, and never hangs.
"""

import ctypes

import pytest

import accel
from accel._errors import AcceleratorError
from accel.backends import _objc
from accel.sim import core, metal
from conftest import use_sim
from test_sim_metal_strict2 import assert_nothing_left, objc  # noqa: F401  (objc: a fixture)
from test_sim_ze_metal_strict import (M_BLIT, M_CB, M_COMMIT, M_END, M_EVENT, M_FILL, M_NEW_BUFFER, M_QUEUE,
                                      M_SIGNAL, M_STATUS, M_VALUE, M_WAIT)

M_ERROR = _objc.Message("error")
M_CONTENTS = _objc.Message("contents", "void *")
M_WAIT_EVENT = _objc.Message("encodeWaitForEvent:value:", "void", "id", "uint64_t")

STATUS_COMPLETED, STATUS_ERROR = 4, 5
ERROR_TIMEOUT = 2          # MTLCommandBufferErrorTimeout
ERROR_OOM = 8              # MTLCommandBufferErrorOutOfMemory




def _fill(rt, cb, buf, n, value):
    with rt.pool():
        enc = rt.send(cb, M_BLIT)
        rng = rt.ffi.new("NSRange *", (0, n))[0]
        rt.send(enc, M_FILL, buf, rng, value)
        rt.send(enc, M_END)


def _new_cb(rt, q):
    with rt.pool():
        return rt.retain(rt.send(q, M_CB))


# -- the simulator ----------------------------------------------------------------------------------

def test_waiter_on_a_signal_its_failed_command_buffer_skipped_times_out(objc):
    """The waiter ran its fill as if the event had been signaled (signaledValue stayed 0)."""
    rt, device = objc
    qa, qb = rt.send(device, M_QUEUE), rt.send(device, M_QUEUE)
    ev = rt.send(device, M_EVENT)
    buf = rt.send(device, M_NEW_BUFFER, 64, 0)
    mem = ctypes.cast(int(rt.ffi.cast("uintptr_t", rt.send(buf, M_CONTENTS))), ctypes.POINTER(ctypes.c_uint8))
    ctypes.memset(mem, 9, 64)
    signaler, waiter = _new_cb(rt, qa), _new_cb(rt, qb)
    rt.send(signaler, M_SIGNAL, ev, 1)
    rt.send(waiter, M_WAIT_EVENT, ev, 1)
    _fill(rt, waiter, buf, 64, 7)
    core.inject_error("commit", ERROR_OOM)
    rt.send(signaler, M_COMMIT)
    rt.send(waiter, M_COMMIT)
    rt.send(waiter, M_WAIT)                      # never hangs
    rt.send(signaler, M_WAIT)
    assert int(rt.send(signaler, M_STATUS)) == STATUS_ERROR
    assert int(rt.send(ev, M_VALUE)) == 0     # the signal never happened
    assert int(rt.send(waiter, M_STATUS)) == STATUS_ERROR
    with rt.pool():
        code, text = rt.error_text(rt.send(waiter, M_ERROR))
    assert code == ERROR_TIMEOUT
    assert "never signaled" in text and "silent" in text
    assert mem[0] == 9                           # the waiter's fill did not run
    for obj in (signaler, waiter, buf, ev, qa, qb):
        rt.release(obj)
    assert set(metal.state().live_counts()) <= {"AGXSimDevice"}


def test_a_wait_committed_after_the_signal_failed_times_out_too(objc):
    """A wait encoded for a value whose only signal was skipped (already known) fails the same
    way, neither hanging nor running."""
    rt, device = objc
    qa, qb = rt.send(device, M_QUEUE), rt.send(device, M_QUEUE)
    ev = rt.send(device, M_EVENT)
    signaler = _new_cb(rt, qa)
    rt.send(signaler, M_SIGNAL, ev, 1)
    core.inject_error("commit", ERROR_OOM)
    rt.send(signaler, M_COMMIT)
    rt.send(signaler, M_WAIT)
    waiter = _new_cb(rt, qb)
    rt.send(waiter, M_WAIT_EVENT, ev, 1)
    rt.send(waiter, M_COMMIT)
    rt.send(waiter, M_WAIT)
    assert int(rt.send(waiter, M_STATUS)) == STATUS_ERROR
    with rt.pool():
        assert rt.error_text(rt.send(waiter, M_ERROR))[0] == ERROR_TIMEOUT
    # a later signal that does happen satisfies waits for it (and for the skipped value)
    ok = _new_cb(rt, qa)
    rt.send(ok, M_SIGNAL, ev, 2)
    rt.send(ok, M_COMMIT)
    w2 = _new_cb(rt, qb)
    rt.send(w2, M_WAIT_EVENT, ev, 1)
    rt.send(w2, M_WAIT_EVENT, ev, 2)
    rt.send(w2, M_COMMIT)
    rt.send(w2, M_WAIT)
    assert int(rt.send(w2, M_STATUS)) == STATUS_COMPLETED
    assert int(rt.send(ev, M_VALUE)) == 2
    for obj in (signaler, waiter, ok, w2, ev, qa, qb):
        rt.release(obj)


def test_a_signal_after_a_timed_out_wait_is_skipped_too(objc):
    """The waiter's own signal is one of its skipped commands: a third queue waiting on it times
    out as well (the failure propagates, nothing hangs)."""
    rt, device = objc
    qa, qb, qc = (rt.send(device, M_QUEUE) for _ in range(3))
    e1, e2 = rt.send(device, M_EVENT), rt.send(device, M_EVENT)
    a, b, c = _new_cb(rt, qa), _new_cb(rt, qb), _new_cb(rt, qc)
    rt.send(a, M_SIGNAL, e1, 1)
    rt.send(b, M_WAIT_EVENT, e1, 1)
    rt.send(b, M_SIGNAL, e2, 1)
    rt.send(c, M_WAIT_EVENT, e2, 1)
    core.inject_error("commit", ERROR_OOM)
    for cb in (a, b, c):
        rt.send(cb, M_COMMIT)
    rt.send(c, M_WAIT)
    assert int(rt.send(e2, M_VALUE)) == 0
    with rt.pool():
        codes = [rt.error_text(rt.send(cb, M_ERROR))[0] for cb in (a, b, c)]
    assert codes == [ERROR_OOM, ERROR_TIMEOUT, ERROR_TIMEOUT]
    for obj in (a, b, c, e1, e2, qa, qb, qc):
        rt.release(obj)


# -- the mps backend --------------------------------------------------------------------------------

def _failing_record(be, stream):
    p = be.mem_alloc(64)
    e = be.event_create()
    core.inject_error("commit", ERROR_OOM)
    be.memset_async(p, 1, 64, stream)
    be.event_record(e, stream)           # the record commits the failing buffer
    return p, e


def _usable(be, stream=0):
    p = be.mem_alloc(64)
    be.memset_async(p, 6, 64, stream)
    out = ctypes.create_string_buffer(64)
    be.memcpy_async(ctypes.addressof(out), p, 64, stream)
    assert out.raw == b"\x06" * 64
    be.mem_free(p)


def test_backend_reports_the_waiting_streams_timeout_once(mps_backend):
    be = mps_backend
    a, b = be.stream_create(), be.stream_create()
    p, e = _failing_record(be, a)
    q = be.mem_alloc(64)
    be.memset_async(q, 9, 64, b)
    be.stream_synchronize(b)
    be.stream_wait_event(b, e)
    be.memset_async(q, 2, 64, b)
    with pytest.raises(AcceleratorError, match="MTLCommandBufferErrorTimeout") as info:
        be.stream_synchronize(b)
    assert "never signaled" in str(info.value)
    be.stream_synchronize(b)             # reported once
    assert be.stream_query(b) is True
    with pytest.raises(AcceleratorError, match="MTLCommandBufferErrorOutOfMemory"):
        be.stream_synchronize(a)         # the signaling stream reports its own failure
    be.device_synchronize()
    out = ctypes.create_string_buffer(64)
    be.memcpy_async(ctypes.addressof(out), q, 64, 0)
    assert out.raw == b"\x09" * 64      # the waiter's fill did not run
    # everything keeps working: the same streams, a new stream, the same event recorded again
    _usable(be, a)
    _usable(be, b)
    c = be.stream_create()
    _usable(be, c)
    be.event_record(e, a)
    be.stream_wait_event(b, e)
    _usable(be, b)
    for h in (p, q):
        be.mem_free(h)
    be.event_destroy(e)
    for s in (a, b, c):
        be.stream_destroy(s)


def test_backend_device_synchronize_reports_the_timeout(mps_backend):
    be = mps_backend
    a, b = be.stream_create(), be.stream_create()
    p, e = _failing_record(be, a)
    with pytest.raises(AcceleratorError, match="MTLCommandBufferErrorOutOfMemory"):
        be.event_synchronize(e)
    be.stream_wait_event(b, e)           # waits for a value whose signal already failed
    be.memset_async(p, 3, 64, b)
    with pytest.raises(AcceleratorError, match="MTLCommandBufferErrorTimeout"):
        be.device_synchronize()
    be.device_synchronize()
    _usable(be, b)
    be.mem_free(p)
    be.event_destroy(e)
    be.stream_destroy(a)
    be.stream_destroy(b)


def test_accel_waiting_stream_fails_once_and_accel_stays_usable(monkeypatch):
    use_sim(monkeypatch, "mps")
    metal.reset()
    core.reset()
    a, b = accel.Stream(), accel.Stream()
    src = accel.Buffer(1 << 12, stream=a)
    dst = accel.Buffer(1 << 12, stream=b)
    e = accel.Event()
    core.inject_error("commit", ERROR_OOM)
    src.fill_(1, a)
    e.record(a)
    b.wait_event(e)
    dst.fill_(2, b)
    with pytest.raises(AcceleratorError, match="MTLCommandBufferErrorTimeout"):
        b.synchronize()
    b.synchronize()
    with pytest.raises(AcceleratorError, match="MTLCommandBufferErrorOutOfMemory"):
        accel.synchronize()
    accel.synchronize()
    c = accel.Stream()
    buf = accel.Buffer(1 << 12, stream=c)
    buf.fill_(5, c)
    c.synchronize()
    for obj in (buf, src, dst, e, a, b, c):
        obj.close()
    assert_nothing_left()
