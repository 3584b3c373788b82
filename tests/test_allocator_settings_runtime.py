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

import pytest

import accel
from accel import MemPool, memory, use_mem_pool

from conftest import use_sim

MiB = 1 << 20


def _power2_div(size, div_factor):
    # torch's test helper: the size rounded up to one of div_factor divisions of its power of two
    pow2 = 1
    while pow2 < size:
        pow2 *= 2
    if pow2 == size:
        return pow2
    step = pow2 / 2 / div_factor
    ret = pow2 / 2
    while ret < size:
        ret += step
    return int(ret)


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


# ------------------------------------------------------------------ a bug the switch showed
def test_a_classic_miss_unmaps_free_expandable_pages_before_oom(device):
    """Under a cap, a MemPool (classic segments) miss while the general cache holds free mapped
    expandable pages: the retry unmaps them (torch's release_cached_blocks frees expandable
    segments' free pages too) instead of raising OutOfMemoryError."""
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
