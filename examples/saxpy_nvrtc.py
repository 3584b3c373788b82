"""SAXPY (y = a*x + y) in CUDA C: compiled with NVRTC, loaded, launched, checked against numpy.

    python examples/saxpy_nvrtc.py                  # on an NVIDIA GPU
    ACCEL_SIM=cuda python examples/saxpy_nvrtc.py   # no GPU: the simulator runs the Python reference

NVRTC needs no driver and no GPU (``pip install 'accel[nvrtc]'``), so the kernel is compiled
for real either way.  On the simulator a launch runs the kernel's reference in Python,
registered with ``accel.sim.register_kernel``: the same reference is what the device result is
checked against, so it is the kernel's unit test.  On a GPU registering does nothing to the launch.

Exits 0 when the result equals numpy's bit for bit.
"""

import sys

import numpy as np

import accel
import accel.sim

SOURCE = r"""
extern "C" __global__ void saxpy(float a, const float *x, float *y, unsigned long long n)
{
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        y[i] = a * x[i] + y[i];
}
"""
#: The .entry parameters NVRTC gives it: .f32, .u64 (x), .u64 (y), .u64 (n).
SIGNATURE = "f32, ptr, ptr, u64"


def saxpy_reference(grid, block, view, a, x, y, n):
    """The kernel in numpy, for the simulator: ``x``/``y`` are addresses, ``view`` maps them.

    Only the threads the launch starts do work, as on the device."""
    n = min(n, grid[0] * block[0])
    xs, ys = view(x, 4 * n, np.float32), view(y, 4 * n, np.float32)
    ys[:] = np.float32(a) * xs + ys       # float32 multiply, then float32 add: two roundings


def main() -> int:
    kind = accel.current_accelerator().type if accel.is_available() else None
    if kind != "cuda":
        print(f"this example compiles CUDA C to PTX, so it needs CUDA (or ACCEL_SIM=cuda); the current "
              f"accelerator is {kind} (see examples/saxpy_metal.py for Metal)", file=sys.stderr)
        return 2
    accel.sim.register_kernel("saxpy", saxpy_reference, SIGNATURE)
    n = 100_003                                     # not a multiple of the block: the tail is checked
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n, dtype=np.float32)
    y = rng.standard_normal(n, dtype=np.float32)
    a = np.float32(2.5)
    dx = accel.Buffer(x.nbytes).copy_from(x)       # the first Buffer initializes the device...
    dy = accel.Buffer(y.nbytes).copy_from(y)

    # ...so accel.compile targets its compute capability.  --fmad=false: no fused multiply-add,
    # the device rounds a*x and then a*x + y, as numpy does.
    program = accel.compile(SOURCE, name="saxpy.cu", options=("--fmad=false",))
    kernel = accel.Module(program.ptx).function("saxpy")

    block = 256
    accel.launch(kernel, (n + block - 1) // block, block, a, dx, dy, n)
    got = dy.to_numpy(np.float32)                   # ordered after the launch (same stream)
    want = a * x + y
    where = accel.get_device_properties().name
    if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
        bad = np.flatnonzero(got != want)
        print(f"saxpy on {where}: {bad.size} of {n} elements differ from numpy, first at {bad[0]}: "
              f"{got[bad[0]]!r} != {want[bad[0]]!r}", file=sys.stderr)
        return 1
    print(f"saxpy on {where} ({program.arch}): {n} elements equal numpy's bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
