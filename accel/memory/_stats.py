"""Memory statistics with the keys of ``torch.cuda.memory_stats()``.

Counters live in flat int lists indexed by ``stat + pool`` so the
allocator's hot path is plain list arithmetic.  ``pool`` is 0 for ``all``,
1 for ``small_pool``, 2 for ``large_pool`` (torch's StatType order).
"""

from __future__ import annotations

from collections import OrderedDict

POOL_NAMES = ("all", "small_pool", "large_pool")
#: Pooled stats, in torch's order; each takes three slots (all, small, large).
POOLED = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
          "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
ALLOCATION, SEGMENT, ACTIVE, INACTIVE_SPLIT, ALLOCATED_BYTES, RESERVED_BYTES, ACTIVE_BYTES, \
    INACTIVE_SPLIT_BYTES, REQUESTED_BYTES = range(0, 27, 3)
OVERSIZE_ALLOCATIONS = 27
OVERSIZE_SEGMENTS = 28
N_STATS = 29

SCALARS = ("num_alloc_retries", "num_ooms", "max_split_size", "num_sync_all_streams",
           "num_device_alloc", "num_device_free", "num_oom_rejections")
STAT_FIELDS = ("current", "peak", "allocated", "freed")


def empty_counters():
    """(current, peak, allocated, freed) lists, all zero."""
    return [0] * N_STATS, [0] * N_STATS, [0] * N_STATS, [0] * N_STATS


def _layout():
    """[(key, column, index)] of flatten's counter keys: column 0..3 (current, peak, allocated,
    freed) and the stat slot, or column None and a scalar's name."""
    rows = []
    for s, name in enumerate(POOLED):
        for p, pool in enumerate(POOL_NAMES):
            rows += [(f"{name}.{pool}.{field}", c, 3 * s + p) for c, field in enumerate(STAT_FIELDS)]
    for name, index in (("oversize_allocations", OVERSIZE_ALLOCATIONS),
                        ("oversize_segments", OVERSIZE_SEGMENTS)):
        rows += [(f"{name}.{field}", c, index) for c, field in enumerate(STAT_FIELDS)]
    rows += [(name, None, name) for name in SCALARS]
    return rows


_LAYOUT = _layout()
#: memory_stats() is read in loops (a training step's logging, the tests' invariants): the
#: sorted key order without private pools is computed once
_SORTED = sorted(_LAYOUT)


def flatten(current, peak, allocated, freed, scalars, pools=None) -> "OrderedDict[str, int]":
    """The flat keys of torch 2.13's torch.cuda.memory_stats(), sorted: 123, and for each private
    pool in ``pools`` (id -> [current, peak, allocated, freed] x (all, small, large)) its
    ``reserved_bytes_by_private_pools.<a>_<b>.<pool>.<field>`` (torch joins the id's parts with
    "_")."""
    columns = (current, peak, allocated, freed)
    if not pools:
        return OrderedDict([(key, scalars.get(i, 0) if c is None else columns[c][i]) for key, c, i in _SORTED])
    out = {key: scalars.get(i, 0) if c is None else columns[c][i] for key, c, i in _LAYOUT}
    for pool_id, st in pools.items():
        name = "_".join(str(part) for part in pool_id)
        for p, pool in enumerate(POOL_NAMES):
            for f, field in enumerate(STAT_FIELDS):
                out[f"reserved_bytes_by_private_pools.{name}.{pool}.{field}"] = st[3 * f + p]
    return OrderedDict(sorted(out.items()))


def format_size(nbytes: int) -> str:
    """torch's ``format_size`` for OOM messages: bytes, KiB, MiB or GiB with 2 decimals."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= 1 << 20:
        return f"{nbytes / 1024:.2f} KiB"
    if nbytes <= 1 << 30:
        return f"{nbytes / (1 << 20):.2f} MiB"
    return f"{nbytes / (1 << 30):.2f} GiB"


# Packed counters.  The hot path keeps counters that always change together
# (count, bytes, requested bytes of the "all" pool and of the block's pool) in
# 64-bit lanes of one Python int, so one addition updates all of them, and a
# new peak in any lane is detected with one subtraction: with the top bit of
# every lane set in ``peak | guard``, subtracting ``cur`` clears a lane's
# guard bit exactly when that lane of ``cur`` exceeds its peak (no lane ever
# borrows from its neighbour because every lane stays below 2**63).
LANE = 64
LANE_MASK = (1 << LANE) - 1


def guard(nlanes: int) -> int:
    return sum(1 << (LANE * i + LANE - 1) for i in range(nlanes))


def unpack(value: int, nlanes: int) -> list:
    return [(value >> (LANE * i)) & LANE_MASK for i in range(nlanes)]


def pack(values) -> int:
    out = 0
    for i, v in enumerate(values):
        out |= v << (LANE * i)
    return out


def raise_peaks(guarded: int, cur: int, guard_bits: int) -> int:
    """``guarded`` (the peaks, each lane's top bit set: ``peak | guard``) with every lane
    that ``cur`` exceeds raised to ``cur``'s, in a few whole-int operations instead of a
    loop over the lanes.  A lane's guard bit survives ``guarded - cur`` exactly when it
    did not go up; shifting the cleared bits down to each lane's bit 0 and multiplying by
    ``LANE_MASK`` fills those lanes (no carry leaves a lane)."""
    grew = ~(guarded - cur) & guard_bits
    mask = (grew >> (LANE - 1)) * LANE_MASK
    return guarded ^ ((guarded ^ (cur | guard_bits)) & mask)
