"""Memory snapshots in torch's layout: stacks, history options, and the file torch's tools read.

torch's snapshot (``torch.cuda.memory._snapshot()``, built by ``_memory_snapshot_pickled`` in
``torch/csrc/cuda/memory_snapshot.cpp``) is::

    {"segments": [{device, address, total_size, allocated_size, active_size, requested_size,
                   stream, segment_type, segment_pool_id, is_expandable, frames,
                   blocks: [{address, size, requested_size, state, frames}]}],
     "device_traces": [[{action, addr | device_free (oom), size, stream, compile_context,
                         user_metadata, pool_id, frames (when recorded), time_us}]],   # per device
     "allocator_settings": {...}, "external_annotations": []}

A frame is ``{"filename", "line", "name"}`` and a stack lists them innermost first: torch's
Python frames start at the user's line that allocated.  accel's stacks start at the first frame
outside the accel package and walk outward.  ``python -m torch.cuda._memory_viz`` and the
pytorch.org/memory_viz page read the pickle ``torch.cuda.memory._dump_snapshot`` writes
(``pickle.dump``: protocol 4 up to Python 3.13, and the page reads no newer one), so
:func:`dump` writes protocol 4, and JSON only for a path ending in ``.json``.

Cost.  While history records stacks, every allocation walks the Python stack with
``sys._getframe`` and keeps each frame's code object and instruction offset, as torch's
CapturedTraceback keeps raw frames; line numbers, names and dicts are made only in a
snapshot, each distinct stack once.  That is about 0.12 us a frame (4 us for a 32-frame
stack on this project's 2-core machine; ``f_lineno`` per frame makes it 7 us, and
``traceback.extract_stack``, which also reads source lines, 77 us).  With history off
nothing is walked.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from bisect import bisect_right
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple

#: torch's RecordContext levels (c10/cuda/CUDACachingAllocator.h): what keeps a stack
CTX_NEVER = 0      # no stacks
CTX_STATE = 1      # live blocks and segments keep their allocation's stack
CTX_ALLOC = 2      # ... and trace entries carry stacks: a free carries its allocation's
CTX_ALL = 3        # ... and a free or release carries its own caller's stack
_CONTEXTS = {None: CTX_NEVER, "state": CTX_STATE, "alloc": CTX_ALLOC, "all": CTX_ALL}

#: trace actions torch records (and skip_actions may name)
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "oom", "snapshot")

#: pickle protocol of torch's dump (pickle.DEFAULT_PROTOCOL up to Python 3.13)
PICKLE_PROTOCOL = 4

#: accel's package directory: recorded stacks start at the first frame outside it
_ACCEL_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

#: a recorded stack: [code, instruction offset, code, offset, ...], innermost frame first
#: (never changed once made; blocks and trace records share it)
Stack = List[object]


def stack() -> Stack:
    """The caller's Python stack, innermost first, from the first frame outside accel, as
    :data:`Stack` (symbolized later by :class:`Symbols`)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_ACCEL_DIR):
        frame = frame.f_back
    out = []
    append = out.append
    while frame is not None:
        append(frame.f_code)
        append(frame.f_lasti)
        frame = frame.f_back
    return out


class Symbols:
    """Turns stacks into torch's frame lists, each distinct stack and frame once (as torch's
    ``ivalue_symbolize`` dedups): the pickle then stores every frame once."""

    __slots__ = ("_frames", "_stacks", "_lines")

    def __init__(self) -> None:
        self._frames: Dict[tuple, dict] = {}
        self._stacks: Dict[int, Tuple[Stack, list]] = {}
        self._lines: Dict[object, Tuple[list, list]] = {}

    def frames(self, st: Optional[Stack]) -> list:
        if not st:
            return []
        got = self._stacks.get(id(st))
        if got is not None and got[0] is st:
            return got[1]
        memo = self._frames
        out = []
        for i in range(0, len(st), 2):
            code, offset = st[i], st[i + 1]
            frame = memo.get((code, offset))
            if frame is None:
                frame = memo[(code, offset)] = {"filename": code.co_filename, "line": self._line(code, offset),
                                                "name": code.co_name}
            out.append(frame)
        self._stacks[id(st)] = (st, out)       # the stack is kept so its id is not reused
        return out

    def _line(self, code, offset: int) -> int:
        """The line of the instruction at byte ``offset``: what ``frame.f_lineno`` says
        (PyCode_Addr2Line over ``co_lines()``); the def line where the table has none."""
        table = self._lines.get(code)
        if table is None:
            starts, rows = [], []
            for start, end, line in code.co_lines():
                starts.append(start)
                rows.append((end, line))
            table = self._lines[code] = (starts, rows)
        starts, rows = table
        i = bisect_right(starts, offset) - 1
        if i >= 0:
            end, line = rows[i]
            if offset < end and line is not None:
                return line
        return code.co_firstlineno


def trace_entry(record: tuple, symbols: Symbols) -> dict:
    """torch's trace entry from an allocator's ``(action, addr, size, stream, time_us, stack,
    user_metadata, pool_id)`` record; ``addr`` is the device's free bytes for ``oom`` (torch's
    ``device_free``), ``pool_id`` the memory's private pool ((0, 0): none; torch 2.13), and
    ``frames`` is present when the entry kept a stack (``stack`` not None)."""
    action, addr, size, stream, time_us, st, metadata, pool_id = record
    entry = {"action": action, ("device_free" if action == "oom" else "addr"): addr, "size": size,
             "stream": stream, "compile_context": "", "user_metadata": metadata, "pool_id": pool_id}
    if st is not None:
        entry["frames"] = symbols.frames(st)
    entry["time_us"] = time_us
    return entry


def allocator_settings(config, expandable: bool) -> dict:
    """torch's ``allocator_settings`` for an allocator with ``config`` (an AllocConfig).  The
    torch options accel accepts and ignores report torch's defaults, which is how accel behaves."""
    return {
        "PYTORCH_CUDA_ALLOC_CONF": config.text,     # torch's last_allocator_settings
        # torch's int64 of SIZE_MAX (no limit) is -1
        "max_split_size": config.max_split_size if config.max_split_size < (1 << 63) else -1,
        "garbage_collection_threshold": float(config.garbage_collection_threshold),
        "expandable_segments": bool(expandable),
        "pinned_num_register_threads": 1,
        "release_lock_on_cudamalloc": False,
        "pinned_use_cuda_host_register": False,
        "graph_capture_record_stream_reuse": False,
        # one entry per power-of-two interval from 1 MiB, keyed "1", "2", "4", ... as torch's
        "roundup_power2_divisions": {str(1 << i): int(d) for i, d in enumerate(config.roundup_power2_divisions)},
    }


class HistoryOptions(NamedTuple):
    """Checked ``record_history`` arguments."""

    max_entries: int
    context: int            # CTX_*
    skip: frozenset         # actions not recorded


def history_options(enabled, context, stacks, max_entries, skip_actions) -> Optional[HistoryOptions]:
    """Check ``record_history``'s (torch's ``_record_memory_history``) arguments; None when
    ``enabled`` turns recording off.  Nothing is changed on a bad value."""
    if enabled is True or enabled == "all":
        keep_all = True
    elif enabled is False or enabled is None:
        keep_all = None
    elif enabled == "state":
        keep_all = False
    else:
        raise ValueError(f"record_history: enabled={enabled!r}: expected state to be 'state', 'all', or None "
                         f"(True and False are accel's spelling of 'all' and None)")
    if isinstance(context, str) or context is None:
        level = _CONTEXTS.get(context, -1)
    else:
        level = -1
    if level < 0:
        raise ValueError(f"record_history: context={context!r}: expected context to be 'state', 'alloc', "
                         f"'all', or None")
    if stacks is False:
        level = CTX_NEVER                      # accel's spelling: no stacks at all
    elif not (stacks is True or stacks in ("python", "all")):
        raise ValueError(f"record_history: stacks={stacks!r}: expected stacks to be 'python', or 'all' "
                         f"(accel records Python frames for both; True/False: with or without stacks)")
    if isinstance(max_entries, bool) or not hasattr(type(max_entries), "__index__"):
        raise TypeError(f"record_history: max_entries must be an int >= 1, got "
                        f"{type(max_entries).__name__} {max_entries!r}")
    max_entries = max_entries.__index__()
    if max_entries < 1:
        raise ValueError(f"record_history: max_entries must be >= 1, got {max_entries}; pass the number of "
                         f"allocation events to keep (default 100000)")
    # torch's default is sys.maxsize (a size_t in C++); a larger count keeps everything too, and
    # deque(maxlen=) takes no more than sys.maxsize (it raised OverflowError after the options were stored)
    max_entries = min(max_entries, sys.maxsize)
    skip = _skip_actions(skip_actions)
    if keep_all is None:
        return None
    # torch keeps one entry for "state" (max_entries only applies to "all")
    return HistoryOptions(max_entries if keep_all else 1, level, skip)


def _skip_actions(skip_actions: Optional[Iterable[str]]) -> frozenset:
    if skip_actions is None:
        return frozenset()
    if isinstance(skip_actions, str):
        raise TypeError(f"record_history: skip_actions must be a list of action names, got the string "
                        f"{skip_actions!r}; write [{skip_actions!r}]")
    try:
        names = list(skip_actions)
    except TypeError:
        raise TypeError(f"record_history: skip_actions must be a list of action names, got "
                        f"{skip_actions!r}") from None
    for name in names:
        if name not in ACTIONS:
            raise ValueError(f"record_history: skip_actions names unknown action {name!r}; valid actions: "
                             f"{', '.join(ACTIONS)}")
    return frozenset(names)


def dump(data: dict, path) -> None:
    """Write snapshot ``data`` to ``path``: JSON when the name ends in ``.json``, else a pickle
    (protocol 4), as torch's ``_dump_snapshot``."""
    name = os.fspath(path)
    if name.endswith(b".json" if isinstance(name, bytes) else ".json"):
        with open(name, "w") as fh:
            json.dump(data, fh)
    else:
        with open(name, "wb") as fh:
            pickle.dump(data, fh, protocol=PICKLE_PROTOCOL)
