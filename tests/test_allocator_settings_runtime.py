"""The caching allocator's options changed while the program runs:
``accel.memory.set_allocator_settings`` / ``get_allocator_settings``, torch's
``torch._C._accelerator_setAllocatorSettings`` / ``_accelerator_getAllocatorSettings``
(``torch.cuda.memory._set_allocator_settings`` before torch 2.10).

torch's rule (c10/core/AllocatorConfig.cpp, ``AcceleratorAllocatorConfig::parseArgs``): each
call sets back ``max_split_size_mb``, ``roundup_power2_divisions`` and
``garbage_collection_threshold`` to their defaults unless it names them; every other option keeps
its value unless named.  The backend cannot change once the allocator started (torch:
"Allocator backend parsed at runtime != allocator backend parsed at load time").

Also here: torch's test_allocator_settings, test_max_split_expandable and
test_garbage_collect_expandable ported with their run-time changes (tests/test_torch_cuda_extra.py
has the earlier one-setting-per-process ports).
"""

import threading

import pytest

import accel
from accel import MemPool, OutOfMemoryError, memory, use_mem_pool
from accel._errors import AllocatorConfigError

from conftest import run_forked, use_sim
from torch_port_util import power2_div

MiB = 1 << 20


def _cap_to(extra_mib, device=0):
    """TestCudaMallocAsync's setup: a per_process_memory_fraction that lets ``extra_mib`` more
    MiB than what is reserved now be reserved on ``device``."""
    memory.empty_cache()
    _, all_memory = memory.get_memory_info(device)
    fraction = (extra_mib * MiB + memory.memory_reserved(device)) / all_memory
    memory.set_per_process_memory_fraction(fraction, device)
    return fraction


@pytest.fixture(params=[0, 1], ids=["device0", "device1"])
def device(request, monkeypatch):
    """The simulated CUDA runtime (two devices); the test works on this device, which is not the
    current one for device 1."""
    use_sim(monkeypatch, "cuda")
    assert accel.device_count() == 2
    return request.param


def _buffer(nbytes, device):
    return accel.Buffer(nbytes, device=device)


# ------------------------------------------------------------------ torch's tests, run-time form
def test_cuda__test_allocator_settings(device):
    """torch's test_allocator_settings with its run-time changes, on ``device``."""
    key_allocated = "active_bytes.all.allocated"
    key_requested = "requested_bytes.all.allocated"
    nelems = 21 * 1024 * 1024
    nbytes = 4 * nelems
    nelems_big = 100 * 1024 * 1024
    nbytes_big = 4 * nelems_big
    memory.empty_cache()
    stats = lambda: memory.memory_stats(device)          # noqa: E731
    start_mem = stats().get(key_allocated, 0)
    memory.set_allocator_settings("")
    x = _buffer(nbytes, device)
    reg_mem = stats()[key_allocated]
    start_requested = stats()[key_requested]
    memory.set_allocator_settings("roundup_power2_divisions:4")
    y = _buffer(nbytes, device)
    pow2_div4_mem = stats()[key_allocated]
    current_requested = stats()[key_requested]
    assert reg_mem - start_mem == nbytes
    assert pow2_div4_mem - reg_mem == power2_div(nbytes, 4)
    assert current_requested - start_requested == nbytes

    memory.set_allocator_settings("garbage_collection_threshold:0.5")
    memory.set_allocator_settings("garbage_collection_threshold:0.5,max_split_size_mb:40")
    # the power2 divisions went back to their default with the last call
    memory.empty_cache()
    start_mem = stats()[key_allocated]
    z = _buffer(nbytes, device)
    reg_mem = stats()[key_allocated]
    assert reg_mem - start_mem == nbytes

    # the array syntax: 84 MiB lies in [64, 128) MiB (8 divisions), 400 MiB in [256, 512) (2)
    memory.empty_cache()
    memory.set_allocator_settings(
        "garbage_collection_threshold:0.5,roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]")
    start_mem = stats()[key_allocated]
    w = _buffer(nbytes, device)
    assert stats()[key_allocated] - start_mem == power2_div(nbytes, 8)
    memory.empty_cache()
    start_mem = stats()[key_allocated]
    v = _buffer(nbytes_big, device)
    assert stats()[key_allocated] - start_mem == power2_div(nbytes_big, 2)
    del x, y, z, w, v

    for bad in ("foo:1,bar:2", "garbage_collection_threshold:1.2", "max_split_size_mb:2",
                "release_lock_on_cudamalloc:none", "pinned_use_cuda_host_register:none",
                "pinned_num_register_threads:none", "pinned_num_register_threads:1024"):
        with pytest.raises(RuntimeError):        # torch's; accel's AllocatorConfigError is a ValueError too
            memory.set_allocator_settings(bad)


@pytest.mark.parametrize("order", ["classic_first", "expandable_first"])
def test_cuda__test_max_split_expandable(device, order):
    """torch's test_max_split_expandable: expandable_segments switched between the allocations.
    Three 40 MiB blocks fit a 120 MiB cap, a fourth raises, and after freeing them one 120 MiB
    block fits: the retry releases the cached blocks, the expandable segment's pages included."""
    first, second = ("False", "True") if order == "classic_first" else ("True", "False")
    orig = memory.get_per_process_memory_fraction(device)
    try:
        _cap_to(120, device)
        memory.set_allocator_settings(f"expandable_segments:{first},max_split_size_mb:40")
        a = _buffer(40 * MiB, device)
        memory.set_allocator_settings(f"expandable_segments:{second},max_split_size_mb:40")
        b = _buffer(40 * MiB, device)
        memory.set_allocator_settings(f"expandable_segments:{first},max_split_size_mb:40")
        c = _buffer(40 * MiB, device)
        segments = memory.memory_snapshot()
        assert {s["is_expandable"] for s in segments if s["device"] == device} == {True, False}
        with pytest.raises(OutOfMemoryError):
            _buffer(40 * MiB, device)
        del a, b, c
        _buffer(120 * MiB, device).close()
    finally:
        memory.set_per_process_memory_fraction(orig, device)


def test_cuda__test_garbage_collect_expandable(device):
    """torch's test_garbage_collect_expandable: a classic and an expandable 40 MiB block freed,
    then 80 MiB under a 120 MiB cap: garbage collection runs with an expandable segment cached."""
    orig = memory.get_per_process_memory_fraction(device)
    try:
        _cap_to(120, device)
        memory.set_allocator_settings("expandable_segments:False,garbage_collection_threshold:0.5")
        a = _buffer(40 * MiB, device)
        memory.set_allocator_settings("expandable_segments:True,garbage_collection_threshold:0.5")
        b = _buffer(40 * MiB, device)
        del a, b
        _buffer(80 * MiB, device).close()
    finally:
        memory.set_per_process_memory_fraction(orig, device)


# ------------------------------------------------------------------ the rules
def test_get_allocator_settings_is_the_last_string_set(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="max_split_size_mb:64")
    assert memory.get_allocator_settings() == "max_split_size_mb:64"
    memory.set_allocator_settings("garbage_collection_threshold:0.6")
    assert memory.get_allocator_settings() == "garbage_collection_threshold:0.6"
    use_sim(monkeypatch, "cuda")
    for name in accel.memory._config.ENV_VARS:     # (ACCEL_TEST_ALLOC_CONF sets one of them)
        monkeypatch.delenv(name, raising=False)
    accel.memory._reset()
    assert memory.get_allocator_settings() == ""


def test_options_not_named_go_back_or_stay_as_torch_says(device):
    memory.set_allocator_settings("max_split_size_mb:64,roundup_power2_divisions:4,"
                                  "garbage_collection_threshold:0.7,max_non_split_rounding_mb:30,"
                                  "expandable_segments:False")
    alloc = memory.device_allocator(device)
    config = alloc.config
    assert config.max_split_size == 64 * MiB
    assert memory.memory_stats(device)["max_split_size"] == 64 * MiB
    memory.set_allocator_settings("release_threshold:4M")
    config = alloc.config
    assert config.max_split_size == accel.memory._config.UNLIMITED       # reset
    assert memory.memory_stats(device)["max_split_size"] == -1
    assert config.roundup_power2_divisions == accel.memory._config.AllocConfig().roundup_power2_divisions
    assert config.garbage_collection_threshold == 0.0
    assert config.max_non_split_rounding == 30 * MiB                    # kept
    assert config.expandable_segments is False                          # kept
    assert config.release_threshold == 4 * MiB


def test_settings_made_before_the_runtime_starts_reach_every_allocator(monkeypatch):
    use_sim(monkeypatch, "cuda")
    memory.set_allocator_settings("max_split_size_mb:48")
    assert not accel._lazy.is_initialized()          # a setting initializes nothing
    for index in (0, 1):
        assert memory.device_allocator(index).config.max_split_size == 48 * MiB


def test_the_fraction_named_applies_to_every_device_and_unnamed_stays(device):
    other = 1 - device
    memory.set_per_process_memory_fraction(0.25, other)
    memory.set_allocator_settings("garbage_collection_threshold:0.5")
    assert memory.get_per_process_memory_fraction(other) == 0.25         # not named: kept
    memory.set_allocator_settings("per_process_memory_fraction:0.5")
    assert memory.get_per_process_memory_fraction(device) == 0.5
    assert memory.get_per_process_memory_fraction(other) == 0.5
    _, total = memory.get_memory_info(device)
    with pytest.raises(OutOfMemoryError):
        _buffer(int(total * 0.6), device)


@pytest.mark.parametrize("bad", ["backend:cudaMallocAsync", "policy:torch", "max_split_size_mb:2",
                                 "nonsense:1", "expandable_segments:maybe", "max_split_size_mb=64"])
def test_a_refused_setting_changes_nothing(device, bad):
    memory.set_allocator_settings("max_split_size_mb:64,expandable_segments:False")
    alloc = memory.device_allocator(device)
    before = alloc.config
    with pytest.raises(AllocatorConfigError) as info:
        memory.set_allocator_settings(bad)
    assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)
    assert memory.get_allocator_settings() == "max_split_size_mb:64,expandable_segments:False"
    assert alloc.config == before
    if bad.startswith("backend"):
        assert "cannot change" in str(info.value) and "native" in str(info.value)


def test_the_same_backend_and_policy_may_be_named(device):
    memory.set_allocator_settings("backend:native,policy:accel,max_split_size_mb:40")
    assert memory.device_allocator(device).config.max_split_size == 40 * MiB


def test_wrong_type_is_a_type_error(device):
    with pytest.raises(TypeError, match="str"):
        memory.set_allocator_settings(None)
    with pytest.raises(TypeError, match="str"):
        memory.set_allocator_settings(b"max_split_size_mb:40")


def test_torch_private_names(device):
    memory._set_allocator_settings("max_split_size_mb:80")
    assert memory.device_allocator(device).config.max_split_size == 80 * MiB
    assert memory.get_allocator_settings() == "max_split_size_mb:80"


# ------------------------------------------------------------------ what a change does to live state
def test_oversize_counts_stay_consistent_when_max_split_changes(device):
    """A block allocated under one max_split_size and freed under another: the oversize counters
    never go negative and count exactly the live blocks and segments at or over the limit."""
    a = _buffer(50 * MiB, device)                          # no limit: not oversize
    memory.set_allocator_settings("max_split_size_mb:40")
    stats = memory.memory_stats(device)
    assert stats["oversize_allocations.current"] == 1     # 50 MiB is over the new limit
    del a
    stats = memory.memory_stats(device)
    assert stats["oversize_allocations.current"] == 0
    b = _buffer(60 * MiB, device)                          # counted under the limit
    memory.set_allocator_settings("")                      # no limit again
    assert memory.memory_stats(device)["oversize_allocations.current"] == 0
    del b
    stats = memory.memory_stats(device)
    assert stats["oversize_allocations.current"] == 0
    assert stats["oversize_segments.current"] == 0
    memory.empty_cache()
    stats = memory.memory_stats(device)
    assert min(v for k, v in stats.items() if k.startswith("oversize")) >= 0


def test_expandable_blocks_are_reused_and_released_after_switching_off(device):
    memory.set_allocator_settings("expandable_segments:True")
    a = _buffer(8 * MiB, device)
    ptr = a.ptr
    memory.set_allocator_settings("expandable_segments:False")
    a.close()
    b = _buffer(8 * MiB, device)                           # the cached expandable block
    assert b.ptr == ptr
    c = _buffer(3 * MiB, device)                           # a new segment: classic now
    kinds = {s["address"]: s["is_expandable"] for s in memory.memory_snapshot() if s["device"] == device}
    assert sorted(kinds.values()) == [False, True]
    b.close()
    c.close()
    memory.empty_cache()
    assert memory.memory_reserved(device) == 0
    assert [s for s in memory.memory_snapshot() if s["device"] == device] == []


def test_switching_on_after_classic_segments(device):
    memory.set_allocator_settings("expandable_segments:False")
    a = _buffer(8 * MiB, device)
    memory.set_allocator_settings("expandable_segments:True")
    b = _buffer(30 * MiB, device)
    kinds = sorted(s["is_expandable"] for s in memory.memory_snapshot() if s["device"] == device)
    assert kinds == [False, True]
    a.close()
    b.close()
    memory.empty_cache()
    assert memory.memory_reserved(device) == 0


def test_settings_change_while_other_threads_allocate(device):
    errors = []
    stop = threading.Event()

    def work():
        try:
            while not stop.is_set():
                bufs = [_buffer(n * MiB // 3, device) for n in (1, 5, 30, 70)]
                for buf in bufs:
                    buf.close()
        except BaseException as exc:        # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for i in range(60):
            memory.set_allocator_settings(["expandable_segments:False,max_split_size_mb:20",
                                           "expandable_segments:True,roundup_power2_divisions:4",
                                           "garbage_collection_threshold:0.5,release_threshold:0"][i % 3])
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    memory.empty_cache()
    assert memory.memory_reserved(device) == 0
    stats = memory.memory_stats(device)
    assert stats["allocated_bytes.all.current"] == 0
    assert min(v for k, v in stats.items() if k.endswith(".current")) >= 0


# ------------------------------------------------------------------ a bug the switch showed
def test_a_classic_miss_unmaps_free_expandable_pages_before_oom(device):
    """Under a cap, a MemPool (classic segments) miss while the general cache holds free mapped
    expandable pages: the retry unmaps them (torch's release_cached_blocks frees expandable
    segments' free pages too) instead of raising OutOfMemoryError."""
    memory.set_allocator_settings("expandable_segments:True")     # (whatever ACCEL_TEST_ALLOC_CONF says)
    orig = memory.get_per_process_memory_fraction(device)
    try:
        _cap_to(100, device)
        a = _buffer(60 * MiB, device)
        assert memory.memory_snapshot()[0]["is_expandable"]
        a.close()                                          # 60 MiB stay mapped, cached
        assert memory.memory_reserved(device) >= 60 * MiB
        with accel.device_index(device):
            pool = MemPool()                              # a pool of the current device
            with use_mem_pool(pool):
                b = _buffer(80 * MiB, device)
        b.close()
        del pool
    finally:
        memory.set_per_process_memory_fraction(orig, device)


def test_a_snapshot_reports_the_last_settings(device):
    memory.set_allocator_settings("garbage_collection_threshold:0.6,max_split_size_mb:64")
    buf = _buffer(MiB, device)
    settings = memory._snapshot(device)["allocator_settings"]
    assert settings["PYTORCH_CUDA_ALLOC_CONF"] == "garbage_collection_threshold:0.6,max_split_size_mb:64"
    assert settings["max_split_size"] == 64 * MiB
    assert settings["garbage_collection_threshold"] == 0.6
    buf.close()


def test_a_forked_child_keeps_the_settings(device):
    """As torch's options (process state), the settings set before a fork hold in the child."""
    memory.set_allocator_settings("garbage_collection_threshold:0.6")

    def child():
        return 0 if memory.get_allocator_settings() == "garbage_collection_threshold:0.6" else 3

    assert run_forked(child) == 0


def test_a_snapshot_before_any_allocator_reports_the_settings(monkeypatch):
    use_sim(monkeypatch, "cuda")
    memory.set_allocator_settings("max_split_size_mb:64")
    settings = memory._snapshot()["allocator_settings"]
    assert settings["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
    assert settings["max_split_size"] == 64 * MiB


def test_a_device_allocator_made_during_a_change_gets_the_new_settings(monkeypatch):
    """Device 1's allocator made by another thread while set_allocator_settings is applying the
    change to device 0: it must start with the new options, not the ones being replaced."""
    use_sim(monkeypatch, "cuda")
    first = memory.device_allocator(0)
    real = type(first).set_config
    made = []

    def slow(self, config, keep_fraction=False):
        t = threading.Thread(target=lambda: made.append(memory.device_allocator(1)))
        t.start()
        t.join(0.5)            # it finishes now unless allocator creation waits for the change
        made.append(t)
        return real(self, config, keep_fraction)

    monkeypatch.setattr(type(first), "set_config", slow)
    memory.set_allocator_settings("max_split_size_mb:48")
    monkeypatch.setattr(type(first), "set_config", real)
    made[-1].join()
    assert memory.device_allocator(1).config.max_split_size == 48 * MiB
