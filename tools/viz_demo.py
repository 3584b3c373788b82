"""A realistic snapshot for ``python -m accel.memory viz`` (issue 17 item 7), on the simulator.

    ACCEL_SIM=cuda python tools/viz_demo.py OUT.pickle [--ops N] [--expandable | --classic]

Replays the first ``N`` operations of the recorded GPT training trace
(tests/test_memory_traces/gpt_small_train.json) as accel Buffers with history on, then:
a side stream allocates its own blocks; a block of the default stream is filled on the side
stream (so the allocator records that use) and freed while that work is still queued, so
its free is pending until the side stream's event completes; a CUDA graph capture allocates
from a private pool; an allocation larger than the device raises OutOfMemoryError (an
``oom`` entry).  Writes the snapshot with ``accel.memory.dump_snapshot`` (a pickle, or JSON
for a ``.json`` name).  ``--expandable`` sets ``expandable_segments:True`` (maps and unmaps),
``--classic`` ``expandable_segments:False`` (cudaMalloc'd segments); by default accel chooses.
Set ACCEL_SIM_DELAY_US (e.g. 20000) so the side stream's work is still running at the free.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(REPO, "tests", "test_memory_traces", "gpt_small_train.json")


def replay(ops, live):
    """One training step's allocations: ``["a", id, nbytes]`` allocates, ``["f", id]`` frees."""
    import accel
    for op in ops:
        if op[0] == "a":
            live[op[1]] = accel.Buffer(op[2])
        else:
            live.pop(op[1]).close()


def side_stream_work(side):
    """Blocks of a second stream, and a default-stream block used there and freed early."""
    import accel
    mine = [accel.Buffer(n, stream=side) for n in (3 << 20, 96 << 10, 512)]
    shared = accel.Buffer(2 << 20)                # allocated on the default stream ...
    shared.fill_(1, stream=side)                  # ... used on the side stream (record_stream)
    shared.close()                                # freed while the side stream still runs: pending
    return mine


def capture_graph():
    """A graph capture allocates from its own private pool."""
    import accel
    g = accel.Graph()
    with accel.graph(g):
        out = accel.Buffer(1 << 20)
        out.fill_(0)
    return g, out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="snapshot file (.pickle, or .json)")
    parser.add_argument("--ops", type=int, default=400, help="trace operations to replay (default 400)")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--expandable", action="store_true", help="expandable_segments:True")
    kind.add_argument("--classic", action="store_true", help="expandable_segments:False")
    args = parser.parse_args(argv)
    os.environ.setdefault("ACCEL_SIM", "cuda")
    if args.expandable:
        os.environ["ACCEL_ALLOC_CONF"] = "expandable_segments:True"
    elif args.classic:
        os.environ["ACCEL_ALLOC_CONF"] = "expandable_segments:False"
    import accel
    from accel import memory
    with open(TRACE) as fh:
        ops = json.load(fh)["ops"][:args.ops]
    memory.record_history(True)
    live, kept, side = {}, [], None
    try:
        half = len(ops) // 2
        replay(ops[:half], live)
        side = accel.Stream()
        kept += side_stream_work(side)
        replay(ops[half:], live)                  # allocations while the free is pending
        side.synchronize()
        kept.append(accel.Buffer(4096))           # the allocator sees the event: free completes
        kept += capture_graph()
        try:
            accel.Buffer(accel.get_device_properties(0).total_memory * 2)
        except accel.OutOfMemoryError:
            pass
        memory.dump_snapshot(args.out)
    finally:
        memory.record_history(False)
        for buf in list(live.values()) + kept:
            if isinstance(buf, accel.Buffer):
                buf.close()
        if side is not None:
            side.synchronize()
        del side, kept                            # released now, not at interpreter exit
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
