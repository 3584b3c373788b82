"""Contexts and unified shared memory: zeContextCreate / Destroy, zeMemAllocDevice / Host,
zeMemFree and zeMemGetAllocProperties.
"""

from __future__ import annotations

from .. import _memory, core
from ..core import ffi
from .objects import _Obj
from .common import _addr, _ready, _ready_get, _struct_arg_code


# -- contexts and memory --------------------------------------------------------------------

def zeContextCreate(hDriver, desc, phContext):
    rt, _driver, rc = _ready_get(_ready, hDriver, "driver")
    if rc:
        return rc
    if not desc or not phContext:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER     # _null_pointers
    if desc.stype != rt.C.ZE_STRUCTURE_TYPE_CONTEXT_DESC or desc.flags > 0x1:
        return rt.C.ZE_RESULT_ERROR_INVALID_ENUMERATION     # ze_api.h: "0x1 < desc->flags"
    if desc.pNext:
        return rt.C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE     # an extension structure: _no_extension
    ctx = rt._add(_Obj("context"))
    phContext[0] = ctx.key
    return 0


# _null_pointers (r70h; ze_api.h, each function's @returns: ZE_RESULT_ERROR_INVALID_NULL_POINTER for
# "nullptr == desc" / "nullptr == phContext" / "nullptr == pptr" ..., checked by the loader's
# parameter validation layer too): the simulator read the descriptor or wrote the out-pointer of a
# NULL and raised a Python error out of the library -- for the creators after the object was made,
# which then leaked (a pool, an event slot, a command list with its engine queue).  Every creator
# and query here, in events.py, commands.py and discovery.py (and common._fill for pCount) now
# checks its pointers first and changes nothing.

# _no_extension (ze_api.h, every descriptor's pNext: "[in][optional] must be null or a pointer to
# an extension-specific structure (i.e. contains stype and pNext)"): an extension structure changes
# what the call does -- ze_relaxed_allocation_limits_exp_desc_t lifts maxMemAllocSize,
# ze_external_memory_export_desc_t / _import_fd_t export or import the memory, counter-based event
# pools change event semantics -- and the simulator simulates none of them: it ignored the chain and
# did the plain call.  Refused now (UNSUPPORTED_FEATURE: not simulated) for the creation descriptors:
# contexts, USM allocations (here), event pools and events (events.py), command queues and lists
# (commands.py), modules and kernels (_ze_kernels.py).

#: The attribute naming the context an object was created from, per kind (zeContextDestroy; a
#: module, _ze_kernels._KObj, keeps it in its fields as "ctx").
_OWNER = {"cmdlist": "ctx", "cmdqueue": "ctx", "eventpool": "context"}


def zeContextDestroy(hContext):
    rt, ctx, rc = _ready_get(_ready, hContext, "context")
    if rc:
        return rc
    with rt.lock:
        # ze_api.h, zeContextDestroy: "The application must ensure the device is not currently
        # referencing the context before it is deleted" (@returns HANDLE_OBJECT_IN_USE): work
        # submitted to a list or queue of the context that has not run yet.  The header is silent
        # on what becomes of the context's other objects (it speaks of allocations only, below):
        # command lists and queues (zeCommandList*Create, zeCommandQueueCreate take hContext),
        # event pools and through them their events, modules and through them their kernels,
        # physical memory ("The application must only use the physical memory object on the
        # context for which it was created", zePhysicalMemCreate) and virtual reservations ("...
        # on the context for which it was created", zeVirtualMemReserve).  Using them after their
        # context is gone is undefined, and the last two could not even be released
        # (zePhysicalMemDestroy and zeVirtualMemFree take the destroyed hContext): the spec is
        # silent, so refused, idle or not, with the same code; nothing changes.  The application
        # destroys them first.  (The simulator destroyed the context and left every one of them
        # usable: tests/test_sim_ze_strict2.py.)
        for obj in list(rt.objects.values()):    # a snapshot: other threads create objects meanwhile
            owner = obj.f["ctx"] if obj.kind == "module" else getattr(obj, _OWNER.get(obj.kind, "-"), None)
            if owner is ctx and obj.live:
                return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
        if ctx in list(rt.vmm_ctx.values()) + list(rt.vmm_handle_ctx.values()):
            return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
        # "The implementation of this function may immediately free all Host and Device
        # allocations associated with this context": the simulator does, so nothing uses them
        # afterwards (a later access faults; the memory is the device's again).
        for a in rt.memory.all():
            if rt.alloc_ctx.get(a.base) is ctx:
                rt.memory.remove(a)
                del rt.alloc_ctx[a.base]
                for card, t, n in rt.alloc_charge.pop(a.base, ()):
                    card.tile_used[t] -= n
        rt._forget(ctx)
    return 0


#: zeDeviceGetMemoryProperties' count for every simulated device (discovery.py): one HBM memory.
_MEMORY_ORDINALS = 1

# The largest alignment the simulator honours: ze_api.h names no upper bound; above this the
# simulator refuses (UNSUPPORTED_ALIGNMENT) rather than reserve that much address space.
_MAX_ALIGNMENT = 1 << 30


def _alloc_checks(rt, size, alignment, flags, max_flags) -> int:
    # ze_api.h, zeMemAllocDevice / zeMemAllocHost @returns: INVALID_ENUMERATION "0x7 <
    # device_desc->flags" / "0xf < host_desc->flags"; UNSUPPORTED_SIZE "0 == size";
    # UNSUPPORTED_ALIGNMENT "Must be zero or a power-of-two".
    if flags > max_flags:
        return rt.C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    if size == 0:
        return rt.C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE
    if alignment and alignment & (alignment - 1) or alignment > _MAX_ALIGNMENT:
        return rt.C.ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT
    return 0


def _allocate(size, kind, device, alignment):
    """The allocation, aligned as asked: ze_api.h, zeMemAlloc*: ``alignment`` is the "minimum
    alignment in bytes for the allocation" (0: the driver's choice, 256 bytes here)."""
    return _memory.allocate(size, kind, device, max(alignment, _memory.ALIGN))


def zeMemAllocDevice(hContext, desc, size, alignment, hDevice, pptr):
    rt, _context, rc = _ready_get(_ready, hContext, "context")
    if rc:
        return rc
    C = rt.C
    dev = rt.get(hDevice, "device")
    if dev is None:
        return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    # "nullptr == device_desc", "nullptr == pptr"; an extension structure: _no_extension
    rc = _struct_arg_code(C, desc, "ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC", pptr)
    if rc:
        return rc
    rc = _alloc_checks(rt, size, alignment, desc.flags, 0x7)
    if rc:
        return rc
    if desc.ordinal >= _MEMORY_ORDINALS:
        # (r70h) ze_device_mem_alloc_desc_t.ordinal: "ordinal of the device's local memory to
        # allocate from. must be less than the count returned from zeDeviceGetMemoryProperties"
        # (1 here: discovery.py).  No code is named: INVALID_ARGUMENT.  The simulator ignored it.
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if size > dev.memory:
        return C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE   # above maxMemAllocSize
    with rt.lock:
        if core.take_oom() or dev.used() + size > dev.memory:
            return C.ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY
        try:
            a = _allocate(size, _memory.DEVICE, dev.ordinal, alignment)
        except MemoryError:
            return C.ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY
        share, extra = divmod(size, len(dev.tiles))
        charge = []
        for i, t in enumerate(dev.tiles):
            n = share + (extra if i == 0 else 0)
            dev.card.tile_used[t] += n
            charge.append((dev.card, t, n))
        rt.alloc_charge[a.base] = charge
        rt.alloc_ctx[a.base] = rt.get(hContext, "context")
        rt.memory.add(a)
    pptr[0] = a.key
    return 0


def zeMemAllocHost(hContext, desc, size, alignment, pptr):
    rt, _context, rc = _ready_get(_ready, hContext, "context")
    if rc:
        return rc
    C = rt.C
    # "nullptr == host_desc", "nullptr == pptr"; an extension structure: _no_extension
    rc = _struct_arg_code(C, desc, "ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC", pptr)
    if rc:
        return rc
    rc = _alloc_checks(rt, size, alignment, desc.flags, 0xF)
    if rc:
        return rc
    if rt.devices and size > rt.devices[0].memory:
        # (r70h) Intel compute-runtime, level_zero/core/source/context/context_imp.cpp,
        # ContextImp::allocHostMem: without ze_relaxed_allocation_limits_exp_desc_t (refused here:
        # _no_extension) "size > this->driverHandle->devices[0]->...maxMemAllocSize" returns
        # ZE_RESULT_ERROR_UNSUPPORTED_SIZE, as zeMemAllocDevice does above its device's limit
        # (ze_api.h: size "must be less-than ze_device_properties_t.maxMemAllocSize").  The driver's
        # first device reports maxMemAllocSize = its memory (discovery.py).  The simulator handed
        # out host allocations of any size up to the host's physical memory (r67b, _memory.py).
        return C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE
    if core.take_oom():
        return C.ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY
    try:
        a = _allocate(size, _memory.HOST, -1, alignment)
    except MemoryError:
        return C.ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY
    rt.alloc_ctx[a.base] = rt.get(hContext, "context")
    rt.memory.add(a)
    pptr[0] = a.key
    return 0


def zeMemFree(hContext, ptr):
    rt, ctx, rc = _ready_get(_ready, hContext, "context")
    if rc:
        return rc
    with rt.lock:
        a = rt.memory.by_key.get(ptr)
        if a is None:
            return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
        # ze_api.h: memory belongs to the context it was allocated in; another context's
        # zeMemFree is refused (the documents are silent on the code: INVALID_ARGUMENT).
        if rt.alloc_ctx.get(a.base) is not ctx:
            return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
        # ze_api.h, zeMemFree: "The application must ensure the device is not currently
        # referencing the memory before it is freed" -- the words of zeEventDestroy and
        # zeKernelDestroy, refused likewise: submitted work that has not run yet touches it.
        if a in rt.alloc_refs:
            return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
        rt.memory.remove(a)
        rt.alloc_ctx.pop(a.base, None)
        for card, t, n in rt.alloc_charge.pop(a.base, ()):
            card.tile_used[t] -= n
    return 0


def zeMemGetAllocProperties(hContext, ptr, props, phDevice):
    rt, _context, rc = _ready_get(_ready, hContext, "context")
    if rc:
        return rc
    C = rt.C
    # "nullptr == ptr", "nullptr == pMemAllocProperties".  (r72a) an extension structure chained to
    # the properties (ze_external_memory_export_fd_t exports the allocation as a dma-buf fd,
    # ze_memory_sub_allocations_exp_properties_t lists its sub-allocations): not simulated, refused
    # (common._struct_code)
    rc = _struct_arg_code(C, props, "ZE_STRUCTURE_TYPE_MEMORY_ALLOCATION_PROPERTIES", _addr(ptr))
    if rc:
        return rc
    a = rt.memory.find(_addr(ptr))
    if a is not None and rt.alloc_ctx.get(a.base) is not rt.get(hContext, "context"):
        # "memory allocation unrelated to the context ... type will be ZE_MEMORY_TYPE_UNKNOWN"
        a = None
    if a is None:
        props.type, props.id, props.pageSize = C.ZE_MEMORY_TYPE_UNKNOWN, 0, 0
        if phDevice:
            phDevice[0] = ffi.NULL
        return 0
    props.type = C.ZE_MEMORY_TYPE_DEVICE if a.kind == _memory.DEVICE else C.ZE_MEMORY_TYPE_HOST
    props.id = a.base
    props.pageSize = 65536
    if phDevice:
        phDevice[0] = rt.devices[a.device].key if a.kind == _memory.DEVICE else ffi.NULL
    return 0
