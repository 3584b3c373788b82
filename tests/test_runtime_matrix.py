"""Runtime x driver matrix (issue 14 items 1 and 5) through the public API on the simulator:
{runtime 12.4, 12.8, 13.0, 12.4 and 13.0 installed together} x {driver 12.2, 12.4, 12.8, 13.0}.
Per cell: the libcudart chosen, device count, init or its clear error, properties, and an RNG
fill on device 1 (device 0 current) by the kernel path the runtime offers.  The cells are run
by tools/runtime_matrix.py, which prints the table:

    python tools/runtime_matrix.py
"""

import os
import sys

import pytest

np = pytest.importorskip("numpy")

from accel import sim  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import runtime_matrix  # noqa: E402

MATRIX_RUNTIMES = runtime_matrix.RUNTIMES
RUNTIMES = ("12.4", "12.8", "13.0")      # the simulated runtimes with export lists
DRIVERS = runtime_matrix.DRIVERS
_version = runtime_matrix.version


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("runtime", MATRIX_RUNTIMES)
def test_cell(monkeypatch, runtime, driver):
    monkeypatch.setenv("ACCEL_SIM", "cuda")
    monkeypatch.setenv("ACCEL_SIM_CUDA_RUNTIME", runtime)
    monkeypatch.setenv("ACCEL_SIM_CUDA_DRIVER", driver)
    want = runtime_matrix.expected(runtime, driver)
    cell = runtime_matrix.run_cell(runtime, driver)
    assert cell["chosen"] == want["chosen"], cell
    if want["works"]:
        assert cell["outcome"] == "works", cell["message"]
        assert cell["count"] == 2 and cell["available"] and cell["properties"][1] > 0
        assert cell["kernel_path"] == want["kernel_path"]
        assert cell["fill_ok"] and not cell["fill_warnings"], cell
        assert cell["jit_compiles"] == 0          # the fatbin's sm_90 SASS
    else:
        # No installed runtime runs on this driver: not available (NVML still sees 2 GPUs), and
        # the error names the runtime's and the driver's versions instead of a 35 from every call.
        assert cell["outcome"] == "refused" and cell["count"] == 0 and not cell["available"]
        assert "needs a driver supporting CUDA 13.0" in cell["message"], cell["message"]
        assert f"the driver supports CUDA {driver}" in cell["message"]
        assert not sim.state().runtime_initialized


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


if __name__ == "__main__":
    sys.exit(runtime_matrix.main())
