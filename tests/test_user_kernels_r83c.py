"""Review r83c: the user-kernel path (accel.compile, accel.Module, accel.launch) checked against
images made by the real toolchain on this machine (NVRTC 13 from the nvidia-cuda-nvrtc wheel,
/usr/local/cuda/bin/nvcc, ptxas and fatbinary) and loaded on the CUDA simulator, plus the
launch checks on the Level Zero and Metal simulators.

Vendor rules used here:

* CUDA Programming Guide, "Binary Compatibility": a cubin for sm_XY runs on devices of compute
  capability X.Z with Z >= Y only; "PTX Compatibility": PTX "can always be compiled to binary
  code of greater or equal compute capability" by the driver's JIT.
* PTX ISA 9.0, "Target ISA notes" (.target): "Target architectures with suffix 'a', such as
  sm_90a, include architecture-accelerated features that are supported on the specified
  architecture only, hence such targets do not follow the onion layer model.  Therefore, PTX
  code generated for such targets cannot be run on later generation devices."  (Quoted in
  LLVM review D155851 from the PTX manual.)  NVIDIA technical blog "NVIDIA Blackwell and NVIDIA
  CUDA 12.9 Introduce Family-Specific Architecture Features": an 'f' target (sm_100f) runs on the
  devices of its family (compute capability 10.x) only.
* CUDA Runtime API, struct cudaFuncAttributes: maxThreadsPerBlock "The maximum number of threads
  per block, beyond which a launch of the function would fail.  This number depends on both the
  function and the device on which the function is currently loaded"; sharedSizeBytes "The size
  in bytes of statically-allocated shared memory per block required by this function".  Both
  are properties of the function whatever image it came from (PTX or cubin).
* CUDA Runtime API, cudaLaunchKernel / cuLaunchKernel: gridDim.x up to 2**31-1, y and z up to
  65535 (cudaDevAttrMaxGridDimX/Y/Z of compute capability 3.0+).
* NVRTC User Guide, "Supported Compile Options": --gpu-architecture (-arch) takes compute_XY,
  sm_XY and the a/f variants; an option NVRTC does not know is NVRTC_ERROR_INVALID_OPTION with
  the reason in the program log.
"""

import shutil
import struct
import subprocess

import numpy as np
import pytest

import accel
from accel import _cuda_containers, sim
from accel.sim import kernels as simk

from conftest import use_sim
from test_user_kernels import spirv_module

SRC = r'''
struct S { int a; double b; };
extern "C" __global__ void r83c_saxpy(float a, const float *x, float *y, unsigned long long n)
{ unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i]; }
extern "C" __global__ void r83c_types(bool b, char c, short s, int i, long long l, double d, S st,
                                      unsigned u, float2 f2) {}
extern "C" __global__ void __launch_bounds__(128) r83c_lb(unsigned *p) { p[threadIdx.x] = threadIdx.x; }
extern "C" __global__ void r83c_static(unsigned *p)
{ __shared__ unsigned s[4096]; s[threadIdx.x] = threadIdx.x; __syncthreads();
  p[threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x]; }
template <typename T> __global__ void r83c_tmpl(T *p) { p[0] = T(1); }
template __global__ void r83c_tmpl<int>(int *);
__global__ void r83c_cpp(int *p) { p[0] = 7; }
'''
NAMES = {"r83c_saxpy", "r83c_types", "r83c_lb", "r83c_static", "_Z9r83c_tmplIiEvPT_", "_Z8r83c_cppPi"}


def _nvcc_path():
    return shutil.which("nvcc") or (shutil.which("/usr/local/cuda/bin/nvcc"))


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """{name: bytes} of the kernels above built by the real nvcc 13 (skipped without one)."""
    nvcc = _nvcc_path()
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    d = tmp_path_factory.mktemp("r83c")
    src = d / "k.cu"
    src.write_text(SRC)
    builds = {
        "sm_80.cubin": ["-cubin", "-arch=sm_80"],
        "sm_90.cubin": ["-cubin", "-arch=sm_90"],
        "sm_90a.cubin": ["-cubin", "-arch=sm_90a"],
        "compute_80.ptx": ["-ptx", "-arch=compute_80"],
        "compute_90a.ptx": ["-ptx", "-arch=compute_90a"],
        "compute_100f.ptx": ["-ptx", "-arch=compute_100f"],
        # nvcc's default fatbin: SASS sm_80 plus the compute_80 PTX (compressed by default in CUDA 13)
        "sm_80+ptx.fatbin": ["-fatbin", "-gencode", "arch=compute_80,code=[sm_80,compute_80]"],
        "ptx80.fatbin": ["-fatbin", "-gencode", "arch=compute_80,code=compute_80"],
        # the same with compression off: what accel reads
        "ptx80_plain.fatbin": ["-fatbin", "-Xfatbin", "-compress-mode=none",
                               "-gencode", "arch=compute_80,code=compute_80"],
    }
    out = {}
    for name, args in builds.items():
        path = d / name
        subprocess.run([nvcc, *args, "-o", str(path), str(src)], check=True, timeout=120,
                       capture_output=True)
        out[name] = path.read_bytes()
    return out


@pytest.fixture
def nvrtc():
    from accel.backends.cuda import nvrtc as _nvrtc
    try:
        _nvrtc.version()
    except Exception as exc:    # no NVRTC wheel
        pytest.skip(f"no NVRTC: {exc}")
    return _nvrtc


@pytest.fixture
def refs():
    """Python references for the kernels above (the simulator runs them)."""
    def lb(grid, block, view, p):
        n = block[0] * block[1] * block[2]
        view(p, 4 * n, np.uint32)[:] = np.arange(n, dtype=np.uint32)

    def saxpy(grid, block, view, a, x, y, n):
        ys = view(y, 4 * n, np.float32)
        ys[:] = np.float32(a) * view(x, 4 * n, np.float32) + ys

    regs = {"r83c_lb": (lb, "ptr"), "r83c_static": (lb, "ptr"), "r83c_saxpy": (saxpy, "f32, ptr, ptr, u64"),
            "_Z8r83c_cppPi": (lambda grid, block, view, p: view(p, 4, np.int32).__setitem__(0, 7), "ptr")}
    for name, (fn, sig) in regs.items():
        sim.register_kernel(name, fn, sig, replace=True)
    try:
        yield
    finally:
        for name in regs:
            sim.unregister_kernel(name)


# -- accel.compile with the real NVRTC -----------------------------------------------------------

@pytest.mark.reallib
def test_arch_options_nvrtc_takes_are_read_back_as_it_reads_them(nvrtc):
    """Split '-arch' 'sm_90' and two -arch options (NVRTC keeps the last, with a warning in the log):
    Program.arch, .cubin and the PTX .target agree with what NVRTC did."""
    p = accel.compile(SRC, options=["-arch", "sm_90"])
    assert p.arch == "sm_90" and p.cubin is not None and p.cubin[:4] == b"\x7fELF"
    assert b".target sm_90" in p.ptx
    p = accel.compile(SRC, options=["-arch=compute_80", "-arch=sm_90"])
    assert p.arch == "sm_90" and p.cubin is not None and b".target sm_90" in p.ptx
    assert "followed by" in p.log         # NVRTC's own warning reaches Program.log
    p = accel.compile(SRC, options=["--gpu-architecture", "compute_90"])
    assert p.arch == "compute_90" and p.cubin is None
    assert set(p.entries) == NAMES


@pytest.mark.reallib
@pytest.mark.parametrize("opts, code, text", [
    (["-arch=all"], "NVRTC_ERROR_INVALID_OPTION", "invalid value for --gpu-architecture"),
    (["-arch=native"], "NVRTC_ERROR_INVALID_OPTION", "invalid value for --gpu-architecture"),
    (["-arch=compute_80a"], "NVRTC_ERROR_COMPILATION", "invalid or no value specified with --nv_arch"),
    (["--std=c++99"], "NVRTC_ERROR_INVALID_OPTION", "invalid value for --std"),
])
def test_an_option_nvrtc_refuses_raises_compile_error_carrying_its_log(nvrtc, opts, code, text):
    with pytest.raises(accel.CompileError) as ei:
        accel.compile(SRC, options=opts)
    assert ei.value.code_name == code
    assert text in str(ei.value) and text in ei.value.log


@pytest.mark.reallib
def test_arch_with_a_suffix_nvrtc_does_not_have_is_compile_error_with_the_log(nvrtc):
    """sm_80a passes accel's number check (80 is supported) and NVRTC refuses it: CompileError, the log in it."""
    with pytest.raises(accel.CompileError, match="nv_arch") as ei:
        accel.compile(SRC, arch="sm_80a")
    assert "--gpu-architecture=sm_80a" in str(ei.value)


@pytest.mark.reallib
def test_mangled_and_c_names_from_nvrtc_load_and_launch(nvrtc, sim_cuda, refs):
    """extern "C" names are the .entry names; a C++ kernel is found by its mangled name only, and the
    error for the plain name says why."""
    prog = accel.compile(SRC, arch=(9, 0))
    m = accel.Module(prog.ptx)
    assert set(m.entries) == NAMES
    with pytest.raises(KeyError, match='extern "C"'):
        m.function("r83c_cpp")
    k = m.function("_Z8r83c_cppPi")
    assert k.params == ("u64",)
    out = accel.Buffer(16)
    accel.launch(k, 1, 1, out)
    assert out.to_numpy(np.int32)[0] == 7


@pytest.mark.reallib
def test_parameters_accel_cannot_pass_are_refused_with_their_ptx_sizes(nvrtc, sim_cuda):
    """bool/char (.u8), short (.u16), a struct and a float2 by value (.align N .b8 p[K]): no
    accel type; a signature must match every size, so none can be given for this kernel."""
    m = accel.Module(accel.compile(SRC, arch=(9, 0)).ptx)
    with pytest.raises(ValueError, match="cannot pass"):
        m.function("r83c_types")
    sig = "u32, u32, u32, i32, i64, f64, u64, u32, u64"
    with pytest.raises(ValueError, match="parameter 0 is 1 bytes in the PTX .entry"):
        m.function("r83c_types", sig)
    with pytest.raises(ValueError, match="has 8 parameter"):
        m.function("r83c_types", "u32, " * 7 + "u32")


# -- real images on the simulated devices --------------------------------------------------------

@pytest.mark.parametrize("image, cc, ok", [
    ("sm_80.cubin", "8.0", True), ("sm_80.cubin", "8.6", True), ("sm_80.cubin", "9.0", False),
    ("sm_90.cubin", "8.6", False), ("sm_90.cubin", "9.0", True), ("sm_90a.cubin", "9.0", True),
    ("sm_90a.cubin", "10.0", False), ("sm_90a.cubin", "12.0", False),
    ("compute_80.ptx", "9.0", True), ("compute_80.ptx", "12.0", True),
    ("compute_90a.ptx", "9.0", True), ("compute_90a.ptx", "8.6", False),
    ("compute_100f.ptx", "10.0", True), ("compute_100f.ptx", "10.3", True), ("compute_100f.ptx", "9.0", False),
])
def test_real_images_load_where_the_binary_compatibility_rules_say(monkeypatch, images, image, cc, ok):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CC=cc)
    if ok:
        m = accel.Module(images[image])
        assert set(m.entries) == NAMES
    else:
        with pytest.raises(accel.KernelImageError):
            accel.Module(images[image])
        assert not accel._lazy.lazy_init()._live_modules


# r83c, fixed in session 40: accel.sim._cuda_images._jit dropped the .target's 'a'/'f' suffix, so sm_90a and
# sm_100f PTX were JIT-compiled for any device of a higher compute capability
@pytest.mark.parametrize("image, cc", [("compute_90a.ptx", "10.0"), ("compute_90a.ptx", "12.0"),
                                       ("compute_100f.ptx", "12.0")])
def test_arch_specific_ptx_does_not_run_on_a_later_architecture(monkeypatch, images, image, cc):
    """PTX ISA, .target: sm_90a PTX "cannot be run on later generation devices"; sm_100f PTX runs
    only in its family (10.x).  The simulated cc 10.0 / 12.0 device loads it and launches."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CC=cc)
    with pytest.raises(accel.KernelImageError):
        accel.Module(images[image])


def test_ptx_of_nvrtc_13_on_a_cuda_12_8_driver_is_a_kernel_image_error(monkeypatch, images):
    """PTX ISA 9.0 (CUDA 13) on a driver that JITs up to 8.7: 222 from Module(...), nothing loaded."""
    assert b".version 9.0" in images["compute_80.ptx"]
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CUDA_DRIVER="12.8", ACCEL_SIM_CUDA_RUNTIME="12.8")
    with pytest.raises(accel.KernelImageError, match="UnsupportedPtxVersion"):
        accel.Module(images["compute_80.ptx"])
    assert not accel._lazy.lazy_init()._live_modules


def test_an_uncompressed_ptx_fatbin_is_read_like_its_ptx(monkeypatch, images):
    """fatbinary -compress-mode=none: accel reads the PTX inside (names and parameter types)."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CC="9.0")
    m = accel.Module(images["ptx80_plain.fatbin"])
    assert set(m.entries) == NAMES
    assert m.function("r83c_saxpy").params == ("f32", "u64", "u64", "u64")


# r83c, fixed in session 40: accel._cuda_containers.fatbin_entries checked only flag 0x2000 and returned nvcc
# 13's zstd-compressed (0x8000) PTX payload as PTX text
def test_fatbin_reader_never_returns_compressed_bytes_as_ptx(images):
    """Either the PTX payload is PTX (inflated) or the reader says it cannot read it (ContainerError),
    as it does for fatbinary --compress (0x2000).  Today Module(nvcc's PTX-only fatbin).entries is ()
    and its parameter types are lost on real devices too."""
    for name in ("ptx80.fatbin", "sm_80+ptx.fatbin"):
        data = images[name]
        try:
            entries = _cuda_containers.fatbin_entries(data)
        except _cuda_containers.ContainerError:
            continue
        for kind, _sm, body in entries:
            if kind == _cuda_containers.KIND_PTX:
                assert body[:4] != b"\x28\xb5\x2f\xfd", f"{name}: zstd frame returned as PTX"
                assert b".entry" in body


# r83c, fixed in session 40: accel.sim._cuda_images.load took the compressed compute_80 PTX for PTX text and
# refused nvcc's default fatbin on a cc 9.0 device with cudaErrorInvalidKernelImage (200), naming nothing.
# The PTX entry is a zstd frame (flag 0x8000): a real driver inflates and JITs it, but Python 3.11 has no zstd
# in its standard library, so where no zstd module (compression.zstd, zstandard) is importable the simulator
# cannot read the PTX it would JIT: it refuses with cudaErrorNotSupported, its reason naming the compression
# and the fix (-Xfatbin -compress-mode=none).  A cc 8.0 device runs the fatbin's SASS either way.
def test_nvcc_default_fatbin_jits_its_ptx_on_a_newer_device(monkeypatch, images):
    """CUDA Programming Guide, "PTX Compatibility": the compute_80 PTX runs on a cc 9.0 device."""
    from accel.sim import _cuda_images
    data = images["sm_80+ptx.fatbin"]
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CC="9.0")
    if _zstd_importable():
        m = accel.Module(data)
        assert set(m.entries) == NAMES
        assert m.function("r83c_saxpy").params == ("f32", "u64", "u64", "u64")
        return
    with pytest.raises(accel.AcceleratorError, match="cudaErrorNotSupported"):
        accel.Module(data)
    assert not accel._lazy.lazy_init()._live_modules
    with pytest.raises(_cuda_images.ImageError, match="compressed.*zstd.*-Xfatbin -compress-mode=none") as ei:
        _cuda_images.load(data, (9, 0), 13000)
    assert ei.value.code == _cuda_images.NOT_SUPPORTED
    # on cc 8.0 the SASS loads: its kernel names are read, their parameter types (in the PTX) are not
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CC="8.0")
    m = accel.Module(data)
    assert set(m.entries) == NAMES
    # (the lead, session 40: the error names the compression and the nvcc option)
    with pytest.raises(ValueError, match="zstd-compressed.*-Xfatbin -compress-mode=none"):
        m.function("r83c_saxpy")
    assert m.function("r83c_saxpy", "f32, ptr, ptr, u64").params == ("f32", "ptr", "ptr", "u64")


def _zstd_importable() -> bool:
    for name in ("compression.zstd", "zstandard"):
        try:
            __import__(name)
            return True
        except ImportError:
            pass
    return False


# -- launch bounds and static shared memory of a cubin --------------------------------------------

def test_ptx_launch_bounds_and_static_shared_are_the_kernels(monkeypatch, images, refs):
    """From PTX: __launch_bounds__(128) is .maxntid 128 (cudaFuncAttributes.maxThreadsPerBlock 128,
    a launch of 256 threads refused before it reaches the runtime); 16 KiB of __shared__ is
    sharedSizeBytes 16384."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CC="8.0")
    m = accel.Module(images["compute_80.ptx"])
    lb = m.function("r83c_lb")
    assert lb.max_threads_per_block == 128
    out = accel.Buffer(4096)
    with pytest.raises(ValueError, match="own limit of 128"):
        accel.launch(lb, 1, 256, out)
    accel.launch(lb, 1, 128, out)
    assert (out.to_numpy(np.uint32)[:128] == np.arange(128)).all()
    assert m.function("r83c_static").shared_size_bytes == 16384


# r83c, fixed in session 40: accel.sim._cuda_images.declared_bounds read nothing from a cubin: its
# __launch_bounds__ (.nv.info EIATTR_MAX_THREADS) was lost, maxThreadsPerBlock 1024
def test_cubin_launch_bounds_limit_the_kernel(monkeypatch, images, refs):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CC="8.0")
    lb = accel.Module(images["sm_80.cubin"]).function("r83c_lb", "ptr")
    out = accel.Buffer(4096)
    try:
        accel.launch(lb, 1, 256, out)
        launched = True
    except ValueError:
        launched = False
    assert lb.max_threads_per_block == 128 and not launched


# r83c, fixed in session 40: accel.sim._cuda_images.declared_bounds read nothing from a cubin: its static
# shared memory (.nv.shared.<kernel>) was reported as 0
def test_cubin_static_shared_memory_is_reported(monkeypatch, images, refs):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CC="8.0")
    k = accel.Module(images["sm_80.cubin"]).function("r83c_static", "ptr")
    assert k.shared_size_bytes == 16384


# -- launch arguments and configuration (CUDA simulator) ------------------------------------------

def test_grid_limits_are_the_devices(sim_cuda):
    k = accel.Module(simk.TEST_PTX).function("accel_test_fill_u32")
    out = accel.Buffer(256)
    accel.launch(k, 2 ** 31 - 1, 32, out, 64, 3)        # gridDim.x up to 2**31-1
    accel.launch(k, (1, 65535, 65535), 32, out, 64, 3)
    for grid in (2 ** 31, (1, 65536), (1, 1, 65536), np.uint64(2 ** 63)):
        with pytest.raises(ValueError, match="above the device's limit"):
            accel.launch(k, grid, 32, out, 64, 3)
    for bad in (np.True_, (1, True), 0, (1, 0, 1)):
        with pytest.raises((TypeError, ValueError)):
            accel.launch(k, bad, 32, out, 64, 3)
    accel.current_stream().synchronize()
    assert (out.to_numpy(np.uint32)[:64] == 3).all()


@pytest.mark.parametrize("value, ok", [
    (np.uint8(1), True), (np.uint16(1), True), (np.uint32(1), True), (np.uint64(1), False),
    (np.int8(1), False), (np.int32(1), False), (np.int64(1), False), (np.float32(1), False),
    (np.bool_(True), False), (True, False), (2 ** 32, False), (-1, False), (1.0, False),
    (np.array(5, np.uint32), True), (np.array(5, np.int64), False), (np.array([5], np.uint32), False),
    (np.timedelta64(1), False), (np.str_("1"), False), (np.longdouble(1), False),
])
def test_u32_argument_takes_what_numpy_casts_safely(sim_cuda, value, ok):
    """The module docstring's rule (numpy 'safe' casts, Python ints in range, no bool, no float)."""
    k = accel.Module(simk.TEST_PTX).function("accel_test_fill_u32")
    out = accel.Buffer(256).copy_from(np.zeros(64, np.uint32))
    if ok:
        accel.launch(k, 1, 32, out, 64, value)
        assert (out.to_numpy(np.uint32)[:64] == int(value)).all()
    else:
        with pytest.raises((TypeError, ValueError), match="argument 2"):
            accel.launch(k, 1, 32, out, 64, value)


def test_pointer_of_another_device_and_wrong_arity_are_refused_before_the_runtime(sim_cuda):
    k = accel.Module(simk.TEST_PTX, device=1).function("accel_test_fill_u32")
    other = accel.Buffer(256)              # device 0, current
    mine = accel.Buffer(256, device=1)
    calls = dict(sim.state().calls)
    with pytest.raises(ValueError, match="memory of device 0"):
        accel.launch(k, 1, 32, other, 64, 1)
    with pytest.raises(TypeError, match="takes 3 argument"):
        accel.launch(k, 1, 32, mine, 64)
    with pytest.raises(TypeError, match="takes 3 argument"):
        accel.launch(k, 1, 32, mine, 64, 1, 2)
    assert sim.state().calls.get("cudaLaunchKernel", 0) == calls.get("cudaLaunchKernel", 0)
    accel.launch(k, 1, 32, mine, 64, 9)    # device 0 current: launched on device 1's stream
    assert accel.current_device_index() == 0
    assert (mine.to_numpy(np.uint32, stream=accel.current_stream(1))[:64] == 9).all()


def test_dynamic_shared_over_48k_is_opted_in_and_over_the_optin_refused(sim_cuda, images, refs):
    """Programming Guide, "Shared Memory": above 48 KB a kernel opts in (cudaFuncSetAttribute);
    accel.launch does it.  With the kernel's 16 KiB static, static + dynamic may reach the opt-in
    limit and no more."""
    m = accel.Module(accel.compile(SRC, arch=(9, 0)).ptx) if _has_nvrtc() else None
    if m is None:
        pytest.skip("no NVRTC")
    k = m.function("r83c_static")
    out = accel.Buffer(4096)
    most = accel._lazy.lazy_init().launch_limits(0)["max_shared_per_block_optin"]
    accel.launch(k, 1, 64, out, shared_mem=most - 16384)
    with pytest.raises(ValueError, match="static shared memory"):
        accel.launch(k, 1, 64, out, shared_mem=most - 16384 + 1)
    accel.current_stream().synchronize()


def _has_nvrtc():
    from accel.backends.cuda import nvrtc as _nvrtc
    try:
        _nvrtc.version()
        return True
    except Exception:
        return False


# -- module lifetime with launches and graphs -------------------------------------------------------

def test_a_graph_of_a_closed_module_refuses_to_replay_and_a_dropped_one_keeps_it(sim_cuda):
    import gc
    out = accel.Buffer(256)
    s = accel.Stream()
    m = accel.Module(simk.TEST_PTX)
    k = m.function("accel_test_fill_u32")
    g = accel.Graph()
    with s, g:
        accel.launch(k, 1, 32, out, 64, 5)
    del k, m
    gc.collect()
    g.replay()                     # the graph kept the module loaded
    s.synchronize()
    assert (out.to_numpy(np.uint32)[:64] == 5).all()
    m2 = accel.Module(simk.TEST_PTX)
    k2 = m2.function("accel_test_fill_u32")
    g2 = accel.Graph()
    with s, g2:
        accel.launch(k2, 1, 32, out, 64, 6)
    m2.close()
    with pytest.raises(RuntimeError, match="was closed"):
        g2.replay()
    with pytest.raises(ValueError, match="closed"):
        accel.launch(k2, 1, 32, out, 64, 6)


# -- Level Zero and Metal ---------------------------------------------------------------------------

@pytest.fixture(params=["xpu", "mps"])
def zm(request, monkeypatch):
    return use_sim(monkeypatch, request.param)


def _zm_kernel(kind, device=None):
    img = spirv_module("accel_test_fill_u32") if kind == "xpu" else (
        "kernel void accel_test_fill_u32(device uint *out [[buffer(0)]], constant ulong &n [[buffer(1)]],\n"
        "                                constant uint &value [[buffer(2)]]) {}\n")
    return accel.Module(img, device=device).function("accel_test_fill_u32", "ptr, u64, u32")


def test_level_zero_and_metal_refuse_the_same_bad_arguments(zm):
    k = _zm_kernel(zm)
    out = accel.Buffer(256)
    for args, err in (((out, 64, 2 ** 32), ValueError), ((out, 64, np.bool_(True)), TypeError),
                      ((out, 64, np.int64(1)), TypeError), ((out, -1, 1), ValueError),
                      ((out, 64), TypeError), ((out, 64, 1, 1), TypeError), ((1.5, 64, 1), TypeError)):
        with pytest.raises(err):
            accel.launch(k, 1, 32, *args)
    for block in (0, 1025, (1, True)):
        with pytest.raises((TypeError, ValueError)):
            accel.launch(k, 1, block, out, 64, 1)
    accel.launch(k, 1, 32, out, 64, np.uint16(4))
    assert (out.to_numpy(np.uint32)[:64] == 4).all()


def test_level_zero_module_of_device_1_with_device_0_current(monkeypatch):
    zm = use_sim(monkeypatch, "xpu")           # (the Metal simulator has one device)
    k = _zm_kernel(zm, device=1)
    with pytest.raises(ValueError, match="memory of device 0"):
        accel.launch(k, 1, 32, accel.Buffer(256), 64, 1)
    out = accel.Buffer(256, device=1)
    accel.launch(k, 1, 32, out, 64, 12)
    assert accel.current_device_index() == 0
    assert (out.to_numpy(np.uint32, stream=accel.current_stream(1))[:64] == 12).all()
    k.module.close()
    with pytest.raises(ValueError, match="closed"):
        accel.launch(k, 1, 32, out, 64, 1)


def test_fatbin_entry_flags_seen_in_nvcc_13_output(images):
    """Documents the layout the xfail above rests on: nvcc 13's PTX entry has flag 0x8000 set and a
    zstd frame as payload; -compress-mode=none leaves it plain."""
    def ptx_entry_flags(data):
        _m, _v, hsize, fat = struct.unpack_from("<IHHQ", data, 0)
        pos, out = hsize, []
        while pos < hsize + fat:
            kind, _ver, eh, payload = struct.unpack_from("<HHIQ", data, pos)
            flags, = struct.unpack_from("<Q", data, pos + 40)
            if kind == 1:
                out.append((flags, data[pos + eh:pos + eh + 4]))
            pos += eh + payload
        return out

    (flags, head), = ptx_entry_flags(images["ptx80.fatbin"])
    assert flags & 0x8000 and not flags & 0x2000 and head == b"\x28\xb5\x2f\xfd"
    (flags, head), = ptx_entry_flags(images["ptx80_plain.fatbin"])
    assert not flags & 0xA000 and head != b"\x28\xb5\x2f\xfd"


_MSL_STATIC = ("kernel void r83c_tg(device float *p [[buffer(0)]], uint t [[thread_position_in_threadgroup]]) {{\n"
               "    threadgroup float s[{n}];\n"
               "    s[t] = 1; threadgroup_barrier(mem_flags::mem_threadgroup); p[t] = s[t];\n"
               "}}\n")


def test_metal_kernel_with_static_threadgroup_memory_within_the_limit_runs(monkeypatch):
    use_sim(monkeypatch, "mps")
    sim.register_kernel("r83c_tg", lambda grid, block, view, p: None, "ptr", replace=True)
    try:
        k = accel.Module(_MSL_STATIC.format(n=4096)).function("r83c_tg", "ptr")     # 16 KiB static
        accel.launch(k, 1, 32, accel.Buffer(256), shared_mem=16 * 1024)            # + 16 KiB: 32 KiB
        accel.current_stream().synchronize()
    finally:
        sim.unregister_kernel("r83c_tg")


# r83c, fixed in session 40: accel.sim.metal had no staticThreadgroupMemoryLength and its dispatch counted only
# setThreadgroupMemoryLength; accel.backends.mps.kernels.function_attributes reported no static memory
@pytest.mark.parametrize("n, dynamic", [(8192, 4096), (16384, 0)])
def test_metal_static_plus_dynamic_threadgroup_memory_over_the_limit_is_refused(monkeypatch, n, dynamic):
    """Apple, MTLComputeCommandEncoder setThreadgroupMemoryLength(_:index:): "The sum of all threadgroup
    memory allocations (whether made using this method or directly in the shader) can't exceed the
    device limits for threadgroup memory.  Check threadgroup memory limits with the
    staticThreadgroupMemoryLength property" (maxThreadgroupMemoryLength: 32 KiB).  A kernel declaring
    32 KiB launched with 4 KiB more, or one declaring 64 KiB, must not run."""
    use_sim(monkeypatch, "mps")
    ran = []
    sim.register_kernel("r83c_tg", lambda grid, block, view, p: ran.append(1), "ptr", replace=True)
    try:
        with pytest.raises((ValueError, accel.AcceleratorError)):
            k = accel.Module(_MSL_STATIC.format(n=n)).function("r83c_tg", "ptr")
            accel.launch(k, 1, 32, accel.Buffer(256), shared_mem=dynamic)
            accel.current_stream().synchronize()
        assert not ran
    finally:
        sim.unregister_kernel("r83c_tg")


# r83c, fixed in session 40: accel.sim.cudart.state's shared memory limits were H100's whatever ACCEL_SIM_CC said
def test_shared_memory_opt_in_limit_follows_the_compute_capability(monkeypatch):
    """CUDA C++ Programming Guide, "Compute Capability 8.x", Shared Memory: "Devices of compute
    capability 8.0 allow a single thread block to address up to 163 KB of shared memory, while
    devices of compute capabilities 8.6 and 8.9 allow up to 99 KB of shared memory" (9.0: 227 KB);
    cudaDevAttrMaxSharedMemoryPerBlockOptin reports it, and cudaFuncSetAttribute
    (MaxDynamicSharedMemorySize) above it is cudaErrorInvalidValue."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CC="8.6")
    k = accel.Module(simk.TEST_PTX.replace(b"sm_90", b"sm_86")).function("accel_test_fill_u32")
    with pytest.raises(ValueError, match="shared"):
        accel.launch(k, 1, 32, accel.Buffer(256), 64, 1, shared_mem=150 * 1024)


@pytest.mark.reallib
def test_include_paths_reach_nvrtc_and_a_missing_header_is_in_the_error(nvrtc, tmp_path):
    (tmp_path / "r83c.h").write_text("#define R83C_VALUE 4321\n")
    src = '#include "r83c.h"\nextern "C" __global__ void r83c_inc(int *p) { p[0] = R83C_VALUE; }\n'
    for opt in (f"-I{tmp_path}", f"--include-path={tmp_path}"):
        p = accel.compile(src, options=[opt, "-std=c++17"])
        assert p.entries == ("r83c_inc",) and b"4321" in p.ptx
    with pytest.raises(accel.CompileError, match='cannot open source file "r83c.h"') as ei:
        accel.compile(src, name="inc.cu")
    assert 'inc.cu(1): catastrophic error: cannot open source file "r83c.h"' in ei.value.log


def test_level_zero_graph_keeps_a_dropped_module_and_refuses_a_closed_one(monkeypatch):
    import gc
    use_sim(monkeypatch, "xpu")
    out = accel.Buffer(256)
    s = accel.Stream()
    k = _zm_kernel("xpu")
    g = accel.Graph()
    with s, g:
        accel.launch(k, 1, 32, out, 64, 5)
    del k
    gc.collect()
    g.replay()
    s.synchronize()
    assert (out.to_numpy(np.uint32)[:64] == 5).all()
    k2 = _zm_kernel("xpu")
    g2 = accel.Graph()
    with s, g2:
        accel.launch(k2, 1, 32, out, 64, 6)
    k2.module.close()
    with pytest.raises(RuntimeError, match="was closed"):
        g2.replay()
    # Level Zero has no dynamic local memory at launch (a kernel argument): refused in a capture
    # too, and the stream leaves the capture usable
    k3 = _zm_kernel("xpu")
    with pytest.raises(ValueError, match="shared_mem must be 0"):
        with s, accel.Graph():
            accel.launch(k3, 1, 32, out, 64, 7, shared_mem=16)
    accel.launch(k3, 1, 32, out, 64, 8, stream=s)
    s.synchronize()
    assert (out.to_numpy(np.uint32)[:64] == 8).all()


def test_a_graph_on_device_1_with_a_kernel_opted_in_to_100k_replays_from_device_0(sim_cuda):
    k = accel.Module(simk.TEST_PTX, device=1).function("accel_test_fill_u32")
    s = accel.Stream(device=1)
    out = accel.Buffer(256, device=1, stream=s)
    g = accel.Graph()
    with s, g:
        accel.launch(k, 1, 32, out, 64, 77, shared_mem=100 * 1024)
    assert accel.current_device_index() == 0
    g.replay()
    s.synchronize()
    assert (out.to_numpy(np.uint32, stream=s)[:64] == 77).all()
