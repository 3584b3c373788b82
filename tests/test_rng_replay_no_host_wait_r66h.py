"""A graph that draws random numbers, replayed on two streams by turns, is ordered on the device (r66h).

Each replay's RNG prologue writes the graph's seed/offset holders on the replay stream, and the
graph's kernels read them; a replay on another stream than the holders' last use must come
after that use (r65a: two replays on two streams drew the same numbers).  Since 1bc2eb7 that
order was a HOST wait (cudaStreamSynchronize of the last stream) on every such replay, so a
pipeline replaying one graph on two streams by turns blocked the host each time (torch does no
ordering at all).  ``accel.random._after_last_use`` now records one of the device allocator's
cached events on the last stream and makes the replay stream wait for it (cudaMallocAsync: the
allocator's temporary event, whose failed destroy it keeps for empty_cache): no host wait, and
no event owned by the replay or the graph, so nothing a finalizer must destroy.

Checked here, on the CUDA simulator:

* alternating replays queue with no cudaStreamSynchronize / cudaDeviceSynchronize /
  cudaEventSynchronize, under the three allocator configurations (expandable and classic
  segments, backend:cudaMallocAsync), and leave as many live events as they found (an event
  made for a wait is destroyed once the wait is queued);
* the numbers are right: a simulated kernel captured after the draw logs, in launch order, the
  words each replay drew; with the replay streams backlogged by turns they are each replay's
  own offsets, the same as the same replays on one stream, and the Philox reference;
* the log does catch a missing order (the ordering switched off: two replays draw alike);
* no event leaks with cudaEventDestroy failing on every call (a graph reset, and one dropped
  without reset), nor with a Ctrl-C anywhere in a pair of alternating replays;
* another thread's global-mode capture is not invalidated by the device-side ordering;
* the host wait is still the fallback where the device cannot order: the last stream closed.
"""

import gc
import struct
import threading

import numpy as np
import pytest

import accel
from accel import memory, sim
from accel import random as R
from accel._errors import AcceleratorError
from accel.random import philox
from conftest import THOROUGH, use_sim
from test_user_kernels import SAXPY_PTX

WORDS = 1024
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
CONFS = {"expandable": "", "classic": "expandable_segments:False", "async": "backend:cudaMallocAsync"}


def _host_waits() -> int:
    return sum(sim.calls(name) for name in HOST_WAITS)


class _Pipeline:
    """A registered generator, and a graph captured on stream ``a`` that draws WORDS words into
    ``out`` and then launches a kernel whose simulated reference logs the words it reads (the
    graph's launches are serialized: cudaGraphLaunch orders each launch after the previous ones
    of the executable graph, so the log order is the replay order)."""

    def __init__(self, seed=7, observe=True):
        self.log = []
        self.observe = observe     # False: no logging kernel (the graph keeps no module)
        if observe:
            sim.register_kernel("saxpy", self._observe, "f32, ptr, ptr, u64", replace=True)
            self.kernel = accel.Module(SAXPY_PTX).function("saxpy")
        self.a, self.b = accel.Stream(0), accel.Stream(0)
        self.gen = R.Generator(0, seed=seed)
        self.out = accel.Buffer(4 * WORDS, stream=self.a)
        self.busy = accel.Buffer(64, stream=self.a)
        R.random_raw_(self.out, generator=self.gen)      # the RNG kernels loaded before the capture
        accel.synchronize(0)
        self.graph = accel.Graph()
        with self.a:
            self.graph.register_generator_state(self.gen)
            self.graph.capture_begin()
            R.random_raw_(self.out, generator=self.gen)
            if observe:
                accel.launch(self.kernel, 1, 1, 0.0, self.out, self.out, WORDS)
            self.graph.capture_end()
        accel.synchronize(0)
        self.seed, self.offset = struct.unpack("<Qq", bytes(self.gen.get_state().tobytes()))

    def _observe(self, grid, block, view, a, x, y, n):
        self.log.append(bytes(view(x, 4 * n, np.uint8)))

    def want(self, i) -> bytes:
        return philox.raw_words(self.seed, self.offset + i * WORDS, WORDS).astype("<u4").tobytes()

    def replay_on(self, stream, backlog=0):
        for _ in range(backlog):
            self.busy.fill_(1, stream=stream)    # the stream busy: its replay's prologue queued behind
        with stream:
            self.graph.replay()

    def close(self):
        accel.synchronize(0)
        self.graph.reset()
        for obj in (self.out, self.busy, self.a, self.b):
            obj.close()
        if self.observe:
            sim.unregister_kernel("saxpy")


@pytest.mark.parametrize("conf", list(CONFS.values()), ids=list(CONFS))
def test_alternating_replays_queue_without_a_host_wait(monkeypatch, conf):
    use_sim(monkeypatch, "cuda", **({"ACCEL_ALLOC_CONF": conf} if conf else {}))
    p = _Pipeline()
    try:
        p.replay_on(p.a)                    # the holders' last use: stream a
        accel.synchronize(0)
        sim.reset_call_counts()
        events = sim.state().events
        for i in range(8):
            p.replay_on(p.b if i % 2 == 0 else p.a)
        assert _host_waits() == 0, {name: sim.calls(name) for name in HOST_WAITS}
        assert sim.calls("cudaStreamWaitEvent") >= 8       # each replay ordered on the device
        # an event made for a wait (the allocator had none cached) is destroyed once it is queued
        made = sim.calls("cudaEventCreateWithFlags") + sim.calls("cudaEventCreate")
        assert made and sim.calls("cudaEventDestroy") == made
        assert sim.state().events == events
        accel.synchronize(0)
        assert p.log == [p.want(i) for i in range(9)]     # (the capture ran no kernel)
    finally:
        p.close()


def _alternating_log(monkeypatch, streams: str, conf: str = "", delay_us: int = 2000) -> list:
    """Six replays, each on a freshly backlogged stream (``streams``: "ab" alternates, "a" all on
    a), with 2 ms per simulated device operation so that unordered work really races."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=delay_us, **({"ACCEL_ALLOC_CONF": conf} if conf else {}))
    p = _Pipeline(seed=11)
    try:
        for i in range(6):
            stream = p.a if streams == "a" or i % 2 == 0 else p.b
            p.replay_on(stream, backlog=3)
        accel.synchronize(0)
        return p.log, [p.want(i) for i in range(6)]
    finally:
        p.close()


@pytest.mark.parametrize("conf", list(CONFS.values()), ids=list(CONFS))
def test_alternating_replays_draw_each_their_own_offsets(monkeypatch, conf):
    two, want = _alternating_log(monkeypatch, "ab", conf)
    one, want_one = _alternating_log(monkeypatch, "a", conf)
    assert want == want_one
    assert one == want, "one stream (the reference) drew wrong numbers"
    assert len(set(two)) == 6, "two replays on two streams drew the same numbers"
    assert two == one


def test_the_log_catches_a_missing_order(monkeypatch):
    """Guard for the test above: with the ordering switched off, the backlogged first replay's
    prologue overwrites the holders after the second replay's, and both launches draw alike."""
    monkeypatch.setattr(R, "_after_last_use", lambda token, stream: None)
    # 20 ms per operation: the race must show even when a loaded machine slows the host (at 2 ms
    # the backlog sometimes drained first and the guard failed in a full -n auto run)
    two, want = _alternating_log(monkeypatch, "ab", delay_us=20000)
    assert two != want and len(set(two)) < 6


@pytest.mark.parametrize("conf", list(CONFS.values()), ids=list(CONFS))
def test_no_event_leaks_with_event_destroy_failing_every_time(monkeypatch, conf):
    from accel import _finalize
    use_sim(monkeypatch, "cuda", **({"ACCEL_ALLOC_CONF": conf} if conf else {}))
    p = _Pipeline()
    dropped = _Pipeline(seed=3)          # a second graph, dropped without a reset below
    memory.empty_cache()
    base = sim.state().events
    sim.inject_error("cudaEventDestroy", 1, times=-1)
    try:
        for i in range(6):
            p.replay_on(p.b if i % 2 == 0 else p.a)
            dropped.replay_on(dropped.b if i % 2 == 0 else dropped.a)
        accel.synchronize(0)
        assert p.log == [p.want(i) for i in range(6)] and dropped.log == [dropped.want(i) for i in range(6)]
        p.graph.reset()
        del dropped.graph               # collected: its finalizer releases the RNG token
        gc.collect()
        _finalize.drain()
        with pytest.raises(AcceleratorError, match="cudaEventDestroy"):
            memory.empty_cache()        # the events are the allocator's: reported, kept
    finally:
        sim.clear_faults()
    memory.empty_cache()                # and destroyed by the next call
    _finalize.drain()
    assert sim.state().events == base
    for obj in (p.out, p.busy, p.a, p.b, dropped.out, dropped.busy, dropped.a, dropped.b):
        obj.close()
    memory.empty_cache()
    assert sim.state().events == 0
    sim.unregister_kernel("saxpy")


def test_another_threads_global_capture_is_left_intact(monkeypatch):
    """The device-side order (an event record on the last stream, a wait on the replay stream,
    neither stream capturing) is legal beside a global-mode capture; a host wait was skipped
    there, and a synchronize would have invalidated it."""
    use_sim(monkeypatch, "cuda")
    p = _Pipeline()
    other = accel.Buffer(4096)
    started, go = threading.Event(), threading.Event()
    result = {}

    def capture():
        c = accel.Stream(0)
        g2 = accel.Graph(capture_error_mode="global")
        try:
            with c:
                g2.capture_begin()
                other.fill_(3, stream=c)
                started.set()
                go.wait(10)
                g2.capture_end()
            result["capture"] = None
        except Exception as exc:     # noqa: BLE001 (reported by the assert below)
            result["capture"] = exc
        finally:
            started.set()
            result["graph"], result["stream"] = g2, c

    t = threading.Thread(target=capture)
    t.start()
    try:
        assert started.wait(10)
        sim.reset_call_counts()
        for i in range(4):
            p.replay_on(p.b if i % 2 == 0 else p.a)
        assert _host_waits() == 0
        assert sim.calls("cudaStreamWaitEvent") >= 4
    finally:
        go.set()
        t.join(10)
    assert result["capture"] is None, f"the other thread's capture failed: {result['capture']}"
    accel.synchronize(0)
    assert p.log == [p.want(i) for i in range(4)]
    result["graph"].replay()
    accel.synchronize(0)
    assert (other.to_numpy(np.uint8) == 3).all()
    result["graph"].reset()
    result["stream"].close()
    other.close()
    p.close()


def test_a_closed_last_stream_is_still_waited_for_on_the_host(monkeypatch):
    """The fallback: the holders' last stream closed since (no event can be recorded on it), the
    replay synchronizes the device first, and draws the next offset."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=500)
    p = _Pipeline()
    c = accel.Stream(0)
    p.replay_on(c)                      # the holders' last use: stream c
    c.close()
    sim.reset_call_counts()
    p.replay_on(p.b)
    assert sim.calls("cudaDeviceSynchronize") == 1
    accel.synchronize(0)
    assert p.log == [p.want(0), p.want(1)]
    p.close()


def _sweep_interrupts(work, check, stride=2, every=()):
    """``work()`` with a KeyboardInterrupt at every ``stride``-th interrupt point (the injector of
    tests/test_interrupt_backends.py over accel's graph, RNG, stream, allocator and backend
    files), and at the first point of each file and backend function that stride missed and
    every point of the functions ``every`` (test_interrupt_allocator.sampled), each followed by
    ``check(n)``; returns the points counted."""
    import test_interrupt_allocator as tia
    import test_interrupt_graphs as tig
    from test_interrupt_backends import _Inject, interrupted
    targets = tig._targets()
    counter = _Inject(0, targets)
    with counter:
        work()
    for n in tia.sampled(counter.codes, stride, every=every):
        interrupted(n, targets, work)
        check(n)
    return counter.count


@pytest.mark.usefixtures("frozen_heap")
def test_a_ctrl_c_anywhere_in_alternating_replays_leaves_no_event(monkeypatch):
    """After each interrupted pair of alternating replays and the user's cleanup, empty_cache
    leaves the simulator the events it had; the next replays draw from the generator's offset."""
    from accel import _finalize
    use_sim(monkeypatch, "cuda")
    p = _Pipeline(observe=False)        # (a graph keeping a module: see the test below)
    p.replay_on(p.b)
    p.replay_on(p.a)
    accel.synchronize(0)
    memory.empty_cache()
    base = [sim.state().events]
    problems = []

    def work():
        p.replay_on(p.b)
        p.replay_on(p.a)

    def check(n):
        accel.synchronize(0)
        gc.collect()
        _finalize.drain()
        memory.empty_cache()
        if sim.state().events != base[0]:
            problems.append((n, "events", sim.state().events))
            base[0] = sim.state().events

    # every 6th point and each file and backend function by default (r74b; every 2nd before)
    assert _sweep_interrupts(work, check, stride=2 if THOROUGH else 6) > 20
    assert not problems, problems[:8]
    seed, offset = struct.unpack("<Qq", bytes(p.gen.get_state().tobytes()))
    p.replay_on(p.b)
    p.replay_on(p.a)
    want = philox.raw_words(seed, offset + WORDS, WORDS).astype("<u4").view(np.uint8)
    assert np.array_equal(p.out.to_numpy(stream=p.a), want)
    p.close()
    memory.empty_cache()
    assert sim.state().streams == 0 and sim.state().events == 0


@pytest.mark.usefixtures("frozen_heap")
def test_a_ctrl_c_in_a_replay_of_a_graph_with_a_kernel_leaves_no_module_lock_held(monkeypatch):
    use_sim(monkeypatch, "cuda")
    p = _Pipeline()
    module = [k for k in p.graph._h.events if not isinstance(k, accel.Event)][0]
    held = []

    def check(n):
        if module._lock.locked():
            held.append(n)
            module._lock.release()      # (so that the sweep goes on instead of hanging)

    try:
        _sweep_interrupts(lambda: p.replay_on(p.b), check, stride=1)
    finally:
        accel.synchronize(0)
        p.close()
    assert not held, f"the module's lock was left held at interrupt points {held[:8]}"


@pytest.mark.usefixtures("frozen_heap")
def test_a_ctrl_c_in_a_replay_leaves_no_stream_marked_in_use(monkeypatch):
    use_sim(monkeypatch, "cuda")
    p = _Pipeline(observe=False)
    marked = []

    def check(n):
        for s in (p.a, p.b):
            if s._busy:
                marked.append(n)
                s._busy.clear()

    try:
        # every 4th point by default (r74b; all before), and every point of the stream holds
        # (_Hold, _KeptInUse), where r66h found the window this test guards, and of replay
        _sweep_interrupts(lambda: (p.replay_on(p.b), p.replay_on(p.a)), check, stride=1 if THOROUGH else 4,
                          every={"_Hold.__enter__", "_Hold.__exit__", "_KeptInUse.__enter__",
                                 "_KeptInUse.__exit__", "Graph.replay"})
    finally:
        accel.synchronize(0)
        p.close()
    assert not marked, f"a stream was left marked in use at interrupt points {marked[:8]}"
