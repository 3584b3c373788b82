"""The consumer: :func:`parse` reads a capsule without taking it, :class:`Imported` takes it
and calls its deleter once, :func:`from_dlpack` wraps it as a non-owning Buffer.

A capsule is read before it is taken: a refused one keeps its name, so its producer's
destructor frees it.  A taken one is renamed ``used_…`` under ``_take_lock`` (made anew in a
forked child: read it through this module) and its deleter is called exactly once by
:meth:`Imported.release`.  ``_ask`` calls a producer's ``__dlpack__`` with accel's stream
(:mod:`.ordering` makes a requested stream of another device wait for it).
"""

from __future__ import annotations

import contextlib
import ctypes
import operator
from typing import Any, Tuple

from .. import _finalize, _lazy, _locks
from .abi import (
    _ADDRESS_LIMIT, BACKEND_DEVICE_TYPES, DELETER, DLPACK_VERSION, FLAG_READ_ONLY, FLAG_SUBBYTE_PADDED,
    HOST_DEVICE_TYPES, NAME, NAME_VERSIONED, USED_NAME, USED_NAME_VERSIONED, DLDeviceType, DLManagedTensor,
    DLManagedTensorVersioned, _PyCapsule_GetName, _PyCapsule_GetPointer, _PyCapsule_IsValid, _PyCapsule_SetName)
from .ordering import _CUDA_LEGACY, wait_for_producer

#: Held while a consumer checks a capsule is unconsumed and renames it (Imported).
_take_lock = _locks.module_lock(globals(), "_take_lock")


# -- consumer ---------------------------------------------------------------------------------
class Tensor:
    """What a DLPack capsule describes (read without taking it)."""

    __slots__ = ("capsule", "address", "versioned", "version", "flags", "data", "device_type", "device_id",
                 "code", "bits", "lanes", "shape", "strides", "byte_offset")

    @property
    def readonly(self) -> bool:
        return bool(self.flags & FLAG_READ_ONLY)

    @property
    def itemsize_bits(self) -> int:
        """Bits an element occupies: a padded sub-byte element (DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED)
        takes whole bytes, as dlpack.h's GetDataSize counts it; packed (the default) its bits."""
        bits = self.bits * self.lanes
        if self.flags & FLAG_SUBBYTE_PADDED and bits % 8:
            bits += 8 - bits % 8
        return bits

    def span(self) -> Tuple[int, int]:
        """``(address, nbytes)`` of the bytes the tensor's elements occupy, from the lowest to the
        highest element (gaps between strided elements included); ``(0, 0)`` when empty."""
        if any(n == 0 for n in self.shape):
            return 0, 0
        bits = self.itemsize_bits
        start = (self.data or 0) + self.byte_offset
        if self.strides is None or _c_contiguous(self.shape, self.strides):
            count = 1
            for n in self.shape:
                count *= n
            nbytes = (count * bits + 7) // 8
            if start + nbytes > _ADDRESS_LIMIT:
                raise BufferError(f"DLPack tensor of shape {self.shape} at {start:#x}: its {nbytes} bytes reach "
                                  f"past the 64-bit address space")
            return start, nbytes
        if bits % 8:
            raise BufferError(f"a strided tensor of {bits}-bit elements has no byte span")
        low = sum(min(0, (n - 1) * s) for n, s in zip(self.shape, self.strides))
        high = sum(max(0, (n - 1) * s) for n, s in zip(self.shape, self.strides))
        item = bits // 8
        lowest, nbytes = start + low * item, (high - low + 1) * item
        if lowest < 0 or lowest + nbytes > _ADDRESS_LIMIT:
            raise BufferError(f"DLPack tensor of shape {self.shape} and strides {self.strides} at {start:#x}: its "
                              f"elements reach addresses outside the 64-bit address space")
        return lowest, nbytes


def _c_contiguous(shape, strides) -> bool:
    step = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1 and s != step:
            return False
        step *= n
    return True


#: The most dimensions a capsule may have (numpy's NPY_MAXDIMS, which its from_dlpack enforces too).
_MAX_NDIM = 64


def parse(capsule) -> Tensor:
    """Read a DLPack capsule without taking it.  TypeError for something that is not a capsule,
    BufferError for a consumed one ("used_dltensor") or one of another name."""
    if type(capsule).__name__ != "PyCapsule":
        raise TypeError(f"expected a DLPack capsule (PyCapsule) or an object with __dlpack__, got "
                        f"{type(capsule).__name__}")
    raw = _PyCapsule_GetName(capsule)
    name = ctypes.string_at(raw) if raw else b""
    if name in (USED_NAME, USED_NAME_VERSIONED):
        raise BufferError(f"this DLPack capsule was already consumed (named {name.decode()!r}): a capsule "
                          f"can be taken once; call __dlpack__() again for a new one")
    if name not in (NAME, NAME_VERSIONED):
        raise BufferError(f"not a DLPack capsule: its name is {name.decode(errors='replace')!r}, not "
                          f"'dltensor' or 'dltensor_versioned'")
    address = _PyCapsule_GetPointer(capsule, name)
    info = Tensor()
    info.capsule, info.address, info.versioned = capsule, address, name == NAME_VERSIONED
    if info.versioned:
        managed = DLManagedTensorVersioned.from_address(address)
        info.version = (managed.version.major, managed.version.minor)
        info.flags = managed.flags
        if info.version[0] != DLPACK_VERSION[0]:
            # dlpack.h: on a major mismatch only the deleter may be touched: take and free it
            Imported(capsule, address, True).release()
            raise BufferError(f"DLPack capsule of version {info.version[0]}.{info.version[1]}: accel reads "
                              f"major version {DLPACK_VERSION[0]}; the capsule was released")
    else:
        managed = DLManagedTensor.from_address(address)
        info.version, info.flags = (0, 0), 0
    tensor = managed.dl_tensor
    info.data = tensor.data or 0
    info.device_type, info.device_id = tensor.device.device_type, tensor.device.device_id
    info.code, info.bits, info.lanes = tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes
    ndim = tensor.ndim
    if not 0 <= ndim <= _MAX_NDIM:
        # the shape and strides arrays are read ndim entries far: a wrong ndim reads past them
        raise BufferError(f"DLPack tensor with ndim {ndim}: accel reads 0 to {_MAX_NDIM} dimensions "
                          f"(numpy's limit); the producer made a malformed capsule")
    if ndim and not tensor.shape:
        raise BufferError(f"DLPack tensor with ndim {ndim} and a NULL shape: the producer made a malformed capsule")
    info.shape = tuple(tensor.shape[i] for i in range(ndim))
    info.strides = tuple(tensor.strides[i] for i in range(ndim)) if tensor.strides else None
    info.byte_offset = tensor.byte_offset
    # a broken producer's tensor is refused here, before the capsule is taken
    if any(n < 0 for n in info.shape):
        raise BufferError(f"DLPack tensor of shape {info.shape}: an extent is negative; the producer made a "
                          f"malformed capsule")
    if not info.bits or not info.lanes:
        raise BufferError(f"DLPack tensor of dtype code {info.code} with {info.bits} bits and {info.lanes} lanes: "
                          f"an element of 0 bits or 0 lanes is malformed")
    # dlpack.h DLDataTypeCode: FP6 "Setting bits != 6 is currently unspecified, and the producer
    # must ensure it is set while the consumer must stop importing if the value is unexpected"
    # (FP4 the same, bits != 4)
    expected = _SUBBYTE_BITS.get(info.code)
    if expected is not None and info.bits != expected:
        raise BufferError(f"DLPack tensor of dtype code {info.code} ({_SUBBYTE_NAMES[info.code]}) with "
                          f"{info.bits} bits: dlpack.h sets {expected}, and a consumer must stop importing "
                          f"another value; the producer made a malformed capsule")
    return info


#: dlpack.h DLDataTypeCode: the sub-byte float codes and the only bits each may have
_SUBBYTE_BITS = {15: 6, 16: 6, 17: 4}
_SUBBYTE_NAMES = {15: "kDLFloat6_e2m3fn", 16: "kDLFloat6_e3m2fn", 17: "kDLFloat4_e2m1fn"}


class Imported:
    """A taken DLPack capsule: its managed tensor's deleter runs exactly once, at
    :meth:`release` (idempotent; nothing in a forked child, whose memory is the parent's)."""

    __slots__ = ("_address", "_versioned", "_done", "_keep", "_pid")

    def __init__(self, capsule, address: int, versioned: bool, keep: Any = None):
        # Checked and renamed under one lock: two accel consumers (threads) that both parsed the
        # capsule must not both take it, or the producer's deleter would run twice.  Never taken
        # by a finalizer or deleter.
        with _take_lock:
            if not _PyCapsule_IsValid(capsule, NAME_VERSIONED if versioned else NAME):
                raise BufferError("this DLPack capsule was consumed meanwhile (by another thread): a capsule "
                                  "can be taken once; call __dlpack__() again for a new one")
            if _PyCapsule_SetName(capsule, USED_NAME_VERSIONED if versioned else USED_NAME):
                raise BufferError("could not rename the DLPack capsule to mark it consumed")
        self._address, self._versioned, self._done, self._keep = address, versioned, False, keep
        self._pid = _finalize.pid

    def release(self) -> None:
        if self._done:
            return
        self._done = True
        keep, self._keep = self._keep, None
        if self._pid != _finalize.pid:
            return
        cls = DLManagedTensorVersioned if self._versioned else DLManagedTensor
        deleter = cls.from_address(self._address).deleter
        if deleter:
            DELETER(deleter)(self._address)
        del keep       # the producer object, after its memory was handed back


def from_dlpack(obj, *, stream=None):
    """``accel.from_dlpack(obj)``: a non-owning :class:`accel.Buffer` over another library's
    device memory (zero copy).

    ``obj`` is an object with ``__dlpack__`` (CuPy, torch, JAX, numba, accel's own buffers and
    views) or a DLPack capsule.  accel asks the producer for a versioned capsule
    (``max_version=(1, 0)``; an old producer without that keyword is asked again without it) and
    passes ``stream``: by default accel's current stream of the producer's device (CUDA: its
    ``cudaStream_t``, 1 for the legacy default stream), so the producer orders its pending work
    before accel's.  The Buffer keeps ``obj`` alive and calls the capsule's deleter exactly once:
    at ``close()`` or when collected (after waiting for the accel work queued on it, see
    :meth:`accel.Buffer.from_ptr`); never in a forked child.

    The Buffer covers the bytes from the tensor's lowest to its highest element: for a
    non-contiguous tensor that includes the gaps between its elements (which belong to the
    producer's allocation); ``copy_from``/``fill_`` on it write those gaps too.  A read-only
    tensor (DLPACK_FLAG_BITMASK_READ_ONLY) gives a read-only Buffer.  Host memory (kDLCPU,
    kDLCUDAHost) is refused: copy it with ``numpy.from_dlpack(obj)`` and ``Buffer.copy_from``.
    A device type other than the current accelerator's is refused with BufferError; a device
    index accel does not have raises :class:`accel.InvalidDeviceError`, as every bad index."""
    from ..buffer import Buffer
    capsule = obj
    device = None
    producer = type(obj).__name__ != "PyCapsule"
    if producer:
        # what needs no device is refused before the runtime starts (a wrong argument is named,
        # not hidden behind a driver error on a machine without a device)
        if not hasattr(obj, "__dlpack__"):
            raise TypeError(f"from_dlpack expects an object with __dlpack__ or a DLPack capsule, got "
                            f"{type(obj).__name__}")
        if hasattr(obj, "__dlpack_device__"):
            device = _device_pair(obj)
            if device[0] in HOST_DEVICE_TYPES:
                _check_device_type(device[0], None, "")
    backend = _lazy.lazy_init()
    own_type = BACKEND_DEVICE_TYPES.get(backend.name)
    if producer:
        if device is not None:
            _check_device_type(device[0], own_type, backend.name)
        capsule = _ask(obj, backend, device, stream)
        if type(capsule).__name__ != "PyCapsule":
            raise TypeError(f"{type(obj).__name__}.__dlpack__() returned {type(capsule).__name__} "
                            f"{capsule!r:.60}, not a DLPack capsule (PyCapsule); the producer is broken")
    info = parse(capsule)
    _check_device_type(info.device_type, own_type, backend.name)
    from .._device import check_range
    check_range(info.device_id)
    to_address(backend, info)
    ptr, nbytes = info.span()
    imported = Imported(capsule, info.address, info.versioned, keep=obj)
    try:
        return Buffer._wrap_foreign(ptr, nbytes, info.device_id, imported, readonly=info.readonly)
    except BaseException:
        imported.release()
        raise


def to_address(backend, info) -> None:
    """Make a parsed capsule's ``data + byte_offset`` the device address of its first byte
    (a kDLMetal capsule names an MTLBuffer: ``Backend.dlpack_address``)."""
    if info.device_type == DLDeviceType.kDLMetal and info.data and all(n != 0 for n in info.shape):
        info.data, info.byte_offset = backend.dlpack_address(info.data, info.byte_offset), 0


def _device_pair(obj) -> Tuple[int, int]:
    """``obj.__dlpack_device__()`` checked: a ``(device_type, device_id)`` pair of ints."""
    value = obj.__dlpack_device__()
    try:
        kind, index = value
        if isinstance(kind, bool) or isinstance(index, bool):
            raise TypeError
        return operator.index(kind), operator.index(index)
    except (TypeError, ValueError):
        raise TypeError(f"{type(obj).__name__}.__dlpack_device__() returned {value!r}, not a (device_type, "
                        f"device_id) pair of ints as the DLPack protocol asks; the producer is broken") from None


def _check_device_type(kind: int, own_type, backend_name: str) -> None:
    if kind in HOST_DEVICE_TYPES:
        raise BufferError(f"from_dlpack: the tensor is host memory ({DLDeviceType(kind).name}); accel wraps only "
                          f"device memory: copy it instead, e.g. Buffer(a.nbytes).copy_from(numpy.from_dlpack(a))")
    if kind != own_type:
        name = DLDeviceType(kind).name if kind in DLDeviceType._value2member_map_ else f"device type {kind}"
        raise BufferError(f"from_dlpack: the tensor lives on {name}, not on the current accelerator "
                          f"({backend_name}, {own_type.name if own_type else 'none'}); copy it to host memory "
                          f"and upload it with Buffer.copy_from")


def _ask(obj, backend, device, stream):
    """``obj.__dlpack__`` with accel's stream and max_version (1, 0), falling back for old producers.
    An accel stream whose handle is passed is held meanwhile (``streams._Hold``): the producer
    queues its wait on the handle, which another thread's close() must not destroy (and hand to
    the next stream made) before that."""
    from ..streams import Stream, _Hold, cuda_stream_handle, current_stream
    consumer = None
    if (isinstance(stream, Stream) and stream._handle == 0 and device is not None and backend.name == "cuda"
            and stream._index != device[1]):
        # Another device's legacy default stream: DLPack's 1 ("the legacy default stream") would
        # name the producer's own device's (r65m: device 1's default stream was left unordered).
        # The producer orders its work before its device's current stream instead, and the
        # requested stream waits for that one.
        consumer, stream = stream, None
    if stream is None and device is not None and backend.name == "cuda":
        from .._device import check_range
        check_range(device[1])
        held = current_stream(device[1])
    else:
        held = stream if isinstance(stream, Stream) else None
    with _Hold(held) if held is not None else contextlib.nullcontext():
        if stream is None and held is not None:
            stream = held._handle or _CUDA_LEGACY
        elif stream is not None and hasattr(stream, "__cuda_stream__"):
            stream = cuda_stream_handle(stream, "stream") or _CUDA_LEGACY
        try:
            capsule = obj.__dlpack__(stream=stream, max_version=(1, 0))
        except TypeError:
            capsule = obj.__dlpack__(stream=stream)
        if consumer is not None:
            wait_for_producer(backend, device[1], stream, consumer)
        return capsule
