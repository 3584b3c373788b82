#!/usr/bin/env python3
"""Replay allocation traces through accel's caching allocator.

    python tools/replay_trace.py                       # the shared traces, both policies
    python tools/replay_trace.py --corpus --markdown   # every trace in tests/test_memory_traces (README table)
    python tools/replay_trace.py --holdout             # the held-out traces (tests/test_memory_traces/holdout)
    python tools/replay_trace.py TRACE.json --policy accel
    python tools/replay_trace.py --conf max_split_size_mb:64 --json
    python tools/replay_trace.py --corpus --variant "accel-exp=policy:accel,expandable_segments:True"
    python tools/replay_trace.py --corpus --passes 3  # each trace 3 times back to back: does it creep?
    python tools/replay_trace.py --corpus --holdout --perturb 5   # + 5 copies each, sizes scaled

Runs on the simulator (ACCEL_SIM=cuda) unless ACCEL_SIM/ACCEL_BACKEND say
otherwise, and prints per trace and policy: ops, peak live bytes, the 2 MiB
physical floor (peak live rounded up to 2 MiB pages) over peak live,
peak reserved / peak allocated, the minimum capacity (smallest
per_process_memory_fraction cap that replays without OutOfMemoryError, by
bisection to 0.5 %) over peak live, backend segment allocations, backend
map/unmap calls (0 for classic segments), and µs per op (median and min-max
over --rounds replays).  ``--pairs N`` also times cached 1 MiB malloc+free
against the bare backend pair.

``--perturb N`` also replays N copies of each trace whose sizes are scaled (each distinct
size by its own factor within ``--jitter``, or with ``--scale-all`` every size by one
factor), no timing and no capacity search, and prints per variant the mean, median and
worst peak reserved over peak live and how many replays pass 1.08 and 1.15: a policy
tuned on the recorded traces can owe its figures to their exact sizes.

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
    parser.add_argument("traces", nargs="*",
                        help="trace files: JSON, or a memory snapshot pickle (torch.cuda.memory._dump_snapshot or "
                             "accel.memory._dump_snapshot after _record_memory_history()); default: the shared traces")
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
    parser.add_argument("--perturb", type=int, default=0, metavar="N",
                        help="also replay N size-scaled copies of each trace; print a summary per variant")
    parser.add_argument("--jitter", type=float, default=None,
                        help="--perturb's largest relative change of a size (default 0.03, 0.2 with --scale-all)")
    parser.add_argument("--scale-all", action="store_true",
                        help="--perturb scales every size of a copy by one factor (another batch size)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table (for the README)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: need at least 1")
    if args.passes < 1:
        parser.error(f"--passes {args.passes}: need at least 1")
    if args.perturb < 0:
        parser.error(f"--perturb {args.perturb}: need at least 0")
    jitter = args.jitter if args.jitter is not None else (0.2 if args.scale_all else 0.03)
    if not 0 <= jitter < 1:
        parser.error(f"--jitter {jitter}: need 0 <= jitter < 1")

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
    seeds = range(args.perturb + 1)
    steps = len(paths) * len(configs) * len(seeds) + (1 if args.pairs else 0)
    for path in paths:
        try:
            loaded = _bench.load_trace(path)
        except (OSError, ValueError) as exc:      # a missing file, bad JSON, a bad op
            parser.error(str(exc))
        recorded = _bench.repeat_trace(loaded, args.passes)
        for seed in seeds:
            trace = _bench.perturb_trace(recorded, seed, jitter, per_size=not args.scale_all)
            for label, config in configs:
                progress.update(f"[{len(results) + 1}/{steps}] replaying {os.path.basename(path)} "
                                f"({len(trace['ops'])} ops, {label}" + (f", copy {seed})" if seed else ")"))
                if args.perturb:
                    r = _bench.replay(trace, config, rounds=1, capacity=False)
                    r["seed"] = seed
                else:
                    r = _bench.replay(trace, config, rounds=args.rounds, capacity=not args.no_capacity)
                r["variant"] = label
                results.append(r)
    if args.pairs:
        progress.update(f"[{steps}/{steps}] timing {args.pairs} cached 1 MiB alloc+free pairs")
    cost = _bench.alloc_free_cost(n=args.pairs) if args.pairs else None
    progress.clear()

    summaries = []
    if args.perturb:
        for label in dict.fromkeys(r["variant"] for r in results):
            summaries.append(dict(_bench.summarize([r for r in results if r["variant"] == label]), variant=label))
    if args.json:
        out = {"replays": results, "alloc_free_1mib": cost}
        if args.perturb:
            out["summaries"] = summaries
        print(json.dumps(out, indent=2))
        return 0
    if args.perturb:
        kind = "every size by one factor" if args.scale_all else "each size by its own factor"
        print(f"{len(paths)} traces x {len(seeds)} (as recorded + {args.perturb} copies, {kind} within "
              f"{jitter:.0%}): peak reserved / peak live")
        print(f"{'variant':16} {'mean':>6} {'median':>6} {'worst':>6} {'over 1.08':>10} {'over 1.15':>10} "
              f"{'max maps':>8}")
        for s in summaries:
            print(f"{s['variant']:16} {s['mean']:6.3f} {s['median']:6.3f} {s['worst']:6.3f} "
                  f"{s['over_1.08']:>4}/{s['replays']:<5} {s['over_1.15']:>4}/{s['replays']:<5} "
                  f"{s['max_map_calls']:8}")
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
