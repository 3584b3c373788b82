"""Apple MPS backend: Metal through the Objective-C runtime (libobjc + cffi).

Model (what the Backend protocol's CUDA-shaped handles mean on Metal):

* **Pointers.**  Metal has buffers, not device addresses.  Every allocation is
  an ``MTLBuffer`` in shared storage (Apple GPUs have unified memory), and the
  "device pointer" handed out is its ``contents`` address.  A sorted table of
  base addresses resolves any interior pointer to ``(buffer, offset)`` with
  ``bisect``, so copies, fills and kernel arguments take sub-ranges of a
  block exactly as CUDA pointers do.  Pinned host memory is the same kind of
  buffer (what torch's MPS pinned allocator does).
* **Streams.**  One ``MTLCommandQueue`` per stream (handle 0 is the default
  queue, created at init).  Each stream has one open command buffer that
  collects work; it is committed at every point where the host or another
  stream can observe progress: stream synchronize/query, event record,
  device synchronize, and after ``_MAX_OPS`` commands so long asynchronous
  sequences start running.  Command buffers within a queue, and encoders
  within a command buffer, are ordered by Metal's hazard tracking (the
  buffers are created with the default, tracked, hazard mode).
* **Events.**  An ``MTLSharedEvent`` with a monotonically increasing value:
  record encodes ``encodeSignalEvent:value:`` (value+1) at the end of the
  stream's command buffer and commits it; another stream waits with
  ``encodeWaitForEvent:value:``; query compares ``signaledValue``;
  synchronize waits for the command buffer that carries the signal.
* **Timing.**  Metal has no timestamp at a point in a queue, only per command
  buffer ``GPUStartTime``/``GPUEndTime`` (seconds, one GPU clock).  A timing
  event's record ends the command buffer with a 4-byte fill of a scratch
  buffer (so the buffer always does GPU work and carries timestamps) and the
  event's time is that buffer's ``GPUEndTime``.  ``elapsed_ms`` is the
  difference, resolution as Metal reports it.
* **Copies.**  Buffer to buffer: a blit ``copyFromBuffer:...``.  Pageable
  host to buffer: the source is copied into a staging buffer before the call
  returns (``newBufferWithBytes:length:options:``), then blitted in order.
  To pageable host: the stream is synchronized and the bytes are copied on the
  host (unified memory).  macOS requires blit offsets and sizes to be
  multiples of 4; other copies and fills take the synchronize-and-copy-on-the-
  host path.
* **Kernels.**  Metal Shading Language compiled at run time
  (``newLibraryWithSource:options:error:``, fast math off), one compute
  pipeline per function.  CUDA's grid of blocks maps to
  ``dispatchThreadgroups:threadsPerThreadgroup:``; argument ``i`` binds to
  ``[[buffer(i)]]``: pointers with ``setBuffer:offset:atIndex:``, scalars with
  ``setBytes:length:atIndex:``.
* **Graphs.**  Not supported: Metal has no stream capture (work submitted to
  a command queue cannot be recorded for replay), so ``supports_graphs`` is
  False and the graph methods raise ``NotImplementedError`` saying so.

Ctrl-C: a Python signal handler can run as any ``objc_msgSend`` returns, so the backend's
short sequences that make and store, or make and end, Metal objects (an encoder and its
``endEncoding``, a command buffer and its retain, an event's signal and the commit) run with
signals deferred in the main thread (``_signals.deferred``, about 1.5 us a call); waits
(``waitUntilCompleted``) are not deferred, and what they hold is given back on every path.

Ownership: objects from ``new…`` methods and ``MTLCreateSystemDefaultDevice``
are owned (+1) and released when their handle is destroyed; autoreleased
results that are kept (command buffers) are retained; every call that makes
autoreleased objects runs inside an autorelease pool.
"""

from __future__ import annotations

import bisect
import contextlib
import operator
import os
import threading
from typing import Any, Dict, List, Optional, Tuple

from .. import _locks
from .._errors import AcceleratorError, CompileError, OutOfMemoryError
from . import _objc
from ._objc import Message
from ._signals import deferred
from .base import Backend, DeviceProperties, KernelArgs

__all__ = ["MPSBackend", "create"]

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
_MAX_OPS = 64          # commit a stream's open command buffer after this many commands
_MAX_BUFFER_INDEX = 31  # [[buffer(0..30)]]
_MAX_GRID = 2 ** 32 - 1            # threadgroups per grid dimension (a uint position in MSL)
_MAX_THREADGROUP_MEMORY = 32 * 1024  # maxThreadgroupMemoryLength on Apple GPU families

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
M_COMPUTE_ENCODER = Message("computeCommandEncoder", "id")
M_SET_PIPELINE = Message("setComputePipelineState:", "void", "id")
M_SET_BUFFER = Message("setBuffer:offset:atIndex:", "void", "id", "NSUInteger", "NSUInteger")
M_SET_BYTES = Message("setBytes:length:atIndex:", "void", "const void *", "NSUInteger", "NSUInteger")
M_SET_THREADGROUP_MEMORY = Message("setThreadgroupMemoryLength:atIndex:", "void",
                                   "NSUInteger", "NSUInteger")
M_DISPATCH = Message("dispatchThreadgroups:threadsPerThreadgroup:", "void", "MTLSize", "MTLSize")

# Kernel scalar argument kinds (base.KERNEL_ARG_TYPES) -> C type for setBytes.
_SCALAR_CTYPES = {"u32": "uint32_t", "i32": "int32_t", "u64": "uint64_t", "i64": "int64_t",
                  "f32": "float"}

_SUPPORTED_DTYPES = frozenset({"bool", "uint8", "int8", "int16", "int32", "int64",
                               "float16", "float32"})  # Metal has no float64

_GRAPHS_UNSUPPORTED = (
    "MPS has no stream capture: Metal cannot record the work submitted to a command queue "
    "for later replay, so accel graphs (capture_begin/capture_end/replay) are not available "
    "on the mps backend; run the work eagerly instead")


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


class _Buffer:
    __slots__ = ("obj", "base", "length", "host")

    def __init__(self, obj: Any, base: int, length: int, host: bool):
        self.obj, self.base, self.length, self.host = obj, base, length, host


class _Committed:
    """A committed MTLCommandBuffer the backend tracks, and whether its failure was reported.

    Each holder (a stream's in-flight list, an event's latest record, a synchronize waiting on
    it) retains ``obj`` once and releases it once; the holders share this record, so a buffer
    that ended in MTLCommandBufferStatusError is reported to the user once, by the first call
    that sees it (stream_query, a synchronize, event_synchronize), and not again by later ones.
    """

    __slots__ = ("obj", "reported")

    def __init__(self, obj: Any):
        self.obj = obj
        self.reported = False


class _Stream:
    __slots__ = ("handle", "queue", "cb", "ops", "inflight")

    def __init__(self, handle: int, queue: Any):
        self.handle = handle
        self.queue = queue          # MTLCommandQueue, owned (+1)
        self.cb = None              # open MTLCommandBuffer, retained; None when nothing pending
        self.ops = 0                # commands encoded into cb
        self.inflight: List[_Committed] = []  # committed, retained, not yet known complete


class _Event:
    __slots__ = ("handle", "shared", "value", "cb", "timing")

    def __init__(self, handle: int, shared: Any, timing: bool):
        self.handle = handle
        self.shared = shared        # MTLSharedEvent, owned (+1)
        self.value = 0              # value of the latest record; 0 = never recorded
        self.cb: Optional[_Committed] = None  # retained command buffer carrying the latest signal
        self.timing = timing


class MPSBackend(Backend):
    """The Metal runtime behind the Backend protocol (one device: the system default)."""

    name = "mps"
    kernel_language = "msl"
    supports_graphs = False
    pinned_shares_device_memory = True      # host_alloc's buffers are shared MTLBuffers, as mem_alloc's

    def __init__(self) -> None:
        self._lock = _locks.RLock("the Metal backend")
        self._libs: Optional[_Libraries] = None
        self._rt: Optional[_objc.Runtime] = None
        self._device = None
        self._buffers: Dict[int, _Buffer] = {}
        self._bases: List[int] = []
        self._streams: Dict[int, _Stream] = {}
        self._events: Dict[int, _Event] = {}
        self._modules: Dict[int, Tuple[Any, List[int]]] = {}
        self._functions: Dict[int, Tuple[Any, Any, int, int]] = {}
        self._next_handle = 1
        self._scratch: Optional[_Buffer] = None
        self._tls = threading.local()
        # committed command buffers of destroyed streams, still running: device_synchronize waits
        # for them (cudaDeviceSynchronize waits for a destroyed stream's work too)
        self._orphans = _Stream(0, None)

    def fresh_locks_in_child(self) -> None:
        # loading the libraries (count) takes it; after init the child is refused anyway
        self._lock = _locks.RLock("the Metal backend")

    # -- discovery ---------------------------------------------------------------
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

    def close(self) -> None:
        """Release every Metal object this backend owns (tests use it to check for leaks).

        Waits for outstanding work first.  The backend can be initialized again.
        """
        with self._lock:
            if self._device is None:
                return
            rt = self._rt
        try:
            self._sync_streams(list(self._streams.values()))
        finally:
            self._release_everything(rt)

    @deferred
    def _release_everything(self, rt) -> None:
        """close()'s releases, signals deferred: a KeyboardInterrupt between a release and the
        table's emptying made a second close() release the same objects again (r70i)."""
        with self._lock, rt.pool():
            for fn in list(self._functions):
                pipeline, function, _, _ = self._functions.pop(fn)
                rt.release(pipeline)
                rt.release(function)
            for lib, _ in self._modules.values():
                rt.release(lib)
            self._modules.clear()
            # Emptied, not just released (as stream_destroy): a synchronize in another thread
            # that took the stream or event before this close waits outside the lock on its
            # own retains, then releases what is still listed on the stream: a second release
            # of a buffer released here (r43; a Mac crashes).
            for ev in self._events.values():
                self._release_committed(ev.cb)
                ev.cb = None
                rt.release(ev.shared)
            self._events.clear()
            for st in self._streams.values():
                rt.release(st.cb)
                st.cb = None
                for cmd in st.inflight:
                    rt.release(cmd.obj)
                st.inflight = []
                rt.release(st.queue)
            self._streams.clear()
            for cmd in self._orphans.inflight:
                rt.release(cmd.obj)
            self._orphans.inflight = []
            for buf in self._buffers.values():
                rt.release(buf.obj)
            self._buffers.clear()
            self._bases.clear()
            if self._scratch is not None:
                rt.release(self._scratch.obj)
                self._scratch = None
            rt.release(self._device)
            self._device = None

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

    def _live(self, buf: _Buffer) -> None:
        """Refuse a buffer looked up before the lock was taken and released since (lock held):
        freed, or released by close() (then maybe re-initialized: stream 0 is live again).  A
        blit or a host copy through it would use a released MTLBuffer (a Mac crashes)."""
        if self._buffers.get(buf.base) is not buf:
            raise self._missing("pointer", buf.base, "the allocation was freed (or the backend closed) "
                                "before the work was queued")

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

    def device_synchronize(self) -> None:
        self._runtime()
        with self._lock:
            streams = list(self._streams.values())
            if self._orphans.inflight:
                streams.append(self._orphans)
        self._sync_streams(streams)

    def mem_info(self) -> Tuple[int, int]:
        """(recommendedMaxWorkingSetSize - currentAllocatedSize, recommendedMaxWorkingSetSize)."""
        with self._lock:        # the device is not released meanwhile (see properties)
            rt = self._runtime()
            total = int(rt.send(self._device, M_RECOMMENDED_MAX))
            used = int(rt.send(self._device, M_CURRENT_ALLOCATED))
        return max(total - used, 0), total

    # -- memory ---------------------------------------------------------------------
    def _new_buffer(self, nbytes: int, host: bool, register: bool = True) -> _Buffer:
        rt = self._rt
        obj = rt.send(self._device, M_NEW_BUFFER, nbytes, _STORAGE_SHARED)
        if obj == rt.nil:  # Metal's out-of-memory answer
            max_buffer = int(rt.send(self._device, M_MAX_BUFFER_LENGTH))
            if nbytes > max_buffer:
                # MTLDevice.maxBufferLength caps one buffer, however much memory is free (torch MPS
                # refuses such a size as "Invalid buffer size").
                raise OutOfMemoryError(
                    f"mps: cannot allocate {nbytes} bytes in one buffer: the device's maxBufferLength is "
                    f"{max_buffer} bytes (newBufferWithLength: returned nil); allocate smaller pieces",
                    library=_LIBRARY, call=M_NEW_BUFFER.selector)
            used = int(rt.send(self._device, M_CURRENT_ALLOCATED))
            limit = int(rt.send(self._device, M_RECOMMENDED_MAX))
            raise OutOfMemoryError(
                f"mps: newBufferWithLength:{nbytes} options:shared returned nil (out of memory; "
                f"{used} bytes allocated, recommended working set {limit} bytes)",
                library=_LIBRARY, call=M_NEW_BUFFER.selector)
        buf = _Buffer(obj, rt.address(rt.send(obj, M_CONTENTS)), nbytes, host)
        if register:
            with self._lock:
                self._buffers[buf.base] = buf
                bisect.insort(self._bases, buf.base)
        return buf

    @deferred
    def _alloc(self, nbytes: int, host: bool) -> int:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool):
            raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative number of bytes ({nbytes})")
        self._runtime()
        if nbytes == 0:
            return 0  # as cudaMalloc(0): a null pointer that may be freed
        with self._lock:        # the device is not released meanwhile (see properties)
            rt = self._runtime()
            if nbytes >= 1 << 64:
                # More than an NSUInteger holds (the argument of newBufferWithLength:): no device has it.
                max_buffer = int(rt.send(self._device, M_MAX_BUFFER_LENGTH))
                raise OutOfMemoryError(
                    f"mps: cannot allocate {nbytes} bytes: more than an NSUInteger holds; the device's "
                    f"maxBufferLength is {max_buffer} bytes; allocate smaller pieces",
                    library=_LIBRARY, call=M_NEW_BUFFER.selector)
            return self._new_buffer(nbytes, host).base

    def _free(self, ptr: int, host: bool) -> None:
        if ptr == 0:
            return
        self._runtime()         # (refuses a runtime torn down or of the parent process)
        if not host:
            with self._lock:
                self._freeable(ptr, host)
            # torch's MPS allocator commits and waits for the stream before it releases cached
            # buffers (aten/src/ATen/mps/MPSAllocator.mm, release_cached_buffers: "before
            # releasing the buffers make sure the command buffer has finished"): a command
            # buffer retains the buffers it uses, so an open one would keep this memory with
            # Metal (currentAllocatedSize) until some later synchronize.  As cudaFree, a failed
            # wait raises before anything is freed.
            self.device_synchronize()
        self._release_buffer(ptr, host)

    @deferred
    def _release_buffer(self, ptr: int, host: bool) -> None:
        """Forget and release the buffer at ``ptr``; signals deferred: a handler run between
        the two would leave a live buffer nobody can free, or a table entry for a dead one."""
        with self._lock:
            buf = self._freeable(ptr, host)
            del self._buffers[ptr]
            del self._bases[bisect.bisect_left(self._bases, ptr)]
        # Command buffers retain the buffers they use: queued work still reads valid memory.
        self._rt.release(buf.obj)

    def _freeable(self, ptr: int, host: bool) -> _Buffer:
        """The live buffer at ``ptr`` of that kind (lock held), else the error naming it."""
        buf = self._buffers.get(ptr)
        if buf is None or buf.host != host:
            raise self._missing("pointer", ptr, f"free only pointers returned by "
                       f"{'host_alloc' if host else 'mem_alloc'}, once")
        return buf

    def mem_alloc(self, nbytes: int) -> int:
        return self._alloc(nbytes, host=False)

    def mem_free(self, ptr: int) -> None:
        self._free(ptr, host=False)

    def host_alloc(self, nbytes: int) -> int:
        """Pinned host memory: a shared-storage MTLBuffer (the GPU reads it in place)."""
        return self._alloc(nbytes, host=True)

    def host_free(self, ptr: int) -> None:
        self._free(ptr, host=True)

    def pointer_location(self, ptr: int) -> Optional[Tuple[str, int]]:
        """Inside a live MTLBuffer of this backend: device memory (private storage) or pinned
        host memory (host_alloc's shared buffers); Metal knows no other addresses."""
        try:
            found = self._resolve(ptr, 1)
        except ValueError:
            found = None
        if found is None:
            return ("unknown", -1)
        return ("host", -1) if found[0].host else ("device", 0)

    def dlpack_data(self, ptr: int) -> Tuple[int, int]:
        """A kDLMetal capsule's ``data`` is the id<MTLBuffer> (``byte_offset`` the offset into it),
        as torch's MPS tensors, MLX and TVM read it (torch: getMTLBufferStorage bit-casts the
        storage's data pointer to id<MTLBuffer>); dlpack.h: data "may be opaque on some device
        types", and byte_offset points "to the beginning of the data"."""
        found = self._resolve(ptr, 1)
        if found is None:
            raise ValueError(f"mps: {ptr:#x} is not in an MTLBuffer of this backend; nothing was exported")
        buf, offset = found
        return self._runtime().address(buf.obj), offset

    def dlpack_address(self, data: int, byte_offset: int) -> int:
        """The contents address of a kDLMetal capsule's bytes: ``data`` names one of this
        backend's MTLBuffers (the form torch and accel export), or, as accel exported before, is
        an address inside one.  Anything else is taken as an address, which the importer then
        refuses as memory Metal does not own here: accel encodes work only on buffers it
        allocated, and messaging an unknown object could crash."""
        if not data:
            return byte_offset      # (a zero-size tensor's NULL data)
        with self._lock:
            for buf in self._buffers.values():
                if self._runtime().address(buf.obj) == data:
                    return buf.base + byte_offset
        # an address inside one (accel's earlier form), or memory Metal does not own here, which
        # the importer's range checks then refuse by name (never messaged as an object)
        return data + byte_offset

    def _resolve(self, ptr: int, nbytes: int) -> Optional[Tuple[_Buffer, int]]:
        """(buffer, offset) holding [ptr, ptr+nbytes), or None for memory Metal does not own."""
        if not isinstance(ptr, int) or isinstance(ptr, bool):
            raise TypeError(f"pointer must be an int, got {type(ptr).__name__}")
        with self._lock:
            i = bisect.bisect_right(self._bases, ptr) - 1
            if i < 0:
                return None
            buf = self._buffers[self._bases[i]]
        off = ptr - buf.base
        if off >= buf.length:
            return None
        if off + nbytes > buf.length:
            raise ValueError(f"mps: {nbytes} bytes at {ptr:#x} overrun the {buf.length}-byte "
                             f"allocation at {buf.base:#x}")
        return buf, off

    # -- streams ---------------------------------------------------------------------
    def _stream(self, handle: int) -> _Stream:
        st = self._streams.get(handle)
        if st is None:
            if not isinstance(handle, int) or isinstance(handle, bool):
                raise TypeError(f"stream handle must be an int, got {type(handle).__name__}")
            raise self._missing("stream", handle, "use a handle from stream_create or default_stream(0)")
        return st

    def _open_cb(self, st: _Stream) -> Any:
        """The stream's open command buffer (created and retained on first use)."""
        if st.cb is None:
            st.cb = self._new(st.queue, M_COMMAND_BUFFER, "commandBuffer")
            st.ops = 0
        return st.cb

    def _encoded(self, st: _Stream) -> None:
        st.ops += 1
        if st.ops >= _MAX_OPS:
            self._commit(st)

    def _commit(self, st: _Stream) -> Optional[_Committed]:
        """Commit the open command buffer; returns it (still retained, now in flight)."""
        cb = st.cb
        if cb is None:
            return None
        # Interrupt safety: a signal's handler (Ctrl-C) runs as commit returns, the buffer then
        # committed; so it is no longer the open buffer before the call, and is in flight after.
        st.cb = None
        try:
            self._rt.send(cb, M_COMMIT)
        except Exception:
            st.cb = cb              # refused: still the open buffer
            raise
        except BaseException:
            st.inflight.append(_Committed(cb))
            raise
        # Forget buffers already known complete (or failed and reported) so the list stays short.
        cmd = _Committed(cb)
        st.inflight = self._still_running(st.inflight) + [cmd]
        return cmd

    def _still_running(self, cmds: List[_Committed]) -> List[_Committed]:
        """``cmds`` less those complete or failed and reported, which are released."""
        keep = []
        for cmd in cmds:
            status = int(self._rt.send(cmd.obj, M_STATUS))
            if status == _CB_COMPLETED or (status == _CB_ERROR and cmd.reported):
                self._rt.release(cmd.obj)
            else:
                keep.append(cmd)
        return keep

    def _release_committed(self, cmd: Optional[_Committed]) -> None:
        if cmd is not None:
            self._rt.release(cmd.obj)

    def _check_cb(self, cmd: _Committed) -> None:
        """Raise the error of a command buffer that failed, unless it was reported already."""
        rt = self._rt
        if cmd.reported or int(rt.send(cmd.obj, M_STATUS)) != _CB_ERROR:
            return
        with rt.pool():
            code, text = rt.error_text(rt.send(cmd.obj, M_ERROR))
        with self._lock:
            if cmd.reported:
                return   # another thread's call reported it meanwhile
            cmd.reported = True
        raise AcceleratorError.from_call(_LIBRARY, "MTLCommandBuffer", code,
                                         _CB_ERRORS.get(code, "MTLCommandBufferError"), text)

    def _sync_streams(self, streams: List[_Stream]) -> None:
        waits: List[Tuple[_Stream, List[_Committed]]] = []  # each listed buffer retained here
        waited: set = set()
        error = None
        try:
            self._take_waits(streams, waits)
            for st, cmds in waits:
                for cmd in cmds:
                    self._rt.send(cmd.obj, M_WAIT)   # signals not deferred: Ctrl-C ends a long wait
                    waited.add(id(cmd))
                    if error is None:          # one error per call; a later one stays for its event
                        try:
                            self._check_cb(cmd)
                        except AcceleratorError as exc:
                            error = exc
        finally:
            # On every path (an error, or a KeyboardInterrupt when a wait returns): the buffers
            # waited for leave the stream's list, and every retain taken above is given back.
            # A handler can run as _release_waits starts (before it defers signals): then it is
            # called again, as it does nothing twice.
            try:
                self._release_waits(waits, waited)
            except BaseException:
                self._release_waits(waits, waited)
                raise
        if error is not None:
            raise error

    @deferred
    def _take_waits(self, streams: List[_Stream], waits: List[Tuple[_Stream, List[_Committed]]]) -> None:
        """Commit each stream's open buffer; append (stream, its in-flight buffers, each retained)
        to ``waits`` (filled in place: a handler run as this returns loses no retain)."""
        rt = self._rt
        with self._lock, rt.pool():
            for st in streams:
                self._commit(st)
                cmds: List[_Committed] = []
                waits.append((st, cmds))
                for cmd in st.inflight:
                    rt.retain(cmd.obj)
                    cmds.append(cmd)

    @deferred
    def _release_waits(self, waits: List[Tuple[_Stream, List[_Committed]]], waited: set) -> None:
        """Undo :meth:`_take_waits`; ``waits`` is emptied, so a second call does nothing."""
        rt = self._rt
        with self._lock:
            while waits:
                st, cmds = waits.pop()
                remaining = []
                for cmd in st.inflight:
                    if id(cmd) in waited:
                        rt.release(cmd.obj)
                    else:
                        remaining.append(cmd)
                st.inflight = remaining
                for cmd in cmds:
                    rt.release(cmd.obj)

    @deferred
    def stream_create(self, priority: int = 0) -> int:
        with self._lock:        # the device is not released meanwhile (see properties)
            self._runtime()
            h = self._handle()
            self._streams[h] = _Stream(h, self._new(self._device, M_NEW_QUEUE, "newCommandQueue"))
        return h

    def foreign_stream(self, stream: int) -> Tuple[int, Optional[int]]:
        self._runtime()
        with self._lock:
            known = stream in self._streams
        if not known:
            raise ValueError(f"mps: {stream!r} is not a live stream of accel's Metal backend: its handles "
                             f"name command queues accel keeps, so it can wrap only the ones it created "
                             f"(backend.stream_create, default_stream)")
        return stream, 0

    @deferred
    def stream_destroy(self, stream: int) -> None:
        """Commit what is queued and drop the queue; committed work still completes (as CUDA)."""
        rt = self._runtime()
        if stream == 0:
            raise ValueError("mps: the default stream (0) cannot be destroyed")
        with self._lock:
            st = self._stream(stream)
            self._commit(st)
            del self._streams[stream]
            # Emptied, not just released: a synchronize of this stream waiting in another thread
            # releases what is still listed here when its wait ends (a double release otherwise).
            # The buffers still running move to the orphans, for device_synchronize to wait on.
            inflight, st.inflight = st.inflight, []
            self._orphans.inflight = self._still_running(self._orphans.inflight + inflight)
            rt.release(st.queue)

    def default_stream(self, index: int) -> int:
        self._check_index(index)
        return 0

    def stream_synchronize(self, stream: int) -> None:
        self._runtime()
        with self._lock:
            st = self._stream(stream)
        self._sync_streams([st])

    @deferred
    def stream_query(self, stream: int) -> bool:
        rt = self._runtime()
        with self._lock:
            st = self._stream(stream)
            self._commit(st)
            pending, error = [], None
            for cmd in st.inflight:
                status = int(rt.send(cmd.obj, M_STATUS))
                if status in (_CB_COMPLETED, _CB_ERROR):
                    if status == _CB_ERROR and error is None:
                        # Report it now (unless reported already), as cudaStreamQuery returns the
                        # stream's error: the buffer is forgotten here, so a later synchronize
                        # could not report it.
                        try:
                            self._check_cb(cmd)
                        except AcceleratorError as exc:
                            error = exc
                    rt.release(cmd.obj)
                else:
                    pending.append(cmd)
            st.inflight = pending
            if error is not None:
                raise error
            return not pending

    @deferred
    def stream_idle(self, stream: int) -> bool:
        """Whether every command buffer of ``stream`` has ended (completed or failed), reporting
        nothing: stream_query reports a failed buffer and forgets it, so a close that asked it
        lost the error its synchronize (or, after the destroy, the device's) would have raised."""
        rt = self._runtime()
        with self._lock:
            st = self._stream(stream)
            self._commit(st)
            return all(int(rt.send(cmd.obj, M_STATUS)) in (_CB_COMPLETED, _CB_ERROR) for cmd in st.inflight)

    @deferred
    def stream_wait_event(self, stream: int, event: int) -> None:
        rt = self._runtime()
        with self._lock, rt.pool():
            st = self._stream(stream)
            ev = self._event(event)
            if ev.value == 0:
                return  # never recorded: nothing to wait for (as cudaStreamWaitEvent)
            rt.send(self._open_cb(st), M_WAIT_EVENT, ev.shared, ev.value)
            self._encoded(st)

    # -- events -----------------------------------------------------------------------
    def _event(self, handle: int) -> _Event:
        ev = self._events.get(handle)
        if ev is None:
            raise self._missing("event", handle, "use a handle from event_create that was not destroyed")
        return ev

    @deferred
    def event_create(self, enable_timing: bool = False, blocking: bool = False) -> int:
        with self._lock:        # (as stream_create)
            self._runtime()
            h = self._handle()
            self._events[h] = _Event(h, self._new(self._device, M_NEW_SHARED_EVENT, "newSharedEvent"),
                                     bool(enable_timing))
        return h

    @deferred
    def event_destroy(self, event: int) -> None:
        rt = self._runtime()
        with self._lock:
            ev = self._event(event)
            del self._events[event]
            self._release_committed(ev.cb)
            rt.release(ev.shared)

    @deferred
    def event_record(self, event: int, stream: int) -> None:
        rt = self._runtime()
        with self._lock, rt.pool():
            ev = self._event(event)
            st = self._stream(stream)
            shared, value, fresh = ev.shared, ev.value, None
            if value and int(rt.send(shared, M_SIGNALED_VALUE)) < value:
                # The latest record is still pending.  A wait encoded for it waits until the
                # event's value "reaches value or higher" (MTLEvent.h), so this record's higher
                # value, signalled first from another stream, would end that wait before the work
                # it waits for (r63e): a new MTLSharedEvent carries this record instead.  The
                # command buffers that wait for or signal the old one retain it.
                fresh = self._new(self._device, M_NEW_SHARED_EVENT, "newSharedEvent")
                shared, value = fresh, 0
            try:
                cb = self._open_cb(st)
                if ev.timing:
                    # Give the command buffer GPU work of its own so it carries timestamps.
                    self._encode_fill(cb, self._scratch, 0, 4, 0)
                rt.send(cb, M_SIGNAL_EVENT, shared, value + 1)
                cmd = self._commit(st)
            except BaseException:
                if fresh is not None:
                    rt.release(fresh)
                raise
            rt.retain(cmd.obj)
            self._release_committed(ev.cb)
            if fresh is not None:
                rt.release(ev.shared)
            ev.shared, ev.value, ev.cb = shared, value + 1, cmd

    def event_synchronize(self, event: int) -> None:
        rt = self._runtime()
        held: List[_Committed] = []
        try:
            self._hold_event_cb(event, held)
            for cmd in held:
                rt.send(cmd.obj, M_WAIT)       # signals not deferred: Ctrl-C ends a long wait
                self._check_cb(cmd)
        finally:
            try:                               # as _sync_streams: again if a handler ran at its start
                self._let_go(held)
            except BaseException:
                self._let_go(held)
                raise

    @deferred
    def _hold_event_cb(self, event: int, held: List[_Committed]) -> None:
        """Append the event's latest command buffer, retained, to ``held`` (none if never recorded)."""
        with self._lock:
            cmd = self._event(event).cb
            if cmd is not None:
                self._rt.retain(cmd.obj)
                held.append(cmd)

    @deferred
    def _let_go(self, held: List[_Committed]) -> None:
        """Release what :meth:`_hold_event_cb` held; ``held`` is emptied (a second call does nothing)."""
        while held:
            self._rt.release(held.pop().obj)

    def event_query(self, event: int) -> bool:
        rt = self._runtime()
        with self._lock:
            ev = self._event(event)
            # A command buffer that failed has ended too (MTLCommandBufferStatusError is final);
            # its error is reported by synchronizing the event or the stream.
            return (ev.value == 0 or int(rt.send(ev.shared, M_SIGNALED_VALUE)) >= ev.value
                    or int(rt.send(ev.cb.obj, M_STATUS)) == _CB_ERROR)

    def event_elapsed_ms(self, start: int, end: int) -> float:
        """Milliseconds between the GPUEndTime of the command buffers ending at each record."""
        rt = self._runtime()
        with self._lock:
            a, b = self._event(start), self._event(end)
            for ev in (a, b):
                if not ev.timing:
                    raise _InvalidHandle(f"mps: event {ev.handle} was created without enable_timing; "
                                         f"create both events with enable_timing=True")
                if ev.cb is None:
                    raise _InvalidHandle(f"mps: event {ev.handle} has not been recorded")
            for ev in (a, b):
                status = int(rt.send(ev.cb.obj, M_STATUS))
                if status == _CB_ERROR:
                    raise AcceleratorError(
                        f"mps: the command buffer of event {ev.handle}'s latest record failed (its error is "
                        f"reported by synchronizing the event or its stream), so it has no GPU time; "
                        f"record it again", library=_LIBRARY, call="GPUEndTime")
                if status != _CB_COMPLETED:
                    raise AcceleratorError(
                        f"mps: event {ev.handle} has not completed; synchronize it before elapsed_time",
                        library=_LIBRARY, call="GPUEndTime", code=600, code_name="NotReady")
            t0 = float(rt.send(a.cb.obj, M_GPU_END))
            t1 = float(rt.send(b.cb.obj, M_GPU_END))
        return (t1 - t0) * 1000.0

    # -- copies -------------------------------------------------------------------------
    def _encode_copy(self, cb: Any, src: _Buffer, soff: int, dst: _Buffer, doff: int, n: int) -> None:
        with self._encoding(cb, M_BLIT_ENCODER) as enc:
            self._rt.send(enc, M_COPY, src.obj, soff, dst.obj, doff, n)

    def _encode_fill(self, cb: Any, dst: _Buffer, off: int, n: int, value: int) -> None:
        rt = self._rt
        rng = rt.ffi.new("NSRange *", (off, n))[0]
        with self._encoding(cb, M_BLIT_ENCODER) as enc:
            rt.send(enc, M_FILL, dst.obj, rng, value & 0xFF)

    def _before_host_write(self, d, stream: int) -> None:
        """Order a host-side copy or fill after the GPU work it must follow.  Into a Metal buffer
        (``d``), every stream: MTLBuffer.h, "The contents become undefined if both the CPU and GPU
        write to the same buffer without a synchronizing action between those writes.  This is
        true even when the regions written do not overlap", and the allocator carves many blocks,
        used on any stream, out of one MTLBuffer.  Into host memory, ``stream`` only."""
        if d is None:
            self.stream_synchronize(stream)
        else:
            self.device_synchronize()

    def _host(self, ptr: int) -> Any:
        return self._rt.ffi.cast("void *", ptr)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        rt = self._runtime()
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        if nbytes == 0:
            return
        for side, ptr in (("dst", dst), ("src", src)):
            if isinstance(ptr, int) and not 0 < ptr < 1 << 64:
                # Memory outside Metal's buffers is copied on the host: such an address would crash
                # the process (cudaMemcpy answers cudaErrorInvalidValue).
                raise ValueError(f"mps: memcpy_async {side} pointer {ptr:#x} is not an address (null, negative "
                                 f"or wider than 64 bits); pass memory from mem_alloc/host_alloc or a live "
                                 f"host buffer; nothing was copied")
        with self._lock:        # one hold: a close between two lookups would pass a released source as host memory
            self._runtime()
            d = self._resolve(dst, nbytes)
            s = self._resolve(src, nbytes)
        if d is not None and nbytes % 4 == 0 and d[1] % 4 == 0 and (s is None or s[1] % 4 == 0):
            self._enqueue_copy(d, s, src, nbytes, stream)
            return
        if d is None and s is None:
            # Neither side is a live Metal buffer: a freed (stale) device pointer looks exactly like
            # host memory here, and a host memmove through it would crash the process.
            raise ValueError(f"mps: memcpy_async({dst:#x}, {src:#x}, {nbytes}): neither pointer is inside a "
                             f"live allocation of this device (freed or foreign memory?); copy to or from "
                             f"memory returned by mem_alloc/host_alloc that has not been freed")
        # Pageable destination or unaligned range: order on the host, copy through unified memory,
        # under the lock with the buffers still live (close() in another thread releases them).
        self._before_host_write(d, stream)
        with self._lock:
            for side in (d, s):
                if side is not None:
                    self._live(side[0])
            rt.ffi.memmove(self._host(dst), self._host(src), nbytes)

    @deferred
    def _enqueue_copy(self, d: Tuple[_Buffer, int], s: Optional[Tuple[_Buffer, int]], src: int, nbytes: int,
                      stream: int) -> None:
        """memcpy_async's blit into buffer ``d`` from buffer ``s``, or from pageable ``src`` (None
        ``s``) through a staging buffer; signals deferred (the encoder and staging buffer are
        made and ended or released within)."""
        rt = self._rt
        with self._lock, rt.pool():
            self._live(d[0])    # looked up before this hold: maybe released since (r43)
            if s is not None:
                self._live(s[0])
            st = self._stream(stream)
            if s is not None:
                self._encode_copy(self._open_cb(st), s[0], s[1], d[0], d[1], nbytes)
                self._encoded(st)
                return
            # Pageable source: copied now into a staging buffer, blitted in order.
            staging = rt.send(self._device, M_NEW_BUFFER_BYTES, self._host(src), nbytes, _STORAGE_SHARED)
            if staging == rt.nil:
                raise OutOfMemoryError(f"mps: no memory for a {nbytes}-byte staging buffer",
                                       library=_LIBRARY, call=M_NEW_BUFFER_BYTES.selector)
            stage = _Buffer(staging, 0, nbytes, True)
            try:
                self._encode_copy(self._open_cb(st), stage, 0, d[0], d[1], nbytes)
            finally:
                rt.release(staging)  # the command buffer holds it until done
            self._encoded(st)

    @deferred
    def _enqueue_fill(self, d: Tuple[_Buffer, int], value: int, nbytes: int, stream: int) -> None:
        with self._lock, self._rt.pool():
            self._live(d[0])    # (as _enqueue_copy)
            st = self._stream(stream)
            self._encode_fill(self._open_cb(st), d[0], d[1], nbytes, value)
            self._encoded(st)

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        rt = self._runtime()
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        try:
            value = operator.index(value)
        except TypeError:
            raise TypeError(f"mps: memset value must be an int (its low byte is written, as cudaMemset), "
                            f"got {type(value).__name__} {value!r}") from None
        if nbytes == 0:
            return
        d = self._resolve(ptr, nbytes)
        if d is None:
            raise self._missing("pointer", ptr, "memset needs memory from mem_alloc or host_alloc")
        if nbytes % 4 == 0 and d[1] % 4 == 0:
            self._enqueue_fill(d, value, nbytes, stream)
            return
        self._before_host_write(d, stream)
        with self._lock:        # (as memcpy_async's host path)
            self._live(d[0])
            rt.ffi.buffer(self._host(ptr), nbytes)[:] = bytes([value & 0xFF]) * nbytes

    # -- graphs: Metal has no stream capture (the protocol's methods raise this) --------
    no_capture_reason = _GRAPHS_UNSUPPORTED

    # -- kernels (Metal Shading Language, compiled at run time) -----------------------
    @deferred
    def module_load(self, source: bytes) -> int:
        rt = self._runtime()
        if isinstance(source, str):
            source = source.encode()
        if not isinstance(source, (bytes, bytearray)) or b"\0" in source:
            raise TypeError("module_load takes MSL source text (bytes without NUL)")
        try:
            text = bytes(source).decode()
        except UnicodeDecodeError as exc:
            raise ValueError(f"mps: MSL source must be UTF-8 text (Metal takes an NSString): {exc}") from None
        with self._lock, rt.pool():
            self._runtime()     # (as stream_create: the device is messaged below)
            options = self._new(rt.cls("MTLCompileOptions"), M_NEW_OPTIONS, "[MTLCompileOptions new]")
            try:
                # IEEE float semantics: the RNG transforms must match the host bit for bit.
                rt.send(options, M_SET_FAST_MATH, 0)
                err = rt.ffi.new("void **")
                lib = rt.send(self._device, M_NEW_LIBRARY, rt.ns_string(text),
                              options, err)
            finally:
                rt.release(options)
            if lib == rt.nil:
                code, text = rt.error_text(err[0])
                exc = CompileError.from_call(_LIBRARY, M_NEW_LIBRARY.selector, code,
                                             "MTLLibraryErrorCompileFailure", text)
                exc.log = text
                raise exc
            h = self._handle()
            self._modules[h] = (lib, [])
        return h

    @deferred
    def module_unload(self, module: int) -> None:
        rt = self._runtime()
        with self._lock:
            entry = self._modules.pop(module, None)
            if entry is None:
                raise self._missing("module", module, "use a handle from module_load that was not unloaded")
            lib, functions = entry
            for fn in functions:
                pipeline, function, _, _ = self._functions.pop(fn)
                rt.release(pipeline)
                rt.release(function)
            rt.release(lib)

    @deferred
    def module_function(self, module: int, name: str) -> int:
        rt = self._runtime()
        if not isinstance(name, str):
            raise TypeError(f"mps: the kernel name must be a str, got {type(name).__name__} {name!r}")
        if "\0" in name:
            # (stringWithUTF8String: stops at the NUL: "k\0junk" found kernel "k", r70i)
            raise ValueError(f"mps: the kernel name must not contain a NUL character, got {name!r}")
        with self._lock, rt.pool():
            entry = self._modules.get(module)
            if entry is None:
                raise self._missing("module", module, "use a handle from module_load that was not unloaded")
            lib, functions = entry
            function = rt.send(lib, M_NEW_FUNCTION, rt.ns_string(name))
            if function == rt.nil:
                raise _InvalidHandle(f"mps: the Metal library has no kernel named {name!r}")
            err = rt.ffi.new("void **")
            pipeline = rt.send(self._device, M_NEW_PIPELINE, function, err)
            if pipeline == rt.nil:
                code, text = rt.error_text(err[0])
                rt.release(function)
                raise AcceleratorError.from_call(_LIBRARY, M_NEW_PIPELINE.selector, code,
                                                 "MTLComputePipelineError", text)
            h = self._handle()
            self._functions[h] = (pipeline, function, module,
                                  int(rt.send(pipeline, M_MAX_THREADS)))
            functions.append(h)
        return h

    @deferred
    def launch(self, function: int, grid: Tuple[int, int, int], block: Tuple[int, int, int],
               args: KernelArgs, shared_mem: int, stream: int) -> None:
        rt = self._runtime()
        grid, block = tuple(grid), tuple(block)
        if (len(grid) != 3 or len(block) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in grid + block)):
            raise TypeError(f"mps: grid and block must be 3 ints each, got {grid!r}, {block!r}")
        if min(grid + block) < 1:
            raise ValueError(f"grid and block must be 3 positive ints, got {grid}, {block}")
        if max(grid) > _MAX_GRID:
            # Apple, "Metal Shading Language Specification" (kernel function input attributes):
            # threadgroup_position_in_grid is a uint/uint2/uint3, 32 bits per dimension, so a larger
            # grid cannot be addressed by the kernel (the API docs give no larger limit).
            raise ValueError(f"mps: grid {grid} has a dimension above {_MAX_GRID} threadgroups, the most a "
                             f"32-bit threadgroup_position_in_grid addresses; split the launch")
        if not isinstance(shared_mem, int) or isinstance(shared_mem, bool):
            raise TypeError(f"mps: shared_mem must be an int number of bytes, got {type(shared_mem).__name__}")
        if not 0 <= shared_mem <= _MAX_THREADGROUP_MEMORY:
            # Apple, "Metal Feature Set Tables": 32 KB of threadgroup memory per threadgroup
            # (MTLDevice.maxThreadgroupMemoryLength) on every Apple GPU family.
            raise ValueError(f"mps: shared_mem {shared_mem} is outside [0, {_MAX_THREADGROUP_MEMORY}] bytes "
                             f"(Metal's maxThreadgroupMemoryLength)")
        if len(args) > _MAX_BUFFER_INDEX:
            raise ValueError(f"Metal binds at most {_MAX_BUFFER_INDEX} kernel arguments, got {len(args)}")
        ffi = rt.ffi
        with self._lock, rt.pool():
            entry = self._functions.get(function)
            if entry is None:
                raise self._missing("kernel", function, "use a handle from module_function")
            pipeline, _, _, max_threads = entry
            threads = block[0] * block[1] * block[2]
            if threads > max_threads:
                raise ValueError(f"block {block} has {threads} threads; this Metal pipeline allows "
                                 f"{max_threads} per threadgroup")
            st = self._stream(stream)
            bindings = []
            for i, (kind, value) in enumerate(args):
                if kind == "ptr":
                    if value == 0:
                        bindings.append((M_SET_BUFFER, rt.nil, 0, i))
                        continue
                    r = self._resolve(value, 0)
                    if r is None:
                        raise self._missing("pointer", value,
                                   f"kernel argument {i} must point into mem_alloc/host_alloc memory")
                    bindings.append((M_SET_BUFFER, r[0].obj, r[1], i))
                elif kind in _SCALAR_CTYPES:
                    ctype = _SCALAR_CTYPES[kind]
                    try:
                        cell = ffi.new(ctype + " *", value)
                    except (TypeError, OverflowError) as exc:
                        kind_of = TypeError if isinstance(exc, TypeError) else ValueError
                        raise kind_of(f"kernel argument {i}: {value!r} is not a {kind} ({ctype}): "
                                      f"{exc}") from None
                    bindings.append((M_SET_BYTES, cell, ffi.sizeof(ctype), i))
                elif kind == "f64":
                    raise ValueError(f"kernel argument {i}: Metal has no 64-bit float; pass f32")
                else:
                    raise ValueError(f"kernel argument {i}: unknown type {kind!r}")
            sizes = ffi.new("MTLSize *", grid)[0], ffi.new("MTLSize *", block)[0]
            with self._encoding(self._open_cb(st), M_COMPUTE_ENCODER) as enc:
                rt.send(enc, M_SET_PIPELINE, pipeline)
                for msg, a, b, i in bindings:
                    rt.send(enc, msg, a, b, i)
                if shared_mem:
                    rt.send(enc, M_SET_THREADGROUP_MEMORY, (shared_mem + 15) // 16 * 16, 0)
                rt.send(enc, M_DISPATCH, *sizes)
            self._encoded(st)

    def function_attributes(self, function: int) -> dict:
        """The kernel's ``max_threads_per_block`` only: its pipeline's
        maxTotalThreadsPerThreadgroup (read at module_function; the kernel's
        [[max_total_threads_per_threadgroup]] lowers it).  Metal reports no registers per
        thread, and no occupancy: the keys are absent."""
        with self._lock:
            entry = self._functions.get(function)
            if entry is None:
                raise self._missing("kernel", function, "use a handle from module_function")
            return {"max_threads_per_block": entry[3]}

    def launch_limits(self, index: int) -> dict:
        # Apple, "Metal Feature Set Tables" (Apple GPU families): 1024 threads per threadgroup
        # (maxThreadsPerThreadgroup is 1024 in each dimension) and 32 KB of threadgroup memory,
        # with no opt-in beyond it; a grid position (threadgroup_position_in_grid) is a 32-bit uint.
        return {"max_grid": (2 ** 32 - 1,) * 3, "max_block": (1024, 1024, 1024),
                "max_threads_per_block": 1024, "max_shared_per_block": 32 * 1024,
                "max_shared_per_block_optin": 32 * 1024}


def create() -> MPSBackend:
    """The factory accel.backends calls; constructing opens nothing."""
    return MPSBackend()
