"""r63c: accel's DLPack and CUDA Array Interface sides checked clause by clause against the specs.

Sources (quoted in each test's docstring):
- the Python array API standard, ``array.__dlpack__(*, stream, max_version, dl_device, copy)``
  and the data interchange page (dmlc/dlpack docs/source/python_spec.rst);
- dlpack.h (DLPack 1.1): DLDeviceType, DLDataTypeCode, DLTensor (data/strides/byte_offset),
  DLManagedTensorVersioned and its flag bits;
- the CUDA Array Interface, version 3 (numba-cuda docs, "CUDA Array Interface (Version 3)").

Producers and consumers are accel (Buffer, ArrayView, from_dlpack, copy_from), a consumer and a
producer written with ctypes, and numpy 2.x / torch (CPU) where host memory takes part.  Every
case that applies to all three simulators runs on them, on device 1 while device 0 is current
(Metal has one device: device 0).  The stream handshake is checked on the CUDA simulator with a
gated stream (tests/torch_port_util.hold): no timing is asserted.
"""

import ctypes
import gc
import threading
import time

import numpy as np
import pytest

import accel
from accel import _dlpack as D
from accel import sim
from accel import streams as _streams

from conftest import SIMS, use_sim
from torch_port_util import hold

pytestmark = pytest.mark.usefixtures("frozen_module_heap")

_KIND = {"cuda": 2, "xpu": 14, "mps": 8}          # kDLCUDA, kDLOneAPI, kDLMetal
_New = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
_SetName = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_SetName", ctypes.pythonapi))
_USED = {b"dltensor": ctypes.create_string_buffer(b"used_dltensor"),
         b"dltensor_versioned": ctypes.create_string_buffer(b"used_dltensor_versioned")}
FLAG_READ_ONLY, FLAG_IS_COPIED, FLAG_SUBBYTE_PADDED = 1, 2, 4


@pytest.fixture(params=[("cuda", 1), ("xpu", 1), ("mps", 0)], ids=lambda p: f"{p[0]}:{p[1]}")
def dev(request, monkeypatch):
    """(backend, device index): device 1 where the simulator has two (device 0 stays current)."""
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


def _live():
    """What live objects hold: the allocators' current counters, the simulator's live handles,
    live exports and capsules (cumulative and peak counters left out)."""
    gc.collect()
    n = accel.device_count()
    stats = [{k: v for k, v in accel.memory_stats(i).items() if k.endswith(".current")} for i in range(n)]
    fields = {k: v for k, v in vars(sim.state()).items() if k not in ("calls", "config")}
    return stats, fields, D.live_exports(), len(D._capsules)


def _name(capsule):
    raw = D._PyCapsule_GetName(capsule)
    return ctypes.string_at(raw) if raw else None


def _consume(capsule):
    """A C consumer: read the managed tensor, rename the capsule ``used_...``; returns the fields
    and the deleter call."""
    name = _name(capsule)
    address = D._PyCapsule_GetPointer(capsule, name)
    versioned = name == b"dltensor_versioned"
    managed = (D.DLManagedTensorVersioned if versioned else D.DLManagedTensor).from_address(address)
    t = managed.dl_tensor
    fields = dict(name=name, data=t.data or 0, device=(t.device.device_type, t.device.device_id),
                  dtype=(t.dtype.code, t.dtype.bits, t.dtype.lanes),
                  shape=tuple(t.shape[i] for i in range(t.ndim)),
                  strides=tuple(t.strides[i] for i in range(t.ndim)) if t.strides else None,
                  byte_offset=t.byte_offset,
                  version=(managed.version.major, managed.version.minor) if versioned else None,
                  flags=managed.flags if versioned else None)
    assert _SetName(capsule, ctypes.cast(_USED[name], ctypes.c_char_p)) == 0
    deleter = D.DELETER(managed.deleter)
    return fields, lambda: deleter(address)


_ALIVE = []     # hand-made managed tensors outlive any consumer (a failed test may still free one)


class Foreign:
    """A managed tensor another library made over ``buf`` (u8, C order unless edited), its
    deleter counting calls and then running ``on_delete``."""

    def __init__(self, buf, *, versioned=True, on_delete=None):
        _ALIVE.append(self)
        self.versioned, self.calls, self.on_delete = versioned, [], on_delete
        self.managed = D.DLManagedTensorVersioned() if versioned else D.DLManagedTensor()
        if versioned:
            self.managed.version.major, self.managed.version.minor = 1, 1
        self.shape = (ctypes.c_int64 * 4)(buf.nbytes)
        t = self.managed.dl_tensor
        t.data = buf.ptr
        t.device.device_type, t.device.device_id = buf.__dlpack_device__()
        t.ndim, t.byte_offset = 1, 0
        t.dtype.code, t.dtype.bits, t.dtype.lanes = 1, 8, 1
        t.shape = ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64))
        self.callback = D.DELETER(self._delete)
        self.managed.deleter = ctypes.cast(self.callback, ctypes.c_void_p).value

    @property
    def tensor(self):
        return self.managed.dl_tensor

    def _delete(self, address):
        self.calls.append(address)
        if self.on_delete is not None:
            self.on_delete()

    def capsule(self):
        return _New(ctypes.addressof(self.managed), D.NAME_VERSIONED if self.versioned else D.NAME, None)


def _source(index, nbytes=256):
    src = accel.Buffer(nbytes, device=index)
    src.copy_from(np.arange(nbytes, dtype=np.uint8))
    return src


# == producer: accel's __dlpack__ =================================================================
def test_producer_capsule_fields(dev):
    """python_spec: the capsule is named "dltensor" (DLManagedTensor) or, for a consumer that asked
    with max_version >= (1, 0), "dltensor_versioned"; the consumer renames it and calls the deleter.
    array API: "the consumer must verify the version even when max_version is passed" -- so the
    major version is 1 whatever max_version (1, 0), (1, 7) or (2, 0) was.  dlpack.h: flags are 0 by
    default (IS_COPIED only "when a copy happens": accel never copies); strides "can not be NULL
    if ndim != 0" and count elements; "if the tensor is of size zero, then the data pointer should
    be set to NULL"; lanes 1 for scalar types; data + byte_offset is the first element."""
    kind, index = dev
    buf = _source(index)
    before = _state()
    views = [(buf, (1, 8, 1), (256,), (1,), buf.ptr),
             (buf.as_array(np.float32, (4, 3), (48, 8), 16), (2, 32, 1), (4, 3), (12, 2), buf.ptr + 16),
             (buf.as_array(np.int16, (), None, 6), (0, 16, 1), (), (), buf.ptr + 6),
             (buf.as_array(np.complex64, (0, 5), None, 8), (5, 64, 1), (0, 5), (5, 1), 0),
             (buf.as_array(np.bool_, (8,), None, 3), (6, 8, 1), (8,), (1,), buf.ptr + 3)]
    for obj, dtype, shape, strides, first in views:
        for max_version, name in ((None, b"dltensor"), ((0, 8), b"dltensor"), ((1, 0), b"dltensor_versioned"),
                                  ((1, 7), b"dltensor_versioned"), ((2, 0), b"dltensor_versioned")):
            capsule = obj.__dlpack__(max_version=max_version)
            fields, delete = _consume(capsule)
            assert fields["name"] == name
            assert fields["device"] == (_KIND[kind], index) == tuple(obj.__dlpack_device__())
            assert (fields["dtype"], fields["shape"]) == (dtype, shape)
            assert fields["strides"] is not None and fields["strides"] == strides
            # (kDLMetal: data is the MTLBuffer, byte_offset the offset into it: Backend.dlpack_address)
            assert accel._lazy.lazy_init().dlpack_address(fields["data"], fields["byte_offset"]) == first
            if name == b"dltensor_versioned":
                assert fields["version"][0] == 1 and fields["flags"] == 0
            delete()
            del capsule
    assert _state() == before


def test_producer_flags_of_a_read_only_import(dev):
    """dlpack.h DLPACK_FLAG_BITMASK_READ_ONLY marks a read-only tensor; IS_COPIED is set only "when
    a copy happens" (array API ``copy``).  A legacy DLManagedTensor cannot carry the flag, so the
    export is refused with BufferError (as numpy refuses), before anything is exported."""
    kind, index = dev
    src = _source(index)
    f = Foreign(src)
    f.managed.flags = FLAG_READ_ONLY
    ro = accel.from_dlpack(f.capsule())
    before = _state()
    fields, delete = _consume(ro.__dlpack__(max_version=(1, 0), dl_device=ro.__dlpack_device__(), copy=False))
    assert fields["flags"] == FLAG_READ_ONLY
    delete()
    with pytest.raises(BufferError, match="read-only"):
        ro.__dlpack__()
    assert _state() == before
    ro.close()
    assert f.calls == [ctypes.addressof(f.managed)]


def test_producer_dl_device_and_copy(dev):
    """array API ``dl_device``: "If the device type cannot be handled by the producer, this function
    must raise BufferError"; ``copy=False``: "raise a BufferError in case a copy is deemed necessary
    (e.g. if a cross-device data movement is requested)", and for kDLCPU "If a copy must be made ...
    but copy is set to False, the function must raise ValueError".  Every refusal leaves the state
    as it was; the buffer's own device with copy=False exports zero copy (no IS_COPIED)."""
    kind, index = dev
    buf = _source(index)
    before = _state()
    own = (_KIND[kind], index)
    fields, delete = _consume(buf.__dlpack__(max_version=(1, 0), dl_device=own, copy=False))
    assert fields["flags"] & FLAG_IS_COPIED == 0
    assert accel._lazy.lazy_init().dlpack_address(fields["data"], fields["byte_offset"]) == buf.ptr
    delete()
    with pytest.raises(ValueError, match="copy=False"):
        buf.__dlpack__(max_version=(1, 0), dl_device=(1, 0), copy=False)          # kDLCPU
    with pytest.raises(ValueError, match="copy=False"):
        buf.__dlpack__(max_version=(1, 0), dl_device=(3, 0), copy=False)          # kDLCUDAHost
    refused = [(13, 0), (3, 0), (1, 0), (_KIND[kind], 1 - index if accel.device_count() > 1 else 5)]
    refused += [(k, index) for k in _KIND.values() if k != _KIND[kind]]
    for dl_device in refused:
        for copy in (None, False):
            if dl_device[0] in (1, 3) and copy is False:
                continue
            if dl_device == (1, 0) and copy is None:
                continue        # a host copy since session 39 (r80b: the array API's "copy otherwise")
            with pytest.raises(BufferError, match="dl_device"):
                buf.__dlpack__(max_version=(1, 0), dl_device=dl_device, copy=copy)
    assert _state() == before


@pytest.mark.skipif(np.dtype(np.longdouble).itemsize <= 8, reason="longdouble is double here")
@pytest.mark.parametrize("dtype", [np.longdouble, np.clongdouble], ids=["longdouble", "clongdouble"])

def test_producer_refuses_non_ieee_long_double(dev, dtype):
    """dlpack.h: kDLFloat is "IEEE floating point", kDLComplex a "compact struct per complex
    number"; DLDataType.bits is a uint8_t.  numpy's long double (x87 extended, 80 bits padded to
    16 bytes) is neither binary128 nor representable (complex256: 256 bits).  array API: "raise
    BufferError when the data cannot be exported as DLPack (e.g., incompatible dtype)" -- numpy 2.x
    itself raises "DLPack only supports IEEE floating point types without padding".  accel exported
    longdouble as kDLFloat 128 (a consumer reads binary128 from x87 bytes: silent wrong values) and
    clongdouble as bits 0 (a malformed capsule)."""
    with pytest.raises(BufferError):
        np.zeros(2, dtype).__dlpack__()                  # numpy, the reference producer
    kind, index = dev
    view = _source(index).as_array(dtype, (4,))
    before = _state()
    with pytest.raises(BufferError, match="IEEE|DLPack cannot describe"):
        capsule = view.__dlpack__(max_version=(1, 0))
        _consume(capsule)[1]()
    assert _state() == before


def test_unconsumed_capsule_runs_the_deleter_once(dev):
    """python_spec: the producer sets a PyCapsule_Destructor that "calls the deleter of the
    DLManagedTensor when the "dltensor"-named capsule is no longer needed", and only then.  A
    buffer closed while its capsule is alive keeps its memory until the capsule is dropped; then
    memory, simulator handles and live exports are back at the baseline.  A consumed capsule's
    destructor does nothing: its deleter is the consumer's."""
    kind, index = dev
    _source(index).close()
    baseline = _live()
    buf = _source(index)
    view = buf.as_array(np.uint32, (8,), None, 32)
    allocated = accel.memory_stats(index)["allocated_bytes.all.current"]
    capsules = [buf.__dlpack__(), buf.__dlpack__(max_version=(1, 0)), view.__dlpack__(max_version=(1, 1))]
    consumed = view.__dlpack__()
    fields, delete = _consume(consumed)
    buf.close()
    del buf, view
    gc.collect()
    assert accel.memory_stats(index)["allocated_bytes.all.current"] == allocated      # still pinned
    del capsules
    del consumed                                  # its destructor must not run the deleter
    gc.collect()
    assert D.live_exports() == baseline[2] + 1
    assert accel.memory_stats(index)["allocated_bytes.all.current"] == allocated
    delete()
    delete()                                      # a second call finds nothing
    accel.synchronize(index)
    assert _live() == baseline


def test_capsule_consumed_twice(dev):
    """python_spec: a capsule "is consumed exactly once"; the consumer renames it
    "used_dltensor[_versioned]".  A second import is refused with BufferError and the deleter is not
    called again; the first import keeps working."""
    kind, index = dev
    src = _source(index)
    dst = accel.Buffer(256, device=index)
    before = _state()
    for versioned in (True, False):
        f = Foreign(src, versioned=versioned)
        capsule = f.capsule()
        first = accel.from_dlpack(capsule)
        assert _name(capsule).startswith(b"used_")
        for consumer in (accel.from_dlpack, dst.copy_from, dst.as_array(np.uint8).copy_from):
            with pytest.raises((BufferError, TypeError), match="consumed|capsule|copy"):
                consumer(capsule)
        assert f.calls == []
        assert (first.to_numpy() == np.arange(256)).all()
        first.close()
        assert f.calls == [ctypes.addressof(f.managed)]
        del capsule, first
    assert _state() == before


def test_producer_memory_outlives_the_producer_object(dev):
    """dlpack.h: the managed tensor "is intended to facilitate the borrowing of DLTensor by another
    framework ... When the borrowing framework doesn't need the tensor, it should call the deleter".
    So the memory must stay valid while the consumer holds it, whatever the producer does to its
    own object: accel as producer (the Buffer closed and dropped before the import) and accel as
    consumer of a producer that frees its memory in its deleter only."""
    kind, index = dev
    _source(index).close()
    before = _live()
    buf = _source(index)
    capsule = buf.__dlpack__(max_version=(1, 0))
    buf.close()
    del buf
    gc.collect()
    imported = accel.from_dlpack(capsule)
    assert (imported.to_numpy() == np.arange(256)).all()
    imported.close()
    del capsule, imported
    accel.synchronize(index)
    assert _live() == before

    src = _source(index)
    f = Foreign(src, on_delete=src.close)
    capsule = f.capsule()
    del src                                   # the producer keeps it through manager_ctx only
    imported = accel.from_dlpack(capsule)
    del capsule
    gc.collect()
    assert f.calls == []
    assert (imported.to_numpy() == np.arange(256)).all()
    imported.close()
    assert f.calls == [ctypes.addressof(f.managed)]
    accel.synchronize(index)
    assert _live() == before


# == consumer: accel.from_dlpack and copy_from ====================================================
def test_consumer_span_counts_lanes_and_packed_subbyte(dev):
    """dlpack.h DLDataType: "float4(vectorized 4 float): type_code = 2, bits = 32, lanes = 4"
    (an element is bits * lanes); "float4_e2m1fn: type_code = 17, bits = 4, lanes = 1 (packed in
    memory)" -- 256 packed fp4 elements are 128 bytes."""
    kind, index = dev
    src = _source(index)
    before = _state()
    for code, bits, lanes, count, nbytes in ((2, 32, 2, 32, 256), (2, 16, 4, 32, 256), (17, 4, 1, 256, 128)):
        f = Foreign(src)
        t = f.tensor
        t.dtype.code, t.dtype.bits, t.dtype.lanes = code, bits, lanes
        f.shape[0] = count
        b = accel.from_dlpack(f.capsule())
        assert (b.ptr, b.nbytes, b.device_index) == (src.ptr, nbytes, index)
        b.close()
        assert len(f.calls) == 1
    assert _state() == before


def test_consumer_reads_data_byte_offset_and_null_strides(dev):
    """dlpack.h DLTensor: the first element is at data + byte_offset; "if the tensor is of size zero,
    then the data pointer should be set to NULL"; python_spec: "When the strides field ... is NULL,
    it indicates a row-major compact array"; a 0-d tensor (ndim 0) is one element.  Legacy and
    versioned capsules alike; each deleter runs once."""
    kind, index = dev
    src = _source(index)
    before = _state()
    cases = [(lambda f: (setattr(f.tensor, "data", None), f.shape.__setitem__(0, 0)), 0, 0),
             (lambda f: f.shape.__setitem__(0, 0), 0, 0),
             (lambda f: (setattr(f.tensor, "ndim", 0), setattr(f.tensor, "byte_offset", 5)), 5, 1),
             (lambda f: (f.shape.__setitem__(0, 16), setattr(f.tensor, "byte_offset", 100)), 100, 16)]
    for edit, offset, nbytes in cases:
        for versioned in (True, False):
            f = Foreign(src, versioned=versioned)
            edit(f)
            b = accel.from_dlpack(f.capsule())
            assert b.nbytes == nbytes and (b.ptr - src.ptr if nbytes else 0) == offset
            if nbytes:
                assert (b.to_numpy() == np.arange(offset, offset + nbytes)).all()
            b.close()
            assert len(f.calls) == 1
    assert _state() == before


def test_consumer_span_of_a_padded_subbyte_tensor(dev):
    """dlpack.h: "DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED: bit mask to indicate that whether a
    sub-byte type is packed or padded. The default for sub-byte types (ex: fp4/fp6) is assumed
    packed. This flag can be set by the producer to signal that a tensor of sub-byte type is
    padded."  Padded, each fp4 element takes a byte (GetDataSize: (bits * lanes + 7) / 8 per
    element): 256 of them are 256 bytes, not 128."""
    kind, index = dev
    src = _source(index)
    f = Foreign(src)
    f.tensor.dtype.code, f.tensor.dtype.bits = 17, 4
    f.managed.flags = FLAG_SUBBYTE_PADDED
    b = accel.from_dlpack(f.capsule())
    try:
        assert b.nbytes == 256
    finally:
        b.close()


@pytest.mark.parametrize("code, bits", [(15, 8), (16, 8), (17, 8), (17, 1)], ids=["fp6e2m3-8", "fp6e3m2-8", "fp4-8", "fp4-1"])
def test_consumer_stops_importing_fp6_fp4_of_unexpected_bits(dev, code, bits):
    """dlpack.h DLDataTypeCode, FP6 (kDLFloat6_e2m3fn 15, kDLFloat6_e3m2fn 16): "Setting bits != 6 is
    currently unspecified, and the producer must ensure it is set while the consumer must stop
    importing if the value is unexpected"; FP4 (kDLFloat4_e2m1fn 17) the same with bits != 4.
    Refused as any malformed capsule: BufferError before it is taken (its name kept, the deleter
    not called), state unchanged."""
    kind, index = dev
    src = _source(index)
    before = _state()
    f = Foreign(src)
    f.tensor.dtype.code, f.tensor.dtype.bits = code, bits
    capsule = f.capsule()
    try:
        with pytest.raises(BufferError, match="bits"):
            accel.from_dlpack(capsule)
    finally:
        if _name(capsule).startswith(b"used_") and not f.calls:
            D.DELETER(f.managed.deleter)(ctypes.addressof(f.managed))
    assert _name(capsule) == D.NAME_VERSIONED and f.calls == []
    assert _state() == before


def test_refused_torch_capsule_stays_consumable(dev):
    """python_spec: "If an array ... lives on a device that the requesting (consumer) library does
    not support, it is recommended to raise a BufferError"; a capsule is taken (renamed) only by the
    consumer that uses it, so torch can still import the kDLCPU capsule accel refused, and the
    unconsumed capsule torch made is freed by torch's destructor."""
    torch = pytest.importorskip("torch")
    kind, index = dev
    accel.Buffer(8, device=index).close()
    before = _state()
    t = torch.arange(6, dtype=torch.float32)
    for capsule in (torch.utils.dlpack.to_dlpack(t), t.__dlpack__(max_version=(1, 0))):
        name = _name(capsule)
        with pytest.raises(BufferError, match="host memory"):
            accel.from_dlpack(capsule)
        assert _name(capsule) == name
        assert torch.equal(torch.from_dlpack(capsule), t)
        assert _name(capsule).startswith(b"used_")
    with pytest.raises(BufferError, match="host memory"):
        accel.from_dlpack(torch.utils.dlpack.to_dlpack(t))       # dropped unconsumed: torch frees it
    assert _state() == before


def test_host_producers_are_copied_with_their_strides(dev):
    """dlpack.h: strides count elements; python_spec: NULL strides mean compact row-major.  torch
    (CPU) and numpy 2.x produce kDLCPU capsules with real strides and offsets; copy_from reads them
    through numpy.from_dlpack as host data (accel never wraps host memory), on device 1."""
    torch = pytest.importorskip("torch")
    kind, index = dev
    view = accel.Buffer(48, device=index).as_array(np.float32, (3, 4))
    for src in (torch.arange(12, dtype=torch.float32).reshape(4, 3).T,
                np.arange(16, dtype=np.float32).reshape(4, 4)[1:, :].T[:, :3].T.copy().T.T[:, :4],
                torch.arange(20, dtype=torch.float32)[5:17].reshape(3, 4)):
        view.copy_from(src)
        assert (view.to_numpy() == np.from_dlpack(src)).all()
    flat = accel.Buffer(24, device=index)
    flat.copy_from(torch.arange(20, dtype=torch.int16)[4:16])
    assert (flat.to_numpy("int16") == np.arange(4, 16)).all()


class _Spy:
    """A DLPack producer over an accel Buffer that records what the consumer asked for."""

    def __init__(self, buf):
        self.buf, self.asked = buf, []

    def __dlpack_device__(self):
        return self.buf.__dlpack_device__()

    def __dlpack__(self, **kw):
        self.asked.append(kw)
        return self.buf.__dlpack__(**kw)


def test_consumer_passes_its_stream_of_the_producers_device(dev):
    """array API ``stream``: "The consumer must pass the stream it will use to the producer" (CUDA: a
    cudaStream_t, 1 for the legacy default stream, never 0); "On CPU and other device types without
    streams, only None is accepted" (and the type for SYCL queues is not agreed: accel passes None).
    The stream is the consumer's current stream of the *producer's* device (device 1), not of the
    current device."""
    kind, index = dev
    src = _source(index)
    spy = _Spy(src)
    accel.from_dlpack(spy).close()
    expect = 1 if kind == "cuda" else None
    assert spy.asked[-1] == {"stream": expect, "max_version": (1, 0)}
    if kind == "cuda":
        side = accel.Stream(index)
        accel.set_stream(side)
        accel.set_device_index(0)
        try:
            assert accel.current_stream(index) == side and accel.current_device_index() == 0
            accel.from_dlpack(spy).close()
            assert spy.asked[-1]["stream"] == side.handle
            accel.Buffer(256, device=index).copy_from(spy, stream=side)
            assert spy.asked[-1]["stream"] == side.handle
        finally:
            accel.set_stream(accel.default_stream(index))
            accel.set_device_index(0)
        side.synchronize()


# == stream handshake (CUDA simulator, gated streams) =============================================
@pytest.fixture
def gated_cuda(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=50)
    return 1


def _busy_buffer(index):
    """A buffer of device ``index`` whose last-use stream is held by a gate, with a fill of 7
    queued behind the gate (the producer's pending work)."""
    producer = accel.Stream(index)
    buf = accel.Buffer(4096, device=index, stream=producer)
    buf.fill_(1, stream=producer)
    producer.synchronize()
    gate = hold(producer)
    buf.fill_(7, stream=producer)
    assert buf.last_stream == producer
    return buf, producer, gate


def _query(handle, index):
    backend = accel._lazy.lazy_init()
    with _streams.on_device(backend, index):
        return backend.stream_query(handle)


class _CudaStream:
    def __init__(self, stream):
        self.stream = stream

    def __cuda_stream__(self):
        return (0, self.stream.handle)


@pytest.mark.parametrize("how", ["None", "1-legacy", "2-per-thread", "handle", "Stream", "__cuda_stream__"])
def test_dlpack_consumer_stream_waits_for_pending_work(gated_cuda, how):
    """array API ``stream``: "stream is provided by the consumer to the producer to instruct the
    producer to ensure that operations can safely be performed on the array (e.g., by inserting a
    dependency between streams via "wait for event")"; CUDA values: "None: producer must assume the
    legacy default stream", "1: the legacy default stream", "2: the per-thread default stream",
    "> 2: stream number".  The producer's pending work is on a stream of device 1 (device 0
    current); the consumer's stream must not run past it, and sees its result."""
    index = gated_cuda
    buf, producer, gate = _busy_buffer(index)
    consumer = accel.Stream(index)
    arg, handle = {"None": (None, 0), "1-legacy": (1, 0), "2-per-thread": (2, 2),
                   "handle": (consumer.handle, consumer.handle), "Stream": (consumer, consumer.handle),
                   "__cuda_stream__": (_CudaStream(consumer), consumer.handle)}[how]
    try:
        capsule = buf.__dlpack__(stream=arg, max_version=(1, 0))
        assert accel.current_device_index() == 0
        assert not _query(handle, index)          # the consumer's stream waits for the gated work
    finally:
        gate.set()
    producer.synchronize()
    backend = accel._lazy.lazy_init()
    with _streams.on_device(backend, index):
        backend.stream_synchronize(handle)
    assert _query(handle, index)
    imported = accel.from_dlpack(capsule)
    assert (imported.to_numpy() == 7).all()
    imported.close()


def test_dlpack_stream_minus_one_does_not_synchronize(gated_cuda):
    """array API: "If stream is -1, the value may be used by the consumer to signal "producer must
    not perform any synchronization"" -- nothing is queued on any consumer stream."""
    index = gated_cuda
    buf, producer, gate = _busy_buffer(index)
    consumer = accel.Stream(index)
    try:
        capsule = buf.__dlpack__(stream=-1, max_version=(1, 0))
        assert _query(consumer.handle, index) and _query(0, index)
        assert buf.last_stream == producer
    finally:
        gate.set()
    producer.synchronize()
    del capsule


class _CAIOnly:
    def __init__(self, obj, stream=None, drop_stream=False):
        self.obj, self.keep = obj, []
        cai = dict(obj.__cuda_array_interface__)
        if drop_stream:
            del cai["stream"]
        self.__cuda_array_interface__ = cai


class _DLPackOnly:
    def __init__(self, obj):
        self.obj = obj

    def __dlpack_device__(self):
        return self.obj.__dlpack_device__()

    def __dlpack__(self, **kw):
        return self.obj.__dlpack__(**kw)


def _run_while_gated(fn, gate, consumer):
    """Run ``fn`` in a thread while ``gate`` holds the producer, and let go once ``fn`` returned
    and ``consumer`` ran dry (a copy nothing ordered after the producer's work has then read the
    old bytes), or after 1 s of either (a wait, on the host or on the stream, that only the gate
    can end)."""
    errors = []

    def body():
        try:
            fn()
        except BaseException as exc:   # reported in the main thread
            errors.append(exc)

    worker = threading.Thread(target=body)
    worker.start()
    try:
        worker.join(1.0)
        deadline = time.monotonic() + 1.0
        while not worker.is_alive() and not consumer.query() and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        gate.set()
        worker.join(60)
    assert not worker.is_alive() and not errors, errors


@pytest.mark.parametrize("target", ["Buffer", "ArrayView"])
@pytest.mark.parametrize("protocol", ["cai", "dlpack"])
def test_copy_from_a_foreign_producer_waits_for_its_stream(gated_cuda, target, protocol):
    """CUDA Array Interface v3, ``stream``: "An optional stream upon which synchronization must take
    place at the point of consumption, either by synchronizing on the stream or enqueuing operations
    on the data on the given stream"; DLPack: the consumer passes its stream and the producer orders
    its work before it.  copy_from on device 1 (device 0 current) must not copy before the
    producer's gated fill of 7 ran."""
    index = gated_cuda
    buf, producer, gate = _busy_buffer(index)
    consumer = accel.Stream(index)
    wrapped = _CAIOnly(buf) if protocol == "cai" else _DLPackOnly(buf)
    if protocol == "cai":
        assert wrapped.__cuda_array_interface__["stream"] == producer.handle
    dst = accel.Buffer(4096, device=index)
    dst.fill_(0)
    dst.last_stream.synchronize()          # (a device synchronize would wait for the gate)
    if target == "Buffer":
        copy = lambda: dst.copy_from(wrapped, stream=consumer, non_blocking=True)
    else:
        copy = lambda: dst.as_array(np.uint8).copy_from(wrapped, stream=consumer)
    _run_while_gated(copy, gate, consumer)
    consumer.synchronize()
    assert (dst.to_numpy() == 7).all()


# == CUDA Array Interface v3: accel's producer side and consumer edge values ======================
def test_cuda_array_interface_fields(sim_cuda):
    """CAI v3: "data: (integer, boolean) ... For zero-size arrays, use 0 here. The second element is
    the read-only flag"; "version: ... The current version is 3"; "strides: If strides is not given,
    or it is None, the array is in C-contiguous layout"; "mask: None or object" (absent or None);
    "stream: ... 0: This is disallowed ... 1: The legacy default stream. 2: The per-thread default
    stream. Any other integer: a cudaStream_t".  Device 1 with device 0 current."""
    src = _source(1)
    side = accel.Stream(1)
    cases = [(src, (256,), "|u1", src.ptr, None),
             (src.as_array(np.float32, (4, 8), None, 64), (4, 8), "<f4", src.ptr + 64, None),
             (src.as_array(np.int16, (3, 2), (8, 2), 2), (3, 2), "<i2", src.ptr + 2, (8, 2)),
             (src.as_array(np.float64, (0, 3), None, 8), (0, 3), "<f8", 0, None),
             (accel.Buffer(0, device=1), (0,), "|u1", 0, None)]
    for obj, shape, typestr, ptr, strides in cases:
        cai = obj.__cuda_array_interface__
        assert (cai["shape"], cai["typestr"], cai["data"], cai["version"]) == (shape, typestr, (ptr, False), 3)
        assert cai.get("strides") == strides and cai.get("mask") is None
        assert cai["stream"] == 1                      # the legacy default stream, never 0
    src.fill_(3, stream=side)
    assert src.__cuda_array_interface__["stream"] == side.handle not in (0, 1, 2)
    f = Foreign(src)
    f.managed.flags = FLAG_READ_ONLY
    ro = accel.from_dlpack(f.capsule())
    assert ro.__cuda_array_interface__["data"] == (src.ptr, True)
    assert ro.as_array(np.uint8).__cuda_array_interface__["data"] == (src.ptr, True)
    ro.close()
    side.synchronize()


def test_cuda_array_interface_consumer_edge_values(sim_cuda):
    """CAI v3 as a consumer: an empty array's ``data`` is (0, False) and copies nothing; a v2
    interface (no ``stream``) and ``stream: None`` ask for no synchronization; 2 names the
    per-thread default stream; 0 is refused (disallowed), as a mask is; nothing changes on a
    refusal."""

    class CAI:
        def __init__(self, **cai):
            self.__cuda_array_interface__ = cai

    src = _source(1)
    empty = dict(shape=(0,), typestr="|u1", data=(0, False), version=3, stream=None)
    accel.Buffer(0, device=1).copy_from(CAI(**empty))
    accel.Buffer(0, device=1).as_array(np.uint8).copy_from(CAI(**empty))
    accel.Buffer(8, device=1).as_array(np.float32, (0, 2)).copy_from(
        CAI(shape=(0, 2), typestr="<f4", data=(0, False), version=3, stream=1))
    good = dict(shape=(256,), typestr="|u1", data=(src.ptr, False), version=3)
    for extra in ({"stream": None}, {"stream": 1}, {"stream": 2}, {"version": 2}):
        for target in (accel.Buffer(256, device=1), accel.Buffer(256, device=1).as_array(np.uint8)):
            target.copy_from(CAI(**{**good, **extra}))
            assert (target.to_numpy() == np.arange(256)).all()
    del target
    dst = accel.Buffer(256, device=1)
    dst.fill_(9)
    accel.synchronize(1)
    before = _state()
    for bad, match in (({"stream": 0}, "0"), ({"mask": object()}, "mask")):
        for target in (dst, dst.as_array(np.uint8)):
            with pytest.raises(ValueError, match=match):
                target.copy_from(CAI(**{**good, **bad}))
    assert _state() == before and (dst.to_numpy() == 9).all()


def test_host_side_handshake_on_streamless_consumers(monkeypatch):
    """array API ``stream`` on device types whose stream type is not agreed (oneAPI, Metal): accel
    takes None, meaning the producer makes the data safe before it returns (it waits on the host
    for the buffer's last-use stream), and -1 for none.  Checked with the simulators' operation
    delay: after ``__dlpack__(stream=None)`` the last-use stream has no pending work."""
    for kind in ("xpu", "mps"):
        if kind not in SIMS:
            continue
        use_sim(monkeypatch, kind, ACCEL_SIM_DELAY_US=5000)
        index = accel.device_count() - 1
        buf = accel.Buffer(1 << 16, device=index)
        side = accel.Stream(index)
        for value in range(4):
            buf.fill_(value, stream=side)
        capsule = buf.__dlpack__(max_version=(1, 0))
        assert side.query()
        with pytest.raises(ValueError, match="stream"):
            buf.__dlpack__(stream=5)
        del capsule


class _Producer:
    """An object with ``__dlpack__`` handing out a Foreign capsule (another library's tensor)."""

    def __init__(self, foreign, device):
        self.foreign, self.device = foreign, device

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        return self.foreign.capsule()

    def __dlpack_device__(self):
        return self.device


@pytest.mark.skipif(np.dtype(np.longdouble).itemsize != 16, reason="longdouble is not 16 bytes here")
def test_consumer_refuses_ieee_quad_into_a_long_double_view(dev):
    """The import side of test_producer_refuses_non_ieee_long_double: a kDLFloat of 128 bits is
    IEEE binary128 (dlpack.h: kDLFloat is "IEEE floating point"), numpy's 16-byte long double is
    x87 extended precision padded: a copy into a long double view would give silently wrong
    values (r63i).  Refused (TypeError, nothing copied), as numpy has no such dtype.  (A complex
    of two quads, 256 bits, cannot even be described: DLDataType.bits is a uint8.)"""
    code, bits, dtype = 2, 128, np.longdouble
    kind, index = dev
    src = _source(index, 64)
    dst = accel.Buffer(64, device=index)
    dst.copy_from(np.zeros(64, np.uint8))
    f = Foreign(src)
    f.shape[0] = 64 // (bits // 8)
    f.tensor.dtype.code, f.tensor.dtype.bits = code, bits
    view = dst.as_array(dtype, (64 // (bits // 8),))
    with pytest.raises(TypeError, match="IEEE|no .*dtype|does not read"):
        view.copy_from(_Producer(f, src.__dlpack_device__()))
    assert (dst.to_numpy() == 0).all()
    src.close()
    dst.close()
