"""PyTorch's test/test_xpu.py (TestXpu, TestMemPool), ported to accel on the simulated Level Zero
runtime (ACCEL_SIM=xpu, two devices): device queries, streams, events, the generator, the
caching allocator's stats and limits, lazy init and fork.

``torch.xpu.X`` is ``accel.X`` / ``accel.memory.X`` / ``accel.random.X``; a float tensor of n
elements is ``accel.Buffer(4 * n)``; ``torch.xpu.device`` / ``_DeviceGuard`` /
``torch.accelerator.device_index`` are ``accel.device_index``.  tests/TORCH_PORTS.md lists every
test of the file and why the others are not ported.
"""

import gc
import subprocess
import sys
import threading

import numpy as np
import pytest

import accel
from accel import memory
from accel._errors import OutOfMemoryError
from accel.memory import MemPool, use_mem_pool

from conftest import use_sim

MiB = 1 << 20


@pytest.fixture
def sim_xpu(monkeypatch):
    """The simulated Level Zero runtime, two devices."""
    return use_sim(monkeypatch, "xpu")


def _run(script: str, **env) -> subprocess.CompletedProcess:
    base = {"PATH": "/usr/bin:/bin", "ACCEL_SIM": "xpu"}
    base.update(env)
    return subprocess.run([sys.executable, "-c", script], env=base, capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------ device queries
def test_xpu__test_device_behavior(sim_xpu):
    current_device = accel.current_device_index()
    accel.set_device_index(current_device)
    assert accel.current_device_index() == current_device


def test_xpu__test_multi_device_behavior(sim_xpu):
    current_device = accel.current_device_index()
    target_device = (current_device + 1) % accel.device_count()
    with accel.device_index(target_device):                  # torch.xpu.device
        assert accel.current_device_index() == target_device
    assert accel.current_device_index() == current_device
    with accel.device_index(target_device):                  # torch.xpu._DeviceGuard
        assert accel.current_device_index() == target_device
    assert accel.current_device_index() == current_device


def test_xpu__test_get_device_properties(sim_xpu):
    current_device = accel.current_device_index()
    props = accel.get_device_properties(current_device)
    assert props == accel.get_device_properties(None)
    assert props == accel.get_device_properties()
    # torch.xpu.get_device_name is the properties' name
    assert props.name == accel.get_device_properties(None).name == accel.get_device_properties().name
    # torch.xpu.get_device_capability(): device_id, max_work_group_size (Level Zero's
    # ze_device_properties_t / ze_device_compute_properties_t) and the driver version
    assert props.extra["device_id"] > 0
    assert props.extra["max_work_group_size"] > 0
    assert props.extra["driver_version"] > 0
    assert len(str(props.uuid)) == 36                         # xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx
    assert len(props.uuid.bytes) == 16
    for index in range(accel.device_count()):                # the non-current device too
        other = accel.get_device_properties(index)
        assert other.index == index and len(other.uuid.bytes) == 16
    assert accel.get_device_properties(0).uuid != accel.get_device_properties(1).uuid


# ------------------------------------------------------------------ fork and lazy init
def test_xpu__test_wrong_xpu_fork():
    script = """\
import multiprocessing
import accel

def run(rank):
    accel.set_device_index(rank)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("fork")
    size = 2
    processes = []
    for rank in range(size):
        # it would work fine without the line below
        accel.set_device_index(0)
        p = ctx.Process(target=run, args=(rank,))
        p.start()
        processes.append(p)
    for p in processes:
        p.join()
"""
    out = _run(script)
    assert "Cannot re-initialize XPU in forked subprocess." in out.stderr, out.stderr


def test_xpu__test_lazy_init():
    """No device work at import: children forked from a parent that only imported accel use
    the device, and the parent counts afterwards."""
    script = """\
import multiprocessing
import numpy as np
import accel

def run_model(x):
    buf = accel.Buffer(x.nbytes).copy_from(x)
    assert np.array_equal(buf.to_numpy(np.float32), x)

def test_multi_process(x):
    p = multiprocessing.get_context("fork").Process(target=run_model, args=(x,))
    p.start()
    p.join()
    assert p.exitcode == 0

if __name__ == "__main__":
    x = np.arange(32 * 3, dtype=np.float32)
    test_multi_process(x)
    test_multi_process(x)
    print(accel.device_count())
"""
    out = _run(script)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "2"


# ------------------------------------------------------------------ streams and events
def test_xpu__test_streams(sim_xpu):
    s0 = accel.Stream()
    accel.set_stream(s0)
    s1 = accel.current_stream()
    assert s0 == s1
    s2 = accel.Stream()
    assert not s0 == s2
    accel.set_stream(s2)
    with s0:                                                  # torch.xpu.stream(s0)
        assert accel.current_stream() == s0
    assert accel.current_stream() == s2


def test_xpu__test_stream_priority(sim_xpu):
    low, high = accel.Stream.priority_range()
    s0 = accel.Stream(0, priority=low)
    assert s0.priority == low
    assert s0.device == accel.device("xpu", 0)
    s1 = accel.Stream(0, priority=high)
    assert s1.priority == high
    assert s1.device == accel.device("xpu", 0)
    s2 = accel.Stream(1, priority=high)                       # the non-current device
    assert s2.priority == high and s2.device == accel.device("xpu", 1)


def test_xpu__test_stream_event_repr(sim_xpu):
    s = accel.current_stream()
    assert "accel.Stream" in str(s)                           # torch: "torch.xpu.Stream"
    e = accel.Event()
    assert "accel.Event" in str(e) and "recorded=False" in str(e)   # torch: "(uninitialized)"
    s.record_event(e)
    assert "accel.Event" in str(e) and "recorded=True" in str(e)


def test_xpu__test_events(sim_xpu):
    stream = accel.current_stream()
    event = accel.Event()
    assert event.query()
    stream.record_event(event)
    event.synchronize()
    assert event.query()
    start_event = accel.Event(enable_timing=True)
    end_event = accel.Event(enable_timing=True)
    stream.record_event(start_event)
    accel.Buffer(4 * 1024).fill_(1)                           # torch: time.sleep(0.1)
    stream.record_event(end_event)
    accel.synchronize()
    assert start_event.elapsed_time(end_event) >= 0           # no timed asserts: the order only

    event = accel.Event(enable_timing=True)
    assert event.handle == 0                                  # torch: sycl_event == event_id == 0
    event.record()
    assert event.handle != 0


def test_xpu__test_generic_stream_event(sim_xpu):
    stream = accel.Stream()                                   # torch.Stream("xpu")
    assert stream.device_index == accel.current_device_index()
    xpu_stream = accel.Stream(stream_id=stream.stream_id, device_index=stream.device_index,
                              device_type=stream.device_type)
    assert isinstance(xpu_stream, accel.Stream)
    assert stream.stream_id == xpu_stream.stream_id
    assert stream.stream_id != accel.current_stream().stream_id

    event1 = accel.Event("xpu", enable_timing=True)
    event2 = accel.Event("xpu", enable_timing=True)
    assert event1.handle == 0
    a = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    with xpu_stream:
        a_xpu = accel.Buffer(a.nbytes).copy_from(a, non_blocking=True)
        assert accel.current_stream().stream_id == stream.stream_id
    event1.record(stream)
    event1.synchronize()
    assert event1.query()
    c_xpu = accel.Buffer(a.nbytes).copy_from(a_xpu)           # torch: a_xpu + b_xpu
    event2.record()                                           # intentionally another stream
    event2.synchronize()
    assert event2.query()
    assert event1.handle != event2.handle
    assert np.array_equal(c_xpu.to_numpy(np.float32), a)
    assert event1.elapsed_time(event2) >= 0
    assert isinstance(accel.Event(), accel.Event)


def test_xpu__test_stream_compatibility(sim_xpu):
    s1, s2 = accel.Stream(), accel.Stream()
    accel.set_stream(s1)
    assert accel.current_stream().stream_id == s1.stream_id
    accel.set_stream(s2)
    assert accel.current_stream().stream_id == s2.stream_id
    with pytest.raises(RuntimeError, match="Device index value .* is out of index range"):
        accel.current_stream(accel.device_count())            # torch: "The device index is out of range"


def test_xpu__test_device_context_manager(sim_xpu):
    prev_device = accel.current_device_index()
    with accel.device_index(None):
        assert accel.current_device_index() == prev_device
    assert accel.current_device_index() == prev_device
    with accel.device_index(0):
        assert accel.current_device_index() == 0
    assert accel.current_device_index() == prev_device


def test_xpu__test_multi_device_context_manager(sim_xpu):
    src_device, dst_device = 0, 1
    accel.set_device_index(src_device)
    with accel.device_index(dst_device):
        assert accel.current_device_index() == 1
    assert accel.current_device_index() == src_device


def test_xpu__test_stream_context_manager(sim_xpu):
    prev_stream = accel.current_stream()
    with accel.Stream() as stream:
        assert stream == accel.current_stream()
    assert prev_stream == accel.current_stream()


def test_xpu__test_multi_device_stream_context_manager(sim_xpu):
    src_device, dst_device = 0, 1
    accel.set_device_index(src_device)
    src_prev_stream = accel.current_stream(src_device)
    dst_prev_stream = accel.current_stream(dst_device)
    with accel.Stream(dst_device) as dst_stream:
        assert accel.current_device_index() == dst_device
        assert accel.current_stream() == dst_stream
        assert accel.current_stream(src_device) == src_prev_stream
    assert accel.current_device_index() == src_device
    assert accel.current_stream() == src_prev_stream
    assert accel.current_stream(dst_device) == dst_prev_stream


# ------------------------------------------------------------------ generator
def test_xpu__test_generator(sim_xpu):
    accel.random.manual_seed_all(2024)                        # torch.manual_seed
    g_state0 = accel.random.get_rng_state()
    accel.random.manual_seed_all(1234)
    g_state1 = accel.random.get_rng_state()
    assert not np.array_equal(g_state0, g_state1)

    accel.random.manual_seed(2024)                            # torch.xpu.manual_seed
    g_state2 = accel.random.get_rng_state()
    assert np.array_equal(g_state0, g_state2)

    accel.random.set_rng_state(g_state1)
    assert np.array_equal(g_state1, accel.random.get_rng_state())

    accel.random.manual_seed_all(1234)
    accel.random.set_rng_state(g_state0)
    assert accel.random.initial_seed() == 2024


# ------------------------------------------------------------------ caching allocator
def test_xpu__test_out_of_memory(sim_xpu):
    tensor = accel.Buffer(4 * 1024)                           # noqa: F841 (torch.zeros(1024))
    with pytest.raises(RuntimeError, match="Tried to allocate 800000000.00 GiB"):
        accel.Buffer(1024 * 1024 * 1024 * 800000000)
    with pytest.raises(RuntimeError, match="XPU out of memory."):
        accel.Buffer(1024 * 1024 * 1024 * 8000000000)


def test_xpu__test_raises_oom(sim_xpu):
    memory.empty_cache()
    with pytest.raises(OutOfMemoryError):
        accel.Buffer(4 * 1024 * 1024 * 1024 * 1024)


def test_xpu__test_set_per_process_memory_fraction(sim_xpu):
    gc.collect()
    memory.empty_cache()
    total_memory = accel.get_device_properties().total_memory
    fraction = 0.5
    orig_fraction = memory.get_per_process_memory_fraction()
    # torch.xpu says "invalid fraction:-0.1. Please set within [0, 1]."; accel torch.cuda's words
    with pytest.raises(ValueError, match="Invalid fraction value:"):
        memory.set_per_process_memory_fraction(-0.1)
    with pytest.raises(ValueError, match="Invalid fraction value:"):
        memory.set_per_process_memory_fraction(1.1)

    memory.set_per_process_memory_fraction(fraction)
    allowed_memory = int(total_memory * 0.49)
    reserved_memory = memory.memory_reserved()
    application_memory = allowed_memory - reserved_memory
    tensor = accel.Buffer(application_memory)
    del tensor
    gc.collect()
    memory.empty_cache()

    assert memory.get_per_process_memory_fraction() == fraction

    application_memory = int(total_memory * 0.51)
    with pytest.raises(OutOfMemoryError):
        accel.Buffer(application_memory)
    assert memory.get_per_process_memory_fraction(1) == 1.0  # the other device keeps its own
    memory.set_per_process_memory_fraction(orig_fraction)


def test_xpu__test_memory_allocation(sim_xpu):
    memory.empty_cache()
    prev_allocated = memory.memory_allocated()
    prev_reserved = memory.memory_reserved()
    assert prev_allocated >= 0 and prev_reserved >= 0
    a = accel.Buffer(4 * 10).fill_(0)                         # torch.ones(10)
    assert memory.memory_allocated() > prev_allocated
    assert memory.memory_reserved() >= prev_reserved
    del a
    assert memory.memory_allocated() == prev_allocated
    memory.empty_cache()
    assert memory.memory_reserved() <= prev_reserved
    memory.reset_accumulated_memory_stats()
    prev_active_current = memory.memory_stats()["active_bytes.all.current"]
    a = accel.Buffer(4 * 256)                                 # torch.randn(256): 1 KiB
    assert memory.memory_stats()["active_bytes.all.current"] == 1024 + prev_active_current
    assert memory.memory_stats()["active_bytes.all.freed"] == 0
    del a
    assert memory.memory_stats()["active_bytes.all.current"] == prev_active_current
    assert memory.memory_stats()["active_bytes.all.freed"] == 1024


def test_xpu__test_device_memory_allocated(sim_xpu):
    device_count = accel.device_count()
    current_alloc = [memory.memory_allocated(idx) for idx in range(device_count)]
    a = accel.Buffer(4 * 10, 0)
    assert memory.memory_allocated(0) > current_alloc[0]
    assert all(memory.memory_allocated(idx) == current_alloc[idx] for idx in range(1, device_count))
    del a


def test_xpu__test_memory_stats(sim_xpu):
    accel.current_device_index()
    gc.collect()
    memory.empty_cache()
    memory.reset_peak_memory_stats()
    memory.reset_accumulated_memory_stats()
    prev_allocated = memory.memory_allocated()
    prev_reserved = memory.memory_reserved()
    prev_max_allocated = memory.max_memory_allocated()
    prev_max_reserved = memory.max_memory_reserved()
    assert prev_allocated == prev_max_allocated
    assert prev_reserved == prev_max_reserved
    prev_active_current = memory.memory_stats()["active_bytes.all.current"]
    tmp = accel.Buffer(4 * 256)
    assert memory.memory_stats()["active_bytes.all.current"] == 1024 + prev_active_current
    assert memory.memory_stats()["active_bytes.all.freed"] == 0
    del tmp
    gc.collect()
    memory.empty_cache()
    assert memory.memory_stats()["active_bytes.all.current"] == prev_active_current
    assert memory.memory_stats()["active_bytes.all.freed"] == 1024
    memory.reset_peak_memory_stats()
    assert memory.max_memory_allocated() == prev_max_allocated
    assert memory.max_memory_reserved() == prev_max_reserved


def test_xpu__test_mem_get_info(sim_xpu):
    for device in (0, 1):
        accel.synchronize(device)
        memory.empty_cache()
        before_free_bytes, before_total_bytes = memory.get_memory_info(device)
        x = accel.Buffer(4 * 1024 * 256, device)              # 1 MiB: a new block
        accel.synchronize(device)
        after_free_bytes, after_total_bytes = memory.get_memory_info(device)
        assert before_free_bytes >= after_free_bytes
        assert before_total_bytes == after_total_bytes
        del x


def test_xpu__test_can_device_access_peer(sim_xpu):
    # symmetric on every pair of the two simulated devices (torch skips it with one device)
    device_count = accel.device_count()
    assert device_count >= 2
    for device in range(device_count):
        for peer in range(device_count):
            assert accel.can_device_access_peer(device, peer) == accel.can_device_access_peer(peer, device)


def test_xpu__test_dlpack_conversion(sim_xpu):
    x = accel.Buffer(4 * 5).copy_from(np.arange(5, dtype=np.float32))
    z = accel.from_dlpack(x)
    try:
        host = z.to_numpy(np.float32)
        host[0] += 1.0
        z.copy_from(host)                                     # z[0] = z[0] + 1.0
        assert np.array_equal(z.to_numpy(np.float32), x.to_numpy(np.float32))
    finally:
        z.close()


# ------------------------------------------------------------------ TestMemPool
def test_xpu__test_mempool_id(sim_xpu):
    pool1 = MemPool().id
    pool2 = MemPool().id
    assert (pool1[0] == 0) == (pool2[0] == 0)
    assert abs(pool2[1] - pool1[1]) > 0


def test_xpu__test_mempool_multithread(sim_xpu):
    pool_ids = []

    def create_mempool_and_make_active():
        pool = MemPool()
        pool_ids.extend([pool.id])

    threads = [threading.Thread(target=create_mempool_and_make_active) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(pool_ids)) == 4


def test_xpu__test_mempool_empty_cache(sim_xpu):
    memory.empty_cache()
    pool = MemPool()
    x = accel.Buffer(4 * 1024 * 1024)                         # torch.empty(1024, 1024)
    with use_mem_pool(pool):
        y = accel.Buffer(4 * 1024 * 1024)
    del x
    del y
    peak_reserved = memory.memory_reserved()
    del pool
    after_pool_release = memory.memory_reserved()
    assert after_pool_release < peak_reserved
    assert after_pool_release > 0
