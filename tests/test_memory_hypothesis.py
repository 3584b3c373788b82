"""Allocator invariants over hypothesis-chosen seeds and configurations
(skipped where hypothesis is not installed; test_memory_allocator has a seeded run)."""

import random

import pytest

pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

from test_memory_allocator import _random_ops, drain, make  # noqa: E402


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1),
       conf=st.sampled_from(["", "policy:torch", "max_split_size_mb:32", "roundup_power2_divisions:4",
                             "garbage_collection_threshold:0.5", "release_threshold:8M"]))
def test_randomized_invariants_hypothesis(seed, conf):
    alloc, be = make(conf, capacity=1 << 40)
    drain(alloc, be, _random_ops(alloc, be, random.Random(seed), 150))


_LANE_VALUES = st.lists(st.integers(0, 2**63 - 1), min_size=15, max_size=15)


@settings(max_examples=300, deadline=None)
@given(peaks=_LANE_VALUES, cur=_LANE_VALUES)
def test_raise_peaks_is_a_lane_wise_max(peaks, cur):
    from accel.memory._stats import guard, pack, raise_peaks, unpack
    g = guard(15)
    got = raise_peaks(pack(peaks) | g, pack(cur), g)
    assert got & g == g
    assert unpack(got ^ g, 15) == [max(p, c) for p, c in zip(peaks, cur)]
