"""Adversarial reliability of runtime discovery, device properties and telemetry: library
overrides that name the wrong file, malformed CUDA_VISIBLE_DEVICES / ZE_AFFINITY_MASK values,
NVML failing for one device, telemetry before and after lazy init and in a forked child.  Each
bad input or environment gives a clear Python exception naming it (or a documented fallback),
never a cffi error or a count that the initialized runtime then contradicts (r10_runtimes)."""

import json
import os
import subprocess
import sys
import warnings

import pytest

import accel
from accel import backends, sim
from accel._errors import AcceleratorError
from accel.backends import _visible
from accel.sim import core as sim_core
from conftest import use_sim
from test_cuda_strict_fixes import _run_forked

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fresh_python(code: str, **env) -> dict:
    """Run ``code`` in a new interpreter (vendor libraries are opened once per process) with
    the accel and visible-device variables of this process dropped and ``env`` set; its last
    stdout line, as JSON."""
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("ACCEL_", "CUDA_VISIBLE_DEVICES", "ZE_AFFINITY_MASK", "ZE_FLAT_DEVICE_HIERARCHY"))}
    full.update(env)
    full["PYTHONPATH"] = _REPO + (os.pathsep + full["PYTHONPATH"] if full.get("PYTHONPATH") else "")
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- a library override naming a library that is not the one asked for ---------------------------

_PROBE_WRONG_LIBRARY = """
import json, accel
from accel import backends
out = {}
try:
    out["count"] = accel.device_count()
except Exception as exc:
    out["count_error"] = [type(exc).__module__, type(exc).__name__, str(exc)]
out["report"] = backends.get(%r).report()
try:
    accel.get_device_properties(0)
except Exception as exc:
    out["use_error"] = [type(exc).__module__, type(exc).__name__, str(exc)]
print(json.dumps(out, default=str))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libc.so.6 is the stand-in library")
@pytest.mark.parametrize("var, backend, symbol", [("ACCEL_NVML_PATH", "cuda", "nvmlInit_v2"),
                                                  ("ACCEL_ZE_PATH", "xpu", "zeInit")])
def test_an_override_naming_another_library_is_refused_by_name(var, backend, symbol):
    # libc.so.6 loads everywhere and is neither NVML nor the Level Zero loader: counting gave a
    # cffi error ("symbol 'nvmlInit_v2' not found in library ...") from device_count(), and the
    # XPU backend's init the same for zeInit, instead of "this is not that library"
    got = _fresh_python(_PROBE_WRONG_LIBRARY % backend, ACCEL_BACKEND=backend, **{var: "libc.so.6"})
    assert "count_error" not in got, got
    assert isinstance(got["count"], int)
    if "use_error" in got:
        module, name, text = got["use_error"]
        assert module.startswith("accel") or name == "RuntimeError", got["use_error"]
    text = json.dumps(got["report"]) + json.dumps(got.get("use_error"))
    assert "libc.so.6" in text and symbol in text, got
