"""r64c: the concrete claims of the public docstrings of accel.memory (the torch.accelerator.memory
queries, the allocator settings, the history recorder, MemPool / use_mem_pool, the pinned host
allocator's statistics) and accel.random (the seeding functions, the RNG state, the fills and
Generator), checked against what the code does on the simulators.

Each test quotes the claims it checks: errors first, and that a refused call changes nothing
(no runtime initialized, no option, offset or seed changed); then numbers (units, rounding,
defaults).  Device 1 is named while device 0 is current wherever a device is named; every
simulator runs the backend-generic claims (Metal has one device: there device 0 stands in).
Claims checked by tests/test_docs_claims_r62i.py are not repeated.  The top-level, stream, event,
graph and interop claims are in tests/test_docstring_claims_r64c.py.
"""

from __future__ import annotations

import copy
import gc
import pickle
import struct
import threading
import warnings
from collections import OrderedDict

import numpy as np
import pytest

import accel
import accel.memory as M
import accel.random as R
from accel._errors import AllocatorConfigError
from accel.random import philox

from conftest import use_sim


@pytest.fixture(autouse=True)
def _default_allocator_options(monkeypatch):
    """The claims quoted here are about the default options (sizes, the option string): a rerun of
    the suite under ACCEL_TEST_ALLOC_CONF (tests/conftest.py) leaves these tests on the defaults."""
    for key in M._config.ENV_VARS:
        monkeypatch.delenv(key, raising=False)


def _dev1() -> int:
    """The highest device: 1 on CUDA and XPU (2 simulated devices), 0 on Metal (one)."""
    return accel.device_count() - 1


_QUERIES = (M.memory_stats, M.memory_allocated, M.max_memory_allocated, M.memory_reserved,
            M.max_memory_reserved, M.reset_peak_memory_stats, M.reset_accumulated_memory_stats)


# -- torch.accelerator.memory queries -------------------------------------------------------------
def test_queries_before_init_answer_without_initializing(sim_backend):
    """accel.memory: "none of them initializes the runtime: before initialization memory_stats()
    is an empty OrderedDict and the scalar queries return 0"; empty_cache: "No-op before
    initialization"; memory_summary: "Before init the table is empty and nothing is initialized";
    get_allocator_settings: "else ''" (no variable set); host_memory_stats: "An empty OrderedDict
    before the runtime is initialized"."""
    d = _dev1()
    stats = M.memory_stats(d)
    assert isinstance(stats, OrderedDict) and not stats
    for fn in (M.memory_allocated, M.max_memory_allocated, M.memory_reserved, M.max_memory_reserved):
        assert fn(d) == 0 and fn() == 0
    M.reset_peak_memory_stats(d)
    M.reset_accumulated_memory_stats(d)
    M.empty_cache()
    assert "memory summary" in M.memory_summary(d)
    assert M.memory_snapshot() == []
    assert M.get_allocator_settings() == ""
    stats = M.host_memory_stats()
    assert isinstance(stats, OrderedDict) and not stats
    assert not accel.is_initialized()


@pytest.mark.parametrize("bad, error", [(True, TypeError), (1.5, TypeError), ("cuda:x", accel.InvalidDeviceError),
                                        (-1, accel.InvalidDeviceError)])
def test_malformed_device_argument_raises_the_same_before_and_after_init(sim_backend, bad, error):
    """memory_stats: "An empty OrderedDict before the runtime is initialized (a malformed
    argument raises then too, see _form)"; _form: "a wrong type (TypeError), a malformed string
    or a negative index (InvalidDeviceError) ... the same mistake raises before init as after"."""
    for stage in ("before", "after"):
        for fn in _QUERIES:
            with pytest.raises(error):
                fn(bad)
        assert accel.is_initialized() == (stage == "after")
        accel.Buffer(8, device=_dev1())


def test_initializing_queries_refuse_a_bad_device_without_initializing(sim_backend):
    """get_memory_info: "initializes (not for a refused argument)"; get_per_process_memory_fraction:
    "Initializes the runtime, as torch's (not for a refused argument)";
    set_per_process_memory_fraction: "A refused argument initializes nothing"; memory_summary: "the
    argument is checked as after"."""
    past = accel.device_count()
    for call in (lambda: M.get_memory_info(past), lambda: M.get_per_process_memory_fraction(past),
                 lambda: M.set_per_process_memory_fraction(0.5, past), lambda: M.memory_summary(past)):
        with pytest.raises(accel.InvalidDeviceError, match="out of range"):
            call()
    with pytest.raises(TypeError, match="Invalid type for fraction argument"):
        M.set_per_process_memory_fraction(np.float32(0.5), 0)
    with pytest.raises(ValueError, match="Invalid fraction value"):
        M.set_per_process_memory_fraction(float("nan"), 0)
    assert not accel.is_initialized()
    assert M.get_per_process_memory_fraction(_dev1()) == 1.0
    assert accel.is_initialized()


def test_stats_of_device1_while_device0_is_current(sim_backend):
    """memory_stats: "torch 2.13's torch.cuda.memory_stats() keys, sorted: 123", "max_split_size (-1:
    unlimited)"; memory_allocated: "Bytes currently allocated (allocated_bytes.all.current)"
    (the block's rounded size, 512 for 100 bytes, as torch; requested_bytes keeps the 100);
    memory_reserved: "Bytes held by the caching allocator"; max_*: "Peak ... since start or the
    last reset_peak_memory_stats"; reset_peak_memory_stats: "Set every peak to the current value";
    empty_cache: "Return unused cached device memory of every device to the runtime".  All of
    device 1 while device 0 is current; device 0 is untouched."""
    d = _dev1()
    buf = accel.Buffer(100, device=d)
    stats = M.memory_stats(d)
    assert len(stats) == 123 and list(stats) == sorted(stats)
    assert stats["max_split_size"] == -1
    assert M.memory_allocated(d) == stats["allocated_bytes.all.current"] == 512
    assert stats["requested_bytes.all.current"] == 100
    assert M.memory_reserved(d) == stats["reserved_bytes.all.current"] >= 512
    if d:
        assert M.memory_allocated(0) == M.memory_reserved(0) == 0
    reserved = M.memory_reserved(d)
    buf.close()
    assert M.memory_allocated(d) == 0 and M.max_memory_allocated(d) == 512
    assert M.memory_reserved(d) == reserved
    M.reset_peak_memory_stats(d)
    assert M.max_memory_allocated(d) == 0 and M.max_memory_reserved(d) == reserved
    M.empty_cache()
    assert M.memory_reserved(d) == 0 and M.max_memory_reserved(d) == reserved
    peaks = {k: v for k, v in M.memory_stats(d).items() if k.endswith(".peak")}
    M.reset_peak_memory_stats(d)
    assert {k: v for k, v in M.memory_stats(d).items() if k.endswith(".peak")} == {
        k: M.memory_stats(d)[k[:-len(".peak")] + ".current"] for k in peaks}
    assert accel.current_device_index() == 0


def test_reset_accumulated_stats_zeroes_counters_not_current_values(sim_backend):
    """reset_accumulated_memory_stats: "Zero the allocated/freed counters and the retry/OOM/call
    counts" -- the current and peak values stay."""
    d = _dev1()
    keep = accel.Buffer(100, device=d)
    M.set_per_process_memory_fraction(0.0, d)
    with pytest.raises(accel.OutOfMemoryError):
        accel.Buffer(3 << 20, device=d)
    before = M.memory_stats(d)
    assert before["num_ooms"] == 1 and before["num_alloc_retries"] >= 1
    M.reset_accumulated_memory_stats(d)
    after = M.memory_stats(d)
    for key, value in after.items():
        if key.endswith((".allocated", ".freed")) or key in ("num_ooms", "num_alloc_retries",
                                                              "num_sync_all_streams", "num_device_alloc",
                                                              "num_device_free"):
            assert value == 0, key
        elif key.endswith((".current", ".peak")):
            assert value == before[key], key
    assert after["allocated_bytes.all.current"] == 512
    keep.close()


def test_get_memory_info_is_free_and_total_of_the_named_device(sim_backend):
    """get_memory_info: "(free, total) bytes of the device, as the runtime reports them" -- total
    is the device's total_memory, free no more than it; device 0 stays current."""
    d = _dev1()
    free, total = M.get_memory_info(d)
    assert total == accel.get_device_properties(d).total_memory and 0 < free <= total
    assert accel.current_device_index() == 0


# -- allocator settings ----------------------------------------------------------------------------
def test_fraction_is_per_device_and_survives_unrelated_settings(sim_backend):
    """set_per_process_memory_fraction: "Cap the caching allocator of device"; set_allocator_settings:
    "a device's own fraction ... stays unless named" (the comment, and "leaves every other option as
    it was unless it names it"); "per_process_memory_fraction, when named, caps every device"."""
    d = _dev1()
    M.set_per_process_memory_fraction(0.25, d)
    assert M.get_per_process_memory_fraction(d) == 0.25
    if d:
        assert M.get_per_process_memory_fraction(0) == 1.0
    M.set_allocator_settings("max_split_size_mb:64")
    assert M.get_per_process_memory_fraction(d) == 0.25
    M.set_allocator_settings("per_process_memory_fraction:0.5")
    assert [M.get_per_process_memory_fraction(i) for i in range(accel.device_count())] == \
        [0.5] * accel.device_count()


@pytest.mark.parametrize("settings", ["max_split_size_mb:128,bogus:1", "max_split_size_mb:128,garbage_collection_threshold:2",
                                      "max_split_size_mb:10", "expandable_segments:maybe"])
def test_refused_allocator_settings_change_nothing(sim_backend, settings):
    """set_allocator_settings: "AllocatorConfigError (a ValueError and RuntimeError) for an unknown
    option, a bad value or a change of a fixed one ... A refused call changes nothing" -- neither
    the option string nor a device's options, even when its first option was good."""
    d = _dev1()
    M.set_allocator_settings("max_split_size_mb:64")
    accel.Buffer(8, device=d)
    with pytest.raises(AllocatorConfigError) as info:
        M.set_allocator_settings(settings)
    assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)
    assert M.get_allocator_settings() == "max_split_size_mb:64"
    assert M.memory_stats(d)["max_split_size"] == 64 << 20


def test_settings_before_init_start_nothing_and_apply_at_first_use(sim_backend):
    """set_allocator_settings: "The runtime is not initialized: called before it starts, the
    options are those every allocator starts with"; get_allocator_settings: "The option string
    last given"."""
    M.set_allocator_settings("max_split_size_mb:32")
    assert not accel.is_initialized()
    assert M.get_allocator_settings() == "max_split_size_mb:32"
    accel.Buffer(8, device=_dev1())
    assert M.memory_stats(_dev1())["max_split_size"] == 32 << 20


def test_allocator_entry_points_refuse_wrong_types(sim_backend):
    """device_allocator: "ValueError for an index that names no device" (and a non-int is a
    TypeError: True would be device 1); memory_snapshot(mempool_id): a pool id "tuple of two
    ints"; attach_out_of_memory_observer takes a callable; detach_out_of_memory_observer:
    "ValueError when it is not attached"; set_allocator_settings: "TypeError for a non-str"."""
    with pytest.raises(TypeError):
        M.device_allocator(True)
    with pytest.raises(ValueError, match="out of range"):
        M.device_allocator(accel.device_count())
    with pytest.raises(TypeError, match="pool id"):
        M.memory_snapshot(mempool_id="xy")
    with pytest.raises(TypeError, match="observer must be callable"):
        M.attach_out_of_memory_observer(5)
    with pytest.raises(ValueError, match="not attached"):
        M.detach_out_of_memory_observer(print)
    with pytest.raises(TypeError):
        M.set_allocator_settings(b"max_split_size_mb:64")
    assert M.get_allocator_settings() == ""


# -- history ---------------------------------------------------------------------------------------
def _alloc_here(d):
    return accel.Buffer(100, device=d)


def _free_here(buf):
    buf.close()


def _trace(d, **options):
    """Record with ``options`` while four buffers are made (in _alloc_here) and freed (in
    _free_here); device d's trace, then recording stops."""
    M.record_history(**options)
    try:
        bufs = [_alloc_here(d) for _ in range(4)]
        for buf in bufs:
            _free_here(buf)
        return M._snapshot()["device_traces"][d]
    finally:
        M.record_history(enabled=None)


def _callers(entry):
    return [frame["name"] for frame in entry.get("frames", [])]


def test_record_history_options(sim_backend):
    """record_history: "all or True records the newest max_entries events"; context "alloc": "a
    free carries its allocation's stack"; "all (the default) a free or release carries its own
    caller's stack"; stacks False: "no stacks at all"; skip_actions: "action names not to record";
    None: "stops and forgets the history"."""
    d = _dev1()
    accel.Buffer(8, device=d).close()       # the segment exists: every trace below is 4 allocs, 8 frees
    full = _trace(d)
    assert [e["action"] for e in full].count("alloc") == 4 and len(full) == 12
    assert all(_callers(e)[0] == ("_alloc_here" if e["action"] == "alloc" else "_free_here") for e in full)
    newest = _trace(d, max_entries=3)
    assert [e["action"] for e in newest] == [e["action"] for e in full[-3:]]
    alloc_ctx = _trace(d, context="alloc")
    assert {_callers(e)[0] for e in alloc_ctx} == {"_alloc_here"}
    assert all(_callers(e) == [] for e in _trace(d, stacks=False))
    skipped = _trace(d, skip_actions=["free_requested", "free_completed"])
    assert [e["action"] for e in skipped] == ["alloc"] * 4
    assert M._snapshot()["device_traces"][d] == []


# -- pinned host memory ----------------------------------------------------------------------------
def test_host_memory_stats_keys_and_pinned_lifetime(sim_backend):
    """host_memory_stats: "{allocations,allocated_bytes,active_requests,active_bytes}.{current,
    peak,allocated,freed} ..., num_host_alloc, num_host_free and {host_alloc_time,host_free_time}.
    {total,max,min,count,avg}", sorted; empty_pinned: "The memory returns to the cache when the
    array and every view of it are gone"; empty_host_cache: "Unpin cached pinned memory whose work
    has completed"; reset_peak_host_memory_stats: "Set every peak ... to the current value";
    reset_accumulated_host_memory_stats: "Zero the allocated/freed counters and the timings"."""
    array = accel.empty_pinned((10, 10), "float32")
    view = array[2:4]
    del array
    gc.collect()
    stats = M.host_memory_stats()
    expected = {f"{a}.{b}" for a in ("allocations", "allocated_bytes", "active_requests", "active_bytes")
                for b in ("current", "peak", "allocated", "freed")}
    expected |= {"num_host_alloc", "num_host_free"}
    expected |= {f"{a}.{b}" for a in ("host_alloc_time", "host_free_time") for b in ("total", "max", "min", "count", "avg")}
    assert set(stats) == expected and list(stats) == sorted(stats)
    assert stats["active_requests.current"] == 1 and stats["active_bytes.current"] >= 400
    del view
    gc.collect()
    stats = M.host_memory_stats()
    assert stats["active_requests.current"] == 0 and stats["allocations.current"] == 1
    M.empty_host_cache()
    stats = M.host_memory_stats()
    assert stats["allocations.current"] == 0 and stats["allocated_bytes.current"] == 0
    assert stats["allocations.peak"] == 1
    M.reset_peak_host_memory_stats()
    assert M.host_memory_stats()["allocations.peak"] == 0
    M.reset_accumulated_host_memory_stats()
    stats = M.host_memory_stats()
    assert all(v == 0 for k, v in stats.items() if k.endswith((".allocated", ".freed")) or "_time." in k)


# -- MemPool ---------------------------------------------------------------------------------------
def _pool_of(buf):
    for seg in M.memory_snapshot():
        if seg["address"] <= buf.ptr < seg["address"] + seg["total_size"]:
            return tuple(seg["segment_pool_id"])
    return None


def test_mempool_argument_checks(sim_backend):
    """MemPool: use_on_oom / no_split are bools (TypeError otherwise); use_mem_pool: "TypeError when
    pool is not a MemPool"."""
    for kwargs in (dict(use_on_oom=1), dict(no_split="yes")):
        with pytest.raises(TypeError, match="must be a bool"):
            accel.MemPool(**kwargs)
    with pytest.raises(TypeError, match="takes an accel.MemPool"):
        with accel.use_mem_pool((0, 1)):
            pass


def test_use_mem_pool_nests_innermost_wins_and_is_per_thread(sim_backend):
    """use_mem_pool: "Contexts nest (the innermost pool is used)"; "Other threads, including ones
    started in the body, allocate as before"; MemPool: "blocks freed later, inside or outside, go
    back to the pool"."""
    d = _dev1()
    with accel.device_index(d):
        outer, inner = accel.MemPool(), accel.MemPool()
    made = []
    with accel.use_mem_pool(outer, d):
        a = accel.Buffer(100, device=d)
        with accel.use_mem_pool(inner, d):
            b = accel.Buffer(100, device=d)
            worker = threading.Thread(target=lambda: made.append(accel.Buffer(100, device=d)))
            worker.start()
            worker.join()
        c = accel.Buffer(100, device=d)
    e = accel.Buffer(100, device=d)
    assert [_pool_of(x) for x in (a, b, c, made[0], e)] == [outer.id, inner.id, outer.id, (0, 0), (0, 0)]
    b.close()
    with accel.use_mem_pool(inner, d):
        again = accel.Buffer(100, device=d)
    assert _pool_of(again) == inner.id


def test_pool_segments_survive_empty_cache_until_the_pool_dies(sim_backend):
    """accel.memory._mempool: "empty_cache() leaves a live pool's free segments alone, inside the
    context or not"; "When the MemPool object dies its pool is released ... its whole free
    segments go back to the device"."""
    d = _dev1()
    with accel.device_index(d):
        pool = accel.MemPool()
    with accel.use_mem_pool(pool, d):
        accel.Buffer(100, device=d).close()
        M.empty_cache()
        assert M.memory_reserved(d) > 0
    M.empty_cache()
    assert M.memory_reserved(d) > 0 and pool.snapshot()
    del pool
    gc.collect()
    M.empty_cache()
    assert M.memory_reserved(d) == 0


def test_no_split_pool_hands_blocks_out_whole(sim_backend):
    """MemPool(no_split=True): "blocks of this pool are handed out whole, never split"."""
    d = _dev1()
    with accel.device_index(d):
        pool = accel.MemPool(no_split=True)
    with accel.use_mem_pool(pool, d):
        first = accel.Buffer(100, device=d)
        second = accel.Buffer(100, device=d)
    segments = pool.snapshot()
    assert len(segments) == 2
    for seg in segments:
        assert [blk["size"] for blk in seg["blocks"]] == [seg["total_size"]]
    first.close()
    second.close()


def test_pool_in_a_capture_is_refused_to_use_mem_pool(sim_graph_backend):
    """use_mem_pool: "RuntimeError when the pool is already in use by another use_mem_pool or a
    graph capture"; use_count: "1 for this object, plus one ... per graph captured into it and not
    yet reset"."""
    d = _dev1()
    with accel.device_index(d):
        pool = accel.MemPool()
    g, s, buf = accel.Graph(pool=pool.id), accel.Stream(d), accel.Buffer(16, device=d)
    with s:
        g.capture_begin()
        with pytest.raises(RuntimeError, match="already recording"):
            with accel.use_mem_pool(pool, d):
                pass
        buf.fill_(1)
        g.capture_end()
    assert pool.use_count() == 2
    g.reset()
    assert pool.use_count() == 1


# -- accel.random: seeding -------------------------------------------------------------------------
def test_manual_seed_range_and_refusals_leave_the_seed(sim_backend):
    """manual_seed: "seed is an integer in [-2**63, 2**64); negatives are taken mod 2**64"; a seed
    outside is a ValueError and a non-integer a TypeError, and neither changes the seed (nor
    initializes: "never initializes"); "Seed the current device's generator (offset reset to 0)"
    -- before init that is device 0's ("applied at once, to device 0's generator")."""
    R.manual_seed(-1)
    assert R.initial_seed(0) == 2 ** 64 - 1
    R.manual_seed(-2 ** 63)
    assert R.initial_seed(0) == 2 ** 63
    R.manual_seed(2 ** 64 - 1)
    for bad, error in ((2 ** 64, ValueError), (-2 ** 63 - 1, ValueError), (1.5, TypeError), ("3", TypeError),
                       (True, TypeError)):
        with pytest.raises(error):
            R.manual_seed(bad)
        with pytest.raises(error):
            R.manual_seed_all(bad)
    assert R.initial_seed(0) == 2 ** 64 - 1
    assert not accel.is_initialized()
    d = _dev1()
    R.default_generator(d).set_offset(8)
    accel.set_device_index(d)
    R.manual_seed(11)
    assert R.initial_seed() == R.initial_seed(d) == 11 and R.default_generator(d).offset == 0
    if d:
        assert R.initial_seed(0) == 2 ** 64 - 1


def test_rng_state_layout_and_set_rng_state_rules(sim_backend):
    """get_rng_state: "numpy uint8 array of 16 bytes (seed, offset; little-endian)"; set_rng_state:
    "16 bytes or an 8-byte seed (offset 0). Errors leave the state unchanged"; Generator.set_state:
    "TypeError for anything but a 1-D uint8 array (or bytes); RuntimeError "RNG state is wrong size"
    ... and "offset must be a multiple of 4""."""
    d = _dev1()
    R.manual_seed_all(0x0102030405060708)
    R.default_generator(d).set_offset(12)
    state = R.get_rng_state(d)
    assert state.dtype == np.uint8 and state.shape == (16,)
    assert state.tobytes() == struct.pack("<Qq", 0x0102030405060708, 12)
    for bad, error, text in ((np.zeros(12, np.uint8), RuntimeError, "wrong size"),
                             (np.frombuffer(struct.pack("<Qq", 5, 2), np.uint8), RuntimeError, "multiple of 4"),
                             (np.frombuffer(struct.pack("<Qq", 5, -4), np.uint8), RuntimeError, "non-negative"),
                             ([0] * 16, TypeError, "uint8"), (np.zeros(16, np.int8), TypeError, "uint8"),
                             (np.zeros((2, 8), np.uint8), TypeError, "1-D")):
        with pytest.raises(error, match=text):
            R.set_rng_state(bad, d)
        assert R.get_rng_state(d).tobytes() == state.tobytes()
    R.set_rng_state(np.frombuffer(struct.pack("<Q", 9), np.uint8), d)
    assert (R.initial_seed(d), R.default_generator(d).offset) == (9, 0)
    R.set_rng_state(bytearray(struct.pack("<Qq", 10, 16)), d)
    assert (R.initial_seed(d), R.default_generator(d).offset) == (10, 16)
    R.set_rng_state(state, d)
    assert R.get_rng_state(d).tobytes() == state.tobytes()
    assert accel.current_device_index() == 0


def test_set_rng_state_all_checks_every_state_first(sim_backend):
    """set_rng_state_all: "All states are checked first: on any error no generator changes";
    get_rng_state_all: "States of all devices' generators, in device order"; more states than
    devices is a ValueError, a dict a TypeError."""
    R.manual_seed_all(5)
    good = R.get_rng_state_all()
    assert len(good) == accel.device_count()
    fresh = np.frombuffer(struct.pack("<Qq", 100, 0), np.uint8)
    first = [fresh] * (accel.device_count() - 1)     # good states, then a bad one last
    for bad, error in ((first + [np.zeros(3, np.uint8)], RuntimeError), (good * 2, ValueError),
                       ({0: fresh}, TypeError), (first + [[1, 2]], TypeError)):
        with pytest.raises(error):
            R.set_rng_state_all(bad)
        assert [s.tobytes() for s in R.get_rng_state_all()] == [s.tobytes() for s in good]
    R.set_rng_state_all([fresh])
    assert R.initial_seed(0) == 100


def test_seed_and_seed_all_return_the_seed(sim_backend):
    """seed: "Seed the current device's generator non-deterministically; returns the seed";
    Generator.seed: "53 bits, as torch's CUDA generators"; seed_all: "Seed every device's
    generator with one non-deterministic seed; returns it"."""
    d = _dev1()
    accel.set_device_index(d)
    value = R.seed()
    assert 0 <= value < 2 ** 53 and R.initial_seed(d) == value
    value = R.seed_all()
    assert 0 <= value < 2 ** 53
    assert [R.initial_seed(i) for i in range(accel.device_count())] == [value] * accel.device_count()


# -- accel.random: fills -----------------------------------------------------------------------------
def _philox_words(seed: int, offset: int, n: int) -> list:
    """cuRAND's curand_init(seed, 0, offset) words: counter offset/4 + j, key (lo32, hi32)(seed)."""
    key = np.array(philox.split_seed(seed), np.uint32)
    first = offset // 4
    ctr = np.array([[(c & 0xFFFFFFFF), c >> 32, 0, 0] for c in range(first, first + (n + 3) // 4)], np.uint32)
    return philox.philox4x32_10(ctr, key).ravel()[:n].tolist()


def test_random_raw_is_curand_order_and_offsets_round_to_four(sim_backend):
    """accel.random: "element i comes from the words of curand_init(seed, 0, offset) in cuRAND
    order"; "each fill advances the offset by its words rounded up to a multiple of 4";
    random_raw_: "raw 32-bit Philox words (uint32)"; "Fills ... write a whole Buffer"."""
    d = _dev1()
    seed = 0x1234_5678_9ABC
    R.manual_seed_all(seed)
    gen = R.default_generator(d)
    whole = accel.Buffer(64, device=d)
    assert R.random_raw_(whole) is whole
    assert gen.offset == 16
    assert whole.to_numpy("uint32").tolist() == _philox_words(seed, 0, 16)
    five = accel.Buffer(20, device=d)
    R.random_raw_(five)
    assert gen.offset == 24
    assert five.to_numpy("uint32").tolist() == _philox_words(seed, 16, 5)
    R.random_raw_(five)
    assert five.to_numpy("uint32").tolist() == _philox_words(seed, 24, 5)


def test_fills_ranges_and_refusals_leave_the_offset(sim_backend):
    """uniform_: "uniform values in [low, high) of dtype (float32 or float64)"; randint_: "integers
    in [low, high) of dtype (int64 or int32)"; normal_: float32 or float64; a generator of another
    device draws from it (as torch), a closed buffer is a RuntimeError; a refused fill draws nothing (the
    offset stays)."""
    d = _dev1()
    R.manual_seed_all(7)
    gen = R.default_generator(d)
    buf = accel.Buffer(4096, device=d)
    R.uniform_(buf, low=2.0, high=3.0)
    u = buf.to_numpy("float32")
    assert u.min() >= 2.0 and u.max() < 3.0
    R.uniform_(buf, dtype="float64", low=-1.0, high=0.0)
    u = buf.to_numpy("float64")
    assert u.min() >= -1.0 and u.max() < 0.0
    R.randint_(buf, 5, 8, dtype="int32")
    r = buf.to_numpy("int32")
    assert set(r.tolist()) == {5, 6, 7}
    R.normal_(buf, mean=10.0, std=0.5)
    assert abs(float(buf.to_numpy("float32").mean()) - 10.0) < 0.1
    offset = gen.offset
    with pytest.raises(TypeError, match="float32' or 'float64"):
        R.uniform_(buf, dtype="float16")
    with pytest.raises(TypeError, match="int64' or 'int32"):
        R.randint_(buf, 0, 3, dtype="float32")
    with pytest.raises(TypeError):
        R.normal_(buf, dtype="int64")
    if d:       # (another device's generator draws, as torch's: r69b)
        other = R.Generator(0)
        R.uniform_(buf, generator=other)
        assert other.offset == 1024
    with pytest.raises(TypeError, match="fills an accel.Buffer"):
        R.uniform_(np.zeros(4, np.float32))
    buf.close()
    with pytest.raises(RuntimeError, match="was closed"):
        R.random_raw_(buf)
    assert gen.offset == offset


# -- accel.random.Generator -------------------------------------------------------------------------
def test_generator_construction_rules(sim_backend):
    """Generator(device_index=0, seed=None): DEFAULT_SEED "what initial_seed() reports before any
    seeding"; the index is an int or a device string/device of the accelerator, checked against
    the device count ("Generator: ..."); device: "Never initializes the runtime"."""
    d = _dev1()
    assert R.Generator().initial_seed() == R.DEFAULT_SEED == 67280421310721
    assert R.Generator(f"{sim_backend}:{d}").device_index == d
    assert R.Generator(accel.device(sim_backend, d), seed=-1).initial_seed() == 2 ** 64 - 1
    assert R.Generator(np.int64(d)).device == accel.device(sim_backend, d)
    with pytest.raises(accel.InvalidDeviceError, match="Generator: device index"):
        R.Generator(accel.device_count())
    with pytest.raises(TypeError):
        R.Generator(True)
    other = "xpu" if sim_backend != "xpu" else "cuda"
    with pytest.raises(ValueError, match="doesn't match"):
        R.Generator(f"{other}:0")
    assert not accel.is_initialized()


def test_generator_offset_rules(sim_backend):
    """set_offset: "a non-negative multiple of 4 below 2**63" (RuntimeError otherwise, TypeError for
    a non-int; the offset stays); offset / get_offset: "Words consumed so far (a multiple of 4)";
    reserve: "advance it by increment rounded up to a multiple of 4"; manual_seed: "reset the
    offset to 0"."""
    g = R.Generator(_dev1(), seed=3)
    g.set_offset(8)
    for bad, error in ((6, RuntimeError), (-4, RuntimeError), (2 ** 63, RuntimeError), (True, TypeError),
                       (8.0, TypeError)):
        with pytest.raises(error):
            g.set_offset(bad)
        assert g.offset == g.get_offset() == 8
    assert g.reserve(1) == 8 and g.offset == 12
    assert g.reserve(0) == 12 and g.offset == 12
    assert g.reserve(9) == 12 and g.offset == 24
    with pytest.raises(ValueError):
        g.reserve(-1)
    assert g.manual_seed(4) is g and g.offset == 0 and g.initial_seed() == 4


def test_generator_states_share_clone_and_copy(sim_backend):
    """graphsafe_get_state: "shared, not copied: draws from either advance both"; clone_state: "a new,
    independent state: this one's seed and offset"; graphsafe_set_state: "a generator of the same
    device" (ValueError otherwise, TypeError for a non-Generator); __reduce__: "pickle, copy.copy and
    copy.deepcopy give an independent generator with this one's device, seed and offset"."""
    d = _dev1()
    g = R.Generator(d, seed=21)
    g.set_offset(4)
    shared = g.graphsafe_get_state()
    shared.reserve(4)
    assert g.offset == shared.offset == 8
    clone = g.clone_state()
    clone.reserve(4)
    assert (clone.initial_seed(), clone.offset, g.offset) == (21, 12, 8)
    for dup in (copy.copy(g), copy.deepcopy(g), pickle.loads(pickle.dumps(g))):
        assert (dup.device_index, dup.initial_seed(), dup.offset) == (d, 21, 8)
        dup.reserve(4)
        assert g.offset == 8
    g.graphsafe_set_state(clone)
    assert g.offset == 12
    with pytest.raises(TypeError):
        g.graphsafe_set_state(5)
    if d:
        with pytest.raises(ValueError, match="same device|of device 0"):
            g.graphsafe_set_state(R.Generator(0))
    assert g.offset == 12


def test_default_generator_checks_its_index_without_initializing(sim_backend):
    """default_generator: "created on first use; no runtime init"; a bool is refused (True would
    be device 1's) and an index past the count is InvalidDeviceError."""
    d = _dev1()
    assert R.default_generator(d) is R.default_generator(np.int32(d))
    with pytest.raises(TypeError):
        R.default_generator(True)
    with pytest.raises(accel.InvalidDeviceError):
        R.default_generator(accel.device_count())
    assert not accel.is_initialized()


@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_seeding_without_a_device_does_nothing(monkeypatch, kind):
    """accel.random: "Without any device the seeding calls do nothing, as torch.cuda.manual_seed";
    seed: "returns the seed (0 without a device)"; get_rng_state_all: one state per device (none)."""
    use_sim(monkeypatch, kind, ACCEL_SIM_DEVICES=0)
    assert accel.device_count() == 0
    R.manual_seed(5)
    R.manual_seed_all(5)
    assert R.seed() == 0
    assert R.get_rng_state_all() == []
    R.set_rng_state_all([])
    assert not accel.is_initialized()


# -- "as torch" claims, where torch 2.13's CPU wheel can answer (skipped without torch) ----------------
def test_torch_comparisons_on_cpu(sim_cuda):
    """Claims that name torch's behaviour, checked against torch where its CPU wheel has the API:
    DEFAULT_SEED "torch's default_rng_seed_val"; check_seed "A seed as torch takes it: an integer
    in [-2**63, 2**64), negative values mod 2**64"; the deprecated aliases' FutureWarning texts
    (torch warns before it finds no accelerator); accel.memory._config "with torch's value checks"
    for the options c10's own parser reads (torch._C._accelerator_setAllocatorSettings)."""
    torch = pytest.importorskip("torch")
    assert R.DEFAULT_SEED == torch.Generator().initial_seed()
    for value in (-1, -2 ** 63, 2 ** 64 - 1, 0, 12345):
        assert R.Generator(0, seed=value).initial_seed() == torch.Generator().manual_seed(value).initial_seed()
    for value in (2 ** 64, -2 ** 63 - 1):
        with pytest.raises(ValueError):
            torch.Generator().manual_seed(value)
        with pytest.raises(ValueError):
            R.Generator(0, seed=value)
    for name, args in (("current_device_idx", ()), ("set_device_idx", (0,))):
        texts = []
        for fn in (getattr(torch.accelerator, name), getattr(accel, name)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    fn(*args)
                except RuntimeError:
                    pass        # torch's CPU wheel: no accelerator
            texts.append([(w.category, str(w.message)) for w in caught if w.category is FutureWarning])
        assert texts[0] == texts[1] != [], name
    try:
        for setting in ("max_split_size_mb:10", "max_split_size_mb:20", "garbage_collection_threshold:0",
                        "garbage_collection_threshold:0.5", "garbage_collection_threshold:1.0",
                        "roundup_power2_divisions:3", "roundup_power2_divisions:4", "expandable_segments:maybe",
                        "expandable_segments:True"):
            outcomes = []
            for apply in (torch._C._accelerator_setAllocatorSettings, M.set_allocator_settings):
                try:
                    apply(setting)
                    outcomes.append("accepted")
                except (ValueError, RuntimeError):
                    outcomes.append("refused")
            assert outcomes[0] == outcomes[1], (setting, outcomes)
    finally:
        torch._C._accelerator_setAllocatorSettings("expandable_segments:False")


@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_cuda_malloc_async_backend_refusals(monkeypatch, kind):
    """MemPool: "NotImplementedError under backend:cudaMallocAsync (its driver pool has no private
    pools)"; device_allocator: "ValueError ... for backend:cudaMallocAsync on a backend or device
    without a memory pool" (Level Zero and Metal have none); memory_stats keeps torch's 123 keys
    there too."""
    use_sim(monkeypatch, kind, ACCEL_ALLOC_CONF="backend:cudaMallocAsync")
    d = _dev1()
    if kind == "cuda":
        keep = accel.Buffer(100, device=d)
        assert len(M.memory_stats(d)) == 123 and M.memory_allocated(d) > 0
        keep.close()
        with pytest.raises(NotImplementedError, match="no private pools"):
            accel.MemPool()
    else:
        with pytest.raises(ValueError, match="no stream-ordered memory pool"):
            M.device_allocator(d)


def test_fill_number_layout_follows_the_documented_rules(sim_backend):
    """accel.random: "Number layout: element i comes from the words of curand_init(seed, 0, offset)
    in cuRAND order, by the per-distribution rules in accel.random._transforms" -- uniform float32
    "u = (W[i] >> 8) * 2**-24 ...; x = fl32(fl32(u * scale) + low)" (1 word each); uniform float64
    "u = ((W[2i] >> 5) * 2**26 + (W[2i+1] >> 6)) * 2**-53 ... x = u * scale + low" (2 words each);
    randint "x = low + W[i] % R" (R <= 2**32, 1 word each); normal float32 "2 words per pair" and
    float64 "4 words per pair", "An odd n still consumes the last pair's words"; each fill advances
    the offset by its words rounded up to 4."""
    d = _dev1()
    seed = 987654321
    R.manual_seed_all(seed)
    gen = R.default_generator(d)
    buf = accel.Buffer(32, device=d)

    R.uniform_(buf, low=-2.0, high=5.0)                      # 8 float32: words 0..7
    w = np.array(_philox_words(seed, 0, 8), np.uint64)
    u = (w >> np.uint64(8)).astype(np.float64) * 2.0 ** -24
    scale, low = np.float32(7.0), np.float32(-2.0)
    expect = (np.float32(u.astype(np.float32) * scale) + low).astype(np.float32)
    assert buf.to_numpy("float32").tolist() == expect.tolist() and gen.offset == 8

    R.uniform_(buf, dtype="float64", low=1.0, high=3.0)      # 4 float64: words 8..15
    w = np.array(_philox_words(seed, 8, 8), np.uint64)
    u = ((w[0::2] >> np.uint64(5)).astype(np.float64) * 2.0 ** 26 + (w[1::2] >> np.uint64(6)).astype(np.float64)) \
        * 2.0 ** -53
    assert buf.to_numpy("float64").tolist() == (u * 2.0 + 1.0).tolist() and gen.offset == 16

    R.randint_(buf, -10, 1000, dtype="int32")                # 8 int32: words 16..23
    w = np.array(_philox_words(seed, 16, 8), np.int64)
    assert buf.to_numpy("int32").tolist() == (-10 + w % 1010).tolist() and gen.offset == 24

    five = accel.Buffer(20, device=d)
    R.normal_(five)                                          # 5 float32: 3 pairs, 6 words -> 8
    assert gen.offset == 32
    R.normal_(accel.Buffer(24, device=d), dtype="float64")   # 3 float64: 2 pairs, 8 words
    assert gen.offset == 40
