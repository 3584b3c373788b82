"""r82c: how accel finds and binds the vendor runtimes, against the real libraries of this machine.

Real files: the CUDA 13 toolkit's libcudart.so.13 (/usr/local/cuda, on the ld.so cache), the pip
wheels nvidia-cuda-runtime (13.0) and nvidia-cuda-runtime-cu12 (12.4), Debian's libze_loader 1.8.12;
no NVIDIA driver (every runtime answers cudaErrorInsufficientDriver, 35, and cudaDriverGetVersion 0)
and no NVML.  NVML is a small C stand-in built here (tmp), whose answers come from the environment
(read at each call), so the real runtimes meet "a driver" of any CUDA version; a stand-in libcudart
logs the calls made to it.  Each case runs in a fresh interpreter (a library is opened once per
process, and LD_LIBRARY_PATH is read once, at start).

Not repeated here (tests/test_runtime_loader_r69g.py, _r70l.py, test_review_r71b.py, _r72d.py,
test_cuda_libs.py, test_runtime_matrix.py, test_real_libs_no_device_r62p.py): broken, truncated,
wrong-architecture and dangling candidates, the chooser's pure logic, ACCEL_CUDART_PATH directories,
relative paths, the simulated NVML failures, old Level Zero loaders without zesInit/zeInitDrivers.

Vendor rules the checks rest on:
- CUDA Compatibility guide, "Minor Version Compatibility": "From CUDA 11 onwards, applications
  compiled with a CUDA Toolkit release from within a CUDA major release family can run, with limited
  feature-set, on systems having at least the minimum required driver version"; table 1: CUDA 13.x
  ">= 580", CUDA 12.x ">= 525".
- CUDA Runtime API, cudaDriverGetVersion: "If no driver is installed, then 0 is returned as the
  driver version".
- nvml.h (nvidia-nvml-dev 13.5), nvmlSystemGetCudaDriverVersion_v2: "NVML_ERROR_LIBRARY_NOT_FOUND
  if libcuda.so.1 or libcuda.dll is not found" (NVML_ERROR_LIBRARY_NOT_FOUND = 12).
- NVIDIA container runtime, driver capabilities: "compute: required for CUDA and OpenCL
  applications", "utility: required for using nvidia-smi and NVML" (so a container given
  ``utility`` only has NVML and no libcuda).
- ld.so(8): a library on the search path that cannot be opened is passed over, the search goes on.

Bugs are strict xfails whose reason names the function at fault (tag r82c).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CC = shutil.which("cc") or shutil.which("gcc")

_NVML_C = r"""
#include <stdlib.h>
#include <stdio.h>
static int env_int(const char *n, int d){ const char *v = getenv(n); return v && *v ? atoi(v) : d; }
static void logc(const char *c){ const char *p = getenv("STUB_LOG"); FILE *f;
    if (!p) return; f = fopen(p, "a"); if (f) { fprintf(f, "%s\n", c); fclose(f); } }
int nvmlInit_v2(void){ logc("nvmlInit_v2"); return env_int("STUB_NVML_INIT_RC", 0); }
int nvmlShutdown(void){ logc("nvmlShutdown"); return 0; }
int nvmlDeviceGetCount_v2(unsigned *n){ logc("nvmlDeviceGetCount_v2"); *n = env_int("STUB_NVML_COUNT", 2); return 0; }
#ifndef OLD_NVML
int nvmlSystemGetCudaDriverVersion_v2(int *v){ int rc = env_int("STUB_NVML_CUDA_RC", 0);
    logc("nvmlSystemGetCudaDriverVersion_v2"); if (!rc) *v = env_int("STUB_NVML_CUDA", 12040); return rc; }
#endif
const char *nvmlErrorString(int rc){ return rc == 9 ? "Driver Not Loaded" : rc == 12 ? "Library Not Found" : "Unknown Error"; }
int nvmlSystemGetDriverVersion(char *b, unsigned n){ snprintf(b, n, "550.54.15"); return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void **h){ *h = (void *)(size_t)(i + 1); return 0; }
int nvmlDeviceGetUUID(void *h, char *b, unsigned n){
    snprintf(b, n, "GPU-00000000-0000-0000-0000-00000000000%d", (int)(size_t)h); return 0; }
"""

_CUDART_C = r"""
#include <stdlib.h>
#include <stdio.h>
static int env_int(const char *n, int d){ const char *v = getenv(n); return v && *v ? atoi(v) : d; }
static void logc(const char *c){ const char *p = getenv("STUB_LOG"); FILE *f;
    if (!p) return; f = fopen(p, "a"); if (f) { fprintf(f, "%s\n", c); fclose(f); } }
int cudaRuntimeGetVersion(int *v){ logc("cudaRuntimeGetVersion"); *v = env_int("STUB_RT_VERSION", 13000); return 0; }
int cudaDriverGetVersion(int *v){ logc("cudaDriverGetVersion"); *v = env_int("STUB_RT_DRIVER", 0); return 0; }
int cudaGetDeviceCount(int *n){ logc("cudaGetDeviceCount"); *n = 0; return 35; }
const char *cudaGetErrorName(int rc){ return rc == 35 ? "cudaErrorInsufficientDriver" : "cudaErrorUnknown"; }
const char *cudaGetErrorString(int rc){ return "CUDA driver version is insufficient for CUDA runtime version"; }
int cudaGetLastError(void){ return 0; }
"""


def _build(dirpath, name, soname, source, *flags):
    dirpath.mkdir(parents=True, exist_ok=True)
    src = dirpath / (name + ".c")
    src.write_text(source)
    out = dirpath / name
    subprocess.run([_CC, "-shared", "-fPIC", *flags, f"-Wl,-soname,{soname}", "-o", str(out), str(src)],
                   check=True, capture_output=True, timeout=60)
    return str(out)


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    """Paths of the stand-ins: NVML, an NVML without nvmlSystemGetCudaDriverVersion_v2, a logging
    libcudart.so.13, and a directory holding a libze_intel_gpu.so.1 that is no driver."""
    if _CC is None:
        pytest.skip("needs a C compiler for the stand-in libraries")
    root = tmp_path_factory.mktemp("r82c")
    ze = root / "ze"
    _build(ze, "libze_intel_gpu.so.1", "libze_intel_gpu.so.1", "int not_a_driver(void) { return 0; }\n")
    return {
        "nvml": _build(root / "nvml", "libnvidia-ml.so.1", "libnvidia-ml.so.1", _NVML_C),
        "old_nvml": _build(root / "old", "libnvidia-ml.so.1", "libnvidia-ml.so.1", _NVML_C, "-DOLD_NVML"),
        "cudart": _build(root / "rt", "libcudart.so.13", "libcudart.so.13", _CUDART_C),
        "ze_dir": str(ze),
        "root": root,
    }


def _site_wheel(*parts):
    for sp in sys.path:
        path = os.path.join(sp, "nvidia", *parts)
        if sp and os.path.isfile(path):
            return path
    return None


W13 = _site_wheel("cu13", "lib", "libcudart.so.13")
W12 = _site_wheel("cuda_runtime", "lib", "libcudart.so.12")
TOOLKIT13 = "/usr/local/cuda/lib64/libcudart.so.13" if os.path.isfile("/usr/local/cuda/lib64/libcudart.so.13") else None
ZE_LOADER = next((p for p in ("/usr/lib/x86_64-linux-gnu/libze_loader.so.1", "/lib/x86_64-linux-gnu/libze_loader.so.1")
                  if os.path.exists(p)), None)

needs_both = pytest.mark.skipif(not (W13 and W12), reason="needs the nvidia-cuda-runtime and -cu12 wheels")


# What the child prints: the public queries, the CUDA backend's choice and report, and the first
# device use's error.
_PROBE = r"""
import json, os, sys, warnings
warnings.simplefilter("always")
caught = []
warnings.showwarning = lambda m, *a, **k: caught.append(str(m))
import accel
from accel import backends
out = {}
def call(key, fn):
    try:
        v = fn()
        out[key] = v if isinstance(v, (int, bool, str, type(None))) else repr(v)
    except Exception as e:
        out[key] = "EXC %s.%s: %s" % (type(e).__module__, type(e).__name__, e)
call("is_available", accel.is_available)
call("device_count", accel.device_count)
call("accelerator", accel.current_accelerator)
be = backends.get("cuda")
try:
    ch = be.cudart_choice()
    out["chosen"] = ch.chosen.resolved if ch.chosen else None
    out["chosen_version"] = ch.chosen.version if ch.chosen else None
    out["chosen_reason"] = ch.chosen.reason if ch.chosen else None
    out["choice_error"] = ch.error
    out["driver_version"] = ch.driver_version
except Exception as e:
    out["choice_exc"] = "%s: %s" % (type(e).__name__, e)
try:
    rep = be.report()
except Exception as e:      # report() never raises (accel.backends.base)
    rep = {"report_exc": "%s.%s: %s" % (type(e).__module__, type(e).__name__, e)}
out["reason"] = rep.get("reason")
out["nvml_error"] = rep.get("nvml_error")
out["report_exc"] = rep.get("report_exc")
out["log_before_init"] = open(os.environ["STUB_LOG"]).read().split() if os.path.exists(os.environ.get("STUB_LOG", "/nonexistent")) else []
call("first_use", accel.current_device_index)
out["warnings"] = caught
print(json.dumps(out))
"""


def _child(code, stubs=None, nvml=True, **env):
    """Run ``code`` in a fresh interpreter without this process's accel/CUDA variables; ``nvml``
    True puts the NVML stand-in in as ACCEL_NVML_PATH (False: none, as on this machine).  Its
    last stdout line as JSON."""
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("ACCEL_", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "ZE_", "ZES_",
                                 "CUDA_HOME", "CUDA_PATH", "CONDA_PREFIX", "LD_LIBRARY_PATH", "STUB_"))}
    if nvml and stubs is not None:
        full["ACCEL_NVML_PATH"] = stubs["nvml"] if nvml is True else nvml
    full.update({k: str(v) for k, v in env.items()})
    full["PYTHONPATH"] = _REPO + (os.pathsep + full["PYTHONPATH"] if full.get("PYTHONPATH") else "")
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- lazy init: nothing at import, no cuInit from the queries, a failed init is tried again ----------

def test_import_accel_opens_no_library_and_calls_nothing(stubs):
    log = stubs["root"] / "import.log"
    got = _child(r"""
import json, os, accel
maps = [l.split()[-1] for l in open("/proc/self/maps") if l.count(" ") >= 5]
libs = sorted({m for m in maps if any(k in m for k in ("cudart", "nvidia-ml", "ze_loader", "libcuda"))})
print(json.dumps({"libs": libs, "log": os.path.exists(os.environ["STUB_LOG"]),
                  "ffi": sorted(m for m in __import__("sys").modules if m.startswith("accel._ffi._"))}))
""", stubs, ACCEL_CUDART_PATH=stubs["cudart"], STUB_LOG=log)
    assert got == {"libs": [], "log": False, "ffi": []}


def test_queries_with_nvml_start_nothing_and_a_failed_init_is_tried_again(stubs):
    # torch counts with NVML so that a process may still fork; cudaGetDeviceCount runs cuInit
    # (REFERENCE.md "Hardware rules"), so only the first device use may call it
    log = stubs["root"] / "queries.log"
    got = _child(_PROBE + r"""
call("second_use", accel.current_device_index)
out["log"] = open(os.environ["STUB_LOG"]).read().split()
print(json.dumps(out))
""", stubs, ACCEL_CUDART_PATH=stubs["cudart"], STUB_LOG=log, STUB_NVML_CUDA=13000)
    assert (got["is_available"], got["device_count"], got["accelerator"]) == (True, 2, "device(type='cuda')")
    assert "cudaGetDeviceCount" not in got["log_before_init"]
    assert got["log_before_init"][0] == "nvmlInit_v2"
    assert got["first_use"].startswith("EXC accel._errors.AcceleratorError") and "13.0" in got["first_use"]
    assert got["second_use"] == got["first_use"]
    # both uses asked the runtime: a failure is not remembered in place of the runtime's answer
    assert got["log"].count("cudaGetDeviceCount") == 2


# -- the runtime the driver runs, whatever the search order ------------------------------------------

_ORDERS = {"none": None, "12-first": ("cuda_runtime", "cu13"), "13-first": ("cu13", "cuda_runtime")}


@needs_both
@pytest.mark.parametrize("order", sorted(_ORDERS))
@pytest.mark.parametrize("driver, want, why", [
    (12040, 12040, "newest runtime the driver (CUDA 12.4) supports"),
    (12020, 12040, "minor-version compatibility"),      # 12.4 on a 12.2 driver: same major
    (13000, 13000, "newest runtime the driver (CUDA 13.0) supports"),
])
def test_real_runtimes_are_chosen_by_nvmls_driver_version_in_any_search_order(stubs, order, driver, want, why):
    env = {"STUB_NVML_CUDA": driver}
    if _ORDERS[order]:
        env["LD_LIBRARY_PATH"] = ":".join(os.path.dirname(W13 if d == "cu13" else W12) for d in _ORDERS[order])
    got = _child(_PROBE, stubs, **env)
    assert got["chosen_version"] == want and why in got["chosen_reason"], got
    assert (got["is_available"], got["device_count"], got["choice_error"]) == (True, 2, None)
    assert got["report_exc"] is None and not got["warnings"]
    # no driver behind the stand-in: the runtime chosen is the one named at first use
    assert f"libcudart {want // 1000}.{want % 1000 // 10}" in got["first_use"]


@needs_both
@pytest.mark.parametrize("order", ["12-first", "13-first"])
def test_without_nvml_and_without_a_driver_the_order_does_not_change_the_answer(stubs, order):
    dirs = [os.path.dirname(W12), os.path.dirname(W13)]
    if order == "13-first":
        dirs.reverse()
    got = _child(_PROBE, stubs, nvml=False, LD_LIBRARY_PATH=":".join(dirs))
    assert got["chosen_version"] == 13000 and got["driver_version"] is None
    assert (got["is_available"], got["device_count"]) == (False, 0)
    for text in ("cudaErrorInsufficientDriver", "no NVIDIA driver", "13.0", "R580"):
        assert text in got["reason"] and text in got["first_use"], (text, got)


@needs_both
def test_an_explicit_12_runtime_is_honoured_on_a_13_driver(stubs):
    got = _child(_PROBE, stubs, STUB_NVML_CUDA=13000, ACCEL_CUDART_PATH=W12)
    assert got["chosen"] == os.path.realpath(W12) and got["chosen_version"] == 12040
    assert got["chosen_reason"] == "set by ACCEL_CUDART_PATH" and got["choice_error"] is None
    assert (got["is_available"], got["device_count"]) == (True, 2)


@pytest.mark.skipif(TOOLKIT13 is None, reason="needs the CUDA 13 toolkit")
def test_an_explicit_13_runtime_on_a_12_driver_is_unavailable_and_says_how_to_fix_it(stubs):
    got = _child(_PROBE, stubs, STUB_NVML_CUDA=12040, ACCEL_CUDART_PATH=os.path.dirname(TOOLKIT13))
    assert (got["is_available"], got["device_count"]) == (False, 0)
    for text in ("libcudart 13.0", "CUDA 12.4", "pip install nvidia-cuda-runtime-cu12", "R580"):
        assert text in got["reason"], (text, got["reason"])


def test_symlink_loops_on_ld_library_path_are_passed_over_as_ld_so_does(stubs, tmp_path):
    if TOOLKIT13 is None and W13 is None:
        pytest.skip("needs a real libcudart.so.13")
    os.symlink("libcudart.so.13", tmp_path / "libcudart.so.13")          # a loop of one
    os.symlink("a", tmp_path / "libcudart.so.12")                         # a loop of two
    os.symlink("libcudart.so.12", tmp_path / "a")
    got = _child(r"""
import ctypes, json
from accel.backends import get
ch = get("cuda").cudart_choice()
try:
    ld = ctypes.CDLL("libcudart.so.13")._name
except OSError as e:
    ld = str(e)
print(json.dumps({"chosen": ch.chosen.resolved, "version": ch.chosen.version, "ld": ld,
                  "c12": [c.reason for c in ch.candidates if c.path == "libcudart.so.12"]}))
""", stubs, nvml=False, LD_LIBRARY_PATH=str(tmp_path))
    assert got["ld"] == "libcudart.so.13"          # ld.so went on past the loop
    assert got["version"] == 13000 and "cudart.so.13" in got["chosen"] and str(tmp_path) not in got["chosen"]
    assert got["c12"] == ["not found"]


# r82c, fixed in session 40: backends.select: a selection that found no device (None) is kept for
# good, so accel.device_count()/is_available() stay 0/False after CUDA_VISIBLE_DEVICES is widened
# before init, though the CUDA backend's count (NVML) follows the variable, as discovery._discover
# says it must ('a later change of the variable is read again')
def test_a_count_of_none_visible_is_read_again_when_the_variable_changes_before_init(stubs):
    got = _child(r"""
import json, os, accel
from accel import backends
first = (accel.device_count(), accel.is_available())
os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
print(json.dumps({"first": first, "then": (accel.device_count(), accel.is_available()),
                  "backend": backends.get("cuda").count(), "init": accel.is_initialized()}))
""", stubs, STUB_NVML_CUDA=13000, CUDA_VISIBLE_DEVICES="")
    assert got["first"] == [0, False] and got["backend"] == 2 and got["init"] is False
    # as when CUDA was counted first with one device visible (then 2, then 0: it follows)
    assert got["then"] == [2, True], got


def test_a_count_before_init_follows_the_variable_both_ways_once_cuda_is_selected(stubs):
    got = _child(r"""
import json, os, accel
seen = [accel.device_count()]
for value in ("0,1", "", "1"):
    os.environ["CUDA_VISIBLE_DEVICES"] = value
    seen.append(accel.device_count())
print(json.dumps({"seen": seen, "init": accel.is_initialized()}))
""", stubs, STUB_NVML_CUDA=13000, CUDA_VISIBLE_DEVICES="0")
    assert got == {"seen": [1, 2, 0, 1], "init": False}


# -- broken copies of the real libraries, by override and by soname ---------------------------------

def _copy_of(src, dst, how):
    data = open(src, "rb").read()
    if how == "aarch64":            # e_machine = EM_AARCH64
        data = data[:18] + (183).to_bytes(2, "little") + data[20:]
    elif how == "truncated":
        data = data[:len(data) // 2]
    with open(dst, "wb") as f:
        f.write(data)
    return str(dst)


@pytest.mark.skipif(ZE_LOADER is None, reason="needs Debian's libze_loader")
@pytest.mark.parametrize("how, says", [("aarch64", "built for another architecture (ELF machine 183"),
                                       ("truncated", "truncated: a loadable segment ends at byte")])
def test_a_broken_level_zero_loader_override_is_named_and_survived(stubs, tmp_path, how, says):
    bad = _copy_of(ZE_LOADER, tmp_path / "libze_loader.so.1", how)
    got = _child(r"""
import json, accel
from accel.backends import get
try:
    accel.current_device_index(); err = None
except Exception as e:
    err = "%s: %s" % (type(e).__name__, e)
print(json.dumps({"n": accel.device_count(), "reason": get("xpu").report().get("reason"), "err": err}))
""", stubs, nvml=False, ACCEL_BACKEND="xpu", ACCEL_ZE_PATH=bad)
    assert got["n"] == 0
    for text in (f"ACCEL_ZE_PATH={bad!r} cannot be used", says, "unset it"):
        assert text in got["reason"] and text in got["err"], (text, got)


@pytest.mark.skipif(ZE_LOADER is None, reason="needs Debian's libze_loader")
def test_truncated_nvml_and_ze_loader_first_on_ld_library_path_are_skipped_not_mapped(stubs, tmp_path):
    _copy_of(stubs["nvml"], tmp_path / "libnvidia-ml.so.1", "truncated")
    _copy_of(ZE_LOADER, tmp_path / "libze_loader.so.1", "truncated")
    got = _child(r"""
import json, accel
from accel.backends import get
n = accel.device_count()
print(json.dumps({"n": n, "nvml": get("cuda").report().get("nvml_error"),
                  "ze": get("xpu").report().get("library_file")}))
""", stubs, nvml=False, LD_LIBRARY_PATH=str(tmp_path))
    assert got["n"] == 0
    assert f"{tmp_path}/libnvidia-ml.so.1 (its soname's file): truncated" in got["nvml"]
    assert got["ze"] == os.path.realpath(ZE_LOADER)      # the real loader, reached by another name


# -- NVML absent, failing, or too old ---------------------------------------------------------------

def test_a_failed_nvml_init_falls_back_to_the_real_runtime_and_is_tried_again(stubs):
    got = _child(_PROBE + r"""
os.environ["STUB_NVML_INIT_RC"] = "0"          # the driver came up (the stand-in reads it per call)
os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"     # (a count is kept until the variable changes)
call("count_after", be.count)
out["nvml_after"] = be.report().get("nvml_library")
print(json.dumps(out))
""", stubs, STUB_NVML_INIT_RC=9, ACCEL_BACKEND="cuda")
    assert (got["is_available"], got["device_count"]) == (False, 0)
    assert "nvmlInit_v2 returned 9 (Driver Not Loaded)" in got["nvml_error"]
    assert "cudaErrorInsufficientDriver" in got["reason"]
    assert got["count_after"] == 2 and got["nvml_after"]


# r82c, fixed in session 40: libs.driver_version_from_nvml: calls nvmlSystemGetCudaDriverVersion_v2
# without checking the NVML exports it (only nvmlInit_v2 is required): device_count(), is_available()
# and report() raise cffi's ffi.error 'symbol not found'
def test_an_nvml_without_the_cuda_version_query_does_not_break_counting(stubs):
    got = _child(_PROBE, stubs, nvml=stubs["old_nvml"], ACCEL_BACKEND="cuda")
    for key in ("is_available", "device_count"):
        assert not str(got[key]).startswith("EXC"), got[key]
    assert "choice_exc" not in got, got["choice_exc"]
    assert got["report_exc"] is None, got["report_exc"]
    # the driver version then comes from the runtime (cudaDriverGetVersion), as without NVML
    assert "cudaDriverGetVersion" in got["first_use"] or "no NVIDIA driver" in got["first_use"]


# r82c, fixed in session 40: discovery.CudaDiscoveryMixin._insufficient_driver
# (libs.insufficient_driver_message): NVML counted the GPUs and said libcuda.so.1 is missing
# (NVML_ERROR_LIBRARY_NOT_FOUND), yet the error says 'no NVIDIA driver is installed'
def test_nvml_without_libcuda_is_not_reported_as_no_driver(stubs):
    # a container given the 'utility' capability only: NVML works, libcuda.so.1 is absent, so
    # nvmlSystemGetCudaDriverVersion_v2 answers 12 and cudaDriverGetVersion 0
    got = _child(_PROBE, stubs, STUB_NVML_CUDA_RC=12)
    err = got["first_use"]
    assert err.startswith("EXC accel._errors.AcceleratorError") and "13.0" in err
    assert "no NVIDIA driver is installed" not in err, err
    assert "libcuda" in err, err


# r82c, fixed in session 40: discovery.CudaDiscoveryMixin._discover: NVML counts 2 GPUs, but
# libcuda.so.1 is missing (nvmlSystemGetCudaDriverVersion_v2: NVML_ERROR_LIBRARY_NOT_FOUND;
# cudaDriverGetVersion: 0), so no runtime can run; is_available() is still True, unlike a driver too
# old for every runtime, which counts 0 with the reason
def test_nvml_without_libcuda_is_not_available(stubs):
    got = _child(_PROBE, stubs, STUB_NVML_CUDA_RC=12)
    assert got["first_use"].startswith("EXC accel._errors.AcceleratorError")     # every use fails (35)
    assert (got["is_available"], got["device_count"]) == (False, 0), got
    assert got["reason"] and "libcuda" in got["reason"], got["reason"]


# -- when no runtime can run: what the user sees ------------------------------------------------------


@pytest.mark.skipif(ZE_LOADER is None or not (W13 or TOOLKIT13), reason="needs libze_loader and a real libcudart")
# r82c, fixed in session 40: a libcudart the chooser refused counted as no CUDA library, so the first
# use raised Level Zero's error
@pytest.mark.parametrize("case", ["driver-11.8", "cudart-path-missing", "cudart-path-too-new"])
def test_the_cuda_reason_is_what_the_first_device_use_raises(stubs, case):
    env = {"driver-11.8": {"STUB_NVML_CUDA": 11080},
           "cudart-path-missing": {"STUB_NVML_CUDA": 12040, "ACCEL_CUDART_PATH": "/nonexistent/libcudart.so.13"},
           "cudart-path-too-new": {"STUB_NVML_CUDA": 12040,
                                   "ACCEL_CUDART_PATH": TOOLKIT13 or W13}}[case]
    got = _child(_PROBE, stubs, **env)
    assert (got["is_available"], got["device_count"]) == (False, 0)
    assert got["reason"] and "libcudart" in got["reason"]       # report() has it right
    # NVML sees two NVIDIA GPUs and a libcudart loads: the accelerator is CUDA, as a CUDA build of torch
    assert got["accelerator"] == "device(type='cuda')", got["accelerator"]
    assert "libcudart" in got["first_use"] and "Level Zero" not in got["first_use"], got["first_use"]
    want = {"driver-11.8": "11.8", "cudart-path-missing": "ACCEL_CUDART_PATH",
            "cudart-path-too-new": "pip install nvidia-cuda-runtime-cu12"}[case]
    assert want in got["first_use"], got["first_use"]


@pytest.mark.skipif(not (W13 and W12), reason="needs both runtime wheels")
def test_a_driver_too_old_for_every_runtime_names_each_version_and_the_fix(stubs):
    got = _child(_PROBE, stubs, STUB_NVML_CUDA=11080)
    assert (got["is_available"], got["device_count"], got["chosen"]) == (False, 0, None)
    for text in ("NVML sees 2 device(s)", "the driver supports CUDA 11.8", "libcudart 13.0", "libcudart 12.4",
                 ">= R580", ">= R525", os.path.realpath(W12)):
        assert text in got["reason"], (text, got["reason"])


@pytest.mark.skipif(not (W13 and W12) or TOOLKIT13 is None, reason="needs the toolkit and both wheels")
# r82c, fixed in session 40: libs.choose: the 'also tried' list of the no-runnable-libcudart error
# counts dedupe()'s 'same file as' candidates as broken runtimes, so the toolkit's libcudart.so.13 is
# listed three more times (once per path that reaches it)
def test_the_too_old_driver_error_lists_no_duplicate_paths_as_broken(stubs):
    got = _child(_PROBE, stubs, STUB_NVML_CUDA=11080)
    assert "same file as" not in got["choice_error"], got["choice_error"]


# -- Level Zero: a GPU driver library that is no driver ----------------------------------------------

@pytest.mark.skipif(ZE_LOADER is None, reason="needs Debian's libze_loader")
def test_a_level_zero_gpu_driver_that_does_not_work_is_counted_as_0_with_zeinits_reason(stubs):
    got = _child(r"""
import json, accel
from accel.backends import get
r = get("xpu").report()
try:
    accel.current_device_index(); err = None
except Exception as e:
    err = "%s: %s" % (type(e).__name__, e)
print(json.dumps({"n": accel.device_count(), "acc": repr(accel.current_accelerator()),
                  "found": r.get("gpu_drivers_found"), "reason": r.get("reason"), "err": err}))
""", stubs, nvml=False, ACCEL_BACKEND="xpu", LD_LIBRARY_PATH=stubs["ze_dir"])
    assert got["n"] == 0 and got["acc"] == "device(type='xpu')"
    assert got["found"] == ["libze_intel_gpu.so.1"]
    assert "zeInit failed with ZE_RESULT_ERROR_UNINITIALIZED" in got["reason"]
    assert got["err"].startswith("AcceleratorError: libze_loader: zeInit") and "0x78000001" in got["err"]
