"""The user-kernel path (accel.Module, Module.function, accel.launch) on the simulated Level Zero
(xpu, two devices) and Metal (mps) libraries, at the edges the CUDA file
(tests/test_user_kernel_edges_r65b.py) checked for CUDA (r65f).

What it checks, each against the vendor document named at the test:

* malformed SPIR-V images (an instruction running past the end, a truncated OpEntryPoint, a
  version word that is no SPIR-V version or is above the device's ``spirvVersionSupported``, an
  entry point <id> outside the header's bound, two kernels of one name, Float64 on a device
  without FP64) fail ``zeModuleCreate`` with ``ZE_RESULT_ERROR_MODULE_BUILD_FAILURE`` and a build
  log saying why, leave nothing loaded, and the device still runs kernels afterwards; accel's own
  reading of the image must raise a clear error too, never a ``struct.error``;
* MSL with unbalanced brackets or a kernel defined twice fails ``newLibraryWithSource:`` with the
  line, a kernel written inside a comment is no function of the library, and a declaration
  before the definition still compiles;
* every refused launch (zero/negative/too-large dimensions, too many threads, shared memory,
  argument count and types, memory of the other device, a closed buffer, a closed module) raises
  a ValueError/TypeError naming the value and queues nothing, and the next launch runs;
* modules dropped or closed with launches queued are all unloaded once the work ran, and their
  launches ran; one Kernel launched from four threads at once gives each thread its own values;
* Level Zero: launches by another thread while a capture is underway run eagerly and stay out
  of the graph; a module loaded and closed during that capture leaves it valid;
* a kernel's own group limit: SPIR-V ``OpExecutionMode LocalSize`` (a required group size) and
  MSL ``[[max_total_threads_per_threadgroup(N)]]`` refuse other launches, queuing nothing;
* accel bugs found here (each failed first): kernel handles grew with Module.function calls
  instead of live Kernels; MSL/SPIR-V build failures were no accel.CompileError; a launch off a
  SPIR-V LocalSize got the driver's bare code instead of the required shape; a truncated SPIR-V
  module raised struct.error.
"""

import gc
import struct
import threading

import numpy as np
import pytest

import accel
from accel import sim
from accel.sim import ze as sim_ze

from conftest import use_sim
from test_user_kernels import spirv_module

FILL = "accel_test_fill_u32"        # fill(ptr out, u64 n, u32 value), registered by accel.sim
SIG = "ptr, u64, u32"
FILL_MSL = ("kernel void accel_test_fill_u32(device uint *out [[buffer(0)]], constant ulong &n [[buffer(1)]],\n"
            "                                constant uint &value [[buffer(2)]]) {\n"
            "    // the simulator runs accel.sim's reference\n"
            "}\n")


def _image(kind):
    return spirv_module(FILL) if kind == "xpu" else FILL_MSL


def _header(version=0x00010200, bound=100):
    return struct.pack("<5I", 0x07230203, version, 0, bound, 0)


def _ze_counts():
    st = sim.state()
    return st.ze_live_modules, st.ze_live_kernels, st.ze_live_build_logs


def _metal_kernel_objects():
    live = sim.state().metal_live_objects
    return {k: v for k, v in live.items() if k in ("MTLLibrary", "MTLFunction", "MTLComputePipelineState")}


def _launches():
    """How many launches reached the simulated library (Level Zero appends, Metal dispatch encoders)."""
    calls = sim.state().calls
    return calls.get("zeCommandListAppendLaunchKernel", 0) + calls.get("computeCommandEncoder", 0)


def _fill_works(kind, value=0x5EED):
    k = accel.Module(_image(kind)).function(FILL, SIG)
    out = accel.Buffer(256)
    accel.launch(k, 1, 64, out, 64, value)
    assert (out.to_numpy(np.uint32)[:64] == value).all()


@pytest.fixture
def xpu(monkeypatch):
    return use_sim(monkeypatch, "xpu")


@pytest.fixture
def mps(monkeypatch):
    return use_sim(monkeypatch, "mps")


@pytest.fixture(params=["xpu", "mps"])
def kind(request, monkeypatch):
    return use_sim(monkeypatch, request.param)


# -- SPIR-V images zeModuleCreate must refuse -------------------------------------------------

_GOOD = spirv_module("a", "b")
BAD_SPIRV = {
    # SPIR-V 2.3: "WordCount: the complete number of words taken by an instruction"
    "instruction past the end": (_GOOD + struct.pack("<I", (50 << 16) | 1), "the module is truncated"),
    "version word": (_header(0xDEADBEEF) + _GOOD[20:], "is no SPIR-V version"),
    # Level Zero SPIR-V Programming Guide: the device's maximum is spirvVersionSupported (1.2 here)
    "version above the device's": (_header(0x00010500) + _GOOD[20:], "SPIR-V 1.5 is above the device's"),
    # SPIR-V 2.3: "all <id>s in this module are guaranteed to satisfy 0 < id < Bound"
    "id outside the bound": (_header(bound=5) + _GOOD[20:], "outside the header's bound 5"),
    # OpEntryPoint: "A module must not have two OpEntryPoint instructions with the same Execution
    # Model and the same Name string."
    "two kernels of one name": (spirv_module("a", "a"), "two OpEntryPoint Kernel instructions are named 'a'"),
}


@pytest.mark.parametrize("what", sorted(BAD_SPIRV))
def test_malformed_spirv_fails_the_build_and_loads_nothing(xpu, what):
    data, log = BAD_SPIRV[what]
    _fill_works(xpu)
    before = _ze_counts()
    # zeModuleCreate itself, through the backend: accel.Module's own reader refuses some of these
    # images first (a truncated instruction: ValueError), and the driver must refuse them all
    from accel import _lazy
    with pytest.raises(accel.CompileError, match=f"zeModuleCreate failed with ZE_RESULT_ERROR_MODULE_BUILD_"
                                                 f"FAILURE.*build log: error: .*{log}") as err:
        _lazy.lazy_init().module_load(data)
    assert log in err.value.log
    assert _ze_counts() == before           # no module, kernel or build log left behind
    _fill_works(xpu)


def test_float64_module_builds_only_on_a_device_with_fp64(xpu):
    """A module declaring OpCapability Float64 needs ZE_DEVICE_MODULE_FLAG_FP64 (the simulated
    device has it by default; configure_ze(fp64=False) is a device without, as Intel Arc A)."""
    with_f64 = _GOOD[:20] + struct.pack("<2I", (2 << 16) | 17, 10) + _GOOD[20:]
    sim_ze.configure_ze(fp64=False)
    assert "float64" not in accel.get_device_capability()["supported_dtypes"]
    with pytest.raises(accel.AcceleratorError, match="MODULE_BUILD_FAILURE.*OpCapability Float64.*"
                                                     "ZE_DEVICE_MODULE_FLAG_FP64"):
        accel.Module(with_f64)
    assert _ze_counts() == (0, 0, 0)
    accel.Module(_GOOD).close()             # the same module without Float64 builds
    _fill_works(xpu)


def test_float64_module_builds_on_a_device_with_fp64(xpu):
    with_f64 = _GOOD[:20] + struct.pack("<2I", (2 << 16) | 17, 10) + _GOOD[20:]
    assert "float64" in accel.get_device_capability()["supported_dtypes"]
    assert accel.Module(with_f64).entries == ("a", "b")


TRUNCATED_SPIRV = {
    "cut in an OpEntryPoint": _GOOD[:-4],
    "OpEntryPoint of two words": _GOOD[:40] + struct.pack("<2I", (2 << 16) | 15, 6),
}


@pytest.mark.parametrize("what", sorted(TRUNCATED_SPIRV))
def test_the_driver_refuses_a_truncated_spirv_module(xpu, what):
    """zeModuleCreate itself (the backend's module_load, below accel's own reading)."""
    backend = accel._lazy.lazy_init()
    with pytest.raises(accel.AcceleratorError, match="MODULE_BUILD_FAILURE.*build log: error: .*(truncated|too few)"):
        backend.module_load(TRUNCATED_SPIRV[what])
    assert _ze_counts() == (0, 0, 0)


@pytest.mark.parametrize("what", sorted(TRUNCATED_SPIRV))
def test_accel_reports_a_truncated_spirv_module_clearly(xpu, what):
    """accel.Module reads the image's kernel names before the driver builds it; a truncated image
    must give a ValueError (or the driver's build failure) saying so, not struct.error."""
    with pytest.raises((ValueError, accel.AcceleratorError), match="truncated|too few|words"):
        accel.Module(TRUNCATED_SPIRV[what])
    assert _ze_counts() == (0, 0, 0)


# -- MSL newLibraryWithSource: must refuse ------------------------------------------------------

BAD_MSL = {
    "unclosed brace": (FILL_MSL[:-2], r"program_source:2: error: '\{' is never closed"),
    "extra parenthesis": (FILL_MSL.replace("value [[buffer(2)]])", "value [[buffer(2)]]))"),
                          r"program_source:2: error: unexpected '\)'"),
    "kernel defined twice": (FILL_MSL + FILL_MSL.replace("    // the simulator runs accel.sim's reference\n", ""),
                             r"program_source:5: error: redefinition of kernel 'accel_test_fill_u32'"),
}


@pytest.mark.parametrize("what", sorted(BAD_MSL))
def test_msl_syntax_errors_fail_to_compile_and_leak_nothing(mps, what):
    """Metal Shading Language Specification 1.5 (MSL is C++14: brackets pair up) and 1.5.1
    ("graphics and kernel functions cannot be overloaded")."""
    src, msg = BAD_MSL[what]
    _fill_works(mps)
    with pytest.raises(accel.AcceleratorError, match=f"newLibraryWithSource.*{msg}"):
        accel.Module(src)
    gc.collect()
    assert _metal_kernel_objects() == {}
    _fill_works(mps)


def test_msl_declaration_before_definition_and_brackets_in_literals_compile(mps):
    src = ("kernel void accel_test_fill_u32(device uint *out [[buffer(0)]], constant ulong &n [[buffer(1)]],\n"
           "                                constant uint &value [[buffer(2)]]);\n"
           "constant char close_paren = ')';   /* an unbalanced '{' in a comment */\n" + FILL_MSL)
    m = accel.Module(src)
    assert m.entries == (FILL,)
    out = accel.Buffer(64)
    accel.launch(m.function(FILL, SIG), 1, 16, out, 16, 3)
    assert (out.to_numpy(np.uint32)[:16] == 3).all()


def test_a_kernel_inside_a_comment_is_no_function_of_the_library(mps):
    """Comments are C++ comments (MSL Specification 1.5): newFunctionWithName: answers nil."""
    sim.register_kernel("r65f_ghost", lambda grid, block, view, out: None, "ptr")
    try:
        src = FILL_MSL + "/* old version:\nkernel void r65f_ghost(device uint *out [[buffer(0)]]) {}\n*/\n"
        m = accel.Module(src)
        assert m.entries == (FILL,)
        with pytest.raises(KeyError, match="no kernel named 'r65f_ghost'; its kernels: accel_test_fill_u32"):
            m.function("r65f_ghost", "ptr")
        backend = accel._lazy.lazy_init()
        h = backend.module_load(src.encode())
        try:
            with pytest.raises(accel.AcceleratorError, match="no kernel named 'r65f_ghost'"):
                backend.module_function(h, "r65f_ghost")
        finally:
            backend.module_unload(h)
    finally:
        sim.unregister_kernel("r65f_ghost")


# -- refused launches queue nothing ---------------------------------------------------------------

def test_each_refused_launch_names_the_value_and_queues_nothing(kind):
    k = accel.Module(_image(kind)).function(FILL, SIG)
    out = accel.Buffer(256)
    closed = accel.Buffer(256)
    closed.close()
    smem = 32 * 1024 + 16 if kind == "mps" else 16      # Metal: 32 KiB; Level Zero: none by launch
    bad = [
        ((0, 64, out, 64, 1), {}, ValueError, r"grid\[0\] is 0; every grid dimension must be >= 1"),
        ((1, (64, -2), out, 64, 1), {}, ValueError, r"block\[1\] is -2"),
        ((1, (1025,), out, 64, 1), {}, ValueError, r"block\[0\] is 1025, above the device's limit of 1024"),
        ((1, (32, 32, 2), out, 64, 1), {}, ValueError, "2048 threads, above the device's 1024"),
        ((2 ** 32, 64, out, 64, 1), {}, ValueError, r"grid\[0\] is 4294967296, above the device's limit"),
        ((1, 64, out, 64, 1), {"shared_mem": smem}, ValueError, "shared"),
        ((1, 64, out, 64), {}, TypeError, r"takes 3 argument\(s\) \(ptr, u64, u32\), 2 given"),
        ((1, 64, out, 64, 1, 2), {}, TypeError, "4 given"),
        ((1, 64, out, 64, 1.5), {}, TypeError, r"argument 2 \(u32\) is float 1.5"),
        ((1, 64, out, -1, 1), {}, ValueError, r"argument 1 \(u64\) is int -1: out of range"),
        ((1, 64, out, 64, out), {}, TypeError, r"argument 2 \(u32\) is Buffer .*device memory for a u32 parameter"),
        ((1, 64, closed, 64, 1), {}, RuntimeError, "was closed; allocate a new Buffer"),
    ]
    if kind == "xpu":
        other = accel.Buffer(256, device=1)
        bad.append(((1, 64, other, 64, 1), {}, ValueError, "memory of device 1 but the kernel's module is loaded "
                                                           r"on device 0; load the module on device 1"))
        bad.append(((1, 64, out, 64, 1), {"stream": accel.Stream(device=1)}, ValueError,
                    "stream is on device 1 but the kernel's module is loaded on device 0"))
    before = _launches()
    for args, kw, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            accel.launch(k, *args, **kw)
    accel.synchronize()
    assert _launches() == before
    accel.launch(k, 1, 64, out, 64, 77)
    assert (out.to_numpy(np.uint32)[:64] == 77).all()
    k.module.close()
    with pytest.raises(ValueError, match="is closed; load the image again"):
        accel.launch(k, 1, 64, out, 64, 1)
    assert _launches() == before + 1


# -- lifetimes and threads --------------------------------------------------------------------------

def test_modules_dropped_or_closed_with_launches_queued_are_unloaded_after_they_ran(monkeypatch, kind):
    use_sim(monkeypatch, kind, ACCEL_SIM_DELAY_US=2000)
    outs = [accel.Buffer(256) for _ in range(12)]
    for i, out in enumerate(outs[:6]):            # dropped: collected with the launch queued
        accel.launch(accel.Module(_image(kind)).function(FILL, SIG), 1, 64, out, 64, i + 1)
    gc.collect()
    m = accel.Module(_image(kind))
    k = m.function(FILL, SIG)
    for i, out in enumerate(outs[6:]):
        accel.launch(k, 1, 64, out, 64, i + 7)
    m.close()                                      # closed with its launches queued
    accel.synchronize()
    assert [int(o.to_numpy(np.uint32)[63]) for o in outs] == list(range(1, 13))
    del k
    gc.collect()
    if kind == "xpu":
        assert _ze_counts() == (0, 0, 0)
    else:
        assert _metal_kernel_objects() == {}
    _fill_works(kind)


def test_one_kernel_launched_from_four_threads(kind):
    k = accel.Module(_image(kind)).function(FILL, SIG)
    errors = []
    barrier = threading.Barrier(4)

    def worker(j):
        try:
            s = accel.Stream()
            outs = [accel.Buffer(256) for _ in range(8)]
            barrier.wait()
            for i, out in enumerate(outs):
                accel.launch(k, 1, 64, out, 64, j * 1000 + i, stream=s)
            s.synchronize()
            got = [int(o.to_numpy(np.uint32, stream=s)[i % 64]) for i, o in enumerate(outs)]
            if got != [j * 1000 + i for i in range(8)]:
                errors.append((j, got))
        except Exception as exc:        # reported below
            errors.append((j, repr(exc)))

    threads = [threading.Thread(target=worker, args=(j,)) for j in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_launches_by_another_thread_during_a_capture_run_eagerly(xpu):
    k = accel.Module(_image(xpu)).function(FILL, SIG)
    captured, eager, late = accel.Buffer(256), accel.Buffer(256), accel.Buffer(256)
    s = accel.Stream()
    g = accel.Graph()
    began, done = threading.Event(), threading.Event()
    result = {}

    def capture():
        try:
            with s:
                g.capture_begin()
                accel.launch(k, 1, 64, captured, 64, 5)
                began.set()
                done.wait(10)
                g.capture_end()
            result["ok"] = True
        except Exception as exc:        # reported below
            result["error"] = repr(exc)
            began.set()

    t = threading.Thread(target=capture)
    t.start()
    began.wait(10)
    try:
        accel.launch(k, 1, 64, eager, 64, 6)                          # this thread's current stream
        accel.launch(k, 1, 64, late, 64, 7, stream=accel.Stream())    # a new stream
        m2 = accel.Module(_image(xpu))                                  # load and unload meanwhile
        accel.launch(m2.function(FILL, SIG), 1, 64, late, 64, 8)
        m2.close()
    finally:
        done.set()
        t.join()
    assert result == {"ok": True}
    accel.synchronize()
    assert eager.to_numpy(np.uint32)[0] == 6 and late.to_numpy(np.uint32)[0] == 8
    assert captured.to_numpy(np.uint32)[0] == 0           # captured, not run
    g.replay()
    s.synchronize()
    assert (captured.to_numpy(np.uint32)[:64] == 5).all()
    assert eager.to_numpy(np.uint32)[0] == 6               # the other thread's launches are not in the graph


# -- accel bugs (fixed) ---------------------------------------------------------------------------

def test_kernel_handles_are_bounded_by_live_kernels(kind):
    """A Module kept for the program's life, its kernel looked up per call (as a library wrapper
    does: ``module.function(name)(...)``): the runtime objects must not grow with the calls
    (zeKernelCreate allocates a kernel object; newComputePipelineStateWithFunction: compiles a
    pipeline).  CUDA's cudaLibraryGetKernel returns the same handle for a name."""
    m = accel.Module(_image(kind))
    out = accel.Buffer(256)
    for i in range(40):
        accel.launch(m.function(FILL, SIG), 1, 64, out, 64, i)
        gc.collect()
    accel.synchronize()
    assert out.to_numpy(np.uint32)[0] == 39
    if kind == "xpu":
        assert sim.state().ze_live_kernels <= 1
    else:
        assert _metal_kernel_objects().get("MTLComputePipelineState", 0) <= 1
    m.close()


def test_a_failed_build_is_a_compile_error_with_the_log(kind):
    """accel.CompileError: "Source code did not compile into a kernel image: accel.compile (NVRTC)
    or a backend that builds source at module creation (Metal's MSL, Level Zero's SPIR-V). ``log``
    holds the compiler's log"."""
    bad = spirv_module() if kind == "xpu" else FILL_MSL + "#error r65f no such type\n"
    with pytest.raises(accel.CompileError) as err:
        accel.Module(bad)
    assert ("no OpEntryPoint Kernel" if kind == "xpu" else "r65f no such type") in err.value.log
    assert err.value.call in ("zeModuleCreate", "newLibraryWithSource:options:error:")


# -- a required group size (OpExecutionMode LocalSize) --------------------------------------------

def _with_local_size(x, y, z):
    """spirv_module(FILL) plus ``OpExecutionMode %10 LocalSize x y z`` (OpenCL C's
    ``__attribute__((reqd_work_group_size(x, y, z)))``; spirv_module gives the entry <id> 10)."""
    return spirv_module(FILL) + struct.pack("<6I", (6 << 16) | 16, 10, 17, x, y, z)


def test_a_kernel_runs_only_with_its_required_group_size(xpu):
    """ze_kernel_properties_t.requiredGroupSizeX/Y/Z ("required group size"): zeKernelSetGroupSize
    with another size fails (ZE_RESULT_ERROR_INVALID_GROUP_SIZE_DIMENSION); nothing is queued and
    the required size launches."""
    k = accel.Module(_with_local_size(64, 1, 1)).function(FILL, SIG)
    out = accel.Buffer(256)
    before = _launches()
    k._required = None      # accel's own check (test_a_launch_off_the_required_group_size_names_it) out of the way
    with pytest.raises(accel.AcceleratorError, match="zeKernelSetGroupSize.*INVALID_GROUP_SIZE_DIMENSION"):
        accel.launch(k, 1, 32, out, 64, 1)
    assert _launches() == before
    accel.launch(k, 1, (64, 1, 1), out, 64, 4)
    assert (out.to_numpy(np.uint32)[:64] == 4).all()


def test_a_required_group_size_beyond_the_device_fails_the_build(xpu):
    with pytest.raises(accel.AcceleratorError, match=r"MODULE_BUILD_FAILURE.*LocalSize \(2048, 1, 1\)"):
        accel.Module(_with_local_size(2048, 1, 1))
    assert _ze_counts() == (0, 0, 0)


def test_a_launch_off_the_required_group_size_names_it(xpu):
    k = accel.Module(_with_local_size(64, 1, 1)).function(FILL, SIG)
    with pytest.raises(ValueError, match=r"block \(32, 1, 1\) is not the block shape \(64, 1, 1\)"):
        accel.launch(k, 1, 32, accel.Buffer(256), 64, 1)


# -- a Metal kernel's own thread limit ([[max_total_threads_per_threadgroup(N)]]) --------------------

_LIMITED_MSL = {
    "before": "[[max_total_threads_per_threadgroup(128)]]\n" + FILL_MSL,
    "after": FILL_MSL.replace("[[buffer(2)]]) {", "[[buffer(2)]])\n    [[max_total_threads_per_threadgroup(128)]]\n{"),
}


@pytest.mark.parametrize("where", sorted(_LIMITED_MSL))
def test_a_metal_kernel_runs_within_its_own_thread_limit(mps, where):
    """MTLComputePipelineDescriptor.maxTotalThreadsPerThreadgroup: "Your shader can also configure the
    maximum number of threads per threadgroup with the [[max_total_threads_per_threadgroup]]
    attribute"; the pipeline's maxTotalThreadsPerThreadgroup "may be different for different
    pipeline objects".  A launch above it is refused before anything is encoded."""
    k = accel.Module(_LIMITED_MSL[where]).function(FILL, SIG)
    out = accel.Buffer(1024)
    before = _launches()
    with pytest.raises(ValueError, match=r"block \(256, 1, 1\) has 256 threads, above the kernel's own limit of 128 .*Metal pipeline"):
        accel.launch(k, 1, 256, out, 256, 1)
    assert _launches() == before
    accel.launch(k, 2, 128, out, 256, 9)
    assert (out.to_numpy(np.uint32)[:256] == 9).all()
