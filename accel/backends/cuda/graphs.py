"""Stream capture and graphs (a mixin of :class:`accel.backends.cuda.CudaBackend`).

Captures underway in the process are counted (``_captures``), with the thread that began each
non-relaxed one and each one's device: the count decides whether a "potentially unsafe" call
must be relaxed (:mod:`.memory`, :mod:`.mempool`), refused (:meth:`host_wait_refused`) or
deferred until the last capture ends (graph and graph exec destroys, module unloads:
``Backend._now_or_after_captures``).  ``capture_gate`` is held from a count through the call it
allows, so no capture begins in between.  Begin and end keep the count right when the call is
interrupted or fails; an end from another thread than a live owner is refused before CUDA would
discard the capture.  Graphs are instantiated with auto-free-on-launch, as torch's CUDAGraph.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

from ..._errors import CaptureError
from .._signals import deferred
from ..base import launch_note

# From driver_types.h (CUDA 13).
_CAPTURE_MODES = {"global": 0, "thread_local": 1, "relaxed": 2}  # cudaStreamCaptureMode
_GRAPH_AUTO_FREE_ON_LAUNCH = 1     # cudaGraphInstantiateFlagAutoFreeOnLaunch
_CAPTURE_STATUS_NONE = 0           # cudaStreamCaptureStatusNone


def _declared_arity(module, symbol: str) -> int:
    """Number of parameters of ``symbol`` as declared in generated module ``module``."""
    import re
    m = re.search(r"\b%s\((.*?)\);" % re.escape(symbol), module.CDEF, re.S)
    params = m.group(1).strip()
    return 0 if params in ("", "void") else params.count(",") + 1


def _thread_alive(ident: int) -> bool:
    """Whether a thread with this ident runs (threads Python started, and foreign ones that
    called into it: those stay listed, so a foreign owner is taken to be alive)."""
    return any(t.ident == ident for t in threading.enumerate())


class CudaGraphsMixin:
    """capture_*, the capture refusals and graph_*; state lives in ``CudaBackend.__init__``."""

    def capture_begin(self, stream: int, mode: str) -> None:
        if mode not in _CAPTURE_MODES:
            raise ValueError(f"capture mode must be one of {', '.join(_CAPTURE_MODES)}, got {mode!r}")
        handle = self._cast("cudaStream_t", stream)
        # Counted (and owned) before the call, taken back when no capture began: a KeyboardInterrupt
        # as the call returns must not leave a capture the count misses (capture_underway() then
        # lets event queries invalidate it).
        me = threading.get_ident()
        device = self.get_device()      # (the caller makes the stream's device current)
        with self.capture_gate:
            try:
                self._captures += 1
                self._capture_devices[stream] = device
                if mode != "relaxed":
                    self._capture_owners[stream] = me
                self._check(self.lib.cudaStreamBeginCapture(handle, _CAPTURE_MODES[mode]),
                            "cudaStreamBeginCapture")
            except BaseException:
                if not self._still_capturing(handle, unknown=False):
                    self._captures -= 1
                    self._capture_owners.pop(stream, None)
                    self._capture_devices.pop(stream, None)
                raise

    def capture_end(self, stream: int) -> int:
        owner = self._capture_owners.get(stream)
        if owner is not None and owner != threading.get_ident() and _thread_alive(owner):
            # Only the thread that began a global or thread_local capture may end it (Runtime API,
            # cudaStreamEndCapture: cudaErrorStreamCaptureWrongThread), and the refused call still
            # ends the capture, discarding it (measured on an H200, tools/cuda_conformance.py): so it
            # is not made, and the capture goes on for its own thread to end.  When that thread has
            # exited, nothing else ever could (r72e: every later synchronize, free and capture was
            # refused): the call is made, and the capture discarded with its error.
            raise CaptureError(f"cudaStreamEndCapture from another thread than the one that began the capture "
                               f"of stream {stream:#x}: CUDA refuses it (cudaErrorStreamCaptureWrongThread) and "
                               f"discards the capture, so accel did not call it; end the capture on the thread "
                               f"that began it, or capture with capture_error_mode='relaxed'",
                               library="libcudart", call="cudaStreamEndCapture")
        p = self.ffi.new("cudaGraph_t *")
        handle = self._cast("cudaStream_t", stream)
        with self.capture_gate:
            # (the gate: until the call has ended the capture, no other thread may find it ended
            # by the count and make a call that invalidates it)
            rc = self._end_capture(stream, owner, handle, p)
        self._check(rc, "cudaStreamEndCapture")
        return self._as_int(p[0])

    def _end_capture(self, stream: int, owner, handle, p) -> int:
        """capture_end's call, the gate held: its return code, the count and owners updated, and
        the releases queued during the captures run once the last one ended."""
        # Uncounted before the call, counted again while the capture goes on: a KeyboardInterrupt
        # as the call returns must not leave an ended capture counted (capture_underway() would
        # then refuse syncs and frees for good).
        device = self._capture_devices.get(stream)
        try:
            self._captures -= 1
            self._capture_devices.pop(stream, None)
            if owner is not None:
                del self._capture_owners[stream]
            rc = self.lib.cudaStreamEndCapture(handle, p)
            if rc != 0 and self._still_capturing(handle):
                # A failed cudaStreamEndCapture ends only an invalidated capture (CUDA Runtime API,
                # cudaStreamEndCapture); one still underway would forbid syncs, frees and new
                # captures in the whole process, so end it again and discard what it captured.
                again = self.ffi.new("cudaGraph_t *")
                if self.lib.cudaStreamEndCapture(handle, again) == 0 and again[0] != self.ffi.NULL:
                    # deferred while another capture is underway, as graph_destroy
                    if not self._after_captures(self._graph_destroy_now, self._as_int(again[0])):
                        self.lib.cudaGraphDestroy(again[0])
        except BaseException:
            if self._still_capturing(handle, unknown=False):
                self._captures += 1
                self._capture_devices[stream] = device
                if owner is not None:
                    self._capture_owners[stream] = owner
            raise
        if rc != 0 and self._still_capturing(handle):
            self._captures += 1
            self._capture_devices[stream] = device
            if owner is not None:
                self._capture_owners[stream] = owner
        elif not self._captures and self._after_capture:
            self._run_after_captures()
        return rc

    def _still_capturing(self, handle, unknown: bool = True) -> bool:
        """Whether ``handle`` is being captured; ``unknown`` when the runtime cannot tell (True
        after a failed end: assume it is; False after an interrupted begin or end: the count
        then follows the call's own outcome)."""
        status = self.ffi.new("enum cudaStreamCaptureStatus *")
        if self.lib.cudaStreamIsCapturing(handle, status) != 0:
            return unknown
        return status[0] != _CAPTURE_STATUS_NONE

    def stream_is_capturing(self, stream: int) -> bool:
        status = self.ffi.new("enum cudaStreamCaptureStatus *")
        self._check(self.lib.cudaStreamIsCapturing(self._cast("cudaStream_t", stream), status),
                    "cudaStreamIsCapturing")
        return status[0] != _CAPTURE_STATUS_NONE

    def capture_id(self, stream: int) -> Optional[int]:
        out = self._out         # per-thread out-pointers: asked at every event record and wait in a capture
        try:
            status, ident = out.capture_info
        except AttributeError:
            status, ident = out.capture_info = (self.ffi.new("enum cudaStreamCaptureStatus *"),
                                                self.ffi.new("unsigned long long *"))
        # The first three parameters (stream, status, id) are the same in every version of
        # cudaStreamGetCaptureInfo (CUDA 12 headers: cudaStreamGetCaptureInfo_v2, 6 parameters;
        # CUDA 13: 7); the optional outputs after them are NULL.
        fn, nulls = self._capture_info
        if fn is None:
            mod = self._bindings()
            fn = self._rt_fn("cudaStreamGetCaptureInfo")
            nulls = (self.ffi.NULL,) * (_declared_arity(mod, mod.ALIASES.get("cudaStreamGetCaptureInfo",
                                                                              "cudaStreamGetCaptureInfo")) - 3)
            self._capture_info = (fn, nulls)
        self._check(fn(self._cast("cudaStream_t", stream), status, ident, *nulls), "cudaStreamGetCaptureInfo")
        return None if status[0] == _CAPTURE_STATUS_NONE else ident[0]

    def captures_underway(self) -> int:
        return self._captures

    def host_wait_refused(self, stream: int) -> Optional[str]:
        # Programming Guide, "CUDA Graphs" > "Prohibited and Unhandled Operations": synchronizing
        # a stream not being captured is valid, except the legacy stream, which synchronizes with
        # the blocking streams of its device (those in a capture included).  But cudaStreamSynchronize
        # and cudaEventSynchronize are "potentially unsafe" calls (cudaStreamBeginCapture's modes):
        # measured on an H100 (tests/conformance/cuda_h100_2026-12-05.json, unsafe_cudaStreamSynchronize_*)
        # they fail with 900 and invalidate the capture while this thread has a global or thread_local
        # capture, or another thread a global one (thread_local ones of other threads allow them; the
        # mode is not kept per stream here, so those refuse too)
        if not self._captures:
            return None
        if stream == 0 and (len(self._capture_devices) < self._captures
                            or self.get_device() in self._capture_devices.values()):
            # (the current device's legacy stream: it synchronizes with that device's blocking
            # streams only, Programming Guide "Implicit Synchronization")
            return "the legacy default stream synchronizes with the streams being captured"
        me = threading.get_ident()
        for owner in self._capture_owners.values():
            return ("this thread's global or thread_local capture forbids a host wait" if owner == me
                    else "another thread's global capture forbids a host wait")
        return None

    def graph_instantiate(self, graph: int) -> int:
        p = self.ffi.new("cudaGraphExec_t *")
        # As torch's CUDAGraph::instantiate: allocations a graph does not free itself (its
        # outputs, with backend:cudaMallocAsync) are freed by its next launch (cudaGraphLaunch
        # fails with unfreed allocations otherwise); no effect on graphs without them.
        self._check(self.lib.cudaGraphInstantiate(p, self.ffi.cast("cudaGraph_t", graph),
                                                  _GRAPH_AUTO_FREE_ON_LAUNCH), "cudaGraphInstantiate")
        return self._as_int(p[0])

    def graph_launch(self, graph_exec: int, stream: int) -> None:
        self._check(self._graph_launch_noted(self.ffi.cast("cudaGraphExec_t", graph_exec),
                                             self._cast("cudaStream_t", stream)), "cudaGraphLaunch")

    @deferred
    def _graph_launch_noted(self, graph_exec, stream) -> int:
        rc = self.lib.cudaGraphLaunch(graph_exec, stream)
        if rc == 0:
            launch_note.queued = True   # (base.LaunchNote: nothing can interrupt between the two)
        return rc

    def graph_destroy(self, graph: int) -> None:
        """cudaGraphDestroy; while a capture is underway in this process, once the last one ended
        (drivers refuse it during a capture and invalidate the capture: PyTorch PR 161037)."""
        self._now_or_after_captures(self._graph_destroy_now, graph)

    def _graph_destroy_now(self, graph: int) -> None:
        self._check(self.lib.cudaGraphDestroy(self.ffi.cast("cudaGraph_t", graph)), "cudaGraphDestroy")

    def graph_exec_destroy(self, graph_exec: int) -> None:
        """cudaGraphExecDestroy, deferred during captures as :meth:`graph_destroy`."""
        self._now_or_after_captures(self._graph_exec_destroy_now, graph_exec)

    def _graph_exec_destroy_now(self, graph_exec: int) -> None:
        self._check(self.lib.cudaGraphExecDestroy(self.ffi.cast("cudaGraphExec_t", graph_exec)),
                    "cudaGraphExecDestroy")

    def graph_node_count(self, graph: int) -> Optional[int]:
        n = self.ffi.new("size_t *")
        self._check(self.lib.cudaGraphGetNodes(self._cast("cudaGraph_t", graph), self.ffi.NULL, n),
                    "cudaGraphGetNodes")
        return int(n[0])

    def graph_debug_dot(self, graph: int, path: str) -> None:
        self._check(self.lib.cudaGraphDebugDotPrint(self.ffi.cast("cudaGraph_t", graph),
                                                    os.fsencode(path), 1),  # cudaGraphDebugDotFlagsVerbose
                    "cudaGraphDebugDotPrint")
