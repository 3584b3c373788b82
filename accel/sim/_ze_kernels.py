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

from . import _memory, core, kernels
from .core import ffi
from .ze.commands import _Op, _append, _events, _inaccessible
from .ze.common import _ready, _struct_code
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


def _ready_fields(handle, kind: str):
    """(runtime, object, its fields, 0), or (None, None, None, code): _ready, then _get
    (ZE_RESULT_ERROR_INVALID_NULL_HANDLE for no live handle of ``kind``)."""
    rt, rc = _ready()
    if rc:
        return None, None, None, rc
    obj, f = _get(rt, handle, kind)
    if obj is None:
        return None, None, None, rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    return rt, obj, f, 0


#: ze_device_module_properties_t.spirvVersionSupported of the simulated devices (ze/discovery.py).
_SPIRV_VERSION_SUPPORTED = (1, 2)
_OP_CAPABILITY, _OP_ENTRY_POINT, _EXECUTION_MODEL_KERNEL, _CAPABILITY_FLOAT64 = 17, 15, 6, 10
_OP_EXECUTION_MODE, _MODE_LOCAL_SIZE = 16, 17


def _spirv_kernels(data: bytes, fp64: bool):
    """(the ``OpEntryPoint Kernel`` names of a SPIR-V module, {name: required group size}), read
    as a driver must before it builds: ValueError (a build failure, its text the build log) for
    what is no valid module.  ``OpExecutionMode %f LocalSize x y z`` (OpenCL C's
    ``reqd_work_group_size``) is the kernel's required group size (ze_kernel_properties_t:
    requiredGroupSizeX/Y/Z, "required group size ... or zero if there is no required group size").

    SPIR-V specification 2.3, "Physical Layout of a SPIR-V Module and Instruction": a module is
    a stream of 32-bit words, the first five the header (magic; version "0 | Major Number |
    Minor Number | 0"; generator; bound, "all <id>s in this module are guaranteed to satisfy
    0 < id < Bound"; schema), then instructions whose first word holds the "WordCount: the
    complete number of words taken by an instruction" (so at least 1, and inside the module).
    3.x OpEntryPoint: the Name is a literal string (2.2.1: "nul-terminated"), and "A module must
    not have two OpEntryPoint instructions with the same Execution Model and the same Name
    string."  Level Zero SPIR-V Programming Guide, "Supported SPIR-V Versions": "The maximum
    SPIR-V version supported by a device is described by
    ze_device_module_properties_t.spirvVersionSupported"; the Float64 capability needs a device
    whose module properties have ZE_DEVICE_MODULE_FLAG_FP64 (double precision is optional)."""
    if len(data) < 20 or len(data) % 4:
        raise ValueError(f"not a SPIR-V module: {len(data)} bytes (a module is a header of 5 words and whole "
                         f"32-bit words)")
    for order in "<>":
        if struct.unpack_from(order + "I", data, 0)[0] == 0x07230203:
            break
    else:
        raise ValueError(f"not a SPIR-V module: magic {data[:4].hex()} (expected 0x07230203)")
    words = struct.unpack(f"{order}{len(data) // 4}I", data)
    version, bound = words[1], words[3]
    major, minor = (version >> 16) & 0xFF, (version >> 8) & 0xFF
    if version & 0xFF0000FF or major != 1:
        raise ValueError(f"SPIR-V version word {version:#010x} is no SPIR-V version (0 | major | minor | 0)")
    if (major, minor) > _SPIRV_VERSION_SUPPORTED:
        raise ValueError(f"SPIR-V {major}.{minor} is above the device's spirvVersionSupported "
                         f"{_SPIRV_VERSION_SUPPORTED[0]}.{_SPIRV_VERSION_SUPPORTED[1]}")
    names, ids, local, pos = [], {}, {}, 5
    while pos < len(words):
        count, op = words[pos] >> 16, words[pos] & 0xFFFF
        if count == 0:
            raise ValueError(f"instruction of 0 words at word {pos}")
        if pos + count > len(words):
            raise ValueError(f"instruction at word {pos} (opcode {op}) has {count} words but the module ends "
                             f"after {len(words) - pos}: the module is truncated")
        if op == _OP_CAPABILITY and count == 2 and words[pos + 1] == _CAPABILITY_FLOAT64 and not fp64:
            raise ValueError("the module declares OpCapability Float64 but the device does not support "
                             "64-bit floating point (ze_device_module_properties_t.flags lacks "
                             "ZE_DEVICE_MODULE_FLAG_FP64)")
        if op == _OP_ENTRY_POINT:
            if count < 4:
                raise ValueError(f"OpEntryPoint at word {pos} has {count} words, too few for its execution "
                                 f"model, function <id> and name")
            if not 0 < words[pos + 2] < bound:
                raise ValueError(f"OpEntryPoint at word {pos} names <id> {words[pos + 2]}, outside the "
                                 f"header's bound {bound}")
            raw = struct.pack(f"<{count - 3}I", *words[pos + 3:pos + count])
            if b"\0" not in raw:
                raise ValueError(f"OpEntryPoint at word {pos}: its name is not nul-terminated")
            if words[pos + 1] == _EXECUTION_MODEL_KERNEL:
                name = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
                if name in names:
                    raise ValueError(f"two OpEntryPoint Kernel instructions are named {name!r}")
                names.append(name)
                ids[words[pos + 2]] = name
        if op == _OP_EXECUTION_MODE and count == 6 and words[pos + 2] == _MODE_LOCAL_SIZE:
            size = tuple(words[pos + 3:pos + 6])
            if min(size) < 1 or max(size) > 1024 or size[0] * size[1] * size[2] > 1024:
                raise ValueError(f"LocalSize {size} of <id> {words[pos + 1]} is beyond the device's group "
                                 f"limits (maxGroupSizeX/Y/Z and maxTotalGroupSize 1024)")
            local[words[pos + 1]] = size
        pos += count
    return names, {ids[i]: size for i, size in local.items() if i in ids}


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
    # an extension structure (ze/memory.py, _no_extension: ze_module_program_exp_desc_t links
    # several inputs): not simulated, refused
    rc = _struct_code(C, desc, "ZE_STRUCTURE_TYPE_MODULE_DESC")
    if rc:
        return rc
    if desc.format > C.ZE_MODULE_FORMAT_NATIVE:
        # (r70h) ze_api.h, zeModuleCreate @returns: ZE_RESULT_ERROR_INVALID_ENUMERATION for
        # "ZE_MODULE_FORMAT_NATIVE < desc->format" (the simulator answered INVALID_NATIVE_BINARY)
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    log = ""
    if desc.format != C.ZE_MODULE_FORMAT_IL_SPIRV:
        # ZE_MODULE_FORMAT_NATIVE is a device binary of one driver; the simulator has none.
        rc, log = C.ZE_RESULT_ERROR_INVALID_NATIVE_BINARY, "accel.sim builds SPIR-V only (ZE_MODULE_FORMAT_IL_SPIRV)"
    elif desc.inputSize == 0 or desc.pInputModule == ffi.NULL:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER if desc.pInputModule == ffi.NULL else C.ZE_RESULT_ERROR_INVALID_SIZE
    elif desc.pConstants != ffi.NULL and desc.pConstants.numConstants == 0:
        # ze_module_desc_t.pConstants: "This must be set to nullptr if no specialization constants
        # are provided" (no code named: INVALID_ARGUMENT)
        rc, log = C.ZE_RESULT_ERROR_INVALID_ARGUMENT, "error: pConstants with no constant (pass NULL instead)"
    elif desc.pConstants != ffi.NULL:
        # The SPIR-V SpecId decorations are not read, so overridden constants would be ignored
        # and the reference kernel run as if they were not: not simulated, refused.
        rc, log = (C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE,
                   "error: accel.sim does not simulate SPIR-V specialization constants (pConstants)")
    elif _bad_build_option(desc.pBuildFlags):
        rc, log = C.ZE_RESULT_ERROR_MODULE_BUILD_FAILURE, f"error: {_bad_build_option(desc.pBuildFlags)}"
    else:
        data = bytes(ffi.buffer(ffi.cast("char *", desc.pInputModule), desc.inputSize))
        try:
            names, required = _spirv_kernels(data, rt.zcfg.fp64)
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
    mod = rt._add(_KObj("module", names=frozenset(names), required=required, device=dev, ctx=ctx, kernels=0))
    phModule[0] = mod.key
    return 0


#: PROG.rst, "Module Build Options" (and ze_module_desc_t.pBuildFlags: "Following options are
#: supported"): the options a module build takes.  "-ze-opt-level" takes one of the levels listed
#: there (0, 1, 2), as "-ze-opt-level=N" (the form Intel's SYCL runtime passes) or as the next word.
_BUILD_OPTIONS = frozenset(("-ze-opt-disable", "-ze-opt-greater-than-4GB-buffer-required",
                            "-ze-opt-large-register-file", "-ze-opt-has-buffer-offset-arg", "-g"))
_OPT_LEVELS = ("0", "1", "2")


def _bad_build_option(flags) -> str:
    """Why ``pBuildFlags`` is refused, or "" (NULL or only documented options).  Any other option
    is outside what the specification documents: a driver's compiler may take more (or reject
    them), so the simulator refuses it, as MODULE_BUILD_FAILURE with the reason in the build log
    (the simulator ignored the flags whatever they said)."""
    if flags == ffi.NULL:
        return ""
    words = ffi.string(flags).decode("utf-8", "replace").split()
    i = 0
    while i < len(words):
        w = words[i]
        if w == "-ze-opt-level":
            if i + 1 >= len(words) or words[i + 1] not in _OPT_LEVELS:
                return "-ze-opt-level needs a level of 0, 1 or 2"
            i += 2
            continue
        if w.startswith("-ze-opt-level="):
            if w.partition("=")[2] not in _OPT_LEVELS:
                return f"{w}: the levels are 0, 1 and 2"
        elif w not in _BUILD_OPTIONS:
            return (f"unknown build option {w!r} (Level Zero documents -ze-opt-disable, -ze-opt-level, "
                    f"-ze-opt-greater-than-4GB-buffer-required, -ze-opt-large-register-file, "
                    f"-ze-opt-has-buffer-offset-arg and -g)")
        i += 1
    return ""


def zeModuleBuildLogGetString(hModuleBuildLog, pSize, pBuildLog):
    rt, obj, f, rc = _ready_fields(hModuleBuildLog, "buildlog")
    if rc:
        return rc
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
    rt, obj, _f, rc = _ready_fields(hModuleBuildLog, "buildlog")
    if rc:
        return rc
    rt._forget(obj)
    return 0


def zeModuleDestroy(hModule):
    rt, obj, f, rc = _ready_fields(hModule, "module")
    if rc:
        return rc
    # ze_api.h, zeModuleDestroy: "The application must destroy all kernel handles created from the
    # module before destroying the module itself."
    if f["kernels"]:
        return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    rt._forget(obj)
    return 0


def zeKernelCreate(hModule, desc, phKernel):
    rt, mod, f, rc = _ready_fields(hModule, "module")
    if rc:
        return rc
    C = rt.C
    if desc == ffi.NULL or phKernel == ffi.NULL or desc.pKernelName == ffi.NULL:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    rc = _struct_code(C, desc, "ZE_STRUCTURE_TYPE_KERNEL_DESC")   # an extension structure: ze/memory.py, _no_extension
    if rc:
        return rc
    if desc.flags > 0x3:
        # ze_api.h, zeKernelCreate @returns: ZE_RESULT_ERROR_INVALID_ENUMERATION for
        # `0x3 < desc->flags` (ze_kernel_flag_t has FORCE_RESIDENCY 0x1, EXPLICIT_RESIDENCY 0x2)
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
    rt, obj, f, rc = _ready_fields(hKernel, "kernel")
    if rc:
        return rc
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
    rt, obj, f, rc = _ready_fields(hKernel, "kernel")
    if rc:
        return rc
    size = (groupSizeX, groupSizeY, groupSizeZ)
    # ze_api.h: ZE_RESULT_ERROR_INVALID_GROUP_SIZE_DIMENSION for a size the device does not
    # support (ze_device_compute_properties_t: maxGroupSize{X,Y,Z}, maxTotalGroupSize; the
    # simulated device reports 1024 for each).
    if min(size) < 1 or max(size) > 1024 or size[0] * size[1] * size[2] > 1024:
        return rt.C.ZE_RESULT_ERROR_INVALID_GROUP_SIZE_DIMENSION
    required = f["mfields"]["required"].get(f["name"])
    if required is not None and size != required:
        # A kernel with OpExecutionMode LocalSize (reqd_work_group_size) runs only with that group
        # size (ze_kernel_properties_t.requiredGroupSizeX/Y/Z: "required group size"): another
        # size is refused, as a size the device does not support.
        return rt.C.ZE_RESULT_ERROR_INVALID_GROUP_SIZE_DIMENSION
    f["group"] = size
    return 0


def zeKernelSetArgumentValue(hKernel, argIndex, argSize, pArgValue):
    rt, obj, f, rc = _ready_fields(hKernel, "kernel")
    if rc:
        return rc
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
    fn, view = ref.fn, _kernel_view(rt, cl.device)
    op = _Op(None, waits, sig, label=f"kernel {f['name']} grid{grid}", kernel=obj)

    def run():
        rec = op.rec
        if rec is None:
            fn(grid, block, view, *values)
        else:
            _run_recording(rec, fn, grid, block, view, values)
    op.fn = run
    return _append(rt, hCommandList, op, memory)


def _run_recording(rec, fn, grid, block, view, values) -> None:
    """(r69f) Run a launch appended to a command list without IN_ORDER, recording what it touched
    for that list's ordering rules (ze/commands.py, "lists without IN_ORDER"): the ranges its
    reference viewed are its reads, the bytes among them it changed its writes (a byte rewritten
    with its old value is not seen: the reference's reads and writes cannot be told apart else)."""
    import numpy as np
    seen = []

    def recording_view(ptr, nbytes, dtype=None):
        out = view(ptr, nbytes, dtype)
        addr = _memory.addr_of(ptr)
        seen.append((addr, nbytes, ffi.buffer(_memory.char_ptr(addr), nbytes)[:]))
        return out
    rec.reads = rec.writes = ()
    try:
        fn(grid, block, recording_view, *values)
    finally:
        reads, writes = [], []
        for addr, nbytes, old in seen:
            if not nbytes:
                continue
            reads.append((addr, addr + nbytes))
            new = ffi.buffer(_memory.char_ptr(addr), nbytes)[:]
            if new != old:
                changed = np.flatnonzero(np.frombuffer(new, np.uint8) != np.frombuffer(old, np.uint8))
                writes.append((addr + int(changed[0]), addr + int(changed[-1]) + 1))
        rec.reads, rec.writes = tuple(reads), tuple(writes)


def _kernel_view(rt, device):
    """``kernels.view`` as a kernel of ``device`` sees memory.  Virtual memory (zeVirtualMemMap) is
    reachable where every byte is mapped with access for the context (zeVirtualMemSetAccessAttribute),
    a range spanning several mappings being contiguous, as on the device; any other address is a
    USM allocation, checked by ``kernels.view``.  A fault raises MemoryRangeError (the device is
    lost, as for a kernel out of range).  (r71k) With cards that are not peers (ACCEL_SIM_PEER), a
    kernel's access to device memory (USM or mapped) of a card ``device`` cannot access faults
    too: ze_api.h zeMemAllocDevice, "a device allocation may only be accessed by the device that
    owns it" unless zeDeviceCanAccessPeer says otherwise (ze/commands.py, _inaccessible; pointer
    arguments were already refused at append, this catches the memory a kernel reaches
    indirectly)."""
    peers_limited = core.config().peer is not None
    if not rt.vmm.reservations and not peers_limited:
        return kernels.view

    def view(ptr, nbytes, dtype=None):
        addr = _memory.addr_of(ptr)
        region = _vmm_range(rt, addr, nbytes, True)
        if region is None:
            if peers_limited:
                why = _inaccessible(rt, device, rt.memory.find(addr))
                if why:
                    raise kernels.MemoryRangeError(f"a kernel touched {why}")
            return kernels.view(addr, nbytes, dtype)
        if region.__class__ is str:
            raise kernels.MemoryRangeError(f"a kernel touched {region}")
        why = next(filter(None, (_inaccessible(rt, device, m) for m in region.maps)), None)
        if why:
            raise kernels.MemoryRangeError(f"a kernel touched {why}")
        return kernels.view_checked_range(addr, nbytes, dtype)
    return view


FUNCTIONS = (zeModuleCreate, zeModuleBuildLogGetString, zeModuleBuildLogDestroy, zeModuleDestroy,
             zeKernelCreate, zeKernelDestroy, zeKernelSetGroupSize, zeKernelSetArgumentValue,
             zeCommandListAppendLaunchKernel)
