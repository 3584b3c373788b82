"""Memory: device and pinned (host USM) allocations, copies and fills, ``mem_info``.

* **Memory**: ``zeMemAllocDevice``/``zeMemAllocHost``; out-of-memory results
  raise :class:`accel.OutOfMemoryError`.  Level Zero forbids freeing memory
  the device may still use, so frees first wait for unfinished streams and
  graph launches (CUDA's ``cudaFree`` synchronizes too).
* **Copies** accept USM pointers directly.  A pageable host source is copied
  into pinned staging memory before the call returns (so the caller may reuse
  it, as with ``cudaMemcpyAsync``); a pageable destination makes the copy
  synchronous.  Neither is allowed inside a graph capture.
* **mem_info**: Sysman memory modules of the device (``zesMemoryGetState``
  free/size summed over its HBM modules, per tile when the device is a
  tile); without Sysman, the total from ``zeDeviceGetMemoryProperties`` and
  free = total minus this process's allocations (``mem_info_path`` says which).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

from ..._errors import AcceleratorError, CaptureError, OutOfMemoryError
from ._library import LIBRARY, _UINT64_MAX

if TYPE_CHECKING:
    from .discovery import _Device


_HOST_ALIGN = 64
_DEVICE_ALIGN = 256          # CUDA's cudaMalloc guarantee; the allocator splits blocks at 512


class MemoryMixin:
    """Allocations (``_allocs``, ``_host_allocs``), copies/fills onto streams, and ``mem_info``."""

    def mem_info(self) -> Tuple[int, int]:
        dev = self._current()
        got = self._sysman_mem(dev)
        if got is not None:
            self._mem_info_path = "sysman"
            return got
        self._mem_info_path = "device-properties (Sysman unavailable: free = total - this process's allocations)"
        return max(dev.total_memory - dev.used, 0), dev.total_memory

    def _sysman_mem(self, dev: _Device) -> Optional[Tuple[int, int]]:
        ffi, lib, _ = self._lib
        if dev.sysman is not None:
            handle, tile = dev.sysman, dev.sysman_tile
        elif self._sysman_legacy:
            handle, tile = dev.handle, dev.subdevice_id   # legacy: the core handle is the Sysman handle
        else:
            return None
        try:
            modules = self._enum(ffi, lib, "zesDeviceEnumMemoryModules", "zes_mem_handle_t",
                                 lambda n, a: lib.zesDeviceEnumMemoryModules(handle, n, a))
        except AcceleratorError:
            return None
        chosen = []
        for m in modules:
            props = ffi.new("zes_mem_properties_t *")
            props.stype = lib.ZES_STRUCTURE_TYPE_MEM_PROPERTIES
            if lib.zesMemoryGetProperties(m, props):
                return None
            if props.location != lib.ZES_MEM_LOC_DEVICE:
                continue
            if tile is not None and props.onSubdevice and props.subdeviceId != tile:
                continue
            chosen.append(m)
        if not chosen:
            return None
        free = total = 0
        for m in chosen:
            st = ffi.new("zes_mem_state_t *")
            st.stype = lib.ZES_STRUCTURE_TYPE_MEM_STATE
            if lib.zesMemoryGetState(m, st):
                return None
            free += st.free
            total += st.size
        return free, total

    def mem_alloc(self, nbytes: int) -> int:
        _check_size(nbytes)
        if nbytes == 0:
            return 0
        dev = self._current()
        ffi, lib, _ = self._lib
        if nbytes > _UINT64_MAX:    # not even a size_t: no device has it
            raise OutOfMemoryError(f"{LIBRARY}: zeMemAllocDevice not called: requested {nbytes} bytes on XPU "
                                   f"device {dev.index}, more than a size_t holds (maxMemAllocSize is "
                                   f"{dev.max_alloc})", library=LIBRARY, call="zeMemAllocDevice")
        desc = ffi.new("ze_device_mem_alloc_desc_t *")
        desc.stype = lib.ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC
        p = ffi.new("void **")
        try:
            return self._alloc_device(ffi, lib, dev, desc, nbytes, p)
        except Exception:
            raise
        except BaseException:
            # A KeyboardInterrupt as the driver returned (CPython runs a signal's handler right
            # after a C call, before its result is stored) or before the caller got the pointer:
            # forgotten and freed, so an interrupted allocation leaves nothing (p starts NULL).
            if p[0] != ffi.NULL:
                ptr = int(ffi.cast("uintptr_t", p[0]))
                with self._lock:
                    if self._allocs.get(ptr) is not None:
                        del self._allocs[ptr]
                        dev.used -= nbytes
                lib.zeMemFree(dev.ctx, p[0])
            raise

    def _alloc_device(self, ffi, lib, dev, desc, nbytes: int, p) -> int:
        rc = lib.zeMemAllocDevice(dev.ctx, desc, nbytes, _DEVICE_ALIGN, dev.handle, p)
        if rc:
            self._fail_alloc("zeMemAllocDevice", rc, f"requested {nbytes} bytes on XPU device {dev.index}",
                             nbytes, dev.max_alloc)
        ptr = int(ffi.cast("uintptr_t", p[0]))
        with self._lock:
            self._allocs[ptr] = (dev, nbytes)
            dev.used += nbytes
        return ptr

    def _fail_alloc(self, call: str, rc: int, extra: str, nbytes: int, max_alloc: int) -> None:
        """Raise for a failed allocation.  A request above ``maxMemAllocSize`` is out of memory to
        the caller (as on CUDA and torch's XPU allocator), so the caching allocators free their
        cache and retry; Level Zero reports it as UNSUPPORTED_SIZE (r70h: for pinned memory
        zeMemAllocHost checks device 0's maxMemAllocSize, and the host allocator's retry never ran)."""
        if nbytes > max_alloc:
            error = self._error(call, rc, f"{extra} (maxMemAllocSize is {max_alloc})")
            raise OutOfMemoryError(str(error), library=error.library, call=error.call,
                                   code=error.code, code_name=error.code_name)
        self._fail(call, rc, extra)

    def mem_free(self, ptr: int) -> None:
        if ptr == 0:
            return
        self._unsafe("mem_free")
        with self._lock:
            entry = self._allocs.get(ptr)
        if entry is None:
            raise ValueError(f"mem_free: {ptr:#x} is not a live XPU device allocation of this process")
        dev = entry[0]
        self._quiesce()   # Level Zero: the device must not reference memory being freed
        ffi, lib, _ = self._lib
        self._free_forgetting(self._allocs, ptr,
                              lambda e: self._check_rc("zeMemFree", lib.zeMemFree(dev.ctx, ffi.cast("void *", ptr))))
        with self._lock:
            dev.used -= entry[1]

    def host_alloc(self, nbytes: int) -> int:
        _check_size(nbytes)
        if nbytes == 0:
            return 0
        p = self._lib[0].new("void **")
        try:
            ptr = self._host_alloc(nbytes, p)
            with self._lock:
                self._host_allocs[ptr] = nbytes
            return ptr
        except Exception:
            raise
        except BaseException:
            # as mem_alloc: an interrupted allocation leaves nothing
            if p[0] != self._lib[0].NULL:
                ptr = int(self._lib[0].cast("uintptr_t", p[0]))
                with self._lock:
                    if ptr in self._host_allocs:
                        del self._host_allocs[ptr]
                self._lib[1].zeMemFree(self._devices[0].ctx, p[0])
            raise

    def _host_alloc(self, nbytes: int, p=None) -> int:
        """zeMemAllocHost; ``p`` (a NULL ``void **``) keeps the pointer for a caller that must
        free it when a KeyboardInterrupt lands as the driver returns."""
        ffi, lib, _ = self._lib
        if not self._devices:
            raise AcceleratorError("the XPU backend is not initialized", library=LIBRARY)
        desc = ffi.new("ze_host_mem_alloc_desc_t *")
        desc.stype = lib.ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC
        p = ffi.new("void **") if p is None else p
        rc = lib.zeMemAllocHost(self._devices[0].ctx, desc, nbytes, _HOST_ALIGN, p)
        if rc:
            self._fail_alloc("zeMemAllocHost", rc, f"requested {nbytes} bytes of pinned host memory",
                             nbytes, self._devices[0].max_alloc)
        return int(ffi.cast("uintptr_t", p[0]))

    def host_free(self, ptr: int) -> None:
        if ptr == 0:
            return
        self._unsafe("host_free")
        with self._lock:
            if ptr not in self._host_allocs:
                raise ValueError(f"host_free: {ptr:#x} is not a live pinned allocation of this process")
        self._quiesce()
        self._free_forgetting(self._host_allocs, ptr, lambda e: self._host_free(ptr))

    def _host_free(self, ptr: int) -> None:
        ffi, lib, _ = self._lib
        rc = lib.zeMemFree(self._devices[0].ctx, ffi.cast("void *", ptr))
        if rc:
            self._fail("zeMemFree", rc)

    def _free_staging(self, ptr: int) -> None:
        """Free a copy's internal staging memory.  A failed zeMemFree does not fail the copy
        (it ran, or its own error is on the way): the memory is freed by the next _sweep."""
        try:
            self._host_free(ptr)
        except AcceleratorError:
            with self._lock:
                self._deferred.append(([], ptr))

    def _quiesce(self) -> None:
        """Wait for every stream and graph launch with unfinished work."""
        for s in list(self._streams.values()):
            if s.seq > s.done and not s.dead:
                self._sync_stream(s)
        for g in list(self._graphs.values()) + list(self._execs.values()):
            if g.launched:
                self._sync_graph(g)

    def pointer_location(self, ptr: int) -> Optional[Tuple[str, int]]:
        # zeMemGetAllocProperties (ze_api.h): the USM type of the allocation holding ptr and,
        # for device/shared memory, its device.  Mapped virtual memory is not USM: this backend's
        # own mapping table tells its device.
        if not self._devices:
            return None
        if not ptr:
            return ("unknown", -1)      # zeMemGetAllocProperties refuses a null ptr (INVALID_NULL_POINTER)
        mapped = self._vmm_device_at(ptr)
        if mapped is not None:
            return ("device", mapped)
        ffi, lib, _ = self._lib
        props = ffi.new("ze_memory_allocation_properties_t *")
        props.stype = lib.ZE_STRUCTURE_TYPE_MEMORY_ALLOCATION_PROPERTIES
        device = ffi.new("ze_device_handle_t *")
        rc = lib.zeMemGetAllocProperties(self._devices[0].ctx, ffi.cast("void *", ptr), props, device)
        if rc:
            self._fail("zeMemGetAllocProperties", rc)
        handle = int(ffi.cast("uintptr_t", device[0]))
        index = next((d.index for d in self._devices if int(ffi.cast("uintptr_t", d.handle)) == handle), -1)
        if props.type == lib.ZE_MEMORY_TYPE_DEVICE:
            return ("device", index)
        if props.type == lib.ZE_MEMORY_TYPE_SHARED:
            return ("managed", index)
        if props.type == lib.ZE_MEMORY_TYPE_HOST:
            return ("host", -1)
        return ("unknown", -1)

    def _usm(self, dev: _Device, ptr: int) -> bool:
        if self._vmm_mapped_at(ptr):      # mapped virtual memory (vmm.py): device-accessible, not USM
            return True
        ffi, lib, _ = self._lib
        props = ffi.new("ze_memory_allocation_properties_t *")
        props.stype = lib.ZE_STRUCTURE_TYPE_MEMORY_ALLOCATION_PROPERTIES
        rc = lib.zeMemGetAllocProperties(dev.ctx, ffi.cast("void *", ptr), props, ffi.NULL)
        if rc:
            self._fail("zeMemGetAllocProperties", rc)
        return props.type != lib.ZE_MEMORY_TYPE_UNKNOWN

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        _check_ptr(dst, "dst")
        _check_ptr(src, "src")
        _check_size(nbytes)
        s = self._stream(stream)
        if nbytes == 0:
            return
        ffi, lib, _ = self._lib
        copy = lib.zeCommandListAppendMemoryCopy
        src_usm, dst_usm = self._usm(s.device, src), self._usm(s.device, dst)
        if src_usm and dst_usm:
            self._enqueue(s, f"copy {nbytes} B", "zeCommandListAppendMemoryCopy", copy,
                          ffi.cast("void *", dst), ffi.cast("void *", src), nbytes, ffi.NULL, 0, ffi.NULL)
            return
        if s.capture is not None:
            self._invalidate(s.capture, "memcpy with pageable host memory")
            raise CaptureError("a copy to or from pageable host memory cannot be captured on XPU (use pinned "
                               "memory from host_alloc); the capture is invalidated")
        # Interrupt safety (Ctrl-C): ``p`` holds the staging pointer while this call owns it (it
        # starts NULL, zeMemAllocHost fills it, and it is set NULL as the memory is handed to the
        # sweep or freed: plain stores, no signal check between); a KeyboardInterrupt anywhere
        # in between hands it to the sweep, to be freed once the stream passed every command
        # counted on it (an interrupted copy's append is counted first: it may be queued).
        # Before, an interrupt as the append returned freed the memory under the queued copy,
        # and one as the allocation returned lost it.
        p = ffi.new("void **")
        if dst_usm:
            # Pageable source: copied now into pinned staging, so the caller may reuse it at
            # once (as cudaMemcpyAsync); the staging memory is freed once the copy has run.
            try:
                staging = self._host_alloc(nbytes, p)
                ffi.memmove(ffi.cast("void *", staging), ffi.cast("void *", src), nbytes)
                seq = self._enqueue(s, f"copy {nbytes} B", "zeCommandListAppendMemoryCopy", copy,
                                    ffi.cast("void *", dst), ffi.cast("void *", staging), nbytes,
                                    ffi.NULL, 0, ffi.NULL)
                with self._lock:
                    self._deferred += [([(s, seq)], staging)]
                    p[0] = ffi.NULL
            except Exception:
                if p[0] != ffi.NULL:        # not queued (refused): freed now
                    self._free_staging(int(ffi.cast("uintptr_t", p[0])))
                raise
            except BaseException:
                self._staging_interrupted(p, s)
                raise
            return
        if not src_usm:
            # Neither side is a live USM allocation: a freed device pointer is indistinguishable
            # from host memory, and a host memmove through it would crash the process.
            raise ValueError(f"xpu: memcpy_async({dst:#x}, {src:#x}, {nbytes}): neither pointer is inside a live "
                             f"USM allocation (freed or foreign memory?); copy to or from memory returned by "
                             f"mem_alloc/host_alloc that has not been freed")
        # Pageable destination: synchronous, as CUDA makes it.
        seq = None
        try:
            staging = self._host_alloc(nbytes, p)
            seq = self._enqueue(s, f"copy {nbytes} B", "zeCommandListAppendMemoryCopy", copy,
                                ffi.cast("void *", staging), ffi.cast("void *", src), nbytes, ffi.NULL, 0,
                                ffi.NULL)
            self._sync_stream(s)
            ffi.memmove(ffi.cast("void *", dst), ffi.cast("void *", staging), nbytes)
            cptr = ffi.cast("void *", staging)
            p[0] = ffi.NULL                 # forgotten, then freed (a failure defers it to the sweep)
            rc = lib.zeMemFree(self._devices[0].ctx, cptr)
        except Exception:
            if p[0] != ffi.NULL:
                staging = int(ffi.cast("uintptr_t", p[0]))
                if seq is None:
                    self._free_staging(staging)
                else:               # the wait failed: the queued copy may still write the staging memory
                    with self._lock:
                        self._deferred.append(([(s, seq)], staging))
            raise
        except BaseException:
            self._staging_interrupted(p, s)
            raise
        if rc:
            with self._lock:
                self._deferred.append(([], staging))

    def memcpy_peer_async(self, dst: int, dst_index: int, src: int, src_index: int, nbytes: int,
                          stream: int) -> None:
        """Between cards that cannot reach each other's memory, through pinned host memory, which
        every device can reach.  Level Zero has no staged peer copy: a device allocation "may only
        be accessed by the device that owns it" unless zeDeviceCanAccessPeer says otherwise
        (ze_api.h zeMemAllocDevice, zeCommandListAppendMemoryCopy: the memory "is accessible by
        the device on which the command list was created"; PROG.rst, Peer-to-Peer Access).  The
        source card's default stream copies into the staging block once ``stream`` has run what
        came before (it waited for the source's stream), and ``stream`` copies it out; blocking
        until the first half ran.  Not capturable (a graph lives on one device)."""
        _check_size(nbytes)
        s = self._stream(stream)
        if nbytes == 0:
            return
        source = self._device(src_index).default
        if s.capture is not None or source.capture is not None:
            invalidated = ""
            if s.capture is not None:
                # (as memcpy_async's pageable copies: a command the capture cannot hold ends it)
                self._invalidate(s.capture, "copy between cards without peer access")
                invalidated = "; the capture is invalidated"
            raise CaptureError(f"a copy from xpu:{src_index} to xpu:{dst_index}, which cannot access each other's "
                               f"memory (zeDeviceCanAccessPeer), goes through host memory and cannot be captured; "
                               f"copy before the capture, or through a Buffer of this device{invalidated}")
        ffi, lib, _ = self._lib
        copy = lib.zeCommandListAppendMemoryCopy
        p = ffi.new("void **")          # the staging pointer while this call owns it (see memcpy_async)
        deps = []
        try:
            staging = self._host_alloc(nbytes, p)
            self._sync_stream(s)
            deps.append(source)     # before the append: a Ctrl-C as it returns leaves the read queued (r71q)
            self._enqueue(source, f"copy {nbytes} B to host", "zeCommandListAppendMemoryCopy", copy,
                          ffi.cast("void *", staging), ffi.cast("void *", src), nbytes, ffi.NULL, 0, ffi.NULL)
            self._sync_stream(source)
            seq = self._enqueue(s, f"copy {nbytes} B", "zeCommandListAppendMemoryCopy", copy,
                                ffi.cast("void *", dst), ffi.cast("void *", staging), nbytes, ffi.NULL, 0, ffi.NULL)
            with self._lock:
                self._deferred += [([(s, seq)], staging)]
                p[0] = ffi.NULL
        except BaseException as exc:
            if deps:
                # the source's read runs on the source card's stream, which the caller's noting
                # (uses recorded on ``stream``) does not cover: wait for it here, best effort
                try:
                    self._sync_stream(source)
                except BaseException:
                    pass
            if p[0] != ffi.NULL:
                staging = int(ffi.cast("uintptr_t", p[0]))
                if deps or not isinstance(exc, Exception):
                    # a queued copy may still read or write it: freed once both streams passed it
                    with self._lock:
                        self._deferred += [([(source, source.seq), (s, s.seq)], staging)]
                        p[0] = ffi.NULL
                else:
                    self._free_staging(staging)
            raise

    def _staging_interrupted(self, p, s) -> None:
        """A KeyboardInterrupt while a copy owned the staging memory in ``p`` (NULL: none): to
        the sweep, freed once ``s`` passed every command counted on it so far."""
        ffi = self._lib[0]
        if p[0] != ffi.NULL:
            with self._lock:
                self._deferred += [([(s, s.seq)], int(ffi.cast("uintptr_t", p[0])))]
                p[0] = ffi.NULL

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        _check_ptr(ptr, "ptr")
        _check_size(nbytes)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
            raise ValueError(f"memset value must be a byte 0..255, got {value!r}")
        s = self._stream(stream)
        if nbytes == 0:
            return
        ffi, lib, _ = self._lib
        pattern = self._patterns.get(value)
        if pattern is None:
            # Kept alive for the process: a captured (regular) list may read it on every replay.
            pattern = self._patterns.setdefault(value, ffi.new("uint8_t *", value))
        self._enqueue(s, f"fill {nbytes} B with {value:#04x}", "zeCommandListAppendMemoryFill",
                      lib.zeCommandListAppendMemoryFill, ffi.cast("void *", ptr), pattern, 1, nbytes,
                      ffi.NULL, 0, ffi.NULL)


def _check_size(nbytes) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"size must be an int number of bytes, got {nbytes!r}")
    if nbytes < 0:
        raise ValueError(f"size must not be negative, got {nbytes}")


def _check_ptr(ptr, what: str) -> None:
    if isinstance(ptr, bool) or not isinstance(ptr, int):
        raise TypeError(f"{what} must be an int address, got {ptr!r}")
    if ptr <= 0:
        raise ValueError(f"{what} must be a non-null address, got {ptr!r}")
