"""Timeline pictures of a memory snapshot: memory over time, per segment.

Input is a snapshot in torch's layout (``torch.cuda.memory._snapshot()``, described in
:mod:`accel.memory._snapfmt`): ``{"segments": [...], "device_traces": [[event, ...] per
device]}``, read from the pickle that :func:`accel.memory.dump_snapshot` and torch's
``torch.cuda.memory._dump_snapshot`` write, or from accel's JSON (a bare list of segments,
as ``memory_snapshot()`` returns, is accepted too).  The pickle is read with an unpickler
that builds only plain data (dicts, lists, tuples, strings, numbers), never an object.

Each segment becomes a horizontal lane whose height is proportional to its size; every block
allocated in it is a rectangle spanning its lifetime (x, in event order) and its address
range (y), coloured by its stream (or, switched on the page, by its memory pool); a block
freed while other streams still had work on it (``free_requested`` until
``free_completed``; state ``active_pending_free`` in the snapshot) is hatched for that time.
An expandable segment (``is_expandable``; ``segment_map``/``segment_unmap`` events) is a
dashed lane holding its mapped runs over time, as torch's viewer draws them.  A line chart on
top shows active (allocated, or freed but still used by another stream) and reserved bytes
(grown by segment_alloc and segment_map, shrunk by segment_free and segment_unmap); a row of
ticks under it marks the segment events, and a red line marks each ``oom``.  Hovering a block
shows its address, size, stream, pool, events and allocation site (the stack's frames from
the innermost user frame outward, ``file:line function``).

HTML output is one self-contained file (inline SVG, CSS and JS; nothing is fetched).  A link
ending in ``#hover=ID`` (the id of a block, e.g. ``d0b12``, or of an OOM marker, ``d0oom0``)
opens the page with that element's hover text shown.  PNG output needs matplotlib.
"""

from __future__ import annotations

import html
import io
import json
import os
import pickle
from bisect import bisect_right
from typing import Dict, List, NamedTuple, Optional, Tuple

_WIDTH = 1100
_LEFT = 190
_RIGHT = 20
_LANES_HEIGHT = 560
_CHART_HEIGHT = 140
_TICKS = 14                       # height of the segment-event row under the chart
#: stream colours (block fills)
_COLORS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#bab0ac")
#: pool colours (the strip left of each lane; block fills when colouring by pool)
_POOL_COLORS = ("#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666")
_SEGMENT_MARKS = {"segment_alloc": ("#2b8a3e", "segment_alloc (cudaMalloc)"),
                  "segment_free": ("#c92a2a", "segment_free (cudaFree)"),
                  "segment_map": ("#74b816", "segment_map (expandable: pages mapped)"),
                  "segment_unmap": ("#f08c00", "segment_unmap (expandable: pages unmapped)")}
_OOM_COLOR = "#d00000"
_MAX_FRAMES = 8                   # frames shown in a hover text
_MIB = 1 << 20
_PENDING_STATES = ("active_pending_free", "active_awaiting_free")   # torch's name; its docstring's


def format_size(n: int) -> str:
    """``n`` bytes for a reader: MiB (GiB from 1 GiB) with two decimals, but sizes under
    0.01 MiB in KiB, and under 1 KiB in bytes (a 512-byte block is not "0.00 MiB")."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if n * 100 >= _MIB:
        return f"{n / _MIB:.2f} MiB"
    if n >= 1024:
        return f"{n / 1024:.2f} KiB"
    return f"{n} B"


_mib = format_size                # the name before issue 17


# ----------------------------------------------------------------------------- frames

_ACCEL_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARY_PARTS = tuple(f"{d}-packages{os.sep}{pkg}{os.sep}" for d in ("site", "dist") for pkg in ("accel", "torch"))


def _is_library_frame(frame: dict) -> bool:
    """A frame that is not the user's: inside accel or torch, or not Python (torch's C++
    frames, which ``stacks="all"`` puts innermost)."""
    name = str(frame.get("filename", ""))
    if not name.endswith(".py"):
        return True
    norm = name.replace("/", os.sep).replace("\\", os.sep)
    return norm.startswith(_ACCEL_DIR) or any(part in norm for part in _LIBRARY_PARTS)


def user_frames(frames) -> List[dict]:
    """The frames of a stack (innermost first) from the innermost user frame outward: frames
    inside accel or torch and C++ frames before it are dropped, and C++ frames after it."""
    frames = [f for f in (frames or ()) if isinstance(f, dict)]
    for i, frame in enumerate(frames):
        if not _is_library_frame(frame):
            return [f for f in frames[i:] if str(f.get("filename", "")).endswith(".py")]
    return frames                  # no user frame: show what there is


def format_frames(frames, limit: int = _MAX_FRAMES) -> List[str]:
    """``file:line function`` lines of ``frames`` from the innermost user frame outward."""
    shown = user_frames(frames)
    lines = [f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '?')}" for f in shown[:limit]]
    if len(shown) > limit:
        lines.append(f"... {len(shown) - limit} outer frames")
    return lines


# ----------------------------------------------------------------------------- model

class BlockInfo:
    """What a block's hover text needs besides its place: its stream, pool, stack, size
    requested, the events that bound it and when its free was requested (None: not freed,
    or freed with nothing pending)."""

    __slots__ = ("stream", "pool", "frames", "requested", "pending", "alloc_t", "end_t", "state")

    def __init__(self, stream: int, pool, frames, requested: int, alloc_t: Optional[int]):
        self.stream, self.pool, self.frames, self.requested = stream, pool, frames or [], requested
        self.pending: Optional[int] = None
        self.alloc_t, self.end_t = alloc_t, None
        self.state = ""


class Block(NamedTuple):
    """A block over its lifetime: in the lane at ``lane``, events ``start``..``end``."""
    lane: int
    start: int
    end: int
    addr: int
    size: int
    info: BlockInfo


class Oom(NamedTuple):
    """An ``oom`` trace entry at event ``t``: ``size`` was asked for on ``stream`` while the
    device had ``device_free`` bytes free."""
    t: int
    size: int
    device_free: Optional[int]
    stream: int
    frames: list


class LaneInfo(NamedTuple):
    stream: int
    pool: Tuple[int, ...]
    frames: list


def _pool(value) -> Optional[Tuple[int, ...]]:
    """A pool id as a tuple (pickles hold tuples, JSON lists); None when absent."""
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return None


class Timeline:
    """Segments, blocks and totals of one device, rebuilt from a snapshot.

    Classic segments (``segment_alloc``/``segment_free``) are one lane each.  An
    expandable segment (snapshot segments with ``is_expandable``; trace events
    ``segment_map``/``segment_unmap``) is reported by the allocator as its mapped
    runs, so, as torch's memory viewer does, mapped ranges of one stream that touch
    are one run: a map grows (or joins) runs and reserved memory, an unmap shrinks
    or splits them.  Every address range of a stream that was mapped at some time
    becomes one lane (kind ``expandable``), and ``runs`` holds its mapped runs over
    time.  Blocks and segments that were allocated before the first event (a trace cut
    short by ``max_entries``) start at time 0.  ``ooms`` are the ``oom`` entries and
    ``marks`` the segment events ``(t, action, addr, size, stream)``.
    """

    def __init__(self, device: int, segments: List[dict], events: List[dict]):
        self.device = device
        self.steps = max(len(events), 1)
        # lane address -> [start, end, size, type]
        self.segments: Dict[int, list] = {}
        self.lane_info: Dict[int, LaneInfo] = {}
        self.blocks: List[Block] = []
        # mapped runs of expandable lanes: (lane, start, end or None, addr, size, stream)
        self.runs: List[Tuple[int, int, Optional[int], int, int, int]] = []
        self.expandable: set = set()
        self.active: List[Tuple[int, int]] = []
        self.reserved: List[Tuple[int, int]] = []
        self.ooms: List[Oom] = []
        self.marks: List[Tuple[int, str, int, int, int]] = []
        seen_allocs = {e.get("addr") for e in events if e.get("action") == "alloc"}
        # a block holds memory until its free completes (after other streams' work);
        # traces without completion events (accel's before issue 16) end blocks at the free
        # request, unless the snapshot shows a pending free: then its completion is to come
        completes = (any(e.get("action") == "free_completed" for e in events)
                     or any(b.get("state") in _PENDING_STATES for s in segments for b in s.get("blocks", ())))
        end_action = "free_completed" if completes else "free_requested"
        seen_segments = {e.get("addr") for e in events if e.get("action") == "segment_alloc"}
        classic = [s for s in segments if not s.get("is_expandable")]
        seg_meta = {s["address"]: s for s in segments}
        snap_blocks = {b["address"]: b for s in segments for b in s.get("blocks", ())}
        mapped = _initial_maps(segments, events)
        early_blocks, early_segments = _before_trace(events, end_action)
        open_blocks: Dict[int, Tuple[int, int, BlockInfo]] = {}
        active = reserved = 0
        for seg in classic:                       # alive before recording began
            if seg["address"] not in seen_segments:
                self.segments[seg["address"]] = [0, None, seg["total_size"], seg.get("segment_type", "")]
                self.lane_info[seg["address"]] = _lane_info(seg)
                reserved += seg["total_size"]
        for addr, event in early_segments.items():    # ... and freed in the trace
            if addr not in self.segments:
                self.segments[addr] = [0, None, event.get("size", 0), ""]
                self.lane_info[addr] = LaneInfo(event.get("stream", 0), _pool(event.get("pool_id")) or (0, 0),
                                                event.get("frames") or [])
                reserved += event.get("size", 0)
        for addr, event in early_blocks.items():
            info = BlockInfo(event.get("stream", 0), _pool(event.get("pool_id")), event.get("frames"),
                             event.get("size", 0), None)
            open_blocks[addr] = (0, event.get("size", 0), info)
            active += event.get("size", 0)
        for seg in segments:
            for block in seg.get("blocks", ()):
                addr = block["address"]
                if block["state"] != "inactive" and addr not in seen_allocs and addr not in open_blocks:
                    info = BlockInfo(seg.get("stream", 0), _pool(seg.get("segment_pool_id")), block.get("frames"),
                                     block.get("requested_size", block["size"]), None)
                    info.state = block["state"]
                    if block["state"] in _PENDING_STATES:
                        info.pending = 0          # its free was requested before the trace began
                    open_blocks[addr] = (0, block["size"], info)
                    active += block["size"]
        reserved += sum(b - a for ivs in mapped.values() for a, b in ivs)
        runs = _Runs(mapped)
        ended = []                                # blocks go into lanes once all lanes are known
        self.active.append((0, active))
        self.reserved.append((0, reserved))
        for t, event in enumerate(events, 1):
            action, addr, size = event.get("action"), event.get("addr", 0), event.get("size", 0)
            if action == "segment_alloc":
                self.segments[addr] = [t, None, size, ""]
                meta = seg_meta.get(addr)
                self.lane_info[addr] = (_lane_info(meta) if meta is not None and not meta.get("is_expandable")
                                        else LaneInfo(event.get("stream", 0), _pool(event.get("pool_id")) or (0, 0),
                                                      event.get("frames") or []))
                reserved += size
            elif action == "segment_free":
                if addr in self.segments:
                    self.segments[addr][1] = t
                reserved -= size
            elif action in ("segment_map", "segment_unmap"):
                runs.change(t, event.get("stream", 0), addr, size, action == "segment_map")
                reserved += size if action == "segment_map" else -size
            elif action == "alloc":
                info = BlockInfo(event.get("stream", 0), _pool(event.get("pool_id")), event.get("frames"), size, t)
                open_blocks[addr] = (t, size, info)
                active += size
            elif action == end_action and addr in open_blocks:
                start, size, info = open_blocks.pop(addr)
                info.end_t = t
                if info.pending is not None and t - info.pending <= 1:
                    info.pending = None           # completed with the request: nothing was pending
                ended.append((start, t, addr, size, info))
                active -= size
            elif action == "free_requested" and addr in open_blocks:
                open_blocks[addr][2].pending = t
            elif action == "oom":
                self.ooms.append(Oom(t, size, event.get("device_free"), event.get("stream", 0),
                                     event.get("frames") or []))
            if action in _SEGMENT_MARKS:
                self.marks.append((t, action, addr, size, event.get("stream", 0)))
            self.active.append((t, active))
            self.reserved.append((t, reserved))
        self._add_expandable(runs.finish(), segments)
        for seg in classic:
            if seg["address"] in self.segments:
                self.segments[seg["address"]][3] = seg.get("segment_type", "")
        self._bases = sorted(self.segments)
        for start, end, addr, size, info in ended:
            self._add_block(start, end, addr, size, info)
        for addr, (start, size, info) in open_blocks.items():
            snap = snap_blocks.get(addr)
            if snap is not None:
                info.state = info.state or snap.get("state", "")
                if not info.frames:
                    info.frames = snap.get("frames") or []
            self._add_block(start, self.steps, addr, size, info)

    def _add_expandable(self, runs, segments) -> None:
        """One lane per address range of a stream that was ever mapped; its runs in it."""
        lanes: Dict[int, list] = {}
        for stream, extent in runs.extents.items():
            for a, b in extent:
                inside = [s for s in segments if s.get("is_expandable") and s.get("stream", 0) == stream
                          and a <= s["address"] < b]
                kinds = sorted({s.get("segment_type", "") for s in inside} - {""})
                lanes[a] = [None, 0, b - a, " ".join(["expandable"] + kinds)]
                pool = next((_pool(s.get("segment_pool_id")) for s in inside), None) or (0, 0)
                frames = next((s.get("frames") for s in inside if s.get("frames")), [])
                self.lane_info[a] = LaneInfo(stream, pool, frames)
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

    def _add_block(self, start, end, addr, size, info: BlockInfo) -> None:
        i = bisect_right(self._bases, addr) - 1
        if i < 0:
            return
        base = self._bases[i]
        if addr < base + self.segments[base][2]:
            if info.pool is None:
                lane = self.lane_info.get(base)
                info.pool = lane.pool if lane is not None else (0, 0)
            self.blocks.append(Block(base, start, end, addr, size, info))

    def streams(self) -> List[int]:
        """Every stream of a block, lane or run, in order of first use (stream 0 first)."""
        seen = {}
        for s in ([b.info.stream for b in self.blocks] + [li.stream for li in self.lane_info.values()]
                  + [r[5] for r in self.runs]):
            seen.setdefault(s, None)
        return sorted(seen, key=lambda s: (s != 0, list(seen).index(s)))

    def pools(self) -> List[Tuple[int, ...]]:
        """Every pool of a block or lane, the default pool (0, 0) first."""
        seen = {}
        for p in [b.info.pool for b in self.blocks] + [self.lane_info[a].pool for a in self.segments
                                                         if a in self.lane_info]:
            seen.setdefault(p or (0, 0), None)
        return sorted(seen, key=lambda p: (p != (0, 0), list(seen).index(p)))

    def lanes(self) -> Dict[int, Tuple[float, float]]:
        """Segment address -> (top y, height) inside the lane area."""
        order = sorted(self.segments)
        if not order:
            return {}
        total = sum(self.segments[a][2] for a in order) or 1
        gap = 2.0
        usable = _LANES_HEIGHT - gap * len(order)
        out, y = {}, 0.0
        for addr in order:
            height = max(usable * self.segments[addr][2] / total, 3.0)
            out[addr] = (y, height)
            y += height + gap
        return out


def _lane_info(seg: dict) -> LaneInfo:
    return LaneInfo(seg.get("stream", 0), _pool(seg.get("segment_pool_id")) or (0, 0), seg.get("frames") or [])


def _before_trace(events: List[dict], end_action: str) -> Tuple[Dict[int, dict], Dict[int, dict]]:
    """Blocks and classic segments allocated before the first event and freed in the trace
    (a trace cut short by ``max_entries``): the addresses whose first event is a free,
    mapped to that event (it carries the size, stream and, with stacks, the frames)."""
    first: Dict[int, dict] = {}
    first_seg: Dict[int, dict] = {}
    for event in events:
        action = event.get("action")
        if action in ("alloc", "free_requested", end_action):
            first.setdefault(event.get("addr"), event)
        elif action in ("segment_alloc", "segment_free"):
            first_seg.setdefault(event.get("addr"), event)
    return ({a: e for a, e in first.items() if e.get("action") != "alloc"},
            {a: e for a, e in first_seg.items() if e.get("action") == "segment_free"})


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
        if event.get("action") in ("segment_map", "segment_unmap"):
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


# ----------------------------------------------------------------------------- reading

class _PlainUnpickler(pickle.Unpickler):
    """Builds plain data only: a snapshot pickle (torch's or accel's) holds dicts, lists,
    tuples, strings and numbers; any class or function reference is refused, so reading a
    file runs no code from it."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"the pickle refers to {module}.{name}; a memory snapshot holds only "
                                     f"dicts, lists, strings and numbers, so it is not read")


def read_snapshot(path: str) -> dict:
    """The snapshot at ``path`` as a dict with ``segments`` and ``device_traces``: a pickle
    (torch's ``_dump_snapshot``, accel's ``dump_snapshot``) or JSON (accel's ``.json``)."""
    with open(path, "rb") as fh:
        raw = fh.read()
    if raw[:1] == b"\x80":                        # a pickle of protocol 2 or newer
        try:
            data = _PlainUnpickler(io.BytesIO(raw)).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError) as exc:
            raise ValueError(f"{path}: not a readable snapshot pickle ({exc})") from None
    else:
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: neither a snapshot pickle nor JSON ({exc}); write one with "
                             f"accel.memory.dump_snapshot or torch.cuda.memory._dump_snapshot") from None
    if isinstance(data, list):
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, dict) or not ("segments" in data or "device_traces" in data):
        raise ValueError(f"{path}: not a memory snapshot (expected a dict with 'segments' and "
                         f"'device_traces', as accel.memory.dump_snapshot and torch.cuda.memory._dump_snapshot "
                         f"write)")
    return data


def timelines(data: dict) -> List[Timeline]:
    """One :class:`Timeline` per device of snapshot ``data``."""
    segments = data.get("segments") or []
    traces = data.get("device_traces") or []
    devices = sorted({s.get("device", 0) for s in segments} | {d for d, tr in enumerate(traces) if tr})
    return [Timeline(d, [s for s in segments if s.get("device", 0) == d],
                     traces[d] if d < len(traces) else []) for d in devices] or [Timeline(0, [], [])]


def load(path: str) -> List[Timeline]:
    """The timelines of the snapshot file at ``path`` (pickle or JSON)."""
    return timelines(read_snapshot(path))


# ----------------------------------------------------------------------------- drawing

def _stream_name(stream: int) -> str:
    return "stream 0 (default)" if stream == 0 else f"stream {stream:#x}"


def _pool_name(pool) -> str:
    pool = tuple(pool or (0, 0))
    return "default pool" if pool == (0, 0) else f"private pool {pool}"


def _block_text(b: Block, tl: Timeline) -> str:
    info = b.info
    req = f" (requested {format_size(info.requested)})" if info.requested and info.requested != b.size else ""
    lane_kind = tl.segments[b.lane][3]
    lines = [f"block {b.addr:#x} {format_size(b.size)}{req}",
             f"{_stream_name(info.stream)}, {_pool_name(info.pool)}, segment {b.lane:#x}"
             + (f" ({lane_kind})" if lane_kind else "")]
    alloc = f"allocated at event {info.alloc_t}" if info.alloc_t is not None else "allocated before the trace"
    if info.end_t is not None:
        done = f"free completed at event {info.end_t}" if info.pending is not None else f"freed at event {info.end_t}"
    else:
        done = "live at the snapshot"
    lines.append(f"{alloc}; {done}")
    if info.pending is not None:
        until = f"event {info.end_t}" if info.end_t is not None else "the snapshot"
        since = f"event {info.pending}" if info.pending else "before the trace"
        lines.append(f"pending free from {since} until {until}: freed, waiting on other streams' events")
    elif info.state in _PENDING_STATES:
        lines.append("pending free at the snapshot: freed, waiting on other streams' events")
    frames = format_frames(info.frames)
    lines += (["allocated at:"] + ["  " + f for f in frames]) if frames else ["(no stack recorded)"]
    return "\n".join(lines)


def _oom_text(o: Oom) -> str:
    free = f"; the device had {format_size(o.device_free)} free" if o.device_free is not None else ""
    lines = [f"OUT OF MEMORY at event {o.t}", f"{format_size(o.size)} requested on {_stream_name(o.stream)}{free}"]
    frames = format_frames(o.frames)
    lines += (["requested at:"] + ["  " + f for f in frames]) if frames else []
    return "\n".join(lines)


def _svg(tl: Timeline, colors: Dict[int, str], pool_colors: Dict[tuple, str]) -> str:
    plot_w = _WIDTH - _LEFT - _RIGHT
    top = _CHART_HEIGHT + _TICKS + 16
    height = top + _LANES_HEIGHT + 20
    sx = plot_w / tl.steps
    d = tl.device
    esc = html.escape
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" '
             f'font-family="sans-serif" font-size="11">'
             f'<defs><pattern id="hatch{d}" width="6" height="6" patternUnits="userSpaceOnUse" '
             f'patternTransform="rotate(45)"><rect width="6" height="6" fill="#fff" fill-opacity="0.55"/>'
             f'<line x1="0" y1="0" x2="0" y2="6" stroke="#000" stroke-width="2.2"/></pattern></defs>']
    # totals chart
    peak = max([v for _, v in tl.reserved] + [v for _, v in tl.active] + [1])
    parts.append(f'<line x1="{_LEFT}" y1="{_CHART_HEIGHT}" x2="{_LEFT + plot_w}" y2="{_CHART_HEIGHT}" stroke="#bbb"/>')
    for name, series, color in (("reserved", tl.reserved, "#888"), ("active", tl.active, "#4e79a7")):
        points = " ".join(f"{_LEFT + t * sx:.1f},{_CHART_HEIGHT - v / peak * (_CHART_HEIGHT - 10):.1f}"
                          for t, v in series)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}">'
                     f'<title>{name} memory (peak {format_size(max(v for _, v in series))})</title></polyline>')
    parts.append(f'<text x="4" y="14">peak {format_size(peak)}</text>'
                 f'<text x="4" y="30" fill="#888">reserved</text>'
                 f'<text x="4" y="46" fill="#4e79a7">active</text>'
                 f'<text x="4" y="{_CHART_HEIGHT + _TICKS}" fill="#555">segment events</text>')
    # segment events
    for t, action, addr, size, stream in tl.marks:
        color, what = _SEGMENT_MARKS[action]
        x = _LEFT + t * sx
        parts.append(f'<rect x="{x - 1:.1f}" y="{_CHART_HEIGHT + 4}" width="2.5" height="{_TICKS - 2}" fill="{color}">'
                     f'<title>{esc(action)} at event {t}: {addr:#x} {format_size(size)}, {_stream_name(stream)}'
                     f'</title></rect>')
    lanes = tl.lanes()
    for addr, (y, h) in lanes.items():
        start, end, size, kind = tl.segments[addr]
        end = tl.steps if end is None else end
        info = tl.lane_info.get(addr) or LaneInfo(0, (0, 0), [])
        frames = format_frames(info.frames, 4)
        where = ("\nallocated at:\n" + "\n".join("  " + f for f in frames)) if frames else ""
        x, w = _LEFT + start * sx, max((end - start) * sx, 1)
        if addr in tl.expandable:               # the address range; its mapped runs below
            parts.append(f'<rect x="{x:.1f}" y="{top + y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="none" '
                         f'stroke="#bbb" stroke-dasharray="4 3"><title>expandable segment {addr:#x}: '
                         f'{format_size(size)} of addresses mapped at some time ({esc(kind)}), '
                         f'{_stream_name(info.stream)}, {_pool_name(info.pool)}{esc(where)}</title></rect>')
        else:
            parts.append(f'<rect x="{x:.1f}" y="{top + y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="#eee" '
                         f'stroke="#ccc"><title>segment {addr:#x} {format_size(size)} {esc(kind)}, '
                         f'{_stream_name(info.stream)}, {_pool_name(info.pool)}{esc(where)}</title></rect>')
        parts.append(f'<rect x="{_LEFT - 6}" y="{top + y:.1f}" width="4" height="{h:.1f}" '
                     f'fill="{pool_colors[info.pool]}"><title>{_pool_name(info.pool)}</title></rect>')
        if h >= 9:
            tag = " expandable" if addr in tl.expandable else ""
            parts.append(f'<text x="4" y="{top + y + min(h, 20) - 4:.1f}">{addr:#x} {format_size(size)}{tag}</text>')
    for base, start, end, addr, size, stream in tl.runs:
        y, h = lanes[base]
        lane_size = tl.segments[base][2]
        end = tl.steps if end is None else end
        parts.append(f'<rect x="{_LEFT + start * sx:.1f}" y="{top + y + (addr - base) / lane_size * h:.2f}" '
                     f'width="{max((end - start) * sx, 1):.1f}" height="{max(size / lane_size * h, 0.5):.2f}" '
                     f'fill="#eee" stroke="#ccc"><title>mapped run {addr:#x} {format_size(size)} of expandable '
                     f'segment {base:#x} ({_stream_name(stream)}), mapped at event {start}, '
                     f'{"still mapped" if end == tl.steps else f"unmapped at event {end}"}</title></rect>')
    for i, b in enumerate(tl.blocks):
        y, h = lanes[b.lane]
        seg_size = tl.segments[b.lane][2]
        by = top + y + (b.addr - b.lane) / seg_size * h
        bh = max(b.size / seg_size * h, 0.5)
        cs, cp = colors[b.info.stream], pool_colors[b.info.pool]
        x, w = _LEFT + b.start * sx, max((b.end - b.start) * sx, 0.5)
        parts.append(f'<rect id="d{d}b{i}" class="blk" x="{x:.1f}" y="{by:.2f}" width="{w:.1f}" height="{bh:.2f}" '
                     f'fill="{cs}" data-cs="{cs}" data-cp="{cp}"><title>{esc(_block_text(b, tl))}</title></rect>')
        pending = b.info.pending if b.info.pending is not None else (
            b.start if b.info.state in _PENDING_STATES else None)
        if pending is not None:
            px = _LEFT + max(pending, b.start) * sx
            parts.append(f'<rect class="pend" x="{px:.1f}" y="{by:.2f}" width="{max(x + w - px, 1.5):.1f}" '
                         f'height="{bh:.2f}" fill="url(#hatch{d})" pointer-events="none"/>')
    for i, o in enumerate(tl.ooms):
        x = _LEFT + o.t * sx
        parts.append(f'<g id="d{d}oom{i}" class="oom"><title>{esc(_oom_text(o))}</title>'
                     f'<line x1="{x:.1f}" y1="2" x2="{x:.1f}" y2="{top + _LANES_HEIGHT:.0f}" stroke="{_OOM_COLOR}" '
                     f'stroke-width="1.5" stroke-dasharray="5 3"/>'
                     f'<rect x="{x - 4:.1f}" y="2" width="8" height="{top + _LANES_HEIGHT - 2:.0f}" fill="#fff" '
                     f'fill-opacity="0"/>'
                     f'<text x="{x + 3 if x < _LEFT + plot_w - 34 else x - 3:.1f}" y="12" fill="{_OOM_COLOR}" '
                     f'font-weight="bold" text-anchor="{"start" if x < _LEFT + plot_w - 34 else "end"}">OOM</text></g>')
    parts.append(f'<text x="{_LEFT}" y="{height - 4}">time (allocator events) →</text></svg>')
    return "".join(parts)


def _swatch(fill: str, extra: str = "") -> str:
    return (f'<svg width="14" height="12"><rect x="0.5" y="0.5" width="13" height="11" fill="{fill}" {extra}/>'
            f'</svg>')


def _legend(tl: Timeline, colors: Dict[int, str], pool_colors: Dict[tuple, str]) -> str:
    d = tl.device
    streams = "".join(f'<span class="key">{_swatch(colors[s])} {html.escape(_stream_name(s))}</span>'
                      for s in tl.streams())
    pools = "".join(f'<span class="key">{_swatch(pool_colors[p])} {html.escape(_pool_name(p))}</span>'
                    for p in tl.pools())
    hatch = (f'<svg width="14" height="12"><rect x="0.5" y="0.5" width="13" height="11" fill="#4e79a7"/>'
             f'<rect x="0.5" y="0.5" width="13" height="11" fill="url(#hatch{d})"/></svg>')
    dashed = _swatch("none", 'stroke="#999" stroke-dasharray="3 2"')
    plain = _swatch("#eee", 'stroke="#ccc"')
    marks = "".join(f'<span class="key">{_swatch(c)} {html.escape(w)}</span>' for c, w in _SEGMENT_MARKS.values())
    return (f'<div class="legend" id="legend{d}">'
            f'<div><b>Blocks by stream</b> {streams}</div>'
            f'<div><b>Pools</b> (strip left of each segment) {pools}</div>'
            f'<div><span class="key">{hatch} pending free (freed, waiting on other streams\' events)</span>'
            f'<span class="key"><svg width="14" height="12"><line x1="7" y1="0" x2="7" y2="12" stroke="{_OOM_COLOR}" '
            f'stroke-width="2" stroke-dasharray="3 2"/></svg> OOM</span>'
            f'<span class="key">{dashed} expandable segment (grey: mapped runs)</span>'
            f'<span class="key">{plain} segment</span></div>'
            f'<div><b>Segment events</b> {marks}</div></div>')


_CSS = ("body{font-family:sans-serif;margin:16px;color:#222} svg{border:1px solid #ddd} h2{font-size:16px;margin:18px 0 4px}"
        " .legend{font-size:12px;margin:4px 0 6px} .legend div{margin:2px 0} .key{margin-right:12px;white-space:nowrap}"
        " .key svg{border:none;vertical-align:middle} .controls{font-size:13px;margin:6px 0}"
        " #tip{position:fixed;display:none;z-index:10;max-width:820px;background:#1e1e1e;color:#f4f4f4;"
        "font:12px/1.35 monospace;white-space:pre-wrap;padding:6px 8px;border-radius:4px;pointer-events:none;"
        "box-shadow:0 2px 8px rgba(0,0,0,.35)} .hot{stroke:#000;stroke-width:1.5}")

# Hover texts: each <title> becomes the element's data-tip, shown in #tip next to the pointer
# (native tooltips are slow and plain); "#hover=ID" shows one at load; the radio buttons
# colour blocks by stream or by pool.
_JS = r"""
(function(){
  var tip=document.getElementById('tip'), hot=null;
  document.querySelectorAll('svg title').forEach(function(t){
    var p=t.parentNode; if(p.tagName.toLowerCase()==='svg')return;
    p.setAttribute('data-tip',t.textContent); p.removeChild(t);});
  function show(el,x,y){
    if(hot)hot.classList.remove('hot'); hot=el; if(el.tagName.toLowerCase()==='rect')el.classList.add('hot');
    tip.textContent=el.getAttribute('data-tip'); tip.style.display='block';
    var w=tip.offsetWidth,h=tip.offsetHeight;
    tip.style.left=Math.max(4,Math.min(x+14,window.innerWidth-w-8))+'px';
    tip.style.top=Math.max(4,(y+16+h>window.innerHeight)?y-h-10:y+16)+'px';}
  function hide(){tip.style.display='none'; if(hot)hot.classList.remove('hot'); hot=null;}
  document.addEventListener('mousemove',function(e){
    var el=e.target.closest?e.target.closest('[data-tip]'):null;
    if(el)show(el,e.clientX,e.clientY); else hide();});
  document.querySelectorAll('input[name=colorby]').forEach(function(r){
    r.addEventListener('change',function(){
      var key=r.value==='pool'?'data-cp':'data-cs';
      document.querySelectorAll('rect.blk').forEach(function(b){b.setAttribute('fill',b.getAttribute(key));});});});
  var m=/^#hover=([\w-]+)$/.exec(location.hash);
  if(m){var el=document.getElementById(m[1]);
    if(el){el.scrollIntoView({block:'center'}); var r=el.getBoundingClientRect();
      if(!el.getAttribute('data-tip')){var c=el.querySelector('[data-tip]'); if(c)el=c;}
      show(el,r.left+Math.min(r.width/2,60),r.top+r.height/2);}}
})();
"""


def _palettes(tls: List[Timeline]) -> Tuple[Dict[int, str], Dict[tuple, str]]:
    streams, pools = [], []
    for tl in tls:
        streams += [s for s in tl.streams() if s not in streams]
        pools += [p for p in tl.pools() if p not in pools]
    return ({s: _COLORS[i % len(_COLORS)] for i, s in enumerate(streams)},
            {p: _POOL_COLORS[i % len(_POOL_COLORS)] for i, p in enumerate(pools)})


def html_page(tls: List[Timeline], title: str) -> str:
    """The self-contained page for ``tls``."""
    colors, pool_colors = _palettes(tls)
    body = []
    for tl in tls:
        exp = (f" ({len(tl.expandable)} expandable, {len(tl.runs)} mapped runs)" if tl.expandable else "")
        pending = sum(1 for b in tl.blocks if b.info.pending is not None or b.info.state in _PENDING_STATES)
        body.append(f"<h2>device {tl.device}: {len(tl.segments)} segments{exp}, {len(tl.blocks)} blocks, "
                    f"{tl.steps} events, {len(tl.streams())} streams, {pending} pending frees, "
                    f"{len(tl.ooms)} OOMs</h2>")
        body.append(_legend(tl, colors, pool_colors))
        body.append(_svg(tl, colors, pool_colors))
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" + html.escape(title) +
            "</title><style>" + _CSS + "</style></head><body><h1>" + html.escape(title) + "</h1>"
            "<p>Each grey lane is a segment (height ∝ size; the strip on its left is its pool's colour); "
            "coloured rectangles are blocks over their lifetime, hatched while a freed block waits on "
            "other streams' work. A dashed lane is an expandable segment: its grey parts are the mapped runs "
            "(a map grows reserved memory, an unmap shrinks it). Red dashed lines are OOMs. "
            "Hover for addresses, sizes, streams and allocation sites.</p>"
            "<div class=\"controls\">Colour blocks by <label><input type=\"radio\" name=\"colorby\" value=\"stream\" "
            "checked> stream</label> <label><input type=\"radio\" name=\"colorby\" value=\"pool\"> pool</label></div>"
            + "".join(body) + "<div id=\"tip\"></div><script>" + _JS + "</script></body></html>\n")


def write_html(timelines: List[Timeline], out: str, title: str) -> None:
    with open(out, "w", encoding="utf-8") as fh:
        fh.write(html_page(timelines, title))


def write_png(timelines: List[Timeline], out: str, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Rectangle
    except ImportError:
        raise RuntimeError(f"writing {out}: PNG output needs matplotlib, which is not installed; "
                           f"write an .html timeline instead (-o timeline.html)") from None
    colors, _ = _palettes(timelines)
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
        for base, start, end, addr, size, info in tl.blocks:
            y, h = lanes[base]
            seg_size = tl.segments[base][2]
            ax.add_patch(Rectangle((start, y + (addr - base) / seg_size * h), end - start,
                                   size / seg_size * h, color=colors[info.stream],
                                   hatch="//" if info.pending is not None else None))
        for o in tl.ooms:
            ax.axvline(o.t, color=_OOM_COLOR, linestyle="--")
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
    """Draw ``snapshot`` (a pickle, torch's or accel's, or accel's JSON) into ``out``
    (.html, or .png with matplotlib)."""
    lower = out.lower()
    if not lower.endswith((".html", ".htm", ".png")):
        raise ValueError(f"output {out!r}: expected a .html or .png file name")
    tls = load(snapshot)
    title = f"accel memory timeline: {snapshot}"
    if lower.endswith(".png"):
        write_png(tls, out, title)
    else:
        write_html(tls, out, title)
