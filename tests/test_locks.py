"""accel._locks.RLock: re-entrant for the holder, refused to a finalizer the collector runs inside a hold."""

import threading

import pytest

from accel import _locks
from accel._errors import AcceleratorError


@pytest.fixture
def collecting(monkeypatch):
    """Pretend the cyclic collector runs on this thread (as inside a user's __del__)."""
    def start():
        monkeypatch.setattr(_locks, "_started", _locks._collections())
        monkeypatch.setattr(_locks, "_collector", threading.get_ident())
    return start


def test_the_holder_re_enters():
    lock = _locks.RLock("x")
    with lock:
        with lock:
            assert lock.acquire()
            lock.release()
    assert lock._owner is None and lock._depth == 0
    assert lock.acquire(False)
    lock.release()


def test_a_finalizer_run_inside_a_hold_is_refused_and_the_hold_is_unchanged(collecting):
    lock = _locks.RLock("the Metal backend")
    with lock:
        collecting()                                 # the collector starts halfway through the call
        with pytest.raises(AcceleratorError, match="the Metal backend was called from a finalizer"):
            lock.acquire()
        assert lock._depth == 1 and lock._owner == threading.get_ident()
    assert lock._owner is None
    with lock:                                        # a finalizer's own outermost hold works, nested too
        with lock:
            pass


def test_a_hold_taken_by_a_finalizer_re_enters(collecting):
    collecting()
    lock = _locks.RLock("x")
    with lock:
        with lock:
            assert lock._depth == 2


def test_another_thread_waits_and_a_finalizer_waits_bounded(collecting, monkeypatch):
    lock = _locks.RLock("x")
    held, done = threading.Event(), threading.Event()

    def hold():
        with lock:
            held.set()
            done.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    try:
        assert not lock.acquire(False)
        assert not lock.acquire(True, 0.01)
        monkeypatch.setattr(_locks, "GC_WAIT_S", 0.01)
        collecting()
        with pytest.raises(AcceleratorError, match="finalizer"):
            lock.acquire()
    finally:
        done.set()
        t.join(10)
    assert lock.acquire(True, 5)
    lock.release()


def test_release_by_a_thread_not_holding_it_raises():
    lock = _locks.RLock("x")
    with pytest.raises(RuntimeError):
        lock.release()
    lock.acquire()
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, lock.release)))
    t.start()
    t.join(10)
    assert errors and lock._depth == 1
    lock.release()


def test_a_stop_callback_interrupted_as_it_starts_is_not_taken_for_a_collection_still_running(monkeypatch):
    """A KeyboardInterrupt (Ctrl-C) that lands as the collector's "stop" callback starts (CPython
    checks for a signal when a Python function starts) is printed and ignored, and the callback's
    body never runs.  accel must not believe a collection still runs on this thread afterwards:
    deferred releases would then wait for good (drain() skips during a collection), and every
    accel lock would take its slow path.  (r37: seen in the Ctrl-C program as blocks never freed.)"""
    import gc
    import sys
    from accel import _finalize

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code is _locks._on_gc.__code__ and frame.f_locals.get("phase") == "stop":
            raise KeyboardInterrupt("as the stop callback starts")
        return None

    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)
    sys.settrace(tracer)
    try:
        gc.collect()
    finally:
        sys.settrace(None)
    assert ignored and isinstance(ignored[0].exc_value, KeyboardInterrupt)     # the interrupt landed there
    assert not _locks.collecting_here()
    assert not _locks.collection_running()
    ran = []
    _finalize.defer(ran.append, "released")
    _finalize.drain()
    assert ran == ["released"]
    gc.collect()            # and the next collection is seen as usual
    assert not _locks.collection_running()


def test_an_interrupted_no_drain_section_does_not_stop_drain_for_good():
    """accel._finalize.no_drain counted its sections in Python __enter__/__exit__: a
    KeyboardInterrupt as __exit__ started (CPython checks for a signal when a Python function
    starts) left the count up, and drain() skipped every deferred release on that thread from
    then on (r37: seen after the graph interrupt sweep, as releases piling up in later tests)."""
    import sys
    from accel import _finalize

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "__exit__" and "_finalize" in frame.f_code.co_filename:
            raise KeyboardInterrupt("as no_drain's __exit__ starts")
        return None

    sys.settrace(tracer)
    try:
        with _finalize.no_drain:
            pass
    except KeyboardInterrupt:
        pass            # (no Python __exit__ to interrupt any more: the with statement calls C)
    finally:
        sys.settrace(None)
    ran = []
    _finalize.defer(ran.append, "released")
    _finalize.drain()
    assert ran == ["released"]
