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
from accel import _lazy, backends, sim
from accel._errors import AcceleratorError
from accel.backends import _visible
from accel.sim import core as sim_core
from conftest import run_forked, use_sim

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


# -- CUDA_VISIBLE_DEVICES entries are read as C strtoul reads them --------------------------------

# (value, ordinals of 2 devices): torch's test_cuda_nvml_based_avail documents unary signs
# ("2, +3, -0, 5" -> [2, 3, 0, 5]) and leading digits ("1gpu2" -> [1]); strtoul knows only the
# ASCII digits, so "1²" reads 1 and "١" (ARABIC-INDIC DIGIT ONE) is no number at all
STRTOUL_CASES = [("+1", [1]), ("-0,1", [0, 1]), ("1²", [1]), ("²", []), ("١", []), ("0,١", [0])]


@pytest.mark.parametrize("value, expected", STRTOUL_CASES)
def test_visible_entries_are_read_as_strtoul_reads_them(value, expected):
    from accel.sim import cudart
    assert _visible.visible_ordinals(value, 2, lambda: []) == expected
    assert cudart.visible_ordinals(value, 2) == expected      # the simulated runtime agrees


@pytest.mark.parametrize("value, expected", STRTOUL_CASES)
def test_the_count_before_init_is_the_runtimes(monkeypatch, value, expected):
    # "+1" counted 1 device but the simulated runtime found none at init; "1²" counted 0 and the
    # runtime 1 (a RuntimeWarning, and a count that changed under the caller)
    use_sim(monkeypatch, "cuda", CUDA_VISIBLE_DEVICES=value)
    assert accel.device_count() == len(expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if not expected:
            with pytest.raises(AcceleratorError, match="cudaErrorNoDevice"):
                accel.current_device_index()
            return
        accel.current_device_index()
    assert accel.device_count() == len(expected)
    assert [accel.get_device_properties(i).pci_bus_id for i in range(len(expected))] == \
        [sim_core.pci_bus(p) for p in expected]


# -- telemetry names the device CUDA_VISIBLE_DEVICES selects, however the runtime started ---------

def test_telemetry_follows_visible_devices_when_init_comes_before_any_count(monkeypatch):
    # With ACCEL_SIM (or ACCEL_BACKEND) set nothing counts before init; the NVML index of visible
    # device 0 was then taken from an unset CUDA_VISIBLE_DEVICES: GPU 0's readings for GPU 1
    use_sim(monkeypatch, "cuda", CUDA_VISIBLE_DEVICES="1")
    assert accel.current_device_index() == 0
    buf = accel.Buffer(1 << 20, device=0)
    assert backends.get("cuda").smi_index(0) == 1
    lines = accel.list_gpu_processes(0).splitlines()
    assert lines[0] == "GPU:1" and lines[1].startswith(f"process {os.getpid():>10d}"), lines
    assert accel.device_memory_used(0) > 0
    with pytest.raises(ValueError, match="not visible"):
        backends.get("cuda").smi_index(1)
    del buf


# -- telemetry in a forked child ----------------------------------------------------------------

def _child_reads_telemetry(parent_initialized: bool) -> int:
    # torch reads these through pynvml, calling nvmlInit each time, so they work in any child
    if accel.temperature(1) != 35 or accel.utilization(1) != 0 or accel.power_draw(0) != 70_000:
        return 3
    if not accel.list_gpu_processes(1).startswith("GPU:1") or accel.clock_rate(1) != 345:
        return 4
    if parent_initialized:
        try:
            accel.get_device_properties(1)
        except RuntimeError as exc:
            return 0 if "forked subprocess" in str(exc) else 5
        return 6
    return 0 if accel.get_device_properties(1).name else 7


@pytest.mark.parametrize("parent_initialized", [False, True])
def test_telemetry_in_a_forked_child(sim_cuda, parent_initialized):
    # The parent opened NVML to count; the child's NVML calls returned NVML_ERROR_UNINITIALIZED
    # ("nvmlDeviceGetCount_v2 failed") because nothing called nvmlInit_v2 in the child
    assert accel.device_count() == 2 and accel.temperature(0) == 35
    if parent_initialized:
        accel.set_device_index(1)
        accel.Stream()
    assert run_forked(lambda: _child_reads_telemetry(parent_initialized)) == 0
    assert accel.temperature(1) == 35     # the parent's NVML is untouched


# -- ZE_AFFINITY_MASK entries that are not ASCII numbers ------------------------------------------

@pytest.mark.parametrize("mask, count", [("²", 0), ("1²", 1), ("١", 0), ("0,²", 1), ("1,١", 1)])
def test_affinity_mask_entries_that_are_no_number_are_ignored(monkeypatch, mask, count):
    # "²" passed str.isdigit and int("²") raised ValueError out of device_count(); "١" counted 0
    # here while the simulated driver took it as 1.  "1²" is device 1: the driver reads a number
    # with std::stoul(s, nullptr, 0), which stops at the first character that is no digit (r82d)
    use_sim(monkeypatch, "xpu", ZE_AFFINITY_MASK=mask)
    assert accel.device_count() == count
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if not count:
            with pytest.raises(AcceleratorError):
                accel.current_device_index()
            return
        accel.current_device_index()
    assert accel.device_count() == count


# -- NVML failing for one device -----------------------------------------------------------------

def test_a_failing_uuid_read_falls_back_to_the_runtime_count(monkeypatch):
    # torch's _device_count_nvml returns -1 (ask the runtime) when a UUID cannot be read; accel
    # took the device's UUID as "" and counted 0 ("selects none"), then init found 1
    use_sim(monkeypatch, "cuda", CUDA_VISIBLE_DEVICES=sim_core.uuid_text(1))
    sim.inject_error("nvmlDeviceGetUUID", 999, times=-1, after=1)      # NVML device 1 only
    assert accel.device_count() == 1
    report = backends.get("cuda").report()
    assert "nvmlDeviceGetUUID" in report["count_path"] and "NVML_ERROR_UNKNOWN" in report["count_path"]
    # the readings need the same UUIDs: the failed call is named, not "device 0 is not visible"
    with pytest.raises(AcceleratorError, match="nvmlDeviceGetUUID.*NVML_ERROR_UNKNOWN"):
        accel.temperature(0)
    sim.clear_faults()
    assert accel.temperature(0) == 35 and backends.get("cuda").smi_index(0) == 1


# -- a process list that never fits ---------------------------------------------------------------

def _child_lists_processes_that_never_fit(kind: str) -> int:
    # the management library answers "too small" on every call, as if processes kept starting
    if kind == "cuda":
        sim.inject_error("nvmlDeviceGetComputeRunningProcesses_v3", 7, times=-1)   # INSUFFICIENT_SIZE
        call = "nvmlDeviceGetComputeRunningProcesses_v3"
    else:
        from accel._ffi import _ze
        code = _ze.ffi.typeof("ze_result_t").relements["ZE_RESULT_ERROR_INVALID_SIZE"]
        sim.inject_error("zesDeviceProcessesGetState", code, times=-1, after=1)     # after the count query
        call = "zesDeviceProcessesGetState"
    try:
        accel.list_gpu_processes(1)
    except AcceleratorError as exc:
        return 0 if call in str(exc) and "grow" in str(exc) else 3
    return 4


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_a_process_list_that_never_fits_is_an_error_not_a_hang(monkeypatch, kind):
    # CUDA doubled its buffer on every NVML_ERROR_INSUFFICIENT_SIZE until MemoryError; Level Zero
    # retried ZE_RESULT_ERROR_INVALID_SIZE forever (the child was killed as hung)
    use_sim(monkeypatch, kind)
    assert accel.device_count() == 2
    assert run_forked(lambda: _child_lists_processes_that_never_fit(kind), timeout=30) == 0
    assert accel.list_gpu_processes(1).startswith("GPU:1")


# -- cudaErrorInsufficientDriver says which driver is missing and what to install ------------------

@pytest.mark.parametrize("setting, match, expect", [
    (dict(driver=False), "cudaErrorInsufficientDriver", ["no NVIDIA driver is installed", "R580"]),
    # (r69g: without NVML the runtime's cudaDriverGetVersion is read before one is chosen, so the
    # choice itself refuses the only runtime, before loading it)
    (dict(nvml=False, driver_version="12.4"), "no libcudart the driver can run",
     ["the driver supports CUDA 12.4", "libcudart 13.0", "pip install nvidia-cuda-runtime-cu12"]),
])
def test_insufficient_driver_at_init_says_why_and_what_to_install(monkeypatch, setting, match, expect):
    # Without NVML to read the driver's version first, the runtime is loaded and init raised only
    # the vendor's "CUDA driver version is insufficient for CUDA runtime version", also where no
    # driver is installed at all; cudaDriverGetVersion (which starts nothing) tells which
    use_sim(monkeypatch, "cuda")
    sim.configure(**setting)
    assert accel.device_count() == 0
    with pytest.raises(AcceleratorError, match=match) as err:
        accel.current_device_index()
    for text in expect:
        assert text in str(err.value)
    assert expect[0] in backends.get("cuda").report()["reason"]


_PROBE_REAL_NO_DRIVER = """
import json, os, accel
from accel import backends
rep = backends.get("cuda").report()
out = {"library": rep.get("library"), "driver": os.path.exists("/proc/driver/nvidia/version")}
try:
    accel.current_device_index()
except Exception as exc:
    out["error"] = [type(exc).__name__, str(exc)]
print(json.dumps(out))
"""


def test_real_runtime_without_a_driver_says_no_driver_is_installed():
    got = _fresh_python(_PROBE_REAL_NO_DRIVER, ACCEL_BACKEND="cuda")
    if got["library"] is None or got["driver"]:
        pytest.skip("needs a real libcudart and no NVIDIA driver")
    name, text = got["error"]
    assert name == "AcceleratorError" and "no NVIDIA driver is installed" in text, got


# -- ACCEL_CUDART_PATH at a directory without the library, or at a link that leads nowhere ----------

def _runtime_error(monkeypatch, value: str) -> str:
    monkeypatch.setenv("ACCEL_BACKEND", "cuda")
    monkeypatch.setenv("ACCEL_CUDART_PATH", value)
    _lazy._reset_for_tests()
    assert accel.device_count() == 0
    with pytest.raises(AcceleratorError) as err:
        accel.current_device_index()
    return str(err.value)


def test_cudart_path_at_a_directory_without_the_library_names_the_directory(monkeypatch, tmp_path):
    # the message named a file the user never wrote (<dir>/libcudart.so.13: "no such file")
    text = _runtime_error(monkeypatch, str(tmp_path))
    assert f"ACCEL_CUDART_PATH={str(tmp_path)!r}" in text and "is a directory" in text, text
    assert "libcudart.so.13" in text and "libcudart.so.12" in text


def test_cudart_path_at_a_symlink_loop_says_so(monkeypatch, tmp_path):
    a, b = tmp_path / "libcudart.so.13", tmp_path / "b"
    os.symlink(b, a)
    os.symlink(a, b)
    text = _runtime_error(monkeypatch, str(a))      # was "no such file", beside a file that is there
    assert "symbolic link" in text and str(a) in text, text


# -- simulator latency settings that no sleep can take --------------------------------------------

@pytest.mark.parametrize("var", ["ACCEL_SIM_DELAY_US", "ACCEL_SIM_VMM_COST_US"])
@pytest.mark.parametrize("value", ["nan", "inf", "1e300", "-5"])
def test_sim_latency_settings_are_finite_and_bounded(monkeypatch, var, value):
    # "nan" and "inf" were taken: the first stream operation's worker died in time.sleep (ValueError,
    # OverflowError) and the caller waited for it; "-5" was refused without naming the variable
    use_sim(monkeypatch, "cuda", **{var: value})
    with pytest.raises(ValueError, match=f"{var}='{value}'"):
        accel.device_count()
    monkeypatch.delenv(var)
    sim.reset()
    key = "delay_us" if var == "ACCEL_SIM_DELAY_US" else "vmm_cost_us"
    with pytest.raises(ValueError, match=key):
        sim.configure(**{key: float(value)})
    assert getattr(sim.config(), key) == 0.0         # refused: unchanged


@pytest.mark.parametrize("value", ["99999999T", "0.5", "0"])
def test_sim_memory_setting_fits_the_vendor_fields(monkeypatch, value):
    # "99999999T" (2**66 bytes) was taken and get_device_properties / get_memory_info raised
    # OverflowError ('int too big to convert') writing totalGlobalMem, a size_t; "0.5" was refused
    # as "got 0", naming neither the variable nor the value given
    use_sim(monkeypatch, "cuda", ACCEL_SIM_MEMORY=value)
    with pytest.raises(ValueError, match=f"ACCEL_SIM_MEMORY='{value}'"):
        accel.device_count()
    monkeypatch.delenv("ACCEL_SIM_MEMORY")
    sim.reset()
    with pytest.raises(ValueError, match="memory"):
        sim.configure(memory=1 << 66)
    assert sim.config().memory == 8 << 30
