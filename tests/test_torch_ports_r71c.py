"""Round r71c: torch's own tests of the accelerator API, ported to run on **device 1 while
device 0 is current**, and torch 2.13's C++ semantics of the generator and event objects.

Every test name of test_cuda.py / test_accelerator.py / test_xpu.py is already listed in
tests/TORCH_PORTS.md, but the graph, snapshot, pool and generator ports there run on the
current device (device 0) only.  torch's bodies use whatever device is current; on two devices
the same programs run with ``torch.cuda.device(1)`` / ``torch.cuda.stream(s1)`` around them
and are read back (replayed, queried, snapshotted) from device 0.  This file ports those
bodies that way: each test makes its objects on device 1, then works from device 0, and checks
that device 0 (its memory, its generator, its current stream) is left as it was.

Sources read (the stored copies; the installed torch 2.13.0+cpu wheel answers where it can):

* aten/src/ATen/cuda/CUDAGraph.cpp (pytorch/pytorch@00cbb1f8): ``capture_begin`` refuses the
  default stream of the *current* device; ``replay`` runs under an ``OptionalDeviceGuard`` of
  the capture device, on that device's current stream.
* aten/src/ATen/cuda/CUDAGeneratorImpl.cpp (pytorch/pytorch@03e68c4b and newer copies):
  ``createCUDAGenerator`` seeds ``default_rng_seed_val`` with offset 0; ``set_state`` takes 16
  bytes or 8 (seed only, offset 0), else "RNG state is wrong size"; ``set_philox_offset_per_thread``
  "offset must be a multiple of 4"; ``set_current_seed`` and ``seed()`` reset the offset to 0;
  ``getNonDeterministicRandom(true)`` keeps 53 bits; ``graphsafe_get_state`` shares the state.
* aten/src/ATen/cuda/CUDAEvent.h: ``elapsed_time`` checks timing, then "recorded", then
  ``query() && other.query()`` ("Both events must be completed before calculating elapsed
  time."); ``block`` and ``synchronize`` of an unrecorded event do nothing; ``record`` checks
  "Event device N does not match recording stream's device M.".
* c10/cuda/CUDACachingAllocator.cpp: ``synchronize_and_free_events`` counts
  ``num_sync_all_streams`` once per call, on every device's allocator ``emptyCache`` walks.
* torch/cuda/memory.py ``use_mem_pool(pool, device)`` routes only ``device``'s allocations.

Tensors are Buffers (``torch_port_util``/tests/TORCH_PORTS.md conventions).  CUDA simulator,
and the Level Zero one where the test is not about Philox kernels; 2 devices.  Strict xfails
carry reasons starting "r71c:".  tests/TORCH_PORTS_r71c.md lists every case and its outcome.
"""

import gc
import struct
import threading

import numpy as np
import pytest

import accel
from accel import Graph, memory

from conftest import use_sim

try:                        # the oracle (imported here: its ~3 s import is no test's time)
    import torch
except ImportError:         # pragma: no cover - .ci/run installs torch 2.13's CPU build
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch (the oracle) is not installed")

R = accel.random
D1 = 1                      # the device the work is on
kSmallBuffer = 2097152      # torch's small-pool segment


# -- helpers ---------------------------------------------------------------------------------------
def _clone(src: accel.Buffer) -> accel.Buffer:
    """``src.clone()`` inside a capture (on the current device and stream)."""
    out = accel.Buffer(src.nbytes, device=src.device_index)
    out.copy_from(src, non_blocking=True)
    return out


def _value(buf: accel.Buffer) -> int:
    data = buf.to_numpy(stream=accel.current_stream(buf.device_index))
    assert (data == data[0]).all(), data
    return int(data[0])


def _filled(n: int, value: int, device=D1) -> accel.Buffer:
    return accel.Buffer(n, device=device).fill_(value, accel.current_stream(device))


class _Device0:
    """Device 0 current, and what a test on device 1 must leave alone there."""

    def __init__(self):
        accel.set_device_index(0)
        self.stream = accel.current_stream(0)
        self.allocated = memory.memory_allocated(0)
        self.gen_state = R.default_generator(0).get_state().copy()

    def check(self, what=""):
        assert accel.current_device_index() == 0, f"{what}: current device moved"
        assert accel.current_stream(0) == self.stream, f"{what}: device 0's current stream changed"
        assert memory.memory_allocated(0) == self.allocated, f"{what}: device 0's memory changed"
        assert (R.default_generator(0).get_state() == self.gen_state).all(), f"{what}: device 0's generator moved"


@pytest.fixture
def sim2(monkeypatch):
    return use_sim(monkeypatch, "cuda")


@pytest.fixture(params=["cuda", "xpu"])
def graph_sim2(request, monkeypatch):
    return use_sim(monkeypatch, request.param)


# == graphs (test_cuda.py TestCuda) on device 1 ======================================================
def test_cuda__test_graph_capture_simple__device1(graph_sim2):
    """TestCuda.test_graph_capture_simple: capture on a side stream of device 1, replay from
    device 0 (torch: replay's device guard takes the capture device)."""
    d0 = _Device0()
    s = accel.Stream(D1)
    with s:
        assert accel.current_device_index() == D1
        a = _filled(1000, 1)
        g = Graph()
        memory.empty_cache()
        g.capture_begin()
        b = a
        for _ in range(10):
            b = _clone(b)
        b.fill_(11)
        g.capture_end()
    d0.check("capture on device 1")
    # the graph's private pool lives on device 1: its segments (memory_snapshot(mempool_id=))
    # and its reserved_bytes_by_private_pools entry (torch 2.13) are device 1's only
    pool = g.pool()
    segs = memory.memory_snapshot(mempool_id=pool)
    assert segs and all(seg["device"] == D1 for seg in segs)
    key = f"reserved_bytes_by_private_pools.{pool[0]}_{pool[1]}.all.current"
    assert memory.memory_stats(D1)[key] == sum(seg["total_size"] for seg in segs)
    assert key not in memory.memory_stats(0)
    accel.current_stream(D1).wait_stream(s)
    g.replay()
    d0.check("replay")
    assert _value(b) == 11
    del a, b
    g.reset()
    d0.check("reset")


def test_cuda__test_accelerator_graph_simple__device1(graph_sim2):
    """TestCuda.test_accelerator_graph_simple (``with s, g:``) with s of device 1."""
    d0 = _Device0()
    s = accel.Stream(D1)
    g = Graph()
    assert not accel.current_stream(D1).is_capturing()
    with s, g:
        a = _filled(1000, 1)
        b = a
        assert s.is_capturing()
        assert not accel.current_stream(0).is_capturing()
        for _ in range(10):
            b = _clone(b)
        b.fill_(11)
    d0.check("with s, g")
    accel.current_stream(D1).wait_stream(s)
    assert not accel.current_stream(D1).is_capturing()
    g.replay()
    assert _value(b) == 11
    d0.check("replay")


def test_cuda__test_graph_capture_reset_recapture__device1(graph_sim2):
    """TestCuda.test_graph_capture_reset_recapture on device 1: reset() releases the pool and
    the same Graph captures again."""
    d0 = _Device0()
    s = accel.Stream(D1)
    with s:
        a = _filled(1000, 1)
        g = Graph()
        g.capture_begin()
        b = _clone(a)
        b.fill_(11)
        g.capture_end()
    accel.current_stream(D1).wait_stream(s)
    g.replay()
    assert _value(b) == 11
    g.reset()
    with s:
        g.capture_begin()
        b.fill_(2)
        c = _clone(b)
        c.fill_(22)
        g.capture_end()
    accel.current_stream(D1).wait_stream(s)
    g.replay()
    assert _value(c) == 22
    d0.check("recapture")
    g.reset()
    del g


def test_cuda__test_graph_error__device1_default_stream(graph_sim2):
    """TestCuda.test_graph_error on device 1: capture_begin on the current device's default
    stream is refused (CUDAGraph::capture_begin compares with getDefaultCUDAStream() of the
    current device); a side stream of device 1 is fine."""
    d0 = _Device0()
    g = Graph()
    with accel.device_index(D1):
        with pytest.raises(RuntimeError, match="non-default stream"):
            g.capture_begin()
    d0.check("refused capture")
    s = accel.Stream(D1)
    with s, g:
        _filled(64, 3)
    g.reset()


def test_cuda__test_graph_replay__device1_current_stream(monkeypatch):
    """CUDAGraph::replay: ``OptionalDeviceGuard device_guard{capture_stream_.device()}`` then
    ``cudaGraphLaunch(graph_exec_, getCurrentCUDAStream())``: from device 0, a graph of device 1
    replays on device 1's *current* stream (a side stream made current there), not on its
    default stream nor on device 0's."""
    from torch_port_util import hold
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=1)
    d0 = _Device0()
    s = accel.Stream(D1)
    x = _filled(4096, 0)
    accel.synchronize(D1)
    g = Graph()
    with s, g:
        x.fill_(7, s)
    side = accel.Stream(D1)
    accel.set_stream(side)                 # device 1 current, side its current stream
    accel.set_device_index(0)
    d0.check("set_stream on device 1")
    assert accel.current_stream(D1) == side
    gate = hold(side)
    try:
        g.replay()
        d0.check("replay")
        assert not side.query()            # the replay waits behind the gate on `side`
        assert accel.default_stream(D1).query()
    finally:
        gate.set()
    side.synchronize()
    assert (x.to_numpy(stream=side) == 7).all()
    accel.set_stream(accel.default_stream(D1))
    accel.set_device_index(0)
    g.reset()


@pytest.mark.parametrize("share_mem", ["Don't share", "via pool()", "via graph_pool_handle()"])
def test_cuda__test_graph_two_successive__device1(monkeypatch, share_mem):
    """TestCuda.test_graph_two_successive on device 1 with torch's segment policy: sharing a
    pool saves exactly one small segment (kSmallBuffer) of device 1's reserved memory, and
    device 0 reserves nothing."""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="policy:torch,expandable_segments:False")
    d0 = _Device0()
    size = 1000
    s = accel.Stream(D1)

    def func_with_temps(t, val):
        x = _clone(t)
        y = _clone(t)
        out = accel.Buffer(t.nbytes, device=t.device_index)
        out.copy_from(x, non_blocking=True)
        del x, y
        out.fill_(val)
        return out

    def run(share):
        memory.empty_cache()
        g0, g1 = Graph(), Graph()
        a = _filled(size, 1)
        s.wait_stream(accel.current_stream(D1))
        with s:
            g0_args = accel.graphs.graph_pool_handle() if share == "via graph_pool_handle()" else None
            g0.graph_pool = g0_args
            g0.capture_begin()
            b = _clone(a)
            for i in range(5):
                b = func_with_temps(b, 10 + i)
            g0.capture_end()
            g1.graph_pool = g0.pool() if share == "via pool()" else g0_args
            g1.capture_begin()
            for i in range(5):
                b = func_with_temps(b, 20 + i)
            g1.capture_end()
        accel.current_stream(D1).wait_stream(s)
        with accel.device_index(D1):
            c = _clone(a)
            for i in range(2):
                c = func_with_temps(c, 30 + i)
        g0.replay()
        with accel.device_index(D1):
            for i in range(2):
                c = func_with_temps(c, 40 + i)
        g1.replay()
        with accel.device_index(D1):
            for i in range(2):
                c = func_with_temps(c, 50 + i)
        assert _value(b) == 24
        assert _value(c) == 51
        reserved = memory.memory_stats(D1)["reserved_bytes.all.current"]
        assert memory.memory_reserved(0) == 0
        del a, b, c, g0, g1
        accel.synchronize(D1)
        memory.empty_cache()
        return reserved

    no_sharing = run("Don't share")
    if share_mem != "Don't share":
        assert no_sharing - run(share_mem) == kSmallBuffer
    d0.check("two successive graphs on device 1")


def test_cuda__test_graph_memory_stats_and_use_result_after_destroy_graph__device1(monkeypatch):
    """TestCuda.test_graph_memory_stats_and_use_result_after_destroy_graph, one large-pool case
    (2 * 2**20 floats, 8 MiB blocks) on device 1 under torch's policy: the capture's segments
    count on device 1 only (at least one kLargeBuffer); the live result adds its 8 MiB to
    allocated bytes (plus torch 2.13's two 512-byte RNG holders of the default generator, which
    every capture registers); after the graph is deleted the result stays usable and, once it
    goes, device 1 is back where it started."""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="policy:torch,expandable_segments:False")
    d0 = _Device0()
    numel, elem = 2 << 20, 4
    kLargeBuffer = 20971520
    s = accel.Stream(D1)
    memory.empty_cache()
    accel.synchronize(D1)
    before = memory.memory_stats(D1)
    before0 = memory.memory_stats(0)
    g = Graph()
    with s:
        a = _filled(numel * elem, 1)
        accel.synchronize(D1)
        mid = memory.memory_stats(D1)
        g.capture_begin()
        b = _clone(a)
        for _ in range(5):
            b = _clone(b)
        b.fill_(9)
        g.capture_end()
    after = memory.memory_stats(D1)
    # a's own segment (outside the capture), then the graph's pool: two 8 MiB blocks alive at
    # each step round to one 20 MiB segment each as torch's large pool does (kLargeBuffer)
    assert after["segment.all.current"] - mid["segment.all.current"] >= 1
    assert after["reserved_bytes.all.current"] - mid["reserved_bytes.all.current"] >= kLargeBuffer
    assert 0 <= after["allocated_bytes.all.current"] - mid["allocated_bytes.all.current"] - numel * elem <= 2 * 512
    assert memory.memory_stats(0).get("reserved_bytes.all.current", 0) == before0.get("reserved_bytes.all.current", 0)
    accel.current_stream(D1).wait_stream(s)
    g.replay()
    del g
    gc.collect()
    assert _value(b) == 9                  # the result outlives the graph
    del a, b
    accel.synchronize(D1)
    memory.empty_cache()
    end = memory.memory_stats(D1)
    assert end["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert end["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]
    d0.check("graph memory on device 1")


def test_cuda__test_graph_record_stream__device1(sim2):
    """TestCuda.test_graph_record_stream on device 1: a block freed with pending record_stream
    events before the capture is not event-queried during it, and a record_stream inside the
    capture is harmless."""
    d0 = _Device0()
    memory.empty_cache()
    potential_problem = _filled(12, 0)
    a = _filled(12, 0)
    s0, s1, s2 = accel.Stream(D1), accel.Stream(D1), accel.Stream(D1)
    g = Graph()
    accel.synchronize(D1)
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
    accel.synchronize(D1)
    _filled(12, 0)
    d0.check("record_stream capture on device 1")


def test_cuda__test_graph_rng_functional__device1(sim2):
    """TestCuda.test_graph_rng_functional on device 1: graphed -> eager -> graphed fills draw
    what six eager fills draw from device 1's default generator; a reseed of device 1 changes
    the replays; device 0's generator never moves."""
    d0 = _Device0()
    size = 4 * 1000
    gen1 = R.default_generator(D1)

    def draw():
        return R.uniform_(accel.Buffer(size, device=D1)).to_numpy(np.float32, stream=accel.current_stream(D1))

    gen1.manual_seed(5)
    outs_eager = [draw() for _ in range(6)]
    graph_out = [accel.Buffer(size, device=D1) for _ in range(2)]
    stream = accel.Stream(D1)
    stream.wait_stream(accel.current_stream(D1))
    with stream:
        gen1.manual_seed(5)
        g = Graph()
        g.capture_begin()
        for b in graph_out:
            R.uniform_(b)
        g.capture_end()
    accel.current_stream(D1).wait_stream(stream)
    g.replay()
    got = [b.to_numpy(np.float32, stream=accel.current_stream(D1)) for b in graph_out]
    got += [draw() for _ in range(2)]
    g.replay()
    got += [b.to_numpy(np.float32, stream=accel.current_stream(D1)) for b in graph_out]
    for want, have in zip(outs_eager, got):
        assert np.array_equal(want, have)
    for seed in (6, 128):
        gen1.manual_seed(seed)
        g.replay()
        replayed = [b.to_numpy(np.float32, stream=accel.current_stream(D1)) for b in graph_out]
        gen1.manual_seed(seed)
        assert all(np.array_equal(x, draw()) for x in replayed)
    d0.check("rng graph on device 1")
    g.reset()


def test_cuda__test_graphsafe_set_get_rng_state__device1(sim2):
    """TestCuda.test_graphsafe_set_get_rng_state with device 1's generators: switching states
    inside a capture on device 1 replays what the same switches draw eagerly on a second
    generator of device 1, and leaves both states at the eager offsets."""
    d0 = _Device0()

    def rand(n, gen):
        return R.uniform_(accel.Buffer(4 * n, device=D1), generator=gen)

    def create_states(generator):
        generator.manual_seed(0)
        return generator, generator.graphsafe_get_state(), generator.clone_state()

    def steps(states):
        generator, old_state, new_state = states
        values = []
        generator.graphsafe_set_state(new_state)
        values.append(rand(5, generator))
        generator.graphsafe_set_state(old_state)
        values.extend(rand(5, generator) for _ in range(2))
        return values

    def offsets(states):
        return states[1].get_offset(), states[2].get_offset()

    eager = create_states(R.Generator(D1))
    default = create_states(R.default_generator(D1))
    g = Graph()
    g.register_generator_state(default[1])
    g.register_generator_state(default[2])
    s = accel.Stream(D1)
    with s:
        g.capture_begin()
        graphed = steps(default)
        g.capture_end()
    accel.current_stream(D1).wait_stream(s)
    seen = []
    for _ in range(3):
        values = steps(eager)
        g.replay()
        assert offsets(eager) == offsets(default)
        a = [v.to_numpy(np.float32, stream=accel.current_stream(D1)) for v in values]
        b = [v.to_numpy(np.float32, stream=accel.current_stream(D1)) for v in graphed]
        assert all((x == y).all() for x, y in zip(a, b))
        seen.append(a[0].copy())
    assert not (seen[0] == seen[1]).all()
    d0.check("graph-safe states on device 1")
    del g
    gc.collect()


# == generators (CUDAGeneratorImpl) on device 1 =======================================================
@needs_torch
def test_cuda_generator__new_generator_seed_and_offset__device1(sim2):
    """createCUDAGenerator: ``set_current_seed(default_rng_seed_val)``, offset 0 (what
    ``torch.Generator('cuda:1')`` starts with); torch's CPU Generator has the same
    default_rng_seed_val."""
    d0 = _Device0()
    gen = R.Generator(D1)
    assert gen.initial_seed() == torch.Generator().initial_seed() == 67280421310721
    assert gen.get_offset() == 0
    assert struct.unpack("<Qq", gen.get_state().tobytes()) == (67280421310721, 0)
    d0.check("new generator")


def test_cuda_generator__set_state_seed_only_and_wrong_sizes__device1(sim2):
    """CUDAGeneratorImpl::set_state: 16 bytes (seed, offset); 8 bytes set the seed with offset
    0 (``no_philox_seed``); any other size "RNG state is wrong size" (RuntimeError), the
    state unchanged."""
    d0 = _Device0()
    gen = R.default_generator(D1)
    gen.manual_seed(3)
    R.uniform_(accel.Buffer(64, device=D1))
    assert gen.get_offset() > 0
    gen.set_state(np.frombuffer(struct.pack("<Q", 1234), np.uint8).copy())
    assert (gen.initial_seed(), gen.get_offset()) == (1234, 0)
    gen.set_state(np.frombuffer(struct.pack("<Qq", 99, 40), np.uint8).copy())
    assert (gen.initial_seed(), gen.get_offset()) == (99, 40)
    for n in (0, 1, 7, 9, 15, 17, 32, 5056):       # 5056: a CPU generator's state
        with pytest.raises(RuntimeError, match="RNG state is wrong size"):
            gen.set_state(np.zeros(n, np.uint8))
        assert (gen.initial_seed(), gen.get_offset()) == (99, 40)
    d0.check("set_state on device 1")


@needs_torch
def test_cuda_generator__set_state_type_checks_as_torch(sim2):
    """``detail::check_rng_state``: TORCH_CHECK_TYPE "RNG state must be a torch.ByteTensor"
    (TypeError) for another dtype; torch's CPU generator answers the same for its own
    set_state (the oracle for the error class)."""
    with pytest.raises(TypeError):
        torch.Generator().set_state(torch.zeros(16, dtype=torch.int32))
    gen = R.Generator(D1)
    for bad in (np.zeros(16, np.int32), np.zeros(16, np.float32), np.zeros(4, np.int32)):
        with pytest.raises(TypeError):
            gen.set_state(bad)
    assert gen.initial_seed() == 67280421310721


@needs_torch
def test_cuda_generator__set_state_from_a_torch_byte_tensor(sim2):
    """``torch.cuda.set_rng_state(torch.cuda.get_rng_state(1), 1)`` in a program being ported
    passes torch's CPU ByteTensor: accel's state setters take it as the 16 bytes it holds."""
    gen = R.Generator(D1)
    state = torch.frombuffer(bytearray(struct.pack("<Qq", 77, 12)), dtype=torch.uint8)
    gen.set_state(state)
    assert (gen.initial_seed(), gen.get_offset()) == (77, 12)
    R.set_rng_state(state, D1)
    assert (R.initial_seed(D1), R.default_generator(D1).get_offset()) == (77, 12)


def test_cuda_generator__offset_multiple_of_four__device1(sim2):
    """CUDAGeneratorImpl::set_offset -> set_philox_offset_per_thread: "offset must be a
    multiple of 4" (RuntimeError); a state whose offset is not is refused the same way;
    get_state carries the offset in bytes 8..15 (int64, little-endian)."""
    gen = R.Generator(D1)
    for bad in (1, 2, 3, 6, 4097):
        with pytest.raises(RuntimeError, match="multiple of 4"):
            gen.set_offset(bad)
        with pytest.raises(RuntimeError, match="multiple of 4"):
            gen.set_state(np.frombuffer(struct.pack("<Qq", 5, bad), np.uint8).copy())
    gen.set_offset(4096)
    assert gen.get_offset() == 4096
    assert struct.unpack("<q", gen.get_state()[8:].tobytes())[0] == 4096


def test_cuda_generator__seeding_resets_the_offset__device1(sim2):
    """set_current_seed (manual_seed) and seed() reset philox_offset_per_thread to 0;
    seed() keeps 53 bits (getNonDeterministicRandom(is_cuda=true))."""
    d0 = _Device0()
    gen = R.default_generator(D1)
    for reseed in (lambda: gen.manual_seed(11), gen.seed, lambda: R.manual_seed_all(11)):
        R.uniform_(accel.Buffer(4 * 100, device=D1))
        assert gen.get_offset() > 0
        value = reseed()
        assert gen.get_offset() == 0
        if isinstance(value, int):
            assert 0 <= value < 2 ** 53
            assert gen.initial_seed() == value
    assert R.default_generator(0).get_offset() == 0
    accel.set_device_index(0)


@needs_torch
def test_cuda_generator__negative_seed_wraps_as_torch(sim2):
    """``Generator.manual_seed(-1)``: torch reads a negative seed as its uint64 bits (the CPU
    wheel answers: ``initial_seed() == 2**64 - 1``); accel's device generator agrees."""
    for seed in (-1, -2 ** 63, -12345):
        want = torch.Generator().manual_seed(seed).initial_seed()
        assert R.Generator(D1).manual_seed(seed).initial_seed() == want == seed % 2 ** 64


def test_cuda_generator__graphsafe_get_state_shares_the_state__device1(sim2):
    """graphsafe_get_state returns a generator over the same CUDAGeneratorState: a draw
    through either advances both; clone_state does not share."""
    gen = R.Generator(D1).manual_seed(4)
    shared, cloned = gen.graphsafe_get_state(), gen.clone_state()
    R.uniform_(accel.Buffer(4 * 64, device=D1), generator=shared)
    assert gen.get_offset() == shared.get_offset() > 0
    assert cloned.get_offset() == 0
    gen.manual_seed(9)
    assert shared.initial_seed() == 9 and cloned.initial_seed() == 4


# == events and streams on device 1 ===================================================================
def test_cuda__test_events_elapsedtime__device1(sim2):
    """TestCuda.test_events_elapsedtime with the events recorded on device 1's current stream
    (from device 0): elapsed time is non-negative (no timed asserts), device 0 untouched."""
    d0 = _Device0()
    s = accel.current_stream(D1)
    e0 = accel.Event(enable_timing=True)
    e1 = accel.Event(enable_timing=True)
    e0.record(s)
    _filled(1 << 16, 1)
    e1.record(s)
    e1.synchronize()
    assert e0.device == accel.device(accel.current_accelerator().type, D1)
    assert e0.elapsed_time(e1) >= 0
    d0.check("events on device 1")


def test_cuda_event__record_on_another_device_refused(sim2):
    """CUDAEvent::record: an event created (first recorded) on device 1 cannot be recorded on
    a stream of device 0: "Event device 1 does not match recording stream's device 0."
    (RuntimeError); the event keeps its device and stays usable on device 1."""
    d0 = _Device0()
    e = accel.Event()
    e.record(accel.current_stream(D1))
    with pytest.raises(RuntimeError):
        e.record()                          # the current stream: device 0's
    with pytest.raises(RuntimeError):
        e.record(accel.current_stream(0))
    assert e.device.index == D1
    e.record(accel.Stream(D1))
    e.synchronize()
    assert e.query()
    d0.check("refused record")


def test_cuda_event__unrecorded_event_is_a_no_op(sim2):
    """CUDAEvent::block / synchronize / query of an event never recorded: nothing to wait for
    (``if (is_created_)``), query True; elapsed_time refuses with torch's ValueError."""
    e = accel.Event(enable_timing=True)
    s1 = accel.Stream(D1)
    s1.wait_event(e)
    e.wait(s1)
    e.synchronize()
    assert e.query()
    assert s1.query()
    other = accel.Event(enable_timing=True)
    other.record(s1)
    with pytest.raises(ValueError, match="Both events must be recorded before calculating elapsed time."):
        e.elapsed_time(other)
    with pytest.raises(ValueError, match="Both events must be created with argument 'enable_timing=True'."):
        accel.Event().elapsed_time(other)


def test_cuda_event__elapsed_time_waits_where_torch_refuses(monkeypatch):
    """CUDAEvent::elapsed_time: ``TORCH_CHECK(query() && other.query(), "Both events must be
    completed before calculating elapsed time.")``: torch raises (RuntimeError) while the end
    event's work is queued.  accel's Event.elapsed_time "waits for both to complete" (its
    docstring): recorded here as a difference, not a bug (a program correct for torch, which
    synchronizes first, runs unchanged).  A timer releases the held stream."""
    from torch_port_util import hold
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=1)
    s = accel.Stream(D1)
    e0, e1 = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    e0.record(s)
    gate = hold(s)
    e1.record(s)
    assert not e1.query()
    timer = threading.Timer(0.05, gate.set)
    timer.start()
    try:
        assert e0.elapsed_time(e1) >= 0
    finally:
        gate.set()
        timer.join()
    assert e1.query()


# == memory: snapshots, empty_cache counters, pools on device 1 =======================================
def test_cuda__test_memory_snapshot__device1(sim2):
    """TestCudaMallocAsync.test_memory_snapshot on device 1: the block carries this file's frame
    and its address, its segment says device 1, device 1's trace holds the alloc and (after
    empty_cache) ends with the segment's release; device 0's trace stays empty."""
    d0 = _Device0()
    try:
        memory.empty_cache()
        memory._record_memory_history("all", context="all", stacks="python")
        keep = accel.Buffer(2 * 311 * 411 * 4, device=D1)
        x = accel.Buffer(311 * 411 * 4, device=D1)
        ss = memory._snapshot()
        found = [b for seg in ss["segments"] if seg["device"] == D1 for b in seg["blocks"]
                 if b["requested_size"] == 311 * 411 * 4]
        assert len(found) == 1
        assert found[0]["address"] == x.ptr
        assert "test_torch_ports_r71c" in found[0]["frames"][0]["filename"]
        assert all(seg["device"] == D1 for seg in ss["segments"])
        assert len(ss["device_traces"]) == accel.device_count()
        assert ss["device_traces"][0] == []
        actions = [t["action"] for t in ss["device_traces"][D1]]
        assert "alloc" in actions
        assert any(t["action"] == "alloc" and t["addr"] == x.ptr and t["size"] >= 311 * 411 * 4
                   for t in ss["device_traces"][D1])
        del x, keep
        accel.synchronize(D1)
        memory.empty_cache()
        ss = memory._snapshot()
        assert ss["device_traces"][D1][-1]["action"] in ("segment_free", "segment_unmap")
        # device 0's trace: only the "snapshot" entry the first _snapshot() recorded there
        # (DeviceCachingAllocator::snapshot records TraceEntry::SNAPSHOT on every device)
        assert [t["action"] for t in ss["device_traces"][0]] == ["snapshot"]
    finally:
        memory._record_memory_history(None)
    d0.check("snapshot of device 1")


def test_cuda__test_memory_snapshot_skip_actions__device1(sim2):
    """TestCudaMallocAsync.test_memory_snapshot_skip_actions on device 1: skipped actions are
    absent from device 1's trace, the others recorded."""
    try:
        memory.empty_cache()
        memory._record_memory_history("all", context="all", stacks="python",
                                      skip_actions=["free_requested", "free_completed"])
        x = accel.Buffer(1 << 16, device=D1)
        del x
        accel.synchronize(D1)
        actions = {t["action"] for t in memory._snapshot()["device_traces"][D1]}
        assert "alloc" in actions
        assert not actions & {"free_requested", "free_completed"}
    finally:
        memory._record_memory_history(None)


def test_caching_allocator__empty_cache_counts_a_sync_on_every_device(sim2):
    """CUDACachingAllocator emptyCache walks every device's allocator, and each
    release_cached_blocks calls synchronize_and_free_events, which counts
    ``num_sync_all_streams`` once: after one empty_cache() both devices count one more."""
    x0 = accel.Buffer(4096, device=0)
    x1 = accel.Buffer(4096, device=D1)
    before = [memory.memory_stats(i)["num_sync_all_streams"] for i in (0, D1)]
    memory.empty_cache()
    after = [memory.memory_stats(i)["num_sync_all_streams"] for i in (0, D1)]
    assert after == [b + 1 for b in before]
    del x0, x1


def test_caching_allocator__memory_stats_of_an_unused_device_after_init(sim2):
    """torch makes every device's DeviceCachingAllocator at init, so memory_stats(1) after
    device 0 alone allocated is the full dict of zeros (torch.accelerator.memory_stats' keys),
    not an empty one."""
    x = accel.Buffer(4096, device=0)
    stats1 = memory.memory_stats(D1)
    stats0 = memory.memory_stats(0)
    assert set(stats1) == set(stats0)
    assert stats1["allocated_bytes.all.current"] == 0
    assert stats1["num_alloc_retries"] == 0
    del x


def test_cuda__test_mempool_use_mem_pool__device1(sim2):
    """TestMemPool (test_mempool_id/test_mempool_with_allocator bodies) on device 1 with device 0
    current: ``use_mem_pool(pool, device=1)`` routes device 1's allocations into the pool
    (torch: _cuda_beginAllocateCurrentThreadToPool(device, pool.id)) and leaves device 0's in
    the general cache; memory_snapshot(mempool_id=pool.id) shows the pool's device-1 segments."""
    d0 = _Device0()
    with accel.device_index(D1):
        pool = accel.MemPool()
    assert pool.id[0] == 0 and pool.id[1] > 0
    with accel.use_mem_pool(pool, device=D1):
        on1 = accel.Buffer(4096, device=D1)
        on0 = accel.Buffer(4096, device=0)
    assert pool.use_count() >= 1
    segs = memory.memory_snapshot(mempool_id=pool.id)
    assert segs and all(seg["device"] == D1 for seg in segs)
    assert any(b["address"] == on1.ptr for seg in segs for b in seg["blocks"])
    assert not any(b["address"] == on0.ptr for seg in segs for b in seg["blocks"])
    del on0
    accel.synchronize(0)
    d0.check("use_mem_pool on device 1")
    del on1
    accel.synchronize(D1)
    del pool
    gc.collect()
    memory.empty_cache()
    assert memory.memory_reserved(D1) == 0


# (r71c found; fixed in session 32)
def test_caching_allocator__empty_cache_counts_on_a_device_not_used_yet(sim2):
    """torch's ``init(device_count)`` makes a DeviceCachingAllocator for every device, and
    ``NativeCachingAllocator::emptyCache`` walks them all (``for (auto& da : device_allocator)
    da->emptyCache(mempool_id)``), each counting ``num_sync_all_streams`` in
    synchronize_and_free_events.  After device 0 alone allocated, two empty_cache() calls leave
    device 1's count at 2."""
    x = accel.Buffer(4096, device=0)
    memory.empty_cache()
    memory.empty_cache()
    assert memory.memory_stats(0)["num_sync_all_streams"] == 2
    assert memory.memory_stats(D1)["num_sync_all_streams"] == 2
    del x


def test_caching_allocator__memory_queries_make_no_context_on_device1(sim2):
    """``torch.cuda.memory_stats(1)`` and friends read DeviceCachingAllocator stats: no CUDA
    call, so no primary context is made on device 1 (torch's _cuda_hasPrimaryContext(1) stays
    False; the simulator records each device's primary context)."""
    from accel import sim
    x = accel.Buffer(4096, device=0)
    assert sim.state().primary_contexts == [True, False]
    memory.memory_stats(D1)
    memory.memory_allocated(D1)
    memory.max_memory_reserved(D1)
    memory.reset_peak_memory_stats(D1)
    memory.reset_accumulated_memory_stats(D1)
    memory.memory_snapshot()
    assert sim.state().primary_contexts == [True, False]
    del x


# (r71c found; fixed in session 31)
@pytest.mark.parametrize("conf", ["", "expandable_segments:False", "policy:torch,expandable_segments:False"])
def test_caching_allocator__empty_cache_makes_no_context_on_an_idle_device(monkeypatch, conf):
    """torch's emptyCache on a device allocator with nothing cached makes no CUDA call
    (release_cached_blocks: no events to synchronize, no block to cudaFree), so after
    ``memory_stats(1)`` (a logging loop reading every device) an empty_cache() leaves device 1
    without a primary context: on a real GPU a context costs hundreds of MiB of device 1's
    memory that no tensor ever asked for."""
    from accel import sim
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF=conf)
    x = accel.Buffer(4096, device=0)
    memory.memory_allocated(D1)
    memory.empty_cache()
    assert sim.state().primary_contexts == [True, False]
    assert accel.current_device_index() == 0
    del x


def test_cuda__memory_snapshot_segments_sorted__device1(sim2):
    """NativeCachingAllocator::snapshot gathers the devices in order and each device's
    ``snapshot()`` sorts its segments by address: memory_snapshot() lists device 0's segments,
    then device 1's, each in address order."""
    memory.empty_cache()
    bufs = [accel.Buffer(size, device=dev) for size in (3 << 20, 1 << 10, 25 << 20, 5 << 20)
            for dev in (D1, 0)]
    segs = memory.memory_snapshot()
    keys = [(seg["device"], seg["address"]) for seg in segs]
    assert keys == sorted(keys)
    assert {seg["device"] for seg in segs} == {0, D1}
    del bufs


# == graph debugging and pool ids (CUDAGraph.cpp) =====================================================
# (r71c found; fixed in session 31)
def test_cuda__test_graph_debugdump__without_debug_mode_warns(graph_sim2, tmp_path):
    """CUDAGraph::debug_dump without enable_debug_mode() (and keep_graph=False):
    ``TORCH_WARN("CUDA Graphs debug not enabled, set with [graph].enable_debug_mode()")`` -- a
    UserWarning, no file, and the program goes on.  Captured on device 1."""
    s = accel.Stream(D1)
    g = Graph()
    with s, g:
        _filled(64, 1)
    path = tmp_path / "g.dot"
    with pytest.warns(UserWarning, match="debug not enabled"):
        g.debug_dump(str(path))
    assert not path.exists()
    g.replay()
    g.reset()


def test_cuda__graph_pool_during_capture__recorded(graph_sim2):
    """CUDAGraph::pool(): ``TORCH_CHECK(capture_ended_, "Called CUDAGraph::pool() without a
    preceding successful capture.")`` in every stored copy: torch refuses it before capture_end
    and after reset().  accel refuses before capture_begin and after reset(), but answers during
    the capture (its message: "only valid after capture_begin").  Recorded, not a bug: a
    program correct for torch never asks then."""
    g = Graph()
    with pytest.raises(RuntimeError):
        g.pool()
    s = accel.Stream(D1)
    with s:
        g.capture_begin()
        during = g.pool()                  # torch: RuntimeError
        _filled(64, 1)
        g.capture_end()
    assert g.pool() == during
    g.reset()
    with pytest.raises(RuntimeError):
        g.pool()


def test_cuda_generator__get_offset_during_capture__recorded(sim2):
    """CUDAGeneratorImpl::get_offset: ``assertNotCapturing("Cannot call
    CUDAGeneratorImpl::get_offset")`` while the current stream captures ("Debatable ...
    Conservatively disallow it"); set_offset and seed() refuse too.  accel refuses set_offset
    and seed() during a capture on the generator's device but answers get_offset (recorded,
    not a bug: a read)."""
    gen = R.default_generator(D1)
    s = accel.Stream(D1)
    g = Graph()
    with s:
        g.capture_begin()
        try:
            offset = gen.get_offset()       # torch: RuntimeError
            with pytest.raises(RuntimeError):
                gen.set_offset(offset + 4)
            with pytest.raises(RuntimeError):
                gen.seed()
            R.uniform_(accel.Buffer(64, device=D1))
        finally:
            g.capture_end()
    assert gen.get_offset() == offset
    g.replay()
    g.reset()


def test_cuda__graph_pool_shared_across_devices(graph_sim2):
    """A pool id names a private pool *per device allocator* in torch (beginAllocateToPool(
    capture_dev_, mempool_id_) on the capture device's DeviceCachingAllocator), so
    ``Graph(pool=g0.pool())`` captured on device 1 after g0 on device 0 (and one
    graph_pool_handle() for both) works: each device's blocks come from its own pool of that
    id, and each replay gives its own device's values."""
    s0, s1 = accel.Stream(0), accel.Stream(D1)
    g0, g1 = Graph(), Graph()
    with s0, g0:
        a = _filled(4096, 1, device=0)
    g1.graph_pool = g0.pool()
    with s1, g1:
        b = _filled(4096, 2)
    assert g1.pool() == g0.pool()
    segs = memory.memory_snapshot(mempool_id=g0.pool())
    assert {seg["device"] for seg in segs} == {0, D1}
    g0.replay()
    g1.replay()
    assert _value(a) == 1 and _value(b) == 2
    handle = accel.graphs.graph_pool_handle()
    g2, g3 = Graph(pool=handle), Graph(pool=handle)
    with s0, g2:
        c = _filled(4096, 3, device=0)
    with s1, g3:
        d = _filled(4096, 4)
    g2.replay()
    g3.replay()
    assert _value(c) == 3 and _value(d) == 4
    for g in (g0, g1, g2, g3):
        g.reset()


def test_cuda_generator__graphsafe_set_state_of_another_device__recorded(sim2):
    """CUDAGeneratorImpl::graphsafe_set_state checks only ``TORCH_CHECK(cuda_gen, "Expected a
    CUDA Generator")``: torch lets device 1's generator take device 0's state object.  accel
    refuses it (ValueError naming both devices; Generator.graphsafe_set_state's message):
    recorded as a difference, the state untouched."""
    gen1 = R.Generator(D1).manual_seed(1)
    other = R.Generator(0).manual_seed(2).graphsafe_get_state()
    with pytest.raises(ValueError, match="device 0"):
        gen1.graphsafe_set_state(other)
    assert gen1.initial_seed() == 1
    gen1.graphsafe_set_state(R.Generator(D1).manual_seed(3).graphsafe_get_state())
    assert gen1.initial_seed() == 3
