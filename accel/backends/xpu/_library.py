"""The Level Zero loader: opening it (real or simulated), its symbol contract, and errors.

``REQUIRED_SYMBOLS`` are called without checking (Debian's 1.8.12 loader exports them all);
``OPTIONAL_SYMBOLS`` only after :meth:`LibraryMixin._has`.  Errors name the library, the call,
the ``ze_result_t`` name and code; out-of-memory results raise :class:`accel.OutOfMemoryError`.
"""

from __future__ import annotations

from ..._errors import AcceleratorError, OutOfMemoryError


LIBRARY = "libze_loader"
#: Every Level Zero function this backend calls without first checking that the
#: loader exports it.  Debian's loader 1.8.12 must (and does) export all of these;
#: tests check it against the real library and against the calls in this file and _ze_count.py.
REQUIRED_SYMBOLS = (
    "zeInit", "zeDriverGet", "zeDriverGetApiVersion", "zeDriverGetProperties",
    "zeDeviceGet", "zeDeviceGetProperties", "zeDeviceGetMemoryProperties",
    "zeDeviceGetComputeProperties", "zeDeviceGetModuleProperties",
    "zeDeviceGetCommandQueueGroupProperties",
    "zeContextCreate", "zeContextDestroy",
    "zeMemAllocDevice", "zeMemAllocHost", "zeMemFree", "zeMemGetAllocProperties",
    "zeCommandListCreateImmediate", "zeCommandListCreate", "zeCommandListClose", "zeCommandListDestroy",
    "zeCommandListAppendMemoryCopy", "zeCommandListAppendMemoryFill", "zeCommandListAppendSignalEvent",
    "zeCommandListAppendWaitOnEvents", "zeCommandListAppendEventReset", "zeCommandListAppendBarrier",
    "zeCommandQueueCreate", "zeCommandQueueDestroy", "zeCommandQueueExecuteCommandLists",
    "zeCommandQueueSynchronize",
    "zeEventPoolCreate", "zeEventPoolDestroy", "zeEventCreate", "zeEventDestroy",
    "zeEventHostSynchronize", "zeEventQueryStatus", "zeEventHostReset", "zeEventQueryKernelTimestamp",
    "zesDeviceGetProperties", "zesDeviceEnumMemoryModules", "zesMemoryGetProperties", "zesMemoryGetState",
    # virtual memory (vmm.py): core API 1.0
    "zeVirtualMemQueryPageSize", "zeVirtualMemReserve", "zeVirtualMemFree", "zePhysicalMemCreate",
    "zePhysicalMemDestroy", "zeVirtualMemMap", "zeVirtualMemUnmap", "zeVirtualMemSetAccessAttribute",
    # readings and peer access (telemetry.py): API 1.0
    "zeDeviceCanAccessPeer", "zesDeviceEnumTemperatureSensors", "zesTemperatureGetProperties",
    "zesTemperatureGetState", "zesDeviceEnumFrequencyDomains", "zesFrequencyGetProperties",
    "zesFrequencyGetState", "zesDeviceProcessesGetState",
    # counters sampled twice (telemetry.py): API 1.0, in Debian's 1.8.12 loader too
    "zesDeviceEnumEngineGroups", "zesEngineGetProperties", "zesEngineGetActivity", "zesMemoryGetBandwidth",
    # user kernels (kernels.py): API 1.0
    "zeModuleCreate", "zeModuleDestroy", "zeModuleBuildLogGetString", "zeModuleBuildLogDestroy",
    "zeKernelCreate", "zeKernelDestroy", "zeKernelSetGroupSize", "zeKernelSetArgumentValue",
    "zeCommandListAppendLaunchKernel",
    "zesDeviceEnumPowerDomains", "zesDeviceGetCardPowerDomain", "zesPowerGetProperties",
    "zesPowerGetEnergyCounter",
)
#: Called only after checking the loader exports them (API 1.5/1.6 additions).
OPTIONAL_SYMBOLS = ("zesInit", "zesDriverGet", "zesDeviceGet", "zeCommandListHostSynchronize")
_UINT64_MAX = (1 << 64) - 1
_DESCRIPTIONS = {
    "ZE_RESULT_ERROR_UNINITIALIZED": "the Level Zero loader found no driver, or no device to drive",
    "ZE_RESULT_ERROR_DEVICE_LOST": "the device hung or was reset",
    "ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY": "out of device memory",
    "ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY": "out of host memory",
    "ZE_RESULT_ERROR_UNSUPPORTED_SIZE": "size is zero or above the device's maxMemAllocSize",
}


class LibraryMixin:
    """Opening the loader (``_lib``: ffi, lib, path), result names, errors, and releases on
    error paths (``_orphans``)."""

    def _library(self):
        if self._lib is None and self._lib_error is None:
            with self._lock:
                if self._lib is None and self._lib_error is None:
                    try:
                        self._lib = self._open()
                    except OSError as exc:
                        self._lib_error = str(exc)
        if self._lib is None:
            raise AcceleratorError(f"{LIBRARY} could not be loaded: {self._lib_error}", library=LIBRARY)
        return self._lib

    def _open(self):
        if self.simulated:
            from ..._ffi import _ze
            from ...sim import ze as sim_ze
            try:
                from ...sim import open_library as sim_open
            except ImportError:
                sim_open = None
            lib = None
            if sim_open is not None:
                try:
                    lib = sim_open("ze")
                except (KeyError, ValueError):
                    lib = None
            if lib is None:
                lib = sim_ze.open_ze()
            return _ze.ffi, lib, "accel.sim (ze)"
        from ..._ffi import open_library
        return open_library("ze")

    @staticmethod
    def _has(lib, symbol: str) -> bool:
        from ..._ffi import has_symbol   # a declared symbol the loader lacks raises ffi.error, not AttributeError
        return has_symbol(lib, symbol)

    def _result_name(self, rc: int) -> str:
        names = getattr(self, "_names", None)
        if names is None:
            ffi = self._lib[0]
            names = self._names = {v: k for v, k in ffi.typeof("ze_result_t").elements.items()
                                   if not k.endswith("FORCE_UINT32")}
        return names.get(rc, "ZE_RESULT_UNKNOWN")

    def _error(self, call: str, rc: int, extra: str = "") -> AcceleratorError:
        name = self._result_name(rc)
        text = f"{rc:#010x}"
        if name in _DESCRIPTIONS:
            text += f", {_DESCRIPTIONS[name]}"
        if extra:
            text += f"; {extra}"
        oom = name in ("ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY", "ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY")
        cls = OutOfMemoryError if oom else AcceleratorError
        return cls.from_call(LIBRARY, call, rc, name, text)

    def _fail(self, call: str, rc: int, extra: str = ""):
        raise self._error(call, rc, extra)

    def _check_rc(self, call: str, rc: int) -> None:
        if rc:
            self._fail(call, rc)

    def _free_forgetting(self, table: dict, key: int, free) -> tuple:
        """``free(entry)`` with ``table[key]`` forgotten first (under the lock) and put back if
        ``free`` raises; returns the entry.  Why first: once the driver has an address or handle
        back it may give the same value to another thread's allocation, whose entry an update
        after the call would drop (test_vmm_ze's reuse tests)."""
        with self._lock:
            entry = table.pop(key, None)
        if entry is None:
            raise ValueError(f"{self.name}: 0x{key:x} was released by another thread meanwhile (a double free)")
        try:
            free(entry)
        except BaseException:
            with self._lock:
                table[key] = entry
            raise
        return entry

    def _discard(self, call: str, handle) -> None:
        """Release ``handle`` with ``call`` on an error path (another error is being raised); a
        failure keeps it for the next _sweep instead of leaking it."""
        if getattr(self._lib[1], call)(handle):
            with self._lock:
                self._orphans.append((call, handle))
