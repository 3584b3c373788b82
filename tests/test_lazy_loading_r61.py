"""r61: lazy module loading and the launch-configuration code, as measured on an H100
(driver 580.159.04, libcudart 13.0; tests/conformance/cuda_h100_2026-12-05.json).

Scenario library_bad_images: with the default CUDA_MODULE_LOADING (LAZY since CUDA 12.2)
cudaLibraryLoadData returned 0 for every bad image and cudaLibraryGetKernel reported the problem
(222 for PTX .version 9.9, 500 for PTX without .entry, 200 for PTX without .version, 218 for
PTX .target sm_100 on the cc 9.0 device, 200 for bytes that are no image); cudaGetLastError then
returned the same code and cudaLibraryUnload of such a library returned 0.  EAGER keeps the
simulator's checks at load.  Scenario driver_module_calls_in_capture: cuModuleLoadData of PTX
.target sm_100 returned 218 at load in the same run, so the driver's load JITs PTX at once.
Scenario launch_configurations: a block or grid outside the device's limits is
cudaErrorInvalidValue (1), not cudaErrorInvalidConfiguration (9).

accel must behave the same under both modes: a Module of an image the device cannot run raises
KernelImageError at Module(...) with nothing left loaded; accel.random falls back from a fatbin the
device cannot run to the PTX, and from there to the host path.
"""

import os
import struct
import sys
import warnings

import pytest

np = pytest.importorskip("numpy")

import accel  # noqa: E402
import accel.random as R  # noqa: E402
from accel import _finalize as _fin, _lazy, sim  # noqa: E402
from accel._errors import AcceleratorError, KernelImageError  # noqa: E402
from accel._ffi._cudart import ffi  # noqa: E402
from accel.backends.cuda.driver import DriverKernels  # noqa: E402
from accel.random import _device, philox  # noqa: E402
from accel.sim import _cuda_images, kernels  # noqa: E402
from conftest import use_sim  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import cuda_conformance as conformance  # noqa: E402

_ptx = conformance._ptx
NOP = b"accel_conformance_nop"
SEED = 0x5EED_0061

#: (label, image, cudaLibraryGetKernel's code under lazy loading (measured on the H100),
#:  cudaLibraryLoadData's code under eager loading (the simulator's checks at load))
BAD_IMAGES = [
    ("PTX .version 9.9", _ptx(version="9.9"), 222, 222),
    ("PTX without .entry", _ptx(entry=False), 500, 218),
    ("PTX without .version", _ptx(with_version=False), 200, 218),
    ("PTX .target sm_100", _ptx(version="8.8", target="sm_100"), 218, 218),
    ("bytes that are no image", b"no image at all\n", 200, 218),
]
MODES = [None, "LAZY", "EAGER"]         # None: unset, the runtime's default (LAZY)


def _mode(monkeypatch, mode):
    if mode is None:
        monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    else:
        monkeypatch.setenv("CUDA_MODULE_LOADING", mode)


def _fatbin_only(data: bytes, keep) -> bytes:
    """The fatbin ``data`` with only the entries ``keep(kind, sm)`` accepts."""
    _magic, version, hsize, size = struct.unpack_from("<IHHQ", data, 0)
    out, pos = b"", hsize
    while pos < hsize + size:
        kind, _v, ehsize, payload = struct.unpack_from("<HHIQ", data, pos)
        sm, = struct.unpack_from("<I", data, pos + 28)
        if keep(kind, sm):
            out += data[pos:pos + ehsize + payload]
        pos += ehsize + payload
    return struct.pack("<IHHQ", _cuda_images.FATBIN_MAGIC, version, hsize, len(out)) + out


_SHIPPED_FATBIN = _device._shipped("philox.fatbin")


def _sm120_only() -> bytes:
    """The shipped Philox fatbin with only its sm_120 SASS: nothing a cc 9.0 device can run."""
    return _fatbin_only(_SHIPPED_FATBIN(), lambda kind, sm: kind == _cuda_images.KIND_ELF and sm == 120)


# -- the simulated runtime, call by call ----------------------------------------------------------

@pytest.fixture
def lib():
    sim.reset()
    yield sim.open_library("cudart")
    sim.reset()


def _load(lib, image):
    p = ffi.new("cudaLibrary_t *")
    rc = lib.cudaLibraryLoadData(p, ffi.new("char[]", image), ffi.NULL, ffi.NULL, 0, ffi.NULL, ffi.NULL, 0)
    return rc, p[0]


def _get_kernel(lib, library, name=NOP):
    k = ffi.new("cudaKernel_t *")
    return lib.cudaLibraryGetKernel(k, library, name), k[0]


def _set_device(lib, device):
    assert lib.cudaSetDevice(device) == 0


def _current(lib):
    d = ffi.new("int *")
    assert lib.cudaGetDevice(d) == 0
    return d[0]


@pytest.mark.parametrize("device", [0, 1])
@pytest.mark.parametrize("mode", [None, "LAZY"])
@pytest.mark.parametrize("label,image,lazy_rc,eager_rc", BAD_IMAGES, ids=[i[0] for i in BAD_IMAGES])
def test_lazy_load_accepts_a_bad_image_and_the_kernel_lookup_reports_it(monkeypatch, lib, mode, device,
                                                                        label, image, lazy_rc, eager_rc):
    _mode(monkeypatch, mode)
    _set_device(lib, device)
    before = sim.state().modules
    rc, library = _load(lib, image)
    assert rc == 0, label
    assert lib.cudaGetLastError() == 0
    assert sim.state().modules == before + 1
    assert _get_kernel(lib, library)[0] == lazy_rc
    assert lib.cudaGetLastError() == lazy_rc            # the lookup's error is the thread's last error
    assert lib.cudaGetLastError() == 0
    assert _get_kernel(lib, library)[0] == lazy_rc      # and every lookup reports it again
    lib.cudaGetLastError()
    assert lib.cudaLibraryUnload(library) == 0
    assert sim.state().modules == before
    assert _current(lib) == device


@pytest.mark.parametrize("device", [0, 1])
@pytest.mark.parametrize("label,image,lazy_rc,eager_rc", BAD_IMAGES, ids=[i[0] for i in BAD_IMAGES])
def test_eager_load_refuses_a_bad_image_at_load(monkeypatch, lib, device, label, image, lazy_rc, eager_rc):
    _mode(monkeypatch, "EAGER")
    _set_device(lib, device)
    before = sim.state().modules
    rc, _ = _load(lib, image)
    assert rc == eager_rc, label
    assert lib.cudaGetLastError() == eager_rc
    assert sim.state().modules == before
    assert _current(lib) == device


@pytest.mark.parametrize("mode", MODES)
def test_a_good_image_loads_and_jits_once_in_each_mode(monkeypatch, lib, mode):
    _mode(monkeypatch, mode)
    rc, library = _load(lib, kernels.TEST_PTX)
    assert rc == 0
    # the JIT runs at load (EAGER) or at the first lookup (LAZY), once either way
    assert sim.state().jit_compiles == (1 if mode == "EAGER" else 0)
    rc, k = _get_kernel(lib, library, b"accel_test_fill_u32")
    assert rc == 0
    assert _get_kernel(lib, library, b"accel_test_fill_u32") == (0, k)
    assert _get_kernel(lib, library, b"no_such_kernel")[0] == 500
    lib.cudaGetLastError()
    assert sim.state().jit_compiles == 1
    assert lib.cudaLibraryUnload(library) == 0


@pytest.mark.parametrize("mode,load_rc,lookup_rc", [(None, 0, 209), ("EAGER", 209, None)])
def test_a_fatbin_without_an_image_for_the_device(monkeypatch, lib, mode, load_rc, lookup_rc):
    _mode(monkeypatch, mode)
    _set_device(lib, 1)
    rc, library = _load(lib, _sm120_only())
    assert rc == load_rc
    if lookup_rc is not None:
        assert _get_kernel(lib, library, b"accel_philox_store_state")[0] == lookup_rc
        assert lib.cudaLibraryUnload(library) == 0
    assert sim.state().modules == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("label,image,lazy_rc,eager_rc", BAD_IMAGES, ids=[i[0] for i in BAD_IMAGES])
def test_the_driver_load_checks_at_load_in_every_mode(monkeypatch, lib, mode, label, image, lazy_rc, eager_rc):
    # Measured (scenario driver_module_calls_in_capture): cuModuleLoadData(PTX .target sm_100) is 218
    # at load with the default (lazy) loading; the simulator keeps every driver check at load.
    _mode(monkeypatch, mode)
    assert lib.cudaFree(ffi.NULL) == 0
    drv = DriverKernels(ffi, lib)
    _set_device(lib, 1)
    before = sim.state().modules
    module, rc = drv.load(ffi.new("char[]", image))
    assert rc == eager_rc, label
    assert sim.state().modules == before
    module, rc = drv.load(ffi.new("char[]", kernels.TEST_PTX))
    assert rc == 0
    assert drv.function(module, "accel_test_fill_u32")[1] == 0
    assert drv.unload(module) == 0


_BAD_CONFIGS = [("block 1025", (1, 1, 1), (1025, 1, 1)), ("block (32, 32, 2)", (1, 1, 1), (32, 32, 2)),
                ("grid 0", (0, 1, 1), (32, 1, 1)), ("grid.y 65536", (1, 65536, 1), (32, 1, 1))]


@pytest.mark.parametrize("label,grid,block", _BAD_CONFIGS, ids=[c[0] for c in _BAD_CONFIGS])
def test_a_launch_outside_the_limits_is_an_invalid_value(lib, label, grid, block):
    # Measured (scenario launch_configurations): cudaErrorInvalidValue (1), as cuLaunchKernel's
    # CUDA_ERROR_INVALID_VALUE; not cudaErrorInvalidConfiguration (9).
    _set_device(lib, 1)
    rc, library = _load(lib, kernels.TEST_PTX)
    rc, k = _get_kernel(lib, library, b"accel_test_fill_u32")
    s = ffi.new("cudaStream_t *")
    assert lib.cudaStreamCreateWithFlags(s, 1) == 0
    argv = ffi.new("void *[]", [ffi.cast("void *", ffi.new("uint64_t *", 0))] * 3)
    assert lib.cudaLaunchKernel(ffi.cast("void *", k), ffi.new("dim3 *", grid)[0], ffi.new("dim3 *", block)[0],
                                argv, 0, s[0]) == lib.cudaErrorInvalidValue
    assert lib.cudaGetLastError() == lib.cudaErrorInvalidValue
    drv = DriverKernels(ffi, lib)
    module, _ = drv.load(ffi.new("char[]", kernels.TEST_PTX))
    fn, _ = drv.function(module, "accel_test_fill_u32")
    assert drv.launch(fn, grid, block, argv, 0, int(ffi.cast("uintptr_t", s[0]))) == 1  # CUDA_ERROR_INVALID_VALUE
    assert sim.calls("cudaLaunchKernel") == 1 and sim.calls("cuLaunchKernel") == 1


# -- accel on top: the same behaviour whatever the loading mode -----------------------------------

def _owned():
    return len(_fin.owned)


_MODULE_IMAGES = [
    ("PTX .version 9.9", _ptx(version="9.9"), r"UnsupportedPtxVersion \(222\)", r"UnsupportedPtxVersion \(222\)"),
    ("PTX .target sm_100", _ptx(version="8.8", target="sm_100"), r"InvalidPtx \(218\)", r"InvalidPtx \(218\)"),
    ("PTX without .version", _ptx(with_version=False), r"InvalidKernelImage \(200\)", r"InvalidPtx \(218\)"),
    ("fatbin of sm_120 SASS only", None, r"NoKernelImageForDevice \(209\)", r"NoKernelImageForDevice \(209\)"),
]


@pytest.mark.parametrize("device", [0, 1])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("label,image,lazy_msg,eager_msg", _MODULE_IMAGES, ids=[i[0] for i in _MODULE_IMAGES])
def test_a_module_the_device_cannot_run_raises_at_load_in_both_modes(monkeypatch, mode, device, label, image,
                                                                     lazy_msg, eager_msg):
    _mode(monkeypatch, mode)
    use_sim(monkeypatch, "cuda")
    image = _sm120_only() if image is None else image
    accel.Buffer(16)                         # the runtime started
    owned, before = _owned(), sim.state().modules
    with pytest.raises(KernelImageError, match=eager_msg if mode == "EAGER" else lazy_msg):
        accel.Module(image, device=device)
    assert sim.state().modules == before, "the refused module was left loaded"
    assert _owned() == owned
    assert accel.current_device_index() == 0
    # nothing else changed: a good module still loads and runs on that device
    mod = accel.Module(kernels.TEST_PTX, device=device)
    out = accel.Buffer(16, device=device)
    accel.launch(mod.function("accel_test_fill_u32"), 1, 32, out, 4, 7)
    accel.synchronize(device)
    assert (out.to_numpy("uint32") == 7).all()
    mod.close()
    assert sim.state().modules == before


@pytest.mark.parametrize("mode", MODES)
def test_a_module_of_a_good_image_runs_in_each_mode(monkeypatch, mode):
    _mode(monkeypatch, mode)
    use_sim(monkeypatch, "cuda")
    mod = accel.Module(kernels.TEST_PTX, device=1)
    assert sim.state().modules == 1 and sim.state().jit_compiles == 1
    k = mod.function("accel_test_fill_u32")
    with accel.device_index(1):
        out = accel.Buffer(32)
    accel.launch(k, 1, 32, out, 8, 0xABC)
    accel.synchronize(1)
    assert (out.to_numpy("uint32") == 0xABC).all()
    with pytest.raises(KeyError, match="no kernel named 'nope'"):
        mod.function("nope")
    mod.close()
    assert sim.state().modules == 0


@pytest.mark.parametrize("device", [0, 1])
def test_driver_path_module_whose_function_lookup_fails_is_unloaded(monkeypatch, device):
    # The driver's lazy loading loads a kernel at cuModuleGetFunction (CUDA Programming Guide, "Lazy
    # Loading"): an image error reported there must leave nothing loaded, as one at cuModuleLoadData.
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CUDA_RUNTIME="12.4")
    accel.Buffer(16)
    owned = _owned()
    sim.inject_error("cuModuleGetFunction", 209)
    with pytest.raises(KernelImageError, match=r"CUDA_ERROR_NO_BINARY_FOR_GPU \(209\)"):
        accel.Module(kernels.TEST_PTX, device=device)
    assert sim.state().modules == 0 and _owned() == owned
    assert accel.current_device_index() == 0


def _raw_on(device: int, n: int = 37):
    R.manual_seed_all(SEED)
    with accel.device_index(device):
        buf = accel.Buffer(4 * n)
    R.random_raw_(buf)
    accel.synchronize(device)
    return buf.to_numpy("uint32")


@pytest.mark.parametrize("device", [0, 1])
@pytest.mark.parametrize("mode", MODES)
def test_random_falls_back_from_a_fatbin_the_device_cannot_run_to_the_ptx(monkeypatch, mode, device):
    _mode(monkeypatch, mode)
    use_sim(monkeypatch, "cuda")
    monkeypatch.setitem(_device._BINARIES, "ptx", _sm120_only)
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # no host-path warning: the PTX runs
        got = _raw_on(device)
    assert np.array_equal(got, philox.raw_words(SEED, 0, 37))
    assert accel.current_device_index() == 0
    st = sim.state()
    assert st.modules == 1, "the refused fatbin was left loaded (or the PTX module is missing)"
    assert st.jit_compiles == 1
    assert sim.calls("cudaLaunchKernel") >= 1


@pytest.mark.parametrize("mode", MODES)
def test_random_uses_the_host_path_when_no_image_runs_and_keeps_nothing_loaded(monkeypatch, mode):
    _mode(monkeypatch, mode)
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CC="7.0")     # no sm_7.0 SASS, and the PTX targets sm_75
    with pytest.warns(RuntimeWarning, match=r"host path"):
        got = _raw_on(1)
    assert np.array_equal(got, philox.raw_words(SEED, 0, 37))
    assert sim.state().modules == 0
    assert sim.calls("cudaLaunchKernel") == 0


@pytest.mark.parametrize("label,grid,block", _BAD_CONFIGS, ids=[c[0] for c in _BAD_CONFIGS])
def test_accel_launch_names_the_bad_configuration_before_the_runtime_sees_it(monkeypatch, label, grid, block):
    use_sim(monkeypatch, "cuda")
    mod = accel.Module(kernels.TEST_PTX, device=1)
    k = mod.function("accel_test_fill_u32")
    with accel.device_index(1):
        out = accel.Buffer(16)
    dim = "grid" if "grid" in label else "block"
    with pytest.raises(ValueError, match=rf"launch\(accel_test_fill_u32\): {dim}"):
        accel.launch(k, grid, block, out, 4, 1)
    assert sim.calls("cudaLaunchKernel") == 0
    # the backend itself, given the same configuration, reports the runtime's code
    backend = _lazy.lazy_init()
    with accel.device_index(1):
        with pytest.raises(AcceleratorError, match=r"cudaLaunchKernel failed with cudaErrorInvalidValue \(1\)"):
            backend.launch(k.handle, grid, block, [("ptr", out.ptr), ("u64", 4), ("u32", 1)], 0,
                           accel.current_stream().handle)


@pytest.mark.parametrize("mode", MODES)
def test_random_loads_nothing_from_a_source_without_its_kernels(monkeypatch, mode):
    # A source that defines none of the Philox kernels: no module is loaded (it was loaded and its
    # handle dropped, never unloaded; lazily, nothing would even have read it).
    _mode(monkeypatch, mode)
    use_sim(monkeypatch, "cuda")
    monkeypatch.setitem(_device._SOURCES, "ptx", lambda: kernels.TEST_PTX)
    monkeypatch.delitem(_device._BINARIES, "ptx")
    got = _raw_on(1)
    assert np.array_equal(got, philox.raw_words(SEED, 0, 37))
    assert sim.state().modules == 0
    assert sim.calls("cudaLibraryLoadData") == 0


@pytest.mark.parametrize("outer", [None, "EAGER", "LAZY"])
def test_conformance_scenarios_set_their_loading_mode_and_restore_the_environment(monkeypatch, outer):
    _mode(monkeypatch, outer)
    results = {}
    for name in ("library_bad_images", "library_bad_images_eager", "library_bad_containers",
                 "driver_module_bad_images", "driver_module_bad_images_eager"):
        sim.reset()
        results[name] = conformance.run_one(name, real=False)
        assert "error" not in results[name], results[name]
        assert os.environ.get("CUDA_MODULE_LOADING") == outer
    steps = {name: dict(r["steps"]) for name, r in results.items()}
    # library_bad_images runs with CUDA_MODULE_LOADING unset (lazy) whatever the caller's setting
    assert steps["library_bad_images"]["cudaLibraryLoadData(PTX .target sm_100)"] == 0
    assert steps["library_bad_images"]["cudaLibraryGetKernel(PTX .target sm_100)"] == 218
    assert steps["library_bad_images_eager"]["cudaLibraryLoadData(PTX .target sm_100)"] == 218
    assert steps["library_bad_images_eager"]["cudaLibraryLoadData(fatbin of sm_120 SASS only)"] == 209
    assert steps["library_bad_containers"]["cudaLibraryGetKernel(cubin for sm_120)"] == 209
    for name in ("driver_module_bad_images", "driver_module_bad_images_eager"):
        assert steps[name]["cuModuleLoadData(PTX .target sm_100)"] == 218
        assert steps[name]["cuModuleLoadData(fatbin of sm_120 SASS only)"] == 209
        assert steps[name]["cuModuleGetFunction(PTX .target sm_80)"] == 0
    sim.reset()
