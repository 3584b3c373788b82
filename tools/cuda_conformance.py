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
listed so each can be justified), or refuses with another code.  Rows whose label ends in "?"
(and the " status" rows) are observations, values or yes/no, not return codes: a difference is
reported ("differs"), never a failure.  A call that needs a handle an earlier call failed to
produce is not made and recorded as -1, so both runs keep the same steps.  Scenarios need one
device and never depend on timing.  A scenario marked ``with_env`` runs with those environment
variables set (or unset) before the runtime is opened: the *_eager ones with
CUDA_MODULE_LOADING=EAGER, their twins with it unset (lazy loading, CUDA's default).  tests/test_sim_cuda_conformance.py checks the simulator
against the run recorded in tests/conformance/; scenarios added after it (the launch_*, pool_*,
vmm_* ones and everything after "rules of accel/sim/README.md" below) are checked from the next
GPU run on (tools/device_check.sh records one).
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


def with_env(**env):
    """The scenario runs with these environment variables (None: unset), set before the runtime is
    opened (run_one) and restored after: e.g. CUDA_MODULE_LOADING, which CUDA reads when it starts."""
    def mark(fn):
        fn.env = env
        return fn
    return mark


class Calls:
    """The runtime under test and the record of what each call returned."""

    def __init__(self, ffi, lib, echo: bool = False):
        self.ffi, self.lib = ffi, lib
        self.steps: List[list] = []
        self.echo = echo        # print each step as it is made (a scenario process: see _run_in_process)

    def rec(self, label: str, rc) -> int:
        self.steps.append([label, int(rc)])
        if self.echo:
            print("@step " + json.dumps([label, int(rc)]), flush=True)
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

    def seen(self, label: str, value) -> None:
        """An observation, not a return code: its label ends in "?" and ``compare`` reports a
        difference from the GPU as "differs", never as a failure."""
        self.steps.append([label + "?", int(value)])

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
def _handle_recycled(c: Calls, make, destroy: str, what: str):
    handle = make()
    first = int(c.ffi.cast("uintptr_t", handle))
    c.rec(destroy, getattr(c.lib, destroy)(handle))
    again = int(c.ffi.cast("uintptr_t", make()))
    c.steps.append([f"next {what} has the destroyed one's handle", int(again == first)])


@scenario
def handle_recycle_stream(c: Calls):
    _handle_recycled(c, c.stream, "cudaStreamDestroy", "stream")


@scenario
def handle_recycle_event(c: Calls):
    _handle_recycled(c, c.event, "cudaEventDestroy", "event")


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


def _launch(c: Calls, k, s, label: str, grid=(1, 1, 1), block=(32, 1, 1), shared: int = 0, argv=None):
    if argv is None:
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
    from accel.backends.cuda.vmm import DriverVmm
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


# -- rules of accel/sim/README.md ("CUDA runtime" > Enforced) a one-device machine can exercise ----------
# Each scenario below makes the calls a rule is about and records every code; "?" rows are
# observations (values, yes/no), compared but never failing.  A call whose handle a failed earlier
# call did not produce is recorded as -1 and not made (never a use of a missing handle).
def _sync(c: Calls, s, label: str = "cudaStreamSynchronize"):
    return c.rec(label, c.lib.cudaStreamSynchronize(s))


def _legacy(c: Calls, handle: int = 0):
    return c.ffi.cast("cudaStream_t", handle)


def _mem_info(c: Calls, label: str = "cudaMemGetInfo"):
    free, total = c.ffi.new("size_t *"), c.ffi.new("size_t *")
    c.rec(label, c.lib.cudaMemGetInfo(free, total))
    return int(free[0]), int(total[0])


def _graph_alloc(c: Calls, s, size: int = 1 << 20, free_in_graph: bool = False, what: str = ""):
    """Capture on ``s`` a cudaMallocAsync, a memset of it and (``free_in_graph``) its cudaFreeAsync:
    (graph or None, the allocation's address)."""
    tag = f" ({what})" if what else ""
    c.begin(s, label="cudaStreamBeginCapture" + tag)
    p = c.ffi.new("void **")
    rc = c.rec("cudaMallocAsync in capture" + tag, c.lib.cudaMallocAsync(p, size, s))
    c.rec("cudaMemsetAsync(graph allocation) in capture" + tag,
          c.lib.cudaMemsetAsync(p[0], 0, 256, s) if rc == 0 else -1)
    if free_in_graph:
        c.rec("cudaFreeAsync in capture" + tag, c.lib.cudaFreeAsync(p[0], s) if rc == 0 else -1)
    g = c.ffi.new("cudaGraph_t *")
    rc = c.rec("cudaStreamEndCapture" + tag, c.lib.cudaStreamEndCapture(s, g))
    return (g[0] if rc == 0 else None), p[0]


def _plain_graph(c: Calls, s, ptr):
    c.begin(s, label="cudaStreamBeginCapture (memset only)")
    c.memset(ptr, s, label="cudaMemsetAsync (memset only)")
    g = c.ffi.new("cudaGraph_t *")
    rc = c.rec("cudaStreamEndCapture (memset only)", c.lib.cudaStreamEndCapture(s, g))
    return g[0] if rc == 0 else None


def _instantiate(c: Calls, g, flags: int = 0, label: str = "cudaGraphInstantiate"):
    if g is None:
        c.rec(label, -1)
        return None
    x = c.ffi.new("cudaGraphExec_t *")
    rc = c.rec(label, c.lib.cudaGraphInstantiate(x, g, flags))
    return x[0] if rc == 0 else None


def _graph_launch(c: Calls, x, s, label: str = "cudaGraphLaunch"):
    return c.rec(label, c.lib.cudaGraphLaunch(x, s) if x is not None else -1)


def _exec_destroy(c: Calls, x, label: str = "cudaGraphExecDestroy"):
    return c.rec(label, c.lib.cudaGraphExecDestroy(x) if x is not None else -1)


def _graph_destroy(c: Calls, g, label: str = "cudaGraphDestroy"):
    return c.rec(label, c.lib.cudaGraphDestroy(g) if g is not None else -1)


def _graph_attr(c: Calls, attr: int, label: str) -> int:
    v = c.ffi.new("unsigned long long *")
    rc = c.rec(label, c.lib.cudaDeviceGetGraphMemAttribute(0, attr, v))
    return int(v[0]) if rc == 0 else -1


def _pool_attr(c: Calls, pool, attr: int, label: str) -> int:
    v = c.ffi.new("unsigned long long *")
    rc = c.rec(label, c.lib.cudaMemPoolGetAttribute(pool, attr, v))
    return int(v[0]) if rc == 0 else -1


USED_CURRENT, USED_HIGH, RESERVED_CURRENT = 0, 1, 2          # cudaGraphMemAttributeType
POOL_RESERVED_CURRENT, POOL_USED_CURRENT, POOL_USED_HIGH = 5, 7, 8   # cudaMemPoolAttr
AUTO_FREE_ON_LAUNCH, UPLOAD, DEVICE_LAUNCH, NODE_PRIORITY = 1, 2, 4, 8   # cudaGraphInstantiateFlags
RECORD_EXTERNAL = WAIT_EXTERNAL = 1                          # cudaEventRecordExternal / cudaEventWaitExternal


# graph memory nodes (Runtime API cudaMallocAsync/cudaFreeAsync in capture, cudaGraphInstantiate,
# cudaGraphLaunch; Programming Guide "Graph Memory Nodes")
@scenario
def graph_mem_relaunch_unfreed(c: Calls):
    s = c.stream()
    g, p = _graph_alloc(c, s)
    x = _instantiate(c, g)
    _graph_launch(c, x, s)
    _sync(c, s)
    _graph_launch(c, x, s, "cudaGraphLaunch again, its allocation not freed")
    c.last_error()
    c.rec("cudaFreeAsync(graph allocation) outside capture", c.lib.cudaFreeAsync(p, s))
    c.rec("cudaFreeAsync(graph allocation) again", c.lib.cudaFreeAsync(p, s))
    c.last_error()
    _graph_launch(c, x, s, "cudaGraphLaunch after cudaFreeAsync")
    _sync(c, s)
    c.rec("cudaFree(graph allocation)", c.lib.cudaFree(p))
    c.rec("cudaFree(graph allocation) again", c.lib.cudaFree(p))
    c.last_error()
    _graph_launch(c, x, s, "cudaGraphLaunch after cudaFree")
    c.rec("cudaFreeAsync(graph allocation)", c.lib.cudaFreeAsync(p, s))
    _sync(c, s)
    _exec_destroy(c, x)
    _graph_destroy(c, g)
    c.rec("cudaDeviceGraphMemTrim", c.lib.cudaDeviceGraphMemTrim(0))
    c.last_error()


@scenario
def graph_mem_free_before_any_launch(c: Calls):
    s = c.stream()
    g, p = _graph_alloc(c, s)
    c.rec("cudaFreeAsync(graph allocation) before any launch", c.lib.cudaFreeAsync(p, s))
    c.last_error()
    x = _instantiate(c, g)
    c.rec("cudaFreeAsync(graph allocation) instantiated, not launched", c.lib.cudaFreeAsync(p, s))
    c.last_error()
    _graph_launch(c, x, s)
    c.rec("cudaFreeAsync(graph allocation) after the launch", c.lib.cudaFreeAsync(p, s))
    _sync(c, s)
    c.last_error()


@scenario
def graph_mem_second_instantiation(c: Calls):
    s = c.stream()
    g, _ = _graph_alloc(c, s, what="unfreed allocation")
    x1 = _instantiate(c, g, label="cudaGraphInstantiate (first)")
    x2 = _instantiate(c, g, label="cudaGraphInstantiate (second, the first alive)")
    _exec_destroy(c, x2, "cudaGraphExecDestroy (second)")
    c.last_error()
    _exec_destroy(c, x1, "cudaGraphExecDestroy (first)")
    x3 = _instantiate(c, g, label="cudaGraphInstantiate after the first was destroyed")
    _exec_destroy(c, x3, "cudaGraphExecDestroy (third)")
    h, _ = _graph_alloc(c, s, free_in_graph=True, what="allocation freed in the graph")
    y1 = _instantiate(c, h, label="cudaGraphInstantiate (allocation freed in the graph, first)")
    y2 = _instantiate(c, h, label="cudaGraphInstantiate (allocation freed in the graph, second)")
    _exec_destroy(c, y2, "cudaGraphExecDestroy (second)")
    c.last_error()
    _graph_launch(c, y1, s, "cudaGraphLaunch (allocation freed in the graph)")
    _graph_launch(c, y1, s, "cudaGraphLaunch again (allocation freed in the graph)")
    _sync(c, s)
    c.last_error()


@scenario
def graph_mem_auto_free_on_launch(c: Calls):
    s = c.stream()
    g, p = _graph_alloc(c, s)
    x = _instantiate(c, g, AUTO_FREE_ON_LAUNCH, "cudaGraphInstantiate(AutoFreeOnLaunch)")
    _graph_launch(c, x, s)
    _graph_launch(c, x, s, "cudaGraphLaunch again, allocation not freed (AutoFreeOnLaunch)")
    _sync(c, s)
    c.rec("cudaFreeAsync(graph allocation)", c.lib.cudaFreeAsync(p, s))
    _graph_launch(c, x, s, "cudaGraphLaunch after cudaFreeAsync")
    _sync(c, s)
    c.rec("cudaFree(graph allocation)", c.lib.cudaFree(p))
    c.last_error()


@scenario
def graph_instantiate_flags(c: Calls):
    s = c.stream()
    ptr = c.malloc()
    g = _plain_graph(c, s, ptr)
    for flags, name in ((AUTO_FREE_ON_LAUNCH, "AutoFreeOnLaunch"), (UPLOAD, "Upload"), (DEVICE_LAUNCH, "DeviceLaunch"),
                        (NODE_PRIORITY, "UseNodePriority"), (AUTO_FREE_ON_LAUNCH | DEVICE_LAUNCH,
                                                              "AutoFreeOnLaunch|DeviceLaunch"),
                        (0x100, "0x100 (unknown)")):
        x = _instantiate(c, g, flags, f"cudaGraphInstantiate({name}) of a memset graph")
        _exec_destroy(c, x, f"cudaGraphExecDestroy ({name})")
        c.last_error()
    # cudaGraphInstantiate: a graph for device launch "can only contain kernel nodes, memcpy nodes,
    # memset nodes, and child graph nodes" and "cannot be empty"
    h, _ = _graph_alloc(c, s, free_in_graph=True)
    x = _instantiate(c, h, DEVICE_LAUNCH, "cudaGraphInstantiate(DeviceLaunch) of a graph with memory nodes")
    _exec_destroy(c, x, "cudaGraphExecDestroy (DeviceLaunch, memory nodes)")
    c.last_error()
    ev = c.event()
    c.begin(s, label="cudaStreamBeginCapture (event record node)")
    c.memset(ptr, s, label="cudaMemsetAsync (event record node)")
    c.rec("cudaEventRecordWithFlags(external) in capture", c.lib.cudaEventRecordWithFlags(ev, s, RECORD_EXTERNAL))
    gp = c.ffi.new("cudaGraph_t *")
    rc = c.rec("cudaStreamEndCapture (event record node)", c.lib.cudaStreamEndCapture(s, gp))
    x = _instantiate(c, gp[0] if rc == 0 else None, DEVICE_LAUNCH,
                     "cudaGraphInstantiate(DeviceLaunch) of a graph with an event record node")
    _exec_destroy(c, x, "cudaGraphExecDestroy (DeviceLaunch, event record node)")
    c.last_error()
    c.begin(s, label="cudaStreamBeginCapture (nothing captured)")
    rc = c.rec("cudaStreamEndCapture (nothing captured)", c.lib.cudaStreamEndCapture(s, gp))
    x = _instantiate(c, gp[0] if rc == 0 else None, DEVICE_LAUNCH,
                     "cudaGraphInstantiate(DeviceLaunch) of an empty graph")
    _exec_destroy(c, x, "cudaGraphExecDestroy (DeviceLaunch, empty graph)")
    c.last_error()


@scenario
def graph_mem_capture_free_twice(c: Calls):
    s = c.stream()
    c.begin(s)
    p = c.ffi.new("void **")
    rc = c.rec("cudaMallocAsync in capture", c.lib.cudaMallocAsync(p, 1 << 20, s))
    c.rec("cudaFreeAsync in capture", c.lib.cudaFreeAsync(p[0], s) if rc == 0 else -1)
    c.rec("cudaFreeAsync in capture again", c.lib.cudaFreeAsync(p[0], s) if rc == 0 else -1)
    c.status(s)
    c.end(s)
    c.last_error()


@scenario
def graph_mem_capture_free_unordered(c: Calls):
    s1, s2 = c.stream(), c.stream()
    ptr = c.malloc()
    c.begin(s1)
    _fork(c, s1, s2, ptr)                 # s2 joins the capture before the allocation
    p = c.ffi.new("void **")
    rc = c.rec("cudaMallocAsync(s1) in capture", c.lib.cudaMallocAsync(p, 1 << 20, s1))
    c.rec("cudaFreeAsync(s2, not ordered after the allocation)", c.lib.cudaFreeAsync(p[0], s2) if rc == 0 else -1)
    c.status(s1)
    join = c.event()
    c.rec("cudaEventRecord(join ev, s2)", c.lib.cudaEventRecord(join, s2))
    c.rec("cudaStreamWaitEvent(s1, join ev)", c.lib.cudaStreamWaitEvent(s1, join, 0))
    c.end(s1)
    c.last_error()


@scenario
def graph_mem_capture_free_other_graphs_allocation(c: Calls):
    s = c.stream()
    g, p = _graph_alloc(c, s, what="first graph")
    x = _instantiate(c, g)
    _graph_launch(c, x, s)
    _sync(c, s)
    c.begin(s, label="cudaStreamBeginCapture (second graph)")
    c.rec("cudaFreeAsync(the first graph's allocation) in capture", c.lib.cudaFreeAsync(p, s))
    c.status(s)
    c.end(s, label="cudaStreamEndCapture (second graph)")
    c.last_error()


@scenario
def graph_mem_capture_free_non_graph_memory(c: Calls):
    s = c.stream()
    d = c.malloc()
    q = c.ffi.new("void **")
    c.rec("cudaMallocAsync (outside capture)", c.lib.cudaMallocAsync(q, 1 << 20, s))
    _sync(c, s)
    c.begin(s)
    c.memset(d, s)
    c.rec("cudaFreeAsync(cudaMalloc pointer) in capture", c.lib.cudaFreeAsync(d, s))
    c.status(s)
    c.rec("cudaFreeAsync(pool allocation) in capture", c.lib.cudaFreeAsync(q[0], s))
    c.status(s, label="cudaStreamIsCapturing after the pool free")
    c.end(s)
    c.last_error()


@scenario
def graph_mem_accounting(c: Calls):
    s = c.stream()
    pool = c.ffi.new("cudaMemPool_t *")
    c.rec("cudaDeviceGetDefaultMemPool", c.lib.cudaDeviceGetDefaultMemPool(pool, 0))
    free0, _ = _mem_info(c, "cudaMemGetInfo before")
    g, p = _graph_alloc(c, s, 64 << 20)
    x = _instantiate(c, g)
    _graph_launch(c, x, s)
    _sync(c, s)
    free1, _ = _mem_info(c, "cudaMemGetInfo after the launch")
    c.seen("free memory dropped by >= 64 MiB after the launch", free0 - free1 >= 64 << 20)
    used = _graph_attr(c, USED_CURRENT, "cudaDeviceGetGraphMemAttribute(UsedMemCurrent)")
    reserved = _graph_attr(c, RESERVED_CURRENT, "cudaDeviceGetGraphMemAttribute(ReservedMemCurrent)")
    c.seen("graph UsedMemCurrent >= 64 MiB", used >= 64 << 20)
    c.seen("graph ReservedMemCurrent >= UsedMemCurrent", reserved >= used >= 0)
    c.seen("default pool UsedMemCurrent is 0", _pool_attr(c, pool[0], POOL_USED_CURRENT,
                                                          "cudaMemPoolGetAttribute(UsedMemCurrent)") == 0)
    c.seen("default pool ReservedMemCurrent is 0", _pool_attr(c, pool[0], POOL_RESERVED_CURRENT,
                                                              "cudaMemPoolGetAttribute(ReservedMemCurrent)") == 0)
    c.rec("cudaFree(graph allocation)", c.lib.cudaFree(p))
    c.rec("cudaDeviceGraphMemTrim (executable graph alive)", c.lib.cudaDeviceGraphMemTrim(0))
    c.seen("graph ReservedMemCurrent is 0 after the trim, executable graph alive",
           _graph_attr(c, RESERVED_CURRENT, "cudaDeviceGetGraphMemAttribute(ReservedMemCurrent)") == 0)
    _exec_destroy(c, x)
    _graph_destroy(c, g)
    c.rec("cudaDeviceGraphMemTrim", c.lib.cudaDeviceGraphMemTrim(0))
    c.seen("graph ReservedMemCurrent is 0 after the trim",
           _graph_attr(c, RESERVED_CURRENT, "cudaDeviceGetGraphMemAttribute(ReservedMemCurrent)") == 0)
    c.seen("graph UsedMemHigh >= 64 MiB", _graph_attr(c, USED_HIGH, "cudaDeviceGetGraphMemAttribute(UsedMemHigh)")
           >= 64 << 20)
    zero, five = c.ffi.new("unsigned long long *", 0), c.ffi.new("unsigned long long *", 5)
    c.rec("cudaDeviceSetGraphMemAttribute(UsedMemHigh, 0)", c.lib.cudaDeviceSetGraphMemAttribute(0, USED_HIGH, zero))
    c.seen("graph UsedMemHigh is 0 after the reset",
           _graph_attr(c, USED_HIGH, "cudaDeviceGetGraphMemAttribute(UsedMemHigh)") == 0)
    c.rec("cudaDeviceSetGraphMemAttribute(UsedMemHigh, 5)", c.lib.cudaDeviceSetGraphMemAttribute(0, USED_HIGH, five))
    c.rec("cudaDeviceSetGraphMemAttribute(UsedMemCurrent, 0)",
          c.lib.cudaDeviceSetGraphMemAttribute(0, USED_CURRENT, zero))
    c.rec("cudaDeviceGetGraphMemAttribute(99)", c.lib.cudaDeviceGetGraphMemAttribute(0, 99, five))
    c.rec("cudaDeviceGraphMemTrim(99)", c.lib.cudaDeviceGraphMemTrim(99))
    c.last_error()


# external events (Runtime API cudaEventRecordWithFlags, cudaStreamWaitEvent; cuda.h CUevent_*_flags)
@scenario
def event_external_outside_capture(c: Calls):
    s = c.stream()
    ev = c.event()
    c.rec("cudaEventRecordWithFlags(external) outside capture", c.lib.cudaEventRecordWithFlags(ev, s, RECORD_EXTERNAL))
    c.last_error()
    c.rec("cudaStreamWaitEvent(external) outside capture", c.lib.cudaStreamWaitEvent(s, ev, WAIT_EXTERNAL))
    c.last_error()
    c.rec("cudaEventRecordWithFlags(flags 2)", c.lib.cudaEventRecordWithFlags(ev, s, 2))
    c.rec("cudaStreamWaitEvent(flags 2)", c.lib.cudaStreamWaitEvent(s, ev, 2))
    c.last_error()
    c.rec("cudaEventRecordWithFlags(default)", c.lib.cudaEventRecordWithFlags(ev, s, 0))
    c.rec("cudaEventSynchronize", c.lib.cudaEventSynchronize(ev))
    p = c.ffi.new("cudaEvent_t *")
    c.rec("cudaEventCreateWithFlags(Interprocess without DisableTiming)", c.lib.cudaEventCreateWithFlags(p, 4))
    c.rec("cudaEventCreateWithFlags(0x10)", c.lib.cudaEventCreateWithFlags(p, 0x10))
    c.last_error()


@scenario
def event_external_in_capture(c: Calls):
    s, other = c.stream(), c.stream()
    a, b = c.event(0), c.event(0)
    w = c.event()
    ptr = c.malloc()
    c.begin(s)
    c.rec("cudaEventRecordWithFlags(a, external) in capture", c.lib.cudaEventRecordWithFlags(a, s, RECORD_EXTERNAL))
    c.memset(ptr, s)
    c.rec("cudaEventRecordWithFlags(b, external) in capture", c.lib.cudaEventRecordWithFlags(b, s, RECORD_EXTERNAL))
    c.rec("cudaStreamWaitEvent(s, never-recorded event, external) in capture",
          c.lib.cudaStreamWaitEvent(s, w, WAIT_EXTERNAL))
    c.status(s)
    gp = c.ffi.new("cudaGraph_t *")
    rc = c.rec("cudaStreamEndCapture", c.lib.cudaStreamEndCapture(s, gp))
    g = gp[0] if rc == 0 else None
    c.rec("cudaEventQuery(a) after the capture, before a launch", c.lib.cudaEventQuery(a))
    x = _instantiate(c, g)
    _graph_launch(c, x, s)
    _sync(c, s)
    c.rec("cudaEventQuery(a) after the launch", c.lib.cudaEventQuery(a))
    ms = c.ffi.new("float *")
    c.rec("cudaEventElapsedTime(a, b) of the record nodes", c.lib.cudaEventElapsedTime(ms, a, b))
    c.rec("cudaEventRecord(w, other)", c.lib.cudaEventRecord(w, other))
    _graph_launch(c, x, s, "cudaGraphLaunch again (its wait node waits for w)")
    _sync(c, s)
    _exec_destroy(c, x)
    _graph_destroy(c, g)
    c.last_error()


@scenario
def event_external_wait_on_event_of_this_capture(c: Calls):
    s = c.stream()
    ev = c.event()
    ptr = c.malloc()
    c.begin(s)
    c.memset(ptr, s)
    c.rec("cudaEventRecord(ev, capturing s)", c.lib.cudaEventRecord(ev, s))
    c.rec("cudaStreamWaitEvent(s, ev of this capture, external)", c.lib.cudaStreamWaitEvent(s, ev, WAIT_EXTERNAL))
    c.status(s)
    c.end(s)
    c.last_error()


# capture bookkeeping, capture information and the capture interaction modes
@scenario
def capture_wait_ended_capture_event_in_capture(c: Calls):
    s1, s2 = c.stream(), c.stream()
    ev = c.event()
    ptr = c.malloc()
    c.begin(s1, label="cudaStreamBeginCapture(s1)")
    c.memset(ptr, s1)
    c.rec("cudaEventRecord(ev, capturing s1)", c.lib.cudaEventRecord(ev, s1))
    c.end(s1, label="cudaStreamEndCapture(s1)")
    c.begin(s2, label="cudaStreamBeginCapture(s2)")
    c.memset(ptr, s2, label="cudaMemsetAsync(s2)")
    c.rec("cudaStreamWaitEvent(capturing s2, ev of the ended capture)", c.lib.cudaStreamWaitEvent(s2, ev, 0))
    c.status(s2, label="cudaStreamIsCapturing(s2)")
    c.end(s2, label="cudaStreamEndCapture(s2)")
    c.last_error()


@scenario
def capture_relaxed_allows_destroy_and_unload(c: Calls):
    ptr = c.malloc()
    g, x = _graph_exec(c, ptr)
    lib_h, _ = _nop_kernel(c)
    s = c.stream()
    c.begin(s)
    c.memset(ptr, s)
    c.relaxed()
    c.rec("cudaGraphExecDestroy during a capture, relaxed", c.lib.cudaGraphExecDestroy(x))
    c.rec("cudaGraphDestroy during a capture, relaxed", c.lib.cudaGraphDestroy(g))
    c.rec("cudaLibraryUnload during a capture, relaxed", c.lib.cudaLibraryUnload(lib_h))
    c.status(s)
    c.end(s)
    c.last_error()


@scenario
def capture_info(c: Calls):
    s = c.stream()
    ptr = c.malloc()
    st, cid, n = c.ffi.new("enum cudaStreamCaptureStatus *"), c.ffi.new("unsigned long long *"), c.ffi.new("size_t *")
    null = c.ffi.NULL

    try:
        get = c.lib.cudaStreamGetCaptureInfo           # CUDA 13: with edgeData_out

        def call(stream):
            return get(stream, st, cid, null, null, null, n)
    except (AttributeError, c.ffi.error):
        def call(stream):                               # CUDA 12 bindings: the _v2 entry point
            return c.lib.cudaStreamGetCaptureInfo_v2(stream, st, cid, null, null, n)

    def info(label, stream):
        rc = c.rec(label, call(stream))
        c.steps.append([label + " status", int(st[0]) if rc == 0 else -1])
        return int(cid[0]), int(n[0])
    info("cudaStreamGetCaptureInfo (not capturing)", s)
    c.begin(s)
    id1, n0 = info("cudaStreamGetCaptureInfo (capturing, nothing captured)", s)
    c.seen("no dependencies before the first node", n0 == 0)
    c.memset(ptr, s)
    id1b, n1 = info("cudaStreamGetCaptureInfo (capturing, one node)", s)
    c.seen("one dependency after one node", n1 == 1)
    c.seen("the capture id is not 0", id1 != 0)
    c.seen("the capture id stays", id1b == id1)
    c.end(s)
    c.begin(s, label="cudaStreamBeginCapture (second capture)")
    id2, _ = info("cudaStreamGetCaptureInfo (second capture)", s)
    c.seen("the second capture has another id", id2 != id1)
    c.end(s, label="cudaStreamEndCapture (second capture)")
    b = c.stream(0)
    c.begin(b, label="cudaStreamBeginCapture(blocking stream)")
    c.memset(ptr, b, label="cudaMemsetAsync(blocking stream)")
    info("cudaStreamGetCaptureInfo(legacy stream) beside a blocking capture", _legacy(c))
    c.status(b, label="cudaStreamIsCapturing(blocking stream)")
    c.end(b, label="cudaStreamEndCapture(blocking stream)")
    c.last_error()


@scenario
def capture_mode_exchange(c: Calls):
    m = c.ffi.new("enum cudaStreamCaptureMode *", RELAXED)
    c.rec("cudaThreadExchangeStreamCaptureMode(relaxed)", c.lib.cudaThreadExchangeStreamCaptureMode(m))
    c.steps.append(["the previous mode status", int(m[0])])
    m[0] = THREAD_LOCAL
    c.rec("cudaThreadExchangeStreamCaptureMode(thread-local)", c.lib.cudaThreadExchangeStreamCaptureMode(m))
    c.steps.append(["the previous mode status", int(m[0])])
    bad = c.ffi.cast("enum cudaStreamCaptureMode *", c.ffi.new("int *", 7))
    c.rec("cudaThreadExchangeStreamCaptureMode(7)", c.lib.cudaThreadExchangeStreamCaptureMode(bad))
    c.last_error()
    c.in_thread(lambda: c.steps.append(["a new thread's mode status", _mode_of_this_thread(c)]))


def _mode_of_this_thread(c: Calls) -> int:
    m = c.ffi.new("enum cudaStreamCaptureMode *", GLOBAL)
    if c.lib.cudaThreadExchangeStreamCaptureMode(m):
        return -1
    old = int(m[0])
    c.lib.cudaThreadExchangeStreamCaptureMode(m)
    return old


def _mode_matrix(capture_mode: int):
    """A capture begun in ``capture_mode``; cudaMalloc and cudaFree by this thread or another one,
    with the interaction mode of that thread global, thread-local or relaxed
    (cudaThreadExchangeStreamCaptureMode); each in a capture of its own."""
    def run(c: Calls):
        ptr = c.malloc()
        for who in ("this", "another"):
            for mode, mname in ((GLOBAL, "global"), (THREAD_LOCAL, "thread-local"), (RELAXED, "relaxed")):
                tag = f"{who} thread in {mname} mode"
                s = c.stream()
                c.begin(s, capture_mode, label=f"cudaStreamBeginCapture ({tag})")
                c.memset(ptr, s, label=f"cudaMemsetAsync ({tag})")

                def call(mode=mode, tag=tag):
                    m = c.ffi.new("enum cudaStreamCaptureMode *", mode)
                    c.rec(f"cudaThreadExchangeStreamCaptureMode ({tag})", c.lib.cudaThreadExchangeStreamCaptureMode(m))
                    q = c.ffi.new("void **")
                    rc = c.rec(f"cudaMalloc ({tag})", c.lib.cudaMalloc(q, 256))
                    c.rec(f"cudaFree ({tag})", c.lib.cudaFree(q[0]) if rc == 0 else -1)
                    c.rec(f"cudaThreadExchangeStreamCaptureMode back ({tag})",
                          c.lib.cudaThreadExchangeStreamCaptureMode(m))
                if who == "another":
                    c.in_thread(call)
                else:
                    call()
                c.status(s, label=f"cudaStreamIsCapturing ({tag})")
                c.end(s, label=f"cudaStreamEndCapture ({tag})")
                c.last_error()
    return run


for _mode, _mname in ((GLOBAL, "global"), (THREAD_LOCAL, "threadlocal"), (RELAXED, "relaxed")):
    SCENARIOS[f"capture_mode_matrix_{_mname}"] = _mode_matrix(_mode)


# the legacy stream, cudaStreamLegacy and cudaStreamPerThread (Programming Guide, "Default Stream")
@scenario
def legacy_per_thread_stream_capture(c: Calls):
    pt = _legacy(c, 2)
    ptr = c.malloc()
    c.begin(pt, label="cudaStreamBeginCapture(cudaStreamPerThread)")
    c.memset(ptr, pt, label="cudaMemsetAsync(cudaStreamPerThread) in capture")
    c.status(pt, label="cudaStreamIsCapturing(cudaStreamPerThread)")
    c.memset(ptr, _legacy(c), label="cudaMemsetAsync(legacy stream) beside the per-thread capture")
    c.status(pt, label="cudaStreamIsCapturing(cudaStreamPerThread) after the legacy memset")
    c.end(pt, label="cudaStreamEndCapture(cudaStreamPerThread)")
    c.last_error()


@scenario
def legacy_device_sync_during_per_thread_capture(c: Calls):
    pt = _legacy(c, 2)
    ptr = c.malloc()
    c.begin(pt, label="cudaStreamBeginCapture(cudaStreamPerThread)")
    c.memset(ptr, pt, label="cudaMemsetAsync(cudaStreamPerThread) in capture")
    c.rec("cudaDeviceSynchronize during the per-thread capture", c.lib.cudaDeviceSynchronize())
    c.status(pt, label="cudaStreamIsCapturing(cudaStreamPerThread)")
    c.end(pt, label="cudaStreamEndCapture(cudaStreamPerThread)")
    c.last_error()


@scenario
def legacy_handles(c: Calls):
    _, k = _nop_kernel(c)
    for h, name in ((0, "0"), (1, "cudaStreamLegacy"), (2, "cudaStreamPerThread")):
        st = _legacy(c, h)
        _launch(c, k, st, f"launch into {name}")
        _sync(c, st, f"cudaStreamSynchronize({name})")
        c.rec(f"cudaStreamQuery({name}) after its synchronize", c.lib.cudaStreamQuery(st))
    b = c.stream(0)
    ptr = c.malloc()
    c.begin(b, label="cudaStreamBeginCapture(blocking stream)")
    c.memset(ptr, b, label="cudaMemsetAsync(blocking stream)")
    c.status(_legacy(c), label="cudaStreamIsCapturing(legacy stream) beside a blocking capture")
    c.status(b, label="cudaStreamIsCapturing(blocking stream)")
    c.end(b, label="cudaStreamEndCapture(blocking stream)")
    c.last_error()
    c.begin(_legacy(c, 1), label="cudaStreamBeginCapture(cudaStreamLegacy)")
    c.last_error()


# copies: cudaMemcpyKind against the pointers (Runtime API cudaMemcpy: "undefined behavior")
@scenario
def memcpy_async_kinds(c: Calls):
    s = c.stream()
    d, h, h2 = c.malloc(), c.host_alloc(), c.host_alloc()
    pg = c.ffi.new("char[8192]")
    q = c.ffi.new("void **")
    c.rec("cudaMallocAsync (pool memory)", c.lib.cudaMallocAsync(q, 1 << 20, s))
    d2 = c.ffi.cast("char *", d) + (64 << 10)
    cases = (("dev <- pinned, HostToDevice", d, h, 1), ("pinned <- dev, DeviceToHost", h, d, 2),
             ("dev <- dev, DeviceToDevice", d, d2, 3), ("pinned <- pinned, HostToHost", h, h2, 0),
             ("dev <- pageable, HostToDevice", d, pg, 1), ("pageable <- dev, DeviceToHost", pg, d, 2),
             ("pageable <- pinned, HostToHost", pg, h, 0), ("pool <- dev, DeviceToDevice", q[0], d, 3),
             ("pool <- pinned, HostToDevice", q[0], h, 1), ("pinned <- pool, DeviceToHost", h, q[0], 2),
             ("pool <- pageable, Default", q[0], pg, DEFAULT), ("pinned <- dev, Default", h, d, DEFAULT),
             ("dev <- pinned, DeviceToHost", d, h, 2), ("pinned <- dev, HostToDevice", h, d, 1),
             ("dev <- pinned, DeviceToDevice", d, h, 3), ("pinned <- dev, DeviceToDevice", h, d, 3),
             ("pool <- dev, HostToDevice", q[0], d, 1), ("dev <- pageable, DeviceToDevice", d, pg, 3),
             ("pageable <- dev, HostToDevice", pg, d, 1), ("dev <- pinned, kind 5", d, h, 5))
    # No HostToHost kind with device memory: the runtime may copy it with the CPU (a crash, not a code).
    for label, dst, src, kind in cases:
        c.rec(f"cudaMemcpyAsync({label})", c.lib.cudaMemcpyAsync(dst, src, 4096, kind, s))
    _sync(c, s)
    c.rec("cudaFreeAsync (pool memory)", c.lib.cudaFreeAsync(q[0], s))
    _sync(c, s)
    c.last_error()


# memory: the context's own memory, the default pool's rules on one device
@scenario
def memory_context_reserved(c: Calls):
    c.rec("cudaFree(NULL) (starts the runtime)", c.lib.cudaFree(c.ffi.NULL))
    free, total = _mem_info(c)
    c.seen("free < total with nothing allocated", 0 < free < total)
    c.malloc(total, "cudaMalloc(total memory)")
    c.last_error()


@scenario
def pool_rules_one_device(c: Calls):
    s = c.stream()
    pool = c.ffi.new("cudaMemPool_t *")
    c.rec("cudaDeviceGetDefaultMemPool(0)", c.lib.cudaDeviceGetDefaultMemPool(pool, 0))
    c.rec("cudaDeviceGetDefaultMemPool(99)", c.lib.cudaDeviceGetDefaultMemPool(c.ffi.new("cudaMemPool_t *"), 99))
    c.last_error()
    mp = pool[0]
    loc = c.ffi.new("struct cudaMemLocation *")
    loc.type, loc.id = 1, 0
    fl = c.ffi.new("enum cudaMemAccessFlags *")
    rc = c.rec("cudaMemPoolGetAccess(own device)", c.lib.cudaMemPoolGetAccess(fl, mp, loc))
    c.steps.append(["own device's access status", int(fl[0]) if rc == 0 else -1])
    loc.id = 99
    c.rec("cudaMemPoolGetAccess(device 99)", c.lib.cudaMemPoolGetAccess(fl, mp, loc))
    c.last_error()
    desc = c.ffi.new("struct cudaMemAccessDesc *")
    for typ, dev, flags, label in ((1, 0, 3, "own device, read-write"), (1, 0, 1, "own device, read"),
                                   (1, 0, 0, "own device, none"), (2, 0, 3, "host location"),
                                   (1, 99, 3, "device 99"), (1, 0, 2, "flags 2")):
        desc.location.type, desc.location.id, desc.flags = typ, dev, flags
        c.rec(f"cudaMemPoolSetAccess({label})", c.lib.cudaMemPoolSetAccess(mp, desc, 1))
        c.last_error()
    c.rec("cudaMemPoolSetAccess(count 0)", c.lib.cudaMemPoolSetAccess(mp, desc, 0))
    v = c.ffi.new("unsigned long long *", 0)
    c.rec("cudaMemPoolSetAttribute(UsedMemCurrent, 0)", c.lib.cudaMemPoolSetAttribute(mp, POOL_USED_CURRENT, v))
    c.rec("cudaMemPoolSetAttribute(UsedMemHigh, 0)", c.lib.cudaMemPoolSetAttribute(mp, POOL_USED_HIGH, v))
    v[0] = 5
    c.rec("cudaMemPoolSetAttribute(UsedMemHigh, 5)", c.lib.cudaMemPoolSetAttribute(mp, POOL_USED_HIGH, v))
    c.rec("cudaMemPoolSetAttribute(ReleaseThreshold, 5)", c.lib.cudaMemPoolSetAttribute(mp, 4, v))
    c.rec("cudaMemPoolGetAttribute(99)", c.lib.cudaMemPoolGetAttribute(mp, 99, v))
    c.last_error()
    q = c.ffi.new("void **")
    c.rec("cudaMallocAsync(legacy stream)", c.lib.cudaMallocAsync(q, 1 << 20, _legacy(c)))
    c.rec("cudaFreeAsync(pool allocation, another stream)", c.lib.cudaFreeAsync(q[0], s))
    c.rec("cudaFreeAsync(NULL)", c.lib.cudaFreeAsync(c.ffi.NULL, s))
    c.last_error()
    _sync(c, s)
    c.rec("cudaMemPoolTrimTo(0)", c.lib.cudaMemPoolTrimTo(mp, 0))
    c.seen("pool ReservedMemCurrent is 0 after the trim",
           _pool_attr(c, mp, POOL_RESERVED_CURRENT, "cudaMemPoolGetAttribute(ReservedMemCurrent)") == 0)
    c.last_error()


@scenario
def peer_access_one_device(c: Calls):
    can = c.ffi.new("int *")
    rc = c.rec("cudaDeviceCanAccessPeer(0, 0)", c.lib.cudaDeviceCanAccessPeer(can, 0, 0))
    c.steps.append(["device 0 can access itself as a peer status", int(can[0]) if rc == 0 else -1])
    c.rec("cudaDeviceEnablePeerAccess(0) on device 0", c.lib.cudaDeviceEnablePeerAccess(0, 0))
    c.last_error()
    c.rec("cudaDeviceEnablePeerAccess(99)", c.lib.cudaDeviceEnablePeerAccess(99, 0))
    c.last_error()
    c.rec("cudaDeviceDisablePeerAccess(0) on device 0", c.lib.cudaDeviceDisablePeerAccess(0))
    c.last_error()


@scenario
def last_error_per_thread(c: Calls):
    c.rec("cudaFree(NULL)", c.lib.cudaFree(c.ffi.NULL))

    def other():
        c.rec("cudaSetDevice(99) in the other thread", c.lib.cudaSetDevice(99))
    c.in_thread(other)
    c.rec("cudaGetLastError (this thread)", c.lib.cudaGetLastError())
    c.rec("cudaSetDevice(99)", c.lib.cudaSetDevice(99))

    def other_reads():
        c.rec("cudaGetLastError in the other thread", c.lib.cudaGetLastError())
    c.in_thread(other_reads)
    c.rec("cudaPeekAtLastError (this thread)", c.lib.cudaPeekAtLastError())
    c.last_error()


# kernels: attributes, occupancy, shared-memory carveout, module images, driver entry points
@scenario
def kernel_attributes_and_occupancy(c: Calls):
    _, k = _nop_kernel(c)
    f = c.ffi.cast("void *", k)
    a = c.ffi.new("struct cudaFuncAttributes *")
    rc = c.rec("cudaFuncGetAttributes", c.lib.cudaFuncGetAttributes(a, f))
    for field in ("maxThreadsPerBlock", "sharedSizeBytes", "maxDynamicSharedSizeBytes", "numRegs",
                  "localSizeBytes", "ptxVersion", "binaryVersion", "preferredShmemCarveout"):
        c.seen(f"cudaFuncAttributes.{field}", getattr(a, field) if rc == 0 else -1)
    c.rec("cudaFuncGetAttributes(NULL function)", c.lib.cudaFuncGetAttributes(a, c.ffi.NULL))
    c.last_error()
    n = c.ffi.new("int *")
    for block, shared in ((32, 0), (256, 0), (1024, 0), (128, 40 << 10), (128, 64 << 10)):
        rc = c.rec(f"cudaOccupancyMaxActiveBlocksPerMultiprocessor(block {block}, shared {shared})",
                   c.lib.cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, f, block, shared))
        c.seen(f"blocks per SM (block {block}, shared {shared})", n[0] if rc == 0 else -1)
    c.rec("cudaOccupancyMaxActiveBlocksPerMultiprocessor(block 0)",
          c.lib.cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, f, 0, 0))
    c.rec("cudaOccupancyMaxActiveBlocksPerMultiprocessor(block 1025)",
          c.lib.cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, f, 1025, 0))
    c.last_error()
    for value in (50, -1, 101):
        c.rec(f"cudaFuncSetAttribute(PreferredSharedMemoryCarveout, {value})",
              c.lib.cudaFuncSetAttribute(f, 9, value))
    c.rec("cudaFuncSetAttribute(MaxDynamicSharedMemorySize, 227 KiB)", c.lib.cudaFuncSetAttribute(f, 8, 227 << 10))
    c.rec("cudaFuncSetAttribute(MaxDynamicSharedMemorySize, 227 KiB + 1)",
          c.lib.cudaFuncSetAttribute(f, 8, (227 << 10) + 1))
    c.last_error()


def _ptx(version: str = "8.0", target: str = "sm_90", entry: bool = True, with_version: bool = True) -> bytes:
    body = ".visible .entry accel_conformance_nop()\n{\n    ret;\n}\n" if entry else \
        ".visible .func accel_conformance_helper()\n{\n    ret;\n}\n"
    head = f".version {version}\n" if with_version else ""
    return (head + f".target {target}\n.address_size 64\n" + body).encode()


_NOP = b"accel_conformance_nop"


def _bad_images():
    """(label, image) of library_bad_images: a good PTX, then four bad ones and bytes that are no image."""
    return (("PTX .target sm_80", _ptx(target="sm_80")), ("PTX .version 9.9", _ptx(version="9.9")),
            ("PTX without .entry", _ptx(entry=False)), ("PTX without .version", _ptx(with_version=False)),
            ("PTX .target sm_100", _ptx(version="8.8", target="sm_100")),
            ("bytes that are no image", b"no image at all\n"))


def _bad_containers():
    """(label, image) of containers a cc 9.0 device cannot run, from accel's shipped Philox fatbin
    (nvcc/fatbinary 13.0; SASS for sm_75..sm_120 and the PTX): the fatbin with only its sm_120 SASS,
    and that sm_120 cubin alone.  Their kernel is accel_philox_store_state."""
    import struct
    from importlib import resources
    from accel.sim import _cuda_images as images
    data = resources.files("accel.random").joinpath("kernels").joinpath("philox.fatbin").read_bytes()
    _magic, version, hsize, size = struct.unpack_from("<IHHQ", data, 0)
    pos, kept, cubin = hsize, b"", b""
    while pos < hsize + size:
        kind, _v, ehsize, payload = struct.unpack_from("<HHIQ", data, pos)
        sm, = struct.unpack_from("<I", data, pos + 28)
        if kind == images.KIND_ELF and sm == 120:
            kept, cubin = data[pos:pos + ehsize + payload], data[pos + ehsize:pos + ehsize + payload]
        pos += ehsize + payload
    fatbin = struct.pack("<IHHQ", images.FATBIN_MAGIC, version, hsize, len(kept)) + kept
    return (("fatbin of sm_120 SASS only", fatbin), ("cubin for sm_120", cubin))


def _store_state_args(c: Calls, ptr):
    """The argument array of accel_philox_store_state(seed_ptr, offset_ptr, seed, offset) writing
    16 bytes at ``ptr``, and the values it points to (keep them alive)."""
    values = [c.ffi.new("void **", ptr), c.ffi.new("void **", c.ffi.cast("char *", ptr) + 8),
              c.ffi.new("uint64_t *", 1), c.ffi.new("uint64_t *", 2)]
    return c.ffi.new("void *[]", [c.ffi.cast("void *", v) for v in values]), values


def _library_image(c: Calls, s, label: str, image: bytes, name: bytes = _NOP, argv=None):
    """Load ``image`` with cudaLibraryLoadData, look up ``name``, launch it, unload."""
    lib_p = c.ffi.new("cudaLibrary_t *")
    rc = c.rec(f"cudaLibraryLoadData({label})", c.lib.cudaLibraryLoadData(
        lib_p, image, c.ffi.NULL, c.ffi.NULL, 0, c.ffi.NULL, c.ffi.NULL, 0))
    c.last_error()
    k = c.ffi.new("cudaKernel_t *")
    krc = c.rec(f"cudaLibraryGetKernel({label})",
                c.lib.cudaLibraryGetKernel(k, lib_p[0], name) if rc == 0 else -1)
    if rc == 0 and krc == 0:
        _launch(c, k[0], s, f"launch ({label})", argv=argv)
        _sync(c, s, f"cudaStreamSynchronize ({label})")
    else:
        c.rec(f"launch ({label})", -1)
        c.rec(f"cudaStreamSynchronize ({label})", -1)
    c.last_error()
    c.rec(f"cudaLibraryUnload({label})", c.lib.cudaLibraryUnload(lib_p[0]) if rc == 0 else -1)


def _library_bad_images(c: Calls, containers: bool = False):
    s = c.stream()
    for label, image in _bad_images():
        _library_image(c, s, label, image)
    lib_p = c.ffi.new("cudaLibrary_t *")
    rc = c.rec("cudaLibraryLoadData", c.lib.cudaLibraryLoadData(lib_p, _PTX, c.ffi.NULL, c.ffi.NULL, 0, c.ffi.NULL,
                                                               c.ffi.NULL, 0))
    k = c.ffi.new("cudaKernel_t *")
    c.rec("cudaLibraryGetKernel(unknown name)",
          c.lib.cudaLibraryGetKernel(k, lib_p[0], b"no_such_kernel") if rc == 0 else -1)
    c.last_error()
    if containers:
        argv, _keep = _store_state_args(c, c.malloc(256))
        for label, image in _bad_containers():
            _library_image(c, s, label, image, b"accel_philox_store_state", argv)


# CUDA_MODULE_LOADING unset: lazy loading, the default since CUDA 12.2 (recorded on the H100 on
# 2026-12-05: every load 0, the errors from cudaLibraryGetKernel; accel/sim/cudart/modules.py).
@scenario
@with_env(CUDA_MODULE_LOADING=None)
def library_bad_images(c: Calls):
    _library_bad_images(c)


# The same images loaded eagerly, then two containers the device cannot run (not yet recorded:
# the simulator checks every image at load here, with its codes from before lazy loading).
@scenario
@with_env(CUDA_MODULE_LOADING="EAGER")
def library_bad_images_eager(c: Calls):
    _library_bad_images(c, containers=True)


# The two containers loaded lazily (not yet recorded).
@scenario
@with_env(CUDA_MODULE_LOADING=None)
def library_bad_containers(c: Calls):
    s = c.stream()
    argv, _keep = _store_state_args(c, c.malloc(256))
    for label, image in _bad_containers():
        _library_image(c, s, label, image, b"accel_philox_store_state", argv)


def _driver_bad_images(c: Calls):
    """library_bad_images and its containers through the driver's cuModuleLoadData /
    cuModuleGetFunction / cuLaunchKernel / cuModuleUnload (cudaGetDriverEntryPoint), each
    followed by cudaGetLastError (driver calls are expected to leave it alone)."""
    from accel.backends.cuda.driver import DriverKernels
    c.rec("cudaFree(NULL) (starts the runtime)", c.lib.cudaFree(c.ffi.NULL))
    drv = DriverKernels(c.ffi, c.lib)
    s = c.stream()
    store_argv, _keep = _store_state_args(c, c.malloc(256))
    nop_argv = c.ffi.new("void *[]", [c.ffi.NULL])
    work = [(label, image, "accel_conformance_nop", nop_argv) for label, image in _bad_images()]
    work += [(label, image, "accel_philox_store_state", store_argv) for label, image in _bad_containers()]
    for label, image, name, argv in work:
        m, rc = drv.load(c.ffi.new("char[]", image))
        c.rec(f"cuModuleLoadData({label})", rc)
        c.last_error()
        f, frc = drv.function(m, name) if rc == 0 else (0, -1)
        c.rec(f"cuModuleGetFunction({label})", frc)
        if rc == 0 and frc == 0:
            c.rec(f"cuLaunchKernel({label})", drv.launch(f, (1, 1, 1), (32, 1, 1), argv, 0,
                                                         int(c.ffi.cast("uintptr_t", s))))
            _sync(c, s, f"cudaStreamSynchronize ({label})")
        else:
            c.rec(f"cuLaunchKernel({label})", -1)
            c.rec(f"cudaStreamSynchronize ({label})", -1)
        c.last_error()
        c.rec(f"cuModuleUnload({label})", drv.unload(m) if rc == 0 else -1)
    m, rc = drv.load(c.ffi.new("char[]", _PTX))
    c.rec("cuModuleLoadData", rc)
    c.rec("cuModuleGetFunction(unknown name)", drv.function(m, "no_such_kernel")[1] if rc == 0 else -1)
    c.last_error()
    c.rec("cuModuleUnload", drv.unload(m) if rc == 0 else -1)


# library_bad_images' twins through the driver API, lazily (the default) and eagerly (not yet
# recorded; the H100 refused PTX .target sm_100 at cuModuleLoadData with the default loading,
# scenario driver_module_calls_in_capture, so the simulator checks every image at load).
@scenario
@with_env(CUDA_MODULE_LOADING=None)
def driver_module_bad_images(c: Calls):
    _driver_bad_images(c)


@scenario
@with_env(CUDA_MODULE_LOADING="EAGER")
def driver_module_bad_images_eager(c: Calls):
    _driver_bad_images(c)


@scenario
def driver_entry_points(c: Calls):
    c.rec("cudaFree(NULL) (starts the runtime)", c.lib.cudaFree(c.ffi.NULL))
    fp = c.ffi.new("void **")
    st = c.ffi.new("enum cudaDriverEntryPointQueryResult *")
    rc = c.rec("cudaGetDriverEntryPoint(cuNoSuchFunction)",
               c.lib.cudaGetDriverEntryPoint(b"cuNoSuchFunction", fp, 0, st))
    c.steps.append(["cuNoSuchFunction status", int(st[0]) if rc == 0 else -1])
    c.seen("cuNoSuchFunction gave NULL", fp[0] == c.ffi.NULL)
    c.rec("cudaGetDriverEntryPoint(cuGetErrorName, flags 8)",
          c.lib.cudaGetDriverEntryPoint(b"cuGetErrorName", fp, 8, st))
    c.last_error()
    for version in (10020, 10010, 12000, 99000):
        fp[0] = c.ffi.NULL
        rc = c.rec(f"cudaGetDriverEntryPointByVersion(cuMemCreate, {version})",
                   c.lib.cudaGetDriverEntryPointByVersion(b"cuMemCreate", fp, version, 0, st))
        c.steps.append([f"cuMemCreate at {version} status", int(st[0]) if rc == 0 else -1])
        c.seen(f"cuMemCreate at {version} gave a function", fp[0] != c.ffi.NULL)
    c.last_error()


@scenario
def driver_module_calls_in_capture(c: Calls):
    from accel.backends.cuda.driver import DriverKernels
    c.rec("cudaFree(NULL) (starts the runtime)", c.lib.cudaFree(c.ffi.NULL))
    drv = DriverKernels(c.ffi, c.lib)
    image = c.ffi.new("char[]", _PTX)
    bad = c.ffi.new("char[]", _ptx(version="8.8", target="sm_100"))
    m1, rc1 = drv.load(image)
    c.rec("cuModuleLoadData before capture", rc1)
    _, rc = drv.load(bad)
    c.rec("cuModuleLoadData(PTX .target sm_100)", rc)
    s = c.stream()
    ptr = c.malloc()
    c.begin(s)
    c.memset(ptr, s)
    m2, rc2 = drv.load(image)
    c.rec("cuModuleLoadData during capture", rc2)
    c.status(s, label="cudaStreamIsCapturing after load")
    c.rec("cuModuleUnload during capture", drv.unload(m1) if rc1 == 0 else -1)
    c.status(s, label="cudaStreamIsCapturing after unload")
    c.end(s)
    c.last_error()
    c.rec("cuModuleUnload after the capture", drv.unload(m2) if rc2 == 0 else -1)


# virtual memory: flags, locations, sub-ranges, accounting, copy kinds
@scenario
def vmm_flags_locations_and_kinds(c: Calls):
    v, g = _vmm(c)
    c.seen("granularity is 2 MiB", g == 2 << 20)
    out = v.dffi.new("CUdeviceptr_v2 *")
    c.rec("cuMemAddressReserve(flags 1)", v.fns["cuMemAddressReserve"](out, 2 * g, 0, 0, 1))
    h = v.dffi.new("CUmemGenericAllocationHandle_v1 *")
    c.rec("cuMemCreate(flags 1)", v.fns["cuMemCreate"](h, g, v._prop(0), 1))
    c.rec("cuMemCreate(device 99)", v.fns["cuMemCreate"](h, g, v._prop(99), 0))
    prop = v._prop(0)
    prop.type = 0
    c.rec("cuMemCreate(allocation type 0)", v.fns["cuMemCreate"](h, g, prop, 0))
    free0, _ = _mem_info(c, "cudaMemGetInfo before cuMemCreate")
    va, rc = v.reserve(4 * g)
    c.rec("cuMemAddressReserve", rc)
    hd, rc = v.create(0, 2 * g)
    c.rec("cuMemCreate(2 granules)", rc)
    free1, _ = _mem_info(c, "cudaMemGetInfo after cuMemCreate")
    c.seen("free memory dropped by 2 granules", free0 - free1 >= 2 * g)
    c.rec("cuMemMap(flags 1)", v.fns["cuMemMap"](va, 2 * g, 0, hd, 1))
    c.rec("cuMemMap", v.map(va, 2 * g, hd))
    c.rec("cuMemSetAccess(half of the mapping)", v.set_access(va, g, 0))
    c.rec("cuMemSetAccess(mapping and an unmapped granule)", v.set_access(va, 3 * g, 0))
    c.rec("cuMemSetAccess", v.set_access(va, 2 * g, 0))
    s = c.stream()
    host = c.host_alloc()
    vp = c.ffi.cast("void *", va)
    for label, dst, src, kind in (("mapped <- pinned, HostToDevice", vp, host, 1),
                                  ("pinned <- mapped, DeviceToHost", host, vp, 2),
                                  ("mapped <- pinned, DeviceToHost", vp, host, 2),
                                  ("pinned <- mapped, HostToDevice", host, vp, 1)):
        c.rec(f"cudaMemcpyAsync({label})", c.lib.cudaMemcpyAsync(dst, src, 4096, kind, s))
    _sync(c, s)
    c.last_error()
    c.rec("cuMemUnmap", v.unmap(va, 2 * g))
    c.rec("cuMemRelease", v.release(hd))
    c.rec("cuMemAddressFree", v.free(va, 4 * g))


# -- a kernel's own launch limits: PTX .maxntid / .reqntid and static .shared (r65e) ---------------------
# PTX ISA 11.4.2/11.4.3 say only "a runtime error or kernel launch failure": no code is documented,
# so the simulator's codes (accel/sim/cudart/modules.py) wait for this scenario's GPU record.
_BOUNDS_PTX = b"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry accel_conformance_max256() .maxntid 256 { ret; }
.visible .entry accel_conformance_req3d() .reqntid 4, 4, 2 { ret; }
.visible .entry accel_conformance_static()
{
    .reg .b32 %r<2>;
    .shared .align 16 .b8 tile[40960];
    ld.shared.u32 %r1, [tile];
    ret;
}
\0"""
_BOUNDS_BOTH = (b".version 8.0\n.target sm_90\n.address_size 64\n"
                b".visible .entry accel_conformance_both() .maxntid 64 .reqntid 64 { ret; }\n\0")
_BOUNDS_BIG = (b".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry accel_conformance_big()\n{\n"
               b" .reg .b32 %r<2>;\n .shared .align 16 .b8 tile[49168];\n ld.shared.u32 %r1, [tile];\n ret;\n}\n\0")
_BOUNDS_NAMES = ("accel_conformance_max256", "accel_conformance_req3d", "accel_conformance_static",
                 "accel_conformance_both", "accel_conformance_big")


def _bounds_kernel(c: Calls, image: bytes, name: str):
    lib_p, k = c.ffi.new("cudaLibrary_t *"), c.ffi.new("cudaKernel_t *")
    short = name[len("accel_conformance_"):]
    rc = c.rec(f"cudaLibraryLoadData({short})", c.lib.cudaLibraryLoadData(
        lib_p, image, c.ffi.NULL, c.ffi.NULL, 0, c.ffi.NULL, c.ffi.NULL, 0))
    krc = c.rec(f"cudaLibraryGetKernel({short})",
                c.lib.cudaLibraryGetKernel(k, lib_p[0], name.encode()) if rc == 0 else -1)
    c.last_error()
    return k[0] if krc == 0 else None


@scenario
def kernel_launch_bounds(c: Calls):
    s = c.stream()
    ks = {name: _bounds_kernel(c, _BOUNDS_PTX, name) for name in _BOUNDS_NAMES[:3]}
    _bounds_kernel(c, _BOUNDS_BOTH, _BOUNDS_NAMES[3])
    _bounds_kernel(c, _BOUNDS_BIG, _BOUNDS_NAMES[4])
    a = c.ffi.new("struct cudaFuncAttributes *")
    for name, k in ks.items():
        if k is not None and c.lib.cudaFuncGetAttributes(a, c.ffi.cast("void *", k)) == 0:
            for field in ("maxThreadsPerBlock", "sharedSizeBytes", "maxDynamicSharedSizeBytes"):
                c.seen(f"{name[len('accel_conformance_'):]}.{field}", getattr(a, field))
    k = ks["accel_conformance_max256"]
    if k is not None:
        for block in ((256, 1, 1), (257, 1, 1), (16, 17, 1)):
            _launch(c, k, s, f"launch max256 block {block}", block=block)
            c.last_error()
        n = c.ffi.new("int *")
        c.rec("occupancy(max256, block 512)", c.lib.cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            n, c.ffi.cast("void *", k), 512, 0))
        c.seen("blocks per SM (max256, block 512)", n[0])
        c.last_error()
    k = ks["accel_conformance_req3d"]
    if k is not None:
        for block in ((4, 4, 2), (2, 4, 4), (4, 4, 1), (64, 1, 1)):
            _launch(c, k, s, f"launch req3d block {block}", block=block)
            c.last_error()
    k = ks["accel_conformance_static"]
    if k is not None:
        f = c.ffi.cast("void *", k)
        _launch(c, k, s, "launch static 40 KiB + dynamic 8 KiB", shared=8192)
        _launch(c, k, s, "launch static 40 KiB + dynamic 8 KiB + 1", shared=8193)
        c.last_error()
        c.rec("cudaFuncSetAttribute(static, max dynamic 227 KiB - 40 KiB + 1)",
              c.lib.cudaFuncSetAttribute(f, 8, 227 * 1024 - 40960 + 1))
        c.last_error()
        c.rec("cudaFuncSetAttribute(static, max dynamic 227 KiB - 40 KiB)",
              c.lib.cudaFuncSetAttribute(f, 8, 227 * 1024 - 40960))
        _launch(c, k, s, "launch static 40 KiB + dynamic 187 KiB after the attribute", shared=227 * 1024 - 40960)
        c.rec("cudaFuncSetAttribute(static, max dynamic 1000)", c.lib.cudaFuncSetAttribute(f, 8, 1000))
        _launch(c, k, s, "launch static + dynamic 1001, attribute 1000", shared=1001)
        c.last_error()
    _sync(c, s)
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
    from accel.backends.cuda.runtime import _cudart_ffi_for
    sim.register_kernel("accel_conformance_nop", _nop, "", replace=True)
    for name in _BOUNDS_NAMES:
        sim.register_kernel(name, _nop, "", replace=True)
    lib = sim.open_library("cudart")
    return _cudart_ffi_for(lib), lib


def _set_env(env: dict) -> None:
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def run_one(name: str, real: bool, echo: bool = False) -> dict:
    fn = SCENARIOS[name]
    env = getattr(fn, "env", {})
    saved = {key: os.environ.get(key) for key in env}
    _set_env(env)       # before the runtime is opened (each scenario of a run is a fresh process)
    try:
        ffi, lib = _open(real)
        c = Calls(ffi, lib, echo)
        try:
            fn(c)
            return {"steps": c.steps}
        except Exception as exc:  # noqa: BLE001 - recorded: the scenario itself broke
            return {"steps": c.steps, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        _set_env(saved)


def _run_in_process(name: str, real: bool, env: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", name] + (["--real"] if real else [])
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return dict(_steps_made(out), error=f"hung: killed after {timeout:.0f} s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@result ")]
    if not lines:
        # The process died (a real runtime may crash on a call): the steps it printed say where.
        return dict(_steps_made(proc.stdout), error=f"exit {proc.returncode} without a result",
                    stderr=proc.stderr[-2000:])
    return json.loads(lines[-1][len("@result "):])


def _steps_made(stdout: str) -> dict:
    steps = [json.loads(ln[len("@step "):]) for ln in stdout.splitlines() if ln.startswith("@step ")]
    return {"steps": steps, "died_after": steps[-1][0] if steps else None}


def run_all(real: bool, only: List[str], timeout: float = 60, jobs: int = 1,
            on_result: Callable[[dict], None] = None) -> dict:
    """Each scenario in its own process, ``jobs`` at a time; ``on_result(results so far)`` after
    each one, so that a run stopped from outside (a lease ending) keeps what it recorded."""
    from concurrent.futures import ThreadPoolExecutor
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    names = list(only or SCENARIOS)
    done = {}
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        futures = [(name, pool.submit(_run_in_process, name, real, env, timeout)) for name in names]
        for name, future in futures:
            done[name] = future.result()
            if on_result is not None:
                on_result(done)
    return done


def _meta(real: bool) -> dict:
    """Where a run was recorded: the device, driver and runtime versions as libcudart reports them."""
    meta = {"recorded": __import__("datetime").date.today().isoformat(),
            "command": "python tools/cuda_conformance.py " + " ".join(sys.argv[1:])}
    if not real:
        return meta
    try:
        ffi, lib = _open(True)
        version = ffi.new("int *")
        if lib.cudaDriverGetVersion(version) == 0:
            meta["driver_cuda_version"] = version[0]
        if lib.cudaRuntimeGetVersion(version) == 0:
            meta["runtime_version"] = version[0]
        count = ffi.new("int *")
        if lib.cudaGetDeviceCount(count) == 0 and count[0] > 0:
            prop = ffi.new("struct cudaDeviceProp *")
            if lib.cudaGetDeviceProperties(prop, 0) == 0:
                meta["device"] = (f"{ffi.string(prop.name).decode()} (cc {prop.major}.{prop.minor}, "
                                  f"{count[0]} GPU)")
    except Exception as exc:  # noqa: BLE001 - the meta is informative; the scenarios say what broke
        meta["meta_error"] = f"{type(exc).__name__}: {exc}"
    return meta


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
            yes_no = la.startswith("next ") or la.endswith(" status") or la.endswith("?")
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
    parser.add_argument("--jobs", type=int, default=1, help="scenarios run at once (each in its own process)")
    parser.add_argument("--timeout", type=float, default=60, help="seconds before a scenario counts as hung")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print("@result " + json.dumps(run_one(args.one, args.real, echo=True)), flush=True)
        return 0
    only = [n for n in SCENARIOS if any(n.startswith(p) for p in args.only.split(",") if p)] if args.only else []
    meta = _meta(args.real) if args.json else {}

    def write(results):
        tmp = args.json + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"_meta": meta, **results}, fh, indent=1)
        os.replace(tmp, args.json)

    results = run_all(args.real, only, timeout=args.timeout, jobs=args.jobs,
                      on_result=write if args.json else None)
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
