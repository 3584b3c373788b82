"""Adversarial review (r71a) of sessions 29-30's concurrency and memory core (6044cf2..4fd6984):
accel/_locks.py, accel/_finalize.py, the caching allocators' ``_probe``, graphs, streams, buffer.

What the project promises and these tests hold it to: a refused call changes nothing and can be
made again (graphs/graph_class.py ``_release_handles``: "A failure stops here and leaves the rest held, so
reset() may be called again"; ``_release_held``: "one that fails puts it back, for a retry"); a
Ctrl-C anywhere leaves nothing half-done (``_finish_end``: "Each step may run again"); user code
that runs inside accel (a gc callback, a ``__del__``) is refused, never hangs (r68i, r69h); accel's
own paths take an allocator's lock before the capture gate, never after (Backend.capture_gate,
_guards.probe).

Every interleaving is forced, nothing depends on timing: user code inside the pinned allocator
is a wrapper of its vendor call (``host_alloc``, made under the allocator's lock); a Ctrl-C is a
KeyboardInterrupt raised by a wrapper at one step; a collection is forced (``gc.collect()``) at an
allocation made inside the lock (at the default threshold one allocation in ~700 starts one), and
a user's gc callback acts at its end; a possible deadlock runs in a forked child under a watchdog.
Work is on device 1 (device 0 current) unless said otherwise.

Bugs (strict xfails; each reason names the cause):

1. **A refused release of a graph's pinned hold forgets the hold.**  ``Graph.reset()``
   (``_release_handles``) and a dropped graph's release (``_release_own``) take ``h.host`` out of
   the holder and then call ``host.release()``; when the pinned allocator refuses it (user code
   inside that allocator: ``_probe``'s re-entry refusal) the hold is gone from the graph but its
   blocks still name it, so a freed block stays parked for good (never reused, never unpinned).
   r69l put ``h.allocs`` back on a failure in ``_release_own`` only; ``_release_handles`` puts
   back neither.
2. **A Ctrl-C in capture_end's ``_finish_end`` loses the graph's pinned hold.**  ``_capture_end``
   pops the capture's hold into a local and stores it as ``h.host`` only after ``finally:
   self._finish_end()``; an interrupt there (the step the code says "may run again") leaves the
   hold nowhere, and its blocks parked for good.
3. **Plain module locks held across allocations: a gc callback that calls accel hangs.**
   ``streams._close_lock`` is held by ``Event._made`` across ``_fin.own()`` (which allocates), and
   ``streams._foreign_lock`` by ``_foreign_stream`` across ``_ForeignAnchor(...)`` and the
   WeakValueDictionary store.  A collection that ends there runs a user's gc callback inside the
   lock; one that closes another Event (or wraps another foreign stream) waits for the plain lock
   its own thread holds, forever.  ("Held for no call" / "never waited for by a finalizer": r68i
   turned ``_create_lock`` and ``_defaults_lock`` into accel._locks.Lock for exactly this.)
4. **accel's own path takes the allocator's lock after the capture gate.**
   ``_refuse_then_synchronize`` holds the gate while ``_check_device_free`` finishes an unfinished
   capture end (``_finish_end`` -> ``end_allocate_to_pool``, the allocator's lock): the reverse of
   every allocator path (lock, then gate).  ``_probe`` takes a gate holder for user code and
   bounds the wait, so ``with accel.graph(g2):`` fails with "called from a finalizer (__del__)"
   while another thread's empty_cache/free holds the lock and waits for the gate.
5. **A from_ptr owner closed under an outer gate hold is dropped under the gate.**
   ``Backend.after_gate`` exists because "a user's DLPack deleter or ``from_ptr`` owner may free an
   accel Buffer, which takes the allocator's lock and then the gate"; ``_release_foreign`` hands
   a DLPack import to it, but a ``from_ptr`` owner goes where ``_fin.release``'s argument tuple
   dies: a gc callback that closes such a Buffer inside a free holding the gate (r70a's scenario)
   runs the owner's ``__del__`` under the gate.

Checked and found fine (guards below or no test): the refusal itself in (1) (``_probe`` refuses
re-entry, the pinned state unchanged); ``run_locked``'s refusal of an OwnedLock its thread holds
(free_nowait of a Buffer dropped inside the allocator defers); ``Event._unmake`` after a refused
first record (lock order _create_lock -> _close_lock matches ``_create``/``_made``; a failed
destroy goes back to the registry); ``drain()`` refused while this thread holds the gate, and
``after_gate`` items are drained by Graph.capture_end; ``Imported.release`` idempotent (a
``_release_foreign`` interrupted after queueing runs the deleter once); ``set_allocator_settings``
refused inside a device's allocator rolls every device back.
"""

import faulthandler
import gc
import threading

import numpy as np
import pytest

import accel
from accel import _finalize, _lazy, _locks, graphs, streams
from accel.graphs import Graph
from accel.streams import on_device
from conftest import run_forked, use_sim

DEV = 1             # the non-current device (device 0 stays current)
CHILD_S = 20.0      # run_forked's limit (the watchdog below ends a hung child first)
HANG_S = 1.5        # a forked child's watchdog: the work takes milliseconds
GRAPH_SIMS = ["cuda", "xpu"]


def _parked() -> int:
    return len(accel.memory.host_allocator()._parked)


def _graph_copying_from_pinned(dev: int = DEV):
    """A graph captured on device ``dev`` whose replays copy from a pinned block, the block then
    freed by its owner: parked (held by the graph's CaptureHold)."""
    data = accel.empty_pinned(8, np.float32)
    data[:] = 2
    with accel.device_index(dev):
        buf = accel.Buffer(32)
        g = Graph()
        with accel.graph(g):
            buf.copy_from(data, non_blocking=True)
    del data
    return g, buf


def _inside_pinned_malloc(monkeypatch, be, act) -> list:
    """Run ``act()`` once inside the pinned allocator's malloc (its host_alloc vendor call, made
    under the allocator's lock), as a user's gc callback or signal handler would; returns
    [what act returned, or the AcceleratorError it raised]."""
    out = []
    real = be.host_alloc

    def host_alloc(size):
        if not out:
            assert accel.memory.host_allocator()._lock._is_owned()
            try:
                out.append(act())
            except accel.AcceleratorError as exc:
                out.append(exc)
        return real(size)

    monkeypatch.setattr(be, "host_alloc", host_alloc)
    try:
        accel.empty_pinned(1 << 16, np.uint8)     # a new block (the parked one is not reused)
    finally:
        monkeypatch.setattr(be, "host_alloc", real)
    return out


def _child(body, limit: float = HANG_S) -> int:
    """A forked child's body under a watchdog that dumps the stacks and exits 1 (a hang)."""
    faulthandler.dump_traceback_later(limit, exit=True)
    try:
        return body()
    finally:
        faulthandler.cancel_dump_traceback_later()


# =============================================================================================
# 1. a refused release of the graph's pinned hold forgets the hold
# =============================================================================================
@pytest.mark.parametrize("kind", GRAPH_SIMS)
def test_guard_reset_inside_the_pinned_allocator_is_refused(monkeypatch, kind):
    """Guard: the graph holds a parked block; reset() from inside the pinned allocator's malloc is
    refused (re-entry), and a reset made outside releases the hold (the block unparked)."""
    use_sim(monkeypatch, kind)
    be = _lazy.lazy_init()
    g, _ = _graph_copying_from_pinned()
    assert _parked() == 1
    g.replay()
    accel.synchronize(DEV)
    g2, _ = _graph_copying_from_pinned()
    assert _parked() == 2
    out = _inside_pinned_malloc(monkeypatch, be, lambda: len(accel.memory.host_allocator()._parked))
    assert out == [2]
    g2.reset()
    g.reset()
    assert _parked() == 0


# (r71a)
# (r71a found; fixed in session 31)
@pytest.mark.parametrize("kind", GRAPH_SIMS)
def test_a_refused_reset_can_be_retried_and_releases_the_pinned_hold(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    be = _lazy.lazy_init()
    g, _ = _graph_copying_from_pinned()
    assert _parked() == 1
    out = _inside_pinned_malloc(monkeypatch, be, g.reset)
    assert len(out) == 1 and isinstance(out[0], accel.AcceleratorError), out     # refused: re-entry
    g.reset()                       # outside now: reset() "may be called again"
    accel.synchronize(DEV)
    assert _parked() == 0, "the graph forgot its pinned hold: the block stays parked for good"
    # and the block is reused (it went back to the cache)
    again = accel.empty_pinned(8, np.float32)
    del again


# (r71a)
# (r71a found; fixed in session 31)
@pytest.mark.parametrize("kind", GRAPH_SIMS)
def test_a_graph_dropped_inside_the_pinned_allocator_releases_its_hold_later(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    be = _lazy.lazy_init()
    g, _ = _graph_copying_from_pinned()
    assert _parked() == 1
    holder = [g]
    del g
    out = _inside_pinned_malloc(monkeypatch, be, lambda: holder.clear())   # the graph's last reference
    assert out == [None]
    # safe points: the finalizer's release was refused, queued, and is retried at a drain
    accel.synchronize(DEV)
    accel.Buffer(64).close()
    _finalize.drain()
    assert _parked() == 0, "the dropped graph's pinned hold was forgotten: its block stays parked for good"


# =============================================================================================
# 2. a Ctrl-C in capture_end's _finish_end loses the pinned hold
# =============================================================================================
def _interrupted_capture_end(monkeypatch):
    """A capture on device DEV that copies from a pinned block; its capture_end is interrupted in
    _finish_end (the allocator's end_allocate_to_pool, first call): the capture ended, the end's
    bookkeeping owed.  Returns (graph, the pinned array)."""
    alloc = accel.memory.device_allocator(DEV)
    real = alloc.end_allocate_to_pool
    calls = []

    def end_allocate_to_pool(pool):
        calls.append(pool)
        if len(calls) == 1:
            raise KeyboardInterrupt("r71a: Ctrl-C in _finish_end")
        return real(pool)

    monkeypatch.setattr(alloc, "end_allocate_to_pool", end_allocate_to_pool)
    data = accel.empty_pinned(8, np.float32)
    with accel.device_index(DEV):
        buf = accel.Buffer(32)
        g = Graph()
        with pytest.raises(KeyboardInterrupt):
            with accel.graph(g):
                buf.copy_from(data, non_blocking=True)
    assert g._stream is None and g in graphs._unfinished     # ended, its bookkeeping owed
    return g, data, buf


@pytest.mark.parametrize("kind", GRAPH_SIMS)
def test_guard_an_interrupted_finish_end_is_finished_by_reset(monkeypatch, kind):
    """Guard: reset() finishes the owed end (the pool stops routing) and empties the graph."""
    use_sim(monkeypatch, kind)
    _lazy.lazy_init()
    g, data, _ = _interrupted_capture_end(monkeypatch)
    g.reset()
    assert g not in graphs._unfinished and g._graph is None and g._exec is None
    del data


# (r71a)
# (r71a found; fixed in session 31)
@pytest.mark.parametrize("kind", GRAPH_SIMS)
def test_ctrl_c_in_finish_end_keeps_the_pinned_hold_with_the_graph(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    _lazy.lazy_init()
    g, data, _ = _interrupted_capture_end(monkeypatch)
    del data                        # its owner frees the block: parked while the graph holds it
    g.reset()                       # finishes the end, releases what the graph holds
    accel.synchronize(DEV)
    assert _parked() == 0, "the interrupted capture_end lost the graph's pinned hold: the block stays parked"


# =============================================================================================
# 3. plain module locks held across allocations (forked child: a hang keeps the lock for good)
# =============================================================================================
class _InsideLock:
    """A gc callback that runs ``act()`` once, at the first collection that ends on this thread
    while ``lock_of()`` is held (single-threaded: a plain lock held is held by this thread)."""

    def __init__(self, lock_of, act):
        self.lock_of, self.act = lock_of, act
        self.ident = threading.get_ident()
        self.out = []

    def __call__(self, phase, info):
        if phase == "stop" and not self.out and threading.get_ident() == self.ident and self.lock_of().locked():
            self.out.append("fired")
            try:
                self.out.append(self.act())
            except (accel.AcceleratorError, RuntimeError) as exc:
                self.out.append(f"refused: {exc}")

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def _first_record(monkeypatch, act) -> list:
    """A first record of a new event on a stream of device DEV, which makes its device event and
    registers its destroy (``_fin.own``: allocations) under streams._close_lock; a collection
    starts at that allocation (forced: at the default threshold one in ~700 does) and a user's
    gc callback runs ``act(other)`` at its end, ``other`` an open recorded event."""
    s = accel.Stream(DEV)
    other = accel.Event()
    other.record(s)
    real = _finalize.own

    def own(fn, *args):
        gc.collect()        # (the collection an allocation inside own() may start)
        return real(fn, *args)

    monkeypatch.setattr(_finalize, "own", own)
    cb = _InsideLock(lambda: streams._close_lock, lambda: act(other))
    try:
        with cb:
            accel.Event().record(s)
    finally:
        monkeypatch.setattr(_finalize, "own", real)
    s.synchronize()
    return cb.out


def _foreign_wrap(monkeypatch, act) -> list:
    """A wrapper of a new foreign stream of device DEV, whose anchor is made and stored under
    streams._foreign_lock (allocations); a collection starts there (forced) and a user's gc
    callback runs ``act(spare)``, ``spare`` another foreign handle."""
    be = _lazy.lazy_init()
    with on_device(be, DEV):
        raw, spare = be.stream_create(0), be.stream_create(0)

    class Anchor(streams.foreign._ForeignAnchor):
        __slots__ = ()

        def __init__(self, *args):
            gc.collect()    # (the collection the anchor's allocation may start)
            super().__init__(*args)

    monkeypatch.setattr(streams.foreign, "_ForeignAnchor", Anchor)
    cb = _InsideLock(lambda: streams._foreign_lock, lambda: act(spare))
    try:
        with cb:
            kept = accel.Stream.from_handle(raw, device=DEV)
    finally:
        monkeypatch.setattr(streams.foreign, "_ForeignAnchor", Anchor.__mro__[1])
    del kept
    return cb.out


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_guard_a_collection_ends_inside_the_close_lock(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    out = _first_record(monkeypatch, lambda other: "seen")
    assert out == ["fired", "seen"], out


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_guard_a_collection_ends_inside_the_foreign_lock(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    out = _foreign_wrap(monkeypatch, lambda spare: "seen")
    assert out == ["fired", "seen"], out


def _close_lock_child(monkeypatch):
    def body():
        out = _first_record(monkeypatch, lambda other: other.close())
        return 0 if out and out[0] == "fired" else 4
    return lambda: _child(body)


def _foreign_lock_child(monkeypatch):
    def body():
        out = _foreign_wrap(monkeypatch, lambda spare: accel.Stream.from_handle(spare, device=DEV) is not None)
        return 0 if out and out[0] == "fired" else 4
    return lambda: _child(body)


# (r71a)
# (r71a found; fixed in session 31)
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_a_gc_callback_inside_a_first_record_can_close_another_event(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    code = run_forked(_close_lock_child(monkeypatch), CHILD_S)
    assert code == 0, f"the child hung or failed (status {code}; stacks on stderr)"


# (r71a)
# (r71a found; fixed in session 31)
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_a_gc_callback_inside_a_foreign_wrap_can_wrap_another_stream(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    code = run_forked(_foreign_lock_child(monkeypatch), CHILD_S)
    assert code == 0, f"the child hung or failed (status {code}; stacks on stderr)"


# =============================================================================================
# 4. the capture gate, then the allocator's lock (an unfinished capture end finished under it)
# =============================================================================================
def _gate_then_lock_child(monkeypatch):
    def body():
        _lazy.lazy_init()
        be = _lazy._initialized_backend
        g1, data, _ = _interrupted_capture_end(monkeypatch)
        alloc = accel.memory.device_allocator(DEV)
        monkeypatch.setattr(_locks, "GC_WAIT_S", 0.3)     # (the bounded wait: shorter, same outcome)
        t_holds, main_in_gate, t_done = threading.Event(), threading.Event(), threading.Event()
        real = Graph._refuse_before_sync

        def refuse_before_sync(self, index):
            main_in_gate.set()          # (called under the gate, before _check_device_free)
            return real(self, index)

        monkeypatch.setattr(Graph, "_refuse_before_sync", refuse_before_sync)

        def empty_cache_like():
            # another thread's empty_cache (or free with events) on device DEV: the allocator's
            # lock, then the gate (every allocator path's order)
            with alloc._lock:
                t_holds.set()
                main_in_gate.wait(1.0)
                with be.capture_gate:
                    pass
            t_done.set()

        g2 = Graph()
        buf = accel.Buffer(32, device=DEV)     # (before the other thread holds the lock)
        t = threading.Thread(target=empty_cache_like, daemon=True)
        t.start()
        t_holds.wait(5)
        result = "ok"
        with accel.device_index(DEV):
            try:
                with accel.graph(g2):
                    buf.fill_(1)
            except accel.AcceleratorError as exc:
                result = f"refused: {exc}"
        t.join(5)
        print(result)
        del data
        return 0 if result == "ok" and t_done.is_set() else 5
    return lambda: _child(body, 8.0)


# (r71a)
# (r71a found; fixed in session 31)
@pytest.mark.parametrize("kind", GRAPH_SIMS)
def test_a_capture_after_an_unfinished_end_does_not_take_the_lock_under_the_gate(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    code = run_forked(_gate_then_lock_child(monkeypatch), CHILD_S)
    assert code == 0, f"the capture was refused or the threads hung (status {code}; see stdout/stderr)"


# =============================================================================================
# 5. a from_ptr owner dropped under an outer hold of the capture gate
# =============================================================================================
class _UnderTheGate:
    """A gc callback that runs ``act()`` once, at the first collection that ends on this thread
    while it holds the backend's capture gate (as tests/test_review_r70a.py's), the collector
    running at nearly every allocation meanwhile."""

    def __init__(self, be, act):
        self.be, self.act = be, act
        self.ident = threading.get_ident()
        self.fired = False

    def __call__(self, phase, info):
        if (phase == "stop" and not self.fired and threading.get_ident() == self.ident
                and self.be.capture_gate._is_owned()):
            self.fired = True
            self.act()

    def __enter__(self):
        self._threshold = gc.get_threshold()
        gc.callbacks.append(self)
        gc.set_threshold(1)
        return self

    def __exit__(self, *exc):
        gc.set_threshold(*self._threshold)
        gc.callbacks.remove(self)


def _close_from_ptr_under_the_gate() -> tuple:
    """A from_ptr Buffer of device DEV whose ``owner`` notes, as it goes, whether its thread holds
    the capture gate; a gc callback closes that Buffer while this thread is inside another
    Buffer's free, which holds the gate to record the events of its other stream.  Returns
    (fired, what the owner noted)."""
    be = _lazy.lazy_init()
    mem = accel.Buffer(4096, device=DEV)
    noted = []

    class Owner:
        def __del__(self):
            noted.append(be.capture_gate._is_owned())

    wrapped = accel.Buffer.from_ptr(mem.ptr, 4096, device=DEV, owner=Owner())
    other = accel.Stream(DEV)
    b = accel.Buffer(64 << 10, device=DEV).fill_(1)
    b.record_stream(other)          # its free records events, the gate held
    accel.synchronize(DEV)
    cb = _UnderTheGate(be, wrapped.close)
    try:
        with cb:
            b.close()
        accel.Buffer(64).close()    # a safe point
    finally:
        _finalize.drain()
    mem.close()
    return cb.fired, noted


@pytest.mark.parametrize("kind", GRAPH_SIMS)
def test_guard_a_from_ptr_buffer_closed_under_the_gate(monkeypatch, kind):
    """Guard: the callback fires while the free holds the gate, and the owner goes once."""
    use_sim(monkeypatch, kind)
    fired, noted = _close_from_ptr_under_the_gate()
    assert fired, "no collection ended inside the gate"
    assert len(noted) == 1, noted


# (r71a)
# (r71a found; fixed in session 31)
@pytest.mark.parametrize("kind", GRAPH_SIMS)
def test_a_from_ptr_owner_closed_under_the_gate_goes_once_the_gate_is_free(monkeypatch, kind):
    """Backend.after_gate: "a user's DLPack deleter or ``from_ptr`` owner may free an accel Buffer,
    which takes the allocator's lock and then the gate" -- so it must not go under the gate."""
    use_sim(monkeypatch, kind)
    fired, noted = _close_from_ptr_under_the_gate()
    assert fired and len(noted) == 1
    assert noted == [False], "the from_ptr owner was dropped (its __del__ ran) while the thread held the capture gate"
