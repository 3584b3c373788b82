"""The parts of PyTorch's test/test_mps.py on torch.mps memory, synchronize, Event, the
generator (manual_seed, get_rng_state) and the allocator's readings, ported to accel on the
simulated Metal runtime (ACCEL_SIM=mps, one device, as Metal exposes).

``torch.mps.current_allocated_memory()`` is ``memory.memory_allocated()``;
``torch.mps.driver_allocated_memory()`` (Metal's ``currentAllocatedSize``) is
``total - free`` of ``memory.get_memory_info()``; ``torch.mps.recommended_max_memory()``
(``recommendedMaxWorkingSetSize``) is the device's ``total_memory``; ``torch.randn(n,
device="mps", generator=g)`` is ``accel.random.normal_(Buffer(4 * n), generator=g)``.
tests/TORCH_PORTS.md lists every test considered and why the others are not ported.
"""

import gc

import numpy as np
import pytest

import accel
from accel import memory
from accel._errors import OutOfMemoryError

from conftest import use_sim

MiB = 1 << 20


@pytest.fixture
def sim_mps(monkeypatch):
    """The simulated Metal runtime (one device)."""
    return use_sim(monkeypatch, "mps")


@pytest.fixture
def sim_mps_delayed(monkeypatch):
    """Metal simulator whose command buffers complete on the queue's thread, later."""
    return use_sim(monkeypatch, "mps", ACCEL_SIM_DELAY_US=2000)


def _randn(n: int, generator=None) -> np.ndarray:
    """torch.randn(n, device="mps", generator=generator) read back."""
    return accel.random.normal_(accel.Buffer(4 * n), generator=generator).to_numpy(np.float32)


def _driver_allocated_memory() -> int:
    """torch.mps.driver_allocated_memory(): what Metal holds for the process."""
    free, total = memory.get_memory_info()
    return total - free


# ------------------------------------------------------------------ TestMPS: generator
def test_mps__test_mps_generator(sim_mps):
    g_mps = accel.random.Generator(0)                         # torch.Generator(device="mps")
    g_mps.manual_seed(999)
    mps_x = _randn(5, g_mps)
    g_mps.manual_seed(999)
    mps_y = _randn(5, g_mps)
    assert np.array_equal(mps_x, mps_y)
    g_state = g_mps.get_state()
    mps_x = _randn(5, g_mps)
    assert not np.array_equal(mps_x, mps_y)
    mps_y = mps_x
    g_mps.set_state(g_state)
    mps_x = _randn(5, g_mps)
    assert np.array_equal(mps_x, mps_y)


def test_mps__test_default_mps_generator(sim_mps):
    accel.random.manual_seed_all(230)                         # torch.manual_seed
    mps_x = _randn(5)
    accel.random.manual_seed(230)                             # torch.mps.manual_seed
    mps_y = _randn(5)
    assert np.array_equal(mps_x, mps_y)
    g_state = accel.random.get_rng_state()
    mps_x = _randn(5)
    assert not np.array_equal(mps_x, mps_y)
    # torch's "offset is 2 after two randn calls" counts calls; accel's Philox offset counts
    # 32-bit values drawn, as torch's CUDA generator (the offset moved, that is all it checks)
    assert accel.random.default_generator(0).offset > 0
    mps_y = mps_x
    accel.random.set_rng_state(g_state)
    mps_x = _randn(5)
    assert np.array_equal(mps_x, mps_y)


# ------------------------------------------------------------------ TestMPS: synchronize, events
def test_mps__test_device_synchronize(sim_mps_delayed):
    x = accel.Buffer(4 * 128 * 6 * 6)
    accel.random.uniform_(x)                                  # torch.rand(1, 128, 6, 6)
    accel.synchronize()                                       # torch.mps.synchronize
    y = accel.Buffer(x.nbytes).copy_from(x, non_blocking=True)   # torch: net1(x)
    accel.synchronize()
    assert np.array_equal(y.to_numpy(np.float32), x.to_numpy(np.float32))
    y.fill_(0)
    accel.synchronize()
    assert not y.to_numpy().any()


def test_mps__test_mps_event_module(sim_mps_delayed):
    start_event = accel.Event(enable_timing=True)             # torch.mps.Event
    start_event.record()
    x = accel.random.uniform_(accel.Buffer(4 * 128 * 6 * 6))
    accel.Buffer(x.nbytes).copy_from(x, non_blocking=True)    # torch: the ConvTranspose2d
    end_event = accel.Event(enable_timing=True)
    end_event.record()
    # torch.mps's elapsed_time waits for the events, so no synchronize first
    elapsed = start_event.elapsed_time(end_event)
    assert elapsed >= 0.0                                     # torch asserts > 0 (a timed assert)


def test_mps__test_generic_event(sim_mps_delayed):
    start_event = accel.Event("mps", enable_timing=True)     # torch.Event('mps', ...)
    start_event.record()
    accel.random.uniform_(accel.Buffer(4 * 128 * 6 * 6))
    end_event = accel.Event("mps", enable_timing=True)
    end_event.record()
    assert start_event.elapsed_time(end_event) >= 0.0


def test_mps__test_generic_device_synchronize(sim_mps_delayed):
    event = accel.Event("mps")
    rng = np.random.default_rng(0)
    a = rng.standard_normal(1000).astype(np.float32)
    a_acc = accel.Buffer(a.nbytes).copy_from(a, non_blocking=True)
    event.record()
    event.synchronize()
    c_acc = accel.Buffer(a.nbytes).copy_from(a_acc, non_blocking=True)   # torch: a_acc + b_acc
    event.record()
    accel.synchronize()                                       # torch.accelerator.synchronize
    assert event.query()
    assert np.array_equal(c_acc.to_numpy(np.float32), a)


# ------------------------------------------------------------------ TestMPS: allocator readings
def test_mps__test_mps_allocator_module(sim_mps):
    gc.collect()
    memory.empty_cache()
    current_alloc_before = memory.memory_allocated()         # torch.mps.current_allocated_memory
    assert current_alloc_before == 0
    driver_alloc_before = _driver_allocated_memory()
    x = accel.Buffer(4 * 1024 * 1024 * 8)                     # torch.ones(8M): a new Metal heap
    x.fill_(0)
    current_alloc_after = memory.memory_allocated()
    driver_alloc_after = _driver_allocated_memory()
    assert current_alloc_after > current_alloc_before
    assert driver_alloc_after > driver_alloc_before


def test_mps__test_mps_allocator_stats(sim_mps):
    max_memory = accel.get_device_properties().total_memory  # torch.mps.recommended_max_memory
    assert max_memory > 0
    assert max_memory == accel.get_device_properties().extra["recommended_max_working_set_size"]
    assert memory.get_memory_info()[1] == max_memory


# ------------------------------------------------------------------ TestMemoryLeak
class _MpsMemoryLeakCheck:
    """test_mps.py's MpsMemoryLeakCheck, reduced to its driver reading: after gc and
    empty_cache, what Metal holds must be back where it was, else "MPS driver API confirmed"
    a leak."""

    def __enter__(self):
        gc.collect()
        memory.empty_cache()
        self.before = _driver_allocated_memory()
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is not None:
            return False
        gc.collect()
        memory.empty_cache()
        after = _driver_allocated_memory()
        if after > self.before:
            raise RuntimeError(f"MPS driver API confirmed a leak: {after - self.before} bytes still held")
        return False


def test_mps__test_mps_memory_leak_detection(sim_mps):
    held = []

    def no_leak():
        # device memory used and dropped, its last use still queued when the check runs
        x = accel.Buffer(4 * 1024 * 1024 * 8)
        x.fill_(1)

    def leak_gpu0():
        held.append(accel.Buffer(4 * 1024 * 1024 * 8))        # 32 MiB: a new block

    with _MpsMemoryLeakCheck():
        no_leak()
    with pytest.raises(RuntimeError, match=r"MPS driver API confirmed .+"):
        with _MpsMemoryLeakCheck():
            leak_gpu0()


def test_mps__test_copy_cast_no_leak(sim_mps):
    """What Metal holds comes back down at empty_cache, even for a buffer whose last use is
    still queued (torch's MPS emptyCache commits and waits for the stream first)."""
    def step(buf):
        host = buf.to_numpy(np.float32)                       # x.to("cpu")
        back = accel.Buffer(host.nbytes // 2)                 # x.to("mps", float16): left queued
        back.copy_from(host.astype(np.float16), non_blocking=True)
        back.fill_(0)

    a = accel.random.normal_(accel.Buffer(4 * 128 * 128))     # float16 in torch: accel fills float32
    step(a)                                                   # warm up
    memory.empty_cache()
    driver_before = _driver_allocated_memory()
    step(a)
    memory.empty_cache()
    driver_after = _driver_allocated_memory()
    assert driver_before == driver_after, f"Detected {driver_after - driver_before} bytes leak of GPU memory"


# ------------------------------------------------------------------ torch.mps.set_per_process_memory_fraction
def test_mps__set_per_process_memory_fraction_caps_at_recommended_max(sim_mps):
    """torch/mps/__init__.py: the allowed memory is fraction x recommendedMaxWorkingSetSize,
    past it an out-of-memory error.  (torch.mps takes 0~2, 0 = no limit; accel keeps
    torch.cuda's 0~1 on every backend: TORCH_PORTS.md.)"""
    total = accel.get_device_properties().total_memory
    memory.empty_cache()
    with pytest.raises(TypeError, match="Invalid type for fraction argument, must be `float`"):
        memory.set_per_process_memory_fraction(1)
    memory.set_per_process_memory_fraction(0.5)
    try:
        ok = accel.Buffer(int(total * 0.49))
        del ok
        memory.empty_cache()
        with pytest.raises(OutOfMemoryError):
            accel.Buffer(int(total * 0.51))
    finally:
        memory.set_per_process_memory_fraction(1.0)
    big = accel.Buffer(int(total * 0.51))                     # the cap is lifted
    del big
