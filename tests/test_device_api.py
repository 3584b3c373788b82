"""The device part of the public API (issue: foundation), on the simulator and the real libcudart."""

import os
import subprocess
import sys

import pytest

import accel
from accel import _lazy


def _real_cudart_without_driver():
    """(ffi, lib) of the real libcudart when it loads and reports no driver, else None."""
    try:
        from accel._ffi import open_library
        ffi, lib, _ = open_library("cudart")
    except OSError:
        return None
    n = ffi.new("int *")
    return (ffi, lib) if lib.cudaGetDeviceCount(n) == 35 else None


needs_driverless_cudart = pytest.mark.skipif(
    _real_cudart_without_driver() is None,
    reason="needs the real libcudart on a machine without an NVIDIA driver (cudaGetDeviceCount -> 35)")


@needs_driverless_cudart
def test_real_libcudart_without_driver_is_unavailable_and_explains(monkeypatch):
    monkeypatch.setenv("ACCEL_BACKEND", "cuda")
    _lazy._reset_for_tests()
    assert accel.is_available() is False
    assert accel.device_count() == 0
    assert accel.current_accelerator() == accel.device("cuda")
    assert accel.current_accelerator(check_available=True) is None
    with pytest.raises(RuntimeError, match="none is available"):
        accel.synchronize()  # torch resolves the current device first, which needs one
    assert not accel.is_initialized()
    with pytest.raises(accel.AcceleratorError) as info:
        accel.set_device_index(0)
    assert info.value.code == 35
    assert info.value.code_name == "cudaErrorInsufficientDriver"
    assert "cudaErrorInsufficientDriver" in str(info.value)


@needs_driverless_cudart
def test_real_libcudart_selected_without_override_explains_too():
    # No ACCEL_BACKEND: nothing has a device, the first library that loads names the type.
    assert accel.is_available() is False
    assert accel.device_count() == 0
    with pytest.raises(accel.AcceleratorError, match="cudaErrorInsufficientDriver"):
        accel.set_device_index(0)


def test_import_is_small_and_initializes_nothing():
    code = ("import sys, accel; accel.is_available(); accel.device_count(); accel.current_accelerator();"
            "bad = [m for m in ('numpy', 'pycparser', 'cffi.cparser', 'cffi.api') if m in sys.modules];"
            "print(bad)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    for extra in ({}, {"ACCEL_SIM": "cuda"}):
        out = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "[]", extra


def test_sim_queries_do_not_initialize_runtime(sim_cuda):
    from accel import sim
    assert accel.is_available()
    assert accel.device_count() == 2
    assert accel.current_accelerator() == accel.device("cuda")
    assert not sim.state().runtime_initialized
    assert not accel.is_initialized()
    assert accel.current_device_index() == 0
    assert sim.state().runtime_initialized
    assert accel.is_initialized()


def test_set_device_index_and_context_manager(sim_cuda):
    accel.set_device_index(1)
    assert accel.current_device_index() == 1
    with accel.device_index(0) as entered:
        assert entered is None
        assert accel.current_device_index() == 0
    assert accel.current_device_index() == 1
    with accel.device_index(None):
        assert accel.current_device_index() == 1
    accel.set_device_index("cuda:0")
    assert accel.current_device_index() == 0
    accel.set_device_index(accel.device("cuda", 1))
    assert accel.current_device_index() == 1
    accel.set_device_index(-1)  # negative: a no-op, as torch
    assert accel.current_device_index() == 1


def test_device_index_restores_on_exception(sim_cuda):
    with pytest.raises(KeyError):
        with accel.device_index(1):
            raise KeyError
    assert accel.current_device_index() == 0


def test_deprecated_aliases_warn(sim_cuda):
    with pytest.warns(FutureWarning, match=r"Use `set_device_index` instead\."):
        accel.set_device_idx(1)
    with pytest.warns(FutureWarning, match=r"Use `current_device_index` instead\."):
        assert accel.current_device_idx() == 1


@pytest.mark.parametrize("bad, error, text", [
    (5, ValueError, r"out of range: 2 cuda devices visible \(valid indices 0\.\.1\)"),
    ("cuda:7", ValueError, r"valid indices 0\.\.1"),
    ("cuda", ValueError, "Expected a torch.device with a specified index or an integer, but got:cuda"),
    ("xpu:0", ValueError, "xpu doesn't match the current accelerator cuda."),
    ("gpu:0", ValueError, "Invalid device string"),
    ("cuda:x", ValueError, "Invalid device string"),
    (1.0, TypeError, "device must be an int"),
    (True, TypeError, "device must be an int"),
    ([0], TypeError, "device must be an int"),
])
def test_bad_device_arguments(sim_cuda, bad, error, text):
    with pytest.raises(error, match=text):
        accel.set_device_index(bad)
    assert accel.current_device_index() == 0


def test_get_device_capability(sim_cuda, monkeypatch):
    cap = accel.get_device_capability()
    assert {"float32", "float64", "int64", "bool"} <= cap["supported_dtypes"]
    assert cap["compute_capability"] == (9, 0)
    assert cap["multi_processor_count"] > 0
    assert cap["total_memory"] > 0 and cap["name"]
    cap["supported_dtypes"].clear()  # the caller's copy, not the cache
    assert accel.get_device_capability(0)["supported_dtypes"]
    assert accel.get_device_capability("cuda:1")["compute_capability"] == (9, 0)


def test_sim_compute_capability_and_count_configurable(monkeypatch):
    from conftest import use_sim
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DEVICES=3, ACCEL_SIM_CC="8.6")
    assert accel.device_count() == 3
    assert accel.get_device_capability(2)["compute_capability"] == (8, 6)


def test_synchronize(sim_cuda):
    accel.synchronize()  # before init: no-op
    assert not accel.is_initialized()
    accel.set_device_index(0)
    accel.synchronize()
    accel.synchronize(1)
    assert accel.current_device_index() == 0


def test_device_value():
    d = accel.device("cuda:1")
    assert (d.type, d.index) == ("cuda", 1)
    assert d == accel.device("cuda", 1) and hash(d) == hash(accel.device("cuda", 1))
    assert repr(accel.device("cuda")) == "device(type='cuda')"
    assert str(d) == "cuda:1"
    with pytest.raises(ValueError):
        accel.device("cuda:-1")
    with pytest.raises(AttributeError):
        d.index = 3


def test_no_backend_at_all_raises_torch_message(monkeypatch):
    from accel import backends
    monkeypatch.setattr(backends, "fallback", lambda: None)
    monkeypatch.setattr(backends, "select", lambda: None)
    assert accel.device_count() == 0 and not accel.is_available()
    assert accel.current_accelerator() is None
    with pytest.raises(RuntimeError, match="Cannot access accelerator device when none is available."):
        accel.current_device_index()


def test_bad_backend_name(monkeypatch):
    monkeypatch.setenv("ACCEL_BACKEND", "tpu")
    with pytest.raises(ValueError, match="expected one of cuda, xpu, mps"):
        accel.device_count()


def test_main_report_runs_under_sim_and_json(sim_cuda):
    env = {k: v for k, v in os.environ.items()}
    out = subprocess.run([sys.executable, "-m", "accel"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "accelerator: cuda" in out.stdout and "[simulated]" in out.stdout
    out = subprocess.run([sys.executable, "-m", "accel", "--json"], env=env, capture_output=True, text=True,
                         timeout=60)
    import json
    report = json.loads(out.stdout)
    assert report["selected"] == "cuda" and len(report["devices"]) == 2


def test_main_report_without_device():
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    out = subprocess.run([sys.executable, "-m", "accel"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "reason" in out.stdout
