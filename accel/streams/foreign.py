"""Streams another library made and owns (foreign): :meth:`Stream.from_handle` and torch's names
for it (:func:`ExternalStream`, :func:`get_stream_from_external`), the CUDA stream protocol
(``__cuda_stream__``, :func:`_as_stream`), and the anchor that all accel wrappers of one
foreign stream hold (:class:`_ForeignAnchor`): when the last goes, accel forgets the handle
(:func:`_forget`) but never destroys the stream."""

from __future__ import annotations

import sys
from typing import Optional

from .. import _finalize as _fin
from .. import _lazy, _locks
from .._device import DeviceLike, check_stream_range
from .._errors import InvalidDeviceError
from ..backends.base import Backend
from ._state import _foreign, _live_streams
from .destroy import _destroy_hooks

#: Held to find or make an anchor, and by _forget from its check to its hooks' end (never waited
#: for by a finalizer: run_locked).  An accel._locks.Lock (r71a): the anchor and its weak
#: reference are allocations, and so are the hooks' calls, where a collection may run a user's gc
#: callback or __del__ that wraps a foreign stream: refused, where a plain lock waited forever on
#: its own thread.  (A forked child finds it free: accel._locks.)
_foreign_lock = _locks.Lock("wrapping a foreign stream")
#: Stream handles are pointers: every valid one is below 2**64.
_HANDLE_LIMIT = 1 << 64


def _forget(backend: Backend, index: int, handle: int, blocking: bool) -> None:
    """The last accel wrapper of foreign stream ``handle`` went: run the destroy hooks (the
    allocators forget the handle, covering its queued work with an event), but never destroy
    it.  While the stream is being captured (by its owner) nothing is forgotten: the capture
    may allocate from a graph pool through the handle, and torch forgets nothing either."""
    if backend.captures_underway() and backend.capture_id(handle) is not None:
        return
    # Under _foreign_lock, which _foreign_stream takes to find or make an anchor: no new wrapper
    # of the handle begins between the check and the hooks.  A finalizer waits for no lock.
    if not _locks.run_locked(_foreign_lock, blocking, _forget_unless_wrapped, backend, index, handle, blocking):
        _fin.defer(_forget, backend, index, handle, True)


def _forget_unless_wrapped(backend: Backend, index: int, handle: int, blocking: bool) -> None:
    anchor = _foreign.get((index, handle))
    if anchor is not None and not anchor.dying:
        # Wrapped again since this forget was asked for: a collection clears the weak reference
        # to its garbage anchor before the anchor's __del__ runs and leaves the forget for after
        # the collection (accel._finalize), and a forget a busy hook deferred waits for the next
        # safe point.  The handle's state is the live wrappers' now; the new anchor forgets it.
        return
    for hook in _destroy_hooks:
        if not hook(backend, index, handle, blocking):
            _fin.defer(_forget, backend, index, handle, True)
            return


class _ForeignAnchor:
    """Held by every accel wrapper of one foreign stream; collected with the last of them,
    when accel forgets the handle (:func:`_forget`).  Takes no lock (a finalizer)."""

    __slots__ = ("backend", "index", "handle", "pid", "dying", "__weakref__")

    def __init__(self, backend: Backend, index: int, handle: int):
        self.backend, self.index, self.handle, self.pid = backend, index, handle, _fin.pid
        self.dying = False

    def __del__(self, _finalizing=sys.is_finalizing):
        # First: outside a collection the weak reference in _foreign still finds this anchor
        # while __del__ runs; a new wrapper must make a new anchor, not take (resurrect) this one.
        self.dying = True
        if _finalizing():
            return      # interpreter exit: module globals may be gone; the process takes it all
        try:
            if self.pid == _fin.pid and _lazy.is_initialized():
                _fin.finalize(_forget, self.backend, self.index, self.handle, False)
        except KeyboardInterrupt:
            _fin.RAISE_AGAIN[_fin.interrupt_key()]    # a Ctrl-C handled in here reaches the program (r62)


#: Makes "closed yet? then mark it closed" one step, so two threads closing one Stream or Event
#: destroy its handle once (the driver gives a freed handle value to the next object it makes).
#: Held for no vendor call, so no finalizer ever waits for it; but Event._made registers the
#: handle's destroy under it (_fin.own: allocations, where a collection may run a user's gc


def ExternalStream(stream_ptr: int, device: DeviceLike = None) -> Stream:
    """torch's name: ``torch.cuda.ExternalStream(stream_ptr, device=None)`` is
    :meth:`Stream.from_handle` (a stream another library owns; accel never destroys it)."""
    return Stream.from_handle(stream_ptr, device)


def get_stream_from_external(data_ptr: int, device: DeviceLike = None) -> Stream:
    """torch's name: ``torch.cuda.get_stream_from_external(data_ptr, device=None)`` (and
    ``torch.xpu.get_stream_from_external``, for a SYCL queue) is :meth:`Stream.from_handle`:
    a :class:`Stream` wrapping a stream another library made and owns.  ``data_ptr`` is the
    stream handle as an int (CUDA: the ``cudaStream_t`` value); ``device`` (default: the
    stream's own device where the runtime can tell, else the current device) must be the
    stream's device, and a wrong one is refused where the runtime can tell.  accel never
    destroys the stream: the owner keeps it alive while a wrapper is in use.  Bad values
    raise as :meth:`Stream.from_handle` does (TypeError, ValueError, InvalidDeviceError)."""
    return Stream.from_handle(data_ptr, device)


def _as_stream(obj, what: str) -> Stream:
    """``obj`` as an accel Stream, for every argument that takes one (``what`` names it in
    errors): a Stream as it is; an object with the CUDA stream protocol
    (``__cuda_stream__() -> (0, handle)``: cuda.core, CuPy and torch streams) as accel's own
    Stream of that handle (a default or accel-created stream) or a new foreign wrapper of it
    (:meth:`Stream.from_handle`, which takes the device from the runtime, else from the
    object's ``device_index``/``device_id``/``device``, else the current device).
    Anything else raises TypeError naming ``what``."""
    if isinstance(obj, Stream):
        return obj
    try:
        protocol = obj.__cuda_stream__
    except AttributeError:
        protocol = None
    if not callable(protocol):
        try:
            shown = repr(obj)
        except Exception:       # noqa: BLE001 - a broken __repr__ must not hide this error
            shown = "(unprintable)"
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise TypeError(f"{what}: expected an accel.Stream or an object with __cuda_stream__ (a cuda.core, "
                        f"CuPy or torch CUDA stream), got {type(obj).__name__} {shown}")
    name = type(obj).__name__
    handle = cuda_stream_handle(obj, what)
    backend = _lazy.lazy_init()
    if backend.name != "cuda":
        # torch.accelerator.set_stream: a stream of another device type is a RuntimeError
        raise InvalidDeviceError(f"{what}: {name} is a CUDA stream (__cuda_stream__) but the accelerator is "
                                 f"{backend.name}; pass an accel.Stream")
    return _foreign_stream(backend, handle, None, what, reuse=True, hint=_device_hint(obj))


def cuda_stream_handle(obj, what: str) -> int:
    """The cudaStream_t that ``obj.__cuda_stream__()`` names, checked: a ``(0, handle)`` tuple
    (version 0, cuda.core's) with an int handle >= 0 that fits in 64 bits; TypeError or
    ValueError naming ``what`` and the value otherwise."""
    name = type(obj).__name__
    value = obj.__cuda_stream__()
    if not isinstance(value, tuple) or len(value) != 2:
        raise TypeError(f"{what}: {name}.__cuda_stream__() returned {value!r}, not the protocol's "
                        f"(version, handle) tuple")
    version, handle = value
    if version != 0:
        raise ValueError(f"{what}: {name}.__cuda_stream__() speaks protocol version {version!r}; accel "
                         f"understands version 0 ((0, cudaStream_t as an int), cuda.core's); wrap the "
                         f"stream with accel.Stream.from_handle(handle, device) instead")
    if isinstance(handle, bool) or not isinstance(handle, int) or handle < 0:
        raise TypeError(f"{what}: {name}.__cuda_stream__() returned handle {handle!r}; the protocol's "
                        f"handle is the cudaStream_t as an int >= 0")
    check_handle_bits(handle, f"{what}: {name}.__cuda_stream__()")
    return handle


def check_handle_bits(handle: int, what: str) -> None:
    """Refuse a stream handle that does not fit in 64 bits: handles are pointers (cudaStream_t),
    and a C cast keeps the low 64 bits, so 2**64 would name the legacy default stream (NULL)."""
    if handle >= _HANDLE_LIMIT:
        raise ValueError(f"{what}: stream handle {handle:#x} does not fit in 64 bits; a stream handle is a "
                         f"pointer-sized unsigned int (cudaStream_t), pass the stream's own handle")


def _device_hint(obj) -> Optional[int]:
    """The device index a foreign stream object states (torch: ``device_index``; CuPy:
    ``device_id``; cuda.core: ``device.device_id``; torch: ``device.index``), or None."""
    for owner, names in ((obj, ("device_index", "device_id")), (None, ("index", "device_id"))):
        if owner is None:
            try:
                owner = obj.device
            except Exception:
                return None
        for attr in names:
            try:
                value = getattr(owner, attr)
            except Exception:
                continue
            if type(value) is int and value >= 0:
                return value
    return None


def _foreign_stream(backend: Backend, handle: int, index: Optional[int], what: str, reuse: bool,
                    hint: Optional[int] = None) -> Stream:
    """A Stream for ``handle`` on device ``index`` (None: the stream's own, else ``hint``, else
    the current device), checked with the backend.  ``reuse``: accel's own Stream object where
    the handle is a default or live accel-created stream; otherwise always a new wrapper."""
    try:
        handle, actual = backend.foreign_stream(handle)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    if actual is not None:
        if index is not None and index != actual:
            raise InvalidDeviceError(f"{what}: stream {handle:#x} belongs to device {actual}, not device "
                                     f"{index}; pass device={actual} (or None)")
        index = actual
    elif index is None:
        if hint is not None:
            check_stream_range(hint)
            index = hint
        else:
            index = backend.get_device()
    key = (index, handle)
    if handle == backend.default_stream(index):
        return default_stream(index) if reuse else Stream._wrap(backend, index, handle, foreign=True)
    own = _live_streams.get(key)
    if own is not None and not own._closed:
        # accel's own stream: its close() forgets the handle; the wrapper holds it as its anchor, so
        # that the stream's collection (its last other reference gone: a graph that held its
        # capture's origin, a buffer's last use) does not destroy the handle the wrapper names
        return own if reuse else Stream._wrap(backend, index, handle, anchor=own)
    with _foreign_lock:
        anchor = _foreign.get(key)
        if anchor is None or anchor.dying:     # (dying: its __del__ runs, see _ForeignAnchor)
            anchor = _foreign[key] = _ForeignAnchor(backend, index, handle)
    return Stream._wrap(backend, index, handle, anchor=anchor)


# (at the end: stream.py uses these at call time, and these use Stream)
from .current import default_stream  # noqa: E402
from .stream import Stream  # noqa: E402
