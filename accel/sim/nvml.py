"""A simulated NVML (libnvidia-ml) for the simulated CUDA devices.

NVML lists every *physical* device (CUDA_VISIBLE_DEVICES is the runtime's
business, not NVML's) and never initializes the CUDA runtime.  UUIDs, PCI
bus ids and names are the ones the simulated runtime reports in
cudaDeviceProp, so a backend can map between them.  nvmlInit_v2 /
nvmlShutdown are reference counted, as in NVML; other calls return
NVML_ERROR_UNINITIALIZED while the count is zero.
"""

from __future__ import annotations

import threading
from typing import Dict, Optional

from . import core
from .core import ffi

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_UNKNOWN = 999

DRIVER_VERSION = "580.65.06"
# The first driver branch of each simulated driver CUDA version (CUDA Toolkit release notes,
# "CUDA Driver" table: 12.2 -> 535, 12.4 -> 550, 12.8 -> 570, 13.0 -> 580), so the driver string
# agrees with nvmlSystemGetCudaDriverVersion_v2.
_DRIVER_BY_CUDA = {12020: "535.54.03", 12040: "550.54.14", 12080: "570.86.10", 13000: DRIVER_VERSION}


def _driver_string() -> str:
    cuda = core.config().driver_version
    known = [v for v in sorted(_DRIVER_BY_CUDA) if v <= cuda]
    return _DRIVER_BY_CUDA[known[-1]] if known else _DRIVER_BY_CUDA[min(_DRIVER_BY_CUDA)]

# nvmlErrorString texts (NVML's short messages).
_ERROR_STRINGS = {
    0: "Success", 1: "Uninitialized", 2: "Invalid Argument", 3: "Not Supported",
    4: "Insufficient Permissions", 5: "Already Initialized", 6: "Not Found", 7: "Insufficient Size",
    8: "Insufficient External Power", 9: "Driver Not Loaded", 10: "Timeout",
    11: "Interrupt request issue", 12: "NVML Shared Library Not Found", 13: "Function Not Found",
    14: "Corrupted infoROM", 15: "GPU is lost", 16: "GPU requires restart",
    17: "The operating system has blocked the request.",
    18: "RM has detected an NVML/RM version mismatch.", 19: "In use by another client",
    20: "Insufficient Memory", 21: "No data", 22: "The requested vgpu operation is not available on target device, becasue ECC is enabled",
    23: "Ran out of critical resources, other than memory", 24: "Ran out of critical resources, other than memory",
    25: "Argument version mismatch", 26: "The requested functionality has been deprecated",
    27: "System is not ready for the request", 28: "No GPUs were found",
    29: "Resource not in correct state to perform requested operation",
    30: "Reset not supported for given device/parameters", 999: "Unknown Error",
}

_VOIDP = ffi.typeof("void *")
_CHARP = ffi.typeof("char *")
_HANDLE_BASE = 0x4E564D4C000   # "NVML"


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.refcount = 0
        self.init_calls = 0
        self.handles: Dict[object, int] = {}   # handle int / cdata -> physical index
        self.keys = []                          # physical index -> void* cdata handle


_S = _State()


def _reset() -> None:
    global _S
    _S = _State()


core.on_reset("nvml", _reset)


def _device(handle) -> Optional[int]:
    try:
        return _S.handles.get(handle)
    except TypeError:
        return None


def _write_string(buf, length, text: str) -> int:
    data = text.encode() + b"\0"
    if buf is None or length is None or length < len(data):
        return NVML_ERROR_INSUFFICIENT_SIZE if buf is not None else NVML_ERROR_INVALID_ARGUMENT
    if buf.__class__ is not int and buf == ffi.NULL:
        return NVML_ERROR_INVALID_ARGUMENT
    ffi.memmove(ffi.cast(_CHARP, buf) if buf.__class__ is int else buf, data, len(data))
    return NVML_SUCCESS


def _ready() -> int:
    if _S.refcount <= 0:
        return NVML_ERROR_UNINITIALIZED
    return NVML_SUCCESS


# -- functions -----------------------------------------------------------------

def nvmlInit_v2():
    cfg = core.config()
    if not cfg.driver:
        return NVML_ERROR_DRIVER_NOT_LOADED
    S = _S
    with S.lock:
        S.init_calls += 1
        S.refcount += 1
        if not S.keys:
            for i in range(cfg.devices):
                key = ffi.cast(_VOIDP, _HANDLE_BASE + 0x100 * i)
                S.keys.append(key)
                S.handles[key] = i
                S.handles[_HANDLE_BASE + 0x100 * i] = i
    return NVML_SUCCESS


def nvmlInitWithFlags(flags):
    return nvmlInit_v2()


def nvmlShutdown():
    S = _S
    with S.lock:
        if S.refcount <= 0:
            return NVML_ERROR_UNINITIALIZED
        S.refcount -= 1
    return NVML_SUCCESS


def nvmlErrorString(result):
    return _text(result)


_texts: Dict[int, object] = {}


def _text(code: int):
    c = _texts.get(code)
    if c is None:
        c = _texts.setdefault(code, ffi.new("char[]", _ERROR_STRINGS.get(code, "Unknown Error").encode()))
    return c


def nvmlSystemGetDriverVersion(version, length):
    rc = _ready()
    return rc or _write_string(version, length, _driver_string())


def nvmlSystemGetNVMLVersion(version, length):
    # Works without nvmlInit, as in NVML.
    return _write_string(version, length, f"{core.config().driver_version // 1000}.{_driver_string()}")


def nvmlSystemGetCudaDriverVersion_v2(cudaDriverVersion):
    rc = _ready()
    if rc:
        return rc
    # The CUDA version the simulated driver supports (Config.driver_version).
    cudaDriverVersion[0] = core.config().driver_version
    return NVML_SUCCESS


def nvmlSystemGetCudaDriverVersion(cudaDriverVersion):
    return nvmlSystemGetCudaDriverVersion_v2(cudaDriverVersion)


def nvmlDeviceGetCount_v2(deviceCount):
    rc = _ready()
    if rc:
        return rc
    if deviceCount is None or deviceCount == ffi.NULL:
        return NVML_ERROR_INVALID_ARGUMENT
    deviceCount[0] = len(_S.keys)
    return NVML_SUCCESS


def nvmlDeviceGetHandleByIndex_v2(index, device):
    rc = _ready()
    if rc:
        return rc
    if not (0 <= index < len(_S.keys)) or device is None or device == ffi.NULL:
        return NVML_ERROR_INVALID_ARGUMENT
    device[0] = _S.keys[index]
    return NVML_SUCCESS


def nvmlDeviceGetHandleByUUID(uuid, device):
    rc = _ready()
    if rc:
        return rc
    text = uuid if isinstance(uuid, bytes) else ffi.string(ffi.cast(_CHARP, uuid))
    for i in range(len(_S.keys)):
        if core.uuid_text(i).encode() == text:
            device[0] = _S.keys[i]
            return NVML_SUCCESS
    return NVML_ERROR_NOT_FOUND


def _with_device(device):
    rc = _ready()
    if rc:
        return rc, None
    i = _device(device)
    if i is None:
        return NVML_ERROR_INVALID_ARGUMENT, None
    return NVML_SUCCESS, i


def nvmlDeviceGetIndex(device, index):
    rc, i = _with_device(device)
    if rc:
        return rc
    index[0] = i
    return NVML_SUCCESS


def nvmlDeviceGetName(device, name, length):
    rc, i = _with_device(device)
    return rc or _write_string(name, length, core.config().name)


def nvmlDeviceGetUUID(device, uuid, length):
    rc, i = _with_device(device)
    return rc or _write_string(uuid, length, core.uuid_text(i))


def nvmlDeviceGetPciInfo_v3(device, pci):
    rc, i = _with_device(device)
    if rc:
        return rc
    if pci is None or pci == ffi.NULL:
        return NVML_ERROR_INVALID_ARGUMENT
    buf = ffi.buffer(pci)
    buf[:] = bytes(len(buf))
    bus = core.pci_bus(i)
    pci.busIdLegacy = b"0000:%02X:00.0" % bus
    pci.busId = b"00000000:%02X:00.0" % bus
    pci.domain = 0
    pci.bus = bus
    pci.device = 0
    pci.pciDeviceId = 0x233010DE
    pci.pciSubSystemId = 0x16C110DE
    return NVML_SUCCESS


def nvmlDeviceGetMemoryInfo(device, memory):
    rc, i = _with_device(device)
    if rc:
        return rc
    if memory is None or memory == ffi.NULL:
        return NVML_ERROR_INVALID_ARGUMENT
    from . import cudart
    total = core.config().memory
    used = cudart.device_used_bytes(i)
    memory.total = total
    memory.used = used
    memory.free = total - used
    return NVML_SUCCESS


def nvmlDeviceGetCudaComputeCapability(device, major, minor):
    rc, i = _with_device(device)
    if rc:
        return rc
    cc = core.config().compute_capability
    major[0], minor[0] = cc
    return NVML_SUCCESS


def nvmlDeviceGetMultiGpuBoard(device, multiGpuBool):
    rc, i = _with_device(device)
    if rc:
        return rc
    multiGpuBool[0] = 0
    return NVML_SUCCESS


def nvmlDeviceGetMigMode(device, currentMode, pendingMode):
    rc, i = _with_device(device)
    if rc:
        return rc
    return NVML_ERROR_NOT_SUPPORTED     # as on GPUs without MIG


def nvmlDeviceGetMaxMigDeviceCount(device, count):
    rc, i = _with_device(device)
    if rc:
        return rc
    count[0] = 0
    return NVML_SUCCESS


def nvmlDeviceGetMigDeviceHandleByIndex(device, index, migDevice):
    rc, i = _with_device(device)
    if rc:
        return rc
    return NVML_ERROR_NOT_SUPPORTED


# -- readings (simulated values) ----------------------------------------------------------------------
# NVML averages utilization, temperature, power and clocks over a sample period of 1/6 s to 1 s
# (nvml.h, nvmlUtilization_t and nvmlDeviceGetPowerUsage).  The simulator has no sampler and no
# sensors: a physical device is *busy* while a stream of the simulated runtime on it has work
# queued or running at the moment of the query, and each reading is a fixed value of that state,
# the same on every device:
#
#   reading (call)                                       idle      busy
#   utilization gpu / memory, % (GetUtilizationRates)    0         100
#   temperature, C (GetTemperature, NVML_TEMPERATURE_GPU) 35       65
#   power, mW (GetPowerUsage)                            70000     350000
#   clock, MHz (GetClockInfo) SM and GRAPHICS            345       1980 (cudaDevAttrClockRate / 1000)
#                             MEM                        2619      2619
#                             VIDEO                      1155      1755
#
# Processes (GetComputeRunningProcesses_v3): the simulated runtime creates a context on every
# visible device at init, so once it is started this process is listed on each physical device
# behind a visible one, using what nvmlDeviceGetMemoryInfo calls used for that device.

IDLE = {"gpu": 0, "memory": 0, "temperature": 35, "power": 70_000,
        "clock": {0: 345, 1: 345, 2: 2619, 3: 1155}}
BUSY = {"gpu": 100, "memory": 100, "temperature": 65, "power": 350_000,
        "clock": {0: 1980, 1: 1980, 2: 2619, 3: 1755}}


def busy(physical: int) -> bool:
    """True while a stream of the simulated runtime on physical device ``physical`` has work
    queued or running."""
    from . import cudart
    R = cudart._R
    if R is None:
        return False
    for d in list(R.devices):
        if d.physical != physical:
            continue
        for _ in range(8):      # another thread may add or retire a stream meanwhile
            try:
                queues = list(d.queues)
                break
            except RuntimeError:
                continue
        else:
            queues = []
        if any(not q.idle() for q in queues):
            return True
    return False


def _reading(i: int) -> dict:
    return BUSY if busy(i) else IDLE


def _out(ptr) -> bool:
    return ptr is not None and ptr != ffi.NULL


def nvmlDeviceGetUtilizationRates(device, utilization):
    rc, i = _with_device(device)
    if rc:
        return rc
    if not _out(utilization):
        return NVML_ERROR_INVALID_ARGUMENT
    r = _reading(i)
    utilization.gpu = r["gpu"]
    utilization.memory = r["memory"]
    return NVML_SUCCESS


def nvmlDeviceGetTemperature(device, sensorType, temp):
    rc, i = _with_device(device)
    if rc:
        return rc
    # nvml.h, nvmlTemperatureSensors_t: NVML_TEMPERATURE_GPU (0) is the only sensor; anything
    # else is NVML_ERROR_INVALID_ARGUMENT ("sensorType is invalid").
    if sensorType != 0 or not _out(temp):
        return NVML_ERROR_INVALID_ARGUMENT
    temp[0] = _reading(i)["temperature"]
    return NVML_SUCCESS


def nvmlDeviceGetPowerUsage(device, power):
    rc, i = _with_device(device)
    if rc:
        return rc
    if not _out(power):
        return NVML_ERROR_INVALID_ARGUMENT
    power[0] = _reading(i)["power"]
    return NVML_SUCCESS


def nvmlDeviceGetClockInfo(device, type, clock):
    rc, i = _with_device(device)
    if rc:
        return rc
    # nvml.h, nvmlClockType_t: GRAPHICS 0, SM 1, MEM 2, VIDEO 3; another value is invalid.
    clocks = _reading(i)["clock"]
    if type not in clocks or not _out(clock):
        return NVML_ERROR_INVALID_ARGUMENT
    clock[0] = clocks[type]
    return NVML_SUCCESS


def _processes(i: int):
    from . import cudart
    R = cudart._R
    if R is None or R.init_error or not any(d.physical == i for d in R.devices):
        return []
    import os
    return [(os.getpid(), cudart.device_used_bytes(i))]


def nvmlDeviceGetComputeRunningProcesses_v3(device, infoCount, infos):
    rc, i = _with_device(device)
    if rc:
        return rc
    # nvml.h: infoCount in = the size of infos, out = the number of processes; *infoCount 0 asks
    # for the count (only then may infos be NULL): NVML_ERROR_INSUFFICIENT_SIZE when the buffer is
    # too small, with the count written, NVML_SUCCESS when none run.
    if not _out(infoCount) or (infoCount[0] and not _out(infos)):
        return NVML_ERROR_INVALID_ARGUMENT
    procs = _processes(i)
    room = infoCount[0]
    infoCount[0] = len(procs)
    if room < len(procs):
        return NVML_ERROR_INSUFFICIENT_SIZE
    for k, (pid, used) in enumerate(procs):
        infos[k].pid = pid
        infos[k].usedGpuMemory = used
        infos[k].gpuInstanceId = 0xFFFFFFFF       # no MIG
        infos[k].computeInstanceId = 0xFFFFFFFF
    return NVML_SUCCESS


_FUNCTIONS = {name: obj for name, obj in list(globals().items()) if name.startswith("nvml") and callable(obj)}

_lib: Optional[core.SimLibrary] = None


def open_library() -> core.SimLibrary:
    """The simulated NVML; OSError like a missing libnvidia-ml when configured absent."""
    global _lib
    if not core.config().nvml:
        raise core.library_not_found("nvml", "libnvidia-ml.so.1")
    lib = _lib
    if lib is None:
        lib = _lib = core.build_library("nvml", _FUNCTIONS, constants=core.constants_of("_nvml"))
    return lib


def _state() -> dict:
    return {"nvml_initialized": _S.refcount > 0, "nvml_init_calls": _S.init_calls}


core.on_state("nvml", _state)
