"""Events and event pools: every record signals a fresh Level Zero event from a pool.

* **Events** must be reset before they are signalled again, and a reset can
  race with a wait appended earlier, so every ``event_record`` signals a
  *fresh* Level Zero event from a pool; the previous one is recycled only
  when every stream that signalled or waited on it has provably passed that
  point (the backend numbers each stream's commands and learns completion
  from syncs and queries).  A waiter therefore always waits for the record it
  saw, as in CUDA.  Timing events come from ``KERNEL_TIMESTAMP`` pools and
  are signalled by a barrier, which stamps them; elapsed time is the
  difference of the two global end timestamps (wrapped to
  ``kernelTimestampValidBits``) times the timer period, read with
  ``ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES_1_2`` (ticks per second) on API 1.2+
  drivers and the 1.0 structure (whole nanoseconds per tick) before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

from ..._errors import AcceleratorError, CaptureError
from ._library import LIBRARY, _UINT64_MAX

if TYPE_CHECKING:
    from .discovery import _Device
    from .streams import _Stream


_EVENTS_PER_POOL = 64


class _Slot:
    """One Level Zero event from a pool, and the stream points that use it."""

    __slots__ = ("pool", "index", "event", "timing", "deps", "ctx", "waiters")

    def __init__(self, pool, index, event, timing, ctx):
        self.pool, self.index, self.event, self.timing, self.ctx = pool, index, event, timing, ctx
        self.deps = []   # [(stream, seq)]: it is free again once every stream passed its point
        # host threads waiting on / querying it: as a stream's marker (changed under that stream's
        # lock) or as an event's record (under the backend's lock, _pin); a slot is one or the other
        self.waiters = 0


class _Event:
    """An event and its latest record: ``rec`` is (slot, stream, number of the signal on the
    stream), or None.  One attribute, replaced whole: a thread that queries the event while
    another records it again reads one record, never the slot of one and the stream of the other."""
    __slots__ = ("device", "timing", "blocking", "rec", "handle")

    def __init__(self, handle, device, timing, blocking):
        self.handle, self.device, self.timing, self.blocking = handle, device, timing, blocking
        self.rec: Optional[Tuple[_Slot, _Stream, int]] = None

    @property
    def slot(self) -> Optional[_Slot]:
        rec = self.rec
        return None if rec is None else rec[0]


class EventsMixin:
    """Events (``_events``), event slots from pools (``_pools``, ``_free_slots``, ``_retired``)
    and the sweep that recycles slots and frees deferred staging memory once streams passed them."""

    def _acquire(self, dev: _Device, timing: bool) -> _Slot:
        key = (id(dev.ctx), timing)
        with self._lock:
            free = self._free_slots.setdefault(key, [])
            if not free and self._retired:
                # Only when needed: retired slots pile up between syncs, so first learn
                # (without waiting) how far the streams got, then recycle what they passed.
                self._poll()
                self._sweep()
            if free:
                return free.pop()
            ffi, lib, _ = self._lib
            desc = ffi.new("ze_event_pool_desc_t *")
            desc.stype = lib.ZE_STRUCTURE_TYPE_EVENT_POOL_DESC
            desc.flags = lib.ZE_EVENT_POOL_FLAG_HOST_VISIBLE | (lib.ZE_EVENT_POOL_FLAG_KERNEL_TIMESTAMP if timing else 0)
            desc.count = _EVENTS_PER_POOL
            p = ffi.new("ze_event_pool_handle_t *")
            # No device list: the pool's events work on every device of the context.
            rc = lib.zeEventPoolCreate(dev.ctx, desc, 0, ffi.NULL, p)
            if rc:
                self._fail("zeEventPoolCreate", rc)
            pool = p[0]
            made = []
            for i in range(_EVENTS_PER_POOL):
                ed = ffi.new("ze_event_desc_t *")
                ed.stype = lib.ZE_STRUCTURE_TYPE_EVENT_DESC
                ed.index = i
                ed.signal = lib.ZE_EVENT_SCOPE_FLAG_HOST   # results visible to the host once signalled
                ed.wait = lib.ZE_EVENT_SCOPE_FLAG_HOST
                pe = ffi.new("ze_event_handle_t *")
                rc = lib.zeEventCreate(pool, ed, pe)
                if rc:
                    # Nothing of the new pool stays behind (the first error is the one reported).
                    for slot in made:
                        self._discard("zeEventDestroy", slot.event)
                    self._discard("zeEventPoolDestroy", pool)
                    self._fail("zeEventCreate", rc)
                made.append(_Slot(pool, i, pe[0], timing, dev.ctx))
            self._pools.append(pool)
            made.reverse()
            slot = made.pop()
            free.extend(made)
            return slot

    def _retire(self, slot: _Slot) -> None:
        with self._lock:
            self._retired.append(slot)

    def _sweep(self) -> None:
        """Recycle event slots and free staging memory whose users have all passed them."""
        # A failed call leaves the slots and blocks not yet handled where they were (none twice).
        with self._lock:
            if self._orphans:
                lib = self._lib[1]
                self._orphans = [(call, h) for call, h in self._orphans if getattr(lib, call)(h)]
            if self._retired:
                keep, i = [], 0
                try:
                    for i, slot in enumerate(self._retired):
                        if not slot.waiters and all(s.done >= seq for s, seq in slot.deps):
                            rc = self._lib[1].zeEventHostReset(slot.event)
                            if rc:
                                self._fail("zeEventHostReset", rc)
                            slot.deps = []
                            self._free_slots.setdefault((id(slot.ctx), slot.timing), []).append(slot)
                        else:
                            keep.append(slot)
                    i = len(self._retired)
                finally:
                    self._retired = keep + self._retired[i:]
            if self._deferred:
                keep, i = [], 0
                try:
                    for i, (deps, ptr) in enumerate(self._deferred):
                        if all(s.done >= seq for s, seq in deps):
                            self._host_free(ptr)
                        else:
                            keep.append((deps, ptr))
                    i = len(self._deferred)
                finally:
                    self._deferred = keep + self._deferred[i:]

    def _event(self, handle: int) -> _Event:
        e = self._events.get(handle)
        if e is None:
            raise ValueError(f"{handle!r} is not a live XPU event handle")
        return e

    def event_create(self, enable_timing: bool = False, blocking: bool = False) -> int:
        dev = self._current()
        handle = next(self._ids)
        with self._lock:
            self._events[handle] = _Event(handle, dev, bool(enable_timing), bool(blocking))
        return handle

    def event_destroy(self, event: int) -> None:
        with self._lock:        # (the record is swapped under this lock: see _record)
            e = self._events.pop(event, None)
            rec = None
            if e is not None:
                rec, e.rec = e.rec, None
        if e is None:
            raise ValueError(f"{event!r} is not a live XPU event handle")
        if rec is not None:
            self._retire(rec[0])

    def event_record(self, event: int, stream: int) -> None:
        e = self._event(event)
        s = self._stream(stream)
        if s.capture is not None:
            self._invalidate(s.capture, "event_record on the capturing stream")
            raise CaptureError("XPU graph capture cannot record events (cross-stream capture is not "
                               "supported by the Level Zero backend); the capture is invalidated")
        self._record(e, s)

    def _record(self, e: _Event, s: _Stream) -> None:
        """Signal a fresh event slot at the end of ``s`` for ``e``; the old slot is recycled later."""
        slot = self._acquire(s.device, e.timing)
        ffi, lib, _ = self._lib
        with s.lock:
            try:
                if e.timing:
                    # A barrier that signals writes the kernel timestamps (as SYCL's profiled
                    # barrier); on an in-order list it completes after all earlier commands.
                    self._append(s, "zeCommandListAppendBarrier", lib.zeCommandListAppendBarrier,
                                 s.list, slot.event, 0, ffi.NULL)
                else:
                    self._append(s, "zeCommandListAppendSignalEvent", lib.zeCommandListAppendSignalEvent,
                                 s.list, slot.event)
            except BaseException:
                self._retire(slot)
                raise
            s.seq += 1
            slot.deps.append((s, s.seq))
            s.last = (slot, s.seq)
            # One swap under the backend's lock: two threads recording the event at once each
            # retire the record they replaced (not both the same one), and a record of an event
            # destroyed meanwhile is retired here, not kept by an event nobody can reach.
            with self._lock:
                live = self._events.get(e.handle) is e or e.handle == 0    # (0: a graph's completion)
                old, e.rec = e.rec, ((slot, s, s.seq) if live else None)
        if old is not None:
            self._retire(old[0])
        if not live:
            self._retire(slot)
            raise ValueError(f"{e.handle!r} is not a live XPU event handle (destroyed by another thread meanwhile)")

    def event_query(self, event: int) -> bool:
        # Level Zero has no stream capture (accel records into a regular list) and its spec says
        # nothing of host queries meanwhile; the capture follows CUDA's rules, where
        # cudaEventQuery/cudaEventSynchronize are "potentially unsafe" during a capture (Programming
        # Guide, "CUDA Graphs" > "Prohibited and Unhandled Operations"), as the CUDA backend does.
        self._unsafe("event_query")
        return self._query(event)

    def _query(self, event: int) -> bool:
        rec = self._pin(self._event(event))
        if rec is None:
            return True
        slot, stream, seq = rec
        lib = self._lib[1]
        try:
            rc = lib.zeEventQueryStatus(slot.event)
        finally:
            self._unpin(slot)
        if rc == lib.ZE_RESULT_NOT_READY:
            return False
        if rc:
            self._fail("zeEventQueryStatus", rc)
        self._progress(stream, seq)
        return True

    def _pin(self, e: _Event):
        """The event's record if its work is not known complete, its slot kept from recycling
        until :meth:`_unpin` (another thread may record the event again meanwhile, and the old
        slot be reset and reused: a wait on it would wait for unrelated work); else None."""
        with self._lock:
            rec = e.rec
            if rec is None or rec[1].done >= rec[2]:
                return None
            rec[0].waiters += 1
            return rec

    def _unpin(self, slot: _Slot) -> None:
        with self._lock:
            slot.waiters -= 1

    def event_synchronize(self, event: int) -> None:
        self._unsafe("event_synchronize")     # (as event_query)
        rec = self._pin(self._event(event))
        if rec is None:
            return
        slot, stream, seq = rec
        try:
            rc = self._lib[1].zeEventHostSynchronize(slot.event, _UINT64_MAX)
        finally:
            self._unpin(slot)
        if rc:
            self._fail("zeEventHostSynchronize", rc)
        self._progress(stream, seq)

    def event_elapsed_ms(self, start: int, end: int) -> float:
        a, b = self._event(start), self._event(end)
        if not (a.timing and b.timing):
            raise AcceleratorError("elapsed time needs both events created with enable_timing=True",
                                   library=LIBRARY)
        ra, rb = a.rec, b.rec
        if ra is None or rb is None:
            raise AcceleratorError("elapsed time needs both events recorded first", library=LIBRARY)
        if ra[1].device is not rb[1].device:
            # Each device stamps with its own timer: the difference of two devices' stamps means nothing.
            raise AcceleratorError(f"elapsed time needs two events of one device: they were recorded on XPU "
                                   f"device {ra[1].device.index} and device {rb[1].device.index}", library=LIBRARY)
        ffi, lib, _ = self._lib
        ticks = []
        for e in (a, b):
            slot = e.slot
            if not self._query(e.handle) or e.slot is not slot:
                raise AcceleratorError.from_call(LIBRARY, "zeEventQueryKernelTimestamp", lib.ZE_RESULT_NOT_READY,
                                                 "ZE_RESULT_NOT_READY", "the event's work has not completed yet")
            ts = ffi.new("ze_kernel_timestamp_result_t *")
            rc = lib.zeEventQueryKernelTimestamp(slot.event, ts)
            if rc:
                self._fail("zeEventQueryKernelTimestamp", rc)
            ticks.append(getattr(ts, "global").kernelEnd)
        dev = ra[1].device         # whose timer stamped them
        mask = dev.ts_mask
        delta = (ticks[1] - ticks[0]) & mask   # the counter wraps at kernelTimestampValidBits
        if delta > mask >> 1:
            delta -= mask + 1                  # end before start: negative, as CUDA reports it
        return delta * dev.ns_per_tick / 1e6
