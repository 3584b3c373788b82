"""The shipped Philox PTX: it assembles, its signatures match what accel.random
passes, it keeps the bit-identity rules, it is up to date with its source, and
the simulator's per-thread models agree with the host path for any grid."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import THOROUGH

np = pytest.importorskip("numpy")

from accel.random import _device, _fills, philox  # noqa: E402
from accel.sim import kernels as sim_kernels  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTX_PATH = os.path.join(ROOT, "accel", "random", "kernels", "philox.ptx")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import regen_kernels  # noqa: E402

PTX = open(PTX_PATH).read()
# launch argument type -> PTX .param type
_PARAM = {"ptr": "u64", "u64": "u64", "i64": "u64", "u32": "u32", "i32": "u32", "f32": "f32", "f64": "f64"}
_COMMON = ["ptr", "u64", "u64", "u64", "ptr", "ptr"]

PLANS = {
    "raw_u32": _fills.plan_raw(16),
    "uniform_f32": _fills.plan_uniform(16, "float32", 0, 1),
    "uniform_f64": _fills.plan_uniform(16, "float64", 0, 1),
    "normal_f32": _fills.plan_normal(16, "float32", 0, 1),
    "normal_f64": _fills.plan_normal(16, "float64", 0, 1),
    "randint_i32": _fills.plan_randint(16, "int32", 0, 9),
    "randint_i64": _fills.plan_randint(16, "int64", 0, 9),
    "randint_i32_wide": _fills.plan_randint(16, "int32", 0, 2**30),
    "randint_i64_wide": _fills.plan_randint(16, "int64", 0, 2**40),
}


def _ptx_params(name):
    m = re.search(r"\.entry\s+" + name + r"\s*\((.*?)\)", PTX, re.S)
    assert m, f"{name} is not in the shipped PTX"
    return re.findall(r"\.param\s+\.(\w+)", m.group(1))


def test_plans_cover_every_kernel():
    assert set(PLANS) == set(_fills.KINDS)
    assert all(PLANS[k].kind == k for k in PLANS)
    assert set(_device.defined_kernels(PTX.encode())) == set(_fills.KERNEL_NAMES)


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_ptx_signature_matches_launch_arguments(kind):
    plan = PLANS[kind]
    launch_types = _COMMON + [t for t, _ in plan.kernel_args]
    assert _ptx_params(plan.kernel) == [_PARAM[t] for t in launch_types]
    assert list(sim_kernels.lookup(plan.kernel).argtypes) == launch_types


def test_store_state_signature():
    name = _fills.STORE_STATE
    assert _ptx_params(name) == ["u64", "u64", "u64", "u64"]
    assert sim_kernels.lookup(name).argtypes == ("ptr", "ptr", "u64", "u64")


def test_ptx_keeps_the_bit_identity_rules():
    # no fused multiply-add and every float op explicitly round-to-nearest (ptxas may not fuse .rn ops)
    assert not re.search(r"\b(fma|mad)\.[a-z0-9.]*f(32|64)", PTX)
    assert not re.search(r"\b(mul|add|sub)\.f(32|64)\b", PTX)
    assert re.search(r"^\.version 6\.3$", PTX, re.M) and re.search(r"^\.target sm_75$", PTX, re.M)


def test_constants_header_is_up_to_date():
    with open(regen_kernels.HEADER) as f:
        assert f.read() == regen_kernels.header_text(), "run python tools/regen_kernels.py"


PTXAS = shutil.which("ptxas") or ("/usr/local/cuda/bin/ptxas" if os.path.exists("/usr/local/cuda/bin/ptxas")
                                  else None)


@pytest.mark.skipif(PTXAS is None, reason="ptxas (CUDA toolkit) is not installed")
def test_ptx_assembles_for_every_supported_sm():
    checked = regen_kernels.ptxas_check(PTXAS, PTX_PATH)
    # sm_75..sm_90 are the contract; a ptxas that dropped one would be reported by the list
    for sm in ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90"):
        assert sm in checked, f"ptxas did not assemble for {sm} (checked: {checked})"


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None or PTXAS is None, reason="nvcc (CUDA toolkit) is not installed")
def test_shipped_ptx_is_regenerated_from_source():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "regen_kernels.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


# -- simulator models with arbitrary grids (fake device memory) -------------------------------
class FakeMemory:
    def __init__(self):
        self.blocks = {}

    def alloc(self, nbytes):
        base = (len(self.blocks) + 1) << 32
        self.blocks[base] = np.zeros(nbytes, np.uint8)
        return base

    def view(self, ptr, nbytes, dtype=None):
        for base, arr in self.blocks.items():
            if base <= ptr and ptr + nbytes <= base + arr.size:
                b = arr[ptr - base:ptr - base + nbytes]
                return b.view(dtype) if dtype is not None else memoryview(b)
        raise ValueError(f"0x{ptr:x}+{nbytes} is outside every allocation")


PLAN_MAKERS = {
    "raw_u32": (lambda nb: _fills.plan_raw(nb), 4),
    "uniform_f32": (lambda nb: _fills.plan_uniform(nb, "float32", -3, 0.5), 4),
    "uniform_f64": (lambda nb: _fills.plan_uniform(nb, "float64", 10, 20), 8),
    "normal_f32": (lambda nb: _fills.plan_normal(nb, "float32", 1, 3), 4),
    "normal_f64": (lambda nb: _fills.plan_normal(nb, "float64", 0, 1), 8),
    "randint_i32": (lambda nb: _fills.plan_randint(nb, "int32", -(2**31), 2**31), 4),
    "randint_i64": (lambda nb: _fills.plan_randint(nb, "int64", 5, 17), 8),
    "randint_i64_wide": (lambda nb: _fills.plan_randint(nb, "int64", -(2**63), 2**63), 8),
}


@pytest.mark.parametrize("kind", sorted(PLAN_MAKERS))
@pytest.mark.parametrize("grid,block", [((1, 1, 1), (1, 1, 1)), ((3, 1, 1), (7, 1, 1)), ((64, 1, 1), (256, 1, 1))])
def test_sim_model_equals_host_for_any_grid(kind, grid, block):
    make, size = PLAN_MAKERS[kind]
    mem = FakeMemory()
    seed, offset = 0xFEEDFACE12345678, 4 * (2**32 - 3)   # the counter crosses into word 1
    for n in (1, 2, 5, 8, 67):
        plan = make(n * size)
        out = mem.alloc(n * size)
        kernel = sim_kernels.lookup(plan.kernel)
        kernel.fn(grid, block, mem.view, out, plan.n, seed, offset, 0, 0, *[v for _, v in plan.kernel_args])
        want = plan.host(seed, offset)
        assert np.array_equal(mem.view(out, n * size, np.uint8), want.view(np.uint8)), (kind, n)


def test_sim_model_graph_safe_state_and_store_state():
    mem = FakeMemory()
    state = mem.alloc(16)
    store = sim_kernels.lookup(_fills.STORE_STATE)
    store.fn((1, 1, 1), (1, 1, 1), mem.view, state, state + 8, 42, 400)
    assert mem.view(state, 16, np.uint64).tolist() == [42, 400]
    out = mem.alloc(4 * 10)
    raw = sim_kernels.lookup("accel_philox_raw_u32")
    # seed argument ignored, offset argument is the intragraph offset added to *offset_ptr
    raw.fn((2, 1, 1), (4, 1, 1), mem.view, out, 10, 999, 8, state, state + 8)
    assert np.array_equal(mem.view(out, 40, np.uint32), philox.raw_words(42, 408, 10))


@pytest.mark.skipif(NVCC is None or PTXAS is None or shutil.which("fatbinary") is None,
                    reason="nvcc/ptxas/fatbinary (CUDA toolkit) are not installed")
def test_check_detects_a_stale_fatbin(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "philox.fatbin"
    shipped = open(regen_kernels.FATBIN, "rb").read()
    data = bytearray(shipped)
    data[len(data) // 2] ^= 0xFF
    stale.write_bytes(bytes(data))
    if not THOROUGH:
        # main's comparison is under test here: the default run hands it the shipped files as the
        # build's output (test_shipped_ptx_is_regenerated_from_source runs the real nvcc/ptxas/
        # fatbinary build and checks it equals them); THOROUGH builds again here
        with open(regen_kernels.PTX) as f:
            ptx = f.read()
        monkeypatch.setattr(regen_kernels, "build_ptx", lambda nvcc: ptx)
        monkeypatch.setattr(regen_kernels, "build_fatbin", lambda ptxas, fatbinary, text: shipped)
    monkeypatch.setattr(regen_kernels, "FATBIN", str(stale))
    monkeypatch.setattr(sys, "argv", ["regen_kernels.py", "--check"])
    assert regen_kernels.main() == 1
    assert "philox.fatbin" in capsys.readouterr().out


def test_fatbin_is_package_data():
    with open(os.path.join(ROOT, "setup.cfg")) as f:
        line = next(ln for ln in f if ln.startswith("accel.random ="))
    assert "kernels/*.fatbin" in line and "kernels/*.ptx" in line
