"""The user-kernel path (accel.Module, Kernel, launch) at its edges, on the simulated CUDA runtime
with two devices (r65b).

What it checks, each against what the CUDA Runtime API documents:

* the dynamic shared memory opt-in (cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize))
  is state of the *function*, not of one accel.Kernel object: two Kernel objects of one function
  (another signature, or copy.copy) must not undo each other's opt-in;
* f32 arguments: a double that C rounds to FLT_MAX (numpy prints float32's max as 3.4028235e+38)
  is a finite float32, only values that round to inf are out of range;
* pointer arguments on CUDA, Level Zero and Metal: an object whose ``.device`` is a device string
  ("cuda:0", a DeviceLike everywhere else in accel), whose ``.ptr`` is no address (negative,
  2**64, a str), and the refusal of a CUDA-array-interface object for a pointer PTX declares .u64;
* every scalar width and signedness at its limits reaches the kernel exactly, one past refused
  with nothing queued; an ArrayView passes the address of its first element;
* wrong-architecture images (sm_100 on the simulated cc 9.0 device, PTX newer than the driver)
  raise KernelImageError on both kernel paths and leave no module loaded, also when accel cannot
  read the image's kernel names (a compressed fatbin); module churn with launches still queued
  unloads every module;
* one Kernel from two threads at once, a launch on the legacy stream while another thread
  captures, and a graph's replay reading the buffer contents of replay time.
"""

import copy
import gc
import shutil
import subprocess
import threading

import numpy as np
import pytest

import accel
from accel import sim
from accel.sim import kernels as simk

from conftest import use_sim, vendor_calls_made_by

FILL = "accel_test_fill_u32"        # fill(ptr out, u64 n, u32 value), registered by accel.sim
F32_MAX = float(np.finfo(np.float32).max)


@pytest.fixture
def cuda(monkeypatch):
    return use_sim(monkeypatch, "cuda")


def _fill(kernel, out, n, value, **kw):
    accel.launch(kernel, 1, 32, out, n, value, **kw)
    return out.to_numpy(np.uint32)[:n]


# -- dynamic shared memory opt-in ----------------------------------------------------------

@pytest.mark.parametrize("runtime", [None, "12040"])          # cudaLibrary* path; the driver's cuModule* path
@pytest.mark.parametrize("second", ["signature", "copy"])
def test_two_kernels_of_one_function_keep_the_shared_memory_opt_in(monkeypatch, second, runtime):
    """CUDA Runtime API, cudaFuncAttributes::maxDynamicSharedSizeBytes: "Any launch must have a
    dynamic shared memory size smaller than this value"; cudaFuncSetAttribute sets it for the
    function.  A Kernel that opted in to 100 000 bytes must still launch with them after another
    Kernel object of the same function set 60 000."""
    use_sim(monkeypatch, "cuda", **({"ACCEL_SIM_CUDA_RUNTIME": runtime} if runtime else {}))
    m = accel.Module(simk.TEST_PTX)
    ka = m.function(FILL)
    kb = m.function(FILL, "ptr, u64, u32") if second == "signature" else copy.copy(ka)
    assert ka is not kb and ka.handle == kb.handle
    out = accel.Buffer(256)
    assert (_fill(ka, out, 64, 1, shared_mem=100_000) == 1).all()
    assert (_fill(kb, out, 64, 2, shared_mem=60_000) == 2).all()
    assert (_fill(ka, out, 64, 3, shared_mem=100_000) == 3).all()


def test_one_kernel_raises_the_opt_in_only_when_asked_for_more(cuda):
    """The same Kernel: 100 000 then 60 000 then 100 000 bytes set the attribute once."""
    k = accel.Module(simk.TEST_PTX).function(FILL)
    out = accel.Buffer(256)

    def run():
        for value, smem in ((1, 100_000), (2, 60_000), (3, 100_000), (4, 49_153)):
            assert (_fill(k, out, 64, value, shared_mem=smem) == value).all()

    assert vendor_calls_made_by(run).get("cudaFuncSetAttribute") == 1


# -- f32 range -----------------------------------------------------------------------------

def _scalar_kernel(signature, device=None):
    got = []
    name = "r65b_scalars"
    sim.register_kernel(name, lambda grid, block, view, *args: got.append(args), signature, replace=True)
    ptx_type = {"i32": "s32", "u32": "u32", "i64": "s64", "u64": "u64", "f32": "f32", "f64": "f64", "ptr": "u64"}
    params = ", ".join(f".param .{ptx_type[t.strip()]} p{i}" for i, t in enumerate(signature.split(",")))
    ptx = (f".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry {name}({params})\n"
           f"{{\n ret;\n}}\n").encode()
    return accel.Module(ptx, device=device).function(name, signature), got


def test_f32_values_that_round_to_float32_max_are_accepted(cuda):
    """C11 6.3.1.5 / IEEE 754 round to nearest: (float)3.4028235e38 == FLT_MAX; only values of
    at least FLT_MAX + 2**103 (ties to even: FLT_MAX's significand is odd) become inf."""
    k, got = _scalar_kernel("f32")
    try:
        halfway = F32_MAX + 2.0 ** 103
        for value in (3.4028235e38, float(np.nextafter(halfway, 0)), -3.4028235e38):
            accel.launch(k, 1, 1, value)
            accel.synchronize()
            assert got[-1] == (np.copysign(F32_MAX, value),)
        for value in (halfway, -halfway, 1e39):
            with pytest.raises(ValueError, match=r"argument 0 \(f32\).*float32 range"):
                accel.launch(k, 1, 1, value)
    finally:
        sim.unregister_kernel("r65b_scalars")


# -- pointers ------------------------------------------------------------------------------

class _Pointer:
    """A foreign pointer object: ``.ptr`` and ``.device``."""

    def __init__(self, ptr, device):
        self.ptr, self.device = ptr, device


FILL_MSL = ("kernel void accel_test_fill_u32(device uint *out [[buffer(0)]], constant ulong &n [[buffer(1)]], "
            "constant uint &value [[buffer(2)]], uint i [[thread_position_in_grid]]) { if (i < n) out[i] = value; }\n")


def _fill_kernel(kind, device=None):
    """accel_test_fill_u32 on the ``kind`` simulator (its reference is accel.sim's)."""
    if kind == "cuda":
        return accel.Module(simk.TEST_PTX, device=device).function(FILL)
    if kind == "xpu":
        from test_user_kernels import spirv_module
        return accel.Module(spirv_module(FILL), device=device).function(FILL, "ptr, u64, u32")
    return accel.Module(FILL_MSL, device=device).function(FILL, "ptr, u64, u32")


@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_pointer_object_with_a_device_string(monkeypatch, kind):
    """A device string is a DeviceLike everywhere else in accel ("cuda:1"): the launch either
    takes it, or refuses naming the device, never "device <built-in method index of str>"."""
    use_sim(monkeypatch, kind)
    k = _fill_kernel(kind)
    out = accel.Buffer(256)
    if accel.device_count() > 1:
        with pytest.raises(ValueError, match="memory of device 1 but the kernel's module is loaded on device 0"):
            accel.launch(k, 1, 64, _Pointer(out.ptr, f"{kind}:1"), 64, 5)
    accel.launch(k, 1, 64, _Pointer(out.ptr, f"{kind}:0"), 64, 5)
    assert (out.to_numpy(np.uint32)[:64] == 5).all()


def test_refused_object_for_a_pointer_declared_u64_names_what_it_takes(cuda):
    """The module docstring: u64 (what PTX declares for pointers too) takes the same objects as
    ptr, or an int.  A __cuda_array_interface__ object (a CuPy or Numba array) or a numpy array
    given for the pointer must be told that, not "expected an int"."""
    k = accel.Module(simk.TEST_PTX).function(FILL)
    assert k.params[0] == "u64"
    out = accel.Buffer(256)
    cai = type("Foreign", (), {"__cuda_array_interface__": out.__cuda_array_interface__})()
    for value in (cai, np.zeros(4, np.uint32)):
        with pytest.raises(TypeError, match=r"argument 0 \(u64\) .*a Buffer, a typed view, an int"):
            accel.launch(k, 1, 32, value, 64, 1)


@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_pointer_object_whose_ptr_is_no_address(monkeypatch, kind):
    """An int argument for a pointer is checked against 0 .. 2**64-1 before anything is queued;
    a ``.ptr`` must be too (and be an int): refused naming the argument, the device still usable."""
    use_sim(monkeypatch, kind)
    k = _fill_kernel(kind)
    out = accel.Buffer(256)
    for ptr in (-5, 2 ** 64):
        with pytest.raises(ValueError, match=r"argument 0 \((u64|ptr)\) .*out of range"):
            accel.launch(k, 1, 64, _Pointer(ptr, 0), 64, 5)
    for ptr in (str(out.ptr), float(out.ptr)):
        with pytest.raises(TypeError, match=r"argument 0 "):
            accel.launch(k, 1, 64, _Pointer(ptr, 0), 64, 5)
    accel.launch(k, 1, 64, out, 64, 5)
    assert (out.to_numpy(np.uint32)[:64] == 5).all()


def test_pointer_object_with_an_int_or_device_object(cuda):
    k = accel.Module(simk.TEST_PTX, device=1).function(FILL)
    out = accel.Buffer(256, device=1)
    s1 = accel.Stream(device=1)
    for dev in (1, accel.device("cuda", 1)):
        out.fill_(0)
        accel.launch(k, 1, 32, _Pointer(out.ptr, dev), 64, 6, stream=s1)
        assert (out.to_numpy(np.uint32, stream=s1)[:64] == 6).all()
    for dev in (0, accel.device("cuda", 0)):
        with pytest.raises(ValueError, match="memory of device 0 but the kernel's module is loaded on device 1"):
            accel.launch(k, 1, 32, _Pointer(out.ptr, dev), 64, 6, stream=s1)


def test_array_view_passes_the_address_of_its_first_element(cuda):
    """Module of device 1, launched from device 0 being current: a view at byte offset 16
    fills from there; a view of device 0's memory is refused, naming both devices."""
    k = accel.Module(simk.TEST_PTX, device=1).function(FILL)
    s1 = accel.Stream(device=1)
    buf = accel.Buffer(256, device=1, stream=s1)
    buf.fill_(0, stream=s1)
    view = buf.as_array(np.uint32, offset=16)
    accel.launch(k, 1, 32, view, 8, 9, stream=s1)
    got = buf.to_numpy(np.uint32, stream=s1)
    assert got[:4].tolist() == [0] * 4 and got[4:12].tolist() == [9] * 8 and not got[12:].any()
    other = accel.Buffer(64).as_array(np.uint32, offset=4)
    with pytest.raises(ValueError, match=r"argument 0 \(u64\) is ArrayView.*memory of device 0 but the kernel's "
                                         r"module is loaded on device 1"):
        accel.launch(k, 1, 32, other, 8, 9, stream=s1)
    assert accel.current_device_index() == 0


# -- scalar widths -------------------------------------------------------------------------

SIGNATURE = "i32, u32, i64, u64, f32, f64"
LOW = (-2 ** 31, 0, -2 ** 63, 0, -F32_MAX, -float("inf"))
HIGH = (2 ** 31 - 1, 2 ** 32 - 1, 2 ** 63 - 1, 2 ** 64 - 1, F32_MAX, float("nan"))


def test_every_scalar_width_at_its_limits_reaches_the_kernel(cuda):
    k, got = _scalar_kernel(SIGNATURE, device=1)
    s1 = accel.Stream(device=1)
    try:
        for args in (LOW, HIGH, (np.int8(-128), np.uint16(65535), np.int32(-5), np.uint32(7),
                                 np.float16(1.5), np.float32(0.1))):
            accel.launch(k, 1, 1, *args, stream=s1)
            s1.synchronize()
            want = tuple(float(a) if isinstance(a, (float, np.floating)) else int(a) for a in args)
            assert len(got[-1]) == 6 and got[-1][:4] == want[:4]
            assert np.float32(got[-1][4]) == np.float32(want[4])
            assert got[-1][5] == want[5] or (want[5] != want[5] and got[-1][5] != got[-1][5])
        runs = len(got)
        for i, bad in enumerate((-2 ** 31 - 1, -1, -2 ** 63 - 1, -1)):
            args = list(HIGH)
            args[i] = bad
            with pytest.raises(ValueError, match=rf"argument {i} \({SIGNATURE.split(', ')[i]}\).*out of range"):
                accel.launch(k, 1, 1, *args, stream=s1)
        for i, bad in enumerate((2 ** 31, 2 ** 32, 2 ** 63, 2 ** 64)):
            args = list(LOW)
            args[i] = bad
            with pytest.raises(ValueError, match=rf"argument {i} .*out of range"):
                accel.launch(k, 1, 1, *args, stream=s1)
        with pytest.raises(TypeError, match=r"argument 1 \(u32\) is int8.*does not convert to uint32"):
            accel.launch(k, 1, 1, 0, np.int8(1), 0, 0, 0.0, 0.0, stream=s1)
        with pytest.raises(TypeError, match=r"argument 4 \(f32\) is float64.*does not convert to float32"):
            accel.launch(k, 1, 1, 0, 0, 0, 0, np.float64(0.5), 0.0, stream=s1)
        with pytest.raises(TypeError, match=r"takes 6 argument\(s\) \(i32, u32, i64, u64, f32, f64\), 7 given"):
            accel.launch(k, 1, 1, *LOW, 0, stream=s1)
        s1.synchronize()
        assert len(got) == runs         # no refused launch reached the device
    finally:
        sim.unregister_kernel("r65b_scalars")


# -- images of the wrong architecture, module churn ----------------------------------------

def _nvcc(tmp_path, out_name, *args):
    """nvcc ``args`` on a fill kernel (accel_test_fill_u32's parameters); the output's bytes."""
    nvcc = shutil.which("nvcc") or shutil.which("/usr/local/cuda/bin/nvcc")
    if nvcc is None:
        pytest.skip("no nvcc")
    src = tmp_path / "fill.cu"
    src.write_text('extern "C" __global__ void accel_test_fill_u32(unsigned *p, unsigned long long n, unsigned v)'
                   '{ unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) p[i] = v; }\n')
    out = tmp_path / out_name
    subprocess.run([nvcc, *args, "-o", str(out), str(src)], check=True, timeout=120)
    return out.read_bytes()


def _nvcc_cubin(tmp_path, arch):
    return _nvcc(tmp_path, f"fill_{arch}.cubin", "-cubin", f"-arch={arch}")


@pytest.mark.parametrize("runtime", [None, "12040"])      # cudaLibrary* path; the driver's cuModule* path
def test_images_for_another_architecture_load_nothing(monkeypatch, tmp_path, runtime):
    """Each refused image raises KernelImageError with the device's code (driver path: the CUresult
    name) on either device, and leaves no module loaded and the current device as it was."""
    use_sim(monkeypatch, "cuda", **({"ACCEL_SIM_CUDA_RUNTIME": runtime} if runtime else {}))
    sm100 = _nvcc_cubin(tmp_path, "sm_100")
    newer_isa = simk.TEST_PTX.replace(b".version 8.0", b".version 9.9")
    sm100_ptx = simk.TEST_PTX.replace(b".target sm_90", b".target sm_100")
    backend = accel._lazy.lazy_init()
    codes = ({"209": "cudaErrorNoKernelImageForDevice", "222": "cudaErrorUnsupportedPtxVersion",
              "218": "cudaErrorInvalidPtx"} if runtime is None else
             {"209": "CUDA_ERROR_NO_BINARY_FOR_GPU", "222": "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
              "218": "CUDA_ERROR_INVALID_PTX"})
    calls = {}
    for image, code in ((sm100, "209"), (newer_isa, "222"), (sm100_ptx, "218")):
        for device in (0, 1):
            def load():
                with pytest.raises(accel.KernelImageError, match=codes[code]):
                    accel.Module(image, device=device)

            for name, n in vendor_calls_made_by(load).items():
                calls[name] = calls.get(name, 0) + n
            assert accel.current_device_index() == 0
            assert not backend._live_modules
    if runtime is None:
        assert calls["cudaLibraryLoadData"] == calls["cudaLibraryUnload"] == 6
    good = accel.Module(_nvcc_cubin(tmp_path, "sm_90"), device=1).function(FILL, "ptr, u64, u32")
    s1 = accel.Stream(device=1)
    out = accel.Buffer(256, device=1, stream=s1)
    accel.launch(good, 1, 32, out, 64, 11, stream=s1)
    assert (out.to_numpy(np.uint32, stream=s1)[:64] == 11).all()


def _nvcc_fatbin(tmp_path, arch, *extra):
    return _nvcc(tmp_path, f"fill_{arch}.fatbin", "-fatbin", *extra, "-gencode",
                 f"arch=compute_{arch[3:]},code={arch}")


def test_image_error_of_an_image_accel_cannot_read_stays_a_kernel_image_error(cuda, tmp_path):
    """A compressed fatbin (fatbinary --compress-all) hides its kernel names from accel's reader;
    its sm_100 image has no code the cc 9.0 device runs.  The lookup's 209
    (cudaErrorNoKernelImageForDevice) says so: it must reach the caller as KernelImageError,
    not as "the module has no kernel named 'accel_test_fill_u32'"."""
    image = _nvcc_fatbin(tmp_path, "sm_100", "-Xfatbin", "-compress-all")
    with pytest.raises(accel.KernelImageError, match="cudaErrorNoKernelImageForDevice"):
        accel.Module(image).function(FILL, "ptr, u64, u32")


def test_modules_dropped_with_launches_queued_are_all_unloaded(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=500)
    out = accel.Buffer(4096)

    def churn():
        for i in range(24):
            m = accel.Module(simk.TEST_PTX, device=i % 2)
            k = m.function(FILL)
            s = accel.current_stream(i % 2)
            buf = out if i % 2 == 0 else accel.Buffer(4096, device=1)
            accel.launch(k, 4, 256, buf, 1024, i, stream=s)
            if i % 3 == 0:
                m.close()
            del m, k, buf
        gc.collect()
        accel.synchronize(0)
        accel.synchronize(1)

    calls = vendor_calls_made_by(churn)
    assert calls["cudaLibraryLoadData"] == calls["cudaLibraryUnload"] == 24
    assert (out.to_numpy(np.uint32) == 22).all()


# -- threads and captures --------------------------------------------------------------------

def test_one_kernel_launched_from_two_threads(cuda):
    k = accel.Module(simk.TEST_PTX).function(FILL)
    errors, results = [], {}
    start = threading.Barrier(2)

    def worker(base, smem):
        try:
            s = accel.Stream()
            out = accel.Buffer(4096, stream=s)
            start.wait()
            for i in range(30):
                accel.launch(k, 4, 256, out, 1024, base + i, stream=s, shared_mem=smem)
            results[base] = out.to_numpy(np.uint32, stream=s)
        except BaseException as exc:      # reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=args) for args in ((0, 60_000), (1000, 100_000))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert (results[0] == 29).all() and (results[1000] == 1029).all()


def test_launch_on_the_legacy_stream_while_another_thread_captures(cuda):
    """accel's streams are cudaStreamNonBlocking: a launch on the legacy default stream does not
    synchronize with them (CUDA Runtime API, "Stream synchronization behavior"), so it neither
    fails nor invalidates the capture, and the graph replays only its own launch."""
    k = accel.Module(simk.TEST_PTX).function(FILL)
    captured, eager = accel.Buffer(256), accel.Buffer(256)
    captured.fill_(0)
    eager.fill_(0)
    accel.synchronize()
    s, g = accel.Stream(), accel.Graph()
    inside, leave, errors = threading.Event(), threading.Event(), []

    def capture():
        try:
            with accel.graph(g, stream=s):
                accel.launch(k, 1, 32, captured, 64, 7)
                inside.set()
                leave.wait(10)
        except BaseException as exc:
            errors.append(repr(exc))
            inside.set()

    t = threading.Thread(target=capture)
    t.start()
    assert inside.wait(10)
    assert accel.current_stream().handle == 0
    accel.launch(k, 1, 32, eager, 64, 9)
    leave.set()
    t.join()
    assert errors == []
    accel.synchronize()
    assert (eager.to_numpy(np.uint32)[:64] == 9).all() and not captured.to_numpy(np.uint32).any()
    eager.fill_(0)
    g.replay()
    accel.synchronize()
    assert (captured.to_numpy(np.uint32)[:64] == 7).all() and not eager.to_numpy(np.uint32).any()


def test_replay_reads_the_buffers_at_replay_time(cuda):
    """A kernel node holds the addresses, not the data: contents written after the capture are
    what each replay reads (here: y = a*x + y, replayed after x changed)."""
    name = "r65b_axpy"

    def axpy(grid, block, view, a, x, y, n):
        ys = view(y, 4 * n, np.float32)
        ys[:] = np.float32(a) * view(x, 4 * n, np.float32) + ys

    sim.register_kernel(name, axpy, "f32, ptr, ptr, u64", replace=True)
    try:
        ptx = (f".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry {name}(.param .f32 a, "
               f".param .u64 x, .param .u64 y, .param .u64 n)\n{{\n ret;\n}}\n").encode()
        k = accel.Module(ptx, device=1).function(name)
        s1 = accel.Stream(device=1)
        x, y = accel.Buffer(256, device=1, stream=s1), accel.Buffer(256, device=1, stream=s1)
        x.copy_from(np.arange(64, dtype=np.float32), stream=s1)
        y.copy_from(np.zeros(64, np.float32), stream=s1)
        g = accel.Graph()
        with accel.graph(g, stream=s1):
            accel.launch(k, 1, 64, 2.0, x, y, 64)
        s1.synchronize()
        assert not y.to_numpy(np.float32, stream=s1).any()      # captured, not run
        x.copy_from(np.full(64, 3, np.float32), stream=s1)
        s1.synchronize()
        g.replay()
        accel.synchronize(1)
        assert (y.to_numpy(np.float32, stream=s1) == 6).all()
        x.copy_from(np.ones(64, np.float32), stream=s1)
        s1.synchronize()
        g.replay()
        accel.synchronize(1)
        assert (y.to_numpy(np.float32, stream=s1) == 8).all()
    finally:
        sim.unregister_kernel(name)
