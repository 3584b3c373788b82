"""DLPack in and out, foreign memory, and __cuda_array_interface__ (issue 17 items 1, 3, 4).

A consumer written with ctypes (accel._dlpack's structs, read by hand here) parses accel's
capsules; round trips through accel.from_dlpack share memory; torch (CPU) is tried as a consumer
and a producer where it can take part without a GPU."""

import ctypes
import gc
import os
import sys
import traceback

import numpy as np
import pytest

import accel
from accel import _dlpack
from tests.conftest import use_sim


# -- __cuda_array_interface__ -------------------------------------------------------------------
def test_cai_stream_is_last_use_stream(sim_cuda):
    buf = accel.Buffer(64)
    side = accel.Stream()
    buf.fill_(7, stream=side)
    # the current stream is still the default one: the consumer must sync on `side`
    assert accel.current_stream() != side
    assert buf.__cuda_array_interface__["stream"] == side.handle
    buf.fill_(1)     # on the current (legacy default, handle 0) stream: CAI v3 says 1
    assert buf.__cuda_array_interface__["stream"] == 1
    buf.record_stream(side)
    assert buf.__cuda_array_interface__["stream"] == side.handle
    side.synchronize()


def test_cai_stream_follows_rng_fill_on_allocation_stream(sim_cuda):
    side = accel.Stream()
    buf = accel.Buffer(64, stream=side)
    buf.fill_(0)                              # current stream: legacy default
    assert buf.__cuda_array_interface__["stream"] == 1
    with side:
        accel.random.uniform_(buf)            # on `side`, the allocation stream
    assert buf.__cuda_array_interface__["stream"] == side.handle
    side.synchronize()


def test_cai_hasattr_false_after_close(sim_cuda):
    buf = accel.Buffer(16)
    assert hasattr(buf, "__cuda_array_interface__")
    buf.close()
    assert not hasattr(buf, "__cuda_array_interface__")
    with pytest.raises(AttributeError, match="closed"):
        buf.__cuda_array_interface__


@pytest.mark.parametrize("kind", ["xpu", "mps"])
def test_cai_hasattr_false_without_cuda(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    buf = accel.Buffer(16)
    assert not hasattr(buf, "__cuda_array_interface__")
    buf.close()
    assert not hasattr(buf, "__cuda_array_interface__")


# -- a DLPack consumer written with ctypes (independent of accel._dlpack's structs) ----------------
class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _Managed(ctypes.Structure):
    _fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _ManagedVersioned(ctypes.Structure):
    _fields_ = [("version", _Version), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _Tensor)]


_GetName = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))
_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_SetName = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_SetName", ctypes.pythonapi))
_USED = {b"dltensor": ctypes.create_string_buffer(b"used_dltensor"),
         b"dltensor_versioned": ctypes.create_string_buffer(b"used_dltensor_versioned")}


def consume(capsule):
    """What a C consumer does: read the struct, rename the capsule, return (fields, delete)."""
    name = _GetName(capsule)
    address = _GetPointer(capsule, name)
    if name == b"dltensor_versioned":
        managed = _ManagedVersioned.from_address(address)
        extra = {"version": (managed.version.major, managed.version.minor), "flags": managed.flags}
    else:
        assert name == b"dltensor"
        managed = _Managed.from_address(address)
        extra = {}
    t = managed.dl_tensor
    fields = dict(name=name, data=t.data or 0, device=(t.device.device_type, t.device.device_id), ndim=t.ndim,
                  dtype=(t.dtype.code, t.dtype.bits, t.dtype.lanes),
                  shape=tuple(t.shape[i] for i in range(t.ndim)),
                  strides=tuple(t.strides[i] for i in range(t.ndim)) if t.strides else None,
                  byte_offset=t.byte_offset, manager_ctx=managed.manager_ctx, **extra)
    assert _SetName(capsule, ctypes.cast(_USED[name], ctypes.c_char_p)) == 0
    deleter = _DELETER(managed.deleter)
    return fields, lambda: deleter(address)


@pytest.mark.parametrize("versioned", [True, False])
def test_ctypes_consumer_parses_capsule(sim_cuda, versioned):
    buf = accel.Buffer(96)
    ref = __import__("weakref").ref(buf)
    before = _dlpack.live_exports()
    capsule = buf.__dlpack__(max_version=(1, 0) if versioned else None)
    fields, delete = consume(capsule)
    assert fields["name"] == (b"dltensor_versioned" if versioned else b"dltensor")
    assert fields["data"] == buf.ptr and fields["byte_offset"] == 0
    assert fields["device"] == (2, 0) == buf.__dlpack_device__()
    assert fields["ndim"] == 1 and fields["shape"] == (96,) and fields["strides"] == (1,)
    assert fields["dtype"] == (1, 8, 1)      # kDLUInt, 8 bits, 1 lane
    if versioned:
        assert fields["version"] == (1, 1) and fields["flags"] == 0
    del capsule
    gc.collect()
    assert _dlpack.live_exports() == before + 1      # consumed: the consumer owns it now
    del buf
    gc.collect()
    assert ref() is not None                         # kept alive by the export until the deleter
    delete()
    assert _dlpack.live_exports() == before
    gc.collect()
    assert ref() is None                             # released once, memory freed by the buffer
    delete()                                         # a second call finds nothing to free
    assert _dlpack.live_exports() == before


def test_unconsumed_capsule_runs_deleter(sim_cuda):
    buf = accel.Buffer(8)
    before = _dlpack.live_exports()
    for kw in ({}, {"max_version": (1, 2)}, {"max_version": (2, 0)}):
        capsule = buf.__dlpack__(**kw)
        assert _dlpack.live_exports() == before + 1
        del capsule
        assert _dlpack.live_exports() == before


def test_legacy_capsule_for_old_max_version(sim_cuda):
    buf = accel.Buffer(8)
    assert _GetName(buf.__dlpack__(max_version=(0, 8))) == b"dltensor"
    assert _GetName(buf.__dlpack__(max_version=(1, 0))) == b"dltensor_versioned"


def test_zero_size_buffer_exports_null(sim_cuda):
    fields, delete = consume(accel.Buffer(0).__dlpack__(max_version=(1, 0)))
    assert fields["data"] == 0 and fields["shape"] == (0,)
    delete()


def test_export_typed_c_and_strided(sim_cuda):
    """The exporter other modules (typed views) call: dtype codes, shape, strides in elements."""
    buf = accel.Buffer(4 * 6 * 8)
    capsule = _dlpack.export(buf, buf.ptr, 2, 0, np.float64, (4, 6), (1, 4), 16, versioned=True)
    fields, delete = consume(capsule)
    assert fields["dtype"] == (2, 64, 1) and fields["shape"] == (4, 6) and fields["strides"] == (1, 4)
    assert fields["byte_offset"] == 16 and fields["data"] == buf.ptr
    delete()
    for dt, code in ((np.int16, (0, 16, 1)), (np.bool_, (6, 8, 1)), (np.complex64, (5, 64, 1))):
        fields, delete = consume(_dlpack.export(buf, buf.ptr, 2, 0, dt, (3,), None, 0, versioned=False))
        assert fields["dtype"] == code and fields["strides"] == (1,)
        delete()
    with pytest.raises(BufferError, match="byte-swapped"):
        _dlpack.export(buf, buf.ptr, 2, 0, np.dtype(">f4"), (3,), None, 0, versioned=True)
    with pytest.raises(BufferError, match="cannot describe"):
        _dlpack.export(buf, buf.ptr, 2, 0, np.dtype([("a", "<f4")]), (3,), None, 0, versioned=True)


# -- round trips -----------------------------------------------------------------------------
def test_round_trip_shares_memory(sim_backend):
    buf = accel.Buffer(64)
    buf.fill_(0)
    before = _dlpack.live_exports()
    view = accel.from_dlpack(buf)
    assert not view.owns_memory and view.ptr == buf.ptr and view.nbytes == 64
    assert view.device == buf.device
    view.copy_from(np.arange(64, dtype=np.uint8))
    assert (buf.to_numpy() == np.arange(64)).all()
    buf.fill_(9)
    assert (view.to_numpy() == 9).all()
    view.close()
    assert _dlpack.live_exports() == before
    assert (buf.to_numpy() == 9).all()               # the producer's memory was not freed


def test_round_trip_typed_view(sim_cuda):
    if not hasattr(accel.Buffer, "as_array"):
        pytest.skip("typed views (Buffer.as_array) are not in this tree")
    buf = accel.Buffer(8 * 4)
    buf.copy_from(np.arange(8, dtype=np.float32))
    view = buf.as_array(np.float32, (2, 4))
    imported = accel.from_dlpack(view)
    assert imported.ptr == buf.ptr and imported.nbytes == 32
    imported.copy_from(np.full(8, 2.5, dtype=np.float32))
    assert (buf.to_numpy("float32") == 2.5).all()
    imported.close()


def test_from_dlpack_of_capsule_and_consumed_capsule(sim_cuda):
    buf = accel.Buffer(16)
    capsule = buf.__dlpack__(max_version=(1, 0))
    imported = accel.from_dlpack(capsule)
    assert _GetName(capsule) == b"used_dltensor_versioned"
    with pytest.raises(BufferError, match="already consumed"):
        accel.from_dlpack(capsule)
    imported.close()
    with pytest.raises(TypeError, match="__dlpack__"):
        accel.from_dlpack(object())


def test_from_dlpack_strided_covers_span(sim_cuda):
    """A non-contiguous tensor: the Buffer covers its lowest to highest element (gaps included)."""
    buf = accel.Buffer(4 * 10)

    class Strided:
        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, stream=None, max_version=None):
            # every other float32 of a 10-element row, starting at element 1: elements 1,3,5,7
            return _dlpack.export(buf, buf.ptr, 2, 0, np.float32, (4,), (2,), 4, versioned=True)

    imported = accel.from_dlpack(Strided())
    assert imported.ptr == buf.ptr + 4 and imported.nbytes == 4 * 7
    imported.close()


# -- deleter exactly once ------------------------------------------------------------------------
class CountingProducer:
    """A producer whose capsules' owner counts its own release (the deleter's effect)."""

    def __init__(self, buf):
        self.buf, self.released, self.calls = buf, [], []

    def __dlpack_device__(self):
        return self.buf.__dlpack_device__()

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls.append({"stream": stream, "max_version": max_version})
        token = _Token(self.released)
        return _dlpack.export(token, self.buf.ptr, *self.buf.__dlpack_device__(), np.uint8,
                              (self.buf.nbytes,), None, 0, versioned=max_version is not None)


class _Token:
    def __init__(self, log):
        self.log = log

    def __del__(self):
        self.log.append(1)


def test_deleter_once_on_close(sim_cuda):
    producer = CountingProducer(accel.Buffer(32))
    imported = accel.from_dlpack(producer)
    assert producer.calls == [{"stream": 1, "max_version": (1, 0)}]    # legacy default stream: 1
    assert producer.released == []
    imported.close()
    assert producer.released == [1]
    imported.close()
    del imported
    gc.collect()
    assert producer.released == [1]


def test_deleter_once_when_collected(sim_cuda):
    producer = CountingProducer(accel.Buffer(32))
    imported = accel.from_dlpack(producer)
    imported.fill_(3)
    del imported
    gc.collect()
    assert producer.released == [1]
    assert (producer.buf.to_numpy() == 3).all()


def test_deleter_once_in_a_reference_cycle(sim_cuda):
    producer = CountingProducer(accel.Buffer(32))
    holder = {"buf": accel.from_dlpack(producer)}
    holder["self"] = holder
    del holder
    gc.collect()
    accel.memory.memory_stats()      # a safe point: deferred releases run
    assert producer.released == [1]


def test_old_producer_without_max_version(sim_cuda):
    buf = accel.Buffer(8)

    class Old:
        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, stream=None):
            return buf.__dlpack__(stream=stream)

    imported = accel.from_dlpack(Old())
    assert imported.ptr == buf.ptr
    imported.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_deleter_not_called_in_forked_child(sim_cuda):
    producer = CountingProducer(accel.Buffer(32))
    imported = accel.from_dlpack(producer)
    pid = os.fork()
    if pid == 0:    # child: the parent's capsule is the parent's to release
        code = 0
        try:
            try:
                imported.close()
                code = 3
            except RuntimeError as exc:
                code = 0 if "forked subprocess" in str(exc) else 4
            globals()["_leak"] = None
            del globals()["_leak"]
            ref = imported
            del ref
            gc.collect()
            if producer.released:
                code = 5
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert producer.released == []
    imported.close()
    assert producer.released == [1]


# -- the stream handshake ------------------------------------------------------------------------
def test_consumer_stream_waits_for_last_use_stream(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=20000)
    buf = accel.Buffer(4096)
    producer, consumer = accel.Stream(), accel.Stream()
    for value in (1, 2, 3, 4, 7):     # five slow operations queued on the producer's stream
        buf.fill_(value, stream=producer)
    capsule = buf.__dlpack__(stream=consumer.handle, max_version=(1, 0))
    assert buf.last_stream == consumer               # the export's stream is the last use now
    out = np.zeros(4096, dtype=np.uint8)
    buf.copy_to(out, stream=consumer)                # queued after the wait: sees the last fill
    assert (out == 7).all()
    del capsule


def test_dlpack_stream_values(sim_cuda):
    buf = accel.Buffer(16)
    side = accel.Stream()
    buf.fill_(1, stream=side)
    for stream in (None, 1, 2, -1, side.handle, side):
        capsule = buf.__dlpack__(stream=stream)
        del capsule
    with pytest.raises(ValueError, match="disallowed"):
        buf.__dlpack__(stream=0)
    with pytest.raises(TypeError, match="stream"):
        buf.__dlpack__(stream="default")
    with pytest.raises(ValueError, match=">= -1"):
        buf.__dlpack__(stream=-5)
    side.synchronize()


def test_dlpack_on_second_device(sim_cuda):
    assert accel.current_device_index() == 0
    buf = accel.Buffer(32, device=1)
    assert buf.__dlpack_device__() == (2, 1)
    side = accel.Stream(1)
    buf.fill_(5, stream=side)
    fields, delete = consume(buf.__dlpack__(stream=1, max_version=(1, 0)))   # device 1's legacy stream
    assert fields["device"] == (2, 1) and fields["data"] == buf.ptr
    delete()
    imported = accel.from_dlpack(buf)
    assert imported.device_index == 1 and accel.current_device_index() == 0
    assert (imported.to_numpy() == 5).all()
    imported.close()
    other = accel.Buffer(32)      # device 0
    other.copy_from(buf)
    assert (other.to_numpy() == 5).all()


@pytest.mark.parametrize("kind,code", [("xpu", 14), ("mps", 8)])
def test_dlpack_device_other_backends(monkeypatch, kind, code):
    use_sim(monkeypatch, kind)
    buf = accel.Buffer(16)
    assert buf.__dlpack_device__() == (code, 0)
    fields, delete = consume(buf.__dlpack__(max_version=(1, 0)))
    assert fields["device"] == (code, 0)
    assert accel._lazy.lazy_init().dlpack_address(fields["data"], fields["byte_offset"]) == buf.ptr
    delete()
    with pytest.raises(ValueError, match="stream"):
        buf.__dlpack__(stream=5)
    buf.__dlpack__(stream=-1)


# -- bad inputs ----------------------------------------------------------------------------------
def test_dlpack_bad_arguments(sim_cuda):
    buf = accel.Buffer(16)
    before = _dlpack.live_exports()
    with pytest.raises(BufferError, match="dl_device"):
        buf.__dlpack__(dl_device=(2, 1))
    with pytest.raises(BufferError, match="dl_device"):
        buf.__dlpack__(dl_device=(14, 0))
    with pytest.raises(ValueError, match="copy=False"):
        buf.__dlpack__(dl_device=(1, 0), copy=False)
    # (since session 39, r80b: dl_device=(kDLCPU, 0) with copy None gives a host copy, and
    # copy=True a device copy, as the array API asks: tests/test_dlpack_differential_r80b.py)
    with pytest.raises(TypeError, match="copy"):
        buf.__dlpack__(copy="yes")
    for bad in ("1.0", (1,), (1, 0, 0), (1, "a"), 1):
        with pytest.raises(TypeError, match="max_version"):
            buf.__dlpack__(max_version=bad)
    with pytest.raises(ValueError, match="max_version"):
        buf.__dlpack__(max_version=(-1, 0))
    buf.__dlpack__(dl_device=(2, 0), copy=False)           # its own device: fine
    assert _dlpack.live_exports() == before
    buf.close()
    with pytest.raises(RuntimeError, match="closed"):
        buf.__dlpack__()


def test_from_dlpack_refuses_foreign_capsule(sim_cuda):
    other = ctypes.pythonapi.PyCapsule_New
    other.restype, other.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    name = ctypes.create_string_buffer(b"not_a_tensor")
    capsule = other(1, ctypes.cast(name, ctypes.c_char_p), None)
    with pytest.raises(BufferError, match="not a DLPack capsule"):
        accel.from_dlpack(capsule)


def test_from_dlpack_device_index_out_of_range(sim_cuda):
    buf = accel.Buffer(8)
    capsule = _dlpack.export(buf, buf.ptr, 2, 5, np.uint8, (8,), None, 0, versioned=True)
    with pytest.raises(Exception, match="5"):
        accel.from_dlpack(capsule)
    assert _GetName(capsule) == b"dltensor_versioned"     # refused: not taken


def test_from_dlpack_wrong_memory(sim_cuda):
    """A capsule claiming kDLCUDA for memory the runtime knows as something else is refused."""
    host = np.zeros(64, dtype=np.uint8)
    capsule = _dlpack.export(host, host.ctypes.data, 2, 0, np.uint8, (64,), None, 0, versioned=True)
    with pytest.raises(ValueError, match="not memory the cuda runtime knows"):
        accel.from_dlpack(capsule)
    del capsule


# -- torch and numpy as consumers and producers -----------------------------------------------------
def _unraisable(monkeypatch) -> list:
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    return seen


def test_torch_cpu_tensor_refused_with_host_message(sim_cuda):
    torch = pytest.importorskip("torch")
    t = torch.arange(8, dtype=torch.int32)
    with pytest.raises(BufferError, match="host memory.*copy_from"):
        accel.from_dlpack(t)
    capsule = torch.utils.dlpack.to_dlpack(t)
    with pytest.raises(BufferError, match="kDLCPU"):
        accel.from_dlpack(capsule)
    assert _GetName(capsule) == b"dltensor"        # not taken: torch's destructor frees it


def test_copy_from_torch_cpu_tensor(sim_cuda):
    torch = pytest.importorskip("torch")
    t = torch.arange(8, dtype=torch.int32)
    buf = accel.Buffer(32).copy_from(t)
    assert (buf.to_numpy("int32") == np.arange(8)).all()


def test_torch_cpu_cannot_consume_device_buffer(sim_cuda, monkeypatch):
    """torch 2.13 CPU has no CUDA: it raises (never crashes), and the capsule is released once."""
    torch = pytest.importorskip("torch")
    buf = accel.Buffer(16)
    before = _dlpack.live_exports()
    with pytest.raises(AssertionError, match="CUDA"):
        torch.from_dlpack(buf)
    # Given the capsule itself, torch refuses the kDLCUDA device with its error set and drops
    # the capsule: accel's destructor runs the deleter (nothing leaks) and reports torch's
    # error through sys.unraisablehook; torch itself then raises SystemError.
    seen = _unraisable(monkeypatch)
    with pytest.raises((SystemError, RuntimeError)) as info:
        torch.from_dlpack(buf.__dlpack__(max_version=(1, 0)))
    # torch's from_dlpack frame, kept by the traceback, holds the capsule: let it go, so that
    # accel's registry of live capsules is empty for the tests after this one
    traceback.clear_frames(info.value.__traceback__)
    for u in seen:
        if u.exc_traceback is not None:
            traceback.clear_frames(u.exc_traceback)
    del info
    gc.collect()
    assert any("CUDA" in str(u.exc_value) for u in seen)
    assert _dlpack.live_exports() == before
    assert not _dlpack._capsules
    assert (buf.fill_(1).to_numpy() == 1).all()


def test_numpy_consumer_refuses_device_memory(sim_cuda, monkeypatch):
    buf = accel.Buffer(16).fill_(3)
    before = _dlpack.live_exports()
    # numpy asks for a host copy (dl_device=(kDLCPU, 0), copy=None): given since session 39 (r80b)
    assert (np.from_dlpack(buf, device="cpu") == 3).all()
    seen = _unraisable(monkeypatch)
    with pytest.raises((SystemError, BufferError, RuntimeError)):
        np.from_dlpack(buf)
    gc.collect()
    assert any("Unsupported device" in str(u.exc_value) for u in seen)     # numpy's own message
    assert _dlpack.live_exports() == before


# -- foreign memory: Buffer.from_ptr and copy_from ----------------------------------------------------
def test_from_ptr_wraps_without_owning(sim_cuda):
    base = accel.Buffer(256)
    base.fill_(0)
    reserved = accel.memory_reserved()
    owner = _Token([])
    wrapped = accel.Buffer.from_ptr(base.ptr + 64, 64, owner=owner)
    assert wrapped.ptr == base.ptr + 64 and not wrapped.owns_memory
    wrapped.copy_from(np.full(64, 5, dtype=np.uint8))
    assert (base.to_numpy()[64:128] == 5).all() and (base.to_numpy()[:64] == 0).all()
    side = accel.Stream()
    wrapped.fill_(6, stream=side)
    wrapped.record_stream(side)
    assert wrapped.__cuda_array_interface__["stream"] == side.handle
    accel.random.uniform_(wrapped)
    out = np.zeros(64, dtype=np.uint8)
    wrapped.copy_to(out)
    wrapped.close()
    assert owner.log == []          # the owner is dropped, not destroyed (we still hold it)
    del owner
    assert accel.memory_reserved() == reserved
    assert (base.to_numpy()[64:128] == out).all()     # memory untouched by close


def test_from_ptr_releases_owner_after_queued_work(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=20000)
    base = accel.Buffer(64)
    log = []
    wrapped = accel.Buffer.from_ptr(base.ptr, 64, owner=_Token(log))
    side = accel.Stream()
    for value in (1, 2, 3):
        wrapped.fill_(value, stream=side)
    wrapped.close()                  # waits for the fills on `side`, then drops the owner
    assert log == [1]
    assert side.query()


@pytest.mark.parametrize("ptr,nbytes,exc,match", [
    (0, 8, ValueError, "ptr must be"), (-16, 8, ValueError, "ptr must be"), (True, 8, TypeError, "bool"),
    (1.5, 8, TypeError, "ptr must be an int"), (4096, 0, ValueError, "nbytes must be > 0"),
    (4096, -1, ValueError, "nbytes must be > 0"), (4096, "8", TypeError, "nbytes")])
def test_from_ptr_bad_values(sim_cuda, ptr, nbytes, exc, match):
    with pytest.raises(exc, match=match):
        accel.Buffer.from_ptr(ptr, nbytes)


def test_from_ptr_checks_range_on_simulator(sim_cuda):
    base = accel.Buffer(1 << 20)
    with pytest.raises(ValueError, match="last byte"):
        accel.Buffer.from_ptr(base.ptr, 1 << 36)     # past the end of its segment
    with pytest.raises(ValueError, match="device=0"):
        accel.Buffer.from_ptr(base.ptr, 16, device=1)
    pinned = accel.empty_pinned(64, np.uint8)
    with pytest.raises(ValueError, match="pinned host memory"):
        accel.Buffer.from_ptr(pinned.ctypes.data, 64)
    with pytest.raises(ValueError, match="not memory the cuda runtime knows"):
        accel.Buffer.from_ptr(np.zeros(64, np.uint8).ctypes.data, 64)
    second = accel.Buffer(64, device=1)
    wrapped = accel.Buffer.from_ptr(second.ptr, 64, device=1)
    assert wrapped.device_index == 1
    wrapped.fill_(4)
    assert (second.to_numpy() == 4).all()


def test_copy_from_cuda_array_interface(sim_cuda):
    src = accel.Buffer(64)
    side = accel.Stream()
    src.copy_from(np.arange(64, dtype=np.uint8), stream=side)

    class Foreign:       # a CuPy-like array: CAI v3 only
        __cuda_array_interface__ = {"shape": (16,), "typestr": "<f4", "data": (src.ptr, False),
                                    "strides": None, "version": 3, "stream": side.handle}

    dst = accel.Buffer(64).copy_from(Foreign())
    assert (dst.to_numpy() == np.arange(64)).all()
    Foreign.__cuda_array_interface__ = dict(Foreign.__cuda_array_interface__, strides=(8,))
    with pytest.raises(ValueError, match="not C-contiguous"):
        dst.copy_from(Foreign())
    Foreign.__cuda_array_interface__ = dict(Foreign.__cuda_array_interface__, strides=None, shape=(8,))
    with pytest.raises(ValueError, match="size mismatch"):
        dst.copy_from(Foreign())


def test_copy_from_dlpack_object(sim_backend):
    src = accel.Buffer(32)
    src.copy_from(np.arange(32, dtype=np.uint8))
    producer = CountingProducer(src)
    dst = accel.Buffer(32).copy_from(producer)
    assert (dst.to_numpy() == np.arange(32)).all()
    assert producer.released == [1]              # the capsule was handed back after the copy
    with pytest.raises(ValueError, match="size mismatch"):
        accel.Buffer(16).copy_from(producer)
    assert producer.released == [1, 1]


def test_read_only_import(sim_cuda):
    buf = accel.Buffer(16)
    capsule = _dlpack.export(buf, buf.ptr, 2, 0, np.uint8, (16,), None, 0, versioned=True, readonly=True)
    imported = accel.from_dlpack(capsule)
    assert imported.readonly
    assert imported.__cuda_array_interface__["data"] == (buf.ptr, True)
    with pytest.raises(ValueError, match="read-only"):
        imported.fill_(1)
    with pytest.raises(ValueError, match="read-only"):
        imported.copy_from(np.zeros(16, np.uint8))
    imported.close()


def test_close_while_exported_defers_the_free(sim_cuda):
    """close() while a consumer holds a capsule's tensor must not hand the memory back yet."""
    buf = accel.Buffer(1 << 20)
    allocated = accel.memory_allocated()
    fields, delete = consume(buf.__dlpack__(max_version=(1, 0)))
    buf.close()
    assert accel.memory_allocated() == allocated          # the consumer still uses it
    other = accel.Buffer(1 << 20)
    assert other.ptr != fields["data"]                    # not handed out again
    delete()
    assert accel.memory_allocated() == allocated          # freed once (other is live)
    other.close()
    assert accel.memory_allocated() == allocated - (1 << 20)


def test_close_while_exported_foreign(sim_cuda):
    producer = CountingProducer(accel.Buffer(32))
    imported = accel.from_dlpack(producer)
    fields, delete = consume(imported.__dlpack__())
    imported.close()
    assert producer.released == []                       # re-exported: still in use
    delete()
    assert producer.released == [1]


def test_export_after_peer_copy_uses_other_device_stream(sim_cuda):
    """A peer copy makes a stream of the other device the buffer's last use: the handshake's
    event is recorded on that stream's device."""
    src = accel.Buffer(64, device=1)
    src.fill_(3)
    dst = accel.Buffer(64)                           # device 0, current
    side = accel.Stream(0)
    dst.copy_from(src, stream=side)
    assert src.last_stream == side
    capsule = src.__dlpack__(stream=1)               # device 1's legacy default stream waits
    fields, delete = consume(capsule)
    assert fields["device"] == (2, 1)
    delete()
    assert (src.to_numpy() == 3).all() and (dst.to_numpy() == 3).all()


def test_from_ptr_checked_on_every_simulator(sim_backend):
    base = accel.Buffer(256)
    base.fill_(0)
    with pytest.raises(ValueError, match="runtime knows"):
        accel.Buffer.from_ptr(np.zeros(64, np.uint8).ctypes.data, 64)
    with pytest.raises(ValueError, match="last byte"):
        accel.Buffer.from_ptr(base.ptr, 1 << 36)
    wrapped = accel.Buffer.from_ptr(base.ptr + 128, 128)
    wrapped.fill_(8)
    assert (base.to_numpy()[128:] == 8).all() and (base.to_numpy()[:128] == 0).all()
    wrapped.close()
    assert (base.to_numpy()[128:] == 8).all()


def test_made_up_consumer_stream_handle_is_named_and_changes_nothing(sim_cuda):
    """__dlpack__(stream=<an int that is no stream>) on a buffer last used on a side stream of
    the non-current device: the error names the stream argument and what to pass (it was a bare
    'cudaStreamWaitEvent failed ... invalid resource handle'), and the buffer exports afterwards."""
    last = accel.device_count() - 1
    buf = accel.Buffer(64, device=last)
    side = accel.Stream(last)
    with side:
        buf.fill_(2)
    with pytest.raises(accel.AcceleratorError, match=r"__dlpack__\(stream=3\).*-1") as err:
        buf.__dlpack__(stream=3)
    assert err.value.code_name == "cudaErrorInvalidResourceHandle"
    assert accel.current_device_index() == 0
    side.synchronize()
    capsule = buf.__dlpack__(stream=-1)
    del capsule
    assert (buf.to_numpy() == 2).all()


def test_producer_returning_no_capsule_is_named(sim_cuda):
    """A producer whose __dlpack__ returns something else: the error says the producer returned
    it (it said 'expected a DLPack capsule ... got NoneType', as if the caller passed None)."""
    class Broken:
        def __dlpack__(self, stream=None, max_version=None):
            return None

        def __dlpack_device__(self):
            return (2, 0)

    with pytest.raises(TypeError, match=r"Broken\.__dlpack__\(\) returned NoneType"):
        accel.from_dlpack(Broken())


def test_xpu_dlpack_to_another_stream_during_a_capture_leaves_the_capture(sim_graph_backend):
    """__dlpack__(stream=<another accel.Stream>) of a buffer last used in a capture: on CUDA the
    other stream waits on an event recorded in the capture (it joins it); XPU's capture cannot
    record events, and the record invalidated the capture.  There it is refused before anything
    is queued (CaptureError naming the fix), and the capture goes on."""
    def refused(buf, s):
        if sim_graph_backend == "xpu":
            with pytest.raises(accel.CaptureError, match=r"stream=-1"):
                buf.__dlpack__(stream=accel.Stream())
            assert accel.is_current_stream_capturing()
    with accel.device_index(accel.device_count() - 1):
        dlpack_inside_a_capture(refused)


def dlpack_inside_a_capture(body):
    """Capture a fill, ``body(buf, stream)`` (exports of the buffer while its last use is the
    capturing ``stream``), and a second fill on the current device; the replay must write the
    second fill's value: the capture survived whatever ``body`` did."""
    buf = accel.Buffer(256)
    s = accel.Stream()
    g = accel.Graph()
    with s:
        g.capture_begin()
        try:
            buf.fill_(3)
            body(buf, s)
            buf.fill_(4)
        finally:
            g.capture_end()
    g.replay()
    accel.synchronize()
    assert (buf.to_numpy() == 4).all()
