"""r59a: hostile and malformed *foreign* inputs -- DLPack capsules made by hand with ctypes (legacy
"dltensor" and "dltensor_versioned"), producers whose ``__dlpack__``/``__dlpack_device__`` misbehave,
``__cuda_array_interface__`` dicts that are wrong one key at a time, ``__cuda_stream__`` objects that
answer nonsense in the DLPack handshake, and raw pointers accel does not own.

Each must raise a clear Python exception (never SystemError, a bare internal KeyError/IndexError/
AttributeError, a hang or a crash: the crash-prone case runs in a forked child), leave the process
as it was (memory_stats, the simulator's live handles, live exports, current devices and streams,
RNG offsets) and leave the next valid import working.  Ownership follows the DLPack protocol (the
array API standard's data interchange section): a consumer that takes a capsule renames it
"used_dltensor[_versioned]" and calls the deleter exactly once; one it refuses before taking keeps
its name and its deleter is never called by the consumer.  Everything runs on every simulator, on
device 1 where there is one (the current device stays 0).
"""

import ctypes
import faulthandler
import gc
import resource
import sys
import weakref

import numpy as np
import pytest

import accel
from accel import _dlpack as D
from accel import sim
from accel import streams as _streams

from conftest import SIMS, run_forked, use_sim

_New = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
_KIND = {"cuda": 2, "xpu": 14, "mps": 8}
_OTHER = {"cuda": ("kDLOneAPI", 14), "xpu": ("kDLCUDA", 2), "mps": ("kDLCUDA", 2)}


@pytest.fixture(params=[("cuda", 1), ("xpu", 1), ("mps", 0)], ids=lambda p: f"{p[0]}:{p[1]}")
def dev(request, monkeypatch):
    """(backend, device index): device 1 on the simulators that have two (not the current one)."""
    kind, index = request.param
    if kind not in SIMS:
        pytest.skip(f"ACCEL_TEST_SIMS leaves out {kind}")
    use_sim(monkeypatch, kind)
    return kind, index


def _state():
    gc.collect()
    n = accel.device_count()
    fields = {k: v for k, v in vars(sim.state()).items() if k not in ("calls", "config")}
    return (accel.current_device_index(), [accel.current_stream(i) for i in range(n)],
            [accel.memory_stats(i) for i in range(n)], fields, D.live_exports(), len(D._capsules),
            len(_streams._live_streams))


def _source(index, nbytes=256):
    src = accel.Buffer(nbytes, device=index)
    src.copy_from(np.arange(nbytes, dtype=np.uint8))
    return src


#: Every Foreign made (their structs and deleter callbacks must outlive any consumer).
_ALIVE = []


class Foreign:
    """A managed tensor another library made: over ``buf`` (u8, C order) unless edited, its
    deleter counting its calls (``calls``), raising, or NULL."""

    def __init__(self, buf, *, versioned=True, deleter="count"):
        _ALIVE.append(self)     # never freed: a failing test's Buffer may call the deleter at any later time
        self.versioned, self.calls = versioned, []
        self.managed = D.DLManagedTensorVersioned() if versioned else D.DLManagedTensor()
        if versioned:
            self.managed.version.major, self.managed.version.minor = 1, 0
        self.shape, self.strides = (ctypes.c_int64 * 8)(buf.nbytes), (ctypes.c_int64 * 8)()
        t = self.tensor
        t.data = buf.ptr
        t.device.device_type, t.device.device_id = buf.__dlpack_device__()
        t.ndim, t.byte_offset = 1, 0
        t.dtype.code, t.dtype.bits, t.dtype.lanes = 1, 8, 1
        t.shape = ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64))
        self.callback = D.DELETER(self._raise if deleter == "raise" else self._count)
        self.managed.deleter = ctypes.cast(self.callback, ctypes.c_void_p).value if deleter else None

    @property
    def tensor(self):
        return self.managed.dl_tensor

    def set_shape(self, shape, strides=None):
        self.tensor.ndim = len(shape)
        self.shape[:len(shape)] = shape
        if strides is not None:
            self.strides[:len(strides)] = strides
            self.tensor.strides = ctypes.cast(self.strides, ctypes.POINTER(ctypes.c_int64))

    def _count(self, address):
        self.calls.append(address)

    def _raise(self, address):
        self.calls.append(address)
        raise RuntimeError("the producer's deleter failed")

    def capsule(self, name=b"default"):
        """A capsule named ``name`` (None: a NULL name), without a destructor: what a refusal
        leaves is this object's to free, which it never does (memory held by ``self``)."""
        self.name = (D.NAME_VERSIONED if self.versioned else D.NAME) if name == b"default" else name
        return _New(ctypes.addressof(self.managed), self.name, None)


def _name(capsule):
    raw = D._PyCapsule_GetName(capsule)
    return ctypes.string_at(raw) if raw else None


def _check_ownership(foreign, capsule, taken):
    """Taken: renamed and its deleter called once (by accel); refused first: neither."""
    assert (_name(capsule) or b"").startswith(b"used_") == taken
    assert foreign.calls == ([ctypes.addressof(foreign.managed)] if taken else [])


def _next_import_works(src):
    for versioned in (True, False):
        good = Foreign(src, versioned=versioned)
        b = accel.from_dlpack(good.capsule())
        assert (b.ptr, b.nbytes, b.device) == (src.ptr, src.nbytes, src.device)
        assert (b.to_numpy() == src.to_numpy()).all()
        b.close()
        assert len(good.calls) == 1


# -- 1. capsules whose DLTensor is wrong in one field ----------------------------------------------
def _set(**fields):
    def edit(f, kind, index):
        t = f.tensor
        for key, value in fields.items():
            if key == "data":
                t.data = value
            elif key in ("device_type", "device_id"):
                setattr(t.device, key, value)
            else:
                setattr(t, key, value)
    return edit


def _shape(shape, strides=None, offset=0):
    def edit(f, kind, index):
        f.set_shape(shape, strides)
        f.tensor.byte_offset = offset
    return edit


def _other_type(f, kind, index):
    f.tensor.device.device_type = _OTHER[kind][1]


def _device_count(f, kind, index):
    f.tensor.device.device_id = accel.device_count()


def _null_shape(f, kind, index):
    f.tensor.ndim = 2
    f.tensor.shape = None


def _major(n):
    def edit(f, kind, index):
        if f.versioned:
            f.managed.version.major = n
    return edit


def _bits_strided(f, kind, index):
    """A sub-byte element with strides has no byte span."""
    _shape((4, 4), (8, 1))(f, kind, index)
    f.tensor.dtype.bits = 3


_PAST = r"64-bit address space"
_NOT_DEVICE = r"runtime knows|device memory of"
_FIELD_CASES = [
    ("null-data", _set(data=None), ValueError, r"at 0x0 .*runtime knows", True),
    ("other-backend-type", _other_type, BufferError, "kDL", False),
    ("unknown-type-99", _set(device_type=99), BufferError, "device type 99", False),
    ("negative-type", _set(device_type=-1), BufferError, "device type -1", False),
    ("device-id-count", _device_count, accel.InvalidDeviceError, "out of range", False),
    ("device-id-negative", _set(device_id=-1), accel.InvalidDeviceError, "out of range", False),
    ("device-id-int32-max", _set(device_id=2 ** 31 - 1), accel.InvalidDeviceError, "out of range", False),
    ("ndim-negative", _set(ndim=-1), BufferError, "ndim -1", False),
    ("ndim-int32-min", _set(ndim=-2 ** 31), BufferError, "ndim -2147483648", False),
    ("null-shape", _null_shape, BufferError, "shape", False),
    ("shape-product-past-2**64", _shape((2 ** 62, 8)), BufferError, _PAST, False),
    ("shape-int64-max", _shape((2 ** 63 - 1,)), ValueError, "last byte", True),
    ("strides-extent-past-2**64", _shape((4, 4), (2 ** 63 - 1, 1)), BufferError, _PAST, False),
    ("stride-before-data", _shape((4,), (-1,)), ValueError, _NOT_DEVICE, True),
    ("byte-offset-past-2**64", _shape((4,), None, 2 ** 64 - 1), BufferError, _PAST, False),
    ("byte-offset-past-2**64-strided", _shape((4, 4), (8, 1), 2 ** 64 - 8), BufferError, _PAST, False),
    ("byte-offset-past-allocation", _shape((4,), None, 1 << 40), ValueError, _NOT_DEVICE, True),
    ("bits-3-strided", _bits_strided, BufferError, "3-bit", False),
    ("version-major-2", _major(2), BufferError, r"version 2\.0", True),
    ("version-major-0xffffffff", _major(0xFFFFFFFF), BufferError, "version 4294967295", True),
]

@pytest.mark.parametrize("case, edit, exc, match, taken", _FIELD_CASES,
                         ids=[getattr(c, "values", c)[0] for c in _FIELD_CASES])
def test_malformed_capsule_field(dev, case, edit, exc, match, taken):
    kind, index = dev
    src = _source(index)
    before = _state()
    for versioned in (True, False):
        if case.startswith("version") and not versioned:
            continue            # a legacy DLManagedTensor has no version
        f = Foreign(src, versioned=versioned)
        edit(f, kind, index)
        capsule = f.capsule()
        with pytest.raises(exc, match=match):
            accel.from_dlpack(capsule)
        _check_ownership(f, capsule, taken)
        del capsule
        assert _state() == before
    _next_import_works(src)
    assert _state() == before


def test_accepted_oddities_are_read_as_bytes(dev):
    """A newer minor version, an unknown dtype code and a NULL deleter are no reason to refuse:
    from_dlpack wraps bytes (the deleter, NULL, is simply not called)."""
    kind, index = dev
    src = _source(index)
    before = _state()
    for f in (Foreign(src), Foreign(src, versioned=False), Foreign(src, deleter=None)):
        if f.versioned:
            f.managed.version.minor = 99
        f.tensor.dtype.code = 200
        b = accel.from_dlpack(f.capsule())
        assert (b.ptr, b.nbytes, b.device.index) == (src.ptr, 256, index)
        b.close()
        assert len(f.calls) == (1 if f.managed.deleter else 0)
    assert _state() == before
    # the typed path refuses the unknown code by name, before taking the capsule
    f = Foreign(src)
    f.tensor.dtype.code = 200
    capsule = f.capsule()
    with pytest.raises(TypeError, match="dtype code 200"):
        view = accel.Buffer(256, device=index).as_array(np.uint8)
        view.copy_from(_Producer(capsule=capsule, device=(_KIND[kind], index)))
    _check_ownership(f, capsule, False)


def test_huge_ndim_is_refused_not_read(sim_cuda):
    def child():
        faulthandler.disable()      # a crash is the expected failure: no traceback dump
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        src = _source(1)
        for versioned in (True, False):
            f = Foreign(src, versioned=versioned)
            f.tensor.ndim = 2 ** 31 - 1
            capsule = f.capsule()
            try:
                accel.from_dlpack(capsule)
            except BufferError as exc:
                if "ndim" not in str(exc) or f.calls or _name(capsule).startswith(b"used_"):
                    return 3
            else:
                return 2
        return 0
    assert run_forked(child, timeout=30) == 0


# -- 2. deleters that raise or are NULL; consumed and foreign-named capsules -------------------------
def test_raising_or_null_deleter(dev, monkeypatch):
    kind, index = dev
    src = _source(index)
    seen = []
    # the exceptions only: a stored hook argument is not tracked by the collector, and its
    # traceback reaches this frame (holding `seen`): a cycle never freed, the backend in it (r66i)
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    before = _state()
    f = Foreign(src, deleter="raise")
    b = accel.from_dlpack(f.capsule())
    b.close()                                   # the deleter's error is reported, not raised
    b.close()
    assert len(f.calls) == 1 and [type(e) for e in seen] == [RuntimeError]
    # taken, then refused (NULL data): the refusal propagates, the deleter ran once
    f = Foreign(src, deleter="raise")
    f.tensor.data = None
    with pytest.raises(ValueError, match="0x0"):
        accel.from_dlpack(f.capsule())
    assert len(f.calls) == 1 and len(seen) == 2
    for data in (src.ptr, None):
        f = Foreign(src, deleter=None)
        f.tensor.data = data
        try:
            accel.from_dlpack(f.capsule()).close()
        except ValueError:
            assert data is None
    assert len(seen) == 2
    assert _state() == before
    _next_import_works(src)


class _Producer:
    def __init__(self, capsule=None, device=None, dlpack=None, dlpack_device=None):
        self.capsule, self.device, self.asked = capsule, device, []
        self._dlpack, self._dlpack_device = dlpack, dlpack_device

    def __dlpack_device__(self):
        return self._dlpack_device() if self._dlpack_device else self.device

    def __dlpack__(self, stream=None, max_version=None, **kw):
        self.asked.append(stream)
        return self._dlpack() if self._dlpack else self.capsule


def _consumers(index):
    """The three ways accel takes another library's DLPack object."""
    return {"from_dlpack": accel.from_dlpack,
            "Buffer.copy_from": accel.Buffer(256, device=index).copy_from,
            "ArrayView.copy_from": accel.Buffer(256, device=index).as_array(np.uint8).copy_from}


def test_consumed_or_foreign_named_capsules_on_every_path(dev):
    kind, index = dev
    src = _source(index)
    consumers = _consumers(index)
    before = _state()
    for name, match in ((D.USED_NAME, "already consumed"), (D.USED_NAME_VERSIONED, "already consumed"),
                        (b"dltensor_v2", "not a DLPack capsule"), (b"", "not a DLPack capsule")):
        for what, consume in consumers.items():
            f = Foreign(src, versioned=name.endswith(b"versioned"))
            capsule = f.capsule(name)
            for obj in (capsule, _Producer(capsule, (_KIND[kind], index))):
                if obj is capsule and what != "from_dlpack":
                    continue
                with pytest.raises(BufferError, match=match):
                    consume(obj)
                assert f.calls == [] and _name(capsule) == name, what
    # a producer that hands out the same capsule twice: the second consumer finds it used
    for what, consume in consumers.items():
        f = Foreign(src)
        producer = _Producer(f.capsule(), (_KIND[kind], index))
        result = consume(producer)
        if what == "from_dlpack":
            result.close()
        with pytest.raises(BufferError, match="already consumed"):
            consume(producer)
        assert len(f.calls) == 1, what
        del producer, result
    assert _state() == before
    _next_import_works(src)


# -- 3. producers that raise, return nonsense, ignore the stream or lie about the device ------------
class Boom(Exception):
    pass


def test_misbehaving_producers(dev):
    kind, index = dev
    src = _source(index)
    mine = (_KIND[kind], index)
    consumers = _consumers(index)
    for i in range(accel.device_count()):
        # every device's context made first: a producer that names another device has accel order
        # that device's current stream before the copy's (r65m), which makes its context
        accel.synchronize(i)
    before = _state()
    host = np.zeros(256, np.uint8)
    for what, consume in consumers.items():
        boom = Boom("producer failed")
        with pytest.raises(Boom) as info:
            consume(_Producer(device=mine, dlpack=lambda: (_ for _ in ()).throw(boom)))
        assert info.value is boom
        # __dlpack_device__ raising: its own exception, or a TypeError naming it
        try:
            consume(_Producer(dlpack_device=lambda: (_ for _ in ()).throw(boom)))
        except Boom as exc:
            assert exc is boom
        except TypeError as exc:
            assert "__dlpack_device__" in str(exc)
        else:
            pytest.fail(f"{what}: a raising __dlpack_device__ was ignored")
        for ret in (None, 5, "dltensor", [1], b"dltensor"):
            with pytest.raises(TypeError, match="capsule|PyCapsule"):
                consume(_Producer(ret, mine))
        old = type("Old", (), {"__dlpack_device__": lambda self: mine, "__dlpack__": lambda self: 1 / 0})()
        with pytest.raises(TypeError, match="stream"):        # takes no keyword at all
            consume(old)
        # says it is this device; the capsule says host memory: refused, not taken
        f = Foreign(src)
        f.tensor.data, (f.tensor.device.device_type, f.tensor.device.device_id) = host.ctypes.data, (1, 0)
        capsule = f.capsule()
        with pytest.raises((BufferError, ValueError), match="host memory|kDLCPU|describes device"):
            consume(_Producer(capsule, mine))
        _check_ownership(f, capsule, False)
        # ignores the stream argument: nothing to detect, the data arrive
        f = Foreign(src)
        producer = _Producer(f.capsule(), mine)
        out = consume(producer)
        if what == "from_dlpack":
            assert (out.to_numpy() == src.to_numpy()).all()
            out.close()
        assert len(f.calls) == 1 and len(producer.asked) == 1
        del out, producer
    if accel.device_count() > 1:
        # says device 0, the capsule is device 1's: the capsule's device is the truth (as torch's
        # from_dlpack) or the lie is refused; never a Buffer of one device over another's memory
        for what, consume in consumers.items():
            f = Foreign(src)
            capsule = f.capsule()
            try:
                out = consume(_Producer(capsule, (_KIND[kind], 1 - index)))
            except (BufferError, ValueError):
                assert f.calls == [] or _name(capsule).startswith(b"used_")
            else:
                if what == "from_dlpack":
                    assert (out.device.index, out.ptr) == (index, src.ptr)
                    out.close()
                assert len(f.calls) == 1
            del capsule
    gc.collect()
    assert _state() == before
    _next_import_works(src)


# -- 4. __cuda_stream__ objects answering nonsense in the DLPack handshake -------------------------
class _CudaStream:
    def __init__(self, value):
        self.value = value

    def __cuda_stream__(self):
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


@pytest.mark.parametrize("value, exc, match", [
    pytest.param(None, TypeError, r"__cuda_stream__\(\) returned None", id="None"),
    pytest.param((0,), TypeError, r"__cuda_stream__\(\) returned \(0,\)", id="1-tuple"),
    pytest.param(7, TypeError, r"__cuda_stream__\(\) returned 7", id="int"),
    pytest.param((1, 5), ValueError, "protocol version 1", id="version-1"),
    pytest.param((0, -1), TypeError, "handle -1", id="handle-minus-1"),
    pytest.param((0, 1.5), TypeError, "1.5", id="float-handle"),
    pytest.param((0, 0xDEAD0), accel.AcceleratorError, "refused it as the consumer's stream", id="dead-handle"),
    pytest.param((0, 1 << 64), ValueError, "64 bits", id="handle-2**64"),
])
def test_cuda_stream_protocol_in_the_dlpack_handshake(sim_cuda, value, exc, match):
    src = _source(1)
    view = src.as_array(np.float32, (8, 8))
    before = _state()
    for call in (lambda s: src.__dlpack__(stream=s), lambda s: view.__dlpack__(stream=s),
                 lambda s: accel.from_dlpack(src, stream=s), lambda s: accel.from_dlpack(view, stream=s)):
        with pytest.raises(exc, match=match):
            call(_CudaStream(value))
        assert _state() == before
    _next_import_works(src)


def test_raising_cuda_stream_everywhere(dev):
    """A raising __cuda_stream__ propagates its own exception from every API that takes a stream;
    nothing changes (current streams, last-use stream, exports)."""
    kind, index = dev
    src = _source(index)
    boom = Boom("no stream")
    bad = _CudaStream(boom)
    last = src.last_stream
    before = _state()
    calls = [lambda: accel.set_stream(bad), lambda: src.fill_(0, stream=bad), lambda: src.record_stream(bad),
             lambda: accel.Buffer(8, device=index, stream=bad), lambda: accel.Event().record(bad),
             lambda: accel.current_stream(index).wait_stream(bad), lambda: src.to_numpy(stream=bad),
             lambda: src.copy_from(np.zeros(256, np.uint8), stream=bad)]
    if kind == "cuda":
        calls += [lambda: src.__dlpack__(stream=bad), lambda: accel.from_dlpack(src, stream=bad)]
    for call in calls:
        with pytest.raises(Boom) as info:
            call()
        assert info.value is boom
    assert src.last_stream == last and (src.to_numpy() == np.arange(256, dtype=np.uint8)).all()
    assert _state() == before


# -- 5. __cuda_array_interface__ dicts wrong one key at a time (CUDA, device 1) --------------------
class _CAI:
    def __init__(self, cai):
        self.cai = cai

    @property
    def __cuda_array_interface__(self):
        if isinstance(self.cai, BaseException):
            raise self.cai
        return self.cai


_MALFORMED = (ValueError, "malformed")


def _cai_cases():
    def d(**kw):
        def make(c):
            cai = dict(shape=(64,), typestr="|u1", data=(c["src"], False), version=3)
            cai.update({k: (v(c) if callable(v) else v) for k, v in kw.items()})
            return {k: v for k, v in cai.items() if v is not ...}
        return make
    ok, knows, dead = None, (ValueError, "runtime knows"), (ValueError, "not a live CUDA stream")
    rows = [
        ("no-shape", d(shape=...), _MALFORMED, _MALFORMED),
        ("no-typestr", d(typestr=...), _MALFORMED, _MALFORMED),
        ("no-data", d(data=...), _MALFORMED, _MALFORMED),
        ("shape-str", d(shape="abc"), _MALFORMED, _MALFORMED),
        ("shape-None", d(shape=None), _MALFORMED, _MALFORMED),
        ("shape-float", d(shape=(64.5,)), _MALFORMED, _MALFORMED),
        ("typestr-int", d(typestr=5), _MALFORMED, _MALFORMED),
        ("typestr-unknown", d(typestr="zz"), _MALFORMED, _MALFORMED),
        ("data-None", d(data=None), _MALFORMED, _MALFORMED),
        ("data-int", d(data=lambda c: c["src"]), _MALFORMED, _MALFORMED),
        ("data-empty", d(data=()), _MALFORMED, _MALFORMED),
        ("data-str-ptr", d(data=lambda c: (str(c["src"]), False)), _MALFORMED, _MALFORMED),
        ("data-null", d(data=(0, False)), (ValueError, "at 0x0"), (ValueError, "at 0x0")),
        ("data-negative", d(data=(-64, False)), (ValueError, "64-bit"), (ValueError, "64-bit")),
        ("data-top-of-address-space", d(data=(2 ** 64 - 16, False)), (ValueError, "64-bit"),
         (ValueError, "64-bit")),
        ("data-host", d(data=lambda c: (c["host"], False)), knows, knows),
        ("data-freed", d(data=lambda c: (c["freed"], False)), knows, knows),
        ("data-other-device", d(data=lambda c: (c["dev0"], False)), ok, (ValueError, "cuda:0, the view on cuda:1")),
        ("data-readonly-source", d(data=lambda c: (c["src"], True)), ok, ok),
        ("version-str", d(version="3"), (ValueError, "version"), ok),
        ("version-None", d(version=None), (ValueError, "version"), ok),
        ("version-4", d(version=4), ok, ok),
        ("negative-stride", d(strides=(-1,)), (ValueError, "C-contiguous"), (ValueError, "negative strides")),
        ("strides-str", d(strides="ab"), _MALFORMED, _MALFORMED),    # (one per dimension: session 34)
        ("mask", d(mask=object()), (ValueError, "mask"), (ValueError, "mask")),
        ("stream-0", d(stream=0), (ValueError, "stream 0"), (ValueError, "stream 0")),
        ("stream-1", d(stream=1), ok, ok),
        ("stream-2", d(stream=2), ok, ok),
        ("stream-str", d(stream="s"), (ValueError, "stream"), (ValueError, "stream")),
        ("stream-float", d(stream=1.0), (ValueError, "stream"), (ValueError, "stream")),
        ("stream-bool", d(stream=True), (ValueError, "stream"), (ValueError, "stream")),
        ("stream-negative", d(stream=-3), (ValueError, "stream -3"), (ValueError, "stream -3")),
        ("stream-dead", d(stream=0xDEAD0), dead, dead),
        ("shape-negative", d(shape=(-64,)), (ValueError, "-64"), (ValueError, "-64")),
        ("shape-huge", d(shape=(2 ** 62, 4)), (ValueError, "mismatch"), (ValueError, "shape")),
        ("interface-list", lambda c: [1, 2], _MALFORMED, _MALFORMED),
        ("interface-int", lambda c: 5, _MALFORMED, _MALFORMED),
        ("interface-str", lambda c: "shape", _MALFORMED, _MALFORMED),
        ("interface-raises", lambda c: Boom("no interface"), "same", "same"),
    ]
    params = []
    for name, make, on_buffer, on_view in rows:
        for path, expect in (("Buffer", on_buffer), ("ArrayView", on_view)):
            params.append(pytest.param(make, path, expect, id=f"{name}-{path}"))
    return params


@pytest.mark.parametrize("make, path, expect", _cai_cases())
def test_malformed_cuda_array_interface(sim_cuda, make, path, expect):
    src, dst, dev0 = _source(1, 64), accel.Buffer(64, device=1), accel.Buffer(64, device=0)
    dev0.copy_from(np.arange(64, dtype=np.uint8))
    freed = accel.Buffer(64 << 20, device=1)              # its pages past the first are released below
    context = {"src": src.ptr, "dev0": dev0.ptr, "host": np.zeros(64, np.uint8).ctypes.data,
               "freed": freed.ptr + (32 << 20)}
    freed.close()
    accel.memory.empty_cache()
    dst.fill_(7)
    cai = make(context)
    target = dst if path == "Buffer" else dst.as_array(np.uint8)
    before = _state()
    if expect is None:
        target.copy_from(_CAI(cai))
        assert (dst.to_numpy() == np.arange(64, dtype=np.uint8)).all()
    else:
        if expect == "same":
            with pytest.raises(Boom) as info:
                target.copy_from(_CAI(cai))
            assert info.value is cai
        else:
            exc, match = expect
            with pytest.raises(exc, match=match):
                target.copy_from(_CAI(cai))
        assert (dst.to_numpy() == 7).all()
    assert _state() == before
    _next_import_works(src)


# -- 6. read-only imports: every write refused, nothing written, RNG offset unmoved ---------------
def test_read_only_import_refuses_every_write(dev):
    kind, index = dev
    src = _source(index)
    f = Foreign(src)
    f.managed.flags = D.FLAG_READ_ONLY
    ro = accel.from_dlpack(f.capsule())
    assert ro.readonly
    rng = accel.random.get_rng_state(index)
    other = _source(index)
    keep = Foreign(other)          # alive while accel may call its deleter
    before = _state()
    writes = [lambda: ro.fill_(1), lambda: ro.copy_from(np.zeros(256, np.uint8)), lambda: ro.copy_from(other),
              lambda: ro.as_array(np.uint8).copy_from(np.zeros(256, np.uint8)),
              lambda: ro.as_array(np.float32).copy_from(other.as_array(np.float32)),
              lambda: accel.random.uniform_(ro), lambda: accel.random.normal_(ro),
              lambda: accel.random.randint_(ro, 0, 5), lambda: accel.random.random_raw_(ro),
              lambda: ro.copy_from(_Producer(keep.capsule(), (_KIND[kind], index)))]
    if kind == "cuda":
        writes.append(lambda: ro.copy_from(_CAI(other.__cuda_array_interface__)))
    for write in writes:
        with pytest.raises(ValueError, match="read-only"):
            write()
    with pytest.raises(BufferError, match="read-only"):
        ro.__dlpack__()                              # a legacy capsule cannot say read-only
    assert (src.to_numpy() == np.arange(256, dtype=np.uint8)).all()
    assert np.array_equal(accel.random.get_rng_state(index), rng)
    # reads still work
    assert (accel.Buffer(256, device=index).copy_from(ro).to_numpy() == src.to_numpy()).all()
    assert D.parse(ro.__dlpack__(max_version=(1, 0))).readonly
    gc.collect()
    assert _state()[4:] == before[4:]
    ro.close()
    assert len(f.calls) == 1


# -- 7. raw pointers accel does not own -------------------------------------------------------------
def test_from_ptr_foreign_freed_and_other_device_pointers(dev):
    kind, index = dev
    big = accel.Buffer(64 << 20, device=index)
    freed = big.ptr + (32 << 20)                      # (an expandable segment keeps its first page mapped)
    big.close()
    accel.memory.empty_cache()                        # handed back to the runtime: not device memory now
    src = _source(index)
    host = np.zeros(64, np.uint8)
    before = _state()

    class Owner:
        pass
    cases = [((host.ctypes.data, 64, index), ValueError, "runtime knows"),
             ((freed, 64, index), ValueError, "runtime knows|device memory of"),
             ((src.ptr, 16 << 20, index), ValueError, "last byte"),
             ((src.ptr, 64, accel.device_count()), accel.InvalidDeviceError, "out of index range"),
             ((float(src.ptr), 64, index), TypeError, "ptr must be an int"),
             ((src.ptr, 64.0, index), TypeError, "nbytes must be an int"),
             ((src.ptr, True, index), TypeError, "nbytes must be an int")]
    if accel.device_count() > 1:
        cases.append(((src.ptr, 64, 1 - index), ValueError, f"device memory of {kind}:{index}"))
    for args, exc, match in cases:
        owner = Owner()
        alive = weakref.ref(owner)
        with pytest.raises(exc, match=match):
            accel.Buffer.from_ptr(*args, owner=owner)
        del owner
        assert alive() is None                        # a refusal keeps no reference to the owner
    assert _state() == before
    # and through a capsule over freed memory: taken (the range is checked on wrapping), released once
    f = Foreign(src)
    f.tensor.data = freed
    capsule = f.capsule()
    with pytest.raises(ValueError, match="runtime knows|device memory of"):
        accel.from_dlpack(capsule)
    _check_ownership(f, capsule, True)
    assert _state() == before
    b = accel.Buffer.from_ptr(np.int64(src.ptr), np.int64(256), index)
    assert (b.to_numpy() == src.to_numpy()).all()
    b.close()
    _next_import_works(src)
