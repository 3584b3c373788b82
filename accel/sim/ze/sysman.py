"""Sysman (zes*): card properties, memory modules and their state and bandwidth, temperature
sensors, frequency domains, engine groups and activity, power and energy, and processes.
"""

from __future__ import annotations

import os

from .. import _ze_counters, core
from . import objects
from .objects import _Card
from .common import _fill, _struct_code, _sysman
from .discovery import _write_core_properties


# -- Sysman -------------------------------------------------------------------------------------------

def _card_of(obj) -> _Card:
    return obj if obj.kind == "card" else obj.card


#: The kinds of a Sysman device handle: a card (zesDeviceGet) or a core device (ZES_ENABLE_SYSMAN=1).
_DEVICE = ("card", "device")


def _component(handle, kinds):
    """(runtime, Sysman object, 0) or (None, None, code): _sysman, then ZE_RESULT_ERROR_INVALID_ARGUMENT
    for an object of another kind than ``kinds``.  (r79b) zes_api.h v1.4, zesDevice*: "hDevice [in]
    Sysman handle of the device"; the docs are silent on another object's handle (a memory module's,
    a sensor's): refused, as each component call refuses another component's handle."""
    rt, obj, rc = _sysman(handle)
    if rc:
        return None, None, rc
    if obj.kind not in kinds:
        return None, None, rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    return rt, obj, 0


def _query(handle, kinds, out, stype_name=None):
    """(runtime, Sysman object, 0) or (None, None, code): _component, then a NULL ``out``
    (ZE_RESULT_ERROR_INVALID_NULL_POINTER) and, given ``stype_name``, the output structure's stype
    and extension chain (common._struct_code)."""
    rt, obj, rc = _component(handle, kinds)
    if rc:
        return None, None, rc
    if not out:
        return None, None, rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    rc = _struct_code(rt.C, out, stype_name) if stype_name else 0
    if rc:
        return None, None, rc
    return rt, obj, 0


def zesDeviceGetProperties(hDevice, props):
    # (r79b) @returns: ZE_RESULT_ERROR_INVALID_NULL_POINTER for "`nullptr == pProperties`"
    rt, dev, rc = _query(hDevice, _DEVICE, props, "ZES_STRUCTURE_TYPE_DEVICE_PROPERTIES")
    if rc:
        return rc
    C = rt.C
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
    rt, dev, rc = _component(hDevice, _DEVICE)
    if rc:
        return rc
    return _fill(pCount, phMemory, _card_of(dev).modules)


def zesMemoryGetProperties(hMemory, props):
    # (r79b) zes_api.h @returns: INVALID_NULL_POINTER, "`nullptr == pProperties`"
    rt, mod, rc = _query(hMemory, ("memmodule",), props, "ZES_STRUCTURE_TYPE_MEM_PROPERTIES")
    if rc:
        return rc
    C = rt.C
    props.type = C.ZES_MEM_TYPE_HBM if mod.location == C.ZES_MEM_LOC_DEVICE else C.ZES_MEM_TYPE_DDR5
    props.onSubdevice = 1 if mod.tile is not None else 0
    props.subdeviceId = mod.tile or 0
    props.location = mod.location
    props.physicalSize = core.config().memory if mod.location == C.ZES_MEM_LOC_DEVICE else 64 << 30
    props.busWidth = -1
    props.numChannels = -1
    return 0


def zesMemoryGetState(hMemory, st):
    # (r79b) zes_api.h @returns: INVALID_NULL_POINTER, "`nullptr == pState`"
    rt, mod, rc = _query(hMemory, ("memmodule",), st, "ZES_STRUCTURE_TYPE_MEM_STATE")
    if rc:
        return rc
    C = rt.C
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
    rt, dev, rc = _component(hDevice, _DEVICE)
    if rc:
        return rc
    return _fill(pCount, phTemperature, _card_of(dev).sensors)


def zesTemperatureGetProperties(hTemperature, pProperties):
    rt, part, rc = _query(hTemperature, ("tempsensor",), pProperties, "ZES_STRUCTURE_TYPE_TEMP_PROPERTIES")
    if rc:
        return rc
    C = rt.C
    pProperties.type = C.ZES_TEMP_SENSORS_GPU
    pProperties.onSubdevice = 0
    pProperties.subdeviceId = 0
    pProperties.maxTemperature = 105.0
    pProperties.isCriticalTempSupported = 0
    pProperties.isThreshold1Supported = 0
    pProperties.isThreshold2Supported = 0
    return 0


def zesTemperatureGetState(hTemperature, pTemperature):
    rt, part, rc = _query(hTemperature, ("tempsensor",), pTemperature)
    if rc:
        return rc
    pTemperature[0] = _TEMP_BUSY if card_busy(part.card) else _TEMP_IDLE
    return 0


def zesDeviceEnumFrequencyDomains(hDevice, pCount, phFrequency):
    rt, dev, rc = _component(hDevice, _DEVICE)
    if rc:
        return rc
    return _fill(pCount, phFrequency, _card_of(dev).freqs)


def zesFrequencyGetProperties(hFrequency, pProperties):
    rt, part, rc = _query(hFrequency, ("freqdomain",), pProperties, "ZES_STRUCTURE_TYPE_FREQ_PROPERTIES")
    if rc:
        return rc
    C = rt.C
    pProperties.type = C.ZES_FREQ_DOMAIN_GPU
    pProperties.onSubdevice = 0
    pProperties.subdeviceId = 0
    pProperties.canControl = 0
    pProperties.isThrottleEventSupported = 0
    pProperties.min = _FREQ_MIN
    pProperties.max = _FREQ_MAX
    return 0


def zesFrequencyGetState(hFrequency, pState):
    rt, part, rc = _query(hFrequency, ("freqdomain",), pState, "ZES_STRUCTURE_TYPE_FREQ_STATE")
    if rc:
        return rc
    actual = _FREQ_MAX if card_busy(part.card) else _FREQ_MIN
    pState.currentVoltage = -1.0      # zes_api.h: negative = not known
    pState.request = actual
    pState.tdp = _FREQ_MAX
    pState.efficient = _FREQ_MIN
    pState.actual = actual
    pState.throttleReasons = 0
    return 0


def zesDeviceProcessesGetState(hDevice, pCount, pProcesses):
    rt, dev, rc = _query(hDevice, _DEVICE, pCount)
    if rc:
        return rc
    C = rt.C
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
        rc = _struct_code(C, st, "ZES_STRUCTURE_TYPE_PROCESS_STATE")
        if rc:
            return rc
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


def zesDeviceEnumEngineGroups(hDevice, pCount, phEngine):
    rt, dev, rc = _component(hDevice, _DEVICE)
    if rc:
        return rc
    return _fill(pCount, phEngine, _card_of(dev).engines)


def zesEngineGetProperties(hEngine, pProperties):
    rt, eng, rc = _query(hEngine, ("engine",), pProperties, "ZES_STRUCTURE_TYPE_ENGINE_PROPERTIES")
    if rc:
        return rc
    C = rt.C
    pProperties.type = getattr(C, _ENGINE_GROUP[eng.group])
    pProperties.onSubdevice = 0 if eng.tile is None else 1
    pProperties.subdeviceId = eng.tile or 0
    return 0


def zesEngineGetActivity(hEngine, pStats):
    rt, eng, rc = _query(hEngine, ("engine",), pStats)
    if rc:
        return rc
    with rt.lock:
        meters = eng.meters()
        # zes_engine_stats_t: activeTime, "monotonic counter for time in microseconds that this
        # resource is actively running workloads"; the card-wide group of a one-tile card is its tile
        pStats.activeTime = sum(m.active[eng.group] for m in meters) // len(meters)
        pStats.timestamp = _ze_counters.now_us()
    return 0


def zesMemoryGetBandwidth(hMemory, pBandwidth):
    rt, mod, rc = _query(hMemory, ("memmodule",), pBandwidth)
    if rc:
        return rc
    C = rt.C
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
    rt, dev, rc = _component(hDevice, _DEVICE)
    if rc:
        return rc
    return _fill(pCount, phPower, _card_of(dev).powers)


def zesDeviceGetCardPowerDomain(hDevice, phPower):
    rt, dev, rc = _query(hDevice, _DEVICE, phPower)
    if rc:
        return rc
    phPower[0] = _card_of(dev).powers[0].key     # "power domain handle for the entire PCIe card"
    return 0


def zesPowerGetProperties(hPower, pProperties):
    rt, pwr, rc = _query(hPower, ("power",), pProperties, "ZES_STRUCTURE_TYPE_POWER_PROPERTIES")
    if rc:
        return rc
    pProperties.onSubdevice = 0 if pwr.tile is None else 1
    pProperties.subdeviceId = pwr.tile or 0
    pProperties.canControl = 0
    pProperties.isEnergyThresholdSupported = 0
    pProperties.defaultLimit = -1        # zes_api.h: (deprecated) -1 = not known
    pProperties.minLimit = -1
    pProperties.maxLimit = -1
    return 0


def zesPowerGetEnergyCounter(hPower, pEnergy):
    rt, pwr, rc = _query(hPower, ("power",), pEnergy)
    if rc:
        return rc
    with rt.lock:
        now = _ze_counters.now_us()
        # zes_power_energy_counter_t: energy, "the monotonic energy counter in microjoules"
        pEnergy.energy = _ze_counters.energy_uj(pwr.meters(), pwr.card.tiles, pwr.card.t0, now)
        pEnergy.timestamp = now
    return 0
