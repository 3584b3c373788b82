"""The Ctrl-C sweeps again, each injection point in a FRESH runtime (r57).

The sweeps of tests/test_interrupt_backends.py, test_interrupt_buffers.py,
test_interrupt_xpu_r37.py and test_interrupt_graphs.py count the points of one run of their
workload, then inject at each point n in turn in ONE runtime.  An interrupted run leaves state
behind (a pool made, a cached segment, a loaded kernel, a side stream, a recycled event slot)
that makes the next run take a shorter path: the numbering shifts and whole stretches of the
counted run are never injected (r55 found a capture begun and left underway in
accel.streams._Hold.__exit__ only so, tests/test_interrupt_graph_handles_r55.py).

Here every injected run starts from a new runtime (``_lazy._reset_for_tests()``), so run n
takes the counted run's path and point n is always reached: each sweep asserts that every
point it picked was injected.  Two variants: ``warm``, the runtime first runs the workload once
(its first-use paths out of the way, as the lead's r55 pattern), and ``cold``, no warm-up: the
first use itself is swept (Level Zero's event pool filled, the VMM tables, the allocator's
first segment, a first capture's generator registration), which the one-runtime sweeps count
but never inject (their counted run was the runtime's first; every later run is shorter).
Before counting, one throwaway warm run takes the process's own first use (imports, module
caches, accel's lazy ``__getattr__``) out of the way, or the count is a few points long.  The workloads, their reconciliation and
their checks are the original sweeps' (imported, not copied where a function exists), on the
non-current device (1) where the workload is the test's to place.  After each interrupted run
and the program's cleanup, besides the original checks: no capture underway, no accel lock
held (every lock reachable from the backend, the allocators and accel's modules).

Measured at r57 (stride 1, sites = distinct file:line function injected): the cold sweeps
inject sites the one-runtime sweeps never reach (xpu copies 813 runs / 58 sites against 281 /
48, xpu allocators 2850 / 150 against 2540 / 138, cuda allocators 1421 / 81 against 1229 / 67,
Buffer dropped on cuda 194 / 113 against 102 / 74), the warm graph sweep 42 sites more on cuda
(the graph's release, release_pool, the generator's unregister_graph).  No point failed.

Default strides (18 to 120, 5 to 10 times the numbers in the code, r74a: about a third of r57's
twice, whose 60 s of one worker were too long for CI; each op still gets at least one point, see
_picked, and the cold allocator and copies sweeps every site a warm run never reaches, see
_cold_only) keep the CI run short; ACCEL_TEST_THOROUGH=1 injects every point (about 3.5 minutes);
``ACCEL_INTERRUPT_STRIDE`` overrides each sweep's stride;
``ACCEL_INTERRUPT_REPORT`` (a file) gets points counted / injected and the failures.
"""

import os
import sys
import threading
from collections import deque

import pytest

import accel
import test_interrupt_allocator as tia
import test_interrupt_backends as tib
import test_interrupt_buffers as tibuf
import test_interrupt_graph_handles_r55 as tgh
import test_interrupt_graphs as tig
import test_interrupt_xpu_r37 as tx
from accel import _lazy, _locks, memory
from accel.sim import _vmm
from accel.streams import on_device
from conftest import THOROUGH, use_sim

pytestmark = pytest.mark.usefixtures("frozen_heap")   # (conftest: a collection per point)

_ENV_STRIDE = int(os.environ.get("ACCEL_INTERRUPT_STRIDE", "0"))
_EVERY_SITE = tib._EVERY_SITE
_REPORT = os.environ.get("ACCEL_INTERRUPT_REPORT")
#: development: a list every injected site is appended to (compare with the one-runtime sweeps)
SITES = None


#: the default run's stride: this many times the code's (r74a: 5, was 2 - CI's 20 minutes; the
#: one-runtime sweeps still interrupt every site, these each op at least once, see _picked)
_DEFAULT_TIMES = 5


def _stride(default: int, times: int = _DEFAULT_TIMES) -> int:
    return _ENV_STRIDE or (1 if THOROUGH else times * default)


def _at_least(n: int, times: int = _DEFAULT_TIMES) -> int:
    """The fewest points a sweep of the code's stride injects, ``n``: 1/``times`` in the default run."""
    return n if _ENV_STRIDE or THOROUGH else n // times


def _cold_only(warm_sites, cold_sites) -> list:
    """[{point n}] per op: the first point of each site the cold run reaches and a warm run
    does not (the first-use paths this file exists for; r74a keeps them all by default)."""
    seen = {site for sites in warm_sites for site in sites}
    return tib.first_of_each_site([[s if s not in seen else None for s in sites] for sites in cold_sites],
                                  skip=None)


def _picked(total: int, stride: int, offset: int = 0, extra=()) -> list:
    """Every ``stride``-th point from ``offset`` and those in ``extra``; an op (or run) with
    points but shorter than the offset still gets one (r74a: the default stride would otherwise
    skip short ops whole)."""
    out = tib.picked(total, stride, offset, extra)
    return out or ([1 + offset % total] if total else [])


def _note(inj) -> None:
    if SITES is not None and inj is not None and inj.site:
        SITES.append(inj.site)


def _report(what, total, injected, failures, extra=()):
    if _REPORT:
        with open(_REPORT, "a") as out:
            print(f"\n{what} (fresh runtime per point): {total} points, {injected} injected, "
                  f"{len(failures)} failures", file=out)
            from collections import Counter
            for (site, text), k in Counter((f[-2], f[-1][:200]) for f in failures).most_common(30):
                print(f"   {k:4d}  {site}  -> {text}", file=out)
            for e in extra:
                print(f"   {e}", file=out)


# ---------------------------------------------------------------------------- common invariants
_RAW_LOCK = type(threading.Lock())
_RAW_RLOCK = type(threading.RLock())


def _held_locks(roots) -> list:
    """Every accel lock (and raw lock) reachable from ``roots`` through accel objects and plain
    containers that this thread holds (a Lock: held by anyone)."""
    seen, out = set(), []
    todo = deque((r, 0) for r in roots)
    while todo:
        obj, depth = todo.popleft()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        t = type(obj)
        if t is _locks.Lock or t is _RAW_LOCK:
            if obj.locked():
                out.append(getattr(obj, "what", repr(obj)))
            continue
        if t is _locks.RLock:
            if obj._lock._is_owned():
                out.append(obj.what)
            continue
        if t is _RAW_RLOCK:
            if obj._is_owned():
                out.append(repr(obj))
            continue
        if depth >= 5:
            continue
        if t in (dict,):
            items = list(obj.values()) + [k for k in obj if not isinstance(k, (int, str, bytes))]
        elif t in (list, tuple, set, frozenset, deque):
            items = list(obj)
        elif t is type(sys) and not obj.__name__.startswith("accel"):
            continue            # another module (threading's own locks are held by design)
        elif t.__module__.startswith("accel") or t is type(sys):
            items = list(getattr(obj, "__dict__", {}).values())
            for klass in t.__mro__:
                for name in getattr(klass, "__slots__", ()):
                    if isinstance(name, str) and hasattr(obj, name):
                        items.append(getattr(obj, name))
        else:
            continue
        todo.extend((x, depth + 1) for x in items
                    if not isinstance(x, (int, float, str, bytes, bool, type(None))) and not callable(x)
                    or type(x) in (_locks.Lock, _locks.RLock, _RAW_LOCK, _RAW_RLOCK))
    return out


def _quiet(be, *roots) -> None:
    """No capture underway, no accel lock held."""
    assert not be.captures_underway(), "a capture is still underway"
    mods = [m for name, m in list(sys.modules.items()) if name == "accel" or name.startswith("accel.")
            and not name.startswith("accel.sim")]
    held = _held_locks([be, *roots, *mods])
    assert not held, f"accel locks left held: {held}"


# ---------------------------------------------------------------------------- 1: backend memory calls
def _alloc_fresh(warm):
    """A new runtime; ``warm``: the allocators' workload run once and freed."""
    _lazy._reset_for_tests()
    be = _lazy.lazy_init()
    if not warm:
        return be
    w = tia.World(be)
    for what, op in tia._ops(w, ""):
        op()
    tia._finish(w)
    return be


def _alloc_sites(be):
    """The allocators' workload once on ``be``: each op's points' sites."""
    w = tia.World(be)
    sites = []
    for what, op in tia._ops(w, ""):
        rec = tib.site_recorder(tib._Inject)()
        with rec:
            op()
        sites.append(rec.sites)
    tia._finish(w)
    return sites


def _alloc_point(be, kind, i, n):
    """tib._sweep_alloc's run for op ``i`` interrupted at point ``n``: returns (injector, lost)."""
    w = tia.World(be)
    ops = tia._ops(w, "")
    for what, op in ops[:i]:
        op()
    inj, what = tia._run(w, ops[i:], 0, n)
    _note(inj)
    assert what is not None, f"point {n} of op {ops[i][0]!r} was never reached"
    tib._after_point(w, ops, i, check=lambda: _quiet(be, *w.allocators(), w.host))
    leaks = tib._leaks(be, kind)
    if leaks and tib._FREES & set(inj.stack) and tia._one_resource(tia._leaks(be)):
        return inj, True        # tib's accepted leak: a free interrupted before its vendor call
    assert not leaks, f"left behind: {leaks}"
    return inj, False


@pytest.mark.skipif(not _vmm.supported(), reason="this host cannot play virtual memory (mmap)")
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_fresh_runtime_per_point_backend_memory_calls(monkeypatch, kind, warm):
    use_sim(monkeypatch, kind)
    monkeypatch.setattr(tia, "_TARGETS", tib._targets())
    monkeypatch.setattr(tia, "_Inject", tib._Inject)
    be = _alloc_fresh(True)     # the process's first use (imports, module caches) out of the way
    warm_sites = _alloc_sites(be) if not warm else None     # (a used runtime's sites)
    be = _alloc_fresh(warm)
    sites = _alloc_sites(be)
    points = [len(s) for s in sites]
    # default: every 120th point, each op once (_picked) and, cold, each first-use site once
    stride = _stride(12, times=10)
    extra = _cold_only(warm_sites, sites) if not warm and _EVERY_SITE else [()] * len(points)
    injected, failures, lost = 0, [], []
    for i, total in enumerate(points):
        for n in _picked(total, stride, i, extra[i]):
            injected += 1
            be = _alloc_fresh(warm)
            inj = None
            try:
                inj, was_lost = _alloc_point(be, kind, i, n)
                if was_lost:
                    lost.append(inj.site)
            except BaseException as exc:   # noqa: BLE001 - a failure to report
                failures.append(((inj.site if inj else None) or f"op {i} point {n}",
                                 f"{type(exc).__name__}: {exc}"[:300]))
    _report(f"{kind} backend memory {'warm' if warm else 'cold'}", sum(points), injected, failures, [f"lost at a free's start: {len(lost)}"])
    assert injected > _at_least(50, times=10)
    assert not failures, failures[:6]


# ---------------------------------------------------------------------------- 2: copies and events on device 1
class Copies1(tib.Copies):
    """tib's copies/events workload with everything on the last device (1; Metal has one), made
    with that device current and run with device 0 current (the non-current device)."""

    def __init__(self, be):
        self.dev = be.count() - 1
        with on_device(be, self.dev):
            super().__init__(be)
            self.s = be.default_stream(self.dev)

    def close(self):
        with on_device(self.be, self.dev):
            super().close()


def _copies_fresh(warm):
    _lazy._reset_for_tests()
    be = _lazy.lazy_init()
    if not warm:
        return be
    c = Copies1(be)
    for what, op in c.ops():
        op()
    c.check()
    c.close()
    return be


def _copies_sites(be):
    """Copies1's workload once on ``be``: its op names and each op's points' sites."""
    c = Copies1(be)
    names, sites = [], []
    for what, op in c.ops():
        names.append(what)
        rec = tib.site_recorder(tib._Inject)()
        with rec:
            op()
        sites.append(rec.sites)
    c.check()
    c.close()
    return names, sites


def _copies_point(be, kind, i, n, inj, base_leaks, base_objects):
    c = Copies1(be)
    ops = c.ops()
    for what, op in ops[:i]:
        op()
    try:
        with inj:
            ops[i][1]()
    except KeyboardInterrupt:
        pass
    _note(inj)
    assert inj.site is not None, f"point {n} of op {ops[i][0]!r} was never reached"
    _quiet(be)
    for what, op in ops:          # a program goes on: the whole workload again
        op()
    c.check()
    c.close()
    _quiet(be)
    assert tib._leaks(be, kind) == base_leaks, f"left behind: {tib._leaks(be, kind)}"
    assert tib._objects(kind) == base_objects, f"Objective-C objects: {tib._objects(kind)} != {base_objects}"


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_fresh_runtime_per_point_copies_and_events_on_the_last_device(monkeypatch, kind, warm):
    use_sim(monkeypatch, kind)
    monkeypatch.setattr(tia, "_TARGETS", tib._targets())
    be = _copies_fresh(True)    # the process's first use (imports, module caches) out of the way
    warm_sites = _copies_sites(be)[1] if not warm else None     # (a used runtime's sites)
    be = _copies_fresh(warm)
    names, sites = _copies_sites(be)
    points = [len(s) for s in sites]
    base = tib._leaks(be, kind), tib._objects(kind)     # (what the first use keeps: Metal's pipelines)
    # default: every 24th point, each op once (_picked) and, cold, each first-use site once
    stride = _stride(3, times=8)
    extra = _cold_only(warm_sites, sites) if not warm and _EVERY_SITE else [()] * len(points)
    injected, failures = 0, []
    for i, total in enumerate(points):
        for n in _picked(total, stride, i, extra[i]):
            injected += 1
            be = _copies_fresh(warm)
            inj = tib._Inject(n)
            try:
                _copies_point(be, kind, i, n, inj, *base)
            except BaseException as exc:   # noqa: BLE001 - a failure to report
                failures.append((inj.site or f"op {names[i]} point {n}", f"{type(exc).__name__}: {exc}"[:300]))
    _report(f"{kind} copies/events on the last device {'warm' if warm else 'cold'}", sum(points), injected, failures)
    assert injected > _at_least(20, times=8)
    assert not failures, failures[:6]


# ---------------------------------------------------------------------------- 3: Level Zero streams, events, copies (r37)
def _xpu_fresh(warm):
    """A new runtime; ``warm``: tx's workload run once (its pools and slots made).  Returns the
    backend and its tables then (warm: the baseline every injected run must come back to)."""
    _lazy._reset_for_tests()
    be = _lazy.lazy_init()
    if not warm:
        return be, None
    w = tx.Work(be)
    for what, blocking, op in w.ops():
        op()
    w.check()
    w.close()
    return be, tx._tables(be)


def _xpu_run(be, i, n, warm):
    """tx._one_run; cold, without its gate: on a cold runtime the gate would take the first event
    slot (and make the pool) outside the injected op, so the op's first-use path would never be
    injected.  Cold runs check the queue only after the fact (the bytes, the tables)."""
    if warm:
        return tx._one_run(be, i, n)
    w = tx.Work(be)
    ops = w.ops()
    for what, blocking, op in ops[:i]:
        op()
    inj = tib._Inject(n)
    try:
        with inj:
            ops[i][2]()
    except KeyboardInterrupt:
        pass
    for what2, blocking2, op2 in ops:
        op2()
    w.check()
    w.close()
    return inj


def _counted(tables):
    return {k: len(v) if k in ("streams", "events") else v for k, v in tables.items()}


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_fresh_runtime_per_point_xpu_streams_events_and_copies(monkeypatch, warm):
    use_sim(monkeypatch, "xpu")
    monkeypatch.setattr(tia, "_TARGETS", tib._targets())
    monkeypatch.setattr(tia, "_Inject", tib._Inject)
    _xpu_fresh(True)            # the process's first use (imports, module caches) out of the way
    be, _ = _xpu_fresh(warm)
    names, counted = tx._points(be)         # (the cold baseline: a cold runtime's tables after one run)
    # each op's points counted as it is injected: after the ops before it (warm: behind tx's gate)
    points = []
    for i, (what, _) in enumerate(names):
        be, _ = _xpu_fresh(warm)
        points.append((what, _xpu_run(be, i, 0, warm).count))
    stride = _stride(6)
    injected, failures = 0, []
    for i, (what, total) in enumerate(points):
        for n in _picked(total, stride, i):
            injected += 1
            be, base = _xpu_fresh(warm)
            base = base or counted
            inj = None
            try:
                inj = _xpu_run(be, i, n, warm)
                _note(inj)
                assert inj.site is not None, f"point {n} of op {what!r} was never reached"
                got = tx._tables(be)
                if not warm:        # (each runtime's handles are new addresses)
                    got, base = _counted(got), _counted(base)
                assert got == base, f"left behind: { {k: v for k, v in got.items() if base[k] != v} }"
                _quiet(be)
            except BaseException as exc:   # noqa: BLE001 - a failure to report
                failures.append((f"{what} @{n}", (inj.site if inj else None), f"{type(exc).__name__}: {exc}"[:300]))
    _report(f"xpu streams/events/copies (r37 workload) {'warm' if warm else 'cold'}", sum(t for _, t in points), injected, failures)
    assert injected > _at_least(50)
    assert not failures, failures[:6]


# ---------------------------------------------------------------------------- 4: buffers and pinned arrays
def _buffers_fresh(make, drop, warm):
    _lazy._reset_for_tests()
    if not warm:
        return
    drop([make()])                  # first-use paths (lazy init, the first segment) out of the way
    tibuf._settle(collect=False)


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
@pytest.mark.parametrize("make, drop", [(tibuf._buffer_on_last, tibuf._close), (tibuf._buffer_on_last, tibuf._drop),
                                        (tibuf._pinned, tibuf._drop), (tibuf._random_filled, tibuf._close)],
                         ids=["buffer-close", "buffer-del", "pinned-del", "random-fill"])
def test_fresh_runtime_per_point_buffers_made_and_dropped(monkeypatch, kind, make, drop, warm):
    use_sim(monkeypatch, kind)
    monkeypatch.setattr(tia, "_TARGETS", tibuf._TARGETS)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(repr(u.exc_value)))
    _buffers_fresh(make, drop, True)    # the process's first use (imports, module caches) out of the way
    _buffers_fresh(make, drop, warm)
    total = tibuf._points(lambda: drop([make()]))
    stride = _stride(3, times=6)      # default: every 18th point (the drop's 24 cases share the sites)
    injected, failures = 0, []
    for n in _picked(total, stride):
        injected += 1
        _buffers_fresh(make, drop, warm)
        inj = None
        try:
            inj = tibuf._run_interrupted(n, make, drop)
            _note(inj)
            assert inj.site is not None, f"point {n} was never reached"
            tibuf._check_released()
            _quiet(_lazy.lazy_init(), memory.host_allocator(),
                   *(memory.device_allocator(d) for d in range(accel.device_count())))
        except BaseException as exc:   # noqa: BLE001 - a failure to report
            failures.append(((inj.site if inj else None) or f"point {n}", f"{type(exc).__name__}: {exc}"[:300]))
    _report(f"{kind} {make.__name__}/{drop.__name__} {'warm' if warm else 'cold'}", total, injected, failures)
    assert injected > _at_least(10, times=6)
    assert not failures, failures[:6]


# ---------------------------------------------------------------------------- 5: graphs (r37 / r55 workload)
def _graph_fresh(kind, dev, warm):
    _lazy._reset_for_tests()
    be = _lazy.lazy_init()
    state = tig._fresh(dev)
    if not warm:
        return be, state, None
    tig._work(state)            # first-use paths (kernels loaded, side streams) out of the way
    return be, state, tgh._held(kind, be)


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_fresh_runtime_per_point_graph_capture_replay_reset(monkeypatch, kind, warm):
    use_sim(monkeypatch, kind)
    monkeypatch.setattr(tia, "_TARGETS", tig._targets())
    dev = accel.device_count() - 1
    _graph_fresh(kind, dev, True)       # the process's first use (imports, module caches) out of the way
    be, state, _ = _graph_fresh(kind, dev, warm)
    counter = tib._Inject(0)
    with counter:
        tig._work(state)
    total = counter.count
    tig._check(state, be)       # as after an injected run
    counted = tgh._held(kind, be)
    stride = _stride(12, times=6)     # default: every 72nd point (each run reaches every op)
    injected, failures, held = 0, [], []
    for n in _picked(total, stride):
        injected += 1
        be, state, base = _graph_fresh(kind, dev, warm)
        base = base or counted
        inj = tib._Inject(n)
        try:
            try:
                with inj:
                    tig._work(state)
            except KeyboardInterrupt:
                pass
            _note(inj)
            assert inj.site is not None, f"point {n} was never reached"
            if tig._cleanup(state):
                held.append(inj.site)
            tig._check(state, be)       # no capture, generator not capturing, allocator; work again
            _quiet(be, memory.device_allocator(dev))
            after = tgh._held(kind, be)
            assert after == base, f"graph handles: {after} != {base}"
        except BaseException as exc:   # noqa: BLE001 - a failure to report
            failures.append((inj.site, f"{type(exc).__name__}: {exc}"[:300]))
        state.clear()
    _report(f"{kind} graphs {'warm' if warm else 'cold'}", total, injected, failures, [f"held by the graph after: {held}"])
    assert total > 50
    assert not failures, failures[:6]
    # the one window tig accepts: contextlib's __exit__ started, the capture still the graph's to end
    assert all(site.startswith("contextlib.py") for site in held), held
