"""Command encoders: blit copies and fills, compute bindings and dispatches.

An encoder records commands into its command buffer (:mod:`.commands`) until
``endEncoding``; one released without it is refused.  The blit encoder checks what Metal's
validation checks on macOS (offsets and sizes multiples of 4, non-empty ranges inside the
buffers) and refuses what the documentation leaves undefined (an empty copy, overlapping
ranges of one buffer).  The compute encoder checks buffer and threadgroup-memory indices and
lengths, and at each dispatch the pipeline, the grid, the threadgroup size and that every
kernel argument is bound the way the reference expects (a buffer for a pointer, bytes of the
scalar's size); the dispatch runs the kernel's numpy reference.
"""

from __future__ import annotations

import ctypes
import struct
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from .. import _memory, core, kernels
from .buffers import MTLBuffer
from .compiler import MTLComputePipelineState
from .objects import SimObject
from .rules import _MAX_BUFFER_INDEX, _MAX_THREADGROUP_INDEX, MAX_THREADGROUP_MEMORY, MetalValidationError, _as

if TYPE_CHECKING:
    from .commands import MTLCommandBuffer


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
        static = self.pipeline.m_staticThreadgroupMemoryLength()
        if static + sum(self.tg_memory.values()) > MAX_THREADGROUP_MEMORY:
            # setThreadgroupMemoryLength(_:index:): "The sum of all threadgroup memory allocations
            # (whether made using this method or directly in the shader) can't exceed the device
            # limits for threadgroup memory.  Check threadgroup memory limits with the
            # staticThreadgroupMemoryLength property"
            raise MetalValidationError(f"kernel {self.pipeline.function.name}: {static} bytes of threadgroup "
                                       f"variables and {self.tg_memory} set by setThreadgroupMemoryLength: sum past "
                                       f"maxThreadgroupMemoryLength ({MAX_THREADGROUP_MEMORY})")
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


def _check_range(what: str, buf: MTLBuffer, off: int, n: int) -> None:
    if off + n > buf.length:
        raise MetalValidationError(f"{what} range [{off}, {off + n}) outside the {buf.length}-byte buffer")
