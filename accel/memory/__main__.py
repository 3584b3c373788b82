"""``python -m accel.memory viz SNAPSHOT -o timeline.html|timeline.png``

Draws memory over time per segment from a snapshot: the pickle (or ``.json``) written by
``accel.memory.dump_snapshot`` (record it with ``accel.memory.record_history(True)``), or
torch's ``torch.cuda.memory._dump_snapshot`` pickle.  Hover a block for its allocation site.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m accel.memory", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    viz = sub.add_parser("viz", help="draw a memory timeline from a snapshot (pickle or JSON)")
    viz.add_argument("snapshot", help="pickle or JSON written by accel.memory.dump_snapshot, or a pickle "
                                      "written by torch.cuda.memory._dump_snapshot")
    viz.add_argument("-o", "--output", required=True, help="timeline.html (self-contained) or timeline.png")
    args = parser.parse_args(argv)
    from ._viz import render
    try:
        render(args.snapshot, args.output)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"python -m accel.memory viz: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
