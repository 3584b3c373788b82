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
