"""DLPack without compiled code: capsules made and read through ``ctypes``.

The structs are dlpack.h's (DLPack 1.1 header; ``DLManagedTensorVersioned`` since 1.0, the legacy
``DLManagedTensor`` before): ``DLDevice``, ``DLDataType``, ``DLTensor``, the managed tensors and
``DLPackVersion``.  Everything here is the C ABI of the header, laid out by ``ctypes``.

**Producer** (:func:`export`).  The managed tensor, its shape and strides arrays live in ctypes
objects held in :data:`_exports` (keyed by the struct's address) together with ``owner``, the
Python object that must outlive the consumer's use (an :class:`accel.Buffer`).  The capsule is
made with ``ctypes.pythonapi.PyCapsule_New`` named ``"dltensor"`` or ``"dltensor_versioned"``,
with a ``PyCapsule_Destructor`` that calls the deleter only while the capsule still has that
name (a capsule dropped unconsumed); a consumer renames it ``"used_dltensor[_versioned]"`` and
calls the deleter itself when it is done.  The deleter pops the entry: the struct is freed once
and ``owner`` released once, whoever calls it and however often.  It takes no lock (a dict pop
is atomic), so it is safe from any thread, a garbage collection, or a forked child (where the
released Buffer's finalizer does nothing, see accel._finalize).  State is bounded by live
exports.  The ctypes callbacks and the capsule names are made immortal (one reference leaked
each), so a capsule that outlives this module's globals at interpreter exit still finds them.

**Consumer** (:func:`parse`, :class:`Imported`, :func:`from_dlpack`).  A capsule is read
before it is taken: a refused one keeps its name, so its producer's destructor frees it.  A
taken one is renamed ``used_…`` and its deleter is called exactly once by
:meth:`Imported.release`.

**Stream handshake** (:func:`sync_for_consumer`): the array API standard's ``__dlpack__``
``stream`` argument, CUDA values: None (the legacy default stream), 1 (legacy default), 2 (per-thread
default), another int (a ``cudaStream_t``), -1 (no synchronization); 0 is disallowed.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import operator
import weakref
from ctypes import POINTER, c_char_p, c_int, c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p
from typing import Any, Dict, Tuple

from . import _finalize, _lazy, _locks
from ._errors import AcceleratorError, CaptureError
from .backends._signals import deferred

__all__ = ["DLDeviceType", "export", "parse", "Imported", "DLPACK_VERSION", "sync_for_consumer",
           "device_of", "from_dlpack", "check_max_version", "check_dl_device", "export_host_copy"]

#: The DLPack version accel writes into versioned capsules (dlpack.h DLPACK_MAJOR/MINOR_VERSION).
DLPACK_VERSION = (1, 1)
FLAG_READ_ONLY = 1 << 0          # DLPACK_FLAG_BITMASK_READ_ONLY
FLAG_IS_COPIED = 1 << 1          # DLPACK_FLAG_BITMASK_IS_COPIED
FLAG_SUBBYTE_PADDED = 1 << 2     # DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED


class DLDeviceType(enum.IntEnum):
    """dlpack.h ``DLDeviceType`` (the values ``__dlpack_device__`` returns)."""
    kDLCPU = 1
    kDLCUDA = 2
    kDLCUDAHost = 3
    kDLOpenCL = 4
    kDLVulkan = 7
    kDLMetal = 8
    kDLVPI = 9
    kDLROCM = 10
    kDLROCMHost = 11
    kDLExtDev = 12
    kDLCUDAManaged = 13
    kDLOneAPI = 14
    kDLWebGPU = 15
    kDLHexagon = 16
    kDLMAIA = 17
    kDLTrn = 18


#: accel backend name -> the DLPack device type of its device memory.
BACKEND_DEVICE_TYPES = {"cuda": DLDeviceType.kDLCUDA, "xpu": DLDeviceType.kDLOneAPI,
                        "mps": DLDeviceType.kDLMetal}
#: Device types whose memory is host memory (never wrapped as device memory).
HOST_DEVICE_TYPES = (DLDeviceType.kDLCPU, DLDeviceType.kDLCUDAHost, DLDeviceType.kDLROCMHost)


# -- dlpack.h structs ---------------------------------------------------------------------------
class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", c_void_p), ("device", DLDevice), ("ndim", c_int32), ("dtype", DLDataType),
                ("shape", POINTER(c_int64)), ("strides", POINTER(c_int64)), ("byte_offset", c_uint64)]


class DLManagedTensor(ctypes.Structure):
    # deleter: void (*)(DLManagedTensor *), kept as a raw pointer (called through DELETER)
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", c_void_p), ("deleter", c_void_p),
                ("flags", c_uint64), ("dl_tensor", DLTensor)]


#: void (*deleter)(DLManagedTensor[Versioned] *self)
DELETER = ctypes.CFUNCTYPE(None, c_void_p)
#: typedef void (*PyCapsule_Destructor)(PyObject *): the argument as a raw pointer, never a
#: py_object (that would take a reference to a capsule being deallocated).
CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, c_void_p)

# Own prototypes over ctypes.pythonapi, so the argtypes other code may set on the shared
# ctypes.pythonapi.PyCapsule_* attributes neither affect nor are affected by these.
_api = ctypes.pythonapi
_PyCapsule_New = ctypes.PYFUNCTYPE(ctypes.py_object, c_void_p, c_char_p, CAPSULE_DESTRUCTOR)(
    ("PyCapsule_New", _api))
_PyCapsule_IsValid_raw = ctypes.PYFUNCTYPE(c_int, c_void_p, c_char_p)(("PyCapsule_IsValid", _api))
_PyCapsule_GetPointer_raw = ctypes.PYFUNCTYPE(c_void_p, c_void_p, c_char_p)(("PyCapsule_GetPointer", _api))
_PyCapsule_IsValid = ctypes.PYFUNCTYPE(c_int, ctypes.py_object, c_char_p)(("PyCapsule_IsValid", _api))
_PyCapsule_GetPointer = ctypes.PYFUNCTYPE(c_void_p, ctypes.py_object, c_char_p)(("PyCapsule_GetPointer", _api))
_PyCapsule_GetName = ctypes.PYFUNCTYPE(c_void_p, ctypes.py_object)(("PyCapsule_GetName", _api))
_PyCapsule_SetName = ctypes.PYFUNCTYPE(c_int, ctypes.py_object, c_char_p)(("PyCapsule_SetName", _api))
_Py_IncRef = ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_IncRef", _api))
# No argtypes: arguments are converted in C (byref objects made in advance), never by a
# Python-level from_param, which fails while an exception is pending.
_PyErr_Fetch = ctypes.PyDLL(_api._name, handle=_api._handle).PyErr_Fetch
_PyErr_Fetch.restype = None
_PyErr_Restore = ctypes.PYFUNCTYPE(None, c_void_p, c_void_p, c_void_p)(("PyErr_Restore", _api))

NAME = b"dltensor"
NAME_VERSIONED = b"dltensor_versioned"
USED_NAME = b"used_dltensor"
USED_NAME_VERSIONED = b"used_dltensor_versioned"

#: Live exports: struct address -> (struct, shape array, strides array, owner, error slots).
_exports: Dict[int, tuple] = {}
#: Live capsules: capsule address -> struct address (the destructor's way to the entry).
_capsules: Dict[int, int] = {}
#: Held while a consumer checks a capsule is unconsumed and renames it (Imported).
_take_lock = _locks.module_lock(globals(), "_take_lock")

# The consumer may call the deleter, or drop a refused capsule (running the destructor), with
# its own exception already set (numpy and torch do on their error paths).  A ctypes callback
# cannot hand that exception back: the call into Python turns it into SystemError and ctypes
# prints and clears it.  So each callback first moves the pending exception out of the way with
# PyErr_Fetch -- before any call, which would fail with it pending -- into slots of its own
# entry (reached by dict lookups only, so concurrent callbacks never share slots), does its
# work with no exception pending, and restores it at the end: it is then raised in the
# callback and reported through sys.unraisablehook ("Exception ignored ... BufferError: ..."),
# while the consumer raises SystemError.  Nothing leaks on that path.


def _on_delete(address) -> None:
    """The deleter (DLManagedTensor[Versioned].deleter): frees the struct and releases the owner,
    once; a second call for the same address finds nothing.  No lock (see the module docstring)."""
    if not _exports or address not in _exports:     # (None at interpreter exit)
        return
    slots = _exports[address][4]
    _PyErr_Fetch(slots[3], slots[4], slots[5])     # first call: see above
    _release_entry(address, slots)


def _release_entry(address, slots) -> None:
    try:
        entry = _exports.pop(address, None)
        del entry              # drops the owner: its finalizer follows accel._finalize's rules
    finally:
        if slots[0].value:
            _PyErr_Restore(slots[0].value, slots[1].value, slots[2].value)   # raises it (reported)


def _on_capsule_free(capsule) -> None:
    """PyCapsule_Destructor: a capsule freed while still named "dltensor[_versioned]" was never
    consumed, so its deleter runs here; a consumed one ("used_…") is the consumer's."""
    if not _capsules or capsule not in _capsules:   # (None at interpreter exit)
        return
    address = _capsules[capsule]
    if address not in _exports:
        del _capsules[capsule]
        return
    slots = _exports[address][4]
    _PyErr_Fetch(slots[3], slots[4], slots[5])     # first call: see above
    del _capsules[capsule]
    unconsumed = False
    try:
        unconsumed = bool(_PyCapsule_IsValid_raw(capsule, NAME) or _PyCapsule_IsValid_raw(capsule, NAME_VERSIONED))
    finally:
        if unconsumed:
            _release_entry(address, slots)
        elif slots[0].value:
            _PyErr_Restore(slots[0].value, slots[1].value, slots[2].value)


_DELETER = DELETER(_on_delete)
_DELETER_ADDRESS = ctypes.cast(_DELETER, c_void_p).value
_DESTRUCTOR = CAPSULE_DESTRUCTOR(_on_capsule_free)
for _immortal in (_DELETER, _DESTRUCTOR, NAME, NAME_VERSIONED, USED_NAME, USED_NAME_VERSIONED):
    _Py_IncRef(_immortal)     # a capsule alive at interpreter exit may still call or name them
del _immortal


# -- dtypes -----------------------------------------------------------------------------------
_KIND_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}     # kDLInt, kDLUInt, kDLFloat, kDLComplex, kDLBool
#: Extension dtypes by numpy name (ml_dtypes): dlpack.h DLDataTypeCode
_NAMED_CODES = {"bfloat16": 4, "float8_e3m4": 7, "float8_e4m3": 8, "float8_e4m3b11fnuz": 9,
                "float8_e4m3fn": 10, "float8_e4m3fnuz": 11, "float8_e5m2": 12, "float8_e5m2fnuz": 13,
                "float8_e8m0fnu": 14}


def dl_dtype(dtype) -> Tuple[int, int, int]:
    """``(code, bits, lanes)`` of a numpy dtype, or BufferError for one DLPack cannot describe."""
    import numpy as np
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"dtype {dtype!r} is not a numpy dtype ({exc}); pass e.g. numpy.float32") from None
    if dt.name in _NAMED_CODES:
        return _NAMED_CODES[dt.name], dt.itemsize * 8, 1
    code = _KIND_CODES.get(dt.kind)
    if code is None or dt.fields is not None or dt.subdtype is not None:
        raise BufferError(f"DLPack cannot describe dtype {dt} (kind {dt.kind!r}): only booleans, integers, "
                          f"floats and complex numbers (and bfloat16/float8) have DLPack codes")
    if not dt.isnative:
        raise BufferError(f"DLPack data are native-endian; dtype {dt} is byte-swapped: use "
                          f"{dt.newbyteorder('=')} and swap the bytes first")
    if (dt.kind == "f" and dt.itemsize > 8) or (dt.kind == "c" and dt.itemsize > 16):
        # dlpack.h: kDLFloat is "IEEE floating point"; numpy's long double is x87 extended
        # precision padded to 16 bytes on x86 (its complex: 256 bits, past DLDataType.bits, a
        # uint8).  numpy refuses them the same way (dlpack.c: "DLPack only supports IEEE
        # floating point types without padding (longdouble typically is not IEEE)").
        raise BufferError(f"DLPack only describes IEEE floating point types without padding; dtype {dt} "
                          f"({dt.itemsize} bytes) is numpy's long double: convert to float64 "
                          f"(or complex128) first")
    return code, dt.itemsize * 8, 1


_INT64_LIMIT = 1 << 63
_ADDRESS_LIMIT = 1 << 64


def _ints(values, what: str) -> Tuple[int, ...]:
    try:
        return tuple(operator.index(v) for v in values)
    except TypeError:
        raise TypeError(f"{what} must be a sequence of ints, got {values!r}") from None


# -- producer ---------------------------------------------------------------------------------
def export(owner: Any, ptr: int, device_type: int, device_id: int, dtype, shape, strides, byte_offset: int,
           *, versioned: bool, readonly: bool = False, held: bool = False):
    """A new DLPack capsule describing ``ptr`` (+ ``byte_offset``) as an array of ``dtype`` and
    ``shape`` (``strides`` in elements, None for C order) on ``(device_type, device_id)``.

    ``owner`` is kept alive until the consumer calls the deleter (or the capsule is dropped
    unconsumed); when it is an accel.Buffer, or has one as ``buffer`` (a typed view), that
    buffer is pinned meanwhile: an explicit ``close()`` leaves its memory to the deleter.  ``versioned`` makes a ``"dltensor_versioned"`` capsule holding a
    ``DLManagedTensorVersioned`` (version :data:`DLPACK_VERSION`; ``readonly`` sets
    DLPACK_FLAG_BITMASK_READ_ONLY), else a legacy ``"dltensor"`` ``DLManagedTensor``.  Strides are
    always written (DLPack 1.x forbids NULL strides for ndim > 0).  A zero-size array has a NULL
    data pointer, as dlpack.h asks.

    ``held``: the caller has held a pin on that buffer since before its open check (``Buffer``'s
    ``_in_use``), so a close() by another thread since then left the memory to the pins: the
    export is made all the same (the call completes on the memory it began with) and its own pin
    takes the memory on to the deleter.  Without it a buffer closed meanwhile is refused: its
    memory may be freed already."""
    pin = _pin_of(owner)
    if pin is not None and pin._buf._closed and not held:
        # A close() (another thread's) landed after the caller's live check and before the pin: its
        # memory may be freed already.  Pinned first, a later close() leaves the memory to the deleter.
        closed, pin = pin._buf, None        # dropping the pin hands on a release close() deferred
        raise RuntimeError(f"{closed!r} was closed while it was being exported; allocate a new Buffer")
    code, bits, lanes = dl_dtype(dtype)
    shape = _ints(shape, "shape")
    if any(n < 0 for n in shape):
        raise ValueError(f"shape {shape} has a negative extent")
    if strides is None:
        strides, step = [], 1
        for n in reversed(shape):
            strides.append(step)
            step *= max(n, 1)
        strides = tuple(reversed(strides))
    else:
        strides = _ints(strides, "strides")
        if len(strides) != len(shape):
            raise ValueError(f"strides {strides} and shape {shape} have different lengths")
    for what, values in (("shape", shape), ("strides", strides)):
        if any(not -_INT64_LIMIT <= v < _INT64_LIMIT for v in values):
            raise ValueError(f"{what} {values} has an entry outside int64, which DLPack's {what} array holds; "
                             f"export a smaller array")
    ptr, byte_offset = operator.index(ptr), operator.index(byte_offset)
    if byte_offset < 0 or ptr < 0:
        raise ValueError(f"ptr ({ptr:#x}) and byte_offset ({byte_offset}) must be >= 0")
    empty = any(n == 0 for n in shape)
    if device_type == DLDeviceType.kDLMetal and ptr and not empty:
        # the MTLBuffer and the offset into it (MetalBackend.dlpack_data)
        ptr, start = _lazy.lazy_init().dlpack_data(ptr + byte_offset)
        byte_offset = start
    ndim = len(shape)
    managed = DLManagedTensorVersioned() if versioned else DLManagedTensor()
    if versioned:
        managed.version.major, managed.version.minor = DLPACK_VERSION
        managed.flags = FLAG_READ_ONLY if readonly else 0
    shape_array = (c_int64 * max(ndim, 1))(*shape)
    strides_array = (c_int64 * max(ndim, 1))(*strides)
    tensor = managed.dl_tensor
    tensor.data = None if empty or not ptr else ptr
    tensor.byte_offset = 0 if empty else byte_offset
    tensor.device.device_type, tensor.device.device_id = int(device_type), int(device_id)
    tensor.ndim = ndim
    tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes = code, bits, lanes
    tensor.shape = ctypes.cast(shape_array, POINTER(c_int64))
    tensor.strides = ctypes.cast(strides_array, POINTER(c_int64))
    address = ctypes.addressof(managed)
    managed.manager_ctx = address
    managed.deleter = _DELETER_ADDRESS
    slots = (c_void_p(), c_void_p(), c_void_p())
    _exports[address] = (managed, shape_array, strides_array, (owner, pin),
                         slots + tuple(map(ctypes.byref, slots)))
    try:
        return _new_capsule(address, NAME_VERSIONED if versioned else NAME)
    except BaseException:
        _exports.pop(address, None)
        raise


@deferred
def _new_capsule(address: int, name: bytes):
    """The capsule of the export at ``address``, registered for its destructor, with signals
    deferred (r55): a capsule dropped before its registration (a Ctrl-C as PyCapsule_New
    returned) ran a destructor that could not find its export, and returned with the interrupt
    still pending (SystemError, then a crash as the interpreter unwound a cleared exception)."""
    capsule = _PyCapsule_New(address, name, _DESTRUCTOR)
    _capsules[id(capsule)] = address
    return capsule


def _pin_of(owner):
    """The accel.Buffer behind ``owner`` (itself, or its ``buffer`` as a typed view has) pinned
    for the export's life, so an explicit close() leaves the memory to the deleter."""
    from .buffer import Buffer
    buf = owner
    if not isinstance(buf, Buffer):
        try:
            buf = getattr(owner, "buffer", None)
        except Exception:
            return None
    return buf._pin() if isinstance(buf, Buffer) else None


def live_exports() -> int:
    """How many exported managed tensors have not been deleted yet (for tests and leak checks)."""
    return len(_exports)


def check_max_version(max_version) -> bool:
    """True when a consumer's ``max_version`` asks for a versioned capsule (``>= (1, 0)``);
    TypeError/ValueError for a malformed one."""
    if max_version is None:
        return False
    if isinstance(max_version, (str, bytes)) or not hasattr(max_version, "__len__") or len(max_version) != 2:
        raise TypeError(f"max_version must be None or a (major, minor) tuple of ints, got {max_version!r}")
    try:
        major, minor = (operator.index(v) for v in max_version)
    except TypeError:
        raise TypeError(f"max_version must be None or a (major, minor) tuple of ints, got {max_version!r}") from None
    if major < 0 or minor < 0 or isinstance(max_version[0], bool) or isinstance(max_version[1], bool):
        raise ValueError(f"max_version {max_version!r}: major and minor must be ints >= 0")
    return major >= 1


def check_legacy_read_only(versioned: bool, readonly: bool) -> None:
    """A legacy ``DLManagedTensor`` has no flags, so it cannot say the memory is read-only: a
    consumer would write to it.  Refused with BufferError, as numpy refuses to export a read-only
    array without a versioned capsule."""
    if readonly and not versioned:
        raise BufferError("cannot export read-only memory as a legacy DLPack capsule (DLManagedTensor has no "
                          "read-only flag, so the consumer would take it as writable): the consumer must ask "
                          "for a versioned capsule, __dlpack__(max_version=(1, 0)); or copy it into a new "
                          "Buffer (Buffer(n, device).copy_from(buf)) and export that")


def check_dl_device(dl_device, own: Tuple[int, int], copy) -> bool:
    """The array API standard's ``dl_device``/``copy`` rules.  True for the one copy accel makes
    on export, ``dl_device=(kDLCPU, 0)`` with ``copy=True`` (:func:`export_host_copy`); else False
    when the export is zero-copy.  Another ``copy=True`` and another device raise BufferError; a
    host device with ``copy=False`` raises ValueError (the standard's wording: a copy would be
    needed but is forbidden)."""
    if copy is not None and not isinstance(copy, bool):
        raise TypeError(f"copy must be None, True or False, got {copy!r}")
    if dl_device is not None:
        try:
            if any(isinstance(v, bool) for v in dl_device):
                raise TypeError     # (as max_version: a bool is no device type or id)
            kind, index = (operator.index(v) for v in dl_device)
        except (TypeError, ValueError):
            raise TypeError(f"dl_device must be None or a (device_type, device_id) tuple as __dlpack_device__ "
                            f"returns, got {dl_device!r}") from None
        if (kind, index) == (DLDeviceType.kDLCPU, 0) and copy is True:
            # array API __dlpack__: "The v2023.12 standard only mandates that a compliant library
            # should offer a way for __dlpack__ to return a capsule referencing an array whose
            # underlying memory is accessible to the Python interpreter (kDLCPU)", with copy=True
            # (numpy's from_dlpack(x, device="cpu", copy=True) asks exactly that)
            return True
        if (kind, index) != tuple(own):
            name = DLDeviceType(kind).name if kind in DLDeviceType._value2member_map_ else str(kind)
            if kind in HOST_DEVICE_TYPES and copy is False:
                raise ValueError(f"dl_device=({name}, {index}) needs a copy to host memory, but copy=False; "
                                 f"the buffer is device memory on {tuple(own)}")
            raise BufferError(f"cannot export to dl_device=({name}, {index}): the buffer lives on "
                              f"{(DLDeviceType(own[0]).name, own[1])} and accel does not copy on export; "
                              f"for host memory use buf.to_numpy(), for another device copy into a "
                              f"Buffer there (Buffer(n, device).copy_from(buf)) and export that")
    if copy:
        raise BufferError("copy=True: accel's __dlpack__ copies only to host memory (dl_device=(kDLCPU, 0)); "
                          "for a device copy make it explicitly (Buffer(buf.nbytes, buf.device).copy_from(buf)) "
                          "and export that buffer")
    return False


def export_host_copy(obj, buffer, stream_arg, versioned: bool):
    """``obj.__dlpack__(dl_device=(kDLCPU, 0), copy=True)`` (``obj`` a Buffer or a typed view of
    ``buffer``): a host copy of its elements after the buffer's queued work (waited for on the
    host: the consumer is the host), as numpy's kDLCPU capsule, flagged
    DLPACK_FLAG_BITMASK_IS_COPIED when versioned (array API: "When a copy happens, the
    DLPACK_FLAG_BITMASK_IS_COPIED flag must be set").  The copy is the consumer's alone: not
    read-only, nothing of accel is kept alive by it.  ``stream`` must be None or -1: the copy
    is done when this returns."""
    if stream_arg is not None and not (type(stream_arg) is int and stream_arg == -1):
        raise ValueError(f"stream={stream_arg!r} with dl_device=(kDLCPU, 0): a host copy needs no consumer "
                         f"stream (pass None or -1); accel waits for the buffer's work before copying")
    buffer._live()
    check_foreign_alive(buffer._last)
    last = buffer._last
    wait_for_stream(buffer._backend, last, "the buffer's last-use stream")
    order_after_other_uses(buffer, last, "host")      # (its other streams' work too: r73d)
    host = obj.to_numpy()
    capsule = host.__dlpack__(max_version=DLPACK_VERSION if versioned else None)
    if versioned:
        DLManagedTensorVersioned.from_address(parse(capsule).address).flags |= FLAG_IS_COPIED
    return capsule


def device_of(backend_name: str, index: int) -> Tuple[DLDeviceType, int]:
    """``__dlpack_device__`` of accel memory on ``backend_name``'s device ``index``."""
    try:
        return BACKEND_DEVICE_TYPES[backend_name], index
    except KeyError:
        raise BufferError(f"{backend_name} memory has no DLPack device type") from None


# -- stream handshake -------------------------------------------------------------------------
_CUDA_LEGACY, _CUDA_PER_THREAD = 1, 2    # cudaStreamLegacy, cudaStreamPerThread


def _consumer_handle(backend, index: int, stream_arg):
    """The consumer's stream as ``(device index, backend handle)``, ``"host"`` (wait on the host)
    or None for "no synchronization".  An int names a stream of the buffer's device ``index``
    (legacy and per-thread handles are the current device's); an accel.Stream its own device
    (every device's default stream has the same handle 0 on CUDA)."""
    from .streams import Stream, check_handle_bits, cuda_stream_handle
    if isinstance(stream_arg, Stream):
        if stream_arg._backend is not backend:
            raise ValueError(f"stream {stream_arg!r} belongs to {stream_arg._backend.name}, "
                             f"the buffer to {backend.name}")
        return stream_arg.device_index, stream_arg.handle
    if backend.name == "cuda" and stream_arg is not None and hasattr(stream_arg, "__cuda_stream__"):
        # (0, 0) is a default stream object's (torch, cuda.core): the legacy stream, as _ask maps it
        stream_arg = cuda_stream_handle(stream_arg, "stream") or _CUDA_LEGACY
    if stream_arg is None:
        return (index, backend.default_stream(index)) if backend.name == "cuda" else "host"
    if isinstance(stream_arg, bool) or not hasattr(type(stream_arg), "__index__"):
        raise TypeError(f"stream must be None, -1 or a stream handle (int), got "
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
    from .streams import Stream, _Hold
    buffer._live()
    with _Hold(stream_arg) if isinstance(stream_arg, Stream) else contextlib.nullcontext():
        _sync_for_consumer(buffer, stream_arg)


def _sync_for_consumer(buffer, stream_arg) -> None:
    from .streams import Stream, _hold_open, on_device
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
    from ._errors import CaptureError
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
    from ._errors import CaptureError
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
    from .streams import on_device
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
    from .streams import on_device
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
    from .streams import _hold_open
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
    from .streams import on_device
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
    from .streams import _hold_open, on_device
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
    from . import memory
    from .streams import on_device
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
    from .streams import _Hold, _hold_open, check_handle_bits, on_device
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
    from .streams import on_device
    with on_device(backend, device):
        return backend.capture_id(handle)


def _accel_stream(backend, index: int, handle: int):
    """The accel Stream a handle names on device ``index`` (its default or a live created
    stream), or None for a foreign stream."""
    from . import streams
    if handle == backend.default_stream(index):
        return streams.default_stream(index)
    stream = streams._live_streams.get((index, handle))
    return stream if stream is not None and not stream.closed else None


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
    from .buffer import Buffer
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
    from ._device import check_range
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
    from .streams import Stream, _Hold, cuda_stream_handle, current_stream
    consumer = None
    if (isinstance(stream, Stream) and stream._handle == 0 and device is not None and backend.name == "cuda"
            and stream._index != device[1]):
        # Another device's legacy default stream: DLPack's 1 ("the legacy default stream") would
        # name the producer's own device's (r65m: device 1's default stream was left unordered).
        # The producer orders its work before its device's current stream instead, and the
        # requested stream waits for that one.
        consumer, stream = stream, None
    if stream is None and device is not None and backend.name == "cuda":
        from ._device import check_range
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
