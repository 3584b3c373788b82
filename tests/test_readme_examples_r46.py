"""README.md says what runs: its "Use" and "Interop" examples print what their comments say on
every simulator, and the names, variables and options it lists exist (r46's README audit).

The "Your own kernels" example is run by tests/test_examples.py and the "Use" example under slow
streams by tests/test_current_stream_defaults.py; here the examples run as a reader would run
them, one after the other in one fresh interpreter, and each ``print(...)  # [...]`` comment is
checked against the printed line.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

with open(os.path.join(REPO, "README.md"), encoding="utf-8") as _fh:
    README = _fh.read()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end >= 0 else None]


def _python_block(title: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", _section(title), re.S)
    assert len(blocks) == 1, f"README section {title!r} should hold one python example, has {len(blocks)}"
    return blocks[0]


def _expected_prints(code: str):
    """The values the README's comments promise: ``print(...)  # [1. 1. 1. 1.]: ...``."""
    found = []
    for line in code.splitlines():
        m = re.match(r"\s*print\(.*\)\s*#\s*(\[[^\]]*\])", line)
        if m:
            found.append(np.array(m.group(1).strip("[]").split(), np.float32))
    return found


def _env(kind: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "CUDA_VISIBLE", "ZE_"))}
    env.update(ACCEL_SIM=kind, ACCEL_SIM_DEVICES="2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return env


def _printed_arrays(stdout: str):
    return [np.array(m.group(1).split(), np.float32)
            for m in re.finditer(r"^\[([-0-9.e+ ]+)\]", stdout, re.M)]


@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_use_then_interop_examples_print_what_the_readme_says(kind):
    use, interop = _python_block("Use"), _python_block("Interop")
    promised = _expected_prints(use) + _expected_prints(interop)
    assert len(promised) == 2, promised  # [1. 1. 1. 1.] after the copy, [ 8. 10. 12. 14.] from the view
    proc = subprocess.run([sys.executable, "-c", use + "\n" + interop], env=_env(kind), cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    printed = _printed_arrays(proc.stdout)
    # the Use example prints three arrays: the copy, the random fill (after the graph on cuda/xpu), the view
    assert len(printed) == 3, proc.stdout
    np.testing.assert_array_equal(printed[0], promised[0])
    np.testing.assert_array_equal(printed[2], promised[1])
    # the last read of buf: uniform draws (mps: the fill on s) or the graph's replayed copy of them
    assert ((printed[1] >= 0) & (printed[1] < 1)).all() and len(set(printed[1].tolist())) == 4, printed[1]
    assert f"accel {kind.upper()} memory summary, device ID 0" in proc.stdout, proc.stdout


def test_kernels_example_is_run_by_test_examples():
    """The "Your own kernels" block is extracted and run by tests/test_examples.py."""
    with open(os.path.join(REPO, "tests", "test_examples.py"), encoding="utf-8") as fh:
        assert '"## Your own kernels"' in fh.read()
    _python_block("Your own kernels")


def _env_table() -> str:
    return _section("Environment variables")


def test_every_documented_variable_is_read_and_every_read_variable_documented():
    documented = set(re.findall(r"`((?:ACCEL|CUDA|ZE)_[A-Z0-9_]+)`", _env_table()))
    sources = []
    for top in ("accel", "tools"):
        for root, _dirs, files in os.walk(os.path.join(REPO, top)):
            sources += [os.path.join(root, f) for f in files if f.endswith((".py", ".sh"))]
    text = ""
    for path in sources:
        with open(path, encoding="utf-8") as fh:
            text += fh.read()
    read = set(re.findall(r"""["'](ACCEL_[A-Z0-9_]+)["']""", text))
    internal = {"ACCEL_XPU_CHILD_SIM"}  # set by accel for its own probe child, not a user setting
    assert not {v for v in documented if v.startswith("ACCEL_")} - read, "documented but never read"
    assert not read - documented - internal, "read by the code but not in the README's table"
    for var in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "ZE_AFFINITY_MASK", "ZE_FLAT_DEVICE_HIERARCHY"):
        assert var in documented and var in text, var


def test_alloc_conf_row_names_every_option_that_has_an_effect():
    from accel.memory import _config
    row = next(line for line in _env_table().splitlines() if line.startswith("| `ACCEL_ALLOC_CONF`"))
    for key in _config.OPTIONS:
        if key in _config.TORCH_ONLY:
            continue  # accepted for PyTorch compatibility, no effect
        assert f"`{key}`" in row, key
    for var in _config.ENV_VARS[1:]:
        assert var in row, var


def test_api_table_names_exist():
    import accel
    import accel.memory
    import accel.random
    import accel.sim
    for name in ("device_count", "is_available", "current_accelerator", "set_device_index", "current_device_index",
                 "device_index", "set_device_idx", "current_device_idx", "get_device_capability", "synchronize",
                 "Stream", "Event", "current_stream", "set_stream", "Buffer", "Graph", "graph", "MemPool",
                 "use_mem_pool", "from_dlpack", "ArrayView", "ExternalStream", "get_stream_from_external",
                 "utilization", "memory_usage", "temperature", "power_draw", "clock_rate", "list_gpu_processes",
                 "compile", "Module", "launch", "empty_pinned", "device"):
        assert hasattr(accel, name), name
    for name in ("memory_stats", "memory_summary", "memory_snapshot", "empty_cache", "get_memory_info",
                 "set_per_process_memory_fraction"):
        assert hasattr(accel.memory, name), name
    for name in ("graphsafe_get_state", "graphsafe_set_state", "clone_state"):
        assert hasattr(accel.random.Generator, name), name
    for name in ("register_generator_state", "debug_dump", "pool", "replay", "reset"):
        assert hasattr(accel.Graph, name), name
    for name in ("from_handle", "__cuda_stream__"):
        assert hasattr(accel.Stream, name), name
    for name in ("as_array", "from_ptr", "__dlpack__", "copy_from", "copy_to", "to_numpy", "fill_"):
        assert hasattr(accel.Buffer, name), name
    assert callable(accel.sim.register_kernel)
