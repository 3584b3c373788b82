"""Memory pools, shared by the stream-ordered allocator (mempool.py) and graph memory nodes
(graph_memory.py): each device's default pool, pool attribute values, and which devices may
touch pool memory.
"""

from __future__ import annotations

from typing import Optional

from .. import _graph_mem, _memory, _vmm
from ..core import ffi
from .state import MemPool, Runtime, _addr


# -- stream-ordered allocation (cudaMallocAsync) ---------------------------------------------
#
# Modelled: each device's default pool, allocation on a stream, cudaFreeAsync in stream order,
# the pool's statistics, cudaMemPoolTrimTo, and which other devices may touch the pool's
# memory (cudaMemPoolSetAccess).  Not modelled, and stricter than the hardware: memory freed
# to the pool stays reserved (counted as used device memory) until cudaMemPoolTrimTo; the real
# pool also releases down to cudaMemPoolAttrReleaseThreshold at synchronization points.  Size
# 0 and a NULL free, on which the CUDA Runtime API documentation is silent, are refused.
#
# During stream capture both calls make graph memory nodes (_graph_mem.py has the model and
# its citations); the graph's memory is its own, not the default pool's, and comes back with
# cudaDeviceGraphMemTrim.  Explicitly built graphs (cudaGraphAddMemAllocNode) are not
# simulated, like every other explicit graph construction call.

# The pool's backing memory (cudaMemPoolAttrReservedMemCurrent) grows and shrinks in whole pages
# of the allocation granularity: pools are built on the virtual memory calls, whose physical
# allocations are multiples of cuMemGetAllocationGranularity (2 MiB here, as _vmm.GRANULARITY).
# How much more the driver reserves at a time is not documented; whole pages are the least any
# implementation can hold, so reserved memory never drops below the 2 MiB floor of what is used.
# Placement inside the pool is not modelled (freed bytes are reusable by any size: no
# fragmentation), which is more generous than the hardware; only the page rounding is enforced.
_POOL_CHUNK = _vmm.GRANULARITY
_POOL_REUSE_FOLLOW_EVENTS, _POOL_REUSE_OPPORTUNISTIC, _POOL_REUSE_INTERNAL_DEPS = 1, 2, 3
_POOL_RELEASE_THRESHOLD = 4
_POOL_RESERVED_CURRENT, _POOL_RESERVED_HIGH, _POOL_USED_CURRENT, _POOL_USED_HIGH = 5, 6, 7, 8


def _default_pool(R: Runtime, device: int) -> MemPool:
    pool = R.default_pools.get(device)
    if pool is None:
        with R.mlock:
            pool = R.default_pools.get(device)
            if pool is None:
                pool = MemPool(next(R.handles), device)
                R.pools[pool.handle] = R.pools[pool.key] = pool
                R.default_pools[device] = pool
    return pool


def _pool_value(value, ctype):
    try:
        return value[0]
    except TypeError:
        return ffi.cast(ctype, _addr(value))[0]


# -- pool access of other devices ----------------------------------------------------------------

_ACCESS_NONE, _ACCESS_READ, _ACCESS_READ_WRITE = 0, 1, 3     # cudaMemAccessFlags
_LOCATION_DEVICE = 1                                         # cudaMemLocationTypeDevice
_LOCATION_HOST = 2                                           # cudaMemLocationTypeHost
_GraphAllocation = _graph_mem.GraphAllocation


def _pool_memory(R: Runtime, a) -> bool:
    return a.__class__ is _GraphAllocation or a.base in R.async_allocs


def _pool_access_problem(R: Runtime, a, device: int, write) -> Optional[str]:
    """Why ``device`` may not touch pool or graph allocation ``a`` (None: it may, or ``a`` is
    other memory).  ``write`` True/False for a copy's destination/source; None for a kernel,
    checked when it runs, which must also be inside the allocation's lifetime.

    CUDA Programming Guide, Stream Ordered Memory Allocator, "Device Accessibility for Multi-GPU
    Support": "memory pool allocation accessibility does not follow cudaDeviceEnablePeerAccess
    ... Instead, the API cudaMemPoolSetAccess modifies what devices can access allocations from
    a pool.  By default, allocations are accessible from the device where the allocations are
    located."  A graph allocation has the access its pool gave when it was captured.  A copy
    runs on its stream's device (as for mapped memory: the docs are silent on copies by another
    device, so they need access too).  Kernels cannot be told reading from writing: read access
    is enough for them (more lenient than the hardware)."""
    if a is None or a.__class__ is _vmm.Region or a.kind != _memory.DEVICE:
        return None
    graph = a.__class__ is _GraphAllocation
    if write is None and graph and not a.live:
        return (f"graph allocation 0x{a.base:x} of device {a.device} outside its lifetime (its allocation "
                f"node has not run, or it was freed)")
    if a.device == device:
        return None
    if graph:
        flags = a.access.get(device, _ACCESS_NONE)
    else:
        entry = R.async_allocs.get(a.base)
        if entry is None:
            return None
        flags = entry[0].access.get(device, _ACCESS_NONE)
    if flags >= (_ACCESS_READ_WRITE if write else _ACCESS_READ):
        return None
    what = "graph allocation" if graph else "memory-pool allocation"
    return (f"{what} 0x{a.base:x} of device {a.device} without {'read-write' if write else 'read'} access "
            f"for device {device} (cudaMemPoolSetAccess on device {a.device}'s pool; pool memory does "
            f"not follow cudaDeviceEnablePeerAccess)")


def _ints(p, n: int):
    return ffi.cast("int *", _addr(p))[0:n]
