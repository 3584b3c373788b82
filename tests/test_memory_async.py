"""``ACCEL_ALLOC_CONF=backend:cudaMallocAsync`` (issue 15 item 5) on the simulated CUDA runtime,
on both devices (device 0 current, so device 1 is the non-current one): the driver's
stream-ordered pool behind the caching allocator's interface (accel/memory/_async.py)."""

import numpy as np
import pytest

import accel
from accel import _lazy, memory, sim
from accel._errors import OutOfMemoryError
from accel.memory import _async, _config
from accel.memory._caching import DeviceCachingAllocator
from conftest import use_sim

MiB = 1 << 20
CONF = "backend:cudaMallocAsync"


@pytest.fixture
def be(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF=CONF)
    b = _lazy.lazy_init()
    yield b
    sim.reset()


def pool(be, index, name):
    return be.mem_pool_get(index, name)


def device_free(be, index):
    with accel.streams.on_device(be, index):
        return be.mem_info()[0]


# -- configuration ---------------------------------------------------------------------------

def test_parse_backend_key():
    assert _config.parse(CONF).backend == "cudaMallocAsync"
    assert _config.parse("backend:native").backend == "native"
    assert _config.AllocConfig().backend == "native"
    with pytest.raises(ValueError, match="'backend'.*native or cudaMallocAsync"):
        _config.parse("backend:cudamallocasync")


@pytest.mark.parametrize("var", ["ACCEL_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_selected_by_each_variable(monkeypatch, var):
    use_sim(monkeypatch, "cuda", **{var: CONF})
    for index in (0, 1):
        alloc = memory.device_allocator(index)
        assert isinstance(alloc, _async.AsyncPoolAllocator) and alloc.device_index == index
        # torch's setup of the pool: keep everything, every reuse policy on
        be = _lazy.lazy_init()
        assert pool(be, index, "release_threshold") == (1 << 64) - 1
        for name in _async._REUSE:
            assert pool(be, index, name) == 1


def test_default_stays_native(monkeypatch):
    use_sim(monkeypatch, "cuda")
    assert isinstance(memory.device_allocator(1), DeviceCachingAllocator)


@pytest.mark.parametrize("kind", ["xpu", "mps"])
def test_backend_without_pools_is_a_config_error(monkeypatch, kind):
    use_sim(monkeypatch, kind, ACCEL_ALLOC_CONF=CONF)
    with pytest.raises(ValueError, match=r"ACCEL_ALLOC_CONF: option 'backend:cudaMallocAsync' cannot be used: "
                                         r".*no stream-ordered memory pool.*backend:native"):
        memory.device_allocator(0)
    with pytest.raises(ValueError, match="backend:cudaMallocAsync"):
        accel.Buffer(64)


def test_cuda_device_without_pools_is_a_config_error(be, monkeypatch):
    real = type(be)._device_attribute

    def attribute(self, attr, index):
        return 0 if (attr, index) == (115, 1) else real(self, attr, index)   # cudaDevAttrMemoryPoolsSupported
    monkeypatch.setattr(type(be), "_device_attribute", attribute)
    assert isinstance(memory.device_allocator(0), _async.AsyncPoolAllocator)
    with pytest.raises(ValueError, match=r"cuda device 1 has no memory pools \(cudaDevAttrMemoryPoolsSupported"):
        memory.device_allocator(1)


# -- allocation --------------------------------------------------------------------------

@pytest.mark.parametrize("index", [0, 1])
def test_alloc_free_reuse(be, index):
    alloc = memory.device_allocator(index)
    stream = be.default_stream(index)
    ptrs = [alloc.malloc(n, stream) for n in (1, 1000, 3 * MiB)]
    assert alloc.malloc(0) == 0 and len(set(ptrs)) == 3
    reserved = pool(be, index, "reserved_current")
    used = pool(be, index, "used_current")
    assert used >= 3 * MiB + 1001 and reserved == -(-used // (2 * MiB)) * (2 * MiB)   # whole pages
    for p in ptrs:
        alloc.free(p)
    alloc.free(0)
    with accel.streams.on_device(be, index):
        be.stream_synchronize(stream)
    assert pool(be, index, "used_current") == 0
    # the pool kept the memory (release threshold: everything) and serves the same sizes again
    again = [alloc.malloc(n, stream) for n in (1, 1000, 3 * MiB)]
    assert pool(be, index, "reserved_current") == reserved
    for p in again:
        alloc.free(p)
    stats = alloc.stats()
    assert stats["num_device_alloc"] == 6 and stats["num_device_free"] == 6
    assert stats["allocation.all.allocated"] == 6 and stats["allocation.all.freed"] == 6
    assert stats["allocation.all.peak"] == 3 and stats["allocation.all.current"] == 0
    assert stats["requested_bytes.all.peak"] == 1 + 1000 + 3 * MiB
    assert stats["reserved_bytes.all.current"] == reserved == stats["reserved_bytes.all.peak"]
    # the other device's pool was not touched
    assert pool(be, 1 - index, "reserved_current") == 0


@pytest.mark.parametrize("index", [0, 1])
def test_buffer_round_trip(be, index):
    """Buffers on either device (device 1 is not current) through the pool."""
    s = accel.Stream(device=index)
    buf = accel.Buffer(3 * 4096, device=index, stream=s)
    assert isinstance(memory.device_allocator(index), _async.AsyncPoolAllocator)
    buf.copy_from(np.arange(3 * 4096, dtype=np.uint8))
    assert (buf.to_numpy() == np.arange(3 * 4096, dtype=np.uint8)).all()
    assert memory.memory_allocated(index) >= 3 * 4096
    buf.close()
    s.synchronize()
    assert memory.memory_stats(index)["allocation.all.current"] == 0
    assert sim.state().errors == []


def test_stats_keys_match_native(be):
    alloc = memory.device_allocator(1)
    native = DeviceCachingAllocator(be, 1, _config.AllocConfig())
    assert list(alloc.stats()) == list(native.stats())
    p = alloc.malloc(5000)
    stats = alloc.stats()
    assert stats["reserved_bytes.all.current"] == pool(be, 1, "reserved_current")
    assert stats["allocated_bytes.all.current"] == pool(be, 1, "used_current") == stats["active_bytes.all.current"]
    assert stats["allocated_bytes.all.peak"] == pool(be, 1, "used_high")
    assert stats["reserved_bytes.all.peak"] == pool(be, 1, "reserved_high")
    assert stats["requested_bytes.all.current"] == 5000 and stats["max_split_size"] == -1
    assert stats["segment.all.current"] == 0          # the driver's pool keeps no segments accel sees
    alloc.free(p)
    be.set_device(1)
    be.device_synchronize()
    be.set_device(0)
    alloc.reset_peak_stats()
    stats = alloc.stats()
    assert stats["allocated_bytes.all.peak"] == 0 and stats["requested_bytes.all.peak"] == 0
    assert stats["reserved_bytes.all.peak"] == stats["reserved_bytes.all.current"]
    alloc.reset_accumulated_stats()
    assert alloc.stats()["num_device_alloc"] == 0 and alloc.stats()["allocation.all.allocated"] == 0
    assert alloc.map_stats() == {"num_device_map": 0, "num_device_unmap": 0}
    assert memory.memory_summary(1)        # the table renders from these stats


def test_history_and_snapshot(be):
    memory.record_history(True)
    alloc = memory.device_allocator(1)
    p = alloc.malloc(4096)
    alloc.free(p)
    snap = alloc.snapshot()
    assert snap["segments"] == []
    assert [e["action"] for e in snap["device_traces"]] == ["alloc", "free_requested", "free_completed"]
    assert snap["device_traces"][0]["addr"] == p
    assert memory.memory_snapshot() == []
    memory.record_history(False)


# -- streams ---------------------------------------------------------------------------------

DELAY_US = 30000
N = 1 << 16


@pytest.mark.parametrize("index", [0, 1])
def test_record_stream_orders_the_free(monkeypatch, index):
    """The free waits for the recorded stream: its late write to the block must land in live
    memory (the simulator faults a write to memory its pool took back), and the pool's
    used bytes drop only once that stream is done."""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF=CONF, ACCEL_SIM_DELAY_US=DELAY_US)
    be = _lazy.lazy_init()
    alloc = memory.device_allocator(index)
    with accel.streams.on_device(be, index):
        mine, slow = be.stream_create(), be.stream_create()
        scratch = be.mem_alloc(N)
    ptr = alloc.malloc(N, mine)
    for _ in range(3):                        # the slow stream is busy for ~90 ms ...
        be.memset_async(scratch, 0, N, slow)
    be.memset_async(ptr, 0xAA, N, slow)       # ... before it writes the block
    alloc.record_stream(ptr, slow)
    alloc.free(ptr)
    be.stream_synchronize(mine)               # the free on `mine` waited for `slow`
    assert be.stream_query(slow), "the free on the allocation stream did not wait for the recorded stream"
    assert pool(be, index, "used_current") == 0
    assert sim.state().errors == []
    with accel.streams.on_device(be, index):
        be.mem_free(scratch)
        for s in (mine, slow):
            be.stream_destroy(s)


def test_stream_destroyed_before_free(be):
    """Memory allocated on (or used by) a stream that is destroyed is freed on the default
    stream, after the dead stream's work."""
    alloc = memory.device_allocator(1)
    s, user = accel.Stream(device=1), accel.Stream(device=1)
    a = alloc.malloc(4096, s.handle)
    b = alloc.malloc(4096)
    alloc.record_stream(b, user.handle, 1)
    events = sim.state().events
    s.close()
    user.close()
    alloc.free(a)
    alloc.free(b)
    be.set_device(1)
    be.device_synchronize()
    be.set_device(0)
    assert pool(be, 1, "used_current") == 0
    assert sim.state().events <= events           # the dead streams' events were destroyed
    assert sim.state().errors == []


# -- empty_cache, OOM, bad frees ----------------------------------------------------------

@pytest.mark.parametrize("index", [0, 1])
def test_empty_cache_trims_the_pool(be, index):
    alloc = memory.device_allocator(index)
    before = device_free(be, index)
    ptrs = [alloc.malloc(8 * MiB) for _ in range(4)]
    assert device_free(be, index) <= before - 32 * MiB
    for p in ptrs:
        alloc.free(p)
    assert device_free(be, index) <= before - 32 * MiB      # kept in the pool
    memory.empty_cache()
    assert device_free(be, index) == before
    assert alloc.stats()["reserved_bytes.all.current"] == 0
    assert alloc.stats()["num_sync_all_streams"] == 1


def _state(alloc):
    stats = dict(alloc.stats())
    stats.pop("num_ooms")
    return stats, dict(alloc._ptrs)


@pytest.mark.parametrize("index", [0, 1])
def test_oom_is_clear_and_changes_nothing(be, index):
    alloc = memory.device_allocator(index)
    keep = alloc.malloc(MiB)
    before = _state(alloc)
    with pytest.raises(OutOfMemoryError, match=rf"(?s)CUDA out of memory. Allocation on device {index} would exceed "
                                               r"allowed memory.*Requested +: 1024.00 GiB"):
        alloc.malloc(1 << 40)
    sim.inject_oom()                                  # the next cudaMallocAsync fails
    with pytest.raises(OutOfMemoryError, match="Currently allocated +: 1024.00 KiB"):
        alloc.malloc(4096)
    assert _state(alloc) == before
    assert alloc.stats()["num_ooms"] == 2
    # the runtime's last error was cleared (torch in the same process must not see it)
    assert be.lib.cudaGetLastError() == 0
    alloc.free(alloc.malloc(4096))                    # and the allocator works on
    alloc.free(keep)


def test_memory_fraction_caps_requested_bytes(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF=CONF + ",per_process_memory_fraction:0.25",
            ACCEL_SIM_MEMORY="64M")
    alloc = memory.device_allocator(1)
    p = alloc.malloc(15 * MiB)
    with pytest.raises(OutOfMemoryError, match=r"accel limit .*\n +: 16.00 MiB"):
        alloc.malloc(2 * MiB)
    q = alloc.malloc(MiB)
    alloc.free(p)
    alloc.free(q)


def test_double_free_and_foreign_pointer(be):
    alloc = memory.device_allocator(1)
    p = alloc.malloc(4096)
    foreign = be.mem_alloc(4096)
    alloc.free(p)
    before = _state(alloc), sim.calls("cudaFreeAsync")
    with pytest.raises(ValueError, match=f"pointer {p:#x} is not allocated"):
        alloc.free(p)
    with pytest.raises(ValueError, match="foreign or interior pointer"):
        alloc.free(foreign)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.record_stream(foreign, 0)
    with pytest.raises(TypeError, match="pointer must be an int"):
        alloc.free("0x10")
    assert (_state(alloc), sim.calls("cudaFreeAsync")) == before
    be.mem_free(foreign)


def test_failed_free_keeps_the_allocation(be):
    alloc = memory.device_allocator(1)
    p = alloc.malloc(4096)
    sim.inject_error("cudaFreeAsync", 1)              # cudaErrorInvalidValue, once
    with pytest.raises(accel.AcceleratorError, match="cudaFreeAsync"):
        alloc.free(p)
    assert alloc.stats()["allocation.all.current"] == 1
    alloc.free(p)
    assert alloc.stats()["allocation.all.current"] == 0


# -- graph capture ---------------------------------------------------------------------------

def test_capture_allocates_graph_memory_and_defers_earlier_frees(be):
    """(tests/test_memory_async_graphs.py has the graph allocations in full.)"""
    s = accel.Stream()
    early = accel.Buffer(4096, stream=s)
    other = memory.device_allocator(0).malloc(4096, s.handle)
    early.fill_(0)
    s.synchronize()
    g = accel.Graph()
    with s, g:
        early.fill_(7, s)
        # an allocation on the capturing stream: a graph allocation, freed in the graph
        inside = memory.device_allocator(0).malloc(4096, s.handle)
        memory.device_allocator(0).free(inside)
        # a free of an earlier allocation while the capture is underway waits until it ended
        memory.device_allocator(0).free(other)
        # early, other (its free deferred) and the generator's seed/offset holders, which
        # the graph registered before capturing (torch's CUDAGraph::capture_begin)
        assert memory.memory_stats(0)["allocation.all.current"] == 4
        with pytest.raises(ValueError, match="already freed"):
            memory.device_allocator(0).free(other)
    assert memory.memory_stats(0)["allocation.all.current"] == 3
    g.replay()
    s.synchronize()
    assert (early.to_numpy() == 7).all()
    with pytest.raises(ValueError, match="release_pool"):
        memory.device_allocator(0).release_pool((99, 99))
    g.reset()                                    # the last graph: the holders are freed
    assert memory.memory_stats(0)["allocation.all.current"] == 1
    early.close()
    memory.empty_cache()
    assert memory.memory_reserved(0) == 0
    assert sim.state().errors == []


# -- the replay benchmark ----------------------------------------------------------------

def test_replay_drives_the_async_backend(be):
    from accel.memory import _bench
    trace = {"name": "t", "ops": [["a", 1, 3000], ["a", 2, 5 * MiB], ["f", 1], ["a", 3, 1000], ["f", 2], ["f", 3]]}
    out = _bench.replay(trace, _config.parse(CONF))
    assert out["peak_requested"] == 3000 + 5 * MiB
    assert out["peak_reserved"] >= out["peak_allocated"] >= out["peak_requested"]
    assert out["reserved_after_empty_cache"] == 0


@pytest.mark.parametrize("runtime", ["12.4", "13.0"])
def test_both_runtime_majors(monkeypatch, runtime):
    """The pool calls go through each major's bindings (cudaMemPool_t, cuuint64_t attributes)."""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF=CONF, ACCEL_SIM_CUDA_RUNTIME=runtime)
    be = _lazy.lazy_init()
    alloc = memory.device_allocator(1)
    p = alloc.malloc(MiB)
    assert alloc.stats()["reserved_bytes.all.current"] == pool(be, 1, "reserved_current") >= MiB
    alloc.free(p)
    memory.empty_cache()
    assert pool(be, 1, "reserved_current") == 0
    assert pool(be, 1, "release_threshold") == (1 << 64) - 1
