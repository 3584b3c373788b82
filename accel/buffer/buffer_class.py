"""The :class:`Buffer` class: construction, properties, copies, fills, uses and
``record_stream``, interop exports (``as_array``, ``__cuda_array_interface__``, DLPack), the
copy and pickle refusals, and close/``__del__``.

Owned memory comes from the device's caching allocator (``accel.memory``, imported on the first
Buffer: :func:`_memory`, whose table of allocators ``Buffer.__init__`` reads directly) and goes
back to it by :mod:`.release`.  The methods that hand the memory to the backend run with a pin
on each Buffer they touch (:func:`_in_use`, :mod:`.pins`).  What a copy's source is comes from
:mod:`.sources`, and its rules under a stream capture from :mod:`.capture`.
"""

from __future__ import annotations

import functools
import operator
import sys
from typing import Optional
from weakref import ref as _weakref

from .. import _finalize as _fin
from .. import _lazy, _locks
from .._copying import refuse as _refuse
from .._device import DeviceLike, device
from ..streams import (Stream, _ExportMark, _Hold, _as_stream, _claim_close, _closed_during_use, _index_for,
                       current_stream, on_device)
from .capture import _capture_hold
from .pins import _begin_use, _call_pinned, _drain, _end_use, _Noting, _Pin, _released
from .release import _free, _free_from_finalizer, _release_foreign_uses
from .sources import (_address, _check_device_range, _check_plain, _device_source, _dlpack_host, _host_view,
                      _is_host_object, _memoryview, _numpy_from_dlpack, _order_producer_after, _own_region,
                      _parse_cai)


_CAI_LEGACY_DEFAULT_STREAM = 1  # __cuda_array_interface__ v3: 0 is disallowed, 1 means the legacy stream


#: accel.memory's table of device allocators (index -> allocator) once _memory() imported it:
#: Buffer reads it directly (an allocator, once made, serves its device until a runtime reset).
_allocators: dict = {}
_memory_module = None


def _memory():
    """accel.memory, imported on first buffer use so `import accel` stays small."""
    global _memory_module, _allocators
    memory = _memory_module
    if memory is None:
        from .. import memory
        _allocators, _memory_module = memory._allocators, memory
    return memory



def _in_use(method):
    """Wrap a Buffer method that hands the memory to the backend (a copy, a fill, a stream use):
    while it runs, the buffer (and a Buffer argument, a copy's source) holds a pin, so a close()
    in another thread leaves the memory to the call's end (as to a DLPack export's deleter,
    :class:`_Pin`) instead of giving it back to the allocator, which would hand it to the next
    allocation while the call still queues work on it.  The method's own ``_live()`` check comes
    after the pin is taken, so a close that came first makes it raise."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        values = (*args, *kwargs.values()) if kwargs else args
        if Buffer in map(type, values):     # a Buffer argument (a copy's source): pinned too
            return _call_pinned([self, *(b for b in values if type(b) is Buffer)], method, self, args, kwargs)
        # Only self to pin (a fill, a copy from host memory): no lists built, a hot path
        key = _begin_use(self)
        try:
            return method(self, *args, **kwargs)
        finally:
            _end_use(self, key)
    return call


def _size(value, what: str) -> int:
    """An ``__index__`` integer (int, numpy integer) as an int; bool and floats are refused."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None


def _byte(value) -> int:
    """fill_'s value: an ``__index__`` integer 0..255 as an int; bool and the rest are refused."""
    if not isinstance(value, bool) and hasattr(type(value), "__index__"):
        value = operator.index(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
        raise ValueError(f"fill_ takes a byte value 0..255, got {value!r}")
    return value


#: Held to make a Buffer's table of export marks (``Buffer._export``).
_export_lock = _locks.Lock("making a Buffer's table of CUDA array interface exports")


class Buffer:
    """``Buffer(nbytes, device=None, stream=None)``: ``nbytes`` of device memory.

    ``stream`` (default: the device's current stream) is the stream the memory
    is allocated for.  Copies and fills run on the ``stream`` they are given,
    by default the *current* stream of the buffer's device (as torch), so they
    are ordered with RNG fills and graph replays; a use on a stream other than
    the allocation stream is recorded with the allocator (``record_stream``),
    which keeps the memory from reuse until that work has run.  ``ptr`` is the device
    address; on CUDA the buffer exports ``__cuda_array_interface__`` (v3), and on every
    backend DLPack (``__dlpack__``/``__dlpack_device__``), so CuPy, Numba, JAX or PyTorch can
    use it without a copy.

    The buffer remembers its *last-use stream*: the stream of its last copy, fill, random
    fill, ``record_stream`` or DLPack export (the allocation stream before any).  Interop
    exports name it, so a consumer orders its work after accel's.

    :meth:`from_ptr` and :func:`accel.from_dlpack` make non-owning buffers over memory that
    another library allocated; accel never frees it.
    """

    __slots__ = ("_backend", "_index", "_ptr", "_nbytes", "_stream", "_closed", "_pid", "_last", "_owner",
                 "_uses", "_readonly", "_pins", "_deferred", "_alloc", "_recorded", "_export",
                 "_drained", "__weakref__")

    def __init__(self, nbytes: int, device: DeviceLike = None, stream: Optional[Stream] = None):
        # Hot path (a Buffer per tensor): each check once, no helper call the common case skips.
        if type(nbytes) is not int:
            nbytes = _size(nbytes, "nbytes")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        backend = _lazy.ready or _lazy.lazy_init()
        if stream is not None:
            stream = _as_stream(stream, "Buffer(stream)")
            index = stream.device_index if device is None else _index_for(device)
            if index != stream.device_index:
                raise ValueError(f"stream is on device {stream.device_index} but the buffer was asked "
                                 f"for device {index}")
        else:
            if type(device) is int and device == -1:
                _index_for(device)      # refused: only current_stream takes -1 as the current device (c10)
            stream = current_stream(device)     # checks ``device`` (None: the current device)
            index = stream._index
        self._backend, self._index, self._nbytes, self._stream = backend, index, nbytes, stream
        self._last, self._owner, self._uses, self._readonly = stream, None, None, False
        self._pins, self._deferred, self._recorded, self._export, self._drained = set(), [], False, None, None
        self._closed = True
        self._pid = pid = _fin.pid
        if nbytes:
            alloc = _allocators.get(index)
            if alloc is None:
                alloc = _memory().device_allocator(index)
            busy = stream._busy     # streams._Use(stream), inlined: a close() in another thread
            try:                    # leaves the destroy to this call's end (the allocator keys by handle)
                busy.append(None)   # (inside: a Ctrl-C as it returns is undone by the finally)
                # stream.handle's checks, read inline: it refuses a stream closed (by another thread,
                # while still its current stream) or made by the parent of this forked process
                handle = stream._handle if stream._pid == pid and not stream._closed else stream.handle
                # the allocator keeps a weak reference to this buffer with the block: a Ctrl-C as
                # malloc returns (the pointer never stored) or as __del__ starts cannot leak it
                self._ptr = alloc.malloc(nbytes, handle, _weakref(self))
            finally:
                busy.pop()
                if stream._closed:
                    _closed_during_use(stream)
        else:
            alloc, self._ptr = None, 0
        self._alloc = alloc     # the allocator close() gives the memory back to
        self._closed = False

    # -- identity ----------------------------------------------------------------
    @property
    def ptr(self) -> int:
        """The device address of the first byte (RuntimeError once closed)."""
        self._live()
        return self._ptr

    @property
    def nbytes(self) -> int:
        """The size in bytes, as asked for."""
        return self._nbytes

    def __len__(self) -> int:
        return self._nbytes

    def __array__(self, dtype=None, copy=None):
        """numpy's implicit conversion (``np.asarray(buf)``, ``np.testing`` comparisons) is
        refused with TypeError: device memory reaches the host only by a copy,
        :meth:`to_numpy` (numpy otherwise wraps the Buffer in a 0-d object array, and a
        comparison with it is silently False; torch and CuPy refuse the same way)."""
        raise TypeError(f"numpy cannot use {self!r} directly (device memory); copy it to the host with "
                        f".to_numpy(dtype, shape)")

    @property
    def device(self) -> device:
        """The device the memory is on."""
        return device(self._backend.name, self._index)

    @property
    def device_index(self) -> int:
        """The index of :attr:`device`."""
        return self._index

    @property
    def stream(self) -> Stream:
        """The stream the memory was allocated for (wrapped for a non-owning buffer)."""
        return self._stream

    @property
    def last_stream(self) -> Stream:
        """The stream of the buffer's last operation (copy, fill, random fill, kernel launch,
        record_stream, DLPack export to an accel stream, the replay of a graph whose capture used
        the buffer); the allocation stream before any."""
        return self._last

    @property
    def readonly(self) -> bool:
        """True for a non-owning buffer over memory its producer marked read-only (a DLPack
        tensor with DLPACK_FLAG_BITMASK_READ_ONLY): copy_from and fill_ refuse to write it."""
        return self._readonly

    @property
    def owns_memory(self) -> bool:
        """False for a buffer made by :meth:`from_ptr` or :func:`accel.from_dlpack`."""
        return self._uses is None

    @classmethod
    def from_ptr(cls, ptr: int, nbytes: int, device: DeviceLike = None, owner=None) -> "Buffer":
        """A non-owning Buffer over ``nbytes`` of device memory at ``ptr`` that another library
        allocated (torch's ``data_ptr()``, CuPy's ``data.ptr``, a cudaMalloc'd address).

        accel never frees the memory: :meth:`close` (or collection) only drops ``owner``, the
        object that keeps the memory alive (e.g. the torch tensor), after waiting for the
        accel work queued on the buffer.  Keep ``owner`` (or the memory) alive yourself when
        you pass None.  ``ptr`` and ``nbytes`` are ints > 0.  ``device`` (default: the current
        device) is the device whose memory it is; where the runtime can tell (CUDA and the
        simulators: ``cudaPointerGetAttributes``), both ends of the range must be device memory
        of that device, else ValueError says what the memory is.

        The buffer works with copy_from, copy_to, fill_, to_numpy, random fills and DLPack /
        ``__cuda_array_interface__`` export.  ``record_stream(s)`` on it does not reach the
        allocator (the memory is not accel's to reuse): the buffer notes the streams it was
        used on, and releasing it (``close()``, or collection) first waits for the work queued
        on them, so the owner never frees memory accel's queued work still touches.
        """
        ptr = _size(ptr, "ptr")
        nbytes = _size(nbytes, "nbytes")
        if ptr <= 0:
            raise ValueError(f"ptr must be a device address > 0, got {ptr:#x}; nothing was wrapped")
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}; nothing was wrapped")
        _lazy.lazy_init()
        return cls._wrap_foreign(ptr, nbytes, _index_for(device), owner)

    @classmethod
    def _wrap_foreign(cls, ptr: int, nbytes: int, index: int, owner, readonly: bool = False) -> "Buffer":
        """A non-owning buffer (from_ptr, from_dlpack): the range is checked where the backend
        can tell what memory it is."""
        backend = _lazy.lazy_init()
        if nbytes:
            _check_device_range(backend, ptr, nbytes, index)
        stream = current_stream(index)
        self = object.__new__(cls)
        self._backend, self._index, self._ptr, self._nbytes, self._stream = backend, index, ptr, nbytes, stream
        self._last, self._owner, self._uses, self._readonly = stream, owner, {}, bool(readonly)
        self._pins, self._deferred, self._alloc, self._recorded, self._export = set(), [], None, False, None
        self._drained = None    # closed streams already waited for (_dlpack.order_after_other_uses)
        self._pid = _fin.pid
        self._closed = False
        return self

    def __repr__(self):
        state = " closed" if self._closed else f" ptr={self._ptr:#x}"
        return f"<accel.Buffer {self._nbytes} bytes on {self._backend.name}:{self._index}{state}>"

    def _live(self) -> None:
        if self._pid != _fin.pid:
            raise _fin.forked_error(self._backend)
        if self._closed:
            raise RuntimeError(f"{self!r} was closed; allocate a new Buffer")

    def _used(self, stream: Stream) -> None:
        """Note a use on ``stream``: it becomes the last-use stream; a non-owning buffer also
        remembers it, to wait for its work before the memory goes back to its owner."""
        self._last = stream
        uses = self._uses
        if uses is not None:
            key = (stream._index, stream._handle)
            noted = uses.get(key)
            if noted is None:
                uses[key] = stream
            elif noted is not stream and noted._closed:
                # a new stream given a closed one's handle (the driver reuses them): both are
                # waited for, the closed one by its device's synchronize, one kept per device (r73d)
                uses[("closed", stream._index)] = noted
                uses[key] = stream

    def _writable(self) -> None:
        if self._readonly:
            raise ValueError(f"{self!r} is read-only (its producer exported it with the DLPack read-only "
                             f"flag); nothing was written")

    def _note(self, stream: Stream) -> None:
        if stream != self._stream:
            self.record_stream(stream)
        else:
            self._used(stream)

    def _check_stream(self, stream: Optional[Stream]) -> Stream:
        # As every torch operation: the current stream of the buffer's device by default.
        if stream is None:
            stream = current_stream(self._index)
        else:
            stream = _as_stream(stream, "stream")
        if stream.device_index != self._index:
            raise ValueError(f"stream is on device {stream.device_index} but the buffer is on device "
                             f"{self._index}; pass a stream of device {self._index} or None")
        return stream

    # -- copies ------------------------------------------------------------------
    @_in_use
    def copy_from(self, src, stream: Optional[Stream] = None, non_blocking: bool = False) -> "Buffer":
        """Copy all of ``src`` (numpy array, Buffer, or bytes-like, exactly ``nbytes``) into this buffer.

        Blocking copies return when the data is on the device (a copy from another Buffer on a
        capturing stream is captured instead, and runs at each replay).  With
        ``non_blocking=True`` the call returns at once; order later work after
        it with the stream.  A pinned source (an :func:`accel.empty_pinned`
        array or a view of one) is copied from directly, as torch's
        ``copy_(src, non_blocking=True)``: its block is not reused before the
        copy ran, but writing to it meanwhile changes what is copied.  Any other
        host source is first copied into pinned staging memory, so it may be
        reused immediately.

        A C-contiguous :class:`accel.ArrayView` is copied as the span of its Buffer it views
        (exactly ``nbytes`` of it), as a Buffer is.
        Another library's device array (C-contiguous) is copied device to device: an object with
        ``__cuda_array_interface__`` (CUDA only; the copy waits for the producer's
        ``stream``), else one with ``__dlpack__`` on this accelerator (on CUDA the producer is
        asked to order its work before the copy stream; elsewhere, as torch, it is asked with
        ``stream=None`` and its work is done first; the capsule's memory is handed back after the
        copy ran, so such a copy is blocking).  A DLPack object in host memory (a torch CPU
        tensor) is copied as host data through ``numpy.from_dlpack``.
        """
        self._live()
        stream = self._check_stream(stream)
        with _Hold(stream):     # the copy's calls on the stream, to its end, use the one it began on
            return self._copy_from(src, stream, non_blocking)

    def _copy_from(self, src, stream: Stream, non_blocking: bool) -> "Buffer":
        backend = self._backend
        region = _own_region(src)
        if region is not None:
            # accel's own C-contiguous typed view: its bytes are a span of its Buffer, copied as a
            # Buffer is (not as another library's array, whose producer stream would be waited on:
            # a synchronize that invalidates a capture)
            src = region[0]
        elif not isinstance(src, Buffer):
            device_src = _device_source(src, self._index)
            if device_src is not None:
                return self._copy_from_foreign(device_src, stream, non_blocking)
            if not _is_host_object(src) and _dlpack_host(src):
                src = _numpy_from_dlpack(src)
        self._writable()
        if isinstance(src, Buffer):
            src._live()
            src_ptr, src_nbytes = (src._ptr, src._nbytes) if region is None else (src._ptr + region[1], region[2])
            if src_nbytes != self._nbytes:
                raise ValueError(f"size mismatch: source {'buffer' if region is None else 'view'} has {src_nbytes} "
                                 f"bytes, destination {self._nbytes}; nothing was copied")
            if src._backend is not backend:
                raise ValueError("source buffer belongs to another backend")
            if src_ptr == self._ptr:
                return self     # the same bytes (torch's copy_ returns early too): nothing to copy
            if self._ptr < src_ptr + src_nbytes and src_ptr < self._ptr + self._nbytes:
                # CUDA Runtime API, cudaMemcpyAsync: "The memory areas may not overlap."
                raise ValueError(f"copy_from: the source (bytes {src_ptr:#x}..{src_ptr + src_nbytes:#x}) "
                                 f"overlaps the destination (bytes {self._ptr:#x}..{self._ptr + self._nbytes:#x}); "
                                 f"copy through a separate buffer; nothing was copied")
            barrier = None
            direct = True
            if src._index != self._index:
                if self._nbytes and not stream.is_capturing():
                    # torch's two-way barrier between the devices' current streams (ATen
                    # cuda/Copy.cu copy_device_to_device): the copy waits for the work queued
                    # on the source device's current stream, and that stream's later work
                    # waits for the copy.  (In a capture the other stream would join it.)
                    barrier = current_stream(src._index)
                    if barrier.is_capturing():
                        # the wait would pull this stream into that capture: the copy would
                        # run only at replays, silently (r71m)
                        from .._errors import CaptureError
                        raise CaptureError(
                            f"copy_from: device {src._index}'s current stream is capturing a graph, and a copy "
                            f"from device {src._index} waits for the work on that stream (the two-way barrier "
                            f"torch puts between the devices' current streams), which would join the copy to "
                            f"the capture; copy before or after the capture, or with a stream of device "
                            f"{src._index} that is not capturing made current; nothing was copied")
                # the copy runs on this buffer's device, which reads the other device's memory:
                # mapped (virtual) and pool memory need explicit access for it (cuMemSetAccess,
                # cudaMemPoolSetAccess), which only a peer-capable pair can have; between
                # others the driver stages the copy (torch asks cudaDeviceCanAccessPeer too,
                # at::cuda::get_p2p_access, and copies with cudaMemcpyPeerAsync then)
                direct = backend.can_access_peer(self._index, src._index)
                if direct:
                    source_allocator = _memory().device_allocator(src._index)
                    source_allocator.add_peer(self._index)
                    direct = source_allocator.reachable_from(src._ptr, self._index)
                if barrier is not None:
                    stream.wait_stream(barrier)
            # Ordering against work on the source's stream is the caller's, as in torch; the
            # uses noted keep the allocator from reusing either block under this copy (noted
            # once it was queued: a refused copy changes nothing)
            noting = _Noting(stream, self, src)
            try:
                with noting:
                    if self._nbytes:
                        with stream._device_scope():
                            if direct:
                                backend.memcpy_async(self._ptr, src_ptr, self._nbytes, stream.handle)
                            else:
                                backend.memcpy_peer_async(self._ptr, self._index, src_ptr, src._index,
                                                          self._nbytes, stream.handle)
                    noting.queued = True
            except Exception:
                if barrier is not None and noting.queued:
                    barrier.wait_stream(stream)
                raise
            except BaseException:
                # (r72d) a KeyboardInterrupt as the copy call returned: it may be queued, so the
                # source device's later work still waits for it (the barrier's second half)
                if barrier is not None:
                    barrier.wait_stream(stream)
                raise
            if barrier is not None:
                barrier.wait_stream(stream)
            if not non_blocking and not (backend.captures_underway() and stream.is_capturing()):
                # A copy on a capturing stream was recorded, not run: nothing to wait for (it
                # runs at each replay, as torch's captured copy_), and cudaStreamSynchronize on
                # the stream would invalidate the capture (CUDA Programming Guide, "Prohibited
                # and Unhandled Operations").
                stream.synchronize()
            return self
        view = _host_view(src)
        if view.nbytes != self._nbytes:
            raise ValueError(f"size mismatch: source has {view.nbytes} bytes, buffer has {self._nbytes}; "
                             f"nothing was copied")
        if not self._nbytes:
            return self
        captured = _capture_hold(backend, stream, _address(view), self._nbytes, non_blocking)
        if captured is not None:
            host, pinned, hold = captured
            host.hold(pinned, hold)         # first: every replay reads the block again
            with _Noting(stream, self) as noting, stream._device_scope():
                backend.memcpy_async(self._ptr, _address(view), self._nbytes, stream.handle)
                noting.queued = True
            return self
        if non_blocking:
            host = _memory().host_allocator()
            address = _address(view)
            pinned = host.owns(address, self._nbytes)
            if pinned is not None:
                # torch's pinned-source path: DMA from the caller's block, which the host
                # allocator keeps from reuse until the copy ran (as copy_to into pinned memory)
                with on_device(backend, self._index), _Noting(stream, self) as noting:
                    backend.memcpy_async(self._ptr, address, self._nbytes, stream.handle)
                    noting.queued = True
                    try:
                        host.record_stream(pinned, stream.handle, self._index)
                    except BaseException:
                        _drain(stream)
                        raise
                return self
            from .._hostmem import _Token, copy_into
            token = _Token()        # the staging block's owner until this call ends (a Ctrl-C: see _Token)
            staging = host.malloc(self._nbytes, _weakref(token))
            try:
                copy_into(staging, view)
                # The stream's device current: for the copy on a shared default stream, and
                # because the host allocator's events live on the stream's device.
                with on_device(backend, self._index), _Noting(stream, self) as noting:
                    backend.memcpy_async(self._ptr, staging, self._nbytes, stream.handle)
                    noting.queued = True
                    try:
                        host.record_stream(staging, stream.handle, self._index)
                    except BaseException:
                        _drain(stream)  # the queued copy may still read the staging block
                        raise
            finally:
                host.free(staging)
        else:
            with _Noting(stream, self) as noting, stream._device_scope():
                backend.memcpy_async(self._ptr, _address(view), self._nbytes, stream.handle)
                noting.queued = True
            stream.synchronize()
        return self

    def _copy_from_foreign(self, source, stream: Stream, non_blocking: bool) -> "Buffer":
        """copy_from another library's device array: ``("cai", interface, obj)`` or
        ``("dlpack", None, obj)`` (see :func:`_device_source`)."""
        kind, cai, obj = source
        if kind == "dlpack":
            from .. import _dlpack
            device = _dlpack._device_pair(obj) if hasattr(obj, "__dlpack_device__") else None
            if device is not None:
                _dlpack._check_device_type(device[0], _dlpack.BACKEND_DEVICE_TYPES.get(self._backend.name),
                                           self._backend.name)
            # the producer orders its work before ``stream`` (CUDA: its handle); elsewhere DLPack has
            # no agreed stream type (torch takes an int, dpctl a SyclQueue) and torch's from_dlpack
            # passes none: None, so the producer waits on the host (as ArrayView.copy_from)
            capsule = _dlpack._ask(obj, self._backend, device, stream if self._backend.name == "cuda" else None)
            info = _dlpack.parse(capsule)
            if info.strides is not None and all(info.shape) and not _dlpack._c_contiguous(info.shape, info.strides):
                # as the __cuda_array_interface__ path: the span would carry the gaps between elements
                raise ValueError(f"{type(obj).__name__} is not C-contiguous (strides {info.strides} for shape "
                                 f"{info.shape}); copy_from needs contiguous memory: make a contiguous copy first; "
                                 f"nothing was copied")
            temp = _dlpack.from_dlpack(capsule)         # takes the capsule, not yet consumed
            try:
                if temp._nbytes != self._nbytes:
                    raise ValueError(f"size mismatch: source {type(obj).__name__} has {temp._nbytes} bytes, "
                                     f"buffer has {self._nbytes}; nothing was copied")
                return self.copy_from(temp, stream, non_blocking)
            finally:
                temp.close()    # waits for the copy, then hands the memory back (the deleter)
        if self._backend.name != "cuda":
            # CUDA Array Interface v3: "data" is a device pointer and "stream" a CUDA stream
            # (1 the legacy default stream, 2 per-thread); neither names XPU or Metal objects,
            # whose stream handles may be 1 or 2 (as ArrayView.copy_from refuses it)
            raise ValueError(f"copy_from: a __cuda_array_interface__ source is CUDA memory, the buffer is on "
                             f"{self.device}; pass an accel.Buffer or a __dlpack__ object of this device; "
                             f"nothing was copied")
        ptr, nbytes, producer = _parse_cai(cai, type(obj).__name__)
        if nbytes != self._nbytes:
            raise ValueError(f"size mismatch: source {type(obj).__name__} has {nbytes} bytes, buffer has "
                             f"{self._nbytes}; nothing was copied")
        self._writable()
        if not nbytes:
            return self
        where = self._backend.pointer_location(ptr)
        index = where[1] if where is not None and where[0] == "device" else self._index
        temp = Buffer._wrap_foreign(ptr, nbytes, index, None)     # checks the range
        try:
            if producer is not None:
                from .._dlpack import wait_for_producer
                wait_for_producer(self._backend, index, producer, stream)
            try:
                self.copy_from(temp, stream, non_blocking)
            except BaseException as exc:
                if producer is not None and non_blocking and not isinstance(exc, Exception):
                    # (r72g) a KeyboardInterrupt as the copy call returned: it may be queued
                    _order_producer_after(self._backend, index, producer, stream)
                raise
            if producer is not None and non_blocking:
                # CAI v3: control returns before the copy ran, so the producer's stream waits for
                # it (its next write would otherwise overwrite the source under the copy)
                _order_producer_after(self._backend, index, producer, stream)
            return self
        finally:
            temp._closed = True     # the caller keeps `obj` alive, as for any source (torch's rule)

    @_in_use
    def copy_to(self, dst, stream: Optional[Stream] = None, non_blocking: bool = False) -> None:
        """Copy the whole buffer into the writable, contiguous host object ``dst``.

        Blocking by default.  With ``non_blocking=True`` and a pinned destination
        (:func:`accel.empty_pinned`) the copy is only queued on the stream and the call
        returns at once: synchronize the stream (or an event recorded after it) before
        reading ``dst``.  A pageable destination is copied blocking, as torch does."""
        self._live()
        stream = self._check_stream(stream)
        with _Hold(stream):     # the copy's calls on the stream, to its end, use the one it began on
            self._copy_to(dst, stream, non_blocking)

    def _copy_to(self, dst, stream: Stream, non_blocking: bool) -> None:
        try:
            view = _memoryview(dst)
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
            address = _address(view)
            captured = _capture_hold(self._backend, stream, address, self._nbytes, non_blocking)
            # the use is noted once the copy was queued (_Noting): a refused one changes nothing
            if captured is not None:
                host, pinned, hold = captured
                host.hold(pinned, hold)     # first: every replay writes the block again
                with _Noting(stream, self) as noting, stream._device_scope():
                    self._backend.memcpy_async(address, self._ptr, self._nbytes, stream.handle)
                    noting.queued = True
                return
            host = _memory().host_allocator() if non_blocking else None
            pinned = host.owns(address, self._nbytes) if host is not None else None
            with _Noting(stream, self) as noting, stream._device_scope():
                self._backend.memcpy_async(address, self._ptr, self._nbytes, stream.handle)
                noting.queued = True
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
        self._live()    # before the output (pinned when non_blocking) is allocated
        try:
            dtype = np.dtype(dtype)
        except TypeError as exc:
            raise TypeError(f"to_numpy: {exc}; pass a numpy dtype such as numpy.float32 or 'uint8'") from None
        if dtype.hasobject:
            raise TypeError(f"to_numpy cannot make an array of dtype {dtype}: it would hold Python object "
                            f"references, not data; use a plain dtype such as numpy.float32 or uint8")
        if dtype.itemsize == 0:
            raise TypeError(f"to_numpy: dtype {dtype} has itemsize 0, so no number of items holds the buffer's "
                            f"bytes; pass a sized dtype such as 'S4', 'V8' or numpy.uint8")
        if self._nbytes % dtype.itemsize:
            raise ValueError(f"buffer of {self._nbytes} bytes is not a whole number of {dtype} items")
        count = self._nbytes // dtype.itemsize
        if shape is not None:
            try:
                dims = tuple(shape) if hasattr(shape, "__iter__") else (shape,)
                if any(isinstance(n, (bool, np.bool_)) for n in dims):
                    raise TypeError     # numpy and torch refuse a bool in a shape; index() takes True as 1
                shape = tuple(operator.index(n) for n in dims)
            except TypeError:
                raise TypeError(f"to_numpy: shape must be an int or a tuple of ints, got {shape!r}") from None
            if any(n < 0 for n in shape) or int(np.prod(shape, dtype=object)) != count:
                raise ValueError(f"to_numpy: shape {shape} does not hold the buffer's {count} {dtype} items "
                                 f"({self._nbytes} bytes); pass a shape whose product is {count}")
        if non_blocking:
            from .._hostmem import empty_pinned
            from ..streams import Event
            stream = self._check_stream(stream)     # (copy_to notes the use, once the copy was queued)
            out = empty_pinned(count, dtype)
            event = Event()
            # One hold over the copy and the record: a close() of the stream by another thread
            # between them would leave a copy queued and no event to say when it ran.
            with _Hold(stream):
                self.copy_to(out, stream, non_blocking=True)
                event.record(stream)
            return (out.reshape(shape + dtype.shape) if shape is not None else out), event
        out = np.empty(count, dtype=dtype)
        self.copy_to(out, stream)
        # a subarray dtype such as ('f4', (2,)) adds its dimensions, as numpy.empty
        return out.reshape(shape + dtype.shape) if shape is not None else out

    @_in_use
    def fill_(self, value: int, stream: Optional[Stream] = None) -> "Buffer":
        """Set every byte to ``value`` (0..255), ordered on ``stream``; returns self."""
        self._live()
        if type(value) is not int or not 0 <= value <= 255:     # (a plain byte passes at once)
            value = _byte(value)
        self._writable()
        stream = self._check_stream(stream)
        with _Hold(stream):     # another thread's close() of the stream waits for the fill
            with _Noting(stream, self) as noting:   # noted once queued: a refused fill changes nothing
                if self._nbytes:
                    with stream._current_scope():
                        self._backend.memset_async(self._ptr, value, self._nbytes, stream._handle)
                    noting.queued = True
        return self

    @_in_use
    def record_stream(self, stream: Stream) -> None:
        """Tell the allocator the buffer is used on ``stream``, so its memory is not
        reused before work queued there so far has completed; ``stream`` becomes the
        buffer's last-use stream.  On a non-owning buffer (:meth:`from_ptr`) the stream is
        noted instead, and releasing the buffer waits for its work."""
        self._live()
        stream = _as_stream(stream, "Buffer.record_stream(stream)")
        stream._live()
        with _Hold(stream):     # the allocator keys the use by the handle: not one destroyed meanwhile
            self._record(stream)

    def _record(self, stream: Stream) -> None:
        """record_stream's work, for a caller holding a pin on this buffer and a hold on ``stream``
        (``streams._Hold``): also after another thread's close() meanwhile, which left the memory
        to the pin's end, so the use is recorded (the free then waits for it) instead of raising
        after the work was queued (a kernel launch, a random fill)."""
        if stream._foreign:
            stream._check_alive()   # a destroyed one, recorded, would fail every later free of the memory
        if self._nbytes and stream is not self._stream and stream != self._stream and self._uses is None:
            _memory().device_allocator(self._index).record_stream(self._ptr, stream._handle, stream._index)
            self._recorded = True       # (an export then orders after them: _dlpack.order_after_other_uses)
        self._used(stream)

    # -- interop -----------------------------------------------------------------
    def as_array(self, dtype, shape=None, strides=None, offset: int = 0):
        """A typed view (:class:`accel.ArrayView`) of this buffer's memory: ``dtype``, ``shape``
        (default: every whole item after ``offset``), byte ``strides`` (default C order) and a
        byte ``offset``; bounds and alignment are checked.  The view shares the memory and
        keeps the buffer alive."""
        from .._array import ArrayView
        return ArrayView(self, dtype, shape, strides, offset)

    @property
    def __cuda_array_interface__(self) -> dict:
        """The CUDA array interface (v3): ``nbytes`` bytes (``|u1``) at ``ptr``.

        ``stream`` is the buffer's last-use stream (:attr:`last_stream`), where accel's latest
        work on the memory was queued; a consumer (CuPy, Numba) orders its work after it.  Work
        still queued on the buffer's other streams (its allocation stream, those of
        :meth:`record_stream`) is waited for by that stream through events, as CAI v3 asks of a
        producer (``accel._dlpack.order_after_other_uses``); the stream's destroy by a
        :meth:`Stream.close` waits for this buffer's close or collection (CAI v3 "Lifetime
        management").  A
        last-use stream closed since is waited for on the host (a device synchronize) and the
        current stream given, and so is one of another device (a copy there read the buffer:
        the consumer would read its handle as a stream of the buffer's device); while a stream capture is underway that wait would invalidate it,
        so CaptureError is raised instead.  CAI v3 forbids 0, so the legacy default stream (handle 0) is given as 1.  torch differs:
        its tensors export version 2, without ``stream``, and leave synchronization to the
        user.  Only CUDA buffers have it: elsewhere and after :meth:`close` the attribute
        raises AttributeError, so ``hasattr(buf, "__cuda_array_interface__")`` is False there
        without any other exception.  In a forked child it raises the fork error, as every
        method of an inherited object."""
        if self._backend.name != "cuda":
            raise AttributeError(f"__cuda_array_interface__ is only defined for CUDA buffers; this one is "
                                 f"{self._backend.name} memory (use __dlpack__)")
        if self._pid != _fin.pid:
            raise _fin.forked_error(self._backend)
        if self._closed:
            raise AttributeError(f"__cuda_array_interface__: {self!r} was closed")
        from .. import _dlpack
        mark = None
        try:
            while True:
                last = self._last
                _dlpack.check_foreign_alive(last)
                # marked before the closed check, as a use is: a close() in another thread either
                # came first (seen here) or leaves the stream's destroy to this export (r73d)
                mark = _ExportMark(last) if last._owned or last._foreign else None
                if last._closed:
                    # its queued work still runs: wait for it, then any stream will do
                    mark = _released(mark)
                    _dlpack.wait_for_closed(self._backend, last)
                elif last._index != self._index:
                    # a stream of another device (a copy it queued read this buffer): the consumer
                    # reads the integer as a stream of the buffer's device (1: that device's legacy
                    # stream) (r71o).  Waited for on the host, as a closed one: a getter that queued a
                    # wait could join a capture or invalidate it, and would queue one at every read
                    # (r71q)
                    mark = _released(mark)
                    _dlpack.wait_for_stream(self._backend, last, f"a stream of device {last._index}")
                else:
                    break
                self._last = current_stream(self._index)
            _dlpack.order_after_other_uses(self, last, (self._index, last._handle))
        except BaseException:
            _released(mark)
            raise
        if not last._handle and self._backend.get_device() != self._index:
            # 1, the legacy default stream, names the current device's when the consumer syncs
            # (CUDA resolves cudaStreamLegacy per calling thread's device; CuPy syncs with no device
            # switch): with another device current, that is not this one's, so its work is waited
            # for here (r73e)
            _dlpack.wait_for_stream(self._backend, last, f"device {self._index}'s default stream")
        # every exported stream outlives a close() while this buffer lives (CAI v3 "Lifetime
        # management"; streams._ExportMark: an earlier consumer may still use the stream it was
        # given), one mark per stream exported (by id: the mark holds the stream, so the id names
        # no other), an export of a stream already marked dropping its own
        if mark is not None:
            marks = self._export
            if marks is None:
                fresh = {}
                with _export_lock:      # two first exports at once make one table (r75f)
                    if self._export is None:
                        self._export = fresh
                    marks = self._export
            if marks.setdefault(id(last), mark) is not mark:
                _released(mark)
            elif self._closed and marks.pop(id(last), None) is mark:
                # a close() in another thread after the checks above took the table before this
                # mark was in it: the stream's destroy waits for nothing now (r75f)
                _released(mark)
        handle = last._handle
        return {"shape": (self._nbytes,), "typestr": "|u1", "data": (self._ptr, self._readonly),
                "strides": None, "version": 3, "stream": handle if handle else _CAI_LEGACY_DEFAULT_STREAM}

    @_in_use
    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule of the buffer: a 1-D ``uint8`` tensor of shape ``(nbytes,)`` (the
        array API standard's ``__dlpack__``; typed tensors come from :meth:`as_array`).

        ``max_version >= (1, 0)`` gives a ``"dltensor_versioned"`` capsule
        (DLManagedTensorVersioned, version 1.1, read-only flag as :attr:`readonly`), None or an
        older version the legacy ``"dltensor"`` (BufferError for a read-only buffer, which that
        struct cannot mark read-only, as numpy refuses).  ``stream`` is the consumer's stream: on CUDA
        None and 1 the legacy default stream, 2 the per-thread default stream, another int a
        ``cudaStream_t``, -1 no synchronization (0 is refused); the consumer's stream waits for
        an event recorded on the buffer's last-use stream (see ``accel._dlpack.sync_for_consumer``).
        ``dl_device=(kDLCPU, 0)`` with ``copy`` None or True gives a host copy (a numpy capsule;
        ``accel._dlpack.export_host_copy``), ``copy=True`` otherwise a copy in a new Buffer on this
        device (``accel._dlpack.export_device_copy``), each flagged IS_COPIED when versioned;
        another ``dl_device`` than :meth:`__dlpack_device__` raises BufferError (ValueError for a
        host device with ``copy=False``).  The capsule keeps the buffer alive until the consumer
        calls its deleter (or the capsule is dropped unconsumed); the memory is freed once, by the
        buffer."""
        from .. import _dlpack
        self._live()
        versioned = _dlpack.check_max_version(max_version)
        own = self.__dlpack_device__()
        copying = _dlpack.check_dl_device(dl_device, own, copy)
        if copying is not None:
            return _dlpack.export_copy(copying, self, self, stream, versioned)
        _dlpack.check_legacy_read_only(versioned, self._readonly)
        _dlpack.sync_for_consumer(self, stream)
        # pinned since before the open check (_in_use): a close() in another thread meanwhile
        # leaves the memory to the pins, and the export's own pin takes it on to the deleter
        return _dlpack.export(self, self._ptr, own[0], own[1], "uint8", (self._nbytes,), None, 0,
                              versioned=versioned, readonly=self._readonly, held=True)

    def __dlpack_device__(self):
        """``(device_type, device_id)``: kDLCUDA (2) on CUDA, kDLOneAPI (14) on XPU, kDLMetal (8)
        on MPS, with the buffer's device index."""
        from .. import _dlpack
        return _dlpack.device_of(self._backend.name, self._index)

    # -- copies (accel/_copying.py) -----------------------------------------------
    def __deepcopy__(self, memo) -> "Buffer":
        """``copy.deepcopy(buf)``: a new Buffer of the same size on the same device holding the
        same bytes (torch's deepcopy of a tensor), copied on the device's current stream."""
        self._live()
        cls = type(self)
        # A subclass keeps its type and its own attributes, deep-copied (torch's Tensor.__deepcopy__);
        # its __init__ is not called again, as torch does not.
        new = cls.__new__(cls)
        Buffer.__init__(new, self._nbytes, device=self._index)
        memo[id(self)] = new
        try:
            if cls is not Buffer:
                import copy
                import copyreg
                for name in copyreg._slotnames(cls):
                    if name not in Buffer.__slots__ and hasattr(self, name):
                        setattr(new, name, copy.deepcopy(getattr(self, name), memo))
                if hasattr(self, "__dict__"):
                    new.__dict__.update(copy.deepcopy(self.__dict__, memo))
            return Buffer.copy_from(new, self, non_blocking=True)    # not an override of the subclass
        except BaseException:
            new.close()
            raise

    def __copy__(self):
        raise _refuse(self, "copy", "use the Buffer itself, copy.deepcopy(buf) for a device copy, or "
                                    "buf.as_array(...) for a view")

    def __reduce_ex__(self, protocol):
        raise _refuse(self, "pickle", "pickle its bytes instead (buf.to_numpy()) and copy them into a new "
                                      "Buffer on the other side")

    # -- lifetime ------------------------------------------------------------------
    def close(self) -> None:
        """Return the memory to the caching allocator.  Idempotent.  A non-owning buffer
        (:meth:`from_ptr`, :func:`accel.from_dlpack`) frees nothing: it waits for the work
        queued on it, then drops its owner (calling a DLPack capsule's deleter).

        While a DLPack consumer still holds one of the buffer's capsules (its deleter not yet
        called), the buffer is closed for accel's use but the memory stays: the last deleter
        hands it back."""
        if self._pid != _fin.pid:
            raise _fin.forked_error(self._backend)
        if self._closed or not _claim_close(self):
            return      # closed already, or another thread's close() got there first
        if self._export is not None:
            marks, self._export = self._export, None
            while marks:            # an exported stream closed meanwhile is destroyed now
                _released(marks.popitem()[1])
        if self._uses is None and not self._pins:
            # the common case: owned memory no export or call in flight pins (checked after the
            # claim, as below: a use that pins it now finds the buffer closed and raises)
            if not self._nbytes:
                return
            if not _locks._running and not _fin.pending and self._backend is _lazy._initialized_backend:
                self._alloc.free(self._ptr)     # _fin.release's fast path: no collection, nothing deferred, live runtime
            else:
                _fin.release(_free, self._backend, self._alloc, self._ptr)
            return
        call = self._release_call()
        if call is None:
            return
        if self._pins:
            self._deferred.append(call)
            call = self._unpinned_release()     # None: an export's deleter releases it later
            if call is None:
                return
        _fin.release(call[0], *call[1])

    def _release_call(self):
        """``(function, args)`` that hands the memory back, or None (nothing to release)."""
        if self._uses is not None:
            # The uses as they are when the release runs, not now: a call in flight (its pin
            # defers the release to its end) may note its stream after this close, once its work
            # was queued (a kernel launch, a random fill), and that work must be waited for too.
            owner, self._owner = self._owner, None
            return _release_foreign_uses, (owner, self._backend, self._uses)
        if self._nbytes:
            return _free, (self._backend, self._alloc, self._ptr)
        return None

    def _unpinned_release(self):
        """The deferred release once no export pins the memory, taken by exactly one caller
        (``list.pop`` is atomic: close() and the last deleter may race here)."""
        if self._pins:
            return None
        try:
            return self._deferred.pop()
        except IndexError:
            return None

    def _pin(self) -> "_Pin":
        """A token a DLPack export holds until its deleter runs: while any is alive, close()
        leaves the memory to the last one."""
        return _Pin(self)

    def __enter__(self) -> "Buffer":
        self._live()        # (as a closed Stream refuses: r67i)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self, _finalizing=sys.is_finalizing):
        if _finalizing():
            return      # interpreter exit: module globals may be gone; the process takes it all
        try:
            # Never waits on the allocator's lock (see accel._finalize); nothing in a forked child.
            if getattr(self, "_closed", True) or self._pid != _fin.pid:
                return
            # During a collection the buffer stays open until its cycle is gone: another finalizer of
            # the same garbage may still use it (accel._finalize.release_on_del).
            if self._uses is not None:
                # a non-owning buffer: its owner is released even after a runtime reset (the
                # release skips the wait then), so a DLPack deleter still runs exactly once
                _fin.release_on_del(self, _release_foreign_uses, self._owner, self._backend, self._uses)
            elif _lazy.is_initialized():
                if self._nbytes:
                    _fin.release_on_del(self, _free_from_finalizer, self._backend, self._alloc, self._ptr)
                elif not _fin.collecting():
                    self._closed = True
        except KeyboardInterrupt:
            _fin.RAISE_AGAIN[_fin.interrupt_key()]    # a Ctrl-C handled in here reaches the program (r62)
