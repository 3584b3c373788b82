"""CUDA_VISIBLE_DEVICES parsing (ported rules from torch/cuda/__init__.py) and the NVML count."""

import pytest

import accel
from accel.backends import _visible

UUIDS = ["GPU-aaaa1111", "GPU-aaaa2222", "GPU-bbbb3333"]


@pytest.mark.parametrize("value, expected", [
    (None, [0, 1, 2]),
    ("", []),
    ("0,1", [0, 1]),
    ("1", [1]),
    ("2,0", [2, 0]),
    ("1gpu2", [1]),          # strtoul reads the leading digits
    (" 1, 2", [1, 2]),
    ("0,-1,2", [0]),         # negative ends the list
    ("0,x,2", [0]),          # invalid ends the list
    ("0,0", []),             # a duplicate empties it
    ("0,7,1", [0]),          # ordinals past the count truncate
    ("GPU-aaaa1", [0]),
    ("GPU-bbbb,GPU-aaaa2", [2, 1]),
    ("GPU-aaaa", []),        # ambiguous prefix stops at once
    ("GPU-bbbb,1", [2]),     # the list stops at the first element without the prefix
    ("GPU-aaaa1,GPU-aaaa1111", []),  # the same device twice
    ("GPU-zzzz", []),
])
def test_visible_ordinals(value, expected):
    assert _visible.visible_ordinals(value, 3, lambda: UUIDS) == expected


def test_mig_needs_the_runtime():
    assert _visible.visible_ordinals("MIG-abc", 3, lambda: UUIDS) is None


@pytest.mark.parametrize("value, count", [("1", 1), ("0,1", 2), ("", 0), ("5", 0), ("1,0,3", 2)])
def test_sim_count_honours_visible_devices(monkeypatch, value, count):
    from conftest import use_sim
    use_sim(monkeypatch, "cuda", CUDA_VISIBLE_DEVICES=value)
    assert accel.device_count() == count
    from accel import sim
    assert not sim.state().runtime_initialized


def test_sim_count_by_uuid_prefix(monkeypatch):
    from conftest import use_sim
    use_sim(monkeypatch, "cuda")
    uuid1 = f"GPU-{accel.get_device_properties(1).uuid}"  # the runtime's view, as a user would copy it (torch's form)
    assert uuid1.startswith("GPU-")
    use_sim(monkeypatch, "cuda", CUDA_VISIBLE_DEVICES=uuid1[:12])
    assert accel.device_count() == 1


def test_count_falls_back_to_runtime_without_nvml(monkeypatch):
    from conftest import use_sim
    from accel import sim, backends
    use_sim(monkeypatch, "cuda")
    sim.configure(nvml=False)
    assert accel.device_count() == 2
    assert backends.get("cuda").report()["count_path"].startswith("cudart")
