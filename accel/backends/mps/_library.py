"""The libraries, the Objective-C messages this backend sends, Metal's constants, and errors.

:class:`_Libraries` opens libobjc and Metal (real, or the simulator ``accel.sim.metal`` under
``ACCEL_SIM=mps``) and never initializes Metal.  Every message is declared once here, as
``M_* = Message(selector, return type, argument types...)`` with the exact C signature from the
Metal headers (``accel.backends._objc`` casts ``objc_msgSend`` to it).  :class:`LibraryMixin`
holds the helpers every concern uses: the runtime (refused before init and after close), a
``new…`` message's owned result, encoders ended on every path, handle numbering, and the
errors for a handle or pointer this backend did not hand out.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Optional

from ..._errors import AcceleratorError
from .. import _objc
from .._objc import Message

_LIBRARY = "Metal"

# -- Metal constants (Metal/MTLResource.h, MTLCommandBuffer.h) ---------------
_STORAGE_SHARED = 0  # MTLResourceStorageModeShared | CPUCacheModeDefaultCache | HazardTrackingModeDefault
_CB_STATUS = ("MTLCommandBufferStatusNotEnqueued", "MTLCommandBufferStatusEnqueued",
              "MTLCommandBufferStatusCommitted", "MTLCommandBufferStatusScheduled",
              "MTLCommandBufferStatusCompleted", "MTLCommandBufferStatusError")
_CB_COMPLETED, _CB_ERROR = 4, 5
_CB_ERRORS = {0: "MTLCommandBufferErrorNone", 1: "MTLCommandBufferErrorInternal",
              2: "MTLCommandBufferErrorTimeout", 3: "MTLCommandBufferErrorPageFault",
              4: "MTLCommandBufferErrorAccessRevoked", 7: "MTLCommandBufferErrorNotPermitted",
              8: "MTLCommandBufferErrorOutOfMemory", 9: "MTLCommandBufferErrorInvalidResource",
              10: "MTLCommandBufferErrorMemoryless", 11: "MTLCommandBufferErrorDeviceRemoved",
              12: "MTLCommandBufferErrorStackOverflow"}

# -- the messages this backend sends, with their exact C signatures ----------
# (types from the Metal headers; e.g. recommendedMaxWorkingSetSize is uint64_t,
# currentAllocatedSize NSUInteger, MTLResourceOptions/MTLCommandBufferStatus NSUInteger)
M_NAME = Message("name", "id")
M_REGISTRY_ID = Message("registryID", "uint64_t")
M_RECOMMENDED_MAX = Message("recommendedMaxWorkingSetSize", "uint64_t")
M_CURRENT_ALLOCATED = Message("currentAllocatedSize", "NSUInteger")
M_HAS_UNIFIED = Message("hasUnifiedMemory", "BOOL")
M_MAX_BUFFER_LENGTH = Message("maxBufferLength", "NSUInteger")
M_NEW_QUEUE = Message("newCommandQueue", "id")
M_NEW_BUFFER = Message("newBufferWithLength:options:", "id", "NSUInteger", "NSUInteger")
M_NEW_BUFFER_BYTES = Message("newBufferWithBytes:length:options:", "id",
                             "const void *", "NSUInteger", "NSUInteger")
M_NEW_SHARED_EVENT = Message("newSharedEvent", "id")
M_CONTENTS = Message("contents", "void *")
M_LENGTH = Message("length", "NSUInteger")
M_COMMAND_BUFFER = Message("commandBuffer", "id")
M_COMMIT = Message("commit", "void")
M_WAIT = Message("waitUntilCompleted", "void")
M_STATUS = Message("status", "NSUInteger")
M_ERROR = Message("error", "id")
M_GPU_START = Message("GPUStartTime", "CFTimeInterval")
M_GPU_END = Message("GPUEndTime", "CFTimeInterval")
M_SIGNAL_EVENT = Message("encodeSignalEvent:value:", "void", "id", "uint64_t")
M_WAIT_EVENT = Message("encodeWaitForEvent:value:", "void", "id", "uint64_t")
M_SIGNALED_VALUE = Message("signaledValue", "uint64_t")
M_BLIT_ENCODER = Message("blitCommandEncoder", "id")
M_COPY = Message("copyFromBuffer:sourceOffset:toBuffer:destinationOffset:size:", "void",
                 "id", "NSUInteger", "id", "NSUInteger", "NSUInteger")
M_FILL = Message("fillBuffer:range:value:", "void", "id", "NSRange", "uint8_t")
M_END_ENCODING = Message("endEncoding", "void")
M_NEW_OPTIONS = Message("new", "id")
M_SET_FAST_MATH = Message("setFastMathEnabled:", "void", "BOOL")
M_NEW_LIBRARY = Message("newLibraryWithSource:options:error:", "id", "id", "id", "id *")
M_NEW_FUNCTION = Message("newFunctionWithName:", "id", "id")
M_NEW_PIPELINE = Message("newComputePipelineStateWithFunction:error:", "id", "id", "id *")
M_MAX_THREADS = Message("maxTotalThreadsPerThreadgroup", "NSUInteger")
M_STATIC_THREADGROUP_MEMORY = Message("staticThreadgroupMemoryLength", "NSUInteger")
M_COMPUTE_ENCODER = Message("computeCommandEncoder", "id")
M_SET_PIPELINE = Message("setComputePipelineState:", "void", "id")
M_SET_BUFFER = Message("setBuffer:offset:atIndex:", "void", "id", "NSUInteger", "NSUInteger")
M_SET_BYTES = Message("setBytes:length:atIndex:", "void", "const void *", "NSUInteger", "NSUInteger")
M_SET_THREADGROUP_MEMORY = Message("setThreadgroupMemoryLength:atIndex:", "void",
                                   "NSUInteger", "NSUInteger")
M_DISPATCH = Message("dispatchThreadgroups:threadsPerThreadgroup:", "void", "MTLSize", "MTLSize")


def _simulated() -> bool:
    return os.environ.get("ACCEL_SIM", "").strip().lower() == "mps"     # (as cuda and xpu read it, r70l)


class _InvalidHandle(AcceleratorError, ValueError):
    """A handle or pointer this backend did not hand out (or already released)."""


def _bad(kind: str, value: Any, hint: str) -> _InvalidHandle:
    shown = hex(value) if isinstance(value, int) and kind == "pointer" else repr(value)
    return _InvalidHandle(f"mps: {shown} is not a live {kind} of this backend; {hint}")


class _Libraries:
    """The opened libobjc and Metal (real or simulated); never initializes Metal."""

    def __init__(self) -> None:
        self.objc_ffi = self.objc_lib = self.metal_lib = None
        self.paths: Dict[str, str] = {}
        self.reason: Optional[str] = None
        self.load_error: Optional[str] = None
        self.simulated = _simulated()
        try:
            if self.simulated:
                from accel.sim import metal as sim_metal
                (self.objc_ffi, self.objc_lib, objc_path), (_, self.metal_lib, metal_path) = \
                    sim_metal.open_libraries()
            else:
                from accel._ffi import open_library
                self.objc_ffi, self.objc_lib, objc_path = open_library("objc")
                _, self.metal_lib, metal_path = open_library("metal")
            self.paths = {"objc": objc_path, "metal": metal_path}
        except OSError as exc:  # LibraryNotFound: not macOS, or no Metal framework
            self.objc_ffi = self.objc_lib = self.metal_lib = None
            which = getattr(exc, "name", None) or "objc"
            self.reason = (f"libobjc/Metal not found (the {which} library did not load; load_error "
                           f"lists the paths tried): the mps backend needs macOS with Metal")
            self.load_error = str(exc)

    @property
    def ok(self) -> bool:
        return self.objc_lib is not None and self.metal_lib is not None


class LibraryMixin:
    """The runtime and the helpers every concern uses (``_rt``, ``_device``, ``_next_handle``)."""

    def _runtime(self) -> _objc.Runtime:
        if self._device is None:
            raise AcceleratorError("mps: the Metal runtime is not initialized (call init() first)",
                                   library=_LIBRARY)
        return self._rt

    def _missing(self, kind: str, value: Any, hint: str) -> _InvalidHandle:
        """The error for a handle or pointer the tables do not hold: the not-initialized error
        when close() in another thread emptied them after the caller's liveness check (r43: the
        user's handle was valid; "not a live stream" misled), else the bad-handle error."""
        self._runtime()
        return _bad(kind, value, hint)

    def _new(self, receiver: Any, msg: Message, what: str, *args: Any) -> Any:
        obj = self._rt.send(receiver, msg, *args)
        if obj == self._rt.nil:
            raise AcceleratorError(f"mps: {what} returned nil", library=_LIBRARY, call=msg.selector)
        return self._rt.owned(msg, obj)

    def _encoder(self, cb: Any, msg: Message) -> Any:
        # MTLCommandBuffer.h declares the encoder factories nullable (autoreleased: not owned).
        enc = self._rt.send(cb, msg)
        if enc == self._rt.nil:
            raise AcceleratorError(f"mps: {msg.selector} returned nil", library=_LIBRARY, call=msg.selector)
        return enc

    @contextlib.contextmanager
    def _encoding(self, cb: Any, msg: Message):
        """An encoder that is ended on every path: a command buffer left with an active encoder
        can never be committed again (Metal aborts at the next encoder or commit)."""
        enc = self._encoder(cb, msg)
        try:
            yield enc
        finally:
            self._rt.send(enc, M_END_ENCODING)

    def _handle(self) -> int:
        h = self._next_handle
        self._next_handle += 1
        return h
