"""Virtual memory through the CUDA driver API, reached from libcudart as torch reaches it.

The allocator's expandable segments need the driver's cuMem* calls (CUDA Driver API,
"Virtual Memory Management"); libcudart has no equivalent, but every runtime accel supports
hands out the driver's own functions through ``cudaGetDriverEntryPoint[ByVersion]``
(``driver.resolve``), cast to their ``PFN_*`` prototypes from cudaTypedefs.h
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

from ..._errors import AcceleratorError, CaptureError
from .driver import NoDriverFunction, error_name, resolve

__all__ = ["SYMBOLS", "DriverVmm", "NoDriverFunction", "CudaVmmMixin"]

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
        from ..._ffi import _cudadrv
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

    def reserve(self, nbytes: int, out=None) -> Tuple[int, int]:
        """``out`` (a zeroed ``CUdeviceptr_v2 *``) keeps the address for a caller that must undo
        the reservation when a KeyboardInterrupt lands as the driver returns."""
        out = self.dffi.new("CUdeviceptr_v2 *") if out is None else out
        rc = self.fns["cuMemAddressReserve"](out, nbytes, 0, 0, 0)
        return (int(out[0]) if rc == 0 else 0), rc

    def free(self, va: int, nbytes: int) -> int:
        return self.fns["cuMemAddressFree"](va, nbytes)

    def create(self, ordinal: int, nbytes: int, out=None) -> Tuple[int, int]:
        """``out``: as for :meth:`reserve` (a zeroed ``CUmemGenericAllocationHandle_v1 *``)."""
        out = self.dffi.new("CUmemGenericAllocationHandle_v1 *") if out is None else out
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


class CudaVmmMixin:
    """The Backend protocol's vmm_* methods for :class:`accel.backends.cuda.CudaBackend`."""

    vmm_access_call = "cuMemSetAccess"

    def _vmm(self):
        v = self._vmm_fns
        if v is None:
            with self._lock:
                if self._vmm_fns is None:
                    try:
                        self._vmm_fns = DriverVmm(self.ffi, self.lib)
                    except NoDriverFunction as exc:
                        self._vmm_fns = f"no virtual memory management: {exc}"
                v = self._vmm_fns
        if isinstance(v, str):
            raise AcceleratorError(f"libcudart: {v}", library="libcudart")
        return v

    def _vmm_not_capturing(self, call: str) -> None:
        # The Driver API does not say whether cuMemCreate/Map/Unmap/SetAccess/Release and
        # cuMemAddressReserve/Free are legal while a stream capture is underway (they are not
        # stream-ordered and change what memory exists, like cudaMalloc/cudaFree, which are
        # "potentially unsafe").  Silent docs: refused here, for every capture mode.
        if self._captures:
            raise CaptureError(f"libcuda: {call} is not allowed while a stream capture is underway "
                               f"(virtual memory is not stream-ordered); map or unmap before the capture "
                               f"begins or after it ends", library="libcuda", call=call)

    def vmm_supported(self, index: int) -> bool:
        """CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED of device ``index`` (False when the
        runtime cannot hand out the driver's cuMem* functions)."""
        try:
            drv = self._vmm()
        except AcceleratorError:
            return False
        ok, rc = drv.supported(index)
        self._check_driver(drv, rc, "cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)")
        return ok

    def vmm_granularity(self, index: int) -> int:
        """cuMemGetAllocationGranularity(CU_MEM_ALLOC_GRANULARITY_MINIMUM) for pinned memory of device
        ``index``: sizes and addresses of create/map/unmap are multiples of it."""
        drv = self._vmm()
        value, rc = drv.granularity(index)
        self._check_driver(drv, rc, "cuMemGetAllocationGranularity")
        return value

    def vmm_reserve(self, index: int, nbytes: int) -> int:
        """cuMemAddressReserve of ``nbytes`` (a multiple of the granularity); the base address."""
        drv = self._vmm()
        out = drv.dffi.new("CUdeviceptr_v2 *")
        try:
            with self.capture_gate:        # (see CudaBackend.capture_gate)
                self._vmm_not_capturing("cuMemAddressReserve")
                va, rc = drv.reserve(nbytes, out)
            self._check_driver(drv, rc, "cuMemAddressReserve")
            return va
        except Exception:
            raise
        except BaseException:
            # A KeyboardInterrupt as the driver returned (CPython runs a signal's handler right
            # after a C call): the range is reserved but the caller never gets it.  Freed here,
            # so an interrupted reserve leaves nothing (an address the driver did not write is 0).
            if out[0]:
                drv.free(int(out[0]), nbytes)
            raise

    def vmm_free(self, va: int, nbytes: int) -> None:
        """cuMemAddressFree of a whole reservation (nothing may be mapped in it)."""
        drv = self._vmm()
        with self.capture_gate:
            self._vmm_not_capturing("cuMemAddressFree")
            rc = drv.free(va, nbytes)
        self._check_driver(drv, rc, "cuMemAddressFree")

    def vmm_create(self, index: int, nbytes: int) -> int:
        """cuMemCreate of ``nbytes`` of pinned memory on device ``index`` (the driver's ordinal);
        OutOfMemoryError when the device is full."""
        drv = self._vmm()
        out = drv.dffi.new("CUmemGenericAllocationHandle_v1 *")
        try:
            with self.capture_gate:
                self._vmm_not_capturing("cuMemCreate")
                handle, rc = drv.create(index, nbytes, out)
            self._check_driver(drv, rc, "cuMemCreate")
            return handle
        except Exception:
            raise
        except BaseException:
            if out[0]:          # created, the caller interrupted before it got it: as vmm_reserve
                drv.release(int(out[0]))
            raise

    def vmm_release(self, handle: int) -> None:
        """cuMemRelease (the memory goes once no mapping of it is left)."""
        drv = self._vmm()
        with self.capture_gate:
            self._vmm_not_capturing("cuMemRelease")
            rc = drv.release(handle)
        self._check_driver(drv, rc, "cuMemRelease")

    def vmm_map(self, va: int, nbytes: int, handle: int, index: int) -> None:
        """cuMemMap of all of ``handle`` at ``va``, then cuMemSetAccess read-write for device ``index``;
        when the access cannot be set the mapping is undone before the error is raised."""
        drv = self._vmm()
        # Interrupt safety: a KeyboardInterrupt anywhere from the map on (CPython runs a signal's
        # handler right after a C call returns, before its result is stored) unmaps again, so an
        # interrupted vmm_map leaves nothing mapped, as a failed one.  ``maybe`` is set before
        # the map (a plain store) and cleared once a driver error says nothing was mapped; the
        # undo is unconditional then, and a refusal ('not mapped') is taken as nothing to undo:
        # ``va`` is in the caller's own reservation, where nobody else maps meanwhile.
        maybe = False
        try:
            with self.capture_gate:        # (see CudaBackend.capture_gate)
                self._vmm_not_capturing("cuMemMap")
                maybe = True
                rc = drv.map(va, nbytes, handle)
                if rc:
                    maybe = False
                    self._check_driver(drv, rc, "cuMemMap")
                rc = drv.set_access(va, nbytes, index)
                if rc:
                    maybe = False
                    undo = drv.unmap(va, nbytes)
                    try:
                        self._check_driver(drv, rc, "cuMemSetAccess")
                    except AcceleratorError as exc:
                        if undo:
                            exc.still_mapped = True       # the caller must unmap it before releasing
                            exc.add_note(f"the mapping at 0x{va:x} could not be undone either: cuMemUnmap "
                                         f"failed with {drv.error_name(undo)} ({undo})")
                        raise
        except Exception:
            raise
        except BaseException:
            if maybe:
                drv.unmap(va, nbytes)
            raise

    def vmm_set_access(self, va: int, nbytes: int, index: int) -> None:
        """cuMemSetAccess read-write for device ``index`` on mapped ``[va, va + nbytes)`` (a peer that
        copies from or runs kernels on memory another device mapped)."""
        drv = self._vmm()
        with self.capture_gate:
            self._vmm_not_capturing("cuMemSetAccess")
            rc = drv.set_access(va, nbytes, index)
        self._check_driver(drv, rc, "cuMemSetAccess")

    def vmm_unmap(self, va: int, nbytes: int) -> None:
        """cuMemUnmap of whole mappings; does not wait for queued work (synchronize first)."""
        drv = self._vmm()
        with self.capture_gate:
            self._vmm_not_capturing("cuMemUnmap")
            rc = drv.unmap(va, nbytes)
        self._check_driver(drv, rc, "cuMemUnmap")
