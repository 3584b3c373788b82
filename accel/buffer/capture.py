"""Host copies while a stream capture is underway (torch's rule, ATen ``copy_kernel_cuda``).

A copy between host memory and a Buffer on a capturing stream is captured only when it is
``non_blocking`` and the host memory is pinned (:func:`accel.empty_pinned`): every replay copies
from or into the same pinned block again, so the capturing :class:`accel.Graph` holds the block
(not reused, even after its array is gone) until the graph is released.  Everything else is
refused with CaptureError before anything is taken, so the capture stays valid: pageable memory,
a blocking copy (it would synchronize the stream), and a capture that another library began
(accel cannot tell when its graph stops using the block).

The Buffers a capture uses are noted in its table too (:func:`note_captured`): each replay of the
graph records its stream as their use, as a call would.
"""

from __future__ import annotations

import weakref

from ..streams import Stream, _capture_events, _capture_table


def _refuse_in_capture(backend, stream: Stream) -> None:
    """A blocking host copy (array views' copies) on a capturing stream: refused before
    anything is taken, so the capture stays valid (see :func:`_capture_hold` for the copies
    a capture may hold)."""
    if backend.captures_underway():
        with stream._device_scope():
            capturing = backend.capture_id(stream.handle) is not None
        if capturing:
            name = backend.name.upper()
            from .._errors import CaptureError
            raise CaptureError(f"Cannot copy between CPU and {name} tensors during {name} graph capture "
                               f"(the stream {stream!r} is capturing): copy before the capture, capture a "
                               f"copy between two accel.Buffers, or use Buffer.copy_from/copy_to with an "
                               f"accel.empty_pinned array and non_blocking=True; nothing was copied")


def _capture_hold(backend, stream: Stream, address: int, nbytes: int, non_blocking: bool):
    """For a host copy on ``stream``: None when the stream is not capturing, else the
    ``(host allocator, pinned block, hold)`` the copy is captured with.

    torch's rule (ATen ``copy_kernel_cuda``): "Cannot copy between CPU and CUDA tensors during
    CUDA graph capture unless the CPU tensor is pinned", and only ``non_blocking`` (a blocking
    copy synchronizes the stream, which invalidates the capture).  The pinned block is held
    by the capturing accel.Graph: its replays copy from or into it again, so it is not reused
    before the graph is released (a capture some other library began cannot say when that
    is: refused).  Refused before anything is taken, so the capture stays valid."""
    if not backend.captures_underway():
        return None
    with stream._device_scope():
        if backend.capture_id(stream.handle) is None:
            return None
        table = _capture_table(backend, stream)
    name = backend.name.upper()
    from .._errors import CaptureError
    from .buffer_class import _memory      # (buffer_class imports this module)
    host = _memory().host_allocator()
    pinned = host.owns(address, nbytes)
    if pinned is None:
        raise CaptureError(f"Cannot copy between CPU and {name} tensors during {name} graph capture unless the "
                           f"CPU memory is pinned (the stream {stream!r} is capturing): use an "
                           f"accel.empty_pinned array with non_blocking=True, copy before the capture, or "
                           f"capture a copy between two accel.Buffers; nothing was copied")
    if not non_blocking:
        raise CaptureError(f"a blocking copy between CPU and {name} memory waits for the stream, which a "
                           f"{name} graph capture does not allow (the stream {stream!r} is capturing): pass "
                           f"non_blocking=True; nothing was copied")
    if table is None:
        raise CaptureError(f"the stream {stream!r} is capturing, but not into an accel.Graph: accel cannot "
                           f"tell when the graph stops copying from or into the pinned memory, so it cannot "
                           f"keep the memory from reuse until then; capture with accel.Graph, or copy before "
                           f"the capture; nothing was copied")
    hold = table.get("host")
    if hold is None:
        hold = table["host"] = host.capture_hold(stream.device_index)
    return host, pinned, hold


def captured_table(stream: Stream):
    """The table (``streams._capture_events``) of the accel.Graph capture ``stream`` takes part
    in, or None.  Asked before work is queued on ``stream``: it may raise."""
    if not _capture_events or not stream._backend.captures_underway():
        return None
    with stream._device_scope():
        return _capture_table(stream._backend, stream)


def note_captured(table, buffers) -> None:
    """Note ``buffers`` as used by the capture of ``table``: each replay of its graph records its
    stream as their use, as a call would (``pins.record_noted``: the allocator keeps the memory
    until the replay ran, and an export names the stream where accel's latest work on the
    memory is queued) (r73e, r80a).  Weak references, keyed by id (a
    subclass may be unhashable): the graph keeps no buffer alive; an id reused by a new buffer
    replaces a dead one's entry, so the table is bounded by the buffers the capture used."""
    kept = table.get("buffers")
    if kept is None:
        kept = table["buffers"] = {}
    for buf in buffers:
        kept[id(buf)] = weakref.ref(buf)
