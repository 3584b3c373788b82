"""PyTorch's test/test_cuda_primary_ctx.py, ported to accel on the CUDA simulator: work on
device 1 alone must create no primary context on device 0.

torch reads ``torch._C._cuda_hasPrimaryContext(i)`` (cuDevicePrimaryCtxGetState); the simulator
records the same per device (``accel.sim.state().primary_contexts``): cudaSetDevice and
cudaInitDevice initialize their device's primary context (CUDA 12+), every other runtime call
but the device queries initializes the calling thread's current device's (accel/sim/cudart/devices.py,
``_NO_CONTEXT``).  Each test starts from a fresh simulated runtime (conftest), as torch's runs
in a new process.  tests/TORCH_PORTS.md lists the cases.
"""

import numpy as np
import pytest

import accel
from accel import sim

from conftest import use_sim

# accel's device scopes restore the previous device as torch's c10::cuda::MaybeSetDevice does:
# only when it has a primary context (CudaBackend.restore_device), else it is only recorded.


@pytest.fixture
def sim_cuda_fresh(monkeypatch):
    use_sim(monkeypatch, "cuda")
    assert accel.device_count() >= 2
    # setUp: no context has been created beforehand (counting uses NVML, not the runtime)
    assert not sim.state().runtime_initialized


def _contexts():
    return sim.state().primary_contexts


def test_cuda_primary_ctx__simulator_records_primary_contexts(sim_cuda_fresh):
    """The simulator's record: nothing before init; the device queries create none; the
    current device's is created by work on it."""
    accel.get_device_properties(1)
    assert _contexts() == [False, False]
    from accel.sim import cudart
    runtime = cudart._R
    runtime.tls.device = 0
    assert cudart.devices.cudaSetDevice(runtime, 1) == 0
    assert _contexts() == [False, True]


def test_cuda_primary_ctx__test_str_repr(sim_cuda_fresh):
    x = accel.random.normal_(accel.Buffer(4, 1))              # torch.randn(1, device="cuda:1")
    assert _contexts() == [False, True]
    str(x)
    repr(x)
    assert _contexts() == [False, True]


def test_cuda_primary_ctx__test_copy(sim_cuda_fresh):
    x = accel.random.normal_(accel.Buffer(4, 1))
    assert _contexts() == [False, True]
    y = np.empty(1, np.float32)                               # torch.randn(1, device="cpu")
    x.copy_to(y)                                              # y.copy_(x)
    assert _contexts() == [False, True]


def test_cuda_primary_ctx__test_pin_memory(sim_cuda_fresh):
    x = accel.random.normal_(accel.Buffer(4, 1))
    assert _contexts() == [False, True]
    x = accel.empty_pinned(3, np.float32)                     # torch.randn(3).pin_memory()
    assert _contexts() == [False, True]
    x = accel.empty_pinned(3, np.float32)                     # torch.empty(3, pin_memory=True)
    assert _contexts() == [False, True]


def test_a_deferred_restore_keeps_device_0_current_and_the_next_work_there_uses_device_0(sim_cuda_fresh):
    """The recorded device is the current one for every reader, and work on it goes to it."""
    x = accel.random.normal_(accel.Buffer(4, 1))
    assert _contexts() == [False, True]
    assert accel.current_device_index() == 0                 # the scope's restore, only recorded
    s = accel.current_stream()
    assert s.device_index == 0
    y = accel.Buffer(4)                                       # the current device: 0
    assert y.device_index == 0 and _contexts() == [True, True]
    y.copy_from(np.ones(1, np.float32))
    out = np.empty(1, np.float32)
    y.copy_to(out)
    assert out[0] == 1.0
    x.copy_to(out)                                            # device 1 again, and back
    assert accel.current_device_index() == 0


def test_each_thread_defers_its_own_restore(sim_cuda_fresh):
    import threading
    seen = {}

    def work(i):
        accel.random.normal_(accel.Buffer(4, 1))
        seen[i] = accel.current_device_index()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {0: 0, 1: 0, 2: 0} and _contexts() == [False, True]
    accel.set_device_index(1)                                 # an explicit set makes it current
    assert accel.current_device_index() == 1


def test_simulated_primary_ctx_get_state_follows_the_driver_rules(sim_cuda_fresh):
    from accel import _lazy
    from accel.sim import cuda_driver
    be = _lazy.lazy_init()
    accel.Buffer(4, 1)          # device 1 current meanwhile: the entry-point lookup touches only it
    assert be.has_primary_context(0) is False and be.has_primary_context(1) is True
    assert _contexts() == [False, True]
    d = cuda_driver._dffi()
    flags, active = d.new("unsigned int *"), d.new("int *")
    assert cuda_driver.cuDevicePrimaryCtxGetState(12345, flags, active) == cuda_driver.CUDA_ERROR_INVALID_DEVICE
    dev = d.new("CUdevice_v1 *")
    assert cuda_driver.cuDeviceGet(dev, 1) == 0
    assert cuda_driver.cuDevicePrimaryCtxGetState(dev[0], d.NULL, active) == cuda_driver.CUDA_ERROR_INVALID_VALUE
    assert cuda_driver.cuDevicePrimaryCtxGetState(dev[0], flags, active) == 0 and active[0] == 1
