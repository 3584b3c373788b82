"""Adversarial tests (r49) of ``accel.memory.set_allocator_settings`` (torch's
``torch._C._accelerator_setAllocatorSettings``): the caching allocator's options changed while
the program runs, with memory live, pending, in MemPools and in graph private pools.

* a seeded random workload on every simulator, device 1 (not the current one) and device 0,
  switching expandable_segments / max_split_size_mb / roundup_power2_divisions /
  garbage_collection_threshold / release_threshold / per_process_memory_fraction between
  every operation; after each step the allocator's full invariants (test_alloc_stress's
  checker), torch's memory_stats-vs-memory_snapshot rule, the oversize counters against the
  live blocks and no negative ``.current`` stat; at the end everything goes back (reserved 0);
* blocks kept pending (record_stream on a held stream) across changes;
* changes during a stream capture (native and ``backend:cudaMallocAsync``);
* ``backend:cudaMallocAsync``: the fraction named or not;
* threads switching settings while others allocate, free, collect garbage and empty the cache;
  a finalizer (Buffer freed by the collector) running while set_config holds the lock;
* a KeyboardInterrupt inside set_allocator_settings (the injection of test_interrupt_allocator);
* bad input: non-str, huge, unicode, whitespace torch skips, repeated keys, expandable segments
  on MPS (no virtual memory).
"""

from __future__ import annotations

import gc
import os
import random
import threading

import pytest

import accel
from accel import _lazy, memory
from accel._errors import AllocatorConfigError, OutOfMemoryError
from accel.memory import _async, _caching, _config, _expandable

from conftest import THOROUGH, run_forked, use_sim
from test_alloc_stress import _check_async, _check_caching
from test_interrupt_allocator import _Inject
from torch_port_util import expected_memory_stats, held

MiB = 1 << 20

#: settings the workloads switch between (each is valid on every backend)
SETTINGS = (
    "", "expandable_segments:True", "expandable_segments:False", "max_split_size_mb:20",
    "max_split_size_mb:40,expandable_segments:True", "roundup_power2_divisions:4",
    "roundup_power2_divisions:[64:8,128:2,>:1]", "garbage_collection_threshold:0.5",
    "release_threshold:0", "release_threshold:8M,expandable_segments:False",
    "garbage_collection_threshold:0.9,max_split_size_mb:25,expandable_segments:True",
    "per_process_memory_fraction:0.5", "per_process_memory_fraction:1.0",
    "max_non_split_rounding_mb:20", "max_non_split_rounding_mb:100,max_split_size_mb:20",
)


def _device(kind: str, want: int) -> int:
    """``want`` where the simulator has that many devices (Metal has one)."""
    return want if accel.device_count() > want else 0


def check(dev: int) -> None:
    """Everything that must hold after any operation on ``dev``'s allocator."""
    alloc = memory.device_allocator(dev)
    assert not alloc._lock.locked(), "the allocator's lock was left held"
    if isinstance(alloc, _caching.DeviceCachingAllocator):
        _check_caching(alloc)
        snap = alloc.snapshot()
        expected = expected_memory_stats(snap["segments"])[dev]
        stats = alloc.stats()
        for key, value in expected.items():
            assert stats[key] == value, (key, stats[key], value)
        limit = alloc._max_split
        assert limit == alloc.config.max_split_size
        assert alloc._pow2 == any(d > 1 for d in alloc.config.roundup_power2_divisions)
        assert alloc._release_threshold == alloc.config.release_threshold
        over = sum(1 for b in alloc._blocks.values() if b.state == _caching._ALLOCATED and b.size >= limit)
        assert stats["oversize_allocations.current"] == over, \
            f"oversize_allocations.current {stats['oversize_allocations.current']}, {over} live blocks >= {limit}"
        over_seg = sum(1 for n in alloc._segments.values() if n >= limit)
        assert stats["oversize_segments.current"] == over_seg, \
            f"oversize_segments.current {stats['oversize_segments.current']}, {over_seg} segments >= {limit}"
    else:
        _check_async(alloc)
    negative = {k: v for k, v in memory.memory_stats(dev).items() if k.endswith(".current") and v < 0}
    assert not negative, negative


def _all_back(dev: int) -> None:
    gc.collect()
    accel.synchronize(dev)
    memory.empty_cache()
    check(dev)
    assert memory.memory_reserved(dev) == 0
    stats = memory.memory_stats(dev)
    assert stats["allocated_bytes.all.current"] == 0
    assert stats.get("allocation.all.current", 0) == 0


# ------------------------------------------------------------------------------ random workload
#: sizes a training loop repeats (the allocator memoizes per request size)
MENU = (700, 100000, MiB, 3 * MiB + 5, 5 * MiB + 7, 21 * MiB, 33 * MiB + 1, 50 * MiB)


def _workload(dev: int, seed: int, steps: int, graphs: bool, repeated: bool = False) -> None:
    rng = random.Random(seed)
    streams = [accel.current_stream(dev), accel.Stream(dev), accel.Stream(dev)]
    side = accel.Stream(dev)         # the capture stream
    live = []
    keep_graphs = []
    pool = None
    log = []
    for step in range(steps):
        op = rng.random()
        try:
            if op < 0.33:
                n = rng.choice([rng.randrange(1, MiB), rng.randrange(MiB, 12 * MiB), rng.randrange(12 * MiB, 60 * MiB)])
                if repeated and rng.random() < 0.7:
                    n = rng.choice(MENU)
                s = rng.choice(streams)
                log.append(("alloc", n))
                if pool is not None and rng.random() < 0.5:
                    with memory.use_mem_pool(pool, dev):
                        live.append(accel.Buffer(n, device=dev, stream=s))
                else:
                    live.append(accel.Buffer(n, device=dev, stream=s))
            elif op < 0.52 and live:
                buf = live.pop(rng.randrange(len(live)))
                if rng.random() < 0.4:
                    log.append(("record_stream+free",))
                    buf.record_stream(rng.choice(streams))
                else:
                    log.append(("free",))
                buf.close()
            elif op < 0.76:
                setting = rng.choice(SETTINGS)
                log.append(("set", setting))
                memory.set_allocator_settings(setting)
            elif op < 0.80:
                log.append(("empty_cache",))
                memory.empty_cache()
            elif op < 0.84:
                log.append(("synchronize",))
                accel.synchronize(dev)
            elif op < 0.90:
                if pool is None:
                    log.append(("mempool",))
                    with accel.device_index(dev):
                        pool = memory.MemPool()
                else:
                    log.append(("drop mempool",))
                    pool = None
                    gc.collect()
            elif graphs:
                if keep_graphs and rng.random() < 0.5:
                    log.append(("drop graph",))
                    g, outs = keep_graphs.pop(0)
                    g.replay()
                    for o in outs:
                        o.close()
                    del g
                    gc.collect()
                else:
                    log.append(("capture",))
                    with accel.device_index(dev):
                        g = accel.Graph()
                        outs = []
                        with side, g:
                            for _ in range(rng.randrange(1, 4)):
                                memory.set_allocator_settings(rng.choice(SETTINGS))
                                t = accel.Buffer(rng.choice([700, 3 * MiB, 30 * MiB]), stream=side)
                                t.fill_(1)
                                if rng.random() < 0.5:
                                    t.close()          # freed inside the capture: its pool reuses it
                                else:
                                    outs.append(t)
                        keep_graphs.append((g, outs))
        except OutOfMemoryError:
            log.append(("oom",))
        try:
            check(dev)
        except AssertionError as exc:
            raise AssertionError(f"step {step} after {log[-6:]}: {exc}") from exc
    for g, outs in keep_graphs:
        for o in outs:
            o.close()
    for buf in live:
        buf.close()
    del live, keep_graphs, pool
    memory.set_allocator_settings("")


# Found here and fixed: malloc's packed-stat memo (_FreeList.alloc_deltas, keyed by the request's
# nbytes) and a whole free segment's block.undo assumed nbytes always rounds to the same size; after
# a roundup_power2_divisions change the next request of a size seen before was counted at its old
# rounding ('assert 5243392 == 6291456'): set_config now drops both when the divisions change.


@pytest.mark.usefixtures("frozen_heap")         # the workload's gc.collect()s scan only its own objects
@pytest.mark.parametrize("want", [1, 0], ids=["device1", "device0"])
@pytest.mark.parametrize("seed", [1, 2])
def test_settings_switched_between_every_operation(sim_backend, want, seed):
    dev = _device(sim_backend, want)
    # default: the first 55 steps of each run (12 cases still switch settings between allocs, frees,
    # pools, captures); THOROUGH: 160
    _workload(dev, seed * 31 + want, 160 if THOROUGH else 55, graphs=sim_backend != "mps")
    _all_back(dev)



@pytest.mark.usefixtures("frozen_heap")
@pytest.mark.parametrize("want", [1, 0], ids=["device1", "device0"])
def test_settings_switched_with_repeated_sizes(sim_backend, want):
    """The workload above with the sizes a training loop repeats."""
    dev = _device(sim_backend, want)
    # default: the first 130 steps (sizes still repeat under changed roundings); THOROUGH: 400
    _workload(dev, 5 + want, 400 if THOROUGH else 130, graphs=sim_backend != "mps", repeated=True)
    _all_back(dev)



@pytest.mark.parametrize("expandable", ["True", "False"])
@pytest.mark.parametrize("path", ["whole_segment", "split_segment"])
@pytest.mark.parametrize("dev", [1, 0], ids=["device1", "device0"])
def test_a_size_seen_before_is_counted_at_its_new_rounding(sim_cuda, dev, path, expandable):
    """roundup_power2_divisions:4 turned on between two requests of 5 MiB + 7 bytes: the second
    block is 6 MiB, and memory_stats must count 6 MiB (memory_snapshot does)."""
    memory.set_allocator_settings(f"expandable_segments:{expandable}")
    big = accel.Buffer(40 * MiB, device=dev)
    big.close()
    head = accel.Buffer(2 * MiB, device=dev) if path == "split_segment" else None   # the rest has a prev
    first = accel.Buffer(5 * MiB + 7, device=dev)
    first.close()
    memory.set_allocator_settings(f"expandable_segments:{expandable},roundup_power2_divisions:4")
    second = accel.Buffer(5 * MiB + 7, device=dev)
    assert memory.device_allocator(dev)._blocks[second.ptr].size == 6 * MiB
    try:
        stats = memory.memory_stats(dev)
        expected = expected_memory_stats(memory.memory_snapshot())[dev]
        for key in ("allocated_bytes.all.current", "active_bytes.all.current", "allocated_bytes.large_pool.current",
                    "inactive_split_bytes.all.current"):
            assert stats[key] == expected[key], (key, stats[key], expected[key])
        check(dev)
    finally:
        second.close()
        if head is not None:
            head.close()
    _all_back(dev)


@pytest.mark.parametrize("base", ["policy:torch", "max_split_size_mb:30,release_threshold:0",
                                  "expandable_segments:False,garbage_collection_threshold:0.7"])
def test_settings_switched_from_a_configured_start(monkeypatch, base):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF=base)
    _workload(1, 7, 140, graphs=True)
    _all_back(1)


def test_pending_blocks_kept_across_changes(monkeypatch):
    """Blocks freed while a held stream still uses them stay pending through every kind of
    change; oversize counting, the free lists and the stats stay right when they complete."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=20)
    dev = 1
    # a high-water mark above what the test reserves: release-before-grow frees no segment (a
    # cudaFree waits for the held stream, as the hardware's)
    accel.Buffer(600 * MiB, device=dev).close()
    memory.empty_cache()
    with accel.device_index(dev):
        other = accel.Stream()
        with held(other):
            bufs = [accel.Buffer(n, device=dev) for n in (50 * MiB, 30 * MiB, 3 * MiB, 700)]
            memory.set_allocator_settings("max_split_size_mb:40,expandable_segments:False")
            bufs += [accel.Buffer(n, device=dev) for n in (60 * MiB, 5 * MiB)]
            pending = [(b.ptr, b.nbytes) for b in bufs]
            for buf in bufs:
                buf.record_stream(other)
                buf.close()
            check(dev)
            assert memory.memory_stats(dev)["active.all.current"] == len(bufs)    # all pending
            # (no release_threshold here: the free that returns a segment calls cudaFree, which
            # waits for the held stream, as the hardware's)
            for setting in ("", "max_split_size_mb:20,roundup_power2_divisions:4", "expandable_segments:True",
                            "garbage_collection_threshold:0.5,max_split_size_mb:45", "expandable_segments:False"):
                memory.set_allocator_settings(setting)
                check(dev)
                fresh = accel.Buffer(45 * MiB, device=dev)      # may not take a pending block
                assert all(fresh.ptr + fresh.nbytes <= p or p + n <= fresh.ptr for p, n in pending)
                assert memory.memory_stats(dev)["active.all.current"] == len(bufs) + 1    # still pending
                fresh.close()
                check(dev)
        accel.synchronize(dev)
    _all_back(dev)


# ------------------------------------------------------------------------------ capture
def _capture_with_changes(settings):
    """Allocations on a capturing stream (the graph's private pool), one change before each."""
    dev = 1
    with accel.device_index(dev):
        s = accel.Stream()
        before = accel.Buffer(3 * MiB, stream=s)
        g = accel.Graph()
        outs = []
        with s, g:
            before.fill_(1)
            for setting in settings:
                memory.set_allocator_settings(setting)
                check(dev)
                out = accel.Buffer(5 * MiB + 7, stream=s)
                out.fill_(2)
                outs.append(out)
                tmp = accel.Buffer(30 * MiB, stream=s)
                tmp.fill_(3)
                tmp.close()
        g.replay()
        accel.synchronize()
        for out in outs:
            out.close()
        before.close()
        del g
    check(dev)
    _all_back(dev)


CAPTURE_SETTINGS = ("expandable_segments:True", "max_split_size_mb:20", "expandable_segments:False",
                    "per_process_memory_fraction:0.5", "garbage_collection_threshold:0.5", "release_threshold:0", "")


def test_settings_changed_during_a_capture(sim_graph_backend):
    """torch applies a change made while a stream is captured (setAllocatorSettings only parses
    into the config its allocator reads at each call); accel too: the capture goes on, its
    private pool stays consistent, and the graph replays."""
    _capture_with_changes(CAPTURE_SETTINGS)
    assert memory.get_per_process_memory_fraction(1) == 0.5



def test_roundup_changed_during_a_capture(sim_graph_backend):
    """The same with roundup_power2_divisions turned on and off between the graph's allocations
    of one size: the private pool's counters stay right (the memo note above)."""
    _capture_with_changes(("roundup_power2_divisions:4", "", "roundup_power2_divisions:4", ""))


def test_settings_changed_during_a_capture_async_backend(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="backend:cudaMallocAsync")
    dev = 1
    with accel.device_index(dev):
        s = accel.Stream()
        g = accel.Graph()
        with s, g:
            memory.set_allocator_settings("per_process_memory_fraction:0.5")
            out = accel.Buffer(5 * MiB, stream=s)
            out.fill_(2)
            memory.set_allocator_settings("garbage_collection_threshold:0.5")
        g.replay()
        accel.synchronize()
        assert memory.get_per_process_memory_fraction(dev) == 0.5
        out.close()
        del g
    _all_back(dev)


# ------------------------------------------------------------------------------ cudaMallocAsync
def test_async_backend_fraction_named_or_not(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="backend:cudaMallocAsync")
    dev = 1
    _, total = memory.get_memory_info(dev)
    for setting in ("expandable_segments:True", "max_split_size_mb:40", "release_threshold:0",
                    "roundup_power2_divisions:4", "backend:cudaMallocAsync"):
        memory.set_allocator_settings(setting)          # accepted; only the fraction acts
        assert memory.device_allocator(dev).config.backend == "cudaMallocAsync"
    with pytest.raises(AllocatorConfigError, match="cannot change"):
        memory.set_allocator_settings("backend:native")
    memory.set_allocator_settings("per_process_memory_fraction:0.25")
    assert [memory.get_per_process_memory_fraction(d) for d in (0, 1)] == [0.25, 0.25]
    with pytest.raises(OutOfMemoryError):
        accel.Buffer(int(total * 0.3), device=dev)
    memory.set_allocator_settings("garbage_collection_threshold:0.5")        # not named: kept
    assert memory.get_per_process_memory_fraction(dev) == 0.25
    held_buf = accel.Buffer(int(total * 0.2), device=dev)
    memory.set_allocator_settings("per_process_memory_fraction:0.1")           # below what is held
    with pytest.raises(OutOfMemoryError):
        accel.Buffer(MiB, device=dev)
    held_buf.close()
    memory.set_allocator_settings("per_process_memory_fraction:1.0")
    accel.Buffer(int(total * 0.5), device=dev).close()
    check(dev)
    _all_back(dev)


# ------------------------------------------------------------------------------ threads
@pytest.mark.parametrize("conf", [None, "backend:cudaMallocAsync", "policy:torch"])
def test_switching_while_threads_allocate_collect_and_empty(sim_backend, monkeypatch, conf):
    if conf == "backend:cudaMallocAsync" and sim_backend != "cuda":
        pytest.skip("the stream-ordered pool backend is CUDA's")
    if conf:
        use_sim(monkeypatch, sim_backend, ACCEL_ALLOC_CONF=conf)
    dev = _device(sim_backend, 1)
    settings = ([s for s in SETTINGS if "expandable" in s or "max_split" in s or "fraction" in s]
                if conf != "backend:cudaMallocAsync" else
                ["", "per_process_memory_fraction:0.6", "per_process_memory_fraction:1.0"])
    stop = threading.Event()
    errors = []

    class Cycle:          # garbage only the collector frees: Buffer.__del__ under gc
        def __init__(self, n):
            self.buf = accel.Buffer(n, device=dev)
            self.me = self

    def worker(seed):
        rng = random.Random(seed)
        try:
            s = accel.Stream(dev)
            while not stop.is_set():
                bufs = []
                for _ in range(6):
                    n = rng.choice([100, 300000, 3 * MiB, 25 * MiB, 70 * MiB])
                    try:
                        if rng.random() < 0.3:
                            Cycle(n)
                        else:
                            bufs.append(accel.Buffer(n, device=dev, stream=s if rng.random() < 0.5 else None))
                    except OutOfMemoryError:
                        pass
                for buf in bufs:
                    if rng.random() < 0.3:
                        buf.record_stream(accel.current_stream(dev))
                    buf.close()
                if rng.random() < 0.2:
                    gc.collect()
        except BaseException as exc:          # noqa: BLE001
            errors.append(exc)

    def emptier():
        try:
            while not stop.is_set():
                memory.empty_cache()
        except BaseException as exc:          # noqa: BLE001
            errors.append(exc)

    threshold = gc.get_threshold()
    gc.set_threshold(50, 5, 5)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)] + [threading.Thread(target=emptier)]
    for t in threads:
        t.start()
    try:
        for i in range(150):
            memory.set_allocator_settings(settings[i % len(settings)])
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        gc.set_threshold(*threshold)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert errors == []
    memory.set_allocator_settings("")
    _all_back(dev)


@pytest.mark.parametrize("conf", [None, "backend:cudaMallocAsync"])
def test_a_finalizer_while_set_config_holds_the_lock(monkeypatch, conf):
    """The collector frees a Buffer (its __del__) while set_config holds the allocator's lock
    on the same thread: no deadlock, the free is deferred and done later."""
    use_sim(monkeypatch, "cuda", **({"ACCEL_ALLOC_CONF": conf} if conf else {}))

    def child():
        dev = 1
        alloc = memory.device_allocator(dev)
        keep = accel.Buffer(50 * MiB, device=dev)
        hits = []

        class Cycle:
            def __init__(self, n):
                self.buf = accel.Buffer(n, device=dev)
                self.me = self

        lock = alloc._lock

        class CollectingLock:        # collects garbage right after the allocator's lock is taken
            def __enter__(self):
                lock.acquire()
                if not hits:
                    hits.append(1)
                    gc.collect()

            def __exit__(self, *exc):
                lock.release()

            def acquire(self, *a):
                return lock.acquire(*a)

            def release(self):
                lock.release()

            def locked(self):
                return lock.locked()

            def _is_owned(self):      # (the allocator's lock is an RLock: _gc_probe asks who holds it)
                return lock._is_owned()

        gc.disable()
        Cycle(3 * MiB)
        Cycle(100)
        alloc._lock = CollectingLock()
        try:
            memory.set_allocator_settings("max_split_size_mb:40,per_process_memory_fraction:0.9")
        finally:
            alloc._lock = lock
            gc.enable()
        assert hits == [1]
        keep.close()
        memory.set_allocator_settings("")
        _all_back(dev)
        return 0

    assert run_forked(child, timeout=60, hung="deadlock: a finalizer while set_config held the lock") == 0


@pytest.mark.parametrize("dev", [1, 0], ids=["device1", "device0"])
def test_a_fraction_set_meanwhile_by_another_thread_is_kept(sim_cuda, dev):
    alloc = memory.device_allocator(dev)
    real = type(alloc).set_config

    def other_thread_lands_here(self, config, keep_fraction=False):
        if self.device_index == dev:
            t = threading.Thread(target=memory.set_per_process_memory_fraction, args=(0.3, dev))
            t.start()
            t.join()
        return real(self, config, keep_fraction)

    type(alloc).set_config = other_thread_lands_here
    try:
        memory.set_allocator_settings("garbage_collection_threshold:0.5")     # names no fraction
    finally:
        type(alloc).set_config = real
    assert memory.get_per_process_memory_fraction(dev) == 0.3


# ------------------------------------------------------------------------------ KeyboardInterrupt
_TARGETS = {os.path.abspath(m.__file__) for m in (_caching, _expandable, _config, memory, _async)}
OLD = "max_split_size_mb:40,expandable_segments:False,release_threshold:0"
NEW = "expandable_segments:True,roundup_power2_divisions:4,garbage_collection_threshold:0.5"


def _whole(allocs) -> list:
    """What is wrong with the allocators after an interrupted change: each must hold the old
    or the new settings entirely (its cached attributes, its oversize counters), all the same
    ones, and get_allocator_settings must name them."""
    problems = []
    for alloc in allocs:
        try:
            check(alloc.device_index)
        except AssertionError as exc:
            problems.append(f"device {alloc.device_index}: {exc}")
        special = alloc._needs_special(alloc._pow2, alloc._max_split)
        if alloc._special != special:
            problems.append(f"device {alloc.device_index}: _special stale")
    texts = {a.config.text for a in allocs} | {memory.get_allocator_settings()}
    if len(texts) != 1:
        problems.append(f"devices and get_allocator_settings disagree: {sorted(texts)}")
    return problems


def _interrupted_run(k: int):
    _lazy._reset_for_tests()
    memory.set_allocator_settings(OLD)
    bufs = [accel.Buffer(n, device=d) for d in (1, 0) for n in (50 * MiB, 3 * MiB, 100)]
    allocs = [memory.device_allocator(d) for d in (0, 1)]
    inject = _Inject(k, _TARGETS)     # test_interrupt_allocator's injector over these files
    try:
        with inject:
            memory.set_allocator_settings(NEW)
        done = True
    except KeyboardInterrupt:
        done = False
    problems = _whole(allocs)
    for buf in bufs:
        buf.close()
    for alloc in allocs:
        negative = {key: v for key, v in alloc.stats().items() if key.endswith(".current") and v < 0}
        if negative:
            problems.append(f"device {alloc.device_index} after the frees: negative {negative}")
    return done, inject.site, problems


# Found here and fixed: set_allocator_settings was not all-or-none under a KeyboardInterrupt (the
# process options published before the loop over the devices; set_config stored its fields one by
# one, with calls between): set_config now computes first and publishes with _locks.publish, and
# set_allocator_settings rolls back the devices it changed.



def test_interrupt_at_the_oversize_recount_leaves_whole_settings(monkeypatch):
    """A KeyboardInterrupt as _oversize_counts starts (CPython checks for a signal when a
    Python function starts) on device 0: each allocator must keep the old or the new settings."""
    use_sim(monkeypatch, "cuda")
    memory.set_allocator_settings(OLD)
    bufs = [accel.Buffer(n, device=d) for d in (1, 0) for n in (50 * MiB, 3 * MiB)]
    allocs = [memory.device_allocator(d) for d in (0, 1)]
    real = _caching.DeviceCachingAllocator._oversize_counts

    def interrupted(self, limit):
        monkeypatch.setattr(_caching.DeviceCachingAllocator, "_oversize_counts", real)
        raise KeyboardInterrupt("as _oversize_counts starts")

    monkeypatch.setattr(_caching.DeviceCachingAllocator, "_oversize_counts", interrupted)
    with pytest.raises(KeyboardInterrupt):
        memory.set_allocator_settings(NEW)
    problems = _whole(allocs)
    for buf in bufs:
        buf.close()
    assert problems == []



def test_interrupt_between_the_devices_leaves_one_setting(monkeypatch):
    """A KeyboardInterrupt as device 1's set_config starts (device 0 done): the two devices and
    get_allocator_settings must agree (all old or all new)."""
    use_sim(monkeypatch, "cuda")
    memory.set_allocator_settings(OLD)
    allocs = [memory.device_allocator(d) for d in (0, 1)]
    real = _caching.DeviceCachingAllocator.set_config

    def second_interrupted(self, config, keep_fraction=False):
        if self.device_index == 1:
            raise KeyboardInterrupt("as device 1's set_config starts")
        return real(self, config, keep_fraction)

    monkeypatch.setattr(_caching.DeviceCachingAllocator, "set_config", second_interrupted)
    with pytest.raises(KeyboardInterrupt):
        memory.set_allocator_settings(NEW)
    monkeypatch.setattr(_caching.DeviceCachingAllocator, "set_config", real)
    assert _whole(allocs) == []



# a point may fall in a weakref callback the collector runs (printed as unraisable, as CPython does)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_interrupt_anywhere_in_set_allocator_settings(monkeypatch):
    """The sweep: a KeyboardInterrupt at every 3rd point where CPython can raise one inside
    set_allocator_settings (parsing, the publication, each allocator's set_config)."""
    use_sim(monkeypatch, "cuda")
    bad = []
    k = 1
    while True:
        done, site, problems = _interrupted_run(k)
        if problems:
            bad.append((k, site, problems[0]))
        if done:
            break
        k += 3
    assert k > 100, "the injection found too few points"
    assert bad == [], f"{len(bad)} interrupted runs left half-applied settings; first: {bad[:3]}"
    _lazy._reset_for_tests()


# ------------------------------------------------------------------------------ refused calls
def test_a_refused_call_changes_nothing_after_the_environment_changed(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="policy:torch")
    first = memory.device_allocator(0)
    monkeypatch.delenv("ACCEL_ALLOC_CONF")    # torch read it at the start: changing it later does nothing
    try:
        memory.set_allocator_settings("max_split_size_mb:40")
    except AllocatorConfigError:
        assert memory.get_allocator_settings() == "policy:torch"      # refused: nothing changed
        assert memory.device_allocator(1).config.policy == "torch"
    else:
        assert first.config.max_split_size == 40 * MiB
        assert memory.device_allocator(1).config.policy == "torch"


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("bad", [None, 40, 4.0, b"max_split_size_mb:40", bytearray(b""), ["max_split_size_mb:40"],
                                 {"max_split_size_mb": 40}])
def test_non_str_is_a_type_error_and_changes_nothing(sim_cuda, bad):
    memory.set_allocator_settings("max_split_size_mb:64")
    with pytest.raises(TypeError):
        memory.set_allocator_settings(bad)
    assert memory.get_allocator_settings() == "max_split_size_mb:64"
    assert memory.device_allocator(1).config.max_split_size == 64 * MiB


def test_a_str_subclass_is_a_str(sim_cuda):
    class Conf(str):
        pass

    memory.set_allocator_settings(Conf("max_split_size_mb:48"))
    assert memory.device_allocator(1).config.max_split_size == 48 * MiB
    assert memory.get_allocator_settings() == "max_split_size_mb:48"


@pytest.mark.parametrize("bad", ["max_split_size_mb:٤٠", "máx_split_size_mb:40", "expandable_segments:Ｔrue",
                                 "garbage_collection_threshold:nan",
                                 "garbage_collection_threshold:inf", "max_split_size_mb:99999999999999999999999",
                                 "max_split_size_mb::40", "max_split_size_mb:40:50", "max_split_size_mb",
                                 "roundup_power2_divisions:[64:8", "roundup_power2_divisions:64:8]"])
def test_unicode_and_malformed_are_refused_and_change_nothing(sim_cuda, bad):
    memory.set_allocator_settings("max_split_size_mb:64")
    before = memory.device_allocator(1).config
    with pytest.raises(AllocatorConfigError):
        memory.set_allocator_settings(bad)
    assert memory.get_allocator_settings() == "max_split_size_mb:64"
    assert memory.device_allocator(1).config == before


def test_nul_after_a_number_ends_it_as_in_torch(sim_cuda):
    """torch 2.13 reads ``max_split_size_mb:40\\x00`` as 40 (std::stoull stops at the NUL), and so
    does accel since session 38 (it refused it before)."""
    memory.set_allocator_settings("max_split_size_mb:40\x00")
    assert memory.device_allocator(1).config.max_split_size == 40 * MiB


def test_huge_strings(sim_cuda):
    """A megabyte of options is parsed (the last of repeated keys wins, as in torch's parser,
    which assigns each in turn); a megabyte-long unknown key is refused."""
    many = ",".join(["max_split_size_mb:40", "garbage_collection_threshold:0.5"] * 25000 + ["max_split_size_mb:60"])
    memory.set_allocator_settings(many)
    config = memory.device_allocator(1).config
    assert config.max_split_size == 60 * MiB and config.garbage_collection_threshold == 0.5
    assert memory.get_allocator_settings() == many
    with pytest.raises(AllocatorConfigError):
        memory.set_allocator_settings("x" * (1 << 20) + ":1")
    assert memory.get_allocator_settings() == many


def test_repeated_keys_last_wins_and_empty_items(sim_cuda):
    memory.set_allocator_settings("max_split_size_mb:40,max_split_size_mb:60,expandable_segments:True,"
                                  "expandable_segments:False,")
    config = memory.device_allocator(1).config
    assert config.max_split_size == 60 * MiB and config.expandable_segments is False
    # an empty option between two is refused as torch's CUDA parser does ("Unrecognized key ','";
    # since session 38, r78g), and changes nothing
    with pytest.raises(AllocatorConfigError, match="empty option"):
        memory.set_allocator_settings("max_split_size_mb:40,,expandable_segments:True")
    assert memory.device_allocator(1).config == config
    memory.set_allocator_settings("  max_split_size_mb : 40 ")                  # spaces: skipped
    assert memory.device_allocator(1).config.max_split_size == 40 * MiB
    memory.set_allocator_settings("   ")                                         # nothing named
    assert memory.device_allocator(1).config.max_split_size == _config.UNLIMITED


@pytest.mark.parametrize("text", ["max_split_size_mb:40,\nexpandable_segments:False", "\tmax_split_size_mb:40",
                                  "expandable_segments:False\r\n", "max_split_size_mb:4\t0",
                                  "max_split_size_mb:40,\x0bexpandable_segments:False\x0c"])
def test_whitespace_torch_skips(monkeypatch, text):
    """torch.cuda.memory._set_allocator_settings accepts these (checked with torch 2.13's
    parser, torch._C._accelerator_setAllocatorSettings): 40 MiB, expandable segments off."""
    use_sim(monkeypatch, "cuda")
    memory.set_allocator_settings(text)
    config = memory.device_allocator(1).config
    assert config.max_split_size == 40 * MiB or "max_split" not in text
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF=text)
    assert memory.device_allocator(1).config.max_split_size == 40 * MiB or "max_split" not in text


def test_expandable_segments_on_mps_without_virtual_memory(monkeypatch):
    """Metal has no virtual memory API: expandable_segments:True is accepted (as torch accepts
    options its MPS allocator ignores) and every segment stays classic."""
    use_sim(monkeypatch, "mps")
    a = accel.Buffer(8 * MiB)
    memory.set_allocator_settings("expandable_segments:True")
    b = accel.Buffer(30 * MiB)
    memory.set_allocator_settings("expandable_segments:True,max_split_size_mb:20")
    c = accel.Buffer(700)
    assert {s["is_expandable"] for s in memory.memory_snapshot()} == {False}
    check(0)
    memory.set_allocator_settings("expandable_segments:False")
    for buf in (a, b, c):
        buf.close()
    _all_back(0)
