"""accel._locks.RLock: re-entrant for the holder, refused to a finalizer the collector runs inside a hold."""

import threading

import pytest

from accel import _locks
from accel._errors import AcceleratorError
from conftest import deliver_then, pretend_collection


@pytest.fixture
def collecting(monkeypatch):
    """Pretend the cyclic collector runs on this thread (as inside a user's __del__)."""
    return lambda: pretend_collection(monkeypatch)


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


def test_a_collection_is_seen_on_its_thread_only_and_until_it_ends():
    """accel's gc.callbacks (C callables) mark a collection running from its start to its
    end, on the thread that runs it; deferred releases run once it ended."""
    import gc
    from accel import _finalize
    seen, other = [], []

    class Probe:
        def __del__(self):
            seen.append((_locks.collecting_here(), _locks.collection_running()))
            t = threading.Thread(target=lambda: other.append(_locks.collecting_here()))
            t.start()
            t.join(10)

    a, b = Probe(), Probe()
    a.b, b.a = b, a                 # a cycle: only the collector frees it
    del a, b
    gc.collect()
    assert seen == [(True, True)] * 2 and other == [False] * 2
    assert not _locks.collecting_here() and not _locks.collection_running()
    ran = []
    _finalize.defer(ran.append, "released")
    _finalize.drain()
    assert ran == ["released"]


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


def test_a_ctrl_c_arriving_as_a_collection_starts_reaches_the_program(monkeypatch):
    """A Ctrl-C (a signal handler raising KeyboardInterrupt) that arrives while the collector
    runs must reach the program.  CPython prints and ignores an exception raised in a gc
    callback, and runs a pending handler when a Python function starts: accel's callback was
    a Python function, so a Ctrl-C landing as a collection started was lost (r52: a third of
    the interrupts in the Ctrl-C program, tests/test_user_programs.py, were printed as
    "Exception ignored in: <function _on_gc>" and the loop went on).  The callbacks are C
    callables now, which run no handler; it runs as the collection returns."""
    import gc
    import signal
    import sys

    def handler(signum, frame):
        raise KeyboardInterrupt("arrived as the collection started")

    # The garbage an earlier test left (a reset backend's Streams, whose _live_streams weakref
    # callbacks are Python functions: the handler would run, and its exception be lost, in
    # one of them) must not be what the collection below frees first (r66a: a CI-order flake).
    gc.collect()
    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)
    others = [cb for cb in gc.callbacks if cb not in _locks._CALLBACKS]
    for cb in others:                             # only accel's callbacks in the way
        gc.callbacks.remove(cb)
    old = signal.signal(signal.SIGUSR1, handler)
    try:
        with pytest.raises(KeyboardInterrupt, match="arrived as the collection started"):
            deliver_then(signal.SIGUSR1, gc.collect)     # the collection's callbacks start first
    finally:
        signal.signal(signal.SIGUSR1, old)
        gc.callbacks.extend(others)
    assert ignored == []
    assert not _locks.collecting_here() and not _locks.collection_running()
