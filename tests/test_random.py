"""accel.random on the host: Philox KATs, the cuRAND stream layout, the value
transforms, and the Generator state rules.  No device or simulator needed."""

import math
import struct

import pytest

np = pytest.importorskip("numpy")

from accel.random import _fills, _transforms, philox  # noqa: E402
from accel.random.generator import DEFAULT_SEED, Generator, check_seed  # noqa: E402

MASK = 0xFFFFFFFF

# Random123 kat_vectors for philox4x32_10: (ctr, key, expected)
KATS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((MASK,) * 4, (MASK, MASK), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


# -- an independent scalar model: Random123 in plain ints, cuRAND's state machine ------------
def philox_scalar(ctr, key):
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & MASK, (k1 + 0xBB67AE85) & MASK
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK, (p0 >> 32) ^ c3 ^ k1, p0 & MASK
    return (c0, c1, c2, c3)


class CurandPhilox:
    """curand_init(seed, subsequence, offset) + curand(), as curand_philox4x32_x.h."""

    def __init__(self, seed, subsequence, offset):
        self.key = (seed & MASK, (seed >> 32) & MASK)
        # counter as a 128-bit integer: words 0..1 <- offset/4 steps, words 2..3 <- subsequence
        self.ctr = (subsequence % (1 << 64)) << 64
        self.ctr += offset >> 2
        self.state = offset & 3
        self._refresh()

    def _refresh(self):
        c = self.ctr
        self.output = philox_scalar(tuple((c >> (32 * i)) & MASK for i in range(4)), self.key)

    def __call__(self):
        ret = self.output[self.state]
        self.state += 1
        if self.state == 4:
            self.ctr = (self.ctr + 1) % (1 << 128)
            self._refresh()
            self.state = 0
        return ret


# -- Philox ------------------------------------------------------------------------------------
@pytest.mark.parametrize("ctr,key,want", KATS)
def test_random123_known_answers(ctr, key, want):
    assert tuple(int(x) for x in philox.philox4x32_10(ctr, key)) == want
    assert philox_scalar(ctr, key) == want


def test_vector_philox_matches_scalar_on_random_inputs():
    rng = np.random.default_rng(7)
    ctr = rng.integers(0, 1 << 32, size=(64, 4), dtype=np.uint32)
    key = rng.integers(0, 1 << 32, size=(64, 2), dtype=np.uint32)
    out = philox.philox4x32_10(ctr, key)
    for i in range(64):
        assert tuple(int(x) for x in out[i]) == philox_scalar(tuple(map(int, ctr[i])), tuple(map(int, key[i])))


@pytest.mark.parametrize("seed,offset,n", [
    (0, 0, 37), (1, 4, 9), (0xDEADBEEFCAFEF00D, 4 * 1000, 21), (2**64 - 1, 3, 11),
    (67280421310721, (2**32 - 3) * 4, 40),      # counter word 0 wraps into word 1 inside the fill
])
def test_host_words_are_curand_order(seed, offset, n):
    ref = CurandPhilox(seed, 0, offset)
    want = [ref() for _ in range(n)]
    assert philox.raw_words(seed, offset, n).tolist() == want


@pytest.mark.parametrize("threads", [1, 2])
def test_fast_path_equals_reference_over_chunks(threads, monkeypatch):
    # more than one chunk and a partial one, so chunking and the thread split are exercised
    monkeypatch.setattr(philox, "_PARALLEL_MIN", 0)
    n_ctr = 2 * philox._CHUNK + 123
    seed = 0x0123456789ABCDEF
    start = (1 << 32) - philox._CHUNK // 2              # crosses a change of counter word 1
    fast = philox.philox_counters(seed, start, n_ctr, threads=threads)
    c = np.uint64(start) + np.arange(n_ctr, dtype=np.uint64)
    ctr = np.zeros((n_ctr, 4), np.uint32)
    ctr[:, 0] = (c & np.uint64(MASK)).astype(np.uint32)
    ctr[:, 1] = (c >> np.uint64(32)).astype(np.uint32)
    ref = philox.philox4x32_10(ctr, [seed & MASK, seed >> 32])
    assert np.array_equal(fast, ref)


def test_consecutive_fills_continue_one_stream():
    seed = 99
    whole = philox.raw_words(seed, 0, 64)
    assert np.array_equal(np.concatenate([philox.raw_words(seed, 0, 24), philox.raw_words(seed, 24, 40)]), whole)


def test_bad_arguments():
    with pytest.raises(ValueError):
        philox.raw_words(1, -4, 3)
    with pytest.raises(ValueError):
        philox.raw_words(1, 0, -1)
    with pytest.raises(ValueError, match="expected ctr"):
        philox.philox4x32_10([0, 0, 0], [0, 0])
    assert philox.raw_words(1, 0, 0).shape == (0,)


# -- transforms --------------------------------------------------------------------------------
def _words(n, seed=5):
    return philox.raw_words(seed, 0, n)


def test_uniform_f32_rule_and_range():
    w = _words(4096)
    u = _transforms.uniform_f32(w)
    assert u.dtype == np.float32
    assert np.array_equal(u, (w >> 8).astype(np.float32) * np.float32(2.0 ** -24))
    assert u.min() >= 0.0 and u.max() < 1.0
    v = _transforms.uniform_f32(w, -3.0, 5.0)
    assert v.min() >= -3.0 and v.max() < 5.0
    assert abs(float(v.mean()) - 1.0) < 0.2
    # edge words: 0 -> low; all ones -> the largest value below 1
    assert _transforms.uniform_f32(np.array([0, MASK], np.uint32)).tolist() == [0.0, 1 - 2.0 ** -24]


def test_uniform_rounding_up_to_high_becomes_low():
    # u = 1 - 2**-24; u*scale + low rounds to high in float32 -> low (torch's rule)
    w = np.array([MASK], np.uint32)
    assert _transforms.uniform_f32(w, 1.0, 1.0 + 2.0 ** -23).tolist() == [1.0]
    assert _transforms.uniform_f32(w, 1e6, 1e6 + 1.0).tolist() == [1e6]


def test_uniform_f64_rule_and_range():
    w = _words(4096)
    u = _transforms.uniform_f64(w)
    assert u.dtype == np.float64 and u.shape == (2048,)
    a, b = int(w[0]), int(w[1])
    assert u[0] == ((a >> 5) * 2.0 ** 26 + (b >> 6)) * 2.0 ** -53
    assert u.min() >= 0.0 and u.max() < 1.0
    top = _transforms.uniform_f64(np.array([MASK, MASK], np.uint32))
    assert top[0] == 1 - 2.0 ** -53


def test_log_and_sincos_polynomials_are_accurate():
    rng = np.random.default_rng(3)
    u = np.concatenate([rng.random(20000) + 1e-300, [1.0, 2.0 ** -53, 2.0 ** -32, 0.5, 1 - 2.0 ** -53]])
    np.testing.assert_allclose(_transforms.log_f64(u), np.log(u), rtol=2e-15, atol=1e-300)
    octant = rng.integers(0, 8, 20000)
    frac = rng.random(20000)
    s, c = _transforms.sincos_octant(octant, frac)
    angle = (octant + frac) * (math.pi / 4)
    np.testing.assert_allclose(s, np.sin(angle), atol=4e-15)
    np.testing.assert_allclose(c, np.cos(angle), atol=4e-15)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_normal_statistics(dtype):
    n = 200_000
    kind = "normal_f32" if dtype == "float32" else "normal_f64"
    w = philox.raw_words(2024, 0, _transforms.words_for(kind, n))
    fn = _transforms.normal_f32 if dtype == "float32" else _transforms.normal_f64
    z = fn(w, n, mean=2.0, std=3.0).astype(np.float64)
    assert z.dtype == np.float64 and z.shape == (n,)
    # 6-sigma bounds for the sample mean and standard deviation (deterministic seed)
    assert abs(z.mean() - 2.0) < 6 * 3.0 / math.sqrt(n)
    assert abs(z.std() - 3.0) < 6 * 3.0 / math.sqrt(2 * n)
    standardized = (z - 2.0) / 3.0
    assert abs(np.mean(standardized ** 3)) < 0.05      # skewness
    assert abs(np.mean(standardized ** 4) - 3.0) < 0.1  # kurtosis
    assert abs(np.mean(np.abs(standardized) < 1) - 0.6827) < 0.01


def test_normal_pairing_and_odd_length():
    w = _words(8)
    z = _transforms.normal_f32(w, 3)
    assert z.shape == (3,)
    z4 = _transforms.normal_f32(w[:4], 4)
    assert np.array_equal(z, z4[:3])
    # pair 0 = (r cos, r sin) of words 0, 1
    a, b = int(w[0]), int(w[1])
    r = math.sqrt(-2 * math.log((a + 1) * 2.0 ** -32))
    theta = 2 * math.pi * b * 2.0 ** -32
    assert z[0] == pytest.approx(r * math.cos(theta), rel=1e-6, abs=1e-6)
    assert z[1] == pytest.approx(r * math.sin(theta), rel=1e-6, abs=1e-6)


def test_randint_rules():
    w = _words(1000)
    v = _transforms.randint(w, -5, 7, "int64")
    assert v.dtype == np.int64 and v.min() >= -5 and v.max() < 7
    assert np.array_equal(v, w.astype(np.int64) % 12 - 5)
    v32 = _transforms.randint(w, -(2**31), 2**31, "int32")      # span 2**32: the low word of a pair
    assert v32.dtype == np.int32 and np.array_equal(v32.view(np.uint32), w[0::2] + np.uint32(2**31))
    # spans from 2**28 take two words, as torch's uniform_int_from_to (one word is skewed, r69b)
    assert np.array_equal(_transforms.randint(w, 0, (1 << 28) - 1, "int64"), w.astype(np.int64) % ((1 << 28) - 1))
    v64 = w[0::2].astype(np.uint64) | (w[1::2].astype(np.uint64) << np.uint64(32))
    assert np.array_equal(_transforms.randint(w, 0, 1 << 28, "int32"), (v64 % np.uint64(1 << 28)).astype(np.int32))
    wide = _transforms.randint(w, 0, 2**40, "int64")
    v64 = w[0::2].astype(np.uint64) | (w[1::2].astype(np.uint64) << np.uint64(32))
    assert wide.shape == (500,) and np.array_equal(wide.astype(np.uint64), v64 % np.uint64(2**40))
    full = _transforms.randint(w, -(2**63), 2**63, "int64")
    assert np.array_equal(full.view(np.uint64), v64 + np.uint64(2**63))
    assert _transforms.randint_kind(0, 2**28 - 1, "int64") == "randint_i64"
    assert _transforms.randint_kind(0, 2**28, "int64") == "randint_i64_wide"    # (torch: from 2**28 on)
    assert _transforms.randint_kind(0, 2**28 - 1, "int32") == "randint_i32"
    assert _transforms.randint_kind(0, 2**28, "int32") == "randint_i32_wide"


@pytest.mark.parametrize("kind,n,words", [
    ("raw_u32", 5, 5), ("uniform_f32", 5, 5), ("uniform_f64", 5, 10), ("normal_f32", 5, 6),
    ("normal_f64", 5, 12), ("randint_i32", 3, 3), ("randint_i64_wide", 3, 6)])
def test_words_consumed(kind, n, words):
    assert _transforms.words_for(kind, n) == words
    assert _transforms.offset_increment(words) == (words + 3) // 4 * 4


def test_fill_plans_check_arguments():
    with pytest.raises(TypeError, match="float32"):
        _fills.plan_uniform(16, "int32", 0, 1)
    with pytest.raises(ValueError, match="low=2.0 > high=1.0"):
        _fills.plan_uniform(16, "float32", 2, 1)
    with pytest.raises(ValueError, match="finite"):
        _fills.plan_uniform(16, "float64", 0, float("inf"))
    with pytest.raises(ValueError, match="float32"):
        _fills.plan_uniform(16, "float32", -1e39, 1e39)
    with pytest.raises(ValueError, match="whole number"):
        _fills.plan_uniform(10, "float64", 0, 1)
    with pytest.raises(ValueError, match="std >= 0"):
        _fills.plan_normal(16, "float32", 0, -1)
    with pytest.raises(ValueError, match="less than"):
        _fills.plan_randint(16, "int64", 3, 3)
    with pytest.raises(ValueError, match="int32 range"):
        _fills.plan_randint(16, "int32", 0, 2**31 + 1)
    with pytest.raises(TypeError, match="integer"):
        _fills.plan_randint(16, "int64", 0.5, 3)
    assert _fills.plan_randint(16, "int32", -(2**31), 2**31).kind == "randint_i32_wide"
    assert _fills.plan_randint(16, "int64", -(2**63), 2**63).kernel_args == [("u64", 0), ("i64", -(2**63))]


# -- Generator state -----------------------------------------------------------------------------
def test_default_seed_and_state_layout():
    g = Generator(0)
    assert g.initial_seed() == DEFAULT_SEED == 67280421310721
    s = g.get_state()
    assert s.dtype == np.uint8 and s.shape == (16,)
    assert struct.unpack("<Qq", s.tobytes()) == (DEFAULT_SEED, 0)


def test_reserve_rounds_up_to_four():
    g = Generator(0)
    assert [g.reserve(k) for k in (1, 4, 5, 0, 8)] == [0, 4, 8, 16, 16]
    assert g.offset == 24


def test_state_round_trip_reproduces_a_sequence():
    g = Generator(0, seed=1234)
    g.reserve(12)
    saved = g.get_state()
    first = [philox.raw_words(g.initial_seed(), g.reserve(8), 8).tolist() for _ in range(3)]
    g.set_state(saved)
    again = [philox.raw_words(g.initial_seed(), g.reserve(8), 8).tolist() for _ in range(3)]
    assert first == again


def test_set_state_eight_bytes_is_seed_with_offset_zero():
    g = Generator(0, seed=5)
    g.reserve(40)
    g.set_state(np.frombuffer(struct.pack("<Q", 77), np.uint8))
    assert (g.initial_seed(), g.offset) == (77, 0)
    g.set_state(struct.pack("<Qq", 9, 12))     # bytes are accepted too
    assert (g.initial_seed(), g.offset) == (9, 12)


@pytest.mark.parametrize("bad,exc,msg", [
    (np.zeros(15, np.uint8), RuntimeError, "RNG state is wrong size"),
    (np.zeros(17, np.uint8), RuntimeError, "RNG state is wrong size"),
    (np.zeros(0, np.uint8), RuntimeError, "RNG state is wrong size"),
    (np.frombuffer(struct.pack("<Qq", 1, 6), np.uint8), RuntimeError, "offset must be a multiple of 4"),
    (np.frombuffer(struct.pack("<Qq", 1, -4), np.uint8), RuntimeError, "non-negative"),
    (np.zeros(16, np.int8), TypeError, "uint8"),
    (np.zeros(2, np.uint64), TypeError, "uint8"),
    (np.zeros((2, 8), np.uint8), TypeError, "1-D"),
    ([0] * 16, TypeError, "uint8"),
    (None, TypeError, "1-D uint8 array"),
    (1234, TypeError, "1-D uint8 array"),
])
def test_bad_state_leaves_generator_unchanged(bad, exc, msg):
    g = Generator(0, seed=31)
    g.reserve(20)
    before = g.get_state()
    with pytest.raises(exc, match=msg):
        g.set_state(bad)
    assert np.array_equal(g.get_state(), before)


def test_seed_range_and_negative_seeds():
    assert check_seed(-1) == 2**64 - 1
    assert check_seed(-(2**63)) == 2**63
    assert check_seed(2**64 - 1) == 2**64 - 1
    assert check_seed(np.int64(-2)) == 2**64 - 2
    g = Generator(0, seed=3)
    g.reserve(4)
    for bad, exc in ((2**64, ValueError), (-(2**63) - 1, ValueError), (1.5, TypeError), ("1", TypeError),
                     (True, TypeError)):
        with pytest.raises(exc, match="64 bits|integer"):
            g.manual_seed(bad)
        assert (g.initial_seed(), g.offset) == (3, 4)
    g.manual_seed(-5)
    assert (g.initial_seed(), g.offset) == (2**64 - 5, 0)


def test_seed_is_random_53_bits_and_resets_offset():
    g = Generator(0)
    g.reserve(8)
    values = {g.seed() for _ in range(4)}
    assert len(values) > 1 and all(0 <= v < 2**53 for v in values)
    assert g.offset == 0 and g.initial_seed() in values


def test_graph_safe_mode_counts_intragraph_offsets():
    g = Generator(0, seed=11)
    g.reserve(8)
    words = iter((0x1000, 0x1008))
    g.register_graph(alloc=lambda n: next(words))
    g.capture_prologue()
    a = g.philox_args(6)
    b = g.philox_args(1)
    assert (a.seed, a.offset, a.seed_ptr, a.offset_ptr) == (0, 0, 0x1000, 0x1008)
    assert b.offset == 8 and b.captured
    eager = g.philox_args(4, graph=False)          # another stream, not capturing
    assert eager == (11, 8, 0, 0)
    with pytest.raises(RuntimeError, match="can be called during stream capture only if new seed is the same"):
        g.manual_seed(1)
    g.manual_seed(11)                               # the seed in use: allowed, a no-op
    assert g.capture_epilogue() == 12
    writes = []
    for _ in range(2):
        g.replay_prologue(12, stream=7, write=lambda *a: writes.append(a))
    assert writes == [(0, 0x1000, 0x1008, 11, 12, 7), (0, 0x1000, 0x1008, 11, 24, 7)]
    assert g.offset == 36
    other = Generator(0)
    with pytest.raises(RuntimeError, match="not in graph-safe mode"):
        other.philox_args(4, graph=True)
