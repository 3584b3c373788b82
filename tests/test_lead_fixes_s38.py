"""Fixes the lead made in session 38 (2026-12-07), each test written first and seen failing."""
import pytest

import accel
import accel.memory as M
from accel.memory import _config


@pytest.mark.parametrize("text, want", [
    ("garbage_collection_threshold:0x0.8p0", 0.5),      # strtod reads hexadecimal floats
    ("garbage_collection_threshold:0x.8", 0.5),
    ("garbage_collection_threshold:.5e0x", 0.5),        # an exponent, then text std::stod ignores
])
def test_threshold_read_as_std_stod_reads_it(text, want):
    """torch 2.13 reads ``garbage_collection_threshold`` with std::stod: these are 0.5 there
    (checked with torch._C._accelerator_setAllocatorSettings); accel refused the first two."""
    assert _config.parse(text).garbage_collection_threshold == want


@pytest.mark.parametrize("value", ["4.9e-324", "1e-310"])
def test_subnormal_threshold_refused_as_std_stod_does(value):
    """std::stod throws out_of_range for a subnormal result (strtod's ERANGE), so torch refuses
    these; accel took them as tiny thresholds.  A refusal changes nothing."""
    before = M.get_allocator_settings()
    with pytest.raises(ValueError, match="garbage_collection_threshold"):
        M.set_allocator_settings(f"garbage_collection_threshold:{value}")
    assert M.get_allocator_settings() == before
