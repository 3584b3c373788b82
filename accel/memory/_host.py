"""Pinned (page-locked) host caching allocator, as torch's CachingHostAllocator.

Blocks come from ``Backend.host_alloc`` (cudaHostAlloc, zeMemAllocHost, a
shared MTLBuffer) in power-of-two sizes and are cached by size after
``free``.  A block used by asynchronous copies is tied to those streams with
``record_stream``; at ``free`` an event is recorded on each such stream and
the block is reused only after all of them completed.

Events are created on the calling thread's current device, so call
``record_stream``/``free`` with the stream's device current (``accel.Buffer``
does).
"""

from __future__ import annotations

import threading
from typing import Dict, List, Tuple

from .._errors import OutOfMemoryError
from ._caching import _check_size

_MIN_SIZE = 512


class _HostBlock:
    __slots__ = ("ptr", "size", "allocated", "uses", "events")

    def __init__(self, ptr, size):
        self.ptr = ptr
        self.size = size
        self.allocated = True
        self.uses = None
        self.events = 0


class HostCachingAllocator:
    """Process-wide pinned host allocator; thread-safe.  See the module docstring."""

    def __init__(self, backend=None):
        self._be = backend
        self._lock = threading.Lock()
        self._blocks: Dict[int, _HostBlock] = {}
        self._free: Dict[int, List[int]] = {}          # size -> ptrs ready for reuse
        self._events: List[Tuple[int, _HostBlock]] = []
        self._event_cache: List[int] = []
        self._stats = {"allocated_bytes": 0, "reserved_bytes": 0, "allocations": 0,
                       "segments": 0, "num_host_alloc": 0, "num_host_free": 0}

    def _backend(self):
        if self._be is None:
            from .. import _lazy
            self._be = _lazy.lazy_init()
        return self._be

    def malloc(self, nbytes: int) -> int:
        """Pinned host memory of at least ``nbytes`` (0 for 0 bytes); OutOfMemoryError
        when the backend cannot pin more even after the cache was released."""
        nbytes = _check_size(nbytes)
        if nbytes == 0:
            return 0
        size = max(_MIN_SIZE, 1 << (nbytes - 1).bit_length())
        be = self._backend()
        with self._lock:
            if self._events:
                self._process_events()
            ready = self._free.get(size)
            if ready:
                block = self._blocks[ready.pop()]
            else:
                try:
                    ptr = be.host_alloc(size)
                except OutOfMemoryError:
                    self._release_free()
                    ptr = be.host_alloc(size)   # a second failure propagates
                block = self._blocks[ptr] = _HostBlock(ptr, size)
                self._stats["reserved_bytes"] += size
                self._stats["segments"] += 1
                self._stats["num_host_alloc"] += 1
            block.allocated = True
            self._stats["allocated_bytes"] += size
            self._stats["allocations"] += 1
            return block.ptr

    def free(self, ptr: int) -> None:
        """Return ``ptr`` to the cache (0 is a no-op).  ValueError for a double free
        or a pointer this allocator did not hand out; the state is then unchanged."""
        with self._lock:
            block = self._blocks.get(ptr)
            if block is None or not block.allocated:
                if ptr == 0 and type(ptr) is int:
                    return
                raise self._not_allocated(ptr, block)
            block.allocated = False
            self._stats["allocated_bytes"] -= block.size
            self._stats["allocations"] -= 1
            if block.uses:
                be = self._be
                for stream in block.uses:
                    event = self._event_cache.pop() if self._event_cache else be.event_create()
                    be.event_record(event, stream)
                    self._events.append((event, block))
                    block.events += 1
                block.uses = None
            else:
                self._free.setdefault(block.size, []).append(ptr)

    def record_stream(self, ptr: int, stream: int) -> None:
        """The allocated block at ``ptr`` is used by work on ``stream``: after
        :meth:`free` it waits for that work before being reused."""
        with self._lock:
            block = self._blocks.get(ptr)
            if block is None or not block.allocated:
                raise self._not_allocated(ptr, block)
            if block.uses is None:
                block.uses = {stream}
            else:
                block.uses.add(stream)

    def empty_cache(self) -> None:
        """Unpin every cached block whose work has completed (never waits)."""
        with self._lock:
            if self._events:
                self._process_events()
            self._release_free()
            be = self._be
            for event in self._event_cache:
                be.event_destroy(event)
            self._event_cache.clear()

    def stats(self) -> dict:
        """Bytes and counts: allocated_bytes, reserved_bytes, allocations, segments,
        num_host_alloc, num_host_free, pending (blocks waiting for events)."""
        with self._lock:
            out = dict(self._stats)
            out["pending"] = len({id(b) for _, b in self._events})
            return out

    def _process_events(self) -> None:
        remaining = []
        query = self._be.event_query
        for event, block in self._events:
            if query(event):
                self._event_cache.append(event)
                block.events -= 1
                if block.events == 0:
                    self._free.setdefault(block.size, []).append(block.ptr)
            else:
                remaining.append((event, block))
        self._events = remaining

    def _release_free(self) -> None:
        for ptrs in self._free.values():
            for ptr in ptrs:
                block = self._blocks.pop(ptr)
                self._be.host_free(ptr)
                self._stats["reserved_bytes"] -= block.size
                self._stats["segments"] -= 1
                self._stats["num_host_free"] += 1
        self._free.clear()

    @staticmethod
    def _not_allocated(ptr, block) -> Exception:
        if type(ptr) is not int:
            return TypeError(f"pointer must be an int, got {type(ptr).__name__} {ptr!r}")
        if block is not None:
            return ValueError(f"pinned host pointer {ptr:#x} is not allocated (double free?)")
        return ValueError(f"pointer {ptr:#x} was not allocated by the pinned host allocator")

