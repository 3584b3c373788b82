"""Stream uses of blocks, and the events that gate their reuse.

Shared by the device and pinned caching allocators (``_caching``, ``_host``); the cudaMallocAsync
allocator (``_async``) shares :func:`order_after`, :func:`stream_uses`, :func:`stream_done`,
:func:`event_done` and record_stream's argument checks (:func:`check_use`, :func:`check_stream_live`).
A block is reused only on the stream it was allocated for; ``record_stream`` adds a *use* by
another stream (:func:`add_use`), and a free records an event on every such stream
(:func:`record_uses`): the block is reused once those events complete.  A stream destroyed while
a block it used is still allocated leaves a :class:`_Gate` (an event recorded just before the
destroy, :func:`cover`, :func:`uses_forgotten`), since the driver hands its handle to the next
stream.  The allocator caches events (``owner._event_cache``); each function says how a
KeyboardInterrupt at any point leaves every event in exactly one place the allocator knows.
"""

from __future__ import annotations

import operator
from functools import partial
from typing import List, Optional, Tuple

from .._device import check_range
from .._errors import AcceleratorError, CaptureError
from .. import _locks
from ..streams import on_device
from ._guards import gate_owned, probe, capture_underway


class _Gate:
    """A use of a block by a stream that was destroyed since: the event recorded on it
    just before the destroy (the handle may already name another stream).  ``held``: made by
    :func:`cover` with the forget's gates, its event still in the owner's cache of events until
    the step that publishes the gate takes it out (see :func:`recorded`)."""

    __slots__ = ("event", "device", "held", "__weakref__")    # (weakly held by Buffer._drained)

    def __init__(self, event, device, held=False):
        self.event = event
        self.device = device
        self.held = held


def recorded(owner, stream: int, device: int, k: int = 0) -> int:
    """An event of ``device`` recorded on ``stream``, which stays in ``owner._event_cache[device]``
    (a cached one, or one made and put there first), ``k`` places below the top: the caller's
    ``k`` events of that device recorded before hold the top places.  The caller takes the top
    ``k + 1`` out of the cache (``del cache[-n:]``) in the same step (no call in between) as it
    publishes them elsewhere (``_pending_events``, a block's uses), so a KeyboardInterrupt leaves
    each event in exactly one place the allocator knows: none is lost, none is in two.  (Until
    r54 the event was popped first, and an interrupt before it was published, e.g. as
    ``on_device.__exit__`` or ``_Gate.__init__`` started, lost it: one live event in the runtime
    each such interrupt, until its teardown.)  A cached event may have been recorded already
    (left by an interrupted forget or a failed record): recording it again is what reuse does.

    ``owner`` is a device or host caching allocator (its ``_be`` and ``_event_cache``), its lock
    held; nothing else changes the cache meanwhile."""
    cache = owner._event_cache.get(device)
    if cache is None:
        cache = owner._event_cache[device] = []
    be = owner._be
    with on_device(be, device):
        if len(cache) <= k:
            # the new event goes in before it is recorded (no call between its creation
            # returning and the insert); the reserved ones stay on top
            cache.insert(0, be.event_create())
        event = cache[-1 - k]
        be.event_record(event, stream)
    return event


def taken(owner, gates: list) -> list:
    """Steps (for _locks.publish) that take the events of the held ``gates`` out of ``owner``'s
    cache (the top places of each device's list, see :func:`recorded`)."""
    counts = {}
    for gate in gates:
        if gate is not None and gate.held:
            counts[gate.device] = counts.get(gate.device, 0) + 1
    return [partial(operator.delitem, owner._event_cache[device], slice(-n, None))
            for device, n in counts.items()]


def order_after(owner, waiter: int, stream: int, device_index, queue_wait) -> bool:
    """The two device allocators' ``order_after`` (``owner``: the allocator): the checks, then
    ``queue_wait(waiter, stream, device)`` (its vendor calls, signals deferred) under the lock
    and then the capture gate (that order, as every allocator path), so that no capture begins
    on ``stream`` between the check and the record.  True when queued, or when ``stream`` is
    being captured (nothing is safe to queue); False when the wait failed (the runtime's error
    cleared): the caller waits on the host."""
    device = check_use(owner._be, stream, device_index, owner._index)
    be = owner._be
    with probe(owner._lock, "order_after", gate_owned(be)), be.capture_gate:
        if capture_underway(be):
            with on_device(be, device):
                if be.stream_is_capturing(stream):
                    return True
        try:
            queue_wait(waiter, stream, device)
        except AcceleratorError:
            return False
    return True


def stream_uses(owner, ptr: int, find, allocated) -> Tuple[List[Tuple[int, int]], List[Tuple[object, int]]]:
    """The two device allocators' ``stream_uses``: ``find()`` gives the block or allocation at
    ``ptr`` (or None), ``allocated(item)`` whether it is allocated.  The uses are copied under
    the lock: the caller waits for them without it."""
    with probe(owner._lock, "stream_uses", owner._gate_owned):
        item = find()
        if item is None or not allocated(item):
            return [], []
        uses = list(item.uses or ())
    live = [use for use in uses if type(use) is tuple]
    return live, [(use, use.device) for use in uses if type(use) is not tuple]


def add_use(owner, block, stream: int, device: int) -> None:
    """``block`` is used by work on ``stream`` of ``device``: its ``uses`` and ``owner._used_on``
    (the stream's users, for forget_stream) say so.  ``owner`` is a device or host caching
    allocator, its lock held.

    The stream's users first: a KeyboardInterrupt between the two leaves a block among them
    that has no use of the stream, which forget_stream skips (as record_uses may leave one)."""
    users = owner._used_on.get(stream)
    if users is None:
        owner._used_on[stream] = {block}
    else:
        users.add(block)
    if block.uses is None:
        block.uses = {(stream, device)}
    else:
        block.uses.add((stream, device))


def record_uses(owner, block, pending: list) -> None:
    """Record an event on every stream that used the freed ``block`` (``block.uses``) and
    queue ``(event, device, block)`` on ``pending``.  When it returns every use is covered:
    the caller then completes the block if ``block.events`` is 0, else takes it out of
    ``owner._deferred``.  ``owner`` is a device or host caching allocator (its ``_event_cache``,
    ``_be``, ``_used_on`` and ``_deferred``); the caller put ``block`` in ``owner._deferred``
    first, where it waits while its uses are recorded.

    A stream whose event cannot be recorded is synchronized instead (its work is then done:
    nothing to wait for).  A use for which both fail stays on the block, which stays in
    ``owner._deferred`` for the next try (never reused before), and the first error
    propagates.

    Interrupt safety: each use leaves ``block.uses`` in the same step (no call in between)
    as its event leaves the cache (see :func:`recorded`) and joins ``pending``, so a
    KeyboardInterrupt leaves every use either still to record or waited for, every event
    either cached or pending, and a retry records only the rest."""
    error = None
    for use in list(block.uses or ()):
        cache = None
        if type(use) is _Gate:
            entry = (use.event, use.device, block)
            stream = None
        else:
            stream, device = use
            entry = None
            try:
                entry = (recorded(owner, stream, device), device, block)
                cache = owner._event_cache[device]
            except Exception:
                try:
                    with on_device(owner._be, device):
                        owner._be.stream_synchronize(stream)
                except Exception as exc:
                    error = error or exc
                    continue                # still in _used_on: forget_stream can cover it
        rest = block.uses - {use}
        users = owner._used_on.get(stream) if stream is not None else None
        # publish: the use goes as its event comes (the append is the last change, a call)
        block.uses = rest or None
        if entry is not None:
            block.events += 1
            if cache is not None:
                del cache[-1]
            pending.append(entry)
        if users is not None:
            users.discard(block)
            if not users:
                del owner._used_on[stream]
    if error is not None:
        raise error


def cover(owner, stream: int, device: int, gates: list) -> Optional[_Gate]:
    """An event of ``device`` recorded on ``stream`` now, or None when it could not be recorded
    but the stream was synchronized instead (its work is done).  ``owner`` is a device or host
    caching allocator (its ``_be`` and ``_event_cache``), its lock held.

    ``gates``: the gates this forget made so far.  The event stays in the cache (held, see
    :func:`recorded`) until the forget's publish takes it out (:func:`uses_forgotten`,
    :func:`taken`), so a KeyboardInterrupt anywhere before leaves it cached.  (Taken out at
    once, as the pinned allocator's forget did until r54, an interrupt before the caller kept
    the gate lost that event.)

    Refused (CaptureError, nothing recorded) while ``stream`` takes part in a capture: an event
    recorded there is a node of the graph, not a point of the stream's work, and CUDA refuses to
    query it once the capture has ended (cudaErrorInvalidValue), which _process_events would do
    at every later free.  (accel.streams defers the destroy of such a stream to the end of the
    captures and never forgets a foreign one inside a capture: this is a second line.)"""
    be = owner._be
    with be.capture_gate:
        if capture_underway(be) and be.capture_id(stream) is not None:
            raise CaptureError(f"stream {stream:#x} takes part in a graph capture: its work cannot be covered "
                               f"with an event until the capture ends (an event recorded now would be a node "
                               f"of the graph); forget or destroy the stream after the capture")
        try:
            k = 0
            for gate in gates:
                if gate is not None and gate.held and gate.device == device:
                    k += 1
            return _Gate(recorded(owner, stream, device, k), device, True)
        except Exception:
            if capture_underway(be):
                raise       # synchronizing would invalidate the capture
            with on_device(be, device):
                be.stream_synchronize(stream)   # a second failure propagates
            return None


def stream_done(owner, stream: int, device: int) -> bool:
    """True when all work queued on the dying ``stream`` (of ``device``) has completed: what it
    used needs no gate (r63b: a kept block used on a stream per request held one vendor event
    per request until its own free).  Not asked while a capture is underway (a query would
    invalidate it), and False when the query fails: the caller then covers the stream."""
    be = owner._be
    with be.capture_gate:
        if capture_underway(be):
            return False
        try:
            with on_device(be, device):
                return bool(be.stream_idle(stream))     # (a failure stays for a synchronize to report)
        except Exception:
            be.clear_error()
            return False


def drop_done_gates(owner, blocks) -> None:
    """For empty_cache: the gates that ``blocks`` (in use: a freed block's gates were queued)
    still hold are dropped once their events completed, the events joining ``owner``'s cache,
    which empty_cache then destroys.  One block's change is one step (_locks.publish).  Not
    called while a capture is underway (a query would invalidate it)."""
    for block in [b for b in blocks if b.uses and any(type(u) is _Gate for u in b.uses)]:
        done = _completed(owner, block.uses)
        if done:
            _locks.publish([partial(setattr, block, "uses", block.uses.difference(done) or None)]
                           + _cached_again(owner, done))


def _completed(owner, uses) -> list:
    """The gates among ``uses`` whose events completed."""
    be = owner._be
    return [u for u in uses if type(u) is _Gate and event_done(be, u.event)]


def event_done(be, event) -> bool:
    """Whether ``event`` completed; a failed query counts as not (what waits for it keeps
    waiting, for its owner's free or synchronize to see the failure), its error cleared."""
    try:
        return bool(be.event_query(event))
    except Exception:
        be.clear_error()
        return False


def _cached_again(owner, gates: list) -> list:
    """Steps (for _locks.publish) that put the events of completed ``gates`` back in the cache,
    below the top places that :func:`taken`'s steps delete (see :func:`recorded`)."""
    return [partial(owner._event_cache.setdefault(g.device, []).insert, 0, g.event) for g in gates]


def gates_back(owner, gates: list) -> None:
    """The events of ``gates`` (from :func:`cover`; None for none) go back to ``owner``'s cache:
    the forget they were recorded for did not happen.  (A held gate's event never left it.)"""
    for gate in gates:
        if gate is not None and not gate.held:
            owner._event_cache.setdefault(gate.device, []).append(gate.event)


def uses_forgotten(owner, stream: int, covers: list, gates: list) -> list:
    """Steps (for _locks.publish) that forget ``stream``'s uses: each use in ``covers``
    ((block, use) pairs) is replaced by its gate (``gates``, in the same order; None: the stream
    was synchronized, nothing to wait for), the held gates' events leave the cache, and
    ``owner._used_on`` forgets the stream.  ``owner`` is a device or host caching allocator, its
    lock held.

    The gates of earlier forgets that a block in ``covers`` still holds are dropped when their
    events completed, the events going back to the cache: a block that outlives many streams
    holds one gate per stream whose work is still queued, not one per stream it ever saw."""
    uses = {}
    done = []
    with owner._be.capture_gate:
        query = not capture_underway(owner._be)        # (a query would invalidate a capture)
        for (block, use), gate in zip(covers, gates):
            rest = uses.get(block)
            if rest is None:
                rest = uses[block] = set(block.uses)
                if query:
                    old = _completed(owner, rest)
                    rest.difference_update(old)
                    done += old
            rest.discard(use)
            if gate is not None:
                rest.add(gate)
    steps = [partial(setattr, block, "uses", rest or None) for block, rest in uses.items()]
    steps += taken(owner, gates) + _cached_again(owner, done)
    steps.append(partial(setattr, owner, "_used_on", without(owner._used_on, stream)))
    return steps


def without(mapping: dict, key) -> dict:
    out = dict(mapping)
    out.pop(key, None)
    return out


def check_use(backend, stream, device_index, default: int) -> int:
    """The device of a ``record_stream(ptr, stream, device_index)`` call, after checking that
    ``stream`` can be a handle (an int in [0, 2**64)) and ``device_index`` names a device
    (None: ``default``).  A bad value kept would fail every later free and empty_cache."""
    if type(stream) is not int or not 0 <= stream < 1 << 64:
        raise (ValueError if isinstance(stream, int) else TypeError)(
            f"record_stream: stream must be a stream handle (an int in [0, 2**64)), got {stream!r}")
    if device_index is None:
        return default
    if type(device_index) is not int:
        raise TypeError(f"record_stream: device_index must be an int, got {device_index!r}")
    check_range(device_index, backend, "record_stream: ")
    return device_index


def check_stream_live(backend, stream: int, device: int) -> None:
    """ValueError when ``stream`` (a handle check_use took) is no live stream of ``device``:
    record_stream would keep it, and every later free of the block and every empty_cache would
    then fail on it (r67i: 0x3039 was kept, and the allocator wedged).  A stream accel made (or
    wraps) is known; another handle is asked of the runtime (Backend.foreign_stream: CUDA's
    cudaStreamGetDevice, or the backend's own table), as Stream.from_handle does."""
    from ..streams import _live_streams
    if _live_streams.get((device, stream)) is not None:
        return
    try:
        _handle, where = backend.foreign_stream(stream)
    except ValueError as exc:
        raise ValueError(f"record_stream: {exc}") from None
    if where is not None and where != device:
        raise ValueError(f"record_stream: stream {stream:#x} is a stream of device {where}, not of device "
                         f"{device}; pass device_index={where}")
