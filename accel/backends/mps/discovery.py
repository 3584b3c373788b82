"""Discovery: loading the libraries, counting, ``report``, init (the one device), its properties
and the current device (always 0).

Metal exposes one device, the system default (index 0).  Counting only loads libobjc and
Metal: ``MTLCreateSystemDefaultDevice`` starts Metal's services, which do not survive
``fork``, so the device is created by :meth:`DiscoveryMixin.init` alone, with the default
stream's command queue and the scratch buffer that timing events fill.
"""

from __future__ import annotations

from ..._errors import AcceleratorError
from .. import _objc
from .._signals import deferred
from ..base import DeviceProperties
from ._library import _LIBRARY, M_HAS_UNIFIED, M_MAX_BUFFER_LENGTH, M_NAME, M_NEW_QUEUE, M_RECOMMENDED_MAX, \
    M_REGISTRY_ID, _InvalidHandle, _Libraries
from .streams import _Stream

_SUPPORTED_DTYPES = frozenset({"bool", "uint8", "int8", "int16", "int32", "int64",
                               "float16", "float32"})  # Metal has no float64


class DiscoveryMixin:
    """Libraries (``_libs``), count, report, init/device creation (``_device``), properties."""

    def _libraries(self) -> _Libraries:
        if self._libs is None:
            with self._lock:
                if self._libs is None:
                    self._libs = _Libraries()
        return self._libs

    def loads(self) -> bool:
        return self._libraries().ok

    def count(self) -> int:
        """1 when libobjc and Metal load (every Mac that runs them has a Metal GPU), else 0.

        The device itself is created only by :meth:`init`:
        ``MTLCreateSystemDefaultDevice`` starts Metal's services, which do not
        survive ``fork``.  The simulator reports its configured device count
        (at most 1).
        """
        libs = self._libraries()
        if not libs.ok:
            return 0
        if libs.simulated:
            from accel.sim import metal as sim_metal
            return sim_metal.device_count()
        return 1

    def report(self) -> dict:
        try:
            libs = self._libraries()
            out = {"backend": self.name, "simulated": libs.simulated, "libraries": dict(libs.paths),
                   "count": self.count(),
                   "count_method": ("simulator configuration" if libs.simulated else
                                    "libobjc and Metal.framework load (the device is created at init)")}
            if libs.reason:
                out["reason"] = libs.reason
                out["load_error"] = libs.load_error
            elif out["count"] == 0:
                out["reason"] = "the Metal simulator is configured with 0 devices (ACCEL_SIM_DEVICES=0)"
            out["initialized"] = self._device is not None
            out["graphs"] = "not supported (Metal has no stream capture)"
            return out
        except Exception as exc:  # report() never raises
            return {"backend": self.name, "count": 0, "reason": f"mps report failed: {exc!r}"}

    # -- runtime ----------------------------------------------------------------
    def init(self) -> None:
        with self._lock:
            if self._device is not None:
                return
            libs = self._libraries()
            if not libs.ok:
                raise AcceleratorError(f"mps: cannot initialize Metal: {libs.reason}",
                                       library=_LIBRARY, call="MTLCreateSystemDefaultDevice")
            self._make_device(libs)

    @deferred
    def _make_device(self, libs) -> None:
        # (signals deferred: a KeyboardInterrupt as a make returned, before its store, leaked the
        # device's +1, the default queue or the scratch buffer, r70i; nothing here waits)
        rt = _objc.Runtime(libs.objc_ffi, libs.objc_lib)
        # MTLCreateSystemDefaultDevice returns +1 (ns_returns_retained).  The
        # real loader opens CoreGraphics first: without it the call returns
        # nil in processes that are not apps.
        device = libs.metal_lib.MTLCreateSystemDefaultDevice()
        if device == rt.nil:
            raise AcceleratorError(
                "mps: MTLCreateSystemDefaultDevice returned nil: this Mac exposes no Metal device "
                "(a VM or a headless session without GPU access?)",
                library=_LIBRARY, call="MTLCreateSystemDefaultDevice")
        self._rt, self._device = rt, device
        self.driver_started = True   # Metal does not survive fork from here on
        try:
            with rt.pool():
                self._streams[0] = _Stream(0, self._new(device, M_NEW_QUEUE, "newCommandQueue"))
                self._scratch = self._new_buffer(4, host=False, register=False)
        except BaseException:
            self.close()
            raise

    @deferred
    def properties(self, index: int) -> DeviceProperties:
        self._check_index(index)
        # Under the lock: close() in another thread releases the MTLDevice under it, and a message
        # to a released object crashes the process (NSZombie: "message sent to deallocated
        # instance"); after a close, _runtime() raises the not-initialized error instead.
        with self._lock:
            rt = self._runtime()
            dev = self._device
            with rt.pool():
                name = rt.string(rt.send(dev, M_NAME))
                registry = int(rt.send(dev, M_REGISTRY_ID))
                total = int(rt.send(dev, M_RECOMMENDED_MAX))
                unified = bool(rt.send(dev, M_HAS_UNIFIED))
                max_buffer = int(rt.send(dev, M_MAX_BUFFER_LENGTH))
        return DeviceProperties(
            index=0, name=name, total_memory=total, compute_capability=(0, 0),
            multi_processor_count=0, supported_dtypes=_SUPPORTED_DTYPES,
            uuid=None, unified_memory=unified,     # Metal has no device UUID: the registry id is extra
            extra={"registry_id": registry, "max_buffer_length": max_buffer,
                   "recommended_max_working_set_size": total})

    def _check_index(self, index: int) -> None:
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"device index must be an int, got {type(index).__name__}")
        if index != 0:
            raise _InvalidHandle(f"mps: invalid device index {index}; Metal exposes one device (index 0)")

    def set_device(self, index: int) -> None:
        self._check_index(index)

    def get_device(self) -> int:
        return 0
