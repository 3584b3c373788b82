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
from .._errors import OutOfMemoryError
from . import _config
from ._async import create_allocator
from ._caching import DeviceCachingAllocator

MiB = 1 << 20
#: The traces of ../shared/traces, also copied into tests/test_memory_traces for a clean clone.
SHARED_TRACES = ("cnn_train.json", "gpt_small_train.json")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TRACES_DIR = os.path.join(_REPO, "tests", "test_memory_traces")     # the committed traces


def default_traces() -> List[str]:
    """The allocation traces: ``$ACCEL_TRACES``, else ``../shared/traces`` next to the
    repository, else the copy kept in ``tests/test_memory_traces`` (for a clean clone)."""
    env = os.environ.get("ACCEL_TRACES")
    folders = [env] if env else [os.path.join(os.path.dirname(_REPO), "shared", "traces"), _TRACES_DIR]
    for folder in folders:
        found = sorted(glob.glob(os.path.join(folder, "*.json")))
        if folder.endswith("test_memory_traces"):
            # The copy sits beside the recorded corpus (``--corpus``): keep the shared two.
            found = [f for f in found if os.path.basename(f) in SHARED_TRACES]
        if found:
            return found
    return []


def load_trace(path: str) -> dict:
    """The trace in ``path`` (JSON ``{"name", "ops": [["a", id, nbytes] | ["f", id]]}``),
    every op checked: ValueError naming the first bad one (an id freed that is not live,
    allocated while live, a size that is no int >= 0).  A pickle is read as a memory snapshot
    (:func:`trace_from_snapshot`); like torch's memory_viz, load only snapshots you trust."""
    with open(path, "rb") as fh:
        head = fh.read(1)
        fh.seek(0)
        if head == b"\x80":        # pickle protocol 2+
            import pickle
            trace = trace_from_snapshot(pickle.load(fh), path)
        else:
            trace = json.loads(fh.read().decode())
    if not isinstance(trace, dict) or not isinstance(trace.get("ops"), list):
        raise ValueError(f"{path}: not a trace (expected {{'name', 'ops': [['a', id, nbytes] | ['f', id]]}})")
    live = set()
    for i, op in enumerate(trace["ops"]):
        kind = op[0] if isinstance(op, list) and op else None
        if kind == "a" and len(op) == 3:
            if type(op[2]) is not int or op[2] < 0:
                raise ValueError(f"{path}: op {i} {op!r}: nbytes must be an int >= 0")
            if op[1] in live:
                raise ValueError(f"{path}: op {i} {op!r} allocates id {op[1]!r}, which is live (not freed since)")
            live.add(op[1])
        elif kind == "f" and len(op) == 2:
            if op[1] not in live:
                raise ValueError(f"{path}: op {i} {op!r} frees id {op[1]!r}, which is not live")
            live.discard(op[1])
        else:
            raise ValueError(f"{path}: op {i} {op!r}: expected ['a', id, nbytes] or ['f', id]")
    return trace


def trace_from_snapshot(snapshot, path: str) -> dict:
    """A trace from a memory snapshot with history (what torch's and accel's
    ``memory._dump_snapshot`` pickle after ``_record_memory_history()``: ``device_traces``, a
    list per device of ``{"action", "addr", "size", ...}``), for the first device that has
    allocations: each ``alloc`` a new id, each ``free_requested`` (``free_completed`` in a
    history that has none) frees the block at its address.  A free of a block allocated before
    the recording began (torch keeps the last ``max_entries``) is skipped."""
    traces = snapshot.get("device_traces") if isinstance(snapshot, dict) else None
    if not isinstance(traces, list):
        raise ValueError(f"{path}: a pickle, but no memory snapshot with history (no 'device_traces'; "
                         f"record with memory._record_memory_history() before memory._dump_snapshot())")
    entries = next((t for t in traces if any(e.get("action") == "alloc" for e in t)), [])
    free = "free_requested" if any(e.get("action") == "free_requested" for e in entries) else "free_completed"
    ops, ids = [], {}
    for e in entries:
        action = e.get("action")
        if action == "alloc":
            ids[e["addr"]] = n = len(ops)       # a new id each time (the op's index)
            ops.append(["a", n, int(e["size"])])
        elif action == free and e.get("addr") in ids:
            ops.append(["f", ids.pop(e["addr"])])
    name = os.path.splitext(os.path.basename(path))[0]
    return {"name": name, "source": f"memory snapshot {os.path.basename(path)}", "ops": ops}


PAGE = 2 * MiB

#: keys of the allocator's ``map_stats()`` (or ``stats()``) read for the map/unmap columns:
#: 0 while the allocator has no expandable segments (classic segments map nothing).
MAP_STAT, UNMAP_STAT = "num_device_map", "num_device_unmap"


def corpus_traces() -> List[str]:
    """Every trace kept in ``tests/test_memory_traces`` (the recorded corpus plus the
    copy of the shared two), sorted by file name."""
    return sorted(glob.glob(os.path.join(_TRACES_DIR, "*.json")))


def holdout_traces() -> List[str]:
    """The held-out traces in ``tests/test_memory_traces/holdout`` (recorded after the
    policy was tuned; ``tools/holdout_workloads.py``), sorted by file name."""
    return sorted(glob.glob(os.path.join(_TRACES_DIR, "holdout", "*.json")))


def peak_live(ops) -> int:
    """The peak over time of the sum of live request sizes (``nbytes`` of the ``a`` ops
    not yet freed), as the trace asks for them: no rounding, no allocator."""
    live: Dict[int, int] = {}
    cur = peak = 0
    for op in ops:
        if op[0] == "a":
            live[op[1]] = op[2]
            cur += op[2]
            if cur > peak:
                peak = cur
        else:
            cur -= live.pop(op[1])
    return peak


def physical_floor(ops, page: int = PAGE) -> int:
    """The 2 MiB physical floor: :func:`peak_live` rounded up to a multiple of ``page``.
    No allocator that maps whole pages can hold the trace's peak in less."""
    return -(-peak_live(ops) // page) * page


class _TimedBackend:
    """The backend as the allocator sees it, adding up the seconds spent in its calls
    (cudaMalloc/cudaFree, cuMemCreate/Map/Unmap/Release, synchronizes...), so a replay
    can tell the allocator's own time from the driver's (or the simulator's)."""

    def __init__(self, backend):
        self._backend = backend
        self.seconds = 0.0
        self.calls = 0

    @property
    def overhead_seconds(self) -> float:
        """The time the timing itself added outside the timed spans of the calls so far
        (an extra frame, the clock reads): part of the elapsed time, not the allocator's."""
        return self.calls * _timing_overhead()

    def __getattr__(self, name):
        value = getattr(self._backend, name)
        if not callable(value) or name.startswith("__"):
            return value

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return value(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
        self.__dict__[name] = timed      # wrapped once: later lookups skip __getattr__
        return timed


_OVERHEAD: List[float] = []


def _timing_overhead(n: int = 20000) -> float:
    """Seconds per call that :class:`_TimedBackend` adds outside its timed span, measured
    once per process on a no-op method (best of 5, less the bare loop)."""
    if not _OVERHEAD:
        class _Noop:
            def noop(self):
                return None
        best = float("inf")
        for _ in range(5):
            tb = _TimedBackend(_Noop())
            call = tb.noop
            direct = _Noop().noop
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            t1 = time.perf_counter()
            for _ in range(n):
                direct()
            t2 = time.perf_counter()
            # per call, wrapped loop = loop + (frame + clocks outside) + timed span; direct loop =
            # loop + call; so (wrapped - direct - timed spans) / n is what the wrapper adds to the
            # allocator's share (its frame and clock reads, less the plain call it replaces)
            best = min(best, ((t1 - t0) - (t2 - t1) - tb.seconds) / n)
        _OVERHEAD.append(max(best, 0.0))
    return _OVERHEAD[0]


def _replay_once(be, trace: dict, config: _config.AllocConfig, device: int):
    """One replay through a fresh allocator: ``(stats at the end, seconds for the ops,
    error)``; ``error`` is the OutOfMemoryError that stopped it, or None.  Every block
    still live is freed and the cache emptied on every path.  ``stats["_backend_seconds"]``
    is the part of the seconds spent inside backend calls."""
    be = _TimedBackend(be)
    alloc = create_allocator(be, device, config)     # backend:cudaMallocAsync too
    stream = be.default_stream(device)
    malloc, free = alloc.malloc, alloc.free
    live = {}
    error = None
    start = time.perf_counter()
    try:
        for op in trace["ops"]:
            if op[0] == "a":
                live[op[1]] = malloc(op[2], stream)
            else:
                free(live.pop(op[1]))
    except OutOfMemoryError as exc:
        error = exc
    elapsed = time.perf_counter() - start
    backend_seconds = be.seconds + be.overhead_seconds    # the timing's own cost is no allocator's
    try:
        stats = alloc.stats()
    finally:
        try:
            for ptr in live.values():
                free(ptr)
        finally:
            alloc.empty_cache()
    stats = dict(stats)
    # map/unmap calls: accel's own keys, kept out of stats() (torch's keys only)
    map_stats = getattr(alloc, "map_stats", None)
    if map_stats is not None:
        stats.update(map_stats())
    stats["_reserved_after_empty_cache"] = alloc.stats()["reserved_bytes.all.current"]
    stats["_backend_seconds"] = backend_seconds
    return stats, elapsed, error


def _with_cap(config: _config.AllocConfig, cap: int, total: int) -> _config.AllocConfig:
    return config._replace(per_process_memory_fraction=cap / total)


def min_capacity(trace: dict, config: Optional[_config.AllocConfig] = None, device: int = 0,
                 precision: float = 0.005, hi: Optional[int] = None) -> Dict[str, float]:
    """The smallest per-process cap (bytes) under which ``trace`` replays without
    OutOfMemoryError, found by bisection to ``precision`` x peak live bytes.

    The cap is the allocator's own ``per_process_memory_fraction`` (reserved bytes
    plus a new segment may not pass ``fraction x total device memory``; past it the
    allocator frees its cache and retries, then raises), so the search sets
    ``fraction = cap / total``.  It runs between peak live bytes (nothing can do with
    less: allocated >= requested) and ``hi`` (default: the uncapped peak reserved,
    raised by 2 % steps until a replay passes).  The search assumes success is
    monotone in the cap; the returned cap itself replayed without error.  Returns ``{"min_capacity" (bytes),
    "min_capacity_ratio" (over peak live), "bisect_replays"}``."""
    be = _lazy.lazy_init()
    config = config or _config.AllocConfig()
    with_device = be.get_device()
    be.set_device(device)
    try:
        total = be.mem_info()[1]
    finally:
        be.set_device(with_device)
    need = peak_live(trace["ops"])
    if hi is None:
        stats, _, error = _replay_once(be, trace, config, device)
        if error is not None:
            raise error
        hi = stats["reserved_bytes.all.peak"]
    if hi >= total:
        raise ValueError(f"trace {trace.get('name')!r} needs {hi} bytes uncapped, more than the device's "
                         f"{total}: run on a larger (simulated) device, e.g. ACCEL_SIM_MEMORY=64G")
    replays = 0
    lo = need - 1                   # fails: the peak live bytes alone exceed it
    step = max(1, int(need * precision))
    # The uncapped peak usually passes, but not always: the simulator's addresses differ
    # between replays and best fit breaks size ties by address, so a replay can take other
    # (worse) choices.  Raise the upper end until a replay passes.
    while True:
        _, _, error = _replay_once(be, trace, _with_cap(config, hi, total), device)
        replays += 1
        if error is None:
            break
        lo = hi
        hi += max(step, hi // 50)
        if hi >= total:
            raise error
    while hi - lo > step:
        mid = (lo + hi) // 2
        _, _, error = _replay_once(be, trace, _with_cap(config, mid, total), device)
        replays += 1
        if error is None:
            hi = mid
        else:
            lo = mid
    return {"min_capacity": hi, "min_capacity_ratio": hi / need if need else 0.0, "bisect_replays": replays}


def replay(trace: dict, config: Optional[_config.AllocConfig] = None, device: int = 0,
           rounds: int = 1, capacity: bool = False) -> Dict[str, float]:
    """Replay one trace through a fresh allocator; returns its figures.

    ``ratio`` is peak reserved / peak allocated (allocated = block sizes, as
    torch's ``allocated_bytes``); ``ratio_requested`` divides by the peak of
    the bytes the program asked for, the stricter measure.  ``floor`` is the
    2 MiB physical floor (:func:`physical_floor`) and ``floor_ratio`` it over
    peak live bytes.  ``us_per_op`` is the median over ``rounds`` replays (each a
    fresh allocator), ``us_per_op_min``/``_max`` the spread, ``allocator_us_per_op`` the
    median of the same time less the time spent inside backend calls (the driver's, or
    the simulator's, share: device allocations, maps, synchronizes); the memory figures are
    the round with the highest peak reserved (best fit breaks size ties by address,
    and addresses differ between replays, so rounds can differ slightly).  ``map_calls`` and
    ``unmap_calls`` are the allocator's backend map/unmap counts (0 for classic
    segments).  With ``capacity``, also :func:`min_capacity`'s figures.
    """
    be = _lazy.lazy_init()
    config = config or _config.AllocConfig()
    ops = trace["ops"]
    times = []
    own = []
    stats = None
    for _ in range(max(1, rounds)):
        got, elapsed, error = _replay_once(be, trace, config, device)
        if error is not None:
            raise error
        times.append(elapsed / len(ops) * 1e6 if ops else 0.0)
        own.append((elapsed - got["_backend_seconds"]) / len(ops) * 1e6 if ops else 0.0)
        # the round with the highest peak reserved: best fit breaks size ties by address,
        # and the simulator's addresses differ between replays
        if stats is None or got["reserved_bytes.all.peak"] > stats["reserved_bytes.all.peak"]:
            stats = got
    times.sort()
    own.sort()
    need = peak_live(ops)
    floor = physical_floor(ops)
    peak_alloc = stats["allocated_bytes.all.peak"]
    peak_req = stats["requested_bytes.all.peak"]
    peak_res = stats["reserved_bytes.all.peak"]
    out = {
        "name": trace.get("name", "?"),
        "policy": config.policy,
        "ops": len(ops),
        "peak_live": need,
        "peak_requested": peak_req,
        "peak_allocated": peak_alloc,
        "peak_reserved": peak_res,
        "floor": floor,
        "floor_ratio": floor / need if need else 0.0,
        "ratio": peak_res / peak_alloc if peak_alloc else 0.0,
        "ratio_requested": peak_res / peak_req if peak_req else 0.0,
        "device_alloc_calls": stats["num_device_alloc"],
        "device_free_calls": stats["num_device_free"],
        "map_calls": stats.get(MAP_STAT, 0),
        "unmap_calls": stats.get(UNMAP_STAT, 0),
        "us_per_op": times[len(times) // 2],
        "us_per_op_min": times[0],
        "us_per_op_max": times[-1],
        "allocator_us_per_op": own[len(own) // 2],
        "rounds": len(times),
        "reserved_after_empty_cache": stats["_reserved_after_empty_cache"],
    }
    if capacity:
        out.update(min_capacity(trace, config, device, hi=peak_res))
    return out


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


def repeat_trace(trace: dict, passes: int) -> dict:
    """``trace`` replayed ``passes`` times back to back, as one trace for one allocator: each
    pass gets its own allocation ids, and what a pass left live is freed before the next
    (a long job repeats its steps; the first pass alone hides whether a policy's footprint
    creeps once the cache holds memory laid out for earlier requests)."""
    if type(passes) is not int or passes < 1:
        raise ValueError(f"passes={passes!r}: need an int of at least 1")
    if passes == 1:
        return trace
    ops: List[list] = []
    base = 0
    for _ in range(passes):
        live = set()
        top = -1
        for op in trace["ops"]:
            key = base + op[1]
            top = max(top, op[1])
            if op[0] == "a":
                ops.append(["a", key, op[2]])
                live.add(key)
            else:
                ops.append(["f", key])
                live.discard(key)
        ops += [["f", key] for key in sorted(live)]
        base += top + 1
    return dict(trace, ops=ops, passes=passes)


def perturb_trace(trace: dict, seed: int, jitter: float = 0.03, per_size: bool = True) -> dict:
    """``trace`` with its request sizes scaled (seed 0: the trace itself).

    ``per_size``: every distinct size gets its own factor in ``[1 - jitter, 1 + jitter]``
    (equal sizes stay equal, the order and every lifetime stay); otherwise one factor
    scales every size (another batch size).  Why: a placement rule tuned on recorded traces
    can owe its figure to the exact sizes (a hole that happens to fit the next request);
    the spread over perturbed copies shows what a trace not seen before gets."""
    if type(seed) is not int or seed < 0:
        raise ValueError(f"seed={seed!r}: need an int >= 0")
    if not 0 <= jitter < 1:
        raise ValueError(f"jitter={jitter!r}: need 0 <= jitter < 1")
    if seed == 0:
        return trace
    import random
    rnd = random.Random(seed)
    factors: Dict[int, float] = {}
    ops = []
    for op in trace["ops"]:
        if op[0] == "a":
            key = op[2] if per_size else 0
            k = factors.get(key)
            if k is None:
                k = factors[key] = rnd.uniform(1 - jitter, 1 + jitter)
            ops.append(["a", op[1], max(1, int(op[2] * k))])
        else:
            ops.append(list(op))
    return dict(trace, ops=ops, seed=seed)


def summarize(results: List[dict]) -> dict:
    """Peak reserved over peak live bytes across ``results`` (replays of one variant): mean,
    median, worst, how many are over 1.08 and 1.15, and the most map calls."""
    ratios = sorted(r["peak_reserved"] / r["peak_live"] for r in results if r["peak_live"])
    n = len(ratios)
    return {"replays": n, "mean": sum(ratios) / n if n else 0.0,
            "median": (ratios[(n - 1) // 2] + ratios[n // 2]) / 2 if n else 0.0,
            "worst": ratios[-1] if n else 0.0,
            "over_1.08": sum(x > 1.08 for x in ratios), "over_1.15": sum(x > 1.15 for x in ratios),
            "max_map_calls": max((r["map_calls"] for r in results), default=0)}


def many_live_trace(n: int, seed: int = 0) -> dict:
    """A synthetic trace that keeps about ``n`` blocks live: ``n`` small requests (512 B to
    300 KB), every other one freed, ``n // 10`` requests of 0.7-2.5 MiB into the holes and
    past them, then everything freed.  Each miss past the high-water mark happens with
    thousands of blocks cached, so a miss path that scans every block shows up as µs/op
    growing with ``n``."""
    import random
    rng = random.Random(seed)
    ops: List[list] = [["a", i, rng.choice((512, 4096, 65536, 300000))] for i in range(n)]
    ops += [["f", i] for i in range(0, n, 2)]
    ops += [["a", n + i, rng.choice((700000, 3 * MiB // 2, 5 * MiB // 2))] for i in range(n // 10)]
    ops += [["f", i] for i in range(1, n, 2)] + [["f", n + i] for i in range(n // 10)]
    return {"name": f"many_live_{n}", "ops": ops}


def scaling_cost(small: int = 2000, large: int = 20000,
                 config: Optional[_config.AllocConfig] = None, rounds: int = 3) -> Dict[str, float]:
    """µs/op (median of ``rounds`` replays) of :func:`many_live_trace` with ``small`` and
    ``large`` live blocks, and their ratio (about 1 when no allocator path is linear in the
    number of blocks)."""
    lo = replay(many_live_trace(small), config, rounds=rounds)["us_per_op"]
    hi = replay(many_live_trace(large), config, rounds=rounds)["us_per_op"]
    return {"small": small, "large": large, "small_us_per_op": lo, "large_us_per_op": hi,
            "ratio": hi / lo if lo else 0.0}


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
