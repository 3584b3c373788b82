"""r68i: deadlocks, wedges, lost updates and leaks under threads, the cyclic garbage collector and
fork, on the three simulators with two devices (Metal: one; device 1 is used non-current).

Earlier rounds (test_concurrency_adversarial*.py, test_gc_stress.py, test_finalizer_audit.py,
test_gc_user_finalizers.py, test_fork_threads_r59.py, test_processes_threads_r62b.py,
test_data_ordering_threads_r65j.py) took accel's own finalizers run by a collection inside the
caching allocator's lock, a user's ``__del__`` that allocates while the allocator or lazy init is
busy, and fork while a thread is inside the allocator, a capture, a replay, a random fill.  This
file adds, each interleaving forced (a function on the path is patched to run ``gc.collect()`` or
to park on a threading.Event while the lock is held; no timing):

1. **A collection inside each of accel's other critical sections, with a user's ``__del__``
   that calls accel** (the project's rule, accel/_locks.py: it must work or raise a clear error,
   never hang): the first ``device_allocator`` of a device (``memory._lock``), the first
   default stream of a device (``streams._defaults_lock``), an Event's first record
   (``streams._create_lock``, held across the vendor's event create), the first default
   generator of a device (``random._lock``), a MemPool's id (``_mempool._ids_lock``).
2. **fork while another thread holds the RNG locks** (a graph replay's RNG prologue holds the
   default generator's lock across the state write; the first default generator of a device
   holds ``random._lock``): the child must be able to seed and read its generators (host state,
   documented to work in a child) without hanging; and fork while a thread holds each of the
   other module and backend locks (the child's fork errors and queries must not hang).
3. **accel's own finalizers during a collection inside every lock** (allocator, pinned
   allocator, capture gate, graph launch lock, generator, backend and simulator locks): every
   kind of object (Buffer, view, non-owning DLPack import, unconsumed capsule, Stream, foreign
   Stream, Event, Graph, MemPool with live blocks, Generator registered with a graph, pinned
   array) dropped in one cycle; nothing waits, and after the next API entry nothing leaks.
4. **four threads on one device**: queries, snapshots, empty_cache, record_stream and frees in
   two threads while a third captures a graph (global, thread_local, relaxed) and a fourth
   drops objects in cycles and collects; the capture stays valid and replays right, nothing
   hangs or leaks.
5. **set_allocator_settings racing allocations** (no lost update between two racing calls, all
   devices agree) and **use_mem_pool in one thread while another thread's MemPool dies** (by
   reference count and by collection).
6. **a collection inside one's own capture** (global, thread_local, relaxed; expandable
   segments; Level Zero): the releases drained mid-capture leave it valid; and the allocators'
   counters lose no update under four threads with collections.
7. **the end of the last capture runs the queued releases with the capture gate held** while
   another thread's free holds the allocator's lock and waits for the gate.

Every risky part runs in a thread joined with a timeout or in a forked child (run_forked), so a
deadlock fails the test instead of hanging the run; a hung child dumps every thread's stack.

Bugs found (each a strict xfail first; fixed in session 28):

* a user's ``__del__`` run by a collection inside a plain ``threading.Lock`` section (the first
  device_allocator, default stream, Event create, default generator of a device; a MemPool id)
  that calls the API taking the same lock hangs forever (section 1);
* fork while another thread holds ``random._lock`` or a generator state's lock: the child's
  manual_seed / initial_seed / get_rng_state hang forever (section 2);
* an ABBA deadlock between ``capture_end`` (capture gate, then the allocator's lock through a
  DLPack deleter's ``_Pin.__del__`` -> blocking ``alloc.free``) and a free of a buffer used on
  another stream (the allocator's lock, then the gate) (section 7).
"""

import faulthandler
import gc
import os
import threading

import numpy as np
import pytest

import accel
import accel.sim
from accel import _finalize, _lazy, _locks
from conftest import SIMS, THOROUGH, run_forked, use_sim
from test_user_programs import allocated, live_objects, settle

WAIT_S = 20.0       # a parked thread's longest wait (a test bug, never reached)
CHILD_S = 20.0      # run_forked's limit
HANG_S = 1.0        # a call that has not returned after this is hung (GC_WAIT_S is cut to 0.3 s)
CHILD_WATCHDOG_S = 10.0     # a forked child that has not finished its checks after this is hung
KiB, MiB = 1 << 10, 1 << 20


def _last() -> int:
    return accel.device_count() - 1


def _bounded(fn, limit: float = HANG_S) -> str:
    """``fn()`` in a daemon thread joined with ``limit``: "ok", the exception's text, or "hung"
    (after writing every thread's stack to stderr, for the report)."""
    out = []

    def body():
        try:
            fn()
            out.append("ok")
        except BaseException as exc:       # noqa: B902 (reported, not swallowed)
            out.append(f"{type(exc).__name__}: {exc}")
    t = threading.Thread(target=body, name="r68i-bounded", daemon=True)
    t.start()
    t.join(limit)
    if t.is_alive():
        faulthandler.dump_traceback(all_threads=True)
        return "hung"
    return out[0]


def _join(threads, limit: float = WAIT_S) -> None:
    for t in threads:
        t.join(limit)
    hung = [t.name for t in threads if t.is_alive()]
    if hung:
        faulthandler.dump_traceback(all_threads=True)
    assert not hung, f"threads hung (deadlock?): {hung}"


class Park:
    """Parks the first call made by :attr:`thread` at :meth:`here` until :attr:`go` is set (in a
    forked child it does nothing: the child may take the same path, e.g. make a generator)."""

    def __init__(self):
        self.reached, self.go = threading.Event(), threading.Event()
        self.parent, self.thread, self.armed = os.getpid(), None, True

    def here(self, where: str) -> None:
        if os.getpid() != self.parent:
            return
        if not self.armed or threading.get_ident() != self.thread:
            return
        self.armed = False
        self.reached.set()
        if not self.go.wait(WAIT_S):
            raise RuntimeError(f"parked at {where} and never released")

    def before(self, fn, where: str):
        def parked(*args, **kwargs):
            self.here(where)
            return fn(*args, **kwargs)
        return parked


def _fork_while_parked(park: Park, call, child) -> tuple:
    """``call()`` in a thread until it parks, then fork: the child runs ``child()`` (its exit
    status returned); then release and join.  Returns (status, {"value"|"exc": ...})."""
    out = {}

    def body():
        park.thread = threading.get_ident()
        try:
            out["value"] = call()
        except BaseException as exc:
            out["exc"] = exc
    t = threading.Thread(target=body, name="r68i-holder")
    t.start()
    try:
        assert park.reached.wait(WAIT_S), "the holder never reached its parked point"
        code = run_forked(child, CHILD_S)
    finally:
        park.go.set()
        t.join(WAIT_S)
    assert not t.is_alive(), "the holder hung after its release"
    return code, out


def _child(checks, limit: float = CHILD_WATCHDOG_S) -> int:
    """A forked child's body: the checks under a watchdog that dumps the stack and exits 1."""
    faulthandler.dump_traceback_later(limit, exit=True)
    try:
        checks()
    finally:
        faulthandler.cancel_dump_traceback_later()
    return 0


# =============================================================================================
# 1. A collection inside accel's plain-lock critical sections runs a user's __del__ that calls
#    accel (forked child: a hung thread keeps the lock for good)
# =============================================================================================
class _UserCleanup:
    """A user's object kept in a reference cycle whose ``__del__`` calls accel (``api``)."""

    def __init__(self, api, out: list):
        self.me, self.api, self.out = self, api, out

    def __del__(self):
        try:
            self.api()
            self.out.append("ok")
        except (accel.AcceleratorError, RuntimeError) as exc:
            self.out.append(f"refused: {exc}")


def _collecting(fn, api, out):
    """``fn`` that, at its first call, drops a user's cycle and collects (as a collection that
    starts at an allocation inside ``fn``, with the caller's lock held)."""
    armed = [True]

    def wrapped(*args, **kwargs):
        if armed:
            armed.clear()
            _UserCleanup(api, out)
            gc.collect()
        return fn(*args, **kwargs)
    return wrapped


def _section_allocator(be, dev, out):
    """The first use of device ``dev``'s memory makes its allocator under memory._lock (and
    _settings_lock); the user's __del__ allocates on that device."""
    from accel.memory import _async
    _async.create_allocator = _collecting(_async.create_allocator,
                                          lambda: accel.Buffer(4 * KiB, device=dev).close(), out)
    return lambda: accel.memory.memory_stats(dev)


def _section_default_stream(be, dev, out):
    """The first default stream of ``dev`` is wrapped under streams._defaults_lock; the user's
    __del__ asks for the current stream of that device (the commonest accel call)."""
    be.default_stream = _collecting(be.default_stream, lambda: accel.current_stream(dev), out)
    return lambda: accel.default_stream(dev)


def _section_event_create(be, dev, out):
    """An Event's first record makes its device event under streams._create_lock, across the
    vendor call; the user's __del__ records an event of its own."""
    accel.current_stream(0)
    be.event_create = _collecting(be.event_create, lambda: accel.Event().record(), out)
    return lambda: accel.Event().record()


def _section_default_generator(be, dev, out):
    """The first default generator of ``dev`` is made under random._lock; the user's __del__
    seeds every device."""
    import accel.random as R
    base = R.Generator

    collect = _collecting(lambda: None, lambda: R.manual_seed_all(68), out)

    class Collecting(base):
        def __init__(self, *args, **kwargs):
            collect()
            super().__init__(*args, **kwargs)
    R.Generator = Collecting
    return lambda: R.initial_seed(dev)


def _section_mempool_id(be, dev, out):
    """A MemPool's id is drawn under _mempool._ids_lock; the user's __del__ makes a MemPool."""
    from accel.memory import _mempool

    collect = _collecting(lambda: None, lambda: accel.MemPool(), out)

    class Ids:
        n = 1000

        def __next__(self):
            collect()
            self.n += 1
            return self.n
    _mempool._user_ids = Ids()
    return lambda: accel.MemPool()


_SECTIONS = {f.__name__[len("_section_"):]: f for f in (
    _section_allocator, _section_default_stream, _section_event_create, _section_default_generator,
    _section_mempool_id)}


def _user_finalizer_in_section(kind: str, name: str) -> int:
    def checks():
        be = _lazy.lazy_init()
        _locks.GC_WAIT_S = 0.3      # a bounded wait (accel._locks.acquire) gives up quickly
        out = []
        call = _SECTIONS[name](be, _last(), out)
        got = _bounded(call)
        if got == "hung":
            os._exit(3)
        assert got == "ok", got
        assert len(out) == 1 and (out[0] == "ok" or "finalizer" in out[0]), out
        settle()    # accel still usable
    return _child(checks, 3 * HANG_S)


_LOCK_OF = {"allocator": "memory._lock", "default_stream": "streams._defaults_lock",
            "event_create": "streams._create_lock", "default_generator": "random._lock",
            "mempool_id": "_mempool._ids_lock"}


# (r68i: a strict xfail first: the thread waited on a lock it held)
@pytest.mark.parametrize("name", sorted(_SECTIONS))
@pytest.mark.parametrize("kind", ["cuda"])
def test_user_finalizer_in_a_first_use_section_never_hangs(monkeypatch, kind, name):
    """A collection starts inside the section (here: the function called under the lock runs
    gc.collect() first), and a user's cycle is garbage whose __del__ calls the API that takes
    the same lock: it must work, or raise accel's "called from a finalizer" error, never hang
    (accel/_locks.py; tests/test_gc_user_finalizers.py states it for the allocator and lazy
    init).  A plain threading.Lock taken by ``with`` waits forever: the child hangs (exit 3 or
    the watchdog's 1)."""
    use_sim(monkeypatch, kind)
    code = run_forked(lambda: _user_finalizer_in_section(kind, name), CHILD_S)
    assert code == 0, f"{_LOCK_OF[name]}: the child's user finalizer hung or failed (status {code})"


# =============================================================================================
# 2. fork while another thread holds a lock
# =============================================================================================
def _child_seeds(dev: int):
    """The child seeds and reads its generators (host state; no device needed)."""
    def checks():
        accel.random.manual_seed_all(5)     # (dropped in a child forked after init, as torch's: r75b)
        # the generators' own calls: accel.random.initial_seed/get_rng_state raise in a child
        # forked after initialization, as torch's do (r71e); Generator.manual_seed seeds in any child
        gen = accel.random.default_generator(dev)
        gen.manual_seed(5)
        assert gen.initial_seed() == 5
        assert gen.get_state()[:8].tobytes() == (5).to_bytes(8, "little")
    return lambda: _child(checks, 2 * HANG_S)     # (unheld, the checks take milliseconds)


# (r68i: a strict xfail first: the child hung)
@pytest.mark.parametrize("kind, where", [(k, "default_generator") for k in SIMS]
                         + [("cuda", "replay_prologue")])    # (Level Zero captures no uniform_ of bytes)
def test_fork_while_a_thread_holds_an_rng_lock(monkeypatch, kind, where):
    """A thread parks inside accel holding an RNG lock: making device ``dev``'s default generator
    (random._lock), or a graph replay's RNG prologue, which holds the default generator's lock
    across the write of its state (graph-safe RNG).  The parent forks; the child seeds and reads
    its generators, which a child may do (README "Lazy initialization and fork"): it must not
    hang.  The parked call then finishes right in the parent."""
    use_sim(monkeypatch, kind)
    dev = _last()
    park = Park()
    import accel.random as R
    if where == "default_generator":
        base = R.Generator

        class Parking(base):
            def __init__(self, *args, **kwargs):
                park.here("making a default generator")
                super().__init__(*args, **kwargs)
        monkeypatch.setattr(R, "Generator", Parking)

        def call():
            return R.initial_seed(dev)
        check = (lambda v: v == R.DEFAULT_SEED)
    else:
        s, g, out = accel.Stream(dev), accel.Graph(), accel.Buffer(4 * KiB, device=dev)
        with accel.device_index(dev):
            with accel.graph(g, stream=s):
                R.uniform_(out)       # the default generator of dev, graph-safe
        from accel.random import _device
        monkeypatch.setattr(_device, "write_state", park.before(_device.write_state, "RNG prologue"))

        def call():
            with accel.device_index(dev), s:
                g.replay()
            s.synchronize()
            return out.to_numpy()
        check = (lambda v: v.dtype == np.uint8 and v.size == 4 * KiB)
    code, res = _fork_while_parked(park, call, _child_seeds(dev))
    assert "exc" not in res, res
    assert check(res["value"])
    assert code == 0, f"the child hung or failed (status {code}) while the parent's thread held the lock"


_FORK_LOCKS = ("streams._defaults_lock", "streams._foreign_lock", "streams._close_lock", "streams._create_lock",
               "graphs._pool_lock", "_mempool._ids_lock", "_launch._limits_lock", "_dlpack.importing._take_lock",
               "_ffi._lock", "backends._lock", "memory._lock", "memory._settings_lock", "device allocator",
               "host allocator", "backend._lock", "backend.capture_gate", "_finalize.no_drain", "_lazy._lock")


def _module_lock(name: str):
    import accel.streams as S
    from accel import _dlpack, _ffi, backends, graphs, memory
    from accel.kernels import _launch
    from accel.memory import _mempool
    be = _lazy.lazy_init()
    table = {"streams._defaults_lock": S._defaults_lock, "streams._foreign_lock": S._foreign_lock,
             "streams._close_lock": S._close_lock, "streams._create_lock": S._create_lock,
             "graphs._pool_lock": graphs._pool_lock, "_mempool._ids_lock": _mempool._ids_lock,
             "_launch._limits_lock": _launch._limits_lock, "_dlpack.importing._take_lock": _dlpack.importing._take_lock,
             "_ffi._lock": _ffi._lock, "backends._lock": backends._lock, "memory._lock": memory._lock,
             "memory._settings_lock": memory._settings_lock,
             "device allocator": memory.device_allocator(_last())._lock,
             "host allocator": memory.host_allocator()._lock, "_finalize.no_drain": _finalize.no_drain,
             "_lazy._lock": _lazy._lock}
    if hasattr(be, "_lock"):
        table["backend._lock"] = be._lock
    if hasattr(be, "capture_gate"):
        table["backend.capture_gate"] = be.capture_gate
    return table.get(name)


@pytest.mark.parametrize("kind", SIMS)
def test_fork_while_a_thread_holds_each_other_lock(monkeypatch, kind):
    """A thread holds one of accel's module, allocator or backend locks (as a thread inside that
    section does) while the main thread forks: in the child every device call raises the fork
    error, the queries that need no device answer, and dropping the inherited objects with a
    collection calls nothing; none of it waits for the parent's lock.  (The RNG locks: above.)"""
    use_sim(monkeypatch, kind)
    dev = _last()
    s = accel.Stream(dev)
    b = accel.Buffer(4 * KiB, device=dev, stream=s).fill_(1)
    cyc = [b, s, s.record_event(), accel.empty_pinned(64)]
    cyc.append(cyc)
    s.synchronize()
    message = "forked subprocess"

    def child():
        def checks():
            calls = [("Buffer", lambda: accel.Buffer(64, device=dev)), ("Stream", lambda: accel.Stream(dev)),
                     ("Event.record", lambda: accel.Event().record()), ("MemPool", accel.MemPool),
                     ("empty_pinned", lambda: accel.empty_pinned(16)), ("fill_", lambda: b.fill_(2)),
                     ("from_handle", lambda: accel.Stream.from_handle(s.handle, dev)),
                     ("__dlpack__", lambda: b.__dlpack__()), ("synchronize", s.synchronize)]
            if kind != "mps":
                calls.append(("capture", lambda: accel.Graph().capture_begin()))
            bad = []
            for what, fn in calls:
                try:
                    fn()
                    bad.append(f"{what}: no error")
                except RuntimeError as exc:
                    if message not in str(exc):
                        bad.append(f"{what}: {exc}")
            assert not bad, bad
            assert accel.device_count() == dev + 1 and accel.is_available()
            assert accel.memory.memory_allocated(dev) == 0
            cyc.clear()
            gc.collect()
            _finalize.drain()
        return _child(checks)

    hung = []
    for name in _FORK_LOCKS:
        lock = _module_lock(name)
        if lock is None:
            continue
        held, go = threading.Event(), threading.Event()

        def holder():
            with lock:
                held.set()
                go.wait(WAIT_S)
        t = threading.Thread(target=holder, name=f"r68i-holds-{name}")
        t.start()
        try:
            assert held.wait(WAIT_S)
            if run_forked(child, CHILD_S) != 0:
                hung.append(name)
        finally:
            go.set()
            t.join(WAIT_S)
    del cyc[:]
    assert not hung, f"the child hung or failed while the parent held: {hung}"


# =============================================================================================
# 3. accel's own finalizers during a collection inside every lock
# =============================================================================================
PTX = (".version 7.0\n.target sm_50\n.address_size 64\n"
       ".visible .entry r68i_noop(.param .u64 p)\n{\n ret;\n}\n")


def _garbage(kind: str, dev: int, conf: str) -> dict:
    """One of each kind of accel object on device ``dev`` (device 0 current), in one cycle."""
    o = {}
    s = o["s"] = accel.Stream(dev)
    b = o["b"] = accel.Buffer(64 * KiB, device=dev, stream=s).fill_(1)
    o["view"] = b.as_array(np.float32)
    o["e"] = s.record_event()
    o["imported"] = accel.from_dlpack(accel.Buffer(4 * KiB, device=dev).fill_(2))
    o["capsule"] = accel.Buffer(4 * KiB, device=dev).__dlpack__()      # never consumed
    o["pinned"] = accel.empty_pinned(1024, np.float32)
    if "cudaMallocAsync" not in conf:
        with accel.device_index(dev):
            o["pool"] = accel.MemPool()
            with accel.use_mem_pool(o["pool"]):
                o["pooled"] = accel.Buffer(8 * KiB).fill_(5)    # a live block in the dying pool
    if kind != "mps":
        g = o["g"] = accel.Graph()
        gen = o["gen"] = accel.random.Generator(dev, seed=68)
        g.register_generator_state(gen)
        out = o["out"] = accel.Buffer(4 * KiB, device=dev)
        with accel.device_index(dev):
            with accel.graph(g, stream=s):
                out.fill_(3, stream=s)
        g.replay()
    if kind == "cuda":
        with accel.device_index(dev):
            o["module"] = accel.Module(PTX.encode())
    o["me"] = o
    return o


def _every_lock(kind: str, dev: int) -> dict:
    from accel import graphs, memory
    import accel.streams as S
    be = _lazy.lazy_init()
    table = {"device allocator": memory.device_allocator(dev)._lock, "host allocator": memory.host_allocator()._lock,
             "memory._lock": memory._lock, "memory._settings_lock": memory._settings_lock,
             "streams._defaults_lock": S._defaults_lock, "streams._foreign_lock": S._foreign_lock,
             "streams._close_lock": S._close_lock, "streams._create_lock": S._create_lock,
             "default generator": accel.random.default_generator(dev)._lock, "random._lock": accel.random._lock,
             "graphs._pool_lock": graphs._pool_lock, "_finalize.no_drain": _finalize.no_drain}
    for name in ("_lock", "_count_lock", "capture_gate", "_deferring_lock", "_choice_lock"):
        if hasattr(be, name):
            table["backend." + name] = getattr(be, name)
    if kind != "mps":      # a live graph's launch lock (held by replay across its launch)
        g, out = accel.Graph(), accel.Buffer(4 * KiB, device=dev)
        with accel.device_index(dev):
            with accel.graph(g):
                out.fill_(4)
        table["graph launch"] = g._launch_lock
        _KEEP.extend((g, out))
    if kind == "cuda":
        from accel.sim.cudart import state
        rt = state.runtime()
        table.update({"sim engine": rt.lock, "sim memory": rt.mlock, "sim captures": rt.clock})
        with accel.device_index(dev):
            module = accel.Module(PTX.encode())
        table["module"] = module._lock                      # (held by a launch and by close)
        _KEEP.append(module)
    if kind == "xpu":
        s = accel.Stream(dev)
        table["XPU stream"] = be._streams[s.handle].lock     # (held across appends)
        _KEEP.append(s)
    return table


_KEEP: list = []    # the live objects whose locks _every_lock hands out (dropped by the test)


@pytest.mark.parametrize("kind, conf", [(k, "") for k in SIMS] + [("cuda", "backend:cudaMallocAsync"),
                                                                   ("cuda", "expandable_segments:True")])
def test_own_finalizers_in_a_collection_inside_every_lock(monkeypatch, kind, conf):
    """Every kind of accel object (Buffer and a typed view, a non-owning DLPack import, an
    unconsumed capsule, Stream, Event, Graph with a registered Generator, MemPool with a live
    block, pinned array, Module) dropped in one cycle; a thread holding one of accel's (or the
    simulator's) locks runs the collection.  No finalizer waits (the thread returns), and after
    the next API entry everything is released: the simulator's live objects and the allocated
    bytes are back at the baseline, lock after lock."""
    use_sim(monkeypatch, kind, **({"ACCEL_ALLOC_CONF": conf} if conf else {}))
    dev = _last()
    accel.random.uniform_(accel.Buffer(64, device=dev))     # kernels loaded once (Metal keeps them)
    locks = _every_lock(kind, dev)
    settle()
    base = (live_objects(), allocated())
    leaks, hung = [], []
    try:
        _collect_inside_each(locks, kind, dev, conf, base, leaks, hung)
    finally:
        _KEEP.clear()
    assert not hung, f"a finalizer waited on the lock its collecting thread holds: {hung}"
    assert not leaks, f"released late or never (baseline {base}): {leaks}"


def _collect_inside_each(locks, kind, dev, conf, base, leaks, hung) -> None:
    for name, lock in locks.items():
        o = _garbage(kind, dev, conf)
        del o
        got = []

        def collect_inside():
            with lock:
                got.append(gc.collect())
        t = threading.Thread(target=collect_inside, name=f"r68i-collects-in-{name}", daemon=True)
        t.start()
        t.join(WAIT_S)
        if t.is_alive():
            faulthandler.dump_traceback(all_threads=True)
            hung.append(name)
            break       # (the lock stays held: nothing after this can be trusted)
        assert got and got[0] > 0, f"{name}: the cycle was not collected"
        settle()
        if (live_objects(), allocated()) != base:
            leaks.append((name, live_objects(), allocated()))


# =============================================================================================
# 4. Four threads on one device while one of them captures
# =============================================================================================
ROUNDS = int(os.environ.get("R68I_ROUNDS", "6"))


@pytest.mark.parametrize("kind, mode", [(k, m) for k in ("cuda", "xpu") for m in ("global", "thread_local", "relaxed")])
def test_queries_frees_and_drops_while_another_thread_captures(monkeypatch, kind, mode):
    """Per round (barriers, seeded choices): thread C captures on device ``dev`` (not current) in
    ``mode`` -- a temporary from the graph's pool, a fill, a copy into ``out`` -- and holds the
    capture open while thread Q reads memory_stats / memory_snapshot / memory_summary / host
    stats and empties both caches (empty_cache is refused with CaptureError while any capture is
    underway: README "Captures and other threads"), thread F allocates on its
    own stream, records another stream's use, closes, and records an event, and thread D makes
    Buffers, Streams and Events in a cycle, drops them and collects.  Then C ends the capture,
    replays and checks ``out``.  Nothing hangs, no capture is invalidated, every replay is right,
    and at the end nothing leaks."""
    use_sim(monkeypatch, kind, ACCEL_SIM_DELAY_US=200)
    dev = _last()
    rng = np.random.default_rng(68)
    plan = [rng.integers(0, 4, size=4).tolist() for _ in range(ROUNDS)]
    accel.random.uniform_(accel.Buffer(64, device=dev))
    settle()
    base = (live_objects(), allocated())
    start, underway, done, ended = (threading.Barrier(4, timeout=WAIT_S) for _ in range(4))
    errors, replays = [], []

    def capturer():
        s = accel.Stream(dev)
        out = accel.Buffer(16 * KiB, device=dev)
        for r in range(ROUNDS):
            start.wait()
            g = accel.Graph(capture_error_mode=mode)
            with accel.device_index(dev), s:
                g.capture_begin()
                try:
                    extra = accel.Buffer(512 * (1 + plan[r][0]))     # from the graph's pool
                    tmp = accel.Buffer(16 * KiB)
                    extra.fill_(9, stream=s)
                    tmp.fill_(r + 1, stream=s)
                    extra.close()
                    out.copy_from(tmp, non_blocking=True, stream=s)
                    tmp.close()
                    underway.wait()     # the others work now, the capture open
                    done.wait()
                finally:
                    g.capture_end()
            ended.wait()
            out.fill_(0, stream=s)
            with s:
                g.replay()
            replays.append(int(out.to_numpy(stream=s).max()) == int(out.to_numpy(stream=s).min()) == r + 1)
            g.reset()
        out.close()
        s.synchronize()
        s.close()

    def querier():
        for r in range(ROUNDS):
            start.wait()
            underway.wait()
            accel.memory.memory_stats(dev)
            accel.memory.memory_snapshot()
            accel.memory.memory_summary(dev)
            accel.memory.host_memory_stats()
            accel.memory.empty_host_cache()
            with pytest.raises(accel.CaptureError, match="capture"):
                accel.memory.empty_cache()      # refused while any capture is underway
            done.wait()
            ended.wait()

    def freer():
        s, other = accel.Stream(dev), accel.Stream(dev)
        for r in range(ROUNDS):
            start.wait()
            underway.wait()
            for i in range(1 + plan[r][1]):
                b = accel.Buffer((1 + i) * 64 * KiB, device=dev, stream=s)
                b.fill_(7, stream=s)
                other.wait_stream(s)
                b.record_stream(other)
                b.close()
            accel.Event().record(s)
            done.wait()
            ended.wait()
        s.synchronize(), other.synchronize()
        s.close(), other.close()

    def dropper():
        for r in range(ROUNDS):
            start.wait()
            underway.wait()
            for _ in range(1 + plan[r][2]):
                st = accel.Stream(dev)
                cyc = [st, accel.Buffer(32 * KiB, device=dev, stream=st).fill_(1, stream=st), accel.Event()]
                cyc[2].record(st)
                cyc.append(cyc)
                del cyc, st
            gc.collect()
            done.wait()
            ended.wait()

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as exc:        # noqa: B902 (reported below)
                import traceback
                errors.append(f"{fn.__name__}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                for b in (start, underway, done, ended):
                    b.abort()
        return run
    threads = [threading.Thread(target=guarded(f), name=f"r68i-{f.__name__}")
               for f in (capturer, querier, freer, dropper)]
    for t in threads:
        t.start()
    _join(threads)
    assert not errors, "\n".join(errors)
    assert replays == [True] * ROUNDS
    settle()
    assert (live_objects(), allocated()) == base


# =============================================================================================
# 5. set_allocator_settings racing allocations; use_mem_pool while another thread's MemPool dies
# =============================================================================================
def _check_settings(split_mb: int, expandable: bool, threshold: float) -> None:
    """Two settings calls raced: whichever ran last, ``expandable_segments`` is the second
    call's (the first never names it), and exactly one of max_split_size /
    garbage_collection_threshold is set (each call puts the other back to its default);
    every device's allocator and get_allocator_settings agree."""
    from accel.memory import _config
    defaults = _config.AllocConfig()
    configs = [accel.memory.device_allocator(d).config for d in range(accel.device_count())]
    assert all(c == configs[0] for c in configs), configs
    c = configs[0]
    assert bool(c.expandable_segments) == expandable, c
    first_last = (c.max_split_size == defaults.max_split_size and c.garbage_collection_threshold == threshold)
    second_last = (c.max_split_size == split_mb * MiB and c.garbage_collection_threshold == 0.0)
    assert first_last or second_last, c
    text = accel.memory.get_allocator_settings()
    assert (f"max_split_size_mb:{split_mb}" in text) == second_last, text


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_set_allocator_settings_races_allocations(monkeypatch, kind):
    """Per round two threads call set_allocator_settings at once (max_split_size_mb in one,
    expandable_segments and garbage_collection_threshold in the other) while two threads
    allocate, fill, check and free on devices 0 and 1 (sizes from a seeded plan, some past
    max_split_size, some in cycles dropped to the collector).  No call hangs or fails, no update
    is lost (see _check_settings), every buffer reads back what was written, and the memory
    all comes back."""
    use_sim(monkeypatch, kind, ACCEL_SIM_DELAY_US=50)
    rng = np.random.default_rng(6868)
    rounds = 6 if THOROUGH else 2       # by default the plan's first 2 rounds: each races both setters
    plan = [(int(rng.choice([24, 32, 48])), bool(rng.integers(2)), float(rng.choice([0.5, 0.7, 0.9])),
             rng.integers(1, 48, size=6).tolist()) for _ in range(rounds)]
    settle()
    base = (live_objects(), allocated())
    start, set_done = threading.Barrier(4, timeout=WAIT_S), threading.Barrier(4, timeout=WAIT_S)
    errors = []

    def setter_split():
        for split, _, _, _ in plan:
            start.wait()
            accel.memory.set_allocator_settings(f"max_split_size_mb:{split}")
            set_done.wait()

    def setter_expandable():
        for split, exp, thr, _ in plan:
            start.wait()
            accel.memory.set_allocator_settings(f"expandable_segments:{exp},garbage_collection_threshold:{thr}")
            set_done.wait()
            _check_settings(split, exp, thr)

    def allocator_on(dev):
        def run():
            s = accel.Stream(dev)
            for r, (_, _, _, sizes) in enumerate(plan):
                start.wait()
                bufs = []
                for i, n in enumerate(sizes):
                    b = accel.Buffer(n * MiB + 512 * i, device=dev, stream=s).fill_((r + i) % 251, stream=s)
                    bufs.append(b)
                    if i % 3 == 2:
                        cyc = [bufs.pop(0)]
                        cyc.append(cyc)
                        del cyc
                for i, b in enumerate(bufs):
                    got = b.to_numpy(stream=s)
                    assert int(got.min()) == int(got.max()), f"device {dev}: a buffer's bytes changed"
                    b.close()
                del bufs
                gc.collect()
                set_done.wait()
            s.synchronize()
            s.close()
        run.__name__ = f"allocator_on_{dev}"
        return run

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as exc:        # noqa: B902 (reported below)
                errors.append(f"{fn.__name__}: {type(exc).__name__}: {exc}")
                start.abort(), set_done.abort()
        return run
    threads = [threading.Thread(target=guarded(f), name=f"r68i-{f.__name__}")
               for f in (setter_split, setter_expandable, allocator_on(0), allocator_on(_last()))]
    for t in threads:
        t.start()
    _join(threads)
    assert not errors, errors
    settle()
    assert (live_objects(), allocated()) == base
    stats = accel.memory.memory_stats(_last())
    assert stats["allocated_bytes.all.current"] == 0 and stats["reserved_bytes.all.current"] == 0


@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
@pytest.mark.parametrize("how", ["refcount", "collection"])
def test_use_mem_pool_while_another_threads_mempool_dies(monkeypatch, kind, how):
    """Thread A allocates inside ``use_mem_pool(pool_a)`` on device ``dev`` round after round;
    thread B, each round, makes a MemPool, allocates in it, leaves its context and drops the
    pool with live blocks (by reference count, or in a cycle collected by thread A *inside* its
    use_mem_pool block, so the pool's release is deferred and then drained by A's next
    allocation, routed to pool_a).  A's blocks all come from pool_a, B's blocks keep their bytes
    after their pool died and are freed into the general cache, pool_a's use count stays
    right, nothing hangs, and the memory all comes back."""
    use_sim(monkeypatch, kind)
    dev = _last()
    with accel.device_index(dev):
        box = {"a": accel.MemPool()}        # (dropped at the end: the pool's release)
    settle()
    base_alloc = allocated()
    rounds = 6
    start, dropped, done = (threading.Barrier(2, timeout=WAIT_S) for _ in range(3))
    errors, handed = [], []

    def thread_a():
        pool_a = box["a"]
        with accel.use_mem_pool(pool_a, device=dev):
            for r in range(rounds):
                start.wait()
                dropped.wait()
                if how == "collection":
                    gc.collect()        # B's pool dies here, its release deferred
                mine = [accel.Buffer(4 * KiB * (r + 1), device=dev).fill_(r + 1) for _ in range(3)]
                owned = {blk["address"] for seg in pool_a.snapshot() for blk in seg["blocks"]
                         if blk["state"] == "active_allocated"}
                assert {b.ptr for b in mine} <= owned, "an allocation inside use_mem_pool left its pool"
                assert pool_a.use_count() == 2      # the MemPool and this context
                for b in mine:
                    assert int(b.to_numpy().max()) == r + 1
                    b.close()
                done.wait()

    def thread_b():
        for r in range(rounds):
            start.wait()
            with accel.device_index(dev):
                pool_b = accel.MemPool()
                with accel.use_mem_pool(pool_b):
                    live = [accel.Buffer(8 * KiB, device=dev).fill_(50 + r) for _ in range(2)]
            if how == "collection":
                cyc = [pool_b]
                cyc.append(cyc)
                del cyc
            del pool_b
            handed.append(live)
            dropped.wait()
            done.wait()
            for b in live:
                assert int(b.to_numpy().min()) == 50 + r, "a block of a dead pool lost its bytes"
                b.close()

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as exc:        # noqa: B902 (reported below)
                errors.append(f"{fn.__name__}: {type(exc).__name__}: {exc}")
                start.abort(), dropped.abort(), done.abort()
        return run
    threads = [threading.Thread(target=guarded(f), name=f"r68i-{f.__name__}") for f in (thread_a, thread_b)]
    for t in threads:
        t.start()
    _join(threads)
    assert not errors, errors
    handed.clear()
    assert box["a"].use_count() == 1
    box.clear()
    settle()
    assert allocated() == base_alloc
    stats = accel.memory.memory_stats(dev)
    assert stats["reserved_bytes.all.current"] == 0, "a dead pool's segments were never given back"


# =============================================================================================
# 6. A collection inside one's own capture; counters under threads and collections
# =============================================================================================
@pytest.mark.parametrize("kind, mode, conf", [("cuda", m, "") for m in ("global", "thread_local", "relaxed")]
                         + [("cuda", "global", "expandable_segments:True"), ("xpu", "global", "")])
def test_collection_inside_ones_own_capture(monkeypatch, kind, mode, conf):
    """The capturing thread drops, mid-capture, a cycle of objects made before it (Buffers with
    work pending on another stream, an Event, a Stream, pinned memory, a MemPool with a live
    block, a captured Graph, that other stream) and objects of the capture itself (a temporary
    from the graph's pool, and on CUDA an event recorded in the capture), and collects; its next
    allocation drains the releases inside the capture.  The capture stays valid (no event query,
    synchronize or device free reaches the runtime while it is underway), the replay is right,
    and at the end nothing leaks."""
    use_sim(monkeypatch, kind, ACCEL_SIM_DELAY_US=100, **({"ACCEL_ALLOC_CONF": conf} if conf else {}))
    dev = _last()
    accel.random.uniform_(accel.Buffer(64, device=dev))
    settle()
    base = (live_objects(), allocated())
    s, out = accel.Stream(dev), accel.Buffer(4 * KiB, device=dev)
    other = accel.Stream(dev)
    pre = [accel.Buffer(64 * KiB, device=dev, stream=other).fill_(1, stream=other) for _ in range(3)]
    pre += [other.record_event(), accel.Stream(dev), accel.empty_pinned(256)]
    with accel.device_index(dev):
        pool = accel.MemPool()
        with accel.use_mem_pool(pool):
            pre.append(accel.Buffer(8 * KiB).fill_(2))
        g0 = accel.Graph()
        with accel.graph(g0, stream=s):
            out.fill_(5, stream=s)
    pre += [pool, g0, other]
    pre.append(pre)
    del pool, g0, other
    g = accel.Graph(capture_error_mode=mode)
    with accel.device_index(dev), s:
        g.capture_begin()
        tmp = accel.Buffer(4 * KiB)
        tmp.fill_(7)
        cyc = [tmp]
        if kind == "cuda":      # (Level Zero captures record no events)
            cyc.append(accel.Event())
            cyc[-1].record()
        cyc.append(cyc)
        del pre, cyc, tmp
        assert gc.collect() > 0 and _finalize.pending
        t2 = accel.Buffer(4 * KiB)     # an API entry: drains inside the capture
        t2.fill_(9)
        out.copy_from(t2, non_blocking=True)
        t2.close()
        g.capture_end()
    out.fill_(0, stream=s)
    with s:
        g.replay()
    assert set(out.to_numpy(stream=s).tolist()) == {9}
    g.reset()
    s.synchronize()
    del g
    s.close(), out.close()
    settle()
    assert (live_objects(), allocated()) == base


@pytest.mark.parametrize("kind", SIMS)
def test_counters_lose_no_update_under_threads_and_collections(monkeypatch, kind):
    """Four threads each allocate and free K device buffers (sizes seeded) and K pinned arrays on
    device ``dev``, a fifth of them dropped in cycles with collections in between: the
    allocator's counters count every request exactly once (allocation.all.allocated and .freed
    grow by 4K, current 0), as do the pinned allocator's active_requests, and all the memory
    comes back."""
    use_sim(monkeypatch, kind)
    dev, n, k = _last(), 4, 60
    settle()
    dev0, host0 = accel.memory.memory_stats(dev), accel.memory.host_memory_stats()
    start = threading.Barrier(n, timeout=WAIT_S)
    errors = []

    def work(i):
        try:
            rng = np.random.default_rng(680 + i)
            st = accel.Stream(dev)
            start.wait()
            for j in range(k):
                b = accel.Buffer(int(rng.integers(1, 4096)) * 512, device=dev, stream=st)
                p = accel.empty_pinned(int(rng.integers(1, 64)) * 64)
                if j % 5 == 0:
                    cyc = [b, p]
                    cyc.append(cyc)
                    del cyc
                    if j % 25 == 0:
                        gc.collect()
                else:
                    b.close()
                del b, p
            st.synchronize()
            st.close()
        except BaseException as exc:        # noqa: B902 (reported below)
            errors.append(f"thread {i}: {type(exc).__name__}: {exc}")
            start.abort()
    threads = [threading.Thread(target=work, args=(i,), name=f"r68i-counter-{i}") for i in range(n)]
    for t in threads:
        t.start()
    _join(threads)
    assert not errors, errors
    settle()
    dev1, host1 = accel.memory.memory_stats(dev), accel.memory.host_memory_stats()
    for key in ("allocation.all.allocated", "allocation.all.freed"):
        assert dev1[key] - dev0.get(key, 0) == n * k, key
    for key in ("active_requests.allocated", "active_requests.freed"):
        assert host1[key] - host0.get(key, 0) == n * k, key
    assert dev1["allocated_bytes.all.current"] == dev1["reserved_bytes.all.current"] == 0
    assert host1["active_requests.current"] == host1["allocated_bytes.current"] == 0


# =============================================================================================
# 7. Ending the last capture runs the queued releases with the capture gate held
# =============================================================================================
class _OrderingLock:
    """Stands in for an allocator's ``_lock``: thread B, once it holds it, waits until thread A
    (armed) asks for it or A's capture_end returned -- the interleaving under test, forced."""

    def __init__(self, real, a_asks: threading.Event):
        self._real, self._a_asks = real, a_asks
        self.a_ident = None
        self.b_holds = threading.Event()

    def acquire(self, blocking=True, timeout=-1):
        if threading.get_ident() == self.a_ident:
            self._a_asks.set()
        got = self._real.acquire(blocking, timeout)
        if got and threading.current_thread().name == "r68i-B" and not self.b_holds.is_set():
            self.b_holds.set()
            self._a_asks.wait(WAIT_S)
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


def _capture_end_runs_a_foreign_release(kind: str) -> int:
    def checks():
        dev = _last()
        alloc = accel.memory.device_allocator(dev)
        src = accel.Buffer(4 * KiB, device=dev).fill_(3)
        imp = accel.from_dlpack(src)        # a non-owning accel Buffer over src (src pinned)
        src.close()                         # the export keeps the memory until its deleter
        other, s = accel.Stream(dev), accel.Stream(dev)
        b = accel.Buffer(64 * KiB, device=dev).fill_(1)
        b.record_stream(other)              # its free records events: allocator lock, then gate
        accel.synchronize(dev)
        a_asks = threading.Event()
        lock = alloc._lock = _OrderingLock(alloc._lock, a_asks)
        queued = threading.Event()

        def thread_a():
            g = accel.Graph()
            with accel.device_index(dev), s:
                g.capture_begin()
                out = accel.Buffer(4 * KiB)
                out.fill_(1)
                imp.close()         # a capture is underway: the release waits for its end
                queued.set()
                assert lock.b_holds.wait(WAIT_S)
                lock.a_ident = threading.get_ident()
                try:
                    g.capture_end()     # runs the queued release with the capture gate held
                finally:
                    a_asks.set()
            g.replay()

        def thread_b():
            assert queued.wait(WAIT_S)
            b.close()               # allocator lock held, then the capture gate

        threads = [threading.Thread(target=thread_a, name="r68i-A", daemon=True),
                   threading.Thread(target=thread_b, name="r68i-B", daemon=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * HANG_S)      # (both run at once: a shared bound in practice)
        if any(t.is_alive() for t in threads):
            faulthandler.dump_traceback(all_threads=True)
            os._exit(3)
        alloc._lock = lock._real
        settle()
        assert accel.memory.memory_allocated(dev) == 0
    return _child(checks)


# (r68i: a strict xfail first: ABBA deadlock)
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_capture_end_running_a_foreign_release_while_another_thread_frees(monkeypatch, kind):
    """Thread A captures; during the capture it closes a non-owning Buffer imported (DLPack) from
    an accel Buffer that was closed while exported, so the release waits for the end of the
    capture (the backend's after-captures queue).  Thread B frees a buffer used on another
    stream (free: the allocator's lock, then the capture gate to record its events) and, holding
    the allocator's lock, waits until A asks for it; A ends the capture, which runs the queue
    with the gate held: the deleter frees the producer's memory through the allocator.  Both
    must finish (the producer's free never waits on the allocator under the gate, or B never
    waits for the gate under the lock), and the memory comes back."""
    use_sim(monkeypatch, kind)
    code = run_forked(lambda: _capture_end_runs_a_foreign_release(kind), CHILD_S)
    assert code == 0, f"the threads deadlocked or failed (status {code}; stacks on stderr)"
