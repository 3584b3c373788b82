"""Round r69b: PyTorch tests of the generator / RNG surface that tests/TORCH_PORTS.md did not
list yet, ported to accel.  /work/notes/r69b_torch_ports.md names every test considered and
where it went (a section for TORCH_PORTS.md).

Copies read:
- test/test_tensor_creation_ops.py BakeLab/pytorch@6cf714bd (216 kB, the newest stored copy;
  class TestRandomTensorCreation, read whole): the device halves of torch.rand/randn/randint/
  normal_/uniform_/random_ and the generator-device rules of randperm/randint;
- test/test_torch.py BakeLab/pytorch@014c9055 (495 kB; r59 read pytorch@e121c6ea, 410 kB):
  TestTorch.test_pickle_generator, added since;
- test/test_functionalization_of_rng_ops.py pytorch/pytorch@01cdd593: the eager halves
  (the reference runs) of test_rand and test_set_get_rng_state.

Conventions as tests/TORCH_PORTS.md: a tensor of n elements is an ``accel.Buffer`` of n items,
``torch.rand``/``randn``/``randint``/``t.random_(a, b)`` on a device are
``accel.random.uniform_``/``normal_``/``randint_`` of a Buffer of that device,
``torch.manual_seed`` (every device) is ``accel.random.manual_seed_all`` and
``torch.cuda.manual_seed`` (the current device) ``accel.random.manual_seed``,
``torch.Generator(device='cuda:1')`` is ``accel.random.Generator('cuda:1')`` (the accelerator's
type).  torch's RuntimeErrors for bad arguments are accel's ValueErrors (TypeErrors for types).

Every test runs on every simulator, on device 0 and on device 1 while device 0 stays current
(Metal has one device: its device-1 cases skip).  Seeds are fixed, so the statistical checks are
deterministic.  Test names are ``test_<torch file>__<torch test>``; strict xfails carry reasons
starting "r69b:".
"""

import pickle

import numpy as np
import pytest

import accel
import accel.random as R

DEVICES = (0, 1)


def _need(device):
    """Skip device 1 where the simulator has one device (Metal)."""
    if device >= accel.device_count():
        pytest.skip(f"{accel.current_accelerator()} has {accel.device_count()} device(s)")


def _type() -> str:
    return accel.current_accelerator().type


def _fill(fill, n, device, dtype, *args, **kwargs):
    """``fill(buf, *args, dtype=dtype, **kwargs)`` of a new n-element Buffer on ``device``,
    read back as ``dtype``.  Device 0 stays current."""
    buf = accel.Buffer(np.dtype(dtype).itemsize * n, device=device)
    fill(buf, *args, dtype=dtype, **kwargs)
    out = buf.to_numpy().view(dtype)
    assert accel.current_device_index() == 0
    return out


def _offset(device) -> int:
    return R.default_generator(device).offset


# =================================================== test_tensor_creation_ops.py TestRandomTensorCreation
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("device", DEVICES)
def test_tensor_creation_ops__test_normal(sim_backend, device, dtype):
    # torch: q.normal_() mean 0 / std 1 within 0.2; q.normal_(2, 3) within 0.3; torch.normal(2, 3,
    # size) likewise; std 0 gives exactly the mean.  Tensor-valued mean/std, slices (q[99:100])
    # and complex dtypes: no API (a fill writes a whole Buffer, scalar mean and std).
    _need(device)
    R.default_generator(device).manual_seed(1234)
    q = _fill(R.normal_, 100 * 100, device, dtype).astype(np.float64)
    assert abs(q.mean() - 0) <= 0.2 and abs(q.std() - 1) <= 0.2
    q = _fill(R.normal_, 100 * 100, device, dtype, 2, 3).astype(np.float64)
    assert abs(q.mean() - 2) <= 0.3 and abs(q.std() - 3) <= 0.3
    r = _fill(R.normal_, 100 * 100, device, dtype, mean=2.0, std=3.0).astype(np.float64)
    assert abs(r.mean() - 2) <= 0.3 and abs(r.std() - 3) <= 0.3
    # "float std 0 with float mean"
    r = _fill(R.normal_, 10 * 10, device, dtype, 2, 0)
    assert r.dtype == np.dtype(dtype) and bool((r == 2).all())
    # the draws came from the buffer's device: device 0's generator never moved
    if device:
        assert _offset(0) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_creation_ops__test_normal_std_error(sim_backend, device):
    # torch: torch.normal(input, -1, (10,)) raises "normal expects std >= 0.0, but found std"
    # (RuntimeError; accel: ValueError, same words); the tensor-std half is no API.  The
    # refused fill draws nothing.
    _need(device)
    buf = accel.Buffer(4 * 10, device=device)
    before = _offset(device)
    for mean in (0, 0.0):
        with pytest.raises(ValueError, match=r"normal_ expects std >= 0.0, but found std"):
            R.normal_(buf, mean, -1)
    assert _offset(device) == before


_F32 = np.finfo(np.float32)
_F64 = np.finfo(np.float64)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("device", DEVICES)
def test_tensor_creation_ops__test_uniform_from_to(sim_backend, device, dtype):
    # torch's loop over from/to in {double_min, float_min, -42, 0, 42, float_max, double_max}:
    # pairs outside the dtype's range are skipped; to < from raises "uniform_ expects to return";
    # to - from > max raises "uniform_ expects to-from" (accel: ValueError, "does not fit in
    # float32" / "high - low overflows"); otherwise 2000 values lie in [from, to), the least
    # within 10 % of the range above from, the greatest within 10 % below to; from == to gives
    # from.  half/bfloat16: no API (float32 and float64 fills).
    _need(device)
    R.default_generator(device).manual_seed(42)
    size, alpha = 2000, 0.1
    float_min, float_max = float(_F32.min), float(_F32.max)
    double_min, double_max = float(_F64.min), float(_F64.max)
    min_val, max_val = (float_min, float_max) if dtype == "float32" else (double_min, double_max)
    values = [double_min, float_min, -42, 0, 42, float_max, double_max]
    buf = accel.Buffer(np.dtype(dtype).itemsize * size, device=device)
    checked = 0
    for from_ in values:
        for to_ in values:
            if not (min_val <= from_ <= max_val) or not (min_val <= to_ <= max_val):
                continue
            before = _offset(device)
            if to_ < from_:
                with pytest.raises(ValueError, match=r"uniform_ expects to return"):
                    R.uniform_(buf, dtype, from_, to_)
                assert _offset(device) == before
            elif to_ - from_ > max_val:
                with pytest.raises(ValueError, match=r"uniform_: .*(does not fit in float32|overflows)"):
                    R.uniform_(buf, dtype, from_, to_)
                assert _offset(device) == before
            else:
                R.uniform_(buf, dtype, from_, to_)
                t = buf.to_numpy().view(dtype).astype(np.float64)
                range_ = to_ - from_
                delta = alpha * range_
                assert not np.isnan(t).any()
                if range_ == 0:
                    assert t.min() == from_ and t.max() == to_, (from_, to_)
                else:
                    assert from_ <= t.min() <= from_ + delta, (from_, to_, t.min())
                    assert to_ - delta <= t.max() < to_, (from_, to_, t.max())
                checked += 1
    assert checked == (14 if dtype == "float32" else 27)


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_creation_ops__test_random_neg_values(sim_backend, device):
    # torch: res.random_(-10, -1) on double/float/long/int/short lies in [-10, -1).  accel's
    # integer fill covers int64 and int32; random_ of a float tensor: no API (randint_ refuses
    # float dtypes with TypeError).
    _need(device)
    R.default_generator(device).manual_seed(7)
    for dtype in ("int64", "int32"):
        res = _fill(R.randint_, 10 * 10, device, dtype, -10, -1)
        assert res.max() <= -2 and res.min() >= -10
        assert set(res.tolist()) == set(range(-10, -1))       # 100 draws of 9 values: all seen
    with pytest.raises(TypeError):
        R.randint_(accel.Buffer(4 * 100, device=device), -10, -1, dtype="float32")


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_creation_ops__test_randint_inference(sim_backend, device):
    # torch (onlyCPU; the device half here): the default dtype is int64; from >= to raises
    # "random_ expects 'from' to be less than 'to', but got from=0 >= to=0"; a float bound is a
    # TypeError; a bound outside the dtype raises "from is out of bounds for" (int16, uint32 in
    # torch; int32 here).  accel's words: "randint_ expects 'low' to be less than 'high'".
    # dtype=float32 (torch: a float tensor of integers): no API, TypeError.  Refusals draw nothing.
    import inspect
    _need(device)
    assert inspect.signature(R.randint_).parameters["dtype"].default == "int64"
    buf = accel.Buffer(8 * 2, device=device)
    before = _offset(device)
    with pytest.raises(ValueError, match=r"expects 'low' to be less than 'high', but got low=0 >= high=0"):
        R.randint_(buf, 0, 0)
    with pytest.raises(ValueError, match=r"expects 'low' to be less than 'high', but got low=-1 >= high=-2"):
        R.randint_(buf, -1, -2)
    with pytest.raises(TypeError, match="integer"):
        R.randint_(buf, 0, .5)
    with pytest.raises(ValueError, match="outside the int32 range"):
        R.randint_(buf, -2 ** 31 - 1, 0, dtype="int32")
    with pytest.raises(TypeError):
        R.randint_(buf, -1, 1, dtype="uint32")
    with pytest.raises(TypeError):
        R.randint_(buf, 0, 3, dtype="float32")
    assert _offset(device) == before


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_creation_ops__test_randint(sim_backend, device):
    # torch (onlyCPU; the device half here): for generator None (torch.manual_seed) and a
    # torch.Generator (generator.manual_seed), reseeding before each of randint(0, 6, ...),
    # randint(0, 6, ..., out=), randint(6, ...), randint(6, ..., out=) gives equal results in
    # [0, 6).  torch's randint(6) is [0, 6); out= is a second buffer.  A fresh explicit generator
    # and the default generator seeded alike draw the same numbers (one Philox stream per seed).
    _need(device)
    size = 100

    def seed(generator):
        if generator is None:
            R.manual_seed_all(123456)
        else:
            generator.manual_seed(123456)
        return generator

    draws = {}
    for generator in (None, R.Generator(f"{_type()}:{device}")):
        results = []
        for _ in range(4):
            generator = seed(generator)
            results.append(_fill(R.randint_, size * size, device, "int64", 0, 6, generator=generator))
        for res in results[1:]:
            np.testing.assert_array_equal(results[0], res)
        assert bool((results[0] < 6).all()) and bool((results[0] >= 0).all())
        draws[generator is None] = results[0]
    np.testing.assert_array_equal(draws[True], draws[False])


def _randint_histogram_error(n_max, device, dtype):
    """torch's test_randint_distribution: 1,000,000 draws of randint(n_max) binned in 8 equal
    bins; the largest relative deviation from the expected bin count, and the bound torch
    allows (3 sigma)."""
    size, n_bins = 1_000_000, 8
    R.default_generator(device).manual_seed(2024)
    res = _fill(R.randint_, size, device, dtype, 0, n_max)
    assert res.min() >= 0 and res.max() < n_max
    bins = (res.astype(np.int64) // (n_max // n_bins)).astype(np.float64)
    hist, _ = np.histogram(bins, n_bins, range=(0, n_bins))
    expected_bin = size / n_bins
    expected_error = np.sqrt(expected_bin) / expected_bin * 3
    return float(np.abs(hist - expected_bin).max() / expected_bin), float(expected_error)


# (r69b found; fixed: spans from 2**28 take two words per value, _transforms.WIDE_SPAN)
@pytest.mark.parametrize("n_max, dtype", [(int(0.75 * 2 ** 32), "int64"),     # torch's case
                                          (3 * 2 ** 28, "int64"), (3 * 2 ** 28, "int32")],
                         ids=["0.75x2^32-int64", "3x2^28-int64", "3x2^28-int32"])
@pytest.mark.parametrize("device", DEVICES)
def test_tensor_creation_ops__test_randint_distribution(sim_backend, device, n_max, dtype):
    _need(device)
    error, expected_error = _randint_histogram_error(n_max, device, dtype)
    assert error < expected_error, f"bin error {error:.4f} > {expected_error:.4f}"


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_creation_ops__test_randint_distribution_wide_range(sim_backend, device):
    # The same check where accel already takes two words per value (range > 2**32): even.
    _need(device)
    error, expected_error = _randint_histogram_error(int(1.5 * 2 ** 32), device, "int64")
    assert error < expected_error, f"bin error {error:.4f} > {expected_error:.4f}"


@pytest.mark.parametrize("fill, dtype", [(R.normal_, "float32"), (R.normal_, "float64"),
                                         (R.uniform_, "float32"), (R.uniform_, "float64")],
                         ids=["randn-float32", "randn-float64", "rand-float32", "rand-float64"])
@pytest.mark.parametrize("size", [0, 100])
@pytest.mark.parametrize("device", DEVICES)
def test_tensor_creation_ops__test_randn_and_test_rand(sim_backend, device, size, fill, dtype):
    # torch's test_randn / test_rand: torch.manual_seed(123456) before torch.randn(size, size) and
    # before torch.randn(size, size, out=res2): equal, for size 0 and 100.  half/bfloat16/complex:
    # no API.  An empty tensor draws nothing (torch's distribution kernels return before taking a
    # Philox offset when numel is 0): the offset stays at 0.
    _need(device)
    R.manual_seed_all(123456)
    res1 = _fill(fill, size * size, device, dtype)
    offset1 = _offset(device)
    R.manual_seed_all(123456)
    res2 = _fill(fill, size * size, device, dtype)
    np.testing.assert_array_equal(res1, res2)
    assert _offset(device) == offset1
    assert res1.size == size * size
    assert (offset1 == 0) is (size == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_creation_ops__test_randperm_device_compatibility(sim_backend, device):
    # torch (onlyCUDA; here every backend): a generator of the tensor's device, named with or
    # without an index, is accepted; a generator of another device type is refused ("Expected a
    # 'cuda' device type for generator but found 'cpu'", RuntimeError).  accel has no CPU
    # generator: a numpy Generator is its nearest, refused with TypeError.  randperm itself: no
    # API; randint_ stands for it (torch's test calls both).
    _need(device)
    t = _type()
    for n in (0, 1, 3, 100, 30000):
        buf = accel.Buffer(8 * n, device=device)
        R.randint_(buf, 0, n + 1, generator=R.Generator(f"{t}:{device}"))
        with accel.device_index(device):
            R.randint_(buf, 0, n + 1, generator=R.Generator(t))     # no index: the current device
        if n:
            assert bool((buf.to_numpy().view(np.int64) <= n).all())
        with pytest.raises(TypeError, match="accel.random.Generator"):
            R.randint_(buf, 0, n + 1, generator=np.random.default_rng(0))


# (r69b found; fixed: a fill draws from another device's generator outside a capture)
@pytest.mark.parametrize("n", [0, 3, 30000])
def test_tensor_creation_ops__test_randperm_device_compatibility_other_index(sim_backend, n):
    _need(1)
    t = _type()
    for buf_device, gen_device in ((0, 1), (1, 0)):
        buf = accel.Buffer(8 * n, device=buf_device)
        gen = R.Generator(f"{t}:{gen_device}")
        R.randint_(buf, 0, n + 1, generator=gen)
        if n:
            assert bool((buf.to_numpy().view(np.int64) <= n).all())
            assert gen.offset > 0           # the draw came from the generator passed


# =============================================================== test_torch.py TestTorch
@pytest.mark.parametrize("device", DEVICES)
def test_torch__test_pickle_generator(sim_backend, device):
    # torch: Generator(device).manual_seed(12345), set_offset(100) on a device generator, a
    # randn((100, 100)) draw, then pickle.loads(pickle.dumps(g)) has the same device,
    # initial_seed, get_offset and get_state.  The "cpu" half: no API (no host generator).
    _need(device)
    generator = R.Generator(f"{_type()}:{device}").manual_seed(12345)
    assert isinstance(generator, R.Generator)
    generator.set_offset(100)
    _fill(R.normal_, 100 * 100, device, "float32", generator=generator)     # progress the RNG state
    assert generator.get_offset() > 100
    reserialized = pickle.loads(pickle.dumps(generator))
    assert reserialized is not generator
    assert reserialized.device == generator.device == accel.device(_type(), device)
    assert reserialized.initial_seed() == generator.initial_seed() == 12345
    assert reserialized.get_offset() == generator.get_offset()
    np.testing.assert_array_equal(reserialized.get_state(), generator.get_state())
    # independent from here on, and both draw the same next numbers
    a = _fill(R.uniform_, 64, device, "float32", generator=generator)
    b = _fill(R.uniform_, 64, device, "float32", generator=reserialized)
    np.testing.assert_array_equal(a, b)


# ============================================ test_functionalization_of_rng_ops.py (eager halves)
@pytest.mark.parametrize("device", DEVICES)
def test_functionalization_of_rng_ops__test_rand(sim_backend, device):
    # torch: for seed in range(10): torch.cuda.manual_seed(seed); ref = fn(x) (two torch.rand(10)
    # draws); torch.cuda.manual_seed(seed); res = the compiled fn(x); equal.  The compiled half is
    # torch-internal; its reference: reseeding the current device repeats both draws.  On device
    # 1 the seeding runs with device 1 made current (torch.cuda.manual_seed seeds the current
    # device only): device 0's generator is left alone, and a seed given with device 0 current
    # does not reach device 1.
    _need(device)
    for seed in range(10):
        runs = []
        for _ in range(2):
            with accel.device_index(device):
                R.manual_seed(seed)
            runs.append((_fill(R.uniform_, 10, device, "float32"), _fill(R.uniform_, 10, device, "float32")))
        np.testing.assert_array_equal(runs[0][0], runs[1][0])
        np.testing.assert_array_equal(runs[0][1], runs[1][1])
        assert not np.array_equal(runs[0][0], runs[0][1])
        assert R.initial_seed(device) == seed
    if device:
        assert _offset(0) == 0 and R.initial_seed(0) == R.DEFAULT_SEED
        state1 = R.get_rng_state(1)
        R.manual_seed(99)                       # device 0 current: device 1 keeps its state
        np.testing.assert_array_equal(R.get_rng_state(1), state1)
        assert R.initial_seed(0) == 99


@pytest.mark.parametrize("device", DEVICES)
def test_functionalization_of_rng_ops__test_set_get_rng_state(sim_backend, device):
    # torch's fn: a = rand_like(x); state = torch.cuda.get_rng_state(); a = rand_like(x);
    # torch.cuda.set_rng_state(state); a = rand_like(x): the third draw repeats the second.
    # The no-argument calls name the current device; here they run inside device_index(device),
    # and the device-argument forms (index, "type:index") from device 0 agree with them.
    _need(device)
    t = _type()
    for seed in range(10):
        with accel.device_index(device):
            R.manual_seed(seed)
        first = _fill(R.uniform_, 10, device, "float32")
        with accel.device_index(device):
            state = R.get_rng_state()
        np.testing.assert_array_equal(state, R.get_rng_state(device))
        np.testing.assert_array_equal(state, R.get_rng_state(f"{t}:{device}"))
        second = _fill(R.uniform_, 10, device, "float32")
        with accel.device_index(device):
            R.set_rng_state(state)
        third = _fill(R.uniform_, 10, device, "float32")
        np.testing.assert_array_equal(second, third)
        assert not np.array_equal(first, second)
        R.set_rng_state(state, f"{t}:{device}")       # the device-string form, from device 0
        np.testing.assert_array_equal(_fill(R.uniform_, 10, device, "float32"), second)
    if device:
        assert _offset(0) == 0
