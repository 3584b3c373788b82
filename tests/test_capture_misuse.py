"""Every public function called while a stream capture is underway (task r19).

One row per public callable (accel.__all__, accel.memory, accel.random, the methods of Buffer,
Stream, Event, Graph, MemPool, Module and Kernel, empty_pinned and the host allocator's
functions).  Each row is called with valid arguments while a graph captures on device 0, in
every capture_error_mode, from the capturing thread and from another thread, aimed at the
capturing device and at the other one, and must either

* work: the capture then ends, and its replay plus the call's own effect give what the same
  call gives with no capture (the eager run), or
* raise a clear exception that names the capture, leaving accel's state as it was.

The capture afterwards is either still valid, or was invalidated only where CUDA invalidates
it (CUDA Runtime API, cudaStreamBeginCapture / cudaThreadExchangeStreamCaptureMode: a
"potentially unsafe" call -- sync, query, cudaMalloc/Free, blocking copies -- made by the
capturing thread in global or thread_local mode, or by any thread while a global capture is
underway; CUDA Programming Guide, "Prohibited and Unhandled Operations"), and accel then says
so (:class:`accel.CaptureError`, and capture_end reports cudaErrorStreamCaptureInvalidated).
Either way no capture is left underway, no accel lock is held, memory statistics agree with
the allocator's segments, and the next correct capture works.

``test_every_public_callable_has_a_row`` fails when a public function is added without a row.
Waiting on streams and events inside ``with g:`` is covered by test_graphs_adversarial.py;
the simulator's raw capture rules by test_cuda_strict2.py / test_sim_cuda_strict.py.
"""

import gc
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import pytest

import accel
from accel import Graph, sim

from test_user_kernels import SAXPY_CU, SAXPY_PTX, saxpy_reference, spirv_module

MODES = ("global", "thread_local", "relaxed")
WHERE = ("capturing thread", "other thread")
N = 256          # bytes of each test buffer
HANG_S = 120     # a call that has not returned by then is reported as a wedge (not a timing assert)

# each case collects a few times: scan only what this module made (conftest.frozen_module_heap)
pytestmark = pytest.mark.usefixtures("frozen_module_heap")


# -- the context each row works on ------------------------------------------------------------
class Ctx:
    """Objects on both devices, made before the capture begins: a side stream, buffers with
    known contents, events, a MemPool, a generator, a kernel, a graph captured earlier."""

    def __init__(self, kind: str):
        self.kind = kind
        self.devs = (0, 1)
        self.side = [accel.Stream(d) for d in self.devs]
        self.src = [accel.Buffer(N, device=d) for d in self.devs]
        self.dst = [accel.Buffer(N, device=d) for d in self.devs]
        self.fbuf = [accel.Buffer(N, device=d) for d in self.devs]     # float32 for kernels and RNG
        self.spare = [accel.Buffer(N, device=d) for d in self.devs]    # closed by rows
        self.spare2 = [accel.Buffer(N, device=d) for d in self.devs]
        for d in self.devs:
            self.src[d].copy_from(np.arange(N, dtype=np.uint8) + d)
            self.dst[d].fill_(0)
            self.fbuf[d].copy_from(np.ones(N // 4, np.float32))
        self.host = np.zeros(N, np.uint8)
        self.pinned = accel.empty_pinned(N)
        self.pinned[:] = 7
        self.pinned_out = accel.empty_pinned(N)
        self.pinned_out[:] = 0
        self.ev = [accel.Event(d) for d in self.devs]
        self.tev = [(accel.Event(d, enable_timing=True), accel.Event(d, enable_timing=True)) for d in self.devs]
        self.spare_ev = [accel.Event(d) for d in self.devs]
        self.spare_stream = [accel.Stream(d) for d in self.devs]
        for d in self.devs:
            self.ev[d].record(self.side[d])
            self.tev[d][0].record(self.side[d])
            self.tev[d][1].record(self.side[d])
        self.pool = []
        for d in self.devs:
            with accel.device_index(d):
                self.pool.append(accel.MemPool())
        self.gen = [accel.random.Generator(d, seed=5) for d in self.devs]
        self.state = [accel.random.get_rng_state(d) for d in self.devs]
        self.fraction = [accel.memory.get_per_process_memory_fraction(d) for d in self.devs]
        if kind == "cuda":
            self.image = SAXPY_PTX
            self.sig = None
        else:
            self.image = spirv_module("saxpy")
            self.sig = "f32, ptr, ptr, u64"
        self.module = [accel.Module(self.image, device=d) for d in self.devs]
        self.spare_module = [accel.Module(self.image, device=d) for d in self.devs]
        self.kernel = [m.function("saxpy", self.sig) for m in self.module]
        # a graph captured before, on each device (replayed, reset, dumped by rows)
        self.graph = []
        for d in self.devs:
            g = Graph(keep_graph=True)
            g.enable_debug_mode()
            with self.side[d], g:
                self.dst[d].fill_(3, self.side[d])
            self.graph.append(g)
        self.made = []     # objects rows create, closed by close()
        accel.synchronize(0)
        accel.synchronize(1)

    def keep(self, obj):
        self.made.append(obj)
        return obj

    def close(self) -> None:
        accel.synchronize(0)
        accel.synchronize(1)
        for obj in reversed(self.made):
            if hasattr(obj, "reset"):
                obj.reset()
            elif hasattr(obj, "close"):
                obj.close()
        for g in self.graph:
            g.reset()
        for group in (self.src, self.dst, self.fbuf, self.spare, self.spare2, self.module, self.spare_module,
                      self.ev, self.spare_ev, [e for pair in self.tev for e in pair], self.spare_stream,
                      self.side):
            for obj in group:
                obj.close()
        self.pinned = self.pinned_out = None
        self.made = self.pool = self.gen = self.kernel = self.graph = None


def _always(kind, mode, where, d):
    return True


def _on_capturing_device(kind, mode, where, d):
    return d == 0


def _xpu(kind, mode, where, d):
    return kind == "xpu"


def _barrier_on_capturing_stream(kind, mode, where, d):
    """A copy into device d's buffer from the other device's: its barrier makes d's current
    (legacy) stream wait for the source device's current stream, the capturing one in the
    capturing thread (ATen copy_device_to_device; CUDA refuses: cudaErrorStreamCaptureImplicit)."""
    return where == "capturing thread" and d == 1


def _on_capturing_stream(kind, mode, where, d):
    return where == "capturing thread" and d == 0


# -- rows -------------------------------------------------------------------------------------
@dataclass
class Row:
    """``call(ctx, d)`` uses the public callable with valid arguments aimed at device ``d``.

    unsafe: CUDA's "potentially unsafe" call (or one accel makes one underneath): it may be
        refused with CaptureError and the capture invalidated where CUDA restricts the thread.
        True, or the backends (kinds) where it is.
    device: the call takes a device, so it runs aimed at the capturing and the other device.
    observe(ctx, d): device state compared between the eager run and the captured replay.
    changes: the call is meant to change process state (seed, fraction...): no unchanged check.
    own: the call acts on the capturing graph itself (``ctx.g``), not on objects of device d.
    captured: from the capturing thread, aimed at the capturing device, the call's work goes to
        the capturing stream and is captured: it must work in every mode, as stream work does.
        True, or the backends where it is.
    invalid(kind, mode, where, d): where CUDA refuses the call in every mode and invalidates the
        capture: synchronizing a device with a stream in capture (CUDA Programming Guide,
        "Prohibited and Unhandled Operations": "It is also invalid to query the execution status
        of or synchronize a broader handle which encompasses an active stream capture, such as a
        device or context handle"), or a capturing stream waiting on uncaptured work ("Cross-stream
        Dependencies and Events": cudaErrorStreamCaptureIsolation).
    """
    call: Callable[[Any, int], Any]
    unsafe: Any = False
    device: bool = True
    observe: Optional[Callable[[Any, int], Any]] = None
    changes: bool = False
    own: bool = False
    captured: Any = False
    invalid: Optional[Callable[[str, str, str, int], bool]] = None


def _dst(ctx, d):
    return ctx.dst[d].to_numpy().tobytes()


def _fbuf(ctx, d):
    return ctx.fbuf[d].to_numpy("float32").tobytes()


def _restore_device(fn):
    def call(ctx, d):
        prev = accel.current_device_index()
        try:
            return fn(ctx, d)
        finally:
            accel.set_device_index(prev)
    return call


def _set_stream(ctx, d):
    prev_dev = accel.current_device_index()
    prev = accel.current_stream(d)
    accel.set_stream(ctx.side[d])
    accel.set_stream(prev)
    accel.set_device_index(prev_dev)


def _graph_fn(ctx, d):
    g = ctx.keep(Graph())
    with accel.graph(g, stream=ctx.side[d]):
        ctx.dst[d].fill_(4, ctx.side[d])
    g.replay()


def _capture_other(ctx, d):
    g = ctx.keep(Graph())
    with ctx.side[d]:
        g.capture_begin()
        try:
            ctx.dst[d].fill_(6, ctx.side[d])
        finally:
            g.capture_end()
        g.replay()


def _register_state(ctx, d):
    g = ctx.keep(Graph())
    g.register_generator_state(accel.random.Generator(d))


def _graph_enter(ctx, d):
    g = ctx.keep(Graph())
    with ctx.side[d]:
        g.__enter__()
        try:
            ctx.dst[d].fill_(8, ctx.side[d])
        finally:
            g.__exit__(None, None, None)
        g.replay()


def _use_mem_pool(ctx, d):
    with accel.use_mem_pool(ctx.pool[d], d):
        b = accel.Buffer(N, device=d)
        b.close()


def _record_history(ctx, d):
    accel.memory.record_history(True)
    accel.memory.record_history(None)


def _fraction(ctx, d):
    accel.memory.set_per_process_memory_fraction(0.9, d)
    accel.memory.set_per_process_memory_fraction(ctx.fraction[d], d)


def _allocator_settings(ctx, d):
    before = accel.memory.get_allocator_settings()
    accel.memory.set_allocator_settings("garbage_collection_threshold:0.7")
    accel.memory.set_allocator_settings(before)


def _oom_observer(ctx, d):
    def observer(*args):
        pass
    accel.memory.attach_out_of_memory_observer(observer)
    accel.memory.detach_out_of_memory_observer(observer)


def _register_kernel_source(ctx, d):
    from accel.random import _device
    accel.random.register_kernel_source("r19-none", lambda: b"")
    try:
        accel.random.uniform_(ctx.fbuf[d])
    finally:
        _device._SOURCES.pop("r19-none", None)


def _drop_pinned(ctx, d):
    ctx.pinned_out = None
    gc.collect()


def _launch(ctx, d):
    accel.launch(ctx.kernel[d], 1, 64, 2.0, ctx.fbuf[d], ctx.fbuf[d], 64)


def _debug_dump(ctx, d):
    import os
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "g.dot")
        ctx.graph[d].debug_dump(path)
        assert os.path.getsize(path) > 0


def _dump_snapshot(ctx, d):
    import os
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        accel.memory.dump_snapshot(os.path.join(tmp, "s.pickle"))


ROWS = {
    # accel
    "accel.Buffer": Row(lambda c, d: c.keep(accel.Buffer(4096, device=d))),
    "accel.Event": Row(lambda c, d: c.keep(accel.Event(d))),
    "accel.ExternalStream": Row(lambda c, d: accel.ExternalStream(c.side[d].handle, d)),
    "accel.get_stream_from_external": Row(lambda c, d: accel.get_stream_from_external(c.side[d].handle, d)),
    "accel.Graph": Row(lambda c, d: Graph(), device=False),
    "accel.Stream": Row(lambda c, d: c.keep(accel.Stream(d))),
    "accel.ArrayView": Row(lambda c, d: accel.ArrayView(c.src[d], np.uint8)),
    "accel.current_accelerator": Row(lambda c, d: accel.current_accelerator(True), device=False),
    "accel.current_device_idx": Row(lambda c, d: accel.current_device_idx(), device=False),
    "accel.current_device_index": Row(lambda c, d: accel.current_device_index(), device=False),
    "accel.current_stream": Row(lambda c, d: accel.current_stream(d)),
    "accel.default_stream": Row(lambda c, d: accel.default_stream(d)),
    "accel.device": Row(lambda c, d: accel.device(c.kind, d)),
    "accel.device_count": Row(lambda c, d: accel.device_count(), device=False),
    "accel.device_index": Row(_restore_device(lambda c, d: accel.device_index(d).__enter__())),
    "accel.empty_pinned": Row(lambda c, d: accel.empty_pinned(N), unsafe=True, device=False),
    "accel.get_device_capability": Row(lambda c, d: accel.get_device_capability(d)),
    "accel.get_device_properties": Row(lambda c, d: accel.get_device_properties(d)),
    "accel.graph": Row(_graph_fn, unsafe=True, observe=_dst, invalid=_always),
    "accel.is_available": Row(lambda c, d: accel.is_available(), device=False),
    "accel.is_current_stream_capturing": Row(lambda c, d: accel.is_current_stream_capturing(), device=False),
    "accel.is_initialized": Row(lambda c, d: accel.is_initialized(), device=False),
    "accel.set_device_idx": Row(_restore_device(lambda c, d: accel.set_device_idx(d))),
    "accel.set_device_index": Row(_restore_device(lambda c, d: accel.set_device_index(d))),
    "accel.set_stream": Row(_set_stream),
    "accel.synchronize": Row(lambda c, d: accel.synchronize(d), unsafe=True, invalid=_on_capturing_device),
    "accel.from_dlpack": Row(lambda c, d: accel.from_dlpack(c.src[d]), invalid=_on_capturing_stream, unsafe=("xpu",)),
    "accel.can_device_access_peer": Row(lambda c, d: accel.can_device_access_peer(d, 1 - d)),
    "accel.clock_rate": Row(lambda c, d: accel.clock_rate(d)),
    "accel.device_memory_used": Row(lambda c, d: accel.device_memory_used(d)),
    "accel.list_gpu_processes": Row(lambda c, d: accel.list_gpu_processes(d)),
    "accel.memory_usage": Row(lambda c, d: accel.memory_usage(d)),
    "accel.power_draw": Row(lambda c, d: accel.power_draw(d)),
    "accel.temperature": Row(lambda c, d: accel.temperature(d)),
    "accel.utilization": Row(lambda c, d: accel.utilization(d)),
    "accel.empty_cache": Row(lambda c, d: accel.empty_cache(), unsafe=True, device=False),
    "accel.empty_host_cache": Row(lambda c, d: accel.empty_host_cache(), unsafe=True, device=False),
    "accel.get_memory_info": Row(lambda c, d: accel.get_memory_info(d)),
    "accel.max_memory_allocated": Row(lambda c, d: accel.max_memory_allocated(d)),
    "accel.max_memory_reserved": Row(lambda c, d: accel.max_memory_reserved(d)),
    "accel.memory_allocated": Row(lambda c, d: accel.memory_allocated(d)),
    "accel.memory_reserved": Row(lambda c, d: accel.memory_reserved(d)),
    "accel.memory_stats": Row(lambda c, d: accel.memory_stats(d)),
    "accel.reset_accumulated_memory_stats": Row(lambda c, d: accel.reset_accumulated_memory_stats(d)),
    "accel.reset_peak_memory_stats": Row(lambda c, d: accel.reset_peak_memory_stats(d)),
    "accel.MemPool": Row(_restore_device(lambda c, d: (accel.set_device_index(d), accel.MemPool()))),
    "accel.use_mem_pool": Row(_use_mem_pool),
    "accel.compile": Row(lambda c, d: accel.compile(SAXPY_CU), device=False),
    "accel.Module": Row(lambda c, d: c.keep(accel.Module(c.image, device=d))),
    "accel.launch": Row(_launch, observe=_fbuf, captured=True),
    # accel.memory
    "accel.memory.device_allocator": Row(lambda c, d: accel.memory.device_allocator(d)),
    "accel.memory.host_allocator": Row(lambda c, d: accel.memory.host_allocator(), device=False),
    "accel.memory.memory_summary": Row(lambda c, d: accel.memory.memory_summary(d)),
    "accel.memory.memory_snapshot": Row(lambda c, d: accel.memory.memory_snapshot(), device=False),
    "accel.memory.record_history": Row(_record_history, device=False),
    "accel.memory.dump_snapshot": Row(_dump_snapshot, device=False),
    "accel.memory.set_per_process_memory_fraction": Row(_fraction),
    "accel.memory.get_per_process_memory_fraction": Row(lambda c, d: accel.memory.get_per_process_memory_fraction(d)),
    "accel.memory.set_allocator_settings": Row(_allocator_settings, device=False),
    "accel.memory.get_allocator_settings": Row(lambda c, d: accel.memory.get_allocator_settings(), device=False),
    "accel.memory.attach_out_of_memory_observer": Row(_oom_observer, device=False),
    "accel.memory.detach_out_of_memory_observer": Row(_oom_observer, device=False),
    "accel.memory.host_memory_stats": Row(lambda c, d: accel.memory.host_memory_stats(), device=False),
    "accel.memory.reset_peak_host_memory_stats": Row(lambda c, d: accel.memory.reset_peak_host_memory_stats(),
                                                     device=False),
    "accel.memory.reset_accumulated_host_memory_stats": Row(
        lambda c, d: accel.memory.reset_accumulated_host_memory_stats(), device=False),
    "empty_pinned (an array dropped)": Row(_drop_pinned, unsafe=True, device=False),
    # accel.random
    "accel.random.Generator": Row(lambda c, d: accel.random.Generator(d)),
    "accel.random.default_generator": Row(lambda c, d: accel.random.default_generator(d)),
    "accel.random.initial_seed": Row(lambda c, d: accel.random.initial_seed(d)),
    "accel.random.get_rng_state": Row(lambda c, d: accel.random.get_rng_state(d)),
    "accel.random.set_rng_state": Row(lambda c, d: accel.random.set_rng_state(c.state[d], d), changes=True),
    "accel.random.get_rng_state_all": Row(lambda c, d: accel.random.get_rng_state_all(), device=False),
    "accel.random.set_rng_state_all": Row(lambda c, d: accel.random.set_rng_state_all(c.state), device=False,
                                          changes=True),
    "accel.random.manual_seed": Row(_restore_device(lambda c, d: (accel.set_device_index(d),
                                                                  accel.random.manual_seed(11))), changes=True),
    "accel.random.manual_seed_all": Row(lambda c, d: accel.random.manual_seed_all(11), device=False, changes=True),
    "accel.random.seed": Row(_restore_device(lambda c, d: (accel.set_device_index(d), accel.random.seed())),
                             changes=True),
    "accel.random.seed_all": Row(lambda c, d: accel.random.seed_all(), device=False, changes=True),
    "accel.random.uniform_": Row(lambda c, d: accel.random.uniform_(c.fbuf[d], generator=c.gen[d]), observe=_fbuf),
    "accel.random.normal_": Row(lambda c, d: accel.random.normal_(c.fbuf[d], generator=c.gen[d]), observe=_fbuf),
    "accel.random.randint_": Row(lambda c, d: accel.random.randint_(c.fbuf[d], 0, 9, dtype="int32",
                                                                    generator=c.gen[d]), observe=_fbuf),
    "accel.random.random_raw_": Row(lambda c, d: accel.random.random_raw_(c.fbuf[d], generator=c.gen[d]),
                                    observe=_fbuf),
    "accel.random.uniform_ (default generator)": Row(lambda c, d: accel.random.uniform_(c.fbuf[d]), captured=("cuda",),
                                                     changes=True),
    "accel.random.register_kernel_source": Row(_register_kernel_source, changes=True),
    # Buffer
    "accel.Buffer.from_ptr": Row(lambda c, d: accel.Buffer.from_ptr(c.src[d].ptr, N, d, owner=c.src[d])),
    "accel.Buffer.copy_from": Row(lambda c, d: c.dst[d].copy_from(c.host), unsafe=True, observe=_dst),
    "accel.Buffer.copy_from (pinned, non_blocking)": Row(lambda c, d: c.dst[d].copy_from(c.pinned,
                                                                                         non_blocking=True),
                                                         observe=_dst),
    "accel.Buffer.copy_from (buffer)": Row(lambda c, d: c.dst[d].copy_from(c.src[d]), observe=_dst, captured=True, unsafe=True),
    "accel.Buffer.copy_from (other device's buffer)": Row(lambda c, d: c.dst[d].copy_from(c.src[1 - d]),
                                                          observe=_dst, captured=True, unsafe=True,
                                                          invalid=_barrier_on_capturing_stream),
    "accel.Buffer.copy_to": Row(lambda c, d: c.src[d].copy_to(c.host), unsafe=True),
    "accel.Buffer.copy_to (pinned, non_blocking)": Row(lambda c, d: c.src[d].copy_to(c.pinned_out,
                                                                                     non_blocking=True)),
    "accel.Buffer.to_numpy": Row(lambda c, d: c.src[d].to_numpy(), unsafe=True),
    "accel.Buffer.fill_": Row(lambda c, d: c.dst[d].fill_(5), observe=_dst, captured=True),
    "accel.Buffer.fill_ (side stream)": Row(lambda c, d: c.dst[d].fill_(5, c.side[d]), observe=_dst),
    "accel.Buffer.record_stream": Row(lambda c, d: c.src[d].record_stream(c.side[d])),
    "accel.Buffer.as_array": Row(lambda c, d: c.src[d].as_array(np.uint8)),
    "accel.Buffer.__dlpack__": Row(lambda c, d: c.src[d].__dlpack__(), unsafe=("xpu",)),
    "accel.Buffer.__dlpack_device__": Row(lambda c, d: c.src[d].__dlpack_device__()),
    "accel.Buffer.close": Row(lambda c, d: c.spare[d].close()),
    "accel.Buffer.__enter__": Row(lambda c, d: c.spare2[d].__enter__()),
    "accel.Buffer.__exit__": Row(lambda c, d: c.spare2[d].__exit__(None, None, None)),
    # Stream
    "accel.Stream.from_handle": Row(lambda c, d: accel.Stream.from_handle(c.side[d].handle, d)),
    "accel.Stream.priority_range": Row(lambda c, d: accel.Stream.priority_range(), device=False),
    "accel.Stream.synchronize": Row(lambda c, d: c.side[d].synchronize(), unsafe=True),
    "accel.Stream.query": Row(lambda c, d: c.side[d].query(), unsafe=True),
    "accel.Stream.is_capturing": Row(lambda c, d: c.side[d].is_capturing()),
    "accel.Stream.wait_event": Row(lambda c, d: c.side[d].wait_event(c.ev[d])),
    "accel.Stream.wait_stream": Row(lambda c, d: c.side[d].wait_stream(c.spare_stream[d])),
    "accel.Stream.record_event": Row(lambda c, d: c.side[d].record_event()),
    "accel.Stream.__enter__": Row(lambda c, d: c.side[d].__enter__().__exit__()),
    "accel.Stream.__exit__": Row(lambda c, d: c.side[d].__enter__().__exit__(None, None, None)),
    "accel.Stream.close": Row(lambda c, d: c.spare_stream[d].close()),
    "accel.Stream.synchronize (capturing stream)": Row(lambda c, d: c.cs.synchronize(), unsafe=True, own=True),
    "accel.Stream.query (capturing stream)": Row(lambda c, d: c.cs.query(), unsafe=True, own=True),
    "accel.Stream.close (capturing stream)": Row(lambda c, d: c.cs.close(), own=True),
    "accel.Stream.wait_stream (capturing stream waits)": Row(lambda c, d: c.cs.wait_stream(c.side[d]), invalid=_always),
    "accel.Stream.wait_stream (waits for the capturing stream)": Row(lambda c, d: c.side[d].wait_stream(c.cs), invalid=_xpu),
    # Event
    "accel.Event.record": Row(lambda c, d: c.spare_ev[d].record(c.side[d])),
    "accel.Event.wait": Row(lambda c, d: c.ev[d].wait(c.side[d])),
    "accel.Event.query": Row(lambda c, d: c.ev[d].query(), unsafe=True),
    "accel.Event.synchronize": Row(lambda c, d: c.ev[d].synchronize(), unsafe=True),
    "accel.Event.elapsed_time": Row(lambda c, d: c.tev[d][0].elapsed_time(c.tev[d][1]), unsafe=True),
    "accel.Event.close": Row(lambda c, d: c.spare_ev[d].close()),
    # Graph: a graph captured before, on device d
    "accel.Graph.capture_begin": Row(_capture_other),
    "accel.Graph.capture_end": Row(_capture_other),
    "accel.Graph.register_generator_state": Row(_register_state),
    "accel.Graph.__enter__": Row(_graph_enter, unsafe=True, invalid=_on_capturing_device),
    "accel.Graph.__exit__": Row(_graph_enter, unsafe=True, invalid=_on_capturing_device),
    "accel.Graph.instantiate": Row(lambda c, d: c.graph[d].instantiate()),
    "accel.Graph.raw_cuda_graph": Row(lambda c, d: c.graph[d].raw_cuda_graph()),
    "accel.Graph.raw_graph": Row(lambda c, d: c.graph[d].raw_graph()),
    "accel.Graph.raw_cuda_graph_exec": Row(lambda c, d: c.graph[d].raw_cuda_graph_exec()),
    # refused ahead on the capturing stream: CUDA would invalidate the capture (measured on an H200)
    "accel.Graph.replay": Row(lambda c, d: c.graph[d].replay(), observe=_dst),
    "accel.Graph.reset": Row(lambda c, d: c.graph[d].reset()),
    "accel.Graph.pool": Row(lambda c, d: c.graph[d].pool()),
    "accel.Graph.enable_debug_mode": Row(lambda c, d: Graph().enable_debug_mode()),
    "accel.Graph.debug_dump": Row(_debug_dump),
    # Graph: the capturing graph's own methods
    "accel.Graph.capture_begin (capturing graph)": Row(lambda c, d: c.g.capture_begin(), own=True),
    "accel.Graph.instantiate (capturing graph)": Row(lambda c, d: c.g.instantiate(), own=True),
    "accel.Graph.replay (capturing graph)": Row(lambda c, d: c.g.replay(), own=True),
    "accel.Graph.reset (capturing graph)": Row(lambda c, d: c.g.reset(), own=True),
    "accel.Graph.pool (capturing graph)": Row(lambda c, d: c.g.pool(), own=True),
    "accel.Graph.raw_cuda_graph (capturing graph)": Row(lambda c, d: c.g.raw_cuda_graph(), own=True),
    "accel.Graph.raw_cuda_graph_exec (capturing graph)": Row(lambda c, d: c.g.raw_cuda_graph_exec(), own=True),
    "accel.Graph.debug_dump (capturing graph)": Row(lambda c, d: c.g.debug_dump("/nonexistent/x.dot"), own=True),
    "accel.Graph.enable_debug_mode (capturing graph)": Row(lambda c, d: c.g.enable_debug_mode(), own=True),
    # MemPool, Module, Kernel
    "accel.MemPool.use_count": Row(lambda c, d: c.pool[d].use_count()),
    "accel.MemPool.snapshot": Row(lambda c, d: c.pool[d].snapshot()),
    "accel.Module.function": Row(lambda c, d: c.module[d].function("saxpy", c.sig)),
    "accel.Module.close": Row(lambda c, d: c.spare_module[d].close()),
    "accel.Module.__enter__": Row(lambda c, d: c.spare_module[d].__enter__()),
    "accel.Module.__exit__": Row(lambda c, d: c.spare_module[d].__exit__(None, None, None)),
    "accel.Kernel.max_potential_block_size": Row(lambda c, d: c.kernel[d].max_potential_block_size()),
}

#: Public callables without a row, and why.
EXEMPT = {
    "accel.Kernel": "made by Module.function (its row), not by users",
    "accel.memory.DeviceCachingAllocator": "internal constructor (accel.memory.device_allocator has a row)",
    "accel.memory.HostCachingAllocator": "internal constructor (accel.memory.host_allocator has a row)",
    "accel.random.PhiloxArgs": "a record of numbers returned by Generator.philox_args, no device work",
    "accel.Event.ipc_handle": "always refused (NotImplementedError, no inter-process events), touching nothing",
    "accel.Event.from_ipc_handle": "always refused (NotImplementedError, no inter-process events), touching nothing",
}

_PROTOCOL = ("__enter__", "__exit__", "__dlpack__", "__dlpack_device__")


def _public_callables() -> dict:
    """Qualified name -> object of every public callable the rows must cover."""
    out = {}
    for mod in (accel, accel.memory, accel.random):
        for name in mod.__all__:
            obj = getattr(mod, name)
            if callable(obj) and not (isinstance(obj, type) and issubclass(obj, BaseException)):
                out.setdefault(id(obj), (f"{mod.__name__}.{name}", obj))
    for cls in (accel.Buffer, accel.Stream, accel.Event, Graph, accel.MemPool, accel.Module, accel.Kernel):
        for name, obj in vars(cls).items():
            if (name.startswith("_") and name not in _PROTOCOL) or isinstance(obj, property):
                continue
            if callable(obj) or isinstance(obj, (classmethod, staticmethod)):
                out.setdefault(id(obj), (f"accel.{cls.__name__}.{name}", obj))
    return dict(out.values())


def test_every_public_callable_has_a_row():
    """A public function added without a row here (or a reason in EXEMPT) fails this test."""
    missing = sorted(name for name in _public_callables() if name not in ROWS and name not in EXEMPT)
    assert not missing, f"public callables with no capture-misuse row: {missing}"
    stale = sorted(name for name in EXEMPT if name not in _public_callables())
    assert not stale, stale


# -- checks -----------------------------------------------------------------------------------
def _captures() -> int:
    return vars(sim.state()).get("captures", 0) or 0


def _on(flag, kind: str) -> bool:
    """A row flag: True, False, or the backends it holds on."""
    return flag is True or (isinstance(flag, tuple) and kind in flag)


def _restricted(mode: str, where: str) -> bool:
    """Whether CUDA restricts the calling thread's potentially unsafe calls now (cudaStreamBeginCapture)."""
    if where == "capturing thread":
        return mode != "relaxed"
    return mode == "global"


def _locks_free() -> None:
    """accel's allocator and lazy-init locks can be taken by a fresh thread (none left held)."""
    from accel import _lazy, memory
    locks = [("lazy init", getattr(_lazy, "_lock", None))]
    for d in (0, 1):
        a = memory.device_allocator(d)
        locks.append((f"device allocator {d}", getattr(a, "_lock", None)))
    locks.append(("host allocator", getattr(memory.host_allocator(), "_lock", None)))
    held = []

    def probe():
        for what, lock in locks:
            if lock is None:
                continue
            if lock.acquire(False):
                lock.release()
            else:
                held.append(what)
    t = threading.Thread(target=probe)
    t.start()
    t.join()
    assert not held, f"locks left held: {held}"


def _stats_consistent() -> None:
    """memory_stats agree with the allocator's own segments on each device."""
    for d in (0, 1):
        snap = accel.memory.device_allocator(d).snapshot()
        segs = snap["segments"] if isinstance(snap, dict) else snap
        reserved = sum(s["total_size"] for s in segs)
        active = sum(b["size"] for s in segs for b in s["blocks"] if b["state"] == "active_allocated")
        assert reserved == accel.memory.memory_reserved(d), (d, reserved)
        assert active == accel.memory.memory_allocated(d), (d, active)


def _process_state() -> dict:
    """What a refused call must leave as it was (read outside any capture)."""
    return {"device": accel.current_device_index(),
            "streams": [accel.current_stream(d) for d in (0, 1)],
            "rng": [accel.random.get_rng_state(d).tobytes() for d in (0, 1)],
            "fraction": [accel.memory.get_per_process_memory_fraction(d) for d in (0, 1)]}


def _usable(devices=(0, 1)) -> None:
    """The next correct capture and replay works (on each of ``devices``)."""
    for d in devices:
        s = accel.Stream(d)
        b = accel.Buffer(64, device=d, stream=s)
        g = Graph()
        with s, g:
            b.fill_(3, s)
        g.replay()
        accel.synchronize(d)
        assert (b.to_numpy() == 3).all()
        g.reset()
        b.close()
        s.close()


def _call(row: Row, ctx, d: int, where: str):
    """(returned value, None) or (None, exception) of the row's call, made from ``where``."""
    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return row.call(ctx, d)
    if where != "other thread":
        try:
            return run(), None
        except Exception as exc:
            return None, exc
    out = []

    def body():
        try:
            out.append((run(), None))
        except Exception as exc:
            out.append((None, exc))
    t = threading.Thread(target=body, name="r19-other")
    t.start()
    t.join(HANG_S)
    assert not t.is_alive(), "the call never returned (wedged)"
    return out[0]


_EAGER = {}


def _eager(kind: str, row: Row, d: int):
    """(exception, observed state) of the row's call made with no capture (cached per row)."""
    key = (kind, row_name(row), d)
    if key not in _EAGER:
        _EAGER[key] = _eager_run(kind, row, d)
    return _EAGER[key]


def _eager_run(kind: str, row: Row, d: int):
    ctx = Ctx(kind)
    try:
        ctx.cs, ctx.g = accel.Stream(0), Graph()
        value, err = _call(row, ctx, d, "capturing thread")
        if err is not None:
            # cached for the session (_EAGER): its traceback would keep this backend's frames,
            # and with them its allocator, streams and blocks, for every later test (r66i)
            err.__traceback__ = err.__context__ = err.__cause__ = None
        accel.synchronize(0)
        accel.synchronize(1)
        observed = row.observe(ctx, d) if row.observe and err is None else None
        return err, observed
    finally:
        ctx.cs.close()
        ctx.close()


def _captured(kind: str, row: Row, mode: str, where: str, d: int, eager) -> None:
    base = [accel.memory_allocated(x) for x in (0, 1)]
    ctx = Ctx(kind)
    cs = ctx.cs = accel.Stream(0)
    out = accel.Buffer(64, device=0)
    out2 = accel.Buffer(64, device=0)
    out.fill_(0)
    out2.fill_(0)
    accel.synchronize(0)
    g = ctx.g = Graph(capture_error_mode=mode)
    before = _process_state()
    with cs:
        g.capture_begin()
        out.fill_(1, cs)
        value, err = _call(row, ctx, d, where)
        probe_err = None
        if not cs.closed and cs.is_capturing():
            try:
                out2.fill_(2, cs)
            except accel.CaptureError as exc:
                probe_err = exc
    end_err = None
    if g._stream is not None:
        try:
            with cs:
                g.capture_end()
        except accel.CaptureError as exc:
            end_err = exc
    where_s = f"{row_name(row)} [{mode}, {where}, device {d}]"
    assert not cs.is_capturing() and _captures() == 0, f"{where_s}: a capture was left underway"
    eager_err, eager_obs = eager
    if err is not None:
        assert isinstance(err, Exception) and len(str(err)) > 20, f"{where_s}: unclear error {err!r}"
        if eager_err is None or type(eager_err) is not type(err):
            assert "captur" in str(err).lower(), f"{where_s}: refused during capture without saying why: {err!r}"
    invalidated = end_err is not None
    if _on(row.captured, kind) and where == "capturing thread" and d == 0:
        # or refused up front, the capture kept, saying what to do before the capture (a
        # cross-device copy needing peer access granted: cuMemSetAccess is not capturable)
        refused_ahead = (isinstance(err, accel.CaptureError) and not invalidated
                         and "before the capture" in str(err))
        assert (err is None or refused_ahead) and not invalidated, \
            f"{where_s}: work on the capturing stream was not captured: {err!r} (end: {end_err})"
    if invalidated:
        assert "nvalidated" in str(end_err), f"{where_s}: {end_err!r}"
        assert (_on(row.unsafe, kind) and _restricted(mode, where) or row.own
                or row.invalid is not None and row.invalid(kind, mode, where, d)), \
            f"{where_s}: the capture was invalidated where CUDA keeps it ({err!r}; end: {end_err})"
        assert isinstance(err, accel.CaptureError), \
            f"{where_s}: the capture was invalidated but the call did not say so (it {'raised ' + repr(err) if err else 'returned'})"
    else:
        assert probe_err is None, f"{where_s}: capture refused more work but ended fine: {probe_err!r}"
        if g._exec is not None or g._graph is not None:
            g.replay()
            accel.synchronize(0)
            assert (out.to_numpy() == 1).all(), f"{where_s}: the replay lost the work captured before the call"
            if not cs.closed:
                assert (out2.to_numpy() == 2).all(), f"{where_s}: the replay lost the work captured after the call"
    accel.synchronize(0)
    accel.synchronize(1)
    if row.observe and err is None and eager_err is None:
        got = row.observe(ctx, d)
        assert got == eager_obs, f"{where_s}: captured + replayed result differs from the eager one"
    after = _process_state()
    if err is not None or not row.changes:
        after_cmp = dict(after)
        assert after_cmp == before, f"{where_s}: state changed ({before} -> {after})"
    g.reset()
    out.close()
    out2.close()
    if not cs.closed:
        cs.close()
    ctx.close()
    del ctx, value
    gc.collect()
    accel.synchronize()
    _locks_free()
    _stats_consistent()
    now = [accel.memory_allocated(x) for x in (0, 1)]
    assert now == base, f"{where_s}: memory allocated {base} -> {now}"
    _usable((0, d) if d else (0,))


def row_name(row: Row) -> str:
    for name, r in ROWS.items():
        if r is row:
            return name
    return "?"


@pytest.fixture(scope="module", autouse=True)
def _kernel_reference():
    sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64", replace=True)
    yield
    sim.unregister_kernel("saxpy")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ROWS))
def test_called_during_capture(sim_graph_backend, name, mode):
    row = ROWS[name]
    devices = (0, 1) if row.device and not row.own else (0,)
    for d in devices:
        eager = _eager(sim_graph_backend, row, d)
        for where in WHERE:
            if mode == "thread_local" and where == "capturing thread":
                # The capturing thread is restricted alike in global and thread_local modes (CUDA
                # Programming Guide, cudaStreamCaptureMode): global's case covers it.
                continue
            _captured(sim_graph_backend, row, mode, where, d, eager)
