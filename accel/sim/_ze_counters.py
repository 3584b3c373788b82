"""The Sysman counters of the simulated Level Zero driver: engine activity, device-memory
traffic and energy, per tile (stack), driven by the work the simulated command lists run.

Sysman gives these as monotonic counters that a tool samples twice (``zes_api.h`` v1.4):

* ``zes_engine_stats_t``: ``activeTime``, a "monotonic counter for time in microseconds that
  this resource is actively running workloads", and ``timestamp`` (microseconds, only for
  deltas); "%util = (s2.activeTime - s1.activeTime) / (s2.timestamp - s1.timestamp)".
* ``zes_mem_bandwidth_t``: ``readCounter``/``writeCounter`` ("total bytes read from / written
  to memory"), ``maxBandwidth`` (bytes/s) and ``timestamp``; "%bw = 10^6 * ((s2.readCounter -
  s1.readCounter) + (s2.writeCounter - s1.writeCounter)) / (s2.maxBandwidth * (s2.timestamp -
  s1.timestamp))".
* ``zes_power_energy_counter_t``: ``energy`` ("the monotonic energy counter in microjoules") and
  ``timestamp`` (microseconds); "PowerWatts = (s2.energy - s1.energy) / (s2.timestamp -
  s1.timestamp)".

The model (a simulator has no sensors):

* An operation that does work (a copy or fill; markers such as signals and barriers do not) is
  *active* from when its worker starts it, less the configured ``ACCEL_SIM_DELAY_US`` latency it
  slept first, until it completes.  Each engine group of each tile the command list's device
  spans (a card device spans all of its tiles) accumulates the union of these intervals:
  ``all`` for every operation, ``compute`` or ``copy`` by the command queue group ordinal the
  list or queue was created for.  An operation counts when it completes, so ``activeTime`` never
  runs ahead of ``timestamp``.
* Traffic: a copy reads its size from device memory when its source is device memory (USM
  device memory or mapped virtual memory) and writes its size when its destination is; a fill
  writes its size.  Bytes are counted on the tiles of the device that runs the operation (split
  evenly), whichever card's memory the pointers name.  ``maxBandwidth`` is a fixed nominal value.
* Energy: each card draws :data:`POWER_IDLE_MW` while idle and :data:`POWER_BUSY_MW` while all of
  its tiles are active (``all`` group), shared evenly by its tiles, so a tile's energy is
  ``idle * elapsed + (busy - idle) * activeTime`` from the runtime's start.

State is bounded: a fixed number of integers per tile of each card.
"""

from __future__ import annotations

import time
from typing import Dict, Iterable

#: Engine groups each tile reports (zes_engine_group_t ZES_ENGINE_GROUP_ALL / _COMPUTE_ALL / _COPY_ALL).
GROUPS = ("all", "compute", "copy")
#: Nominal device-memory bandwidth of a simulated tile, bytes/s (zes_mem_bandwidth_t.maxBandwidth):
#: of the order of the host memcpy the simulated copies run on, so readings move with the work
#: (a real Data Center GPU Max tile has ~1.6 TB/s).
MAX_BANDWIDTH = 16_000_000_000
#: A simulated card's power draw, idle and with every tile active, in milliwatts.
POWER_IDLE_MW = 60_000
POWER_BUSY_MW = 300_000


def now_us() -> int:
    """The counters' timestamp: a monotonic clock in microseconds (only deltas mean anything)."""
    return time.monotonic_ns() // 1000


class Meter:
    """The counters of one tile.  Callers hold the runtime's lock."""

    __slots__ = ("active", "last_end", "read", "write")

    def __init__(self) -> None:
        self.active: Dict[str, int] = dict.fromkeys(GROUPS, 0)     # microseconds
        self.last_end: Dict[str, int] = dict.fromkeys(GROUPS, 0)
        self.read = 0
        self.write = 0

    def add_active(self, group: str, start: int, end: int) -> None:
        """Add ``[start, end)`` to ``group``'s union of active intervals.  ``end`` never
        decreases from call to call (it is read under the lock at completion), so the union is
        exact: only the part after the latest end counted so far is new."""
        last = self.last_end[group]
        begin = start if start > last else last
        if end > begin:
            self.active[group] += end - begin
        if end > last:
            self.last_end[group] = end


def account(meters: Iterable[Meter], group: str, start: int, end: int, reads: int, writes: int) -> None:
    """Charge one completed operation to the ``meters`` of the tiles its device spans."""
    meters = list(meters)
    n = len(meters)
    r_share, r_extra = divmod(reads, n)
    w_share, w_extra = divmod(writes, n)
    for i, m in enumerate(meters):
        m.add_active("all", start, end)
        if group != "all":
            m.add_active(group, start, end)
        m.read += r_share + (r_extra if i == 0 else 0)
        m.write += w_share + (w_extra if i == 0 else 0)


def energy_uj(meters: Iterable[Meter], tiles: int, since: int, now: int) -> int:
    """Energy in microjoules drawn by the tiles behind ``meters`` (of a card with ``tiles``
    tiles) from ``since`` to ``now``: each tile draws ``1/tiles`` of the card's idle power, plus
    its share of the busy surplus while active."""
    meters = list(meters)
    elapsed = now - since
    idle = POWER_IDLE_MW * len(meters) * elapsed
    surplus = (POWER_BUSY_MW - POWER_IDLE_MW) * sum(m.active["all"] for m in meters)
    return (idle + surplus) // (1000 * tiles)      # mW * us = nJ; / 1000 = uJ
