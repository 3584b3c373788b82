"""PyTorch's test/test_cuda_multigpu.py (TestCudaMultiGPU), ported to accel (issue 16).

Tensors become ``accel.Buffer``s (a float tensor of shape s is a Buffer of 4 * prod(s) bytes),
``torch.cuda.X`` is ``accel.X`` / ``accel.memory.X``, ``torch.cuda.device(i)`` is
``accel.device_index(i)`` and ``torch.cuda._sleep`` is ``torch_port_util.hold`` (a gate on the
simulated stream instead of a timed spin).  Tests that need tensor math, autograd, comm
(broadcast/scatter/gather), GradScaler or serialization are not ported; tests/TORCH_PORTS.md
lists every case and why.  Two simulated devices, the non-current one included.
"""

import contextlib
import gc
import random
import subprocess
import sys

import numpy as np
import pytest

import accel
from accel import _lazy, memory

from conftest import SIMS, use_sim
from torch_port_util import expected_memory_stats, held

MiB = 1 << 20


@pytest.fixture(params=[s for s in SIMS if s != "mps"])
def sim_multi(request, monkeypatch):
    """The simulators with two devices (the Metal simulator has one, as a Mac)."""
    return use_sim(monkeypatch, request.param)


@pytest.fixture
def sim_cuda_delayed(monkeypatch):
    """The CUDA simulator with every stream operation going through the stream's worker
    thread (so a stream can be held busy)."""
    return use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=1)


def _floats(*size, device=None):
    """torch.cuda.FloatTensor(*size) on ``device`` (None: the current device)."""
    return accel.Buffer(4 * int(np.prod(size, dtype=np.int64)) if size else 0, device)


# ------------------------------------------------------------------ synchronize
def test_cuda_multigpu__test_cuda_synchronize(sim_multi):
    sim_backend = sim_multi
    accel.synchronize()
    accel.synchronize(sim_backend)
    accel.synchronize(f"{sim_backend}:0")
    accel.synchronize(0)
    accel.synchronize(accel.device(sim_backend, 0))
    if accel.device_count() > 1:
        accel.synchronize(f"{sim_backend}:1")
        accel.synchronize(1)
        accel.synchronize(accel.device(sim_backend, 1))
    # torch.cuda.synchronize says "Expected a cuda device, but got: cpu"; accel (as
    # torch.accelerator.synchronize) says the type does not match the accelerator
    with pytest.raises(ValueError, match="doesn't match the current accelerator"):
        accel.synchronize(accel.device("cpu"))
    with pytest.raises(ValueError, match="doesn't match the current accelerator"):
        accel.synchronize("cpu")


# ------------------------------------------------------------------ memory stats
def _check_memory_stat_consistency():
    """TestCudaMultiGPU._check_memory_stat_consistency: every counter of memory_stats()
    agrees with what memory_snapshot() shows, device by device."""
    expected_each_device = expected_memory_stats(memory.memory_snapshot())
    for device, expected in expected_each_device.items():
        stats = memory.memory_stats(device)
        for k, v in expected.items():
            assert v == stats[k], (device, k)


def _memory_stats_generator(device=None, N=35, rng=None):
    """TestCudaMultiGPU._test_memory_stats_generator, allocating Buffers."""
    rng = rng or random.Random(0)
    if device is None:
        device = accel.current_device_index()
    m0 = memory.memory_allocated(device)
    last_m = [memory.memory_allocated(device)]
    max_m = [memory.max_memory_allocated(device)]
    last_r = [memory.memory_reserved(device)]
    max_r = [memory.max_memory_reserved(device)]

    def alloc(*size):
        with accel.device_index(device):
            return _floats(*size)

    def assert_change(comp=1, empty_cache=False, reset_peak=False):
        new_m = memory.memory_allocated(device)
        new_max_m = memory.max_memory_allocated(device)
        if comp > 0:
            assert new_m > last_m[0]
        elif comp < 0:
            assert new_m < last_m[0]
        else:
            assert new_m == last_m[0]
        assert new_m <= new_max_m
        assert new_max_m >= max_m[0]
        last_m[0], max_m[0] = new_m, new_max_m

        new_r = memory.memory_reserved(device)
        new_max_r = memory.max_memory_reserved(device)
        assert new_r <= new_max_r
        assert new_max_r >= max_r[0]
        last_r[0], max_r[0] = new_r, new_max_r

        if empty_cache:
            stats = memory.memory_stats(device)
            num_sync_1 = stats.get("num_sync_all_streams", -1)
            assert num_sync_1 >= 0
            num_alloc_1 = stats.get("num_device_alloc", -1)
            assert num_alloc_1 >= (0 if new_m == 0 else 1)
            num_free_1 = stats.get("num_device_free", -1)
            assert num_free_1 >= 0
            memory.empty_cache()
            stats = memory.memory_stats(device)
            assert stats.get("num_sync_all_streams", -1) == num_sync_1 + 1
            assert stats.get("num_device_alloc", -1) >= num_alloc_1
            assert stats.get("num_device_free", -1) >= num_free_1
            new_r = memory.memory_reserved(device)
            new_max_r = memory.max_memory_reserved(device)
            assert new_r <= last_r[0]
            assert new_r <= new_max_r
            assert new_max_r == max_r[0]
            last_r[0] = new_r

        if reset_peak:
            memory.reset_peak_memory_stats(device)
            assert memory.memory_allocated(device) == last_m[0]
            assert memory.max_memory_allocated(device) == last_m[0]
            max_m[0] = last_m[0]
            assert memory.memory_reserved(device) == last_r[0]
            assert memory.max_memory_reserved(device) == last_r[0]
            max_r[0] = last_r[0]

    assert_change(0)
    assert_change(0, reset_peak=True)
    assert_change(0, empty_cache=True)
    assert_change(0, reset_peak=True)
    assert_change(0)
    yield

    tensors1 = [alloc(1), alloc(10, 20), alloc(200, 300, 2000)]
    m1 = memory.memory_allocated(device)
    assert_change(1)
    yield

    tensors2 = []
    for i in range(1, int(N / 2) + 1):        # small ones
        tensors2.append(alloc(i, i * 4))
        assert_change(1)
        yield
    for i in range(5, int(N / 2) + 5):        # large ones
        tensors2.append(alloc(i, i * 7, i * 9, i * 11))
        assert_change(1, reset_peak=(i % 2 == 0))
        yield
    tensors2.append(alloc(0, 0, 0))
    assert_change(0)
    yield

    permute = []
    for i in rng.sample(range(len(tensors2)), len(tensors2)):
        permute.append(tensors2[i])
        assert_change(0)
        yield
    del tensors2
    assert_change(0)
    yield
    tensors2 = permute
    assert_change(0)
    yield
    del permute
    assert_change(0, reset_peak=True)
    yield

    for i in range(int(N / 2)):
        x = tensors2[i].nbytes
        del tensors2[i]
        assert_change(-x)                      # in case that tensors2[i] is empty
        yield
    for i in range(2, int(2 * N / 3) + 2):
        tensors2.append(alloc(i, i * 3, i * 8))
        assert_change(1)
        yield
    del tensors2
    assert_change(-1, reset_peak=True)
    assert_change(0)
    assert memory.memory_allocated(device) == m1
    yield True

    del tensors1
    assert_change(-1, reset_peak=True)
    assert memory.memory_allocated(device) == m0
    # test empty_cache and reset_peak
    assert_change(0, empty_cache=True)
    assert_change(0, reset_peak=True)


@pytest.mark.parametrize("conf", ["", "expandable_segments:False", "policy:torch,expandable_segments:False"])
def test_cuda_multigpu__test_memory_stats(monkeypatch, conf):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF=conf)
    gc.collect()
    memory.empty_cache()
    for _ in _memory_stats_generator():
        _check_memory_stat_consistency()


@pytest.mark.parametrize("conf", ["", "expandable_segments:False"])
def test_cuda_multigpu__test_memory_stats_multigpu(monkeypatch, conf):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF=conf)

    def advance(gen, end):
        if not end:
            try:
                next(gen)
            except StopIteration:
                end = True
        return end

    accel.current_device_index()          # torch's test process has initialized CUDA long before
    # interlace
    memory.empty_cache()
    gen0 = _memory_stats_generator(device="cuda:0", N=35)
    gen1 = _memory_stats_generator(device=accel.device("cuda:1"), N=35)
    end0 = end1 = False
    while not (end0 and end1):
        end0 = advance(gen0, end0)
        end1 = advance(gen1, end1)
        _check_memory_stat_consistency()

    # semi-random order
    memory.empty_cache()
    rng = random.Random(1)
    gen0 = _memory_stats_generator(device=0, N=35)
    gen1 = _memory_stats_generator(device=accel.device("cuda:1"), N=35)
    end0 = end1 = False
    while not (end0 and end1):
        end0 = advance(gen0, end0)
        gen1_max_times = rng.randrange(0, 3) if not end0 else float("inf")
        t = 0
        while t < gen1_max_times and not end1:
            end1 = advance(gen1, end1)
            t += 1


def test_cuda_multigpu__test_cuda_device_memory_allocated(sim_backend):
    count = accel.device_count()
    current_alloc = [memory.memory_allocated(idx) for idx in range(count)]
    x = accel.Buffer(40, f"{sim_backend}:0")
    assert memory.memory_allocated(0) > current_alloc[0]
    assert all(memory.memory_allocated(idx) == current_alloc[idx] for idx in range(1, count))
    x.close()


# ------------------------------------------------------------------ devices
def test_cuda_multigpu__test_cuda_set_device(sim_multi):
    sim_backend = sim_multi
    # x.cuda() lands on the current device: an accel.Buffer with no device does too
    with accel.device_index(1):
        assert accel.Buffer(4).device_index == 1
        accel.set_device_index(0)
        assert accel.Buffer(4).device_index == 0
        with accel.device_index(1):
            assert accel.Buffer(4).device_index == 1
        assert accel.Buffer(4).device_index == 0
        accel.set_device_index(1)
    assert accel.Buffer(4).device_index == 0


def test_cuda_multigpu__test_grad_scaling_device_as_key(sim_multi):
    sim_backend = sim_multi
    # dict keys: equal devices hash equal (the part of the test that is about devices)
    d = {}
    t = accel.Buffer(4, f"{sim_backend}:0")
    dev0a, dev0b = accel.device(f"{sim_backend}:0"), accel.device(sim_backend, 0)
    dev1a, dev1b = accel.device(f"{sim_backend}:1"), accel.device(sim_backend, 1)
    assert hash(dev0a) == hash(dev0b) and hash(dev1a) == hash(dev1b)
    d[dev0a] = "0a"
    d[dev0b] = "0b"
    assert len(d) == 1 and d[dev0a] == "0b"
    d[t.device] = "t"
    assert len(d) == 1 and d[dev0a] == "t"
    d[dev1a] = "1a"
    d[dev1b] = "1b"
    assert len(d) == 2 and d[dev1a] == "1b"


def test_cuda_multigpu__test_mem_get_info(sim_multi):
    sim_backend = sim_multi
    def _test(device):
        memory.empty_cache()
        accel.synchronize()
        before_free, before_total = memory.get_memory_info(device)
        t = accel.Buffer(4 * 1024 * 1024 * 8, device)     # 32 MiB: a new segment
        after_free, after_total = memory.get_memory_info(device)
        assert after_free < before_free
        assert before_total == after_total
        t.close()

    _test(0)
    _test(accel.device(sim_backend))
    _test(accel.device(sim_backend, 0))
    _test(sim_backend)
    _test(f"{sim_backend}:0")
    _test(1)
    _test(accel.device(sim_backend, 1))
    _test(f"{sim_backend}:1")


def test_cuda_multigpu__test_cuda_init_race():
    # https://github.com/pytorch/pytorch/issues/16559: two threads initialize at once
    script = """\
import threading
import accel

def worker(rank):
    b = accel.Buffer(4, rank)
    b.copy_from(bytes([rank] * 4))
    assert b.to_numpy().tolist() == [rank] * 4

threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("ok")
"""
    env = {"ACCEL_SIM": "cuda", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# ------------------------------------------------------------------ streams
def test_cuda_multigpu__test_current_stream(sim_multi):
    sim_backend = sim_multi
    d0, d1 = accel.device(sim_backend, 0), accel.device(sim_backend, 1)
    s0 = accel.current_stream()
    s1 = accel.current_stream(1)
    s2 = accel.current_stream(0)
    assert d0 == s0.device and d1 == s1.device and d0 == s2.device
    assert s0 == s2
    with accel.device_index(d1):
        s0 = accel.current_stream()
        s1 = accel.current_stream(1)
        s2 = accel.current_stream(d0)
    assert d1 == s0.device and d1 == s1.device and d0 == s2.device
    assert s0 == s1
    with pytest.raises(ValueError, match="doesn't match the current accelerator"):
        accel.current_stream(accel.device("cpu"))


def test_cuda_multigpu__test_default_stream(sim_multi):
    sim_backend = sim_multi
    d0, d1 = accel.device(sim_backend, 0), accel.device(sim_backend, 1)
    with accel.device_index(d0):
        s0 = accel.default_stream()
    with accel.device_index(d1):
        s1 = accel.default_stream()
    s2 = accel.default_stream(0)
    s3 = accel.default_stream(d1)
    assert d0 == s0.device and d1 == s1.device and d0 == s2.device and d1 == s3.device
    assert s0 == s2 and s1 == s3
    with accel.device_index(d0):
        assert accel.current_stream() == s0
    with accel.device_index(d1):
        assert accel.current_stream() == s1
    with pytest.raises(ValueError, match="doesn't match the current accelerator"):
        accel.default_stream(accel.device("cpu"))


def test_cuda_multigpu__test_stream_event_device(sim_multi):
    sim_backend = sim_multi
    d0, d1 = accel.device(sim_backend, 0), accel.device(sim_backend, 1)
    e0 = accel.Event()
    # torch.cuda.Event().device is None before the first record; accel.Event is torch.Event,
    # whose device is the accelerator type (no index) until then
    assert e0.device is None or e0.device.index is None
    with accel.device_index(d0):
        s0 = accel.current_stream()
        s0.record_event(e0)
    with accel.device_index(d1):
        s1 = accel.Stream()
        e1 = s1.record_event()
    assert s0.device == d0 and e0.device == d0
    assert s1.device == d1 and e1.device == d1


def test_cuda_multigpu__test_stream_context(sim_multi):
    sim_backend = sim_multi
    s0 = accel.current_stream()
    s1 = accel.Stream(device=1)
    s2 = accel.Stream(device=0)
    with accel.device_index(s1.device):
        prev_stream_on_1 = accel.current_stream()
    assert accel.current_stream() == s0 and accel.current_device_index() == 0
    with s1:
        assert accel.current_stream() == s1 and accel.current_device_index() == 1
        with s2:
            assert accel.current_stream() == s2 and accel.current_device_index() == 0
            with s0:
                assert accel.current_stream() == s0 and accel.current_device_index() == 0
            assert accel.current_stream() == s2 and accel.current_device_index() == 0
        assert accel.current_stream() == s1 and accel.current_device_index() == 1
    with accel.device_index(s1.device):
        assert prev_stream_on_1 == accel.current_stream()
    assert accel.current_stream() == s0 and accel.current_device_index() == 0


def test_cuda_multigpu__test_streams_multi_gpu(sim_multi):
    sim_backend = sim_multi
    default_stream = accel.current_stream()
    assert default_stream.device == accel.device(sim_backend, 0)
    stream = accel.Stream(device=1)
    assert stream.device == accel.device(sim_backend, 1)
    with accel.device_index(1):
        assert accel.current_stream().device == accel.device(sim_backend, 1)
        assert accel.current_stream() != default_stream


def test_cuda_multigpu__test_streams_multi_gpu_query(sim_cuda_delayed):
    d0, d1 = accel.device("cuda", 0), accel.device("cuda", 1)
    accel.synchronize(d0)
    accel.synchronize(d1)
    with accel.device_index(d0):
        s0 = accel.current_stream()
    with accel.device_index(d1):
        s1 = accel.current_stream()
    with held(s1):
        assert s0.query() and not s1.query()
        with accel.device_index(d0):
            assert s0.query() and not s1.query()
        with accel.device_index(d1):
            assert s0.query() and not s1.query()
    # deliberately synchronize from a different device (held() did s1.synchronize on device 0)
    with accel.device_index(d0):
        s1.synchronize()
    assert s0.query() and s1.query()
    with accel.device_index(d0):
        assert s0.query() and s1.query()
    with accel.device_index(d1):
        assert s0.query() and s1.query()


def test_cuda_multigpu__test_streams_multi_gpu_eq(sim_multi):
    sim_backend = sim_multi
    d0, d1 = accel.device(sim_backend, 0), accel.device(sim_backend, 1)
    with accel.device_index(d0):
        s0 = accel.current_stream()
        s1 = accel.current_stream()
    with accel.device_index(d1):
        s2 = accel.current_stream()
        s3 = accel.current_stream()
    assert s0 == s0 and s0 == s1 and s2 == s2 and s2 == s3
    assert not s0 == s2 and not s1 == s3
    assert s0.device == s1.device and s0.handle == s1.handle
    assert s2.device == s3.device and s2.handle == s3.handle
    assert s0.device != s3.device
    assert hash(s0) == hash(s1) and hash(s2) == hash(s3)
    assert hash(s0) != hash(s3)


def test_cuda_multigpu__test_streams_priority(sim_multi):
    sim_backend = sim_multi
    low, high = accel.Stream.priority_range()
    s0 = accel.Stream(device=0, priority=low)
    assert s0.priority == low and s0.device == accel.device(sim_backend, 0)
    s1 = accel.Stream(device=1, priority=high)
    assert s1.priority == high and s1.device == accel.device(sim_backend, 1)


# ------------------------------------------------------------------ events
def test_cuda_multigpu__test_events_wait(sim_cuda_delayed):
    d0, d1 = accel.device("cuda", 0), accel.device("cuda", 1)
    accel.synchronize(d0)
    accel.synchronize(d1)
    with accel.device_index(d0):
        s0 = accel.current_stream()
    with accel.device_index(d1):
        s1 = accel.current_stream()
    with held(s0) as (gate,):
        with accel.device_index(d0):
            e0 = accel.Event()
            s0.record_event(e0)
        assert not s0.query() and s1.query()
        s1.wait_event(e0)
        assert not s1.query()              # s1 now waits for device 0's work
        gate.set()
        s1.synchronize()
        assert e0.query() and s0.query() and s1.query()


def test_cuda_multigpu__test_events_multi_gpu_query(sim_cuda_delayed):
    d0, d1 = accel.device("cuda", 0), accel.device("cuda", 1)
    with accel.device_index(d0):
        s0 = accel.current_stream()
        e0 = s0.record_event()
        s0.synchronize()
    with accel.device_index(d1):
        s1 = accel.current_stream()
    with held(s1) as (gate,):
        with accel.device_index(d1):
            e1 = s1.record_event()
        assert e0.query() and not e1.query()
        with accel.device_index(d0):
            assert e0.query() and not e1.query()
        with accel.device_index(d1):
            assert e0.query() and not e1.query()
        gate.set()
        # deliberately using a different device
        with accel.device_index(d0):
            e1.synchronize()
    assert e0.query() and e1.query()
    with accel.device_index(d0):
        assert e0.query() and e1.query()
    with accel.device_index(d1):
        assert e0.query() and e1.query()


# ------------------------------------------------------------------ external streams
@contextlib.contextmanager
def _get_external_stream(device):
    """torch's helper: a stream another library made (torch: ``cudart.cudaStreamCreate`` under
    ``with device:``), destroyed by that library after the body.  Here the backend's own
    stream_create, outside any accel.Stream, so accel holds nothing of it."""
    backend = _lazy.lazy_init()
    with device:
        stream = backend.stream_create()
        try:
            assert stream != 0
            yield stream
        finally:
            gc.collect()            # the wrappers go first: the owner keeps the stream alive until then
            backend.stream_destroy(stream)


def test_cuda_multigpu__test_external_streams(sim_backend):
    # torch.cuda.ExternalStream(ptr) and torch.cuda.get_stream_from_external(ptr, device):
    # the handle is the pointer, the device the stream's.  `ext_stream.cuda_stream` is
    # `.handle`; torch passes the `torch.cuda.device(0)` object itself as the device, accel
    # takes its index (accel's device arguments are ints, strings and accel.device)
    device = accel.device_index(0)
    with _get_external_stream(device) as stream_v:
        ext_stream = accel.ExternalStream(stream_v)
        assert stream_v == ext_stream.handle
        assert ext_stream.device.index == device.idx
        ext_stream = accel.get_stream_from_external(stream_v, device.idx)
        assert stream_v == ext_stream.handle
        assert ext_stream.device.index == device.idx


def test_cuda_multigpu__test_external_streams_multi_device(sim_multi):
    # the stream is on device 1 while device 0 is current
    device = accel.device_index(1)
    assert accel.current_device_index() == 0
    with _get_external_stream(device) as stream_v:
        ext_stream = accel.ExternalStream(stream_v, device=device.idx)
        assert stream_v == ext_stream.handle
        assert ext_stream.device.index == device.idx
        ext_stream = accel.get_stream_from_external(stream_v, device.idx)
        assert stream_v == ext_stream.handle
        assert ext_stream.device.index == device.idx


# ------------------------------------------------------------------ pinned memory
def test_cuda_multigpu__test_caching_pinned_memory_multi_gpu(sim_cuda_delayed):
    # the events that keep pinned memory from reuse are recorded on the copy's device
    t = accel.empty_pinned(1, np.float32)
    t[0] = 1
    ptr = t.ctypes.data
    gpu0 = accel.Buffer(4, 0)
    gpu1 = accel.Buffer(4, 1)
    with held(accel.current_stream(1)):
        with accel.device_index(1):
            gpu1.copy_from(t, non_blocking=True)
        del t
        t = accel.empty_pinned(1, np.float32)
        t[0] = 2
        assert t.ctypes.data != ptr, "allocation reused too soon"
        with accel.device_index(0):
            gpu0.copy_from(t, non_blocking=True)
    assert gpu1.to_numpy(np.float32)[0] == 1
    assert gpu0.to_numpy(np.float32)[0] == 2


def test_cuda_multigpu__test_caching_pinned_memory_multi_gpu_download(sim_cuda_delayed):
    # the same rule for a download into a pinned array (the copy accel leaves queued)
    t = accel.empty_pinned(1, np.float32)
    ptr = t.ctypes.data
    gpu1 = accel.Buffer(4, 1).copy_from(np.ones(1, np.float32))
    with held(accel.current_stream(1)):
        gpu1.copy_to(t, non_blocking=True)
        del t
        t2 = accel.empty_pinned(1, np.float32)
        assert t2.ctypes.data != ptr, "allocation reused too soon"


# ------------------------------------------------------------------ RNG
def test_cuda_multigpu__test_get_set_rng_state_all(sim_multi):
    sim_backend = sim_multi
    states = accel.random.get_rng_state_all()
    before0 = accel.random.normal_(accel.Buffer(400, 0)).to_numpy(np.float32)
    before1 = accel.random.normal_(accel.Buffer(400, 1)).to_numpy(np.float32)
    accel.random.set_rng_state_all(states)
    after0 = accel.random.normal_(accel.Buffer(400, 0)).to_numpy(np.float32)
    after1 = accel.random.normal_(accel.Buffer(400, 1)).to_numpy(np.float32)
    assert np.array_equal(before0, after0) and np.array_equal(before1, after1)


def test_cuda_multigpu__test_rng_state_offset(sim_backend):
    # torch.cuda._set_rng_state_offset / _get_rng_state_offset: the generator's offset
    before = accel.random.get_rng_state()
    gen = accel.random.default_generator(accel.current_device_index())
    gen.set_offset(100)
    offset = gen.offset
    accel.random.set_rng_state(before)
    assert offset == 100


# ------------------------------------------------------------------ copies between streams
def _copy_sync_current_stream(x, y):
    """_test_copy_sync_current_stream: a copy between devices is ordered with the current
    streams of both devices (torch copies on the source's current stream with a two-way
    barrier; accel copies on the destination's with the same barriers)."""
    x_plus_one = accel.Buffer(x.nbytes, x.device).fill_(2)
    x.fill_(1)
    accel.synchronize(0)
    accel.synchronize(1)
    s0 = accel.Stream(device=x.device)
    s1 = accel.Stream(device=y.device)
    s2 = accel.Stream(device=x.device)
    s3 = accel.Stream(device=y.device)

    # same dst stream different src streams
    with held(s0):
        with s0:
            with s1:
                y.copy_from(x_plus_one, non_blocking=True)
        with s2, s1:
            y.copy_from(x, non_blocking=True)
    s1.synchronize()
    # the copy() is synchronized on the current streams of both src and dst: x is copied to
    # y after x_plus_one is
    assert _value(y) == 1

    # same src stream different dst streams
    with held(s1):
        with s1:
            with s0:
                y.copy_from(x_plus_one, non_blocking=True)
        with s3, s0:
            y.copy_from(x, non_blocking=True)
    s0.synchronize()
    assert _value(y) == 1


def _value(buf):
    data = buf.to_numpy()
    assert (data == data[0]).all(), data
    return int(data[0])


def test_cuda_multigpu__test_copy_streams(sim_cuda_delayed):
    x0 = accel.Buffer(100, "cuda:0").fill_(0)
    x1 = accel.Buffer(100, "cuda:1").fill_(0)
    _copy_sync_current_stream(x0, x1)
    x2 = accel.Buffer(100, "cuda:0").fill_(0)
    _copy_sync_current_stream(x0, x2)
