"""Fault audit (r67d): every acquisition has its release on every path, for the vendor calls
the existing fault sweeps never make fail.

How the existing tests inject vendor failures: ``accel.sim.inject_error(call, code, times,
after)`` makes the simulated function fail (``times=-1``: until ``clear_faults``) and
``inject_oom`` fails an allocation; Metal fails the messages of ``accel.sim.metal.COUNTED``
(nil, or a command buffer in error).  tests/test_fault_sweep.py sweeps one standard workload,
tests/test_fault_sweep_r60.py fourteen operations (DLPack, ArrayView copies, MemPool, random,
snapshots...), tests/test_alloc_adversarial*.py the cudaMallocAsync pool and the cuMem* calls of
expandable segments, tests/test_vmm*.py each cuMem*/zeVirtualMem* call, and
tests/test_xpu_adversarial.py a Level Zero kernel/graph workload.  What none of them makes fail
(measured by counting the calls of their workloads): cudaGraphDebugDotPrint, a second
cudaGraphInstantiate (keep_graph), cudaEventRecordWithFlags / cudaEventElapsedTime,
cudaFuncSetAttribute (a launch's shared-memory opt-in), cudaOccupancyMaxActiveBlocksPerMultiprocessor,
the driver path of runtimes before 12.8 (cuModuleLoadData, cuModuleGetFunction, cuLaunchKernel,
cuModuleUnload, cuFuncGetAttribute, cuFuncSetAttribute), cudaStreamGetDevice (a foreign
__cuda_array_interface__ stream), cudaMemPoolGetAttribute (memory_stats),
graph allocations of backend:cudaMallocAsync, pinned memory captured in a graph, the releases
of objects dropped without close(); Level Zero's regular lists, queues, kernels and build logs
of a keep_graph capture and their destroys, kernel timestamps, pinned host memory; Metal's
library compile, compute encoders and shared events outside the standard workload.

For each such call, once (each of its calls, six sampled where there are more) and from its
first call on until cleared:
the operation raises an accel error naming the call (or recovers), and after cleanup the
simulator's live objects (``accel.sim.state()``), accel's allocator statistics, reserved bytes,
the current device and streams are as before; the operation then works again, and
empty_cache/empty_host_cache succeed.

The bugs found (each test below failed first, fixed in session 27): a failed cudaFreeAsync of a
graph allocation during its capture, a cudaStreamGetCaptureInfo failure swallowed by
capture_begin, releases deferred past a capture or by a collection that got one attempt (or
none), a failed unload on the error path of a module load, and a capture body's error replaced
by a failing discard.
"""

import gc
import os
import threading
import warnings

import pytest

import accel
from accel import memory, sim
from accel._errors import AcceleratorError
from accel.sim import core
from conftest import SIMS, THOROUGH, pretend_collection, pretend_collection_ends, use_sim
import test_fault_sweep_r60 as r60
from test_user_kernels import SAXPY_MSL, SAXPY_PTX, saxpy_reference, spirv_module

SIG = "f32, ptr, ptr, u64"
CODES = r60._CODES
#: Functions that return no error code (a string): a fault there means nothing.
_NOT_CODES = frozenset({"cudaGetErrorName", "cudaGetErrorString", "nvmlErrorString"})
#: A capture whose end keeps failing cannot be ended (tests/test_fault_sweep.py, _NO_RECOVERY).
_NO_RECOVERY = frozenset({"cudaStreamEndCapture"})


def _image(kind):
    return {"cuda": SAXPY_PTX, "xpu": spirv_module("saxpy"), "mps": SAXPY_MSL}[kind]


def _close_all(result):
    """close() or reset() each object of ``result`` (idempotent: run again after a failure)."""
    if result is None:
        return
    for obj in result if isinstance(result, (list, tuple)) else (result,):
        (getattr(obj, "close", None) or getattr(obj, "reset"))()


# -- the sweep ----------------------------------------------------------------------------------

def _names(kind, name, err) -> bool:
    """The error names the failing call (Metal: a nil buffer is reported with its selector's
    words, a failed commit as the command buffer's error)."""
    return (name in str(err) or r60._metal_named(kind, name, err)
            or (kind == "mps" and name.startswith("newBuffer") and "returned nil" in str(err)))


def _full_state(kind) -> dict:
    """r60's settled state (live simulator objects, allocated/active bytes, reserved bytes, the
    current device and streams) and each device's live allocation count and requested bytes."""
    st = r60._full_state(kind)
    for i in range(accel.device_count()):
        stats = memory.memory_stats(i)
        st[f"counts{i}"] = (stats.get("allocation.all.current", 0), stats.get("requested_bytes.all.current", 0))
    return st


def _samples(n, most=6):
    """Which calls of a function fail: every one up to ``most``, else evenly spread ones."""
    if n <= most or most == 1:
        return list(range(min(n, most)))
    return sorted({round(i * (n - 1) / (most - 1)) for i in range(most)})


def sweep(kind, op, dev, targets, persistent=True, most=6, done=()):
    """Make each of ``targets`` the operation calls fail (each of its calls once, sampled past
    six, then from its first call on); returns (problems, {call: calls per run}, faults fired)."""
    setup, run = op
    ctx = setup(dev)

    def whole():
        result = run(ctx)
        _close_all(result)      # the releases are swept too
        return result

    whole()                                     # lazily made state (kernels, pools) made now
    r60._settle()
    gc.freeze()         # (what lives now out of the collector's sight: each settle's collection is cheap)
    before = dict(sim.calls())
    whole()
    after = dict(sim.calls())
    calls = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    base = _full_state(kind)
    names = sorted(n for n in calls if n in targets and n not in _NOT_CODES and n not in done)
    plan = [(n, k, 1) for n in names for k in _samples(calls[n], most)]
    if persistent:
        plan += [(n, 0, -1) for n in names if n not in _NO_RECOVERY]
    problems, fired = [], 0
    for name, k, times in plan:
        where = (f"{kind} device {dev}: {name} failing at call {k + 1} of {calls[name]}"
                 + (" and every later one" if times == -1 else ""))
        sim.inject_error(name, CODES[kind], times=times, after=k)
        err, result = None, None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result = run(ctx)
                _close_all(result)
            except AcceleratorError as exc:
                err = exc
            except Exception as exc:            # noqa: BLE001
                if not r60._guard_warned(caught):     # (a device guard that cannot restore warns: r60)
                    problems.append(f"{where}: not an accel error: {exc!r}"[:500])
            finally:
                entry = core._faults.get(name)
                fired += entry is None or entry[2] == 0
                sim.clear_faults()
        if err is not None and not _names(kind, name, err):
            problems.append(f"{where}: the error does not name the call: {err}"[:500])
        err = None
        gc.collect()
        try:
            _close_all(result)
        except Exception as exc:                # noqa: BLE001
            problems.append(f"{where}: close after the failure failed: {exc!r}"[:500])
        accel.set_device_index(base["device"])
        for step in ("after the failure", "after a retry"):
            try:
                st = _full_state(kind)          # synchronize, empty_cache, empty_host_cache
            except Exception as exc:            # noqa: BLE001
                problems.append(f"{where}: emptying the caches {step} failed: {exc!r}"[:500])
                st = _full_state(kind)
            if st != base:
                diff = {key: (base[key], st[key]) for key in st if st[key] != base[key]}
                problems.append(f"{where}: {step}, (before, now): {diff}"[:700])
                base = st
            if step == "after the failure":
                try:
                    whole()
                except Exception as exc:        # noqa: BLE001
                    problems.append(f"{where}: the retry failed: {exc!r}"[:500])
    return problems, calls, fired


# -- the operations -------------------------------------------------------------------------------

_TMP = {}


def _graph_keep_setup(dev):
    import tempfile
    _TMP.setdefault("dir", tempfile.mkdtemp(prefix="r67d-"))
    return accel.Stream(device=dev), accel.Buffer(8192, device=dev)


def _graph_keep(ctx):
    """keep_graph: capture, instantiate, dump, replay, instantiate again, replay, reset."""
    s, b = ctx
    g = accel.Graph(keep_graph=True)
    try:
        g.enable_debug_mode()
        with s, g:
            b.fill_(3)
        g.instantiate()
        g.debug_dump(os.path.join(_TMP["dir"], "g.dot"))
        with s:
            g.replay()
        g.instantiate()                 # destroys the first executable
        with s:
            g.replay()
        s.synchronize()
    except BaseException:
        g.reset()
        raise
    return [g]


def _external_events_setup(dev):
    return accel.Stream(device=dev), accel.Buffer(8192, device=dev)


def _external_events(ctx):
    """Event(external=True) recorded inside a capture (event record nodes), timed per replay."""
    s, b = ctx
    e1 = accel.Event(enable_timing=True, external=True)
    e2 = accel.Event(enable_timing=True, external=True)
    g = accel.Graph()
    try:
        with s, g:
            e1.record()
            b.fill_(1)
            e2.record()
        with s:
            g.replay()
        e2.synchronize()
        e1.elapsed_time(e2)
    except BaseException:
        g.reset()
        e1.close()
        e2.close()
        raise
    return [g, e1, e2]


def _kernel_setup(dev):
    sim.register_kernel("saxpy", saxpy_reference, SIG, replace=True)
    return accel.Stream(device=dev), accel.Buffer(4096, device=dev), accel.Buffer(4096, device=dev)


def _kernel_optin(ctx):
    """Module load, attributes, a launch above 48 KiB of shared memory (the opt-in), occupancy."""
    s, x, y = ctx
    with accel.Module(SAXPY_PTX, device=s.device_index) as m:
        k = m.function("saxpy")
        assert k.max_threads_per_block >= 256
        accel.launch(k, 4, 256, 2.0, x, y, 1024, stream=s, shared_mem=64 * 1024)
        k.max_potential_block_size(dynamic_smem=100 * 1024)
        s.synchronize()
    return None


def _pinned_setup(dev):
    return accel.Stream(device=dev), accel.Buffer(1 << 16, device=dev)


def _pinned(ctx):
    """Pinned arrays (a small and a large block), staged copies both ways, the cache emptied."""
    s, b = ctx
    a = accel.empty_pinned(1 << 14, "float32")
    c = accel.empty_pinned((1 << 20) + 5, "uint8")
    a[:] = 1
    b.copy_from(a, stream=s, non_blocking=True)
    b.copy_to(a, stream=s, non_blocking=True)
    del a, c
    s.synchronize()
    memory.empty_host_cache()
    return None


class _Foreign:
    def __init__(self, cai):
        self.__cuda_array_interface__ = cai


def _cai_setup(dev):
    return (accel.Buffer(4096, device=dev), accel.Buffer(4096, device=dev), accel.Stream(device=dev),
            accel.Stream(device=dev))


def _cai_copy(ctx):
    """A __cuda_array_interface__ source whose producer stream is another stream: the copy's
    stream waits for it (cudaStreamGetDevice, an event recorded there and waited for)."""
    a, b, s1, s2 = ctx
    a.fill_(3, stream=s1)
    cai = dict(a.as_array("float32", (1024,)).__cuda_array_interface__)
    cai["stream"] = s1.handle
    b.as_array("float32", (1024,)).copy_from(_Foreign(cai), stream=s2)
    s2.synchronize()
    return None


def _graph_alloc_setup(dev):
    return accel.Stream(device=dev), dev


def _graph_alloc(ctx):
    """An allocation made and freed inside a capture, one that outlives it, replays, stats."""
    s, dev = ctx
    g = accel.Graph()
    out = None
    try:
        with s, g:
            t = accel.Buffer(1 << 20)
            t.fill_(1)
            out = accel.Buffer(4096)
            out.copy_from(t.as_array("uint8", (4096,)))
            t.close()
        with s:
            g.replay()
            g.replay()
        s.synchronize()
        memory.memory_stats(dev)
    except BaseException:
        g.reset()
        if out is not None:
            out.close()
        raise
    return [out, g]


def _mempool_setup(dev):
    with accel.device_index(dev):
        return dev, accel.MemPool(), accel.Stream(device=dev)


def _mempool_expandable(ctx):
    """A MemPool routed with expandable segments on (private pools keep classic segments), a
    block used on two streams, a second pool dropped after its block was freed, the cache
    emptied."""
    dev, pool, s = ctx
    memory.set_allocator_settings("expandable_segments:True")
    try:
        with accel.use_mem_pool(pool, device=dev):
            b = accel.Buffer(3 << 20, device=dev, stream=s)
            c = accel.Buffer(25 << 20, device=dev)
        try:
            b.fill_(1, stream=s)
            c.fill_(2)
            b.record_stream(accel.current_stream(dev))
        finally:
            b.close()
            c.close()
        s.synchronize()
        with accel.device_index(dev):
            other = accel.MemPool()
        with accel.use_mem_pool(other, device=dev):
            accel.Buffer(1 << 20, device=dev).close()
        del other
        memory.empty_cache()
    finally:
        memory.set_allocator_settings("expandable_segments:False")
    return None


def _async_deferred_setup(dev):
    return accel.Stream(device=dev), accel.Stream(device=dev), dev


def _async_deferred(ctx):
    """backend:cudaMallocAsync: a block of another stream freed during a capture (its free
    deferred to the capture's end), a graph allocation used on the capture stream and freed in
    the capture, one that outlives the capture and the graph."""
    s, other, dev = ctx
    keep = accel.Buffer(1 << 20, device=dev, stream=other)
    keep.fill_(3, stream=other)
    g = accel.Graph()
    out = None
    try:
        with s, g:
            t = accel.Buffer(4096)
            t.fill_(1)
            keep.close()
            out = accel.Buffer(8192)
            out.fill_(2)
            t.close()
        with s:
            g.replay()
            g.replay()
        g.reset()
        with s:
            out.fill_(4)
        s.synchronize()
    except BaseException:
        g.reset()
        keep.close()
        if out is not None:
            out.close()
        raise
    return [out, g]


def _oom_history(dev):
    """Memory history on, an allocation the device cannot hold (the OOM report reads the
    device's free memory), a snapshot."""
    memory.record_history(True)
    try:
        with pytest.raises(accel.OutOfMemoryError):
            accel.Buffer(1 << 40, device=dev)
        b = accel.Buffer(3 << 20, device=dev)
        b.close()
        memory.memory_snapshot()
    finally:
        memory.record_history(None)
    return None


def _graph_host_setup(dev):
    return accel.Stream(device=dev), accel.Buffer(8192, device=dev)


def _graph_host(ctx):
    """Captured copies from and into pinned memory (the graph holds the pinned block)."""
    s, b = ctx
    h = accel.empty_pinned(2048, "float32")
    h[:] = 4
    g = accel.Graph()
    try:
        with s, g:
            b.copy_from(h, non_blocking=True)
            b.copy_to(h, non_blocking=True)
        del h
        with s:
            g.replay()
        s.synchronize()
    except BaseException:
        g.reset()
        raise
    return [g]


def _kgraph_setup(dev):
    sim.register_kernel("saxpy", saxpy_reference, SIG, replace=True)
    return accel.Stream(device=dev), accel.Buffer(4096, device=dev), accel.Buffer(4096, device=dev)


def _kgraph(ctx):
    """A module, a launch, and (with graphs) a keep_graph capture of a launch and a fill,
    instantiated twice and replayed; everything closed."""
    s, x, y = ctx
    kind = accel.current_accelerator().type
    m = accel.Module(_image(kind), device=s.device_index)
    g = accel.Graph(keep_graph=True) if kind != "mps" else None
    try:
        k = m.function("saxpy", SIG)
        accel.launch(k, 4, 256, 2.0, x, y, 1024, stream=s)
        if g is not None:
            with s, g:
                accel.launch(k, 4, 256, 2.0, x, y, 1024)
                y.fill_(1)
            g.instantiate()
            with s:
                g.replay()
            g.instantiate()
            with s:
                g.replay()
        s.synchronize()
    except BaseException:
        if g is not None:
            g.reset()
        m.close()
        raise
    return [g, m] if g is not None else [m]


def _timing_setup(dev):
    return accel.Stream(device=dev), accel.Stream(device=dev), accel.Buffer(4096, device=dev)


def _timing(ctx):
    """Timing events, a cross-stream wait, a query and a synchronize."""
    s, s2, b = ctx
    e1, e2 = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    try:
        e1.record(s)
        b.fill_(1, stream=s)
        e2.record(s)
        s2.wait_event(e2)
        b.fill_(2, stream=s2)
        e1.elapsed_time(e2)
        e3 = s2.record_event()
    except BaseException:
        e1.close()
        e2.close()
        raise
    e3.query()
    e3.synchronize()
    return [e1, e2, e3]


def _dropped(dev):
    """Objects dropped without close(): their finalizers release them (a failed release is
    tried again at the next API entry, accel._finalize)."""
    kind = accel.current_accelerator().type
    s = accel.Stream(device=dev)
    b = accel.Buffer(4096, device=dev, stream=s)
    b.fill_(1, stream=s)
    m = accel.Module(_image(kind), device=dev)
    k = m.function("saxpy", SIG)
    e = accel.Event()
    e.record(s)
    g = None
    if kind != "mps":
        g = accel.Graph()
        with s, g:
            b.fill_(2)
        g.replay()
    h = accel.empty_pinned(1024, "float32")
    b.copy_from(h, stream=s, non_blocking=True)
    del s, b, m, k, e, g, h
    gc.collect()
    accel.Buffer(8, device=dev).close()          # an API entry runs the deferred releases
    return None


def _dropped_setup(dev):
    sim.register_kernel("saxpy", saxpy_reference, SIG, replace=True)
    return dev


_ASYNC = {"ACCEL_ALLOC_CONF": "backend:cudaMallocAsync"}
_RUNTIME_12_4 = {"ACCEL_SIM_CUDA_RUNTIME": "12.4", "ACCEL_SIM_CUDA_DRIVER": "12.4"}

#: name -> (kind, (setup, run), the calls swept (those the other sweeps never fail), env, persistent)
_CASES = {
    "cuda-graph_keep": ("cuda", (_graph_keep_setup, _graph_keep),
                        {"cudaGraphInstantiate", "cudaGraphExecDestroy", "cudaGraphDestroy",
                         "cudaGraphDebugDotPrint", "cudaGraphLaunch"}, {}, True),
    "cuda-external_events": ("cuda", (_external_events_setup, _external_events),
                             {"cudaEventRecordWithFlags", "cudaEventElapsedTime", "cudaEventDestroy",
                              "cudaEventSynchronize"}, {}, True),
    "cuda-kernel_optin": ("cuda", (_kernel_setup, _kernel_optin),
                          {"cudaFuncSetAttribute", "cudaFuncGetAttributes", "cudaLibraryGetKernel",
                           "cudaOccupancyMaxActiveBlocksPerMultiprocessor", "cudaLaunchKernel",
                           "cudaLibraryUnload"}, {}, True),
    "cuda-kernel_driver_12.4": ("cuda", (_kernel_setup, _kernel_optin),
                                {"cuModuleLoadData", "cuModuleGetFunction", "cuModuleUnload", "cuLaunchKernel",
                                 "cuFuncGetAttribute", "cuFuncSetAttribute",
                                 "cuOccupancyMaxActiveBlocksPerMultiprocessor"}, _RUNTIME_12_4, True),
    "cuda-pinned": ("cuda", (_pinned_setup, _pinned), {"cudaHostAlloc", "cudaFreeHost", "cudaEventQuery"}, {},
                    True),
    "cuda-cai_copy": ("cuda", (_cai_setup, _cai_copy),
                      {"cudaStreamGetDevice", "cudaEventCreateWithFlags", "cudaEventRecord", "cudaStreamWaitEvent",
                       "cudaEventDestroy"}, {}, True),
    "cuda-async_graph_alloc": ("cuda", (_graph_alloc_setup, _graph_alloc),
                               {"cudaMallocAsync", "cudaFreeAsync", "cudaDeviceGraphMemTrim", "cudaMemPoolTrimTo",
                                "cudaMemPoolGetAttribute", "cudaGraphLaunch",
                                "cudaGraphExecDestroy"}, _ASYNC, True),
    "cuda-async_deferred": ("cuda", (_async_deferred_setup, _async_deferred),
                            {"cudaMallocAsync", "cudaDeviceGraphMemTrim",
                             "cudaMemPoolTrimTo", "cudaGraphExecDestroy", "cudaGraphDestroy", "cudaGraphLaunch",
                             "cudaGraphInstantiate"}, _ASYNC, True),
    "cuda-graph_alloc": ("cuda", (_graph_alloc_setup, _graph_alloc),
                         {"cudaMalloc", "cudaGraphLaunch", "cudaGraphExecDestroy", "cudaGraphDestroy",
                          "cudaGraphInstantiate", "cuMemCreate", "cuMemMap", "cuMemSetAccess"}, {}, True),
    "cuda-mempool_expandable": ("cuda", (_mempool_setup, _mempool_expandable),
                                {"cudaMalloc", "cudaFree", "cudaEventRecord", "cudaEventQuery", "cudaEventDestroy",
                                 "cudaEventCreateWithFlags"}, {}, True),
    "cuda-oom_history": ("cuda", (lambda dev: dev, _oom_history), {"cudaMemGetInfo"}, {}, True),
    "cuda-async_oom_history": ("cuda", (lambda dev: dev, _oom_history), {"cudaMemGetInfo", "cudaMallocAsync",
                                                                       "cudaFreeAsync"}, _ASYNC, True),
    "cuda-graph_host_copy": ("cuda", (_graph_host_setup, _graph_host),
                             {"cudaHostAlloc", "cudaStreamGetCaptureInfo", "cudaMemcpyAsync", "cudaEventCreateWithFlags", "cudaEventRecord",
                              "cudaGraphDestroy", "cudaGraphExecDestroy"}, {}, True),
    # a release that keeps failing in a finalizer is reported and leaked by design (accel._finalize)
    "cuda-dropped": ("cuda", (_dropped_setup, _dropped),
                     {"cudaStreamDestroy", "cudaEventDestroy", "cudaLibraryUnload", "cudaGraphExecDestroy",
                      "cudaGraphDestroy", "cudaEventRecord"}, {}, False),
    "xpu-kernel_graph": ("xpu", (_kgraph_setup, _kgraph),
                         {"zeCommandListCreate", "zeCommandListClose", "zeCommandListDestroy", "zeCommandQueueCreate",
                          "zeCommandQueueDestroy", "zeCommandQueueExecuteCommandLists", "zeCommandQueueSynchronize",
                          "zeModuleCreate", "zeModuleBuildLogGetString", "zeModuleBuildLogDestroy",
                          "zeModuleDestroy", "zeKernelCreate", "zeKernelDestroy", "zeKernelSetGroupSize",
                          "zeCommandListAppendLaunchKernel"}, {}, True),
    "xpu-timing": ("xpu", (_timing_setup, _timing),
                   {"zeEventQueryKernelTimestamp", "zeCommandListAppendBarrier", "zeEventHostSynchronize",
                    "zeEventQueryStatus", "zeCommandListAppendWaitOnEvents"}, {}, True),
    "xpu-pinned": ("xpu", (_pinned_setup, _pinned), {"zeMemAllocHost", "zeMemFree", "zeMemGetAllocProperties"},
                   {}, True),
    "xpu-graph_alloc": ("xpu", (_graph_alloc_setup, _graph_alloc),
                        {"zeMemAllocDevice", "zeCommandListCreate", "zeCommandListDestroy", "zeCommandListClose",
                         "zeCommandQueueExecuteCommandLists", "zePhysicalMemCreate", "zeVirtualMemMap",
                         "zeVirtualMemReserve"}, {}, True),
    "xpu-mempool_expandable": ("xpu", (_mempool_setup, _mempool_expandable),
                               {"zeMemAllocDevice", "zeMemFree", "zeEventQueryStatus"}, {}, True),
    "xpu-dropped": ("xpu", (_dropped_setup, _dropped),
                    {"zeCommandListDestroy", "zeCommandQueueDestroy", "zeKernelDestroy", "zeModuleDestroy"}, {},
                    False),
    "mps-kernel": ("mps", (_kgraph_setup, _kgraph),
                   {"newLibraryWithSource:options:error:", "computeCommandEncoder", "commandBuffer", "commit"}, {},
                   True),
    "mps-timing": ("mps", (_timing_setup, _timing), {"newSharedEvent", "blitCommandEncoder", "commit"}, {}, True),
    "mps-pinned": ("mps", (_pinned_setup, _pinned), {"newBufferWithLength:options:"}, {}, True),
    "mps-dropped": ("mps", (_dropped_setup, _dropped), {"newCommandQueue", "newLibraryWithSource:options:error:",
                                                       "newSharedEvent", "commit"}, {}, False),
}


@pytest.mark.parametrize("case", [c for c in _CASES if _CASES[c][0] in SIMS])
def test_failed_call_leaves_nothing_behind(monkeypatch, frozen_heap, case):
    kind, op, targets, env, persistent = _CASES[case]
    use_sim(monkeypatch, kind, **env)
    problems, reached, fired = [], set(), 0
    try:
        for dev in range(accel.device_count() - 1, -1, -1):     # device 1 (not current), then 0
            # default run: each target's first and last call on device 1 (and from its first
            # on), on device 0 the first call of every other one of those and of those device 1
            # never made (every target still fails, half of them on both devices); THOROUGH:
            # six calls each and from the first on, on both devices
            found, calls, hits = (sweep(kind, op, dev, targets, persistent, 6 if THOROUGH else 2)
                                  if THOROUGH or dev or accel.device_count() == 1
                                  else sweep(kind, op, dev, targets, False, 1,
                                             done={n for i, n in enumerate(sorted(reached)) if i % 2 == 0}))
            problems += found
            reached |= set(calls) & targets
            fired += hits
    finally:
        sim.clear_faults()
        sim.unregister_kernel("saxpy")
    assert not problems, "\n".join(problems)
    assert reached == targets, f"the operation never made {sorted(targets - reached)}"
    assert fired >= len(targets)


# -- finalizers: never wait on a lock the same thread holds; a failed release is retried --------

def _close_in_a_collection_holding_its_lock(monkeypatch, m) -> None:
    """``m.close()`` as a user's ``__del__`` run by a collection while this very thread holds the
    module's lock (a launch of its kernel in progress), in another thread so that a wait for the
    lock shows as a timeout instead of a hung run."""
    done = []

    def body():
        with m._lock:
            pretend_collection(monkeypatch)
            try:
                m.close()
            finally:
                pretend_collection_ends(monkeypatch)
        done.append(True)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(10)
    assert done, "close() in a collection waited for the lock its own thread holds"


def test_close_in_a_collection_under_the_module_lock_does_not_wait(monkeypatch):
    """The close is recorded at once and the unload runs at the next safe point (an API entry)."""
    use_sim(monkeypatch, "cuda")
    accel.Module(SAXPY_PTX, device=1).close()
    r60._settle()
    base = sim.state().modules
    m = accel.Module(SAXPY_PTX, device=1)
    m.function("saxpy")
    _close_in_a_collection_holding_its_lock(monkeypatch, m)
    assert m.closed
    assert sim.state().modules == base + 1          # not yet: deferred
    accel.Buffer(8, device=1).close()               # the safe point
    r60._settle()
    assert sim.state().modules == base


@pytest.mark.parametrize("objects", ["stream", "event", "graph"])
def test_objects_collected_in_a_cycle_retry_a_release_that_fails_once(monkeypatch, objects):
    """Streams, events and graphs freed by the cyclic collector: a destroy that fails once is
    tried again at the next safe point (accel._finalize) and nothing leaks."""
    use_sim(monkeypatch, "cuda")
    s = accel.Stream(device=1)
    b = accel.Buffer(4096, device=1)
    warm = accel.Graph()
    with s, warm:                                   # what a first capture loads lazily
        b.fill_(1)
    warm.reset()
    r60._settle()
    before = r60._live("cuda")
    holder = _Cycle()
    if objects == "stream":
        holder.obj, call = accel.Stream(device=1), "cudaStreamDestroy"
    elif objects == "event":
        holder.obj, call = accel.Event(), "cudaEventDestroy"
        holder.obj.record(s)
    else:
        holder.obj, call = accel.Graph(), "cudaGraphExecDestroy"
        with s, holder.obj:
            b.fill_(1)
    del holder
    sim.inject_error(call, CODES["cuda"])
    gc.collect()                                    # the finalizers run in the collection: deferred
    accel.Buffer(8, device=1).close()               # the safe point: the release fails once...
    sim.clear_faults()
    accel.Buffer(8, device=1).close()               # ...and is tried again
    r60._settle()
    assert r60._live("cuda") == before
    b.close()
    s.close()


class _Cycle:
    def __init__(self):
        self.me = self


@pytest.mark.parametrize("how", ["module_collected_in_a_cycle", "module_closed_in_a_collection",
                                 "graph_reset_in_a_collection_during_its_replay"])
def test_release_deferred_by_a_collection_retries_a_call_that_fails_once(monkeypatch, how):
    use_sim(monkeypatch, "cuda")
    reports = []
    monkeypatch.setattr("sys.unraisablehook", lambda u: reports.append(str(u.exc_value)))
    s, b = accel.Stream(device=1), accel.Buffer(4096, device=1)
    accel.Module(SAXPY_PTX, device=1).close()
    warm = accel.Graph()
    with s, warm:                                   # what a first capture loads lazily
        b.fill_(1)
    warm.reset()
    r60._settle()
    before = r60._live("cuda")
    if how == "module_collected_in_a_cycle":
        holder = _Cycle()
        holder.obj = accel.Module(SAXPY_PTX, device=1)
        del holder
        call = "cudaLibraryUnload"
        sim.inject_error(call, CODES["cuda"])
        gc.collect()
    elif how == "module_closed_in_a_collection":
        m = accel.Module(SAXPY_PTX, device=1)
        _close_in_a_collection_holding_its_lock(monkeypatch, m)
        call = "cudaLibraryUnload"
    else:
        g = accel.Graph()
        with s, g:
            b.fill_(2)
        be = g._backend
        launch = be.graph_launch

        def launch_then_collect(exe, stream):       # a collection in the replay resets g
            launch(exe, stream)
            pretend_collection(monkeypatch)
            try:
                g.reset()
            finally:
                pretend_collection_ends(monkeypatch)
        monkeypatch.setattr(be, "graph_launch", launch_then_collect)
        with s:
            g.replay()
        monkeypatch.setattr(be, "graph_launch", launch)
        call = "cudaGraphExecDestroy"
    sim.inject_error(call, CODES["cuda"])
    accel.Buffer(8, device=1).close()               # the safe point: the release fails once...
    sim.clear_faults()
    accel.Buffer(8, device=1).close()               # ...and would be tried again here
    r60._settle()
    assert r60._live("cuda") == before, f"leaked; reported: {reports}"
    b.close()
    s.close()


# -- the bugs ---------------------------------------------------------------------------------------

def test_failed_free_in_capture_of_a_graph_allocation_is_not_lost(monkeypatch):
    use_sim(monkeypatch, "cuda", **_ASYNC)
    s = accel.Stream(device=1)

    def capture_and_replay(fail):
        g = accel.Graph()
        if fail:
            sim.inject_error("cudaFreeAsync", CODES["cuda"])
        try:
            with s, g:
                t = accel.Buffer(1 << 20)
                t.fill_(1)
                t.close()                   # a free node (cudaFreeAsync in the capture)
        except AcceleratorError as exc:
            assert fail and "cudaFreeAsync" in str(exc)
        sim.clear_faults()
        if g._exec is not None:
            with s:
                g.replay()
                g.replay()
        s.synchronize()
        g.reset()
        r60._settle()

    capture_and_replay(False)
    base = (sim.state().live_allocations, memory.memory_stats(1)["allocation.all.current"])
    capture_and_replay(True)
    capture_and_replay(False)               # the same address again
    capture_and_replay(False)
    assert (sim.state().live_allocations, memory.memory_stats(1)["allocation.all.current"]) == base
    s.close()


@pytest.mark.parametrize("work", ["launch", "pinned_copy"])
def test_failed_capture_info_at_capture_begin_is_not_swallowed(monkeypatch, work):
    """Either capture_begin raises the failure (nothing left underway), or the graph is a full
    accel capture, as without the fault: it keeps the module it launches (a replay after close()
    is refused by accel) and takes a pinned host copy."""
    use_sim(monkeypatch, "cuda")
    sim.register_kernel("saxpy", saxpy_reference, SIG, replace=True)
    s = accel.Stream(device=1)
    x, y = accel.Buffer(4096, device=1), accel.Buffer(4096, device=1)
    h = accel.empty_pinned(1024, "float32")
    m = accel.Module(SAXPY_PTX, device=1)
    k = m.function("saxpy")
    g = accel.Graph()
    try:
        sim.inject_error("cudaStreamGetCaptureInfo", CODES["cuda"])
        try:
            with s, g:
                sim.clear_faults()
                if work == "launch":
                    accel.launch(k, 4, 256, 2.0, x, y, 1024)
                else:
                    y.copy_from(h, non_blocking=True)
        except AcceleratorError as exc:
            assert "cudaStreamGetCaptureInfo" in str(exc), f"a misleading error: {exc}"
            assert sim.state().captures == 0 and g._exec is None
            return
        finally:
            sim.clear_faults()
        if work == "launch":
            m.close()
            with pytest.raises(RuntimeError, match="was closed"):
                with s:
                    g.replay()
        g.reset()
    finally:
        sim.unregister_kernel("saxpy")


@pytest.mark.parametrize("call", ["cudaLibraryUnload", "cudaGraphExecDestroy", "cudaGraphDestroy"])
def test_release_deferred_past_a_capture_is_retried_when_it_fails(monkeypatch, call):
    use_sim(monkeypatch, "cuda")
    sim.register_kernel("saxpy", saxpy_reference, SIG, replace=True)
    reports = []
    monkeypatch.setattr("sys.unraisablehook", lambda u: reports.append(u.exc_value))
    try:
        s, b = accel.Stream(device=1), accel.Buffer(4096, device=1)
        accel.Module(SAXPY_PTX, device=1).close()
        warm = accel.Graph()
        with s, warm:                               # what a first capture loads lazily
            b.fill_(1)
        warm.reset()
        r60._settle()
        before = sim.state()
        m = accel.Module(SAXPY_PTX, device=1)
        m.function("saxpy")
        other = accel.Graph(keep_graph=True)        # holds a graph and an executable
        with s, other:
            b.fill_(1)
        other.instantiate()
        g = accel.Graph()
        with s:
            g.capture_begin()
            b.fill_(2)
            m.close()                               # deferred to the end of the capture
            other.reset()                           # likewise
            sim.inject_error(call, CODES["cuda"])
            g.capture_end()                         # runs them: one fails
        sim.clear_faults()
        g.reset()
        for _ in range(2):                          # API entries: a retry would run here
            accel.Buffer(8, device=1).close()
            accel.Stream(device=1).close()
        gc.collect()
        r60._settle()
        after = sim.state()
        left = {k: (getattr(before, k), getattr(after, k)) for k in ("modules", "graphs", "graph_execs")
                if getattr(before, k) != getattr(after, k)}
        assert not left, f"leaked (before, after): {left}; reported: {reports}"
        s.close()
    finally:
        sim.unregister_kernel("saxpy")


def test_failed_unload_after_a_failed_lookup_in_module_load(monkeypatch):
    use_sim(monkeypatch, "cuda")
    accel.Module(SAXPY_PTX, device=1).close()
    r60._settle()
    base = sim.state().modules
    sim.inject_error("cudaLibraryGetKernel", CODES["cuda"])
    sim.inject_error("cudaLibraryUnload", CODES["cuda"])
    with pytest.raises(AcceleratorError) as info:
        accel.Module(SAXPY_PTX, device=1)
    sim.clear_faults()
    for _ in range(2):                              # API entries: a retry would run here
        accel.Buffer(8, device=1).close()
        accel.Stream(device=1).close()
    r60._settle()
    assert sim.state().modules == base, "the module leaked"
    assert "cudaLibraryGetKernel" in str(info.value), "the lookup's error was replaced by the unload's"


def test_failed_unload_after_a_failed_lookup_in_the_random_kernels(monkeypatch):
    use_sim(monkeypatch, "cuda")
    b = accel.Buffer(4096, device=1)
    r60._settle()
    base = sim.state().modules
    sim.inject_error("cudaLibraryGetKernel", CODES["cuda"])
    sim.inject_error("cudaLibraryUnload", CODES["cuda"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accel.random.uniform_(b)                    # host path this once, with a warning
    sim.clear_faults()
    accel.random.uniform_(b)                        # loads the kernels: one module
    for _ in range(2):
        accel.Buffer(8, device=1).close()
    r60._settle()
    assert sim.state().modules == base + 1, "the module of the failed load leaked"
    assert any("cudaLibraryGetKernel" in str(w.message) for w in caught), [str(w.message) for w in caught]
    b.close()


def test_body_error_of_a_capture_survives_a_failed_discard(monkeypatch):
    use_sim(monkeypatch, "cuda")
    s, b = accel.Stream(device=1), accel.Buffer(4096, device=1)
    g = accel.Graph()
    try:
        with pytest.raises(ValueError, match="the body's own error"):
            with s, g:
                b.fill_(1)
                sim.inject_error("cudaGraphExecDestroy", CODES["cuda"])
                raise ValueError("the body's own error")
    finally:
        sim.clear_faults()
        g.reset()                                   # what the failed discard kept goes now
    r60._settle()
    assert sim.state().graph_execs == 0 and sim.state().graphs == 0
