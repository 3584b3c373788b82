"""PyTorch's test/test_cuda_primary_ctx.py, ported to accel on the CUDA simulator: work on
device 1 alone must create no primary context on device 0.

torch reads ``torch._C._cuda_hasPrimaryContext(i)`` (cuDevicePrimaryCtxGetState); the simulator
records the same per device (``accel.sim.state().primary_contexts``): cudaSetDevice and
cudaInitDevice initialize their device's primary context (CUDA 12+), every other runtime call
but the device queries initializes the calling thread's current device's (accel/sim/cudart.py,
``_NO_CONTEXT``).  Each test starts from a fresh simulated runtime (conftest), as torch's runs
in a new process.  tests/TORCH_PORTS.md lists the cases.
"""

import numpy as np
import pytest

import accel
from accel import sim

from conftest import use_sim

# accel's device scopes restore the previous device with cudaSetDevice, which (CUDA 12+)
# initializes that device's primary context; torch restores with c10::cuda::MaybeSetDevice, which
# only records the device when it has no primary context yet.  Left for a follow-up (needs
# cuDevicePrimaryCtxGetState in the generated driver bindings and the simulator).
_RESTORE_CREATES_CONTEXT = pytest.mark.xfail(
    strict=True, reason="accel's device scope exit calls cudaSetDevice(0), creating device 0's primary context")


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
    assert cudart.cudaSetDevice(runtime, 1) == 0
    assert _contexts() == [False, True]


@_RESTORE_CREATES_CONTEXT
def test_cuda_primary_ctx__test_str_repr(sim_cuda_fresh):
    x = accel.random.normal_(accel.Buffer(4, 1))              # torch.randn(1, device="cuda:1")
    assert _contexts() == [False, True]
    str(x)
    repr(x)
    assert _contexts() == [False, True]


@_RESTORE_CREATES_CONTEXT
def test_cuda_primary_ctx__test_copy(sim_cuda_fresh):
    x = accel.random.normal_(accel.Buffer(4, 1))
    assert _contexts() == [False, True]
    y = np.empty(1, np.float32)                               # torch.randn(1, device="cpu")
    x.copy_to(y)                                              # y.copy_(x)
    assert _contexts() == [False, True]


@_RESTORE_CREATES_CONTEXT
def test_cuda_primary_ctx__test_pin_memory(sim_cuda_fresh):
    x = accel.random.normal_(accel.Buffer(4, 1))
    assert _contexts() == [False, True]
    x = accel.empty_pinned(3, np.float32)                     # torch.randn(3).pin_memory()
    assert _contexts() == [False, True]
    x = accel.empty_pinned(3, np.float32)                     # torch.empty(3, pin_memory=True)
    assert _contexts() == [False, True]
