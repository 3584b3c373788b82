"""Level Zero Sysman readings (the Backend ``smi_*`` capability) and peer access.

The Sysman handle of visible device ``i`` is the card ``zesDeviceGet`` lists for it (through
ZE_AFFINITY_MASK, as counting maps it), so nothing initializes the core runtime.  With a loader
or driver older than zesInit (API 1.5) Sysman answers only on core handles, and only when
``ZES_ENABLE_SYSMAN=1`` was in effect at zeInit: then the initialized device's own handle is used.

What Sysman gives directly: the GPU temperature sensor (``zesTemperatureGetState``, degrees C),
the GPU frequency domain's resolved clock (``zesFrequencyGetState``: ``actual`` MHz), memory
state (``zesMemoryGetState``) and the processes on the device (``zesDeviceProcessesGetState``).
Utilization, memory bandwidth and power are *counters* in Sysman (``zesEngineGetActivity``,
``zesMemoryGetBandwidth``, ``zesPowerGetEnergyCounter``) whose rate needs two samples some time
apart; accel does not sample them yet, and says so.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from ..._errors import AcceleratorError
from ._library import LIBRARY


class TelemetryMixin:
    """``smi_*`` over Sysman and ``can_access_peer`` over ``zeDeviceCanAccessPeer``."""

    supports_smi = True

    def _smi_target(self, index: int) -> Tuple[object, object, object, Optional[int], int]:
        """(ffi, lib, Sysman handle, tile or None, card index) for visible device ``index``."""
        self.count()
        ffi, lib, _ = self._library()
        if self._zes_usable():
            visible = self._sysman_discover()
            if not 0 <= index < len(visible):
                raise ValueError(f"device index {index} is out of range: {len(visible)} XPU device(s) visible")
            card, tile = visible[index]
            return ffi, lib, self._sysman_cards[card][0], tile, card
        if self._sysman_legacy and self._devices:
            dev = self._device(index)
            return ffi, lib, dev.handle, dev.subdevice_id, index
        raise AcceleratorError(
            "Level Zero Sysman is not available: the loader or driver has no zesInit (Level Zero API "
            "1.5+), and ZES_ENABLE_SYSMAN=1 was not in effect when the runtime initialized. Use a "
            "newer loader and driver, or set ZES_ENABLE_SYSMAN=1 before the first device use",
            library=LIBRARY)

    def _not_sampled(self, what: str, counter: str) -> AcceleratorError:
        return AcceleratorError(
            f"xpu: {what} is a Sysman counter ({counter}) that needs two samples some time apart; "
            f"accel does not sample it yet (temperature, clock_rate, device_memory_used and "
            f"list_gpu_processes are available)", library=LIBRARY)

    def smi_index(self, index: int) -> int:
        return self._smi_target(index)[4]

    def smi_utilization(self, index: int) -> Tuple[int, int]:
        self._smi_target(index)
        raise self._not_sampled("utilization", "zesEngineGetActivity")

    def smi_power_draw(self, index: int) -> int:
        self._smi_target(index)
        raise self._not_sampled("power_draw", "zesPowerGetEnergyCounter")


    def smi_temperature(self, index: int) -> int:
        ffi, lib, handle, tile, _ = self._smi_target(index)
        best = None
        for sensor in self._enum(ffi, lib, "zesDeviceEnumTemperatureSensors", "zes_temp_handle_t",
                                 lambda n, a: lib.zesDeviceEnumTemperatureSensors(handle, n, a)):
            props = ffi.new("zes_temp_properties_t *")
            props.stype = lib.ZES_STRUCTURE_TYPE_TEMP_PROPERTIES
            self._check_rc("zesTemperatureGetProperties", lib.zesTemperatureGetProperties(sensor, props))
            # ZES_TEMP_SENSORS_GPU: "the maximum temperature across all sensors in the GPU"
            if props.type != lib.ZES_TEMP_SENSORS_GPU:
                continue
            if tile is not None and props.onSubdevice and props.subdeviceId != tile:
                continue
            value = ffi.new("double *")
            self._check_rc("zesTemperatureGetState", lib.zesTemperatureGetState(sensor, value))
            best = value[0] if best is None else max(best, value[0])
        if best is None:
            raise AcceleratorError("xpu: Sysman lists no GPU temperature sensor (ZES_TEMP_SENSORS_GPU) "
                                   f"for device {index}", library=LIBRARY)
        return int(round(best))

    def smi_clock_rate(self, index: int) -> int:
        ffi, lib, handle, tile, _ = self._smi_target(index)
        for domain in self._enum(ffi, lib, "zesDeviceEnumFrequencyDomains", "zes_freq_handle_t",
                                 lambda n, a: lib.zesDeviceEnumFrequencyDomains(handle, n, a)):
            props = ffi.new("zes_freq_properties_t *")
            props.stype = lib.ZES_STRUCTURE_TYPE_FREQ_PROPERTIES
            self._check_rc("zesFrequencyGetProperties", lib.zesFrequencyGetProperties(domain, props))
            if props.type != lib.ZES_FREQ_DOMAIN_GPU:
                continue
            if tile is not None and props.onSubdevice and props.subdeviceId != tile:
                continue
            st = ffi.new("zes_freq_state_t *")
            st.stype = lib.ZES_STRUCTURE_TYPE_FREQ_STATE
            self._check_rc("zesFrequencyGetState", lib.zesFrequencyGetState(domain, st))
            if st.actual < 0:       # zes_api.h: negative = not known
                break
            return int(round(st.actual))
        raise AcceleratorError(f"xpu: Sysman reports no GPU frequency (ZES_FREQ_DOMAIN_GPU) for device {index}",
                               library=LIBRARY)

    def smi_memory_used(self, index: int) -> int:
        ffi, lib, handle, tile, _ = self._smi_target(index)
        used = 0
        found = False
        for m in self._enum(ffi, lib, "zesDeviceEnumMemoryModules", "zes_mem_handle_t",
                            lambda n, a: lib.zesDeviceEnumMemoryModules(handle, n, a)):
            props = ffi.new("zes_mem_properties_t *")
            props.stype = lib.ZES_STRUCTURE_TYPE_MEM_PROPERTIES
            self._check_rc("zesMemoryGetProperties", lib.zesMemoryGetProperties(m, props))
            if props.location != lib.ZES_MEM_LOC_DEVICE:
                continue
            if tile is not None and props.onSubdevice and props.subdeviceId != tile:
                continue
            st = ffi.new("zes_mem_state_t *")
            st.stype = lib.ZES_STRUCTURE_TYPE_MEM_STATE
            self._check_rc("zesMemoryGetState", lib.zesMemoryGetState(m, st))
            used += st.size - st.free
            found = True
        if not found:
            raise AcceleratorError(f"xpu: Sysman lists no device memory module for device {index}", library=LIBRARY)
        return int(used)

    def smi_processes(self, index: int) -> List[Tuple[int, Optional[int]]]:
        ffi, lib, handle, _tile, _ = self._smi_target(index)
        n = ffi.new("uint32_t *", 0)
        self._check_rc("zesDeviceProcessesGetState", lib.zesDeviceProcessesGetState(handle, n, ffi.NULL))
        while True:
            room = n[0] + 4       # processes may start between the two calls
            arr = ffi.new("zes_process_state_t[]", room)
            for k in range(room):
                arr[k].stype = lib.ZES_STRUCTURE_TYPE_PROCESS_STATE
            n[0] = room
            rc = lib.zesDeviceProcessesGetState(handle, n, arr)
            if rc == lib.ZE_RESULT_ERROR_INVALID_SIZE:
                continue
            self._check_rc("zesDeviceProcessesGetState", rc)
            return [(int(arr[k].processId), int(arr[k].memSize)) for k in range(n[0])]

    def can_access_peer(self, index: int, peer: int) -> bool:
        ffi, lib, _ = self._lib
        value = ffi.new("ze_bool_t *")
        self._check_rc("zeDeviceCanAccessPeer",
                       lib.zeDeviceCanAccessPeer(self._device(index).handle, self._device(peer).handle, value))
        return bool(value[0])
