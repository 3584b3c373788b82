"""tools/bench.py runs end to end and reports well-formed rows (structure only: no timing asserts)."""

import io
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "tools", "bench.py")
GROUPS = {"import", "percall", "percall_real", "alloc", "rng", "graphs", "kernels"}


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def quick_json():
    proc = subprocess.run([sys.executable, BENCH, "--quick", "--json"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout), proc.stderr


def test_quick_json_rows_are_well_formed(quick_json):
    result, _ = quick_json
    assert result["quick"] is True
    rows = result["rows"]
    assert rows
    for r in rows:
        for key in ("name", "accel", "baseline", "ratio", "unit", "target", "ok", "group"):
            assert key in r, (key, r)
        assert not r.get("error"), r
        if r.get("skipped"):
            continue
        assert isinstance(r["accel"], (int, float)) and isinstance(r["baseline"], (int, float)), r
        assert r["ratio"] is None or isinstance(r["ratio"], float)
        if r["target"]:
            assert r["ok"] in (True, False), r
    assert {r["group"] for r in rows} == GROUPS


def test_quick_json_covers_every_benchmark(quick_json):
    names = " ".join(r["name"] for r in quick_json[0]["rows"])
    for needle in ("import+query (real libs)", "import+query (ACCEL_SIM=cuda)", "current_stream()",
                   "Event.record()", "Stream.query()", "real cudaRuntimeGetVersion", "peak reserved/allocated",
                   "cached 1 MiB alloc+free", "rng host Philox", "graph replay vs eager",
                   "sim accel.launch", "graph replay vs eager, 100 launches"):
        assert needle in names, needle


def test_progress_goes_to_stderr_as_plain_lines_when_not_a_tty(quick_json):
    _, stderr = quick_json
    assert "\r" not in stderr
    assert "[import]" in stderr and "graphs" in stderr


def test_only_selects_groups_and_table_has_the_columns():
    proc = subprocess.run([sys.executable, BENCH, "--quick", "--only", "percall", "--no-progress"], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    header = proc.stdout.splitlines()[0]
    for col in ("name", "accel", "baseline", "ratio", "target", "ok"):
        assert col in header
    assert "Stream.query()" in proc.stdout and "import+query" not in proc.stdout
    assert proc.stderr == ""


def test_unknown_group_is_a_usage_error():
    proc = subprocess.run([sys.executable, BENCH, "--only", "nope"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "unknown group(s) nope" in proc.stderr and "percall" in proc.stderr


def test_progress_uses_one_updating_line_on_a_tty():
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        import bench
    finally:
        sys.path.pop(0)

    class FakeTTY(io.StringIO):
        def isatty(self):
            return True

    out = FakeTTY()
    p = bench.Progress(out)
    p.update("first step")
    p.update("2nd")
    p.clear()
    text = out.getvalue()
    assert "\n" not in text
    assert text.startswith("\rfirst step") and "\r2nd" in text and text.endswith("\r")
