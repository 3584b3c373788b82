"""Graph capture and replay (``torch.accelerator.Graph`` / ``torch.cuda.CUDAGraph``).

Capture records the work queued on the current stream (and on streams that
join it through events) into a graph instead of running it; replay launches
the whole recorded graph with one call, which is what saves launch overhead.

How the pieces fit (as ``aten/src/ATen/cuda/CUDAGraph.cpp``):

* **Memory.** While capturing, the caching allocator serves the capturing
  stream from a *private pool* identified by ``pool()``; replays reuse the same
  addresses, so that memory stays reserved until :meth:`Graph.reset` or the
  graph is collected.  Graphs captured with the same ``pool=`` share it.
* **RNG.** Default generators switch to graph-safe mode during capture: the
  captured kernels read seed and offset from device memory, and every replay
  writes fresh values there first, so each replay draws new numbers.
* **Illegal work.** Synchronizing a capturing stream or its device raises
  :class:`accel.CaptureError`; the runtime then invalidates the capture and
  :meth:`capture_end` reports it.  A blocking (pageable) host copy and ``empty_cache()``
  are refused by accel with CaptureError before any runtime call, and the capture goes on.
* **Host copies.** A ``non_blocking`` copy between a Buffer and pinned memory
  (:func:`accel.empty_pinned`) is captured, as torch's: every replay copies again, so the
  graph holds the pinned block (not reused, even after its array is gone) until the graph
  is released and its queued replays ran.  Pageable memory is refused.
* **An interrupted ``__del__`` (r54).**  What a graph must release (its executable and graph
  handles, its pool, its own allocations, its pinned blocks, its generator registrations, a
  capture underway and its stream) lives in a holder (:class:`_Held`) registered in
  ``accel._finalize.owned`` once the graph first holds something, with a token only the graph
  holds.  Every release (reset(), ``__del__``, the registry's) takes each thing out of the holder
  just before releasing it, so none is released twice; a Ctrl-C as ``__del__`` starts (CPython
  raises it at the first instruction, prints and ignores it) leaves the rest in the holder, and
  the next entry of the API after the graph is freed releases it.  In a collection ``__del__``
  leaves it all to the registry: a graph another finalizer resurrects keeps its handles (its
  replays work) until it is freed for good.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import os
import sys
import threading
import warnings
import weakref
from typing import Optional, Tuple

from . import _finalize as _fin
from . import _lazy, _locks
from ._copying import refuse_copies as _refuse_copies
from ._errors import AcceleratorError, CaptureError
from .backends._signals import deferred as _signals_deferred
from .memory._mempool import check_pool_id as _check_pool
from .streams import Event, Stream, _Hold, _as_stream, _capture_events, _closed_during_use, current_stream, on_device

__all__ = ["Graph", "graph", "generate_graph_pool_handle", "graph_pool_handle"]

#: Graphs whose ended capture still owes bookkeeping (Graph._finish_end), bounded by them (a
#: dict: adding is a plain store, with no signal check, beside the others that end a capture).
_unfinished: dict = {}

_MODES = ("default", "global", "thread_local", "relaxed")
# torch's MempoolId_t (c10/cuda MemPool::graph_pool_handle): ids a user asks for are
# {0, n} (graph_pool_handle and MemPool share accel.memory._mempool's counter), the pool a
# graph makes for itself {n, 0}, each from its own counter.
_graph_pool_ids = itertools.count(1)
_pool_lock = _locks.Lock("a graph's private pool id")


def generate_graph_pool_handle() -> Tuple[int, int]:
    """A fresh pool id ``(0, n)`` to pass as ``Graph(pool=...)`` so several graphs share
    one memory pool (a graph's own pool is ``(n, 0)``, as torch's MempoolId_t).  A
    :class:`accel.MemPool`'s ``id`` comes from the same counter."""
    from .memory import _mempool
    return _mempool.new_user_pool_id()


graph_pool_handle = generate_graph_pool_handle  # torch.cuda's name


def _new_private_pool() -> Tuple[int, int]:
    with _pool_lock:
        return (next(_graph_pool_ids), 0)


class _UnknownCaptureMode(ValueError, RuntimeError):
    """A capture_error_mode that is none of _MODES.  torch raises it from a TORCH_CHECK in
    capture_begin (RuntimeError); accel raised ValueError: this class is both."""


def _check_mode(mode: str) -> str:
    if mode not in _MODES:
        raise _UnknownCaptureMode("Unknown capture error mode. Expected `default`, `global`, `thread_local`, "
                                  f"or `relaxed`, got {mode}")
    return mode


class _Held:
    """What a :class:`Graph` holds that must be released (r54): the registry entry's argument
    (``accel._finalize.own``), so that a graph freed without its release having run (a Ctrl-C as
    its ``__del__`` started) is released at the next drain.  The graph keeps its state here and
    every release takes each field (a plain store of None) just before its release call: a
    thing is released once, by whichever path took it."""

    __slots__ = ("backend", "index", "exec", "graph", "pool", "rng", "allocs", "host", "events", "stream",
                 "capture_id", "discarded")

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
        self.stream = None        # capturing Stream while capturing
        self.capture_id = None    # the backend's id of the capture underway
        self.discarded = None     # the graph of a capture discarded at capture_begin, its destroy failed


def _holder_field(name: str) -> property:
    """The read-only ``Graph._<name>`` of its holder's field (a C getter: no interrupt point)."""
    return property(operator.attrgetter("_h." + name), doc=f"the holder's {name} (see _Held)")


def _graph_backend():
    """The initialized backend; NotImplementedError saying why where it has no stream capture."""
    backend = _lazy.lazy_init()
    if not backend.supports_graphs:
        raise NotImplementedError(backend.no_capture_reason)
    return backend


def _refuse_default_stream(backend, stream: Stream) -> None:
    if stream._handle == backend.default_stream(stream.device_index):
        raise RuntimeError(
            f"{backend.name.upper()} graphs must be captured on a non-default stream. (However, after "
            "capture, it's ok to replay them on the default stream.) Use `with accel.Stream(), graph:` "
            "or `with accel.graph(graph):`.")


def _refuse_then_synchronize(graph: "Graph", indices, stream: Optional[Stream] = None) -> None:
    """``with g:`` and :func:`graph`: capture_begin's refusals for the devices ``indices`` (None:
    the current one) and for the capture ``stream`` when known (the default stream: r70c, the
    refusal came after the synchronize and the emptied caches), then a synchronize of the
    current device, as one step under the capture gate: a capture another thread began between
    the check and the synchronize would be invalidated by it (r65j).  Deferred releases run
    first, outside the gate: they take the
    allocators' locks, which every other path takes before the gate (holding the gate across
    accel.synchronize()'s drain deadlocked against a record_stream: tests/test_gc_stress.py)."""
    if _fin.pending:
        _fin.drain()
    backend = _graph_backend()
    # An ended capture whose bookkeeping a Ctrl-C cut short is finished first, outside the gate
    # too: its end_allocate_to_pool takes the allocator's lock (r71a: taken under the gate, the
    # reverse of every allocator path's order, against another thread's empty_cache or free).
    graph._check_process()
    for index in indices:
        _finish_owed_ends(backend.get_device() if index is None else index)
    with backend.capture_gate:
        for index in indices:
            graph._refuse_before_sync(index)
        if stream is not None:
            _refuse_default_stream(backend, stream)
        backend.device_synchronize()


@_refuse_copies("capture another Graph (sharing this one's pool: Graph(pool=g.pool()))")
class Graph:
    """A captured sequence of device work that can be replayed.

    ``Graph(keep_graph=False, *, pool=None, capture_error_mode="default")``.
    ``with g:`` synchronizes, empties the caches and captures the body on the
    current stream (which must not be the legacy default stream: use
    ``with stream, g:`` or :func:`graph`).
    """

    def __init__(self, keep_graph: bool = False, *, pool: Optional[Tuple[int, int]] = None,
                 capture_error_mode: str = "default"):
        self.keep_graph = bool(keep_graph)
        self.graph_pool = _check_pool(pool) if pool is not None else None
        self.capture_error_mode = _check_mode(capture_error_mode)
        self._h = _Held()         # what it holds (handles, pool, registrations, capture: see _Held)
        self._own = None          # (key, token) of the holder's registration (accel._finalize.own)
        self._debug = False
        self._finish = None       # what an ended capture still owes (see _finish_end)
        self._pid = _fin.pid      # the process the graph's handles belong to
        # Held by replay() from reading the executable to its launch, and by reset() while it
        # destroys it: a reset in another thread waits for a replay in flight, whose launch of a
        # destroyed executable would be undefined in CUDA (a launch of a kernel whose library
        # was unloaded killed the process on an H100).  Never waited for by a finalizer: a reset()
        # in a collection that finds it held leaves a note in _owed, and whoever holds the lock
        # moves the graph's handles to their queued release as it lets go (_settle_owed).
        self._launch_lock = threading.Lock()
        self._owed = []

    # the holder's fields, read-only (the graph's code stores into self._h)
    _backend, _index, _exec, _graph, _pool, _rng, _allocs, _host, _events, _stream, _capture_id, _discarded = map(
        _holder_field, _Held.__slots__)

    def _register(self, backend) -> "_Held":
        """Register the holder's release with ``backend`` (once: the entry stays while the graph
        lives, emptied by reset(); again after a reset runtime dropped the registry)."""
        h = self._h
        own = self._own
        if own is None or own[0] not in _fin.owned:
            h.backend = backend
            self._own = _fin.own(_reclaim, backend, h)
        return h

    def __repr__(self) -> str:
        h = self._h
        if h.stream is not None:
            state = f"capturing device={h.index}"
        elif h.exec is not None or h.graph is not None:
            state = f"captured device={h.index} pool={h.pool}"
        else:
            state = "empty"
        return f"<accel.Graph {state}>"

    # -- capture -------------------------------------------------------------------
    def capture_begin(self) -> None:
        """Begin capturing work queued on the current stream into this graph."""
        self._check_process()
        backend = _graph_backend()
        self._check_unused()
        mode = _check_mode(self.capture_error_mode)
        if mode == "default":
            mode = "global"  # CUDA's and torch's default
        stream = current_stream()
        # The stream is held to the end: another thread's close() meanwhile leaves the destroy to
        # then (its handle, keyed by the graph pool and captured into, is not handed to the next
        # stream made), and a close that claimed it makes the capture end, discarded, below.
        try:
            with _Hold(stream):
                self._capture_begin(backend, stream, mode)
        except BaseException as exc:
            if self._h.stream is not None:
                # begun, then a Ctrl-C as the hold ended (r55): an error leaves nothing begun
                _end_after_error(self, exc)
            raise

    def register_generator_state(self, generator) -> None:
        """Register ``generator``'s current state (torch's ``CUDAGraph.register_generator_state``):
        capture_begin puts it in graph-safe mode, so the captured fills drawing from it read its
        seed and offset from device holders, and each replay writes them there and advances
        it by the words the graph draws.  ``generator``: an :class:`accel.random.Generator`, or
        a state from its ``graphsafe_get_state()``/``clone_state()``.  The default generator's
        state is registered by every capture.  Before capture_begin only (the holders, two
        blocks of the caching allocator, are allocated now, on the current stream of the
        state's device); registering a state twice is a no-op.  The states stay registered
        until reset() or the graph's collection, which free the holders of a state no other
        graph has registered."""
        self._check_process()
        from . import random
        if not isinstance(generator, random.Generator):
            raise TypeError(f"register_generator_state expects an accel.random.Generator (a generator, or a "
                            f"state from graphsafe_get_state() or clone_state()), got "
                            f"{type(generator).__name__} {generator!r}")
        backend = _graph_backend()
        h = self._h
        if h.stream is not None:
            raise RuntimeError("Cannot register the state during capturing stage: this graph is being captured; "
                               "register generator states before capture_begin")
        if h.graph is not None or h.exec is not None:
            raise RuntimeError("register_generator_state: this graph already holds a capture, which draws "
                               "nothing from a state registered now; call reset(), register the states, and "
                               "capture again")
        self._register(backend)     # first: reset() and the finalizers release the registration
        h.rng = random._graph_register(h.rng, generator)

    def _check_unused(self) -> None:
        h = self._h
        if h.stream is not None:
            raise RuntimeError("capture_begin called twice: this graph is already capturing")
        if h.graph is not None or h.exec is not None:
            raise RuntimeError("this graph already holds a capture; call reset() before capturing again")

    def _refuse_before_sync(self, index: Optional[int]) -> None:
        """capture_begin's refusals that need no stream, made before ``with g:`` and
        :func:`graph` synchronize: a synchronize while a capture is underway on the device
        invalidates that capture, so the refusal would otherwise come after the damage.
        ``index``: the device the capture would begin on (None: the current one)."""
        self._check_process()
        backend = _graph_backend()
        self._check_unused()
        # (under the capture gate: the owed ends were finished before it, nothing here takes
        # an allocator's lock; r71a)
        if index is None:
            _check_device_free(backend.get_device(), " (`with graph:` and accel.graph() "
                               "first synchronize the current device, which would invalidate it)", finish=False)
        else:
            _check_device_free(index, finish=False)

    def _capture_begin(self, backend, stream: Stream, mode: str) -> None:
        _refuse_default_stream(backend, stream)
        pool = _check_pool(self.graph_pool) if self.graph_pool is not None else (0, 0)
        if pool == (0, 0):      # torch's MempoolId_t {0, 0}: no pool given, so a private one (r68a)
            pool = _new_private_pool()
        from . import memory
        _check_device_free(stream.device_index)
        allocator = memory.device_allocator(stream.device_index)
        h = self._register(backend)     # before the graph holds anything
        _begin_held(h, backend, stream, mode, allocator, pool)

    def capture_end(self) -> None:
        """End the capture; instantiate it unless ``keep_graph``.

        Raises :class:`accel.CaptureError` when the capture was invalidated by an
        illegal operation (the graph is then empty and may be captured again).
        """
        self._capture_end(warn_empty=True)

    def _capture_end(self, warn_empty: bool) -> None:
        self._check_process()
        h = self._h
        stream = h.stream
        if stream is None:
            raise RuntimeError("capture_end called without a matching capture_begin")
        if current_stream(stream.device_index) != stream:
            raise RuntimeError("Capture must end on the same stream it began on.")
        from . import memory, random
        allocator = memory.device_allocator(h.index)
        capture_id = h.capture_id
        # Interrupt safety (Ctrl-C): the graph forgets the capture only once the backend ended it,
        # and the bookkeeping after that (the pool's routing, the generator) runs in `finally`
        # clauses, so a KeyboardInterrupt leaves the capture either held by the graph (still
        # underway: ending it again works) or ended with nothing of it left behind.
        try:
            graph_handle = _end_capture(h, stream.handle)
        except BaseException as exc:
            if _still_capturing(h.backend, stream):
                # Not ended (CUDA: cudaErrorStreamCaptureWrongThread, ending a global or
                # thread_local capture on another thread; or an interrupt before the call): the
                # capture goes on, so the graph keeps it, for the thread that began it to end.
                if isinstance(exc, Exception):
                    exc.add_note("(the capture is still underway: call capture_end() on the thread that "
                                 "began it, or capture with capture_error_mode='relaxed' to end it on another)")
                raise
            h.stream = None
            h.capture_id = None
            # (the graph holds the pinned hold until its release below succeeds: a step that fails
            # or is refused leaves it, and the allocations, to reset() or the graph's release; r71i)
            _take_capture_table(h, capture_id, False)
            try:
                # ended, and interrupted as the end returned: its graph is not kept (the pool
                # its nodes use is released below)
                _destroy_held(h, "graph", h.backend.graph_destroy)
                allocator.end_allocate_to_pool(h.pool)
                allocator.release_pool(h.pool)
                if h.allocs is not None:
                    allocs, h.allocs = h.allocs, None
                    try:
                        allocs.release()
                    except Exception:
                        h.allocs = allocs
                        raise
                host = h.host
                if host is not None:
                    host.release()      # (idempotent)
                    h.host = None
            finally:
                h.rng = random._graph_capture_abort(h.rng)
                h.pool = None
            raise
        # published with plain stores: the capture is the graph's no more, and what ending it
        # still owes (the pool's routing, the generator) is owed until _finish_end ran whole
        self._finish = (allocator, h.pool, h.rng)
        _unfinished[self] = None
        h.stream = None
        h.capture_id = None
        try:
            # the graph holds them before _finish_end, which a Ctrl-C may cut short (r71a: the
            # pinned hold, kept in a local until after it, was lost and its blocks parked for good)
            _take_capture_table(h, capture_id, True)
        finally:
            self._finish_end()
        if warn_empty and h.backend.graph_node_count(graph_handle) == 0:
            warnings.warn(f"The {h.backend.name.upper()} Graph is empty. This usually means that the graph "
                          "was attempted to be captured on wrong device or stream.", UserWarning, stacklevel=3)
        if not self.keep_graph:
            # A module closed during the capture was unloaded as it ended: no executable of its
            # kernel nodes is made, and the graph is kept (replay() refuses, naming the module;
            # a new capture_begin asks for reset(), which releases the graph and its pool).
            if not any(kept._closed for kept in h.events):
                self.instantiate()
                if not self._debug:
                    self._destroy_graph()
        if _fin.pending:
            # a safe point, now that the pool routes no more: what ending the capture released
            # (a from_ptr owner's or a DLPack producer's deleter) runs here, with signals
            # delivered, and an allocation it makes gets no memory the replays write (r70m)
            _fin.drain()

    def _finish_end(self) -> None:
        """What an ended capture still owes: allocations stop going to its pool, and the
        generator leaves graph-safe mode.  Each step may run again (a KeyboardInterrupt inside
        leaves the rest owed): _check_device_free, reset() and the next capture finish it."""
        owed = self._finish
        if owed is None:
            return
        allocator, pool, rng = owed
        allocator.end_allocate_to_pool(pool)
        if rng is not None:
            from . import random
            random._graph_capture_end(rng)
        self._finish = None
        _unfinished.pop(self, None)

    def _destroy_graph(self) -> None:
        h = self._h
        _destroy_held(h, "graph", h.backend.graph_destroy)

    def _destroy_exec(self) -> None:
        h = self._h
        _destroy_held(h, "exec", h.backend.graph_exec_destroy)

    def instantiate(self) -> None:
        """Build the executable graph (done by capture_end, or by the first replay with keep_graph)."""
        self._check_process()
        h = self._h
        if h.exec is not None and not self.keep_graph:
            raise RuntimeError("instantiate() is intended to be called by the user only when keep_graph=true")
        kept = _KeptInUse(())
        try:
            with self._launch_lock:     # the executable it replaces may be in a replay's launch
                if h.graph is None:
                    raise RuntimeError("capture_end() must have been called before calling instantiate: capture "
                                       "one first (without keep_graph, capture_end instantiates it)")
                _refuse_closed_kept(h, "instantiate()")
                if h.exec is not None:
                    self._destroy_exec()
                # the modules' kernels are the graph's kernel nodes: none is unloaded meanwhile
                with kept.of(h):
                    _instantiate(h)
        finally:
            # a Ctrl-C as the with statement called kept's __exit__: finished here (as replay's)
            if kept._marked or kept._locked:
                kept.__exit__(None, None, None)
            if self._owed:
                self._settle_owed()

    def raw_cuda_graph(self) -> int:
        """The backend's graph handle (cudaGraph_t); needs ``keep_graph=True`` and a finished capture."""
        if not self.keep_graph:
            raise RuntimeError("You cannot access the raw cudaGraph_t instance unless CUDAGraph was initialized "
                               "with keep_graph=true")
        if self._graph is None:
            raise RuntimeError("You cannot access the raw cudaGraph_t instance until capture_end() has been called")
        return self._graph

    raw_graph = raw_cuda_graph

    def raw_cuda_graph_exec(self) -> int:
        """The backend's executable graph handle (cudaGraphExec_t); instantiate() (or capture_end()
        without keep_graph) first.  A later instantiate() destroys the handle returned."""
        if self._exec is None:
            raise RuntimeError("You cannot access the raw cudaGraphExec_t instance until instantiate() has been "
                               "called")
        return self._exec

    def replay(self) -> None:
        """Launch the captured work on the current stream of the graph's device."""
        self._check_process()
        h = self._h
        _refuse_closed_kept(h, "replay()")
        if h.exec is None:
            if h.graph is None:
                raise RuntimeError("replay() called on a graph with no capture: capture one first")
            self.instantiate()
        backend, index = h.backend, h.index
        stream = current_stream(index)
        # The stream is held to the replay's end: another thread's close() of it waits (its handle
        # is not destroyed, and so not given to the next stream made, while the replay queues on
        # it), and the RNG prologue's write goes to the same stream as the launch.  So are the
        # graph's external events and modules (_KeptInUse): a close() of one meanwhile waits, or
        # leaves its destroy to the replay's end.  (cudaGraphLaunch: the stream's device current)
        hold, kept = _Hold(stream), _KeptInUse(())
        try:
            # kept.of(h): the graph's kept objects read once the launch lock is held (a reset and a
            # new capture by another thread meanwhile change them: r67f)
            with self._launch_lock, hold, kept.of(h), on_device(backend, index):
                if h.exec is None:
                    raise RuntimeError("replay(): the graph was reset (by another thread) as the replay began; "
                                       "capture it again")
                if h.index != index:    # (the stream above is device `index`'s: r68a)
                    raise RuntimeError(f"replay(): the graph was reset and captured again on device {h.index} "
                                       f"(by another thread) as the replay began on device {index}; replay it "
                                       f"again")
                handle = stream._handle
                if backend.captures_underway() and backend.stream_is_capturing(handle):
                    # CUDA refuses a graph launched into a stream being captured and invalidates the
                    # capture (cudaErrorStreamCaptureUnsupported, measured on an H200 by
                    # tools/cuda_conformance.py); accel's Level Zero capture does the same.  Refused
                    # here instead, so the capture goes on.
                    raise CaptureError(f"replay() onto {stream!r}, which is being captured: a "
                                       f"graph cannot be launched inside a capture (the runtime would refuse it and "
                                       f"invalidate the capture); replay it before capture_begin() or after "
                                       f"capture_end(), or on a stream that is not being captured; the capture goes on")
                if h.rng is not None:
                    from . import random
                    random._graph_replay(h.rng, stream)
                if h.pool is not None:
                    # before the launch: a pool replayed on a stream other than its own is kept
                    # from the general cache once a reset releases it, as torch keeps every
                    # released pool (P1 in memory._caching release_pool; r61h: a replay queued on
                    # another stream overwrote the temporary the next allocation on the capture
                    # stream had been given)
                    from . import memory
                    memory.device_allocator(h.index).pool_used_on(h.pool, handle, h.index)
                backend.graph_launch(h.exec, handle)
                if h.rng is not None:
                    random._graph_replayed(h.rng, stream)
                if h.allocs is not None:
                    h.allocs.replayed(handle)
                if h.host is not None:
                    h.host.replayed(handle)
        finally:
            # A Ctrl-C as the with statement called kept's or the hold's __exit__ (Python functions:
            # CPython checks for signals as one starts) left all it releases taken: released here
            # (each can finish in a second call), or the module's lock would hang the next replay and
            # the stream's mark keep its close() from destroying it (r66h).  (Plain reads: no point.)
            if kept._marked or kept._locked:
                kept.__exit__(None, None, None)
            if hold._in:
                hold.__exit__(None, None, None)
            if self._owed:
                self._settle_owed()     # a reset a finalizer made meanwhile: now the launch is done

    def reset(self) -> None:
        """Destroy the captured graph and release its memory pool; the graph may then be recaptured."""
        self._check_process()
        h = self._h
        if h.stream is not None:
            raise RuntimeError("reset() during capture: call capture_end() first")
        self._finish_end()
        backend = h.backend
        if backend is None:
            return
        if _fin.collecting():
            # Called from a finalizer during a collection: the allocator's lock may be held
            # by this thread (see accel._finalize), and so may the graph's launch lock (a replay
            # in flight on this thread or another, whose launch passes the executable): nothing
            # waits.  The reset is noted, then done now if the lock is free, else by its holder as
            # it lets go (_settle_owed: one of the two always sees the other's step).
            self._owed.append(None)
            self._settle_owed()
            return
        try:
            # (no drain under the launch lock: user code a deferred release runs, a deleter, could
            # need the graph; r70m) then a safe point once the lock is free
            with self._launch_lock, _fin.no_drain:
                self._release_handles()
        finally:
            if self._owed:
                self._settle_owed()
        if _fin.pending:
            _fin.drain()

    def _settle_owed(self) -> None:
        """Do the resets finalizers asked for (``_owed``) unless the launch lock is held (its
        holder calls this again as it lets go): what the graph holds moves to a holder of its
        own, queued for the next safe point with plain stores and a C append (no point where an
        interrupt drops it), so a replay after it finds nothing to launch."""
        while self._owed:
            if not self._launch_lock.acquire(blocking=False):
                return
            try:
                taken = False
                while True:
                    try:
                        self._owed.pop()
                    except IndexError:
                        break
                    taken = True
                if taken:
                    self._move_to_release()
            finally:
                self._launch_lock.release()

    def _move_to_release(self) -> None:
        """What the graph holds moves to a holder of its own, whose release is queued (the launch
        lock held: no replay reads the handles meanwhile)."""
        h = self._h
        backend = h.backend
        if backend is None or (h.exec is None and h.graph is None and h.pool is None and h.rng is None
                               and h.allocs is None and h.host is None and not h.events and h.discarded is None):
            return
        moved = _Held()
        moved.backend, moved.index, moved.exec, moved.graph, moved.pool = backend, h.index, h.exec, h.graph, h.pool
        moved.rng, moved.allocs, moved.host, moved.events = h.rng, h.allocs, h.host, h.events
        moved.discarded = h.discarded
        h.exec = h.graph = h.pool = h.rng = h.allocs = h.host = h.discarded = None
        h.events = ()
        _fin.pending.append((_fin.finalize, (_release_held, backend, moved)))   # (tried twice: r67d)

    def _release_handles(self) -> None:
        """reset()'s releases, with no replay in flight."""
        h = self._h
        # In order, each handle dropped once released.  A failure stops here and leaves the
        # rest held, so reset() may be called again: the executable's launches use the private
        # pool's memory and the generator's offsets, which must not go while it may still exist.
        # (Each is taken from the holder just before its release: see _Held.)  A graph left by
        # a capture discarded at capture_begin is not this graph's: its destroy is tried last, so
        # a failing one does not keep the executable, the pool and the offsets (r68a).
        if h.exec is not None:
            self._destroy_exec()
        if h.graph is not None:
            self._destroy_graph()
        h.events = ()
        if h.pool is not None:
            from . import memory
            allocator = memory.device_allocator(h.index)
            pool, h.pool = h.pool, None      # forgotten first, as the handles above
            try:
                allocator.release_pool(pool)
            except Exception:
                h.pool = pool
                raise
        if h.allocs is not None:
            allocs, h.allocs = h.allocs, None
            try:
                allocs.release()
            except Exception:
                h.allocs = allocs       # (for reset() again: refused under its lock, r71a)
                raise
        if h.host is not None:
            host, h.host = h.host, None
            try:
                host.release()          # (idempotent: a retry after an interrupt inside is fine)
            except BaseException:
                h.host = host           # (refused inside the pinned allocator: r71a)
                raise
        if h.rng is not None:
            from . import random
            rng, h.rng = h.rng, None
            random._graph_release(rng)
        if h.discarded is not None:
            _destroy_held(h, "discarded", h.backend.graph_destroy)

    def pool(self) -> Tuple[int, int]:
        """The id of this graph's memory pool, to share it: ``Graph(pool=g.pool())``."""
        self._check_process()
        pool = self._h.pool
        if pool is None:
            raise RuntimeError("pool() is only valid after capture_begin")
        return pool

    # -- debugging -----------------------------------------------------------------------
    def enable_debug_mode(self) -> None:
        """Keep the captured graph so :meth:`debug_dump` can write it."""
        self._debug = True

    def debug_dump(self, path: str) -> None:
        """Write the captured graph as a Graphviz DOT file.  The graph must have been kept:
        :meth:`enable_debug_mode` before capture, or ``keep_graph=True`` (torch's
        ``CUDAGraph::debug_dump`` dumps when either holds); otherwise it warns, writes nothing
        and returns, as torch does."""
        self._check_process()
        if not (self._debug or self.keep_graph):
            # torch's CUDAGraph::debug_dump: TORCH_WARN("CUDA Graphs debug not enabled, ...") (r71c)
            warnings.warn("Graph debug not enabled, set with [graph].enable_debug_mode() before capture "
                          "(or make the Graph with keep_graph=True): nothing was written", UserWarning,
                          stacklevel=2)
            return
        if self._graph is None:
            raise RuntimeError("debug_dump: no captured graph to dump")
        path = os.fsdecode(os.fspath(path))     # (bytes too: str(b"x.dot") named a file "b'x.dot'", r67i)
        if "\0" in path:
            raise ValueError(f"debug_dump: the path {path!r} has a NUL character (the C call would cut it there)")
        if os.path.isdir(path):
            raise IsADirectoryError(f"debug_dump: {path!r} is a folder; pass a file name, e.g. "
                                    f"{os.path.join(path, 'graph.dot')!r}")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            # CUDA's cudaGraphDebugDotPrint reports only cudaErrorOperatingSystem: name the path.
            raise FileNotFoundError(f"debug_dump: cannot write {path!r}: the folder {folder!r} does not exist; "
                                    f"create it first or pass a path in an existing folder")
        try:
            with self._launch_lock:     # not a graph that a reset() in another thread destroys
                if self._h.graph is None:
                    raise RuntimeError("debug_dump: no captured graph to dump (it was reset)")
                self._h.backend.graph_debug_dot(self._h.graph, path)
        finally:
            if self._owed:
                self._settle_owed()

    # -- context manager -----------------------------------------------------------------
    def __enter__(self) -> None:
        import accel
        _refuse_then_synchronize(self, (None,), current_stream())
        accel.memory.empty_cache()
        accel.memory.empty_host_cache()
        self.capture_begin()

    def __exit__(self, *exc_info) -> None:
        exc = exc_info[1] if len(exc_info) > 1 else None      # torch's signature: (*exc_info)
        if exc is None:
            _end_block_or_discard(self)
        else:
            _end_after_error(self, exc)


    def _check_process(self) -> None:
        if self._pid != _fin.pid:
            raise _fin.forked_error(self._backend)

    def __del__(self, _finalizing=sys.is_finalizing):
        if _finalizing():
            return      # interpreter exit: module globals may be gone; the process takes it all
        try:
            # Never waits on a lock (see accel._finalize); nothing in a forked child.  A Ctrl-C as
            # this starts leaves it all to the registry (r54: see _Held); one later, the rest.
            h = getattr(self, "_h", None)
            if h is None or h.backend is None or self._pid != _fin.pid or not _lazy.is_initialized():
                return
            own = self._own
            if own is not None and own[0] in _fin.owned and _fin.collecting():
                # In a collection: released at the next drain if the graph is gone by then (in the
                # order of the finalizers, as finalize_later).  Another finalizer of its garbage may
                # resurrect it: it then keeps its handles, which its replays use, and the registry
                # releases them once it is freed for good.  (A C append: no point to interrupt.)
                _fin.pending.append((_reclaim_if_gone, (weakref.ref(self), own[0], h.backend, h)))
                return
            # (Dropped mid-capture: nothing else could end the capture, and while it is underway
            # every sync, free and capture in the process fails: _reclaim ends it, discarded.)
            _fin.finalize(_reclaim, h.backend, h)
            if own is not None:
                _fin.owned.pop(own[0], None)    # released (a failure: retried once from the queue)
        except KeyboardInterrupt:
            _fin.RAISE_AGAIN[_fin.interrupt_key()]    # a Ctrl-C handled in here reaches the program (r62)


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
    """``with _KeptInUse(h.events):`` around a replay's launch, which passes the runtime the
    handles of the graph's external events (its event record and wait nodes) and the kernels of
    its modules: each event is marked in use (as streams._Use: another thread's close() leaves
    its destroy to the launch's end) and each module's lock is held (Module.close waits for it,
    as for a launch: a launch of an unloaded library's kernel killed the process on an H100).
    Each is checked open once held (closed by another thread since replay's own check: raises
    as that check).  Nothing to do for a graph that keeps none (the common case).

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


@_signals_deferred
def _take_capture_table(h, capture_id, keep_events: bool) -> None:
    """Move what an ended capture left in ``streams._capture_events`` to the graph's handles: the
    pinned hold (buffer._capture_hold) and, with ``keep_events``, the events recorded in it.  With
    signals deferred (r72d: a Ctrl-C as a pop returned left the hold on the stack only, and its
    pinned block parked for good)."""
    events = _capture_events.pop(capture_id, None) or {}
    h.host = events.pop("host", None)
    if keep_events:
        h.events = tuple(events.values())


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
    from . import random
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


@_signals_deferred
def _destroy_held(h: _Held, name: str, destroy) -> None:
    """Take the holder's handle ``name`` and destroy it; on a vendor error it is put back (a
    retry, or reset() again, takes it again)."""
    handle = getattr(h, name)
    if handle is None:
        return
    setattr(h, name, None)
    try:
        destroy(handle)
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
    from . import memory, random
    memory.device_allocator(h.index).end_allocate_to_pool(h.pool)
    h.rng = random._graph_capture_abort(h.rng)      # (the states the user registered: released below)
    h.stream = h.capture_id = None
    _release_held(backend, h)


def _release_held(backend, h: _Held) -> None:
    """Destroy a graph's executable and graph handles, release its pool, its own
    allocations and the pinned blocks of its host copies, and unregister it from its
    generator (each attempted), taking each from the holder just before its release (a path
    that finds it gone does nothing; one that fails puts it back, for a retry)."""
    from . import memory, random
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


@contextlib.contextmanager
def graph(cuda_graph: Graph, pool: Optional[Tuple[int, int]] = None, stream: Optional[Stream] = None,
          capture_error_mode: str = "global", enable_annotations: bool = False,
          check_input_liveness: bool = False):
    """Capture the body into ``cuda_graph`` on a side stream (``torch.cuda.graph``).

    The side stream (``stream``, or one kept per device) first waits for the
    current stream, so the captured work sees everything queued before.

    ``enable_annotations`` and ``check_input_liveness`` are torch 2.13's keywords; accel has
    neither kernel annotations nor input tracking, so only ``False`` (the default) is taken:
    ``True`` raises NotImplementedError before anything happens.
    """
    # Every argument is checked before anything is synchronized, emptied or created.
    if not isinstance(cuda_graph, Graph):
        raise TypeError(f"graph() expects an accel.Graph, got {type(cuda_graph).__name__}")
    if enable_annotations:
        raise NotImplementedError("graph(enable_annotations=True): accel records no kernel annotations "
                                  "(torch's need cuda.bindings and a 13.1 driver); leave it False")
    if check_input_liveness:
        raise NotImplementedError("graph(check_input_liveness=True): accel does not track a capture's input "
                                  "Buffers; keep every Buffer the graph reads alive (and open) while it is "
                                  "replayed, and leave check_input_liveness False")
    mode = _check_mode(capture_error_mode)
    if pool is not None:
        _check_pool(pool)
    if stream is not None:
        stream = _as_stream(stream, "graph(stream)")
        stream._live()                          # a closed stream: refused before the synchronize
    import accel
    # the current device (the one the synchronize waits on), and the capture stream's
    _refuse_then_synchronize(cuda_graph, (None,) if stream is None else (None, stream.device_index), stream)
    accel.memory.empty_cache()
    accel.memory.empty_host_cache()     # torch 2.13 graph.__enter__: torch._C._host_emptyCache()
    capture_stream = stream if stream is not None else _side_stream()
    capture_stream.wait_stream(current_stream(capture_stream.device_index))
    saved = (cuda_graph.graph_pool, cuda_graph.capture_error_mode)
    with capture_stream:
        try:
            # (set inside the try: a Ctrl-C as the stream was entered changes nothing of the graph)
            if pool is not None:
                cuda_graph.graph_pool = pool
            cuda_graph.capture_error_mode = mode
            cuda_graph.capture_begin()
        finally:
            # torch passes pool and mode to this capture_begin only: the graph's own stay as they were
            cuda_graph.graph_pool, cuda_graph.capture_error_mode = saved
        try:
            yield cuda_graph
        except BaseException as exc:
            _end_after_error(cuda_graph, exc)
            raise
        try:
            _end_block(cuda_graph)
        except BaseException as exc:
            # (a KeyboardInterrupt before the capture ended: ended and discarded, as after an error;
            # _end_block_or_discard inlined, as a function's start is one more point it can land)
            if cuda_graph._stream is not None:
                _end_after_error(cuda_graph, exc)
            raise


def _finish_owed_ends(index: int) -> None:
    """Finish the bookkeeping of the ended captures of device ``index`` that a KeyboardInterrupt
    cut short (Graph._finish_end: takes the allocator's lock, so never under the capture gate)."""
    for g in [g for g in _unfinished if g._index == index]:
        g._finish_end()


def _check_device_free(index: int, why: str = "", finish: bool = True) -> None:
    """RuntimeError when an accel capture is underway on device ``index`` (one that ended but
    whose bookkeeping a KeyboardInterrupt cut short is finished here first, unless ``finish`` is
    False: the caller holds the capture gate and finished them before taking it)."""
    from . import random
    if finish:
        _finish_owed_ends(index)
    if random._device_capturing(index):
        raise RuntimeError(f"another graph is being captured on device {index}{why}: accel captures "
                           f"one graph per device at a time (the device's default generator follows one "
                           f"capture); end that capture first, or capture on another device")


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
    if h.discarded is not None:         # (one left by an earlier failed discard: retried first)
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


def _end_after_error(g: Graph, exc: BaseException) -> None:
    """End a capture whose body raised ``exc``, so the process stays usable, and let ``exc``
    propagate: the error of ending a capture that the failure invalidated (CUDA 901) says
    less than the failure itself, so it is attached as a note instead of replacing it."""
    if g._stream is None:
        return
    try:
        with g._stream:     # its own stream, whichever one the body left current
            # no "Graph is empty" warning: a body that failed early captured nothing, and the
            # warning's guess (wrong device or stream) would mislead about the real error
            g._capture_end(warn_empty=False)
    except Exception as end_error:     # the capture is ended (and its pool released) either way
        exc.add_note(f"(the capture was then ended and discarded: {end_error})")
    else:
        try:
            g.reset()   # a capture cut short by an error is not a graph anyone asked for
        except Exception as reset_error:    # the body's error stays the one raised (r67d)
            exc.add_note(f"(discarding the captured graph then failed: {reset_error}; what it still "
                         f"holds is released by graph.reset() or when the graph is dropped)")


def _end_block_or_discard(g: Graph) -> None:
    """_end_block, and when a KeyboardInterrupt (Ctrl-C) stops it before the capture ended, the
    capture is ended and discarded as after an error in the body: no capture is left underway
    that no one ends."""
    try:
        _end_block(g)
    except BaseException as exc:
        if g._stream is not None:
            _end_after_error(g, exc)
        raise


def _end_block(g: Graph) -> None:
    """End the capture of a ``with g:`` or :func:`graph` block whose body returned.  A body
    that left another stream current cannot end it as asked (torch's capture_end check): the
    capture is ended on its own stream and discarded, and RuntimeError says why, so no
    capture is left underway to make every later sync fail."""
    stream = g._stream
    if stream is None or current_stream(stream.device_index) == stream:
        g.capture_end()
        return
    err = RuntimeError(f"Capture must end on the same stream it began on: the body of the capture block "
                       f"left {current_stream(stream.device_index)!r} current instead of {stream!r}; the "
                       f"capture was ended and discarded.  Use `with other_stream:` inside the block (it "
                       f"restores the stream) rather than set_stream()")
    _end_after_error(g, err)
    raise err


_side_streams = {}


def _side_stream() -> Stream:
    index = _lazy.lazy_init().get_device()
    stream = _side_streams.get(index)
    if stream is None:
        stream = _side_streams[index] = Stream(index)
    return stream


_lazy.register_reset_hook(_side_streams.clear)
