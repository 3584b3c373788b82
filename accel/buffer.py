"""``accel.Buffer``: an owned range of device memory, and host↔device copies.

Memory comes from the device's caching allocator and goes back to it when the
buffer is closed or collected; the allocator keeps it unused until the work
queued on the buffer's streams has finished.  Copies are ordered on a stream
(by default the current stream of the buffer's device, as every torch operation);
blocking copies return when the data has arrived, ``non_blocking`` host→device
copies stage through pinned host memory and return at once.
"""

from __future__ import annotations

import operator
import re
from typing import Optional

from . import _finalize as _fin
from . import _lazy
from ._device import DeviceLike, device
from .streams import Stream, _as_stream, _index_for, current_stream, on_device

__all__ = ["Buffer"]

_FIELD_NAMES = re.compile(r":[^:]*:")   # struct-format field names, e.g. T{<q:a:O:b:}
_CAI_LEGACY_DEFAULT_STREAM = 1  # __cuda_array_interface__ v3: 0 is disallowed, 1 means the legacy stream


def _memory():
    """accel.memory, imported on first buffer use so `import accel` stays small."""
    from . import memory
    return memory


def _check_plain(obj, view, what: str) -> None:
    """Refuse buffers holding Python object references: their bytes are PyObject* addresses,
    so copying device bytes into them (or uploading them) corrupts the interpreter."""
    dtype = getattr(obj, "dtype", None)
    if getattr(dtype, "hasobject", False) or "O" in _FIELD_NAMES.sub("", view.format):
        shown = dtype if dtype is not None else f"format {view.format!r}"
        raise TypeError(f"cannot copy {what} an array of dtype {shown}: it holds Python object references, "
                        f"not data; use an array of plain numbers (e.g. numpy.float32 or uint8); "
                        f"nothing was copied")


def _host_view(src):
    """A read-only contiguous byte memoryview of a host object, or a clear error."""
    try:
        view = memoryview(src)
    except TypeError:
        raise TypeError(f"cannot copy from {type(src).__name__}: expected a numpy array, an accel.Buffer, "
                        f"or a bytes-like object") from None
    _check_plain(src, view, "from")
    if not view.c_contiguous:
        raise ValueError("source array is not C-contiguous; pass numpy.ascontiguousarray(a) "
                         "(nothing was copied)")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _refuse_in_capture(backend, stream: Stream) -> None:
    """torch's rule: no host copy on a capturing stream.  Refused before anything is taken,
    so the capture stays valid and no pinned block or event is captured."""
    if backend.captures_underway():
        with stream._device_scope():
            capturing = backend.capture_id(stream.handle) is not None
        if capturing:
            name = backend.name.upper()
            from ._errors import CaptureError
            raise CaptureError(f"Cannot copy between CPU and {name} tensors during {name} graph capture "
                               f"(the stream {stream!r} is capturing): copy before the capture, or capture a "
                               f"copy between two accel.Buffers instead; nothing was copied")


def _size(value, what: str) -> int:
    """An ``__index__`` integer (int, numpy integer) as an int; bool and floats are refused."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None


def _drain(stream: Stream) -> None:
    """Wait for ``stream`` on an error path, keeping the error being raised."""
    try:
        stream.synchronize()
    except Exception:
        pass


def _address(view) -> int:
    from ._hostmem import address_of
    return address_of(view)


class Buffer:
    """``Buffer(nbytes, device=None, stream=None)``: ``nbytes`` of device memory.

    ``stream`` (default: the device's current stream) is the stream the memory
    is allocated for.  Copies and fills run on the ``stream`` they are given,
    by default the *current* stream of the buffer's device (as torch), so they
    are ordered with RNG fills and graph replays; a use on a stream other than
    the allocation stream is recorded with the allocator (``record_stream``),
    which keeps the memory from reuse until that work has run.  ``ptr`` is the device
    address; on CUDA the buffer exports ``__cuda_array_interface__`` (v3) so
    CuPy, Numba or PyTorch can use it without a copy.
    """

    __slots__ = ("_backend", "_index", "_ptr", "_nbytes", "_stream", "_closed", "_pid", "__weakref__")

    def __init__(self, nbytes: int, device: DeviceLike = None, stream: Optional[Stream] = None):
        nbytes = _size(nbytes, "nbytes")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        backend = _lazy.lazy_init()
        if stream is not None:
            stream = _as_stream(stream, "Buffer(stream)")
            index = stream.device_index if device is None else _index_for(device)
            if index != stream.device_index:
                raise ValueError(f"stream is on device {stream.device_index} but the buffer was asked "
                                 f"for device {index}")
        else:
            index = _index_for(device)
            stream = current_stream(index)
        self._backend, self._index, self._nbytes, self._stream = backend, index, nbytes, stream
        self._closed = True
        self._pid = _fin.pid
        self._ptr = _memory().device_allocator(index).malloc(nbytes, stream.handle) if nbytes else 0
        self._closed = False

    # -- identity ----------------------------------------------------------------
    @property
    def ptr(self) -> int:
        self._live()
        return self._ptr

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return self._nbytes

    @property
    def device(self) -> device:
        return device(self._backend.name, self._index)

    @property
    def device_index(self) -> int:
        return self._index

    @property
    def stream(self) -> Stream:
        return self._stream

    def __repr__(self):
        state = " closed" if self._closed else f" ptr={self._ptr:#x}"
        return f"<accel.Buffer {self._nbytes} bytes on {self._backend.name}:{self._index}{state}>"

    def _live(self) -> None:
        if self._pid != _fin.pid:
            raise _fin.forked_error(self._backend)
        if self._closed:
            raise RuntimeError(f"{self!r} was closed; allocate a new Buffer")

    def _stream_for(self, stream: Optional[Stream]) -> Stream:
        # As every torch operation: the current stream of the buffer's device by default.
        if stream is None:
            stream = current_stream(self._index)
        else:
            stream = _as_stream(stream, "stream")
        if stream.device_index != self._index:
            raise ValueError(f"stream is on device {stream.device_index} but the buffer is on device "
                             f"{self._index}; pass a stream of device {self._index} or None")
        if stream != self._stream:
            self.record_stream(stream)
        return stream

    # -- copies ------------------------------------------------------------------
    def copy_from(self, src, stream: Optional[Stream] = None, non_blocking: bool = False) -> "Buffer":
        """Copy all of ``src`` (numpy array, Buffer, or bytes-like, exactly ``nbytes``) into this buffer.

        Blocking copies return when the data is on the device.  With
        ``non_blocking=True`` the call returns at once; order later work after
        it with the stream.  A pinned source (an :func:`accel.empty_pinned`
        array or a view of one) is copied from directly, as torch's
        ``copy_(src, non_blocking=True)``: its block is not reused before the
        copy ran, but writing to it meanwhile changes what is copied.  Any other
        host source is first copied into pinned staging memory, so it may be
        reused immediately.
        """
        self._live()
        stream = self._stream_for(stream)
        backend = self._backend
        if isinstance(src, Buffer):
            src._live()
            if src._nbytes != self._nbytes:
                raise ValueError(f"size mismatch: source buffer has {src._nbytes} bytes, destination "
                                 f"{self._nbytes}; nothing was copied")
            if src._backend is not backend:
                raise ValueError("source buffer belongs to another backend")
            if src._stream != stream:
                # Ordering against work on the source's stream is the caller's, as in torch;
                # recording keeps the allocator from reusing the source under this copy.
                src.record_stream(stream)
            barrier = None
            if src._index != self._index:
                # the copy runs on this buffer's device, which reads the other device's memory:
                # mapped (virtual) memory needs explicit access for it (cuMemSetAccess)
                _memory().device_allocator(src._index).add_peer(self._index)
                if self._nbytes and not stream.is_capturing():
                    # torch's two-way barrier between the devices' current streams (ATen
                    # cuda/Copy.cu copy_device_to_device): the copy waits for the work queued
                    # on the source device's current stream, and that stream's later work
                    # waits for the copy.  (In a capture the other stream would join it.)
                    barrier = current_stream(src._index)
                    stream.wait_stream(barrier)
            if self._nbytes:
                with stream._device_scope():
                    backend.memcpy_async(self._ptr, src._ptr, self._nbytes, stream.handle)
            if barrier is not None:
                barrier.wait_stream(stream)
            if not non_blocking:
                stream.synchronize()
            return self
        view = _host_view(src)
        if view.nbytes != self._nbytes:
            raise ValueError(f"size mismatch: source has {view.nbytes} bytes, buffer has {self._nbytes}; "
                             f"nothing was copied")
        if not self._nbytes:
            return self
        _refuse_in_capture(backend, stream)
        if non_blocking:
            host = _memory().host_allocator()
            address = _address(view)
            pinned = host.owns(address, self._nbytes)
            if pinned is not None:
                # torch's pinned-source path: DMA from the caller's block, which the host
                # allocator keeps from reuse until the copy ran (as copy_to into pinned memory)
                with on_device(backend, self._index):
                    backend.memcpy_async(self._ptr, address, self._nbytes, stream.handle)
                    try:
                        host.record_stream(pinned, stream.handle, self._index)
                    except BaseException:
                        _drain(stream)
                        raise
                return self
            from ._hostmem import copy_into
            staging = host.malloc(self._nbytes)
            try:
                copy_into(staging, view)
                # The stream's device current: for the copy on a shared default stream, and
                # because the host allocator's events live on the stream's device.
                with on_device(backend, self._index):
                    backend.memcpy_async(self._ptr, staging, self._nbytes, stream.handle)
                    try:
                        host.record_stream(staging, stream.handle, self._index)
                    except BaseException:
                        _drain(stream)  # the queued copy may still read the staging block
                        raise
            finally:
                host.free(staging)
        else:
            with stream._device_scope():
                backend.memcpy_async(self._ptr, _address(view), self._nbytes, stream.handle)
            stream.synchronize()
        return self

    def copy_to(self, dst, stream: Optional[Stream] = None, non_blocking: bool = False) -> None:
        """Copy the whole buffer into the writable, contiguous host object ``dst``.

        Blocking by default.  With ``non_blocking=True`` and a pinned destination
        (:func:`accel.empty_pinned`) the copy is only queued on the stream and the call
        returns at once: synchronize the stream (or an event recorded after it) before
        reading ``dst``.  A pageable destination is copied blocking, as torch does."""
        self._live()
        stream = self._stream_for(stream)
        try:
            view = memoryview(dst)
        except TypeError:
            raise TypeError(f"cannot copy into {type(dst).__name__}: expected a writable numpy array "
                            f"or bytearray") from None
        _check_plain(dst, view, "into")
        if view.readonly:
            raise ValueError("destination is read-only; nothing was copied")
        if not view.c_contiguous:
            raise ValueError("destination is not C-contiguous; nothing was copied")
        if view.nbytes != self._nbytes:
            raise ValueError(f"size mismatch: destination has {view.nbytes} bytes, buffer has "
                             f"{self._nbytes}; nothing was copied")
        if self._nbytes:
            _refuse_in_capture(self._backend, stream)
            address = _address(view)
            host = _memory().host_allocator() if non_blocking else None
            pinned = host.owns(address, self._nbytes) if host is not None else None
            with stream._device_scope():
                self._backend.memcpy_async(address, self._ptr, self._nbytes, stream.handle)
                if pinned is not None:
                    # the pinned block is not reused (after its array is gone) before the copy ran
                    try:
                        host.record_stream(pinned, stream.handle, self._index)
                    except BaseException:
                        stream.synchronize()
                        raise
            if pinned is None:
                stream.synchronize()

    def to_numpy(self, dtype="uint8", shape=None, stream: Optional[Stream] = None, non_blocking: bool = False):
        """The buffer's bytes as a new numpy array of ``dtype`` (and ``shape``), after queued work.

        With ``non_blocking=True`` returns ``(array, event)`` at once: the array is pinned
        (:func:`accel.empty_pinned`) and holds the bytes once ``event`` (recorded after the
        copy on the stream) completes; torch's ``t.to("cpu", non_blocking=True)`` pattern."""
        import numpy as np
        try:
            dtype = np.dtype(dtype)
        except TypeError as exc:
            raise TypeError(f"to_numpy: {exc}; pass a numpy dtype such as numpy.float32 or 'uint8'") from None
        if dtype.hasobject:
            raise TypeError(f"to_numpy cannot make an array of dtype {dtype}: it would hold Python object "
                            f"references, not data; use a plain dtype such as numpy.float32 or uint8")
        if self._nbytes % dtype.itemsize:
            raise ValueError(f"buffer of {self._nbytes} bytes is not a whole number of {dtype} items")
        count = self._nbytes // dtype.itemsize
        if shape is not None:
            try:
                shape = tuple(operator.index(n) for n in shape) if hasattr(shape, "__iter__") \
                    else (operator.index(shape),)
            except TypeError:
                raise TypeError(f"to_numpy: shape must be an int or a tuple of ints, got {shape!r}") from None
            if any(n < 0 for n in shape) or int(np.prod(shape, dtype=object)) != count:
                raise ValueError(f"to_numpy: shape {shape} does not hold the buffer's {count} {dtype} items "
                                 f"({self._nbytes} bytes); pass a shape whose product is {count}")
        if non_blocking:
            from ._hostmem import empty_pinned
            from .streams import Event
            stream = self._stream_for(stream)
            out = empty_pinned(count, dtype)
            self.copy_to(out, stream, non_blocking=True)
            event = Event()
            event.record(stream)
            return (out.reshape(shape) if shape is not None else out), event
        out = np.empty(count, dtype=dtype)
        self.copy_to(out, stream)
        return out.reshape(shape) if shape is not None else out

    def fill_(self, value: int, stream: Optional[Stream] = None) -> "Buffer":
        """Set every byte to ``value`` (0..255), ordered on ``stream``; returns self."""
        self._live()
        if not isinstance(value, bool) and hasattr(type(value), "__index__"):
            value = operator.index(value)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
            raise ValueError(f"fill_ takes a byte value 0..255, got {value!r}")
        stream = self._stream_for(stream)
        if self._nbytes:
            with stream._device_scope():
                self._backend.memset_async(self._ptr, value, self._nbytes, stream.handle)
        return self

    def record_stream(self, stream: Stream) -> None:
        """Tell the allocator the buffer is used on ``stream``, so its memory is not
        reused before work queued there so far has completed."""
        self._live()
        stream = _as_stream(stream, "Buffer.record_stream(stream)")
        if self._nbytes and stream != self._stream:
            _memory().device_allocator(self._index).record_stream(self._ptr, stream.handle, stream.device_index)

    # -- interop -----------------------------------------------------------------
    def as_array(self, dtype, shape=None, strides=None, offset: int = 0):
        """A typed view (:class:`accel.ArrayView`) of this buffer's memory: ``dtype``, ``shape``
        (default: every whole item after ``offset``), byte ``strides`` (default C order) and a
        byte ``offset``; bounds and alignment are checked.  The view shares the memory and
        keeps the buffer alive."""
        from ._array import ArrayView
        return ArrayView(self, dtype, shape, strides, offset)

    @property
    def __cuda_array_interface__(self) -> dict:
        if self._backend.name != "cuda":
            raise AttributeError("__cuda_array_interface__ is only defined for CUDA buffers")
        self._live()
        # As torch: the current stream of the buffer's device, where its operations are queued.
        handle = current_stream(self._index).handle
        return {"shape": (self._nbytes,), "typestr": "|u1", "data": (self._ptr, False), "strides": None,
                "version": 3, "stream": handle if handle else _CAI_LEGACY_DEFAULT_STREAM}

    # -- lifetime ------------------------------------------------------------------
    def close(self) -> None:
        """Return the memory to the caching allocator.  Idempotent."""
        if self._pid != _fin.pid:
            raise _fin.forked_error(self._backend)
        if self._closed:
            return
        self._closed = True
        if self._nbytes:
            _fin.release(_free, self._index, self._ptr)

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # Never waits on the allocator's lock (see accel._finalize); nothing in a forked child.
        if not getattr(self, "_closed", True) and self._pid == _fin.pid and _lazy.is_initialized():
            self._closed = True
            if self._nbytes:
                _fin.finalize(_free, self._index, self._ptr)


def _free(index: int, ptr: int) -> None:
    _memory().device_allocator(index).free(ptr)
