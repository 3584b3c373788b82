"""Errors and versions (the calls that start no runtime), and device management: count,
current device, attributes and properties, peer access, synchronize, reset.
"""

from __future__ import annotations

from typing import Dict

from .. import _memory, core, kernels
from .._cuda_strings import ERROR_STRINGS, UNRECOGNIZED
from ..core import ffi
from . import state
from .state import (
    _CHARP, _L2, _PRIORITY_GREATEST, _PRIORITY_LEAST, _SHARED_PER_BLOCK, _SM_COUNT, Runtime, Stream, _addr,
    cudaErrorInvalidDevice, cudaErrorInvalidValue, blocks_per_sm, shared_per_block_optin, shared_per_sm,
    shared_reserved_per_block, threads_per_sm,
    cudaErrorNotSupported, cudaErrorPeerAccessAlreadyEnabled, cudaErrorPeerAccessNotEnabled,
    cudaErrorPeerAccessUnsupported, cudaErrorStreamCaptureUnsupported, cudaSuccess, _error_name,
)
from .common import (
    _cstr, _destroy_stream, _device_captures, _invalidate, _is_null, _put, _unsafe_call, _wait_device,
)
from .graph_memory import _graph_mem_exec_destroyed
from .pools import _pool_access_problem, _pool_memory


def cudaGetErrorName(error):
    """``const char *`` name of ``error`` ("unrecognized error code" if unknown)."""
    return _cstr("name", error, _error_name(error))


def cudaGetErrorString(error):
    """``const char *`` description of ``error``, the runtime's own text."""
    return _cstr("string", error, ERROR_STRINGS.get(error, UNRECOGNIZED))


def cudaGetLastError():
    R = state._R       # read live: created on first use, replaced by a reset
    if R is None:
        return cudaSuccess
    rc = R.tls.last_error
    R.tls.last_error = 0
    return R.sticky or rc      # a sticky error is never cleared


def cudaPeekAtLastError():
    R = state._R       # read live: created on first use, replaced by a reset
    return cudaSuccess if R is None else (R.sticky or R.tls.last_error)


def cudaRuntimeGetVersion(runtimeVersion):
    version = core.config().runtime_version
    try:
        runtimeVersion[0] = version
    except (TypeError, RuntimeError):
        if _is_null(runtimeVersion):
            return cudaErrorInvalidValue
        _put(runtimeVersion, version)
    return cudaSuccess


def cudaDriverGetVersion(driverVersion):
    if _is_null(driverVersion):
        return cudaErrorInvalidValue
    cfg = core.config()
    _put(driverVersion, cfg.driver_version if cfg.driver else 0)
    return cudaSuccess


#: Runtime calls that create no primary context.  CUDA Programming Guide, "Initialization":
#: the runtime "will implicitly use device 0 and self-initialize as needed"; a device's primary
#: context "is initialized at the first runtime function which requires an active context on
#: this device".  The device-management queries answer from the driver without one (torch's
#: test_cuda_primary_ctx.py relies on it); cudaSetDevice/cudaInitDevice mark their own target.
#: (r79a) So do the driver entry-point look-ups: an address of a driver function (cuGetProcAddress)
#: needs no context, and callers that want one make it themselves (meta-pytorch/monarch PR 4226:
#: its DriverAPI::get() called cudaFree(0) "to lazily bind a CUDA context").
#: Every other call marks the calling thread's current device.
_NO_CONTEXT = frozenset({
    "cudaGetDeviceCount", "cudaGetDevice", "cudaSetDevice", "cudaInitDevice", "cudaGetDeviceProperties",
    "cudaGetDeviceProperties_v2", "cudaDeviceGetAttribute", "cudaDeviceGetPCIBusId",
    "cudaDeviceCanAccessPeer", "cudaGetDriverEntryPoint", "cudaGetDriverEntryPointByVersion",
})


_NO_INIT = {
    "cudaGetErrorName": cudaGetErrorName, "cudaGetErrorString": cudaGetErrorString,
    "cudaGetLastError": cudaGetLastError, "cudaPeekAtLastError": cudaPeekAtLastError,
    "cudaRuntimeGetVersion": cudaRuntimeGetVersion, "cudaDriverGetVersion": cudaDriverGetVersion,
}


# -- device management ------------------------------------------------------------------

def cudaGetDeviceCount(R, count):
    if _is_null(count):
        return cudaErrorInvalidValue
    _put(count, len(R.devices))
    return R.init_error


def cudaSetDevice(R, device):
    if not (0 <= device < len(R.devices)):
        return cudaErrorInvalidDevice
    R.tls.device = device
    # CUDA Programming Guide, "Initialization": "As of CUDA 12.0, the cudaInitDevice() and
    # cudaSetDevice() calls initialize the runtime and the primary context associated with the
    # specified device."
    R.devices[device].context = True
    return cudaSuccess


def cudaGetDevice(R, device):
    try:
        device[0] = R.tls.device
    except (TypeError, RuntimeError):
        if _is_null(device):
            return cudaErrorInvalidValue
        _put(device, R.tls.device)
    return cudaSuccess


def cudaInitDevice(R, device, deviceFlags, flags):
    if not (0 <= device < len(R.devices)):
        return cudaErrorInvalidDevice
    if flags & ~0x1:
        return cudaErrorInvalidValue
    R.devices[device].context = True        # as cudaSetDevice (Programming Guide, "Initialization")
    return cudaSuccess


def _attributes(R: Runtime, d: int) -> Dict[int, int]:
    dev = R.devices[d]
    if dev.attrs is None:
        major, minor = cc = R.cfg.compute_capability
        dev.attrs = {
            1: 1024, 2: 1024, 3: 1024, 4: 64, 5: 2 ** 31 - 1, 6: 65535, 7: 65535,
            8: _SHARED_PER_BLOCK, 9: 65536, 10: 32, 11: 2 ** 31 - 1, 12: 65536, 13: 1980000,
            14: 512, 15: 1, 16: _SM_COUNT, 17: 0, 18: 0, 19: 1, 20: 0,
            30: 512, 31: 1, 32: 1, 33: core.pci_bus(dev.physical), 34: 0, 35: 0, 36: 2619000,
            37: 5120, 38: _L2, 39: threads_per_sm(cc), 40: 2, 41: 1, 50: 0, 51: 32,
            75: major, 76: minor, 78: 1, 79: 1, 80: 1, 81: shared_per_sm(cc), 82: 65536,
            83: 1, 84: 0, 85: d, 86: 0, 87: 2, 88: 0, 89: 1, 90: 1, 91: 1, 95: 1,
            97: shared_per_block_optin(cc), 98: 1, 99: 1, 100: 0, 101: 0, 106: blocks_per_sm(cc), 108: _L2 // 2,
            109: 134213632, 111: shared_reserved_per_block(cc), 112: 1, 113: 1, 114: 1, 115: 1, 116: 1, 117: 1,
            118: 0,
            119: 9, 120: 1 if major >= 9 else 0, 121: 1, 125: 1, 126: 4, 130: 0, 131: -1, 133: 0,
            134: -1, 139: 0x233010DE, 140: 0x16C110DE,
        }
    return dev.attrs


#: The last cudaDeviceAttr / CUdevice_attribute a driver of CUDA 12.4 knows: cudaDevAttrHostNumaId = 134
#: (its driver_types.h ends the enumeration at cudaDevAttrMax = 135: accel/_ffi/_cudart12.py, generated
#: from the 12.4 headers).  CUDA 13.0's ends at 148 (cudaDevAttrOnlyPartialHostNativeAtomicSupported =
#: 147).  The releases between add attributes 135-147 in steps the simulator does not model: a driver
#: from 12.5 to 12.9 answers all of them (still lenient).
_LAST_ATTRIBUTE_12_4, _LAST_ATTRIBUTE_13_0 = 134, 147


def last_attribute(driver_version: int) -> int:
    """The highest device attribute value a driver of CUDA ``driver_version`` knows."""
    return _LAST_ATTRIBUTE_12_4 if driver_version < 12050 else _LAST_ATTRIBUTE_13_0


def cudaDeviceGetAttribute(R, value, attr, device):
    if not (0 <= device < len(R.devices)):
        return cudaErrorInvalidDevice
    # (r72a) CUDA Runtime API, cudaDeviceGetAttribute: cudaErrorInvalidValue for an attribute that is no
    # cudaDeviceAttr.  The runtime asks the driver (cuDeviceGetAttribute, which has the same values and
    # code), and an attribute added after the driver's release is none to it: a 12.4 driver refuses
    # cudaDevAttrGpuPciDeviceId (139), say, whatever the runtime's headers.  The simulator answered every
    # value up to 147 on every driver version.
    if _is_null(value) or not (1 <= attr <= last_attribute(R.cfg.driver_version)):
        return cudaErrorInvalidValue
    _put(value, _attributes(R, device).get(attr, 0))
    return cudaSuccess


def _set_fields(obj, values: dict) -> None:
    for name, v in values.items():
        try:
            setattr(obj, name, v)
        except AttributeError:   # field absent from this header version
            pass


def _device_properties(R, prop, device, major: int):
    """Write ``struct cudaDeviceProp`` in the layout of CUDA ``major``'s headers into ``prop``.

    The real library writes its own layout whatever the caller declared (CUDA 12 and 13
    differ: fields removed in 13 shift multiProcessorCount, integrated, ...), so the
    struct is filled by field name in that layout (accel._ffi.cudart_module(major)) and
    its bytes copied into the caller's memory: a caller reading it through the other
    major's declarations reads garbage, as on real hardware.  A caller's struct smaller
    than the layout would be overrun by the real library; the simulator refuses it
    (cudaErrorInvalidValue) instead of corrupting memory."""
    if not (0 <= device < len(R.devices)):
        return cudaErrorInvalidDevice
    if _is_null(prop):
        return cudaErrorInvalidValue
    from accel._ffi import cudart_module
    own_ffi = cudart_module(major).ffi
    try:
        room = len(ffi.buffer(prop))
    except TypeError:           # a bare address: the caller's size is unknown
        room = None
    size = own_ffi.sizeof("struct cudaDeviceProp")
    if room is not None and room < size:
        return cudaErrorInvalidValue
    own = own_ffi.new("struct cudaDeviceProp *")
    _fill_device_properties(R, own, device)
    ffi.memmove(ffi.cast(_CHARP, _addr(prop)), own_ffi.buffer(own), size)
    return cudaSuccess


def cudaGetDeviceProperties(R, prop, device):
    """The plain symbol.  CUDA 13: the current layout.  CUDA 12 (REFERENCE.md "Runtime vs
    driver versions"): its headers map the name to cudaGetDeviceProperties_v2, and the
    plain symbol kept the pre-12.0 layout, which accel has no bindings for (no headers
    of it are generated): refused with cudaErrorNotSupported rather than written in a
    layout the simulator cannot model."""
    major = R.cfg.runtime_version // 1000
    if major < 13:
        return cudaErrorNotSupported
    return _device_properties(R, prop, device, major)


def cudaGetDeviceProperties_v2(R, prop, device):
    """CUDA 12.x (what its headers call cudaGetDeviceProperties): the 12.0+ layout.
    Exported by the 12.x libraries only (accel/sim/cudart_symbols)."""
    return _device_properties(R, prop, device, 12)


def _fill_device_properties(R, prop, device):
    cfg = R.cfg
    dev = R.devices[device]
    a = _attributes(R, device)
    prop.name = cfg.name.encode()[:255]
    prop.uuid.bytes = core.uuid_bytes(dev.physical)
    _set_fields(prop, {
        "totalGlobalMem": cfg.memory, "sharedMemPerBlock": a[8], "regsPerBlock": a[12], "warpSize": a[10],
        "memPitch": a[11], "maxThreadsPerBlock": a[1], "maxThreadsDim": [a[2], a[3], a[4]],
        "maxGridSize": [a[5], a[6], a[7]], "totalConstMem": a[9],
        "major": cfg.compute_capability[0], "minor": cfg.compute_capability[1],
        "textureAlignment": a[14], "texturePitchAlignment": a[51], "multiProcessorCount": a[16],
        "integrated": 0, "canMapHostMemory": 1, "surfaceAlignment": a[30], "concurrentKernels": 1,
        "ECCEnabled": 1, "pciBusID": a[33], "pciDeviceID": 0, "pciDomainID": 0, "tccDriver": 0,
        "asyncEngineCount": a[40], "unifiedAddressing": 1, "memoryBusWidth": a[37], "l2CacheSize": a[38],
        "persistingL2CacheMaxSize": a[108], "maxThreadsPerMultiProcessor": a[39],
        "streamPrioritiesSupported": 1, "globalL1CacheSupported": 1, "localL1CacheSupported": 1,
        "sharedMemPerMultiprocessor": a[81], "regsPerMultiprocessor": a[82], "managedMemory": 1,
        "isMultiGpuBoard": 0, "multiGpuBoardGroupID": device, "hostNativeAtomicSupported": 0,
        "pageableMemoryAccess": 0, "concurrentManagedAccess": 1, "computePreemptionSupported": 1,
        "canUseHostPointerForRegisteredMem": 1, "cooperativeLaunch": 1,
        "sharedMemPerBlockOptin": a[97], "maxBlocksPerMultiProcessor": a[106],
        "accessPolicyMaxWindowSize": a[109], "reservedSharedMemPerBlock": a[111],
        "hostRegisterSupported": 1, "sparseCudaArraySupported": 1, "hostRegisterReadOnlySupported": 1,
        "timelineSemaphoreInteropSupported": 1, "memoryPoolsSupported": 1, "gpuDirectRDMASupported": 1,
        "gpuDirectRDMAFlushWritesOptions": 1, "memoryPoolSupportedHandleTypes": a[119],
        "deferredMappingCudaArraySupported": 1, "ipcEventSupported": 1, "clusterLaunch": a[120],
        "unifiedFunctionPointers": 1, "deviceNumaConfig": 0, "deviceNumaId": -1, "hostNumaId": -1,
        "gpuPciDeviceID": a[139], "gpuPciSubsystemID": a[140],
        # CUDA 12 layout only (removed in 13; cudaDeviceGetAttribute still answers them)
        "clockRate": a[13], "memoryClockRate": a[36], "deviceOverlap": 1, "kernelExecTimeoutEnabled": 0,
        "computeMode": 0, "cooperativeMultiDeviceLaunch": 0, "singleToDoublePrecisionPerfRatio": 2,
    })


def cudaDeviceGetPCIBusId(R, pciBusId, len_, device):
    if not (0 <= device < len(R.devices)):
        return cudaErrorInvalidDevice
    if _is_null(pciBusId) or len_ <= 0:
        return cudaErrorInvalidValue
    text = b"0000:%02x:00.0" % core.pci_bus(R.devices[device].physical)
    text = text[:len_ - 1] + b"\0"
    ffi.memmove(ffi.cast(_CHARP, _addr(pciBusId)), text, len(text))
    return cudaSuccess


def cudaDeviceCanAccessPeer(R, canAccessPeer, device, peerDevice):
    n = len(R.devices)
    if not (0 <= device < n and 0 <= peerDevice < n):
        return cudaErrorInvalidDevice
    if _is_null(canAccessPeer):
        return cudaErrorInvalidValue
    # (r71g) CUDA Runtime API, cudaDeviceCanAccessPeer: "Returns in *canAccessPeer a value of 1 if
    # device device is capable of directly accessing memory from peerDevice and 0 otherwise";
    # whether it can depends on the machine (Programming Guide, "Peer-to-Peer Memory Access":
    # "depending on the system properties, specifically the PCIe and/or NVLINK topology").  Before
    # r71g every distinct pair answered 1; core.peer_capable follows ACCEL_SIM_PEER (default: all).
    _put(canAccessPeer, 1 if _peer_capable(R, device, peerDevice) else 0)
    return cudaSuccess


def _peer_capable(R: Runtime, device: int, peer: int) -> bool:
    """(r71g) Whether runtime devices ``device`` and ``peer`` are peer-capable (by their physical
    devices: CUDA_VISIBLE_DEVICES reorders ordinals, not the PCIe/NVLink topology)."""
    return device != peer and core.peer_capable(R.devices[device].physical, R.devices[peer].physical)


def _peer_call_in_capture(R: Runtime) -> int:
    """0, or cudaErrorStreamCaptureUnsupported (900) after invalidating the captures that prohibit a
    potentially unsafe call by this thread now (common._unsafe_call: the thread's own non-relaxed
    capture, or another thread's global capture unless this thread is relaxed).

    (r69d) cudaDeviceEnablePeerAccess / cudaDeviceDisablePeerAccess.  The Runtime API pages say
    nothing of stream capture; the calls are not stream operations: "On success, all allocations
    from peerDevice will immediately be accessible by the current device.  They will remain
    accessible until access is explicitly disabled using cudaDeviceDisablePeerAccess()" -- a change,
    at once and for the whole context, of what every kernel may touch (work already queued or
    captured included), which no graph node can stand for.  Docs silent: refused as potentially
    unsafe, as the simulator refuses the other access changes (cudaMemPoolSetAccess, r68d;
    cuMemSetAccess), 900 and the capture invalidated; the thread's relaxed mode allows them.
    Before r69d both were accepted in any capture."""
    return _unsafe_call(R) if R.captures else 0


def cudaDeviceEnablePeerAccess(R, peerDevice, flags):
    """Let kernels of the current device access ``peerDevice``'s memory (one direction only).

    CUDA Runtime API, cudaDeviceEnablePeerAccess: access is unidirectional; flags must be 0;
    cudaErrorPeerAccessAlreadyEnabled when already enabled; cudaErrorInvalidDevice for a device
    out of range.  The current device itself (cudaDeviceCanAccessPeer(d, d) is 0): the docs name
    no code; cudaErrorPeerAccessUnsupported ("P2P access is not supported across the given
    devices"), measured on an H100, tests/conformance/cuda_h100_2026-12-05.json, scenario
    peer_access_one_device (driver 580.159.04, libcudart 13.0), with any number of devices."""
    d = R.tls.device
    if not (0 <= peerDevice < len(R.devices)):
        return cudaErrorInvalidDevice
    if peerDevice == d:
        return cudaErrorPeerAccessUnsupported
    if flags != 0:
        return cudaErrorInvalidValue
    if not _peer_capable(R, d, peerDevice):
        # (r71g) CUDA Runtime API, cudaDeviceEnablePeerAccess: "Returns
        # cudaErrorPeerAccessUnsupported if cudaDeviceCanAccessPeer() indicates that the current
        # device cannot directly access memory from peerDevice" (Driver API, cuCtxEnablePeerAccess:
        # CUDA_ERROR_PEER_ACCESS_UNSUPPORTED likewise).  Nothing is enabled; kernels of the current
        # device keep faulting on peerDevice's memory (_device_view).  Copies need no peer access:
        # cudaMemcpyPeer/cudaMemcpyPeerAsync and cudaMemcpy between devices are staged by the driver.
        return cudaErrorPeerAccessUnsupported
    rc = _peer_call_in_capture(R)
    if rc:
        return rc
    peers = R.devices[d].peers
    if peerDevice in peers:
        return cudaErrorPeerAccessAlreadyEnabled
    peers.add(peerDevice)
    return cudaSuccess


def cudaDeviceDisablePeerAccess(R, peerDevice):
    """CUDA Runtime API, cudaDeviceDisablePeerAccess: cudaErrorPeerAccessNotEnabled unless
    cudaDeviceEnablePeerAccess(peerDevice) was called on the current device."""
    if not (0 <= peerDevice < len(R.devices)):
        return cudaErrorInvalidDevice
    rc = _peer_call_in_capture(R)
    if rc:
        return rc
    peers = R.devices[R.tls.device].peers
    if peerDevice not in peers:
        return cudaErrorPeerAccessNotEnabled
    peers.discard(peerDevice)
    return cudaSuccess


def _device_view(R: Runtime, device: int):
    """``kernels.view`` as seen by a kernel running on ``device``: another device's memory is
    reachable only after cudaDeviceEnablePeerAccess (CUDA Programming Guide, "Peer-to-Peer
    Memory Access"); otherwise the access faults (cudaErrorIllegalAddress).  Pinned host
    memory is reachable from every device (unified addressing makes it portable)."""
    dev = R.devices[device]
    v = dev.view
    if v is None:
        peers, find, base_view, addr_of = dev.peers, R.mem.find, kernels.view, _memory.addr_of
        vm = R.vmm

        def v(ptr, nbytes, dtype=None):
            addr = addr_of(ptr)
            if vm.reservations:
                # Virtual memory: every byte mapped, with read-write access for this device
                # (CUDA Driver API, cuMemMap: "does not make the address accessible"; cuMemSetAccess).
                region = vm.resolve(addr, nbytes, device, True)
                if region.__class__ is str:
                    raise kernels.MemoryRangeError(f"a kernel on device {device} touched {region}")
                if region is not None:
                    return kernels.view_checked_range(addr, nbytes, dtype)
            a = find(addr)
            if a is not None and a.kind == _memory.DEVICE and (a.device != device or not a.live):
                why = _pool_access_problem(R, a, device, None)
                if why is not None:
                    raise kernels.MemoryRangeError(f"a kernel on device {device} touched 0x{addr:x}: {why}")
                if a.device != device and a.device not in peers and not _pool_memory(R, a):
                    raise kernels.MemoryRangeError(
                        f"a kernel on device {device} touched 0x{addr:x}, memory of device {a.device}, "
                        f"without peer access (cudaDeviceEnablePeerAccess({a.device}, 0) on device {device})")
            return base_view(addr, nbytes, dtype)
        dev.view = v
    return v


def cudaDeviceGetStreamPriorityRange(R, leastPriority, greatestPriority):
    if not _is_null(leastPriority):
        _put(leastPriority, _PRIORITY_LEAST)
    if not _is_null(greatestPriority):
        _put(greatestPriority, _PRIORITY_GREATEST)
    return cudaSuccess


def _refused_with_device_captures(R, d) -> int:
    """0, or the error of a call that waits for device ``d`` (or resets it) while a capture is
    underway: a potentially unsafe call's refusal (``_unsafe_call``), else 900 with the
    device's captures invalidated."""
    if not R.captures:
        return 0
    rc = _unsafe_call(R)
    if rc:
        return rc
    caps = _device_captures(R, d)
    for cap in caps:
        _invalidate(R, cap)
    return cudaErrorStreamCaptureUnsupported if caps else 0


def cudaDeviceSynchronize(R):
    d = R.tls.device
    rc = _refused_with_device_captures(R, d)
    if rc:
        return rc
    _wait_device(R, d)
    return R.sticky


def cudaDeviceReset(R):
    """Wait for the current device, then drop its memory, streams, events, modules and graph execs, and
    leave its primary context inactive."""
    d = R.tls.device
    dev = R.devices[d]
    if R.captures:
        # (r69d) CUDA Runtime API, cudaDeviceReset: "Explicitly destroys and cleans up all resources
        # associated with the current device in the current process" -- it frees the device's memory
        # (as cudaFree, a potentially unsafe call: _unsafe_call) and destroys its streams, a
        # capture's among them; CUDA Programming Guide, "CUDA Graphs" > "Prohibited and Unhandled
        # Operations": "It is also invalid to query the execution status of or synchronize a broader
        # handle which encompasses an active stream capture, such as a device or context handle when
        # any associated stream is in capture mode" (cudaDeviceSynchronize: 900 in any mode).  The
        # docs do not say what a reset does to a capture underway; before r69d the simulator
        # invalidated it and reset anyway, destroying the capture's origin stream, so the capture
        # could never be ended and every later potentially unsafe call (cudaMalloc, ...) in global
        # mode returned 900 for good.  Refused now as cudaDeviceSynchronize is: 900, the captures
        # invalidated, nothing reset.
        rc = _refused_with_device_captures(R, d)
        if rc:
            return rc
    _wait_device(R, d)
    for a in R.mem.all():
        if a.kind == _memory.DEVICE and a.device == d:
            R.mem.remove(a)
    with R.mlock:
        dev.used = dev.vmm      # cuMemCreate'd memory is not the context's: it stays until cuMemRelease
        pool = R.default_pools.get(d)
        if pool is not None:
            pool.used = pool.reserved = 0
    for base in [b for b, (p, _n) in R.async_allocs.items() if p.device == d]:
        del R.async_allocs[base]
    R.gmem.forget_device(d)
    # CUDA Runtime API, cudaDeviceEnablePeerAccess: peer allocations "will remain accessible until
    # access is explicitly disabled using cudaDeviceDisablePeerAccess() or either device is reset
    # using cudaDeviceReset()": the reset ends this device's access to its peers and every other
    # device's access to this one (r68d: the other devices kept it, so their kernels could touch
    # this device's memory after the reset and re-enabling returned 704).
    dev.peers.clear()
    for other in R.devices:
        other.peers.discard(d)
    for s in [s for s in set(R.streams.values()) if s.__class__ is Stream and s.device == d]:
        _destroy_stream(R, s)
    for e in [e for e in set(R.events.values()) if e.device == d]:
        Runtime.drop(R.events, e)
        R.free_events.append(e.handle)
    # (r79a) What lived in the primary context dies with it.  cuModuleLoadData loads a module "into
    # the current context", so the device's CUmodules are unloaded as cuModuleUnload would (their
    # handles and CUfunctions refused after); cudaLibrary_t (device None) is context-independent
    # and stays.  An executable graph of the device (cudaGraphInstantiate: work made in that
    # context) is dropped with its graph memory; what a later launch of it does the docs do not
    # say (silent: refused, as an unknown exec).  Its graph holds no context: it may be
    # instantiated again.
    from .modules import unload     # modules imports this module
    for lib in [lib for lib in set(R.libraries.values()) if lib.device == d]:
        unload(R, lib)
    for x in [x for x in set(R.execs.values()) if x.device == d]:
        Runtime.drop(R.execs, x)
        em = R.gmem.execs.pop(x, None)
        if em is not None:
            _graph_mem_exec_destroyed(R, em)
    # Driver API, cuDevicePrimaryCtxRetain: the primary context is active "until the user releases
    # it with cuDevicePrimaryCtxRelease() or resets it with cuDevicePrimaryCtxReset()", which is what
    # cudaDeviceReset calls (a native trace: lupinemachines/lupine issue 844, active=0 afterwards);
    # the next runtime call on the device makes it again ("Any subsequent API call to this device
    # will reinitialize the device": the wrapper in __init__.py).
    dev.context = False
    return R.sticky
