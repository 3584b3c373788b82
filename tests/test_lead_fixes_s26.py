"""Fixes of the lead's 2026-12-06 session, each test written first and seen failing."""

import pytest

import accel

from test_user_kernels import SAXPY_PTX


def test_max_potential_block_size_counts_the_opt_in_a_launch_would_make(sim_cuda):
    """Above 48 KiB of dynamic shared memory a launch opts the function in by itself, so the
    occupancy query answers for that launch instead of (0, 0) (no block fits without the
    opt-in); past the device's opt-in limit it is refused, naming what fits."""
    k = accel.Module(SAXPY_PTX, device=1).function("saxpy")
    sms = accel.get_device_properties(1).multi_processor_count
    grid, block = k.max_potential_block_size(dynamic_smem=100 * 1024)
    assert (grid, block) == (2 * sms, 1024)
    limit = accel._lazy.lazy_init().launch_limits(1)["max_shared_per_block_optin"]
    with pytest.raises(ValueError, match=rf"dynamic_smem={limit + 1}.*at most {limit} bytes"):
        k.max_potential_block_size(dynamic_smem=limit + 1)


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_a_grow_instead_miss_that_meets_a_capture_takes_the_cached_segment(monkeypatch):
    """r66e's case with the capture begun after _grow_instead chose the miss path (the rule made
    to answer True whatever the capture): the miss, which frees nothing during a capture, serves
    the request from the cached segment instead of raising OutOfMemoryError."""
    from accel.memory import _caching
    from conftest import use_sim
    from test_review_r66e import MiB, _big_free_segment_under_cap
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="expandable_segments:False")
    monkeypatch.setattr(_caching.DeviceCachingAllocator, "_grow_instead",
                        lambda self, size, block, fl: block.seg is None and fl.owner is None)
    a, s2 = accel.Stream(0), accel.Stream(0)
    with a:
        _big_free_segment_under_cap(67, s2)
        g = accel.Graph(capture_error_mode="relaxed")
        g.capture_begin()
        try:
            y = accel.Buffer(4 * MiB, stream=s2)
            y.close()
        finally:
            g.capture_end()
    g.reset()


@pytest.mark.parametrize("value, want", [("{0},1", [0]), ("{0}, {1}", [0]), ("{1},{0}", [1, 0]),
                                         ("1, 0", [1, 0]), ("0,{1}", [0])])
def test_sim_visible_devices_read_mixed_lists_as_torch_does(value, want):
    """r66g: the simulated runtime counted `GPU-<uuid0>,1` and `GPU-a, GPU-b` as two devices where
    accel's NVML count (torch's parser) counts one: a list's kind is its first entry's."""
    from accel.backends import _visible
    from accel.sim import core
    from accel.sim.cudart.state import visible_ordinals
    uuids = [core.uuid_text(i) for i in range(2)]
    value = value.format(*uuids)
    assert visible_ordinals(value, 2) == want
    assert _visible.visible_ordinals(value, 2, lambda: uuids) == want
