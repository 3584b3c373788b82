#!/usr/bin/env python3
"""Replay allocation traces through accel's caching allocator.

    python tools/replay_trace.py                       # the shared traces, both policies
    python tools/replay_trace.py TRACE.json --policy accel
    python tools/replay_trace.py --conf max_split_size_mb:64 --json

Runs on the simulator (ACCEL_SIM=cuda) unless ACCEL_SIM/ACCEL_BACKEND say
otherwise, and prints per trace and policy: ops, peak requested / allocated /
reserved bytes, reserved/allocated and reserved/requested ratios, backend
segment allocations, and µs per op.  ``--pairs N`` also times cached 1 MiB
malloc+free against the bare backend pair.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _progress import Progress  # noqa: E402  (tools/ is on sys.path when run as a script)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="*", help="trace files (default: the shared traces)")
    parser.add_argument("--policy", choices=("accel", "torch", "both"), default="both")
    parser.add_argument("--conf", default="", help="extra ACCEL_ALLOC_CONF options for the replay")
    parser.add_argument("--pairs", type=int, default=0, help="also time N cached 1 MiB alloc+free pairs")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)

    if not (os.environ.get("ACCEL_SIM") or os.environ.get("ACCEL_BACKEND")):
        os.environ["ACCEL_SIM"] = "cuda"
    from accel.memory import _bench, _config

    paths = args.traces or _bench.default_traces()
    if not paths:
        parser.error("no traces given and none found (set ACCEL_TRACES to the traces folder)")
    policies = ("accel", "torch") if args.policy == "both" else (args.policy,)
    progress = Progress()
    results = []
    steps = len(paths) * len(policies) + (1 if args.pairs else 0)
    for path in paths:
        trace = _bench.load_trace(path)
        for policy in policies:
            progress.update(f"[{len(results) + 1}/{steps}] replaying {os.path.basename(path)} "
                            f"({len(trace['ops'])} ops, {policy} policy)")
            conf = ",".join(filter(None, (f"policy:{policy}", args.conf)))
            results.append(_bench.replay(trace, _config.parse(conf, "--conf")))
    if args.pairs:
        progress.update(f"[{steps}/{steps}] timing {args.pairs} cached 1 MiB alloc+free pairs")
    cost = _bench.alloc_free_cost(n=args.pairs) if args.pairs else None
    progress.clear()

    if args.json:
        print(json.dumps({"replays": results, "alloc_free_1mib": cost}, indent=2))
        return 0
    mib = 1 << 20
    print(f"{'trace':<18}{'policy':<8}{'ops':>7}{'peak req MiB':>14}{'peak alloc MiB':>16}"
          f"{'peak resv MiB':>15}{'resv/alloc':>12}{'resv/req':>10}{'dev allocs':>12}{'us/op':>8}")
    for r in results:
        print(f"{r['name']:<18}{r['policy']:<8}{r['ops']:>7}{r['peak_requested'] / mib:>14.2f}"
              f"{r['peak_allocated'] / mib:>16.2f}{r['peak_reserved'] / mib:>15.2f}{r['ratio']:>12.3f}"
              f"{r['ratio_requested']:>10.3f}{r['device_alloc_calls']:>12}{r['us_per_op']:>8.2f}")
    if cost:
        print(f"\ncached 1 MiB malloc+free: {cost['cached_pair_us']:.2f} us/pair CPU "
              f"({cost['cached_pair_wall_us']:.2f} wall); bare backend mem_alloc+mem_free: "
              f"{cost['bare_pair_us']:.2f} us/pair CPU ({cost['bare_pair_wall_us']:.2f} wall); "
              f"cached/bare = {1 / cost['speedup_vs_bare']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
