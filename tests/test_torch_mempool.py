"""PyTorch's TestMemPool cases from test/test_cuda.py (torch.cuda.MemPool / use_mem_pool),
ported to accel.MemPool / accel.use_mem_pool (issue 16), plus accel's own checks of the
same API: the thread filter, two devices, graphs capturing into a MemPool, bad input.

torch allocates tensors (``torch.empty(n, device="cuda")``); the ports allocate
``accel.Buffer``s of the same byte sizes.  Cases that need a pluggable allocator
(``CUDAPluggableAllocator``, which accel does not have) are ported without it where the
check does not depend on it (use count, segments, use_on_oom, no_split);
tests/TORCH_PORTS.md lists every case.
"""

import gc
import random
import threading
from collections import defaultdict

import pytest

import accel
from accel import Graph, MemPool, memory, use_mem_pool

from conftest import use_sim
from test_memory_allocator import check_invariants, make

MiB = 1 << 20


def _pool_ids():
    return [tuple(seg["segment_pool_id"]) for seg in memory.memory_snapshot()]


def _general_segments():
    return [(seg["address"], seg["total_size"]) for seg in memory.memory_snapshot()
            if tuple(seg["segment_pool_id"]) == (0, 0)]


def _limit(monkeypatch_free_mib: int, device: int = 0) -> float:
    """torch's _setup_mempool_limited_memory_test: cap the device at what it has reserved now
    plus ``monkeypatch_free_mib`` MiB; returns the previous fraction."""
    before = memory.get_per_process_memory_fraction(device)
    memory.empty_cache()
    total = memory.get_memory_info(device)[1]
    allowed = monkeypatch_free_mib * MiB + memory.memory_reserved(device)
    memory.set_per_process_memory_fraction(allowed / total, device)
    return before


# ------------------------------------------------------------------ ported from TestMemPool
def test_cuda__test_mempool_id(sim_backend):
    pool1 = accel.graphs.graph_pool_handle()
    pool2 = MemPool().id
    pool3 = accel.graphs.generate_graph_pool_handle()
    # first value of id in a user created pool is always zero
    assert pool1[0] == 0 and pool2[0] == 0 and pool3[0] == 0
    # each call increments the id (one counter for graph_pool_handle and MemPool)
    assert pool2[1] - pool1[1] > 0
    assert pool3[1] - pool2[1] > 0


def test_cuda__test_mempool_with_allocator(sim_backend):
    # torch's case with allocator=None: the use counts and the pool's segments
    pool = MemPool()
    assert pool.allocator is None
    assert pool.use_count() == 1              # the MemPool object holds a reference
    with use_mem_pool(pool):
        out_0 = accel.Buffer(MiB)
        assert pool.use_count() == 2          # use_mem_pool holds one too
    assert pool.use_count() == 1
    out_non_pool = accel.Buffer(MiB)
    with use_mem_pool(pool):
        # a 1 MiB request is packed into a 2 MiB small segment
        assert len(pool.snapshot()) == 1
        out_1 = accel.Buffer(MiB)
        assert len(pool.snapshot()) == 1      # ... the same segment
        out_2 = accel.Buffer(MiB)
        assert len(pool.snapshot()) == 2      # a new 2 MiB segment
    assert len(pool.snapshot()) == 2
    assert all(tuple(seg["segment_pool_id"]) == pool.id for seg in pool.snapshot())
    del out_0, out_1, out_2, out_non_pool
    del pool                                   # its free segments go back to the device
    assert _pool_ids().count((0, 0)) == len(_pool_ids())


def test_cuda__test_mempool_with_allocator_refuses_a_pluggable_allocator(sim_cuda):
    with pytest.raises(NotImplementedError, match="no pluggable allocators"):
        MemPool(object())
    assert memory.memory_reserved() == 0


def test_cuda__test_mempool_empty_cache(sim_backend):
    memory.empty_cache()
    pool = MemPool()
    x = accel.Buffer(4 * MiB)
    with use_mem_pool(pool):
        y = accel.Buffer(4 * MiB)
    del y, x
    del pool
    assert len(memory.memory_snapshot()) > 0, "x's segment stays cached in the general cache"
    assert all(pid == (0, 0) for pid in _pool_ids())


def test_cuda__test_mempool_empty_cache_inactive(sim_cuda):
    # the pool dies while a block it served is alive; the block's memory goes back at empty_cache
    def f():
        pool = MemPool()
        with use_mem_pool(pool):
            x = accel.Buffer(8 * MiB)
        return x

    x = f()
    assert memory.memory_allocated() == 8 * MiB
    del x
    memory.empty_cache()
    assert memory.memory_reserved() == 0


def test_cuda__test_tensor_delete_after_allocator_delete(sim_cuda):
    # torch's case drops the pool (and its allocator) before the tensor; the block stays valid
    pool = MemPool()
    with use_mem_pool(pool):
        data = accel.Buffer(16).fill_(7)
    pool_id = pool.id
    del pool
    gc.collect()
    assert int(data.to_numpy()[0]) == 7
    assert accel.memory.device_allocator(0).pool_use_count(pool_id) == 0
    del data
    memory.empty_cache()
    assert memory.memory_reserved() == 0


def test_cuda__test_mempool_limited_memory_with_allocator(sim_cuda):
    # torch's case with allocator=None: use_on_oom lets requests outside fall back on a pool
    pool_do_not_use = MemPool()
    pool_use = MemPool(use_on_oom=True)
    before = _limit(80)
    try:
        with use_mem_pool(pool_do_not_use):
            a = accel.Buffer(40 * MiB)
        with use_mem_pool(pool_use):
            b = accel.Buffer(40 * MiB)
        b_ptr = b.ptr
        with pytest.raises(accel.OutOfMemoryError):
            accel.Buffer(40 * MiB)                 # the device is full
        del a, b
        c = accel.Buffer(30 * MiB)                # falls back on pool_use
        assert c.ptr == b_ptr
        with pytest.raises(accel.OutOfMemoryError):
            accel.Buffer(30 * MiB)                 # pool_do_not_use is not used on OOM
        del c
        with use_mem_pool(pool_use):
            e = accel.Buffer(20 * MiB)            # pool_use still serves its own context
        assert e.ptr == b_ptr
        del e
        del pool_use, pool_do_not_use
    finally:
        memory.empty_cache()
        memory.set_per_process_memory_fraction(before)


def test_cuda__test_deleted_mempool_not_used_on_oom(sim_cuda):
    before = _limit(40)
    try:
        for _ in range(10):
            pool = MemPool(use_on_oom=True)
            with use_mem_pool(pool):
                a = accel.Buffer(40 * MiB)
            del a
            del pool                               # its 40 MiB go back to the device
        new_pool = MemPool(use_on_oom=True)
        with use_mem_pool(new_pool):
            a = accel.Buffer(40 * MiB)
        del a
        b = accel.Buffer(20 * MiB)                # only the live pool can serve these
        c = accel.Buffer(20 * MiB)
        assert {tuple(seg["segment_pool_id"]) for seg in memory.memory_snapshot()} == {new_pool.id}
        del b, c, new_pool
    finally:
        memory.empty_cache()
        memory.set_per_process_memory_fraction(before)


def test_cuda__test_mempool_no_split(monkeypatch):
    # torch's segment sizes (a 4 MiB request gets a 20 MiB segment), so the split pool has room
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="policy:torch")
    memory.empty_cache()
    pool_split = MemPool()
    pool_no_split = MemPool(no_split=True)
    keep = []
    for _ in range(2):
        with use_mem_pool(pool_split):
            keep.append(accel.Buffer(4 * MiB))
        with use_mem_pool(pool_no_split):
            keep.append(accel.Buffer(4 * MiB))
    assert len(pool_no_split.snapshot()) > len(pool_split.snapshot())
    for seg in pool_no_split.snapshot():
        assert len(seg["blocks"]) == 1

    def count_blocks(pool):
        return sum(len(seg["blocks"]) for seg in pool.snapshot())

    assert count_blocks(pool_no_split) < count_blocks(pool_split)


def test_cuda__test_mempool_multithread(sim_cuda):
    pool_ids = []

    def create_mempool_and_make_active():
        pool = MemPool()
        pool_ids.append(pool.id)

    threads = [threading.Thread(target=create_mempool_and_make_active) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(pool_ids)) == 4


def test_cuda__test_mempool_emptycache_multithread(sim_backend):
    errors = []

    def my_function(pool):
        try:
            with use_mem_pool(pool):
                x = accel.Buffer(16)
                del x
                memory.empty_cache()               # leaves the live pool's segment alone
        except BaseException as exc:               # pragma: no cover - reported below
            errors.append(exc)

    accel.current_device_index()                   # initialized before the threads start
    pools = [MemPool() for _ in range(4)]
    threads = [threading.Thread(target=my_function, args=(pool,)) for pool in pools]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for pool in pools:
        assert len(pool.snapshot()) == 1, "Expected to have a single segment"


def test_cuda__test_nested_mempool(sim_backend):
    memory.empty_cache()
    pool1, pool2, pool3 = MemPool(), MemPool(), MemPool()
    data = []

    def allocate_data():
        data.append(accel.Buffer(20 * MiB))

    with use_mem_pool(pool1):
        allocate_data()
        with use_mem_pool(pool2):
            allocate_data()
            with use_mem_pool(pool3):
                allocate_data()
            allocate_data()
        allocate_data()
    assert len(memory.memory_snapshot(pool1.id)) == 2
    assert len(memory.memory_snapshot(pool2.id)) == 2
    assert len(memory.memory_snapshot(pool3.id)) == 1


def test_cuda__test_mempool_expandable(monkeypatch):
    # torch's case with a pluggable allocator; accel's pools keep classic segments anyway
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="expandable_segments:True")
    pool = MemPool()
    data = []
    with use_mem_pool(pool):
        data.append(accel.Buffer(MiB))
    data.append(accel.Buffer(MiB))                 # the general cache: an expandable segment
    segments = memory.memory_snapshot()
    assert len(segments) == 2
    assert sum(seg["is_expandable"] for seg in segments) == 1
    assert [seg["is_expandable"] for seg in pool.snapshot()] == [False]


def test_cuda__test_mempool_ctx_multithread(sim_cuda):
    memory.empty_cache()
    assert memory.memory_snapshot() == []
    nelem = MiB
    trigger_alloc = threading.Event()
    done_allocation = threading.Event()
    segments = []
    errors = []

    def main_thread_fn():
        try:
            pool = MemPool()
            out1 = accel.Buffer(nelem)
            with use_mem_pool(pool):
                out = accel.Buffer(nelem)
                del out
                trigger_alloc.set()
                done_allocation.wait()
            del out1
        except BaseException as exc:               # pragma: no cover
            errors.append(exc)
            trigger_alloc.set()

    def side_thread_fn():
        try:
            trigger_alloc.wait()
            out = accel.Buffer(nelem)              # another thread: not routed to the pool
            segments.append(memory.memory_snapshot())
            del out
        finally:
            done_allocation.set()

    accel.current_device_index()
    main_thread = threading.Thread(target=main_thread_fn)
    side_thread = threading.Thread(target=side_thread_fn)
    main_thread.start()
    side_thread.start()
    main_thread.join()
    side_thread.join()
    assert errors == []
    assert len(segments) == 1
    active = defaultdict(int)
    for seg in segments[0]:
        active[tuple(seg["segment_pool_id"])] += seg["active_size"]
    assert len(active) == 2                        # the general cache and the pool
    for pool_id, size in active.items():
        if pool_id == (0, 0):
            assert size == 2 * MiB, "out1 and the side thread's block in the general cache"
        else:
            assert size == 0, "nothing allocated in the pool any more"


# ------------------------------------------------------------------ accel's own checks
def test_use_mem_pool_routes_only_inside_and_leaves_the_general_cache_alone(sim_backend):
    pool = MemPool()
    outside = accel.Buffer(3 * MiB)
    general = _general_segments()
    stats = memory.memory_stats()
    with use_mem_pool(pool):
        inside = [accel.Buffer(n) for n in (100, 5000, 3 * MiB)]
    assert _general_segments() == general
    assert memory.memory_stats()["allocation.all.current"] == stats["allocation.all.current"] + 3
    blocks = {b["address"]: b for seg in pool.snapshot() for b in seg["blocks"]}
    assert all(buf.ptr in blocks and blocks[buf.ptr]["state"] == "active_allocated" for buf in inside)
    after = accel.Buffer(100)                      # outside again: the general cache
    assert after.ptr not in blocks
    # freed outside the context, a block goes back to the pool, and the pool serves it again
    ptr = inside[0].ptr
    del inside[0]
    assert len(pool.snapshot()) == 2 and all(seg["segment_pool_id"] == pool.id for seg in pool.snapshot())
    assert accel.Buffer(100).ptr != ptr           # not reused outside
    with use_mem_pool(pool):
        again = accel.Buffer(100)
    assert again.ptr == ptr
    del outside, after


def test_pool_of_the_other_device(sim_graph_backend):     # Metal has one device
    with accel.device_index(1):
        pool = MemPool()
    assert pool.device_index == 1 and accel.current_device_index() == 0
    with use_mem_pool(pool, device=1):
        on1 = accel.Buffer(4096, device=1)
        on0 = accel.Buffer(4096, device=0)        # device 0's allocations are not routed
    assert [seg["device"] for seg in pool.snapshot()] == [1]
    assert {b["address"] for seg in pool.snapshot() for b in seg["blocks"]} >= {on1.ptr}
    assert all(tuple(seg["segment_pool_id"]) == (0, 0)
               for seg in memory.memory_snapshot() if seg["device"] == 0)
    assert memory.memory_allocated(1) == 4096 and memory.memory_allocated(0) == 4096
    with pytest.raises(ValueError, match="belongs to device 1, not device 0"):
        with use_mem_pool(pool):                   # the current device is 0
            pass
    assert pool.use_count() == 1
    del on1, on0, pool
    assert memory.memory_reserved(1) == 0


def test_graph_captures_into_a_mempool(sim_graph_backend):
    pool = MemPool()
    src = accel.Buffer(4096).fill_(5)
    g = Graph()
    with accel.graph(g, pool=pool.id):
        out = accel.Buffer(4096)
        out.copy_from(src, non_blocking=True)
    assert g.pool() == pool.id
    assert pool.use_count() == 2                   # the MemPool and the graph
    assert out.ptr in {b["address"] for seg in pool.snapshot() for b in seg["blocks"]}
    g.replay()
    accel.synchronize()
    assert int(out.to_numpy()[0]) == 5
    pool_id = pool.id
    del pool                                       # the graph keeps the pool alive
    alloc = memory.device_allocator(0)
    assert alloc.pool_use_count(pool_id) == 1
    g2 = Graph(pool=pool_id)                       # Graph(pool=mempool.id) too
    with accel.Stream():
        g2.capture_begin()
        out2 = accel.Buffer(4096)
        out2.fill_(1)
        g2.capture_end()
    assert alloc.pool_use_count(pool_id) == 2
    del out, out2
    g.reset()
    g2.reset()
    assert alloc.pool_use_count(pool_id) == 0
    memory.empty_cache()                           # (blocks the captures used wait for their events)
    assert pool_id not in alloc._private          # released: its segments joined the general cache
    assert all(pid == (0, 0) for pid in _pool_ids())


def test_a_pool_takes_one_route_at_a_time(sim_graph_backend):
    pool = MemPool()
    with use_mem_pool(pool):
        with pytest.raises(RuntimeError, match="already recording to mempool_id"):
            with use_mem_pool(pool):
                pass
        assert pool.use_count() == 2               # unchanged by the refusal
        with pytest.raises(RuntimeError, match="already recording to mempool_id"):
            with accel.graph(Graph(), pool=pool.id):
                pass
        assert pool.use_count() == 2
        buf = accel.Buffer(64)                     # still routed
    assert pool.use_count() == 1
    assert buf.ptr in {b["address"] for seg in pool.snapshot() for b in seg["blocks"]}


def test_empty_cache_inside_use_mem_pool_releases_the_general_cache_only(sim_cuda):
    tmp = accel.Buffer(8 * MiB)
    del tmp
    assert memory.memory_reserved() == 8 * MiB
    pool = MemPool()
    with use_mem_pool(pool):
        kept = accel.Buffer(8 * MiB)
        del kept
        memory.empty_cache()                       # no CaptureError: use_mem_pool is no capture
    assert memory.memory_reserved() == 8 * MiB    # the pool's free segment only
    assert len(pool.snapshot()) == 1
    del pool
    assert memory.memory_reserved() == 0


def test_bad_input_changes_nothing(sim_cuda):
    pool = MemPool()
    with pytest.raises(TypeError, match="takes an accel.MemPool, got tuple"):
        with use_mem_pool(pool.id):
            pass
    with pytest.raises(TypeError, match="use_on_oom"):
        MemPool(use_on_oom=1)
    with pytest.raises(TypeError, match="no_split"):
        MemPool(no_split="yes")
    with pytest.raises(accel.InvalidDeviceError):
        with use_mem_pool(pool, device=7):
            pass
    with pytest.raises(TypeError, match="pool id"):
        memory.memory_snapshot(mempool_id="0_1")
    assert pool.use_count() == 1
    assert accel.Buffer(64).ptr not in {b["address"] for seg in pool.snapshot() for b in seg["blocks"]}
    assert memory.device_allocator(0)._threads == {}


def test_body_error_ends_the_route(sim_cuda):
    pool = MemPool()
    with pytest.raises(KeyError):
        with use_mem_pool(pool):
            raise KeyError("body")
    assert pool.use_count() == 1
    assert memory.device_allocator(0)._threads == {}
    assert memory.device_allocator(0)._special is False


def test_cuda_malloc_async_has_no_mempool(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="backend:cudaMallocAsync")
    with pytest.raises(NotImplementedError, match="no private pools"):
        MemPool()


def test_thread_routes_keep_the_allocator_invariants():
    # random use of two MemPool-style routes, from two threads' idents, over the fake backend
    alloc, be = make()
    rng = random.Random(16)
    pools = [(0, 101), (0, 102)]
    for pool_id in pools:
        alloc.create_pool(pool_id, no_split=pool_id == (0, 102))
    live, routed = [], []
    for step in range(400):
        op = rng.random()
        if op < 0.15 and len(routed) < 2:
            pool_id = pools[len(routed)]
            alloc.begin_allocate_to_pool(pool_id, thread=threading.get_ident())
            routed.append(pool_id)
        elif op < 0.25 and routed:
            pool_id = routed.pop()
            alloc.end_allocate_to_pool(pool_id)
            alloc.release_pool(pool_id)
        elif op < 0.65 or not live:
            live.append(alloc.malloc(rng.choice((512, 4096, 700_000, 3 * MiB)), 0))
        else:
            alloc.free(live.pop(rng.randrange(len(live))))
        check_invariants(alloc, be)
    for pool_id in reversed(routed):
        alloc.end_allocate_to_pool(pool_id)
        alloc.release_pool(pool_id)
    for ptr in live:
        alloc.free(ptr)
    for pool_id in pools:
        alloc.release_pool(pool_id, mempool=True)
    check_invariants(alloc, be)
    alloc.empty_cache()
    assert be.live == {} and alloc._private == {}
