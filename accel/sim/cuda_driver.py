"""The driver functions the simulated cudaGetDriverEntryPoint hands out.

Each is a cffi callback with the driver's own signature (the ``PFN_*`` types of
``accel/_ffi/_cudadrv.py``, from cudaTypedefs.h), so the caller casts the
pointer and calls it exactly as it calls the real driver.  They work on the
simulated runtime's state: a module loaded with cuModuleLoadData belongs to
the current device's context, cuLaunchKernel follows the same launch rules as
cudaLaunchKernel (and is captured like it), and they return CUresult codes
(cuda.h), not cudaError_t.  Only the functions accel uses are simulated; any
other symbol is "not found" (stricter than a real driver, never more lenient).
"""

from __future__ import annotations

import threading
from typing import Dict, Optional, Tuple

from . import core
from ._cuda_strings import ERROR_STRINGS

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_INVALID_HANDLE = 400
CUDA_ERROR_NOT_FOUND = 500

# cudaError_t from the shared launch path -> the CUresult cuLaunchKernel returns (cuda.h); the
# other codes the path returns (1, 400, 700, 719, 900-908) have the same value in both enums.
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
}

_lock = threading.Lock()
_callbacks: Dict[str, object] = {}     # symbol -> callback cdata (kept alive for the process)
_names: Dict[tuple, object] = {}       # (CUresult, names?) -> const char * (cuGetErrorName/String)


def _dffi():
    from accel._ffi._cudadrv import ffi
    return ffi


def entry_point(name: str, version: int, driver_version: int):
    """(cudaDriverEntryPointQueryResult, void* or None) for driver symbol ``name`` of ABI ``version``."""
    # CUDA Driver API, cuGetProcAddress (what the runtime calls): SymbolNotFound for a symbol the
    # driver lacks; VersionNotSufficient when it exists but ``version`` predates its first ABI.
    # A ``version`` newer than the driver gets the newest ABI the driver has (minor version
    # compatibility: a 12.4 runtime on a 12.2 driver).
    spec = SYMBOLS.get(name)
    if spec is None or spec[1] > driver_version:
        return 1, None        # cudaDriverEntryPointSymbolNotFound
    if version < spec[1]:
        return 2, None        # cudaDriverEntryPointVersionNotSufficent
    with _lock:
        cb = _callbacks.get(name)
        if cb is None:
            dffi = _dffi()
            impl = core.counted(name, _IMPLS[name])   # call counters and inject_error, as runtime calls
            cb = _callbacks[name] = dffi.callback(spec[0], impl, error=999)   # CUDA_ERROR_UNKNOWN
    return 0, core.ffi.cast("void *", int(_dffi().cast("uintptr_t", cb)))


def _runtime():
    from . import cudart
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
    lib, rc = cudart.load_image(R, core.ffi.cast("char *", _addr(image)), device=R.tls.device)
    if lib is None:
        return rc       # 200/209/218/222: the same values as CUresult
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
    s = cudart._stream(R, _addr(hStream))
    if s is None:
        return CUDA_ERROR_INVALID_HANDLE
    rc = cudart.launch(R, k, (gridDimX, gridDimY, gridDimZ), (blockDimX, blockDimY, blockDimZ),
                       core.ffi.cast("void **", _addr(kernelParams)), sharedMemBytes, s)
    return _LAUNCH_CODES.get(rc, rc)


_IMPLS = {"cuGetErrorName": cuGetErrorName, "cuGetErrorString": cuGetErrorString,
          "cuModuleLoadData": cuModuleLoadData, "cuModuleUnload": cuModuleUnload,
          "cuModuleGetFunction": cuModuleGetFunction, "cuLaunchKernel": cuLaunchKernel}


def callback_address(name: str) -> Optional[int]:
    """The address of the callback for ``name`` once handed out (tests)."""
    cb = _callbacks.get(name)
    return None if cb is None else _addr(cb)
