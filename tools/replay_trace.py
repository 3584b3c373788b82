#!/usr/bin/env python3
"""Replay allocation traces through accel's caching allocator.

    python tools/replay_trace.py                       # the shared traces, both policies
    python tools/replay_trace.py --corpus --markdown   # every trace in tests/test_memory_traces (README table)
    python tools/replay_trace.py --holdout             # the held-out traces (tests/test_memory_traces/holdout)
    python tools/replay_trace.py TRACE.json --policy accel
    python tools/replay_trace.py --conf max_split_size_mb:64 --json
    python tools/replay_trace.py --corpus --variant "accel-exp=policy:accel,expandable_segments:True"
    python tools/replay_trace.py --corpus --passes 3  # each trace 3 times back to back: does it creep?

Runs on the simulator (ACCEL_SIM=cuda) unless ACCEL_SIM/ACCEL_BACKEND say
otherwise, and prints per trace and policy: ops, peak live bytes, the 2 MiB
physical floor (peak live rounded up to 2 MiB pages) over peak live,
peak reserved / peak allocated, the minimum capacity (smallest
per_process_memory_fraction cap that replays without OutOfMemoryError, by
bisection to 0.5 %) over peak live, backend segment allocations, backend
map/unmap calls (0 for classic segments), and µs per op (median and min-max
over --rounds replays).  ``--pairs N`` also times cached 1 MiB malloc+free
against the bare backend pair.

A "variant" is a label and an ACCEL_ALLOC_CONF string; ``--policy`` picks the
built-in ones (accel, torch), ``--variant LABEL=CONF`` adds more (for instance
expandable segments, once the allocator has them), ``--conf`` is appended to all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _progress import Progress  # noqa: E402  (tools/ is on sys.path when run as a script)

MiB = 1 << 20


def _variant(text: str):
    label, sep, conf = text.partition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected LABEL=CONF, e.g. "
                                         "'accel-exp=policy:accel,expandable_segments:True'")
    return label, conf


def table_rows(results):
    """(header, rows) of the report, as strings; shared by the text and markdown tables."""
    header = ["trace", "policy", "ops", "peak live MiB", "2 MiB floor", "resv/alloc", "resv/req",
              "min cap", "dev allocs", "map/unmap", "us/op (min-max)", "alloc us/op"]
    rows = []
    for r in results:
        cap = f"{r['min_capacity_ratio']:.3f}" if "min_capacity_ratio" in r else "-"
        rows.append([r["name"], r["variant"], str(r["ops"]), f"{r['peak_live'] / MiB:.2f}",
                     f"{r['floor_ratio']:.3f}", f"{r['ratio']:.3f}", f"{r['ratio_requested']:.3f}", cap,
                     str(r["device_alloc_calls"]), f"{r['map_calls']}/{r['unmap_calls']}",
                     f"{r['us_per_op']:.2f} ({r['us_per_op_min']:.2f}-{r['us_per_op_max']:.2f})",
                     f"{r['allocator_us_per_op']:.2f}"])
    return header, rows


def markdown(results) -> str:
    """The README table: one row per trace and variant, then the worst ratio per variant."""
    header, rows = table_rows(results)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines.append("")
    lines.append("| variant | worst resv/alloc | worst min cap | worst 2 MiB floor |")
    lines.append("|---|---:|---:|---:|")
    for variant in dict.fromkeys(r["variant"] for r in results):
        mine = [r for r in results if r["variant"] == variant]
        caps = [r["min_capacity_ratio"] for r in mine if "min_capacity_ratio" in r]
        lines.append(f"| {variant} | {max(r['ratio'] for r in mine):.3f} | "
                     f"{max(caps):.3f} | {max(r['floor_ratio'] for r in mine):.3f} |" if caps else
                     f"| {variant} | {max(r['ratio'] for r in mine):.3f} | - | "
                     f"{max(r['floor_ratio'] for r in mine):.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="*", help="trace files (default: the shared traces)")
    parser.add_argument("--corpus", action="store_true",
                        help="replay every trace in tests/test_memory_traces (the corpus and the shared two)")
    parser.add_argument("--holdout", action="store_true",
                        help="replay the held-out traces in tests/test_memory_traces/holdout")
    parser.add_argument("--policy", choices=("accel", "torch", "both", "none"), default="both",
                        help="built-in variants to run (none: only --variant ones)")
    parser.add_argument("--variant", action="append", type=_variant, default=[], metavar="LABEL=CONF",
                        help="also replay with this ACCEL_ALLOC_CONF, reported as LABEL (repeatable)")
    parser.add_argument("--conf", default="", help="extra ACCEL_ALLOC_CONF options for every replay")
    parser.add_argument("--rounds", type=int, default=3, help="timed replays per trace and variant (default 3)")
    parser.add_argument("--no-capacity", action="store_true", help="skip the minimum-capacity bisection")
    parser.add_argument("--pairs", type=int, default=0, help="also time N cached 1 MiB alloc+free pairs")
    parser.add_argument("--passes", type=int, default=1,
                        help="replay each trace N times back to back in one allocator (what a pass "
                             "leaves live is freed before the next); figures cover all passes")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table (for the README)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: need at least 1")
    if args.passes < 1:
        parser.error(f"--passes {args.passes}: need at least 1")

    if not (os.environ.get("ACCEL_SIM") or os.environ.get("ACCEL_BACKEND")):
        os.environ["ACCEL_SIM"] = "cuda"
    from accel.memory import _bench, _config

    paths = list(args.traces)
    if args.corpus:
        paths += [p for p in _bench.corpus_traces() if p not in paths]
    if args.holdout:
        paths += [p for p in _bench.holdout_traces() if p not in paths]
    paths = paths or _bench.default_traces()
    if not paths:
        parser.error("no traces given and none found (set ACCEL_TRACES to the traces folder)")
    variants = [(p, f"policy:{p}") for p in {"both": ("accel", "torch"), "none": ()}.get(args.policy, (args.policy,))]
    variants += args.variant
    if not variants:
        parser.error("--policy none needs at least one --variant LABEL=CONF")
    configs = [(label, _config.parse(",".join(filter(None, (conf, args.conf))), f"variant {label}"))
               for label, conf in variants]
    progress = Progress()
    results = []
    steps = len(paths) * len(configs) + (1 if args.pairs else 0)
    for path in paths:
        trace = _bench.repeat_trace(_bench.load_trace(path), args.passes)
        for label, config in configs:
            progress.update(f"[{len(results) + 1}/{steps}] replaying {os.path.basename(path)} "
                            f"({len(trace['ops'])} ops, {label})")
            r = _bench.replay(trace, config, rounds=args.rounds, capacity=not args.no_capacity)
            r["variant"] = label
            results.append(r)
    if args.pairs:
        progress.update(f"[{steps}/{steps}] timing {args.pairs} cached 1 MiB alloc+free pairs")
    cost = _bench.alloc_free_cost(n=args.pairs) if args.pairs else None
    progress.clear()

    if args.json:
        print(json.dumps({"replays": results, "alloc_free_1mib": cost}, indent=2))
        return 0
    if args.markdown:
        print(markdown(results))
    else:
        header, rows = table_rows(results)
        widths = [max(len(x) for x in col) for col in zip(header, *rows)]
        for row in [header] + rows:
            print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    if cost:
        print(f"\ncached 1 MiB malloc+free: {cost['cached_pair_us']:.2f} us/pair CPU "
              f"({cost['cached_pair_wall_us']:.2f} wall); bare backend mem_alloc+mem_free: "
              f"{cost['bare_pair_us']:.2f} us/pair CPU ({cost['bare_pair_wall_us']:.2f} wall); "
              f"cached/bare = {1 / cost['speedup_vs_bare']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
