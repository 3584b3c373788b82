"""Tests for tools/gen_bindings.py and accel._ffi (generated modules + loader).

Checks that need the vendor headers, a C compiler or a real vendor library skip
with the reason when those are absent; each library is checked on its own.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

import accel._ffi as F
from conftest import THOROUGH

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "gen_bindings.py")
ALL = ["cudart", "nvml", "ze", "objc", "metal", "nvrtc"]
HEADER_LIBS = ["cudart", "nvml", "ze"]
# generator keys of the per-major CUDA modules (accel._ffi.cudart_module) and the driver types
CUDA_GEN = ["cudart", "cudart12", "cudadrv"]


def _tool():
    spec = importlib.util.spec_from_file_location("gen_bindings", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_bindings", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tool():
    pytest.importorskip("pycparser", reason="pycparser is needed to run the generator")
    return _tool()


def _need_headers(tool, name):
    lib = tool.LIBRARIES[name]
    if lib.literal_cdef is not None:
        return None
    if tool.find_compiler() is None:
        pytest.skip("no C preprocessor (gcc/cc/clang/cpp) on PATH")
    root = tool.find_include_root(lib)
    if root is None:
        pytest.skip("%s headers %s not found on this machine" % (name, lib.headers))
    return root


def _run_py(code, env=None, timeout=60):
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = REPO + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env=full_env, cwd=REPO, timeout=timeout)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


# -- (a) determinism ------------------------------------------------------------

def _full_check_possible(tool):
    for name in HEADER_LIBS + ["nvrtc"]:
        lib = tool.LIBRARIES[name]
        if tool.find_compiler() is None or tool.find_include_root(lib) is None:
            return "%s headers or compiler missing" % name
    return None


@pytest.fixture(scope="module")
def full_check(tool):
    """``gen_bindings.py --check`` of every library, run once for the module (it regenerates
    each in a process of its own); None where some headers or the compiler are missing."""
    if _full_check_possible(tool):
        return None
    return subprocess.run([sys.executable, TOOL, "--check"], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


@pytest.mark.parametrize("name", ALL + ["cudart12", "cudadrv"])
def test_regeneration_is_byte_identical(tool, full_check, name):
    _need_headers(tool, name)
    lib = tool.LIBRARIES[name]
    text = tool.render(tool.generate(lib))
    path = os.path.join(REPO, "accel", "_ffi", lib.module + ".py")
    with open(path) as f:
        committed = f.read()
    assert text == committed, "accel/_ffi/%s.py is stale: run python tools/gen_bindings.py" % lib.module
    # twice in a row: no timestamps, temp paths or set-order leaks.  The default run takes the
    # second generation from the module's --check run (another process, another hash seed: it
    # compares its own generation with the same committed file); THOROUGH (or without the full
    # --check) generates again here, as before.
    if THOROUGH or full_check is None or lib.literal_cdef is not None:
        assert tool.render(tool.generate(lib)) == text
    else:
        said = os.path.join("accel", "_ffi", lib.module + ".py") + " up to date"
        assert full_check.returncode == 0 and any(line.endswith(said) for line in full_check.stdout.splitlines()), \
            full_check.stdout + full_check.stderr


def test_check_mode_reports_up_to_date(tool, full_check):
    why = _full_check_possible(tool)
    if why:
        pytest.skip(why)
    res = full_check
    assert res.returncode == 0, res.stdout + res.stderr


def test_check_mode_passes_for_the_cuda_modules(tool):
    """--check of the per-major CUDA modules on its own (the full --check needs NVML's
    headers too): up to date, and each symbol-checked against its real libcudart when
    that is installed (a declared non-optional function it lacks fails the check)."""
    for name in CUDA_GEN:
        _need_headers(tool, name)
    res = subprocess.run([sys.executable, TOOL, "--check", "--only", ",".join(CUDA_GEN)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    for name in ("cudart", "cudart12"):
        real = tool.find_real_library(tool.LIBRARIES[name])
        if real is not None:
            assert "%s: every non-optional function is exported by %s" % (name, real) in res.stdout
        else:
            assert "%s: no real library found to symbol-check against" % name in res.stdout


def test_check_mode_detects_a_difference(tool, tmp_path):
    res = subprocess.run([sys.executable, TOOL, "--check", "--only", "objc", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 1
    assert "_objc.py differs" in res.stdout


def test_generated_headers_say_generated_and_record_versions():
    for name in ALL:
        mod = F.module(name)
        with open(mod.__file__) as f:
            head = f.read(2000)
        assert head.startswith("# GENERATED by tools/gen_bindings.py")
        assert "/tmp/" not in head and REPO not in head
        assert mod.LIBRARY == name
        assert isinstance(mod.CDEF, str) and mod.CDEF
    assert F.module("cudart").HEADER_VERSIONS["CUDART_VERSION"].isdigit()
    for major in F.CUDART_MAJORS:
        mod = F.cudart_module(major)
        with open(mod.__file__) as f:
            assert f.read(200).startswith("# GENERATED by tools/gen_bindings.py")
        assert mod.LIBRARY == "cudart"
        assert int(mod.HEADER_VERSIONS["CUDART_VERSION"]) // 1000 == major
    assert F.module("nvml").HEADER_VERSIONS["NVML_API_VERSION"].isdigit()
    assert "ZE_API_VERSION_CURRENT" in F.module("ze").HEADER_VERSIONS
    # nvrtc.h has no version macro: the package that installed it is recorded
    assert F.module("nvrtc").HEADER_VERSIONS["nvrtc.h package"].startswith(("nvidia-cuda-nvrtc", "CUDA toolkit"))


# -- generated module contents --------------------------------------------------

def test_constants_are_on_the_declarations():
    cd = F.module("cudart").CDEF
    for name in ("#define cudaStreamNonBlocking 1", "#define cudaEventDisableTiming 2",
                 "#define cudaHostAllocPortable 1", "cudaErrorInsufficientDriver = 35"):
        assert name in cd
    assert "#define NVML_DEVICE_UUID_V2_BUFFER_SIZE 96" in F.module("nvml").CDEF
    assert "#define ZE_MAX_DEVICE_NAME 256" in F.module("ze").CDEF


def test_optional_symbols_and_aliases_exported():
    ze = F.module("ze")
    assert {"zeInitDrivers", "zesInit", "zeCommandListHostSynchronize"} <= ze.OPTIONAL_SYMBOLS
    assert ze.OPTIONAL_SYMBOLS <= set(ze.FUNCTIONS)
    # declarations taken from newer headers are only ever optional ones
    assert set(ze.SPEC_FALLBACK) <= ze.OPTIONAL_SYMBOLS
    for name in ALL:
        mod = F.module(name)
        assert isinstance(mod.ALIASES, dict)
        assert set(mod.ALIASES.values()) <= set(mod.FUNCTIONS)


def test_objc_msgsend_declared_without_arguments():
    # arm64: objc_msgSend is never called variadically; callers cast it per signature.
    ffi = F.module("objc").ffi
    assert ffi.typeof("id(*)(id, SEL, unsigned long)")
    assert "void objc_msgSend(void);" in F.module("objc").CDEF
    assert "id MTLCreateSystemDefaultDevice(void);" in F.module("metal").CDEF


def test_cuda_device_prop_is_complete():
    ffi = F.module("cudart").ffi
    names = [n for n, _ in ffi.typeof("struct cudaDeviceProp").fields]
    for field in ("name", "uuid", "totalGlobalMem", "major", "minor", "multiProcessorCount",
                  "pciBusID", "reserved"):
        assert field in names


# -- (c) struct layouts against the C compiler ---------------------------------

def _layout_program(mod, structs):
    ffi = mod.ffi
    lines = ["#include <stdio.h>", "#include <stddef.h>"]
    lines += ['#include "%s"' % h for h in mod.HEADERS]
    lines.append("int main(void) {")
    expected = {}
    for s in structs:
        key = "%s sizeof" % s
        lines.append('printf("%%s %%zu\\n", "%s", sizeof(%s));' % (key, s))
        lines.append('printf("%%s %%zu\\n", "%s alignof", _Alignof(%s));' % (s, s))
        expected[key] = ffi.sizeof(s)
        expected["%s alignof" % s] = ffi.alignof(s)
        for fname, field in ffi.typeof(s).fields:
            if field.bitsize != -1 or not fname:
                continue
            key = "%s .%s" % (s, fname)
            lines.append('printf("%%s %%zu\\n", "%s", offsetof(%s, %s));' % (key, s, fname))
            expected[key] = ffi.offsetof(s, fname)
    lines.append("return 0; }")
    return "\n".join(lines) + "\n", expected


@pytest.mark.parametrize("name", HEADER_LIBS + ["cudart12"])
def test_struct_layouts_match_the_c_compiler(tool, name):
    root = _need_headers(tool, name)
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to compile the layout check")
    mod = F.module(name) if name != "cudart12" else F.cudart_module(12)
    assert mod.STRUCTS, "no structs emitted for %s" % name
    src, expected = _layout_program(mod, mod.STRUCTS)
    with tempfile.TemporaryDirectory() as tmp:
        c = os.path.join(tmp, "layout.c")
        exe = os.path.join(tmp, "layout")
        with open(c, "w") as f:
            f.write(src)
        # after the root: the generator's stand-ins for headers the root lacks (the cu12 wheel has no crt/)
        _stubs, after = tool._write_stubs(os.path.join(tmp, "gen"))
        res = subprocess.run([cc, "-std=gnu11", "-I", root, "-I", after, c, "-o", exe],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-3000:]
        out = subprocess.run([exe], capture_output=True, text=True, check=True).stdout
    got = {}
    for line in out.splitlines():
        key, _, val = line.rpartition(" ")
        got[key] = int(val)
    mismatched = {k: (expected[k], got.get(k)) for k in expected if expected[k] != got.get(k)}
    assert not mismatched, "cffi vs C (%s): %s" % (name, mismatched)


# -- (d) imports stay light ----------------------------------------------------

def test_import_opens_nothing_and_needs_no_parser():
    got = _run_py("""
        import json, sys
        import accel._ffi
        mods = ["accel._ffi." + m for m in accel._ffi.LIBRARIES.values()]
        before = sorted(m for m in sys.modules if m.startswith("accel._ffi."))
        for m in mods:
            __import__(m)
        maps = open("/proc/self/maps").read() if sys.platform.startswith("linux") else ""
        print(json.dumps({
            "parser": sorted(m for m in sys.modules if m.startswith(("pycparser", "cffi"))),
            "before": before,
            "libs": [n for n in ("libcudart", "libnvidia-ml", "libze_loader", "libobjc", "libnvrtc")
                     if n in maps],
        }))
    """)
    assert got["parser"] == []
    assert got["before"] == []     # the package imports no generated module by itself
    assert got["libs"] == []


# -- (e) loader ---------------------------------------------------------------

def test_env_override_missing_file_names_it(monkeypatch, tmp_path):
    missing = str(tmp_path / "libcudart.so.99")
    monkeypatch.setenv("ACCEL_CUDART_PATH", missing)
    monkeypatch.setattr(F, "_opened", {})
    with pytest.raises(F.LibraryNotFound) as ei:
        F.open_library("cudart")
    assert isinstance(ei.value, OSError)
    assert missing in str(ei.value)
    assert "ACCEL_CUDART_PATH" in str(ei.value)
    assert ei.value.tried == [(missing, "no such file")]
    assert not F.is_open("cudart")


def test_env_override_not_a_library(monkeypatch, tmp_path):
    bogus = tmp_path / "libnvidia-ml.so.1"
    bogus.write_text("not an ELF file")
    monkeypatch.setenv("ACCEL_NVML_PATH", str(bogus))
    monkeypatch.setattr(F, "_opened", {})
    with pytest.raises(F.LibraryNotFound) as ei:
        F.open_library("nvml")
    assert str(bogus) in str(ei.value)


def test_unknown_library_name():
    with pytest.raises(ValueError, match="unknown library"):
        F.open_library("opencl")


def test_candidates_search_order(monkeypatch):
    monkeypatch.delenv("ACCEL_CUDART_PATH", raising=False)
    monkeypatch.setenv("CUDA_HOME", "/opt/mycuda")
    c = F.candidates("cudart")
    assert c[:3] == ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    assert "/opt/mycuda/lib64/libcudart.so.13" in c
    assert any("nvidia/cu13/lib" in p for p in c)
    assert F.candidates("nvml")[0] == "libnvidia-ml.so.1"
    assert F.candidates("ze")[0] == "libze_loader.so.1"
    nv = F.candidates("nvrtc")
    wheel = [i for i, p in enumerate(nv) if "nvidia/cu13/lib/libnvrtc.so.13" in p]
    toolkit = nv.index("/opt/mycuda/lib64/libnvrtc.so.13")
    assert wheel and wheel[0] < toolkit < nv.index("libnvrtc.so.13")   # wheel, toolkit, system
    assert nv[-3:] == ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]


def test_nvrtc_env_override_file_or_lib_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("ACCEL_NVRTC_PATH", str(tmp_path / "libnvrtc.so.13"))
    assert F.nvrtc_search() == ([(str(tmp_path / "libnvrtc.so.13"), "ACCEL_NVRTC_PATH")], True)
    (tmp_path / "libnvrtc.so.12").write_bytes(b"")
    monkeypatch.setenv("ACCEL_NVRTC_PATH", str(tmp_path))       # a lib/ directory: the libnvrtc in it
    assert F.candidates("nvrtc") == [str(tmp_path / "libnvrtc.so.12")]
    monkeypatch.setattr(F, "_opened", {})
    with pytest.raises(F.LibraryNotFound) as ei:
        F.open_library("nvrtc")
    assert "ACCEL_NVRTC_PATH" in str(ei.value) and str(tmp_path / "libnvrtc.so.12") in str(ei.value)
    assert not F.is_open("nvrtc")


def test_has_symbol_on_a_fake_lib():
    class Lib:
        present = 1

        def __getattr__(self, name):
            raise AttributeError(name)

    assert F.has_symbol(Lib(), "present")
    assert not F.has_symbol(Lib(), "zesInit")


def _open_or_skip(name):
    code = """
        import json, accel._ffi as F
        try:
            ffi, lib, path = F.open_library(%r)
        except F.LibraryNotFound as e:
            print(json.dumps({"skip": str(e)})); raise SystemExit
        print(json.dumps({"path": path}))
    """ % name
    got = _run_py(code)
    if "skip" in got:
        pytest.skip("real %s library absent: %s" % (name, got["skip"].splitlines()[0]))
    return got["path"]


def test_real_cudart():
    _open_or_skip("cudart")
    got = _run_py("""
        import json, accel._ffi as F
        ffi, lib, path = F.open_library("cudart")
        v = ffi.new("int *")
        rv = lib.cudaRuntimeGetVersion(v)
        n = ffi.new("int *")
        rc = lib.cudaGetDeviceCount(n)
        print(json.dumps({"rv": rv, "ver": v[0], "rc": rc, "path": path,
                          "name35": ffi.string(lib.cudaGetErrorName(35)).decode(),
                          "missing": F.missing_symbols("cudart"),
                          "consts": [lib.cudaSuccess, lib.cudaErrorInsufficientDriver,
                                     lib.cudaStreamNonBlocking, lib.cudaMemcpyDeviceToHost]}))
    """)
    assert got["missing"] == [], "declared but not exported by %s" % got["path"]
    assert got["rv"] == 0 and got["ver"] // 1000 >= 12
    if got["ver"] // 1000 == 13:
        assert 13000 <= got["ver"] < 14000
    assert got["name35"] == "cudaErrorInsufficientDriver"
    assert got["consts"] == [0, 35, 1, 2]
    # This machine has no driver: 35 (cudaErrorInsufficientDriver).  With a GPU it is 0.
    assert got["rc"] in (0, 35, 100)


@pytest.mark.parametrize("name,major", [("cudart", 13), ("cudart12", 12)])
def test_each_cuda_module_is_exported_by_its_real_library(tool, name, major):
    """accel._ffi.cudart_module(major).FUNCTIONS against the real libcudart of that major
    (13: /usr/local/cuda or the nvidia-cuda-runtime wheel; 12: the nvidia-cuda-runtime-cu12
    wheel): every non-optional function exported, read from the ELF symbol table and
    through the module's own ffi; the optional ones are exactly those the version lacks."""
    lib = tool.LIBRARIES[name]
    path = tool.find_real_library(lib)
    if path is None:
        pytest.skip("no real libcudart.so.%d installed (pip install %s)"
                    % (major, "nvidia-cuda-runtime" if major == 13 else "nvidia-cuda-runtime-cu12==12.4.127"))
    mod = F.cudart_module(major)
    exported = tool.library_exports(path)
    optional = set(mod.OPTIONAL_SYMBOLS) | {mod.ALIASES.get(f, f) for f in mod.OPTIONAL_SYMBOLS}
    required = [f for f in mod.FUNCTIONS if f not in optional]
    assert [f for f in required if f not in exported] == [], path
    opened = mod.ffi.dlopen(path)
    try:
        assert [f for f in required if not F.has_symbol(opened, f)] == [], path
        absent = {f for f in mod.FUNCTIONS if not F.has_symbol(opened, f)}
    finally:
        mod.ffi.dlclose(opened)
    assert absent <= optional
    v = open(path, "rb").read()
    assert b"libcudart.so.%d" % major in v          # the soname of the major it is bound for
    if major == 12 and "cudaLibraryLoadData" not in exported:   # 12.4: before cudaLibrary*
        assert {"cudaLibraryLoadData", "cudaLibraryGetKernel", "cudaLibraryUnload"} <= absent


def test_symbol_check_fails_on_a_missing_required_function(tool):
    lib = tool.LIBRARIES["cudart"]
    path = tool.find_real_library(lib)
    if path is None:
        pytest.skip("no real libcudart.so.13 installed")
    g = tool.Generated(lib, "", [], {}, ["cudaMalloc", "cudaNoSuchFunction", "cudaGetDriverEntryPointByVersion"],
                       [], [])
    assert tool.symbol_check(g, path) == (["cudaNoSuchFunction"], [])


def test_include_root_must_be_of_the_wanted_major(tool, tmp_path):
    for major, version in ((12, 12040), (13, 13000)):
        (tmp_path / str(major)).mkdir()
        (tmp_path / str(major) / "cuda_runtime_api.h").write_text("#define CUDART_VERSION  %d\n" % version)
    roots = lambda: iter([str(tmp_path / "13"), str(tmp_path / "12")])
    for major in (12, 13):
        lib = tool.Library(name="x", module="_x", functions=[], headers=["cuda_runtime_api.h"],
                           include_roots=(roots,), cuda_major=("cuda_runtime_api.h", "CUDART_VERSION", major))
        assert tool.find_include_root(lib) == str(tmp_path / str(major))
    lib.cuda_major = ("cuda_runtime_api.h", "CUDART_VERSION", 11)
    assert tool.find_include_root(lib) is None


def test_renames_through_function_like_macros_resolve(tool, tmp_path):
    """CUDA 12: #define cudaStreamGetCaptureInfo __CUDART_API_PTSZ(cudaStreamGetCaptureInfo_v2)."""
    if tool.find_compiler() is None:
        pytest.skip("no C preprocessor on PATH")
    (tmp_path / "r.h").write_text(
        "#define __API_PTSZ(api) api\n"
        "#define getInfo __API_PTSZ(getInfo_v2)\n"
        "#define getProps getProps_v2\n"
        "int getInfo(int a, int b);\nint getProps(int *p);\nint plain(void);\n")
    lib = tool.Library(name="r", module="_r", functions=["getInfo", "getProps", "plain"], headers=["r.h"],
                       include_roots=(lambda: iter([str(tmp_path)]),))
    g = tool.generate(lib)
    assert g.aliases == {"getInfo": "getInfo_v2", "getProps": "getProps_v2"}
    assert g.functions == ["getInfo_v2", "getProps_v2", "plain"]


def test_real_nvml():
    _open_or_skip("nvml")
    got = _run_py("""
        import json, accel._ffi as F
        print(json.dumps({"missing": F.missing_symbols("nvml")}))
    """)
    assert got["missing"] == []


def test_real_nvrtc():
    """The generated NVRTC declarations against the real libnvrtc (the nvidia-cuda-nvrtc
    wheel or the toolkit): every function exported, and the builtins library preloaded
    beside it (the wheel's lib/ is on no loader path; without it the first compile fails
    with NVRTC_ERROR_BUILTIN_OPERATION_FAILURE)."""
    _open_or_skip("nvrtc")
    got = _run_py("""
        import json, accel._ffi as F
        ffi, lib, path = F.open_library("nvrtc")
        major, minor = ffi.new("int *"), ffi.new("int *")
        rc = lib.nvrtcVersion(major, minor)
        maps = open("/proc/self/maps").read()
        print(json.dumps({"missing": F.missing_symbols("nvrtc"), "rc": rc, "v": [major[0], minor[0]],
                          "builtins": "libnvrtc-builtins" in maps, "path": path,
                          "err6": ffi.string(lib.nvrtcGetErrorString(6)).decode()}))
    """)
    assert got["missing"] == [], got["path"]
    assert got["rc"] == 0 and got["v"][0] >= 12
    assert got["err6"] == "NVRTC_ERROR_COMPILATION"
    assert got["builtins"], "libnvrtc-builtins was not loaded beside %s" % got["path"]


def test_real_ze_loader():
    _open_or_skip("ze")
    got = _run_py("""
        import json, accel._ffi as F
        from accel._ffi import _ze
        ffi, lib, path = F.open_library("ze")
        missing = F.missing_symbols("ze")
        print(json.dumps({"rc": lib.zeInit(0) & 0xFFFFFFFF, "missing": missing,
                          "optional": sorted(_ze.OPTIONAL_SYMBOLS), "path": path,
                          "uninit": lib.ZE_RESULT_ERROR_UNINITIALIZED & 0xFFFFFFFF}))
    """)
    # Only optional symbols may be missing (old loaders).
    assert set(got["missing"]) <= set(got["optional"]), got
    if "libze_loader.so.1.8" in got["path"]:
        # Debian's loader 1.8.12 lacks every optional entry point (zesInit/zesDriverGet/
        # zesDeviceGet, zeInitDrivers, zeCommandListHostSynchronize).
        assert sorted(got["missing"]) == got["optional"]
    # No Level Zero driver on the test machines: ZE_RESULT_ERROR_UNINITIALIZED.
    assert got["uninit"] == 0x78000001
    assert got["rc"] in (0, 0x78000001)


# -- the generator on a small synthetic header (needs only a preprocessor) ------

SYNTH_H = """\
#include <stdint.h>
#include <stddef.h>
#define API_CALL __attribute__((visibility("default")))
#define FOO_BUF 2*8
#define FOO_FLAG_A (1u << 3)
#define fooOpen fooOpen_v2
typedef enum foo_err { FOO_OK = 0, FOO_BAD = 0x78000001, FOO_NEXT } foo_err_t;
enum foo_kind { FOO_K0 = FOO_OK, FOO_K1 = FOO_BAD & 0xff };
typedef struct foo_handle_st *foo_handle_t;
struct foo_inner { uint8_t b[FOO_BUF]; };
typedef struct foo_props { struct foo_inner inner; uint32_t n; uint64_t big; unsigned f : 3; } foo_props_t;
typedef struct { int unused; } foo_unused_t;
API_CALL foo_err_t fooOpen_v2(foo_handle_t *h, enum foo_kind k);
API_CALL foo_err_t fooProps(foo_handle_t h, foo_props_t *p, size_t n);
foo_err_t fooNotListed(foo_unused_t *u);
"""


def test_generator_on_synthetic_header(tool, tmp_path):
    if tool.find_compiler() is None:
        pytest.skip("no C preprocessor on PATH")
    (tmp_path / "foo.h").write_text(SYNTH_H)
    lib = tool.Library(name="foo", module="_foo", functions=["fooOpen", "fooProps", "fooMissing"],
                       defines=["FOO_BUF", "FOO_FLAG_A", "FOO_NOPE"], headers=["foo.h"],
                       include_roots=(lambda: iter([str(tmp_path)]),))
    g = tool.generate(lib)
    assert g.aliases == {"fooOpen": "fooOpen_v2"}
    assert g.functions == ["fooOpen_v2", "fooProps"]
    assert g.dropped == ["fooMissing", "#define FOO_NOPE"]
    assert "fooNotListed" not in g.cdef and "foo_unused_t" not in g.cdef
    assert "FOO_NEXT = 2013265922" in g.cdef and "FOO_K1 = 1" in g.cdef
    assert "uint8_t b[16];" in g.cdef
    assert "#define FOO_BUF 16\n#define FOO_FLAG_A 8\n" in g.cdef
    assert g.structs == ["struct foo_inner", "struct foo_props"]
    text = tool.render(g)
    assert str(tmp_path) not in text
    ns = {}
    exec(compile(text.replace("accel._ffi._foo", "_foo"), "_foo.py", "exec"), ns)
    ffi = ns["ffi"]
    assert ffi.sizeof("foo_props_t") == 40 and ffi.offsetof("foo_props_t", "big") == 24
    assert ns["ALIASES"] == {"fooOpen": "fooOpen_v2"} and ns["FUNCTIONS"] == ("fooOpen_v2", "fooProps")
    assert tool.render(tool.generate(lib)) == text


def test_cuda_module_is_the_same_from_a_root_without_crt(tool, tmp_path):
    """The pip wheels ship the runtime headers without crt/ (nvcc's): generating from such a
    root (the generator's crt/host_defines.h stand-in) gives the committed module byte for byte."""
    lib = tool.LIBRARIES["cudart"]
    root = _need_headers(tool, "cudart")
    if not os.path.isfile(os.path.join(root, "crt", "host_defines.h")):
        pytest.skip("the CUDA 13 include root has no crt/ already")
    for f in os.listdir(root):
        if f.endswith(".h"):
            shutil.copy(os.path.join(root, f), tmp_path / f)
    bare = tool.Library(**{**lib.__dict__, "include_roots": (lambda: iter([str(tmp_path)]),)})
    with open(os.path.join(REPO, "accel", "_ffi", "_cudart.py")) as f:
        assert tool.render(tool.generate(bare)) == f.read()
