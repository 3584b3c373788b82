"""PyTorch's test/test_accelerator.py (TestAccelerator), ported to accel: tensors become
accel.Buffers and numpy arrays; torch.accelerator.X is accel.X.  Cases that need a tensor
library (torch.compile, dtype round trips of torch.empty, DataLoader's pin_memory helper) are
not ported.  Runs on every simulator, two devices where the backend has them."""

import gc
import operator

import numpy as np
import pytest

import accel
from accel import memory


def test_accelerator__current_accelerator(sim_backend):
    assert accel.is_available()
    assert accel.current_accelerator().type == sim_backend
    assert accel.current_accelerator().index is None
    with pytest.raises(ValueError, match="doesn't match the current accelerator"):
        accel.set_device_index("cpu")


def test_accelerator__generic_multi_device_behavior(sim_backend):
    if accel.device_count() < 2:
        pytest.skip("only one accelerator device")
    orig = accel.current_device_index()
    target = (orig + 1) % accel.device_count()
    accel.set_device_index(target)
    assert accel.current_device_index() == target
    accel.set_device_index(orig)
    assert accel.current_device_index() == orig
    s1 = accel.Stream(target)
    accel.set_stream(s1)
    assert accel.current_device_index() == target
    accel.synchronize(orig)
    assert accel.current_device_index() == target
    accel.set_device_index(orig)


def test_accelerator__generic_stream_behavior(sim_backend):
    s1, s2 = accel.Stream(), accel.Stream()
    accel.set_stream(s1)
    assert accel.current_stream() == s1
    event = accel.Event()
    a = np.random.default_rng(0).random(1000).astype(np.float32)
    b = np.random.default_rng(1).random(1000).astype(np.float32)
    accel.set_stream(s2)
    assert accel.current_stream() == s2
    a_acc = accel.Buffer(a.nbytes).copy_from(a, non_blocking=True)
    b_acc = accel.Buffer(b.nbytes).copy_from(b, non_blocking=True)
    accel.set_stream(s1)
    assert accel.current_stream() == s1
    event.record(s2)
    event.synchronize()
    event.record(s2)
    accel.synchronize()
    assert event.query()
    assert np.array_equal(a_acc.to_numpy(np.float32, stream=s2), a)
    assert np.array_equal(b_acc.to_numpy(np.float32, stream=s2), b)


def test_accelerator__current_stream_query(sim_backend):
    s = accel.current_stream()
    assert accel.current_stream(s.device) == s
    assert accel.current_stream(s.device.index) == s
    assert accel.current_stream(str(s.device)) == s
    with pytest.raises(ValueError, match="doesn't match the current accelerator"):
        accel.current_stream(accel.device("cpu"))


def test_accelerator__stream_compare_with_non_stream(sim_backend):
    s1 = accel.Stream()
    for other in (42, "hello", 3.14, None, object()):
        assert not s1 == other
        assert s1 != other
    assert s1 in [1, "a", s1]
    s2 = accel.Stream()
    for op in (operator.lt, operator.le, operator.gt, operator.ge):
        with pytest.raises(TypeError):
            op(s1, s2)
    sid, di, dt = s1.stream_id, s1.device_index, s1.device_type
    same = accel.Stream(stream_id=sid, device_index=di, device_type=dt)
    assert s1 == same
    assert not s1 != same


def test_accelerator__device_context_manager(sim_backend):
    prev = accel.current_device_index()
    with accel.device_index(None):
        assert accel.current_device_index() == prev
    assert accel.current_device_index() == prev
    with accel.device_index(0):
        assert accel.current_device_index() == 0
    assert accel.current_device_index() == prev


def test_accelerator__multi_device_context_manager(sim_backend):
    if accel.device_count() < 2:
        pytest.skip("only one accelerator device")
    accel.set_device_index(0)
    with accel.device_index(1):
        assert accel.current_device_index() == 1
    assert accel.current_device_index() == 0


def test_accelerator__stream_context_manager(sim_backend):
    prev = accel.current_stream()
    with accel.Stream() as s:
        assert accel.current_stream() == s
    assert accel.current_stream() == prev


def test_accelerator__stream_context_manager_reentrance(sim_backend):
    prev = accel.current_stream()
    s0 = accel.Stream()
    with s0, s0:
        assert accel.current_stream() == s0
    assert accel.current_stream() == prev
    s1 = accel.Stream()
    with s0:
        assert accel.current_stream() == s0
        with s1:
            assert accel.current_stream() == s1
            with s0:
                assert accel.current_stream() == s0
    assert accel.current_stream() == prev


def test_accelerator__multi_device_stream_context_manager(sim_backend):
    if accel.device_count() < 2:
        pytest.skip("only one accelerator device")
    accel.set_device_index(0)
    src_prev = accel.current_stream()
    dst_prev = accel.current_stream(1)
    with accel.Stream(1) as dst_stream:
        assert accel.current_device_index() == 1
        assert accel.current_stream() == dst_stream
        assert accel.current_stream(0) == src_prev
    assert accel.current_device_index() == 0
    assert accel.current_stream() == src_prev
    assert accel.current_stream(1) == dst_prev


def test_accelerator__pin_memory_on_non_blocking_copy(sim_backend):
    data = np.arange(100, dtype=np.float32)
    acc = accel.Buffer(data.nbytes).copy_from(data)
    host, event = acc.to_numpy(np.float32, non_blocking=True)
    accel.synchronize()
    assert memory.host_allocator().owns(host.ctypes.data, host.nbytes)
    assert np.array_equal(host, data)


def test_accelerator__generic_event_behavior(sim_backend):
    e1, e2 = accel.Event(enable_timing=False), accel.Event(enable_timing=False)
    with pytest.raises(ValueError, match="Both events must be created with argument 'enable_timing=True'"):
        e1.elapsed_time(e2)
    e1, e2 = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    with pytest.raises(ValueError, match="Both events must be recorded before calculating elapsed time"):
        e1.elapsed_time(e2)
    e1, e2 = accel.Event(), accel.Event()        # enable_timing defaults to False
    with pytest.raises(ValueError, match="Both events must be created with argument 'enable_timing=True'"):
        e1.elapsed_time(e2)


def test_accelerator__empty_host_cache(sim_backend):
    memory.empty_host_cache()        # before any allocation, on every backend


def test_accelerator__memory_stats(sim_backend):
    tmp = accel.Buffer(400)
    tmp.close()
    gc.collect()
    memory.empty_cache()
    stats = memory.memory_stats()
    expected = [f"{st}.{pt}.{mt}" for st in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes")
                for pt in ("all", "small_pool", "large_pool") for mt in ("peak", "current", "allocated", "freed")]
    assert [k for k in expected if k not in stats] == []
    prev_allocated, prev_reserved = memory.memory_allocated(), memory.memory_reserved()
    assert memory.max_memory_allocated() > 0 and memory.max_memory_reserved() > 0
    tmp = accel.Buffer(1024)
    assert memory.memory_allocated() > prev_allocated
    assert memory.memory_reserved() >= prev_reserved
    tmp.close()
    gc.collect()
    memory.empty_cache()
    memory.reset_peak_memory_stats()
    assert memory.memory_allocated() == prev_allocated
    assert memory.memory_reserved() == prev_reserved
    memory.reset_accumulated_memory_stats()
    prev_max_allocated, prev_max_reserved = memory.max_memory_allocated(), memory.max_memory_reserved()
    prev_active = memory.memory_stats()["active_bytes.all.current"]
    tmp = accel.Buffer(1024)
    assert memory.memory_stats()["active_bytes.all.current"] == 1024 + prev_active
    assert memory.memory_stats()["active_bytes.all.freed"] == 0
    tmp.close()
    gc.collect()
    memory.empty_cache()
    assert memory.memory_stats()["active_bytes.all.current"] == prev_active
    assert memory.memory_stats()["active_bytes.all.freed"] == 1024
    memory.reset_peak_memory_stats()
    assert memory.max_memory_allocated() == prev_max_allocated
    assert memory.max_memory_reserved() == prev_max_reserved


def test_accelerator__get_memory_info(sim_backend):
    free, total = memory.get_memory_info()
    assert free >= 0 and total >= 0


def test_accelerator__device_capability_supported_dtypes(sim_backend):
    caps = accel.get_device_capability()
    assert isinstance(caps["supported_dtypes"], set) and caps["supported_dtypes"]
