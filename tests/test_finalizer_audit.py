"""Audit of accel's finalizers (issue r18): ``__del__``, weakref callbacks, atexit and fork paths.

Each hazard is forced deterministically (a collection held open in another thread, a release
drained while a lock is held, a finalizer that fails), with a thread join(timeout) where a
deadlock is possible, so a hang fails the test instead of hanging the suite.
"""

import gc
import threading

import pytest

import accel
from accel import _finalize
import accel.sim as sim

from conftest import SIMS, use_sim

JOIN_S = 60


@pytest.fixture(autouse=True)
def no_automatic_gc():
    """Collections only where a test starts one: an automatic collection in the wrong thread
    would run the test's waiting finalizer there."""
    enabled = gc.isenabled()
    gc.disable()
    yield
    if enabled:
        gc.enable()


class _HeldCollection:
    """A cyclic garbage collection started in another thread and held open: the garbage's
    ``__del__`` waits (releasing the GIL) until :meth:`finish`."""

    def __init__(self):
        self.entered, self.go = threading.Event(), threading.Event()
        self.errors = []
        held = self

        class Garbage:
            def __init__(self):
                self.me = self

            def __del__(self):
                held.entered.set()
                held.go.wait(JOIN_S)

        def collect():
            try:
                gc.collect()
            except BaseException as exc:     # pragma: no cover - reported by finish()
                self.errors.append(exc)

        gc.collect()
        Garbage()
        self.thread = threading.Thread(target=collect, daemon=True)

    def __enter__(self):
        self.thread.start()
        assert self.entered.wait(JOIN_S), "the collection never reached the garbage"
        assert _finalize._collecting    # another thread collects
        return self

    def __exit__(self, *exc):
        self.go.set()
        self.thread.join(JOIN_S)
        assert not self.thread.is_alive(), "the held collection never finished"
        assert not self.errors, self.errors


def _device_count():
    return accel.device_count()


@pytest.mark.parametrize("kind", SIMS)
def test_explicit_release_is_not_deferred_by_another_threads_collection(monkeypatch, kind):
    """A collection running in another thread (its finalizer waiting on I/O, a lock, a stream)
    must not turn this thread's explicit close() / del into a deferred release: accel's
    finalizers run in the collecting thread, so nothing here can hold a lock the collector
    needs.  Before the fix close() was queued and memory_allocated() (whose drain also did
    nothing while any collection ran) still counted the closed buffer; a loop of
    allocate/close then ran out of memory."""
    use_sim(monkeypatch, kind, ACCEL_SIM_MEMORY=str(64 << 20))
    devices = _device_count()
    base = [accel.memory.memory_allocated(d) for d in range(devices)]
    with _HeldCollection():
        for d in range(devices):
            for _ in range(8):          # 256 MiB through a 64 MiB device, 32 MiB at a time
                with accel.Buffer(32 << 20, device=d):
                    pass
        for d in range(devices):
            b = accel.Buffer(1 << 20, device=d)
            b.close()
            assert accel.memory.memory_allocated(d) == base[d], "close() was deferred"
            b = accel.Buffer(1 << 20, device=d)
            del b
            assert accel.memory.memory_allocated(d) == base[d], "del was deferred"
            s = accel.Stream(d)
            e = accel.Event()
            e.record(s)
            s.close()
            e.close()
        assert not _finalize.pending, list(_finalize.pending)


@pytest.mark.parametrize("kind", SIMS)
def test_drain_in_another_thread_leaves_a_collected_cycles_buffer_open(monkeypatch, kind):
    """A buffer in a garbage cycle stays open until its collection is over, so another
    finalizer of the cycle may still use it (issue r15).  Now that other threads drain while a
    collection runs, their drain must leave that delayed release queued: the object is still
    alive (its cycle not yet freed) and would be taken for resurrected and closed."""
    use_sim(monkeypatch, kind)
    used = []
    held = _HeldCollection.__new__(_HeldCollection)
    held.entered, held.go, held.errors = threading.Event(), threading.Event(), []

    class User:
        def __del__(self):
            if held.entered.is_set() or not any(fn is _finalize._release_if_gone for fn, _ in _finalize.pending):
                return      # the buffer's finalizer has not run yet: the other User waits
            held.entered.set()
            held.go.wait(JOIN_S)
            try:
                self.buf.fill_(5)
                used.append(bytes(self.buf.to_numpy()[:2]))
            except Exception as exc:
                used.append(exc)

    gc.collect()
    base = accel.memory.memory_allocated(0)
    # One User before the buffer and one after: whichever order the collector calls the
    # finalizers of the cycle in, one User's runs after the buffer's and waits.
    first, buf, second = User(), accel.Buffer(4096, device=0), User()
    first.buf = second.buf = buf
    first.other, second.other = second, first
    del first, buf, second

    def collect():
        try:
            gc.collect()
        except BaseException as exc:
            held.errors.append(exc)

    held.thread = threading.Thread(target=collect, daemon=True)
    with held:
        accel.memory.memory_allocated(0)        # drains, in this thread, during the collection
        assert any(fn is _finalize._release_if_gone for fn, _ in _finalize.pending)
    assert used == [b"\x05\x05"], used
    _finalize.drain()
    assert accel.memory.memory_allocated(0) == base
