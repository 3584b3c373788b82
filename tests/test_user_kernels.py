"""accel.Module / Kernel / launch and accel.sim.register_kernel (issue 18 items 1, 2, 4)."""

import gc
import os
import shutil
import subprocess

import numpy as np
import pytest

import accel
from accel import sim
from accel.sim import kernels as simk

from conftest import use_sim

# SAXPY as nvcc -ptx writes it for
#   extern "C" __global__ void saxpy(float a, const float *x, float *y, unsigned long long n)
# (parameters only: the simulator runs the registered reference, a device runs the body).
SAXPY_PTX = b"""//
// saxpy: y = a * x + y
.version 8.0
.target sm_90
.address_size 64

.visible .entry saxpy(
    .param .f32 saxpy_param_0,
    .param .u64 saxpy_param_1,
    .param .u64 saxpy_param_2,
    .param .u64 saxpy_param_3
)
{
    .reg .pred  %p<2>;
    .reg .f32   %f<5>;
    .reg .b32   %r<5>;
    .reg .b64   %rd<12>;

    ld.param.f32    %f1, [saxpy_param_0];
    ld.param.u64    %rd2, [saxpy_param_1];
    ld.param.u64    %rd3, [saxpy_param_2];
    ld.param.u64    %rd4, [saxpy_param_3];
    mov.u32         %r1, %ctaid.x;
    mov.u32         %r2, %ntid.x;
    mov.u32         %r3, %tid.x;
    mad.wide.u32    %rd5, %r1, %r2, %rd0;
    cvt.u64.u32     %rd6, %r3;
    add.s64         %rd1, %rd5, %rd6;
    setp.ge.u64     %p1, %rd1, %rd4;
    @%p1 bra        $L__BB0_2;
    cvta.to.global.u64  %rd7, %rd2;
    shl.b64         %rd8, %rd1, 2;
    add.s64         %rd9, %rd7, %rd8;
    ld.global.f32   %f2, [%rd9];
    cvta.to.global.u64  %rd10, %rd3;
    add.s64         %rd11, %rd10, %rd8;
    ld.global.f32   %f3, [%rd11];
    fma.rn.f32      %f4, %f1, %f2, %f3;
    st.global.f32   [%rd11], %f4;
$L__BB0_2:
    ret;
}
"""

SAXPY_CU = r"""
extern "C" __global__ void saxpy(float a, const float *x, float *y, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""

SAXPY_MSL = """
#include <metal_stdlib>
using namespace metal;
kernel void saxpy(constant float &a [[buffer(0)]], device const float *x [[buffer(1)]],
                  device float *y [[buffer(2)]], constant ulong &n [[buffer(3)]],
                  uint i [[thread_position_in_grid]]) {
    if (i < n) y[i] = fma(a, x[i], y[i]);
}
"""


def saxpy_reference(grid, block, view, a, x, y, n):
    """What the kernel computes, in float32 with one rounding per element (fma.rn)."""
    n = min(n, grid[0] * block[0])
    xs, ys = view(x, 4 * n, np.float32), view(y, 4 * n, np.float32)
    ys[:] = (np.float64(np.float32(a)) * xs.astype(np.float64) + ys.astype(np.float64)).astype(np.float32)


def expected(a, x, y):
    return (np.float64(np.float32(a)) * x.astype(np.float64) + y.astype(np.float64)).astype(np.float32)


@pytest.fixture
def saxpy_registered():
    sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64")
    yield
    sim.unregister_kernel("saxpy")


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)


def _device_arrays(x, y, device=None, stream=None):
    bx = accel.Buffer(x.nbytes, device=device, stream=stream)
    by = accel.Buffer(y.nbytes, device=device, stream=stream)
    bx.copy_from(x, stream=stream)
    by.copy_from(y, stream=stream)
    return bx, by


def _run_saxpy(ptx, n=1000, a=2.5):
    k = accel.Module(ptx).function("saxpy")
    x, y = _data(n)
    bx, by = _device_arrays(x, y)
    accel.launch(k, -(-n // 256), 256, a, bx, by, n)
    got = by.to_numpy("float32")
    assert got.tobytes() == expected(a, x, y).tobytes()


# -- loading and launching --------------------------------------------------------------------

def test_saxpy_ptx_matches_numpy_bit_for_bit(sim_cuda, saxpy_registered):
    _run_saxpy(SAXPY_PTX)


def test_saxpy_ptx_from_nvcc(sim_cuda, saxpy_registered, tmp_path):
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc")
                                    else None)
    if nvcc is None:
        pytest.skip("nvcc is not installed (neither on PATH nor /usr/local/cuda/bin)")
    src = tmp_path / "saxpy.cu"
    src.write_text(SAXPY_CU)
    subprocess.run([nvcc, "-ptx", "-arch=sm_90", str(src), "-o", str(tmp_path / "saxpy.ptx")], check=True,
                   capture_output=True, timeout=120)
    _run_saxpy(str(tmp_path / "saxpy.ptx"))          # a path works as well as bytes


def test_parameters_from_the_ptx_entry(sim_cuda):
    m = accel.Module(SAXPY_PTX)
    assert m.entries == ("saxpy",)
    k = m.function("saxpy")
    assert k.params == ("f32", "u64", "u64", "u64")
    assert k.device == accel.device("cuda", 0) and k.name == "saxpy"
    # a signature may say ptr where PTX says .u64, and must otherwise agree
    assert m.function("saxpy", "f32, ptr, ptr, u64").params == ("f32", "ptr", "ptr", "u64")
    with pytest.raises(ValueError, match="does not match the PTX .entry parameters f32, u64, u64, u64"):
        m.function("saxpy", "f32, ptr, ptr")


def test_ptx_type_mapping():
    from accel import _ptx
    text = """.visible .entry k(.param .u32 a, .param .s32 b, .param .b32 c, .param .u64 d, .param .s64 e,
        .param .b64 f, .param .f32 g, .param .f64 h, .param .u64 .ptr .global .align 4 i)"""
    assert _ptx.ptx_params(text, "k") == ("u32", "i32", "u32", "u64", "i64", "u64", "f32", "f64", "ptr")
    with pytest.raises(_ptx.UnsupportedParam, match=r"parameter 0 is declared '.param .align 8 .b8 s\[16\]'"):
        _ptx.ptx_params(".entry s(.param .align 8 .b8 s[16])", "s")


def test_struct_parameter_needs_a_signature(sim_cuda):
    ptx = SAXPY_PTX.replace(b".param .f32 saxpy_param_0", b".param .align 4 .b8 saxpy_param_0[4]")
    m = accel.Module(ptx)
    with pytest.raises(ValueError, match="pass signature="):
        m.function("saxpy")
    assert m.function("saxpy", "f32, ptr, ptr, u64").params == ("f32", "ptr", "ptr", "u64")


def test_graph_of_100_launches_replays_as_eager(sim_cuda, saxpy_registered):
    k = accel.Module(SAXPY_PTX).function("saxpy")
    n = 512
    x, y = _data(n, 1)
    s = accel.Stream()
    bx, by = _device_arrays(x, y, stream=s)
    ex, ey = _device_arrays(x, y, stream=s)
    g = accel.Graph()
    with s, g:
        for _ in range(100):
            accel.launch(k, 2, 256, 0.5, bx, by, n)
    s.synchronize()
    assert by.to_numpy("float32").tobytes() == y.tobytes()      # captured, not run
    with s:
        for _ in range(100):
            accel.launch(k, 2, 256, 0.5, ex, ey, n)
        g.replay()
    s.synchronize()
    assert by.to_numpy("float32").tobytes() == ey.to_numpy("float32").tobytes()
    want = y
    for _ in range(100):
        want = expected(0.5, x, want)
    assert ey.to_numpy("float32").tobytes() == want.tobytes()


def test_stream_of_device_1_while_device_0_is_current(sim_cuda, saxpy_registered):
    m = accel.Module(SAXPY_PTX, device=1)
    k = m.function("saxpy")
    assert k.device_index == 1 and accel.current_device_index() == 0
    s1 = accel.Stream(device=1)
    x, y = _data(300, 2)
    bx, by = _device_arrays(x, y, device=1, stream=s1)
    accel.launch(k, 2, 256, -1.5, bx, by, 300, stream=s1)
    assert accel.current_device_index() == 0
    assert by.to_numpy("float32", stream=s1).tobytes() == expected(-1.5, x, y).tobytes()
    # the default: the current stream of the kernel's device
    accel.launch(k, 2, 256, 1.0, bx, by, 300)
    accel.synchronize(1)


def test_arguments_checked_per_type(sim_cuda, saxpy_registered):
    k = accel.Module(SAXPY_PTX).function("saxpy")
    bx, by = _device_arrays(*_data(16))
    accel.launch(k, 1, 16, np.float32(2), bx, by, np.uint32(16))    # lossless numpy scalars
    accel.launch(k, 1, 16, np.int16(2), bx, by, np.uint64(16))
    accel.launch(k, 1, 16, 2, bx, by, 16)                            # an int for a float
    accel.launch(k, 1, 16, 2.0, bx.ptr, by, 16)                      # a raw address
    accel.synchronize()
    cases = [
        ((2.0, bx, by), TypeError, r"takes 4 argument\(s\) \(f32, u64, u64, u64\), 3 given"),
        ((2.0, bx, by, 16, 1), TypeError, r"takes 4 argument\(s\)"),
        (("2", bx, by, 16), TypeError, r"argument 0 \(f32\) is str '2'"),
        ((2.0, bx, by, 16.0), TypeError, r"argument 3 \(u64\) is float 16.0: a float for an integer"),
        ((2.0, bx, by, -1), ValueError, r"argument 3 \(u64\) is int -1: out of range for u64"),
        ((2.0, bx, by, 2 ** 64), ValueError, r"argument 3 \(u64\) .* out of range"),
        ((2.0, bx, by, True), TypeError, r"argument 3 \(u64\) is bool True: bool is not accepted"),
        ((1e39, bx, by, 16), ValueError, r"argument 0 \(f32\) .* beyond the float32 range"),
        ((np.float64(2), bx, by, 16), TypeError, r"argument 0 \(f32\) .* float64 does not convert to float32"),
        ((2.0, bx, by, np.int64(16)), TypeError, r"argument 3 \(u64\) .* int64 does not convert to uint64"),
        ((2.0, "x", by, 16), TypeError, r"argument 1 \(u64\) is str 'x'"),
        ((bx, bx, by, 16), TypeError, r"argument 0 \(f32\) is Buffer .*device memory for a f32 parameter"),
    ]
    for args, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            accel.launch(k, 1, 16, *args)


def test_u32_range(sim_cuda):
    ptx = b""".version 8.0
.target sm_90
.address_size 64
.visible .entry fill32(.param .u64 out, .param .u32 v, .param .s32 w)
{ ret; }
"""
    seen = []
    sim.register_kernel("fill32", lambda g, b, view, out, v, w: seen.append((v, w)), "ptr, u32, i32")
    try:
        k = accel.Module(ptx).function("fill32")
        buf = accel.Buffer(4)
        accel.launch(k, 1, 1, buf, 2 ** 32 - 1, -2 ** 31)
        accel.synchronize()
        assert seen == [(2 ** 32 - 1, -2 ** 31)]
        with pytest.raises(ValueError, match=r"argument 1 \(u32\) is int 4294967296: out of range for u32 "
                                             r"\(0 .. 4294967295\)"):
            accel.launch(k, 1, 1, buf, 2 ** 32, 0)
        with pytest.raises(ValueError, match=r"argument 2 \(i32\) .* out of range for i32"):
            accel.launch(k, 1, 1, buf, 0, 2 ** 31)
        # PTX declares a C int as .u32 too: a negative value says how to name the parameter signed
        with pytest.raises(ValueError, match=r"argument 1 \(u32\) is int -1: .* a C int .* "
                                             r"module\.function\('fill32', 'u64, i32, i32'\)"):
            accel.launch(k, 1, 1, buf, -1, 0)
        with pytest.raises(ValueError, match=r"out of range for i32 \(-2147483648 .. 2147483647\)$"):
            accel.launch(k, 1, 1, buf, 0, -2 ** 31 - 1)
        with pytest.raises(TypeError, match=r"argument 1 \(u32\) .* int32 does not convert to uint32"):
            accel.launch(k, 1, 1, buf, np.int32(1), 0)
    finally:
        sim.unregister_kernel("fill32")


def test_grid_block_and_shared_memory_limits(sim_cuda, saxpy_registered):
    k = accel.Module(SAXPY_PTX).function("saxpy")
    bx, by = _device_arrays(*_data(16))
    args = (2.0, bx, by, 16)
    for grid, block, exc, pattern in [
        (0, 1, ValueError, r"grid\[0\] is 0; every grid dimension must be >= 1"),
        ((1, 0), 1, ValueError, r"grid\[1\] is 0"),
        (1, (1, 1, 0), ValueError, r"block\[2\] is 0"),
        (2 ** 31, 1, ValueError, r"grid\[0\] is 2147483648, above the device's limit of 2147483647"),
        ((1, 65536), 1, ValueError, r"grid\[1\] is 65536, above the device's limit of 65535"),
        (1, 2048, ValueError, r"block\[0\] is 2048, above the device's limit of 1024"),
        (1, (1, 1, 65), ValueError, r"block\[2\] is 65, above the device's limit of 64"),
        (1, (64, 32), ValueError, r"block \(64, 32, 1\) has 2048 threads, above the device's 1024"),
        ((1, 1, 1, 1), 1, TypeError, r"grid must be an int or a tuple of 1 to 3 ints"),
        (1.0, 1, TypeError, r"grid must be an int or a tuple"),
        (True, 1, TypeError, r"grid must be an int or a tuple"),
        ((True, 1), 1, TypeError, r"grid\[0\] must be an int, got bool True"),
        (1, (32, False), TypeError, r"block\[1\] must be an int, got bool False"),
    ]:
        with pytest.raises(exc, match=pattern):
            accel.launch(k, grid, block, *args)
    with pytest.raises(ValueError, match=r"shared_mem=233472 bytes is above the device's limit of 232448"):
        accel.launch(k, 1, 16, *args, shared_mem=228 * 1024)
    with pytest.raises(ValueError, match="shared_mem must be an int >= 0"):
        accel.launch(k, 1, 16, *args, shared_mem=-1)


def test_shared_memory_above_48k_opts_in_first(sim_cuda, saxpy_registered):
    k = accel.Module(SAXPY_PTX).function("saxpy")
    bx, by = _device_arrays(*_data(16))
    backend = accel._lazy.lazy_init()
    # The runtime itself refuses more than 48 KiB without the opt-in (the simulator's rule) ...
    with pytest.raises(accel.AcceleratorError, match="cudaErrorInvalidValue"):
        backend.launch(k.handle, (1, 1, 1), (16, 1, 1), [("f32", 1.0), ("ptr", bx.ptr), ("ptr", by.ptr),
                                                         ("u64", 16)], 64 * 1024, 0)
    # ... accel.launch sets cudaFuncAttributeMaxDynamicSharedMemorySize first.
    calls = sim.calls("cudaFuncSetAttribute")
    accel.launch(k, 1, 16, 1.0, bx, by, 16, shared_mem=64 * 1024)
    accel.launch(k, 1, 16, 1.0, bx, by, 16, shared_mem=60 * 1024)     # already opted in
    accel.synchronize()
    assert sim.calls("cudaFuncSetAttribute") == calls + 1


def test_occupancy(sim_cuda):
    k = accel.Module(SAXPY_PTX).function("saxpy")
    assert k.max_threads_per_block == 1024
    assert k.num_regs == 32
    assert k.shared_size_bytes == 0
    # 32 registers x 1024 threads fill the SM's 64K registers twice: 2 blocks of 1024 per SM
    sms = accel.get_device_properties(0).multi_processor_count
    assert k.max_potential_block_size() == (2 * sms, 1024)
    # 100 KiB of shared memory per block (opted in): 2 blocks of 228 KiB fit per SM
    k_big = k
    accel._lazy.lazy_init().function_set_max_dynamic_shared(k_big.handle, 100 * 1024)
    grid, block = k_big.max_potential_block_size(dynamic_smem=100 * 1024)
    assert grid == 2 * sms and block == 1024
    # at most 100 threads: 100 runs 16 blocks (1600 threads, 4 warps each), 64 runs 32 (the
    # per-SM block limit, 2048 threads): the search keeps the fuller SM
    assert k.max_potential_block_size(block_size_limit=100) == (32 * sms, 64)
    with pytest.raises(ValueError, match="dynamic_smem must be an int >= 0"):
        k.max_potential_block_size(-1)


def test_module_of_device_1_on_a_stream_of_device_0(sim_cuda, saxpy_registered):
    k = accel.Module(SAXPY_PTX, device=1).function("saxpy")
    bx, by = _device_arrays(*_data(16), device=1)
    with pytest.raises(ValueError, match="stream is on device 0 but the kernel's module is loaded on device 1"):
        accel.launch(k, 1, 16, 1.0, bx, by, 16, stream=accel.current_stream(0))
    b0 = accel.Buffer(64, device=0)
    with pytest.raises(ValueError, match=r"argument 1 \(u64\) .* memory of device 0 but the kernel's module "
                                         r"is loaded on device 1"):
        accel.launch(k, 1, 16, 1.0, b0, by, 16)


def test_unknown_kernel_name(sim_cuda):
    m = accel.Module(SAXPY_PTX)
    with pytest.raises(KeyError, match=r"the module has no kernel named 'saxpi'; its kernels: saxpy") as info:
        m.function("saxpi")
    assert str(info.value).startswith("the module has no kernel named")
    with pytest.raises(TypeError, match="name must be a str"):
        m.function(3)


def test_unregistered_kernel_on_the_simulator(sim_cuda):
    k = accel.Module(SAXPY_PTX).function("saxpy")
    buf = accel.Buffer(64)
    with pytest.raises(accel.AcceleratorError,
                       match=r"no Python reference for kernel 'saxpy'; register one before launching: "
                             r"accel.sim.register_kernel\('saxpy', fn, 'f32, u64, u64, u64'\)"):
        accel.launch(k, 1, 1, 1.0, buf, buf, 0)
    # the runtime alone (accel's wrapper bypassed) refuses it too
    backend = accel._lazy.lazy_init()
    with pytest.raises(accel.AcceleratorError, match="cudaErrorInvalidDeviceFunction"):
        backend.launch(k.handle, (1, 1, 1), (1, 1, 1), [("f32", 1.0), ("ptr", buf.ptr), ("ptr", buf.ptr),
                                                        ("u64", 0)], 0, 0)


def test_simulator_checks_the_reference_against_the_entry(sim_cuda):
    sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr")    # one parameter short
    try:
        k = accel.Module(SAXPY_PTX).function("saxpy")
        buf = accel.Buffer(64)
        with pytest.raises(ValueError, match=r"the simulator's reference takes \(f32, ptr, ptr\) but the "
                                             r"kernel's parameters are \(f32, u64, u64, u64\)"):
            accel.launch(k, 1, 1, 1.0, buf, buf, 0)
        backend = accel._lazy.lazy_init()
        with pytest.raises(accel.AcceleratorError, match="cudaErrorInvalidValue"):
            backend.launch(k.handle, (1, 1, 1), (1, 1, 1), [("f32", 1.0), ("ptr", buf.ptr), ("ptr", buf.ptr),
                                                            ("u64", 0)], 0, 0)
    finally:
        sim.unregister_kernel("saxpy")


def test_register_kernel_checks_its_signature():
    with pytest.raises(ValueError, match=r"argument 1 has type 'float'; expected one of ptr, u32"):
        sim.register_kernel("k_bad", saxpy_reference, "ptr, float")
    assert simk.lookup("k_bad") is None
    # the old name keeps working and is the same registry
    simk.register("k_old", ("ptr",), saxpy_reference)
    try:
        assert simk.lookup("k_old").argtypes == ("ptr",)
    finally:
        sim.unregister_kernel("k_old")


def test_close_and_collection_unload(sim_cuda, saxpy_registered):
    before = sim.state().modules
    m = accel.Module(SAXPY_PTX)
    k = m.function("saxpy")
    assert sim.state().modules == before + 1
    m.close()
    m.close()       # idempotent
    assert sim.state().modules == before
    buf = accel.Buffer(64)
    with pytest.raises(ValueError, match="is closed"):
        accel.launch(k, 1, 1, 1.0, buf, buf, 0)
    with pytest.raises(ValueError, match="is closed"):
        m.function("saxpy")
    k2 = accel.Module(SAXPY_PTX).function("saxpy")
    assert sim.state().modules == before + 1
    del k2
    gc.collect()
    accel.Buffer(64)        # an API entry drains deferred releases
    assert sim.state().modules == before


def test_bad_images(sim_cuda):
    with pytest.raises(TypeError, match="Module\\(image\\) takes bytes"):
        accel.Module(3)
    with pytest.raises(ValueError, match="cannot read '/nonexistent.ptx'"):
        accel.Module("/nonexistent.ptx")
    with pytest.raises(ValueError, match="CUDA takes PTX text"):
        accel.Module(b"\x00\x01garbage")
    with pytest.raises(accel.KernelImageError):
        accel.Module(SAXPY_PTX.replace(b".version 8.0", b".version 99.0"))


def test_driver_entry_point_path(monkeypatch, saxpy_registered):
    """A 12.4 runtime has no cudaLibrary*: modules are driver CUmodules (cuModuleLoadData) and the
    attributes, the shared-memory opt-in and occupancy go through cuFunc*/cuOccupancy*."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CUDA_RUNTIME="12.4", ACCEL_SIM_CUDA_DRIVER="12.4")
    backend = accel._lazy.lazy_init()
    assert backend.kernel_path()["kernel_path"] == "driver"
    _run_saxpy(SAXPY_PTX)
    k = accel.Module(SAXPY_PTX).function("saxpy")
    assert (k.max_threads_per_block, k.num_regs, k.shared_size_bytes) == (1024, 32, 0)
    sms = accel.get_device_properties(0).multi_processor_count
    assert k.max_potential_block_size() == (2 * sms, 1024)
    x, y = _data(32, 6)
    bx, by = _device_arrays(x, y)
    accel.launch(k, 1, 32, 2.0, bx, by, 32, shared_mem=100 * 1024)
    assert by.to_numpy("float32").tobytes() == expected(2.0, x, y).tobytes()
    assert sim.calls("cuFuncSetAttribute") == 1


# -- the other simulators ---------------------------------------------------------------------

def test_metal_simulator_runs_the_same_reference(monkeypatch, saxpy_registered):
    use_sim(monkeypatch, "mps")
    m = accel.Module(SAXPY_MSL)
    assert m.entries == ("saxpy",)
    with pytest.raises(ValueError, match="does not declare its parameter types; pass signature="):
        m.function("saxpy")
    k = m.function("saxpy", "f32, ptr, ptr, u64")
    x, y = _data(100, 3)
    bx, by = _device_arrays(x, y)
    accel.launch(k, 1, 128, 3.0, bx, by, 100)
    assert by.to_numpy("float32").tobytes() == expected(3.0, x, y).tobytes()
    with pytest.raises(ValueError, match=r"block\[0\] is 2048"):
        accel.launch(k, 1, 2048, 3.0, bx, by, 100)


def test_metal_build_log_and_unregistered_kernel(monkeypatch):
    use_sim(monkeypatch, "mps")
    with pytest.raises(accel.AcceleratorError, match="newLibraryWithSource.*program_source: error: no such type"):
        accel.Module("kernel void f(device float *x) {}\n#error no such type\n")
    m = accel.Module("kernel void lonely(device float *x [[buffer(0)]]) {}\n")
    with pytest.raises(accel.AcceleratorError, match=r"no Python reference for kernel 'lonely'; register one: "
                                                     r"accel.sim.register_kernel\('lonely'"):
        m.function("lonely", "ptr")


def spirv_module(*names):
    """A minimal SPIR-V module (SPIR-V specification 2.3, "Physical Layout"): the header, OpCapability
    Kernel, OpMemoryModel and one OpEntryPoint Kernel per name (no bodies: the simulator runs the
    registered references)."""
    import struct
    words = [0x07230203, 0x00010200, 0, 100, 0, (2 << 16) | 17, 6, (3 << 16) | 14, 2, 2]
    for i, name in enumerate(names):
        raw = name.encode() + b"\0"
        raw += b"\0" * (-len(raw) % 4)
        words += [((3 + len(raw) // 4) << 16) | 15, 6, 10 + i] + list(struct.unpack(f"<{len(raw) // 4}I", raw))
    return struct.pack(f"<{len(words)}I", *words)


def test_level_zero_simulator_runs_the_same_reference(monkeypatch, saxpy_registered):
    use_sim(monkeypatch, "xpu")
    m = accel.Module(spirv_module("saxpy", "other"))
    assert m.entries == ("saxpy", "other")
    with pytest.raises(ValueError, match="does not declare its parameter types"):
        m.function("saxpy")
    k = m.function("saxpy", "f32, ptr, ptr, u64")
    x, y = _data(300, 4)
    bx, by = _device_arrays(x, y)
    accel.launch(k, 2, 256, 1.25, bx, by, 300)
    assert by.to_numpy("float32").tobytes() == expected(1.25, x, y).tobytes()
    # captured into a graph (a regular command list) and replayed
    s = accel.Stream()
    g = accel.Graph()
    with s, g:
        accel.launch(k, 2, 256, 1.25, bx, by, 300)
    g.replay()
    s.synchronize()
    assert by.to_numpy("float32").tobytes() == expected(1.25, x, expected(1.25, x, y)).tobytes()
    with pytest.raises(ValueError, match=r"block\[0\] is 2048, above the device's limit of 1024"):
        accel.launch(k, 1, 2048, 1.0, bx, by, 300)
    with pytest.raises(KeyError, match="no kernel named 'saxpi'; its kernels: saxpy, other"):
        m.function("saxpi", "ptr")
    m.close()


def test_level_zero_module_on_device_1(monkeypatch, saxpy_registered):
    use_sim(monkeypatch, "xpu")
    k = accel.Module(spirv_module("saxpy"), device=1).function("saxpy", "f32, ptr, ptr, u64")
    x, y = _data(64, 5)
    s1 = accel.Stream(device=1)
    bx, by = _device_arrays(x, y, device=1, stream=s1)
    accel.launch(k, 1, 64, 2.0, bx, by, 64, stream=s1)
    assert by.to_numpy("float32", stream=s1).tobytes() == expected(2.0, x, y).tobytes()
    with pytest.raises(ValueError, match="stream is on device 0 but the kernel's module is loaded on device 1"):
        accel.launch(k, 1, 64, 2.0, bx, by, 64, stream=accel.current_stream(0))


def test_level_zero_build_log_in_the_error(monkeypatch):
    use_sim(monkeypatch, "xpu")
    header_only = spirv_module()
    with pytest.raises(accel.AcceleratorError, match="zeModuleCreate failed with ZE_RESULT_ERROR_MODULE_BUILD_"
                                                     "FAILURE.*build log: error: the SPIR-V module has no "
                                                     "OpEntryPoint Kernel"):
        accel.Module(header_only)
    with pytest.raises(ValueError, match="Level Zero takes SPIR-V; not a SPIR-V module: magic"):
        accel.Module(b"\x7fELF" + b"\0" * 28)


def test_level_zero_simulator_rules(monkeypatch):
    """The simulated driver alone (accel's checks bypassed)."""
    use_sim(monkeypatch, "xpu")
    k = accel.Module(spirv_module("nobody")).function("nobody", "ptr")
    backend = accel._lazy.lazy_init()
    buf = accel.Buffer(64)
    s = accel.current_stream()
    with pytest.raises(accel.AcceleratorError, match="ZE_RESULT_ERROR_UNSUPPORTED_FEATURE"):
        backend.launch(k.handle, (1, 1, 1), (1, 1, 1), [("ptr", buf.ptr)], 0, s.handle)
    with pytest.raises(accel.AcceleratorError, match="ZE_RESULT_ERROR_INVALID_GROUP_SIZE_DIMENSION"):
        backend.launch(k.handle, (1, 1, 1), (2048, 1, 1), [("ptr", buf.ptr)], 0, s.handle)
    sim.register_kernel("nobody", lambda g, b, view, p: None, "ptr, u32")
    try:
        with pytest.raises(accel.AcceleratorError, match="ZE_RESULT_ERROR_INVALID_KERNEL_ARGUMENT_SIZE"):
            backend.launch(k.handle, (1, 1, 1), (1, 1, 1), [("u64", 1), ("u64", 2)], 0, s.handle)
    finally:
        sim.unregister_kernel("nobody")


# -- a real device (pytest -m device) ---------------------------------------------------------

@pytest.mark.device
def test_saxpy_on_a_real_device(tmp_path):
    if not accel.is_available():
        pytest.skip("needs a real accelerator (ACCEL_SIM unset)")
    if accel.current_accelerator().type != "cuda":
        pytest.skip("the real-device SAXPY here is CUDA's")
    try:
        ptx = accel.compile(SAXPY_CU, name="saxpy.cu").ptx
    except Exception as exc:        # no NVRTC: the toolkit's nvcc, else skip
        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        if not os.path.exists(nvcc):
            pytest.skip(f"neither NVRTC ({exc}) nor nvcc is available")
        (tmp_path / "s.cu").write_text(SAXPY_CU)
        subprocess.run([nvcc, "-ptx", str(tmp_path / "s.cu"), "-o", str(tmp_path / "s.ptx")], check=True,
                       timeout=120)
        ptx = (tmp_path / "s.ptx").read_bytes()
    k = accel.Module(ptx).function("saxpy")
    assert k.params == ("f32", "u64", "u64", "u64")
    n = 1 << 20
    x, y = _data(n, 7)
    bx, by = _device_arrays(x, y)
    grid, block = k.max_potential_block_size()
    assert grid >= 1 and 32 <= block <= k.max_threads_per_block
    accel.launch(k, -(-n // block), block, 2.5, bx, by, n)
    got = by.to_numpy("float32")
    # fma.rn rounds once; the float64 reference rounds twice, which may differ by one ulp
    assert np.array_equal(got, expected(2.5, x, y)) or np.max(np.abs(
        got.view(np.int32).astype(np.int64) - expected(2.5, x, y).view(np.int32))) <= 1
    accel.launch(k, 1, 256, 1.0, bx, by, 256, shared_mem=64 * 1024)   # opted in above 48 KiB
    accel.synchronize()
    with pytest.raises(ValueError, match="above the device's limit"):
        accel.launch(k, 1, 256, 1.0, bx, by, 256, shared_mem=1 << 20)
    if accel.device_count() > 1:
        s1 = accel.Stream(device=1)
        k1 = accel.Module(ptx, device=1).function("saxpy")
        cx, cy = _device_arrays(x[:4096], y[:4096], device=1, stream=s1)
        accel.launch(k1, 16, 256, 2.5, cx, cy, 4096, stream=s1)
        assert accel.current_device_index() == 0
        s1.synchronize()
