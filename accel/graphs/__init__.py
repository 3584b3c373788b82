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
  :meth:`Graph.capture_end` reports it.  A blocking (pageable) host copy and ``empty_cache()``
  are refused by accel with CaptureError before any runtime call, and the capture goes on.
* **Host copies.** A ``non_blocking`` copy between a Buffer and pinned memory
  (:func:`accel.empty_pinned`) is captured, as torch's: every replay copies again, so the
  graph holds the pinned block (not reused, even after its array is gone) until the graph
  is released and its queued replays ran.  Pageable memory is refused.
* **An interrupted ``__del__`` (r54).**  What a graph must release (its executable and graph
  handles, its pool, its own allocations, its pinned blocks, its generator registrations, a
  capture underway and its stream) lives in a holder (:class:`.held._Held`) registered in
  ``accel._finalize.owned`` once the graph first holds something, with a token only the graph
  holds.  Every release (reset(), ``__del__``, the registry's) takes each thing out of the holder
  just before releasing it, so none is released twice; a Ctrl-C as ``__del__`` starts (CPython
  raises it at the first instruction, prints and ignores it) leaves the rest in the holder, and
  the next entry of the API after the graph is freed releases it.  In a collection ``__del__``
  leaves it all to the registry: a graph another finalizer resurrects keeps its handles (its
  replays work) until it is freed for good.

The package, one module per concern, each with its part of the design in its docstring:

* :mod:`.graph_class`: the :class:`Graph` class (capture_begin/capture_end, instantiate,
  replay, reset, pool, debug_dump, ``with g:``, ``__del__``);
* :mod:`.context`: :func:`graph`, the capture block on a side stream (``torch.cuda.graph``),
  and the side streams it keeps per device;
* :mod:`.block`: how a capture block (``with g:`` and :func:`graph`) starts (the refusals, then
  a synchronize, under the capture gate) and ends (on its own stream, or discarded after an error);
* :mod:`.checks`: the capture error modes and what a capture_begin refuses (a backend without
  capture, the default stream, a device already capturing), and the ended captures whose
  bookkeeping is still owed (``_unfinished``);
* :mod:`.held`: what a graph holds (:class:`_Held`) and its lifecycle: the begin, end,
  instantiate and destroy of its handles with signals deferred, the discard of a capture, and
  the releases (``__del__``'s, the registry's, and that of what a reset in a collection moved
  aside; a plain reset() releases through ``Graph._release_handles``);
* :mod:`.kept`: the external events and modules a replay keeps in use (``_KeptInUse``);
* :mod:`.pools`: the ids of the graphs' memory pools (``graph_pool_handle``, a graph's own).

This module exports the names the rest of accel and its tests take from ``accel.graphs`` (the
tables and locks are the shared objects themselves, never rebound); a monkeypatch must patch
the module whose code looks the name up (``Graph``'s callees: :mod:`.graph_class`).
"""

from __future__ import annotations

from . import checks, context, graph_class, kept, pools

# The names the rest of accel (and its tests) take from accel.graphs: each the one object its
# module defines (the tables and the lock are only ever mutated, never rebound).
Graph, graph = graph_class.Graph, context.graph
generate_graph_pool_handle, graph_pool_handle = pools.generate_graph_pool_handle, pools.graph_pool_handle
_pool_lock, _unfinished, _KeptInUse = pools._pool_lock, checks._unfinished, kept._KeptInUse
_side_stream, _side_streams = context._side_stream, context._side_streams
_check_pool = graph_class._check_pool     # accel.memory._mempool.check_pool_id

__all__ = ["Graph", "graph", "generate_graph_pool_handle", "graph_pool_handle"]
