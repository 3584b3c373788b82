"""What a graph holds (:class:`_Held`) and its lifecycle (r54, r55).

The holder is the registry entry's argument (``accel._finalize.own``): a graph freed without
its release having run is released at the next drain.  Every release takes each field (a plain
store of None) just before its release call, so a thing is released once, by whichever path
took it.  Each runtime call that makes or destroys a handle runs with signals deferred, with
the store or the take, so a Ctrl-C lands before or after it, never between.  Here: the begin of
a capture (the generator, the pool's routing, the backend's capture), its end, the instantiate,
the destroy of a handle, the discard of a capture, and the releases of a dropped graph
(``_reclaim``: ``__del__``'s and the registry's) and of what a reset in a collection moved to a
holder of its own (``_release_held``, queued by ``Graph._move_to_release``; a plain reset()
releases through ``Graph._release_handles``, with :func:`_destroy_held` for the handles).
"""

from __future__ import annotations

import warnings
from typing import Optional, Tuple

from .. import _finalize as _fin
from .._errors import AcceleratorError
from ..backends._signals import deferred as _signals_deferred
from ..streams import Stream, _capture_events


class _Held:
    """What a :class:`accel.Graph` holds that must be released (r54): the registry entry's argument
    (``accel._finalize.own``), so that a graph freed without its release having run (a Ctrl-C as
    its ``__del__`` started) is released at the next drain.  The graph keeps its state here and
    every release takes each field (a plain store of None) just before its release call: a
    thing is released once, by whichever path took it."""

    __slots__ = ("backend", "index", "exec", "graph", "pool", "rng", "allocs", "host", "events", "buffers",
                 "stream", "capture_id", "discarded")

    def __init__(self):
        self.backend = None
        self.index = None         # device of the capture
        self.exec = None          # instantiated executable graph
        self.graph = None         # backend graph handle, kept when keep_graph
        self.pool = None          # pool id actually used
        self.rng = None           # graph-safe RNG state from accel.random during capture/replay
        self.allocs = None        # the allocator's token for the graph's own allocations (cudaMallocAsync)
        self.host = None          # the pinned blocks its captured host copies use (memory._host.CaptureHold)
        self.events = ()          # external events of its event nodes and modules of its kernels, kept for replays
        self.buffers = ()         # weak references to the Buffers its capture used (replay notes their uses)
        self.stream = None        # capturing Stream while capturing
        self.capture_id = None    # the backend's id of the capture underway
        self.discarded = None     # the graph of a capture discarded at capture_begin, its destroy failed


@_signals_deferred
def _take_capture_table(h, capture_id, keep_events: bool) -> None:
    """Move what an ended capture left in ``streams._capture_events`` to the holder ``h``: the
    pinned hold (buffer.capture._capture_hold) and, with ``keep_events``, the events recorded in it
    and the buffers it used (buffer.capture.note_captured).  With
    signals deferred (r72d: a Ctrl-C as a pop returned left the hold on the stack only, and its
    pinned block parked for good)."""
    events = _capture_events.pop(capture_id, None) or {}
    h.host = events.pop("host", None)
    buffers = events.pop("buffers", None) or {}
    if keep_events:
        h.events = tuple(events.values())
        h.buffers = tuple(buffers.values())


@_signals_deferred
def _begin_held(h: _Held, backend, stream: Stream, mode: str, allocator, pool: Tuple[int, int]) -> None:
    """Graph.capture_begin's work once the graph is registered: the generator follows the
    capture, allocations on ``stream`` go to ``pool``, the backend begins the capture, and the
    holder ``h`` holds it all; on an error (or a capture another thread's close() claimed the
    stream of) nothing of it is left.  With signals deferred (r55): begin_allocate_to_pool
    publishes the route before its lock is released, so a Ctrl-C there raised from a call that
    had routed the stream, and the route was never ended (every later empty_cache refused, "a
    stream capture is underway").  A Ctrl-C lands before all of it or once the graph holds the
    capture (capture_end() ends it)."""
    from .. import random
    # The generator's seed/offset holders come from the general cache (torch registers
    # the graph with its generator before routing allocations to the graph's pool).
    # (The states registered with register_generator_state join it; on an error before
    # the capture began they stay registered, for the next capture_begin.)
    h.rng = random._graph_capture_begin(stream.device_index, h.rng)
    try:
        # backend:cudaMallocAsync returns a token: its replays allocate the graph's own
        # allocations again, and its release frees them (None from the caching allocator)
        allocs = allocator.begin_allocate_to_pool(pool, stream._handle)
    except BaseException:
        h.rng = random._graph_capture_abort(h.rng)
        raise
    capture_id = None
    try:
        backend.capture_begin(stream._handle, mode)
        if stream._closed:
            # Another thread's close() claimed the stream since the hold began.  It checks for a
            # capture again after claiming, but may have looked before this one began: end the
            # capture just begun (discarded), so the stream is destroyed with none underway.
            _discard_capture(h, backend, stream)
            raise RuntimeError(f"capture_begin: {stream!r} was closed by another thread while the capture "
                               f"began; nothing was captured: capture on a stream no thread closes")
        # The id (cudaStreamGetCaptureInfo) keys what the graph must keep: the modules it
        # launches, the pinned blocks of its host copies, the external events recorded in it.
        # A failure is the capture_begin's (the capture discarded below): going on without it
        # let a replay after Module.close() launch an unloaded kernel (r67d).
        capture_id = backend.capture_id(stream._handle)
        if capture_id is not None:
            _capture_events[capture_id] = {}   # external events recorded in the capture (accel.streams)
        # published with plain stores: the graph holds the capture from here on
        index = stream.device_index
        h.capture_id = capture_id
        h.backend, h.index, h.stream, h.pool = backend, index, stream, pool
        h.allocs = allocs
    except BaseException as exc:
        # Refused, or a KeyboardInterrupt (Ctrl-C) before the graph held the capture: a capture
        # the backend began is ended and discarded, so none is left underway that no one ends.
        try:
            if h.stream is None and _still_capturing(backend, stream):
                _discard_capture(h, backend, stream)
        except Exception as discard_error:      # the first error stays the one raised
            exc.add_note(f"(ending and discarding the capture then failed: {discard_error})")
        finally:
            if capture_id is not None:
                _capture_events.pop(capture_id, None)
            allocator.end_allocate_to_pool(pool)
            allocator.release_pool(pool)
            if allocs is not None:
                allocs.release()
            h.rng = random._graph_capture_abort(h.rng)
        raise



# A graph handle exists from the moment the runtime's call that makes it returns, and a handle the
# holder forgot before its destroy call exists until that call: a Ctrl-C in between would leave a
# handle nobody destroys.  So each make-and-store and each take-and-destroy runs with signals
# deferred (accel/backends/_signals.py, r55): a Ctrl-C lands before or after it, never inside.
@_signals_deferred
def _end_capture(h: _Held, stream: int) -> Optional[int]:
    """End the capture underway on the stream handle ``stream`` and store its graph in the
    holder (None: an empty capture on some runtimes)."""
    graph_handle = h.backend.capture_end(stream)
    if graph_handle is not None:
        h.graph = graph_handle
    return graph_handle


@_signals_deferred
def _instantiate(h: _Held) -> None:
    h.exec = h.backend.graph_instantiate(h.graph)


#: What a destroy reports for a handle that no longer exists (r80a: a foreign library's
#: cudaDeviceReset "explicitly destroys and cleans up all resources associated with the current
#: device", the graphs and executables of accel's graphs among them).
_HANDLE_GONE = frozenset({"cudaErrorInvalidResourceHandle"})


@_signals_deferred
def _destroy_held(h: _Held, name: str, destroy) -> None:
    """Take the holder's handle ``name`` and destroy it; on a vendor error it is put back (a
    retry, or reset() again, takes it again), except when the error says the handle is no
    longer valid: no retry can succeed, so it is forgotten with a RuntimeWarning (r80a: every
    reset() raised and the graph could never be captured again), as torch's CUDAGraph::reset
    warns (C10_CUDA_CHECK_WARN) and forgets it."""
    handle = getattr(h, name)
    if handle is None:
        return
    setattr(h, name, None)
    try:
        destroy(handle)
    except AcceleratorError as exc:
        if exc.code_name not in _HANDLE_GONE:
            setattr(h, name, handle)
            raise
        warnings.warn(f"accel.Graph: the {name} handle {handle!r} was already invalid and is forgotten "
                      f"(another library's cudaDeviceReset may have destroyed it): {exc}", RuntimeWarning)
    except Exception:
        setattr(h, name, handle)
        raise


def _reclaim_if_gone(ref, key: int, backend, h: _Held) -> None:
    """A collected graph's release (its ``__del__`` ran in a collection): done when the graph is
    gone, then its registration is taken; nothing for a resurrected one (the registry's)."""
    if ref() is not None or key not in _fin.owned:
        return
    _fin.finalize(_reclaim, backend, h)
    _fin.owned.pop(key, None)


def _reclaim(backend, h: _Held) -> None:
    """Release what the holder ``h`` of a dropped graph still holds: ``__del__``'s release, and
    the registry's for a graph freed without it (accel._finalize, r54)."""
    if h.stream is not None:
        _abandon(backend, h)
    else:
        _release_held(backend, h)


def _abandon(backend, h: _Held) -> None:
    """End the capture of a graph dropped while capturing and release what it held.  When
    the capture cannot be ended (CUDA: a non-relaxed capture ended from another thread), it
    is left as it was and the failure propagates (the finalizer retries at the next drain).
    Each step may run again (a retry): the holder forgets the capture last."""
    stream = h.stream
    try:
        with stream._device_scope():
            _end_capture(h, stream._handle)
    except AcceleratorError:
        if _still_capturing(backend, stream):
            raise
        # an invalidated capture (or one a first try ended)
    host = (_capture_events.pop(h.capture_id, None) or {}).get("host")
    if host is not None:
        h.host = host
    from .. import memory, random
    memory.device_allocator(h.index).end_allocate_to_pool(h.pool)
    h.rng = random._graph_capture_abort(h.rng)      # (the states the user registered: released below)
    h.stream = h.capture_id = None
    _release_held(backend, h)


def _release_held(backend, h: _Held) -> None:
    """Destroy a graph's executable and graph handles, release its pool, its own
    allocations and the pinned blocks of its host copies, and unregister it from its
    generator (each attempted), taking each from the holder just before its release (a path
    that finds it gone does nothing; one that fails puts it back, for a retry)."""
    from .. import memory, random
    try:
        _release_own(backend, h, memory, random)
    finally:
        # the graph of a capture discarded at capture_begin: a failing destroy of it keeps
        # nothing else (r68a: the executable leaked beside it)
        _destroy_held(h, "discarded", backend.graph_destroy)


def _release_own(backend, h: _Held, memory, random) -> None:
    """_release_held's steps for what the graph's own capture left, each attempted."""
    try:
        _destroy_held(h, "exec", backend.graph_exec_destroy)
    finally:
        try:
            _destroy_held(h, "graph", backend.graph_destroy)
        finally:
            h.events = ()
            try:
                pool = h.pool
                if pool is not None:
                    allocator = memory.device_allocator(h.index)   # (before the take: a call)
                    h.pool = None
                    try:
                        allocator.release_pool(pool)
                    except Exception:
                        h.pool = pool
                        raise
            finally:
                try:
                    allocs = h.allocs
                    if allocs is not None:
                        h.allocs = None
                        try:
                            allocs.release()
                        except Exception:
                            h.allocs = allocs       # (for the retry: r69l, refused under its lock)
                            raise
                finally:
                    try:
                        host = h.host
                        if host is not None:
                            h.host = None
                            try:
                                host.release()      # (idempotent: back after a Ctrl-C inside too)
                            except BaseException:
                                h.host = host       # (for the retry: r71a, refused under its lock)
                                raise
                    finally:
                        rng = h.rng
                        if rng is not None:
                            h.rng = None
                            random._graph_release(rng)


@_signals_deferred
def _discard_capture(h: _Held, backend, stream: Stream) -> None:
    """End the capture underway on ``stream`` (begun by this thread) and destroy its graph
    (signals deferred: see _end_capture).  The graph goes through the holder ``h`` (registered
    with ``backend``) as ``discarded``: a destroy that fails leaves it there for reset() or the
    graph's release to try again (r67d: it leaked), and the graph stays empty (r67f: as
    ``h.graph`` it read as captured, and a replay failed inside accel)."""
    graph = backend.capture_end(stream._handle)
    if graph is None:
        return
    if h.discarded is not None:
        # (h keeps one an earlier failed discard left: this one is destroyed as a finalizer's
        # release, whose failure is tried once more at the next drain)
        _fin.finalize(backend.graph_destroy, graph)
        return
    h.discarded = graph
    _destroy_held(h, "discarded", backend.graph_destroy)


def _still_capturing(backend, stream: Stream) -> bool:
    """True when ``stream`` is still being captured (asked after a failed capture end)."""
    try:
        with stream._device_scope():
            return backend.stream_is_capturing(stream.handle)
    except Exception:   # cannot tell: treat it as ended, as before (the caller raises its own error)
        return False
