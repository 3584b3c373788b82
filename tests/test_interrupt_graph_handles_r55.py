"""A Ctrl-C anywhere in a graph's capture, instantiation, replay or reset leaves no graph or
executable-graph handle behind once the program has cleaned up (r55).

tests/test_interrupt_graphs.py (r37) sweeps the same workload for what must never be left: a
capture underway, allocations routed to an ended capture's pool, the generator in graph-safe
mode.  It did not count the runtime's graphs.  A handle exists from the moment the runtime's
call that makes it (cudaStreamEndCapture, cudaGraphInstantiate; zeCommandListClose on Level
Zero) returns, and the Graph stored it only some bytecodes later; a handle the Graph forgets
before its destroy call was lost when the interrupt landed between the two.  Here the injector
is tests/test_interrupt_backends.py's (no point where signals are blocked: a real signal stays
pending there), over the same files as the r37 sweep, and after each interrupted run and the
user's cleanup (end the capture if the graph still holds it, reset, drop) the simulator must hold
exactly the graphs, executable graphs and command lists it held before.  The points of
tests/test_interrupt_graphs.py's default sample (every 24th, plus the first of each file and
backend function: tia.sampled) by default (``ACCEL_TEST_THOROUGH=1``: all of them).
"""

import gc

import pytest

import accel
import test_interrupt_allocator as tia
import test_interrupt_graphs as tig
from accel import _finalize, _lazy, sim
from conftest import use_sim
from test_interrupt_backends import _Inject, interrupted

pytestmark = pytest.mark.usefixtures("frozen_heap")   # (conftest: a collection per point)


def _held(kind, be) -> tuple:
    gc.collect()
    _finalize.drain()
    accel.synchronize(accel.device_count() - 1)
    # settles the allocator's events of completed frees: a buffer of the graph's pool a replay
    # used on another stream keeps one until then (its free waits for the replay; session 39),
    # and the tracer of the counted run keeps the capture's temporary alive through the replay
    accel.memory.empty_cache()
    _finalize.drain()
    st = sim.state()
    if kind == "cuda":
        return ("graphs", st.graphs, "execs", st.graph_execs, "streams", st.streams, "events", st.events)
    return ("command_lists", st.ze_live_command_lists, "graphs", len(be._graphs), "execs", len(be._execs))


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_a_ctrl_c_anywhere_in_a_graphs_life_leaves_no_graph_handle(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    monkeypatch.setattr(tia, "_TARGETS", tig._targets())
    be = _lazy.lazy_init()
    dev = accel.device_count() - 1
    state = tig._fresh(dev)
    tig._work(state)            # first-use paths (kernels loaded, side streams) out of the way
    base = _held(kind, be)
    counter = _Inject(0)
    with counter:
        tig._work(state)
    assert _held(kind, be) == base
    assert counter.count > 50
    leaks = []
    for n in tia.sampled(counter.codes, tig._STRIDE):
        point, _ = interrupted(n, None, lambda: tig._work(state))
        tig._cleanup(state)
        after = _held(kind, be)
        if after != base:
            leaks.append((point.site, after))
            base = after        # each leaking point reported once
    state.clear()
    assert not leaks, leaks[:8]



@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_a_ctrl_c_anywhere_as_a_capture_begins_leaves_no_generator_in_graph_safe_mode(monkeypatch, kind):
    """Found by the sweep above (on Level Zero, where its every-second point landed there): an
    interrupt as a generator state's capture_prologue released its lock, after the state had
    entered graph-safe mode but before the graph's token listed it, left the device's default
    generator capturing for good ("another graph is being captured on device 1" at every later
    capture).  Here every point of accel.random's part of a capture's begin (what Graph's
    capture_begin calls) is swept, then the abort a failed begin runs."""
    import os
    from accel import random as R
    from accel.random import generator
    use_sim(monkeypatch, kind)
    targets = {os.path.abspath(R.__file__), os.path.abspath(generator.__file__)}
    dev = accel.device_count() - 1

    def fresh():
        """A new runtime, its generator's first capture begun and aborted (kernels loaded):
        every injected run then takes the same path."""
        _lazy._reset_for_tests()
        R._graph_capture_abort(R._graph_capture_begin(dev))

    fresh()
    counter = _Inject(0, targets)
    with counter:
        token = R._graph_capture_begin(dev)
    R._graph_capture_abort(token)
    assert counter.count > 5
    stuck = []
    for n in range(1, counter.count + 1):
        fresh()
        point, token = interrupted(n, targets, lambda: R._graph_capture_begin(dev))
        if token is not None:
            R._graph_capture_abort(token)
        if R._device_capturing(dev):
            stuck.append(point.site)
    assert not stuck, stuck


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_a_capture_begin_a_ctrl_c_cut_short_leaves_no_capture(monkeypatch, kind):
    """Graph.capture_begin either begins the capture or raises with none begun: before r55 a
    Ctrl-C as its stream hold ended (accel.streams._Hold.__exit__, after the capture had begun)
    raised with the capture underway and held by the graph, and accel.graph() took the error for
    a refusal (every later synchronize and empty_cache in the process then failed).  Found by
    the r37 sweep once r55 moved its sampled points.  Every point of accel/graphs/,
    accel/streams/ and accel.random in capture_begin is swept."""
    import os
    import accel.graphs
    import accel.streams
    from accel import random as R
    from accel.random import generator
    use_sim(monkeypatch, kind)
    streams = os.path.dirname(os.path.abspath(accel.streams.__file__))
    graphs = os.path.dirname(os.path.abspath(accel.graphs.__file__))
    targets = {os.path.abspath(m.__file__) for m in (R, generator)} | {
        os.path.join(folder, name) for folder in (streams, graphs) for name in os.listdir(folder)
        if name.endswith(".py")}
    dev = accel.device_count() - 1

    def fresh():
        """A new runtime whose first capture on a new stream of ``dev`` began and ended: every
        injected run then takes the same path (an interrupted one leaves state that would
        shorten the next run's, and move its points)."""
        _lazy._reset_for_tests()
        stream = accel.Stream(dev)
        end(stream, begin(stream, None))
        return _lazy.lazy_init(), stream

    def begin(stream, point):
        g = accel.Graph()
        with stream:
            if point is None:
                g.capture_begin()
            else:
                with point:
                    g.capture_begin()
        return g

    def end(stream, g):
        with stream:
            g.capture_end()
        g.reset()

    be, stream = fresh()
    counter = _Inject(0, targets)
    end(stream, begin(stream, counter))
    assert counter.count > 5
    left = []
    for n in range(1, counter.count + 1):
        be, stream = fresh()
        point = _Inject(n, targets)
        try:
            g = begin(stream, point)
        except KeyboardInterrupt:
            if be.captures_underway() or R._device_capturing(dev):
                left.append(point.site)
        else:
            end(stream, g)
    assert not left, left
