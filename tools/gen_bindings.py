#!/usr/bin/env python3
"""Generate accel/_ffi/*.py: cffi out-of-line ABI modules from the vendor headers.

Usage::

    python tools/gen_bindings.py            # (re)write accel/_ffi/_cudart.py, _cudart12.py, _cudadrv.py,
                                            # _nvml.py, _ze.py, _objc.py, _metal.py, _nvrtc.py
    python tools/gen_bindings.py --check    # regenerate in memory; exit 1 and summarize if accel/_ffi differs
    python tools/gen_bindings.py --only cudart,cudart12

CUDA: one module per runtime major (accel._ffi.cudart_module), each from that major's
headers: ``_cudart`` from CUDA 13 (/usr/local/cuda or the nvidia-cuda-runtime wheel),
``_cudart12`` from the nvidia-cuda-runtime-cu12==12.4.127 wheel (nvidia/cuda_runtime/include).
An include root of another major is skipped (Library.cuda_major), and each module is
symbol-checked against the real libcudart of its major when one is installed: a
declared non-optional function it does not export fails the run (and --check).

How it works: each header is run through the C preprocessor (``gcc -E``/``cc -E``/``cpp``)
with ``-nostdinc`` and the tiny libc stubs below (so no glibc extensions reach the
parser), ``__attribute__`` and friends defined away; pycparser parses the result;
the tool keeps only the functions listed in :data:`LIBRARIES` plus every type they
need, transitively (typedefs, struct/union definitions, enums with their values
folded to integer literals, array sizes folded too), plus the integer ``#define``
constants listed per library.  The result goes through ``cffi.FFI.cdef`` and
``emit_python_code`` so the generated module holds pre-parsed declarations: importing
it needs neither pycparser nor a compiler, and opening the library happens in
``accel/_ffi/__init__.py`` on first use.

Output is deterministic: header order is kept (it is the C declaration order), the
extra constants are sorted, header paths are recorded relative to their include root.

To bind another function, append its exact vendor name to the ``functions`` list of
its library below (and to ``optional`` if old libraries may lack it), then rerun.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(REPO, "accel", "_ffi")

# ---------------------------------------------------------------------------
# What to bind.  Append names here; keep them exact vendor names.
# ---------------------------------------------------------------------------

CUDART_FUNCTIONS = [
    "cudaGetErrorName", "cudaGetErrorString", "cudaGetLastError", "cudaPeekAtLastError",
    "cudaRuntimeGetVersion", "cudaDriverGetVersion",
    "cudaGetDeviceCount", "cudaSetDevice", "cudaGetDevice", "cudaInitDevice",
    "cudaFree", "cudaMalloc", "cudaGetDeviceProperties", "cudaDeviceGetAttribute",
    "cudaDeviceGetPCIBusId", "cudaDeviceSynchronize", "cudaDeviceReset", "cudaMemGetInfo",
    "cudaHostAlloc", "cudaFreeHost",
    "cudaStreamCreateWithPriority", "cudaStreamCreateWithFlags", "cudaStreamDestroy",
    "cudaStreamSynchronize", "cudaStreamQuery", "cudaStreamWaitEvent",
    "cudaDeviceGetStreamPriorityRange",
    "cudaEventCreateWithFlags", "cudaEventDestroy", "cudaEventRecord", "cudaEventSynchronize",
    "cudaEventQuery", "cudaEventElapsedTime",
    # issue 16: external events (event record/wait nodes in a capture); every CUDA >= 11.1 has it
    "cudaEventRecordWithFlags",
    "cudaMemcpyAsync", "cudaMemcpy", "cudaMemsetAsync",
    "cudaStreamBeginCapture", "cudaStreamEndCapture", "cudaStreamIsCapturing",
    "cudaStreamGetCaptureInfo", "cudaThreadExchangeStreamCaptureMode",
    "cudaGraphInstantiate", "cudaGraphLaunch", "cudaGraphExecDestroy", "cudaGraphDestroy",
    "cudaGraphDebugDotPrint", "cudaGraphGetNodes",
    "cudaLibraryLoadData", "cudaLibraryUnload", "cudaLibraryGetKernel", "cudaLaunchKernel",
    "cudaPointerGetAttributes", "cudaMemcpyPeerAsync", "cudaDeviceCanAccessPeer",
    # issue 14: bound for what comes next, not used yet (peer access, function attributes,
    # stream-ordered allocation: torch's backend:cudaMallocAsync); every CUDA 12 and 13 has them
    "cudaDeviceEnablePeerAccess", "cudaDeviceDisablePeerAccess",
    "cudaFuncSetAttribute", "cudaFuncGetAttributes",
    "cudaMallocAsync", "cudaFreeAsync", "cudaDeviceGetDefaultMemPool",
    "cudaMemPoolSetAttribute", "cudaMemPoolGetAttribute", "cudaMemPoolTrimTo",
    # issue 15 item 5: backend:cudaMallocAsync under capture (graph memory nodes) and a peer's
    # access to the pool (torch's enablePeerAccess); every CUDA >= 11.4 has them
    "cudaMemPoolSetAccess", "cudaMemPoolGetAccess",
    "cudaDeviceGraphMemTrim", "cudaDeviceGetGraphMemAttribute", "cudaDeviceSetGraphMemAttribute",
    # issue 17 item 5: Stream.from_handle checks a foreign stream's device (CUDA >= 12.8)
    "cudaStreamGetDevice",
    # issue 18 item 2: Kernel.max_potential_block_size (cudaOccupancyMaxPotentialBlockSize is a
    # header-only C++ template in cuda_runtime.h, not an export: accel runs its search in Python
    # over this call); every CUDA >= 6.5 has it
    "cudaOccupancyMaxActiveBlocksPerMultiprocessor",
]

# Runtimes older than these functions (checked against the real exports in
# accel/sim/cudart_symbols/*.txt, written by tools/cudart_exports.py):
# cudaLibrary* and cudaStreamGetDevice came with 12.8 (absent from 12.4);
# cudaGetDriverEntryPointByVersion with 12.5.
CUDART12_OPTIONAL = {"cudaLibraryLoadData", "cudaLibraryUnload", "cudaLibraryGetKernel",
                     "cudaGetDriverEntryPointByVersion", "cudaStreamGetDevice"}

# Their declarations for the CUDA 12 module when its headers predate them (12.4 does):
# copied from the nvidia-cuda-runtime-cu12==12.8.90 wheel's cuda_runtime_api.h and
# driver_types.h (enum values as the generator folds them).  Types go with the first
# function (sorted) that needs them, since the fallbacks are appended in sorted order.
CUDART12_SPEC_FALLBACK = {
    "cudaGetDriverEntryPointByVersion": (
        "", "cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **funcPtr,"
            " unsigned int cudaVersion, unsigned long long flags,"
            " enum cudaDriverEntryPointQueryResult *driverStatus);"),
    "cudaLibraryGetKernel": (
        "typedef struct CUlib_st *cudaLibrary_t;\n",
        "cudaError_t cudaLibraryGetKernel(cudaKernel_t *pKernel, cudaLibrary_t library, const char *name);"),
    "cudaLibraryLoadData": (
        """enum cudaJitOption
{
  cudaJitMaxRegisters = 0,
  cudaJitThreadsPerBlock = 1,
  cudaJitWallTime = 2,
  cudaJitInfoLogBuffer = 3,
  cudaJitInfoLogBufferSizeBytes = 4,
  cudaJitErrorLogBuffer = 5,
  cudaJitErrorLogBufferSizeBytes = 6,
  cudaJitOptimizationLevel = 7,
  cudaJitFallbackStrategy = 10,
  cudaJitGenerateDebugInfo = 11,
  cudaJitLogVerbose = 12,
  cudaJitGenerateLineInfo = 13,
  cudaJitCacheMode = 14,
  cudaJitPositionIndependentCode = 30,
  cudaJitMinCtaPerSm = 31,
  cudaJitMaxThreadsPerBlock = 32,
  cudaJitOverrideDirectiveValues = 33
};
enum cudaLibraryOption
{
  cudaLibraryHostUniversalFunctionAndDataTable = 0,
  cudaLibraryBinaryIsPreserved = 1
};
""",
        "cudaError_t cudaLibraryLoadData(cudaLibrary_t *library, const void *code,"
        " enum cudaJitOption *jitOptions, void **jitOptionsValues, unsigned int numJitOptions,"
        " enum cudaLibraryOption *libraryOptions, void **libraryOptionValues,"
        " unsigned int numLibraryOptions);"),
    "cudaLibraryUnload": ("", "cudaError_t cudaLibraryUnload(cudaLibrary_t library);"),
    "cudaStreamGetDevice": ("", "cudaError_t cudaStreamGetDevice(cudaStream_t hStream, int *device);"),
}

# Integer #defines (object-like macros) to expose as lib.NAME.
CUDART_DEFINES = [
    "CUDART_VERSION",
    "cudaStreamDefault", "cudaStreamNonBlocking", "cudaStreamLegacy", "cudaStreamPerThread",
    "cudaEventDefault", "cudaEventBlockingSync", "cudaEventDisableTiming", "cudaEventInterprocess",
    "cudaEventRecordDefault", "cudaEventRecordExternal", "cudaEventWaitDefault", "cudaEventWaitExternal",
    "cudaHostAllocDefault", "cudaHostAllocPortable", "cudaHostAllocMapped",
    "cudaHostAllocWriteCombined",
    "cudaDeviceScheduleAuto", "cudaDeviceScheduleSpin", "cudaDeviceScheduleYield",
    "cudaDeviceScheduleBlockingSync", "cudaDeviceMapHost",
    "cudaCpuDeviceId", "cudaInvalidDeviceId",
]

# Types no listed function mentions but whose constants callers need (flag enums
# behind plain unsigned/uint32_t parameters): "enum NAME", "struct NAME" or a typedef name.
CUDART_TYPES = ["enum cudaGraphDebugDotFlags", "enum cudaGraphInstantiateFlags"]

NVML_FUNCTIONS = [
    "nvmlInit_v2", "nvmlShutdown", "nvmlErrorString",
    "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetUUID",
    "nvmlDeviceGetName", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetMultiGpuBoard",
    "nvmlSystemGetDriverVersion", "nvmlSystemGetNVMLVersion", "nvmlSystemGetCudaDriverVersion_v2",
    "nvmlDeviceGetMigMode", "nvmlDeviceGetMaxMigDeviceCount", "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceGetIndex",
    # what torch.cuda's utilization/memory_usage/temperature/power_draw/clock_rate and
    # list_gpu_processes read through pynvml (accel._telemetry)
    "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetClockInfo", "nvmlDeviceGetComputeRunningProcesses_v3",
]

NVML_DEFINES = [
    "NVML_API_VERSION",
    "NVML_DEVICE_UUID_BUFFER_SIZE", "NVML_DEVICE_UUID_V2_BUFFER_SIZE",
    "NVML_DEVICE_NAME_BUFFER_SIZE", "NVML_DEVICE_NAME_V2_BUFFER_SIZE",
    "NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE", "NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE",
    "NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE", "NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE",
    "NVML_DEVICE_MIG_DISABLE", "NVML_DEVICE_MIG_ENABLE",
    "NVML_INIT_FLAG_NO_GPUS", "NVML_INIT_FLAG_NO_ATTACH",
    "NVML_VALUE_NOT_AVAILABLE",
]

ZE_FUNCTIONS = [
    # ze_api.h
    "zeInit", "zeInitDrivers", "zeDriverGet", "zeDriverGetApiVersion", "zeDriverGetProperties",
    "zeDeviceGet", "zeDeviceGetSubDevices", "zeDeviceGetProperties",
    "zeDeviceGetComputeProperties", "zeDeviceGetMemoryProperties",
    "zeDeviceGetCommandQueueGroupProperties", "zeDeviceGetGlobalTimestamps",
    "zeDeviceGetModuleProperties",
    "zeContextCreate", "zeContextDestroy",
    "zeMemAllocDevice", "zeMemAllocHost", "zeMemFree", "zeMemGetAllocProperties",
    "zeCommandListCreate", "zeCommandListCreateImmediate", "zeCommandListDestroy",
    "zeCommandListClose", "zeCommandListReset", "zeCommandListAppendMemoryCopy",
    "zeCommandListAppendMemoryFill", "zeCommandListAppendSignalEvent",
    "zeCommandListAppendWaitOnEvents", "zeCommandListAppendBarrier",
    "zeCommandListAppendLaunchKernel", "zeCommandListHostSynchronize",
    "zeCommandListAppendEventReset",
    "zeCommandQueueCreate", "zeCommandQueueDestroy", "zeCommandQueueExecuteCommandLists",
    "zeCommandQueueSynchronize",
    "zeEventPoolCreate", "zeEventPoolDestroy", "zeEventCreate", "zeEventDestroy",
    "zeEventHostSignal", "zeEventHostSynchronize", "zeEventQueryStatus", "zeEventHostReset",
    "zeEventQueryKernelTimestamp",
    "zeModuleCreate", "zeModuleDestroy", "zeKernelCreate", "zeKernelDestroy",
    "zeKernelSetArgumentValue", "zeKernelSetGroupSize", "zeKernelSuggestGroupSize",
    # issue 18 item 1: accel.Module's build log in the error when SPIR-V fails to build (API 1.0)
    "zeModuleBuildLogGetString", "zeModuleBuildLogDestroy",
    # virtual memory (issue 15: the allocator's expandable segments); core API 1.0, every loader has them
    "zeVirtualMemQueryPageSize", "zeVirtualMemReserve", "zeVirtualMemFree",
    "zePhysicalMemCreate", "zePhysicalMemDestroy", "zeVirtualMemMap", "zeVirtualMemUnmap",
    "zeVirtualMemSetAccessAttribute", "zeVirtualMemGetAccessAttribute",
    # zes_api.h (Sysman, same loader library)
    "zesInit", "zesDriverGet", "zesDeviceGet", "zesDeviceGetProperties",
    "zesDeviceEnumMemoryModules", "zesMemoryGetProperties", "zesMemoryGetState",
    # torch.cuda's temperature / clock_rate / list_gpu_processes / can_device_access_peer on
    # Level Zero (accel._telemetry); Level Zero API 1.0, every loader has them
    "zeDeviceCanAccessPeer",
    "zesDeviceEnumTemperatureSensors", "zesTemperatureGetProperties", "zesTemperatureGetState",
    "zesDeviceEnumFrequencyDomains", "zesFrequencyGetProperties", "zesFrequencyGetState",
    "zesDeviceProcessesGetState",
    # utilization / memory_usage / power_draw on Level Zero: Sysman counters sampled twice
    # (engine activity, memory bandwidth, energy); Level Zero API 1.0, every loader has them
    "zesDeviceEnumEngineGroups", "zesEngineGetProperties", "zesEngineGetActivity",
    "zesMemoryGetBandwidth",
    "zesDeviceEnumPowerDomains", "zesDeviceGetCardPowerDomain", "zesPowerGetProperties",
    "zesPowerGetEnergyCounter",
]

ZE_TYPES = [
    "ze_init_flag_t", "ze_device_property_flag_t", "ze_command_queue_group_property_flag_t",
    "ze_command_queue_flag_t", "ze_command_list_flag_t", "ze_event_pool_flag_t",
    "ze_event_scope_flag_t", "ze_device_mem_alloc_flag_t", "ze_host_mem_alloc_flag_t",
    "ze_kernel_flag_t", "ze_device_module_flag_t",
    "ze_physical_mem_flag_t",
]

ZE_DEFINES = [
    "ZE_MAX_DEVICE_NAME", "ZE_MAX_DEVICE_UUID_SIZE", "ZE_MAX_DRIVER_UUID_SIZE",
    "ZE_MAX_KERNEL_UUID_SIZE", "ZE_MAX_MODULE_UUID_SIZE", "ZE_MAX_EXTENSION_NAME",
    "ZE_MAX_IPC_HANDLE_SIZE", "ZE_SUBGROUPSIZE_COUNT",
    "ZE_MAX_UUID_SIZE", "ZES_STRING_PROPERTY_SIZE",
]

# Functions that old libraries may lack: the loader reports them through
# missing_symbols(); Debian's libze_loader 1.8.12 lacks all three.
# zesDriverGet/zesDeviceGet came with zesInit (API 1.5), so the same loader lacks them too.
ZE_OPTIONAL = {"zeInitDrivers", "zeCommandListHostSynchronize", "zesInit", "zesDriverGet", "zesDeviceGet"}

# Declarations of OPTIONAL functions, copied from newer Level Zero headers
# (ze_api.h / zes_api.h v1.10+), used only when the installed headers predate
# them (Debian's libze-dev 1.8.12 ships API 1.4).  Each entry: supporting types
# and the prototype.
ZE_SPEC_FALLBACK = {
    "zeInitDrivers": (
        "typedef uint32_t ze_init_driver_type_flags_t;\n"
        "typedef struct _ze_init_driver_type_desc_t {\n"
        "    ze_structure_type_t stype;\n"
        "    const void *pNext;\n"
        "    ze_init_driver_type_flags_t flags;\n"
        "} ze_init_driver_type_desc_t;\n",
        "ze_result_t zeInitDrivers(uint32_t *pCount, ze_driver_handle_t *phDrivers,"
        " ze_init_driver_type_desc_t *desc);"),
    "zeCommandListHostSynchronize": (
        "", "ze_result_t zeCommandListHostSynchronize(ze_command_list_handle_t hCommandList, uint64_t timeout);"),
    "zesInit": ("typedef uint32_t zes_init_flags_t;\n", "ze_result_t zesInit(zes_init_flags_t flags);"),
    "zesDriverGet": ("", "ze_result_t zesDriverGet(uint32_t *pCount, zes_driver_handle_t *phDrivers);"),
    "zesDeviceGet": (
        "", "ze_result_t zesDeviceGet(zes_driver_handle_t hDriver, uint32_t *pCount,"
            " zes_device_handle_t *phDevices);"),
}
# Constants of newer headers (enum values there; values from ze_api.h v1.10+),
# emitted as #defines only when the installed headers do not define them.
ZE_CONSTANT_FALLBACK = {
    "ZE_COMMAND_LIST_FLAG_IN_ORDER": 1 << 3,
    "ZE_COMMAND_QUEUE_FLAG_IN_ORDER": 1 << 1,  # immediate command lists, API 1.7+
    "ZE_STRUCTURE_TYPE_INIT_DRIVER_TYPE_DESC": 0x00020021,
    "ZE_INIT_DRIVER_TYPE_FLAG_GPU": 1 << 0,
    "ZE_INIT_DRIVER_TYPE_FLAG_NPU": 1 << 1,
}

# No Objective-C runtime headers on Linux: these declarations are written here by
# hand (from <objc/runtime.h>, <objc/message.h>, <Metal/MTLDevice.h>) and still go
# through cffi's parser and emit_python_code, so _objc.py/_metal.py are generated.
#
# objc_msgSend is declared as taking nothing and returning nothing on purpose: on
# arm64 it must never be called variadically; callers cast it to the exact method
# signature first, e.g. ffi.cast("id(*)(id, SEL, unsigned long)", lib.objc_msgSend).
# MTLSize (<Metal/MTLTypes.h>) and NSRange (<Foundation/NSRange.h>) are here because
# methods take them by value, so the casts in accel/backends/_objc.py name them.
# BOOL is not declared: it is _Bool on arm64 and signed char on x86_64, so the
# message-send helper picks the type per machine.
OBJC_CDEF = """\
typedef void *id;
typedef void *SEL;
typedef void *Class;
typedef unsigned long NSUInteger;
typedef long NSInteger;
typedef struct { NSUInteger width; NSUInteger height; NSUInteger depth; } MTLSize;
typedef struct _NSRange { NSUInteger location; NSUInteger length; } NSRange;
Class objc_getClass(const char *name);
SEL sel_registerName(const char *str);
const char *sel_getName(SEL sel);
void objc_msgSend(void);
id objc_retain(id obj);
void objc_release(id obj);
id objc_autorelease(id obj);
void *objc_autoreleasePoolPush(void);
void objc_autoreleasePoolPop(void *pool);
const char *object_getClassName(id obj);
Class object_getClass(id obj);
"""

METAL_CDEF = """\
typedef void *id;
id MTLCreateSystemDefaultDevice(void);
id MTLCopyAllDevices(void);
"""


# NVRTC (issue 18 item 3: accel.compile, CUDA C -> PTX).  nvrtc.h from the nvidia-cuda-nvrtc
# wheel (nvidia/cu13/include; the cu12 wheel: nvidia/cuda_nvrtc/include) or the toolkit.  These
# have kept their signatures from CUDA 11.1 through 13 (nvrtcGetCUBIN came with 11.1), so one
# module serves libnvrtc.so.12 and .so.13.  nvrtc.h has no version macro: the version recorded
# is the package's that installed the header (Library.header_package).
NVRTC_FUNCTIONS = [
    "nvrtcGetErrorString", "nvrtcVersion", "nvrtcGetNumSupportedArchs", "nvrtcGetSupportedArchs",
    "nvrtcCreateProgram", "nvrtcDestroyProgram", "nvrtcCompileProgram",
    "nvrtcGetPTXSize", "nvrtcGetPTX", "nvrtcGetCUBINSize", "nvrtcGetCUBIN",
    "nvrtcGetProgramLogSize", "nvrtcGetProgramLog",
]


@dataclass
class Library:
    """One generated module."""

    name: str                         # generator key (--only); also the open_library key unless ``key``
    module: str                       # generated module name under accel._ffi
    functions: List[str]
    defines: List[str] = field(default_factory=list)
    types: List[str] = field(default_factory=list)
    optional: set = field(default_factory=set)
    headers: List[str] = field(default_factory=list)      # top headers, relative to the include root
    include_roots: Tuple[callable, ...] = ()              # callables yielding candidate include dirs
    version_macros: List[str] = field(default_factory=list)  # macros/enum constants recorded in the header comment
    literal_cdef: Optional[str] = None                    # objc/metal: no header on Linux
    spec_fallback: Dict[str, Tuple[str, str]] = field(default_factory=dict)  # optional fn -> (types, prototype)
    constant_fallback: Dict[str, int] = field(default_factory=dict)
    fallback_source: str = "newer Level Zero headers"     # where spec_fallback was copied from
    source_note: str = ""
    # CUDA: the major the headers must be (an include root of another major is skipped),
    # as (header, version macro, major), e.g. ("cuda_runtime_api.h", "CUDART_VERSION", 12).
    cuda_major: Optional[Tuple[str, str, int]] = None
    # Real libraries to symbol-check the generated module against (first that exists).
    real_libraries: Tuple[callable, ...] = ()
    key: Optional[str] = None         # accel._ffi.open_library key when not ``name`` (cudart12 -> cudart)
    # Record the version of the package that installed the headers (a wheel's dist-info, the
    # toolkit's version.json or directory name): for headers without a version macro (nvrtc.h).
    header_package: bool = False


def _site_dirs() -> List[str]:
    import site
    dirs = []
    try:
        dirs.extend(site.getsitepackages())
    except AttributeError:  # pragma: no cover - virtualenv without getsitepackages
        pass
    try:
        dirs.append(site.getusersitepackages())
    except AttributeError:  # pragma: no cover
        pass
    dirs.extend(p for p in sys.path if p.endswith("site-packages"))
    seen, out = set(), []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def _cuda_roots():
    # Candidates of every major: Library.cuda_major keeps those of the wanted one.
    for var in ("CUDA_HOME", "CUDA_PATH"):
        v = os.environ.get(var)
        if v:
            yield os.path.join(v, "include")
    yield "/usr/local/cuda/include"
    for sp in _site_dirs():
        yield os.path.join(sp, "nvidia", "cu13", "include")
        yield os.path.join(sp, "nvidia", "cuda_runtime", "include")   # nvidia-cuda-runtime-cu12


def _cudart13_libs():
    for var in ("CUDA_HOME", "CUDA_PATH"):
        v = os.environ.get(var)
        if v:
            yield os.path.join(v, "lib64", "libcudart.so.13")
    yield "/usr/local/cuda/lib64/libcudart.so.13"
    for sp in _site_dirs():
        yield os.path.join(sp, "nvidia", "cu13", "lib", "libcudart.so.13")


def _cudart12_libs():
    # The library next to the headers the module is generated from (the cu12 wheel)
    # comes first, so the check is against the very version the headers describe.
    for sp in _site_dirs():
        yield os.path.join(sp, "nvidia", "cuda_runtime", "lib", "libcudart.so.12")
    for var in ("CUDA_HOME", "CUDA_PATH"):
        v = os.environ.get(var)
        if v:
            yield os.path.join(v, "lib64", "libcudart.so.12")


def _nvml_roots():
    for sp in _site_dirs():
        yield os.path.join(sp, "nvidia", "cu13", "include")
        yield os.path.join(sp, "nvidia", "nvml", "include")
        yield os.path.join(sp, "nvidia", "cu12", "include")
    for var in ("CUDA_HOME", "CUDA_PATH"):
        v = os.environ.get(var)
        if v:
            yield os.path.join(v, "include")
    yield "/usr/local/cuda/include"
    yield "/usr/include"


def _ze_roots():
    yield "/usr/include/level_zero"
    yield "/usr/local/include/level_zero"


def _nvrtc_roots():
    # The wheels first: that is where accel's loader finds libnvrtc first too.
    for sp in _site_dirs():
        yield os.path.join(sp, "nvidia", "cu13", "include")
        yield os.path.join(sp, "nvidia", "cuda_nvrtc", "include")   # nvidia-cuda-nvrtc-cu12
    for var in ("CUDA_HOME", "CUDA_PATH"):
        v = os.environ.get(var)
        if v:
            yield os.path.join(v, "include")
    yield "/usr/local/cuda/include"


def _nvrtc_libs():
    # The library next to the header first, so the check is against the version it describes.
    for sp in _site_dirs():
        yield os.path.join(sp, "nvidia", "cu13", "lib", "libnvrtc.so.13")
        yield os.path.join(sp, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.12")
    for var in ("CUDA_HOME", "CUDA_PATH"):
        v = os.environ.get(var)
        if v:
            yield os.path.join(v, "lib64", "libnvrtc.so.13")
    yield "/usr/local/cuda/lib64/libnvrtc.so.13"


def header_package(root: str, header: str) -> str:
    """Which package installed ``root/header``: "<name> <version>" from the pip wheel whose
    dist-info RECORD lists it, else the CUDA toolkit's version.json / directory name, else
    "unknown".  Deterministic: reads only files next to the header."""
    path = os.path.realpath(os.path.join(root, header))
    d = os.path.dirname(path)
    while True:
        parent = os.path.dirname(d)
        try:
            infos = sorted(e for e in os.listdir(d) if e.endswith(".dist-info"))
        except OSError:
            infos = []
        rel = os.path.relpath(path, d).replace(os.sep, "/")
        for info in infos:
            try:
                with open(os.path.join(d, info, "RECORD"), errors="replace") as f:
                    if not any(line.split(",", 1)[0] == rel for line in f):
                        continue
                with open(os.path.join(d, info, "METADATA"), errors="replace") as f:
                    meta = dict(re.findall(r"^(Name|Version): (.+)$", f.read(), re.M))
            except OSError:
                continue
            return "%s %s" % (meta.get("Name", info), meta.get("Version", "?"))
        vj = os.path.join(d, "version.json")
        if os.path.isfile(vj):
            import json
            try:
                with open(vj) as f:
                    data = json.load(f)
                return "CUDA toolkit (cuda_nvrtc %s)" % data["cuda_nvrtc"]["version"]
            except (OSError, ValueError, KeyError, TypeError):
                pass
        m = re.fullmatch(r"cuda-(\d+\.\d+)", os.path.basename(d))
        if m:
            return "CUDA toolkit %s" % m.group(1)
        if parent == d:
            return "unknown"
        d = parent


LIBRARIES: Dict[str, Library] = {
    "cudart": Library(
        name="cudart", module="_cudart", functions=CUDART_FUNCTIONS, defines=CUDART_DEFINES,
        types=CUDART_TYPES,
        headers=["cuda_runtime_api.h"], include_roots=(_cuda_roots,),
        version_macros=["CUDART_VERSION"],
        cuda_major=("cuda_runtime_api.h", "CUDART_VERSION", 13), real_libraries=(_cudart13_libs,),
    ),
    # CUDA 12 from its own headers (the nvidia-cuda-runtime-cu12 wheel's include/):
    # struct cudaDeviceProp has another layout there, and the headers rename
    # cudaGetDeviceProperties / cudaStreamGetCaptureInfo to their _v2 symbols (ALIASES).
    "cudart12": Library(
        name="cudart12", key="cudart", module="_cudart12", functions=CUDART_FUNCTIONS, defines=CUDART_DEFINES,
        types=CUDART_TYPES, optional=set(CUDART12_OPTIONAL),
        spec_fallback=CUDART12_SPEC_FALLBACK, fallback_source="the CUDA 12.8 headers",
        headers=["cuda_runtime_api.h"], include_roots=(_cuda_roots,),
        version_macros=["CUDART_VERSION"],
        cuda_major=("cuda_runtime_api.h", "CUDART_VERSION", 12), real_libraries=(_cudart12_libs,),
    ),
    "nvml": Library(
        name="nvml", module="_nvml", functions=NVML_FUNCTIONS, defines=NVML_DEFINES,
        headers=["nvml.h"], include_roots=(_nvml_roots,), version_macros=["NVML_API_VERSION"],
    ),
    "ze": Library(
        name="ze", module="_ze", functions=ZE_FUNCTIONS, defines=ZE_DEFINES, optional=ZE_OPTIONAL,
        types=ZE_TYPES,
        spec_fallback=ZE_SPEC_FALLBACK, constant_fallback=ZE_CONSTANT_FALLBACK,
        headers=["ze_api.h", "zes_api.h"], include_roots=(_ze_roots,),
        version_macros=["ZE_API_VERSION_CURRENT"],
    ),
    "objc": Library(
        name="objc", module="_objc",
        functions=["objc_getClass", "sel_registerName", "sel_getName", "objc_msgSend", "objc_retain",
                   "objc_release", "objc_autorelease", "objc_autoreleasePoolPush",
                   "objc_autoreleasePoolPop", "object_getClassName", "object_getClass"],
        literal_cdef=OBJC_CDEF, source_note="literal cdef in tools/gen_bindings.py (libobjc.A.dylib)",
    ),
    "metal": Library(
        name="metal", module="_metal", functions=["MTLCreateSystemDefaultDevice", "MTLCopyAllDevices"],
        literal_cdef=METAL_CDEF,
        source_note="literal cdef in tools/gen_bindings.py (Metal.framework)",
    ),
}

# ---------------------------------------------------------------------------
# CUDA driver entry points (issue 14 item 3; kernel path, owned with accel/backends/cuda/driver.py).
# Not a library accel opens: accel/_ffi/_cudadrv.py holds the driver's function-pointer
# types (cudaTypedefs.h PFN_*, with their cuda.h types and the CUresult enum) that the
# pointers cudaGetDriverEntryPoint[ByVersion] hands out are cast to.  The _v<N> suffix
# is the ABI version of the symbol; these have kept their ABI through CUDA 13.
# ---------------------------------------------------------------------------

CUDADRV_TYPES = [
    "CUresult",
    "PFN_cuGetErrorName_v6000", "PFN_cuGetErrorString_v6000",
    "PFN_cuModuleLoadData_v2000", "PFN_cuModuleUnload_v2000", "PFN_cuModuleGetFunction_v2000",
    "PFN_cuLaunchKernel_v4000",
    # issue 18 item 2: kernel attributes, the >48 KiB shared-memory opt-in and occupancy on
    # runtimes without cudaLibrary* (their kernels are driver CUfunctions)
    "PFN_cuFuncGetAttribute_v2020", "PFN_cuFuncSetAttribute_v9000",
    "PFN_cuOccupancyMaxActiveBlocksPerMultiprocessor_v6050",
    # Virtual memory (issue 15 item 1: the caching allocator's expandable segments).  The same
    # ABIs (_v10020, _v2000) and struct layouts (CUmemAllocationProp_v1, CUmemAccessDesc_v1,
    # CUmemLocation_v1) in the CUDA 12.4 and 13.0 headers, so one module serves both majors.
    "PFN_cuDeviceGet_v2000", "PFN_cuDeviceGetAttribute_v2000",
    "PFN_cuMemGetAllocationGranularity_v10020",
    "PFN_cuMemAddressReserve_v10020", "PFN_cuMemAddressFree_v10020",
    "PFN_cuMemCreate_v10020", "PFN_cuMemRelease_v10020",
    "PFN_cuMemMap_v10020", "PFN_cuMemUnmap_v10020",
    "PFN_cuMemSetAccess_v10020", "PFN_cuMemGetAccess_v10020",
    # A device guard's exit restores a device only if its primary context exists (torch's
    # c10::cuda::MaybeSetDevice): cudaSetDevice would create one (CUDA 12+).
    "PFN_cuDevicePrimaryCtxGetState_v7000",
]

# The runtime calls that hand out those pointers (added here only if the list above
# lacks them; ByVersion is 12.5+, so old runtimes miss it).
CUDART_FUNCTIONS += [n for n in ("cudaGetDriverEntryPoint", "cudaGetDriverEntryPointByVersion")
                     if n not in CUDART_FUNCTIONS]
LIBRARIES["cudart"].optional.add("cudaGetDriverEntryPointByVersion")

LIBRARIES["cudadrv"] = Library(
    name="cudadrv", module="_cudadrv", functions=[], types=CUDADRV_TYPES,
    headers=["cudaTypedefs.h"], include_roots=(_cuda_roots,), version_macros=["CUDA_VERSION"],
    cuda_major=("cuda.h", "CUDA_VERSION", 13),
)

LIBRARIES["nvrtc"] = Library(
    name="nvrtc", module="_nvrtc", functions=NVRTC_FUNCTIONS, headers=["nvrtc.h"],
    include_roots=(_nvrtc_roots,), real_libraries=(_nvrtc_libs,), header_package=True,
)

# ---------------------------------------------------------------------------
# Preprocessing
# ---------------------------------------------------------------------------

# Stand-ins for the few libc headers the vendor headers include.  Types cffi
# knows natively (size_t, uint32_t, ...) are declared here only so pycparser can
# parse; they are never emitted.
_STUB_TYPES = {
    "size_t": "unsigned long", "ssize_t": "long", "ptrdiff_t": "long", "wchar_t": "int",
    "int8_t": "signed char", "uint8_t": "unsigned char", "int16_t": "short",
    "uint16_t": "unsigned short", "int32_t": "int", "uint32_t": "unsigned int",
    "int64_t": "long", "uint64_t": "unsigned long", "intptr_t": "long", "uintptr_t": "unsigned long",
    "intmax_t": "long", "uintmax_t": "unsigned long",
}
CFFI_BUILTIN_TYPEDEFS = frozenset(_STUB_TYPES)

_STUB_LIMITS = """\
#define CHAR_BIT 8
#define SCHAR_MIN (-128)
#define SCHAR_MAX 127
#define UCHAR_MAX 255
#define CHAR_MIN SCHAR_MIN
#define CHAR_MAX SCHAR_MAX
#define SHRT_MIN (-32768)
#define SHRT_MAX 32767
#define USHRT_MAX 65535
#define INT_MIN (-INT_MAX - 1)
#define INT_MAX 2147483647
#define UINT_MAX 4294967295U
#define LONG_MAX 9223372036854775807L
#define LONG_MIN (-LONG_MAX - 1L)
#define ULONG_MAX 18446744073709551615UL
#define LLONG_MAX 9223372036854775807LL
#define LLONG_MIN (-LLONG_MAX - 1LL)
#define ULLONG_MAX 18446744073709551615ULL
"""

_STUB_HEADERS = {
    "stddef.h": "#define NULL ((void*)0)\n#define offsetof(t, m) __builtin_offsetof(t, m)\n",
    "stdint.h": "#include <stddef.h>\n",
    "limits.h": _STUB_LIMITS,
    "stdbool.h": "#define bool _Bool\n#define true 1\n#define false 0\n",
    "stdlib.h": "#include <stddef.h>\n",
    "string.h": "#include <stddef.h>\n",
}

# crt/host_defines.h for an include root that lacks it: the nvidia-cuda-runtime-cu12
# wheel ships cuda_runtime_api.h and friends but not crt/ (that comes with nvcc).  These
# are its host-compiler (GCC, not __CUDACC__) definitions: alignment stays a real
# attribute (so the struct-layout test compiles the same layouts as with the real file),
# the CUDA-only location and builtin markers are empty.  The generator defines
# __attribute__ away, so for the cdef all of them are nothing.  Searched AFTER the
# include root: a root with crt/ uses its own.
_CRT_HOST_DEFINES_STUB = (
    "#define __HOST_DEFINES_H__\n"
    "#define __align__(n) __attribute__((aligned(n)))\n"
    "#define __builtin_align__(a) __align__(a)\n"
    "#define __no_return__ __attribute__((noreturn))\n"
    + "".join("#define %s\n" % m for m in (
        "__noinline__", "__forceinline__", "__inline_hint__", "__maxnreg__(a)", "__local_maxnreg__(a)",
        "__thread__", "__import__", "__export__", "__cdecl", "__annotate__(a)", "__location__(a)",
        "CUDARTAPI", "CUDARTAPI_CDECL", "__specialization_static", "__launch_bounds__(...)",
        "__grid_constant__", "__host__", "__device__", "__global__", "__shared__", "__constant__",
        "__managed__", "__nv_pure__", "__device_builtin__", "__device_builtin_texture_type__",
        "__device_builtin_surface_type__", "__cudart_builtin__", "__cluster_dims__(...)",
        "__block_size__(...)")))
_STUB_AFTER_HEADERS = {os.path.join("crt", "host_defines.h"): _CRT_HOST_DEFINES_STUB}


def _write_stubs(tmp: str) -> Tuple[str, str]:
    """Write the libc stubs (searched before the root) and the after-root stubs; return both dirs."""
    stubs = os.path.join(tmp, "stubs")
    after = os.path.join(stubs, "after")
    os.makedirs(os.path.join(after, "crt"))
    for name, text in _STUB_HEADERS.items():
        with open(os.path.join(stubs, name), "w") as f:
            f.write(text)
    for name, text in _STUB_AFTER_HEADERS.items():
        with open(os.path.join(after, name), "w") as f:
            f.write(text)
    return stubs, after


_TYPES_PRELUDE = "".join("typedef %s %s;\n" % (c, n) for n, c in sorted(_STUB_TYPES.items()))

# GNU/CUDA decorations that mean nothing to a cdef.  The vendor headers take their
# GCC branch (__GNUC__ stays defined) and expand to these, which we define away.
_PP_DEFINES = [
    "__attribute__(x)=", "__extension__=", "__inline=inline", "__inline__=inline",
    "__restrict=", "__restrict__=", "__asm__(x)=", "__asm(x)=", "__declspec(x)=",
    "__builtin_va_list=void*", "__THROW=", "__nonnull(x)=",
    "__CUDA_DEPRECATED=", "__CUDA_DEPRECATED_MSG(x)=",
]

_MARKER = "__accel_define__"
FALLBACK_FILE = "<spec-fallback>"


def find_compiler() -> Optional[List[str]]:
    """The C preprocessor command to use, or None when there is none."""
    for cc in (os.environ.get("CC"), "gcc", "cc", "clang"):
        if cc and shutil.which(cc):
            return [cc, "-E"]
    if shutil.which("cpp"):
        return ["cpp"]
    return None


def header_cuda_version(root: str, header: str, macro: str) -> Optional[int]:
    """The integer value of ``#define <macro> <n>`` in ``root/header`` (e.g. CUDART_VERSION 12040)."""
    try:
        with open(os.path.join(root, header), errors="replace") as f:
            m = re.search(r"^\s*#\s*define\s+%s\s+(\d+)" % re.escape(macro), f.read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def find_include_root(lib: Library) -> Optional[str]:
    """First candidate include dir holding every header of ``lib`` (of its CUDA major, if set)."""
    for gen in lib.include_roots:
        for root in gen():
            if not all(os.path.isfile(os.path.join(root, h)) for h in lib.headers):
                continue
            if lib.cuda_major is not None:
                header, macro, major = lib.cuda_major
                v = header_cuda_version(root, header, macro)
                if v is None or v // 1000 != major:
                    continue
            return os.path.normpath(root)
    return None


def find_real_library(lib: Library) -> Optional[str]:
    """First existing real library to symbol-check ``lib``'s module against, or None."""
    for gen in lib.real_libraries:
        for path in gen():
            if os.path.isfile(path):
                return path
    return None


def library_exports(path: str) -> set:
    """Defined function names in the dynamic symbol table of the ELF library at ``path``."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        from cudart_exports import exported_functions
    finally:
        sys.path.pop(0)
    with open(path, "rb") as f:
        return exported_functions(f.read())


def symbol_check(g: "Generated", path: str) -> Tuple[List[str], List[str]]:
    """(missing required, missing optional) declared functions of ``g`` absent from ``path``."""
    exported = library_exports(path)
    missing = [f for f in g.functions if f not in exported]
    opt = set(g.lib.optional) | {g.aliases.get(f, f) for f in g.lib.optional}
    return [f for f in missing if f not in opt], [f for f in missing if f in opt]


def preprocess(lib: Library, root: str, extra: str = "") -> str:
    """Run the preprocessor over ``lib``'s headers (plus ``extra`` source) and return its output."""
    cc = find_compiler()
    if cc is None:
        raise RuntimeError("no C preprocessor (gcc, cc, clang or cpp) on PATH")
    with tempfile.TemporaryDirectory(prefix="accel-gen-") as tmp:
        stubs, after = _write_stubs(tmp)
        src = os.path.join(tmp, "accel_bindings_input.c")
        with open(src, "w") as f:
            for h in lib.headers:
                f.write('#include "%s"\n' % h)
            f.write(extra)
        cmd = cc + ["-nostdinc", "-I", stubs, "-I", root, "-I", after, "-std=c99", "-xc"]
        cmd += ["-D" + d for d in _PP_DEFINES]
        cmd.append(src)
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp)
        if res.returncode != 0:
            raise RuntimeError("preprocessing %s failed:\n%s" % (lib.headers, res.stderr[-4000:]))
        out = res.stdout
        # Make the line markers independent of where the temp dir and the root are.
        out = out.replace(root + os.sep, "").replace(root, ".").replace(stubs + os.sep, "<stub>/")
        out = out.replace(tmp + os.sep, "")
        return out


def macro_table(lib: Library, root: str) -> Dict[str, str]:
    """Object-like macros defined after including ``lib``'s headers: name -> body."""
    cc = find_compiler()
    with tempfile.TemporaryDirectory(prefix="accel-gen-") as tmp:
        stubs, after = _write_stubs(tmp)
        src = os.path.join(tmp, "m.c")
        with open(src, "w") as f:
            for h in lib.headers:
                f.write('#include "%s"\n' % h)
        cmd = cc + ["-dM", "-nostdinc", "-I", stubs, "-I", root, "-I", after, "-std=c99", "-xc"]
        cmd += ["-D" + d for d in _PP_DEFINES] + [src]
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if res.returncode != 0:
            raise RuntimeError(res.stderr[-4000:])
    table = {}
    for line in res.stdout.splitlines():
        m = re.match(r"#define ([A-Za-z_]\w*)(?: (.*))?$", line)
        if m:
            table[m.group(1)] = (m.group(2) or "").strip()
    return table


# ---------------------------------------------------------------------------
# Parsing and selection
# ---------------------------------------------------------------------------

def _int_literal(text: str) -> int:
    t = text.rstrip("uUlL")
    if t.startswith("'"):
        body = t[1:-1]
        if body.startswith("\\"):
            return {"n": 10, "t": 9, "0": 0, "\\": 92, "'": 39}.get(body[1:], None) or int(body[1:], 8)
        return ord(body)
    if t.lower().startswith("0x"):
        return int(t, 16)
    if len(t) > 1 and t.startswith("0"):
        return int(t, 8)
    return int(t)


class Evaluator:
    """Folds C integer constant expressions (enum values, array sizes, #defines)."""

    def __init__(self):
        self.consts: Dict[str, int] = {}

    def eval(self, node) -> int:
        from pycparser import c_ast
        if isinstance(node, c_ast.Constant):
            if node.type in ("int", "char", "unsigned int", "long int", "unsigned long int",
                             "long long int", "unsigned long long int") or node.type.endswith("int"):
                return _int_literal(node.value)
            raise ValueError("not an integer constant: %r" % node.value)
        if isinstance(node, c_ast.ID):
            if node.name not in self.consts:
                raise ValueError("unknown constant %r" % node.name)
            return self.consts[node.name]
        if isinstance(node, c_ast.Cast):
            v = self.eval(node.expr)
            names = _type_names(node.to_type)
            if "unsigned" in names and "long" not in names:
                v &= 0xFFFFFFFF
            elif names == ["int"]:
                v = (v + 2 ** 31) % 2 ** 32 - 2 ** 31
            return v
        if isinstance(node, c_ast.UnaryOp):
            v = self.eval(node.expr)
            return {"-": lambda: -v, "+": lambda: v, "~": lambda: ~v, "!": lambda: int(not v)}[node.op]()
        if isinstance(node, c_ast.BinaryOp):
            a, b = self.eval(node.left), self.eval(node.right)
            op = node.op
            if op == "/":
                q = abs(a) // abs(b)
                return q if (a >= 0) == (b >= 0) else -q
            if op == "%":
                return a - b * (abs(a) // abs(b) if (a >= 0) == (b >= 0) else -(abs(a) // abs(b)))
            return int({
                "+": a + b, "-": a - b, "*": a * b, "<<": a << b, ">>": a >> b, "|": a | b,
                "&": a & b, "^": a ^ b, "<": a < b, ">": a > b, "<=": a <= b, ">=": a >= b,
                "==": a == b, "!=": a != b, "&&": bool(a and b), "||": bool(a or b),
            }[op])
        if isinstance(node, c_ast.TernaryOp):
            return self.eval(node.iftrue) if self.eval(node.cond) else self.eval(node.iffalse)
        raise ValueError("cannot fold %s" % type(node).__name__)


def _type_names(node) -> List[str]:
    from pycparser import c_ast
    while not isinstance(node, c_ast.IdentifierType):
        if not hasattr(node, "type"):
            return []
        node = node.type
    return list(node.names)


@dataclass
class _Item:
    key: tuple
    kind: str        # "struct", "union", "enum", "typedef", "func"
    name: str
    node: object


class HeaderModel:
    """Top-level declarations of a preprocessed header, indexed for dependency walks."""

    def __init__(self, text: str):
        from pycparser import CParser, c_ast
        self.c_ast = c_ast
        self.ast = CParser().parse(_TYPES_PRELUDE + text, "<headers>")
        self.ev = Evaluator()
        self.typedefs: Dict[str, _Item] = {}
        self.tags: Dict[Tuple[str, str], _Item] = {}     # ("struct"|"union"|"enum", name) -> definition
        self.funcs: Dict[str, _Item] = {}
        self.files: set = set()
        self.enum_values: Dict[Tuple[str, str], List[Tuple[str, int]]] = {}
        self.defines: Dict[str, int] = {}
        for i, ext in enumerate(self.ast.ext):
            name = getattr(ext, "name", None) or ""
            if name.startswith(_MARKER):
                self.defines[name[len(_MARKER):]] = self.ev.eval(ext.init)
                continue
            if ext.coord and ext.coord.file:
                self.files.add(ext.coord.file)
            self._index(i, ext)

    def _index(self, i, ext):
        c_ast = self.c_ast
        if isinstance(ext, c_ast.Typedef):
            self._index_tags(i, ext.type)
            if ext.name not in self.typedefs:
                self.typedefs[ext.name] = _Item((i, 1), "typedef", ext.name, ext)
        elif isinstance(ext, c_ast.Decl):
            if isinstance(ext.type, c_ast.FuncDecl):
                self._index_tags(i, ext.type)
                if ext.name not in self.funcs:
                    self.funcs[ext.name] = _Item((i, 1), "func", ext.name, ext)
            else:
                self._index_tags(i, ext.type)

    def _index_tags(self, i, node, depth=0):
        """Register named struct/union/enum definitions found anywhere in ``node``;
        fold enum values as they appear (later enums may refer to earlier constants)."""
        c_ast = self.c_ast
        if node is None:
            return
        if isinstance(node, (c_ast.Struct, c_ast.Union)):
            if node.decls is not None:
                for d in node.decls:
                    self._index_tags(i, d.type, depth + 1)
                if node.name:
                    kind = "struct" if isinstance(node, c_ast.Struct) else "union"
                    self.tags.setdefault((kind, node.name), _Item((i, 0, -depth), kind, node.name, node))
            return
        if isinstance(node, c_ast.Enum):
            if node.values is not None:
                vals, nxt = [], 0
                for e in node.values.enumerators:
                    v = self.ev.eval(e.value) if e.value is not None else nxt
                    self.ev.consts[e.name] = v
                    vals.append((e.name, v))
                    nxt = v + 1
                self.enum_values[("enum", node.name or "@%d" % id(node))] = vals
                if node.name:
                    self.tags.setdefault(("enum", node.name), _Item((i, 0, -depth), "enum", node.name, node))
            return
        if isinstance(node, c_ast.FuncDecl):
            if node.args:
                for p in node.args.params:
                    if hasattr(p, "type"):
                        self._index_tags(i, p.type, depth + 1)
            self._index_tags(i, node.type, depth + 1)
            return
        if hasattr(node, "type"):
            self._index_tags(i, node.type, depth)

    # -- dependency walk --------------------------------------------------
    def refs(self, node) -> List[Tuple[str, str]]:
        """(kind, name) references a type node makes: typedef names and tagged types."""
        c_ast = self.c_ast
        out: List[Tuple[str, str]] = []

        def walk(n):
            if n is None:
                return
            if isinstance(n, c_ast.IdentifierType):
                for nm in n.names:
                    if nm in self.typedefs:
                        out.append(("typedef", nm))
                return
            if isinstance(n, (c_ast.Struct, c_ast.Union)):
                kind = "struct" if isinstance(n, c_ast.Struct) else "union"
                if n.name:
                    out.append((kind, n.name))
                if n.decls:
                    for d in n.decls:
                        walk(d.type)
                return
            if isinstance(n, c_ast.Enum):
                if n.name:
                    out.append(("enum", n.name))
                return
            if isinstance(n, c_ast.FuncDecl):
                if n.args:
                    for p in n.args.params:
                        walk(getattr(p, "type", None))
                walk(n.type)
                return
            if isinstance(n, (c_ast.Typedef, c_ast.Decl, c_ast.TypeDecl, c_ast.PtrDecl,
                              c_ast.ArrayDecl, c_ast.Typename)):
                walk(n.type)
                return

        walk(node)
        return out

    def select(self, functions: Sequence[str], types: Sequence[str] = ()) -> List[_Item]:
        """Items needed by ``functions`` and ``types``, in header order."""
        need: Dict[Tuple[str, str], _Item] = {}
        stack: List[Tuple[str, str]] = []
        for t in types:
            kind, _, name = t.rpartition(" ")
            ref = (kind or "typedef", name)
            if (self.typedefs if not kind else {k[1]: v for k, v in self.tags.items() if k[0] == kind}).get(name) is None:
                raise SystemExit("type %r not found in the headers" % t)
            stack.append(ref)
        for fn in functions:
            item = self.funcs[fn]
            need[("func", fn)] = item
            stack.extend(self.refs(item.node.type))
        while stack:
            ref = stack.pop()
            if ref in need:
                continue
            kind, name = ref
            item = self.typedefs.get(name) if kind == "typedef" else self.tags.get(ref)
            if item is None:  # opaque struct (handle types): declared by reference only
                continue
            need[ref] = item
            node = item.node.type if kind == "typedef" else item.node
            stack.extend(self.refs(node))
        return sorted(need.values(), key=lambda it: (it.key, it.kind, it.name))

    # -- emission ---------------------------------------------------------
    def _fold(self, node):
        """Copy of a type node with enum values and array sizes folded to literals and
        named tag definitions reduced to references (they are emitted on their own)."""
        c_ast = self.c_ast
        node = copy.deepcopy(node)

        def fix(n, top):
            if n is None:
                return
            if isinstance(n, (c_ast.Struct, c_ast.Union)):
                if n.decls is not None and n.name and not top:
                    n.decls = None
                    return
                for d in n.decls or ():
                    fix(d, False)
                    if d.bitsize is not None:
                        d.bitsize = c_ast.Constant("int", str(self.ev.eval(d.bitsize)))
                return
            if isinstance(n, c_ast.Enum):
                if n.values is not None and n.name and not top:
                    n.values = None
                    return
                if n.values is not None:
                    for e in n.values.enumerators:
                        e.value = c_ast.Constant("int", str(self.ev.consts[e.name]))
                return
            if isinstance(n, c_ast.ArrayDecl):
                if n.dim is not None:
                    n.dim = c_ast.Constant("int", str(self.ev.eval(n.dim)))
                fix(n.type, False)
                return
            if isinstance(n, c_ast.FuncDecl):
                if n.args:
                    for p in n.args.params:
                        fix(p, False)
                fix(n.type, False)
                return
            if isinstance(n, (c_ast.Typedef, c_ast.Decl, c_ast.TypeDecl, c_ast.PtrDecl, c_ast.Typename)):
                fix(n.type, top and isinstance(n, c_ast.Struct))
                return

        if isinstance(node, (c_ast.Struct, c_ast.Union, c_ast.Enum)):
            fix(node, True)
        else:
            fix(node, False)
        return node

    def emit(self, items: List[_Item]) -> str:
        from pycparser import c_generator
        gen = c_generator.CGenerator()
        lines = []
        for it in items:
            if it.kind in ("struct", "union", "enum"):
                node = self._fold(it.node)
                text = gen.visit(node)
                lines.append(text + ";")
            elif it.kind == "typedef":
                if it.name in CFFI_BUILTIN_TYPEDEFS:
                    continue
                node = self._fold(it.node)
                node.quals = []
                lines.append(gen.visit(node) + ";")
            elif it.kind == "func":
                node = self._fold(it.node)
                node.storage = []
                node.funcspec = []
                lines.append(gen.visit(node) + ";")
        return "\n".join(_normalize(line) for line in lines) + "\n"


def _normalize(text: str) -> str:
    return re.sub(r"[ \t]+\n", "\n", text)


def defines_source(lib: Library, macros: Dict[str, str]) -> str:
    """C source appended after the headers so the compiler expands each listed #define;
    HeaderModel then folds the expanded expressions (see HeaderModel.defines)."""
    return "\n" + "".join("long long %s%s = (long long)(%s);\n" % (_MARKER, d, d)
                          for d in lib.defines if d in macros)


_ALIAS_MARKER = "__accel_alias__"


def resolve_aliases(lib: Library, macros: Dict[str, str], root: Optional[str] = None) -> Dict[str, str]:
    """Public name -> exported symbol for listed functions that the headers rename by macro.

    With ``root``, the preprocessor itself expands each listed name after the headers, so
    renames through function-like macros resolve too (CUDA 12: ``#define
    cudaStreamGetCaptureInfo __CUDART_API_PTSZ(cudaStreamGetCaptureInfo_v2)``, where
    ``__CUDART_API_PTSZ(api)`` is ``api`` without per-thread default streams, as here).
    Without it, chains of object-like macros only."""
    candidates = [fn for fn in lib.functions if fn in macros]
    if root is not None and candidates:
        text = preprocess(lib, root, "\n" + "".join("%s %s\n" % (_ALIAS_MARKER, fn) for fn in candidates))
        found = [line.split()[1:] for line in text.splitlines() if line.startswith(_ALIAS_MARKER + " ")]
        assert len(found) == len(candidates), (candidates, found)
        aliases = {}
        for fn, expanded in zip(candidates, found):
            if len(expanded) != 1 or not re.fullmatch(r"[A-Za-z_]\w*", expanded[0]):
                raise SystemExit("cannot resolve the header's rename of %s: it expands to %r"
                                 % (fn, " ".join(expanded)))
            if expanded[0] != fn:
                aliases[fn] = expanded[0]
        return aliases
    aliases = {}
    for fn in lib.functions:
        target, seen = fn, set()
        while target in macros and re.fullmatch(r"[A-Za-z_]\w*", macros[target] or "") and target not in seen:
            seen.add(target)
            target = macros[target]
        if target != fn:
            aliases[fn] = target
    return aliases


# ---------------------------------------------------------------------------
# Module writing
# ---------------------------------------------------------------------------

@dataclass
class Generated:
    lib: Library
    cdef: str
    provenance: List[str]
    aliases: Dict[str, str]
    functions: List[str]
    structs: List[str]
    dropped: List[str]
    header_version: Optional[Dict[str, str]] = None
    fallback: List[str] = field(default_factory=list)


def _cffi_py_source(module: str, cdef: str) -> str:
    import cffi
    ffi = cffi.FFI()
    ffi.cdef(cdef)
    ffi.set_source("accel._ffi." + module, None)
    with tempfile.TemporaryDirectory(prefix="accel-gen-") as tmp:
        path = os.path.join(tmp, module + ".py")
        with contextlib.redirect_stdout(io.StringIO()):  # cffi prints "generating ..."
            ffi.emit_python_code(path)
        with open(path) as f:
            return f.read()


def _struct_names(model: HeaderModel, items: List[_Item]) -> List[str]:
    """C type names (as ffi.typeof accepts them) of every struct/union emitted with a body."""
    c_ast = model.c_ast
    names = set()
    for it in items:
        if it.node.coord is not None and it.node.coord.file == FALLBACK_FILE:
            continue  # not in the installed headers, so the C layout check cannot see it
        if it.kind in ("struct", "union"):
            names.add("%s %s" % (it.kind, it.name))
        elif it.kind == "typedef":
            t = it.node.type
            if isinstance(t, c_ast.TypeDecl) and isinstance(t.type, (c_ast.Struct, c_ast.Union)):
                if t.type.name is None and t.type.decls is not None:
                    names.add(it.name)
    return sorted(names)


def generate(lib: Library) -> Generated:
    """Build the cdef and provenance for one library (needs its headers unless literal)."""
    if lib.literal_cdef is not None:
        return Generated(lib, lib.literal_cdef, ["source: " + lib.source_note], {}, list(lib.functions), [], [])
    root = find_include_root(lib)
    if root is None:
        raise FileNotFoundError("%s: headers %s not found in any include root" % (lib.name, lib.headers))
    macros = macro_table(lib, root)
    aliases = resolve_aliases(lib, macros, root)
    text = preprocess(lib, root, defines_source(lib, macros))
    fallback_used = []
    for fn, (types, proto) in sorted(lib.spec_fallback.items()):
        assert fn in lib.optional, "spec fallbacks are only for OPTIONAL functions: %s" % fn
        if not re.search(r"\b%s\s*\(" % re.escape(aliases.get(fn, fn)), text):
            fallback_used.append(fn)
            text += '\n# 1 "%s"\n' % FALLBACK_FILE + types + proto + "\n"
    model = HeaderModel(text)
    symbols, dropped = [], []
    for fn in lib.functions:
        sym = aliases.get(fn, fn)
        if sym in model.funcs:
            symbols.append(sym)
        else:
            dropped.append(fn)
    dropped += ["#define " + d for d in lib.defines if d not in macros]
    items = model.select(symbols, lib.types)
    cdef = model.emit(items)
    defines = dict(model.defines)
    const_fallback = []
    for cname, value in sorted(lib.constant_fallback.items()):
        if cname not in model.ev.consts and cname not in macros:
            defines[cname] = value
            const_fallback.append(cname)
    defines = sorted(defines.items())
    if defines:
        cdef += "".join("#define %s %d\n" % (n, v) for n, v in defines)
    versions = {}
    for vm in lib.version_macros:
        if vm in macros:
            versions[vm] = macros[vm].split("//")[0].strip()
        elif vm in model.ev.consts:
            v = model.ev.consts[vm]
            versions[vm] = "0x%x (%d.%d)" % (v, v >> 16, v & 0xFFFF)
    for h in lib.headers:
        with open(os.path.join(root, h), errors="replace") as f:
            m = re.search(r"@version\s+(\S+)", f.read(4096))
        if m:
            versions["%s @version" % h] = m.group(1)
        if lib.header_package:
            versions["%s package" % h] = header_package(root, h)
    files = sorted(f for f in model.files if not f.startswith("<"))
    prov = ["headers (relative to their include root): " + ", ".join(files)]
    # Whether crt/host_defines.h came from the root or from _STUB_AFTER_HEADERS is not
    # recorded: the output is the same either way, and the same headers from the toolkit
    # (which has crt/) and from a wheel (which has not) must generate the same module.
    prov += ["%s = %s" % kv for kv in sorted(versions.items())]
    if fallback_used:
        prov.append("not in these headers, declared from %s (optional): " % lib.fallback_source
                    + ", ".join(fallback_used))
    if const_fallback:
        prov.append("constants not in these headers, values from newer headers: " + ", ".join(const_fallback))
    return Generated(lib, cdef, prov, aliases, symbols, _struct_names(model, items), dropped, versions,
                     fallback_used)


def _py_tuple(items) -> str:
    if not items:
        return "()"
    return "(%s\n)" % "".join("\n    %r," % x for x in items)


def _py_dict(d) -> str:
    if not d:
        return "{}"
    return "{%s\n}" % "".join("\n    %r: %r," % kv for kv in sorted(d.items()))


def render(g: Generated) -> str:
    """Full text of the generated module."""
    lib = g.lib
    py = _cffi_py_source(lib.module, g.cdef)
    py = py.replace("# auto-generated file\n", "", 1)
    head = ['# GENERATED by tools/gen_bindings.py — do not edit.',
            '# Regenerate: python tools/gen_bindings.py   (check: python tools/gen_bindings.py --check)']
    head += ["# " + p for p in g.provenance]
    if g.dropped:
        head.append("# listed but not in the headers (not bound): " + ", ".join(g.dropped))
    key = lib.key or lib.name
    if lib.cuda_major is not None and key == "cudart":
        doc = ('"""cffi out-of-line ABI declarations for libcudart of CUDA %d (GENERATED, do not edit).\n\n'
               'Select it with ``accel._ffi.cudart_module(%d)``: use it with a libcudart of that major only\n'
               '(struct layouts and renamed symbols differ between majors).\n"""\n'
               % (lib.cuda_major[2], lib.cuda_major[2]))
    else:
        doc = ('"""cffi out-of-line ABI declarations for %s (GENERATED, do not edit).\n\n'
               'Open the library with ``accel._ffi.open_library(%r)`` -> ``(ffi, lib, path)``.\n"""\n'
               % (lib.name, key))
    tail = ["", "",
            "#: Library key for accel._ffi.open_library.",
            "LIBRARY = %r" % key,
            "#: Exported symbols declared here (after ALIASES), in list order.",
            "FUNCTIONS = " + _py_tuple(g.functions),
            "#: Public (macro) name -> exported symbol, for listed names the headers rename.",
            "ALIASES = " + _py_dict(g.aliases),
            "#: Symbols old libraries may lack; check with accel._ffi.has_symbol / missing_symbols.",
            "OPTIONAL_SYMBOLS = frozenset(%s)" % (repr(sorted(lib.optional)) if lib.optional else ""),
            "#: Optional functions the headers lacked, declared from newer vendor headers.",
            "SPEC_FALLBACK = " + _py_tuple(g.fallback),
            "#: Structs/unions declared with their full layout (checked against the C compiler in tests).",
            "STRUCTS = " + _py_tuple(g.structs),
            "#: Top-level headers (relative to their include root).",
            "HEADERS = %r" % (tuple(lib.headers),),
            "#: Version macros of the headers this was generated from.",
            "HEADER_VERSIONS = " + _py_dict(g.header_version or {}),
            "#: The declarations, as given to ffi.cdef (for inspection).",
            "CDEF = '''\\\n%s'''" % g.cdef,
            ""]
    return "\n".join(head) + "\n" + doc + py + "\n".join(tail)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="regenerate in memory; exit 1 with a diff summary if accel/_ffi differs")
    ap.add_argument("--only", default="", help="comma-separated library keys (default: all)")
    ap.add_argument("--out", default=OUT_DIR, help="output directory (default accel/_ffi)")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(LIBRARIES)
    status = 0
    for name in names:
        lib = LIBRARIES[name]
        path = os.path.join(args.out, lib.module + ".py")
        try:
            g = generate(lib)
        except FileNotFoundError as e:
            print("skip %s: %s" % (name, e))
            continue
        text = render(g)
        if g.dropped:
            print("%s: not in the headers, dropped: %s" % (name, ", ".join(g.dropped)))
        if lib.real_libraries:
            real = find_real_library(lib)
            if real is None:
                print("%s: no real library found to symbol-check against (skipped)" % name)
            else:
                required, optional = symbol_check(g, real)
                if required:
                    status = 1
                    print("%s: %s lacks declared non-optional functions: %s"
                          % (name, real, ", ".join(required)))
                else:
                    print("%s: every non-optional function is exported by %s%s" % (
                        name, real, "" if not optional else " (optional, absent: %s)" % ", ".join(optional)))
        if args.check:
            old = open(path).read() if os.path.exists(path) else ""
            if old != text:
                status = 1
                diff = list(difflib.unified_diff(old.splitlines(), text.splitlines(),
                                                 path, "regenerated", lineterm="", n=0))
                print("%s differs (%d diff lines):" % (path, len(diff)))
                print("\n".join(diff[:40]))
            else:
                print("%s up to date" % path)
        else:
            with open(path, "w") as f:
                f.write(text)
            print("wrote %s (%d functions, %d structs)" % (os.path.relpath(path, REPO), len(g.functions),
                                                          len(g.structs)))
    return status


if __name__ == "__main__":
    sys.exit(main())
