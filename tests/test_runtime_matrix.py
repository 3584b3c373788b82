"""Runtime x driver matrix (issue 14 item 5) through the public API on the simulator:
{runtime 12.4, 12.8, 13.0} x {driver 12.2, 12.4, 12.8, 13.0}.  Per cell: device count,
init or its clear error, properties, and an RNG fill on device 1 (device 0 current) by
the kernel path the runtime offers.

    python tests/test_runtime_matrix.py     # print the table (chosen library, outcome, message)
"""

import os
import sys
import warnings

import pytest

np = pytest.importorskip("numpy")

import accel  # noqa: E402
import accel.random as R  # noqa: E402
from accel import _lazy, sim  # noqa: E402
from accel.random import philox  # noqa: E402

RUNTIMES = ("12.4", "12.8", "13.0")
DRIVERS = ("12.2", "12.4", "12.8", "13.0")
SEED = 0xC0FFEE


def _version(text: str) -> int:
    major, minor = text.split(".")
    return 1000 * int(major) + 10 * int(minor)


def expected(runtime: str, driver: str) -> dict:
    """What the hardware does: a runtime needs a driver of its major version or newer (minor
    version compatibility within a major); kernels load through cudaLibrary* from 12.8 on,
    through the driver entry points before."""
    works = _version(driver) >= _version(runtime) // 1000 * 1000
    return {"works": works, "kernel_path": ("library" if _version(runtime) >= 12080 else "driver") if works else None}


def run_cell(runtime: str, driver: str) -> dict:
    """Run one cell in this process (the caller has set ACCEL_SIM=cuda); returns what happened."""
    os.environ["ACCEL_SIM_CUDA_RUNTIME"] = runtime
    os.environ["ACCEL_SIM_CUDA_DRIVER"] = driver
    _lazy._reset_for_tests()
    sim.reset()
    cell = {"runtime": runtime, "driver": driver, "count": accel.device_count()}
    try:
        props = accel.get_device_properties(1)
        cell["properties"] = (props.name, props.total_memory)
        backend = _lazy.lazy_init()
        rep = backend.report()
        cell["library"] = f"libcudart {rep.get('runtime_version')} ({rep.get('library')})"
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
        cell["message"] = (f"{cell['count']} devices; fill on cuda:1 via "
                           f"{cell['kernel_path_detail'] if not cell['fill_warnings'] else 'host path'}, "
                           f"{cell['jit_compiles']} PTX JIT")
    except accel.AcceleratorError as exc:
        cell["outcome"] = "refused"
        cell["message"] = f"device_count() {cell['count']}; {exc}"
        cell["code"] = exc.code
        rep = _lazy.backend().report()
        cell["library"] = f"libcudart {rep.get('runtime_version')} ({rep.get('library')})"
    return cell


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_cell(monkeypatch, runtime, driver):
    monkeypatch.setenv("ACCEL_SIM", "cuda")
    monkeypatch.setenv("ACCEL_SIM_CUDA_RUNTIME", runtime)
    monkeypatch.setenv("ACCEL_SIM_CUDA_DRIVER", driver)
    want = expected(runtime, driver)
    cell = run_cell(runtime, driver)
    if want["works"]:
        assert cell["outcome"] == "works", cell["message"]
        assert cell["count"] == 2 and cell["properties"][1] > 0
        assert cell["kernel_path"] == want["kernel_path"]
        assert cell["fill_ok"] and not cell["fill_warnings"], cell
        assert cell["jit_compiles"] == 0          # the fatbin's sm_90 SASS
    else:
        # Every runtime call returns cudaErrorInsufficientDriver (35); accel says so, naming the error.
        assert cell["outcome"] == "refused"
        assert cell["code"] == 35 or "needs a driver" in cell["message"], cell["message"]
        assert "InsufficientDriver" in cell["message"] or "needs a driver" in cell["message"]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_simulated_library_exports_exactly_the_real_symbols(monkeypatch, runtime):
    from accel.sim import cudart
    monkeypatch.setenv("ACCEL_SIM_CUDA_RUNTIME", runtime)
    sim.reset()
    lib = sim.open_library("cudart")
    functions = {n for n in dir(lib) if n.startswith("cuda") and callable(getattr(lib, n))}
    exported = cudart.exported_symbols(_version(runtime))
    assert functions <= exported
    simulated = {n for n in cudart._FUNCTIONS} | set(cudart._NO_INIT)
    assert functions == simulated & exported
    assert ("cudaLibraryLoadData" in functions) == (_version(runtime) >= 12080)
    assert ("cudaGetDriverEntryPointByVersion" in functions) == (_version(runtime) >= 12050)
    assert "cudaGetDriverEntryPoint" in functions


def test_versions_reach_every_reader(monkeypatch):
    from accel._ffi import _cudart, _nvml
    monkeypatch.setenv("ACCEL_SIM_CUDA_RUNTIME", "12.8")
    monkeypatch.setenv("ACCEL_SIM_CUDA_DRIVER", "12.2")
    sim.reset()
    lib, nvml = sim.open_library("cudart"), sim.open_library("nvml")
    v = _cudart.ffi.new("int *")
    assert lib.cudaRuntimeGetVersion(v) == 0 and v[0] == 12080
    assert lib.cudaDriverGetVersion(v) == 0 and v[0] == 12020
    n = _nvml.ffi.new("int *")
    assert nvml.nvmlInit_v2() == 0
    try:
        assert nvml.nvmlSystemGetCudaDriverVersion_v2(n) == 0 and n[0] == 12020
    finally:
        nvml.nvmlShutdown()
    assert not sim.state().runtime_initialized        # version queries start nothing


@pytest.mark.parametrize("var,value", [("ACCEL_SIM_CUDA_RUNTIME", "12.2"), ("ACCEL_SIM_CUDA_RUNTIME", "twelve"),
                                       ("ACCEL_SIM_CUDA_DRIVER", "12")])
def test_bad_version_settings_are_refused_by_name(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    sim.reset()
    with pytest.raises(ValueError, match=r"(ACCEL_SIM_CUDA_|runtime version|driver CUDA version).*"):
        sim.config()
    monkeypatch.delenv(var)
    sim.reset()
    assert sim.config().runtime_version == 13000


def table() -> str:
    os.environ["ACCEL_SIM"] = "cuda"
    rows = ["| runtime | driver | chosen library | outcome | message |", "|---|---|---|---|---|"]
    for runtime in RUNTIMES:
        for driver in DRIVERS:
            c = run_cell(runtime, driver)
            rows.append(f"| {runtime} | {driver} | {c.get('library')} | {c['outcome']} | {c['message']} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(print(table()))
