"""Host Philox throughput against numpy's C Philox, measured in the same run.

``bench_philox(seconds=2.0) -> dict`` (called by tools/bench.py) times
:func:`accel.random.philox.raw_words` (uint32 words; default threads and one
thread) against ``numpy.random.Philox().random_raw`` (uint64 words, same
bytes) and ``numpy.random.Generator(numpy.random.Philox()).integers(0, 2**32,
dtype=uint32)``, interleaving the runs so machine noise hits all of them, and
reports GB/s (best of the runs) and ratios.  Run ``python -m accel.random._bench``
to print it.  numpy's Philox is Philox4x64-10 in C; ours is Philox4x32-10 in
numpy ufuncs (the same design torch and cuRAND use on devices).
"""

from __future__ import annotations

import time
from typing import Dict

TARGET_RATIO = 0.5


def bench_philox(seconds: float = 2.0, n_words: int = 1 << 22) -> Dict[str, object]:
    """Measure for about ``seconds``; return GB/s figures and ratios (see module doc)."""
    import numpy as np

    from . import philox

    nbytes = 4 * n_words
    bitgen = np.random.Philox(12345)
    gen = np.random.Generator(np.random.Philox(12345))
    threads = philox._threads()
    runs = {
        "accel": lambda: philox.raw_words(1, 0, n_words),
        "accel_1thread": lambda: philox.raw_words(1, 0, n_words, threads=1),
        "numpy_random_raw": lambda: bitgen.random_raw(n_words // 2),
        "numpy_integers": lambda: gen.integers(0, 1 << 32, size=n_words, dtype=np.uint32),
    }
    best = {k: float("inf") for k in runs}
    for fn in runs.values():   # warm up: workspaces, thread pool, page cache
        fn()
    deadline = time.perf_counter() + max(0.0, seconds)
    rounds = 0
    while rounds < 3 or time.perf_counter() < deadline:
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
        rounds += 1
    gbps = {k: nbytes / v / 1e9 for k, v in best.items()}
    result: Dict[str, object] = {f"{k}_gbps": round(v, 4) for k, v in gbps.items()}
    for ours in ("accel", "accel_1thread"):
        for theirs in ("numpy_random_raw", "numpy_integers"):
            result[f"ratio_{ours}_vs_{theirs}"] = round(gbps[ours] / gbps[theirs], 3)
    result.update({
        "n_words": n_words, "rounds": rounds, "threads": threads, "target_ratio": TARGET_RATIO,
        # the stricter comparison: numpy's raw C generator, no conversion to uint32
        "meets_target": gbps["accel"] / gbps["numpy_random_raw"] >= TARGET_RATIO,
    })
    return result


def format_result(r: Dict[str, object]) -> str:
    return (f"host Philox (uint32, {r['n_words']} words, best of {r['rounds']}): "
            f"accel {r['accel_gbps']:.3f} GB/s ({r['threads']} threads), "
            f"{r['accel_1thread_gbps']:.3f} GB/s (1 thread); "
            f"numpy Philox random_raw {r['numpy_random_raw_gbps']:.3f} GB/s, "
            f"integers(uint32) {r['numpy_integers_gbps']:.3f} GB/s\n"
            f"ratio vs random_raw {r['ratio_accel_vs_numpy_random_raw']:.2f}x "
            f"(1 thread {r['ratio_accel_1thread_vs_numpy_random_raw']:.2f}x), "
            f"vs integers {r['ratio_accel_vs_numpy_integers']:.2f}x "
            f"(1 thread {r['ratio_accel_1thread_vs_numpy_integers']:.2f}x); "
            f"target >= {r['target_ratio']}x: {'met' if r['meets_target'] else 'NOT met'}")


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="host Philox throughput vs numpy")
    ap.add_argument("--seconds", type=float, default=3.0)
    print(format_result(bench_philox(ap.parse_args().seconds)))
