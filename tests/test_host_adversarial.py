"""Adversarial reliability of pinned host memory and host<->device copies: bad shapes and
dtypes, closed buffers, failed pinned allocations, sources mutated or freed under a queued
copy, copies between the two simulated devices, threads and fork -- on every simulator.
Each misuse raises a clear Python exception and leaves the allocator's state unchanged."""

import gc
import os
import threading

import numpy as np
import pytest

import accel
from accel import memory, sim
from accel._errors import OutOfMemoryError
from conftest import use_sim


@pytest.fixture
def delayed(sim_backend, monkeypatch):
    """The simulator with a stream latency, so a queued copy is still pending when the call returns."""
    monkeypatch.setenv("ACCEL_SIM_DELAY_US", "2000")
    use_sim(monkeypatch, sim_backend, ACCEL_SIM_DELAY_US=2000)
    yield sim_backend
    sim.clear_faults()


def _other() -> int:
    """The non-current device (device 0 stays current); Metal has only device 0."""
    return accel.device_count() - 1


def _host_state():
    """What a failed call must leave unchanged: the pinned allocator's counts."""
    stats = memory.host_allocator().stats()
    stats.pop("pending")        # events complete on their own time
    return stats


# -- empty_pinned: shapes -------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [2.5, (2, 1.5), "3", (True, 2), np.float64(4.0), None])
def test_empty_pinned_refuses_a_shape_that_is_no_integer(sim_backend, shape):
    """A float, string or bool dimension was truncated or parsed (2.5 -> 2 items, "3" -> 3):
    numpy and torch refuse them.  Nothing is pinned."""
    accel.empty_pinned(1)           # initializes the runtime
    before = _host_state()
    with pytest.raises(TypeError, match="shape"):
        accel.empty_pinned(shape)
    assert _host_state() == before


def test_empty_pinned_takes_numpy_integers(sim_backend):
    a = accel.empty_pinned((np.int64(2), np.uint8(3)), "f4")
    assert a.shape == (2, 3) and a.dtype == np.float32
    assert accel.empty_pinned(np.array([4, 1])).shape == (4, 1)
    assert accel.empty_pinned(np.array(5)).shape == (5,)        # a 0-d integer array, as numpy


@pytest.mark.parametrize("shape", [(1 << 40, 1 << 40), (1 << 62, 4)])
def test_empty_pinned_refuses_a_shape_too_big_for_an_array(sim_backend, shape):
    """More bytes than an array can index gave a bare OverflowError from the C layer (cuda,
    xpu) or an out-of-memory error after the whole pinned cache was released."""
    accel.empty_pinned(1)
    before = _host_state()
    with pytest.raises(ValueError, match="too big"):
        accel.empty_pinned(shape, "u1")
    assert _host_state() == before


def test_empty_pinned_oom_leaves_stats_unchanged(delayed):
    """A pinned allocation that fails twice (the second try after the cache was released)
    counts nothing.  The cache is empty first: releasing it is the documented retry."""
    keep = accel.empty_pinned(100)
    memory.empty_host_cache()
    before, torch_before = _host_state(), memory.host_memory_stats()
    sim.inject_oom(times=2)
    with pytest.raises(OutOfMemoryError):
        accel.empty_pinned(1 << 20)
    sim.clear_faults()
    assert _host_state() == before
    after = memory.host_memory_stats()
    assert {k: v for k, v in after.items() if "time" not in k} == \
        {k: v for k, v in torch_before.items() if "time" not in k}
    assert accel.empty_pinned(1 << 20).nbytes == 1 << 20       # the next one works
    assert keep.nbytes == 100


# -- datetime64 / timedelta64 --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["M8[s]", "m8[ns]"])
def test_datetime_arrays_copy_both_ways(sim_backend, dtype):
    """numpy gives no buffer for datetime64/timedelta64 ("cannot include dtype 'M' in a buffer"):
    copy_from, copy_to and to_numpy failed with that message although the data is plain int64."""
    src = np.arange(6, dtype="i8").view(dtype)
    buf = accel.Buffer(src.nbytes, device=_other())
    buf.copy_from(src)
    out = np.zeros(6, dtype)
    buf.copy_to(out)
    np.testing.assert_array_equal(out, src)
    np.testing.assert_array_equal(buf.to_numpy(dtype, (2, 3)), src.reshape(2, 3))
    buf.copy_from(src[::-1].copy(), non_blocking=True)
    arr, event = buf.to_numpy(dtype, non_blocking=True)
    event.synchronize()
    np.testing.assert_array_equal(arr, src[::-1])


def test_datetime_views_keep_the_checks(sim_backend):
    buf = accel.Buffer(48)
    with pytest.raises(ValueError, match="C-contiguous"):
        buf.copy_from(np.zeros(12, "M8[s]")[::2])
    ro = np.zeros(6, "M8[s]")
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        buf.copy_to(ro)
    with pytest.raises(ValueError, match="size mismatch"):
        buf.copy_to(np.zeros(5, "m8[s]"))


# -- closed buffers ---------------------------------------------------------------------------------

def test_to_numpy_non_blocking_on_a_closed_buffer_pins_nothing(sim_backend):
    """to_numpy(non_blocking=True) pinned its output array before copy_to found the buffer
    closed: the failed call changed the pinned allocator's counts."""
    buf = accel.Buffer(4096, device=_other())
    buf.close()
    accel.empty_pinned(1)
    before, torch_before = _host_state(), memory.host_memory_stats()
    with pytest.raises(RuntimeError, match="closed"):
        buf.to_numpy("f4", non_blocking=True)
    gc.collect()
    assert _host_state() == before
    assert memory.host_memory_stats()["active_requests.allocated"] == torch_before["active_requests.allocated"]


@pytest.mark.parametrize("op", ["copy_from", "copy_to", "copy_from_nb", "to_numpy"])
def test_closed_buffer_copies_raise(sim_backend, op):
    buf = accel.Buffer(64, device=_other())
    buf.close()
    calls = {"copy_from": lambda: buf.copy_from(np.zeros(64, "u1")),
             "copy_from_nb": lambda: buf.copy_from(np.zeros(64, "u1"), non_blocking=True),
             "copy_to": lambda: buf.copy_to(np.zeros(64, "u1")),
             "to_numpy": lambda: buf.to_numpy()}
    with pytest.raises(RuntimeError, match="closed"):
        calls[op]()


# -- staging and pinned reuse ------------------------------------------------------------------------

def test_non_blocking_source_mutated_and_freed_keeps_the_data(delayed):
    buf = accel.Buffer(1 << 16, device=_other())
    src = np.full(1 << 16, 7, "u1")
    buf.copy_from(src, non_blocking=True)
    src[:] = 9
    del src
    gc.collect()
    assert set(np.unique(buf.to_numpy())) == {7}


def test_pinned_blocks_not_reused_under_queued_copies(delayed):
    buf = accel.Buffer(1 << 16, device=_other())
    buf.fill_(5)
    dst = accel.empty_pinned(1 << 16)
    buf.copy_to(dst, non_blocking=True)
    del dst
    gc.collect()
    memory.empty_host_cache()               # must not unpin the block under the queued copy
    other = accel.empty_pinned(1 << 16)     # the same block only once the copy has run
    other[:] = 1
    accel.synchronize(_other())
    assert set(np.unique(other)) == {1}


def test_threads_copy_concurrently(delayed):
    bufs = [accel.Buffer(4096, device=i % accel.device_count()) for i in range(4)]
    errors = []

    def work(i):
        try:
            for k in range(10):
                value = (i * 31 + k) % 256
                bufs[i].copy_from(np.full(4096, value, "u1"), non_blocking=True)
                out, event = bufs[i].to_numpy(non_blocking=True)
                event.synchronize()
                assert set(np.unique(out)) == {value}
                if k % 3 == 0:
                    memory.empty_host_cache()
        except Exception as exc:     # pragma: no cover - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    for index in range(accel.device_count()):
        accel.synchronize(index)
    gc.collect()
    memory.empty_host_cache()
    assert memory.host_allocator().stats()["allocations"] == 0


# -- fork and reset ---------------------------------------------------------------------------------

_RUNTIME_CALLS = ("event_create", "event_record", "event_query", "stream_synchronize", "host_free", "host_alloc")


def _spy(backend, calls):
    for name in _RUNTIME_CALLS:
        original = getattr(backend, name)
        setattr(backend, name, lambda *args, _name=name, _original=original: (calls.append(_name),
                                                                                _original(*args))[1])


def test_pinned_array_freed_in_a_forked_child_calls_no_runtime(delayed):
    """A pinned array inherited by a forked child and dropped there ran the parent's allocator
    free in the child: with a queued copy on the block, it created and recorded an event and
    synchronized the parent's stream through the parent's runtime (xpu, mps), which the child
    must never call (accel._finalize: finalizers do nothing in a child)."""
    buf = accel.Buffer(1 << 16, device=_other())
    buf.fill_(3)
    pinned = accel.empty_pinned(1 << 16)
    buf.copy_to(pinned, non_blocking=True)      # the block has a use on the stream
    idle = accel.empty_pinned(100)              # a block without uses
    backend = memory.host_allocator()._be
    pid = os.fork()
    if pid == 0:        # pragma: no cover - the child
        code = 1
        try:
            calls = []
            _spy(backend, calls)
            del pinned, idle
            gc.collect()
            code = 10 + len(calls) if calls else 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child called the parent's runtime"
    accel.synchronize(_other())
    assert set(np.unique(pinned)) == {3}
    del idle


def test_pinned_array_outliving_a_runtime_reset_frees_nothing_there(delayed, monkeypatch):
    """A pinned array dropped after the runtime was reset (tests switching simulators) must not
    call the old runtime; accel._finalize drops releases of a backend that is not the live one."""
    pinned = accel.empty_pinned(4096)
    old = memory.host_allocator()._be
    accel.Buffer(4096, device=_other()).copy_to(pinned, non_blocking=True)
    from accel import _lazy
    _lazy._reset_for_tests()
    calls = []
    _spy(old, calls)
    del pinned
    gc.collect()
    assert calls == []


# -- the host allocator's record_stream --------------------------------------------------------------

@pytest.mark.parametrize("stream, device", [(-1, None), (1 << 64, None), ("s", None), (1.0, None),
                                            (0, 7), (0, -1), (0, "1")])
def test_host_record_stream_refuses_a_bad_stream_or_device(sim_backend, stream, device):
    """The pinned allocator kept any stream and device index (the device allocators refuse them
    since efef3a7): the bad use then failed the free's event record, so the block stayed
    deferred and every later empty_host_cache raised."""
    host = memory.host_allocator()
    ptr = host.malloc(4096)
    with pytest.raises((TypeError, ValueError)):
        host.record_stream(ptr, stream, device)
    host.free(ptr)                      # no use was kept: straight back to the cache
    memory.empty_host_cache()
    stats = host.stats()
    assert stats["allocations"] == 0 and stats["pending"] == 0 and stats["segments"] == 0


# -- dtypes without a size ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["S0", "U0", "V0", np.dtype([])])
@pytest.mark.parametrize("non_blocking", [False, True])
def test_to_numpy_refuses_a_dtype_of_no_size(sim_backend, dtype, non_blocking):
    """A zero-itemsize dtype raised ZeroDivisionError ("integer modulo by zero")."""
    buf = accel.Buffer(16, device=_other())
    with pytest.raises(TypeError, match="to_numpy.*itemsize 0"):
        buf.to_numpy(dtype, non_blocking=non_blocking)
    with pytest.raises(TypeError, match="to_numpy.*itemsize 0"):
        accel.Buffer(0, device=_other()).to_numpy(dtype, non_blocking=non_blocking)


@pytest.mark.parametrize("dtype", ["S0", "U0", "V0"])
def test_empty_pinned_refuses_an_unsized_dtype_before_pinning(sim_backend, dtype):
    """numpy's "itemsize cannot be zero in type" came after the block was pinned."""
    accel.empty_pinned(1)
    memory.empty_host_cache()
    before = _host_state()
    with pytest.raises(TypeError, match="empty_pinned.*itemsize 0"):
        accel.empty_pinned(3, dtype)
    assert _host_state() == before


# -- torch CPU tensors numpy cannot read ---------------------------------------------------------------

@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn"])
def test_copy_from_a_torch_tensor_numpy_cannot_read_names_the_fix(sim_backend, name):
    """copy_from a bfloat16 CPU tensor (torch's most common training dtype) raised numpy's bare
    RuntimeError "Unsupported dtype in DLTensor."; the error names the dtype and the same-size
    integer view that copies it."""
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, name)
    t = torch.arange(8, dtype=torch.float32).to(dtype)
    buf = accel.Buffer(t.numel() * t.element_size(), device=_other())
    buf.fill_(0)
    with pytest.raises(TypeError, match=f"{name}.*view"):
        buf.copy_from(t)
    assert set(np.unique(buf.to_numpy())) == {0}
    ints = torch.int16 if t.element_size() == 2 else torch.uint8
    buf.copy_from(t.view(ints))
    assert buf.to_numpy().tobytes() == t.view(ints).numpy().tobytes()


# -- device views through DLPack ----------------------------------------------------------------------

def test_copy_from_a_strided_device_view_is_refused_on_every_backend(sim_backend):
    """On CUDA a strided ArrayView source (via __cuda_array_interface__) is refused as not
    C-contiguous; through DLPack (xpu, mps) copy_from copied the view's whole span, gaps between
    the elements included, into a buffer of the span's size."""
    from accel import _dlpack
    dev = _other()
    src = accel.Buffer(64, device=dev)
    src.copy_from(np.arange(64, dtype="u1"))
    view = src.as_array("u2", shape=(16,), strides=(4,))     # span 62 bytes, 32 of data
    dst = accel.Buffer(62, device=dev)
    dst.fill_(9)
    with pytest.raises(ValueError, match="not C-contiguous"):
        dst.copy_from(view)
    assert set(np.unique(dst.to_numpy())) == {9}
    assert _dlpack.live_exports() == 0
    whole = src.as_array("u2", shape=(2, 16))           # C-contiguous: copied
    dst32 = accel.Buffer(64, device=dev)
    dst32.copy_from(whole)
    np.testing.assert_array_equal(dst32.to_numpy(), np.arange(64, dtype="u1"))
    one = src.as_array("u1", shape=(4, 1), strides=(1, 7))    # extent-1 strides do not matter
    dst4 = accel.Buffer(4, device=dev)
    dst4.copy_from(one)
    np.testing.assert_array_equal(dst4.to_numpy(), np.arange(4, dtype="u1"))


# -- subarray dtypes -------------------------------------------------------------------------------------

def test_subarray_dtype_adds_its_dimensions_as_numpy(sim_backend):
    """numpy.empty(3, ('f4', (2,))) is a (3, 2) float32 array.  empty_pinned failed with "cannot
    reshape array of size 6 into shape (3,)" after pinning, and to_numpy did so with a shape or
    non_blocking (its blocking form without a shape worked)."""
    sub = np.dtype(("f4", (2,)))
    pinned = accel.empty_pinned(3, sub)
    assert pinned.shape == (3, 2) and pinned.dtype == np.float32
    assert accel.empty_pinned((2, 0), sub).shape == (2, 0, 2)
    buf = accel.Buffer(24, device=_other())
    buf.copy_from(np.arange(6, dtype="f4"))
    expect = np.arange(6, dtype="f4").reshape(3, 2)
    np.testing.assert_array_equal(buf.to_numpy(sub), expect)
    np.testing.assert_array_equal(buf.to_numpy(sub, (3,)), expect)
    np.testing.assert_array_equal(buf.to_numpy(sub, (1, 3)), expect.reshape(1, 3, 2))
    arr, event = buf.to_numpy(sub, (3,), non_blocking=True)
    event.synchronize()
    np.testing.assert_array_equal(arr, expect)
    arr, event = buf.to_numpy(sub, non_blocking=True)
    event.synchronize()
    np.testing.assert_array_equal(arr, expect)
