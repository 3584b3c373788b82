"""r69h: accel under user hooks that run at arbitrary points (gc.callbacks, signal handlers,
threading.excepthook), interpreter shutdown, and fork from a thread other than the main one, on
the three simulators with two devices (Metal: one), device 1 used while device 0 is current.

Earlier rounds took a user's ``__del__`` run by a collection inside each of accel's critical
sections (test_gc_user_finalizers.py, test_concurrency_gc_r68i.py), handlers that *raise*
(KeyboardInterrupt: test_interrupt_*.py), fork from the main thread while another thread holds
a lock or is mid-call (test_fork_threads_r59.py, test_concurrency_gc_r68i.py, r68f's imports),
and exits with daemon threads copying or objects left alive (test_user_programs.py,
test_interpreter_exit.py).  This file adds:

1. **a user's ``gc.callbacks`` function that calls accel**, swept over every collection point of
   a workload on device 1 (``gc.set_threshold(1)``: a collection at nearly every allocation,
   inside the caching allocator and the backends), while a second thread uses the same device.
   accel tells a finalizer run inside its own lock by the marker its own ``gc.callbacks``
   entries set at "start" and clear at "stop" (accel/_locks.py).  A callback that runs at
   "start" after accel's entry works or raises AcceleratorError (the documented behaviour), the
   stats and the snapshot agree afterwards, nothing is printed by a finalizer.  A callback that
   acts at "stop" (accel's entry cleared the marker already), or one registered before ``import
   accel`` (it runs ahead of the marker), waits forever on a lock its own thread holds (strict
   xfail).  Points where the collection started inside a simulated vendor call or simulated
   device work are skipped: no Python runs inside a real runtime, and there the simulator can
   only refuse (or, for a wait on the very work it is running inline, time out after 60 s);
   1b. **a user's ``__del__`` that reads the memory stats** (``memory_allocated``,
   ``memory_snapshot``, ``empty_cache``, ``reset_peak_memory_stats``) run by a collection that
   starts just after device 1's malloc took the allocator's lock: it hangs, where allocating,
   freeing, ``get_memory_info`` and the pinned stats work or refuse (strict xfail);
2. **a signal handler that calls accel** (a SIGUSR1 "print memory stats" handler, a SIGTERM
   checkpoint that copies a buffer to the host), delivered at every line of accel's code that a
   workload on device 1 runs (a ``sys.settrace`` hook raises the signal; CPython runs the
   handler at the next bytecode boundary, as for a real signal).  Inside the caching allocator's
   critical section the handler waits forever for the lock its own thread holds (strict xfail);
3. **interpreter shutdown** with a daemon thread parked holding *each* of accel's, the backend's
   and the simulator's locks at once, and objects of every kind alive and in cycles: the process
   exits 0, quickly, with nothing on stderr; and shutdown with daemon threads still issuing work
   on both devices (fills, pinned copies, Philox fills), one blocked in ``synchronize`` on a long
   queue, one with a ``thread_local`` or ``relaxed`` capture underway and never ended, a
   ``sys.exit`` from a non-main thread, and a user's ``atexit`` function that synchronizes;
4. **fork from a worker thread while the main thread holds a lock**: before init (the lazy-init,
   selection, counting, settings and RNG locks a parent that only counted and seeded can hold)
   the child initializes and uses device 1 (streams, events, Philox with the parent's queued
   seed, a captured graph); after init (allocator, pinned allocator, capture gate, stream table,
   default generator and backend locks) the child's device calls and closes raise the
   documented fork error, nothing hangs (``streams._close_lock`` and the capture gate, which
   only an initialized parent can hold, are left out of the first list: they are plain locks
   with no at-fork renewal, so a child that could still initialize would hang on them);
5. **threading.excepthook that calls accel** for a thread that died inside ``with stream``
   / ``device_index``, inside a graph capture (each capture mode), of an OutOfMemoryError and of
   an accel RuntimeError: the hook sees device 0 current, the default stream, no capture, and can
   synchronize, allocate, summarize and capture a graph on device 1; nothing leaks.

Not covered: a pending host callback (accel has no host-function launch), and a device reset
(accel has no public one; ``_lazy._reset_for_tests`` is for tests).

Every risky part runs in a fresh interpreter with a watchdog (run_program, faulthandler) or a
forked child with a deadline, so a hang fails the test instead of hanging the run.
"""

import gc
import threading

import pytest

import accel
from conftest import SIMS, THOROUGH, use_sim
from test_user_programs import run_program

#: a call still running after this is hung (every point of the sweeps takes milliseconds)
HANG_S = 2.0
PROGRAM_S = 45.0
JOIN_S = 20.0
#: Points of the sweeps (collections of the gc sweeps, accel lines of the signal sweep).  The
#: default strides over a third of THOROUGH's points: still spread over every part of the workload
#: (allocator, copies, streams, events, graph replay), each point a fresh run of it.
GC_POINTS = 60 if THOROUGH else 20
SIGNAL_POINTS = 150 if THOROUGH else 50


def _run(kind: str, monkeypatch, source: str, timeout: float = PROGRAM_S, **env):
    use_sim(monkeypatch, kind, ACCEL_SIM_DEVICES=2, OPENBLAS_NUM_THREADS=1, **env)
    return run_program(source, timeout=timeout)


def _ok(proc) -> str:
    tail = f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0 and "\nOK" in "\n" + proc.stdout, tail
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, tail
    return proc.stdout


# =============================================================================================
# The workload the sweeps interrupt, and the checks after them (shared program text)
# =============================================================================================
_COMMON = r'''
import faulthandler, gc, os, sys, threading, time
import numpy as np
import accel
from accel import _locks
_locks.GC_WAIT_S = 0.02         # accel's bounded wait for a finalizer: give up quickly
KIND = accel.current_accelerator().type
DEV = accel.device_count() - 1  # device 1 (Metal: 0), never made current
accel.set_device_index(0)
KiB = 1024
HOST = np.arange(16 * KiB, dtype=np.uint8)
SIDE = accel.Stream(DEV)
GRAPH = None
if KIND != "mps":
    GOUT = accel.Buffer(4 * KiB, device=DEV)
    GRAPH = accel.Graph()
    with SIDE, GRAPH:
        GOUT.fill_(5)
UNRAISABLE = []
sys.unraisablehook = lambda u: UNRAISABLE.append(f"{u.exc_type.__name__}: {u.exc_value} in {u.object!r}")
BASE = accel.memory.memory_allocated(DEV)


def work():
    """Allocator, copies, a side stream, events, a stream made and dropped, a graph replay."""
    b = accel.Buffer(16 * KiB, device=DEV)
    b.fill_(3)
    b.copy_from(HOST, non_blocking=True)
    with SIDE:
        c = accel.Buffer(4 * KiB)
        c.fill_(1)
        ev = SIDE.record_event()
        if GRAPH is not None:
            GRAPH.replay()
    s = accel.Stream(DEV)
    s.wait_event(ev)
    s.record_event().synchronize()
    assert (b.to_numpy() == HOST).all()
    assert (c.to_numpy() == 1).all()
    del b, c, s
    accel.synchronize(DEV)


def user_calls():
    """What a user's hook does: read the stats (STATS), a small checkpoint copy, an event."""
    if STATS:
        accel.memory.memory_allocated(DEV)
    x = accel.Buffer(4 * KiB, device=DEV)
    x.fill_(7)
    assert (x.to_numpy() == 7).all()
    accel.Event().record(accel.current_stream(DEV))
    x.close()


def outcome(tally, fn):
    try:
        fn()
        key = "ok"
    except accel.AcceleratorError:      # the documented refusal (a subclass of RuntimeError)
        key = "AcceleratorError"
    except BaseException as exc:
        key = f"WRONG {type(exc).__name__}: {exc}"[:200]
    tally[key] = tally.get(key, 0) + 1


def final_checks(tally):
    gc.set_threshold(700, 10, 10)
    gc.collect()
    accel.synchronize(DEV)
    work()                              # still works
    accel.memory.empty_cache()
    assert not [k for k in tally if k.startswith("WRONG")], tally
    assert UNRAISABLE == [], UNRAISABLE[:5]
    assert accel.memory.memory_allocated(DEV) == BASE, (accel.memory.memory_allocated(DEV), BASE)
    stats = accel.memory.memory_stats(DEV)
    snap = accel.memory.memory_snapshot()
    segs = [s for s in (snap["segments"] if isinstance(snap, dict) else snap) if s["device"] == DEV]
    assert sum(s["allocated_size"] for s in segs) == stats["allocated_bytes.all.current"], stats
    assert sum(s["total_size"] for s in segs) == stats["reserved_bytes.all.current"], stats
    assert stats["allocation.all.current"] == sum(
        1 for s in segs for b in s["blocks"] if b["state"] == "active_allocated"), stats
'''


# =============================================================================================
# 1. gc.callbacks functions that call accel
# =============================================================================================
_GC_SWEEP = r'''
import gc, os, sys, threading
WORKER = {"thread": None}
STATE = {"count": 0, "fire": -1, "tally": {}}


def inside_simulator() -> bool:
    """Whether the collection started inside a simulated vendor call or simulated device work:
    a real runtime is C code where no Python runs, so such a point has no hardware counterpart
    (the simulator's own bounded waits answer there); the sweep skips it."""
    sim = os.path.join(os.path.dirname(sys.modules["accel"].__file__), "sim") + os.sep
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(sim) or name == "<accel.sim call wrapper>":
            return True
        f = f.f_back
    return False


def user_gc_callback(phase, info):
    """A user's hook (memory logging after collections): calls accel at collection number
    STATE['fire'] of the workload's thread, at PHASE."""
    if phase != PHASE or threading.get_ident() != WORKER["thread"]:
        return
    STATE["count"] += 1
    if STATE["count"] == STATE["fire"]:
        if inside_simulator():
            STATE["tally"]["skipped: inside the simulator"] = STATE["tally"].get("skipped: inside the simulator", 0) + 1
        else:
            outcome(STATE["tally"], user_calls)


if BEFORE_IMPORT:                   # a profiler registered before accel was imported
    gc.callbacks.insert(0, user_gc_callback)
''' + _COMMON + r'''
if not BEFORE_IMPORT:
    gc.callbacks.append(user_gc_callback)

stop = threading.Event()
neighbour_errors = []


def neighbour():
    """Another thread using the same device all along (its collections call nothing)."""
    s = accel.Stream(DEV)
    try:
        while not stop.is_set():
            with s:
                y = accel.Buffer(8 * KiB)
                y.fill_(2)
                e = s.record_event()
            e.synchronize()
            assert (y.to_numpy() == 2).all()
            del y
    except BaseException as exc:
        neighbour_errors.append(f"{type(exc).__name__}: {exc}")


def run(fire):
    STATE.update(count=0, fire=fire)
    err = []

    def body():
        WORKER["thread"] = threading.get_ident()
        gc.set_threshold(1, 10 ** 6, 10 ** 6)       # a young collection at nearly every allocation
        try:
            work()
        except BaseException as exc:
            err.append(f"{type(exc).__name__}: {exc}")
        finally:
            gc.set_threshold(700, 10, 10)
    t = threading.Thread(target=body, daemon=True, name="r69h-work")
    t.start()
    t.join(HANG_S)
    if t.is_alive():
        print(f"HUNG at collection {fire} of {TOTAL}", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)
    assert not err, f"the workload failed at collection {fire}: {err}"
    return STATE["count"]


gc.freeze()
TOTAL = -1
run(-1)
TOTAL = run(-1)
n = threading.Thread(target=neighbour, daemon=True, name="r69h-neighbour")
n.start()
stride = max(1, TOTAL // GC_POINTS)
for k in range(1, TOTAL + 1, stride):
    run(k)
stop.set()
n.join(HANG_S * 5)
assert not n.is_alive(), "the neighbour thread hung"
assert not neighbour_errors, neighbour_errors
gc.unfreeze()
final_checks(STATE["tally"])
print("OK", TOTAL, sorted(STATE["tally"].items()))
'''


def _gc_sweep(phase: str, before_import: bool) -> str:
    # (no stats read: a finalizer's memory_allocated inside the allocator's lock is the next
    # section's bug; these sweeps check the marker alone)
    return (f"PHASE = {phase!r}\nBEFORE_IMPORT = {before_import!r}\nHANG_S = {HANG_S!r}\nSTATS = False\n"
            f"GC_POINTS = {GC_POINTS!r}\n" + _GC_SWEEP)


@pytest.mark.parametrize("kind", SIMS)
def test_gc_callback_at_collection_start_calling_accel_works_or_refuses(monkeypatch, kind):
    """A user's gc.callbacks function registered after ``import accel`` calls accel (stats, a
    checkpoint copy, an event) as a collection starts, at every collection point of a workload
    on device 1, while another thread uses device 1: each call works or raises
    AcceleratorError, never hangs; the workload's results are right, nothing is printed by a
    finalizer, and afterwards the allocator's stats agree with its snapshot and come back to
    the baseline."""
    out = _ok(_run(kind, monkeypatch, _gc_sweep("start", False)))
    assert "'ok'" in out, out         # some points are outside every lock: the call just works



@pytest.mark.xfail(strict=False, reason=(
    "r69h, left open in session 29: a user's gc callback appended after accel's acts at 'stop' after "
    "accel's marker is cleared; re-entry by the lock's own holder is refused now (RLocks), and a thread "
    "holding the capture gate (Metal: the backend lock) waits for an allocator's lock a bounded time, but "
    "an ABBA through another lock (an XPU stream or event lock) still hangs now and then"))
@pytest.mark.parametrize("kind", SIMS)
def test_gc_callback_after_a_collection_calling_accel_never_hangs(monkeypatch, kind):
    """The same hook acting at "stop" (after the collection, as a memory logger reading
    ``memory_allocated`` after each collection would): the collection started inside accel's
    critical section, so the hook's call must work or raise AcceleratorError, as at "start".
    It waits forever on a lock its own thread holds (seen: the device allocator's lock inside a
    free, the XPU stream lock inside a fill, ``streams._create_lock`` inside an Event's first
    record), or on Metal re-enters the backend's RLock halfway through encoding a command
    buffer (the outer fill then fails with the simulator's 'command buffer ... is already
    committed')."""
    _ok(_run(kind, monkeypatch, _gc_sweep("stop", False)))


# (r69h found; fixed in session 29: allocator and accel._locks locks are RLocks that refuse re-entry by their holder, and a thread holding the capture gate waits for an allocator's lock a bounded time)
def test_gc_callback_registered_before_import_calling_accel_never_hangs(monkeypatch):
    """A callback registered before ``import accel`` (a profiler installed first) runs ahead of
    accel's own at "start": the collection is not marked yet, so the same calls hang (CUDA)."""
    _ok(_run("cuda", monkeypatch, _gc_sweep("start", True)))


# =============================================================================================
# 1b. a user's __del__ reading the memory stats during a collection inside the allocator
# =============================================================================================
class _UserCycle:
    """A user's object in a reference cycle whose ``__del__`` calls ``api`` (a logger that
    reads the memory stats when its session object goes, a cleanup that empties the cache)."""

    def __init__(self, api, out: list):
        self.me, self.api, self.out = self, api, out

    def __del__(self):
        try:
            self.api()
            self.out.append("ok")
        except accel.AcceleratorError:
            self.out.append("refused")
        except BaseException as exc:        # noqa: B902 (reported by the caller)
            self.out.append(f"WRONG {type(exc).__name__}: {exc}")


class _CollectingLock:
    """Stands for the device allocator's lock: the first ``with`` takes the real lock, then a
    collection starts (as at any allocation inside the critical section) with a user's cycle
    pending.  ``acquire``/``release``/``locked`` pass through (the allocator's other paths)."""

    def __init__(self, real, api, out: list):
        self.real, self.api, self.out, self.armed = real, api, out, True

    def acquire(self, *args, **kwargs):
        return self.real.acquire(*args, **kwargs)

    def release(self):
        self.real.release()

    def locked(self):
        return self.real.locked()

    def _is_owned(self):          # (the allocator's lock is an RLock: _gc_probe asks who holds it)
        return self.real._is_owned()

    def __enter__(self):
        self.real.acquire()
        if self.armed:
            self.armed = False
            _UserCycle(self.api, self.out)
            gc.collect()
        return True

    def __exit__(self, *exc):
        self.real.release()


def _finalizer_inside_malloc(kind: str, api_name: str) -> int:
    """In a forked child (fresh runtime): device 1's Buffer allocation takes the allocator's
    lock, a collection runs a user's ``__del__`` calling ``api_name``: 0 if it worked or raised
    AcceleratorError, 9 if it hung, 5 for another error."""
    from accel import _locks
    from conftest import run_forked

    def child() -> int:
        _locks.GC_WAIT_S = 0.05
        dev = accel.device_count() - 1
        accel.set_device_index(0)
        keep = [accel.Buffer(4096, device=dev), accel.Buffer(4096, device=dev)]
        apis = {"memory_allocated": lambda: accel.memory.memory_allocated(dev),
                "memory_snapshot": accel.memory.memory_snapshot,
                "empty_cache": accel.memory.empty_cache,
                "reset_peak_memory_stats": lambda: accel.memory.reset_peak_memory_stats(dev),
                "Buffer": lambda: accel.Buffer(512, device=dev).close(),
                "close": lambda: keep.pop().close(),
                "get_memory_info": lambda: accel.memory.get_memory_info(dev),
                "host_memory_stats": accel.memory.host_memory_stats}
        out: list = []
        alloc = accel.memory.device_allocator(dev)
        alloc._lock = _CollectingLock(alloc._lock, apis[api_name], out)
        t = threading.Thread(target=lambda: accel.Buffer(4096, device=dev), daemon=True)
        t.start()
        t.join(0.5)
        if t.is_alive():
            return 9
        return 0 if out and not out[0].startswith("WRONG") else 5
    return run_forked(child, 20)


@pytest.mark.parametrize("kind", SIMS)
def test_user_del_inside_malloc_may_allocate_free_and_query_info(monkeypatch, kind):
    """The paths that check for a collection on this thread (``_gc_probe``): a user's
    ``__del__`` run by a collection inside device 1's malloc may allocate, close a buffer,
    read ``get_memory_info`` and the pinned stats (each works or raises AcceleratorError)."""
    use_sim(monkeypatch, kind)
    codes = {name: _finalizer_inside_malloc(kind, name)
             for name in ("Buffer", "close", "get_memory_info", "host_memory_stats")}
    assert set(codes.values()) == {0}, codes


# (r69h found; fixed in session 29: allocator and accel._locks locks are RLocks that refuse re-entry by their holder, and a thread holding the capture gate waits for an allocator's lock a bounded time)
@pytest.mark.parametrize("kind", SIMS)
def test_user_del_inside_malloc_may_read_stats_and_empty_the_cache(monkeypatch, kind):
    """The same ``__del__`` reading ``memory_allocated(1)``, taking ``memory_snapshot()``,
    calling ``empty_cache()`` or ``reset_peak_memory_stats(1)`` (what a memory logger or a
    cleanup does) must work or raise AcceleratorError as the allocation does; today each hangs
    (the pinned allocator's stats have the check, the device allocator's do not)."""
    use_sim(monkeypatch, kind)
    codes = {name: _finalizer_inside_malloc(kind, name)
             for name in ("memory_allocated", "memory_snapshot", "empty_cache", "reset_peak_memory_stats")}
    assert set(codes.values()) == {0}, codes


# =============================================================================================
# 2. signal handlers that call accel
# =============================================================================================
_SIGNAL_SWEEP = _COMMON + r'''
import signal
ACCEL_DIR = os.path.dirname(accel.__file__)
STATE = {"n": 0, "at": -1, "tally": {}}


def handler(signum, frame):
    """A SIGUSR1 'print memory stats' / SIGTERM 'checkpoint' handler of a training job."""
    outcome(STATE["tally"], user_calls)


signal.signal(signal.SIGUSR1, handler)


def tracer(frame, event, arg):
    return line if frame.f_code.co_filename.startswith(ACCEL_DIR) else None


def line(frame, event, arg):
    if event == "line":
        STATE["n"] += 1
        if STATE["n"] == STATE["at"]:
            signal.raise_signal(signal.SIGUSR1)     # the handler runs at the next bytecode boundary
    return line


def run(at):
    STATE.update(n=0, at=at)
    faulthandler.dump_traceback_later(HANG_S, exit=True)    # a hung handler: stacks, exit 1
    sys.settrace(tracer)
    try:
        work()
    finally:
        sys.settrace(None)
        faulthandler.cancel_dump_traceback_later()
    return STATE["n"]


run(-1)
TOTAL = run(-1)
stride = max(1, TOTAL // SIGNAL_POINTS)
for k in range(1 + TOTAL % 7, TOTAL + 1, stride):
    run(k)
final_checks(STATE["tally"])
print("OK", TOTAL, sorted(STATE["tally"].items()))
'''


# (r69h found; fixed in session 29: allocator and accel._locks locks are RLocks that refuse re-entry by their holder, and a thread holding the capture gate waits for an allocator's lock a bounded time)
@pytest.mark.parametrize("kind", SIMS)
def test_signal_handler_calling_accel_anywhere_never_hangs(monkeypatch, kind):
    """A handler reading ``memory_allocated(1)`` and copying a small buffer of device 1 to the
    host, delivered at every line of accel's code a workload on device 1 runs (stride: about
    50 points, 150 with ACCEL_TEST_THOROUGH): each handler call works or raises AcceleratorError, never hangs; the workload
    and the stats stay right.  Today the first point inside ``DeviceCachingAllocator.malloc``'s
    ``with self._lock:`` hangs: the handler's ``memory_stats`` (``stats``) or ``Buffer``
    (``malloc``) waits for the lock the interrupted frame holds."""
    _ok(_run(kind, monkeypatch, f"HANG_S = {HANG_S!r}\nSTATS = True\nSIGNAL_POINTS = {SIGNAL_POINTS!r}\n"
             + _SIGNAL_SWEEP))


# =============================================================================================
# 3. interpreter shutdown
# =============================================================================================
_EXIT_LOCKS_HELD = r'''
import threading
import numpy as np
import accel
from accel import _lazy, graphs, memory
import accel.streams as S
kind = accel.current_accelerator().type
dev = accel.device_count() - 1
accel.set_device_index(0)
s = accel.Stream(dev)
b = accel.Buffer(64 << 10, device=dev, stream=s).fill_(1)
e = s.record_event()
pinned = accel.empty_pinned(1 << 14, np.float32)
b.copy_to(pinned.view(np.uint8), non_blocking=True)
gen = accel.random.default_generator(dev)
accel.random.uniform_(b, generator=gen)
be = _lazy.lazy_init()
table = {"device allocator": memory.device_allocator(dev)._lock, "host allocator": memory.host_allocator()._lock,
         "memory._lock": memory._lock, "memory._settings_lock": memory._settings_lock,
         "streams._defaults_lock": S._defaults_lock, "streams._foreign_lock": S._foreign_lock,
         "streams._close_lock": S._close_lock, "streams._create_lock": S._create_lock,
         "default generator": gen._lock, "random._lock": accel.random._lock,
         "graphs._pool_lock": graphs._pool_lock, "_lazy._lock": _lazy._lock}
for name in ("_lock", "_count_lock", "capture_gate", "_deferring_lock", "_choice_lock"):
    if hasattr(be, name):
        table["backend." + name] = getattr(be, name)
keep = [s, b, e, pinned]
if kind != "mps":
    g, out = accel.Graph(), accel.Buffer(4096, device=dev)
    with accel.device_index(dev):
        with accel.graph(g):
            out.fill_(4)
    g.replay()
    table["graph launch"] = g._launch_lock
    keep += [g, out]
if kind == "cuda":
    from accel.sim.cudart import state
    rt = state.runtime()
    table.update({"sim engine": rt.lock, "sim memory": rt.mlock, "sim captures": rt.clock})
if kind == "xpu":
    table["XPU stream"] = be._streams[s.handle].lock


class Cycle:
    def __init__(self, *objs):
        self.objs, self.me = objs, self


Cycle(accel.Buffer(4096, device=dev), accel.Stream(dev), accel.Event(), accel.empty_pinned(64),
      accel.Buffer(4096, device=0))
s.synchronize()
held = []
for name, lock in table.items():
    if not hasattr(lock, "acquire"):
        continue                    # (Metal has no capture gate)
    got = threading.Event()

    def hold(lock=lock, got=got):
        lock.acquire()
        got.set()
        threading.Event().wait()    # parked for good, the lock held, when the interpreter exits
    threading.Thread(target=hold, daemon=True, name="r69h-holds " + name).start()
    assert got.wait(10), name
    held.append(name)
print("OK", len(held), flush=True)
'''

_EXIT_WITH_WORK = r'''
import atexit, sys, threading
import numpy as np
import accel
kind = accel.current_accelerator().type
dev = accel.device_count() - 1
accel.set_device_index(0)
ready = threading.Barrier(4)
captured = threading.Event()


def issuer(d):
    """A prefetch loop that never ends: fills, pinned downloads, Philox fills, events."""
    s = accel.Stream(d)
    pin = accel.empty_pinned(1 << 14, np.uint8)
    i = 0
    while True:
        with s:
            x = accel.Buffer(1 << 14)
            x.fill_(i & 0xFF)
            x.copy_to(pin, non_blocking=True)
            accel.random.uniform_(x)
            ev = s.record_event()
        i += 1
        if i == 3:
            ready.wait(10)
        if i % 4 == 0:
            ev.synchronize()


def waiter():
    """Blocked in synchronize on a long queue of delayed work when the interpreter exits."""
    s = accel.Stream(dev)
    big = accel.Buffer(1 << 16, device=dev)
    with s:
        for _ in range(200):
            big.fill_(1)
    ready.wait(10)
    s.synchronize()
    threading.Event().wait()


def capturer():
    """Begins a capture on device 1 and never ends it."""
    s = accel.Stream(dev)
    out = accel.Buffer(4096, device=dev)
    g = accel.Graph(capture_error_mode=MODE)
    with accel.device_index(dev):
        with s:
            g.capture_begin()
            out.fill_(1)
            captured.set()
            threading.Event().wait()


def quitter():
    accel.Buffer(1024, device=dev).fill_(3)
    sys.exit(3)                     # a thread's sys.exit ends that thread only


devices = list(range(accel.device_count())) if accel.device_count() > 1 else [0, 0]
for d in devices:
    threading.Thread(target=issuer, args=(d,), daemon=True).start()
threading.Thread(target=waiter, daemon=True).start()
q = threading.Thread(target=quitter)
q.start()
q.join(10)
ready.wait(10)
keep_s = accel.Stream(dev)
accel.set_stream(keep_s)            # the main thread's current stream is device 1's side stream
keep_b = accel.Buffer(1 << 16)
keep_p = accel.empty_pinned(1 << 14, np.float32)
keep_b.copy_to(keep_p.view(np.uint8)[: 1 << 16], non_blocking=True)
keep_e = keep_s.record_event()
if kind != "mps":
    # thread_local, not the default global: a global capture forbids the issuers' synchronize
    # in other threads (cudaStreamBeginCapture: "if any other thread has a concurrent capture
    # sequence initiated with cudaStreamCaptureModeGlobal, this thread is prohibited from
    # potentially unsafe API calls"), and their refusal invalidates this capture.
    keep_g = accel.Graph(capture_error_mode="thread_local")
    with accel.Stream(dev), keep_g:
        keep_b.fill_(1)
    keep_g.replay()
    threading.Thread(target=capturer, daemon=True).start()
    assert captured.wait(10)


def at_exit():
    keep_e.synchronize()
    print("atexit", accel.memory.memory_allocated(dev) > 0, flush=True)


atexit.register(at_exit)
print("OK", flush=True)
'''


@pytest.mark.parametrize("kind", SIMS)
def test_exit_while_daemon_threads_hold_every_lock(monkeypatch, kind):
    """Daemon threads parked holding every lock of accel's modules, the allocators (device and
    pinned), the default generator, the backend (capture gate included), a graph's launch lock
    and the simulator's, when the main program returns with streams, events, buffers, a graph
    and pinned arrays alive and a cycle of them garbage: the process exits 0 at once and prints
    nothing (no finalizer or atexit function waits for a lock that a frozen daemon holds)."""
    proc = _run(kind, monkeypatch, _EXIT_LOCKS_HELD, timeout=30)
    out = _ok(proc)
    assert proc.stderr == "", proc.stderr[-3000:]
    assert int(out.split()[-1]) >= 12, out


@pytest.mark.parametrize("kind, mode", [(k, m) for k in SIMS for m in (("thread_local", "relaxed")
                                                                        if k != "mps" else ("none",))])
def test_exit_with_daemon_work_a_capture_underway_and_a_thread_sys_exit(monkeypatch, kind, mode):
    """Daemon threads still issuing work on every device (under a per-operation delay), one
    blocked in synchronize, one holding a capture of device 1 underway (never ended), a
    non-main thread that called sys.exit(3), the main thread's current stream on device 1 and a
    user's atexit function that synchronizes: exit status 0 (not 3), the atexit line printed,
    nothing on stderr, no hang."""
    proc = _run(kind, monkeypatch, f"MODE = {mode!r}\n" + _EXIT_WITH_WORK, timeout=30,
                ACCEL_SIM_DELAY_US=2000)
    _ok(proc)
    assert proc.stdout.split("\n")[-2:] == ["atexit True", ""], proc.stdout
    assert proc.stderr == "", proc.stderr[-3000:]


# =============================================================================================
# 4. fork from a worker thread while the main thread holds a lock
# =============================================================================================
_FORK_FROM_WORKER = r'''
import gc, os, signal, sys, threading, time
import accel
from accel import _lazy, backends, graphs, memory
import accel.streams as S
from accel.memory import _mempool
kind = accel.current_accelerator().type
dev = accel.device_count() - 1
accel.random.manual_seed_all(69)        # queued: nothing initialized yet
assert not accel.is_initialized()
inherited = {}


def child_before_init():
    """The parent only counted and seeded: the child initializes and uses device 1."""
    accel.set_device_index(0)
    b = accel.Buffer(1 << 12, device=dev)
    s = accel.Stream(dev)
    assert accel.random.initial_seed(dev) == 69
    with s:
        b.fill_(5)
        accel.random.uniform_(b)
    s.record_event().synchronize()
    if kind != "mps":
        g = accel.Graph()
        with s, g:
            b.fill_(6)
        g.replay()
        accel.synchronize(dev)
        assert (b.to_numpy() == 6).all()
    p = accel.empty_pinned(64)
    assert accel.memory.memory_allocated(dev) > 0
    del b, s, p
    gc.collect()


def child_after_init():
    """The parent initialized: every device call and close raises the fork error."""
    for what, fn in [("Buffer", lambda: accel.Buffer(64, device=dev)),
                     ("fill_", lambda: inherited["b"].fill_(2)), ("Stream", lambda: accel.Stream(dev)),
                     ("synchronize", lambda: inherited["s"].synchronize()),
                     ("empty_pinned", lambda: accel.empty_pinned(8)),
                     ("Event.record", lambda: accel.Event().record()),
                     ("Stream.close", lambda: inherited["s"].close()),
                     ("Event.close", lambda: inherited["e"].close()),
                     ("Buffer.close", lambda: inherited["b"].close())]:
        try:
            fn()
        except RuntimeError as exc:
            assert "forked subprocess" in str(exc), (what, str(exc))
        else:
            assert what.endswith(".close"), f"{what}: no error"
    assert accel.device_count() == dev + 1 and accel.memory.memory_allocated(dev) == 0
    inherited.clear()
    gc.collect()


def fork_from_worker(checks) -> object:
    status = {}

    def forker():
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.alarm(10)
                checks()
                code = 0
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                os._exit(code)
        deadline = time.monotonic() + 12
        while time.monotonic() < deadline:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status["rc"] = os.waitstatus_to_exitcode(st)
                return
            time.sleep(0.01)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        status["rc"] = "hung"
    t = threading.Thread(target=forker, name="r69h-forker")
    t.start()
    t.join(30)
    return status.get("rc", "forker hung")


def hold_and_fork(locks, checks) -> list:
    bad = []
    for name, lock in locks.items():
        if not hasattr(lock, "acquire"):
            continue
        lock.acquire()                  # the main thread is inside that section
        try:
            rc = fork_from_worker(checks)
        finally:
            lock.release()
        if rc != 0:
            bad.append((name, rc))
    return bad


chosen = backends.select()
before = {"_lazy._lock": _lazy._lock, "backends._lock": backends._lock, "memory._lock": memory._lock,
          "memory._settings_lock": memory._settings_lock, "random._lock": accel.random._lock,
          "streams._defaults_lock": S._defaults_lock, "streams._create_lock": S._create_lock,
          "graphs._pool_lock": graphs._pool_lock, "_mempool._ids_lock": _mempool._ids_lock}
for name in ("_lock", "_count_lock", "_choice_lock"):
    if hasattr(chosen, name):
        before["backend." + name] = getattr(chosen, name)
bad = hold_and_fork(before, child_before_init)
assert not accel.is_initialized()
print("before init:", bad, flush=True)

inherited["b"] = accel.Buffer(4096, device=dev).fill_(1)
inherited["s"] = accel.Stream(dev)
inherited["e"] = inherited["s"].record_event()
inherited["p"] = accel.empty_pinned(64)
be = _lazy.lazy_init()
after = {"device allocator": memory.device_allocator(dev)._lock, "host allocator": memory.host_allocator()._lock,
         "default generator": accel.random.default_generator(dev)._lock, "streams._close_lock": S._close_lock,
         "streams._create_lock": S._create_lock, "streams._foreign_lock": S._foreign_lock}
for name in ("_lock", "capture_gate", "_deferring_lock"):
    if hasattr(be, name):
        after["backend." + name] = getattr(be, name)
bad2 = hold_and_fork(after, child_after_init)
print("after init:", bad2, flush=True)
assert not bad and not bad2
x = accel.Buffer(4096, device=dev).fill_(9)      # the parent is unaffected
assert (x.to_numpy() == 9).all()
print("OK")
'''


@pytest.mark.parametrize("kind", SIMS)
def test_fork_from_a_worker_thread_while_main_holds_a_lock(monkeypatch, kind):
    """A worker thread forks while the main thread holds one lock at a time.  Before init (the
    parent counted and queued a seed): the child initializes, sees the queued seed on device 1
    and runs streams, events, Philox, pinned memory and a captured graph there.  After init:
    the child's device calls and closes raise the fork error (or do nothing), its queries
    answer, dropping the inherited objects is quiet; nothing waits on the parent's lock (a
    child past its 10 s alarm or 12 s deadline is a failure)."""
    _ok(_run(kind, monkeypatch, _FORK_FROM_WORKER, timeout=PROGRAM_S))


# =============================================================================================
# 5. threading.excepthook that calls accel
# =============================================================================================
def _thread_bodies(kind: str, dev: int) -> dict:
    def in_stream():
        s = accel.Stream(dev)
        with accel.device_index(dev), s:
            b = accel.Buffer(1 << 16)
            b.fill_(1)
            raise ValueError("user error inside with stream")

    def oom():
        accel.memory.set_per_process_memory_fraction(0.01, dev)
        try:
            keep = [accel.Buffer(8 << 20, device=dev) for _ in range(1000)]
        finally:
            accel.memory.set_per_process_memory_fraction(1.0, dev)
        del keep

    def closed_stream():
        s = accel.Stream(dev)
        s.close()
        s.synchronize()

    def in_capture(mode):
        def body():
            s = accel.Stream(dev)
            g = accel.Graph(capture_error_mode=mode)
            out = accel.Buffer(4096, device=dev)
            with s, g:
                out.fill_(3)
                raise KeyError("user error inside capture")
        return body

    out = {"in_stream": (in_stream, ValueError), "oom": (oom, accel.OutOfMemoryError),
           "closed_stream": (closed_stream, RuntimeError)}
    if kind != "mps":
        for mode in ("global", "thread_local", "relaxed"):
            out[f"capture_{mode}"] = (in_capture(mode), KeyError)
    return out


@pytest.mark.parametrize("kind", SIMS)
def test_excepthook_calls_accel_for_threads_that_died_inside_accel_blocks(monkeypatch, kind):
    """threading.excepthook, run in the dying thread after its ``with`` blocks unwound, sees
    device 0 current, the default stream of device 1, no capture underway, and can synchronize
    device 1, empty the cache, allocate and copy, summarize and capture and replay a graph there
    (the capture of the dead thread was ended, whatever its mode); afterwards device 1's
    allocated bytes are back at the baseline."""
    use_sim(monkeypatch, kind)
    dev = accel.device_count() - 1
    accel.set_device_index(0)
    base = accel.memory.memory_allocated(dev)
    seen = {}

    def hook(args):
        name = args.thread.name
        try:
            info = (args.exc_type, accel.current_device_index(), accel.is_current_stream_capturing(),
                    accel.current_stream(dev) == accel.default_stream(dev))
            accel.synchronize(dev)
            accel.memory.empty_cache()
            x = accel.Buffer(4096, device=dev).fill_(7)
            assert (x.to_numpy() == 7).all()
            x.close()
            assert "memory summary" in accel.memory.memory_summary(dev)
            if kind != "mps":
                g, o = accel.Graph(), accel.Buffer(512, device=dev)
                with accel.Stream(dev), g:
                    o.fill_(2)
                g.replay()
                accel.synchronize(dev)
                assert (o.to_numpy() == 2).all()
            seen[name] = info
        except BaseException as exc:        # noqa: B902 (reported by the assertion below)
            seen[name] = f"hook failed: {type(exc).__name__}: {exc}"

    monkeypatch.setattr(threading, "excepthook", hook)
    bodies = _thread_bodies(kind, dev)
    for name, (fn, _) in bodies.items():
        t = threading.Thread(target=fn, name=name)
        t.start()
        t.join(JOIN_S)
        assert not t.is_alive(), f"{name} hung"
    for name, (_, exc_type) in bodies.items():
        assert not isinstance(seen.get(name), str), seen.get(name)
        got, device, capturing, default = seen[name]
        assert issubclass(got, exc_type) and device == 0 and not capturing and default, (name, seen[name])
    seen.clear()
    gc.collect()
    assert accel.memory.memory_allocated(dev) == base
    assert accel.current_device_index() == 0
