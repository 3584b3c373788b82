"""A simulated NVML (libnvidia-ml) for the simulated CUDA devices.

NVML lists every *physical* device (CUDA_VISIBLE_DEVICES is the runtime's
business, not NVML's) and never initializes the CUDA runtime.  UUIDs, PCI
bus ids and names are the ones the simulated runtime reports in
cudaDeviceProp, so a backend can map between them.  nvmlInit_v2 /
nvmlShutdown are reference counted, as in NVML; other calls return
NVML_ERROR_UNINITIALIZED while the count is zero, and the handles of an
initialization die with its last nvmlShutdown (r70k).  NULL out-pointers are
NVML_ERROR_INVALID_ARGUMENT, as each function's nvml.h @return list says.
"""

from __future__ import annotations

import itertools
import re
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
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_UNKNOWN = 999

# nvml.h: NVML_INIT_FLAG_NO_GPUS (1 << 0), NVML_INIT_FLAG_NO_ATTACH (1 << 1), NVML_INIT_FLAG_FORCE_INIT (1 << 2)
_INIT_FLAGS = 0x7
# nvml.h: #define NVML_STRUCT_VERSION(data, ver) (sizeof(nvml##data##_v##ver##_t) | (ver << 24U));
# nvmlMemory_v2_t is {unsigned int version; unsigned long long total, reserved, free, used;}: 40 bytes
NVML_MEMORY_V2 = 40 | (2 << 24)

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
# Each complete initialization (the reference count going from 0 to 1) hands out new handle
# values; the count is never reset (not by a reset, nor in a forked child), so a handle from an
# earlier initialization, or the parent's, is never valid again (r70k; nvml.h nvmlShutdown).
_GENERATIONS = itertools.count()


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
    # nvml.h (nvmlDeviceGetName, GetUUID, nvmlSystemGetDriverVersion ...): INVALID_ARGUMENT "if
    # \a name is NULL", INSUFFICIENT_SIZE "if \a length is too small": a NULL buffer is refused
    # first, whatever the length (r70k: a NULL buffer with a short length answered 7)
    if buf is None or (buf.__class__ is not int and buf == ffi.NULL) or buf == 0:
        return NVML_ERROR_INVALID_ARGUMENT
    if length is None or length < len(data):
        return NVML_ERROR_INSUFFICIENT_SIZE
    ffi.memmove(ffi.cast(_CHARP, buf) if buf.__class__ is int else buf, data, len(data))
    return NVML_SUCCESS


def _ready() -> int:
    if _S.refcount <= 0:
        return NVML_ERROR_UNINITIALIZED
    return NVML_SUCCESS


def _out(ptr) -> bool:
    """An out-pointer the caller gave: not None / NULL (nvml.h: INVALID_ARGUMENT "if ... is NULL")."""
    return ptr is not None and ptr != ffi.NULL


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
            base = _HANDLE_BASE + 0x10000 * next(_GENERATIONS)
            keys, handles = [], {}
            for i in range(cfg.devices):
                key = ffi.cast(_VOIDP, base + 0x100 * i)
                keys.append(key)
                handles[key] = i
                handles[base + 0x100 * i] = i
            S.handles, S.keys = handles, keys
    return NVML_SUCCESS


def nvmlInitWithFlags(flags):
    # nvml.h nvmlInitWithFlags: "NVML_INIT_FLAG_* flags that can modify NVML Init behavior";
    # the docs are silent on other bits: refused (r70k).  The three flags only relax init, which
    # never fails here for want of devices, so each is a plain init.
    if flags & ~_INIT_FLAGS:
        return NVML_ERROR_INVALID_ARGUMENT
    return nvmlInit_v2()


def nvmlShutdown():
    S = _S
    with S.lock:
        if S.refcount <= 0:
            return NVML_ERROR_UNINITIALIZED
        S.refcount -= 1
        if S.refcount == 0:
            # nvml.h nvmlShutdown: "shut down and cleanup NVML Library state by releasing all
            # device and library resources previously allocated with nvmlInit_v2()": a handle
            # from before is invalid (INVALID_ARGUMENT "if device is invalid"), also after the next
            # init, which hands out new values (r70k).  New objects: a call racing the shutdown
            # reads the old ones whole.
            S.handles, S.keys = {}, []
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
    if not _out(cudaDriverVersion):       # nvml.h: INVALID_ARGUMENT "if cudaDriverVersion is NULL"
        return NVML_ERROR_INVALID_ARGUMENT
    # The CUDA version the simulated driver supports (Config.driver_version).
    cudaDriverVersion[0] = core.config().driver_version
    return NVML_SUCCESS


def nvmlSystemGetCudaDriverVersion(cudaDriverVersion):
    return nvmlSystemGetCudaDriverVersion_v2(cudaDriverVersion)


def nvmlDeviceGetCount_v2(deviceCount):
    rc = _ready()
    if rc:
        return rc
    if not _out(deviceCount):
        return NVML_ERROR_INVALID_ARGUMENT
    deviceCount[0] = len(_S.keys)
    return NVML_SUCCESS


def nvmlDeviceGetHandleByIndex_v2(index, device):
    rc = _ready()
    if rc:
        return rc
    keys = _S.keys
    if not (0 <= index < len(keys)) or not _out(device):
        return NVML_ERROR_INVALID_ARGUMENT
    # (r71g) NVML enumerates by PCI bus id (nvml.h, nvmlDeviceGetHandleByIndex_v2: "The order in
    # which NVML enumerates devices has no guarantees of consistency between reboots. For that
    # reason it is recommended that devices be looked up by their PCI ids or UUID"; "The NVML
    # index may not correlate with other APIs, such as the CUDA device index"), while the CUDA
    # runtime's default order is CUDA_DEVICE_ORDER=FASTEST_FIRST (CUDA Programming Guide, "CUDA
    # Environment Variables").  ``keys`` is by physical device (the CUDA default order); NVML's
    # index i is the i-th physical device by PCI bus (core.by_pci_bus; the identity unless
    # ACCEL_SIM_PCI_ORDER says otherwise).  Before r71g the two orders were always equal.
    device[0] = keys[core.by_pci_bus(len(keys))[index]]
    return NVML_SUCCESS


def _c_string(arg) -> Optional[bytes]:
    """The bytes of a ``const char *`` argument (Python bytes or a char cdata); None for NULL."""
    if isinstance(arg, bytes):
        return arg.split(b"\0", 1)[0]
    if arg is None or arg == ffi.NULL:
        return None
    return ffi.string(ffi.cast(_CHARP, arg))


# nvmlDeviceGetUUID's form, "GPU-" (or "MIG-" for a MIG device) and 8-4-4-4-12 hexadecimal digits
_UUID_FORM = re.compile(rb"(GPU|MIG)-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def nvmlDeviceGetHandleByUUID(uuid, device):
    rc = _ready()
    if rc:
        return rc
    # nvml.h nvmlDeviceGetHandleByUUID: INVALID_ARGUMENT "if uuid is invalid or device is null",
    # NOT_FOUND "if uuid does not match a valid device on the system".  A text that is not a
    # whole UUID (a CUDA_VISIBLE_DEVICES style prefix, junk) is invalid (r70k: it answered
    # NOT_FOUND, and NULL pointers raised Python errors).  No MIG devices: a MIG- UUID matches none.
    text = _c_string(uuid)
    if text is None or not _out(device) or not _UUID_FORM.fullmatch(text):
        return NVML_ERROR_INVALID_ARGUMENT
    keys = _S.keys
    for i in range(len(keys)):
        if core.uuid_text(i).encode() == text:
            device[0] = keys[i]
            return NVML_SUCCESS
    return NVML_ERROR_NOT_FOUND


# nvml.h nvmlDeviceGetHandleByPciBusId_v2, pciBusId: "Accept the following formats (all numbers
# in hexadecimal): domain:bus:device.function in format %x:%x:%x.%x, domain:bus:device in format
# %x:%x:%x, bus:device.function in format %x:%x.%x".  Only hexadecimal digits are taken (no 0x,
# sign or blanks, which scanf would also read: the docs name the digits only).
_PCI_FORMS = (
    re.compile(rb"(?P<domain>[0-9a-fA-F]+):(?P<bus>[0-9a-fA-F]+):(?P<device>[0-9a-fA-F]+)\.(?P<function>[0-9a-fA-F]+)"),
    re.compile(rb"(?P<domain>[0-9a-fA-F]+):(?P<bus>[0-9a-fA-F]+):(?P<device>[0-9a-fA-F]+)"),
    re.compile(rb"(?P<bus>[0-9a-fA-F]+):(?P<device>[0-9a-fA-F]+)\.(?P<function>[0-9a-fA-F]+)"),
)


def nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device):
    rc = _ready()
    if rc:
        return rc
    text = _c_string(pciBusId)
    if text is None or not _out(device):       # INVALID_ARGUMENT "if ... device is NULL"
        return NVML_ERROR_INVALID_ARGUMENT
    m = next((m for m in (f.fullmatch(text) for f in _PCI_FORMS) if m is not None), None)
    if m is None:                               # INVALID_ARGUMENT "if pciBusId is invalid"
        return NVML_ERROR_INVALID_ARGUMENT
    parts = m.groupdict()
    domain = int(parts.get("domain") or b"0", 16)
    bus, dev = int(parts["bus"], 16), int(parts["device"], 16)
    function = int(parts["function"], 16) if parts.get("function") is not None else 0
    keys = _S.keys
    for i in range(len(keys)):
        # every simulated device is domain 0, bus core.pci_bus(i), device 0, function 0
        if (domain, bus, dev, function) == (0, core.pci_bus(i), 0, 0):
            device[0] = keys[i]
            return NVML_SUCCESS
    return NVML_ERROR_NOT_FOUND                 # "if pciBusId does not match a valid device"


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
    if not _out(index):                   # nvml.h: INVALID_ARGUMENT "if ... index is NULL"
        return NVML_ERROR_INVALID_ARGUMENT
    index[0] = core.by_pci_bus(len(_S.keys)).index(i)      # (r71g) NVML's own index: PCI bus order
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


def nvmlDeviceGetMemoryInfo_v2(device, memory):
    rc, i = _with_device(device)
    if rc:
        return rc
    if not _out(memory):                  # nvml.h: INVALID_ARGUMENT "if ... memory is NULL"
        return NVML_ERROR_INVALID_ARGUMENT
    # nvml.h nvmlMemory_v2_t.version: "Structure format version (must be 2)", meaning the macro
    # nvmlMemory_v2 = NVML_STRUCT_VERSION(Memory, 2) (NVIDIA/nvidia-settings issue 78: a plain 2
    # is refused; drivers of that time answered FUNCTION_NOT_FOUND); nvmlReturn_t:
    # ARGUMENT_VERSION_MISMATCH "The provided version is invalid/unsupported" (r70k)
    if memory.version != NVML_MEMORY_V2:
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    from . import cudart
    total = core.config().memory
    used = cudart.device_used_bytes(i)
    # no memory is reserved before a context (README, "still more lenient"): reserved 0, and the
    # contexts' reservation is in used as in v1, so total = reserved + used + free as in v1
    memory.total = total
    memory.reserved = 0
    memory.used = used
    memory.free = total - used
    return NVML_SUCCESS


def nvmlDeviceGetCudaComputeCapability(device, major, minor):
    rc, i = _with_device(device)
    if rc:
        return rc
    if not _out(major) or not _out(minor):    # nvml.h: INVALID_ARGUMENT "if ... major or minor are NULL"
        return NVML_ERROR_INVALID_ARGUMENT
    cc = core.config().compute_capability
    major[0], minor[0] = cc
    return NVML_SUCCESS


def nvmlDeviceGetMultiGpuBoard(device, multiGpuBool):
    rc, i = _with_device(device)
    if rc:
        return rc
    if not _out(multiGpuBool):            # nvml.h: INVALID_ARGUMENT "if ... multiGpuBool is NULL"
        return NVML_ERROR_INVALID_ARGUMENT
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
    if not _out(count):                   # nvml.h: INVALID_ARGUMENT "if device or count reference is invalid"
        return NVML_ERROR_INVALID_ARGUMENT
    count[0] = 0                          # "Returns zero if MIG is not supported or enabled"
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
