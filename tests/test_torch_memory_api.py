"""torch 2.13's memory API layout on accel (issue 16, "Module layout"): the memory functions
re-exported at the top level, set/get_per_process_memory_fraction at run time,
host_memory_stats with torch's keys, synchronize's argument check before init, and the
reset_* functions' device resolution.  Tests are named after the PyTorch test they port
(``test/test_cuda.py``, ``test/test_accelerator.py``); tensors become allocator calls.
"""

import random

import pytest

import accel
from accel import _lazy, memory
from accel._errors import OutOfMemoryError

from conftest import use_sim

MiB = 1 << 20

#: torch/accelerator/__init__.py (2.13) imports these from .memory
_TORCH_ACCELERATOR_MEMORY = ("empty_cache", "empty_host_cache", "get_memory_info", "max_memory_allocated",
                             "max_memory_reserved", "memory_allocated", "memory_reserved", "memory_stats",
                             "reset_accumulated_memory_stats", "reset_peak_memory_stats")


# ------------------------------------------------------------------ module layout
def test_accelerator__memory_functions_at_top_level(sim_backend):
    """torch.accelerator.memory_stats is torch.accelerator.memory.memory_stats (and so on)."""
    for name in _TORCH_ACCELERATOR_MEMORY:
        assert getattr(accel, name) is getattr(memory, name), name
        assert name in accel.__all__
    assert accel.memory_stats() == {}                   # before init: empty, and no init
    assert not _lazy.is_initialized()
    ptr = memory.device_allocator(0).malloc(1024)
    assert accel.memory_allocated() == memory.memory_allocated() > 0
    memory.device_allocator(0).free(ptr)


# ------------------------------------------------------------------ per-process memory fraction
def test_cuda__test_set_per_process_memory_fraction(sim_cuda):
    """test_cuda.py::test_set_per_process_memory_fraction."""
    orig = memory.get_per_process_memory_fraction(0)
    alloc = memory.device_allocator(0)
    try:
        with pytest.raises(TypeError, match="Invalid type"):
            memory.set_per_process_memory_fraction(1)
        with pytest.raises(ValueError, match="Invalid fraction value"):
            memory.set_per_process_memory_fraction(-0.1)
        with pytest.raises(ValueError, match="Invalid fraction value"):
            memory.set_per_process_memory_fraction(2.0)
        with pytest.raises(ValueError, match="Invalid fraction value: nan"):
            memory.set_per_process_memory_fraction(float("nan"))

        tensor = alloc.malloc(1024 * 4)
        memory.empty_cache()
        total_memory = accel.get_device_properties(0).total_memory
        memory.set_per_process_memory_fraction(0.5, 0)

        # test 0.499 allocation is ok.
        application = int(total_memory * 0.499) - memory.max_memory_reserved()
        tmp = alloc.malloc(application)
        alloc.free(tmp)
        memory.empty_cache()

        application = int(total_memory * 0.5)
        # it will get OOM when try to allocate more than half memory.
        with pytest.raises(RuntimeError, match="out of memory"):
            alloc.malloc(application)

        # ensure out of memory error doesn't disturb subsequent work
        alloc.free(tensor)
        alloc.free(alloc.malloc(1024 * 4))
    finally:
        memory.set_per_process_memory_fraction(orig, 0)


def test_cuda__test_get_per_process_memory_fraction(sim_cuda):
    """test_cuda.py::test_get_per_process_memory_fraction: 1.0 and 0.0 are the limiting
    cases, and a set value reads back."""
    init_fraction = memory.get_per_process_memory_fraction()
    assert init_fraction == 1.0
    memory.set_per_process_memory_fraction(1.0)
    assert memory.get_per_process_memory_fraction() == 1.0
    memory.set_per_process_memory_fraction(0.0)
    assert memory.get_per_process_memory_fraction() == 0.0
    with pytest.raises(OutOfMemoryError, match="0 bytes allowed; "):
        memory.device_allocator(0).malloc(1024)            # 0.0: no new segment at all
    rng = random.Random(16)
    for val in (rng.random() for _ in range(3)):
        memory.set_per_process_memory_fraction(val)
        assert memory.get_per_process_memory_fraction() == val
    memory.set_per_process_memory_fraction(init_fraction)


def test_cuda__test_set_per_process_memory_fraction_device_argument(sim_cuda):
    """The fraction belongs to the named device (int, "cuda:1", accel.device); a device of
    another type or out of range raises as torch's _get_device_index and allocator do."""
    memory.set_per_process_memory_fraction(0.25, "cuda:1")
    assert memory.get_per_process_memory_fraction(1) == 0.25
    assert memory.get_per_process_memory_fraction(accel.device("cuda", 0)) == 1.0
    with pytest.raises(ValueError, match="cpu doesn't match the current accelerator cuda."):
        memory.set_per_process_memory_fraction(0.5, "cpu")
    with pytest.raises(RuntimeError, match="out of range"):
        memory.set_per_process_memory_fraction(0.5, 2)


# ------------------------------------------------------------------ host_memory_stats
def _empty_host_stats():
    return {
        "allocated_bytes.allocated": 0, "allocated_bytes.current": 0, "allocated_bytes.freed": 0,
        "allocated_bytes.peak": 0, "allocations.allocated": 0, "allocations.current": 0,
        "allocations.freed": 0, "allocations.peak": 0, "host_alloc_time.count": 0,
        "host_free_time.count": 0, "num_host_alloc": 0, "num_host_free": 0,
        "active_bytes.allocated": 0, "active_bytes.current": 0, "active_bytes.freed": 0,
        "active_bytes.peak": 0, "active_requests.allocated": 0, "active_requests.current": 0,
        "active_requests.freed": 0, "active_requests.peak": 0,
    }


def test_cuda__test_host_memory_stats(sim_backend):
    """test_cuda.py::test_host_memory_stats (torch 2.13): torch's keys, power-of-two blocks,
    allocations/allocated_bytes for owned blocks, active_* for handed-out ones."""
    assert memory.host_memory_stats() == {}             # before init, as torch's
    accel.current_device_index()
    stats = memory.host_memory_stats()
    keys = {f"{k}.{s}" for k in ("allocations", "allocated_bytes", "active_requests", "active_bytes")
            for s in ("current", "peak", "allocated", "freed")}
    keys |= {f"{k}.{s}" for k in ("host_alloc_time", "host_free_time")
             for s in ("total", "max", "min", "count", "avg")}
    keys |= {"num_host_alloc", "num_host_free"}
    assert set(stats) == keys and list(stats) == sorted(stats)

    def check_stats(expected):
        stats = memory.host_memory_stats()
        for k, v in expected.items():
            assert stats[k] == v, k

    host = memory.host_allocator()
    expected = _empty_host_stats()
    memory.empty_host_cache()
    check_stats(expected)
    t1 = host.malloc(10 * 1024 * 4)                      # torch.ones(10 * 1024, pin_memory=True)
    for prefix in ("active_requests", "allocations"):
        for suffix in ("allocated", "current", "peak"):
            expected[f"{prefix}.{suffix}"] += 1
    size1 = 16 * 1024 * 4
    for prefix in ("allocated_bytes", "active_bytes"):
        for suffix in ("allocated", "current", "peak"):
            expected[f"{prefix}.{suffix}"] += size1
    expected["num_host_alloc"] += 1
    expected["host_alloc_time.count"] += 1
    check_stats(expected)

    t2 = host.malloc(20 * 1024 * 4)
    for prefix in ("active_requests", "allocations"):
        for suffix in ("allocated", "current", "peak"):
            expected[f"{prefix}.{suffix}"] += 1
    size2 = 32 * 1024 * 4
    for prefix in ("allocated_bytes", "active_bytes"):
        for suffix in ("allocated", "current", "peak"):
            expected[f"{prefix}.{suffix}"] += size2
    expected["num_host_alloc"] += 1
    expected["host_alloc_time.count"] += 1
    check_stats(expected)

    host.free(t1)                                        # del t1
    expected["active_requests.current"] -= 1
    expected["active_requests.freed"] += 1
    expected["active_bytes.current"] -= size1
    expected["active_bytes.freed"] += size1
    check_stats(expected)

    host.free(t2)
    expected["active_requests.current"] -= 1
    expected["active_requests.freed"] += 1
    expected["active_bytes.current"] -= size2
    expected["active_bytes.freed"] += size2
    check_stats(expected)

    memory.empty_host_cache()                            # torch._C._host_emptyCache()
    expected["allocations.current"] -= 2
    expected["allocations.freed"] += 2
    expected["allocated_bytes.current"] -= size1 + size2
    expected["allocated_bytes.freed"] += size1 + size2
    expected["num_host_free"] += 2
    expected["host_free_time.count"] += 2
    check_stats(expected)

    memory.reset_accumulated_host_memory_stats()
    memory.reset_peak_host_memory_stats()
    after = memory.host_memory_stats()
    assert after["allocations.allocated"] == after["allocations.freed"] == 0
    assert after["active_bytes.peak"] == 0 and after["host_alloc_time.count"] == 0


# ------------------------------------------------------------------ synchronize and reset_*
def test_accelerator__synchronize_checks_the_device_before_init(sim_backend):
    """torch.accelerator.synchronize resolves its argument before the lazy-init no-op:
    synchronize("cpu") raises before init as after, and a bad string too."""
    for _ in range(2):
        with pytest.raises(ValueError, match=f"cpu doesn't match the current accelerator {sim_backend}."):
            accel.synchronize("cpu")
        with pytest.raises(RuntimeError, match="Invalid device string"):
            accel.synchronize(f"{sim_backend}0")
        if not _lazy.is_initialized():
            accel.synchronize()                          # a no-op that does not initialize
            accel.synchronize(sim_backend)
            accel.synchronize(0)
            assert not _lazy.is_initialized()
            accel.current_device_index()


@pytest.mark.parametrize("reset, counter", [
    (memory.reset_peak_memory_stats, "allocated_bytes.all.peak"),
    (memory.reset_accumulated_memory_stats, "allocated_bytes.all.allocated"),
])
def test_accelerator__reset_memory_stats_device_resolution(sim_cuda, reset, counter):
    """torch.accelerator.reset_*: a no-op before the allocator is initialized (nothing is
    resolved, nothing initialized); then _get_device_index(device, optional=True): an int,
    "cuda:1", accel.device("cuda", 1), "cuda" / None = the current device; another type is
    a ValueError and an index past the count a RuntimeError (torch's "Invalid device
    argument") that is also a ValueError."""
    reset("cpu")
    reset(7)
    assert not _lazy.is_initialized()
    a0, a1 = memory.device_allocator(0), memory.device_allocator(1)
    p0, p1 = a0.malloc(MiB), a1.malloc(MiB)
    a0.free(p0)
    a1.free(p1)
    for dev in (1, "cuda:1", accel.device("cuda", 1)):
        assert memory.memory_stats(1)[counter] == MiB
        reset(dev)
        assert memory.memory_stats(1)[counter] == 0
        assert memory.memory_stats(0)[counter] == MiB   # only the named device
        a1.free(a1.malloc(MiB))
    accel.set_device_index(1)
    for dev in ("cuda", None, accel.device("cuda")):
        reset(dev)
        assert memory.memory_stats(1)[counter] == 0 and memory.memory_stats(0)[counter] == MiB
        a1.free(a1.malloc(MiB))
    with pytest.raises(ValueError, match="cpu doesn't match the current accelerator cuda."):
        reset("cpu")
    with pytest.raises(RuntimeError, match=r"device index 2 is out of range"):
        reset(2)
    with pytest.raises(ValueError, match=r"device index 2 is out of range"):
        reset("cuda:2")
