#!/usr/bin/env python3
"""Every accel benchmark side by side with its baseline, measured in the same run.

    python tools/bench.py                  # full run (about a minute on 2 cores)
    python tools/bench.py --quick          # small sizes, under 30 s
    python tools/bench.py --json           # machine-readable results on stdout
    python tools/bench.py --only percall,graphs

Prints one table: name | accel | baseline | ratio | target | ok.  Groups:

``import``        ``import accel; is_available(); device_count()`` vs ``python -c pass``
                  (real libraries, and again under ACCEL_SIM=cuda), added ms; also against
                  ``import numpy`` and, where installed, ``import torch`` + the same queries.
``percall``       ``current_stream()``, ``Event.record()`` (on a created stream and on the
                  current one), ``Stream.query()``, ``Buffer(256).fill_(1)`` under
                  ACCEL_SIM=cuda vs the bare call of the same simulated function;
                  ``accel.Buffer(1 MiB).close()`` vs the device caching allocator's own
                  ``malloc``+``free`` pair it wraps; each row notes its spread over rounds.
``percall_real``  the real libcudart (no driver needed): accel's checked call vs the bare
                  cffi call; ctypes, ``cuda.bindings`` and ``pynvml`` where installed.
``alloc``         allocator trace replay (../shared/traces) and cached 1 MiB alloc+free vs
                  the bare simulated cudaMalloc+cudaFree pair (accel.memory._bench).
``rng``           host Philox GB/s vs numpy's C Philox (accel.random._bench).
``graphs``        replaying 100 captured fills vs issuing them eagerly (ACCEL_SIM=cuda).
``kernels``       ``accel.launch`` of a user kernel vs the bare cffi ``cudaLaunchKernel`` with
                  prebuilt arguments, and a graph of 100 launches replayed vs issued eagerly
                  (ACCEL_SIM=cuda).

Each group runs in its own subprocess with its own environment, so one
group's process state (simulator threads, caches) cannot skew another's.
Within a group, accel and its baseline are timed in interleaved rounds
(``time.perf_counter_ns``) and the best round of each is kept, so machine
noise hits both alike (start-up rows also report the median difference).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

#: Environment variables that change what accel does; removed before every run.
_ACCEL_ENV_PREFIXES = ("ACCEL_",)


# -- result rows ------------------------------------------------------------------------
def row(name: str, accel: Optional[float], baseline: Optional[float], unit: str, *,
        baseline_name: str = "", target: str = "", ok: Optional[bool] = None,
        ratio: Optional[float] = None, note: str = "", **extra) -> dict:
    """One table row.  ``ratio`` defaults to accel / baseline; ``ok`` is None without a target."""
    if ratio is None and accel is not None and baseline:
        ratio = accel / baseline
    out = {"name": name, "accel": accel, "baseline": baseline, "unit": unit,
           "baseline_name": baseline_name, "ratio": ratio, "target": target, "ok": ok, "note": note}
    out.update(extra)
    return out


def error_row(name: str, message: str) -> dict:
    return row(name, None, None, "", note=message, ok=False, error=message)


from _progress import Progress  # noqa: E402  (tools/ is on sys.path when run as a script)


def _report(text: str) -> None:
    """From a worker: tell the parent's progress display what is running now."""
    sys.stderr.write(f"@progress {text}\n")
    sys.stderr.flush()


# -- group: import time (runs in the orchestrator; every sample is a fresh interpreter) ------
_IMPORT_CMDS = {
    "pass": "pass",
    "accel": "import accel; accel.is_available(); accel.device_count()",
    "numpy": "import numpy",
    "torch": "import torch; torch.cuda.is_available(); torch.cuda.device_count()",
}


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_ACCEL_ENV_PREFIXES)}
    env.update(extra)
    return env


def _run_ms(code: str, env: dict) -> float:
    t0 = time.perf_counter_ns()
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
    elapsed = (time.perf_counter_ns() - t0) / 1e6
    if proc.returncode != 0:
        raise RuntimeError(f"`python -c {code!r}` failed: {proc.stderr.decode(errors='replace')[-500:]}")
    return elapsed


def _have(module: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def group_import(quick: bool, progress: Callable[[str], None]) -> List[dict]:
    import tempfile
    with tempfile.TemporaryDirectory(prefix="accel-bench-pyc-") as pyc:
        return _group_import(quick, progress, pyc)


def _group_import(quick: bool, progress: Callable[[str], None], pyc: str) -> List[dict]:
    rounds = 5 if quick else 20
    # Bytecode is cached (in a private folder) as it is for an installed package:
    # with PYTHONDONTWRITEBYTECODE every run would recompile accel's sources.
    real = _clean_env(PYTHONPYCACHEPREFIX=pyc)
    real.pop("PYTHONDONTWRITEBYTECODE", None)
    sim = dict(real, ACCEL_SIM="cuda")
    cases = {"pass": ("pass", real), "accel": ("accel", real), "accel_sim": ("accel", sim),
             "numpy": ("numpy", real)}
    samples: Dict[str, List[float]] = {k: [] for k in cases}
    for key, (cmd, env) in cases.items():   # warm-up: page cache and __pycache__
        _run_ms(_IMPORT_CMDS[cmd], env)
    for r in range(rounds):
        progress(f"round {r + 1}/{rounds}")
        for key, (cmd, env) in cases.items():
            samples[key].append(_run_ms(_IMPORT_CMDS[cmd], env))
    # Start-up samples are skewed upwards by whatever else the machine runs, so the
    # best run of each command is compared; the median of the per-round differences
    # is kept alongside.
    best = {k: min(v) for k, v in samples.items()}
    added = {k: best[k] - best["pass"] for k in samples}
    added_med = {k: statistics.median(a - b for a, b in zip(samples[k], samples["pass"])) for k in samples}
    target = "added < 25 ms"
    rows = [
        row("import+query (real libs)", best["accel"], best["pass"], "ms", baseline_name="python -c pass",
            target=target, ok=added["accel"] < 25, added_ms=added["accel"], added_ms_median=added_med["accel"],
            note=f"+{added['accel']:.1f} ms (median of rounds +{added_med['accel']:.1f})",
            samples=samples["accel"], baseline_samples=samples["pass"]),
        row("import+query (ACCEL_SIM=cuda)", best["accel_sim"], best["pass"], "ms",
            baseline_name="python -c pass", target=target, ok=added["accel_sim"] < 25,
            added_ms=added["accel_sim"], added_ms_median=added_med["accel_sim"],
            note=f"+{added['accel_sim']:.1f} ms (median of rounds +{added_med['accel_sim']:.1f})"),
        row("import+query vs import numpy", added["accel"], added["numpy"], "ms added",
            baseline_name="python -c 'import numpy'", note="for scale: time added to the interpreter"),
    ]
    if _have("torch"):
        torch_rounds = 1 if quick else 3
        torch_s: List[float] = []
        accel_s: List[float] = []
        _run_ms(_IMPORT_CMDS["torch"], real)
        for r in range(torch_rounds):
            progress(f"torch round {r + 1}/{torch_rounds}")
            accel_s.append(_run_ms(_IMPORT_CMDS["accel"], real))
            torch_s.append(_run_ms(_IMPORT_CMDS["torch"], real))
        rows.append(row("import+query vs torch", min(accel_s), min(torch_s), "ms",
                        baseline_name="import torch; torch.cuda.is_available(); device_count()",
                        note="lower ratio is better"))
    else:
        rows.append(row("import+query vs torch", None, None, "ms", baseline_name="torch",
                        note="torch not installed (pip install torch to compare)", skipped=True))
    return rows


# -- group: per-call overhead on the simulator ------------------------------------------------
def rounds_ns(stmts: Dict[str, str], ns: dict, *, rounds: int, batch_s: float,
              between: Optional[Callable[[], None]] = None) -> Dict[str, List[float]]:
    """ns per execution of each statement in each of ``rounds`` interleaved rounds (one
    ``interleaved_ns`` round each), so a row can give its best round and the spread."""
    from accel._selftest_bench import interleaved_ns
    out: Dict[str, List[float]] = {k: [] for k in stmts}
    for _ in range(rounds):
        for key, value in interleaved_ns(stmts, ns, rounds=1, batch_s=batch_s, between=between).items():
            out[key].append(value)
    return out


def spread_note(samples: List[float]) -> str:
    """How far the median round lies above the best one (the row reports the best)."""
    best = min(samples)
    return f"best of {len(samples)} rounds, median +{(statistics.median(samples) - best) / best:.0%}"


def group_percall(quick: bool, progress: Callable[[str], None]) -> List[dict]:
    import accel
    accel.current_stream()                      # initializes the backend
    be = accel.backends.get("cuda")
    lib, ffi = be.lib, be.ffi
    s = accel.Stream()
    e = accel.Event()
    e.record(s)
    ed = accel.Event()                          # recorded on the current (default) stream
    ed.record()
    s.synchronize()
    cur = accel.current_stream()
    alloc = accel.memory.device_allocator(cur.device_index)
    alloc.free(alloc.malloc(1 << 20, cur.handle))    # a cached 1 MiB block
    small = accel.Buffer(256)                   # on the current stream, as selftest's bench_peers
    ns = {"accel": accel, "s": s, "e": e, "ed": ed, "small": small, "lib": lib,
          "sc": ffi.cast("cudaStream_t", s.handle), "ec": ffi.cast("cudaEvent_t", e.handle),
          "cc": ffi.cast("cudaStream_t", cur.handle), "edc": ffi.cast("cudaEvent_t", ed.handle),
          "sp": ffi.cast("void *", small.ptr), "p": ffi.new("int *"), "alloc": alloc, "h": cur.handle}
    # (name, accel's statement, baseline statement, baseline name, target ratio)
    cases = [
        ("current_stream()", "accel.current_stream()", "lib.cudaGetDevice(p)", "bare sim cudaGetDevice", 2.0),
        ("Event.record()", "e.record(s)", "lib.cudaEventRecord(ec, sc)", "bare sim cudaEventRecord", 2.0),
        # selftest bench_peers' statement: the current stream, the device's default stream here
        ("Event.record() on the current stream", "ed.record()", "lib.cudaEventRecord(edc, cc)",
         "bare sim cudaEventRecord, default stream", 2.0),
        ("Stream.query()", "s.query()", "lib.cudaStreamQuery(sc)", "bare sim cudaStreamQuery", 2.0),
        # Buffer = the allocator pair + the current device (one cudaGetDevice) and its current
        # stream, a Python object, an atomic close: 4.4x before r25, about 2x since; 2.5x leaves
        # room for noise while a regression to the old wrapper cost still fails.
        ("Buffer(1 MiB).close()", "accel.Buffer(1048576).close()", "alloc.free(alloc.malloc(1048576, h))",
         "DeviceCachingAllocator malloc+free", 2.5),
        # selftest bench_peers' fill_small: 256 bytes on the current stream
        ("Buffer(256).fill_(1)", "small.fill_(1)", "lib.cudaMemsetAsync(sp, 1, 256, cc)",
         "bare sim cudaMemsetAsync, default stream", 2.0),
    ]
    stmts = {}
    for name, ours, bare, _, _ in cases:
        stmts[name] = ours
        stmts[name + "/bare"] = bare
    rounds = 3 if quick else 9
    progress(f"timing {len(cases)} calls vs their bare baselines, {rounds} rounds")
    got = rounds_ns(stmts, ns, rounds=rounds, batch_s=0.005 if quick else 0.02, between=accel.synchronize)
    rows = []
    for name, ours, bare, base, limit in cases:
        a, b = min(got[name]), min(got[name + "/bare"])
        rows.append(row(f"sim {name}", a, b, "ns/call", baseline_name=base, target=f"<= {limit:g}x",
                        ok=a / b <= limit, stmt=ours, baseline_stmt=bare, samples=got[name],
                        baseline_samples=got[name + "/bare"],
                        note=f"{spread_note(got[name])} (baseline +"
                             f"{spread_note(got[name + '/bare']).rsplit('+', 1)[1]})"))
    small.close()
    return rows


# -- group: per-call overhead on the real libcudart --------------------------------------------
def group_percall_real(quick: bool, progress: Callable[[str], None]) -> List[dict]:
    import accel
    from accel._selftest_bench import interleaved_ns
    from accel._errors import AcceleratorError
    be = accel.backends.get("cuda")
    try:
        ffi, lib, path = be._runtime()
    except AcceleratorError as exc:
        return [row("real cudaRuntimeGetVersion", None, None, "ns/call", note=f"skipped: {exc}", skipped=True)]

    def runtime_version():
        # The idiom of every CudaBackend method: out-pointer, call, _check.
        p = ffi.new("int *")
        be._check(lib.cudaRuntimeGetVersion(p), "cudaRuntimeGetVersion")
        return p[0]

    def device_count_call():
        # Same idiom for a call that fails without a driver (cudaErrorInsufficientDriver):
        # the value a wrapper returns instead of raising, as CudaBackend._discover.
        p = ffi.new("int *")
        rc = lib.cudaGetDeviceCount(p)
        return p[0] if rc == 0 else 0

    ns = {"accel": accel, "lib": lib, "p": ffi.new("int *"),
          "runtime_version": getattr(be, "runtime_version", runtime_version),
          "device_count_call": device_count_call}
    stmts = {
        "rtv": "runtime_version()", "rtv/bare": "lib.cudaRuntimeGetVersion(p)",
        "dc": "device_count_call()", "dc/bare": "lib.cudaGetDeviceCount(p)",
        "api_dc": "accel.device_count()",
    }
    peers = {}
    # ctypes (standard library): the usual hand-written binding
    try:
        import ctypes
        cdll = ctypes.CDLL(path)
        cint = ctypes.c_int()
        ns.update(ct_dc=cdll.cudaGetDeviceCount, ct_rtv=cdll.cudaRuntimeGetVersion,
                  ct_ref=ctypes.byref(cint))
        stmts.update({"ctypes:dc": "ct_dc(ct_ref)", "ctypes:rtv": "ct_rtv(ct_ref)"})
        peers["ctypes"] = ""
    except OSError as exc:
        peers["ctypes"] = f"ctypes could not load {path}: {exc}"
    if _have("cuda.bindings"):
        try:
            from cuda.bindings import runtime as cb
            ns["cb"] = cb
            stmts.update({"cuda.bindings:dc": "cb.cudaGetDeviceCount()",
                          "cuda.bindings:rtv": "cb.cudaRuntimeGetVersion()"})
            peers["cuda.bindings"] = ""
        except Exception as exc:  # an installed but broken peer is reported, not fatal
            peers["cuda.bindings"] = f"import failed: {exc!r}"
    else:
        peers["cuda.bindings"] = "not installed (pip install cuda-bindings to compare)"
    if _have("pynvml"):
        try:
            import pynvml
            pynvml.nvmlInit()
            ns["pynvml"] = pynvml
            stmts["pynvml:count"] = "pynvml.nvmlDeviceGetCount()"
            nvml = be._nvml_lib()
            if nvml is not None:
                ns["nvml_lib"], ns["nvml_p"] = nvml[1], nvml[0].new("unsigned int *")
                stmts["pynvml:count/bare"] = "nvml_lib.nvmlDeviceGetCount_v2(nvml_p)"
            peers["pynvml"] = ""
        except Exception as exc:
            peers["pynvml"] = f"nvmlInit failed: {exc!r}"
    else:
        peers["pynvml"] = "not installed"
    progress(f"timing {len(stmts)} calls on {os.path.basename(path)}")
    best = interleaved_ns(stmts, ns, rounds=3 if quick else 9, batch_s=0.005 if quick else 0.02)
    lib_note = f"real {os.path.basename(path)}"
    rows = [
        row("real cudaRuntimeGetVersion (checked call)", best["rtv"], best["rtv/bare"], "ns/call",
            baseline_name="bare cffi call", note=f"{lib_note}; ffi.new + call + _check, as CudaBackend"),
        row("real cudaGetDeviceCount (wrapped call)", best["dc"], best["dc/bare"], "ns/call",
            baseline_name="bare cffi call", note=f"{lib_note}; returns 35 without a driver"),
        row("real device_count() (cached NVML count)", best["api_dc"], best["dc/bare"], "ns/call",
            baseline_name="bare cffi cudaGetDeviceCount", note="public API; counted once, fork-safe"),
    ]
    for peer, why in peers.items():
        if why:
            rows.append(row(f"real cudaGetDeviceCount vs {peer}", None, None, "ns/call", baseline_name=peer,
                            note=why, skipped=True))
            continue
        if peer == "pynvml":
            if "pynvml:count/bare" in best:
                rows.append(row("real nvmlDeviceGetCount vs pynvml", best["pynvml:count/bare"],
                                best["pynvml:count"], "ns/call", baseline_name="pynvml",
                                note="accel's bare cffi NVML call"))
            continue
        for key, fn in (("dc", "cudaGetDeviceCount"), ("rtv", "cudaRuntimeGetVersion")):
            rows.append(row(f"real {fn} vs {peer}", best[f"{key}/bare"], best[f"{peer}:{key}"], "ns/call",
                            baseline_name=peer, note="accel's bare cffi ABI call vs the peer binding"))
    return rows


# -- group: allocator --------------------------------------------------------------------------
def group_alloc(quick: bool, progress: Callable[[str], None]) -> List[dict]:
    from accel.memory import _bench, _config
    traces = _bench.default_traces()
    progress(f"replaying {len(traces)} traces, timing cached 1 MiB alloc+free")
    res = {"traces": {}, "alloc_free_1mib": _bench.alloc_free_cost(_bench.MiB, 2000 if quick else 20000,
                                                                   3 if quick else 7)}
    for path in traces:
        trace = _bench.load_trace(path)
        by_policy: Dict[str, dict] = {}
        for r in range(1 if quick else 5):      # interleaved rounds; the fastest replay of each policy
            for policy in ("accel", "torch"):
                got = _bench.replay(trace, _config.AllocConfig(policy=policy))
                if policy not in by_policy or got["us_per_op"] < by_policy[policy]["us_per_op"]:
                    by_policy[policy] = got
        res["traces"][trace.get("name", os.path.basename(path))] = by_policy
    rows = []
    for name, by_policy in res["traces"].items():
        ours, theirs = by_policy["accel"], by_policy.get("torch")
        base = theirs or {}
        rows.append(row(f"alloc {name}: peak reserved/allocated", ours["ratio"], base.get("ratio"), "x",
                        baseline_name="torch policy (same allocator, torch's rules)", target="<= 1.10",
                        ok=ours["ratio"] <= 1.10, detail=by_policy,
                        note=f"{ours['ops']} ops, peak alloc {ours['peak_allocated'] / 2**20:.0f} MiB"))
        rows.append(row(f"alloc {name}: backend alloc calls", ours["device_alloc_calls"],
                        base.get("device_alloc_calls"), "calls", baseline_name="torch policy"))
        rows.append(row(f"alloc {name}: time per op", ours["us_per_op"], base.get("us_per_op"), "us/op",
                        baseline_name="torch policy"))
    if not res["traces"]:
        rows.append(row("alloc traces", None, None, "x", note="no traces found: set ACCEL_TRACES to the "
                        "folder of *.json traces (default ../shared/traces)", skipped=True))
    for label, conf in (("classic", "expandable_segments:False"), ("expandable", "expandable_segments:True")):
        sc = _bench.scaling_cost(2000, 5000 if quick else 20000, _config.parse(conf))
        rows.append(row(f"alloc {label}: us/op with {sc['large']} blocks live", sc["large_us_per_op"],
                        sc["small_us_per_op"], "us/op", baseline_name=f"{sc['small']} blocks live",
                        target="<= 1.5x", ok=sc["ratio"] <= 1.5,
                        note="synthetic trace (_bench.many_live_trace): no path linear in live blocks"))
    pair = res["alloc_free_1mib"]
    rows.append(row("alloc cached 1 MiB alloc+free", pair["cached_pair_us"], pair["bare_pair_us"], "us/pair",
                    baseline_name="bare sim cudaMalloc+cudaFree", target="<= 3 us",
                    ok=pair["cached_pair_us"] <= 3.0,
                    note=(f"wall {pair['cached_pair_wall_us']:.2f} vs {pair['bare_pair_wall_us']:.2f} us"
                          if "cached_pair_wall_us" in pair else "")))
    return rows


# -- group: RNG ----------------------------------------------------------------------------------
def group_rng(quick: bool, progress: Callable[[str], None]) -> List[dict]:
    from accel.random import _bench
    progress("host Philox vs numpy Philox")
    r = _bench.bench_philox(seconds=0.3 if quick else 3.0, n_words=(1 << 20) if quick else (1 << 22))
    target = r.get("target_ratio", 0.5)
    rows = []
    for theirs, label in (("numpy_random_raw", "numpy Philox random_raw (C)"),
                          ("numpy_integers", "numpy Generator(Philox).integers(uint32)")):
        for ours, what in (("accel", f"{r['threads']} threads"), ("accel_1thread", "1 thread")):
            a, b = r[f"{ours}_gbps"], r[f"{theirs}_gbps"]
            rows.append(row(f"rng host Philox ({what}) vs {theirs.split('_', 1)[1]}", a, b, "GB/s",
                            baseline_name=label, target=f">= {target}x", ok=a / b >= target,
                            note=f"uint32, {r['n_words']} words, best of {r['rounds']}"))
    return rows


# -- group: graphs ---------------------------------------------------------------------------------
def group_graphs(quick: bool, progress: Callable[[str], None]) -> List[dict]:
    from accel._selftest_bench import graph_vs_eager
    nops = 100
    progress(f"graph replay vs eager, {nops} fills")
    r = graph_vs_eager(nops, rounds=3 if quick else 9, batch_s=0.01 if quick else 0.05)
    return [
        row(f"graph replay vs eager, {nops} fills (issue+sync)", r["graph_us"], r["eager_us"], "us/iter",
            baseline_name=f"{nops} eager fill_ + synchronize", target="< 1x", ok=r["ratio"] < 1.0),
        row(f"graph replay vs eager, {nops} fills (issue only)", r["graph_issue_us"], r["eager_issue_us"],
            "us/iter", baseline_name=f"{nops} eager fill_ calls",
            note="host time to enqueue; the simulator runs the work on its stream thread"),
    ]


# -- group: user kernels (issue 18) ------------------------------------------------------------------
def _test_kernel():
    """accel's own test kernel (sim.kernels.TEST_PTX, its reference already registered), loaded
    as a user module: ``accel_test_fill_u32(ptr out, u64 n, u32 value)``."""
    import accel
    from accel.sim import kernels as sim_kernels
    return accel.Module(sim_kernels.TEST_PTX).function("accel_test_fill_u32")


def group_kernels(quick: bool, progress: Callable[[str], None]) -> List[dict]:
    import numpy as np

    import accel
    from accel._selftest_bench import interleaved_ns
    accel.current_stream()                      # initializes the backend
    be = accel.backends.get("cuda")
    lib, ffi = be.lib, be.ffi
    kernel = _test_kernel()
    s = accel.Stream()
    n, value = 64, 7
    out = accel.Buffer(4 * n, stream=s)
    # The bare call: cudaLaunchKernel with everything prebuilt once (argument cells, the void *[],
    # dim3s, the cast stream and function), i.e. only the cffi call accel.launch ends in.
    cells = [ffi.new("uint64_t *", out.ptr), ffi.new("uint64_t *", n), ffi.new("uint32_t *", value)]
    argv = ffi.new("void *[]", [ffi.cast("void *", c) for c in cells])
    ns = {"accel": accel, "lib": lib, "k": kernel, "out": out, "n": n, "value": value, "s": s,
          "argv": argv, "func": ffi.cast("void *", kernel.handle), "sc": ffi.cast("cudaStream_t", s.handle),
          "grid": ffi.new("dim3 *", (1, 1, 1))[0], "block": ffi.new("dim3 *", (32, 1, 1))[0],
          "np_n": np.uint64(n), "np_value": np.uint32(value)}
    rc = eval("lib.cudaLaunchKernel(func, grid, block, argv, 0, sc)", ns)
    if rc != 0:
        raise RuntimeError(f"the bare cudaLaunchKernel returned {rc}")
    accel.launch(kernel, 1, 32, out, n, value, stream=s)
    s.synchronize()
    if not (out.to_numpy(np.uint32, stream=s) == value).all():
        raise AssertionError("accel.launch of accel_test_fill_u32 did not fill the buffer")
    stmts = {
        "launch": "accel.launch(k, 1, 32, out, n, value, stream=s)",
        "launch/bare": "lib.cudaLaunchKernel(func, grid, block, argv, 0, sc)",
        "launch_np": "accel.launch(k, 1, 32, out, np_n, np_value, stream=s)",
        "launch_tuple": "accel.launch(k, (1, 1, 1), (32, 1, 1), out, n, value, stream=s)",
    }
    progress("accel.launch vs bare cudaLaunchKernel")
    best = interleaved_ns(stmts, ns, rounds=3 if quick else 9, batch_s=0.005 if quick else 0.02,
                          between=s.synchronize)
    bare = best["launch/bare"]
    rows = [
        row("sim accel.launch (int args, stream=s)", best["launch"], bare, "ns/call",
            baseline_name="bare sim cudaLaunchKernel, prebuilt args", target="<= 2x",
            ok=best["launch"] / bare <= 2.0, stmt=stmts["launch"], baseline_stmt=stmts["launch/bare"]),
        row("sim accel.launch (numpy scalar args)", best["launch_np"], bare, "ns/call",
            baseline_name="bare sim cudaLaunchKernel, prebuilt args", stmt=stmts["launch_np"]),
        row("sim accel.launch (3-tuple grid/block)", best["launch_tuple"], bare, "ns/call",
            baseline_name="bare sim cudaLaunchKernel, prebuilt args", stmt=stmts["launch_tuple"]),
    ]
    progress("graph replay of 100 launches vs 100 eager launches")
    r = launch_graph_vs_eager(kernel, 100, rounds=3 if quick else 9, batch_s=0.01 if quick else 0.05)
    rows += [
        row("graph replay vs eager, 100 launches (issue+sync)", r["graph_us"], r["eager_us"], "us/iter",
            baseline_name="100 eager accel.launch + synchronize", target="< 1x", ok=r["ratio"] < 1.0),
        row("graph replay vs eager, 100 launches (issue only)", r["graph_issue_us"], r["eager_issue_us"],
            "us/iter", baseline_name="100 eager accel.launch calls",
            note="host time to enqueue; the simulator runs the kernels on its stream thread"),
    ]
    out.close()
    s.close()
    return rows


def launch_graph_vs_eager(kernel, nops: int = 100, *, rounds: int = 9, batch_s: float = 0.05) -> dict:
    """Host µs per iteration of ``nops`` launches of ``kernel`` (accel_test_fill_u32 signature)
    issued eagerly vs replayed from one graph; checks a replay really launches them first."""
    import numpy as np

    import accel
    from accel._selftest_bench import interleaved_ns
    s = accel.Stream()
    n = 16
    bufs = [accel.Buffer(4 * n, stream=s) for _ in range(nops)]

    def program():
        for i, b in enumerate(bufs):
            accel.launch(kernel, 1, 32, b, n, i, stream=s)

    program()
    s.synchronize()
    g = accel.Graph()
    with s, g:
        program()
    for b in bufs:
        b.fill_(0xAB, s)

    def replay():
        with s:
            g.replay()

    replay()
    s.synchronize()
    wrong = [i for i, b in enumerate(bufs) if not (b.to_numpy(np.uint32, stream=s) == i).all()]
    if wrong:
        raise AssertionError(f"graph replay did not perform launches {wrong[:5]}")
    ns = {"program": program, "replay": replay, "s": s}
    stmts = {"eager": "program(); s.synchronize()", "graph": "replay(); s.synchronize()",
             "eager_issue": "program()", "graph_issue": "replay()"}
    best = interleaved_ns(stmts, ns, rounds=rounds, batch_s=batch_s, between=s.synchronize)
    result = {f"{k}_us": v / 1e3 for k, v in best.items()}
    result.update(nops=nops, ratio=best["graph"] / best["eager"])
    g.reset()
    for b in bufs:
        b.close()
    s.close()
    return result


# -- groups: name -> (environment, function, where it runs) ------------------------------------------
GROUPS = {
    "import": ({}, group_import, "here"),
    "percall": ({"ACCEL_SIM": "cuda"}, group_percall, "worker"),
    "percall_real": ({}, group_percall_real, "worker"),
    "alloc": ({"ACCEL_SIM": "cuda"}, group_alloc, "worker"),
    "rng": ({}, group_rng, "worker"),
    "graphs": ({"ACCEL_SIM": "cuda"}, group_graphs, "worker"),
    "kernels": ({"ACCEL_SIM": "cuda"}, group_kernels, "worker"),
}


def _find_traces() -> Optional[str]:
    candidates = [os.environ.get("ACCEL_TRACES"), os.path.join(os.path.dirname(REPO), "shared", "traces"),
                  os.path.join(REPO, "shared", "traces")]
    for path in candidates:
        if path and os.path.isdir(path):
            return path
    return None


def _run_worker(group: str, quick: bool, progress: Progress, timeout: float) -> List[dict]:
    env_extra, _, _ = GROUPS[group]
    env = _clean_env(**env_extra)
    traces = _find_traces()
    if traces:
        env["ACCEL_TRACES"] = traces
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", group] + (["--quick"] if quick else [])
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: List[str] = []
    err: List[str] = []

    def read_err():
        for line in proc.stderr:
            if line.startswith("@progress "):
                progress.update(f"[{group}] {line[10:].rstrip()}")
            else:
                err.append(line)

    def read_out():
        out.append(proc.stdout.read())

    readers = [threading.Thread(target=read_err, daemon=True), threading.Thread(target=read_out, daemon=True)]
    for t in readers:
        t.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return [error_row(group, f"timed out after {timeout:.0f} s")]
    for t in readers:
        t.join(5)
    text = "".join(out).strip()
    if proc.returncode != 0 or not text:
        tail = "".join(err)[-2000:].strip()
        return [error_row(group, f"worker exited with {proc.returncode}: {tail}")]
    try:
        return json.loads(text.splitlines()[-1])["rows"]
    except (ValueError, KeyError) as exc:
        return [error_row(group, f"worker printed no result ({exc}): {text[-500:]}")]


# -- output ---------------------------------------------------------------------------------------------
def _fmt(value, unit: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) >= 100):
        return f"{int(value)} {unit}"
    if abs(value) >= 100:
        return f"{value:.0f} {unit}"
    if abs(value) >= 10:
        return f"{value:.1f} {unit}"
    return f"{value:.3g} {unit}"


def format_table(rows: List[dict]) -> str:
    header = ("name", "accel", "baseline", "ratio", "target", "ok", "baseline is / note")
    lines = []
    for r in rows:
        ok = {True: "yes", False: "NO", None: ""}[r.get("ok")]
        if r.get("error"):
            ok = "ERROR"
        ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.3g}x"
        note = "; ".join(filter(None, [r.get("baseline_name", ""), r.get("note", "")]))
        lines.append((r["name"], _fmt(r.get("accel"), r.get("unit", "")), _fmt(r.get("baseline"), r.get("unit", "")),
                      ratio, r.get("target", ""), ok, note))
    widths = [max(len(str(x[i])) for x in [header] + lines) for i in range(len(header) - 1)]
    out = []
    for i, line in enumerate([header] + lines):
        cells = [str(c).ljust(w) if j == 0 else str(c).rjust(w) if j in (1, 2, 3) else str(c).ljust(w)
                 for j, (c, w) in enumerate(zip(line, widths))]
        out.append(" | ".join(cells) + " | " + line[-1])
        if i == 0:
            out.append("-+-".join("-" * w for w in widths) + "-+-" + "-" * 20)
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--quick", action="store_true", help="small sizes and few rounds (under 30 s)")
    parser.add_argument("--only", default="", help=f"comma-separated groups: {', '.join(GROUPS)}")
    parser.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:     # inside a group's subprocess: print its rows as one JSON line
        rows = GROUPS[args.worker][1](args.quick, _report)
        sys.stdout.write(json.dumps({"rows": rows}) + "\n")
        return 0

    groups = list(GROUPS)
    if args.only:
        wanted = [g.strip() for g in args.only.split(",") if g.strip()]
        unknown = [g for g in wanted if g not in GROUPS]
        if unknown:
            parser.error(f"unknown group(s) {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
        groups = [g for g in groups if g in wanted]

    progress = Progress(enabled=not args.no_progress)
    started = time.perf_counter()
    rows: List[dict] = []
    for i, group in enumerate(groups, 1):
        progress.update(f"[{i}/{len(groups)}] {group} ...")
        _, fn, where = GROUPS[group]
        t0 = time.perf_counter()
        if where == "here":
            try:
                got = fn(args.quick, lambda text, g=group: progress.update(f"[{g}] {text}"))
            except Exception as exc:
                got = [error_row(group, f"{type(exc).__name__}: {exc}")]
        else:
            got = _run_worker(group, args.quick, progress, timeout=120 if args.quick else 600)
        for r in got:
            r["group"] = group
        rows.extend(got)
        progress.update(f"[{i}/{len(groups)}] {group} done in {time.perf_counter() - t0:.1f} s")
    progress.clear()
    elapsed = time.perf_counter() - started

    if args.json:
        print(json.dumps({"quick": args.quick, "elapsed_s": round(elapsed, 2),
                          "python": sys.version.split()[0], "machine": platform.machine(),
                          "cpus": os.cpu_count(), "rows": rows}, indent=1))
    else:
        print(format_table(rows))
        missed = [r["name"] for r in rows if r.get("ok") is False]
        print(f"\n{len(rows)} rows in {elapsed:.1f} s ({'quick' if args.quick else 'full'} run, "
              f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}); "
              + (f"missed or failed: {', '.join(missed)}" if missed else "all targets met"))
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
