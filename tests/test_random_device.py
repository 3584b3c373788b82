"""accel.random through the simulators: device fills equal the host path bit for
bit, offsets advance across fills and graph replays, and seeding or querying
never initializes the runtime."""

import struct

import pytest

np = pytest.importorskip("numpy")

import accel  # noqa: E402
import accel.random as R  # noqa: E402
from accel.random import _transforms, philox  # noqa: E402

from conftest import use_sim  # noqa: E402

SEED = 0x5EED_1234_ABCD_0042


def _fill_and_read(fill, nbytes, read_as, **kw):
    buf = accel.Buffer(nbytes)
    fill(buf, **kw)
    return buf.to_numpy(read_as)


# (fill function, kwargs, dtype, itemsize, host function (seed, offset, n) -> values)
CASES = {
    "raw": (R.random_raw_, {}, "uint32", 4, lambda s, o, n: philox.raw_words(s, o, n)),
    "uniform32": (R.uniform_, {"low": -2.0, "high": 3.0}, "float32", 4,
                  lambda s, o, n: _transforms.uniform_f32(philox.raw_words(s, o, n), -2.0, 3.0)),
    "uniform32-default": (R.uniform_, {}, "float32", 4,
                          lambda s, o, n: _transforms.uniform_f32(philox.raw_words(s, o, n))),
    "uniform64": (R.uniform_, {"dtype": "float64", "low": 1.0, "high": 1.5}, "float64", 8,
                  lambda s, o, n: _transforms.uniform_f64(philox.raw_words(s, o, 2 * n), 1.0, 1.5)),
    "normal32": (R.normal_, {"mean": 1.0, "std": 2.0}, "float32", 4,
                 lambda s, o, n: _transforms.normal_f32(philox.raw_words(s, o, n + n % 2), n, 1.0, 2.0)),
    "normal64": (R.normal_, {"dtype": "float64"}, "float64", 8,
                 lambda s, o, n: _transforms.normal_f64(philox.raw_words(s, o, 4 * ((n + 1) // 2)), n)),
    "randint32": (R.randint_, {"low": -7, "high": 1000, "dtype": "int32"}, "int32", 4,
                  lambda s, o, n: _transforms.randint(philox.raw_words(s, o, n), -7, 1000, "int32")),
    "randint64": (R.randint_, {"low": 0, "high": 10}, "int64", 8,
                  lambda s, o, n: _transforms.randint(philox.raw_words(s, o, n), 0, 10, "int64")),
    "randint64-wide": (R.randint_, {"low": -(2**62), "high": 2**62}, "int64", 8,
                       lambda s, o, n: _transforms.randint(philox.raw_words(s, o, 2 * n), -(2**62), 2**62,
                                                           "int64")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_device_fill_equals_host_path(sim_backend, case):
    fill, kw, dtype, size, host = CASES[case]
    R.manual_seed(SEED)
    offset = 0
    for n in (1, 3, 6, 1027):   # tails of every shape, and more counters than one grid-stride pass
        got = _fill_and_read(fill, n * size, dtype, **kw)
        want = host(SEED, offset, n)
        assert got.dtype == want.dtype
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (case, n)
        offset = R.default_generator(0).offset
    assert offset > 0


def test_large_fill_uses_many_grid_stride_iterations(sim_cuda):
    R.manual_seed(3)
    n = 1024 * 256 * 4 + 4 * 37 + 1        # more counters than _MAX_BLOCKS * _BLOCK threads
    got = _fill_and_read(R.random_raw_, 4 * n, "uint32")
    assert np.array_equal(got, philox.raw_words(3, 0, n))


def test_offsets_advance_by_words_rounded_to_four(sim_backend):
    R.manual_seed(1)
    gen = R.default_generator(0)
    steps = []
    for fill, nbytes, kw in ((R.random_raw_, 4 * 5, {}), (R.uniform_, 8 * 3, {"dtype": "float64"}),
                             (R.normal_, 4 * 3, {}), (R.normal_, 8 * 3, {"dtype": "float64"}),
                             (R.randint_, 8 * 3, {"low": 0, "high": 2**40}), (R.random_raw_, 0, {})):
        before = gen.offset
        fill(accel.Buffer(nbytes), **kw)
        steps.append(gen.offset - before)
    assert steps == [8, 8, 4, 8, 8, 0]
    state = R.get_rng_state()
    assert struct.unpack("<Qq", state.tobytes()) == (1, sum(steps))


def test_consecutive_fills_continue_one_stream(sim_cuda):
    R.manual_seed(SEED)
    parts = [_fill_and_read(R.random_raw_, 4 * n, "uint32") for n in (8, 4, 12)]
    assert np.array_equal(np.concatenate(parts), philox.raw_words(SEED, 0, 24))


def test_state_round_trip_reproduces_device_numbers(sim_backend):
    R.manual_seed(77)
    R.uniform_(accel.Buffer(40))
    saved = R.get_rng_state()
    first = _fill_and_read(R.normal_, 4 * 100, "float32")
    R.uniform_(accel.Buffer(400))
    R.set_rng_state(saved)
    again = _fill_and_read(R.normal_, 4 * 100, "float32")
    assert np.array_equal(first, again)
    R.manual_seed(77)
    assert R.default_generator(0).offset == 0


def test_explicit_generator_and_devices(sim_cuda):
    gen = R.Generator(1, seed=5)
    buf = accel.Buffer(64, device=1)
    R.random_raw_(buf, generator=gen)
    assert np.array_equal(buf.to_numpy("uint32"), philox.raw_words(5, 0, 16))
    assert gen.offset == 16 and R.default_generator(1).offset == 0
    other = accel.Buffer(8)            # (device 0) a generator of another device draws, as torch's
    R.random_raw_(other, generator=gen)
    assert np.array_equal(other.to_numpy("uint32"), philox.raw_words(5, 16, 2)) and gen.offset == 20
    with pytest.raises(TypeError, match="accel.Buffer"):
        R.random_raw_(np.zeros(4, np.uint32))
    with pytest.raises(TypeError, match="Generator"):
        R.random_raw_(buf, generator=3)
    before = R.get_rng_state(0)
    with pytest.raises(ValueError, match="whole number"):
        R.uniform_(accel.Buffer(6))
    with pytest.raises(ValueError, match="less than"):
        R.randint_(accel.Buffer(8), 5, 5)
    assert np.array_equal(R.get_rng_state(0), before)


def test_manual_seed_current_device_and_all(sim_cuda):
    R.manual_seed_all(10)
    assert [R.initial_seed(i) for i in range(2)] == [10, 10]
    accel.set_device_index(1)
    R.manual_seed(11)
    assert [R.initial_seed(i) for i in range(2)] == [10, 11]
    assert R.initial_seed() == 11 and R.initial_seed("cuda") == 11 and R.initial_seed("cuda:0") == 10
    s = R.seed_all()
    assert [R.initial_seed(i) for i in range(2)] == [s, s]
    assert R.seed() == R.initial_seed(1)
    with pytest.raises(ValueError, match="out of range"):
        R.initial_seed(2)
    with pytest.raises(ValueError, match="doesn't match the current accelerator"):
        R.get_rng_state("xpu:0")


def test_rng_state_all_is_all_or_nothing(sim_cuda):
    R.manual_seed_all(4)
    states = R.get_rng_state_all()
    assert len(states) == 2
    good = np.frombuffer(struct.pack("<Qq", 8, 16), np.uint8)
    with pytest.raises(RuntimeError, match="wrong size"):
        R.set_rng_state_all([good, np.zeros(3, np.uint8)])
    assert [R.initial_seed(i) for i in range(2)] == [4, 4]
    with pytest.raises(ValueError, match="only 2 device"):
        R.set_rng_state_all([good] * 3)
    R.set_rng_state_all([good, good])
    assert [struct.unpack("<Qq", s.tobytes()) for s in R.get_rng_state_all()] == [(8, 16)] * 2


def test_seeding_and_queries_never_initialize(monkeypatch):
    use_sim(monkeypatch, "cuda")
    import accel.sim
    R.manual_seed(123)
    R.manual_seed_all(5)
    R.manual_seed(-1)
    R.seed_all()
    R.manual_seed(99)
    assert R.initial_seed() == 99 and R.initial_seed(1) != 99
    state = R.get_rng_state()
    R.set_rng_state(state)
    R.get_rng_state_all()
    with pytest.raises(ValueError, match="64 bits"):
        R.manual_seed(2**64)
    assert not accel.is_initialized()
    assert not accel.sim.state().runtime_initialized
    # the seed set before init is what the first device fill draws from
    assert np.array_equal(_fill_and_read(R.random_raw_, 32, "uint32"), philox.raw_words(99, 0, 8))
    assert accel.sim.state().runtime_initialized


def test_seeding_without_a_device_is_a_no_op(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DEVICES=0)
    R.manual_seed(1)
    R.manual_seed_all(2)
    assert R.seed() == 0
    assert R.get_rng_state_all() == []
    with pytest.raises(ValueError, match="no cuda device"):
        R.get_rng_state()


# -- graphs ---------------------------------------------------------------------------------------
graphs = pytest.importorskip("accel.graphs")


def test_graph_replays_draw_fresh_numbers_and_advance_the_offset(sim_graph_backend):
    if sim_graph_backend != "cuda":
        pytest.skip("graph-safe fills need a Philox kernel; only the CUDA backend has one for graphs")
    R.manual_seed(SEED)
    gen = R.default_generator(0)
    R.random_raw_(accel.Buffer(16))                          # offset 4 before capture
    side = accel.Stream()
    a = accel.Buffer(4 * 6, stream=side)
    b = accel.Buffer(8 * 3, stream=side)
    g = accel.Graph()
    with accel.graph(g, stream=side):
        R.random_raw_(a)                                     # 6 words -> 8
        R.uniform_(b, dtype="float64")                       # 6 words -> 8
    assert gen.offset == 4                                   # capture consumed nothing eagerly
    seen = []
    for replay in range(3):
        start = gen.offset
        g.replay()
        accel.synchronize()
        assert gen.offset == start + 16
        got_a, got_b = a.to_numpy("uint32"), b.to_numpy("float64")
        assert np.array_equal(got_a, philox.raw_words(SEED, start, 6))
        assert np.array_equal(got_b, _transforms.uniform_f64(philox.raw_words(SEED, start + 8, 6)))
        seen.append(got_a.tolist())
    assert len({tuple(s) for s in seen}) == 3
    # eager draws continue after the replays
    after = _fill_and_read(R.random_raw_, 16, "uint32")
    assert np.array_equal(after, philox.raw_words(SEED, 4 + 3 * 16, 4))


def test_capture_with_a_non_default_generator_is_refused(sim_cuda):
    gen = R.Generator(0, seed=1)
    side = accel.Stream()
    a = accel.Buffer(16, stream=side)
    g = accel.Graph()
    with pytest.raises(accel.CaptureError, match="graph-safe"):
        with accel.graph(g, stream=side):
            R.random_raw_(a, generator=gen)
    assert gen.offset == 0


# -- import weight and fork ------------------------------------------------------------------
def test_import_accel_random_does_not_import_numpy():
    import subprocess
    import sys
    code = ("import sys, accel, accel.random as R; R.manual_seed; "
            "assert 'numpy' not in sys.modules, 'numpy imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_forked_child_can_seed_but_neither_query_nor_fill(sim_cuda):
    """torch's seeding in a child forked after init is queued (never run), and its queries and
    fills call _lazy_init, which raises the fork error (r71e: accel answered the parent's state)."""
    from conftest import run_forked
    from test_lazy_fork import FORK_MESSAGE
    R.manual_seed(5)
    R.random_raw_(accel.Buffer(16))                 # parent initialized the runtime

    def child():
        R.manual_seed(6)
        R.manual_seed_all(7)
        for query in (lambda: R.get_rng_state(0), lambda: R.initial_seed(0), R.get_rng_state_all):
            try:
                query()
                return 3
            except RuntimeError as exc:
                if str(exc) != FORK_MESSAGE:
                    return 6
        try:
            R.random_raw_(accel.Buffer(16))
        except RuntimeError as exc:
            return 0 if str(exc) == FORK_MESSAGE else 4
        return 5

    assert run_forked(child) == 0
    assert R.initial_seed(0) == 5 and R.default_generator(0).offset == 4
