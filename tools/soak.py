#!/usr/bin/env python3
"""Soak: create and destroy Streams, Events and Buffers many times; watch time and resources.

    python tools/soak.py                        # 50,000 cycles on the CUDA simulator
    python tools/soak.py --sim xpu --cycles 20000 --every 1000 --json out.json

One cycle makes a Stream on one device (alternating, so half the work is on a device that is
not current), a Buffer allocated on it, fills it, records an Event and makes the default stream
wait for it, and every tenth cycle stages a non-blocking host copy through pinned memory.  The
objects then go away three ways in turn: ``close()``, the last reference dropped, and a
reference cycle left to the garbage collector.  Every ``--every`` cycles a line gives the time
of that block, RSS, threads, open fds and the structural counts that must stay flat (the
simulator's live streams/events/allocations, the allocator's per-stream free lists, blocks,
pending events and event cache, the pinned allocator's blocks, pending finalizer releases).
The summary compares the time of the first and last blocks (the fastest of up to five at each
end, since other processes only add time; target: within 1.5x) and RSS.  Exit status 1 when
the end is more than 1.5x slower than the start, or a count grew
(fds, threads: at all; the others: by more than SLACK).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import accel  # noqa: E402  (the repository's accel when run from a checkout)
from accel import _finalize  # noqa: E402

TARGET_RATIO = 1.5


class _Cycle:
    __slots__ = ("objs", "me")

    def __init__(self, *objs):
        self.objs = objs
        self.me = self


_PAYLOAD = bytes(range(256)) * 4


def cycle(i: int, devices: int) -> None:
    """One create/use/destroy cycle (see the module docstring)."""
    d = i % devices
    s = accel.Stream(d)
    b = accel.Buffer(1024 + 512 * (i % 5), device=d, stream=s)
    b.fill_(i & 255, stream=s)
    e = accel.Event()
    e.record(s)
    accel.default_stream(d).wait_event(e)
    if i % 10 == 0:
        h = accel.Buffer(1024, device=d, stream=s)
        h.copy_from(_PAYLOAD, stream=s, non_blocking=True)
        h.close()
    way = i % 3
    if way == 0:
        b.close()
        e.close()
        s.close()
    elif way == 2:
        _Cycle(b, e, s)
    del b, e, s


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def counts() -> dict:
    """The structural counts that must not grow with the number of cycles."""
    from accel import memory
    out = {"threads": threading.active_count(), "fds": fd_count(), "pending_releases": len(_finalize.pending)}
    for index, alloc in sorted(memory._allocators.items()):
        out[f"dev{index}_stream_lists"] = len(alloc._general)
        out[f"dev{index}_blocks"] = len(alloc._blocks)
        out[f"dev{index}_pending_events"] = len(alloc._pending_events)
        out[f"dev{index}_used_on"] = len(alloc._used_on)
        out[f"dev{index}_cached_events"] = sum(len(v) for v in alloc._event_cache.values())
    host = memory._host
    if host is not None:
        out["pinned_blocks"] = len(host._blocks)
        out["pinned_used_on"] = len(host._used_on)
        out["pinned_events"] = len(host._events)
    out.update(_sim_counts())
    return out


def _sim_counts() -> dict:
    be = accel._lazy.ready
    if be is None or not os.environ.get("ACCEL_SIM"):
        return {}
    from accel import sim
    st = sim.state()
    kind = be.name
    if kind == "cuda":
        return {"sim_streams": st.streams, "sim_events": st.events,
                "sim_allocations": sum(st.live_allocations.values()), "sim_host_allocations": st.host_allocations}
    if kind == "xpu":
        return {k: v for k, v in vars(st).items() if k.startswith("ze_live_")}
    from accel.sim import metal
    return {f"metal_{k}": v for k, v in metal.state().live_counts().items()}


#: A count may wander this much (events pending vs cached, say) without growing.
SLACK = 16


def grown_counts(first: dict, last: dict) -> dict:
    """{name: (first, last)} for the counts that grew by more than :data:`SLACK` (a leak of
    one object per cycle grows by a whole block); fds and threads by any amount."""
    out = {}
    for k, v in last.items():
        before = first.get(k, 0)
        if v > before + (0 if k in ("fds", "threads") else SLACK):
            out[k] = (before, v)
    return out


def settle() -> None:
    """Collect cycles, run deferred releases, let queued work finish."""
    gc.collect()
    _finalize.drain()
    for d in range(accel.device_count()):
        accel.synchronize(d)


def _top_functions(profile, count: int = 12) -> str:
    """The ``count`` functions of a cProfile run with the most time of their own."""
    import io
    import pstats
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(count)
    return "\n".join(line for line in text.getvalue().splitlines() if line.strip())


def soak(cycles: int, every: int, out=None, profile: bool = False) -> dict:
    """Run ``cycles`` cycles; returns {"blocks": [(seconds, rss, counts)], ...} and prints a
    line per block to ``out`` when given.  ``profile``: run each block under cProfile and
    return the top functions of the first and last blocks as "profiles" (where a slowdown
    comes from; the profiler adds its own time to every call)."""
    devices = accel.device_count()
    for i in range(every):          # warm-up: lazy state, caches, worker threads
        cycle(i, devices)
    settle()
    blocks = []
    profiles = []
    i = 0
    while i < cycles:
        prof = None
        if profile:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        t0 = time.perf_counter()
        for _ in range(every):
            cycle(i, devices)
            i += 1
        elapsed = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
            if not profiles or i >= cycles:
                profiles.append(f"block ending at cycle {i}:\n{_top_functions(prof)}")
        settle()
        row = (elapsed, rss_bytes(), counts())
        blocks.append(row)
        if out is not None:
            c = row[2]
            print(f"{i:>7} cycles  {elapsed * 1e3:8.1f} ms/{every}  rss {row[1] / 2**20:7.1f} MiB  "
                  + "  ".join(f"{k}={v}" for k, v in c.items()), file=out, flush=True)
    return {"blocks": blocks, "profiles": profiles}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sim", default=None, help="simulator (cuda, xpu, mps); default: ACCEL_SIM or cuda "
                        "unless ACCEL_BACKEND names real hardware")
    parser.add_argument("--cycles", type=int, default=50_000)
    parser.add_argument("--every", type=int, default=1_000)
    parser.add_argument("--json", metavar="PATH", help="also write the blocks (seconds, rss, counts) as JSON")
    parser.add_argument("--profile", action="store_true",
                        help="profile each block; print the top functions of the first and last")
    args = parser.parse_args(argv)
    if args.cycles < args.every or args.every < 1:
        parser.error(f"--cycles ({args.cycles}) must be at least --every ({args.every}), which must be >= 1")
    if args.sim:
        os.environ["ACCEL_SIM"] = args.sim
    elif not os.environ.get("ACCEL_SIM") and not os.environ.get("ACCEL_BACKEND"):
        os.environ["ACCEL_SIM"] = "cuda"
    accel._lazy.lazy_init()
    print(f"soak: {args.cycles} cycles on {accel.current_accelerator()} "
          f"({os.environ.get('ACCEL_SIM', 'hardware')}), {accel.device_count()} device(s)")
    result = soak(args.cycles, args.every, sys.stdout, profile=args.profile)
    blocks = result["blocks"]
    for text in result["profiles"]:
        print(text)
    if args.json:
        import json
        with open(args.json, "w") as fh:
            json.dump({"every": args.every, "devices": accel.device_count(),
                       "blocks": [{"seconds": t, "rss": r, "counts": c} for t, r, c in blocks]}, fh)
    first, last = blocks[0], blocks[-1]
    # Other processes only ever add time: the fastest of a few blocks is the soak's own cost.
    k = max(1, min(5, len(blocks) // 4))
    start = min(b[0] for b in blocks[:k])
    end = min(b[0] for b in blocks[-k:])
    ratio = end / start
    grown = grown_counts(first[2], last[2])
    print(f"ms per {args.every} cycles, fastest of the first {k} blocks: {start * 1e3:.1f}, of the last {k}: "
          f"{end * 1e3:.1f} (ratio {ratio:.2f}, target <= {TARGET_RATIO}; single blocks first "
          f"{first[0] * 1e3:.1f}, last {last[0] * 1e3:.1f}); "
          f"rss {first[1] / 2**20:.1f} -> {last[1] / 2**20:.1f} MiB "
          f"(max {max(b[1] for b in blocks) / 2**20:.1f}); counts grown: {grown or 'none'}")
    return 0 if ratio <= TARGET_RATIO and not grown else 1


if __name__ == "__main__":
    sys.exit(main())
