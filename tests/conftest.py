"""Shared fixtures: every test starts with accel's process state forgotten, and
``sim_backend`` runs a test once per simulated runtime."""

import os

import pytest

from accel import _lazy

_ENV_PREFIXES = ("ACCEL_", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "ZE_AFFINITY_MASK", "ZES_ENABLE_SYSMAN",
                 "ZE_ENABLE_ALT_DRIVERS",
                 "ZE_FLAT_DEVICE_HIERARCHY", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
_KEEP = ("ACCEL_TEST_SIMS",)

#: Simulators the shared suites run on; ACCEL_TEST_SIMS=cuda,xpu narrows it.
ALL_SIMS = ("cuda", "xpu", "mps")
SIMS = tuple(s for s in os.environ.get("ACCEL_TEST_SIMS", ",".join(ALL_SIMS)).split(",") if s)


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    """No test sees the developer's ACCEL_*/visible-device variables or another test's state."""
    for key in list(os.environ):
        if key.startswith(_ENV_PREFIXES) and key not in _KEEP:
            monkeypatch.delenv(key)
    _lazy._reset_for_tests()
    yield
    _lazy._reset_for_tests()


def use_sim(monkeypatch, kind: str, **env) -> str:
    """Switch this process to the ``kind`` simulator (fresh state), with extra env settings."""
    monkeypatch.setenv("ACCEL_SIM", kind)
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    _lazy._reset_for_tests()
    return kind


@pytest.fixture
def sim_cuda(monkeypatch):
    """The simulated CUDA runtime (2 devices by default)."""
    return use_sim(monkeypatch, "cuda")


@pytest.fixture(params=SIMS)
def sim_backend(request, monkeypatch):
    """Run the test once per simulated runtime; yields the backend name."""
    return use_sim(monkeypatch, request.param)


@pytest.fixture(params=[s for s in SIMS if s != "mps"])
def sim_graph_backend(request, monkeypatch):
    """Simulated runtimes with stream capture (Metal has none)."""
    return use_sim(monkeypatch, request.param)
