"""A simulated CUDA runtime (libcudart 12.4, 12.8 or 13.0) over host memory and threads.

Call it exactly like the cffi ``lib`` of the generated declarations:
out-pointers are the caller's cdata, handles are pointer cdata (or ints),
return values are ``cudaError_t`` codes.  :func:`open_library` returns the
lib-like object; ``accel.sim`` re-exports the configuration, fault injection
and state inspection shared with the other simulators.

Semantics chosen where CUDA leaves room (see also ``accel/sim/__init__.py``):

* Every call except cudaGetErrorName/String, cudaGetLastError/PeekAtLastError
  and cudaRuntime/DriverGetVersion initializes the runtime (including
  cudaGetDeviceCount, as in real CUDA).  Without a driver (``driver=False``)
  or with no visible device, those calls return cudaErrorInsufficientDriver /
  cudaErrorNoDevice (cudaGetDeviceCount also writes 0).
* CUDA_VISIBLE_DEVICES is read once, at runtime initialization: indices and
  ``GPU-`` UUID prefixes; parsing stops at the first invalid, unknown or
  ambiguous entry; a repeated device makes the list empty; "" hides all.
* Streams are in-order queues run by worker threads (``_engine``).  The
  legacy default stream of each device (handles 0 and cudaStreamLegacy) waits
  for all earlier work of the device's blocking streams, and blocking
  streams wait for earlier legacy work; cudaStreamNonBlocking streams do
  neither.  cudaStreamPerThread is a blocking stream per host thread and device.
* Events record a point in a stream; waits capture the record current at
  the time of the wait.  Timing events stamp ``perf_counter_ns`` when the
  point is reached.
* cudaFree / cudaFreeHost first wait for the device's (all devices') queued
  work, as the real calls synchronize, so no queued copy touches freed memory.
* A Python exception in a reference kernel (or a copy touching freed memory)
  is a device fault: the process gets a sticky error (cudaErrorIllegalAddress
  for out-of-range memory, else cudaErrorLaunchFailure) that every later
  runtime call, on any device and thread, returns (cudaDeviceReset included;
  only a new process, or ``accel.sim.reset()``, recovers); the traceback is
  printed to stderr and kept in ``accel.sim.state().errors``.
* Stream capture follows the programming guide's rules (see ``_capture_*``);
  prohibited calls return the vendor code and invalidate the capture, and
  cudaStreamEndCapture then returns cudaErrorStreamCaptureInvalidated with a
  NULL graph.  Pageable-memory copies during capture are refused
  (cudaErrorStreamCaptureUnsupported).  External events (cudaEventRecordExternal,
  cudaEventWaitExternal) become event record / event wait nodes: each launch records
  the event, or waits for its record current at the launch (see ``_event_plan``).
* Versions (``Config.runtime_version`` / ``driver_version``): the library exposes exactly
  the cuda* functions the real libcudart of that version exports (``cudart_symbols/``,
  written by tools/cudart_exports.py) that are simulated here; a driver older than the
  runtime's major version makes every initializing call return cudaErrorInsufficientDriver.
  Module images (PTX, cubin, fatbin) are read by ``_cuda_images``; the driver entry points
  (cudaGetDriverEntryPoint) hand out the callbacks of ``cuda_driver``.
* Strictness rules (launch device, peer access, sticky errors, unsafe calls
  during capture, recycled handles, fork after init, shared-memory opt-in,
  context memory) are listed with their citations in ``accel/sim/README.md``.
* Graph replay runs the captured nodes in capture order (a topological
  order) as one operation on the launch stream, with the argument values
  captured at record time.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import threading
import time
import traceback
from typing import Dict, List, Optional, Sequence, Tuple

from . import _cuda_images, _engine, _graph_mem, _memory, _vmm, core, kernels
from ._cuda_strings import ERROR_STRINGS, UNRECOGNIZED
from .core import ffi

# cudaError_t values (driver_types.h, CUDA 13.0); tests check them against the generated enum.
cudaSuccess = 0
cudaErrorInvalidValue = 1
cudaErrorMemoryAllocation = 2
cudaErrorInitializationError = 3
cudaErrorInvalidConfiguration = 9
cudaErrorInvalidMemcpyDirection = 21
cudaErrorInsufficientDriver = 35
cudaErrorInvalidDeviceFunction = 98
cudaErrorNoDevice = 100
cudaErrorInvalidDevice = 101
cudaErrorInvalidPtx = 218
cudaErrorOperatingSystem = 304
cudaErrorInvalidResourceHandle = 400
cudaErrorIllegalState = 401
cudaErrorSymbolNotFound = 500
cudaErrorNotReady = 600
cudaErrorIllegalAddress = 700
cudaErrorPeerAccessAlreadyEnabled = 704
cudaErrorPeerAccessNotEnabled = 705
cudaErrorLaunchFailure = 719
cudaErrorNotSupported = 801
cudaErrorStreamCaptureUnsupported = 900
cudaErrorStreamCaptureInvalidated = 901
cudaErrorStreamCaptureMerge = 902
cudaErrorStreamCaptureUnmatched = 903
cudaErrorStreamCaptureUnjoined = 904
cudaErrorStreamCaptureIsolation = 905
cudaErrorStreamCaptureImplicit = 906
cudaErrorCapturedEvent = 907
cudaErrorStreamCaptureWrongThread = 908

_STREAM_NON_BLOCKING = 0x1
_EVENT_BLOCKING_SYNC, _EVENT_DISABLE_TIMING, _EVENT_INTERPROCESS = 0x1, 0x2, 0x4
_EVENT_WAIT_EXTERNAL = 0x1         # cudaEventWaitExternal
_EVENT_RECORD_EXTERNAL = 0x1       # cudaEventRecordExternal
_CAPTURE_GLOBAL, _CAPTURE_THREAD_LOCAL, _CAPTURE_RELAXED = 0, 1, 2
_STATUS_NONE, _STATUS_ACTIVE, _STATUS_INVALIDATED = 0, 1, 2
_MEMCPY_H2H, _MEMCPY_H2D, _MEMCPY_D2H, _MEMCPY_D2D, _MEMCPY_DEFAULT = 0, 1, 2, 3, 4
# cudaMemcpyKind -> (destination is device memory, source is device memory)
_MEMCPY_KINDS = {_MEMCPY_H2H: (False, False), _MEMCPY_H2D: (True, False), _MEMCPY_D2H: (False, True),
                 _MEMCPY_D2D: (True, True)}
_MEM_TYPE_UNREGISTERED, _MEM_TYPE_HOST, _MEM_TYPE_DEVICE = 0, 1, 2
_INVALID_DEVICE_ID = -2
_PRIORITY_LEAST, _PRIORITY_GREATEST = 0, -5

_VOIDP = ffi.typeof("void *")
_VOIDPP = ffi.typeof("void **")
_CHARP = ffi.typeof("char *")
_UINTPTR = ffi.typeof("uintptr_t")
_NULL = ffi.cast(_VOIDP, 0)

_SM_COUNT = 132
_SHARED_PER_BLOCK = 48 * 1024
_SHARED_PER_BLOCK_OPTIN = 227 * 1024
_SHARED_PER_SM = 228 * 1024
_L2 = 50 * 1024 * 1024


def context_reserved(memory: int) -> int:
    """Device memory a CUDA context holds before any cudaMalloc (module code, the device heap
    (cudaLimitMallocHeapSize, 8 MB by default), per-thread stacks, printf FIFO: CUDA Runtime
    API, cudaDeviceSetLimit) -- a few hundred MiB on a real GPU, 1/16 of a small simulated one."""
    return min(320 << 20, memory // 16) & ~255


class _IllegalAddress(RuntimeError):
    """A queued copy or memset touches memory that was freed meanwhile."""


# -- runtime objects -------------------------------------------------------------

class _TLS(threading.local):
    def __init__(self):
        self.device = 0
        self.capture_mode = _CAPTURE_GLOBAL
        self.last_error = 0
        self.per_thread = None   # {device: Stream} for cudaStreamPerThread


class Device:
    __slots__ = ("index", "physical", "used", "peak", "legacy", "queues", "blocking", "attrs", "peers",
                 "view", "reserved", "vmm", "context")

    def __init__(self, index: int, physical: int, reserved: int = 0):
        self.index = index
        self.physical = physical
        self.reserved = reserved    # held by the context (cudaMemGetInfo: free < total)
        self.used = 0               # cudaMalloc'd bytes (256-rounded) and cuMemCreate'd bytes
        self.vmm = 0                # of which cuMemCreate'd (physical memory of virtual-memory handles)
        self.peak = 0
        self.legacy: Optional[Stream] = None
        self.queues: Dict[_engine.Queue, None] = {}   # live and draining queues (device sync)
        self.blocking: List[Stream] = []        # live streams that synchronize with the legacy stream
        self.attrs: Optional[Dict[int, int]] = None
        self.peers: set = set()     # devices whose memory this one may access (cudaDeviceEnablePeerAccess)
        self.view = None            # the kernels' memory view for this device (see _device_view)
        self.context = False        # its primary context is initialized (see _NO_CONTEXT)


class Stream:
    __slots__ = ("handle", "key", "device", "flags", "priority", "q", "capture", "destroyed", "legacy",
                 "blocking")

    def __init__(self, handle, device, flags, priority, legacy=False):
        self.handle = handle
        self.key = ffi.cast(_VOIDP, handle)
        self.device = device
        self.flags = flags
        self.priority = priority
        self.legacy = legacy
        self.blocking = not legacy and not (flags & _STREAM_NON_BLOCKING)
        self.capture: Optional[Capture] = None
        self.destroyed = False
        self.q: Optional[_engine.Queue] = None


class Rec:
    """One cudaEventRecord: a point in a stream, or a set of nodes in a capture."""
    __slots__ = ("q", "seq", "ts", "cap", "nodes")

    def __init__(self):
        self.q = None
        self.seq = 0
        self.ts = 0
        self.cap = None
        self.nodes = ()

    def stamp(self):
        self.ts = time.perf_counter_ns()


class Event:
    __slots__ = ("handle", "key", "flags", "device", "rec")

    def __init__(self, handle, flags, device):
        self.handle = handle
        self.key = ffi.cast(_VOIDP, handle)
        self.flags = flags
        self.device = device
        self.rec: Optional[Rec] = None


class Node:
    """A captured operation; ``event`` is set for event record / event wait nodes, ``kernel``
    (a KernelHandle) for kernel nodes."""
    __slots__ = ("id", "kind", "label", "fn", "deps", "event", "kernel")

    def __init__(self, id, kind, label, fn, deps, event=None, kernel=None):
        self.id = id
        self.kind = kind
        self.label = label
        self.fn = fn
        self.deps = deps
        self.event = event
        self.kernel = kernel


class Capture:
    __slots__ = ("id", "origin", "mode", "thread", "status", "nodes", "tails", "device", "ended")

    def __init__(self, id, origin, mode, thread, device):
        self.id = id
        self.origin = origin
        self.mode = mode
        self.thread = thread
        self.status = _STATUS_ACTIVE
        self.nodes: List[Node] = []
        self.tails: Dict[Stream, Tuple[int, ...]] = {origin: ()}
        self.device = device
        self.ended = False


class Graph:
    __slots__ = ("handle", "key", "nodes", "capture_id", "device")

    def __init__(self, handle, nodes, capture_id, device):
        self.handle = handle
        self.key = ffi.cast(_VOIDP, handle)
        self.nodes = nodes
        self.capture_id = capture_id
        self.device = device


class GraphExec:
    __slots__ = ("handle", "key", "nodes", "launches", "device", "plan", "libraries")

    def __init__(self, handle, nodes, device):
        self.handle = handle
        self.key = ffi.cast(_VOIDP, handle)
        self.nodes = nodes
        self.launches = 0
        self.device = device
        self.plan = _event_plan(nodes)     # None: no event nodes, one operation per launch
        # the modules whose kernels the graph launches (checked loaded at each cudaGraphLaunch)
        self.libraries = tuple({id(n.kernel.library): n.kernel.library for n in nodes if n.kernel}.values())


class Library:
    """A cudaLibrary_t (device None) or a driver CUmodule (loaded into ``device``'s context)."""
    __slots__ = ("handle", "key", "names", "kernels", "device", "params", "unloaded")

    def __init__(self, handle, names, device=None, params=None):
        self.handle = handle
        self.key = ffi.cast(_VOIDP, handle)
        self.names = names
        self.device = device
        self.unloaded = False
        self.kernels: Dict[str, "KernelHandle"] = {}
        # entry -> accel argument types from the PTX .entry declaration (None: the image has
        # no PTX for it, or a parameter type accel cannot pass); see accel/_ptx.py
        self.params: Dict[str, Optional[tuple]] = params or {}


class KernelHandle:
    __slots__ = ("handle", "key", "name", "library", "max_dynamic_shared", "carveout")

    def __init__(self, handle, name, library):
        self.handle = handle
        self.key = ffi.cast(_VOIDP, handle)
        self.name = name
        self.library = library
        self.max_dynamic_shared: Dict[int, int] = {}    # device -> cudaFuncSetAttribute opt-in
        self.carveout: Dict[int, int] = {}              # device -> preferred shared memory carveout


class MemPool:
    """A device's default stream-ordered memory pool (cudaDeviceGetDefaultMemPool)."""
    __slots__ = ("handle", "key", "device", "used", "reserved", "used_high", "reserved_high",
                 "release_threshold", "reuse", "access")

    def __init__(self, handle, device):
        self.handle = handle
        self.key = ffi.cast(_VOIDP, handle)
        self.device = device
        self.used = self.reserved = self.used_high = self.reserved_high = 0
        self.release_threshold = 0
        self.reuse = {1: 1, 2: 1, 3: 1}     # the cudaMemPoolReuse* attributes, enabled by default
        self.access: Dict[int, int] = {}    # peer device -> cudaMemAccessFlags (cudaMemPoolSetAccess)


_LEGACY, _PER_THREAD = object(), object()


class Runtime:
    """Everything one initialized simulated runtime holds."""

    def __init__(self, cfg: core.Config, forked: bool = False):
        self.cfg = cfg
        self.tls = _TLS()
        self.engine = _engine.Engine(self._on_error, self._on_retire)
        self.lock = self.engine.lock
        self.mlock = threading.Lock()          # device memory accounting
        self.clock = threading.RLock()         # capture bookkeeping
        self.mem = _memory.MemoryTable()
        # Virtual memory (cuMemAddressReserve, cuMemCreate, cuMemMap ...: cuda_driver.py); its
        # physical memory is charged to the same device budget as cudaMalloc.
        self.vmm = _vmm.Space("cuda", cfg.memory, self._vmm_charge, self._vmm_refund)
        self.host_bytes = 0
        self.handles = itertools.count(0x100000, 0x10)
        # Handle values of destroyed streams/events, reused last-freed-first as the driver does.
        self.free_streams: List[int] = []
        self.free_events: List[int] = []
        self.dead_per_thread: List[Stream] = []     # per-thread streams of exited threads
        self.capture_ids = itertools.count(1)
        self.streams: Dict[object, object] = {}
        for k in (None, 0, 1, ffi.cast(_VOIDP, 0), ffi.cast(_VOIDP, 1)):
            self.streams[k] = _LEGACY
        for k in (2, ffi.cast(_VOIDP, 2)):
            self.streams[k] = _PER_THREAD
        self.events: Dict[object, Event] = {}
        self.graphs: Dict[object, Graph] = {}
        self.execs: Dict[object, GraphExec] = {}
        self.libraries: Dict[object, Library] = {}
        self.jit_compiles = 0        # images loaded through the PTX JIT (no SASS for the device)
        self.kernels: Dict[object, KernelHandle] = {}
        self.pools: Dict[object, MemPool] = {}           # by handle and by void* key
        self.default_pools: Dict[int, MemPool] = {}      # device -> its default pool
        self.async_allocs: Dict[int, Tuple[MemPool, int]] = {}   # base -> (pool, accounted bytes)
        self.gmem = _graph_mem.Space()      # graph memory nodes (cudaMallocAsync during capture)
        self.captures: set = set()
        self.errors: List[Tuple[str, str]] = []
        self.init_error = 0         # every call (but cudaGetDeviceCount) returns this when set
        self.sticky = 0             # the first device fault's error (see _on_error)
        self.devices: List[Device] = []
        if forked:
            # CUDA Programming Guide, "Initialization" / REFERENCE.md "Hardware rules": a child
            # forked after the parent initialized the driver (cuInit; cudaGetDeviceCount does it)
            # cannot use CUDA: every runtime call returns cudaErrorInitializationError.
            self.init_error = cudaErrorInitializationError
            return
        if not cfg.driver:
            self.init_error = cudaErrorInsufficientDriver
            return
        # REFERENCE.md "Runtime vs driver versions" (CUDA Compatibility guide, "Minor Version
        # Compatibility"): a runtime runs on any driver of its major version or newer; an older
        # driver makes every runtime call return cudaErrorInsufficientDriver.
        if cfg.driver_version < cfg.runtime_version // 1000 * 1000:
            self.init_error = cudaErrorInsufficientDriver
            return
        ordinals = visible_ordinals(os.environ.get("CUDA_VISIBLE_DEVICES"), cfg.devices)
        if not ordinals:
            self.init_error = cudaErrorNoDevice
            return
        for i, phys in enumerate(ordinals):
            # Contexts are created for every visible device at init (real CUDA creates a device's
            # primary context at its first use: the simulator reports less free memory, never more).
            d = Device(i, phys, context_reserved(cfg.memory))
            legacy = Stream(0, i, 0, 0, legacy=True)
            legacy.q = self.engine.queue(f"cuda{i}-legacy", legacy)
            d.legacy = legacy
            d.queues[legacy.q] = None
            self.devices.append(d)

    # handle tables hold each object under its int handle and its void* cdata,
    # so a lookup by whatever the caller passes is one dict access.
    def new_handle(self, free: Optional[List[int]] = None) -> int:
        """A handle value; with ``free``, a recycled one from that list when it has any.

        CUDA hands out the value of a destroyed stream or event to the next one created
        (REFERENCE.md "Hardware rules"; the driver's handle allocator reuses freed slots), so
        anything keyed by a handle value must forget it on destroy."""
        if free:
            try:
                return free.pop()
            except IndexError:      # another thread took the last one
                pass
        return next(self.handles)

    @staticmethod
    def put(table, obj) -> None:
        table[obj.handle] = obj
        table[obj.key] = obj

    @staticmethod
    def drop(table, obj) -> None:
        table.pop(obj.handle, None)
        table.pop(obj.key, None)

    def _on_retire(self, q: _engine.Queue) -> None:
        # A destroyed stream's queue drained (engine lock held): the device forgets it too.
        owner = q.owner
        if owner is not None and 0 <= owner.device < len(self.devices):
            self.devices[owner.device].queues.pop(q, None)

    def _on_error(self, q: _engine.Queue, exc: BaseException) -> None:
        code = cudaErrorIllegalAddress if isinstance(exc, (_IllegalAddress, kernels.MemoryRangeError)) \
            else cudaErrorLaunchFailure
        # CUDA Runtime API, "Error Handling" / cudaErrorIllegalAddress, cudaErrorLaunchFailure: "This
        # leaves the process in an inconsistent state and any further CUDA work will return the same
        # error. To continue using CUDA, the process must be terminated and relaunched."  So the
        # first fault becomes every later call's result (the wrapper returns init_error), on every
        # device and thread, and cudaDeviceReset does not clear it.
        # The text is kept before the error becomes sticky: a thread that sees the sticky code
        # (any call returns it from then on) can read why in state().errors.
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.errors.append((q.label, text))
        if not self.sticky:
            self.sticky = code
            self.init_error = code
        try:
            sys.stderr.write(f"accel.sim: device fault on {q.label} ({_error_name(code)}):\n{text}")
        except Exception:
            pass

    def _vmm_charge(self, device: int, nbytes: int) -> bool:
        dev = self.devices[device]
        with self.mlock:
            if dev.used + nbytes > self.cfg.memory - dev.reserved:
                return False
            dev.used += nbytes
            dev.vmm += nbytes
            if dev.used > dev.peak:
                dev.peak = dev.used
        return True

    def _vmm_refund(self, device: int, nbytes: int) -> None:
        dev = self.devices[device]
        with self.mlock:
            dev.used -= nbytes
            dev.vmm -= nbytes

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.mem.close()
        self.vmm.close()


_R: Optional[Runtime] = None
_start_lock = threading.Lock()
#: This process was forked after an ancestor started the driver: CUDA is unusable here.
_forked_after_init = False


def _start() -> Runtime:
    global _R
    with _start_lock:
        if _R is None:
            _R = Runtime(core.config(), forked=_forked_after_init)
        return _R


def runtime() -> Optional[Runtime]:
    """The initialized simulated runtime, or None if nothing initialized it yet."""
    return _R


def _reset() -> None:
    # accel.sim.reset() / configure(): a new simulated process, so a fork poison goes too.
    global _R, _forked_after_init
    with _start_lock:
        R, _R = _R, None
        _forked_after_init = False
    if R is not None:
        R.shutdown()


def _fork_reset() -> None:
    # In the child the workers do not exist and the locks may be held: drop, do not join.
    # A driver the parent started (any call but the no-init ones did) poisons the child.
    global _R, _start_lock, _forked_after_init
    _start_lock = threading.Lock()
    R, _R = _R, None
    if R is not None:
        _memory.forget(R.mem)
        R.vmm.close(unmap=False)
        if R.devices or R.init_error == cudaErrorInitializationError:
            _forked_after_init = True


core.on_reset("cudart", _reset, _fork_reset)


# -- CUDA_VISIBLE_DEVICES ----------------------------------------------------------

def visible_ordinals(value: Optional[str], count: int) -> List[int]:
    """Physical ordinals the runtime exposes, in order, as the CUDA runtime parses
    CUDA_VISIBLE_DEVICES: indices (strtoul: leading digits count) or ``GPU-``
    UUID prefixes; stop at the first invalid entry; a repeated device empties
    the list (MIG- entries are invalid: the simulator has no MIG)."""
    if value is None:
        return list(range(count))
    out: List[int] = []
    uuids = None
    for raw in value.split(","):
        item = raw.strip()
        if item.startswith("GPU-"):
            if uuids is None:
                uuids = [core.uuid_text(i) for i in range(count)]
            matches = [i for i, u in enumerate(uuids) if u.startswith(item)]
            if len(matches) != 1:
                break
            idx = matches[0]
        else:
            # C strtoul: an optional sign, then ASCII digits ("+1" is 1, "-0" is 0; torch's
            # test_cuda_nvml_based_avail: "2, +3, -0, 5" -> [2, 3, 0, 5]); a negative one ends the list
            m = re.match(r"[+-]?[0-9]+", item)
            if not m:
                break
            idx = int(m.group(0))
            if not 0 <= idx < count:
                break
        if idx in out:
            return []
        out.append(idx)
    return out


# -- argument helpers --------------------------------------------------------------

_addr = _memory.addr_of
_oom = core._oom      # non-empty while an OOM is injected (the list object is never replaced)


def _put_ptr(p, key) -> bool:
    """Write pointer/handle ``key`` (void* cdata) through out-pointer ``p``; False if p is NULL."""
    if p is None:
        return False
    try:
        p[0] = key
        return True
    except RuntimeError:    # cffi: "cannot dereference null pointer"
        return False
    except TypeError:
        a = _addr(p)
        if not a:
            return False
        ffi.cast(_VOIDPP, a)[0] = key
        return True


def _is_null(p) -> bool:
    return p is None or (p.__class__ is int and p == 0) or (p.__class__ is not int and p == ffi.NULL)


def _put(p, value, ctype="int *") -> None:
    try:
        p[0] = value
    except TypeError:
        ffi.cast(ctype, _addr(p))[0] = value


def _c_string(x) -> Optional[str]:
    if isinstance(x, bytes):
        return x.split(b"\0", 1)[0].decode()
    if isinstance(x, str):
        return x
    if _is_null(x):
        return None
    return ffi.string(ffi.cast(_CHARP, x)).decode()


def _stream(R: Runtime, x):
    try:
        s = R.streams.get(x)
    except TypeError:
        return None
    if s.__class__ is Stream:
        return s
    if s is _LEGACY:
        return R.devices[R.tls.device].legacy
    if s is _PER_THREAD:
        return _per_thread_stream(R)
    return None


class _PerThreadStreams(dict):
    """{device: Stream} of cudaStreamPerThread for one host thread.  When the thread exits its
    thread-local state goes, and these streams are handed to the runtime to close (a plain
    list.append: a finalizer must not take a lock the collecting thread may hold)."""

    __slots__ = ("dead",)

    def __init__(self, dead: list):
        super().__init__()
        self.dead = dead

    def __del__(self):
        self.dead.extend(self.values())


def _per_thread_stream(R: Runtime) -> Stream:
    tls = R.tls
    d = tls.device
    table = tls.per_thread
    if table is None:
        table = tls.per_thread = _PerThreadStreams(R.dead_per_thread)
    s = table.get(d)
    if s is None:
        if R.dead_per_thread:
            _sweep_finished_threads(R)
        s = Stream(R.new_handle(), d, 0, 0)
        s.q = R.engine.queue(f"cuda{d}-per-thread-{threading.get_ident():x}", s)
        dev = R.devices[d]
        with R.lock:
            dev.queues[s.q] = None
            dev.blocking.append(s)
        table[d] = s
    return s


def _lookup(table, x):
    try:
        return table.get(x)
    except TypeError:
        return None


# -- stream ordering and capture ------------------------------------------------------

def _implicit_deps(R: Runtime, s: Stream):
    """Legacy-stream semantics: the points a new operation on ``s`` must wait for."""
    if s.legacy:
        return [(b.q, b.q.enqueued) for b in R.devices[s.device].blocking if b.q.done < b.q.enqueued]
    if s.blocking:
        lq = R.devices[s.device].legacy.q
        if lq.done < lq.enqueued:
            return ((lq, lq.enqueued),)
    return ()


def _legacy_conflict(R: Runtime, device: int) -> int:
    """Using the legacy stream while a blocking stream of its device captures is
    invalid (it would depend on the capture): invalidate those captures."""
    rc = 0
    with R.clock:
        for cap in list(R.captures):
            if cap.device == device and any(st.blocking for st in cap.tails):
                cap.status = _STATUS_INVALIDATED
                rc = cudaErrorStreamCaptureImplicit
    return rc


def _unsafe_call(R: Runtime) -> int:
    """0, or cudaErrorStreamCaptureUnsupported after invalidating the captures that prohibit
    a "potentially unsafe" call by this thread now.

    CUDA Runtime API, cudaStreamBeginCapture / cudaThreadExchangeStreamCaptureMode: in global
    mode (the default), a thread with an ongoing non-relaxed capture of its own, or while any
    other thread has a global-mode capture underway, is prohibited from potentially unsafe
    calls; thread-local mode ignores other threads' captures; relaxed mode allows them.  The
    unsafe calls (CUDA Programming Guide, "CUDA Graphs" > "Prohibited and Unhandled
    Operations"; torch's allocator relies on this list): cudaMalloc/cudaHostAlloc/cudaFree/
    cudaFreeHost, cudaEventQuery/cudaEventSynchronize of any event, cudaStreamQuery/
    cudaStreamSynchronize of streams not being captured, cudaDeviceSynchronize, and
    synchronous cudaMemcpy/cudaMemset.  A prohibited call fails and invalidates the capture
    (cudaStreamEndCapture then returns cudaErrorStreamCaptureInvalidated)."""
    mode = R.tls.capture_mode
    if mode == _CAPTURE_RELAXED:
        return 0
    me = threading.get_ident()
    rc = 0
    with R.clock:
        for cap in list(R.captures):
            if cap.thread == me:
                hit = cap.mode != _CAPTURE_RELAXED
            else:
                hit = mode == _CAPTURE_GLOBAL and cap.mode == _CAPTURE_GLOBAL
            if hit:
                cap.status = _STATUS_INVALIDATED
                rc = cudaErrorStreamCaptureUnsupported
    return rc


def _invalidate(R: Runtime, cap: Optional[Capture]) -> None:
    if cap is not None and not cap.ended:
        with R.clock:
            cap.status = _STATUS_INVALIDATED


def _enqueue(R: Runtime, s: Stream, fn, kind: str, label: str, work: bool = True, event=None, kernel=None):
    """Run ``fn`` in stream order on ``s`` (or record it, if ``s`` is capturing).
    Returns (rc, seq); seq is 0 for captured or failed operations."""
    cap = s.capture
    if cap is not None:
        with R.clock:
            if cap.status != _STATUS_ACTIVE:
                return cudaErrorStreamCaptureInvalidated, 0
            node = Node(len(cap.nodes), kind, label, fn, cap.tails.get(s, ()), event, kernel)
            cap.nodes.append(node)
            cap.tails[s] = (node.id,)
        return 0, 0
    if s.legacy and R.captures:
        rc = _legacy_conflict(R, s.device)
        if rc:
            return rc, 0
    return 0, s.q.submit(fn, _implicit_deps(R, s) if (s.legacy or s.blocking) else (), work)


def _wait_device(R: Runtime, device: int) -> None:
    for q in list(R.devices[device].queues):
        if q.done < q.enqueued:
            q.wait()


def _device_captures(R: Runtime, device: int) -> List[Capture]:
    return [c for c in list(R.captures) if c.device == device]


# -- error names ---------------------------------------------------------------------

_strings: Dict[Tuple[str, int], object] = {}
_names: Optional[Dict[int, str]] = None


def _error_name(code: int) -> str:
    global _names
    if _names is None:
        try:
            from accel._ffi import _cudart as gen
            _names = dict(gen.ffi.typeof("cudaError_t").elements)
        except Exception:   # generated module unavailable: the codes this file knows
            _names = {v: k for k, v in globals().items() if k.startswith("cudaError") or k == "cudaSuccess"}
    return _names.get(code, UNRECOGNIZED)


def _cstr(kind: str, code: int, text: str):
    key = (kind, code)
    c = _strings.get(key)
    if c is None:
        c = _strings.setdefault(key, ffi.new("char[]", text.encode()))
    return c


def cudaGetErrorName(error):
    """``const char *`` name of ``error`` ("unrecognized error code" if unknown)."""
    return _cstr("name", error, _error_name(error))


def cudaGetErrorString(error):
    """``const char *`` description of ``error``, the runtime's own text."""
    return _cstr("string", error, ERROR_STRINGS.get(error, UNRECOGNIZED))


def cudaGetLastError():
    R = _R
    if R is None:
        return cudaSuccess
    rc = R.tls.last_error
    R.tls.last_error = 0
    return R.sticky or rc      # a sticky error is never cleared


def cudaPeekAtLastError():
    R = _R
    return cudaSuccess if R is None else (R.sticky or R.tls.last_error)


def cudaRuntimeGetVersion(runtimeVersion):
    version = core.config().runtime_version
    try:
        runtimeVersion[0] = version
    except (TypeError, RuntimeError):
        if _is_null(runtimeVersion):
            return cudaErrorInvalidValue
        _put(runtimeVersion, version)
    return cudaSuccess


def cudaDriverGetVersion(driverVersion):
    if _is_null(driverVersion):
        return cudaErrorInvalidValue
    cfg = core.config()
    _put(driverVersion, cfg.driver_version if cfg.driver else 0)
    return cudaSuccess


#: Runtime calls that create no primary context.  CUDA Programming Guide, "Initialization":
#: the runtime "will implicitly use device 0 and self-initialize as needed"; a device's primary
#: context "is initialized at the first runtime function which requires an active context on
#: this device".  The device-management queries answer from the driver without one (torch's
#: test_cuda_primary_ctx.py relies on it); cudaSetDevice/cudaInitDevice mark their own target.
#: Every other call marks the calling thread's current device.
_NO_CONTEXT = frozenset({
    "cudaGetDeviceCount", "cudaGetDevice", "cudaSetDevice", "cudaInitDevice", "cudaGetDeviceProperties",
    "cudaGetDeviceProperties_v2", "cudaDeviceGetAttribute", "cudaDeviceGetPCIBusId",
    "cudaDeviceCanAccessPeer",
})


_NO_INIT = {
    "cudaGetErrorName": cudaGetErrorName, "cudaGetErrorString": cudaGetErrorString,
    "cudaGetLastError": cudaGetLastError, "cudaPeekAtLastError": cudaPeekAtLastError,
    "cudaRuntimeGetVersion": cudaRuntimeGetVersion, "cudaDriverGetVersion": cudaDriverGetVersion,
}


# -- device management ------------------------------------------------------------------

def cudaGetDeviceCount(R, count):
    if _is_null(count):
        return cudaErrorInvalidValue
    _put(count, len(R.devices))
    return R.init_error


def cudaSetDevice(R, device):
    if not (0 <= device < len(R.devices)):
        return cudaErrorInvalidDevice
    R.tls.device = device
    # CUDA Programming Guide, "Initialization": "As of CUDA 12.0, the cudaInitDevice() and
    # cudaSetDevice() calls initialize the runtime and the primary context associated with the
    # specified device."
    R.devices[device].context = True
    return cudaSuccess


def cudaGetDevice(R, device):
    try:
        device[0] = R.tls.device
    except (TypeError, RuntimeError):
        if _is_null(device):
            return cudaErrorInvalidValue
        _put(device, R.tls.device)
    return cudaSuccess


def cudaInitDevice(R, device, deviceFlags, flags):
    if not (0 <= device < len(R.devices)):
        return cudaErrorInvalidDevice
    if flags & ~0x1:
        return cudaErrorInvalidValue
    R.devices[device].context = True        # as cudaSetDevice (Programming Guide, "Initialization")
    return cudaSuccess


def _attributes(R: Runtime, d: int) -> Dict[int, int]:
    dev = R.devices[d]
    if dev.attrs is None:
        major, minor = R.cfg.compute_capability
        dev.attrs = {
            1: 1024, 2: 1024, 3: 1024, 4: 64, 5: 2 ** 31 - 1, 6: 65535, 7: 65535,
            8: _SHARED_PER_BLOCK, 9: 65536, 10: 32, 11: 2 ** 31 - 1, 12: 65536, 13: 1980000,
            14: 512, 15: 1, 16: _SM_COUNT, 17: 0, 18: 0, 19: 1, 20: 0,
            30: 512, 31: 1, 32: 1, 33: core.pci_bus(dev.physical), 34: 0, 35: 0, 36: 2619000,
            37: 5120, 38: _L2, 39: 2048, 40: 2, 41: 1, 50: 0, 51: 32,
            75: major, 76: minor, 78: 1, 79: 1, 80: 1, 81: _SHARED_PER_SM, 82: 65536,
            83: 1, 84: 0, 85: d, 86: 0, 87: 2, 88: 0, 89: 1, 90: 1, 91: 1, 95: 1,
            97: _SHARED_PER_BLOCK_OPTIN, 98: 1, 99: 1, 100: 0, 101: 0, 106: 32, 108: _L2 // 2,
            109: 134213632, 111: 1024, 112: 1, 113: 1, 114: 1, 115: 1, 116: 1, 117: 1, 118: 0,
            119: 9, 120: 1 if major >= 9 else 0, 121: 1, 125: 1, 126: 4, 130: 0, 131: -1, 133: 0,
            134: -1, 139: 0x233010DE, 140: 0x16C110DE,
        }
    return dev.attrs


def cudaDeviceGetAttribute(R, value, attr, device):
    if not (0 <= device < len(R.devices)):
        return cudaErrorInvalidDevice
    if _is_null(value) or not (1 <= attr <= 147):
        return cudaErrorInvalidValue
    _put(value, _attributes(R, device).get(attr, 0))
    return cudaSuccess


def _set_fields(obj, values: dict) -> None:
    for name, v in values.items():
        try:
            setattr(obj, name, v)
        except AttributeError:   # field absent from this header version
            pass


def _device_properties(R, prop, device, major: int):
    """Write ``struct cudaDeviceProp`` in the layout of CUDA ``major``'s headers into ``prop``.

    The real library writes its own layout whatever the caller declared (CUDA 12 and 13
    differ: fields removed in 13 shift multiProcessorCount, integrated, ...), so the
    struct is filled by field name in that layout (accel._ffi.cudart_module(major)) and
    its bytes copied into the caller's memory: a caller reading it through the other
    major's declarations reads garbage, as on real hardware.  A caller's struct smaller
    than the layout would be overrun by the real library; the simulator refuses it
    (cudaErrorInvalidValue) instead of corrupting memory."""
    if not (0 <= device < len(R.devices)):
        return cudaErrorInvalidDevice
    if _is_null(prop):
        return cudaErrorInvalidValue
    from accel._ffi import cudart_module
    own_ffi = cudart_module(major).ffi
    try:
        room = len(ffi.buffer(prop))
    except TypeError:           # a bare address: the caller's size is unknown
        room = None
    size = own_ffi.sizeof("struct cudaDeviceProp")
    if room is not None and room < size:
        return cudaErrorInvalidValue
    own = own_ffi.new("struct cudaDeviceProp *")
    _fill_device_properties(R, own, device)
    ffi.memmove(ffi.cast(_CHARP, _addr(prop)), own_ffi.buffer(own), size)
    return cudaSuccess


def cudaGetDeviceProperties(R, prop, device):
    """The plain symbol.  CUDA 13: the current layout.  CUDA 12 (REFERENCE.md "Runtime vs
    driver versions"): its headers map the name to cudaGetDeviceProperties_v2, and the
    plain symbol kept the pre-12.0 layout, which accel has no bindings for (no headers
    of it are generated): refused with cudaErrorNotSupported rather than written in a
    layout the simulator cannot model."""
    major = R.cfg.runtime_version // 1000
    if major < 13:
        return cudaErrorNotSupported
    return _device_properties(R, prop, device, major)


def cudaGetDeviceProperties_v2(R, prop, device):
    """CUDA 12.x (what its headers call cudaGetDeviceProperties): the 12.0+ layout.
    Exported by the 12.x libraries only (accel/sim/cudart_symbols)."""
    return _device_properties(R, prop, device, 12)


def _fill_device_properties(R, prop, device):
    cfg = R.cfg
    dev = R.devices[device]
    a = _attributes(R, device)
    prop.name = cfg.name.encode()[:255]
    prop.uuid.bytes = core.uuid_bytes(dev.physical)
    _set_fields(prop, {
        "totalGlobalMem": cfg.memory, "sharedMemPerBlock": a[8], "regsPerBlock": a[12], "warpSize": a[10],
        "memPitch": a[11], "maxThreadsPerBlock": a[1], "maxThreadsDim": [a[2], a[3], a[4]],
        "maxGridSize": [a[5], a[6], a[7]], "totalConstMem": a[9],
        "major": cfg.compute_capability[0], "minor": cfg.compute_capability[1],
        "textureAlignment": a[14], "texturePitchAlignment": a[51], "multiProcessorCount": a[16],
        "integrated": 0, "canMapHostMemory": 1, "surfaceAlignment": a[30], "concurrentKernels": 1,
        "ECCEnabled": 1, "pciBusID": a[33], "pciDeviceID": 0, "pciDomainID": 0, "tccDriver": 0,
        "asyncEngineCount": a[40], "unifiedAddressing": 1, "memoryBusWidth": a[37], "l2CacheSize": a[38],
        "persistingL2CacheMaxSize": a[108], "maxThreadsPerMultiProcessor": a[39],
        "streamPrioritiesSupported": 1, "globalL1CacheSupported": 1, "localL1CacheSupported": 1,
        "sharedMemPerMultiprocessor": a[81], "regsPerMultiprocessor": a[82], "managedMemory": 1,
        "isMultiGpuBoard": 0, "multiGpuBoardGroupID": device, "hostNativeAtomicSupported": 0,
        "pageableMemoryAccess": 0, "concurrentManagedAccess": 1, "computePreemptionSupported": 1,
        "canUseHostPointerForRegisteredMem": 1, "cooperativeLaunch": 1,
        "sharedMemPerBlockOptin": a[97], "maxBlocksPerMultiProcessor": a[106],
        "accessPolicyMaxWindowSize": a[109], "reservedSharedMemPerBlock": a[111],
        "hostRegisterSupported": 1, "sparseCudaArraySupported": 1, "hostRegisterReadOnlySupported": 1,
        "timelineSemaphoreInteropSupported": 1, "memoryPoolsSupported": 1, "gpuDirectRDMASupported": 1,
        "gpuDirectRDMAFlushWritesOptions": 1, "memoryPoolSupportedHandleTypes": a[119],
        "deferredMappingCudaArraySupported": 1, "ipcEventSupported": 1, "clusterLaunch": a[120],
        "unifiedFunctionPointers": 1, "deviceNumaConfig": 0, "deviceNumaId": -1, "hostNumaId": -1,
        "gpuPciDeviceID": a[139], "gpuPciSubsystemID": a[140],
        # CUDA 12 layout only (removed in 13; cudaDeviceGetAttribute still answers them)
        "clockRate": a[13], "memoryClockRate": a[36], "deviceOverlap": 1, "kernelExecTimeoutEnabled": 0,
        "computeMode": 0, "cooperativeMultiDeviceLaunch": 0, "singleToDoublePrecisionPerfRatio": 2,
    })


def cudaDeviceGetPCIBusId(R, pciBusId, len_, device):
    if not (0 <= device < len(R.devices)):
        return cudaErrorInvalidDevice
    if _is_null(pciBusId) or len_ <= 0:
        return cudaErrorInvalidValue
    text = b"0000:%02x:00.0" % core.pci_bus(R.devices[device].physical)
    text = text[:len_ - 1] + b"\0"
    ffi.memmove(ffi.cast(_CHARP, _addr(pciBusId)), text, len(text))
    return cudaSuccess


def cudaDeviceCanAccessPeer(R, canAccessPeer, device, peerDevice):
    n = len(R.devices)
    if not (0 <= device < n and 0 <= peerDevice < n):
        return cudaErrorInvalidDevice
    if _is_null(canAccessPeer):
        return cudaErrorInvalidValue
    _put(canAccessPeer, 1 if device != peerDevice else 0)
    return cudaSuccess


def cudaDeviceEnablePeerAccess(R, peerDevice, flags):
    """Let kernels of the current device access ``peerDevice``'s memory (one direction only).

    CUDA Runtime API, cudaDeviceEnablePeerAccess: access is unidirectional; flags must be 0;
    cudaErrorPeerAccessAlreadyEnabled when already enabled; cudaErrorInvalidDevice for a bad
    (or the current) device."""
    d = R.tls.device
    if not (0 <= peerDevice < len(R.devices)) or peerDevice == d:
        return cudaErrorInvalidDevice
    if flags != 0:
        return cudaErrorInvalidValue
    peers = R.devices[d].peers
    if peerDevice in peers:
        return cudaErrorPeerAccessAlreadyEnabled
    peers.add(peerDevice)
    return cudaSuccess


def cudaDeviceDisablePeerAccess(R, peerDevice):
    """CUDA Runtime API, cudaDeviceDisablePeerAccess: cudaErrorPeerAccessNotEnabled unless
    cudaDeviceEnablePeerAccess(peerDevice) was called on the current device."""
    if not (0 <= peerDevice < len(R.devices)):
        return cudaErrorInvalidDevice
    peers = R.devices[R.tls.device].peers
    if peerDevice not in peers:
        return cudaErrorPeerAccessNotEnabled
    peers.discard(peerDevice)
    return cudaSuccess


def _device_view(R: Runtime, device: int):
    """``kernels.view`` as seen by a kernel running on ``device``: another device's memory is
    reachable only after cudaDeviceEnablePeerAccess (CUDA Programming Guide, "Peer-to-Peer
    Memory Access"); otherwise the access faults (cudaErrorIllegalAddress).  Pinned host
    memory is reachable from every device (unified addressing makes it portable)."""
    dev = R.devices[device]
    v = dev.view
    if v is None:
        peers, find, base_view, addr_of = dev.peers, R.mem.find, kernels.view, _memory.addr_of
        vm = R.vmm

        def v(ptr, nbytes, dtype=None):
            addr = addr_of(ptr)
            if vm.reservations:
                # Virtual memory: every byte mapped, with read-write access for this device
                # (CUDA Driver API, cuMemMap: "does not make the address accessible"; cuMemSetAccess).
                region = vm.resolve(addr, nbytes, device, True)
                if region.__class__ is str:
                    raise kernels.MemoryRangeError(f"a kernel on device {device} touched {region}")
                if region is not None:
                    buf = ffi.buffer(ffi.cast(_CHARP, addr), nbytes)
                    if dtype is None:
                        return memoryview(buf)
                    import numpy as np
                    dt = np.dtype(dtype)
                    return np.frombuffer(buf, dtype=dt, count=nbytes // dt.itemsize)
            a = find(addr)
            if a is not None and a.kind == _memory.DEVICE and (a.device != device or not a.live):
                why = _pool_access_problem(R, a, device, None)
                if why is not None:
                    raise kernels.MemoryRangeError(f"a kernel on device {device} touched 0x{addr:x}: {why}")
                if a.device != device and a.device not in peers and not _pool_memory(R, a):
                    raise kernels.MemoryRangeError(
                        f"a kernel on device {device} touched 0x{addr:x}, memory of device {a.device}, "
                        f"without peer access (cudaDeviceEnablePeerAccess({a.device}, 0) on device {device})")
            return base_view(addr, nbytes, dtype)
        dev.view = v
    return v


def cudaDeviceGetStreamPriorityRange(R, leastPriority, greatestPriority):
    if not _is_null(leastPriority):
        _put(leastPriority, _PRIORITY_LEAST)
    if not _is_null(greatestPriority):
        _put(greatestPriority, _PRIORITY_GREATEST)
    return cudaSuccess


def cudaDeviceSynchronize(R):
    d = R.tls.device
    if R.captures:
        rc = _unsafe_call(R)
        if rc:
            return rc
        caps = _device_captures(R, d)
        if caps:
            for cap in caps:
                _invalidate(R, cap)
            return cudaErrorStreamCaptureUnsupported
    _wait_device(R, d)
    return R.sticky


def cudaDeviceReset(R):
    """Wait for the current device, then drop its memory, streams and events."""
    d = R.tls.device
    dev = R.devices[d]
    for cap in _device_captures(R, d):
        _invalidate(R, cap)
    _wait_device(R, d)
    for a in R.mem.all():
        if a.kind == _memory.DEVICE and a.device == d:
            R.mem.remove(a)
    with R.mlock:
        dev.used = dev.vmm      # cuMemCreate'd memory is not the context's: it stays until cuMemRelease
        pool = R.default_pools.get(d)
        if pool is not None:
            pool.used = pool.reserved = 0
    for base in [b for b, (p, _n) in R.async_allocs.items() if p.device == d]:
        del R.async_allocs[base]
    R.gmem.forget_device(d)
    dev.peers.clear()
    for s in [s for s in set(R.streams.values()) if s.__class__ is Stream and s.device == d]:
        _destroy_stream(R, s)
    for e in [e for e in set(R.events.values()) if e.device == d]:
        Runtime.drop(R.events, e)
        R.free_events.append(e.handle)
    return R.sticky


def cudaMemGetInfo(R, free, total):
    if _is_null(free) or _is_null(total):
        return cudaErrorInvalidValue
    dev = R.devices[R.tls.device]
    _put(free, R.cfg.memory - dev.reserved - dev.used, "size_t *")
    _put(total, R.cfg.memory, "size_t *")
    return cudaSuccess


# -- memory ------------------------------------------------------------------------------

def _accounted(size: int) -> int:
    return (size + _memory.ALIGN - 1) & ~(_memory.ALIGN - 1)


def cudaMalloc(R, devPtr, size):
    if devPtr is None or size < 0:
        return cudaErrorInvalidValue
    if R.captures:
        rc = _unsafe_call(R)
        if rc:
            return rc
    if size == 0:
        return cudaSuccess if _put_ptr(devPtr, _NULL) else cudaErrorInvalidValue
    d = R.tls.device
    dev = R.devices[d]
    if _oom and core.take_oom():
        return cudaErrorMemoryAllocation
    n = (size + 255) & ~255     # accounted like the 256-byte alignment
    with R.mlock:
        if dev.used + n > R.cfg.memory - dev.reserved:
            return cudaErrorMemoryAllocation
        dev.used += n
        if dev.used > dev.peak:
            dev.peak = dev.used
    try:
        a = _memory.allocate(size, _memory.DEVICE, d)
    except MemoryError:
        with R.mlock:
            dev.used -= n
        return cudaErrorMemoryAllocation
    if not _put_ptr(devPtr, a.key):
        with R.mlock:
            dev.used -= n
        return cudaErrorInvalidValue
    R.mem.add(a)
    return cudaSuccess


def _allocation_to_free(R, ptr, kind):
    """What cudaFree/cudaFreeHost check first: ``(rc, allocation)``; a NULL
    pointer is ``(cudaSuccess, None)``, a valid free ``(cudaSuccess, allocation)``."""
    if ptr is None or (ptr.__class__ is int and ptr == 0):
        return cudaSuccess, None
    a = _lookup(R.mem.by_key, ptr)
    if a is None:
        return (cudaSuccess if ptr == ffi.NULL else cudaErrorInvalidValue), None
    if a.kind != kind:
        return cudaErrorInvalidValue, None
    if R.captures:
        rc = _unsafe_call(R)
        if rc:
            return rc, None
    return cudaSuccess, a


def cudaFree(R, devPtr):
    rc, a = _allocation_to_free(R, devPtr, _memory.DEVICE)
    if a is None:
        return rc
    if a.__class__ is _GraphAllocation:
        return _graph_free_now(R, a)
    _wait_device(R, a.device)   # cudaFree synchronizes: no queued work may still use the buffer
    R.mem.remove(a)
    dev = R.devices[a.device]
    with R.mlock:
        dev.used -= (a.size + 255) & ~255
    return cudaSuccess


def cudaHostAlloc(R, pHost, size, flags):
    if pHost is None or size < 0 or flags & ~0xF:
        return cudaErrorInvalidValue
    if R.captures:
        rc = _unsafe_call(R)
        if rc:
            return rc
    if size == 0:
        return cudaSuccess if _put_ptr(pHost, _NULL) else cudaErrorInvalidValue
    if _oom and core.take_oom():
        return cudaErrorMemoryAllocation
    try:
        a = _memory.allocate(size, _memory.HOST, R.tls.device)
    except MemoryError:
        return cudaErrorMemoryAllocation
    if not _put_ptr(pHost, a.key):
        return cudaErrorInvalidValue
    R.mem.add(a)
    with R.mlock:
        R.host_bytes += _accounted(size)
    return cudaSuccess


def cudaMallocHost(R, ptr, size):
    return cudaHostAlloc(R, ptr, size, 0)


def cudaFreeHost(R, ptr):
    rc, a = _allocation_to_free(R, ptr, _memory.HOST)
    if a is None:
        return rc
    for d in range(len(R.devices)):    # pinned memory may be in use by any device's queue
        _wait_device(R, d)
    R.mem.remove(a)
    with R.mlock:
        R.host_bytes -= _accounted(a.size)
    return cudaSuccess


def cudaPointerGetAttributes(R, attributes, ptr):
    if _is_null(attributes):
        return cudaErrorInvalidValue
    # struct cudaPointerAttributes is 24 bytes in CUDA 12 and 88 in CUDA 13 (reserved[8]
    # added): the real library writes its own size, so a caller's struct smaller than the
    # runtime's would be overrun; refused here (cudaErrorInvalidValue) instead.
    from accel._ffi import cudart_module
    try:
        room = len(ffi.buffer(attributes))
    except TypeError:
        room = None
    if room is not None and room < cudart_module(R.cfg.runtime_version // 1000).ffi.sizeof(
            "struct cudaPointerAttributes"):
        return cudaErrorInvalidValue
    addr = _addr(ptr)
    a = R.mem.find(addr) if addr else None
    if a is None and addr and R.vmm.reservations:
        a = R.vmm.mapping_at(addr)      # mapped virtual memory is device memory of its handle's device
    buf = ffi.buffer(attributes)
    buf[:] = bytes(len(buf))
    if a is None:
        attributes.type = _MEM_TYPE_UNREGISTERED
        attributes.device = _INVALID_DEVICE_ID
        attributes.hostPointer = ffi.cast(_VOIDP, addr)
    elif a.kind == _memory.DEVICE:
        attributes.type = _MEM_TYPE_DEVICE
        attributes.device = a.device
        attributes.devicePointer = ffi.cast(_VOIDP, addr)
    else:
        attributes.type = _MEM_TYPE_HOST
        attributes.device = a.device
        attributes.devicePointer = ffi.cast(_VOIDP, addr)   # mapped: the same address (UVA)
        attributes.hostPointer = ffi.cast(_VOIDP, addr)
    return cudaSuccess


# -- copies ------------------------------------------------------------------------------

def _range_ok(a, addr: int, n: int) -> bool:
    return a is None or addr + n <= a.end


def _copy_op(dst: int, src: int, staged, n: int, da, sa):
    lock = (da.lock if da.__class__ is _vmm.Region else None) or \
        (sa.lock if sa.__class__ is _vmm.Region else None)
    if lock is not None:
        # Virtual memory may be unmapped while the copy is queued (cuMemUnmap does not wait): check
        # and copy under the space's lock, so the pages cannot go between the two.
        def vop():
            with lock.shared():
                for r in (da, sa):
                    why = r.problem() if r.__class__ is _vmm.Region else None
                    if why is None and r is not None and not r.live:
                        why = "freed memory"
                    if why:
                        raise _IllegalAddress(f"copy of {n} bytes 0x{src:x} -> 0x{dst:x}: {why}")
                ffi.memmove(ffi.cast(_CHARP, dst), staged if staged is not None else ffi.cast(_CHARP, src), n)
        return vop

    def op():
        if (da is not None and not da.live) or (sa is not None and not sa.live):
            raise _IllegalAddress(f"copy of {n} bytes 0x{src:x} -> 0x{dst:x} touches freed memory")
        ffi.memmove(ffi.cast(_CHARP, dst), staged if staged is not None else ffi.cast(_CHARP, src), n)
    return op


def _fault_op(why: str):
    def op():
        raise _IllegalAddress(why)
    return op


def _vmm_fault(R: Runtime, s: Stream, why: str, sync: bool, kind: str) -> int:
    """Queue an access to unmapped or inaccessible virtual memory: it faults when it runs, as the
    device's access would (cudaErrorIllegalAddress, sticky)."""
    rc, seq = _enqueue(R, s, _fault_op(f"{kind} on device {s.device}: {why}"), kind, kind)
    if rc:
        return rc
    if sync and seq:
        s.q.wait(seq)
        return R.sticky
    return cudaSuccess


def _memcpy(R: Runtime, dst, src, count, kind, s: Stream, sync: bool, label: str = "memcpy") -> int:
    if not (0 <= kind <= 4):
        return cudaErrorInvalidMemcpyDirection
    if count < 0:
        return cudaErrorInvalidValue
    staged = None
    if isinstance(src, (bytes, bytearray, memoryview)):
        staged = bytes(memoryview(src).cast("B")[:count])
        if len(staged) < count:
            return cudaErrorInvalidValue
        sp = 0
    else:
        sp = _addr(src)
    dp = _addr(dst)
    if count == 0:
        return cudaSuccess
    if dp == 0 or (staged is None and sp == 0):
        return cudaErrorInvalidValue
    if staged is None and dp < sp + count and sp < dp + count:
        # CUDA Runtime API, cudaMemcpy / cudaMemcpyAsync: "The memory areas may not overlap."
        # What an overlapping copy does is not said (copy engines need not copy as memmove
        # does): refused, the identical range included.
        return cudaErrorInvalidValue
    da = R.mem.find(dp)
    sa = R.mem.find(sp) if staged is None else None
    if R.vmm.reservations:
        # The stream's device reads the source and writes the destination: both must be mapped
        # with access for it, else the copy faults (cuMemSetAccess; docs silent on copies of other
        # devices: refused unless that device was granted access).
        dv = R.vmm.resolve(dp, count, s.device, True) if da is None else None
        sv = R.vmm.resolve(sp, count, s.device, False) if sa is None and staged is None else None
        for v in (dv, sv):
            if v.__class__ is str:
                return _vmm_fault(R, s, v, sync, "memcpy")
        if dv is not None:
            da = dv
        if sv is not None:
            sa = sv
    if not _range_ok(da, dp, count) or not _range_ok(sa, sp, count):
        return cudaErrorInvalidValue
    if R.async_allocs or R.gmem.allocs:
        # pool and graph memory: only the devices the pool lets in (cudaMemPoolSetAccess)
        why = _pool_access_problem(R, da, s.device, True) or _pool_access_problem(R, sa, s.device, False)
        if why is not None:
            return _vmm_fault(R, s, f"0x{sp:x} -> 0x{dp:x}: {why}", sync, "memcpy")
    if kind != _MEMCPY_DEFAULT and _MEMCPY_KINDS[kind] != (
            da is not None and da.kind == _memory.DEVICE, sa is not None and sa.kind == _memory.DEVICE):
        # CUDA Runtime API, cudaMemcpy / cudaMemcpyAsync: "Calling cudaMemcpy() with dst and src
        # pointers that do not match the direction of the copy results in an undefined
        # behavior": refused (pinned and pageable host memory are both host memory).
        return cudaErrorInvalidValue
    pageable_dst = da is None
    if staged is None and sa is None:
        if s.capture is not None:   # graphs cannot replay a copy from pageable memory
            _invalidate(R, s.capture)
            return cudaErrorStreamCaptureUnsupported
        # Pageable source: the runtime stages it before returning, so the
        # caller may reuse its buffer at once.
        staged = ffi.buffer(ffi.cast(_CHARP, sp), count)[:]
    if pageable_dst and s.capture is not None:
        _invalidate(R, s.capture)
        return cudaErrorStreamCaptureUnsupported
    if sync and R.captures:
        rc = _unsafe_call(R)
        if rc:
            return rc
    rc, seq = _enqueue(R, s, _copy_op(dp, sp, staged, count, da, sa), "memcpy", label)
    if rc:
        return rc
    if (sync or pageable_dst) and seq:
        # cudaMemcpy, and copies into pageable memory, return once the copy is done.
        s.q.wait(seq)
        if sync:
            return R.sticky
    return cudaSuccess


def cudaMemcpyAsync(R, dst, src, count, kind, stream=None):
    s = _stream(R, stream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    return _memcpy(R, dst, src, count, kind, s, False)


def cudaMemcpy(R, dst, src, count, kind):
    return _memcpy(R, dst, src, count, kind, R.devices[R.tls.device].legacy, True)


def cudaMemcpyPeerAsync(R, dst, dstDevice, src, srcDevice, count, stream=None):
    n = len(R.devices)
    if not (0 <= dstDevice < n and 0 <= srcDevice < n):
        return cudaErrorInvalidDevice
    s = _stream(R, stream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    da, sa = R.mem.find(_addr(dst)), R.mem.find(_addr(src))
    if R.vmm.reservations:
        da = da or R.vmm.mapping_at(_addr(dst))
        sa = sa or R.vmm.mapping_at(_addr(src))
    if da is None or sa is None or da.device != dstDevice or sa.device != srcDevice:
        return cudaErrorInvalidValue
    return _memcpy(R, dst, src, count, _MEMCPY_D2D, s, False, "memcpy-peer")


def _memset_op(dp: int, value: int, n: int, a):
    if a.__class__ is _vmm.Region:
        def vop():
            with a.lock.shared():
                why = a.problem()
                if why:
                    raise _IllegalAddress(f"memset of {n} bytes at 0x{dp:x}: {why}")
                import ctypes
                ctypes.memset(dp, value, n)
        return vop

    def op():
        if not a.live:
            raise _IllegalAddress(f"memset of {n} bytes at 0x{dp:x} touches freed memory")
        import ctypes
        ctypes.memset(dp, value, n)
    return op


def _memset(R: Runtime, devPtr, value, count, s: Stream, sync: bool) -> int:
    if count < 0:
        return cudaErrorInvalidValue
    if count == 0:
        return cudaSuccess
    dp = _addr(devPtr)
    a = R.mem.find(dp) if dp else None
    if a is None and dp and R.vmm.reservations:
        a = R.vmm.resolve(dp, count, s.device, True)
        if a.__class__ is str:
            return _vmm_fault(R, s, a, sync, "memset")
    if a is None or dp + count > a.end:
        return cudaErrorInvalidValue
    if R.async_allocs or R.gmem.allocs:
        why = _pool_access_problem(R, a, s.device, True)
        if why is not None:
            return _vmm_fault(R, s, f"0x{dp:x}: {why}", sync, "memset")
    if sync and R.captures:
        rc = _unsafe_call(R)
        if rc:
            return rc
    rc, seq = _enqueue(R, s, _memset_op(dp, value & 0xFF, count, a), "memset", "memset")
    if rc:
        return rc
    if sync and seq:
        s.q.wait(seq)
        return R.sticky
    return cudaSuccess


def cudaMemsetAsync(R, devPtr, value, count, stream=None):
    s = _stream(R, stream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    return _memset(R, devPtr, value, count, s, False)


def cudaMemset(R, devPtr, value, count):
    return _memset(R, devPtr, value, count, R.devices[R.tls.device].legacy, True)


# -- streams -------------------------------------------------------------------------------

def cudaStreamCreateWithPriority(R, pStream, flags, priority):
    if _is_null(pStream) or flags & ~_STREAM_NON_BLOCKING:
        return cudaErrorInvalidValue
    if R.dead_per_thread:
        _sweep_finished_threads(R)
    d = R.tls.device
    priority = min(_PRIORITY_LEAST, max(_PRIORITY_GREATEST, priority))
    s = Stream(R.new_handle(R.free_streams), d, flags, priority)
    s.q = R.engine.queue(f"cuda{d}-stream-{s.handle:#x}", s)
    dev = R.devices[d]
    with R.lock:
        dev.queues[s.q] = None
        if s.blocking:
            dev.blocking.append(s)
    Runtime.put(R.streams, s)
    _put_ptr(pStream, s.key)
    return cudaSuccess


def cudaStreamCreateWithFlags(R, pStream, flags):
    return cudaStreamCreateWithPriority(R, pStream, flags, 0)


def cudaStreamCreate(R, pStream):
    return cudaStreamCreateWithPriority(R, pStream, 0, 0)


def _destroy_stream(R: Runtime, s: Stream) -> None:
    Runtime.drop(R.streams, s)
    R.free_streams.append(s.handle)
    _close_stream(R, s)


def _close_stream(R: Runtime, s: Stream) -> None:
    s.destroyed = True
    if s.capture is not None:
        _invalidate(R, s.capture)
    dev = R.devices[s.device]
    with R.lock:
        if s in dev.blocking:
            dev.blocking.remove(s)
        R.engine.close(s.q)     # queued work still runs; then the engine and device forget it


def _sweep_finished_threads(R: Runtime) -> None:
    """Close the per-thread default streams of threads that have exited (queued by
    _PerThreadStreams.__del__, which takes no lock), so they leave every table."""
    dead = R.dead_per_thread
    while dead:
        try:
            s = dead.pop()
        except IndexError:
            break
        _close_stream(R, s)


def cudaStreamDestroy(R, stream):
    s = _lookup(R.streams, stream)
    if s.__class__ is not Stream:
        return cudaErrorInvalidResourceHandle
    if s.capture is not None:
        # CUDA Runtime API, cudaStreamDestroy, says nothing of a stream taking part in a capture;
        # destroyed, the capture could never be ended on it (cudaStreamBeginCapture: "Capture must
        # be ended on the same stream in which it was initiated") and would prohibit unsafe calls
        # for good.  Refused: the operation is not permitted while the stream is capturing
        # (cudaErrorStreamCaptureUnsupported), and the capture is invalidated.
        _invalidate(R, s.capture)
        return cudaErrorStreamCaptureUnsupported
    _destroy_stream(R, s)
    return cudaSuccess


def cudaStreamQuery(R, stream):
    s = _stream(R, stream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    if s.capture is not None:
        _invalidate(R, s.capture)
        return cudaErrorStreamCaptureUnsupported
    if R.captures:
        rc = _unsafe_call(R) or (_legacy_conflict(R, s.device) if s.legacy else 0)
        if rc:
            return rc
    q = s.q
    if q.done < q.enqueued:
        return cudaErrorNotReady
    if s.legacy:    # the legacy stream encompasses the device's blocking streams
        for b in R.devices[s.device].blocking:
            if b.q.done < b.q.enqueued:
                return cudaErrorNotReady
    return R.sticky


def cudaStreamSynchronize(R, stream):
    s = _stream(R, stream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    if s.capture is not None:
        _invalidate(R, s.capture)
        return cudaErrorStreamCaptureUnsupported
    if R.captures:
        rc = _unsafe_call(R) or (_legacy_conflict(R, s.device) if s.legacy else 0)
        if rc:
            return rc
    if s.legacy:
        _engine.wait_points([(b.q, b.q.enqueued) for b in R.devices[s.device].blocking])
    s.q.wait()
    return R.sticky


def cudaStreamGetPriority(R, hStream, priority):
    s = _stream(R, hStream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    _put(priority, s.priority)
    return cudaSuccess


def cudaStreamGetFlags(R, hStream, flags):
    s = _stream(R, hStream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    _put(flags, s.flags, "unsigned int *")
    return cudaSuccess


def cudaStreamGetDevice(R, hStream, device):
    s = _stream(R, hStream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    _put(device, s.device)
    return cudaSuccess


def cudaStreamWaitEvent(R, stream, event, flags=0):
    s = _stream(R, stream)
    e = _lookup(R.events, event)
    if s is None or e is None:
        return cudaErrorInvalidResourceHandle
    if flags & ~_EVENT_WAIT_EXTERNAL:
        return cudaErrorInvalidValue
    if flags & _EVENT_WAIT_EXTERNAL:
        return _external_wait(R, s, e)
    r = e.rec
    if r is None:
        return cudaSuccess      # never recorded: the wait is a no-op
    if r.cap is not None:
        return _wait_captured_event(R, s, r)
    cap = s.capture
    if cap is not None:
        if cap.status != _STATUS_ACTIVE:
            return cudaErrorStreamCaptureInvalidated
        # Guide, "Cross-stream Dependencies and Events": waiting on a non-captured event from a
        # capturing stream is invalid without cudaEventWaitExternal.
        _invalidate(R, cap)
        return cudaErrorStreamCaptureIsolation
    if r.q.done >= r.seq:
        return cudaSuccess      # already complete: nothing to wait for
    if s.legacy and R.captures:
        rc = _legacy_conflict(R, s.device)
        if rc:
            return rc
    deps = list(_implicit_deps(R, s))
    deps.append((r.q, r.seq))
    s.q.submit(None, deps, work=False)
    return cudaSuccess


def _external_wait(R: Runtime, s: Stream, e: Event) -> int:
    """cudaStreamWaitEvent(stream, event, cudaEventWaitExternal): an event wait node.

    CUDA Runtime API, cudaStreamWaitEvent: "cudaEventWaitExternal: Event is captured in the
    graph as an external event node when performing stream capture"; cuda.h, CUevent_wait_flags:
    the flag "is invalid when used outside of capture".  The node waits, at each launch, for
    the event's record current at that launch (cudaGraphAddEventWaitNode: "The graph node will
    wait for all work captured in event"), whether or not the event was ever recorded when
    the wait was captured."""
    cap = s.capture
    if cap is None:
        return cudaErrorInvalidValue
    r = e.rec
    if r is not None and r.cap is not None and not r.cap.ended:
        # The event was last recorded inside a capture underway (a capture-internal
        # dependency, Guide "Cross-stream Dependencies and Events"): what an event wait node on
        # it would wait for at launch the docs do not say, so the simulator refuses it.
        _invalidate(R, cap)
        return cudaErrorStreamCaptureUnsupported
    return _enqueue(R, s, None, "event_wait", f"event {e.handle:#x}", event=e)[0]


def _wait_captured_event(R: Runtime, s: Stream, r: Rec) -> int:
    cap = r.cap
    with R.clock:
        if cap.ended:
            # The event was last recorded in a capture that has ended: it stands for a graph node,
            # not for work on a stream (cudaErrorCapturedEvent: "The operation is not permitted on
            # an event which was last recorded in a capturing stream"; Programming Guide, "CUDA
            # Graphs" > "Cross-stream Dependencies and Events").  What waiting on it does is not
            # documented: refused (and a capture doing it is invalidated) until it is recorded again,
            # with the code an H200 returns (driver 580.159.04, libcudart 13.0;
            # tools/cuda_conformance.py, capture_wait_event_of_ended_capture).
            if s.capture is not None and not s.capture.ended:
                s.capture.status = _STATUS_INVALIDATED
            return cudaErrorInvalidValue
        if s.legacy:
            cap.status = _STATUS_INVALIDATED
            return cudaErrorStreamCaptureImplicit
        if s.capture is None:           # fork: s joins the capture
            s.capture = cap
            cap.tails[s] = tuple(r.nodes)
            return cudaSuccess
        if s.capture is not cap:
            s.capture.status = _STATUS_INVALIDATED
            cap.status = _STATUS_INVALIDATED
            return cudaErrorStreamCaptureMerge
        if cap.status != _STATUS_ACTIVE:
            return cudaErrorStreamCaptureInvalidated
        cap.tails[s] = tuple(sorted(set(cap.tails.get(s, ())) | set(r.nodes)))
        return cudaSuccess


# -- events --------------------------------------------------------------------------------

def cudaEventCreateWithFlags(R, event, flags):
    if _is_null(event) or flags & ~0x7 or (flags & _EVENT_INTERPROCESS and not flags & _EVENT_DISABLE_TIMING):
        return cudaErrorInvalidValue
    e = Event(R.new_handle(R.free_events), flags, R.tls.device)
    Runtime.put(R.events, e)
    _put_ptr(event, e.key)
    return cudaSuccess


def cudaEventCreate(R, event):
    return cudaEventCreateWithFlags(R, event, 0)


def cudaEventDestroy(R, event):
    e = _lookup(R.events, event)
    if e is None:
        return cudaErrorInvalidResourceHandle
    Runtime.drop(R.events, e)
    R.free_events.append(e.handle)
    return cudaSuccess


def cudaEventRecord(R, event, stream=None):
    e = _lookup(R.events, event)
    s = _stream(R, stream)
    if e is None or s is None or e.device != s.device:   # event and stream must share a context
        return cudaErrorInvalidResourceHandle
    rec = Rec()
    cap = s.capture
    if cap is not None:
        with R.clock:
            if cap.status != _STATUS_ACTIVE:
                return cudaErrorStreamCaptureInvalidated
            rec.cap = cap
            rec.nodes = cap.tails.get(s, ())
        e.rec = rec
        return cudaSuccess
    if s.legacy and R.captures:
        rc = _legacy_conflict(R, s.device)
        if rc:
            return rc
    q = s.q
    rec.q = q
    rec.seq = q.submit(None if e.flags & _EVENT_DISABLE_TIMING else rec.stamp,
                       _implicit_deps(R, s) if (s.legacy or s.blocking) else (), False)
    e.rec = rec
    return cudaSuccess


def cudaEventRecordWithFlags(R, event, stream=None, flags=0):
    """cudaEventRecordDefault records as cudaEventRecord; cudaEventRecordExternal during stream
    capture adds an event record node (CUDA Runtime API, cudaEventRecordWithFlags: "Event is
    captured in the graph as an external event node when performing stream capture") and
    leaves the event as it was: each launch of the graph records it (cudaGraphAddEventRecordNode:
    "Each launch of the graph will record event").  cuda.h, CUevent_record_flags: the flag "is
    invalid when used outside of capture"."""
    if flags & ~_EVENT_RECORD_EXTERNAL:
        return cudaErrorInvalidValue
    if not flags:
        return cudaEventRecord(R, event, stream)
    e = _lookup(R.events, event)
    s = _stream(R, stream)
    if e is None or s is None or e.device != s.device:   # event and stream must share a context
        return cudaErrorInvalidResourceHandle
    if s.capture is None:
        return cudaErrorInvalidValue
    return _enqueue(R, s, None, "event_record", f"event {e.handle:#x}", event=e)[0]


def _captured_event(R: Runtime, r: Rec) -> int:
    if r.cap.ended:
        # An event last recorded in a capture that has ended: cudaErrorInvalidValue on an H200
        # (driver 580.159.04, libcudart 13.0; tools/cuda_conformance.py,
        # capture_wait_event_of_ended_capture), cudaErrorCapturedEvent while the capture is underway.
        return cudaErrorInvalidValue
    _invalidate(R, r.cap)
    return cudaErrorCapturedEvent


def cudaEventQuery(R, event):
    e = _lookup(R.events, event)
    if e is None:
        return cudaErrorInvalidResourceHandle
    r = e.rec
    if r is not None and r.cap is not None:
        return _captured_event(R, r)
    if R.captures:
        rc = _unsafe_call(R)
        if rc:
            return rc
    if r is None:
        return cudaSuccess
    if r.q.done < r.seq:
        return cudaErrorNotReady
    return R.sticky


def cudaEventSynchronize(R, event):
    e = _lookup(R.events, event)
    if e is None:
        return cudaErrorInvalidResourceHandle
    r = e.rec
    if r is not None and r.cap is not None:
        return _captured_event(R, r)
    if R.captures:
        rc = _unsafe_call(R)
        if rc:
            return rc
    if r is None:
        return cudaSuccess
    r.q.wait(r.seq)
    return R.sticky


def cudaEventElapsedTime(R, ms, start, end):
    a, b = _lookup(R.events, start), _lookup(R.events, end)
    if a is None or b is None:
        return cudaErrorInvalidResourceHandle
    if _is_null(ms):
        return cudaErrorInvalidValue
    # CUDA Programming Guide, "Multi-Device System": "cudaEventElapsedTime() will fail if the
    # two input events are associated to different devices."
    if (a.flags | b.flags) & _EVENT_DISABLE_TIMING or a.device != b.device:
        return cudaErrorInvalidResourceHandle
    ra, rb = a.rec, b.rec
    if ra is None or rb is None:
        return cudaErrorInvalidResourceHandle   # never recorded
    if ra.cap is not None or rb.cap is not None:
        return _captured_event(R, ra if ra.cap is not None else rb)
    if ra.q.done < ra.seq or rb.q.done < rb.seq:
        return cudaErrorNotReady
    _put(ms, (rb.ts - ra.ts) / 1e6, "float *")
    return cudaSuccess


# -- capture and graphs -----------------------------------------------------------------

def cudaStreamBeginCapture(R, stream, mode):
    s = _stream(R, stream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    if s.legacy:
        return cudaErrorStreamCaptureUnsupported
    if mode not in (_CAPTURE_GLOBAL, _CAPTURE_THREAD_LOCAL, _CAPTURE_RELAXED):
        return cudaErrorInvalidValue
    with R.clock:
        if s.capture is not None:
            return cudaErrorIllegalState
        cap = Capture(next(R.capture_ids), s, mode, threading.get_ident(), s.device)
        s.capture = cap
        R.captures.add(cap)
    return cudaSuccess


def _unjoined(cap: Capture) -> bool:
    """True when some stream's last captured work does not flow into the origin's tail."""
    reach = set()
    stack = list(cap.tails.get(cap.origin, ()))
    while stack:
        n = stack.pop()
        if n not in reach:
            reach.add(n)
            stack.extend(cap.nodes[n].deps)
    return any(not set(t) <= reach for st, t in cap.tails.items() if st is not cap.origin)


def cudaStreamEndCapture(R, stream, pGraph):
    s = _stream(R, stream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    if _is_null(pGraph):
        return cudaErrorInvalidValue
    with R.clock:
        cap = s.capture
        if cap is None:
            return cudaErrorIllegalState
        if cap.origin is not s:
            cap.status = _STATUS_INVALIDATED
            return cudaErrorStreamCaptureUnmatched
        # A global or thread_local capture must be ended by the thread that began it (Runtime API,
        # cudaStreamEndCapture: cudaErrorStreamCaptureWrongThread).  The call from another thread
        # still ends the capture: measured on an H200 (driver 580.159.04, libcudart 13.0;
        # tools/cuda_conformance.py, capture_end_other_thread_global), the stream then reports no
        # capture and the capturing thread's own cudaStreamEndCapture fails with
        # cudaErrorIllegalState.  What was captured is discarded.
        wrong_thread = cap.mode != _CAPTURE_RELAXED and cap.thread != threading.get_ident()
        for st in cap.tails:
            if st.capture is cap:
                st.capture = None
        cap.ended = True
        R.captures.discard(cap)
        _put_ptr(pGraph, _NULL)
        g = None
        if wrong_thread:
            rc = cudaErrorStreamCaptureWrongThread
        elif cap.status != _STATUS_ACTIVE:
            rc = cudaErrorStreamCaptureInvalidated
        elif _unjoined(cap):
            rc = cudaErrorStreamCaptureUnjoined
        else:
            rc = cudaSuccess
            g = Graph(R.new_handle(), tuple(cap.nodes), cap.id, cap.device)
    if R.gmem.allocs:
        _graph_mem_captured(R, cap, g)      # graph memory nodes: owned by the graph, or given back
    if rc:
        return rc
    Runtime.put(R.graphs, g)
    _put_ptr(pGraph, g.key)
    return cudaSuccess


def cudaStreamIsCapturing(R, stream, pCaptureStatus):
    s = _stream(R, stream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    if _is_null(pCaptureStatus):
        return cudaErrorInvalidValue
    if s.legacy and R.captures:
        if any(c.device == s.device and any(st.blocking for st in c.tails) for c in list(R.captures)):
            return cudaErrorStreamCaptureImplicit
    cap = s.capture
    _put(pCaptureStatus, _STATUS_NONE if cap is None else cap.status, "int *")
    return cudaSuccess


def cudaStreamGetCaptureInfo(R, stream, captureStatus_out, id_out=None, graph_out=None,
                             dependencies_out=None, edgeData_out=None, numDependencies_out=None):
    s = _stream(R, stream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    if _is_null(captureStatus_out):
        return cudaErrorInvalidValue
    if s.legacy and R.captures:
        if any(c.device == s.device and any(st.blocking for st in c.tails) for c in list(R.captures)):
            return cudaErrorStreamCaptureImplicit
    cap = s.capture
    _put(captureStatus_out, _STATUS_NONE if cap is None else cap.status, "int *")
    if cap is not None:
        if not _is_null(id_out):
            _put(id_out, cap.id, "unsigned long long *")
        if not _is_null(graph_out):
            _put_ptr(graph_out, _NULL)      # the simulator has no graph object until EndCapture
        if not _is_null(dependencies_out):
            _put_ptr(dependencies_out, _NULL)
        if not _is_null(edgeData_out):
            _put_ptr(edgeData_out, _NULL)
        if not _is_null(numDependencies_out):
            _put(numDependencies_out, len(cap.tails.get(s, ())), "size_t *")
    return cudaSuccess


def cudaStreamGetCaptureInfo_v2(R, stream, captureStatus_out, id_out, graph_out, dependencies_out,
                                numDependencies_out):
    """CUDA 12.x (what its headers call cudaStreamGetCaptureInfo): the outputs of the
    CUDA 13 call without edgeData.  Exported by the 12.x libraries only."""
    return cudaStreamGetCaptureInfo(R, stream, captureStatus_out, id_out, graph_out, dependencies_out,
                                    None, numDependencies_out)


def cudaThreadExchangeStreamCaptureMode(R, mode):
    if _is_null(mode):
        return cudaErrorInvalidValue
    try:
        new = mode[0]
    except TypeError:
        new = ffi.cast("int *", _addr(mode))[0]
    if new not in (_CAPTURE_GLOBAL, _CAPTURE_THREAD_LOCAL, _CAPTURE_RELAXED):
        return cudaErrorInvalidValue
    old = R.tls.capture_mode
    R.tls.capture_mode = new
    _put(mode, old, "int *")
    return cudaSuccess


def _event_plan(nodes: Sequence[Node]):
    """How a launch of a graph with event nodes runs: ("work", nodes) steps (one stream
    operation each, as a graph without event nodes is one), split at ("record", Event) and
    ("wait", Event) steps; None when the graph has no event node."""
    if all(n.event is None for n in nodes):
        return None
    plan, chunk = [], []
    for n in nodes:
        if n.event is None:
            chunk.append(n)
            continue
        if chunk:
            plan.append(("work", tuple(chunk)))
            chunk = []
        plan.append(("record" if n.kind == "event_record" else "wait", n.event))
    if chunk:
        plan.append(("work", tuple(chunk)))
    return tuple(plan)


def _launch_with_events(R: Runtime, x: GraphExec, s: Stream) -> int:
    """cudaGraphLaunch of a graph with event record / wait nodes, as stream operations in
    capture order: each record node records its event when the launch reaches it (timestamp
    and completion, cudaGraphAddEventRecordNode: "Each launch of the graph will record
    event"), each wait node waits for its event's record current at this launch (or for a
    record node earlier in the same launch, which stream order already covers).  Everything
    is checked before anything is queued, so a refused launch queues nothing."""
    if s.capture is not None:
        # Launching into a capture makes the graph a child graph node; what event nodes do
        # there the docs do not say (cudaGraphAddChildGraphNode lists only the node kinds it
        # refuses), so the simulator refuses it.
        _invalidate(R, s.capture)
        return cudaErrorStreamCaptureUnsupported
    steps = []
    recorded = set()
    for kind, arg in x.plan:
        if kind == "work":
            steps.append((kind, arg, None))
            continue
        if R.events.get(arg.handle) is not arg:
            # The node's event was destroyed (its handle may name another event by now): what
            # the launch would record or wait for the docs do not say, so it is refused.
            return cudaErrorInvalidResourceHandle
        if kind == "record":
            recorded.add(id(arg))
            steps.append((kind, arg, None))
            continue
        r = arg.rec
        if id(arg) in recorded or r is None:
            continue            # recorded earlier in this launch, or never: nothing more to wait for
        if r.cap is not None:
            if r.cap.ended:
                continue        # as cudaStreamWaitEvent on an event of an ended capture
            return cudaErrorCapturedEvent
        if r.q.done < r.seq:
            steps.append((kind, arg, (r.q, r.seq)))
    if s.legacy and R.captures:
        rc = _legacy_conflict(R, s.device)
        if rc:
            return rc
    deps = list(_implicit_deps(R, s)) if (s.legacy or s.blocking) else []
    q = s.q
    x.launches += 1
    for kind, arg, point in steps:
        if kind == "work":
            q.submit(_replay(arg), deps, True)
        elif kind == "record":
            rec = Rec()
            rec.q = q
            rec.seq = q.submit(None if arg.flags & _EVENT_DISABLE_TIMING else rec.stamp, deps, False)
            arg.rec = rec
        else:
            q.submit(None, deps + [point], False)
        deps = []               # later steps follow the first in stream order
    return cudaSuccess


def _replay(nodes: Sequence[Node]):
    def run():
        delay = core.delay_s
        for i, node in enumerate(nodes):
            if node.fn is not None:
                if delay and i:
                    time.sleep(delay)
                node.fn()
    return run


def cudaGraphInstantiate(R, pGraphExec, graph, flags=0):
    g = _lookup(R.graphs, graph)
    if g is None:
        return cudaErrorInvalidResourceHandle
    if _is_null(pGraphExec):
        return cudaErrorInvalidValue
    rc, em = _graph_mem_instantiate(R, g, flags)
    if rc:
        return rc
    x = GraphExec(R.new_handle(), g.nodes, g.device)
    if em is not None:
        _graph_mem_bind(R, x, em)
    Runtime.put(R.execs, x)
    _put_ptr(pGraphExec, x.key)
    return cudaSuccess


def cudaGraphInstantiateWithFlags(R, pGraphExec, graph, flags=0):
    return cudaGraphInstantiate(R, pGraphExec, graph, flags)


def cudaGraphLaunch(R, graphExec, stream):
    x = _lookup(R.execs, graphExec)
    s = _stream(R, stream)
    if x is None or s is None:
        return cudaErrorInvalidResourceHandle
    # CUDA Programming Guide, "Multi-Device System" (Stream and Event Behavior): a launch into a
    # stream not associated with the current device fails; a graph exec belongs to its device.
    if s.device != R.tls.device or x.device != s.device:
        return cudaErrorInvalidResourceHandle
    cap = s.capture
    if cap is not None:
        # A graph launched into a stream being captured: measured on an H200 (driver 580.159.04,
        # libcudart 13.0; tools/cuda_conformance.py, capture_graph_launch_inside) the launch returns
        # cudaErrorStreamCaptureUnsupported and the capture is invalidated.
        _invalidate(R, cap)
        return cudaErrorStreamCaptureUnsupported
    for lib in x.libraries:
        if lib.unloaded:
            # cudaLibraryUnload / cuModuleUnload (CUDA Runtime and Driver API): "Use of the handle
            # after this call is undefined behavior"; a graph still launching one of the module's
            # kernels would run freed code.  The docs name no error for it: the simulator refuses
            # the launch with the one an unknown kernel gets (cudaLaunchKernel).
            return cudaErrorInvalidDeviceFunction
    em = R.gmem.execs.get(x) if R.gmem.execs else None
    if em is not None:
        rc, mapped = _graph_mem_before_launch(R, em, s)
        if rc:
            return rc
    if x.plan is not None:
        rc = _launch_with_events(R, x, s)
    else:
        x.launches += 1
        rc = _enqueue(R, s, _replay(x.nodes), "graph", f"graph exec {x.handle:#x}")[0]
    if em is not None:
        _graph_mem_after_launch(R, em, s, rc, mapped)
    return rc


def _graph_destroy_in_capture(R: Runtime) -> int:
    """cudaGraphExecDestroy / cudaGraphDestroy while a capture is underway.  The CUDA docs list
    neither among the calls prohibited during capture, but the driver refuses them: PyTorch
    PR 161037 ("Disable GC when capturing CUDA Graphs": destroying a graph while capturing
    another gives "operation not permitted when stream is capturing" from CUDAGraph::reset and
    breaks the capture), NVIDIA Warp issue 992 ("Deleting a CUDA graph breaks capture").
    Refused as the other potentially unsafe calls (900, capture invalidated; relaxed mode
    allows them)."""
    return _unsafe_call(R) if R.captures else cudaSuccess


def cudaGraphExecDestroy(R, graphExec):
    x = _lookup(R.execs, graphExec)
    if x is None:
        return cudaErrorInvalidResourceHandle
    rc = _graph_destroy_in_capture(R)
    if rc:
        return rc
    Runtime.drop(R.execs, x)
    em = R.gmem.execs.pop(x, None) if R.gmem.execs else None
    if em is not None:
        _graph_mem_exec_destroyed(R, em)
    return cudaSuccess


def cudaGraphDestroy(R, graph):
    g = _lookup(R.graphs, graph)
    if g is None:
        return cudaErrorInvalidResourceHandle
    rc = _graph_destroy_in_capture(R)
    if rc:
        return rc
    Runtime.drop(R.graphs, g)
    _graph_mem_graph_destroyed(R, g)
    return cudaSuccess


def cudaGraphGetNodes(R, graph, nodes, numNodes):
    g = _lookup(R.graphs, graph)
    if g is None:
        return cudaErrorInvalidResourceHandle
    if _is_null(numNodes):
        return cudaErrorInvalidValue
    if not _is_null(nodes):
        return cudaErrorInvalidValue    # node handles are not simulated; count only
    _put(numNodes, len(g.nodes), "size_t *")
    return cudaSuccess


def dot_text(g: Graph) -> str:
    """The DOT description cudaGraphDebugDotPrint writes for ``g``."""
    gid = f"graph_{g.capture_id}"
    lines = ["digraph dot {", f"subgraph cluster_{g.capture_id} {{",
             f'label="{gid}" graph[style="dashed"];']
    for n in g.nodes:
        label = f"{n.id}\\n{n.kind.upper()}\\n{n.label}"
        lines.append(f'"{gid}_node_{n.id}"[style="solid" shape="rectangle" label="{label}"];')
    for n in g.nodes:
        for d in n.deps:
            lines.append(f'"{gid}_node_{d}" -> "{gid}_node_{n.id}";')
    lines += ["}", "}", ""]
    return "\n".join(lines)


def cudaGraphDebugDotPrint(R, graph, path, flags):
    g = _lookup(R.graphs, graph)
    if g is None:
        return cudaErrorInvalidResourceHandle
    p = _c_string(path)
    if not p:
        return cudaErrorInvalidValue
    try:
        with open(p, "w") as f:
            f.write(dot_text(g))
    except OSError:
        return cudaErrorOperatingSystem
    return cudaSuccess


# -- kernels ------------------------------------------------------------------------------

ptx_entries = _cuda_images.ptx_entries


_MODULE_LOAD_IN_CAPTURE = 12030    # the first driver (CUDA 12.3) that loads modules during a capture


def module_call_in_capture(R: Runtime, loading: bool) -> int:
    """0, or cudaErrorStreamCaptureUnsupported (= CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) after
    invalidating the captures that prohibit this thread's potentially unsafe calls
    (:func:`_unsafe_call`), for loading (cudaLibraryLoadData, cuModuleLoadData) or unloading
    (cudaLibraryUnload, cuModuleUnload) a module while a capture is underway.

    The CUDA documentation lists neither among the calls prohibited during capture.  Drivers
    before CUDA 12.3 refuse a load with 900 (NVIDIA Warp, warp.capture_begin: "kernels can be
    loaded during graph capture on more recent drivers", CUDA 12.3 or newer; Warp reports
    "error 900: operation not permitted when stream is capturing" from cuModuleLoadDataEx on a
    12.2 driver); an unload during a capture fails the same way on current drivers (Warp issue
    401, "Module unloading causes errors during graph capture").  Both are refused as the
    other potentially unsafe calls: the calling thread's relaxed mode allows them."""
    if not R.captures or (loading and R.cfg.driver_version >= _MODULE_LOAD_IN_CAPTURE):
        return cudaSuccess
    return _unsafe_call(R)


def load_image(R: Runtime, code, device=None):
    """(Library, 0) for the module image at ``code`` (PTX, cubin or fatbin), or (None, error code).
    ``device`` set: a driver module of that device's context (cuModuleLoadData); None: a
    context-independent cudaLibrary_t."""
    rc = module_call_in_capture(R, True)
    if rc:
        return None, rc
    try:
        data = _cuda_images.image_bytes(ffi, code, _CHARP)
        # Every simulated device has the configured compute capability.
        names, jit = _cuda_images.load(data, R.cfg.compute_capability, R.cfg.driver_version)
    except _cuda_images.ImageError as exc:
        return None, exc.code
    if jit:
        R.jit_compiles += 1
    lib = Library(R.new_handle(), frozenset(names), device, _cuda_images.declared_params(data))
    Runtime.put(R.libraries, lib)
    return lib, cudaSuccess


def cudaLibraryLoadData(R, library, code, jitOptions=None, jitOptionsValues=None, numJitOptions=0,
                        libraryOptions=None, libraryOptionValues=None, numLibraryOptions=0):
    if _is_null(library) or _is_null(code):
        return cudaErrorInvalidValue
    lib, rc = load_image(R, code)
    if lib is None:
        return rc
    _put_ptr(library, lib.key)
    return cudaSuccess


def cudaLibraryUnload(R, library):
    lib = _lookup(R.libraries, library)
    if lib is None or lib.device is not None:    # a driver CUmodule is not a cudaLibrary_t
        return cudaErrorInvalidResourceHandle
    rc = module_call_in_capture(R, False)
    if rc:
        return rc
    unload(R, lib)
    return cudaSuccess


def unload(R: Runtime, lib: Library) -> None:
    lib.unloaded = True
    Runtime.drop(R.libraries, lib)
    for k in lib.kernels.values():
        Runtime.drop(R.kernels, k)


def kernel_of(R: Runtime, lib: Library, name: str) -> "KernelHandle":
    """The one handle of kernel ``name`` (in ``lib.names``) of ``lib``."""
    k = lib.kernels.get(name)
    if k is None:
        k = lib.kernels[name] = KernelHandle(R.new_handle(), name, lib)
        Runtime.put(R.kernels, k)
    return k


def cudaLibraryGetKernel(R, pKernel, library, name):
    lib = _lookup(R.libraries, library)
    if lib is None or lib.device is not None:
        return cudaErrorInvalidResourceHandle
    n = _c_string(name)
    if _is_null(pKernel) or n is None:
        return cudaErrorInvalidValue
    if n not in lib.names:
        return cudaErrorSymbolNotFound
    _put_ptr(pKernel, kernel_of(R, lib, n).key)
    return cudaSuccess


# -- driver entry points -------------------------------------------------------------------

_ENTRY_FLAGS = (0, 1, 2)   # cudaEnableDefault, cudaEnableLegacyStream, cudaEnablePerThreadDefaultStream
_ENTRY_FOUND, _ENTRY_NOT_FOUND, _ENTRY_VERSION_NOT_SUFFICIENT = 0, 1, 2   # cudaDriverEntryPointQueryResult


def _entry_point(R, symbol, funcPtr, version, flags, driverStatus):
    """CUDA Runtime API, cudaGetDriverEntryPoint[ByVersion]: the driver function ``symbol`` of ABI
    ``version`` in ``*funcPtr``, or NULL with driverStatus SymbolNotFound (the driver has no such
    symbol) / VersionNotSufficent (``version`` predates the symbol's first ABI)."""
    name = _c_string(symbol)
    if name is None or _is_null(funcPtr) or flags not in _ENTRY_FLAGS:
        return cudaErrorInvalidValue
    from . import cuda_driver
    status, fn = cuda_driver.entry_point(name, version, R.cfg.driver_version)
    _put_ptr(funcPtr, fn if fn is not None else _NULL)
    if not _is_null(driverStatus):
        _put(driverStatus, status)
    return cudaSuccess


def cudaGetDriverEntryPoint(R, symbol, funcPtr, flags, driverStatus=None):
    # Without a version the runtime asks for the ABI of its own CUDA version.
    return _entry_point(R, symbol, funcPtr, R.cfg.runtime_version, flags, driverStatus)


def cudaGetDriverEntryPointByVersion(R, symbol, funcPtr, cudaVersion, flags, driverStatus=None):
    # cuda_runtime_api.h: "If the specified CUDA version is greater than the driver version, the
    # API will return cudaErrorInvalidValue."
    if cudaVersion > R.cfg.driver_version:
        return cudaErrorInvalidValue
    return _entry_point(R, symbol, funcPtr, cudaVersion, flags, driverStatus)


_FUNC_ATTR_MAX_DYNAMIC_SHARED = 8          # cudaFuncAttributeMaxDynamicSharedMemorySize
_FUNC_ATTR_PREFERRED_CARVEOUT = 9          # cudaFuncAttributePreferredSharedMemoryCarveout


def cudaFuncSetAttribute(R, func, attr, value):
    """Set a kernel attribute for the current device (cudaKernel_t handles as ``func``).

    CUDA Runtime API, cudaFuncSetAttribute: cudaErrorInvalidDeviceFunction for an unknown
    function; cudaErrorInvalidValue for an attribute that cannot be written or a bad value.
    cudaFuncAttributeMaxDynamicSharedMemorySize may not exceed cudaDevAttrMaxSharedMemoryPerBlockOptin
    (kernels here use no static shared memory); the carveout is a percentage (-1: default)."""
    k = _lookup(R.kernels, func)
    if k is None:
        return cudaErrorInvalidDeviceFunction
    if attr == _FUNC_ATTR_MAX_DYNAMIC_SHARED:
        if not (0 <= value <= _SHARED_PER_BLOCK_OPTIN):
            return cudaErrorInvalidValue
        k.max_dynamic_shared[R.tls.device] = value
        return cudaSuccess
    if attr == _FUNC_ATTR_PREFERRED_CARVEOUT:
        if not -1 <= value <= 100:
            return cudaErrorInvalidValue
        k.carveout[R.tls.device] = value
        return cudaSuccess
    return cudaErrorInvalidValue


def cudaFuncGetAttributes(R, attr, func):
    """``struct cudaFuncAttributes`` of a kernel (cudaKernel_t handles as ``func``) on the
    current device.  CUDA Runtime API, cudaFuncGetAttributes: cudaErrorInvalidDeviceFunction
    for an unknown function.  The struct has the same layout in CUDA 12 and 13; fields are
    set by name.  The simulated kernels use no static shared, constant or local memory."""
    k = _lookup(R.kernels, func)
    if k is None:
        return cudaErrorInvalidDeviceFunction
    if _is_null(attr):
        return cudaErrorInvalidValue
    _set_fields(attr, function_attributes(R, k))
    return cudaSuccess


def function_attributes(R: Runtime, k: "KernelHandle") -> Dict[str, int]:
    """The fields of ``struct cudaFuncAttributes`` of ``k`` on the current device (also what the
    driver's cuFuncGetAttribute reads)."""
    d = R.tls.device
    major, minor = R.cfg.compute_capability
    return {
        "sharedSizeBytes": 0, "constSizeBytes": 0, "localSizeBytes": 0, "maxThreadsPerBlock": 1024,
        "numRegs": _SIM_NUM_REGS, "ptxVersion": major * 10 + minor, "binaryVersion": major * 10 + minor,
        "cacheModeCA": 0, "maxDynamicSharedSizeBytes": k.max_dynamic_shared.get(d, _SHARED_PER_BLOCK),
        "preferredShmemCarveout": k.carveout.get(d, -1), "clusterDimMustBeSet": 0,
        "requiredClusterWidth": 0, "requiredClusterHeight": 0, "requiredClusterDepth": 0,
        "clusterSchedulingPolicyPreference": 0, "nonPortableClusterSizeAllowed": 0,
    }


_MAX_BLOCKS_PER_SM = 32            # cudaDevAttrMaxBlocksPerMultiprocessor (compute capability 9.0)
_MAX_THREADS_PER_SM = 2048         # cudaDevAttrMaxThreadsPerMultiProcessor
_REGS_PER_SM = 65536               # cudaDevAttrMaxRegistersPerMultiprocessor
_SIM_NUM_REGS = 32                 # what cudaFuncGetAttributes reports for a simulated kernel


def cudaOccupancyMaxActiveBlocksPerMultiprocessor(R, numBlocks, func, blockSize, dynamicSMemSize):
    """CUDA Runtime API, cudaOccupancyMaxActiveBlocksPerMultiprocessor: the blocks of the kernel
    resident on one SM at once.  cudaErrorInvalidDeviceFunction for an unknown function,
    cudaErrorInvalidValue for a NULL result or a block size outside 1..maxThreadsPerBlock.
    Computed from the limits the CUDA Programming Guide ("Compute Capabilities", table of
    technical specifications) gives for compute capability 9.0: 32 blocks, 2048 threads, 64K
    registers (allocated per warp) and the SM's shared memory, of which each block also
    reserves 1 KiB for the system ("Shared Memory" in the 9.0 section)."""
    k = _lookup(R.kernels, func)
    if k is None:
        return cudaErrorInvalidDeviceFunction
    if _is_null(numBlocks) or not (1 <= blockSize <= 1024) or dynamicSMemSize < 0:
        return cudaErrorInvalidValue
    warps = -(-blockSize // 32)
    limits = [_MAX_BLOCKS_PER_SM, _MAX_THREADS_PER_SM // (warps * 32),
              _REGS_PER_SM // (warps * 32 * _SIM_NUM_REGS)]
    if dynamicSMemSize > k.max_dynamic_shared.get(R.tls.device, _SHARED_PER_BLOCK):
        limits.append(0)
    else:
        limits.append(_SHARED_PER_SM // (dynamicSMemSize + 1024))
    _put(numBlocks, max(0, min(limits)))
    return cudaSuccess


# -- stream-ordered allocation (cudaMallocAsync) ---------------------------------------------
#
# Modelled: each device's default pool, allocation on a stream, cudaFreeAsync in stream order,
# the pool's statistics, cudaMemPoolTrimTo, and which other devices may touch the pool's
# memory (cudaMemPoolSetAccess).  Not modelled, and stricter than the hardware: memory freed
# to the pool stays reserved (counted as used device memory) until cudaMemPoolTrimTo; the real
# pool also releases down to cudaMemPoolAttrReleaseThreshold at synchronization points.  Size
# 0 and a NULL free, on which the CUDA Runtime API documentation is silent, are refused.
#
# During stream capture both calls make graph memory nodes (_graph_mem.py has the model and
# its citations); the graph's memory is its own, not the default pool's, and comes back with
# cudaDeviceGraphMemTrim.  Explicitly built graphs (cudaGraphAddMemAllocNode) are not
# simulated, like every other explicit graph construction call.

# The pool's backing memory (cudaMemPoolAttrReservedMemCurrent) grows and shrinks in whole pages
# of the allocation granularity: pools are built on the virtual memory calls, whose physical
# allocations are multiples of cuMemGetAllocationGranularity (2 MiB here, as _vmm.GRANULARITY).
# How much more the driver reserves at a time is not documented; whole pages are the least any
# implementation can hold, so reserved memory never drops below the 2 MiB floor of what is used.
# Placement inside the pool is not modelled (freed bytes are reusable by any size: no
# fragmentation), which is more generous than the hardware; only the page rounding is enforced.
_POOL_CHUNK = _vmm.GRANULARITY
_POOL_REUSE_FOLLOW_EVENTS, _POOL_REUSE_OPPORTUNISTIC, _POOL_REUSE_INTERNAL_DEPS = 1, 2, 3
_POOL_RELEASE_THRESHOLD = 4
_POOL_RESERVED_CURRENT, _POOL_RESERVED_HIGH, _POOL_USED_CURRENT, _POOL_USED_HIGH = 5, 6, 7, 8


def _default_pool(R: Runtime, device: int) -> MemPool:
    pool = R.default_pools.get(device)
    if pool is None:
        with R.mlock:
            pool = R.default_pools.get(device)
            if pool is None:
                pool = MemPool(next(R.handles), device)
                R.pools[pool.handle] = R.pools[pool.key] = pool
                R.default_pools[device] = pool
    return pool


def cudaDeviceGetDefaultMemPool(R, memPool, device):
    if not (0 <= device < len(R.devices)):
        return cudaErrorInvalidDevice
    if _is_null(memPool):
        return cudaErrorInvalidValue
    _put_ptr(memPool, _default_pool(R, device).key)
    return cudaSuccess


def cudaMallocAsync(R, devPtr, size, hStream):
    """CUDA Runtime API, cudaMallocAsync: ``size`` bytes from the default pool of the stream's
    device, usable in stream order on ``hStream``; cudaErrorMemoryAllocation when the device
    has no room for what the pool must add."""
    if _is_null(devPtr) or size <= 0:
        return cudaErrorInvalidValue
    s = _stream(R, hStream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    if s.capture is not None:
        return _capture_malloc(R, devPtr, size, s)
    if _oom and core.take_oom():
        return cudaErrorMemoryAllocation
    pool, dev = _default_pool(R, s.device), R.devices[s.device]
    n = (size + 255) & ~255
    with R.mlock:
        grow = -(-max(0, n - (pool.reserved - pool.used)) // _POOL_CHUNK) * _POOL_CHUNK
        if dev.used + grow > R.cfg.memory - dev.reserved:
            return cudaErrorMemoryAllocation
        dev.used += grow
        dev.peak = max(dev.peak, dev.used)
        pool.reserved += grow
        pool.used += n
        pool.used_high = max(pool.used_high, pool.used)
        pool.reserved_high = max(pool.reserved_high, pool.reserved)
    try:
        a = _memory.allocate(size, _memory.DEVICE, s.device)
    except MemoryError:
        a = None
    if a is None or not _put_ptr(devPtr, a.key):
        with R.mlock:
            pool.used -= n
        return cudaErrorMemoryAllocation if a is None else cudaErrorInvalidValue
    R.mem.add(a)
    R.async_allocs[a.base] = (pool, n)
    return cudaSuccess


def cudaFreeAsync(R, devPtr, hStream):
    """CUDA Runtime API, cudaFreeAsync: returns memory from cudaMallocAsync to its pool in
    stream order on ``hStream``.  Memory from cudaMalloc, or freed already, is refused
    (cudaErrorInvalidValue)."""
    s = _stream(R, hStream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    a = None if _is_null(devPtr) else _lookup(R.mem.by_key, devPtr)
    if a.__class__ is _GraphAllocation:
        return _capture_free(R, a, s) if s.capture is not None else _graph_free_async(R, a, s)
    if a is None or a.base not in R.async_allocs:
        return cudaErrorInvalidValue
    if s.capture is not None:
        # cudaFreeAsync: "During stream capture, this function results in the creation of a free
        # node and must therefore be passed the address of a graph allocation."
        return cudaErrorInvalidValue
    pool, n = R.async_allocs.pop(a.base)

    def run():
        R.mem.remove(a)
        with R.mlock:
            pool.used -= n
    rc, _seq = _enqueue(R, s, run, "free", "cudaFreeAsync")
    if rc:
        R.async_allocs[a.base] = (pool, n)
    return rc


def _pool_value(value, ctype):
    try:
        return value[0]
    except TypeError:
        return ffi.cast(ctype, _addr(value))[0]


def cudaMemPoolSetAttribute(R, memPool, attr, value):
    """CUDA Runtime API, cudaMemPoolSetAttribute: the reuse flags (int), the release
    threshold (cuuint64_t) and the two high watermarks, which can only be reset to 0;
    the current sizes are read-only (cudaErrorInvalidValue)."""
    pool = _lookup(R.pools, memPool)
    if pool is None:
        return cudaErrorInvalidResourceHandle
    if _is_null(value):
        return cudaErrorInvalidValue
    if attr in pool.reuse:
        pool.reuse[attr] = 1 if _pool_value(value, "int *") else 0
    elif attr == _POOL_RELEASE_THRESHOLD:
        pool.release_threshold = _pool_value(value, "unsigned long long *")
    elif attr in (_POOL_RESERVED_HIGH, _POOL_USED_HIGH):
        if _pool_value(value, "unsigned long long *") != 0:
            return cudaErrorInvalidValue
        with R.mlock:
            if attr == _POOL_RESERVED_HIGH:
                pool.reserved_high = pool.reserved
            else:
                pool.used_high = pool.used
    else:
        return cudaErrorInvalidValue
    return cudaSuccess


def cudaMemPoolGetAttribute(R, memPool, attr, value):
    pool = _lookup(R.pools, memPool)
    if pool is None:
        return cudaErrorInvalidResourceHandle
    if _is_null(value):
        return cudaErrorInvalidValue
    if attr in pool.reuse:
        _put(value, pool.reuse[attr], "int *")
        return cudaSuccess
    with R.mlock:
        got = {_POOL_RELEASE_THRESHOLD: pool.release_threshold, _POOL_RESERVED_CURRENT: pool.reserved,
               _POOL_RESERVED_HIGH: pool.reserved_high, _POOL_USED_CURRENT: pool.used,
               _POOL_USED_HIGH: pool.used_high}.get(attr)
    if got is None:
        return cudaErrorInvalidValue
    _put(value, got, "unsigned long long *")
    return cudaSuccess


def cudaMemPoolTrimTo(R, memPool, minBytesToKeep):
    """CUDA Runtime API, cudaMemPoolTrimTo: release unused pool memory until the pool holds at
    most ``minBytesToKeep`` reserved bytes (memory in use is never released)."""
    pool = _lookup(R.pools, memPool)
    if pool is None:
        return cudaErrorInvalidResourceHandle
    if minBytesToKeep < 0:
        return cudaErrorInvalidValue
    with R.mlock:
        keep = max(-(-pool.used // _POOL_CHUNK) * _POOL_CHUNK, minBytesToKeep // _POOL_CHUNK * _POOL_CHUNK)
        release = max(0, pool.reserved - keep)
        pool.reserved -= release
        R.devices[pool.device].used -= release
    return cudaSuccess


# -- pool access of other devices ----------------------------------------------------------------

_ACCESS_NONE, _ACCESS_READ, _ACCESS_READ_WRITE = 0, 1, 3     # cudaMemAccessFlags
_LOCATION_DEVICE = 1                                         # cudaMemLocationTypeDevice
_GraphAllocation = _graph_mem.GraphAllocation


def _pool_memory(R: Runtime, a) -> bool:
    return a.__class__ is _GraphAllocation or a.base in R.async_allocs


def _pool_access_problem(R: Runtime, a, device: int, write) -> Optional[str]:
    """Why ``device`` may not touch pool or graph allocation ``a`` (None: it may, or ``a`` is
    other memory).  ``write`` True/False for a copy's destination/source; None for a kernel,
    checked when it runs, which must also be inside the allocation's lifetime.

    CUDA Programming Guide, Stream Ordered Memory Allocator, "Device Accessibility for Multi-GPU
    Support": "memory pool allocation accessibility does not follow cudaDeviceEnablePeerAccess
    ... Instead, the API cudaMemPoolSetAccess modifies what devices can access allocations from
    a pool.  By default, allocations are accessible from the device where the allocations are
    located."  A graph allocation has the access its pool gave when it was captured.  A copy
    runs on its stream's device (as for mapped memory: the docs are silent on copies by another
    device, so they need access too).  Kernels cannot be told reading from writing: read access
    is enough for them (more lenient than the hardware)."""
    if a is None or a.__class__ is _vmm.Region or a.kind != _memory.DEVICE:
        return None
    graph = a.__class__ is _GraphAllocation
    if write is None and graph and not a.live:
        return (f"graph allocation 0x{a.base:x} of device {a.device} outside its lifetime (its allocation "
                f"node has not run, or it was freed)")
    if a.device == device:
        return None
    if graph:
        flags = a.access.get(device, _ACCESS_NONE)
    else:
        entry = R.async_allocs.get(a.base)
        if entry is None:
            return None
        flags = entry[0].access.get(device, _ACCESS_NONE)
    if flags >= (_ACCESS_READ_WRITE if write else _ACCESS_READ):
        return None
    what = "graph allocation" if graph else "memory-pool allocation"
    return (f"{what} 0x{a.base:x} of device {a.device} without {'read-write' if write else 'read'} access "
            f"for device {device} (cudaMemPoolSetAccess on device {a.device}'s pool; pool memory does "
            f"not follow cudaDeviceEnablePeerAccess)")


def _ints(p, n: int):
    return ffi.cast("int *", _addr(p))[0:n]


def cudaMemPoolSetAccess(R, memPool, descList, count):
    """CUDA Runtime API, cudaMemPoolSetAccess: "Controls visibility of pools between devices";
    each cudaMemAccessDesc gives one device's access (cudaMemAccessFlagsProtNone / ProtRead /
    ProtReadWrite).  Refused (cudaErrorInvalidValue, nothing applied): a location that is not a
    device, a device out of range, another flag value, and any change to the owner's own access
    (the docs are silent on it: allocations are always accessible from the pool's device)."""
    pool = _lookup(R.pools, memPool)
    if pool is None:
        return cudaErrorInvalidResourceHandle
    if count < 0 or (count and _is_null(descList)):
        return cudaErrorInvalidValue
    fields = _ints(descList, 3 * count) if count else []
    changes = {}
    for i in range(count):
        kind, device, flags = fields[3 * i:3 * i + 3]
        if kind != _LOCATION_DEVICE or not (0 <= device < len(R.devices)) or \
                flags not in (_ACCESS_NONE, _ACCESS_READ, _ACCESS_READ_WRITE):
            return cudaErrorInvalidValue
        if device == pool.device and flags != _ACCESS_READ_WRITE:
            return cudaErrorInvalidValue
        changes[device] = flags
    with R.mlock:
        for device, flags in changes.items():
            if device == pool.device:
                continue
            if flags == _ACCESS_NONE:
                pool.access.pop(device, None)
            else:
                pool.access[device] = flags
    return cudaSuccess


def cudaMemPoolGetAccess(R, flags, memPool, location):
    """CUDA Runtime API, cudaMemPoolGetAccess: "the accessibility of the pool's memory from the
    specified location" (read-write for the pool's own device)."""
    pool = _lookup(R.pools, memPool)
    if pool is None:
        return cudaErrorInvalidResourceHandle
    if _is_null(flags) or _is_null(location):
        return cudaErrorInvalidValue
    kind, device = _ints(location, 2)
    if kind != _LOCATION_DEVICE or not (0 <= device < len(R.devices)):
        return cudaErrorInvalidValue
    _put(flags, _ACCESS_READ_WRITE if device == pool.device else pool.access.get(device, _ACCESS_NONE))
    return cudaSuccess


# -- graph memory nodes (model: _graph_mem.py) ------------------------------------------------------

_AUTO_FREE_ON_LAUNCH, _DEVICE_LAUNCH = 1, 4     # cudaGraphInstantiateFlags
# cudaGraphInstantiate: "Valid flags are: cudaGraphInstantiateFlagAutoFreeOnLaunch, ...DeviceLaunch,
# ...UseNodePriority"; Upload (2) is "Only supported by cudaGraphInstantiateWithParams" (driver_types.h).
_GRAPH_INSTANTIATE_FLAGS = 0xD
#: What a graph instantiated for device launch may hold (cudaGraphInstantiate: "kernel nodes, memcpy
#: nodes, memset nodes, and child graph nodes"; it "cannot be empty").
_DEVICE_LAUNCH_NODES = frozenset({"kernel", "memcpy", "memset"})
_GRAPH_MEM_ATTRS = {0: "used", 1: "used_high", 2: "reserved", 3: "reserved_high"}   # cudaGraphMemAttributeType


def _capture_malloc(R: Runtime, devPtr, size: int, s: Stream) -> int:
    """cudaMallocAsync on a capturing stream: an allocation node, its address fixed now, on the
    stream's device, with the access the device's default pool grants now.  Out of memory
    (cudaGraphAddMemAllocNode lists cudaErrorOutOfMemory) when injected, or when the size can
    never fit the device; nothing is added then."""
    if _oom and core.take_oom():
        return cudaErrorMemoryAllocation
    dev = R.devices[s.device]
    if _accounted(size) > R.cfg.memory - dev.reserved:
        return cudaErrorMemoryAllocation
    try:
        a = _memory.allocate(size, _memory.DEVICE, s.device)
    except MemoryError:
        return cudaErrorMemoryAllocation
    cap = s.capture
    ga = _GraphAllocation(a, dict(_default_pool(R, s.device).access), cap)

    def alloc_node():
        ga.live = True
    alloc_node.ga = ga
    if not _put_ptr(devPtr, ga.key):
        return cudaErrorInvalidValue
    with R.mlock:
        R.gmem.allocs[ga.base] = ga
    R.mem.add(ga)
    rc, _seq = _enqueue(R, s, alloc_node, "mem_alloc", f"cudaMallocAsync {size} bytes at 0x{ga.base:x}")
    if rc:                  # the capture was invalidated meanwhile: no node, no address
        with R.mlock:
            R.gmem.allocs.pop(ga.base, None)
        R.mem.remove(ga)
        return rc
    with R.clock:
        ga.node = cap.tails[s][0]
    return cudaSuccess


def _ordered_after(cap: Capture, s: Stream, node: int) -> bool:
    """True when ``s``'s next captured operation follows node ``node`` of ``cap``."""
    seen, stack = set(), list(cap.tails.get(s, ()))
    while stack:
        n = stack.pop()
        if n == node:
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(cap.nodes[n].deps)
    return False


def _capture_free(R: Runtime, ga: _GraphAllocation, s: Stream) -> int:
    """cudaFreeAsync of a graph allocation on a capturing stream: a free node.  The allocation
    must be one of this capture, not freed in it yet, and the free ordered after its
    allocation node (cudaGraphAddMemAllocNode: "the allocation can be accessed by nodes ordered
    after the allocation node but before the free node ... they can only be freed once in the
    owning graph").  Freeing another graph's allocation in a capture is not simulated (refused,
    cudaErrorInvalidValue, as everything else here)."""
    cap = s.capture
    with R.clock:
        if ga.capture is not cap or ga.freed_in_graph or not _ordered_after(cap, s, ga.node):
            return cudaErrorInvalidValue

    def free_node():
        ga.live = False
    free_node.ga = ga
    rc, _seq = _enqueue(R, s, free_node, "mem_free", f"cudaFreeAsync 0x{ga.base:x}")
    if not rc:
        ga.freed_in_graph = True
    return rc


def _graph_free_async(R: Runtime, ga: _GraphAllocation, s: Stream) -> int:
    """cudaFreeAsync of a graph allocation outside capture: it must be allocated (a launch made
    it and no free was issued since: cudaGraphAddMemAllocNode, "Allocations which are not freed
    in the same graph can be freed by passing the allocation to cudaMemFreeAsync or
    cudaMemFree"); the docs leave freeing one that is not allocated undefined, so it is
    refused (cudaErrorInvalidValue).  A later launch of its graph waits for this free."""
    with R.mlock:
        if not ga.outstanding:
            return cudaErrorInvalidValue
        ga.outstanding = False

    def run():
        ga.live = False
        R.gmem.release_if_unused(R, ga)
    rc, seq = _enqueue(R, s, run, "free", "cudaFreeAsync")
    if rc:
        with R.mlock:
            ga.outstanding = True
        return rc
    ga.pending = (s.q, seq) if seq else None
    return cudaSuccess


def _graph_free_now(R: Runtime, ga: _GraphAllocation) -> int:
    """cudaFree of a graph allocation: ends it "immediately upon the synchronous cudaFree() call"
    (Programming Guide, Graph Memory Nodes) after the device's queued work, as cudaFree waits."""
    with R.mlock:
        if not ga.outstanding:
            return cudaErrorInvalidValue
        ga.outstanding = False
    _wait_device(R, ga.device)
    ga.live = False
    R.gmem.release_if_unused(R, ga)
    return cudaSuccess


def _graph_allocs(nodes) -> list:
    return [n.fn.ga for n in nodes if n.kind == "mem_alloc"]


def _graph_mem_captured(R: Runtime, cap: Capture, graph) -> None:
    """cudaStreamEndCapture: the capture's allocations belong to ``graph`` now, or (None: the
    capture failed) their addresses go back."""
    allocs = _graph_allocs(cap.nodes)
    for ga in allocs:
        ga.capture = None
        if graph is not None:
            ga.refs += 1
    if graph is None:
        for ga in allocs:
            R.gmem.release_if_unused(R, ga)


def _graph_mem_instantiate(R: Runtime, g: Graph, flags: int):
    """(rc, ExecMem or None) for cudaGraphInstantiate of ``g``.  cudaGraphInstantiate: "If graph
    contains any allocation or free nodes, there can be at most one executable graph in existence
    for that graph at a time.  An attempt to instantiate a second executable graph before
    destroying the first with cudaGraphExecDestroy will result in an error" (which one the docs
    do not say: cudaErrorInvalidValue here); DeviceLaunch "cannot be used in conjunction with
    cudaGraphInstantiateFlagAutoFreeOnLaunch"; unknown flags are refused."""
    if flags & ~_GRAPH_INSTANTIATE_FLAGS or \
            flags & (_AUTO_FREE_ON_LAUNCH | _DEVICE_LAUNCH) == _AUTO_FREE_ON_LAUNCH | _DEVICE_LAUNCH:
        return cudaErrorInvalidValue, None
    if flags & _DEVICE_LAUNCH and (not g.nodes or any(n.kind not in _DEVICE_LAUNCH_NODES for n in g.nodes)):
        return cudaErrorInvalidValue, None
    if not R.gmem.allocs:
        return cudaSuccess, None
    allocs = _graph_allocs(g.nodes)
    if not allocs:
        return cudaSuccess, None
    if any(ga.exec is not None for ga in allocs):
        return cudaErrorInvalidValue, None
    if flags & _DEVICE_LAUNCH:
        return cudaErrorNotSupported, None      # device launch is not simulated
    return cudaSuccess, _graph_mem.ExecMem(allocs, bool(flags & _AUTO_FREE_ON_LAUNCH))


def _graph_mem_bind(R: Runtime, x: GraphExec, em) -> None:
    R.gmem.execs[x] = em
    for ga in em.allocs:
        ga.exec = em
        ga.refs += 1


def _graph_mem_before_launch(R: Runtime, em, s: Stream):
    """(rc, newly mapped) before cudaGraphLaunch of a graph with allocation nodes.

    cudaGraphLaunch: "If any allocations created by graphExec remain unfreed (from a previous
    launch) and graphExec was not instantiated with cudaGraphInstantiateFlagAutoFreeOnLaunch,
    the launch will fail with cudaErrorInvalidValue."  Physical memory is mapped for the launch;
    without room it fails with cudaErrorMemoryAllocation (no code is documented for that) and
    nothing changes.  The launch is ordered after frees of its allocations issued on other
    streams and after its previous launch ("Each launch is ordered behind ... any previous
    launches of graphExec"), so no lifetime of one launch overlaps the next.  Launched into a
    capture it would be a child graph, which "can only be used in a child node if the ownership
    is moved to the parent": refused."""
    if s.capture is not None:
        _invalidate(R, s.capture)
        return cudaErrorStreamCaptureUnsupported, ()
    with R.mlock:
        if not em.auto_free and any(ga.outstanding for ga in em.unfreed):
            return cudaErrorInvalidValue, ()
        mapped = R.gmem.map(R, em.allocs)
    if mapped is None:
        return cudaErrorMemoryAllocation, ()
    points = [ga.pending for ga in em.allocs if ga.pending is not None and ga.pending[0].done < ga.pending[1]]
    if em.last is not None and em.last[0] is not s.q and em.last[0].done < em.last[1]:
        points.append(em.last)
    if points:
        s.q.submit(None, points, False)
    return cudaSuccess, mapped


def _graph_mem_after_launch(R: Runtime, em, s: Stream, rc: int, mapped) -> None:
    with R.mlock:
        if rc:
            for ga in mapped:
                R.gmem.unmap(ga)
            return
        for ga in em.unfreed:
            ga.outstanding = True       # AutoFreeOnLaunch freed the previous one: allocated again
        for ga in em.allocs:
            ga.pending = None
        em.last = (s.q, s.q.enqueued)


def _graph_mem_exec_destroyed(R: Runtime, em) -> None:
    """The executable graph is gone once its queued launches ran; its allocations' addresses
    go back unless their graph or a live allocation still holds them."""
    if em.last is not None:
        em.last[0].wait(em.last[1])
    with R.mlock:
        for ga in em.allocs:
            ga.exec = None
            ga.refs -= 1
    for ga in em.allocs:
        R.gmem.release_if_unused(R, ga)


def _graph_mem_graph_destroyed(R: Runtime, g: Graph) -> None:
    if not R.gmem.allocs:
        return
    allocs = _graph_allocs(g.nodes)
    with R.mlock:
        for ga in allocs:
            ga.refs -= 1
    for ga in allocs:
        R.gmem.release_if_unused(R, ga)


def cudaDeviceGraphMemTrim(R, device):
    """CUDA Runtime API, cudaDeviceGraphMemTrim: "Free unused memory that was cached on the
    specified device for use with graphs back to the OS.  Blocks which are not in use by a graph
    that is either currently executing or scheduled to execute are freed"."""
    if not (0 <= device < len(R.devices)):
        return cudaErrorInvalidDevice
    with R.mlock:
        R.gmem.trim(R, device)
    return cudaSuccess


def cudaDeviceGetGraphMemAttribute(R, device, attr, value):
    """CUDA Runtime API, cudaDeviceGetGraphMemAttribute: UsedMemCurrent ("currently associated
    with graphs": mapped for graph allocations), UsedMemHigh, ReservedMemCurrent ("currently
    allocated for use by the CUDA graphs asynchronous allocator"), ReservedMemHigh."""
    if not (0 <= device < len(R.devices)):
        return cudaErrorInvalidDevice
    which = _GRAPH_MEM_ATTRS.get(attr)
    if which is None or _is_null(value):
        return cudaErrorInvalidValue
    with R.mlock:
        got = R.gmem.attribute(device, which)
    _put(value, got, "unsigned long long *")
    return cudaSuccess


def cudaDeviceSetGraphMemAttribute(R, device, attr, value):
    """CUDA Runtime API, cudaDeviceSetGraphMemAttribute: only the two high watermarks, which
    "can only be reset to zero" (to the current value, as the pools' high watermarks)."""
    if not (0 <= device < len(R.devices)):
        return cudaErrorInvalidDevice
    which = _GRAPH_MEM_ATTRS.get(attr)
    if which not in ("used_high", "reserved_high") or _is_null(value) or \
            _pool_value(value, "unsigned long long *") != 0:
        return cudaErrorInvalidValue
    with R.mlock:
        R.gmem.reset_high(device, which)
    return cudaSuccess


def _dim3(d) -> Tuple[int, int, int]:
    if isinstance(d, int):
        return (d, 1, 1)
    if isinstance(d, (tuple, list)):
        t = tuple(int(v) for v in d) + (1, 1, 1)
        return t[:3]
    if isinstance(d, dict):
        return (d.get("x", 1), d.get("y", 1), d.get("z", 1))
    return (d.x, d.y, d.z)


def _launch_config_ok(grid, block) -> bool:
    if min(grid) < 1 or min(block) < 1:
        return False
    if block[0] > 1024 or block[1] > 1024 or block[2] > 64 or block[0] * block[1] * block[2] > 1024:
        return False
    return grid[0] <= 2 ** 31 - 1 and grid[1] <= 65535 and grid[2] <= 65535


def cudaLaunchKernel(R, func, gridDim, blockDim, args, sharedMem, stream):
    k = _lookup(R.kernels, func)
    if k is None:
        return cudaErrorInvalidDeviceFunction
    s = _stream(R, stream)
    if s is None:
        return cudaErrorInvalidResourceHandle
    return launch(R, k, _dim3(gridDim), _dim3(blockDim), args, sharedMem, s)


def launch(R: Runtime, k: "KernelHandle", grid, block, args, sharedMem, s: Stream) -> int:
    """Launch ``k`` on stream ``s`` (cudaLaunchKernel and the driver's cuLaunchKernel);
    returns a cudaError_t code."""
    # CUDA Programming Guide, "Multi-Device System" (Stream and Event Behavior): "A kernel launch
    # will fail if it is issued to a stream that is not associated to the current device."
    if s.device != R.tls.device:
        return cudaErrorInvalidResourceHandle
    if not _launch_config_ok(grid, block):
        return cudaErrorInvalidConfiguration
    # CUDA Programming Guide, "Shared Memory" (compute capability 7.x+): more than 48 KB of
    # dynamic shared memory per block needs an explicit opt-in with cudaFuncSetAttribute(
    # cudaFuncAttributeMaxDynamicSharedMemorySize); the launch fails with cudaErrorInvalidValue
    # (CUDA_ERROR_INVALID_VALUE from cuLaunchKernel) otherwise.
    if sharedMem > _SHARED_PER_BLOCK and sharedMem > k.max_dynamic_shared.get(s.device, _SHARED_PER_BLOCK):
        return cudaErrorInvalidValue
    ref = kernels.lookup(k.name)
    if ref is None:
        # No Python reference registered (accel.sim.register_kernel): the simulator cannot run it.
        return cudaErrorInvalidDeviceFunction
    declared = k.library.params.get(k.name)
    if declared is not None and not kernels.matches(ref, declared):
        # The kernel reads its parameters as its .entry declares them (PTX ISA, "Kernel Function
        # Parameters"); a reference registered with another list would read other bytes.  The
        # driver does not check argument lists (it cannot); the simulator refuses the launch.
        return cudaErrorInvalidValue
    try:
        values = kernels.decode_args(ref, args)
    except ValueError:
        return cudaErrorInvalidValue
    fn, view, vmm_lock = ref.fn, _device_view(R, s.device), R.vmm.lock

    def run():
        # holding the mapped pages (the space's lock, shared): no cuMemUnmap pulls them from under
        # a running kernel, and other work can still be queued and run meanwhile
        with vmm_lock.shared():
            fn(grid, block, view, *values)
    return _enqueue(R, s, run, "kernel", f"{k.name} grid{grid} block{block}", kernel=k)[0]


# -- the library object ----------------------------------------------------------------------

_FUNCTIONS = {name: obj for name, obj in list(globals().items())
              if name.startswith("cuda") and callable(obj) and name not in _NO_INIT}


_RT = """\
        next(_box[0])
        R = _R
        if R is None:
            R = _start()
        if _faults and _name in _faults:
            _rc = _take(_name)
            if _rc:
                R.tls.last_error = _rc
                return _rc
        if R.init_error and _check_init:
            _rc = R.init_error
        else:
            if _needs_context:
                R.devices[R.tls.device].context = True
            _rc = _fn(R, {args})
        if _rc and _rc != 600:
            R.tls.last_error = _rc
        return _rc
"""
_RT_BODY = core.deferred_body(_RT)   # signals deferred for the call (core: "atomic for Python signal handlers")
#: Queries that change nothing (their runtime is started by then): a handler stopping one
#: midway leaves what stopping it before the call leaves, so they skip the ~1.4 us of deferral.
_READ_ONLY = frozenset(("cudaGetDevice", "cudaStreamQuery", "cudaEventQuery", "cudaPeekAtLastError"))


def _wrap(name: str, fn):
    # Every runtime entry point: count, initialize the runtime on first use,
    # injected faults, "no driver/no device", cudaGetLastError bookkeeping.
    return core.exact_wrapper(name, fn, _RT if name in _READ_ONLY else _RT_BODY, globals(), skip=1,
                              _box=core.counter_box(name),
                              _faults=core._faults, _take=core.take_fault, _name=name, _fn=fn,
                              _check_init=name != "cudaGetDeviceCount", _needs_context=name not in _NO_CONTEXT,
                              **core.deferral_cells())


def _wrap_any(name: str, fn):
    if name in _NO_INIT:
        return core.counted(name, fn)
    return _wrap(name, fn)


_libs: Dict[int, core.SimLibrary] = {}


def exported_symbols(runtime_version: int) -> frozenset:
    """The cuda* functions the real libcudart of ``runtime_version`` exports
    (accel/sim/cudart_symbols/<major>.<minor>.txt, written by tools/cudart_exports.py)."""
    from importlib import resources
    name = f"{runtime_version // 1000}.{runtime_version % 1000 // 10}.txt"
    text = resources.files(__package__).joinpath("cudart_symbols").joinpath(name).read_text()
    return frozenset(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))


def open_library() -> core.SimLibrary:
    """The simulated libcudart of the configured runtime version: the functions that real
    library exports and this module simulates (OSError like a missing library when configured absent)."""
    cfg = core.config()
    soname = "libcudart.so.12" if cfg.runtime_version < 13000 else "libcudart.so.13"
    if not cfg.cudart:
        raise core.library_not_found("cudart", soname)
    lib = _libs.get(cfg.runtime_version)
    if lib is None:
        exported = exported_symbols(cfg.runtime_version)
        functions = {k: v for k, v in {**_NO_INIT, **_FUNCTIONS}.items() if k in exported}
        # the bindings of this runtime's major (accel._ffi.cudart_module): what a caller
        # declares, so a declared function this version lacks fails as in cffi
        module = "_cudart12" if cfg.runtime_version < 13000 else "_cudart"
        try:
            declared = __import__("accel._ffi." + module, fromlist=["FUNCTIONS"]).FUNCTIONS
        except ImportError:
            declared = ()
        lib = _libs.setdefault(cfg.runtime_version, core.build_library(
            "cudart", functions, constants=core.constants_of(module), wrap=_wrap_any, declared=declared))
    return lib


def _state() -> dict:
    R = _R
    out = {"runtime_initialized": R is not None}
    if R is None:
        out.update(live_allocations={}, live_bytes={}, peak_bytes={}, host_allocations=0, host_bytes=0,
                   streams=0, events=0, graphs=0, graph_execs=0, captures=0, errors=[], modules=0,
                   jit_compiles=0, vmm_reservations=0, vmm_reserved_bytes=0, vmm_handles=0,
                   vmm_physical_bytes=0, vmm_mappings=0, vmm_mapped_bytes=0)
        return out
    allocs, nbytes = {}, {}
    host_n = 0
    for a in R.mem.all():
        if a.kind == _memory.DEVICE:
            allocs[a.device] = allocs.get(a.device, 0) + 1
            nbytes[a.device] = nbytes.get(a.device, 0) + _accounted(a.size)
        else:
            host_n += 1
    uniq = lambda table, cls: len({id(v) for v in table.values() if v.__class__ is cls})
    out.update(live_allocations=allocs, live_bytes=nbytes,
               peak_bytes={d.index: d.peak for d in R.devices},
               host_allocations=host_n, host_bytes=R.host_bytes,
               streams=uniq(R.streams, Stream), events=uniq(R.events, Event), graphs=uniq(R.graphs, Graph),
               graph_execs=uniq(R.execs, GraphExec), captures=len(R.captures), errors=list(R.errors),
               modules=uniq(R.libraries, Library), jit_compiles=R.jit_compiles,
               visible_devices=[d.physical for d in R.devices],
               primary_contexts=[d.context for d in R.devices], **R.vmm.stats())
    return out


core.on_state("cudart", _state)


def device_used_bytes(physical: int) -> int:
    """Device memory in use on simulated *physical* device ``physical`` (NVML's view: the
    context's reservation plus cudaMalloc'd bytes; 0 before the runtime starts)."""
    R = _R
    if R is None:
        return 0
    return sum(d.used + d.reserved for d in R.devices if d.physical == physical)
