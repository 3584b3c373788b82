"""The DLPack ABI, laid out by ``ctypes``: dlpack.h's enums, structs, flags and dtype codes, and
the CPython capsule API both sides call.

The structs are dlpack.h's (DLPack 1.1 header; ``DLManagedTensorVersioned`` since 1.0, the legacy
``DLManagedTensor`` before): ``DLDevice``, ``DLDataType``, ``DLTensor``, the managed tensors and
``DLPackVersion``.  ``DELETER`` is the managed tensor's deleter type, ``CAPSULE_DESTRUCTOR``
``PyCapsule_Destructor``.  The ``PyCapsule_*`` prototypes are accel's own over
``ctypes.pythonapi``; the capsule names are ``"dltensor[_versioned]"``, ``"used_…"`` once taken.
:func:`dl_dtype` maps a numpy dtype to ``(code, bits, lanes)``.  Nothing here holds state.
"""

from __future__ import annotations

import ctypes
import enum
from ctypes import POINTER, c_char_p, c_int, c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p
from typing import Tuple

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
