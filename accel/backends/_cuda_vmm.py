"""Virtual memory through the CUDA driver API, reached from libcudart as torch reaches it.

The allocator's expandable segments need the driver's cuMem* calls (CUDA Driver API,
"Virtual Memory Management"); libcudart has no equivalent, but every runtime accel supports
hands out the driver's own functions through ``cudaGetDriverEntryPoint[ByVersion]``
(``_cuda_driver.resolve``), cast to their ``PFN_*`` prototypes from cudaTypedefs.h
(``accel/_ffi/_cudadrv.py``).  No libcuda binding is opened.

Device numbers: the runtime's device ``i`` is the driver's ordinal ``i`` (both count the
devices CUDA_VISIBLE_DEVICES leaves, in its order).  Calls that take a ``CUdevice``
(cuDeviceGetAttribute) get it from ``cuDeviceGet(ordinal)``; a ``CUmemLocation`` of type
CU_MEM_LOCATION_TYPE_DEVICE takes the ordinal itself (cuda.h: "id is a device ordinal").

Every function returns a CUresult; the caller (``CudaBackend._check_driver``) turns a failure
into an AcceleratorError naming the call and the CUresult name (CUDA_ERROR_OUT_OF_MEMORY:
OutOfMemoryError).
"""

from __future__ import annotations

from typing import Dict, Tuple

from ._cuda_driver import NoDriverFunction, error_name, resolve

__all__ = ["SYMBOLS", "DriverVmm", "NoDriverFunction"]

#: driver symbol -> PFN type of the ABI accel calls (cudaTypedefs.h; the same in CUDA 12 and 13).
SYMBOLS: Dict[str, str] = {
    "cuGetErrorName": "PFN_cuGetErrorName_v6000",
    "cuDeviceGet": "PFN_cuDeviceGet_v2000",
    "cuDeviceGetAttribute": "PFN_cuDeviceGetAttribute_v2000",
    "cuMemGetAllocationGranularity": "PFN_cuMemGetAllocationGranularity_v10020",
    "cuMemAddressReserve": "PFN_cuMemAddressReserve_v10020",
    "cuMemAddressFree": "PFN_cuMemAddressFree_v10020",
    "cuMemCreate": "PFN_cuMemCreate_v10020",
    "cuMemRelease": "PFN_cuMemRelease_v10020",
    "cuMemMap": "PFN_cuMemMap_v10020",
    "cuMemUnmap": "PFN_cuMemUnmap_v10020",
    "cuMemSetAccess": "PFN_cuMemSetAccess_v10020",
}

# cuda.h (CUDA 12.4 and 13.0 agree)
_ATTR_VMM = 102                  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
_ALLOCATION_TYPE_PINNED = 1      # CU_MEM_ALLOCATION_TYPE_PINNED
_LOCATION_TYPE_DEVICE = 1        # CU_MEM_LOCATION_TYPE_DEVICE
_GRANULARITY_MINIMUM = 0         # CU_MEM_ALLOC_GRANULARITY_MINIMUM
_PROT_READWRITE = 3              # CU_MEM_ACCESS_FLAGS_PROT_READWRITE


class DriverVmm:
    """The driver's virtual-memory functions, resolved once per backend.

    Each method returns ``(value, CUresult)`` or the CUresult; nothing here raises on a
    driver error, so the backend decides how to report it and what to undo."""

    def __init__(self, ffi, lib):
        from .._ffi import _cudadrv
        self.dffi = _cudadrv.ffi
        self.fns, self.getter = resolve(ffi, lib, SYMBOLS)

    def error_name(self, rc: int) -> str:
        return error_name(self.fns, rc)

    def _prop(self, ordinal: int):
        prop = self.dffi.new("CUmemAllocationProp_v1 *")     # zeroed: no handle types, no flags
        prop.type = _ALLOCATION_TYPE_PINNED
        prop.location.type = _LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        return prop

    def supported(self, ordinal: int) -> Tuple[bool, int]:
        d = self.dffi
        dev = d.new("CUdevice_v1 *")
        rc = self.fns["cuDeviceGet"](dev, ordinal)
        if rc:
            return False, rc
        value = d.new("int *")
        rc = self.fns["cuDeviceGetAttribute"](value, _ATTR_VMM, dev[0])
        return bool(value[0]) if rc == 0 else False, rc

    def granularity(self, ordinal: int) -> Tuple[int, int]:
        out = self.dffi.new("size_t *")
        rc = self.fns["cuMemGetAllocationGranularity"](out, self._prop(ordinal), _GRANULARITY_MINIMUM)
        return (out[0] if rc == 0 else 0), rc

    def reserve(self, nbytes: int) -> Tuple[int, int]:
        out = self.dffi.new("CUdeviceptr_v2 *")
        rc = self.fns["cuMemAddressReserve"](out, nbytes, 0, 0, 0)
        return (int(out[0]) if rc == 0 else 0), rc

    def free(self, va: int, nbytes: int) -> int:
        return self.fns["cuMemAddressFree"](va, nbytes)

    def create(self, ordinal: int, nbytes: int) -> Tuple[int, int]:
        out = self.dffi.new("CUmemGenericAllocationHandle_v1 *")
        rc = self.fns["cuMemCreate"](out, nbytes, self._prop(ordinal), 0)
        return (int(out[0]) if rc == 0 else 0), rc

    def release(self, handle: int) -> int:
        return self.fns["cuMemRelease"](handle)

    def map(self, va: int, nbytes: int, handle: int) -> int:
        return self.fns["cuMemMap"](va, nbytes, 0, handle, 0)

    def unmap(self, va: int, nbytes: int) -> int:
        return self.fns["cuMemUnmap"](va, nbytes)

    def set_access(self, va: int, nbytes: int, ordinal: int) -> int:
        desc = self.dffi.new("CUmemAccessDesc_v1 *")
        desc.location.type = _LOCATION_TYPE_DEVICE
        desc.location.id = ordinal
        desc.flags = _PROT_READWRITE
        return self.fns["cuMemSetAccess"](va, nbytes, desc, 1)
