"""How a capture block (``with g:`` and :func:`accel.graph`) starts and ends.

It starts with capture_begin's refusals and a synchronize of the current device as one step
under the capture gate (r65j), so a refusal comes before the synchronize that would invalidate
another capture.  A body that returns ends the capture on its own stream; a body that raised,
or left another stream current, or a KeyboardInterrupt before the end, ends it and discards
it, so no capture is left underway that no one ends (every later sync would fail).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .. import _finalize as _fin
from ..streams import Stream, current_stream
from .checks import _finish_owed_ends, _graph_backend, _refuse_default_stream

if TYPE_CHECKING:
    from .graph_class import Graph


def _refuse_then_synchronize(graph: "Graph", indices, stream: Optional[Stream] = None) -> None:
    """``with g:`` and :func:`accel.graph`: capture_begin's refusals for ``graph`` (the Graph) on the
    devices ``indices`` (None: the current one) and for the capture ``stream`` when known (the
    default stream: r70c, the refusal came after the synchronize and the emptied caches), then a
    synchronize of the current device, as one step under the capture gate: a capture another thread
    began between the check and the synchronize would be invalidated by it (r65j).  Deferred
    releases run first, outside the gate: they take the allocators' locks, which every other path
    takes before the gate (holding the gate across accel.synchronize()'s drain deadlocked against a
    record_stream: tests/test_gc_stress.py)."""
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
    """End the capture of a ``with g:`` or :func:`accel.graph` block whose body returned.  A body
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
