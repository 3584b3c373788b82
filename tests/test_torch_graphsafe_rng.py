"""Ports of torch's graph-safe generator-state tests (test/test_cuda.py, TestCuda) and misuse.

torch keeps a generator's Philox state (seed, offset, the graph-safe fields and the device
holders the captured kernels read) in a ``CUDAGeneratorState`` the generator points to:
``Generator.graphsafe_get_state()`` returns a Generator sharing that state object,
``graphsafe_set_state(other)`` makes a generator use ``other``'s state object, ``clone_state()``
makes an independent state (same seed and offset, its own holders), and
``CUDAGraph.register_generator_state(gen)`` registers ``gen``'s state with a graph, so that
capture_begin puts it in graph-safe mode, capture_end takes its whole-graph increment, and each
replay writes its seed/offset to its holders and advances it.  The default generator's state is
registered by every capture.  (aten/src/ATen/cuda/CUDAGeneratorImpl.cpp, CUDAGraph.cpp.)

Tensors become Buffers and ``torch.rand(5)`` becomes ``accel.random.uniform_`` of a 5-float
Buffer.  Level Zero has no Philox kernels, so its captured fills are refused (CaptureError) and
the ports there check only the bookkeeping; Metal has no graphs.
"""

import gc

import numpy as np
import pytest

import accel

R = accel.random
# (captures refused a fill from an unregistered state, or Level Zero's refused every fill, are empty)
pytestmark = pytest.mark.filterwarnings("ignore:The (CUDA|XPU) Graph is empty:UserWarning")


def _rand(n, gen, dev=0):
    """torch.rand(n, device=dev, generator=gen): a new Buffer of n uniform floats."""
    return R.uniform_(accel.Buffer(4 * n, device=dev), generator=gen)


def _values(bufs):
    return [b.to_numpy(np.float32).copy() for b in bufs]


def _active():
    stats = accel.memory.memory_stats(0)
    return stats.get("active.all.current", 0), stats.get("active_bytes.all.current", 0)


# -- ports -------------------------------------------------------------------------------------
def test_cuda__test_graphsafe_set_get_rng_state(sim_graph_backend):
    """torch's test, with the default generator of device 0 and a second generator: the same
    steps (switch to the cloned state, draw once; back to the original state, draw twice) run
    eagerly with the second generator and captured with the default one; each replay leaves
    both states at the same offsets as the eager run and draws what it drew."""

    def create_states(generator):
        _rand(1, None)          # (torch.rand(1): initializes the device's generator)
        generator.manual_seed(0)
        old_state = generator.graphsafe_get_state()
        new_state = generator.clone_state()
        return generator, old_state, new_state

    def register_states_to_graph(generator_state, graph):
        generator, old_state, new_state = generator_state
        graph.register_generator_state(old_state)
        graph.register_generator_state(new_state)

    def perform_random_generation_steps(generator_state):
        generator, old_state, new_state = generator_state
        random_values = []
        generator.graphsafe_set_state(new_state)
        random_values.append(_rand(5, generator))
        generator.graphsafe_set_state(old_state)
        random_values.extend([_rand(5, generator) for _ in range(2)])
        return random_values

    def get_final_offsets_of_states(generator_state):
        generator, old_state, new_state = generator_state
        return old_state.get_offset(), new_state.get_offset()

    generator = R.Generator(0)
    generator_state = create_states(generator)

    g = accel.Graph()
    s = accel.Stream(0)
    default_generator = R.default_generator(0)
    default_generator_state = create_states(default_generator)
    register_states_to_graph(default_generator_state, g)

    if sim_graph_backend == "xpu":
        with s:
            g.capture_begin()
            with pytest.raises(accel.CaptureError, match="cannot be captured"):
                perform_random_generation_steps(default_generator_state)
            g.capture_end()
        # nothing drawn: the replays move neither state
        g.replay()
        assert get_final_offsets_of_states(default_generator_state) == (0, 0)
        return

    with s:
        g.capture_begin()
        graphed_random_values = perform_random_generation_steps(default_generator_state)
        g.capture_end()

    accel.current_stream().wait_stream(s)
    for _ in range(3):
        random_values = perform_random_generation_steps(generator_state)
        g.replay()
        offset = get_final_offsets_of_states(generator_state)
        graph_offset = get_final_offsets_of_states(default_generator_state)
        assert offset == graph_offset
        a, b = _values(random_values), _values(graphed_random_values)
        assert all((x == y).all() for x, y in zip(a, b))
    assert not (a[0] == a[1]).all() and not (a[1] == a[2]).all()
    del g
    gc.collect()


def test_cuda__test_memory_stats_of_multiple_generators_and_graphs(sim_graph_backend):
    """Each (registered state, graph) pair holds two 512-byte blocks (seed and offset holders,
    torch 2.13's per-capture CUDAGeneratorCaptureState; torch's newest test counts them per
    pair), and dropping the graphs frees them all."""

    def clear_cuda_cache():
        gc.collect()
        accel.memory.empty_cache()

    def simple_graph_task(graph):
        s = accel.Stream(0)
        with s:
            graph.capture_begin()
            if sim_graph_backend != "xpu":
                _rand(1, None)
            else:
                accel.Buffer(4).fill_(1)        # (Level Zero: no captured fills)
            graph.capture_end()
        accel.current_stream().wait_stream(s)
        graph.replay()

    def test(num_graphs, num_generators):
        clear_cuda_cache()
        baseline = _active()
        graphs = [accel.Graph() for _ in range(num_graphs)]
        default_generator = R.default_generator(0)
        generators = [default_generator.graphsafe_get_state()]
        for _ in range(1, num_generators):
            generators.append(default_generator.clone_state())
        for graph in graphs:
            for generator_state in generators:
                graph.register_generator_state(generator_state)
            simple_graph_task(graph)
        num_blocks, total_size = _active()
        assert num_blocks - baseline[0] == 2 * num_generators * num_graphs, "Unexpected number of active blocks."
        assert total_size - baseline[1] == 2 * 512 * num_generators * num_graphs, "Unexpected total memory size."
        while graphs:
            graph = graphs.pop()
            del graph
        clear_cuda_cache()
        assert _active() == baseline, "Memory stats do not match baseline after cleanup."

    test(1, 1)
    test(3, 2)
    test(10, 20)


# -- misuse and lifetimes ------------------------------------------------------------------------
def _registered(gen):
    """(graphs registered with gen's current state, whether it holds its device holders)."""
    return gen._graphs, bool(gen._holders)


def test_graphsafe_bad_arguments_are_refused_and_change_nothing(sim_graph_backend):
    gen = R.Generator(0, seed=7)
    other = R.Generator(1, seed=8)
    g = accel.Graph()
    for bad in (None, 3, "state", gen.get_state()):
        with pytest.raises(TypeError, match="accel.random.Generator"):
            gen.graphsafe_set_state(bad)
        with pytest.raises(TypeError, match="register_generator_state expects an accel.random.Generator"):
            g.register_generator_state(bad)
    with pytest.raises(ValueError, match="device 1 but this generator is of device 0"):
        gen.graphsafe_set_state(other)
    assert gen.initial_seed() == 7 and gen.get_offset() == 0
    assert g._rng is None and _registered(gen) == (0, False)
    # shared and cloned states: a shared state moves with its generator, a clone does not
    shared, clone = gen.graphsafe_get_state(), gen.clone_state()
    _rand(4, shared)
    assert gen.offset == shared.offset == 4 and clone.offset == 0
    assert (clone.initial_seed(), clone.device_index) == (7, 0)
    gen.graphsafe_set_state(clone)
    _rand(4, gen)
    assert (gen.offset, clone.offset, shared.offset) == (4, 4, 4)
    _rand(4, gen)
    assert (gen.offset, clone.offset, shared.offset) == (8, 8, 4)


def test_registering_or_setting_state_during_capture(sim_graph_backend):
    """torch refuses registering a state while capturing ("Cannot register the state during
    capturing stage.") and set_state/set_offset/seed of a capturing state; graphsafe_set_state
    is allowed (torch's own test switches states inside the capture); a fill from a state no
    capturing graph registered is refused and the capture goes on."""
    gen, late, loose = R.Generator(0, seed=1), R.Generator(0, seed=2), R.Generator(0, seed=3)
    g, g2, s = accel.Graph(), accel.Graph(), accel.Stream(0)
    g.register_generator_state(gen)
    g.register_generator_state(gen.graphsafe_get_state())        # twice (same state): a no-op
    assert _registered(gen) == (1, True)
    out = accel.Buffer(4 * 16)
    with s:
        g.capture_begin()
        try:
            assert gen.capturing and not late.capturing
            with pytest.raises(RuntimeError, match="Cannot register the state during capturing stage"):
                g.register_generator_state(late)
            with pytest.raises(RuntimeError, match="Cannot register the state during capturing stage"):
                g2.register_generator_state(late)       # another graph, same device: still refused
            with pytest.raises(RuntimeError, match="Cannot call set_state"):
                gen.set_state(late.get_state())
            with pytest.raises(RuntimeError, match="Cannot call set_offset"):
                gen.set_offset(8)
            with pytest.raises(RuntimeError, match="Cannot call clone_state"):
                gen.clone_state()
            if sim_graph_backend != "xpu":
                with pytest.raises(accel.CaptureError, match="register_generator_state"):
                    R.uniform_(out, generator=loose)     # registered with no capturing graph
                loose.graphsafe_set_state(gen)           # allowed during capture: now it is
                R.uniform_(out, generator=loose)
            # the default generator switched to a state no graph registered: the device is still
            # capturing, so a second capture on it is refused (accel: one per device)
            default = R.default_generator(0)
            mine = default.graphsafe_get_state()
            default.graphsafe_set_state(late)
            assert not default.capturing
            with accel.Stream(0), pytest.raises(RuntimeError, match="another graph is being captured on device 0"):
                g2.capture_begin()
            default.graphsafe_set_state(mine)
        finally:
            g.capture_end()
    assert _registered(late) == (0, False) and g2._rng is None
    assert not gen.capturing and (gen.initial_seed(), gen.offset, loose.offset) == (1, 0, 0)
    with pytest.raises(RuntimeError, match="already holds a capture"):
        g.register_generator_state(late)
    assert _registered(late) == (0, False)
    if sim_graph_backend != "xpu":
        g.replay()
        assert gen.offset == 16 and loose.offset == 16      # one state, advanced once per replay
        assert (out.to_numpy(np.float32) == _rand(16, R.Generator(0, seed=1)).to_numpy(np.float32)).all()
    del g, g2
    gc.collect()
    assert _registered(gen) == (0, False)


def test_graph_reset_or_collected_unregisters_its_states(sim_graph_backend):
    """reset() and collection unregister the graph's states (the graph's own holders are
    freed); the states then draw eagerly, and a new capture draws from
    one only once it is registered again.  A refused capture_begin keeps the registrations;
    a capture whose body raised is discarded with every registration released."""
    gen = R.Generator(0, seed=4)
    s = accel.Stream(0)
    accel.memory.empty_cache()
    base = _active()
    g, keep = accel.Graph(), accel.Graph()
    g.register_generator_state(gen)
    keep.register_generator_state(gen)
    assert _registered(gen) == (2, True)
    assert _active()[0] - base[0] == 4                     # a pair of holders per graph (torch 2.13)
    with pytest.raises(RuntimeError, match="non-default stream"):
        g.capture_begin()                                   # refused: registrations kept
    assert _registered(gen) == (2, True) and not R.default_generator(0).capturing
    g.reset()
    assert _registered(gen) == (1, True) and _active()[0] - base[0] == 2
    del keep
    gc.collect()
    assert _registered(gen) == (0, False) and _active() == base
    _rand(8, gen)
    assert gen.offset == 8
    if sim_graph_backend != "xpu":
        with s:
            g.capture_begin()
            with pytest.raises(accel.CaptureError, match="not in graph-safe mode"):
                _rand(8, gen)
            g.capture_end()
        g.reset()
        g.register_generator_state(gen)
        out = accel.Buffer(4 * 8)
        with s:
            g.capture_begin()
            R.uniform_(out, generator=gen)
            g.capture_end()
        state = gen.get_state()
        g.replay()
        got = out.to_numpy(np.float32).copy()
        gen.set_state(state)
        assert (got == _rand(8, gen).to_numpy(np.float32)).all()
        g.reset()
        del out
    with pytest.raises(KeyError):
        g.register_generator_state(gen)
        with s, g:
            raise KeyError("model code failed")
    assert _registered(gen) == (0, False) and not gen.capturing
    g.register_generator_state(gen)
    del g
    gc.collect()
    assert _registered(gen) == (0, False)
    accel.memory.empty_cache()
    assert _active() == base


def test_state_of_device_1_registered_while_device_0_is_current(sim_cuda):
    """A generator of device 1 registered with device 0 current: its holders are device 1's;
    the graph captures on device 1 and replays with device 0 current, drawing what eager
    draws at the same state.  A graph holding a device-1 state refuses to capture on device 0
    (nothing captured, no capture left underway)."""
    gen = R.Generator(1, seed=11)
    accel.memory.empty_cache()
    base0, base1 = accel.memory.memory_stats(0).get("active.all.current", 0), \
        accel.memory.memory_stats(1).get("active.all.current", 0)
    g = accel.Graph()
    with accel.device_index(0):
        g.register_generator_state(gen)
    assert accel.memory.memory_stats(1)["active.all.current"] - base1 == 2
    assert accel.memory.memory_stats(0).get("active.all.current", 0) == base0
    wrong = accel.Graph()
    wrong.register_generator_state(gen)
    with accel.device_index(0), accel.Stream(0):
        with pytest.raises(RuntimeError, match="state of device 1 is registered with a graph about to capture "
                                               "on device 0"):
            wrong.capture_begin()
        assert not accel.is_current_stream_capturing() and not R.default_generator(0).capturing
    wrong.reset()
    out = accel.Buffer(4 * 32, device=1)
    with accel.device_index(1), accel.Stream(1):
        g.capture_begin()
        R.uniform_(out, generator=gen)
        R.normal_(out, generator=gen)
        g.capture_end()
    state = gen.get_state()
    with accel.device_index(0):
        g.replay()
        accel.synchronize(1)
        got = out.to_numpy(np.float32).copy()
        gen.set_state(state)
        ref = accel.Buffer(4 * 32, device=1)
        R.uniform_(ref, generator=gen)
        R.normal_(ref, generator=gen)
    assert (got == ref.to_numpy(np.float32)).all() and gen.offset == 2 * 32
    del g, wrong
    gc.collect()
    assert _registered(gen) == (0, False)


def test_graphsafe_states_without_graphs_on_mps(monkeypatch):
    """Metal has no graphs: registering refuses as capture_begin does; the states work."""
    from conftest import use_sim
    use_sim(monkeypatch, "mps")
    gen = R.Generator(0, seed=5)
    with pytest.raises(NotImplementedError):
        accel.Graph().register_generator_state(gen)
    clone = gen.clone_state()
    gen.graphsafe_set_state(clone)
    _rand(4, gen)
    assert clone.offset == 4 and _registered(gen) == (0, False)
