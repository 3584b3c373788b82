"""Capture and graphs: stream capture into regular command lists, replayed on a command queue.

* **Graphs** (``supports_graphs``): Level Zero has no stream capture, so
  ``capture_begin`` redirects the stream's commands into a regular command
  list that starts by waiting on a gate event; ``capture_end`` closes it.
  ``graph_launch`` signals the gate on the stream, executes the list on the
  graph's command queue, and makes the stream wait for the list's final
  event, so a replay is ordered after the stream's earlier work and before
  its later work, and launches of one graph are ordered among themselves.
  The spec forbids resubmitting a list the device still references, so a
  replay issued while the previous replay of the same graph still runs waits
  for it on the host.  Captured: copies and fills between USM pointers.
  Events recorded or waited on inside a capture (cross-stream capture) raise
  :class:`accel.CaptureError` and invalidate the capture.
"""

from __future__ import annotations

import threading
from typing import List, Optional

from ..._errors import AcceleratorError, CaptureError
from .._signals import deferred
from ..base import launch_note
from ._library import LIBRARY, _UINT64_MAX
from .events import _Event


_CAPTURE_MODES = ("global", "thread_local", "relaxed")


class _Capture:
    __slots__ = ("list", "mode", "thread", "invalid", "ops", "gate", "done", "device", "ident", "kernels",
                 "broken")

    def __init__(self, cmdlist, mode, device, gate, done, ident):
        self.list, self.mode, self.device, self.gate, self.done = cmdlist, mode, device, gate, done
        # capture_id: unique in the process, as cudaStreamGetCaptureInfo's id (not id(self): a
        # collected capture's address comes back for a later one, and accel.graphs keys the
        # capture's table by it until the graph forgets it, which may be after the capture ended)
        self.ident = ident
        self.thread = threading.get_ident()
        self.invalid: Optional[str] = None
        self.ops: List[str] = []
        self.kernels = set()        # the kernels its list launches (module_unload's failure path)
        self.broken: Optional[str] = None   # its graph can never launch (see _Graph.broken)


class _Graph:
    __slots__ = ("handle", "device", "list", "gate", "done", "ops", "queue", "execs", "destroyed",
                 "launched", "last_stream", "completion", "lock", "deps", "released", "stale", "launches",
                 "kernels", "broken", "waiting", "orphan")

    def __init__(self, handle, cap: _Capture):
        self.handle, self.device, self.list = handle, cap.device, cap.list
        self.gate, self.done, self.ops = cap.gate, cap.done, cap.ops
        self.queue = None
        self.execs = 0
        self.destroyed = False
        self.launched = False          # a submission may still be running on the queue
        self.launches = 0              # submissions so far (_sync_graph)
        self.last_stream = None
        self.completion: Optional[_Event] = None
        self.lock = threading.Lock()
        self.deps = []                 # stream points that signal/wait/reset the gate events
        self.released = False          # list, queue and events given back (_release_graph)
        self.stale = None              # the stream of a launch that failed half way (_rearm_graph)
        self.kernels = cap.kernels     # the kernels its list launches
        self.broken: Optional[str] = cap.broken     # why it can never launch again (module_unload)
        self.waiting = 0               # host threads inside zeCommandQueueSynchronize on the queue
        self.orphan = None             # the queue, destroyed once the last of them left (_sync_graph)


class GraphsMixin:
    """Captures (``_captures``), graphs and their execs (``_graphs``, ``_execs``), and CUDA's
    rules for calls during capture."""

    def _not_capturing(self, what: str, captures) -> None:
        """Waiting on work that is being captured is illegal: invalidate the capture and raise."""
        captures = [c for c in captures if c is not None]
        if captures:
            for cap in captures:
                self._invalidate(cap, what)
            raise CaptureError(f"{what} would wait on a stream that is being captured; "
                               f"the capture is invalidated")

    def _prohibiting(self) -> List[_Capture]:
        """The captures underway whose modes forbid a "potentially unsafe" call by this thread
        now (CUDA's rules: the thread's own capture unless relaxed, another thread's global one)."""
        if not self._captures:
            return []
        me = threading.get_ident()
        return [cap for cap in list(self._captures.values())
                if (cap.mode != "relaxed" if cap.thread == me else cap.mode == "global")]

    def _unsafe(self, what: str) -> None:
        """CUDA's rules for "potentially unsafe" calls during capture (cudaFree, cudaFreeHost:
        here the frees, which wait for the device): refused in the capturing thread unless its
        capture is relaxed, and in other threads while a global-mode capture runs."""
        hit = self._prohibiting()
        if hit:
            for cap in hit:
                self._invalidate(cap, what)
            raise CaptureError(f"{what} is not permitted while a stream is being captured "
                               f"({hit[0].mode} capture mode); the capture is invalidated")

    def host_wait_refused(self, stream: int) -> Optional[str]:
        """Whether a host wait now falls under :meth:`_unsafe`'s rule (without invalidating)."""
        hit = self._prohibiting()
        return f"a {hit[0].mode}-mode capture is underway" if hit else None

    @staticmethod
    def _invalidate(cap: _Capture, why: str) -> None:
        if cap.invalid is None:
            cap.invalid = why

    def capture_begin(self, stream: int, mode: str) -> None:
        if mode not in _CAPTURE_MODES:
            raise ValueError(f"capture mode must be one of {', '.join(_CAPTURE_MODES)}, got {mode!r}")
        s = self._stream(stream)
        if s.capture is not None:
            raise CaptureError("capture_begin: the stream is already capturing")
        dev = s.device
        ffi, lib, _ = self._lib
        desc = ffi.new("ze_command_list_desc_t *")
        desc.stype = lib.ZE_STRUCTURE_TYPE_COMMAND_LIST_DESC
        desc.commandQueueGroupOrdinal = dev.ordinal
        desc.flags = lib.ZE_COMMAND_LIST_FLAG_IN_ORDER if dev.in_order else 0
        p = ffi.new("ze_command_list_handle_t *")
        rc = lib.zeCommandListCreate(dev.ctx, dev.handle, desc, p)
        if rc:
            self._fail("zeCommandListCreate", rc)
        slots = []
        try:
            slots.append(self._acquire(dev, False))
            slots.append(self._acquire(dev, False))
            gate, done = slots
            cap = _Capture(p[0], mode, dev, gate, done, next(self._ids))
            # The list first waits for the launching stream's earlier work, then re-arms the gate.
            arr = ffi.new("ze_event_handle_t[1]", [gate.event])
            self._append(s, "zeCommandListAppendWaitOnEvents", lib.zeCommandListAppendWaitOnEvents, cap.list, 1, arr)
            self._append(s, "zeCommandListAppendEventReset", lib.zeCommandListAppendEventReset, cap.list, gate.event)
        except BaseException:
            # Nothing stays behind: the list, and the slots taken (a second one may fail to come).
            self._discard("zeCommandListDestroy", p[0])
            for slot in slots:
                self._retire(slot)
            raise
        with self.capture_gate:         # (no check-then-call of another thread straddles it)
            with s.lock:
                s.capture = cap
            with self._lock:
                self._captures[stream] = cap

    # Signals deferred (r55): the capture is taken from the stream first, and an interrupt
    # between that and the try below, or as the graph's record is made, lost its command list.
    @deferred
    def capture_end(self, stream: int) -> int:
        s = self._stream(stream)
        with s.lock:
            cap = s.capture
            s.capture = None
        if cap is None:
            raise CaptureError("capture_end: the stream is not capturing")
        with self._lock:
            self._captures.pop(stream, None)
        ffi, lib, _ = self._lib
        try:
            if cap.invalid is not None:
                raise CaptureError(f"the capture was invalidated by an illegal operation during capture: "
                                   f"{cap.invalid}", library=LIBRARY)
            self._append(s, "zeCommandListAppendSignalEvent", lib.zeCommandListAppendSignalEvent, cap.list,
                         cap.done.event)
            rc = lib.zeCommandListClose(cap.list)
            if rc:
                self._fail("zeCommandListClose", rc)
        except BaseException:
            self._discard("zeCommandListDestroy", cap.list)
            self._retire(cap.gate)
            self._retire(cap.done)
            self._run_after_captures()
            raise
        handle = next(self._ids)
        with self._lock:
            self._graphs[handle] = _Graph(handle, cap)
        self._run_after_captures()
        return handle

    def stream_is_capturing(self, stream: int) -> bool:
        return self._stream(stream).capture is not None

    def capture_id(self, stream: int) -> Optional[int]:
        # A capture records only its own stream's list: other streams never join it.
        cap = self._stream(stream).capture
        return None if cap is None else cap.ident

    def captures_underway(self) -> int:
        return len(self._captures)

    def graph_instantiate(self, graph: int) -> int:
        g = self._graphs.get(graph)
        if g is None:
            raise ValueError(f"{graph!r} is not a live XPU graph handle")
        with g.lock:
            if g.queue is None:
                dev = g.device
                ffi, lib, _ = self._lib
                desc = ffi.new("ze_command_queue_desc_t *")
                desc.stype = lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC
                desc.ordinal = dev.ordinal
                desc.mode = lib.ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS
                desc.priority = lib.ZE_COMMAND_QUEUE_PRIORITY_NORMAL
                p = ffi.new("ze_command_queue_handle_t *")
                rc = lib.zeCommandQueueCreate(dev.ctx, dev.handle, desc, p)
                if rc:
                    self._fail("zeCommandQueueCreate", rc)
                g.queue = p[0]
                g.completion = _Event(0, dev, False, False)
                with self._lock:
                    dev.graphs.add(g)
            g.execs += 1
        handle = next(self._ids)
        with self._lock:
            self._execs[handle] = g
        return handle

    def graph_launch(self, graph_exec: int, stream: int) -> None:
        g = self._execs.get(graph_exec)
        if g is None:
            raise ValueError(f"{graph_exec!r} is not a live XPU graph exec handle")
        s = self._stream(stream)
        if s.device is not g.device:
            raise ValueError(f"the graph was captured on XPU device {g.device.index} but the stream is on "
                             f"device {s.device.index}")
        if s.capture is not None:
            self._invalidate(s.capture, "graph_launch on the capturing stream")
            raise CaptureError("launching a graph inside an XPU capture is not supported; the capture is invalidated")
        ffi, lib, _ = self._lib
        with g.lock:
            if g.released or self._execs.get(graph_exec) is not g:
                # Destroyed by another thread since it was looked up: its list, queue and gate
                # events may be gone (the gate's slot even given to another record).
                raise ValueError(f"{graph_exec!r} is not a live XPU graph exec handle (the graph exec was "
                                 f"destroyed by another thread meanwhile)")
            if g.broken is not None:
                raise AcceleratorError(f"the XPU graph cannot be replayed: {g.broken}; capture it again "
                                       f"after loading the module again")
            if g.launched:
                # The spec forbids resubmitting a list the device still references.
                self._sync_graph(g)
            if g.stale is not None:
                self._rearm_graph(g)
            prev = g.completion
            launches = g.launches
            try:
                with s.lock:
                    if g.last_stream is not None and g.last_stream is not s and prev.slot is not None:
                        arr = ffi.new("ze_event_handle_t[1]", [prev.slot.event])
                        self._append(s, "zeCommandListAppendWaitOnEvents", lib.zeCommandListAppendWaitOnEvents,
                                     s.list, 1, arr)
                        s.seq += 1
                        prev.slot.deps.append((s, s.seq))
                    try:
                        self._append(s, "zeCommandListAppendSignalEvent", lib.zeCommandListAppendSignalEvent,
                                     s.list, g.gate.event)
                        s.seq += 1
                        g.deps.append((s, s.seq))
                        rc = self._execute_graph(g)
                        if rc:
                            self._fail("zeCommandQueueExecuteCommandLists", rc)
                        arr = ffi.new("ze_event_handle_t[1]", [g.done.event])
                        self._append(s, "zeCommandListAppendWaitOnEvents", lib.zeCommandListAppendWaitOnEvents,
                                     s.list, 1, arr)
                        s.seq += 1
                        g.deps.append((s, s.seq))
                        self._append(s, "zeCommandListAppendEventReset", lib.zeCommandListAppendEventReset, s.list,
                                     g.done.event)
                        s.seq += 1
                        g.deps.append((s, s.seq))
                    except BaseException:
                        # A gate signalled for a list that never ran, or a done event the stream never
                        # reset: the next launch's waits would take either as their own (_rearm_graph).
                        g.stale = s
                        raise
                    if len(g.deps) > 16:
                        # bounded by the streams whose part may still run: an entry a stream passed
                        # (a destroyed stream's among them) waits for nothing (r63h: one entry per
                        # stream the graph was ever replayed on, kept while the graph lived)
                        latest = {}
                        for st, n in g.deps:
                            if st.done < n and latest.get(st, 0) < n:
                                latest[st] = n
                        g.deps = list(latest.items())
            except BaseException:
                # Submitted, but the stream never came to wait for it (a later append failed): the
                # uses a replay records on the stream would free memory the list still writes
                # (zeMemFree: "The application must ensure the device is not currently referencing
                # the memory before it is freed"): wait for the list first (r84a), again when a
                # Ctrl-C lands as the wait begins (r85a; inline: a handler can raise as any Python
                # function starts).  A wait the driver refuses leaves the device's state unknown.
                interrupt = None
                while g.launches != launches:
                    try:
                        self._sync_graph(g)
                        break
                    except Exception:       # noqa: BLE001 (the first error is the one raised)
                        break
                    except BaseException as exc:
                        interrupt = exc
                if interrupt is not None:
                    raise interrupt
                raise
            g.last_stream = s
            self._record(g.completion, s)

    @deferred
    def _execute_graph(self, g: _Graph) -> int:
        """Submit ``g``'s list and note it (g.launched, base.LaunchNote) with signals deferred: a
        KeyboardInterrupt as the submission returned left a running list unnoted (the next launch
        resubmitted it without waiting, which the spec forbids)."""
        ffi, lib, _ = self._lib
        lists = ffi.new("ze_command_list_handle_t[1]", [g.list])
        rc = lib.zeCommandQueueExecuteCommandLists(g.queue, 1, lists, ffi.NULL)
        if rc == 0:
            g.launched = True
            g.launches += 1
            launch_note.queued = True
        return rc

    def _rearm_graph(self, g: _Graph) -> None:
        """After a launch that failed half way (caller holds ``g.lock``, the list is idle): wait
        for every stream that signalled, waited on or reset the gate and done events, then reset
        both on the host, so the next launch's list waits for its own gate signal and its stream
        for its own done signal.  A failure raises and leaves the graph to re-arm next time."""
        for st, seq in list(g.deps):
            if st.done < seq:
                self._sync_stream(st)
        self._sync_stream(g.stale)      # (what it appended past its numbered points too)
        lib = self._lib[1]
        for slot in (g.gate, g.done):
            rc = lib.zeEventHostReset(slot.event)
            if rc:
                self._fail("zeEventHostReset", rc)
        g.stale = None

    def _sync_graph(self, g: _Graph) -> None:
        """Wait for the graph's queue.  Callers without ``g.lock`` (frees, device_synchronize)
        may race a launch: the graph is noted idle only if no launch came after the wait began."""
        with self._lock:
            queue = g.queue
            if not g.launched or queue is None:
                return
            g.waiting += 1      # (the queue read once: _release_graph may clear g.queue meanwhile)
            self._graph_waits += 1      # close() waits for these, released graphs' included
            launches = g.launches
        try:
            rc = self._lib[1].zeCommandQueueSynchronize(queue, _UINT64_MAX)
        finally:
            with self._lock:
                g.waiting -= 1
                self._graph_waits -= 1
                if not g.waiting and g.orphan is not None:
                    # the graph was released while this thread waited: its queue goes now, at the
                    # next sweep (level-zero-spec INTRO.rst, "Multithreading and Concurrency": no
                    # destroy while another thread uses the handle)
                    self._orphans.append(("zeCommandQueueDestroy", g.orphan))
                    g.orphan = None
        if rc:
            self._fail("zeCommandQueueSynchronize", rc)
        if g.launches == launches:
            g.launched = False

    def graph_destroy(self, graph: int) -> None:
        with self._lock:
            g = self._graphs.pop(graph, None)
        if g is None:
            raise ValueError(f"{graph!r} is not a live XPU graph handle")
        g.destroyed = True
        try:
            self._release_graph(g)
        except BaseException:
            with self._lock:            # still live: destroying it again retries the release
                self._graphs[graph] = g
            g.destroyed = False
            raise

    def graph_exec_destroy(self, graph_exec: int) -> None:
        with self._lock:
            g = self._execs.pop(graph_exec, None)
        if g is None:
            raise ValueError(f"{graph_exec!r} is not a live XPU graph exec handle")
        with g.lock:
            g.execs -= 1
        try:
            self._release_graph(g)
        except BaseException:
            with g.lock:                # still live: destroying it again retries the release
                g.execs += 1
            with self._lock:
                self._execs[graph_exec] = g
            raise

    def _release_graph(self, g: _Graph) -> None:
        """Free the list, queue and gate events once neither the graph nor an exec needs them.
        Each step is done once; after a failed call, the next try goes on from there."""
        with g.lock:
            if not g.destroyed or g.execs > 0 or g.released:
                return
            self._sync_graph(g)
            ffi, lib, _ = self._lib
            if g.list is not None:
                rc = lib.zeCommandListDestroy(g.list)
                if rc:
                    self._fail("zeCommandListDestroy", rc)
                g.list = None
            if g.queue is not None:
                with self._lock:
                    queue, g.queue = g.queue, None      # no new wait starts on it
                    if g.waiting:
                        g.orphan, queue = queue, None   # another thread's device_synchronize waits
                                                        # on it: the last such wait hands it on
                if queue is not None:
                    rc = lib.zeCommandQueueDestroy(queue)
                    if rc:
                        g.queue = queue                 # (a retry destroys it)
                        self._fail("zeCommandQueueDestroy", rc)
                with self._lock:
                    g.device.graphs.discard(g)
            for slot in (g.gate, g.done):
                slot.deps.extend(g.deps)
                self._retire(slot)
            if g.completion is not None and g.completion.rec is not None:
                self._retire(g.completion.rec[0])
                g.completion.rec = None
            g.released = True

    def graph_node_count(self, graph: int) -> Optional[int]:
        g = self._graphs.get(graph)
        if g is None:
            raise ValueError(f"{graph!r} is not a live XPU graph handle")
        return len(g.ops)

    def graph_debug_dot(self, graph: int, path: str) -> None:
        g = self._graphs.get(graph)
        if g is None:
            raise ValueError(f"{graph!r} is not a live XPU graph handle")
        lines = ["digraph xpu_graph {", '  rankdir="TB";',
                 f'  label="XPU graph {graph}: Level Zero regular command list on device {g.device.index}";',
                 '  n0 [label="wait gate event (launching stream\'s earlier work)", shape=box];']
        for i, op in enumerate(g.ops, 1):
            lines.append(f'  n{i} [label="{op}"];')
            lines.append(f"  n{i - 1} -> n{i};")
        last = len(g.ops) + 1
        lines.append(f'  n{last} [label="signal done event (stream waits for it)", shape=box];')
        lines.append(f"  n{last - 1} -> n{last};")
        lines.append("}")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
