"""Virtual memory: zeVirtualMemReserve / Free / Map / Unmap, access attributes and page sizes,
zePhysicalMemCreate / Destroy, with the spec's rules (granularity, mapping only inside a
reservation, no double map).
"""

from __future__ import annotations

from .. import _vmm, core
from ..core import ffi
from .common import _addr, _ready


# -- virtual memory (zeVirtualMem*, zePhysicalMem*) ---------------------------------------------
# Level Zero specification, "Virtual Memory Management" (ze_api.h, the entry of each function).
# Reservations, physical pages and mappings are accel.sim._vmm's (real host address ranges, pages
# of a per-device memory file charged to the device).  Access is one attribute per mapping for
# the whole context (zeVirtualMemMap / zeVirtualMemSetAccessAttribute take no device), kept
# under the accessor key _CTX_ACCESS.

_CTX_ACCESS = -1
_ZE_ACCESS = {0: None, 1: "rw", 2: "r"}      # ZE_MEMORY_ACCESS_ATTRIBUTE_NONE / _READWRITE / _READONLY
_ZE_ACCESS_VALUES = {None: 0, "rw": 1, "r": 2}


def _vmm_code(rt, kind: str) -> int:
    C = rt.C
    return {"invalid": C.ZE_RESULT_ERROR_INVALID_ARGUMENT, "oom": C.ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY,
            "in_use": C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE,
            "unsupported": C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE}[kind]


def _vmm_ready(hContext):
    """(runtime, context, 0) or (None, None, code)."""
    rt, rc = _ready()
    if rc:
        return None, None, rc
    ctx = rt.get(hContext, "context")
    if ctx is None:
        return None, None, rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if not _vmm.supported():
        return None, None, rt.C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE
    return rt, ctx, 0


def _vmm_address(hContext, ptr, *out_pointers):
    """(runtime, context, address, 0) or (None, None, 0, code): _vmm_ready, then
    ZE_RESULT_ERROR_INVALID_NULL_POINTER for a NULL ``ptr`` or out-pointer."""
    rt, ctx, rc = _vmm_ready(hContext)
    if rc:
        return None, None, 0, rc
    base = _addr(ptr)
    if not base or not all(out_pointers):
        return None, None, 0, rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    return rt, ctx, base, 0


def _page_aligned(*values) -> bool:
    return all(v % _vmm.GRANULARITY == 0 for v in values)


def _extent_code(C, size: int, *addresses) -> int:
    """0, or the code refusing an empty range (UNSUPPORTED_SIZE: "0 == size") or a size or address
    that is not page aligned (UNSUPPORTED_ALIGNMENT)."""
    if size == 0:
        return C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE
    if not _page_aligned(size, *addresses):
        return C.ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT
    return 0


def _reservation_ctx(rt, addr: int, ctx) -> bool:
    # ze_api.h, zeVirtualMemReserve / zeVirtualMemMap: "The application must only use the memory
    # allocation on the context for which it was created."
    r = rt.vmm.reservation_of(addr)
    return r is not None and rt.vmm_ctx.get(r.base) is ctx


def zeVirtualMemQueryPageSize(hContext, hDevice, size, pagesize):
    rt, ctx, rc = _vmm_ready(hContext)
    if rc:
        return rc
    if rt.get(hDevice, "device") is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if not pagesize:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if size == 0:
        return rt.C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE
    pagesize[0] = _vmm.GRANULARITY
    return 0


def zeVirtualMemReserve(hContext, pStart, size, pptr):
    rt, ctx, rc = _vmm_ready(hContext)
    if rc:
        return rc
    C = rt.C
    # ze_api.h, zeVirtualMemReserve @returns: ZE_RESULT_ERROR_INVALID_NULL_POINTER for
    # `nullptr == pStart` (the prose calls a null start "implementation chooses"; the stricter
    # reading is enforced: pass a page-aligned hint) and `nullptr == pptr`; UNSUPPORTED_SIZE for
    # 0 == size; "The starting address and size must be page aligned".  A hint that is taken is
    # only a hint ("If not available then will find another suitable starting address").
    if not pStart or not pptr:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if size == 0:
        return C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE
    if not _page_aligned(size, _addr(pStart)):
        return C.ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT
    try:
        base = rt.vmm.reserve(size, _vmm.GRANULARITY)
    except _vmm.VmmError:
        return C.ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY
    rt.vmm_ctx[base] = ctx
    pptr[0] = ffi.cast("void *", base)
    return 0


def zeVirtualMemFree(hContext, ptr, size):
    rt, ctx, base, rc = _vmm_address(hContext, ptr)
    if rc:
        return rc
    C = rt.C
    rc = _extent_code(C, size, base)
    if rc:
        return rc
    # The context entry goes before the range does (and comes back if the free fails): once
    # free, the range may be another thread's next reservation, whose entry must survive.
    with rt.lock:
        if rt.vmm_ctx.get(base) is not ctx:
            return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
        del rt.vmm_ctx[base]
    # ze_api.h, zeVirtualMemFree: "Any existing virtual mappings for the range will be unmapped"
    # (the physical objects stay).  Freeing part of a reservation is not described: refused.
    try:
        rt.vmm.free(base, size, unmap=True)
    except _vmm.VmmError as exc:
        rt.vmm_ctx[base] = ctx
        return _vmm_code(rt, exc.kind)
    return 0


def zePhysicalMemCreate(hContext, hDevice, desc, phPhysicalMemory):
    rt, ctx, rc = _vmm_ready(hContext)
    if rc:
        return rc
    C = rt.C
    dev = rt.get(hDevice, "device")
    if dev is None:
        return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if not desc or not phPhysicalMemory:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    # ze_api.h, zePhysicalMemCreate: INVALID_ENUMERATION for 0x1 < desc->flags, UNSUPPORTED_SIZE for
    # 0 == desc->size; "The size must be page aligned" (UNSUPPORTED_ALIGNMENT); the memory counts
    # against the device (OUT_OF_DEVICE_MEMORY).
    if desc.stype != C.ZE_STRUCTURE_TYPE_PHYSICAL_MEM_DESC or desc.pNext:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION if desc.stype != C.ZE_STRUCTURE_TYPE_PHYSICAL_MEM_DESC \
            else C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if desc.flags > 0x1:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    size = desc.size
    rc = _extent_code(C, size)
    if rc:
        return rc
    if core.take_oom():
        return C.ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY
    try:
        h = rt.vmm.create(dev.ordinal, size)
    except _vmm.VmmError as exc:
        return _vmm_code(rt, exc.kind)
    rt.vmm_handle_ctx[h] = ctx
    phPhysicalMemory[0] = ffi.cast("void *", h)
    return 0


def zePhysicalMemDestroy(hContext, hPhysicalMemory):
    rt, ctx, rc = _vmm_ready(hContext)
    if rc:
        return rc
    h = _addr(hPhysicalMemory)
    if not h:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    with rt.lock:                  # forgotten first, as in zeVirtualMemFree
        if rt.vmm_handle_ctx.get(h) is not ctx:
            return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
        del rt.vmm_handle_ctx[h]
    # ze_api.h, zePhysicalMemDestroy: "The application must ensure the device is not currently
    # referencing the physical memory object before it is deleted" (ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE):
    # a mapped object is refused.
    try:
        rt.vmm.release(h, while_mapped=False)
    except _vmm.VmmError as exc:
        rt.vmm_handle_ctx[h] = ctx
        return _vmm_code(rt, exc.kind)
    return 0


def zeVirtualMemMap(hContext, ptr, size, hPhysicalMemory, offset, access):
    rt, ctx, rc = _vmm_ready(hContext)
    if rc:
        return rc
    C = rt.C
    base, h = _addr(ptr), _addr(hPhysicalMemory)
    if not h:
        return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if not base:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    # ze_api.h, zeVirtualMemMap: INVALID_ENUMERATION for READONLY < access; UNSUPPORTED_SIZE for
    # 0 == size; "The virtual address range must have been reserved using zeVirtualMemReserve";
    # "The virtual start address and size must be page aligned" (and the offset: "must be page
    # aligned").  Mapping over a live mapping is not described: refused (INVALID_ARGUMENT).
    if access > 2:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    rc = _extent_code(C, size, base, offset)
    if rc:
        return rc
    if rt.vmm_handle_ctx.get(h) is not ctx or not _reservation_ctx(rt, base, ctx):
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    try:
        rt.vmm.map(base, size, h, offset, whole=False)
        flags = _ZE_ACCESS[access]
        if flags is not None:
            rt.vmm.set_access(base, size, [(_CTX_ACCESS, flags)])
    except _vmm.VmmError as exc:
        return _vmm_code(rt, exc.kind)
    finally:
        core.vmm_cost()
    return 0


def zeVirtualMemUnmap(hContext, ptr, size):
    rt, ctx, base, rc = _vmm_address(hContext, ptr)
    if rc:
        return rc
    C = rt.C
    if size == 0:
        return C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE
    if not _page_aligned(base):
        return C.ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT
    if not _page_aligned(size):
        return C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE      # ze_api.h: "Size must be page aligned"
    if not _reservation_ctx(rt, base, ctx):
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    # Unmapping part of a mapping is not described: refused (whole mappings only).  Like cuMemUnmap,
    # it does not wait: work still queued on the range faults when it runs.
    try:
        rt.vmm.unmap(base, size)
    except _vmm.VmmError as exc:
        return _vmm_code(rt, exc.kind)
    finally:
        core.vmm_cost()
    return 0


def zeVirtualMemSetAccessAttribute(hContext, ptr, size, access):
    rt, ctx, base, rc = _vmm_address(hContext, ptr)
    if rc:
        return rc
    C = rt.C
    if access > 2:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    rc = _extent_code(C, size, base)
    if rc:
        return rc
    if not _reservation_ctx(rt, base, ctx):
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    try:
        rt.vmm.set_access(base, size, [(_CTX_ACCESS, _ZE_ACCESS[access])])
    except _vmm.VmmError as exc:
        return _vmm_code(rt, exc.kind)
    return 0


def zeVirtualMemGetAccessAttribute(hContext, ptr, size, access, outSize):
    rt, ctx, base, rc = _vmm_address(hContext, ptr, access, outSize)
    if rc:
        return rc
    C = rt.C
    rc = _extent_code(C, size, base)
    if rc:
        return rc
    if not _reservation_ctx(rt, base, ctx):
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    m = rt.vmm.mapping_at(base)
    flags = m.access.get(_CTX_ACCESS) if m is not None else None
    access[0] = _ZE_ACCESS_VALUES[flags]
    # the length of the leading part of the range with the same attribute
    n = 0
    a = base
    while a < base + size:
        mm = rt.vmm.mapping_at(a)
        f = mm.access.get(_CTX_ACCESS) if mm is not None else None
        if f != flags:
            break
        step = (mm.end - a) if mm is not None else _vmm.GRANULARITY
        n += step
        a += step
    outSize[0] = min(n, size)
    return 0


def _vmm_range(rt, addr: int, size: int, write: bool):
    """For a copy or fill: None (not virtual memory), a _vmm.Region, or why it faults (str)."""
    if not rt.vmm.reservations:
        return None
    return rt.vmm.resolve(addr, size, _CTX_ACCESS, write)
