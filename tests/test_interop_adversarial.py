"""Adversarial reliability of the interop layer (task r1_interop): DLPack capsules made and
taken, typed views, ``__cuda_array_interface__``, foreign streams and the DLPack stream
handshake, fed the values a hostile caller or a broken producer gives.  Each test pins a bug
that was found here: a clear Python exception naming the bad value, state unchanged, no crash,
no leak."""

import gc
import os
import subprocess
import sys

import numpy as np
import pytest

import accel
from accel import _dlpack, _lazy
from accel.streams import on_device
from conftest import use_sim

_INT64_MAX = (1 << 63) - 1


class CAI:
    """A minimal __cuda_array_interface__ v3 producer (as CuPy or Numba export)."""

    def __init__(self, ptr, shape=(16,), typestr="<f4", stream=None):
        self.ptr, self.shape, self.typestr, self.stream = ptr, shape, typestr, stream

    @property
    def __cuda_array_interface__(self):
        cai = {"shape": self.shape, "typestr": self.typestr, "data": (self.ptr, False), "version": 3,
               "strides": None}
        if self.stream is not None:
            cai["stream"] = self.stream
        return cai


class Proto:
    """Only the CUDA stream protocol (cuda.core / CuPy streams)."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


class Lying:
    """A DLPack producer whose capsule describes other memory than its device says (a broken
    or hostile producer): ``edit(managed_tensor)`` rewrites accel's own capsule."""

    def __init__(self, buf, edit):
        self.buf, self.edit = buf, edit

    def __dlpack_device__(self):
        return self.buf.__dlpack_device__()

    def __dlpack__(self, stream=None, max_version=None, **kw):
        capsule = self.buf.__dlpack__(max_version=(1, 0))
        info = _dlpack.parse(capsule)
        self.edit(_dlpack.DLManagedTensorVersioned.from_address(info.address).dl_tensor)
        return capsule


def _allocated(index=0):
    return accel.memory.memory_allocated(index)


# -- typed views: sizes DLPack's int64 cannot hold ------------------------------------------------
@pytest.mark.parametrize("shape, strides", [((1 << 63,), (0,)), ((1 << 64,), (0,)), ((1 << 62, 1 << 62), (0, 0)),
                                            ((1 << 61,), (0,))])
def test_view_larger_than_int64_bytes_is_refused(sim_backend, shape, strides):
    """A broadcast view (stride 0) of 2**63 elements or more used to be made and exported: its
    DLPack capsule then said shape (-2**63,) (ctypes wraps int64 silently)."""
    buf = accel.Buffer(64)
    with pytest.raises(ValueError, match=r"as_array: .*shape.* (bytes of elements|more than 2\*\*63 - 1)"):
        buf.as_array("f4", shape=shape, strides=strides)
    assert _dlpack.live_exports() == 0


def test_empty_view_with_an_extent_beyond_int64_is_refused(sim_backend):
    """0 elements pass the byte count, but the extent itself does not fit a DLPack or CAI shape."""
    buf = accel.Buffer(64)
    with pytest.raises(ValueError, match=r"shape\[1\] is 1180591620717411303424"):
        buf.as_array("f4", shape=(0, 1 << 70))
    with pytest.raises(ValueError, match=r"strides\[0\] is 1180591620717411303424"):
        buf.as_array("f4", shape=(1, 2), strides=(1 << 70, 4))


def test_largest_broadcast_view_exports_its_true_shape(sim_cuda):
    buf = accel.Buffer(64)
    n = _INT64_MAX // 4
    view = buf.as_array("f4", shape=(n,), strides=(0,))
    info = _dlpack.parse(view.__dlpack__())
    assert info.shape == (n,) and info.strides == (0,)


def test_export_refuses_extents_outside_int64(sim_cuda):
    buf = accel.Buffer(64)
    for shape, strides in (((1 << 63,), None), ((4,), (1 << 63,)), ((4,), (-(1 << 63) - 1,))):
        with pytest.raises(ValueError, match="int64"):
            _dlpack.export(buf, buf.ptr, 2, 0, "uint8", shape, strides, 0, versioned=True)
    assert _dlpack.live_exports() == 0



# -- ArrayView.copy_from of foreign device memory: the range is checked ---------------------------
def test_view_copy_from_cai_of_host_memory_is_refused(sim_cuda):
    """Buffer.copy_from checks a __cuda_array_interface__ pointer; ArrayView.copy_from copied
    from whatever address it was given (host memory here; a bogus one crashed the process)."""
    view = accel.Buffer(64).as_array("f4")
    view.copy_from(np.full(16, 7, np.float32))
    host = np.arange(16, dtype=np.float32)
    with pytest.raises(ValueError, match="runtime knows"):
        view.copy_from(CAI(host.ctypes.data))
    assert (view.to_numpy() == 7).all()              # nothing was copied


def test_view_copy_from_cai_past_the_allocation_is_refused(sim_cuda):
    src = accel.Buffer(64)
    view = accel.Buffer(1 << 12).as_array("f4")
    with pytest.raises(ValueError, match="last byte"):
        view.copy_from(CAI(src.ptr + (1 << 21) - 16, shape=(1024,)))


def test_view_copy_from_cai_of_a_bogus_address_does_not_crash(tmp_path):
    script = tmp_path / "bogus.py"
    script.write_text(
        "import sys; sys.path.insert(0, %r)\n"
        "from test_interop_adversarial import CAI\n"
        "import accel\n"
        "view = accel.Buffer(64).as_array('f4')\n"
        "for ptr in (4096, 1 << 40):\n"
        "    try:\n"
        "        view.copy_from(CAI(ptr))\n"
        "    except ValueError as exc:\n"
        "        assert 'runtime knows' in str(exc), exc\n"
        "    else:\n"
        "        raise SystemExit('copied from %%#x' %% ptr)\n"
        "print('ok')\n" % os.path.dirname(__file__))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    env.update(ACCEL_SIM="cuda", ACCEL_SIM_DEVICES="2")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-2000:])
    assert run.stdout.strip() == "ok"


def test_view_copy_from_dlpack_of_host_memory_is_refused(sim_backend):
    """A DLPack producer whose capsule points at host memory while claiming to be device memory."""
    src = accel.Buffer(64)
    src.fill_(1)
    host = np.zeros(64, np.uint8)

    def to_host(tensor):
        tensor.data = host.ctypes.data

    view = accel.Buffer(64).as_array("u1")
    view.copy_from(np.full(64, 9, np.uint8))
    with pytest.raises(ValueError, match="runtime knows"):
        view.copy_from(Lying(src, to_host))
    gc.collect()
    assert _dlpack.live_exports() == 0                # the taken capsule was released
    assert (view.to_numpy() == 9).all()


# -- DLPack capsules a broken producer makes ------------------------------------------------------
def _set(field, value):
    def edit(tensor):
        if field == "shape":
            tensor.shape[0] = value
        elif field == "stride":
            tensor.strides[0] = value
        elif field in ("bits", "lanes"):
            setattr(tensor.dtype, field, value)
    return edit


@pytest.mark.parametrize("field, value, match", [
    ("shape", -1, r"shape \(-1,\)"),
    ("bits", 0, "0 bits"),
    ("lanes", 0, "0 lanes"),
    ("stride", -(1 << 62), "address"),
])
def test_from_dlpack_of_malformed_tensor(sim_backend, field, value, match):
    src = accel.Buffer(64)
    with pytest.raises(BufferError, match=match):
        accel.from_dlpack(Lying(src, _set(field, value)))
    gc.collect()
    assert _dlpack.live_exports() == 0
    src.close()
    assert _allocated() == 0


# -- stream handles: pointers are 64 bits ---------------------------------------------------------
def test_stream_handle_beyond_64_bits_is_refused(sim_cuda):
    """cffi casts 2**64 to the NULL pointer: such a handle named the legacy default stream."""
    buf = accel.Buffer(64)
    for bad in (1 << 64, (1 << 64) + 0x100000):
        with pytest.raises(ValueError, match="64 bits"):
            accel.Stream.from_handle(bad)
        with pytest.raises(ValueError, match="64 bits"):
            accel.ExternalStream(bad, 0)
        with pytest.raises(ValueError, match="64 bits"):
            buf.record_stream(Proto(bad))
        with pytest.raises(ValueError, match="64 bits"):
            buf.__dlpack__(stream=bad)
        with pytest.raises(ValueError, match="64 bits"):
            buf.copy_from(CAI(accel.Buffer(64).ptr, shape=(64,), typestr="|u1", stream=bad))
        with pytest.raises(ValueError, match="64 bits"):
            buf.as_array("u1").copy_from(CAI(accel.Buffer(64).ptr, shape=(64,), typestr="|u1", stream=bad))
    assert _dlpack.live_exports() == 0


# -- the DLPack stream handshake across devices ---------------------------------------------------
def test_consumer_default_stream_of_other_device_waits(monkeypatch):
    """Buffer on device 0 (current), consumer stream: device 1's default stream.  Both default
    streams have handle 0: the handshake compared handles only and skipped the wait."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=20000)
    backend = _lazy.lazy_init()
    buf = accel.Buffer(4096)
    for value in (1, 2, 3, 4, 7):        # slow fills on device 0's default stream
        buf.fill_(value)
    consumer = accel.default_stream(1)
    capsule = buf.__dlpack__(stream=consumer)
    assert buf.last_stream == consumer
    out = np.zeros(4096, np.uint8)
    accel.memory.device_allocator(0).add_peer(1)     # device 1 may read device 0's mapped memory
    with on_device(backend, 1):           # the consumer reads on its stream (a peer read)
        backend.memcpy_async(out.ctypes.data, buf.ptr, 4096, consumer.handle)
        backend.stream_synchronize(consumer.handle)
    assert (out == 7).all()
    del capsule
    assert accel.current_device_index() == 0


def test_consumer_stream_of_other_device_after_peer_use(sim_cuda):
    """Last use on device 0's default stream of a device-1 buffer; the consumer asks for device
    1's legacy stream (1): the wait must be issued, on device 1."""
    backend = _lazy.lazy_init()
    buf = accel.Buffer(64, device=1)
    buf.record_stream(accel.default_stream(0))
    waits = []
    real = backend.stream_wait_event

    def spy(stream, event, *a, **kw):
        waits.append((backend.get_device(), stream))
        return real(stream, event, *a, **kw)

    backend.stream_wait_event = spy
    try:
        del_capsule = buf.__dlpack__(stream=1)
    finally:
        del backend.stream_wait_event
    assert waits == [(1, backend.default_stream(1))]
    assert buf.last_stream == accel.default_stream(1)
    del del_capsule


def test_protocol_stream_with_handle_zero(sim_cuda):
    """A torch/cuda.core default stream says (0, 0): taken as the legacy default stream, as
    from_dlpack does, not refused as the int 0 the protocol forbids."""
    buf = accel.Buffer(64)
    capsule = buf.__dlpack__(stream=Proto(0))
    assert _dlpack.parse(capsule).shape == (64,)


# -- close racing an export ---------------------------------------------------------------------
def test_close_racing_an_export_gives_no_capsule_over_freed_memory(sim_backend, monkeypatch):
    """Another thread's close() landing between __dlpack__'s check and the export's pin freed
    the memory under the capsule being made (the next Buffer got the same address).  Since r61
    the call pins first: the export completes on the memory it began with, which stays out of
    the allocator's hands until the capsule goes."""
    real = _dlpack.sync_for_consumer

    def racing(buffer, stream):
        real(buffer, stream)
        buffer.close()                  # what another thread's close() does in this window

    monkeypatch.setattr(_dlpack, "sync_for_consumer", racing)
    for as_exporter in (lambda b: b, lambda b: b.as_array("u1")):
        buf = accel.Buffer(64)
        ptr = buf.ptr
        capsule = as_exporter(buf).__dlpack__()
        assert buf._closed
        other = accel.Buffer(64)
        assert other.ptr != ptr         # not handed out while the capsule holds it
        other.close()
        del capsule
        gc.collect()
    assert _dlpack.live_exports() == 0 and _allocated() == 0


# -- Buffer.from_ptr: a range past the 64-bit address space ---------------------------------------
def test_from_ptr_past_the_address_space_is_refused(sim_backend):
    """cudaPointerGetAttributes was asked about the address cast to 64 bits: ptr + 2**64 (or a
    size of 2**64 + n, whose last byte wraps to the start) was taken as the allocation."""
    buf = accel.Buffer(64)
    for ptr, nbytes in ((buf.ptr, (1 << 64) + 1), (buf.ptr, (1 << 65) + 1), (buf.ptr + (1 << 64), 64)):
        with pytest.raises(ValueError, match="64-bit address space"):
            accel.Buffer.from_ptr(ptr, nbytes)
    wrapped = accel.Buffer.from_ptr(buf.ptr, 64)
    wrapped.close()


def test_view_copy_from_cai_past_the_address_space_is_refused(sim_cuda):
    src = accel.Buffer(64)
    src.fill_(3)
    view = accel.Buffer(64).as_array("u1")
    view.copy_from(np.zeros(64, np.uint8))
    with pytest.raises(ValueError, match="64-bit address space"):
        view.copy_from(CAI(src.ptr + (1 << 64), shape=(64,), typestr="|u1"))
    assert (view.to_numpy() == 0).all()


# -- a foreign stream its owner destroyed ---------------------------------------------------------
def test_destroyed_foreign_stream_is_refused_before_it_is_recorded(sim_backend):
    """A failed copy on a wrapper of a destroyed stream used to record the dead handle with the
    allocator first: every later close() and empty_cache() of the device then failed (400)."""
    backend = _lazy.lazy_init()
    with on_device(backend, 1 if backend.count() > 1 else 0):
        raw = backend.stream_create()
    wrapper = accel.Stream.from_handle(raw)
    index = wrapper.device_index
    buf = accel.Buffer(64, index)
    buf.fill_(4)
    backend.stream_destroy(raw)                      # the owner destroys it; accel still wraps it
    host = np.zeros(64, np.uint8)
    for use in (lambda: buf.copy_to(host, stream=wrapper), lambda: buf.fill_(1, stream=wrapper),
                lambda: buf.record_stream(wrapper), lambda: buf.as_array("u1").to_numpy(stream=wrapper)):
        with pytest.raises(ValueError, match="destroyed"):
            use()
    assert buf.last_stream != wrapper
    assert (buf.to_numpy() == 4).all()
    buf.close()                                      # used to raise: the dead stream was recorded
    accel.memory.empty_cache()
    assert _allocated(index) == 0 and accel.memory.memory_reserved(index) == 0


# -- memory snapshot files ----------------------------------------------------------------------
@pytest.mark.parametrize("as_bytes", [False, True])
def test_dump_snapshot_json_for_a_bytes_path(sim_cuda, tmp_path, as_bytes):
    """A bytes path ending in .json got a pickle: the suffix test looked at str(b'...json'), which
    ends in a quote."""
    import json
    import pickle
    accel.memory.record_history("all")
    try:
        accel.Buffer(64, device=1).fill_(1)
        for name, load in (("snap.json", lambda fh: json.loads(fh.read())), ("snap.pickle", pickle.load)):
            path = os.fsencode(tmp_path / name) if as_bytes else str(tmp_path / name)
            accel.memory.dump_snapshot(path)
            with open(path, "rb") as fh:
                data = load(fh)
            assert len(data["device_traces"]) == 2 and data["device_traces"][1]
    finally:
        accel.memory.record_history(None)


# -- a __cuda_array_interface__ producer stream of another device ---------------------------------
def test_cai_producer_stream_on_another_device(sim_cuda):
    """CuPy exports the current device's current stream: data on device 0, stream of device 1.
    The event was recorded with device 0 current on device 1's stream (cudaErrorInvalidResourceHandle)."""
    src = accel.Buffer(64)                 # device 0
    src.copy_from(np.arange(64, dtype=np.uint8))
    producer = accel.Stream(1)
    cai = CAI(src.ptr, shape=(64,), typestr="|u1", stream=producer.handle)
    dst = accel.Buffer(64)
    dst.copy_from(cai)
    assert (dst.to_numpy() == np.arange(64)).all()
    view = accel.Buffer(64).as_array("u1")
    view.copy_from(cai)
    assert (view.to_numpy() == np.arange(64)).all()
    assert accel.current_device_index() == 0


def test_cai_producer_stream_destroyed_or_negative(sim_cuda):
    src = accel.Buffer(64)
    gone = accel.Stream()
    handle = gone.handle
    gone.close()
    dst = accel.Buffer(64)
    view = accel.Buffer(64).as_array("u1")
    for bad, match in ((handle, "not a live"), (-3, "stream -3")):
        cai = CAI(src.ptr, shape=(64,), typestr="|u1", stream=bad)
        for target in (dst, view):
            with pytest.raises(ValueError, match=match):
                target.copy_from(cai)
    assert dst.last_stream == accel.current_stream()


# -- a producer whose __dlpack_device__ is malformed -----------------------------------------------
class BadDevice:
    def __init__(self, device):
        self.device, self.asked = device, 0

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, **kw):
        self.asked += 1
        raise AssertionError("not asked for a capsule")


@pytest.mark.parametrize("device", [None, (2,), (2, 0, 0), (2, "x"), ("cuda", 0), (2, True), (2.0, 0), 7])
def test_from_dlpack_names_a_malformed_dlpack_device(sim_cuda, device):
    """These raised TypeError/IndexError from inside accel ("'NoneType' object is not iterable",
    "tuple index out of range", "'<=' not supported ...")."""
    producer = BadDevice(device)
    with pytest.raises(TypeError, match=r"BadDevice.__dlpack_device__\(\) returned"):
        accel.from_dlpack(producer)
    assert producer.asked == 0


# -- one capsule taken by two consumers at once ---------------------------------------------------
_PyCapsule_New = __import__("ctypes").PYFUNCTYPE(
    __import__("ctypes").py_object, __import__("ctypes").c_void_p, __import__("ctypes").c_char_p,
    __import__("ctypes").c_void_p)(("PyCapsule_New", __import__("ctypes").pythonapi))
_LEGACY_NAME = b"dltensor"


class ForeignProducer:
    """A legacy DLManagedTensor over ``buf`` made with ctypes, whose deleter counts its calls
    (a second call would be a double free in a real producer)."""

    def __init__(self, buf):
        import ctypes
        self.calls = []
        self.managed = _dlpack.DLManagedTensor()
        self.shape = (ctypes.c_int64 * 1)(buf.nbytes)
        t = self.managed.dl_tensor
        t.data = buf.ptr
        t.device.device_type, t.device.device_id = buf.__dlpack_device__()
        t.ndim = 1
        t.dtype.code, t.dtype.bits, t.dtype.lanes = 1, 8, 1
        t.shape = ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64))
        self.deleter = _dlpack.DELETER(lambda address: self.calls.append(address))
        self.managed.deleter = ctypes.cast(self.deleter, ctypes.c_void_p).value
        self.capsule = _PyCapsule_New(ctypes.addressof(self.managed), _LEGACY_NAME, None)


def test_capsule_taken_by_two_consumers_at_once(sim_backend, monkeypatch):
    """Another thread's from_dlpack between this one's parse and its rename: both took the
    capsule and the producer's deleter ran twice (a double free)."""
    buf = accel.Buffer(64)
    producer = ForeignProducer(buf)
    real = _dlpack.parse
    inner = []

    def racing(capsule):
        info = real(capsule)
        if not inner:
            inner.append(None)
            inner[0] = accel.from_dlpack(capsule)        # the other consumer, in this window
        return info

    monkeypatch.setattr(_dlpack.importing, "parse", racing)   # (from_dlpack looks it up there)
    with pytest.raises(BufferError, match="consumed"):
        accel.from_dlpack(producer.capsule)
    monkeypatch.undo()
    inner[0].close()
    gc.collect()
    assert len(producer.calls) == 1
    with pytest.raises(BufferError, match="consumed"):
        accel.from_dlpack(producer.capsule)


# -- a last-use stream that was closed --------------------------------------------------------------
def test_export_after_the_last_use_stream_was_closed(monkeypatch):
    """A side stream used for a fill and then closed (an ordinary thing to do) made every
    __dlpack__ with a stream, from_dlpack and a view's export raise "stream was closed"."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=20000)
    backend = _lazy.lazy_init()
    buf = accel.Buffer(4096)
    side = accel.Stream()
    for value in (1, 2, 3, 9):              # slow fills, still queued when the stream is closed
        buf.fill_(value, stream=side)
    side.close()
    capsule = buf.__dlpack__(stream=1)      # the legacy stream must see the closed stream's work
    out = np.zeros(4096, np.uint8)
    backend.memcpy_async(out.ctypes.data, buf.ptr, 4096, backend.default_stream(0))
    backend.stream_synchronize(backend.default_stream(0))
    assert (out == 9).all()
    assert buf.last_stream == accel.default_stream(0)
    del capsule
    imported = accel.from_dlpack(buf)
    imported.close()
    assert _dlpack.parse(buf.as_array("u1").__dlpack__(max_version=(1, 0))).shape == (4096,)
    gc.collect()
    assert _dlpack.live_exports() == 0


def test_host_export_after_the_last_use_stream_was_closed(sim_backend):
    buf = accel.Buffer(64)
    side = accel.Stream()
    buf.fill_(5, stream=side)
    side.close()
    capsule = buf.__dlpack__()              # stream None: CUDA's legacy stream, elsewhere the host waits
    assert _dlpack.parse(capsule).shape == (64,)
    assert (buf.to_numpy() == 5).all()


def test_cuda_array_interface_after_the_last_use_stream_was_closed(monkeypatch):
    """The interface named the current stream, which is not ordered after the closed stream's
    still-queued work: a consumer that synchronized on it read stale bytes."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=20000)
    backend = _lazy.lazy_init()
    buf = accel.Buffer(4096)
    side = accel.Stream()
    for value in (1, 2, 3, 9):
        buf.fill_(value, stream=side)
    side.close()
    cai = buf.__cuda_array_interface__
    handle = 0 if cai["stream"] == 1 else cai["stream"]
    backend.stream_synchronize(handle)                 # what CuPy/Numba do with "stream"
    reader = accel.Stream()
    out = np.zeros(4096, np.uint8)
    backend.memcpy_async(out.ctypes.data, buf.ptr, 4096, reader.handle)
    reader.synchronize()
    assert (out == 9).all()
