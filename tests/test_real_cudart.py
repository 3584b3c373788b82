"""The real CUDA runtime wheels, no driver needed (issue 14 item 6): .ci/run installs
nvidia-cuda-runtime-cu12==12.4.127 (older than 12.8: no cudaLibrary*) and
nvidia-cuda-runtime==13.0.96.  Each library loads, reports its version, exports every
non-optional function its major's bindings declare, and without a driver gives
cudaErrorInsufficientDriver (35) with accel's clear reason; ``python -m accel --json``
with ACCEL_CUDART_PATH at each wheel reports its version and that reason, no traceback.
Skipped, with the install command, where a wheel is absent."""

import json
import os
import subprocess
import sys

import pytest

import accel
from accel import _ffi, _lazy, backends
from accel._ffi import _site_dirs
from accel.backends.cuda import libs as _cuda_libs

#: major -> (wheel, its libcudart under site-packages, the version it is pinned to in .ci/run)
WHEELS = {12: ("nvidia-cuda-runtime-cu12", os.path.join("nvidia", "cuda_runtime", "lib", "libcudart.so.12"), 12040),
          13: ("nvidia-cuda-runtime", os.path.join("nvidia", "cu13", "lib", "libcudart.so.13"), 13000)}


def wheel_library(major: int) -> str:
    """The wheel's libcudart in this environment, or skip saying what to install."""
    wheel, rel, _ = WHEELS[major]
    for sp in _site_dirs():
        path = os.path.join(sp, rel)
        if os.path.exists(path):
            return path
    pytest.skip(f"the {wheel} wheel is not installed (pip install {wheel}; .ci/run does)")


def _no_driver():
    """Skip where a driver is installed: these are the no-driver answers."""
    if os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("an NVIDIA driver is installed here; these tests check the no-driver answers")


@pytest.fixture(params=sorted(WHEELS))
def wheel(request):
    return request.param, wheel_library(request.param)


def test_loads_and_reports_its_version(wheel):
    major, path = wheel
    ffi, lib, resolved = _ffi.open_cudart(path, major)
    v = ffi.new("int *")
    assert lib.cudaRuntimeGetVersion(v) == 0
    assert v[0] // 10 * 10 == WHEELS[major][2], v[0]
    probed = _cuda_libs.probe(_cuda_libs.Candidate(path, "test"))
    assert probed.version == WHEELS[major][2] and probed.version_from == "cudaRuntimeGetVersion"


def test_exports_every_declared_non_optional_function(wheel):
    major, path = wheel
    mod = _ffi.cudart_module(major)
    _ffi_, lib, _ = _ffi.open_cudart(path, major)
    missing = [f for f in mod.FUNCTIONS if not _ffi.has_symbol(lib, f)]
    assert set(missing) <= set(mod.OPTIONAL_SYMBOLS), missing
    if WHEELS[major][2] < 12080:            # 12.4: no cudaLibrary*, kernels via the driver entry points
        assert "cudaLibraryLoadData" in missing and _ffi.has_symbol(lib, "cudaGetDriverEntryPoint")


def test_no_driver_gives_insufficient_driver(wheel):
    _no_driver()
    major, path = wheel
    ffi, lib, _ = _ffi.open_cudart(path, major)
    n = ffi.new("int *")
    assert lib.cudaGetDeviceCount(n) == 35      # cudaErrorInsufficientDriver
    assert ffi.string(lib.cudaGetErrorName(35)) == b"cudaErrorInsufficientDriver"
    lib.cudaGetLastError()
    v = ffi.new("int *")
    assert lib.cudaDriverGetVersion(v) == 0 and v[0] == 0   # "0 if no driver is installed"


def test_accel_is_not_available_and_says_why(wheel, monkeypatch):
    _no_driver()
    major, path = wheel
    monkeypatch.setenv("ACCEL_CUDART_PATH", path)
    monkeypatch.setenv("ACCEL_BACKEND", "cuda")
    _lazy._reset_for_tests()
    assert not accel.is_available()
    rep = backends.get("cuda").report()
    assert rep["runtime_version"] == f"{major}.{WHEELS[major][2] % 1000 // 10}"
    assert os.path.realpath(rep["library"]) == os.path.realpath(path)
    assert "cudaErrorInsufficientDriver (35)" in rep["reason"] and "no NVIDIA driver" in rep["reason"]
    with pytest.raises(accel.AcceleratorError, match="cudaErrorInsufficientDriver"):
        _lazy.lazy_init()


def test_python_m_accel_json_reports_the_wheel(wheel):
    _no_driver()
    major, path = wheel
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    env["ACCEL_CUDART_PATH"] = path
    out = subprocess.run([sys.executable, "-m", "accel", "--json", "--no-smoke"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "Traceback" not in out.stdout + out.stderr, out.stderr
    cuda = json.loads(out.stdout)["backends"]["cuda"]
    assert cuda["runtime_version"] == f"{major}.{WHEELS[major][2] % 1000 // 10}"
    assert cuda["count"] == 0 and "cudaErrorInsufficientDriver (35)" in cuda["reason"]
    choice = cuda["cudart_choice"]
    assert choice["explicit"] and [c["verdict"] for c in choice["candidates"]] == ["taken"]


def test_both_wheels_installed_the_newest_is_taken_without_nvml():
    paths = [wheel_library(m) for m in (12, 13)]
    choice = _cuda_libs.choose_real(None, "driver version unknown: NVML missing")
    assert choice.chosen.version // 1000 == 13
    # the 12 wheel's file (by path, or by soname once this process loaded it) loses to 13
    c12 = [c for c in choice.candidates if c.version and c.resolved
           and os.path.realpath(c.resolved) == os.path.realpath(paths[0])]
    assert len(c12) == 1 and c12[0].verdict == "rejected" and "newer one is preferred" in c12[0].reason
    # a driver supporting CUDA 12.4 (NVML's answer on an R550 node) takes the 12.4 wheel
    choice = _cuda_libs.choose_real(12040, "test")
    assert choice.usable and choice.chosen.version == 12040
