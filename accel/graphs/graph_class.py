"""The :class:`Graph` class (``torch.accelerator.Graph`` / ``torch.cuda.CUDAGraph``).

A graph keeps its state in its holder (:class:`.held._Held`, read-only as ``Graph._<field>``)
and registers the holder's release once it first holds something.  Its capture_begin refuses
(:mod:`.checks`) and then begins the capture (:func:`.held._begin_held`); capture_end ends it,
publishes what the end still owes (``_finish_end``) and instantiates; replay launches under the
graph's launch lock, its stream and its kept objects held; reset releases it all, or, in a
collection, moves it to a holder of its own whose release is queued.  ``with g:`` is a capture
block (:mod:`.block`).
"""

from __future__ import annotations

import operator
import os
import sys
import warnings
import weakref
from typing import Optional, Tuple

from .. import _finalize as _fin
from .. import _lazy
from .. import _locks
from .._copying import refuse_copies as _refuse_copies
from .._errors import CaptureError
from ..backends._signals import deferred
from ..backends.base import launch_note
from ..buffer.pins import _drain, pin_noted, record_noted, unpin_noted
from ..memory._mempool import check_pool_id as _check_pool
from ..streams import Stream, _Hold, current_stream, on_device
from .block import _end_after_error, _end_block_or_discard, _refuse_then_synchronize
from .checks import _check_device_free, _check_mode, _graph_backend, _refuse_default_stream, _unfinished
from .held import (_Held, _begin_held, _destroy_held, _end_capture, _instantiate, _reclaim, _reclaim_if_gone,
                   _release_held, _still_capturing, _take_capture_table)
from .kept import _KeptInUse, _refuse_closed_kept
from .pools import _new_private_pool


def _holder_field(name: str) -> property:
    """The read-only ``Graph._<name>`` of its holder's field (a C getter: no interrupt point)."""
    return property(operator.attrgetter("_h." + name), doc=f"the holder's {name} (see _Held)")


@deferred
def _note_replay(noted: list, h, stream: Stream, handle: int, pinned: list) -> None:
    """After a launch of ``h``'s graph was queued on ``stream``: the RNG, the allocators and the
    pinned buffers learn of it (each buffer's use of ``stream``, as a call's).  Signals deferred,
    so that once begun (``noted[0]`` set first thing) it runs whole; an error drains the stream,
    whose work then needs no note, and propagates."""
    noted[0] = True
    try:
        if h.rng is not None:
            from .. import random
            random._graph_replayed(h.rng, stream)
        if h.allocs is not None:
            h.allocs.replayed(handle)
        if h.host is not None:
            h.host.replayed(handle)
        if pinned:
            record_noted(pinned, stream)
    except BaseException:
        _drain(stream)
        raise


@_refuse_copies("capture another Graph (sharing this one's pool: Graph(pool=g.pool()))")
class Graph:
    """A captured sequence of device work that can be replayed.

    ``Graph(keep_graph=False, *, pool=None, capture_error_mode="default")``.
    ``with g:`` synchronizes, empties the caches and captures the body on the
    current stream (which must not be the legacy default stream: use
    ``with stream, g:`` or :func:`accel.graph`).
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
        # A C RLock only to tell its holder (_own_lock_refused): a finalizer or gc callback that
        # replays this graph inside its own replay hung on a plain Lock (r84a).  Not
        # accel._locks.Lock, which registers in a WeakSet: its removal callback as a graph is
        # collected is a place a Ctrl-C would be printed and lost (r54).
        self._launch_lock = _locks.OwnedLock()
        self._owed = []

    # the holder's fields, read-only (the graph's code stores into self._h)
    (_backend, _index, _exec, _graph, _pool, _rng, _allocs, _host, _events, _buffers, _stream, _capture_id,
     _discarded) = map(_holder_field, _Held.__slots__)

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
        from .. import random
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
        :func:`accel.graph` synchronize: a synchronize while a capture is underway on the device
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
        from .. import memory
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
        from .. import memory, random
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
            from .. import random
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
            self._own_lock_refused("instantiate()")
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
        hold, kept, pinned = _Hold(stream), _KeptInUse(()), []
        try:
            # kept.of(h): the graph's kept objects read once the launch lock is held (a reset and a
            # new capture by another thread meanwhile change them: r67f)
            self._own_lock_refused("replay()")
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
                if stream._foreign:
                    # before anything is queued: a wrapper's stream may be gone, its handle another
                    # stream's by now (r82a: launched there, then refused)
                    stream._check_alive()
                if h.rng is not None:
                    from .. import random
                    random._graph_replay(h.rng, stream)
                # the buffers the capture used, pinned over the launch: the replay uses each on
                # `stream` as a call would (recorded after the launch: _note_replay)
                if h.buffers:
                    pin_noted(h.buffers, pinned)
                if h.pool is not None:
                    # before the launch: a pool replayed on a stream other than its own is kept
                    # from the general cache once a reset releases it, as torch keeps every
                    # released pool (P1 in memory._private_pools release_pool; r61h: a replay queued on
                    # another stream overwrote the temporary the next allocation on the capture
                    # stream had been given)
                    from .. import memory
                    memory.device_allocator(h.index).pool_used_on(h.pool, handle, h.index)
                noted, interrupt = [False], None
                # (saved and put back: a finalizer's replay inside this one's launch must not
                # change what this one reads: r84a)
                outer, launch_note.queued = launch_note.queued, False
                try:
                    backend.graph_launch(h.exec, handle)
                finally:
                    queued, launch_note.queued = launch_note.queued, outer
                    # Once the launch queued (also when a Ctrl-C lands as it returns: LaunchNote), the
                    # replay's uses are noted to the end: inline, since a signal handler can raise as
                    # any Python function starts, _note_replay's deferred wrapper included (r82a)
                    while queued and not noted[0]:
                        try:
                            _note_replay(noted, h, stream, handle, pinned)
                        except BaseException as exc:
                            if noted[0]:
                                raise       # its own error (it drained the stream first)
                            interrupt = exc     # a handler's, before it began: once more
                if interrupt is not None:
                    raise interrupt
        finally:
            # A Ctrl-C as the with statement called kept's or the hold's __exit__ (Python functions:
            # CPython checks for signals as one starts) left all it releases taken: released here
            # (each can finish in a second call), or the module's lock would hang the next replay and
            # the stream's mark keep its close() from destroying it (r66h).  (Plain reads: no point.)
            if kept._marked or kept._locked:
                kept.__exit__(None, None, None)
            if hold._in:
                hold.__exit__(None, None, None)
            interrupt = None
            while pinned:       # (r82a: a Ctrl-C as unpin_noted's wrapper started left every pin)
                try:
                    unpin_noted(pinned)
                except BaseException as exc:
                    interrupt = exc
            if self._owed:
                self._settle_owed()     # a reset a finalizer made meanwhile: now the launch is done
            if interrupt is not None:
                raise interrupt

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
        if _fin.collecting() or self._launch_lock._is_owned():
            # Called from a finalizer during a collection: the allocator's lock may be held
            # by this thread (see accel._finalize), and so may the graph's launch lock (a replay
            # in flight on this thread or another, whose launch passes the executable): nothing
            # waits.  The reset is noted, then done now if the lock is free, else by its holder as
            # it lets go (_settle_owed: one of the two always sees the other's step).  The same
            # inside this thread's own replay, reset or instantiate of the graph (a __del__ run by
            # a dropped reference, a signal handler): refusing it lost the reset, since Python
            # prints and drops a __del__'s error (r85a).
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

    def _own_lock_refused(self, call: str) -> None:
        """RuntimeError when this thread holds the launch lock: ``call`` runs inside the graph's
        own replay, reset or instantiate (a finalizer, gc callback or signal handler ran there),
        and taking the lock would wait for itself."""
        if self._launch_lock._is_owned():
            raise RuntimeError(f"{call} on {self!r} inside its own replay, reset or instantiate on this "
                               f"thread (a __del__, gc callback or signal handler ran there): it would wait "
                               f"for itself; call it once that returns")

    def _settle_owed(self) -> None:
        """Do the resets finalizers asked for (``_owed``) unless the launch lock is held (its
        holder calls this again as it lets go): what the graph holds moves to a holder of its
        own, queued for the next safe point with plain stores and a C append (no point where an
        interrupt drops it), so a replay after it finds nothing to launch."""
        while self._owed:
            # (run_locked: the lock's holder, this thread inside its replay, is "busy"; the acquire's
            # result is stored in the C step that takes it, so a Ctrl-C as it returns never leaves
            # the lock held: r85a)
            if not _locks.run_locked(self._launch_lock, False, self._settle_now):
                return

    def _settle_now(self) -> None:
        """The owed resets, the launch lock held: the handles move first and the debt is cleared
        after (r85a: popped first, a Ctrl-C before the move lost the reset)."""
        if self._owed:
            self._move_to_release()
            self._owed.clear()

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
        h.events = h.buffers = ()
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
        h.events = h.buffers = ()
        if h.pool is not None:
            from .. import memory
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
            from .. import random
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
            self._own_lock_refused("debug_dump()")
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
