"""r72f: accel's interop audited against the specs, past what r63c, test_dlpack, the adversarial
file and r71o pin: real-library consumers and producers of host memory (numpy 2.x, torch 2.13
CPU), pinned memory, zero-size and strided host sources, capsule lifetime from a native thread,
and the stream obligations the CUDA Array Interface v3 puts on consumers and producers.

Spec text relied on (quoted where used):
- CUDA Array Interface v3 (numba-cuda docs/source/user/cuda_array_interface.rst), "Interface
  Requirements": a consumer that "synchronizes on the provided stream prior to accessing the
  data ... must ensure that no computation can take place in the provided stream until its
  operations in its own choice of stream have taken place" (an event waited on in the provided
  stream, or not returning before its own operations completed); a producer must ensure that
  "if there is work on the data enqueued in one or more streams, then synchronization on the
  provided stream is sufficient to ensure synchronization with all pending work ... If the
  Producer has enqueued work on the data on multiple streams, then it must enqueue events on
  those streams that follow the enqueued work, and then wait on those events in the provided
  stream"; ``stream``: "None or integer".
- array API ``array.__dlpack__``: "stream is provided by the consumer to the producer to
  instruct the producer to ensure that operations can safely be performed on the array".
- dlpack python_spec.rst: "The DLManagedTensor deleter must ensure that sharing beyond Python
  boundaries is possible, this means that the GIL must be acquired explicitly"; the consumer
  renames the capsule "used_dltensor[_versioned]" and calls the deleter when done.

Every accel bug is a strict xfail naming the accel function.  Device 1 is used while device 0
stays current (Metal has one device: 0).  Gated streams (tests/torch_port_util.hold) show
ordering with stream queries; nothing is timed.
"""

import ctypes
import gc
import time

import numpy as np
import pytest

import accel
from accel import _dlpack as D
from accel import streams as _streams

from conftest import SIMS, use_sim
from torch_port_util import hold

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.usefixtures("frozen_module_heap")


@pytest.fixture(params=[("cuda", 1), ("xpu", 1), ("mps", 0)], ids=lambda p: f"{p[0]}:{p[1]}")
def dev(request, monkeypatch):
    kind, index = request.param
    if kind not in SIMS:
        pytest.skip(f"ACCEL_TEST_SIMS leaves out {kind}")
    use_sim(monkeypatch, kind)
    return kind, index


@pytest.fixture
def gated_cuda(monkeypatch):
    if "cuda" not in SIMS:
        pytest.skip("ACCEL_TEST_SIMS leaves out cuda")
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=50)
    return 1


class HostDL:
    """A host DLPack producer that is not a numpy array (as a JAX or CuPy-pinned array would be)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kw):
        return self.array.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


class CAI:
    """A CUDA Array Interface v3 producer over ``buf`` whose pending work is on ``stream``."""

    def __init__(self, buf, stream):
        self.buf, self.stream = buf, stream

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.buf.nbytes,), "typestr": "|u1", "data": (self.buf.ptr, False), "version": 3,
                "strides": None, "stream": self.stream}


def _query(handle, index):
    backend = accel._lazy.lazy_init()
    with _streams.on_device(backend, index):
        return backend.stream_query(handle)


def _live():
    gc.collect()
    return D.live_exports(), len(D._capsules)


# == zero-size host sources ========================================================================
_ZERO_SOURCES = {
    "numpy(0,3)": lambda: np.zeros((0, 3), np.float32),
    "numpy(3,0)": lambda: np.zeros((3, 0), np.float32),
    "torch(0,3)": lambda: torch.zeros(0, 3),
    "hostDLPack(0,3)": lambda: HostDL(np.zeros((0, 3), np.float32)),
    "pinned(0,3)": lambda: accel.empty_pinned((0, 3), np.float32),
}


# (r72f found; fixed in session 32)
@pytest.mark.parametrize("source", list(_ZERO_SOURCES))
def test_buffer_copy_from_zero_size_multidim_host_source(dev, source):
    """A zero-size source into a zero-byte Buffer is a no-op, whatever its shape: copy_to, a 1-D
    zero-size source and ArrayView.copy_from already treat it so (checked first).  The torch
    tensor and the host DLPack object reach the same path through numpy.from_dlpack."""
    kind, index = dev
    buf = accel.Buffer(0, device=index)
    buf.copy_from(np.zeros(0, np.float32))
    buf.copy_to(np.empty((0, 3), np.float32))
    buf.as_array(np.float32, (0, 3)).copy_from(np.zeros((0, 3), np.float32))
    src = _ZERO_SOURCES[source]()
    buf.copy_from(src, non_blocking=source.startswith("pinned"))
    assert accel.current_device_index() == 0


# (r72f found; fixed in session 32)
def test_view_copy_from_zero_size_multidim_bytes_like(dev):
    kind, index = dev
    view = accel.Buffer(16, device=index).as_array(np.float32, (0, 3))
    view.copy_from(memoryview(np.zeros((0, 3), np.float32)))


# == CUDA Array Interface v3: the consumer's obligation ===========================================
def producer_ran_past_the_copy(queue_copy, src, producer, consumer) -> bool:
    """With ``consumer`` held (torch_port_util.hold), ``queue_copy()`` queues a non-blocking copy
    of ``src`` there; then the producer's next work on its own stream overwrites ``src`` (9).
    Whether ``producer`` ran it before the held copy (a bounded wait for what must not happen);
    the consumer is let go and both streams are synchronized before returning."""
    gate = hold(consumer)
    try:
        queue_copy()
        src.fill_(9, stream=producer)             # the producer's next work on its own stream
        deadline = time.monotonic() + 1.0
        while not producer.query() and time.monotonic() < deadline:
            time.sleep(0.001)
        overwritten_first = producer.query()
    finally:
        gate.set()
    consumer.synchronize()
    producer.synchronize()
    return overwritten_first



# (r72f found; fixed in session 32)
def test_cai_consumer_non_blocking_copy_orders_the_producer_stream_after_it(gated_cuda):
    """CAI v3: a consumer that synchronizes on the provided stream "must ensure that no computation
    can take place in the provided stream until its operations in its own choice of stream have
    taken place".  accel's copy_from waits for the producer's stream (P), queues the copy on its
    own stream (C, held here) and, with non_blocking=True, returns; nothing keeps P from running
    the producer's next write, so the copy reads the new bytes (9), not the exported ones (1)."""
    index = gated_cuda
    producer, consumer = accel.Stream(index), accel.Stream(index)
    src = accel.Buffer(256, device=index, stream=producer).fill_(1, stream=producer)
    dst = accel.Buffer(256, device=index, stream=consumer).fill_(0, stream=consumer)
    producer.synchronize()
    consumer.synchronize()
    overwritten_first = producer_ran_past_the_copy(
        lambda: dst.copy_from(CAI(src, producer.handle), stream=consumer, non_blocking=True),
        src, producer, consumer)
    assert accel.current_device_index() == 0
    assert not overwritten_first, "the producer's stream ran past the consumer's pending copy"
    assert set(dst.to_numpy().tolist()) == {1}


def test_cai_consumer_blocking_copy_and_view_copy_read_the_exported_bytes(gated_cuda):
    """The same handshake, blocking (the default) and through ArrayView.copy_from (always blocking):
    control returns only after the copy ran, which the spec accepts."""
    index = gated_cuda
    producer = accel.Stream(index)
    src = accel.Buffer(256, device=index, stream=producer)
    src.fill_(1, stream=producer)
    gate = hold(producer)
    src.fill_(2, stream=producer)                 # pending behind the gate
    dst = accel.Buffer(256, device=index)
    view = accel.Buffer(256, device=index).as_array(np.uint8)
    gate.set()
    dst.copy_from(CAI(src, producer.handle))
    view.copy_from(CAI(src, producer.handle))
    src.fill_(9, stream=producer)
    producer.synchronize()
    assert set(dst.to_numpy().tolist()) == {2} and set(view.to_numpy().tolist()) == {2}


# (r72f found; fixed in session 32)
def test_view_copy_from_cai_stream_as_numpy_integer(gated_cuda):
    """CAI v3 ``stream``: "None or integer" -- Buffer.copy_from reads it through ``__index__``
    (checked first); the typed view's copy refuses the same dict with ValueError."""
    index = gated_cuda
    side = accel.Stream(index)
    src = accel.Buffer(64, device=index).fill_(3)
    accel.Buffer(64, device=index).copy_from(CAI(src, np.int64(side.handle)))
    view = accel.Buffer(64, device=index).as_array(np.uint8)
    view.copy_from(CAI(src, np.int64(side.handle)))
    assert set(view.to_numpy().tolist()) == {3}


# (r72f found; fixed in session 32)
def test_view_copy_from_cai_with_the_default_descr(gated_cuda):
    """CAI v3 ``descr``: "This follows the same specification as in the NumPy array interface",
    where descr defaults to ``[('', typestr)]`` -- the default and an absent descr mean the same
    type.  CuPy's ``__cuda_array_interface__`` always includes ``'descr': self.dtype.descr``; for a
    ``V8`` array that is ``[('', '|V8')]``.  Without the key the copy works (checked first)."""
    index = gated_cuda
    src = accel.Buffer(64, device=index).fill_(5)

    class Void:
        def __init__(self, descr):
            self.descr = descr

        @property
        def __cuda_array_interface__(self):
            cai = {"shape": (8,), "typestr": "|V8", "data": (src.ptr, False), "version": 3, "strides": None,
                   "stream": None}
            if self.descr is not None:
                cai["descr"] = self.descr
            return cai

    assert np.zeros(1, "V8").__array_interface__["descr"] == [("", "|V8")]
    view = accel.Buffer(64, device=index).as_array("V8")
    view.copy_from(Void(None))
    view.copy_from(Void([("", "|V8")]))
    assert set(view.to_numpy().view(np.uint8).tolist()) == {5}


# == the producer's obligation: every stream with pending work =====================================
# (r72f found; fixed in session 34)
@pytest.mark.parametrize("how", ["cai", "dlpack"])
def test_exported_stream_covers_pending_work_on_every_stream(gated_cuda, how):
    """CAI v3: "If the Producer has enqueued work on the data on multiple streams, then it must
    enqueue events on those streams that follow the enqueued work, and then wait on those events in
    the provided stream"; array API ``__dlpack__``: the producer ensures "that operations can safely
    be performed on the array".  The buffer is read on stream A (held) and then on stream B: B
    becomes the last-use stream, and the stream handed to the consumer does not wait for A's
    pending read, so a consumer writing the buffer there overwrites it under that read."""
    index = gated_cuda
    a, b, consumer = accel.Stream(index), accel.Stream(index), accel.Stream(index)
    buf = accel.Buffer(256, device=index).fill_(1)
    accel.synchronize(index)
    out_a, out_b = accel.Buffer(256, device=index), accel.Buffer(256, device=index)
    gate = hold(a)
    try:
        out_a.copy_from(buf, stream=a, non_blocking=True)     # a read of buf, pending on A
        out_b.copy_from(buf, stream=b, non_blocking=True)     # a read of buf on B
        b.synchronize()
        assert buf.last_stream == b
        if how == "cai":
            handle = buf.__cuda_array_interface__["stream"]
        else:
            buf.__dlpack__(stream=consumer.handle, max_version=(1, 0))     # (dropped unconsumed)
            handle = consumer.handle
        waits_for_a = not _query(handle, index)
    finally:
        gate.set()
    accel.synchronize(index)
    assert accel.current_device_index() == 0
    assert waits_for_a, "the consumer's stream does not wait for the read still pending on stream A"


# (r72f found; fixed in session 34)
def test_cai_exported_stream_outlives_a_close_while_the_buffer_lives(gated_cuda):
    """CAI v3, "Lifetime management" > "Streams": "it is therefore required that a Producer exporting
    data on the interface with an associated stream ensures that the exported stream's lifetime is
    equal to or surpasses the lifetime of the object from which the interface was exported."  Numba
    keeps the provided stream as the imported array's default stream for its later transfers, so
    the handle is used after the export.  accel exports its last-use stream S; S.close() destroys
    it at once (the Buffer still alive), and the next Stream gets the same handle: the consumer's
    later work is ordered on an unrelated stream.  (Reading the interface after the close is
    handled: test_interop_adversarial's test_cuda_array_interface_after_the_last_use_stream_was_closed.)"""
    index = gated_cuda
    side = accel.Stream(index)
    buf = accel.Buffer(64, device=index, stream=side).fill_(1, stream=side)
    handle = buf.__cuda_array_interface__["stream"]
    assert handle == side.handle
    side.close()
    later = accel.Stream(index)
    try:
        buf.fill_(2)                              # the exported object is alive and usable
        assert later.handle != handle, "the exported stream handle now names a stream made after the export"
    finally:
        later.close()
        buf.close()


# == kDLMetal: what ``data`` holds ==================================================================
def _mtl_buffer_id(ptr):
    """The id<MTLBuffer> of the allocation holding accel's Metal pointer ``ptr``, and the offset."""
    import _cffi_backend
    block, offset = accel._lazy.lazy_init()._resolve(ptr, 1)
    return int(_cffi_backend.FFI().cast("uintptr_t", block.obj)), offset


# (r72f found; fixed in session 34)
@pytest.mark.parametrize("side", ["export", "import"])
def test_metal_capsule_data_is_the_mtlbuffer_handle(monkeypatch, side):
    """dlpack.h DLTensor.data: "This will be CUDA device pointer or cl_mem handle in OpenCL. It may be
    opaque on some device types"; "The byte_offset field should be used to point to the beginning
    of the data".  For kDLMetal the libraries that exchange Metal memory take it as an opaque
    id<MTLBuffer>: torch's MPS kernels read a tensor's storage as ``__builtin_bit_cast(id<MTLBuffer>,
    tensor.storage().data())`` (aten/src/ATen/native/mps/OperationUtils.h getMTLBufferStorage), and
    torch 2.13's from_dlpack of a kDLMetal capsule makes an MPS tensor over DLTensor.data (even
    the CPU build here, checked below).  accel
    hands out the contents address of a shared MTLBuffer as its "device pointer" (accel/backends/
    mps/memory.py) and exports that: a torch/MLX/TVM consumer on a Mac would message it as an
    Objective-C object.  NB: r63c's test_producer_capsule_fields asserts ``data + byte_offset ==
    buf.ptr + offset`` on mps too; a fix changes that expectation for Metal."""
    if "mps" not in SIMS:
        pytest.skip("ACCEL_TEST_SIMS leaves out mps")
    use_sim(monkeypatch, "mps")
    buf = accel.Buffer(64)
    view = buf.as_array(np.uint8, (48,), offset=16)
    handle, offset = _mtl_buffer_id(view.ptr)
    assert offset == 16 and handle != buf.ptr
    capsule = view.__dlpack__(max_version=(1, 0))
    if side == "export":
        t = torch.from_dlpack(view)
        assert t.device.type == "mps"               # torch 2.13 (CPU build) takes kDLMetal capsules
        del t
        info = D.parse(capsule)
        assert (info.device_type, info.data, info.byte_offset) == (8, handle, 16)
    else:
        tensor = D.DLManagedTensorVersioned.from_address(D.parse(capsule).address).dl_tensor
        tensor.data, tensor.byte_offset = handle, 16                   # torch's form of the same bytes
        imported = accel.from_dlpack(capsule)
        assert (imported.ptr, imported.nbytes) == (view.ptr, 48)
        imported.close()


# == capsule lifetime ==============================================================================
def test_deleter_called_from_a_native_thread(dev):
    """python_spec: the deleter "must ensure that sharing beyond Python boundaries is possible, this
    means that the GIL must be acquired explicitly".  A C consumer takes accel's capsule (renames it
    used_dltensor_versioned) and calls the deleter from a thread Python never saw (pthread_create):
    the export is released once, the capsule's later destruction does nothing, the Buffer frees."""
    kind, index = dev
    libc = ctypes.CDLL(None)
    buf = accel.Buffer(64, device=index)
    before = _live()
    for versioned, name, used in ((True, D.NAME_VERSIONED, D.USED_NAME_VERSIONED), (False, D.NAME, D.USED_NAME)):
        capsule = buf.__dlpack__(max_version=(1, 0) if versioned else None)
        address = D._PyCapsule_GetPointer(capsule, name)
        managed = (D.DLManagedTensorVersioned if versioned else D.DLManagedTensor).from_address(address)
        assert D._PyCapsule_SetName(capsule, used) == 0
        tid = ctypes.c_ulong()
        assert libc.pthread_create(ctypes.byref(tid), None, ctypes.c_void_p(managed.deleter),
                                   ctypes.c_void_p(address)) == 0
        assert libc.pthread_join(tid, None) == 0
        assert D.live_exports() == before[0]
        del capsule, managed
    assert _live() == before
    buf.close()
    assert accel.memory_stats(index)["allocated_bytes.all.current"] == 0


def test_pinned_memory_shared_with_numpy_and_torch_consumers(dev):
    """numpy.from_dlpack and torch.from_dlpack of an accel.empty_pinned array take numpy's kDLCPU
    capsule (zero copy); the pinned block goes back to accel's host cache only when the last of the
    array and its consumers is gone, and a non_blocking upload from the torch view of it runs from
    the pinned block (the copy reads what was written)."""
    kind, index = dev
    stats = accel.memory.host_memory_stats

    def active():
        gc.collect()
        return stats().get("active_bytes.current", 0)

    base = active()
    pinned = accel.empty_pinned((4,), np.float32)
    pinned[:] = [1, 2, 3, 4]
    t, n = torch.from_dlpack(pinned), np.from_dlpack(pinned)
    assert t.data_ptr() == n.ctypes.data == pinned.ctypes.data
    del pinned
    assert active() == base + 16
    buf = accel.Buffer(16, device=index)
    buf.copy_from(t, non_blocking=True)
    accel.synchronize(index)
    assert (buf.to_numpy("float32") == [1, 2, 3, 4]).all()
    del t
    assert active() == base + 16
    del n
    assert active() == base
    assert accel.current_device_index() == 0


def test_host_dlpack_sources_into_views(dev):
    """Host DLPack producers (numpy through a non-numpy wrapper, torch CPU) with negative strides,
    read-only memory, bool, complex, 0-d and zero-size shapes copy their values into a typed view
    of device 1; nothing is left exported."""
    kind, index = dev
    before = _live()
    ro = np.arange(6, dtype=np.complex64) * (1 - 2j)
    ro.flags.writeable = False
    sources = [np.arange(12, dtype=np.float32).reshape(3, 4)[::-1, ::-2], ro, np.array([True, False, True]),
               np.array(3.5), np.zeros((0, 3), np.int16)]
    for array in sources:
        for src in (HostDL(array), torch.from_dlpack(array) if array.strides == tuple(abs(s) for s in array.strides)
                    and array.flags.writeable else HostDL(array)):
            view = accel.Buffer(max(array.nbytes, 1), device=index).as_array(array.dtype, array.shape)
            view.copy_from(src)
            assert np.array_equal(view.to_numpy(), array)
    assert _live() == before
    assert accel.current_device_index() == 0


# == dl_device=kDLCPU with copy=True: the one cross-device export the standard asks for =============
# (r72f found; fixed in session 33)
def test_numpy_from_dlpack_with_device_cpu_and_copy_true(dev):
    """array API ``__dlpack__``: "The v2023.12 standard only mandates that a compliant library should
    offer a way for __dlpack__ to return a capsule referencing an array whose underlying memory is
    accessible to the Python interpreter (represented by the kDLCPU enumerator in DLPack)"; ``copy``:
    "If True, the function must always copy (performed by the producer)" and "When a copy happens,
    the DLPACK_FLAG_BITMASK_IS_COPIED flag must be set".  numpy 2.x asks exactly that for
    ``from_dlpack(x, device="cpu", copy=True)``; accel refuses every copy (a "should", not a
    "must": the lowest-ranked finding here).  copy=None keeps refusing (r63c's rule stands)."""
    kind, index = dev
    view = accel.Buffer(24, device=index).as_array(np.float32, (2, 3))
    view.copy_from(np.arange(6, dtype=np.float32).reshape(2, 3))
    before = _live()
    host = np.from_dlpack(view, device="cpu", copy=True)
    assert host.shape == (2, 3) and (host == np.arange(6).reshape(2, 3)).all()
    del host
    assert _live() == before
