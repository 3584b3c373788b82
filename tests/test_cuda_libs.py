"""Which libcudart accel loads (issue 14 item 1): every candidate's version against the
driver's CUDA version, a verdict per candidate, and a clear error instead of
cudaErrorInsufficientDriver (35) from every call."""

import json
import os
import subprocess
import sys

import pytest

import accel
from accel import _lazy, sim
from accel.backends.cuda import libs as _cuda_libs
from accel.backends.cuda.libs import Candidate, choose

MAJORS = (13, 12)


def _cands(*versions):
    return [Candidate(f"/lib/{v}/libcudart.so.{v // 1000}", "test", f"/lib/{v}/libcudart.so", v) if v else
            Candidate("/missing/libcudart.so.12", "test", reason="not found") for v in versions]


def test_newest_runtime_the_driver_supports_is_taken():
    cands = _cands(13000, 12080, 12040, None)
    c = choose(cands, 12080, "nvml", MAJORS)
    assert c.usable and c.chosen.version == 12080
    verdicts = {x.version: (x.verdict, x.reason) for x in cands}
    assert verdicts[12080][0] == "taken"
    assert "needs a driver supporting CUDA 13.0" in verdicts[13000][1] and "12.8" in verdicts[13000][1]
    assert verdicts[12040] == ("rejected", "12.4 < 12.8: the newer one is preferred")
    assert cands[3].reason == "not found"


def test_a_runtime_newer_than_the_driver_within_its_major_is_second_choice():
    # Minor-version compatibility: 12.8 runs on a 12.2 driver, but one <= 12.4 is preferred.
    c = choose(_cands(12080, 12040), 12040, "nvml", MAJORS)
    assert c.chosen.version == 12040
    assert "minor-version compatibility" in c.candidates[0].reason
    c = choose(_cands(12080, 12040), 12020, "nvml", MAJORS)
    assert c.usable and c.chosen.version == 12080      # nothing <= 12.2: the newest 12.x runs
    assert "minor-version compatibility" in c.chosen.reason


def test_a_newer_major_driver_runs_older_runtimes():
    assert choose(_cands(12040), 13000, "nvml", MAJORS).chosen.version == 12040


def test_nothing_runnable_names_both_versions_and_what_to_install():
    c = choose(_cands(13000), 12040, "nvml", MAJORS)
    assert c.chosen is None and not c.usable
    assert "13.0" in c.error and "12.4" in c.error
    assert "pip install nvidia-cuda-runtime-cu12" in c.error and "R580" in c.error


def test_no_bindings_for_another_major():
    c = choose(_cands(11080), 12040, "nvml", MAJORS)
    assert c.chosen is None and "no bindings for CUDA major 11" in c.candidates[0].reason


def test_driver_unknown_takes_the_newest_with_bindings_and_says_so():
    c = choose(_cands(12040, 13000, 11080), None, "driver version unknown: NVML missing", MAJORS)
    assert c.chosen.version == 13000 and "NVML missing" in c.chosen.reason


def test_explicit_path_is_honoured_but_too_new_is_an_error():
    c = choose(_cands(13000), 12040, "nvml", MAJORS, explicit=True)
    assert c.chosen is not None and c.chosen.verdict == "taken"
    assert c.error and "13.0" in c.error and "12.4" in c.error and "nvidia-cuda-runtime-cu12" in c.error
    ok = choose(_cands(12040), 12080, "nvml", MAJORS, explicit=True)
    assert ok.usable and "ACCEL_CUDART_PATH" in ok.chosen.reason
    missing = choose(_cands(None), 12080, "nvml", MAJORS, explicit=True)
    assert missing.chosen is None and "ACCEL_CUDART_PATH" in missing.error


# -- the simulator with several installed runtimes -------------------------------

def _fresh(monkeypatch, runtime, driver):
    monkeypatch.setenv("ACCEL_SIM", "cuda")
    monkeypatch.setenv("ACCEL_SIM_CUDA_RUNTIME", runtime)
    monkeypatch.setenv("ACCEL_SIM_CUDA_DRIVER", driver)
    _lazy._reset_for_tests()
    sim.reset()


@pytest.mark.parametrize("driver,want", [("12.2", "12.4"), ("12.4", "12.4"), ("12.8", "12.4"), ("13.0", "13.0")])
def test_simulated_installed_runtimes_are_chosen_by_the_driver(monkeypatch, driver, want):
    _fresh(monkeypatch, "12.4,13.0", driver)
    assert accel.device_count() == 2
    backend = _lazy.lazy_init()
    rep = backend.report()
    assert rep["runtime_version"] == want
    assert rep["cudart_choice"]["chosen_version"] == want
    major, minor = want.split(".")
    assert sim.config().runtime_version == 1000 * int(major) + 10 * int(minor)   # the one "loaded"


def test_too_new_runtime_alone_is_not_available_and_says_why(monkeypatch):
    # Before: device_count() was 2 (NVML) and every call then failed with cudaErrorInsufficientDriver.
    _fresh(monkeypatch, "13.0", "12.4")
    assert accel.device_count() == 0
    assert not accel.is_available()
    from accel import backends
    reason = backends.get("cuda").report()["reason"]
    assert "13.0" in reason and "12.4" in reason and "nvidia-cuda-runtime-cu12" in reason
    with pytest.raises(accel.AcceleratorError, match=r"13\.0.*12\.4"):
        accel.get_device_properties(0)
    assert not sim.state().runtime_initialized


def test_python_m_accel_lists_every_candidate_with_its_verdict():
    env = {**os.environ, "ACCEL_SIM": "cuda", "ACCEL_SIM_CUDA_RUNTIME": "12.4,12.8,13.0",
           "ACCEL_SIM_CUDA_DRIVER": "12.4"}
    out = subprocess.run([sys.executable, "-m", "accel", "--json", "--no-smoke"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    choice = json.loads(out.stdout)["backends"]["cuda"]["cudart_choice"]
    verdicts = {c["version"]: c["verdict"] for c in choice["candidates"]}
    assert verdicts == {"13.0": "rejected", "12.8": "rejected", "12.4": "taken"}
    text = subprocess.run([sys.executable, "-m", "accel", "--no-smoke"], env=env, capture_output=True,
                          text=True, timeout=120).stdout
    assert "taken    accel.sim (libcudart 12.4)" in text and "needs a driver supporting CUDA 13.0" in text


# -- the real loader with a driver version from a (simulated) NVML ---------------

def _real_cudart_13():
    for c in _cuda_libs.real_candidates()[0]:
        _cuda_libs.probe(c)
        if c.version and c.version // 1000 == 13:
            return c.resolved
    return None


def test_explicit_real_runtime_too_new_for_the_driver_is_a_clear_error(monkeypatch):
    path = _real_cudart_13()
    if path is None:
        pytest.skip("no real libcudart 13 here (pip install nvidia-cuda-runtime)")
    from accel._ffi import _nvml
    from accel.backends.cuda import CudaBackend
    monkeypatch.setenv("ACCEL_CUDART_PATH", path)
    sim.reset()
    sim.configure(driver_version="12.4")
    nvml = sim.open_library("nvml")
    assert nvml.nvmlInit_v2() == 0
    try:
        backend = CudaBackend(simulated=False)
        backend._nvml = (_nvml.ffi, nvml, "accel.sim (nvml)")   # a driver supporting CUDA 12.4
        choice = backend.cudart_choice()
        assert choice.explicit and choice.chosen.resolved == path and choice.error
        assert backend.count() == 0
        with pytest.raises(accel.AcceleratorError) as err:
            backend.init()
        text = str(err.value)
        assert "13.0" in text and "CUDA 12.4" in text and "pip install nvidia-cuda-runtime-cu12" in text
        rep = backend.report()                      # still reports, no exception
        assert rep["count"] == 0 and "13.0" in rep["reason"] and rep["library_error"]
    finally:
        nvml.nvmlShutdown()
        sim.reset()


def test_cuda_pathfinder_is_a_candidate_when_importable(monkeypatch, tmp_path):
    import types
    lib = tmp_path / "libcudart.so.12"
    lib.write_bytes(b"")
    pf = types.ModuleType("cuda.pathfinder")
    pf.load_nvidia_dynamic_lib = lambda name: types.SimpleNamespace(abs_path=str(lib))
    cuda = types.ModuleType("cuda")
    cuda.pathfinder = pf
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.pathfinder", pf)
    cands, explicit = _cuda_libs.real_candidates()
    assert not explicit and (str(lib), "cuda.pathfinder") in [(c.path, c.source) for c in cands]
    monkeypatch.setitem(sys.modules, "cuda.pathfinder", None)   # not installed: no candidate, no error
    monkeypatch.delattr(cuda, "pathfinder")
    assert "cuda.pathfinder" not in [c.source for c in _cuda_libs.real_candidates()[0]]


def test_accel_cudart_path_may_name_a_directory(monkeypatch, tmp_path):
    (tmp_path / "libcudart.so.12").write_bytes(b"")
    monkeypatch.setenv("ACCEL_CUDART_PATH", str(tmp_path))
    cands, explicit = _cuda_libs.real_candidates()
    assert explicit and [c.path for c in cands] == [str(tmp_path / "libcudart.so.12")]
