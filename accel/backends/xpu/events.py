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

    def _acquire(self, dev: _Device, timing: bool, got: Optional[list] = None) -> _Slot:
        """A free event slot of ``dev``'s context (a new pool when none is left).  ``got`` (a
        one-item list) receives it as it leaves the free list, with no signal check between:
        the lock's release as this returns is one (CPython checks after a C call), and a
        caller whose try covers this call retires ``got[0]`` when a KeyboardInterrupt lands
        there, instead of losing the slot."""
        got = [None] if got is None else got
        key = (id(dev.ctx), timing)
        with self._lock:
            free = self._free_slots.setdefault(key, [])
            if not free and self._retired:
                # Only when needed: retired slots pile up between syncs, so first learn
                # (without waiting) how far the streams got, then recycle what they passed.
                self._poll()
                self._sweep()
            if free:
                got[0] = free[-1]
                del free[-1]
                return got[0]
            ffi, lib, _ = self._lib
            desc = ffi.new("ze_event_pool_desc_t *")
            desc.stype = lib.ZE_STRUCTURE_TYPE_EVENT_POOL_DESC
            desc.flags = lib.ZE_EVENT_POOL_FLAG_HOST_VISIBLE | (lib.ZE_EVENT_POOL_FLAG_KERNEL_TIMESTAMP if timing else 0)
            desc.count = _EVENTS_PER_POOL
            p = ffi.new("ze_event_pool_handle_t *")
            pe = ffi.new("ze_event_handle_t *")
            made = []
            try:
                # No device list: the pool's events work on every device of the context.
                rc = lib.zeEventPoolCreate(dev.ctx, desc, 0, ffi.NULL, p)
                if rc:
                    self._fail("zeEventPoolCreate", rc)
                pool = p[0]
                self._fill_pool(ffi, lib, dev, timing, pool, made, pe)
            except Exception:
                raise
            except BaseException:
                # A KeyboardInterrupt as the driver returned a pool or an event: nothing of the
                # new pool stays behind (made and pe, p start empty: what exists is destroyed).
                if pe[0] != ffi.NULL and not any(slot.event == pe[0] for slot in made):
                    lib.zeEventDestroy(pe[0])
                for slot in made:
                    lib.zeEventDestroy(slot.event)
                if p[0] != ffi.NULL:
                    lib.zeEventPoolDestroy(p[0])
                raise
            # published with plain stores (no signal check between them): the pool, the free
            # slots, and the caller's slot in ``got``
            got[0] = made[-1]
            del made[-1]
            self._pools += [pool]
            free += made
            return got[0]

    def _fill_pool(self, ffi, lib, dev, timing: bool, pool, made: list, pe) -> None:
        """The pool's events, into ``made`` (``pe``: the out-pointer, read by the caller's undo)."""
        for i in range(_EVENTS_PER_POOL):
            ed = ffi.new("ze_event_desc_t *")
            ed.stype = lib.ZE_STRUCTURE_TYPE_EVENT_DESC
            ed.index = i
            ed.signal = lib.ZE_EVENT_SCOPE_FLAG_HOST   # results visible to the host once signalled
            ed.wait = lib.ZE_EVENT_SCOPE_FLAG_HOST
            pe[0] = ffi.NULL
            rc = lib.zeEventCreate(pool, ed, pe)
            if rc:
                # Nothing of the new pool stays behind (the first error is the one reported).
                for slot in made:
                    self._discard("zeEventDestroy", slot.event)
                self._discard("zeEventPoolDestroy", pool)
                self._fail("zeEventCreate", rc)
            made += [_Slot(pool, i, pe[0], timing, dev.ctx)]
        made.reverse()

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
                # Each slot leaves the retired list (``start`` past it) and joins a free list with
                # plain stores, no signal check between: a KeyboardInterrupt never leaves it in
                # both (before, one as the free list's append returned kept it retired too, and
                # the next sweep made it free twice: one slot for two records).  One as the
                # reset returns leaves it retired: reset again later, which is harmless.
                lib = self._lib[1]
                keep, start = [], 0
                try:
                    for i, slot in enumerate(self._retired):
                        if _passed(slot):
                            rc = lib.zeEventHostReset(slot.event)
                            if rc:
                                self._fail("zeEventHostReset", rc)
                            free = self._free_slots.setdefault((id(slot.ctx), slot.timing), [])
                            slot.deps = []
                            start = i + 1
                            free += [slot]
                        else:
                            keep += [slot]
                            start = i + 1
                    start = len(self._retired)
                finally:
                    self._retired = keep + self._retired[start:]
            if self._deferred:
                # Each block is forgotten (``start`` past it) before its zeMemFree, with no signal
                # check between: a KeyboardInterrupt as the free returns leaves it forgotten, not
                # kept to be freed twice (INVALID_ARGUMENT at every later sweep: accel wedged).
                ffi, lib, _ = self._lib
                ctx = self._devices[0].ctx
                keep, start = [], 0
                try:
                    for i, (deps, ptr) in enumerate(self._deferred):
                        if all(s.done >= seq for s, seq in deps):
                            cptr = ffi.cast("void *", ptr)
                            start = i + 1
                            rc = lib.zeMemFree(ctx, cptr)
                            if rc:
                                keep += [(deps, ptr)]      # refused: still there, freed again later
                                self._fail("zeMemFree", rc)
                        else:
                            keep += [(deps, ptr)]
                            start = i + 1
                    start = len(self._deferred)
                finally:
                    self._deferred = keep + self._deferred[start:]

    def _event(self, handle: int) -> _Event:
        e = self._events.get(handle)
        if e is None:
            raise ValueError(f"{handle!r} is not a live XPU event handle")
        return e

    def event_create(self, enable_timing: bool = False, blocking: bool = False) -> int:
        dev = self._current()
        handle = next(self._ids)
        e = _Event(handle, dev, bool(enable_timing), bool(blocking))
        try:
            with self._lock:
                self._events[handle] = e
        except BaseException:
            # a KeyboardInterrupt as the lock is released: the caller never got the handle
            with self._lock:
                if self._events.get(handle) is e:
                    del self._events[handle]
            raise
        return handle

    def event_destroy(self, event: int) -> None:
        # (the record is swapped under this lock: see _record).  Forgotten and its slot retired
        # with plain stores, no signal check between: a KeyboardInterrupt as the lock is
        # released no longer loses the slot (before: it was retired after the release).
        with self._lock:
            e = self._events.get(event)
            if e is not None:
                rec = e.rec
                del self._events[event]
                e.rec = None
                if rec is not None:
                    self._retired += [rec[0]]
        if e is None:
            raise ValueError(f"{event!r} is not a live XPU event handle")
        if rec is not None and _passed(rec[0]):
            # Its work is known done: recycled now, so it no longer names the streams it depended
            # on (destroyed ones among them) until some later operation sweeps (r63).  The event
            # is gone whatever happens here: a failed reset leaves the slot to the next sweep.
            try:
                self._sweep()
            except Exception:
                pass

    def event_record(self, event: int, stream: int) -> None:
        e = self._event(event)
        s = self._stream(stream)
        if s.capture is not None:
            self._invalidate(s.capture, "event_record on the capturing stream")
            raise CaptureError("XPU graph capture cannot record events (cross-stream capture is not "
                               "supported by the Level Zero backend); the capture is invalidated")
        self._record(e, s)

    def _record(self, e: _Event, s: _Stream) -> None:
        """Signal a fresh event slot at the end of ``s`` for ``e``; the old slot is recycled later.

        Interrupt safety (Ctrl-C): the slot is the caller's from the moment it leaves the free
        list (``got``) until it is published (``e.rec``, or retired), and retired on a
        KeyboardInterrupt in between; its use on ``s`` is counted before the signal is
        appended, so a slot retired after an interrupt as the append returned is reset only
        once the stream passed the signal (before, it was reset under the queued signal:
        zeEventHostReset HANDLE_OBJECT_IN_USE, and every later sweep failed the same way)."""
        got = [None]
        published = False
        ffi, lib, _ = self._lib
        try:
            slot = self._acquire(s.device, e.timing, got)
            with s.lock:
                self._check_live(s)
                seq = self._number(s, slot)
                if e.timing:
                    # A barrier that signals writes the kernel timestamps (as SYCL's profiled
                    # barrier); on an in-order list it completes after all earlier commands.
                    self._append(s, "zeCommandListAppendBarrier", lib.zeCommandListAppendBarrier,
                                 s.list, slot.event, 0, ffi.NULL)
                else:
                    self._append(s, "zeCommandListAppendSignalEvent", lib.zeCommandListAppendSignalEvent,
                                 s.list, slot.event)
                s.issued = seq
                s.last = (slot, seq)
                # One swap under the backend's lock: two threads recording the event at once each
                # retire the record they replaced (not both the same one), and a record of an event
                # destroyed meanwhile is retired here, not kept by an event nobody can reach.
                # Plain stores from the swap to the retirement (one C call, last).
                with self._lock:
                    live = self._events.get(e.handle) is e or e.handle == 0    # (0: a graph's completion)
                    old = e.rec
                    e.rec = (slot, s, seq) if live else None
                    published = True
                    self._retired += ([] if old is None else [old[0]]) + ([] if live else [slot])
        except BaseException:
            if got[0] is not None and not published:
                self._retire(got[0])
            raise
        if not live:
            raise ValueError(f"{e.handle!r} is not a live XPU event handle (destroyed by another thread meanwhile)")

    def event_query(self, event: int) -> bool:
        # Level Zero has no stream capture (accel records into a regular list) and its spec says
        # nothing of host queries meanwhile; the capture follows CUDA's rules, where
        # cudaEventQuery/cudaEventSynchronize are "potentially unsafe" during a capture (Programming
        # Guide, "CUDA Graphs" > "Prohibited and Unhandled Operations"), as the CUDA backend does.
        self._unsafe("event_query")
        return self._query(event)

    def _query(self, event: int) -> bool:
        e = self._event(event)
        lib = self._lib[1]
        pinned = [None]
        try:
            rec = self._pin(e, pinned)
            if rec is None:
                return True
            rc = lib.zeEventQueryStatus(rec[0].event)
        finally:
            if pinned[0] is not None:
                with self._lock:     # (a C lock: no Python frame, no signal check, before the decrement)
                    pinned[0][0].waiters -= 1
        slot, stream, seq = rec
        if rc == lib.ZE_RESULT_NOT_READY:
            return False
        if rc:
            self._fail("zeEventQueryStatus", rc)
        self._progress(stream, seq)
        return True

    def _pin(self, e: _Event, pinned: list):
        """The event's record if its work is not known complete, its slot kept from recycling
        until the caller's count goes down (another thread may record the event again meanwhile, and the old
        slot be reset and reused: a wait on it would wait for unrelated work); else None.
        ``pinned[0]`` gets the record as its count goes up (no signal check between): the
        caller's finally, whose try covers this call, takes it down even when a KeyboardInterrupt
        lands as the lock is released here (before, the slot stayed pinned for good)."""
        with self._lock:
            rec = e.rec
            if rec is None or rec[1].done >= rec[2]:
                return None
            rec[0].waiters += 1
            pinned[0] = rec
            return rec

    def event_synchronize(self, event: int) -> None:
        self._unsafe("event_synchronize")     # (as event_query)
        e = self._event(event)
        pinned = [None]
        try:
            rec = self._pin(e, pinned)
            if rec is None:
                return
            rc = self._lib[1].zeEventHostSynchronize(rec[0].event, _UINT64_MAX)
        finally:
            if pinned[0] is not None:
                with self._lock:     # (as _query)
                    pinned[0][0].waiters -= 1
        slot, stream, seq = rec
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


def _passed(slot) -> bool:
    """Whether a retired slot may be reset and reused: nobody waits on it on the host and every
    stream it depends on passed it."""
    return not slot.waiters and all(s.done >= seq for s, seq in slot.deps)
