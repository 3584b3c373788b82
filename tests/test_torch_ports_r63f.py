"""Round r63f: PyTorch's OpenReg tests, ported to accel.

torch's reference out-of-tree accelerator (test/cpp_extensions/open_registration_extension/
torch_openreg/tests/, read from pytorch/pytorch's stored copies: test_streams.py, test_event.py,
test_device.py, test_memory.py, test_rng.py, test_utils.py, test_storage.py) exercises the
device-generic torch.accelerator / torch.Stream / torch.Event / allocator / generator API on a
two-device backend: exactly accel's surface.  TORCH_PORTS.md had never considered these files.

Conventions as the other ports (tests/TORCH_PORTS.md): ``"openreg"`` is the simulator's device
type (``accel.current_accelerator().type``), ``torch.Stream``/``torch.Event`` are
``accel.Stream``/``accel.Event``, ``torch.accelerator.X`` is ``accel.X``, ``torch.openreg.X``
(seeds, states) is ``accel.random.X``, a float tensor of n elements is ``accel.Buffer(4 * n)``,
``torch.randn(n, device=d)`` is ``accel.random.normal_`` on such a Buffer, and an op between two
tensors (``matmul``, ``+``, ``clone``) is a device-to-device copy.  Every test runs on the three
simulators; ``"openreg:1"`` is device 1 (not current: device 0 stays current) where the simulator
has two devices, and device 0 on Metal, which has one (tests that need two distinct devices skip
there).  Tests are named ``test_openreg_<torch file>__<torch test>``.  torch's ``elapsed_time() >
0`` is asserted ``>= 0`` (no timed asserts)."""

import gc
import multiprocessing
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import accel
import accel.random as R
from accel import memory

from conftest import run_forked


def _t() -> str:
    """The simulator's device type (torch's "openreg")."""
    return accel.current_accelerator().type


def _one() -> int:
    """torch's "openreg:1": device 1 where there are two devices, device 0 on Metal."""
    return 1 if accel.device_count() > 1 else 0


def _need_two():
    if accel.device_count() < 2:
        pytest.skip(f"{_t()} has one device")


def _randn(n, device=None, stream=None) -> accel.Buffer:
    """torch.randn(n, device=device): a float32 Buffer of n normal draws."""
    buf = accel.Buffer(4 * n, device=device, stream=stream)
    R.normal_(buf)
    return buf


def _op(x: accel.Buffer) -> accel.Buffer:
    """A tensor op on ``x`` (matmul, +, clone): a new Buffer on x's device copied from it, on
    the current stream."""
    return accel.Buffer(x.nbytes, device=x.device_index).copy_from(x)


def _pinned(array) -> bool:
    return bool(memory.host_allocator().owns(array.ctypes.data, max(array.nbytes, 1)))


# ===================================================================== test_streams.py
def test_openreg_streams__test_stream_create(sim_backend):
    stream = accel.Stream(device=_t())
    assert stream.device_index == accel.current_device_index()

    stream = accel.Stream(device=f"{_t()}:{_one()}")
    assert stream.device.type == _t()
    assert stream.device_index == _one()

    stream = accel.Stream(_one())
    assert stream.device.type == _t()
    assert stream.device_index == _one()

    stream1 = accel.Stream(stream_id=stream.stream_id, device_type=stream.device_type,
                           device_index=stream.device_index)
    assert stream == stream1
    assert accel.current_device_index() == 0


def test_openreg_streams__test_stream_context(sim_backend):
    with accel.Stream(device=f"{_t()}:{_one()}") as stream:
        assert accel.current_stream() == stream
    assert accel.current_device_index() == 0
    assert accel.current_stream() == accel.default_stream(0)


def test_openreg_streams__test_stream_switch(sim_backend):
    stream1 = accel.Stream(device=f"{_t()}:0")
    accel.set_stream(stream1)
    assert accel.current_stream() == stream1

    stream2 = accel.Stream(device=f"{_t()}:{_one()}")
    accel.set_stream(stream2)
    assert accel.current_stream() == stream2
    # torch.accelerator.set_stream makes the stream's device current too
    assert accel.current_device_index() == _one()


def test_openreg_streams__test_stream_synchronize(sim_backend):
    stream = accel.Stream(device=f"{_t()}:{_one()}")
    assert stream.query() is True

    event = accel.Event()
    event.record(stream)
    stream.synchronize()
    assert stream.query() is True
    assert event.query()


def test_openreg_streams__test_stream_repr(sim_backend):
    stream = accel.Stream(device=f"{_t()}:{_one()}")
    # torch: "torch.Stream device_type=openreg, device_index=1"; accel names the same things
    assert f"accel.Stream device={_t()}:{_one()}" in repr(stream)


def test_openreg_streams__test_stream_wait_stream(sim_backend):
    stream_1 = accel.Stream(device=f"{_t()}:0")
    stream_2 = accel.Stream(device=f"{_t()}:{_one()}")
    stream_2.wait_stream(stream_1)
    stream_2.synchronize()
    assert accel.current_device_index() == 0


def test_openreg_streams__test_stream_wait_event(sim_backend):
    s1 = accel.Stream(device=_t())
    s2 = accel.Stream(device=_t())
    e = s1.record_event()
    s2.wait_event(e)
    s2.synchronize()
    assert e.query()


# ======================================================================= test_event.py
def test_openreg_event__test_event_create(sim_backend):
    for event in (accel.Event(device=_t()), accel.Event(device=f"{_t()}:{_one()}"),
                  accel.Event()):
        assert event.device.type == _t()
        assert event.device.index is None
        assert event.event_id == 0

    stream = accel.Stream(device=f"{_t()}:{_one()}")
    event = stream.record_event()
    assert event.device.type == _t()
    assert event.device.index == _one()
    assert event.event_id != 0


def test_openreg_event__test_event_query(sim_backend):
    event = accel.Event()
    assert event.query()

    stream = accel.Stream(device=f"{_t()}:{_one()}")
    event = stream.record_event()
    event.synchronize()
    assert event.query()


def test_openreg_event__test_event_record(sim_backend):
    stream = accel.Stream(device=f"{_t()}:{_one()}")
    event1 = stream.record_event()
    assert event1.event_id != 0
    event2 = stream.record_event()
    assert event2.event_id != 0
    assert event1.event_id != event2.event_id


def test_openreg_event__test_event_elapsed_time(sim_backend):
    stream = accel.Stream(device=f"{_t()}:{_one()}")
    event1 = accel.Event(device=f"{_t()}:{_one()}", enable_timing=True)
    event1.record(stream)
    event2 = accel.Event(device=f"{_t()}:{_one()}", enable_timing=True)
    event2.record(stream)

    stream.synchronize()
    assert event1.query()
    assert event2.query()
    assert event1.elapsed_time(event2) >= 0


def test_openreg_event__test_event_wait_stream(sim_backend):
    stream1 = accel.Stream(device=_t())
    stream2 = accel.Stream(device=_t())
    event = stream1.record_event()
    stream2.wait_event(event)
    stream2.synchronize()


def test_openreg_event__test_event_synchronize(sim_backend):
    event = accel.Event(device=_t())
    assert event.query()

    stream = accel.Stream(device=_t())
    event.record(stream)
    event.synchronize()
    assert event.query()


def test_openreg_event__test_event_different_devices(sim_backend):
    _need_two()
    event0 = accel.Event(device=f"{_t()}:0")
    event1 = accel.Event(device=f"{_t()}:1")
    stream0 = accel.Stream(device=f"{_t()}:0")
    stream1 = accel.Stream(device=f"{_t()}:1")
    event0.record(stream0)
    event1.record(stream1)
    assert event0.device.index == 0
    assert event1.device.index == 1
    assert accel.current_device_index() == 0


def test_openreg_event__test_event_timing_disabled(sim_backend):
    event1 = accel.Event(device=f"{_t()}:{_one()}", enable_timing=False)
    event2 = accel.Event(device=f"{_t()}:{_one()}", enable_timing=False)
    stream = accel.Stream(device=f"{_t()}:{_one()}")
    event1.record(stream)
    event2.record(stream)
    stream.synchronize()
    with pytest.raises(ValueError,
                       match=r"Both events must be created with argument 'enable_timing=True'\."):
        event1.elapsed_time(event2)


def test_openreg_event__test_event_wait_event(sim_backend):
    stream1 = accel.Stream(device=_t())
    stream2 = accel.Stream(device=_t())
    event = stream1.record_event()
    stream2.wait_event(event)
    stream2.synchronize()
    assert event.query()


def test_openreg_event__test_device_synchronization(sim_backend):
    original_device = accel.current_device_index()
    try:
        accel.set_device_index(_one())
        x = _randn(100 * 100)
        y = _randn(100 * 100)
        z = _op(x)
        accel.synchronize()
        assert accel.current_device_index() == _one()
        # torch.sum(z): a result on the same device
        result = _op(z)
        assert result.device.type == _t()
        assert result.device.index == _one()
        assert y.device_index == _one()
        np.testing.assert_array_equal(result.to_numpy(np.float32), x.to_numpy(np.float32))
    finally:
        accel.set_device_index(original_device)


def test_openreg_event__test_blocking_vs_non_blocking_synchronization(sim_backend):
    stream = accel.Stream(device=f"{_t()}:0")

    event = accel.Event(device=f"{_t()}:0")
    assert event.query()
    assert event.event_id == 0
    assert event.device.index is None

    event.record(stream)
    assert event.event_id != 0
    x = _randn(50 * 50, device=0)
    y = _randn(50 * 50, device=0)
    _ = _op(x)
    _ = event.query()

    event.synchronize()
    assert event.query()
    assert event.device.index == 0

    event2 = stream.record_event()
    assert event2.event_id != 0
    for _ in range(4):
        _ = event2.query()
    event2.synchronize()
    assert event2.query()
    del y


def test_openreg_event__test_interleaved_stream_operations(sim_backend):
    stream = accel.Stream(device=f"{_t()}:0")
    x = _randn(50 * 50, device=0)
    y = _randn(50 * 50, device=0)

    event1 = stream.record_event()
    assert event1.event_id != 0
    z1 = _op(x)
    event2 = stream.record_event()
    assert event2.event_id != 0
    assert event1.event_id != event2.event_id
    _ = _op(z1)
    stream.synchronize()
    assert event1.query()
    assert event2.query()
    del y


def test_openreg_event__test_multiple_streams_wait_same_event(sim_backend):
    stream1 = accel.Stream(device=f"{_t()}:0")
    stream2 = accel.Stream(device=f"{_t()}:0")
    stream3 = accel.Stream(device=f"{_t()}:0")
    assert stream1.stream_id != stream2.stream_id
    assert stream2.stream_id != stream3.stream_id

    x = _randn(30 * 30, device=0)
    y = _randn(30 * 30, device=0)

    # torch's x and y are made on the current stream and read on stream2/stream3 with no
    # ordering (its kernels happen to be done); here stream1 waits for them first, so the
    # one event the two streams wait on covers the inputs
    stream1.wait_stream(accel.current_stream())
    event = stream1.record_event()
    assert event.event_id != 0

    stream2.wait_event(event)
    stream3.wait_event(event)

    with stream2:
        z2 = _op(x)
    with stream3:
        z3 = _op(x)

    accel.synchronize()
    assert event.query()
    np.testing.assert_array_equal(z2.to_numpy(np.float32), z3.to_numpy(np.float32))
    del y


def test_openreg_event__test_event_lifecycle(sim_backend):
    stream = accel.Stream(device=f"{_t()}:0")

    event1 = accel.Event(device=f"{_t()}:0")
    event1.record(stream)
    stream.synchronize()
    assert event1.query()
    event1.record(stream)
    stream.synchronize()
    assert event1.query()

    events = []
    for _ in range(2):
        event = accel.Event(device=f"{_t()}:0")
        event.record(stream)
        events.append(event)
    stream.synchronize()
    for event in events:
        assert event.query()


def test_openreg_event__test_generic_stream_event(sim_backend):
    stream = accel.Stream(_t())
    assert stream.device_index == accel.current_device_index()

    event1 = accel.Event(_t(), enable_timing=True)
    event2 = accel.Event(_t(), enable_timing=True)

    a = _randn(1000)
    b = _randn(1000)
    with accel.device_index(stream.device_index):
        _ = _op(a)
        event1.record(stream)
        event1.synchronize()
        event2.record()
        event2.synchronize()
        assert event1.elapsed_time(event2) >= 0
    del b


def test_openreg_event__test_stream_compatibility(sim_backend):
    s1 = accel.Stream(device=f"{_t()}:0")
    s2 = accel.Stream(device=f"{_t()}:0")
    original_stream = accel.current_stream()
    accel.set_stream(s1)
    assert accel.current_stream().stream_id == s1.stream_id
    accel.set_stream(s2)
    assert accel.current_stream().stream_id == s2.stream_id
    accel.set_stream(original_stream)
    assert accel.current_stream() == original_stream


# ====================================================================== test_device.py
def _multiprocessing_worker(device_idx, result_queue):
    """torch's worker for test_device_multiprocessing_spawn (module level: spawn pickles it)."""
    try:
        accel.set_device_index(device_idx)
        x = _randn(10 * 10)
        z = _op(x)
        result_queue.put(("success", device_idx, float(z.to_numpy(np.float32).sum())))
    except Exception as e:  # noqa: BLE001 - torch's worker reports any error
        result_queue.put(("error", device_idx, str(e)))


def test_openreg_device__test_device_count(sim_backend):
    assert accel.device_count() == (1 if sim_backend == "mps" else 2)


def test_openreg_device__test_device_switch(sim_backend):
    accel.set_device_index(_one())
    assert accel.current_device_index() == _one()
    accel.set_device_index(0)
    assert accel.current_device_index() == 0


def test_openreg_device__test_device_context(sim_backend):
    device = accel.current_device_index()
    with accel.device_index(None):
        assert accel.current_device_index() == device
    assert accel.current_device_index() == device

    with accel.device_index(_one()):
        assert accel.current_device_index() == _one()
    assert accel.current_device_index() == device


def test_openreg_device__test_invalid_device_index(sim_backend):
    # torch's OpenReg says "The device index is out of range"; accel's message names the index
    # and the valid range (TORCH_PORTS.md, test_xpu.py's row)
    n = accel.device_count()
    with pytest.raises(RuntimeError, match=f"device index {n} is out of range"):
        accel.set_device_index(n)
    assert accel.current_device_index() == 0


def test_openreg_device__test_device_capability(sim_backend):
    capability = accel.get_device_capability(f"{_t()}:0")
    supported_dtypes = capability["supported_dtypes"]
    # torch's get_all_dtypes(include_complex32=True, include_qint=True) lists torch dtypes
    # (bfloat16, complex32, quantized); accel's are numpy names: the backend's basic set
    expected = {"bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32"}
    assert all(dtype in supported_dtypes for dtype in expected)


def test_openreg_device__test_tensor_device(sim_backend):
    x = accel.Buffer(4 * 6, device=_t())
    assert x.device.type == _t()
    x = accel.Buffer(4 * 6, device=f"{_t()}:{_one()}")
    assert x.device.type == _t()
    assert x.device.index == _one()
    assert accel.current_device_index() == 0


def test_openreg_device__test_device_guard(sim_backend):
    original_device = accel.current_device_index()
    with accel.device_index(_one()):
        assert accel.current_device_index() == _one()
    assert accel.current_device_index() == original_device


def test_openreg_device__test_device_switch_persistence(sim_backend):
    old_index = accel.current_device_index()
    try:
        accel.set_device_index(_one())
        x = _randn(2 * 3)
        assert x.device.index == _one()
        y = _randn(3 * 3)
        assert y.device.index == _one()
    finally:
        accel.set_device_index(old_index)


def test_openreg_device__test_device_count_consistency(sim_backend):
    count = accel.device_count()
    assert count == (1 if sim_backend == "mps" else 2)
    for i in range(count):
        accel.set_device_index(i)
        assert accel.current_device_index() == i
    accel.set_device_index(0)


def test_openreg_device__test_device_poison_fork(sim_backend):
    # First, initialize in the parent process (torch.openreg.init())
    accel.current_device_index()
    assert accel.is_initialized()
    name = {"cuda": "CUDA", "xpu": "XPU", "mps": "MPS"}[sim_backend]

    def child():
        try:
            accel.Buffer(4)                  # Second, try to initialize in the child process
        except RuntimeError as e:
            expected = (f"Cannot re-initialize {name} in forked subprocess. To use {name} "
                        f"with multiprocessing, you must use the 'spawn' start method")
            return 0 if expected in str(e) else 3
        return 2

    assert run_forked(child) == 0
    # the parent is unharmed
    assert accel.Buffer(4).device_index == 0


def test_openreg_device__test_device_properties(sim_backend):
    device = accel.device(f"{_t()}:0")
    assert device.type == _t()
    assert device.index == 0
    device_str = str(device)
    assert _t() in device_str
    assert "0" in device_str

    capability = accel.get_device_capability(f"{_t()}:0")
    assert isinstance(capability, dict)
    assert "supported_dtypes" in capability
    supported_dtypes = capability["supported_dtypes"]
    assert isinstance(supported_dtypes, set)
    assert len(supported_dtypes) > 0

    capability1 = accel.get_device_capability(f"{_t()}:{_one()}")
    assert capability["supported_dtypes"] == capability1["supported_dtypes"]

    # torch.accelerator.get_memory_info(): (free, total) in torch 2.13, as accel's
    free, total = memory.get_memory_info()
    assert 0 <= free <= total


def test_openreg_device__test_current_device_after_operations(sim_backend):
    original_device = accel.current_device_index()
    x = _randn(2 * 3)
    y = _randn(2 * 3)
    z = _op(x)
    result = _op(z)
    assert x.device.index == original_device
    assert z.device.index == original_device
    assert result.device.index == original_device
    assert accel.current_device_index() == original_device

    accel.set_device_index(_one())
    assert accel.current_device_index() == _one()
    a = _randn(5 * 5)
    result2 = _op(a)
    assert a.device.index == _one()
    assert result2.device.index == _one()
    assert accel.current_device_index() == _one()
    accel.set_device_index(original_device)
    del y


def test_openreg_device__test_device_context_restoration(sim_backend):
    original_device = accel.current_device_index()
    try:
        with accel.device_index(_one()):
            assert accel.current_device_index() == _one()
            x = _randn(2 * 2)
            assert x.device.index == _one()
            raise ValueError("Test exception")
    except ValueError:
        pass
    assert accel.current_device_index() == original_device

    try:
        with accel.device_index(_one()):
            assert accel.current_device_index() == _one()
            with accel.device_index(0):
                assert accel.current_device_index() == 0
                raise RuntimeError("Nested exception")
    except RuntimeError:
        pass
    assert accel.current_device_index() == original_device


def test_openreg_device__test_concurrent_device_operations(sim_backend):
    original_device = accel.current_device_index()
    ndev = accel.device_count()
    num_threads = 4
    num_operations = 50
    errors = []
    barrier = threading.Barrier(num_threads)

    def worker_thread(thread_id):
        try:
            barrier.wait()
            for _ in range(num_operations):
                device_idx = thread_id % ndev      # torch: thread_id % 2 (two devices)
                accel.set_device_index(device_idx)
                current = accel.current_device_index()
                if current != device_idx:
                    errors.append(f"Thread {thread_id}: Expected device {device_idx}, got {current}")
                x = _randn(10 * 10)
                y = _randn(10 * 10)
                z = _op(x)
                result = _op(z)
                if x.device.index != device_idx:
                    errors.append(f"Thread {thread_id}: Tensor x on wrong device, expected "
                                  f"{device_idx}, got {x.device.index}")
                if result.device.index != device_idx:
                    errors.append(f"Thread {thread_id}: Result tensor on wrong device, expected "
                                  f"{device_idx}, got {result.device.index}")
                if accel.current_device_index() != device_idx:
                    errors.append(f"Thread {thread_id}: Device changed during operation")
                del y
        except Exception as e:  # noqa: BLE001 - torch's worker collects any error
            errors.append(f"Thread {thread_id}: {e}")

    with ThreadPoolExecutor(max_workers=num_threads) as executor:
        futures = [executor.submit(worker_thread, i) for i in range(num_threads)]
        for future in futures:
            future.result()

    assert len(errors) == 0, f"Errors occurred: {errors}"
    # the current device is per thread: the workers' switches left this thread's alone
    assert accel.current_device_index() == original_device
    accel.set_device_index(original_device)


def test_openreg_device__test_device_initialization_state(sim_backend):
    accel.current_device_index()                 # torch.openreg.init()
    assert accel.is_initialized()
    assert accel.device_count() > 0


def test_openreg_device__test_device_multiprocessing_spawn(sim_backend):
    ctx = multiprocessing.get_context("spawn")
    result_queue = ctx.Queue()
    p = ctx.Process(target=_multiprocessing_worker, args=(0, result_queue))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    assert not result_queue.empty()
    status, device_idx, result = result_queue.get(timeout=10)
    assert status == "success", result
    assert device_idx == 0


def test_openreg_device__test_device_state_after_errors(sim_backend):
    original_device = accel.current_device_index()
    error_raised = False
    try:
        x = _randn(5 * 5)
        y = _randn(3 * 3)
        # torch: a matmul of mismatched shapes; here a copy between buffers of other sizes
        x.copy_from(y)
    except (RuntimeError, ValueError):
        error_raised = True
    assert error_raised, "Expected an error for the size mismatch"
    assert accel.current_device_index() == original_device

    z = _randn(5 * 5)
    assert z.device.index == original_device
    w = _randn(5 * 5)
    _ = _op(z)
    z.copy_from(w)
    np.testing.assert_array_equal(z.to_numpy(np.float32), w.to_numpy(np.float32))


# ====================================================================== test_memory.py
@pytest.fixture
def clean_memory(sim_backend):
    gc.collect()
    memory.empty_cache()
    base = {d: memory.memory_allocated(d) for d in range(accel.device_count())}
    yield sim_backend
    gc.collect()
    for d, allocated in base.items():
        assert memory.memory_allocated(d) == allocated, f"device {d} kept memory"
    memory.empty_cache()


def test_openreg_memory__test_basic_allocation(clean_memory):
    x = accel.Buffer(4 * 100)
    assert x.device.type == _t()
    assert x.nbytes == 400
    z = accel.Buffer(4 * 10000)
    assert z.device.type == _t()
    assert z.nbytes == 40000
    w = accel.Buffer(4 * 10 * 20 * 30)
    assert w.device.type == _t()
    assert w.as_array(np.float32, (10, 20, 30)).shape == (10, 20, 30)


def test_openreg_memory__test_memory_lifecycle(clean_memory):
    x = accel.Buffer(4 * 1000)
    assert x.device.type == _t()
    del x
    gc.collect()
    y = accel.Buffer(4 * 1000)
    assert y.device.type == _t()
    del y
    gc.collect()


def test_openreg_memory__test_tensor_copy_operations(clean_memory):
    cpu_tensor = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    openreg_tensor = accel.Buffer(cpu_tensor.nbytes).copy_from(cpu_tensor)
    assert openreg_tensor.device.type == _t()
    assert openreg_tensor.nbytes == cpu_tensor.nbytes

    back_to_cpu = openreg_tensor.to_numpy(np.float32)
    assert isinstance(back_to_cpu, np.ndarray)
    np.testing.assert_allclose(cpu_tensor, back_to_cpu)

    cloned = _op(openreg_tensor)
    assert cloned.device.type == _t()
    np.testing.assert_allclose(openreg_tensor.to_numpy(np.float32), cloned.to_numpy(np.float32))


def test_openreg_memory__test_view_operations(clean_memory):
    x = _randn(100)
    original_data_ptr = x.ptr
    y = x.as_array(np.float32, (10, 10))
    assert y.ptr == original_data_ptr
    assert y.shape == (10, 10)
    z = x.as_array(np.float32, (10,), offset=4 * 10)
    assert z.size == 10
    assert z.ptr == original_data_ptr + 40


def test_openreg_memory__test_different_dtypes(clean_memory):
    for dtype in (np.float32, np.float64, np.int32, np.int64):
        x = accel.Buffer(np.dtype(dtype).itemsize * 100).as_array(dtype)
        assert x.device.type == _t()
        assert x.dtype == np.dtype(dtype)
        assert x.size == 100


def test_openreg_memory__test_empty_cache_operation(clean_memory):
    x = accel.Buffer(4 * 1000)
    y = accel.Buffer(4 * 2000)
    del x, y
    gc.collect()
    allocated = memory.memory_allocated()
    reserved = memory.memory_reserved()
    memory.empty_cache()                    # torch only checks that it does not crash
    assert memory.memory_allocated() == allocated
    assert memory.memory_reserved() <= reserved


def test_openreg_memory__test_large_allocation(clean_memory):
    size = 10 * 1024 * 1024 // 4
    x = accel.Buffer(4 * size)
    assert x.device.type == _t()
    assert x.nbytes == 4 * size


def test_openreg_memory__test_sequential_allocations_and_deallocations(clean_memory):
    for i in range(10):
        x = accel.Buffer(4 * (1000 + i * 100))
        assert x.device.type == _t()
        del x
    gc.collect()


def test_openreg_memory__test_tensor_from_blob(clean_memory):
    x = _randn(100)
    y = x.as_array(np.float32)              # x.view_as(x)
    assert x.ptr == y.ptr
    x.copy_from(np.full(100, 5.0, np.float32))  # x.fill_(5.0)
    assert np.all(y.to_numpy() == 5.0)


def test_openreg_memory__test_no_leak_simple_allocations(clean_memory):
    for _ in range(10):
        x = accel.Buffer(4 * 1000)
        del x
    gc.collect()
    for i in range(1000):
        x = accel.Buffer(4 * 1000)
        del x
        if i % 100 == 0:
            gc.collect()
    gc.collect()


def test_openreg_memory__test_no_leak_varying_sizes(clean_memory):
    sizes = [100, 500, 1000, 5000, 10000]
    for i in range(500):
        x = accel.Buffer(4 * sizes[i % len(sizes)])
        del x
        if i % 50 == 0:
            gc.collect()
    gc.collect()


def test_openreg_memory__test_no_leak_with_copies(clean_memory):
    for i in range(300):
        x = _randn(500)
        cpu_copy = x.to_numpy(np.float32)
        device_copy = accel.Buffer(cpu_copy.nbytes).copy_from(cpu_copy)
        cloned = _op(device_copy)
        del x, cpu_copy, device_copy, cloned
        if i % 50 == 0:
            gc.collect()
    gc.collect()


def test_openreg_memory__test_no_leak_with_views(clean_memory):
    for i in range(500):
        x = _randn(1000)
        view1 = x.as_array(np.float32, (10, 100))
        view2 = x.as_array(np.float32, (100,), offset=400)
        view3 = x.as_array(np.float32, (20, 50))
        del view1, view2, view3, x
        if i % 100 == 0:
            gc.collect()
    gc.collect()


def test_openreg_memory__test_no_leak_repeated_large_allocations(clean_memory):
    size = 50 * 1024 * 1024 // 4
    for _ in range(50):
        x = accel.Buffer(4 * size)
        del x
        gc.collect()
    gc.collect()


def test_openreg_memory__test_leak_detection_with_statistics(clean_memory):
    for _ in range(10):
        tensors = [accel.Buffer(4 * 1000) for _ in range(100)]
        assert len(tensors) == 100
        tensors.clear()
        gc.collect()
    final_tensor = accel.Buffer(4 * 10000)
    assert final_tensor.device.type == _t()
    del final_tensor


def test_openreg_memory__test_pin_memory(sim_backend):
    tensor = np.random.default_rng(0).standard_normal(10)
    assert not _pinned(tensor)
    # tensor.pin_memory(): accel pins at construction (no API to pin an existing array)
    pinned_tensor = accel.empty_pinned(10, np.float64)
    pinned_tensor[:] = tensor
    assert _pinned(pinned_tensor)
    slice_tensor = pinned_tensor[2:5]
    assert _pinned(slice_tensor)


def test_openreg_memory__test_allocation_on_device_1(clean_memory):
    accel.set_device_index(_one())
    try:
        x = accel.Buffer(4 * 100, device=f"{_t()}:{_one()}")
        assert x.device.type == _t()
        assert x.device.index == _one()
        del x
    finally:
        accel.set_device_index(0)


def test_openreg_memory__test_simultaneous_device_allocations(clean_memory):
    _need_two()
    x = accel.Buffer(4 * 100, device=f"{_t()}:0")
    y = accel.Buffer(4 * 200, device=f"{_t()}:1")
    assert x.device.index == 0
    assert y.device.index == 1
    assert x.ptr != y.ptr
    assert accel.current_device_index() == 0


def test_openreg_memory__test_memory_isolation_between_devices(clean_memory):
    _need_two()
    tensors_dev0 = [accel.Buffer(4 * 1000, device=f"{_t()}:0") for _ in range(10)]
    tensors_dev1 = [accel.Buffer(4 * 1000, device=f"{_t()}:1") for _ in range(10)]
    for t in tensors_dev0:
        assert t.device.index == 0
    for t in tensors_dev1:
        assert t.device.index == 1
    ptrs_dev0 = {t.ptr for t in tensors_dev0}
    ptrs_dev1 = {t.ptr for t in tensors_dev1}
    assert len(ptrs_dev0 & ptrs_dev1) == 0, "Devices should not share pointers"
    assert memory.memory_allocated(1) >= 10 * 4000


def test_openreg_memory__test_alternating_device_allocations(clean_memory):
    ndev = accel.device_count()
    tensors = []
    for i in range(20):
        device_idx = i % ndev
        t = accel.Buffer(4 * (100 + i), device=f"{_t()}:{device_idx}")
        assert t.device.index == device_idx
        tensors.append(t)
    for i, t in enumerate(tensors):
        assert t.device.index == i % ndev


def test_openreg_memory__test_tensor_to_different_device(clean_memory):
    _need_two()
    x = _randn(100, device=f"{_t()}:0")
    assert x.device.index == 0
    y = accel.Buffer(x.nbytes, device=f"{_t()}:1").copy_from(x)      # x.to("openreg:1")
    assert y.device.index == 1
    assert x.ptr != y.ptr or x.device != y.device
    np.testing.assert_allclose(x.to_numpy(np.float32), y.to_numpy(np.float32))
    assert accel.current_device_index() == 0


def test_openreg_memory__test_bidirectional_device_transfer(clean_memory):
    _need_two()
    original = _randn(100, device=f"{_t()}:0")
    original_cpu = original.to_numpy(np.float32)
    on_dev1 = accel.Buffer(original.nbytes, device=f"{_t()}:1").copy_from(original)
    np.testing.assert_allclose(original_cpu, on_dev1.to_numpy(np.float32))
    back_to_dev0 = accel.Buffer(on_dev1.nbytes, device=f"{_t()}:0").copy_from(on_dev1)
    np.testing.assert_allclose(original_cpu, back_to_dev0.to_numpy(np.float32))


# ========================================================================= test_rng.py
def test_openreg_rng__test_generator(sim_backend):
    generator = R.Generator(f"{_t()}:{_one()}")
    assert generator.device.type == _t()
    assert generator.device.index == _one()


def test_openreg_rng__test_rng_state(sim_backend):
    state = R.get_rng_state(0)
    R.set_rng_state(state, 0)
    states = R.get_rng_state_all()
    R.set_rng_state_all(states)
    assert len(states) == accel.device_count()
    np.testing.assert_array_equal(R.get_rng_state(0), state)


def test_openreg_rng__test_manual_seed(sim_backend):
    R.manual_seed_all(42)
    assert R.initial_seed() == 42
    with accel.device_index(_one()):
        assert R.initial_seed() == 42


def test_openreg_rng__test_seed(sim_backend):
    R.seed_all()
    seed1 = R.initial_seed()
    R.seed_all()
    seed2 = R.initial_seed()
    assert seed1 != seed2


def test_openreg_rng__test_create_generator_and_seed(sim_backend):
    generator = R.Generator(f"{_t()}:0")
    generator.manual_seed(42)
    assert generator.initial_seed() == 42


# ============================================================ test_utils.py, test_storage.py
def test_openreg_utils__test_open_device_dlpack(sim_backend):
    host = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    x_in = accel.Buffer(host.nbytes, device=_one()).copy_from(host)
    capsule = x_in.__dlpack__()
    x_out = accel.from_dlpack(capsule)
    assert x_out.device == x_in.device
    np.testing.assert_array_equal(x_in.to_numpy(np.float32), x_out.to_numpy(np.float32))


def test_openreg_storage__test_rewrapped_storage(sim_backend):
    pinned_a = accel.empty_pinned(10, np.float32)
    pinned_a[:] = np.random.default_rng(0).standard_normal(10)
    # torch: a tensor set_ on pinned_a's storage from its byte 2 on (5 floats)
    rewrapped_a = np.frombuffer(pinned_a, dtype=np.uint8)[2:2 + 5 * 4]
    assert _pinned(rewrapped_a)
    assert pinned_a.ctypes.data != rewrapped_a.ctypes.data


# ============================================= test/test_openreg.py (the older, single file)
def test_openreg__test_factory(sim_backend):
    a = accel.Buffer(4 * 50, device=_t())
    assert a.device.type == _t()
    a.copy_from(np.full(50, 3.5, np.float32))           # a.fill_(3.5)
    assert np.all(a.to_numpy(np.float32) == 3.5)


def test_openreg__test_printing(sim_backend):
    a = accel.Buffer(4 * 20, device=_t())
    a.copy_from(np.ones(20, np.float32))
    assert _t() in str(a)                               # does not crash
    assert _t() in repr(a.as_array(np.float32))


def test_openreg__test_cross_device_copy(sim_backend):
    a = np.random.default_rng(0).random(10).astype(np.float32)
    b = accel.Buffer(a.nbytes, device=_one()).copy_from(a)  # a.to("openreg") (.add(2): math)
    np.testing.assert_array_equal(b.to_numpy(np.float32), a)


def test_openreg__test_copy_same_device(sim_backend):
    ones = accel.Buffer(4 * 10, device=_one()).copy_from(np.ones(10, np.float32))
    a = _op(ones)
    np.testing.assert_array_equal(a.to_numpy(np.float32), np.ones(10, np.float32))


def test_openreg__test_cross_diff_devices_copy(sim_backend):
    _need_two()
    src = accel.Buffer(4 * 10, device=f"{_t()}:0").copy_from(np.ones(10, np.float32))
    a = accel.Buffer(4 * 10, device=f"{_t()}:1").copy_from(src).to_numpy(np.float32)
    np.testing.assert_array_equal(a, np.ones(10, np.float32))
    assert accel.current_device_index() == 0


def test_openreg__test_stream_synchronize(sim_backend):
    stream = accel.Stream(device=f"{_t()}:{_one()}")
    stream.synchronize()
    assert stream.query() is True


def test_openreg__test_event_elapsed_time(sim_backend):
    stream = accel.Stream(device=f"{_t()}:{_one()}")
    e1 = accel.Event(device=f"{_t()}:{_one()}", enable_timing=True)
    e1.record(stream)
    e2 = accel.Event(device=f"{_t()}:{_one()}", enable_timing=True)
    e2.record(stream)
    e2.synchronize()                    # only e2: e1 is done too, being before it on the stream
    assert e2.query()
    assert e1.elapsed_time(e2) >= 0


def test_openreg__test_event_wait_stream(sim_backend):
    s1 = accel.Stream(device=_t())
    s2 = accel.Stream(device=_t())
    e1 = s1.record_event()
    e1.wait(s2)
    s2.synchronize()
    assert e1.query()


def test_openreg__test_empty_tensor(sim_backend):
    empty_tensor = accel.Buffer(0, device=_t())
    out = empty_tensor.to_numpy(np.float32)
    assert out.shape == (0,)
