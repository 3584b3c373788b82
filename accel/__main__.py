"""``python -m accel [--json]``: what accelerator this machine has, and why not.

Prints the selected backend, each runtime's library paths and versions, how
devices were counted, the visible-device environment, the devices and their
properties, and for every runtime without a device the reason.  Works with
no device and under the simulator (``ACCEL_SIM=cuda``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import accel
from accel import backends

_ENV = ("ACCEL_BACKEND", "ACCEL_SIM", "ACCEL_ALLOC_CONF", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER",
        "ZE_AFFINITY_MASK", "ZE_FLAT_DEVICE_HIERARCHY")


def collect() -> dict:
    """The report as a dict (what ``--json`` prints)."""
    result = {"accel_version": accel.__version__, "python": sys.version.split()[0],
              "env": {k: os.environ[k] for k in _ENV if k in os.environ}}
    try:
        chosen = backends.select()
    except ValueError as exc:  # a bad ACCEL_BACKEND value
        result["error"] = str(exc)
        return result
    result["selected"] = chosen.name if chosen is not None else None
    # the type current_accelerator() names even without a device (the first runtime whose library
    # loads, as a CUDA build of torch on a machine without a GPU; r85b noticed the report left it out)
    try:
        kind = chosen or backends.fallback()
    except Exception:       # noqa: BLE001 (a report never stops)
        kind = None
    result["accelerator_type"] = kind.name if kind is not None else None
    result["backends"] = {}
    for name in backends.NAMES:
        try:
            result["backends"][name] = backends.get(name).report()
        except Exception as exc:  # a report must never stop the others
            result["backends"][name] = {"backend": name, "count": 0, "reason": f"report failed: {exc!r}"}
    devices = []
    try:
        count = chosen.count() if chosen is not None else 0
    except Exception as exc:  # a bad simulator setting (ACCEL_SIM_DEVICES=abc): say so, no traceback
        result["error"] = f"{type(exc).__name__}: {exc}"
        return result
    if count > 0:
        try:
            accel._lazy.lazy_init()
            for i in range(chosen.count()):
                p = chosen.properties(i)
                devices.append({"index": i, "name": p.name, "total_memory": p.total_memory,
                                "compute_capability": list(p.compute_capability),
                                "multi_processor_count": p.multi_processor_count, "uuid": None if p.uuid is None else str(p.uuid),
                                "unified_memory": p.unified_memory, **p.extra,
                                "readings": readings(i, chosen.count())})
        except accel.AcceleratorError as exc:
            result["init_error"] = str(exc)
    result["devices"] = devices
    result["nvrtc"] = _nvrtc()
    return result


def _nvrtc() -> dict:
    """Which libnvrtc accel.compile would use, and its version (loading it initializes nothing)."""
    from .backends.cuda import nvrtc as _nvrtc
    try:
        _ffi, _lib, path = _nvrtc.open_lib()
        return {"library": str(path), "version": "%d.%d" % _nvrtc.version()}
    except Exception as exc:     # absent or broken: say so, never stop the report
        return {"error": str(exc).splitlines()[0]}


#: (report key, accel function) of the management-library readings torch.cuda offers.
_READINGS = (("utilization_percent", "utilization"), ("memory_usage_percent", "memory_usage"),
             ("temperature_c", "temperature"), ("power_draw_mw", "power_draw"),
             ("clock_rate_mhz", "clock_rate"), ("memory_used_bytes", "device_memory_used"))


def readings(index: int, count: int) -> dict:
    """Device ``index``'s management-library readings (NVML / Sysman) and the devices it can
    access as peers; a reading the backend cannot give is the reason, as a string."""
    from accel import _telemetry
    out = {}
    for key, name in _READINGS:
        try:
            out[key] = getattr(_telemetry, name)(index)
        except (accel.AcceleratorError, NotImplementedError) as exc:
            out[key] = f"n/a ({exc})"
    try:
        out["peers"] = [j for j in range(count) if j != index and _telemetry.can_device_access_peer(index, j)]
    except accel.AcceleratorError as exc:
        out["peers"] = f"n/a ({exc})"
    return out


def smoke() -> dict:
    """Exercise the selected device end to end: copies, streams, events, a graph, RNG, memory stats.

    Everything runs on a side stream made current with ``with s:``; every operation uses the
    current stream, so each read is ordered after the writes before it."""
    import numpy as np
    checks = {}
    s = accel.Stream()
    data = np.arange(1 << 18, dtype=np.float32)
    with s:
        buf = accel.Buffer(data.nbytes)
        buf.copy_from(data, non_blocking=True)
        checks["copy round trip (1 MiB)"] = bool(np.array_equal(buf.to_numpy(np.float32), data))
        start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
        start.record()
        buf.fill_(0)
        end.record()
        checks["event timing (ms)"] = round(start.elapsed_time(end), 4)
        if backends.select().supports_graphs:
            g = accel.Graph()
            with g:
                buf.fill_(3)
            buf.fill_(0)
            g.replay()
            checks["graph replay"] = bool((buf.to_numpy() == 3).all())
            g.reset()
        accel.random.manual_seed(0)
        accel.random.uniform_(buf)
        values = buf.to_numpy(np.float32)
        checks["uniform fill mean"] = round(float(values.mean()), 4)
        checks["memory_allocated (bytes)"] = accel.memory.memory_allocated()
        buf.close()
    return checks


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def render(report: dict) -> str:
    lines = [f"accel {report['accel_version']} (Python {report['python']})"]
    if "error" in report:
        return "\n".join(lines + [f"error: {report['error']}"])
    selected, kind = report["selected"], report.get("accelerator_type")
    if selected:
        lines.append(f"accelerator: {selected}")
    elif kind:
        lines.append(f"accelerator: none available (current_accelerator() is {kind}: its library loads; "
                     f"the reason it has no device is below)")
    else:
        lines.append("accelerator: none available")
    for key, value in report["env"].items():
        lines.append(f"  {key}={value}")
    for name, info in report["backends"].items():
        mark = "*" if name == selected else " "
        lines.append(f"{mark} {name}: {info.get('count', 0)} device(s)" +
                     (" [simulated]" if info.get("simulated") else ""))
        for key, value in info.items():
            if key in ("backend", "count", "simulated") or value in (None, "", {}):
                continue
            if key == "cudart_choice" and isinstance(value, dict) and "candidates" in value:
                lines.extend(_render_choice(value))
                continue
            if isinstance(value, dict):
                value = ", ".join(f"{k}={v}" for k, v in value.items() if v is not None) or "-"
            value = str(value).replace("\n", "\n          ")
            lines.append(f"      {key}: {value}")
    for d in report["devices"]:
        cc = ".".join(map(str, d["compute_capability"]))
        lines.append(f"  [{d['index']}] {d['name']}  {_gib(d['total_memory'])}  cc {cc}  "
                     f"{d['multi_processor_count']} SMs/EUs  {d['uuid']}")
        if d.get("readings"):
            lines.append(f"      now: {_render_readings(d['readings'])}")
    if "init_error" in report:
        lines.append(f"  init failed: {report['init_error']}")
    nvrtc = report.get("nvrtc") or {}
    if "library" in nvrtc:
        lines.append(f"nvrtc (accel.compile): {nvrtc['library']} (NVRTC {nvrtc['version']})")
    elif nvrtc:
        lines.append(f"nvrtc (accel.compile): {nvrtc['error']}")
    return "\n".join(lines)


def _render_readings(r: dict) -> str:
    """One line: utilization, memory activity, temperature, power, SM clock, memory used, peers."""
    def show(key, fmt):
        value = r.get(key)
        return fmt(value) if isinstance(value, int) else "n/a"
    missing = sorted({v for v in r.values() if isinstance(v, str)})
    text = (f"utilization {show('utilization_percent', lambda v: f'{v}%')}  "
            f"memory activity {show('memory_usage_percent', lambda v: f'{v}%')}  "
            f"{show('temperature_c', lambda v: f'{v} C')}  "
            f"{show('power_draw_mw', lambda v: f'{v / 1000:.1f} W')}  "
            f"SM clock {show('clock_rate_mhz', lambda v: f'{v} MHz')}  "
            f"used {show('memory_used_bytes', _gib)}  "
            f"peers {r['peers'] if isinstance(r.get('peers'), list) else 'n/a'}")
    if missing:
        text += "\n          " + "\n          ".join(missing)
    return text


def _render_choice(choice: dict) -> list:
    """The libcudart candidates, one line each with its verdict (taken / rejected: why)."""
    driver = choice.get("driver_cuda_version")
    lines = [f"      libcudart choice (driver supports CUDA {driver or '?'}"
             f"{'' if driver else ': ' + str(choice.get('driver_version_from'))}):"]
    for c in choice["candidates"]:
        where = c["path"] if not c.get("file") or c["file"] == c["path"] else f"{c['path']} -> {c['file']}"
        version = f" [{c['version']}]" if c.get("version") else ""
        lines.append(f"        {c['verdict']:8} {where}{version} ({c['source']})"
                     + (f": {c['reason']}" if c.get("reason") else ""))
    if choice.get("error"):
        lines.append(f"        error: {choice['error']}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m accel", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-smoke", action="store_true",
                        help="only report; do not exercise the device (or the simulator when there is none)")
    args = parser.parse_args(argv)
    report = collect()
    if "error" not in report and not args.no_smoke:
        if report["devices"]:
            try:
                report["smoke"] = smoke()
            except Exception as exc:  # e.g. a bad ACCEL_ALLOC_CONF: the report says why
                report["smoke"] = {"error": f"{type(exc).__name__}: {exc}"}
        elif not os.environ.get("ACCEL_SIM"):
            report["simulator"] = _smoke_on_simulator()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(render(report))
        if "error" in report.get("smoke", {}):
            print(f"smoke test failed: {report['smoke']['error']}")
        elif "smoke" in report:
            print("smoke test on the selected device:")
            print("\n".join(f"  {k}: {v}" for k, v in report["smoke"].items()))
        if "simulator" in report:
            print("no device here; the same API on the simulator (ACCEL_SIM=cuda):")
            print("\n".join(f"  {k}: {v}" for k, v in report["simulator"].items()))
    return 1 if "error" in report or "error" in report.get("smoke", {}) else 0


def _smoke_on_simulator() -> dict:
    """Run the smoke test in a child process on ACCEL_SIM=cuda (this process keeps the real view)."""
    import subprocess
    env = {**os.environ, "ACCEL_SIM": "cuda"}
    env.pop("ACCEL_BACKEND", None)
    code = "import json, accel.__main__ as m; print(json.dumps(m.smoke()))"
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             timeout=120)
    except subprocess.TimeoutExpired:
        return {"error": "the simulator smoke test timed out"}
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed"}
    return json.loads(out.stdout)


if __name__ == "__main__":
    sys.exit(main())
