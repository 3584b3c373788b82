"""The system device: MTLCreateSystemDefaultDevice, MTLDevice, and how many devices there are.

Metal exposes one system default device (none when ``ACCEL_SIM_DEVICES=0``):
:class:`SimMetalLibrary` is Metal.framework's C functions, and
``MTLCreateSystemDefaultDevice`` gives its caller +1 on the one :class:`MTLDevice`.  The
device answers its properties (the recommended working set is ``ACCEL_SIM_MEMORY``), makes
command queues (:mod:`.commands`) and shared events (:mod:`.events`); it makes buffers
through the :class:`accel.sim.metal.buffers._DeviceBuffers` mixin and libraries and
pipelines through :class:`accel.sim.metal.compiler._DeviceCompiler`, so each concern's rules
stay in its module.
"""

from __future__ import annotations

from .. import core
from .buffers import _DeviceBuffers, max_buffer_length
from .commands import MTLCommandQueue
from .compiler import _DeviceCompiler
from .events import MTLSharedEvent
from .objects import NSString, SimObject
from .rules import MetalValidationError, _forked
from .runtime import _State


class MTLDevice(_DeviceBuffers, _DeviceCompiler, SimObject):
    cls_name = "AGXSimDevice"

    def __init__(self, rt):
        super().__init__(rt)
        self.allocated = 0
        self.allocations = 0

    def m_name(self):
        return self.rt.autorelease(NSString(self.rt, "Apple M-sim (accel simulator)"))

    def m_registryID(self):
        return 0x100000A5C

    def m_recommendedMaxWorkingSetSize(self):
        return core.config().memory

    def m_currentAllocatedSize(self):
        return self.allocated

    def m_hasUnifiedMemory(self):
        return 1

    def m_maxBufferLength(self):
        return max_buffer_length()

    def m_newCommandQueue(self):
        return MTLCommandQueue(self.rt, self)

    def m_newSharedEvent(self):
        return MTLSharedEvent(self.rt)


class SimMetalLibrary:
    """Metal.framework's C functions."""

    def __init__(self, rt: _State):
        self._rt = rt

    @core.deferred
    def MTLCreateSystemDefaultDevice(self):
        rt = self._rt
        if rt.forked:
            _forked("MTLCreateSystemDefaultDevice through the parent's Metal")
        rt.runtime_initialized = True
        if device_count() < 1:
            return rt.ffi.cast("void *", 0)
        with rt.lock:
            # One system device; ns_returns_retained: every call gives the caller +1.
            if rt.device is None or rt.device.rc <= 0:
                rt.device = MTLDevice(rt)
            else:
                rt.retain(rt.device)
            return rt.ffi.cast("void *", rt.device.addr)

    def MTLCopyAllDevices(self):
        raise MetalValidationError("MTLCopyAllDevices: not simulated (the backend uses the default device)")


def device_count() -> int:
    """Devices the simulated Metal exposes: Metal has one system default device (0 if configured so)."""
    return min(core.config().devices, 1)
