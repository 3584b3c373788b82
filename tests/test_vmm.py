"""Virtual memory (issue 15 items 1 and 3), CUDA: the simulated driver's cuMem* rules called as a
CUDA program calls them (pointers from cudaGetDriverEntryPointByVersion, cast to the PFN types),
and the CUDA backend's vmm_* methods on both devices.  MPS has none."""

import os
import shutil
import subprocess
import tempfile
import time

import pytest

from accel import _lazy, sim
from accel._errors import AcceleratorError, CaptureError, OutOfMemoryError
from accel._ffi import _cudadrv, cudart_module
from accel.sim import _vmm, cuda_driver
from conftest import use_sim

G = 2 << 20
D = _cudadrv.ffi
RFFI = cudart_module(13).ffi
SUCCESS, INVALID_VALUE, OOM, INVALID_DEVICE, ILLEGAL_ADDRESS, NOT_SUPPORTED, CAPTURE_UNSUPPORTED = \
    0, 1, 2, 101, 700, 801, 900

pytestmark = pytest.mark.skipif(not _vmm.supported(), reason="this host cannot play virtual memory (mmap)")


class Driver:
    """The simulated libcudart and the driver functions it hands out."""

    def __init__(self):
        self.lib = sim.open_library("cudart")
        self.fns = {}

    def __getattr__(self, name):
        if not name.startswith("cu"):
            raise AttributeError(name)
        fn = self.fns.get(name)
        if fn is None:
            fp = RFFI.new("void **")
            st = RFFI.new("enum cudaDriverEntryPointQueryResult *")
            assert self.lib.cudaGetDriverEntryPointByVersion(name.encode(), fp, 12000, 0, st) == 0
            assert st[0] == 0, name
            fn = self.fns[name] = D.cast(cuda_driver.SYMBOLS[name][0], int(RFFI.cast("uintptr_t", fp[0])))
        return fn

    def prop(self, device=0):
        p = D.new("CUmemAllocationProp_v1 *")
        p.type, p.location.type, p.location.id = 1, 1, device
        return p

    def reserve(self, size):
        p = D.new("CUdeviceptr_v2 *")
        assert self.cuMemAddressReserve(p, size, 0, 0, 0) == SUCCESS
        return p[0]

    def create(self, size, device=0):
        h = D.new("CUmemGenericAllocationHandle_v1 *")
        rc = self.cuMemCreate(h, size, self.prop(device), 0)
        return h[0] if rc == 0 else rc

    def access(self, va, size, device=0, flags=3):
        desc = D.new("CUmemAccessDesc_v1 *")
        desc.location.type, desc.location.id, desc.flags = 1, device, flags
        return self.cuMemSetAccess(va, size, desc, 1)

    def mapped(self, size, device=0, access=True):
        va = self.reserve(size)
        h = self.create(size, device)
        assert self.cuMemMap(va, size, 0, h, 0) == SUCCESS
        if access:
            assert self.access(va, size, device) == SUCCESS
        return va, h

    def mem_free(self, device=0):
        free, total = RFFI.new("size_t *"), RFFI.new("size_t *")
        self.lib.cudaSetDevice(device)
        assert self.lib.cudaMemGetInfo(free, total) == 0
        self.lib.cudaSetDevice(0)
        return free[0]

    def h2d(self, va, data):
        return self.lib.cudaMemcpy(RFFI.cast("void *", va), data, len(data), 1)

    def d2h(self, va, n):
        out = bytearray(n)
        rc = self.lib.cudaMemcpy(RFFI.from_buffer(out), RFFI.cast("void *", va), n, 2)
        return rc, bytes(out)


@pytest.fixture
def drv(monkeypatch):
    use_sim(monkeypatch, "cuda")
    sim.reset()
    d = Driver()
    yield d
    sim.reset()


# -- entry points and bindings ------------------------------------------------------------------

def test_entry_points_hand_out_the_driver_signatures(drv):
    for name, (pfn, first) in cuda_driver.SYMBOLS.items():
        fp = RFFI.new("void **")
        st = RFFI.new("enum cudaDriverEntryPointQueryResult *")
        assert drv.lib.cudaGetDriverEntryPoint(name.encode(), fp, 0, st) == 0 and st[0] == 0, name
        assert cuda_driver.callback_address(name) == int(RFFI.cast("uintptr_t", fp[0]))
        # the callback is built from the PFN type of the generated bindings (cudaTypedefs.h)
        assert D.typeof(cuda_driver._callbacks[name]) is D.typeof(pfn)
        if first == 10020:   # asking for an older ABI than the function's first one
            assert drv.lib.cudaGetDriverEntryPointByVersion(name.encode(), fp, 10010, 0, st) == 0
            assert st[0] == 2 and fp[0] == RFFI.NULL


def _cc():
    return shutil.which("gcc") or shutil.which("cc")


def _cuda_include_roots():
    import site
    roots = {}
    for sp in site.getsitepackages():
        for sub, major in (("nvidia/cu13/include", 13), ("nvidia/cuda_runtime/include", 12)):
            p = os.path.join(sp, sub)
            if os.path.exists(os.path.join(p, "cuda.h")):
                roots.setdefault(major, p)
    if os.path.exists("/usr/local/cuda/include/cuda.h"):
        roots.setdefault(13, "/usr/local/cuda/include")
    return roots


@pytest.mark.parametrize("major", [12, 13])
def test_vmm_struct_layouts_match_both_majors_headers(major):
    """One _cudadrv (from the CUDA 13 headers) serves both majors: the layouts of the structs the
    cuMem* calls take are the same in the CUDA 12.4 headers (checked with the C compiler)."""
    root = _cuda_include_roots().get(major)
    if root is None or _cc() is None:
        pytest.skip(f"no CUDA {major} headers or no C compiler here")
    fields = {"CUmemAllocationProp_v1": ["type", "requestedHandleTypes", "location", "win32HandleMetaData",
                                         "allocFlags"],
              "CUmemAccessDesc_v1": ["location", "flags"], "CUmemLocation_v1": ["type", "id"]}
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <cuda.h>", "int main(void) {"]
    expected = []
    for s, names in fields.items():
        lines.append(f'printf("%zu\\n", sizeof({s}));')
        expected.append(D.sizeof(s))
        for f in names:
            lines.append(f'printf("%zu\\n", offsetof({s}, {f}));')
            expected.append(D.offsetof(s, f))
    lines.append("return 0; }")
    with tempfile.TemporaryDirectory() as tmp:
        c, exe = os.path.join(tmp, "l.c"), os.path.join(tmp, "l")
        with open(c, "w") as f:
            f.write("\n".join(lines) + "\n")
        res = subprocess.run([_cc(), "-I", root, c, "-o", exe], capture_output=True, text=True)
        if res.returncode:
            pytest.skip(f"the CUDA {major} cuda.h does not compile here: {res.stderr[-300:]}")
        out = subprocess.run([exe], capture_output=True, text=True, check=True).stdout.split()
    assert [int(x) for x in out] == expected


# -- the driver's rules -------------------------------------------------------------------------

def test_granularity_is_2mib_and_needs_a_valid_prop(drv):
    g = D.new("size_t *")
    assert drv.cuMemGetAllocationGranularity(g, drv.prop(), 0) == SUCCESS and g[0] == G
    assert drv.cuMemGetAllocationGranularity(g, drv.prop(1), 1) == SUCCESS and g[0] == G
    assert drv.cuMemGetAllocationGranularity(g, drv.prop(), 7) == INVALID_VALUE
    assert drv.cuMemGetAllocationGranularity(g, drv.prop(5), 0) == INVALID_DEVICE


def test_devices_are_cudevice_handles_from_cudeviceget(drv):
    dev, v = D.new("CUdevice_v1 *"), D.new("int *")
    assert drv.cuDeviceGet(dev, 1) == SUCCESS
    assert drv.cuDeviceGetAttribute(v, 102, dev[0]) == SUCCESS and v[0] == 1
    assert drv.cuDeviceGet(dev, 2) == INVALID_DEVICE          # two simulated devices
    # an ordinal is not a CUdevice (the simulator's handles differ from ordinals on purpose)
    assert drv.cuDeviceGetAttribute(v, 102, 1) == INVALID_DEVICE


def test_reservations_are_unique_granular_host_ranges(drv):
    a, b = drv.reserve(4 * G), drv.reserve(2 * G)
    assert a % G == 0 and b % G == 0
    assert a + 4 * G <= b or b + 2 * G <= a
    p = D.new("CUdeviceptr_v2 *")
    assert drv.cuMemAddressReserve(p, G + 4096, 0, 0, 0) == INVALID_VALUE     # not a multiple of 2 MiB
    assert drv.cuMemAddressReserve(p, G, 3 << 20, 0, 0) == INVALID_VALUE      # alignment not a power of 2
    assert drv.cuMemAddressReserve(p, G, 0, 0, 1) == INVALID_VALUE            # flags must be 0
    assert drv.cuMemAddressFree(a, 2 * G) == INVALID_VALUE                    # size must match
    assert drv.cuMemAddressFree(a + G, 2 * G) == INVALID_VALUE
    assert drv.cuMemAddressFree(a, 4 * G) == SUCCESS
    assert drv.cuMemAddressFree(a, 4 * G) == INVALID_VALUE                    # gone
    assert drv.cuMemAddressFree(b, 2 * G) == SUCCESS
    assert sim.state().vmm_reservations == 0


def test_create_checks_size_prop_and_flags(drv):
    h = D.new("CUmemGenericAllocationHandle_v1 *")
    assert drv.cuMemCreate(h, G + 1, drv.prop(), 0) == INVALID_VALUE
    assert drv.cuMemCreate(h, G, drv.prop(), 1) == INVALID_VALUE
    assert drv.cuMemCreate(h, G, drv.prop(9), 0) == INVALID_DEVICE
    p = drv.prop()
    p.type = 0
    assert drv.cuMemCreate(h, G, p, 0) == INVALID_VALUE
    p = drv.prop()
    p.requestedHandleTypes = 1        # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: not simulated
    assert drv.cuMemCreate(h, G, p, 0) == NOT_SUPPORTED
    assert sim.state().vmm_handles == 0


def test_map_only_inside_a_reservation_granular_whole_handle_no_double_map(drv):
    va = drv.reserve(4 * G)
    h, h2 = drv.create(2 * G), drv.create(G)
    assert drv.cuMemMap(va + 4096, 2 * G, 0, h, 0) == INVALID_VALUE      # address not granular
    # offset "currently must be zero", and a mapping covers the whole handle: NOT_SUPPORTED on an
    # H100 (tests/conformance/cuda_h100_2026-12-05.json, scenario vmm_rules)
    assert drv.cuMemMap(va, 2 * G, G, h, 0) == NOT_SUPPORTED             # offset must be 0
    assert drv.cuMemMap(va, 2 * G, 0, h, 1) == INVALID_VALUE             # flags must be 0
    assert drv.cuMemMap(va, G, 0, h, 0) == NOT_SUPPORTED                 # not the whole handle
    assert drv.cuMemMap(va + 3 * G, 2 * G, 0, h, 0) == INVALID_VALUE     # runs past the reservation
    assert drv.cuMemMap(va + 64 * G, 2 * G, 0, h, 0) == INVALID_VALUE    # outside every reservation
    assert drv.cuMemMap(va, 2 * G, 0, 0x1234, 0) == INVALID_VALUE        # not a handle
    assert drv.cuMemMap(va, 2 * G, 0, h, 0) == SUCCESS
    assert drv.cuMemMap(va, 2 * G, 0, h, 0) == INVALID_VALUE             # double map
    assert drv.cuMemMap(va + G, G, 0, h2, 0) == INVALID_VALUE            # overlaps the mapping
    assert drv.cuMemMap(va + 2 * G, G, 0, h2, 0) == SUCCESS
    st = sim.state()
    assert st.vmm_mappings == 2 and st.vmm_mapped_bytes == 3 * G


def test_unmap_and_set_access_take_whole_mappings(drv):
    va = drv.reserve(4 * G)
    h, h2 = drv.create(2 * G), drv.create(G)
    drv.cuMemMap(va, 2 * G, 0, h, 0)
    drv.cuMemMap(va + 2 * G, G, 0, h2, 0)
    assert drv.cuMemUnmap(va, G) == INVALID_VALUE                    # a sub-range of a mapping
    assert drv.cuMemUnmap(va + G, 2 * G) == INVALID_VALUE
    assert drv.access(va, G) == INVALID_VALUE                         # part of a mapping
    assert drv.access(va, 4 * G) == INVALID_VALUE                     # the last 2 MiB are not mapped
    assert drv.access(va, 3 * G) == SUCCESS                           # two whole mappings at once
    assert drv.cuMemUnmap(va + 3 * G, G) == INVALID_VALUE             # nothing mapped there
    assert drv.cuMemUnmap(va, 3 * G) == SUCCESS                       # both, as the CUDA samples do
    assert sim.state().vmm_mappings == 0


def test_release_while_mapped_frees_at_the_last_unmap(drv):
    before = drv.mem_free()
    va = drv.reserve(2 * G)
    h = drv.create(2 * G)
    assert drv.mem_free() == before - 2 * G            # physical memory counts at cuMemCreate
    assert drv.cuMemMap(va, 2 * G, 0, h, 0) == SUCCESS
    assert drv.cuMemRelease(h) == SUCCESS              # allowed while mapped (cuMemRelease docs)
    assert drv.cuMemRelease(h) == INVALID_VALUE        # released already
    assert drv.mem_free() == before - 2 * G            # still mapped: still held
    assert drv.access(va, 2 * G) == SUCCESS
    assert drv.h2d(va, b"kept") == SUCCESS
    assert drv.cuMemAddressFree(va, 2 * G) == INVALID_VALUE     # a mapping is left
    assert drv.cuMemUnmap(va, 2 * G) == SUCCESS
    assert drv.mem_free() == before
    assert drv.cuMemMap(va, 2 * G, 0, h, 0) == INVALID_VALUE    # the handle is gone
    assert drv.cuMemAddressFree(va, 2 * G) == SUCCESS
    st = sim.state()
    assert (st.vmm_handles, st.vmm_physical_bytes, st.vmm_reservations) == (0, 0, 0)


def test_contents_survive_remap_and_aliases_share_them(drv):
    va = drv.reserve(4 * G)
    h = drv.create(G)
    drv.cuMemMap(va, G, 0, h, 0)
    drv.access(va, G)
    data = bytes(range(256)) * 16
    assert drv.h2d(va + 100, data) == SUCCESS
    drv.cuMemUnmap(va, G)
    drv.cuMemMap(va + 3 * G, G, 0, h, 0)      # elsewhere: the same physical pages
    drv.cuMemMap(va + G, G, 0, h, 0)          # and an alias
    drv.access(va + G, G)
    drv.access(va + 3 * G, G)
    assert drv.d2h(va + 3 * G + 100, len(data)) == (SUCCESS, data)
    assert drv.h2d(va + G, b"alias") == SUCCESS
    assert drv.d2h(va + 3 * G, 5) == (SUCCESS, b"alias")


def test_copy_spanning_two_handles_works(drv):
    va = drv.reserve(2 * G)
    for i in range(2):
        drv.cuMemMap(va + i * G, G, 0, drv.create(G), 0)
    drv.access(va, 2 * G)
    data = os.urandom(4096)
    assert drv.h2d(va + G - 2048, data) == SUCCESS
    assert drv.d2h(va + G - 2048, 4096) == (SUCCESS, data)


def test_access_must_be_set_before_use(drv):
    va, _h = drv.mapped(G, access=False)
    assert drv.h2d(va, b"x") == ILLEGAL_ADDRESS        # mapped, no cuMemSetAccess: a fault, sticky
    assert "no write access" in sim.state().errors[-1][1]
    assert drv.lib.cudaDeviceSynchronize() == ILLEGAL_ADDRESS


def test_unmapped_page_of_a_reservation_faults(drv):
    va, _h = drv.mapped(G)
    other = drv.reserve(2 * G)
    assert drv.h2d(va + G - 2, b"abcd") == ILLEGAL_ADDRESS     # runs off the mapping into nothing
    assert drv.lib.cudaGetLastError() == ILLEGAL_ADDRESS
    assert other


def test_memset_of_unmapped_memory_faults(drv):
    va = drv.reserve(2 * G)
    assert drv.lib.cudaMemset(RFFI.cast("void *", va), 0, 16) == ILLEGAL_ADDRESS


def test_read_only_access_refuses_writes(drv):
    va, _h = drv.mapped(G)
    assert drv.h2d(va, b"ro") == SUCCESS
    assert drv.access(va, G, flags=1) == SUCCESS        # CU_MEM_ACCESS_FLAGS_PROT_READ
    flags = D.new("unsigned long long *")
    loc = D.new("CUmemLocation_v1 *")
    loc.type, loc.id = 1, 0
    assert drv.cuMemGetAccess(flags, loc, va) == SUCCESS and flags[0] == 1
    assert drv.d2h(va, 2) == (SUCCESS, b"ro")
    assert drv.h2d(va, b"no") == ILLEGAL_ADDRESS


def test_unmap_does_not_wait_for_queued_work(drv):
    """cuMemUnmap returns at once; a copy still queued on the range faults when it runs."""
    sim.configure(delay_us=200_000)
    va, _h = drv.mapped(G)
    s = RFFI.new("cudaStream_t *")
    assert drv.lib.cudaStreamCreate(s) == 0
    assert drv.lib.cudaMemsetAsync(RFFI.cast("void *", va), 1, 64, s[0]) == SUCCESS
    assert drv.cuMemUnmap(va, G) == SUCCESS
    if drv.lib.cudaStreamQuery(s[0]) != 600:
        pytest.skip("the queued memset ran before the unmap (host too slow to observe the race)")
    assert drv.lib.cudaStreamSynchronize(s[0]) == ILLEGAL_ADDRESS
    assert "unmapped before the operation ran" in sim.state().errors[-1][1]


def test_another_device_needs_access_too(drv):
    va, _h = drv.mapped(G, device=0)
    assert drv.lib.cudaSetDevice(1) == 0
    out = RFFI.new("void **")
    assert drv.lib.cudaMalloc(out, 64) == 0
    s = RFFI.new("cudaStream_t *")
    drv.lib.cudaStreamCreate(s)                       # a stream of device 1
    assert drv.access(va, G, device=1) == SUCCESS     # the peer granted access: its copy works
    assert drv.lib.cudaMemcpyAsync(out[0], RFFI.cast("void *", va), 64, 4, s[0]) == SUCCESS
    assert drv.lib.cudaStreamSynchronize(s[0]) == SUCCESS
    assert drv.access(va, G, device=1, flags=0) == SUCCESS      # taken away again
    assert drv.lib.cudaMemcpyAsync(out[0], RFFI.cast("void *", va), 64, 4, s[0]) == SUCCESS
    assert drv.lib.cudaStreamSynchronize(s[0]) == ILLEGAL_ADDRESS


def test_kernels_check_the_mapping_and_access(drv):
    from accel.random import _device   # noqa: F401  (registers nothing; the test kernel is built in)
    va, _h = drv.mapped(G)
    ptx = (b".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry accel_test_fill_u32(\n"
           b".param .u64 a, .param .u64 b, .param .u32 c)\n{\nret;\n}\n\0")
    mod, fn = D.new("CUmodule *"), D.new("CUfunction *")
    assert drv.cuModuleLoadData(mod, D.from_buffer(bytearray(ptx))) == SUCCESS
    assert drv.cuModuleGetFunction(fn, mod[0], b"accel_test_fill_u32") == SUCCESS

    def launch(ptr, n):
        args = [D.new("uint64_t *", ptr), D.new("uint64_t *", n), D.new("uint32_t *", 7)]
        argv = D.new("void *[]", [D.cast("void *", a) for a in args])
        return drv.cuLaunchKernel(fn[0], 1, 1, 1, 1, 1, 1, 0, D.NULL, argv, D.NULL)

    assert launch(va, 16) == SUCCESS
    assert drv.lib.cudaDeviceSynchronize() == 0
    assert drv.d2h(va, 8) == (SUCCESS, b"\x07\x00\x00\x00" * 2)
    assert launch(va + G - 8, 4) == SUCCESS           # runs off the end of the mapping
    assert drv.lib.cudaDeviceSynchronize() == ILLEGAL_ADDRESS


def test_physical_memory_shares_the_device_budget(drv):
    free = drv.mem_free()
    n = free // G
    p = RFFI.new("void **")
    assert drv.lib.cudaMalloc(p, free - (n // 2) * G) == 0      # leaves room for n//2 pages
    handles = [drv.create(G) for _ in range(n // 2)]
    assert all(h > 0x1000 for h in handles)
    assert drv.create(G) == OOM                                  # full: cudaMalloc + cuMemCreate
    assert drv.create(G, device=1) > 0x1000                      # the other device has its own
    assert drv.lib.cudaFree(p[0]) == 0
    assert drv.create(G) > 0x1000
    assert drv.lib.cudaMalloc(p, drv.mem_free() + 256) == 2


def test_injected_oom_and_faults_reach_each_call(drv):
    sim.inject_oom()
    assert drv.create(G) == OOM
    for name in ("cuMemAddressReserve", "cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap",
                 "cuMemRelease", "cuMemAddressFree", "cuMemGetAllocationGranularity"):
        sim.inject_error(name, 999)
    p, g = D.new("CUdeviceptr_v2 *"), D.new("size_t *")
    assert drv.cuMemAddressReserve(p, G, 0, 0, 0) == 999
    assert drv.cuMemGetAllocationGranularity(g, drv.prop(), 0) == 999
    assert drv.create(G) == 999
    assert drv.cuMemMap(0, G, 0, 0, 0) == 999
    assert drv.access(0, G) == 999
    assert drv.cuMemUnmap(0, G) == 999
    assert drv.cuMemRelease(0) == 999
    assert drv.cuMemAddressFree(0, G) == 999
    st = sim.state()
    assert (st.vmm_reservations, st.vmm_handles) == (0, 0)


def test_map_and_unmap_are_counted_and_can_be_made_slow(drv):
    va = drv.reserve(2 * G)
    h = drv.create(G)
    sim.reset_call_counts()
    sim.configure(vmm_cost_us=20_000)
    t0 = time.perf_counter()
    drv.cuMemMap(va, G, 0, h, 0)
    drv.cuMemUnmap(va, G)
    assert time.perf_counter() - t0 >= 0.04        # each slept its cost (a lower bound, not a timing)
    calls = sim.calls()
    assert calls["cuMemMap"] == 1 and calls["cuMemUnmap"] == 1


def test_vmm_cost_from_the_environment(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_VMM_COST_US="150")
    sim.reset()
    assert sim.config().vmm_cost_us == 150.0
    monkeypatch.setenv("ACCEL_SIM_VMM_COST_US", "slow")
    sim.reset()
    with pytest.raises(ValueError, match="ACCEL_SIM_VMM_COST_US"):
        sim.config()
    monkeypatch.delenv("ACCEL_SIM_VMM_COST_US")
    sim.reset()


def test_vmm_calls_during_a_global_capture_invalidate_it(drv):
    va = drv.reserve(2 * G)
    h = drv.create(G)
    s, graph = RFFI.new("cudaStream_t *"), RFFI.new("cudaGraph_t *")
    drv.lib.cudaStreamCreate(s)
    assert drv.lib.cudaStreamBeginCapture(s[0], 0) == 0          # global mode
    assert drv.cuMemMap(va, G, 0, h, 0) == CAPTURE_UNSUPPORTED
    assert drv.lib.cudaStreamEndCapture(s[0], graph) == 901
    mode = RFFI.new("enum cudaStreamCaptureMode *", 2)            # relaxed: allowed
    assert drv.lib.cudaStreamBeginCapture(s[0], 0) == 0
    drv.lib.cudaThreadExchangeStreamCaptureMode(mode)
    assert drv.cuMemMap(va, G, 0, h, 0) == SUCCESS
    drv.lib.cudaThreadExchangeStreamCaptureMode(mode)
    assert drv.lib.cudaStreamEndCapture(s[0], graph) == 0


def test_no_vmm_device_reports_it(monkeypatch):
    use_sim(monkeypatch, "cuda")
    sim.reset()
    sim.configure(vmm=False)
    d = Driver()
    dev, v = D.new("CUdevice_v1 *"), D.new("int *")
    d.cuDeviceGet(dev, 0)
    assert d.cuDeviceGetAttribute(v, 102, dev[0]) == SUCCESS and v[0] == 0
    assert d.create(G) == NOT_SUPPORTED
    b = _lazy.lazy_init()
    assert b.supports_vmm and not b.vmm_supported(0)
    sim.reset()


# -- the CUDA backend ----------------------------------------------------------------------------

@pytest.fixture
def cuda(monkeypatch):
    use_sim(monkeypatch, "cuda")
    b = _lazy.lazy_init()
    yield b
    sim.reset()


def _vmm_state():
    st = sim.state()
    return (st.vmm_reservations, st.vmm_handles, st.vmm_physical_bytes, st.vmm_mappings)


@pytest.mark.parametrize("runtime", ["12.4", "13.0"])
def test_backend_vmm_on_both_devices(monkeypatch, runtime):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CUDA_RUNTIME=runtime, ACCEL_SIM_CUDA_DRIVER="13.0")
    b = _lazy.lazy_init()
    b.set_device(0)
    for index in (0, 1):                     # 1 is not the current device
        assert b.vmm_supported(index)
        g = b.vmm_granularity(index)
        assert g == G
        free0 = b.mem_info()[0] if index == 0 else None
        va = b.vmm_reserve(index, 4 * g)
        h = b.vmm_create(index, 2 * g)
        b.vmm_map(va, 2 * g, h, index)
        if free0 is not None:
            assert b.mem_info()[0] == free0 - 2 * g
        s = b.stream_create()
        buf = bytearray(b"vmm!" * 1024)
        with _on(b, index):
            s = b.stream_create()
            b.memcpy_async(va + g - 2048, _host(b, buf), len(buf), s)
            b.stream_synchronize(s)
            b.stream_destroy(s)
        b.vmm_unmap(va, 2 * g)
        b.vmm_release(h)
        b.vmm_free(va, 4 * g)
        if free0 is not None:
            assert b.mem_info()[0] == free0
    assert b.get_device() == 0
    assert _vmm_state() == (0, 0, 0, 0)
    sim.reset()


class _on:
    def __init__(self, b, index):
        self.b, self.index = b, index

    def __enter__(self):
        self.prev = self.b.get_device()
        self.b.set_device(self.index)

    def __exit__(self, *exc):
        self.b.set_device(self.prev)


def _host(b, buf):
    return int(RFFI.cast("uintptr_t", RFFI.from_buffer(buf)))


def test_backend_create_oom_is_out_of_memory_error(cuda):
    free = cuda.mem_info()[0]
    with pytest.raises(OutOfMemoryError, match="cuMemCreate failed with CUDA_ERROR_OUT_OF_MEMORY"):
        cuda.vmm_create(0, (free // G + 1) * G)
    sim.inject_oom()
    with pytest.raises(OutOfMemoryError):
        cuda.vmm_create(1, G)
    assert _vmm_state() == (0, 0, 0, 0)


def test_backend_errors_name_the_call_and_the_curesult(cuda):
    va = cuda.vmm_reserve(0, 2 * G)
    with pytest.raises(AcceleratorError, match=r"cuMemMap failed with CUDA_ERROR_INVALID_VALUE \(1\)"):
        cuda.vmm_map(va + 4096, G, 0x99, 0)
    with pytest.raises(AcceleratorError, match="cuMemAddressReserve failed with CUDA_ERROR_INVALID_VALUE"):
        cuda.vmm_reserve(0, G + 1)
    cuda.vmm_free(va, 2 * G)


def _workload(b, index):
    """reserve, create, map, unmap, release, free; on a failure everything acquired is given back."""
    va = h = None
    mapped = False
    try:
        va = b.vmm_reserve(index, 2 * G)
        h = b.vmm_create(index, G)
        b.vmm_map(va, G, h, index)
        mapped = True
        b.vmm_unmap(va, G)
        mapped = False
        b.vmm_release(h)
        h = None
        b.vmm_free(va, 2 * G)
        va = None
    finally:
        if mapped:
            b.vmm_unmap(va, G)
        if h is not None:
            b.vmm_release(h)
        if va is not None:
            b.vmm_free(va, 2 * G)


@pytest.mark.parametrize("call", ["cuMemAddressReserve", "cuMemCreate", "cuMemMap", "cuMemSetAccess",
                                  "cuMemUnmap", "cuMemRelease", "cuMemAddressFree"])
def test_backend_failing_call_leaks_nothing(cuda, call):
    free = cuda.mem_info()[0]
    sim.inject_error(call, 2 if call == "cuMemCreate" else 1)
    with pytest.raises(AcceleratorError, match=call):
        _workload(cuda, 1)
    assert _vmm_state() == (0, 0, 0, 0)
    assert cuda.mem_info()[0] == free
    _workload(cuda, 1)                     # and the next one works
    assert _vmm_state() == (0, 0, 0, 0)


def test_backend_map_whose_access_fails_is_undone(cuda):
    va = cuda.vmm_reserve(0, 2 * G)
    h = cuda.vmm_create(0, G)
    sim.inject_error("cuMemSetAccess", 1)
    with pytest.raises(AcceleratorError, match="cuMemSetAccess"):
        cuda.vmm_map(va, G, h, 0)
    assert sim.state().vmm_mappings == 0
    cuda.vmm_map(va, G, h, 0)              # the range is free for the next map
    cuda.vmm_set_access(va, G, 1)          # and a peer can be granted access
    cuda.vmm_unmap(va, G)
    cuda.vmm_release(h)
    cuda.vmm_free(va, 2 * G)


def test_backend_refuses_vmm_during_capture(cuda):
    va = cuda.vmm_reserve(0, 2 * G)
    h = cuda.vmm_create(0, G)
    s = cuda.stream_create()
    cuda.capture_begin(s, "relaxed")
    try:
        for fn, args in ((cuda.vmm_map, (va, G, h, 0)), (cuda.vmm_create, (0, G)), (cuda.vmm_reserve, (0, G)),
                         (cuda.vmm_release, (h,)), (cuda.vmm_free, (va, 2 * G)), (cuda.vmm_unmap, (va, G))):
            with pytest.raises(CaptureError, match="stream capture is underway"):
                fn(*args)
    finally:
        cuda.graph_destroy(cuda.capture_end(s))
    cuda.vmm_release(h)
    cuda.vmm_free(va, 2 * G)
    cuda.stream_destroy(s)


def test_backend_without_driver_entry_points_has_no_vmm(monkeypatch):
    use_sim(monkeypatch, "cuda")
    b = _lazy.lazy_init()
    b._vmm_fns = "no virtual memory management: cudaGetDriverEntryPoint('cuMemMap') found nothing"
    assert b.supports_vmm and not b.vmm_supported(0)
    with pytest.raises(AcceleratorError, match="no virtual memory management"):
        b.vmm_reserve(0, G)
    sim.reset()


def test_mps_has_no_vmm():
    from accel.backends import base, mps
    cls = mps.MpsBackend if hasattr(mps, "MpsBackend") else next(
        v for v in vars(mps).values() if isinstance(v, type) and issubclass(v, base.Backend) and v is not base.Backend)
    assert cls.supports_vmm is False
    b = cls.__new__(cls)
    assert not b.vmm_supported(0)
    for fn, args in ((b.vmm_granularity, (0,)), (b.vmm_reserve, (0, G)), (b.vmm_create, (0, G)),
                     (b.vmm_map, (0, G, 1, 0)), (b.vmm_unmap, (0, G)), (b.vmm_release, (1,)),
                     (b.vmm_free, (0, G)), (b.vmm_set_access, (0, G, 0))):
        with pytest.raises(NotImplementedError, match="no virtual memory management"):
            fn(*args)


def test_ordinals_follow_cuda_visible_devices_and_nvml_sees_the_memory(monkeypatch):
    """With CUDA_VISIBLE_DEVICES=1 the runtime's device 0 is the driver's ordinal 0 and physical GPU 1:
    its physical memory shows in NVML's used memory of GPU 1, not GPU 0."""
    use_sim(monkeypatch, "cuda", CUDA_VISIBLE_DEVICES="1")
    b = _lazy.lazy_init()
    from accel.sim import cudart
    before = (cudart.device_used_bytes(0), cudart.device_used_bytes(1))
    h = b.vmm_create(0, 4 * G)
    assert (cudart.device_used_bytes(0), cudart.device_used_bytes(1)) == (before[0], before[1] + 4 * G)
    with pytest.raises(AcceleratorError, match="CUDA_ERROR_INVALID_DEVICE"):
        b.vmm_create(1, G)                 # one visible device: ordinal 1 does not exist
    b.vmm_release(h)
    assert cudart.device_used_bytes(1) == before[1]
    sim.reset()


def test_mapped_memory_is_device_memory_to_the_runtime_but_not_cudamalloc_memory(drv):
    va, _h = drv.mapped(G, device=1)
    attrs = RFFI.new("struct cudaPointerAttributes *")
    assert drv.lib.cudaPointerGetAttributes(attrs, RFFI.cast("void *", va + 100)) == 0
    assert attrs.type == 2 and attrs.device == 1            # cudaMemoryTypeDevice, the handle's device
    assert drv.lib.cudaFree(RFFI.cast("void *", va)) == INVALID_VALUE


def test_threads_mapping_copying_and_unmapping_at_once(cuda):
    """Several threads map, copy through and unmap their own pages while the others do the same:
    no fault, no crash, every byte where it was written, nothing left."""
    import threading
    errors = []

    def worker(k):
        try:
            index = k % 2
            s = None
            with _on(cuda, index):
                s = cuda.stream_create()
                va = cuda.vmm_reserve(index, 4 * G)
                for i in range(15):
                    h = cuda.vmm_create(index, G)
                    base = va + (i % 4) * G
                    cuda.vmm_map(base, G, h, index)
                    data = bytearray(os.urandom(4096))
                    out = bytearray(4096)
                    cuda.memcpy_async(base + 1000, _host(cuda, data), 4096, s)
                    cuda.memcpy_async(_host(cuda, out), base + 1000, 4096, s)
                    cuda.stream_synchronize(s)
                    assert out == data
                    cuda.vmm_unmap(base, G)
                    cuda.vmm_release(h)
                cuda.vmm_free(va, 4 * G)
                cuda.stream_destroy(s)
        except BaseException as exc:     # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert _vmm_state() == (0, 0, 0, 0)
    assert sim.state().errors == []


def test_a_running_kernel_does_not_stall_the_host_queueing_other_work(monkeypatch):
    """While a kernel runs (it holds the mapped pages it reads), the host can still queue a
    memset of other mapped memory on another stream: enqueueing never waits for device work on
    hardware.  The simulator held its virtual-memory lock exclusively for the whole kernel, so
    the memset's address check waited for the kernel (a 30 s stall in
    test_torch_external_events when the gate kernel had started first)."""
    import threading
    import accel
    from accel.sim import kernels
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=1)     # work runs on the streams' workers
    started, release = threading.Event(), threading.Event()

    def hold(grid, block, view, ptr):
        view(ptr, 4)                      # touches its own mapped memory
        started.set()
        release.wait(20)

    kernels.register("accel_test_vmm_hold", ("ptr",), hold, replace=True)
    try:
        ptx = (b".version 8.0\n.target sm_90\n.address_size 64\n"
               b".visible .entry accel_test_vmm_hold(.param .u64 p)\n{\n ret;\n}\n")
        k = accel.Module(ptx).function("accel_test_vmm_hold")
        a, b = accel.Buffer(1 << 20), accel.Buffer(1 << 20)     # expandable segments: mapped pages
        s, t = accel.Stream(), accel.Stream()
        accel.launch(k, 1, 1, a, stream=s)
        assert started.wait(20)
        done = threading.Event()
        worker = threading.Thread(target=lambda: (b.fill_(1, stream=t), done.set()), daemon=True)
        worker.start()
        queued = done.wait(5)
        release.set()
        worker.join(20)
        assert queued, "queueing a memset waited for a running kernel"
        t.synchronize()
        s.synchronize()
        assert (b.to_numpy()[:4] == 1).all()
    finally:
        release.set()
        kernels.unregister("accel_test_vmm_hold")
