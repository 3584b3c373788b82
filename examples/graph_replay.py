"""A graph of 100 kernel launches: captured once, replayed, checked against the same launches run eagerly.

    python examples/graph_replay.py                  # on an NVIDIA GPU
    ACCEL_SIM=cuda python examples/graph_replay.py   # no GPU: the simulator runs the Python reference

Each launch is y = a_i * x + y with its own a_i.  A captured launch keeps the argument values it
was captured with (they are copied into the graph), so every replay repeats the same 100
launches.  The kernel is compiled with NVRTC (``pip install 'accel[nvrtc]'``; no GPU needed).

Exits 0 when one replay equals 100 eager launches and numpy, bit for bit.
"""

import sys
import time

import numpy as np

import accel
import accel.sim

SOURCE = r"""
extern "C" __global__ void axpy_step(float a, const float *x, float *y, unsigned long long n)
{
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        y[i] = a * x[i] + y[i];
}
"""
LAUNCHES = 100


def axpy_step_reference(grid, block, view, a, x, y, n):
    """What axpy_step does, in numpy (the simulator runs this; ``x``/``y`` are addresses)."""
    n = min(n, grid[0] * block[0])
    ys = view(y, 4 * n, np.float32)
    ys[:] = np.float32(a) * view(x, 4 * n, np.float32) + ys


def main() -> int:
    kind = accel.current_accelerator().type if accel.is_available() else None
    if kind != "cuda":
        print(f"this example compiles CUDA C to PTX, so it needs CUDA (or ACCEL_SIM=cuda); the current "
              f"accelerator is {kind}" + (" (and Metal has no stream capture)" if kind == "mps" else ""),
              file=sys.stderr)
        return 2
    accel.sim.register_kernel("axpy_step", axpy_step_reference, "f32, ptr, ptr, u64")
    accel.current_stream()                           # initialize: compile for this device's architecture
    program = accel.compile(SOURCE, name="axpy_step.cu", options=("--fmad=false",))
    kernel = accel.Module(program.ptx).function("axpy_step")

    n, block = 4099, 128
    grid = (n + block - 1) // block
    rng = np.random.default_rng(1)
    x = rng.standard_normal(n, dtype=np.float32)
    y0 = rng.standard_normal(n, dtype=np.float32)
    coeffs = [np.float32(1.0 / (i + 1)) for i in range(LAUNCHES)]
    dx = accel.Buffer(x.nbytes).copy_from(x)
    y_eager = accel.Buffer(y0.nbytes).copy_from(y0)
    y_graph = accel.Buffer(y0.nbytes).copy_from(y0)

    def program_on(y):
        for a in coeffs:
            accel.launch(kernel, grid, block, a, dx, y, n)

    t0 = time.perf_counter()
    program_on(y_eager)                              # 100 launches on the current stream
    eager = y_eager.to_numpy(np.float32)
    eager_ms = (time.perf_counter() - t0) * 1e3

    side = accel.Stream()                            # capture on a side stream, as torch requires
    side.wait_stream(accel.current_stream())         # the uploads above come first
    graph = accel.Graph()
    with side, graph:
        program_on(y_graph)                          # recorded, not run
    t0 = time.perf_counter()
    graph.replay()                                   # all 100 launches, on the current stream
    replayed = y_graph.to_numpy(np.float32)
    replay_ms = (time.perf_counter() - t0) * 1e3

    want = y0.copy()
    for a in coeffs:
        want = a * x + want
    for label, got in (("eager", eager), ("graph replay", replayed)):
        if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
            bad = np.flatnonzero(got != want)
            print(f"{label}: {bad.size} of {n} elements differ from numpy, first at {bad[0]}: "
                  f"{got[bad[0]]!r} != {want[bad[0]]!r}", file=sys.stderr)
            return 1
    print(f"{LAUNCHES} launches of axpy_step on {accel.get_device_properties().name}: eager {eager_ms:.1f} ms, "
          f"one graph replay {replay_ms:.1f} ms (both with the read-back); results equal bit for bit")
    graph.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
