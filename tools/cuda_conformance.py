#!/usr/bin/env python3
"""The CUDA simulator's rules side by side with the real runtime, call by call.

    python tools/cuda_conformance.py                      # every scenario on the simulator
    python tools/cuda_conformance.py --real --json r.json # on the real libcudart (needs a GPU)
    python tools/cuda_conformance.py --compare r.json     # the simulator against a saved real run

Each scenario makes raw libcudart calls through accel's generated bindings (no accel layer in
between) in a fresh process, and records every call's return code.  The same code runs against
``accel.sim``'s libcudart and the real one, so ``--compare`` shows, per call, where the simulator
is more lenient than the hardware (it returned success where CUDA refused: a simulator bug, since
the simulator must be at least as strict), stricter (it refused where CUDA accepted: allowed,
listed so each can be justified), or refuses with another code.  Scenarios need one device.
tests/test_sim_cuda_conformance.py checks the simulator against the run recorded in
tests/conformance/; scenarios added after it (the launch_*, pool_* and vmm_* ones) are checked
from the next GPU run on (tools/device_check.sh records one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from typing import Callable, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SCENARIOS: Dict[str, Callable] = {}
NON_BLOCKING = 1
GLOBAL, THREAD_LOCAL, RELAXED = 0, 1, 2
D2D, DEFAULT = 3, 4
_PTX = b"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry accel_conformance_nop()
{
    ret;
}
"""


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


class Calls:
    """The runtime under test and the record of what each call returned."""

    def __init__(self, ffi, lib):
        self.ffi, self.lib = ffi, lib
        self.steps: List[list] = []

    def rec(self, label: str, rc) -> int:
        self.steps.append([label, int(rc)])
        return int(rc)

    def stream(self, flags: int = NON_BLOCKING):
        p = self.ffi.new("cudaStream_t *")
        self.rec("cudaStreamCreateWithFlags", self.lib.cudaStreamCreateWithFlags(p, flags))
        return p[0]

    def event(self, flags: int = 2):
        p = self.ffi.new("cudaEvent_t *")
        self.rec("cudaEventCreateWithFlags", self.lib.cudaEventCreateWithFlags(p, flags))
        return p[0]

    def malloc(self, n: int = 1 << 20, label: str = "cudaMalloc"):
        p = self.ffi.new("void **")
        self.rec(label, self.lib.cudaMalloc(p, n))
        return p[0]

    def host_alloc(self, n: int = 1 << 20):
        p = self.ffi.new("void **")
        self.rec("cudaHostAlloc", self.lib.cudaHostAlloc(p, n, 0))
        return p[0]

    def capturing(self, flags: int = NON_BLOCKING, mode: int = GLOBAL):
        """A new stream capturing in ``mode`` with one memset captured, and the memory it sets."""
        s, ptr = self.stream(flags), self.malloc()
        self.begin(s, mode)
        self.memset(ptr, s)
        return s, ptr

    def begin(self, s, mode: int = GLOBAL, label: str = "cudaStreamBeginCapture"):
        return self.rec(label, self.lib.cudaStreamBeginCapture(s, mode))

    def end(self, s, label: str = "cudaStreamEndCapture"):
        g = self.ffi.new("cudaGraph_t *")
        rc = self.rec(label, self.lib.cudaStreamEndCapture(s, g))
        if g[0] != self.ffi.NULL:
            self.lib.cudaGraphDestroy(g[0])
        return rc

    def memset(self, ptr, s, n: int = 256, label: str = "cudaMemsetAsync"):
        return self.rec(label, self.lib.cudaMemsetAsync(ptr, 0, n, s))

    def status(self, s, label: str = "cudaStreamIsCapturing"):
        st = self.ffi.new("enum cudaStreamCaptureStatus *")
        rc = self.lib.cudaStreamIsCapturing(s, st)
        self.rec(label, rc)
        self.steps.append([label + " status", int(st[0]) if rc == 0 else -1])

    def last_error(self):
        self.rec("cudaGetLastError", self.lib.cudaGetLastError())

    def relaxed(self):
        mode = self.ffi.new("enum cudaStreamCaptureMode *", RELAXED)
        self.rec("cudaThreadExchangeStreamCaptureMode(relaxed)", self.lib.cudaThreadExchangeStreamCaptureMode(mode))

    def in_thread(self, fn):
        """Run ``fn()`` in another thread (which calls cudaSetDevice(0) first) and wait for it."""
        def body():
            self.rec("cudaSetDevice(0) in the other thread", self.lib.cudaSetDevice(0))
            fn()
        t = threading.Thread(target=body)
        t.start()
        t.join()


# -- the potentially unsafe calls during a capture (Runtime API: cudaStreamBeginCapture modes) ---------
def _unsafe_calls(c: Calls, other_stream, other_event, ptr, host):
    lib, ffi = c.lib, c.ffi
    return {
        "cudaMalloc": lambda: c.malloc(256, "cudaMalloc (unsafe?)"),
        "cudaFree": lambda: c.rec("cudaFree (unsafe?)", lib.cudaFree(ptr)),
        "cudaHostAlloc": lambda: c.rec("cudaHostAlloc (unsafe?)", lib.cudaHostAlloc(ffi.new("void **"), 4096, 0)),
        "cudaFreeHost": lambda: c.rec("cudaFreeHost (unsafe?)", lib.cudaFreeHost(host)),
        "cudaEventQuery": lambda: c.rec("cudaEventQuery (unsafe?)", lib.cudaEventQuery(other_event)),
        "cudaEventSynchronize": lambda: c.rec("cudaEventSynchronize (unsafe?)", lib.cudaEventSynchronize(other_event)),
        "cudaStreamQuery": lambda: c.rec("cudaStreamQuery (unsafe?)", lib.cudaStreamQuery(other_stream)),
        "cudaStreamSynchronize": lambda: c.rec("cudaStreamSynchronize (unsafe?)",
                                               lib.cudaStreamSynchronize(other_stream)),
        "cudaDeviceSynchronize": lambda: c.rec("cudaDeviceSynchronize (unsafe?)", lib.cudaDeviceSynchronize()),
        "cudaMemcpy": lambda: c.rec("cudaMemcpy D2D (unsafe?)", lib.cudaMemcpy(ptr, ffi.cast("char *", ptr) + 4096,
                                                                              256, D2D)),
    }


def _unsafe(name: str, mode: int, where: str):
    """Capture on s (``mode``), then ``name`` from this thread ("same"), this thread after switching
    to relaxed mode ("relaxed"), or another thread ("other"); then end the capture."""
    def run(c: Calls):
        s, other = c.stream(), c.stream()
        ev = c.event()
        c.rec("cudaEventRecord(other event, other stream)", c.lib.cudaEventRecord(ev, other))
        ptr, host = c.malloc(), c.host_alloc()
        c.rec("cudaDeviceSynchronize", c.lib.cudaDeviceSynchronize())
        c.begin(s, mode)
        c.memset(ptr, s)
        call = _unsafe_calls(c, other, ev, ptr, host)[name]
        if where == "other":
            c.in_thread(call)
        else:
            if where == "relaxed":
                c.relaxed()
            call()
        c.status(s)
        c.end(s)
        c.last_error()
    return run


for _name in ("cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaFreeHost", "cudaEventQuery", "cudaEventSynchronize",
              "cudaStreamQuery", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy"):
    for _mode, _mname in ((GLOBAL, "global"), (THREAD_LOCAL, "threadlocal")):
        for _where in ("same", "relaxed", "other"):
            SCENARIOS[f"unsafe_{_name}_{_mname}_{_where}"] = _unsafe(_name, _mode, _where)


# -- capture rules -------------------------------------------------------------------------------------
@scenario
def capture_query_captured_event(c: Calls):
    s = c.stream()
    ev = c.event()
    ptr = c.malloc()
    c.begin(s)
    c.memset(ptr, s)
    c.rec("cudaEventRecord(ev, capturing s)", c.lib.cudaEventRecord(ev, s))
    c.relaxed()
    c.rec("cudaEventQuery(captured ev) relaxed", c.lib.cudaEventQuery(ev))
    c.end(s)
    c.last_error()


@scenario
def capture_sync_capturing_stream_relaxed(c: Calls):
    s, ptr = c.capturing()
    c.relaxed()
    c.rec("cudaStreamSynchronize(capturing s) relaxed", c.lib.cudaStreamSynchronize(s))
    c.rec("cudaStreamQuery(capturing s) relaxed", c.lib.cudaStreamQuery(s))
    c.end(s)
    c.last_error()


@scenario
def capture_legacy_beside_blocking(c: Calls):
    s = c.stream(0)                       # a blocking stream: synchronizes with the legacy stream
    ptr = c.malloc()
    c.begin(s)
    c.memset(ptr, s)
    c.memset(ptr, c.ffi.cast("cudaStream_t", 0), label="cudaMemsetAsync(legacy stream)")
    c.status(s)
    c.end(s)
    c.last_error()


@scenario
def capture_legacy_beside_nonblocking(c: Calls):
    s, ptr = c.capturing(flags=NON_BLOCKING)
    c.memset(ptr, c.ffi.cast("cudaStream_t", 0), label="cudaMemsetAsync(legacy stream)")
    c.status(s)
    c.end(s)
    c.last_error()


@scenario
def capture_begin_on_legacy_stream(c: Calls):
    c.begin(c.ffi.cast("cudaStream_t", 0), label="cudaStreamBeginCapture(legacy stream)")
    c.last_error()


@scenario
def capture_begin_twice(c: Calls):
    s = c.stream()
    c.begin(s)
    c.begin(s, label="cudaStreamBeginCapture again")
    c.end(s)
    c.last_error()


@scenario
def capture_end_without_begin(c: Calls):
    s = c.stream()
    c.end(s, label="cudaStreamEndCapture (not capturing)")
    c.last_error()


@scenario
def capture_wait_noncaptured_event(c: Calls):
    s, other = c.stream(), c.stream()
    ev = c.event()
    ptr = c.malloc()
    c.memset(ptr, other)
    c.rec("cudaEventRecord(ev, other) outside capture", c.lib.cudaEventRecord(ev, other))
    c.begin(s)
    c.rec("cudaStreamWaitEvent(capturing s, uncaptured ev)", c.lib.cudaStreamWaitEvent(s, ev, 0))
    c.memset(ptr, s)
    c.status(s)
    c.end(s)
    c.last_error()


@scenario
def capture_merge(c: Calls):
    s1, s2 = c.stream(), c.stream()
    ev = c.event()
    ptr = c.malloc()
    c.begin(s1)
    c.begin(s2, label="cudaStreamBeginCapture(s2)")
    c.memset(ptr, s1)
    c.rec("cudaEventRecord(ev, s1)", c.lib.cudaEventRecord(ev, s1))
    c.rec("cudaStreamWaitEvent(s2 capturing, ev of s1's capture)", c.lib.cudaStreamWaitEvent(s2, ev, 0))
    c.end(s2, label="cudaStreamEndCapture(s2)")
    c.end(s1, label="cudaStreamEndCapture(s1)")
    c.last_error()


def _fork(c: Calls, s1, s2, ptr):
    ev = c.event()
    c.memset(ptr, s1)
    c.rec("cudaEventRecord(fork ev, s1)", c.lib.cudaEventRecord(ev, s1))
    c.rec("cudaStreamWaitEvent(s2, fork ev)", c.lib.cudaStreamWaitEvent(s2, ev, 0))
    c.memset(ptr, s2, label="cudaMemsetAsync(s2)")


@scenario
def capture_end_from_joined_stream(c: Calls):
    s1, s2 = c.stream(), c.stream()
    ptr = c.malloc()
    c.begin(s1)
    _fork(c, s1, s2, ptr)
    c.end(s2, label="cudaStreamEndCapture(s2, not the origin)")
    c.status(s1)
    c.end(s1, label="cudaStreamEndCapture(s1)")
    c.last_error()


@scenario
def capture_unjoined(c: Calls):
    s1, s2 = c.stream(), c.stream()
    ptr = c.malloc()
    c.begin(s1)
    _fork(c, s1, s2, ptr)
    c.end(s1, label="cudaStreamEndCapture(s1, s2 not joined)")
    c.status(s2, label="cudaStreamIsCapturing(s2)")
    c.last_error()


@scenario
def capture_end_other_thread_global(c: Calls):
    s, ptr = c.capturing(mode=GLOBAL)
    c.in_thread(lambda: c.end(s, label="cudaStreamEndCapture from another thread"))
    c.status(s)
    c.end(s, label="cudaStreamEndCapture from the capturing thread")
    c.last_error()


@scenario
def capture_end_other_thread_relaxed(c: Calls):
    s, ptr = c.capturing(mode=RELAXED)
    c.in_thread(lambda: c.end(s, label="cudaStreamEndCapture from another thread"))
    c.status(s)
    c.last_error()


@scenario
def capture_pageable_copy(c: Calls):
    s = c.stream()
    ptr = c.malloc()
    host = c.ffi.new("char[4096]")
    c.begin(s)
    c.rec("cudaMemcpyAsync(dev <- pageable host) in capture",
          c.lib.cudaMemcpyAsync(ptr, host, 4096, DEFAULT, s))
    c.status(s)
    c.end(s)
    c.last_error()


@scenario
def capture_pinned_copy(c: Calls):
    s = c.stream()
    ptr, host = c.malloc(), c.host_alloc()
    c.begin(s)
    c.rec("cudaMemcpyAsync(dev <- pinned host) in capture", c.lib.cudaMemcpyAsync(ptr, host, 4096, DEFAULT, s))
    c.end(s)
    c.last_error()


@scenario
def capture_destroy_joined_stream(c: Calls):
    s1, s2 = c.stream(), c.stream()
    ptr = c.malloc()
    c.begin(s1)
    _fork(c, s1, s2, ptr)
    c.rec("cudaStreamDestroy(s2, joined into the capture)", c.lib.cudaStreamDestroy(s2))
    c.status(s1)
    c.end(s1)
    c.last_error()


@scenario
def capture_destroy_origin_stream(c: Calls):
    s, ptr = c.capturing()
    c.rec("cudaStreamDestroy(capturing origin)", c.lib.cudaStreamDestroy(s))
    c.last_error()


@scenario
def capture_wait_event_of_ended_capture(c: Calls):
    s, other = c.stream(), c.stream()
    ev = c.event()
    ptr = c.malloc()
    c.begin(s)
    c.memset(ptr, s)
    c.rec("cudaEventRecord(ev, capturing s)", c.lib.cudaEventRecord(ev, s))
    c.end(s)
    c.rec("cudaStreamWaitEvent(other, ev recorded in the ended capture)", c.lib.cudaStreamWaitEvent(other, ev, 0))
    c.rec("cudaEventQuery(ev recorded in the ended capture)", c.lib.cudaEventQuery(ev))
    c.rec("cudaStreamSynchronize(other)", c.lib.cudaStreamSynchronize(other))
    c.last_error()


def _graph_exec(c: Calls, ptr):
    s = c.stream()
    c.begin(s, label="cudaStreamBeginCapture (graph to instantiate)")
    c.memset(ptr, s)
    g = c.ffi.new("cudaGraph_t *")
    c.rec("cudaStreamEndCapture (graph to instantiate)", c.lib.cudaStreamEndCapture(s, g))
    e = c.ffi.new("cudaGraphExec_t *")
    c.rec("cudaGraphInstantiate", c.lib.cudaGraphInstantiate(e, g[0], 0))
    return g[0], e[0]


@scenario
def capture_graph_exec_destroy(c: Calls):
    ptr = c.malloc()
    g, e = _graph_exec(c, ptr)
    s = c.stream()
    c.begin(s)
    c.memset(ptr, s)
    c.rec("cudaGraphExecDestroy during another capture", c.lib.cudaGraphExecDestroy(e))
    c.rec("cudaGraphDestroy during another capture", c.lib.cudaGraphDestroy(g))
    c.status(s)
    c.end(s)
    c.last_error()


@scenario
def capture_graph_launch_inside(c: Calls):
    ptr = c.malloc()
    g, e = _graph_exec(c, ptr)
    s = c.stream()
    c.begin(s)
    c.rec("cudaGraphLaunch inside a capture", c.lib.cudaGraphLaunch(e, s))
    c.status(s)
    c.end(s)
    c.last_error()


@scenario
def capture_library_load_unload(c: Calls):
    s = c.stream()
    ptr = c.malloc()
    lib1 = c.ffi.new("cudaLibrary_t *")
    c.rec("cudaLibraryLoadData before capture", c.lib.cudaLibraryLoadData(lib1, _PTX, c.ffi.NULL, c.ffi.NULL, 0,
                                                                          c.ffi.NULL, c.ffi.NULL, 0))
    c.begin(s)
    c.memset(ptr, s)
    lib2 = c.ffi.new("cudaLibrary_t *")
    c.rec("cudaLibraryLoadData during capture", c.lib.cudaLibraryLoadData(lib2, _PTX, c.ffi.NULL, c.ffi.NULL, 0,
                                                                          c.ffi.NULL, c.ffi.NULL, 0))
    c.status(s, label="cudaStreamIsCapturing after load")
    c.rec("cudaLibraryUnload during capture", c.lib.cudaLibraryUnload(lib1[0]))
    c.status(s, label="cudaStreamIsCapturing after unload")
    c.end(s)
    c.last_error()


@scenario
def capture_malloc_async(c: Calls):
    s = c.stream()
    c.begin(s)
    p = c.ffi.new("void **")
    c.rec("cudaMallocAsync in capture", c.lib.cudaMallocAsync(p, 1 << 20, s))
    c.rec("cudaFreeAsync in capture", c.lib.cudaFreeAsync(p[0], s))
    c.end(s)
    c.last_error()


# -- handles, memory, events ----------------------------------------------------------------------------
@scenario
def handle_recycle_stream(c: Calls):
    a = c.stream()
    first = int(c.ffi.cast("uintptr_t", a))
    c.rec("cudaStreamDestroy", c.lib.cudaStreamDestroy(a))
    b = c.stream()
    c.steps.append(["next stream has the destroyed one's handle", int(int(c.ffi.cast("uintptr_t", b)) == first)])


@scenario
def handle_recycle_event(c: Calls):
    a = c.event()
    first = int(c.ffi.cast("uintptr_t", a))
    c.rec("cudaEventDestroy", c.lib.cudaEventDestroy(a))
    b = c.event()
    c.steps.append(["next event has the destroyed one's handle", int(int(c.ffi.cast("uintptr_t", b)) == first)])


@scenario
def free_twice(c: Calls):
    p = c.malloc()
    c.rec("cudaFree", c.lib.cudaFree(p))
    c.rec("cudaFree again", c.lib.cudaFree(p))
    c.last_error()


@scenario
def free_interior_pointer(c: Calls):
    p = c.malloc()
    c.rec("cudaFree(p + 256)", c.lib.cudaFree(c.ffi.cast("char *", p) + 256))
    c.last_error()


@scenario
def memcpy_overlap(c: Calls):
    p = c.malloc()
    c.rec("cudaMemcpy D2D overlapping", c.lib.cudaMemcpy(c.ffi.cast("char *", p) + 16, p, 4096, D2D))
    c.rec("cudaMemcpy D2D same range", c.lib.cudaMemcpy(p, p, 4096, D2D))
    c.last_error()


@scenario
def memcpy_kind_mismatch(c: Calls):
    p, q = c.malloc(), c.malloc()
    host = c.ffi.new("char[4096]")
    c.rec("cudaMemcpy(dev, dev, HostToDevice)", c.lib.cudaMemcpy(p, q, 4096, 1))
    c.rec("cudaMemcpy(dev, pageable, DeviceToDevice)", c.lib.cudaMemcpy(p, host, 4096, D2D))
    c.rec("cudaMemcpy(pageable, dev, HostToDevice)", c.lib.cudaMemcpy(host, p, 4096, 1))
    c.last_error()


@scenario
def memset_past_the_end(c: Calls):
    p = c.malloc(1 << 20)
    s = c.stream()
    c.rec("cudaMemsetAsync(p, 1 MiB + 1)", c.lib.cudaMemsetAsync(p, 0, (1 << 20) + 1, s))
    c.rec("cudaStreamSynchronize", c.lib.cudaStreamSynchronize(s))
    c.last_error()


@scenario
def event_elapsed_rules(c: Calls):
    s = c.stream()
    a, b = c.event(0), c.event(0)
    ms = c.ffi.new("float *")
    c.rec("cudaEventElapsedTime(never recorded)", c.lib.cudaEventElapsedTime(ms, a, b))
    c.rec("cudaEventRecord(a)", c.lib.cudaEventRecord(a, s))
    c.rec("cudaEventElapsedTime(a recorded, b not)", c.lib.cudaEventElapsedTime(ms, a, b))
    c.rec("cudaEventRecord(b)", c.lib.cudaEventRecord(b, s))
    c.rec("cudaEventSynchronize(b)", c.lib.cudaEventSynchronize(b))
    c.rec("cudaEventElapsedTime(both)", c.lib.cudaEventElapsedTime(ms, a, b))
    x, y = c.event(2), c.event(2)
    c.rec("cudaEventRecord(x no timing)", c.lib.cudaEventRecord(x, s))
    c.rec("cudaEventRecord(y no timing)", c.lib.cudaEventRecord(y, s))
    c.rec("cudaEventSynchronize(y)", c.lib.cudaEventSynchronize(y))
    c.rec("cudaEventElapsedTime(DisableTiming events)", c.lib.cudaEventElapsedTime(ms, x, y))
    c.last_error()


@scenario
def event_query_never_recorded(c: Calls):
    e = c.event()
    c.rec("cudaEventQuery(never recorded)", c.lib.cudaEventQuery(e))
    c.rec("cudaEventSynchronize(never recorded)", c.lib.cudaEventSynchronize(e))
    c.last_error()


@scenario
def last_error_rules(c: Calls):
    c.rec("cudaSetDevice(99)", c.lib.cudaSetDevice(99))
    c.rec("cudaPeekAtLastError", c.lib.cudaPeekAtLastError())
    c.rec("cudaGetLastError", c.lib.cudaGetLastError())
    c.rec("cudaGetLastError again", c.lib.cudaGetLastError())
    s = c.stream()
    p = c.malloc(1 << 24)
    c.memset(p, s, 1 << 24)
    c.rec("cudaStreamQuery(busy?)", c.lib.cudaStreamQuery(s))
    c.rec("cudaGetLastError after a query", c.lib.cudaGetLastError())


def _forked(c: Calls, before_fork: Callable[[], None], in_child: Callable[[Calls], None]):
    before_fork()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        child = Calls(c.ffi, c.lib)
        try:
            in_child(child)
        finally:
            os.write(w, json.dumps(child.steps).encode())
            os.close(w)
            os._exit(0)
    os.close(w)
    data = b""
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    for label, rc in json.loads(data or b"[]"):
        c.steps.append(["child: " + label, rc])


def _child_work(child: Calls):
    n = child.ffi.new("int *")
    child.rec("cudaGetDeviceCount", child.lib.cudaGetDeviceCount(n))
    child.malloc(256)
    v = child.ffi.new("int *")
    child.rec("cudaRuntimeGetVersion", child.lib.cudaRuntimeGetVersion(v))


@scenario
def fork_before_any_call(c: Calls):
    _forked(c, lambda: None, _child_work)


@scenario
def fork_after_device_count(c: Calls):
    n = c.ffi.new("int *")
    _forked(c, lambda: c.rec("cudaGetDeviceCount (parent)", c.lib.cudaGetDeviceCount(n)), _child_work)


@scenario
def fork_after_malloc(c: Calls):
    _forked(c, lambda: c.malloc(256, "cudaMalloc (parent)"), _child_work)


# -- kernel launches (a kernel of no parameters; the simulator runs a no-op reference for it) -----------
def _nop_kernel(c: Calls):
    lib_p = c.ffi.new("cudaLibrary_t *")
    c.rec("cudaLibraryLoadData", c.lib.cudaLibraryLoadData(lib_p, _PTX, c.ffi.NULL, c.ffi.NULL, 0, c.ffi.NULL,
                                                          c.ffi.NULL, 0))
    k = c.ffi.new("cudaKernel_t *")
    c.rec("cudaLibraryGetKernel", c.lib.cudaLibraryGetKernel(k, lib_p[0], b"accel_conformance_nop"))
    return lib_p[0], k[0]


def _launch(c: Calls, k, s, label: str, grid=(1, 1, 1), block=(32, 1, 1), shared: int = 0):
    argv = c.ffi.new("void *[]", [c.ffi.NULL])
    return c.rec(label, c.lib.cudaLaunchKernel(c.ffi.cast("void *", k), c.ffi.new("dim3 *", grid)[0],
                                               c.ffi.new("dim3 *", block)[0], argv, shared, s))


@scenario
def launch_configurations(c: Calls):
    s = c.stream()
    _, k = _nop_kernel(c)
    _launch(c, k, s, "launch 1x32")
    _launch(c, k, s, "launch block 1025", block=(1025, 1, 1))
    _launch(c, k, s, "launch block 1024", block=(1024, 1, 1))
    _launch(c, k, s, "launch block (32, 32, 2)", block=(32, 32, 2))
    _launch(c, k, s, "launch grid 0", grid=(0, 1, 1))
    _launch(c, k, s, "launch grid.y 65536", grid=(1, 65536, 1))
    _launch(c, k, s, "launch grid.x 2**31-1", grid=(2 ** 31 - 1, 1, 1), block=(1, 1, 1))
    c.rec("cudaStreamSynchronize", c.lib.cudaStreamSynchronize(s))
    c.last_error()


@scenario
def launch_dynamic_shared_memory(c: Calls):
    s = c.stream()
    _, k = _nop_kernel(c)
    _launch(c, k, s, "launch 48 KiB dynamic shared", shared=48 << 10)
    _launch(c, k, s, "launch 64 KiB dynamic shared, no attribute", shared=64 << 10)
    c.last_error()
    c.rec("cudaFuncSetAttribute(max dynamic shared 64 KiB)",
          c.lib.cudaFuncSetAttribute(c.ffi.cast("void *", k), 8, 64 << 10))
    _launch(c, k, s, "launch 64 KiB dynamic shared after the attribute", shared=64 << 10)
    _launch(c, k, s, "launch 80 KiB dynamic shared, attribute 64 KiB", shared=80 << 10)
    c.last_error()
    c.rec("cudaFuncSetAttribute(max dynamic shared 300 KiB)",
          c.lib.cudaFuncSetAttribute(c.ffi.cast("void *", k), 8, 300 << 10))
    c.rec("cudaStreamSynchronize", c.lib.cudaStreamSynchronize(s))
    c.last_error()


@scenario
def launch_after_library_unload(c: Calls):
    s = c.stream()
    lib_h, k = _nop_kernel(c)
    _launch(c, k, s, "launch")
    c.rec("cudaStreamSynchronize", c.lib.cudaStreamSynchronize(s))
    c.rec("cudaLibraryUnload", c.lib.cudaLibraryUnload(lib_h))
    _launch(c, k, s, "launch after unload")
    c.rec("cudaStreamSynchronize", c.lib.cudaStreamSynchronize(s))
    c.last_error()


@scenario
def launch_in_capture_and_graph_after_unload(c: Calls):
    s = c.stream()
    lib_h, k = _nop_kernel(c)
    c.begin(s)
    _launch(c, k, s, "launch in capture")
    g = c.ffi.new("cudaGraph_t *")
    c.rec("cudaStreamEndCapture", c.lib.cudaStreamEndCapture(s, g))
    x = c.ffi.new("cudaGraphExec_t *")
    c.rec("cudaGraphInstantiate", c.lib.cudaGraphInstantiate(x, g[0], 0))
    c.rec("cudaGraphLaunch", c.lib.cudaGraphLaunch(x[0], s))
    c.rec("cudaStreamSynchronize", c.lib.cudaStreamSynchronize(s))
    c.rec("cudaLibraryUnload", c.lib.cudaLibraryUnload(lib_h))
    c.rec("cudaGraphLaunch after the kernel's library was unloaded", c.lib.cudaGraphLaunch(x[0], s))
    c.rec("cudaStreamSynchronize", c.lib.cudaStreamSynchronize(s))
    c.last_error()


# -- stream-ordered allocation (cudaMallocAsync) ---------------------------------------------------------
@scenario
def pool_free_mismatches(c: Calls):
    s = c.stream()
    p = c.malloc()
    c.rec("cudaFreeAsync(cudaMalloc pointer)", c.lib.cudaFreeAsync(p, s))
    c.last_error()
    q = c.ffi.new("void **")
    c.rec("cudaMallocAsync", c.lib.cudaMallocAsync(q, 1 << 20, s))
    c.rec("cudaFree(cudaMallocAsync pointer)", c.lib.cudaFree(q[0]))
    c.last_error()
    r = c.ffi.new("void **")
    c.rec("cudaMallocAsync", c.lib.cudaMallocAsync(r, 1 << 20, s))
    c.rec("cudaFreeAsync", c.lib.cudaFreeAsync(r[0], s))
    c.rec("cudaFreeAsync again", c.lib.cudaFreeAsync(r[0], s))
    c.rec("cudaStreamSynchronize", c.lib.cudaStreamSynchronize(s))
    c.last_error()
    z = c.ffi.new("void **")
    c.rec("cudaMallocAsync(0 bytes)", c.lib.cudaMallocAsync(z, 0, s))
    c.steps.append(["cudaMallocAsync(0 bytes) gave NULL", int(z[0] == c.ffi.NULL)])
    c.last_error()


# -- virtual memory management (the driver's cuMem*, as accel's expandable segments use them) -----------
def _vmm(c: Calls):
    from accel.backends._cuda_vmm import DriverVmm
    c.rec("cudaFree(NULL) (starts the runtime)", c.lib.cudaFree(c.ffi.NULL))
    v = DriverVmm(c.ffi, c.lib)
    gran, rc = v.granularity(0)
    c.rec("cuMemGetAllocationGranularity", rc)
    return v, gran


def _vmm_memset(c: Calls, va: int, n: int, label: str):
    s = c.stream()
    c.rec(label, c.lib.cudaMemsetAsync(c.ffi.cast("void *", va), 1, n, s))
    c.rec(label + ": cudaStreamSynchronize", c.lib.cudaStreamSynchronize(s))


@scenario
def vmm_basic_and_release_while_mapped(c: Calls):
    v, g = _vmm(c)
    va, rc = v.reserve(4 * g)
    c.rec("cuMemAddressReserve", rc)
    h, rc = v.create(0, g)
    c.rec("cuMemCreate", rc)
    c.rec("cuMemMap", v.map(va, g, h))
    c.rec("cuMemSetAccess", v.set_access(va, g, 0))
    _vmm_memset(c, va, g, "memset mapped")
    c.rec("cuMemRelease while mapped", v.release(h))
    _vmm_memset(c, va, g, "memset after release, still mapped")
    c.rec("cuMemUnmap", v.unmap(va, g))
    c.rec("cuMemAddressFree", v.free(va, 4 * g))


@scenario
def vmm_rules(c: Calls):
    v, g = _vmm(c)
    va, rc = v.reserve(8 * g)
    c.rec("cuMemAddressReserve", rc)
    _, rc = v.create(0, g + 1)
    c.rec("cuMemCreate(granularity + 1)", rc)
    h2, rc = v.create(0, 2 * g)
    c.rec("cuMemCreate(2 granules)", rc)
    c.rec("cuMemMap(offset 1 granule)", v.fns["cuMemMap"](va, g, g, h2, 0))
    c.rec("cuMemMap(size 1 granule of a 2-granule handle, offset 0)", v.fns["cuMemMap"](va, g, 0, h2, 0))
    c.rec("cuMemMap(size 3 granules of a 2-granule handle)", v.map(va + 2 * g, 3 * g, h2))
    c.rec("cuMemMap(whole handle)", v.map(va + 2 * g, 2 * g, h2))
    c.rec("cuMemMap(again onto a mapped range)", v.map(va + 2 * g, 2 * g, h2))
    c.rec("cuMemMap(the same handle at a second address)", v.map(va + 4 * g, 2 * g, h2))
    c.rec("cuMemMap(unaligned address)", v.map(va + 6 * g + 4096, g, h2))
    c.rec("cuMemSetAccess(both mappings)", v.set_access(va + 2 * g, 4 * g, 0))
    c.rec("cuMemUnmap(half of a mapping)", v.unmap(va + 2 * g, g))
    c.rec("cuMemAddressFree while mapped", v.free(va, 8 * g))
    c.rec("cuMemUnmap(first mapping)", v.unmap(va + 2 * g, 2 * g))
    c.rec("cuMemUnmap(second mapping)", v.unmap(va + 4 * g, 2 * g))
    c.rec("cuMemUnmap(not mapped)", v.unmap(va + 2 * g, 2 * g))
    c.rec("cuMemRelease", v.release(h2))
    c.rec("cuMemRelease again", v.release(h2))
    c.rec("cuMemAddressFree(part of the reservation)", v.free(va, g))
    c.rec("cuMemAddressFree", v.free(va, 8 * g))
    c.rec("cuMemAddressFree again", v.free(va, 8 * g))


@scenario
def vmm_during_capture(c: Calls):
    v, g = _vmm(c)
    va, rc = v.reserve(2 * g)
    c.rec("cuMemAddressReserve", rc)
    s = c.stream()
    p = c.malloc()
    c.begin(s)
    c.memset(p, s)
    h, rc = v.create(0, g)
    c.rec("cuMemCreate in a global capture", rc)
    c.status(s, label="cudaStreamIsCapturing after cuMemCreate")
    c.rec("cuMemMap in a global capture", v.map(va, g, h) if rc == 0 else -1)
    c.rec("cuMemSetAccess in a global capture", v.set_access(va, g, 0) if rc == 0 else -1)
    c.status(s, label="cudaStreamIsCapturing after map")
    c.rec("cuMemUnmap in a global capture", v.unmap(va, g) if rc == 0 else -1)
    c.rec("cuMemRelease in a global capture", v.release(h) if rc == 0 else -1)
    c.status(s, label="cudaStreamIsCapturing after release")
    c.end(s)
    c.last_error()


# -- running -------------------------------------------------------------------------------------------
def _nop(grid, block, view):
    """The simulator's reference of accel_conformance_nop: it does nothing, as the kernel."""


def _open(real: bool):
    if real:
        from accel._ffi import open_library
        ffi, lib, _ = open_library("cudart")
        return ffi, lib
    os.environ.setdefault("ACCEL_SIM", "cuda")
    from accel import sim
    from accel.backends.cuda import _cudart_ffi_for
    sim.register_kernel("accel_conformance_nop", _nop, "", replace=True)
    lib = sim.open_library("cudart")
    return _cudart_ffi_for(lib), lib


def run_one(name: str, real: bool) -> dict:
    ffi, lib = _open(real)
    c = Calls(ffi, lib)
    try:
        SCENARIOS[name](c)
        return {"steps": c.steps}
    except Exception as exc:  # noqa: BLE001 - recorded: the scenario itself broke
        return {"steps": c.steps, "error": f"{type(exc).__name__}: {exc}"}


def run_all(real: bool, only: List[str], timeout: float = 60) -> dict:
    out = {}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    for name in only or SCENARIOS:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", name] + (["--real"] if real else [])
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            out[name] = {"error": f"hung: killed after {timeout:.0f} s"}
            continue
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@result ")]
        if not lines:
            out[name] = {"error": f"exit {proc.returncode} without a result", "stderr": proc.stderr[-2000:]}
            continue
        out[name] = json.loads(lines[-1][len("@result "):])
    return out


def compare(sim: dict, real: dict) -> dict:
    """Per call: "same", "sim_lenient" (sim 0, real error: a bug), "sim_stricter" (sim error,
    real 0), "other_code" (both errors, different codes), "steps_differ" (the runs diverged)."""
    verdicts = {}
    real = {k: v for k, v in real.items() if not k.startswith("_")}      # "_meta": where it was recorded
    for name in sorted(set(sim) | set(real)):
        if name not in real:
            verdicts[name] = [["not_recorded"]]       # added after the GPU run: the next one records it
            continue
        a, b = sim.get(name, {}), real.get(name, {})
        rows = []
        sa, sb = a.get("steps", []), b.get("steps", [])
        for i in range(max(len(sa), len(sb))):
            la, ra = (sa[i] if i < len(sa) else [None, None])
            lb, rb = (sb[i] if i < len(sb) else [None, None])
            if la != lb:
                rows.append(["steps_differ", i, la, ra, lb, rb])
                break
            if ra == rb:
                continue
            yes_no = la.startswith("next ") or la.endswith(" status")
            kind = ("differs" if yes_no else "sim_lenient" if ra == 0 else "sim_stricter" if rb == 0
                    else "other_code")
            rows.append([kind, i, la, ra, rb])
        if a.get("error") or b.get("error"):
            rows.append(["error", a.get("error"), b.get("error")])
        verdicts[name] = rows
    return verdicts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", action="store_true", help="run on the real libcudart (needs a device)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--compare", metavar="REAL_JSON", help="run on the simulator and compare with a real run")
    parser.add_argument("--only", default="", help="comma-separated scenario names (prefixes allowed)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print("@result " + json.dumps(run_one(args.one, args.real)), flush=True)
        return 0
    only = [n for n in SCENARIOS if any(n.startswith(p) for p in args.only.split(",") if p)] if args.only else []
    results = run_all(args.real, only)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    if args.compare:
        with open(args.compare) as fh:
            real = json.load(fh)
        verdicts = compare(results, {k: v for k, v in real.items() if not only or k in only})
        bad = 0
        for name, rows in verdicts.items():
            for row in rows:
                bad += row[0] in ("sim_lenient", "steps_differ", "error")
                print(name, *row)
        counts = {}
        for rows in verdicts.values():
            for row in rows:
                counts[row[0]] = counts.get(row[0], 0) + 1
        print(f"{len(verdicts)} scenarios; {counts or 'all calls agree'}")
        return 1 if bad else 0
    for name, res in results.items():
        print(f"{name}: " + ", ".join(f"{label}={rc}" for label, rc in res.get("steps", []))
              + (f"  ERROR {res['error']}" if res.get("error") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
