"""torch 2.13's new caching-allocator features that accel lacks, checked against accel (r64d).

What each test holds and where it comes from (the report of helper r64d has the citations):

* ``throw_on_cudamalloc_oom`` and the ``num_oom_rejections`` stat (pytorch PR #179473, in
  v2.13.0): with the option True, an allocation whose driver allocation would take the
  allocator's reserved bytes past ``per_process_memory_fraction * total memory`` is refused with
  OutOfMemoryError before cudaMalloc / the expandable-segment map, without the free-the-cache-and-
  retry chain, and counted in ``num_oom_rejections``.  ``test_cuda__*`` are ports of torch's own
  tests in test/test_cuda.py (TestCuda.test_allocator_settings' throw_on_cudamalloc_oom part and
  TestCudaAllocator.test_throw_on_cudamalloc_oom, as fixed by pytorch commit 81d5c3f0);
  ``test_pr__*`` hold what the PR's description states and torch's test does not check.
* ``reserved_bytes_by_private_pools`` (pytorch PR #178240, in v2.13.0): per private pool
  (MemPool, graph pool) the reserved bytes, a ``{all,large_pool,small_pool}.{current,peak,
  allocated,freed}`` entry keyed by the pool's id tuple in ``memory_stats_as_nested_dict`` and
  flattened to ``reserved_bytes_by_private_pools.<a>_<b>.<type>.<metric>`` by ``memory_stats``;
  "current drops to 0 when a pool is deleted, while peak/allocated/freed are preserved until
  reset" (c10/core/CachingDeviceAllocator.h of torch 2.13).  torch's own test of it could not be
  read (the stored test_cuda.py copies predate it), so ``test_doc__*`` hold what torch 2.13's
  header and torch/cuda/memory.py document.
* ``pinned_free_catch_all`` (a True/False key of CUDAAllocatorConfig in v2.13.0; it makes the
  pinned host allocator's free() swallow an exception instead of rethrowing it): accepted,
  strict True/False.
* ``expandable_segments_reserve`` / ``expandable_segments_reserve_by_class`` are NOT torch 2.13
  keys (pytorch main only, PR #192269): torch 2.13 refuses them ("Unrecognized key ... in CUDA
  allocator config."), and so does accel: these tests pass.
* ``max_non_split_rounding_mb`` / ``max_split_size_mb``: torch 2.13 reads the MiB count with
  std::stoull, so ``-1`` wraps to 2**64-1 and is accepted (clamped to SIZE_MAX / 1 MiB: no limit),
  and refuses a ``max_non_split_rounding_mb`` below large_segment_size (20 MiB) ("too small, must
  be >= 20"); checked against the installed torch 2.13.0 (its AcceleratorAllocatorConfig is in
  libc10, the same on CPU builds).

Names assumed in accel (the ones that do not exist yet): ``accel.memory.memory_stats_as_nested_dict``,
the ``num_oom_rejections`` and ``reserved_bytes_by_private_pools.*`` stat keys, the options
``throw_on_cudamalloc_oom`` and ``pinned_free_catch_all`` of
``accel.memory.set_allocator_settings``.  Existing names used: ``accel.memory.memory_stats``,
``reset_peak_memory_stats``, ``reset_accumulated_memory_stats``, ``memory_snapshot``,
``empty_cache``, ``accel.MemPool`` / ``accel.use_mem_pool``, ``accel.Buffer``,
``accel.OutOfMemoryError``.  Written as strict xfails while accel lacked these (each failed on the
missing feature: unknown option, KeyError 'num_oom_rejections', no memory_stats_as_nested_dict);
the marks went with the implementation.  All run on the simulated CUDA runtime (2 devices).
"""

import gc

import pytest

import accel
from accel import Buffer, MemPool, OutOfMemoryError, memory, use_mem_pool
from accel.memory import _config
from accel._errors import AllocatorConfigError

from conftest import use_sim

MiB = 1 << 20

NOT_THROW = "r64d: not implemented: throw_on_cudamalloc_oom option / num_oom_rejections stat (torch 2.13)"
NOT_PRIVATE = "r64d: not implemented: reserved_bytes_by_private_pools stat (torch 2.13)"
NOT_PINNED = "r64d: not implemented: pinned_free_catch_all option (torch 2.13)"
NOT_STOULL = ("r64d: not implemented: torch 2.13 reads *_mb with std::stoull (-1 wraps to no limit) and "
              "refuses max_non_split_rounding_mb < 20 (accel/memory/_config.py _parse_mb callers)")


@pytest.fixture
def cuda(monkeypatch):
    """The simulated CUDA runtime, two devices."""
    use_sim(monkeypatch, "cuda")
    assert accel.device_count() == 2
    yield
    try:                  # leave no option behind for the next test of this process
        memory.set_allocator_settings("")
    except Exception:
        pass


def _settings_back():
    """torch's test's finally: the options back to their defaults."""
    try:
        memory.set_allocator_settings("throw_on_cudamalloc_oom:False,per_process_memory_fraction:1.0")
    except AllocatorConfigError:
        memory.set_allocator_settings("per_process_memory_fraction:1.0")


# ------------------------------------------------------------------ throw_on_cudamalloc_oom

def test_cuda__test_allocator_settings_throw_on_cudamalloc_oom(cuda):
    """TestCuda.test_allocator_settings, its throw_on_cudamalloc_oom part: True and False
    accepted, anything else a ValueError (torch's ConfigTokenizer::toBool takes exactly "True" /
    "False"; PR #179057: not 1/0, not lower case)."""
    memory.set_allocator_settings("throw_on_cudamalloc_oom:True")
    memory.set_allocator_settings("throw_on_cudamalloc_oom:False")
    for bad in ("maybe", "true", "1", "0", ""):
        with pytest.raises(ValueError):
            memory.set_allocator_settings(f"throw_on_cudamalloc_oom:{bad}")



def test_cuda__test_throw_on_cudamalloc_oom(cuda):
    """TestCudaAllocator.test_throw_on_cudamalloc_oom: with the option False an allocation
    succeeds; with it True and per_process_memory_fraction:0.005 (both through the settings
    string), the allowed bytes + 1 MiB is refused with OutOfMemoryError and num_oom_rejections
    counts it."""
    memory.empty_cache()
    memory.reset_accumulated_memory_stats(0)
    try:
        memory.set_allocator_settings("throw_on_cudamalloc_oom:False")
        x = Buffer(10 * MiB)
        del x
        memory.empty_cache()

        fraction = 0.005
        memory.set_allocator_settings(f"throw_on_cudamalloc_oom:True,per_process_memory_fraction:{fraction}")
        total_mem = accel.get_device_properties(0).total_memory
        # the allowed threshold + 1 MiB guarantees the rejection
        alloc_bytes = int(total_mem * fraction) + MiB
        with pytest.raises(OutOfMemoryError):
            Buffer(alloc_bytes)
        assert memory.memory_stats()["num_oom_rejections"] > 0
    finally:
        memory.empty_cache()
        _settings_back()



def test_doc__num_oom_rejections_is_a_memory_stats_key_zeroed_by_reset(cuda):
    """torch/cuda/memory.py (2.13): memory_stats has ``num_oom_rejections``, "number of
    allocations preemptively rejected by the throw_on_cudamalloc_oom + per_process_memory_fraction
    policy"; an accumulated counter (DeviceStats::num_oom_rejections), so
    reset_accumulated_memory_stats sets it back to 0, on each device."""
    for dev in (0, 1):
        Buffer(256, device=dev).close()         # (memory_stats is {} before init, as torch's)
        stats = memory.memory_stats(dev)
        assert stats["num_oom_rejections"] == 0
    try:
        memory.set_allocator_settings("throw_on_cudamalloc_oom:True,per_process_memory_fraction:0.01")
        total = accel.get_device_properties(1).total_memory
        with accel.device_index(1):
            with pytest.raises(OutOfMemoryError):
                Buffer(int(total * 0.01) + MiB)
        assert memory.memory_stats(1)["num_oom_rejections"] == 1
        assert memory.memory_stats(0)["num_oom_rejections"] == 0
        memory.reset_peak_memory_stats(1)
        assert memory.memory_stats(1)["num_oom_rejections"] == 1
        memory.reset_accumulated_memory_stats(1)
        assert memory.memory_stats(1)["num_oom_rejections"] == 0
    finally:
        _settings_back()



def test_pr__rejection_skips_the_free_cache_and_retry_chain(cuda):
    """PR #179473: "If exceeded, reject immediately with OutOfMemoryError (skip retry chain)":
    the cached free segments stay cached (no release_cached_blocks), num_alloc_retries does not
    move, and the rejection is counted once per refused request."""
    memory.empty_cache()
    total = accel.get_device_properties(0).total_memory
    fraction = 0.01
    allowed = int(total * fraction)
    try:
        cached = Buffer(16 * MiB)
        del cached                   # a free, cached segment: reserved > 0, allocated 0
        before = memory.memory_stats()
        assert before["reserved_bytes.all.current"] > 0
        memory.set_allocator_settings(f"throw_on_cudamalloc_oom:True,per_process_memory_fraction:{fraction}")
        with pytest.raises(OutOfMemoryError):
            Buffer(allowed + MiB)
        after = memory.memory_stats()
        assert after["num_oom_rejections"] - before["num_oom_rejections"] == 1
        assert after["num_alloc_retries"] == before["num_alloc_retries"]
        assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]
        # a request the cap allows is served as before
        ok = Buffer(MiB)
        del ok
    finally:
        memory.empty_cache()
        _settings_back()



def test_pr__fraction_left_at_one_rejects_past_total_memory(cuda):
    """PR #179473's check is ``total_allocated_memory + request_size >
    per_process_memory_fraction * total_GPU_memory``; the fraction defaults to 1.0
    (CUDAAllocatorConfig::m_per_process_memory_fraction{1.0}), so with only the option set a
    request past the device's memory is a rejection (counted), not a failed cudaMalloc."""
    total = accel.get_device_properties(0).total_memory
    try:
        memory.set_allocator_settings("throw_on_cudamalloc_oom:True")
        before = memory.memory_stats()["num_oom_rejections"]
        with pytest.raises(OutOfMemoryError):
            Buffer(total + MiB)
        assert memory.memory_stats()["num_oom_rejections"] == before + 1
        ok = Buffer(4 * MiB)        # well under the cap: no rejection
        del ok
        assert memory.memory_stats()["num_oom_rejections"] == before + 1
    finally:
        _settings_back()


# ------------------------------------------------------------------ reserved_bytes_by_private_pools
def _pool_segments(pool_id, device=None):
    return [s for s in memory.memory_snapshot() if tuple(s["segment_pool_id"]) == tuple(pool_id)
            and (device is None or s["device"] == device)]


def _expected(pool_id, device=None):
    """What reserved_bytes_by_private_pools[pool_id] must say now: the pool's segments' bytes."""
    segs = _pool_segments(pool_id, device)
    large = sum(s["total_size"] for s in segs if s["segment_type"] == "large")
    small = sum(s["total_size"] for s in segs if s["segment_type"] == "small")
    return {"all": large + small, "large_pool": large, "small_pool": small}



def test_doc__private_pool_reserved_bytes_nested_and_flat(cuda):
    """torch/cuda/memory.py (2.13): ``reserved_bytes_by_private_pools`` is a nested dict keyed
    by MemPool.id tuples, each with reserved_bytes' {all,large_pool,small_pool}.{current,peak,
    allocated,freed}; memory_stats flattens a tuple key by joining its parts with "_" ((0, 1) ->
    "0_1").  The bytes are the pool's segments' (a private pool's share of reserved_bytes)."""
    pool = MemPool()
    with use_mem_pool(pool):
        big = Buffer(3 * MiB)
        small = Buffer(4096)
    nested = memory.memory_stats_as_nested_dict()
    per_pool = nested["reserved_bytes_by_private_pools"]
    assert pool.id in per_pool
    assert (0, 0) not in per_pool                      # the default pool is not a private pool
    entry = per_pool[pool.id]
    assert set(entry) == {"all", "large_pool", "small_pool"}
    want = _expected(pool.id)
    assert want["all"] > 0
    for kind in ("all", "large_pool", "small_pool"):
        assert set(entry[kind]) == {"current", "peak", "allocated", "freed"}
        assert entry[kind]["current"] == want[kind]
        assert entry[kind]["peak"] >= entry[kind]["current"]
    assert entry["all"]["current"] <= nested["reserved_bytes"]["all"]["current"]

    flat = memory.memory_stats()
    a, b = pool.id
    for kind in ("all", "large_pool", "small_pool"):
        for metric in ("current", "peak", "allocated", "freed"):
            assert flat[f"reserved_bytes_by_private_pools.{a}_{b}.{kind}.{metric}"] == entry[kind][metric]
    del big, small



def test_doc__private_pool_current_drops_to_zero_when_deleted_peak_kept_until_reset(cuda):
    """c10/core/CachingDeviceAllocator.h (2.13): "current drops to 0 when a pool is deleted,
    while peak/allocated/freed are preserved until reset"."""
    memory.empty_cache()
    pool = MemPool()
    pool_id = pool.id
    with use_mem_pool(pool):
        x = Buffer(8 * MiB)
    held = memory.memory_stats_as_nested_dict()["reserved_bytes_by_private_pools"][pool_id]["all"]
    assert held["current"] > 0 and held["allocated"] == held["current"] and held["freed"] == 0
    del x
    del pool
    gc.collect()
    memory.empty_cache()
    assert _pool_segments(pool_id) == []
    after = memory.memory_stats_as_nested_dict()["reserved_bytes_by_private_pools"][pool_id]["all"]
    assert after["current"] == 0
    assert after["peak"] == held["peak"]
    assert after["allocated"] == held["allocated"]
    assert after["freed"] == held["allocated"]

    memory.reset_peak_memory_stats()
    per_pool = memory.memory_stats_as_nested_dict()["reserved_bytes_by_private_pools"]
    if pool_id in per_pool:           # torch may drop a dead pool's entry at a reset
        assert per_pool[pool_id]["all"]["peak"] == 0
        assert per_pool[pool_id]["all"]["allocated"] == held["allocated"]
    memory.reset_accumulated_memory_stats()
    per_pool = memory.memory_stats_as_nested_dict()["reserved_bytes_by_private_pools"]
    if pool_id in per_pool:
        assert per_pool[pool_id]["all"] == {"current": 0, "peak": 0, "allocated": 0, "freed": 0}



def test_doc__private_pool_reset_peak_and_accumulated_while_alive(cuda):
    """The per-pool StatArray resets as reserved_bytes does: reset_peak_memory_stats sets peak to
    current, reset_accumulated_memory_stats zeroes allocated and freed; current is untouched."""
    pool = MemPool()
    with use_mem_pool(pool):
        keep = Buffer(2 * MiB)
        gone = Buffer(30 * MiB)
    del gone
    memory.empty_cache()       # a live pool's free segments: torch frees them only for a dead pool
    entry = memory.memory_stats_as_nested_dict()["reserved_bytes_by_private_pools"][pool.id]["all"]
    current = entry["current"]
    assert current == _expected(pool.id)["all"]
    memory.reset_peak_memory_stats()
    entry = memory.memory_stats_as_nested_dict()["reserved_bytes_by_private_pools"][pool.id]["all"]
    assert entry["peak"] == entry["current"] == current
    memory.reset_accumulated_memory_stats()
    entry = memory.memory_stats_as_nested_dict()["reserved_bytes_by_private_pools"][pool.id]["all"]
    assert (entry["current"], entry["allocated"], entry["freed"]) == (current, 0, 0)
    del keep



def test_doc__private_pool_stats_are_per_device(cuda):
    """DeviceStats is per device: a pool of device 1 shows in memory_stats(1) only; two pools of
    one device have one entry each."""
    with accel.device_index(1):
        pool1 = MemPool()
        with use_mem_pool(pool1):
            y = Buffer(5 * MiB)
    pool0a, pool0b = MemPool(), MemPool()
    with use_mem_pool(pool0a):
        a = Buffer(MiB)
    with use_mem_pool(pool0b):
        b = Buffer(7 * MiB)
    on0 = memory.memory_stats_as_nested_dict(0)["reserved_bytes_by_private_pools"]
    on1 = memory.memory_stats_as_nested_dict(1)["reserved_bytes_by_private_pools"]
    assert pool1.id in on1 and pool1.id not in on0
    assert pool0a.id in on0 and pool0b.id in on0
    assert pool0a.id not in on1 and pool0b.id not in on1
    assert on1[pool1.id]["all"]["current"] == _expected(pool1.id, 1)["all"]
    assert on0[pool0a.id]["all"]["current"] == _expected(pool0a.id, 0)["all"]
    assert on0[pool0b.id]["all"]["current"] == _expected(pool0b.id, 0)["all"]
    del y, a, b


# ------------------------------------------------------------------ pinned_free_catch_all

def test_config__pinned_free_catch_all_is_a_strict_bool(cuda):
    """CUDAAllocatorConfig (2.13): ``pinned_free_catch_all`` is one of getKeys(), parsed by
    parsePinnedFreeCatchAll with tokenizer.toBool (exactly True / False)."""
    memory.set_allocator_settings("pinned_free_catch_all:True")
    assert "pinned_free_catch_all:True" in memory.get_allocator_settings()
    memory.set_allocator_settings("pinned_free_catch_all:False")
    for bad in ("maybe", "true", "1"):
        with pytest.raises(ValueError):
            memory.set_allocator_settings(f"pinned_free_catch_all:{bad}")
    assert _config.parse("pinned_free_catch_all:True") is not None


# ------------------------------------------------------------------ not torch 2.13 keys
@pytest.mark.parametrize("setting", ["expandable_segments_reserve:0.5",
                                     "expandable_segments_reserve:40G",
                                     "expandable_segments_reserve_by_class:[serving:0.25]"])
def test_config__expandable_segments_reserve_is_refused_as_torch_2_13_does(cuda, setting):
    """torch 2.13's CUDAAllocatorConfig::getKeys() has no expandable_segments_reserve(_by_class)
    (they came after, on main), so torch 2.13 refuses them with "Unrecognized key '...' in CUDA
    allocator config." (a ValueError); accel refuses them too and changes nothing."""
    before = memory.get_allocator_settings()
    with pytest.raises(ValueError, match="expandable_segments_reserve"):
        memory.set_allocator_settings(setting)
    assert memory.get_allocator_settings() == before


# ------------------------------------------------------------------ *_mb read as std::stoull

@pytest.mark.parametrize("key, field", [("max_non_split_rounding_mb", "max_non_split_rounding"),
                                        ("max_split_size_mb", "max_split_size")])
def test_config__minus_one_mb_is_no_limit_as_torch_2_13(cuda, key, field):
    """torch 2.13 (AcceleratorAllocatorConfig::parseMaxNonSplitRoundingSize / parseMaxSplitSize,
    tokenizer.toSizeT = std::stoull): "-1" wraps to 2**64-1, passes the >= 20 check and is
    clamped to SIZE_MAX / 1 MiB MiB: no limit (for max_non_split_rounding: an oversize cached block
    serves any smaller oversize request).  torch._C._accelerator_setAllocatorSettings(
    "max_non_split_rounding_mb:-1") is accepted by the installed torch 2.13.0."""
    value = getattr(_config.parse(f"{key}:-1"), field)
    assert value >= (_config.UNLIMITED // MiB) * MiB
    memory.set_allocator_settings(f"{key}:-1")



@pytest.mark.parametrize("mb", [0, 1, 19])
def test_config__max_non_split_rounding_below_20_mb_is_refused_as_torch_2_13(cuda, mb):
    """torch 2.13: "CachingAllocator option max_non_split_rounding_mb too small, must be >= 20"
    (the minimum is large_segment_size_mb, 20 by default): ValueError.  accel takes 0..19."""
    with pytest.raises(ValueError, match="max_non_split_rounding_mb"):
        memory.set_allocator_settings(f"max_non_split_rounding_mb:{mb}")


def test_config__max_non_split_rounding_20_mb_is_accepted(cuda):
    """The boundary torch 2.13 accepts (20 MiB): accel takes it too."""
    memory.set_allocator_settings("max_non_split_rounding_mb:20")
    assert _config.parse("max_non_split_rounding_mb:20").max_non_split_rounding == 20 * MiB
