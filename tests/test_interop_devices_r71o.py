"""r71o: interop on the non-current device and between devices.

DLPack (``Buffer/ArrayView.__dlpack__``, ``accel.from_dlpack``, ``copy_from`` of DLPack
producers), the CUDA Array Interface v3 and ``accel.launch`` with buffers of device 1 while
device 0 is current, on the CUDA and XPU simulators with two devices, with and without peer
access (``ACCEL_SIM_PEER=none``, accel/sim/README.md r71g).

Spec text relied on:
- array API standard, ``array.__dlpack__(*, stream=None, ...)``: "stream: ... For CUDA and
  ROCm, a Python integer representing a pointer to a stream, on devices that support streams.
  stream is provided by the consumer to the producer to instruct the producer to ensure that
  operations can safely be performed on the array (e.g., by inserting a dependency between
  streams via 'wait for event')."  The DLPack Python spec: __dlpack_device__ is there "to query
  what device the array is on (may be needed to pass in the correct stream, e.g. in the case of
  multiple GPUs)".
- CUDA Array Interface v3, ``stream``: "An optional stream upon which synchronization must
  take place at the point of consumption ... 1 = the legacy default stream ... 0 is disallowed";
  the consumer synchronizes on that stream before using the data.

Gated streams (tests/torch_port_util.hold) show ordering; nothing is timed.
"""

import gc

import numpy as np
import pytest

import accel
from accel import _dlpack as D
from accel import _lazy
from accel import streams as _streams

from conftest import SIMS, use_sim
from torch_port_util import hold

torch = pytest.importorskip("torch")


def _need(kind):
    if kind not in SIMS:
        pytest.skip(f"ACCEL_TEST_SIMS leaves out {kind}")


@pytest.fixture(params=["cuda", "xpu"])
def two(request, monkeypatch):
    """A simulator with two devices, device 0 current, no peer access between them."""
    _need(request.param)
    use_sim(monkeypatch, request.param, ACCEL_SIM_PEER="none")
    return request.param


@pytest.fixture
def gated(monkeypatch):
    """The CUDA simulator with queued operations (hold() can gate a stream)."""
    _need("cuda")
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=50)
    return "cuda"


def _query(handle, index):
    backend = _lazy.lazy_init()
    with _streams.on_device(backend, index):
        return backend.stream_query(handle)


def _pattern(n=256, seed=0):
    return ((np.arange(n) * 7 + seed) % 251).astype(np.uint8)


def _src(index, n=256, seed=0):
    buf = accel.Buffer(n, device=index)
    buf.copy_from(_pattern(n, seed))
    return buf


class DL:
    """A DLPack-only producer wrapping an accel object (hides __cuda_array_interface__)."""

    def __init__(self, obj):
        self.obj = obj
        self.streams = []

    def __dlpack__(self, **kw):
        self.streams.append(kw.get("stream"))
        return self.obj.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.obj.__dlpack_device__()


class CAI:
    """A __cuda_array_interface__-only producer (a snapshot of an accel object's interface)."""

    def __init__(self, cai, keep=None):
        self.__cuda_array_interface__ = dict(cai)
        self.keep = keep


def _settled():
    gc.collect()
    return D.live_exports(), len(D._capsules)


# -- DLPack export of a device-1 buffer while device 0 is current -----------------------------------
def test_export_of_device1_buffer_is_device1_and_leaves_device0_current(two):
    buf = _src(1)
    assert accel.current_device_index() == 0
    for obj in (buf, buf.as_array("u2", (128,)), buf.as_array("u1", (8, 6), (32, 3))):
        assert obj.__dlpack_device__()[1] == 1
        imported = accel.from_dlpack(obj)
        assert imported.device_index == 1 and imported.ptr == buf.ptr
        imported.close()
    # dl_device naming device 0 of the same type is refused: accel never copies on export
    kind = buf.__dlpack_device__()[0]
    with pytest.raises(BufferError, match="dl_device"):
        buf.__dlpack__(dl_device=(kind, 0), max_version=(1, 0))
    with pytest.raises(BufferError):
        buf.__dlpack__(dl_device=(kind, 0), copy=True, max_version=(1, 0))
    assert accel.current_device_index() == 0
    assert _settled() == (0, 0)


def test_consumer_stream_handle_of_device0_for_a_device1_buffer_waits(gated):
    """The consumer passes an int handle of a created stream of device 0 for a device-1 buffer
    whose last use (a fill) is pending on device 1: the consumer stream must not run past it
    (cudaStreamWaitEvent: the event may be of another device than the stream)."""
    producer = accel.Stream(1)
    buf = accel.Buffer(4096, device=1, stream=producer)
    buf.fill_(1, stream=producer)
    producer.synchronize()
    gate = hold(producer)
    buf.fill_(7, stream=producer)
    consumer = accel.Stream(0)
    try:
        capsule = buf.__dlpack__(stream=consumer.handle, max_version=(1, 0))
        assert not _query(consumer.handle, 0)
        assert accel.current_device_index() == 0
    finally:
        gate.set()
    producer.synchronize()
    consumer.synchronize()
    imported = accel.from_dlpack(capsule)
    assert (imported.to_numpy() == 7).all()
    imported.close()


def test_from_dlpack_of_device1_with_a_created_device0_stream_orders_it(gated):
    """accel.from_dlpack(device-1 producer, stream=<created stream of device 0>): the producer
    orders its pending work before that stream."""
    producer = accel.Stream(1)
    buf = accel.Buffer(4096, device=1, stream=producer)
    buf.fill_(1, stream=producer)
    producer.synchronize()
    gate = hold(producer)
    buf.fill_(9, stream=producer)
    consumer = accel.Stream(0)
    try:
        imported = accel.from_dlpack(DL(buf), stream=consumer)
        assert not _query(consumer.handle, 0)
    finally:
        gate.set()
    producer.synchronize()
    consumer.synchronize()
    assert imported.device_index == 1
    assert (imported.to_numpy() == 9).all()
    imported.close()


# -- the CUDA Array Interface of a device-1 buffer last used on device 0 ----------------------------
# (r71o found; fixed in session 31)
@pytest.mark.parametrize("last_use", ["device0-copy", "dlpack-consumer"])
def test_cai_of_device1_buffer_last_used_on_device0_default_stream(sim_cuda, last_use):
    """A device-1 buffer whose last use is device 0's legacy default stream (a device-0 buffer's
    copy_from(buf), queued there; a consumer's kernel writing buf must wait for that read).  CAI v3 can only say ``stream: 1`` ("the legacy
    default stream"), which a consumer working on the data's device takes as that device's
    legacy stream -- as accel's own consumer (``_dlpack.wait_for_producer``: 1 is device
    ``index``'s default stream) does.  So a device-1 consumer orders nothing after device 0's
    pending work on the buffer.  (DLPack gets it right: __dlpack__(stream=1) records on device 0's
    stream and waits on device 1's, test_consumer_stream_of_other_device_after_peer_use.)
    The producer must name a stream the consumer can tell apart: e.g. make the current stream of
    the buffer's device wait for the last-use stream and give that one."""
    backend = _lazy.lazy_init()
    buf = _src(1, 64)
    zero = accel.default_stream(0)
    if last_use == "device0-copy":
        accel.Buffer(64).copy_from(buf, non_blocking=True)    # read on device 0's legacy stream
    else:
        buf.__dlpack__(stream=zero, max_version=(1, 0))     # a consumer on device 0's legacy stream
    assert buf.last_stream == zero
    recorded, synced = [], []
    real, real_sync, real_stream_sync = backend.event_record, backend.device_synchronize, backend.stream_synchronize

    def spy(event, stream, *a, **kw):
        recorded.append((backend.get_device(), stream))
        return real(event, stream, *a, **kw)

    def spy_sync(*a, **kw):
        synced.append(backend.get_device())
        return real_sync(*a, **kw)

    def spy_stream_sync(stream, *a, **kw):
        synced.append((backend.get_device(), stream))
        return real_stream_sync(stream, *a, **kw)

    backend.event_record, backend.device_synchronize, backend.stream_synchronize = spy, spy_sync, spy_stream_sync
    try:
        cai = buf.__cuda_array_interface__
        accel.Buffer(64, device=1).copy_from(CAI(cai, buf))
        accel.Buffer(64, device=1).as_array("u1").copy_from(CAI(cai, buf))
    finally:
        del backend.event_record, backend.device_synchronize, backend.stream_synchronize
    # device 0's legacy stream must be waited for (an event recorded on it, by the producer or
    # the consumers, or it or device 0 synchronized: accel's getter waits on the host since r71q,
    # for the stream alone since r72d) before the device-1 consumers' copies
    zero_handle = backend.default_stream(0)
    assert (0, zero_handle) in recorded or 0 in synced or (0, zero_handle) in synced, \
        (cai["stream"], recorded, synced)
    assert cai["stream"] in (1, accel.current_stream(1).handle or 1)


def test_cai_fields_of_a_device1_view_while_device0_current(sim_cuda):
    buf = _src(1, 512)
    view = buf.as_array("<u2", (16, 8), (32, 4))
    cai = view.__cuda_array_interface__
    assert cai["version"] == 3 and cai["data"] == (buf.ptr, False) and cai["strides"] == (32, 4)
    assert cai["shape"] == (16, 8) and cai["typestr"] == "<u2" and cai.get("mask") is None
    s = accel.Stream(1)
    buf.fill_(3, stream=s)
    assert view.__cuda_array_interface__["stream"] == s.handle
    s.synchronize()
    # a device-0 buffer receives it through copy_from (across devices): refused for a strided one
    with pytest.raises(ValueError, match="contiguous"):
        accel.Buffer(view.nbytes).copy_from(CAI(cai, buf))
    assert accel.current_device_index() == 0


# -- imports of device-1 producers into device-0 destinations ---------------------------------------
def test_view_on_device0_refuses_a_device1_dlpack_source_and_frees_nothing(two):
    src = _src(1)
    dst = accel.Buffer(256).as_array("u1")
    before = _settled()
    producer = DL(src)
    with pytest.raises(ValueError, match="device"):
        dst.copy_from(producer)
    assert producer.streams == []           # refused before asking for a capsule
    assert _settled() == before
    # a device-1 capsule (already taken from the producer) cannot be passed to a view: no __dlpack__
    capsule = src.__dlpack__(max_version=(1, 0))
    with pytest.raises(TypeError):
        dst.copy_from(capsule)
    assert D.live_exports() == 1
    del capsule
    assert _settled() == (0, 0)


def test_buffer_on_device0_copies_a_device1_dlpack_source_without_peer_access(two):
    src = _src(1, 256, seed=3)
    dst = accel.Buffer(256)
    dst.copy_from(DL(src))
    assert (dst.to_numpy() == _pattern(256, 3)).all()
    dst2 = accel.Buffer(256)
    dst2.copy_from(DL(src.as_array("u1")))
    assert (dst2.to_numpy() == _pattern(256, 3)).all()
    assert accel.current_device_index() == 0
    assert _settled() == (0, 0)


def test_buffer_on_device0_copies_a_device1_cai_source_without_peer_access(monkeypatch):
    _need("cuda")
    use_sim(monkeypatch, "cuda", ACCEL_SIM_PEER="none")
    src = _src(1, 256, seed=5)
    dst = accel.Buffer(256)
    dst.copy_from(CAI(src.__cuda_array_interface__, src))
    assert (dst.to_numpy() == _pattern(256, 5)).all()
    view = accel.Buffer(256).as_array("u1")
    with pytest.raises(ValueError, match="device"):
        view.copy_from(CAI(src.__cuda_array_interface__, src))
    assert accel.current_device_index() == 0


def test_device1_capsule_after_the_buffer_closed_copies_to_device0(two):
    """The capsule pins the memory: close() leaves it to the deleter; the import (on device 1)
    then copies to device 0 without peer access."""
    src = _src(1, 256, seed=11)
    capsule = src.__dlpack__(max_version=(1, 0))
    src.close()
    imported = accel.from_dlpack(capsule)
    assert imported.device_index == 1
    dst = accel.Buffer(256)
    dst.copy_from(imported)
    assert (dst.to_numpy() == _pattern(256, 11)).all()
    with pytest.raises(BufferError, match="consumed"):
        accel.from_dlpack(capsule)
    imported.close()
    del capsule
    assert _settled() == (0, 0)


def test_device1_capsule_after_the_producer_was_freed(two):
    """The producer object (a typed view of a temporary buffer) is gone: the capsule keeps both."""
    def make():
        b = _src(1, 256, seed=13)
        return b.as_array("u1").__dlpack__(max_version=(1, 0))
    capsule = make()
    gc.collect()
    # a new allocation on device 1 must not reuse the memory the capsule still holds
    other = accel.Buffer(256, device=1)
    other.fill_(0xEE)
    imported = accel.from_dlpack(capsule)
    assert imported.ptr != other.ptr
    out = accel.Buffer(256)
    out.copy_from(imported)
    assert (out.to_numpy() == _pattern(256, 13)).all()
    imported.close()
    del capsule
    assert _settled() == (0, 0)


def test_device1_capsule_consumed_twice_or_by_a_c_consumer_first(two):
    src = _src(1)
    capsule = src.__dlpack__(max_version=(1, 0))
    first = accel.from_dlpack(capsule)
    with pytest.raises(BufferError, match="consumed"):
        accel.from_dlpack(capsule)
    with pytest.raises(BufferError, match="consumed"):
        accel.Buffer(256, device=1).as_array("u1").copy_from(_Wrapped(capsule, (src.__dlpack_device__())))
    first.close()
    del capsule
    assert _settled() == (0, 0)


class _Wrapped:
    """A producer whose __dlpack__ hands out one fixed capsule (a broken producer)."""

    def __init__(self, capsule, device):
        self.capsule, self.device = capsule, device

    def __dlpack__(self, **kw):
        return self.capsule

    def __dlpack_device__(self):
        return self.device


def test_producer_lying_about_its_device_is_refused(two):
    """__dlpack_device__ says device 1, the capsule describes device 0 memory (or the other way):
    a device-1 view refuses it and the capsule's deleter still runs (nothing taken)."""
    zero = _src(0)
    capsule = zero.__dlpack__(max_version=(1, 0))
    kind = zero.__dlpack_device__()[0]
    dst = accel.Buffer(256, device=1).as_array("u1")
    with pytest.raises(ValueError, match="describes device"):
        dst.copy_from(_Wrapped(capsule, (kind, 1)))
    assert D.live_exports() == 1           # not taken: the producer's destructor frees it
    del capsule
    assert _settled() == (0, 0)
    assert (dst.to_numpy() == 0).all()


def test_buffer_copy_from_a_producer_lying_about_its_device(two):
    """Buffer.copy_from: __dlpack_device__ says device 0, the capsule is device 1's: the copy must
    still read device 1's memory correctly (from_dlpack wraps by the capsule's device)."""
    one = _src(1, 256, seed=17)
    kind = one.__dlpack_device__()[0]
    dst = accel.Buffer(256)
    dst.copy_from(_Wrapped(one.__dlpack__(max_version=(1, 0)), (kind, 0)))
    assert (dst.to_numpy() == _pattern(256, 17)).all()
    assert _settled() == (0, 0)


# -- host producers and consumers: torch CPU and numpy, pinned memory -------------------------------
def test_torch_cpu_and_numpy_sources_into_device1_while_device0_current(two):
    t = torch.arange(256, dtype=torch.int32).reshape(16, 16)
    buf = accel.Buffer(1024, device=1)
    buf.copy_from(t)
    assert (buf.to_numpy(np.int32) == np.arange(256)).all()
    view = accel.Buffer(1024, device=1).as_array("i4", (16, 16))
    view.copy_from(t.T)                                      # strided torch CPU producer
    assert (view.to_numpy() == t.T.numpy()).all()
    with pytest.raises(ValueError):
        buf.copy_from(t.T)                                   # Buffer.copy_from needs contiguous bytes
    pinned = accel.empty_pinned((16, 16), np.int32)
    pinned[:] = np.arange(256, dtype=np.int32).reshape(16, 16) * 2
    view.copy_from(torch.from_dlpack(pinned))                # pinned host memory through torch
    assert (view.to_numpy() == pinned).all()
    # device memory is not host memory: numpy asks for a host copy (copy=None), which accel makes
    # since session 39 (r80b; the array API: "copy otherwise")
    assert (np.from_dlpack(buf, device="cpu") == buf.to_numpy()).all()
    assert (np.from_dlpack(view, device="cpu") == view.to_numpy()).all()
    assert accel.current_device_index() == 0
    assert _settled() == (0, 0)


def test_device1_data_to_torch_via_pinned_host(two):
    src = _src(1, 256, seed=19)
    pinned = accel.empty_pinned(256)
    src.copy_to(pinned, non_blocking=True)
    accel.synchronize(1)
    t = torch.from_dlpack(pinned)
    assert t.data_ptr() == pinned.ctypes.data
    assert (t.numpy() == _pattern(256, 19)).all()


# -- kernels launched with device-1 buffers while device 0 is current --------------------------------
def test_launch_with_an_imported_device1_buffer(monkeypatch):
    _need("cuda")
    use_sim(monkeypatch, "cuda", ACCEL_SIM_PEER="none")
    from accel import sim
    from test_user_kernels import SAXPY_PTX, saxpy_reference
    sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64")
    try:
        n = 64
        x = accel.Buffer(4 * n, device=1).copy_from(np.arange(n, dtype=np.float32))
        y = accel.Buffer(4 * n, device=1).copy_from(np.ones(n, np.float32))
        xi, yv = accel.from_dlpack(x), accel.from_dlpack(DL(y.as_array("f4")))
        k1 = accel.Module(SAXPY_PTX, device=1).function("saxpy")
        accel.launch(k1, 1, n, np.float32(2.0), xi, yv, n)
        assert accel.current_device_index() == 0
        assert (y.to_numpy(np.float32) == 2 * np.arange(n, dtype=np.float32) + 1).all()
        k0 = accel.Module(SAXPY_PTX, device=0).function("saxpy")
        with pytest.raises(ValueError, match="device"):
            accel.launch(k0, 1, n, np.float32(2.0), xi, yv, n)
        with pytest.raises(ValueError, match="device"):
            accel.launch(k0, 1, n, np.float32(2.0), x.as_array("f4"), yv, n)
        xi.close()
        yv.close()
    finally:
        sim.unregister_kernel("saxpy")


# -- imports ordered after a device-1 producer's pending work (gate released by a timer) -----------
def _pending(value):
    """A device-1 buffer whose fill of ``value`` is queued behind a gate on a created stream of
    device 1 (not the current stream of any device); the gate opens 0.2 s later, so a consumer
    that is not ordered after the fill reads the old bytes (1) and one that is reads ``value``."""
    import threading
    producer = accel.Stream(1)
    buf = accel.Buffer(4096, device=1, stream=producer)
    buf.fill_(1, stream=producer)
    producer.synchronize()
    gate = hold(producer)
    buf.fill_(value, stream=producer)
    timer = threading.Timer(0.2, gate.set)
    timer.start()
    return buf, timer


@pytest.mark.parametrize("how", ["buffer-dlpack", "buffer-cai", "view-dlpack-dev1", "from_dlpack",
                                 "from_dlpack-stream0", "buffer-dlpack-stream0"])
def test_device1_producer_pending_work_is_waited_for(gated, how):
    buf, timer = _pending(7)
    try:
        if how == "buffer-dlpack":
            out = accel.Buffer(4096).copy_from(DL(buf)).to_numpy()
        elif how == "buffer-cai":
            out = accel.Buffer(4096).copy_from(CAI(buf.__cuda_array_interface__, buf)).to_numpy()
        elif how == "view-dlpack-dev1":
            s = accel.Stream(1)
            view = accel.Buffer(4096, device=1).as_array("u1")
            view.copy_from(DL(buf.as_array("u1")), stream=s)
            out = view.to_numpy(stream=s)
        elif how == "buffer-dlpack-stream0":
            s = accel.Stream(0)
            out = accel.Buffer(4096).copy_from(DL(buf), stream=s).to_numpy(stream=s)
        else:
            kw = {"stream": accel.Stream(0)} if how == "from_dlpack-stream0" else {}
            imported = accel.from_dlpack(DL(buf), **kw)
            out = accel.Buffer(4096).copy_from(imported, stream=kw.get("stream")).to_numpy(stream=kw.get("stream")) \
                if kw else imported.to_numpy()
            imported.close()
    finally:
        timer.join()
    accel.synchronize(1)
    assert (out == 7).all(), np.unique(out)
    assert accel.current_device_index() == 0


def test_xpu_consumer_stream_of_device0_for_a_device1_buffer(monkeypatch):
    _need("xpu")
    use_sim(monkeypatch, "xpu", ACCEL_SIM_PEER="none")
    src = _src(1, 256, seed=23)
    s0 = accel.Stream(0)
    imported = accel.from_dlpack(DL(src), stream=s0)
    assert imported.device_index == 1
    out = accel.Buffer(256).copy_from(imported, stream=s0)
    assert (out.to_numpy(stream=s0) == _pattern(256, 23)).all()
    capsule = src.__dlpack__(stream=s0, max_version=(1, 0))
    with pytest.raises(ValueError, match="stream"):
        src.__dlpack__(stream=s0.handle if s0.handle not in (-1,) else 5, max_version=(1, 0))
    del capsule
    imported.close()
    assert _settled() == (0, 0)


# (r71o found; fixed in session 31)
def test_view_copy_from_a_torch_bfloat16_tensor_is_refused_clearly(two):
    t = torch.ones(128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        accel.Buffer(256, device=1).copy_from(t)
    view = accel.Buffer(256, device=1).as_array("u2")
    with pytest.raises(TypeError, match="bfloat16"):
        view.copy_from(t)


def test_imported_device1_buffer_written_from_device0_without_peer(two):
    one = accel.Buffer(256, device=1)
    zero = accel.Buffer(256).copy_from(_pattern(256, 29))
    imported = accel.from_dlpack(DL(one.as_array("u1")))
    imported.copy_from(zero)                        # device 1 reads device 0's memory: staged
    assert (one.to_numpy() == _pattern(256, 29)).all()
    with pytest.raises(ValueError, match="device"):
        imported.as_array("u1").copy_from(zero.as_array("u1"))
    with pytest.raises(TypeError, match="PyCapsule"):
        accel.Buffer(256).copy_from(one.__dlpack__(max_version=(1, 0)))
    imported.close()
    assert accel.current_device_index() == 0
    assert _settled() == (0, 0)


class _Claims:
    """A broken producer: a capsule over ``buf``'s memory that claims device ``index``
    (__dlpack_device__ and the capsule's DLDevice agree, the memory does not)."""

    def __init__(self, buf, index):
        self.buf, self.index, self.kind = buf, index, buf.__dlpack_device__()[0]

    def __dlpack__(self, **kw):
        return D.export(self.buf, self.buf.ptr, self.kind, self.index, np.uint8, (self.buf.nbytes,), None, 0,
                        versioned=True)

    def __dlpack_device__(self):
        return self.kind, self.index


def test_buffer_and_from_dlpack_refuse_device0_memory_claimed_as_device1(two):
    """from_dlpack and Buffer.copy_from check where the memory is (pointer_location) and refuse."""
    zero = _src(0)
    with pytest.raises(ValueError, match="device memory of .*:0"):
        accel.from_dlpack(_Claims(zero, 1))
    with pytest.raises(ValueError, match="device memory of .*:0"):
        accel.Buffer(256, device=1).copy_from(_Claims(zero, 1))
    assert _settled() == (0, 0)
    if two == "cuda":                       # the CAI path of a view checks it too
        cai = dict(zero.__cuda_array_interface__)
        with pytest.raises(ValueError, match="device"):
            accel.Buffer(256, device=1).as_array("u1").copy_from(CAI(cai, zero))
    assert (accel.Buffer(256, device=1).fill_(3).to_numpy() == 3).all()      # the device is healthy


# (r71o found; fixed in session 31)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")       # "could not make device 0 current again" after the fault
def test_view_refuses_device0_memory_claimed_as_device1(two):
    zero = _src(0)
    view = accel.Buffer(256, device=1).as_array("u1")
    with pytest.raises(ValueError, match="device"):
        view.copy_from(_Claims(zero, 1))
    assert _settled() == (0, 0)
    assert (accel.Buffer(256, device=1).fill_(3).to_numpy() == 3).all()      # the device is healthy


def test_read_only_device1_import_while_device0_current(two):
    """A versioned capsule with DLPACK_FLAG_BITMASK_READ_ONLY over device-1 memory: the import is
    read-only everywhere (writes refused, legacy re-export refused, versioned re-export flagged),
    and reads copy across devices without peer access."""
    one = _src(1, 256, seed=31)
    kind = one.__dlpack_device__()[0]
    ro = accel.from_dlpack(D.export(one, one.ptr, kind, 1, np.uint8, (256,), None, 0, versioned=True,
                                    readonly=True))
    assert ro.readonly and ro.device_index == 1
    if two == "cuda":
        assert ro.__cuda_array_interface__["data"] == (one.ptr, True)
        assert ro.as_array("u1").__cuda_array_interface__["data"][1] is True
    with pytest.raises(BufferError, match="legacy"):
        ro.__dlpack__()
    again = accel.from_dlpack(ro)
    assert again.readonly
    for write in (lambda: ro.copy_from(np.zeros(256, np.uint8)), lambda: ro.fill_(1),
                  lambda: ro.as_array("u1").copy_from(np.zeros(256, np.uint8)),
                  lambda: again.copy_from(accel.Buffer(256))):
        with pytest.raises(ValueError, match="read-only"):
            write()
    assert (accel.Buffer(256).copy_from(ro).to_numpy() == _pattern(256, 31)).all()
    again.close()
    ro.close()
    assert (one.to_numpy() == _pattern(256, 31)).all()
    assert _settled() == (0, 0)


def test_import_released_after_its_use_streams_of_both_devices_closed(two):
    """An import of a device-1 buffer used on a created stream of device 0 (a copy out) and one of
    device 1 (a fill), both closed before the import is closed or collected: the deleter runs
    once, after the work, and the memory holds the last write."""
    one = accel.Buffer(256, device=1).fill_(4)
    imported = accel.from_dlpack(one)
    s0, s1 = accel.Stream(0), accel.Stream(1)
    out = accel.Buffer(256, stream=s0)
    out.copy_from(imported, stream=s0, non_blocking=True)
    imported.fill_(5, stream=s1)
    s0.close()
    s1.close()
    imported.close()
    assert D.live_exports() == 0
    assert (out.to_numpy() == 4).all() and (one.to_numpy() == 5).all()
    again = accel.from_dlpack(DL(one.as_array("u1")))
    s2 = accel.Stream(1)
    again.fill_(6, stream=s2)
    s2.close()
    del again
    assert _settled() == (0, 0)
    assert (one.to_numpy() == 6).all()
