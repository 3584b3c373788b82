"""Edge values across the public API (r62a), on every simulator, on the last device while
device 0 is current.

What tests/test_api_fuzz_r32.py, test_refusals_r58.py and test_api_state_machine_r60.py leave
out: zero sizes everywhere (Buffer(0) and each method of it, empty views, empty random fills,
empty copies across devices and to or from pinned and pageable host memory, under
``use_mem_pool`` and inside a graph capture and its replay), the integers a caller may pass
where ints go (numpy scalars, ``__index__`` objects, Fraction, Decimal, nan, 2**31 .. 2**64)
and seeds at the ends of their range (torch's CPU generator is the oracle), and copies whose
source and destination are one buffer or overlap, or whose host array is strided, read-only,
of another dtype or of another size.

A zero-size call must do what torch does for an empty tensor (nothing: no allocation, no
statistic, no RNG offset); a refused call must raise a clear error naming the value and leave
the whole fingerprint of test_refusals_r58 (memory stats and snapshot of both devices, the
simulator's live handles, current device and streams, RNG states, ...) as it was.
"""

import copy
import gc
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest

import accel
import accel.memory as M
import accel.random as R
from accel import sim
from test_refusals_r58 import CLEAR, Case, Sweep, _current, _diff, _fingerprint, _freeze

pytestmark = pytest.mark.usefixtures("frozen_heap")   # each fingerprint's collection sees the test's objects


class Idx:
    """An integer-like object (``__index__`` only), as a user type passes."""

    def __init__(self, value):
        self.value = value

    def __index__(self):
        return self.value

    def __repr__(self):
        return f"Idx({self.value})"


def _last():
    return accel.device_count() - 1


def _warm(d):
    """Every first-use path out of the way (random kernels, DLPack types, the event pools of a
    copy across devices), so that a fingerprint compares like with like; device 0 current."""
    for i in {0, d}:
        with accel.Buffer(64, i) as w:
            R.uniform_(w)
            R.normal_(w)
            R.randint_(w, 0, 9)
            R.random_raw_(w)
            accel.from_dlpack(w)
            w.as_array(np.float32).__dlpack__()
            w.to_numpy(np.float32)
            accel.current_stream(i)
    a, b = accel.Buffer(64, 0), accel.Buffer(64, d)
    b.copy_from(a)
    a.copy_from(b)
    b.copy_from(a.as_array(np.uint8))
    a.close()
    b.close()
    accel.set_device_index(0)
    for i in {0, d}:
        accel.synchronize(i)
        accel.Buffer(16, i).close()      # (an allocation processes the events of the blocks freed above)


def _run_all(cases, extra=()):
    """(label, fn, expected exception or None): each call's outcome and its fingerprint change."""
    problems = []
    for label, fn, want in cases:
        before = _fingerprint(extra)
        try:
            fn()
            got = None
        except Exception as exc:          # noqa: BLE001 - reported below
            exc.__traceback__ = None      # (its frames would keep a half-made object alive)
            got = exc
        after = _fingerprint(extra)
        if want is None and got is not None:
            problems.append(f"{label}: {type(got).__name__}: {got}")
        elif want is not None and not isinstance(got, want[0]):
            problems.append(f"{label}: wanted {want[0].__name__}, got {got!r}")
        elif want is not None and want[1] not in str(got):
            problems.append(f"{label}: message does not name {want[1]!r}: {got}")
        got = None
        if before != after:
            problems.append(f"{label}: state changed: {_diff(before, after)}")
    return problems


# -- 1. zero sizes ---------------------------------------------------------------------------------
def test_zero_size_buffer_every_method_changes_nothing(sim_backend):
    """Buffer(0) on the last device (device 0 current) and every method of it, empty views of it and
    of a live buffer, empty copies to and from the other device and host memory (pageable and a
    zero-length slice of pinned memory), empty random fills: each works, allocates nothing,
    counts nothing and moves no RNG offset (torch: an empty tensor's uniform_ draws nothing)."""
    d = _last()
    _warm(d)
    z, z2, z0 = accel.Buffer(0, d), accel.Buffer(0, d), accel.Buffer(0, 0)
    live, live0 = accel.Buffer(64, d), accel.Buffer(64, 0)
    live.fill_(7)
    pin = accel.empty_pinned(64)
    pin_end = pin[64:]                     # a zero-length slice of pinned memory
    side = accel.Stream(d)
    host0 = np.zeros(0, np.uint8)
    ro0 = np.zeros(0, np.float32)
    ro0.flags.writeable = False
    closed = accel.Buffer(0, d)
    closed.close()
    accel.synchronize(d)
    _freeze()
    cai = None if sim_backend == "cuda" else (AttributeError, "CUDA")
    cases = [
        ("Buffer(0, d)", lambda: accel.Buffer(0, d).close(), None),
        ("Buffer(np.int64(0), d)", lambda: accel.Buffer(np.int64(0), d), None),
        ("Buffer(Idx(0), 'dev:d')", lambda: accel.Buffer(Idx(0), f"{sim_backend}:{d}"), None),
        ("Buffer(0, d, stream=side)", lambda: accel.Buffer(0, d, stream=side), None),
        ("fill_", lambda: z.fill_(255), None),
        ("fill_(stream=side)", lambda: z.fill_(0, stream=side), None),
        ("to_numpy()", lambda: z.to_numpy(), None),
        ("to_numpy(float64, (0, 3))", lambda: z.to_numpy(np.float64, (0, 3)), None),
        ("copy_from(empty ndarray)", lambda: z.copy_from(host0), None),
        ("copy_from(empty read-only float32)", lambda: z.copy_from(ro0), None),
        ("copy_from(b'')", lambda: z.copy_from(b""), None),
        ("copy_from(empty ndarray, non_blocking)", lambda: z.copy_from(host0, non_blocking=True), None),
        ("copy_from(pinned[64:], non_blocking)", lambda: z.copy_from(pin_end, non_blocking=True), None),
        ("copy_to(bytearray())", lambda: z.copy_to(bytearray()), None),
        ("copy_to(pinned[64:], non_blocking)", lambda: z.copy_to(pin_end, non_blocking=True), None),
        ("copy_from(itself)", lambda: z.copy_from(z), None),
        ("copy_from(another empty buffer)", lambda: z.copy_from(z2, non_blocking=True), None),
        ("copy_from(empty buffer of device 0)", lambda: z.copy_from(z0), None),
        ("device 0 copy_from(empty buffer of d)", lambda: z0.copy_from(z), None),
        ("copy_from(empty view at the end of a live buffer)", lambda: z.copy_from(live.as_array(np.uint8, (0,), offset=64)),
         None),
        ("copy_from(empty view of a device-0 buffer)", lambda: z.copy_from(live0.as_array(np.uint8, (0,), offset=8)),
         None),
        ("as_array(float32)", lambda: z.as_array(np.float32), None),
        ("as_array(float32, (0, 4)).to_numpy()", lambda: z.as_array(np.float32, (0, 4)).to_numpy(), None),
        ("as_array(float32, (4, 0)).to_numpy()", lambda: z.as_array(np.float32, (4, 0)).to_numpy(), None),
        ("empty view.copy_from(empty host)", lambda: z.as_array(np.int16).copy_from(np.zeros(0, np.int16)), None),
        ("live view (0,).copy_from(empty view)", lambda: live.as_array(np.uint8, (0,), offset=3).copy_from(
            z.as_array(np.uint8)), None),
        ("live view (0,).to_numpy()", lambda: live.as_array(np.uint8, (0,), offset=64).to_numpy(), None),
        ("live view (2, 0).copy_from(host)", lambda: live.as_array(np.int32, (2, 0), offset=8).copy_from(
            np.zeros((2, 0), np.int32)), None),
        ("record_stream(side)", lambda: z.record_stream(side), None),
        ("__dlpack__()", lambda: z.__dlpack__(), None),
        ("__dlpack__(max_version=(1, 0), stream=-1)", lambda: z.__dlpack__(max_version=(1, 0), stream=-1)
         if sim_backend == "cuda" else z.__dlpack__(max_version=(1, 0)), None),
        ("from_dlpack(empty buffer)", lambda: accel.from_dlpack(z).close(), None),
        ("from_dlpack(empty view)", lambda: accel.from_dlpack(z.as_array(np.float64, (0, 2))), None),
        ("from_dlpack(empty view of a live buffer)", lambda: accel.from_dlpack(live.as_array(np.uint8, (0,), offset=5)),
         None),
        ("__cuda_array_interface__", lambda: z.__cuda_array_interface__, cai),
        ("uniform_", lambda: R.uniform_(z), None),
        ("normal_(float64)", lambda: R.normal_(z, dtype="float64"), None),
        ("randint_(int32)", lambda: R.randint_(z, -5, 5, "int32"), None),
        ("random_raw_", lambda: R.random_raw_(z), None),
        ("uniform_(own generator)", lambda: R.uniform_(z, generator=R.default_generator(d)), None),
        ("deepcopy", lambda: copy.deepcopy(z).close(), None),
        ("close twice", lambda: (accel.Buffer(0, d).close(), closed.close()), None),
        ("closed: fill_", lambda: closed.fill_(0), (RuntimeError, "closed")),
        ("closed: copy_from(empty)", lambda: closed.copy_from(host0), (RuntimeError, "closed")),
        ("closed: uniform_", lambda: R.uniform_(closed), (RuntimeError, "closed")),
        ("closed: as_array", lambda: closed.as_array(np.uint8), (RuntimeError, "closed")),
        ("empty buffer: fill_(256)", lambda: z.fill_(256), (ValueError, "256")),
        ("empty buffer: copy_to(read-only)", lambda: z.copy_to(ro0), (ValueError, "read-only")),
        ("empty buffer: copy_from(1 byte)", lambda: z.copy_from(b"x"), (ValueError, "1")),
        ("empty buffer: to_numpy(shape (1,))", lambda: z.to_numpy(np.uint8, (1,)), (ValueError, "(1,)")),
        ("empty buffer: randint_(5, 5)", lambda: R.randint_(z, 5, 5), (ValueError, "5")),
    ]
    if accel.device_count() > 1:
        cases += [
            ("empty buffer: fill_(stream of device 0)", lambda: z.fill_(0, stream=accel.current_stream(0)),
             (ValueError, "device")),
            ("empty buffer: record_stream(stream of device 0)", lambda: z.record_stream(accel.current_stream(0)),
             None),
        ]
    problems = _run_all(cases)
    assert accel.current_device_index() == 0
    assert not problems, "\n".join(problems)
    assert (live.to_numpy() == 7).all()


def test_zero_size_under_use_mem_pool(sim_backend):
    """Empty buffers made, used and freed inside use_mem_pool take nothing from the pool (its
    snapshot and use count stay), and the route still serves the next real allocation."""
    d = _last()
    _warm(d)
    with accel.device_index(d):
        pool = M.MemPool()
    snap, uses = pool.snapshot(), pool.use_count()
    _freeze()
    before = _fingerprint((("pool", pool.snapshot), ("uses", pool.use_count)))
    with M.use_mem_pool(pool, d):
        made = [accel.Buffer(0, d) for _ in range(3)]
        made[0].fill_(1)
        made[1].copy_from(made[2])
        R.uniform_(made[2])
        made.append(accel.Buffer(0, 0))       # another device's empty buffer meanwhile
    for b in made:
        b.close()
    made = b = None
    after = _fingerprint((("pool", pool.snapshot), ("uses", pool.use_count)))
    assert before == after, _diff(before, after)
    assert pool.snapshot() == snap and pool.use_count() == uses
    with M.use_mem_pool(pool, d):
        real = accel.Buffer(4096, d)
    assert {blk["address"] for seg in pool.snapshot() for blk in seg["blocks"]
            if blk["state"] == "active_allocated"} == {real.ptr}


def _settled(extra=()):
    """The fingerprint once the caches are emptied, without running totals, high-water marks and
    the allocator's bookkeeping objects."""
    gc.collect()
    for i in range(accel.device_count()):
        accel.synchronize(i)
    M.empty_cache()
    M.empty_host_cache()
    fp = _current(_fingerprint(extra))
    fp["host_memory_stats"] = {k: v for k, v in fp["host_memory_stats"].items()
                               if not k.endswith((".allocated", ".freed", ".peak"))}
    fp["sim"] = {k: v for k, v in fp["sim"].items() if "peak" not in k}
    for key in [k for k in fp if k.startswith("memory_stats(")]:
        fp[key] = {k: v for k, v in fp[key].items() if not k.startswith("num_")}
    # the allocator's own bookkeeping objects (a graph pool's segment record) are made anew by each
    # capture and those of the warm-up capture are frozen out of sight: bounded (checked over
    # repeated captures), and the memory they describe is compared above
    fp.pop("live accel objects")
    return fp


def test_zero_size_ops_in_a_capture_and_its_replays(sim_graph_backend):
    """Empty fills, copies (device to device, pageable and pinned host memory, empty views),
    random fills and allocations captured on a side stream of the last device, with one real
    fill: the capture stays valid, each replay does the fill and draws no RNG offset (the graph
    took no words), and once the graph is reset the state is what it was."""
    d = _last()
    _warm(d)
    z, z2 = accel.Buffer(0, d), accel.Buffer(0, d)
    target = accel.Buffer(256, d)
    target.fill_(0)
    pin = accel.empty_pinned(64)
    pin_end = pin[64:]
    side = accel.Stream(d)
    g0 = accel.Graph()                       # a capture's one-time paths (holders, kernels) once
    with accel.device_index(d), side:
        g0.capture_begin()
        if sim_graph_backend == "cuda":
            R.uniform_(target)          # (XPU has no Philox kernel to capture)
        target.fill_(1)
        g0.capture_end()
    g0.reset()
    g0 = None
    _freeze()
    before = _settled()
    rng = R.get_rng_state(d).tobytes()
    errors = []
    g = accel.Graph()
    with accel.device_index(d), side:
        g.capture_begin()
        for label, fn in [
            ("fill_", lambda: z.fill_(3)),
            ("copy_from(empty buffer)", lambda: z.copy_from(z2)),
            ("copy_from(empty pageable host), blocking", lambda: z.copy_from(np.zeros(0, np.uint8))),
            ("copy_from(pinned[64:], non_blocking)", lambda: z.copy_from(pin_end, non_blocking=True)),
            ("copy_to(empty pageable host), blocking", lambda: z.copy_to(np.zeros(0, np.uint8))),
            ("copy_to(pinned[64:], non_blocking)", lambda: z.copy_to(pin_end, non_blocking=True)),
            ("to_numpy()", lambda: z.to_numpy()),
            ("empty view of target .to_numpy()", lambda: target.as_array(np.uint8, (0,), offset=256).to_numpy()),
            ("empty view .copy_from(host)", lambda: target.as_array(np.uint8, (0,), offset=8).copy_from(
                np.zeros(0, np.uint8))),
            ("uniform_", lambda: R.uniform_(z)),
            ("randint_", lambda: R.randint_(z, 0, 5)),
            ("Buffer(0)", lambda: accel.Buffer(0)),
            ("record_stream(side)", lambda: z.record_stream(side)),
        ]:
            try:
                fn()
            except Exception as exc:     # noqa: BLE001 - reported below
                errors.append(f"{label}: {type(exc).__name__}: {exc}")
        target.fill_(9)
        g.capture_end()
    assert not errors, errors
    for _ in range(2):
        target.fill_(0)
        g.replay()
        accel.synchronize(d)
        assert (target.to_numpy() == 9).all()
    assert R.get_rng_state(d).tobytes() == rng, "an empty random fill in the graph drew words at replay"
    g.reset()
    g = None
    after = _settled()
    assert before == after, _diff(before, after)
    assert accel.current_device_index() == 0


def _synchronized(result):
    out, event = result
    event.synchronize()
    return out


def test_empty_pinned_of_no_bytes_pins_nothing(sim_backend):
    """An empty pinned array holds no memory, as torch.empty(0, pin_memory=True): no pinned block,
    no host_memory_stats change (r62a: active_requests.allocated 0->1, active_bytes 0->512, and
    the simulator's host_allocations 0->1 for the block then cached)."""
    d = _last()
    _warm(d)
    z = accel.Buffer(0, d)
    out, event = accel.Buffer(64, d).to_numpy(non_blocking=True)     # a pinned block and an Event, once
    event.synchronize()
    out = event = None
    _freeze()
    problems = []
    for label, fn in [("empty_pinned(0)", lambda: accel.empty_pinned(0)),
                      ("empty_pinned((0, 5), float32)", lambda: accel.empty_pinned((0, 5), np.float32)),
                      ("empty_pinned(3, itemsize-0 struct)", lambda: accel.empty_pinned(3, np.dtype([]))),
                      ("Buffer(0).to_numpy(non_blocking=True)", lambda: _synchronized(z.to_numpy(non_blocking=True)))]:
        before = _fingerprint()
        out = fn()
        assert out.size == 0 or out.nbytes == 0
        z.copy_to(out.view(np.uint8).reshape(-1) if out.dtype.itemsize else bytearray(), non_blocking=True)
        accel.synchronize(d)
        out = None
        after = _fingerprint()
        if before != after:
            problems.append(f"{label}: {_diff(before, after)}")
    assert not problems, "\n".join(problems)


def test_cuda_array_interface_of_an_empty_view_points_at_0(sim_cuda):
    """r62a: data[0] was buffer.ptr + 16 for a (0,) view at offset 16, and for a (3, 0) view."""
    buf = accel.Buffer(64, 1)
    assert accel.Buffer(0, 1).__cuda_array_interface__["data"][0] == 0        # (already so)
    for view in (buf.as_array(np.uint8, (0,), offset=16), buf.as_array(np.float32, (3, 0), offset=16)):
        cai = view.__cuda_array_interface__
        assert cai["data"][0] == 0, (view, hex(cai["data"][0]))


# -- 2. integer edges ------------------------------------------------------------------------------------
class _Valid:
    """The next valid operation after each case: fill a buffer of the last device, read it back."""

    def __init__(self, d):
        self.buf, self.k = accel.Buffer(256, d), 0

    def __call__(self):
        self.k = self.k % 250 + 1
        self.buf.fill_(self.k)
        assert (self.buf.to_numpy() == self.k).all()


def _int_cases(kind, d, b, gen, module):
    """Integer-like values where ints go: each refused with the value named."""
    n = accel.device_count()
    other = {"cuda": "xpu", "xpu": "mps", "mps": "cuda"}[kind]
    U64 = np.uint64(2 ** 64 - 1)
    OOM = (accel.OutOfMemoryError,)
    out = []
    for v, named in ((Fraction(8), "Fraction"), (Decimal(8), "Decimal"), (float("nan"), "nan"),
                     (np.bool_(True), "True"), (np.float64(8.0), "8.0"), (Idx(-1), "-1"), (np.int64(-1), "-1")):
        out.append(Case(f"Buffer({v!r})", lambda v=v: accel.Buffer(v, d), named))
    for v in (2 ** 63 - 1, 2 ** 63, U64, Idx(2 ** 64)):
        out.append(Case(f"Buffer({v!r})", lambda v=v: accel.Buffer(v, d), ("1EB", str(int(v))), OOM))
    for v, named in ((Fraction(1), "Fraction"), (Decimal(1), "Decimal"), (np.bool_(False), "False"),
                     (Idx(n), str(n)), (U64, str(int(U64))), (2 ** 63, str(2 ** 63)), (np.int8(-1), "-1"),
                     (f"{kind}:{2 ** 63}", str(2 ** 63)), (accel.device(other, 0), other)):
        out.append(Case(f"Buffer(16, device={v!r})", lambda v=v: accel.Buffer(16, v), named))
        out.append(Case(f"Module(device={v!r})", lambda v=v: accel.Module(module, device=v), named))
        out.append(Case(f"Generator(device={v!r})", lambda v=v: R.Generator(v), (named, "int")))
    for v, named in ((Fraction(8), "Fraction"), (Decimal(8), "Decimal"), (np.bool_(False), "False"),
                     (U64, str(int(U64))), (2 ** 63, str(2 ** 63)), (2 ** 64, str(2 ** 64)), (Idx(-1), "-1")):
        out.append(Case(f"as_array(offset={v!r})", lambda v=v: b.as_array(np.uint8, (0,), offset=v), named))
    for shape, named in (((U64,), str(int(U64))), ((2 ** 63, 0), str(2 ** 63)), ((Fraction(1),), "Fraction"),
                         ((np.bool_(True),), "True"), ((2 ** 32,), str(2 ** 32)), ((0, 2 ** 62), str(2 ** 64))):
        out.append(Case(f"as_array(float32, {shape!r})", lambda s=shape: b.as_array(np.float32, s), named))
    for strides, named in (((2 ** 63,), str(2 ** 63)), ((U64,), str(int(U64))), ((Decimal(4),), "Decimal")):
        out.append(Case(f"as_array(strides={strides!r})", lambda s=strides: b.as_array(np.float32, (2,), s), named))
    for shape, named in (((Fraction(64),), "Fraction"), ((U64,), str(int(U64))), ((2 ** 63,), str(2 ** 63))):
        out.append(Case(f"to_numpy(shape={shape!r})", lambda s=shape: b.to_numpy(np.uint8, s), named))
    for v, named in ((Fraction(1), "Fraction"), (Decimal(1), "Decimal"), (np.bool_(True), "True"),
                     (np.int64(-1), "-1"), (2 ** 64, str(2 ** 64)), (U64, str(int(U64)))):
        out.append(Case(f"empty_pinned({v!r})", lambda v=v: accel.empty_pinned(v), named))
    for v, named in ((Fraction(1), "Fraction"), (Decimal(1), "Decimal"), (float("nan"), "nan"),
                     (np.bool_(True), "True"), (np.float64(1.0), "float64"), (2 ** 64, str(2 ** 64)),
                     (Idx(2 ** 64), str(2 ** 64)), (-2 ** 63 - 1, str(-2 ** 63 - 1))):
        out.append(Case(f"manual_seed({v!r})", lambda v=v: R.manual_seed(v), named))
        out.append(Case(f"manual_seed_all({v!r})", lambda v=v: R.manual_seed_all(v), named))
        out.append(Case(f"Generator.manual_seed({v!r})", lambda v=v: gen.manual_seed(v), named))
        out.append(Case(f"Generator(d, seed={v!r})", lambda v=v: R.Generator(d, v), named))
    for v, named in ((2 ** 63, str(2 ** 63)), (U64, str(int(U64))), (np.bool_(False), "False"),
                     (Decimal(4), "Decimal"), (2 ** 63 - 1, str(2 ** 63 - 1))):
        out.append(Case(f"Generator.set_offset({v!r})", lambda v=v: gen.set_offset(v), named))
    for low, high, dtype, named in ((0, 2 ** 64, "int64", str(2 ** 64)), (-2 ** 63 - 1, 0, "int64", str(-2 ** 63 - 1)),
                                    (0, 2 ** 31 + 1, "int32", str(2 ** 31 + 1)), (Fraction(0), 5, "int64", "Fraction"),
                                    (0, U64, "int64", str(int(U64))), (np.bool_(False), 5, "int64", "bool")):
        out.append(Case(f"randint_({low!r}, {high!r}, {dtype})", lambda a=low, z=high, t=dtype: R.randint_(b, a, z, t),
                        named))
    for v in (Fraction(0), Decimal(0), np.bool_(False)):
        out.append(Case(f"fill_({v!r})", lambda v=v: b.fill_(v), repr(v) if not isinstance(v, np.bool_) else "False"))
    for v, named in ((Idx(n), str(n)), (U64, str(int(U64))), (2 ** 63, str(2 ** 63)), (np.bool_(True), "True")):
        out.append(Case(f"set_device_index({v!r})", lambda v=v: accel.set_device_index(v), named))
        out.append(Case(f"default_generator({v!r})", lambda v=v: R.default_generator(v), (named, "int")))
        out.append(Case(f"memory_stats({v!r})", lambda v=v: M.memory_stats(v), named))
    return out


def test_integer_edges_refused_and_state_unchanged(sim_backend):
    """Each refused with a clear error naming the value, the whole fingerprint unchanged and the
    next valid operation working."""
    from test_user_kernels import SAXPY_MSL, SAXPY_PTX, saxpy_reference, spirv_module
    sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64", replace=True)
    image = {"cuda": SAXPY_PTX, "mps": SAXPY_MSL,
             "xpu": spirv_module("saxpy") if sim_backend == "xpu" else None}[sim_backend]
    d = _last()
    _warm(d)
    accel.Module(image, device=d).close()
    b = accel.Buffer(64, d)
    gen = R.Generator(d, seed=3)
    valid = _Valid(d)
    _freeze()
    sweep = Sweep(f"[{sim_backend} dev {d}]", valid).run(_int_cases(sim_backend, d, b, gen, image))
    assert not sweep.problems, "\n".join(sweep.problems)
    assert sweep.count > 100
    assert accel.current_device_index() == 0


def test_integer_likes_taken_where_ints_go(sim_backend):
    """numpy integers and __index__ objects are ints (as operator.index): the same result as the int."""
    d = _last()
    for v in (np.int64(d), np.uint8(d), Idx(d)):
        assert accel.Buffer(16, v).device_index == d
        assert R.Generator(v).device_index == d
        assert M.memory_allocated(v) == M.memory_allocated(d)
    for v in (np.int64(24), np.uint8(24), Idx(24), np.uint64(24)):
        b = accel.Buffer(v, d)
        assert b.nbytes == 24 and type(b.nbytes) is int
        three, eight = (Idx(3), Idx(8)) if isinstance(v, Idx) else (type(v)(3), type(v)(8))
        view = b.as_array(np.float32, (three,), offset=eight)
        assert view.shape == (3,) and type(view.shape[0]) is int and view.offset == 8
        b.fill_(np.uint8(200))
        assert (b.to_numpy(np.uint8, (np.int64(4), Idx(6))) == 200).all()
    assert accel.empty_pinned((np.int64(2), Idx(3)), np.float32).shape == (2, 3)


@pytest.mark.parametrize("seed", [0, 1, 2 ** 32, 2 ** 63, 2 ** 64 - 1, -1, -2 ** 63, np.uint64(2 ** 64 - 1),
                                  np.int64(-5), Idx(2 ** 64 - 1)])
def test_seeds_at_the_ends_of_the_range_as_torch(sim_backend, seed):
    """manual_seed / Generator take what torch's CPU generator takes, negative values mod 2**64,
    and read back the same initial_seed; the state is (seed, offset 0) on the device seeded only."""
    torch = pytest.importorskip("torch")
    torch_seed = int(seed) if not isinstance(seed, Idx) else seed.value
    want = torch.Generator().manual_seed(torch_seed).initial_seed()
    d = _last()
    other = R.get_rng_state(0).tobytes()
    with accel.device_index(d):
        R.manual_seed(seed)
    assert R.initial_seed(d) == want
    assert R.get_rng_state(d).tobytes() == want.to_bytes(8, "little") + bytes(8)
    assert R.get_rng_state(0).tobytes() == other or d == 0
    assert R.Generator(d, seed).initial_seed() == want


def test_to_numpy_refuses_a_bool_in_its_shape(sim_backend):
    """r62a: b.to_numpy(np.uint8, (True,)) on a 1-byte buffer returned an array of shape (1,)
    (and shape=True, (1, True), and (False,) on an empty buffer)."""
    one, zero = accel.Buffer(1, _last()), accel.Buffer(0, _last())
    problems = []
    for buf, shape in ((one, (True,)), (one, True), (one, (1, True)), (zero, (False,)), (zero, False)):
        try:
            buf.to_numpy(np.uint8, shape)
            problems.append(f"{buf.nbytes} B, shape {shape!r}: accepted")
        except TypeError as exc:
            if "True" not in str(exc) and "False" not in str(exc) and "bool" not in str(exc):
                problems.append(f"shape {shape!r}: {exc}")
    assert not problems, problems


def test_random_fills_refuse_a_numpy_bool_for_a_bound(sim_backend):
    """r62a: R.uniform_(b, low=np.False_) filled the buffer and moved the offset; low=False is
    refused ('low must be a real number, got bool')."""
    b = accel.Buffer(64, _last())
    state = R.get_rng_state(_last()).tobytes()
    problems = []
    for label, fn in (("uniform_(low=np.False_)", lambda: R.uniform_(b, low=np.False_)),
                      ("uniform_(high=np.True_)", lambda: R.uniform_(b, low=0.0, high=np.True_)),
                      ("normal_(mean=np.False_)", lambda: R.normal_(b, mean=np.False_)),
                      ("normal_(std=np.True_)", lambda: R.normal_(b, std=np.True_))):
        try:
            fn()
            problems.append(f"{label}: accepted")
        except TypeError as exc:
            if "bool" not in str(exc):
                problems.append(f"{label}: {exc}")
    assert not problems, problems
    assert R.get_rng_state(_last()).tobytes() == state


# -- 3. overlapping and self copies ---------------------------------------------------------------------
def test_self_overlapping_and_host_copies(sim_backend):
    """Copies whose source is the destination, overlaps it, lies on the other device, or is a
    strided / read-only / other-dtype / other-size host array: each either gives the bytes numpy
    would, or is refused with a clear error, the destination's bytes and the fingerprint
    unchanged."""
    d = _last()
    _warm(d)
    ref = np.arange(64, dtype=np.uint8)
    b = accel.Buffer(64, d)
    far = accel.Buffer(128, 0)
    far.copy_from(np.arange(128, dtype=np.uint8)[::-1].copy())
    big = accel.Buffer(128, d)
    host = np.arange(128, dtype=np.uint8)
    ro = ref[::-1].copy()
    ro.flags.writeable = False
    f32 = np.arange(16, dtype=np.float32) + 0.5
    fortran = np.asfortranarray(np.arange(64, dtype=np.uint8).reshape(8, 8))
    pin = accel.empty_pinned(128)
    pin[:] = host
    lo, mid = accel.from_dlpack(b.as_array(np.uint8, (32,))), accel.from_dlpack(b.as_array(np.uint8, (32,), offset=16))

    def view(n, offset=0, stride=1, dtype=np.uint8):
        return b.as_array(dtype, (n,), (stride * np.dtype(dtype).itemsize,), offset)

    swapped = ref.copy()
    swapped[:32] = ref[32:]
    even_odd = ref.copy()
    even_odd[0::2] = ref[1::2]
    far_bytes = np.arange(128, dtype=np.uint8)[::-1]
    cases = [
        # (label, fn, expected bytes of b or None, refusal (exception, text) or None)
        ("b.copy_from(b)", lambda: b.copy_from(b), ref, None),
        ("b.copy_from(its own float32 view)", lambda: b.copy_from(b.as_array(np.float32)), ref, None),
        ("b.copy_from(its own strided view)", lambda: b.copy_from(view(32, stride=2)), None, (ValueError, "contiguous")),
        ("alias.copy_from(itself)", lambda: lo.copy_from(lo), ref, None),
        ("alias.copy_from(overlapping alias)", lambda: lo.copy_from(mid), None, (ValueError, "overlap")),
        ("view[:32].copy_from(view[32:])", lambda: view(32).copy_from(view(32, 32)), swapped, None),
        ("view[:32].copy_from(view[16:48])", lambda: view(32).copy_from(view(32, 16)), None, (ValueError, "overlap")),
        ("view.copy_from(the same view)", lambda: view(64).copy_from(view(64)), None, (ValueError, "overlap")),
        ("even.copy_from(odd), interleaved", lambda: view(32, 0, 2).copy_from(view(32, 1, 2)), None,
         (ValueError, "overlap")),
        ("b.copy_from(device-0 buffer's view at 32)", lambda: b.copy_from(far.as_array(np.uint8, (64,), offset=32)),
         far_bytes[32:96], None),
        ("b.copy_from(device-0 strided view)", lambda: b.copy_from(far.as_array(np.uint8, (64,), (2,))), None,
         (ValueError, "contiguous")),
        ("b.copy_from(device-0 128-byte buffer)", lambda: b.copy_from(far), None, (ValueError, "128")),
        ("b.copy_from(128-byte buffer)", lambda: b.copy_from(big), None, (ValueError, "128")),
        ("view.copy_from(device-0 view)", lambda: view(64).copy_from(far.as_array(np.uint8, (64,))), None,
         (ValueError, "device") if accel.device_count() > 1 else None),
        ("b.copy_from(strided host)", lambda: b.copy_from(host[::2]), None, (ValueError, "contiguous")),
        ("b.copy_from(strided pinned, non_blocking)", lambda: b.copy_from(pin[::2], non_blocking=True), None,
         (ValueError, "contiguous")),
        ("b.copy_from(Fortran host)", lambda: b.copy_from(fortran), None, (ValueError, "contiguous")),
        ("view (8, 8).copy_from(Fortran host)", lambda: b.as_array(np.uint8, (8, 8)).copy_from(fortran),
         np.ascontiguousarray(fortran).reshape(-1), None),
        ("view.copy_from(strided host)", lambda: view(64).copy_from(host[::2]), host[::2], None),
        ("b.copy_from(read-only host)", lambda: b.copy_from(ro), ro, None),
        ("b.copy_from(read-only host, non_blocking)", lambda: b.copy_from(ro, non_blocking=True), ro, None),
        ("view.copy_from(read-only host)", lambda: view(64).copy_from(ro), ro, None),
        ("b.copy_from(float32 host): raw bytes", lambda: b.copy_from(f32), f32.view(np.uint8), None),
        ("uint8 view.copy_from(float32 host)", lambda: view(64).copy_from(f32), None, (ValueError, "(16,)")),
        ("float32 view.copy_from(float64 host)", lambda: view(16, dtype=np.float32).copy_from(f32.astype(np.float64)),
         None, (TypeError, "float64")),
        ("float32 view.copy_from(big-endian float32)", lambda: view(16, dtype=np.float32).copy_from(f32.astype(">f4")),
         None, (TypeError, ">f4")),
        ("b.copy_from(128 host bytes)", lambda: b.copy_from(host), None, (ValueError, "128")),
        ("b.copy_from(128 pinned bytes, non_blocking)", lambda: b.copy_from(pin, non_blocking=True), None,
         (ValueError, "128")),
        ("view.copy_from(128 host bytes)", lambda: view(64).copy_from(host), None, (ValueError, "128")),
        ("b.copy_from(pinned[1:65], non_blocking)", lambda: b.copy_from(pin[1:65], non_blocking=True), host[1:65], None),
        ("b.copy_to(read-only)", lambda: b.copy_to(ro), None, (ValueError, "read-only")),
        ("b.copy_to(strided pinned)", lambda: b.copy_to(pin[::2], non_blocking=True), None, (ValueError, "contiguous")),
        ("b.copy_to(128 bytes)", lambda: b.copy_to(np.empty(128, np.uint8)), None, (ValueError, "128")),
    ]
    _freeze()
    problems = []
    for label, fn, want, refusal in cases:
        b.copy_from(ref)
        before = _fingerprint()
        try:
            fn()
            err = None
        except Exception as exc:          # noqa: BLE001 - reported below
            exc.__traceback__ = None
            err = exc
        for i in {0, d}:
            accel.synchronize(i)
        got = b.to_numpy()
        after = _fingerprint()
        if refusal is None and err is not None:
            problems.append(f"{label}: {type(err).__name__}: {err}")
        elif refusal is not None and not isinstance(err, refusal[0]):
            problems.append(f"{label}: wanted {refusal[0].__name__}, got {err!r}")
        elif refusal is not None and refusal[1] not in str(err):
            problems.append(f"{label}: message does not name {refusal[1]!r}: {err}")
        if refusal is not None and not (got == ref).all():
            problems.append(f"{label}: refused, but the destination changed: {got[:8]}")
        if refusal is None and want is not None and not (got == want).all():
            problems.append(f"{label}: wrong bytes {got[:8]}..., wanted {np.asarray(want)[:8]}...")
        if isinstance(err, CLEAR) and before != after:
            problems.append(f"{label}: state changed by a refusal: {_diff(before, after)}")
        err = None
    assert not problems, "\n".join(problems)
    assert accel.current_device_index() == 0
