"""Allocator measurements: trace replay and the cached alloc+free cost.

``tools/replay_trace.py`` and ``tools/bench.py`` call these.  Everything runs
on the selected backend (the simulator under ``ACCEL_SIM=cuda``); each
replay uses a fresh :class:`DeviceCachingAllocator` so several policies can be
compared in one process.
"""

from __future__ import annotations

import glob
import json
import os
import time
from typing import Dict, Iterable, List, Optional, Tuple

from .. import _lazy
from . import _config
from ._caching import DeviceCachingAllocator

MiB = 1 << 20


def default_traces() -> List[str]:
    """The allocation traces: ``$ACCEL_TRACES``, else ``../shared/traces`` next to the
    repository, else the copy kept in ``tests/test_memory_traces`` (for a clean clone)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = os.environ.get("ACCEL_TRACES")
    folders = [env] if env else [os.path.join(os.path.dirname(repo), "shared", "traces"),
                                 os.path.join(repo, "tests", "test_memory_traces")]
    for folder in folders:
        found = sorted(glob.glob(os.path.join(folder, "*.json")))
        if found:
            return found
    return []


def load_trace(path: str) -> dict:
    with open(path) as fh:
        trace = json.load(fh)
    if not isinstance(trace, dict) or not isinstance(trace.get("ops"), list):
        raise ValueError(f"{path}: not a trace (expected {{'name', 'ops': [['a', id, nbytes] | ['f', id]]}})")
    return trace


def replay(trace: dict, config: Optional[_config.AllocConfig] = None, device: int = 0) -> Dict[str, float]:
    """Replay one trace through a fresh allocator; returns its figures.

    ``ratio`` is peak reserved / peak allocated (allocated = block sizes, as
    torch's ``allocated_bytes``); ``ratio_requested`` divides by the peak of
    the bytes the program asked for, the stricter measure.
    """
    be = _lazy.lazy_init()
    alloc = DeviceCachingAllocator(be, device, config or _config.AllocConfig())
    stream = be.default_stream(device)
    malloc, free = alloc.malloc, alloc.free
    live = {}
    ops = trace["ops"]
    start = time.perf_counter()
    for op in ops:
        if op[0] == "a":
            live[op[1]] = malloc(op[2], stream)
        else:
            free(live.pop(op[1]))
    elapsed = time.perf_counter() - start
    stats = alloc.stats()
    for ptr in live.values():
        free(ptr)
    alloc.empty_cache()
    leaked = alloc.stats()["reserved_bytes.all.current"]
    peak_alloc = stats["allocated_bytes.all.peak"]
    peak_req = stats["requested_bytes.all.peak"]
    peak_res = stats["reserved_bytes.all.peak"]
    return {
        "name": trace.get("name", "?"),
        "policy": alloc.config.policy,
        "ops": len(ops),
        "peak_requested": peak_req,
        "peak_allocated": peak_alloc,
        "peak_reserved": peak_res,
        "ratio": peak_res / peak_alloc if peak_alloc else 0.0,
        "ratio_requested": peak_res / peak_req if peak_req else 0.0,
        "device_alloc_calls": stats["num_device_alloc"],
        "device_free_calls": stats["num_device_free"],
        "us_per_op": elapsed / len(ops) * 1e6 if ops else 0.0,
        "reserved_after_empty_cache": leaked,
    }


def _pair_cost(malloc, free, nbytes, stream, n, repeats) -> Tuple[float, float]:
    """(wall, thread CPU) µs per malloc+free pair, each the best of ``repeats`` runs;
    ``malloc`` takes ``(nbytes, stream)``, or ``(nbytes)`` when stream is None.

    The CPU-time figure is what the code costs; wall time on a shared machine
    also counts the time other processes held the core."""
    wall = cpu = float("inf")
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.thread_time()
        if stream is None:
            for _ in range(n):
                free(malloc(nbytes))
        else:
            for _ in range(n):
                free(malloc(nbytes, stream))
        wall = min(wall, time.perf_counter() - w0)
        cpu = min(cpu, time.thread_time() - c0)
    return wall / n * 1e6, cpu / n * 1e6


def alloc_free_cost(nbytes: int = MiB, n: int = 20000, repeats: int = 7, device: int = 0) -> Dict[str, float]:
    """Cached ``malloc``+``free`` of ``nbytes`` vs the backend's bare ``mem_alloc``+``mem_free``
    (µs per pair, best of ``repeats`` runs of ``n`` pairs, both in this run).

    ``cached_pair_us``/``bare_pair_us`` are thread CPU time, ``*_wall_us`` wall time."""
    be = _lazy.lazy_init()
    alloc = DeviceCachingAllocator(be, device, _config.AllocConfig())
    stream = be.default_stream(device)
    cached_wall, cached = _pair_cost(alloc.malloc, alloc.free, nbytes, stream, n, repeats)
    alloc.empty_cache()
    prev = be.get_device()
    be.set_device(device)
    try:
        bare_wall, bare = _pair_cost(be.mem_alloc, be.mem_free, nbytes, None, max(n // 4, 1), repeats)
    finally:
        be.set_device(prev)
    return {"nbytes": nbytes, "cached_pair_us": cached, "bare_pair_us": bare,
            "cached_pair_wall_us": cached_wall, "bare_pair_wall_us": bare_wall,
            "speedup_vs_bare": bare / cached if cached else 0.0}


def bench_alloc(traces: Optional[Iterable[str]] = None, *, policies=("accel", "torch"),
                pairs: int = 20000, repeats: int = 5) -> dict:
    """The allocator figures for ``tools/bench.py``.

    Returns ``{"backend", "traces": {name: {policy: replay figures}},
    "alloc_free_1mib": {cached_pair_us, bare_pair_us, speedup_vs_bare}}``.
    """
    be = _lazy.lazy_init()
    out = {"backend": be.name, "simulated": os.environ.get("ACCEL_SIM") == be.name,
           "traces": {}, "alloc_free_1mib": alloc_free_cost(MiB, pairs, repeats)}
    for path in (default_traces() if traces is None else traces):
        trace = load_trace(path)
        out["traces"][trace.get("name", os.path.basename(path))] = {
            policy: replay(trace, _config.AllocConfig(policy=policy)) for policy in policies}
    return out
