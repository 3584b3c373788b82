"""The self-test's device checks on a real accelerator (``pytest -m device``).

Each check of :mod:`accel._selftest_checks` runs exactly as ``python -m
accel.selftest`` runs it: in a fresh interpreter with no simulator, under the
check's own timeout, so a check that crashes or poisons the device context
cannot affect the next one.  On a machine without a device every test skips
with the backends' reasons.
"""

import json
import os
import subprocess
import sys

import pytest

from accel import _selftest_checks, selftest

from conftest import dropped_env

pytestmark = pytest.mark.device

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = ("import json, accel; from accel.selftest import _why_unavailable; a = accel.is_available(); "
          "print(json.dumps({'available': a, 'reason': '' if a else _why_unavailable()}))")


@pytest.fixture(scope="module")
def real_device():
    """Skip unless a real device is available (probed in a clean process: ACCEL_SIM unset, the
    caller's CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER and ACCEL_*_PATH kept, as in the checks)."""
    drop = set(dropped_env(os.environ, device_test=True))
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    probe = json.loads(proc.stdout.splitlines()[-1])
    if not probe["available"]:
        pytest.skip(f"needs a real accelerator (ACCEL_SIM unset): {probe['reason']}")
    return 0


@pytest.mark.parametrize("name", list(_selftest_checks.CHECKS))
def test_device_check(real_device, name):
    record = selftest.run_check_subprocess(name, device=real_device)
    assert record["status"] in ("pass", "skip"), json.dumps(record, indent=1, default=repr)[:8000]


def test_multi_device_check_from_the_second_device(real_device):
    """The same two-device checks with device 1 current and device 0 the other one."""
    record = selftest.run_check_subprocess("multi_device", device=1)
    if record["status"] == "fail" and "does not exist" in record.get("error", ""):
        pytest.skip(f"needs 2 or more devices: {record['error']}")
    assert record["status"] == "pass", json.dumps(record, indent=1, default=repr)[:8000]
