"""Metal simulator and mps backend, second strictness audit (r22).

Objective-C ownership (Apple, "Advanced Memory Management Programming Guide", Memory Management
Policy: "You own any object you create", "You must not relinquish ownership of an object you do
not own"), MTLCommandBuffer/MTLCommandEncoder state rules, the lifetimes of MTLBuffer and
MTLSharedEvent across accel's close calls and interpreter exit, and how a failed command buffer
is reported: once, by the first call that can see it.
"""

import ctypes
import os
import subprocess
import sys

import pytest

import accel
from accel import backends
from accel._errors import AcceleratorError
from accel.backends import _objc
from accel.backends.mps import _library as mps_lib
from accel.sim import core, metal
from conftest import use_sim

M_QUEUE = _objc.Message("newCommandQueue")
M_CB = _objc.Message("commandBuffer")
M_COMMIT = _objc.Message("commit", "void")
M_WAIT = _objc.Message("waitUntilCompleted", "void")
M_BLIT = _objc.Message("blitCommandEncoder")
M_COMPUTE = _objc.Message("computeCommandEncoder")
M_END = _objc.Message("endEncoding", "void")
M_NEW_BUFFER = _objc.Message("newBufferWithLength:options:", "id", "NSUInteger", "NSUInteger")
M_LENGTH = _objc.Message("length", "NSUInteger")


@pytest.fixture
def be(mps_backend):
    return mps_backend


@pytest.fixture
def objc(monkeypatch):
    """libobjc + Metal as a program on a Mac uses them directly."""
    use_sim(monkeypatch, "mps")
    metal.reset()
    core.reset()
    (ffi_, objc_lib, _), (_, metal_lib, _) = metal.open_libraries()
    rt = _objc.Runtime(ffi_, objc_lib)
    device = metal_lib.MTLCreateSystemDefaultDevice()
    yield rt, device
    metal.reset()
    core.reset()


def _failing_record(be, stream=0):
    """Work on ``stream`` whose command buffer ends in MTLCommandBufferStatusError, and an event
    recorded at its end: (pointer, event)."""
    p = be.mem_alloc(64)
    e = be.event_create()
    core.inject_error("commit", 8)       # MTLCommandBufferErrorOutOfMemory
    be.memset_async(p, 1, 64, stream)
    be.event_record(e, stream)           # the record commits the failing buffer
    return p, e


# -- a failed command buffer is reported once ------------------------------------------------------

def test_failed_command_buffer_reported_by_event_sync_is_not_reported_again(be):
    """event_synchronize reported the failure, and then stream_query, stream_synchronize,
    device_synchronize, mem_free and close each reported the same failure again (the stream
    still listed the buffer), so unrelated later calls failed for work already reported."""
    s = be.stream_create()
    p, e = _failing_record(be, s)
    with pytest.raises(AcceleratorError, match="MTLCommandBufferErrorOutOfMemory"):
        be.event_synchronize(e)
    be.event_synchronize(e)              # reported already
    assert be.event_query(e) is True     # it has ended
    assert be.stream_query(s) is True
    be.stream_synchronize(s)
    be.device_synchronize()
    be.mem_free(p)
    be.event_destroy(e)
    be.stream_destroy(s)


def test_failed_command_buffer_reported_by_stream_query_is_not_reported_by_its_event(be):
    p, e = _failing_record(be)
    reported = []
    for _ in range(100_000):
        try:
            if be.stream_query(0):
                break
        except AcceleratorError as exc:
            reported.append(exc)
            break
    be.event_synchronize(e)
    be.device_synchronize()
    assert len(reported) == 1
    be.mem_free(p)
    be.event_destroy(e)


def test_failed_command_buffer_reported_once_through_accel(monkeypatch):
    """The same through accel's objects: Event.synchronize raised, then Stream.synchronize raised
    again for the same work."""
    use_sim(monkeypatch, "mps")
    metal.reset()
    core.reset()
    s = accel.Stream()
    b = accel.Buffer(64, stream=s)
    e = accel.Event()
    core.inject_error("commit", 8)
    b.fill_(1, s)
    e.record(s)
    with pytest.raises(AcceleratorError, match="MTLCommandBufferErrorOutOfMemory"):
        e.synchronize()
    s.synchronize()
    accel.synchronize()
    b.close()
    s.close()


def test_a_later_failure_is_still_reported(be):
    """Reporting once must not hide the next failure of other work."""
    p, e = _failing_record(be)
    with pytest.raises(AcceleratorError):
        be.event_synchronize(e)
    core.inject_error("commit", 1)       # MTLCommandBufferErrorInternal
    be.memset_async(p, 2, 64, 0)
    be.event_record(e, 0)
    with pytest.raises(AcceleratorError, match="MTLCommandBufferErrorInternal"):
        be.device_synchronize()
    be.event_synchronize(e)
    be.mem_free(p)
    be.event_destroy(e)


def test_close_does_not_report_an_error_already_reported(monkeypatch):
    use_sim(monkeypatch, "mps")
    metal.reset()
    core.reset()
    be = backends.get("mps")
    be.init()
    p, e = _failing_record(be)
    with pytest.raises(AcceleratorError):
        be.event_synchronize(e)
    be.close()                           # releases everything, raises nothing
    assert metal.state().live() == []


# -- every retain taken is released on every path ----------------------------------------------

@pytest.mark.parametrize("call", ["stream_synchronize", "device_synchronize", "close"])
def test_interrupted_synchronize_releases_its_command_buffer_retains(be, monkeypatch, call):
    """_sync_streams retained each in-flight command buffer and released them after the waits
    with no try/finally: a KeyboardInterrupt (Ctrl-C lands when waitUntilCompleted returns) or any
    error in the waits leaked the command buffers, and with them the queue and every buffer
    their commands used (the simulator's live objects after close() showed them)."""
    s = be.stream_create()
    p = be.mem_alloc(64)
    be.memset_async(p, 1, 64, s)
    rt = be._rt
    real_send = rt.send

    def send(receiver, msg, *args):
        if msg is mps_lib.M_WAIT:
            monkeypatch.setattr(rt, "send", real_send)
            raise KeyboardInterrupt
        return real_send(receiver, msg, *args)

    monkeypatch.setattr(rt, "send", send)
    if call == "close":
        with pytest.raises(KeyboardInterrupt):
            be.close()
        assert metal.state().live() == []
        be.init()
        return
    with pytest.raises(KeyboardInterrupt):
        getattr(be, call)(*((s,) if call == "stream_synchronize" else ()))
    be.device_synchronize()
    be.mem_free(p)
    be.stream_destroy(s)


# -- the simulator refuses what Metal's validation refuses -------------------------------------------

@pytest.mark.parametrize("factory", [M_BLIT, M_COMPUTE])
def test_encoder_released_without_end_encoding_is_refused(objc, factory):
    """Apple documents no behaviour for an encoder deallocated while still encoding (endEncoding:
    "Declares that all command generation from the encoder is completed"); Metal's API validation
    aborts with "Command encoder released without endEncoding".  The simulator let it pass."""
    rt, device = objc
    q = rt.send(device, M_QUEUE)
    with pytest.raises(metal.MetalValidationError, match="released without endEncoding"):
        with rt.pool():
            cb = rt.send(q, M_CB)
            rt.send(cb, factory)
    # the pool was drained all the same: nothing but the queue and the device is left
    assert sorted(metal.state().live_counts()) == ["AGXSimDevice", "MTLCommandQueue"]
    rt.release(q)


def test_ended_encoder_released_by_its_pool_is_fine(objc):
    rt, device = objc
    q = rt.send(device, M_QUEUE)
    with rt.pool():
        cb = rt.send(q, M_CB)
        rt.send(rt.send(cb, M_BLIT), M_END)
        rt.send(cb, M_COMMIT)
        rt.send(cb, M_WAIT)
    rt.release(q)
    assert metal.state().live_counts() == {"AGXSimDevice": 1}


def test_over_release_and_use_after_release_are_refused(objc):
    """"You must not relinquish ownership of an object you do not own": an autoreleased object
    released by its receiver is over-released when its pool drains; a message to a released
    object is "sent to deallocated instance"."""
    rt, device = objc
    q = rt.send(device, M_QUEUE)
    with pytest.raises(metal.MetalValidationError, match="over-release|deallocated"):
        with rt.pool():
            cb = rt.send(q, M_CB)    # +0 (autoreleased): not the caller's to release
            rt.release(cb)
    buf = rt.send(device, M_NEW_BUFFER, 64, 0)   # +1: the caller's
    rt.release(buf)
    with pytest.raises(metal.MetalValidationError, match="deallocated"):
        rt.send(buf, M_LENGTH)
    rt.release(q)


def test_live_objects_are_in_accel_sim_state(objc):
    """accel.sim.state() reports Metal objects not yet deallocated and autoreleases with no pool,
    so a leak test needs no simulator internals."""
    import accel.sim
    rt, device = objc
    buf = rt.send(device, M_NEW_BUFFER, 64, 0)
    st = accel.sim.state()
    assert st.metal_live_objects == {"AGXSimDevice": 1, "MTLBuffer": 1}
    assert st.metal_leaked_autoreleases == 0
    q = rt.send(device, M_QUEUE)
    cb = rt.send(q, M_CB)                 # autoreleased with no pool in place: leaks
    assert accel.sim.state().metal_leaked_autoreleases == 1
    rt.send(cb, M_COMMIT)
    rt.send(cb, M_WAIT)
    rt.release(buf)
    rt.release(q)
    assert "MTLBuffer" not in accel.sim.state().metal_live_objects


# -- MTLBuffer / MTLSharedEvent lifetimes across accel's close calls ----------------------------------

def test_pinned_buffer_freed_with_a_copy_queued_stays_valid_until_the_copy_ran(be):
    s = be.stream_create()
    d = be.mem_alloc(64)
    h = be.host_alloc(64)
    ctypes.memset(h, 5, 64)
    be.memcpy_async(d, h, 64, s)          # a blit from the pinned buffer, not yet committed
    be.host_free(h)                       # the command buffer keeps the MTLBuffer
    out = ctypes.create_string_buffer(64)
    be.memcpy_async(ctypes.addressof(out), d, 64, s)
    assert out.raw == b"\x05" * 64
    be.mem_free(d)
    be.stream_destroy(s)


def test_event_destroyed_while_another_stream_waits_on_it(be):
    a, b = be.stream_create(), be.stream_create()
    p = be.mem_alloc(64)
    e = be.event_create()
    be.memset_async(p, 3, 64, a)
    be.event_record(e, a)
    be.stream_wait_event(b, e)            # encoded in b's open command buffer
    be.event_destroy(e)                   # the command buffer keeps the MTLSharedEvent
    be.memset_async(p, 4, 64, b)
    be.stream_destroy(a)                  # committed work still completes
    be.stream_synchronize(b)
    out = ctypes.create_string_buffer(4)
    be.memcpy_async(ctypes.addressof(out), p, 4, b)
    assert out.raw == b"\x04" * 4
    be.stream_destroy(b)
    be.mem_free(p)


def test_accel_objects_closed_with_work_queued_leave_nothing(monkeypatch):
    use_sim(monkeypatch, "mps")
    metal.reset()
    core.reset()
    s = accel.Stream()
    e = accel.Event(enable_timing=True)
    b = accel.Buffer(1 << 16, stream=s)
    b.fill_(9, s)
    e.record(s)
    e.close()
    b.close()
    s.close()
    assert_nothing_left()


def assert_nothing_left() -> None:
    """Once accel's objects are closed and their work ran, only the device, queues and cached
    buffers are live, and closing the backend releases every Objective-C object."""
    accel.synchronize()
    accel.memory.empty_cache()
    assert set(accel.sim.state().metal_live_objects) <= {"AGXSimDevice", "MTLCommandQueue", "MTLBuffer"}
    backends.get("mps").close()
    assert metal.state().live() == []


EXIT_PROGRAM = r'''
import accel
from accel.sim import core
s = accel.Stream()
b = accel.Buffer(1 << 20, stream=s)
e = accel.Event()
b.fill_(1, s)
e.record(s)
core.inject_error("commit", 8)
b.fill_(2, s)             # fails, never synchronized: nothing to report at exit
keep = [s, b, e]
keep.append(keep)         # a cycle: collected after the modules are gone
print("done", flush=True)
'''


def test_interpreter_exit_with_metal_work_queued_and_failed():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "CUDA_VISIBLE", "ZE_"))}
    env.update(ACCEL_SIM="mps")
    proc = subprocess.run([sys.executable, "-c", EXIT_PROGRAM], env=env, capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "done" in out and "Exception ignored" not in out and "Traceback" not in out, out


def test_close_while_another_thread_synchronizes(monkeypatch):
    """close() from another thread while a synchronize waits outside the lock: close's own
    synchronize takes the waited buffers off the streams' lists before it releases what is left,
    so the waiting thread's release of the same list does not over-release (a Mac crashes), as
    stream_destroy's emptied list does (r6).  Deterministic: close runs inside the first wait."""
    import threading
    use_sim(monkeypatch, "mps")
    metal.reset()
    core.reset()
    be = backends.get("mps")
    be.init()
    p = be.mem_alloc(64)
    be.memset_async(p, 1, 64, 0)
    rt = be._rt
    real_send = rt.send
    closed = []

    def send(receiver, msg, *args):
        if msg is mps_lib.M_WAIT and not closed:
            closed.append(True)
            other = threading.Thread(target=be.close)
            other.start()
            other.join()
        return real_send(receiver, msg, *args)

    monkeypatch.setattr(rt, "send", send)
    be.stream_synchronize(0)
    monkeypatch.setattr(rt, "send", real_send)
    assert closed
    st = metal.state()
    assert st.live() == [] and st.engine_errors == []
