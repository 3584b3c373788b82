"""The CUDA runtime x driver matrix on the simulator (issue 14 items 1 and 5), as a markdown table.

    python tools/runtime_matrix.py            # print the table
    python tools/runtime_matrix.py --json     # the cells as JSON

Rows: the installed runtimes (12.4, 12.8, 13.0 alone, and 12.4 with 13.0 side by side,
``ACCEL_SIM_CUDA_RUNTIME=12.4,13.0``); columns: the CUDA version the driver supports.
Each cell runs through the public API in this process on ``ACCEL_SIM=cuda``: the device
count, is_available(), init or its clear error, properties of device 1, and an RNG fill on
device 1 by the kernel path the chosen runtime offers (checked against the host Philox).
tests/test_runtime_matrix.py asserts every cell against :func:`expected`.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

RUNTIMES = ("12.4", "12.8", "13.0", "12.4,13.0")
DRIVERS = ("12.2", "12.4", "12.8", "13.0")
SEED = 0xC0FFEE


def version(text: str) -> int:
    major, minor = text.split(".")
    return 1000 * int(major) + 10 * int(minor)


def expected(runtimes: str, driver: str) -> dict:
    """What the hardware does and what accel must pick (REFERENCE.md "Runtime vs driver versions"):
    a runtime runs on a driver of its major or newer (minor-version compatibility within a
    major); among those accel takes the newest the driver fully supports (<= its version),
    else the newest that runs.  Kernels load through cudaLibrary* from 12.8, through the
    driver entry points before."""
    d = version(driver)
    runs = [v for v in map(version, runtimes.split(",")) if d // 1000 >= v // 1000]
    if not runs:
        return {"works": False, "chosen": None, "kernel_path": None}
    full = [v for v in runs if v <= d]
    chosen = max(full) if full else max(runs)
    return {"works": True, "chosen": chosen, "kernel_path": "library" if chosen >= 12080 else "driver"}


def run_cell(runtimes: str, driver: str) -> dict:
    """Run one cell in this process on the CUDA simulator; returns what happened."""
    import numpy as np

    import accel
    import accel.random as R
    from accel import _lazy, backends, sim
    from accel.random import philox

    os.environ["ACCEL_SIM"] = "cuda"
    os.environ["ACCEL_SIM_CUDA_RUNTIME"] = runtimes
    os.environ["ACCEL_SIM_CUDA_DRIVER"] = driver
    _lazy._reset_for_tests()
    sim.reset()
    cell = {"runtime": runtimes, "driver": driver, "count": accel.device_count(),
            "available": accel.is_available()}
    choice = backends.get("cuda").cudart_choice()
    cell["chosen"] = choice.chosen.version if choice.chosen else None
    cell["library"] = (f"libcudart {choice.chosen.version // 1000}.{choice.chosen.version % 1000 // 10}"
                       if choice.chosen else "none")
    try:
        props = accel.get_device_properties(1)
        cell["properties"] = (props.name, props.total_memory, props.multi_processor_count)
        backend = _lazy.lazy_init()
        cell.update(backend.kernel_path())
        R.manual_seed_all(SEED)
        with accel.device_index(1):
            buf = accel.Buffer(4 * 1000)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            R.random_raw_(buf)
            got = buf.to_numpy("uint32")
        cell["fill_ok"] = bool(np.array_equal(got, philox.raw_words(SEED, 0, 1000)))
        cell["fill_warnings"] = [str(w.message) for w in caught]
        cell["jit_compiles"] = sim.state().jit_compiles
        cell["outcome"] = "works"
        via = cell["kernel_path_detail"] if not cell["fill_warnings"] else "the host path"
        cell["message"] = (f"{cell['count']} devices, {props.multi_processor_count} SMs; RNG fill on cuda:1 "
                           f"via {via}; {cell['jit_compiles']} PTX JIT")
    except accel.AcceleratorError as exc:
        cell["outcome"] = "refused"
        cell["code"] = exc.code
        cell["message"] = (f"device_count() {cell['count']}, is_available() {cell['available']}; "
                           f"{exc}")
    return cell


def table(cells=None) -> str:
    cells = cells if cells is not None else [run_cell(r, d) for r in RUNTIMES for d in DRIVERS]
    rows = ["| installed runtime(s) | driver (CUDA) | chosen library | outcome | message |",
            "|---|---|---|---|---|"]
    for c in cells:
        message = c["message"].replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {c['runtime']} | {c['driver']} | {c['library']} | {c['outcome']} | {message} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cells = [run_cell(r, d) for r in RUNTIMES for d in DRIVERS]
    if "--json" in argv:
        print(json.dumps(cells, indent=2, default=str))
    else:
        print(table(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
