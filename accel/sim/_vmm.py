"""Simulated virtual memory management: reserved address ranges, physical pages, mappings.

The shape is the drivers' (CUDA cuMemAddressReserve / cuMemCreate / cuMemMap /
cuMemSetAccess / cuMemUnmap / cuMemRelease / cuMemAddressFree; Level Zero
zeVirtualMemReserve / zePhysicalMemCreate / zeVirtualMemMap / ...), over the host's own
virtual memory so that addresses are real and unique:

* a **reservation** is an anonymous ``PROT_NONE`` host mapping (``mmap`` with
  ``MAP_NORESERVE``): nothing else in the process can get those addresses, and touching
  them without a mapping is an error the simulator reports as a device fault;
* **physical memory** of device *d* is pages of one per-device ``memfd`` (a shared-memory
  file as large as the device); a handle owns a list of pages, so its contents survive
  an unmap and a later map, and mapping one handle at two addresses aliases it, as on
  the device;
* a **mapping** places a handle's pages at an address inside a reservation (``mmap``
  ``MAP_FIXED | MAP_SHARED`` of the file); an unmap puts ``PROT_NONE`` back.

Access is bookkept per mapping (the devices with read-write / read-only access); the
vendor simulators check, before any copy, memset or kernel touches a range, that every
byte is mapped and accessible by the accessing device (:meth:`Space.resolve`), and check
again when the queued operation runs (an unmap does not wait for queued work), holding
:attr:`Space.lock` shared (:class:`SharedLock`), so no unmap (which takes it exclusively) can pull
the pages away under a running operation, while other work is still queued and run meanwhile.

Errors are raised as :class:`VmmError` with a ``kind`` the vendor layer turns into its
own code: ``"invalid"`` (bad argument or rule), ``"oom"``, ``"unsupported"``.
Physical memory is charged to a device through the ``charge``/``refund`` callbacks the
vendor simulator passes, so it shares the device's budget with its other allocations.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import itertools
import os
import sys
import threading
from typing import Callable, Dict, List, Optional, Tuple

from . import _memory

#: Page size of simulated physical memory (CUDA: cuMemGetAllocationGranularity is 2 MiB on
#: current GPUs, REFERENCE.md "Virtual memory"; Level Zero: zeVirtualMemQueryPageSize).
GRANULARITY = 2 << 20

_PROT_NONE, _PROT_READ, _PROT_WRITE = 0, 1, 2
if sys.platform.startswith("linux"):
    _MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANON, _MAP_NORESERVE = 0x1, 0x2, 0x10, 0x20, 0x4000
elif sys.platform == "darwin":
    _MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANON, _MAP_NORESERVE = 0x1, 0x2, 0x10, 0x1000, 0x40
else:
    _MAP_SHARED = None

_libc = None


def _c():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = libc
    return _libc


_MAP_FAILED = (1 << (8 * ctypes.sizeof(ctypes.c_void_p))) - 1


def supported() -> bool:
    """Whether this host can play virtual memory (an mmap with MAP_FIXED on Linux or macOS)."""
    if _MAP_SHARED is None:
        return False
    try:
        _c()
    except OSError:
        return False
    return True


def _mmap(addr: int, size: int, prot: int, flags: int, fd: int = -1, offset: int = 0) -> int:
    p = _c().mmap(addr or None, size, prot, flags, fd, offset)
    if p is None or p == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap({addr:#x}, {size}) failed: {os.strerror(err)}")
    return p


def _munmap(addr: int, size: int) -> None:
    _c().munmap(addr, size)


def _new_file(size: int) -> int:
    """A file descriptor of ``size`` bytes of shared memory (pages cost nothing until touched)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("accel-sim-device-memory", getattr(os, "MFD_CLOEXEC", 0))
    else:
        import tempfile
        fd, path = tempfile.mkstemp(prefix="accel-sim-device-memory-")
        os.unlink(path)
    os.ftruncate(fd, size)
    return fd


class SharedLock:
    """The space's lock: exclusive (``with lock:``, reentrant) for what changes mappings,
    shared (``with lock.shared():``, reentrant per thread) for what only reads them -- address
    checks when work is queued, and copies, memsets and kernels while they run.

    Why not one RLock: a kernel holds the pages it touches for as long as it runs (so no
    cuMemUnmap pulls them from under it: the simulator would fault in the host process), and
    with an exclusive lock the host could not even *queue* other work on mapped memory until
    the kernel finished, which never happens on the device.  Writers are preferred (a waiting
    writer stops new readers of other threads), so back-to-back kernels cannot starve an unmap."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._owner: Optional[int] = None     # thread holding it exclusively
        self._depth = 0                       # its reentrant depth (only the owner changes it)
        self._readers = 0                     # shared holds of all threads
        self._waiting_writers = 0
        self._waiters = 0                     # threads in wait(): notify only when there are some
        self._mine = threading.local()        # this thread's shared depth

    def _wait(self) -> None:
        self._waiters += 1
        try:
            self._cond.wait()
        finally:
            self._waiters -= 1

    def __enter__(self):
        me = threading.get_ident()
        if self._owner == me:                 # only this thread sets or clears its own ownership
            self._depth += 1
            return self
        if getattr(self._mine, "depth", 0):
            raise RuntimeError("accel.sim: a thread holding the virtual-memory space shared "
                               "asked for it exclusively (would deadlock)")
        with self._cond:
            self._waiting_writers += 1
            try:
                while self._owner is not None or self._readers:
                    self._wait()
            finally:
                self._waiting_writers -= 1
            self._owner, self._depth = me, 1
        return self

    def __exit__(self, *exc):
        if self._depth > 1:
            self._depth -= 1
            return
        with self._cond:
            self._depth = 0
            self._owner = None
            if self._waiters:
                self._cond.notify_all()

    @contextlib.contextmanager
    def shared(self):
        mine = self._mine
        depth = getattr(mine, "depth", 0)
        if depth or self._owner == threading.get_ident():
            mine.depth = depth + 1           # nested, or inside this thread's exclusive hold
            try:
                yield self
            finally:
                mine.depth -= 1
            return
        with self._cond:
            while self._owner is not None or self._waiting_writers:
                self._wait()
            self._readers += 1
        mine.depth = 1
        try:
            yield self
        finally:
            mine.depth = 0
            with self._cond:
                self._readers -= 1
                if not self._readers and self._waiters:
                    self._cond.notify_all()


class VmmError(Exception):
    """A refused VMM call: ``kind`` is "invalid", "oom", "in_use" or "unsupported"; ``str`` says why."""

    def __init__(self, kind: str, why: str):
        super().__init__(why)
        self.kind = kind


def _by_device(handles) -> Dict[int, int]:
    out: Dict[int, int] = {}
    for p in handles:
        out[p.device] = out.get(p.device, 0) + p.size
    return out


class Physical:
    """A physical allocation (cuMemCreate handle / ze_physical_mem_handle_t)."""

    __slots__ = ("handle", "size", "device", "pages", "maps", "released")

    def __init__(self, handle: int, size: int, device: int, pages: List[int]):
        self.handle = handle
        self.size = size
        self.device = device
        self.pages = pages          # page indices in the device's memory file, in order
        self.maps = 0               # live mappings of this handle
        self.released = False       # cuMemRelease'd: freed at the last unmap


class Mapping(_memory.Allocation):
    """``[base, base + size)`` of a reservation backed by ``phys``; ``access``: device -> "rw" | "r"."""

    __slots__ = ("phys", "access", "reservation")

    def __init__(self, base: int, size: int, phys: Physical, reservation: "Reservation"):
        super().__init__(base, size, _memory.DEVICE, phys.device, None)
        self.phys = phys
        self.access: Dict[int, str] = {}
        self.reservation = reservation


class Reservation:
    __slots__ = ("base", "size", "bases", "maps")

    def __init__(self, base: int, size: int):
        self.base = base
        self.size = size
        self.bases: List[int] = []              # sorted bases of its live mappings
        self.maps: Dict[int, Mapping] = {}

    @property
    def end(self) -> int:
        return self.base + self.size


class Region:
    """The live mappings under ``[base, base + size)`` as the device ``device`` sees them;
    passed to queued operations in place of an Allocation (``live``, ``end``, ``device``)."""

    __slots__ = ("base", "size", "maps", "accessor", "write", "lock", "space")
    kind = _memory.DEVICE

    def __init__(self, base, size, maps, accessor, write, lock, space=None):
        self.base, self.size, self.maps, self.accessor, self.write, self.lock = \
            base, size, maps, accessor, write, lock
        self.space = space      # set: resolved again at each check (at_launch)

    @classmethod
    def at_launch(cls, space: "Space", base: int, size: int, accessor: Optional[int], write: bool) -> "Region":
        """``[base, base + size)`` of ``space`` as a graph node touches it: whatever is mapped there,
        with the access set, when each launch runs the node (r70d).  CUDA Programming Guide, "CUDA
        Graphs" > Stream Capture: captured work "is appended to an internal graph" instead of
        running, so a copy or memset captured on virtual memory touches the address as mapped at
        the launch (cuMemUnmap: the range "can be used for a future calls to cuMemMap"; cuMemMap:
        accessibility comes from cuMemSetAccess), as kernel nodes already did; it kept the mappings
        and access of capture time before, so a launch after cuMemSetAccess, or after unmap + map +
        access, faulted."""
        return cls(base, size, (), accessor, write, space.lock, space)

    @property
    def end(self) -> int:
        return self.base + self.size

    @property
    def device(self) -> int:
        if self.space is not None:
            m = self.space.mapping_at(self.base)
            return m.device if m is not None else self.accessor
        return self.maps[0].device

    @property
    def live(self) -> bool:
        """Every mapping still mapped and still accessible by the accessing device."""
        return self.problem() is None

    def problem(self) -> Optional[str]:
        if self.space is not None:
            got = self.space.resolve(self.base, self.size, self.accessor, self.write)
            if got is None:
                return (f"0x{self.base:x}+{self.size} is no longer reserved (cuMemAddressFree) when the "
                        f"operation ran")
            return got if got.__class__ is str else None
        for m in self.maps:
            if not m.live:
                return f"0x{m.base:x}+{m.size} was unmapped before the operation ran"
            if self.accessor is not None:
                flags = m.access.get(self.accessor)
                if flags is None or (self.write and flags != "rw"):
                    return (f"device {self.accessor} lost {'write' if self.write else 'read'} access to "
                            f"0x{m.base:x}+{m.size} before the operation ran")
        return None


class Space:
    """One simulated driver's virtual memory: reservations, physical handles, mappings.

    ``charge(device, nbytes) -> bool`` takes device memory (False: the device is full) and
    ``refund(device, nbytes)`` gives it back; ``memory`` is one device's size (the size of its
    memory file)."""

    def __init__(self, name: str, memory: int, charge: Callable[[int, int], bool],
                 refund: Callable[[int, int], None]):
        self.name = name
        self.memory = memory
        self.charge, self.refund = charge, refund
        self.lock = SharedLock()
        self.table = _memory.MemoryTable()      # the mappings, so accel.sim.kernels.read/write find them
        self._bases: List[int] = []             # sorted reservation bases
        self.reservations: Dict[int, Reservation] = {}
        self.handles: Dict[int, Physical] = {}
        self._ids = itertools.count(0x7A000001, 2)
        self._files: Dict[int, int] = {}        # device -> memory file descriptor
        self._free_pages: Dict[int, List[int]] = {}
        self._high: Dict[int, int] = {}         # device -> pages never handed out start here

    # -- reservations ---------------------------------------------------------------------
    def reserve(self, size: int, alignment: int) -> int:
        if alignment <= 0:
            alignment = GRANULARITY
        try:
            raw = _mmap(0, size + alignment, _PROT_NONE, _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE)
        except OSError as exc:
            raise VmmError("oom", f"the host has no {size}-byte address range left: {exc}") from None
        base = (raw + alignment - 1) & ~(alignment - 1)
        if base > raw:
            _munmap(raw, base - raw)
        tail = raw + size + alignment - (base + size)
        if tail:
            _munmap(base + size, tail)
        with self.lock:
            bisect.insort(self._bases, base)
            self.reservations[base] = Reservation(base, size)
        return base

    def free(self, base: int, size: int, unmap: bool = False) -> None:
        """Return a whole reservation; with mappings left, refused unless ``unmap`` (Level Zero's
        zeVirtualMemFree unmaps them)."""
        with self.lock:
            r = self.reservations.get(base)
            if r is None or r.size != size:
                raise VmmError("invalid", f"0x{base:x}+{size} is not a reservation (the address and size "
                                          f"must be those of one earlier reserve)")
            if r.maps and unmap:
                for m in list(r.maps.values()):
                    self.unmap(m.base, m.size)
            if r.maps:
                raise VmmError("invalid", f"the reservation 0x{base:x}+{size} still has {len(r.maps)} "
                                          f"mapping(s): unmap them first")
            del self.reservations[base]
            self._bases.remove(base)
        _munmap(base, size)

    def reservation_of(self, addr: int) -> Optional[Reservation]:
        # Under the space's lock, shared (r65j), as mapping_at: callers outside it (Level Zero's
        # context check of a copy or fill, zeCommandListAppendMemoryFill/Copy) ran while another
        # thread's reserve/free shifted _bases between the bisect and the index, and a live
        # reservation read as none (ZE_RESULT_ERROR_INVALID_ARGUMENT).  The Level Zero API is
        # free-threaded (Level Zero spec, Core Programming Guide, multithreading) and a range stays
        # reserved until zeVirtualMemFree (ze_api.h, zeVirtualMemReserve).  Reentrant.
        with self.lock.shared():
            bases = self._bases
            i = bisect.bisect_right(bases, addr) - 1
            if i < 0:
                return None
            r = self.reservations.get(bases[i])
            return r if r is not None and addr < r.end else None

    # -- physical memory ------------------------------------------------------------------
    def create(self, device: int, size: int) -> int:
        n = size // GRANULARITY
        if not self.charge(device, size):
            raise VmmError("oom", f"device {device} has no {size} bytes left")
        try:
            with self.lock:
                fd = self._files.get(device)
                if fd is None:
                    fd = self._files[device] = _new_file(self.memory)
                    self._free_pages[device] = []
                    self._high[device] = 0
                free = self._free_pages[device]
                take = min(n, len(free))
                pages = free[len(free) - take:]
                del free[len(free) - take:]
                pages.reverse()
                rest = n - take
                high = self._high[device]
                if high + rest > self.memory // GRANULARITY:     # cannot happen under the charge
                    free.extend(reversed(pages))
                    raise VmmError("oom", f"device {device}'s memory file is full")
                pages.extend(range(high, high + rest))
                self._high[device] = high + rest
                h = next(self._ids)
                self.handles[h] = Physical(h, size, device, pages)
            return h
        except BaseException:
            self.refund(device, size)
            raise

    def release(self, handle: int, while_mapped: bool = True) -> None:
        """Release a handle; mapped, it goes at its last unmap (CUDA), or with ``while_mapped``
        False the release is refused as "in_use" (Level Zero)."""
        gone = None
        with self.lock:
            p = self.handles.get(handle)
            if p is None or p.released:
                raise VmmError("invalid", f"handle 0x{handle:x} is not a live physical allocation")
            if p.maps and not while_mapped:
                raise VmmError("in_use", f"handle 0x{handle:x} is still mapped {p.maps} time(s): unmap first")
            p.released = True
            if p.maps == 0:
                gone = self._destroy(p)
        if gone is not None:
            self.refund(*gone)

    def _destroy(self, p: Physical) -> Tuple[int, int]:
        """Drop ``p`` (lock held); returns the (device, bytes) for the caller to refund
        after letting go of the lock: refund takes the runtime's lock, which is held while
        queued work resolves addresses under this one (lock order: runtime, then space)."""
        del self.handles[p.handle]
        fd = self._files.get(p.device)
        if fd is not None:
            _punch(fd, p.pages)
            self._free_pages[p.device].extend(sorted(p.pages, reverse=True))
        return p.device, p.size

    # -- mappings -------------------------------------------------------------------------
    def map(self, base: int, size: int, handle: int, offset: int = 0, whole: bool = True) -> None:
        """Map ``size`` bytes of ``handle`` from ``offset`` at ``base``; ``whole``: the mapping must
        cover the whole handle (CUDA)."""
        with self.lock:
            p = self.handles.get(handle)
            if p is None or p.released:
                raise VmmError("invalid", f"handle 0x{handle:x} is not a live physical allocation")
            if whole and (size != p.size or offset):
                # CUDA_ERROR_NOT_SUPPORTED (the Driver API, cuMemMap: offset "currently must be
                # zero"), measured on an H100, tests/conformance/cuda_h100_2026-12-05.json, scenario
                # vmm_rules (driver 580.159.04): an offset of 1 granule, 1 or 3 granules of a
                # 2-granule handle, and 1 granule of it at an unaligned address (this check comes
                # before the address's).
                raise VmmError("unsupported", f"a mapping of handle 0x{handle:x} must cover all its {p.size} "
                                              f"bytes, not {size} from offset {offset}")
            if base % GRANULARITY or size % GRANULARITY:
                raise VmmError("invalid", f"0x{base:x}+{size} is not a multiple of the {GRANULARITY}-byte "
                                          f"granularity")
            if offset % GRANULARITY or offset + size > p.size:
                raise VmmError("invalid", f"{size} bytes from offset {offset} are not inside the {p.size}-byte "
                                          f"handle 0x{handle:x}")
            r = self.reservation_of(base)
            if r is None or base + size > r.end:
                raise VmmError("invalid", f"0x{base:x}+{size} is not inside one reservation")
            i = bisect.bisect_left(r.bases, base + size)
            if i > 0:
                prev = r.maps[r.bases[i - 1]]
                if prev.end > base:
                    raise VmmError("invalid", f"0x{base:x}+{size} overlaps the mapping at 0x{prev.base:x}+"
                                              f"{prev.size}: unmap it first")
            fd = self._files[p.device]
            off = 0
            pages = p.pages[offset // GRANULARITY:(offset + size) // GRANULARITY]
            for first, count in _runs(pages):
                _mmap(base + off, count * GRANULARITY, _PROT_READ | _PROT_WRITE, _MAP_SHARED | _MAP_FIXED,
                      fd, first * GRANULARITY)
                off += count * GRANULARITY
            m = Mapping(base, size, p, r)
            bisect.insort(r.bases, base)
            r.maps[base] = m
            p.maps += 1
            self.table.add(m)

    def mappings_in(self, base: int, size: int, what: str) -> List[Mapping]:
        """The mappings exactly tiling ``[base, base + size)`` (VmmError when a byte is not mapped
        or a mapping straddles either end)."""
        r = self.reservation_of(base)
        if r is None or base + size > r.end:
            raise VmmError("invalid", f"{what}: 0x{base:x}+{size} is not inside one reservation")
        out = []
        addr, end = base, base + size
        i = bisect.bisect_right(r.bases, addr) - 1
        if i < 0 or r.maps[r.bases[i]].base != addr:
            raise VmmError("invalid", f"{what}: no mapping starts at 0x{addr:x} (a range must consist of "
                                      f"whole mappings)")
        while addr < end:
            m = r.maps.get(addr)
            if m is None:
                raise VmmError("invalid", f"{what}: 0x{addr:x} is not mapped")
            if m.end > end:
                raise VmmError("invalid", f"{what}: the range ends inside the mapping 0x{m.base:x}+{m.size} "
                                          f"(a range must consist of whole mappings)")
            out.append(m)
            addr = m.end
        return out

    def unmap(self, base: int, size: int) -> None:
        gone = []
        try:
            with self.lock:
                self._unmap(base, size, gone)
        finally:
            for device, nbytes in gone:
                self.refund(device, nbytes)

    def _unmap(self, base: int, size: int, gone: list) -> None:
        """Unmap under the lock; (device, bytes) of handles that went, to refund after it."""
        maps = self.mappings_in(base, size, "unmap")
        for m in maps:
            r = m.reservation
            self.table.remove(m)        # live = False: queued work touching it now faults
            del r.maps[m.base]
            r.bases.remove(m.base)
            _mmap(m.base, m.size, _PROT_NONE, _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE | _MAP_FIXED)
            p = m.phys
            p.maps -= 1
            if p.maps == 0 and p.released:
                gone.append(self._destroy(p))

    def set_access(self, base: int, size: int, grants: List[Tuple[int, Optional[str]]]) -> None:
        """``grants``: (device, "rw" | "r" | None) each; None takes the device's access away."""
        with self.lock:
            maps = self.mappings_in(base, size, "set access")
            for m in maps:
                for device, flags in grants:
                    if flags is None:
                        m.access.pop(device, None)
                    else:
                        m.access[device] = flags

    def access_of(self, addr: int, device: int) -> Optional[str]:
        with self.lock.shared():
            m = self.mapping_at(addr)
            if m is None:
                raise VmmError("invalid", f"0x{addr:x} is not mapped")
            return m.access.get(device)

    def mapping_at(self, addr: int) -> Optional[Mapping]:
        # Under the space's lock, shared (r65j): callers outside it (cudaPointerGetAttributes,
        # cudaMemcpyPeerAsync, zeVirtualMemGetAccessAttribute) ran while another thread's
        # cuMemMap/cuMemUnmap inserted into or removed from r.bases between the bisect and the
        # index, and a live mapped address read as unregistered (or a KeyError).  The runtime is
        # thread-safe, and a range mapped with cuMemMap is device memory until cuMemUnmap (CUDA
        # Driver API, Virtual Memory Management: cuMemMap/cuMemUnmap; Runtime API,
        # cudaPointerGetAttributes).  Reentrant: callers already holding it pass through.
        with self.lock.shared():
            r = self.reservation_of(addr)
            if r is None:
                return None
            i = bisect.bisect_right(r.bases, addr) - 1
            if i < 0:
                return None
            m = r.maps[r.bases[i]]
            return m if addr < m.end else None

    # -- what copies, memsets and kernels check --------------------------------------------
    def resolve(self, addr: int, nbytes: int, accessor: Optional[int], write: bool):
        """None when ``addr`` is in no reservation (not virtual memory); else a :class:`Region`
        when every byte of ``[addr, addr + nbytes)`` is mapped and accessible by device
        ``accessor`` (None: any access), or the reason (a str) the access faults."""
        with self.lock.shared():
            r = self.reservation_of(addr)
            if r is None:
                return None
            end = addr + max(nbytes, 1)
            maps = []
            a = addr
            bases, rmaps = r.bases, r.maps
            while a < end:
                i = bisect.bisect_right(bases, a) - 1
                m = rmaps[bases[i]] if i >= 0 else None
                if m is not None and a >= m.end:
                    m = None
                if m is None:
                    return (f"0x{a:x} (of the access 0x{addr:x}+{nbytes}) is reserved but not mapped"
                            if a < r.end else f"0x{addr:x}+{nbytes} runs past the end of its reservation "
                                               f"0x{r.base:x}+{r.size}")
                if accessor is not None:
                    flags = m.access.get(accessor)
                    if flags is None or (write and flags != "rw"):
                        return (f"device {accessor} has no {'write' if write else 'read'} access to "
                                f"0x{m.base:x}+{m.size} (cuMemSetAccess / zeVirtualMemSetAccessAttribute "
                                f"first)")
                maps.append(m)
                a = m.end
            return Region(addr, nbytes, maps, accessor, write, self.lock)

    # -- state ----------------------------------------------------------------------------
    def stats(self) -> dict:
        with self.lock.shared():
            return {
                "vmm_reservations": len(self.reservations),
                "vmm_reserved_bytes": sum(r.size for r in self.reservations.values()),
                "vmm_handles": sum(1 for p in self.handles.values() if not p.released),
                "vmm_physical_bytes": sum(p.size for p in self.handles.values()),
                "vmm_physical_by_device": _by_device(self.handles.values()),
                "vmm_mappings": sum(len(r.maps) for r in self.reservations.values()),
                "vmm_mapped_bytes": sum(m.size for r in self.reservations.values() for m in r.maps.values()),
            }

    def close(self, unmap: bool = True) -> None:
        """Drop everything (a reset): reservations go back to the host, files are closed.
        ``unmap=False`` (a forked child) only forgets."""
        if unmap:
            for r in list(self.reservations.values()):
                for m in r.maps.values():
                    m.live = False
                _munmap(r.base, r.size)
            for fd in self._files.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self.table.close()
        else:
            _memory.forget(self.table)
        self.reservations.clear()
        self._bases.clear()
        self.handles.clear()
        self._files.clear()


def _runs(pages: List[int]):
    """[(first page, count)] of consecutive runs in ``pages`` (in order)."""
    out = []
    for pg in pages:
        if out and out[-1][0] + out[-1][1] == pg:
            out[-1][1] += 1
        else:
            out.append([pg, 1])
    return out


_FALLOC_PUNCH = 0x02 | 0x01     # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE (linux/falloc.h)


def _punch(fd: int, pages: List[int]) -> None:
    """Give released pages back to the host (contents of new handles start as zeros)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        fallocate = _c().fallocate
    except AttributeError:
        return
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    for first, count in _runs(pages):
        fallocate(fd, _FALLOC_PUNCH, first * GRANULARITY, count * GRANULARITY)
