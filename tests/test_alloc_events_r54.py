"""The caching allocators' events (r54): a KeyboardInterrupt anywhere in them loses no event,
the events they keep are bounded by live objects, and ``accel.memory.empty_cache()`` drains
releases deferred by a collection even before any allocator exists.

An allocator records an event on a stream to know when work that used a block is done: when a
block used on other streams (``record_stream``) is freed (``record_uses``), and when a stream is
destroyed (``forget_stream``: one event covers the destroyed stream's free lists, one each use
of a live block by it, a ``_Gate``).  The event waits in ``_pending_events`` (or in the block's
uses), then goes back to the allocator's cache of completed events (per device, as torch's
event pool), which ``empty_cache`` destroys.  So the live events are: the cache (at most the
peak number of events outstanding at once), one per pending block use and destroyed-stream
free lists, and one per use of a live block by a destroyed stream: none after the blocks are
freed, the work is done and ``empty_cache`` ran.

Before r54 an interrupt between an event's record and the step that published it (at
``_Gate.__init__``'s start, at ``on_device.__exit__`` in ``_record``, inside ``_rehome`` or
``_complete`` after the entry left ``_pending_events``) lost the event: it stayed alive in the
runtime until its teardown, one more each such interrupt (the Ctrl-C program of
tests/test_user_programs.py ended with a covering event alive in 5 of 6 seeds).  The sweeps
below raise KeyboardInterrupt at every eval-breaker point (tests/test_interrupt_allocator.py's
injector) of the allocator calls that make or retire events, then finish the program and count
the simulator's live events (by default every 4th point and the first of each file and backend
function, r74b; ``ACCEL_TEST_THOROUGH=1``: every point).
"""

import gc
import importlib
import os
from collections import Counter

import pytest

import accel
from accel import _finalize, _lazy, sim
from accel.memory import _caching, _config
from accel.memory._caching import DeviceCachingAllocator
from accel.memory._host import HostCachingAllocator
from accel.streams import on_device
from conftest import THOROUGH, use_sim
from test_interrupt_allocator import _Inject, check_device, check_host, sampled

MiB = 1 << 20
KINDS = ["cuda", "xpu"]
# every 4th point by default (r74b, was every point), plus the first point of each file and
# backend function (event_record, event_destroy, stream_destroy, ...) that stride missed
# (test_interrupt_allocator.sampled): each event-making or -destroying call is still interrupted
_STRIDE = int(os.environ.get("ACCEL_INTERRUPT_STRIDE", "1" if THOROUGH else "4"))


def _live_events(be) -> int:
    """Events alive in the runtime (xpu: the backend pools event slots; count its events)."""
    if accel.current_accelerator().type == "xpu":
        return len(be._events)
    return sim.state().events


def _leftovers(be) -> dict:
    st = sim.state()
    out = {}
    if _live_events(be):
        out["events"] = _live_events(be)
    if any(st.live_allocations.values()):
        out["live_allocations"] = st.live_allocations
    if getattr(st, "host_allocations", 0):
        out["host_allocations"] = st.host_allocations
    return out


# -- a world: allocators of both devices (device 1 is not the current one), a stream of each
class _World:
    def __init__(self, be, host: bool = False):
        self.be = be
        self.allocs = [DeviceCachingAllocator(be, d, _config.parse("")) for d in (0, 1)]
        self.host = HostCachingAllocator(be) if host else None
        self.streams = {}
        for d in (0, 1):
            with on_device(be, d):
                self.streams[d] = be.stream_create()
        self.live = {}

    def default(self, d):
        return self.be.default_stream(d)

    def fill(self):
        """Blocks on both allocators: cached in each stream's own lists (a destroyed stream's
        lists wait for one event), in use by a stream of the same and of the other device
        (a _Gate each once the stream is destroyed)."""
        A, S = self.allocs, self.streams
        for d in (0, 1):
            a, s = A[d], S[d]
            p = a.malloc(3 * MiB, s)
            self.live[f"own{d}"] = (a, a.malloc(700, s))
            a.free(p)
            q = a.malloc(2 * MiB, self.default(d))
            a.record_stream(q, s, d)
            self.live[f"used{d}"] = (a, q)
            x = a.malloc(1000, self.default(d))
            a.record_stream(x, S[1 - d], 1 - d)
            self.live[f"cross{d}"] = (a, x)
            y = a.malloc(5000, self.default(d))
            a.record_stream(y, S[0], 0)
            a.record_stream(y, S[1], 1)
            self.live[f"both{d}"] = (a, y)
        if self.host is not None:
            for d in (0, 1):
                h = self.host.malloc(1000)
                self.host.record_stream(h, S[d], d)
                self.host.record_stream(h, S[1 - d], 1 - d)
                self.live[f"host{d}"] = (self.host, h)

    def close(self, d):
        """What Stream.close does: the allocators forget the stream, then it is destroyed.
        Retried by finish() when interrupted (close() leaves the stream open then)."""
        s = self.streams.get(d)
        if s is None:
            return
        for a in self.allocs:
            a.forget_stream(s, d)
        if self.host is not None:
            self.host.forget_stream(s, d)
        with on_device(self.be, d):
            self.be.stream_destroy(s)
        del self.streams[d]

    def free(self, name):
        a, p = self.live[name]
        a.free(p)
        del self.live[name]

    def sync(self):
        for d in (0, 1):
            with on_device(self.be, d):
                self.be.device_synchronize()

    def finish(self):
        """Free everything still allocated (what the program holds, an interrupted free's block,
        a malloc's orphan), close the streams, let the work end, empty the caches."""
        for d in (0, 1):
            self.close(d)
        for a in self.allocs:
            for ptr, b in list(a._blocks.items()):
                if b.state == _caching._ALLOCATED:
                    a.free(ptr)
        if self.host is not None:
            for ptr, b in list(self.host._blocks.items()):
                if b.allocated:
                    self.host.free(ptr)
        self.live.clear()
        self.sync()
        for a in self.allocs:
            a.empty_cache()
            check_device(a)
        if self.host is not None:
            self.host.empty_cache()
            check_host(self.host)


def _sweep(monkeypatch, kind, prepare, op, host=False, accepted=(), busy=True):
    """Interrupt ``op(world)`` (after ``prepare(world)``) at each of its eval-breaker points, then
    finish the program: [(site, what was left)] for each run that left something.  A run whose
    interrupt landed as a function in ``accepted`` started (a destroy: the handle may be gone
    already, so the allocator forgets it first) and left exactly one event is counted apart.

    ``busy``: a destroyed stream's work counts as still queued (the world queues none), so
    forget_stream covers it with events, as for a stream destroyed right after its work was
    queued; else the allocators ask the stream (r63: an idle one needs no event)."""
    use_sim(monkeypatch, kind)
    if busy:
        # (accel.memory._host names the pinned allocator there: the module is asked for by name)
        host_module = importlib.import_module("accel.memory._host")
        monkeypatch.setattr(_caching, "stream_done", lambda owner, stream, device: False)
        monkeypatch.setattr(host_module, "stream_done", lambda owner, stream, device: False)
    be = _lazy.lazy_init()
    w = _World(be, host)
    prepare(w)
    inj = _Inject(0)
    with inj:
        op(w)
    total = inj.count
    w.finish()
    assert not _leftovers(be), f"without an interrupt: {_leftovers(be)}"
    failures, lost = [], Counter()
    for n in sampled(inj.codes, _STRIDE):
        w = _World(be, host)
        prepare(w)
        inj = _Inject(n)
        try:
            with inj:
                op(w)
        except KeyboardInterrupt:
            pass
        try:
            w.finish()
            left = _leftovers(be)
        except BaseException as exc:   # noqa: BLE001 - a failure to report
            left = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        if left:
            if inj.site and inj.site.split()[-1] in accepted and left == {"events": 1}:
                lost[inj.site] += 1
            else:
                failures.append((inj.site, left))
            use_sim(monkeypatch, kind)      # a fresh runtime for the next run
            be = _lazy.lazy_init()
    assert total > 20, total
    return failures, lost


def _report(failures) -> str:
    sites = Counter(f"{site} -> {left}" for site, left in failures)
    return f"{len(failures)} interrupted runs left something: " + "; ".join(
        f"{k}x {s}" for s, k in sites.most_common(8))


@pytest.mark.parametrize("busy", [True, False], ids=["busy", "idle"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dev", [1, 0])
def test_stream_destroyed_with_an_interrupt_anywhere_loses_no_event(monkeypatch, kind, dev, busy):
    """forget_stream (Stream.close, an owned Stream's release) records one event on the stream
    for its cached lists and one per use of a live block (on this and the other device), none
    when the stream is idle; an interrupt anywhere in it leaves every event in the cache or
    published, so after close() is retried, the blocks freed and empty_cache nothing is alive."""
    failures, _ = _sweep(monkeypatch, kind, _World.fill, lambda w: w.close(dev), busy=busy)
    assert not failures, _report(failures)


@pytest.mark.parametrize("host", [False, True], ids=["device", "pinned"])
@pytest.mark.parametrize("kind", KINDS)
def test_second_stream_destroyed_drops_the_first_ones_completed_gates_interrupted_anywhere(
        monkeypatch, kind, host):
    """The blocks both streams used hold the first stream's gates (completed) when the second
    is destroyed: its forget drops them, their events back to the cache, as it adds its own
    (uses_forgotten); an interrupt anywhere loses none."""
    def prepare(w):
        w.fill()
        w.close(1)

    failures, _ = _sweep(monkeypatch, kind, prepare, lambda w: w.close(0), host=host)
    assert not failures, _report(failures)


@pytest.mark.parametrize("kind", KINDS)
def test_free_with_uses_interrupted_anywhere_loses_no_event(monkeypatch, kind):
    """free() of blocks used on streams of both devices records one event per use
    (record_uses), of live streams and of destroyed ones (gates)."""
    def prepare(w):
        w.fill()
        w.close(0)

    def op(w):
        for name in ("both1", "cross1", "used1", "both0"):
            w.free(name)

    failures, _ = _sweep(monkeypatch, kind, prepare, op)
    assert not failures, _report(failures)


@pytest.mark.parametrize("kind", KINDS)
def test_completed_events_processed_with_an_interrupt_anywhere_lose_none(monkeypatch, kind):
    """A malloc processes completed events (_process_events): a pending block completes and a
    destroyed stream's lists join the default stream's (_rehome), and each event goes back to
    the cache; an interrupt anywhere in that loses none."""
    def prepare(w):
        w.fill()
        w.close(1)
        w.close(0)
        for name in ("both1", "cross1", "used1", "both0", "used0", "cross0"):
            w.free(name)
        w.sync()

    def op(w):
        for d in (1, 0):
            a = w.allocs[d]
            w.live[f"new{d}"] = (a, a.malloc(600, w.default(d)))

    failures, _ = _sweep(monkeypatch, kind, prepare, op)
    assert not failures, _report(failures)


@pytest.mark.parametrize("kind", KINDS)
def test_empty_cache_interrupted_anywhere_loses_at_most_the_event_being_destroyed(monkeypatch, kind):
    """empty_cache waits for pending events (_wait_for_events: each back to the cache) and
    destroys the cached ones.  An event is taken out of the cache before its destroy (a
    destroyed handle must never stay cached: the runtime may give its value to a new event),
    so an interrupt exactly as event_destroy starts may lose that one event (as a free's start
    may lose its memory, tests/test_interrupt_allocator.py); anywhere else, none."""
    def prepare(w):
        w.fill()
        w.close(1)
        w.close(0)
        for name in ("both1", "cross1", "used1", "both0", "used0"):
            w.free(name)

    def op(w):
        w.allocs[1].empty_cache()
        w.allocs[0].empty_cache()

    failures, lost = _sweep(monkeypatch, kind, prepare, op, accepted={"event_destroy"})
    assert not failures, _report(failures)
    assert set(lost) <= {s for s in lost if s.endswith(" event_destroy")}, lost


@pytest.mark.parametrize("kind", KINDS)
def test_pinned_free_with_uses_interrupted_anywhere_loses_no_event(monkeypatch, kind):
    """The pinned allocator records its events through the same record_uses."""
    def op(w):
        w.free("host1")
        w.free("host0")

    failures, _ = _sweep(monkeypatch, kind, _World.fill, op, host=True)
    assert not failures, _report(failures)


@pytest.mark.parametrize("kind", KINDS)
def test_pinned_blocks_stream_destroyed_with_an_interrupt_anywhere_loses_no_event(monkeypatch, kind):
    """The pinned allocator's forget_stream covers each use of a live pinned block by the
    stream with an event (cover); an interrupt anywhere in it loses none."""
    failures, _ = _sweep(monkeypatch, kind, _World.fill, lambda w: w.close(1), host=True)
    assert not failures, _report(failures)


# -- the bound: events kept are not a function of the number of streams destroyed -------------
def _streams_program(n: int, keep: list) -> None:
    """``n`` streams made and destroyed, alternately on device 0 (current) and 1, each with
    blocks allocated on it, used by another stream (record_stream) and by it, freed before
    and after it is destroyed; every third block used by the stream is kept alive."""
    for i in range(n):
        d = i % 2
        s = accel.Stream(d)
        t = accel.Stream(1 - d)
        with s:
            a = accel.Buffer(1 << 14, device=d)
            a.fill_(1)
            b = accel.Buffer(1 << 14, device=1 - d)
            b.record_stream(s)
            c = accel.Buffer(1 << 12, device=d)
            c.record_stream(accel.current_stream(d))
        x = accel.Buffer(1 << 12, device=d)
        x.fill_(2)
        x.record_stream(s)
        if keep is not None and i % 3 == 0:
            keep.append(x)
        del a, b, c, x
        s.close()
        t.close()


def _settle() -> None:
    gc.collect()
    _finalize.drain()
    for d in range(accel.device_count()):
        accel.synchronize(d)
    for d in range(accel.device_count()):
        accel.Buffer(256, device=d).close()    # a malloc: completed events go back to the cache


def test_events_kept_are_bounded_by_live_blocks_not_by_streams_destroyed(sim_cuda):
    """Live events once the work is done: the allocators' caches of completed events (as many
    as were outstanding at once: the same after 6 streams destroyed as after 60) plus at most
    one per live block that a destroyed stream used (its gate, until the block is freed, a
    later stream's forget or empty_cache finds it completed; the cache then keeps it, up to
    empty_cache); none after empty_cache, even with the blocks alive."""
    assert accel.device_count() >= 2
    _settle()
    accel.memory.empty_cache()
    base = sim.state().events
    cached = {}
    for n in (6, 60):
        _streams_program(n, None)
        _settle()
        cached[n] = sim.state().events
        assert sim.state().streams == 0
        accel.memory.empty_cache()
        assert sim.state().events == base, (n, sim.state().events, base)
    assert cached[60] == cached[6], cached          # the caches: not a function of n
    for n in (6, 60):
        keep = []
        _streams_program(n, keep)
        _settle()
        held = sim.state().events
        # (a kept block holds a gate only while the destroyed stream's work is not done)
        assert held - base <= cached[6] - base + len(keep), (n, held, len(keep), cached)
        accel.memory.empty_cache()      # completed gates of live blocks go too (r63)
        assert sim.state().events == base, (n, sim.state().events, base, len(keep))
        keep.clear()
        _settle()
        accel.memory.empty_cache()
        assert sim.state().events == base, (n, sim.state().events, base)


# -- memory.empty_cache() before any allocator -------------------------------------------------
def test_empty_cache_drains_deferred_releases_before_any_allocator(sim_cuda, monkeypatch):
    """An Event freed by a cyclic collection is released at the next entry of the API
    (accel._finalize); memory.empty_cache() and empty_host_cache() are such entries even
    when no allocator exists yet (before r54 they returned at once, the handle left alive)."""
    from accel import memory
    gc.collect()
    _finalize.drain()
    assert not memory._allocators and memory._host is None
    for empty in (memory.empty_cache, memory.empty_host_cache):
        e = accel.Event()
        e.record()
        before = sim.state().events

        class Cycle:
            def __init__(self, ev):
                self.me, self.ev = self, ev

        Cycle(e)
        del e
        enabled = gc.isenabled()
        gc.disable()
        try:
            gc.collect()            # the Event's release is deferred (it runs in the collection)
            assert _finalize.pending, "the release was not deferred: the test sees nothing"
            assert sim.state().events == before
            empty()
            # (empty_cache makes every device's caching allocator since session 32, as torch's
            # init does; neither makes the host allocator)
            assert memory._host is None
            assert sim.state().events == before - 1, f"{empty.__name__}() left the event alive"
        finally:
            if enabled:
                gc.enable()
