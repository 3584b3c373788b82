"""Round r74i: torch 2.13's ``torch.cuda.graph`` / ``torch.Event`` / ``MemPool`` / generator
semantics that the earlier ports did not pin, on the simulators with two devices (work on
device 1 while device 0 is current).

Sources (the installed torch 2.13.0+cpu wheel, read and, where it can answer, run):

* torch/cuda/graphs.py ``graph.__enter__``: ``torch.cuda.synchronize()``, ``empty_cache()``,
  ``torch._C._host_emptyCache()`` (the pinned host cache is emptied too), then
  ``capture_begin(*self.pool, capture_error_mode=...)``: the pool and the mode are arguments of
  that one capture; the graph object keeps neither, so a later ``graph(g)`` without ``pool``
  captures into a new private pool.
* torch/csrc/Event.cpp (the wheel's parser string ``Event(Device device=None, *, bool
  enable_timing=False, ...)``): ``c10::Event(device->type(), flag)`` keeps only the type;
  ``record()``/``wait()`` without a stream use ``impl.getStream(impl.getDevice())``, the
  current device's current stream.
* c10/cuda/CUDACachingAllocator.cpp ``beginAllocateToPool(device, id)``: an id the device's
  allocator does not know makes a new private pool there (create_or_incref_pool), so a graph
  captured on device 1 may use the id of a MemPool made on device 0.
* torch.Generator (CPU wheel, run; torch/csrc/Generator.cpp is shared by every device's
  generator): ``manual_seed`` returns the generator, ``seed()`` the new ``initial_seed()``;
  a non-integer seed or offset is a RuntimeError ("manual_seed expected a long, but got
  float", "manual_offset expected a long, but got bool"); ``graphsafe_set_state(5)`` a
  TypeError.  (torch also refuses numpy integers, "an integer is required"; accel takes
  them: a superset, not tested.)

The accel bugs found here were strict xfails first, fixed in session 35.
"""

import gc

import numpy as np
import pytest

import accel
from accel import Graph, memory

from conftest import use_sim

try:
    import torch
except ImportError:         # pragma: no cover - CI installs torch 2.13's CPU build
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch (the oracle) is not installed")

R = accel.random


def _host_cached_bytes() -> int:
    """Bytes of pinned blocks the host cache owns (active + cached): torch's
    ``host_memory_stats()["allocated_bytes.current"]``."""
    return memory.host_memory_stats()["allocated_bytes.current"]


# -- torch.cuda.graph ------------------------------------------------------------------------------
# (r74i found; fixed in session 35)
def test_cuda_graph__enter_empties_the_host_cache(sim_graph_backend):
    """torch/cuda/graphs.py graph.__enter__: synchronize, empty_cache, _host_emptyCache, then
    capture.  A pinned block freed before the capture is returned by the time the body runs."""
    pinned = accel.empty_pinned(4096, "uint8")
    del pinned
    gc.collect()
    assert _host_cached_bytes() > 0             # cached, not returned
    out = accel.Buffer(4096, device=1)
    g = Graph()
    with accel.device_index(1):
        with accel.graph(g):
            seen = _host_cached_bytes()
            out.fill_(1, accel.current_stream())
    g.replay()
    accel.synchronize(1)
    assert accel.current_device_index() == 0
    assert seen == 0


def test_graph_context_empties_the_host_cache(sim_graph_backend):
    """torch.accelerator.Graph.__enter__ (empty_host_cache()): accel's Graph does it."""
    pinned = accel.empty_pinned(4096, "uint8")
    del pinned
    gc.collect()
    assert _host_cached_bytes() > 0
    out = accel.Buffer(4096, device=1)
    g = Graph()
    with accel.Stream(1), g:
        seen = _host_cached_bytes()
        out.fill_(1, accel.current_stream())
    assert seen == 0 and accel.current_device_index() == 0
    g.replay()
    accel.synchronize(1)


# (r74i found; fixed in session 35)
def test_cuda_graph__pool_argument_is_for_that_capture_only(sim_graph_backend):
    """torch.cuda.graph(g, pool=h) passes h to capture_begin only; after g.reset(),
    torch.cuda.graph(g) captures into a new private pool (CUDAGraph::capture_begin with the
    default {0, 0}: graph_pool_handle(false))."""
    h = accel.graphs.graph_pool_handle()
    out = accel.Buffer(4096, device=1)
    g = Graph()
    with accel.device_index(1):
        with accel.graph(g, pool=h):
            out.fill_(1, accel.current_stream())
        assert g.pool() == h
        g.reset()
        with accel.graph(g):
            out.fill_(2, accel.current_stream())
    g.replay()
    accel.synchronize(1)
    assert g.pool() != h


# (r74i found; fixed in session 35)
def test_cuda_graph__leaves_the_graph_attributes_as_they_were(sim_graph_backend):
    """torch.accelerator.Graph's graph_pool / capture_error_mode are the user's settings for its
    own captures (set at construction or by hand, read by capture_begin); torch.cuda.graph's
    pool and mode are arguments of the capture it begins, not stored on the graph."""
    h = accel.graphs.graph_pool_handle()
    out = accel.Buffer(4096, device=1)
    g = Graph()
    with accel.device_index(1):
        with accel.graph(g, pool=h, capture_error_mode="relaxed"):
            out.fill_(1, accel.current_stream())
    g.replay()
    accel.synchronize(1)
    assert (g.graph_pool, g.capture_error_mode) == (None, "default")


def test_cuda_graph__capture_error_mode_is_per_call(sim_graph_backend):
    """graph(g, capture_error_mode="relaxed") then graph(g): the second capture is "global"
    (torch passes the mode to capture_begin each time)."""
    out = accel.Buffer(4096, device=1)
    g = Graph()
    with accel.device_index(1):
        with accel.graph(g, capture_error_mode="relaxed"):
            out.fill_(1, accel.current_stream())
        g.reset()
        with accel.graph(g):
            mode = g.capture_error_mode
            out.fill_(2, accel.current_stream())
    assert mode in ("global", "default")
    g.replay()
    accel.synchronize(1)


def test_cuda_graph__stream_of_device_1_from_device_0(sim_graph_backend):
    """torch.cuda.graph(g, stream=s1): torch.cuda.stream(s1) makes device 1 current in the body
    and restores device 0 and its stream after; the graph replays on device 1."""
    s1 = accel.Stream(1)
    before = accel.current_stream()
    out = accel.Buffer(4096, device=1)
    g = Graph()
    with accel.graph(g, stream=s1):
        inside = (accel.current_device_index(), accel.current_stream())
        out.fill_(7, s1)
    assert inside == (1, s1)
    assert accel.current_device_index() == 0 and accel.current_stream() == before
    g.replay()
    accel.synchronize(1)
    assert (out.to_numpy() == 7).all()
    assert memory.memory_allocated(0) == 0


def test_cuda_graph__mempool_id_of_device_0_captured_on_device_1(sim_graph_backend):
    """beginAllocateToPool(1, pool.id) of a MemPool made on device 0: device 1's allocator makes
    a private pool of that id (torch does not tie a pool id to a device)."""
    pool = accel.MemPool()                  # device 0 current
    assert pool.device_index == 0
    s1 = accel.Stream(1)
    g = Graph(pool=pool.id)
    with s1, g:
        inner = accel.Buffer(4096, device=1, stream=s1)
        inner.fill_(3, s1)
    assert g.pool() == pool.id
    g.replay()
    accel.synchronize(1)
    assert (inner.to_numpy() == 3).all()
    assert pool.use_count() == 1            # device 0's pool: the capture counted on device 1's
    assert [(seg["device"], tuple(seg["segment_pool_id"])) for seg in pool.snapshot()] == [(1, pool.id)]
    assert memory.memory_allocated(0) == 0
    del inner
    g.reset()


# -- torch.Event -----------------------------------------------------------------------------------
def test_event__device_index_is_dropped_until_record(sim_backend):
    """torch.Event(device='cuda:1') keeps the type only (c10::Event(device->type(), flag));
    record() with no stream records on the current device's current stream."""
    n = accel.device_count()
    name = accel.current_accelerator().type
    e = accel.Event(device=f"{name}:{n - 1}", enable_timing=True)
    assert e.device.index is None and e.event_id == 0
    e.record()
    assert e.device.index == 0
    e.synchronize()
    assert e.query()


def test_event__wait_without_stream_uses_the_current_device(sim_cuda, monkeypatch):
    """THPEvent_wait: no stream -> impl.getStream(impl.getDevice()), the current device's
    current stream (here device 1's side stream), not the event's device's."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=1)
    from torch_port_util import hold
    s0 = accel.current_stream()
    e = accel.Event()
    gate = hold(s0)
    try:
        e.record(s0)
        s1 = accel.Stream(1)
        with s1:
            e.wait()
            marker = s1.record_event()
        assert not marker.query()           # device 1's current stream waits for device 0's work
    finally:
        gate.set()
    marker.synchronize()
    assert marker.query() and e.query()


# -- generators ------------------------------------------------------------------------------------
@needs_torch
def test_generator__seed_and_manual_seed_return_values_as_torch(sim_backend):
    """torch.Generator: manual_seed returns the generator, seed() returns the new
    initial_seed(), -1 wraps to 2**64 - 1 (CPU wheel run); accel's generator of the last device."""
    theirs = torch.Generator()
    ours = R.Generator(accel.device_count() - 1)
    for seed in (12345, -1, 2**64 - 1, 0):
        assert theirs.manual_seed(seed) is theirs and ours.manual_seed(seed) is ours
        assert ours.initial_seed() == theirs.initial_seed()
    assert theirs.seed() == theirs.initial_seed()
    value = ours.seed()
    assert value == ours.initial_seed() and ours.get_offset() == 0
    assert R.default_generator(0).get_offset() == 0     # device 0 untouched


@needs_torch
@pytest.mark.parametrize("bad", ["5", None, 5.5, True, np.float64(2.0)], ids=["str", "None", "float", "bool", "np_float"])
# (r74i found; fixed in session 35)
def test_generator__manual_seed_non_integer_is_a_runtime_error_as_torch(sim_cuda, bad):
    """torch 2.13 CPU wheel: Generator().manual_seed('5' / None / 5.5 / True / np.float64(2.0))
    -> RuntimeError("manual_seed expected a long, but got ...").  The check is in
    torch/csrc/Generator.cpp, shared by every device's generator.  A class that is both
    TypeError and RuntimeError (as accel's _UnknownCaptureMode) would satisfy both."""
    with pytest.raises(RuntimeError, match="expected a long"):
        torch.Generator().manual_seed(bad)
    ours = R.Generator(1)
    before = ours.get_state().tobytes()
    with pytest.raises(RuntimeError, match="expected a long"):
        ours.manual_seed(bad)
    assert ours.get_state().tobytes() == before


@needs_torch
@pytest.mark.parametrize("bad", [True, 5.0, "8", None], ids=["bool", "float", "str", "None"])
# (r74i found; fixed in session 35)
def test_generator__set_offset_non_integer_is_a_runtime_error_as_torch(sim_cuda, bad):
    """torch 2.13 CPU wheel: the argument check runs before the CPU generator's "does not use
    offset" refusal, so it is the same check a CUDA generator makes."""
    with pytest.raises(RuntimeError, match="manual_offset expected a long"):
        torch.Generator().set_offset(bad)
    ours = R.Generator(1).set_offset(8)
    with pytest.raises(RuntimeError, match="manual_offset expected a long"):
        ours.set_offset(bad)
    assert ours.get_offset() == 8


@needs_torch
def test_generator__graphsafe_set_state_non_generator_is_a_type_error_as_torch(sim_cuda):
    """torch: graphsafe_set_state(5) -> TypeError "expected a Generator, but got int"."""
    with pytest.raises(TypeError, match="expected a Generator"):
        torch.Generator().graphsafe_set_state(5)
    with pytest.raises(TypeError):
        R.Generator(1).graphsafe_set_state(5)
