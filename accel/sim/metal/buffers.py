"""MTLBuffer, and the MTLDevice messages that make buffers, with the storage rules they check.

A buffer is host memory from the shared simulator allocator (:mod:`accel.sim._memory`),
zeroed, entered in the runtime's memory table so kernel references range-check what they
touch; ``currentAllocatedSize`` counts it in whole pages.  ``newBufferWithLength:options:``
and ``newBufferWithBytes:length:options:`` (the :class:`_DeviceBuffers` mixin of
:class:`accel.sim.metal.device.MTLDevice`) refuse undefined ``MTLResourceOptions`` and the
modes the simulator cannot check (managed storage, untracked hazards), and answer nil past
:func:`max_buffer_length`, past the working set, or on an injected fault.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _memory, core
from .objects import SimObject
from .rules import PAGE, MetalValidationError

if TYPE_CHECKING:
    from .device import MTLDevice


class MTLBuffer(SimObject):
    cls_name = "MTLBuffer"

    def __init__(self, rt, device: "MTLDevice", length: int, private: bool = False):
        super().__init__(rt)
        self.device = device
        self.length = length
        self.private = private
        self.size = -(-length // PAGE) * PAGE  # what currentAllocatedSize counts
        # Host memory from the shared simulator allocator, in a table so kernel
        # references (accel.sim.kernels.view) can range-check what they touch.
        # MTLDevice newBufferWithLength:options: "Creates a buffer the method clears with zero values"
        self.alloc = _memory.allocate(length, _memory.DEVICE, 0, zeroed=True)
        self.base = self.alloc.base
        rt.table.add(self.alloc)
        device.allocated += self.size

    def dealloc(self):
        self.device.allocated -= self.size
        self.rt.table.remove(self.alloc)  # queued commands keep the memory itself alive

    def m_contents(self):
        # MTLBuffer contents: "... or NULL for buffers allocated with a private resource storage mode"
        return None if self.private else self.base

    def m_length(self):
        return self.length

    def view(self, offset: int, n: int):
        return core.ffi.buffer(_memory.char_ptr(self.base + offset), n)


class _DeviceBuffers:
    """MTLDevice's messages that make buffers (a mixin of :class:`accel.sim.metal.device.MTLDevice`)."""

    def _buffer(self, length, options):
        if options & 0xF0 not in (0x00, 0x10, 0x20):  # storage mode shared/managed/private
            raise MetalValidationError(f"newBuffer: invalid storage mode in options {options:#x}")
        if options & ~0x3FF or options & 0xF > 1 or (options >> 8) & 3 == 3:
            # MTLResourceOptions: CPU cache mode 0-1 (bits 0-3), storage mode (bits 4-7), hazard
            # tracking mode 0-2 (bits 8-9); any other value is undefined: refused
            raise MetalValidationError(f"newBuffer: undefined MTLResourceOptions bits in {options:#x}")
        if (options >> 8) & 3 == 1:
            # MTLResourceHazardTrackingModeUntracked (1 << 8): "Metal doesn't track memory
            # dependencies for untracked resources, which means you're responsible for ensuring
            # that commands access those resources safely with barriers, fences, or events"
            # (MTLHazardTrackingMode.untracked). The simulator runs every command in order, as if
            # tracked, so it could not show a missing fence: not simulated, refused.
            raise MetalValidationError("newBuffer: MTLResourceHazardTrackingModeUntracked is not simulated (the "
                                       "simulator orders every command as if tracked, so it cannot check your "
                                       "fences); use the default or tracked hazard tracking mode")
        if options & 0xF0 == 0x10:
            # MTLStorageModeManaged: didModifyRange: must announce CPU writes before the GPU reads
            # them ("... the behavior is undefined"); the simulator cannot see CPU writes
            raise MetalValidationError("newBuffer: MTLStorageModeManaged is not simulated (the simulator cannot "
                                       "check didModifyRange:); use shared or private storage")
        if length == 0:
            raise MetalValidationError("newBuffer: length must be greater than 0")
        self.allocations += 1
        if core.take_oom() or core.take_fault("newBufferWithLength:options:"):
            return None
        if length > max_buffer_length():
            # MTLDevice.maxBufferLength: "the largest amount of memory, in bytes, that a single
            # buffer can allocate"; newBufferWithLength:options: answers nil beyond it.
            return None
        size = -(-length // PAGE) * PAGE
        limit = core.config().memory
        if self.allocated + size > limit:
            return None  # Metal answers nil when it cannot back the buffer
        return MTLBuffer(self.rt, self, length, private=options & 0xF0 == 0x20)

    def m_newBufferWithLength_options_(self, length, options):
        return self._buffer(length, options)

    def m_newBufferWithBytes_length_options_(self, ptr, length, options):
        if not ptr:
            # "pointer: A pointer to the starting memory address the method copies the
            # initialization data from"
            raise MetalValidationError("newBufferWithBytes:length:options: pointer is NULL")
        if options & 0xF0 == 0x20:
            # The method "initializes its contents by copying existing data into it" on the CPU,
            # and a private buffer's storage is not the CPU's (MTLBuffer.contents: "Private
            # resources aren't CPU-accessible"). The documentation is silent on private storage
            # here (Metal's API validation asserts); the simulator refuses rather than copy.
            raise MetalValidationError("newBufferWithBytes:length:options: private storage cannot be "
                                       "initialized from CPU bytes; make a shared buffer and blit it")
        buf = self._buffer(length, options)
        if buf is not None:
            buf.view(0, length)[:] = self.rt.ffi.buffer(self.rt.ffi.cast("char *", ptr), length)
        return buf


def max_buffer_length() -> int:
    """MTLDevice.maxBufferLength: 3/4 of the working set, whole pages. Apple does not fix the ratio;
    real devices report less than recommendedMaxWorkingSetSize, so one buffer cannot take it all."""
    return core.config().memory * 3 // 4 // PAGE * PAGE or PAGE
