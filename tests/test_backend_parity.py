"""The same call behaves the same way on every backend, or is refused the same way (r23).

Found by running the CUDA-only tests against the Level Zero and Metal simulators.
"""

import numpy as np
import pytest

import accel


class _CAI:
    """A minimal __cuda_array_interface__ v3 producer (as CuPy or Numba export)."""

    def __init__(self, ptr, nbytes, stream=None):
        self.ptr, self.nbytes, self.stream = ptr, nbytes, stream

    @property
    def __cuda_array_interface__(self):
        cai = {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3,
               "strides": None}
        if self.stream is not None:
            cai["stream"] = self.stream
        return cai


@pytest.mark.parametrize("producer_stream", [None, "own"])
def test_cuda_array_interface_source_is_cuda_memory_only(sim_backend, producer_stream):
    """A __cuda_array_interface__ describes CUDA memory and CUDA streams (1 = legacy default,
    2 = per-thread).  ArrayView.copy_from refused one on XPU/MPS; Buffer.copy_from took its
    pointer as the backend's own memory and its stream number as a CUDA one (on Metal, whose
    stream handles are 1, 2, ..., accel stream 1 was read as 'the legacy default stream', so the
    copy waited for the wrong stream)."""
    src = accel.Buffer(64).fill_(7)
    dst = accel.Buffer(64).fill_(1)
    side = accel.Stream()
    stream = side.handle if producer_stream == "own" else None
    if sim_backend == "cuda":
        dst.copy_from(_CAI(src.ptr, 64, stream))
        assert (dst.to_numpy() == 7).all()
        return
    for target in (dst, dst.as_array("u1")):
        with pytest.raises(ValueError, match=rf"__cuda_array_interface__ source is CUDA memory.*{sim_backend}:0"):
            target.copy_from(_CAI(src.ptr, 64, stream))
    assert (dst.to_numpy() == 1).all(), "a refused copy changed the destination"
    dst.copy_from(src)                      # the accel way still works
    assert (dst.to_numpy() == 7).all()
    side.close()


class _TorchLikeProducer:
    """A DLPack producer that checks ``stream`` as torch's Tensor.__dlpack__ does ("stream must
    be ``int`` or ``none``"); its memory is an accel buffer's."""

    def __init__(self, view):
        self.view, self.streams = view, []

    def __dlpack_device__(self):
        return self.view.__dlpack_device__()

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.streams.append(stream)
        if stream is not None and type(stream) is not int:
            raise TypeError("stream must be ``int`` or ``none``")
        return self.view.__dlpack__(stream=None if stream in (None, 1) else -1, max_version=max_version)


def test_dlpack_source_gets_a_stream_its_producer_understands(sim_backend):
    """torch (and dpctl) producers of XPU/Metal memory take no accel.Stream: DLPack has no agreed
    stream type there, and torch's own from_dlpack passes none.  ArrayView.copy_from passed None
    off CUDA; Buffer.copy_from passed the accel.Stream object, so the producer raised TypeError
    (twice: accel retried without max_version) and nothing could be copied from it."""
    src = accel.Buffer(64).fill_(9)
    producer = _TorchLikeProducer(src.as_array("u1"))
    dst = accel.Buffer(64).fill_(1)
    dst.copy_from(producer)
    assert (dst.to_numpy() == 9).all()
    view = accel.Buffer(64).fill_(2).as_array("u1")
    view.copy_from(producer)
    assert (view.to_numpy() == 9).all()
    if sim_backend == "cuda":
        assert all(type(s) is int for s in producer.streams)
    else:
        assert producer.streams == [None, None]


@pytest.mark.parametrize("api", ["1.5", "1.9"])
def test_xpu_stream_close_on_a_driver_without_in_order_lists(monkeypatch, api):
    """Level Zero drivers before API 1.7 have no in-order lists: accel orders a stream's commands
    with barriers and syncs with a marker event (no zeCommandListHostSynchronize either).  The
    barrier came after every command, the marker's too, so when the host saw the marker the list
    still held a pending barrier, and zeCommandListDestroy ("the device is not currently
    referencing the command list") answered HANDLE_OBJECT_IN_USE: Stream.close() raised whenever
    the device was slower than the host (here: 20 ms per operation)."""
    from conftest import use_sim
    use_sim(monkeypatch, "xpu", ACCEL_SIM_ZE_API=api, ACCEL_SIM_DELAY_US=20000)
    fresh = accel.Stream()
    fresh.close()                                # no work at all
    s = accel.Stream()
    buf = accel.Buffer(64, stream=s).fill_(3, stream=s)
    s.synchronize()
    buf.fill_(4, stream=s)
    s.close()
    assert (buf.to_numpy() == 4).all()           # the stream's work still ran, in order
    buf.close()
    accel.memory.empty_cache()
    st = accel.sim.state()
    assert st.ze_live_command_lists == accel.device_count()     # the default streams only


def test_synchronize_waits_for_the_work_of_a_closed_stream(sim_backend, monkeypatch):
    """A stream's queued work still runs after close() (cudaStreamDestroy returns at once); a
    device-wide synchronize waits for it, and so does the host wait of ``__dlpack__()`` after
    the buffer's last-use stream was closed (accel._dlpack.wait_for_closed)."""
    from conftest import use_sim
    use_sim(monkeypatch, sim_backend, ACCEL_SIM_DELAY_US=20000)
    for how in ("synchronize", "dlpack"):
        buf = accel.Buffer(64).fill_(1)
        accel.synchronize()
        side = accel.Stream()
        buf.fill_(5, stream=side)
        side.close()
        if how == "synchronize":
            accel.synchronize()
        else:
            buf.__dlpack__()                     # stream None: the host waits for the buffer's work
        out = np.zeros(64, np.uint8)
        backend = accel._lazy.lazy_init()
        backend.memcpy_async(out.ctypes.data, buf.ptr, 64, backend.default_stream(0))   # no implicit order
        assert (out == 5).all(), f"{how}: the closed stream's fill had not run"
