"""A second adversarial audit of how accel finds and loads vendor runtimes (r70l).

r69g (tests/test_runtime_loader_r69g.py) checked the CUDA runtime/driver compatibility rules, the
search order, NVML failures, the Debian Level Zero loader and fork after a failure.  This file
covers what it did not, with real directory layouts built in tmp dirs from the libraries this
machine has (libcudart 13.0 in /usr/local/cuda, the pip wheels nvidia-cuda-runtime-cu12 12.4 and
nvidia-cuda-runtime 13.0, nvidia-cuda-nvrtc 13.0, Debian's libze_loader 1.8.12, no GPU driver),
small stand-in libraries built with gcc where a real one of the needed shape does not exist here
(an NVRTC 12, a Level Zero loader lacking functions), and the simulators where a driver is needed:

1. Broken candidates: a text file, an empty file, a directory, a dangling link, a 32-bit or
   another architecture's ELF, a truncated copy, a file whose name gives another version than
   the library reports, or another library under a libcudart name.  Each is rejected with a
   reason, the next candidate is taken, and nothing stays loaded.
2. The choice: ``ACCEL_CUDART_PATH`` naming a directory with two runtimes, a relative
   ``ACCEL_CUDART_PATH`` and a later ``chdir``, the wheels' places (``pip install --target``,
   conda), and the error when nothing usable exists (every candidate, why, and the fix).
3. Stability: one choice for many threads, each candidate probed once, and the same runtime in a
   child forked before or after the choice.
4. NVRTC is paired with the runtime accel uses, whatever the order of the first compile and init.
5. Level Zero: a loader lacking functions accel calls; Metal/Objective-C: override variables
   naming other libraries, and ``ACCEL_SIM`` spelled as the other backends accept it.

Bugs found are strict xfails whose reason names the cause (see the report of r70l).
"""

import gc
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest

import accel
from accel import _lazy, backends
from accel.backends.cuda import libs as _cuda_libs
from conftest import run_forked, use_sim

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_GCC = shutil.which("gcc") or shutil.which("cc")


def _fresh_python(code: str, *args: str, cwd=None, check=True, **env):
    """Run ``code`` in a new interpreter (vendor libraries are opened once per process) without
    this process's accel/visible-device variables, ``env`` set.  Its last stdout line as JSON, or
    with ``check=False`` the CompletedProcess."""
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("ACCEL_", "CUDA_VISIBLE_DEVICES", "ZE_", "ZES_", "CUDA_HOME", "CUDA_PATH",
                                 "CONDA_PREFIX", "LD_LIBRARY_PATH"))}
    full.update(env)
    full["PYTHONPATH"] = _REPO + (os.pathsep + full["PYTHONPATH"] if full.get("PYTHONPATH") else "")
    out = subprocess.run([sys.executable, "-c", code, *args], env=full, capture_output=True, text=True,
                         timeout=300, cwd=cwd)
    if not check:
        return out
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _real(major: int, source_prefix: str):
    """The resolved file of the real libcudart of ``major`` found by ``source_prefix``, else None."""
    for c in _cuda_libs.real_candidates()[0]:
        if c.source.startswith(source_prefix):
            _cuda_libs.probe(c)
            if c.version and c.version // 1000 == major:
                return c.resolved
    return None


def _wheel12():
    w12 = _real(12, "pip nvidia-cuda-runtime-cu12")
    if w12 is None:
        pytest.skip("needs the nvidia-cuda-runtime-cu12 wheel")
    return w12


def _wheel13():
    w13 = _real(13, "pip nvidia-cuda-runtime")
    if w13 is None:
        pytest.skip("needs the nvidia-cuda-runtime wheel (CUDA 13)")
    return w13


def _only_search(monkeypatch, paths):
    """Make accel's libcudart search exactly ``paths`` (``(path, source)`` pairs)."""
    import accel._ffi as ffi_mod
    monkeypatch.setattr(ffi_mod, "cudart_search", lambda: (list(paths), False))
    monkeypatch.setattr(_cuda_libs, "_pathfinder_path", lambda: None)


def _gcc(tmp_path, name: str, soname: str, source: str) -> str:
    if _GCC is None:
        pytest.skip("needs a C compiler to build a stand-in library")
    src = tmp_path / (name + ".c")
    src.write_text(source)
    out = tmp_path / name
    subprocess.run([_GCC, "-shared", "-fPIC", "-o", str(out), f"-Wl,-soname,{soname}", str(src)],
                   check=True, capture_output=True, timeout=120)
    return str(out)


def _mapped(pattern: str):
    return sorted({line.split()[-1] for line in open("/proc/self/maps") if pattern in line})


# -- 1. broken candidates ---------------------------------------------------------------------------

def _make_bad(kind: str, target, w12: str) -> None:
    """Write a ``kind`` of unusable libcudart at ``target`` (a pathlib path)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    data = open(w12, "rb").read()
    if kind == "text":                      # a linker script, as some distributions ship for .so
        target.write_text("INPUT(-lcudart_static)\n")
    elif kind == "empty":
        target.write_bytes(b"")
    elif kind == "directory":
        target.mkdir()
    elif kind == "dangling":
        os.symlink(str(target.parent / "libcudart.so.12.4.127"), str(target))
    elif kind == "elfclass32":
        target.write_bytes(data[:4] + b"\x01" + data[5:])
    elif kind == "aarch64":                # e_machine = EM_AARCH64 (183)
        target.write_bytes(data[:18] + (183).to_bytes(2, "little") + data[20:])
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["text", "empty", "directory", "dangling", "elfclass32", "aarch64"])
def test_an_unloadable_candidate_is_rejected_by_name_and_the_next_is_taken(monkeypatch, tmp_path, kind):
    w12 = _wheel12()
    home = tmp_path / "cuda"
    bad = home / "lib64" / "libcudart.so.12"
    _make_bad(kind, bad, w12)
    for var in ("CUDA_PATH", "ACCEL_CUDART_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CUDA_HOME", str(home))
    choice = _cuda_libs.choose_real(12040, "test: a CUDA 12.4 driver")
    assert choice.usable and choice.chosen.version == 12040, choice.as_dict()
    assert choice.chosen.path != str(bad)
    mine = [c for c in choice.candidates if c.path == str(bad)]
    assert len(mine) == 1 and mine[0].verdict == "rejected" and mine[0].version is None
    assert mine[0].reason and ("does not load" in mine[0].reason or "symbolic link" in mine[0].reason), mine[0]


# (r70l found; fixed in session 30)
def test_a_library_of_another_architecture_is_named_as_such(tmp_path):
    w12 = _wheel12()
    bad = tmp_path / "arm" / "libcudart.so.12"
    _make_bad("aarch64", bad, w12)
    c = _cuda_libs.probe(_cuda_libs.Candidate(str(bad), "test"))
    assert c.version is None
    assert "No such file" not in c.reason and ("architecture" in c.reason or "aarch64" in c.reason), c.reason


_PROBE_CHOICE = """
import json
from accel.backends.cuda import libs as _cuda_libs
ch = _cuda_libs.choose_real(12040, "test: a CUDA 12.4 driver")
print(json.dumps(ch.as_dict()))
"""


# (r70l found; fixed in session 30)
def test_a_truncated_candidate_does_not_kill_the_process(tmp_path):
    w12 = _wheel12()
    lib = tmp_path / "cuda" / "lib64" / "libcudart.so.12"
    lib.parent.mkdir(parents=True)
    data = open(w12, "rb").read()
    lib.write_bytes(data[:len(data) // 2])          # an interrupted copy or a full disk
    out = _fresh_python(_PROBE_CHOICE, check=False, CUDA_HOME=str(tmp_path / "cuda"))
    assert out.returncode == 0, f"the process died: exit status {out.returncode}"
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["chosen_version"] == "12.4"
    mine = [c for c in got["candidates"] if c["path"] == str(lib)]
    assert mine and mine[0]["verdict"] == "rejected" and mine[0]["reason"], mine


# (r70l found; fixed in session 30)
def test_another_library_under_a_versioned_libcudart_name_is_refused(monkeypatch, tmp_path):
    other = next((p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib/x86_64-linux-gnu/libm.so.6")
                  if os.path.exists(p)), None)
    if other is None:
        pytest.skip("needs some real shared library to stand in for a wrong one")
    named = tmp_path / "lib" / "libcudart.so.12.4.127"
    named.parent.mkdir()
    shutil.copyfile(other, named)
    monkeypatch.setenv("ACCEL_CUDART_PATH", str(named))
    choice = _cuda_libs.choose_real(12040, "test: a CUDA 12.4 driver")
    assert choice.chosen is None and "not a libcudart" in (choice.error or ""), choice.as_dict()


# (r70l found; fixed in session 30)
def test_the_version_is_the_librarys_own_not_its_file_names(tmp_path):
    w12 = _wheel12()
    named = tmp_path / "lib" / "libcudart.so.13.0.96"
    named.parent.mkdir()
    shutil.copyfile(w12, named)
    c = _cuda_libs.probe(_cuda_libs.Candidate(str(named), "test"))
    assert c.version == 12040, (c.version, c.version_from)


def test_probing_leaves_no_library_loaded_but_the_one_opened():
    w12 = _wheel12()
    got = _fresh_python("""
import gc, json, os
from accel.backends.cuda import libs as _cuda_libs
from accel import _ffi
def mapped():
    return sorted({l.split()[-1] for l in open("/proc/self/maps") if "libcudart" in l})
ch = _cuda_libs.choose_real(12040, "test")
gc.collect()
after_choice = mapped()
_ffi.open_cudart(ch.chosen.path, ch.chosen.version // 1000)
print(json.dumps({"after_choice": after_choice, "after_open": mapped(),
                  "chosen": os.path.realpath(ch.chosen.resolved)}))
""")
    assert got["after_choice"] == [], got        # every probed candidate was closed again
    assert [os.path.realpath(p) for p in got["after_open"]] == [got["chosen"]] == [os.path.realpath(w12)], got


# -- 2. the choice, the search places and the error ---------------------------------------------------

# (r70l found; fixed in session 30)
def test_a_cudart_directory_with_two_runtimes_gives_the_one_the_driver_runs(monkeypatch, tmp_path):
    w12, w13 = _wheel12(), _wheel13()
    lib = tmp_path / "lib"
    lib.mkdir()
    os.symlink(w12, lib / "libcudart.so.12")
    os.symlink(w13, lib / "libcudart.so.13")
    monkeypatch.setenv("ACCEL_CUDART_PATH", str(lib))
    choice = _cuda_libs.choose_real(12040, "test: a CUDA 12.4 driver")
    assert choice.usable and choice.chosen.version == 12040, choice.as_dict()


# (r70l found; fixed in session 30)
def test_a_relative_cudart_path_still_opens_after_a_chdir(monkeypatch, tmp_path):
    w12 = _wheel12()
    rel = f"rel_{tmp_path.name}"              # unique: probes are cached per path string
    (tmp_path / rel).mkdir()
    os.symlink(w12, tmp_path / rel / "libcudart.so.12")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ACCEL_BACKEND", "cuda")
    monkeypatch.setenv("ACCEL_CUDART_PATH", rel)
    _lazy._reset_for_tests()
    be = backends.get("cuda")
    choice = be.cudart_choice()                  # e.g. device_count() at import of a library
    assert choice.chosen is not None and choice.chosen.version == 12040
    monkeypatch.chdir("/")                       # the program moves to its output directory
    rep = be.report()
    assert rep.get("library") and os.path.realpath(rep["library"]) == os.path.realpath(w12), rep
    assert rep.get("runtime_version") == "12.4"


# (r70l found; fixed in session 30)
def test_a_wheel_installed_with_pip_target_is_a_candidate(monkeypatch, tmp_path):
    w12 = _wheel12()
    deps = tmp_path / "deps"
    lib = deps / "nvidia" / "cuda_runtime" / "lib"
    lib.mkdir(parents=True)
    os.symlink(w12, lib / "libcudart.so.12")
    monkeypatch.syspath_prepend(str(deps))
    from accel._ffi import cudart_search
    paths = [p for p, _s in cudart_search()[0]]
    assert str(lib / "libcudart.so.12") in paths, paths


# (r70l found; fixed in session 30)
def test_a_conda_environments_runtime_is_a_candidate(monkeypatch, tmp_path):
    w12 = _wheel12()
    prefix = tmp_path / "env"
    (prefix / "lib").mkdir(parents=True)
    shutil.copyfile(w12, prefix / "lib" / "libcudart.so.12.4.127")     # the package's own file
    os.symlink("libcudart.so.12.4.127", prefix / "lib" / "libcudart.so.12")
    for var in ("CUDA_HOME", "CUDA_PATH", "ACCEL_CUDART_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CONDA_PREFIX", str(prefix))
    from accel._ffi import cudart_search
    found = [os.path.realpath(p) for p, _s in cudart_search()[0] if os.sep in p]
    assert os.path.realpath(prefix / "lib" / "libcudart.so.12") in found


# (r70l found; fixed in session 30)
def test_the_error_when_no_runtime_loads_names_each_candidate_and_the_fix(monkeypatch, tmp_path):
    w12 = _wheel12()
    missing = tmp_path / "a" / "libcudart.so.13"
    broken = tmp_path / "b" / "libcudart.so.12"
    _make_bad("text", broken, w12)
    _only_search(monkeypatch, [(str(missing), "CUDA_HOME"), (str(broken), "CUDA_PATH")])
    choice = _cuda_libs.choose_real(12040, "test")
    err = choice.error or ""
    assert choice.chosen is None and str(missing) in err and str(broken) in err, err
    assert "no such file" in err and "file too short" in err
    assert "pip install nvidia-cuda-runtime" in err and "ACCEL_CUDART_PATH" in err, err


# (r70l found; fixed in session 30)
def test_the_too_new_error_also_names_the_broken_runtime_of_the_drivers_major(monkeypatch, tmp_path):
    w12, w13 = _wheel12(), _wheel13()
    broken = tmp_path / "cuda" / "lib64" / "libcudart.so.12"
    _make_bad("text", broken, w12)
    _only_search(monkeypatch, [(w13, "pip nvidia-cuda-runtime"), (str(broken), "CUDA_HOME")])
    choice = _cuda_libs.choose_real(12040, "test: a CUDA 12.4 driver")
    assert choice.chosen is None and "needs a driver supporting CUDA 13.0" in choice.error
    assert str(broken) in choice.error and "file too short" in choice.error, choice.error


# (r70l found; fixed in session 30)
def test_readme_describes_the_choice_without_nvml_as_it_is():
    text = open(os.path.join(_REPO, "README.md")).read()
    section = text[text.index("**Which CUDA runtime.**"):text.index("- **XPU**")]
    assert "cudaDriverGetVersion" in section and "Without NVML it takes the newest" not in section


@pytest.mark.parametrize("installed, driver, want", [
    ("12.4,13.0", "13.0", "13.0"),
    ("12.8,13.0", "12.4", "12.8"),     # 13.0 needs R580; 12.8 runs on 12.4 by minor-version compatibility
    ("12.4,12.8", "12.8", "12.8"),
])
def test_the_choice_follows_cudaDriverGetVersion_when_nvml_is_missing(monkeypatch, installed, driver, want):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CUDA_RUNTIME=installed, ACCEL_SIM_CUDA_DRIVER=driver)
    from accel import sim
    sim.configure(nvml=False)
    accel.current_device_index()
    rep = backends.get("cuda").report()
    assert rep["runtime_version"] == want and rep["cudart_choice"]["driver_cuda_version"] == driver
    assert "cudaDriverGetVersion" in rep["cudart_choice"]["driver_version_from"]


# -- 3. stability: threads and fork -----------------------------------------------------------------

_PROBE_THREADS = """
import collections, json, threading
import accel
from accel import backends
from accel.backends.cuda import libs as _cuda_libs
calls = collections.Counter()
real = _cuda_libs._probe
def counting(path):
    calls[path] += 1
    return real(path)
_cuda_libs._probe = counting
be = backends.get("cuda")
start = threading.Barrier(8)
seen = []
def work():
    start.wait()
    seen.append((id(be.cudart_choice()), accel.device_count(), be.cudart_choice().chosen.path))
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps({"seen": sorted(set(map(tuple, seen))), "max_calls": max(calls.values()), "n": len(seen)}))
"""


def test_many_threads_get_one_choice_and_each_candidate_is_probed_once():
    got = _fresh_python(_PROBE_THREADS, ACCEL_BACKEND="cuda")
    assert got["n"] == 8 and len(got["seen"]) == 1, got
    assert got["max_calls"] == 1, got


@pytest.mark.parametrize("chosen_in_parent", [True, False])
def test_a_forked_child_uses_the_parents_runtime(monkeypatch, chosen_in_parent):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CUDA_RUNTIME="12.4,12.8,13.0", ACCEL_SIM_CUDA_DRIVER="12.6")
    be = backends.get("cuda")
    if chosen_in_parent:
        assert accel.device_count() == 2 and be.cudart_choice().chosen.version == 12040

    def child():
        accel.current_device_index()
        rep = backends.get("cuda").report()
        return 0 if rep["runtime_version"] == "12.4" and rep["cudart_choice"]["chosen_version"] == "12.4" else 2
    assert run_forked(child) == 0
    accel.current_device_index()
    assert be.report()["runtime_version"] == "12.4"


# -- 4. NVRTC paired with the runtime ---------------------------------------------------------------

_NVRTC12 = r"""
int nvrtcVersion(int *major, int *minor) { *major = 12; *minor = 4; return 0; }
const char *nvrtcGetErrorString(int rc) { return "NVRTC_STUB"; }
"""

_PROBE_NVRTC = """
import json, sys
sys.path.append(sys.argv[1])
import accel
from accel.backends.cuda import nvrtc as _nvrtc
first = _nvrtc.version() if sys.argv[2] == "compile first" else None
accel.current_device_index()
from accel import backends
print(json.dumps({"runtime": backends.get("cuda").report()["runtime_version"], "first": first,
                  "after_init": _nvrtc.version(), "library": _nvrtc.open_lib()[2]}))
"""


# (r70l found; fixed in session 30)
def test_nvrtc_pairs_with_the_chosen_runtime_even_when_compiling_before_init(tmp_path):
    from accel._ffi import nvrtc_search
    if not any(p.endswith("libnvrtc.so.13") and os.path.exists(p) for p, _s in nvrtc_search()[0]):
        pytest.skip("needs the real nvidia-cuda-nvrtc (13) wheel")
    site = tmp_path / "site-packages"
    lib = site / "nvidia" / "cuda_nvrtc" / "lib"
    lib.mkdir(parents=True)
    stub = _gcc(tmp_path, "libnvrtc.so.12", "libnvrtc.so.12", _NVRTC12)
    shutil.move(stub, lib / "libnvrtc.so.12")
    env = dict(ACCEL_SIM="cuda", ACCEL_SIM_CUDA_RUNTIME="12.4,13.0", ACCEL_SIM_CUDA_DRIVER="12.4")
    after = _fresh_python(_PROBE_NVRTC, str(site), "init first", **env)
    assert after["runtime"] == "12.4" and after["after_init"] == [12, 4], after     # the pairing works here
    first = _fresh_python(_PROBE_NVRTC, str(site), "compile first", **env)
    assert first["runtime"] == "12.4"
    assert first["first"] == [12, 4] and first["after_init"] == [12, 4], first


# -- 5. Level Zero and Metal ------------------------------------------------------------------------

_ZE_PARTIAL = r"""
#include <stdint.h>
int zeInit(int flags) { (void)flags; return 0; }
int zeDriverGet(uint32_t *count, void **drivers) {
    if (drivers && *count) drivers[0] = (void *)0x1000;
    *count = 1;
    return 0;
}
"""

_PROBE_ZE = """
import json, os, accel
from accel import backends
be = backends.get("xpu")
rep = be.report()
out = {"library": rep.get("library"), "reason": rep.get("reason") or "", "error": None}
try:
    be.init()
except Exception as exc:
    out["error"] = [type(exc).__name__, isinstance(exc, accel.AcceleratorError), str(exc)]
print(json.dumps(out))
"""


# (r70l found; fixed in session 30)
def test_a_loader_lacking_required_functions_is_skipped_or_refused_clearly(tmp_path):
    fake_dir = tmp_path / "old_loader"
    fake_dir.mkdir()
    fake = _gcc(tmp_path, "libze_loader.so.1", "libze_loader.so.1", _ZE_PARTIAL)
    shutil.move(fake, fake_dir / "libze_loader.so.1")
    got = _fresh_python(_PROBE_ZE, LD_LIBRARY_PATH=str(fake_dir))
    took_fake = os.path.realpath(got["library"] or "") == os.path.realpath(fake_dir / "libze_loader.so.1")
    assert got["error"] is not None and got["error"][1], got      # an AcceleratorError, not cffi's error
    if took_fake:
        assert "zeDriverGetApiVersion" in got["reason"] + got["error"][2], got


_PROBE_MPS = """
import json, accel
from accel import backends
be = backends.get("mps")
rep = be.report()
out = {"count": accel.device_count(), "reason": rep.get("reason") or "", "load_error": rep.get("load_error") or ""}
try:
    accel.current_device_index()
    out["error"] = None
except Exception as exc:
    out["error"] = [type(exc).__name__, isinstance(exc, accel.AcceleratorError), str(exc)]
print(json.dumps(out))
"""


# (r70l found; fixed in session 30)
def test_objc_and_metal_overrides_naming_other_libraries_are_refused_by_name():
    other = next((p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib/x86_64-linux-gnu/libm.so.6",
                              "/lib64/libm.so.6") if os.path.exists(p)), None)
    if other is None or sys.platform == "darwin":
        pytest.skip("needs a Linux libm to stand in for a wrong library")
    got = _fresh_python(_PROBE_MPS, ACCEL_BACKEND="mps", ACCEL_OBJC_PATH=other, ACCEL_METAL_PATH=other)
    assert got["count"] == 0, got
    assert "ACCEL_OBJC_PATH" in got["load_error"] and "objc_msgSend" in got["load_error"], got
    assert got["error"] is not None and got["error"][1], got


# (r70l found; fixed in session 30)
@pytest.mark.parametrize("spelling", ["MPS", " mps"])
def test_accel_sim_mps_is_read_as_the_other_backends_read_it(monkeypatch, spelling):
    use_sim(monkeypatch, spelling)
    be = backends.select()
    assert be is not None and be.name == "mps"
    assert be.report()["simulated"] is True and accel.device_count() == 1


@pytest.mark.parametrize("kind, spelling", [("cuda", "CUDA"), ("xpu", " xpu ")])
def test_accel_sim_cuda_and_xpu_accept_any_case(monkeypatch, kind, spelling):
    use_sim(monkeypatch, spelling)
    be = backends.select()
    assert be.name == kind and be.report()["simulated"] is True and accel.device_count() == 2
