"""Timeline pictures of a memory snapshot: memory over time, per segment.

Input is what :func:`accel.memory.dump_snapshot` writes: ``{"segments": [...],
"device_traces": [[event, ...] per device]}`` (a bare list of segments is
accepted too).  Each segment becomes a horizontal lane whose height is
proportional to its size; every block allocated in it is a rectangle spanning
its lifetime (x, in event order) and its address range (y).  A line chart on
top shows active (allocated, or freed but still used by another stream) and
reserved bytes.  HTML output is one self-contained file with inline SVG; PNG
output needs matplotlib.
"""

from __future__ import annotations

import html
import json
from typing import Dict, List, Tuple

_WIDTH = 1100
_LEFT = 190
_RIGHT = 20
_LANES_HEIGHT = 560
_CHART_HEIGHT = 140
_COLORS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#bab0ac")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


class Timeline:
    """Segments, blocks and totals of one device, rebuilt from a snapshot."""

    def __init__(self, device: int, segments: List[dict], events: List[dict]):
        self.device = device
        self.steps = max(len(events), 1)
        # segment address -> [start, end, size, type]; blocks -> (seg, start, end, addr, size, label)
        self.segments: Dict[int, list] = {}
        self.blocks: List[Tuple[int, int, int, int, int, str]] = []
        self.active: List[Tuple[int, int]] = []
        self.reserved: List[Tuple[int, int]] = []
        seen_allocs = {e["addr"] for e in events if e["action"] == "alloc"}
        # a block holds memory until its free completes (after other streams' work);
        # traces without completion events end blocks at the free request
        end_action = ("free_completed" if any(e["action"] == "free_completed" for e in events)
                      else "free_requested")
        seen_segments = {e["addr"] for e in events if e["action"] == "segment_alloc"}
        open_blocks: Dict[int, Tuple[int, int, str]] = {}
        active = reserved = 0
        for seg in segments:                      # alive before recording began
            if seg["address"] not in seen_segments:
                self.segments[seg["address"]] = [0, None, seg["total_size"], seg.get("segment_type", "")]
                reserved += seg["total_size"]
            for block in seg["blocks"]:
                if block["state"] != "inactive" and block["address"] not in seen_allocs:
                    open_blocks[block["address"]] = (0, block["size"], _label(block))
                    active += block["size"]
        self.active.append((0, active))
        self.reserved.append((0, reserved))
        for t, event in enumerate(events, 1):
            action, addr, size = event["action"], event["addr"], event["size"]
            if action == "segment_alloc":
                self.segments[addr] = [t, None, size, ""]
                reserved += size
            elif action == "segment_free":
                if addr in self.segments:
                    self.segments[addr][1] = t
                reserved -= size
            elif action == "alloc":
                open_blocks[addr] = (t, size, _label(event))
                active += size
            elif action == end_action and addr in open_blocks:
                start, size, label = open_blocks.pop(addr)
                self._add_block(start, t, addr, size, label)
                active -= size
            self.active.append((t, active))
            self.reserved.append((t, reserved))
        for addr, (start, size, label) in open_blocks.items():
            self._add_block(start, self.steps, addr, size, label)
        for seg in segments:
            if seg["address"] in self.segments:
                self.segments[seg["address"]][3] = seg.get("segment_type", "")

    def _add_block(self, start, end, addr, size, label):
        for base, (_, _, seg_size, _) in self.segments.items():
            if base <= addr < base + seg_size:
                self.blocks.append((base, start, end, addr, size, label))
                return

    def lanes(self) -> Dict[int, Tuple[float, float]]:
        """Segment address -> (top y, height) inside the lane area."""
        order = sorted(self.segments)
        if not order:
            return {}
        total = sum(self.segments[a][2] for a in order)
        gap = 2.0
        usable = _LANES_HEIGHT - gap * len(order)
        out, y = {}, 0.0
        for addr in order:
            height = max(usable * self.segments[addr][2] / total, 3.0)
            out[addr] = (y, height)
            y += height + gap
        return out


def _label(entry: dict) -> str:
    frames = entry.get("frames") or []
    where = ""
    for frame in reversed(frames):
        if "accel" not in frame.get("filename", "").replace("\\", "/").split("/")[-2:-1]:
            where = f" at {frame['filename']}:{frame['line']} ({frame['name']})"
            break
    return f"{entry.get('addr', entry.get('address', 0)):#x} {_mib(entry['size'])}{where}"


def load(path: str) -> List[Timeline]:
    with open(path) as fh:
        data = json.load(fh)
    if isinstance(data, list):
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, dict) or "segments" not in data:
        raise ValueError(f"{path}: not a memory snapshot (expected the JSON that "
                         f"accel.memory.dump_snapshot writes)")
    traces = data.get("device_traces") or []
    devices = sorted({s.get("device", 0) for s in data["segments"]} | set(range(len(traces))))
    return [Timeline(d, [s for s in data["segments"] if s.get("device", 0) == d],
                     traces[d] if d < len(traces) else []) for d in devices] or [Timeline(0, [], [])]


def _svg(tl: Timeline) -> str:
    plot_w = _WIDTH - _LEFT - _RIGHT
    height = _CHART_HEIGHT + 30 + _LANES_HEIGHT + 20
    sx = plot_w / tl.steps
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" '
             f'font-family="sans-serif" font-size="11">']
    # totals chart
    peak = max([v for _, v in tl.reserved] + [v for _, v in tl.active] + [1])
    for name, series, color in (("reserved", tl.reserved, "#888"), ("active", tl.active, "#4e79a7")):
        points = " ".join(f"{_LEFT + t * sx:.1f},{_CHART_HEIGHT - v / peak * (_CHART_HEIGHT - 10):.1f}"
                          for t, v in series)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}">'
                     f'<title>{name}</title></polyline>')
    parts.append(f'<text x="4" y="14">peak {_mib(peak)}</text>'
                 f'<text x="4" y="30" fill="#888">reserved</text>'
                 f'<text x="4" y="46" fill="#4e79a7">active</text>')
    top = _CHART_HEIGHT + 30
    lanes = tl.lanes()
    for addr, (y, h) in lanes.items():
        start, end, size, kind = tl.segments[addr]
        end = tl.steps if end is None else end
        parts.append(f'<rect x="{_LEFT + start * sx:.1f}" y="{top + y:.1f}" width="{max((end - start) * sx, 1):.1f}" '
                     f'height="{h:.1f}" fill="#eee" stroke="#ccc"><title>segment {addr:#x} '
                     f'{_mib(size)} {kind}</title></rect>')
        if h >= 9:
            parts.append(f'<text x="4" y="{top + y + min(h, 20) - 4:.1f}">{addr:#x} {_mib(size)}</text>')
    for i, (base, start, end, addr, size, label) in enumerate(tl.blocks):
        y, h = lanes[base]
        seg_size = tl.segments[base][2]
        by = top + y + (addr - base) / seg_size * h
        bh = max(size / seg_size * h, 0.5)
        color = _COLORS[(addr // 512 + size) % len(_COLORS)]
        parts.append(f'<rect x="{_LEFT + start * sx:.1f}" y="{by:.2f}" width="{max((end - start) * sx, 0.5):.1f}" '
                     f'height="{bh:.2f}" fill="{color}"><title>{html.escape(label)}</title></rect>')
    parts.append(f'<text x="{_LEFT}" y="{height - 4}">time (allocator events) →</text></svg>')
    return "".join(parts)


def write_html(timelines: List[Timeline], out: str, title: str) -> None:
    body = []
    for tl in timelines:
        body.append(f"<h2>device {tl.device}: {len(tl.segments)} segments, {len(tl.blocks)} blocks, "
                    f"{tl.steps} events</h2>")
        body.append(_svg(tl))
    doc = ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" + html.escape(title) +
           "</title><style>body{font-family:sans-serif;margin:16px} svg{border:1px solid #ddd}</style>"
           "</head><body><h1>" + html.escape(title) + "</h1><p>Each grey lane is a segment (height ∝ size); "
           "coloured rectangles are blocks over their lifetime. Hover for addresses, sizes and "
           "allocation sites.</p>" + "".join(body) + "</body></html>\n")
    with open(out, "w", encoding="utf-8") as fh:
        fh.write(doc)


def write_png(timelines: List[Timeline], out: str, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Rectangle
    except ImportError:
        raise RuntimeError(f"writing {out}: PNG output needs matplotlib, which is not installed; "
                           f"write an .html timeline instead (-o timeline.html)") from None
    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 6 * len(timelines)), squeeze=False)
    for ax, tl in zip(axes[:, 0], timelines):
        lanes = tl.lanes()
        for addr, (y, h) in lanes.items():
            start, end, _, _ = tl.segments[addr]
            end = tl.steps if end is None else end
            ax.add_patch(Rectangle((start, y), end - start, h, facecolor="#eee", edgecolor="#ccc"))
        for base, start, end, addr, size, _ in tl.blocks:
            y, h = lanes[base]
            seg_size = tl.segments[base][2]
            ax.add_patch(Rectangle((start, y + (addr - base) / seg_size * h), end - start,
                                   size / seg_size * h, color=_COLORS[(addr // 512 + size) % len(_COLORS)]))
        ax.set_xlim(0, tl.steps)
        ax.set_ylim(_LANES_HEIGHT, 0)
        ax.set_yticks([y + h / 2 for y, h in lanes.values()])
        ax.set_yticklabels([f"{a:#x}" for a in lanes], fontsize=6)
        ax.set_xlabel("time (allocator events)")
        ax.set_title(f"{title}: device {tl.device}")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def render(snapshot: str, out: str) -> None:
    """Draw ``snapshot`` (JSON) into ``out`` (.html, or .png with matplotlib)."""
    timelines = load(snapshot)
    title = f"accel memory timeline: {snapshot}"
    lower = out.lower()
    if lower.endswith((".html", ".htm")):
        write_html(timelines, out, title)
    elif lower.endswith(".png"):
        write_png(timelines, out, title)
    else:
        raise ValueError(f"output {out!r}: expected a .html or .png file name")
