"""Streams, events, and the per-thread current stream.

A :class:`Stream` is an ordered queue of device work; an :class:`Event` marks
a point in one, so other streams (``wait_event``) or the host
(``synchronize``) can wait for it.  Both wrap ``int`` handles of the selected
backend, so this module is the same for every runtime.

The *current stream* is kept per thread and per device, defaulting to the
device's default stream, as in CUDA and torch.

Where the backend's default stream is one handle for every device, resolved
against the calling thread's current device (CUDA's legacy stream 0), every
call on a default stream runs with its device current (``Stream._shared``), as
torch's ``CUDAStream`` methods do under a ``DeviceGuard``.  Created streams carry
their device in the handle and need no switch.

**Foreign streams.**  ``Stream.from_handle(handle, device)`` (torch's ``ExternalStream``) wraps
a stream another library made, and :func:`_as_stream` turns anything with the CUDA stream
protocol (``__cuda_stream__() -> (0, handle)``: cuda.core, CuPy, torch) into a Stream wherever
accel takes one.  accel never destroys such a stream.  What accel keys by its handle (the
caching allocator's free lists and stream uses) is forgotten, as for a destroyed stream of its
own (:func:`on_stream_destroy`), when the last accel wrapper of it goes: the driver gives a
destroyed stream's handle value to the next stream it creates, so free lists left keyed by the
handle would be inherited by an unrelated stream while the dead one's work may still run.
torch keeps them (``CUDACachingAllocator`` keys blocks by ``cudaStream_t`` and never forgets an
external one).  The owner must therefore keep the stream alive until accel's wrappers of it
are closed or gone, Buffers allocated on it included (torch asks the same while its
ExternalStream "is being used").

The package, one module per concern, each with its part of the design in its docstring:

* :mod:`.stream`: the :class:`Stream` class, and :class:`on_device` (the device guard);
* :mod:`.current`: each thread's current streams and ``with stream:`` stack, ``current_stream``,
  ``set_stream``, ``default_stream``;
* :mod:`.event`: the :class:`Event` class, and the external events of captures underway;
* :mod:`.uses`: uses of a handle in flight (``_Use``, ``_Hold``, ``_ExportMark``), and close() during one;
* :mod:`.foreign`: foreign streams (``Stream.from_handle``, ``__cuda_stream__``) and their anchors;
* :mod:`.destroy`: the destroy of owned streams and events, and the hooks that hear of it first;
* :mod:`._state`: the tables, and ``_tls`` (each thread's state), which ``_reset`` rebinds: read
  it as ``accel.streams._state._tls``, never imported by name.

This module exports the names the rest of accel imports (the tables and locks are the shared
objects themselves, never rebound); a monkeypatch must patch the module whose code looks the name up.
"""

from __future__ import annotations

from . import _state, current, destroy, event, foreign, stream, uses

# The names the rest of accel (and its tests) take from accel.streams: each the one object its
# module defines (the tables and locks are only ever mutated, never rebound; ``_tls`` is not here).
Stream, on_device, _index_for = stream.Stream, stream.on_device, stream._index_for
current_stream, set_stream, default_stream = current.current_stream, current.set_stream, current.default_stream
Event, _DeviceMismatchError = event.Event, event._DeviceMismatchError
_capture_of, _capture_table = event._capture_of, event._capture_table
ExternalStream, get_stream_from_external = foreign.ExternalStream, foreign.get_stream_from_external
_as_stream, check_handle_bits = foreign._as_stream, foreign.check_handle_bits
cuda_stream_handle = foreign.cuda_stream_handle
on_stream_destroy, announced, _after_captures = destroy.on_stream_destroy, destroy.announced, destroy._after_captures
_destroy_hooks = destroy._destroy_hooks
_Use, _Hold, _ExportMark, _hold_open = uses._Use, uses._Hold, uses._ExportMark, uses._hold_open
_claim_close, _closed_during_use = uses._claim_close, uses._closed_during_use
_capture_events, _defaults, _foreign, _live_streams, _stacks = (
    _state._capture_events, _state._defaults, _state._foreign, _state._live_streams, _state._stacks)
_close_lock, _create_lock, _defaults_lock, _foreign_lock = (
    uses._close_lock, event._create_lock, current._defaults_lock, foreign._foreign_lock)

__all__ = ["Stream", "Event", "current_stream", "set_stream", "default_stream", "on_device"]
