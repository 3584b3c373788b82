"""Simulated device and pinned memory: host buffers at real addresses.

A "device pointer" is an address in the **device range**: address space reserved for device
memory (anonymous ``mmap``, ``PROT_NONE`` and ``MAP_NORESERVE``, as _vmm.py reserves), carved
into allocations by :class:`_Arena` and committed (``mprotect``) as it is used.  Nothing else in
the process gets those addresses, so an address in the device range that no live allocation holds
is a freed (or never allocated) device address, never pageable host memory: the copy paths refuse
it (:func:`in_device_range`).  Pages cost nothing until touched, and the whole pages of a freed
allocation go back to the host at once (``MADV_DONTNEED``), so resident memory is what the live
allocations touched, as with the host heap before.  Pinned host memory ("host" allocations:
cudaHostAlloc, zeMemAllocHost) is carved out of a second reserved range of its own, the **pinned
range**, the same way (r63d): a real cudaFreeHost unmaps the pages, so an address in the pinned
range that no live allocation holds is freed pinned memory, never pageable host memory
(:func:`in_pinned_range`).  Both are aligned to 256 bytes as cudaMalloc guarantees.  Copies are plain ``memmove``.  Every
live allocation is in a :class:`MemoryTable`, which finds the allocation
containing any address (so interior pointers and copy ranges can be checked)
and keeps the buffer alive.  Tables register themselves so
``accel.sim.kernels.view`` can check the ranges a reference kernel touches.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import sys
import threading
from typing import Dict, List, Optional

from .core import ffi

ALIGN = 256
_new_raw = ffi.new_allocator(should_clear_after_alloc=False)
_UINTPTR = ffi.typeof("uintptr_t")
_CHARP = ffi.typeof("char *")

DEVICE = "device"
HOST = "host"   # pinned (page-locked) host memory


class Allocation:
    """One live (or freed, if still referenced by queued work) allocation."""

    __slots__ = ("base", "size", "kind", "device", "buf", "live", "key")

    def __init__(self, base, size, kind, device, buf):
        self.base = base
        self.size = size
        self.kind = kind
        self.device = device
        self.buf = buf          # the cffi owner; keeps the memory alive
        self.live = True
        self.key = ffi.cast("void *", base)   # cdata key: dict lookups by the caller's cdata

    @property
    def end(self) -> int:
        return self.base + self.size


def allocate(size: int, kind: str, device: int, align: int = ALIGN, zeroed: bool = False) -> Allocation:
    """A new buffer of ``size`` bytes aligned to ``align`` (a power of two, 256 unless given),
    ``zeroed`` or not (calloc: large zeroed buffers touch no page until used); raises MemoryError
    when the host has no room.  Device memory comes from the device range (its memory goes back
    when the allocation's last reference, ``buf``, is dropped: queued work keeps it alive)."""
    arena = _arena if kind == DEVICE else _pinned_arena
    if arena is not None:
        base, buf = arena.take(size, align, zeroed)
        return Allocation(base, size, kind, device, buf)
    if kind == HOST and _PHYSICAL is not None and size > _PHYSICAL:
        raise MemoryError(f"cannot allocate {size} bytes of pinned host memory: the host has {_PHYSICAL} bytes "
                          f"of physical memory")
    raw = (ffi.new if zeroed else _new_raw)("char[]", size + align)
    addr = int(ffi.cast(_UINTPTR, raw))
    base = (addr + align - 1) & ~(align - 1)
    return Allocation(base, size, kind, device, raw)


class MemoryTable:
    """Live allocations by base address, with containment lookup."""

    def __init__(self):
        self._lock = threading.Lock()
        self._bases: List[int] = []
        self.by_key = {}   # base int AND base cdata -> Allocation (exact-base lookups, e.g. free)
        _tables.append(self)

    def add(self, a: Allocation) -> None:
        with self._lock:
            bisect.insort(self._bases, a.base)
            self.by_key[a.base] = a
            self.by_key[a.key] = a

    def remove(self, a: Allocation) -> None:
        with self._lock:
            i = bisect.bisect_left(self._bases, a.base)
            if i < len(self._bases) and self._bases[i] == a.base:
                del self._bases[i]
            self.by_key.pop(a.base, None)
            self.by_key.pop(a.key, None)
            a.live = False

    def find(self, addr: int) -> Optional[Allocation]:
        """The allocation containing ``addr`` (its last byte included), or None."""
        with self._lock:
            bases = self._bases
            i = bisect.bisect_right(bases, addr) - 1
            if i < 0:
                return None
            a = self.by_key[bases[i]]
        if addr < a.base + max(a.size, 1):
            return a
        return None

    def all(self) -> List[Allocation]:
        with self._lock:
            return [self.by_key[b] for b in self._bases]

    def clear(self) -> None:
        with self._lock:
            for b in self._bases:
                a = self.by_key.get(b)
                if a is not None:
                    a.live = False
            self._bases.clear()
            self.by_key.clear()

    def close(self) -> None:
        self.clear()
        try:
            _tables.remove(self)
        except ValueError:
            pass


_tables: List[MemoryTable] = []


#: A forked child's tables of the parent's allocations (see forget): never released here.
_inherited: List[MemoryTable] = []


def forget(table: MemoryTable) -> None:
    """Unregister ``table`` without taking its lock (a forked child: the lock may be
    held by a parent thread that does not exist here).  Its allocations stay mapped for the
    child's life: fork(2), "The entire virtual address space of the parent is replicated in the
    child", so memory the parent allocated (a pinned array the child inherited) reads there as
    in the parent.  Dropping the table would give its blocks back to the arena, which unmaps a
    chunk's pages once no block is left in it: the child's read of an inherited pinned array
    then faulted."""
    try:
        _tables.remove(table)
    except ValueError:
        pass
    _inherited.append(table)


def find_any(addr: int) -> Optional[Allocation]:
    """The live simulated allocation (any library, any kind) containing ``addr``."""
    for t in list(_tables):
        a = t.find(addr)
        if a is not None:
            return a
    return None


def addr_of(x) -> int:
    """A pointer argument (int, None or any cdata pointer/array) as an int address."""
    if x.__class__ is int:
        return x
    if x is None:
        return 0
    return int(ffi.cast(_UINTPTR, x))


def char_ptr(addr: int):
    return ffi.cast(_CHARP, addr)


# -- the device range ----------------------------------------------------------------------------

_PAGE = mmap.PAGESIZE
_CHUNK = 1 << 36            # address space reserved at a time: 64 GiB (a larger one for a larger block)
_RECENT = 64                # freed blocks remembered for reuse at the same address
_COMMIT_STEP = 64 << 20     # mprotect'ed read/write in steps (one mapping grows; pages untouched cost nothing)
_PROT_NONE, _PROT_RW = 0, 3
if sys.platform.startswith("linux"):
    _MAP_FLAGS, _MAP_FIXED, _MADV_DONTNEED = 0x2 | 0x20 | 0x4000, 0x10, 4      # PRIVATE|ANON|NORESERVE
elif sys.platform == "darwin":
    _MAP_FLAGS, _MAP_FIXED, _MADV_DONTNEED = 0x2 | 0x1000 | 0x40, 0x10, None    # (darwin: remap to drop)
else:
    _MAP_FLAGS = None


class _Chunk:
    """One reservation: ``[base, end)``, read/write up to ``committed``, its free ranges
    (start -> end, and the sorted starts)."""
    __slots__ = ("base", "end", "committed", "free", "starts", "live")

    def __init__(self, base: int, size: int):
        self.base, self.end, self.committed = base, base + size, base
        self.free: Dict[int, int] = {base: base + size}
        self.starts: List[int] = [base]
        self.live = 0           # allocations in it


class _Arena:
    """The device range: first-fit blocks of 256-byte multiples in reserved chunks.  A block
    is given back by its ``buf``'s finalizer; that may run on any thread, inside a take or a give
    of the same thread (the garbage collector), so a give that cannot take the lock at once is
    queued and done by the holder before it lets go.  Invariant: a whole page inside a free range
    is untouched or was dropped (MADV_DONTNEED), so it reads zeros."""

    def __init__(self, what: str = "device memory", limit: Optional[int] = None):
        self.what = what
        self.limit = limit              # most live bytes at once (None: address space only)
        self.live_bytes = 0             # bytes of the live blocks (256-byte multiples)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        for name in ("mprotect", "madvise"):
            f = getattr(libc, name)
            f.restype = ctypes.c_int
            f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._libc = libc
        self._lock = threading.Lock()
        self._pending: List[tuple] = []
        self._recent: List[tuple] = []  # the last blocks freed (base, size), at most _RECENT
        self.chunks: List[_Chunk] = []
        self._bases: List[int] = []     # chunk bases, sorted
        self._index = ((), ())          # (bases, chunks) as tuples: read without the lock

    # address space
    def _mmap(self, addr: int, size: int, flags: int) -> int:
        p = self._libc.mmap(addr or None, size, _PROT_NONE, flags, -1, 0)
        if p is None or p == (1 << (8 * ctypes.sizeof(ctypes.c_void_p))) - 1:
            raise MemoryError(f"cannot reserve {size} bytes of address space for {self.what}: "
                              f"{os.strerror(ctypes.get_errno())}")
        return p

    def _drop(self, start: int, end: int) -> None:
        """Give the pages of [start, end) (page-aligned, read/write) back to the host: they read
        zeros from then on."""
        if _MADV_DONTNEED is not None:
            self._libc.madvise(start, end - start, _MADV_DONTNEED)
        else:
            self._mmap(start, end - start, _MAP_FLAGS | _MAP_FIXED)
            self._libc.mprotect(start, end - start, _PROT_RW)

    # blocks
    def take(self, size: int, align: int, zeroed: bool):
        n = (max(size, 1) + ALIGN - 1) & ~(ALIGN - 1)
        align = max(align, ALIGN)
        with self._lock:
            try:
                self._settle()          # gives queued by other threads count before the limit
                if self.limit is not None and self.live_bytes + n > self.limit:
                    raise MemoryError(f"cannot allocate {size} bytes of {self.what}: {self.live_bytes} bytes are "
                                      f"live and the host has {self.limit} bytes of physical memory")
                base = self._take(n, align)
                self.live_bytes += n
            finally:
                self._settle()
        self._after()
        if zeroed:
            # the whole pages inside are zero (the invariant); a part page may hold old bytes
            head = min(base + n, (base + _PAGE - 1) & ~(_PAGE - 1))
            tail = max(head, (base + n) & ~(_PAGE - 1))
            if head > base:
                ctypes.memset(base, 0, head - base)
            if base + n > tail:
                ctypes.memset(tail, 0, base + n - tail)
        return base, ffi.gc(ffi.cast(_CHARP, base), self._finalizer(base, n))

    def _finalizer(self, base: int, n: int):
        def give(_):
            self.give(base, n)
        return give

    def _take(self, n: int, align: int) -> int:
        # The block of this size freed last, if still free, as the host heap and the CUDA pools
        # hand out a freed address again (accel's tests of reused addresses rely on it).
        recent = self._recent
        for j in range(len(recent) - 1, -1, -1):
            b, m = recent[j]
            if m == n and not b & (align - 1):
                del recent[j]
                c = self.chunks[bisect.bisect_right(self._bases, b) - 1]
                i = bisect.bisect_right(c.starts, b) - 1
                if i >= 0 and b + n <= c.free[c.starts[i]]:
                    return self._carve(c, c.starts[i], b, n)
                break
        for c in self.chunks:
            for s in c.starts:
                a = (s + align - 1) & ~(align - 1)
                if a + n <= c.free[s]:
                    return self._carve(c, s, a, n)
        size = max(_CHUNK, (n + align + _CHUNK - 1) & ~(_CHUNK - 1))
        c = _Chunk(self._mmap(0, size, _MAP_FLAGS), size)
        i = bisect.bisect_left(self._bases, c.base)
        self._bases.insert(i, c.base)
        self.chunks.insert(i, c)
        self._index = (tuple(self._bases), tuple(self.chunks))
        a = (c.base + align - 1) & ~(align - 1)
        return self._carve(c, c.base, a, n)

    def _carve(self, c: _Chunk, s: int, a: int, n: int) -> int:
        t = c.free[s]
        if a + n > c.committed:
            top = min(c.end, (a + n + _COMMIT_STEP - 1) & ~(_COMMIT_STEP - 1))
            if self._libc.mprotect(c.committed, top - c.committed, _PROT_RW):
                raise MemoryError(f"cannot commit {top - c.committed} bytes of {self.what}: "
                                  f"{os.strerror(ctypes.get_errno())}")
            c.committed = top
        i = bisect.bisect_left(c.starts, s)
        if a > s:
            c.free[s] = a
        else:
            del c.free[s]
            del c.starts[i]
        if a + n < t:
            c.free[a + n] = t
            bisect.insort(c.starts, a + n)
        c.live += 1
        return a

    def give(self, base: int, n: int) -> None:
        try:
            self._pending.append((base, n))
            if self._lock.acquire(blocking=False):     # else the holder gives it back
                try:
                    self._settle()
                finally:
                    self._lock.release()
                self._after()
        except Exception:
            if not sys.is_finalizing():
                raise
            # interpreter shutdown: the process gives everything back

    def _after(self) -> None:
        """Gives queued while the lock was held, after it was let go (another thread's)."""
        while self._pending and self._lock.acquire(blocking=False):
            try:
                self._settle()
            finally:
                self._lock.release()

    def _settle(self) -> None:
        while self._pending:
            self._give(*self._pending.pop())

    def _give(self, b: int, n: int) -> None:
        c = self.chunks[bisect.bisect_right(self._bases, b) - 1]
        e = b + n
        lo, hi = b, e
        i = bisect.bisect_left(c.starts, b)
        if i > 0 and c.free[c.starts[i - 1]] == b:       # the free range before
            i -= 1
            lo = c.starts[i]
        else:
            c.starts.insert(i, b)
        if e in c.free:                                   # the free range after
            hi = c.free.pop(e)
            del c.starts[i + 1]
        c.free[lo] = hi
        c.live -= 1
        self.live_bytes -= n
        self._recent.append((b, n))
        if len(self._recent) > _RECENT:
            del self._recent[0]
        if c.live == 0 and c.committed > c.base:
            # all free: drop the commitment too (address space stays reserved: still device range)
            self._mmap(c.base, c.committed - c.base, _MAP_FLAGS | _MAP_FIXED)
            c.committed = c.base
            return
        # the whole pages of [lo, hi) that [b, e) touched (the others were free already: zero)
        first = max((lo + _PAGE - 1) & ~(_PAGE - 1), b & ~(_PAGE - 1))
        last = min(hi & ~(_PAGE - 1), (e + _PAGE - 1) & ~(_PAGE - 1), c.committed)
        if first < last:
            self._drop(first, last)

    def contains(self, addr: int, n: int = 1) -> bool:
        bases, chunks = self._index
        i = bisect.bisect_right(bases, addr + max(n, 1) - 1) - 1
        return i >= 0 and addr < chunks[i].end

    def before_fork(self) -> None:
        self._lock.acquire()

    def after_fork_in_parent(self) -> None:
        self._lock.release()
        self._after()

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()


def in_device_range(addr: int, n: int = 1) -> bool:
    """Whether [addr, addr+n) touches the device range: device memory, live or not, never host
    memory (a freed device address is not pageable memory)."""
    return _arena is not None and _arena.contains(addr, n)


def in_pinned_range(addr: int, n: int = 1) -> bool:
    """Whether [addr, addr+n) touches the pinned range: pinned host memory, live or not.  CUDA
    Runtime API, cudaFreeHost: "Frees the memory space pointed to by ptr, which must have been
    returned by a previous call to cudaMallocHost() or cudaHostAlloc()": the pages are unmapped,
    so a freed pinned address is not pageable host memory either."""
    return _pinned_arena is not None and _pinned_arena.contains(addr, n)


def _new_arena(what: str) -> Optional[_Arena]:
    if _MAP_FLAGS is None:
        return None
    try:
        arena = _Arena(what)
    except (OSError, AttributeError):   # no mmap/mprotect/madvise: the memory is host heap
        return None
    if hasattr(os, "register_at_fork"):
        # a fork happens between two arena operations (the forking thread holds the lock across
        # it), so the child's copy is whole; the child gets a new lock, the parent lets go
        os.register_at_fork(before=arena.before_fork, after_in_parent=arena.after_fork_in_parent,
                            after_in_child=arena.after_fork_in_child)
    return arena


def _physical_memory() -> Optional[int]:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


#: Pinned (page-locked) host memory is never more than the host's physical memory, live at once
#: (r67b): page-locked pages stay resident in RAM (CUDA C++ Programming Guide, "Page-Locked Host
#: Memory": "page-locked host memory is a scarce resource ... allocations in page-locked memory will
#: start failing long before allocations in pageable memory"), so cudaHostAlloc past it returns
#: cudaErrorMemoryAllocation (Runtime API, cudaHostAlloc) and zeMemAllocHost
#: ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY (ze_api.h).  The range alone would hand out terabytes that
#: a program touching them could not have (the OOM killer instead of the vendor's error).
_PHYSICAL = _physical_memory()

_arena: Optional[_Arena] = _new_arena("device memory")
_pinned_arena: Optional[_Arena] = _new_arena("pinned host memory")
if _pinned_arena is not None:
    _pinned_arena.limit = _PHYSICAL
