"""Sysman (zes*): card properties, memory modules and their state and bandwidth, temperature
sensors, frequency domains, engine groups and activity, power and energy, and processes.
"""

from __future__ import annotations

import os

from .. import _ze_counters, core
from . import objects
from .objects import _Card
from .common import _fill, _sysman
from .discovery import _extension_chain, _write_core_properties


# -- Sysman -------------------------------------------------------------------------------------------

def _card_of(obj) -> _Card:
    return obj if obj.kind == "card" else obj.card


def zesDeviceGetProperties(hDevice, props):
    rt, dev, rc = _sysman(hDevice)
    if rc:
        return rc
    C = rt.C
    # (r79b) zes_api.h v1.4, zesDeviceGetProperties: "hDevice [in] Sysman handle of the device"; the
    # docs are silent on another object's handle (a memory module's, a sensor's): refused, as the
    # sibling zesDevice* calls refuse it.
    if dev.kind not in ("card", "device"):
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    # (r79b) @returns: ZE_RESULT_ERROR_INVALID_NULL_POINTER for "`nullptr == pProperties`"
    if not props:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if props.stype != C.ZES_STRUCTURE_TYPE_DEVICE_PROPERTIES:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    if _extension_chain(props):
        return C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE   # (r72a) discovery._extension_chain
    card = _card_of(dev)
    props.core.stype = C.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES
    rc = _write_core_properties(rt, props.core, card.uuid, False, 0, card.tiles)
    if rc:
        return rc
    props.numSubdevices = card.tiles if card.tiles > 1 else 0
    props.serialNumber = b"unknown"
    props.boardNumber = b"unknown"
    props.brandName = b"Intel(R) Corporation (simulated)"
    props.modelName = core.config().name.encode()[:63]
    props.vendorName = b"Intel(R) Corporation"
    props.driverVersion = b"1.3.29735 (accel.sim)"
    return 0


def zesDeviceEnumMemoryModules(hDevice, pCount, phMemory):
    rt, dev, rc = _sysman(hDevice)
    if rc:
        return rc
    # (r79b) zes_api.h v1.4: "hDevice [in] Sysman handle of the device"; the docs are silent on
    # another object's handle: refused, as zesDeviceGetProperties.
    if dev.kind not in ("card", "device"):
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    return _fill(pCount, phMemory, _card_of(dev).modules)


def zesMemoryGetProperties(hMemory, props):
    rt, mod, rc = _sysman(hMemory)
    if rc:
        return rc
    C = rt.C
    if mod.kind != "memmodule":
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if not props:       # (r79b) zes_api.h @returns: INVALID_NULL_POINTER, "`nullptr == pProperties`"
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if props.stype != C.ZES_STRUCTURE_TYPE_MEM_PROPERTIES:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    if _extension_chain(props):
        return C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE   # (r72a) discovery._extension_chain
    props.type = C.ZES_MEM_TYPE_HBM if mod.location == C.ZES_MEM_LOC_DEVICE else C.ZES_MEM_TYPE_DDR5
    props.onSubdevice = 1 if mod.tile is not None else 0
    props.subdeviceId = mod.tile or 0
    props.location = mod.location
    props.physicalSize = core.config().memory if mod.location == C.ZES_MEM_LOC_DEVICE else 64 << 30
    props.busWidth = -1
    props.numChannels = -1
    return 0


def zesMemoryGetState(hMemory, st):
    rt, mod, rc = _sysman(hMemory)
    if rc:
        return rc
    C = rt.C
    if mod.kind != "memmodule":
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if not st:          # (r79b) zes_api.h @returns: INVALID_NULL_POINTER, "`nullptr == pState`"
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if st.stype != C.ZES_STRUCTURE_TYPE_MEM_STATE:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    if _extension_chain(st):
        return C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE   # (r72a) discovery._extension_chain
    st.health = C.ZES_MEM_HEALTH_OK
    if mod.location != C.ZES_MEM_LOC_DEVICE:
        st.size, st.free = 64 << 30, 48 << 30
        return 0
    size = core.config().memory
    tiles = [mod.tile] if mod.tile is not None else list(range(mod.card.tiles))
    used = sum(mod.card.tile_used[t] for t in tiles)
    st.size = size
    st.free = max(size - used, 0)
    return 0


# Readings (simulated values).  Sysman reads sensors and clocks of the hardware; the simulator
# has neither.  A card is *busy* while a command list or queue of the simulated driver on it has
# work queued or running at the moment of the query (the same model as accel/sim/nvml.py), and:
#
#   reading (call)                                         idle     busy
#   temperature, C (zesTemperatureGetState, ZES_TEMP_SENSORS_GPU)  35   65
#   GPU frequency, MHz (zesFrequencyGetState .actual)      300      1600 (coreClockRate)
#
# Each card has one GPU temperature sensor and one GPU frequency domain (min 300, max 1600 MHz).
# zesDeviceProcessesGetState lists this process on each card a core device of zeInit stands for,
# using the card's allocated device memory (what zesMemoryGetState counts as used).

_TEMP_IDLE, _TEMP_BUSY = 35.0, 65.0
_FREQ_MIN, _FREQ_MAX = 300.0, 1600.0
_ENGINE_TYPE_FLAG_COMPUTE = 1 << 1     # zes_api.h, zes_engine_type_flag_t (not in the bindings)


def card_busy(card: _Card) -> bool:
    """True while a command list or queue on ``card`` has work queued or running."""
    rt = objects._rt       # read live: made by zeInit, dropped by a reset
    if rt is None:
        return False
    for _ in range(8):      # another thread may create or destroy objects meanwhile
        try:
            objs = list(rt.objects.values())
            break
        except RuntimeError:
            continue
    else:
        return False
    for obj in objs:
        if obj.kind in ("cmdlist", "cmdqueue") and obj.live and obj.device.card is card and obj.queue is not None:
            if not obj.queue.idle():
                return True
    return False


def zesDeviceEnumTemperatureSensors(hDevice, pCount, phTemperature):
    rt, dev, rc = _sysman(hDevice)
    if rc:
        return rc
    if dev.kind not in ("card", "device"):
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    return _fill(pCount, phTemperature, _card_of(dev).sensors)


def zesTemperatureGetProperties(hTemperature, pProperties):
    rt, part, rc = _sysman(hTemperature)
    if rc:
        return rc
    C = rt.C
    if part.kind != "tempsensor":
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if not pProperties:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if pProperties.stype != C.ZES_STRUCTURE_TYPE_TEMP_PROPERTIES:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    if _extension_chain(pProperties):
        return C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE   # (r72a) discovery._extension_chain
    pProperties.type = C.ZES_TEMP_SENSORS_GPU
    pProperties.onSubdevice = 0
    pProperties.subdeviceId = 0
    pProperties.maxTemperature = 105.0
    pProperties.isCriticalTempSupported = 0
    pProperties.isThreshold1Supported = 0
    pProperties.isThreshold2Supported = 0
    return 0


def zesTemperatureGetState(hTemperature, pTemperature):
    rt, part, rc = _sysman(hTemperature)
    if rc:
        return rc
    if part.kind != "tempsensor":
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if not pTemperature:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    pTemperature[0] = _TEMP_BUSY if card_busy(part.card) else _TEMP_IDLE
    return 0


def zesDeviceEnumFrequencyDomains(hDevice, pCount, phFrequency):
    rt, dev, rc = _sysman(hDevice)
    if rc:
        return rc
    if dev.kind not in ("card", "device"):
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    return _fill(pCount, phFrequency, _card_of(dev).freqs)


def zesFrequencyGetProperties(hFrequency, pProperties):
    rt, part, rc = _sysman(hFrequency)
    if rc:
        return rc
    C = rt.C
    if part.kind != "freqdomain":
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if not pProperties:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if pProperties.stype != C.ZES_STRUCTURE_TYPE_FREQ_PROPERTIES:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    if _extension_chain(pProperties):
        return C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE   # (r72a) discovery._extension_chain
    pProperties.type = C.ZES_FREQ_DOMAIN_GPU
    pProperties.onSubdevice = 0
    pProperties.subdeviceId = 0
    pProperties.canControl = 0
    pProperties.isThrottleEventSupported = 0
    pProperties.min = _FREQ_MIN
    pProperties.max = _FREQ_MAX
    return 0


def zesFrequencyGetState(hFrequency, pState):
    rt, part, rc = _sysman(hFrequency)
    if rc:
        return rc
    C = rt.C
    if part.kind != "freqdomain":
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if not pState:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if pState.stype != C.ZES_STRUCTURE_TYPE_FREQ_STATE:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    if _extension_chain(pState):
        return C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE   # (r72a) discovery._extension_chain
    actual = _FREQ_MAX if card_busy(part.card) else _FREQ_MIN
    pState.currentVoltage = -1.0      # zes_api.h: negative = not known
    pState.request = actual
    pState.tdp = _FREQ_MAX
    pState.efficient = _FREQ_MIN
    pState.actual = actual
    pState.throttleReasons = 0
    return 0


def zesDeviceProcessesGetState(hDevice, pCount, pProcesses):
    rt, dev, rc = _sysman(hDevice)
    if rc:
        return rc
    C = rt.C
    if dev.kind not in ("card", "device"):
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if not pCount:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    card = _card_of(dev)
    procs = []
    if rt.initialized and any(d.card is card for d in rt.devices):
        procs.append((os.getpid(), sum(card.tile_used)))
    # zes_api.h: *pCount 0 asks for the count; a larger count is lowered to the number of
    # processes; a smaller one gets that many and ZE_RESULT_ERROR_INVALID_SIZE.
    n = pCount[0]
    if n == 0:
        pCount[0] = len(procs)
        return 0
    if not pProcesses:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    for k, (pid, mem) in enumerate(procs[:n]):
        st = pProcesses[k]
        if st.stype != C.ZES_STRUCTURE_TYPE_PROCESS_STATE:
            return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
        if _extension_chain(st):
            return C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE   # (r72a) discovery._extension_chain
        st.processId = pid
        st.memSize = mem
        st.sharedSize = 0
        st.engines = _ENGINE_TYPE_FLAG_COMPUTE
    if n < len(procs):
        return C.ZE_RESULT_ERROR_INVALID_SIZE
    pCount[0] = len(procs)
    return 0


# Counters (zesEngineGetActivity, zesMemoryGetBandwidth, zesPowerGetEnergyCounter): the model is in
# accel/sim/_ze_counters.py.  Each card lists engine groups ALL, COMPUTE_ALL and COPY_ALL and power
# domains card-wide on a one-tile card, else per tile (onSubdevice), and its own card-level power domain
# first; zesDeviceGetCardPowerDomain returns that one.

_ENGINE_GROUP = {"all": "ZES_ENGINE_GROUP_ALL", "compute": "ZES_ENGINE_GROUP_COMPUTE_ALL",
                 "copy": "ZES_ENGINE_GROUP_COPY_ALL"}


def _component(handle, kind: str):
    """(runtime, component, 0) or (None, None, code) for a Sysman component of ``kind``."""
    rt, obj, rc = _sysman(handle)
    if rc:
        return None, None, rc
    if obj.kind != kind:
        return None, None, rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    return rt, obj, 0


def zesDeviceEnumEngineGroups(hDevice, pCount, phEngine):
    rt, dev, rc = _sysman(hDevice)
    if rc:
        return rc
    if dev.kind not in ("card", "device"):
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if not pCount:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    return _fill(pCount, phEngine, _card_of(dev).engines)


def zesEngineGetProperties(hEngine, pProperties):
    rt, eng, rc = _component(hEngine, "engine")
    if rc:
        return rc
    C = rt.C
    if not pProperties:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if pProperties.stype != C.ZES_STRUCTURE_TYPE_ENGINE_PROPERTIES:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    if _extension_chain(pProperties):
        return C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE   # (r72a) discovery._extension_chain
    pProperties.type = getattr(C, _ENGINE_GROUP[eng.group])
    pProperties.onSubdevice = 0 if eng.tile is None else 1
    pProperties.subdeviceId = eng.tile or 0
    return 0


def zesEngineGetActivity(hEngine, pStats):
    rt, eng, rc = _component(hEngine, "engine")
    if rc:
        return rc
    if not pStats:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    with rt.lock:
        meters = eng.meters()
        # zes_engine_stats_t: activeTime, "monotonic counter for time in microseconds that this
        # resource is actively running workloads"; the card-wide group of a one-tile card is its tile
        pStats.activeTime = sum(m.active[eng.group] for m in meters) // len(meters)
        pStats.timestamp = _ze_counters.now_us()
    return 0


def zesMemoryGetBandwidth(hMemory, pBandwidth):
    rt, mod, rc = _component(hMemory, "memmodule")
    if rc:
        return rc
    C = rt.C
    if not pBandwidth:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if mod.location != C.ZES_MEM_LOC_DEVICE:
        # System memory traffic is not simulated; zes_api.h lists no code for a module without
        # bandwidth counters: the simulator refuses with the generic one.
        return C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE
    with rt.lock:
        meters = mod.card.meters if mod.tile is None else [mod.card.meters[mod.tile]]
        pBandwidth.readCounter = sum(m.read for m in meters)
        pBandwidth.writeCounter = sum(m.write for m in meters)
        pBandwidth.maxBandwidth = _ze_counters.MAX_BANDWIDTH * len(meters)
        pBandwidth.timestamp = _ze_counters.now_us()
    return 0


def zesDeviceEnumPowerDomains(hDevice, pCount, phPower):
    rt, dev, rc = _sysman(hDevice)
    if rc:
        return rc
    if dev.kind not in ("card", "device"):
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if not pCount:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    return _fill(pCount, phPower, _card_of(dev).powers)


def zesDeviceGetCardPowerDomain(hDevice, phPower):
    rt, dev, rc = _sysman(hDevice)
    if rc:
        return rc
    if dev.kind not in ("card", "device"):
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if not phPower:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    phPower[0] = _card_of(dev).powers[0].key     # "power domain handle for the entire PCIe card"
    return 0


def zesPowerGetProperties(hPower, pProperties):
    rt, pwr, rc = _component(hPower, "power")
    if rc:
        return rc
    C = rt.C
    if not pProperties:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if pProperties.stype != C.ZES_STRUCTURE_TYPE_POWER_PROPERTIES:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    if _extension_chain(pProperties):
        return C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE   # (r72a) discovery._extension_chain
    pProperties.onSubdevice = 0 if pwr.tile is None else 1
    pProperties.subdeviceId = pwr.tile or 0
    pProperties.canControl = 0
    pProperties.isEnergyThresholdSupported = 0
    pProperties.defaultLimit = -1        # zes_api.h: (deprecated) -1 = not known
    pProperties.minLimit = -1
    pProperties.maxLimit = -1
    return 0


def zesPowerGetEnergyCounter(hPower, pEnergy):
    rt, pwr, rc = _component(hPower, "power")
    if rc:
        return rc
    if not pEnergy:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    with rt.lock:
        now = _ze_counters.now_us()
        # zes_power_energy_counter_t: energy, "the monotonic energy counter in microjoules"
        pEnergy.energy = _ze_counters.energy_uj(pwr.meters(), pwr.card.tiles, pwr.card.t0, now)
        pEnergy.timestamp = now
    return 0
