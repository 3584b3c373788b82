"""Simulated device and pinned memory: host buffers at real addresses.

A "device pointer" is the address of a host buffer allocated with cffi (not
cleared, so big allocations cost only address space until touched), aligned
to 256 bytes as cudaMalloc guarantees.  Copies are plain ``memmove``.  Every
live allocation is in a :class:`MemoryTable`, which finds the allocation
containing any address (so interior pointers and copy ranges can be checked)
and keeps the buffer alive.  Tables register themselves so
``accel.sim.kernels.view`` can check the ranges a reference kernel touches.
"""

from __future__ import annotations

import bisect
import threading
from typing import List, Optional

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
    when the host has no room."""
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


def forget(table: MemoryTable) -> None:
    """Unregister ``table`` without taking its lock (a forked child: the lock may be
    held by a parent thread that does not exist here)."""
    try:
        _tables.remove(table)
    except ValueError:
        pass


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
