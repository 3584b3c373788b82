"""The stream ordering between a producer and a consumer, which ``__dlpack__`` and
``__cuda_array_interface__`` share.

**Stream handshake** (:func:`sync_for_consumer`): the array API standard's ``__dlpack__``
``stream`` argument, CUDA values: None (the legacy default stream), 1 (legacy default), 2 (per-thread
default), another int (a ``cudaStream_t``), -1 (no synchronization); 0 is disallowed.  The
consumer's stream waits for an event recorded on the buffer's last-use stream, and for its work
on every other stream (:func:`order_after_other_uses`, CAI v3's rule too); a closed stream's work
is waited for on the host (:func:`wait_for_closed`, :func:`wait_for_stream`).

**Imports** (:func:`wait_for_producer`, :func:`order_producer_after`): accel's stream waits for
the producer's (the ``stream`` of a ``__cuda_array_interface__``, or the one ``accel.from_dlpack``
passed), and the producer's waits for accel's copy.

**Captures**: a wait that would invalidate a stream capture underway, or pull a stream into it,
is refused with CaptureError before anything is queued (``_refuse_waiting_on_capture``,
``_refuse_waiting_from_capture``, ``_refuse_wait_into_capture``).
"""

from __future__ import annotations

import contextlib
import operator
import weakref

from .. import _finalize
from .._errors import AcceleratorError, CaptureError

# -- stream handshake -------------------------------------------------------------------------
_CUDA_LEGACY, _CUDA_PER_THREAD = 1, 2    # cudaStreamLegacy, cudaStreamPerThread


def _consumer_handle(backend, index: int, stream_arg):
    """The consumer's stream as ``(device index, backend handle)``, ``"host"`` (wait on the host)
    or None for "no synchronization".  An int names a stream of the buffer's device ``index``
    (legacy and per-thread handles are the current device's); an accel.Stream its own device
    (every device's default stream has the same handle 0 on CUDA)."""
    from ..streams import Stream, check_handle_bits, cuda_stream_handle
    if isinstance(stream_arg, Stream):
        if stream_arg._backend is not backend:
            raise ValueError(f"stream {stream_arg!r} belongs to {stream_arg._backend.name}, "
                             f"the buffer to {backend.name}")
        if stream_arg._foreign:
            stream_arg._check_alive()   # (r83a: a wrapper of a closed stream got the consumer's wait)
        return stream_arg.device_index, stream_arg.handle
    if backend.name == "cuda" and stream_arg is not None and hasattr(stream_arg, "__cuda_stream__"):
        # (0, 0) is a default stream object's (torch, cuda.core): the legacy stream, as _ask maps it
        stream_arg = cuda_stream_handle(stream_arg, "stream") or _CUDA_LEGACY
    if stream_arg is None:
        return (index, backend.default_stream(index)) if backend.name == "cuda" else "host"
    if isinstance(stream_arg, bool) or not hasattr(type(stream_arg), "__index__"):
        # (r82b: it offered an int on every backend and left out accel.Stream)
        handle = ", a cudaStream_t handle (int)" if backend.name == "cuda" else ""
        raise TypeError(f"stream must be None, -1, an accel.Stream{handle} on {backend.name}, got "
                        f"{type(stream_arg).__name__} {stream_arg!r}")
    value = operator.index(stream_arg)
    if value == -1:
        return None
    check_handle_bits(value, f"__dlpack__(stream={value:#x})")
    if backend.name != "cuda":
        raise ValueError(f"stream={value}: on {backend.name} __dlpack__ takes stream None (accel waits for the "
                         f"buffer's work before returning), -1 (no synchronization) or an accel.Stream")
    if value == 0:
        raise ValueError("stream=0 is disallowed by the DLPack protocol (ambiguous between the legacy and the "
                         "per-thread default stream): pass 1 (legacy default), 2 (per-thread default) or a "
                         "cudaStream_t handle")
    if value < -1:
        raise ValueError(f"stream={value}: stream handles are >= -1")
    if value == _CUDA_LEGACY:
        return index, backend.default_stream(index)
    return index, value


def sync_for_consumer(buffer, stream_arg) -> None:
    """Make ``buffer``'s data ready for a DLPack consumer working on ``stream_arg`` (the
    ``stream`` argument of ``__dlpack__``), as the array API standard asks of a producer.

    CUDA: None and 1 mean the legacy default stream of the buffer's device, 2 the per-thread
    default stream, another int a ``cudaStream_t``, an accel.Stream its stream on its own device
    (the wait is queued with that device current), another object with ``__cuda_stream__`` its
    handle (0, a default stream's, as 1); -1 asks for no synchronization; 0 is refused.  When the consumer's
    stream is not the buffer's last-use stream, an event is recorded on the last-use stream and
    the consumer's stream waits for it (torch's ``Tensor.__dlpack__``, which uses the current
    stream where accel uses the last-use one).  Other backends: None waits on the host for the
    last-use stream, -1 nothing, an accel.Stream waits for an event.  Afterwards an accel stream
    of the consumer becomes the buffer's last-use stream.  The consumer's stream is not recorded
    with the allocator (as torch): the consumer calls the deleter after its work, or syncs.

    The accel streams whose handles are passed on (the last-use stream, an accel.Stream
    consumer) are held meanwhile (``streams._Hold``): another thread's close() of one leaves its
    destroy to the end of the handshake, so the handle names no newer stream while in use."""
    from ..streams import Stream, _Hold
    buffer._live()
    with _Hold(stream_arg) if isinstance(stream_arg, Stream) else contextlib.nullcontext():
        _sync_for_consumer(buffer, stream_arg)


def _sync_for_consumer(buffer, stream_arg) -> None:
    from ..streams import Stream, _hold_open, on_device
    backend, index = buffer._backend, buffer._index
    consumer = _consumer_handle(backend, index, stream_arg)
    if consumer is None:
        return
    last = buffer._last
    check_foreign_alive(last)
    hold = _hold_open(last)
    if hold is None:    # closed (maybe by another thread just now)
        wait_for_closed(backend, last)
        order_after_other_uses(buffer, last, consumer)
        known = None if consumer == "host" else _accel_stream(backend, *consumer)
        if known is not None:
            buffer._used(known)
        return
    try:
        if backend.captures_underway():
            _refuse_waiting_on_capture(backend, last, consumer)
        order_after_other_uses(buffer, last, consumer)
        if consumer == "host":
            last.synchronize()
            return
        device, handle = consumer
        if handle == last._handle and device == last._index:
            return
        # The event lives on the last-use stream's device (a peer copy may have used the buffer on
        # another device's stream: cudaEventRecord needs the stream's device); the wait runs with the
        # consumer stream's device current, since legacy/per-thread handles name the current
        # device's stream (for an int, the buffer's device).
        with on_device(backend, last._index):
            event = backend.event_create(False, False)
        try:
            with on_device(backend, last._index):
                backend.event_record(event, last._handle)
            with on_device(backend, device):
                try:
                    backend.stream_wait_event(handle, event)
                except AcceleratorError as exc:
                    # only a handle the runtime does not know (a capture error keeps its type and words)
                    if isinstance(stream_arg, Stream) or exc.code_name not in (
                            "cudaErrorInvalidResourceHandle", "cudaErrorInvalidValue"):
                        raise
                    raise AcceleratorError(
                        f"__dlpack__(stream={stream_arg!r}): {backend.name} refused it as the consumer's stream "
                        f"({exc}); pass a live stream handle of device {device} (the consumer's current "
                        f"stream), None for the legacy default stream, or -1 for no synchronization",
                        library=exc.library, call=exc.call, code=exc.code, code_name=exc.code_name) from exc
        finally:
            # the wait is queued; CUDA frees the event when it completes.  A failed destroy is
            # tried again at the next drain (_finalize.finalize), not lost with the error
            _finalize.finalize(backend.event_destroy, event)
    finally:
        hold.__exit__(None, None, None)
    known = _accel_stream(backend, device, handle)
    if known is not None:
        buffer._used(known)


def _refuse_waiting_on_capture(backend, last, consumer) -> None:
    """A consumer that waits on the host ("host"), or the legacy default stream (CUDA: it
    synchronizes with every blocking stream), cannot wait for a capturing last-use stream: CUDA
    invalidates the capture (cudaErrorStreamCaptureImplicit; Programming Guide, "CUDA Graphs" >
    "Prohibited and Unhandled Operations"), as would a host wait; nor can another stream outside
    that capture (it would be forked into it) or any other stream where the backend records no
    event in a capture (XPU).  Refused before anything is queued, so the capture goes on."""
    from .._errors import CaptureError
    with last._device_scope():
        capturing = backend.capture_id(last._handle)
    if capturing is None:
        _refuse_waiting_from_capture(backend, last, consumer)
        return
    if consumer != "host" and consumer[1] != backend.default_stream(consumer[0]):
        if consumer == (last._index, last._handle):
            return
        if backend.records_events_in_capture:
            theirs = _capture_of(backend, consumer[1], consumer[0])
            if theirs == capturing:
                return      # a stream of the same capture: the wait is captured too
            # (as _refuse_wait_into_capture: a stream outside the capture waiting for an event
            # recorded in it is forked into it, so the consumer's next work is captured instead
            # of run, and the capture cannot end until that stream joins back,
            # cudaErrorStreamCaptureUnjoined; one in another capture is refused by CUDA,
            # cudaErrorStreamCaptureIsolation)
            where = "is not capturing" if theirs is None else "is in another stream capture"
            raise CaptureError(f"__dlpack__(stream={consumer[1]:#x}): the buffer was last used on {last!r}, "
                               f"which is capturing, and the consumer's stream {where}: its wait for the "
                               f"captured work would pull it into the capture (its next work captured "
                               f"instead of run) or be refused; export after the capture ends (after a "
                               f"replay), pass a stream of the capture or stream=-1; nothing was exported")
        raise CaptureError(f"__dlpack__(stream=<another stream>): the buffer was last used on {last!r}, which is "
                           f"capturing, and {backend.name}'s capture cannot record the event another stream "
                           f"would wait for: pass the capturing stream itself or stream=-1; nothing was exported")
    what = "stream=None/1 (the legacy default stream)" if consumer != "host" else "stream=None (a host wait)"
    raise CaptureError(f"__dlpack__ with {what}: the buffer was last used on {last!r}, which is capturing, and "
                       f"waiting for a capturing stream there would invalidate the capture: pass the "
                       f"consumer's own stream (e.g. the capturing one) or stream=-1; nothing was exported")


def _refuse_waiting_from_capture(backend, last, consumer) -> None:
    """The last-use stream is not capturing: a consumer inside a capture cannot wait for it.  A
    capturing consumer stream would wait on an event recorded outside its capture (CUDA refuses
    it and invalidates the capture: Programming Guide, "CUDA Graphs" > "Cross-stream
    Dependencies and Events"; Level Zero's capture records no cross-list wait), and a host wait
    invalidates the captures whose modes forbid it (Backend.host_wait_refused).  Refused before
    anything is queued (r67i: from_dlpack of a buffer last used on the default stream
    invalidated the capture it was called in)."""
    from .._errors import CaptureError
    if consumer == "host":
        with last._device_scope():      # (host_wait_refused reads the stream's device as current)
            why = backend.host_wait_refused(last._handle)     # (by capture mode: r67j)
        if why is None:
            return
        raise CaptureError(f"__dlpack__ with stream=None (a host wait for {last!r}, the buffer's last use) "
                           f"while {why}: the wait would invalidate the capture; synchronize before "
                           f"capture_begin(), capture in relaxed mode, or pass the consumer's stream or "
                           f"stream=-1; nothing was exported")
    device, handle = consumer
    if handle == last._handle and device == last._index:
        return
    from ..streams import on_device
    with on_device(backend, device):
        if backend.capture_id(handle) is None:
            return
    raise CaptureError(f"the consumer's stream is capturing, and the buffer was last used outside the capture, on "
                       f"{last!r}: a captured wait for work outside the capture would invalidate it; "
                       f"synchronize (or make the capturing stream wait) before capture_begin(), or pass "
                       f"stream=-1; nothing was exported")


def wait_for_closed(backend, stream, why: str = "") -> None:
    """Wait on the host for the work a closed ``stream`` may still run: it still runs after the
    stream is closed (cudaStreamDestroy returns at once), but no event can be recorded on it any
    more, so its device is synchronized.  CaptureError while a capture is underway: the device
    synchronize would invalidate it (a global-mode capture of any thread: CUDA Runtime API,
    cudaStreamBeginCapture), and none begins between the check and the synchronize
    (``backend.capture_gate``)."""
    from ..streams import on_device
    with backend.capture_gate:
        if backend.captures_underway():
            raise CaptureError(f"the buffer was last used on {why or 'a stream that is closed'} ({stream!r}): "
                               f"its queued work can only be waited for by a device synchronize, which would "
                               f"invalidate the stream capture underway; export it after the capture ends"
                               + ("" if why else ", or keep the stream open until the buffer is exported"))
        with on_device(backend, stream.device_index):
            backend.device_synchronize()


def wait_for_stream(backend, stream, why: str) -> None:
    """Wait on the host for the work queued so far on ``stream`` (another device's, still
    open): a stream synchronize, not the device's (r72d: work of other streams there, maybe
    waiting for what the caller does next, is not waited for).  A stream closed meanwhile is
    waited for as :func:`wait_for_closed` does.  CaptureError while a capture is underway, as
    there (a wait on the host would invalidate a global-mode capture)."""
    from ..streams import _hold_open
    held = _hold_open(stream)
    if held is None:
        wait_for_closed(backend, stream, why)
        return
    try:
        _host_wait(backend, stream.device_index, stream._handle, f"{why} ({stream!r})")
    finally:
        held.__exit__(None, None, None)


def _host_wait(backend, device: int, handle: int, what: str) -> None:
    """Synchronize stream ``handle`` of ``device``, no capture beginning meanwhile
    (``backend.capture_gate``); CaptureError naming ``what`` where the wait would invalidate a
    capture underway (r72g: a relaxed capture, or one another thread's mode keeps to itself,
    allows it, as it allows Stream.synchronize)."""
    from ..streams import on_device
    with backend.capture_gate, on_device(backend, device):
        refused = None
        if backend.captures_underway():
            refused = ("that stream is capturing" if backend.capture_id(handle) is not None
                       else backend.host_wait_refused(handle))
        if refused:
            raise CaptureError(f"the buffer was used on {what}: waiting for it on the host now would invalidate "
                               f"the stream capture underway ({refused}); export it after the capture ends")
        backend.stream_synchronize(handle)


def check_foreign_alive(stream) -> None:
    """ValueError naming the stream when ``stream`` is an open :meth:`Stream.from_handle` wrapper
    whose owner destroyed it: its handle may name the next stream the driver made, so no export
    may hand it on or wait on it (as ``fill_``/``copy_to`` refuse it: ``Stream._check_alive``)."""
    if stream._foreign and not stream._closed:
        stream._check_alive()


def order_after_other_uses(buffer, last, waiter) -> None:
    """Order ``waiter`` after the work on ``buffer`` still queued on a stream other than ``last``
    (its last-use stream).  ``waiter`` is ``(device, handle)``, the stream an export names (CAI:
    ``last`` itself; ``__dlpack__``: the consumer's), or "host".  CAI v3: "If the Producer has
    enqueued work on the data on multiple streams, then it must enqueue events on those streams
    that follow the enqueued work, and then wait on those events in the provided stream"; the
    array API's ``__dlpack__`` likewise makes the data safe to use on the consumer's stream.

    The other streams: the buffer's allocation stream, those :meth:`Buffer.record_stream` noted
    with the allocator (a non-owning buffer's noted streams).  Each is skipped when a query says
    its work is done, else ``waiter`` waits for an event recorded on it (the allocator's
    ``order_after``; a "host" waiter waits on the host).  Work of such a stream closed since is
    waited for by a synchronize of its device, once per closed stream (``Buffer._drained``: the
    closed streams, or the allocator's records of them, already waited for, by id, held weakly:
    an entry goes with its object, so it is bounded by them and an id never names another).

    While a capture is underway (CUDA's rules for the calls, Programming Guide "CUDA Graphs" >
    "Prohibited and Unhandled Operations", and cudaStreamBeginCapture's modes): nothing when
    ``waiter`` is capturing (its work runs at a replay; a capture cannot wait for work outside
    it); a stream that is capturing is skipped (what it queued before its capture began cannot be
    waited for without invalidating it); a query only where a host wait is allowed
    (``Backend.host_wait_refused``), else the event wait, which is; a host wait or a device
    synchronize that would invalidate the capture raises CaptureError instead."""
    backend = buffer._backend
    others, closed = {}, {}

    def note(stream):
        if stream is last or stream == last:
            return
        if stream.closed:
            closed[id(stream)] = (stream.device_index, stream)
        else:
            others.setdefault((stream._index, stream._handle), stream)

    note(buffer._stream)
    if buffer._uses is not None:
        for stream in list(buffer._uses.values()):
            note(stream)
    elif buffer._recorded:
        live, gone = buffer._alloc.stream_uses(buffer._ptr)
        for record, device in gone:
            closed[id(record)] = (device, record)
        for handle, device in live:
            if (device, handle) != (last._index, last._handle):
                # (a raw handle: an accel stream, or a foreign one whose wrapper still lives; a
                # destroyed stream's use is a covering event, in ``gone``)
                others.setdefault((device, handle), None)
    drained = buffer._drained
    if drained:
        # (an entry lives only while its object does, so a key never names another object)
        closed = {key: v for key, v in closed.items() if drained.get(key) is not v[1]}
    if not others and not closed:
        return
    from ..streams import _hold_open, on_device
    if waiter != "host" and backend.captures_underway():
        with on_device(backend, waiter[0]):
            if backend.capture_id(waiter[1]) is not None:
                return
    for device in sorted({device for device, _ in closed.values()}):
        with backend.capture_gate:
            if backend.captures_underway():
                raise CaptureError(f"{buffer!r} was used on a stream of device {device} that is closed now: its "
                                   f"queued work can only be waited for by a device synchronize, which would "
                                   f"invalidate the stream capture underway; export it after the capture ends")
            with on_device(backend, device):
                backend.device_synchronize()
    if closed:
        done = buffer._drained
        if done is None:
            done = buffer._drained = weakref.WeakValueDictionary()
        for key, (_device, obj) in closed.items():
            done[key] = obj
    for (device, handle), stream in others.items():
        held = None if stream is None else _hold_open(stream)
        if stream is not None and held is None:
            wait_for_closed(backend, stream, "another stream than the one exported, closed just now")
            continue
        try:
            _order_after_one(backend, device, handle, waiter, stream)
        finally:
            if held is not None:
                held.__exit__(None, None, None)


def _order_after_one(backend, device: int, handle: int, waiter, stream) -> None:
    """:func:`order_after_other_uses` for the stream ``handle`` of ``device`` (``stream`` its
    accel Stream, held open, or None)."""
    from .. import memory
    from ..streams import on_device
    with on_device(backend, device):
        if backend.captures_underway():
            if backend.capture_id(handle) is not None:
                return
            query = backend.host_wait_refused(handle) is None
        else:
            query = True
        if query and backend.stream_query(handle):
            return
    if waiter != "host":
        if memory.device_allocator(waiter[0]).order_after(waiter[1], handle, device):
            return
    what = repr(stream) if stream is not None else f"stream {handle:#x} of device {device}"
    _host_wait(backend, device, handle, f"another stream than the one exported, with work still queued ({what})")


def wait_for_producer(backend, index: int, producer, stream) -> None:
    """Make accel ``stream`` wait for the work a producer queued on its stream ``producer``
    (the ``stream`` of a __cuda_array_interface__ v3: 1 legacy default, 2 per-thread default
    (both device ``index``'s), else a ``cudaStream_t``, of any device: CuPy exports the current
    device's stream, which need not be the data's).  The event is made and recorded with the
    producer stream's device current, as cudaEventRecord asks.  ``stream``, and the producer's
    stream when it is a live accel stream (an accel buffer's interface), are held meanwhile
    (``streams._Hold``): another thread's close() of one leaves its destroy to the end."""
    _order_with_producer(backend, index, producer, stream, True)


def order_producer_after(backend, index: int, producer, stream) -> None:
    """The consumer's other half of CAI v3's handshake, once its work on the data is queued on
    ``stream`` and control returns before it ran (a non-blocking copy): the producer's stream
    waits for it, so that the producer's next work cannot overwrite the data under it ("Placing
    a wait on an event in the provided stream that occurs once all of the consumer's operations
    on the data are completed").  ``producer`` as for :func:`wait_for_producer`."""
    _order_with_producer(backend, index, producer, stream, False)


def _order_with_producer(backend, index: int, producer, stream, producer_first: bool) -> None:
    from ..streams import _Hold, _hold_open, check_handle_bits, on_device
    if isinstance(producer, bool) or not hasattr(type(producer), "__index__"):
        raise ValueError(f"__cuda_array_interface__ stream must be an int or None, got {producer!r}")
    handle = operator.index(producer)
    if handle < 0:
        raise ValueError(f"__cuda_array_interface__ stream {handle} is not a stream (CAI v3: None, 1, 2 or a "
                         f"cudaStream_t); nothing was copied")
    check_handle_bits(handle, "__cuda_array_interface__ stream")
    if handle == 0:
        raise ValueError("__cuda_array_interface__ stream 0 is disallowed (CAI v3); the producer must give "
                         "1 for the legacy default stream")
    device = index
    if handle == _CUDA_LEGACY:
        handle = backend.default_stream(index)
    elif handle != _CUDA_PER_THREAD:
        try:
            handle, actual = backend.foreign_stream(handle)
        except ValueError as exc:
            raise ValueError(f"__cuda_array_interface__ stream: {exc}; nothing was copied") from None
        if actual is not None:
            device = actual
    own = None if handle == _CUDA_PER_THREAD else _accel_stream(backend, device, handle)
    held = None if own is None else _hold_open(own)
    try:
        with _Hold(stream):
            if handle == stream._handle and device == stream._index:
                return
            # the signalling side's device is current for the event's creation and record, as
            # cudaEventRecord asks; a wait may name another device's event
            (signal, signal_device), (waiter, waiter_device) = (
                ((handle, device), (stream._handle, stream._index)) if producer_first
                else ((stream._handle, stream._index), (handle, device)))
            if backend.captures_underway():
                _refuse_wait_into_capture(backend, signal, signal_device, waiter, waiter_device)
            with on_device(backend, signal_device):
                event = backend.event_create(False, False)
            try:
                with on_device(backend, signal_device):
                    backend.event_record(event, signal)
                with on_device(backend, waiter_device):
                    backend.stream_wait_event(waiter, event)
            finally:
                _finalize.finalize(backend.event_destroy, event)      # (as in _sync_for_consumer)
    finally:
        if held is not None:
            held.__exit__(None, None, None)


def _refuse_wait_into_capture(backend, signal: int, signal_device: int, waiter: int, waiter_device: int) -> None:
    """CaptureError, before anything is queued, when one of the two streams is capturing and the
    other is not part of that capture.  A capturing waiter would wait for an event recorded
    outside its capture, which CUDA refuses and which invalidates it (cudaErrorStreamCaptureIsolation;
    Programming Guide, "CUDA Graphs" > "Cross-stream Dependencies and Events"); a waiter outside a
    capturing signaller would be forked into the capture, so the copy it queues next is captured
    instead of run, and the capture cannot end until that stream joins back
    (cudaErrorStreamCaptureUnjoined)."""
    if _capture_of(backend, waiter, waiter_device) == _capture_of(backend, signal, signal_device):
        return
    raise CaptureError(f"the __cuda_array_interface__ producer's stream and the copy's stream ({signal:#x} on "
                       f"device {signal_device}, {waiter:#x} on device {waiter_device}) are not in the same "
                       f"stream capture: ordering them would invalidate the capture or pull the other stream "
                       f"into it.  Copy on the capturing stream itself, or outside the capture (synchronize the "
                       f"producer first); nothing was copied")


def _capture_of(backend, handle: int, device: int):
    """The id of the capture stream ``handle`` of ``device`` takes part in, or None (asked with
    that device current: legacy and per-thread handles name the current device's stream)."""
    from ..streams import on_device
    with on_device(backend, device):
        return backend.capture_id(handle)


def _accel_stream(backend, index: int, handle: int):
    """The accel Stream a handle names on device ``index`` (its default or a live created
    stream), or None for a foreign stream."""
    from .. import streams
    if handle == backend.default_stream(index):
        return streams.default_stream(index)
    stream = streams._live_streams.get((index, handle))
    return stream if stream is not None and not stream.closed else None
