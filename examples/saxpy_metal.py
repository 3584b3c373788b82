"""SAXPY (y = a*x + y) in Metal Shading Language, loaded as a Module, launched, checked against numpy.

    python examples/saxpy_metal.py                  # on a Mac
    ACCEL_SIM=mps python examples/saxpy_metal.py    # anywhere: the Metal simulator runs the reference

Metal compiles MSL source when the Module is created (``newLibraryWithSource:``; a build
error carries Metal's log).  MSL has no PTX-style parameter list to read, so the function
is given its signature: one entry per ``[[buffer(i)]]``, in order.  ``grid`` counts
threadgroups and ``block`` threads per threadgroup, as CUDA's grid and block.
"""

import sys

import numpy as np

import accel
import accel.sim

SOURCE = r"""
#include <metal_stdlib>
using namespace metal;

kernel void saxpy(constant float &a [[buffer(0)]],
                  device const float *x [[buffer(1)]],
                  device float *y [[buffer(2)]],
                  constant uint &n [[buffer(3)]],
                  uint i [[thread_position_in_grid]])
{
    if (i < n)
        y[i] = a * x[i] + y[i];
}
"""
SIGNATURE = "f32, ptr, ptr, u32"


def saxpy_reference(grid, block, view, a, x, y, n):
    """The kernel in numpy, for the simulator (``x``/``y`` are addresses, ``view`` maps them)."""
    n = min(n, grid[0] * block[0])
    xs, ys = view(x, 4 * n, np.float32), view(y, 4 * n, np.float32)
    ys[:] = np.float32(a) * xs + ys


def main() -> int:
    kind = accel.current_accelerator().type if accel.is_available() else None
    if kind != "mps":
        print(f"this example is for Metal; the current accelerator is {kind} "
              "(run it with ACCEL_SIM=mps, or see examples/saxpy_nvrtc.py)", file=sys.stderr)
        return 2
    accel.sim.register_kernel("saxpy", saxpy_reference, SIGNATURE)
    kernel = accel.Module(SOURCE).function("saxpy", signature=SIGNATURE)

    n = 100_003
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n, dtype=np.float32)
    y = rng.standard_normal(n, dtype=np.float32)
    a = np.float32(2.5)
    dx = accel.Buffer(x.nbytes).copy_from(x)
    dy = accel.Buffer(y.nbytes).copy_from(y)

    block = 256
    accel.launch(kernel, (n + block - 1) // block, block, a, dx, dy, n)
    got = dy.to_numpy(np.float32)
    want = a * x + y
    name = accel.get_device_properties().name
    if "simulator" in name:
        ok = np.array_equal(got.view(np.uint32), want.view(np.uint32))   # it ran saxpy_reference
    else:
        # Metal compiles with fast math by default and may fuse a*x + y into one fma (one
        # rounding instead of two), so the device can differ from numpy in the last bit.
        ok = np.allclose(got, want, rtol=1e-6, atol=1e-6)
    if not ok:
        bad = np.flatnonzero(got != want)
        print(f"saxpy on {name}: {bad.size} of {n} elements differ from numpy, first at {bad[0]}: "
              f"{got[bad[0]]!r} != {want[bad[0]]!r}", file=sys.stderr)
        return 1
    print(f"saxpy (MSL) on {name}: {n} elements match numpy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
