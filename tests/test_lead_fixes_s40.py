"""The lead's own fixes of session 40 that no review file holds (each failed first on the
session's start, 8a8f2fb)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    env["PYTHONPATH"] = _REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def test_the_report_names_the_accelerator_type_current_accelerator_gives():
    """r85b noticed: with no device, ``python -m accel`` said "none available" (and ``--json``
    ``selected: None``) while ``accel.current_accelerator()`` names the type whose library loads
    (as a CUDA build of torch does).  The report now gives that type too."""
    probe = subprocess.run([sys.executable, "-c", "import accel; a = accel.current_accelerator(); "
                            "print(a.type if a is not None else None)"],
                           env=_env(), capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    kind = probe.stdout.strip()
    out = subprocess.run([sys.executable, "-m", "accel", "--json"], env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["accelerator_type"] == (None if kind == "None" else kind)
    text = subprocess.run([sys.executable, "-m", "accel"], env=_env(), capture_output=True, text=True,
                          timeout=120)
    line = next(ln for ln in text.stdout.splitlines() if ln.startswith("accelerator:"))
    if report["selected"] is None and kind != "None":
        assert f"current_accelerator() is {kind}" in line, line


def test_the_report_under_the_simulator_names_the_selected_type():
    out = subprocess.run([sys.executable, "-m", "accel", "--json"], env=_env(ACCEL_SIM="cuda"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["selected"] == report["accelerator_type"] == "cuda"
