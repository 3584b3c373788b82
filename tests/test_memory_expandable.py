"""Expandable segments (issue 15 item 2) on the simulated CUDA runtime, which enforces the
driver's map/unmap rules (any violation raises or faults), on both devices including the
non-current one.  Invariants E1-E12: accel/memory/_expandable.py."""

import random

import pytest

from accel import _lazy, sim
from accel._errors import OutOfMemoryError
from accel.memory import _blocks, _caching, _config, _expandable
from accel.memory._caching import DeviceCachingAllocator
from accel.sim import _vmm
from conftest import use_sim

MiB = 1 << 20
G = 2 * MiB

pytestmark = pytest.mark.skipif(not _vmm.supported(), reason="this host cannot play virtual memory (mmap)")


@pytest.fixture
def be(monkeypatch):
    use_sim(monkeypatch, "cuda")
    b = _lazy.lazy_init()
    yield b
    sim.reset()


def make(be, index, conf="expandable_segments:True"):
    alloc = DeviceCachingAllocator(be, index, _config.parse(conf))
    return alloc


def check(alloc):
    """E1-E5 plus the free lists and the reserved/allocated stats."""
    mapped_total = 0
    allocated = 0
    for seg in alloc._exp_segs:
        end = seg.base
        prev_state = None
        mapped = 0
        for block in seg.blocks():
            assert block.ptr == end, "E1: blocks tile the reservation"
            assert block.seg is seg and block.size > 0
            st = block.state
            assert not (st == prev_state and st in (_caching._FREE, _expandable.UNMAPPED)), "E2"
            if st == _expandable.UNMAPPED:
                assert block.ptr % G == 0 and block.size % G == 0, "E4"
                assert block.ptr not in alloc._blocks
            else:
                assert alloc._blocks[block.ptr] is block
                mapped += block.size
                inside = [a for a in seg.maps if a < block.ptr + block.size and a + seg.maps[a][0] > block.ptr]
                assert inside, "E3: a mapped block lies on a mapping"
            if st == _caching._FREE:
                fl = block.pool
                assert (block.size << 64 | block.ptr) in fl.keys
            if st == _caching._ALLOCATED:
                allocated += block.size
            prev_state = st
            end += block.size
            if block.next is not None:
                assert block.next.prev is block
        assert end == seg.base + seg.size, "E1"
        assert seg.holes == {b for b in seg.blocks() if b.state == _expandable.UNMAPPED}, "holes record"
        assert len({id(b.pool) for b in seg.blocks()}) == 1, "a segment's blocks share one stream's lists"
        assert seg.kind == _caching._LARGE, "E12: one range per stream, the large pool's"
        assert mapped == seg.mapped == sum(n for n, _ in seg.maps.values()), "E3"
        for a, (n, _) in seg.maps.items():
            assert n % G == 0 and 0 < n // G <= max(1, alloc._reserved_hw // G // _expandable.PIECE_SHARE), "E9"
        mapped_total += mapped
    classic = sum(alloc._segments.values())
    stats = alloc.stats()
    unreleased = sum(u[1] for u in alloc._unreleased)
    assert stats["reserved_bytes.all.current"] == mapped_total + classic + unreleased, "E5"
    st = sim.state()
    assert st.vmm_mapped_bytes >= mapped_total
    return stats


@pytest.mark.parametrize("index", [0, 1])
def test_random_ops_keep_invariants_and_empty_cache_unmaps_all(be, index):
    alloc = make(be, index)
    rng = random.Random(index)
    stream = be.default_stream(index)
    live = []
    for step in range(400):
        if live and rng.random() < 0.45:
            alloc.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(alloc.malloc(rng.choice([700, 64 * 1024, MiB, 3 * MiB + 5, 12 * MiB, 31 * MiB]), stream))
        check(alloc)
    assert alloc._expandable
    stats = alloc.stats()
    assert stats["reserved_bytes.all.peak"] <= 1.3 * stats["allocated_bytes.all.peak"] + 4 * G
    for ptr in live:
        alloc.free(ptr)
    alloc.empty_cache()
    check(alloc)
    assert alloc.stats()["reserved_bytes.all.current"] == 0
    assert alloc.stats()["segment.all.current"] == 0
    assert sim.state().vmm_mappings == 0 and sim.state().vmm_handles == 0
    calls = alloc.map_stats()
    assert calls["num_device_map"] == calls["num_device_unmap"] > 0
    assert be.get_device() == 0


def test_copies_through_expandable_memory(be):
    alloc = make(be, 1)
    s = be.default_stream(1)
    ptrs = [alloc.malloc(3 * MiB, s) for _ in range(3)]
    alloc.free(ptrs[1])
    p = alloc.malloc(2 * MiB, s)     # best fit into the freed mapped space (large pool)
    assert ptrs[1] <= p < ptrs[1] + 3 * MiB
    prev = be.get_device()
    be.set_device(1)
    try:
        buf = bytearray(b"x" * MiB)
        out = bytearray(MiB)
        from accel._ffi import cudart_module
        ffi = cudart_module(13).ffi
        be.memcpy_async(p, int(ffi.cast("uintptr_t", ffi.from_buffer(buf))), MiB, s)
        be.memcpy_async(int(ffi.cast("uintptr_t", ffi.from_buffer(out))), p, MiB, s)
        be.stream_synchronize(s)
    finally:
        be.set_device(prev)
    assert out == buf
    check(alloc)


def test_oom_unmaps_free_pages_and_retries(be):
    alloc = make(be, 0)
    a = alloc.malloc(10 * MiB)
    b = alloc.malloc(10 * MiB)
    alloc.free(a)
    before = alloc.map_stats()["num_device_unmap"]
    sim.inject_oom()                 # the next cuMemCreate fails
    c = alloc.malloc(30 * MiB)       # retry after unmapping every free page
    assert alloc.map_stats()["num_device_unmap"] > before
    assert alloc.stats()["num_alloc_retries"] == 1
    check(alloc)
    sim.inject_oom(times=2)
    with pytest.raises(OutOfMemoryError, match="out of memory. Tried to allocate 40.00 MiB"):
        alloc.malloc(40 * MiB)
    stats = check(alloc)
    assert stats["num_ooms"] == 1
    assert stats["allocated_bytes.all.current"] == 40 * MiB
    alloc.free(b)
    alloc.free(c)
    alloc.empty_cache()
    assert sim.state().vmm_handles == 0


def test_memory_fraction_caps_mapped_bytes(be):
    alloc = make(be, 1, "expandable_segments:True,per_process_memory_fraction:0.01")
    cap = alloc._allowed_bytes()
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(cap + G)
    ptr = alloc.malloc(cap // 2)
    check(alloc)
    assert alloc.stats()["reserved_bytes.all.current"] <= cap
    alloc.free(ptr)


def test_high_water_mark_unmaps_instead_of_growing(be):
    alloc = make(be, 0)
    x = [alloc.malloc(8 * MiB) for _ in range(4)]        # 32 MiB mapped
    for p in x[::2]:
        alloc.free(p)                                     # two 8 MiB free holes, not adjacent
    y = alloc.malloc(16 * MiB)                            # fits nowhere: unmaps a free run first
    stats = check(alloc)
    assert stats["reserved_bytes.all.peak"] <= 32 * MiB + 8 * MiB
    assert alloc.map_stats()["num_device_unmap"] >= 1
    for p in x[1::2] + [y]:
        alloc.free(p)
    check(alloc)


def test_record_stream_on_expandable_blocks(be):
    alloc = make(be, 1)
    s0 = be.default_stream(1)
    prev = be.get_device()
    be.set_device(1)
    try:
        other = be.stream_create()
    finally:
        be.set_device(prev)
    p = alloc.malloc(4 * MiB, s0)
    alloc.record_stream(p, other, 1)
    alloc.free(p)
    q = alloc.malloc(4 * MiB, s0)
    check(alloc)
    alloc.free(q)
    alloc.empty_cache()                    # waits for the event, then unmaps everything free
    check(alloc)
    assert alloc.stats()["reserved_bytes.all.current"] == 0
    alloc.forget_stream(other, 1)
    be.set_device(1)
    try:
        be.stream_destroy(other)
    finally:
        be.set_device(prev)


def test_snapshot_marks_expandable_and_traces_map_unmap(be):
    alloc = make(be, 0)
    alloc.record_history(True)
    p = alloc.malloc(5 * MiB)
    snap = alloc.snapshot()
    segs = [s for s in snap["segments"] if s["is_expandable"]]
    assert segs and segs[0]["allocated_size"] == 5 * MiB
    alloc.free(p)
    alloc.empty_cache()
    actions = [e["action"] for e in alloc.snapshot()["device_traces"]]
    assert "segment_map" in actions and "segment_unmap" in actions


def test_on_by_default_off_and_torch_policy_keep_classic_segments(be):
    for conf, expandable in (("", True), ("expandable_segments:False", False), ("policy:torch", False),
                             ("policy:torch,expandable_segments:True", True)):
        alloc = make(be, 0, conf)
        p = alloc.malloc(3 * MiB)
        assert bool(alloc._exp_segs) == expandable and bool(alloc._segments) != expandable, conf
        alloc.free(p)
        alloc.empty_cache()
        assert alloc.stats()["reserved_bytes.all.current"] == 0


def test_graph_private_pools_keep_classic_segments(be):
    alloc = make(be, 0)
    s = be.default_stream(0)
    alloc.begin_allocate_to_pool((1, 1), s)
    p = alloc.malloc(3 * MiB, s)
    alloc.end_allocate_to_pool((1, 1))
    assert p in alloc._segments and not alloc._exp_segs
    alloc.free(p)
    alloc.release_pool((1, 1))
    alloc.empty_cache()
    check(alloc)


def test_pieces_give_shared_pages_their_own_piece():
    base = 64 * G
    # new pages [2, 12) for a block [2.5, 11.5): the first and last are shared, the 8
    # pages between are the block's own, in runs of at most `most` (4 here)
    got = _expandable.pieces(base + 2 * G, 10 * G, G, base + 2 * G + G // 2, base + 11 * G + G // 2, 4)
    assert [((a - base) // G, n // G) for a, n in got] == [(2, 1), (3, 4), (7, 4), (11, 1)]
    # 9 whole pages: equal runs (3 + 3 + 3), not 4 + 4 + 1
    got = _expandable.pieces(base, 9 * G, G, base, base + 9 * G, 4)
    assert [n // G for _, n in got] == [3, 3, 3]
    # a block inside one page, or starting before the new pages
    assert _expandable.pieces(base, G, G, base, base + 4096, 4) == [(base, G)]
    got = _expandable.pieces(base + 4 * G, 2 * G, G, base + G // 2, base + 5 * G + G // 2, 4)
    assert [((a - base) // G, n // G) for a, n in got] == [(4, 1), (5, 1)]


def test_a_page_shared_with_the_free_tail_pins_only_itself(be):
    # A 6.5 MiB block maps 4 pages: 3 of its own and a last one shared with the free tail,
    # where a 1.5 MiB block then lands.  Once the first block is freed, its 3 pages are
    # unmapped before reserved memory passes its high-water mark (E9, E10), so an 8 MiB
    # request peaks at 10 MiB.  With one 4-page piece the tail block pinned all of it and
    # reserved peaked at 16 MiB.
    alloc = make(be, 1)
    stream = be.default_stream(1)
    a = alloc.malloc(6 * MiB + MiB // 2, stream)
    b = alloc.malloc(MiB + MiB // 2, stream)
    assert b == a + 6 * MiB + MiB // 2
    alloc.free(a)
    c = alloc.malloc(8 * MiB, stream)
    stats = check(alloc)
    assert stats["reserved_bytes.all.peak"] == 10 * MiB
    for p in (b, c):
        alloc.free(p)
    alloc.empty_cache()
    assert alloc.stats()["reserved_bytes.all.current"] == 0


def test_free_piece_of_a_pinned_run_is_unmapped_before_growing(be):
    # A 16 MiB run pinned by a 3 MiB block at its start: its free pages are given back
    # before reserved memory passes its high-water mark (E9, E10), down to the two pages
    # the 3 MiB block covers: with a footprint of 8 pages the run was mapped page by page.
    # (Pieces of 4 pages kept 8 MiB mapped there: a 30 MiB peak; whole-run mappings the
    # whole run: 38 MiB.)
    alloc = make(be, 1)
    stream = be.default_stream(1)
    a = alloc.malloc(16 * MiB, stream)
    barrier = alloc.malloc(2 * MiB, stream)
    alloc.free(a)
    x = alloc.malloc(3 * MiB, stream)
    assert x == a
    z = alloc.malloc(20 * MiB, stream)
    stats = check(alloc)
    assert stats["reserved_bytes.all.peak"] == 26 * MiB
    for p in (x, z, barrier):
        alloc.free(p)
    alloc.empty_cache()
    assert alloc.stats()["reserved_bytes.all.current"] == 0


def test_capture_begun_by_another_thread_mid_miss_takes_a_classic_segment(be, monkeypatch):
    """A miss reads "no capture underway", then another thread begins a capture before the
    driver is called: the VMM call is refused (CaptureError, E6).  The allocation falls back to
    a classic segment, as capture-time misses do, and the user sees no error (gc_stress caught it
    on xpu: 'zePhysicalMemCreate is not allowed while a stream capture is underway')."""
    from accel._errors import CaptureError
    alloc = make(be, 1)
    keep = alloc.malloc(MiB)                       # a segment exists: the race is in growing it
    real_create, calls = be.vmm_create, []

    def create_after_capture_began(index, nbytes):
        calls.append(nbytes)
        if len(calls) == 1:
            raise CaptureError("libcuda: cuMemCreate is not allowed while a stream capture is underway")
        return real_create(index, nbytes)

    monkeypatch.setattr(be, "vmm_create", create_after_capture_began)
    ptr = alloc.malloc(8 * MiB)
    assert ptr and calls
    check(alloc)
    assert alloc.stats()["num_device_alloc"] == 2     # keep's map, then the classic segment (torch counts both)
    monkeypatch.setattr(be, "vmm_create", real_create)
    alloc.free(ptr)
    alloc.free(keep)
    alloc.empty_cache()
    assert sim.state().vmm_handles == 0 and alloc.stats()["reserved_bytes.all.current"] == 0


@pytest.mark.parametrize("index", [0, 1])
def test_no_address_range_left_takes_classic_segments(be, index):
    """cuMemAddressReserve fails with CUDA_ERROR_OUT_OF_MEMORY when the process's virtual
    address space is used up (each stream's range is the device's whole memory: some 900
    streams of an H200 fill a 47-bit space), with device memory still free: the stream's
    requests take classic segments instead of failing (it raised OutOfMemoryError naming
    cuMemAddressReserve while the device was empty).  A later stream gets its range when
    the driver has room again."""
    alloc = make(be, index)
    sim.inject_error("cuMemAddressReserve", 2, times=2)        # CUDA_ERROR_OUT_OF_MEMORY, twice
    small, large = alloc.malloc(4096), alloc.malloc(8 * MiB)
    check(alloc)
    stats = alloc.stats()
    assert stats["num_device_alloc"] == 2 and not alloc._exp_segs    # two classic segments
    assert stats["num_ooms"] == 0 and stats["num_alloc_retries"] == 0
    alloc.free(small)
    alloc.free(large)
    alloc.empty_cache()
    assert alloc.stats()["reserved_bytes.all.current"] == 0
    again = alloc.malloc(8 * MiB)                              # the driver has room again
    assert alloc._exp_segs and alloc.stats()["num_device_alloc"] == 3      # and a map, counted as torch does
    check(alloc)
    alloc.free(again)
    alloc.empty_cache()
    assert sim.state().vmm_handles == 0 and alloc.stats()["reserved_bytes.all.current"] == 0


def test_no_address_range_left_takes_classic_segments_on_level_zero(monkeypatch):
    """The same on Level Zero: zeVirtualMemReserve out of host memory (its code for a full
    address space), on the non-current device."""
    use_sim(monkeypatch, "xpu")
    be = _lazy.lazy_init()
    try:
        alloc = make(be, 1)
        sim.inject_error("zeVirtualMemReserve", 0x70000002, times=1)   # ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY
        ptr = alloc.malloc(8 * MiB)
        assert alloc.stats()["num_device_alloc"] == 1 and not alloc._exp_segs
        alloc.free(ptr)
        alloc.empty_cache()
        assert alloc.stats()["reserved_bytes.all.current"] == 0
    finally:
        sim.reset()


@pytest.mark.parametrize("conf", ["expandable_segments:True", "expandable_segments:False"])
def test_a_vendor_error_in_a_miss_is_not_chained_to_an_index_error(be, conf):
    """malloc finds a miss by an IndexError from its free list; the miss ran inside that
    handler, so a vendor error raised by it printed "During handling of the above exception
    (IndexError: list index out of range), another exception occurred", as if accel had
    failed inside."""
    from accel._errors import AcceleratorError
    alloc = make(be, 1, conf)
    sim.inject_error("cuMemAddressReserve" if conf.endswith("True") else "cudaMalloc", 1)   # INVALID_VALUE
    with pytest.raises(AcceleratorError, match="INVALID_VALUE|InvalidValue") as info:
        alloc.malloc(8 * MiB)
    assert not isinstance(info.value.__context__, IndexError), info.value.__context__
    ptr = alloc.malloc(8 * MiB)                   # state unchanged: the next one works
    alloc.free(ptr)
    alloc.empty_cache()
    assert alloc.stats()["reserved_bytes.all.current"] == 0


@pytest.mark.parametrize("index", [0, 1])
def test_small_requests_share_the_large_range(be, index):
    """E12, one address range per stream for every size: a 64 KiB request takes the free tail
    of the page a 3 MiB block shares with it, and maps nothing (a small pool of its own would
    map another 2 MiB page for it).  The block is the large pool's, in the stats too, as
    every block of a segment is (memory_stats agree with memory_snapshot, as torch's)."""
    alloc = make(be, index)
    stream = be.default_stream(index)
    big = alloc.malloc(3 * MiB, stream)
    maps = alloc.map_stats()["num_device_map"]
    small = alloc.malloc(64 << 10, stream)
    assert small == big + 3 * MiB
    stats = check(alloc)
    assert alloc.map_stats()["num_device_map"] == maps
    assert stats["reserved_bytes.all.current"] == 4 * MiB == stats["reserved_bytes.large_pool.current"]
    assert stats["segment.all.current"] == 0          # E14: torch counts classic segments only
    assert stats["allocation.large_pool.current"] == 2 and stats["allocation.small_pool.current"] == 0
    assert stats["allocated_bytes.large_pool.current"] == 3 * MiB + (64 << 10)
    (seg,) = alloc.snapshot()["segments"]
    assert seg["segment_type"] == "large" and seg["allocated_size"] == 3 * MiB + (64 << 10)
    alloc.free(small)
    alloc.free(big)
    alloc.empty_cache()
    assert alloc.stats()["reserved_bytes.all.current"] == 0 and sim.state().vmm_mappings == 0


def test_a_small_request_first_maps_one_page_of_the_shared_range(be):
    alloc = make(be, 1)
    stream = be.default_stream(1)
    p = alloc.malloc(4096, stream)                # the first request of all decides expandable
    stats = check(alloc)
    assert alloc._expandable and stats["reserved_bytes.large_pool.current"] == 2 * MiB
    q = alloc.malloc(MiB + 4096, stream)          # fits in the same page's free rest
    assert q == p + 4096 and alloc.map_stats()["num_device_map"] == 1
    for x in (p, q):
        alloc.free(x)
    alloc.empty_cache()
    assert alloc.stats()["reserved_bytes.all.current"] == 0


def test_pieces_are_at_most_a_thirty_second_of_the_footprint(be):
    """E9: the pages a block covers whole are mapped in runs of at most footprint / 32 pages
    (at least one), the footprint being the most ever reserved, this grow included: a pinned
    piece then holds back at most about 3 % of it, and a big footprint needs few map calls."""
    alloc = make(be, 0)
    stream = be.default_stream(0)
    a = alloc.malloc(10 * MiB, stream)            # footprint 5 pages: 1-page pieces
    assert sorted(n for n, _ in alloc._exp_segs[0].maps.values()) == [G] * 5
    b = alloc.malloc(256 * MiB, stream)           # footprint 133 pages: pieces of at most 4
    sizes = [n // G for n, _ in alloc._exp_segs[0].maps.values()]
    assert len(sizes) == 5 + 32 and max(sizes) == 4
    check(alloc)
    for x in (a, b):
        alloc.free(x)
    alloc.empty_cache()
    assert alloc.stats()["reserved_bytes.all.current"] == 0


def test_list_edits_keep_the_free_list_sorted():
    """_exp_map and _exp_unmap_one edit a free list in place (no copy of every cached block's
    key per map call): the edits give the sorted list, for every overlap of the keys."""
    rng = random.Random(5)
    for _ in range(2000):
        keys = sorted(rng.sample(range(1000), rng.randrange(0, 12)))
        gone = rng.sample(keys, min(len(keys), rng.randrange(0, 3)))
        new = rng.sample([k for k in range(1000) if k not in keys], rng.randrange(0, 3))
        want = sorted(set(keys) - set(gone) | set(new))
        (d1, d2), (p1, k1), (p2, k2) = _blocks._list_edits(keys, gone, new)
        got = list(keys)
        for d in (d1, d2):
            if d >= 0:
                del got[d]
        for p, k in ((p1, k1), (p2, k2)):
            if p >= 0:
                got[p:p] = (k,)
        assert got == want, (keys, gone, new)


@pytest.mark.parametrize("sim_name", ["cuda", "xpu"])
def test_dropped_streams_leave_no_reservations_behind(monkeypatch, sim_name):
    """E11, state bounded by live streams: each stream's expandable segment is an address range
    the size of the device.  A stream made, used and dropped in a loop below an earlier high-
    water mark (no unmap pass comes) left its range and its free pages mapped: 100 dropped
    streams kept 101 reservations and 200 MiB.  Once the work of a dropped stream is done, the
    free pieces of its segment are unmapped (its work, the only work that can touch a free
    block of it, is known complete: no device synchronize) and the range freed.  On the
    non-current device too."""
    import gc
    import accel
    from accel import memory
    use_sim(monkeypatch, sim_name)
    try:
        dev = accel.device_count() - 1
        alloc = memory.device_allocator(dev)
        big = accel.Buffer(256 * MiB, dev)             # a high-water mark far above the loop's needs
        del big
        before = len(alloc._exp_segs)
        for _ in range(40):
            s = accel.Stream(dev)
            b = accel.Buffer(2 * MiB, dev, stream=s)
            b.fill_(1, stream=s)
            del b
            s.close()
            del s
        gc.collect()
        keep = accel.Buffer(MiB, dev)                  # a later malloc settles what is pending
        assert len(alloc._exp_segs) <= before + 1, f"{len(alloc._exp_segs) - before} reservations of dropped streams"
        st = alloc.stats()
        assert st["reserved_bytes.all.current"] <= 256 * MiB + 4 * MiB
        del keep
        alloc.empty_cache()
        assert alloc.stats()["reserved_bytes.all.current"] == 0
    finally:
        sim.reset()


@pytest.mark.parametrize("sim_name", ["cuda", "xpu"])
def test_a_stream_churn_reuses_one_address_range(monkeypatch, sim_name):
    """A program that makes a stream per step (each with its first allocation, its segment
    dropped once the stream's work is done) reserved and freed an address range the size of
    the device for every stream: 40 steps, 40 cuMemAddressReserve and 40 cuMemAddressFree
    (torch's streams come from a fixed pool, so its per-stream ranges never churn).  The range
    of a dropped segment is kept as the allocator's one spare and taken by the next new
    segment; empty_cache frees it.  On the non-current device too."""
    import gc
    import accel
    from accel import memory
    use_sim(monkeypatch, sim_name)
    reserve, release = {"cuda": ("cuMemAddressReserve", "cuMemAddressFree"),
                        "xpu": ("zeVirtualMemReserve", "zeVirtualMemFree")}[sim_name]
    dev = accel.device_count() - 1
    alloc = memory.device_allocator(dev)
    keep = accel.Buffer(MiB, dev)
    before = sim.calls(reserve), sim.calls(release)
    for _ in range(40):
        s = accel.Stream(dev)
        b = accel.Buffer(4096, dev, stream=s)
        b.fill_(1, stream=s)
        del b
        s.close()
        del s
    gc.collect()
    again = accel.Buffer(MiB, dev)                 # a later malloc settles what is pending
    made, freed = sim.calls(reserve) - before[0], sim.calls(release) - before[1]
    assert made <= 2 and freed <= 1, f"{made} reservations made and {freed} freed for 40 short-lived streams"
    del keep, again
    memory.empty_cache()
    assert not alloc._exp_segs and not alloc._exp_spare
    state = sim.state()
    assert (state.vmm_reservations if sim_name == "cuda" else state.ze_vmm_reservations) == 0


@pytest.mark.parametrize("history", [False, True])
@pytest.mark.parametrize("index", [0, 1])
def test_a_split_block_goes_to_the_end_that_pins_no_new_page(be, index, history):
    """E13: a request carved out of a larger free block takes the end of it that touches fewer
    pages no live block holds.  A 3 MiB block at the range's start and a 1 MiB one after it
    share page 1; once the first is freed, a 512 KiB request taken from the low end would pin
    page 0 as well, so it goes to the high end, inside page 1, and the unmap pass frees page 0.
    Recording history (malloc's general path) must not change where blocks go."""
    alloc = make(be, index)
    if history:
        alloc.record_history(True)
    stream = be.default_stream(index)
    x = alloc.malloc(3 * MiB, stream)
    r = alloc.malloc(MiB, stream)
    assert r == x + 3 * MiB
    alloc.free(x)
    small = alloc.malloc(512 << 10, stream)
    assert small == r - (512 << 10), "carved from the low end: page 0 pinned as well"
    check(alloc)
    alloc.empty_cache()
    stats = check(alloc)
    assert stats["reserved_bytes.all.current"] == G
    assert stats["allocated_bytes.all.current"] == MiB + (512 << 10)
    alloc.free(small)
    tail = alloc.malloc(2 * MiB + (512 << 10), stream)   # low end again: pins no more
    check(alloc)
    for p in (tail, r):
        alloc.free(p)
    alloc.empty_cache()
    assert alloc.stats()["reserved_bytes.all.current"] == 0 and sim.state().vmm_mappings == 0


@pytest.mark.parametrize("a, b, size, expected", [
    (0, 3 * MiB, 512 << 10, True),                 # the right end shares page 1: no new page
    (0, 4 * MiB, 512 << 10, False),                # both ends page-aligned: the low end
    (MiB, 4 * MiB, 512 << 10, False),              # the left end shares page 0: the low end
    (MiB + (512 << 10), 3 * MiB, MiB, False),      # one shared page each side, a tie: the low end
    (3 * MiB // 2, 8 * MiB - (128 << 10), 2 * MiB + (640 << 10), True),   # low pins pages 1-2, high 2
    (3 * MiB // 2, 5 * MiB + MiB // 2, 2 * MiB + MiB // 2, False),       # one new page either way
    (MiB, MiB + (512 << 10), 256 << 10, False),    # inside one page shared on both sides
])
def test_high_end_pins_fewer(a, b, size, expected):
    assert _expandable.high_end_pins_fewer(a, b, size, G) is expected
