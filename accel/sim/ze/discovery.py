"""Initialization and discovery: zeInit / zesInit, drivers, devices and sub-devices, and their
properties (core, compute, module, memory, queue groups, timestamps, peer access).
"""

from __future__ import annotations

import os
import time

from .. import core
from ...backends._ze_visible import sysman_env_on
from .objects import _Device, _Runtime, _runtime
from .common import _fill, _ready, _ready_get, _struct_arg_code, _struct_code, _visible


# -- initialization and discovery --------------------------------------------------------

# _NULL_OUT (r70h): ze_api.h, each query's @returns: ZE_RESULT_ERROR_INVALID_NULL_POINTER for
# "nullptr == version", "nullptr == pDriverProperties", "nullptr == pDeviceProperties", "nullptr ==
# pComputeProperties", "nullptr == pModuleProperties", "nullptr == pCount", "nullptr ==
# hostTimestamp" ... (the loader's parameter validation layer checks the same): the simulator
# dereferenced the NULL and raised a Python error out of the library (memory.py, _null_pointers).

def zeInit(flags):
    rt = _runtime()
    if flags & ~3:
        return rt.C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    if not rt.cfg.driver or not rt.cards or (flags & 3) == 2:   # VPU only: no GPU driver answers
        return rt.C.ZE_RESULT_ERROR_UNINITIALIZED
    with rt.lock:
        if not rt.initialized:
            # Legacy Sysman (core device handles double as Sysman handles) needs ZES_ENABLE_SYSMAN=1
            # at zeInit and no zesInit before it: Intel compute-runtime, "Level Zero Sysman
            # Initialization", table row "zesInit + (Legacy mode)": "Not supported" ("Only one
            # initialization of sysman is supported for a process"); level-zero-tests SysmanInitTests
            # GivenSysmanInitializedFromZesInitAndCoreInitializedWithSysmanFlag...: after zesInit then
            # zeInit with ZES_ENABLE_SYSMAN=1, every zes call on a core handle returns
            # ZE_RESULT_ERROR_UNINITIALIZED (r69g).  Any value atoll reads as non-zero turns it on
            # (compute-runtime's getSetting over atoll, debug_env_reader.cpp: sysman_env_on).
            rt.sysman_on_core = (rt.zcfg.sysman_env and sysman_env_on(os.environ.get("ZES_ENABLE_SYSMAN"))
                                 and not rt.sysman_initialized)
            for ordinal, (card, tiles, is_sub) in enumerate(_visible(rt)):
                dev = rt._add(_Device(ordinal, card, tiles, is_sub))
                if not is_sub and len(tiles) > 1:
                    for t in tiles:
                        dev.subdevices.append(rt._add(_Device(ordinal, card, [t], True)))
                rt.devices.append(dev)
            rt.initialized = True
    return 0


def zesInit(flags):
    rt = _runtime()
    if flags != 0:
        return rt.C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    if not rt.cfg.driver or not rt.cards:
        return rt.C.ZE_RESULT_ERROR_UNINITIALIZED
    if rt.zcfg.api_version < (1, 5):
        # zesInit is Level Zero API 1.5. Loader source/loader/zes_ldrddi.cpp, zesInit: a driver whose
        # Sysman table has no pfnInit is skipped, and with no valid driver the result is
        # ZE_RESULT_ERROR_UNINITIALIZED, whatever the loader's own version.
        return rt.C.ZE_RESULT_ERROR_UNINITIALIZED
    rt.sysman_initialized = True
    return 0


def zesDriverGet(pCount, phDrivers):
    rt = _runtime()
    if not rt.sysman_initialized:
        return rt.C.ZE_RESULT_ERROR_UNINITIALIZED
    return _fill(pCount, phDrivers, [rt.zes_driver])


def zesDeviceGet(hDriver, pCount, phDevices):
    rt = _runtime()
    if not rt.sysman_initialized:
        return rt.C.ZE_RESULT_ERROR_UNINITIALIZED
    if rt.get(hDriver, "zesdriver") is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    return _fill(pCount, phDevices, rt.cards)


def zeDriverGet(pCount, phDrivers):
    rt, rc = _ready()
    if rc:
        return rc
    return _fill(pCount, phDrivers, [rt.driver])


def zeDriverGetApiVersion(hDriver, version):
    rt, _driver, rc = _ready_get(_ready, hDriver, "driver")
    if rc:
        return rc
    if not version:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER    # _NULL_OUT
    major, minor = rt.zcfg.api_version
    version[0] = (major << 16) | minor
    return 0


def zeDriverGetProperties(hDriver, props):
    rt, _driver, rc = _ready_get(_ready, hDriver, "driver")
    if rc:
        return rc
    rc = _struct_arg_code(rt.C, props, "ZE_STRUCTURE_TYPE_DRIVER_PROPERTIES")    # _NULL_OUT; (r72a)
    if rc:
        return rc
    props.uuid.id = list(b"accel-sim-ze-drv")
    props.driverVersion = 0x01030000 | 29735
    return 0


def zeDeviceGet(hDriver, pCount, phDevices):
    rt, _driver, rc = _ready_get(_ready, hDriver, "driver")
    if rc:
        return rc
    return _fill(pCount, phDevices, rt.devices)


def zeDeviceGetSubDevices(hDevice, pCount, phSubdevices):
    rt, dev, rc = _ready_get(_ready, hDevice, "device")
    if rc:
        return rc
    return _fill(pCount, phSubdevices, dev.subdevices)


def _write_core_properties(rt: _Runtime, props, dev_uuid: bytes, is_sub: bool, tile: int, tiles: int) -> int:
    C = rt.C
    if not props:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER       # _NULL_OUT
    if props.stype not in (C.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES, C.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES_1_2):
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    z = rt.zcfg
    props.type = C.ZE_DEVICE_TYPE_GPU
    props.vendorId = 0x8086
    props.deviceId = 0x0BD5
    props.flags = C.ZE_DEVICE_PROPERTY_FLAG_SUBDEVICE if is_sub else 0
    props.subdeviceId = tile if is_sub else 0
    props.coreClockRate = 1600
    props.maxMemAllocSize = core.config().memory * tiles
    props.maxHardwareContexts = 65536
    props.maxCommandQueuePriority = 0
    props.numThreadsPerEU = 8
    props.physicalEUSimdWidth = 16
    props.numEUsPerSubslice = 8
    props.numSubslicesPerSlice = 8 * tiles
    props.numSlices = 1
    if props.stype == C.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES_1_2:
        props.timerResolution = z.timer_hz                      # ticks per second
    else:
        props.timerResolution = round(1_000_000_000 / z.timer_hz)  # whole nanoseconds per tick
    props.timestampValidBits = z.timestamp_bits
    props.kernelTimestampValidBits = z.timestamp_bits
    props.uuid.id = list(dev_uuid)
    name = core.config().name.encode()[:255]
    props.name = name
    return 0


def zeDeviceGetProperties(hDevice, props):
    rt, dev, rc = _ready_get(_ready, hDevice, "device")
    if rc:
        return rc
    C = rt.C
    if props:
        if props.stype == C.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES_1_2 and rt.zcfg.api_version < (1, 2):
            # (r72a) ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES_1_2 came with API 1.2, with its timerResolution
            # in cycles/sec (ze_api.h, ze_device_properties_t.timerResolution: "When
            # stype==ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES the units are in nanoseconds. When
            # stype==ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES_1_2 units are in cycles/sec"; the Level Zero
            # tutorial and Intel's PTI pick it only when zeDriverGetApiVersion >= ZE_API_VERSION_1_2:
            # "Before to v1.2" the ns field).  A driver of an older API knows no such structure type: it
            # would fill the 1.0 structure, nanoseconds per tick included, and a caller reading cycles/sec
            # would be off by orders of magnitude.  The simulator answered in cycles/sec whatever the API;
            # now the stype is refused as IN_ORDER flags are before 1.7 (commands.py): INVALID_ENUMERATION.
            return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
        if props.stype in (C.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES, C.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES_1_2) \
                and props.pNext:
            return C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE     # (r72a) common._struct_code
    return _write_core_properties(rt, props, dev.uuid, dev.is_sub, dev.tiles[0], len(dev.tiles))


def zeDeviceCanAccessPeer(hDevice, hPeerDevice, value):
    """ze_api.h, zeDeviceCanAccessPeer: "If both device and peer device are the same then return
    true", likewise a sub-device and itself, two sub-devices of one parent, and a sub-device and
    its parent; "If both device and remote device are connected by a direct or indirect scale-up
    fabric or over PCIe (same root complex or shared PCIe switch) then true".  (r71g) Devices of two
    cards answer what ACCEL_SIM_PEER says of the two cards (core.peer_capable; default: every pair,
    the cards sharing one root complex, as before r71g); "none" plays cards under different root
    complexes with no fabric, which answer false."""
    rt, rc = _ready()
    if rc:
        return rc
    dev, peer = rt.get(hDevice, "device"), rt.get(hPeerDevice, "device")
    if dev is None or peer is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if not value:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    value[0] = 1 if dev.card is peer.card or core.peer_capable(dev.card.index, peer.card.index) else 0
    return 0


def zeDeviceGetComputeProperties(hDevice, props):
    rt, _device, rc = _ready_get(_ready, hDevice, "device")
    if rc:
        return rc
    rc = _struct_arg_code(rt.C, props, "ZE_STRUCTURE_TYPE_DEVICE_COMPUTE_PROPERTIES")    # _NULL_OUT; (r72a)
    if rc:
        return rc
    props.maxTotalGroupSize = 1024
    props.maxGroupSizeX = props.maxGroupSizeY = props.maxGroupSizeZ = 1024
    props.maxGroupCountX = props.maxGroupCountY = props.maxGroupCountZ = 0xFFFFFFFF
    props.maxSharedLocalMemory = 128 * 1024
    props.numSubGroupSizes = 2
    props.subGroupSizes[0], props.subGroupSizes[1] = 16, 32
    return 0


def zeDeviceGetModuleProperties(hDevice, props):
    rt, _device, rc = _ready_get(_ready, hDevice, "device")
    if rc:
        return rc
    rc = _struct_arg_code(rt.C, props, "ZE_STRUCTURE_TYPE_DEVICE_MODULE_PROPERTIES")    # _NULL_OUT; (r72a)
    if rc:
        return rc
    props.spirvVersionSupported = (1 << 16) | 2
    props.flags = rt.C.ZE_DEVICE_MODULE_FLAG_FP16 | (rt.C.ZE_DEVICE_MODULE_FLAG_FP64 if rt.zcfg.fp64 else 0)
    return 0


def zeDeviceGetMemoryProperties(hDevice, pCount, props):
    rt, dev, rc = _ready_get(_ready, hDevice, "device")
    if rc:
        return rc
    if not pCount:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER    # _NULL_OUT
    if pCount[0] == 0 or not props:
        pCount[0] = 1
        return 0
    rc = _struct_code(rt.C, props[0], "ZE_STRUCTURE_TYPE_DEVICE_MEMORY_PROPERTIES")     # (r72a)
    if rc:
        return rc
    props[0].flags = 0
    props[0].maxClockRate = 3200
    props[0].maxBusWidth = 8192
    props[0].totalSize = dev.memory
    props[0].name = b"HBM"
    pCount[0] = 1
    return 0


# Ordinal 0 copies only and ordinal 1 computes, so a backend that assumes
# "ordinal 0 is compute" is caught (real PVC lists compute first).
_GROUPS = (("copy", 2), ("compute", 1))


def _fill_pattern_max(ordinal: int) -> int:
    """maxMemoryFillPatternSize of queue group ``ordinal``: 16 bytes on compute, 4 on copy engines."""
    return 16 if ordinal < len(_GROUPS) and _GROUPS[ordinal][0] == "compute" else 4


def zeDeviceGetCommandQueueGroupProperties(hDevice, pCount, props):
    rt, _device, rc = _ready_get(_ready, hDevice, "device")
    if rc:
        return rc
    C = rt.C
    if not pCount:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER       # _NULL_OUT
    if pCount[0] == 0 or not props:
        pCount[0] = len(_GROUPS)
        return 0
    k = min(pCount[0], len(_GROUPS))
    for i in range(k):
        kind, nq = _GROUPS[i]
        rc = _struct_code(C, props[i], "ZE_STRUCTURE_TYPE_COMMAND_QUEUE_GROUP_PROPERTIES")    # (r72a)
        if rc:
            return rc
        flags = C.ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COPY
        if kind == "compute":
            flags |= C.ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COMPUTE | C.ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_METRICS
        props[i].flags = flags
        props[i].maxMemoryFillPatternSize = _fill_pattern_max(i)
        props[i].numQueues = nq
    pCount[0] = k
    return 0


def zeDeviceGetGlobalTimestamps(hDevice, hostTimestamp, deviceTimestamp):
    rt, _device, rc = _ready_get(_ready, hDevice, "device")
    if rc:
        return rc
    if not hostTimestamp or not deviceTimestamp:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER    # _NULL_OUT
    hostTimestamp[0] = time.monotonic_ns()
    deviceTimestamp[0] = rt.ticks()
    return 0
