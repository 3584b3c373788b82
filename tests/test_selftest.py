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

from conftest import use_sim

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
    proc = _run(["--allow-sim", "--quick", "--json", str(out)])
    report = json.loads(out.read_text())
    assert proc.returncode == 0, json.dumps(report, indent=1)[:6000] + proc.stderr
    assert report["dry_run"] is True and report["skipped"] is False and report["ok"] is True
    assert [c["name"] for c in report["checks"]] == list(checks.CHECKS)
    for c in report["checks"]:
        assert c["status"] == "pass", c
        assert isinstance(c["details"], dict) and c["details"], c
    by_name = {c["name"]: c["details"] for c in report["checks"]}
    assert by_name["fork_rules"]["fork_after_init"]["message"].startswith("Cannot re-initialize CUDA")
    assert by_name["philox_kernel"]["kernels"] and by_name["philox_kernel"]["mismatches"] == {}
    assert by_name["bench_graph"]["ratio"] > 0 and by_name["bench_alloc"]["cached_pair_us"] > 0
    assert by_name["bench_rng_bandwidth"]["copy_gbps"] > 0


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
