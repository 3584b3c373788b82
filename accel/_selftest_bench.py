"""Measurements shared by ``python -m accel.selftest`` and ``tools/bench.py``.

Everything runs on the selected backend (a real device, or the simulator
under ``ACCEL_SIM``).  Timings interleave the measured call and its baseline
round by round and keep the best round, so machine noise hits both alike.
"""

from __future__ import annotations

import time
import timeit
from typing import Callable, Dict, Optional

MiB = 1 << 20


def interleaved_ns(stmts: Dict[str, str], namespace: dict, *, rounds: int, batch_s: float,
                   between: Optional[Callable[[], None]] = None) -> Dict[str, float]:
    """Best ns per execution of each statement over ``rounds`` interleaved rounds.

    Each statement is compiled inline into a timing loop (``timeit``), so an
    accel call and its bare baseline pay the same loop overhead.  The batch
    size per statement is calibrated to about ``batch_s`` seconds; ``between``
    runs untimed after every batch (to drain a stream's queue, say).
    """
    timers = {k: timeit.Timer(stmt, globals=namespace) for k, stmt in stmts.items()}
    numbers = {}
    for key, timer in timers.items():
        timer.timeit(1)          # warm-up: one-time costs (lazy imports, selection) stay out of calibration
        if between:
            between()
        n = 1
        while True:
            t = timer.timeit(n)
            if between:
                between()
            if t >= batch_s / 4 or n >= 1 << 22:
                break
            n *= 4
        numbers[key] = max(1, int(n * batch_s / max(t, 1e-9)))
    best = {k: float("inf") for k in timers}
    for _ in range(rounds):
        for key, timer in timers.items():
            t = timer.timeit(numbers[key])
            if between:
                between()
            best[key] = min(best[key], t / numbers[key] * 1e9)
    return best


def graph_vs_eager(nops: int = 100, nbytes: int = 256, *, rounds: int = 9, batch_s: float = 0.05,
                   device: Optional[int] = None) -> Dict[str, float]:
    """Host time per iteration of ``nops`` small fills issued eagerly vs replayed from a graph.

    Returns µs per iteration with and without the final stream synchronize
    (``graph_us``, ``eager_us``, ``graph_issue_us``, ``eager_issue_us``) and
    ``ratio`` = graph / eager (issue + synchronize).  Checks that a replay
    really performs the fills before timing anything.
    """
    import accel

    s = accel.Stream(device)
    bufs = [accel.Buffer(nbytes, stream=s) for _ in range(nops)]

    def program():
        for i, b in enumerate(bufs):
            b.fill_(i & 0xFF, s)

    program()
    s.synchronize()
    g = accel.Graph()
    with s, g:
        program()
    s.synchronize()

    def replay():
        with s:
            g.replay()

    for b in bufs:
        b.fill_(0xAB, s)
    replay()
    s.synchronize()
    wrong = [i for i, b in enumerate(bufs) if int(b.to_numpy()[0]) != (i & 0xFF)]
    if wrong:
        raise AssertionError(f"graph replay did not perform fills {wrong[:5]}")

    ns = {"program": program, "replay": replay, "s": s}
    stmts = {"eager": "program(); s.synchronize()", "graph": "replay(); s.synchronize()",
             "eager_issue": "program()", "graph_issue": "replay()"}
    best = interleaved_ns(stmts, ns, rounds=rounds, batch_s=batch_s, between=s.synchronize)
    out = {f"{k}_us": v / 1e3 for k, v in best.items()}
    out.update(nops=nops, nbytes=nbytes, ratio=best["graph"] / best["eager"],
               ratio_issue=best["graph_issue"] / best["eager_issue"])
    g.reset()
    for b in bufs:
        b.close()
    s.close()
    return out


def _timed_ms(stream, fn: Callable[[], None], reps: int) -> float:
    """Milliseconds for ``reps`` calls of ``fn`` on ``stream``, by timing events where the
    backend has them (device time), else host time around a synchronize."""
    import accel

    try:
        start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
        start.record(stream)
        for _ in range(reps):
            fn()
        end.record(stream)
        end.synchronize()
        ms = start.elapsed_time(end)
        if ms > 0:
            return ms
    except (NotImplementedError, accel.AcceleratorError):
        pass
    stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    stream.synchronize()
    return (time.perf_counter() - t0) * 1e3


def rng_vs_bandwidth(nbytes: int, *, reps: int = 5, rounds: int = 3, device: Optional[int] = None) -> dict:
    """Device RNG fill throughput against the memory bandwidth of the same device.

    Bandwidth is estimated from a device-to-device copy of ``nbytes``
    (counted as read + write, as bandwidth tests do) and from a memset (write
    only, like an RNG fill).  Returns GB/s figures (best of ``rounds``) and
    ratios of the Philox fills to them.
    """
    import accel
    import accel.random as R

    s = accel.Stream(device)
    a, b = accel.Buffer(nbytes, stream=s), accel.Buffer(nbytes, stream=s)
    a.fill_(1, s)
    b.fill_(2, s)
    runs = {
        "copy": (lambda: b.copy_from(a, s, non_blocking=True), 2 * nbytes),
        "memset": (lambda: a.fill_(7, s), nbytes),
        "rng_raw_u32": (lambda: R.random_raw_(a), nbytes),
        "rng_uniform_f32": (lambda: R.uniform_(a), nbytes),
    }
    best = {k: float("inf") for k in runs}
    with s:                                    # fills run on the current stream
        for fn, _ in runs.values():            # warm-up: kernel load, JIT, first-touch
            fn()
        s.synchronize()
        for _ in range(rounds):
            for key, (fn, _) in runs.items():
                best[key] = min(best[key], _timed_ms(s, fn, reps))
    gbps = {k: runs[k][1] * reps / (best[k] / 1e3) / 1e9 for k in runs}
    a.close()
    b.close()
    s.close()
    out = {f"{k}_gbps": round(v, 3) for k, v in gbps.items()}
    out.update(nbytes=nbytes, reps=reps,
               rng_raw_vs_copy=round(gbps["rng_raw_u32"] / gbps["copy"], 3),
               rng_raw_vs_memset=round(gbps["rng_raw_u32"] / gbps["memset"], 3),
               rng_uniform_vs_memset=round(gbps["rng_uniform_f32"] / gbps["memset"], 3))
    return out
