"""Adversarial review (r70g) of the lead's session-30 fixes (c6a15bb..4c5ecae): accel/_locks.py
(``_take_into`` and ``BoundedHold``, since folded into ``acquire_into`` and ``held``; ``Lock/RLock._enter_checked``, ``module_lock``), the allocators'
``_probe`` (device, async, pinned), ``Backend.after_gate``'s kept releases now also run by any
thread's safe point (``run_kept``), seeding before initialization as torch's queue
(``_seeds_before_init``), ``synchronize`` in a bad-fork child, the allocator variables' order and
``accel._cuda_containers``.

What the project promises and these tests hold it to: a user's code that runs inside accel (a gc
callback, a ``__del__``, a signal handler) never hangs and never leaves a lock held; a release
handed to ``after_gate`` runs once, on a thread that holds no capture gate, by the next safe point
after the gate is free; a Ctrl-C leaves nothing lost; seeding before init ends as torch 2.13's
queue leaves it (torch/cuda/__init__.py ``_lazy_call``/``_lazy_init``, torch/_utils.py
``_LazySeedTracker``, run here on the CPU wheel's own Python); bad input is a clear error.

Every interleaving is forced (a gc callback at the first collection that ends under the gate,
``gc.set_threshold(1)``; wrappers of a lock or of the gate that signal a step); a possible deadlock
runs in a forked child whose threads are joined under a timeout.  Nothing depends on timing.

Bugs (strict xfails; each reason names the cause): see the ``reason=`` strings below.

Checked and found fine (guards below, or by hand): ``_take_into``/``Lock._enter_checked``/
``BoundedHold.__enter__`` and ``RLock._enter_checked`` (plain and nested holds by a finalizer)
under a KeyboardInterrupt at every eval-breaker point: never left held, never released twice;
every converted ``with _probe(...)`` site holds the same lock object as before, the four hot paths
keep their condition, each refusal names its call; ``module_lock`` names are read as globals at
each use (no module keeps an alias); ``_take_kept`` never runs an item twice (one take under
``_kept_lock``); a fork child drops the kept items and markers; synchronize(index) in a bad-fork
child returns and synchronize()/synchronize("cuda") raise the fork error, as torch's
``_get_device_index`` + ``_accelerator_synchronizeDevice``; PYTORCH_CUDA_ALLOC_CONF before
PYTORCH_ALLOC_CONF (also an empty one) as the 2.13 wheel.
"""

import gc
import os
import struct
import sys
import threading
import time

import numpy as np
import pytest

import accel
import accel.random as R
from accel import _cuda_containers, _dlpack, _finalize, _lazy, _locks
from accel import backends as _backends
from accel.kernels import _module
from conftest import run_forked, use_sim
from test_review_r70a import _Inject, _UnderTheGate

KiB = 1 << 10
WAIT_S = 5.0        # a forced interleaving's longest wait (a test bug, never reached)
JOIN_S = 6.0        # a thread not done after this is deadlocked (the bounded wait is 2 s)
CHILD_S = 30.0      # run_forked's limit


# =============================================================================================
# 1. after_gate: the keeping thread's own drain under the gate consumes the marker
# =============================================================================================
def _import_closed_then(after, dev_b: int = 0):
    """A DLPack import of an accel Buffer (device 0) is closed by a gc callback while this thread
    is inside another Buffer's free (device ``dev_b``), which holds the capture gate; the callback
    then calls ``after()``.  Returns (fired, callback result, exports right after, exports after
    two more safe points), each counted from the exports live as it starts."""
    be = _lazy.lazy_init()
    base = _dlpack.live_exports()
    src = accel.Buffer(4 * KiB).fill_(3)
    imp = accel.from_dlpack(src)
    src.close()
    other = accel.Stream(dev_b)
    b = accel.Buffer(64 * KiB, device=dev_b).fill_(1)
    b.record_stream(other)          # its free records events, the gate held
    accel.synchronize(dev_b)

    def act():
        imp.close()
        return after()

    cb = _UnderTheGate(be, act)
    try:
        with cb:
            b.close()
        right_after = _dlpack.live_exports()
        accel.Buffer(4 * KiB).close()           # safe points: an allocation, a synchronize
        accel.synchronize()
        later = _dlpack.live_exports()
    finally:
        _finalize.drain()           # (this thread holds no gate: leaves nothing for later tests)
    return cb.fired, cb.result, right_after - base, later - base


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_guard_a_callback_that_reads_stats_after_closing_an_import(monkeypatch, kind):
    """Guard of the test below: the callback fires under the gate, its memory_allocated(1)
    answers (device 1's allocator is not the one the free holds), the export was live."""
    use_sim(monkeypatch, kind)
    fired, result, right_after, _ = _import_closed_then(lambda: accel.memory.memory_allocated(1))
    assert fired
    assert isinstance(result, int), result
    assert right_after == 1


# (r70g found; fixed in session 30)
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_a_drain_under_the_gate_does_not_lose_the_kept_release(monkeypatch, kind):
    """The callback closes the import, then reads memory_allocated(1) (an API entry: it drains,
    and run_kept finds this thread still holding the gate).  The producer's deleter must still run
    by the next safe point once the free returned (the export count back to 0); it stays live
    for good."""
    use_sim(monkeypatch, kind)
    fired, result, _, later = _import_closed_then(lambda: accel.memory.memory_allocated(1))
    assert fired and isinstance(result, int)
    assert later == 0, f"the producer's deleter never ran: {later} export(s) live after two more safe points"


# =============================================================================================
# 2. run_kept on another thread runs the kept release under that thread's gate and lock
# =============================================================================================
class _GateSpy:
    """Stands in for ``backend.capture_gate`` (an RLock): sets ``b_waiting`` when thread ``b``
    finds it busy (it then waits for it as before)."""

    def __init__(self, real):
        self._real, self.b, self.b_waiting = real, None, threading.Event()

    def _is_owned(self):
        return self._real._is_owned()

    def acquire(self, blocking=True, timeout=-1):
        if self._real.acquire(False):
            return True
        if threading.get_ident() == self.b:
            self.b_waiting.set()
        return self._real.acquire(blocking, timeout)

    def release(self):
        self._real.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def _kept_by_a_run_under_b(monkeypatch):
    """Thread A, in a free of a device-1 buffer (the gate held), closes a DLPack import of a
    device-0 buffer from a gc callback, once thread B (main) waits for the gate in its own free of
    a device-0 buffer (B already drained at its entry and holds device 0's allocator lock): the
    producer's deleter is kept, with a marker.  A's hold ends (nothing runs it); B gets the gate,
    and B's gc callback reads memory_allocated(1), which drains.  Returns (where each import
    release ran: (thread, gate held, device 0's lock held), callback flags, B's result, unraisable
    reports, exports (counted from those live as it starts) and device-0 bytes after more safe
    points)."""
    be = _lazy.lazy_init()
    base = _dlpack.live_exports()
    gate = be.capture_gate = _GateSpy(be.capture_gate)     # (before any allocator reads it)
    ran = []
    real_release = _dlpack.Imported.release

    def release(self, *args):
        ran.append((threading.current_thread().name, gate._is_owned(),
                    accel.memory.device_allocator(0)._lock._is_owned()))
        return real_release(self, *args)

    monkeypatch.setattr(_dlpack.Imported, "release", release)
    src = accel.Buffer(4 * KiB, device=0).fill_(3)
    imp = accel.from_dlpack(src)
    src.close()
    oa, ob = accel.Stream(1), accel.Stream(0)
    ba = accel.Buffer(64 * KiB, device=1).fill_(1)
    ba.record_stream(oa)
    bb = accel.Buffer(64 * KiB, device=0).fill_(1)
    bb.record_stream(ob)
    accel.synchronize(0)
    accel.synchronize(1)
    a_in = threading.Event()
    state = {"a": None, "b": None, "b_result": None}

    def callback(phase, info):
        if phase != "stop" or not gate._is_owned():
            return
        me = threading.get_ident()
        if me == state["a"] and a_in.is_set() is False:
            a_in.set()
            gate.b_waiting.wait(WAIT_S)
            imp.close()
        elif me == gate.b and state["b"] is None:
            state["b"] = True
            try:
                state["b_result"] = accel.memory.memory_allocated(1)
            except accel.AcceleratorError as exc:
                state["b_result"] = f"refused: {exc}"

    def thread_a():
        state["a"] = threading.get_ident()
        ba.close()

    reports = []
    old_hook, old_threshold = sys.unraisablehook, gc.get_threshold()
    sys.unraisablehook = reports.append
    gate.b = threading.get_ident()
    gc.callbacks.append(callback)
    gc.set_threshold(1)
    try:
        t = threading.Thread(target=thread_a, name="r70g-A", daemon=True)
        t.start()
        assert a_in.wait(WAIT_S)
        bb.close()
        t.join(JOIN_S)
        assert not t.is_alive()
    finally:
        gc.set_threshold(*old_threshold)
        gc.callbacks.remove(callback)
    try:
        accel.Buffer(4 * KiB).close()           # safe points
        accel.synchronize(0)
        gc.collect()
    finally:
        sys.unraisablehook = old_hook
    flags = (a_in.is_set(), gate.b_waiting.is_set(), state["b"])
    return ran, flags, state["b_result"], [str(r.exc_value) for r in reports], \
        _dlpack.live_exports() - base, accel.memory.memory_allocated(0)


def test_guard_another_threads_kept_release_reaches_a_drain_under_the_gate(monkeypatch):
    """Guard of the test below: the interleaving happens (A kept the deleter while B waited for
    the gate; B's callback fired under it and its call answered), and the deleter ran once."""
    use_sim(monkeypatch, "cuda")
    ran, flags, b_result, _, _, _ = _kept_by_a_run_under_b(monkeypatch)
    assert flags == (True, True, True)
    assert isinstance(b_result, int), b_result
    assert len(ran) == 1


# (r70g found; fixed in session 30)
def test_another_threads_kept_release_never_runs_under_this_threads_gate(monkeypatch):
    """after_gate's promise (r69a): the deleter runs on a thread that holds no capture gate.  Here
    it runs on B inside B's free (gate and device 0's lock held); its free of the exported memory
    is refused as re-entry, retried in the same drain, reported as "failed twice", and the 4 KiB
    stay allocated for good."""
    use_sim(monkeypatch, "cuda")
    ran, _, _, reports, exports, allocated = _kept_by_a_run_under_b(monkeypatch)
    assert all(not gate_held for _, gate_held, _ in ran), ran
    assert not reports, reports
    assert (exports, allocated) == (0, 0)


# =============================================================================================
# 3. (removed in session 30: the Ctrl-C sweep of run_kept/_take_kept tested code that the fix of
#    sections 1-2 replaced; after_gate defers to accel._finalize.pending, whose drain is swept by
#    tests/test_interrupt_*.py)
# =============================================================================================

# =============================================================================================
# 4. the async and pinned allocators' _probe under the gate: the ABBA deadlock r70a fixed for
#    the native allocator
# =============================================================================================
class _SpyLock:
    """Stands in for an allocator's lock (an OwnedLock): sets ``b_holds`` once thread ``b`` holds it."""

    def __init__(self, real):
        self._real, self.b, self.b_holds = real, None, threading.Event()

    def acquire(self, blocking=True, timeout=-1):
        got = self._real.acquire(blocking, timeout)
        if got and threading.get_ident() == self.b:
            self.b_holds.set()
        return got

    def release(self):
        self._real.release()

    def locked(self):
        return self._real.locked()

    def _is_owned(self):
        return self._real._is_owned()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def _gate_then_lock(which: str):
    """Thread A closes a DLPack import (``_release_foreign`` holds the capture gate); a gc callback
    there waits until thread B holds the allocator's lock (B's call then waits for the gate) and
    reads the allocator's stats.  B: a free of a buffer used on another stream ("device": native
    or async allocator, device 1), or empty_host_cache ("pinned").  Returns (A alive, B alive,
    A's result, B held the lock)."""
    dev = 1
    be = _lazy.lazy_init()
    if which == "pinned":
        alloc = accel.memory.host_allocator()
        ptr = alloc.malloc(4 * KiB)     # (the pinned allocator learns its backend)
        alloc.free(ptr)
        query = lambda: accel.memory.host_memory_stats()["num_host_alloc"]      # noqa: E731
        b_call = accel.memory.empty_host_cache
    else:
        alloc = accel.memory.device_allocator(dev)
        query = lambda: accel.memory.memory_allocated(dev)      # noqa: E731
        other = accel.Stream(dev)
        b = accel.Buffer(64 * KiB, device=dev).fill_(1)
        b.record_stream(other)
        b_call = b.close
    src = accel.Buffer(4 * KiB, device=dev).fill_(3)
    imp = accel.from_dlpack(src)
    src.close()
    accel.synchronize(dev)
    lock = alloc._lock = _SpyLock(alloc._lock)
    a_in = threading.Event()

    def act():
        a_in.set()
        lock.b_holds.wait(WAIT_S)
        return query()

    cb = _UnderTheGate(be, act, ident=-1)

    def thread_a():
        cb.ident = threading.get_ident()
        with cb:
            imp.close()

    def thread_b():
        lock.b = threading.get_ident()
        if a_in.wait(WAIT_S):
            b_call()

    threads = [threading.Thread(target=thread_a, daemon=True), threading.Thread(target=thread_b, daemon=True)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + JOIN_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return threads[0].is_alive(), threads[1].is_alive(), cb.result, lock.b_holds.is_set()


def _deadlock_child(which: str) -> int:
    a_alive, b_alive, result, b_held = _gate_then_lock(which)
    if a_alive or b_alive:
        return 3
    if not b_held:
        return 4        # (the interleaving was not reached: a test bug)
    return 0


def test_guard_the_native_allocator_answers_or_refuses_under_the_gate(monkeypatch):
    """Guard of the tests below: the same interleaving with the native allocator (r70a's fix)
    ends: A's bounded wait refuses after 2 s, B's free completes."""
    use_sim(monkeypatch, "cuda")
    assert run_forked(lambda: _deadlock_child("device"), CHILD_S) == 0


# (r70g found; fixed in session 30)
def test_the_async_allocator_never_deadlocks_under_the_gate(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="backend:cudaMallocAsync")
    code = run_forked(lambda: _deadlock_child("device"), CHILD_S)
    assert code == 0, f"status {code} (3: the threads deadlocked)"


# (r70g found; fixed in session 30)
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_the_pinned_allocator_never_deadlocks_under_the_gate(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    code = run_forked(lambda: _deadlock_child("pinned"), CHILD_S)
    assert code == 0, f"status {code} (3: the threads deadlocked)"


# =============================================================================================
# 5. held() (backend selection's lock): a Ctrl-C as its acquire returns
# =============================================================================================
def _selection_sweep() -> list:
    lock_file = os.path.abspath(_locks.__file__)
    sites = {(lock_file, "__enter__"), (lock_file, "acquire"), (lock_file, "acquire_into")}
    points = []
    for n in range(1, 40):
        _backends.reset()
        inj = _Inject(n, sites)
        try:
            with inj:
                _backends.select()
        except KeyboardInterrupt:
            pass
        held = _backends._lock.locked()
        if held:
            _backends._lock.release()       # (the next point starts clean)
        points.append((n, inj.site, held))
        if inj.site is None:
            break
    return points


def test_guard_the_selection_sweep_reaches_held(monkeypatch):
    use_sim(monkeypatch, "cuda")
    points = _selection_sweep()
    assert points[-1][1] is None and len(points) >= 3
    # (held.__enter__ takes through acquire_into since session 30; it called acquire() before)
    assert any(site and site.endswith(("acquire", "acquire_into")) for _, site, _ in points)


# (r70g found; fixed in session 30)
def test_ctrl_c_in_backend_selection_leaves_no_lock_held(monkeypatch):
    use_sim(monkeypatch, "cuda")
    points = _selection_sweep()
    assert points[-1][1] is None
    bad = [f"point {n} ({site}): backends._lock left held" for n, site, held in points if held]
    assert not bad, "\n".join(bad)


# =============================================================================================
# 6. seeding before initialization: torch's queue, with a query or a generator call in between
# =============================================================================================
_S1 = struct.pack("<Qq", 1234, 40)


def _torch_states(monkeypatch, calls, count=2):
    """``calls`` through torch.cuda.random's own functions on the CPU wheel: queued by
    ``_lazy_call`` until a query (get_rng_state, initial_seed), which initializes: the queue runs
    in ``_lazy_init``'s order (plain calls, then the seed tracker's) and later calls run at once.
    Final states of model generators (as tests/test_torch_ports_r70b.py)."""
    torch = pytest.importorskip("torch")
    import torch.cuda as tcuda
    import torch.cuda.random as tcuda_random
    from test_torch_ports_r70b import _ModelGenerator
    gens = [_ModelGenerator() for _ in range(count)]
    monkeypatch.setattr(tcuda, "_queued_calls", [])
    monkeypatch.setattr(tcuda, "_lazy_seed_tracker", tcuda._LazySeedTracker())
    monkeypatch.setattr(tcuda, "_initialized", False)
    monkeypatch.setattr(tcuda, "_is_in_bad_fork", lambda: False)
    monkeypatch.setattr(tcuda, "default_generators", tuple(gens), raising=False)
    monkeypatch.setattr(tcuda_random, "device_count", lambda: count)
    monkeypatch.setattr(tcuda_random, "current_device", lambda: 0)

    def init():
        if tcuda._initialized:
            return
        queue = list(tcuda._queued_calls) + [c for c in tcuda._lazy_seed_tracker.get_calls() if c]
        for callback, _traceback in queue:
            callback()
        tcuda._initialized = True

    monkeypatch.setattr(tcuda_random, "_lazy_init", init)
    monkeypatch.setattr(tcuda_random, "is_initialized", lambda: tcuda._initialized)
    for name, args in calls:
        if name == "set_rng_state":
            state, device = args
            tensor = torch.from_numpy(np.frombuffer(state, np.uint8).copy())
            tcuda_random.set_rng_state(tensor) if device is None else tcuda_random.set_rng_state(tensor, device)
        elif name == "get_rng_state":
            init()          # (torch's get_rng_state: _lazy_init, then the read)
        elif name == "initial_seed":
            tcuda_random.initial_seed()
        else:
            getattr(tcuda_random, name)(*args)
    init()
    return [g.state() for g in gens]


def _accel_states(monkeypatch, calls):
    use_sim(monkeypatch, "cuda")
    for name, args in calls:
        if name == "set_rng_state":
            state, device = args
            R.set_rng_state(np.frombuffer(state, np.uint8).copy(), device)
        elif name == "get_rng_state":
            R.get_rng_state(*args)
        else:
            getattr(R, name)(*args)
    assert not accel.is_initialized()
    return [bytes(s) for s in R.get_rng_state_all()]


@pytest.mark.parametrize("calls", [
    pytest.param([("manual_seed", (5,)), ("set_rng_state", (_S1, None))], id="no-query"),
    pytest.param([("get_rng_state", (0,)), ("set_rng_state", (_S1, 0)), ("manual_seed", (5,))],
                 id="query-set-seed"),
])
def test_guard_seeding_before_init_as_torch(monkeypatch, calls):
    assert _accel_states(monkeypatch, calls) == _torch_states(monkeypatch, calls)


# (r70g found; fixed by 190b6e6 while this review ran: _queried_once)
@pytest.mark.parametrize("calls", [
    pytest.param([("get_rng_state", (0,)), ("manual_seed", (5,)), ("set_rng_state", (_S1, None))],
                 id="query-seed-set"),
    pytest.param([("initial_seed", ()), ("manual_seed_all", (7,)), ("set_rng_state", (_S1, 1))],
                 id="initial_seed-seed_all-set"),
])
def test_seeding_after_a_query_lands_in_call_order_as_torch(monkeypatch, calls):
    """torch: the query initialized, so the later set_rng_state lands last (S1); accel seeded the
    device again after it (a query ended the tracking only until the next seed call)."""
    assert _accel_states(monkeypatch, calls) == _torch_states(monkeypatch, calls)


# (r70g found; fixed in session 30)
def test_set_rng_state_on_one_device_leaves_the_other_alone(monkeypatch):
    """Before initialization: manual_seed_all(7), device 1's default generator seeded 9 through
    the generator itself (read back: 9), then set_rng_state(S, 0): device 1 must still be 9
    (torch has no default generator before init; after it every call lands in order)."""
    use_sim(monkeypatch, "cuda")
    R.manual_seed_all(7)
    R.default_generator(1).manual_seed(9)
    assert R.default_generator(1).initial_seed() == 9
    R.set_rng_state(np.frombuffer(_S1, np.uint8).copy(), 0)
    assert R.default_generator(1).initial_seed() == 9


# (r70g found; fixed in session 30)
def test_a_seed_and_a_state_set_by_two_threads_before_init_end_as_torch(monkeypatch):
    """Thread T seeds 5 (manual_seed) while the main thread sets device 0's state S before
    initialization.  torch queues both under _initialization_lock and its _lazy_init runs the
    set_state, then the seed: device 0 ends seeded 5 in every interleaving.  Forced here: the main
    thread's set_rng_state runs between T's generator seed and T's tracking; accel ends at S."""
    use_sim(monkeypatch, "cuda")
    seeded, state_set = threading.Event(), threading.Event()
    real = R.Generator.manual_seed
    worker = []

    def manual_seed(self, seed):
        out = real(self, seed)
        if worker and threading.get_ident() == worker[0] and not seeded.is_set():
            seeded.set()
            state_set.wait(WAIT_S)
        return out

    monkeypatch.setattr(R.Generator, "manual_seed", manual_seed)

    def seed_five():
        worker.append(threading.get_ident())
        R.manual_seed(5)

    t = threading.Thread(target=seed_five, daemon=True)
    t.start()
    assert seeded.wait(WAIT_S)
    R.set_rng_state(np.frombuffer(_S1, np.uint8).copy(), 0)
    state_set.set()
    t.join(JOIN_S)
    assert not t.is_alive() and not accel.is_initialized()
    want = _torch_states(monkeypatch, [("set_rng_state", (_S1, 0)), ("manual_seed", (5,))])
    assert want[0] == struct.pack("<Qq", 5, 0)
    assert bytes(R.get_rng_state(0)) == want[0]


def _bad_fork_child_sets_state() -> int:
    # (the generators' reads, no query: torch's get_rng_state raises in this child, as accel's does since r71e)
    before0, before1 = bytes(R.default_generator(0).get_state()), bytes(R.default_generator(1).get_state())
    R.set_rng_state(np.frombuffer(_S1, np.uint8).copy(), 1)
    # torch queues it (is_initialized() is False in a bad fork) and never runs it (r73f, r75b)
    got1, got0 = bytes(R.default_generator(1).get_state()), bytes(R.default_generator(0).get_state())
    if got1 != before1:
        return 3
    if got0 != before0:
        return 4
    return 0


def test_guard_a_bad_fork_child_sets_a_state_after_a_query_in_the_parent(monkeypatch):
    """Guard of the test below: the same program with one query in the parent after its
    initialization (which ends the tracking): the child's set_rng_state is dropped (torch queues it
    for good), both devices stay."""
    use_sim(monkeypatch, "cuda")
    R.manual_seed_all(7)
    R.uniform_(accel.Buffer(4 * KiB))       # initializes, advances device 0's offset
    R.get_rng_state(0)
    assert run_forked(_bad_fork_child_sets_state, CHILD_S) == 0


# (r70g found; fixed in session 30)
def test_a_bad_fork_child_sets_a_state(monkeypatch):
    """Parent: manual_seed_all(7), then a fill (initializes; device 0's offset moves), fork.  The
    child sets device 1's state, which torch queues there and never runs (r73f): both devices keep
    the parent's states; accel seeded both 7 again (device 0's offset lost: status 4)."""
    use_sim(monkeypatch, "cuda")
    R.manual_seed_all(7)
    R.uniform_(accel.Buffer(4 * KiB))
    assert run_forked(_bad_fork_child_sets_state, CHILD_S) == 0


# =============================================================================================
# 7. accel._cuda_containers and the allocator variables
# =============================================================================================
def _cubin_with_symtab_entsize_0() -> bytes:
    elf = bytearray(64)
    elf[:4] = b"\x7fELF"
    struct.pack_into("<Q", elf, 0x28, 64)           # e_shoff
    struct.pack_into("<HH", elf, 0x3A, 64, 1)       # e_shentsize, e_shnum
    # one SHT_SYMTAB section: offset 0, size 24, link 0, sh_entsize 0
    return bytes(elf) + struct.pack("<IIQQQQIIQQ", 0, 2, 0, 0, 0, 24, 0, 0, 0, 0)


# (r70g found; fixed in session 30)
def test_a_cubin_whose_symbol_table_has_entsize_0_is_a_container_error():
    image = _cubin_with_symtab_entsize_0()
    with pytest.raises(_cuda_containers.ContainerError):
        _cuda_containers.elf_entries(image)
    assert _module._image_info(image, "cubin") == ({}, {})


# (r70g found; fixed in session 30)
def test_pytorch_hip_alloc_conf_is_read_before_pytorch_alloc_conf(monkeypatch):
    use_sim(monkeypatch, "cuda", PYTORCH_HIP_ALLOC_CONF="max_split_size_mb:30",
            PYTORCH_ALLOC_CONF="max_split_size_mb:40")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert accel.memory.get_allocator_settings() == "max_split_size_mb:30"
