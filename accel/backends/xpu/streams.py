"""Streams: immediate command lists, and how far each one's commands are known to have run.

* **Streams** are immediate command lists, ``ZE_COMMAND_QUEUE_FLAG_IN_ORDER``,
  asynchronous mode, on the device's compute queue group; each device's
  default stream is one created at init.  Drivers older than API 1.7 have no
  IN_ORDER flag, so a barrier follows every command there.  Stream sync uses
  ``zeCommandListHostSynchronize`` where the loader has it, else a fresh
  host-visible event appended after the last command.
* **Handles**: the stream table is keyed by the command list's handle value, which the driver
  gives to the next list it creates once the old one is destroyed.  So a stream leaves the
  table before its list is destroyed (and comes back if that fails), entries are removed by
  identity, and a created value that collides with a live entry is refused.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional, Tuple

from ..._errors import AcceleratorError, CaptureError
from ..._locks import Lock as _Lock
from ._library import LIBRARY, _UINT64_MAX

if TYPE_CHECKING:
    from .discovery import _Device
    from .events import _Slot


_PRIORITY_RANGE = (1, -1)    # (least, greatest): low, normal (0), high — numerically lower is higher


class _Stream:
    """An immediate command list and how far its commands are known to have completed."""

    __slots__ = ("handle", "device", "list", "lock", "seq", "done", "capture", "marker", "in_order", "dead",
                 "last", "waiting", "issued")

    def __init__(self, handle, device, cmdlist, in_order):
        self.handle, self.device, self.list, self.in_order = handle, device, cmdlist, in_order
        # Level Zero forbids appending to one list from two threads at once.  Held across vendor
        # calls, where a user's __del__ run by the collector may queue work again (accel._locks).
        self.lock = _Lock("queueing work on an XPU stream")
        # Commands appended: each is counted (seq bumped, a slot's use recorded) BEFORE its append
        # call, so a KeyboardInterrupt as the driver returns (CPython runs a handler right after
        # a C call, before its result is stored) leaves it counted, and a sync, a free's quiesce
        # and a slot's recycling wait for it; a count without a command is passed at once.
        self.seq = 0
        self.issued = 0                # seq as the last append returned: never ahead of the list
        self.done = 0                  # commands known complete
        self.capture = None            # _Capture while capturing
        self.marker = None             # (slot, seq): query marker on loaders without HostSynchronize
        self.last = None               # (slot, seq): the latest event this stream signals (progress polls)
        self.dead = False
        self.waiting = 0               # host threads inside zeCommandListHostSynchronize on the list


class StreamsMixin:
    """Streams (``_streams`` and each device's ``streams``): create, destroy, sync, query, waits,
    and appending commands in stream order."""

    def device_synchronize(self) -> None:
        dev = self._current()
        self._not_capturing("device_synchronize", [c for c in self._captures.values() if c.device is dev])
        self._unsafe("device_synchronize")   # and any device's, as cudaDeviceSynchronize (events.event_query)
        for s in list(dev.streams.values()):
            self._sync_stream(s)
        for g in list(dev.graphs):
            self._sync_graph(g)

    def _new_stream(self, dev: _Device, priority: int) -> _Stream:
        ffi, lib, _ = self._lib
        desc = ffi.new("ze_command_queue_desc_t *")
        desc.stype = lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC
        desc.ordinal = dev.ordinal
        desc.index = 0
        desc.flags = lib.ZE_COMMAND_QUEUE_FLAG_IN_ORDER if dev.in_order else 0
        desc.mode = lib.ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS
        if priority < 0:
            desc.priority = lib.ZE_COMMAND_QUEUE_PRIORITY_PRIORITY_HIGH
        elif priority > 0:
            desc.priority = lib.ZE_COMMAND_QUEUE_PRIORITY_PRIORITY_LOW
        else:
            desc.priority = lib.ZE_COMMAND_QUEUE_PRIORITY_NORMAL
        p = ffi.new("ze_command_list_handle_t *")
        s = None
        entered = False
        try:
            rc = lib.zeCommandListCreateImmediate(dev.ctx, dev.handle, desc, p)
            if rc:
                self._fail("zeCommandListCreateImmediate", rc)
            handle = int(ffi.cast("uintptr_t", p[0]))
            s = _Stream(handle, dev, p[0], dev.in_order)
            with self._lock:
                self._enter_stream(s)
                entered = True
        except Exception:
            raise
        except BaseException:
            # A KeyboardInterrupt as the driver returned the list (p starts NULL), or before the
            # caller got the stream (the lock's release is a signal check): out of the tables
            # and destroyed (it is idle), so an interrupted create leaves nothing.
            if p[0] != ffi.NULL:
                if entered:
                    with self._lock:
                        self._leave_stream(s)
                lib.zeCommandListDestroy(p[0])
            raise
        return s

    def _enter_stream(self, s: _Stream) -> None:
        """Put ``s`` in the stream tables (caller holds ``self._lock``).  A value the tables
        already hold for a live stream is refused, never overwritten: the driver reuses a value
        only once its list is destroyed, and a destroyed stream leaves the tables first
        (:meth:`stream_destroy`), so a collision means a stale entry or a driver handing out a
        live handle, and overwriting would make that other stream unreachable."""
        held = self._streams.get(s.handle)
        if held is not None and held is not s:
            raise AcceleratorError(
                f"{LIBRARY}: zeCommandListCreateImmediate returned {s.handle:#x}, which is already a live stream "
                f"of this process (device {held.device.index}); refusing to replace it. This is a driver or "
                f"accel bug: please report it with the output of `python -m accel`",
                library=LIBRARY, call="zeCommandListCreateImmediate")
        self._streams[s.handle] = s
        s.device.streams[s.handle] = s

    def _leave_stream(self, s: _Stream) -> None:
        """Take ``s`` out of the stream tables (caller holds ``self._lock``): only ``s`` itself,
        never another stream that now has the same handle value."""
        if self._streams.get(s.handle) is s:
            del self._streams[s.handle]
        if s.device.streams.get(s.handle) is s:
            del s.device.streams[s.handle]

    def _stream(self, handle: int) -> _Stream:
        s = self._streams.get(handle)
        if s is None:
            raise ValueError(f"{handle!r} is not a live XPU stream handle")
        return s

    def stream_create(self, priority: int = 0) -> int:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {priority!r}")
        return self._new_stream(self._current(), priority).handle

    def stream_destroy(self, stream: int) -> None:
        s = self._stream(stream)
        if s is s.device.default:
            raise ValueError("the default XPU stream of a device cannot be destroyed")
        if s.capture is not None:
            self._invalidate(s.capture, "the capturing stream was destroyed")
            raise CaptureError("stream_destroy: the stream is capturing; end the capture first")
        while True:
            self._sync_stream(s)   # the device must not reference a list being destroyed
            with s.lock:           # nothing is appended to the list from here to its destroy
                if s.dead:         # another thread destroyed it first: its value may be another list's now
                    raise ValueError(f"{stream!r} is not a live XPU stream handle (destroyed by another thread)")
                busy = s.done < s.seq or s.waiting > 0
                if not busy:
                    self._destroy_list(s)
            if not busy:
                break
            # Another thread appended meanwhile (a sync's marker), or still waits on the list
            # (device_synchronize): wait for that too (the list is idle: that returns at once).
            time.sleep(0)
        if s.marker is not None:
            self._retire(s.marker[0])
            s.marker = None
        # The kernels it launched forget it (their records are for module_unload's waits, and
        # the stream ran dry above): kept, they held up to 16 dead streams per kernel.
        _modules, kernels, klock = self._kernel_state()
        with klock:
            for entry in kernels.values():
                entry[3].pop(s, None)

    def _destroy_list(self, s: _Stream) -> None:
        """zeCommandListDestroy of an idle stream (caller holds ``s.lock``); on failure it stays live."""
        lib = self._lib[1]
        called = False
        try:
            with self._lock:
                # Out of the tables BEFORE the driver may hand the value to a new list (another
                # thread's stream_create): removed afterwards, by value, it took that new stream's
                # entry with it ("not a live XPU stream handle" on a live stream).
                self._leave_stream(s)
            # Dead (and all done) before the destroy, with no signal check from here to the call:
            # a KeyboardInterrupt as the destroy returns leaves no live-looking stream whose list
            # is gone, and one before the call puts the stream back (below): destroying it again
            # retries, where before its list was left behind, forgotten.
            s.done = s.seq = max(s.seq, s.done)
            s.dead = True
            called = True
            rc = lib.zeCommandListDestroy(s.list)
        except BaseException:
            if not called:
                s.dead = False
                with self._lock:
                    self._enter_stream(s)
            raise
        if rc:
            s.dead = False
            with self._lock:
                self._enter_stream(s)                # still live: destroying it again retries
            self._fail("zeCommandListDestroy", rc)

    def default_stream(self, index: int) -> int:
        return self._device(index).default.handle

    def foreign_stream(self, stream: int) -> Tuple[int, Optional[int]]:
        with self._lock:
            s = self._streams.get(stream)
        if s is None:
            raise ValueError(f"{stream!r} is not a live stream of accel's XPU backend: accel keeps state "
                             f"for each Level Zero command list it runs work on, so it can wrap only the "
                             f"handles it created (backend.stream_create, default_stream)")
        return stream, s.device.index

    def stream_priority_range(self) -> Tuple[int, int]:
        return _PRIORITY_RANGE

    def stream_synchronize(self, stream: int) -> None:
        s = self._stream(stream)
        self._not_capturing("stream_synchronize", [s.capture])
        self._unsafe("stream_synchronize")   # CUDA's rules for other streams (events.event_query)
        self._sync_stream(s)

    def _sync_stream(self, s: _Stream) -> None:
        """Wait for every command appended to ``s`` so far.  Callers that took ``s`` from a
        snapshot of the tables (device_synchronize, frees, close) may find it destroyed by
        another thread meanwhile: a dead stream has nothing left to wait for, and the wait
        itself keeps the list (or the marker event) from being destroyed (reset) under it."""
        ffi, lib, _ = self._lib
        if self._host_sync:
            # Interrupt safety (Ctrl-C): the count goes up inside the try whose finally takes it
            # down, with no signal check between the increment and `counted`, nor between the
            # finally's start and the decrement; before, an interrupt as the lock was released
            # kept it up for good and stream_destroy waited forever for it to drop.
            counted = False
            try:
                with s.lock:
                    if s.dead:
                        return
                    target = s.seq
                    s.waiting += 1          # stream_destroy waits for this count to drop to 0
                    counted = True
                rc = lib.zeCommandListHostSynchronize(s.list, _UINT64_MAX)
            finally:
                if counted:
                    # the threading lock inside: a with on it runs no Python frame (accel Lock's
                    # __enter__ getter does, where a handler may raise) before the decrement
                    with s.lock._lock:
                        s.waiting -= 1
            if rc:
                self._fail("zeCommandListHostSynchronize", rc)
        else:
            marker = self._marker(s)
            if marker is None:
                return
            slot, target = marker
            try:
                rc = lib.zeEventHostSynchronize(slot.event, _UINT64_MAX)
            finally:
                self._unmark(s, slot)
            if rc:
                self._fail("zeEventHostSynchronize", rc)
        self._progress(s, target)

    def _marker(self, s: _Stream):
        """A host-visible event signalled after the stream's last command, and that command's
        number; None for a destroyed stream.  The caller uses the event, then calls
        :meth:`_unmark`: until then the slot is not reset for reuse (a newer marker or the
        stream's destroy retires it, and a reset event would never be signalled for this wait)."""
        with s.lock:
            if s.dead:
                return None
            marker = s.marker
            if marker is not None and marker[1] == s.seq:
                marker[0].waiters += 1
                return marker
            slot = self._acquire(s.device, False)
            try:
                seq = self._number(s, slot)
                self._append(s, "zeCommandListAppendSignalEvent", self._lib[1].zeCommandListAppendSignalEvent,
                             s.list, slot.event)
            except BaseException:
                self._retire(slot)      # back to the pool once its use above is passed and it is reset
                raise
            s.issued = seq
            slot.waiters += 1
            s.marker = s.last = new = (slot, seq)
        if marker is not None:
            self._retire(marker[0])
        return new

    @staticmethod
    def _unmark(s: _Stream, slot: "_Slot") -> None:
        with s.lock:
            slot.waiters -= 1

    def stream_query(self, stream: int) -> bool:
        s = self._stream(stream)
        self._not_capturing("stream_query", [s.capture])
        self._unsafe("stream_query")   # CUDA's rules for other streams (events.event_query)
        if s.done >= s.seq:
            return True
        ffi, lib, _ = self._lib
        if self._host_sync:
            target = s.issued      # (not s.seq: counted before its append, maybe not appended yet)
            rc = lib.zeCommandListHostSynchronize(s.list, 0)
            call = "zeCommandListHostSynchronize"
        else:
            marker = self._marker(s)
            if marker is None:
                raise ValueError(f"{stream!r} is not a live XPU stream handle (destroyed meanwhile)")
            slot, target = marker
            try:
                rc = lib.zeEventQueryStatus(slot.event)
            finally:
                self._unmark(s, slot)
            call = "zeEventQueryStatus"
        if rc == lib.ZE_RESULT_NOT_READY:
            return False
        if rc:
            self._fail(call, rc)
        self._progress(s, target)
        return True

    def stream_wait_event(self, stream: int, event: int) -> None:
        s = self._stream(stream)
        e = self._event(event)
        if e.rec is None:
            return   # never recorded: nothing to wait for (as CUDA)
        if s.capture is not None:
            self._invalidate(s.capture, "stream_wait_event on the capturing stream")
            raise CaptureError("XPU graph capture cannot wait on events (cross-stream capture is not "
                               "supported by the Level Zero backend); the capture is invalidated")
        lib = self._lib[1]
        with s.lock:
            # The record is read, and its slot kept from recycling (a use at the next command
            # number), under the lock the sweep holds: a record replaced by another thread
            # meanwhile is retired, and could be reset and reused before this wait is appended.
            self._check_live(s)
            arr = self._lib[0].new("ze_event_handle_t[1]", [self._lib[0].NULL])
            with self._lock:
                rec = e.rec
                if rec is None:
                    return      # destroyed meanwhile
                slot = rec[0]
                arr[0] = slot.event
                seq = self._number(s, slot)      # (also when the append fails: passed at the next sync)
            self._append(s, "zeCommandListAppendWaitOnEvents", lib.zeCommandListAppendWaitOnEvents, s.list,
                         1, arr)
            s.issued = seq

    @staticmethod
    def _check_live(s: _Stream) -> None:
        """Refuse a stream destroyed by another thread after the caller looked it up (caller
        holds ``s.lock``): its list handle may be another stream's now (the driver reuses it)."""
        if s.dead:
            raise ValueError(f"{s.handle!r} is not a live XPU stream handle (destroyed by another thread meanwhile)")

    @staticmethod
    def _number(s: _Stream, slot=None) -> int:
        """Number the next command of ``s`` (caller holds ``s.lock``, checked the stream is live,
        and appends it next): ``s.seq`` first, then ``slot``'s use at that number, with no
        signal check between them (one C call, the list's append, last)."""
        seq = s.seq + 1
        s.seq = seq
        if slot is not None:
            slot.deps.append((s, seq))
        return seq

    def _append(self, s: _Stream, call: str, fn, *args) -> None:
        """One command on ``s``'s list, or its capture's (caller holds ``s.lock``; for the
        stream's list it counted the command first, :meth:`_number`, and sets ``s.issued`` after)."""
        self._check_live(s)
        if not s.in_order:
            # Pre-1.7 drivers have no in-order lists: a barrier keeps commands in stream order.
            # It goes BEFORE the command, so the list's last command is the caller's: once a
            # marker's signal is seen the list is idle and zeCommandListDestroy may run ("the
            # application must ensure the device is not currently referencing the command list").
            # A barrier after it was still pending then (HANDLE_OBJECT_IN_USE on a slow device).
            lst = args[0]
            rc = self._lib[1].zeCommandListAppendBarrier(lst, self._lib[0].NULL, 0, self._lib[0].NULL)
            if rc:
                self._fail("zeCommandListAppendBarrier", rc)
        rc = fn(*args)
        if rc:
            self._fail(call, rc)

    def _enqueue(self, s: _Stream, what: str, call: str, fn, *args, kernel=None) -> Optional[int]:
        """Append one command to the stream, or to its capture; returns its number on the stream.
        ``kernel``: the launched kernel's handle, which a capture keeps (its graph's list holds it)."""
        with s.lock:
            cap = s.capture
            if cap is not None:
                self._append(s, call, fn, cap.list, *args)
                cap.ops.append(what)
                if kernel is not None:
                    cap.kernels.add(kernel)
                return None
            self._check_live(s)
            seq = self._number(s)
            self._append(s, call, fn, s.list, *args)
            s.issued = seq
            return seq

    def _progress(self, s: _Stream, seq: int) -> None:
        if seq > s.done:
            s.done = seq
        if self._retired or self._deferred or self._orphans:
            self._sweep()

    def _poll(self) -> None:
        """Update every stream's completed-command count without blocking."""
        lib = self._lib[1]
        for s in list(self._streams.values()):
            if s.dead or s.done >= s.seq:
                continue
            if self._host_sync:
                target = s.issued      # (s.seq may count a command another thread is appending)
                if lib.zeCommandListHostSynchronize(s.list, 0) == 0:
                    s.done = max(s.done, target)
            else:
                last = s.last
                # A slot whose signal is not yet known complete cannot have been recycled.
                if last is not None and last[1] > s.done and lib.zeEventQueryStatus(last[0].event) == 0:
                    s.done = max(s.done, last[1])
