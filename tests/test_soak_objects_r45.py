"""Soak (r45): state is bounded by live objects, never by everything ever created.

tests/test_soak.py cycles Stream/Event/Buffer.  Here every other object a user makes and drops
(graphs captured, replayed, reset and dropped -- with RNG, private and shared pools, a capture
failing half way --, MemPools, Generators, kernel Modules, DLPack round trips, wrappers of raw
stream handles, pinned arrays, events across devices, memory history, streams whose expandable
segments hold blocks) is cycled on every simulator, half the cycles on the non-current device.

What is watched is found, not listed: :func:`census` walks every ``accel*`` module's globals and,
through them, every accel object reachable (backends, allocators, pools, the simulators'
libraries and handle tables), and counts the entries of every dict/list/set/deque/weak
container on the way, keyed by path (``accel.memory._allocators[*]._general``: summed over the
elements).  After a warm-up block, every later block must leave each count within SLACK of the
first block's: a registry keyed by objects ever created grows by a whole block.
``ACCEL_SOAK_R45_CYCLES=2000`` runs longer blocks.
"""

from __future__ import annotations

import collections
import gc
import os
import sys
import threading
import types
import weakref

import numpy as np
import pytest

import accel
from accel import _finalize
from conftest import SIMS, use_sim

#: cycles per block; the warm-up block, then BLOCKS blocks compared with the first.
EVERY = int(os.environ.get("ACCEL_SOAK_R45_CYCLES", "30"))
BLOCKS = 3
#: a count may wander this much (event caches, round-robin pools) without growing
SLACK = 12

_CONTAINERS = (dict, list, set, collections.deque, weakref.WeakValueDictionary, weakref.WeakKeyDictionary,
               weakref.WeakSet)
_SKIP_TYPES = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
               np.ndarray, str, bytes, int, float, bool, type(None), threading.Thread)


def _accel_object(obj) -> bool:
    mod = getattr(type(obj), "__module__", "") or ""
    return mod == "accel" or mod.startswith("accel.")


def _attrs(obj):
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        yield from list(d.items())
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name in ("__dict__", "__weakref__"):
                continue
            try:
                yield name, getattr(obj, name)
            except AttributeError:
                pass


def census() -> dict:
    """{path: entries} for every container reachable from accel's modules (see the docstring)."""
    out: dict = collections.Counter()
    seen = set()

    def visit(obj, path, depth):
        if depth > 8 or isinstance(obj, _SKIP_TYPES) or id(obj) in seen:
            return
        if isinstance(obj, _CONTAINERS):
            seen.add(id(obj))
            try:
                items = list(obj.items()) if hasattr(obj, "items") else [(None, v) for v in list(obj)]
            except RuntimeError:        # changed size: a worker thread; the next census sees it
                return
            out[path] += len(items)
            for k, v in items:
                if isinstance(k, tuple) or _accel_object(k):
                    visit(k, path + "{k}", depth + 1)
                visit(v, path + "[*]", depth + 1)
        elif isinstance(obj, tuple):
            for i, v in enumerate(obj):
                visit(v, f"{path}({i})", depth + 1)
        elif _accel_object(obj):
            seen.add(id(obj))
            for name, v in _attrs(obj):
                visit(v, f"{path}.{name}", depth + 1)
        elif isinstance(obj, threading.local):         # this thread's values
            seen.add(id(obj))
            for name, v in list(vars(obj).items()):
                visit(v, f"{path}.{name}", depth + 1)

    def visit_class(cls, path):
        # class-level state (a cache or table in the class body), and lru_caches
        for name, v in list(vars(cls).items()):
            if name.startswith("__"):
                continue
            if hasattr(v, "cache_info"):
                out[f"{path}.{name}.cache"] = v.cache_info().currsize
            elif isinstance(v, (staticmethod, classmethod)) and hasattr(v.__func__, "cache_info"):
                out[f"{path}.{name}.cache"] = v.__func__.cache_info().currsize
            elif not isinstance(v, (types.FunctionType, property, staticmethod, classmethod, type)):
                visit(v, f"{path}.{name}", 0)

    # the owners first, so an object shared by several (a backend, an allocator) is counted
    # under the same path in every census whatever else holds it now
    first = ("accel._lazy", "accel.backends", "accel.memory", "accel.buffer", "accel.buffer.buffer_class",
             "accel.streams", "accel.graphs", "accel.random", "accel.kernels", "accel.sim")
    for name, mod in sorted(sys.modules.items(), key=lambda kv: (kv[0] not in first, first.index(kv[0])
                                                                  if kv[0] in first else 0, kv[0])):
        if mod is None or not (name == "accel" or name.startswith("accel.")):
            continue
        for attr, v in list(vars(mod).items()):
            if attr.startswith("__"):
                continue
            if isinstance(v, type) and v.__module__ == name:
                visit_class(v, f"{name}.{attr}")
            elif hasattr(v, "cache_info"):
                out[f"{name}.{attr}.cache"] = v.cache_info().currsize
            else:
                visit(v, f"{name}.{attr}", 0)
    from accel import sim
    for k, v in vars(sim.state()).items():
        if "bytes" in k or k in ("calls", "config", "nvml_init_calls", "jit_compiles") or "_by_device" in k:
            continue        # totals of bytes and calls: not counts of live objects
        if isinstance(v, (list, tuple)):
            out[f"sim.state.{k}"] = len(v)
        elif isinstance(v, int) and not isinstance(v, bool):
            out[f"sim.state.{k}"] = v
        elif isinstance(v, dict):
            for name, x in v.items():
                if isinstance(x, int):
                    out[f"sim.state.{k}[{name}]"] = x
    out["threads"] = threading.active_count()
    out["fds"] = len(os.listdir("/proc/self/fd"))
    return dict(out)


def settle() -> None:
    for _ in range(2):
        gc.collect()
        _finalize.drain()
    for d in range(accel.device_count()):
        accel.synchronize(d)
    # backend:cudaMallocAsync postpones a free made while any capture is underway (as torch's,
    # until no capture runs) to the device's next allocation, free or empty_cache: an
    # allocation on each device lets a free a cleanup made during the last capture go through
    for d in range(accel.device_count()):
        accel.Buffer(256, device=d).close()
    gc.collect()
    _finalize.drain()
    # The simulator's engine forgets the queues closed from inside its own lock (close_later: a
    # destroyed Level Zero event's, a Metal queue's) when it next makes a queue: the objects a
    # collection just destroyed would stay counted until then, as many as that collection
    # happened to find (the CI runs of 2026-12-06 saw 70 -> 84).  A stream made and closed on
    # each device makes that queue.
    for d in range(accel.device_count()):
        accel.Stream(d).close()


#: Registries bounded by a constant, not by live objects, that a soak may see grow up to it:
#: the xpu backend's fill patterns (one cdata per byte value, at most 256).
#: the Metal simulator's zombies (released objects remembered to refuse their later use, as
#: NSZombieEnabled; the last accel.sim.metal.ZOMBIES_KEPT of them).
BOUNDED = ("accel._lazy._initialized_backend._patterns", "accel._lazy._initialized_backend._libs.objc_ffi._rt.zombies")


#: Counts of expandable segments, which wander with what the cache holds (segments whose pages
#: cached blocks keep mapped); compared after empty_cache only.
WANDER = ("vmm", "_exp_segs")


def grown(first: dict, last: dict) -> dict:
    return {k: (first.get(k, 0), v) for k, v in last.items()
            if k not in BOUNDED and v > first.get(k, 0) + (0 if k in ("threads", "fds") else SLACK)}


def soak(cycle, *, every=EVERY, blocks=BLOCKS):
    """Run ``cycle(i, device)`` for a warm-up block and ``blocks`` more; assert the census flat."""
    devices = accel.device_count()     # 2 (ACCEL_SIM_DEVICES=2), Metal: 1
    i = 0
    rows = []
    for b in range(blocks + 2):         # two warm-up blocks: caches, worker threads, lazy state
        for _ in range(every):
            cycle(i, i % devices)
            i += 1
        settle()
        cached = census()               # (the first one imports what the census reads)
        accel.memory.empty_cache()
        emptied = census()
        if b > 1:
            rows.append((cached, emptied))
    first = rows[0]
    for n, (cached, emptied) in enumerate(rows[1:], 2):
        g = {k: v for k, v in grown(first[0], cached).items() if not any(w in k for w in WANDER)}
        assert not g, f"after block {n} of {every} cycles: grown {{path: (first block, now)}}: {g}"
        g = grown(first[1], emptied)
        assert not g, f"after block {n} of {every} cycles and empty_cache: grown {{path: (first block, now)}}: {g}"


@pytest.fixture(params=SIMS)
def sim2(request, monkeypatch):
    # The cycles collect garbage often; in the whole suite's process (torch imported, thousands of
    # tests' objects) a full collection walks all of it: frozen, earlier tests' objects are skipped
    # (this file took 5 minutes of the suite, 20 s alone).
    gc.collect()
    gc.freeze()
    yield use_sim(monkeypatch, request.param, ACCEL_SIM_DEVICES=2)     # (conftest unfreezes later)


def test_census_catches_a_registry_that_grows(sim2, monkeypatch):
    """The walker finds a container hung deep under a backend object and a leak of one entry
    every other cycle in it."""
    leak = []
    monkeypatch.setattr(_backend(), "_r45_planted", {"inner": [leak]}, raising=False)

    def cycle(i, d):
        if i % 2:
            leak.append(accel.Stream(d).stream_id)
    with pytest.raises(AssertionError, match=r"_r45_planted\[\*\]\[\*\]"):
        soak(cycle)


def test_census_sees_the_stream_event_buffer_cycle_flat(sim2):
    """The walker itself: tools/soak.py's cycle (known flat) stays flat under it."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import soak as tool
    soak(lambda i, d: tool.cycle(i, accel.device_count()))


def _backend():
    return accel._lazy.lazy_init()


def _other(d):
    """A scope making device ``d`` current only on odd cycles' other half: objects on device 1 are
    made while device 0 is current, as well as under ``device_index(1)``."""
    return accel.device_index(d)


# -- graphs -------------------------------------------------------------------------------------
def _graph_cycle(i, d):
    s = accel.Stream(d)
    b = accel.Buffer(4096, device=d, stream=s)
    way = i % 4
    g = accel.Graph()
    with s, g:
        b.fill_(i & 255)
        if _philox_kernels():
            accel.random.uniform_(b)              # RNG in the capture: graph-safe Philox state
        t = accel.Buffer(2048 + 512 * (i % 3), device=d)   # from the graph's private pool
        t.fill_(1)
        del t
    for _ in range(2):
        g.replay()
    if way == 0:
        g.reset()
    elif way == 1:
        s.synchronize()
    elif way == 2:
        _Cycle(g, s, b)
    else:
        g.replay()          # dropped with a replay queued
    del g, s, b


class _Cycle:
    def __init__(self, *objs):
        self.objs = objs
        self.me = self


def _philox_kernels() -> bool:
    """Random fills can be captured (the backend has device Philox kernels): the CUDA simulator's."""
    return _backend().name == "cuda"


def _needs_graphs():
    if not _backend().supports_graphs:
        pytest.skip(f"{_backend().name}: no graphs ")


def test_graph_capture_replay_reset_drop(sim2):
    _needs_graphs()
    soak(_graph_cycle)


def test_graphs_sharing_a_pool_handle(sim2):
    _needs_graphs()

    def cycle(i, d):
        s = accel.Stream(d)
        pool = accel.graphs.graph_pool_handle()
        g1, g2 = accel.Graph(), accel.Graph()
        with accel.graph(g1, pool=pool, stream=s):
            a = accel.Buffer(8192, device=d)
            a.fill_(3)
        with accel.graph(g2, pool=pool, stream=s):
            c = accel.Buffer(8192, device=d)
            c.copy_from(a)
        g1.replay()
        g2.replay()
        if i % 2:
            g1.reset()
            del a, c
        else:
            del a, c, g1
            s.synchronize()
        del g2, s
    soak(cycle)


def test_capture_failing_half_way(sim2):
    _needs_graphs()

    def cycle(i, d):
        s = accel.Stream(d)
        b = accel.Buffer(4096, device=d, stream=s)
        g = accel.Graph()
        with pytest.raises(accel.CaptureError):
            with s, g:
                b.fill_(1)
                if _philox_kernels():
                    accel.random.normal_(b)
                t = accel.Buffer(1024, device=d)
                t.fill_(2)
                if i % 2:
                    s.synchronize()        # illegal in capture: the capture is invalidated
                else:
                    accel.synchronize(d)
        if i % 3 == 0:
            g.reset()
        del g, s, b
    soak(cycle)


# -- memory pools ---------------------------------------------------------------------------------
def test_mempool_use_and_drop(sim2):
    def cycle(i, d):
        with accel.device_index(d):
            pool = accel.memory.MemPool(no_split=bool(i % 2))
        s = accel.Stream(d)
        with accel.memory.use_mem_pool(pool, device=d):
            b = accel.Buffer(4096 + 1024 * (i % 4), device=d, stream=s)
            b.fill_(1, stream=s)
        if i % 3 == 0:
            del pool                  # pool dropped while its block lives
            b.close()
        elif i % 3 == 1:
            b.close()
            del pool
        else:
            _Cycle(pool, b, s)
            del pool, b
        del s
    soak(cycle)


# -- generators -------------------------------------------------------------------------------------
def test_generators_used_and_dropped(sim2):
    def cycle(i, d):
        gen = accel.random.Generator(d, seed=i)
        b = accel.Buffer(4096, device=d)
        accel.random.uniform_(b, generator=gen)
        accel.random.randint_(b, 0, 10, generator=gen)
        if i % 4 == 0:
            gen.get_state()
            gen.set_state(gen.get_state())
        if i % 2:
            _Cycle(gen, b)
        del gen, b
    soak(cycle)


# -- kernels --------------------------------------------------------------------------------------
def test_modules_loaded_launched_and_dropped(sim2):
    from accel import sim
    from test_user_kernels import SAXPY_MSL, SAXPY_PTX, saxpy_reference, spirv_module
    kind = _backend().name
    image = {"cuda": SAXPY_PTX, "mps": SAXPY_MSL, "xpu": spirv_module("saxpy") if kind == "xpu" else None}[kind]
    sig = None if kind == "cuda" else "f32, ptr, ptr, u64"
    sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64")
    n = 256

    def cycle(i, d):
        m = accel.Module(image, device=d)
        k = m.function("saxpy", sig)
        s = accel.Stream(d)
        x = accel.Buffer(4 * n, device=d, stream=s)
        x.fill_(0, stream=s)
        y = accel.Buffer(4 * n, device=d, stream=s)
        y.fill_(0, stream=s)
        accel.launch(k, 1, n, 2.0, x, y, n, stream=s)
        way = i % 3
        if way == 0:
            s.synchronize()
            m.close()
        elif way == 2:
            _Cycle(m, k, s, x, y)
        del m, k, s, x, y

    try:
        soak(cycle)
    finally:
        sim.unregister_kernel("saxpy")


# -- DLPack -------------------------------------------------------------------------------------------
def test_dlpack_round_trips(sim2):
    def cycle(i, d):
        b = accel.Buffer(4096, device=d)
        b.fill_(7)
        way = i % 4
        if way == 0:
            imported = accel.from_dlpack(b)             # consumed by accel itself
            imported.fill_(1)
            imported.close()
        elif way == 1:
            capsule = b.__dlpack__(max_version=(1, 0))  # never consumed: its destructor frees it
            del capsule
        elif way == 2:
            capsule = b.__dlpack__()                     # legacy capsule, consumed, the Buffer dropped
            imported = accel.from_dlpack(capsule)
            del capsule, imported
        else:
            view = accel.ArrayView(b, "float32", (1024,)) if hasattr(accel, "ArrayView") else b
            imported = accel.from_dlpack(view)
            _Cycle(imported, view)
            del imported, view
        del b
    soak(cycle)


# -- wrappers of raw stream handles ---------------------------------------------------------------------
def test_foreign_stream_wrappers(sim2):
    backend = _backend()

    def cycle(i, d):
        with accel.streams.on_device(backend, d):
            handle = backend.stream_create()
        try:
            if i % 2:
                s = accel.Stream.from_handle(handle, device=d)
            else:
                s = accel.ExternalStream(handle, device=d)
            s2 = accel.Stream.from_handle(handle, device=d)     # a second wrapper of the same handle
            b = accel.Buffer(2048, device=d, stream=s)
            b.fill_(3, stream=s)
            e = s.record_event()
            s2.wait_event(e)
            if i % 3 == 0:
                s.close()           # never destroys a foreign handle
            del s, s2, b, e
            gc.collect()
            _finalize.drain()
            accel.synchronize(d)
        finally:
            with accel.streams.on_device(backend, d):
                backend.stream_destroy(handle)
    soak(cycle)


# -- pinned memory -----------------------------------------------------------------------------------------
def test_pinned_arrays_with_non_blocking_copies(sim2):
    def cycle(i, d):
        s = accel.Stream(d)
        a = accel.empty_pinned(1024 + 256 * (i % 3), dtype=np.uint8)
        a[:] = i & 255
        b = accel.Buffer(a.nbytes, device=d, stream=s)
        b.copy_from(a, stream=s, non_blocking=True)
        out = accel.empty_pinned(a.nbytes, dtype=np.uint8)
        b.copy_to(out, stream=s, non_blocking=True)
        if i % 2:
            s.synchronize()
            view = out[10:20]          # a view keeps the block
            del out
            _Cycle(view, s)
            del view
        else:
            del out                    # dropped with the copy queued
        del a, b, s
    soak(cycle)


# -- events across devices -------------------------------------------------------------------------------
def test_events_recorded_across_devices(sim2):
    n = accel.device_count()

    def cycle(i, d):
        s = accel.Stream(d)
        other = accel.Stream((d + 1) % n)
        b = accel.Buffer(1024, device=d, stream=s)
        b.fill_(1, stream=s)
        e = accel.Event(enable_timing=bool(i % 2))
        e.record(s)
        other.wait_event(e)
        accel.default_stream((d + 1) % n).wait_event(e)
        e2 = accel.Event(enable_timing=bool(i % 2))
        e2.record(s)
        if i % 2:
            e2.synchronize()
            e.elapsed_time(e2)
        if i % 3 == 0:
            _Cycle(e, e2, s, other, b)
        del s, other, b, e, e2
    soak(cycle)


# -- memory history ----------------------------------------------------------------------------------------
def test_record_history_on_off_with_snapshots(sim2):
    def cycle(i, d):
        if i % 5 == 0:
            accel.memory.record_history(True, max_entries=64)
        s = accel.Stream(d)
        b = accel.Buffer(4096 + 512 * (i % 7), device=d, stream=s)
        b.fill_(1, stream=s)
        if i % 5 == 2:
            snap = accel.memory.memory_snapshot()
            assert isinstance(snap, list)
        if i % 5 == 4:
            accel.memory.record_history(None)
        del b, s
    try:
        soak(cycle)
    finally:
        accel.memory.record_history(None)


# -- E11: reservations bounded by live streams -------------------------------------------------------------------
def test_streams_dropped_while_their_expandable_segments_hold_blocks(sim2, monkeypatch):
    if not _backend().supports_vmm:
        pytest.skip(f"{_backend().name}: no virtual memory (expandable segments)")
    monkeypatch.setenv("ACCEL_ALLOC_CONF", "expandable_segments:True")
    accel._lazy._reset_for_tests()
    kept = []

    def cycle(i, d):
        s = accel.Stream(d)
        b = accel.Buffer((2 << 20) + 4096 * (i % 5), device=d, stream=s)
        b.fill_(1, stream=s)
        small = accel.Buffer(512, device=d, stream=s)
        del s                      # the stream goes while its segment holds b and small
        if i % 2:
            kept.append(b)         # outlives its stream for a while
        if len(kept) > 4:
            kept.pop(0)
        del b, small

    soak(cycle)
    kept.clear()
    settle()
    accel.memory.empty_cache()
    state = accel.sim.state()
    live = state.vmm_reservations or getattr(state, "ze_vmm_reservations", 0)
    assert live == 0, f"{live} reservations left with no stream and no block live"


def test_graph_with_fork_join_external_events_and_host_copies(sim2):
    """Captures that fork to a side stream and join back, record an external event (where the
    backend has them) and copy to and from pinned memory (the graph holds the pinned blocks)."""
    _needs_graphs()
    external = _backend().supports_external_events
    forks = getattr(_backend(), "records_events_in_capture", True)     # Level Zero: no cross-stream capture

    def cycle(i, d):
        s, side = accel.Stream(d), accel.Stream(d)
        b = accel.Buffer(4096, device=d, stream=s)
        c = accel.Buffer(4096, device=d, stream=s)
        host = accel.empty_pinned(4096, dtype=np.uint8)
        g = accel.Graph(keep_graph=bool(i % 2))
        ext = accel.Event(external=True) if external and i % 3 == 0 else None
        with s, g:
            b.fill_(1)
            fork = join = None
            if forks:
                fork = s.record_event()
                side.wait_event(fork)
                c.fill_(2, stream=side)
                join = side.record_event()
                s.wait_event(join)
            c.copy_to(host, non_blocking=True)
            b.copy_from(host, non_blocking=True)
            if ext is not None:
                ext.record(s)
        if i % 2:
            g.instantiate()
        g.replay()
        del host
        if i % 4 == 0:
            g.reset()
        del g, s, side, b, c, ext, fork, join
    soak(cycle)


# -- short-lived threads -------------------------------------------------------------------------------------
def test_threads_that_use_streams_pools_and_captures_then_exit(sim2):
    """Per-thread state (current streams, use_mem_pool routing, capture modes, the simulators'
    per-thread streams) goes with the thread."""
    graphs = _backend().supports_graphs

    def body(i, d, errors):
        try:
            s = accel.Stream(d)
            with s:
                b = accel.Buffer(2048, device=d)
                b.fill_(1)
                accel.current_stream(d).synchronize()
            accel.set_stream(accel.Stream(d))          # left current when the thread ends
            with accel.device_index(d):
                pool = accel.memory.MemPool()
            with accel.memory.use_mem_pool(pool, device=d):
                c = accel.Buffer(1024, device=d)
                c.fill_(2)
            if graphs and i % 3 == 0:
                g = accel.Graph(capture_error_mode="thread_local")
                with s, g:
                    b.fill_(3)
                g.replay()
            accel.synchronize(d)
        except BaseException as exc:   # reported by the cycle
            errors.append(exc)

    def cycle(i, d):
        errors = []
        t = threading.Thread(target=body, args=(i, d, errors))
        t.start()
        t.join()
        assert not errors, errors[0]
    soak(cycle)


def test_graphs_with_registered_user_generators(sim2):
    """User generators (and their cloned / graph-safe states) registered with graphs, drawn from
    in the capture, replayed, then graph and generators dropped (r44's graph-safe states)."""
    _needs_graphs()
    if not _philox_kernels() or not hasattr(accel.Graph, "register_generator_state"):
        pytest.skip("no capturable Philox kernels / no Graph.register_generator_state")

    def cycle(i, d):
        s = accel.Stream(d)
        b = accel.Buffer(4096, device=d, stream=s)
        gen = accel.random.Generator(d, seed=i)
        state = gen.clone_state() if i % 2 else gen.graphsafe_get_state()
        g = accel.Graph()
        g.register_generator_state(gen)
        if i % 2:
            g.register_generator_state(state)        # a state of its own
        with s, g:
            accel.random.uniform_(b, generator=state)
            accel.random.normal_(b, generator=gen)
        g.replay()
        g.replay()
        if i % 2 == 0:
            g.reset()
        elif i % 4 == 1:
            _Cycle(g, gen, state)
        del g, gen, state, s, b
    soak(cycle)


def test_graphs_and_streams_under_the_async_allocator(sim2, monkeypatch):
    """backend:cudaMallocAsync: the graph's own allocations (its token) and the stream-ordered
    frees of dropped streams leave nothing behind."""
    if not getattr(_backend(), "supports_async_alloc", False):
        pytest.skip(f"{_backend().name}: no stream-ordered allocator")
    monkeypatch.setenv("ACCEL_ALLOC_CONF", "backend:cudaMallocAsync")
    accel._lazy._reset_for_tests()

    def cycle(i, d):
        _graph_cycle(i, d)
        s = accel.Stream(d)
        b = accel.Buffer(8192, device=d, stream=s)
        b.fill_(1, stream=s)
        del s
        if i % 2:
            _Cycle(b)
        del b
    soak(cycle)


def test_mempool_shared_with_a_graph(sim2):
    """A MemPool's id given to a capture (torch: graph(g, pool=mempool.id)); pool and graph dropped
    in either order."""
    _needs_graphs()

    def cycle(i, d):
        with accel.device_index(d):
            pool = accel.memory.MemPool()
            s = accel.Stream(d)
            g = accel.Graph()
            with accel.graphs.graph(g, pool=pool.id, stream=s):
                b = accel.Buffer(4096, device=d)
                b.fill_(5)
            g.replay()
        if i % 2:
            del pool
            g.reset()
        else:
            del g
            del pool
        del b, s
    soak(cycle)
