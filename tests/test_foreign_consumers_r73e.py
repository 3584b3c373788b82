"""r73e: accel as a producer and a consumer against faithful models of real foreign libraries.

No CuPy or Numba here: each fake library below does exactly what its documentation (and its
source, where the docs are silent) says, through the simulated CUDA runtime's own entry points
(``backend.lib.cuda*``, return codes checked as a C caller would), never through accel's API.

Spec text relied on:
- CUDA Array Interface v3 (numba-cuda docs/source/user/cuda_array_interface.rst):
  ``stream``: "An optional stream upon which synchronization must take place at the point of
  consumption, either by synchronizing on the stream or enqueuing operations on the data on the
  given stream ... 1: the legacy default stream ... any other integer: a cudaStream_t pointer".
  Synchronization: "If the Producer has enqueued work on the data on multiple streams, then it
  must enqueue events on those streams that follow the enqueued work, and then wait on those
  events in the provided stream."  Lifetime management > Streams: "it is therefore required that
  a Producer exporting data on the interface with an associated stream ensures that the exported
  stream's lifetime is equal to or surpasses the lifetime of the object from which the interface
  was exported."
- Numba (numba.cuda.api.from_cuda_array_interface / as_cuda_array): reads the interface once;
  ``owner=obj`` keeps the exporter alive; a ``stream`` becomes the array's stream
  (``external_stream(ptr)``), synchronized at import when ``sync`` (CUDA_ARRAY_INTERFACE_SYNC);
  later transfers and ``arr[...] = v`` without a stream argument run on the array's stream.
- CuPy (cupy/_core/core.pyx, _convert_object_with_cuda_array_interface): with CAI v3 and
  CUPY_CUDA_ARRAY_INTERFACE_SYNC (default on) ``runtime.streamSynchronize(stream_ptr)`` before
  use; as a producer CuPy exports ``stream`` = the *current device's* current stream
  (``stream_module.get_current_stream_ptr()``), which need not be the data's device.
- array API ``array.__dlpack__(*, stream=None, ...)``: "stream is provided by the consumer to the
  producer to instruct the producer to ensure that operations can safely be performed on the
  array"; dlpack python_spec.rst: the consumer renames the capsule "used_dltensor[_versioned]"
  and calls the deleter when it no longer needs the tensor (from any thread), or never (a capsule
  dropped unconsumed is deleted by its destructor).

Orderings are made observable with gates (tests/torch_port_util.hold, ACCEL_SIM_DELAY_US): a held
stream runs nothing until its gate is set; no assert depends on timing.  Device 1 is the data's
device throughout while device 0 stays accel's current device.  accel bugs are strict xfails
naming the accel function.
"""

import ctypes
import gc
import threading

import numpy as np
import pytest

import accel
from accel import _dlpack as D
from accel import streams as _streams

from conftest import SIMS, use_sim
from torch_port_util import HOLD_LIMIT_S, hold

DEV = 1         # the data's device; accel's current device stays 0
N = 256


@pytest.fixture
def cuda(monkeypatch):
    if "cuda" not in SIMS:
        pytest.skip("ACCEL_TEST_SIMS leaves out cuda")
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=50)
    accel.set_device_index(0)
    return accel._lazy.lazy_init()


# == the foreign runtime calls (what a C library linked to libcudart does) ========================
def _rt():
    return accel._lazy.lazy_init()


def _s(handle):
    return _rt().ffi.cast("cudaStream_t", handle)


def _ok(rc, call):
    assert rc == 0, f"{call} returned {rc}"


def raw_stream_create(device):
    """A stream the foreign library creates (cudaStreamCreateWithFlags(NonBlocking)) on ``device``."""
    be = _rt()
    with _streams.on_device(be, device):
        p = be.ffi.new("cudaStream_t *")
        _ok(be.lib.cudaStreamCreateWithFlags(p, 1), "cudaStreamCreateWithFlags")
    return int(be.ffi.cast("uintptr_t", p[0]))


def raw_stream_destroy(handle):
    _ok(_rt().lib.cudaStreamDestroy(_s(handle)), "cudaStreamDestroy")


def raw_hold(handle):
    """hold() for a stream accel does not wrap: an operation that runs until the gate is set."""
    from accel.sim import cudart
    gate = threading.Event()
    cudart._R.streams[handle].q.submit(lambda: gate.wait(HOLD_LIMIT_S))
    return gate


def raw_memset(ptr, value, nbytes, handle):
    _ok(_rt().lib.cudaMemsetAsync(_rt().ffi.cast("void *", ptr), value, nbytes, _s(handle)), "cudaMemsetAsync")


def raw_memcpy(dst, src, nbytes, handle):
    be = _rt()
    _ok(be.lib.cudaMemcpyAsync(be.ffi.cast("void *", dst), be.ffi.cast("void *", src), nbytes, 4, _s(handle)),
        "cudaMemcpyAsync")


def raw_sync(handle):
    _ok(_rt().lib.cudaStreamSynchronize(_s(handle)), "cudaStreamSynchronize")


def raw_is_capturing(handle, device):
    be = _rt()
    with _streams.on_device(be, device):
        status = be.ffi.new("int *")
        _ok(be.lib.cudaStreamIsCapturing(_s(handle), status), "cudaStreamIsCapturing")
    return status[0] != 0


def raw_live_events():
    from accel.sim import cudart
    return len({id(e) for e in cudart._R.events.values()})


def sim_queue(stream):
    """The simulator's work queue of an accel Stream (the device's legacy queue for handle 0)."""
    from accel.sim import cudart
    q = cudart._R.streams[stream.handle]
    if q is cudart.state._LEGACY:
        q = cudart._R.devices[stream.device_index].legacy
    return q.q


def raw_queue(handle):
    from accel.sim import cudart
    return cudart._R.streams[handle].q


def waits_for(waiter, signal, seq):
    """Whether work still pending on ``waiter``'s queue depends (through the dependencies of
    pending operations, transitively) on ``signal``'s queue reaching operation ``seq``: a
    structural ordering check, no waiting.  Work that already ran depends on nothing."""
    from accel.sim import cudart
    with cudart._R.engine.lock:
        seen, todo = set(), [waiter]
        while todo:
            q = todo.pop()
            if id(q) in seen:
                continue
            seen.add(id(q))
            for op in list(q.ops):
                for dq, ds in op[2]:
                    if dq is signal and ds is not None and ds >= seq:
                        return True
                    todo.append(dq)
    return False


def raw_stream_alive(handle):
    from accel.sim import cudart
    return handle in cudart._R.streams


# == a Numba-like consumer ========================================================================
class NumbaArray:
    """numba.cuda.as_cuda_array(obj, sync): the interface read once, ``owner`` kept, the provided
    stream kept as the array's default stream (1 means CU_STREAM_LEGACY), synchronized at import
    when ``sync``.  Numba works in the current context: the test makes the data's device current
    around each call (``with cuda.gpus[1]:`` in a Numba program)."""

    def __init__(self, obj, sync=True, device=DEV):
        desc = obj.__cuda_array_interface__
        assert desc["version"] == 3 and desc["typestr"] == "|u1" and desc.get("strides") is None
        self.owner = obj                                # DeviceNDArray(gpu_data=MemoryPointer(owner=obj))
        self.ptr, self.nbytes, self.device = desc["data"][0], int(np.prod(desc["shape"])), device
        self.stream = desc.get("stream")                # external_stream(ptr), or 0 when absent
        assert self.stream != 0, "CAI v3: 0 is disallowed"
        if self.stream is not None and sync:
            with _streams.on_device(_rt(), device):
                raw_sync(self.stream)

    def _stream(self):
        return 0 if self.stream is None else self.stream

    def setitem(self, value):
        """``arr[:] = value``: queued on the array's stream."""
        with _streams.on_device(_rt(), self.device):
            raw_memset(self.ptr, value, self.nbytes, self._stream())

    def copy_to_host(self):
        """DeviceNDArray.copy_to_host(): cuMemcpyDtoHAsync on the array's stream, then a synchronize."""
        out = np.empty(self.nbytes, np.uint8)
        with _streams.on_device(_rt(), self.device):
            raw_memcpy(out.ctypes.data, self.ptr, self.nbytes, self._stream())
            raw_sync(self._stream())
        return out


# == a CuPy-like consumer and producer ============================================================
class CupyArray:
    """cupy.asarray(obj) of a CAI v3 object: the data's device current; by default
    ``runtime.streamSynchronize(stream_ptr)`` on the host; with ``by_event`` the variant that makes
    the consumer's own stream wait on an event recorded on the provided one (no host wait)."""

    def __init__(self, obj, own_stream, by_event=False, device=DEV):
        desc = obj.__cuda_array_interface__
        self.owner, self.ptr, self.nbytes = obj, desc["data"][0], int(np.prod(desc["shape"]))
        self.device, self.own = device, own_stream
        provided = desc.get("stream")
        if provided is None:
            return
        be = _rt()
        with _streams.on_device(be, device):
            if not by_event:
                raw_sync(provided)
                return
            p = be.ffi.new("cudaEvent_t *")
            _ok(be.lib.cudaEventCreateWithFlags(p, 2), "cudaEventCreateWithFlags")     # DisableTiming
            _ok(be.lib.cudaEventRecord(p[0], _s(provided)), "cudaEventRecord")
            _ok(be.lib.cudaStreamWaitEvent(_s(own_stream), p[0], 0), "cudaStreamWaitEvent")
            _ok(be.lib.cudaEventDestroy(p[0]), "cudaEventDestroy")

    def fill(self, value):
        with _streams.on_device(_rt(), self.device):
            raw_memset(self.ptr, value, self.nbytes, self.own)


class CupyProducer:
    """A CuPy array as a CAI v3 producer: ``stream`` is the current stream of the *current* device
    when the attribute is read (here ``current``), whatever device the data is on."""

    def __init__(self, ptr, nbytes, current):
        self.ptr, self.nbytes, self.current = ptr, nbytes, current

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.nbytes,), "typestr": "|u1", "descr": [("", "|u1")], "data": (self.ptr, False),
                "version": 3, "strides": None, "stream": self.current}


# == a DLPack consumer ============================================================================
# own prototypes: the shared ctypes.pythonapi attributes' argtypes are left as other code set them
_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_SetName", ctypes.pythonapi))


class DLConsumer:
    """A C consumer of a versioned capsule: takes it (renames it "used_dltensor_versioned"), keeps
    the DLManagedTensorVersioned*, and calls its deleter when asked (any thread), or never."""

    def __init__(self, capsule):
        self.address = _get_pointer(capsule, b"dltensor_versioned")
        _ok(_set_name(capsule, b"used_dltensor_versioned"), "PyCapsule_SetName")
        managed = D.DLManagedTensorVersioned.from_address(self.address)
        self.ptr = (managed.dl_tensor.data or 0) + managed.dl_tensor.byte_offset
        self.nbytes = managed.dl_tensor.shape[0]
        self.device = (managed.dl_tensor.device.device_type, managed.dl_tensor.device.device_id)
        self._deleter = managed.deleter

    def delete(self):
        deleter = D.DELETER(self._deleter)
        deleter(self.address)


WRITERS = {
    "fill": lambda buf, a, scratch: buf.fill_(5, stream=a),
    "copy_nb": lambda buf, a, scratch: buf.copy_from(scratch["src"].fill_(5, stream=a), stream=a, non_blocking=True),
    "host_nb": lambda buf, a, scratch: buf.copy_from(np.full(N, 5, np.uint8), stream=a, non_blocking=True),
    "random": lambda buf, a, scratch: _random_on(buf, a),
}
READERS = {
    "read": lambda buf, b, scratch: scratch["dst"].copy_from(buf, stream=b, non_blocking=True),
    "record_stream": lambda buf, b, scratch: buf.record_stream(b),
    "dlpack_to_b": lambda buf, b, scratch: buf.__dlpack__(stream=b, max_version=(1, 0)),     # dropped unconsumed
    "to_numpy_nb": lambda buf, b, scratch: buf.to_numpy(stream=b, non_blocking=True),
}


def _random_on(buf, a):
    with a:
        accel.random.uniform_(buf)


def _pending_on_two_streams(index=DEV, writer="fill", reader="read"):
    """A buffer of device ``index`` written on stream A (held: the write is pending) and then used
    on B, another stream, as its last use: the CAI v3 "multiple streams" case."""
    a, b = accel.Stream(index), accel.Stream(index)
    buf = accel.Buffer(N, device=index).fill_(0)
    # scratch buffers allocated before the gate, each for the stream that uses it (an allocation
    # may synchronize the device: expandable segments unmapping a free page to stay under the mark)
    scratch = {"src": accel.Buffer(N, device=index, stream=a), "dst": accel.Buffer(N, device=index, stream=b)}
    accel.synchronize(index)
    gate = hold(a)
    try:
        WRITERS[writer](buf, a, scratch)                    # pending behind the gate
        written = sim_queue(a).enqueued
        READERS[reader](buf, b, scratch)
    except BaseException:
        gate.set()
        raise
    assert buf.last_stream == b
    assert accel.current_device_index() == 0
    return buf, a, b, gate, written


# == Numba-like consumer ==========================================================================
@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("writer", list(WRITERS))
def test_numba_work_on_the_exported_stream_follows_every_pending_writer(cuda, writer, reader):
    """The stream Numba keeps must be ordered after accel's write still pending on A (CAI v3
    "multiple streams"): its ``arr[:] = 9`` (sync=False: the import's host wait would wait for
    the gate) lands after it."""
    buf, a, b, gate, written = _pending_on_two_streams(writer=writer, reader=reader)
    try:
        arr = NumbaArray(buf, sync=False)
        assert arr.stream == b.handle
        arr.setitem(9)
        ordered = waits_for(sim_queue(b), sim_queue(a), written)
    finally:
        gate.set()
    assert ordered, "Numba's write on the exported stream is not ordered after accel's write pending on A"
    accel.synchronize(DEV)
    assert accel.current_device_index() == 0
    assert set(buf.to_numpy().tolist()) == {9}, "Numba's write on the exported stream ran before accel's pending fill"


# (r73e found; fixed in session 36)
def test_numba_first_import_stream_outlives_a_later_export_naming_another(cuda):
    """CAI v3 Lifetime management: every exported stream lives at least as long as the buffer.
    Numba array #1 keeps stream A (its default stream), #2 keeps B; both keep ``buf`` alive.  The
    user closes A; #1's next transfer on A must still work, and A's handle name no other stream."""
    a, b = accel.Stream(DEV), accel.Stream(DEV)
    buf = accel.Buffer(N, device=DEV).fill_(1, stream=a)
    first = NumbaArray(buf)
    buf.fill_(2, stream=b)
    second = NumbaArray(buf)
    assert (first.stream, second.stream) == (a.handle, b.handle)
    handle = first.stream
    a.close()                                               # the user is done with A; buf lives on
    assert raw_stream_alive(handle), "stream A was destroyed while the buffer its export named lives"
    later = accel.Stream(DEV)
    assert later.handle != handle
    accel.synchronize(DEV)
    assert set(first.copy_to_host().tolist()) == {2}
    del first, second


def test_numba_keeps_a_closed_exported_stream_until_the_buffer_goes(cuda):
    """The exported stream S is closed by the user while the Numba array (owner=buf) lives: S is
    not destroyed (its handle names no newer stream), Numba's transfer on it works, and once the
    array and the buffer are gone S is destroyed (nothing kept for good)."""
    s = accel.Stream(DEV)
    buf = accel.Buffer(N, device=DEV).fill_(3, stream=s)
    arr = NumbaArray(buf)
    handle = arr.stream
    assert handle == s.handle
    s.close()
    del buf
    gc.collect()
    other = accel.Stream(DEV)
    assert other.handle != handle and raw_stream_alive(handle)
    arr.setitem(8)
    assert set(arr.copy_to_host().tolist()) == {8}
    del arr
    gc.collect()
    accel.synchronize(DEV)      # (a destroy a finalizer deferred runs at accel's next call)
    assert not raw_stream_alive(handle), "the closed stream outlived the buffer that exported it"
    other.close()


def test_numba_stream_given_back_to_accel_after_the_user_closed_it(cuda):
    """Numba's stream (accel's exported S, closed by the user since) handed back to accel as an
    external stream (``accel.Stream.from_handle``, torch.cuda.ExternalStream's counterpart): accel
    work on it runs while the buffer lives; once wrapper, array and buffer are gone the stream is
    destroyed and accel's allocator keeps working (nothing refers to the dead handle)."""
    s = accel.Stream(DEV)
    buf = accel.Buffer(N, device=DEV).fill_(3, stream=s)
    arr = NumbaArray(buf)
    handle = arr.stream
    s.close()
    del buf
    wrapped = accel.Stream.from_handle(handle, DEV)
    arr.owner.fill_(5, stream=wrapped)
    wrapped.synchronize()
    assert set(arr.copy_to_host().tolist()) == {5}
    wrapped.close()
    del wrapped, arr
    gc.collect()
    accel.synchronize(DEV)
    assert not raw_stream_alive(handle)
    again = accel.Buffer(N, device=DEV).fill_(1)
    accel.memory.empty_cache()
    assert set(again.to_numpy().tolist()) == {1}
    again.close()
    accel.memory.empty_cache()


def test_numba_default_stream_export_on_the_non_current_device_then_accel_reads(cuda):
    """A buffer of device 1 last used on its default stream exports 1 (the legacy stream): Numba
    (device 1's context current) writes there, and accel's next operation on the buffer (on its
    device's current stream, the legacy one) sees the write."""
    buf = accel.Buffer(N, device=DEV).fill_(4)
    arr = NumbaArray(buf)
    assert arr.stream == 1
    gate = hold(accel.default_stream(DEV))
    try:
        arr.setitem(6)                                      # queued behind the gate
    finally:
        gate.set()
    assert set(buf.to_numpy().tolist()) == {6}
    assert accel.current_device_index() == 0


def test_numba_write_on_the_exported_stream_then_accel_reads_on_the_last_use_stream(cuda):
    """Numba writes on the exported stream S (held); accel's next read on the buffer's last-use
    stream (non-blocking, so the gate can be let go) returns Numba's bytes."""
    s = accel.Stream(DEV)
    buf = accel.Buffer(N, device=DEV).fill_(1, stream=s)
    arr = NumbaArray(buf)
    gate = hold(s)
    try:
        arr.setitem(7)
        host, done = buf.to_numpy(stream=buf.last_stream, non_blocking=True)
    finally:
        gate.set()
    done.synchronize()
    assert set(host.tolist()) == {7}


# == CuPy-like consumer and producer ==============================================================
def test_cupy_event_wait_consumer_follows_every_pending_writer(cuda):
    """CuPy's own stream waits on an event recorded on the provided stream (B, the last use); the
    fill still pending on A must come first, so CuPy's fill of 9 is what remains."""
    buf, a, b, gate, written = _pending_on_two_streams()
    mine = raw_stream_create(DEV)
    try:
        try:
            arr = CupyArray(buf, mine, by_event=True)
            arr.fill(9)
            ordered = waits_for(raw_queue(mine), sim_queue(a), written)
        finally:
            gate.set()
        assert ordered
        raw_sync(mine)
        accel.synchronize(DEV)
        assert set(buf.to_numpy().tolist()) == {9}
    finally:
        raw_stream_destroy(mine)


def test_cupy_producer_stream_of_another_device(cuda):
    """CuPy exports its current device's (0) current stream P0 for data on device 1, which a copy
    queued on P0 (held) is still writing.  accel's copy on a stream of device 1 must wait for it,
    and P0's later work must wait for accel's non-blocking copy (CAI v3 consumer obligation)."""
    p0 = raw_stream_create(0)
    try:
        src0 = accel.Buffer(N, device=0).fill_(7)
        data1 = accel.Buffer(N, device=DEV).fill_(1)
        accel.synchronize(0)
        accel.synchronize(DEV)
        gate = raw_hold(p0)
        be = _rt()
        with _streams.on_device(be, 0):
            # CuPy's write of the data, pending on P0: a copy from device 0 (cudaMemcpyPeerAsync, as
            # CuPy copies between devices that have no peer access)
            _ok(be.lib.cudaMemcpyPeerAsync(be.ffi.cast("void *", data1.ptr), DEV, be.ffi.cast("void *", src0.ptr),
                                           0, N, _s(p0)), "cudaMemcpyPeerAsync")
        dst = accel.Buffer(N, device=DEV)
        mine = accel.Stream(DEV)
        try:
            dst.copy_from(CupyProducer(data1.ptr, N, p0), stream=mine, non_blocking=True)
        finally:
            gate.set()
        mine.synchronize()
        raw_sync(p0)
        assert set(dst.to_numpy().tolist()) == {7}
        assert accel.current_device_index() == 0
    finally:
        raw_stream_destroy(p0)


# == DLPack consumer ==============================================================================
def test_dlpack_consumer_stream_follows_every_pending_writer_and_deleter_on_a_thread(cuda):
    """The consumer passes its own stream (created by it, unknown to accel) on device 1: its
    fill of 9 lands after accel's pending fill on A.  The buffer is closed while the consumer
    holds the tensor: the memory is not handed to a new allocation before the deleter, which the
    consumer calls later from another thread."""
    buf, a, b, gate, written = _pending_on_two_streams()
    mine = raw_stream_create(DEV)
    live = D.live_exports()
    try:
        try:
            capsule = buf.__dlpack__(stream=mine, max_version=(1, 0))
            tensor = DLConsumer(capsule)
            assert tensor.device == (2, DEV) and tensor.nbytes == N and tensor.ptr == buf.ptr
            with _streams.on_device(_rt(), DEV):
                raw_memset(tensor.ptr, 9, N, mine)
            ordered = waits_for(raw_queue(mine), sim_queue(a), written)
        finally:
            gate.set()
        assert ordered
        raw_sync(mine)
        accel.synchronize(DEV)
        check = accel.Buffer(N, device=DEV)
        check.copy_from(buf)
        assert set(check.to_numpy().tolist()) == {9}
        ptr = buf.ptr
        del capsule
        buf.close()
        a.synchronize()
        again = accel.Buffer(N, device=DEV)
        assert again.ptr != ptr, "the consumer's memory was reallocated before its deleter ran"
        again.close()
        t = threading.Thread(target=tensor.delete)
        t.start()
        t.join()
        gc.collect()
        assert D.live_exports() == live
    finally:
        raw_stream_destroy(mine)


def test_dlpack_capsule_dropped_unconsumed_after_close_releases(cuda):
    buf = accel.Buffer(N, device=DEV).fill_(2)
    live = D.live_exports()
    capsule = buf.__dlpack__(stream=-1, max_version=(1, 0))
    buf.close()
    assert D.live_exports() == live + 1
    del capsule
    gc.collect()
    assert D.live_exports() == live


# (r73e found; fixed in session 36)
def test_dlpack_export_during_a_capture_to_a_consumer_stream_outside_it(cuda):
    """A buffer last written inside a capture (device 1) is exported to a consumer whose own
    stream is not capturing.  The copy path refuses the same wait into a capture
    (accel._dlpack.ordering._refuse_wait_into_capture: "a waiter outside a capturing signaller would be
    forked into the capture").  Either the export is refused (CaptureError, nothing queued) or
    the consumer's stream stays outside the capture, and the capture ends."""
    mine = raw_stream_create(DEV)
    try:
        with accel.device_index(DEV):
            s = accel.Stream()
            buf = accel.Buffer(N, stream=s)     # no other stream to wait for: only the capture's
            g = accel.Graph()
            joined = False
            with s:
                g.capture_begin()
                try:
                    buf.fill_(3)
                    try:
                        tensor = DLConsumer(buf.__dlpack__(stream=mine, max_version=(1, 0)))
                    except accel.CaptureError:
                        pass
                    else:
                        raw_memset(tensor.ptr, 9, N, mine)      # the consumer's work, meant to run now
                        tensor.delete()
                    joined = raw_is_capturing(mine, DEV)
                finally:
                    if joined:
                        # as a real consumer would not, join it back so that the capture can end
                        be = _rt()
                        p = be.ffi.new("cudaEvent_t *")
                        be.lib.cudaEventCreateWithFlags(p, 2)
                        be.lib.cudaEventRecord(p[0], _s(mine))
                        be.lib.cudaStreamWaitEvent(_s(s.handle), p[0], 0)
                        be.lib.cudaEventDestroy(p[0])
                    g.capture_end()
            g.replay()
            accel.synchronize()
        assert not joined, "the consumer's stream was pulled into accel's capture"
    finally:
        raw_stream_destroy(mine)


# == CAI export during a capture ==================================================================
def test_cai_export_during_a_capture_names_the_capturing_stream(cuda):
    """A buffer written inside a capture exports the capturing stream; Numba (sync=False, as a
    consumer inside a capture must) queues its write there, which the capture records; the
    replay runs both, in order."""
    with accel.device_index(DEV):
        buf = accel.Buffer(N).fill_(0)
        accel.synchronize()
        s = accel.Stream()
        g = accel.Graph()
        with s:
            g.capture_begin()
            try:
                buf.fill_(3)
                arr = NumbaArray(buf, sync=False)
                assert arr.stream == s.handle
                arr.setitem(4)
            finally:
                g.capture_end()
        assert set(buf.to_numpy().tolist()) == {0}
        g.replay()
        accel.synchronize()
        assert set(buf.to_numpy().tolist()) == {4}
    assert accel.current_device_index() == 0


# r73e, fixed in session 39: Graph.replay did not note the buffers its capture used on the replay
# stream, so Buffer.__cuda_array_interface__ named the capture stream and did not order the consumer
# after the pending replay
def test_cai_export_after_a_replay_on_another_stream_covers_the_replay(cuda):
    """A graph captured on S writes ``buf`` (7); it is replayed with another stream R current (R
    held), the graph's documented replay stream.  accel has enqueued work on the data on R: the
    exported stream must wait for it (CAI v3 "multiple streams"), so Numba's write of 9 on the
    exported stream comes after the 7.  (When R is the buffer's allocation stream the export waits
    for it by chance: checked first.)  torch tracks no graph inputs either, but its tensors export
    no stream; accel's export claims its stream covers accel's pending work on the data."""
    with accel.device_index(DEV):
        buf = accel.Buffer(N).fill_(0)
        accel.synchronize()
        s, r = accel.Stream(), accel.Stream()
        g = accel.Graph()
        with s:
            g.capture_begin()
            try:
                buf.fill_(7)
            finally:
                g.capture_end()
        for replay_stream in (accel.current_stream(), r):
            buf.fill_(0, stream=s)
            accel.synchronize()
            gate = hold(replay_stream)
            try:
                with replay_stream:
                    g.replay()                              # pending behind the gate
                replayed = sim_queue(replay_stream).enqueued
                arr = NumbaArray(buf, sync=False)
                arr.setitem(9)
                # the export names the replay stream itself (stream order covers the replay), or
                # another stream made to wait for it
                exported = {s.handle or 1: s, replay_stream.handle or 1: replay_stream}[arr.stream]
                ordered = exported is replay_stream or waits_for(sim_queue(exported), sim_queue(replay_stream),
                                                                  replayed)
            finally:
                gate.set()
            accel.synchronize()
            assert ordered, f"the consumer's write on the exported stream is not ordered after the replay on " \
                            f"{replay_stream!r}"
            assert set(buf.to_numpy().tolist()) == {9}


# == exports repeated in a loop ===================================================================
def test_exports_in_a_loop_leave_bounded_state(cuda):
    """300 rounds: the last use alternates between two streams, each round exports through CAI
    (a Numba import kept until the next round) and DLPack (a consumer stream, the capsule taken and
    deleted; every 3rd dropped unconsumed).  Afterwards no event, export, capsule or stream use
    mark is left beyond what one round leaves, and the buffer's release destroys the streams."""
    a, b = accel.Stream(DEV), accel.Stream(DEV)
    mine = raw_stream_create(DEV)
    buf = accel.Buffer(N, device=DEV).fill_(1)
    accel.synchronize(DEV)
    from accel import _finalize
    from accel.sim import cudart
    events, live, streams = raw_live_events(), D.live_exports(), len(cudart._R.streams)
    try:
        kept = None
        for i in range(300):
            stream = a if i % 2 else b
            buf.fill_(i % 256, stream=stream)
            kept = NumbaArray(buf, sync=bool(i % 5 == 0))
            assert kept.stream == stream.handle
            capsule = buf.__dlpack__(stream=mine, max_version=(1, 0))
            if i % 3:
                DLConsumer(capsule).delete()
            del capsule
        raw_sync(mine)
        accel.synchronize(DEV)
        del kept
        gc.collect()
        accel.synchronize(DEV)      # (runs what finalizers deferred during the collection)
        assert D.live_exports() == live and not D._capsules
        assert raw_live_events() <= events + 2
        assert len(cudart._R.streams) == streams and len(_finalize.pending) <= 2
        assert len(a._busy) <= 1 and len(b._busy) <= 1
        ha, hb = a.handle, b.handle
        a.close()
        b.close()
        buf.close()
        gc.collect()
        accel.synchronize(DEV)
        assert not raw_stream_alive(ha) and not raw_stream_alive(hb)
    finally:
        raw_stream_destroy(mine)


# == non-owning buffers, per-thread default streams ==============================================
@pytest.mark.parametrize("wrap", ["from_ptr", "from_dlpack"])
def test_numba_import_of_a_non_owning_buffer_follows_every_pending_writer(cuda, wrap):
    """The same CAI v3 "multiple streams" obligation for a buffer over another library's memory
    (Buffer.from_ptr, accel.from_dlpack): its uses are noted by the buffer, not the allocator."""
    base = accel.Buffer(N, device=DEV).fill_(0)
    accel.synchronize(DEV)
    buf = accel.Buffer.from_ptr(base.ptr, N, device=DEV, owner=base) if wrap == "from_ptr" else \
        accel.from_dlpack(base)
    a, b = accel.Stream(DEV), accel.Stream(DEV)
    gate = hold(a)
    try:
        buf.fill_(5, stream=a)
        written = sim_queue(a).enqueued
        buf.record_stream(b)
        arr = NumbaArray(buf, sync=False)
        assert arr.stream == b.handle
        arr.setitem(9)
        ordered = waits_for(sim_queue(b), sim_queue(a), written)
    finally:
        gate.set()
    accel.synchronize(DEV)
    assert ordered, "Numba's write on the exported stream is not ordered after accel's write pending on A"
    assert set(base.to_numpy().tolist()) == {9}
    del arr
    buf.close()


def test_dlpack_consumer_on_another_thread_with_its_per_thread_default_stream(cuda):
    """A consumer thread passes stream=2 (its per-thread default stream) with device 1 current in
    that thread: the wait must be queued on that thread's per-thread stream, so its fill of 9
    lands after accel's pending fill; it then syncs and calls the deleter in that thread."""
    buf, a, b, gate, written = _pending_on_two_streams()
    live = D.live_exports()
    queued, errors = threading.Event(), []

    def consumer():
        try:
            with _streams.on_device(_rt(), DEV):
                tensor = DLConsumer(buf.__dlpack__(stream=2, max_version=(1, 0)))
                raw_memset(tensor.ptr, 9, N, 2)
                queued.set()
                raw_sync(2)
                tensor.delete()
        except BaseException as exc:       # reported by the main thread
            errors.append(exc)
        finally:
            queued.set()

    t = threading.Thread(target=consumer)
    t.start()
    queued.wait(HOLD_LIMIT_S)
    gate.set()
    t.join()
    assert not errors, errors
    accel.synchronize(DEV)
    assert set(buf.to_numpy().tolist()) == {9}
    gc.collect()
    assert D.live_exports() == live


# == the legacy default stream of a device that is not current ====================================
def _release_when_blocked(gate, ident, done):
    """Set ``gate`` once thread ``ident`` blocks in a simulated host wait (or ``done`` is set):
    a producer that waits on the host for the gated work is let through, one that does not is
    observed not to have waited.  (Polls the thread's frames; nothing is timed.)"""
    import sys
    import time

    def run():
        while not done.is_set() and not gate.is_set():
            f = sys._current_frames().get(ident)
            while f is not None:
                if f.f_code.co_name == "_wait_locked" and f.f_code.co_filename.endswith("_engine.py"):
                    gate.set()
                    return
                f = f.f_back
            time.sleep(0.001)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


# (r73e found; fixed in session 34)
def test_cupy_import_with_another_device_current_waits_for_the_legacy_stream_work(cuda):
    """CuPy's import synchronizes ``runtime.streamSynchronize(stream_ptr)`` on the host with no
    device switch (its current device is 0 here, the data on device 1, as in accel's caller), and
    then reads through its own non-blocking stream of device 1.  accel's fill is pending on
    device 1's legacy stream (held).  Value 1 names "the legacy default stream", which the CUDA
    runtime resolves in the calling thread's current device: the sync must cover accel's fill
    (the export may wait on the host itself, which lets the gate go here)."""
    buf = accel.Buffer(N, device=DEV).fill_(0)
    accel.synchronize(DEV)
    legacy = sim_queue(accel.default_stream(DEV))
    gate = hold(accel.default_stream(DEV))
    done = threading.Event()
    helper = _release_when_blocked(gate, threading.get_ident(), done)
    try:
        buf.fill_(5)                                        # device 1's current (legacy) stream, held
        written = legacy.enqueued
        assert accel.current_device_index() == 0
        desc = buf.__cuda_array_interface__
        raw_sync(desc["stream"])                            # CuPy: no device switch before the sync
        synced = legacy.done >= written
    finally:
        done.set()
        gate.set()
        helper.join()
        accel.synchronize(DEV)
    assert desc["stream"] == 1
    assert synced, "CuPy's synchronize on the exported stream (1, in device 0) missed accel's fill on device 1"


# == found on the way: an allocation that waits for other streams' work ===========================
# (r73e found; fixed in session 36)
def test_allocation_does_not_wait_for_a_foreign_stream_s_work(monkeypatch):
    """Another library (CuPy) has a long kernel running on its own stream of device 1 (held).
    accel then allocates for its stream B while a free page of its stream A's segment is mapped
    (a buffer used on A and closed; A idle).  The new Buffer must not wait on the host for the
    foreign kernel: torch maps a new page and unmaps pages only when an allocation would
    otherwise fail; accel's release-before-grow unmaps A's free page to stay under the reserved
    high-water mark, after a cudaDeviceSynchronize that waits for every stream of the device."""
    if "cuda" not in SIMS:
        pytest.skip("ACCEL_TEST_SIMS leaves out cuda")
    for name in ("ACCEL_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.setenv(name, "expandable_segments:True")
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=50)
    a, b = accel.Stream(DEV), accel.Stream(DEV)
    accel.Buffer(N, device=DEV, stream=a).fill_(5, stream=a).close()
    accel.synchronize(DEV)
    theirs = raw_stream_create(DEV)
    gate = raw_hold(theirs)                                 # the other library's long kernel
    done = threading.Event()
    helper = _release_when_blocked(gate, threading.get_ident(), done)
    try:
        fresh = accel.Buffer(N, device=DEV, stream=b)
        waited = gate.is_set()
    finally:
        done.set()
        gate.set()
        helper.join()
        raw_sync(theirs)
        raw_stream_destroy(theirs)
    fresh.close()
    assert not waited, "allocating for stream B waited on the host for another library's stream"
