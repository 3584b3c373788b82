"""``backend:cudaMallocAsync`` under graph capture (issue 15 item 5), as torch's
CUDAMallocAsyncAllocator: an allocation on a capturing stream is a graph allocation node, a
free during the capture of a block allocated in it a free node, a free of anything older is
deferred until no capture is underway; graphs are instantiated with AutoFreeOnLaunch so they
replay any number of times; ``pool=`` is accepted and ignored; and a peer device gets access
to the pool (cudaMemPoolSetAccess) before it copies from it.  Every test checks that the
graph memory is all returned at the end (cudaDeviceGraphMemTrim leaves nothing reserved: no
graph allocation was left allocated)."""

import numpy as np
import pytest

import accel
from accel import _lazy, memory, sim
from accel._errors import OutOfMemoryError
from accel.memory import _async
from conftest import use_sim

CONF = "backend:cudaMallocAsync"
N = 4096


@pytest.fixture
def be(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF=CONF)
    b = _lazy.lazy_init()
    yield b
    sim.reset()


def graph_reserved(be, index):
    with accel.streams.on_device(be, index):
        return be.graph_mem_get(index, "reserved_current")


def all_returned(be, index):
    """Nothing of ``index``'s graph memory or pool is left once caches are emptied."""
    accel.synchronize(index)
    memory.empty_cache()
    return (graph_reserved(be, index), be.mem_pool_get(index, "used_current"), sim.state().errors) == (0, 0, [])


def filled(buf, value):
    return bool((buf.to_numpy() == value).all())


@pytest.mark.parametrize("index", [0, 1])
def test_capture_and_replay_with_allocations_inside(be, index):
    """A temporary allocated and freed inside the capture (freed in the graph), an output
    allocated inside and kept (freed by its owner after the replays); device 1 is not the
    current device outside the capture."""
    s = accel.Stream(device=index)
    out = accel.Buffer(N, device=index, stream=s)
    alloc = memory.device_allocator(index)
    g = accel.Graph()
    with s, g:
        tmp = accel.Buffer(N, device=index, stream=s)
        tmp.fill_(5, s)
        out.copy_from(tmp, s, non_blocking=True)     # a blocking copy would synchronize the capture
        tmp.close()                                  # a free node: its lifetime ends in the graph
        kept = accel.Buffer(N, device=index, stream=s)
        kept.fill_(9, s)
    assert accel.current_device_index() == 0
    pool_used = be.mem_pool_get(index, "used_current")    # out and the generator's holders
    for _ in range(3):
        out.fill_(0, s)
        s.synchronize()
        g.replay()
        accel.synchronize(index)
        assert filled(out, 5) and filled(kept, 9)
    # the pool is not involved: graph memory is the graph allocator's
    assert be.mem_pool_get(index, "used_current") == pool_used and graph_reserved(be, index) >= 2 * N
    assert alloc.stats()["num_device_alloc"] >= 2
    g.reset()
    assert filled(kept, 9)                           # an output outlives its graph
    kept.close()
    out.close()
    assert all_returned(be, index)


def test_output_freed_before_any_replay(be):
    s = accel.Stream()
    g = accel.Graph()
    with s, g:
        kept = accel.Buffer(N, stream=s)
        kept.fill_(1, s)
    kept.close()                                     # no launch allocated it: nothing to free
    g.replay()                                       # allocated again by the launch, owned by no one
    g.replay()
    accel.synchronize()
    g.reset()                                        # the graph frees what no one holds
    assert all_returned(be, 0)


def test_output_freed_between_replays(be):
    s = accel.Stream()
    g = accel.Graph()
    with s, g:
        kept = accel.Buffer(N, stream=s)
        kept.fill_(3, s)
    g.replay()
    assert filled(kept, 3)
    kept.close()                                     # freed after the replay that allocated it
    g.replay()                                       # ... which allocates it again
    g.replay()
    g.reset()
    assert all_returned(be, 0)


def test_capture_on_device_1_while_0_is_current(be):
    s1 = accel.Stream(device=1)
    g = accel.Graph()
    with accel.graph(g, stream=s1):
        assert accel.current_device_index() == 1
        kept = accel.Buffer(N, device=1, stream=s1)
        kept.fill_(4, s1)
    assert accel.current_device_index() == 0
    for _ in range(2):
        g.replay()
    accel.synchronize(1)
    assert filled(kept, 4)
    assert graph_reserved(be, 1) >= N and graph_reserved(be, 0) == 0
    kept.close()
    g.reset()
    assert all_returned(be, 1)


@pytest.mark.parametrize("how", ["fraction", "injected"])
def test_oom_during_capture_is_clear_and_leaves_nothing(monkeypatch, how):
    conf = CONF + (",per_process_memory_fraction:0.5" if how == "fraction" else "")
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF=conf, ACCEL_SIM_MEMORY="64M")
    be = _lazy.lazy_init()
    alloc = memory.device_allocator(0)
    s = accel.Stream()
    before = alloc.stats()["allocation.all.current"], dict(alloc._ptrs)
    g = accel.Graph()
    with pytest.raises(OutOfMemoryError, match="CUDA out of memory. Allocation on device 0 would exceed"):
        with s, g:
            accel.Buffer(N, stream=s).fill_(1, s)    # a graph allocation that works ...
            if how == "injected":
                sim.inject_oom()
                accel.Buffer(N, stream=s)
            else:
                accel.Buffer(48 << 20, stream=s)     # ... and one past the memory fraction
    # the capture was ended and discarded; the allocator holds what it held before
    assert be.captures_underway() == 0 and not accel.is_current_stream_capturing()
    assert (alloc.stats()["allocation.all.current"], dict(alloc._ptrs)) == before
    assert be.lib.cudaGetLastError() == 0
    with s, g:                                       # and the graph captures again
        kept = accel.Buffer(N, stream=s)
        kept.fill_(2, s)
    g.replay()
    assert filled(kept, 2)
    kept.close()
    g.reset()
    assert all_returned(be, 0)


def test_earlier_allocations_freed_during_capture_wait_for_its_end(be):
    s = accel.Stream()
    early = accel.Buffer(N, stream=s)
    other = memory.device_allocator(0).malloc(N, s.handle)
    g = accel.Graph()
    with s, g:
        early.fill_(7, s)
        memory.device_allocator(0).free(other)       # not part of the capture: deferred
        with pytest.raises(ValueError, match="already freed"):
            memory.device_allocator(0).free(other)
        assert sim.calls("cudaFreeAsync") == 0
    g.replay()
    assert filled(early, 7)
    early.close()
    g.reset()
    assert all_returned(be, 0)


def test_graph_pools_are_accepted_and_ignored(be):
    """torch's cudaMallocAsync backend ignores the pool of beginAllocateToPool: graphs
    sharing a pool id (make_graphed_callables does that) capture and replay as any other."""
    pool = accel.graphs.graph_pool_handle()
    s = accel.Stream()
    graphs, outs = [], []
    for value in (1, 2):
        g = accel.Graph(pool=pool)
        with s, g:
            out = accel.Buffer(N, stream=s)
            out.fill_(value, s)
        graphs.append(g)
        outs.append(out)
    for g in graphs:
        g.replay()
    assert filled(outs[0], 1) and filled(outs[1], 2)
    outs[0].close()
    graphs[0].replay()
    for g in graphs:
        g.reset()
    outs[1].close()
    assert all_returned(be, 0)


def test_one_capture_at_a_time_per_device(be):
    """As torch's beginAllocateToPool with this backend (accel.Graph's generator refuses a
    second capture on a device first; the allocator's own check covers direct callers)."""
    s, t = accel.Stream(), accel.Stream()
    alloc = memory.device_allocator(0)
    token = alloc.begin_allocate_to_pool((0, 1), s.handle)
    early = alloc.malloc(N, s.handle)             # the stream is not captured yet: pool memory
    with pytest.raises(RuntimeError, match=r"Only one capture at a time is allowed in a process\. "
                                           r"\(backend:cudaMallocAsync: stream .* of device 0"):
        alloc.begin_allocate_to_pool((0, 2), t.handle)
    other = memory.device_allocator(1)            # another device's allocator: its own captures
    u = accel.Stream(device=1)
    other_token = other.begin_allocate_to_pool((0, 3), u.handle)
    other.end_allocate_to_pool((0, 3))
    other.release_pool((0, 3))
    other_token.release()
    alloc.end_allocate_to_pool((0, 1))
    alloc.release_pool((0, 1))
    token.release()
    alloc.free(early)
    token = alloc.begin_allocate_to_pool((0, 2), t.handle)       # the next one is fine
    alloc.end_allocate_to_pool((0, 2))
    alloc.release_pool((0, 2))
    token.release()
    assert all_returned(be, 0)


def test_peer_copy_after_add_peer(be):
    """A copy on device 1 reading device 0's pool memory: Buffer.copy_from gives device 1
    access to device 0's pool first (add_peer -> cudaMemPoolSetAccess), as torch's
    enablePeerAccess does for this backend; without it the simulator faults the copy."""
    src = accel.Buffer(N, device=0)
    src.copy_from(np.full(N, 6, np.uint8))
    dst = accel.Buffer(N, device=1)
    dst.copy_from(src)
    assert filled(dst, 6)
    alloc = memory.device_allocator(0)
    assert isinstance(alloc, _async.AsyncPoolAllocator)
    alloc.add_peer(1)                                # again: a no-op
    alloc.add_peer(0)                                # the pool's own device: a no-op
    with pytest.raises(TypeError, match="device index must be an int"):
        alloc.add_peer("1")
    src.close()
    dst.close()
    assert sim.state().errors == []


def test_add_peer_skips_a_device_without_direct_access(be, monkeypatch):
    monkeypatch.setattr(type(be), "can_access_peer", lambda self, index, peer: False)
    calls = sim.calls("cudaMemPoolSetAccess")
    memory.device_allocator(1).add_peer(0)
    assert sim.calls("cudaMemPoolSetAccess") == calls


def test_keep_graph_and_debug_mode(be, tmp_path):
    """keep_graph: the graph is instantiated at the first replay and may be instantiated again
    (one executable graph at a time, as CUDA allows for graphs with memory nodes); debug mode
    keeps the graph beside its executable graph."""
    s = accel.Stream()
    g = accel.Graph(keep_graph=True)
    with s, g:
        kept = accel.Buffer(N, stream=s)
        kept.fill_(8, s)
    g.replay()
    g.instantiate()
    g.replay()
    assert filled(kept, 8)
    h = accel.Graph()
    h.enable_debug_mode()
    with s, h:
        tmp = accel.Buffer(N, stream=s)
        tmp.fill_(1, s)
        tmp.close()
    h.debug_dump(tmp_path / "h.dot")
    assert "MEM_ALLOC" in (tmp_path / "h.dot").read_text()
    h.replay()
    kept.close()
    for graph in (g, h):
        graph.reset()
    assert all_returned(be, 0)


def test_replays_on_other_streams_and_uses_order_the_free(be):
    """An output replayed on another stream and used on a third: its free follows both (the
    simulator faults a write into graph memory after its free)."""
    s, r, u = accel.Stream(), accel.Stream(), accel.Stream()
    g = accel.Graph()
    with s, g:
        kept = accel.Buffer(N, stream=s)
        kept.fill_(5, s)
    with r:
        g.replay()                                   # on r: the output is allocated there now
    u.wait_stream(r)
    kept.fill_(6, u)                                 # used on u (recorded: u is not its stream)
    kept.close()
    accel.synchronize()
    with u:
        g.replay()
    g.reset()
    assert all_returned(be, 0)


def test_collected_graph_frees_what_no_one_holds(be):
    import gc
    s = accel.Stream()
    g = accel.Graph()
    with s, g:
        kept = accel.Buffer(N, stream=s)
        kept.fill_(2, s)
    g.replay()
    kept.close()
    g.replay()                                       # allocated again, with no owner
    del g
    gc.collect()
    memory.device_allocator(0).stats()               # a safe point: deferred releases run
    assert all_returned(be, 0)


@pytest.mark.parametrize("stale_first", [True, False])
def test_output_of_a_graph_reset_before_any_replay(be, stale_first):
    """No replay allocated the output, so its address went back with the graph, and the next
    allocation of its size gets it again: two owners of one address.  Whichever frees first,
    no memory goes before its owner is done (the stale owner's free forgets, the other's waits)."""
    s = accel.Stream()
    g = accel.Graph()
    with s, g:
        kept = accel.Buffer(N, stream=s)
    g.reset()
    again = accel.Buffer(N, stream=s)
    if again.ptr != kept.ptr:
        # the simulated pool placed it elsewhere (what earlier tests in this process left in the pool
        # decides): the two-owners case this test is about did not arise
        again.close()
        kept.close()
        pytest.skip("the simulated pool did not hand the address out again")
    again.fill_(4, s)
    first, second = (kept, again) if stale_first else (again, kept)
    first.close()
    assert memory.memory_stats(0)["allocation.all.current"] >= 1
    if stale_first:
        assert filled(again, 4)                      # still allocated: the stale free forgot only
    second.close()
    assert all_returned(be, 0)
