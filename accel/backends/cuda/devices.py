"""Init, device properties and the current device (a mixin of
:class:`accel.backends.cuda.CudaBackend`).

:meth:`init` is the first runtime call that starts CUDA (cudaGetDeviceCount); after it the
runtime's count wins over NVML's (:mod:`.discovery`), and each device's UUID is read once so
that NVML readings find their GPU later, in a forked child too (:mod:`.nvml`).  Properties come
from cudaGetDeviceProperties under the symbol the runtime major's headers give it, checked
against the layout-free cudaDeviceGetAttribute.

The current device is CUDA's, per thread.  A device scope's restore is deferred, as torch's
c10::cuda::MaybeSetDevice does, when the device to restore has no primary context yet
(cuDevicePrimaryCtxGetState through the driver entry points, :mod:`.driver`): cudaSetDevice
would create one and hold memory on a device nothing uses.  ``get_device`` is bound per
instance at init to a closure (current_stream() calls it for every queued operation).
"""

from __future__ import annotations

import threading
from typing import List, Optional, Tuple

from ..._errors import AcceleratorError
from ..base import DeviceProperties
from .discovery import _ERR_INSUFFICIENT_DRIVER

# cudaDeviceAttr (driver_types.h) for the few properties read one by one.
_ATTR_COMPUTE_MAJOR = 75
_ATTR_COMPUTE_MINOR = 76
_ATTR_MULTIPROCESSOR_COUNT = 16    # cudaDevAttrMultiProcessorCount
_ATTR_INTEGRATED = 18              # cudaDevAttrIntegrated

_NUMPY_DTYPES = frozenset({
    "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
    "float16", "float32", "float64", "complex64", "complex128",
})


class _DeferredDevice(threading.local):
    """A device scope's restore that CudaBackend.restore_device deferred (-1: none), per thread
    as CUDA's current device is."""
    index = -1


class CudaDevicesMixin:
    """init, properties, the current device (deferred restores), device_synchronize and mem_info;
    state lives in ``CudaBackend.__init__``."""

    def init(self) -> None:
        ffi, lib, _ = self._runtime()
        n = ffi.new("int *")
        rc = lib.cudaGetDeviceCount(n)
        self.driver_started = True
        if rc == _ERR_INSUFFICIENT_DRIVER:
            # the vendor's text ("driver version is insufficient") also where no driver is installed
            lib.cudaGetLastError()
            raise AcceleratorError.from_call("libcudart", "cudaGetDeviceCount", rc, "cudaErrorInsufficientDriver",
                                             self._insufficient_driver(ffi, lib))
        self._check(rc, "cudaGetDeviceCount")
        if n[0] == 0:
            raise AcceleratorError("libcudart: cudaGetDeviceCount reports no CUDA device",
                                   library="libcudart", call="cudaGetDeviceCount")
        self._reconcile_count(n[0])
        self.get_device = self._bind_get_device()
        self._uuids = self._read_uuids(n[0])

    def _read_uuids(self, count: int) -> Optional[List[str]]:
        """Each device's UUID as NVML prints it, read once at init so that NVML readings find
        their GPU by it later, in a child forked after init too, where the runtime refuses
        every call (nvml.smi_index); None when one cannot be read."""
        ffi = self.ffi
        get_properties = self._rt_fn("cudaGetDeviceProperties")
        prop = ffi.new("struct cudaDeviceProp *")
        out = []
        for i in range(count):
            if get_properties(prop, i):
                self.lib.cudaGetLastError()      # (not sticky; cleared so no later call reports it)
                return None
            h = bytes(ffi.buffer(prop.uuid.bytes, 16)).hex()
            out.append(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
        return out

    def properties(self, index: int) -> DeviceProperties:
        ffi = self.ffi
        get_properties = self._rt_fn("cudaGetDeviceProperties")   # 12.x: cudaGetDeviceProperties_v2
        prop = ffi.new("struct cudaDeviceProp *")
        self._check(get_properties(prop, index), "cudaGetDeviceProperties")
        # The fields that shift between the CUDA 12 and 13 layouts come from
        # cudaDeviceGetAttribute, which is layout-free; the struct must agree with it, or
        # it was read through the wrong declarations (name, uuid and totalGlobalMem have
        # no attribute: they sit before the first difference of the layouts).
        sm = self._device_attribute(_ATTR_MULTIPROCESSOR_COUNT, index)
        integrated = self._device_attribute(_ATTR_INTEGRATED, index)
        cc = (self._device_attribute(_ATTR_COMPUTE_MAJOR, index),
              self._device_attribute(_ATTR_COMPUTE_MINOR, index))
        if (prop.multiProcessorCount, prop.integrated, prop.major, prop.minor) != (sm, integrated) + cc:
            raise AcceleratorError(
                f"libcudart: cudaDeviceProp of device {index} disagrees with cudaDeviceGetAttribute "
                f"(multiProcessorCount {prop.multiProcessorCount} vs {sm}, integrated {prop.integrated} vs "
                f"{integrated}): the struct layout of the bindings ({self._bindings().__name__}) is not "
                f"the runtime's", library="libcudart", call="cudaGetDeviceProperties")
        return DeviceProperties(
            index=index,
            name=ffi.string(prop.name).decode(errors="replace"),
            total_memory=prop.totalGlobalMem,
            compute_capability=cc,
            multi_processor_count=sm,
            supported_dtypes=_NUMPY_DTYPES,
            uuid=bytes(ffi.buffer(prop.uuid.bytes, 16)),     # torch's props.uuid; "GPU-" + str() for nvidia-smi's
            unified_memory=bool(integrated),
            # torch.cuda's names (torch/csrc/cuda/Module.cpp); gcnArchName is ROCm's only
            L2_cache_size=prop.l2CacheSize, warp_size=prop.warpSize,
            max_threads_per_multi_processor=prop.maxThreadsPerMultiProcessor,
            pci_bus_id=prop.pciBusID, pci_device_id=prop.pciDeviceID, pci_domain_id=prop.pciDomainID,
            # accel's names before these (kept)
            extra={"pci_bus_id": prop.pciBusID, "warp_size": prop.warpSize,
                   "max_threads_per_block": prop.maxThreadsPerBlock,
                   "l2_cache_size": prop.l2CacheSize},
        )

    def _device_attribute(self, attr: int, index: int) -> int:
        value = self.ffi.new("int *")
        self._check(self.lib.cudaDeviceGetAttribute(value, attr, index), "cudaDeviceGetAttribute")
        return value[0]

    def set_device(self, index: int) -> None:
        self._check(self.lib.cudaSetDevice(index), "cudaSetDevice")
        if self._deferring[0] and self._deferred.index >= 0:
            self._deferred.index = -1
            with self._deferring_lock:
                self._deferring[0] -= 1

    def get_device(self) -> int:
        # Replaced per instance by init() with _bind_get_device's closure; this
        # form only serves a backend used before init (which the layers never do).
        if self._deferring[0] and self._deferred.index >= 0:
            return self._deferred.index
        return self._runtime_device()

    def _runtime_device(self) -> int:
        """The runtime's current device of this thread (cudaGetDevice), whatever is deferred."""
        p = self.ffi.new("int *")
        self._check(self.lib.cudaGetDevice(p), "cudaGetDevice")
        return p[0]

    def device_deferred(self) -> bool:
        return bool(self._deferring[0]) and self._deferred.index >= 0

    def restore_device(self, index: int) -> None:
        """As torch's c10::cuda::MaybeSetDevice: cudaSetDevice creates the device's primary
        context (CUDA Programming Guide, "Initialization": "As of CUDA 12.0, ... cudaSetDevice()
        ... initialize[s] the primary context"), so a scope on device 1 must not end by making
        device 0 current when device 0 has none: work on device 1 alone would hold memory on
        device 0 for good.  Such a device is only recorded: get_device names it, and the next
        scope on it (on_device) makes it current."""
        if index != self._runtime_device() and not self.has_primary_context(index):
            if self._deferred.index < 0:
                with self._deferring_lock:
                    self._deferring[0] += 1
            self._deferred.index = index
            return
        self.set_device(index)

    def has_primary_context(self, index: int) -> bool:
        """Whether device ``index``'s primary context is active (cuDevicePrimaryCtxGetState,
        through the driver entry points; creates nothing), asked at each call as torch's
        _hasPrimaryContext does: another library's cudaDeviceReset deinitializes it (r80a: an
        "active" cached for good made a scope's exit create it again).  True when the driver
        function cannot be reached: then restores stay eager, as before.  The entry points are
        looked up once, at the first restore (a look-up needs no context, and the simulator makes
        none: accel/sim/cudart/devices.py _NO_CONTEXT); the out-pointers are made once per thread."""
        fns = self._ctx_fns
        if fns is None:
            fns = self._ctx_fns = self._primary_ctx_fns()
        if isinstance(fns, str):
            return True
        get_state, devices, dffi = fns
        dev = devices.get(index)
        if dev is None:
            return True          # unknown: restore eagerly (what cudaSetDevice reports is then checked)
        try:
            flags, active = self._out.ctx_state
        except AttributeError:
            flags, active = self._out.ctx_state = (dffi.new("unsigned int *"), dffi.new("int *"))
        if get_state(dev, flags, active):
            return True
        return bool(active[0])

    def _primary_ctx_fns(self):
        """(cuDevicePrimaryCtxGetState, {index: CUdevice} of every device cuDeviceGet answers, the
        driver ffi), or why the driver functions cannot be had (str)."""
        from ..._ffi import _cudadrv
        from .driver import NoDriverFunction, resolve
        try:
            fns = resolve(self.ffi, self.lib, {"cuDeviceGet": "PFN_cuDeviceGet_v2000",
                                               "cuDevicePrimaryCtxGetState":
                                                   "PFN_cuDevicePrimaryCtxGetState_v7000"})[0]
        except NoDriverFunction as exc:
            return str(exc)
        devices, out = {}, _cudadrv.ffi.new("CUdevice_v1 *")
        for index in range(self.count()):
            if not fns["cuDeviceGet"](out, index):
                devices[index] = out[0]
        return fns["cuDevicePrimaryCtxGetState"], devices, _cudadrv.ffi

    def _bind_get_device(self):
        """get_device as a closure over the library function and a per-thread out-pointer:
        current_stream() calls it for every queued operation, so no attribute lookups."""
        cuda_get_device, ffi, check, out = self.lib.cudaGetDevice, self.ffi, self._check, self._out
        deferred, deferring = self._deferred, self._deferring

        def get_device() -> int:
            if deferring[0] and deferred.index >= 0:
                return deferred.index
            try:
                p = out.int_p
            except AttributeError:
                p = out.int_p = ffi.new("int *")
            rc = cuda_get_device(p)
            if rc:
                check(rc, "cudaGetDevice")
            return p[0]

        get_device.__doc__ = CudaDevicesMixin.get_device.__doc__
        return get_device

    def device_synchronize(self) -> None:
        self._check(self.lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def mem_info(self) -> Tuple[int, int]:
        free, total = self.ffi.new("size_t *"), self.ffi.new("size_t *")
        self._check(self.lib.cudaMemGetInfo(free, total), "cudaMemGetInfo")
        return free[0], total[0]
