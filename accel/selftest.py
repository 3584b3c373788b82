"""Real-hardware self-test: ``python -m accel.selftest [--json PATH]``.

Runs, on one real device and in well under 5 minutes, the checks that matter
on hardware: device count and properties against NVML, alloc/copy round
trips from 1 B to 1 GiB, stream/event ordering, graph capture and replay, on a
machine with 2+ devices the work on another device while this one is current
(streams, events, fills, RNG, graph replay), copies between the devices and
pinned copies to both (skipped, with the reason, on one device), the
PTX Philox kernels bit-equal to the host path, a user kernel (SAXPY in CUDA C
compiled with NVRTC, loaded and launched; skipped, with the reason, without
NVRTC) bit-equal to numpy, recovery from out-of-memory,
the fork rules, DLPack/CAI exchange with torch and CuPy where installed, and
benchmarks (device RNG fill GB/s against the memory bandwidth, cached
alloc+free µs, graph replay vs eager launch, per-call host cost beside torch,
CuPy and cuda.core, the shared allocation traces replayed with expandable and
classic segments).  Writes one
JSON report (default ``accel-selftest.json``; ``--json -`` prints it).

Each check runs in its own subprocess under a timeout, so one failing,
crashing or hanging check (or a device left in a sticky error state) does not
stop the rest.  The exit status is 0 when every check passed or when there
is no device (the report then says ``"skipped": true`` and why), else 1.

The simulator is not used: ``ACCEL_SIM`` is ignored (with a note) unless
``--allow-sim`` asks for a *dry run* of every check on the simulated runtime
(``ACCEL_SIM=cuda`` unless set, 1 GiB per simulated device unless
``ACCEL_SIM_MEMORY`` is set), which is how the checks themselves are tested on
machines without a device.  ``--quick`` uses small sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from typing import List, Optional

_RESULT = "@result "
DEFAULT_BUDGET_S = 285.0


def _check_names() -> List[str]:
    from . import _selftest_checks
    return list(_selftest_checks.CHECKS)


def _why_unavailable() -> str:
    """Each backend's reason for reporting no device (from its report(); never initializes)."""
    from . import backends
    reasons = []
    requested = os.environ.get("ACCEL_BACKEND") or os.environ.get("ACCEL_SIM")
    for name in ([requested] if requested in backends.NAMES else backends.NAMES):
        try:
            rep = backends.get(name).report()
            reasons.append(f"{name}: {rep.get('reason') or 'count ' + str(rep.get('count'))}")
        except Exception as exc:  # a broken backend still gets a line
            reasons.append(f"{name}: report failed ({type(exc).__name__}: {exc})")
    return "no accelerator device; " + "; ".join(reasons)


def run_check_here(name: str, device: int = 0, quick: bool = False) -> dict:
    """Run one check in this process; returns its result record (never raises)."""
    from . import _selftest_checks as checks
    fn, _ = checks.CHECKS[name]
    t0 = time.perf_counter()
    record = {"name": name, "doc": (fn.__doc__ or "").strip().split("\n")[0]}
    try:
        details = fn(checks.Context(device, quick))
        record.update(status="skip" if isinstance(details, dict) and "skipped" in details else "pass",
                      details=details)
    except checks.CheckFailed as exc:
        record.update(status="fail", error=str(exc), details=exc.details)
    except Exception as exc:  # noqa: BLE001 - any error is this check's failure, not the run's
        record.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    record["seconds"] = round(time.perf_counter() - t0, 3)
    return record


def _child_env() -> dict:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def run_check_subprocess(name: str, device: int = 0, quick: bool = False, timeout: Optional[float] = None,
                         allow_sim: bool = False) -> dict:
    """Run one check in a fresh interpreter under ``timeout`` seconds (default: the check's own)."""
    from . import _selftest_checks as checks
    if timeout is None:
        timeout = checks.CHECKS[name][1]
    cmd = [sys.executable, "-m", "accel.selftest", "--run-check", name, "--device", str(device)]
    cmd += ["--quick"] if quick else []
    cmd += ["--allow-sim"] if allow_sim else []
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=_child_env(), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return {"name": name, "status": "timeout", "seconds": round(time.perf_counter() - t0, 3),
                "error": f"did not finish in {timeout:.0f} s (killed)", "stderr": err[-4000:]}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_RESULT)]
    if not lines:
        return {"name": name, "status": "error", "seconds": round(time.perf_counter() - t0, 3),
                "error": f"the check's process exited with {proc.returncode} without a result",
                "stdout": proc.stdout[-2000:], "stderr": proc.stderr[-4000:]}
    record = json.loads(lines[-1][len(_RESULT):])
    if proc.stderr.strip():
        record["stderr"] = proc.stderr[-4000:]
    return record


def _backend_summary() -> dict:
    from . import backends
    chosen = backends.select()
    try:
        return chosen.report() if chosen is not None else {}
    except Exception as exc:  # noqa: BLE001
        return {"report_error": repr(exc)}


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=lambda o: sorted(o) if isinstance(o, (set, frozenset)) else repr(o)))


def _write(report: dict, path: str) -> None:
    text = json.dumps(_jsonable(report), indent=1)
    if path == "-":
        print(text)
        return
    with open(path, "w") as fh:
        fh.write(text + "\n")


def _print(*args) -> None:
    print(*args, flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m accel.selftest",
        description="Real-hardware self-test: device checks and benchmarks on one device, one JSON report.",
        epilog="checks: " + ", ".join(_check_names()))
    parser.add_argument("--json", default="accel-selftest.json", metavar="PATH",
                        help="where to write the JSON report ('-' = stdout; default %(default)s)")
    parser.add_argument("--device", type=int, default=0, help="device index to test (default 0)")
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds, not minutes)")
    parser.add_argument("--allow-sim", action="store_true",
                        help="dry run on the simulator (ACCEL_SIM=cuda unless set): tests the checks themselves")
    parser.add_argument("--only", default="", help="comma-separated check names")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds for the whole run; checks left when it is spent are skipped")
    parser.add_argument("--run-check", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = sys.stderr if args.json == "-" else sys.stdout

    def say(*parts):
        print(*parts, file=out, flush=True)

    sim = os.environ.get("ACCEL_SIM")
    if args.allow_sim:
        os.environ.setdefault("ACCEL_SIM", "cuda")
        os.environ.setdefault("ACCEL_SIM_MEMORY", "1G")
    elif sim:
        if not args.run_check:
            say(f"accel.selftest: ignoring ACCEL_SIM={sim}: the self-test is for real hardware "
                "(use --allow-sim for a dry run on the simulator)")
        del os.environ["ACCEL_SIM"]

    if args.run_check:
        sys.stdout.write(_RESULT + json.dumps(_jsonable(run_check_here(args.run_check, args.device, args.quick)))
                         + "\n")
        return 0

    names = _check_names()
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            parser.error(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(names)}")
        names = [n for n in names if n in wanted]

    import accel
    started = time.time()
    report = {"tool": "accel.selftest", "accel_version": accel.__version__, "python": sys.version.split()[0],
              "platform": platform.platform(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "dry_run": bool(args.allow_sim), "quick": args.quick, "device": args.device,
              "env": {k: v for k, v in os.environ.items()
                      if k.startswith(("ACCEL_", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "ZE_AFFINITY_MASK"))}}
    try:
        available = accel.is_available()
    except Exception as exc:  # noqa: BLE001 - a broken backend still gets a report
        report.update(skipped=False, ok=False, checks=[], error=f"is_available() raised {type(exc).__name__}: {exc}",
                      traceback=traceback.format_exc(), elapsed_s=round(time.time() - started, 3))
        say(f"accel.selftest: error: {report['error']}")
        _write(report, args.json)
        return 1
    if not available:
        reason = _why_unavailable()
        report.update(skipped=True, reason=reason, checks=[], elapsed_s=round(time.time() - started, 3))
        say(f"accel.selftest: skipped: {reason}")
        _write(report, args.json)
        return 0

    report["skipped"] = False
    report["backend"] = _backend_summary()
    say(f"accel.selftest: {report['backend'].get('backend', '?')} device {args.device}"
        f"{' (dry run on the simulator)' if args.allow_sim else ''}; {len(names)} checks, "
        f"budget {args.budget:.0f} s")
    from . import _selftest_checks as checks
    results = []
    deadline = time.monotonic() + args.budget
    for i, name in enumerate(names, 1):
        left = deadline - time.monotonic()
        if left < 5:
            rec = {"name": name, "status": "skip", "error": "time budget spent", "seconds": 0}
        else:
            say(f"[{i}/{len(names)}] {name} ...")
            rec = run_check_subprocess(name, args.device, args.quick, min(checks.CHECKS[name][1], left),
                                       args.allow_sim)
        results.append(rec)
        line = f"[{i}/{len(names)}] {rec['status'].upper():7} {name} ({rec.get('seconds', 0):.1f} s)"
        if rec.get("error"):
            line += f": {rec['error'].splitlines()[0][:200]}"
        say(line)
    counts = {}
    for rec in results:
        counts[rec["status"]] = counts.get(rec["status"], 0) + 1
    report.update(checks=results, summary=counts, elapsed_s=round(time.time() - started, 3),
                  ok=all(r["status"] in ("pass", "skip") for r in results))
    _write(report, args.json)
    say(f"accel.selftest: {', '.join(f'{v} {k}' for k, v in sorted(counts.items()))} in "
        f"{report['elapsed_s']:.1f} s; report: {args.json}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
