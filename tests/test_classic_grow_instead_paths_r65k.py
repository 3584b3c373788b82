"""Classic segments (issue 15 item 4): `_grow_instead` (a large request whose best fit is a whole
free segment over four times its own new segment gets a segment of its own) must hold on every
path malloc takes, not only its hot path.  malloc's other path (``_find_special``, through
``_find``) runs while memory history is recorded, while freed blocks wait for events
(``record_stream``), and under ``roundup_power2_divisions``; before r65k it skipped the rule, so
recording a snapshot changed where requests went (as recorded, peak reserved over peak live with
history on: wide & deep 1.100 -> 1.283, gnn scatter 1.071 -> 1.183, WaveNet 1.355 -> 1.443).
Over the fake backend, with the allocator's invariants checked."""

import pytest

from test_memory_allocator import check_invariants, drain, make

MiB = 1 << 20


def _segment_of(alloc, ptr):
    return max(base for base in alloc._segments if base <= ptr)


def _history(alloc):
    alloc.record_history(True, stacks=False)
    return []


def _pending(alloc):
    # a block freed while another stream still uses it waits for an event: malloc's other path
    held = alloc.malloc(4096)
    alloc.record_stream(held, 101)
    alloc.free(held)
    assert alloc._special
    return []


def _plain(alloc):
    return []


@pytest.mark.parametrize("setup, conf", [
    (_plain, ""),
    (_history, ""),
    (_pending, ""),
    (_plain, "roundup_power2_divisions:4"),
], ids=["hot-path", "history", "pending-event", "roundup-power2"])
def test_the_small_request_gets_its_own_segment_on_every_path(setup, conf):
    alloc, be = make(conf)
    alloc.free(alloc.malloc(64 * MiB))
    alloc.empty_cache()                         # high-water mark 64 MiB, nothing reserved
    live = setup(alloc)
    big = alloc.malloc(32 * MiB)
    alloc.free(big)                             # a whole free 32 MiB segment
    pin = alloc.malloc(2 * MiB)                 # 32 > 4 x 2: a 2 MiB segment of its own
    check_invariants(alloc, be)
    assert alloc._segments[_segment_of(alloc, pin)] == 2 * MiB
    assert 32 * MiB in be.live.values()         # the big one kept, whole
    again = alloc.malloc(30 * MiB)              # and a request of its size takes it
    assert again == big
    check_invariants(alloc, be)
    drain(alloc, be, live + [pin, again])


@pytest.mark.parametrize("setup", [_plain, _history], ids=["hot-path", "history"])
def test_torch_rules_still_carve_on_every_path(setup):
    alloc, be = make("policy:torch")
    live = setup(alloc)
    big = alloc.malloc(32 * MiB)
    alloc.free(big)
    pin = alloc.malloc(2 * MiB)                 # torch's best fit: carved out of the 32 MiB segment
    check_invariants(alloc, be)
    assert _segment_of(alloc, pin) == big and list(be.live.values()) == [32 * MiB]
    drain(alloc, be, live + [pin])


def test_a_cap_is_met_with_history_recorded():
    # 34 MiB allowed: carving 2 MiB out of the free 32 MiB segment would leave no room for the
    # next 32 MiB request (as test_classic_grow_instead_r65c, on malloc's other path)
    alloc, be = make("per_process_memory_fraction:0.53125", capacity=64 * MiB)
    _history(alloc)
    alloc.free(alloc.malloc(32 * MiB))
    pin = alloc.malloc(2 * MiB)
    other = alloc.malloc(32 * MiB)
    check_invariants(alloc, be)
    assert alloc.stats()["reserved_bytes.all.current"] == 34 * MiB
    drain(alloc, be, [pin, other])
