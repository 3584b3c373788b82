"""The hot paths' shortcuts keep their rules (r61: Event.record, Stream.query, Buffer.fill_ and
Buffer(n).close() on the CUDA simulator): a record or fill on a shared default stream runs with
its device current, also on device 1 and after a deferred device restore; a pin taken for a
call covers the buffer itself and a Buffer argument; a bad device index is refused as before."""

import numpy as np
import pytest

import accel
from accel import sim
from accel._errors import InvalidDeviceError

from conftest import use_sim


def _watch_current_device(monkeypatch, names):
    """(call, the runtime's current device) for each call of the simulated functions ``names``."""
    from accel import _lazy
    backend = _lazy.lazy_init()
    lib, ffi = backend.lib, backend.ffi
    get_device = lib.cudaGetDevice
    seen = []

    def spy(name, fn):
        def call(*args):
            cur = ffi.new("int *")
            get_device(cur)
            seen.append((name, cur[0]))
            return fn(*args)
        return call

    for name in names:
        monkeypatch.setattr(lib, name, spy(name, getattr(lib, name)))
    return seen


@pytest.mark.parametrize("index", [0, 1])
def test_record_on_the_current_stream_runs_on_the_current_device(sim_cuda, monkeypatch, index):
    accel.set_device_index(index)
    e = accel.Event()
    e.record()          # creates the device event
    seen = _watch_current_device(monkeypatch, ["cudaEventRecord"])
    e.record()
    assert seen == [("cudaEventRecord", index)]
    assert e.device.index == index and accel.current_device_index() == index
    e.synchronize()
    assert e.query()


def test_record_on_a_given_default_stream_of_another_device_switches_and_restores(sim_cuda, monkeypatch):
    accel.set_device_index(0)
    e = accel.Event()
    e.record(accel.default_stream(1))
    seen = _watch_current_device(monkeypatch, ["cudaEventRecord"])
    e.record(accel.default_stream(1))
    assert seen == [("cudaEventRecord", 1)]
    assert accel.current_device_index() == 0


def test_the_first_record_after_a_deferred_restore_makes_the_device_current(monkeypatch):
    use_sim(monkeypatch, "cuda")
    accel.random.normal_(accel.Buffer(4, 1))        # device 0 has no context: its restore is deferred
    assert sim.state().primary_contexts == [False, True]
    assert accel.current_device_index() == 0
    e = accel.Event()
    e.record()
    assert e.device.index == 0 and sim.state().primary_contexts == [True, True]
    e.synchronize()
    assert e.query()


@pytest.mark.parametrize("index", [0, 1])
def test_fill_on_the_current_stream_runs_on_the_buffers_device(sim_cuda, monkeypatch, index):
    accel.set_device_index(0)
    buf = accel.Buffer(256, device=index)
    seen = _watch_current_device(monkeypatch, ["cudaMemsetAsync"])
    assert buf.fill_(7) is buf
    assert seen == [("cudaMemsetAsync", index)]
    assert accel.current_device_index() == 0
    assert (buf.to_numpy() == 7).all()


@pytest.mark.parametrize("value", [7, np.uint8(7), np.int64(7)])
def test_fill_takes_index_integers(sim_cuda, value):
    buf = accel.Buffer(16)
    buf.fill_(value)
    assert (buf.to_numpy() == 7).all()


@pytest.mark.parametrize("value", [True, -1, 256, 1.0, "7", None])
def test_fill_refuses_what_is_no_byte(sim_cuda, value):
    buf = accel.Buffer(16)
    with pytest.raises(ValueError, match="byte value 0..255"):
        buf.fill_(value)


def test_a_call_pins_the_buffer_and_a_buffer_argument_until_it_returns(sim_cuda, monkeypatch):
    """A close() meanwhile (another thread's) leaves both memories to the call's end."""
    src, dst = accel.Buffer(64), accel.Buffer(64)
    src.fill_(3)
    backend = src._backend
    real = backend.memcpy_async
    pinned = []

    def memcpy_async(*args):
        pinned.append((len(src._pins), len(dst._pins)))
        src.close()
        dst.close()
        assert src._deferred and dst._deferred        # left to the pins' end
        return real(*args)

    monkeypatch.setattr(backend, "memcpy_async", memcpy_async)
    dst.copy_from(src)
    assert pinned == [(1, 1)]
    assert not src._pins and not dst._pins and not src._deferred and not dst._deferred


@pytest.mark.parametrize("bad", [-2, 2, 5])     # (-1 is the current device, as c10's: r69j)
def test_current_stream_of_a_bad_index_is_refused_after_good_ones(sim_cuda, bad):
    accel.current_stream(0)
    accel.current_stream(1)
    with pytest.raises(InvalidDeviceError, match="out of index range"):
        accel.current_stream(bad)
