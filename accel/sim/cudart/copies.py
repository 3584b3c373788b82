"""Copies and memsets (synchronous, asynchronous, peer), and the faults of touching memory a
device may not: freed, unmapped or no-access virtual memory, pool memory without access.
"""

from __future__ import annotations

from .. import _memory, _vmm
from ..core import ffi
from .state import (
    _CHARP, _MEMCPY_D2D, _MEMCPY_DEFAULT, _MEMCPY_KINDS, _IllegalAddress, Runtime, Stream, _addr,
    cudaErrorInvalidDevice, cudaErrorInvalidMemcpyDirection, cudaErrorInvalidResourceHandle,
    cudaErrorInvalidValue, cudaErrorStreamCaptureUnsupported, cudaSuccess,
)
from .common import _async_unusable, _enqueue, _invalidate, _stream, _unsafe_call
from .pools import _pool_access_problem, _pool_memory


# -- copies ------------------------------------------------------------------------------

def _range_ok(a, addr: int, n: int) -> bool:
    return a is None or addr + n <= a.end


def _copy_op(dst: int, src: int, staged, n: int, da, sa):
    lock = (da.lock if da.__class__ is _vmm.Region else None) or \
        (sa.lock if sa.__class__ is _vmm.Region else None)
    if lock is not None:
        # Virtual memory may be unmapped while the copy is queued (cuMemUnmap does not wait): check
        # and copy under the space's lock, so the pages cannot go between the two.
        def vop():
            with lock.shared():
                for r in (da, sa):
                    why = r.problem() if r.__class__ is _vmm.Region else None
                    if why is None and r is not None and not r.live:
                        why = "freed memory"
                    if why:
                        raise _IllegalAddress(f"copy of {n} bytes 0x{src:x} -> 0x{dst:x}: {why}")
                ffi.memmove(ffi.cast(_CHARP, dst), staged if staged is not None else ffi.cast(_CHARP, src), n)
        vop.allocs = (da, sa)
        return vop

    def op():
        if (da is not None and not da.live) or (sa is not None and not sa.live):
            raise _IllegalAddress(f"copy of {n} bytes 0x{src:x} -> 0x{dst:x} touches freed memory")
        ffi.memmove(ffi.cast(_CHARP, dst), staged if staged is not None else ffi.cast(_CHARP, src), n)
    op.allocs = (da, sa)    # what it touches (a graph launch checks its copy nodes: graphs.py)
    return op


def _fault_op(why: str):
    def op():
        raise _IllegalAddress(why)
    return op


def _vmm_fault(R: Runtime, s: Stream, why: str, sync: bool, kind: str) -> int:
    """Queue an access to unmapped or inaccessible virtual memory: it faults when it runs, as the
    device's access would (cudaErrorIllegalAddress, sticky)."""
    rc, seq = _enqueue(R, s, _fault_op(f"{kind} on device {s.device}: {why}"), kind, kind)
    if rc:
        return rc
    if sync and seq:
        s.q.wait(seq)
        return R.sticky
    return cudaSuccess


def _memcpy(R: Runtime, dst, src, count, kind, s: Stream, sync: bool, label: str = "memcpy",
            staged_peer=None) -> int:
    """``staged_peer``: (dstDevice, srcDevice) of a cudaMemcpyPeerAsync between two devices
    (r71g; any two since session 32): the driver stages it where no access was granted, each
    device touching its own memory only, so each side's access is checked for its own device
    instead of the stream's."""
    if not (0 <= kind <= 4):
        return cudaErrorInvalidMemcpyDirection
    if count < 0:
        return cudaErrorInvalidValue
    staged = None
    if isinstance(src, (bytes, bytearray, memoryview)):
        staged = bytes(memoryview(src).cast("B")[:count])
        if len(staged) < count:
            return cudaErrorInvalidValue
        sp = 0
    else:
        sp = _addr(src)
    dp = _addr(dst)
    if count == 0:
        return cudaSuccess
    if dp == 0 or (staged is None and sp == 0):
        return cudaErrorInvalidValue
    if staged is None and dp < sp + count and sp < dp + count:
        # CUDA Runtime API, cudaMemcpy / cudaMemcpyAsync: "The memory areas may not overlap."
        # What an overlapping copy does is not said (copy engines need not copy as memmove
        # does): refused, the identical range included.
        return cudaErrorInvalidValue
    da = R.mem.find(dp)
    sa = R.mem.find(sp) if staged is None else None
    if R.vmm.reservations:
        # The stream's device reads the source and writes the destination: both must be mapped
        # with access for it, else the copy faults (cuMemSetAccess; docs silent on copies of other
        # devices: refused unless that device was granted access).
        dd, sd = staged_peer or (s.device, s.device)
        dv = R.vmm.resolve(dp, count, dd, True) if da is None else None
        sv = R.vmm.resolve(sp, count, sd, False) if sa is None and staged is None else None
        if s.capture is not None:
            # (r70d) A captured copy runs at each graph launch: it touches the addresses as mapped,
            # and with the access set, then (_vmm.Region.at_launch; it kept capture time's before).
            if dv is not None:
                dv = _vmm.Region.at_launch(R.vmm, dp, count, dd, True)
            if sv is not None:
                sv = _vmm.Region.at_launch(R.vmm, sp, count, sd, False)
        for v in (dv, sv):
            if v.__class__ is str:
                return _vmm_fault(R, s, v, sync, "memcpy")
        if dv is not None:
            da = dv
        if sv is not None:
            sa = sv
    for freed in (_memory.in_device_range, _memory.in_pinned_range):
        if (da is None and freed(dp, count)) or (sa is None and staged is None and freed(sp, count)):
            # Device or pinned host memory no live allocation of this runtime holds: freed
            # (cudaFree: "Frees the memory space pointed to by devPtr"; cudaFreeHost: "Frees the
            # memory space pointed to by ptr", its pages unmapped), or another library's.  Never
            # pageable host memory: both ranges are reserved address space.  cudaMemcpy needs
            # valid pointers and is silent on freed ones: refused.
            return cudaErrorInvalidValue
    if not _range_ok(da, dp, count) or not _range_ok(sa, sp, count):
        return cudaErrorInvalidValue
    if _async_unusable(R, da, s) or _async_unusable(R, sa, s):
        return cudaErrorInvalidValue
    if R.async_allocs or R.gmem.allocs:
        # pool and graph memory: only the devices the pool lets in (cudaMemPoolSetAccess)
        dd, sd = staged_peer or (s.device, s.device)
        why = _pool_access_problem(R, da, dd, True) or _pool_access_problem(R, sa, sd, False)
        if why is not None:
            return _vmm_fault(R, s, f"0x{sp:x} -> 0x{dp:x}: {why}", sync, "memcpy")
    if kind != _MEMCPY_DEFAULT and _MEMCPY_KINDS[kind] != (
            da is not None and da.kind == _memory.DEVICE, sa is not None and sa.kind == _memory.DEVICE):
        # CUDA Runtime API, cudaMemcpy / cudaMemcpyAsync: "Calling cudaMemcpy() with dst and src
        # pointers that do not match the direction of the copy results in an undefined
        # behavior": refused (pinned and pageable host memory are both host memory).
        return cudaErrorInvalidValue
    pageable_dst = da is None
    if staged is None and sa is None:
        if s.capture is not None:   # graphs cannot replay a copy from pageable memory
            _invalidate(R, s.capture)
            return cudaErrorStreamCaptureUnsupported
        # Pageable source: the runtime stages it before returning, so the
        # caller may reuse its buffer at once.
        staged = ffi.buffer(ffi.cast(_CHARP, sp), count)[:]
    if pageable_dst and s.capture is not None:
        _invalidate(R, s.capture)
        return cudaErrorStreamCaptureUnsupported
    if sync and R.captures:
        rc = _unsafe_call(R)
        if rc:
            return rc
    rc, seq = _enqueue(R, s, _copy_op(dp, sp, staged, count, da, sa), "memcpy", label)
    if rc:
        return rc
    if (sync or pageable_dst) and seq:
        # cudaMemcpy, and copies into pageable memory, return once the copy is done.
        s.q.wait(seq)
        if sync:
            return R.sticky
    return cudaSuccess


def cudaMemcpyAsync(R, dst, src, count, kind, stream=None):
    s = _stream(R, stream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    return _memcpy(R, dst, src, count, kind, s, False)


def cudaMemcpy(R, dst, src, count, kind):
    return _memcpy(R, dst, src, count, kind, R.devices[R.tls.device].legacy, True)


def cudaMemcpyPeerAsync(R, dst, dstDevice, src, srcDevice, count, stream=None):
    n = len(R.devices)
    if not (0 <= dstDevice < n and 0 <= srcDevice < n):
        return cudaErrorInvalidDevice
    s = _stream(R, stream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    da, sa = R.mem.find(_addr(dst)), R.mem.find(_addr(src))
    if R.vmm.reservations:
        da = da or R.vmm.mapping_at(_addr(dst))
        sa = sa or R.vmm.mapping_at(_addr(src))
    if da is None or sa is None or da.device != dstDevice or sa.device != srcDevice:
        return cudaErrorInvalidValue
    staged_peer = None
    if dstDevice != srcDevice:
        # (r71g) Between devices that cannot access each other (cudaDeviceCanAccessPeer 0,
        # ACCEL_SIM_PEER) the copy is staged by the driver through the host, each device reading or
        # writing its own memory; between peer-capable ones too when the access was not granted
        # (session 32: a graph's pool allocation keeps the access of capture time): the
        # Programming Guide, "Peer-to-Peer Memory Copy": "if peer-to-peer access is enabled ...
        # peer-to-peer memory copy between these two devices no longer needs to be staged through
        # the host", so without it the copy is staged, not refused.  The simulator stages every
        # peer copy: the bytes and ordering are the same, only speed differs.  CUDA Runtime API,
        # cudaMemcpyPeerAsync: "Copies memory from one device to memory on another device", with no condition on peer access (Programming Guide,
        # "Peer-to-Peer Memory Copy": "Memory copies can be performed between the memories of two
        # different devices").  torch relies on it for pool memory (ATen/native/cuda/Copy.cu:
        # "copies of cudaMallocAsynced memory between devices that aren't peer-to-peer-capable
        # need cudaMemcpyPeerAsync"), as NVIDIA advised (alpaka-group/alpaka issue 1909, NVIDIA bug
        # 3446335: cudaMemcpy/cudaMemcpyAsync "are not able to copy memory allocated by
        # cudaMallocAsync across different devices ... use cudaMemcpyPeer or cudaMemcpyPeerAsync").
        # So pool and mapped memory need access only for their own device here, which they always
        # have; cudaMemcpyAsync keeps the stream device's rule.
        staged_peer = (dstDevice, srcDevice)
    return _memcpy(R, dst, src, count, _MEMCPY_D2D, s, False, "memcpy-peer", staged_peer)


def _memset_op(dp: int, value: int, n: int, a, foreign=None):
    if foreign is not None:
        peers, device = foreign

        def fop():
            # (r69d) checked when the memset runs, as a kernel's access is (devices._device_view):
            # peer access enabled or disabled meanwhile counts ("immediately")
            if a.device not in peers:
                raise _IllegalAddress(
                    f"memset of {n} bytes at 0x{dp:x} on device {device}: memory of device {a.device} without "
                    f"peer access (cudaDeviceEnablePeerAccess({a.device}, 0) on device {device})")
            op()
        op = _memset_op(dp, value, n, a)
        fop.allocs = op.allocs
        return fop
    if a.__class__ is _vmm.Region:
        def vop():
            with a.lock.shared():
                why = a.problem()
                if why:
                    raise _IllegalAddress(f"memset of {n} bytes at 0x{dp:x}: {why}")
                import ctypes
                ctypes.memset(dp, value, n)
        vop.allocs = (a,)
        return vop

    def op():
        if not a.live:
            raise _IllegalAddress(f"memset of {n} bytes at 0x{dp:x} touches freed memory")
        import ctypes
        ctypes.memset(dp, value, n)
    op.allocs = (a,)
    return op


def _memset(R: Runtime, devPtr, value, count, s: Stream, sync: bool) -> int:
    if count < 0:
        return cudaErrorInvalidValue
    if count == 0:
        return cudaSuccess
    dp = _addr(devPtr)
    a = R.mem.find(dp) if dp else None
    if a is None and dp and R.vmm.reservations:
        a = R.vmm.resolve(dp, count, s.device, True)
        if a is not None and s.capture is not None:
            # (r70d) a captured memset touches the address as mapped at each launch (as a copy)
            a = _vmm.Region.at_launch(R.vmm, dp, count, s.device, True)
        elif a.__class__ is str:
            return _vmm_fault(R, s, a, sync, "memset")
    if a is None or dp + count > a.end or _async_unusable(R, a, s):
        return cudaErrorInvalidValue
    if R.async_allocs or R.gmem.allocs:
        why = _pool_access_problem(R, a, s.device, True)
        if why is not None:
            return _vmm_fault(R, s, f"0x{dp:x}: {why}", sync, "memset")
    foreign = None
    if a.__class__ is not _vmm.Region and a.kind == _memory.DEVICE and a.device != s.device \
            and not _pool_memory(R, a):
        # (r69d) A memset by one device (the stream's) into another device's cudaMalloc memory.  CUDA
        # Runtime API, cudaDeviceEnablePeerAccess: "On success, all allocations from peerDevice will
        # immediately be accessible by the current device" -- not before; the pages of cudaMemset /
        # cudaMemsetAsync are silent on memory the stream's device cannot access.  Kernels already
        # fault there (cudaErrorIllegalAddress, devices._device_view); the memset ran before r69d (the
        # README listed it as still lenient).  It is queued and faults when it runs (700, sticky),
        # unless the stream's device has peer access to the memory's then.  Pool and graph memory
        # follow cudaMemPoolSetAccess instead (above); pinned host memory is every device's.
        foreign = (R.devices[s.device].peers, s.device)
    if sync and R.captures:
        rc = _unsafe_call(R)
        if rc:
            return rc
    rc, seq = _enqueue(R, s, _memset_op(dp, value & 0xFF, count, a, foreign), "memset", "memset")
    if rc:
        return rc
    if sync and seq:
        s.q.wait(seq)
        return R.sticky
    return cudaSuccess


def cudaMemsetAsync(R, devPtr, value, count, stream=None):
    s = _stream(R, stream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    # CUDA Programming Guide, "Multi-Device System" (Stream and Event Behavior): "A kernel launch will
    # fail if it is issued to a stream that is not associated to the current device ... A memory copy
    # will succeed even if it is issued to a stream that is not associated to the current device."
    # A memset is neither; the guide is silent, so the simulator refuses it as a launch (r72): a
    # caller sets the stream's device first, as accel does.
    if s.device != R.tls.device:
        return cudaErrorInvalidResourceHandle
    return _memset(R, devPtr, value, count, s, False)


def cudaMemset(R, devPtr, value, count):
    return _memset(R, devPtr, value, count, R.devices[R.tls.device].legacy, True)
