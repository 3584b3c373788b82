"""What the simulated Metal refuses, and the limits it checks, with Apple's words for each.

A call Metal's API validation would reject (a Mac aborts the process) raises
:class:`MetalValidationError`; a Metal object inherited through ``fork`` raises
:class:`MetalForkError` (:func:`_forked`; which objects are Metal's: ``_METAL_PREFIXES``).
The documented limits (page size, uncompleted command buffers, threadgroup memory and
indices, threads per threadgroup, buffer indices) are here, each beside its source; the
rules that use them keep their own citations in the modules that apply them.  Fault
injection: :data:`NIL_ON_FAULT` (the ``nullable`` messages ``inject_error`` makes answer nil)
and :data:`COUNTED` (the messages counted in ``accel.sim.calls()``).  :func:`_as` refuses an
argument that is not the object the method takes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .runtime import _State


PAGE = 16384  # Apple silicon page: Metal rounds allocations and aligns contents to it
#: Deallocated addresses remembered for "message sent to deallocated instance" (as NSZombie does);
#: older ones still fail, as "not an Objective-C object". Bounded: no state per dead object.
ZOMBIES_KEPT = 1024
_MAX_UNCOMPLETED = 64               # MTLDevice newCommandQueue: "up to 64 uncompleted command buffers"
_MAX_THREADGROUP_INDEX = 31         # threadgroup memory indices taken (undocumented: as buffer indices)
MAX_THREADGROUP_MEMORY = 32 * 1024  # MTLDevice.maxThreadgroupMemoryLength on Apple GPU families
_MAX_THREADS_PER_GROUP = 1024
_MAX_BUFFER_INDEX = 31


class MetalValidationError(AssertionError):
    """A call Metal's API validation would reject (a Mac aborts the process)."""


class MetalForkError(MetalValidationError):
    """A Metal object inherited from the parent was used in a forked child (a Mac crashes)."""


_METAL_PREFIXES = ("MTL", "AGX")

#: Messages whose return the Metal headers declare ``nullable`` (MTLDevice.h newCommandQueue,
#: newSharedEvent, newBufferWithBytes:length:options:; MTLCommandQueue.h commandBuffer;
#: MTLCommandBuffer.h blitCommandEncoder, computeCommandEncoder): ``inject_error(selector, code)``
#: makes the next one answer nil.
NIL_ON_FAULT = frozenset({"newCommandQueue", "newSharedEvent", "newBufferWithBytes:length:options:",
                          "commandBuffer", "blitCommandEncoder", "computeCommandEncoder"})
#: Messages that can fail, counted in ``accel.sim.calls()`` (Metal keeps no other call counters).
COUNTED = NIL_ON_FAULT | {"newBufferWithLength:options:", "newLibraryWithSource:options:error:", "commit"}


def _forked(what: str) -> None:
    raise MetalForkError(f"{what} in a forked child: Metal objects do not survive fork (a Mac crashes "
                         f"here); create them after the fork, or use the 'spawn' start method")


def _as(rt: "_State", obj: Any, kind: type) -> Any:
    if not isinstance(obj, kind):
        got = "nil" if obj is None else obj.cls_name
        raise MetalValidationError(f"expected a {kind.cls_name}, got {got}")
    return obj
