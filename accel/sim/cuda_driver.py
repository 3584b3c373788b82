"""The driver functions the simulated cudaGetDriverEntryPoint hands out.

Each is a cffi callback with the driver's own signature (the ``PFN_*`` types of
``accel/_ffi/_cudadrv.py``, from cudaTypedefs.h), so the caller casts the
pointer and calls it exactly as it calls the real driver.  They work on the
simulated runtime's state: a module loaded with cuModuleLoadData belongs to
the current device's context, cuLaunchKernel follows the same launch rules as
cudaLaunchKernel (and is captured like it), and they return CUresult codes
(cuda.h), not cudaError_t.  Only the functions accel uses are simulated; any
other symbol is "not found" (stricter than a real driver, never more lenient).

Virtual memory (cuMemAddressReserve/Free, cuMemCreate/Release, cuMemMap/Unmap,
cuMemSetAccess/GetAccess, cuMemGetAllocationGranularity) works on the runtime's
:class:`accel.sim._vmm.Space`; each rule cites the CUDA Driver API reference, section
"Virtual Memory Management" (the function's entry), and is listed in accel/sim/README.md.
"""

from __future__ import annotations

import mmap
import threading
from typing import Dict, Optional, Tuple

from . import _vmm, core
from ._cuda_strings import ERROR_STRINGS

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_INVALID_HANDLE = 400
CUDA_ERROR_NOT_FOUND = 500
CUDA_ERROR_NOT_SUPPORTED = 801

# cudaError_t from the shared launch path -> the CUresult cuLaunchKernel returns (cuda.h); the
# other codes the path returns (1, 400, 700, 719, 900-908) have the same value in both enums.  A
# block or grid outside the limits is cudaErrorInvalidValue there (as an H100,
# tests/conformance/cuda_h100_2026-12-05.json, scenario launch_configurations), so
# CUDA_ERROR_INVALID_VALUE here; cudaErrorInvalidConfiguration is mapped should it come back.
_LAUNCH_CODES = {9: CUDA_ERROR_INVALID_VALUE,      # cudaErrorInvalidConfiguration
                 98: CUDA_ERROR_INVALID_HANDLE}    # cudaErrorInvalidDeviceFunction

#: symbol -> (PFN type, the CUDA version that introduced this ABI (its _v suffix)).
SYMBOLS: Dict[str, Tuple[str, int]] = {
    "cuGetErrorName": ("PFN_cuGetErrorName_v6000", 6000),
    "cuGetErrorString": ("PFN_cuGetErrorString_v6000", 6000),
    "cuModuleLoadData": ("PFN_cuModuleLoadData_v2000", 2000),
    "cuModuleUnload": ("PFN_cuModuleUnload_v2000", 2000),
    "cuModuleGetFunction": ("PFN_cuModuleGetFunction_v2000", 2000),
    "cuLaunchKernel": ("PFN_cuLaunchKernel_v4000", 4000),
    "cuFuncGetAttribute": ("PFN_cuFuncGetAttribute_v2020", 2020),
    "cuFuncSetAttribute": ("PFN_cuFuncSetAttribute_v9000", 9000),
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": ("PFN_cuOccupancyMaxActiveBlocksPerMultiprocessor_v6050", 6050),
    "cuDeviceGet": ("PFN_cuDeviceGet_v2000", 2000),
    "cuDeviceGetAttribute": ("PFN_cuDeviceGetAttribute_v2000", 2000),
    "cuMemGetAllocationGranularity": ("PFN_cuMemGetAllocationGranularity_v10020", 10020),
    "cuMemAddressReserve": ("PFN_cuMemAddressReserve_v10020", 10020),
    "cuMemAddressFree": ("PFN_cuMemAddressFree_v10020", 10020),
    "cuMemCreate": ("PFN_cuMemCreate_v10020", 10020),
    "cuMemRelease": ("PFN_cuMemRelease_v10020", 10020),
    "cuMemMap": ("PFN_cuMemMap_v10020", 10020),
    "cuMemUnmap": ("PFN_cuMemUnmap_v10020", 10020),
    "cuMemSetAccess": ("PFN_cuMemSetAccess_v10020", 10020),
    "cuMemGetAccess": ("PFN_cuMemGetAccess_v10020", 10020),
    "cuDevicePrimaryCtxGetState": ("PFN_cuDevicePrimaryCtxGetState_v7000", 7000),
}

_lock = threading.Lock()
_callbacks: Dict[str, object] = {}     # symbol -> callback cdata (kept alive for the process)
_names: Dict[tuple, object] = {}       # (CUresult, names?) -> const char * (cuGetErrorName/String)


_DFFI = None
_CUDART = None


def _dffi():
    global _DFFI
    if _DFFI is None:
        from accel._ffi._cudadrv import ffi
        _DFFI = ffi
    return _DFFI


def entry_point(name: str, version: int, driver_version: int, flags: int = 0):
    """(cudaDriverEntryPointQueryResult, void* or None) for driver symbol ``name`` of ABI ``version``;
    ``flags`` cudaEnablePerThreadDefaultStream (2) hands out the per-thread version where the driver
    has one (cuLaunchKernel_ptsz)."""
    # CUDA Driver API, cuGetProcAddress (what the runtime calls): SymbolNotFound for a symbol the
    # driver lacks; VersionNotSufficient when it exists but ``version`` predates its first ABI.
    # A ``version`` newer than the driver gets the newest ABI the driver has (minor version
    # compatibility: a 12.4 runtime on a 12.2 driver).
    spec = SYMBOLS.get(name)
    if spec is None or spec[1] > driver_version:
        return 1, None        # cudaDriverEntryPointSymbolNotFound
    if version < spec[1]:
        return 2, None        # cudaDriverEntryPointVersionNotSufficent
    # (r70d) CUDA Runtime API, cudaGetDriverEntryPoint[ByVersion]: cudaEnableLegacyStream searches
    # "all driver symbols that match the requested driver symbol name except the corresponding
    # per-thread versions"; cudaEnablePerThreadDefaultStream "including the per-thread versions"
    # (cudaEnableDefault is legacy unless the caller is built with --default-stream per-thread,
    # which a cffi caller is not).  The per-thread cuLaunchKernel (cuLaunchKernel_ptsz) takes a NULL
    # stream as the calling thread's per-thread default stream; before r70d every flag got the
    # legacy function, so a per-thread program's launches were serialized on the legacy stream.
    key = name + "_ptsz" if flags == _ENTRY_PER_THREAD and name in _PER_THREAD_IMPLS else name
    with _lock:
        cb = _callbacks.get(key)
        if cb is None:
            dffi = _dffi()
            fn = _PER_THREAD_IMPLS[name] if key != name else _IMPLS[name]
            impl = core.counted(name, fn, callback=True)   # counters, inject_error, signals deferred
            cb = _callbacks[key] = dffi.callback(spec[0], impl, error=999,   # CUDA_ERROR_UNKNOWN
                                                 onerror=_callback_error)
    return 0, core.ffi.cast("void *", int(_dffi().cast("uintptr_t", cb)))


def _callback_error(exc_type, exc, tb):
    # A cffi callback cannot raise into its C caller: cffi prints the exception and returns
    # 999.  A signal handler's KeyboardInterrupt (or SystemExit) can still land at the
    # callback's first bytecode, before signals are deferred (core: "atomic for Python signal
    # handlers"), or when a thread the sim does not own took the signal; with a C driver it would
    # be raised in the caller as the call returns.  So it is: the main thread gets the same
    # exception type asynchronously, raised as the cffi call returns to it (the 999 is never seen).
    # (PyThreadState_SetAsyncExc is called by a weakref callback, from C: a call from bytecode
    # would run the pending exception right here, inside the callback.  Its prototype has a third
    # argument, the weakref, which the C function ignores: cdecl, the caller pops arguments.)
    if exc_type is not None and not issubclass(exc_type, Exception) and threading.get_ident() == \
            threading.main_thread().ident:
        import ctypes
        import functools
        import weakref
        set_async = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.py_object, ctypes.py_object)(
            ("PyThreadState_SetAsyncExc", ctypes.pythonapi))
        token = _Token()
        ref = weakref.ref(token, functools.partial(set_async, threading.get_ident(), exc_type))
        del token
        return None
    # reported as an exception in __del__ is: through sys.unraisablehook, with the argument type
    # CPython's own hook requires (an object of our own made its default hook raise TypeError)
    from accel._finalize import _FailedRelease
    _FailedRelease(exc if exc is not None else exc_type())
    return None


class _Token:
    pass


def _runtime():
    global _CUDART
    cudart = _CUDART
    if cudart is None:
        from . import cudart
        _CUDART = cudart
    return cudart, cudart.runtime()


def _addr(x) -> int:
    return int(_dffi().cast("uintptr_t", x))


def _started():
    cudart, R = _runtime()
    if R is None:
        return cudart, None, CUDA_ERROR_NOT_INITIALIZED
    # A faulted context returns its sticky error from every call, driver API included.
    return cudart, R, R.sticky or R.init_error


def cuGetErrorName(error, pStr):
    return _error_text(error, pStr, names=True)


def cuGetErrorString(error, pStr):
    return _error_text(error, pStr, names=False)


def _error_text(error, pStr, names: bool):
    dffi = _dffi()
    if pStr == dffi.NULL:
        return CUDA_ERROR_INVALID_VALUE
    known = dffi.typeof("CUresult").elements
    if error not in known:
        # CUDA Driver API, cuGetErrorName: an unrecognized code gives CUDA_ERROR_INVALID_VALUE
        # and *pStr = NULL.
        pStr[0] = dffi.NULL
        return CUDA_ERROR_INVALID_VALUE
    key = (error, names)
    with _lock:
        text = _names.get(key)
        if text is None:
            raw = known[error] if names else ERROR_STRINGS.get(error, known[error])
            text = _names[key] = dffi.new("char[]", raw.encode())
    pStr[0] = text
    return CUDA_SUCCESS


def cuModuleLoadData(module, image):
    cudart, R, rc = _started()
    if rc:
        return rc
    if module == _dffi().NULL or image == _dffi().NULL:
        return CUDA_ERROR_INVALID_VALUE
    # CUDA Driver API, cuModuleLoadData: "loads the corresponding module ... into the current context".
    # The image is checked here whatever CUDA_MODULE_LOADING says: lazy loading defers loading a
    # kernel to cuModuleGetFunction (CUDA Programming Guide, "Lazy Loading"), but an H100 with the
    # default (lazy) loading refused PTX .target sm_100 here, 218 (tests/conformance/
    # cuda_h100_2026-12-05.json, scenario driver_module_calls_in_capture); see cudart/modules.py.
    lib, rc = cudart.load_image(R, core.ffi.cast("char *", _addr(image)), device=R.tls.device)
    if lib is None:
        return rc       # 200/209/218/222/900: the same values as CUresult
    module[0] = _dffi().cast("CUmodule", lib.handle)
    return CUDA_SUCCESS


def _module(R, hmod):
    lib = R.libraries.get(_addr(hmod))
    return lib if lib is not None and lib.device is not None else None


def cuModuleUnload(hmod):
    cudart, R, rc = _started()
    if rc:
        return rc
    lib = _module(R, hmod)
    if lib is None:
        return CUDA_ERROR_INVALID_HANDLE
    rc = cudart.module_call_in_capture(R, False)    # 900 = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    if rc:
        return rc
    cudart.unload(R, lib)
    return CUDA_SUCCESS


def cuModuleGetFunction(hfunc, hmod, name):
    cudart, R, rc = _started()
    if rc:
        return rc
    lib = _module(R, hmod)
    if lib is None:
        return CUDA_ERROR_INVALID_HANDLE
    dffi = _dffi()
    if hfunc == dffi.NULL or name == dffi.NULL:
        return CUDA_ERROR_INVALID_VALUE
    n = dffi.string(name).decode()
    if n not in lib.names:
        return CUDA_ERROR_NOT_FOUND
    hfunc[0] = dffi.cast("CUfunction", cudart.kernel_of(R, lib, n).handle)
    return CUDA_SUCCESS


def cuLaunchKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes,
                   hStream, kernelParams, extra):
    return _launch_kernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes,
                          hStream, kernelParams, extra, 0)


def _launch_kernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes,
                   hStream, kernelParams, extra, null):
    """cuLaunchKernel; ``null``: the stream a NULL hStream names (0 legacy, 2 per-thread)."""
    cudart, R, rc = _started()
    if rc:
        return rc
    k = R.kernels.get(_addr(f))
    if k is None:
        return CUDA_ERROR_INVALID_HANDLE
    # A CUfunction belongs to the context its module was loaded into (CUDA Driver API, "Context
    # Management"); launching it while another device's context is current is refused.
    if k.library.device is not None and k.library.device != R.tls.device:
        return CUDA_ERROR_INVALID_CONTEXT
    if extra != _dffi().NULL:
        return CUDA_ERROR_INVALID_VALUE   # CU_LAUNCH_PARAM_* buffers are not simulated
    s = cudart.common._stream(R, _addr(hStream) or null)
    if s is None:
        return CUDA_ERROR_INVALID_HANDLE
    rc = cudart.launch(R, k, (gridDimX, gridDimY, gridDimZ), (blockDimX, blockDimY, blockDimZ),
                       core.ffi.cast("void **", _addr(kernelParams)), sharedMemBytes, s)
    return _LAUNCH_CODES.get(rc, rc)


def cuLaunchKernel_ptsz(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes,
                        hStream, kernelParams, extra):
    """cuLaunchKernel's per-thread version (cuda.h, CUDA_API_PER_THREAD_DEFAULT_STREAM): a NULL
    stream is CU_STREAM_PER_THREAD, the calling thread's per-thread default stream (cudaStreamPerThread);
    CU_STREAM_LEGACY still names the legacy stream."""
    return _launch_kernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes,
                          hStream, kernelParams, extra, _CU_STREAM_PER_THREAD)


_ENTRY_PER_THREAD = 2           # cudaEnablePerThreadDefaultStream
_CU_STREAM_PER_THREAD = 2       # CU_STREAM_PER_THREAD (cuda.h) = cudaStreamPerThread (driver_types.h)
_PER_THREAD_IMPLS = {"cuLaunchKernel": cuLaunchKernel_ptsz}


# CUfunction_attribute (cuda.h) -> the field of struct cudaFuncAttributes with the same value (the
# runtime's cudaFuncGetAttributes reads the same kernel properties).
_FUNC_ATTRS = {0: "maxThreadsPerBlock", 1: "sharedSizeBytes", 2: "constSizeBytes", 3: "localSizeBytes",
               4: "numRegs", 5: "ptxVersion", 6: "binaryVersion", 7: "cacheModeCA",
               8: "maxDynamicSharedSizeBytes", 9: "preferredShmemCarveout"}


def cuFuncGetAttribute(pi, attrib, hfunc):
    """CUDA Driver API, cuFuncGetAttribute: CUDA_ERROR_INVALID_HANDLE for an unknown function,
    CUDA_ERROR_INVALID_VALUE for an attribute not listed in CUfunction_attribute (the cluster
    attributes are not simulated: refused too)."""
    cudart, R, rc = _started()
    if rc:
        return rc
    k = R.kernels.get(_addr(hfunc))
    if k is None:
        return CUDA_ERROR_INVALID_HANDLE
    field = _FUNC_ATTRS.get(attrib)
    if pi == _dffi().NULL or field is None:
        return CUDA_ERROR_INVALID_VALUE
    pi[0] = cudart.function_attributes(R, k)[field]
    return CUDA_SUCCESS


def cuFuncSetAttribute(hfunc, attrib, value):
    """CUDA Driver API, cuFuncSetAttribute: the same rules as cudaFuncSetAttribute."""
    cudart, R, rc = _started()
    if rc:
        return rc
    k = R.kernels.get(_addr(hfunc))
    if k is None:
        return CUDA_ERROR_INVALID_HANDLE
    rc = cudart.modules.cudaFuncSetAttribute(R, k.key, attrib, value)
    return _LAUNCH_CODES.get(rc, rc)


def cuOccupancyMaxActiveBlocksPerMultiprocessor(numBlocks, func, blockSize, dynamicSMemSize):
    """CUDA Driver API, cuOccupancyMaxActiveBlocksPerMultiprocessor: computed as the runtime's."""
    cudart, R, rc = _started()
    if rc:
        return rc
    k = R.kernels.get(_addr(func))
    if k is None:
        return CUDA_ERROR_INVALID_HANDLE
    if numBlocks == _dffi().NULL:
        return CUDA_ERROR_INVALID_VALUE
    rc = cudart.modules.cudaOccupancyMaxActiveBlocksPerMultiprocessor(R, core.ffi.cast("int *", _addr(numBlocks)), k.key,
                                                               blockSize, dynamicSMemSize)
    return _LAUNCH_CODES.get(rc, rc)


# -- devices and virtual memory ----------------------------------------------------------------

#: The simulated CUdevice of ordinal i is _CUDEVICE_BASE + i.  A real driver's CUdevice happens to
#: equal the ordinal, but the Driver API only promises a handle from cuDeviceGet ("Returns in
#: *device a device handle given an ordinal"); distinct values catch an ordinal passed as a CUdevice.
_CUDEVICE_BASE = 0x5100
_ATTR_VMM = 102                 # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED (cuda.h)
_ALLOCATION_TYPE_PINNED = 1     # CU_MEM_ALLOCATION_TYPE_PINNED
_LOCATION_TYPE_DEVICE = 1       # CU_MEM_LOCATION_TYPE_DEVICE
_GRANULARITY_OPTIONS = (0, 1)   # CU_MEM_ALLOC_GRANULARITY_MINIMUM, _RECOMMENDED
_HOST_LOCATIONS = (2, 3)        # CU_MEM_LOCATION_TYPE_HOST, _HOST_NUMA: valid, not simulated
_ACCESS = {0: None, 1: "r", 3: "rw"}   # CU_MEM_ACCESS_FLAGS_PROT_NONE / _READ / _READWRITE
_ACCESS_FLAGS = {"r": 1, "rw": 3}
_HOST_PAGE = mmap.PAGESIZE      # cuMemAddressReserve: addresses are multiples of the host page size
_VMM_CODES = {"invalid": CUDA_ERROR_INVALID_VALUE, "oom": CUDA_ERROR_OUT_OF_MEMORY,
              "unsupported": CUDA_ERROR_NOT_SUPPORTED}


def vmm_available(cfg) -> bool:
    """Whether the simulated devices support virtual memory management (Config.vmm, and a host
    that can play it: accel.sim._vmm.supported)."""
    return bool(cfg.vmm) and _vmm.supported()


def cuDeviceGet(device, ordinal):
    cudart, R, rc = _started()
    if rc:
        return rc
    if device == _dffi().NULL:
        return CUDA_ERROR_INVALID_VALUE
    if not (0 <= ordinal < len(R.devices)):
        return CUDA_ERROR_INVALID_DEVICE
    device[0] = _CUDEVICE_BASE + ordinal
    return CUDA_SUCCESS


def cuDevicePrimaryCtxGetState(dev, flags, active):
    # CUDA Driver API, cuDevicePrimaryCtxGetState: "Returns in *flags the flags for the primary
    # context of dev, and in *active whether it is active"; CUDA_ERROR_INVALID_DEVICE for a bad
    # dev, CUDA_ERROR_INVALID_VALUE for a NULL out-pointer.  It creates no context.
    cudart, R, d, rc = _started_on(dev)
    if rc:
        return rc
    null = _dffi().NULL
    if flags == null or active == null:
        return CUDA_ERROR_INVALID_VALUE
    flags[0] = 0
    active[0] = 1 if R.devices[d].context else 0
    return CUDA_SUCCESS


def _started_on(dev):
    """_started() for a call naming CUdevice ``dev``: ``(cudart, R, ordinal, rc)``, rc
    CUDA_ERROR_INVALID_DEVICE when ``dev`` is not one cuDeviceGet hands out."""
    cudart, R, rc = _started()
    if rc:
        return cudart, R, -1, rc
    i = dev - _CUDEVICE_BASE
    if not 0 <= i < len(R.devices):
        return cudart, R, -1, CUDA_ERROR_INVALID_DEVICE
    return cudart, R, i, CUDA_SUCCESS


def cuDeviceGetAttribute(pi, attrib, dev):
    cudart, R, d, rc = _started_on(dev)
    if rc:
        return rc
    # (r72a) an attribute newer than the driver is no CUdevice_attribute to it (cudart/devices.py,
    # last_attribute): CUDA_ERROR_INVALID_VALUE
    if pi == _dffi().NULL or not (1 <= attrib <= cudart.devices.last_attribute(R.cfg.driver_version)):
        return CUDA_ERROR_INVALID_VALUE
    if attrib == _ATTR_VMM:
        pi[0] = 1 if vmm_available(R.cfg) else 0
    else:
        # CUdevice_attribute and cudaDeviceAttr share their values (cuda.h / driver_types.h)
        pi[0] = cudart.devices._attributes(R, d).get(attrib, 0)
    return CUDA_SUCCESS


def _prop_device(R, prop):
    """(device ordinal, 0) from a CUmemAllocationProp, or (-1, CUresult).

    CUDA Driver API, cuMemCreate: type must be CU_MEM_ALLOCATION_TYPE_PINNED and location a
    CU_MEM_LOCATION_TYPE_DEVICE whose id is a device ordinal; win32HandleMetaData "is required to be
    zero" unless a Win32 handle type is requested (cuda.h, CUmemAllocationProp).  Exportable handles,
    compression, host locations and usage flags are not simulated: CUDA_ERROR_NOT_SUPPORTED."""
    if prop == _dffi().NULL:
        return -1, CUDA_ERROR_INVALID_VALUE
    if not vmm_available(R.cfg):
        # cuda.h, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0: no cuMem* VMM calls
        return -1, CUDA_ERROR_NOT_SUPPORTED
    if prop.type != _ALLOCATION_TYPE_PINNED:
        return -1, CUDA_ERROR_INVALID_VALUE if prop.type == 0 else CUDA_ERROR_NOT_SUPPORTED
    loc = prop.location
    if loc.type != _LOCATION_TYPE_DEVICE:
        # (r70d) cuMemCreate: "Specifying CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT as the
        # CUmemLocation::type will result in CUDA_ERROR_INVALID_VALUE" (it was NOT_SUPPORTED, as the
        # host locations that are valid but not simulated still are); so is a value that is no
        # CUmemLocationType at all (cuda.h), or CU_MEM_LOCATION_TYPE_INVALID.
        return -1, CUDA_ERROR_NOT_SUPPORTED if loc.type in _HOST_LOCATIONS else CUDA_ERROR_INVALID_VALUE
    if not (0 <= loc.id < len(R.devices)):
        return -1, CUDA_ERROR_INVALID_DEVICE
    if prop.win32HandleMetaData != _dffi().NULL or any(prop.allocFlags.reserved):
        return -1, CUDA_ERROR_INVALID_VALUE
    if prop.requestedHandleTypes != 0 or prop.allocFlags.compressionType or prop.allocFlags.usage:
        return -1, CUDA_ERROR_NOT_SUPPORTED
    return loc.id, CUDA_SUCCESS


def _unsafe(cudart, R) -> int:
    # The Driver API and the Programming Guide ("CUDA Graphs" > Prohibited and Unhandled
    # Operations) do not say whether cuMemAddressReserve/Free, cuMemCreate/Release, cuMemMap/Unmap
    # and cuMemSetAccess are legal during stream capture; they are not stream-ordered and, like
    # cudaMalloc/cudaFree, change what memory exists.  Silent docs: refused as "potentially unsafe"
    # (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, the capture invalidated; relaxed mode allows them).
    if R.captures:
        return cudart.common._unsafe_call(R)
    return 0


def _vmm_call(fn, *args) -> int:
    try:
        fn(*args)
    except _vmm.VmmError as exc:
        return _VMM_CODES[exc.kind]
    return CUDA_SUCCESS


def _aligned(*values) -> bool:
    return all(v % _vmm.GRANULARITY == 0 for v in values)


def cuMemGetAllocationGranularity(granularity, prop, option):
    cudart, R, rc = _started()
    if rc:
        return rc
    # CUDA Driver API, cuMemGetAllocationGranularity: option is CU_MEM_ALLOC_GRANULARITY_MINIMUM or
    # _RECOMMENDED; the granularity is that of allocations with these properties.
    if granularity == _dffi().NULL or option not in _GRANULARITY_OPTIONS:
        return CUDA_ERROR_INVALID_VALUE
    _d, rc = _prop_device(R, prop)
    if rc:
        return rc
    granularity[0] = _vmm.GRANULARITY
    return CUDA_SUCCESS


def cuMemAddressReserve(ptr, size, alignment, addr, flags):
    cudart, R, rc = _started()
    if rc or (rc := _unsafe(cudart, R)):
        return rc
    # CUDA Driver API, cuMemAddressReserve: "The size and address parameters must be a multiple of
    # the host page size and the alignment must be a power of two or zero for default alignment";
    # flags "currently unused, must be zero"; addr is only a hint.  Stricter here: the size must be a
    # multiple of the allocation granularity (2 MiB), since only such ranges can ever be mapped
    # (cuMemMap) -- a smaller multiple of the host page size is refused with CUDA_ERROR_INVALID_VALUE.
    if ptr == _dffi().NULL or flags != 0 or size <= 0 or not _aligned(size):
        return CUDA_ERROR_INVALID_VALUE
    if alignment and alignment & (alignment - 1):
        return CUDA_ERROR_INVALID_VALUE
    # r67c: the address hint too ("The size and address parameters must be a multiple of the host
    # page size"); it was ignored whatever it was.  A page-aligned hint is only a hint ("when it is
    # non-zero then the driver treats it as a hint about where to place the reservation").
    if int(addr) % _HOST_PAGE:
        return CUDA_ERROR_INVALID_VALUE
    if not vmm_available(R.cfg):
        return CUDA_ERROR_NOT_SUPPORTED
    try:
        base = R.vmm.reserve(size, max(alignment, _vmm.GRANULARITY))
    except _vmm.VmmError as exc:
        return _VMM_CODES[exc.kind]
    ptr[0] = base
    return CUDA_SUCCESS


def cuMemAddressFree(ptr, size):
    cudart, R, rc = _started()
    if rc or (rc := _unsafe(cudart, R)):
        return rc
    # CUDA Driver API, cuMemAddressFree: "The size must match what was given to memAddressReserve and
    # the ptr given must match what was returned from memAddressReserve."  The reference does not say
    # what happens to mappings still inside the range: refused (CUDA_ERROR_INVALID_VALUE) until they
    # are unmapped.
    return _vmm_call(R.vmm.free, int(ptr), size)


def cuMemCreate(handle, size, prop, flags):
    cudart, R, rc = _started()
    if rc or (rc := _unsafe(cudart, R)):
        return rc
    # CUDA Driver API, cuMemCreate: size "must be a multiple of the granularity" of
    # cuMemGetAllocationGranularity(CU_MEM_ALLOC_GRANULARITY_MINIMUM) for prop; flags "for future
    # use, must be zero now".  The memory counts against the device (cudaMalloc and cuMemCreate
    # share it): CUDA_ERROR_OUT_OF_MEMORY when it is full.
    if handle == _dffi().NULL or flags != 0 or size <= 0 or not _aligned(size):
        return CUDA_ERROR_INVALID_VALUE
    d, rc = _prop_device(R, prop)
    if rc:
        return rc
    if core.take_oom():
        return CUDA_ERROR_OUT_OF_MEMORY
    try:
        h = R.vmm.create(d, size)
    except _vmm.VmmError as exc:
        return _VMM_CODES[exc.kind]
    handle[0] = h
    return CUDA_SUCCESS


def cuMemRelease(handle):
    cudart, R, rc = _started()
    if rc or (rc := _unsafe(cudart, R)):
        return rc
    # CUDA Driver API, cuMemRelease: "The memory allocation will be freed when all outstanding
    # mappings to the memory are unmapped ... The generic memory handle can be freed when there are
    # still outstanding mappings made with this handle."  So a release while mapped succeeds and
    # the memory (and its device-memory charge) goes at the last unmap.  "If handle is not a valid
    # handle the behavior is undefined": refused here (CUDA_ERROR_INVALID_VALUE), a second release too.
    return _vmm_call(R.vmm.release, int(handle))


def cuMemMap(ptr, size, offset, handle, flags):
    cudart, R, rc = _started()
    if rc or (rc := _unsafe(cudart, R)):
        return rc
    # CUDA Driver API, cuMemMap: the range "must be an address reservation previously reserved with
    # cuMemAddressReserve"; "Both ptr, size, and offset must be a multiple of the value given via
    # cuMemGetAllocationGranularity with the CU_MEM_ALLOC_GRANULARITY_MINIMUM flag"; offset
    # "currently must be zero"; flags "currently unused, must be zero".  A range that overlaps a
    # live mapping is refused (no double map), and a mapping covers the whole handle (offset 0 and
    # "offset + size must be less than the size of the memory allocation" leave only size ==
    # the handle's size meaningful).  "Please note calling cuMemMap does not make the address
    # accessible": until cuMemSetAccess every access faults.  A mapping of part of the handle
    # or from an offset is CUDA_ERROR_NOT_SUPPORTED, checked (in _vmm.Vmm.map) before the
    # address's alignment (CUDA_ERROR_INVALID_VALUE): measured on an H100,
    # tests/conformance/cuda_h100_2026-12-05.json, scenario vmm_rules.
    if flags != 0 or size <= 0:
        return CUDA_ERROR_INVALID_VALUE
    rc = _vmm_call(R.vmm.map, int(ptr), size, int(handle), offset)
    core.vmm_cost()
    return rc


def cuMemUnmap(ptr, size):
    cudart, R, rc = _started()
    if rc or (rc := _unsafe(cudart, R)):
        return rc
    # CUDA Driver API, cuMemUnmap: "The range must be the entire contiguous address range that was
    # mapped to. In other words, cuMemUnmap cannot unmap a sub-range of an address range mapped by
    # cuMemCreate / cuMemMap."  (A range of several whole mappings is accepted, as the CUDA samples'
    # growing vector unmaps its whole range.)  The call does not wait for queued work: a copy,
    # memset or kernel still queued on the range faults (CUDA_ERROR_ILLEGAL_ADDRESS, sticky) when
    # it runs; synchronize the streams that use the range first.
    if size <= 0 or not _aligned(int(ptr), size):
        return CUDA_ERROR_INVALID_VALUE
    rc = _vmm_call(R.vmm.unmap, int(ptr), size)
    core.vmm_cost()
    return rc


def cuMemSetAccess(ptr, size, desc, count):
    cudart, R, rc = _started()
    if rc or (rc := _unsafe(cudart, R)):
        return rc
    # CUDA Driver API, cuMemSetAccess: "The range must be a fully mapped address range containing
    # all allocations created by cuMemMap / cuMemCreate"; each CUmemAccessDesc names a location and
    # its CUmemAccess_flags (PROT_NONE, PROT_READ, PROT_READWRITE).  Host locations are not simulated.
    if desc == _dffi().NULL or count <= 0 or size <= 0:
        return CUDA_ERROR_INVALID_VALUE
    grants = []
    seen = set()
    for i in range(count):
        loc, flags = desc[i].location, desc[i].flags
        if loc.type != _LOCATION_TYPE_DEVICE:
            return CUDA_ERROR_INVALID_VALUE if loc.type == 0 else CUDA_ERROR_NOT_SUPPORTED
        if not (0 <= loc.id < len(R.devices)):
            return CUDA_ERROR_INVALID_DEVICE
        if flags not in _ACCESS:
            return CUDA_ERROR_INVALID_VALUE
        if loc.id in seen:
            # (r70d) Two CUmemAccessDesc for one location in one call: the reference says each sets
            # "the access flags for the target locations", not which of two wins.  Silent docs:
            # refused (CUDA_ERROR_INVALID_VALUE), nothing changed; it applied the last one.
            return CUDA_ERROR_INVALID_VALUE
        seen.add(loc.id)
        grants.append((loc.id, _ACCESS[flags]))
    m = R.vmm.mapping_at(int(ptr))
    if m is not None:
        for device, access in grants:
            if access is not None and device != m.device and not core.peer_capable(
                    R.devices[device].physical, R.devices[m.device].physical):
                # (r71g) Access for a device that cannot access the memory's device directly
                # (cuDeviceCanAccessPeer 0: ACCEL_SIM_PEER).  CUDA Programming Guide, Virtual
                # Memory Management, "Controlling Access Rights": access is granted per device
                # with cuMemSetAccess; NVIDIA's cuda-samples vectorAddMMAP grants it only to the
                # devices for which cuDeviceCanAccessPeer is 1 (and the backing device itself).
                # What cuMemSetAccess returns for another device is not documented (docs silent,
                # not measured): refused with CUDA_ERROR_INVALID_DEVICE, nothing changed.
                return CUDA_ERROR_INVALID_DEVICE
    return _vmm_call(R.vmm.set_access, int(ptr), size, grants)


def cuMemGetAccess(flags, location, ptr):
    cudart, R, rc = _started()
    if rc:
        return rc
    # CUDA Driver API, cuMemGetAccess: "Get the access flags set for the given location and ptr".
    if flags == _dffi().NULL or location == _dffi().NULL:
        return CUDA_ERROR_INVALID_VALUE
    if location.type != _LOCATION_TYPE_DEVICE or not (0 <= location.id < len(R.devices)):
        return CUDA_ERROR_INVALID_VALUE
    try:
        got = R.vmm.access_of(int(ptr), location.id)
    except _vmm.VmmError:
        return CUDA_ERROR_INVALID_VALUE
    flags[0] = _ACCESS_FLAGS.get(got, 0)
    return CUDA_SUCCESS


_IMPLS = {"cuGetErrorName": cuGetErrorName, "cuGetErrorString": cuGetErrorString,
          "cuModuleLoadData": cuModuleLoadData, "cuModuleUnload": cuModuleUnload,
          "cuModuleGetFunction": cuModuleGetFunction, "cuLaunchKernel": cuLaunchKernel,
          "cuFuncGetAttribute": cuFuncGetAttribute, "cuFuncSetAttribute": cuFuncSetAttribute,
          "cuOccupancyMaxActiveBlocksPerMultiprocessor": cuOccupancyMaxActiveBlocksPerMultiprocessor,
          "cuDeviceGet": cuDeviceGet, "cuDeviceGetAttribute": cuDeviceGetAttribute,
          "cuMemGetAllocationGranularity": cuMemGetAllocationGranularity,
          "cuMemAddressReserve": cuMemAddressReserve, "cuMemAddressFree": cuMemAddressFree,
          "cuMemCreate": cuMemCreate, "cuMemRelease": cuMemRelease, "cuMemMap": cuMemMap,
          "cuMemUnmap": cuMemUnmap, "cuMemSetAccess": cuMemSetAccess, "cuMemGetAccess": cuMemGetAccess,
          "cuDevicePrimaryCtxGetState": cuDevicePrimaryCtxGetState}


def callback_address(name: str) -> Optional[int]:
    """The address of the callback for ``name`` once handed out (tests)."""
    cb = _callbacks.get(name)
    return None if cb is None else _addr(cb)
