"""The accel segment policy with classic segments (issue 15 item 4): where a request
goes when no cached block of its own pool fits.  Over the fake backend, with the
allocator's invariants checked after each step."""

import pytest

from test_memory_allocator import check_invariants, drain, make

MiB = 1 << 20
KiB = 1 << 10


def _reserved(alloc):
    return alloc.stats()["reserved_bytes.all.current"]


def test_small_request_takes_a_large_tail_instead_of_growing_past_the_high_water_mark():
    alloc, be = make()
    big = alloc.malloc(3 * MiB)                 # a 4 MiB large segment, 1 MiB of it free
    assert _reserved(alloc) == 4 * MiB
    small = alloc.malloc(4 * KiB)               # a new 2 MiB small segment would lift reserved to 6
    check_invariants(alloc, be)
    assert _reserved(alloc) == 4 * MiB and len(be.live) == 1
    # the high end of the free tail, so the tail's low part stays next to the big block
    assert small == big + 4 * MiB - 4 * KiB
    stats = alloc.stats()
    assert stats["allocation.large_pool.current"] == 2          # counted by the segment's pool
    assert stats["inactive_split.large_pool.current"] == 1
    alloc.free(big)
    check_invariants(alloc, be)
    again = alloc.malloc(4 * MiB - 4 * KiB)     # the freed block merged with the rest of the tail
    assert again == big and len(be.live) == 1
    check_invariants(alloc, be)
    drain(alloc, be, [small, again])


def test_small_request_grows_the_small_pool_below_the_high_water_mark():
    alloc, be = make()
    alloc.free(alloc.malloc(8 * MiB))
    alloc.empty_cache()                         # reserved 0, high-water mark 8 MiB
    big = alloc.malloc(3 * MiB)
    small = alloc.malloc(4 * KiB)               # 4 + 2 MiB stays under the mark: a small segment
    check_invariants(alloc, be)
    assert _reserved(alloc) == 6 * MiB and len(be.live) == 2
    assert alloc.stats()["allocation.small_pool.current"] == 1
    drain(alloc, be, [big, small])


def test_whole_free_segments_are_released_before_a_small_request_shares_a_large_block():
    alloc, be = make()
    keep = alloc.malloc(3 * MiB)                # 4 MiB segment, 1 MiB tail
    alloc.free(alloc.malloc(2 * MiB))           # a whole free 2 MiB large segment; mark 6 MiB
    small = alloc.malloc(4 * KiB)               # release-before-grow pays for the small segment
    check_invariants(alloc, be)
    assert _reserved(alloc) == 6 * MiB
    assert alloc.stats()["allocation.small_pool.current"] == 1
    drain(alloc, be, [keep, small])


@pytest.mark.parametrize("conf", ["policy:torch", "max_split_size_mb:21"])
def test_torch_policy_and_oversize_blocks_keep_pools_apart(conf):
    alloc, be = make(conf)
    big = alloc.malloc(30 * MiB if "max_split" in conf else 3 * MiB)
    small = alloc.malloc(4 * KiB)
    check_invariants(alloc, be)
    assert alloc.stats()["allocation.small_pool.current"] == 1
    drain(alloc, be, [big, small])


def test_randomized_small_and_large_mix_keeps_invariants():
    import random
    rng = random.Random(15)
    alloc, be = make()
    live = []
    for step in range(3000):
        if live and rng.random() < 0.45:
            alloc.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.choice([rng.randrange(1, 1 << 20), rng.randrange(1 << 20, 9 << 20)])
            live.append(alloc.malloc(size))
        if step % 50 == 0:
            check_invariants(alloc, be)
        if step % 700 == 0:
            alloc.empty_cache()
    drain(alloc, be, live)


def test_request_takes_a_split_segments_free_block_before_carving_a_whole_free_segment():
    # Best fit would carve 3 MiB out of the whole free 8 MiB segment and pin all of it; the
    # free 10 MiB of the segment the 4 MiB block already pins costs nothing new.
    alloc, be = make()
    a = alloc.malloc(14 * MiB)                  # a 14 MiB segment
    b = alloc.malloc(8 * MiB)                   # and an 8 MiB one
    alloc.free(a)
    pin = alloc.malloc(4 * MiB)                 # 4 MiB of the 14 (not over 4x its own 4): its 10 MiB rest is split
    alloc.free(b)                               # a whole free 8 MiB segment
    x = alloc.malloc(3 * MiB)
    check_invariants(alloc, be)
    assert pin <= x < pin + 14 * MiB
    whole = [b for b in alloc._blocks.values() if b.prev is None and b.next is None]
    assert [b.size for b in whole] == [8 * MiB]       # still whole: release-before-grow can return it
    stats_before = alloc.stats()["reserved_bytes.all.current"]
    big = alloc.malloc(7 * MiB)                 # fits the 7 MiB left in the 14 MiB segment
    assert alloc.stats()["reserved_bytes.all.current"] == stats_before == 22 * MiB
    drain(alloc, be, [pin, x, big])


@pytest.mark.parametrize("conf", ["policy:torch", "max_split_size_mb:21"])
def test_torch_rules_and_oversize_limits_keep_best_fit(conf):
    alloc, be = make(conf)
    a = alloc.malloc(14 * MiB)
    b = alloc.malloc(8 * MiB)
    alloc.free(a)
    pin = alloc.malloc(2 * MiB)
    alloc.free(b)
    x = alloc.malloc(3 * MiB)
    check_invariants(alloc, be)
    assert not (pin <= x < pin + 14 * MiB)      # best fit: the 8 MiB segment
    drain(alloc, be, [pin, x])
