"""Adversarial reliability of the allocator backends (expandable segments, backend:cudaMallocAsync,
MemPool): a vendor call failing on a grow, free or unmap path leaves no leak and no double
release, the error is clear, and the next allocation works -- on two simulated devices, with
the work on the non-current one (device 0 stays current)."""

import gc

import pytest

import accel
from accel import _lazy, memory, sim
from accel._errors import AcceleratorError
from accel.memory import _config
from accel.memory._caching import DeviceCachingAllocator
from accel.sim import _vmm
from conftest import THOROUGH, use_sim
from test_memory_expandable import check as check_expandable

MiB = 1 << 20
CUDA_INVALID_VALUE = 1


# -- backend:cudaMallocAsync ---------------------------------------------------------------------

@pytest.fixture
def async_cuda(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="backend:cudaMallocAsync")
    yield
    sim.clear_faults()


def _async_clean(index: int) -> None:
    """Everything the pool handed out went back: accel's counts and the simulator's."""
    memory.empty_cache()
    stats = memory.memory_stats(index)
    assert stats["allocation.all.current"] == 0
    assert stats["allocated_bytes.all.current"] == 0
    assert stats["reserved_bytes.all.current"] == 0
    assert sim.state().live_allocations.get(index, 0) == 0


@pytest.mark.parametrize("call", ["cudaEventCreateWithFlags", "cudaEventRecord", "cudaStreamWaitEvent",
                                  "cudaFreeAsync"])
def test_async_failed_free_of_a_closed_buffer_is_retried(async_cuda, call):
    """Buffer.close() marks the buffer closed before the allocator frees it, so a free that
    fails must still hand the memory back later: it waits in the allocator for the next free,
    malloc or empty_cache.  (It stayed allocated for good: nothing could free it again.)"""
    s, user = accel.Stream(device=1), accel.Stream(device=1)
    buf = accel.Buffer(3 * MiB, device=1, stream=s)
    buf.fill_(1, stream=s)
    buf.record_stream(user)
    buf.fill_(2, stream=user)
    sim.inject_error(call, CUDA_INVALID_VALUE)
    with pytest.raises(AcceleratorError, match=call):
        buf.close()
    assert memory.memory_stats(1)["allocation.all.current"] == 1     # not freed yet, still counted
    _async_clean(1)
    assert sim.state().errors == []
    again = accel.Buffer(3 * MiB, device=1, stream=s)                 # the next allocation works
    again.close()
    s.close()
    user.close()
    _async_clean(1)


def test_async_free_after_a_failed_one_frees_its_own_allocation(async_cuda):
    """A free retries the frees that failed before it; when that retry fails again, the
    allocation being freed now must still be freed (or wait its turn), not be dropped."""
    a = accel.Buffer(MiB, device=1)
    b = accel.Buffer(2 * MiB, device=1)
    sim.inject_error("cudaFreeAsync", CUDA_INVALID_VALUE, times=2)
    with pytest.raises(AcceleratorError, match="cudaFreeAsync"):
        a.close()
    b.close()           # a's retry fails (the second fault); b is freed all the same
    assert memory.memory_stats(1)["allocation.all.current"] == 1     # a waits for the next try
    _async_clean(1)


def test_async_failed_free_from_a_finalizer_is_retried(async_cuda):
    """The same for a buffer collected without close(): its finalizer's free fails once."""
    s, user = accel.Stream(device=1), accel.Stream(device=1)
    buf = accel.Buffer(3 * MiB, device=1, stream=s)
    buf.record_stream(user)
    sim.inject_error("cudaStreamWaitEvent", CUDA_INVALID_VALUE, times=3)
    del buf
    gc.collect()
    sim.clear_faults()
    s.close()
    user.close()
    _async_clean(1)


@pytest.mark.parametrize("stream_first", [False, True], ids=["live-stream", "destroyed-stream"])
def test_async_failed_event_destroy_frees_once_and_destroys_later(async_cuda, stream_first):
    """The free waits for record_stream's stream through an event (a live stream: one made for
    the wait; a destroyed one: the event forget_stream recorded), then destroys it.  When that
    destroy fails the memory was freed all the same: it must not be freed a second time, and the
    event is destroyed at the next empty_cache instead of leaking."""
    user = accel.Stream(device=1)
    events = sim.state().events
    buf = accel.Buffer(3 * MiB, device=1)
    buf.record_stream(user)
    buf.fill_(2, stream=user)
    if stream_first:
        user.close()
    sim.inject_error("cudaEventDestroy", CUDA_INVALID_VALUE)
    try:
        buf.close()
    except AcceleratorError as exc:        # may be reported, but the memory went back
        assert "cudaEventDestroy" in str(exc)
    assert memory.memory_stats(1)["allocation.all.current"] == 0
    if not stream_first:
        user.close()
    _async_clean(1)
    assert sim.state().errors == []
    assert sim.state().events == events


def test_async_failed_free_at_graph_reset_is_retried(async_cuda):
    """A graph's launches allocate its output again after the owner freed it; Graph.reset()
    frees that copy.  When that cudaFreeAsync fails the graph is reset all the same (it forgets
    the allocations), so the allocator must keep the free and try it again."""
    s = accel.Stream(device=1)
    g = accel.Graph()
    with accel.graph(g, stream=s):
        kept = accel.Buffer(MiB, device=1, stream=s)
        kept.fill_(3, s)
    g.replay()
    kept.close()
    g.replay()                                  # allocated again, with no owner
    sim.inject_error("cudaFreeAsync", CUDA_INVALID_VALUE)
    with pytest.raises(AcceleratorError, match="cudaFreeAsync"):
        g.reset()
    del g               # (reset stops at the error; the collected graph releases its generator state)
    gc.collect()
    accel.synchronize(1)
    memory.empty_cache()
    be = accel._lazy.lazy_init()
    with accel.streams.on_device(be, 1):
        assert be.graph_mem_get(1, "reserved_current") == 0, "the graph's output was never freed"
    assert sim.state().errors == []
    s.close()
    _async_clean(1)



def _async_workload(objs: list) -> None:
    """Device 1 (not current): two streams, record_stream, a stream destroyed before the free of
    a block it used and one destroyed after a free, a peer, the cache emptied."""
    s, user = accel.Stream(device=1), accel.Stream(device=1)
    objs += [s, user]
    a = accel.Buffer(3 * MiB, device=1, stream=s)
    b = accel.Buffer(5 * MiB, device=1)
    objs += [a, b]
    a.fill_(1, stream=s)
    a.record_stream(user)
    a.fill_(2, stream=user)
    memory.device_allocator(1).add_peer(0)
    a.close()
    s.close()
    b.record_stream(user)
    user.close()
    b.close()
    memory.empty_cache()


def _async_live() -> tuple:
    st = sim.state()
    return dict(st.live_allocations), st.streams, st.events


def _close_all(objs: list) -> None:
    sim.clear_faults()
    accel.set_device_index(0)          # a failed device restore warns and may leave device 1 current
    for obj in [o for o in objs if isinstance(o, accel.Buffer)] + [o for o in objs if isinstance(o, accel.Stream)]:
        obj.close()
    for index in (0, 1):
        accel.synchronize(index)


@pytest.mark.filterwarnings("ignore:could not make device")
def test_async_fault_sweep(async_cuda):
    """Every vendor call of the workload fails once (and each from its first call on, until
    cleared): an accel error or recovery, and after closing what was made and emptying the cache
    nothing is left allocated, counted, or alive in the simulator, and the workload runs again."""
    objs = []
    _async_workload(objs)
    _close_all(objs)
    base = _async_live()
    sim.reset_call_counts()
    objs = []
    _async_workload(objs)
    calls = sim.calls()
    _close_all(objs)
    assert calls.get("cudaFreeAsync") and calls.get("cudaMemPoolTrimTo")
    for name in sorted(calls):
        for k, times in [(k, 1) for k in range(calls[name])] + [(0, -1)]:
            where = f"{name} failing at call {k + 1}" + (" and every later one" if times == -1 else "")
            objs = []
            sim.inject_error(name, CUDA_INVALID_VALUE, times=times, after=k)
            try:
                _async_workload(objs)
            except AcceleratorError:
                pass
            _close_all(objs)
            memory.empty_cache()
            for index in (0, 1):
                stats = memory.memory_stats(index)
                assert (stats["allocation.all.current"], stats["reserved_bytes.all.current"]) == (0, 0), where
            assert _async_live() == base, where
            objs = []
            _async_workload(objs)
            _close_all(objs)


# -- expandable segments -------------------------------------------------------------------------

needs_vmm = pytest.mark.skipif(not _vmm.supported(), reason="this host cannot play virtual memory (mmap)")


class _ZeState:
    """test_memory_expandable.check reads the CUDA simulator's mapped bytes: give it Level Zero's."""

    @staticmethod
    def state():
        st = sim.state()
        st.vmm_mapped_bytes = st.ze_vmm_mapped_bytes
        return st


@pytest.fixture(params=["cuda", "xpu"])
def vmm_backend(request, monkeypatch):
    use_sim(monkeypatch, request.param, ACCEL_ALLOC_CONF="expandable_segments:True")
    if request.param == "xpu":
        import test_memory_expandable
        monkeypatch.setattr(test_memory_expandable, "sim", _ZeState)
    yield _lazy.lazy_init()
    sim.clear_faults()


def _expandable(be, index: int) -> DeviceCachingAllocator:
    return DeviceCachingAllocator(be, index, _config.parse("expandable_segments:True"))


def _stream(be, index: int) -> int:
    prev = be.get_device()
    be.set_device(index)
    try:
        return be.stream_create()
    finally:
        be.set_device(prev)


def _destroy_stream(be, alloc, stream: int, index: int) -> None:
    alloc.forget_stream(stream, index)
    prev = be.get_device()
    be.set_device(index)
    try:
        be.stream_destroy(stream)
    finally:
        be.set_device(prev)


@needs_vmm
def test_small_blocks_of_a_destroyed_stream_join_the_default_streams_lists(vmm_backend):
    """After a stream is destroyed, its expandable segment (small requests share it, E12) joins
    the default stream's lists, which had none: frees and requests there keep every invariant.
    (Written for E8, retired since, when that list did not know the segment's page size.)"""
    be = vmm_backend
    alloc = _expandable(be, 1)
    s = _stream(be, 1)
    a, b, c = (alloc.malloc(1 << 20, s) for _ in range(3))    # b ends where c's page begins
    _destroy_stream(be, alloc, s, 1)
    alloc.empty_cache()                 # the stream's work is done: its lists join the default's
    alloc.free(b)
    alloc.free(c)
    check_expandable(alloc)
    d = alloc.malloc(512 << 10)
    e = alloc.malloc(1 << 20)
    check_expandable(alloc)
    for p in (a, d, e):
        alloc.free(p)
    alloc.empty_cache()
    check_expandable(alloc)
    assert alloc.stats()["reserved_bytes.all.current"] == 0


@needs_vmm
def test_classic_small_segment_beside_an_expandable_one_is_released(vmm_backend, monkeypatch):
    """While another stream is captured (another thread's relaxed capture), a miss of a stream
    with an expandable segment takes a classic 2 MiB segment (E6).  The device may place it at
    any 256-byte boundary (CUDA Programming Guide, "Device Memory Accesses": allocations are
    "always aligned to at least 256 bytes"), so a 2 MiB boundary can fall inside it: its blocks
    must still merge there (E8, retired since, once kept them apart), or the segment never
    becomes whole again and empty_cache never returns it."""
    be = vmm_backend
    real_alloc, real_free = be.mem_alloc, be.mem_free
    raw_of = {}

    def mem_alloc(nbytes):              # 256-aligned, 1 MiB past a 2 MiB boundary
        raw = real_alloc(nbytes + 2 * MiB)
        ptr = raw + (MiB - raw) % (2 * MiB)
        raw_of[ptr] = raw
        return ptr

    monkeypatch.setattr(be, "mem_alloc", mem_alloc)
    monkeypatch.setattr(be, "mem_free", lambda ptr: real_free(raw_of.pop(ptr)))
    alloc = _expandable(be, 1)
    keep = [alloc.malloc(MiB), alloc.malloc(MiB)]          # the expandable page is full
    captured = _stream(be, 1)
    be.set_device(1)
    be.capture_begin(captured, "relaxed")
    be.set_device(0)
    try:
        x = alloc.malloc(MiB)                              # a classic segment: [x][y]
        y = alloc.malloc(MiB)
    finally:
        be.set_device(1)
        be.graph_destroy(be.capture_end(captured))
        be.set_device(0)
    assert list(alloc._segments) == [x] and y % (2 * MiB) == 0
    for ptr in [x, y] + keep:
        alloc.free(ptr)
    check_expandable(alloc)
    alloc.empty_cache()
    assert alloc.stats()["reserved_bytes.all.current"] == 0
    assert raw_of == {}, "the classic segment was never returned to the device"
    _destroy_stream(be, alloc, captured, 1)


@needs_vmm
@pytest.mark.parametrize("bad", [2, 7, -1])
def test_add_peer_refuses_a_device_that_does_not_exist(vmm_backend, bad):
    """add_peer records the peer for every later mapping: a bad index must be refused at once,
    not accepted (with nothing mapped yet) and then fail every later allocation in cuMemSetAccess."""
    be = vmm_backend
    alloc = _expandable(be, 1)
    with pytest.raises(ValueError, match=f"device index {bad} is out of range"):
        alloc.add_peer(bad)
    ptr = alloc.malloc(3 * MiB)                 # the next allocation works
    with pytest.raises(ValueError, match=f"device index {bad} is out of range"):
        alloc.add_peer(bad)                     # with mappings too, and nothing changed
    alloc.add_peer(0)
    alloc.free(ptr)
    alloc.empty_cache()
    check_expandable(alloc)
    assert alloc.stats()["reserved_bytes.all.current"] == 0


@needs_vmm
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")     # the capture that failed
def test_first_peer_copy_inside_a_capture_says_what_to_do(vmm_backend):
    """A copy from device 0's expandable memory by device 1 needs device 1 granted access to
    device 0's mappings (add_peer: cuMemSetAccess), which cannot happen during a capture (E6,
    refused by the simulator).  The first such copy inside a capture must say so in terms of
    the copy (warm up before capturing), not of a virtual-memory call the user never made; after
    a warm-up copy the capture works."""
    src = accel.Buffer(4 * MiB, device=0)
    src.fill_(3)
    s1 = accel.Stream(device=1)
    dst = accel.Buffer(4 * MiB, device=1, stream=s1)
    g = accel.Graph()
    with pytest.raises(accel.CaptureError, match=r"device 1 .*device 0.* before the capture"):
        with accel.graph(g, stream=s1):
            dst.copy_from(src, stream=s1, non_blocking=True)
    g.reset()
    dst.copy_from(src, stream=s1)                   # the warm-up: access granted
    dst.fill_(7, stream=s1)
    g = accel.Graph()
    with accel.graph(g, stream=s1):
        dst.fill_(0, stream=s1)
        dst.copy_from(src, stream=s1, non_blocking=True)
    with s1:
        g.replay()                                  # on s1: replay() uses the current stream
    s1.synchronize()
    assert (dst.to_numpy(stream=s1) == 3).all()
    g.reset()
    for obj in (src, dst, s1):
        obj.close()
    memory.empty_cache()
    assert memory.memory_reserved(0) == memory.memory_reserved(1) == 0



_VMM_CALLS = {"cuda": ("cuMemAddressReserve", "cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap",
                       "cuMemRelease", "cuMemAddressFree"),
              "xpu": ("zeVirtualMemReserve", "zePhysicalMemCreate", "zeVirtualMemMap",
                      "zeVirtualMemSetAccessAttribute", "zeVirtualMemUnmap", "zePhysicalMemDestroy",
                      "zeVirtualMemFree")}


def _vmm_live(kind: str) -> tuple:
    st = sim.state()
    p = "ze_" if kind == "xpu" else ""
    return tuple(getattr(st, p + k) for k in ("vmm_reservations", "vmm_handles", "vmm_mappings",
                                               "vmm_physical_bytes"))


def _grow_unmap_workload(alloc, live: list) -> None:
    """Grow, a small segment, unmap before growing past the high-water mark, a peer granted
    access to what is mapped and to what is mapped later, free everything, empty the cache."""
    for nbytes in (10 * MiB, 3 * MiB, 700):
        live.append(alloc.malloc(nbytes))
    alloc.free(live.pop(0))
    live.append(alloc.malloc(20 * MiB))
    alloc.add_peer(0)
    live.append(alloc.malloc(9 * MiB))
    while live:
        alloc.free(live.pop())
    alloc.empty_cache()


@needs_vmm
def test_vmm_fault_sweep_of_grow_unmap_and_peer(vmm_backend, request):
    """Each virtual-memory call of device 1's expandable segments fails at each of its calls
    (once, and from there on until cleared): the invariants hold right after the error, and
    once the live blocks are freed and the cache emptied, stats, reserved bytes and the
    simulator's reservations, handles and mappings are back where they were, with no double
    release (the simulator refuses one); the workload then runs again."""
    be = vmm_backend
    kind = request.node.callspec.params["vmm_backend"]
    code = CUDA_INVALID_VALUE if kind == "cuda" else 0x7FFFFFFE     # ZE_RESULT_ERROR_UNKNOWN
    if not THOROUGH:
        # default run: the calls of one clean run counted, then every third call of each
        # function and its last (each function still fails at its first and last call; about a
        # third of the runs); THOROUGH: every call up to the 40th
        before = dict(sim.calls())
        _grow_unmap_workload(_expandable(be, 1), [])
        after = dict(sim.calls())
        counts = {name: after.get(name, 0) - before.get(name, 0) for name in _VMM_CALLS[kind]}
    base = _vmm_live(kind)
    from accel.sim import core
    fired = 0
    for name in _VMM_CALLS[kind]:
        ks = range(40) if THOROUGH else sorted(set(range(0, counts[name], 3)) | {max(counts[name] - 1, 0)})
        for k in ks:
            for times in (1, -1):
                where = f"{name} failing at call {k + 1}" + (" and every later one" if times == -1 else "")
                alloc = _expandable(be, 1)
                live = []
                sim.inject_error(name, code, times=times, after=k)
                try:
                    _grow_unmap_workload(alloc, live)
                except AcceleratorError:
                    pass
                if times == 1:
                    hit = name not in core._faults          # the k-th call happened (and failed)
                sim.clear_faults()
                check_expandable(alloc)
                for ptr in live:
                    alloc.free(ptr)
                alloc.empty_cache()
                check_expandable(alloc)
                stats = alloc.stats()
                assert (stats["reserved_bytes.all.current"], stats["segment.all.current"]) == (0, 0), where
                assert _vmm_live(kind) == base, where
                _grow_unmap_workload(alloc, [])
                assert _vmm_live(kind) == base, where
                fired += hit and times == 1
            if not hit:                                 # the workload makes fewer calls
                break
    assert fired >= 7 * 3


@pytest.mark.parametrize("backend_conf", ["", "backend:cudaMallocAsync"])
@pytest.mark.parametrize("bad", [dict(device_index=7), dict(device_index=-1), dict(device_index="0"),
                                 dict(stream=-1), dict(stream=1 << 64), dict(stream=1.0)],
                         ids=["device-7", "device--1", "device-str", "stream--1", "stream-2**64", "stream-float"])
def test_record_stream_refuses_a_bad_stream_or_device(monkeypatch, backend_conf, bad):
    """The allocator's record_stream is public (accel.memory.device_allocator(i).record_stream):
    a device index naming no device, or a stream that is no handle, is refused with the value
    named, and nothing is recorded.  Before, it was kept, and every later free's event record
    and every empty_cache failed on it."""
    monkeypatch.setenv("ACCEL_ALLOC_CONF", backend_conf)
    use_sim(monkeypatch, "cuda")
    alloc = memory.device_allocator(0)
    be = _lazy.lazy_init()
    ptr = alloc.malloc(1 << 20)
    args = dict(stream=be.default_stream(1), device_index=1)
    args.update(bad)
    with pytest.raises((ValueError, TypeError)) as info:
        alloc.record_stream(ptr, args["stream"], args["device_index"])
    assert repr(bad[next(iter(bad))]) in str(info.value) or str(bad[next(iter(bad))]) in str(info.value)
    alloc.free(ptr)
    alloc.empty_cache()
    assert alloc.stats()["allocated_bytes.all.current"] == 0
