"""A Ctrl-C anywhere in a stream hold or a replay's hold of its kept events and modules leaves
nothing taken (r67e).

``streams._Hold`` marks a stream in use for a whole operation, and ``graphs.kept._KeptInUse`` marks
a replayed graph's external events in use and holds the locks of the modules whose kernels it
launches.  Before r67e a KeyboardInterrupt as a mark's append or a lock's acquire returned, or
as either ``__exit__`` started, left the mark (the stream's close() then never destroyed it) or
the lock (the graph's next replay hung on it): tests/test_rng_replay_no_host_wait_r66h.py.
Now each step is recorded with no interrupt point between the step and its record, so
``__enter__`` takes all or nothing, and ``__exit__`` can be called again to finish: the callers
that must not leave a mark (Graph.replay, the RNG ordering's hold of the last stream) call it
once more when a Ctrl-C stopped the with statement's call as it started.

Checked with the injector of tests/test_interrupt_backends.py (a KeyboardInterrupt at every
point where CPython runs a signal handler, over accel's stream, graph, RNG, allocator, lock
and backend files), on the CUDA simulator:

* a replay of a graph that records and waits for external events and launches kernels of two
  modules: after every interrupted replay no event or stream is marked in use, no module lock
  is held, this thread holds no stream, and the graph replays again and everything closes;
* nested holds (of one stream twice and of another) used as Graph.replay uses them: nothing
  left; used by a plain ``with``: the hold's record is exact at every point (no mark, or the
  record says one is left and a second ``__exit__`` drops it);
* a hold of a closed stream, and a replay whose module was closed, refuse and take nothing;
  a stream closed while held is destroyed as the hold ends.
"""

import os

import numpy as np
import pytest

import accel
from accel import _locks, memory, sim, streams
from accel.graphs import _KeptInUse
from accel.streams import _Hold
from conftest import use_sim
from test_user_kernels import SAXPY_PTX, saxpy_reference


def _targets():
    import test_interrupt_graphs as tig
    return tig._targets() | {os.path.abspath(_locks.__file__)}


def _sweep(work, check):
    """``work()`` with a KeyboardInterrupt at each of its interrupt points in turn, each run
    followed by ``check(n, injector, result)``; returns the number of points."""
    from test_interrupt_backends import _Inject, interrupted
    targets = _targets()
    counter = _Inject(0, targets)
    with counter:
        work()
    for n in range(1, counter.count + 1):
        point, result = interrupted(n, targets, work)
        check(n, point, result)
    return counter.count


def _held():
    return list(streams._state._tls.__dict__.get("held") or ())


@pytest.fixture
def cuda(monkeypatch):
    use_sim(monkeypatch, "cuda")
    sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64", replace=True)
    yield
    sim.unregister_kernel("saxpy")


@pytest.mark.usefixtures("frozen_heap")
def test_a_ctrl_c_anywhere_in_a_replay_with_kept_events_and_modules_leaves_nothing_taken(cuda):
    n = 64
    m1, m2 = accel.Module(SAXPY_PTX), accel.Module(SAXPY_PTX)
    k1, k2 = m1.function("saxpy", "f32, ptr, ptr, u64"), m2.function("saxpy", "f32, ptr, ptr, u64")
    s, r = accel.Stream(0), accel.Stream(0)
    x, y = accel.Buffer(4 * n, stream=s), accel.Buffer(4 * n, stream=s)
    x.copy_from(np.ones(n, np.float32), stream=s)
    y.copy_from(np.zeros(n, np.float32), stream=s)
    e1, e2 = accel.Event(external=True), accel.Event(external=True)
    e2.record(s)
    s.synchronize()
    g = accel.Graph()
    with s:
        g.capture_begin()
        e2.wait(s)
        accel.launch(k1, 1, n, 1.0, x, y, n, stream=s)
        e1.record(s)
        accel.launch(k2, 1, n, 1.0, x, y, n, stream=s)
        g.capture_end()
    s.synchronize()
    kept = [k for k in g._h.events]
    assert {m1, m2, e1, e2} <= set(kept), "the graph keeps both modules and both events"
    left = []

    def work():
        with r:
            g.replay()

    def check(i, point, result):
        accel.synchronize(0)
        taken = [name for name, busy in (("m1 lock", m1._lock.locked()), ("m2 lock", m2._lock.locked()),
                                         ("e1", e1._busy), ("e2", e2._busy), ("s", s._busy), ("r", r._busy),
                                         ("held", _held())) if busy]
        if taken:
            left.append((i, point.site, taken))
            for m in (m1, m2):
                if m._lock.locked():
                    m._lock.release()       # (so that the sweep goes on instead of hanging)
            for obj in (e1, e2, s, r):
                obj._busy.clear()
            streams._state._tls.__dict__.pop("held", None)

    points = _sweep(work, check)
    assert points > 30
    assert not left, f"taken after {len(left)} of {points} interrupt points: {left[:6]}"
    before = y.to_numpy(np.float32, stream=s)[0]
    with r:
        g.replay()                          # nothing hangs: both kernels add x once more
    assert y.to_numpy(np.float32, stream=r)[0] == before + 2.0
    accel.synchronize(0)
    g.reset()
    for obj in (x, y, e1, e2, s, r, m1, m2):
        obj.close()
    memory.empty_cache()
    assert sim.state().streams == 0 and sim.state().events == 0


def _replay_style(*stream_list):
    """Holds of ``stream_list``, nested, each released as Graph.replay releases its hold: a
    second ``__exit__`` when a Ctrl-C stopped the with statement's call as it started."""
    if not stream_list:
        return
    hold = _Hold(stream_list[0])
    try:
        with hold:
            stream_list[0].handle           # (a Stream method inside the hold)
            _replay_style(*stream_list[1:])
    finally:
        if hold._in:
            hold.__exit__(None, None, None)


@pytest.mark.usefixtures("frozen_heap")
def test_nested_holds_leave_nothing_at_any_interrupt_point(monkeypatch):
    use_sim(monkeypatch, "cuda")
    s, t = accel.Stream(0), accel.Stream(0)
    left = []

    def check(i, point, result):
        if s._busy or t._busy or _held():
            left.append((i, point.site, len(s._busy), len(t._busy), _held()))
            s._busy.clear(), t._busy.clear()
            streams._state._tls.__dict__.pop("held", None)

    points = _sweep(lambda: _replay_style(s, s, t), check)
    assert points > 20
    assert not left, f"left after {len(left)} of {points} interrupt points: {left[:6]}"
    s.close(), t.close()
    assert sim.state().streams == 0


@pytest.mark.usefixtures("frozen_heap")
def test_a_plain_with_hold_keeps_an_exact_record_at_any_interrupt_point(monkeypatch):
    """Without the caller's second call: the one point left is the with statement's call of
    ``__exit__`` as it starts, where the record says the mark is still there."""
    use_sim(monkeypatch, "cuda")
    s = accel.Stream(0)
    holds, wrong, unfinished = [], [], []

    def work():
        holds.append(_Hold(s))
        with holds[-1]:
            s.handle

    def check(i, point, result):
        hold = holds[-1]
        if bool(hold._in) != bool(s._busy) or len(_held()) != (1 if hold._in else 0):
            wrong.append((i, point.site, hold._in, len(s._busy), _held()))
        if hold._in:
            unfinished.append(point.stack[:2])
            hold.__exit__(None, None, None)     # finishes what the interrupted one did not start
        if s._busy or _held():
            wrong.append((i, point.site, "after a second __exit__", len(s._busy), _held()))
            s._busy.clear()
            streams._state._tls.__dict__.pop("held", None)

    points = _sweep(work, check)
    assert points > 5
    assert not wrong, wrong[:6]
    assert unfinished and all(stack[0] == "__exit__" for stack in unfinished), unfinished
    s.close()
    assert sim.state().streams == 0


def test_a_hold_of_a_closed_stream_takes_nothing(monkeypatch):
    use_sim(monkeypatch, "cuda")
    s = accel.Stream(0)
    s.close()
    hold = _Hold(s)
    with pytest.raises(RuntimeError, match="was closed"):
        with hold:
            pass
    assert not s._busy and not hold._in and _held() == []


def test_a_stream_closed_while_held_is_destroyed_as_the_hold_ends(monkeypatch):
    use_sim(monkeypatch, "cuda")
    s = accel.Stream(0)
    base = sim.state().streams
    with _Hold(s):
        s.close()                   # (as another thread's close: the destroy waits for the hold)
        assert sim.state().streams == base
        assert s.handle             # this thread's hold keeps the stream usable to its end
    assert sim.state().streams == base - 1
    assert not s._busy and _held() == []


def test_a_replay_whose_module_was_closed_takes_nothing(cuda):
    m = accel.Module(SAXPY_PTX)
    k = m.function("saxpy", "f32, ptr, ptr, u64")
    e = accel.Event(external=True)
    s = accel.Stream(0)
    x = accel.Buffer(256, stream=s)
    g = accel.Graph()
    with s:
        g.capture_begin()
        e.record(s)
        accel.launch(k, 1, 64, 1.0, x, x, 64, stream=s)
        g.capture_end()
    s.synchronize()
    m.close()
    with s, pytest.raises(RuntimeError, match="was closed"):
        g.replay()
    # the same refusal from _KeptInUse itself (a close after replay's own check)
    kept = _KeptInUse(g._h.events)
    with pytest.raises(RuntimeError, match="was closed"):
        with kept:
            pass
    assert not m._lock.locked() and not e._busy and not s._busy
    assert kept._marked == 0 and not kept._locked
    g.reset()
    for obj in (x, e, s):
        obj.close()
