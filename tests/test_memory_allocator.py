"""The device caching allocator over a fake backend: invariants, errors, OOM,
stream-ordered reuse, private pools, configuration and thread safety."""

import random

import pytest

from accel._errors import CaptureError, OutOfMemoryError
from accel.memory import _caching, _config
from accel.memory._caching import DeviceCachingAllocator
from test_memory_fakes import FakeBackend, hammer

MiB = 1 << 20


def make(conf="", **fake):
    be = FakeBackend(**fake)
    return DeviceCachingAllocator(be, 0, _config.parse(conf)), be


# ---------------------------------------------------------------------------- invariants
def check_invariants(alloc, be):
    """Every structural and statistical property the allocator promises."""
    blocks = alloc._blocks
    seen = set()
    n = {"alloc": [0, 0, 0], "alloc_b": [0, 0, 0], "req": [0, 0, 0], "seg": [0, 0, 0], "res": [0, 0, 0],
         "isplit": [0, 0, 0], "isplit_b": [0, 0, 0], "pend": [0, 0, 0], "pend_b": [0, 0, 0]}
    assert set(alloc._segments) == set(be.live), "segments and backend allocations differ"
    for base, seg_size in alloc._segments.items():
        assert be.live[base] == seg_size
        block = blocks[base]
        assert block.prev is None
        fl = block.pool
        q = fl.kind
        end = base
        prev_free = False
        split = block.next is not None
        while block is not None:
            assert block.ptr == end, "blocks must tile the segment without gaps or overlap"
            assert block.size > 0 and block.size % 512 == 0
            assert block.pool is fl, "all blocks of a segment share one free list"
            assert blocks[block.ptr] is block
            if block.next is not None:
                assert block.next.prev is block
            is_free = block.state == _caching._FREE
            assert not (is_free and prev_free), "two adjacent free blocks were not coalesced"
            prev_free = is_free
            seen.add(block.ptr)
            for k in (0, q):
                if block.state == _caching._ALLOCATED:
                    n["alloc"][k] += 1
                    n["alloc_b"][k] += block.size
                    n["req"][k] += block.requested
                    assert block.requested <= block.size
                elif block.state == _caching._PENDING:
                    n["pend"][k] += 1
                    n["pend_b"][k] += block.size
                    n["req"][k] += block.requested     # until the block is free, as torch's
                elif split:
                    n["isplit"][k] += 1
                    n["isplit_b"][k] += block.size
            end += block.size
            block = block.next
        assert end == base + seg_size, "blocks must cover the whole segment"
        for k in (0, q):
            n["seg"][k] += 1
            n["res"][k] += seg_size
    assert seen == set(blocks), "every block belongs to a segment"
    # free lists: sorted, exactly the free blocks, each in its own list
    listed = set()
    all_lists = list(alloc._general.values()) + [l for p in alloc._private.values() for l in p.lists.values()]
    all_lists += [pair for entry in alloc._pending_events if type(entry[2]) is _caching._Retired
                  for _, pair in entry[2].lists]           # a destroyed stream's, waiting for its work
    for pair in all_lists:
        for fl in pair:
            assert fl.keys == sorted(fl.keys)
            for key in fl.keys:
                block = blocks[key & _caching._MASK]
                assert block.state == _caching._FREE and block.pool is fl
                assert key >> 64 == block.size
                assert block.ptr not in listed
                listed.add(block.ptr)
    assert listed == {p for p, b in blocks.items() if b.state == _caching._FREE}
    # release-before-grow reads the whole free segments from a record (_whole); it must
    # name exactly the ones a scan of every free list finds
    owners = [alloc._general] + [p.lists for p in alloc._private.values() if p.use_count == 0]
    scanned = {key & _caching._MASK for lists in owners for pair in lists.values() for fl in pair
               for key in fl.keys if blocks[key & _caching._MASK].prev is None
               and blocks[key & _caching._MASK].next is None and blocks[key & _caching._MASK].seg is None}
    assert {b.ptr for b in alloc._whole_free_segments()} == scanned
    assert set(alloc._whole) <= set(alloc._segments)      # bounded by live segments
    stats = alloc.stats()
    for q, pool in enumerate(("all", "small_pool", "large_pool")):
        expect = {"allocation": n["alloc"][q], "allocated_bytes": n["alloc_b"][q],
                  "requested_bytes": n["req"][q], "segment": n["seg"][q], "reserved_bytes": n["res"][q],
                  "inactive_split": n["isplit"][q], "inactive_split_bytes": n["isplit_b"][q],
                  "active": n["alloc"][q] + n["pend"][q], "active_bytes": n["alloc_b"][q] + n["pend_b"][q]}
        for name, value in expect.items():
            assert stats[f"{name}.{pool}.current"] == value, f"{name}.{pool}.current"
            assert stats[f"{name}.{pool}.peak"] >= value
            assert stats[f"{name}.{pool}.allocated"] - stats[f"{name}.{pool}.freed"] <= value
    # torch 2.13's 123 keys, and 12 per private pool: the bytes of the segments it owns
    per_pool = [k for k in stats if k.startswith("reserved_bytes_by_private_pools.")]
    assert len(stats) - len(per_pool) == 123
    owned = {}
    for base, seg_size in alloc._segments.items():
        owner = blocks[base].pool.owner
        if owner is not None:
            mine = owned.setdefault(owner.id, [0, 0, 0])
            mine[0] += seg_size
            mine[blocks[base].pool.kind] += seg_size
    for pool_id, entry in alloc.private_pool_stats().items():
        want = owned.pop(pool_id, [0, 0, 0])
        for q, pool in enumerate(("all", "small_pool", "large_pool")):
            assert entry[pool]["current"] == want[q], f"reserved_bytes_by_private_pools {pool_id} {pool}"
            assert entry[pool]["peak"] >= entry[pool]["current"]
    assert not owned, f"pools owning segments with no reserved_bytes_by_private_pools entry: {owned}"


def test_fresh_stats_have_torch_keys():
    alloc, _ = make()
    stats = alloc.stats()
    assert len(stats) == 123
    assert list(stats) == sorted(stats)
    assert stats["max_split_size"] == -1
    assert all(v == 0 for k, v in stats.items() if k != "max_split_size")
    for key in ("allocation.all.current", "inactive_split_bytes.large_pool.freed", "num_sync_all_streams",
                "oversize_segments.peak", "num_device_free", "requested_bytes.small_pool.allocated"):
        assert key in stats


def drain(alloc, be, live):
    """Free everything, let pending work finish, empty the cache: nothing may be left."""
    for ptr in live:
        alloc.free(ptr)
    be.complete_events()
    alloc.empty_cache()
    check_invariants(alloc, be)
    assert be.live == {}, "segments leaked after empty_cache"


def _random_ops(alloc, be, rng, steps, check=True):
    streams = [0, 101, 102]
    live = {}
    for _ in range(steps):
        r = rng.random()
        if r < 0.5 or not live:
            kind = rng.random()
            if kind < 0.45:
                size = rng.randint(1, MiB)
            elif kind < 0.9:
                size = rng.randint(MiB + 1, 24 * MiB)
            elif kind < 0.95:
                size = rng.choice([0, 512, MiB, 2 * MiB, 20 * MiB])
            else:
                size = rng.randint(1, 64) * 512
            stream = rng.choice(streams)
            ptr = alloc.malloc(size, stream)
            if size:
                assert ptr not in live
                live[ptr] = (size, stream)
        elif r < 0.85:
            ptr = rng.choice(list(live))
            del live[ptr]
            alloc.free(ptr)
        elif r < 0.93:
            ptr = rng.choice(list(live))
            alloc.record_stream(ptr, rng.choice(streams))
        elif r < 0.98:
            if rng.random() < 0.5:
                be.complete_events()
            else:
                for event in list(be.events):
                    if rng.random() < 0.5:
                        be.events[event] = True
        else:
            alloc.empty_cache()
        if check:
            check_invariants(alloc, be)
            spans = sorted((p, p + s) for p, (s, _) in live.items())
            for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
                assert a1 <= b0, "live allocations overlap"
    return live


def test_peaks_rise_when_a_freed_split_block_grows_its_free_neighbour_after_a_reset():
    # [live][b][free tail]: freeing b merges it into the tail, so the inactive split bytes
    # rise.  A repeated malloc/free pair alternates between two states; a peak reset between
    # them must still let the free raise the peaks (the memo of a value known to be under
    # the peaks is per call site, and reset_peak_stats clears both).
    alloc, be = make()
    keep = alloc.malloc(3 * MiB, 0)          # a 4 MiB segment: [keep][1 MiB free]
    for _ in range(3):
        b = alloc.malloc(MiB // 2, 0)
        check_invariants(alloc, be)
        alloc.free(b)
        check_invariants(alloc, be)
    b = alloc.malloc(MiB // 2, 0)
    alloc.reset_peak_stats()
    alloc.free(b)
    check_invariants(alloc, be)
    stats = alloc.stats()
    assert stats["inactive_split_bytes.all.peak"] == stats["inactive_split_bytes.all.current"] == MiB
    alloc.free(keep)
    check_invariants(alloc, be)

@pytest.mark.parametrize("policy", ["accel", "torch"])
def test_randomized_invariants_after_every_op(policy):
    alloc, be = make(f"policy:{policy}")
    live = _random_ops(alloc, be, random.Random(1234), 1500)
    for ptr in live:
        alloc.free(ptr)
    alloc.empty_cache()
    check_invariants(alloc, be)
    assert be.live == {}, "segments leaked after empty_cache"
    stats = alloc.stats()
    assert stats["allocated_bytes.all.current"] == stats["reserved_bytes.all.current"] == 0
    assert stats["num_device_alloc"] == stats["num_device_free"] == be.alloc_calls


@pytest.mark.parametrize("conf", ["max_split_size_mb:32", "roundup_power2_divisions:4",
                                  "garbage_collection_threshold:0.5", "release_threshold:8M"])
def test_randomized_invariants_with_options(conf):
    alloc, be = make(conf, capacity=1 << 40)
    drain(alloc, be, _random_ops(alloc, be, random.Random(99), 300))


def test_split_and_coalesce():
    alloc, be = make()
    a = alloc.malloc(3 * MiB, 0)
    b = alloc.malloc(3 * MiB, 0)      # reuses the 4 MiB segment? no: 1 MiB left, a new segment
    check_invariants(alloc, be)
    assert alloc.stats()["segment.large_pool.current"] == 2
    alloc.free(a)
    alloc.free(b)
    check_invariants(alloc, be)
    small = [alloc.malloc(1000, 0) for _ in range(3)]
    assert small[1] - small[0] == 1024 and small[2] - small[1] == 1024, "512-byte granules, address order"
    alloc.free(small[1])
    stats = alloc.stats()
    assert stats["inactive_split.small_pool.current"] == 2
    alloc.free(small[0])
    alloc.free(small[2])
    check_invariants(alloc, be)
    assert alloc.stats()["inactive_split.all.current"] == 0
    assert alloc.malloc(1000, 0) == small[0], "best fit, lowest address first"


def test_best_fit_prefers_smallest_block():
    alloc, be = make("policy:torch")
    big = alloc.malloc(12 * MiB, 0)          # a 12 MiB segment
    mid = alloc.malloc(5 * MiB, 0)           # a 20 MiB segment
    alloc.free(big)
    alloc.free(mid)
    ptr = alloc.malloc(11 * MiB, 0)
    assert ptr == big, "the 12 MiB block fits best"
    check_invariants(alloc, be)


def test_stats_allocated_freed_and_resets():
    alloc, be = make()
    ptrs = [alloc.malloc(1000, 0) for _ in range(4)]
    for p in ptrs[:3]:
        alloc.free(p)
    stats = alloc.stats()
    assert stats["allocation.all.allocated"] == 4 and stats["allocation.all.freed"] == 3
    assert stats["allocation.all.peak"] == 4 and stats["allocation.all.current"] == 1
    assert stats["requested_bytes.all.current"] == 1000
    assert stats["allocated_bytes.all.current"] == 1024
    alloc.reset_peak_stats()
    assert alloc.stats()["allocation.all.peak"] == 1
    alloc.reset_accumulated_stats()
    stats = alloc.stats()
    assert stats["allocation.all.allocated"] == 0 and stats["allocation.all.freed"] == 0
    assert stats["allocation.all.current"] == 1 and stats["num_device_alloc"] == 0
    alloc.free(ptrs[3])
    stats = alloc.stats()
    assert stats["allocation.all.freed"] == 1 and stats["allocation.all.current"] == 0


# ---------------------------------------------------------------------------- bad input
def _state(alloc, be):
    snap = alloc.snapshot()
    return snap["segments"], dict(alloc.stats()), dict(be.live)


@pytest.mark.parametrize("size, exc, words", [
    (-1, ValueError, "negative"), (1.5, TypeError, "float"), ("10", TypeError, "str"),
    (True, TypeError, "bool"), (None, TypeError, "NoneType"), ([], TypeError, "list")])
def test_bad_sizes_raise_and_change_nothing(size, exc, words):
    alloc, be = make()
    keep = alloc.malloc(1000, 0)
    before = _state(alloc, be)
    with pytest.raises(exc, match=words):
        alloc.malloc(size, 0)
    assert _state(alloc, be) == before
    alloc.free(keep)


def test_stream_must_be_a_handle():
    alloc, be = make()
    before = _state(alloc, be)
    with pytest.raises(TypeError, match="stream handle"):
        alloc.malloc(1000, object())
    assert _state(alloc, be) == before


def test_index_like_sizes_are_accepted():
    np = pytest.importorskip("numpy")
    alloc, be = make()
    ptr = alloc.malloc(np.int64(4096), 0)
    assert alloc.stats()["requested_bytes.all.current"] == 4096
    alloc.free(ptr)
    assert alloc.malloc(0, 0) == 0
    alloc.free(0)       # freeing the null pointer is a no-op, as torch


def test_double_free_and_foreign_pointers():
    alloc, be = make()
    a = alloc.malloc(1000, 0)
    b = alloc.malloc(5 * MiB, 0)
    alloc.free(a)
    before = _state(alloc, be)
    with pytest.raises(ValueError, match=f"{a:#x}.*double free"):
        alloc.free(a)
    with pytest.raises(ValueError, match=f"{0xdead000:#x}.*not allocated by"):
        alloc.free(0xdead000)
    with pytest.raises(ValueError, match="interior"):
        alloc.free(b + 512)
    with pytest.raises(TypeError, match="int"):
        alloc.free("0x10")
    with pytest.raises(ValueError, match=f"{a:#x}"):
        alloc.record_stream(a, 7)
    assert _state(alloc, be) == before
    check_invariants(alloc, be)
    # a pending (waiting for events) block is freed too: a second free is still a double free
    alloc.record_stream(b, 7)
    alloc.free(b)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(b)
    check_invariants(alloc, be)


# ---------------------------------------------------------------------------- OOM
def test_oom_frees_cache_and_retries():
    alloc, be = make(capacity=64 * MiB)
    ptrs = [alloc.malloc(10 * MiB, 0) for _ in range(5)]
    for p in ptrs:
        alloc.free(p)
    assert len(be.live) == 5
    be.fail_allocs = 1                       # the next cudaMalloc fails once
    ptr = alloc.malloc(30 * MiB, 0)          # needs a new segment: fails, frees cache, retries
    stats = alloc.stats()
    assert stats["num_alloc_retries"] == 1 and stats["num_ooms"] == 0
    assert stats["num_device_free"] == 5
    alloc.free(ptr)
    check_invariants(alloc, be)


def test_oom_message_and_state():
    alloc, be = make(capacity=64 * MiB)
    keep = alloc.malloc(40 * MiB, 0)
    before = _state(alloc, be)
    with pytest.raises(OutOfMemoryError) as info:
        alloc.malloc(30 * MiB, 0)
    msg = str(info.value)
    assert "CUDA out of memory. Tried to allocate 30.00 MiB" in msg
    assert "total capacity of 64.00 MiB of which 24.00 MiB is free" in msg
    assert "40.00 MiB is allocated by accel" in msg and "reserved by accel but unallocated" in msg
    assert "ACCEL_ALLOC_CONF" in msg
    stats = alloc.stats()
    assert stats["num_ooms"] == 1 and stats["num_alloc_retries"] == 1
    assert _state(alloc, be)[0] == before[0]
    alloc.free(keep)
    check_invariants(alloc, be)


def test_oom_waits_for_pending_blocks_before_failing():
    alloc, be = make(capacity=32 * MiB)
    ptr = alloc.malloc(30 * MiB, 0)
    alloc.record_stream(ptr, 5)
    alloc.free(ptr)                           # pending: event on stream 5 not done
    again = alloc.malloc(30 * MiB, 0)         # cannot grow: synchronizes the event instead
    assert again == ptr
    assert be.event_syncs == 1
    assert alloc.stats()["num_sync_all_streams"] == 1
    alloc.free(again)
    check_invariants(alloc, be)


def test_per_process_memory_fraction_caps_reserved():
    alloc, be = make("per_process_memory_fraction:0.5", capacity=64 * MiB)
    a = alloc.malloc(20 * MiB, 0)
    with pytest.raises(OutOfMemoryError, match="32.00 MiB allowed"):
        alloc.malloc(20 * MiB, 0)
    alloc.free(a)


# ---------------------------------------------------------------------------- streams
def test_block_used_on_other_stream_waits_for_its_event():
    alloc, be = make()
    ptr = alloc.malloc(4 * MiB, 0)
    alloc.record_stream(ptr, 7)
    alloc.record_stream(ptr, 0)               # its own stream: nothing to wait for
    alloc.free(ptr)
    stats = alloc.stats()
    assert stats["active.all.current"] == 1 and stats["allocation.all.current"] == 0
    other = alloc.malloc(4 * MiB, 0)
    assert other != ptr, "reused while stream 7 may still use it"
    be.complete_events()
    third = alloc.malloc(4 * MiB, 0)
    assert third == ptr, "reused once the event completed"
    assert alloc.stats()["active.all.current"] == 2
    check_invariants(alloc, be)


def test_blocks_are_cached_per_stream():
    # torch policy: the accel policy would release stream 1's idle segment instead of growing
    alloc, be = make("policy:torch")
    ptr = alloc.malloc(1000, 1)
    alloc.free(ptr)
    assert alloc.malloc(1000, 2) != ptr
    assert alloc.malloc(1000, 1) == ptr
    check_invariants(alloc, be)


# ---------------------------------------------------------------------------- private pools
def test_private_pool_routes_and_keeps_memory_until_released():
    alloc, be = make()
    pool = (1, 0)
    alloc.begin_allocate_to_pool(pool, 9)
    inside = alloc.malloc(3 * MiB, 9)
    outside = alloc.malloc(3 * MiB, 0)
    with pytest.raises(CaptureError, match="capture"):
        alloc.empty_cache()
    alloc.end_allocate_to_pool(pool)
    alloc.free(inside)
    # pool memory is not handed to general allocations, even on the same stream
    assert alloc.malloc(3 * MiB, 9) != inside
    alloc.empty_cache()                        # the pool's free segment stays
    assert inside in {s["address"] for s in alloc.snapshot()["segments"]}
    alloc.release_pool(pool)
    assert alloc._private == {}
    assert alloc.malloc(3 * MiB, 9) == inside, "after release the segment joined the general cache"
    alloc.free(outside)
    check_invariants(alloc, be)


def test_shared_pool_needs_every_release():
    alloc, be = make()
    pool = (2, 5)
    for _ in range(2):                         # two graphs capture into the same pool
        alloc.begin_allocate_to_pool(pool, 3)
        ptr = alloc.malloc(MiB, 3)
        alloc.end_allocate_to_pool(pool)
        alloc.free(ptr)
    alloc.release_pool(pool)
    assert pool in alloc._private
    alloc.release_pool(pool)
    assert pool not in alloc._private
    with pytest.raises(ValueError, match="no private pool"):
        alloc.release_pool(pool)
    with pytest.raises(TypeError, match="tuple of two ints"):
        alloc.begin_allocate_to_pool(7, 3)
    check_invariants(alloc, be)


def test_released_pool_returns_live_segments_when_freed():
    alloc, be = make()
    alloc.begin_allocate_to_pool((3, 0), 4)
    ptr = alloc.malloc(5 * MiB, 4)
    alloc.end_allocate_to_pool((3, 0))
    alloc.release_pool((3, 0))
    assert (3, 0) in alloc._private            # still holds a live block
    alloc.free(ptr)
    assert alloc._private == {}
    alloc.empty_cache()
    assert be.live == {}
    check_invariants(alloc, be)


def test_free_with_stream_use_during_capture_is_deferred():
    alloc, be = make()
    ptr = alloc.malloc(MiB, 0)
    alloc.record_stream(ptr, 8)
    alloc.begin_allocate_to_pool((4, 0), 8)
    alloc.free(ptr)
    assert be.events == {}, "no event may be recorded while capturing"
    alloc.end_allocate_to_pool((4, 0))
    assert len(be.events) == 1
    alloc.release_pool((4, 0))
    check_invariants(alloc, be)


# ---------------------------------------------------------------------------- configuration
def test_config_parsing():
    conf = _config.parse("max_split_size_mb:64, garbage_collection_threshold:0.8,"
                         "roundup_power2_divisions:[256:1,512:2,>:4],release_threshold:1G,"
                         "per_process_memory_fraction:0.5,policy:torch,backend:native")
    assert conf.max_split_size == 64 * MiB and conf.garbage_collection_threshold == 0.8
    assert conf.release_threshold == 1 << 30 and conf.per_process_memory_fraction == 0.5
    assert conf.divisions_for(MiB) == 1 and conf.divisions_for(1 << 30) == 4
    assert _config.parse("roundup_power2_divisions:4").divisions_for(12345) == 4


@pytest.mark.parametrize("text, words", [
    ("max_split_size:64", "(?s)unknown allocator option 'max_split_size'.*max_split_size_mb"),
    ("max_split_size_mb:10", "must be >= 20"), ("garbage_collection_threshold:1.5", "expected 0 <"),
    ("roundup_power2_divisions:3", "power of two"),
    ("expandable_segments:yes", "Expected a single True/False argument"),       # torch's bound and wording
    ("policy:fast", "accel or torch"), ("max_split_size_mb=64", "key:value")])
def test_config_errors(text, words):
    with pytest.raises(ValueError, match=words):
        _config.parse(text)


def test_config_from_environment(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:100")
    assert _config.from_environment().max_split_size == 100 * MiB
    monkeypatch.setenv("ACCEL_ALLOC_CONF", "max_split_size_mb:200")
    assert _config.from_environment().max_split_size == 200 * MiB
    monkeypatch.setenv("ACCEL_ALLOC_CONF", "bogus:1")
    with pytest.raises(ValueError, match="ACCEL_ALLOC_CONF: unknown allocator option 'bogus'"):
        DeviceCachingAllocator(FakeBackend(), 0)


def test_expandable_segments_without_vmm_keep_classic_segments():
    conf = _config.parse("expandable_segments:True")     # the fake backend has no virtual memory
    alloc = DeviceCachingAllocator(FakeBackend(), 0, conf)
    alloc.free(alloc.malloc(MiB, 0))


def test_max_split_size_keeps_oversize_blocks_whole():
    alloc, be = make("max_split_size_mb:40,policy:torch")
    big = alloc.malloc(50 * MiB, 0)
    alloc.free(big)
    small = alloc.malloc(5 * MiB, 0)
    assert not (big <= small < big + 50 * MiB), "oversize blocks never serve small requests"
    again = alloc.malloc(45 * MiB, 0)
    assert again == big, "an oversize request may take a block up to 20 MiB larger, unsplit"
    stats = alloc.stats()
    assert stats["oversize_allocations.current"] == 1 and stats["oversize_segments.current"] == 1
    assert stats["max_split_size"] == 40 * MiB
    assert stats["allocated_bytes.all.current"] == 50 * MiB + 5 * MiB
    check_invariants(alloc, be)


def test_roundup_power2_divisions():
    alloc, be = make("roundup_power2_divisions:4")
    ptr = alloc.malloc(1200 * 1024, 0)       # between 1 MiB and 2 MiB: steps of 256 KiB
    assert alloc.stats()["allocated_bytes.all.current"] == 1280 * 1024
    alloc.free(ptr)
    assert _caching._roundup_power2_next_division(1 << 20, 4) == 1 << 20


def test_garbage_collection_threshold_releases_before_growing():
    alloc, be = make("garbage_collection_threshold:0.5,policy:torch", capacity=100 * MiB)
    a = alloc.malloc(30 * MiB, 0)
    alloc.free(a)
    b = alloc.malloc(40 * MiB, 0)            # 30 + 40 > 50: the cached 30 MiB goes first
    assert alloc.stats()["num_device_free"] == 1
    alloc.free(b)
    check_invariants(alloc, be)


def test_release_threshold_bounds_cached_free_segments():
    alloc, be = make("release_threshold:8M")
    ptrs = [alloc.malloc(5 * MiB, 0) for _ in range(4)]
    for p in ptrs:
        alloc.free(p)
    whole = sum(b.size for b in alloc._whole_free_segments())
    assert whole <= 8 * MiB
    check_invariants(alloc, be)


def test_accel_policy_reuses_instead_of_growing_past_high_water():
    alloc, be = make()
    a = alloc.malloc(6 * MiB, 0)
    alloc.free(a)
    b = alloc.malloc(8 * MiB, 0)             # would exceed the 6 MiB high-water mark
    stats = alloc.stats()
    assert stats["reserved_bytes.all.peak"] == 8 * MiB, "the unused 6 MiB segment was released first"
    alloc.free(b)


# ---------------------------------------------------------------------------- threads
def test_eight_threads_hammering():
    alloc, be = make()
    assert hammer(alloc, [512, 4000, MiB, 3 * MiB], lambda seed: seed % 3, 1500) == []
    check_invariants(alloc, be)
    assert alloc.stats()["allocation.all.current"] == 0
    alloc.empty_cache()
    assert be.live == {}


# ---------------------------------------------------------------------------- history and snapshot
def test_snapshot_and_history():
    alloc, be = make()
    alloc.record_history(True)
    ptr = alloc.malloc(1000, 0)
    snap = alloc.snapshot()
    (seg,) = snap["segments"]
    assert seg["segment_type"] == "small" and seg["total_size"] == 2 * MiB
    first = seg["blocks"][0]
    assert first["state"] == "active_allocated" and first["requested_size"] == 1000
    assert any(f["name"] == "test_snapshot_and_history" for f in first["frames"])
    assert seg["blocks"][1]["state"] == "inactive"
    alloc.free(ptr)
    actions = [e["action"] for e in alloc.snapshot()["device_traces"]]
    # "snapshot": the first snapshot's entry (torch's TraceEntry::SNAPSHOT, recorded after it read the trace)
    assert actions == ["segment_alloc", "alloc", "snapshot", "free_requested", "free_completed"]
    alloc.record_history(False)
    assert alloc.snapshot()["device_traces"] == []


def test_event_handles_are_reused_and_destroyed():
    alloc, be = make()
    for _ in range(3):
        ptr = alloc.malloc(MiB, 0)
        alloc.record_stream(ptr, 4)
        alloc.free(ptr)
        be.complete_events()
        alloc.free(alloc.malloc(MiB, 0))       # processes the completed event
    assert len(be.events) == 1, "one event handle, reused"
    alloc.empty_cache()
    assert be.events == {}
