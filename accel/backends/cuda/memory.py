"""Device and pinned host memory, copies and fills (a mixin of
:class:`accel.backends.cuda.CudaBackend`).

cudaMalloc and cudaHostAlloc are "potentially unsafe" calls that invalidate a global-mode
capture; the memory outlives replays, so while a capture is underway in the process they run
with this thread in relaxed capture mode (:meth:`_call_maybe_capturing`, as torch's
cudaMallocMaybeCapturing; :mod:`.mempool` uses it for the pool calls too), and an allocation
the caller never gets (a Ctrl-C as the runtime returns) is freed here.

Every copy is cudaMemcpyAsync with cudaMemcpyDefault (the direction from unified addresses),
refused when neither pointer is inside a live CUDA allocation; between devices,
cudaMemcpyPeerAsync, the only copy the driver stages through the host for pool and mapped
memory when peers have no access.  ``pointer_location`` is cudaPointerGetAttributes.
"""

from __future__ import annotations

from typing import Optional, Tuple

from .._signals import deferred
from .graphs import _CAPTURE_MODES

# Integer #defines from driver_types.h (CUDA 13).
_HOST_ALLOC_DEFAULT = 0x00         # cudaHostAllocDefault
_MEMCPY_DEFAULT = 4                # cudaMemcpyDefault: direction inferred from unified addresses


class CudaMemoryMixin:
    """mem_alloc/free, host_alloc/free, memcpy/memset and pointer_location; state lives in
    ``CudaBackend.__init__``."""

    def mem_alloc(self, nbytes: int) -> int:
        return self._alloc_maybe_capturing("cudaMalloc", self.lib.cudaMalloc, self.lib.cudaFree, nbytes,
                                           what="device memory")

    def _alloc_maybe_capturing(self, call: str, alloc, free, nbytes, *args, what: str) -> int:
        """``alloc(void **, nbytes, *args)`` (cudaMalloc, cudaHostAlloc), checked (the error
        names ``nbytes`` of ``what``); the pointer as an int."""
        p = self.ffi.new("void **")
        rc = None
        try:
            # cudaMalloc is a "potentially unsafe" call that invalidates a global-mode capture; it
            # is fine as long as the memory outlives replays, so the mode is relaxed around it
            # (torch's cudaMallocMaybeCapturing does the same)
            rc = self._call_maybe_capturing(alloc, p, nbytes, *args)
            self._check(rc, call, f"requested {nbytes} bytes of {what}")
            return self._as_int(p[0])
        except BaseException:
            # The memory is allocated but the caller never gets it: a KeyboardInterrupt as the
            # runtime returned (CPython runs a signal's handler right after a C call, before its
            # result is stored), or the capture mode's restore failing after the allocation (the
            # thread is still relaxed then, so the free is allowed).  Freed here, so a failed or
            # interrupted allocation leaves nothing (the runtime writes the pointer only on
            # success; p starts NULL).
            if rc in (None, 0) and p[0] != self.ffi.NULL:
                # (relaxed as the allocation was: in a global capture a plain cudaFree is refused
                # and invalidates it, r69a)
                self._call_maybe_capturing(free, p[0])
            raise

    def _call_maybe_capturing(self, fn, *args) -> int:
        """``fn(*args)``'s return code, in relaxed capture mode while a capture is underway in
        this process (no capture begins meanwhile: the gate), for a "potentially unsafe" call
        that acts at once and must not invalidate a capture (allocations, memory pool calls)."""
        # (rc stored inside the with: a signal checked as the call returns then lands in the
        # with's cleanup range, which releases the gate; tests/test_interrupt_fresh_r57.py)
        with self.capture_gate:
            if self._captures:
                rc = self._call_relaxed(fn, *args)
            else:
                rc = fn(*args)
        return rc

    @deferred
    def _call_relaxed(self, fn, *args) -> int:
        """``fn(*args)`` with this thread in relaxed capture mode, its own mode restored after.
        Signals are deferred (none of these calls waits): a Ctrl-C between the two exchanges
        would leave the thread relaxed, every later unsafe call of it unchecked (r69a).  A
        failed restore is tried once more before it raises, for the same reason."""
        exchange = self.lib.cudaThreadExchangeStreamCaptureMode
        mode = self.ffi.new("enum cudaStreamCaptureMode *", _CAPTURE_MODES["relaxed"])
        self._check(exchange(mode), "cudaThreadExchangeStreamCaptureMode")
        try:
            rc = fn(*args)
        finally:
            err = exchange(mode)     # (a failed exchange leaves *mode as it was)
            if err:
                err = exchange(mode)
                if not err:
                    self.lib.cudaGetLastError()      # (the first failure's, now moot)
        self._check(err, "cudaThreadExchangeStreamCaptureMode", "restoring this thread's capture mode")
        return rc

    def mem_free(self, ptr: int) -> None:
        self._check(self.lib.cudaFree(self.ffi.cast("void *", ptr)), "cudaFree")

    def host_alloc(self, nbytes: int) -> int:
        return self._alloc_maybe_capturing("cudaHostAlloc", self.lib.cudaHostAlloc, self.lib.cudaFreeHost,
                                           nbytes, _HOST_ALLOC_DEFAULT, what="pinned host memory")

    def host_free(self, ptr: int) -> None:
        self._check(self.lib.cudaFreeHost(self.ffi.cast("void *", ptr)), "cudaFreeHost")

    # -- copies ----------------------------------------------------------------
    def _registered(self, ptr: int) -> bool:
        """True when ``ptr`` lies in memory the runtime knows (device, pinned or managed)."""
        attrs = self.ffi.new("struct cudaPointerAttributes *")
        self._check(self.lib.cudaPointerGetAttributes(attrs, self.ffi.cast("void *", ptr)),
                    "cudaPointerGetAttributes")
        return attrs.type != self.lib.cudaMemoryTypeUnregistered

    def pointer_location(self, ptr: int) -> Optional[Tuple[str, int]]:
        # cudaPointerGetAttributes (Runtime API, Unified Addressing): type Device/Managed/Host/
        # Unregistered and the device of the allocation, for any address inside one.
        attrs = self.ffi.new("struct cudaPointerAttributes *")
        self._check(self.lib.cudaPointerGetAttributes(attrs, self.ffi.cast("void *", ptr)),
                    "cudaPointerGetAttributes")
        kind = {self.lib.cudaMemoryTypeDevice: "device", self.lib.cudaMemoryTypeManaged: "managed",
                self.lib.cudaMemoryTypeHost: "host"}.get(attrs.type)
        return (kind, attrs.device) if kind is not None else ("unknown", -1)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        cast = self.ffi.cast
        if nbytes and not self._registered(dst) and not self._registered(src):
            # cudaMemcpyDefault takes two unknown pointers as host memory and memmoves on the host:
            # a freed device pointer there crashes the process.  accel never copies host to host.
            raise ValueError(f"cuda: memcpy_async({dst:#x}, {src:#x}, {nbytes}): neither pointer is inside a "
                             f"live CUDA allocation (freed or foreign memory?); copy to or from memory "
                             f"returned by mem_alloc/host_alloc that has not been freed")
        self._check(self.lib.cudaMemcpyAsync(cast("void *", dst), cast("void *", src), nbytes,
                                             _MEMCPY_DEFAULT, self._cast("cudaStream_t", stream)),
                    "cudaMemcpyAsync")

    def memcpy_peer_async(self, dst: int, dst_index: int, src: int, src_index: int, nbytes: int,
                          stream: int) -> None:
        # Between devices without peer access the driver stages the copy through the host, and
        # only cudaMemcpyPeerAsync does so for pool (cudaMallocAsync) and mapped (cuMemMap)
        # memory (torch, ATen/native/cuda/Copy.cu and CUDACachingAllocator's memcpyAsync:
        # "when p2p is not enabled, only cudaMemcpyPeerAsync correctly handles memory not
        # allocated via cudaMalloc"); cudaMemcpyAsync faults there (cudaErrorIllegalAddress).
        cast = self.ffi.cast
        self._check(self.lib.cudaMemcpyPeerAsync(cast("void *", dst), dst_index, cast("void *", src), src_index,
                                                 nbytes, self._cast("cudaStream_t", stream)),
                    "cudaMemcpyPeerAsync")

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        # Hot path: the cached cdata read inline (_cast's lookup), _check only on failure.
        rc = self.lib.cudaMemsetAsync(self.ffi.cast("void *", ptr), value, nbytes,
                                      self._handles.get(stream) or self._cast("cudaStream_t", stream))
        if rc:
            self._check(rc, "cudaMemsetAsync")
