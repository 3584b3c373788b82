"""Virtual memory on Level Zero: zeVirtualMem* / zePhysicalMem* (the allocator's expandable segments).

Owns ``_vmm_reserved`` (base -> (size, context)), ``_vmm_handles`` (physical handle -> (device,
size, context)) and ``_vmm_mapped`` (base -> size of each live mapping, so copies and fills on
mapped memory are recognized: ``zeMemGetAllocProperties`` knows USM allocations, not mappings).

Level Zero's access attribute is per mapping for the whole context (no device argument), so
``vmm_map`` maps with ZE_MEMORY_ACCESS_ATTRIBUTE_READWRITE and ``vmm_set_access`` checks the peer
shares the context.  ``zeVirtualMemReserve`` gets a page-aligned hint (its @returns list refuses a
null ``pStart``), the end of the last reservation.
"""

from __future__ import annotations

import bisect
from ..._errors import AcceleratorError, CaptureError

_ACCESS_READWRITE = 1          # ZE_MEMORY_ACCESS_ATTRIBUTE_READWRITE
_HINT_START = 1 << 44          # first hint: far above the heap; the driver moves it if taken


class VmmMixin:
    """zeVirtualMem*/zePhysicalMem* as the Backend's vmm_* methods."""

    supports_vmm = True
    vmm_access_call = "zeVirtualMemSetAccessAttribute"

    def _vmm_tables(self):
        t = self.__dict__.get("_vmm_state")
        if t is None:
            with self._lock:
                t = self.__dict__.setdefault("_vmm_state", {"reserved": {}, "handles": {}, "mapped": {},
                                                            "bases": [], "hint": _HINT_START})
        return t

    def _vmm_lib(self, call: str):
        dev0 = self._device(0)   # initializes
        ffi, lib, _ = self._lib
        if self._captures:
            # The specification does not say whether virtual-memory calls may run while a command
            # list is being captured for a graph (they are not command-list operations); refused.
            raise CaptureError(f"{self.name}: {call} is not allowed while a stream capture is underway "
                               f"(virtual memory is not stream-ordered); map or unmap before the capture "
                               f"begins or after it ends", library="libze_loader", call=call)
        return ffi, lib, dev0

    def vmm_supported(self, index: int) -> bool:
        """True: the virtual-memory functions are core API 1.0 (REQUIRED_SYMBOLS of every loader)."""
        self._device(index)
        return True

    def vmm_granularity(self, index: int) -> int:
        """zeVirtualMemQueryPageSize for device ``index`` (for a 2 MiB allocation)."""
        dev = self._device(index)
        ffi, lib, _ = self._lib
        out = ffi.new("size_t *")
        self._check_rc("zeVirtualMemQueryPageSize", lib.zeVirtualMemQueryPageSize(dev.ctx, dev.handle, 2 << 20, out))
        return out[0]

    def vmm_reserve(self, index: int, nbytes: int) -> int:
        """zeVirtualMemReserve of ``nbytes`` (page aligned) in device ``index``'s context."""
        dev = self._device(index)
        ffi, lib, _ = self._vmm_lib("zeVirtualMemReserve")
        t = self._vmm_tables()
        out = ffi.new("void **")
        try:
            rc = lib.zeVirtualMemReserve(dev.ctx, ffi.cast("void *", t["hint"]), nbytes, out)
            self._check_rc("zeVirtualMemReserve", rc)
            va = int(ffi.cast("uintptr_t", out[0]))
            hint = max(t["hint"], va + nbytes)
            with self._lock:
                t["reserved"][va] = (nbytes, dev.ctx)
                t["hint"] = hint
            return va
        except Exception:
            raise
        except BaseException:
            # A KeyboardInterrupt as the driver returned (CPython runs a signal's handler right
            # after a C call, before its result is stored) or before the caller got the range:
            # forgotten and freed, so an interrupted reserve leaves nothing (out starts NULL).
            if out[0] != ffi.NULL:
                with self._lock:
                    t["reserved"].pop(int(ffi.cast("uintptr_t", out[0])), None)
                lib.zeVirtualMemFree(dev.ctx, out[0], nbytes)
            raise

    def vmm_free(self, va: int, nbytes: int) -> None:
        """zeVirtualMemFree of a whole reservation (accel unmaps first; Level Zero would unmap)."""
        ffi, lib, _ = self._vmm_lib("zeVirtualMemFree")
        t = self._vmm_tables()
        # Forgotten before the call, restored if it fails, as _free_forgetting does for one table:
        # a range reserved again by another thread keeps its entries.
        with self._lock:
            entry = t["reserved"].pop(va, None)
            mapped = {b: t["mapped"][b] for b in t["mapped"] if va <= b < va + nbytes}
            devices = {b: t.get("devices", {}).get(b) for b in mapped}
            for base in mapped:
                self._vmm_forget_mapping(t, base)
        if entry is None:
            raise AcceleratorError(f"{self.name}: vmm_free(0x{va:x}, {nbytes}): not a reservation of this backend; "
                                   f"pass the address vmm_reserve returned", library="libze_loader")
        try:
            self._check_rc("zeVirtualMemFree", lib.zeVirtualMemFree(entry[1], ffi.cast("void *", va), nbytes))
        except Exception:
            # refused: still reserved.  (A KeyboardInterrupt keeps it forgotten: it may have
            # been freed, and a freed range may be the next reservation's.)
            with self._lock:
                t["reserved"][va] = entry
                for base, n in mapped.items():
                    t["mapped"][base] = n
                    bisect.insort(t["bases"], base)
                    if devices[base] is not None:
                        t.setdefault("devices", {})[base] = devices[base]
            raise

    def vmm_create(self, index: int, nbytes: int) -> int:
        """zePhysicalMemCreate of ``nbytes`` on device ``index``; OutOfMemoryError when it is full."""
        dev = self._device(index)
        ffi, lib, _ = self._vmm_lib("zePhysicalMemCreate")
        desc = ffi.new("ze_physical_mem_desc_t *")
        desc.stype = lib.ZE_STRUCTURE_TYPE_PHYSICAL_MEM_DESC
        desc.size = nbytes
        out = ffi.new("ze_physical_mem_handle_t *")
        handles = self._vmm_tables()["handles"]
        try:
            self._check_rc("zePhysicalMemCreate", lib.zePhysicalMemCreate(dev.ctx, dev.handle, desc, out))
            handle = int(ffi.cast("uintptr_t", out[0]))
            entry = (dev, nbytes, dev.ctx)
            with self._lock:
                handles[handle] = entry
                dev.used += nbytes
            return handle
        except Exception:
            raise
        except BaseException:
            # as vmm_reserve: an interrupted create leaves no handle
            if out[0] != ffi.NULL:
                with self._lock:
                    if handles.pop(int(ffi.cast("uintptr_t", out[0])), None) is not None:
                        dev.used -= nbytes
                lib.zePhysicalMemDestroy(dev.ctx, out[0])
            raise

    def vmm_release(self, handle: int) -> None:
        """zePhysicalMemDestroy (the handle must not be mapped any more)."""
        ffi, lib, _ = self._vmm_lib("zePhysicalMemDestroy")
        t = self._vmm_tables()
        if handle not in t["handles"]:
            raise AcceleratorError(f"{self.name}: vmm_release(0x{handle:x}): not a physical allocation of this "
                                   f"backend", library="libze_loader")
        # forgotten (and uncounted) first, destroyed last, restored if refused: as the allocators'
        # frees, a KeyboardInterrupt as the destroy starts may leak it, never keep a destroyed one
        with self._lock:
            entry = t["handles"].pop(handle, None)
            if entry is not None:
                entry[0].used -= entry[1]
        if entry is None:
            raise ValueError(f"{self.name}: 0x{handle:x} was released by another thread meanwhile (a double free)")
        try:
            self._check_rc("zePhysicalMemDestroy",
                           lib.zePhysicalMemDestroy(entry[2], ffi.cast("ze_physical_mem_handle_t", handle)))
        except Exception:
            with self._lock:
                t["handles"][handle] = entry
                entry[0].used += entry[1]
            raise

    def vmm_map(self, va: int, nbytes: int, handle: int, index: int) -> None:
        """zeVirtualMemMap of ``handle`` at ``va``, read-write (for every device of the context)."""
        ffi, lib, _ = self._vmm_lib("zeVirtualMemMap")
        ctx = self._vmm_ctx(va, index)
        t = self._vmm_tables()
        entry = t["handles"].get(handle)      # the physical memory's device (pointer_location)
        devices = t.setdefault("devices", {})
        # Interrupt safety: from the map on, a KeyboardInterrupt (CPython runs a signal's handler
        # right after a C call returns, before its result is stored) forgets and unmaps again, so
        # an interrupted vmm_map leaves nothing mapped, as a failed one; the undo's refusal (it
        # was not mapped) is nothing to undo: ``va`` is in the caller's own reservation.
        maybe = False
        try:
            maybe = True
            rc = lib.zeVirtualMemMap(ctx, ffi.cast("void *", va), nbytes,
                                     ffi.cast("ze_physical_mem_handle_t", handle), 0, _ACCESS_READWRITE)
            if rc:
                maybe = False
                self._check_rc("zeVirtualMemMap", rc)
            with self._lock:                  # plain stores, then the insort (one C call) last
                t["mapped"][va] = nbytes
                devices[va] = entry[0].index if entry is not None else index
                # the slot is found under the lock: another device's allocator maps and unmaps
                # on other threads, and a slot found before could leave the list unsorted
                bisect.insort(t["bases"], va)
        except Exception:
            raise
        except BaseException:
            if maybe:
                with self._lock:
                    if va in t["mapped"]:
                        self._vmm_forget_mapping(t, va)
                lib.zeVirtualMemUnmap(ctx, ffi.cast("void *", va), nbytes)
            raise

    def vmm_set_access(self, va: int, nbytes: int, index: int) -> None:
        """Level Zero's access is for the whole context: device ``index`` has it when it shares the
        context of the mapping (else AcceleratorError)."""
        ffi, lib, _ = self._vmm_lib("zeVirtualMemSetAccessAttribute")
        ctx = self._vmm_ctx(va, None)
        if self._device(index).ctx != ctx:
            raise AcceleratorError(f"{self.name}: device {index} is in another Level Zero context than the "
                                   f"mapping at 0x{va:x}; virtual memory is usable only in its own context",
                                   library="libze_loader")
        self._check_rc("zeVirtualMemSetAccessAttribute",
                       lib.zeVirtualMemSetAccessAttribute(ctx, ffi.cast("void *", va), nbytes, _ACCESS_READWRITE))

    def vmm_unmap(self, va: int, nbytes: int) -> None:
        """zeVirtualMemUnmap of whole mappings; does not wait for queued work (synchronize first)."""
        ffi, lib, _ = self._vmm_lib("zeVirtualMemUnmap")
        ctx = self._vmm_ctx(va, None)
        t = self._vmm_tables()
        # forgotten first, unmapped last, restored if refused (a KeyboardInterrupt as the unmap
        # returns then leaves no entry for a range that is no longer mapped)
        with self._lock:
            gone = {b: (t["mapped"][b], t.get("devices", {}).get(b)) for b in t["mapped"] if va <= b < va + nbytes}
            for base in gone:
                self._vmm_forget_mapping(t, base)
        try:
            self._check_rc("zeVirtualMemUnmap", lib.zeVirtualMemUnmap(ctx, ffi.cast("void *", va), nbytes))
        except Exception:
            with self._lock:
                for base, (n, dev) in gone.items():
                    if base not in t["mapped"]:
                        t["mapped"][base] = n
                        bisect.insort(t["bases"], base)
                        if dev is not None:
                            t.setdefault("devices", {})[base] = dev
            raise

    def _vmm_close(self) -> None:
        """For close(): unmap, destroy and free whatever virtual memory is left (before the
        contexts go), and forget the tables (close re-runs __init__, which does not know them)."""
        t = self.__dict__.pop("_vmm_state", None)
        if not t:
            return
        ffi, lib, _ = self._lib

        def ctx_of(va):
            for base, (size, ctx) in t["reserved"].items():
                if base <= va < base + size:
                    return ctx
            return None
        for base, size in list(t["mapped"].items()):
            self._check_rc("zeVirtualMemUnmap", lib.zeVirtualMemUnmap(ctx_of(base), ffi.cast("void *", base), size))
        for handle, (dev, nbytes, ctx) in list(t["handles"].items()):
            self._check_rc("zePhysicalMemDestroy",
                           lib.zePhysicalMemDestroy(ctx, ffi.cast("ze_physical_mem_handle_t", handle)))
            dev.used -= nbytes
        for va, (size, ctx) in list(t["reserved"].items()):
            self._check_rc("zeVirtualMemFree", lib.zeVirtualMemFree(ctx, ffi.cast("void *", va), size))

    # -- helpers ------------------------------------------------------------------------------
    def _vmm_ctx(self, va: int, index):
        t = self._vmm_tables()
        # A snapshot under the lock: another device's allocator reserves and frees on other threads,
        # and a dict iterated while one key goes and another comes (with a resize) can skip entries.
        with self._lock:
            reserved = list(t["reserved"].items())
        for base, (size, ctx) in reserved:
            if base <= va < base + size:
                return ctx
        if index is not None:
            return self._device(index).ctx
        raise AcceleratorError(f"{self.name}: 0x{va:x} is in no reservation of this backend (vmm_reserve first)",
                               library="libze_loader")

    @staticmethod
    def _vmm_forget_mapping(t, base: int) -> None:
        # the one call first, then plain deletes (no signal check between them)
        bases, mapped = t["bases"], t["mapped"]
        i = bisect.bisect_left(bases, base)
        hit = i < len(bases) and bases[i] == base
        devices = t["devices"] if "devices" in t else {}
        if base in mapped:
            del mapped[base]
        if base in devices:
            del devices[base]
        if hit:
            del bases[i]

    def _vmm_mapped_at(self, ptr: int) -> bool:
        """Whether ``ptr`` is inside a live mapping this backend made (device-accessible memory)."""
        return self._vmm_mapping_at(ptr) is not None

    def _vmm_device_at(self, ptr: int):
        """The device index of the physical memory mapped at ``ptr``, or None when unmapped."""
        base = self._vmm_mapping_at(ptr)
        return None if base is None else self._vmm_state.get("devices", {}).get(base)

    def _vmm_mapping_at(self, ptr: int):
        """The start of the live mapping holding ``ptr``, or None."""
        t = self.__dict__.get("_vmm_state")
        if not t or not t["bases"]:
            return None
        with self._lock:        # (another device's allocator unmaps from its own thread: r63g)
            bases = t["bases"]
            i = bisect.bisect_right(bases, ptr) - 1
            return bases[i] if i >= 0 and ptr < bases[i] + t["mapped"].get(bases[i], 0) else None
