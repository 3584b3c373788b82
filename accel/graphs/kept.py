"""The external events and modules a graph's replay keeps in use (r67e).

A capture keeps the external events recorded in it and the modules whose kernels it launches
(the holder's ``events``); a replay, or an instantiate, keeps each in use across its launch
(:class:`_KeptInUse`), and refuses a graph one of whose kept objects was closed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _locks
from ..streams import Event, _closed_during_use

if TYPE_CHECKING:
    from .held import _Held


def _refuse_closed_kept(h: "_Held", call: str) -> None:
    """``call``'s refusal of a graph one of whose external events or modules was closed."""
    for kept in h.events:
        if kept._closed:
            raise _closed_kept(kept, call)


def _closed_kept(kept, call: str = "replay()") -> RuntimeError:
    """``call``'s refusal of a graph whose external event or module ``kept`` was closed."""
    if not isinstance(kept, Event):    # an accel.Module whose kernels it launches
        return RuntimeError(f"{call}: {kept!r} was closed, but this graph launches its kernels "
                            f"at every replay; keep the module open while the graph is replayed, "
                            f"or capture the graph again")
    return RuntimeError(f"{call}: {kept!r} was closed, but this graph records or waits for it "
                        f"at every replay (Event(external=True) in its capture); keep the event "
                        f"open while the graph is replayed, or capture the graph again")


class _KeptInUse:
    """``kept = _KeptInUse(())`` before the ``try``, then ``with kept.of(h):`` around a replay's launch
    (or an instantiate), which passes the runtime the handles of the graph's external events (its
    event record and wait nodes) and the kernels of its modules: each event is marked in use (as
    streams._Use: another thread's close() leaves its destroy to the launch's end) and each module's
    lock is held (Module.close waits for it, as for a launch: a launch of an unloaded library's
    kernel killed the process on an H100).  Each is checked open once held (closed by another thread
    since replay's own check: raises as that check).  Nothing to do for a graph that keeps none (the
    common case).

    Interrupt safety (r67e; as streams._Hold): what is taken is recorded in the same step, so
    ``__enter__`` takes all or nothing and ``__exit__`` can be called again to finish (a Ctrl-C
    as the with statement's call of it started: Graph.replay's ``finally`` calls it again while
    a record is left).  ``_marked`` counts the events marked (stored just before each mark: no
    interrupt point between), ``_locked`` holds one True per module lock taken (appended in the
    acquire's own C step; an acquire interrupted as it waits takes nothing), and ``__exit__``
    drops each record just before the release or the pop it stands for."""

    __slots__ = ("_kept", "_events", "_modules", "_marked", "_locked")

    def __init__(self, kept):
        self._kept, self._marked, self._locked = kept, 0, None

    def of(self, h: "_Held") -> "_KeptInUse":
        """Keep the holder ``h``'s events and modules (read now); returns self, to enter."""
        self._kept = h.events
        return self

    def __enter__(self) -> None:
        if not self._kept:
            return
        # Module locks in one order for every replay (by id): two graphs launching kernels of the
        # same two modules, captured in opposite orders, replayed at once, must not deadlock.
        events = self._events = [kept for kept in self._kept if isinstance(kept, Event)]
        modules = self._modules = sorted((kept for kept in self._kept if not isinstance(kept, Event)), key=id)
        locked = self._locked = []
        try:
            for kept in events:
                self._marked += 1               # (a plain store, then the mark: no point between)
                kept._busy.append(None)
                if kept._closed:
                    raise _closed_kept(kept)
            for kept in modules:
                _locks.acquire_into(kept._lock, locked)     # taken and recorded in one C step
                if kept._closed:
                    raise _closed_kept(kept)
        except BaseException:
            self.__exit__(None, None, None)     # (a Ctrl-C as it starts: replay's finally calls it again)
            raise

    def __exit__(self, *exc) -> None:
        locked = self._locked
        while locked:
            lock = self._modules[len(locked) - 1]._lock
            del locked[-1]          # (a plain delete, then the release: no point between)
            lock.release()
        while self._marked:
            event = self._events[self._marked - 1]
            self._marked -= 1
            event._busy.pop()
            if event._closed:
                _closed_during_use(event)   # the last use of an event closed meanwhile destroys it
