"""Timeline pictures of a memory snapshot: memory over time, per segment.

Input is what :func:`accel.memory.dump_snapshot` writes: ``{"segments": [...],
"device_traces": [[event, ...] per device]}`` (a bare list of segments is
accepted too).  Each segment becomes a horizontal lane whose height is
proportional to its size; every block allocated in it is a rectangle spanning
its lifetime (x, in event order) and its address range (y).  An expandable
segment (``is_expandable``; ``segment_map``/``segment_unmap`` events) is a dashed
lane holding its mapped runs over time, as torch's viewer draws them.  A line chart on
top shows active (allocated, or freed but still used by another stream) and
reserved bytes (grown by segment_alloc and segment_map, shrunk by
segment_free and segment_unmap).  HTML output is one self-contained file with inline SVG; PNG
output needs matplotlib.
"""

from __future__ import annotations

import html
import json
from typing import Dict, List, Optional, Tuple

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
    """Segments, blocks and totals of one device, rebuilt from a snapshot.

    Classic segments (``segment_alloc``/``segment_free``) are one lane each.  An
    expandable segment (snapshot segments with ``is_expandable``; trace events
    ``segment_map``/``segment_unmap``) is reported by the allocator as its mapped
    runs, so, as torch's memory viewer does, mapped ranges of one stream that touch
    are one run: a map grows (or joins) runs and reserved memory, an unmap shrinks
    or splits them.  Every address range of a stream that was mapped at some time
    becomes one lane (kind ``expandable``), and ``runs`` holds its mapped runs over
    time.
    """

    def __init__(self, device: int, segments: List[dict], events: List[dict]):
        self.device = device
        self.steps = max(len(events), 1)
        # lane address -> [start, end, size, type]; blocks -> (lane, start, end, addr, size, label)
        self.segments: Dict[int, list] = {}
        self.blocks: List[Tuple[int, int, int, int, int, str]] = []
        # mapped runs of expandable lanes: (lane, start, end or None, addr, size, stream)
        self.runs: List[Tuple[int, int, Optional[int], int, int, int]] = []
        self.expandable: set = set()
        self.active: List[Tuple[int, int]] = []
        self.reserved: List[Tuple[int, int]] = []
        seen_allocs = {e["addr"] for e in events if e["action"] == "alloc"}
        # a block holds memory until its free completes (after other streams' work);
        # traces without completion events end blocks at the free request
        end_action = ("free_completed" if any(e["action"] == "free_completed" for e in events)
                      else "free_requested")
        seen_segments = {e["addr"] for e in events if e["action"] == "segment_alloc"}
        classic = [s for s in segments if not s.get("is_expandable")]
        mapped = _initial_maps(segments, events)
        open_blocks: Dict[int, Tuple[int, int, str]] = {}
        active = reserved = 0
        for seg in classic:                       # alive before recording began
            if seg["address"] not in seen_segments:
                self.segments[seg["address"]] = [0, None, seg["total_size"], seg.get("segment_type", "")]
                reserved += seg["total_size"]
        for seg in segments:
            for block in seg["blocks"]:
                if block["state"] != "inactive" and block["address"] not in seen_allocs:
                    open_blocks[block["address"]] = (0, block["size"], _label(block))
                    active += block["size"]
        reserved += sum(b - a for ivs in mapped.values() for a, b in ivs)
        runs = _Runs(mapped)
        ended = []                                # blocks go into lanes once all lanes are known
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
            elif action in ("segment_map", "segment_unmap"):
                runs.change(t, event.get("stream", 0), addr, size, action == "segment_map")
                reserved += size if action == "segment_map" else -size
            elif action == "alloc":
                open_blocks[addr] = (t, size, _label(event))
                active += size
            elif action == end_action and addr in open_blocks:
                start, size, label = open_blocks.pop(addr)
                ended.append((start, t, addr, size, label))
                active -= size
            self.active.append((t, active))
            self.reserved.append((t, reserved))
        self._add_expandable(runs.finish(), segments)
        for start, end, addr, size, label in ended:
            self._add_block(start, end, addr, size, label)
        for addr, (start, size, label) in open_blocks.items():
            self._add_block(start, self.steps, addr, size, label)
        for seg in classic:
            if seg["address"] in self.segments:
                self.segments[seg["address"]][3] = seg.get("segment_type", "")

    def _add_expandable(self, runs, segments) -> None:
        """One lane per address range of a stream that was ever mapped; its runs in it."""
        lanes: Dict[int, list] = {}
        for stream, extent in runs.extents.items():
            for a, b in extent:
                kinds = sorted({s.get("segment_type", "") for s in segments if s.get("is_expandable")
                                and s.get("stream", 0) == stream and a <= s["address"] < b} - {""})
                lanes[a] = [None, 0, b - a, " ".join(["expandable"] + kinds)]
        for stream, start, end, a, b in runs.closed:
            lane = max(base for base in lanes if base <= a)
            entry = lanes[lane]
            entry[0] = start if entry[0] is None else min(entry[0], start)
            entry[1] = None if end is None or entry[1] is None else max(entry[1], end)
            self.runs.append((lane, start, end, a, b - a, stream))
        for base, (start, end, size, kind) in lanes.items():
            self.segments[base] = [start or 0, end, size, kind]
            self.expandable.add(base)
        self.runs.sort(key=lambda r: (r[3], r[1]))

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



def _iv_add(ivs: List[Tuple[int, int]], a: int, b: int) -> List[Tuple[int, int]]:
    """Sorted disjoint intervals ``ivs`` with [a, b) added; touching ones merge."""
    out = []
    for x, y in ivs:
        if y < a or x > b:
            out.append((x, y))
        else:
            a, b = min(a, x), max(b, y)
    out.append((a, b))
    return sorted(out)


def _iv_sub(ivs: List[Tuple[int, int]], a: int, b: int) -> List[Tuple[int, int]]:
    """Sorted disjoint intervals ``ivs`` with [a, b) taken out."""
    out = []
    for x, y in ivs:
        if x < a:
            out.append((x, min(y, a)))
        if y > b:
            out.append((max(x, b), y))
    return out


def _initial_maps(segments: List[dict], events: List[dict]) -> Dict[int, List[Tuple[int, int]]]:
    """Mapped ranges of expandable segments per stream before the first event: the
    snapshot's mapped runs with the trace undone backwards (as torch's viewer does;
    a trace cut short by ``max_entries`` still starts from the right state)."""
    mapped: Dict[int, List[Tuple[int, int]]] = {}
    for seg in segments:
        if seg.get("is_expandable"):
            stream = seg.get("stream", 0)
            mapped[stream] = _iv_add(mapped.get(stream, []), seg["address"],
                                     seg["address"] + seg["total_size"])
    for event in reversed(events):
        if event["action"] in ("segment_map", "segment_unmap"):
            stream, a = event.get("stream", 0), event["addr"]
            ivs = mapped.get(stream, [])
            mapped[stream] = (_iv_sub(ivs, a, a + event["size"]) if event["action"] == "segment_map"
                              else _iv_add(ivs, a, a + event["size"]))
    return {s: ivs for s, ivs in mapped.items() if ivs}


class _Runs:
    """Mapped runs of expandable segments over time (touching maps of a stream are one run)."""

    def __init__(self, mapped: Dict[int, List[Tuple[int, int]]]):
        self.mapped = {s: list(ivs) for s, ivs in mapped.items()}
        self.extents = {s: list(ivs) for s, ivs in mapped.items()}
        self.open = {(s, a, b): 0 for s, ivs in mapped.items() for a, b in ivs}
        self.closed: List[Tuple[int, int, Optional[int], int, int]] = []

    def change(self, t: int, stream: int, addr: int, size: int, is_map: bool) -> None:
        ivs = self.mapped.get(stream, [])
        ivs = _iv_add(ivs, addr, addr + size) if is_map else _iv_sub(ivs, addr, addr + size)
        self.mapped[stream] = ivs
        self.extents[stream] = _iv_add(self.extents.get(stream, []), addr, addr + size)
        now = {(stream, a, b) for a, b in ivs}
        for key in [k for k in self.open if k[0] == stream and k not in now]:
            self.closed.append((stream, self.open.pop(key), t, key[1], key[2]))
        for key in now - self.open.keys():
            self.open[key] = t

    def finish(self) -> "_Runs":
        for (stream, a, b), start in self.open.items():
            self.closed.append((stream, start, None, a, b))
        self.open = {}
        return self

def _label(entry: dict) -> str:
    frames = entry.get("frames") or []      # innermost first, as torch's snapshots
    where = ""
    for frame in frames:
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
        if addr in tl.expandable:               # the address range; its mapped runs below
            parts.append(f'<rect x="{_LEFT + start * sx:.1f}" y="{top + y:.1f}" '
                         f'width="{max((end - start) * sx, 1):.1f}" height="{h:.1f}" fill="none" '
                         f'stroke="#ccc" stroke-dasharray="4 3"><title>expandable segment {addr:#x}: '
                         f'{_mib(size)} of addresses mapped at some time ({kind})</title></rect>')
        else:
            parts.append(f'<rect x="{_LEFT + start * sx:.1f}" y="{top + y:.1f}" '
                         f'width="{max((end - start) * sx, 1):.1f}" height="{h:.1f}" fill="#eee" '
                         f'stroke="#ccc"><title>segment {addr:#x} {_mib(size)} {kind}</title></rect>')
        if h >= 9:
            tag = " expandable" if addr in tl.expandable else ""
            parts.append(f'<text x="4" y="{top + y + min(h, 20) - 4:.1f}">{addr:#x} {_mib(size)}{tag}</text>')
    for base, start, end, addr, size, stream in tl.runs:
        y, h = lanes[base]
        lane_size = tl.segments[base][2]
        end = tl.steps if end is None else end
        parts.append(f'<rect x="{_LEFT + start * sx:.1f}" y="{top + y + (addr - base) / lane_size * h:.2f}" '
                     f'width="{max((end - start) * sx, 1):.1f}" height="{max(size / lane_size * h, 0.5):.2f}" '
                     f'fill="#eee" stroke="#ccc"><title>mapped run {addr:#x} {_mib(size)} of expandable '
                     f'segment {base:#x} (stream {stream:#x}), events {start}-{end}</title></rect>')
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
        exp = (f" ({len(tl.expandable)} expandable, {len(tl.runs)} mapped runs)" if tl.expandable else "")
        body.append(f"<h2>device {tl.device}: {len(tl.segments)} segments{exp}, {len(tl.blocks)} blocks, "
                    f"{tl.steps} events</h2>")
        body.append(_svg(tl))
    doc = ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" + html.escape(title) +
           "</title><style>body{font-family:sans-serif;margin:16px} svg{border:1px solid #ddd}</style>"
           "</head><body><h1>" + html.escape(title) + "</h1><p>Each grey lane is a segment (height ∝ size); "
           "coloured rectangles are blocks over their lifetime. A dashed lane is an "
           "expandable segment: its grey parts are the mapped runs (a map grows reserved memory, an unmap "
           "shrinks it). Hover for addresses, sizes and "
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
            if addr in tl.expandable:
                ax.add_patch(Rectangle((start, y), end - start, h, fill=False, edgecolor="#ccc",
                                       linestyle="--"))
            else:
                ax.add_patch(Rectangle((start, y), end - start, h, facecolor="#eee", edgecolor="#ccc"))
        for base, start, end, addr, size, _ in tl.runs:
            y, h = lanes[base]
            lane_size = tl.segments[base][2]
            end = tl.steps if end is None else end
            ax.add_patch(Rectangle((start, y + (addr - base) / lane_size * h), end - start,
                                   size / lane_size * h, facecolor="#eee", edgecolor="#ccc"))
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
