"""The simulated CUDA runtime's state: error codes and constants, the objects behind handles
(devices, streams, events, captures, graphs, libraries, kernels, memory pools), the Runtime that
holds them, and its start, reset and fork.
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

from .. import _engine, _graph_mem, _memory, _vmm, core, kernels
from .._cuda_strings import UNRECOGNIZED
from ..core import ffi


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
cudaErrorPeerAccessUnsupported = 217
cudaErrorInvalidPtx = 218
cudaErrorOperatingSystem = 304
cudaErrorInvalidResourceHandle = 400
cudaErrorIllegalState = 401
cudaErrorSymbolNotFound = 500
cudaErrorNotReady = 600
cudaErrorIllegalAddress = 700
cudaErrorLaunchOutOfResources = 701     # "too many resources requested for launch"
cudaErrorMisalignedAddress = 716
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

_SM_COUNT = 132                    # an H100 SXM's (a product's figure, not the compute capability's)
_SHARED_PER_BLOCK = 48 * 1024
_L2 = 50 * 1024 * 1024

#: Shared memory per compute capability, KiB: (per SM, per block with the opt-in) --
#: cudaDevAttrMaxSharedMemoryPerMultiprocessor and cudaDevAttrMaxSharedMemoryPerBlockOptin.  CUDA
#: Programming Guide, "Compute Capabilities" (docs.nvidia.com/cuda/cuda-programming-guide/05-appendices/
#: compute-capabilities.html), technical specifications; its 8.x text: "Devices of compute capability
#: 8.0 allow a single thread block to address up to 163 KB of shared memory, while devices of compute
#: capabilities 8.6 and 8.9 allow up to 99 KB", and 9.0 up to 227 KB.  The guide's table itself could
#: not be read through the search tool; the figures are those of NVIDIA's CCCL, libcudacxx
#: include/cuda/__device/arch_traits.h (max_shared_memory_per_multiprocessor; the opt-in is that less
#: the 1 KiB reserved per block from 8.0 on; 6.x: 48 KiB), which agree with the sentences above.
#: Compute capabilities in neither (5.x, 7.2, ...) are not verified: they keep the 9.0 figures the
#: simulator always gave.
_SHARED_KIB = {
    (6, 0): (64, 48), (6, 1): (96, 48), (6, 2): (64, 48), (7, 0): (96, 96), (7, 5): (64, 64),
    (8, 0): (164, 163), (8, 6): (100, 99), (8, 7): (164, 163), (8, 8): (100, 99), (8, 9): (100, 99),
    (9, 0): (228, 227), (10, 0): (228, 227), (10, 3): (228, 227), (11, 0): (228, 227),
    (12, 0): (100, 99), (12, 1): (100, 99),
}


# (threads, blocks) resident per SM by compute capability: cudaDevAttrMaxThreadsPerMultiProcessor
# and cudaDevAttrMaxBlocksPerMultiprocessor, from NVIDIA's CCCL libcudacxx/include/cuda/__device/
# arch_traits.h (its copy of the Programming Guide's "Compute Capabilities" table; e.g. sm_86:
# "max_blocks_per_multiprocessor = 16; max_threads_per_multiprocessor = 1536").  Review r86a: every
# ACCEL_SIM_CC had 9.0's 2048 and 32.  Others (5.x, 7.2, 8.8): 9.0's, unverified.
_SM_RESIDENCY = {
    (6, 0): (2048, 32), (6, 1): (2048, 32), (6, 2): (2048, 32), (7, 0): (2048, 32), (7, 5): (1024, 16),
    (8, 0): (2048, 32), (8, 6): (1536, 16), (8, 7): (1536, 16), (8, 9): (1536, 24),
    (9, 0): (2048, 32), (10, 0): (2048, 32), (10, 3): (2048, 32), (11, 0): (1536, 24),
    (12, 0): (1536, 24), (12, 1): (1536, 24),
}


def threads_per_sm(cc) -> int:
    """cudaDevAttrMaxThreadsPerMultiProcessor of compute capability ``cc``."""
    return _SM_RESIDENCY.get(tuple(cc), _SM_RESIDENCY[9, 0])[0]


def blocks_per_sm(cc) -> int:
    """cudaDevAttrMaxBlocksPerMultiprocessor of compute capability ``cc``."""
    return _SM_RESIDENCY.get(tuple(cc), _SM_RESIDENCY[9, 0])[1]


def shared_per_sm(cc) -> int:
    """cudaDevAttrMaxSharedMemoryPerMultiprocessor of compute capability ``cc`` (bytes)."""
    return _SHARED_KIB.get(tuple(cc), _SHARED_KIB[9, 0])[0] * 1024


def shared_per_block_optin(cc) -> int:
    """cudaDevAttrMaxSharedMemoryPerBlockOptin of compute capability ``cc`` (bytes)."""
    return _SHARED_KIB.get(tuple(cc), _SHARED_KIB[9, 0])[1] * 1024


def shared_reserved_per_block(cc) -> int:
    """cudaDevAttrReservedSharedMemoryPerBlock: what each block's shared memory leaves the system."""
    return shared_per_sm(cc) - shared_per_block_optin(cc) if tuple(cc) >= (7, 0) else 0


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
        self.blocking: List[Stream] = []        # streams that synchronize with the legacy stream (a
        #                                         destroyed one until its queued work ran: r67c)
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
    __slots__ = ("handle", "key", "nodes", "launches", "device", "plan", "libraries", "last")

    def __init__(self, handle, nodes, device):
        self.handle = handle
        self.key = ffi.cast(_VOIDP, handle)
        self.nodes = nodes
        self.launches = 0
        self.last = None        # (queue, seq): the end of the latest launch (cudaGraphLaunch orders the next after it)
        self.device = device
        self.plan = _event_plan(nodes)     # None: no event nodes, one operation per launch
        # the modules whose kernels the graph launches (checked loaded at each cudaGraphLaunch)
        self.libraries = tuple({id(n.kernel.library): n.kernel.library for n in nodes if n.kernel}.values())


class Library:
    """A cudaLibrary_t (device None) or a driver CUmodule (loaded into ``device``'s context)."""
    __slots__ = ("handle", "key", "names", "kernels", "device", "params", "unloaded", "bounds")

    def __init__(self, handle, names, device=None, params=None, bounds=None):
        self.handle = handle
        self.key = ffi.cast(_VOIDP, handle)
        self.names = names
        self.device = device
        self.unloaded = False
        self.kernels: Dict[str, "KernelHandle"] = {}
        # entry -> accel argument types from the PTX .entry declaration (None: the image has
        # no PTX for it, or a parameter type accel cannot pass); see accel/_ptx.py
        self.params: Dict[str, Optional[tuple]] = params or {}
        # entry -> _cuda_images.EntryBounds (.maxntid/.reqntid and static shared memory read from
        # the PTX; an entry without one, e.g. of a cubin, has no launch bounds and no static shared)
        self.bounds: dict = bounds or {}


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
        # bases of cudaMallocAsync allocations a cudaFreeAsync freed that their stream has not
        # reached yet: work submitted after the free may not touch them (cudaFreeAsync)
        self.freeing: set = set()
        # bases of cudaMallocAsync allocations whose stream has not reached the allocation yet ->
        # the allocation point [queue, seq] (seq None until submitted); gone when the point runs
        self.making: Dict[int, list] = {}
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

    def freed_async(self, a) -> bool:
        """Whether allocation ``a`` (None: no allocation) is memory a cudaFreeAsync freed, which
        work submitted since may not touch (``freeing``)."""
        return bool(self.freeing) and a is not None and a.base in self.freeing

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
            dev = self.devices[owner.device]
            dev.queues.pop(q, None)
            if owner in dev.blocking:
                # r67c: a destroyed blocking stream held the legacy stream until its work ran
                # (common._close_stream).  A new list, not remove(): readers iterate the list
                # without the lock (streams.cudaStreamQuery, common._implicit_deps).
                dev.blocking = [b for b in dev.blocking if b is not owner]

    def _on_error(self, q: _engine.Queue, exc: BaseException) -> None:
        code = cudaErrorMisalignedAddress if isinstance(exc, kernels.MisalignedAddress) else \
            cudaErrorIllegalAddress if isinstance(exc, (_IllegalAddress, kernels.MemoryRangeError)) \
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
    the list (MIG- entries are invalid: the simulator has no MIG).

    The list's kind is its first entry's: after a UUID, an index or a UUID with a space before
    it ends the list.  NVIDIA's documentation ("CUDA Environment Variables") is silent on mixed
    lists and spaces; torch's _parse_visible_devices, written against the driver, reads them so
    (and only strtoul skips leading spaces), and that is the stricter reading (fewer devices)."""
    # (r71g) CUDA Programming Guide, "CUDA Environment Variables": CUDA_DEVICE_ORDER
    # "FASTEST_FIRST, PCI_BUS_ID, (default is FASTEST_FIRST)": FASTEST_FIRST "causes CUDA to
    # enumerate the available devices in fastest to slowest order using a simple heuristic";
    # PCI_BUS_ID "orders devices by PCI bus ID in ascending order".  The simulator's physical
    # numbering is its FASTEST_FIRST order; PCI_BUS_ID follows core.pci_bus (ACCEL_SIM_PCI_ORDER),
    # and CUDA_VISIBLE_DEVICES indices name devices in the order chosen.
    enum = core.by_pci_bus(count) if os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID" else list(range(count))
    if value is None:
        return enum
    out: List[int] = []
    uuids = None
    by_uuid = value.startswith("GPU-")
    for raw in value.split(","):
        item = raw if by_uuid else raw.strip()
        if by_uuid != item.startswith("GPU-"):
            break
        if by_uuid:
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
            idx = enum[idx]
        if idx in out:
            return []
        out.append(idx)
    return out


# -- argument helpers --------------------------------------------------------------

_addr = _memory.addr_of
_oom = core._oom      # non-empty while an OOM is injected (the list object is never replaced)
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


# -- memory ------------------------------------------------------------------------------

def _accounted(size: int) -> int:
    return (size + _memory.ALIGN - 1) & ~(_memory.ALIGN - 1)


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


# -- graph memory nodes (model: _graph_mem.py) ------------------------------------------------------

_AUTO_FREE_ON_LAUNCH, _DEVICE_LAUNCH = 1, 4     # cudaGraphInstantiateFlags
