"""Intel XPU backend over Level Zero (``libze_loader``, core API + Sysman).

:class:`XpuBackend` is the Backend protocol for Level Zero, composed of one mixin per concern,
each in its own module with its part of the design:

* :mod:`.discovery`: counting without initializing (Sysman or a child process), init, device
  properties and the current device;
* :mod:`.memory`: device and pinned allocations, copies and fills, ``mem_info``;
* :mod:`.streams`: streams as immediate command lists, synchronization, command numbering;
* :mod:`.events`: events, and the pools of Level Zero events behind them;
* :mod:`.graphs`: capture into regular command lists, graph replay on a command queue;
* :mod:`.vmm`: virtual memory (zeVirtualMem*/zePhysicalMem*) for the allocator's expandable segments;
* :mod:`._library`: the loader, its symbol contract, and errors.

Why mixins rather than collaborator objects: every concern works on the same few tables under
one lock (streams, event slots, allocations, captures), and the calls between concerns go both
ways (a copy appends to a stream, a stream sync recycles event slots, a free waits for streams
and graph launches).  Collaborators would each need the backend back, and every call would pass
through it; mixins keep each call site as it was and the state in one place,
:meth:`XpuBackend.__init__`, which lists it all.  Each mixin's docstring says what it owns.

* **Kernels**: user SPIR-V modules (``kernel_language = "spirv"``, kernels.py, for accel.Module);
  accel ships no SPIR-V Philox kernels, so the RNG uses its host path.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections import deque
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from ..base import Backend
from ._library import LIBRARY, OPTIONAL_SYMBOLS, REQUIRED_SYMBOLS, LibraryMixin
from .discovery import DiscoveryMixin
from .events import EventsMixin
from .graphs import GraphsMixin
from .kernels import KernelsMixin
from .memory import MemoryMixin
from .streams import StreamsMixin
from .telemetry import TelemetryMixin
from .vmm import VmmMixin

if TYPE_CHECKING:
    from .discovery import _Device
    from .events import _Event, _Slot
    from .graphs import _Capture, _Graph
    from .streams import _Stream

__all__ = ["XpuBackend", "create", "LIBRARY", "REQUIRED_SYMBOLS", "OPTIONAL_SYMBOLS"]


class XpuBackend(DiscoveryMixin, MemoryMixin, StreamsMixin, EventsMixin, GraphsMixin, VmmMixin, TelemetryMixin,
                 KernelsMixin, LibraryMixin,
                 Backend):
    """Level Zero as a :class:`Backend` (see the module docstring for the design)."""

    name = "xpu"
    kernel_language = "spirv"    # user kernels (accel.Module): SPIR-V through zeModuleCreate (kernels.py)
    supports_graphs = True
    records_events_in_capture = False     # graphs.py: a capture is one command list

    def __init__(self, simulated: bool):
        self.simulated = simulated
        self._lock = threading.RLock()
        self._lib = None
        self._lib_error = None
        self._count: Optional[int] = None
        self._count_path = ""
        self._count_reason = ""
        self._count_before_init: Optional[int] = None   # set when init's zeDeviceGet disagreed
        self._probe: Optional[List[str]] = None
        self._sysman_cards = None      # [(zes handle, tiles, uuid bytes)] from zesDeviceGet
        self._sysman_visible = None    # [(card, tile)] after the mask
        self._sysman_legacy = False   # ZES_ENABLE_SYSMAN=1 was in effect at zeInit
        self._devices: List[_Device] = []
        self._tls = threading.local()
        self._streams: Dict[int, _Stream] = {}
        self._events: Dict[int, _Event] = {}
        self._graphs: Dict[int, _Graph] = {}
        self._execs: Dict[int, _Graph] = {}
        self._ids = itertools.count(1)
        self._free_slots: Dict[Tuple[int, bool], List[_Slot]] = {}
        self._pools: List[object] = []
        self._retired: List[_Slot] = []
        self._deferred: List[Tuple[list, object]] = []   # (deps, pinned staging pointer) to free later
        self._graph_waits = 0      # host threads inside zeCommandQueueSynchronize on a graph's queue
        self._orphans: List[Tuple[str, object]] = []      # (destroy call, handle) an error path failed to release
        self._captures: Dict[int, _Capture] = {}
        # Backend.capture_gate: _unsafe applies CUDA's rule (a free, query or synchronize by one
        # thread invalidates another thread's global-mode capture), so a check and the call it
        # allows are one step; capture_begin registers a capture under it.  Taken before a
        # stream's lock and the backend's.
        self.capture_gate = threading.RLock()
        self._after_capture = deque()   # (fn, args): releases _unsafe would refuse during a capture
        self._patterns: Dict[int, object] = {}
        self._allocs: Dict[int, Tuple[_Device, int]] = {}
        self._host_allocs: Dict[int, int] = {}
        self._host_sync = False
        self._zes_ok: Optional[bool] = None   # zesInit exists and the driver answered it (API 1.5+)
        self._zes_legacy_asked = False         # ZES_ENABLE_SYSMAN=1 was set: no zesInit made
        self._zes_error = ""
        self._mem_info_path = ""
        self._kstate = None            # modules and kernels (kernels.py)
        self._new_contexts = None      # contexts an init underway made (discovery.py)

    def fresh_locks_in_child(self) -> None:
        # the one backend lock: loading the library and counting take it too
        self._lock = threading.RLock()

    def close(self) -> None:
        """Wait for all work and destroy every Level Zero object this backend made.

        Not needed at process exit; tests use it to check that nothing leaks.
        The backend is uninitialized afterwards.
        """
        # Lock order (r43): a stream's lock before the backend's (event_record, stream_wait_event,
        # a sync's marker take the backend's lock inside the stream's).  close() used to wait for
        # the streams holding the backend's lock: a call holding a stream's lock and waiting for
        # the backend's deadlocked it.  So the streams are waited for without the backend's lock,
        # then sealed under it (dead: no append from then on) only where a stream's lock is free
        # and the stream is idle; otherwise the lock is let go and the wait done again.
        while True:
            with self._lock:
                if not self._devices:
                    return
                streams = list(self._streams.values())
            self._quiesce_streams(streams)
            with self._lock:
                if not self._devices:
                    return
                if self._seal_streams():
                    self._close_sealed()
                    return

    def _quiesce_streams(self, streams) -> None:
        for s in streams:
            self._sync_stream(s)
        for g in list(self._graphs.values()) + list(self._execs.values()):
            if g.launched:
                self._sync_graph(g)

    def _seal_streams(self) -> bool:
        """Mark every stream dead if each one's lock is free and its work known done (caller holds
        the backend's lock); else change nothing and return False.  A dead stream's lock is taken
        by other threads only to refuse it (_check_live) or skip it, never with the backend's lock
        after it: waiting for it from here on cannot deadlock."""
        sealed = []
        try:
            for s in list(self._streams.values()):
                if s.dead:
                    continue
                if not s.lock.acquire(False):
                    return False
                try:
                    if s.done < s.seq or s.waiting:
                        return False
                    s.dead = True
                    sealed.append(s)
                finally:
                    s.lock.release()
            if self._host_waits():
                return False
            sealed = []
            return True
        finally:
            for s in sealed:        # not all sealed: live again, waited for again
                s.dead = False

    def _host_waits(self) -> bool:
        """Whether another thread is inside a host wait on an event slot or a graph's queue (an
        event_synchronize, a graph's sync): close() waits for it to return before destroying
        what it waits on (level-zero-spec INTRO.rst, "Multithreading and Concurrency")."""
        if any(e.rec is not None and e.rec[0].waiters for e in self._events.values()):
            return True
        if any(slot.waiters for slot in self._retired):
            return True
        return self._graph_waits > 0

    def _close_sealed(self) -> None:
        """close()'s destroys (caller holds the backend's lock, the streams sealed)."""
        ffi, lib, _ = self._lib
        self._quiesce()
        for g in list(self._graphs.values()) + list(self._execs.values()):
            g.destroyed, g.execs = True, 0
            self._release_graph(g)
        self._graphs.clear()
        self._execs.clear()
        # A capture underway is the backend's too: its regular list and its two event slots go
        # before their pool and context (zeEventPoolDestroy: "must destroy all event handles
        # created from the pool before destroying the pool itself"; close() failed there).
        # The stream forgets it by an attribute write, not under s.lock, which is taken
        # before self._lock elsewhere.
        for stream, cap in list(self._captures.items()):
            self._invalidate(cap, "the backend was closed")
            s = self._streams.get(stream)
            if s is not None and s.capture is cap:
                s.capture = None
            self._check_rc("zeCommandListDestroy", lib.zeCommandListDestroy(cap.list))
            del self._captures[stream]
            self._retire(cap.gate)
            self._retire(cap.done)
        for s in list(self._streams.values()):
            self._sync_stream(s)
        self._sweep()
        self._kernels_close()
        self._vmm_close()
        for ptr, (dev, _n) in list(self._allocs.items()):
            self._check_rc("zeMemFree", lib.zeMemFree(dev.ctx, ffi.cast("void *", ptr)))
        for ptr in list(self._host_allocs) + [p for _, p in self._deferred]:
            self._host_free(ptr)
        for call, handle in self._orphans:
            self._check_rc(call, getattr(lib, call)(handle))
        for s in list(self._streams.values()):
            self._check_rc("zeCommandListDestroy", lib.zeCommandListDestroy(s.list))
            s.dead = True
        slots = [sl for free in self._free_slots.values() for sl in free] + self._retired
        slots += [e.slot for e in self._events.values() if e.slot is not None]
        slots += [s.marker[0] for s in self._streams.values() if s.marker is not None]
        for slot in slots:
            self._check_rc("zeEventDestroy", lib.zeEventDestroy(slot.event))
        for pool in self._pools:
            self._check_rc("zeEventPoolDestroy", lib.zeEventPoolDestroy(pool))
        for ctx in {id(d.ctx): d.ctx for d in self._devices}.values():
            self._check_rc("zeContextDestroy", lib.zeContextDestroy(ctx))
        lib_state = self._lib
        self.__init__(self.simulated)
        self._lib = lib_state


_backends: "weakref.WeakSet[XpuBackend]" = weakref.WeakSet()


def _forget_sysman_in_child() -> None:
    # zes_api.h, zesInit: "Each forked process must call this function": the parent's Sysman
    # handles mean nothing in a child, which counts (keeps the count) and maps Sysman afresh.
    # Attributes only: no lock, no library call in a fork handler.
    for be in list(_backends):
        be._zes_ok = None
        be._zes_error = ""
        be._zes_legacy_asked = False
        be._sysman_cards = None
        be._sysman_visible = None


os.register_at_fork(after_in_child=_forget_sysman_in_child)


def create() -> XpuBackend:
    """The XPU backend; simulated when ``ACCEL_SIM=xpu``.  Opens nothing."""
    be = XpuBackend(simulated=os.environ.get("ACCEL_SIM", "").strip().lower() == "xpu")
    _backends.add(be)
    return be
