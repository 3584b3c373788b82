"""The simulated CUDA runtime and driver entry points against the CUDA documents, round r79a.

Audited: the cuda*/cu*/nvml* calls accel/backends/cuda/*.py makes, against the Runtime and Driver API
reference pages, for rules the earlier strict files (test_sim_cuda_strict*.py, test_cuda_strict*.py,
test_sim_strict_r72a.py, test_sim_peer_r71g.py, test_sim_cuda_vmm_graph_r70d.py, test_vmm.py,
test_sim_cuda_event_nodes.py, test_torch_primary_ctx.py) do not pin.

Leniencies found (strict xfails first, each seen failing; fixed in session 39 and plain tests since):

* cudaMemPoolSetAccess naming one device twice in one call applies the last descriptor.  The Runtime
  API: "Each descriptor instructs the access to enable for a single gpu" -- silent on two for one
  device, so the simulator must refuse (cuMemSetAccess already does, r70d).
* cudaDeviceReset does not end what lived in the primary context: a CUmodule loaded there
  (cuModuleLoadData: "into the current context") and its CUfunction still answer after the reset
  ("Explicitly destroys and cleans up all resources associated with the current device in the
  current process"), and cuDevicePrimaryCtxGetState still reports the context active (the Driver API,
  cuDevicePrimaryCtxRetain: the context is active "until the user releases it with
  cuDevicePrimaryCtxRelease() or resets it with cuDevicePrimaryCtxReset()"; cudaDeviceReset is
  cuDevicePrimaryCtxReset on hardware, and a native trace shows active=0 afterwards: lupinemachines/
  lupine issue 844); and a graph exec instantiated on the device before the reset still launches and
  runs (docs silent on the exec: refuse).  accel never calls cudaDeviceReset, so accel itself is not
  exposed.

Checked and found as documented (plain tests): the function handles of an unloaded module and the
kernels of an unloaded library are refused by every call accel makes with them; cudaMemcpyPeerAsync
refuses device numbers that do not name the pointers' devices and host memory (docs silent).
"""

import numpy as np
import pytest

from accel import sim
from accel._ffi import _cudadrv, cudart_module
from accel.sim import cuda_driver
from conftest import use_sim

RFFI = cudart_module(13).ffi
D = _cudadrv.ffi

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_HANDLE = 400
#: what a call naming a handle of a destroyed context may return on hardware: INVALID_HANDLE,
#: INVALID_CONTEXT (201) or CONTEXT_IS_DESTROYED (709); the docs name none of them for it
DEAD_CONTEXT_CODES = {400, 201, 709}
cudaErrorInvalidValue = 1
cudaErrorInvalidDeviceFunction = 98
cudaErrorInvalidResourceHandle = 400
LOC_DEVICE = 1                       # cudaMemLocationTypeDevice
PROT_NONE, PROT_READ_WRITE = 0, 3    # cudaMemAccessFlagsProtNone / ProtReadWrite

_PTX = (b".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry accel_r79a_k(\n"
        b".param .u64 a)\n{\nret;\n}\n\0")


@pytest.fixture
def lib(monkeypatch):
    use_sim(monkeypatch, "cuda")
    sim.reset()
    yield sim.open_library("cudart")
    sim.reset()


def ok(rc):
    assert rc == 0, rc


def drv(lib, name):
    """The driver function ``name`` as cudaGetDriverEntryPointByVersion hands it out (as accel gets it)."""
    fp = RFFI.new("void **")
    st = RFFI.new("enum cudaDriverEntryPointQueryResult *")
    ok(lib.cudaGetDriverEntryPointByVersion(name.encode(), fp, 12000, 0, st))
    assert st[0] == 0, name
    return D.cast(cuda_driver.SYMBOLS[name][0], int(RFFI.cast("uintptr_t", fp[0])))


def stream(lib, flags=1):
    p = RFFI.new("cudaStream_t *")
    ok(lib.cudaStreamCreateWithFlags(p, flags))
    return p[0]


def malloc_on(lib, device, n):
    ok(lib.cudaSetDevice(device))
    p = RFFI.new("void **")
    ok(lib.cudaMalloc(p, n))
    ok(lib.cudaSetDevice(0))
    return p[0]


def read_back(lib, ptr, device, n=4096):
    """The ``n`` bytes at device ``device``'s ``ptr`` (a cudaMemcpy on that device)."""
    out = np.empty(n, np.uint8)
    ok(lib.cudaSetDevice(device))
    ok(lib.cudaMemcpy(RFFI.cast("void *", out.ctypes.data), ptr, n, 4))
    ok(lib.cudaSetDevice(0))
    return out


def load_module(lib, keep):
    """cuModuleLoadData of a one-kernel PTX into the current context: (module, function)."""
    buf = bytearray(_PTX)
    keep.append(buf)
    mod, fn = D.new("CUmodule *"), D.new("CUfunction *")
    assert drv(lib, "cuModuleLoadData")(mod, D.from_buffer(buf)) == CUDA_SUCCESS
    assert drv(lib, "cuModuleGetFunction")(fn, mod[0], b"accel_r79a_k") == CUDA_SUCCESS
    return mod[0], fn[0]


# -- cudaMemPoolSetAccess: one device named twice in one call ---------------------------------------

def _pool_access(lib, pool, device):
    flags = RFFI.new("enum cudaMemAccessFlags *")
    loc = RFFI.new("struct cudaMemLocation *")
    loc.type, loc.id = LOC_DEVICE, device
    ok(lib.cudaMemPoolGetAccess(flags, pool, loc))
    return flags[0]


def _descs(*entries):
    out = RFFI.new("struct cudaMemAccessDesc[]", len(entries))
    for i, (device, flags) in enumerate(entries):
        out[i].location.type, out[i].location.id, out[i].flags = LOC_DEVICE, device, flags
    return out


def test_pool_set_access_of_one_device_once_per_call_works(lib):
    """The documented use (what accel's mem_pool_set_access passes: one descriptor): device 1 gets
    read-write access to device 0's default pool, and can lose it again."""
    pool = RFFI.new("cudaMemPool_t *")
    ok(lib.cudaDeviceGetDefaultMemPool(pool, 0))
    ok(lib.cudaMemPoolSetAccess(pool[0], _descs((1, PROT_READ_WRITE)), 1))
    assert _pool_access(lib, pool[0], 1) == PROT_READ_WRITE
    ok(lib.cudaMemPoolSetAccess(pool[0], _descs((1, PROT_NONE)), 1))
    assert _pool_access(lib, pool[0], 1) == PROT_NONE


# r79a, fixed in session 39: cudaMemPoolSetAccess accepted two descriptors for one device (the last won)
def test_pool_set_access_naming_one_device_twice_is_refused(lib):
    """CUDA Runtime API, cudaMemPoolSetAccess: "Each descriptor instructs the access to enable for a
    single gpu"; which of two descriptors for one device wins is not said.  The project rule (docs
    silent: refuse) and the driver side of the simulator (cuMemSetAccess, r70d: "One location twice
    in one set access is refused") ask for cudaErrorInvalidValue with nothing applied."""
    pool = RFFI.new("cudaMemPool_t *")
    ok(lib.cudaDeviceGetDefaultMemPool(pool, 0))
    ok(lib.cudaMemPoolSetAccess(pool[0], _descs((1, PROT_READ_WRITE)), 1))
    rc = lib.cudaMemPoolSetAccess(pool[0], _descs((1, PROT_READ_WRITE), (1, PROT_NONE)), 2)
    assert rc == cudaErrorInvalidValue
    assert _pool_access(lib, pool[0], 1) == PROT_READ_WRITE     # nothing applied


# -- cudaDeviceReset ends the primary context and what was loaded into it -----------------------------

def test_unloaded_module_handles_are_refused(lib):
    """CUDA Driver API, cuModuleUnload: "Unloads a module hmod from the current context"; its handle
    and the CUfunction handles taken from it are gone: every call accel makes with them
    (cuModuleGetFunction, cuFuncGetAttribute, cuFuncSetAttribute,
    cuOccupancyMaxActiveBlocksPerMultiprocessor, cuModuleUnload) returns CUDA_ERROR_INVALID_HANDLE."""
    keep = []
    mod, fn = load_module(lib, keep)
    assert drv(lib, "cuModuleUnload")(mod) == CUDA_SUCCESS
    pi = D.new("int *")
    out = D.new("CUfunction *")
    assert drv(lib, "cuModuleGetFunction")(out, mod, b"accel_r79a_k") == CUDA_ERROR_INVALID_HANDLE
    assert drv(lib, "cuFuncGetAttribute")(pi, 0, fn) == CUDA_ERROR_INVALID_HANDLE
    assert drv(lib, "cuFuncSetAttribute")(fn, 8, 1024) == CUDA_ERROR_INVALID_HANDLE
    assert drv(lib, "cuOccupancyMaxActiveBlocksPerMultiprocessor")(pi, fn, 128, 0) == CUDA_ERROR_INVALID_HANDLE
    assert drv(lib, "cuModuleUnload")(mod) == CUDA_ERROR_INVALID_HANDLE


def test_unloaded_library_kernels_are_refused(lib):
    """CUDA Runtime API, cudaLibraryUnload: the library and the cudaKernel_t handles taken from it are
    gone: cudaFuncGetAttributes / cudaFuncSetAttribute / cudaOccupancyMaxActiveBlocksPerMultiprocessor
    return cudaErrorInvalidDeviceFunction, cudaLibraryGetKernel and a second unload
    cudaErrorInvalidResourceHandle."""
    library = RFFI.new("cudaLibrary_t *")
    ok(lib.cudaLibraryLoadData(library, _PTX, RFFI.NULL, RFFI.NULL, 0, RFFI.NULL, RFFI.NULL, 0))
    kernel = RFFI.new("cudaKernel_t *")
    ok(lib.cudaLibraryGetKernel(kernel, library[0], b"accel_r79a_k"))
    ok(lib.cudaLibraryUnload(library[0]))
    k = RFFI.cast("void *", kernel[0])
    assert lib.cudaFuncGetAttributes(RFFI.new("struct cudaFuncAttributes *"), k) == cudaErrorInvalidDeviceFunction
    assert lib.cudaFuncSetAttribute(k, 8, 1024) == cudaErrorInvalidDeviceFunction
    assert lib.cudaOccupancyMaxActiveBlocksPerMultiprocessor(RFFI.new("int *"), k, 128, 0) == \
        cudaErrorInvalidDeviceFunction
    assert lib.cudaLibraryGetKernel(kernel, library[0], b"accel_r79a_k") == cudaErrorInvalidResourceHandle
    assert lib.cudaLibraryUnload(library[0]) == cudaErrorInvalidResourceHandle


# r79a, fixed in session 39: cudaDeviceReset left the device's cuModuleLoadData modules and functions usable
def test_module_of_a_reset_device_is_gone(lib):
    """CUDA Driver API, cuModuleLoadData: the module is loaded "into the current context" (here the
    runtime's primary context of device 0).  CUDA Runtime API, cudaDeviceReset: "Explicitly destroys
    and cleans up all resources associated with the current device in the current process" (it
    resets the primary context, cuDevicePrimaryCtxReset: "Destroy all allocations and reset all state
    on the primary context").  The module and its functions die with it; which code a later call gets
    the docs do not say (silent: refused; any of INVALID_HANDLE, INVALID_CONTEXT, CONTEXT_IS_DESTROYED
    is accepted here)."""
    keep = []
    mod, fn = load_module(lib, keep)
    ok(lib.cudaDeviceReset())
    out = D.new("CUfunction *")
    assert drv(lib, "cuModuleGetFunction")(out, mod, b"accel_r79a_k") in DEAD_CONTEXT_CODES
    assert drv(lib, "cuFuncGetAttribute")(D.new("int *"), 0, fn) in DEAD_CONTEXT_CODES


def _primary_active(lib, ordinal):
    dev = D.new("CUdevice_v1 *")
    assert drv(lib, "cuDeviceGet")(dev, ordinal) == CUDA_SUCCESS
    flags, active = D.new("unsigned int *"), D.new("int *")
    assert drv(lib, "cuDevicePrimaryCtxGetState")(dev[0], flags, active) == CUDA_SUCCESS
    return active[0]


# r79a, fixed in session 39: cuDevicePrimaryCtxGetState reported the context active after cudaDeviceReset
def test_primary_context_is_inactive_after_device_reset_until_the_next_call(lib):
    """CUDA Driver API, cuDevicePrimaryCtxRetain: the primary context "will be active and available to
    the user until the user releases it with cuDevicePrimaryCtxRelease() or resets it with
    cuDevicePrimaryCtxReset()"; cudaDeviceReset resets it ("Any subsequent API call to this device will
    reinitialize the device").  A native trace (lupinemachines/lupine issue 844) shows cudaDeviceReset
    calling cuDevicePrimaryCtxReset and cuDevicePrimaryCtxGetState answering active=0 afterwards, until
    the next runtime call on the device retains it again."""
    ok(lib.cudaSetDevice(0))
    ok(lib.cudaFree(RFFI.NULL))                  # the runtime's usual way to make the context
    assert _primary_active(lib, 0) == 1
    ok(lib.cudaDeviceReset())
    assert _primary_active(lib, 0) == 0          # reset: inactive
    ok(lib.cudaFree(RFFI.NULL))                  # a runtime call on the device: active again
    assert _primary_active(lib, 0) == 1


@pytest.fixture
def counting_kernel():
    """A reference for the test PTX's kernel that counts its runs (unregistered afterwards)."""
    runs = []
    sim.register_kernel("accel_r79a_k", lambda grid, block, view, a: runs.append(a), "u64", replace=True)
    yield runs
    sim.unregister_kernel("accel_r79a_k")


def launch_counting(lib, kernel, s, value=1):
    arg = RFFI.new("uint64_t *", value)
    argv = RFFI.new("void *[]", [RFFI.cast("void *", arg)])
    return lib.cudaLaunchKernel(RFFI.cast("void *", kernel), RFFI.new("dim3 *", (1, 1, 1))[0],
                                RFFI.new("dim3 *", (1, 1, 1))[0], argv, 0, s)


# r79a, fixed in session 39: a graph exec of the device still launched and ran after cudaDeviceReset
def test_graph_exec_of_a_reset_device_is_refused(lib, counting_kernel):
    """CUDA Runtime API, cudaDeviceReset: "Explicitly destroys and cleans up all resources associated
    with the current device in the current process"; the simulator ends the device's streams and
    events with it, but an executable graph instantiated there (cudaGraphInstantiate: device-side work
    made in the context the reset destroyed) still launches.  What such an exec does after the reset
    the Runtime API does not say (docs silent: refused, nothing run).  The kernel comes from a
    cudaLibrary (context-independent loading), and the graph itself (no context) may be instantiated
    again: both stay usable."""
    library = RFFI.new("cudaLibrary_t *")
    ok(lib.cudaLibraryLoadData(library, _PTX, RFFI.NULL, RFFI.NULL, 0, RFFI.NULL, RFFI.NULL, 0))
    kernel = RFFI.new("cudaKernel_t *")
    ok(lib.cudaLibraryGetKernel(kernel, library[0], b"accel_r79a_k"))
    s = stream(lib)
    ok(lib.cudaStreamBeginCapture(s, 0))
    ok(launch_counting(lib, kernel[0], s))
    graph = RFFI.new("cudaGraph_t *")
    ok(lib.cudaStreamEndCapture(s, graph))
    x = RFFI.new("cudaGraphExec_t *")
    ok(lib.cudaGraphInstantiate(x, graph[0], 0))
    ok(lib.cudaGraphLaunch(x[0], s))
    ok(lib.cudaStreamSynchronize(s))
    assert counting_kernel == [1]                # the exec runs before the reset
    ok(lib.cudaDeviceReset())
    s2 = stream(lib)
    rc = lib.cudaGraphLaunch(x[0], s2)
    ok(lib.cudaStreamSynchronize(s2))
    assert rc != 0
    assert counting_kernel == [1]                # nothing ran
    x2 = RFFI.new("cudaGraphExec_t *")
    ok(lib.cudaGraphInstantiate(x2, graph[0], 0))
    ok(lib.cudaGraphLaunch(x2[0], s2))
    ok(lib.cudaStreamSynchronize(s2))
    assert counting_kernel == [1, 1]


# -- cudaMemcpyPeerAsync: the device numbers must name the pointers' devices ----------------------------

def test_memcpy_peer_refuses_device_numbers_that_do_not_name_the_pointers(lib):
    """CUDA Runtime API, cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream): "Copies
    memory from one device to memory on another device.  dst is the base device pointer of the
    destination memory and dstDevice is the destination device"; what a pointer of another device, or
    host memory, does there the page does not say: refused (cudaErrorInvalidValue), nothing copied."""
    a0 = malloc_on(lib, 0, 4096)
    a1 = malloc_on(lib, 1, 4096)
    s = stream(lib)
    ok(lib.cudaMemset(a0, 7, 4096))
    ok(lib.cudaSetDevice(1))
    ok(lib.cudaMemset(a1, 0, 4096))
    ok(lib.cudaSetDevice(0))
    # the devices swapped
    assert lib.cudaMemcpyPeerAsync(a1, 0, a0, 1, 256, s) == cudaErrorInvalidValue
    # pinned and pageable host memory as the destination
    host = RFFI.new("void **")
    ok(lib.cudaHostAlloc(host, 4096, 0))
    assert lib.cudaMemcpyPeerAsync(host[0], 1, a0, 0, 256, s) == cudaErrorInvalidValue
    arr = np.zeros(256, np.uint8)
    assert lib.cudaMemcpyPeerAsync(RFFI.cast("void *", arr.ctypes.data), 1, a0, 0, 256, s) == cudaErrorInvalidValue
    # more bytes than the allocations hold
    assert lib.cudaMemcpyPeerAsync(a1, 1, a0, 0, 8192, s) == cudaErrorInvalidValue
    assert lib.cudaGetLastError() == cudaErrorInvalidValue   # the refusals' last error, now cleared
    ok(lib.cudaStreamSynchronize(s))
    assert not read_back(lib, a1, 1).any()       # nothing was copied
    assert not arr.any()
    # the documented call copies
    ok(lib.cudaMemcpyPeerAsync(a1, 1, a0, 0, 256, s))
    ok(lib.cudaStreamSynchronize(s))
    got = read_back(lib, a1, 1)
    assert (got[:256] == 7).all() and not got[256:].any()
    ok(lib.cudaFreeHost(host[0]))
