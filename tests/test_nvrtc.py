"""accel.compile: CUDA C++ to PTX through the real NVRTC (issue 18 item 3).

NVRTC needs no driver and no GPU, so these run for real wherever libnvrtc is installed
(``pip install 'accel[nvrtc]'``; CI installs nvidia-cuda-nvrtc); they skip with the reason
where it is absent.  Argument checks run everywhere: they fail before NVRTC is opened.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest

import accel
import accel._ffi as F
from accel import compiler
from accel.backends.cuda import nvrtc as _nvrtc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SAXPY = r'''
extern "C" __global__ void saxpy(float a, const float *x, float *y, unsigned long long n)
{
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
'''


def _nvrtc_or_skip():
    try:
        return _nvrtc.version()
    except RuntimeError as exc:
        pytest.skip("NVRTC absent (pip install 'accel[nvrtc]'): %s" % str(exc).splitlines()[0])


@pytest.fixture
def nvrtc():
    return _nvrtc_or_skip()


def _run_py(code, env=None):
    full = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    full["PYTHONPATH"] = REPO + os.pathsep + full.get("PYTHONPATH", "")
    full.update(env or {})
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env=full, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


# -- compiling for real ---------------------------------------------------------

@pytest.mark.reallib
def test_saxpy_compiles_to_ptx_with_its_entry(nvrtc):
    prog = accel.compile(SAXPY, name="saxpy.cu", arch="compute_90")
    assert isinstance(prog, compiler.Program)
    assert isinstance(prog.ptx, bytes) and b"\0" not in prog.ptx
    assert b".visible .entry saxpy(" in prog.ptx
    assert b".target sm_90" in prog.ptx
    assert prog.entries == ("saxpy",)
    assert prog.name == "saxpy.cu" and prog.arch == "compute_90" and prog.cubin is None
    assert isinstance(prog.log, str)
    assert prog.options == ("--gpu-architecture=compute_90",)
    assert "saxpy" in repr(prog)


@pytest.mark.reallib
def test_first_compile_in_a_fresh_process_finds_the_builtins(nvrtc):
    """libnvrtc dlopens libnvrtc-builtins.so.X.Y by soname at the first compile; from the
    nvidia-cuda-nvrtc 13.0.88 wheel nothing finds it (no RUNPATH, the wheel's lib/ on no
    search path) unless accel opened it first.  A fresh process, no LD_LIBRARY_PATH."""
    env = {"LD_LIBRARY_PATH": ""}
    got = _run_py("""
        import json, accel
        prog = accel.compile('extern "C" __global__ void k(int *p) { *p = 1; }')
        print(json.dumps({"entries": prog.entries, "arch": prog.arch, "init": accel.is_initialized()}))
    """, env)
    assert got["entries"] == ["k"]
    # no device initialized: NVRTC's default architecture, read back from the PTX
    assert got["arch"].startswith("compute_")
    assert got["init"] is False          # compile never initializes a runtime


@pytest.mark.reallib
def test_sm_arch_also_gives_a_cubin_and_tuple_arch_gives_ptx(nvrtc):
    prog = accel.compile(SAXPY, arch="sm_90")
    assert prog.arch == "sm_90" and prog.entries == ("saxpy",)
    assert prog.cubin is not None and prog.cubin[:4] == b"\x7fELF"
    assert accel.compile(SAXPY, arch=(9, 0)).arch == "compute_90"
    assert accel.compile(SAXPY.encode(), arch=[8, 0]).arch == "compute_80"


@pytest.mark.reallib
def test_syntax_error_raises_compile_error_with_nvrtc_log(nvrtc):
    src = 'extern "C" __global__ void broken(int *p) {\n    *p = ;\n}\n'
    with pytest.raises(accel.CompileError) as ei:
        accel.compile(src, name="broken.cu")
    err = ei.value
    assert isinstance(err, accel.AcceleratorError) and isinstance(err, RuntimeError)
    assert "broken.cu(2): error: expected an expression" in err.log
    assert "broken.cu(2): error: expected an expression" in str(err)   # the log is in the message
    assert err.code == 6 and err.code_name == "NVRTC_ERROR_COMPILATION"
    assert err.library == "nvrtc" and err.call == "nvrtcCompileProgram"


@pytest.mark.reallib
def test_option_nvrtc_rejects_raises_compile_error(nvrtc):
    with pytest.raises(accel.CompileError, match="--no-such-option") as ei:
        accel.compile(SAXPY, options=["--no-such-option"])
    assert ei.value.code_name == "NVRTC_ERROR_INVALID_OPTION"


@pytest.mark.reallib
def test_define_options_change_the_result(nvrtc):
    src = r'''
    extern "C" __global__ void KERNEL(int *y) { y[0] = SCALE; }
    '''
    a = accel.compile(src, options=("-DKERNEL=scale_a", "-DSCALE=12345"))
    b = accel.compile(src, options=["--define-macro=KERNEL=scale_b", "-DSCALE=67890"])
    assert a.entries == ("scale_a",) and b.entries == ("scale_b",)
    assert b", 12345;" in a.ptx and b", 67890;" in b.ptx and b"67890" not in a.ptx
    assert a.options[-2:] == ("-DKERNEL=scale_a", "-DSCALE=12345")
    with pytest.raises(accel.CompileError, match="SCALE"):         # without the define: undefined
        accel.compile(src, options=("-DKERNEL=k",))


@pytest.mark.reallib
def test_arch_in_options_is_used(nvrtc):
    prog = accel.compile(SAXPY, options=("-arch=compute_80",))
    assert b".target sm_80" in prog.ptx and prog.arch == "compute_80"


def _ptxas():
    found = []
    for d in [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]:
        if d:
            found.append(os.path.join(d, "bin", "ptxas"))
    for sp in sys.path:
        if sp.endswith("site-packages"):
            found.append(os.path.join(sp, "nvidia", "cu13", "bin", "ptxas"))   # the nvidia-cuda-nvcc wheel
    if shutil.which("ptxas"):
        found.append(shutil.which("ptxas"))
    return [p for p in found if os.path.isfile(p) and os.access(p, os.X_OK)]


@pytest.mark.reallib
def test_ptxas_assembles_the_ptx_for_sm_90(nvrtc, tmp_path):
    tools = _ptxas()
    if not tools:
        pytest.skip("no ptxas (CUDA toolkit's bin/ or the nvidia-cuda-nvcc wheel) on this machine")
    prog = accel.compile(SAXPY, name="saxpy.cu", arch="compute_90")
    ptx = tmp_path / "saxpy.ptx"
    ptx.write_bytes(prog.ptx)
    too_old = []
    for tool in tools:
        cubin = tmp_path / "saxpy.cubin"
        res = subprocess.run([tool, "-arch=sm_90", str(ptx), "-o", str(cubin)], capture_output=True, text=True,
                             timeout=120)
        if res.returncode != 0 and "Unsupported .version" in res.stderr:
            too_old.append("%s: %s" % (tool, res.stderr.strip().splitlines()[0]))
            continue
        assert res.returncode == 0, res.stderr
        assert cubin.read_bytes()[:4] == b"\x7fELF"
        return
    pytest.skip("the PTX of NVRTC %d.%d is newer than every ptxas here can read: %s"
                % (nvrtc + ("; ".join(too_old),)))


@pytest.mark.reallib
def test_threads_compile_in_parallel(nvrtc):
    out, errors = {}, []

    def work(i):
        try:
            out[i] = accel.compile('extern "C" __global__ void k%d(int *p) { *p = %d; }' % (i, i)).entries
        except Exception as exc:   # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert out == {i: ("k%d" % i,) for i in range(4)}


class _CountingLib:
    """libnvrtc with its program create/destroy calls counted."""

    def __init__(self, lib):
        self._lib, self.created, self.destroyed = lib, 0, 0

    def nvrtcCreateProgram(self, *args):
        rc = self._lib.nvrtcCreateProgram(*args)
        self.created += rc == 0
        return rc

    def nvrtcDestroyProgram(self, prog):
        self.destroyed += 1
        return self._lib.nvrtcDestroyProgram(prog)

    def __getattr__(self, name):
        return getattr(self._lib, name)


@pytest.mark.reallib
def test_every_program_is_destroyed_on_every_path(nvrtc, monkeypatch):
    ffi, lib, path = _nvrtc.open_lib()
    counting = _CountingLib(lib)
    monkeypatch.setattr(_nvrtc, "open_lib", lambda: (ffi, counting, path))
    accel.compile(SAXPY)
    with pytest.raises(accel.CompileError):
        accel.compile("this is not C++")
    with pytest.raises(accel.CompileError):
        accel.compile(SAXPY, options=["--bogus"])
    assert counting.created == counting.destroyed == 3


# -- arch None: the current device's when a runtime is initialized ----------------

@pytest.mark.reallib
def test_arch_defaults_to_the_initialized_device(nvrtc, monkeypatch):
    monkeypatch.setenv("ACCEL_SIM", "cuda")
    monkeypatch.setenv("ACCEL_SIM_CC", "8.6")
    assert accel.compile(SAXPY).arch != "compute_86"    # not initialized: NVRTC's default
    assert not accel.is_initialized()
    accel.set_device_index(1)                            # the non-current device's twin: same model
    prog = accel.compile(SAXPY)
    assert prog.arch == "compute_86" and b".target sm_86" in prog.ptx


@pytest.mark.reallib
def test_a_device_newer_than_nvrtc_gets_nvrtc_newest(nvrtc, monkeypatch):
    monkeypatch.setenv("ACCEL_SIM", "cuda")
    monkeypatch.setenv("ACCEL_SIM_CC", "19.0")
    accel.current_device_index()
    newest = max(_nvrtc.supported_archs())
    assert accel.compile(SAXPY).arch == "compute_%d" % newest


@pytest.mark.reallib
def test_a_device_older_than_nvrtc_supports_is_a_clear_error(nvrtc, monkeypatch):
    monkeypatch.setenv("ACCEL_SIM", "cuda")
    monkeypatch.setenv("ACCEL_SIM_CC", "3.5")
    accel.current_device_index()
    with pytest.raises(ValueError, match=r"cuda:0\) is sm_35.*pass arch="):
        accel.compile(SAXPY)
    assert accel.compile(SAXPY, arch="compute_90").arch == "compute_90"   # explicit arch still works


@pytest.mark.reallib
def test_arch_nvrtc_cannot_target_names_the_supported_ones(nvrtc):
    with pytest.raises(ValueError, match=r"'sm_20'.*cannot target it; it supports sm_\d+"):
        accel.compile(SAXPY, arch="sm_20")


# -- bad arguments: clear errors before NVRTC is called -----------------------------

@pytest.mark.parametrize("source", [None, 42, ["__global__ void k() {}"]])
def test_source_must_be_text(source):
    with pytest.raises(TypeError, match="source must be str or bytes"):
        accel.compile(source)


def test_source_with_nul_is_refused():
    with pytest.raises(ValueError, match="source contains a NUL character at offset 3"):
        accel.compile("abc\0def")


def test_options_must_be_a_sequence_of_strings():
    with pytest.raises(TypeError, match="not a single str: '-DN=4'"):
        accel.compile(SAXPY, options="-DN=4")
    with pytest.raises(TypeError, match=r"options\[1\] must be a str, got bytes"):
        accel.compile(SAXPY, options=["-DA=1", b"-DB=2"])
    with pytest.raises(TypeError, match=r"options\[0\] must be a str, got int"):
        accel.compile(SAXPY, options=(4,))
    with pytest.raises(TypeError, match="options must be a sequence of strings, got int"):
        accel.compile(SAXPY, options=4)


@pytest.mark.parametrize("arch", ["sm90", "90", "sm_9", "gfx90a", "compute_90x", "", (9,), (9, 0, 0), (9, 10),
                                  ("9", "0"), (True, 0)])
def test_bad_arch_values(arch):
    with pytest.raises(ValueError, match="arch"):
        accel.compile(SAXPY, arch=arch)


@pytest.mark.parametrize("arch", [90, 9.0, b"sm_90"])
def test_bad_arch_types(arch):
    with pytest.raises(TypeError, match="arch must be None, a str"):
        accel.compile(SAXPY, arch=arch)


def test_arch_given_twice():
    with pytest.raises(ValueError, match="architecture is given twice"):
        accel.compile(SAXPY, arch="sm_90", options=["--gpu-architecture=sm_80"])


def test_bad_name():
    with pytest.raises(TypeError, match="name must be a str"):
        accel.compile(SAXPY, name=b"saxpy.cu")


def test_no_nvrtc_names_the_wheel(monkeypatch, tmp_path):
    missing = str(tmp_path / "libnvrtc.so.13")
    monkeypatch.setenv("ACCEL_NVRTC_PATH", missing)
    monkeypatch.setattr(F, "_opened", {})
    with pytest.raises(RuntimeError) as ei:
        accel.compile(SAXPY)
    assert not isinstance(ei.value, accel.CompileError)
    msg = str(ei.value)
    assert "pip install 'accel[nvrtc]'" in msg and "nvidia-cuda-nvrtc" in msg
    assert missing in msg and "ACCEL_NVRTC_PATH" in msg
    assert not F.is_open("nvrtc")


def test_compile_is_exported_and_lazy():
    got = _run_py("""
        import json, sys, accel
        before = "accel.compiler" in sys.modules
        fn = accel.compile
        print(json.dumps({"before": before, "mod": fn.__module__, "builtin_ok": compile("1", "x", "eval") is not None,
                          "exported": "compile" in accel.__all__ and "CompileError" in accel.__all__,
                          "err": accel.CompileError.__mro__[1].__name__}))
    """)
    assert got == {"before": False, "mod": "accel.compiler", "builtin_ok": True, "exported": True,
                   "err": "AcceleratorError"}


# -- which libnvrtc: the loaded runtime's major first ------------------------------------

def test_open_nvrtc_tries_the_preferred_major_first(monkeypatch, tmp_path):
    found = [(str(tmp_path / "a" / "libnvrtc.so.13"), "pip nvidia-cuda-nvrtc"),
             (str(tmp_path / "b" / "libnvrtc.so.12"), "pip nvidia-cuda-nvrtc-cu12"),
             (str(tmp_path / "c" / "libnvrtc.so.13"), "CUDA_HOME")]
    monkeypatch.setattr(F, "nvrtc_search", lambda: (found, False))
    monkeypatch.setattr(F, "_opened", {})
    with pytest.raises(F.LibraryNotFound) as ei:
        F.open_nvrtc(12)
    assert [p for p, _why in ei.value.tried] == [found[1][0], found[0][0], found[2][0]]
    with pytest.raises(F.LibraryNotFound) as ei:
        F.open_nvrtc(None)                                   # no preference: search order
    assert [p for p, _why in ei.value.tried] == [p for p, _s in found]


def test_preferred_major_is_the_initialized_runtimes(monkeypatch):
    assert _nvrtc._runtime_major() is None                   # nothing initialized
    monkeypatch.setenv("ACCEL_SIM", "cuda")
    accel.current_device_index()
    backend = accel._lazy.ready
    assert _nvrtc._runtime_major() == backend._choice.chosen.version // 1000


def test_python_m_accel_names_the_nvrtc_it_would_use(monkeypatch, tmp_path):
    """`python -m accel` says which libnvrtc accel.compile would load, or why there is none."""
    from accel import __main__ as cli
    monkeypatch.setenv("ACCEL_NVRTC_PATH", str(tmp_path / "no-such-libnvrtc.so"))
    with monkeypatch.context() as m:
        m.setattr(F, "_opened", {})            # as in a fresh process (the library is cached once opened)
        missing = cli._nvrtc()
    assert "error" in missing and "accel[nvrtc]" in missing["error"]
    monkeypatch.delenv("ACCEL_NVRTC_PATH")
    try:
        found = _nvrtc.version()
    except RuntimeError:
        return
    report = cli._nvrtc()
    assert report["version"] == "%d.%d" % found and "nvrtc" in report["library"]
