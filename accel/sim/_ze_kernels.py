"""Simulated Level Zero modules and kernels: zeModuleCreate (SPIR-V), build logs, zeKernelCreate,
group sizes, arguments and zeCommandListAppendLaunchKernel.

A module "build" reads the SPIR-V ``OpEntryPoint Kernel`` names (accel/_ptx.spirv_entries); a
launch runs the Python reference registered under the kernel's name
(:func:`accel.sim.register_kernel`), in command-list order, with the arguments decoded as the
reference's signature says.  Rules from ze_api.h (Level Zero specification 1.x), each cited where
it is checked; where the specification leaves a case undefined the simulator refuses it.
"""

from __future__ import annotations

import struct

from . import _memory, kernels
from .core import ffi
from .ze.commands import _Op, _append, _events
from .ze.common import _ready
from .ze.discovery import _GROUPS
from .ze.objects import _Obj
from .ze.virtual_memory import _vmm_range

_FORMATS = {"ptr": "<Q", "u32": "<I", "i32": "<i", "u64": "<Q", "i64": "<q", "f32": "<f", "f64": "<d"}


class _KObj(_Obj):
    """A module ("module"), kernel ("kernel") or build log ("buildlog") and its fields."""
    __slots__ = ("f",)

    def __init__(self, kind: str, **fields):
        super().__init__(kind)
        self.f = fields


def _get(rt, handle, kind: str):
    """(object, its fields) for a live handle of ``kind``, or (None, None)."""
    obj = rt.get(handle, kind)
    return (None, None) if obj is None else (obj, obj.f)


def zeModuleCreate(hContext, hDevice, desc, phModule, phBuildLog):
    rt, rc = _ready()
    if rc:
        return rc
    C = rt.C
    ctx, dev = rt.get(hContext, "context"), rt.get(hDevice, "device")
    if ctx is None or dev is None:
        return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if desc == ffi.NULL or phModule == ffi.NULL:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if desc.stype != C.ZE_STRUCTURE_TYPE_MODULE_DESC:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    log = ""
    if desc.format != C.ZE_MODULE_FORMAT_IL_SPIRV:
        # ZE_MODULE_FORMAT_NATIVE is a device binary of one driver; the simulator has none.
        rc, log = C.ZE_RESULT_ERROR_INVALID_NATIVE_BINARY, "accel.sim builds SPIR-V only (ZE_MODULE_FORMAT_IL_SPIRV)"
    elif desc.inputSize == 0 or desc.pInputModule == ffi.NULL:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER if desc.pInputModule == ffi.NULL else C.ZE_RESULT_ERROR_INVALID_SIZE
    else:
        data = bytes(ffi.buffer(ffi.cast("char *", desc.pInputModule), desc.inputSize))
        from .._ptx import spirv_entries
        try:
            names = spirv_entries(data)
            rc = 0 if names else C.ZE_RESULT_ERROR_MODULE_BUILD_FAILURE
            if not names:
                log = "error: the SPIR-V module has no OpEntryPoint Kernel"
        except ValueError as exc:
            # ze_api.h, zeModuleCreate: ZE_RESULT_ERROR_MODULE_BUILD_FAILURE, the log says why.
            rc, log = C.ZE_RESULT_ERROR_MODULE_BUILD_FAILURE, f"error: {exc}"
    if phBuildLog != ffi.NULL:
        # "phBuildLog: [out][optional] pointer to handle of module's build log."
        log_obj = rt._add(_KObj("buildlog", text=log))
        phBuildLog[0] = log_obj.key
    if rc:
        return rc
    mod = rt._add(_KObj("module", names=frozenset(names), device=dev, ctx=ctx, kernels=0))
    phModule[0] = mod.key
    return 0


def zeModuleBuildLogGetString(hModuleBuildLog, pSize, pBuildLog):
    rt, rc = _ready()
    if rc:
        return rc
    obj, f = _get(rt, hModuleBuildLog, "buildlog")
    if obj is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if pSize == ffi.NULL:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    raw = f["text"].encode() + b"\0"
    # "pSize: [in,out] size of build log string"; with pBuildLog NULL only the size is returned.
    if pBuildLog == ffi.NULL:
        pSize[0] = len(raw)
        return 0
    if pSize[0] < len(raw):
        return rt.C.ZE_RESULT_ERROR_INVALID_SIZE
    ffi.memmove(pBuildLog, raw, len(raw))
    return 0


def zeModuleBuildLogDestroy(hModuleBuildLog):
    rt, rc = _ready()
    if rc:
        return rc
    obj, _f = _get(rt, hModuleBuildLog, "buildlog")
    if obj is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    rt._forget(obj)
    return 0


def zeModuleDestroy(hModule):
    rt, rc = _ready()
    if rc:
        return rc
    obj, f = _get(rt, hModule, "module")
    if obj is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    # ze_api.h, zeModuleDestroy: "The application must destroy all kernel handles created from the
    # module before destroying the module itself."
    if f["kernels"]:
        return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    rt._forget(obj)
    return 0


def zeKernelCreate(hModule, desc, phKernel):
    rt, rc = _ready()
    if rc:
        return rc
    C = rt.C
    mod, f = _get(rt, hModule, "module")
    if mod is None:
        return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if desc == ffi.NULL or phKernel == ffi.NULL or desc.pKernelName == ffi.NULL:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if desc.stype != C.ZE_STRUCTURE_TYPE_KERNEL_DESC:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    name = ffi.string(desc.pKernelName).decode("utf-8", "replace")
    if name not in f["names"]:
        return C.ZE_RESULT_ERROR_INVALID_KERNEL_NAME
    with rt.lock:
        f["kernels"] += 1
    k = rt._add(_KObj("kernel", name=name, module=mod, mfields=f, group=None, args={}, refs=0))
    phKernel[0] = k.key
    return 0


def zeKernelDestroy(hKernel):
    rt, rc = _ready()
    if rc:
        return rc
    obj, f = _get(rt, hKernel, "kernel")
    if obj is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    with rt.lock:
        # ze_api.h, zeKernelDestroy: "The application is responsible for making sure the device is
        # not currently referencing the kernel before it is deleted": a launch submitted and not
        # yet run is refused (HANDLE_OBJECT_IN_USE, as zeEventDestroy of a referenced event).
        if f["refs"]:
            return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
        f["mfields"]["kernels"] -= 1
        rt._forget(obj)
    return 0


def zeKernelSetGroupSize(hKernel, groupSizeX, groupSizeY, groupSizeZ):
    rt, rc = _ready()
    if rc:
        return rc
    obj, f = _get(rt, hKernel, "kernel")
    if obj is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    size = (groupSizeX, groupSizeY, groupSizeZ)
    # ze_api.h: ZE_RESULT_ERROR_INVALID_GROUP_SIZE_DIMENSION for a size the device does not
    # support (ze_device_compute_properties_t: maxGroupSize{X,Y,Z}, maxTotalGroupSize; the
    # simulated device reports 1024 for each).
    if min(size) < 1 or max(size) > 1024 or size[0] * size[1] * size[2] > 1024:
        return rt.C.ZE_RESULT_ERROR_INVALID_GROUP_SIZE_DIMENSION
    f["group"] = size
    return 0


def zeKernelSetArgumentValue(hKernel, argIndex, argSize, pArgValue):
    rt, rc = _ready()
    if rc:
        return rc
    obj, f = _get(rt, hKernel, "kernel")
    if obj is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    ref = kernels.lookup(f["name"])
    if ref is not None:
        # ze_api.h, zeKernelSetArgumentValue: ZE_RESULT_ERROR_INVALID_KERNEL_ARGUMENT_INDEX /
        # _SIZE.  The kernel's parameters are the registered reference's (the SPIR-V types are
        # not read).
        if argIndex >= len(ref.argtypes):
            return rt.C.ZE_RESULT_ERROR_INVALID_KERNEL_ARGUMENT_INDEX
        if argSize != struct.calcsize(_FORMATS[ref.argtypes[argIndex]]):
            return rt.C.ZE_RESULT_ERROR_INVALID_KERNEL_ARGUMENT_SIZE
    if pArgValue == ffi.NULL:
        f["args"][argIndex] = b"\0" * argSize    # "pArgValue: [in][optional]": a null pointer argument
    else:
        f["args"][argIndex] = bytes(ffi.buffer(ffi.cast("char *", pArgValue), argSize))
    return 0


def zeCommandListAppendLaunchKernel(hCommandList, hKernel, pLaunchFuncArgs, hSignalEvent, numWaitEvents,
                                    phWaitEvents):
    rt, rc = _ready()
    if rc:
        return rc
    C = rt.C
    obj, f = _get(rt, hKernel, "kernel")
    cl = rt.get(hCommandList, "cmdlist")
    if obj is None or cl is None:
        return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if pLaunchFuncArgs == ffi.NULL:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    got = _events(rt, hSignalEvent, numWaitEvents, phWaitEvents)
    if isinstance(got, int):
        return got
    sig, waits = got
    mfields = f["mfields"]
    # A module is built for one device in one context (zeModuleCreate's hContext, hDevice): its
    # kernels run on command lists of that device and context only.
    if cl.ctx is not mfields["ctx"] or cl.device is not mfields["device"]:
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if _GROUPS[cl.ordinal][0] != "compute":
        # ze_api.h, zeCommandListAppendLaunchKernel: "may **only** be called for a command list
        # created with command queue group ordinal that supports compute"
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    grid = (pLaunchFuncArgs.groupCountX, pLaunchFuncArgs.groupCountY, pLaunchFuncArgs.groupCountZ)
    if min(grid) < 1:
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    block = f["group"]
    if block is None:
        # The specification gives no default group size to rely on: the simulator refuses.
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    ref = kernels.lookup(f["name"])
    if ref is None:
        # No Python reference registered (accel.sim.register_kernel): nothing to run.
        return C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE
    values, memory = [], []
    for i, t in enumerate(ref.argtypes):
        raw = f["args"].get(i)
        if raw is None:     # an argument never set: undefined behaviour, refused
            return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
        values.append(struct.unpack(_FORMATS[t], raw)[0])
        a = rt.memory.find(values[-1]) if t == "ptr" and values[-1] else None
        if a is not None and a not in memory:
            # A pointer argument into a USM allocation: _append checks its context ("must only
            # use the memory allocation for the context ... which was provided during
            # allocation"), and the launch references it until it ran (zeMemFree).
            memory.append(a)
    fn, view = ref.fn, _kernel_view(rt)

    def run():
        fn(grid, block, view, *values)
    return _append(rt, hCommandList, _Op(run, waits, sig, label=f"kernel {f['name']} grid{grid}", kernel=obj),
                   memory)


def _kernel_view(rt):
    """``kernels.view`` as a kernel sees memory.  Virtual memory (zeVirtualMemMap) is reachable
    where every byte is mapped with access for the context (zeVirtualMemSetAccessAttribute), a
    range spanning several mappings being contiguous, as on the device; any other address is a
    USM allocation, checked by ``kernels.view``.  A fault raises MemoryRangeError (the device is
    lost, as for a kernel out of range)."""
    if not rt.vmm.reservations:
        return kernels.view

    def view(ptr, nbytes, dtype=None):
        addr = _memory.addr_of(ptr)
        region = _vmm_range(rt, addr, nbytes, True)
        if region is None:
            return kernels.view(addr, nbytes, dtype)
        if region.__class__ is str:
            raise kernels.MemoryRangeError(f"a kernel touched {region}")
        return kernels.view_checked_range(addr, nbytes, dtype)
    return view


FUNCTIONS = (zeModuleCreate, zeModuleBuildLogGetString, zeModuleBuildLogDestroy, zeModuleDestroy,
             zeKernelCreate, zeKernelDestroy, zeKernelSetGroupSize, zeKernelSetArgumentValue,
             zeCommandListAppendLaunchKernel)
