"""The producer: :func:`export` makes a capsule, its deleter and destructor free it once.

The managed tensor, its shape and strides arrays live in ctypes objects held in :data:`_exports`
(keyed by the struct's address) together with ``owner`` and the pin of its buffer;
:data:`_capsules` maps a live capsule to its entry for the destructor.  The deleter
(``_on_delete``) pops the entry, with no lock; the destructor (``_on_capsule_free``) calls it
only for a capsule still named ``"dltensor[_versioned]"`` (dropped unconsumed).  Both callbacks
and the capsule names are immortal.  Also the checks of a consumer's ``__dlpack__`` arguments
(:func:`check_max_version`, :func:`check_dl_device`, :func:`check_legacy_read_only`), the
copies accel makes on export (:func:`export_host_copy`, :func:`export_device_copy`) and
:func:`device_of`.  The stream
handshake is :mod:`.ordering`'s.
"""

from __future__ import annotations

import ctypes
import operator
from ctypes import POINTER, c_int64, c_void_p
from typing import Any, Dict, Optional, Tuple

from .. import _lazy
from ..backends._signals import deferred
from .abi import (
    _INT64_LIMIT, BACKEND_DEVICE_TYPES, CAPSULE_DESTRUCTOR, DELETER, DLPACK_VERSION, FLAG_IS_COPIED, FLAG_READ_ONLY,
    HOST_DEVICE_TYPES, NAME, NAME_VERSIONED, USED_NAME, USED_NAME_VERSIONED, DLDeviceType, DLManagedTensor,
    DLManagedTensorVersioned, _Py_IncRef, _PyCapsule_IsValid_raw, _PyCapsule_New, _PyErr_Fetch, _PyErr_Restore,
    dl_dtype)
from .importing import parse
from .ordering import (_consumer_handle, _refuse_waiting_on_capture, check_foreign_alive, order_after_other_uses,
                       sync_for_consumer, wait_for_stream)

#: Live exports: struct address -> (struct, shape array, strides array, owner, error slots).
_exports: Dict[int, tuple] = {}
#: Live capsules: capsule address -> struct address (the destructor's way to the entry).
_capsules: Dict[int, int] = {}

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
    from ..buffer import Buffer
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


def check_dl_device(dl_device, own: Tuple[int, int], copy) -> Optional[str]:
    """The array API standard's ``dl_device``/``copy`` rules: None when the export is zero-copy,
    ``"host"`` for a host copy (``dl_device=(kDLCPU, 0)`` with ``copy`` None or True:
    :func:`export_host_copy`), ``"device"`` for a copy on the buffer's own device (``copy=True``:
    :func:`export_device_copy`).  Another device raises BufferError; a host device with
    ``copy=False`` raises ValueError (the standard's wording: a copy would be needed but is
    forbidden)."""
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
        if (kind, index) == (DLDeviceType.kDLCPU, 0) and copy is not False:
            # array API __dlpack__: "The v2023.12 standard only mandates that a compliant library
            # should offer a way for __dlpack__ to return a capsule referencing an array whose
            # underlying memory is accessible to the Python interpreter (kDLCPU)"; copy None: "must
            # reuse the existing memory buffer if possible and copy otherwise" (numpy's
            # from_dlpack(x, device="cpu") asks exactly that; torch copies too: r80b)
            return "host"
        if (kind, index) != tuple(own):
            name = DLDeviceType(kind).name if kind in DLDeviceType._value2member_map_ else str(kind)
            if kind in HOST_DEVICE_TYPES and copy is False:
                raise ValueError(f"dl_device=({name}, {index}) needs a copy to host memory, but copy=False; "
                                 f"the buffer is device memory on {tuple(own)}")
            raise BufferError(f"cannot export to dl_device=({name}, {index}): the buffer lives on "
                              f"{(DLDeviceType(own[0]).name, own[1])} and accel copies on export only to "
                              f"(kDLCPU, 0) or its own device; for another device copy into a Buffer there "
                              f"(Buffer(n, device).copy_from(buf)) and export that")
    # array API __dlpack__, copy: "If True, the function must always copy (performed by the
    # producer)" (torch clones) (r80b)
    return "device" if copy else None


def export_copy(kind: str, obj, buffer, stream_arg, versioned: bool):
    """The copy :func:`check_dl_device` asked for (``kind``), of ``obj`` (a Buffer or a typed view
    of ``buffer``), exported."""
    if kind == "host":
        return export_host_copy(obj, buffer, stream_arg, versioned)
    return export_device_copy(obj, buffer, stream_arg, versioned)


def _flag_copied(capsule, versioned: bool):
    # array API __dlpack__: "When a copy happens, the DLPACK_FLAG_BITMASK_IS_COPIED flag must be set"
    if versioned:
        DLManagedTensorVersioned.from_address(parse(capsule).address).flags |= FLAG_IS_COPIED
    return capsule


def export_device_copy(obj, buffer, stream_arg, versioned: bool):
    """``obj.__dlpack__(copy=True)`` on the buffer's own device (``obj`` a Buffer or a typed view of
    ``buffer``): a new Buffer there holding a copy of the elements (a view's in C order), made
    on the device's current stream after the buffer's queued work and exported as any Buffer (the
    consumer's ``stream`` waits for the copy), flagged IS_COPIED when versioned.  Not read-only:
    the copy is the consumer's alone; the capsule keeps it alive until the deleter runs."""
    from ..buffer import Buffer
    from ..streams import current_stream
    backend, index = buffer._backend, buffer._index
    consumer = _consumer_handle(backend, index, stream_arg)   # a bad stream is refused before anything is made
    stream = current_stream(index)
    if backend.captures_underway() and stream._capturing():
        # the copy is captured, ordered on the capturing stream only, as Buffer.copy_from's (and
        # torch's clone in a capture); the consumer's handshake with it is checked first, so a
        # refused one leaves nothing captured (r81a)
        if consumer is not None:
            _refuse_waiting_on_capture(backend, stream, consumer)
    else:
        sync_for_consumer(buffer, stream)      # the copy reads after the buffer's queued work
    new = Buffer(obj.nbytes, device=index)
    try:
        if obj is buffer:
            out = new.copy_from(buffer, stream=stream, non_blocking=True)
        else:
            out = new.as_array(obj.dtype, obj.shape).copy_from(obj, stream=stream)
        capsule = out.__dlpack__(stream=stream_arg, max_version=DLPACK_VERSION if versioned else None)
    except BaseException:
        new.close()
        raise
    return _flag_copied(capsule, versioned)


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
    return _flag_copied(host.__dlpack__(max_version=DLPACK_VERSION if versioned else None), versioned)


def device_of(backend_name: str, index: int) -> Tuple[DLDeviceType, int]:
    """``__dlpack_device__`` of accel memory on ``backend_name``'s device ``index``."""
    try:
        return BACKEND_DEVICE_TYPES[backend_name], index
    except KeyError:
        raise BufferError(f"{backend_name} memory has no DLPack device type") from None
