"""MTLSharedEvent: a value that only increases, and the engine points that will signal it.

Command buffers encode signals and waits (:mod:`.commands`); at commit each pending signal
is listed as the engine point after which the event reaches its value, so a wait depends on
that point and never blocks a host thread.  A signal skipped because its command buffer
failed is remembered (one entry, the highest) so that a wait for a value only it was to
reach fails instead of proceeding.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from .objects import SimObject


class MTLSharedEvent(SimObject):
    cls_name = "MTLSharedEvent"

    def __init__(self, rt):
        super().__init__(rt)
        self.value = 0
        self.points: List[Tuple[int, Tuple[Any, int]]] = []  # (value, engine point signaling it)
        # The point of the highest pending value whose signal a failed command buffer skipped:
        # a wait for a value only it was to signal fails (MTLCommandBuffer._check_waits).  One
        # entry, not one per failure: the event's state stays bounded.
        self.skipped: Optional[Tuple[int, Tuple[Any, int]]] = None

    def m_signaledValue(self):
        return self.value

    def m_setSignaledValue_(self, value):
        self.signal(value)

    def signal(self, value: int) -> None:
        # Shared event values only increase: a late, smaller signal is ignored.
        with self.rt.lock:
            if value > self.value:
                self.value = value
                # Points for values now reached are never needed again (point_for answers None):
                # the event holds only pending signals, not one entry per signal ever encoded.
                points = self.points
                if points and points[0][0] <= value:
                    self.points = [p for p in points if p[0] > value]
                if self.skipped is not None and self.skipped[0] <= value:
                    self.skipped = None

    def signal_skipped(self, value: int, point: Tuple[Any, int]) -> None:
        """The signal of ``value`` at ``point`` will never happen (its command buffer failed)."""
        with self.rt.lock:
            self.points = [p for p in self.points if p[1] != point]
            if value > self.value and (self.skipped is None or value >= self.skipped[0]):
                self.skipped = (value, point)

    def point_for(self, value: int):
        """The engine point after which ``value`` is signaled: None when it already
        is, False when no committed command buffer signals it.  A value only a skipped
        signal was to reach answers that (completed) point: the wait then fails."""
        with self.rt.lock:
            if self.value >= value:
                return None
            for v, point in self.points:
                if v >= value:
                    return point
            if self.skipped is not None and self.skipped[0] >= value:
                return self.skipped[1]
            return False
