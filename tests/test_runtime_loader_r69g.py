"""How accel finds and picks vendor runtimes, against the vendors' compatibility rules (r69g).

Checked here, with the real libraries this machine has (libcudart 13.0 in /usr/local/cuda, the
pip wheels nvidia-cuda-runtime-cu12 12.4 and nvidia-cuda-runtime 13.0, nvidia-cuda-nvrtc 13.0,
Debian's libze_loader 1.8.12, no GPU driver) wherever they work without a device, and the
simulators elsewhere (``ACCEL_SIM_CUDA_RUNTIME`` / ``ACCEL_SIM_CUDA_DRIVER`` play the installed
runtimes and the CUDA version the driver supports; NVML and Level Zero faults are injected):

1. Which libcudart runs on a driver (REFERENCE.md "Runtime vs driver versions"; CUDA
   Compatibility guide): a 12.x runtime runs on any CUDA 12 driver (R525+), a 13.x runtime
   needs a CUDA 13 driver (R580+), a newer major never runs on an older driver; within a major
   the runtime the driver fully supports is preferred.  Every skipped runtime says why, in
   ``python -m accel`` and in the error.
2. Search order and overrides: ``ACCEL_CUDART_PATH`` (a file or a lib/ directory), the sonames,
   ``CUDA_HOME``/``CUDA_PATH``, the pip wheels; a bad ``ACCEL_*_PATH`` is refused naming it.
3. NVML: missing, ``nvmlInit_v2`` failing with NVML_ERROR_DRIVER_NOT_LOADED or with the
   NVML/RM version mismatch; the count falls back to the runtime (as torch's ``device_count``).
4. Level Zero: the loader's symbols against the driver's API version, a loader without Sysman,
   ``ZES_ENABLE_SYSMAN`` (legacy Sysman) and ``zesInit`` in one process.
5. A second attempt after a failure, and fork after a failed load or a failed init (torch:
   ``poison_fork()`` runs before ``_cuda_init``, so a child of a parent whose init failed is
   refused too; a failed ``_lazy_init`` is retried at the next call, its queue kept).

Bugs found are strict xfails whose reason names the cause (see the report of r69g).
"""

import ctypes
import json
import os
import shutil
import subprocess
import sys

import pytest

import accel
from accel import _lazy, backends, sim
from accel.backends.cuda import libs as _cuda_libs
from conftest import run_forked, use_sim

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NO_DRIVER = not os.path.exists("/proc/driver/nvidia/version")
ZE = sim.core.constants_of("_ze")


def _fresh_python(code: str, *args: str, **env) -> dict:
    """Run ``code`` in a new interpreter (vendor libraries are opened once per process) without
    this process's accel and visible-device variables, ``env`` set; its last line, as JSON."""
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("ACCEL_", "CUDA_VISIBLE_DEVICES", "ZE_", "ZES_", "CUDA_HOME", "CUDA_PATH"))}
    full.update(env)
    full["PYTHONPATH"] = _REPO + (os.pathsep + full["PYTHONPATH"] if full.get("PYTHONPATH") else "")
    out = subprocess.run([sys.executable, "-c", code, *args], env=full, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _real(major: int, source_prefix: str):
    """The resolved file of the real libcudart of ``major`` found by ``source_prefix`` (probed
    through accel's own search), else None."""
    for c in _cuda_libs.real_candidates()[0]:
        if c.source.startswith(source_prefix):
            _cuda_libs.probe(c)
            if c.version and c.version // 1000 == major:
                return c.resolved
    return None


# -- 1. which runtime runs on which driver (simulated runtimes and driver) ---------------------

_RULES = [
    # installed runtimes, the driver's CUDA version, the runtime accel must load (None: none runs)
    ("12.4,12.8,13.0", "12.6", "12.4"),   # the newest one the driver fully supports (<= 12.6)
    ("12.8", "12.2", "12.8"),             # minor-version compatibility: 12.8 on a 12.2 driver
    ("12.4,12.8", "12.2", "12.8"),        # nothing <= 12.2 installed: the newest 12.x
    ("12.4", "13.0", "12.4"),             # an older major runs on a newer driver
    ("12.4,13.0", "13.0", "13.0"),
    ("13.0", "12.8", None),               # 13.x needs a CUDA 13 (R580+) driver
    ("12.4,13.0", "11.8", None),          # a newer major never runs on an older driver
]


@pytest.mark.parametrize("installed, driver, want", _RULES)
def test_the_runtime_loaded_is_one_the_driver_runs(monkeypatch, installed, driver, want):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CUDA_RUNTIME=installed, ACCEL_SIM_CUDA_DRIVER=driver)
    be = backends.get("cuda")
    if want is None:
        assert accel.device_count() == 0 and not accel.is_available()
        reason = be.report()["reason"]
        for v in installed.split(","):
            assert f"libcudart {v}" in reason and f"CUDA {driver}" in reason, reason
        with pytest.raises(accel.AcceleratorError) as err:
            accel.current_device_index()
        assert f"CUDA {driver}" in str(err.value)
        assert not sim.state().runtime_initialized      # nothing started CUDA to find this out
        return
    assert accel.device_count() == 2
    accel.current_device_index()
    rep = be.report()
    assert rep["runtime_version"] == want and rep["cudart_choice"]["chosen_version"] == want
    taken = [c for c in rep["cudart_choice"]["candidates"] if c["verdict"] == "taken"]
    assert [c["version"] for c in taken] == [want]
    for c in rep["cudart_choice"]["candidates"]:
        assert c["reason"], c                          # every runtime, taken or not, says why


def test_python_m_accel_explains_a_minor_version_compatible_choice():
    # driver 12.2: 12.8 is taken by minor-version compatibility (nothing <= 12.2 installed),
    # 12.4 is older than it, 13.0 needs a CUDA 13 driver; each line says so
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "CUDA_VISIBLE"))},
           "ACCEL_SIM": "cuda", "ACCEL_SIM_CUDA_RUNTIME": "12.4,12.8,13.0", "ACCEL_SIM_CUDA_DRIVER": "12.2",
           "PYTHONPATH": _REPO}
    out = subprocess.run([sys.executable, "-m", "accel", "--json", "--no-smoke"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    choice = json.loads(out.stdout)["backends"]["cuda"]["cudart_choice"]
    why = {c["version"]: (c["verdict"], c["reason"]) for c in choice["candidates"]}
    assert choice["driver_cuda_version"] == "12.2" and choice["chosen_version"] == "12.8"
    assert why["12.8"][0] == "taken" and "minor-version compatibility" in why["12.8"][1]
    assert why["12.4"] == ("rejected", "12.4 < 12.8: the newer one is preferred")
    assert why["13.0"][0] == "rejected" and "needs a driver supporting CUDA 13.0" in why["13.0"][1]
    assert "the driver supports CUDA 12.2" in why["13.0"][1]


# (r69g found; fixed: _cuda_libs.driver_version_from_runtime)
def test_without_nvml_the_driver_version_still_picks_a_runtime_that_runs(monkeypatch):
    # A container started with NVIDIA_DRIVER_CAPABILITIES=compute has libcuda but no NVML.
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CUDA_RUNTIME="12.4,13.0", ACCEL_SIM_CUDA_DRIVER="12.4")
    sim.configure(nvml=False)
    assert accel.device_count() == 2, backends.get("cuda").report().get("reason")
    accel.current_device_index()
    assert backends.get("cuda").report()["runtime_version"] == "12.4"


# (r69g found; fixed: the note names NVML's own error)
def test_the_choice_names_why_nvml_gave_no_driver_version(monkeypatch):
    use_sim(monkeypatch, "cuda")
    sim.inject_error("nvmlInit_v2", 18, times=-1)       # NVML_ERROR_LIB_RM_VERSION_MISMATCH
    rep = backends.get("cuda").report()
    note = rep["cudart_choice"]["driver_version_from"]
    assert "18" in rep["nvml_error"] and "mismatch" in rep["nvml_error"]
    assert "NVML missing" not in note and ("18" in note or "mismatch" in note), note


# (r69g found; fixed: a same-major 35 names the branch minimum)
def test_insufficient_driver_from_a_same_major_driver_does_not_contradict_itself(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CUDA_RUNTIME="12.8", ACCEL_SIM_CUDA_DRIVER="12.2")
    sim.inject_error("cudaGetDeviceCount", 35, times=-1)
    with pytest.raises(accel.AcceleratorError, match="cudaErrorInsufficientDriver") as err:
        accel.current_device_index()
    text = str(err.value)
    assert "the driver supports CUDA 12.2" in text
    assert "needs a driver supporting CUDA 12.0 or newer" not in text, text
    assert "pip install nvidia-cuda-runtime-cu12" not in text, text


# -- 3. NVML missing or failing ------------------------------------------------------------------

def test_nvml_driver_not_loaded_falls_back_to_the_runtime_count(monkeypatch):
    # torch's _raw_device_count_nvml: nvmlInit failing -> -1 -> torch._C._cuda_getDeviceCount()
    use_sim(monkeypatch, "cuda")
    sim.inject_error("nvmlInit_v2", 9, times=-1)          # NVML_ERROR_DRIVER_NOT_LOADED
    assert accel.device_count() == 2
    rep = backends.get("cuda").report()
    assert rep["count_path"].startswith("cudart") and "Driver Not Loaded" in rep["nvml_error"]
    # the runtime's count started the driver: a forked child is refused with torch's words
    def child():
        try:
            accel.current_device_index()
        except RuntimeError as exc:
            return 0 if "Cannot re-initialize CUDA in forked subprocess" in str(exc) else 2
        return 3
    assert run_forked(child) == 0


def test_no_driver_at_all_says_so_after_nvml_and_the_runtime_both_refuse(monkeypatch):
    use_sim(monkeypatch, "cuda")
    sim.configure(driver=False)       # nvmlInit_v2: DRIVER_NOT_LOADED; cudart: 35, driver version 0
    assert accel.device_count() == 0
    rep = backends.get("cuda").report()
    assert "Driver Not Loaded" in rep["nvml_error"] and "no NVIDIA driver is installed" in rep["reason"]


def test_nvml_rm_version_mismatch_and_the_runtimes_refusal_are_both_reported(monkeypatch):
    # a driver upgraded without reloading the kernel module: nvmlInit 18, the runtime 803
    use_sim(monkeypatch, "cuda")
    sim.inject_error("nvmlInit_v2", 18, times=-1)
    sim.inject_error("cudaGetDeviceCount", 803, times=-1)
    assert accel.device_count() == 0
    rep = backends.get("cuda").report()
    assert "version mismatch" in rep["nvml_error"]
    assert "cudaErrorSystemDriverMismatch (803)" in rep["reason"]
    with pytest.raises(accel.AcceleratorError, match="cudaErrorSystemDriverMismatch"):
        accel.current_device_index()


def test_an_nvml_failure_is_tried_again_and_the_runtime_count_stands(monkeypatch):
    # A failed nvmlInit_v2 is tried again at the next use, as torch's readings call nvmlInit each
    # time (r70k changed this in session 30: the first failure used to stand for the process);
    # the runtime counted meanwhile, and its count is final.  Once NVML answers it stays initialized.
    use_sim(monkeypatch, "cuda")
    sim.inject_error("nvmlInit_v2", 9, times=1)
    assert accel.device_count() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")       # the runtime's count is final anyway
    assert accel.device_count() == 2
    assert sim.state().nvml_init_calls == 1
    assert accel.device_count() == 2 and sim.state().nvml_init_calls == 1


# -- 2. real libraries: versions, search order, overrides ----------------------------------------

@pytest.mark.parametrize("driver, want", [(12040, 12040), (12090, 12040), (13000, 13000), (11080, None)])
def test_real_runtimes_are_chosen_by_the_drivers_cuda_version(driver, want):
    w12 = _real(12, "pip nvidia-cuda-runtime-cu12")
    if w12 is None or not any(_real(13, s) for s in ("dynamic loader", "pip nvidia-cuda-runtime", "/usr/local")):
        pytest.skip("needs the real 12 wheel and a real libcudart 13")
    choice = _cuda_libs.choose_real(driver, "test: a driver of this CUDA version")
    if want is None:
        assert choice.chosen is None and "no libcudart the driver can run" in choice.error
        assert "12.4" in choice.error and "13.0" in choice.error and "CUDA 11.8" in choice.error
        assert "R525" in choice.error and "R580" in choice.error
        return
    assert choice.usable and choice.chosen.version == want
    if want == 12040:
        assert choice.chosen.resolved == w12
    for c in choice.candidates:
        if c.version and c.version // 1000 == 13 and driver < 13000:
            assert c.verdict == "rejected" and "needs a driver supporting CUDA 13.0" in c.reason


@pytest.mark.parametrize("var", ["CUDA_HOME", "CUDA_PATH"])
def test_cuda_home_is_searched_before_the_wheels(monkeypatch, tmp_path, var):
    w12 = _real(12, "pip nvidia-cuda-runtime-cu12")
    if w12 is None:
        pytest.skip("needs the nvidia-cuda-runtime-cu12 wheel")
    if _cuda_libs.probe(_cuda_libs.Candidate("libcudart.so.12", "soname")).version:
        pytest.skip("the dynamic loader finds a libcudart.so.12 first here")
    (tmp_path / "lib64").mkdir()
    home_lib = tmp_path / "lib64" / "libcudart.so.12"
    os.symlink(w12, home_lib)
    for other in ("CUDA_HOME", "CUDA_PATH", "ACCEL_CUDART_PATH"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(var, str(tmp_path))
    choice = _cuda_libs.choose_real(12040, "test")
    by_path = {c.path: c for c in choice.candidates}
    assert by_path[str(home_lib)].source == var
    assert choice.chosen.path == str(home_lib) and choice.chosen.resolved == w12
    wheel = [c for c in choice.candidates if c.source == "pip nvidia-cuda-runtime-cu12"]
    assert wheel and wheel[0].verdict == "rejected" and str(home_lib) in wheel[0].reason


@pytest.mark.skipif(not _NO_DRIVER, reason="checks the messages of a machine with no NVIDIA driver")
def test_cudart_path_at_the_12_wheel_is_honoured_and_says_which_driver_it_needs(monkeypatch):
    w12 = _real(12, "pip nvidia-cuda-runtime-cu12")
    if w12 is None:
        pytest.skip("needs the nvidia-cuda-runtime-cu12 wheel")
    monkeypatch.setenv("ACCEL_BACKEND", "cuda")
    monkeypatch.setenv("ACCEL_CUDART_PATH", os.path.dirname(w12))     # a lib/ directory
    _lazy._reset_for_tests()
    assert accel.device_count() == 0
    rep = backends.get("cuda").report()
    assert rep["cudart_choice"]["explicit"] and rep["cudart_choice"]["chosen_version"] == "12.4"
    assert rep["library"] == w12 and rep["runtime_version"] == "12.4"
    with pytest.raises(accel.AcceleratorError) as err:
        accel.current_device_index()
    assert "no NVIDIA driver is installed" in str(err.value) and "R525" in str(err.value)


def test_cudart_path_naming_another_real_library_is_refused_by_name(monkeypatch):
    nvrtc = [p for p, _s in __import__("accel._ffi", fromlist=["x"]).nvrtc_search()[0]
             if os.sep in p and os.path.exists(p)]
    if not nvrtc:
        pytest.skip("needs a real libnvrtc to stand in for a wrong library")
    monkeypatch.setenv("ACCEL_BACKEND", "cuda")
    monkeypatch.setenv("ACCEL_CUDART_PATH", nvrtc[0])
    _lazy._reset_for_tests()
    assert accel.device_count() == 0
    with pytest.raises(accel.AcceleratorError) as err:
        accel.current_device_index()
    assert f"ACCEL_CUDART_PATH={nvrtc[0]!r}" in str(err.value) and "not a libcudart" in str(err.value)


_PROBE_BAD_OVERRIDES = """
import json
from accel import backends
from accel.backends.cuda import nvrtc as _nvrtc
out = {"ACCEL_NVML_PATH": backends.get("cuda").report().get("nvml_error") or "",
       "ACCEL_ZE_PATH": backends.get("xpu").report().get("reason") or ""}
try:
    _nvrtc.version()
    out["ACCEL_NVRTC_PATH"] = "(loaded)"
except Exception as exc:
    out["ACCEL_NVRTC_PATH"] = str(exc)
print(json.dumps(out))
"""


# (r69g found; fixed: LibraryNotFound names the override variable)
def test_a_bad_library_override_is_refused_naming_the_variable(tmp_path):
    env = {var: str(tmp_path / f"missing-{var.lower()}.so")
           for var in ("ACCEL_NVML_PATH", "ACCEL_ZE_PATH", "ACCEL_NVRTC_PATH")}
    got = _fresh_python(_PROBE_BAD_OVERRIDES, **env)
    for var, path in env.items():
        text = got[var]
        assert path in text, (var, text)
        assert f"{var}=" in text and f"set {var} to" not in text, (var, text)
    assert "not installed" not in got["ACCEL_NVRTC_PATH"], got["ACCEL_NVRTC_PATH"]


_PROBE_RESOLVED = """
import ctypes, json, os, sys
from accel.backends.cuda import libs as _cuda_libs
from accel._ffi import _cudart
for path in sys.argv[1:3]:          # other code of the process loaded these first
    ctypes.CDLL(path)
c = _cuda_libs.probe(_cuda_libs.Candidate("libcudart.so", "dynamic loader (soname)"))
lib = _cudart.ffi.dlopen("libcudart.so")
class Info(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p), ("sname", ctypes.c_char_p),
                ("saddr", ctypes.c_void_p)]
info = Info()
addr = int(_cudart.ffi.cast("uintptr_t", lib.cudaRuntimeGetVersion))
assert ctypes.CDLL(None).dladdr(ctypes.c_void_p(addr), ctypes.byref(info))
v = _cudart.ffi.new("int *")
lib.cudaRuntimeGetVersion(v)
print(json.dumps({"resolved": c.resolved, "version": c.version, "file": os.path.realpath(info.fname.decode()),
                  "file_version": v[0] // 10 * 10}))
"""


# (r69g found; fixed: a bare soname is resolved by dladdr)
def test_a_bare_soname_is_resolved_to_the_file_it_loaded(tmp_path):
    w12 = _real(12, "pip nvidia-cuda-runtime-cu12")
    target = _cuda_libs.probe(_cuda_libs.Candidate("libcudart.so", "soname"))
    if w12 is None or target.resolved is None or target.version == 12040:
        pytest.skip("needs the 12 wheel and a dynamic loader libcudart.so of another version")
    named = tmp_path / "libcudart.so.12.4.127"     # a conda-style file name that carries the version
    shutil.copyfile(w12, named)
    other = target.resolved
    seen = []
    for order in ((str(named), other), (other, str(named))):
        got = _fresh_python(_PROBE_RESOLVED, *order)
        seen.append((got["resolved"], got["version"]))
        assert got["resolved"] == got["file"] and got["version"] == got["file_version"], (order, got)


# -- 4. Level Zero --------------------------------------------------------------------------------

def test_old_loader_on_a_new_driver_uses_only_what_the_loader_exports(monkeypatch):
    # Debian's loader 1.8.12 exports neither zesInit nor zeCommandListHostSynchronize even when
    # the driver's API (zeDriverGetApiVersion) is 1.9: count in a child, sync by event, legacy
    # Sysman through ZES_ENABLE_SYSMAN=1 set for accel's zeInit only
    use_sim(monkeypatch, "xpu", ACCEL_SIM_ZE_LOADER="1.8.12", ACCEL_SIM_ZE_API="1.9")
    monkeypatch.delenv("ZES_ENABLE_SYSMAN", raising=False)
    assert accel.device_count() == 2
    be = backends.get("xpu")
    assert be.report()["count_path"] == "child-zeInit" and not sim.state().ze_runtime_initialized
    s = accel.Stream(0)
    s.synchronize()
    rep = be.report()
    assert rep["api_version"] == "1.9" and rep["stream_sync"] == "event after the last command"
    assert sim.calls("zesInit") == 0 and "ZES_ENABLE_SYSMAN" not in os.environ
    assert be.mem_info()[1] > 0 and rep.get("mem_info_path") in (None, "sysman")
    assert be.report()["mem_info_path"] == "sysman"
    s.close()


_PROBE_REAL_ZE = """
import json, os, accel
from accel import backends
from accel._ffi import has_symbol, open_library
be = backends.get("xpu")
rep = be.report()
out = {"count": rep["count"], "path": rep["count_path"], "reason": rep.get("reason"),
       "missing": rep.get("missing_optional_symbols"),
       "zeInitDrivers": has_symbol(open_library("ze")[1], "zeInitDrivers"), "errors": []}
for attempt in range(2):
    try:
        be.init()
    except Exception as exc:
        out["errors"].append([type(exc).__name__, str(exc)])
out["sysman_env_left"] = "ZES_ENABLE_SYSMAN" in os.environ
print(json.dumps(out))
"""


def test_real_debian_loader_without_sysman_or_a_driver():
    if not any(os.path.exists(os.path.join(d, "libze_loader.so.1"))
               for d in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/local/lib")):
        pytest.skip("needs a real libze_loader")
    got = _fresh_python(_PROBE_REAL_ZE)
    if got["path"] != "driver-probe":
        pytest.skip(f"a Level Zero GPU driver is installed here ({got['path']})")
    assert got["count"] == 0 and "no Level Zero GPU driver is installed" in got["reason"]
    assert {"zesInit", "zesDriverGet", "zesDeviceGet"} <= set(got["missing"])
    assert got["zeInitDrivers"] is False        # accel calls zeInit, which every loader exports
    # zeInit fails the same way twice (the loader runs its initialization once per process),
    # and the ZES_ENABLE_SYSMAN=1 accel set for its zeInit is gone again
    assert len(got["errors"]) == 2 and got["errors"][0] == got["errors"][1]
    assert "ZE_RESULT_ERROR_UNINITIALIZED" in got["errors"][0][1] and not got["sysman_env_left"]


# (r69g found; fixed: no zesInit where ZES_ENABLE_SYSMAN=1 asks for legacy Sysman)
def test_legacy_sysman_the_environment_asks_for_keeps_working(monkeypatch):
    use_sim(monkeypatch, "xpu", ZES_ENABLE_SYSMAN="1")
    from accel._ffi import _ze
    ffi = _ze.ffi
    assert accel.device_count() == 2
    accel.current_device_index()                   # accel's zeInit, with the user's variable set
    assert backends.get("xpu").mem_info()[1] > 0
    # another library of the process reads Sysman through its core device handles (legacy mode)
    lib = sim.open_library("ze")
    assert lib.zeInit(0) == 0
    n = ffi.new("uint32_t *", 0)
    assert lib.zeDriverGet(n, ffi.NULL) == 0 and n[0] >= 1
    drivers = ffi.new("ze_driver_handle_t[]", n[0])
    assert lib.zeDriverGet(n, drivers) == 0
    m = ffi.new("uint32_t *", 0)
    assert lib.zeDeviceGet(drivers[0], m, ffi.NULL) == 0 and m[0] == 2
    devices = ffi.new("ze_device_handle_t[]", m[0])
    assert lib.zeDeviceGet(drivers[0], m, devices) == 0
    modules = ffi.new("uint32_t *", 0)
    rc = lib.zesDeviceEnumMemoryModules(devices[0], modules, ffi.NULL)
    assert rc == 0 and modules[0] > 0, hex(rc)


def test_sim_refuses_legacy_sysman_after_zesinit(monkeypatch):
    # the simulator rule the test above relies on (r69g, accel/sim/ze/discovery.py zeInit)
    use_sim(monkeypatch, "xpu")
    from accel._ffi import _ze
    ffi = _ze.ffi
    lib = sim.open_library("ze")
    monkeypatch.setenv("ZES_ENABLE_SYSMAN", "1")
    assert lib.zesInit(0) == 0 and lib.zeInit(0) == 0
    n = ffi.new("uint32_t *", 1)
    drivers = ffi.new("ze_driver_handle_t[]", 1)
    assert lib.zeDriverGet(n, drivers) == 0
    m = ffi.new("uint32_t *", 1)
    devices = ffi.new("ze_device_handle_t[]", 1)
    assert lib.zeDeviceGet(drivers[0], m, devices) == 0
    count = ffi.new("uint32_t *", 0)
    assert lib.zesDeviceEnumMemoryModules(devices[0], count, ffi.NULL) == ZE.ZE_RESULT_ERROR_UNINITIALIZED
    # Sysman's own handles still answer
    zd = ffi.new("zes_driver_handle_t[]", 1)
    assert lib.zesDriverGet(n, zd) == 0
    cards = ffi.new("zes_device_handle_t[]", 2)
    m[0] = 2
    assert lib.zesDeviceGet(zd[0], m, cards) == 0
    assert lib.zesDeviceEnumMemoryModules(cards[0], count, ffi.NULL) == 0 and count[0] > 0


def test_sim_legacy_sysman_without_zesinit_still_works(monkeypatch):
    use_sim(monkeypatch, "xpu", ACCEL_SIM_ZE_LOADER="1.8.12", ZES_ENABLE_SYSMAN="1")
    accel.current_device_index()
    assert backends.get("xpu").mem_info()[1] > 0 and backends.get("xpu").report()["mem_info_path"] == "sysman"


# -- 5. a second attempt, and fork, after a failure ------------------------------------------------

def test_a_failed_load_is_kept_and_a_forked_child_gets_the_same_reason(monkeypatch):
    use_sim(monkeypatch, "cuda")
    sim.configure(cudart=False)
    errors = []
    for _ in range(2):
        with pytest.raises(accel.AcceleratorError) as err:
            accel.current_device_index()
        errors.append(str(err.value))
    assert errors[0] == errors[1] and "no libcudart found" in errors[0]
    assert not backends.started_drivers()           # nothing started: the child is not poisoned

    def child():
        try:
            accel.current_device_index()
        except accel.AcceleratorError as exc:
            return 0 if str(exc) == errors[0] else 2
        except RuntimeError:
            return 3                                 # "Cannot re-initialize": wrong reason
        return 4
    assert run_forked(child) == 0


def test_a_child_forked_after_a_failed_init_is_refused_as_torch_refuses_it(monkeypatch):
    # torch/csrc/cuda/Module.cpp THCPModule_initExtension calls poison_fork() before
    # lazyInitDevice: a child of a parent whose init failed is in a bad fork too
    use_sim(monkeypatch, "cuda")
    sim.configure(driver=False)
    with pytest.raises(accel.AcceleratorError, match="no NVIDIA driver is installed"):
        accel.current_device_index()

    def child():
        try:
            accel.current_device_index()
        except RuntimeError as exc:
            return 0 if "Cannot re-initialize CUDA in forked subprocess" in str(exc) else 2
        return 3
    assert run_forked(child) == 0


def test_init_is_retried_after_a_failure_with_the_queued_seed_kept(monkeypatch):
    # torch's _lazy_init: a failed torch._C._cuda_init() leaves _initialized False and the queue
    # as it was; the next call tries again and then runs the queue
    use_sim(monkeypatch, "cuda")
    accel.random.manual_seed(1234)
    sim.inject_error("cudaGetDeviceCount", 2, times=1)      # cudaErrorMemoryAllocation, once
    with pytest.raises(accel.AcceleratorError):
        accel.current_device_index()
    assert not _lazy.is_initialized()
    assert accel.current_device_index() == 0
    assert _lazy.is_initialized() and accel.random.initial_seed() == 1234
