"""The CUDA backend, streams, RNG and graphs under the hardware rules of issue 12.

Each test drives accel the way an 8-GPU machine would punish it: work for device 1
issued while device 0 is current, counting that starts the driver before a fork,
runtime errors that must not linger in the thread's last-error slot, kernels that
must be loaded before a capture, and JIT failures at the first launch.

Where a rule is about which device is current *when* the runtime is called, the
tests watch the simulated library directly (``_watch``): the legacy default stream
(handle 0) always resolves against the calling thread's current device, so a call
on "device 1's default stream" made with device 0 current silently lands on device
0 — no error code exists to catch it.
"""

import warnings

import numpy as np
import pytest

import accel
import accel.random as R
from accel import _lazy
from accel.random import philox
from conftest import run_forked

FORK_MESSAGE = ("Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, "
                "you must use the 'spawn' start method")

# cudart function -> index of its stream argument
_STREAM_ARG = {"cudaLaunchKernel": 5, "cudaGraphLaunch": 1, "cudaStreamQuery": 0, "cudaStreamSynchronize": 0,
               "cudaEventRecord": 1, "cudaMemcpyAsync": 4, "cudaMemsetAsync": 3, "cudaStreamWaitEvent": 0,
               "cudaStreamIsCapturing": 0}


def _backend():
    accel.current_device_index()        # initializes
    return _lazy.lazy_init()


def _watch(monkeypatch, backend, calls):
    """Record (function, current device, stream handle, stream's device or None for handle 0)
    for every cudart call that takes a stream."""
    lib, ffi = backend.lib, backend.ffi
    get_device, stream_device = lib.cudaGetDevice, lib.cudaStreamGetDevice

    def spy(name, fn, pos):
        def call(*args):
            cur = ffi.new("int *")
            get_device(cur)
            handle = int(ffi.cast("uintptr_t", args[pos]))
            owner = None
            if handle:
                d = ffi.new("int *")
                if stream_device(args[pos], d) == 0:
                    owner = d[0]
            calls.append((name, cur[0], handle, owner))
            return fn(*args)
        return call

    for name, pos in _STREAM_ARG.items():
        monkeypatch.setattr(lib, name, spy(name, getattr(lib, name), pos))


_NEED_CURRENT = ("cudaLaunchKernel", "cudaGraphLaunch")


def _assert_on(calls, index, names=None):
    """Every watched call went to a stream of device ``index`` with the current device
    the runtime needs: ``index`` for the legacy stream (handle 0) and for launches;
    any for other calls on created streams, whose handle names their device."""
    assert calls, "nothing was watched"

    def ok(name, current, handle, owner):
        if handle == 0 or name in _NEED_CURRENT:
            return current == index and owner in (None, index)
        return owner == index
    wrong = [c for c in calls if (names is None or c[0] in names) and not ok(*c)]
    assert not wrong, f"calls made with the wrong device current (want {index}): {wrong}"


# -- 1. stream work runs with the stream's device current --------------------------------

def test_default_stream_of_other_device_runs_there(sim_cuda, monkeypatch):
    backend = _backend()
    accel.set_device_index(0)
    s1 = accel.default_stream(1)
    buf = accel.Buffer(1024, device=1)          # current stream of device 1: its default stream
    assert buf.stream == s1
    calls = []
    _watch(monkeypatch, backend, calls)
    buf.fill_(7)
    data = np.arange(1024, dtype=np.uint8)
    buf.copy_from(data)
    buf.copy_from(data, non_blocking=True)
    out = buf.to_numpy()
    s1.query()
    s1.synchronize()
    e = accel.Event()
    e.record(s1)
    s1.wait_event(e)
    s1.wait_stream(accel.Stream(1))
    assert np.array_equal(out, data)
    assert accel.current_device_index() == 0
    _assert_on(calls, 1)


def test_launches_and_replays_run_with_the_stream_device_current(sim_cuda, monkeypatch):
    backend = _backend()
    accel.set_device_index(0)
    side = accel.Stream(1)
    buf = accel.Buffer(4096, device=1, stream=side)
    g = accel.Graph()
    with accel.graph(g, stream=side):
        R.uniform_(buf)
    calls = []
    _watch(monkeypatch, backend, calls)
    R.manual_seed_all(3)
    R.uniform_(buf)                       # on side: a created stream of device 1
    R.uniform_(accel.Buffer(64, device=1))  # on device 1's default stream
    accel.set_device_index(0)
    g.replay()                            # replays on the current stream of device 1 (its default)
    side.synchronize()
    accel.synchronize(1)
    assert accel.current_device_index() == 0
    _assert_on(calls, 1, names=("cudaLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync"))
    assert {c[0] for c in calls} >= {"cudaLaunchKernel", "cudaGraphLaunch"}


def test_rng_state_write_runs_on_its_device(sim_cuda, monkeypatch):
    from accel.random import _device
    backend = _backend()
    accel.set_device_index(0)
    gen = R.default_generator(1)
    gen.register_graph()
    gen.capture_prologue()
    gen.capture_epilogue()
    calls = []
    _watch(monkeypatch, backend, calls)
    gen.replay_prologue(4, stream=accel.default_stream(1).handle)
    accel.synchronize(1)
    _assert_on(calls, 1, names=("cudaLaunchKernel", "cudaMemcpyAsync"))
    assert _device.kernel_functions(backend, 1)


# -- 6. events of two devices ---------------------------------------------------------------

def test_elapsed_time_across_devices_is_refused_before_the_runtime(sim_cuda):
    from accel import sim
    a, b = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    a.record(accel.Stream(0))
    b.record(accel.Stream(1))
    before = sim.calls("cudaEventElapsedTime")
    with pytest.raises(ValueError, match="device 0.*device 1"):
        a.elapsed_time(b)
    assert sim.calls("cudaEventElapsedTime") == before
    with pytest.raises(ValueError, match="device 0 but the stream is on device 1"):
        a.record(accel.Stream(1))


# -- 2. fork after the driver was started by counting -------------------------------------

def _child_expects_fork_error() -> int:
    try:
        accel.Buffer(16)
    except RuntimeError as exc:
        return 0 if str(exc) == FORK_MESSAGE else 4
    return 5


def test_fork_after_counting_through_the_runtime_is_poisoned(sim_cuda):
    from accel import sim
    sim.configure(nvml=False)
    assert accel.device_count() == 2          # only cudaGetDeviceCount can count: the driver starts
    assert not accel.is_initialized()
    assert _lazy.backend().driver_started
    assert run_forked(_child_expects_fork_error) == 0
    # the child's count is the parent's (asking the runtime again would fail with error 3)
    assert run_forked(lambda: 0 if accel.device_count() == 2 else 6) == 0


def test_fork_after_counting_mig_uuids_is_poisoned(sim_cuda, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-4b4a7c23-0000-0000-0000-000000000000")
    accel.device_count()                     # MIG UUIDs: NVML can't map them, the runtime counts
    assert "cudart" in _lazy.backend().report()["count_path"]
    assert _lazy.backend().driver_started
    assert run_forked(_child_expects_fork_error) == 0


def test_fork_after_nvml_count_still_works(sim_cuda):
    assert accel.device_count() == 2
    assert not _lazy.backend().driver_started
    assert run_forked(lambda: 0 if accel.Buffer(16).nbytes == 16 else 7) == 0


def test_device_count_rereads_visible_devices_until_init(sim_cuda, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert accel.device_count() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert accel.device_count() == 2
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert accel.device_count() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert accel.device_count() == 1
    accel.current_device_index()             # the runtime read the variable once, at init
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert accel.device_count() == 1


# -- 5. counts reconciled after init ----------------------------------------------------------

def test_count_reconciled_with_the_runtime_after_init(sim_cuda, monkeypatch):
    backend = _lazy.backend()
    monkeypatch.setattr(type(backend), "_discover", lambda self: 3)   # NVML disagrees (e.g. MIG)
    assert accel.device_count() == 3
    with pytest.warns(RuntimeWarning, match="3.*2|2.*3"):
        accel.current_device_index()
    assert accel.device_count() == 2
    with pytest.raises(ValueError, match="out of index range"):
        accel.Stream(2)


# -- 3. the runtime's last error is cleared after errors accel handles -----------------------

def _last_error(backend) -> int:
    return backend.lib.cudaPeekAtLastError()


def test_raised_errors_are_cleared_from_the_last_error_slot(sim_cuda):
    from accel import sim
    backend = _backend()
    sim.inject_error("cudaMemsetAsync", 1)      # cudaErrorInvalidValue
    with pytest.raises(accel.AcceleratorError, match="cudaErrorInvalidValue"):
        accel.Buffer(16).fill_(1)
    assert _last_error(backend) == 0


def test_oom_recovery_leaves_no_last_error(sim_cuda):
    from accel import sim
    backend = _backend()
    keep = accel.Buffer(1 << 20)
    keep.close()                                # cached: an OOM can be recovered by freeing it
    sim.inject_oom(after=0, times=1)
    buf = accel.Buffer(32 << 20)
    assert buf.nbytes == 32 << 20
    assert _last_error(backend) == 0


def test_capture_errors_leave_no_last_error(sim_cuda):
    backend = _backend()
    s = accel.Stream()
    g = accel.Graph()
    with pytest.raises(accel.CaptureError):
        with s:
            g.capture_begin()
            try:
                accel.current_stream().synchronize()
            finally:
                g.capture_end()
    assert _last_error(backend) == 0


def test_clear_error_protocol_method(sim_cuda):
    from accel import sim
    backend = _backend()
    sim.inject_error("cudaStreamQuery", 1)
    assert backend.lib.cudaStreamQuery(backend.ffi.NULL) == 1
    assert _last_error(backend) == 1
    backend.clear_error()
    assert _last_error(backend) == 0


def test_timeout_is_not_a_capture_error(sim_cuda):
    from accel import sim
    _backend()
    sim.inject_error("cudaStreamSynchronize", 909)   # cudaErrorTimeout
    with pytest.raises(accel.AcceleratorError) as info:
        accel.Stream().synchronize()
    assert not isinstance(info.value, accel.CaptureError)
    assert info.value.code == 909


# -- 4. kernels loaded before capture; JIT failure falls back once ------------------------------

def test_kernels_are_loaded_before_the_capture_begins(sim_cuda, monkeypatch):
    backend = _backend()
    loads = []
    load = backend.lib.cudaLibraryLoadData

    def watched(*args):
        loads.append(backend._captures)
        return load(*args)
    monkeypatch.setattr(backend.lib, "cudaLibraryLoadData", watched)
    buf = accel.Buffer(256)
    g = accel.Graph()
    with accel.graph(g):
        R.uniform_(buf)
    g.replay()
    assert loads == [0], f"cudaLibraryLoadData ran during a capture: {loads}"


@pytest.mark.parametrize("code", [209, 218, 222])  # NoKernelImageForDevice, InvalidPtx, UnsupportedPtxVersion
def test_jit_failure_at_first_launch_falls_back_to_host_once(sim_cuda, code):
    from accel import sim
    _backend()
    R.manual_seed(11)
    sim.inject_error("cudaLaunchKernel", code)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = accel.Buffer(64)
        R.random_raw_(a)
        b = accel.Buffer(64)
        R.random_raw_(b)
    jit = [w for w in caught if "host path" in str(w.message)]
    assert len(jit) == 1, [str(w.message) for w in caught]
    assert np.array_equal(a.to_numpy(np.uint32), philox.raw_words(11, 0, 16))
    assert np.array_equal(b.to_numpy(np.uint32), philox.raw_words(11, 16, 16))


def test_jit_failure_at_load_falls_back_to_host_once(sim_cuda):
    from accel import sim
    _backend()
    R.manual_seed(5)
    sim.inject_error("cudaLibraryLoadData", 218, times=2)   # the fatbin, then its PTX fallback
    with pytest.warns(RuntimeWarning, match="host path"):
        a = accel.Buffer(32)
        R.random_raw_(a)
    assert np.array_equal(a.to_numpy(np.uint32), philox.raw_words(5, 0, 8))
