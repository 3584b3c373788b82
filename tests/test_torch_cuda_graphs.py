"""PyTorch's CUDA-graph tests from test/test_cuda.py (TestCuda test_graph_*, test_cuda_graph_*,
TestCachingHostAllocatorCudaGraph, TestMemPool's pool ids), ported to accel (issue 16).

torch's captured bodies are tensor math (``b = b + 1``); accel captures copies and fills, so
each port keeps the data flow that the test checks with Buffers: a temporary is a new
``accel.Buffer`` allocated during the capture (from the graph's private pool), ``a.clone()``
is a new Buffer plus ``copy_from(a, non_blocking=True)`` (a blocking copy would synchronize
the capturing stream, which the capture rules forbid), and "the value" of a buffer is a byte
pattern written by ``fill_`` or copied from a host array.  The CUDA and Level Zero simulators
capture (Level Zero without cross-stream capture: the tests that fork the capture into a second
stream run on CUDA only); Metal has no graphs.  tests/TORCH_PORTS.md lists every case and why.
"""

import gc
import threading

import numpy as np
import pytest

import accel
from accel import Graph, memory
from accel._errors import CaptureError, OutOfMemoryError

from conftest import use_sim

MiB = 1 << 20
kSmallSize = 1048576
kSmallBuffer = 2097152
kLargeBuffer = 20971520
kMinLargeAlloc = 10485760
kRoundLarge = 2097152


def _clone(src: accel.Buffer) -> accel.Buffer:
    """``src.clone()`` inside a capture: a new block of the current stream's pool, copied
    in stream order."""
    out = accel.Buffer(src.nbytes)
    out.copy_from(src, non_blocking=True)
    return out


def _value(buf: accel.Buffer) -> int:
    """The byte every position of ``buf`` holds (asserting they agree)."""
    data = buf.to_numpy()
    assert (data == data[0]).all(), data
    return int(data[0])


def _filled(n: int, value: int, stream=None) -> accel.Buffer:
    return accel.Buffer(n, stream=stream).fill_(value, stream)


# ------------------------------------------------------------------ capture and replay
def test_cuda__test_graph_capture_simple(sim_graph_backend):
    s = accel.Stream()
    with s:
        a = _filled(1000, 1)
        g = Graph()
        memory.empty_cache()
        g.capture_begin()
        b = a
        for step in range(10):
            b = _clone(b)                       # b = b + 1: ten temporaries of the graph's pool
        b.fill_(11)
        g.capture_end()
    accel.current_stream().wait_stream(s)
    g.replay()
    assert _value(b) == 11


def test_cuda__test_accelerator_graph_simple(sim_graph_backend):
    s = accel.Stream()
    g = Graph()
    assert not accel.current_stream().is_capturing()
    with s, g:
        a = _filled(1000, 1)
        b = a
        assert s.is_capturing()
        for _ in range(10):
            b = _clone(b)
        b.fill_(11)
    accel.current_stream().wait_stream(s)
    assert not accel.current_stream().is_capturing()
    g.replay()
    assert _value(b) == 11


def test_cuda__test_graph_capture_reset_recapture(sim_graph_backend):
    s = accel.Stream()
    with s:
        a = _filled(1000, 1)
        g = Graph()
        memory.empty_cache()
        g.capture_begin()
        b = _clone(a)
        b.fill_(11)
        g.capture_end()
    accel.current_stream().wait_stream(s)
    g.replay()
    assert _value(b) == 11

    g.reset()
    with s:
        g.capture_begin()
        b.fill_(2)
        c = _clone(b)
        c.fill_(22)
        g.capture_end()
    accel.current_stream().wait_stream(s)
    g.replay()
    assert _value(c) == 22
    g.reset()
    del g


def test_cuda__test_graph_debugdump(sim_cuda, tmp_path):
    memory.empty_cache()
    x = accel.Buffer(4 * 10240)
    y = accel.Buffer(4 * 10240)
    g = Graph()
    g.enable_debug_mode()
    s0, s1 = accel.Stream(), accel.Stream()
    s0.wait_stream(accel.current_stream())
    with s0:
        g.capture_begin()
        z = _clone(x)
        with s1:
            s1.wait_stream(s0)
            y.copy_from(z, non_blocking=True)
        s0.wait_stream(s1)
        g.capture_end()
    s0.synchronize()
    accel.synchronize()
    path = tmp_path / "out_multi_stream.dot"
    g.debug_dump(str(path))
    assert path.read_text().lstrip().startswith("digraph")


def test_cuda__test_graph_timing(sim_cuda):
    memory.empty_cache()
    x = accel.Buffer(4 * 10240)
    g = Graph()
    start_event = accel.Event(enable_timing=True, external=True)
    end_event = accel.Event(enable_timing=True, external=True)
    with accel.graph(g):
        start_event.record()
        _clone(x)
        end_event.record()
    accel.synchronize()
    g.replay()
    accel.synchronize()
    assert start_event.elapsed_time(end_event) >= 0


def test_cuda__test_graph_error():
    # capture_begin on the default stream (torch runs it in a subprocess: on CUDA the failed
    # capture leaves the context unusable; accel refuses before calling the runtime)
    import subprocess
    import sys
    script = """\
import accel
g = accel.Graph()
try:
    g.capture_begin()
except RuntimeError as e:
    if "CUDA graphs must be captured on a non-default stream." in str(e):
        exit(0)
    else:
        exit(1)
exit(2)
"""
    out = subprocess.run([sys.executable, "-c", script], env={"PATH": "/usr/bin:/bin", "ACCEL_SIM": "cuda"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr)


def test_cuda__test_graph_capture_oom(sim_graph_backend):
    with pytest.raises(OutOfMemoryError, match="out of memory"):
        with accel.graph(Graph()):
            accel.Buffer(4 * 2 ** 40)                  # torch.zeros(2**40) floats


def test_cuda__test_graph_is_current_stream_capturing_in_graph_context(sim_graph_backend):
    # test_graph_is_current_stream_capturing through accel.graph (torch.cuda.graph)
    assert not accel.is_current_stream_capturing()
    g = Graph()
    with accel.graph(g):
        assert accel.is_current_stream_capturing()
        _filled(16, 1)
    assert not accel.is_current_stream_capturing()


# ------------------------------------------------------------------ pools shared between graphs
_SHARING = ("Don't share", "via pool()", "via graph_pool_handle()")


@pytest.mark.parametrize("conf", ["policy:torch,expandable_segments:False", ""])
def test_cuda__test_graph_two_successive(monkeypatch, conf):
    """Two graphs captured one after the other, alone or sharing a pool; eager work between
    replays.  With torch's segment policy, sharing saves exactly one small segment (torch's
    kSmallBuffer)."""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF=conf)
    memory.empty_cache()
    size = 1000
    s = accel.Stream()
    reserved_no_sharing = None

    def func_with_temps(t, val):
        x = _clone(t)
        y = _clone(t)
        out = accel.Buffer(t.nbytes)
        out.copy_from(x, non_blocking=True)
        del x, y
        out.fill_(val)
        return out

    for share_mem in _SHARING:
        g0, g1 = Graph(), Graph()
        a = _filled(size, 1)
        s.wait_stream(accel.current_stream())
        with s:
            g0_args = accel.graphs.graph_pool_handle() if share_mem == "via graph_pool_handle()" else None
            g0.graph_pool = g0_args
            g0.capture_begin()
            b = _clone(a)
            for i in range(5):
                b = func_with_temps(b, 10 + i)
            g0.capture_end()

            g1.graph_pool = g0.pool() if share_mem == "via pool()" else g0_args
            g1.capture_begin()
            for i in range(5):
                b = func_with_temps(b, 20 + i)
            g1.capture_end()
        accel.current_stream().wait_stream(s)

        # mixes unrelated eager ops with replays
        c = _clone(a)
        for i in range(2):
            c = func_with_temps(c, 30 + i)
        g0.replay()
        for i in range(2):
            c = func_with_temps(c, 40 + i)
        g1.replay()
        for i in range(2):
            c = func_with_temps(c, 50 + i)
        assert _value(b) == 24
        assert _value(c) == 51

        if conf.startswith("policy:torch"):
            reserved = memory.memory_stats()["reserved_bytes.all.current"]
            if share_mem != "Don't share":
                assert reserved_no_sharing - reserved == kSmallBuffer
            else:
                reserved_no_sharing = reserved
        del a, b, c, g0, g1
        accel.synchronize()
        memory.empty_cache()


def test_cuda__test_graph_concurrent_replay(sim_graph_backend):
    """The "Don't share" half: two graphs with their own pools replayed concurrently on two
    streams don't corrupt each other (the shared-pool half expects corruption, which depends
    on the device's scheduling and is not asserted by torch either on cudaMallocAsync)."""
    memory.empty_cache()
    size = 100000
    s = accel.Stream()
    g0, g1 = Graph(), Graph()
    s0, s1 = accel.Stream(), accel.Stream()
    a = _filled(size, 1)
    s.wait_stream(accel.current_stream())
    with s:
        g0.capture_begin()
        b = _clone(a)
        for i in range(5):
            t = _clone(b)
            t.fill_(10 + i)
            b = _clone(t)
        g0.capture_end()
        g1.capture_begin()
        c = _clone(a)
        for i in range(5):
            t = _clone(c)
            t.fill_(20 + i)
            c = _clone(t)
        g1.capture_end()
    accel.synchronize()
    with s0:
        s1.wait_stream(s0)
        g0.replay()
    with s1:
        g1.replay()
    accel.current_stream().wait_stream(s0)
    accel.current_stream().wait_stream(s1)
    assert _value(b) == 14
    assert _value(c) == 24
    del a, b, c, g0, g1
    accel.synchronize()
    memory.empty_cache()


@pytest.mark.parametrize("share_mem", _SHARING)
def test_cuda__test_graph_three_successive(sim_graph_backend, share_mem):
    """Replaying in capture order is valid; replaying g0, g2, g1 is valid only when they don't
    share a pool: sharing lets g2's capture reuse c's memory (freed in g1) for f, so g1 then
    reads f's bytes where it expects c's."""
    memory.empty_cache()
    size = 1000
    s = accel.Stream()
    a = _filled(size, 1)
    g0, g1, g2 = Graph(), Graph(), Graph()
    s.wait_stream(accel.current_stream())
    with s:
        g0_args = accel.graphs.graph_pool_handle() if share_mem == "via graph_pool_handle()" else None
        g0.graph_pool = g0_args
        g0.capture_begin()
        b = _clone(a)
        c = _clone(b)
        c.fill_(2)                                # c = b + 1
        d = _clone(b)
        d.fill_(3)                                # d = b + 2
        g0.capture_end()

        args = g0.pool() if share_mem == "via pool()" else g0_args
        g1.graph_pool = args
        g1.capture_begin()
        e = _clone(c)                             # e = c + 3: e reads c
        e_out = _clone(e)
        del c
        g1.capture_end()

        g2.graph_pool = args
        g2.capture_begin()
        f = _clone(d)
        f.fill_(7)                                # f = d + 4
        g2.capture_end()
    accel.current_stream().wait_stream(s)

    g0.replay()
    g1.replay()
    g2.replay()
    assert _value(e_out) == 2
    assert _value(f) == 7

    g0.replay()
    g2.replay()
    g1.replay()
    expect_corruption = share_mem != "Don't share"
    assert _value(e_out) == (7 if expect_corruption else 2)
    assert _value(f) == 7
    del a, b, d, e, e_out, f, g0, g1, g2
    accel.synchronize()
    memory.empty_cache()


# ------------------------------------------------------------------ graph memory statistics
_STATS = ("segment.", "reserved_bytes.", "active.", "active_bytes.")
_CASES = (
    (512, 1, kSmallBuffer, kSmallBuffer, "small_pool"),
    (kSmallSize, 2, 2 * kSmallBuffer, kSmallBuffer, "small_pool"),
    (kSmallSize + 512, 1, kLargeBuffer, kLargeBuffer, "large_pool"),
    (kMinLargeAlloc - 512, 2, 2 * kLargeBuffer, kLargeBuffer, "large_pool"),
    (kMinLargeAlloc + 512, 3, 3 * (kRoundLarge * ((kMinLargeAlloc + 512 + kRoundLarge - 1) // kRoundLarge)),
     kRoundLarge * ((kMinLargeAlloc + 512 + kRoundLarge - 1) // kRoundLarge), "large_pool"),
)


@pytest.mark.parametrize("case", range(len(_CASES)))
def test_cuda__test_graph_memory_stats_and_use_result_after_destroy_graph(monkeypatch, case):
    """All five sizes of torch's test, with torch's segment policy (accel's own policy sizes
    segments differently, on purpose; README "Where accel differs from torch")."""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="policy:torch,expandable_segments:False")
    nbytes, delta_mallocs, delta_malloc_bytes, delta_malloc_bytes_post_del_g, pool = _CASES[case]
    gc.collect()
    memory.empty_cache()
    s = accel.Stream()
    if pool == "small_pool":
        delta_active_blocks = 3            # b plus the graph's RNG seed and offset holders
        delta_active_bytes = nbytes + 1024
    else:
        delta_active_blocks = 1
        delta_active_bytes = nbytes
    g = Graph()
    s.wait_stream(accel.current_stream())
    with s:
        a = _filled(nbytes, 1)
        precapture = memory.memory_stats()
        g.capture_begin()
        b = _clone(a)
        for step in range(5):              # b = b.clone() + 1: a temporary and a result
            t = _clone(b)
            r = _clone(t)
            del t
            r.fill_(2 + step)
            b = r
        del r
        g.capture_end()
    accel.current_stream().wait_stream(s)
    gc.collect()
    postcapture = memory.memory_stats()
    expecteds = (delta_mallocs, delta_malloc_bytes, delta_active_blocks, delta_active_bytes)
    for i in range(2):
        for stat, expected in zip(_STATS, expecteds):
            key = stat + pool + ".current"
            assert postcapture[key] - precapture[key] == expected, key
        g.replay()
        assert _value(b) == 6
        if i == 0:
            memory.empty_cache()
    del g
    gc.collect()
    memory.empty_cache()
    postdel = memory.memory_stats()
    assert _value(b) == 6                  # b outlives its graph
    # b is the only live block of the graph's pool
    expecteds = (1, delta_malloc_bytes_post_del_g, 1, nbytes)
    for stat, expected in zip(_STATS, expecteds):
        key = stat + pool + ".current"
        assert postdel[key] - precapture[key] == expected, key
    del a, b
    accel.synchronize()
    memory.empty_cache()


def test_cuda__test_graph_record_stream(sim_cuda):
    """Capture defers reclaiming blocks used across streams: a block freed with pending
    record_stream events before the capture is not event-queried during it (which would
    invalidate the capture), and a record_stream inside the capture is harmless."""
    memory.empty_cache()
    potential_problem = _filled(12, 0)
    a = _filled(12, 0)
    s0, s1, s2 = accel.Stream(), accel.Stream(), accel.Stream()
    g = Graph()
    accel.synchronize()
    with s0:
        potential_problem.record_stream(s0)
        potential_problem.fill_(1)
    del potential_problem
    with s1:
        g.capture_begin()
        b = _clone(a)
        s2.wait_stream(s1)
        with s2:
            b.fill_(1)
            b.record_stream(s2)
            del b
        s1.wait_stream(s2)
        g.capture_end()
    accel.synchronize()
    _filled(12, 0)              # a dummy allocation processes b's end-of-life event


def test_cuda__test_cuda_graph_error_options(sim_graph_backend):
    """A thread that allocates (on its own stream) while another thread captures is legal in
    the thread_local and relaxed modes."""
    def fn():
        x = _filled(2000 * 4, 0)
        return _clone(x)

    def raw_malloc(errors):
        stream = accel.Stream()
        try:
            with stream:
                alloc = memory.device_allocator(stream.device_index)
                ptr = alloc.malloc(1024, stream.handle)
            alloc.free(ptr)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def throws_on_event(mode):
        graph = Graph()
        accel.synchronize()
        stream = accel.Stream()
        stream.wait_stream(accel.current_stream())
        with stream:
            fn()
        stream.synchronize()
        accel.current_stream().wait_stream(stream)
        accel.synchronize()
        errors = []
        try:
            with accel.graph(graph, stream=stream, capture_error_mode=mode):
                fn()
                thread = threading.Thread(target=raw_malloc, args=(errors,))
                thread.start()
                thread.join()
        except Exception:  # noqa: BLE001
            return True
        return bool(errors)

    assert not throws_on_event("thread_local")
    assert not throws_on_event("relaxed")


def test_cuda__test_cuda_graph_raw_graph(sim_cuda):
    # torch reads the raw cudaGraph_t with cuda-python; accel's own binding counts its nodes
    graph = Graph(keep_graph=True)
    x = _filled(2000 * 4, 0)
    with accel.graph(graph, capture_error_mode="relaxed"):
        z = _clone(x)
    raw = graph.raw_cuda_graph()
    backend = accel._lazy.lazy_init()
    assert backend.graph_node_count(raw) > 0
    graph.replay()


@pytest.mark.parametrize("keep_graph", [True, False])
def test_cuda__test_cuda_graph_raw_graph_exec(sim_cuda, keep_graph):
    graph = Graph(keep_graph=keep_graph)
    x = _filled(2000 * 4, 0)
    with accel.graph(graph, capture_error_mode="relaxed"):
        z = _clone(x)
    if keep_graph:
        with pytest.raises(RuntimeError, match=r"You cannot access the raw (cuda|hip)GraphExec_t instance until "
                                               r"instantiate\(\) has been called"):
            graph.raw_cuda_graph_exec()
        graph.instantiate()
    assert graph.raw_cuda_graph_exec() != 0
    graph.replay()


def test_cuda__test_cuda_graph_raw_graph_reset_and_recapture(sim_graph_backend):
    graph = Graph(keep_graph=True)
    src = accel.Buffer(2000 * 4).copy_from(np.arange(8000, dtype=np.uint8) % 7)
    x = _filled(2000 * 4, 0)
    with accel.graph(graph, capture_error_mode="relaxed"):
        x.copy_from(src, non_blocking=True)       # x += 1 in torch
    graph.instantiate()
    graph.replay()
    assert (x.to_numpy() == src.to_numpy()).all()
    # instantiate twice
    x.fill_(0)
    graph.instantiate()
    graph.replay()
    assert (x.to_numpy() == src.to_numpy()).all()
    graph.reset()
    # a new capture, writing a new buffer
    x = _filled(2000 * 4, 0)
    with accel.graph(graph, capture_error_mode="relaxed"):
        x.fill_(2)
    graph.instantiate()
    graph.replay()
    assert _value(x) == 2
    graph.instantiate()
    graph.replay()
    assert _value(x) == 2


def test_cuda__test_cuda_graph_allocator_propagates_stream(sim_cuda):
    """Allocations on a second stream that joined the capture go to the graph's pool too."""
    x = _filled(10240 * 4, 1)
    y = _filled(10240 * 4, 2)
    # (torch's test process has allocated long before, so its default pool is "existing")
    existing_pools = {s["segment_pool_id"] for s in memory.memory_snapshot()}
    g = Graph()
    s0, s1 = accel.Stream(), accel.Stream()
    s0.wait_stream(accel.current_stream())
    with s0:
        g.capture_begin()
        z = _clone(x)
    with s1:
        s1.wait_stream(s0)
        w = _clone(y)                              # z + y on s1
    s0.wait_stream(s1)
    with s0:
        g.capture_end()
    pools = [s["segment_pool_id"] for s in memory.memory_snapshot() if s["segment_pool_id"] not in existing_pools]
    assert len(pools) == 2
    assert pools[0] == pools[1]


def test_cuda__test_cuda_graph_tensor_item_not_allowed(sim_graph_backend):
    # Tensor.item() synchronizes, which a capture forbids: accel's host copy is refused
    a = _filled(16, 1)
    g = Graph()
    with pytest.raises(CaptureError):
        with accel.graph(g):
            a.to_numpy()


# ------------------------------------------------------------------ pinned host memory and graphs
def test_cuda__test_pin_memory_no_use(sim_graph_backend):
    # TestCachingHostAllocatorCudaGraph: a live pinned block is never handed out twice
    graph = Graph()
    with accel.graph(graph, capture_error_mode="thread_local"):
        data = accel.empty_pinned(8, np.float32)
        data2 = accel.empty_pinned(8, np.float32)
    assert data.ctypes.data != data2.ctypes.data
    del data2


def test_cuda__test_pin_memory_no_use2(sim_graph_backend):
    # a pinned block deleted during the capture and never used by a copy can be reused
    graph = Graph()
    with accel.graph(graph, capture_error_mode="thread_local"):
        data = accel.empty_pinned(8, np.float32)
        data_ptr = data.ctypes.data
        del data
        data2 = accel.empty_pinned(8, np.float32)
        assert data2.ctypes.data == data_ptr


@pytest.mark.parametrize("use_memory", [True, False])
@pytest.mark.parametrize("delete_memory", [True, False])
def test_cuda__test_two_graphs(sim_graph_backend, use_memory, delete_memory):
    # a pinned block a captured copy used stays out of reuse while its graph lives, across a
    # second capture into the same pool (torch parametrizes background threads and
    # cudaHostRegister too: accel takes those settings and ignores them)
    shared_pool = accel.graphs.graph_pool_handle()
    graph1, graph2 = Graph(), Graph()
    with accel.graph(graph1, pool=shared_pool):
        data = accel.empty_pinned(8, np.float32)
        if use_memory:
            data_gpu = accel.Buffer(32)
            data_gpu.copy_from(data, non_blocking=True)
        old_data_ptr = data.ctypes.data
        if delete_memory:
            del data
    with accel.graph(graph2, pool=shared_pool):
        data2 = accel.empty_pinned(8, np.float32)
        if use_memory:
            data_gpu = accel.Buffer(32)
            data_gpu.copy_from(data2, non_blocking=True)
        new_data_ptr = data2.ctypes.data
        if delete_memory:
            del data2
    if delete_memory and not use_memory:
        assert new_data_ptr == old_data_ptr
    else:
        assert new_data_ptr != old_data_ptr


def test_cuda__test_unpinned_memory_use(sim_graph_backend):
    graph = Graph()
    name = accel.current_accelerator().type.upper()
    with pytest.raises(RuntimeError, match=f"Cannot copy between CPU and {name} tensors during {name} graph capture"):
        with accel.graph(graph):
            data = np.empty(8, np.float32)
            data_gpu = accel.Buffer(32)
            data_gpu.copy_from(data, non_blocking=True)


def test_cuda__test_unpinned_memory_use_device_to_host(sim_graph_backend):
    graph = Graph()
    name = accel.current_accelerator().type.upper()
    with pytest.raises(RuntimeError, match=f"Cannot copy between CPU and {name} tensors during {name} graph capture"):
        with accel.graph(graph):
            data_gpu = accel.Buffer(32)
            data = np.empty(8, np.float32)
            data_gpu.copy_to(data, non_blocking=True)


# ------------------------------------------------------------------ pool ids
def test_cuda__test_mempool_id(sim_graph_backend):
    # TestMemPool.test_mempool_id's graph_pool_handle half (accel.MemPool's ids: tests/test_torch_mempool.py)
    pool1 = accel.graphs.graph_pool_handle()
    pool3 = accel.graphs.generate_graph_pool_handle()
    assert pool1[0] == 0 and pool3[0] == 0          # user-created ids are (0, n)
    assert pool3[1] - pool1[1] > 0                   # each call increments the id


def test_cuda__test_mempool_multithread(sim_graph_backend):
    # ids handed out from several threads at once are unique
    ids = []

    def make():
        ids.append(accel.graphs.graph_pool_handle())

    threads = [threading.Thread(target=make) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 4


# ------------------------------------------------------------------ RNG in graphs
# (CUDA only: the Level Zero backend has no Philox kernels, so it refuses to capture fills)
_RNG_FILLS = (
    ("uniform_", lambda b: accel.random.uniform_(b)),
    ("normal_", lambda b: accel.random.normal_(b, 1.0, 1.0)),
    ("randint_", lambda b: accel.random.randint_(b, 0, 3, dtype="int32")),
    ("random_raw_", lambda b: accel.random.random_raw_(b)),
)


@pytest.mark.parametrize("name,fill", _RNG_FILLS, ids=[n for n, _ in _RNG_FILLS])
def test_cuda__test_graph_rng_distributions(sim_cuda, name, fill):
    """Replays draw what eager calls would draw at the same point of the generator: each
    replay reads the seed and offset the generator holds then (a reseed included), and
    advances the offset as the eager calls would."""
    size = 4 * 10000
    alloc = accel.Buffer(size).fill_(0)

    def clone():
        return _clone(alloc)

    accel.random.manual_seed(5)
    dummy, control1, control2 = clone(), clone(), clone()
    for b in (dummy, control1, control2):
        fill(b)

    stream = accel.Stream()
    stream.wait_stream(accel.current_stream())
    with stream:
        accel.random.manual_seed(5)
        g = Graph()
        memory.empty_cache()
        t1, t2 = clone(), clone()
        g.capture_begin()
        fill(t1)
        fill(t2)
        g.capture_end()
    accel.current_stream().wait_stream(stream)
    # capture did not run the fills
    assert (t1.to_numpy() != control1.to_numpy()).any()
    assert (t2.to_numpy() != control2.to_numpy()).any()

    for seed in (6, 314, 271):
        accel.random.manual_seed(seed)
        for b in (dummy, control1, control2):        # the eager controls, after a dummy fill
            fill(b)
        accel.random.manual_seed(seed)
        fill(dummy)                                   # the replay picks up the dummy's increment
        t1.copy_from(alloc)
        t2.copy_from(alloc)
        g.replay()
        assert (t1.to_numpy() == control1.to_numpy()).all()
        assert (t2.to_numpy() == control2.to_numpy()).all()
    accel.synchronize()


def test_cuda__test_graph_rng_functional(sim_cuda):
    """graphed -> eager -> graphed fills draw the same numbers as six eager fills, and a new
    seed changes what replays draw (test_graph_rng_functional with fills for dropout)."""
    size = 4 * 1000
    outs_eager = []
    accel.random.manual_seed(5)
    for _ in range(6):
        outs_eager.append(accel.random.uniform_(accel.Buffer(size)).to_numpy(np.float32))

    graph_out = [accel.Buffer(size) for _ in range(2)]
    stream = accel.Stream()
    stream.wait_stream(accel.current_stream())
    with stream:
        accel.random.manual_seed(5)
        g = Graph()
        memory.empty_cache()
        g.capture_begin()
        for b in graph_out:
            accel.random.uniform_(b)
        g.capture_end()
    accel.current_stream().wait_stream(stream)
    g.replay()
    got = [b.to_numpy(np.float32) for b in graph_out]
    got += [accel.random.uniform_(accel.Buffer(size)).to_numpy(np.float32) for _ in range(2)]
    g.replay()
    got += [b.to_numpy(np.float32) for b in graph_out]
    for a, b in zip(outs_eager, got):
        assert np.array_equal(a, b)

    for seed in (6, 128, 9999):
        accel.random.manual_seed(seed)
        g.replay()
        replayed = [b.to_numpy(np.float32) for b in graph_out]
        assert not np.array_equal(replayed[0], outs_eager[0])
        accel.random.manual_seed(seed)
        eager = [accel.random.uniform_(accel.Buffer(size)).to_numpy(np.float32) for _ in range(2)]
        assert all(np.array_equal(a, b) for a, b in zip(replayed, eager))
    accel.synchronize()


def test_cuda__test_pin_memory_use(sim_graph_backend):
    # TestCachingHostAllocatorCudaGraph: a pinned block used by a captured copy is not reused
    graph = Graph()
    with accel.graph(graph, capture_error_mode="thread_local"):
        data = accel.empty_pinned(8, np.float32)
        data_gpu = accel.Buffer(32)
        data_gpu.copy_from(data, non_blocking=True)
        old_data_ptr = data.ctypes.data
        del data
        data2 = accel.empty_pinned(8, np.float32)
    assert data2.ctypes.data != old_data_ptr
