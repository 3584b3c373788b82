"""The package's tables and each thread's stream state, in one module: :func:`_reset` (after a
fork, or accel's reset) rebinds ``_tls``, so every module reads it here at use time
(``_state._tls``), never a copy imported by name.  The tables are only ever mutated: the other
modules import them by name.  ``_tls`` holds a thread's current-stream table (``current``), its
``with stream:`` stack (``stack``, accel.streams.current) and its holds (``held``,
accel.streams.uses).

``_drop_stack`` (a stack's weak-reference callback) is here beside ``_tls`` and ``_stacks``: at
interpreter exit a module's globals are cleared in the order they were made, so the thread-local
data goes (and the callback runs) while ``_stacks`` is still there, as when all was one module."""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Dict, Tuple

from .. import _lazy

if TYPE_CHECKING:
    from .current import _Stack
    from .event import Event
    from .foreign import _ForeignAnchor
    from .stream import Stream

_tls = threading.local()
_defaults: Dict[int, "Stream"] = {}
#: Created streams by (device index, handle), for Stream(stream_id=...).  Weak: a stream no
#: one holds is collected (and its entry goes) before its handle can be handed out again.
_live_streams: "weakref.WeakValueDictionary[Tuple[int, int], Stream]" = weakref.WeakValueDictionary()
#: External events recorded or waited on in each capture accel.Graph has underway, by capture
#: id ({id(event): event}), and the accel.Modules whose kernels it launches (accel.launch): the
#: graph that ends the capture keeps them alive, since each of its replays records or waits for
#: them, or launches the kernels.  An entry lives from capture_begin to capture_end.
_capture_events: Dict[int, Dict[int, "Event"]] = {}
#: The anchor of each foreign stream (device index, handle) while an accel wrapper of it lives:
#: every wrapper holds it, and the last one's going forgets the handle (_ForeignAnchor).
_foreign: "weakref.WeakValueDictionary[Tuple[int, int], _ForeignAnchor]" = weakref.WeakValueDictionary()


#: Every thread's _Stack by id, for Stream._exit_elsewhere: a thread's goes with its
#: thread-local data (the weak reference's callback).  (A list is unhashable: no WeakSet.)
_stacks: Dict[int, "weakref.ref[_Stack]"] = {}


def _drop_stack(ref: "weakref.ref[_Stack]", key: int) -> None:
    if _stacks.get(key) is ref:
        del _stacks[key]


def _reset() -> None:
    global _tls
    _tls = threading.local()
    _stacks.clear()
    _defaults.clear()
    _live_streams.clear()
    _capture_events.clear()
    _foreign.clear()


_lazy.register_reset_hook(_reset)
