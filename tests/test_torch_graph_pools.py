"""Ported from PyTorch's own tests and sources (issue 16, "Allocator counters and pools"):
graph pool ids, the generator's graph seed/offset holders, empty-capture warnings,
manual_seed during capture, instantiate/raw graph access, and num_sync_all_streams.

Each test names its origin: torch's test/test_cuda.py (TestCudaGraph / TestCuda) or the
C++ source whose behaviour it checks (aten/src/ATen/cuda/CUDAGraph.cpp,
aten/src/ATen/cuda/CUDAGeneratorImpl.cpp, c10/cuda/CUDACachingAllocator.cpp)."""

import gc
import warnings

import pytest

import accel
from accel import Graph, memory

SMALL_BLOCK = 512


def _capture(g, buf, stream):
    with stream, g:
        buf.fill_(3)


def test_cuda__graph_pool_handle_ids_follow_mempool_convention(sim_graph_backend):
    # CUDAGraph.cpp / MemPool::graph_pool_handle: user handles are {0, n}, a graph's own
    # pool (capture_begin without a pool) is {n, 0}.
    h1, h2 = accel.graphs.graph_pool_handle(), accel.graphs.graph_pool_handle()
    assert h1[0] == 0 and h2[0] == 0 and 0 < h1[1] < h2[1]
    s = accel.Stream()
    buf = accel.Buffer(64, stream=s)
    g = Graph()
    _capture(g, buf, s)
    own = g.pool()
    assert own[0] > 0 and own[1] == 0
    shared = Graph(pool=h1)
    _capture(shared, buf, s)
    assert shared.pool() == h1


def test_cuda__empty_capture_warns(sim_graph_backend):
    # CUDAGraph::capture_end: TORCH_WARN("The CUDA Graph is empty. ...")
    s = accel.Stream()
    g = Graph()
    name = accel.current_accelerator().type.upper()
    with pytest.warns(UserWarning, match=f"The {name} Graph is empty. This usually means that the graph was "
                                         "attempted to be captured on wrong device or stream."):
        with s, g:
            pass
    buf = accel.Buffer(64, stream=s)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _capture(Graph(), buf, s)


def test_cuda__graph_manual_seed_same_seed_is_allowed_during_capture(sim_graph_backend):
    # test_cuda.py::TestCudaGraph test_graph_manual_seed_mismatch_raises and its same-seed twin
    accel.random.manual_seed(0)
    s = accel.Stream()
    g = Graph()
    with s, g:
        accel.random.manual_seed(0)          # the same seed: a no-op
    prefix = "CUDA" if accel.current_accelerator().type == "cuda" else "XPU"
    g2 = Graph()
    with pytest.raises(RuntimeError, match=f"{prefix}GeneratorImpl::set_current_seed can be called during "
                                           "stream capture only if new seed is the same as the original seed."):
        with s, g2:
            accel.random.manual_seed(1)


def test_cuda__instantiate_twice_without_keep_graph_raises(sim_graph_backend):
    # CUDAGraph::instantiate: "instantiate() is intended to be called by the user only when keep_graph=true"
    s = accel.Stream()
    buf = accel.Buffer(64, stream=s)
    g = Graph()
    _capture(g, buf, s)
    with pytest.raises(RuntimeError, match=r"instantiate\(\) is intended to be called by the user only when "
                                           "keep_graph=true"):
        g.instantiate()
    with pytest.raises(RuntimeError, match=r"capture_end\(\) must have been called before calling instantiate"):
        Graph(keep_graph=True).instantiate()


def test_cuda__raw_cuda_graph_needs_keep_graph(sim_graph_backend):
    # CUDAGraph::raw_cuda_graph / raw_cuda_graph_exec
    s = accel.Stream()
    buf = accel.Buffer(64, stream=s)
    g = Graph()
    _capture(g, buf, s)
    with pytest.raises(RuntimeError, match="You cannot access the raw cudaGraph_t instance unless CUDAGraph "
                                           "was initialized with keep_graph=true"):
        g.raw_cuda_graph()
    assert g.raw_cuda_graph_exec() != 0
    kept = Graph(keep_graph=True)
    with pytest.raises(RuntimeError, match=r"until capture_end\(\) has been called"):
        kept.raw_cuda_graph()
    _capture(kept, buf, s)
    assert kept.raw_cuda_graph() != 0 and kept.raw_graph() == kept.raw_cuda_graph()
    with pytest.raises(RuntimeError, match=r"until instantiate\(\) has been called"):
        kept.raw_cuda_graph_exec()
    kept.instantiate()
    assert kept.raw_cuda_graph_exec() != 0


@pytest.mark.parametrize("conf", ["expandable_segments:False", "expandable_segments:True"])
def test_cuda__graph_memory_stats_count_rng_holders(sim_graph_backend, monkeypatch, conf):
    # test_cuda.py::TestCudaGraph::test_graph_memory_stats_and_use_result_after_destroy_graph:
    # small pool: "one from b plus a sneaky two from CUDAGraph's one-element rng seed and
    # offset holders"; after the graph is deleted only b remains.
    monkeypatch.setenv("ACCEL_ALLOC_CONF", conf)
    gc.collect()
    memory.empty_cache()
    s = accel.Stream()
    a = accel.Buffer(SMALL_BLOCK, stream=s)
    before = memory.memory_stats()
    g = Graph()
    with s, g:
        b = accel.Buffer(SMALL_BLOCK, stream=s)
        b.copy_from(a, non_blocking=True)
    after = memory.memory_stats()
    # With expandable segments (accel's policy) the general cache has one address range per
    # stream (E12 in accel/memory/_expandable.py): the two holders are blocks of its large
    # segment, counted in large_pool as torch counts every block by its segment's pool; b is
    # the graph pool's, which keeps classic small segments.
    holders = "large_pool" if conf == "expandable_segments:True" else "small_pool"
    delta = {pool: after[f"active.{pool}.current"] - before[f"active.{pool}.current"]
             for pool in ("small_pool", "large_pool")}
    delta_bytes = {pool: after[f"active_bytes.{pool}.current"] - before[f"active_bytes.{pool}.current"]
                   for pool in ("small_pool", "large_pool")}
    assert delta["small_pool"] + delta["large_pool"] == 3 and delta[holders] >= 2
    assert delta_bytes["small_pool"] + delta_bytes["large_pool"] == 3 * SMALL_BLOCK
    assert delta_bytes[holders] >= 2 * SMALL_BLOCK
    del g
    gc.collect()
    memory.empty_cache()
    gone = memory.memory_stats()
    assert gone["active.small_pool.current"] - before["active.small_pool.current"] == 1
    assert gone["active_bytes.small_pool.current"] - before["active_bytes.small_pool.current"] == SMALL_BLOCK
    assert gone["active.large_pool.current"] == before["active.large_pool.current"]
    b.close()
    a.close()


def test_caching_allocator__every_empty_cache_counts_a_sync_all_streams(sim_cuda):
    # CUDACachingAllocator.cpp synchronize_and_free_events: stats.num_sync_all_streams++ on
    # every call, i.e. on every empty_cache (and OOM retry), events outstanding or not.
    accel.Buffer(4096).close()
    n = memory.memory_stats()["num_sync_all_streams"]
    memory.empty_cache()
    memory.empty_cache()
    assert memory.memory_stats()["num_sync_all_streams"] == n + 2


def test_cuda__capture_on_default_stream_message(sim_cuda):
    # torch/cuda/graphs.py / CUDAGraph.cpp: "CUDA graphs must be captured on a non-default stream."
    with pytest.raises(RuntimeError, match=r"CUDA graphs must be captured on a non-default stream\. "
                                           r"\(However, after capture, it's ok to replay them on the default stream\.\)"):
        Graph().capture_begin()
