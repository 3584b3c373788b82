"""Every script in examples/ runs as a user would run it, on the simulator, and exits 0 (issue 18 item 5).

Each runs in a fresh interpreter with only the simulator's environment (no developer ACCEL_*
settings).  The CUDA examples compile with NVRTC, which needs no GPU: they are skipped, with the
reason, where NVRTC is not installed.
"""

import os
import subprocess
import sys

import pytest

from accel.backends.cuda import nvrtc as _nvrtc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")


def _run(script: str, sim: str, **env_extra) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "CUDA_VISIBLE_DEVICES"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    env.update(ACCEL_SIM=sim, ACCEL_SIM_DEVICES="2", **env_extra)
    return subprocess.run([sys.executable, os.path.join(EXAMPLES, script)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=180)


# script -> (simulator, needs NVRTC, what its output says on success)
CASES = {
    "saxpy_nvrtc.py": ("cuda", True, "equal numpy's bit for bit"),
    "graph_replay.py": ("cuda", True, "results equal bit for bit"),
    "saxpy_metal.py": ("mps", False, "match numpy"),
}


def test_every_example_is_tested():
    assert sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py")) == sorted(CASES)


@pytest.mark.parametrize("script", sorted(CASES))
def test_example_runs_on_the_simulator(script):
    sim, needs_nvrtc, success = CASES[script]
    if needs_nvrtc:
        why = _nvrtc.missing()
        if why:
            pytest.skip(f"{script} compiles with NVRTC, which is not available: {why}")
    proc = _run(script, sim)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert success in proc.stdout, proc.stdout
    assert "Simulated" in proc.stdout or "simulator" in proc.stdout, proc.stdout


@pytest.mark.parametrize("script", ["saxpy_nvrtc.py", "graph_replay.py"])
@pytest.mark.parametrize("sim", ["mps", "xpu"])
def test_cuda_examples_refuse_other_backends_with_the_reason(script, sim):
    """PTX runs on CUDA only: the scripts say so instead of failing inside Module or a capture."""
    proc = _run(script, sim)
    assert proc.returncode == 2 and "needs CUDA (or ACCEL_SIM=cuda)" in proc.stderr, proc.stderr
    if script == "graph_replay.py" and sim == "mps":
        assert "Metal has no stream capture" in proc.stderr


def test_metal_example_refuses_other_backends_with_a_hint():
    proc = _run("saxpy_metal.py", "cuda")
    assert proc.returncode == 2 and "ACCEL_SIM=mps" in proc.stderr, proc.stderr


def test_readme_kernel_example_runs_on_the_simulator(tmp_path):
    """The README's "Your own kernels" snippet is a working script."""
    why = _nvrtc.missing()
    if why:
        pytest.skip(f"the README example compiles with NVRTC, which is not available: {why}")
    with open(os.path.join(REPO, "README.md")) as fh:
        text = fh.read()
    section = text[text.index("## Your own kernels"):]
    code = section[section.index("```python\n") + 10:section.index("\n```")]
    script = tmp_path / "readme_saxpy.py"
    script.write_text(code + "\nprint('ok')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "CUDA_VISIBLE_DEVICES"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    env["ACCEL_SIM"] = "cuda"
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
