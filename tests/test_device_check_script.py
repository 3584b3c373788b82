"""tools/device_check.sh (everything that needs a device, as one script) on a machine without one:
it writes what it can (the environment, ``python -m accel``), says there is no device, exits 0."""

import os
import subprocess
import sys

import pytest

import accel
from conftest import dropped_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_without_a_device_it_says_so_and_exits_0(tmp_path):
    drop = set(dropped_env(os.environ, device_test=True))
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHON"] = sys.executable
    probe = subprocess.run([sys.executable, "-c", "import accel; print(accel.is_available())"], env=env,
                           capture_output=True, text=True, cwd=REPO, timeout=120)
    if probe.stdout.strip() == "True":
        pytest.skip("this machine has a device: tools/device_check.sh would run the device checks")
    out = tmp_path / "report"
    proc = subprocess.run(["bash", os.path.join(REPO, "tools", "device_check.sh"), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no accelerator device here" in proc.stdout
    assert (out / "env.txt").read_text().strip()
    assert accel.__version__ in (out / "main.txt").read_text()
    assert (out / "steps.txt").read_text().startswith("device_check: main rc=0")
