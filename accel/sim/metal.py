"""Simulated libobjc + Metal: the Objective-C message layer over host memory.

``ACCEL_SIM=mps`` makes :mod:`accel.backends.mps` open this instead of
``libobjc.A.dylib`` and ``Metal.framework``.  The backend code above is the
code that runs on a Mac: it calls ``objc_getClass``, ``sel_registerName``,
``objc_retain``/``objc_release``, the autorelease pool functions and
``MTLCreateSystemDefaultDevice`` on the simulated library, and casts
``objc_msgSend`` to each method's exact C type with ``ffi.cast``.  The
simulated ``ffi`` is the real objc FFI except that casting the simulated
``objc_msgSend`` yields a sender that

* checks the cast C type against the method's declaration in Apple's headers
  (return and argument types by kind and size: an ``unsigned int`` where
  ``NSUInteger`` is declared is an error, as it would corrupt registers on a
  Mac), and converts the arguments as cffi would;
* dispatches to a Python object implementing the selector, with the checks
  Metal's API validation layer makes (one active encoder per command buffer,
  no encoding after commit, blit offsets/sizes multiples of 4 on macOS, ranges
  inside buffers, ``waitUntilCompleted`` only after ``commit``...): a
  violation raises :class:`MetalValidationError` where a Mac would abort.

Objects are reference counted as Cocoa does: ``alloc``/``new``/``copy``
results start at +1, other results are autoreleased into the calling
thread's pool (an autorelease with no pool in place is counted as a leak);
command buffers retain the buffers their commands use until they complete;
a committed command buffer is kept alive by its queue until it completes.
:func:`state` exposes live objects so tests can assert that nothing leaks.

Execution: each ``MTLCommandQueue`` is a queue of the shared simulator
engine (:mod:`accel.sim._engine`, worker threads, ``ACCEL_SIM_DELAY_US`` of
latency per operation); a committed command buffer becomes one engine
operation per command, in order.  ``encodeWaitForEvent:value:`` makes the next
operation depend on the point where a committed command buffer signals that
value, so no wait can deadlock; waiting for a value that no committed command
buffer signals is reported (:class:`MetalValidationError`) instead of hanging.
A command buffer that fails skips its remaining commands, its signals included;
one that waits for a value only such a skipped signal was to reach ends in
``MTLCommandBufferStatusError`` with ``MTLCommandBufferErrorTimeout`` (the
docs are silent; the GPU would wait for its watchdog) instead of proceeding.
``newLibraryWithSource:`` finds ``kernel void NAME(`` entries in the MSL text
and a dispatch runs the numpy reference registered under NAME in
:mod:`accel.sim.kernels`.  Faults come from :mod:`accel.sim.core`:
``inject_oom`` (``newBufferWithLength:options:`` returns nil) and
``inject_error(selector, code)`` for ``newBufferWithLength:options:``,
``newLibraryWithSource:options:error:``, ``commit`` (the command buffer
ends in ``MTLCommandBufferStatusError`` with that code; none of its commands
run, its signals included) and the messages in
:data:`NIL_ON_FAULT` (they answer nil).  Those messages are counted in
``accel.sim.calls()``.

Configuration is :func:`accel.sim.core.config` (``ACCEL_SIM_DEVICES``: Metal
exposes one default device, 0 means none; ``ACCEL_SIM_MEMORY``: the
recommended working set, default 8 GiB; ``ACCEL_SIM_DELAY_US``).
"""

from __future__ import annotations

import collections
import ctypes
import re
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _engine, _memory, core, kernels

__all__ = ["MetalValidationError", "open_library", "open_libraries", "device_count", "state", "reset",
           "DECLARED"]

PAGE = 16384  # Apple silicon page: Metal rounds allocations and aligns contents to it
#: Deallocated addresses remembered for "message sent to deallocated instance" (as NSZombie does);
#: older ones still fail, as "not an Objective-C object". Bounded: no state per dead object.
ZOMBIES_KEPT = 1024
_MAX_UNCOMPLETED = 64               # MTLDevice newCommandQueue: "up to 64 uncompleted command buffers"
_MAX_THREADGROUP_INDEX = 31         # threadgroup memory indices taken (undocumented: as buffer indices)
MAX_THREADGROUP_MEMORY = 32 * 1024  # MTLDevice.maxThreadgroupMemoryLength on Apple GPU families


class MetalValidationError(AssertionError):
    """A call Metal's API validation would reject (a Mac aborts the process)."""


class MetalForkError(MetalValidationError):
    """A Metal object inherited from the parent was used in a forked child (a Mac crashes)."""


# ---------------------------------------------------------------------------
# Declared signatures (Apple's headers: Metal/*.h, Foundation/NSString.h,
# NSError.h, NSObject.h).  Types are Objective-C names from
# accel.backends._objc.C_TYPES.  The simulator checks every cast against these.
# ---------------------------------------------------------------------------
DECLARED: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    # NSObject / Foundation
    "new": ("id", ()), "alloc": ("id", ()), "init": ("id", ()),
    "retain": ("id", ()), "release": ("void", ()), "autorelease": ("id", ()),
    "retainCount": ("NSUInteger", ()),
    "stringWithUTF8String:": ("id", ("const char *",)),
    "UTF8String": ("const char *", ()),
    "localizedDescription": ("id", ()),
    "code": ("NSInteger", ()),
    # MTLDevice
    "name": ("id", ()),
    "registryID": ("uint64_t", ()),
    "recommendedMaxWorkingSetSize": ("uint64_t", ()),
    "currentAllocatedSize": ("NSUInteger", ()),
    "hasUnifiedMemory": ("BOOL", ()),
    "maxBufferLength": ("NSUInteger", ()),
    "newCommandQueue": ("id", ()),
    "newBufferWithLength:options:": ("id", ("NSUInteger", "NSUInteger")),
    "newBufferWithBytes:length:options:": ("id", ("const void *", "NSUInteger", "NSUInteger")),
    "newSharedEvent": ("id", ()),
    "newLibraryWithSource:options:error:": ("id", ("id", "id", "id *")),
    "newComputePipelineStateWithFunction:error:": ("id", ("id", "id *")),
    # MTLBuffer
    "contents": ("void *", ()),
    "length": ("NSUInteger", ()),        # also -[NSString length]
    # MTLCommandQueue / MTLCommandBuffer
    "commandBuffer": ("id", ()),
    "commit": ("void", ()),
    "waitUntilCompleted": ("void", ()),
    "status": ("NSUInteger", ()),
    "error": ("id", ()),
    "GPUStartTime": ("CFTimeInterval", ()),
    "GPUEndTime": ("CFTimeInterval", ()),
    "encodeSignalEvent:value:": ("void", ("id", "uint64_t")),
    "encodeWaitForEvent:value:": ("void", ("id", "uint64_t")),
    "blitCommandEncoder": ("id", ()),
    "computeCommandEncoder": ("id", ()),
    # MTLSharedEvent
    "signaledValue": ("uint64_t", ()),
    "setSignaledValue:": ("void", ("uint64_t",)),
    # encoders
    "endEncoding": ("void", ()),
    "copyFromBuffer:sourceOffset:toBuffer:destinationOffset:size:":
        ("void", ("id", "NSUInteger", "id", "NSUInteger", "NSUInteger")),
    "fillBuffer:range:value:": ("void", ("id", "NSRange", "uint8_t")),
    "setComputePipelineState:": ("void", ("id",)),
    "setBuffer:offset:atIndex:": ("void", ("id", "NSUInteger", "NSUInteger")),
    "setBytes:length:atIndex:": ("void", ("const void *", "NSUInteger", "NSUInteger")),
    "setThreadgroupMemoryLength:atIndex:": ("void", ("NSUInteger", "NSUInteger")),
    "dispatchThreadgroups:threadsPerThreadgroup:": ("void", ("MTLSize", "MTLSize")),
    "dispatchThreads:threadsPerThreadgroup:": ("void", ("MTLSize", "MTLSize")),
    # MTLCompileOptions, MTLLibrary, MTLFunction, MTLComputePipelineState
    "setFastMathEnabled:": ("void", ("BOOL",)),
    "newFunctionWithName:": ("id", ("id",)),
    "maxTotalThreadsPerThreadgroup": ("NSUInteger", ()),
    "threadExecutionWidth": ("NSUInteger", ()),
}

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


# MTLCommandBufferStatus
NOT_ENQUEUED, ENQUEUED, COMMITTED, SCHEDULED, COMPLETED, ERROR = range(6)
_ERR_INTERNAL = 1  # MTLCommandBufferErrorInternal
_ERR_TIMEOUT = 2   # MTLCommandBufferErrorTimeout
_MAX_THREADS_PER_GROUP = 1024
_MAX_BUFFER_INDEX = 31


# ---------------------------------------------------------------------------
# Objects
# ---------------------------------------------------------------------------
class SimObject:
    """An Objective-C object: class name, retain count, selector methods (``m_<name>``)."""

    cls_name = "NSObject"

    def __init__(self, rt: "_State"):
        self.rt = rt
        self.rc = 1
        self.addr = rt.register(self)

    def dealloc(self) -> None:
        """Called when the retain count reaches zero (release what this object holds)."""

    def method(self, selector: str) -> Callable:
        fn = getattr(self, "m_" + selector.replace(":", "_"), None)
        if fn is None:
            raise MetalValidationError(
                f"-[{self.cls_name} {selector}]: unrecognized selector sent to instance {self.addr:#x}")
        return fn

    # NSObject
    def m_retain(self):
        self.rt.retain(self)
        return self

    def m_release(self):
        self.rt.release(self)

    def m_autorelease(self):
        return self.rt.autorelease(self)

    def m_retainCount(self):
        return self.rc


class SimClass(SimObject):
    """A class object: ``objc_getClass`` result; class methods are ``c_<name>``."""

    cls_name = "Class"

    def __init__(self, rt: "_State", name: str, factory: Optional[Callable] = None,
                 class_methods: Optional[Dict[str, Callable]] = None):
        super().__init__(rt)
        self.name = name
        self.factory = factory
        self.class_methods = class_methods or {}
        self.rc = 1 << 62  # classes are never deallocated

    def method(self, selector: str) -> Callable:
        if selector in self.class_methods:
            return self.class_methods[selector]
        if selector in ("new", "alloc") and self.factory is not None:
            return lambda: self.factory(self.rt)  # +1
        raise MetalValidationError(f"+[{self.name} {selector}]: unrecognized selector sent to class")


class NSString(SimObject):
    cls_name = "NSString"

    def __init__(self, rt, text: str):
        super().__init__(rt)
        self.text = text
        self._utf8 = rt.ffi.new("char[]", text.encode("utf-8"))

    def m_UTF8String(self):
        return self._utf8

    def m_length(self):
        return len(self.text.encode("utf-16-le")) // 2


class NSError(SimObject):
    cls_name = "NSError"

    def __init__(self, rt, code: int, text: str):
        super().__init__(rt)
        self.code, self.text = code, text

    def m_code(self):
        return self.code

    def m_localizedDescription(self):
        return self.rt.autorelease(NSString(self.rt, self.text))


class MTLCompileOptions(SimObject):
    cls_name = "MTLCompileOptions"

    def __init__(self, rt):
        super().__init__(rt)
        self.fast_math = True  # Metal's default

    def m_init(self):
        return self

    def m_setFastMathEnabled_(self, flag):
        self.fast_math = bool(flag)


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


class MTLSharedEvent(SimObject):
    cls_name = "MTLSharedEvent"

    def __init__(self, rt):
        super().__init__(rt)
        self.value = 0
        self.points: List[Tuple[int, Tuple[Any, int]]] = []  # (value, engine point signaling it)
        # The point of the highest pending value whose signal a failed command buffer skipped:
        # a wait for a value only it was to signal fails (MTLCommandBuffer._check_waits).  One
        # entry, not one per failure: the event's state stays bounded.
        self.skipped: Optional[Tuple[int, Tuple[Any, int]]] = None

    def m_signaledValue(self):
        return self.value

    def m_setSignaledValue_(self, value):
        self.signal(value)

    def signal(self, value: int) -> None:
        # Shared event values only increase: a late, smaller signal is ignored.
        with self.rt.lock:
            if value > self.value:
                self.value = value
                # Points for values now reached are never needed again (point_for answers None):
                # the event holds only pending signals, not one entry per signal ever encoded.
                points = self.points
                if points and points[0][0] <= value:
                    self.points = [p for p in points if p[0] > value]
                if self.skipped is not None and self.skipped[0] <= value:
                    self.skipped = None

    def signal_skipped(self, value: int, point: Tuple[Any, int]) -> None:
        """The signal of ``value`` at ``point`` will never happen (its command buffer failed)."""
        with self.rt.lock:
            self.points = [p for p in self.points if p[1] != point]
            if value > self.value and (self.skipped is None or value >= self.skipped[0]):
                self.skipped = (value, point)

    def point_for(self, value: int):
        """The engine point after which ``value`` is signaled: None when it already
        is, False when no committed command buffer signals it.  A value only a skipped
        signal was to reach answers that (completed) point: the wait then fails."""
        with self.rt.lock:
            if self.value >= value:
                return None
            for v, point in self.points:
                if v >= value:
                    return point
            if self.skipped is not None and self.skipped[0] >= value:
                return self.skipped[1]
            return False


class MTLFunction(SimObject):
    cls_name = "MTLFunction"

    def __init__(self, rt, library: "MTLLibrary", name: str):
        super().__init__(rt)
        self.library = rt.retain(library)
        self.name = name

    def dealloc(self):
        self.rt.release(self.library)


class MTLLibrary(SimObject):
    cls_name = "MTLLibrary"

    def __init__(self, rt, names: List[str], thread_limits: Optional[Dict[str, int]] = None):
        super().__init__(rt)
        self.names = names
        self.thread_limits = thread_limits or {}    # [[max_total_threads_per_threadgroup(N)]] per kernel

    def m_newFunctionWithName_(self, name):
        text = _as(self.rt, name, NSString).text
        if text not in self.names:
            return None
        return MTLFunction(self.rt, self, text)


class MTLComputePipelineState(SimObject):
    cls_name = "MTLComputePipelineState"

    def __init__(self, rt, function: MTLFunction, reference):
        super().__init__(rt)
        self.function = rt.retain(function)
        self.reference = reference  # (argtypes, fn) from accel.sim.kernels

    def dealloc(self):
        self.rt.release(self.function)

    def m_maxTotalThreadsPerThreadgroup(self):
        # MTLComputePipelineState.maxTotalThreadsPerThreadgroup: "may be different for different
        # pipeline objects"; MTLComputePipelineDescriptor.maxTotalThreadsPerThreadgroup: "Your
        # shader can also configure the maximum number of threads per threadgroup with the
        # [[max_total_threads_per_threadgroup]] attribute".
        limit = self.function.library.thread_limits.get(self.function.name)
        return _MAX_THREADS_PER_GROUP if limit is None else min(limit, _MAX_THREADS_PER_GROUP)

    def m_threadExecutionWidth(self):
        return 32


class _Encoder(SimObject):
    def __init__(self, rt, cb: "MTLCommandBuffer"):
        super().__init__(rt)
        self.cb = cb
        self.active = True

    def _check(self, selector: str) -> None:
        if not self.active:
            raise MetalValidationError(f"{selector}: encoder {self.addr:#x} has already ended encoding")

    def dealloc(self):
        if self.active:
            # Apple's documentation of MTLCommandEncoder.endEncoding ("Declares that all command
            # generation from the encoder is completed") states nothing about an encoder
            # deallocated before it; Metal's API validation aborts ("Command encoder released
            # without endEncoding"), so the simulator refuses.
            self.active = False
            raise MetalValidationError(
                f"{self.cls_name} {self.addr:#x} released without endEncoding (Metal's API validation "
                f"aborts here; the documentation is silent, so the simulator refuses): end every "
                f"encoder before its autorelease pool drains")

    def m_endEncoding(self):
        self._check("endEncoding")
        self.active = False
        self.cb.encoder = None


class MTLBlitCommandEncoder(_Encoder):
    cls_name = "MTLBlitCommandEncoder"

    def m_copyFromBuffer_sourceOffset_toBuffer_destinationOffset_size_(self, src, soff, dst, doff, n):
        self._check("copyFromBuffer:")
        src, dst = _as(self.rt, src, MTLBuffer), _as(self.rt, dst, MTLBuffer)
        for what, v in (("sourceOffset", soff), ("destinationOffset", doff), ("size", n)):
            if v % 4:
                raise MetalValidationError(f"copyFromBuffer: {what} ({v}) must be a multiple of 4 on macOS")
        if n == 0:
            # copyFromBuffer:sourceOffset:toBuffer:destinationOffset:size: says nothing of size 0:
            # the simulator refuses what the documentation does not define
            raise MetalValidationError("copyFromBuffer: size 0 (Metal documents no empty copy; the simulator "
                                       "refuses)")
        if src is dst and soff < doff + n and doff < soff + n:
            # the documentation does not define a copy between overlapping ranges of one buffer
            # (a blit need not copy front to back): refused, as the Level Zero simulator does
            raise MetalValidationError(f"copyFromBuffer: source [{soff}, {soff + n}) and destination "
                                       f"[{doff}, {doff + n}) overlap in one buffer (undefined in Metal's "
                                       f"documentation; the simulator refuses)")
        _check_range("copyFromBuffer: source", src, soff, n)
        _check_range("copyFromBuffer: destination", dst, doff, n)
        self.cb.uses(src, dst)
        ffi = core.ffi
        self.cb.commands.append(("op", lambda: ffi.memmove(_memory.char_ptr(dst.base + doff),
                                                           _memory.char_ptr(src.base + soff), n)))

    def m_fillBuffer_range_value_(self, buf, rng, value):
        self._check("fillBuffer:")
        buf = _as(self.rt, buf, MTLBuffer)
        off, n = int(rng.location), int(rng.length)
        if off % 4 or n % 4:
            raise MetalValidationError(f"fillBuffer:range:value: range ({off}, {n}) must be a multiple "
                                       f"of 4 on macOS")
        if n == 0:
            # fillBuffer:range:value: "The range's count property needs to be greater than 0."
            raise MetalValidationError("fillBuffer:range:value: the range's count must be greater than 0")
        _check_range("fillBuffer:", buf, off, n)
        self.cb.uses(buf)
        self.cb.commands.append(("op", lambda: ctypes.memset(buf.base + off, value, n)))


class MTLComputeCommandEncoder(_Encoder):
    cls_name = "MTLComputeCommandEncoder"

    def __init__(self, rt, cb):
        super().__init__(rt, cb)
        self.pipeline: Optional[MTLComputePipelineState] = None
        self.bindings: Dict[int, Tuple[str, Any]] = {}
        self.tg_memory: Dict[int, int] = {}     # threadgroup memory length per index

    def m_setComputePipelineState_(self, pipeline):
        self._check("setComputePipelineState:")
        self.pipeline = _as(self.rt, pipeline, MTLComputePipelineState)

    def _index(self, index):
        if index >= _MAX_BUFFER_INDEX:
            raise MetalValidationError(f"buffer index {index} out of range [0, {_MAX_BUFFER_INDEX})")

    def m_setBuffer_offset_atIndex_(self, buf, offset, index):
        self._check("setBuffer:")
        self._index(index)
        if buf is None:
            self.bindings[index] = ("buffer", (None, 0))
            return
        buf = _as(self.rt, buf, MTLBuffer)
        if offset >= buf.length:
            # Apple's validation layer refuses an offset at the end too (the binding would hold no byte)
            raise MetalValidationError(f"setBuffer: offset {offset} not inside the buffer's {buf.length} bytes")
        self.bindings[index] = ("buffer", (buf, offset))

    def m_setBytes_length_atIndex_(self, ptr, length, index):
        self._check("setBytes:")
        self._index(index)
        if length > 4096:
            raise MetalValidationError("setBytes:length:atIndex: takes at most 4 KB; use a buffer")
        if not ptr and length:
            raise MetalValidationError("setBytes:length:atIndex: bytes is NULL (the method copies from it)")
        self.bindings[index] = ("bytes", bytes(self.rt.ffi.buffer(self.rt.ffi.cast("char *", ptr), length)))

    def m_setThreadgroupMemoryLength_atIndex_(self, length, index):
        self._check("setThreadgroupMemoryLength:")
        if length % 16:
            raise MetalValidationError(f"threadgroup memory length {length} must be a multiple of 16")
        if length > MAX_THREADGROUP_MEMORY:
            # Apple, setThreadgroupMemoryLength:atIndex: "The total of all threadgroup memory
            # allocations must not exceed maxThreadgroupMemoryLength" (32 KB on Apple GPU families,
            # "Metal Feature Set Tables").
            raise MetalValidationError(f"threadgroup memory length {length} exceeds maxThreadgroupMemoryLength "
                                       f"({MAX_THREADGROUP_MEMORY})")
        if index >= _MAX_THREADGROUP_INDEX:
            # the documentation gives no range of indices: the simulator takes as many as buffers
            raise MetalValidationError(f"threadgroup memory index {index} out of range "
                                       f"[0, {_MAX_THREADGROUP_INDEX}) (undocumented; the simulator refuses)")
        lengths = {**self.tg_memory, index: length}
        if sum(lengths.values()) > MAX_THREADGROUP_MEMORY:
            # "The sum of all threadgroup memory allocations ... can't exceed the device limits"
            raise MetalValidationError(f"threadgroup memory {lengths} sums past maxThreadgroupMemoryLength "
                                       f"({MAX_THREADGROUP_MEMORY})")
        self.tg_memory = lengths

    def m_dispatchThreadgroups_threadsPerThreadgroup_(self, groups, threads):
        self._check("dispatchThreadgroups:")
        grid = (int(groups.width), int(groups.height), int(groups.depth))
        block = (int(threads.width), int(threads.height), int(threads.depth))
        self._dispatch(grid, block)

    def m_dispatchThreads_threadsPerThreadgroup_(self, total, threads):
        self._check("dispatchThreads:")
        block = (int(threads.width), int(threads.height), int(threads.depth))
        t = (int(total.width), int(total.height), int(total.depth))
        self._dispatch(tuple(-(-a // b) for a, b in zip(t, block)), block)

    def _dispatch(self, grid, block):
        if self.pipeline is None:
            raise MetalValidationError("dispatch without setComputePipelineState:")
        if min(grid + block) < 1:
            raise MetalValidationError(f"dispatch with an empty grid {grid} or threadgroup {block}")
        if max(grid) > 0xFFFFFFFF:
            # The Metal docs give no limit on threadgroups per grid dimension; MSL's
            # threadgroup_position_in_grid is 32-bit, so the simulator refuses what it cannot address.
            raise MetalValidationError(f"dispatch grid {grid} exceeds 2**32-1 threadgroups in a dimension "
                                       f"(Metal documents no limit; the simulator refuses)")
        if block[0] * block[1] * block[2] > self.pipeline.m_maxTotalThreadsPerThreadgroup():
            raise MetalValidationError(f"threadgroup {block} exceeds maxTotalThreadsPerThreadgroup")
        argtypes, fn = self.pipeline.reference.argtypes, self.pipeline.reference.fn
        args = []
        for i, kind in enumerate(argtypes):
            if i not in self.bindings:
                raise MetalValidationError(
                    f"kernel {self.pipeline.function.name}: no buffer or bytes bound at index {i}")
            how, value = self.bindings[i]
            if kind == "ptr":
                if how != "buffer":
                    raise MetalValidationError(f"kernel {self.pipeline.function.name}: argument {i} is a "
                                               f"device pointer but was bound with setBytes:")
                buf, off = value
                args.append(0 if buf is None else buf.base + off)
                if buf is not None:
                    self.cb.uses(buf)
            else:
                if how != "bytes":
                    raise MetalValidationError(f"kernel {self.pipeline.function.name}: argument {i} is a "
                                               f"{kind} scalar but was bound with setBuffer:")
                fmt = _SCALAR_FORMATS[kind]
                if len(value) != struct.calcsize(fmt):
                    raise MetalValidationError(f"kernel {self.pipeline.function.name}: argument {i} "
                                               f"({kind}) bound with {len(value)} bytes")
                args.append(struct.unpack(fmt, value)[0])
        self.cb.retain_obj(self.pipeline)
        self.cb.commands.append(("op", lambda: fn(grid, block, kernels.view, *args)))


_SCALAR_FORMATS = {"u32": "<I", "i32": "<i", "u64": "<Q", "i64": "<q", "f32": "<f", "f64": "<d"}


class MTLCommandBuffer(SimObject):
    cls_name = "MTLCommandBuffer"

    def __init__(self, rt, queue: "MTLCommandQueue"):
        super().__init__(rt)
        self.queue = rt.retain(queue)
        self.status = NOT_ENQUEUED
        queue.uncommitted += 1
        # ("op", fn) | ("wait", event, value) | ("signal", event, value), in encoding order
        self.commands: List[tuple] = []
        self.held: List[SimObject] = []
        self.encoder: Optional[_Encoder] = None
        self.error_obj: Optional[NSError] = None
        self.failure: Optional[Tuple[int, str]] = None
        self.start = self.end = 0.0
        self.final_seq = 0

    def dealloc(self):
        self._drop_held()
        if self.status == NOT_ENQUEUED:
            self.queue.uncommitted -= 1
        self.rt.release(self.queue)
        if self.error_obj is not None:
            self.rt.release(self.error_obj)

    def _drop_held(self):
        held, self.held = self.held, []
        for obj in held:
            self.rt.release(obj)

    def retain_obj(self, obj):
        self.held.append(self.rt.retain(obj))

    def uses(self, *bufs):
        for b in bufs:
            self.retain_obj(b)

    def _encodable(self, selector: str) -> None:
        if self.status != NOT_ENQUEUED:
            raise MetalValidationError(f"{selector}: command buffer {self.addr:#x} is already committed")
        if self.encoder is not None:
            raise MetalValidationError(f"{selector}: command buffer {self.addr:#x} has an active encoder; "
                                       f"call endEncoding first")

    def _new_encoder(self, kind):
        self._encodable(kind.cls_name)
        self.encoder = kind(self.rt, self)
        return self.rt.autorelease(self.encoder)

    def m_blitCommandEncoder(self):
        return self._new_encoder(MTLBlitCommandEncoder)

    def m_computeCommandEncoder(self):
        return self._new_encoder(MTLComputeCommandEncoder)

    def m_encodeSignalEvent_value_(self, event, value):
        self._encodable("encodeSignalEvent:value:")
        event = _as(self.rt, event, MTLSharedEvent)
        self.retain_obj(event)
        self.commands.append(("signal", event, value))

    def m_encodeWaitForEvent_value_(self, event, value):
        self._encodable("encodeWaitForEvent:value:")
        event = _as(self.rt, event, MTLSharedEvent)
        self.retain_obj(event)
        self.commands.append(("wait", event, value))

    def m_commit(self):
        """Each command becomes one operation of the queue's engine queue, in
        order; an event wait makes the next operation depend on the point
        where the awaited value is signaled; a final marker completes the
        command buffer."""
        if self.status != NOT_ENQUEUED:
            raise MetalValidationError(f"commit: command buffer {self.addr:#x} was already committed")
        if self.encoder is not None:
            raise MetalValidationError("commit: command buffer has an active encoder; call endEncoding first")
        self.queue.uncommitted -= 1
        code = core.take_fault("commit")
        if code:
            # The injected failure comes first: none of the buffer's commands run, its
            # encodeSignalEvent:value: included (the strictest place: the GPU may fail at any
            # command, and Apple's docs do not say whether a failed buffer still signals).
            self.commands.insert(0, ("op", lambda c=code: _fail(c, "injected fault")))
        q = self.queue.q
        deps: List[Tuple[Any, int]] = []
        awaited: List[Tuple[MTLSharedEvent, int]] = []   # waits the next operation checks
        plan = []
        for cmd in self.commands:
            if cmd[0] == "wait":
                _, event, value = cmd
                point = event.point_for(value)
                if point is False:
                    raise MetalValidationError(
                        f"encodeWaitForEvent: value {value} of event {event.addr:#x} is signaled by no "
                        f"committed command buffer (the simulator cannot wait for future signals; "
                        f"Metal would wait, possibly forever)")
                if point is not None:
                    deps.append(point)
                awaited.append((event, value))
            elif cmd[0] == "signal":
                plan.append((self._signal_op(cmd[1], cmd[2], q, awaited), tuple(deps), cmd[1], cmd[2]))
                deps, awaited = [], []
            else:
                plan.append((self._op(cmd[1], awaited), tuple(deps), None, None))
                deps, awaited = [], []
        self.commands = []
        self.status = COMMITTED
        self.rt.retain(self)  # the queue keeps a committed buffer alive until it completes
        for fn, op_deps, event, value in plan:
            seq = q.submit(fn, op_deps)
            if event is not None:
                with self.rt.lock:
                    if fn.skipped:            # it ran (inline) and skipped its signal
                        event.signal_skipped(value, (q, seq))
                    elif value > event.value:   # a value already reached needs no point
                        event.points.append((value, (q, seq)))
                        fn.seq = seq
        self.final_seq = q.submit(lambda: self._finish(awaited), tuple(deps), work=False)

    def _started(self) -> None:
        if self.status == COMMITTED:
            with self.rt.lock:
                if self.status == COMMITTED:
                    self.status = SCHEDULED
                    self.start = time.perf_counter()

    def _check_waits(self, awaited) -> None:
        """Fail the buffer at an encodeWaitForEvent:value: whose value was never signaled.

        The operation runs after the engine point that was to signal each awaited value, so a
        value still unreached means that signal was skipped: its command buffer failed first.
        Apple's docs are silent on this case (MTLCommandBuffer encodeWaitForEvent:value: only
        says the GPU "waits until the event reaches the value"; MTLSharedEvent and
        MTLCommandBufferError say nothing of a signal a failed command buffer never performs):
        the GPU would wait until its watchdog ends the command buffer.  The simulator does not
        wait (it cannot know of future signals) and does not proceed as if signaled: the waiter
        ends in MTLCommandBufferStatusError with MTLCommandBufferErrorTimeout ("the command
        buffer took too long to execute"), its remaining commands and signals skipped.
        """
        if self.failure is not None:
            return
        for event, value in awaited:
            if event.value < value:
                self.failure = (_ERR_TIMEOUT, (
                    f"encodeWaitForEvent: value {value} of MTLSharedEvent {event.addr:#x} was never "
                    f"signaled (signaledValue {event.value}): the command buffer that encoded the "
                    f"signal failed before it. Apple's docs are silent on this case (Metal would wait "
                    f"until the GPU watchdog ends this command buffer); the accel simulator fails it "
                    f"with MTLCommandBufferErrorTimeout"))
                return

    def _op(self, fn, awaited=()):
        def run():
            self._started()
            self._check_waits(awaited)
            if self.failure is not None:
                return  # an earlier command failed: the rest of the buffer does not run
            try:
                fn()
            except _CommandFailure as exc:
                self.failure = exc.args
            except Exception as exc:  # a kernel reference failed: the GPU would fault
                self.failure = (_ERR_INTERNAL, f"{type(exc).__name__}: {exc}")
        return run

    def _signal_op(self, event, value, q, awaited=()):
        def run():
            self._started()
            self._check_waits(awaited)
            if self.failure is None:
                event.signal(value)
                return
            with self.rt.lock:   # commit lists the point (run.seq) or reads run.skipped under it
                if run.seq is not None:
                    event.signal_skipped(value, (q, run.seq))
                else:
                    run.skipped = True
        run.seq = None
        run.skipped = False
        return run

    def _finish(self, awaited=()) -> None:
        self._started()
        self._check_waits(awaited)
        with self.rt.lock:
            self.end = time.perf_counter()
            if self.failure is not None:
                self.error_obj = NSError(self.rt, *self.failure)
                self.status = ERROR
            else:
                self.status = COMPLETED
            self._drop_held()
            self.rt.release(self)

    def m_waitUntilCompleted(self):
        if self.status == NOT_ENQUEUED:
            raise MetalValidationError("waitUntilCompleted on a command buffer that was never committed "
                                       "(Metal would block forever)")
        self.queue.q.wait(self.final_seq)

    def m_status(self):
        return self.status

    def m_error(self):
        return self.error_obj

    def _finished(self) -> bool:
        return self.status in (COMPLETED, ERROR)

    # Apple, MTLCommandBuffer gpuStartTime / gpuEndTime (Discussion): "The GPU start and end times
    # remain 0.0 until the GPU finishes running the command buffer. Check this value after the
    # waitUntilCompleted() method returns" (r69e: the start time was answered while it ran).
    def m_GPUStartTime(self):
        return self.start if self._finished() else 0.0

    def m_GPUEndTime(self):
        return self.end if self._finished() else 0.0


class _CommandFailure(Exception):
    """(code, text): a command buffer ends in MTLCommandBufferStatusError."""


def _fail(code: int, text: str) -> None:
    raise _CommandFailure(code, text)


class MTLCommandQueue(SimObject):
    cls_name = "MTLCommandQueue"

    def __init__(self, rt, device):
        super().__init__(rt)
        self.device = device
        self.q = rt.engine.queue(f"metal-queue-{self.addr:#x}", owner=self)
        self.uncommitted = 0        # command buffers made and not yet committed

    def dealloc(self):
        # committed buffers hold the queue: nothing is pending here
        self.rt.engine.close_later(self.q)

    def m_commandBuffer(self):
        if self.uncommitted >= _MAX_UNCOMPLETED:
            # newCommandQueue: the queue allows "up to 64 uncompleted command buffers", and
            # commandBuffer "blocks the calling CPU thread when the queue doesn't have any free
            # command buffers": with 64 never committed, none can complete, and a Mac blocks forever
            raise MetalValidationError(f"commandBuffer: the queue holds {self.uncommitted} uncommitted command "
                                       f"buffers; on a Mac this call would block forever")
        return self.rt.autorelease(MTLCommandBuffer(self.rt, self))


class MTLDevice(SimObject):
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

    def m_newSharedEvent(self):
        return MTLSharedEvent(self.rt)

    def m_newLibraryWithSource_options_error_(self, source, options, error):
        text = _as(self.rt, source, NSString).text
        if options is not None:
            _as(self.rt, options, MTLCompileOptions)
        m = re.search(r"^\s*#\s*error\s+(.*)$", text, re.M)
        fault = core.take_fault("newLibraryWithSource:options:error:")
        if m or fault:
            msg = m.group(1) if m else f"injected fault {fault}"
            self.rt.set_error(error, 3, f"program_source: error: {msg}")  # MTLLibraryErrorCompileFailure
            return None
        code = _MSL_COMMENT.sub(lambda c: re.sub(r"[^\n]", " ", c.group()), text)
        m = _MSL_DOUBLE.search(code)
        if m:
            # Metal Shading Language Specification, 2.1 "Scalar Data Types": there is no double
            # (nor long double, nor doubleN vectors); Apple's compiler rejects the source.
            line = code.count("\n", 0, m.start()) + 1
            self.rt.set_error(error, 3, f"program_source:{line}: error: '{m.group()}' is not supported in Metal")
            return None
        problem = _msl_syntax_error(code)
        if problem:
            self.rt.set_error(error, 3, f"program_source:{problem[0]}: error: {problem[1]}")
            return None
        # Metal Shading Language Specification 1.5 ("Metal and C++14"): comments are C++ comments,
        # so a kernel written inside one is no function of the library (newFunctionWithName: nil).
        names = _MSL_KERNEL.findall(code)
        return MTLLibrary(self.rt, names, _msl_thread_limits(code))

    def m_newComputePipelineStateWithFunction_error_(self, function, error):
        function = _as(self.rt, function, MTLFunction)
        reference = kernels.lookup(function.name)
        if reference is None:
            self.rt.set_error(error, 1, f"the accel simulator has no Python reference for kernel "
                                        f"{function.name!r}; register one: accel.sim.register_kernel("
                                        f"{function.name!r}, fn, 'ptr, u64, ...')")
            return None
        if "f64" in reference.argtypes:
            # No Metal kernel declares a double parameter (MSL Specification, 2.1), so this
            # reference would decode bytes no launch passes: refused, as a missing reference is.
            self.rt.set_error(error, 1, f"the accel simulator's reference for kernel {function.name!r} takes an "
                                        f"f64 argument, and Metal has no double (a Metal kernel cannot declare one); "
                                        f"register it with f32")
            return None
        return MTLComputePipelineState(self.rt, function, reference)


_MSL_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_MSL_DOUBLE = re.compile(r"\b(?:long\s+)?double\d*\b")
_MSL_KERNEL = re.compile(r"\bkernel\s+void\s+([A-Za-z_]\w*)\s*\(")
_MSL_LITERAL = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'')
_MSL_CLOSE = {")": "(", "]": "[", "}": "{"}
_MSL_OPEN = {v: k for k, v in _MSL_CLOSE.items()}


_MSL_MAX_THREADS = r"\[\[\s*max_total_threads_per_threadgroup\s*\(\s*(\d+)\s*\)\s*\]\]"
_MSL_MAX_THREADS_BEFORE = re.compile(_MSL_MAX_THREADS + r"\s*kernel\s+void\s+([A-Za-z_]\w*)\s*\(")
_MSL_MAX_THREADS_AFTER = re.compile(r"\s*" + _MSL_MAX_THREADS)


def _msl_thread_limits(code: str) -> Dict[str, int]:
    """{kernel name: N} of the kernels declared with ``[[max_total_threads_per_threadgroup(N)]]``,
    before ``kernel void NAME(`` or after its parameter list (comments blanked)."""
    limits = {name: int(n) for n, name in _MSL_MAX_THREADS_BEFORE.findall(code)}
    for m in _MSL_KERNEL.finditer(code):
        end = _close_paren(code, m.end() - 1)
        after = _MSL_MAX_THREADS_AFTER.match(code, end + 1)
        if after:
            limits[m.group(1)] = int(after.group(1))
    return limits


def _close_paren(code: str, j: int) -> int:
    """The index of the ')' closing the '(' at ``code[j]`` (len(code) when it is never closed)."""
    depth = 0
    while j < len(code):
        depth += {"(": 1, ")": -1}.get(code[j], 0)
        if depth == 0:
            return j
        j += 1
    return j


def _msl_syntax_error(code: str):
    """(line, message) of the first error the simulated compiler can see in MSL whose comments
    were blanked, or None.  Metal Shading Language Specification 1.5: MSL is C++14 with
    restrictions, so parentheses, brackets and braces pair up as in any C++ program (an unclosed
    one fails the compile), and 1.5.1 "Overloading": graphics and kernel functions cannot be
    overloaded, so two definitions of one kernel name fail too."""
    code = _MSL_LITERAL.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), code)
    stack = []
    for i, ch in enumerate(code):
        if ch in "([{":
            stack.append((ch, i))
        elif ch in _MSL_CLOSE:
            if not stack or stack[-1][0] != _MSL_CLOSE[ch]:
                return code.count("\n", 0, i) + 1, f"unexpected '{ch}'"
            stack.pop()
    if stack:
        ch, i = stack[-1]
        return code.count("\n", 0, i) + 1, f"'{ch}' is never closed (expected '{_MSL_OPEN[ch]}')"
    defined = {}
    for m in _MSL_KERNEL.finditer(code):
        rest = code[_close_paren(code, m.end() - 1) + 1:].lstrip()
        if rest.startswith("[["):     # an attribute after the parameter list
            rest = rest[rest.find("]]") + 2:].lstrip()
        if rest.startswith("{"):      # a definition, not a declaration
            name = m.group(1)
            line = code.count("\n", 0, m.start()) + 1
            if name in defined:
                return line, (f"redefinition of kernel '{name}' (first defined at line {defined[name]}; kernel "
                              f"functions cannot be overloaded)")
            defined[name] = line
    return None


def _check_range(what: str, buf: MTLBuffer, off: int, n: int) -> None:
    if off + n > buf.length:
        raise MetalValidationError(f"{what} range [{off}, {off + n}) outside the {buf.length}-byte buffer")


def _as(rt: "_State", obj: Any, kind: type) -> Any:
    if not isinstance(obj, kind):
        got = "nil" if obj is None else obj.cls_name
        raise MetalValidationError(f"expected a {kind.cls_name}, got {got}")
    return obj


# ---------------------------------------------------------------------------
# Runtime state: objects, retain counts, autorelease pools, faults
# ---------------------------------------------------------------------------
class _State:
    """One simulated Objective-C runtime + Metal: objects, retain counts, pools, queues."""

    def __init__(self, ffi) -> None:
        self.ffi = ffi
        self.lock = threading.RLock()
        self.engine = _engine.Engine(self._engine_error)
        self.table = _memory.MemoryTable()
        self.objects: Dict[int, SimObject] = {}
        self.zombies: "collections.OrderedDict[int, str]" = collections.OrderedDict()
        self.forked = False   # set in a forked child: inherited Metal objects fail there
        self.next_addr = 0x7F5100000000
        self.selectors: Dict[int, str] = {}
        self.selector_addr: Dict[str, int] = {}
        self.selector_names: Dict[str, Any] = {}
        self.tls = threading.local()
        self.leaked_autoreleases = 0
        self.runtime_initialized = False
        self.engine_errors: List[str] = []
        self.device: Optional[MTLDevice] = None
        self.classes: Dict[str, SimClass] = {}
        self._define_classes()

    def after_fork(self) -> bool:
        """In a forked child: True when this state stays usable (Metal was never started in the
        parent, only libobjc and the framework loaded), else mark it forked and answer False."""
        if self.runtime_initialized:
            self.forked = True
            return False
        # No device, so no Metal object, queue or buffer exists; the parent's threads and locks
        # do not exist here: fresh ones.
        self.lock = threading.RLock()
        self.engine = _engine.Engine(self._engine_error)
        self.tls = threading.local()
        _memory.forget(self.table)
        self.table = _memory.MemoryTable()
        return True

    def _engine_error(self, queue, exc: BaseException) -> None:
        self.engine_errors.append(f"{queue.label}: {type(exc).__name__}: {exc}")

    def _define_classes(self) -> None:
        def string_with_utf8(ptr):
            # Apple, NSString init(utf8String:): "A NULL-terminated C array of bytes in UTF-8 encoding.
            # This value must not be NULL" (a Mac raises NSInvalidArgumentException), and the
            # initializer is failable ("convenience init?"): bytes that are not UTF-8 give nil.
            # r69e: the bytes after a NUL were kept, a char[] cdata, NULL and non-UTF-8 bytes raised
            # Python errors out of objc_msgSend.
            if not ptr:
                raise MetalValidationError("+[NSString stringWithUTF8String:]: NULL cString (NSString "
                                           "init(utf8String:): \"This value must not be NULL\"; a Mac raises "
                                           "NSInvalidArgumentException)")
            raw = self.ffi.string(self.ffi.cast("char *", ptr))     # C reads up to the first NUL
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                return None
            return self.autorelease(NSString(self, text))

        for name, factory, methods in (
                ("NSObject", None, {}),
                ("NSString", None, {"stringWithUTF8String:": string_with_utf8}),
                ("MTLCompileOptions", MTLCompileOptions, {})):
            self.classes[name] = SimClass(self, name, factory, methods)

    def close(self) -> None:
        self.engine.shutdown()
        self.table.close()

    # -- registry -------------------------------------------------------------
    def _address(self) -> int:
        with self.lock:
            addr = self.next_addr
            self.next_addr += 0x40
        return addr

    def register(self, obj: SimObject) -> int:
        with self.lock:
            addr = self._address()
            self.objects[addr] = obj
        return addr

    def get(self, addr: int) -> SimObject:
        obj = self.objects.get(addr)
        if obj is None:
            if addr in self.zombies:
                raise MetalValidationError(f"message sent to deallocated instance {addr:#x} "
                                           f"({self.zombies[addr]})")
            raise MetalValidationError(f"{addr:#x} is not an Objective-C object (or one deallocated "
                                       f"long ago)")
        if self.forked and obj.cls_name.startswith(_METAL_PREFIXES):
            _forked(f"message to {obj.cls_name} {addr:#x}")
        return obj

    def retain(self, obj: SimObject) -> SimObject:
        with self.lock:
            if obj.rc <= 0:
                raise MetalValidationError(f"retain of deallocated {obj.cls_name} {obj.addr:#x}")
            obj.rc += 1
        return obj

    def release(self, obj: SimObject) -> None:
        # Apple, "Advanced Memory Management Programming Guide" (Memory Management Policy): "You own
        # any object you create" (alloc/new/copy/mutableCopy), "You must not relinquish ownership of
        # an object you do not own": a release the caller did not own shows up here as the pool's
        # (or the owner's) later release of a deallocated object, refused, where a Mac crashes.
        with self.lock:
            if obj.rc <= 0:
                raise MetalValidationError(f"over-release of {obj.cls_name} {obj.addr:#x}")
            obj.rc -= 1
            if obj.rc == 0:
                del self.objects[obj.addr]
                zombies = self.zombies
                zombies[obj.addr] = obj.cls_name
                if len(zombies) > ZOMBIES_KEPT:
                    zombies.popitem(last=False)
                obj.dealloc()

    def autorelease(self, obj: SimObject) -> SimObject:
        pools = getattr(self.tls, "pools", None)
        if not pools:
            self.leaked_autoreleases += 1  # "autoreleased with no pool in place - just leaking"
        else:
            pools[-1][1].append(obj)
        return obj

    def pool_push(self) -> int:
        pools = getattr(self.tls, "pools", None)
        if pools is None:
            pools = self.tls.pools = []
        token = self._address()
        pools.append((token, []))
        return token

    def pool_pop(self, token: int) -> None:
        pools = getattr(self.tls, "pools", None) or []
        if token not in [t for t, _ in pools]:
            raise MetalValidationError(f"objc_autoreleasePoolPop({token:#x}): not a pool of this thread")
        failure = None
        while pools:
            t, objs = pools.pop()
            for obj in objs:
                try:
                    self.release(obj)
                except MetalValidationError as exc:   # drain the rest all the same, report the first
                    failure = failure or exc
            if t == token:
                break
        if failure is not None:
            raise failure

    def set_error(self, out, code: int, text: str) -> None:
        if out is not None:
            out[0] = self.ffi.cast("void *", self.autorelease(NSError(self, code, text)).addr)

    def live(self) -> List[SimObject]:
        """Objects not yet deallocated (classes excluded)."""
        with self.lock:
            return [o for o in self.objects.values() if not isinstance(o, SimClass)]

    def live_counts(self) -> Dict[str, int]:
        """{class name: live instances}."""
        counts: Dict[str, int] = {}
        for o in self.live():
            counts[o.cls_name] = counts.get(o.cls_name, 0) + 1
        return counts


# ---------------------------------------------------------------------------
# The library surface (what accel._ffi.open_library would return)
# ---------------------------------------------------------------------------
class _MsgSendSymbol:
    """The simulated ``objc_msgSend``: only usable through ``ffi.cast`` (as on arm64)."""

    def __call__(self, *args):
        raise MetalValidationError("objc_msgSend called without a cast to the method's exact type "
                                   "(variadic call: undefined behaviour on arm64)")


def _type_key(ffi, ctype) -> Tuple:
    """How the ABI sees a C type: (kind, size, signedness/name)."""
    if ctype.kind == "pointer":
        return ("pointer",)
    if ctype.kind == "struct":
        return ("struct", ctype.cname.replace("struct ", "").lstrip("_"))
    if ctype.kind == "void":
        return ("void",)
    if ctype.kind == "primitive":
        size = ffi.sizeof(ctype)
        if ctype.cname in ("float", "double", "long double"):
            return ("float", size)
        signed = int(ffi.cast(ctype, -1)) < 0 if ctype.cname != "_Bool" else False
        return ("int", size, signed, ctype.cname == "_Bool")
    return (ctype.kind, ctype.cname)


class _Sender:
    """``objc_msgSend`` cast to one C function type."""

    def __init__(self, rt: _State, ctype):
        self.rt = rt
        self.ctype = ctype
        self.checked: Dict[str, bool] = {}

    def _check_signature(self, selector: str) -> None:
        if selector in self.checked:
            return
        from accel.backends._objc import C_TYPES
        ffi = self.rt.ffi
        declared = DECLARED.get(selector)
        if declared is None:
            raise MetalValidationError(f"the Metal simulator does not implement {selector!r}; "
                                       f"add its declaration to accel.sim.metal.DECLARED")
        restype, argtypes = declared
        want = [_type_key(ffi, ffi.typeof(C_TYPES[t])) for t in (restype,) + argtypes]
        got = [_type_key(ffi, self.ctype.result)] + [_type_key(ffi, a) for a in self.ctype.args[2:]]
        fixed = [_type_key(ffi, a) for a in self.ctype.args[:2]]
        if fixed != [("pointer",), ("pointer",)] or want != got:
            raise MetalValidationError(
                f"objc_msgSend cast to {self.ctype.cname} for {selector!r}, declared as "
                f"{restype} ({', '.join(('id', 'SEL') + argtypes)}): the ABI would not match")
        self.checked[selector] = True

    def _arg(self, ctype, value):
        """Convert one argument as a cffi call would (and validate it)."""
        ffi = self.rt.ffi
        if ctype.kind == "pointer":
            if value is None:
                raise TypeError(f"initializer for ctype '{ctype.cname}' must be a cdata pointer, not None")
            if isinstance(value, bytes) and ctype.item.cname in ("char", "void"):
                return value
            if not isinstance(value, ffi.CData):
                raise TypeError(f"initializer for ctype '{ctype.cname}' must be a cdata pointer, "
                                f"not {type(value).__name__}")
            return value
        if ctype.kind == "struct":
            if not isinstance(value, ffi.CData) or ffi.typeof(value) is not ctype:
                raise TypeError(f"expected a {ctype.cname} struct by value, got {value!r}")
            return value
        return ffi.new(ctype.cname + " *", value)[0]

    def _object(self, value) -> Optional[SimObject]:
        addr = int(self.rt.ffi.cast("uintptr_t", value))
        return None if addr == 0 else self.rt.get(addr)

    @core.deferred      # atomic for Python signal handlers, as a C call (core)
    def __call__(self, receiver, sel, *args):
        rt, ffi = self.rt, self.rt.ffi
        selector = rt.selectors.get(int(ffi.cast("uintptr_t", sel)))
        if selector is None:
            raise MetalValidationError("objc_msgSend with a SEL that sel_registerName did not return")
        self._check_signature(selector)
        declared_args = DECLARED[selector][1]
        argc = len(self.ctype.args) - 2
        if len(args) != argc:
            raise TypeError(f"{selector}: expected {argc} arguments, got {len(args)}")
        target = self._object(receiver)
        if target is None:
            return self._result(None)  # messages to nil return zero
        if selector in COUNTED:
            next(core.counter_box(selector)[0])
            if selector in NIL_ON_FAULT and core.take_fault(selector):
                return self._result(None)
        values = []
        keep = []   # bytes arguments' copies, alive for the call
        for objc_type, ctype, value in zip(declared_args, self.ctype.args[2:], args):
            value = self._arg(ctype, value)
            if objc_type == "id":
                value = self._object(value)
            elif objc_type == "id *":
                value = None if value == ffi.NULL else ffi.cast("void **", value)
            elif ctype.kind == "pointer":
                if isinstance(value, bytes):
                    # cffi passes a bytes object to a char * / void * parameter as a pointer to its
                    # data (NUL-terminated, as CPython keeps it): the method sees an address, as on a
                    # Mac (r69e: newBufferWithBytes:/setBytes: raised TypeError for bytes).
                    keep.append(ffi.new("char[]", value))
                    value = keep[-1]
                value = int(ffi.cast("uintptr_t", value))
            values.append(value)
        fn = target.method(selector)
        if selector != "waitUntilCompleted":
            with rt.lock:
                result = fn(*values)
        else:
            result = fn(*values)  # blocks: must not hold the lock the workers need
        return self._result(result)

    def _result(self, value):
        ffi, res = self.rt.ffi, self.ctype.result
        if res.kind == "void":
            return None
        if res.kind == "pointer":
            if value is None:
                return ffi.cast(res, 0)
            if isinstance(value, SimObject):
                return ffi.cast(res, value.addr)
            if isinstance(value, ffi.CData):
                return ffi.cast(res, value)
            return ffi.cast(res, value)
        if res.kind == "struct":
            return value
        return ffi.new(res.cname + " *", 0 if value is None else value)[0]


class SimFFI:
    """The real objc FFI, except ``cast`` of the simulated ``objc_msgSend``."""

    def __init__(self, ffi, rt: _State, symbol: _MsgSendSymbol):
        self._ffi = ffi
        self._rt = rt
        self._symbol = symbol

    def cast(self, ctype, value):
        if value is self._symbol:
            t = self._ffi.typeof(ctype) if isinstance(ctype, str) else ctype
            if t.kind != "function":  # cffi's kind for a pointer-to-function type
                raise TypeError("objc_msgSend must be cast to a function pointer type")
            if t.ellipsis:
                raise MetalValidationError("objc_msgSend cast to a variadic type (wrong on arm64)")
            return _Sender(self._rt, t)
        return self._ffi.cast(ctype, value)

    def __getattr__(self, name):
        return getattr(self._ffi, name)


class SimObjCLibrary:
    """libobjc's functions, over :class:`_State`."""

    def __init__(self, rt: _State):
        self._rt = rt
        self.objc_msgSend = _MsgSendSymbol()

    def _addr(self, p) -> int:
        return int(self._rt.ffi.cast("uintptr_t", p))

    def _name(self, p) -> str:
        return (p if isinstance(p, bytes) else self._rt.ffi.string(p)).decode()

    def objc_getClass(self, name):
        cls = self._rt.classes.get(self._name(name))
        return self._rt.ffi.cast("void *", cls.addr if cls else 0)

    def sel_registerName(self, name):
        rt, text = self._rt, self._name(name)
        with rt.lock:
            addr = rt.selector_addr.get(text)
            if addr is None:
                addr = rt.next_addr
                rt.next_addr += 0x40
                rt.selector_addr[text] = addr
                rt.selectors[addr] = text
                rt.selector_names[text] = rt.ffi.new("char[]", text.encode())
        return rt.ffi.cast("void *", addr)

    def sel_getName(self, sel):
        return self._rt.selector_names[self._rt.selectors[self._addr(sel)]]

    @core.deferred
    def objc_retain(self, obj):
        addr = self._addr(obj)
        if addr:
            self._rt.retain(self._rt.get(addr))
        return obj

    @core.deferred
    def objc_release(self, obj):
        addr = self._addr(obj)
        if addr:
            self._rt.release(self._rt.get(addr))

    @core.deferred
    def objc_autorelease(self, obj):
        addr = self._addr(obj)
        if addr:
            self._rt.autorelease(self._rt.get(addr))
        return obj

    @core.deferred
    def objc_autoreleasePoolPush(self):
        return self._rt.ffi.cast("void *", self._rt.pool_push())

    @core.deferred
    def objc_autoreleasePoolPop(self, token):
        self._rt.pool_pop(self._addr(token))

    def object_getClassName(self, obj):
        obj = self._rt.get(self._addr(obj))
        name = obj.name if isinstance(obj, SimClass) else obj.cls_name
        return self._rt.ffi.new("char[]", name.encode())

    def object_getClass(self, obj):
        obj = self._rt.get(self._addr(obj))
        cls = self._rt.classes.get(obj.cls_name)
        return self._rt.ffi.cast("void *", cls.addr if cls else 0)


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


# ---------------------------------------------------------------------------
# Module API
# ---------------------------------------------------------------------------
_lock = threading.Lock()
_libraries = None  # ((ffi, objc, path), (ffi, metal, path))
_state: Optional[_State] = None


def open_libraries():
    """``((ffi, objc_lib, path), (ffi, metal_lib, path))`` as ``accel._ffi.open_library`` gives them."""
    global _libraries, _state
    with _lock:
        if _libraries is None:
            from accel._ffi import _objc as objc_decls
            core.config()  # read the environment now, as opening a library does
            rt = _State(objc_decls.ffi)
            objc = SimObjCLibrary(rt)
            ffi = SimFFI(objc_decls.ffi, rt, objc.objc_msgSend)
            _state = rt
            _libraries = ((ffi, objc, "<accel simulated libobjc>"),
                          (ffi, SimMetalLibrary(rt), "<accel simulated Metal.framework>"))
        return _libraries


def open_library():
    """The simulated libobjc (``accel.sim.open_library("objc")``); the mps backend uses
    :func:`open_libraries`, which also gives the FFI whose ``cast`` of ``objc_msgSend``
    the simulator intercepts, and the simulated Metal."""
    return open_libraries()[0][1]


def state() -> _State:
    """The simulator's runtime state (opens the simulated libraries if needed)."""
    open_libraries()
    return _state


def max_buffer_length() -> int:
    """MTLDevice.maxBufferLength: 3/4 of the working set, whole pages. Apple does not fix the ratio;
    real devices report less than recommendedMaxWorkingSetSize, so one buffer cannot take it all."""
    return core.config().memory * 3 // 4 // PAGE * PAGE or PAGE


def device_count() -> int:
    """Devices the simulated Metal exposes: Metal has one system default device (0 if configured so)."""
    return min(core.config().devices, 1)


def reset() -> None:
    """Forget the simulated runtime; the next open starts fresh (faults and config are core's)."""
    global _libraries, _state
    with _lock:
        if _state is not None:
            _state.close()
        _libraries = None
        _state = None


def _forget_after_fork() -> None:
    # The parent's worker threads and locks do not exist in the child: drop, do not close.
    # Metal does not survive fork (its GPU connection and threads stay in the parent), so every
    # message to a Metal object the child inherited fails with MetalForkError, where a Mac
    # crashes or hangs; the child may open Metal afresh (open_libraries) and use new objects.
    global _libraries, _state, _lock
    _lock = threading.Lock()
    if _state is not None and _state.after_fork():
        return   # Metal was not started in the parent: the child goes on with the same libraries
    _libraries = None
    _state = None


core.on_reset("metal", reset, _forget_after_fork)
def _state_fields() -> dict:
    """accel.sim.state() fields: whether Metal started, the Objective-C objects not yet deallocated
    ({class name: count}; a leak test compares them) and autoreleases made with no pool in place
    (each one leaks on a Mac)."""
    st = _state
    return {"metal_runtime_initialized": bool(st is not None and st.runtime_initialized),
            "metal_live_objects": st.live_counts() if st is not None else {},
            "metal_leaked_autoreleases": st.leaked_autoreleases if st is not None else 0}


core.on_state("metal", _state_fields)
