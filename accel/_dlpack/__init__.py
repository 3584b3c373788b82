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

The package, one module per concern, each with its part of the design in its docstring:

* :mod:`.abi`: dlpack.h's enums, structs, flags and dtype codes (:func:`dl_dtype`), the capsule
  names and accel's prototypes of the CPython capsule API;
* :mod:`.exporting`: the producer, :func:`export`, the live exports and capsules and their
  deleter and destructor, the checks of ``__dlpack__``'s arguments and the copies made on
  export (:func:`export_host_copy`, :func:`export_device_copy`);
* :mod:`.ordering`: the stream ordering between producer and consumer that DLPack and
  ``__cuda_array_interface__`` share (:func:`sync_for_consumer`,
  :func:`order_after_other_uses`, the host waits, :func:`wait_for_producer`,
  :func:`order_producer_after`) and the refusals of what would invalidate a capture;
* :mod:`.importing`: the consumer, :func:`parse`, :class:`Tensor`, :class:`Imported`,
  :func:`from_dlpack` and the ask of a producer (``_ask``).

This module exports the names the rest of accel and its tests take from ``accel._dlpack`` (the
tables ``_exports`` and ``_capsules`` are the shared objects themselves, never rebound).
``_take_lock`` is not among them: it is made anew in a forked child, so it is read through
:mod:`.importing`.  A monkeypatch must patch the module whose code looks the name up
(``from_dlpack``'s callees: :mod:`.importing`; ``export_host_copy``'s: :mod:`.exporting`).
"""

from __future__ import annotations

from . import abi, exporting, importing, ordering

# The names the rest of accel (and its tests) take from accel._dlpack: each the one object its
# module defines.
DLPACK_VERSION, FLAG_READ_ONLY, FLAG_IS_COPIED = abi.DLPACK_VERSION, abi.FLAG_READ_ONLY, abi.FLAG_IS_COPIED
DLDeviceType, BACKEND_DEVICE_TYPES = abi.DLDeviceType, abi.BACKEND_DEVICE_TYPES
HOST_DEVICE_TYPES, DELETER = abi.HOST_DEVICE_TYPES, abi.DELETER
DLManagedTensor, DLManagedTensorVersioned = abi.DLManagedTensor, abi.DLManagedTensorVersioned
NAME, NAME_VERSIONED = abi.NAME, abi.NAME_VERSIONED
USED_NAME, USED_NAME_VERSIONED = abi.USED_NAME, abi.USED_NAME_VERSIONED
_PyCapsule_GetName, _PyCapsule_GetPointer = abi._PyCapsule_GetName, abi._PyCapsule_GetPointer
_PyCapsule_SetName, dl_dtype = abi._PyCapsule_SetName, abi.dl_dtype
export, live_exports, device_of = exporting.export, exporting.live_exports, exporting.device_of
_exports, _capsules = exporting._exports, exporting._capsules
check_max_version, check_dl_device = exporting.check_max_version, exporting.check_dl_device
check_legacy_read_only, export_host_copy = exporting.check_legacy_read_only, exporting.export_host_copy
export_copy, export_device_copy = exporting.export_copy, exporting.export_device_copy
sync_for_consumer, order_after_other_uses = ordering.sync_for_consumer, ordering.order_after_other_uses
wait_for_closed, wait_for_stream, check_foreign_alive = (ordering.wait_for_closed, ordering.wait_for_stream,
                                                         ordering.check_foreign_alive)
wait_for_producer, order_producer_after = ordering.wait_for_producer, ordering.order_producer_after
Tensor, parse, Imported, from_dlpack = importing.Tensor, importing.parse, importing.Imported, importing.from_dlpack
to_address, _ask, _c_contiguous = importing.to_address, importing._ask, importing._c_contiguous
_device_pair, _check_device_type = importing._device_pair, importing._check_device_type

__all__ = ["DLDeviceType", "export", "parse", "Imported", "DLPACK_VERSION", "sync_for_consumer",
           "device_of", "from_dlpack", "check_max_version", "check_dl_device", "export_host_copy",
           "export_device_copy", "export_copy"]
