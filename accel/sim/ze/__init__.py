"""Simulated Level Zero loader (``libze_loader``: core ``ze*`` and Sysman ``zes*``).

``ACCEL_SIM=xpu`` makes :mod:`accel.backends.xpu` use :func:`open_ze` instead
of the real loader.  The backend calls the same functions with the same cffi
arguments (descriptor structs and out-pointers made with the generated
``accel._ffi._ze`` FFI) and gets the same ``ze_result_t`` codes, so the code
above the library is the code that runs on an Intel GPU.

What is simulated, and how faithfully:

* **Driver and devices.** One GPU driver with ``ACCEL_SIM_DEVICES`` cards of
  ``tiles`` tiles each.  ``zeInit`` reads ``ZE_FLAT_DEVICE_HIERARCHY`` and
  ``ZE_AFFINITY_MASK`` as Intel's driver does (its own implementation, kept
  independent of the backend's so tests cross-check the two); no card, or
  ``configure(driver=False)``, makes ``zeInit`` fail with
  ``ZE_RESULT_ERROR_UNINITIALIZED`` like a loader with no driver.  Every core
  call before ``zeInit`` returns that code too.  ``runtime_initialized`` in
  :func:`state` tells whether ``zeInit`` succeeded.
* **Sysman.** ``zesInit``/``zesDriverGet``/``zesDeviceGet`` list whole cards
  and ignore the two variables, as the real Sysman does.  Core device handles
  also work as Sysman handles when ``ZES_ENABLE_SYSMAN=1`` was set at
  ``zeInit`` (the legacy mode the 1.8.12 loader needs).  Each card has one
  HBM module per tile (``onSubdevice`` when it has several) and one system
  memory module, with free bytes tracking allocations.  Engine activity,
  memory bandwidth and energy are counters driven by the simulated work
  (:mod:`accel.sim._ze_counters`).
* **Loader version.** ``configure_ze(loader="1.8.12")`` (or
  ``ACCEL_SIM_ZE_LOADER=1.8.12``) removes ``zesInit``, ``zesDriverGet``,
  ``zesDeviceGet``, ``zeInitDrivers`` and ``zeCommandListHostSynchronize``,
  which that loader lacks.
* **Memory.** USM device and host allocations are host buffers at real
  addresses (:mod:`accel.sim._memory`).  Copies and fills accept USM pointers
  only: pageable host memory is rejected (strict, so a backend that forgets
  to stage it is caught).  Using freed memory in queued work faults the
  device (``ZE_RESULT_ERROR_DEVICE_LOST`` from then on).
* **Command lists.** Immediate lists are in-order queues of the shared
  engine (:mod:`accel.sim._engine`), with ``ACCEL_SIM_DELAY_US`` latency per
  operation.  Regular lists record operations; ``zeCommandQueueExecuteCommandLists``
  replays them on the queue's worker, and refuses a list the device still
  references (the spec forbids resubmitting it before it completes).
* **Events.** Each event counts the signals submitted for it and remembers
  how many had been submitted at its latest reset; a wait is satisfied by
  the first signal submitted after the reset that precedes it, so waits,
  signals and resets keep their order exactly as in-order lists execute them,
  without blocking a host thread.  Kernel timestamps use a ``timer_hz`` clock
  masked to ``timestamp_bits`` (``timestamp_start`` sets its initial value,
  to test wrap-around); ``timerResolution`` is nanoseconds per tick for
  ``ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES`` and ticks per second for
  ``..._1_2``, as the spec says.

The package, one concern a module: ``objects`` (settings, the objects behind handles, the
runtime, reset and fork, :func:`state`), ``common`` (initialization check, out-pointers,
visible devices), ``discovery``, ``memory``, ``events``, ``virtual_memory``, ``commands``
(command lists and queues), ``sysman``; modules, kernels and launches are ``.._ze_kernels``.
This module builds the library object.
"""

from __future__ import annotations

import threading

from .. import core
from . import objects
from .objects import ZeConfig, configure_ze, export_config, import_config, reset, _runtime, state, ze_config
from .discovery import (
    zeDeviceCanAccessPeer, zeDeviceGet, zeDeviceGetCommandQueueGroupProperties,
    zeDeviceGetComputeProperties, zeDeviceGetGlobalTimestamps, zeDeviceGetMemoryProperties,
    zeDeviceGetModuleProperties, zeDeviceGetProperties, zeDeviceGetSubDevices, zeDriverGet,
    zeDriverGetApiVersion, zeDriverGetProperties, zeInit, zesDeviceGet, zesDriverGet, zesInit,
)
from .memory import (
    zeContextCreate, zeContextDestroy, zeMemAllocDevice, zeMemAllocHost, zeMemFree,
    zeMemGetAllocProperties,
)
from .events import (
    zeEventCreate, zeEventDestroy, zeEventHostReset, zeEventHostSignal, zeEventHostSynchronize,
    zeEventPoolCreate, zeEventPoolDestroy, zeEventQueryKernelTimestamp, zeEventQueryStatus,
)
from .virtual_memory import (
    zePhysicalMemCreate, zePhysicalMemDestroy, zeVirtualMemFree, zeVirtualMemGetAccessAttribute,
    zeVirtualMemMap, zeVirtualMemQueryPageSize, zeVirtualMemReserve, zeVirtualMemSetAccessAttribute,
    zeVirtualMemUnmap,
)
from .commands import (
    zeCommandListAppendBarrier, zeCommandListAppendEventReset, zeCommandListAppendMemoryCopy,
    zeCommandListAppendMemoryFill, zeCommandListAppendSignalEvent, zeCommandListAppendWaitOnEvents,
    zeCommandListClose, zeCommandListCreate, zeCommandListCreateImmediate, zeCommandListDestroy,
    zeCommandListHostSynchronize, zeCommandListReset, zeCommandQueueCreate, zeCommandQueueDestroy,
    zeCommandQueueExecuteCommandLists, zeCommandQueueSynchronize,
)
from .sysman import (
    zesDeviceEnumEngineGroups, zesDeviceEnumFrequencyDomains, zesDeviceEnumMemoryModules,
    zesDeviceEnumPowerDomains, zesDeviceEnumTemperatureSensors, zesDeviceGetCardPowerDomain,
    zesDeviceGetProperties, zesDeviceProcessesGetState, zesEngineGetActivity, zesEngineGetProperties,
    zesFrequencyGetProperties, zesFrequencyGetState, zesMemoryGetBandwidth, zesMemoryGetProperties,
    zesMemoryGetState, zesPowerGetEnergyCounter, zesPowerGetProperties, zesTemperatureGetProperties,
    zesTemperatureGetState,
)


__all__ = ["ZeConfig", "open_ze", "open_library", "configure_ze", "ze_config", "state", "reset",
           "export_config", "import_config"]


def __getattr__(name: str):
    # The runtime object is made by zeInit and dropped by a reset: read it live.
    if name == "_rt":
        return objects._rt
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- the library object ---------------------------------------------------------------------------------

#: Functions Debian's libze_loader 1.8.12 does not export.
NEW_LOADER_ONLY = ("zesInit", "zesDriverGet", "zesDeviceGet", "zeInitDrivers", "zeCommandListHostSynchronize")

_FUNCTIONS = (
    zeInit, zeDriverGet, zeDriverGetApiVersion, zeDriverGetProperties, zeDeviceGet, zeDeviceGetSubDevices,
    zeDeviceGetProperties, zeDeviceGetComputeProperties, zeDeviceGetModuleProperties,
    zeDeviceGetMemoryProperties, zeDeviceGetCommandQueueGroupProperties, zeDeviceGetGlobalTimestamps,
    zeContextCreate, zeContextDestroy, zeMemAllocDevice, zeMemAllocHost, zeMemFree, zeMemGetAllocProperties,
    zeEventPoolCreate, zeEventPoolDestroy, zeEventCreate, zeEventDestroy, zeEventHostSignal, zeEventHostReset,
    zeEventQueryStatus, zeEventHostSynchronize, zeEventQueryKernelTimestamp,
    zeCommandListCreateImmediate, zeCommandListCreate, zeCommandListDestroy, zeCommandListClose,
    zeCommandListReset, zeCommandListAppendMemoryCopy, zeCommandListAppendMemoryFill,
    zeCommandListAppendSignalEvent, zeCommandListAppendWaitOnEvents, zeCommandListAppendEventReset,
    zeCommandListAppendBarrier, zeCommandListHostSynchronize,
    zeCommandQueueCreate, zeCommandQueueDestroy, zeCommandQueueExecuteCommandLists, zeCommandQueueSynchronize,
    zesInit, zesDriverGet, zesDeviceGet, zesDeviceGetProperties, zesDeviceEnumMemoryModules,
    zesMemoryGetProperties, zesMemoryGetState,
    zeDeviceCanAccessPeer, zesDeviceEnumTemperatureSensors, zesTemperatureGetProperties, zesTemperatureGetState,
    zesDeviceEnumFrequencyDomains, zesFrequencyGetProperties, zesFrequencyGetState, zesDeviceProcessesGetState,
    zesDeviceEnumEngineGroups, zesEngineGetProperties, zesEngineGetActivity, zesMemoryGetBandwidth,
    zesDeviceEnumPowerDomains, zesDeviceGetCardPowerDomain, zesPowerGetProperties, zesPowerGetEnergyCounter,
    zeVirtualMemQueryPageSize, zeVirtualMemReserve, zeVirtualMemFree, zePhysicalMemCreate, zePhysicalMemDestroy,
    zeVirtualMemMap, zeVirtualMemUnmap, zeVirtualMemSetAccessAttribute, zeVirtualMemGetAccessAttribute,
)
from .._ze_kernels import FUNCTIONS as _KERNEL_FUNCTIONS   # noqa: E402 (modules, kernels, launches; issue 18)
_FUNCTIONS += _KERNEL_FUNCTIONS

#: ze_api.h: "The application must **not** call this function from simultaneous threads with the
#: same command list handle" (zeCommandListAppend*, Close, Reset, Destroy) / "... with the same
#: kernel handle" (zeKernelSetArgumentValue, zeKernelSetGroupSize) / "... with the same context
#: handle" (zeContextDestroy): function -> handle kind.
_ONE_THREAD = {name: "cmdlist" for name in (
    "zeCommandListAppendMemoryCopy", "zeCommandListAppendMemoryFill", "zeCommandListAppendSignalEvent",
    "zeCommandListAppendWaitOnEvents", "zeCommandListAppendEventReset", "zeCommandListAppendBarrier",
    "zeCommandListAppendLaunchKernel", "zeCommandListClose", "zeCommandListReset", "zeCommandListDestroy")}
_ONE_THREAD.update(zeKernelSetArgumentValue="kernel", zeKernelSetGroupSize="kernel")
# zeContextDestroy: "The application must **not** call this function from simultaneous threads
# with the same context handle" (the second destroyed the context under the first).
_ONE_THREAD.update(zeContextDestroy="context")
# (r70h) The same words in ze_api.h for zeEventCreate and zeEventPoolDestroy ("... with the same
# event pool handle"), zeEventDestroy ("event"), zeCommandQueueDestroy ("command queue"),
# zeKernelDestroy ("kernel": one claim with zeKernelSetArgumentValue/SetGroupSize), zeModuleDestroy
# ("module") and zeModuleBuildLogDestroy ("build log"): the simulator let two threads in at once
# (two zeEventCreate calls on one pool raced for its slots; a destroy ran under another thread's
# call on the handle).  The second is refused, HANDLE_OBJECT_IN_USE, as above.
_ONE_THREAD.update(zeEventCreate="eventpool", zeEventPoolDestroy="eventpool", zeEventDestroy="event",
                   zeCommandQueueDestroy="cmdqueue", zeKernelDestroy="kernel", zeModuleDestroy="module",
                   zeModuleBuildLogDestroy="buildlog")


def _claim(handle, kind: str):
    """(object, 0) when the calling thread now holds ``handle`` (release with :func:`_release`);
    (None, 0) to call freely (no such live handle: the function says so; or this thread is
    already inside a call on it -- a command run inline signals and its waiter destroys);
    (None, HANDLE_OBJECT_IN_USE) while another thread is inside a call on it (the documents
    name no code; the call is refused and changes nothing)."""
    rt = objects._rt
    obj = rt.get(handle, kind) if rt is not None else None
    if obj is None:
        return None, 0
    busy, me = rt.busy, threading.get_ident()
    if busy.get(obj) == me:
        return None, 0
    if busy.setdefault(obj, me) != me:   # atomic: one thread gets the handle
        return None, rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    return obj, 0


def _release(obj) -> None:
    rt = objects._rt
    if rt is not None:
        rt.busy.pop(obj, None)            # bounded by the calls in progress


_ONE_THREAD_BODY = """\
        obj, rc = _claim(a0, _kind)
        if rc:
            return rc
        if obj is None:
            return _fn({args})
        try:
            return _fn({args})
        finally:
            _release(obj)
"""


def _one_thread(fn, kind: str):
    """``fn`` (first parameter: a ``kind`` handle) refusing a second thread meanwhile (_ONE_THREAD)."""
    return core.exact_wrapper(fn.__name__, fn, _ONE_THREAD_BODY, globals(), _fn=fn, _kind=kind)


def open_ze():
    """The simulated ``libze_loader``: an object called like the cffi ``lib`` of the real one.

    Raises OSError when ``configure(cudart=...)``-style switches say the library is
    absent (never, today: the loader is always "installed"; no driver is
    ``configure(driver=False)`` or ``ACCEL_SIM_DEVICES=0``).
    """
    zcfg = ze_config()
    _runtime()
    funcs = {f.__name__: (_one_thread(f, _ONE_THREAD[f.__name__]) if f.__name__ in _ONE_THREAD else f)
             for f in _FUNCTIONS}
    if zcfg.loader == "1.8.12":
        for name in NEW_LOADER_ONLY:
            funcs.pop(name, None)
    return core.build_library("ze", funcs, constants=core.constants_of("_ze"))


open_library = open_ze
