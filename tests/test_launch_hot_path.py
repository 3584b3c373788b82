"""accel.launch's fast paths keep every check of the general path (issue 18 benchmark).

The hot path packs accel Buffers and in-range ints inline, converts numpy scalar types it has
accepted once without asking numpy again, and remembers the simulator reference it found
matching.  Each test warms a path first, then shows the check still holds on the next call.
"""

import numpy as np
import pytest

import accel
from accel.sim import kernels as simk

# fill_u32(ptr out, u64 n, u32 value): accel's own test kernel, its reference registered by accel.sim.
PTX = simk.TEST_PTX
NAME = "accel_test_fill_u32"


@pytest.fixture
def kernel(sim_cuda):
    return accel.Module(PTX).function(NAME)


def _fill(kernel, out, n, value, **kw):
    accel.launch(kernel, 1, 32, out, n, value, **kw)
    return out.to_numpy(np.uint32)


def test_warm_fast_path_still_fills(kernel):
    out = accel.Buffer(64)
    for v in (1, 2, 3):
        assert (_fill(kernel, out, 16, v) == v).all()
    assert (_fill(kernel, out, np.uint64(16), np.uint32(9)) == 9).all()
    assert (_fill(kernel, out, np.uint64(16), np.uint16(10)) == 10).all()


def test_out_of_range_int_after_warm_launches(kernel):
    out = accel.Buffer(64)
    _fill(kernel, out, 16, 1)
    with pytest.raises(ValueError, match=r"argument 2 \(u32\).*out of range"):
        accel.launch(kernel, 1, 32, out, 16, 2 ** 32)
    with pytest.raises(ValueError, match=r"argument 1 \(u64\).*out of range"):
        accel.launch(kernel, 1, 32, out, -1, 0)
    with pytest.raises(TypeError, match="bool is not accepted"):
        accel.launch(kernel, 1, 32, out, 16, True)


def test_numpy_type_accepted_for_one_parameter_type_is_not_for_another(kernel):
    out = accel.Buffer(64)
    _fill(kernel, out, np.uint64(16), np.uint32(5))             # (uint64, u64) and (uint32, u32) cached
    with pytest.raises(TypeError, match=r"argument 2 \(u32\).*numpy uint64 does not convert"):
        accel.launch(kernel, 1, 32, out, 16, np.uint64(5))
    with pytest.raises(TypeError, match=r"argument 2 \(u32\).*numpy int32 does not convert"):
        accel.launch(kernel, 1, 32, out, 16, np.int32(5))
    with pytest.raises(TypeError, match=r"argument 2 \(u32\).*numpy int32 does not convert"):
        accel.launch(kernel, 1, 32, out, 16, np.int32(5))          # refused again: never cached


def test_buffer_of_another_device_or_closed_after_warm_launches(kernel):
    out = accel.Buffer(64)
    _fill(kernel, out, 16, 1)
    with accel.device_index(1):
        other = accel.Buffer(64)
    with pytest.raises(ValueError, match=r"argument 0 \(u64\).*memory of device 1 but the kernel's module is "
                                         r"loaded on device 0"):
        accel.launch(kernel, 1, 32, other, 16, 1)
    out.close()
    with pytest.raises(Exception, match="closed"):
        accel.launch(kernel, 1, 32, out, 16, 1)


def test_grid_and_block_tuples_after_warm_launches(kernel):
    out = accel.Buffer(64)
    accel.launch(kernel, (1, 1, 1), (32, 1, 1), out, 16, 4)
    assert (out.to_numpy(np.uint32) == 4).all()
    with pytest.raises(ValueError, match=r"block\[1\] is 0"):
        accel.launch(kernel, (1, 1, 1), (32, 0, 1), out, 16, 4)
    with pytest.raises(ValueError, match=r"grid\[2\] is -1"):
        accel.launch(kernel, (1, 1, -1), (32, 1, 1), out, 16, 4)
    with pytest.raises(TypeError, match=r"block\[0\] must be an int"):
        accel.launch(kernel, (1, 1, 1), (32.0, 1, 1), out, 16, 4)
    with pytest.raises(ValueError, match=r"grid\[1\] is 70000, above the device's limit"):
        accel.launch(kernel, (1, 70000, 1), (32, 1, 1), out, 16, 4)
    with pytest.raises(ValueError, match="threads, above the device's"):
        accel.launch(kernel, 1, (32, 32, 2), out, 16, 4)


def test_reference_replaced_or_removed_after_warm_launches(sim_cuda):
    """The remembered reference is used only while the registry still holds that very entry."""
    ptx = PTX.replace(NAME.encode(), b"hot_path_fill")
    kernel = accel.Module(ptx).function("hot_path_fill")
    out = accel.Buffer(64)
    accel.sim.register_kernel("hot_path_fill", simk._test_fill_u32, "ptr, u64, u32")
    try:
        assert (_fill(kernel, out, 16, 3) == 3).all()

        def other(grid, block, view, out_, n, value):
            view(out_, 4 * n, np.uint32)[:] = value + 1

        accel.sim.register_kernel("hot_path_fill", other, "ptr, u64, u32", replace=True)
        assert (_fill(kernel, out, 16, 3) == 4).all()              # the new reference runs
        accel.sim.register_kernel("hot_path_fill", other, "ptr, u64, f32", replace=True)
        with pytest.raises(ValueError, match=r"reference takes \(ptr, u64, f32\)"):
            accel.launch(kernel, 1, 32, out, 16, 3)
        accel.sim.unregister_kernel("hot_path_fill")
        with pytest.raises(accel.AcceleratorError, match="register one before launching"):
            accel.launch(kernel, 1, 32, out, 16, 3)
    finally:
        accel.sim.unregister_kernel("hot_path_fill")


def test_stream_of_the_other_device_while_warm(kernel):
    out = accel.Buffer(64)
    _fill(kernel, out, 16, 1)
    with accel.device_index(1):
        s1 = accel.Stream()
    with pytest.raises(ValueError, match="stream is on device 1 but the kernel's module is loaded on device 0"):
        accel.launch(kernel, 1, 32, out, 16, 1, stream=s1)


def test_launch_from_another_current_device_switches_and_restores(kernel):
    out = accel.Buffer(64)
    _fill(kernel, out, 16, 1)
    accel.set_device_index(1)
    accel.launch(kernel, 1, 32, out, 16, 6)         # module of device 0, its current stream
    assert accel.current_device_index() == 1
    accel.set_device_index(0)
    assert (out.to_numpy(np.uint32) == 6).all()
