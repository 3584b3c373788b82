"""Classic segments (expandable_segments:False) under accel's rules: a new segment for a request
whose 2 MiB rounding wastes much holds a few such requests once they recur (r47)."""

import pytest

from accel import _lazy, sim
from accel.memory import _config
from accel.memory._caching import DeviceCachingAllocator
from conftest import use_sim

MiB = 1 << 20


@pytest.fixture
def be(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DEVICES=2)
    b = _lazy.lazy_init()
    yield b
    sim.reset()


def make(be, index, conf="expandable_segments:False"):
    return DeviceCachingAllocator(be, index, _config.parse(conf))


def reserved(alloc):
    return alloc.stats()["reserved_bytes.all.current"]


def peak_reserved(alloc):
    return alloc.stats()["reserved_bytes.all.peak"]


@pytest.mark.parametrize("index", [0, 1])
def test_recurring_wasteful_requests_share_a_segment(be, index):
    # 2.2 MiB requests round to 4 MiB segments (45 % free); once they recur, a segment holds four
    alloc = make(be, index)
    s = be.default_stream(index)
    size = 2 * MiB + 200 * 1024
    ptrs = [alloc.malloc(size, s) for _ in range(6)]
    assert reserved(alloc) <= 18 * MiB, f"reserved {reserved(alloc) / MiB} MiB for 6 x 2.2 MiB"
    for p in ptrs:
        alloc.free(p)
    alloc.empty_cache()
    assert reserved(alloc) == 0


@pytest.mark.parametrize("conf, size", [
    ("expandable_segments:False", 3 * MiB + 512 * 1024),    # rounding wastes 12.5 %: one each
    ("expandable_segments:False", 12 * MiB + 512 * 1024),   # over 10 MiB: rounded only
    ("policy:torch", 2 * MiB + 200 * 1024),                  # torch's rules: 20 MiB buffers
])
def test_requests_that_waste_little_or_follow_torch_are_not_packed(be, conf, size):
    alloc = make(be, 1, conf)
    s = be.default_stream(1)
    ptrs = [alloc.malloc(size, s) for _ in range(4)]
    segs = sorted({seg["total_size"] for seg in alloc.snapshot()["segments"]})
    if conf == "policy:torch":
        assert segs == [20 * MiB]
    else:
        assert segs == [-(-size // (2 * MiB)) * 2 * MiB], segs
    for p in ptrs:
        alloc.free(p)
    alloc.empty_cache()
    assert reserved(alloc) == 0


@pytest.mark.parametrize("index", [0, 1])
def test_a_packed_segment_that_does_not_fit_under_a_cap_falls_back_to_one_request(be, index):
    """A segment for several requests is a bigger ask: where the memory cap leaves room for the
    request's own segment but not for the packed one, the request still succeeds."""
    alloc = make(be, index)
    s = be.default_stream(index)
    total = alloc._allowed_bytes()                       # the device's memory (no cap yet)
    alloc.set_memory_fraction(14 * MiB / total)
    size = 2 * MiB + 200 * 1024
    ptrs = [alloc.malloc(size, s) for _ in range(3)]     # the third would pack four (10 MiB)
    assert reserved(alloc) <= 14 * MiB
    for p in ptrs:
        alloc.free(p)
    alloc.empty_cache()
    assert reserved(alloc) == 0
