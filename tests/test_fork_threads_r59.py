"""os.fork() while another thread is in the middle of an accel call (r59c).

The fork happens at an exact point: a function on the call's path is patched to park the calling
thread on a threading.Event (:class:`Gate`), the test forks, and only then releases it in the
parent.  Points: inside the caching allocator's malloc/free/empty_cache/memory_snapshot with its
lock held, a finalizer drain and a Buffer/Stream/Event ``__del__`` (the lock held by the
finalizer's nowait path), a vendor call with signals deferred on the main thread while a worker
thread forks, a graph capture underway and a replay, the pinned allocator, Stream/Event
synchronize waiting on work in flight, lazy init itself (before and after the driver started),
an accel.random fill and a use_mem_pool route.

In the child: plain Python works, every device call raises the documented fork error, dropping
every inherited object (Buffers, Streams, Events, Graphs, MemPools, pinned arrays) and
gc.collect() call no vendor function, and nothing waits on a lock the parked thread held
(``run_forked`` fails on a hang).  A patched point reached in the child exits it with 97.  The
parent: the parked thread finishes, its result is right, and state goes back to the baseline.
A child forked before init may initialize and use accel (README "Lazy initialization and fork").

``run_forked`` ends its child with os._exit; the programs at the end fork children that leave
through normal interpreter shutdown (atexit, finalizers, module teardown).
"""

import gc
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import accel
from accel import _finalize, _lazy, sim
from conftest import SIMS, THOROUGH, not_refused_with, run_forked, use_sim, vendor_calls_made_by
from test_user_programs import _devices, allocated, live_objects, settle

HOLD_S = 30.0       # the longest a parked thread waits to be released (a test bug, never reached)
CHILD_S = 30.0      # run_forked's limit: a child past it hung
MiB = 1 << 20


def _message(kind: str) -> str:
    name = kind.upper()
    return (f"Cannot re-initialize {name} in forked subprocess. To use {name} with multiprocessing, "
            f"you must use the 'spawn' start method")


class Gate:
    """Parks the first call of the chosen thread at :meth:`pause` until :attr:`go` is set.  In a
    forked child, a pause exits it with 97 (it went down the parent's vendor path or lock),
    unless ``child_passes`` (the child may use accel: forked before init)."""

    def __init__(self, child_passes: bool = False):
        self.reached, self.go = threading.Event(), threading.Event()
        self.parent, self.thread, self.armed = os.getpid(), None, True
        self.child_passes = child_passes

    def pause(self, where: str) -> None:
        if os.getpid() != self.parent:
            if self.child_passes:
                return
            os.write(2, f"the child reached the parent's parked point: {where}\n".encode())
            os._exit(97)
        if not self.armed or threading.get_ident() != self.thread:
            return
        self.armed = False
        self.reached.set()
        if not self.go.wait(HOLD_S):
            raise RuntimeError(f"parked at {where} and never released")

    def before(self, fn, where: str):
        def parked(*args, **kwargs):
            self.pause(where)
            return fn(*args, **kwargs)
        return parked

    def after(self, fn, where: str):
        def parked(*args, **kwargs):
            result = fn(*args, **kwargs)
            self.pause(where)
            return result
        return parked


class GateLock:
    """A lock that parks its taker (the gate's thread) right after taking it: the thread is then
    inside the call with the lock held.  Stands in for an allocator's ``_lock``."""

    def __init__(self, lock, gate: Gate, where: str):
        self._real, self._gate, self._where = lock, gate, where

    def acquire(self, blocking=True, timeout=-1):
        got = self._real.acquire(blocking, timeout)
        if got:
            self._gate.pause(self._where)
        return got

    def release(self):
        self._real.release()

    def locked(self):
        return self._real.locked()

    def _is_owned(self):          # (the allocator's lock is an RLock: _gc_probe asks who holds it)
        return self._real._is_owned()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def _fork_child(child, from_thread: bool) -> int:
    if not from_thread:
        return run_forked(child, CHILD_S)
    out = {}

    def forker():
        try:
            out["code"] = run_forked(child, CHILD_S)
        except BaseException as exc:        # pytest.fail on a hung child
            out["exc"] = exc
    t = threading.Thread(target=forker, name="r59-forker")
    t.start()
    t.join(CHILD_S + 10)
    if "exc" in out:
        raise out["exc"]
    return out["code"]


def fork_during(gate: Gate, call, child, from_thread: bool = False, wait_for=None):
    """Run ``call`` in a new thread until it parks at ``gate``, fork (from the main thread, or from
    another thread), release, join.  ``wait_for()`` (optional) is polled until True before the
    fork.  Returns (child's exit code, {"value": ...} or {"exc": ...})."""
    out = {}

    def body():
        gate.thread = threading.get_ident()
        try:
            out["value"] = call()
        except BaseException as exc:
            out["exc"] = exc
    t = threading.Thread(target=body, name="r59-busy")
    t.start()
    try:
        assert gate.reached.wait(HOLD_S), "the busy thread never reached its parked point"
        if wait_for is not None:
            _until(wait_for)
        code = _fork_child(child, from_thread)
    finally:
        gate.go.set()
        t.join(HOLD_S)
    assert not t.is_alive(), "the busy thread hung after its release"
    return code, out


def _until(pred, what="a condition"):
    deadline = time.monotonic() + HOLD_S
    while not pred():
        assert time.monotonic() < deadline, f"never reached: {what}"
        time.sleep(0.002)


def _waiting_in_sim(thread_name: str) -> bool:
    """Whether the named thread is blocked in a simulator wait (a Condition wait under accel.sim)."""
    ident = next((t.ident for t in threading.enumerate() if t.name == thread_name), None)
    frame = sys._current_frames().get(ident)
    names = []
    while frame is not None:
        names.append((frame.f_code.co_name, frame.f_code.co_filename))
        frame = frame.f_back
    return bool(names) and names[0][0] == "wait" and any("accel/sim" in f for _, f in names)


# -- what the child checks -----------------------------------------------------------------------
def _inherited(kind: str) -> dict:
    """Objects of every kind the child inherits, on the last device (device 0 current)."""
    last = _devices()[-1]
    o = {"s": accel.Stream(last), "pinned": accel.empty_pinned(1024, np.float32)}
    o["pinned"][:] = 1.5
    o["b"] = accel.Buffer(4096, device=last, stream=o["s"]).fill_(2)
    o["e"] = o["s"].record_event()
    with accel.device_index(last):
        o["pool"] = accel.MemPool()
        with accel.use_mem_pool(o["pool"]):
            o["pooled"] = accel.Buffer(8192).fill_(5)
    if kind != "mps":
        o["g"], o["out"] = accel.Graph(), accel.Buffer(4096, device=last)
        with accel.graph(o["g"], stream=o["s"]):
            o["out"].copy_from(o["b"], non_blocking=True)
    o["s"].synchronize()
    return o


def _close_inherited(o: dict) -> None:
    assert (o["b"].to_numpy() == 2).all() and (o["pooled"].to_numpy() == 5).all()
    if "g" in o:
        o["g"].replay()
        assert (o["out"].to_numpy(stream=o["s"]) == 2).all()
        o["g"].reset()
    o.clear()
    settle()


def _child_checks(kind: str, o: dict, more=()) -> int:
    """The child's checks (see the module docstring); 0 when all hold, else 1 with stderr."""
    import json
    bad = []
    if json.loads(json.dumps({"k": [1, 2]})) != {"k": [1, 2]}:
        bad.append("json")
    box = []
    t = threading.Thread(target=box.append, args=(1,))
    t.start()
    t.join(10)
    if box != [1]:
        bad.append("a new thread did not run")
    if not (o["pinned"] == 1.5).all():
        bad.append("the inherited pinned array's contents")
    last = _devices_no_init()[-1]
    calls = [("Buffer", lambda: accel.Buffer(64, device=last)),
             ("Stream", lambda: accel.Stream(last)),
             ("Event.record", lambda: accel.Event().record()),
             ("current_stream", lambda: accel.current_stream(last)),
             ("empty_pinned", lambda: accel.empty_pinned(16)),
             ("MemPool", lambda: accel.MemPool()),
             ("get_memory_info", lambda: accel.memory.get_memory_info(last)),
             ("Buffer.fill_", lambda: o["b"].fill_(1)),
             ("Buffer.copy_from(pinned)", lambda: o["b"].copy_from(o["pinned"], non_blocking=True)),
             ("Stream.synchronize", lambda: o["s"].synchronize()),
             ("Event.query", lambda: o["e"].query()),
             ("use_mem_pool", lambda: accel.use_mem_pool(o["pool"]).__enter__()),
             ("random.uniform_", lambda: accel.random.uniform_(o["b"]))]
    if "g" in o:
        calls += [("Graph.replay", lambda: o["g"].replay()), ("new capture", lambda: accel.Graph().capture_begin())]
    calls += list(more)
    bad += not_refused_with(calls, _message(kind))
    del calls
    if accel.memory.memory_allocated(last) != 0 or accel.device_count() != len(_devices_no_init()):
        bad.append("queries")
    made = vendor_calls_made_by(lambda: (o.clear(), gc.collect(), _finalize.drain()))
    if made:
        bad.append(f"dropping the inherited objects called the vendor library: {made}")
    if bad:
        sys.stderr.write("\n".join(bad) + "\n")
        return 1
    return 0


def _devices_no_init():
    return list(range(accel.device_count()))


# -- the scenarios: each returns (call, check of its result, child's extra calls) ---------------
def _alloc(last):
    return accel.memory.device_allocator(last)


def sc_malloc(kind, gate, mp, last, o):
    mp.setattr(_alloc(last), "_lock", GateLock(_alloc(last)._lock, gate, "malloc"))
    return (lambda: accel.Buffer(3 * MiB + 5, device=last).fill_(7),
            lambda b: (b.to_numpy() == 7).all() and b.close() is None)


def sc_free(kind, gate, mp, last, o):
    b = accel.Buffer(3 * MiB, device=last).fill_(1)
    mp.setattr(_alloc(last), "_lock", GateLock(_alloc(last)._lock, gate, "free"))
    return b.close, lambda r: r is None


def sc_empty_cache(kind, gate, mp, last, o):
    accel.Buffer(5 * MiB, device=last).close()
    cached = accel.memory.memory_reserved(last)
    mp.setattr(_alloc(last), "_lock", GateLock(_alloc(last)._lock, gate, "empty_cache"))
    return accel.memory.empty_cache, lambda r: accel.memory.memory_reserved(last) <= cached - 4 * MiB


def sc_snapshot(kind, gate, mp, last, o):
    mp.setattr(_alloc(last), "_lock", GateLock(_alloc(last)._lock, gate, "snapshot"))
    return accel.memory.memory_snapshot, lambda snap: any(s["device"] == last for s in snap)


def sc_buffer_del(kind, gate, mp, last, o):
    box = [accel.Buffer(MiB, device=last).fill_(3)]
    mp.setattr(_alloc(last), "_lock", GateLock(_alloc(last)._lock, gate, "Buffer.__del__"))
    return box.clear, lambda r: not box


def sc_drain(kind, gate, mp, last, o):
    """A Buffer dropped in a cycle during a collection: its release waits in _finalize.pending;
    the thread's Stream() drains it and parks in the free with the allocator's lock held."""
    cyc = [accel.Buffer(MiB, device=last).fill_(3)]
    cyc.append(cyc)
    del cyc
    gc.collect()
    assert _finalize.pending, "the collection left no release pending"
    mp.setattr(_alloc(last), "_lock", GateLock(_alloc(last)._lock, gate, "drain"))
    return (lambda: accel.Stream(last)), lambda s: s.close() is None and not _finalize.pending


def sc_stream_del(kind, gate, mp, last, o):
    box = [accel.Stream(last)]
    accel.Buffer(4096, device=last, stream=box[0]).close()    # the allocator knows the stream
    mp.setattr(_alloc(last), "_lock", GateLock(_alloc(last)._lock, gate, "Stream.__del__"))
    return box.clear, lambda r: not box


def sc_event_del(kind, gate, mp, last, o):
    be = _lazy.lazy_init()
    box = [o["s"].record_event()]
    mp.setattr(be, "event_destroy", gate.before(be.event_destroy, "Event.__del__"))
    return box.clear, lambda r: not box


def sc_capture(kind, gate, mp, last, o):
    """The thread captures on its own stream and parks with the capture underway."""
    s, g, out = accel.Stream(last), accel.Graph(), accel.Buffer(4096, device=last)

    def call():
        with accel.device_index(last), s:
            g.capture_begin()
            out.copy_from(o["b"], non_blocking=True)
            out.fill_(9, stream=s)
            gate.pause("capture")
            g.capture_end()
        g.replay()
        s.synchronize()
        result = out.to_numpy(stream=s)
        g.reset()
        return result
    return call, lambda r: (r == 9).all()


def sc_replay(kind, gate, mp, last, o):
    be = _lazy.lazy_init()
    mp.setattr(be, "graph_launch", gate.before(be.graph_launch, "replay"))

    def call():
        o["g"].replay()
        return o["out"].to_numpy(stream=o["s"])
    return call, lambda r: (r == 2).all()


def sc_pinned(kind, gate, mp, last, o):
    host = accel.memory.host_allocator()
    mp.setattr(host, "_lock", GateLock(host._lock, gate, "pinned malloc"))

    def call():
        a = accel.empty_pinned(4096, np.uint8)
        a[:] = 4
        return int(a.sum())
    return call, lambda r: r == 4 * 4096


def sc_pinned_free(kind, gate, mp, last, o):
    host = accel.memory.host_allocator()
    box = [accel.empty_pinned(4096, np.uint8)]
    mp.setattr(host, "_lock", GateLock(host._lock, gate, "pinned free"))
    return box.clear, lambda r: not box


def sc_random(kind, gate, mp, last, o):
    from accel.random import _device
    mp.setattr(_device, "_fill_here", gate.before(_device._fill_here, "random fill"))
    b, ref = accel.Buffer(4096, device=last), accel.Buffer(4096, device=last)
    accel.random.uniform_(ref, generator=accel.random.Generator(last, seed=59))

    def call():
        return accel.random.uniform_(b, generator=accel.random.Generator(last, seed=59)).to_numpy()
    return call, lambda r: np.array_equal(r, ref.to_numpy())


def sc_mempool_route(kind, gate, mp, last, o):
    with accel.device_index(last):
        pool = accel.MemPool()

    def call():
        with accel.use_mem_pool(pool, device=last):
            b = accel.Buffer(8192, device=last).fill_(6)
            gate.pause("use_mem_pool")
        after = accel.Buffer(512, device=last)
        owned = {blk["address"] for seg in pool.snapshot() for blk in seg["blocks"]
                 if blk["state"] == "active_allocated"}
        ok = owned == {b.ptr} and (b.to_numpy() == 6).all() and pool.use_count() == 1
        b.close(), after.close()
        return ok
    return call, lambda ok: ok


SCENARIOS = {f.__name__[3:]: f for f in (sc_malloc, sc_free, sc_empty_cache, sc_snapshot, sc_buffer_del, sc_drain,
                                         sc_stream_del, sc_event_del, sc_capture, sc_replay, sc_pinned,
                                         sc_pinned_free, sc_random, sc_mempool_route)}
GRAPHS_ONLY = {"capture", "replay"}


def _baseline():
    settle()
    return live_objects(), allocated()


#: Forked from another thread (not the main one) too: a few points suffice.
FROM_THREAD = ("malloc", "drain", "pinned", "capture")
_CASES = [pytest.param(kind, name, from_thread, id=f"{kind}-{name}-{'fork-thread' if from_thread else 'fork-main'}")
          for kind in SIMS for name in sorted(SCENARIOS) for from_thread in (False, True)
          if not (kind == "mps" and name in GRAPHS_ONLY) and (not from_thread or name in FROM_THREAD)]


@pytest.mark.parametrize("kind, name, from_thread", _CASES)
def test_fork_while_a_thread_is_inside_a_call(monkeypatch, frozen_heap, kind, name, from_thread):
    """A thread parks at the scenario's point; the parent forks (from the main thread or a
    third one); the child's checks hold; the parked call's result is right; baseline again."""
    use_sim(monkeypatch, kind)
    last = _devices()[-1]
    if name == "random":
        accel.random.uniform_(accel.Buffer(64, device=last))    # Metal keeps the kernels it compiles
    base = _baseline()
    o = _inherited(kind)
    gate = Gate()
    with monkeypatch.context() as mp:
        call, check = SCENARIOS[name](kind, gate, mp, last, o)
        code, out = fork_during(gate, call, lambda: _child_checks(kind, o), from_thread=from_thread)
    assert "exc" not in out, repr(out.get("exc"))
    assert check(out["value"]), f"the parked call's result: {out['value']!r}"
    del out, call, check
    assert code == 0, f"the child's checks failed ({code}; stderr above)"
    _close_inherited(o)
    assert _baseline() == base


# -- (c) the main thread inside a vendor call with signals deferred, another thread forks --------
@pytest.mark.parametrize("kind", SIMS)
def test_fork_from_a_thread_while_main_is_in_a_deferred_vendor_call(monkeypatch, kind):
    """The main thread makes a Stream: Stream._create runs with signals deferred (backends/_signals)
    and the simulated call too (sim/core); it parks inside the simulator's queue creation, signals
    blocked.  A worker forks: in the child (whose main thread is the worker) signals are not
    blocked, a handler runs, every call raises the fork error, drops call nothing.  The parent's
    Stream is made and works, and its signal mask is restored (conftest checks)."""
    import signal
    from accel.backends import _signals
    from accel.sim import _engine
    use_sim(monkeypatch, kind)
    last = _devices()[-1]
    base = _baseline()
    o = _inherited(kind)
    gate = Gate()
    gate.thread = threading.get_ident()
    monkeypatch.setattr(_engine.Engine, "queue", gate.before(_engine.Engine.queue, "sim queue creation"))
    seen = {}

    def child():
        got = []
        old = signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
        signal.raise_signal(signal.SIGUSR1)
        signal.signal(signal.SIGUSR1, old)
        code = _child_checks(kind, o)
        if got != [1] or _signals.blocked():
            sys.stderr.write(f"signals in the child: handler ran {got}, SIGINT blocked {_signals.blocked()}\n")
            return 2
        return code

    def forker():
        try:
            gate.reached.wait(HOLD_S)
            seen["blocked"] = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
            seen["code"] = run_forked(child, CHILD_S)
        except BaseException as exc:
            seen["exc"] = exc
        finally:
            gate.go.set()
    t = threading.Thread(target=forker, name="r59-forker")
    t.start()
    s = accel.Stream(last)
    t.join(HOLD_S)
    assert "exc" not in seen, repr(seen.get("exc"))
    assert gate.reached.is_set(), "the main thread never reached the simulator's queue creation"
    assert seen["code"] == 0, "the child's checks (stderr above)"
    assert not _signals.blocked()
    b = accel.Buffer(4096, device=last, stream=s).fill_(8, stream=s)
    assert (b.to_numpy(stream=s) == 8).all()
    b.close(), s.close()
    _close_inherited(o)
    assert _baseline() == base


# -- (f) waiting in Stream/Event.synchronize with work in flight --------------------------------
@pytest.fixture
def parked_kernel():
    """Launch a kernel whose simulated body parks at a gate: the launching thread is inside the
    simulated vendor call (the op runs inline), work in flight on the stream."""
    from test_user_kernels import SAXPY_MSL, SAXPY_PTX, spirv_module
    gate = Gate()
    parent = os.getpid()

    def body(grid, block, view, a, x, y, n):
        if os.getpid() == parent:
            gate.pause("kernel body")
        view(y, 4 * n, np.float32)[:] = a * view(x, 4 * n, np.float32)
    sim.register_kernel("saxpy", body, "f32, ptr, ptr, u64", replace=True)

    def make(kind, dev):
        image = {"cuda": SAXPY_PTX, "mps": SAXPY_MSL, "xpu": spirv_module("saxpy")}[kind]
        return accel.Module(image, device=dev).function("saxpy", None if kind == "cuda" else "f32, ptr, ptr, u64")
    yield gate, make
    sim.unregister_kernel("saxpy")


def _sync_scenario(kind, last, gate, make):
    """Thread A launches the parked kernel on s; B waits in s.synchronize(); C records an event
    after it and waits in Event.synchronize().  Returns (run(fork), results)."""
    k = make(kind, last)
    s = accel.Stream(last)
    x = accel.Buffer(64, device=last, stream=s).copy_from(np.arange(16, dtype=np.float32))
    y = accel.Buffer(64, device=last, stream=s)
    s.synchronize()
    res = {}

    def waiter(name, fn):
        def run():
            try:
                res[name] = fn()
            except BaseException as exc:
                res[name] = exc
        return threading.Thread(target=run, name=name)
    ev = accel.Event()
    threads = [waiter("r59-sync", s.synchronize), waiter("r59-event", lambda: (ev.record(s), ev.synchronize()))]

    def launch():
        accel.launch(k, 1, 16, 2.0, x, y, 16, stream=s)
        return y.to_numpy(np.float32, stream=s)

    def start_waiters():
        for t in threads:
            t.start()
        return all(_waiting_in_sim(t.name) for t in threads)
    return launch, start_waiters, threads, res, (s, x, y, ev, k)


@pytest.mark.parametrize("kind", SIMS)
def test_fork_while_threads_wait_for_a_stream_and_an_event(monkeypatch, frozen_heap, parked_kernel, kind):
    gate, make = parked_kernel
    use_sim(monkeypatch, kind)
    last = _devices()[-1]
    base = _baseline()
    o = _inherited(kind)
    launch, start_waiters, threads, res, keep = _sync_scenario(kind, last, gate, make)
    started = []
    code, out = fork_during(gate, launch, lambda: _child_checks(kind, o),
                            wait_for=lambda: started or started.append(start_waiters()) or
                            all(_waiting_in_sim(t.name) for t in threads))
    for t in threads:
        t.join(HOLD_S)
    assert "exc" not in out, repr(out.get("exc"))
    assert (out["value"] == 2 * np.arange(16, dtype=np.float32)).all()
    assert res == {"r59-sync": None, "r59-event": (None, None)}, res
    assert code == 0, "the child's checks (stderr above)"
    del keep
    out = launch = start_waiters = threads = res = started = None     # (they hold the objects)
    _close_inherited(o)
    assert _baseline() == base


# -- (g) a thread inside lazy init when another forks -----------------------------------------
@pytest.mark.parametrize("driver_started", [False, True], ids=["before-driver", "after-driver"])
@pytest.mark.parametrize("kind", SIMS)
def test_fork_while_a_thread_initializes(monkeypatch, kind, driver_started):
    """A thread's first call parks inside lazy_init (holding its lock), before the backend's
    init() starts the driver or right after it did.  Before: the child may initialize and use the
    device as any child of an uninitialized parent.  After: the child is poisoned (the driver
    started in the parent), and gets the fork error at once instead of waiting for the lock."""
    use_sim(monkeypatch, kind)
    last = accel.device_count() - 1
    assert not _lazy.is_initialized()
    be = _lazy.backend()
    gate = Gate(child_passes=not driver_started)
    wrap = gate.after if driver_started else gate.before
    monkeypatch.setattr(be, "init", wrap(be.init, "backend init"))

    def child():
        if driver_started:
            try:
                accel.Buffer(64, device=last)
            except RuntimeError as exc:
                return 0 if str(exc) == _message(kind) else 3
            return 4
        b = accel.Buffer(64, device=last)
        b.copy_from(bytes(range(64)))
        ok = b.to_numpy().tobytes() == bytes(range(64)) and _lazy.is_initialized()
        return 0 if ok else 5

    code, out = fork_during(gate, lambda: accel.Buffer(4096, device=last).fill_(3), child)
    assert "exc" not in out, repr(out.get("exc"))
    assert (out["value"].to_numpy() == 3).all() and _lazy.is_initialized()
    assert code == 0, f"the child ({code}; stderr above)"
    out.clear()
    settle()
    assert allocated() == (0,) * len(_devices())


# -- normal interpreter shutdown in the child ------------------------------------------------
def _program(names, child_s: float) -> None:
    """Run in a fresh interpreter (ACCEL_SIM set): each scenario's child ends with SystemExit,
    so it leaves through normal interpreter shutdown (atexit, finalizers, module teardown) with
    every inherited object still alive, the parked thread's locks still held."""
    import atexit
    kind = accel.current_accelerator().type
    last = accel.device_count() - 1
    for name in names:
        o = _inherited(kind)
        gate, mp = Gate(), pytest.MonkeyPatch()
        if name == "sync":
            from test_user_kernels import SAXPY_MSL, SAXPY_PTX, spirv_module
            parent = os.getpid()

            def body(grid, block, view, a, x, y, n):
                if os.getpid() == parent:
                    gate.pause("kernel body")
            sim.register_kernel("saxpy", body, "f32, ptr, ptr, u64", replace=True)
            image = {"cuda": SAXPY_PTX, "mps": SAXPY_MSL, "xpu": spirv_module("saxpy")}[kind]
            k = accel.Module(image, device=last).function("saxpy", None if kind == "cuda" else "f32, ptr, ptr, u64")
            s, x = accel.Stream(last), accel.Buffer(64, device=last)
            call, check = (lambda: accel.launch(k, 1, 16, 2.0, x, x, 16, stream=s) or s.synchronize()), \
                (lambda r: r is None)
        else:
            call, check = SCENARIOS[name](kind, gate, mp, last, o)
        out = {}

        def run():
            gate.thread = threading.get_ident()
            try:
                out["value"] = call()
            except BaseException as exc:
                out["exc"] = exc
        t = threading.Thread(target=run, name="r59-busy")
        t.start()
        gate.reached.wait(HOLD_S)
        pid = os.fork()
        if pid == 0:
            atexit.register(os.write, 1, f"ATEXIT {name}\n".encode())
            raise SystemExit(_child_checks(kind, dict(o)))
        deadline = time.monotonic() + child_s
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                verdict = "OK" if os.waitstatus_to_exitcode(status) == 0 else f"EXIT{os.waitstatus_to_exitcode(status)}"
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                verdict = "HUNG"
                break
            time.sleep(0.01)
        gate.go.set()
        t.join(HOLD_S)
        mp.undo()
        good = not t.is_alive() and "exc" not in out and check(out.get("value"))
        out.clear()
        if name == "sync":
            sim.unregister_kernel("saxpy")
            s.synchronize()
            del s, x, k
        _close_inherited(o)
        print(f"{verdict if good else 'PARENT-' + verdict} {name}", flush=True)


def _run_program(kind: str, names, child_s: float, limit: float = 120.0):
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {here!r}); import test_fork_threads_r59 as T; "
            f"T._program({list(names)!r}, {child_s!r})")
    env = dict(os.environ, ACCEL_SIM=kind, ACCEL_SIM_DEVICES="2")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=limit, env=env)
    return proc


def _shutdown_names(kind):
    names = [n for n in sorted(SCENARIOS) if not (kind == "mps" and n in GRAPHS_ONLY)]
    if THOROUGH:
        return names
    # By default each scenario's child leaves through shutdown on one simulator, the simulators
    # taking the scenarios in turn (every scenario still run once, every simulator runs several).
    mine = []
    for i, n in enumerate(sorted(SCENARIOS)):
        able = [k for k in SIMS if not (k == "mps" and n in GRAPHS_ONLY)]
        if able[i % len(able)] == kind:
            mine.append(n)
    return mine


@pytest.mark.parametrize("kind", SIMS)
def test_children_leave_through_normal_interpreter_shutdown(kind):
    names = _shutdown_names(kind)
    proc = _run_program(kind, names, child_s=20.0)
    report = proc.stdout.split("\n")
    bad = [n for n in names if f"OK {n}" not in report or f"ATEXIT {n}" not in report]
    assert proc.returncode == 0 and not bad, (bad, proc.stdout, proc.stderr[-3000:])
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_child_forked_with_stream_work_in_flight_exits_normally(kind):
    """A thread's kernel is running on a stream (parked in its body, the simulated launch in
    flight) when the parent forks; the child must still leave through normal interpreter shutdown
    (the simulated device is the parent's: nothing of it is the child's to wait for).  Before r59's
    fix it printed its atexit line, then hung in the simulator's _drain_at_exit, waiting for the
    parent's engines: the program reported "HUNG sync"."""
    proc = _run_program(kind, ["sync"], child_s=8.0)
    assert proc.returncode == 0 and "OK sync" in proc.stdout.split("\n"), (proc.stdout, proc.stderr[-3000:])
    assert "ATEXIT sync" in proc.stdout.split("\n")
