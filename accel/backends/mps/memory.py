"""Memory: buffers for device and pinned memory, pointer lookup, copies and fills, ``mem_info``.

* **Pointers.**  Metal has buffers, not device addresses.  Every allocation is
  an ``MTLBuffer`` in shared storage (Apple GPUs have unified memory), and the
  "device pointer" handed out is its ``contents`` address.  A sorted table of
  base addresses resolves any interior pointer to ``(buffer, offset)`` with
  ``bisect``, so copies, fills and kernel arguments take sub-ranges of a
  block exactly as CUDA pointers do.  Pinned host memory is the same kind of
  buffer (what torch's MPS pinned allocator does).
* **Copies.**  Buffer to buffer: a blit ``copyFromBuffer:...``.  Pageable
  host to buffer: the source is copied into a staging buffer before the call
  returns (``newBufferWithBytes:length:options:``), then blitted in order.
  To pageable host: the stream is synchronized and the bytes are copied on the
  host (unified memory).  macOS requires blit offsets and sizes to be
  multiples of 4; other copies and fills take the synchronize-and-copy-on-the-
  host path.
* **mem_info**: ``recommendedMaxWorkingSetSize`` less ``currentAllocatedSize``.
"""

from __future__ import annotations

import bisect
import operator
from typing import Any, Optional, Tuple

from ..._errors import OutOfMemoryError
from .._signals import deferred
from ._library import _LIBRARY, _STORAGE_SHARED, M_BLIT_ENCODER, M_CONTENTS, M_COPY, M_CURRENT_ALLOCATED, \
    M_FILL, M_MAX_BUFFER_LENGTH, M_NEW_BUFFER, M_NEW_BUFFER_BYTES, M_RECOMMENDED_MAX


class _Buffer:
    __slots__ = ("obj", "base", "length", "host")

    def __init__(self, obj: Any, base: int, length: int, host: bool):
        self.obj, self.base, self.length, self.host = obj, base, length, host


class MemoryMixin:
    """Buffers (``_buffers``, ``_bases``), pointer resolution, copies and fills onto streams."""

    def mem_info(self) -> Tuple[int, int]:
        """(recommendedMaxWorkingSetSize - currentAllocatedSize, recommendedMaxWorkingSetSize)."""
        with self._lock:        # the device is not released meanwhile (see DiscoveryMixin.properties)
            rt = self._runtime()
            total = int(rt.send(self._device, M_RECOMMENDED_MAX))
            used = int(rt.send(self._device, M_CURRENT_ALLOCATED))
        return max(total - used, 0), total

    def _new_buffer(self, nbytes: int, host: bool, register: bool = True) -> _Buffer:
        rt = self._rt
        obj = rt.send(self._device, M_NEW_BUFFER, nbytes, _STORAGE_SHARED)
        if obj == rt.nil:  # Metal's out-of-memory answer
            max_buffer = int(rt.send(self._device, M_MAX_BUFFER_LENGTH))
            if nbytes > max_buffer:
                # MTLDevice.maxBufferLength caps one buffer, however much memory is free (torch MPS
                # refuses such a size as "Invalid buffer size").
                raise OutOfMemoryError(
                    f"mps: cannot allocate {nbytes} bytes in one buffer: the device's maxBufferLength is "
                    f"{max_buffer} bytes (newBufferWithLength: returned nil); allocate smaller pieces",
                    library=_LIBRARY, call=M_NEW_BUFFER.selector)
            used = int(rt.send(self._device, M_CURRENT_ALLOCATED))
            limit = int(rt.send(self._device, M_RECOMMENDED_MAX))
            raise OutOfMemoryError(
                f"mps: newBufferWithLength:{nbytes} options:shared returned nil (out of memory; "
                f"{used} bytes allocated, recommended working set {limit} bytes)",
                library=_LIBRARY, call=M_NEW_BUFFER.selector)
        buf = _Buffer(obj, rt.address(rt.send(obj, M_CONTENTS)), nbytes, host)
        if register:
            with self._lock:
                self._buffers[buf.base] = buf
                bisect.insort(self._bases, buf.base)
        return buf

    @deferred
    def _alloc(self, nbytes: int, host: bool) -> int:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool):
            raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative number of bytes ({nbytes})")
        self._runtime()
        if nbytes == 0:
            return 0  # as cudaMalloc(0): a null pointer that may be freed
        with self._lock:        # the device is not released meanwhile (see DiscoveryMixin.properties)
            rt = self._runtime()
            if nbytes >= 1 << 64:
                # More than an NSUInteger holds (the argument of newBufferWithLength:): no device has it.
                max_buffer = int(rt.send(self._device, M_MAX_BUFFER_LENGTH))
                raise OutOfMemoryError(
                    f"mps: cannot allocate {nbytes} bytes: more than an NSUInteger holds; the device's "
                    f"maxBufferLength is {max_buffer} bytes; allocate smaller pieces",
                    library=_LIBRARY, call=M_NEW_BUFFER.selector)
            return self._new_buffer(nbytes, host).base

    def _free(self, ptr: int, host: bool) -> None:
        if ptr == 0:
            return
        self._runtime()         # (refuses a runtime torn down or of the parent process)
        if not host:
            with self._lock:
                self._freeable(ptr, host)
            # torch's MPS allocator commits and waits for the stream before it releases cached
            # buffers (aten/src/ATen/mps/MPSAllocator.mm, release_cached_buffers: "before
            # releasing the buffers make sure the command buffer has finished"): a command
            # buffer retains the buffers it uses, so an open one would keep this memory with
            # Metal (currentAllocatedSize) until some later synchronize.  As cudaFree, a failed
            # wait raises before anything is freed.
            self.device_synchronize()
        self._release_buffer(ptr, host)

    @deferred
    def _release_buffer(self, ptr: int, host: bool) -> None:
        """Forget and release the buffer at ``ptr``; signals deferred: a handler run between
        the two would leave a live buffer nobody can free, or a table entry for a dead one."""
        with self._lock:
            buf = self._freeable(ptr, host)
            del self._buffers[ptr]
            del self._bases[bisect.bisect_left(self._bases, ptr)]
        # Command buffers retain the buffers they use: queued work still reads valid memory.
        self._rt.release(buf.obj)

    def _freeable(self, ptr: int, host: bool) -> _Buffer:
        """The live buffer at ``ptr`` of that kind (lock held), else the error naming it."""
        buf = self._buffers.get(ptr)
        if buf is None or buf.host != host:
            raise self._missing("pointer", ptr, f"free only pointers returned by "
                       f"{'host_alloc' if host else 'mem_alloc'}, once")
        return buf

    def mem_alloc(self, nbytes: int) -> int:
        return self._alloc(nbytes, host=False)

    def mem_free(self, ptr: int) -> None:
        self._free(ptr, host=False)

    def host_alloc(self, nbytes: int) -> int:
        """Pinned host memory: a shared-storage MTLBuffer (the GPU reads it in place)."""
        return self._alloc(nbytes, host=True)

    def host_free(self, ptr: int) -> None:
        self._free(ptr, host=True)

    def pointer_location(self, ptr: int) -> Optional[Tuple[str, int]]:
        """Inside a live MTLBuffer of this backend: device memory (mem_alloc's buffers) or pinned
        host memory (host_alloc's; both in shared storage); Metal knows no other addresses."""
        try:
            found = self._resolve(ptr, 1)
        except ValueError:
            found = None
        if found is None:
            return ("unknown", -1)
        return ("host", -1) if found[0].host else ("device", 0)

    def dlpack_data(self, ptr: int) -> Tuple[int, int]:
        """A kDLMetal capsule's ``data`` is the id<MTLBuffer> (``byte_offset`` the offset into it),
        as torch's MPS tensors, MLX and TVM read it (torch: getMTLBufferStorage bit-casts the
        storage's data pointer to id<MTLBuffer>); dlpack.h: data "may be opaque on some device
        types", and byte_offset points "to the beginning of the data"."""
        found = self._resolve(ptr, 1)
        if found is None:
            raise ValueError(f"mps: {ptr:#x} is not in an MTLBuffer of this backend; nothing was exported")
        buf, offset = found
        return self._runtime().address(buf.obj), offset

    def dlpack_address(self, data: int, byte_offset: int) -> int:
        """The contents address of a kDLMetal capsule's bytes: ``data`` names one of this
        backend's MTLBuffers (the form torch and accel export), or, as accel exported before, is
        an address inside one.  Anything else is taken as an address, which the importer then
        refuses as memory Metal does not own here: accel encodes work only on buffers it
        allocated, and messaging an unknown object could crash."""
        if not data:
            return byte_offset      # (a zero-size tensor's NULL data)
        with self._lock:
            for buf in self._buffers.values():
                if self._runtime().address(buf.obj) == data:
                    return buf.base + byte_offset
        # an address inside one (accel's earlier form), or memory Metal does not own here, which
        # the importer's range checks then refuse by name (never messaged as an object)
        return data + byte_offset

    def _resolve(self, ptr: int, nbytes: int) -> Optional[Tuple[_Buffer, int]]:
        """(buffer, offset) holding [ptr, ptr+nbytes), or None for memory Metal does not own."""
        if not isinstance(ptr, int) or isinstance(ptr, bool):
            raise TypeError(f"pointer must be an int, got {type(ptr).__name__}")
        with self._lock:
            i = bisect.bisect_right(self._bases, ptr) - 1
            if i < 0:
                return None
            buf = self._buffers[self._bases[i]]
        off = ptr - buf.base
        if off >= buf.length:
            return None
        if off + nbytes > buf.length:
            raise ValueError(f"mps: {nbytes} bytes at {ptr:#x} overrun the {buf.length}-byte "
                             f"allocation at {buf.base:#x}")
        return buf, off

    def _live(self, buf: _Buffer) -> None:
        """Refuse a buffer looked up before the lock was taken and released since (lock held):
        freed, or released by close() (then maybe re-initialized: stream 0 is live again).  A
        blit or a host copy through it would use a released MTLBuffer (a Mac crashes)."""
        if self._buffers.get(buf.base) is not buf:
            raise self._missing("pointer", buf.base, "the allocation was freed (or the backend closed) "
                                "before the work was queued")

    # -- copies -------------------------------------------------------------------------
    def _encode_copy(self, cb: Any, src: _Buffer, soff: int, dst: _Buffer, doff: int, n: int) -> None:
        with self._encoding(cb, M_BLIT_ENCODER) as enc:
            self._rt.send(enc, M_COPY, src.obj, soff, dst.obj, doff, n)

    def _encode_fill(self, cb: Any, dst: _Buffer, off: int, n: int, value: int) -> None:
        rt = self._rt
        rng = rt.ffi.new("NSRange *", (off, n))[0]
        with self._encoding(cb, M_BLIT_ENCODER) as enc:
            rt.send(enc, M_FILL, dst.obj, rng, value & 0xFF)

    def _before_host_write(self, d, stream: int) -> None:
        """Order a host-side copy or fill after the GPU work it must follow.  Into a Metal buffer
        (``d``), every stream: MTLBuffer.h, "The contents become undefined if both the CPU and GPU
        write to the same buffer without a synchronizing action between those writes.  This is
        true even when the regions written do not overlap", and the allocator carves many blocks,
        used on any stream, out of one MTLBuffer.  Into host memory, ``stream`` only."""
        if d is None:
            self.stream_synchronize(stream)
        else:
            self.device_synchronize()

    def _host(self, ptr: int) -> Any:
        return self._rt.ffi.cast("void *", ptr)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        rt = self._runtime()
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        if nbytes == 0:
            return
        for side, ptr in (("dst", dst), ("src", src)):
            if isinstance(ptr, int) and not 0 < ptr < 1 << 64:
                # Memory outside Metal's buffers is copied on the host: such an address would crash
                # the process (cudaMemcpy answers cudaErrorInvalidValue).
                raise ValueError(f"mps: memcpy_async {side} pointer {ptr:#x} is not an address (null, negative "
                                 f"or wider than 64 bits); pass memory from mem_alloc/host_alloc or a live "
                                 f"host buffer; nothing was copied")
        with self._lock:        # one hold: a close between two lookups would pass a released source as host memory
            self._runtime()
            d = self._resolve(dst, nbytes)
            s = self._resolve(src, nbytes)
        if d is not None and nbytes % 4 == 0 and d[1] % 4 == 0 and (s is None or s[1] % 4 == 0):
            self._enqueue_copy(d, s, src, nbytes, stream)
            return
        if d is None and s is None:
            # Neither side is a live Metal buffer: a freed (stale) device pointer looks exactly like
            # host memory here, and a host memmove through it would crash the process.
            raise ValueError(f"mps: memcpy_async({dst:#x}, {src:#x}, {nbytes}): neither pointer is inside a "
                             f"live allocation of this device (freed or foreign memory?); copy to or from "
                             f"memory returned by mem_alloc/host_alloc that has not been freed")
        # Pageable destination or unaligned range: order on the host, copy through unified memory,
        # under the lock with the buffers still live (close() in another thread releases them).
        self._before_host_write(d, stream)
        with self._lock:
            for side in (d, s):
                if side is not None:
                    self._live(side[0])
            rt.ffi.memmove(self._host(dst), self._host(src), nbytes)

    @deferred
    def _enqueue_copy(self, d: Tuple[_Buffer, int], s: Optional[Tuple[_Buffer, int]], src: int, nbytes: int,
                      stream: int) -> None:
        """memcpy_async's blit into buffer ``d`` from buffer ``s``, or from pageable ``src`` (None
        ``s``) through a staging buffer; signals deferred (the encoder and staging buffer are
        made and ended or released within)."""
        rt = self._rt
        with self._lock, rt.pool():
            self._live(d[0])    # looked up before this hold: maybe released since (r43)
            if s is not None:
                self._live(s[0])
            st = self._stream(stream)
            if s is not None:
                self._encode_copy(self._open_cb(st), s[0], s[1], d[0], d[1], nbytes)
                self._encoded(st)
                return
            # Pageable source: copied now into a staging buffer, blitted in order.
            staging = rt.send(self._device, M_NEW_BUFFER_BYTES, self._host(src), nbytes, _STORAGE_SHARED)
            if staging == rt.nil:
                raise OutOfMemoryError(f"mps: no memory for a {nbytes}-byte staging buffer",
                                       library=_LIBRARY, call=M_NEW_BUFFER_BYTES.selector)
            stage = _Buffer(staging, 0, nbytes, True)
            try:
                self._encode_copy(self._open_cb(st), stage, 0, d[0], d[1], nbytes)
            finally:
                rt.release(staging)  # the command buffer holds it until done
            self._encoded(st)

    @deferred
    def _enqueue_fill(self, d: Tuple[_Buffer, int], value: int, nbytes: int, stream: int) -> None:
        with self._lock, self._rt.pool():
            self._live(d[0])    # (as _enqueue_copy)
            st = self._stream(stream)
            self._encode_fill(self._open_cb(st), d[0], d[1], nbytes, value)
            self._encoded(st)

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        rt = self._runtime()
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        try:
            value = operator.index(value)
        except TypeError:
            raise TypeError(f"mps: memset value must be an int (its low byte is written, as cudaMemset), "
                            f"got {type(value).__name__} {value!r}") from None
        if nbytes == 0:
            return
        d = self._resolve(ptr, nbytes)
        if d is None:
            raise self._missing("pointer", ptr, "memset needs memory from mem_alloc or host_alloc")
        if nbytes % 4 == 0 and d[1] % 4 == 0:
            self._enqueue_fill(d, value, nbytes, stream)
            return
        self._before_host_write(d, stream)
        with self._lock:        # (as memcpy_async's host path)
            self._live(d[0])
            rt.ffi.buffer(self._host(ptr), nbytes)[:] = bytes([value & 0xFF]) * nbytes
