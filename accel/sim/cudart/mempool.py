"""The stream-ordered allocator: cudaMallocAsync / cudaFreeAsync from each device's default
pool, pool attributes, trimming, and access from other devices.
"""

from __future__ import annotations

import functools

from .. import _memory, core
from .state import (
    cudaErrorInvalidDevice, cudaErrorInvalidResourceHandle, cudaErrorInvalidValue,
    cudaErrorMemoryAllocation, cudaErrorNotSupported, cudaErrorPeerAccessUnsupported, cudaSuccess, _oom,
)
from .common import (
    _enqueue, _implicit_deps, _is_null, _legacy_conflict, _ordered_after, _unmade, _lookup, _put, _put_ptr,
    _stream, _unsafe_call,
)
from .pools import (
    _ACCESS_NONE, _ACCESS_READ, _ACCESS_READ_WRITE, _LOCATION_DEVICE, _LOCATION_HOST, _POOL_CHUNK, _POOL_RELEASE_THRESHOLD,
    _POOL_RESERVED_CURRENT, _POOL_RESERVED_HIGH, _POOL_USED_CURRENT, _POOL_USED_HIGH, _GraphAllocation,
    _default_pool, _ints, _pool_value,
)
from .graph_memory import _capture_free, _capture_malloc, _graph_free_async


def _touches(fn, a) -> bool:
    """Whether the queued operation ``fn`` touches allocation ``a``: a copy or memset naming it
    (``allocs``), or a kernel passed a pointer into it (``ptrs``, interior pointers included)."""
    allocs = getattr(fn, "allocs", None)
    if allocs and any(x is a for x in allocs):
        return True
    ptrs = getattr(fn, "ptrs", None)
    if ptrs is None and fn.__class__ is functools.partial:
        ptrs = getattr(fn.func, "ptrs", None)       # a kernel launched with freed ranges to guard
    return bool(ptrs) and any(p.__class__ is int and a.base <= p < a.end for p in ptrs)


def _use_not_ordered_before(R, a, s) -> bool:
    """(r68d) Whether work queued on another stream that touches ``a`` has not run yet and is not
    ordered before work queued on ``s`` now, so that a free queued on ``s`` could be reached first.

    CUDA Runtime API, cudaFreeAsync: "The allocation must not be accessed after stream execution
    reaches the free"; Programming Guide, "Graph Memory Nodes": "It is illegal to access memory
    after it has been freed - the free operation must be ordered after all operations accessing the
    memory using graph dependencies, CUDA events and other stream ordering mechanisms"; the Stream
    Ordered Memory Allocator section orders a free on another stream after the kernel there with an
    event (cudaEventRecord on that stream, cudaStreamWaitEvent on the freeing one).  A free on a
    stream not ordered after a pending use is a race the hardware cannot see (the use may touch
    memory the pool reused, or fault).  Before r68d the simulator let the two race: the use faulted
    only when the free happened to run first.  No code is documented for refusing it:
    cudaErrorInvalidValue, nothing queued, as for a free not ordered after the allocation.
    Copies, memsets and kernels are seen; a graph launch's nodes are not."""
    last = {}
    with R.engine.lock:
        for dev in R.devices:
            for q in list(dev.queues):
                if q is s.q or q.done >= q.enqueued:
                    continue
                for seq, fn, _deps, _work in q.ops:
                    if fn is not None and seq > q.done and _touches(fn, a):
                        last[q] = seq
    return any(not _ordered_after(R, s, (q, seq)) for q, seq in last.items())


def _pool_call_in_capture(R) -> int:
    """0, or cudaErrorStreamCaptureUnsupported (900) after invalidating the captures that prohibit a
    potentially unsafe call by this thread now (common._unsafe_call: the thread's own non-relaxed
    capture, or another thread's global capture unless this thread is relaxed).

    (r68d) The pool calls cudaMemPoolGetAttribute / cudaMemPoolSetAttribute, cudaMemPoolTrimTo and
    cudaMemPoolSetAccess / cudaMemPoolGetAccess.  The Runtime API pages are silent on capture; the
    attribute calls are "potentially unsafe" on the hardware: NVIDIA/cccl PR 11360 ("Make resolving
    a default memory pool legal under stream capture", NVIDIA's libcu++): "cuMemPoolGetAttribute /
    cuMemPoolSetAttribute are 'potentially unsafe' driver calls: while the calling thread is inside a
    global or thread-local stream capture they fail with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and
    invalidate the capture" ("operation not permitted when stream is capturing(900)"), while
    cudaDeviceGetDefaultMemPool "is a pure query and is legal under capture" (not checked here).
    Trimming (memory back to the OS, as cudaFree) and access changes (mappings, as cuMemSetAccess,
    which the simulator refuses too): docs silent, refused alike; HIP refuses all five during a
    non-relaxed capture (ROCm/rocm-systems PR 7845/10166, CHECK_STREAM_CAPTURE_SUPPORTED).  Before
    r68d all five were accepted in any capture."""
    return _unsafe_call(R) if R.captures else 0


def cudaDeviceGetDefaultMemPool(R, memPool, device):
    if not (0 <= device < len(R.devices)):
        return cudaErrorInvalidDevice
    if _is_null(memPool):
        return cudaErrorInvalidValue
    _put_ptr(memPool, _default_pool(R, device).key)
    return cudaSuccess


def cudaMallocAsync(R, devPtr, size, hStream):
    """CUDA Runtime API, cudaMallocAsync: ``size`` bytes from the default pool of the stream's
    device, usable in stream order on ``hStream``; cudaErrorMemoryAllocation when the device
    has no room for what the pool must add."""
    if _is_null(devPtr) or size <= 0:
        return cudaErrorInvalidValue
    s = _stream(R, hStream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    if s.capture is not None:
        return _capture_malloc(R, devPtr, size, s)
    if s.legacy and R.captures:
        # cudaMallocAsync "uses standard default stream semantics": an allocation queued on the
        # legacy stream while a blocking stream of its device captures would depend on the capture
        # (CUDA Programming Guide, "CUDA Graphs" > "Prohibited and Unhandled Operations": "any
        # attempted use of the legacy stream is invalid"): cudaErrorStreamCaptureImplicit and the
        # capture is invalidated, as for every other operation queued there (r66c: accepted before).
        rc = _legacy_conflict(R, s.device)
        if rc:
            return rc
    if _oom and core.take_oom():
        return cudaErrorMemoryAllocation
    pool, dev = _default_pool(R, s.device), R.devices[s.device]
    n = (size + 255) & ~255
    with R.mlock:
        grow = -(-max(0, n - (pool.reserved - pool.used)) // _POOL_CHUNK) * _POOL_CHUNK
        if dev.used + grow > R.cfg.memory - dev.reserved:
            return cudaErrorMemoryAllocation
        dev.used += grow
        dev.peak = max(dev.peak, dev.used)
        pool.reserved += grow
        pool.used += n
        pool.used_high = max(pool.used_high, pool.used)
        pool.reserved_high = max(pool.reserved_high, pool.reserved)
    try:
        a = _memory.allocate(size, _memory.DEVICE, s.device)
    except MemoryError:
        a = None
    if a is None or not _put_ptr(devPtr, a.key):
        with R.mlock:
            pool.used -= n
        return cudaErrorMemoryAllocation if a is None else cudaErrorInvalidValue
    R.mem.add(a)
    R.async_allocs[a.base] = (pool, n)
    # The allocation point, in stream order on s: until s reaches it, work on a stream not
    # ordered after it may not touch the memory (cudaMallocAsync: "The allocation must not be
    # accessed until the allocation operation completes"; common._unmade).
    point = [s.q, None]
    R.making[a.base] = point

    def made():
        if R.making.get(a.base) is point:
            del R.making[a.base]
    seq = s.q.submit(made, _implicit_deps(R, s) if (s.legacy or s.blocking) else (), work=False)
    if R.making.get(a.base) is point:
        point[1] = seq
    return cudaSuccess


def cudaFreeAsync(R, devPtr, hStream):
    """CUDA Runtime API, cudaFreeAsync: returns memory from cudaMallocAsync to its pool in
    stream order on ``hStream``.  Memory from cudaMalloc, or freed already, is refused
    (cudaErrorInvalidValue)."""
    s = _stream(R, hStream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    a = None if _is_null(devPtr) else _lookup(R.mem.by_key, devPtr)
    if a.__class__ is _GraphAllocation:
        if s.capture is not None:
            return _capture_free(R, a, s)
        if _use_not_ordered_before(R, a, s):
            return cudaErrorInvalidValue    # r68d: a pending use on another stream could come after it
        return _graph_free_async(R, a, s)
    if a is None or a.base not in R.async_allocs or (R.making and _unmade(R, a, s)):
        # (cudaMallocAsync: "The allocation must not be accessed until the allocation operation
        # completes": freeing it on a stream not ordered after the allocation is refused too)
        return cudaErrorInvalidValue
    if s.capture is not None:
        # cudaFreeAsync: "During stream capture, this function results in the creation of a free
        # node and must therefore be passed the address of a graph allocation."
        return cudaErrorInvalidValue
    if _use_not_ordered_before(R, a, s):
        # r68d: "The allocation must not be accessed after stream execution reaches the free":
        # a pending use on another stream the free is not ordered after (no event wait) races it
        return cudaErrorInvalidValue
    pool, n = R.async_allocs.pop(a.base)
    # cudaFreeAsync: "After this API returns, accessing the memory from any subsequent work launched
    # on the GPU or querying its pointer attributes results in undefined behavior": refused from now
    R.freeing.add(a.base)

    def run():
        R.mem.remove(a)
        R.freeing.discard(a.base)
        with R.mlock:
            pool.used -= n
    rc, _seq = _enqueue(R, s, run, "free", "cudaFreeAsync")
    if rc:
        R.freeing.discard(a.base)
        R.async_allocs[a.base] = (pool, n)
    return rc


def cudaMemPoolSetAttribute(R, memPool, attr, value):
    """CUDA Runtime API, cudaMemPoolSetAttribute: the reuse flags (int), the release
    threshold (cuuint64_t) and the two high watermarks, which can only be reset to 0;
    the current sizes are read-only (cudaErrorInvalidValue)."""
    pool = _lookup(R.pools, memPool)
    if pool is None:
        return cudaErrorInvalidResourceHandle
    if _is_null(value):
        return cudaErrorInvalidValue
    rc = _pool_call_in_capture(R)     # r68d: potentially unsafe in a capture (NVIDIA/cccl PR 11360)
    if rc:
        return rc
    if attr in pool.reuse:
        # (r69d) CUDA Runtime API, cudaMemPoolSetAttribute: cudaMemPoolReuseFollowEventDependencies,
        # cudaMemPoolReuseAllowOpportunistic and cudaMemPoolReuseAllowInternalDependencies are
        # "(value type = int) Allow ... (default enabled)": on/off switches.  The page says nothing
        # of other values (2 or -1 were read as 1 before r69d): refused, nothing changed.
        v = _pool_value(value, "int *")
        if v not in (0, 1):
            return cudaErrorInvalidValue
        pool.reuse[attr] = v
    elif attr == _POOL_RELEASE_THRESHOLD:
        pool.release_threshold = _pool_value(value, "unsigned long long *")
    elif attr in (_POOL_RESERVED_HIGH, _POOL_USED_HIGH):
        if _pool_value(value, "unsigned long long *") != 0:
            return cudaErrorInvalidValue
        with R.mlock:
            if attr == _POOL_RESERVED_HIGH:
                pool.reserved_high = pool.reserved
            else:
                pool.used_high = pool.used
    else:
        return cudaErrorInvalidValue
    return cudaSuccess


def cudaMemPoolGetAttribute(R, memPool, attr, value):
    pool = _lookup(R.pools, memPool)
    if pool is None:
        return cudaErrorInvalidResourceHandle
    if _is_null(value):
        return cudaErrorInvalidValue
    rc = _pool_call_in_capture(R)     # r68d: potentially unsafe in a capture (NVIDIA/cccl PR 11360)
    if rc:
        return rc
    if attr in pool.reuse:
        _put(value, pool.reuse[attr], "int *")
        return cudaSuccess
    with R.mlock:
        got = {_POOL_RELEASE_THRESHOLD: pool.release_threshold, _POOL_RESERVED_CURRENT: pool.reserved,
               _POOL_RESERVED_HIGH: pool.reserved_high, _POOL_USED_CURRENT: pool.used,
               _POOL_USED_HIGH: pool.used_high}.get(attr)
    if got is None:
        return cudaErrorInvalidValue
    _put(value, got, "unsigned long long *")
    return cudaSuccess


def cudaMemPoolTrimTo(R, memPool, minBytesToKeep):
    """CUDA Runtime API, cudaMemPoolTrimTo: release unused pool memory, keeping at least
    ``minBytesToKeep`` reserved bytes (whole pages) and memory in use."""
    pool = _lookup(R.pools, memPool)
    if pool is None:
        return cudaErrorInvalidResourceHandle
    if minBytesToKeep < 0:
        return cudaErrorInvalidValue
    rc = _pool_call_in_capture(R)     # r68d: potentially unsafe in a capture (docs silent: refused)
    if rc:
        return rc
    # minBytesToKeep (Runtime API, cudaMemPoolTrimTo): "If the pool has less than minBytesToKeep
    # reserved, the TrimTo operation is a no-op.  Otherwise the pool will be guaranteed to have at
    # least minBytesToKeep bytes reserved after the operation."  The pool holds whole pages, so
    # it keeps the fewest pages covering the bound, rounded up (r67c: it rounded down and left
    # less reserved than asked), and never the pages backing bytes in use ("The allocator cannot
    # release OS allocations that back outstanding asynchronous allocations").
    with R.mlock:
        keep = max(-(-pool.used // _POOL_CHUNK) * _POOL_CHUNK, -(-minBytesToKeep // _POOL_CHUNK) * _POOL_CHUNK)
        release = max(0, pool.reserved - keep)
        pool.reserved -= release
        R.devices[pool.device].used -= release
    return cudaSuccess


def cudaMemPoolSetAccess(R, memPool, descList, count):
    """CUDA Runtime API, cudaMemPoolSetAccess: "Controls visibility of pools between devices";
    each cudaMemAccessDesc gives one device's access (cudaMemAccessFlagsProtNone / ProtRead /
    ProtReadWrite).  A refused list applies nothing; the first refused entry gives the code.
    The Runtime API lists only cudaErrorInvalidValue; the other codes were measured on an H100,
    tests/conformance/cuda_h100_2026-12-05.json, scenario pool_rules_one_device (driver
    580.159.04, libcudart 13.0): the host location cudaErrorNotSupported, a device out of range
    cudaErrorInvalidDevice, another flag value cudaErrorInvalidValue, and a change to the owner's
    own access (allocations are always accessible from the pool's device) cudaErrorNotSupported
    to read-only, cudaErrorInvalidDevice to none.  Other location types (not measured):
    cudaErrorInvalidValue."""
    pool = _lookup(R.pools, memPool)
    if pool is None:
        return cudaErrorInvalidResourceHandle
    if count < 0 or (count and _is_null(descList)):
        return cudaErrorInvalidValue
    rc = _pool_call_in_capture(R)     # r68d: potentially unsafe in a capture (docs silent: refused)
    if rc:
        return rc
    fields = _ints(descList, 3 * count) if count else []
    changes = {}
    for i in range(count):
        kind, device, flags = fields[3 * i:3 * i + 3]
        if kind == _LOCATION_HOST:
            return cudaErrorNotSupported
        if kind != _LOCATION_DEVICE:
            return cudaErrorInvalidValue
        if not (0 <= device < len(R.devices)):
            return cudaErrorInvalidDevice
        if flags not in (_ACCESS_NONE, _ACCESS_READ, _ACCESS_READ_WRITE):
            return cudaErrorInvalidValue
        if device in changes:
            # (r79a) One device named twice in one call: "Each descriptor instructs the access to
            # enable for a single gpu" (cudaMemPoolSetAccess), not which of two for one gpu wins.
            # Docs silent: refused (cudaErrorInvalidValue), nothing applied, as cuMemSetAccess
            # refuses one location twice (r70d); before r79a the last descriptor won.
            return cudaErrorInvalidValue
        if device == pool.device and flags != _ACCESS_READ_WRITE:
            return cudaErrorNotSupported if flags == _ACCESS_READ else cudaErrorInvalidDevice
        if device != pool.device and flags != _ACCESS_NONE and not core.peer_capable(
                R.devices[device].physical, R.devices[pool.device].physical):
            # (r71g) Access for a device that cannot access the pool's device directly
            # (cudaDeviceCanAccessPeer 0: ACCEL_SIM_PEER).  CUDA Programming Guide, Stream Ordered
            # Memory Allocator, "Device Accessibility for Multi-GPU Support": pool accessibility
            # "does not follow cudaDeviceEnablePeerAccess", and the section's example
            # setAccessOnDevice checks cudaDeviceCanAccessPeer first and returns
            # cudaErrorPeerAccessUnsupported when it is 0, before calling cudaMemPoolSetAccess.  What
            # cudaMemPoolSetAccess itself returns then is not documented (not measured): refused
            # with cudaErrorPeerAccessUnsupported, the code the guide's example uses; nothing applied.
            return cudaErrorPeerAccessUnsupported
        changes[device] = flags
    with R.mlock:
        for device, flags in changes.items():
            if device == pool.device:
                continue
            if flags == _ACCESS_NONE:
                pool.access.pop(device, None)
            else:
                pool.access[device] = flags
    return cudaSuccess


def cudaMemPoolGetAccess(R, flags, memPool, location):
    """CUDA Runtime API, cudaMemPoolGetAccess: "the accessibility of the pool's memory from the
    specified location" (read-write for the pool's own device)."""
    pool = _lookup(R.pools, memPool)
    if pool is None:
        return cudaErrorInvalidResourceHandle
    if _is_null(flags) or _is_null(location):
        return cudaErrorInvalidValue
    kind, device = _ints(location, 2)
    if kind != _LOCATION_DEVICE or not (0 <= device < len(R.devices)):
        return cudaErrorInvalidValue
    rc = _pool_call_in_capture(R)     # r68d: potentially unsafe in a capture (docs silent: refused)
    if rc:
        return rc
    _put(flags, _ACCESS_READ_WRITE if device == pool.device else pool.access.get(device, _ACCESS_NONE))
    return cudaSuccess
