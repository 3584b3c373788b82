"""CudaBackend.launch reuses its argument cells (r65d): what a launch passes is what the kernel gets.

The backend keeps, per argument count, a pool of kernelParams cells (one 8-byte cell per
argument, written through a view of the argument's type) and the ``void *[]`` pointing at them,
and takes a set out of the pool for the one call.  cuLaunchKernel copies the parameters at the
call (a capture copies them into the node), so a set is free again once the call returns.
These tests show that reuse never leaks one launch's values into another's: kernels of the
same argument count but other types, threads launching at once, a graph captured before the
cells were rewritten, a launch that failed halfway through filling its cells, no arguments.
"""

import threading

import numpy as np
import pytest

import accel
from accel import sim
from accel.sim import kernels as simk

HEAD = b""".version 8.0
.target sm_90
.address_size 64
"""


def _module(entry: bytes):
    return accel.Module(HEAD + entry + b"\n{ ret; }\n")


@pytest.fixture
def seen(sim_cuda):
    """Kernels whose references record the arguments they were launched with."""
    got = []
    names = {"wide_r65d": "u64, i64, f64", "narrow_r65d": "u32, i32, f32",
             "mixed_r65d": "ptr, u32, f64, i32, u64, f32, i64", "none_r65d": ""}
    for name, types in names.items():
        sim.register_kernel(name, lambda g, b, view, *args, _n=name: got.append((_n,) + args), types)
    yield got
    for name in names:
        sim.unregister_kernel(name)


def test_narrow_types_after_wide_ones_in_the_same_cells(seen):
    """A 3-argument launch of 8-byte values, then one of 4-byte values: the second kernel reads
    its own values, not the high bytes the first left in the cells."""
    wide = _module(b".visible .entry wide_r65d(.param .u64 a, .param .s64 b, .param .f64 c)").function("wide_r65d")
    narrow = _module(b".visible .entry narrow_r65d(.param .u32 a, .param .s32 b, .param .f32 c)"
                     ).function("narrow_r65d")
    for round_ in range(3):
        accel.launch(wide, 1, 1, 2 ** 64 - 1, -2 ** 63, -1.0e300)
        accel.launch(narrow, 1, 1, 5 + round_, -7, 1.5)
        accel.launch(narrow, 1, 1, 2 ** 32 - 1, -2 ** 31, -0.0)
    accel.synchronize()
    assert seen == [("wide_r65d", 2 ** 64 - 1, -2 ** 63, -1.0e300),
                    ("narrow_r65d", 5, -7, 1.5), ("narrow_r65d", 2 ** 32 - 1, -2 ** 31, -0.0),
                    ("wide_r65d", 2 ** 64 - 1, -2 ** 63, -1.0e300),
                    ("narrow_r65d", 6, -7, 1.5), ("narrow_r65d", 2 ** 32 - 1, -2 ** 31, -0.0),
                    ("wide_r65d", 2 ** 64 - 1, -2 ** 63, -1.0e300),
                    ("narrow_r65d", 7, -7, 1.5), ("narrow_r65d", 2 ** 32 - 1, -2 ** 31, -0.0)]


def test_every_type_at_every_position(seen):
    k = _module(b".visible .entry mixed_r65d(.param .u64 .ptr .global .align 4 a, .param .u32 b, "
                b".param .f64 c, .param .s32 d, .param .u64 e, .param .f32 f, .param .s64 g)").function("mixed_r65d")
    buf = accel.Buffer(64)
    rng = np.random.default_rng(65)
    want = []
    for _ in range(20):
        args = (int(rng.integers(0, 2 ** 32)), float(rng.standard_normal()), int(rng.integers(-2 ** 31, 2 ** 31)),
                int(rng.integers(0, 2 ** 63)) * 2 + 1, float(np.float32(rng.standard_normal())),
                int(rng.integers(-2 ** 62, 2 ** 62)) * 2)
        accel.launch(k, 1, 1, buf, *args)
        want.append(("mixed_r65d", buf.ptr) + args)
    accel.synchronize()
    assert seen == want


def test_no_arguments(seen):
    k = _module(b".visible .entry none_r65d()").function("none_r65d")
    accel.launch(k, 1, 1)
    accel.launch(k, (2, 1, 1), 1)
    accel.synchronize()
    assert seen == [("none_r65d",), ("none_r65d",)]


def test_threads_launching_one_kernel_at_once_each_get_their_values(sim_cuda):
    """8 threads launch the same kernel (so the same pool) with their own buffer and value; a
    set of cells shared between two calls would hand one thread's value to another's kernel."""
    k = accel.Module(simk.TEST_PTX).function("accel_test_fill_u32")
    n, nthreads, launches = 16, 8, 40
    bufs = [accel.Buffer(4 * n) for _ in range(nthreads)]
    streams = [accel.Stream() for _ in range(nthreads)]
    wrong, errors = [], []
    start = threading.Barrier(nthreads)

    def work(t):
        try:
            start.wait()
            for j in range(launches):
                value = t * 1000 + j
                accel.launch(k, 1, 32, bufs[t], n, value, stream=streams[t])
                streams[t].synchronize()
                got = bufs[t].to_numpy(np.uint32, stream=streams[t])
                if not (got == value).all():
                    wrong.append((t, j, got[:2].tolist()))
        except BaseException as exc:    # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(nthreads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and not wrong


def test_captured_launch_keeps_its_values_after_the_cells_are_rewritten(sim_cuda):
    k = accel.Module(simk.TEST_PTX).function("accel_test_fill_u32")
    s = accel.Stream()
    n = 16
    out = accel.Buffer(4 * n, stream=s)
    g = accel.Graph()
    with s, g:
        accel.launch(k, 1, 32, out, n, 5, stream=s)
    accel.launch(k, 1, 32, out, n, 9, stream=s)     # the same cells, rewritten
    s.synchronize()
    assert (out.to_numpy(np.uint32, stream=s) == 9).all()
    with s:
        g.replay()
    s.synchronize()
    assert (out.to_numpy(np.uint32, stream=s) == 5).all()


def test_a_launch_refused_while_filling_its_cells_leaves_the_next_one_right(sim_cuda):
    """The backend's own refusals (a value its cell cannot hold, an unknown type) come before
    the call; the cells a refused launch half filled are not handed to the next launch stale."""
    k = accel.Module(simk.TEST_PTX).function("accel_test_fill_u32")
    backend = accel.backends.get("cuda")
    n = 16
    out = accel.Buffer(4 * n)
    stream = accel.current_stream()
    grid, block = (1, 1, 1), (32, 1, 1)
    with pytest.raises(OverflowError):
        backend.launch(k.handle, grid, block, [("ptr", out.ptr), ("u64", n), ("u32", 2 ** 32)], 0, stream.handle)
    with pytest.raises(ValueError, match="unknown kernel argument type 'u16'"):
        backend.launch(k.handle, grid, block, [("ptr", out.ptr), ("u16", n), ("u32", 1)], 0, stream.handle)
    accel.launch(k, 1, 32, out, n, 3)
    accel.synchronize()
    assert (out.to_numpy(np.uint32) == 3).all()


def test_threads_that_died_leave_no_argument_cells(seen, monkeypatch):
    """Eight threads inside a launch at once each need a set of cells; once they have died the
    backend holds none of theirs (state bounded by live threads, not by the most that ever
    launched at once: CI's dying-threads program saw the shared pool grow from 11 to 16 sets)."""
    import gc
    import weakref
    from accel.backends.cuda import kernels as cuda_kernels
    be = accel._lazy.lazy_init()
    made = []
    real_cells = cuda_kernels._arg_cells

    def tracked(ffi, n):
        cells = real_cells(ffi, n)
        made.append(weakref.ref(cells[3][0]))
        return cells
    monkeypatch.setattr(cuda_kernels, "_arg_cells", tracked)
    together = threading.Barrier(8)
    real_launch = be.lib.cudaLaunchKernel

    def launch_together(*a):
        together.wait(timeout=30)
        return real_launch(*a)
    # one module each: a module's launches hold its lock
    fs = [_module(b".visible .entry wide_r65d(.param .u64 a, .param .s64 b, .param .f64 c)").function("wide_r65d")
          for _ in range(8)]
    monkeypatch.setattr(be.lib, "cudaLaunchKernel", launch_together)
    errors = []

    def worker(i):
        try:
            accel.launch(fs[i], 1, 1, i, -i, 0.5)
        except BaseException as exc:     # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    monkeypatch.setattr(be.lib, "cudaLaunchKernel", real_launch)
    accel.synchronize()
    assert not errors, errors[0]
    assert len(made) >= 8
    gc.collect()
    assert sum(r() is not None for r in made) == 0, "argument cells of dead threads are still held"
    assert sorted(a[1] for a in seen) == list(range(8))
