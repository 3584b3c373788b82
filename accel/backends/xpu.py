"""Intel XPU backend over Level Zero (``libze_loader``, core API + Sysman).

How the Backend protocol maps onto Level Zero, and why:

* **Counting** never initializes the core runtime (it must be safe before
  ``fork``).  With a loader that has ``zesInit`` (API 1.5+) Sysman lists the
  cards and their tile counts and :mod:`._ze_visible` applies
  ``ZE_FLAT_DEVICE_HIERARCHY``/``ZE_AFFINITY_MASK`` as the driver would
  (``count_path`` "zesInit").  Older loaders, such as Debian's 1.8.12, have
  no way to ask Sysman without ``zeInit``, and ``zeInit`` in this process
  would make a later ``fork`` unusable.  So: when no Level Zero GPU driver
  library can be found at all, the count is 0 without loading anything
  ("driver-probe"); otherwise a short-lived child process runs
  ``zeInit``/``zeDeviceGet`` and reports the number (its driver applies the
  two variables itself) — "child-zeInit" (:mod:`._ze_count`).  The path taken and the reason for
  a zero count are in :meth:`XpuBackend.report` (``python -m accel``).
* **Init**: ``zeInit(GPU_ONLY)``, every driver's GPU devices, one context per
  driver.  Without ``zesInit`` the backend sets ``ZES_ENABLE_SYSMAN=1``
  before ``zeInit`` (unless the user set it) so core device handles double
  as Sysman handles for :meth:`mem_info`.
* **Streams** are immediate command lists, ``ZE_COMMAND_QUEUE_FLAG_IN_ORDER``,
  asynchronous mode, on the device's compute queue group; each device's
  default stream is one created at init.  Drivers older than API 1.7 have no
  IN_ORDER flag, so a barrier follows every command there.  Stream sync uses
  ``zeCommandListHostSynchronize`` where the loader has it, else a fresh
  host-visible event appended after the last command.
* **Events** must be reset before they are signalled again, and a reset can
  race with a wait appended earlier, so every ``event_record`` signals a
  *fresh* Level Zero event from a pool; the previous one is recycled only
  when every stream that signalled or waited on it has provably passed that
  point (the backend numbers each stream's commands and learns completion
  from syncs and queries).  A waiter therefore always waits for the record it
  saw, as in CUDA.  Timing events come from ``KERNEL_TIMESTAMP`` pools and
  are signalled by a barrier, which stamps them; elapsed time is the
  difference of the two global end timestamps (wrapped to
  ``kernelTimestampValidBits``) times the timer period, read with
  ``ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES_1_2`` (ticks per second) on API 1.2+
  drivers and the 1.0 structure (whole nanoseconds per tick) before.
* **Memory**: ``zeMemAllocDevice``/``zeMemAllocHost``; out-of-memory results
  raise :class:`accel.OutOfMemoryError`.  Level Zero forbids freeing memory
  the device may still use, so frees first wait for unfinished streams and
  graph launches (CUDA's ``cudaFree`` synchronizes too).
* **Copies** accept USM pointers directly.  A pageable host source is copied
  into pinned staging memory before the call returns (so the caller may reuse
  it, as with ``cudaMemcpyAsync``); a pageable destination makes the copy
  synchronous.  Neither is allowed inside a graph capture.
* **mem_info**: Sysman memory modules of the device (``zesMemoryGetState``
  free/size summed over its HBM modules, per tile when the device is a
  tile); without Sysman, the total from ``zeDeviceGetMemoryProperties`` and
  free = total minus this process's allocations (``mem_info_path`` says which).
* **Graphs** (``supports_graphs``): Level Zero has no stream capture, so
  ``capture_begin`` redirects the stream's commands into a regular command
  list that starts by waiting on a gate event; ``capture_end`` closes it.
  ``graph_launch`` signals the gate on the stream, executes the list on the
  graph's command queue, and makes the stream wait for the list's final
  event, so a replay is ordered after the stream's earlier work and before
  its later work, and launches of one graph are ordered among themselves.
  The spec forbids resubmitting a list the device still references, so a
  replay issued while the previous replay of the same graph still runs waits
  for it on the host.  Captured: copies and fills between USM pointers.
  Events recorded or waited on inside a capture (cross-stream capture) raise
  :class:`accel.CaptureError` and invalidate the capture.
* **Kernels**: none (``kernel_language = None``); the RNG uses its host path.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import warnings
import weakref
from typing import Dict, List, Optional, Tuple

from .._errors import AcceleratorError, CaptureError, OutOfMemoryError
from . import _ze_count, _ze_visible
from .base import Backend, DeviceProperties

LIBRARY = "libze_loader"

#: Every Level Zero function this backend calls without first checking that the
#: loader exports it.  Debian's loader 1.8.12 must (and does) export all of these;
#: tests check it against the real library and against the calls in this file and _ze_count.py.
REQUIRED_SYMBOLS = (
    "zeInit", "zeDriverGet", "zeDriverGetApiVersion", "zeDriverGetProperties",
    "zeDeviceGet", "zeDeviceGetProperties", "zeDeviceGetMemoryProperties",
    "zeDeviceGetComputeProperties", "zeDeviceGetModuleProperties",
    "zeDeviceGetCommandQueueGroupProperties",
    "zeContextCreate", "zeContextDestroy",
    "zeMemAllocDevice", "zeMemAllocHost", "zeMemFree", "zeMemGetAllocProperties",
    "zeCommandListCreateImmediate", "zeCommandListCreate", "zeCommandListClose", "zeCommandListDestroy",
    "zeCommandListAppendMemoryCopy", "zeCommandListAppendMemoryFill", "zeCommandListAppendSignalEvent",
    "zeCommandListAppendWaitOnEvents", "zeCommandListAppendEventReset", "zeCommandListAppendBarrier",
    "zeCommandQueueCreate", "zeCommandQueueDestroy", "zeCommandQueueExecuteCommandLists",
    "zeCommandQueueSynchronize",
    "zeEventPoolCreate", "zeEventPoolDestroy", "zeEventCreate", "zeEventDestroy",
    "zeEventHostSynchronize", "zeEventQueryStatus", "zeEventHostReset", "zeEventQueryKernelTimestamp",
    "zesDeviceGetProperties", "zesDeviceEnumMemoryModules", "zesMemoryGetProperties", "zesMemoryGetState",
)

#: Called only after checking the loader exports them (API 1.5/1.6 additions).
OPTIONAL_SYMBOLS = ("zesInit", "zesDriverGet", "zesDeviceGet", "zeCommandListHostSynchronize")

_UINT64_MAX = (1 << 64) - 1
_EVENTS_PER_POOL = 64
_HOST_ALIGN = 64
_DEVICE_ALIGN = 256          # CUDA's cudaMalloc guarantee; the allocator splits blocks at 512
_PRIORITY_RANGE = (1, -1)    # (least, greatest): low, normal (0), high — numerically lower is higher
_CAPTURE_MODES = ("global", "thread_local", "relaxed")
_API_1_2 = (1 << 16) | 2
_API_1_6 = (1 << 16) | 6
_API_1_7 = (1 << 16) | 7

_NUMPY_DTYPES = frozenset({
    "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
    "float16", "float32", "float64", "complex64", "complex128",
})

_DESCRIPTIONS = {
    "ZE_RESULT_ERROR_UNINITIALIZED": "the Level Zero loader found no driver, or no device to drive",
    "ZE_RESULT_ERROR_DEVICE_LOST": "the device hung or was reset",
    "ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY": "out of device memory",
    "ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY": "out of host memory",
    "ZE_RESULT_ERROR_UNSUPPORTED_SIZE": "size is zero or above the device's maxMemAllocSize",
}


class _Device:
    """What the backend keeps per visible device."""

    __slots__ = ("index", "driver", "ctx", "handle", "name", "uuid", "flags", "subdevice_id",
                 "eu_count", "max_alloc", "ns_per_tick", "ts_mask", "ordinal", "in_order",
                 "total_memory", "fp16", "fp64", "api_version", "default", "streams", "graphs",
                 "vendor_id", "device_id", "sysman", "sysman_tile", "used", "props_extra")

    def __init__(self, index):
        self.index = index
        self.streams = {}      # handle -> _Stream (live)
        self.graphs = set()    # graphs with a command queue
        self.sysman = None     # Sysman device handle for mem_info (None: not available)
        self.sysman_tile = None
        self.used = 0          # bytes this process allocated here (mem_info fallback)


class _Stream:
    """An immediate command list and how far its commands are known to have completed."""

    __slots__ = ("handle", "device", "list", "lock", "seq", "done", "capture", "marker", "in_order", "dead",
                 "last", "waiting")

    def __init__(self, handle, device, cmdlist, in_order):
        self.handle, self.device, self.list, self.in_order = handle, device, cmdlist, in_order
        self.lock = threading.Lock()   # Level Zero forbids appending to one list from two threads at once
        self.seq = 0                   # commands appended
        self.done = 0                  # commands known complete
        self.capture = None            # _Capture while capturing
        self.marker = None             # (slot, seq): query marker on loaders without HostSynchronize
        self.last = None               # (slot, seq): the latest event this stream signals (progress polls)
        self.dead = False
        self.waiting = 0               # host threads inside zeCommandListHostSynchronize on the list


class _Slot:
    """One Level Zero event from a pool, and the stream points that use it."""

    __slots__ = ("pool", "index", "event", "timing", "deps", "ctx", "waiters")

    def __init__(self, pool, index, event, timing, ctx):
        self.pool, self.index, self.event, self.timing, self.ctx = pool, index, event, timing, ctx
        self.deps = []   # [(stream, seq)]: it is free again once every stream passed its point
        self.waiters = 0  # host threads waiting on / querying it as a stream's marker (changed under that stream's lock)


class _Event:
    __slots__ = ("device", "timing", "blocking", "slot", "stream", "seq", "handle")

    def __init__(self, handle, device, timing, blocking):
        self.handle, self.device, self.timing, self.blocking = handle, device, timing, blocking
        self.slot: Optional[_Slot] = None
        self.stream: Optional[_Stream] = None
        self.seq = 0


class _Capture:
    __slots__ = ("list", "mode", "thread", "invalid", "ops", "gate", "done", "device")

    def __init__(self, cmdlist, mode, device, gate, done):
        self.list, self.mode, self.device, self.gate, self.done = cmdlist, mode, device, gate, done
        self.thread = threading.get_ident()
        self.invalid: Optional[str] = None
        self.ops: List[str] = []


class _Graph:
    __slots__ = ("handle", "device", "list", "gate", "done", "ops", "queue", "execs", "destroyed",
                 "launched", "last_stream", "completion", "lock", "deps", "released")

    def __init__(self, handle, cap: _Capture):
        self.handle, self.device, self.list = handle, cap.device, cap.list
        self.gate, self.done, self.ops = cap.gate, cap.done, cap.ops
        self.queue = None
        self.execs = 0
        self.destroyed = False
        self.launched = False          # a submission may still be running on the queue
        self.last_stream = None
        self.completion: Optional[_Event] = None
        self.lock = threading.Lock()
        self.deps = []                 # stream points that signal/wait/reset the gate events
        self.released = False          # list, queue and events given back (_release_graph)


class XpuBackend(Backend):
    """Level Zero as a :class:`Backend` (see the module docstring for the design)."""

    name = "xpu"
    kernel_language = None
    supports_graphs = True

    def __init__(self, simulated: bool):
        self.simulated = simulated
        self._lock = threading.RLock()
        self._lib = None
        self._lib_error = None
        self._count: Optional[int] = None
        self._count_path = ""
        self._count_reason = ""
        self._count_before_init: Optional[int] = None   # set when init's zeDeviceGet disagreed
        self._probe: Optional[List[str]] = None
        self._sysman_cards = None      # [(zes handle, tiles, uuid bytes)] from zesDeviceGet
        self._sysman_visible = None    # [(card, tile)] after the mask
        self._sysman_legacy = False   # ZES_ENABLE_SYSMAN=1 was in effect at zeInit
        self._devices: List[_Device] = []
        self._tls = threading.local()
        self._streams: Dict[int, _Stream] = {}
        self._events: Dict[int, _Event] = {}
        self._graphs: Dict[int, _Graph] = {}
        self._execs: Dict[int, _Graph] = {}
        self._ids = itertools.count(1)
        self._free_slots: Dict[Tuple[int, bool], List[_Slot]] = {}
        self._pools: List[object] = []
        self._retired: List[_Slot] = []
        self._deferred: List[Tuple[list, object]] = []   # (deps, pinned staging pointer) to free later
        self._orphans: List[Tuple[str, object]] = []      # (destroy call, handle) an error path failed to release
        self._captures: Dict[int, _Capture] = {}
        self._patterns: Dict[int, object] = {}
        self._allocs: Dict[int, Tuple[_Device, int]] = {}
        self._host_allocs: Dict[int, int] = {}
        self._host_sync = False
        self._zes_ok: Optional[bool] = None   # zesInit exists and the driver answered it (API 1.5+)
        self._zes_error = ""
        self._mem_info_path = ""

    # -- library -------------------------------------------------------------------
    def _library(self):
        if self._lib is None and self._lib_error is None:
            with self._lock:
                if self._lib is None and self._lib_error is None:
                    try:
                        self._lib = self._open()
                    except OSError as exc:
                        self._lib_error = str(exc)
        if self._lib is None:
            raise AcceleratorError(f"{LIBRARY} could not be loaded: {self._lib_error}", library=LIBRARY)
        return self._lib

    def _open(self):
        if self.simulated:
            from .._ffi import _ze
            from ..sim import ze as sim_ze
            try:
                from ..sim import open_library as sim_open
            except ImportError:
                sim_open = None
            lib = None
            if sim_open is not None:
                try:
                    lib = sim_open("ze")
                except (KeyError, ValueError):
                    lib = None
            if lib is None:
                lib = sim_ze.open_ze()
            return _ze.ffi, lib, "accel.sim (ze)"
        from .._ffi import open_library
        return open_library("ze")

    @staticmethod
    def _has(lib, symbol: str) -> bool:
        from .._ffi import has_symbol   # a declared symbol the loader lacks raises ffi.error, not AttributeError
        return has_symbol(lib, symbol)

    def _result_name(self, rc: int) -> str:
        names = getattr(self, "_names", None)
        if names is None:
            ffi = self._lib[0]
            names = self._names = {v: k for v, k in ffi.typeof("ze_result_t").elements.items()
                                   if not k.endswith("FORCE_UINT32")}
        return names.get(rc, "ZE_RESULT_UNKNOWN")

    def _error(self, call: str, rc: int, extra: str = "") -> AcceleratorError:
        name = self._result_name(rc)
        text = f"{rc:#010x}"
        if name in _DESCRIPTIONS:
            text += f", {_DESCRIPTIONS[name]}"
        if extra:
            text += f"; {extra}"
        oom = name in ("ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY", "ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY")
        cls = OutOfMemoryError if oom else AcceleratorError
        return cls.from_call(LIBRARY, call, rc, name, text)

    def _fail(self, call: str, rc: int, extra: str = ""):
        raise self._error(call, rc, extra)

    # -- discovery (never initializes the core runtime) ----------------------------
    def loads(self) -> bool:
        try:
            self._library()
            return True
        except AcceleratorError:
            return False

    def count(self) -> int:
        if self._devices:
            return len(self._devices)
        count = self._count
        if count is None:
            with self._lock:
                if self._count is None:
                    self._count = self._discover()
                count = self._count
        return count

    def _discover(self) -> int:
        try:
            ffi, lib, _ = self._library()
        except AcceleratorError as exc:
            self._count_path = "none"
            self._count_reason = str(exc)
            return 0
        if self._zes_usable():
            self._count_path = "zesInit"
            try:
                visible = self._sysman_discover()
            except AcceleratorError as exc:
                self._count_reason = str(exc)
                return 0
            if not visible:
                self._count_reason = self._empty_reason(len(self._sysman_cards))
            return len(visible)
        if self._zes_error:
            missing = (f"zesInit failed with {self._zes_error}: no driver, or one older than Level Zero "
                       f"API 1.5, which zesInit needs to count without initializing")
        else:
            missing = "the loader has no zesInit (Level Zero API 1.5+), which counts without initializing"
        if not self.simulated:
            self._probe = _ze_count.probe_gpu_drivers()
            if self._probe == []:
                self._count_path = "driver-probe"
                self._count_reason = (f"no Level Zero GPU driver is installed: none of "
                                      f"{', '.join(_ze_count.GPU_DRIVER_NAMES)} is in the library search path "
                                      f"({missing})")
                return 0
        self._count_path = "child-zeInit"
        count, reason = self._count_in_child()
        if not count:
            self._count_reason = f"{reason} (counted by zeInit in a child process: {missing})"
        return count

    def _empty_reason(self, cards: int) -> str:
        if cards == 0:
            return "Sysman reports no Intel GPU"
        mask = os.environ.get("ZE_AFFINITY_MASK")
        return (f"Sysman sees {cards} GPU card(s) but ZE_AFFINITY_MASK={mask!r} "
                f"(ZE_FLAT_DEVICE_HIERARCHY={os.environ.get('ZE_FLAT_DEVICE_HIERARCHY')!r}) selects none")

    def _zes_usable(self) -> bool:
        """Whether Sysman counts without core init: the loader exports zesInit and friends AND a
        driver answers zesInit. A driver older than API 1.5 has no zesInit; the loader then returns
        ZE_RESULT_ERROR_UNINITIALIZED (or UNSUPPORTED_FEATURE), whatever its own version. Cached."""
        ok = self._zes_ok
        if ok is None:
            ffi, lib, _ = self._lib
            ok = False
            if all(self._has(lib, s) for s in ("zesInit", "zesDriverGet", "zesDeviceGet")):
                rc = lib.zesInit(0)
                ok = rc == 0
                if not ok:
                    self._zes_error = f"{self._result_name(rc)} ({rc:#010x})"
            self._zes_ok = ok
        return ok

    def _sysman_discover(self):
        """Cards from zesDeviceGet and the visible (card, tile) list; cached. Needs _zes_usable()."""
        if self._sysman_visible is not None:
            return self._sysman_visible
        ffi, lib, _ = self._lib
        n = ffi.new("uint32_t *", 0)
        rc = lib.zesDriverGet(n, ffi.NULL)
        if rc:
            self._fail("zesDriverGet", rc)
        drivers = ffi.new("zes_driver_handle_t[]", n[0] or 1)
        if n[0]:
            rc = lib.zesDriverGet(n, drivers)
            if rc:
                self._fail("zesDriverGet", rc)
        cards = []
        for d in range(n[0]):
            m = ffi.new("uint32_t *", 0)
            rc = lib.zesDeviceGet(drivers[d], m, ffi.NULL)
            if rc:
                self._fail("zesDeviceGet", rc)
            if not m[0]:
                continue
            handles = ffi.new("zes_device_handle_t[]", m[0])
            rc = lib.zesDeviceGet(drivers[d], m, handles)
            if rc:
                self._fail("zesDeviceGet", rc)
            for i in range(m[0]):
                props = ffi.new("zes_device_properties_t *")
                props.stype = lib.ZES_STRUCTURE_TYPE_DEVICE_PROPERTIES
                props.core.stype = lib.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES
                rc = lib.zesDeviceGetProperties(handles[i], props)
                if rc:
                    self._fail("zesDeviceGetProperties", rc)
                if props.core.type != lib.ZE_DEVICE_TYPE_GPU:
                    continue
                cards.append((handles[i], props.numSubdevices, bytes(props.core.uuid.id)))
        self._sysman_cards = cards
        self._sysman_visible = _ze_visible.visible_devices(
            [c[1] for c in cards], os.environ.get("ZE_AFFINITY_MASK"), os.environ.get("ZE_FLAT_DEVICE_HIERARCHY"))
        return self._sysman_visible

    def _count_in_child(self) -> Tuple[int, str]:
        sim_config = None
        if self.simulated:
            from ..sim import ze as sim_ze
            sim_config = sim_ze.export_config()
        return _ze_count.count_in_child(sim_config)

    def report(self) -> dict:
        info = {"backend": self.name, "simulated": self.simulated}
        try:
            count = self.count()
        except Exception as exc:   # report() never raises
            count, self._count_reason = 0, f"counting failed: {exc}"
        info["count"] = count
        info["count_path"] = self._count_path
        info["initialized"] = bool(self._devices)
        if self._lib is not None:
            ffi, lib, path = self._lib
            info["library"] = path
            real = os.path.realpath(path) if os.sep in path else path
            if real != path:
                info["library_file"] = real
            info["missing_optional_symbols"] = [s for s in OPTIONAL_SYMBOLS if not self._has(lib, s)]
        else:
            info["library"] = None
            info["library_error"] = self._lib_error
        if self._probe is not None:
            info["gpu_drivers_found"] = self._probe
        info["env"] = {k: os.environ.get(k) for k in ("ZE_AFFINITY_MASK", "ZE_FLAT_DEVICE_HIERARCHY",
                                                       "ZES_ENABLE_SYSMAN", "ZE_ENABLE_ALT_DRIVERS")}
        info["graphs"] = "regular command lists replayed on a command queue"
        if self._devices:
            info["api_version"] = "%d.%d" % (self._devices[0].api_version >> 16, self._devices[0].api_version & 0xFFFF)
            info["stream_sync"] = "zeCommandListHostSynchronize" if self._host_sync else "event after the last command"
            info["devices"] = [d.name for d in self._devices]
            if self._count_before_init is not None:
                info["count_before_init"] = self._count_before_init   # disagreed with zeDeviceGet
            if self._mem_info_path:
                info["mem_info_path"] = self._mem_info_path
        if count == 0:
            info["reason"] = self._count_reason or "no device"
        return info

    # -- runtime -----------------------------------------------------------------------
    def init(self) -> None:
        with self._lock:
            if self._devices:
                return
            ffi, lib, _ = self._library()
            has_zes = self._zes_usable()
            user_sysman = os.environ.get("ZES_ENABLE_SYSMAN")
            if not has_zes and user_sysman is None:
                # Legacy Sysman: core handles serve as Sysman handles when this is set at zeInit.
                # The driver reads it only there, so it is removed again right after.
                os.environ["ZES_ENABLE_SYSMAN"] = "1"
            try:
                rc = lib.zeInit(lib.ZE_INIT_FLAG_GPU_ONLY)
            finally:
                if not has_zes and user_sysman is None:
                    os.environ.pop("ZES_ENABLE_SYSMAN", None)
            if rc:
                self._fail("zeInit", rc, "is an Intel GPU driver (intel-level-zero-gpu) installed?")
            self._sysman_legacy = not has_zes and (user_sysman is None or user_sysman == "1")
            devices = []
            try:
                for driver in self._enum(ffi, lib, "zeDriverGet", "ze_driver_handle_t", lambda n, a: lib.zeDriverGet(n, a)):
                    devices += self._init_driver(ffi, lib, driver, len(devices))
                if not devices:
                    raise AcceleratorError(f"{LIBRARY}: zeDeviceGet found no GPU device", library=LIBRARY,
                                           call="zeDeviceGet")
                # zeCommandListHostSynchronize is API 1.6: the loader's symbol is not enough, an older
                # driver answers ZE_RESULT_ERROR_UNSUPPORTED_FEATURE.
                self._host_sync = (self._has(lib, "zeCommandListHostSynchronize")
                                   and all(d.api_version >= _API_1_6 for d in devices))
                for dev in devices:
                    dev.default = self._new_stream(dev, 0)
            except BaseException:
                for dev in devices:
                    for s in list(dev.streams.values()):
                        lib.zeCommandListDestroy(s.list)
                        self._streams.pop(s.handle, None)
                raise
            self._reconcile_count(len(devices))
            self._devices = devices
            self.driver_started = True
            if has_zes:
                try:
                    self._map_sysman()
                except AcceleratorError:
                    pass

    def _reconcile_count(self, runtime_count: int) -> None:
        """From init on, the count is the initialized driver's (as the CUDA backend's).  The count
        before init (Sysman cards and tiles through :mod:`._ze_visible`, or a child's zeInit) can
        differ: a driver whose default hierarchy is not FLAT (older drivers expose whole cards),
        or ZE_FLAT_DEVICE_HIERARCHY / ZE_AFFINITY_MASK changed between counting and init.  Say
        so once, naming both numbers and the hierarchy mode, rather than let indices past the
        driver's devices fail later (caller holds ``self._lock``)."""
        before = self._count
        self._count = runtime_count
        if before is None or before == runtime_count:
            return
        self._count_before_init = before
        raw = os.environ.get("ZE_FLAT_DEVICE_HIERARCHY")
        mode = f"ZE_FLAT_DEVICE_HIERARCHY={raw!r}" if raw is not None else "ZE_FLAT_DEVICE_HIERARCHY unset"
        warnings.warn(f"accel: the count before init ({self._count_path}) found {before} XPU device(s) but the "
                      f"initialized driver (zeDeviceGet) reports {runtime_count}; using {runtime_count}. "
                      f"{mode}: the count before init applies the {_ze_visible.hierarchy(raw)} hierarchy, and a "
                      f"driver whose default differs (older drivers expose whole cards, as COMPOSITE) or a "
                      f"ZE_FLAT_DEVICE_HIERARCHY/ZE_AFFINITY_MASK changed after counting gives another number; "
                      f"set ZE_FLAT_DEVICE_HIERARCHY explicitly before starting the process",
                      RuntimeWarning, stacklevel=3)
        self._count_path = f"zeDeviceGet after init (the count before init, by {self._count_path}, said {before})"

    def _enum(self, ffi, lib, call, ctype, fn) -> list:
        n = ffi.new("uint32_t *", 0)
        rc = fn(n, ffi.NULL)
        if rc:
            self._fail(call, rc)
        if not n[0]:
            return []
        arr = ffi.new(f"{ctype}[]", n[0])
        rc = fn(n, arr)
        if rc:
            self._fail(call, rc)
        return [arr[i] for i in range(n[0])]

    def _init_driver(self, ffi, lib, driver, first_index) -> List[_Device]:
        v = ffi.new("ze_api_version_t *")
        rc = lib.zeDriverGetApiVersion(driver, v)
        if rc:
            self._fail("zeDriverGetApiVersion", rc)
        api = v[0]
        dp = ffi.new("ze_driver_properties_t *")
        dp.stype = lib.ZE_STRUCTURE_TYPE_DRIVER_PROPERTIES
        rc = lib.zeDriverGetProperties(driver, dp)
        if rc:
            self._fail("zeDriverGetProperties", rc)
        driver_version = dp.driverVersion
        handles = self._enum(ffi, lib, "zeDeviceGet", "ze_device_handle_t",
                             lambda n, a: lib.zeDeviceGet(driver, n, a))
        out = []
        ctx = None
        for h in handles:
            props = ffi.new("ze_device_properties_t *")
            # The 1.2 structure gives the timer in ticks per second (exact); the 1.0 one in whole ns.
            props.stype = (lib.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES_1_2 if api >= _API_1_2
                           else lib.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES)
            rc = lib.zeDeviceGetProperties(h, props)
            if rc:
                self._fail("zeDeviceGetProperties", rc)
            if props.type != lib.ZE_DEVICE_TYPE_GPU:
                continue
            if ctx is None:
                desc = ffi.new("ze_context_desc_t *")
                desc.stype = lib.ZE_STRUCTURE_TYPE_CONTEXT_DESC
                p = ffi.new("ze_context_handle_t *")
                rc = lib.zeContextCreate(driver, desc, p)
                if rc:
                    self._fail("zeContextCreate", rc)
                ctx = p[0]
            dev = _Device(first_index + len(out))
            dev.driver, dev.ctx, dev.handle, dev.api_version = driver, ctx, h, api
            dev.name = ffi.string(props.name).decode(errors="replace")
            dev.uuid = bytes(props.uuid.id)
            dev.flags = props.flags
            dev.subdevice_id = props.subdeviceId if props.flags & lib.ZE_DEVICE_PROPERTY_FLAG_SUBDEVICE else None
            dev.eu_count = props.numSlices * props.numSubslicesPerSlice * props.numEUsPerSubslice
            dev.max_alloc = props.maxMemAllocSize
            res = props.timerResolution
            if props.stype == lib.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES_1_2:
                dev.ns_per_tick = 1e9 / res if res else 1.0
            else:
                dev.ns_per_tick = float(res or 1)
            bits = props.kernelTimestampValidBits or 64
            dev.ts_mask = (1 << bits) - 1
            dev.vendor_id, dev.device_id = props.vendorId, props.deviceId
            dev.in_order = api >= _API_1_7
            dev.ordinal = self._compute_ordinal(ffi, lib, h)
            dev.total_memory = self._total_memory(ffi, lib, h)
            mp = ffi.new("ze_device_module_properties_t *")
            mp.stype = lib.ZE_STRUCTURE_TYPE_DEVICE_MODULE_PROPERTIES
            rc = lib.zeDeviceGetModuleProperties(h, mp)
            if rc:
                self._fail("zeDeviceGetModuleProperties", rc)
            dev.fp16 = bool(mp.flags & lib.ZE_DEVICE_MODULE_FLAG_FP16)
            dev.fp64 = bool(mp.flags & lib.ZE_DEVICE_MODULE_FLAG_FP64)
            cp = ffi.new("ze_device_compute_properties_t *")
            cp.stype = lib.ZE_STRUCTURE_TYPE_DEVICE_COMPUTE_PROPERTIES
            rc = lib.zeDeviceGetComputeProperties(h, cp)
            if rc:
                self._fail("zeDeviceGetComputeProperties", rc)
            dev.props_extra = {"vendor_id": props.vendorId, "device_id": props.deviceId,
                               "max_mem_alloc_size": props.maxMemAllocSize,
                               "max_work_group_size": cp.maxTotalGroupSize,
                               "max_shared_local_memory": cp.maxSharedLocalMemory,
                               "sub_group_sizes": [cp.subGroupSizes[i] for i in range(cp.numSubGroupSizes)],
                               "timer_ns_per_tick": dev.ns_per_tick,
                               "api_version": f"{api >> 16}.{api & 0xFFFF}",
                               "subdevice_id": dev.subdevice_id,
                               "core_clock_mhz": props.coreClockRate,
                               "driver_version": driver_version}
            out.append(dev)
        return out

    def _compute_ordinal(self, ffi, lib, h) -> int:
        n = ffi.new("uint32_t *", 0)
        rc = lib.zeDeviceGetCommandQueueGroupProperties(h, n, ffi.NULL)
        if rc:
            self._fail("zeDeviceGetCommandQueueGroupProperties", rc)
        props = ffi.new("ze_command_queue_group_properties_t[]", n[0] or 1)
        for i in range(n[0]):
            props[i].stype = lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_GROUP_PROPERTIES
        rc = lib.zeDeviceGetCommandQueueGroupProperties(h, n, props)
        if rc:
            self._fail("zeDeviceGetCommandQueueGroupProperties", rc)
        for i in range(n[0]):
            if props[i].flags & lib.ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COMPUTE:
                return i
        raise AcceleratorError(f"{LIBRARY}: the device has no compute command queue group",
                               library=LIBRARY, call="zeDeviceGetCommandQueueGroupProperties")

    def _total_memory(self, ffi, lib, h) -> int:
        n = ffi.new("uint32_t *", 0)
        rc = lib.zeDeviceGetMemoryProperties(h, n, ffi.NULL)
        if rc:
            self._fail("zeDeviceGetMemoryProperties", rc)
        props = ffi.new("ze_device_memory_properties_t[]", n[0] or 1)
        for i in range(n[0]):
            props[i].stype = lib.ZE_STRUCTURE_TYPE_DEVICE_MEMORY_PROPERTIES
        rc = lib.zeDeviceGetMemoryProperties(h, n, props)
        if rc:
            self._fail("zeDeviceGetMemoryProperties", rc)
        return sum(props[i].totalSize for i in range(n[0]))

    def _map_sysman(self) -> None:
        """Pair each core device with its Sysman card (and tile) for mem_info."""
        visible = self._sysman_discover()
        if len(visible) != len(self._devices):
            return
        for dev, (card, tile) in zip(self._devices, visible):
            handle, tiles, uuid = self._sysman_cards[card]
            if tile is None and dev.subdevice_id is None and uuid != dev.uuid:
                continue   # the orders disagree; do not guess
            if tile is not None and dev.subdevice_id not in (None, tile):
                continue
            dev.sysman, dev.sysman_tile = handle, tile

    def _device(self, index: int) -> _Device:
        devices = self._devices
        if not devices:
            raise AcceleratorError("the XPU backend is not initialized", library=LIBRARY)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(devices):
            raise ValueError(f"device index {index!r} is out of range: {len(devices)} XPU device(s) "
                             f"(valid indices 0..{len(devices) - 1})")
        return devices[index]

    def _current(self) -> _Device:
        return self._device(getattr(self._tls, "device", 0))

    def properties(self, index: int) -> DeviceProperties:
        dev = self._device(index)
        dtypes = set(_NUMPY_DTYPES)
        if not dev.fp64:
            dtypes -= {"float64", "complex128"}
        if not dev.fp16:
            dtypes -= {"float16"}
        return DeviceProperties(
            index=index, name=dev.name, total_memory=dev.total_memory, compute_capability=(0, 0),
            multi_processor_count=dev.eu_count, supported_dtypes=frozenset(dtypes),
            uuid=_uuid_text(dev.uuid), unified_memory=bool(dev.flags & self._lib[1].ZE_DEVICE_PROPERTY_FLAG_INTEGRATED),
            extra=dict(dev.props_extra))

    def set_device(self, index: int) -> None:
        self._device(index)
        self._tls.device = index

    def get_device(self) -> int:
        return getattr(self._tls, "device", 0)

    def device_synchronize(self) -> None:
        dev = self._current()
        self._not_capturing("device_synchronize", [c for c in self._captures.values() if c.device is dev])
        for s in list(dev.streams.values()):
            self._sync_stream(s)
        for g in list(dev.graphs):
            self._sync_graph(g)

    def mem_info(self) -> Tuple[int, int]:
        dev = self._current()
        got = self._sysman_mem(dev)
        if got is not None:
            self._mem_info_path = "sysman"
            return got
        self._mem_info_path = "device-properties (Sysman unavailable: free = total - this process's allocations)"
        return max(dev.total_memory - dev.used, 0), dev.total_memory

    def _sysman_mem(self, dev: _Device) -> Optional[Tuple[int, int]]:
        ffi, lib, _ = self._lib
        if dev.sysman is not None:
            handle, tile = dev.sysman, dev.sysman_tile
        elif self._sysman_legacy:
            handle, tile = dev.handle, dev.subdevice_id   # legacy: the core handle is the Sysman handle
        else:
            return None
        try:
            modules = self._enum(ffi, lib, "zesDeviceEnumMemoryModules", "zes_mem_handle_t",
                                 lambda n, a: lib.zesDeviceEnumMemoryModules(handle, n, a))
        except AcceleratorError:
            return None
        chosen = []
        for m in modules:
            props = ffi.new("zes_mem_properties_t *")
            props.stype = lib.ZES_STRUCTURE_TYPE_MEM_PROPERTIES
            if lib.zesMemoryGetProperties(m, props):
                return None
            if props.location != lib.ZES_MEM_LOC_DEVICE:
                continue
            if tile is not None and props.onSubdevice and props.subdeviceId != tile:
                continue
            chosen.append(m)
        if not chosen:
            return None
        free = total = 0
        for m in chosen:
            st = ffi.new("zes_mem_state_t *")
            st.stype = lib.ZES_STRUCTURE_TYPE_MEM_STATE
            if lib.zesMemoryGetState(m, st):
                return None
            free += st.free
            total += st.size
        return free, total

    # -- memory ----------------------------------------------------------------------------
    def mem_alloc(self, nbytes: int) -> int:
        _check_size(nbytes)
        if nbytes == 0:
            return 0
        dev = self._current()
        ffi, lib, _ = self._lib
        if nbytes > _UINT64_MAX:    # not even a size_t: no device has it
            raise OutOfMemoryError(f"{LIBRARY}: zeMemAllocDevice not called: requested {nbytes} bytes on XPU "
                                   f"device {dev.index}, more than a size_t holds (maxMemAllocSize is "
                                   f"{dev.max_alloc})", library=LIBRARY, call="zeMemAllocDevice")
        desc = ffi.new("ze_device_mem_alloc_desc_t *")
        desc.stype = lib.ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC
        p = ffi.new("void **")
        rc = lib.zeMemAllocDevice(dev.ctx, desc, nbytes, _DEVICE_ALIGN, dev.handle, p)
        if rc:
            extra = f"requested {nbytes} bytes on XPU device {dev.index}"
            if nbytes > dev.max_alloc:
                extra += f" (maxMemAllocSize is {dev.max_alloc})"
                error = self._error("zeMemAllocDevice", rc, extra)
                # A request above the device's capacity is out of memory to the caller (as on
                # CUDA and torch's XPU allocator); Level Zero reports it as UNSUPPORTED_SIZE.
                raise OutOfMemoryError(str(error), library=error.library, call=error.call,
                                       code=error.code, code_name=error.code_name)
            self._fail("zeMemAllocDevice", rc, extra)
        ptr = int(ffi.cast("uintptr_t", p[0]))
        with self._lock:
            self._allocs[ptr] = (dev, nbytes)
            dev.used += nbytes
        return ptr

    def mem_free(self, ptr: int) -> None:
        if ptr == 0:
            return
        self._unsafe("mem_free")
        with self._lock:
            entry = self._allocs.get(ptr)
        if entry is None:
            raise ValueError(f"mem_free: {ptr:#x} is not a live XPU device allocation of this process")
        dev = entry[0]
        self._quiesce()   # Level Zero: the device must not reference memory being freed
        ffi, lib, _ = self._lib
        rc = lib.zeMemFree(dev.ctx, ffi.cast("void *", ptr))
        if rc:
            self._fail("zeMemFree", rc)
        with self._lock:
            self._allocs.pop(ptr, None)
            dev.used -= entry[1]

    def host_alloc(self, nbytes: int) -> int:
        _check_size(nbytes)
        if nbytes == 0:
            return 0
        ptr = self._host_alloc(nbytes)
        with self._lock:
            self._host_allocs[ptr] = nbytes
        return ptr

    def _host_alloc(self, nbytes: int) -> int:
        ffi, lib, _ = self._lib
        if not self._devices:
            raise AcceleratorError("the XPU backend is not initialized", library=LIBRARY)
        desc = ffi.new("ze_host_mem_alloc_desc_t *")
        desc.stype = lib.ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC
        p = ffi.new("void **")
        rc = lib.zeMemAllocHost(self._devices[0].ctx, desc, nbytes, _HOST_ALIGN, p)
        if rc:
            self._fail("zeMemAllocHost", rc, f"requested {nbytes} bytes of pinned host memory")
        return int(ffi.cast("uintptr_t", p[0]))

    def host_free(self, ptr: int) -> None:
        if ptr == 0:
            return
        self._unsafe("host_free")
        with self._lock:
            if ptr not in self._host_allocs:
                raise ValueError(f"host_free: {ptr:#x} is not a live pinned allocation of this process")
        self._quiesce()
        self._host_free(ptr)
        with self._lock:
            self._host_allocs.pop(ptr, None)

    def _host_free(self, ptr: int) -> None:
        ffi, lib, _ = self._lib
        rc = lib.zeMemFree(self._devices[0].ctx, ffi.cast("void *", ptr))
        if rc:
            self._fail("zeMemFree", rc)

    def _free_staging(self, ptr: int) -> None:
        """Free a copy's internal staging memory.  A failed zeMemFree does not fail the copy
        (it ran, or its own error is on the way): the memory is freed by the next _sweep."""
        try:
            self._host_free(ptr)
        except AcceleratorError:
            with self._lock:
                self._deferred.append(([], ptr))

    def _quiesce(self) -> None:
        """Wait for every stream and graph launch with unfinished work."""
        for s in list(self._streams.values()):
            if s.seq > s.done and not s.dead:
                self._sync_stream(s)
        for g in list(self._graphs.values()) + list(self._execs.values()):
            if g.launched:
                self._sync_graph(g)

    # -- streams -----------------------------------------------------------------------------
    def _new_stream(self, dev: _Device, priority: int) -> _Stream:
        ffi, lib, _ = self._lib
        desc = ffi.new("ze_command_queue_desc_t *")
        desc.stype = lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC
        desc.ordinal = dev.ordinal
        desc.index = 0
        desc.flags = lib.ZE_COMMAND_QUEUE_FLAG_IN_ORDER if dev.in_order else 0
        desc.mode = lib.ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS
        if priority < 0:
            desc.priority = lib.ZE_COMMAND_QUEUE_PRIORITY_PRIORITY_HIGH
        elif priority > 0:
            desc.priority = lib.ZE_COMMAND_QUEUE_PRIORITY_PRIORITY_LOW
        else:
            desc.priority = lib.ZE_COMMAND_QUEUE_PRIORITY_NORMAL
        p = ffi.new("ze_command_list_handle_t *")
        rc = lib.zeCommandListCreateImmediate(dev.ctx, dev.handle, desc, p)
        if rc:
            self._fail("zeCommandListCreateImmediate", rc)
        handle = int(ffi.cast("uintptr_t", p[0]))
        s = _Stream(handle, dev, p[0], dev.in_order)
        with self._lock:
            self._enter_stream(s)
        return s

    def _enter_stream(self, s: _Stream) -> None:
        """Put ``s`` in the stream tables (caller holds ``self._lock``).  A value the tables
        already hold for a live stream is refused, never overwritten: the driver reuses a value
        only once its list is destroyed, and a destroyed stream leaves the tables first
        (:meth:`stream_destroy`), so a collision means a stale entry or a driver handing out a
        live handle, and overwriting would make that other stream unreachable."""
        held = self._streams.get(s.handle)
        if held is not None and held is not s:
            raise AcceleratorError(
                f"{LIBRARY}: zeCommandListCreateImmediate returned {s.handle:#x}, which is already a live stream "
                f"of this process (device {held.device.index}); refusing to replace it. This is a driver or "
                f"accel bug: please report it with the output of `python -m accel`",
                library=LIBRARY, call="zeCommandListCreateImmediate")
        self._streams[s.handle] = s
        s.device.streams[s.handle] = s

    def _leave_stream(self, s: _Stream) -> None:
        """Take ``s`` out of the stream tables (caller holds ``self._lock``): only ``s`` itself,
        never another stream that now has the same handle value."""
        if self._streams.get(s.handle) is s:
            del self._streams[s.handle]
        if s.device.streams.get(s.handle) is s:
            del s.device.streams[s.handle]

    def _stream(self, handle: int) -> _Stream:
        s = self._streams.get(handle)
        if s is None:
            raise ValueError(f"{handle!r} is not a live XPU stream handle")
        return s

    def stream_create(self, priority: int = 0) -> int:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {priority!r}")
        return self._new_stream(self._current(), priority).handle

    def stream_destroy(self, stream: int) -> None:
        s = self._stream(stream)
        if s is s.device.default:
            raise ValueError("the default XPU stream of a device cannot be destroyed")
        if s.capture is not None:
            self._invalidate(s.capture, "the capturing stream was destroyed")
            raise CaptureError("stream_destroy: the stream is capturing; end the capture first")
        while True:
            self._sync_stream(s)   # the device must not reference a list being destroyed
            with s.lock:           # nothing is appended to the list from here to its destroy
                if s.dead:         # another thread destroyed it first: its value may be another list's now
                    raise ValueError(f"{stream!r} is not a live XPU stream handle (destroyed by another thread)")
                busy = s.done < s.seq or s.waiting > 0
                if not busy:
                    self._destroy_list(s)
            if not busy:
                break
            # Another thread appended meanwhile (a sync's marker), or still waits on the list
            # (device_synchronize): wait for that too (the list is idle: that returns at once).
            time.sleep(0)
        if s.marker is not None:
            self._retire(s.marker[0])
            s.marker = None

    def _destroy_list(self, s: _Stream) -> None:
        """zeCommandListDestroy of an idle stream (caller holds ``s.lock``); on failure it stays live."""
        lib = self._lib[1]
        with self._lock:
            # Out of the tables BEFORE the driver may hand the value to a new list (another
            # thread's stream_create): removed afterwards, by value, it took that new stream's
            # entry with it ("not a live XPU stream handle" on a live stream).
            self._leave_stream(s)
        rc = lib.zeCommandListDestroy(s.list)
        if rc:
            with self._lock:
                self._enter_stream(s)                # still live: destroying it again retries
            self._fail("zeCommandListDestroy", rc)
        s.dead = True
        s.done = s.seq = max(s.seq, s.done)

    def default_stream(self, index: int) -> int:
        return self._device(index).default.handle

    def stream_priority_range(self) -> Tuple[int, int]:
        return _PRIORITY_RANGE

    def stream_synchronize(self, stream: int) -> None:
        s = self._stream(stream)
        self._not_capturing("stream_synchronize", [s.capture])
        self._sync_stream(s)

    def _sync_stream(self, s: _Stream) -> None:
        """Wait for every command appended to ``s`` so far.  Callers that took ``s`` from a
        snapshot of the tables (device_synchronize, frees, close) may find it destroyed by
        another thread meanwhile: a dead stream has nothing left to wait for, and the wait
        itself keeps the list (or the marker event) from being destroyed (reset) under it."""
        ffi, lib, _ = self._lib
        if self._host_sync:
            with s.lock:
                if s.dead:
                    return
                target = s.seq
                s.waiting += 1          # stream_destroy waits for this count to drop to 0
            try:
                rc = lib.zeCommandListHostSynchronize(s.list, _UINT64_MAX)
            finally:
                with s.lock:
                    s.waiting -= 1
            if rc:
                self._fail("zeCommandListHostSynchronize", rc)
        else:
            marker = self._marker(s)
            if marker is None:
                return
            slot, target = marker
            try:
                rc = lib.zeEventHostSynchronize(slot.event, _UINT64_MAX)
            finally:
                self._unmark(s, slot)
            if rc:
                self._fail("zeEventHostSynchronize", rc)
        self._progress(s, target)

    def _marker(self, s: _Stream):
        """A host-visible event signalled after the stream's last command, and that command's
        number; None for a destroyed stream.  The caller uses the event, then calls
        :meth:`_unmark`: until then the slot is not reset for reuse (a newer marker or the
        stream's destroy retires it, and a reset event would never be signalled for this wait)."""
        with s.lock:
            if s.dead:
                return None
            marker = s.marker
            if marker is not None and marker[1] == s.seq:
                marker[0].waiters += 1
                return marker
            slot = self._acquire(s.device, False)
            self._append(s, "zeCommandListAppendSignalEvent", self._lib[1].zeCommandListAppendSignalEvent,
                         s.list, slot.event)
            s.seq += 1
            slot.deps.append((s, s.seq))
            slot.waiters += 1
            s.marker = s.last = new = (slot, s.seq)
        if marker is not None:
            self._retire(marker[0])
        return new

    @staticmethod
    def _unmark(s: _Stream, slot: "_Slot") -> None:
        with s.lock:
            slot.waiters -= 1

    def stream_query(self, stream: int) -> bool:
        s = self._stream(stream)
        self._not_capturing("stream_query", [s.capture])
        if s.done >= s.seq:
            return True
        ffi, lib, _ = self._lib
        if self._host_sync:
            target = s.seq
            rc = lib.zeCommandListHostSynchronize(s.list, 0)
            call = "zeCommandListHostSynchronize"
        else:
            marker = self._marker(s)
            if marker is None:
                raise ValueError(f"{stream!r} is not a live XPU stream handle (destroyed meanwhile)")
            slot, target = marker
            try:
                rc = lib.zeEventQueryStatus(slot.event)
            finally:
                self._unmark(s, slot)
            call = "zeEventQueryStatus"
        if rc == lib.ZE_RESULT_NOT_READY:
            return False
        if rc:
            self._fail(call, rc)
        self._progress(s, target)
        return True

    def stream_wait_event(self, stream: int, event: int) -> None:
        s = self._stream(stream)
        e = self._event(event)
        slot = e.slot
        if slot is None:
            return   # never recorded: nothing to wait for (as CUDA)
        if s.capture is not None:
            self._invalidate(s.capture, "stream_wait_event on the capturing stream")
            raise CaptureError("XPU graph capture cannot wait on events (cross-stream capture is not "
                               "supported by the Level Zero backend); the capture is invalidated")
        lib = self._lib[1]
        with s.lock:
            arr = self._lib[0].new("ze_event_handle_t[1]", [slot.event])
            self._append(s, "zeCommandListAppendWaitOnEvents", lib.zeCommandListAppendWaitOnEvents, s.list, 1, arr)
            s.seq += 1
            slot.deps.append((s, s.seq))

    def _append(self, s: _Stream, call: str, fn, *args) -> None:
        """One command on ``s``'s list (caller holds ``s.lock`` and bumps ``s.seq``)."""
        rc = fn(*args)
        if rc:
            self._fail(call, rc)
        if not s.in_order:
            # Pre-1.7 drivers have no in-order lists: a barrier keeps commands in stream order.
            lst = args[0]
            rc = self._lib[1].zeCommandListAppendBarrier(lst, self._lib[0].NULL, 0, self._lib[0].NULL)
            if rc:
                self._fail("zeCommandListAppendBarrier", rc)

    def _progress(self, s: _Stream, seq: int) -> None:
        if seq > s.done:
            s.done = seq
        if self._retired or self._deferred or self._orphans:
            self._sweep()

    def _discard(self, call: str, handle) -> None:
        """Release ``handle`` with ``call`` on an error path (another error is being raised); a
        failure keeps it for the next _sweep instead of leaking it."""
        if getattr(self._lib[1], call)(handle):
            with self._lock:
                self._orphans.append((call, handle))

    def _poll(self) -> None:
        """Update every stream's completed-command count without blocking."""
        lib = self._lib[1]
        for s in list(self._streams.values()):
            if s.dead or s.done >= s.seq:
                continue
            if self._host_sync:
                target = s.seq
                if lib.zeCommandListHostSynchronize(s.list, 0) == 0:
                    s.done = max(s.done, target)
            else:
                last = s.last
                # A slot whose signal is not yet known complete cannot have been recycled.
                if last is not None and last[1] > s.done and lib.zeEventQueryStatus(last[0].event) == 0:
                    s.done = max(s.done, last[1])

    # -- event slots -----------------------------------------------------------------------
    def _acquire(self, dev: _Device, timing: bool) -> _Slot:
        key = (id(dev.ctx), timing)
        with self._lock:
            free = self._free_slots.setdefault(key, [])
            if not free and self._retired:
                # Only when needed: retired slots pile up between syncs, so first learn
                # (without waiting) how far the streams got, then recycle what they passed.
                self._poll()
                self._sweep()
            if free:
                return free.pop()
            ffi, lib, _ = self._lib
            desc = ffi.new("ze_event_pool_desc_t *")
            desc.stype = lib.ZE_STRUCTURE_TYPE_EVENT_POOL_DESC
            desc.flags = lib.ZE_EVENT_POOL_FLAG_HOST_VISIBLE | (lib.ZE_EVENT_POOL_FLAG_KERNEL_TIMESTAMP if timing else 0)
            desc.count = _EVENTS_PER_POOL
            p = ffi.new("ze_event_pool_handle_t *")
            # No device list: the pool's events work on every device of the context.
            rc = lib.zeEventPoolCreate(dev.ctx, desc, 0, ffi.NULL, p)
            if rc:
                self._fail("zeEventPoolCreate", rc)
            pool = p[0]
            made = []
            for i in range(_EVENTS_PER_POOL):
                ed = ffi.new("ze_event_desc_t *")
                ed.stype = lib.ZE_STRUCTURE_TYPE_EVENT_DESC
                ed.index = i
                ed.signal = lib.ZE_EVENT_SCOPE_FLAG_HOST   # results visible to the host once signalled
                ed.wait = lib.ZE_EVENT_SCOPE_FLAG_HOST
                pe = ffi.new("ze_event_handle_t *")
                rc = lib.zeEventCreate(pool, ed, pe)
                if rc:
                    # Nothing of the new pool stays behind (the first error is the one reported).
                    for slot in made:
                        self._discard("zeEventDestroy", slot.event)
                    self._discard("zeEventPoolDestroy", pool)
                    self._fail("zeEventCreate", rc)
                made.append(_Slot(pool, i, pe[0], timing, dev.ctx))
            self._pools.append(pool)
            made.reverse()
            slot = made.pop()
            free.extend(made)
            return slot

    def _retire(self, slot: _Slot) -> None:
        with self._lock:
            self._retired.append(slot)

    def _sweep(self) -> None:
        """Recycle event slots and free staging memory whose users have all passed them."""
        # A failed call leaves the slots and blocks not yet handled where they were (none twice).
        with self._lock:
            if self._orphans:
                lib = self._lib[1]
                self._orphans = [(call, h) for call, h in self._orphans if getattr(lib, call)(h)]
            if self._retired:
                keep, i = [], 0
                try:
                    for i, slot in enumerate(self._retired):
                        if not slot.waiters and all(s.done >= seq for s, seq in slot.deps):
                            rc = self._lib[1].zeEventHostReset(slot.event)
                            if rc:
                                self._fail("zeEventHostReset", rc)
                            slot.deps = []
                            self._free_slots.setdefault((id(slot.ctx), slot.timing), []).append(slot)
                        else:
                            keep.append(slot)
                    i = len(self._retired)
                finally:
                    self._retired = keep + self._retired[i:]
            if self._deferred:
                keep, i = [], 0
                try:
                    for i, (deps, ptr) in enumerate(self._deferred):
                        if all(s.done >= seq for s, seq in deps):
                            self._host_free(ptr)
                        else:
                            keep.append((deps, ptr))
                    i = len(self._deferred)
                finally:
                    self._deferred = keep + self._deferred[i:]

    # -- events --------------------------------------------------------------------------------
    def _event(self, handle: int) -> _Event:
        e = self._events.get(handle)
        if e is None:
            raise ValueError(f"{handle!r} is not a live XPU event handle")
        return e

    def event_create(self, enable_timing: bool = False, blocking: bool = False) -> int:
        dev = self._current()
        handle = next(self._ids)
        with self._lock:
            self._events[handle] = _Event(handle, dev, bool(enable_timing), bool(blocking))
        return handle

    def event_destroy(self, event: int) -> None:
        with self._lock:
            e = self._events.pop(event, None)
        if e is None:
            raise ValueError(f"{event!r} is not a live XPU event handle")
        if e.slot is not None:
            self._retire(e.slot)
            e.slot = None

    def event_record(self, event: int, stream: int) -> None:
        e = self._event(event)
        s = self._stream(stream)
        if s.capture is not None:
            self._invalidate(s.capture, "event_record on the capturing stream")
            raise CaptureError("XPU graph capture cannot record events (cross-stream capture is not "
                               "supported by the Level Zero backend); the capture is invalidated")
        self._record(e, s)

    def event_query(self, event: int) -> bool:
        e = self._event(event)
        slot = e.slot
        if slot is None:
            return True
        if e.stream.done >= e.seq:
            return True
        lib = self._lib[1]
        rc = lib.zeEventQueryStatus(slot.event)
        if rc == lib.ZE_RESULT_NOT_READY:
            return False
        if rc:
            self._fail("zeEventQueryStatus", rc)
        self._progress(e.stream, e.seq)
        return True

    def event_synchronize(self, event: int) -> None:
        e = self._event(event)
        slot = e.slot
        if slot is None:
            return
        if e.stream.done >= e.seq:
            return
        rc = self._lib[1].zeEventHostSynchronize(slot.event, _UINT64_MAX)
        if rc:
            self._fail("zeEventHostSynchronize", rc)
        self._progress(e.stream, e.seq)

    def event_elapsed_ms(self, start: int, end: int) -> float:
        a, b = self._event(start), self._event(end)
        if not (a.timing and b.timing):
            raise AcceleratorError("elapsed time needs both events created with enable_timing=True",
                                   library=LIBRARY)
        if a.slot is None or b.slot is None:
            raise AcceleratorError("elapsed time needs both events recorded first", library=LIBRARY)
        ffi, lib, _ = self._lib
        ticks = []
        for e in (a, b):
            if not self.event_query(e.handle):
                raise AcceleratorError.from_call(LIBRARY, "zeEventQueryKernelTimestamp", lib.ZE_RESULT_NOT_READY,
                                                 "ZE_RESULT_NOT_READY", "the event's work has not completed yet")
            ts = ffi.new("ze_kernel_timestamp_result_t *")
            rc = lib.zeEventQueryKernelTimestamp(e.slot.event, ts)
            if rc:
                self._fail("zeEventQueryKernelTimestamp", rc)
            ticks.append(getattr(ts, "global").kernelEnd)
        dev = a.device
        mask = dev.ts_mask
        delta = (ticks[1] - ticks[0]) & mask   # the counter wraps at kernelTimestampValidBits
        if delta > mask >> 1:
            delta -= mask + 1                  # end before start: negative, as CUDA reports it
        return delta * dev.ns_per_tick / 1e6

    # -- copies -------------------------------------------------------------------------------------
    def _usm(self, dev: _Device, ptr: int) -> bool:
        ffi, lib, _ = self._lib
        props = ffi.new("ze_memory_allocation_properties_t *")
        props.stype = lib.ZE_STRUCTURE_TYPE_MEMORY_ALLOCATION_PROPERTIES
        rc = lib.zeMemGetAllocProperties(dev.ctx, ffi.cast("void *", ptr), props, ffi.NULL)
        if rc:
            self._fail("zeMemGetAllocProperties", rc)
        return props.type != lib.ZE_MEMORY_TYPE_UNKNOWN

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        _check_ptr(dst, "dst")
        _check_ptr(src, "src")
        _check_size(nbytes)
        s = self._stream(stream)
        if nbytes == 0:
            return
        ffi, lib, _ = self._lib
        copy = lib.zeCommandListAppendMemoryCopy
        src_usm, dst_usm = self._usm(s.device, src), self._usm(s.device, dst)
        if src_usm and dst_usm:
            self._enqueue(s, f"copy {nbytes} B", "zeCommandListAppendMemoryCopy", copy,
                          ffi.cast("void *", dst), ffi.cast("void *", src), nbytes, ffi.NULL, 0, ffi.NULL)
            return
        if s.capture is not None:
            self._invalidate(s.capture, "memcpy with pageable host memory")
            raise CaptureError("a copy to or from pageable host memory cannot be captured on XPU (use pinned "
                               "memory from host_alloc); the capture is invalidated")
        if dst_usm:
            # Pageable source: copied now into pinned staging, so the caller may reuse it at
            # once (as cudaMemcpyAsync); the staging memory is freed once the copy has run.
            staging = self._host_alloc(nbytes)
            try:
                ffi.memmove(ffi.cast("void *", staging), ffi.cast("void *", src), nbytes)
                seq = self._enqueue(s, f"copy {nbytes} B", "zeCommandListAppendMemoryCopy", copy,
                                    ffi.cast("void *", dst), ffi.cast("void *", staging), nbytes,
                                    ffi.NULL, 0, ffi.NULL)
            except BaseException:
                self._free_staging(staging)
                raise
            with self._lock:
                self._deferred.append(([(s, seq)], staging))
            return
        if not src_usm:
            # Neither side is a live USM allocation: a freed device pointer is indistinguishable
            # from host memory, and a host memmove through it would crash the process.
            raise ValueError(f"xpu: memcpy_async({dst:#x}, {src:#x}, {nbytes}): neither pointer is inside a live "
                             f"USM allocation (freed or foreign memory?); copy to or from memory returned by "
                             f"mem_alloc/host_alloc that has not been freed")
        # Pageable destination: synchronous, as CUDA makes it.
        staging = self._host_alloc(nbytes)
        seq = None
        try:
            seq = self._enqueue(s, f"copy {nbytes} B", "zeCommandListAppendMemoryCopy", copy,
                                ffi.cast("void *", staging), ffi.cast("void *", src), nbytes, ffi.NULL, 0,
                                ffi.NULL)
            self._sync_stream(s)
            ffi.memmove(ffi.cast("void *", dst), ffi.cast("void *", staging), nbytes)
        except BaseException:
            if seq is None:
                self._free_staging(staging)
            else:               # the wait failed: the queued copy may still write the staging memory
                with self._lock:
                    self._deferred.append(([(s, seq)], staging))
            raise
        self._free_staging(staging)

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        _check_ptr(ptr, "ptr")
        _check_size(nbytes)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
            raise ValueError(f"memset value must be a byte 0..255, got {value!r}")
        s = self._stream(stream)
        if nbytes == 0:
            return
        ffi, lib, _ = self._lib
        pattern = self._patterns.get(value)
        if pattern is None:
            # Kept alive for the process: a captured (regular) list may read it on every replay.
            pattern = self._patterns.setdefault(value, ffi.new("uint8_t *", value))
        self._enqueue(s, f"fill {nbytes} B with {value:#04x}", "zeCommandListAppendMemoryFill",
                      lib.zeCommandListAppendMemoryFill, ffi.cast("void *", ptr), pattern, 1, nbytes,
                      ffi.NULL, 0, ffi.NULL)

    def _enqueue(self, s: _Stream, what: str, call: str, fn, *args) -> Optional[int]:
        """Append one command to the stream, or to its capture; returns its number on the stream."""
        with s.lock:
            cap = s.capture
            if cap is not None:
                self._append(s, call, fn, cap.list, *args)
                cap.ops.append(what)
                return None
            self._append(s, call, fn, s.list, *args)
            s.seq += 1
            return s.seq

    # -- graphs -------------------------------------------------------------------------------------
    def _not_capturing(self, what: str, captures) -> None:
        """Waiting on work that is being captured is illegal: invalidate the capture and raise."""
        captures = [c for c in captures if c is not None]
        if captures:
            for cap in captures:
                self._invalidate(cap, what)
            raise CaptureError(f"{what} would wait on a stream that is being captured; "
                               f"the capture is invalidated")

    def _unsafe(self, what: str) -> None:
        """CUDA's rules for "potentially unsafe" calls during capture (cudaFree, cudaFreeHost:
        here the frees, which wait for the device): refused in the capturing thread unless its
        capture is relaxed, and in other threads while a global-mode capture runs."""
        if not self._captures:
            return
        me = threading.get_ident()
        hit = [cap for cap in list(self._captures.values())
               if (cap.mode != "relaxed" if cap.thread == me else cap.mode == "global")]
        if hit:
            for cap in hit:
                self._invalidate(cap, what)
            raise CaptureError(f"{what} is not permitted while a stream is being captured "
                               f"({hit[0].mode} capture mode); the capture is invalidated")

    @staticmethod
    def _invalidate(cap: _Capture, why: str) -> None:
        if cap.invalid is None:
            cap.invalid = why

    def capture_begin(self, stream: int, mode: str) -> None:
        if mode not in _CAPTURE_MODES:
            raise ValueError(f"capture mode must be one of {', '.join(_CAPTURE_MODES)}, got {mode!r}")
        s = self._stream(stream)
        if s.capture is not None:
            raise CaptureError("capture_begin: the stream is already capturing")
        dev = s.device
        ffi, lib, _ = self._lib
        desc = ffi.new("ze_command_list_desc_t *")
        desc.stype = lib.ZE_STRUCTURE_TYPE_COMMAND_LIST_DESC
        desc.commandQueueGroupOrdinal = dev.ordinal
        desc.flags = lib.ZE_COMMAND_LIST_FLAG_IN_ORDER if dev.in_order else 0
        p = ffi.new("ze_command_list_handle_t *")
        rc = lib.zeCommandListCreate(dev.ctx, dev.handle, desc, p)
        if rc:
            self._fail("zeCommandListCreate", rc)
        gate, done = self._acquire(dev, False), self._acquire(dev, False)
        cap = _Capture(p[0], mode, dev, gate, done)
        try:
            # The list first waits for the launching stream's earlier work, then re-arms the gate.
            arr = ffi.new("ze_event_handle_t[1]", [gate.event])
            self._append(s, "zeCommandListAppendWaitOnEvents", lib.zeCommandListAppendWaitOnEvents, cap.list, 1, arr)
            self._append(s, "zeCommandListAppendEventReset", lib.zeCommandListAppendEventReset, cap.list, gate.event)
        except BaseException:
            self._discard("zeCommandListDestroy", cap.list)
            self._retire(gate)
            self._retire(done)
            raise
        with s.lock:
            s.capture = cap
        with self._lock:
            self._captures[stream] = cap

    def capture_end(self, stream: int) -> int:
        s = self._stream(stream)
        with s.lock:
            cap = s.capture
            s.capture = None
        if cap is None:
            raise CaptureError("capture_end: the stream is not capturing")
        with self._lock:
            self._captures.pop(stream, None)
        ffi, lib, _ = self._lib
        try:
            if cap.invalid is not None:
                raise CaptureError(f"the capture was invalidated by an illegal operation during capture: "
                                   f"{cap.invalid}", library=LIBRARY)
            self._append(s, "zeCommandListAppendSignalEvent", lib.zeCommandListAppendSignalEvent, cap.list,
                         cap.done.event)
            rc = lib.zeCommandListClose(cap.list)
            if rc:
                self._fail("zeCommandListClose", rc)
        except BaseException:
            self._discard("zeCommandListDestroy", cap.list)
            self._retire(cap.gate)
            self._retire(cap.done)
            raise
        handle = next(self._ids)
        with self._lock:
            self._graphs[handle] = _Graph(handle, cap)
        return handle

    def stream_is_capturing(self, stream: int) -> bool:
        return self._stream(stream).capture is not None

    def capture_id(self, stream: int) -> Optional[int]:
        # A capture records only its own stream's list: other streams never join it.
        cap = self._stream(stream).capture
        return None if cap is None else id(cap)

    def captures_underway(self) -> int:
        return len(self._captures)

    def graph_instantiate(self, graph: int) -> int:
        g = self._graphs.get(graph)
        if g is None:
            raise ValueError(f"{graph!r} is not a live XPU graph handle")
        with g.lock:
            if g.queue is None:
                dev = g.device
                ffi, lib, _ = self._lib
                desc = ffi.new("ze_command_queue_desc_t *")
                desc.stype = lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC
                desc.ordinal = dev.ordinal
                desc.mode = lib.ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS
                desc.priority = lib.ZE_COMMAND_QUEUE_PRIORITY_NORMAL
                p = ffi.new("ze_command_queue_handle_t *")
                rc = lib.zeCommandQueueCreate(dev.ctx, dev.handle, desc, p)
                if rc:
                    self._fail("zeCommandQueueCreate", rc)
                g.queue = p[0]
                g.completion = _Event(0, dev, False, False)
                with self._lock:
                    dev.graphs.add(g)
            g.execs += 1
        handle = next(self._ids)
        with self._lock:
            self._execs[handle] = g
        return handle

    def graph_launch(self, graph_exec: int, stream: int) -> None:
        g = self._execs.get(graph_exec)
        if g is None:
            raise ValueError(f"{graph_exec!r} is not a live XPU graph exec handle")
        s = self._stream(stream)
        if s.device is not g.device:
            raise ValueError(f"the graph was captured on XPU device {g.device.index} but the stream is on "
                             f"device {s.device.index}")
        if s.capture is not None:
            self._invalidate(s.capture, "graph_launch on the capturing stream")
            raise CaptureError("launching a graph inside an XPU capture is not supported; the capture is invalidated")
        ffi, lib, _ = self._lib
        with g.lock:
            if g.launched:
                # The spec forbids resubmitting a list the device still references.
                self._sync_graph(g)
            prev = g.completion
            with s.lock:
                if g.last_stream is not None and g.last_stream is not s and prev.slot is not None:
                    arr = ffi.new("ze_event_handle_t[1]", [prev.slot.event])
                    self._append(s, "zeCommandListAppendWaitOnEvents", lib.zeCommandListAppendWaitOnEvents,
                                 s.list, 1, arr)
                    s.seq += 1
                    prev.slot.deps.append((s, s.seq))
                self._append(s, "zeCommandListAppendSignalEvent", lib.zeCommandListAppendSignalEvent,
                             s.list, g.gate.event)
                s.seq += 1
                g.deps.append((s, s.seq))
                lists = ffi.new("ze_command_list_handle_t[1]", [g.list])
                rc = lib.zeCommandQueueExecuteCommandLists(g.queue, 1, lists, ffi.NULL)
                if rc:
                    self._fail("zeCommandQueueExecuteCommandLists", rc)
                g.launched = True
                arr = ffi.new("ze_event_handle_t[1]", [g.done.event])
                self._append(s, "zeCommandListAppendWaitOnEvents", lib.zeCommandListAppendWaitOnEvents, s.list, 1, arr)
                self._append(s, "zeCommandListAppendEventReset", lib.zeCommandListAppendEventReset, s.list,
                             g.done.event)
                s.seq += 2
                g.deps.append((s, s.seq))
                if len(g.deps) > 64:
                    g.deps = [max((d for d in g.deps if d[0] is st), key=lambda d: d[1])
                              for st in {d[0] for d in g.deps}]
            g.last_stream = s
            self._record(g.completion, s)

    def _record(self, e: _Event, s: _Stream) -> None:
        """Signal a fresh event slot at the end of ``s`` for ``e``; the old slot is recycled later."""
        slot = self._acquire(s.device, e.timing)
        ffi, lib, _ = self._lib
        with s.lock:
            try:
                if e.timing:
                    # A barrier that signals writes the kernel timestamps (as SYCL's profiled
                    # barrier); on an in-order list it completes after all earlier commands.
                    self._append(s, "zeCommandListAppendBarrier", lib.zeCommandListAppendBarrier,
                                 s.list, slot.event, 0, ffi.NULL)
                else:
                    self._append(s, "zeCommandListAppendSignalEvent", lib.zeCommandListAppendSignalEvent,
                                 s.list, slot.event)
            except BaseException:
                self._retire(slot)
                raise
            s.seq += 1
            slot.deps.append((s, s.seq))
            s.last = (slot, s.seq)
            old, e.slot, e.stream, e.seq = e.slot, slot, s, s.seq
        if old is not None:
            self._retire(old)

    def _sync_graph(self, g: _Graph) -> None:
        if not g.launched or g.queue is None:
            return
        rc = self._lib[1].zeCommandQueueSynchronize(g.queue, _UINT64_MAX)
        if rc:
            self._fail("zeCommandQueueSynchronize", rc)
        g.launched = False

    def graph_destroy(self, graph: int) -> None:
        with self._lock:
            g = self._graphs.pop(graph, None)
        if g is None:
            raise ValueError(f"{graph!r} is not a live XPU graph handle")
        g.destroyed = True
        try:
            self._release_graph(g)
        except BaseException:
            with self._lock:            # still live: destroying it again retries the release
                self._graphs[graph] = g
            g.destroyed = False
            raise

    def graph_exec_destroy(self, graph_exec: int) -> None:
        with self._lock:
            g = self._execs.pop(graph_exec, None)
        if g is None:
            raise ValueError(f"{graph_exec!r} is not a live XPU graph exec handle")
        with g.lock:
            g.execs -= 1
        try:
            self._release_graph(g)
        except BaseException:
            with g.lock:                # still live: destroying it again retries the release
                g.execs += 1
            with self._lock:
                self._execs[graph_exec] = g
            raise

    def _release_graph(self, g: _Graph) -> None:
        """Free the list, queue and gate events once neither the graph nor an exec needs them.
        Each step is done once; after a failed call, the next try goes on from there."""
        with g.lock:
            if not g.destroyed or g.execs > 0 or g.released:
                return
            self._sync_graph(g)
            ffi, lib, _ = self._lib
            if g.list is not None:
                rc = lib.zeCommandListDestroy(g.list)
                if rc:
                    self._fail("zeCommandListDestroy", rc)
                g.list = None
            if g.queue is not None:
                rc = lib.zeCommandQueueDestroy(g.queue)
                if rc:
                    self._fail("zeCommandQueueDestroy", rc)
                g.queue = None
                with self._lock:
                    g.device.graphs.discard(g)
            for slot in (g.gate, g.done):
                slot.deps.extend(g.deps)
                self._retire(slot)
            if g.completion is not None and g.completion.slot is not None:
                self._retire(g.completion.slot)
                g.completion.slot = None
            g.released = True

    def graph_debug_dot(self, graph: int, path: str) -> None:
        g = self._graphs.get(graph)
        if g is None:
            raise ValueError(f"{graph!r} is not a live XPU graph handle")
        lines = ["digraph xpu_graph {", '  rankdir="TB";',
                 f'  label="XPU graph {graph}: Level Zero regular command list on device {g.device.index}";',
                 '  n0 [label="wait gate event (launching stream\'s earlier work)", shape=box];']
        for i, op in enumerate(g.ops, 1):
            lines.append(f'  n{i} [label="{op}"];')
            lines.append(f"  n{i - 1} -> n{i};")
        last = len(g.ops) + 1
        lines.append(f'  n{last} [label="signal done event (stream waits for it)", shape=box];')
        lines.append(f"  n{last - 1} -> n{last};")
        lines.append("}")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")


    # -- teardown -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for all work and destroy every Level Zero object this backend made.

        Not needed at process exit; tests use it to check that nothing leaks.
        The backend is uninitialized afterwards.
        """
        with self._lock:
            if not self._devices:
                return
            ffi, lib, _ = self._lib
            self._quiesce()
            for g in list(self._graphs.values()) + list(self._execs.values()):
                g.destroyed, g.execs = True, 0
                self._release_graph(g)
            self._graphs.clear()
            self._execs.clear()
            for s in list(self._streams.values()):
                self._sync_stream(s)
            self._sweep()
            for ptr, (dev, _n) in list(self._allocs.items()):
                self._check_rc("zeMemFree", lib.zeMemFree(dev.ctx, ffi.cast("void *", ptr)))
            for ptr in list(self._host_allocs) + [p for _, p in self._deferred]:
                self._host_free(ptr)
            for call, handle in self._orphans:
                self._check_rc(call, getattr(lib, call)(handle))
            for s in list(self._streams.values()):
                self._check_rc("zeCommandListDestroy", lib.zeCommandListDestroy(s.list))
                s.dead = True
            slots = [sl for free in self._free_slots.values() for sl in free] + self._retired
            slots += [e.slot for e in self._events.values() if e.slot is not None]
            slots += [s.marker[0] for s in self._streams.values() if s.marker is not None]
            for slot in slots:
                self._check_rc("zeEventDestroy", lib.zeEventDestroy(slot.event))
            for pool in self._pools:
                self._check_rc("zeEventPoolDestroy", lib.zeEventPoolDestroy(pool))
            for ctx in {id(d.ctx): d.ctx for d in self._devices}.values():
                self._check_rc("zeContextDestroy", lib.zeContextDestroy(ctx))
            lib_state = self._lib
            self.__init__(self.simulated)
            self._lib = lib_state

    def _check_rc(self, call: str, rc: int) -> None:
        if rc:
            self._fail(call, rc)


# -- helpers ------------------------------------------------------------------------------------

def _uuid_text(raw: bytes) -> str:
    h = raw.hex()
    return f"{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _check_size(nbytes) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"size must be an int number of bytes, got {nbytes!r}")
    if nbytes < 0:
        raise ValueError(f"size must not be negative, got {nbytes}")


def _check_ptr(ptr, what: str) -> None:
    if isinstance(ptr, bool) or not isinstance(ptr, int):
        raise TypeError(f"{what} must be an int address, got {ptr!r}")
    if ptr <= 0:
        raise ValueError(f"{what} must be a non-null address, got {ptr!r}")


_backends: "weakref.WeakSet[XpuBackend]" = weakref.WeakSet()


def _forget_sysman_in_child() -> None:
    # zes_api.h, zesInit: "Each forked process must call this function": the parent's Sysman
    # handles mean nothing in a child, which counts (keeps the count) and maps Sysman afresh.
    # Attributes only: no lock, no library call in a fork handler.
    for be in list(_backends):
        be._zes_ok = None
        be._zes_error = ""
        be._sysman_cards = None
        be._sysman_visible = None


os.register_at_fork(after_in_child=_forget_sysman_in_child)


def create() -> XpuBackend:
    """The XPU backend; simulated when ``ACCEL_SIM=xpu``.  Opens nothing."""
    be = XpuBackend(simulated=os.environ.get("ACCEL_SIM", "").strip().lower() == "xpu")
    _backends.add(be)
    return be
