"""A kernel's typed access at a misaligned address faults on every simulator (r62e).

CUDA: a load or store of an element at an address that is not a multiple of its size fails
with cudaErrorMisalignedAddress (716, "the device encountered a load or store instruction on a
memory address which is not aligned"; sticky, as every device fault).  Metal, setBuffer:offset:
atIndex: "align the offset to the data type's size".  The simulators' reference kernels read
memory through ``accel.sim.kernels.view``, which took any address: a kernel given ``ptr + 2``
for float32 data ran and returned numbers.  Run in a forked child: the fault is sticky for the
whole process, as on hardware."""

import numpy as np
import pytest

import accel
from accel import sim
from conftest import SIMS, run_forked, use_sim
from test_user_kernels import SAXPY_MSL, SAXPY_PTX, saxpy_reference, spirv_module


@pytest.mark.parametrize("kind", SIMS)
def test_a_kernel_on_a_misaligned_pointer_faults(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    image = {"cuda": SAXPY_PTX, "mps": SAXPY_MSL, "xpu": spirv_module("saxpy")}[kind]

    def child():
        sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64")
        dev = accel.device_count() - 1
        k = accel.Module(image, device=dev).function("saxpy", "f32, ptr, ptr, u64")
        x = accel.Buffer(4096, device=dev).copy_from(np.ones(1024, np.float32))
        y = accel.Buffer(4096, device=dev).copy_from(np.ones(1024, np.float32))
        accel.launch(k, 4, 256, 2.0, x, y, 1000)                # aligned: runs
        assert (y.to_numpy(np.float32)[:1000] == 3).all()
        try:
            accel.launch(k, 4, 256, 2.0, x.ptr + 2, y, 1000)    # float32 data 2 bytes off
            accel.synchronize(dev)
        except accel.AcceleratorError as exc:
            if kind == "cuda" and "716" not in str(exc) and "isaligned" not in str(exc):
                print("wrong error:", exc)
                return 2
            return 0
        print("a misaligned float32 access ran")
        return 1
    assert run_forked(child) == 0
