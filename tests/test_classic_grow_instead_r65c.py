"""Classic segments under accel's rules (issue 15 item 4): a large request whose best fit is a
whole free segment over four times its own new segment (the request rounded up to 2 MiB), with
no split segment to take it, gets a segment of its own instead of pinning the big one
(DeviceCachingAllocator._grow_instead).  The big segment then stays cached whole for a request
of its size, or goes back to the device before reserved memory passes its high-water mark or
past a cap.  Torch's rules and an oversize limit keep best fit.  Over the fake backend, with the
allocator's invariants checked after each step."""

import pytest

from test_memory_allocator import check_invariants, drain, make

MiB = 1 << 20


def _reserved(alloc):
    return alloc.stats()["reserved_bytes.all.current"]


def _segment_of(alloc, ptr):
    return max(base for base in alloc._segments if base <= ptr)


def test_small_request_gets_its_own_segment_and_the_big_one_stays_cached_below_the_mark():
    alloc, be = make()
    alloc.free(alloc.malloc(64 * MiB))
    alloc.empty_cache()                         # high-water mark 64 MiB, nothing reserved
    big = alloc.malloc(32 * MiB)
    alloc.free(big)                             # a whole free 32 MiB segment
    pin = alloc.malloc(2 * MiB)                 # 32 > 4 x 2: a 2 MiB segment of its own
    check_invariants(alloc, be)
    assert alloc._segments[_segment_of(alloc, pin)] == 2 * MiB
    assert sorted(be.live.values()) == [2 * MiB, 32 * MiB]       # the 32 MiB one kept, whole
    again = alloc.malloc(30 * MiB)              # and a request of its size takes it
    assert again == big and _reserved(alloc) == 34 * MiB
    check_invariants(alloc, be)
    drain(alloc, be, [pin, again])


def test_the_big_segment_goes_back_when_the_new_one_would_pass_the_mark():
    alloc, be = make()
    alloc.free(alloc.malloc(32 * MiB))          # high-water mark 32 MiB
    pin = alloc.malloc(2 * MiB)
    check_invariants(alloc, be)
    assert list(be.live.values()) == [2 * MiB] and _reserved(alloc) == 2 * MiB
    drain(alloc, be, [pin])


def test_a_cap_that_carving_would_break_is_met():
    # 34 MiB allowed: carving 2 MiB out of the free 32 MiB segment would leave no room for
    # the next 32 MiB request; a 2 MiB segment of its own does.
    alloc, be = make("per_process_memory_fraction:0.53125", capacity=64 * MiB)
    alloc.free(alloc.malloc(32 * MiB))
    pin = alloc.malloc(2 * MiB)
    other = alloc.malloc(32 * MiB)
    check_invariants(alloc, be)
    assert _reserved(alloc) == 34 * MiB
    drain(alloc, be, [pin, other])


def test_a_segment_at_most_four_times_the_own_one_is_still_carved():
    alloc, be = make()
    seg = alloc.malloc(8 * MiB)
    alloc.free(seg)
    pin = alloc.malloc(2 * MiB)                 # 8 = 4 x 2: carved, no new segment
    check_invariants(alloc, be)
    assert pin == seg and list(be.live.values()) == [8 * MiB]
    drain(alloc, be, [pin])


def test_an_odd_request_compares_with_its_rounded_segment():
    alloc, be = make()
    seg = alloc.malloc(12 * MiB)
    alloc.free(seg)
    pin = alloc.malloc(2 * MiB + 512)           # own segment 4 MiB: 12 <= 16, carved
    check_invariants(alloc, be)
    assert pin == seg and list(be.live.values()) == [12 * MiB]
    drain(alloc, be, [pin])


@pytest.mark.parametrize("conf", ["policy:torch", "max_split_size_mb:64"])
def test_torch_rules_and_oversize_limits_keep_best_fit(conf):
    alloc, be = make(conf)
    seg = alloc.malloc(32 * MiB)
    alloc.free(seg)
    pin = alloc.malloc(2 * MiB)
    check_invariants(alloc, be)
    assert pin == seg and list(be.live.values()) == [32 * MiB]
    drain(alloc, be, [pin])
