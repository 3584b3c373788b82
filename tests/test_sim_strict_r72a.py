"""CUDA and Level Zero simulators against the vendor documents, round r72a.

Audited: the cuda*/cu*/ze*/zes* calls accel makes (accel/backends/*.py, accel/backends/xpu/*.py) against
the CUDA Runtime and Driver API references and the Programming Guide ("Multi-Device System"), and
ze_api.h / zes_api.h (v1.4 on this machine) with the Level Zero programming guide.  Leniencies found,
each now refused (accel/sim/README.md, Level Zero "Added in r72"):

* **Property structures with an extension chain** (``pNext``: "[in,out][optional] must be null or a
  pointer to an extension-specific structure (i.e. contains sType and pNext)").  A chained structure
  asks the driver to fill an extension's properties too (ze_device_memory_ext_properties_t,
  ze_device_luid_ext_properties_t, ze_external_memory_export_fd_t on zeMemGetAllocProperties ...).
  The simulator has no extension: it returned success and left the chained structure untouched, so a
  program read its own bytes back as the driver's answer.  Now UNSUPPORTED_FEATURE with nothing written,
  as r68 refused the creation descriptors' chains: zeDriverGetProperties, zeDeviceGetProperties,
  zeDeviceGetComputeProperties, zeDeviceGetModuleProperties, zeDeviceGetMemoryProperties,
  zeDeviceGetCommandQueueGroupProperties, zeMemGetAllocProperties and the zes*GetProperties/GetState calls.
* **ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES_1_2 on a driver older than API 1.2.**  The stype came with 1.2
  and switches timerResolution from nanoseconds to cycles/sec (ze_api.h, ze_device_properties_t); programs
  pick it only when zeDriverGetApiVersion >= ZE_API_VERSION_1_2 (Intel PTI, the Level Zero tutorial:
  "Before to v1.2" the ns field).  The simulator answered in cycles/sec whatever its API version; now
  INVALID_ENUMERATION before 1.2, as IN_ORDER flags before 1.7.  accel's discovery takes the 1.0
  structure there and still works.
* **cudaLibraryLoadData options were ignored.**  "Options are passed as an array via jitOptions ... The
  number of total JIT options is supplied via numJitOptions. Any outputs will be returned via
  jitOptionsValues": the simulator read none and wrote none (a program read its own bytes back as the
  JIT's log or wall time).  A count with a NULL array is now cudaErrorInvalidValue (not described:
  refused), options cudaErrorNotSupported (not simulated), nothing loaded.  accel passes none.
* **Device attributes newer than the driver.**  cudaDeviceGetAttribute / cuDeviceGetAttribute return
  cudaErrorInvalidValue for a value that is no device attribute; the CUDA 12.4 headers end at
  cudaDevAttrHostNumaId = 134 (cudaDevAttrMax = 135), so a 12.4 driver refuses cudaDevAttrGpuPciDeviceId
  (139) and later.  The simulator answered every value up to 147 on every driver.  accel reads only
  attributes every supported driver knows.

Checked and found as documented (no change; tests below pin them):
cudaEventRecord with an event and a stream of different devices (400) and cudaEventElapsedTime of two
devices' events (400), both as the Programming Guide says; cudaStreamWaitEvent on a stream of another
device than the event's succeeds ("will succeed even if the input stream and input event are associated
to different devices") and orders the work; cudaEventElapsedTime of a cudaEventDisableTiming event
or of an event never recorded (400, "cudaErrorInvalidResourceHandle"); cudaMemcpyAsync into a stream
of a device other than the current one succeeds ("A memory copy will succeed even if it is issued to a
stream that is not associated to the current device"); cudaGraphInstantiate flags (README, r62).
"""

import numpy as np
import pytest

import accel
from accel import sim
from accel._ffi._cudart import ffi as cffi
from accel._ffi._ze import ffi

from conftest import use_sim
from test_sim_ze_metal_strict import ze  # noqa: F401 (the fixture)

NULL = ffi.NULL


def _extension(stype: int):
    """An extension structure (stype, pNext, payload), as ze_device_memory_ext_properties_t is laid
    out; the payload is a pattern the driver would overwrite."""
    raw = ffi.new("uint64_t[8]", [0] * 8)
    ffi.cast("uint32_t *", raw)[0] = stype
    for i in range(2, 8):
        raw[i] = 0xA5A5A5A5A5A5A5A5
    return raw


def _untouched(raw) -> bool:
    return all(raw[i] == 0xA5A5A5A5A5A5A5A5 for i in range(2, 8))


# -- pNext chains on property queries --------------------------------------------------------------

def _query(z, name, ext):
    """Call property query ``name`` on device 1 with ``ext`` chained; ``(rc, structure)``."""
    lib, dev = z.lib, z.devices[1]
    if name == "zeDriverGetProperties":
        p = ffi.new("ze_driver_properties_t *", {"stype": lib.ZE_STRUCTURE_TYPE_DRIVER_PROPERTIES, "pNext": ext})
        return lib.zeDriverGetProperties(z.driver, p), p
    if name == "zeDeviceGetProperties":
        p = ffi.new("ze_device_properties_t *", {"stype": lib.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES, "pNext": ext})
        return lib.zeDeviceGetProperties(dev, p), p
    if name == "zeDeviceGetComputeProperties":
        p = ffi.new("ze_device_compute_properties_t *",
                    {"stype": lib.ZE_STRUCTURE_TYPE_DEVICE_COMPUTE_PROPERTIES, "pNext": ext})
        return lib.zeDeviceGetComputeProperties(dev, p), p
    if name == "zeDeviceGetModuleProperties":
        p = ffi.new("ze_device_module_properties_t *",
                    {"stype": lib.ZE_STRUCTURE_TYPE_DEVICE_MODULE_PROPERTIES, "pNext": ext})
        return lib.zeDeviceGetModuleProperties(dev, p), p
    if name == "zeDeviceGetMemoryProperties":
        n = ffi.new("uint32_t *", 1)
        p = ffi.new("ze_device_memory_properties_t[1]", [{"stype": lib.ZE_STRUCTURE_TYPE_DEVICE_MEMORY_PROPERTIES,
                                                          "pNext": ext}])
        return lib.zeDeviceGetMemoryProperties(dev, n, p), p[0]
    if name == "zeDeviceGetCommandQueueGroupProperties":
        n = ffi.new("uint32_t *", 2)
        st = lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_GROUP_PROPERTIES
        p = ffi.new("ze_command_queue_group_properties_t[2]", [{"stype": st, "pNext": ext}, {"stype": st}])
        return lib.zeDeviceGetCommandQueueGroupProperties(dev, n, p), p[0]
    if name == "zeMemGetAllocProperties":
        ptr = z.alloc(256, dev=1)
        p = ffi.new("ze_memory_allocation_properties_t *",
                    {"stype": lib.ZE_STRUCTURE_TYPE_MEMORY_ALLOCATION_PROPERTIES, "pNext": ext})
        h = ffi.new("ze_device_handle_t *")
        return lib.zeMemGetAllocProperties(z.ctx, ptr, p, h), p
    raise AssertionError(name)


_QUERIES = ["zeDriverGetProperties", "zeDeviceGetProperties", "zeDeviceGetComputeProperties",
            "zeDeviceGetModuleProperties", "zeDeviceGetMemoryProperties",
            "zeDeviceGetCommandQueueGroupProperties", "zeMemGetAllocProperties"]


@pytest.mark.parametrize("name", _QUERIES)
def test_property_query_with_an_extension_chain_is_refused(ze, name):
    """ze_api.h, pNext of every property structure: "must be null or a pointer to an
    extension-specific structure".  The simulator fills no extension: UNSUPPORTED_FEATURE, nothing
    written (it answered 0 and left the chained structure as the caller wrote it)."""
    z = ze()
    ext = _extension(z.lib.ZE_STRUCTURE_TYPE_DEVICE_MEMORY_EXT_PROPERTIES)
    rc, _p = _query(z, name, ext)
    assert rc == z.lib.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE
    assert _untouched(ext)


@pytest.mark.parametrize("name", _QUERIES)
def test_property_query_without_a_chain_still_answers(ze, name):
    z = ze()
    rc, _p = _query(z, name, NULL)
    assert rc == 0


def test_device_memory_properties_untouched_when_refused(ze):
    z = ze()
    ext = _extension(z.lib.ZE_STRUCTURE_TYPE_DEVICE_MEMORY_EXT_PROPERTIES)
    rc, p = _query(z, "zeDeviceGetMemoryProperties", ext)
    assert rc == z.lib.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE and p.totalSize == 0


def test_sysman_queries_with_an_extension_chain_are_refused(ze):
    """zes_api.h: the same pNext rule on zes_device_properties_t, zes_mem_state_t, ..."""
    z = ze(init=False)
    lib = z.lib
    assert lib.zesInit(0) == 0
    n = ffi.new("uint32_t *", 1)
    drv = ffi.new("zes_driver_handle_t[1]")
    assert lib.zesDriverGet(n, drv) == 0
    n = ffi.new("uint32_t *", 0)
    assert lib.zesDeviceGet(drv[0], n, NULL) == 0 and n[0] >= 2
    devs = ffi.new("zes_device_handle_t[]", n[0])
    assert lib.zesDeviceGet(drv[0], n, devs) == 0
    card = devs[1]
    ext = _extension(lib.ZE_STRUCTURE_TYPE_DEVICE_MEMORY_EXT_PROPERTIES)
    p = ffi.new("zes_device_properties_t *", {"stype": lib.ZES_STRUCTURE_TYPE_DEVICE_PROPERTIES, "pNext": ext})
    assert lib.zesDeviceGetProperties(card, p) == lib.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE
    p.pNext = NULL
    assert lib.zesDeviceGetProperties(card, p) == 0
    n = ffi.new("uint32_t *", 1)
    mods = ffi.new("zes_mem_handle_t[1]")
    assert lib.zesDeviceEnumMemoryModules(card, n, mods) == 0 and n[0] == 1
    st = ffi.new("zes_mem_state_t *", {"stype": lib.ZES_STRUCTURE_TYPE_MEM_STATE, "pNext": ext})
    assert lib.zesMemoryGetState(mods[0], st) == lib.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE
    assert st.size == 0 and _untouched(ext)
    st.pNext = NULL
    assert lib.zesMemoryGetState(mods[0], st) == 0 and st.size > 0


# -- ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES_1_2 needs a 1.2 driver ------------------------------------------

@pytest.mark.parametrize("api", ["1.0", "1.1"])
def test_device_properties_1_2_before_api_1_2_is_refused(ze, api):
    """ze_api.h, ze_device_properties_t.timerResolution: nanoseconds for DEVICE_PROPERTIES, cycles/sec
    for DEVICE_PROPERTIES_1_2, a structure type of API 1.2.  An older driver knows no such type."""
    z = ze(api_version=api)
    lib = z.lib
    p = ffi.new("ze_device_properties_t *", {"stype": lib.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES_1_2})
    assert lib.zeDeviceGetProperties(z.devices[1], p) == lib.ZE_RESULT_ERROR_INVALID_ENUMERATION
    assert p.timerResolution == 0
    p.stype = lib.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES          # the 1.0 structure: nanoseconds per tick
    assert lib.zeDeviceGetProperties(z.devices[1], p) == 0
    assert p.timerResolution == round(1e9 / sim.ze.ze_config().timer_hz)


def test_device_properties_1_2_from_api_1_2_answers_cycles_per_second(ze):
    z = ze(api_version="1.2")
    lib = z.lib
    p = ffi.new("ze_device_properties_t *", {"stype": lib.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES_1_2})
    assert lib.zeDeviceGetProperties(z.devices[1], p) == 0
    assert p.timerResolution == sim.ze.ze_config().timer_hz


@pytest.mark.parametrize("api", ["1.1", "1.2"])
def test_accel_discovers_and_times_on_a_pre_1_2_driver(monkeypatch, api):
    """accel's discovery asks for the 1.2 structure only from API 1.2 (accel/backends/xpu/discovery.py):
    on a 1.1 driver it reads nanoseconds per tick, and event timing still works on device 1."""
    use_sim(monkeypatch, "xpu", ACCEL_SIM_ZE_API=api)
    try:
        assert accel.device_count() == 2
        props = accel.get_device_properties(1)
        ns = props.extra["timer_ns_per_tick"]
        hz = sim.ze.ze_config().timer_hz
        assert ns == pytest.approx(round(1e9 / hz) if api == "1.1" else 1e9 / hz)
        s = accel.Stream(1)
        start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
        with s:
            b = accel.Buffer(1 << 16, device=1)
            start.record(s)
            b.fill_(3)
            end.record(s)
        end.synchronize()
        assert start.elapsed_time(end) >= 0.0
        assert (b.to_numpy() == 3).all()
        b.close()
        s.close()
    finally:
        sim.reset()


# -- CUDA: the cross-device event and copy rules hold (checked, no change) ---------------------------

@pytest.fixture
def cuda(monkeypatch):
    monkeypatch.setenv("ACCEL_SIM", "cuda")
    sim.reset()
    yield sim.open_library("cudart")
    sim.reset()


def test_cuda_event_rules_across_devices(cuda):
    """Programming Guide, "Multi-Device System" (Stream and Event Behavior): cudaEventRecord fails for an
    event and a stream of different devices, cudaEventElapsedTime for events of two devices;
    cudaStreamWaitEvent succeeds across devices.  Runtime API, cudaEventElapsedTime: an event never
    recorded, or created with cudaEventDisableTiming, is cudaErrorInvalidResourceHandle."""
    from test_sim_cuda import event, ok, stream
    lib = cuda
    ok(lib.cudaSetDevice(1))
    s1, e1, quiet1 = stream(lib), event(lib), event(lib, 2)       # 2: cudaEventDisableTiming
    ok(lib.cudaSetDevice(0))
    s0, e0 = stream(lib), event(lib)
    assert lib.cudaEventRecord(e1, s0) == 400
    assert lib.cudaEventRecord(e0, s1) == 400
    ms = cffi.new("float *")
    assert lib.cudaEventElapsedTime(ms, e1, e1) == 400            # never recorded
    ok(lib.cudaEventRecord(e0, s0))
    ok(lib.cudaEventRecord(e1, s1))
    ok(lib.cudaEventRecord(quiet1, s1))
    ok(lib.cudaStreamWaitEvent(s0, e1, 0))                        # another device's event: allowed
    ok(lib.cudaStreamSynchronize(s0))
    ok(lib.cudaStreamSynchronize(s1))
    assert lib.cudaEventElapsedTime(ms, e0, e1) == 400            # two devices
    assert lib.cudaEventElapsedTime(ms, e1, quiet1) == 400        # timing disabled
    ok(lib.cudaEventElapsedTime(ms, e1, e1))
    assert lib.cudaGetLastError() == 400


def test_cuda_copy_into_a_stream_of_another_device(cuda):
    """Programming Guide, "Multi-Device System": "A memory copy will succeed even if it is issued to a
    stream that is not associated to the current device" (a kernel launch there fails)."""
    from test_sim_cuda import malloc, ok, stream
    lib = cuda
    ok(lib.cudaSetDevice(1))
    s1, d1 = stream(lib), malloc(lib, 256)
    ok(lib.cudaSetDevice(0))
    host = np.arange(256, dtype=np.uint8)
    back = np.zeros(256, dtype=np.uint8)
    hp = cffi.cast("void *", host.ctypes.data)
    bp = cffi.cast("void *", back.ctypes.data)
    ok(lib.cudaMemcpyAsync(d1, hp, 256, 4, s1))                   # cudaMemcpyDefault
    ok(lib.cudaMemcpyAsync(bp, d1, 256, 4, s1))
    ok(lib.cudaStreamSynchronize(s1))
    assert np.array_equal(back, host)


# -- cudaLibraryLoadData options ---------------------------------------------------------------------

def _ptx():
    from accel.sim import kernels
    return cffi.new("char[]", kernels.TEST_PTX)


def test_library_load_with_a_count_and_no_array_is_invalid_value(cuda):
    """cudaLibraryLoadData: the options are "passed as an array via jitOptions ... The number of total
    JIT options is supplied via numJitOptions"; a count with NULL arrays is not described: refused."""
    lib = cuda
    p = cffi.new("cudaLibrary_t *")
    N = cffi.NULL
    assert lib.cudaLibraryLoadData(p, _ptx(), N, N, 2, N, N, 0) == 1
    assert lib.cudaLibraryLoadData(p, _ptx(), N, N, 0, N, N, 1) == 1
    assert p[0] == N
    assert lib.cudaGetLastError() == 1


def test_library_load_with_jit_options_is_not_simulated(cuda):
    """"Any outputs will be returned via jitOptionsValues": the simulated JIT writes no log and no wall
    time; it answered 0 and left the caller's values as they were.  cudaErrorNotSupported, nothing
    loaded."""
    lib = cuda
    p = cffi.new("cudaLibrary_t *")
    opts = cffi.new("enum cudaJitOption[1]", [lib.cudaJitWallTime])
    wall = cffi.new("float *", -1.0)
    vals = cffi.new("void *[1]", [wall])
    assert lib.cudaLibraryLoadData(p, _ptx(), opts, vals, 1, cffi.NULL, cffi.NULL, 0) == 801
    assert p[0] == cffi.NULL
    lopts = cffi.new("enum cudaLibraryOption[1]", [lib.cudaLibraryBinaryIsPreserved])
    lvals = cffi.new("void *[1]", [cffi.cast("void *", 1)])
    assert lib.cudaLibraryLoadData(p, _ptx(), cffi.NULL, cffi.NULL, 0, lopts, lvals, 1) == 801
    assert lib.cudaGetLastError() == 801
    ok_rc = lib.cudaLibraryLoadData(p, _ptx(), cffi.NULL, cffi.NULL, 0, cffi.NULL, cffi.NULL, 0)
    assert ok_rc == 0 and p[0] != cffi.NULL
    assert lib.cudaLibraryUnload(p[0]) == 0


def test_accel_module_loads_without_options(monkeypatch):
    """accel's module_load passes no options (accel/backends/cuda/kernels.py): a module still loads and runs on
    device 1."""
    from accel.sim import kernels
    use_sim(monkeypatch, "cuda")
    try:
        m = accel.Module(kernels.TEST_PTX, device=1)
        assert m.entries
        m.close()
    finally:
        sim.reset()


# -- device attributes newer than the driver -----------------------------------------------------------

GPU_PCI_DEVICE_ID, HOST_NUMA_ID, MEMORY_POOLS_SUPPORTED = 139, 134, 115   # cudaDeviceAttr (13.0 headers)


def _cu_device_get_attribute(lib, rffi):
    """cuDeviceGetAttribute through cudaGetDriverEntryPoint, cast to its PFN type, and cuDeviceGet."""
    from accel._ffi import _cudadrv
    from accel.sim import cuda_driver
    D = _cudadrv.ffi
    fns = {}
    for name in ("cuDeviceGet", "cuDeviceGetAttribute"):
        fp = rffi.new("void **")
        st = rffi.new("enum cudaDriverEntryPointQueryResult *")
        assert lib.cudaGetDriverEntryPoint(name.encode(), fp, 0, st) == 0 and st[0] == 0
        fns[name] = D.cast(cuda_driver.SYMBOLS[name][0], int(rffi.cast("uintptr_t", fp[0])))
    dev = D.new("CUdevice_v1 *")
    assert fns["cuDeviceGet"](dev, 1) == 0
    return fns["cuDeviceGetAttribute"], D, dev[0]


@pytest.mark.parametrize("driver, known", [("12.4", False), ("13.0", True)])
def test_device_attribute_newer_than_the_driver_is_invalid_value(monkeypatch, driver, known):
    """cudaDeviceGetAttribute / cuDeviceGetAttribute: cudaErrorInvalidValue (CUDA_ERROR_INVALID_VALUE) for
    a value that is no device attribute.  The CUDA 12.4 headers end at cudaDevAttrHostNumaId = 134
    (cudaDevAttrMax = 135, accel/_ffi/_cudart12.py); cudaDevAttrGpuPciDeviceId (139) came later, so a 12.4
    driver knows no such attribute.  The simulator answered it on every driver."""
    from accel._ffi import cudart_module
    monkeypatch.setenv("ACCEL_SIM", "cuda")
    sim.reset()
    try:
        sim.configure(runtime_version=driver, driver_version=driver)
        lib = sim.open_library("cudart")
        rffi = cudart_module(int(driver.split(".")[0])).ffi
        v = rffi.new("int *", -7)
        rc = lib.cudaDeviceGetAttribute(v, GPU_PCI_DEVICE_ID, 1)
        assert rc == (0 if known else 1)
        assert (v[0] != -7) == known
        assert lib.cudaGetLastError() == rc
        for attr in (HOST_NUMA_ID, MEMORY_POOLS_SUPPORTED):           # known to both
            assert lib.cudaDeviceGetAttribute(v, attr, 1) == 0
        get, D, dev = _cu_device_get_attribute(lib, rffi)
        pi = D.new("int *")
        assert get(pi, GPU_PCI_DEVICE_ID, dev) == (0 if known else 1)
        assert get(pi, MEMORY_POOLS_SUPPORTED, dev) == 0 and pi[0] == 1
    finally:
        sim.reset()


def test_accel_reads_only_attributes_a_12_4_driver_knows(monkeypatch):
    """accel's CUDA backend reads cudaDevAttrMultiProcessorCount, Integrated, the block and grid limits,
    MemoryPoolsSupported and the VMM attribute: all known to a 12.4 driver, so it starts and allocates
    on device 1 there."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CUDA_DRIVER="12.4", ACCEL_SIM_CUDA_RUNTIME="12.4")
    try:
        assert accel.device_count() == 2
        props = accel.get_device_properties(1)
        assert props.multi_processor_count > 0
        b = accel.Buffer(4096, device=1)
        b.fill_(5)
        assert (b.to_numpy() == 5).all()
        b.close()
    finally:
        sim.reset()
