"""What a copy's source or destination is, and how accel reads it.

A *host* object is anything with a buffer (``memoryview``): a numpy array (datetime64 and
timedelta64 ones as their integers), bytes, bytearray, a pinned :func:`accel.empty_pinned`
array; it must be C-contiguous and hold plain numbers (a dtype with Python object references
is refused: its bytes are ``PyObject*`` addresses), and is read as one contiguous span of bytes
at its address.  A DLPack object in host memory (a torch CPU tensor) is read through
``numpy.from_dlpack``.  A C-contiguous :class:`accel.ArrayView` is a span of its own Buffer.

A *foreign device* source is another library's device array: ``__cuda_array_interface__``
(parsed here: pointer, size, producer stream; C-contiguous and unmasked only) or ``__dlpack__``
not in host memory.  A foreign range wrapped as a Buffer (``from_ptr``, ``from_dlpack``) is
checked to be device memory of the device named, where the backend can tell.
"""

from __future__ import annotations

import operator
import re

from ..streams import Stream


_FIELD_NAMES = re.compile(r":[^:]*:")   # struct-format field names, e.g. T{<q:a:O:b:}
_ADDRESS_LIMIT = 1 << 64         # device addresses are 64-bit pointers


def _check_plain(obj, view, what: str) -> None:
    """Refuse buffers holding Python object references: their bytes are PyObject* addresses,
    so copying device bytes into them (or uploading them) corrupts the interpreter."""
    dtype = getattr(obj, "dtype", None)
    if getattr(dtype, "hasobject", False) or "O" in _FIELD_NAMES.sub("", view.format):
        shown = dtype if dtype is not None else f"format {view.format!r}"
        raise TypeError(f"cannot copy {what} an array of dtype {shown}: it holds Python object references, "
                        f"not data; use an array of plain numbers (e.g. numpy.float32 or uint8); "
                        f"nothing was copied")


def _memoryview(obj) -> memoryview:
    """``memoryview(obj)``; a numpy datetime64/timedelta64 array, for which numpy gives no buffer
    ("cannot include dtype 'M' in a buffer"), as a view of its integers (same bytes, strides and
    read-only flag)."""
    try:
        return memoryview(obj)
    except ValueError:
        dtype = getattr(obj, "dtype", None)
        if getattr(dtype, "kind", None) not in ("M", "m") or not hasattr(obj, "view"):
            raise
        return memoryview(obj.view(f"i{dtype.itemsize}"))


def _host_view(src):
    """A read-only contiguous byte memoryview of a host object, or a clear error."""
    try:
        view = _memoryview(src)
    except TypeError:
        raise TypeError(f"cannot copy from {type(src).__name__}: expected a numpy array, an accel.Buffer, "
                        f"or a bytes-like object") from None
    _check_plain(src, view, "from")
    if not view.c_contiguous:
        raise ValueError("source array is not C-contiguous; pass numpy.ascontiguousarray(a) "
                         "(nothing was copied)")
    if not view.nbytes:
        return memoryview(b"")      # (cast() refuses a shape with a 0 in it: "zero-length" dimensions)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _address(view) -> int:
    from .._hostmem import address_of
    return address_of(view)


def _is_host_object(obj) -> bool:
    try:
        _memoryview(obj)
    except TypeError:
        return False
    return True


def _dlpack_host(obj) -> bool:
    """True for an object whose DLPack device is host memory (a torch CPU tensor)."""
    device = getattr(obj, "__dlpack_device__", None)
    if device is None or not hasattr(obj, "__dlpack__"):
        return False
    from .._dlpack import HOST_DEVICE_TYPES
    try:
        return device()[0] in HOST_DEVICE_TYPES
    except Exception:
        return False


def _numpy_from_dlpack(obj):
    """``numpy.from_dlpack(obj)`` for a host DLPack object (a torch CPU tensor); a dtype numpy
    has not (bfloat16, float8) is refused naming the integer view that copies the same bytes."""
    import numpy as np
    try:
        return np.from_dlpack(obj)
    except RuntimeError as exc:
        if "dtype" not in str(exc):
            raise
        dtype = getattr(obj, "dtype", "?")
        size = getattr(obj, "element_size", lambda: None)()
        view = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}.get(size, "uint8")
        raise TypeError(f"cannot copy from {type(obj).__name__} of dtype {dtype}: numpy.from_dlpack cannot "
                        f"read it ({exc}); copy the same bytes through an integer view, e.g. "
                        f"t.view(torch.{view}); nothing was copied") from None


def _own_region(obj):
    """``(buffer, offset, nbytes)`` when ``obj`` is a C-contiguous :class:`accel.ArrayView`
    (its elements are one span of its Buffer), else None."""
    from .._array import ArrayView
    if type(obj) is ArrayView and obj.c_contiguous:
        return obj.buffer, obj.offset, obj.nbytes
    return None


def _device_source(obj, index: int):
    """Another library's device array for copy_from: ``("cai", interface, obj)`` for an object
    exporting ``__cuda_array_interface__``, ``("dlpack", None, obj)`` for one with ``__dlpack__``
    not in host memory, None for host objects (and anything else, which the host path refuses)."""
    if _is_host_object(obj):
        return None
    try:
        cai = obj.__cuda_array_interface__
    except AttributeError:
        cai = None
    if cai is not None:
        return ("cai", cai, obj)
    if hasattr(obj, "__dlpack__") and not _dlpack_host(obj):
        return ("dlpack", None, obj)
    return None


def _cai_typestr(cai) -> str:
    """A __cuda_array_interface__'s ``typestr``; TypeError when it is no string (np.dtype(None)
    is float64: a missing type must not read as one)."""
    typestr = cai["typestr"]
    if not isinstance(typestr, str):
        raise TypeError(f"typestr {typestr!r} is not a string such as '<f4'")
    return typestr


def _parse_cai(cai, what: str):
    """``(ptr, nbytes, producer stream or None)`` of a C-contiguous __cuda_array_interface__."""
    import numpy as np
    try:
        shape = tuple(operator.index(n) for n in cai["shape"])
        itemsize = np.dtype(_cai_typestr(cai)).itemsize
        ptr = operator.index(cai["data"][0])
    except (KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"{what}.__cuda_array_interface__ is malformed ({exc!r}); nothing was copied") from None
    if cai.get("mask") is not None:
        raise ValueError(f"{what}.__cuda_array_interface__ has a mask; copy_from takes unmasked arrays only")
    count = 1
    for n in shape:
        count *= n
    strides = cai.get("strides")
    if strides is not None and len(tuple(strides)) != len(shape):
        raise ValueError(f"{what}.__cuda_array_interface__ is malformed: strides {tuple(strides)} for shape {shape} "
                         f"(one stride per dimension, as numpy requires); nothing was copied")
    if strides is not None and count:
        step = itemsize
        for n, s in zip(reversed(shape), reversed(tuple(strides))):
            if n != 1 and s != step:
                raise ValueError(f"{what} is not C-contiguous (strides {tuple(strides)} for shape {shape}); "
                                 f"copy_from needs contiguous memory: make a contiguous copy first")
            step *= n
    try:
        version = operator.index(cai.get("version", 0))
    except TypeError:
        raise ValueError(f"{what}.__cuda_array_interface__ is malformed: its version is {cai.get('version')!r}, "
                         f"not an int; nothing was copied") from None
    stream = cai.get("stream") if version >= 3 else None
    return ptr, count * itemsize, stream


def _order_producer_after(backend, index: int, producer, stream: Stream) -> None:
    from .._dlpack import order_producer_after
    order_producer_after(backend, index, producer, stream)


def _check_device_range(backend, ptr: int, nbytes: int, index: int) -> None:
    """Refuse a foreign range that is not device memory of device ``index``, where the backend
    can tell (``Backend.pointer_location``); otherwise the caller's word is taken."""
    if ptr < 0 or ptr + nbytes > _ADDRESS_LIMIT:
        # a C cast keeps the low 64 bits: the runtime would be asked about another address
        raise ValueError(f"cannot wrap {nbytes} bytes at {ptr:#x}: the range reaches outside the 64-bit address "
                         f"space; pass the address and size of a live device allocation; nothing was wrapped")
    name = backend.name
    for addr in (ptr, ptr + nbytes - 1):
        where = backend.pointer_location(addr)
        if where is None:
            return
        kind, dev = where
        if kind == "device" and dev == index:
            continue
        end = "start" if addr == ptr else f"last byte ({addr:#x})"
        if kind == "device":
            what, fix = f"device memory of {name}:{dev}", f"pass device={dev}"
        elif kind in ("host", "managed"):
            what = "pinned host memory" if kind == "host" else f"managed memory of {name}:{dev}"
            fix = "copy host data with Buffer.copy_from instead of wrapping it"
        else:
            what = f"not memory the {name} runtime knows (freed, host, or past the end of its allocation)"
            fix = "pass the address and size of a live device allocation"
        raise ValueError(f"cannot wrap {nbytes} bytes at {ptr:#x} as device memory of {name}:{index}: its "
                         f"{end} is {what}; {fix}; nothing was wrapped")
