"""A Ctrl-C that lands as a Graph's ``__del__`` starts loses nothing the graph held (r54).

CPython raises a pending KeyboardInterrupt at the first instruction of a ``__del__`` and
ignores it (tests/test_interrupt_del_r53.py explains how the interrupt is made to land exactly
there).  Before r54 an interrupted ``Graph.__del__`` released nothing: the executable and graph
handles, the private memory pool (and the segments its blocks hold), the generator states'
registrations (and their seed/offset holders) and the pinned host blocks its captured copies
use stayed held until the runtime's teardown, and a graph dropped during its capture left the
capture underway (every sync, free and capture of the process failing).  Now what the graph
holds lives in a holder registered in accel._finalize.owned, released at the next entry of the
API once the graph is freed.  A graph resurrected by another finalizer of its garbage keeps it
all while it lives (its replays work), and releases it once dropped for good.

Before the fix 28 of these 29 tests failed (the per-point sweep came later), e.g. "device 0: graph
handles or a capture leaked: ('graphs', 1, 'execs', 1, 'captures', 0)" (a kept graph),
"... ('graphs', 0, 'execs', 0, 'captures', 1)" (one dropped while capturing: the capture stayed
underway), "the resurrected graph leaked {... 'reserved': (2097152, 6291456), 'rng
registrations': ((0, 0), (1, 1)), ... 'pinned parked': (0, 1)}"; and with no interrupt at all a
graph resurrected by another finalizer had its handles destroyed while it lived ("the handles of
a resurrected graph were destroyed": its __del__ in a collection queued the release
unconditionally).  The sweep then found the pool taken from the holder before the call that
fetched its allocator (an interrupt there leaked the pool).

Metal has no graphs (capture_begin and register_generator_state raise NotImplementedError).
"""

import gc
import re
import sys

import numpy as np
import pytest

import accel
from accel import _finalize, _lazy
from conftest import use_sim
from test_interrupt_del_r53 import _Interrupt

R = accel.random
GRAPH_SIMS = ["cuda", "xpu"]
DEVICES = [0, 1]
pytestmark = [pytest.mark.filterwarnings("ignore:The (CUDA|XPU) Graph is empty:UserWarning"),
              pytest.mark.usefixtures("frozen_heap")]   # (conftest: a collection per point)


# -- helpers -------------------------------------------------------------------------------
def _handles() -> tuple:
    """(graphs, executable graphs, captures underway) in the runtime; reads drain nothing."""
    be = _lazy.lazy_init()
    if accel.current_accelerator().type == "cuda":
        from accel import sim
        st = sim.state()
        return ("graphs", st.graphs, "execs", st.graph_execs, "captures", st.captures)
    return ("graphs", len(be._graphs), "execs", len(be._execs), "captures", len(be._captures))


def _parked() -> int:
    """Pinned blocks held by graphs after their arrays went (accel.memory._host.CaptureHold)."""
    return len(accel.memory.host_allocator()._parked)


def _held(dev: int, gen) -> dict:
    """Everything a graph on ``dev`` can hold, after empty_cache (a drain point)."""
    accel.synchronize(dev)
    accel.memory.empty_cache()
    default = R.default_generator(dev)._state
    return {"handles": _handles(), "reserved": accel.memory.memory_reserved(dev),
            "rng registrations": (default._graphs, gen._state._graphs),
            "rng holders": (bool(default._holders), bool(gen._state._holders)),
            "generator capturing": R.default_generator(dev).capturing, "pinned parked": _parked(),
            "registry": (len(_finalize.owned), len(_finalize.pending))}


def _settle(dev: int) -> None:
    gc.collect()
    _finalize.drain()
    accel.synchronize(dev)
    accel.memory.empty_cache()


class _Made:
    """A graph on ``dev`` in ``state`` and what it uses: "instantiated" (captured, instantiated,
    replayed; its graph handle destroyed), "kept" (keep_graph=True: both handles), "capturing"
    (capture_begin'd, not ended).  It registers a generator state of its own; its capture
    allocates (the private pool keeps a segment), copies from pinned memory (the array is
    dropped: the graph keeps the block) and, on CUDA, draws from that generator (Level Zero has
    no captured fills)."""

    def __init__(self, dev: int, state: str):
        self.dev, self.state = dev, state
        self.gen = R.Generator(dev, seed=5)
        self.out = accel.Buffer(256, device=dev)
        self.out.fill_(0)
        self.stream = accel.Stream(dev)
        self.graph = None

    def capture(self) -> "_Made":
        kind = accel.current_accelerator().type
        dev, state = self.dev, self.state
        pinned = accel.empty_pinned(64, np.float32)
        pinned[:] = 3
        g = accel.Graph(keep_graph=(state == "kept"))
        with accel.device_index(dev):
            g.register_generator_state(self.gen)
        with self.stream:
            accel.synchronize(dev)
            g.capture_begin()
            tmp = accel.Buffer(1 << 20)                     # from the graph's private pool
            tmp.fill_(1)
            small = accel.Buffer(256)
            small.copy_from(pinned, non_blocking=True)     # the graph holds the pinned block
            self.out.copy_from(small, non_blocking=True)
            if kind == "cuda":
                R.uniform_(accel.Buffer(4096), generator=self.gen)
            del tmp, small
            if state != "capturing":
                g.capture_end()
        del pinned
        if state != "capturing":
            g.replay()
            accel.synchronize(dev)
            assert self.out.to_numpy(np.float32)[:64].tolist() == [3] * 64
            self.out.fill_(0)
            accel.synchronize(dev)
        self.graph = g
        return self

    def check_alive(self, g) -> None:
        """The graph still works: its handles and pool were not released."""
        g.replay()
        accel.synchronize(self.dev)
        assert self.out.to_numpy(np.float32)[:64].tolist() == [3] * 64


_RECLAIM = {
    "drain": lambda dev: _finalize.drain(),
    "Event()": lambda dev: accel.Event(),
    "malloc": lambda dev: accel.Buffer(256, device=dev).close(),
}


def _leaked(base: dict, now: dict) -> dict:
    return {k: (base[k], now[k]) for k in base if base[k] != now[k]}


def _check_nothing_held(dev: int, made: "_Made", base: dict, what: str) -> None:
    """The ``what`` graph of ``made`` holds nothing on ``dev`` any more (``_held`` as in
    ``base``); then its stream's work is waited for."""
    now = _held(dev, made.gen)
    assert _leaked(base, now) == {}, f"device {dev}: the {what} graph leaked {_leaked(base, now)}"
    made.stream.synchronize()


# -- the interrupt as __del__ starts -------------------------------------------------------
@pytest.mark.parametrize("kind", GRAPH_SIMS)
@pytest.mark.parametrize("state", ["instantiated", "kept", "capturing"])
@pytest.mark.parametrize("reclaim", sorted(_RECLAIM))
def test_a_ctrl_c_as_a_graphs_del_starts_leaves_nothing_held_after_the_next_api_entry(monkeypatch, kind, state,
                                                                                       reclaim):
    use_sim(monkeypatch, kind)
    for dev in DEVICES:
        _settle(dev)
        made = _Made(dev, state)
        base = _held(dev, made.gen)                 # the same, without the graph
        made.capture()
        assert _handles() != base["handles"]
        if state != "capturing":                    # (empty_cache would invalidate a capture)
            held = _held(dev, made.gen)
            assert held["reserved"] > base["reserved"], (base, held)
            assert held["rng registrations"] == (1, 1) and held["pinned parked"] == 1, held
        box = [made.graph]
        made.graph = None
        before = _handles()
        with _Interrupt(monkeypatch) as run:
            run(box.clear)                          # the last reference: __del__ starts with Ctrl-C due
        assert run.ignored == [(KeyboardInterrupt, "Graph.__del__")], run.ignored
        assert _handles() == before, "the interrupt did not land at __del__'s start"
        _RECLAIM[reclaim](dev)                      # the next entry of the API
        assert _handles() == base["handles"], f"device {dev}: graph handles or a capture leaked: {_handles()}"
        _check_nothing_held(dev, made, base, state)
        del made
        _settle(dev)


@pytest.mark.parametrize("kind", GRAPH_SIMS)
@pytest.mark.parametrize("state", ["instantiated", "capturing"])
def test_a_ctrl_c_as_a_graphs_del_starts_in_a_collection_leaves_nothing_held(monkeypatch, kind, state):
    """The collector runs the ``__del__`` (a cycle holds the graph): all goes at the first
    drain point after the collection."""
    use_sim(monkeypatch, kind)

    class Cycle:
        pass

    for dev in DEVICES:
        _settle(dev)
        made = _Made(dev, state)
        base = _held(dev, made.gen)
        made.capture()
        holder = Cycle()
        holder.graph, holder.me = made.graph, holder
        del made.graph, holder
        before = _handles()
        with _Interrupt(monkeypatch) as run:
            run(gc.collect)                         # the graph's __del__ is the collection's first Python code
        assert run.ignored == [(KeyboardInterrupt, "Graph.__del__")], run.ignored
        assert _handles() == before
        accel.Event()                               # the first drain point after the collection
        assert _handles() == base["handles"], f"device {dev}: graph handles or a capture leaked: {_handles()}"
        _check_nothing_held(dev, made, base, state)
        del made
        _settle(dev)


@pytest.mark.parametrize("kind", GRAPH_SIMS)
@pytest.mark.parametrize("interrupted", [True, False], ids=["interrupted", "not-interrupted"])
def test_a_graph_resurrected_by_another_finalizer_keeps_everything_while_it_lives(monkeypatch, kind, interrupted):
    """The graph's ``__del__`` runs in a collection (a Ctrl-C stops it as it starts, or not),
    then another finalizer of the same garbage stores the graph: while it lives its handles,
    pool and registrations stay (its replays work; ``__del__`` never runs again), and once it
    is dropped for good they all go at the next drain point."""
    use_sim(monkeypatch, kind)
    kept = []

    class Saver:
        def __del__(self):
            kept.append(self.graph)

    for dev in DEVICES:
        _settle(dev)
        made = _Made(dev, "instantiated")
        base = _held(dev, made.gen)
        g = made.capture().graph
        del made.graph
        gc.collect()    # the graph in the oldest generation, the saver in a younger one: its __del__ runs first
        saver = Saver()
        saver.graph, saver.me = g, saver
        del g, saver
        before = _handles()
        with _Interrupt(monkeypatch) as run:
            if interrupted:
                run(gc.collect)
            else:
                gc.collect()
        if interrupted:
            assert run.ignored == [(KeyboardInterrupt, "Graph.__del__")], run.ignored
        assert len(kept) == 1
        accel.Event()                               # drain points after the collection
        _finalize.drain()
        accel.synchronize(dev)
        assert _handles() == before, f"device {dev}: the handles of a resurrected graph were destroyed"
        made.check_alive(kept[0])
        assert R.default_generator(dev)._state._graphs == 1 and made.gen._state._graphs == 1
        kept.clear()                                # dropped for good: __del__ does not run again
        accel.Event()
        _check_nothing_held(dev, made, base, "resurrected")
        del made
        _settle(dev)


@pytest.mark.parametrize("kind", GRAPH_SIMS)
def test_every_way_a_graph_goes_leaves_no_registration(monkeypatch, kind):
    """reset() then del, del, a collection, register_generator_state only, a refused capture:
    the registry holds only live graphs, and nothing waits for a drain when no interrupt came.
    A reset graph captures again and is released once."""
    use_sim(monkeypatch, kind)
    dev = DEVICES[-1]

    class Cycle:
        pass

    _settle(dev)
    made = [_Made(dev, "instantiated") for _ in range(3)]
    again = _Made(dev, "kept")
    base_owned = set(_finalize.owned)
    for m in made:
        m.capture()
    assert len(set(_finalize.owned) - base_owned) >= 3
    made[0].graph.reset()
    made[0].graph.reset()                           # twice: nothing more
    made[0].graph = None
    made[1].graph = None                            # __del__
    holder = Cycle()
    holder.graph, holder.me = made[2].graph, holder
    made[2].graph = None
    del holder
    gc.collect()
    g = accel.Graph()
    with accel.device_index(dev):
        g.register_generator_state(R.Generator(dev))
    del g
    assert not any(type(item) is not tuple for item in _finalize.pending)
    _finalize.drain()
    assert set(_finalize.owned) == base_owned, "a gone graph left its registration"
    assert not _finalize.pending
    # a graph reset and captured again: released once
    again.capture()
    again.graph.reset()
    with again.stream:
        g = again.graph
        g.capture_begin()
        accel.Buffer(4096).fill_(2)
        g.capture_end()
    g.replay()
    accel.synchronize(dev)
    del g
    again.graph = None
    assert set(_finalize.owned) == base_owned and not _finalize.pending
    for m in made + [again]:
        m.stream.synchronize()
    now = _held(dev, again.gen)
    assert now["handles"] == ("graphs", 0, "execs", 0, "captures", 0), now
    assert now["rng registrations"] == (0, 0) and now["pinned parked"] == 0, now


def test_graphs_are_refused_on_metal_as_documented(monkeypatch):
    """Metal has no stream capture: capture_begin and register_generator_state raise
    NotImplementedError (the backend's no_capture_reason) and the graph holds nothing, so
    its __del__ (interrupted or not) has nothing to release; the tests above skip Metal."""
    use_sim(monkeypatch, "mps")
    be = _lazy.lazy_init()
    assert not be.supports_graphs
    g = accel.Graph()
    with accel.Stream():
        with pytest.raises(NotImplementedError, match=re.escape(be.no_capture_reason)):
            g.capture_begin()
    with pytest.raises(NotImplementedError, match=re.escape(be.no_capture_reason)):
        g.register_generator_state(R.default_generator(0))
    assert g._h.backend is None and g._own is None     # nothing held, nothing registered
    before = dict(_finalize.owned)
    box = [g]
    del g
    gc.collect()                                    # (no traceback keeps the graph)
    with _Interrupt(monkeypatch) as run:
        run(box.clear)
    assert run.ignored == [(KeyboardInterrupt, "Graph.__del__")], run.ignored
    _finalize.drain()
    assert dict(_finalize.owned) == before and not _finalize.pending


# -- an interrupt at every point of a release: nothing released twice ---------------------------
@pytest.mark.parametrize("kind", GRAPH_SIMS)
@pytest.mark.parametrize("how", ["del", "collected", "reset"])
def test_a_ctrl_c_anywhere_in_a_graphs_release_releases_each_thing_once(monkeypatch, kind, how):
    """tests/test_interrupt_allocator.py's injector raises KeyboardInterrupt at each point of
    accel/graphs/ and accel/_finalize.py (and at the start of each function they call) while
    a captured graph (keep_graph: both handles) is dropped, collected, or reset then dropped.
    Its executable and graph handles, its pool and its generator registration are each
    released once (by its own path or, after the interrupt, at the next drain point), never
    twice; the pool or the generator registration leaks only where the interrupt lands at the
    start of the call that releases it, after the holder gave it up.  The handles no longer leak
    there: since r55 each is taken and destroyed with signals deferred (the injector is
    tests/test_interrupt_backends.py's, which has no point where signals are blocked)."""
    import os
    from test_interrupt_backends import _Inject
    from accel import graphs, memory
    use_sim(monkeypatch, kind)
    package = os.path.dirname(os.path.abspath(graphs.__file__))     # every file of accel/graphs/
    targets = {os.path.join(package, name) for name in os.listdir(package) if name.endswith(".py")} | {
        os.path.abspath(_finalize.__file__)}
    be = _lazy.lazy_init()
    dev = DEVICES[-1]
    released = []

    def counting(name, real):
        def call(x, *a, **k):
            released.append((name, x))
            return real(x, *a, **k)
        call.__name__ = name
        return call

    monkeypatch.setattr(be, "graph_exec_destroy", counting("graph_exec_destroy", be.graph_exec_destroy))
    monkeypatch.setattr(be, "graph_destroy", counting("graph_destroy", be.graph_destroy))
    monkeypatch.setattr(R, "_graph_release", counting("_graph_release", R._graph_release))
    alloc = memory.device_allocator(dev)
    monkeypatch.setattr(alloc, "release_pool", counting("release_pool", alloc.release_pool))
    monkeypatch.setattr(sys, "unraisablehook", lambda u: None)     # the interrupted __del__s
    # the start of a release call (this test's counting wrapper is the first Python code of one)
    windows = (" _graph_release", " release_pool", " release", " call")

    class Cycle:
        pass

    def make():
        s = accel.Stream(dev)
        g = accel.Graph(keep_graph=True)
        with s:
            g.capture_begin()
            accel.Buffer(1 << 16).fill_(1)
            g.capture_end()
        g.instantiate()
        h = g._h
        return [g], {("graph_exec_destroy", h.exec), ("graph_destroy", h.graph), ("_graph_release", h.rng),
                     ("release_pool", h.pool)}

    def drop(box):
        if how == "del":
            box.clear()
        elif how == "reset":
            try:
                box[0].reset()
            finally:
                box.clear()
        else:
            holder = Cycle()
            holder.graph, holder.me = box.pop(), holder
            del holder
            gc.collect()

    def after():
        gc.collect()
        _finalize.drain()
        accel.synchronize(dev)
        _finalize.drain()

    _settle(dev)
    box, mine = make()
    inj = _Inject(0, targets)
    with inj:
        drop(box)
    after()
    assert {r for r in released if r in mine} == mine
    assert inj.count > 5, inj.count         # (the points swept: 8 for a collected graph, more else)
    failures = []
    for n in range(1, inj.count + 1):
        box, mine = make()
        released.clear()
        point = _Inject(n, targets)
        try:
            with point:
                drop(box)
        except KeyboardInterrupt:
            pass
        after()
        got = [r for r in released if r in mine]
        twice = {r for r in got if got.count(r) > 1}
        if twice:
            failures.append(("released twice", sorted(twice, key=str), point.site))
        elif set(got) != mine and not point.site.endswith(windows):
            failures.append(("leaked", sorted(mine - set(got), key=str), point.site))
    assert not failures, failures
    assert not be.captures_underway()
