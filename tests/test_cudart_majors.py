"""Per-major libcudart bindings (issue 14 item 2): accel._ffi._cudart (CUDA 13) and
accel._ffi._cudart12 (CUDA 12), chosen with accel._ffi.cudart_module(major).

The layouts are the real ones (generated from each major's headers), so the layout
tests need no library; the simulator writes the layout of its configured runtime's
major into the struct it is handed, as the real library does.
"""

import pytest

import accel
from accel import _ffi as F
from accel import _lazy, sim
from accel._ffi import _cudart as cudart13
from accel._ffi import _cudart12 as cudart12

PROP = "struct cudaDeviceProp"


def test_interface():
    assert F.CUDART_MAJORS == (13, 12)
    assert F.cudart_module(13) is cudart13
    assert F.cudart_module(12) is cudart12
    for bad in (11, 14, "12", 12.0, None):
        with pytest.raises(ValueError, match="supported majors: 13, 12"):
            F.cudart_module(bad)


def test_modules_are_generated_from_their_major():
    assert cudart13.HEADER_VERSIONS["CUDART_VERSION"].startswith("13")
    assert cudart12.HEADER_VERSIONS["CUDART_VERSION"].startswith("12")
    assert cudart13.LIBRARY == cudart12.LIBRARY == "cudart"


def test_layouts_differ_as_expected():
    f13, f12 = cudart13.ffi, cudart12.ffi
    # CUDA 13 removed fields (clockRate, deviceOverlap, ...) ahead of multiProcessorCount.
    assert f12.offsetof(PROP, "multiProcessorCount") != f13.offsetof(PROP, "multiProcessorCount")
    assert f12.offsetof(PROP, "integrated") != f13.offsetof(PROP, "integrated")
    assert f12.sizeof(PROP) != f13.sizeof(PROP)
    names12 = {n for n, _ in f12.typeof(PROP).fields}
    names13 = {n for n, _ in f13.typeof(PROP).fields}
    assert {"clockRate", "deviceOverlap", "kernelExecTimeoutEnabled"} <= names12 - names13
    # the fields accel reads are in both, with the same meaning
    for name in ("name", "uuid", "totalGlobalMem", "major", "minor", "multiProcessorCount",
                 "integrated", "pciBusID", "warpSize", "maxThreadsPerBlock", "l2CacheSize"):
        assert name in names12 and name in names13, name
    # The offsets before the first difference agree (name, uuid, totalGlobalMem)
    for name in ("name", "uuid", "totalGlobalMem"):
        assert f12.offsetof(PROP, name) == f13.offsetof(PROP, name)


def test_12_layout_read_through_the_13_bindings_gives_the_wrong_sm_count():
    """The bug of issue 14: a libcudart.so.12 writes its cudaDeviceProp; reading it
    through the CUDA 13 declarations shows another field as the SM count."""
    f13, f12 = cudart13.ffi, cudart12.ffi
    p12 = f12.new(PROP + " *")
    p12.multiProcessorCount = 132          # an H200
    p12.integrated = 0
    p12.deviceOverlap = 1                  # every device since Fermi reports 1
    p12.clockRate = 1980000
    p12.totalGlobalMem = 141 << 30
    # the 13 struct is smaller: read only its size out of the 12 bytes
    raw = bytes(f12.buffer(p12))[:f13.sizeof(PROP)]
    p13 = f13.new(PROP + " *")
    f13.memmove(p13, raw, len(raw))
    assert p13.totalGlobalMem == 141 << 30       # before the layouts diverge: right
    assert p13.multiProcessorCount != 132        # after: another field
    assert p13.multiProcessorCount == 1          # deviceOverlap, as seen on an H200


def test_renamed_symbols():
    # CUDA 12 headers #define these to their _v2 symbols; CUDA 13 exports the plain names.
    assert cudart12.ALIASES == {"cudaGetDeviceProperties": "cudaGetDeviceProperties_v2",
                                "cudaStreamGetCaptureInfo": "cudaStreamGetCaptureInfo_v2"}
    assert cudart13.ALIASES == {}
    assert "cudaGetDeviceProperties_v2" in cudart12.FUNCTIONS
    assert "cudaGetDeviceProperties" not in cudart12.FUNCTIONS


def test_optional_symbols():
    # 12.4 lacks cudaLibrary* and cudaStreamGetDevice (12.8+) and cudaGetDriverEntryPointByVersion
    # (12.5+): declared from the 12.8 headers, optional.
    opt = {"cudaLibraryLoadData", "cudaLibraryUnload", "cudaLibraryGetKernel", "cudaGetDriverEntryPointByVersion",
           "cudaStreamGetDevice"}
    assert set(cudart12.OPTIONAL_SYMBOLS) == opt
    assert set(cudart12.SPEC_FALLBACK) == opt
    assert opt <= set(cudart12.FUNCTIONS)
    assert set(cudart13.OPTIONAL_SYMBOLS) == {"cudaGetDriverEntryPointByVersion"}


@pytest.fixture
def cuda_sim(monkeypatch):
    monkeypatch.setenv("ACCEL_SIM", "cuda")

    def use(runtime: str, driver: str = "13.0"):
        monkeypatch.setenv("ACCEL_SIM_CUDA_RUNTIME", runtime)
        monkeypatch.setenv("ACCEL_SIM_CUDA_DRIVER", driver)
        _lazy._reset_for_tests()
        sim.reset()
        sim.configure(name="NVIDIA H200", compute_capability="9.0", memory="8G")
    yield use
    _lazy._reset_for_tests()
    sim.reset()


@pytest.mark.parametrize("runtime", ["12.4", "12.8", "13.0"])
def test_properties_read_correctly_on_every_runtime(cuda_sim, runtime):
    cuda_sim(runtime)
    props = accel.get_device_properties(1)
    expect_sm = sim.cudart.devices._attributes(sim.cudart._R, 1)[16]    # cudaDevAttrMultiProcessorCount
    assert props.multi_processor_count == expect_sm > 1
    assert props.unified_memory is False                          # integrated == 0
    assert props.name == "NVIDIA H200"
    assert props.total_memory == 8 << 30
    assert props.compute_capability == (9, 0)
    uuid = sim.core.uuid_bytes(1).hex()
    assert f"GPU-{props.uuid}" == f"GPU-{uuid[0:8]}-{uuid[8:12]}-{uuid[12:16]}-{uuid[16:20]}-{uuid[20:32]}"
    backend = _lazy.lazy_init()
    assert backend.ffi is F.cudart_module(int(runtime.split(".")[0])).ffi


@pytest.mark.parametrize("runtime", ["12.4", "13.0"])
def test_capture_id_on_every_runtime(cuda_sim, runtime):
    cuda_sim(runtime)
    backend = _lazy.lazy_init()
    with accel.device_index(0):
        s = accel.Stream()
    assert backend.capture_id(s.handle) is None


def test_sim_writes_its_own_layout(cuda_sim):
    """The simulated 12.x library writes the CUDA 12 layout whatever the caller declared,
    as the real one does: the wrong bindings read garbage, and a caller's struct smaller
    than the layout (the 13 one) is refused rather than overrun."""
    cuda_sim("12.4")
    lib = sim.open_library("cudart")
    p12 = cudart12.ffi.new(PROP + " *")
    assert lib.cudaGetDeviceProperties_v2(p12, 0) == 0
    assert p12.multiProcessorCount > 1 and p12.deviceOverlap == 1
    p13 = cudart13.ffi.new(PROP + " *")
    assert lib.cudaGetDeviceProperties_v2(p13, 0) == lib.cudaErrorInvalidValue
    assert lib.cudaGetLastError() == lib.cudaErrorInvalidValue
    # the bare 12.x symbol writes the pre-12.0 layout, which accel has no bindings for
    assert lib.cudaGetDeviceProperties(p12, 0) == lib.cudaErrorNotSupported
    cuda_sim("13.0")
    lib = sim.open_library("cudart")
    assert not hasattr(lib, "cudaGetDeviceProperties_v2")
    assert lib.cudaGetDeviceProperties(p13, 0) == 0 and p13.multiProcessorCount > 1


def _declared_arity(module, name):
    import re
    m = re.search(r"\b%s\((.*?)\);" % name, module.CDEF, re.S)
    params = m.group(1).strip()
    return 0 if params in ("", "void") else params.count(",") + 1


@pytest.mark.parametrize("runtime,module", [("12.8", cudart12), ("13.0", cudart13)])
def test_every_function_of_the_major_is_simulated_with_its_arity(cuda_sim, runtime, module):
    cuda_sim(runtime)
    lib = sim.open_library("cudart")
    for name in module.FUNCTIONS:
        assert hasattr(lib, name), name
        assert getattr(lib, name).__code__.co_argcount == _declared_arity(module, name), name


def test_12_4_lacks_exactly_the_optional_functions(cuda_sim):
    cuda_sim("12.4")
    lib = sim.open_library("cudart")
    missing = {n for n in cudart12.FUNCTIONS if not F.has_symbol(lib, n)}
    assert missing == set(cudart12.OPTIONAL_SYMBOLS)


def test_a_runtime_opened_with_another_majors_bindings_is_refused_clearly(cuda_sim):
    """A libcudart.so.12 opened with the CUDA 13 declarations would read cudaDeviceProp
    wrongly: properties() says which versions disagree instead of answering garbage."""
    cuda_sim("12.4")
    backend = _lazy.lazy_init()
    backend.ffi = cudart13.ffi           # what the loader did before per-major bindings
    backend._rt_module = None
    with pytest.raises(accel.AcceleratorError, match=r"CUDA 12\.4 but was opened with the CUDA 13 bindings"):
        backend.properties(0)


def test_properties_cross_check_the_layout_free_attributes(cuda_sim):
    """The fields the layouts shift are checked against cudaDeviceGetAttribute: a struct
    read wrongly is an error naming both values, never a silent 1-SM device."""
    cuda_sim("13.0")
    backend = _lazy.lazy_init()
    real = backend.lib

    class Skewed:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def cudaDeviceGetAttribute(value, attr, device):
            rc = real.cudaDeviceGetAttribute(value, attr, device)
            if attr == 16:                 # cudaDevAttrMultiProcessorCount
                value[0] = 1
            return rc

    backend.lib = Skewed()
    try:
        with pytest.raises(accel.AcceleratorError, match=r"multiProcessorCount \d+ vs 1"):
            backend.properties(0)
    finally:
        backend.lib = real
    assert backend.properties(0).multi_processor_count > 1


def test_pointer_attributes_of_the_13_runtime_need_the_13_struct(cuda_sim):
    """cudaPointerAttributes grew from 24 bytes (CUDA 12) to 88 (CUDA 13): the CUDA 12
    struct handed to a 13 runtime would be overrun; the simulator refuses it."""
    assert cudart12.ffi.sizeof("struct cudaPointerAttributes") < cudart13.ffi.sizeof("struct cudaPointerAttributes")
    cuda_sim("13.0")
    lib = sim.open_library("cudart")
    small = cudart12.ffi.new("struct cudaPointerAttributes *")
    assert lib.cudaPointerGetAttributes(small, cudart12.ffi.NULL) == lib.cudaErrorInvalidValue
    lib.cudaGetLastError()
    big = cudart13.ffi.new("struct cudaPointerAttributes *")
    assert lib.cudaPointerGetAttributes(big, cudart13.ffi.NULL) == 0
    cuda_sim("12.4")
    lib = sim.open_library("cudart")
    assert lib.cudaPointerGetAttributes(small, cudart12.ffi.NULL) == 0
