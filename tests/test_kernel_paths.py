"""Kernels on every CUDA runtime (issue 14 items 3-4): cudaLibrary* on 12.8+, the driver API
through cudaGetDriverEntryPoint before that, the host path when neither works; the shipped
fatbin loads with no JIT where it has SASS; the simulator reads fatbins as the driver does."""

import struct
import warnings

import pytest

np = pytest.importorskip("numpy")

import accel  # noqa: E402
import accel.random as R  # noqa: E402
from _cffi_backend import FFI  # noqa: E402

from accel import _lazy, sim  # noqa: E402
from accel._ffi import has_symbol  # noqa: E402
from accel._errors import AcceleratorError, KernelImageError  # noqa: E402
from accel.backends.cuda import driver as _cuda_driver  # noqa: E402
from accel.random import _device, philox  # noqa: E402
from accel.sim import _cuda_images  # noqa: E402
from conftest import use_sim  # noqa: E402

SEED = 0x1234_5678_9ABC


def _fatbin():
    return _device._BINARIES["ptx"]()


def _ptx():
    return _device._SOURCES["ptx"]()


def _cuda(monkeypatch, runtime="13.0", driver="13.0", cc=None):
    env = {"ACCEL_SIM_CUDA_RUNTIME": runtime, "ACCEL_SIM_CUDA_DRIVER": driver}
    if cc:
        env["ACCEL_SIM_CC"] = cc
    use_sim(monkeypatch, "cuda", **env)
    return _lazy.lazy_init()


def _raw_on(device: int, n: int = 37):
    """random_raw_ into a buffer of ``device`` while device 0 stays current."""
    R.manual_seed_all(SEED)
    with accel.device_index(device):
        buf = accel.Buffer(4 * n)
    R.random_raw_(buf)
    accel.synchronize(device)
    return buf.to_numpy("uint32")


@pytest.mark.parametrize("runtime,path,launch_call", [("12.4", "driver", "cuLaunchKernel"),
                                                      ("12.8", "library", "cudaLaunchKernel"),
                                                      ("13.0", "library", "cudaLaunchKernel")])
def test_each_runtime_runs_the_kernels_on_the_non_current_device(monkeypatch, runtime, path, launch_call):
    backend = _cuda(monkeypatch, runtime=runtime)
    assert backend.kernel_path()["kernel_path"] == path
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # no host-path fallback warning
        got = _raw_on(1)
    assert accel.current_device_index() == 0
    assert np.array_equal(got, philox.raw_words(SEED, 0, 37))
    assert sim.calls(launch_call) >= 1
    assert sim.state().jit_compiles == 0          # the fatbin's sm_90 SASS: nothing JIT-compiled


def test_runtime_12_4_has_no_cudaLibrary_symbols(monkeypatch):
    backend = _cuda(monkeypatch, runtime="12.4")
    _, lib, _ = backend._runtime()
    assert not has_symbol(lib, "cudaLibraryLoadData") and not has_symbol(lib, "cudaGetDriverEntryPointByVersion")
    assert has_symbol(lib, "cudaGetDriverEntryPoint")
    # as cffi does for a real libcudart.so.12 of 12.4: a declared but absent symbol is ffi.error
    with pytest.raises(FFI.error, match="undefined symbol: cudaLibraryLoadData"):
        lib.cudaLibraryLoadData


def test_driver_path_launches_are_captured(monkeypatch):
    _cuda(monkeypatch, runtime="12.4")
    R.manual_seed(SEED)
    gen = R.default_generator(0)
    side = accel.Stream()
    a = accel.Buffer(4 * 6, stream=side)
    g = accel.Graph()
    with accel.graph(g, stream=side):
        R.random_raw_(a)
    launches = sim.calls("cuLaunchKernel")
    assert launches >= 1
    for _ in range(2):
        start = gen.offset
        g.replay()
        accel.synchronize()
        assert np.array_equal(a.to_numpy("uint32"), philox.raw_words(SEED, start, 6))


def test_missing_entry_point_is_a_clear_no_kernel_path_and_the_host_path_runs(monkeypatch):
    backend = _cuda(monkeypatch, runtime="12.4")
    # classic segments: expandable ones would take the injected failure for cuMemCreate's entry point
    monkeypatch.setenv("ACCEL_ALLOC_CONF", "expandable_segments:False")
    sim.inject_error("cudaGetDriverEntryPoint", 801, times=1)      # cudaErrorNotSupported
    with pytest.warns(RuntimeWarning, match=r"no kernel path: cudaGetDriverEntryPoint\('cuModuleLoadData'\) "
                                            r"failed with cudaErrorNotSupported \(801\).*host path"):
        got = _raw_on(0)
    assert np.array_equal(got, philox.raw_words(SEED, 0, 37))
    with pytest.raises(AcceleratorError, match="no kernel path"):
        backend.module_load(_ptx())


def test_plan_without_either_symbol_names_what_is_missing():
    class Lib:   # a libcudart exporting neither cudaLibrary* nor cudaGetDriverEntryPoint
        pass
    path, why = _cuda_driver.plan(Lib())
    assert path == "" and "cudaLibraryLoadData" in why and "cudaGetDriverEntryPoint" in why


def test_driver_errors_are_named_cuda_error_codes(monkeypatch):
    backend = _cuda(monkeypatch, runtime="12.4", driver="12.4")
    newer = _ptx().replace(b".version 6.3", b".version 8.7")       # 8.7 needs a 12.8 driver
    with pytest.raises(KernelImageError, match=r"cuModuleLoadData failed with "
                                               r"CUDA_ERROR_UNSUPPORTED_PTX_VERSION \(222\)") as info:
        backend.module_load(newer)
    assert info.value.code == 222
    module = backend.module_load(_ptx())
    with pytest.raises(AcceleratorError, match=r"cuModuleGetFunction failed with CUDA_ERROR_NOT_FOUND \(500\)"):
        backend.module_function(module, "no_such_kernel")
    backend.module_unload(module)
    assert sim.state().modules == 0


def test_driver_function_belongs_to_the_device_it_was_loaded_on(monkeypatch):
    backend = _cuda(monkeypatch, runtime="12.4")
    module = backend.module_load(_fatbin())                        # device 0's context
    fn = backend.module_function(module, "accel_philox_store_state")
    with accel.device_index(1):
        buf = accel.Buffer(16)
        args = [("ptr", buf.ptr), ("ptr", buf.ptr + 8), ("u64", 1), ("u64", 2)]
        with pytest.raises(AcceleratorError, match=r"CUDA_ERROR_INVALID_CONTEXT \(201\)"):
            backend.launch(fn, (1, 1, 1), (1, 1, 1), args, 0, accel.current_stream().handle)


def test_newer_ptx_than_the_driver_falls_back_to_the_host_path(monkeypatch):
    # 12.8 runtime on a 12.2 driver works (minor version compatibility), but its JIT
    # cannot compile PTX 8.7: the fill warns once and uses the host path.
    _cuda(monkeypatch, runtime="12.8", driver="12.2")
    newer = _ptx().replace(b".version 6.3", b".version 8.7")
    R.register_kernel_source("ptx", lambda: newer)
    try:
        with pytest.warns(RuntimeWarning, match="UnsupportedPtxVersion"):
            got = _raw_on(1)
        assert np.array_equal(got, philox.raw_words(SEED, 0, 37))
    finally:
        R.register_kernel_source("ptx", _device._shipped("philox.ptx"))
        _device._BINARIES["ptx"] = _device._shipped("philox.fatbin")


@pytest.mark.parametrize("cc,jit", [("9.0", 0), ("8.7", 0), ("12.1", 0), ("11.0", 1)])
def test_fatbin_uses_sass_for_the_device_and_jits_ptx_otherwise(monkeypatch, cc, jit):
    _cuda(monkeypatch, cc=cc)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _raw_on(1)
    assert np.array_equal(got, philox.raw_words(SEED, 0, 37))
    assert sim.state().jit_compiles == jit


def test_device_older_than_every_image_uses_the_host_path(monkeypatch):
    _cuda(monkeypatch, cc="7.0")        # no sm_7x SASS for 7.0, and the PTX targets sm_75
    with pytest.warns(RuntimeWarning, match="host path"):
        got = _raw_on(0)
    assert np.array_equal(got, philox.raw_words(SEED, 0, 37))


def _fatbin_without_ptx(data: bytes) -> bytes:
    _magic, version, hsize, _size = struct.unpack_from("<IHHQ", data, 0)
    out, pos = b"", hsize
    while pos < len(data):
        kind, _v, ehsize, payload = struct.unpack_from("<HHIQ", data, pos)
        if kind == _cuda_images.KIND_ELF:
            out += data[pos:pos + ehsize + payload]
        pos += ehsize + payload
    return struct.pack("<IHHQ", _cuda_images.FATBIN_MAGIC, version, hsize, len(out)) + out


def test_shipped_fatbin_holds_sass_for_every_target_and_the_ptx():
    entries = _cuda_images.fatbin_entries(_fatbin())
    assert sorted(sm for kind, sm, _ in entries if kind == _cuda_images.KIND_ELF) == [75, 80, 86, 89, 90, 100, 120]
    ptx = [body for kind, _, body in entries if kind == _cuda_images.KIND_PTX]
    # fatbinary keeps the PTX minus its comments and indentation
    code = lambda text: [b" ".join(ln.split()) for ln in text.rstrip(b"\0").splitlines()
                         if ln.strip() and not ln.strip().startswith(b"//")]
    assert len(ptx) == 1 and code(ptx[0]) == code(_ptx())
    for kind, sm, body in entries:
        if kind == _cuda_images.KIND_ELF:
            assert sorted(_cuda_images.elf_entries(body)) == sorted(_device.defined_kernels(_ptx()))


def test_sim_refuses_a_fatbin_with_no_image_for_the_device(monkeypatch):
    backend = _cuda(monkeypatch, runtime="13.0", cc="7.0")
    # loaded lazily (the default): at the first kernel lookup (tests/test_lazy_loading_r61.py)
    module = backend.module_load(_fatbin_without_ptx(_fatbin()))
    with pytest.raises(KernelImageError, match=r"cudaErrorNoKernelImageForDevice \(209\)"):
        backend.module_function(module, "accel_philox_store_state")
    backend.module_unload(module)
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    with pytest.raises(KernelImageError, match=r"cudaErrorNoKernelImageForDevice \(209\)"):
        backend.module_load(_fatbin_without_ptx(_fatbin()))
    # the same image through the driver path: CUDA_ERROR_NO_BINARY_FOR_GPU
    backend = _cuda(monkeypatch, runtime="12.4", cc="7.0")
    with pytest.raises(KernelImageError, match=r"CUDA_ERROR_NO_BINARY_FOR_GPU \(209\)"):
        backend.module_load(_fatbin_without_ptx(_fatbin()))


def test_ptx_isa_limits_follow_the_cuda_release():
    assert _cuda_images.max_ptx_isa(12020) == (8, 2)
    assert _cuda_images.max_ptx_isa(12080) == (8, 7)
    assert _cuda_images.max_ptx_isa(13000) == (9, 0)


def test_a_rejected_fatbin_falls_back_to_the_ptx(monkeypatch):
    _cuda(monkeypatch, runtime="13.0")
    sim.inject_error("cudaLibraryLoadData", 200, times=1)    # e.g. a driver refusing these cubins
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _raw_on(1)
    assert np.array_equal(got, philox.raw_words(SEED, 0, 37))
    assert sim.calls("cudaLibraryLoadData") == 2 and sim.state().jit_compiles == 1
