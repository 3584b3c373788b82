"""Device and pinned host memory: cudaMalloc / cudaFree (also during a capture), cudaHostAlloc,
cudaMemGetInfo and cudaPointerGetAttributes.
"""

from __future__ import annotations

from .. import _memory, core
from ..core import ffi
from .state import (
    _INVALID_DEVICE_ID, _MEM_TYPE_DEVICE, _MEM_TYPE_HOST, _MEM_TYPE_UNREGISTERED, _NULL, _VOIDP,
    _accounted, _addr, cudaErrorInvalidValue, cudaErrorMemoryAllocation, cudaSuccess, _oom,
)
from .common import _is_null, _lookup, _put, _put_ptr, _unsafe_call, _wait_device
from .pools import _GraphAllocation
from .graph_memory import _graph_free_now


def cudaMemGetInfo(R, free, total):
    if _is_null(free) or _is_null(total):
        return cudaErrorInvalidValue
    dev = R.devices[R.tls.device]
    _put(free, R.cfg.memory - dev.reserved - dev.used, "size_t *")
    _put(total, R.cfg.memory, "size_t *")
    return cudaSuccess


def cudaMalloc(R, devPtr, size):
    if devPtr is None or size < 0:
        return cudaErrorInvalidValue
    if R.captures:
        rc = _unsafe_call(R)
        if rc:
            return rc
    if size == 0:
        return cudaSuccess if _put_ptr(devPtr, _NULL) else cudaErrorInvalidValue
    d = R.tls.device
    dev = R.devices[d]
    if _oom and core.take_oom():
        return cudaErrorMemoryAllocation
    n = (size + 255) & ~255     # accounted like the 256-byte alignment
    with R.mlock:
        if dev.used + n > R.cfg.memory - dev.reserved:
            return cudaErrorMemoryAllocation
        dev.used += n
        if dev.used > dev.peak:
            dev.peak = dev.used
    try:
        a = _memory.allocate(size, _memory.DEVICE, d)
    except MemoryError:
        with R.mlock:
            dev.used -= n
        return cudaErrorMemoryAllocation
    if not _put_ptr(devPtr, a.key):
        with R.mlock:
            dev.used -= n
        return cudaErrorInvalidValue
    R.mem.add(a)
    return cudaSuccess


def _allocation_to_free(R, ptr, kind):
    """What cudaFree/cudaFreeHost check first: ``(rc, allocation)``; a NULL
    pointer is ``(cudaSuccess, None)``, a valid free ``(cudaSuccess, allocation)``."""
    if ptr is None or (ptr.__class__ is int and ptr == 0):
        return cudaSuccess, None
    a = _lookup(R.mem.by_key, ptr)
    if a is None:
        return (cudaSuccess if ptr == ffi.NULL else cudaErrorInvalidValue), None
    if a.kind != kind:
        return cudaErrorInvalidValue, None
    if R.freed_async(a):
        # cudaMallocAsync memory a cudaFreeAsync already freed (the free still queued): a double
        # free.  CUDA Runtime API, cudaFree: "Otherwise, or if cudaFree(devPtr) has already been
        # called before, an error is returned"; cudaFreeAsync: "After this API returns, accessing
        # the memory ... results in undefined behavior".  r66c: it returned cudaSuccess and took
        # the bytes off the device's count as well as off the pool's.
        return cudaErrorInvalidValue, None
    if R.captures:
        rc = _unsafe_call(R)
        if rc:
            return rc, None
    return cudaSuccess, a


def cudaFree(R, devPtr):
    rc, a = _allocation_to_free(R, devPtr, _memory.DEVICE)
    if a is None:
        return rc
    if a.__class__ is _GraphAllocation:
        return _graph_free_now(R, a)
    _wait_device(R, a.device)   # cudaFree synchronizes: no queued work may still use the buffer
    R.mem.remove(a)
    entry = R.async_allocs.pop(a.base, None)
    if entry is not None:
        # cudaMallocAsync memory given to cudaFree (an H100 returned 0: scenario pool_free_mismatches):
        # its bytes go back to its pool, as a cudaFreeAsync's would
        pool, n = entry
        with R.mlock:
            pool.used -= n
        return cudaSuccess
    dev = R.devices[a.device]
    with R.mlock:
        dev.used -= (a.size + 255) & ~255
    return cudaSuccess


def cudaHostAlloc(R, pHost, size, flags):
    # cudaHostAlloc: cudaHostAllocDefault/Portable/Mapped/WriteCombined (0, 1, 2, 4) only; 8 is
    # cudaHostRegister's cudaHostRegisterIoMemory
    if pHost is None or size < 0 or flags & ~0x7:
        return cudaErrorInvalidValue
    if R.captures:
        rc = _unsafe_call(R)
        if rc:
            return rc
    if size == 0:
        return cudaSuccess if _put_ptr(pHost, _NULL) else cudaErrorInvalidValue
    if _oom and core.take_oom():
        return cudaErrorMemoryAllocation
    try:
        a = _memory.allocate(size, _memory.HOST, R.tls.device)
    except MemoryError:
        return cudaErrorMemoryAllocation
    if not _put_ptr(pHost, a.key):
        return cudaErrorInvalidValue
    R.mem.add(a)
    with R.mlock:
        R.host_bytes += _accounted(size)
    return cudaSuccess


def cudaMallocHost(R, ptr, size):
    return cudaHostAlloc(R, ptr, size, 0)


def cudaFreeHost(R, ptr):
    rc, a = _allocation_to_free(R, ptr, _memory.HOST)
    if a is None:
        return rc
    for d in range(len(R.devices)):    # pinned memory may be in use by any device's queue
        _wait_device(R, d)
    R.mem.remove(a)
    with R.mlock:
        R.host_bytes -= _accounted(a.size)
    return cudaSuccess


def cudaPointerGetAttributes(R, attributes, ptr):
    if _is_null(attributes):
        return cudaErrorInvalidValue
    # struct cudaPointerAttributes is 24 bytes in CUDA 12 and 88 in CUDA 13 (reserved[8]
    # added): the real library writes its own size, so a caller's struct smaller than the
    # runtime's would be overrun; refused here (cudaErrorInvalidValue) instead.
    from accel._ffi import cudart_module
    try:
        room = len(ffi.buffer(attributes))
    except TypeError:
        room = None
    if room is not None and room < cudart_module(R.cfg.runtime_version // 1000).ffi.sizeof(
            "struct cudaPointerAttributes"):
        return cudaErrorInvalidValue
    addr = _addr(ptr)
    a = R.mem.find(addr) if addr else None
    if R.freed_async(a):
        return cudaErrorInvalidValue    # "or querying its pointer attributes results in undefined behavior"
    if a is None and addr and R.vmm.reservations:
        a = R.vmm.mapping_at(addr)      # mapped virtual memory is device memory of its handle's device
    buf = ffi.buffer(attributes)
    buf[:] = bytes(len(buf))
    if a is None:
        attributes.type = _MEM_TYPE_UNREGISTERED
        attributes.device = _INVALID_DEVICE_ID
        attributes.hostPointer = ffi.cast(_VOIDP, addr)
    elif a.kind == _memory.DEVICE:
        attributes.type = _MEM_TYPE_DEVICE
        attributes.device = a.device
        attributes.devicePointer = ffi.cast(_VOIDP, addr)
    else:
        attributes.type = _MEM_TYPE_HOST
        attributes.device = a.device
        attributes.devicePointer = ffi.cast(_VOIDP, addr)   # mapped: the same address (UVA)
        attributes.hostPointer = ffi.cast(_VOIDP, addr)
    return cudaSuccess
