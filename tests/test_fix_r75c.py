"""r75c: on a backend whose pinned and device memory are one pool (Metal), each caching allocator's
out-of-memory retry frees the other's cache too (torch's MPS allocator frees every cached pool,
MPSHeapAllocatorImpl::release_cached_buffers), without ever waiting for the other's lock; the
counters and the OOM error stay as before, and CUDA (pinned memory beside the device's) is left alone.
"""

import contextlib
import threading

import numpy as np
import pytest

import accel
from accel import memory

from conftest import use_sim

MiB = 1 << 20


@pytest.fixture
def mps_small(monkeypatch):
    """A 64 MiB Metal device: recommendedMaxWorkingSetSize 64 MiB, maxBufferLength 48 MiB."""
    use_sim(monkeypatch, "mps", ACCEL_SIM_MEMORY="64M")
    assert accel.get_device_properties().extra["max_buffer_length"] == 48 * MiB


def _host_stats():
    return memory.host_allocator().stats()


def test_device_retry_releases_the_pinned_cache_with_its_counters(mps_small):
    staged = accel.empty_pinned(32 * MiB, np.uint8)
    del staged
    assert _host_stats()["reserved_bytes"] == 32 * MiB
    before = memory.memory_stats()
    big = accel.Buffer(40 * MiB)
    after = memory.memory_stats()
    assert after["num_alloc_retries"] == before["num_alloc_retries"] + 1     # one retry, as before
    assert after["num_ooms"] == before["num_ooms"]
    host = _host_stats()
    assert host["reserved_bytes"] == 0 and host["segments"] == 0 and host["num_host_free"] == 1
    torch_host = memory.host_memory_stats()
    assert torch_host["allocations.current"] == 0 and torch_host["num_host_free"] == 1
    del big


def test_pinned_retry_releases_the_device_cache_with_its_counters(mps_small):
    activations = accel.Buffer(40 * MiB)
    del activations
    before = memory.memory_stats()
    pinned = accel.empty_pinned(32 * MiB, np.uint8)
    after = memory.memory_stats()
    assert memory.memory_reserved() == 0 and after["segment.all.current"] == 0
    assert after["num_device_free"] == before["num_device_free"] + 1
    # the device allocator retried nothing: its counters say so
    assert after["num_alloc_retries"] == before["num_alloc_retries"]
    assert after["num_ooms"] == before["num_ooms"]
    assert _host_stats()["reserved_bytes"] == 32 * MiB
    del pinned


def test_an_oom_after_both_caches_went_still_names_the_sizes(mps_small):
    staged = accel.empty_pinned(8 * MiB, np.uint8)
    keep = accel.empty_pinned(32 * MiB, np.uint8)      # in use: not released
    del staged
    before = memory.memory_stats()
    with pytest.raises(accel.OutOfMemoryError, match=r"Tried to allocate 40\.00 MiB"):
        accel.Buffer(40 * MiB)
    after = memory.memory_stats()
    assert after["num_alloc_retries"] == before["num_alloc_retries"] + 1
    assert after["num_ooms"] == before["num_ooms"] + 1
    assert _host_stats()["reserved_bytes"] == 32 * MiB    # the freed one went back, the live one stays
    assert keep.nbytes == 32 * MiB


@contextlib.contextmanager
def _held_by_another_thread(lock):
    """``lock`` held by another thread for the body; the thread ends after it."""
    taken, done = threading.Event(), threading.Event()

    def hold():
        with lock:
            taken.set()
            done.wait(20)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    try:
        assert taken.wait(20)
        yield
    finally:
        done.set()
        t.join(20)
        assert not t.is_alive()     # (also when the body raised, as the tests expect it to)


def test_a_busy_pinned_lock_is_not_waited_for(mps_small):
    """The cross-release never waits: a thread holding the pinned allocator's lock (as its own
    retry would, calling into the device allocator) leaves the device OOM to be reported."""
    staged = accel.empty_pinned(32 * MiB, np.uint8)
    del staged
    host = memory.host_allocator()
    with pytest.raises(accel.OutOfMemoryError), _held_by_another_thread(host._lock):
        accel.Buffer(40 * MiB)
    assert accel.Buffer(40 * MiB).nbytes == 40 * MiB    # lock free again: the pinned cache goes


def test_a_busy_device_lock_is_not_waited_for(mps_small):
    activations = accel.Buffer(40 * MiB)
    del activations
    alloc = memory.device_allocator(0)
    with pytest.raises(accel.OutOfMemoryError), _held_by_another_thread(alloc._lock):
        accel.empty_pinned(32 * MiB, np.uint8)
    assert accel.empty_pinned(32 * MiB, np.uint8).nbytes == 32 * MiB


def test_cuda_keeps_the_pinned_cache_on_a_device_oom(monkeypatch):
    """CUDA's pinned memory is host RAM beside the device's: a device retry leaves it cached."""
    # (classic segments: the retry this fix changed; CUDA grows expandable ones by default)
    use_sim(monkeypatch, "cuda", ACCEL_SIM_MEMORY="64M", ACCEL_ALLOC_CONF="expandable_segments:False")
    from accel.backends.cuda import CudaBackend
    assert not CudaBackend.pinned_shares_device_memory
    staged = accel.empty_pinned(1 * MiB, np.uint8)
    del staged
    keep = accel.Buffer(32 * MiB)
    with pytest.raises(accel.OutOfMemoryError):
        accel.Buffer(40 * MiB)
    assert memory.memory_stats()["num_alloc_retries"] == 1
    assert _host_stats()["reserved_bytes"] == 1 * MiB
    del keep
