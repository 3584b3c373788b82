"""The simulated CUDA runtime and NVML, driven the way a backend drives the real
libraries: cdata out-pointers from the generated ffi, integer error codes.

Nothing here is timed.  Asynchrony is made deterministic with a "gate"
kernel that blocks its stream until the test opens the gate; ordering
tests add a per-op delay so a wrong order would show in the data.
"""

import os
import threading

import pytest

from accel import sim
from accel.sim import core, cudart, kernels
from accel._ffi._cudart import ffi
from accel._ffi import _nvml

# -- helpers ----------------------------------------------------------------------------

_gates = {}


def _gate_kernel(grid, block, view, gate):
    assert _gates[gate].wait(30), "test gate never opened"


kernels.register("accel_test_gate", ("u32",), _gate_kernel)
GATE_PTX = b".visible .entry accel_test_gate(\n .param .u32 gate\n)\n{\n ret;\n}\n"


@pytest.fixture
def lib():
    sim.reset()
    yield sim.open_library("cudart")
    for g in _gates.values():
        g.set()
    sim.reset()


@pytest.fixture
def async_lib(lib):
    """A tiny per-op delay sends all work through the stream workers (no inline fast path)."""
    sim.configure(delay_us=1)
    return lib


def ok(rc):
    assert rc == 0, f"{ffi.string(cudart.cudaGetErrorName(rc)).decode()} ({rc})"


def malloc(lib, n):
    p = ffi.new("void **")
    ok(lib.cudaMalloc(p, n))
    return p[0]


def host_alloc(lib, n):
    p = ffi.new("void **")
    ok(lib.cudaHostAlloc(p, n, 0))
    return p[0]


def stream(lib, flags=1, priority=0):
    p = ffi.new("cudaStream_t *")
    ok(lib.cudaStreamCreateWithPriority(p, flags, priority))
    return p[0]


def event(lib, flags=0):
    p = ffi.new("cudaEvent_t *")
    ok(lib.cudaEventCreateWithFlags(p, flags))
    return p[0]


def read(ptr, n):
    return ffi.buffer(ffi.cast("char *", ptr), n)[:]


def write(ptr, data):
    ffi.memmove(ffi.cast("char *", ptr), data, len(data))


def load(lib, ptx):
    if b".version" not in ptx:
        # PTX ISA, "PTX Module Directives": a module starts with .version and .target; the
        # simulated JIT refuses PTX without them (cudaErrorInvalidPtx), as the driver does.
        ptx = b".version 6.3\n.target sm_75\n.address_size 64\n" + ptx
    p = ffi.new("cudaLibrary_t *")
    image = ffi.new("char[]", ptx)
    rc = lib.cudaLibraryLoadData(p, image, ffi.NULL, ffi.NULL, 0, ffi.NULL, ffi.NULL, 0)
    return rc, p[0]


def get_kernel(lib, module, name):
    p = ffi.new("cudaKernel_t *")
    rc = lib.cudaLibraryGetKernel(p, module, name)
    return rc, p[0]


_CT = {"ptr": "void **", "u32": "uint32_t *", "u64": "uint64_t *", "i32": "int32_t *",
       "i64": "int64_t *", "f32": "float *", "f64": "double *"}


def launch(lib, kernel, args, s, grid=(1, 1, 1), block=(32, 1, 1), keep=None):
    values = [ffi.new(_CT[t], v) for t, v in args]
    if keep is not None:
        keep.extend(values)
    argv = ffi.new("void *[]", [ffi.cast("void *", v) for v in values] or [ffi.NULL])
    return lib.cudaLaunchKernel(ffi.cast("void *", kernel), ffi.new("dim3 *", grid)[0],
                                ffi.new("dim3 *", block)[0], argv, 0, s)


def gate(lib, s, name):
    """Block stream ``s`` until the returned threading.Event is set."""
    _gates[name] = g = threading.Event()
    rc, mod = load(lib, GATE_PTX)
    ok(rc)
    rc, k = get_kernel(lib, mod, b"accel_test_gate")
    ok(rc)
    ok(launch(lib, k, [("u32", name)], s))
    return g


NULL_STREAM = ffi.cast("cudaStream_t", 0)


# -- constants, errors, versions ---------------------------------------------------------

def test_error_codes_match_the_generated_header_values(lib):
    for name in dir(cudart):
        if name.startswith("cudaError") or name == "cudaSuccess":
            assert getattr(cudart, name) == getattr(lib, name), name
    assert lib.cudaErrorStreamCaptureUnmatched == 903 and lib.cudaErrorInvalidPtx == 218


def test_error_name_and_string_are_const_char_pointers(lib):
    assert ffi.string(lib.cudaGetErrorName(2)) == b"cudaErrorMemoryAllocation"
    assert ffi.string(lib.cudaGetErrorString(2)) == b"out of memory"
    assert ffi.string(lib.cudaGetErrorName(12345)) == b"unrecognized error code"
    assert ffi.typeof(lib.cudaGetErrorName(0)).kind in ("pointer", "array")


def _declared_arity(module, name):
    import re
    m = re.search(r"\b%s\((.*?)\);" % name, module.CDEF, re.S)
    params = m.group(1).strip()
    return 0 if params in ("", "void") else params.count(",") + 1


@pytest.mark.parametrize("which", ["cudart", "nvml"])
def test_every_generated_function_is_simulated_with_its_arity(which):
    from accel._ffi import _cudart
    module = _cudart if which == "cudart" else _nvml
    simlib = sim.open_library(which)
    for name in module.FUNCTIONS:
        assert hasattr(simlib, name), name
        assert getattr(simlib, name).__code__.co_argcount == _declared_arity(module, name), name


def test_constants_and_missing_symbols(lib):
    assert lib.cudaStreamNonBlocking == 1 and lib.cudaEventDisableTiming == 2
    assert not hasattr(lib, "cudaNoSuchFunction")
    assert hasattr(lib, "cudaMalloc")


def test_versions_and_error_strings_do_not_initialize_the_runtime(lib):
    v = ffi.new("int *")
    ok(lib.cudaRuntimeGetVersion(v))
    assert v[0] == 13000
    ok(lib.cudaDriverGetVersion(v))
    assert v[0] == 13000
    lib.cudaGetErrorString(1)
    lib.cudaGetLastError()
    assert not sim.state().runtime_initialized
    ok(lib.cudaGetDeviceCount(v))   # real CUDA initializes here
    assert v[0] == 2 and sim.state().runtime_initialized


def test_last_error_is_per_thread_and_reset_by_get(lib):
    assert lib.cudaSetDevice(7) == lib.cudaErrorInvalidDevice
    assert lib.cudaPeekAtLastError() == lib.cudaErrorInvalidDevice
    seen = []
    t = threading.Thread(target=lambda: seen.append(lib.cudaGetLastError()))
    t.start()
    t.join()
    assert seen == [0]
    assert lib.cudaGetLastError() == lib.cudaErrorInvalidDevice
    assert lib.cudaGetLastError() == 0


# -- configuration -----------------------------------------------------------------------

def test_environment_configuration(monkeypatch, lib):
    monkeypatch.setenv("ACCEL_SIM_DEVICES", "3")
    monkeypatch.setenv("ACCEL_SIM_MEMORY", "512M")
    monkeypatch.setenv("ACCEL_SIM_CC", "8.6")
    sim.reset()
    lib = sim.open_library("cudart")
    n = ffi.new("int *")
    ok(lib.cudaGetDeviceCount(n))
    assert n[0] == 3
    prop = ffi.new("struct cudaDeviceProp *")
    ok(lib.cudaGetDeviceProperties(prop, 2))
    assert (prop.major, prop.minor, prop.totalGlobalMem) == (8, 6, 512 << 20)


@pytest.mark.parametrize("text, value", [("512M", 512 << 20), ("8G", 8 << 30), ("1.5GiB", 3 << 29),
                                         ("4096", 4096), ("64k", 65536)])
def test_sizes(text, value):
    assert core.parse_size(text) == value


def test_bad_configuration_is_rejected_clearly(monkeypatch, lib):
    with pytest.raises(ValueError, match="ACCEL_SIM_MEMORY"):
        monkeypatch.setenv("ACCEL_SIM_MEMORY", "lots")
        sim.reset()
        sim.config()
    monkeypatch.delenv("ACCEL_SIM_MEMORY")
    with pytest.raises(TypeError, match="unknown setting"):
        sim.configure(gpus=3)
    with pytest.raises(ValueError, match="device count"):
        sim.configure(devices=-1)


def test_no_driver_and_no_device(lib):
    sim.configure(driver=False)
    n = ffi.new("int *", 5)
    assert lib.cudaGetDeviceCount(n) == lib.cudaErrorInsufficientDriver and n[0] == 0
    assert lib.cudaMalloc(ffi.new("void **"), 16) == lib.cudaErrorInsufficientDriver
    v = ffi.new("int *")
    ok(lib.cudaDriverGetVersion(v))
    assert v[0] == 0
    sim.configure(driver=True, devices=0)
    assert lib.cudaGetDeviceCount(n) == lib.cudaErrorNoDevice and n[0] == 0
    assert lib.cudaSetDevice(0) == lib.cudaErrorNoDevice


@pytest.mark.parametrize("value, expected", [
    (None, [0, 1, 2]), ("", []), ("1", [1]), ("2,0", [2, 0]), ("1,0,7,2", [1, 0]),
    ("1gpu2", [1]), ("-1,0", []), ("0,0", []), ("1, 2", [1, 2]), ("GPU-acce1111", [1]),
    ("GPU-acce2222,0", [2]), ("0,GPU-acce1111", [0]), ("GPU-acce", []), ("0,GPU-nope,1", [0]), ("MIG-xyz", []),
])
def test_visible_devices_parsing(value, expected):
    assert cudart.visible_ordinals(value, 3) == expected


def test_runtime_count_honours_visible_devices(monkeypatch, lib):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    n = ffi.new("int *")
    ok(lib.cudaGetDeviceCount(n))
    assert n[0] == 1
    prop = ffi.new("struct cudaDeviceProp *")
    ok(lib.cudaGetDeviceProperties(prop, 0))
    assert bytes(ffi.buffer(prop.uuid.bytes)) == core.uuid_bytes(1)   # physical device 1
    assert lib.cudaGetDeviceProperties(prop, 1) == lib.cudaErrorInvalidDevice


# -- devices -----------------------------------------------------------------------------

def test_current_device_is_per_thread(lib):
    d = ffi.new("int *")
    ok(lib.cudaSetDevice(1))
    ok(lib.cudaGetDevice(d))
    assert d[0] == 1
    seen = []

    def other():
        p = ffi.new("int *")
        lib.cudaGetDevice(p)
        seen.append(p[0])
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [0]
    assert lib.cudaSetDevice(2) == lib.cudaErrorInvalidDevice
    assert lib.cudaSetDevice(-1) == lib.cudaErrorInvalidDevice
    ok(lib.cudaInitDevice(1, 0, 0))
    assert lib.cudaInitDevice(5, 0, 0) == lib.cudaErrorInvalidDevice


def test_device_properties_and_attributes(lib):
    prop = ffi.new("struct cudaDeviceProp *")
    ok(lib.cudaGetDeviceProperties(prop, 1))
    assert ffi.string(prop.name) == b"Accel Simulated GPU"
    assert (prop.major, prop.minor) == (9, 0)
    assert prop.multiProcessorCount == 132 and prop.warpSize == 32 and prop.maxThreadsPerBlock == 1024
    assert prop.totalGlobalMem == 8 << 30
    assert prop.pciBusID == core.pci_bus(1)
    v = ffi.new("int *")
    ok(lib.cudaDeviceGetAttribute(v, lib.cudaDevAttrMultiProcessorCount, 0))
    assert v[0] == 132
    ok(lib.cudaDeviceGetAttribute(v, lib.cudaDevAttrComputeCapabilityMajor, 0))
    assert v[0] == 9
    assert lib.cudaDeviceGetAttribute(v, 9999, 0) == lib.cudaErrorInvalidValue
    buf = ffi.new("char[]", 32)
    ok(lib.cudaDeviceGetPCIBusId(buf, 32, 1))
    assert ffi.string(buf) == b"0000:%02x:00.0" % core.pci_bus(1)
    least, greatest = ffi.new("int *"), ffi.new("int *")
    ok(lib.cudaDeviceGetStreamPriorityRange(least, greatest))
    assert (least[0], greatest[0]) == (0, -5)
    ok(lib.cudaDeviceCanAccessPeer(v, 0, 1))
    assert v[0] == 1


# -- memory ------------------------------------------------------------------------------

def test_malloc_free_and_accounting(lib):
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    ok(lib.cudaMemGetInfo(free, total))
    # The context holds some memory, so free < total with nothing allocated (was free == total).
    reserved = cudart.context_reserved(8 << 30)
    assert total[0] == 8 << 30 and free[0] == total[0] - reserved
    p = malloc(lib, 1000)
    assert int(ffi.cast("uintptr_t", p)) % 256 == 0
    ok(lib.cudaMemGetInfo(free, total))
    assert total[0] - free[0] == reserved + 1024
    st = sim.state()
    assert st.live_allocations == {0: 1} and st.live_bytes == {0: 1024}
    ok(lib.cudaFree(p))
    assert lib.cudaFree(p) == lib.cudaErrorInvalidValue              # double free
    assert lib.cudaFree(ffi.cast("void *", 0x1234)) == lib.cudaErrorInvalidValue
    ok(lib.cudaFree(ffi.NULL))                                        # the classic init idiom
    assert sim.state().live_allocations == {}
    assert sim.calls("cudaMalloc") == 1 and sim.calls("cudaFree") == 4


def test_per_device_memory_limit(lib):
    sim.configure(memory="1M")
    p = malloc(lib, 600 << 10)
    assert lib.cudaMalloc(ffi.new("void **"), 600 << 10) == lib.cudaErrorMemoryAllocation
    ok(lib.cudaSetDevice(1))
    q = malloc(lib, 600 << 10)                 # the other device has its own memory
    ok(lib.cudaFree(q))
    ok(lib.cudaSetDevice(0))
    ok(lib.cudaFree(p))
    # Not all of the 1M: the context holds 1/16 of it (was: the whole 1M could be allocated).
    assert lib.cudaMalloc(ffi.new("void **"), 1 << 20) == lib.cudaErrorMemoryAllocation
    ok(lib.cudaFree(malloc(lib, (1 << 20) - cudart.context_reserved(1 << 20))))


def test_oom_injection_counts_device_and_host_allocations(lib):
    sim.inject_oom(after=2)
    a = malloc(lib, 64)
    h = host_alloc(lib, 64)
    p = ffi.new("void **", ffi.cast("void *", 0x77))
    assert lib.cudaMalloc(p, 64) == lib.cudaErrorMemoryAllocation
    assert p[0] == ffi.cast("void *", 0x77)   # untouched
    b = malloc(lib, 64)                       # only one failure
    for x in (a, b):
        ok(lib.cudaFree(x))
    ok(lib.cudaFreeHost(h))


def test_error_injection(lib):
    sim.inject_error("cudaStreamCreateWithPriority", lib.cudaErrorUnknown, times=2, after=1)
    stream(lib)
    p = ffi.new("cudaStream_t *")
    assert lib.cudaStreamCreateWithPriority(p, 1, 0) == lib.cudaErrorUnknown
    assert lib.cudaStreamCreateWithPriority(p, 1, 0) == lib.cudaErrorUnknown
    assert p[0] == ffi.NULL
    stream(lib)
    sim.inject_error("cudaGetDeviceCount", 35, times=-1)
    n = ffi.new("int *")
    assert lib.cudaGetDeviceCount(n) == 35 and lib.cudaGetDeviceCount(n) == 35
    sim.clear_faults()
    ok(lib.cudaGetDeviceCount(n))
    assert sim.calls("cudaStreamCreateWithPriority") == 4


def test_pinned_memory_and_pointer_attributes(lib):
    d = malloc(lib, 128)
    ok(lib.cudaSetDevice(1))
    d1 = malloc(lib, 128)
    h = host_alloc(lib, 128)
    attr = ffi.new("struct cudaPointerAttributes *")
    ok(lib.cudaPointerGetAttributes(attr, d))
    assert attr.type == lib.cudaMemoryTypeDevice and attr.device == 0 and attr.devicePointer == d
    ok(lib.cudaPointerGetAttributes(attr, ffi.cast("char *", d1) + 10))
    assert attr.type == lib.cudaMemoryTypeDevice and attr.device == 1
    ok(lib.cudaPointerGetAttributes(attr, h))
    assert attr.type == lib.cudaMemoryTypeHost and attr.hostPointer == h
    plain = ffi.new("char[]", 8)
    ok(lib.cudaPointerGetAttributes(attr, plain))
    assert attr.type == lib.cudaMemoryTypeUnregistered
    assert lib.cudaFree(h) == lib.cudaErrorInvalidValue       # pinned memory is not cudaFree'd
    assert lib.cudaFreeHost(d) == lib.cudaErrorInvalidValue
    ok(lib.cudaFreeHost(h))
    assert sim.state().host_allocations == 0
    assert sim.state().live_allocations == {0: 1, 1: 1}


def test_concurrent_malloc_free_is_thread_safe(lib):
    errors = []

    def work():
        for _ in range(50):
            p = ffi.new("void **")
            rc = lib.cudaMalloc(p, 4096)
            rc2 = lib.cudaFree(p[0]) if rc == 0 else rc
            if rc or rc2:
                errors.append((rc, rc2))
    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sim.calls("cudaMalloc") == sim.calls("cudaFree") == 400
    assert sim.state().live_allocations == {}


# -- copies ------------------------------------------------------------------------------

def test_copies_round_trip(lib):
    s = stream(lib)
    d1, d2 = malloc(lib, 64), malloc(lib, 64)
    src = bytes(range(64))
    ok(lib.cudaMemcpyAsync(d1, src, 64, lib.cudaMemcpyHostToDevice, s))
    ok(lib.cudaMemcpyAsync(d2, d1, 64, lib.cudaMemcpyDeviceToDevice, s))
    out = bytearray(64)
    ok(lib.cudaMemcpyAsync(ffi.from_buffer(out), d2, 64, lib.cudaMemcpyDefault, s))
    assert bytes(out) == src           # a copy into pageable memory returns when done
    ok(lib.cudaMemsetAsync(ffi.cast("char *", d1) + 8, 0xAB, 8, s))
    h = host_alloc(lib, 64)
    ok(lib.cudaMemcpy(h, d1, 64, lib.cudaMemcpyDeviceToHost))
    assert read(h, 64) == src[:8] + b"\xab" * 8 + src[16:]


def test_copy_validation(lib):
    d = malloc(lib, 64)
    h = host_alloc(lib, 64)
    ok(lib.cudaMemset(d, 0, 64))
    write(h, b"\x01" * 64)
    # runs 32 bytes past the end of the allocation: refused, nothing copied
    assert lib.cudaMemcpy(ffi.cast("char *", d) + 32, h, 64, lib.cudaMemcpyHostToDevice) \
        == lib.cudaErrorInvalidValue
    assert lib.cudaMemcpyAsync(h, ffi.cast("char *", d) + 1, 64, lib.cudaMemcpyDeviceToHost, NULL_STREAM) \
        == lib.cudaErrorInvalidValue
    ok(lib.cudaDeviceSynchronize())
    assert kernels.read(d, 64) == bytes(64) and read(h, 64) == b"\x01" * 64
    assert lib.cudaMemcpy(d, h, 8, 7) == lib.cudaErrorInvalidMemcpyDirection
    plain = ffi.new("char[]", 8)
    assert lib.cudaMemcpy(plain, plain, 8, lib.cudaMemcpyDeviceToDevice) == lib.cudaErrorInvalidValue
    assert lib.cudaMemsetAsync(ffi.cast("char *", d) + 60, 0, 8, NULL_STREAM) == lib.cudaErrorInvalidValue
    ok(lib.cudaMemcpy(d, h, 0, lib.cudaMemcpyHostToDevice))


def test_pageable_source_is_staged_at_call_time(async_lib):
    lib = async_lib
    s = stream(lib)
    d = malloc(lib, 16)
    g = gate(lib, s, 1)
    src = bytearray(b"A" * 16)
    ok(lib.cudaMemcpyAsync(d, ffi.from_buffer(src), 16, lib.cudaMemcpyHostToDevice, s))
    assert lib.cudaStreamQuery(s) == lib.cudaErrorNotReady
    src[:] = b"B" * 16                    # the caller may reuse its buffer at once
    g.set()
    ok(lib.cudaStreamSynchronize(s))
    assert kernels.read(d, 16) == b"A" * 16


def test_pinned_source_is_read_when_the_copy_runs(async_lib):
    lib = async_lib
    s = stream(lib)
    d, h = malloc(lib, 16), host_alloc(lib, 16)
    write(h, b"A" * 16)
    g = gate(lib, s, 2)
    ok(lib.cudaMemcpyAsync(d, h, 16, lib.cudaMemcpyHostToDevice, s))
    write(h, b"B" * 16)                   # pinned memory is not staged: the copy sees this
    g.set()
    ok(lib.cudaStreamSynchronize(s))
    assert kernels.read(d, 16) == b"B" * 16


# -- streams and events -----------------------------------------------------------------

def test_stream_lifecycle_and_destroyed_handles(lib):
    s = stream(lib, priority=-9)
    d = malloc(lib, 8)
    ok(lib.cudaStreamQuery(s))
    ok(lib.cudaStreamDestroy(s))
    for rc in (lib.cudaStreamQuery(s), lib.cudaStreamSynchronize(s), lib.cudaStreamDestroy(s),
               lib.cudaMemsetAsync(d, 0, 8, s), lib.cudaEventRecord(event(lib), s)):
        assert rc == lib.cudaErrorInvalidResourceHandle
    assert lib.cudaStreamCreateWithPriority(ffi.new("cudaStream_t *"), 8, 0) == lib.cudaErrorInvalidValue
    assert lib.cudaStreamDestroy(NULL_STREAM) == lib.cudaErrorInvalidResourceHandle
    ok(lib.cudaStreamSynchronize(NULL_STREAM))
    ok(lib.cudaStreamSynchronize(ffi.cast("cudaStream_t", 1)))   # cudaStreamLegacy
    ok(lib.cudaStreamSynchronize(ffi.cast("cudaStream_t", 2)))   # cudaStreamPerThread
    assert sim.state().streams == 0


def test_query_is_not_ready_while_work_is_pending(async_lib):
    lib = async_lib
    s = stream(lib)
    g = gate(lib, s, 3)
    assert lib.cudaStreamQuery(s) == lib.cudaErrorNotReady
    assert lib.cudaGetLastError() == 0            # NotReady is not an error
    g.set()
    ok(lib.cudaStreamSynchronize(s))
    ok(lib.cudaStreamQuery(s))


def test_destroying_a_busy_stream_lets_its_work_finish(async_lib):
    lib = async_lib
    s = stream(lib)
    d = malloc(lib, 8)
    g = gate(lib, s, 4)
    ok(lib.cudaMemsetAsync(d, 7, 8, s))
    ok(lib.cudaStreamDestroy(s))
    g.set()
    ok(lib.cudaDeviceSynchronize())
    assert kernels.read(d, 8) == b"\x07" * 8


def test_stream_order_holds_under_delay(lib):
    sim.configure(delay_us=2000)
    s = stream(lib)
    d = malloc(lib, 4)
    out = bytearray(4)
    for i in range(1, 6):
        ok(lib.cudaMemsetAsync(d, i, 4, s))
    ok(lib.cudaMemcpyAsync(ffi.from_buffer(out), d, 4, lib.cudaMemcpyDeviceToHost, s))
    assert bytes(out) == b"\x05" * 4


def test_event_wait_orders_streams_under_delay(lib):
    sim.configure(delay_us=3000)
    a, b = stream(lib), stream(lib)
    x, y = malloc(lib, 4), malloc(lib, 4)
    e = event(lib, lib.cudaEventDisableTiming)
    ok(lib.cudaMemsetAsync(x, 1, 4, a))
    ok(lib.cudaEventRecord(e, a))
    ok(lib.cudaStreamWaitEvent(b, e, 0))
    ok(lib.cudaMemcpyAsync(y, x, 4, lib.cudaMemcpyDeviceToDevice, b))
    ok(lib.cudaStreamSynchronize(b))
    assert kernels.read(y, 4) == b"\x01" * 4


def test_legacy_stream_synchronizes_with_blocking_streams_only(async_lib):
    lib = async_lib
    blocking, nonblocking = stream(lib, flags=0), stream(lib, flags=1)
    d = malloc(lib, 8)
    g = gate(lib, NULL_STREAM, 5)
    ok(lib.cudaMemsetAsync(d, 1, 4, nonblocking))
    ok(lib.cudaMemsetAsync(d, 2, 4, blocking))
    ok(lib.cudaStreamSynchronize(nonblocking))       # does not wait for the legacy stream
    assert lib.cudaStreamQuery(blocking) == lib.cudaErrorNotReady
    g.set()
    ok(lib.cudaStreamSynchronize(blocking))
    # and the legacy stream waits for earlier blocking-stream work (and its query sees it)
    g2 = gate(lib, blocking, 6)
    assert lib.cudaStreamQuery(NULL_STREAM) == lib.cudaErrorNotReady
    ok(lib.cudaMemsetAsync(d, 3, 4, NULL_STREAM))
    assert lib.cudaStreamQuery(NULL_STREAM) == lib.cudaErrorNotReady
    g2.set()
    ok(lib.cudaDeviceSynchronize())
    assert kernels.read(d, 4) == b"\x03" * 4


def test_wait_uses_the_record_current_at_wait_time(async_lib):
    lib = async_lib
    a, b, c = stream(lib), stream(lib), stream(lib)
    e = event(lib)
    g = gate(lib, a, 7)
    ok(lib.cudaEventRecord(e, a))
    assert lib.cudaEventQuery(e) == lib.cudaErrorNotReady
    ok(lib.cudaStreamWaitEvent(b, e, 0))
    ok(lib.cudaEventRecord(e, c))                    # re-record on an idle stream
    ok(lib.cudaEventSynchronize(e))
    assert lib.cudaStreamQuery(b) == lib.cudaErrorNotReady   # still waits for the first record
    g.set()
    ok(lib.cudaStreamSynchronize(b))


def test_event_and_stream_must_share_a_device(lib):
    e = event(lib)
    ok(lib.cudaSetDevice(1))
    s1 = stream(lib)
    assert lib.cudaEventRecord(e, s1) == lib.cudaErrorInvalidResourceHandle
    ok(lib.cudaStreamWaitEvent(s1, e, 0))          # waits may cross devices
    ok(lib.cudaSetDevice(0))
    ok(lib.cudaEventRecord(e, NULL_STREAM))
    ok(lib.cudaStreamWaitEvent(s1, e, 0))
    ok(lib.cudaStreamSynchronize(s1))


def test_elapsed_time_rules(async_lib):
    lib = async_lib
    s = stream(lib)
    start, end, untimed, fresh = event(lib), event(lib), event(lib, lib.cudaEventDisableTiming), event(lib)
    ms = ffi.new("float *")
    assert lib.cudaEventElapsedTime(ms, start, fresh) == lib.cudaErrorInvalidResourceHandle  # never recorded
    ok(lib.cudaEventQuery(fresh))                                                          # ... but complete
    ok(lib.cudaEventRecord(start, s))
    ok(lib.cudaEventRecord(untimed, s))
    assert lib.cudaEventElapsedTime(ms, start, untimed) == lib.cudaErrorInvalidResourceHandle
    g = gate(lib, s, 8)
    ok(lib.cudaEventRecord(end, s))
    assert lib.cudaEventElapsedTime(ms, start, end) == lib.cudaErrorNotReady
    g.set()
    ok(lib.cudaEventSynchronize(end))
    ok(lib.cudaEventElapsedTime(ms, start, end))
    assert ms[0] >= 0.0
    ok(lib.cudaEventDestroy(end))
    assert lib.cudaEventQuery(end) == lib.cudaErrorInvalidResourceHandle
    assert lib.cudaEventCreateWithFlags(ffi.new("cudaEvent_t *"), lib.cudaEventInterprocess) \
        == lib.cudaErrorInvalidValue


def test_reset_with_queued_work_returns(lib):
    sim.configure(delay_us=50_000)
    s = stream(lib)
    d = malloc(lib, 8)
    for _ in range(20):
        ok(lib.cudaMemsetAsync(d, 1, 8, s))
    sim.reset()               # abandons the queue; must not wait a second per op
    assert not sim.state().runtime_initialized


# -- kernels -------------------------------------------------------------------------------

def test_module_load_and_kernel_lookup(lib, monkeypatch):
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")     # checked at load
    assert load(lib, b"// no entries here\n.version 8.0\n")[0] == lib.cudaErrorInvalidPtx
    # lazily (the default; tests/test_lazy_loading_r61.py): at the first lookup, as an H100
    monkeypatch.delenv("CUDA_MODULE_LOADING")
    rc, mod = load(lib, kernels.TEST_PTX)
    ok(rc)
    assert get_kernel(lib, mod, b"missing")[0] == lib.cudaErrorSymbolNotFound
    rc, k = get_kernel(lib, mod, b"accel_test_fill_u32")
    ok(rc)
    assert get_kernel(lib, mod, b"accel_test_fill_u32")[1] == k
    assert cudart.ptx_entries(b".entry a(\n.visible .entry b_2(") == ["a", "b_2"]
    ok(lib.cudaLibraryUnload(mod))
    assert lib.cudaLibraryUnload(mod) == lib.cudaErrorInvalidResourceHandle


def test_kernel_launch_decodes_arguments(lib):
    import numpy as np
    rc, mod = load(lib, kernels.TEST_PTX)
    rc, k = get_kernel(lib, mod, b"accel_test_fill_u32")
    d = malloc(lib, 40)
    s = stream(lib)
    ok(launch(lib, k, [("ptr", d), ("u64", 8), ("u32", 0xDEADBEEF)], s, grid=(1, 1, 1), block=(256, 1, 1)))
    ok(lib.cudaStreamSynchronize(s))
    assert list(kernels.view(d, 32, np.uint32)) == [0xDEADBEEF] * 8
    # an H100's code (tests/conformance/cuda_h100_2026-12-05.json, scenario launch_configurations)
    assert launch(lib, k, [], s, block=(2048, 1, 1)) == lib.cudaErrorInvalidValue
    assert launch(lib, ffi.cast("void *", 0x999), [], s) == lib.cudaErrorInvalidDeviceFunction


def test_unregistered_kernel_name_fails_at_launch(lib):
    rc, mod = load(lib, b".visible .entry nobody_registered_this(\n)\n{ ret; }")
    ok(rc)
    rc, k = get_kernel(lib, mod, b"nobody_registered_this")
    ok(rc)
    assert launch(lib, k, [], NULL_STREAM) == lib.cudaErrorInvalidDeviceFunction


def test_kernel_fault_is_a_sticky_device_error(lib, capsys):
    kernels.register("accel_test_boom", ("ptr",), lambda g, b, view, p: view(p, 1 << 20)[0], replace=True)
    try:
        rc, mod = load(lib, b".visible .entry accel_test_boom(.param .u64 p) { ret; }")
        rc, k = get_kernel(lib, mod, b"accel_test_boom")
        d = malloc(lib, 16)
        ok(launch(lib, k, [("ptr", d)], NULL_STREAM))
        assert lib.cudaDeviceSynchronize() == lib.cudaErrorIllegalAddress
        assert lib.cudaStreamQuery(NULL_STREAM) == lib.cudaErrorIllegalAddress
        assert "past the end" in sim.state().errors[0][1]
        # Sticky for the whole process (was: only for the faulting device, which real CUDA is not;
        # see test_sim_cuda_strict.py::test_a_device_fault_is_sticky_for_every_later_call_in_the_process).
        assert lib.cudaSetDevice(1) == lib.cudaErrorIllegalAddress
    finally:
        kernels.unregister("accel_test_boom")
    assert "accel.sim: device fault" in capsys.readouterr().err


# -- capture and graphs -----------------------------------------------------------------------

def capture(lib, s, mode=0):
    ok(lib.cudaStreamBeginCapture(s, mode))


def end_capture(lib, s):
    g = ffi.new("cudaGraph_t *", ffi.cast("cudaGraph_t", 0x55))
    rc = lib.cudaStreamEndCapture(s, g)
    return rc, g[0]


def status(lib, s):
    st = ffi.new("enum cudaStreamCaptureStatus *")
    ok(lib.cudaStreamIsCapturing(s, st))
    return st[0]


def test_graph_replays_captured_work_with_original_arguments(lib):
    import numpy as np
    rc, mod = load(lib, kernels.TEST_PTX)
    rc, k = get_kernel(lib, mod, b"accel_test_fill_u32")
    s = stream(lib)
    d, d2 = malloc(lib, 16), malloc(lib, 16)
    ok(lib.cudaMemset(d, 0, 16))
    keep = []
    capture(lib, s)
    assert status(lib, s) == lib.cudaStreamCaptureStatusActive
    ok(launch(lib, k, [("ptr", d), ("u64", 4), ("u32", 7)], s, keep=keep))
    ok(lib.cudaMemcpyAsync(d2, d, 16, lib.cudaMemcpyDeviceToDevice, s))
    assert kernels.read(d, 16) == bytes(16)          # captured, not executed
    keep[0][0] = ffi.cast("void *", d2)               # later changes to the arg buffers ...
    keep[2][0] = 9                                    # ... do not affect the graph
    rc, graph = end_capture(lib, s)
    ok(rc)
    assert status(lib, s) == lib.cudaStreamCaptureStatusNone
    exec_ = ffi.new("cudaGraphExec_t *")
    ok(lib.cudaGraphInstantiate(exec_, graph, 0))
    for _ in range(2):
        ok(lib.cudaGraphLaunch(exec_[0], s))
    ok(lib.cudaStreamSynchronize(s))
    assert list(kernels.view(d2, 16, np.uint32)) == [7] * 4
    ok(lib.cudaGraphExecDestroy(exec_[0]))
    ok(lib.cudaGraphDestroy(graph))
    assert lib.cudaGraphLaunch(exec_[0], s) == lib.cudaErrorInvalidResourceHandle
    assert lib.cudaGraphDestroy(graph) == lib.cudaErrorInvalidResourceHandle


def test_sync_during_capture_invalidates_it(lib):
    s = stream(lib)
    d = malloc(lib, 64)
    capture(lib, s)
    assert lib.cudaStreamSynchronize(s) == lib.cudaErrorStreamCaptureUnsupported
    assert status(lib, s) == lib.cudaStreamCaptureStatusInvalidated
    assert lib.cudaMemsetAsync(d, 0, 4, s) == lib.cudaErrorStreamCaptureInvalidated
    rc, graph = end_capture(lib, s)
    assert rc == lib.cudaErrorStreamCaptureInvalidated and graph == ffi.NULL
    ok(lib.cudaStreamSynchronize(s))         # out of capture mode again
    for call in (lambda: lib.cudaStreamQuery(s), lambda: lib.cudaDeviceSynchronize()):
        capture(lib, s)
        assert call() == lib.cudaErrorStreamCaptureUnsupported
        assert end_capture(lib, s)[0] == lib.cudaErrorStreamCaptureInvalidated


def test_capture_rules_for_the_legacy_stream(lib):
    assert lib.cudaStreamBeginCapture(NULL_STREAM, 0) == lib.cudaErrorStreamCaptureUnsupported
    d = malloc(lib, 64)
    blocking, nonblocking = stream(lib, flags=0), stream(lib, flags=1)
    capture(lib, nonblocking)
    ok(lib.cudaMemsetAsync(d, 0, 4, NULL_STREAM))       # fine: a non-blocking stream captures
    ok(end_capture(lib, nonblocking)[0])
    capture(lib, blocking)
    assert lib.cudaMemsetAsync(d, 0, 4, NULL_STREAM) == lib.cudaErrorStreamCaptureImplicit
    # A synchronous copy is a "potentially unsafe" call, refused first during a global capture
    # (900); in relaxed mode it is allowed, but the legacy stream still conflicts (906).
    assert lib.cudaMemcpy(d + 32, d, 4, lib.cudaMemcpyDeviceToDevice) == lib.cudaErrorStreamCaptureUnsupported
    mode = ffi.new("enum cudaStreamCaptureMode *", lib.cudaStreamCaptureModeRelaxed)
    ok(lib.cudaThreadExchangeStreamCaptureMode(mode))
    assert lib.cudaMemcpy(d + 32, d, 4, lib.cudaMemcpyDeviceToDevice) == lib.cudaErrorStreamCaptureImplicit
    ok(lib.cudaThreadExchangeStreamCaptureMode(mode))
    assert end_capture(lib, blocking)[0] == lib.cudaErrorStreamCaptureInvalidated


def test_malloc_during_capture_depends_on_the_mode(lib):
    s = stream(lib)
    p = ffi.new("void **")
    capture(lib, s, lib.cudaStreamCaptureModeGlobal)
    assert lib.cudaMalloc(p, 16) == lib.cudaErrorStreamCaptureUnsupported
    assert end_capture(lib, s)[0] == lib.cudaErrorStreamCaptureInvalidated
    capture(lib, s, lib.cudaStreamCaptureModeRelaxed)
    ok(lib.cudaMalloc(p, 16))
    ok(lib.cudaFree(p[0]))
    ok(end_capture(lib, s)[0])
    # the thread's own mode can relax a global capture, push/pop style
    capture(lib, s, lib.cudaStreamCaptureModeGlobal)
    mode = ffi.new("enum cudaStreamCaptureMode *", lib.cudaStreamCaptureModeRelaxed)
    ok(lib.cudaThreadExchangeStreamCaptureMode(mode))
    assert mode[0] == lib.cudaStreamCaptureModeGlobal
    ok(lib.cudaMalloc(p, 16))
    ok(lib.cudaThreadExchangeStreamCaptureMode(mode))
    assert mode[0] == lib.cudaStreamCaptureModeRelaxed
    ok(end_capture(lib, s)[0])
    ok(lib.cudaFree(p[0]))


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_capture_modes_across_threads(lib):
    s = stream(lib)
    p = ffi.new("void **")
    capture(lib, s, lib.cudaStreamCaptureModeThreadLocal)
    assert _in_thread(lambda: lib.cudaMalloc(p, 16)) == 0          # other threads unaffected
    assert lib.cudaFree(p[0]) == lib.cudaErrorStreamCaptureUnsupported   # ... this one is not
    assert end_capture(lib, s)[0] == lib.cudaErrorStreamCaptureInvalidated
    ok(lib.cudaFree(p[0]))
    capture(lib, s, lib.cudaStreamCaptureModeGlobal)
    assert _in_thread(lambda: lib.cudaMalloc(p, 16)) == lib.cudaErrorStreamCaptureUnsupported
    assert end_capture(lib, s)[0] == lib.cudaErrorStreamCaptureInvalidated
    capture(lib, s, lib.cudaStreamCaptureModeGlobal)
    assert _in_thread(lambda: end_capture(lib, s)[0]) == lib.cudaErrorStreamCaptureWrongThread
    # ... and that ended it, as on an H200 (tests/test_sim_cuda_conformance.py)
    assert end_capture(lib, s)[0] == lib.cudaErrorIllegalState


def test_multi_stream_capture_fork_and_join(lib, tmp_path):
    s1, s2 = stream(lib), stream(lib)
    fork, join = event(lib), event(lib)
    d = malloc(lib, 8)
    capture(lib, s1)
    ok(lib.cudaMemsetAsync(d, 1, 4, s1))
    ok(lib.cudaEventRecord(fork, s1))
    assert lib.cudaEventQuery(fork) == lib.cudaErrorCapturedEvent
    capture_rc_after = status(lib, s1)
    assert capture_rc_after == lib.cudaStreamCaptureStatusInvalidated
    assert end_capture(lib, s1)[0] == lib.cudaErrorStreamCaptureInvalidated

    capture(lib, s1)
    ok(lib.cudaMemsetAsync(d, 1, 4, s1))
    ok(lib.cudaEventRecord(fork, s1))
    ok(lib.cudaStreamWaitEvent(s2, fork, 0))             # s2 joins the capture
    assert status(lib, s2) == lib.cudaStreamCaptureStatusActive
    ok(lib.cudaMemsetAsync(ffi.cast("char *", d) + 4, 2, 4, s2))
    ok(lib.cudaEventRecord(join, s2))
    ok(lib.cudaStreamWaitEvent(s1, join, 0))
    rc, graph = end_capture(lib, s1)
    ok(rc)
    assert status(lib, s2) == lib.cudaStreamCaptureStatusNone
    path = tmp_path / "g.dot"
    ok(lib.cudaGraphDebugDotPrint(graph, str(path).encode(), 1))
    dot = path.read_text()
    assert dot.startswith("digraph") and dot.count("MEMSET") == 2 and "->" in dot
    exec_ = ffi.new("cudaGraphExec_t *")
    ok(lib.cudaGraphInstantiate(exec_, graph, 0))
    ok(lib.cudaGraphLaunch(exec_[0], NULL_STREAM))
    ok(lib.cudaDeviceSynchronize())
    assert kernels.read(d, 8) == b"\x01" * 4 + b"\x02" * 4


def test_unjoined_fork_and_isolation_errors(lib):
    s1, s2, s3 = stream(lib), stream(lib), stream(lib)
    fork, outside = event(lib), event(lib)
    d = malloc(lib, 8)
    capture(lib, s1)
    ok(lib.cudaEventRecord(fork, s1))
    ok(lib.cudaStreamWaitEvent(s2, fork, 0))
    ok(lib.cudaMemsetAsync(d, 1, 4, s2))
    assert end_capture(lib, s2)[0] == lib.cudaErrorStreamCaptureUnmatched
    assert end_capture(lib, s1)[0] == lib.cudaErrorStreamCaptureInvalidated
    capture(lib, s1)
    ok(lib.cudaEventRecord(fork, s1))
    ok(lib.cudaStreamWaitEvent(s2, fork, 0))
    ok(lib.cudaMemsetAsync(d, 1, 4, s2))
    assert end_capture(lib, s1)[0] == lib.cudaErrorStreamCaptureUnjoined
    # waiting on work recorded outside the capture crosses the boundary
    ok(lib.cudaEventRecord(outside, s3))
    capture(lib, s1)
    assert lib.cudaStreamWaitEvent(s1, outside, 0) == lib.cudaErrorStreamCaptureIsolation
    assert end_capture(lib, s1)[0] == lib.cudaErrorStreamCaptureInvalidated
    capture(lib, s1)
    ok(lib.cudaStreamWaitEvent(s1, outside, 1))        # cudaEventWaitExternal
    ok(end_capture(lib, s1)[0])
    assert end_capture(lib, s1)[0] == lib.cudaErrorIllegalState


def test_capture_info(lib):
    s = stream(lib)
    st, cid = ffi.new("enum cudaStreamCaptureStatus *"), ffi.new("unsigned long long *")
    n = ffi.new("size_t *")
    d = malloc(lib, 4)
    ok(lib.cudaStreamGetCaptureInfo(s, st, cid, ffi.NULL, ffi.NULL, ffi.NULL, n))
    assert st[0] == 0
    capture(lib, s)
    ok(lib.cudaMemsetAsync(d, 0, 4, s))
    ok(lib.cudaStreamGetCaptureInfo(s, st, cid, ffi.NULL, ffi.NULL, ffi.NULL, n))
    assert st[0] == 1 and cid[0] >= 1 and n[0] == 1
    ok(end_capture(lib, s)[0])


# -- NVML --------------------------------------------------------------------------------------

@pytest.fixture
def nvml():
    sim.reset()
    yield sim.open_library("nvml")
    sim.reset()


def test_nvml_lists_physical_devices_without_runtime_init(monkeypatch, nvml):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    f = _nvml.ffi
    n = f.new("unsigned int *")
    assert nvml.nvmlDeviceGetCount_v2(n) == nvml.NVML_ERROR_UNINITIALIZED
    assert nvml.nvmlInit_v2() == nvml.NVML_SUCCESS
    assert nvml.nvmlDeviceGetCount_v2(n) == 0 and n[0] == 2
    h = f.new("nvmlDevice_t *")
    assert nvml.nvmlDeviceGetHandleByIndex_v2(1, h) == 0
    buf = f.new("char[]", 96)
    assert nvml.nvmlDeviceGetUUID(h[0], buf, 96) == 0
    assert f.string(buf).decode() == core.uuid_text(1)
    assert nvml.nvmlDeviceGetUUID(h[0], buf, 8) == nvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert nvml.nvmlDeviceGetName(h[0], buf, 96) == 0 and f.string(buf) == b"Accel Simulated GPU"
    major, minor = f.new("int *"), f.new("int *")
    assert nvml.nvmlDeviceGetCudaComputeCapability(h[0], major, minor) == 0 and (major[0], minor[0]) == (9, 0)
    pci = f.new("nvmlPciInfo_t *")
    assert nvml.nvmlDeviceGetPciInfo_v3(h[0], pci) == 0
    assert pci.bus == core.pci_bus(1) and f.string(pci.busId) == b"00000000:%02X:00.0" % core.pci_bus(1)
    assert nvml.nvmlSystemGetDriverVersion(buf, 96) == 0 and f.string(buf)
    assert nvml.nvmlDeviceGetHandleByIndex_v2(2, h) == nvml.NVML_ERROR_INVALID_ARGUMENT
    assert f.string(nvml.nvmlErrorString(1)) == b"Uninitialized"
    assert not sim.state().runtime_initialized and sim.state().nvml_initialized


def test_nvml_memory_reflects_runtime_allocations(nvml, lib):
    f = _nvml.ffi
    assert nvml.nvmlInit_v2() == 0
    h = f.new("nvmlDevice_t *")
    assert nvml.nvmlDeviceGetHandleByIndex_v2(0, h) == 0
    mem = f.new("nvmlMemory_t *")
    p = malloc(lib, 1 << 20)
    assert nvml.nvmlDeviceGetMemoryInfo(h[0], mem) == 0
    used = cudart.context_reserved(8 << 30) + (1 << 20)     # the context's memory counts as used
    assert (mem.total, mem.used, mem.free) == (8 << 30, used, (8 << 30) - used)
    ok(lib.cudaFree(p))


def test_nvml_init_is_reference_counted(nvml):
    n = _nvml.ffi.new("unsigned int *")
    assert nvml.nvmlInit_v2() == 0 and nvml.nvmlInit_v2() == 0
    assert nvml.nvmlShutdown() == 0
    assert nvml.nvmlDeviceGetCount_v2(n) == 0
    assert nvml.nvmlShutdown() == 0
    assert nvml.nvmlDeviceGetCount_v2(n) == nvml.NVML_ERROR_UNINITIALIZED
    assert nvml.nvmlShutdown() == nvml.NVML_ERROR_UNINITIALIZED


def test_missing_libraries_and_driver(nvml):
    sim.configure(nvml=False)
    from accel._ffi import LibraryNotFound
    with pytest.raises(LibraryNotFound, match="libnvidia-ml"):
        sim.open_library("nvml")
    sim.configure(nvml=True, driver=False)
    assert sim.open_library("nvml").nvmlInit_v2() == 9   # NVML_ERROR_DRIVER_NOT_LOADED
    sim.configure(cudart=False)
    with pytest.raises(OSError, match="libcudart"):
        sim.open_library("cudart")
    with pytest.raises(ValueError, match="no simulated library"):
        sim.open_library("opencl")


# -- process state ------------------------------------------------------------------------------

def test_lazy_reset_hook_drops_sim_state(lib):
    from accel import _lazy
    malloc(lib, 16)
    sim.inject_oom(after=5)
    assert sim.state().runtime_initialized
    _lazy._reset_for_tests()
    st = sim.state()
    assert not st.runtime_initialized and st.calls == {} and not core._oom


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_drops_the_parents_runtime_and_cannot_use_cuda(async_lib):
    # Was test_forked_child_gets_a_fresh_simulator: the child re-initialized and used CUDA,
    # which real CUDA refuses after the parent started the driver (cudaErrorInitializationError;
    # see test_sim_cuda_strict.py).  The child still drops the parent's workers and counters.
    lib = async_lib
    s = stream(lib)
    d = malloc(lib, 8)
    ok(lib.cudaMemsetAsync(d, 1, 8, s))        # a worker thread exists in the parent
    pid = os.fork()
    if pid == 0:   # child: no inherited runtime, workers or counters; CUDA refuses to start
        code = 1
        try:
            st = sim.state()
            if not st.runtime_initialized and st.calls == {} and st.config.delay_us == 1:
                rc = lib.cudaMalloc(ffi.new("void **"), 8)
                rc2 = lib.cudaMemsetAsync(d, 3, 8, NULL_STREAM)
                code = 0 if (rc, rc2) == (lib.cudaErrorInitializationError,) * 2 else 2
        finally:
            os._exit(code)
    _, status_ = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status_) == 0
    ok(lib.cudaStreamSynchronize(s))
    assert kernels.read(d, 8) == b"\x01" * 8
