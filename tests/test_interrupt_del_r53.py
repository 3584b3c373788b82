"""A Ctrl-C that lands as an Event's, an owned Stream's or a kernel Module's ``__del__`` starts
loses no handle, and one anywhere in a release never destroys a handle twice (r53).

CPython runs a pending signal handler when a Python function starts (RESUME checks the eval
breaker), so a KeyboardInterrupt that became due just before an object's last reference went
is raised at the first instruction of its ``__del__``, printed and ignored
(``sys.unraisablehook``): the release in ``__del__`` never runs.  Buffers survive it (the
caching allocator frees the blocks of dead owners); before r53 an Event's, Stream's or
Module's handle stayed alive in the runtime until its teardown.  accel._finalize now registers
each such handle (``owned``) and releases it at the next drain point once its owner is freed.

The interrupt is made to land exactly there: the signal is raised while blocked, then
unblocked and the last reference dropped in one C step (tests/test_locks.py's technique), so
the first bytecode boundary after the signal is the ``__del__``'s first instruction.  The
handle must be gone after the next entry of the API (a drain point: creating an Event or a
Stream, synchronize, an allocation, empty_cache).  The handle must never be destroyed while its
object lives: one resurrected by another finalizer of its garbage keeps it, and a handle of a
runtime that was reset (tests) or of the parent of a forked child is never touched.
"""

import gc
import signal
import sys

import pytest

import accel
from accel import _finalize, _lazy, _locks
from conftest import SIMS, deliver_then, run_forked, use_sim

pytestmark = pytest.mark.usefixtures("frozen_heap")   # (conftest: a collection per point)


# -- helpers -------------------------------------------------------------------------------
def live() -> tuple:
    """The simulator's live streams and events (what a leaked handle keeps)."""
    from accel import sim
    kind = accel.current_accelerator().type
    if kind == "cuda":
        st = sim.state()
        return ("streams", st.streams, "events", st.events)
    if kind == "xpu":
        # event slots are pooled by the backend (count accel's events); a stream is a command list
        st = sim.state()
        return ("command_lists", st.ze_live_command_lists, "events", len(_lazy.lazy_init()._events))
    from accel.sim import metal
    counts = metal.state().live_counts()
    return ("queues", counts.get("MTLCommandQueue", 0), "events", counts.get("MTLSharedEvent", 0))


def settle() -> None:
    for dev in range(accel.device_count()):
        _MAKERS["event"](dev).close()   # first use of the device's default stream (a command list on xpu)
        accel.Buffer(256, device=dev).close()   # and of its allocator (memory.empty_cache drains through it)
    gc.collect()
    _finalize.drain()
    for d in range(accel.device_count()):
        accel.synchronize(d)
    accel.memory.empty_cache()
    _finalize.drain()


def _expected(what: str, dev: int, reclaim) -> tuple:
    """``live()`` after a ``what`` on ``dev`` was dropped with no interrupt and ``reclaim(dev)``
    ran (on Metal the allocator's covering event keeps a destroyed stream's queue until
    empty_cache); state settled again."""
    settle()
    obj = _MAKERS[what](dev)
    del obj
    reclaim(dev)
    counts = live()
    settle()
    return counts


class _Interrupt:
    """``with _Interrupt(monkeypatch) as run: run(fn)``: ``fn`` (a C callable) starts with a
    KeyboardInterrupt due (SIGUSR1's handler raises it); ``run.ignored`` lists (exception type,
    qualified name of the function it was ignored in) as sys.unraisablehook saw them.  Only
    accel's gc.callbacks stay (C callables): a Python one would take the interrupt instead."""

    def __init__(self, monkeypatch):
        self.ignored = []
        monkeypatch.setattr(sys, "unraisablehook", lambda u: self.ignored.append(
            (type(u.exc_value), getattr(u.object, "__qualname__", repr(u.object)))))
        self._mp = monkeypatch

    def __enter__(self):
        def handler(signum, frame):
            raise KeyboardInterrupt("Ctrl-C as __del__ started")
        self._old = signal.signal(signal.SIGUSR1, handler)
        self._others = [cb for cb in gc.callbacks if cb not in _locks._CALLBACKS]
        for cb in self._others:
            gc.callbacks.remove(cb)
        return self

    def __call__(self, fn) -> None:
        deliver_then(signal.SIGUSR1, fn)

    def __exit__(self, *exc):
        signal.signal(signal.SIGUSR1, self._old)
        gc.callbacks.extend(self._others)


def _devices(kind: str) -> list:
    return [0, 1] if kind != "mps" else [0]     # the Metal simulator has one device


def _event_on(dev: int) -> accel.Event:
    ev = accel.Event()
    ev.record(accel.current_stream(dev))        # its device event is made on dev (not current for 1)
    return ev


def _stream_on(dev: int) -> accel.Stream:
    stream = accel.Stream(dev)
    with stream:                                # used: the allocator knows the handle
        accel.Buffer(1 << 12).fill_(1)
    return stream


def _first_finalizer(obj) -> None:
    """Make ``obj``'s ``__del__`` the first Python code a collection of it runs.  A Stream's
    entry in accel.streams._live_streams (a WeakValueDictionary) has a Python weak-reference
    callback, which the collector runs before any finalizer and which would take the interrupt
    (printed and ignored there, the Stream's __del__ then runs whole): the entry goes first."""
    if isinstance(obj, accel.Stream):
        accel.streams._live_streams.pop((obj._index, obj._handle))


_MAKERS = {"event": _event_on, "stream": _stream_on}

_RECLAIM = {
    "Event()": lambda dev: accel.Event(),
    "Stream()": lambda dev: accel.Stream(dev).close(),
    "synchronize": lambda dev: accel.synchronize(dev),
    "malloc": lambda dev: accel.Buffer(256, device=dev).close(),
    "empty_cache": lambda dev: accel.memory.empty_cache(),
}


# -- the interrupt as __del__ starts -------------------------------------------------------
@pytest.mark.parametrize("kind", SIMS)
@pytest.mark.parametrize("what", sorted(_MAKERS))
@pytest.mark.parametrize("reclaim", sorted(_RECLAIM))
def test_a_ctrl_c_as_del_starts_leaves_no_handle_after_the_next_api_entry(monkeypatch, kind, what, reclaim):
    use_sim(monkeypatch, kind)
    for dev in _devices(kind):
        expected = _expected(what, dev, _RECLAIM[reclaim])
        base = live()
        box = [_MAKERS[what](dev)]
        made = live()
        assert made != base
        with _Interrupt(monkeypatch) as run:
            run(box.clear)                      # the last reference: __del__ starts with Ctrl-C due
        name = "Event.__del__" if what == "event" else "Stream.__del__"
        assert run.ignored == [(KeyboardInterrupt, name)], run.ignored
        assert live() == made, "the interrupt did not land at __del__'s start"
        _RECLAIM[reclaim](dev)                  # the next entry of the API
        assert live() == expected, f"device {dev}: a {what} handle leaked ({made} made, {live()} now)"
        settle()
        assert live() == base
    settle()
    assert not _finalize.owned


@pytest.mark.parametrize("kind", SIMS)
@pytest.mark.parametrize("what", sorted(_MAKERS))
def test_a_ctrl_c_as_del_starts_in_a_collection_leaves_no_handle(monkeypatch, kind, what):
    """The collector runs the ``__del__`` (a cycle holds the object): the handle goes at the
    first drain point after the collection."""
    use_sim(monkeypatch, kind)

    class Cycle:
        pass

    for dev in _devices(kind):
        expected = _expected(what, dev, accel.synchronize)
        base = live()
        obj = _MAKERS[what](dev)
        _first_finalizer(obj)
        holder = Cycle()
        holder.obj, holder.me = obj, holder
        made = live()
        del obj, holder
        with _Interrupt(monkeypatch) as run:
            run(gc.collect)                     # the object's __del__ is the collection's first Python code
        name = "Event.__del__" if what == "event" else "Stream.__del__"
        assert run.ignored == [(KeyboardInterrupt, name)], run.ignored
        assert live() == made
        accel.synchronize(dev)                  # the first drain point after the collection
        assert live() == expected, f"device {dev}: a {what} handle leaked ({made} made, {live()} now)"
        settle()
        assert live() == base


@pytest.mark.parametrize("kind", SIMS)
@pytest.mark.parametrize("what", sorted(_MAKERS))
def test_an_object_resurrected_after_its_interrupted_del_keeps_its_handle(monkeypatch, kind, what):
    """A Ctrl-C stops the object's ``__del__`` in a collection, then another finalizer of the
    same garbage stores the object (resurrects it): its handle must stay valid while it lives
    (the collector clears weak references to its garbage before any finalizer runs, so a weak
    reference to the object cannot tell), and go once it is dropped for good (its ``__del__``
    never runs again)."""
    use_sim(monkeypatch, kind)
    kept = []

    class Saver:
        def __del__(self):
            kept.append(self.obj)

    for dev in _devices(kind):
        expected = _expected(what, dev, accel.synchronize)
        base = live()
        obj = _MAKERS[what](dev)
        _first_finalizer(obj)
        gc.collect()    # obj in the oldest generation, saver in a younger one: obj's __del__ runs first
        saver = Saver()
        saver.obj, saver.me = obj, saver
        made = live()
        del obj, saver
        with _Interrupt(monkeypatch) as run:
            run(gc.collect)
        name = "Event.__del__" if what == "event" else "Stream.__del__"
        assert run.ignored == [(KeyboardInterrupt, name)], run.ignored
        assert len(kept) == 1
        accel.synchronize(dev)                  # a drain point after the collection
        settle()
        assert live() == made, "the handle of a resurrected object was destroyed"
        if what == "event":
            kept[0].record(accel.current_stream(dev))
            kept[0].synchronize()
        else:
            with kept[0]:
                accel.Buffer(1 << 12).fill_(2)
            kept[0].synchronize()
        kept.clear()                            # dropped for good: __del__ does not run again
        accel.synchronize(dev)
        assert live() == expected, f"device {dev}: a {what} handle leaked ({made} made, {live()} now)"
        settle()
        assert live() == base


@pytest.mark.parametrize("what", sorted(_MAKERS))
def test_a_handle_of_a_reset_runtime_is_never_reclaimed(monkeypatch, what):
    """The runtime is reset (tests switch simulators) and the new one hands out the same handle
    values: an old object's interrupted __del__ must not destroy the new runtime's handle."""
    use_sim(monkeypatch, "cuda")
    box = [_MAKERS[what](1)]
    use_sim(monkeypatch, "cuda")                # a fresh runtime
    settle()
    fresh = _MAKERS[what](1)
    made = live()
    with _Interrupt(monkeypatch) as run:
        run(box.clear)
    accel.synchronize(1)
    settle()
    assert live() == made
    fresh.synchronize()
    assert not _finalize.pending


def test_a_forked_child_never_reclaims_the_parents_handles(monkeypatch):
    """A child drops the parent's registry: the parent's objects dying there (interrupted or
    not) never call the parent's runtime."""
    use_sim(monkeypatch, "cuda")
    box = [_event_on(1), accel.Stream(1)]
    be = _lazy.lazy_init()
    calls = []

    def child():
        monkeypatch.setattr(be, "event_destroy", lambda *a: calls.append(a))
        monkeypatch.setattr(be, "stream_destroy", lambda *a: calls.append(a))
        if _finalize.owned:
            print("the child kept the parent's registry", file=sys.stderr)
            return 1
        with _Interrupt(monkeypatch) as run:
            run(box.clear)
        gc.collect()
        _finalize.drain()
        return 0 if not calls else 1

    assert run_forked(child) == 0


@pytest.mark.parametrize("kind", SIMS)
def test_the_registry_holds_only_live_objects(monkeypatch, kind):
    """Every way an Event or Stream goes (close, del, a collection, close then del) takes its
    entry; none waits for a drain when no interrupt came."""
    use_sim(monkeypatch, kind)
    settle()
    base = live()
    dev = _devices(kind)[-1]

    class Cycle:
        pass

    for what in sorted(_MAKERS):
        objs = [_MAKERS[what](dev) for _ in range(4)]
        assert len(_finalize.owned) == 4
        objs[0].close()
        objs.pop(0)
        objs.pop(0)                             # __del__
        holder = Cycle()
        holder.obj, holder.me = objs.pop(0), holder
        del holder
        gc.collect()
        objs[0].close()
        objs.clear()
        assert not any(type(item) is not tuple for item in _finalize.pending)
        _finalize.drain()
        assert not _finalize.owned and not _finalize.pending
    settle()
    assert live() == base


# -- kernel modules (accel.Module): the same hole, the same registry ----------------------------
def _modules() -> int:
    from accel import sim
    kind = accel.current_accelerator().type
    if kind == "cuda":
        return sim.state().modules
    if kind == "xpu":
        return sim.state().ze_live_modules
    from accel.sim import metal
    return metal.state().live_counts().get("MTLLibrary", 0)


def _module_on(dev: int) -> accel.Module:
    from test_user_kernels import SAXPY_MSL, SAXPY_PTX, spirv_module
    kind = accel.current_accelerator().type
    image = {"cuda": SAXPY_PTX, "mps": SAXPY_MSL, "xpu": spirv_module("saxpy") if kind == "xpu" else None}[kind]
    return accel.Module(image, device=dev)


@pytest.mark.parametrize("kind", SIMS)
@pytest.mark.parametrize("how", ["del", "collected"])
def test_a_ctrl_c_as_a_modules_del_starts_leaves_it_loaded_only_until_the_next_api_entry(monkeypatch, kind, how):
    use_sim(monkeypatch, kind)

    class Cycle:
        pass

    for dev in _devices(kind):
        settle()
        base = _modules()
        box = [_module_on(dev)]
        assert _modules() == base + 1
        with _Interrupt(monkeypatch) as run:
            if how == "del":
                run(box.clear)
            else:
                holder = Cycle()
                holder.obj, holder.me = box.pop(), holder
                del holder
                run(gc.collect)
        assert run.ignored == [(KeyboardInterrupt, "Module.__del__")], run.ignored
        assert _modules() == base + 1
        accel.synchronize(dev)                  # the next entry of the API
        assert _modules() == base, f"device {dev}: a module stayed loaded"
    settle()
    assert not _finalize.owned


@pytest.mark.parametrize("kind", SIMS)
def test_a_closed_or_dropped_module_leaves_no_registration(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    settle()
    base = _modules()
    dev = _devices(kind)[-1]
    mods = [_module_on(dev) for _ in range(3)]
    mods[0].close()
    mods[0].close()
    del mods[:2]
    assert len(_finalize.owned) == 1
    mods.clear()
    assert not _finalize.owned and not _finalize.pending
    assert _modules() == base


# -- an interrupt at every point of a release: never a handle destroyed twice -------------------
@pytest.mark.parametrize("kind", SIMS)
@pytest.mark.parametrize("what", sorted(_MAKERS))
@pytest.mark.parametrize("how", ["close", "del", "collected"])
def test_a_ctrl_c_anywhere_in_a_release_destroys_the_handle_once(monkeypatch, kind, what, how):
    """tests/test_interrupt_allocator.py's injector raises KeyboardInterrupt at each point of
    accel/streams/ and accel/_finalize.py (and at the start of each function they call) while
    an Event or Stream is closed, dropped or collected.  Its handle is destroyed once (closed,
    finalized or reclaimed at the next drain point), never twice: before r53 an interrupt as the
    destroy in close() returned reopened the object, whose __del__ destroyed the handle again
    (by then maybe another object's).  Nor does it leak: before r55 it did where the interrupt
    landed between the registry's take and the runtime's destroy call
    (accel._finalize.destroy_owned, which now runs them with signals deferred: the injector is
    tests/test_interrupt_backends.py's, which has no point where signals are blocked)."""
    import os
    from test_interrupt_backends import _Inject
    use_sim(monkeypatch, kind)
    streams = os.path.dirname(os.path.abspath(accel.streams.__file__))
    targets = {os.path.abspath(_finalize.__file__)} | {
        os.path.join(streams, name) for name in os.listdir(streams) if name.endswith(".py")}
    be = _lazy.lazy_init()
    name = f"{what}_destroy"
    real = getattr(be, name)
    destroyed = []

    def vendor_destroy(handle):
        destroyed.append(handle)
        real(handle)

    monkeypatch.setattr(be, name, vendor_destroy)
    monkeypatch.setattr(sys, "unraisablehook", lambda u: None)     # the interrupted __del__s
    dev = _devices(kind)[-1]

    class Cycle:
        pass

    def drop(box):
        if how == "close":
            try:
                box[0].close()
            finally:
                box.clear()
        elif how == "del":
            box.clear()
        else:
            holder = Cycle()
            holder.obj, holder.me = box.pop(), holder
            del holder
            gc.collect()

    def after():
        gc.collect()
        _finalize.drain()
        accel.synchronize(dev)

    settle()
    box = [_MAKERS[what](dev)]
    inj = _Inject(0, targets)
    with inj:
        drop(box)
    after()
    assert destroyed
    failures = []
    for n in range(1, inj.count + 1):
        box = [_MAKERS[what](dev)]
        handle = box[0]._handle
        destroyed.clear()
        point = _Inject(n, targets)
        try:
            with point:
                drop(box)
        except KeyboardInterrupt:
            pass
        after()
        if destroyed.count(handle) > 1:
            failures.append(("destroyed twice", point.site))
        elif handle not in destroyed:
            failures.append(("leaked", point.site))
    assert not failures, failures


@pytest.mark.parametrize("kind", SIMS)
@pytest.mark.parametrize("what", sorted(_MAKERS))
def test_a_close_the_runtime_refuses_leaves_the_object_open_and_registered(monkeypatch, kind, what):
    """A vendor error in close() leaves the handle alive: the object stays open, its entry
    registered (a Ctrl-C as its __del__ starts later still reclaims it), and it is destroyed
    once when dropped."""
    use_sim(monkeypatch, kind)
    settle()
    be = _lazy.lazy_init()
    name = f"{what}_destroy"
    real = getattr(be, name)
    destroyed = []

    def refuse(handle):
        raise accel.AcceleratorError(f"simulated: {name} failed")

    def count(handle):
        destroyed.append(handle)
        real(handle)

    dev = _devices(kind)[-1]
    box = [_MAKERS[what](dev)]
    handle = box[0]._handle
    monkeypatch.setattr(be, name, refuse)
    with pytest.raises(accel.AcceleratorError, match="simulated"):
        box[0].close()
    assert not box[0]._closed
    assert list(_finalize.owned) == [box[0]._own[0]]
    monkeypatch.setattr(be, name, count)
    with _Interrupt(monkeypatch) as run:
        run(box.clear)
    accel.synchronize(dev)
    assert destroyed == [handle] and not _finalize.owned and not _finalize.pending
