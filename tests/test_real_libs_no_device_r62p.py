"""r62p: the whole public API with a *real* vendor library and no usable device (no ACCEL_SIM).

This machine kind has the real CUDA 13 runtime (/usr/local/cuda, the nvidia-cuda-runtime
wheel), the CUDA 12.4 wheel (nvidia-cuda-runtime-cu12), Debian's Level Zero loader 1.8.12
without a GPU driver, NVRTC 13.0 and no NVIDIA driver (cudaGetDeviceCount: 35,
cudaErrorInsufficientDriver; zeInit: ZE_RESULT_ERROR_UNINITIALIZED).  Each library is
selected in turn (ACCEL_CUDART_PATH / ACCEL_BACKEND) and a fresh interpreter (vendor
libraries are opened once per process; a crash there fails the test instead of the run)
sweeps every public name:

* queries that need no device answer (is_available False, device_count 0,
  current_accelerator as documented, allocator statistics empty, seeding queued);
* every call that needs a device raises AcceleratorError naming the library, the call,
  the vendor error's name and code, and the fix, and a second call gives the same error
  (no wedge, no partial state: still not initialized);
* the process can fork afterwards and the child answers its queries, NVRTC compiles;
* several threads hitting the failing init at once all get the same error, none hangs;
* ``python -m accel`` and ``python -m accel.selftest`` report the reason, exit 0.

Three tests were strict xfails, what this sweep found (r62p; fixed in r62): ACCEL_NVRTC_PATH naming
another library gave cffi's "symbol 'nvrtcVersion' not found"; "no device" refusals did not say
why there is none (now the count's reason: the vendor error and its fix); from_dlpack of a
non-DLPack object or host memory raised the driver's error instead of TypeError/BufferError.  Skipped, saying why, where
a library is absent or a driver is installed."""

import json
import os
import subprocess
import sys

import pytest

from accel._ffi import _site_dirs

pytestmark = pytest.mark.reallib

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TIMEOUT = 180


def _wheel(rel: str):
    for sp in _site_dirs():
        path = os.path.join(sp, rel)
        if os.path.exists(path):
            return path
    return None


def _local_cuda13():
    path = "/usr/local/cuda/lib64/libcudart.so.13"
    return path if os.path.exists(path) else None


def _ze_loader():
    for path in ("/usr/lib/x86_64-linux-gnu/libze_loader.so.1", "/usr/local/lib/libze_loader.so.1"):
        if os.path.exists(path):
            return path
    return None


CUDA13_WHEEL = _wheel(os.path.join("nvidia", "cu13", "lib", "libcudart.so.13"))
CUDA12_WHEEL = _wheel(os.path.join("nvidia", "cuda_runtime", "lib", "libcudart.so.12"))
NVRTC13 = _wheel(os.path.join("nvidia", "cu13", "lib", "libnvrtc.so.13"))

#: name -> (environment, backend, library, call, code, code name, texts the fix must contain)
CONFIGS = {
    "cuda13-toolkit": (lambda: _local_cuda13() and {"ACCEL_CUDART_PATH": "/usr/local/cuda/lib64"},
                       "cuda", "libcudart", "cudaGetDeviceCount", 35, "cudaErrorInsufficientDriver",
                       ("no NVIDIA driver is installed", "R580", "libcudart 13.0")),
    "cuda-default-choice": (lambda: (CUDA13_WHEEL or _local_cuda13()) and {"ACCEL_BACKEND": "cuda"},
                            "cuda", "libcudart", "cudaGetDeviceCount", 35, "cudaErrorInsufficientDriver",
                            ("no NVIDIA driver is installed", "R580", "libcudart 13.0")),
    "cuda13-wheel": (lambda: CUDA13_WHEEL and {"ACCEL_CUDART_PATH": CUDA13_WHEEL, "ACCEL_BACKEND": "cuda"},
                     "cuda", "libcudart", "cudaGetDeviceCount", 35, "cudaErrorInsufficientDriver",
                     ("no NVIDIA driver is installed", "R580", "libcudart 13.0")),
    "cuda12.4-wheel": (lambda: CUDA12_WHEEL and {"ACCEL_CUDART_PATH": CUDA12_WHEEL, "ACCEL_BACKEND": "cuda"},
                       "cuda", "libcudart", "cudaGetDeviceCount", 35, "cudaErrorInsufficientDriver",
                       ("no NVIDIA driver is installed", "R525", "libcudart 12.4")),
    "level-zero": (lambda: _ze_loader() and {"ACCEL_BACKEND": "xpu"},
                   "xpu", "libze_loader", "zeInit", 0x78000001, "ZE_RESULT_ERROR_UNINITIALIZED",
                   ("0x78000001", "intel-level-zero-gpu")),
}


def _no_driver(backend: str) -> None:
    if backend == "cuda" and os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("an NVIDIA driver is installed here; these are the no-driver answers")
    if backend == "xpu":
        from accel.backends import _ze_count
        if _ze_count.probe_gpu_drivers():
            pytest.skip("an Intel Level Zero GPU driver is installed here")


@pytest.fixture(params=sorted(CONFIGS))
def config(request):
    make, backend, *rest = CONFIGS[request.param]
    env = make()
    if not env:
        pytest.skip(f"{request.param}: the library is not installed here")
    _no_driver(backend)
    return (request.param, env, backend, *rest)


def _env(extra: dict) -> dict:
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("ACCEL_", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "ZE_"))}
    full.update(extra)
    full["PYTHONPATH"] = _REPO + (os.pathsep + full["PYTHONPATH"] if full.get("PYTHONPATH") else "")
    return full


def _fresh_python(code: str, env: dict) -> dict:
    """``code`` in a new interpreter with ``env``; its last stdout line as JSON.  A crash (a
    signal: negative return code) or a hang (the timeout) fails the test."""
    try:
        out = subprocess.run([sys.executable, "-c", code], env=_env(env), capture_output=True, text=True,
                             timeout=_TIMEOUT, cwd=_REPO)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung for {_TIMEOUT} s; output so far: {exc.stdout!r:.2000} {exc.stderr!r:.2000}")
    assert out.returncode == 0, f"exit {out.returncode}\nstdout: {out.stdout[-3000:]}\nstderr: {out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- the sweep --------------------------------------------------------------------------------

_SWEEP = r'''
import json, os, signal, threading, warnings
import numpy as np
import accel
from accel import memory as M, random as R, graphs as G
warnings.simplefilter("ignore", FutureWarning)    # current_device_idx & co.

def outcome(fn):
    try:
        value = fn()
        try:
            json.dumps(value)
        except TypeError:
            value = repr(value)
        return {"ok": True, "value": value}
    except BaseException as e:
        return {"ok": False, "type": type(e).__name__, "module": type(e).__module__,
                "runtime_error": isinstance(e, RuntimeError), "accel": isinstance(e, accel.AcceleratorError),
                "msg": str(e), "attrs": [getattr(e, a, None) for a in ("library", "call", "code", "code_name")]}

def twice(fn):
    return [outcome(fn), outcome(fn)]

out = {"queries_before": {}, "device": {}, "queries_after": {}}
queries = {
    "is_available": accel.is_available,
    "device_count": accel.device_count,
    "current_accelerator": lambda: repr(accel.current_accelerator()),
    "current_accelerator_checked": lambda: accel.current_accelerator(check_available=True),
    "is_initialized": accel.is_initialized,
    "memory_allocated": accel.memory_allocated,
    "memory_reserved": accel.memory_reserved,
    "max_memory_allocated": accel.max_memory_allocated,
    "max_memory_reserved": accel.max_memory_reserved,
    "memory_stats": lambda: dict(accel.memory_stats()),
    "host_memory_stats": lambda: dict(M.host_memory_stats()),
    "memory_snapshot": M.memory_snapshot,
    "empty_cache": accel.empty_cache,
    "empty_host_cache": accel.empty_host_cache,
    "reset_peak_memory_stats": accel.reset_peak_memory_stats,
    "reset_accumulated_memory_stats": accel.reset_accumulated_memory_stats,
    "is_current_stream_capturing": accel.is_current_stream_capturing,
    "manual_seed": lambda: R.manual_seed(1),
    "manual_seed_all": lambda: R.manual_seed_all(2),
    "get_rng_state_all": R.get_rng_state_all,
    "synchronize(0)": lambda: accel.synchronize(0),
    "memory_summary_is_text": lambda: isinstance(M.memory_summary(), str),
    "Event()": lambda: type(accel.Event()).__name__,
    "Graph()": lambda: type(accel.Graph()).__name__,
    "graph_pool_handle": lambda: list(G.graph_pool_handle()),
    "compile": lambda: sorted(accel.compile('extern "C" __global__ void k(int *p) { p[0] = 1; }').entries),
}
for name, fn in queries.items():
    out["queries_before"][name] = outcome(fn)

PTX = accel.compile('extern "C" __global__ void k(int *p) { p[0] = 1; }').ptx
device_calls = {
    "current_device_index": accel.current_device_index,
    "current_device_idx": accel.current_device_idx,
    "set_device_index(0)": lambda: accel.set_device_index(0),
    "device_index(0)": lambda: accel.device_index(0).__enter__(),
    "get_device_properties(0)": lambda: accel.get_device_properties(0),
    "get_device_properties()": lambda: accel.get_device_properties(),
    "get_device_capability(0)": lambda: accel.get_device_capability(0),
    "can_device_access_peer(0, 0)": lambda: accel.can_device_access_peer(0, 0),
    "current_stream": accel.current_stream,
    "default_stream": accel.default_stream,
    "Stream()": lambda: accel.Stream(),
    "Stream(0, priority=-1)": lambda: accel.Stream(0, priority=-1),
    "ExternalStream": lambda: accel.ExternalStream(1234),
    "get_stream_from_external": lambda: accel.get_stream_from_external(1234),
    "Event().record()": lambda: accel.Event().record(),
    "Buffer(16)": lambda: accel.Buffer(16),
    "Buffer(16, 0)": lambda: accel.Buffer(16, 0),
    "empty_pinned": lambda: accel.empty_pinned(16),
    "MemPool": lambda: accel.MemPool(),
    "get_memory_info": accel.get_memory_info,
    "set_per_process_memory_fraction": lambda: M.set_per_process_memory_fraction(0.5),
    "get_per_process_memory_fraction": M.get_per_process_memory_fraction,
    "device_allocator(0)": lambda: M.device_allocator(0),
    "Graph.capture_begin": lambda: accel.Graph().capture_begin(),
    "graph(Graph())": lambda: accel.graph(accel.Graph()).__enter__(),
    "Module(ptx)": lambda: accel.Module(PTX),
}
for name, fn in device_calls.items():
    out["device"][name] = twice(fn)
out["synchronize()"] = twice(accel.synchronize)

for name, fn in queries.items():
    out["queries_after"][name] = outcome(fn)

# several threads hit the failing init at once
errors = []
def worker():
    try:
        accel.Buffer(16)
        errors.append("no error")
    except BaseException as e:
        errors.append(f"{type(e).__name__}: {e}")
threads = [threading.Thread(target=worker) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join(60)
out["threads"] = {"alive": sum(t.is_alive() for t in threads), "errors": sorted(set(errors)), "n": len(errors)}

# the process can fork afterwards: the child answers queries and compiles
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    signal.alarm(60)
    res = {"is_available": outcome(accel.is_available), "device_count": outcome(accel.device_count),
           "compile": outcome(lambda: sorted(accel.compile('extern "C" __global__ void j() {}').entries)),
           "Buffer": outcome(lambda: accel.Buffer(16))}
    os.write(w, json.dumps(res).encode())
    os._exit(0)
os.close(w)
data = b""
while True:
    chunk = os.read(r, 65536)
    if not chunk:
        break
    data += chunk
_, status = os.waitpid(pid, 0)
out["fork"] = {"status": os.waitstatus_to_exitcode(status), "child": json.loads(data or b"{}")}
print(json.dumps(out, default=repr))
'''


@pytest.fixture(scope="module")
def _sweeps():
    return {}


def _sweep(config, cache):
    name, env = config[0], config[1]
    if name not in cache:
        cache[name] = _fresh_python(_SWEEP, env)
    return cache[name]


def _clean(got, config, what):
    """``got`` is the AcceleratorError naming the library, the call, the vendor error and the fix."""
    _name, _env_, _backend, library, call, code, code_name, fixes = config
    assert not got["ok"], f"{what}: no error without a device: {got}"
    assert got["accel"] and got["module"].startswith("accel"), f"{what}: {got['module']}.{got['type']}: {got['msg']}"
    assert got["attrs"] == [library, call, code, code_name], (what, got["attrs"], got["msg"])
    msg = got["msg"]
    assert library in msg and call in msg and code_name in msg, (what, msg)
    assert str(code) in msg or hex(code) in msg, (what, msg)
    for fix in fixes:
        assert fix in msg, (what, fix, msg)


_EXPECTED_QUERIES = {"is_available": False, "device_count": 0, "current_accelerator_checked": None,
                     "is_initialized": False, "memory_allocated": 0, "memory_reserved": 0,
                     "max_memory_allocated": 0, "max_memory_reserved": 0, "memory_stats": {},
                     "host_memory_stats": {}, "memory_snapshot": [], "empty_cache": None,
                     "empty_host_cache": None, "reset_peak_memory_stats": None,
                     "reset_accumulated_memory_stats": None, "is_current_stream_capturing": False,
                     "manual_seed": None, "manual_seed_all": None, "get_rng_state_all": [],
                     "synchronize(0)": None, "memory_summary_is_text": True, "Event()": "Event",
                     "Graph()": "Graph", "compile": ["k"]}


@pytest.mark.parametrize("when", ["queries_before", "queries_after"])
def test_queries_answer_before_and_after_failed_device_calls(config, _sweeps, when):
    got = _sweep(config, _sweeps)[when]
    backend = config[2]
    bad = {k: v for k, v in got.items() if not v["ok"]}
    assert not bad, bad
    values = {k: v["value"] for k, v in got.items()}
    assert values["current_accelerator"] == f"device(type='{backend}')"
    assert {k: values[k] for k in _EXPECTED_QUERIES} == _EXPECTED_QUERIES
    assert len(values["graph_pool_handle"]) == 2


def test_every_device_call_names_library_call_error_and_fix_twice(config, _sweeps):
    got = _sweep(config, _sweeps)["device"]
    for name, (first, second) in got.items():
        _clean(first, config, name)
        assert second == first, f"{name}: the second call differs: {first} then {second}"


def test_synchronize_without_a_device_is_torchs_runtime_error(config, _sweeps):
    first, second = _sweep(config, _sweeps)["synchronize()"]
    # documented: "synchronize() with no device available a RuntimeError" (torch's words)
    assert not first["ok"] and first["runtime_error"] and "none is available" in first["msg"], first
    assert second == first


def test_concurrent_first_use_all_get_the_same_error(config, _sweeps):
    t = _sweep(config, _sweeps)["threads"]
    assert t["alive"] == 0 and t["n"] == 8
    assert len(t["errors"]) == 1 and t["errors"][0].startswith("AcceleratorError: "), t
    assert config[6] in t["errors"][0]


def test_fork_after_the_failed_init(config, _sweeps):
    f = _sweep(config, _sweeps)["fork"]
    assert f["status"] == 0, f
    child = f["child"]
    assert child["is_available"] == {"ok": True, "value": False}
    assert child["device_count"] == {"ok": True, "value": 0}
    assert child["compile"] == {"ok": True, "value": ["j"]}, child["compile"]     # NVRTC needs no driver
    use = child["Buffer"]
    assert not use["ok"] and use["runtime_error"], use
    if config[2] == "cuda":
        # as torch: the failed init ran cudaGetDeviceCount, which poisons fork (THCPModule_initExtension
        # calls poison_fork() before lazyInitDevice), so the child gets torch's bad-fork message
        assert "Cannot re-initialize CUDA in forked subprocess" in use["msg"] or config[6] in use["msg"], use
    else:
        # zeInit failed: nothing started, the child gets the same clean error
        _clean(use, config, "Buffer in the forked child")


def test_python_m_accel_and_selftest_report_the_reason(config):
    name, env, backend = config[0], config[1], config[2]
    for args, timeout in ((["-m", "accel", "--json", "--no-smoke"], _TIMEOUT), (["-m", "accel.selftest"], 300)):
        try:
            out = subprocess.run([sys.executable, *args], env=_env(env), capture_output=True, text=True,
                                 timeout=timeout, cwd=_REPO)
        except subprocess.TimeoutExpired:
            pytest.fail(f"python {' '.join(args)} hung")
        text = out.stdout + out.stderr
        assert out.returncode == 0 and "Traceback" not in text, (args, text[-3000:])
        if args[1] == "accel":
            report = json.loads(out.stdout)
            rep = report["backends"][backend]
            assert rep["count"] == 0 and rep["reason"], rep
            assert report["nvrtc"].get("version") or "error" not in report["nvrtc"], report["nvrtc"]
        else:
            assert "skipped: no accelerator device" in text and f"{backend}:" in text, text[-2000:]


def test_nvrtc_compiles_to_cubin_without_any_driver():
    if NVRTC13 is None:
        pytest.skip("the nvidia-cuda-nvrtc wheel is not installed")
    _no_driver("cuda")
    got = _fresh_python(r'''
import json, accel
p = accel.compile('extern "C" __global__ void k(int *p) { p[0] = 1; }', arch="sm_90")
q = accel.compile('extern "C" __global__ void k(int *p) { p[0] = 1; }', arch=(8, 0))
try:
    accel.compile("junk")
    err = None
except accel.CompileError as e:
    err = str(e)
ptx = q.ptx.decode() if isinstance(q.ptx, bytes) else q.ptx
print(json.dumps({"cubin": len(p.cubin or b""), "arch": q.arch, "ptx": ".target sm_80" in ptx, "err": err,
                  "initialized": accel.is_initialized()}))
''', {"ACCEL_CUDART_PATH": CUDA13_WHEEL or "/usr/local/cuda/lib64"})
    assert got["cubin"] > 0 and got["arch"] == "compute_80" and got["ptx"], got
    assert got["err"] and "NVRTC_ERROR_COMPILATION" in got["err"], got
    assert got["initialized"] is False


# -- what the sweep found ---------------------------------------------------------------------

_NVRTC_WRONG = r'''
import json, accel
out = {}
for k in (1, 2):
    try:
        accel.compile('extern "C" __global__ void k() {}')
        out[k] = None
    except BaseException as e:
        out[k] = [type(e).__module__, type(e).__name__, isinstance(e, RuntimeError), str(e)]
print(json.dumps(out))
'''


def test_accel_nvrtc_path_naming_another_library_is_refused_by_name():
    if CUDA13_WHEEL is None:
        pytest.skip("the nvidia-cuda-runtime wheel is not installed")
    got = _fresh_python(_NVRTC_WRONG, {"ACCEL_NVRTC_PATH": CUDA13_WHEEL})
    for k in ("1", "2"):
        module, name, is_runtime, msg = got[k]
        # before: ['ffi', 'error', False, "symbol 'nvrtcVersion' not found in library '.../libcudart.so.13': ..."]
        assert module.startswith("accel") and is_runtime, got[k]
        assert CUDA13_WHEEL in msg and "ACCEL_NVRTC_PATH" in msg and "nvrtcVersion" in msg, msg
    assert got["1"] == got["2"]


_INVALID_DEVICE = r'''
import json, accel
from accel import backends
out = {"reason": backends.get(%r).report()["reason"]}
for name, fn in {"temperature": lambda: accel.temperature(0),
                 "device_memory_used": lambda: accel.device_memory_used(0),
                 "list_gpu_processes": lambda: accel.list_gpu_processes(0),
                 "initial_seed": accel.random.initial_seed,
                 "get_rng_state": accel.random.get_rng_state,
                 "default_generator": lambda: accel.random.default_generator(0)}.items():
    try:
        fn()
        out[name] = None
    except BaseException as e:
        out[name] = [type(e).__name__, str(e)]
print(json.dumps(out))
'''


def test_no_device_index_errors_say_why_there_is_no_device(config):
    name, env, backend = config[0], config[1], config[2]
    got = _fresh_python(_INVALID_DEVICE % backend, env)
    reason = got.pop("reason")
    assert reason
    key = "cudaErrorInsufficientDriver (35)" if backend == "cuda" else "libze_intel_gpu.so.1"
    assert key in reason
    for call, err in got.items():
        assert err is not None and err[0] == "InvalidDeviceError", (call, err)
        # before: "device index 0 is invalid: no cuda device is available"
        assert key in err[1], (call, err[1])


_DLPACK = r'''
import json, numpy as np, accel
out = {}
for name, obj in {"int": 42, "numpy": np.zeros(4, np.float32)}.items():
    try:
        accel.from_dlpack(obj)
        out[name] = None
    except BaseException as e:
        out[name] = [type(e).__name__, str(e)]
print(json.dumps(out))
'''


def test_from_dlpack_refuses_non_device_objects_without_a_device(config):
    got = _fresh_python(_DLPACK, config[1])
    # before: ['AcceleratorError', 'libcudart: cudaGetDeviceCount failed with cudaErrorInsufficientDriver (35): ...']
    assert got["int"] is not None and got["int"][0] == "TypeError", got["int"]
    assert got["numpy"] is not None and got["numpy"][0] == "BufferError" and "kDLCPU" in got["numpy"][1], got
