"""Stream-ordered allocation from each device's default memory pool (``cudaMallocAsync``).

torch's ``backend:cudaMallocAsync`` (``c10/cuda/CUDAMallocAsyncAllocator.cpp``) allocates with
``cudaMallocAsync``/``cudaFreeAsync`` from the device's default pool
(``cudaDeviceGetDefaultMemPool``), keeps everything in the pool (release threshold
``UINT64_MAX``), trims it with ``cudaMemPoolTrimTo`` on ``empty_cache`` and reads its statistics
with ``cudaMemPoolGetAttribute``.  libcudart exports all of these directly (CUDA >= 11.2), so
no driver entry point is needed.  Whether a device has pools at all is
``cudaDevAttrMemoryPoolsSupported`` (CUDA Runtime API, "Stream Ordered Memory Allocator":
"Whether or not a device supports the integrated stream ordered memory allocator may be
queried by calling cudaDeviceGetAttribute() with the device attribute
cudaDevAttrMemoryPoolsSupported").

During stream capture ``cudaMallocAsync``/``cudaFreeAsync`` make graph memory nodes (CUDA
Runtime API, cudaMallocAsync: "the allocation is owned by the graph instead of the memory
pool"): that memory is the graph allocator's, read with ``cudaDeviceGetGraphMemAttribute`` and
returned with ``cudaDeviceGraphMemTrim`` (:meth:`graph_mem_get`, :meth:`graph_mem_trim`).  Another
device reaches a pool's memory only once ``cudaMemPoolSetAccess`` lets it (Programming Guide,
"Device Accessibility for Multi-GPU Support": pool memory does not follow
``cudaDeviceEnablePeerAccess``): :meth:`mem_pool_set_access`.

A mixin of :class:`accel.backends.cuda.CudaBackend`; it uses the backend's ``ffi``, ``lib``,
``_check`` (cudaError_t -> AcceleratorError, cudaErrorMemoryAllocation -> OutOfMemoryError,
the thread's last error cleared), ``_cast``, ``_device_attribute`` and ``_call_maybe_capturing``
(:mod:`.memory`).
"""

from __future__ import annotations

from typing import Dict

__all__ = ["CudaMemPoolMixin", "POOL_ATTRIBUTES", "GRAPH_MEM_ATTRIBUTES"]

_ATTR_MEMORY_POOLS_SUPPORTED = 115       # cudaDevAttrMemoryPoolsSupported (driver_types.h)

#: accel's names of the cudaMemPoolAttr values (driver_types.h, CUDA 12 and 13 agree) and
#: whether the attribute is an ``int`` (the reuse flags) or a ``cuuint64_t``.
POOL_ATTRIBUTES: Dict[str, tuple] = {
    "reuse_follow_event_dependencies": (1, "int"),      # cudaMemPoolReuseFollowEventDependencies
    "reuse_allow_opportunistic": (2, "int"),            # cudaMemPoolReuseAllowOpportunistic
    "reuse_allow_internal_dependencies": (3, "int"),    # cudaMemPoolReuseAllowInternalDependencies
    "release_threshold": (4, "unsigned long long"),     # cudaMemPoolAttrReleaseThreshold
    "reserved_current": (5, "unsigned long long"),      # cudaMemPoolAttrReservedMemCurrent
    "reserved_high": (6, "unsigned long long"),         # cudaMemPoolAttrReservedMemHigh
    "used_current": (7, "unsigned long long"),          # cudaMemPoolAttrUsedMemCurrent
    "used_high": (8, "unsigned long long"),             # cudaMemPoolAttrUsedMemHigh
}

#: accel's names of the cudaGraphMemAttributeType values (driver_types.h; all cuuint64_t).
GRAPH_MEM_ATTRIBUTES: Dict[str, int] = {
    "used_current": 0,      # cudaGraphMemAttrUsedMemCurrent: mapped for graph allocations
    "used_high": 1,         # cudaGraphMemAttrUsedMemHigh
    "reserved_current": 2,  # cudaGraphMemAttrReservedMemCurrent: held by the graph allocator
    "reserved_high": 3,     # cudaGraphMemAttrReservedMemHigh
}
_LOCATION_DEVICE = 1        # cudaMemLocationTypeDevice
_ACCESS_READ_WRITE = 3      # cudaMemAccessFlagsProtReadWrite


class CudaMemPoolMixin:
    """``supports_async_alloc``: cudaMallocAsync/cudaFreeAsync and the default pool's attributes."""

    supports_async_alloc = True

    def _default_pool(self, index: int):
        pools = self.__dict__.setdefault("_mem_pools", {})
        pool = pools.get(index)
        if pool is None:
            p = self.ffi.new("cudaMemPool_t *")
            self._check(self.lib.cudaDeviceGetDefaultMemPool(p, index), "cudaDeviceGetDefaultMemPool")
            pool = pools[index] = p[0]
        return pool

    def _pool_call(self, call: str, fn, *args) -> None:
        """``fn(*args)``, a pool or graph-memory call, checked; in relaxed capture mode while a
        capture is underway.  Reading or changing a pool is a "potentially unsafe" call: in a
        global or thread-local capture it fails with cudaErrorStreamCaptureUnsupported and
        invalidates the capture (NVIDIA/cccl PR 11360, which relaxes the mode around it the same
        way); it acts at once either way, nothing is captured."""
        self._check(self._call_maybe_capturing(fn, *args), call)

    def async_alloc_supported(self, index: int) -> bool:
        """cudaDevAttrMemoryPoolsSupported of device ``index``."""
        return bool(self._device_attribute(_ATTR_MEMORY_POOLS_SUPPORTED, index))

    def mem_alloc_async(self, nbytes: int, stream: int) -> int:
        """cudaMallocAsync of ``nbytes`` on ``stream`` from its device's default pool (the legacy
        stream 0 means the current device's); OutOfMemoryError when the pool cannot grow."""
        p = self.ffi.new("void **")
        s = self._cast("cudaStream_t", stream)
        try:
            self._check(self.lib.cudaMallocAsync(p, nbytes, s), "cudaMallocAsync")
            return self._as_int(p[0])
        except Exception:
            raise
        except BaseException:
            if p[0] != self.ffi.NULL:
                # made, then a KeyboardInterrupt before the pointer reached the caller: given back
                self.lib.cudaFreeAsync(p[0], s)
            raise

    def mem_free_async(self, ptr: int, stream: int) -> None:
        """cudaFreeAsync: ``ptr`` goes back to its pool once ``stream`` reaches this point."""
        self._check(self.lib.cudaFreeAsync(self.ffi.cast("void *", ptr), self._cast("cudaStream_t", stream)),
                    "cudaFreeAsync")

    @staticmethod
    def _pool_attribute(name: str) -> tuple:
        try:
            return POOL_ATTRIBUTES[name]
        except KeyError:
            raise ValueError(f"unknown memory pool attribute {name!r}; expected one of "
                             f"{', '.join(POOL_ATTRIBUTES)}") from None

    def mem_pool_get(self, index: int, name: str) -> int:
        """cudaMemPoolGetAttribute of device ``index``'s default pool; ``name`` is a key of
        :data:`POOL_ATTRIBUTES` (e.g. ``"reserved_current"``)."""
        attr, ctype = self._pool_attribute(name)
        value = self.ffi.new(ctype + " *")
        self._pool_call("cudaMemPoolGetAttribute", self.lib.cudaMemPoolGetAttribute, self._default_pool(index),
                        attr, value)
        return int(value[0])

    def mem_pool_set(self, index: int, name: str, value: int) -> None:
        """cudaMemPoolSetAttribute of device ``index``'s default pool (the high-water marks
        accept only 0, which resets them to the current value)."""
        attr, ctype = self._pool_attribute(name)
        self._pool_call("cudaMemPoolSetAttribute", self.lib.cudaMemPoolSetAttribute, self._default_pool(index),
                        attr, self.ffi.new(ctype + " *", value))

    def mem_pool_trim(self, index: int, keep: int = 0) -> None:
        """cudaMemPoolTrimTo: release unused memory of device ``index``'s default pool, keeping
        at least ``keep`` bytes reserved (the runtime's guarantee; memory in use, or freed by
        work not yet done, stays too)."""
        self._pool_call("cudaMemPoolTrimTo", self.lib.cudaMemPoolTrimTo, self._default_pool(index), keep)

    def mem_pool_set_access(self, index: int, peer: int) -> None:
        """cudaMemPoolSetAccess: device ``peer`` gets read-write access to the memory of device
        ``index``'s default pool (what it allocates later too, and what graphs capture from it
        later; graph allocations captured earlier keep the access they had)."""
        desc = self.ffi.new("struct cudaMemAccessDesc *")
        desc.location.type = _LOCATION_DEVICE
        desc.location.id = peer
        desc.flags = _ACCESS_READ_WRITE
        self._pool_call("cudaMemPoolSetAccess", self.lib.cudaMemPoolSetAccess, self._default_pool(index), desc, 1)

    def graph_mem_get(self, index: int, name: str) -> int:
        """cudaDeviceGetGraphMemAttribute of device ``index``: ``name`` is a key of
        :data:`GRAPH_MEM_ATTRIBUTES` (e.g. ``"reserved_current"``)."""
        try:
            attr = GRAPH_MEM_ATTRIBUTES[name]
        except KeyError:
            raise ValueError(f"unknown graph memory attribute {name!r}; expected one of "
                             f"{', '.join(GRAPH_MEM_ATTRIBUTES)}") from None
        value = self.ffi.new("unsigned long long *")
        self._pool_call("cudaDeviceGetGraphMemAttribute", self.lib.cudaDeviceGetGraphMemAttribute, index, attr, value)
        return int(value[0])

    def graph_mem_trim(self, index: int) -> None:
        """cudaDeviceGraphMemTrim: give device ``index``'s graph memory that no graph uses (or
        is about to) back to the device."""
        self._pool_call("cudaDeviceGraphMemTrim", self.lib.cudaDeviceGraphMemTrim, index)
