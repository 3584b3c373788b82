"""Level Zero Sysman readings (the Backend ``smi_*`` capability) and peer access.

The Sysman handle of visible device ``i`` is the card ``zesDeviceGet`` lists for it (through
ZE_AFFINITY_MASK, as counting maps it), so nothing initializes the core runtime.  With a loader
or driver older than zesInit (API 1.5) Sysman answers only on core handles, and only when
``ZES_ENABLE_SYSMAN=1`` was in effect at zeInit: then the initialized device's own handle is used.

What Sysman gives directly: the GPU temperature sensor (``zesTemperatureGetState``, degrees C),
the GPU frequency domain's resolved clock (``zesFrequencyGetState``: ``actual`` MHz), memory
state (``zesMemoryGetState``) and the processes on the device (``zesDeviceProcessesGetState``).

Utilization, memory bandwidth and power are *counters* in Sysman, turned into rates from two
samples as ``zes_api.h`` (v1.4) defines them:

* utilization: ``zes_engine_stats_t``, "%util = (s2.activeTime - s1.activeTime) / (s2.timestamp -
  s1.timestamp)" (``zesEngineGetActivity``) of the engine group that runs compute kernels:
  ``ZES_ENGINE_GROUP_3D_RENDER_COMPUTE_ALL`` where listed (the header points to it for "the
  underlying resource utilization"), else ``ZES_ENGINE_GROUP_COMPUTE_ALL``, else
  ``ZES_ENGINE_GROUP_ALL``; several handles (one per tile, for a card) are averaged.
* memory_usage: ``zes_mem_bandwidth_t``, "%bw = 10^6 * ((s2.readCounter - s1.readCounter) +
  (s2.writeCounter - s1.writeCounter)) / (s2.maxBandwidth * (s2.timestamp - s1.timestamp))"
  (``zesMemoryGetBandwidth``) over the device-memory modules, as percent.  Sysman may refuse it
  (``ZE_RESULT_ERROR_INSUFFICIENT_PERMISSIONS`` for users without access to the telemetry):
  ``memory_usage`` then raises with that code; ``utilization`` reads other counters.
* power_draw: ``zes_power_energy_counter_t``, "PowerWatts = (s2.energy - s1.energy) /
  (s2.timestamp - s1.timestamp)" (microjoules over microseconds, ``zesPowerGetEnergyCounter``), in
  milliwatts as NVML's: the card's domain (``zesDeviceGetCardPowerDomain``, else the first domain
  not on a sub-device) for a card, the tile's domain for a tile.

Sampling: accel keeps the previous reading of each counter handle (one per engine group, memory
module and power domain: bounded by the device's components) and reports the average since
then, as ``psutil.cpu_percent(interval=None)`` does.  The first reading of a handle, one younger
than :data:`SAMPLE_INTERVAL_S`, or one the counters have gone backwards from (a device reset)
waits that interval and reads again.  A forked child starts with no previous readings.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..._errors import AcceleratorError
from ._library import LIBRARY

#: The shortest span a utilization, memory_usage or power_draw reading averages over, seconds
#: (NVML's sample period is 1/6 s to 1 s; this is enough for the counters' microsecond clocks).
SAMPLE_INTERVAL_S = 0.05
_PROCESS_LIST_ATTEMPTS = 8      # asks with more room before a growing process list is an error
_PROCESS_LIST_MAX = 1 << 16     # a count above any real process table


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
            dev = self._devices[index] if self._devices and index < len(self._devices) else None
            if dev is not None:
                # after init: the card paired with the device by identity (_map_sysman), never by
                # position (zesDeviceGet's order need not be zeDeviceGet's: r82d, r84a)
                if dev.sysman is None:
                    raise AcceleratorError(
                        f"Level Zero Sysman: XPU device {index} matches no Sysman device by UUID (its "
                        f"uuid {dev.uuid.hex()} is none of the {len(self._sysman_cards)} zesDeviceGet "
                        f"lists), so its readings cannot be told from another card's", library=LIBRARY)
                card = next(i for i, c in enumerate(self._sysman_cards) if c[0] == dev.sysman)
                return ffi, lib, dev.sysman, dev.sysman_tile, card
            card, tile = visible[index]
            return ffi, lib, self._sysman_cards[card][0], tile, card
        if self._sysman_legacy and self._devices:
            dev = self._device(index)
            return ffi, lib, dev.handle, dev.subdevice_id, index
        if not self._devices:
            # Without zesInit, Sysman handles are the core devices of a zeInit made with
            # ZES_ENABLE_SYSMAN=1; readings never start the runtime (a fork afterwards stays safe),
            # so before the first device use there is nothing to read through
            if self._zes_legacy_asked:      # (r69i: it blamed the loader, which has zesInit)
                raise AcceleratorError(
                    "Level Zero Sysman readings under ZES_ENABLE_SYSMAN=1 (legacy Sysman, which accel "
                    "keeps by making no zesInit) read through the initialized runtime's devices, and "
                    "readings never initialize the runtime themselves (so that a fork afterwards stays "
                    "safe). Use the device first (e.g. accel.current_device_index() or a Buffer), or "
                    "unset ZES_ENABLE_SYSMAN to read through zesInit", library=LIBRARY)
            raise AcceleratorError(
                "Level Zero Sysman readings on this loader need the runtime initialized: the loader or "
                "driver has no zesInit (Level Zero API 1.5+), and readings never initialize the runtime "
                "themselves (so that a fork afterwards stays safe). Use the device first (any call that "
                "initializes it, e.g. accel.current_device_index() or a Buffer) with ZES_ENABLE_SYSMAN "
                "unset or non-zero, or install a newer loader and driver", library=LIBRARY)
        raise AcceleratorError(
            "Level Zero Sysman is not available: the loader or driver has no zesInit (Level Zero API "
            "1.5+), and ZES_ENABLE_SYSMAN=1 was not in effect when the runtime initialized. Use a "
            "newer loader and driver, or set ZES_ENABLE_SYSMAN=1 before the first device use",
            library=LIBRARY)

    def smi_index(self, index: int) -> int:
        return self._smi_target(index)[4]

    # -- counters sampled twice -------------------------------------------------------------
    def _sampled(self, kind: str, handles: Sequence[object], read: Callable[[object], tuple]
                 ) -> List[Tuple[tuple, tuple]]:
        """(previous, current) readings of each handle; ``read(handle)`` gives a tuple of
        monotonic counters whose last item is the counter's own timestamp (microseconds).

        The previous reading is the one kept from the last call (per handle); a missing one,
        one younger than SAMPLE_INTERVAL_S, or one a counter went backwards from, makes this
        call read, wait, and read again."""
        ffi = self._library()[0]
        keys = [(kind, int(ffi.cast("uintptr_t", h))) for h in handles]
        with self._lock:
            kept = getattr(self, "_smi_prev", None)
            if kept is None or kept[0] != os.getpid():      # a forked child's handles are new
                kept = self._smi_prev = (os.getpid(), {})
            prev = [kept[1].get(k) for k in keys]
        now = [(time.monotonic(), read(h)) for h in handles]
        usable = all(p is not None and all(b >= a for a, b in zip(p[1], c[1])) and c[1][-1] > p[1][-1]
                     for p, c in zip(prev, now))
        if usable:
            wait = SAMPLE_INTERVAL_S - (now[0][0] - max(p[0] for p in prev))
        else:
            prev, wait = now, SAMPLE_INTERVAL_S
        if wait > 0:
            time.sleep(wait)
            now = [(time.monotonic(), read(h)) for h in handles]
        for p, c in zip(prev, now):
            if c[1][-1] <= p[1][-1] or any(b < a for a, b in zip(p[1], c[1])):
                raise AcceleratorError(f"xpu: Sysman {kind} counters did not advance monotonically over "
                                       f"{SAMPLE_INTERVAL_S} s ({p[1]} then {c[1]}); read again", library=LIBRARY)
        with self._lock:
            table: Dict = self._smi_prev[1]
            for k, c in zip(keys, now):
                table[k] = c
        return [(p[1], c[1]) for p, c in zip(prev, now)]

    def _components(self, ffi, lib, handle, tile, enum_call: str, ctype: str, enum, props_call: str,
                    props_type: str, stype: str, getter) -> list:
        """[(component handle, properties)] of the device's components of one kind that belong
        to ``tile`` (all of them for a card)."""
        found = []
        for comp in self._enum(ffi, lib, enum_call, ctype, lambda n, a: enum(handle, n, a)):
            props = ffi.new(f"{props_type} *")
            props.stype = getattr(lib, stype)
            self._check_rc(props_call, getter(comp, props))
            if tile is not None and props.onSubdevice and props.subdeviceId != tile:
                continue
            found.append((comp, props))
        return found

    def _engines(self, ffi, lib, handle, tile, index: int) -> list:
        comps = self._components(ffi, lib, handle, tile, "zesDeviceEnumEngineGroups", "zes_engine_handle_t",
                                 lib.zesDeviceEnumEngineGroups, "zesEngineGetProperties",
                                 "zes_engine_properties_t", "ZES_STRUCTURE_TYPE_ENGINE_PROPERTIES",
                                 lib.zesEngineGetProperties)
        for group in ("ZES_ENGINE_GROUP_3D_RENDER_COMPUTE_ALL", "ZES_ENGINE_GROUP_COMPUTE_ALL",
                      "ZES_ENGINE_GROUP_ALL"):
            chosen = [c for c, p in comps if p.type == getattr(lib, group)]
            if chosen:
                return chosen
        raise AcceleratorError(f"xpu: Sysman lists no compute engine group (ZES_ENGINE_GROUP_3D_RENDER_"
                               f"COMPUTE_ALL, _COMPUTE_ALL or _ALL) for device {index}", library=LIBRARY)

    def smi_memory_usage(self, index: int) -> int:
        """Percent of the device memory's bandwidth used since the previous reading (the first
        call waits SAMPLE_INTERVAL_S)."""
        ffi, lib, handle, tile, _ = self._smi_target(index)
        modules = [m for m, p in self._components(
            ffi, lib, handle, tile, "zesDeviceEnumMemoryModules", "zes_mem_handle_t", lib.zesDeviceEnumMemoryModules,
            "zesMemoryGetProperties", "zes_mem_properties_t", "ZES_STRUCTURE_TYPE_MEM_PROPERTIES",
            lib.zesMemoryGetProperties) if p.location == lib.ZES_MEM_LOC_DEVICE]
        if not modules:
            raise AcceleratorError(f"xpu: Sysman lists no device memory module for device {index}", library=LIBRARY)
        limits = {}

        def read(m):
            bw = ffi.new("zes_mem_bandwidth_t *")
            # ZE_RESULT_ERROR_INSUFFICIENT_PERMISSIONS where the user may not read this telemetry
            self._check_rc("zesMemoryGetBandwidth", lib.zesMemoryGetBandwidth(m, bw))
            limits[int(ffi.cast("uintptr_t", m))] = bw.maxBandwidth     # the latest (s2's)
            return bw.readCounter, bw.writeCounter, bw.timestamp

        pairs = self._sampled("bandwidth", modules, read)
        moved = sum((c[0] - p[0]) + (c[1] - p[1]) for p, c in pairs)
        capacity = sum(limits[int(ffi.cast("uintptr_t", m))] * (c[2] - p[2])      # bytes/s * us
                       for m, (p, c) in zip(modules, pairs))
        if capacity <= 0:
            raise AcceleratorError(f"xpu: Sysman reports no memory bandwidth (maxBandwidth 0) for device {index}",
                                   library=LIBRARY)
        return _percent(100 * 1_000_000 * moved / capacity)

    def smi_gpu_utilization(self, index: int) -> int:
        """Percent of the time since the previous reading the compute engines were active (the
        first call waits SAMPLE_INTERVAL_S)."""
        ffi, lib, handle, tile, _ = self._smi_target(index)
        engines = self._engines(ffi, lib, handle, tile, index)

        def read(e):
            st = ffi.new("zes_engine_stats_t *")
            self._check_rc("zesEngineGetActivity", lib.zesEngineGetActivity(e, st))
            return st.activeTime, st.timestamp

        pairs = self._sampled("engine", engines, read)
        return _percent(100 * sum((c[0] - p[0]) / (c[1] - p[1]) for p, c in pairs) / len(pairs))

    def smi_utilization(self, index: int) -> Tuple[int, int]:
        """(smi_gpu_utilization, smi_memory_usage): each samples its own counters."""
        return self.smi_gpu_utilization(index), self.smi_memory_usage(index)

    def _power_domain(self, ffi, lib, handle, tile, index: int):
        if tile is None:
            # the whole card, as NVML's board power; a device without card-level telemetry says
            # ZE_RESULT_ERROR_UNSUPPORTED_FEATURE: then its first domain not on a sub-device
            card = ffi.new("zes_pwr_handle_t *")
            rc = lib.zesDeviceGetCardPowerDomain(handle, card)
            if rc == 0:
                return card[0]
            if rc != lib.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE:
                self._check_rc("zesDeviceGetCardPowerDomain", rc)
        comps = self._components(ffi, lib, handle, tile, "zesDeviceEnumPowerDomains", "zes_pwr_handle_t",
                                 lib.zesDeviceEnumPowerDomains, "zesPowerGetProperties", "zes_power_properties_t",
                                 "ZES_STRUCTURE_TYPE_POWER_PROPERTIES", lib.zesPowerGetProperties)
        for comp, props in comps:
            if bool(props.onSubdevice) == (tile is not None):
                return comp
        where = "the card" if tile is None else f"tile {tile}"
        raise AcceleratorError(f"xpu: Sysman lists no power domain of {where} for device {index}", library=LIBRARY)

    def smi_power_draw(self, index: int) -> int:
        """Average power in milliwatts since the previous reading (the first call waits
        SAMPLE_INTERVAL_S)."""
        ffi, lib, handle, tile, _ = self._smi_target(index)
        domain = self._power_domain(ffi, lib, handle, tile, index)

        def read(d):
            e = ffi.new("zes_power_energy_counter_t *")
            self._check_rc("zesPowerGetEnergyCounter", lib.zesPowerGetEnergyCounter(d, e))
            return e.energy, e.timestamp

        (p, c), = self._sampled("power", [domain], read)
        return int(round(1000 * (c[0] - p[0]) / (c[1] - p[1])))     # uJ / us = W


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
        room = n[0]
        for _attempt in range(_PROCESS_LIST_ATTEMPTS):
            room = min(max(room, n[0]), _PROCESS_LIST_MAX) + 4   # processes may start between the calls
            arr = ffi.new("zes_process_state_t[]", room)
            for k in range(room):
                arr[k].stype = lib.ZES_STRUCTURE_TYPE_PROCESS_STATE
            n[0] = room
            rc = lib.zesDeviceProcessesGetState(handle, n, arr)
            if rc == lib.ZE_RESULT_ERROR_INVALID_SIZE:
                continue
            self._check_rc("zesDeviceProcessesGetState", rc)
            return [(int(arr[k].processId), int(arr[k].memSize)) for k in range(n[0])]
        # a list that never fits: an error, not a loop forever
        self._fail("zesDeviceProcessesGetState", rc, f"the process list kept growing past the room given, "
                   f"{_PROCESS_LIST_ATTEMPTS} times; read again")

    def can_access_peer(self, index: int, peer: int) -> bool:
        ffi, lib, _ = self._lib
        value = ffi.new("ze_bool_t *")
        self._check_rc("zeDeviceCanAccessPeer",
                       lib.zeDeviceCanAccessPeer(self._device(index).handle, self._device(peer).handle, value))
        return bool(value[0])


def _percent(value: float) -> int:
    """A rate as an integer percent, 0..100 (counters sampled at slightly different instants can
    overshoot by a hair)."""
    return int(round(min(max(value, 0.0), 100.0)))
