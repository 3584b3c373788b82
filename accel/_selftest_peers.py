"""Self-test checks against the other GPU libraries installed beside accel (torch, CuPy, cuda.core).

``interop_peers`` exchanges device memory with each through DLPack and ``__cuda_array_interface__``
and reads back what the other side wrote.  ``bench_peers`` times the same host-side calls
(current stream, event record, stream query, a 1 MiB allocate+free, a small fill) in accel and in
each peer, interleaved round by round in one process, so a user can see what the pure-Python
layer costs next to the compiled ones.  A peer that is not installed, or has no device, is
reported as skipped with the reason; neither check needs one.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

MiB = 1 << 20


def _torch_cuda():
    """torch if it is installed with a usable CUDA device, else the reason it is not."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any import failure only means "not here"
        return None, f"torch not importable ({type(exc).__name__}: {exc})"
    try:
        ok = torch.cuda.is_available()
    except Exception as exc:  # noqa: BLE001
        return None, f"torch.cuda.is_available() raised {type(exc).__name__}: {exc}"
    return (torch, "") if ok else (None, f"torch {torch.__version__} sees no CUDA device")


def _cupy():
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001
        return None, f"cupy not usable ({type(exc).__name__}: {exc})"
    return cupy, ""


def _cuda_core():
    try:
        try:
            from cuda.core import Device
        except ImportError:
            from cuda.core.experimental import Device
    except Exception as exc:  # noqa: BLE001
        return None, f"cuda.core not importable ({type(exc).__name__}: {exc})"
    return Device, ""


def _step(results: Dict[str, str], name: str, fn: Callable[[], Optional[str]]) -> None:
    try:
        problem = fn()
    except Exception as exc:  # noqa: BLE001 - each exchange is reported on its own
        problem = f"{type(exc).__name__}: {str(exc)[:300]}"
    results[name] = problem or "ok"


def _same(got, want, what: str) -> Optional[str]:
    import numpy as np
    got = np.asarray(got)
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{what}: got {got.dtype}{got.shape}, expected {want.dtype}{want.shape}"
    bad = np.flatnonzero(got != want)
    return f"{what}: {bad.size} elements differ, first at {int(bad[0])}" if bad.size else None


def check_interop_peers(ctx) -> dict:
    """DLPack and __cuda_array_interface__ with torch and CuPy where installed: each reads what
    accel wrote (zero copy) and accel reads what each wrote, on the device under test."""
    import numpy as np

    import accel
    from ._selftest_checks import CheckFailed
    if ctx.simulated:
        return {"skipped": "the simulator's memory is host memory no framework reads as device memory"}
    if ctx.backend.name != "cuda":
        return {"skipped": f"the peers checked here are CUDA libraries; this is {ctx.backend.name}"}
    n = (1 << 16) if ctx.quick else (1 << 22)
    want = np.arange(n, dtype=np.float32)
    d = ctx.device
    results: Dict[str, str] = {}
    skipped: Dict[str, str] = {}
    with accel.device_index(d):
        buf = accel.Buffer(4 * n, d)
        buf.copy_from(want)
        view = accel.ArrayView(buf, np.float32, (n,))
        torch, why = _torch_cuda()
        if torch is None:
            skipped["torch"] = why
        else:
            dev = torch.device("cuda", d)

            def torch_reads_accel():
                t = torch.from_dlpack(view)
                if t.device != dev:
                    return f"torch.from_dlpack put it on {t.device}, expected {dev}"
                if t.data_ptr() != view.ptr:
                    return f"torch copied: data_ptr {t.data_ptr():#x} != accel's {view.ptr:#x}"
                return _same(t.cpu().numpy(), want, "torch.from_dlpack(ArrayView)")

            def torch_writes_accel_reads():
                t = torch.arange(n, dtype=torch.float32, device=dev) * 3
                b = accel.from_dlpack(t)        # accel's current stream waits for torch's
                try:
                    return _same(b.to_numpy(np.float32), want * 3, "accel.from_dlpack(torch tensor)")
                finally:
                    b.close()

            def torch_writes_in_place_after_accel():
                buf.fill_(0)                          # queued on accel's stream: torch must see it done
                t = torch.from_dlpack(view)
                t.add_(7)
                torch.cuda.synchronize(dev)
                return _same(view.to_numpy(), np.full(n, 7, np.float32), "torch add_ on accel's memory")

            def accel_copies_from_torch_cai():
                t = torch.full((n,), 5.0, dtype=torch.float32, device=dev)
                other = accel.Buffer(4 * n, d)
                try:
                    other.copy_from(t)
                    return _same(other.to_numpy(np.float32), np.full(n, 5, np.float32),
                                 "Buffer.copy_from(torch tensor)")
                finally:
                    other.close()

            for fn in (torch_reads_accel, torch_writes_accel_reads, torch_writes_in_place_after_accel,
                       accel_copies_from_torch_cai):
                _step(results, "torch." + fn.__name__, fn)
            buf.copy_from(want)
        cupy, why = _cupy()
        if cupy is None:
            skipped["cupy"] = why
        else:
            def cupy_reads_accel_cai():
                with cupy.cuda.Device(d):
                    x = cupy.asarray(view)
                    if x.data.ptr != view.ptr:
                        return "cupy.asarray(ArrayView) copied"
                    return _same(cupy.asnumpy(x), want, "cupy.asarray(ArrayView)")

            def cupy_reads_accel_dlpack():
                with cupy.cuda.Device(d):
                    return _same(cupy.asnumpy(cupy.from_dlpack(view)), want, "cupy.from_dlpack(ArrayView)")

            def cupy_writes_accel_reads():
                with cupy.cuda.Device(d):
                    x = cupy.arange(n, dtype=cupy.float32) * 2
                b = accel.from_dlpack(x)
                try:
                    return _same(b.to_numpy(np.float32), want * 2, "accel.from_dlpack(cupy array)")
                finally:
                    b.close()

            for fn in (cupy_reads_accel_cai, cupy_reads_accel_dlpack, cupy_writes_accel_reads):
                _step(results, "cupy." + fn.__name__, fn)
        buf.close()
    details = {"elements": n, "results": results, "skipped_peers": skipped}
    failed = [k for k, v in results.items() if v != "ok"]
    if failed:
        raise CheckFailed(f"{len(failed)} exchanges failed: {', '.join(failed)}", details)
    if not results:
        details["skipped"] = "no peer installed with a device: " + "; ".join(f"{k}: {v}" for k, v in skipped.items())
    return details


#: op -> {library: statement}; bench_peers fills the namespace the statements use.
_PEER_STATEMENTS: Dict[str, Dict[str, str]] = {
    "current_stream": {"accel": "accel.current_stream()", "torch": "torch.cuda.current_stream()",
                       "cupy": "cupy.cuda.get_current_stream()", "cuda.core": "ccdev.default_stream"},
    "event_record": {"accel": "aev.record()", "torch": "tev.record()", "cupy": "cev.record()",
                     "cuda.core": "ccs.record(ccev)"},
    "stream_query": {"accel": "ast.query()", "torch": "tst.query()", "cupy": "cst.done",
                     "cuda.core": "ccev.is_done"},
    "alloc_free_1MiB": {"accel": "accel.Buffer(MiB).close()",
                        "torch": "torch.empty(MiB, dtype=torch.uint8, device=tdev)",
                        "cupy": "cupy.cuda.alloc(MiB)", "cuda.core": "ccmr.allocate(MiB, stream=ccs).close(ccs)"},
    "fill_small": {"accel": "abuf.fill_(1)", "torch": "tbuf.fill_(1)", "cupy": "cbuf.fill(1)"},
}


def bench_peers(ctx) -> dict:
    """Host µs per call, accel next to torch, CuPy and cuda.core where installed: current stream,
    event record, stream query, 1 MiB allocate+free (cached), a 256-byte fill; ratio = accel / peer."""
    import accel
    from . import _selftest_bench
    d = ctx.device
    ns: Dict[str, object] = {"accel": accel, "MiB": MiB}
    skipped: Dict[str, str] = {}
    syncs: List[Callable[[], None]] = []
    with accel.device_index(d):
        ns.update(aev=accel.Event(), ast=accel.Stream(), abuf=accel.Buffer(256))
        syncs.append(accel.synchronize)
        libs = ["accel"]
        if not ctx.simulated and ctx.backend.name == "cuda":
            torch, why = _torch_cuda()
            if torch is None:
                skipped["torch"] = why
            else:
                torch.cuda.set_device(d)
                tdev = torch.device("cuda", d)
                ns.update(torch=torch, tdev=tdev, tev=torch.cuda.Event(), tst=torch.cuda.Stream(tdev),
                          tbuf=torch.empty(256, dtype=torch.uint8, device=tdev))
                syncs.append(lambda: torch.cuda.synchronize(tdev))
                libs.append("torch")
            cupy, why = _cupy()
            if cupy is None:
                skipped["cupy"] = why
            else:
                cupy.cuda.Device(d).use()
                ns.update(cupy=cupy, cev=cupy.cuda.Event(), cst=cupy.cuda.Stream(non_blocking=True),
                          cbuf=cupy.empty(256, dtype=cupy.uint8))
                syncs.append(lambda: cupy.cuda.Device(d).synchronize())
                libs.append("cupy")
            Device, why = _cuda_core()
            if Device is None:
                skipped["cuda.core"] = why
            else:
                try:
                    ccdev = Device(d)
                    ccdev.set_current()
                    ccs = ccdev.create_stream()
                    ns.update(ccdev=ccdev, ccs=ccs, ccev=ccs.record(), ccmr=ccdev.memory_resource)
                    syncs.append(ccdev.sync)
                    libs.append("cuda.core")
                except Exception as exc:  # noqa: BLE001
                    skipped["cuda.core"] = f"set-up failed ({type(exc).__name__}: {exc})"
        else:
            skipped["peers"] = "only measured on a real CUDA device"

        def between():
            for sync in syncs:
                sync()

        stmts: Dict[str, str] = {}
        errors: Dict[str, str] = {}
        for op, by_lib in _PEER_STATEMENTS.items():
            for lib in libs:
                stmt = by_lib.get(lib)
                if stmt is None:
                    continue
                try:
                    exec(stmt, ns)       # noqa: S102 - our own fixed statements; one try before timing
                    between()
                except Exception as exc:  # noqa: BLE001 - a peer API that differs here is reported, not fatal
                    errors[f"{op}.{lib}"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    continue
                stmts[f"{op}.{lib}"] = stmt
        best = _selftest_bench.interleaved_ns(stmts, ns, rounds=3 if ctx.quick else 7,
                                              batch_s=0.01 if ctx.quick else 0.05, between=between)
        accel.synchronize()
        ns["abuf"].close()
        ns["ast"].close()
    table: Dict[str, Dict[str, float]] = {}
    for key, value in best.items():
        op, lib = key.split(".", 1)
        table.setdefault(op, {})[f"{lib}_us"] = round(value / 1000, 3)
    for op, row in table.items():
        mine = row.get("accel_us")
        for lib in libs[1:]:
            if mine and row.get(f"{lib}_us"):
                row[f"accel_over_{lib}"] = round(mine / row[f"{lib}_us"], 2)
    return {"us_per_call": table, "peers": libs[1:], "skipped_peers": skipped, "statement_errors": errors,
            "statements": {op: {lib: s for lib, s in by.items() if lib in libs}
                           for op, by in _PEER_STATEMENTS.items()}}
