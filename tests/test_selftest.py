"""``python -m accel.selftest`` without a device: the skip path, the simulator dry run,
independent checks with a timeout guard, and negative controls showing the checks can fail."""

import json
import os
import subprocess
import sys

import pytest

import accel
from accel import _selftest_checks as checks
from accel import selftest
from accel.backends.cuda import nvrtc as _nvrtc

from conftest import THOROUGH, use_sim

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, **env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "accel.selftest"] + args, env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=240)


@pytest.fixture
def no_real_device():
    if accel.is_available():
        pytest.skip("a real device is present: the no-device path cannot be shown here")


def test_without_a_device_it_says_why_and_exits_0(tmp_path, no_real_device):
    out = tmp_path / "report.json"
    proc = _run(["--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["skipped"] is True and report["checks"] == []
    assert report["reason"].startswith("no accelerator device") and "cuda:" in report["reason"]
    assert "skipped" in proc.stdout and report["reason"] in proc.stdout


def test_accel_sim_is_ignored_without_allow_sim(tmp_path, no_real_device):
    out = tmp_path / "report.json"
    proc = _run(["--json", str(out)], ACCEL_SIM="cuda")
    assert proc.returncode == 0, proc.stderr
    assert "ignoring ACCEL_SIM=cuda" in proc.stdout
    report = json.loads(out.read_text())
    assert report["skipped"] is True and report["dry_run"] is False


def test_dry_run_on_the_simulator_passes_every_check(tmp_path):
    out = tmp_path / "report.json"
    # default run: 512 MiB simulated devices (the OOM check allocates until OOM and fills half
    # the device afterwards; the allocator-trace bench needs ~240 MiB); THOROUGH: the tool's 1 GiB
    memory = {} if THOROUGH else {"ACCEL_SIM_MEMORY": "512M"}
    proc = _run(["--allow-sim", "--quick", "--json", str(out)], ACCEL_SIM_DEVICES="2", **memory)
    report = json.loads(out.read_text())
    assert proc.returncode == 0, json.dumps(report, indent=1)[:6000] + proc.stderr
    assert report["dry_run"] is True and report["skipped"] is False and report["ok"] is True
    assert [c["name"] for c in report["checks"]] == list(checks.CHECKS)
    for c in report["checks"]:
        if c["name"] == "user_kernel" and _nvrtc.missing():
            assert c["status"] == "skip" and "NVRTC is not available" in c["details"]["skipped"], c
            continue
        if c["name"] == "interop_peers":      # the peers read device memory; the simulator's is host memory
            assert c["status"] == "skip" and "simulator" in c["details"]["skipped"], c
            continue
        assert c["status"] == "pass", c
        assert isinstance(c["details"], dict) and c["details"], c
    by_name = {c["name"]: c["details"] for c in report["checks"]}
    assert by_name["fork_rules"]["fork_after_init"]["message"].startswith("Cannot re-initialize CUDA")
    assert by_name["philox_kernel"]["kernels"] and by_name["philox_kernel"]["mismatches"] == {}
    assert by_name["bench_graph"]["ratio"] > 0 and by_name["bench_alloc"]["cached_pair_us"] > 0
    assert set(by_name["bench_peers"]["us_per_call"]) == {"current_stream", "event_record", "stream_query",
                                                          "alloc_free_1MiB", "fill_small"}
    assert by_name["bench_rng_bandwidth"]["copy_gbps"] > 0
    assert by_name["multi_device"]["devices"] == 2
    assert set(by_name["multi_device"]["steps"].values()) == {"ok"}, by_name["multi_device"]


def test_user_kernel_check_on_the_simulator_says_so(monkeypatch):
    """The dry run compiles SAXPY with the real NVRTC, but the launch ran the registered reference:
    the record must not read as a device result (issue 18)."""
    if _nvrtc.missing():
        pytest.skip(f"NVRTC is not available: {_nvrtc.missing()}")
    use_sim(monkeypatch, "cuda")
    for device in (0, 1):
        record = selftest.run_check_here("user_kernel", device, quick=True)
        assert record["status"] == "pass", json.dumps(record, indent=1, default=repr)
        assert record["details"]["ran_on"].startswith("simulator"), record
        assert record["details"]["mismatches"] == 0 and record["details"]["entries"] == ["accel_selftest_saxpy"]


def test_user_kernel_check_skips_with_the_reason_without_nvrtc(monkeypatch):
    use_sim(monkeypatch, "cuda")
    from accel.backends.cuda import nvrtc as _nvrtc

    def absent():
        raise RuntimeError("no libnvrtc: pip install 'accel[nvrtc]'\nsearched: ...")

    monkeypatch.setattr(_nvrtc, "version", absent)
    details = checks.check_user_kernel(checks.Context(0, quick=True))
    assert details == {"skipped": "NVRTC is not available: no libnvrtc: pip install 'accel[nvrtc]'"}


def test_user_kernel_check_fails_when_the_result_is_wrong(monkeypatch):
    """Negative control: a reference that computes something else is caught."""
    if _nvrtc.missing():
        pytest.skip(f"NVRTC is not available: {_nvrtc.missing()}")
    use_sim(monkeypatch, "cuda")
    import numpy as np
    real = checks._saxpy_reference

    def off_by_one_ulp(grid, block, view, a, x, y, n):
        real(grid, block, view, a, x, y, n)
        ys = view(y, 4, np.uint32)
        ys[0] ^= 1

    monkeypatch.setattr(checks, "_saxpy_reference", off_by_one_ulp)
    with pytest.raises(checks.CheckFailed, match="saxpy differs from numpy in 1 of") as info:
        checks.check_user_kernel(checks.Context(0, quick=True))
    assert info.value.details["first_mismatch"] == 0
    assert "accel_selftest_saxpy" not in accel.sim.kernels.names()     # unregistered on the way out


def test_every_check_runs_and_reports_even_when_all_fail(tmp_path):
    out = tmp_path / "report.json"
    proc = _run(["--allow-sim", "--quick", "--device", "1", "--json", str(out)], ACCEL_SIM_DEVICES="1")
    assert proc.returncode == 1
    report = json.loads(out.read_text())
    assert [c["name"] for c in report["checks"]] == list(checks.CHECKS)
    for c in report["checks"]:
        assert c["status"] == "fail" and "device 1 does not exist" in c["error"], c


def test_a_check_that_overruns_its_timeout_is_killed_and_reported(monkeypatch):
    monkeypatch.setenv("ACCEL_SIM", "cuda")
    record = selftest.run_check_subprocess("fork_rules", quick=True, timeout=0.05, allow_sim=True)
    assert record["status"] == "timeout" and "did not finish" in record["error"]


def test_unknown_check_is_a_usage_error():
    proc = _run(["--only", "nope"])
    assert proc.returncode == 2 and "unknown check(s) nope" in proc.stderr


# -- negative controls: the checks detect what they are for ------------------------------------
def test_stream_order_check_fails_when_waits_do_nothing(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=3000)
    monkeypatch.setattr(accel.Event, "wait", lambda self, stream=None: None)
    with pytest.raises(checks.CheckFailed, match="stream ordering broken"):
        checks.check_stream_event_order(checks.Context(0, quick=True))


def test_philox_check_fails_when_host_and_device_differ(monkeypatch):
    use_sim(monkeypatch, "cuda")
    from accel.random import _fills
    real = _fills._raw
    monkeypatch.setattr(_fills, "_raw", lambda seed, offset, n: real(seed, offset, n) ^ 1)
    with pytest.raises(checks.CheckFailed, match="device fills differ from the host path") as info:
        checks.check_philox_kernel(checks.Context(0, quick=True))
    assert "raw_u32[n=1]" in info.value.details["mismatches"]


def test_alloc_copy_check_fails_when_a_copy_is_lost(monkeypatch):
    use_sim(monkeypatch, "cuda")
    real = accel.Buffer.copy_from

    def lossy(self, src, stream=None, non_blocking=False):
        if non_blocking and not isinstance(src, accel.Buffer) and self.nbytes > 64:
            return self     # drop pinned-staging copies of more than 64 bytes
        return real(self, src, stream, non_blocking)

    monkeypatch.setattr(accel.Buffer, "copy_from", lossy)
    with pytest.raises(checks.CheckFailed, match="pinned staging copy of 256 bytes"):
        checks.check_alloc_copy(checks.Context(0, quick=True))


# -- the multi-device check ----------------------------------------------------------------------
def test_multi_device_check_skips_with_one_device(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DEVICES=1)
    assert checks.check_multi_device(checks.Context(0, quick=True)) == {"skipped": "needs 2 or more devices: 1 visible"}


@pytest.mark.parametrize("device", [0, 1])
def test_multi_device_check_passes_on_two_simulated_devices(monkeypatch, sim_backend, device):
    use_sim(monkeypatch, sim_backend, ACCEL_SIM_DELAY_US=100)
    if accel.device_count() < 2:
        assert device == 1 or checks.check_multi_device(checks.Context(0, quick=True))["skipped"]
        return
    record = selftest.run_check_here("multi_device", device, quick=True)
    assert record["status"] == "pass", json.dumps(record, indent=1, default=repr)
    assert record["details"]["other"] == 1 - device


def test_multi_device_check_fails_when_a_cross_device_copy_is_lost(monkeypatch, sim_backend):
    if sim_backend == "mps":
        pytest.skip("mps: one device")
    real = accel.Buffer.copy_from

    def lossy(self, src, stream=None, non_blocking=False):
        if isinstance(src, accel.Buffer) and src.device_index != self.device_index:
            return self
        return real(self, src, stream, non_blocking)

    monkeypatch.setattr(accel.Buffer, "copy_from", lossy)
    lost = f"cross_device_copy: 0 -> 1: {sim_backend}:1 differs at byte"
    with pytest.raises(checks.CheckFailed, match=lost) as info:
        checks.check_multi_device(checks.Context(0, quick=True))
    assert info.value.details["steps"]["streams_events_on_other"] == "ok"


def test_multi_device_check_fails_when_an_operation_moves_the_current_device(monkeypatch, sim_backend):
    if sim_backend == "mps":
        pytest.skip("mps: one device")
    real = accel.Buffer.fill_

    def moving(self, value, stream=None):
        out = real(self, value, stream)
        accel.set_device_index(self.device_index)   # a fill that leaves its device current
        return out

    monkeypatch.setattr(accel.Buffer, "fill_", moving)
    with pytest.raises(checks.CheckFailed, match="changed the current device from 0 to 1"):
        checks.check_multi_device(checks.Context(0, quick=True))


# -- `pytest -m device` keeps the caller's choice of devices and libraries -------------------------
_CALLER_ENV = {"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
               "ACCEL_CUDART_PATH": "/opt/x/libcudart.so", "ACCEL_NVML_PATH": "/opt/x/libnvidia-ml.so.1",
               "ZE_AFFINITY_MASK": "1", "ACCEL_BACKEND": "cuda",
               "ACCEL_SIM": "cuda", "ACCEL_SIM_DEVICES": "3", "ACCEL_ALLOC_CONF": "max_split_size_mb:64",
               "PYTORCH_CUDA_ALLOC_CONF": "x", "ACCEL_TEST_SIMS": "cuda", "HOME": "/home/u"}
_DEVICE_CHOICE = {"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "ACCEL_CUDART_PATH", "ACCEL_NVML_PATH",
                  "ZE_AFFINITY_MASK", "ACCEL_BACKEND"}


def test_env_filter_keeps_device_choice_only_for_device_tests():
    from conftest import dropped_env
    assert set(dropped_env(_CALLER_ENV, device_test=True)) == {
        "ACCEL_SIM", "ACCEL_SIM_DEVICES", "ACCEL_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"}
    assert set(dropped_env(_CALLER_ENV, device_test=False)) == {
        "ACCEL_SIM", "ACCEL_SIM_DEVICES", "ACCEL_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"} | _DEVICE_CHOICE


_PROBE_VAR = "PYTEST_ACCEL_ENV_PROBE"    # no ACCEL_ prefix: the fixture under test must not drop it


def _write_probe(kind: str) -> None:
    path = os.environ.get(_PROBE_VAR)
    if not path:
        pytest.skip("probe for test_device_marked_tests_keep_the_callers_devices_and_libraries")
    with open(f"{path}.{kind}", "w") as fh:
        json.dump({k: os.environ.get(k) for k in _CALLER_ENV}, fh)


@pytest.mark.device
def test_env_probe_device():
    _write_probe("device")


def test_env_probe_plain():
    _write_probe("plain")


def test_device_marked_tests_keep_the_callers_devices_and_libraries(tmp_path):
    probe = str(tmp_path / "env")
    env = dict(os.environ, **_CALLER_ENV, **{_PROBE_VAR: probe})
    env.pop("ACCEL_TEST_ALLOC_CONF", None)      # (a rerun's knob sets an allocator variable in every test)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    device_probe = "tests/test_selftest.py::test_env_probe_device"
    plain_probe = "tests/test_selftest.py::test_env_probe_plain"
    if THOROUGH:    # as a caller runs them: `pytest -m device`, and a plain run
        runs = [["-m", "device", device_probe], [plain_probe]]
    else:           # one pytest (seconds each) runs both probes: the env filter goes by each test's marker
        runs = [[device_probe, plain_probe]]
    for args in runs:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"] + args, env=env,
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    seen_device = json.loads(open(probe + ".device").read())
    seen_plain = json.loads(open(probe + ".plain").read())
    for key, value in _CALLER_ENV.items():
        if key in _DEVICE_CHOICE:
            assert seen_device[key] == value, f"-m device dropped {key}"
            assert seen_plain[key] is None, f"a simulator test saw the caller's {key}"
        elif key in ("HOME", "ACCEL_TEST_SIMS"):
            assert seen_device[key] == seen_plain[key] == value
        else:
            assert seen_device[key] is None and seen_plain[key] is None, f"{key} leaked into a test"
