"""``accel.ArrayView``: a typed, strided view of an :class:`accel.Buffer` (issue 17).

A view names a dtype, a shape, byte strides and a byte offset into a buffer.  It
checks once, when it is made, that every element lies inside the buffer and is
aligned for its dtype, so what it exports (``__cuda_array_interface__``,
``__dlpack__``) never points a consumer outside the allocation.  It owns no memory:
it keeps its buffer alive, and every copy goes through the buffer's streams and
allocator rules (a use on another stream is recorded with ``record_stream``).
"""

from __future__ import annotations

import functools
import operator
from typing import Optional, Tuple

import numpy as np

from ._copying import refuse as _refuse
from .buffer import (Buffer, _Noting, _address, _cai_typestr, _call_pinned, _check_device_range, _host_view,
                     _refuse_in_capture)
from .streams import Stream, _Hold

__all__ = ["ArrayView"]

#: Most separate copy operations one ``copy_from`` queues.  Layouts that share only short
#: contiguous runs would otherwise queue one copy per element.
_MAX_COPIES = 1 << 16
#: Largest byte count of a view's elements (numpy's intp, DLPack's int64).
_INT64_MAX = (1 << 63) - 1


def _int(value, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None


def _ints(value, what: str) -> Tuple[int, ...]:
    """An int or a sequence of ints as a tuple."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{what} must be an int or a tuple of ints, got {value!r}")
    if hasattr(value, "__iter__"):
        return tuple(_int(v, f"{what}[{i}]") for i, v in enumerate(value))
    return (_int(value, what),)


def _dtype(value) -> np.dtype:
    """A fixed-size numpy dtype of plain data, or a clear error."""
    try:
        dt = np.dtype(value)
    except TypeError as exc:
        raise TypeError(f"as_array: {exc}; pass a numpy dtype such as numpy.float32 or 'int64'") from None
    if dt.hasobject:
        raise TypeError(f"as_array: dtype {dt} holds Python object references, not data; "
                        f"use a dtype of plain numbers such as numpy.float32")
    if dt.subdtype is not None:
        raise TypeError(f"as_array: dtype {dt} is a sub-array dtype; use its base dtype "
                        f"{dt.subdtype[0]} and add the dimensions {dt.subdtype[1]} to the shape")
    if dt.itemsize == 0:
        raise TypeError(f"as_array: dtype {dt!r} has no fixed size (itemsize 0); give the size, "
                        f"e.g. 'S8' or 'U4', or use a numeric dtype")
    return dt


def _c_strides(shape, itemsize: int) -> Tuple[int, ...]:
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _is_c_contiguous(shape, strides, itemsize: int) -> bool:
    """numpy's rule: sizes of 1 ignore their stride, and an empty array is contiguous."""
    if 0 in shape:
        return True
    step = itemsize
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1:
            if s != step:
                return False
            step *= n
    return True


def _extent(shape, strides, itemsize: int) -> int:
    """Bytes from the first element to one past the last byte of the farthest element (strides >= 0)."""
    if 0 in shape:
        return 0
    return sum((n - 1) * s for n, s in zip(shape, strides)) + itemsize


def _overlaps(shape, strides, itemsize: int) -> bool:
    """True when two elements share a byte (strides >= 0)."""
    dims = sorted((s, n) for n, s in zip(shape, strides) if n > 1)
    if not dims or 0 in shape:
        return False
    reach = itemsize
    for s, n in dims:                     # nested layout: each stride clears the dims inside it
        if s < reach:
            break
        reach = s * (n - 1) + reach
    else:
        return False
    size = int(np.prod(shape, dtype=object))
    span = _extent(shape, strides, itemsize)
    if size * itemsize > span:            # more element bytes than the span holds
        return True
    offsets = _element_offsets(shape, strides)   # at most span / itemsize of them
    offsets.sort()
    return bool(np.any(np.diff(offsets) < itemsize))


def _element_offsets(shape, strides) -> np.ndarray:
    """Byte offset of every element, C order (int64)."""
    out = np.zeros((), dtype=np.int64)
    for n, s in zip(shape, strides):
        out = (out[..., None] + np.arange(n, dtype=np.int64) * s)
    return out.reshape(-1)


def _runs(shape, dst_strides, src_strides, itemsize: int):
    """(run_bytes, dst_offsets, src_offsets): the copy as runs contiguous on both sides."""
    dims = [(n, d, s) for n, d, s in zip(shape, dst_strides, src_strides) if n != 1]
    run = itemsize
    while dims and dims[-1][1] == run and dims[-1][2] == run:
        run *= dims.pop()[0]
    outer = tuple(n for n, _, _ in dims)
    return run, outer, tuple(d for _, d, _ in dims), tuple(s for _, _, s in dims)


class _Source:
    """What ``copy_from`` copies: a host array (``host``) or device memory (``ptr`` and layout),
    with what keeps it valid, ``after``: what orders the source before the copy once every check
    passed (a foreign producer's stream waited for), and ``user``: the accel Buffer read, whose
    use of the copy's stream is noted once the copy was queued."""

    __slots__ = ("host", "ptr", "shape", "strides", "dtype", "keep", "after", "user")

    def __init__(self, host=None, ptr=0, shape=(), strides=None, dtype=None, keep=None, after=None, user=None):
        self.host, self.ptr, self.shape, self.dtype, self.keep, self.after = host, ptr, shape, dtype, keep, after
        self.user = user
        if host is None:
            self.strides = _c_strides(shape, dtype.itemsize) if strides is None else tuple(strides)

    @property
    def span(self) -> int:
        return _extent(self.shape, self.strides, self.dtype.itemsize)

    def commit(self) -> None:
        if self.after is not None:
            self.after()


def _pinning(method):
    """As ``buffer.buffer_class._in_use``, for an ArrayView method that hands memory to the backend: while it
    runs, the view's buffer (and the buffer of a Buffer or ArrayView argument, a copy's source)
    holds a pin, so a close() in another thread leaves the memory to the call's end instead of
    giving it to the next allocation while the call still copies into or out of it.  The
    method's own ``_live()`` checks come after the pins are taken."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        held = [self._buffer]
        for a in (*args, *kwargs.values()):
            if type(a) is Buffer:
                held.append(a)
            elif type(a) is ArrayView:
                held.append(a._buffer)
        return _call_pinned(held, method, self, args, kwargs)
    return call


class ArrayView:
    """``buffer.as_array(dtype, shape=None, strides=None, offset=0)``: a typed view of device memory.

    ``dtype`` is any fixed-size numpy dtype of plain data.  ``shape`` defaults to as many
    elements as fit after ``offset`` (the remaining bytes must then be a whole number of
    items).  ``strides`` are in bytes, numpy's convention, default C-contiguous; each is a
    multiple of the itemsize and not negative (0 repeats an element: a broadcast view,
    readable but not a ``copy_from`` destination).  Every element must lie inside the
    buffer and ``ptr`` must be aligned for the dtype; otherwise ``ValueError`` names the
    bad value.  The view shares the buffer's memory and keeps the buffer alive; closing
    the buffer ends the view too.

    It exports ``__cuda_array_interface__`` (v3, typed; CUDA only) and
    ``__dlpack__``/``__dlpack_device__``, so CuPy, Numba, torch or JAX can use it without a
    copy, and copies with :meth:`to_numpy` and :meth:`copy_from`.
    """

    __slots__ = ("_buffer", "_dtype", "_shape", "_strides", "_offset", "_contiguous", "__weakref__")

    def __init__(self, buffer: Buffer, dtype, shape=None, strides=None, offset: int = 0):
        if not isinstance(buffer, Buffer):
            raise TypeError(f"ArrayView needs an accel.Buffer, got {type(buffer).__name__}")
        buffer._live()
        dt = _dtype(dtype)
        item = dt.itemsize
        nbytes = buffer.nbytes
        offset = _int(offset, "offset")
        if not 0 <= offset <= nbytes:
            raise ValueError(f"offset {offset} is outside the buffer of {nbytes} bytes; "
                             f"pass 0 <= offset <= {nbytes}")
        if shape is None:
            if strides is not None:
                raise ValueError("as_array: strides given without a shape; pass the shape too")
            rest = nbytes - offset
            if rest % item:
                raise ValueError(f"as_array: the {rest} bytes after offset {offset} are not a whole number of "
                                 f"{dt} items ({item} bytes each); pass a shape")
            shape = (rest // item,)
        else:
            shape = _ints(shape, "shape")
            for i, n in enumerate(shape):
                if n < 0:
                    raise ValueError(f"as_array: shape[{i}] is {n}; sizes must be >= 0 (shape {shape})")
        if strides is None:
            strides = _c_strides(shape, item)
        else:
            strides = _ints(strides, "strides")
            if len(strides) != len(shape):
                raise ValueError(f"as_array: strides {strides} has {len(strides)} entries but shape {shape} "
                                 f"has {len(shape)}; give one byte stride per dimension")
            for i, s in enumerate(strides):
                if s < 0:
                    raise ValueError(f"as_array: strides[{i}] is {s}; negative strides are refused because "
                                     f"the view's pointer must be its lowest address (DLPack consumers such as "
                                     f"torch reject negative strides); view the elements forwards and reverse "
                                     f"on the host, e.g. view.to_numpy()[::-1]")
                if s % item:
                    raise ValueError(f"as_array: strides[{i}] is {s} bytes, not a multiple of the itemsize "
                                     f"{item} of {dt}; strides are in bytes (numpy's convention)")
        for what, values in (("shape", shape), ("strides", strides)):
            for i, v in enumerate(values):
                if v > _INT64_MAX:
                    raise ValueError(f"as_array: {what}[{i}] is {v}, more than 2**63 - 1, the most numpy, DLPack "
                                     f"and the CUDA array interface can describe")
        total = int(np.prod(shape, dtype=object)) * item
        if total > _INT64_MAX:
            # numpy's limit too; DLPack and CAI shapes are int64 (ctypes would wrap them silently)
            raise ValueError(f"as_array: shape {shape} of {dt} holds {total} bytes of elements, more than "
                             f"2**63 - 1, the most numpy and DLPack can describe; use a smaller shape")
        end = offset + _extent(shape, strides, item)
        if end > nbytes:
            raise ValueError(f"as_array: the view of shape {shape}, strides {strides}, offset {offset} reaches "
                             f"byte {end} but the buffer has {nbytes} bytes; make it smaller or use a "
                             f"larger buffer")
        if offset % dt.alignment:
            raise ValueError(f"as_array: offset {offset} is not aligned for {dt} (alignment {dt.alignment} "
                             f"bytes); use an offset that is a multiple of {dt.alignment}")
        ptr = buffer.ptr
        if (ptr + offset) % dt.alignment:
            raise ValueError(f"as_array: address {ptr + offset:#x} (buffer ptr {ptr:#x} + offset {offset}) is "
                             f"not aligned for {dt} (alignment {dt.alignment} bytes)")
        self._buffer, self._dtype, self._shape, self._strides, self._offset = buffer, dt, shape, strides, offset
        self._contiguous = _is_c_contiguous(shape, strides, item)

    # -- layout ------------------------------------------------------------------
    @property
    def buffer(self) -> Buffer:
        """The :class:`accel.Buffer` viewed (kept alive by the view)."""
        return self._buffer

    @property
    def dtype(self) -> np.dtype:
        """The element type (a numpy dtype)."""
        return self._dtype

    @property
    def shape(self) -> Tuple[int, ...]:
        """Elements per dimension."""
        return self._shape

    @property
    def strides(self) -> Tuple[int, ...]:
        """Byte strides, numpy's convention."""
        return self._strides

    @property
    def offset(self) -> int:
        """Byte offset of the first element in the buffer."""
        return self._offset

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self._dtype.itemsize

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self._shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self._shape, dtype=object))

    @property
    def nbytes(self) -> int:
        """Bytes of the elements (``size * itemsize``), as numpy's ``nbytes``."""
        return self.size * self._dtype.itemsize

    @property
    def c_contiguous(self) -> bool:
        """True when the elements are packed in C order (numpy's ``flags.c_contiguous``)."""
        return self._contiguous

    @property
    def device(self):
        """The buffer's device."""
        return self._buffer.device

    @property
    def ptr(self) -> int:
        """Device address of the first element (``buffer.ptr + offset``)."""
        return self._buffer.ptr + self._offset

    def _address(self) -> int:
        """:attr:`ptr` without the open check, for a method holding a pin on the buffer (``_pinning``):
        a close() by another thread since the method's own check leaves the memory to the pin."""
        return self._buffer._ptr + self._offset

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d ArrayView")
        return self._shape[0]

    def __array__(self, dtype=None, copy=None):
        """numpy's implicit conversion is refused with TypeError, as :meth:`Buffer.__array__
        <accel.Buffer.__array__>`: :meth:`to_numpy` copies the view to the host."""
        raise TypeError(f"numpy cannot use {self!r} directly (device memory); copy it to the host with "
                        f".to_numpy()")

    def __repr__(self):
        layout = "" if self._contiguous else f", strides={self._strides}"
        where = f"{self._buffer.device}"
        state = " closed" if self._buffer._closed else ""
        return (f"<accel.ArrayView shape={self._shape} dtype={self._dtype}{layout} offset={self._offset} "
                f"on {where}{state}>")

    # -- interop -----------------------------------------------------------------
    @property
    def __cuda_array_interface__(self) -> dict:
        """CUDA array interface v3, typed.  ``stream`` is the buffer's (its last-use stream),
        so a consumer orders its work after accel's.  Absent (``hasattr`` False) on other
        backends and once the buffer is closed."""
        buffer = self._buffer
        if buffer._backend.name != "cuda":
            raise AttributeError("__cuda_array_interface__ is only defined for CUDA buffers")
        if buffer._closed:
            raise AttributeError("__cuda_array_interface__: the view's buffer was closed")
        base = buffer.__cuda_array_interface__
        # CUDA Array Interface v3, data: "For zero-size arrays, use 0 here."
        ptr = base["data"][0] + self._offset if 0 not in self._shape else 0
        cai = {"shape": self._shape, "typestr": self._dtype.str,
               "data": (ptr, _readonly(buffer)),
               "strides": None if self._contiguous else self._strides, "version": 3, "stream": base["stream"]}
        if self._dtype.fields is not None:
            cai["descr"] = self._dtype.descr
        return cai

    def __dlpack_device__(self) -> Tuple[int, int]:
        """``(device_type, device_id)``: kDLCUDA (2), kDLOneAPI (14) or kDLMetal (8) and the index."""
        from . import _dlpack
        return _dlpack.device_of(self._buffer._backend.name, self._buffer.device_index)

    @_pinning
    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule of the view (zero copy): its dtype, shape and element strides, the data
        pointer at the first element (``byte_offset`` 0; on MPS the data is the ``id<MTLBuffer>``
        and ``byte_offset`` the view's offset into it, as torch's MPS tensors read).  The arguments and the stream
        handshake are :meth:`accel.Buffer.__dlpack__`'s: the consumer's ``stream`` waits for the
        buffer's last-use stream; ``max_version >= (1, 0)`` gives a versioned capsule; a copy
        (``copy=True``, or a host ``dl_device``) holds the view's elements in C order.  The
        capsule keeps the view (and so the buffer) alive until the consumer's deleter runs."""
        from . import _dlpack
        buffer = self._buffer
        buffer._live()
        versioned = _dlpack.check_max_version(max_version)
        own = self.__dlpack_device__()
        copying = _dlpack.check_dl_device(dl_device, own, copy)
        if copying is not None:
            _dlpack.dl_dtype(self._dtype)    # a dtype DLPack cannot describe fails before the copy
            return _dlpack.export_copy(copying, self, buffer, stream, versioned)
        _dlpack.check_legacy_read_only(versioned, _readonly(buffer))
        _dlpack.dl_dtype(self._dtype)        # a dtype DLPack cannot describe fails before any sync
        _dlpack.sync_for_consumer(buffer, stream)
        item = self._dtype.itemsize
        strides = None if self._contiguous else tuple(s // item for s in self._strides)
        return _dlpack.export(self, self._address(), own[0], own[1], self._dtype, self._shape, strides, 0,
                              versioned=versioned, readonly=_readonly(buffer), held=True)

    # -- streams -----------------------------------------------------------------
    def record_stream(self, stream: Stream) -> None:
        """torch's ``Tensor.record_stream`` on a view: :meth:`Buffer.record_stream` of the viewed
        buffer.  The allocator tracks the whole block, so a view starting inside it (an
        ``offset``) protects all of it from reuse until work queued on ``stream`` so far has
        completed (torch issue #27366)."""
        self._buffer.record_stream(stream)

    # -- copies ------------------------------------------------------------------
    def __copy__(self) -> "ArrayView":
        """``copy.copy(view)``: another view of the same memory."""
        return self._buffer.as_array(self._dtype, self._shape, self._strides, self._offset)

    def __deepcopy__(self, memo) -> "ArrayView":
        """``copy.deepcopy(view)``: the same view of a device copy of its Buffer (Buffer.__deepcopy__)."""
        import copy
        return copy.deepcopy(self._buffer, memo).as_array(self._dtype, self._shape, self._strides, self._offset)

    def __reduce_ex__(self, protocol):
        raise _refuse(self, "pickle", "pickle its values instead (view.to_numpy()) and copy them into a "
                                      "new Buffer's view on the other side")

    @_pinning
    def to_numpy(self, stream: Optional[Stream] = None):
        """The viewed elements as a new numpy array of the view's shape and dtype, after queued work.

        Ordered on ``stream`` (default: the current stream of the buffer's device) and
        blocking.  A strided view is fetched as the one byte range its elements span and
        gathered on the host."""
        buffer = self._buffer
        buffer._live()
        stream = buffer._check_stream(stream)
        with _Hold(stream):     # the copy's calls on the stream, to its end, use the one it began on
            if self.size:
                _refuse_in_capture(buffer._backend, stream)
            # the use is noted once the copy was queued: a refused one changes nothing
            with _Noting(stream, buffer) as noting:
                if self._contiguous or not self.size:
                    out = np.empty(self._shape, dtype=self._dtype)
                    if out.size:
                        _download(buffer, self._address(), out, stream, noting)
                    return out
                span = np.empty(_extent(self._shape, self._strides, self.itemsize), dtype=np.uint8)
                _download(buffer, self._address(), span, stream, noting)
        return _gather(span, self._shape, self._strides, self._dtype)

    @_pinning
    def copy_from(self, src, stream: Optional[Stream] = None) -> "ArrayView":
        """Copy ``src`` into the viewed elements; blocking; returns self.

        ``src`` is a numpy array of the same shape and dtype, another ArrayView, or any
        object exporting ``__cuda_array_interface__`` or ``__dlpack__`` with the same shape
        and dtype on the same device (host DLPack producers are copied as host arrays);
        an accel.Buffer or a bytes-like object is taken as raw bytes, exactly ``nbytes``.
        Strided sources and destinations are copied run by run; a destination whose
        elements overlap (a 0 stride), or a source overlapping the destination in device
        memory, is refused.  Ordered on ``stream`` (default: the current stream of the
        buffer's device)."""
        buffer = self._buffer
        buffer._live()
        if _readonly(buffer):
            raise ValueError(f"copy_from: {buffer!r} is read-only (a read-only DLPack import); "
                             f"nothing was copied")
        if self._contiguous is False and _overlaps(self._shape, self._strides, self.itemsize):
            raise ValueError(f"copy_from: the destination's elements overlap (shape {self._shape}, strides "
                             f"{self._strides}: a 0 or too small stride), so it cannot be written; "
                             f"copy into a view without repeated elements")
        stream = buffer._check_stream(stream)
        # the copy's calls on the stream, to its end, use the one it began on
        with _Hold(stream), _source(self, src, stream) as source:
            run = self._plan(source, stream)     # every check before anything is queued or noted
            source.commit()
            # the uses are noted once the copy was queued: a refused one changes nothing
            users = (buffer,) if source.user is None else (buffer, source.user)
            with _Noting(stream, *users) as noting:
                run(noting)
        return self

    # -- internals ---------------------------------------------------------------
    def _check_match(self, shape, dtype, what: str) -> None:
        if tuple(shape) != self._shape:
            raise ValueError(f"copy_from: {what} has shape {tuple(shape)}, the view {self._shape}; "
                             f"nothing was copied")
        if dtype != self._dtype:
            raise TypeError(f"copy_from: {what} has dtype {dtype}, the view {self._dtype}; convert it first "
                            f"(e.g. numpy's a.astype({str(self._dtype)!r})); nothing was copied")

    def _plan(self, source, stream: Stream):
        """The copy from ``source`` as a function to call, after every check passed."""
        if not self.size:
            return lambda noting: None
        backend = self._buffer._backend
        if source.host is not None:
            _refuse_in_capture(backend, stream)
            array = np.ascontiguousarray(source.host)
            run, outer, dst_s, src_s = _runs(self._shape, self._strides, array.strides, self.itemsize)
            _check_count(outer, run)
            return lambda noting: self._upload(array, run, outer, dst_s, src_s, stream, noting)
        dst_lo, src_lo = self._address(), source.ptr
        dst_hi = dst_lo + _extent(self._shape, self._strides, self.itemsize)
        src_hi = src_lo + source.span
        if dst_lo < src_hi and src_lo < dst_hi:
            raise ValueError(f"copy_from: the source (bytes {src_lo:#x}..{src_hi:#x}) overlaps the destination "
                             f"(bytes {dst_lo:#x}..{dst_hi:#x}) in device memory; copy through the host "
                             f"(view.copy_from(src.to_numpy())) or through a separate buffer")
        run, outer, dst_s, src_s = _runs(self._shape, self._strides, source.strides, self.itemsize)
        if _count(outer) <= _MAX_COPIES:
            return lambda noting: self._copy_runs(source, run, outer, dst_s, src_s, stream, noting)
        # layouts that share only short runs: gather the source on the host, then upload
        _refuse_in_capture(backend, stream)
        c_strides = _c_strides(self._shape, self.itemsize)
        up = _runs(self._shape, self._strides, c_strides, self.itemsize)
        _check_count(up[1], up[0])

        def staged(noting):
            host = np.empty(source.span, dtype=np.uint8)
            _download(self._buffer, source.ptr, host, stream, noting)
            self._upload(_gather(host, source.shape, source.strides, source.dtype), *up, stream, noting)
        return staged

    def _upload(self, array: np.ndarray, run, outer, dst_s, src_s, stream: Stream, noting: _Noting) -> None:
        """Queue the runs from the C-contiguous host ``array``; blocking.  ``noting.queued`` once
        one was queued."""
        src = _host_address(array)
        backend, dst = self._buffer._backend, self._address()
        try:
            with stream._device_scope():
                for d, s in _pairs(outer, dst_s, src_s):
                    backend.memcpy_async(dst + d, src + s, run, stream.handle)
                    noting.queued = True
        finally:
            stream.synchronize()     # the host array must outlive the queued copies

    def _copy_runs(self, source: "_Source", run, outer, dst_s, src_s, stream: Stream, noting: _Noting) -> None:
        backend, dst = self._buffer._backend, self._address()
        with stream._device_scope():
            for d, s in _pairs(outer, dst_s, src_s):
                backend.memcpy_async(dst + d, source.ptr + s, run, stream.handle)
                noting.queued = True
        if not stream.is_capturing():
            stream.synchronize()     # blocking, and a DLPack source's memory is handed back after


def _gather(span: np.ndarray, shape, strides, dtype) -> np.ndarray:
    """The elements of a strided layout over host bytes ``span``, as a new C-contiguous array."""
    raw = np.lib.stride_tricks.as_strided(span, shape=tuple(shape) + (dtype.itemsize,),
                                          strides=tuple(strides) + (1,), writeable=False)
    return np.ascontiguousarray(raw).view(dtype).reshape(shape)


def _pairs(outer, dst_strides, src_strides):
    """(dst_offset, src_offset) of every run, C order."""
    if not outer:
        return [(0, 0)]
    return zip(_element_offsets(outer, dst_strides).tolist(), _element_offsets(outer, src_strides).tolist())


def _count(outer) -> int:
    return int(np.prod(outer, dtype=object))


def _check_count(outer, run: int) -> None:
    count = _count(outer)
    if count > _MAX_COPIES:
        raise ValueError(f"copy_from: the layouts share only runs of {run} bytes, which would take {count} "
                         f"separate copies (at most {_MAX_COPIES}); copy into a C-contiguous view, or through "
                         f"the host; nothing was copied")


def _host_address(array: np.ndarray) -> int:
    """Address of a C-contiguous host array of any plain dtype (datetime64 too, which the
    buffer protocol refuses), kept alive by the caller."""
    return _address(memoryview(array.reshape(-1).view(np.uint8)))


def _download(buffer: Buffer, ptr: int, out: np.ndarray, stream: Stream, noting: Optional[_Noting] = None) -> None:
    """Copy ``out.nbytes`` device bytes at ``ptr`` into the contiguous host array ``out``; blocking.
    ``noting.queued`` (where given) once the copy was queued."""
    _refuse_in_capture(buffer._backend, stream)
    with stream._device_scope():
        buffer._backend.memcpy_async(_host_address(out), ptr, out.nbytes, stream.handle)
        if noting is not None:
            noting.queued = True
    stream.synchronize()


class _source:
    """``with _source(view, src, stream) as s``: ``src`` as a :class:`_Source`, checked against
    the view, ordered before ``stream`` once committed, and kept valid for the block (a DLPack
    capsule's deleter runs at its end)."""

    def __init__(self, view: ArrayView, src, stream: Stream):
        self.view, self.src, self.stream, self.release = view, src, stream, None

    def __enter__(self):
        view, src = self.view, self.src
        buffer = view._buffer
        if isinstance(src, np.ndarray):
            if src.dtype.hasobject:
                raise TypeError(f"copy_from: the source has dtype {src.dtype}: it holds Python object "
                                f"references, not data; nothing was copied")
            view._check_match(src.shape, src.dtype, "the source array")
            return _Source(host=src)
        if isinstance(src, ArrayView):
            src._buffer._live()
            _same_device(buffer, src._buffer._backend.name, src._buffer.device_index, "source view")
            view._check_match(src.shape, src.dtype, "the source view")
            return _Source(None, src._address(), src.shape, src.strides, src.dtype, src, user=src._buffer)
        if isinstance(src, Buffer):
            src._live()
            _same_device(buffer, src._backend.name, src.device_index, "source buffer")
            if src.nbytes != view.nbytes:
                raise ValueError(f"copy_from: the source buffer has {src.nbytes} bytes, the view {view.nbytes} "
                                 f"({view.shape} of {view.dtype}); nothing was copied")
            return _Source(None, src._ptr, view.shape, None, view.dtype, src, user=src)
        cai = _cai_of(src)
        if cai is not None:
            return self._from_cai(cai)
        if hasattr(src, "__dlpack__"):
            return self._from_dlpack(src)
        try:
            raw = _host_view(src)
        except TypeError:
            raise TypeError(f"copy_from: cannot copy from {type(src).__name__}: expected a numpy array, an "
                            f"ArrayView or Buffer, an object with __cuda_array_interface__ or __dlpack__, or "
                            f"a bytes-like object (for a list, pass numpy.asarray(x, dtype={str(view.dtype)!r}))"
                            ) from None
        if raw.nbytes != view.nbytes:
            raise ValueError(f"copy_from: the source has {raw.nbytes} bytes, the view {view.nbytes} "
                             f"({view.shape} of {view.dtype}); nothing was copied")
        return _Source(host=np.frombuffer(raw, dtype=view.dtype).reshape(view.shape))

    def _from_cai(self, cai: dict) -> _Source:
        view, stream = self.view, self.stream
        buffer = view._buffer
        if buffer._backend.name != "cuda":
            raise ValueError(f"copy_from: a __cuda_array_interface__ source is CUDA memory, the view is on "
                             f"{buffer.device}; nothing was copied")
        if not isinstance(cai, dict):
            raise ValueError(f"copy_from: malformed __cuda_array_interface__ (a {type(cai).__name__}, not a dict); "
                             f"nothing was copied")
        if cai.get("mask") is not None:
            raise ValueError("copy_from: masked __cuda_array_interface__ arrays are not supported; "
                             "nothing was copied")
        try:
            shape = tuple(operator.index(n) for n in cai["shape"])
            dtype = _cai_dtype(cai)
            ptr = operator.index(cai["data"][0])
            strides = cai.get("strides")
            strides = None if strides is None else tuple(operator.index(s) for s in strides)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ValueError(f"copy_from: malformed __cuda_array_interface__ ({exc!r}); nothing was copied") \
                from None
        if strides is not None and len(strides) != len(shape):
            raise ValueError(f"copy_from: malformed __cuda_array_interface__: strides {strides} for shape {shape} "
                             f"(one stride per dimension, as numpy requires); nothing was copied")
        view._check_match(shape, dtype, "the __cuda_array_interface__ source")
        if strides is not None and any(s < 0 for s in strides):
            raise ValueError(f"copy_from: the source has negative strides {strides}; nothing was copied")
        foreign = cai.get("stream")
        if foreign is not None:
            _check_cai_stream(foreign)
        source = _Source(None, ptr, shape, strides, dtype, self.src,
                         after=None if foreign is None else lambda: _wait_foreign(buffer._backend, stream, foreign))
        if source.span:
            # as an ArrayView, Buffer or DLPack source: one device.  A copy queued on the view's
            # device reading another device's memory faults it where that memory was not made
            # accessible to it (cudaErrorIllegalAddress, sticky); Buffer.copy_from copies across.
            where = buffer._backend.pointer_location(ptr)
            if where is not None and where[0] == "device":
                _same_device(buffer, buffer._backend.name, where[1], "__cuda_array_interface__ source")
        _check_foreign_range(buffer, ptr, source.span)
        return source

    def _from_dlpack(self, src):
        from . import _dlpack
        view, stream = self.view, self.stream
        buffer = view._buffer
        # a pair of ints, as accel.from_dlpack reads it; the producer's own errors propagate (array
        # API from_dlpack: "must propagate such exceptions") (r80b)
        kind, index = _dlpack._device_pair(src)
        if kind in _dlpack.HOST_DEVICE_TYPES:
            # host memory is copied from as a host array, never wrapped as device memory
            from .buffer import _numpy_from_dlpack      # (a dtype numpy lacks: a clear TypeError, r71o)
            return self._host_from(_numpy_from_dlpack(src))
        mine = tuple(view.__dlpack_device__())
        if (kind, index) != mine:
            raise ValueError(f"copy_from: the DLPack source is on device ({kind}, {index}), the view on "
                             f"{mine} ({buffer.device}); copy on the same device; nothing was copied")
        # the producer orders its pending work before ``stream`` (CUDA: its handle; elsewhere the
        # producer waits on the host)
        capsule = _dlpack._ask(src, buffer._backend, (kind, index), stream if buffer._backend.name == "cuda"
                               else None)
        info = _dlpack.parse(capsule)
        if (info.device_type, info.device_id) != mine:
            raise ValueError(f"copy_from: the DLPack capsule describes device ({info.device_type}, "
                             f"{info.device_id}), the view is on {mine}; nothing was copied")
        _dlpack.to_address(buffer._backend, info)
        dtype = _np_dtype(info)
        item = dtype.itemsize
        strides = None if info.strides is None else tuple(s * item for s in info.strides)
        if strides is not None and any(s < 0 for s in strides):
            raise ValueError(f"copy_from: the DLPack source has negative strides {info.strides}; "
                             f"nothing was copied")
        view._check_match(info.shape, dtype, "the DLPack source")
        source = _Source(None, info.data + info.byte_offset, info.shape, strides, dtype)
        # before the capsule is taken: a refused one is freed by its producer's destructor
        if source.span:
            # memory of another device under this device's id (as for __cuda_array_interface__):
            # the copy queued here would fault on it (r71o)
            where = buffer._backend.pointer_location(source.ptr)
            if where is not None and where[0] == "device":
                _same_device(buffer, buffer._backend.name, where[1], "DLPack source's memory")
        _check_foreign_range(buffer, source.ptr, source.span)
        imported = _dlpack.Imported(capsule, info.address, info.versioned, keep=src)
        self.release = imported.release
        source.keep = imported
        return source

    def _host_from(self, array: np.ndarray) -> np.ndarray:
        self.view._check_match(array.shape, array.dtype, "the host DLPack source")
        return _Source(host=array)

    def __exit__(self, *exc) -> None:
        if self.release is not None:
            self.release()


#: dlpack.h DLDataTypeCode -> numpy kind (lanes 1)
_DL_KINDS = {0: "i", 1: "u", 2: "f", 5: "c"}


def _np_dtype(info) -> np.dtype:
    """The numpy dtype of a parsed DLPack tensor, or a clear error."""
    if info.lanes == 1 and info.code == 6 and info.bits == 8:
        return np.dtype(np.bool_)
    kind = _DL_KINDS.get(info.code)
    if info.lanes != 1 or kind is None or info.bits % 8:
        raise TypeError(f"copy_from: the DLPack source has dtype code {info.code}, {info.bits} bits, "
                        f"{info.lanes} lanes, which accel's views do not read; nothing was copied")
    if (kind == "f" and info.bits > 64) or (kind == "c" and info.bits > 128):
        # dlpack.h: kDLFloat is "IEEE floating point"; numpy's 16-byte float is x87 extended
        # precision padded, not binary128: the bytes would be read as other numbers
        raise TypeError(f"copy_from: the DLPack source holds {info.bits}-bit IEEE floats, which numpy has "
                        f"no dtype for (its long double is x87 extended precision); nothing was copied")
    try:
        return np.dtype(f"{kind}{info.bits // 8}")
    except TypeError:
        raise TypeError(f"copy_from: numpy has no {info.bits}-bit dtype of kind {kind!r}") from None


def _check_foreign_range(buffer: Buffer, ptr: int, span: int) -> None:
    """Refuse a foreign source (``__cuda_array_interface__``, DLPack) whose bytes are not device
    memory of one device, where the runtime can tell, as Buffer.copy_from does: a copy from a
    host or bogus address would read whatever lies there (or crash the process)."""
    if not span:
        return
    backend = buffer._backend
    where = backend.pointer_location(ptr)
    index = where[1] if where is not None and where[0] == "device" else buffer.device_index
    _check_device_range(backend, ptr, span, index)


def _same_device(buffer: Buffer, backend: str, index: int, what: str) -> None:
    if backend != buffer._backend.name or index != buffer.device_index:
        raise ValueError(f"copy_from: the {what} is on {backend}:{index}, the view on {buffer.device}; "
                         f"copy between devices with Buffer.copy_from, or through the host; nothing was copied")


def _readonly(buffer: Buffer) -> bool:
    return bool(getattr(buffer, "_readonly", False))


def _cai_of(obj) -> Optional[dict]:
    try:
        return obj.__cuda_array_interface__
    except AttributeError:
        return None


def _cai_dtype(cai: dict) -> np.dtype:
    """The element type of a CUDA array interface: ``typestr``, or ``descr`` for a structured
    void type.  ``descr`` "follows the same specification as in the NumPy array interface", whose
    default is ``[('', typestr)]``: that names the plain type, not a structure with one field
    (numpy and CuPy always send it)."""
    typestr, descr = _cai_typestr(cai), cai.get("descr")
    if not typestr.lstrip("<>|=").startswith("V") or not descr:
        return np.dtype(typestr)
    if len(descr) == 1 and len(descr[0]) == 2 and descr[0][0] == "" and np.dtype(descr[0][1]) == np.dtype(typestr):
        return np.dtype(typestr)
    # numpy's own reading of an interface descr: unnamed void entries are padding, not fields
    # (r72g: np.dtype(descr) made an aligned structure's padding a field "f1")
    from numpy.lib.format import descr_to_dtype
    return descr_to_dtype(descr)


def _check_cai_stream(foreign) -> None:
    if isinstance(foreign, bool) or not hasattr(type(foreign), "__index__") or operator.index(foreign) <= 0:
        raise ValueError(f"copy_from: __cuda_array_interface__ stream {foreign!r} is invalid (v3: None, 1, 2 "
                         f"or a stream handle; 0 is disallowed); nothing was copied")
    from .streams import check_handle_bits
    check_handle_bits(operator.index(foreign), "copy_from: __cuda_array_interface__ stream")


def _wait_foreign(backend, stream: Stream, foreign) -> None:
    """Order ``stream`` after the work queued on a producer's stream (CAI v3: the consumer
    synchronizes on ``stream`` before reading)."""
    from ._dlpack import wait_for_producer
    wait_for_producer(backend, stream.device_index, foreign, stream)
