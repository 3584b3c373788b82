"""Expandable segments: a grow past the high-water mark unmaps only enough free pieces, those of
the smallest free blocks first (``_exp_unmap_enough``), and every free piece when those do not
keep the grow under the mark (E10).  Why: unmapping every free piece at each step of a loop
gave back pages the next requests mapped again (map calls over the issue's 200 on perturbed
copies of a diffusion sampler).  Simulated CUDA runtime, which enforces the driver's map rules;
the invariant checker is test_memory_expandable's."""

import pytest

from accel import _lazy, sim
from accel.memory import _config
from accel.memory._caching import DeviceCachingAllocator
from accel.sim import _vmm
from conftest import use_sim
from test_memory_expandable import check

MiB = 1 << 20

pytestmark = pytest.mark.skipif(not _vmm.supported(), reason="this host cannot play virtual memory (mmap)")


@pytest.fixture
def alloc(monkeypatch):
    use_sim(monkeypatch, "cuda")
    be = _lazy.lazy_init()
    a = DeviceCachingAllocator(be, 0, _config.parse("expandable_segments:True"))
    yield a
    a.empty_cache()
    sim.reset()


def _calls(alloc):
    s = alloc.map_stats()
    return s["num_device_map"], s["num_device_unmap"]


def test_the_smallest_free_block_is_unmapped_and_the_large_one_kept(alloc):
    # [f4 free 4][l1 2][f2 free 2][l2 2][big free 8][end]: 18 MiB mapped, the mark.
    f4 = alloc.malloc(4 * MiB)
    l1 = alloc.malloc(2 * MiB)
    f2 = alloc.malloc(2 * MiB)
    l2 = alloc.malloc(2 * MiB)
    big = alloc.malloc(8 * MiB)
    assert big == l2 + 2 * MiB
    for p in (f4, f2, big):
        alloc.free(p)
    assert alloc.stats()["reserved_bytes.all.current"] == 18 * MiB
    maps, unmaps = _calls(alloc)
    # 10 MiB fits no free block; joined with the free 8 MiB at the end it needs 2 MiB more,
    # 2 MiB past the mark: the 2 MiB free block goes, the 4 and 8 MiB ones stay mapped
    x = alloc.malloc(10 * MiB)
    stats = check(alloc)
    assert x == big
    assert stats["reserved_bytes.all.peak"] == 18 * MiB
    assert _calls(alloc) == (maps + 1, unmaps + 1)
    # the 4 MiB free block is still mapped: taking it maps nothing
    y = alloc.malloc(4 * MiB)
    assert y == f4
    assert _calls(alloc) == (maps + 1, unmaps + 1)
    check(alloc)
    for p in (x, y, l1, l2):
        alloc.free(p)
    check(alloc)


def test_every_free_piece_goes_when_they_do_not_cover_the_grow(alloc):
    # E10: reserved passes its mark only after every free piece was unmapped
    f = alloc.malloc(2 * MiB)
    live = alloc.malloc(2 * MiB)
    alloc.free(f)
    maps, unmaps = _calls(alloc)
    x = alloc.malloc(8 * MiB)                 # 8 MiB past the mark; 2 MiB free in all
    stats = check(alloc)
    assert _calls(alloc)[1] == unmaps + 1
    assert stats["reserved_bytes.all.current"] == 10 * MiB
    assert stats["reserved_bytes.all.peak"] == 10 * MiB
    for p in (x, live):
        alloc.free(p)
    check(alloc)


def test_a_partial_pass_that_falls_short_unmaps_the_rest(alloc):
    # [lead 2][tail free 4, two 2 MiB pieces][end]: a 6 MiB request joins the free tail and needs
    # 2 MiB past the 6 MiB mark.  The tail's first piece covers those 2 MiB, but once it is gone
    # the grow joins only 2 MiB of free memory and still passes the mark: then every free piece
    # goes (E10) before reserved memory passes its mark.
    lead = alloc.malloc(2 * MiB)
    tail = alloc.malloc(4 * MiB)
    alloc.free(tail)
    assert alloc.stats()["reserved_bytes.all.current"] == 6 * MiB
    maps, unmaps = _calls(alloc)
    x = alloc.malloc(6 * MiB)
    stats = check(alloc)
    assert _calls(alloc)[1] == unmaps + 2
    assert alloc._exp_free_pieces() == []
    assert stats["reserved_bytes.all.peak"] == stats["reserved_bytes.all.current"] == 8 * MiB
    for p in (x, lead):
        alloc.free(p)
    check(alloc)
