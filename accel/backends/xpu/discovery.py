"""Discovery and counting: which Level Zero devices this process sees, without and with init.

* **Counting** never initializes the core runtime (it must be safe before
  ``fork``).  With a loader that has ``zesInit`` (API 1.5+) Sysman lists the
  cards and their tile counts and :mod:`accel.backends._ze_visible` applies
  ``ZE_FLAT_DEVICE_HIERARCHY``/``ZE_AFFINITY_MASK`` as the driver would
  (``count_path`` "zesInit").  Older loaders, such as Debian's 1.8.12, have
  no way to ask Sysman without ``zeInit``, and ``zeInit`` in this process
  would make a later ``fork`` unusable.  So: when no Level Zero GPU driver
  library can be found at all, the count is 0 without loading anything
  ("driver-probe"); otherwise a short-lived child process runs
  ``zeInit``/``zeDeviceGet`` and reports the number (its driver applies the
  two variables itself) — "child-zeInit" (:mod:`accel.backends._ze_count`).  The path taken and the reason for
  a zero count are in :meth:`XpuBackend.report` (``python -m accel``).
* **Init**: ``zeInit(GPU_ONLY)``, every driver's GPU devices, one context per
  driver.  Without ``zesInit`` the backend sets ``ZES_ENABLE_SYSMAN=1``
  before ``zeInit`` (unless the user set it) so core device handles double
  as Sysman handles for :meth:`mem_info`.
* **Until init** the count follows ``ZE_AFFINITY_MASK`` and ``ZE_FLAT_DEVICE_HIERARCHY`` as they
  are now, as torch's ``torch.xpu.device_count()`` (which caches only once initialized) and this
  package's CUDA backend do: only what does not depend on them is kept (the Sysman card list),
  and the count is cached per pair of values, so a repeated count with unchanged variables costs
  two environment reads.  The driver reads the two variables once, at the first successful
  ``zeInit`` (compute-runtime builds its device list there, as ``accel.sim.ze``'s ``zeInit``
  does; a later ``zeInit`` is a no-op), so from then on the values it read are the ones that
  count, whatever the environment says later.
* **After init** the initialized driver's count is the count; a different count before init
  (another default hierarchy, variables changed meanwhile) is reported once as a warning.
"""

from __future__ import annotations

import os
import warnings
from typing import List, Optional, Tuple

from .. import _ze_count, _ze_visible
from ..._errors import AcceleratorError
from ..base import DeviceProperties
from ._library import LIBRARY, OPTIONAL_SYMBOLS


_API_1_2 = (1 << 16) | 2
_API_1_5 = (1 << 16) | 5
_API_1_6 = (1 << 16) | 6
_API_1_7 = (1 << 16) | 7
_NUMPY_DTYPES = frozenset({
    "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
    "float16", "float32", "float64", "complex64", "complex128",
})


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


def _card_uuids(uuid: bytes, tile: int) -> set:
    """The uuids tile ``tile``'s card may have, given the tile's: its tile part cleared.
    compute-runtime (Device::generateUuidFromPciBusInfo, struct DeviceUUID) ends the uuid with
    subDeviceID, the tile + 1, 0 for the card; without PCI information (Device::generateUuid) a
    tile has its card's uuid; accel.sim.ze puts a sub-device flag and the tile in bytes 6 and 7."""
    out = {uuid}
    if uuid[15] == tile + 1:
        out.add(uuid[:15] + b"\0")
    if uuid[6:8] == bytes([1, tile & 0xFF]):
        out.add(uuid[:6] + b"\0\0" + uuid[8:])
    return out


class DiscoveryMixin:
    """Counting (fork-safe, no core init), init, device properties and the current device.

    Owns ``_count*``, ``_sysman_*``, ``_zes_*``, ``_probe``, ``_init_env`` and ``_devices`` (one
    :class:`_Device` each)."""

    # Defaults here, not in XpuBackend.__init__: close() re-runs __init__, and the driver keeps
    # what it read at zeInit for the life of the process (close() does not undo zeInit).
    _count_memo = None        # (visibility key, count) the last count was made for
    _sysman_memo = None       # (visibility key, _sysman_visible) the list was computed for
    _init_env = None          # the visibility key the driver read at the first successful zeInit

    def _visibility_env(self) -> Tuple:
        """(ZE_AFFINITY_MASK, ZE_FLAT_DEVICE_HIERARCHY) that decide which devices are visible: as
        the driver read them at zeInit once it ran in this process, else as they are now."""
        frozen = self._init_env
        if frozen is not None:
            return frozen
        env = os.environ
        return env.get("ZE_AFFINITY_MASK"), env.get("ZE_FLAT_DEVICE_HIERARCHY")

    def loads(self) -> bool:
        try:
            self._library()
            return True
        except AcceleratorError:
            return False

    def count(self) -> int:
        # Before zeInit the count follows the variables as they are now (cached per their
        # values); afterwards the driver's view is fixed (see the module docstring).
        if self._devices:
            return len(self._devices)
        key = self._visibility_env()
        memo = self._count_memo     # one attribute: the key and its count are read together
        if memo is not None and memo[0] == key and self._count is not None:
            return memo[1]
        with self._lock:
            if self._devices:
                return len(self._devices)
            key = self._visibility_env()
            memo = self._count_memo
            if memo is None or memo[0] != key or self._count is None:
                count = self._discover(key)
                self._count, self._count_memo = count, (key, count)
            return self._count

    def _discover(self, key: Tuple) -> int:
        """The count for the visibility variables ``key`` (see :meth:`_visibility_env`); sets
        ``_count_path`` and, for 0, ``_count_reason``.  Starts no driver in this process."""
        self._count_reason = ""
        try:
            ffi, lib, _ = self._library()
        except AcceleratorError as exc:
            self._count_path = "none"
            self._count_reason = str(exc)
            return 0
        if self._zes_usable():
            self._count_path = "zesInit"
            try:
                visible = self._sysman_discover(key)
            except AcceleratorError as exc:
                self._count_reason = str(exc)
                return 0
            if not visible:
                self._count_reason = self._empty_reason(len(self._sysman_cards), key)
            return len(visible)
        if self._zes_legacy_asked:
            missing = "ZES_ENABLE_SYSMAN (non-zero) asks for legacy Sysman, which a zesInit would break"
        elif self._zes_error:
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
        count, reason = self._count_in_child(key)
        if not count:
            self._count_reason = f"{reason} (counted by zeInit in a child process: {missing})"
        return count

    def _empty_reason(self, cards: int, key: Tuple) -> str:
        if cards == 0:
            return "Sysman reports no Intel GPU"
        mask, mode = key
        return (f"Sysman sees {cards} GPU card(s) but ZE_AFFINITY_MASK={mask!r} "
                f"(ZE_FLAT_DEVICE_HIERARCHY={mode!r}) selects none")

    def _zes_usable(self) -> bool:
        """Whether Sysman counts without core init: the loader exports zesInit and friends AND a
        driver answers zesInit. A driver older than API 1.5 has no zesInit; the loader then returns
        ZE_RESULT_ERROR_UNINITIALIZED (or UNSUPPORTED_FEATURE), whatever its own version. Cached."""
        ok = self._zes_ok
        if ok is None:
            ffi, lib, _ = self._lib
            ok = False
            if _ze_visible.sysman_env_on(os.environ.get("ZES_ENABLE_SYSMAN")):
                # The process asked for legacy Sysman (oneCCL and geopm set it; any value the driver
                # reads as a non-zero number, "2" or " 1" as "1": sysman_env_on): after a zesInit its
                # core handles answer no Sysman call (Intel compute-runtime, "Level Zero Sysman
                # Initialization": zesInit + legacy mode is not supported), so accel makes none
                # and counts as a loader without zesInit does (r69g).
                self._zes_legacy_asked = True
            elif all(self._has(lib, s) for s in ("zesInit", "zesDriverGet", "zesDeviceGet")):
                rc = lib.zesInit(0)
                ok = rc == 0
                if not ok:
                    self._zes_error = f"{self._result_name(rc)} ({rc:#010x})"
            self._zes_ok = ok
        return ok

    def _sysman_discover(self, key: Optional[Tuple] = None):
        """The visible (card, tile) list for the visibility variables ``key`` (default: as
        :meth:`_visibility_env` gives them).  Needs _zes_usable().  The cards from zesDeviceGet
        do not depend on the variables (Sysman lists whole cards and ignores both) and are read
        once; the list is cached for the last key."""
        if key is None:
            key = self._visibility_env()
        memo = self._sysman_memo    # one attribute: the key and its list are read together
        if memo is not None and memo[0] == key and memo[1] is self._sysman_visible:
            return memo[1]          # (the fork handler and close() drop _sysman_visible)
        cards = self._sysman_cards
        if cards is None:
            cards = self._sysman_cards = self._sysman_read_cards()
        visible = _ze_visible.visible_devices([c[1] for c in cards], key[0], key[1])
        self._sysman_visible = visible
        self._sysman_memo = (key, visible)
        return visible

    def _sysman_read_cards(self) -> list:
        """[(zes handle, tiles, uuid bytes)] of every GPU card zesDeviceGet lists."""
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
        return cards

    def _count_in_child(self, key: Tuple) -> Tuple[int, str]:
        sim_config = None
        if self.simulated:
            from ...sim import ze as sim_ze
            sim_config = sim_ze.export_config()
        return _ze_count.count_in_child(sim_config, visibility=key)

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

    def init(self) -> None:
        with self._lock:
            if self._devices:
                return
            ffi, lib, _ = self._library()
            has_zes = self._zes_usable()
            user_sysman = os.environ.get("ZES_ENABLE_SYSMAN")
            env_key = self._visibility_env()   # what this zeInit reads (the first one that succeeds)
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
                self._fail("zeInit", rc, self._zeinit_fix())
            if self._init_env is None:
                # The driver built its device list from these values; a ZE_AFFINITY_MASK or
                # ZE_FLAT_DEVICE_HIERARCHY set from now on changes nothing in this process.
                self._init_env = env_key
            legacy = user_sysman is None or _ze_visible.sysman_env_on(user_sysman)
            self._sysman_legacy = not has_zes and legacy
            devices = []
            contexts = self._new_contexts = []     # made by _init_driver, destroyed if init fails
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
                # Nothing made so far stays with the driver: the default streams' lists, then the
                # contexts (also one of a driver whose devices were not all set up).
                for dev in devices:
                    for s in list(dev.streams.values()):
                        self._discard("zeCommandListDestroy", s.list)
                        self._streams.pop(s.handle, None)
                for ctx in contexts:
                    self._discard("zeContextDestroy", ctx)
                raise
            finally:
                self._new_contexts = None
            self._reconcile_count(len(devices))
            self._devices = devices
            self.driver_started = True
            if has_zes:
                try:
                    self._map_sysman()
                except AcceleratorError:
                    pass

    def _zeinit_fix(self) -> str:
        """What to check when zeInit fails: the driver is missing, or (a driver library found where
        the loader looks) the loader could not use it."""
        found = self._probe
        if found is None and not self.simulated:
            found = _ze_count.probe_gpu_drivers()
        if not found:
            return "is an Intel GPU driver (intel-level-zero-gpu) installed?"
        return (f"the Level Zero GPU driver {', '.join(found)} was found but the loader could not use it "
                f"(a driver and loader of mismatched versions, or a broken install: reinstall "
                f"intel-level-zero-gpu and the Level Zero loader)")

    def _reconcile_count(self, runtime_count: int) -> None:
        """From init on, the count is the initialized driver's (as the CUDA backend's).  The count
        before init (Sysman cards and tiles through :mod:`accel.backends._ze_visible`, or a
        child's zeInit) can differ: a driver whose default hierarchy is not FLAT (older drivers expose whole cards),
        or ZE_FLAT_DEVICE_HIERARCHY / ZE_AFFINITY_MASK changed between counting and init.  Say
        so once, naming both numbers and the hierarchy mode, rather than let indices past the
        driver's devices fail later (caller holds ``self._lock``)."""
        before = self._count
        self._count, self._count_memo = runtime_count, (self._init_env, runtime_count)
        if before is None or before == runtime_count:
            return
        self._count_before_init = before
        raw = self._init_env[1] if self._init_env is not None else os.environ.get("ZE_FLAT_DEVICE_HIERARCHY")
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
                self._new_contexts.append(ctx)
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

    def _query_all(self, ffi, fn, call: str, h, ctype: str, stype: int):
        """The Level Zero two-call query: ``fn(h, &n, NULL)`` for the count, then
        ``fn(h, &n, props)`` with each element's ``stype`` set (the spec requires it)."""
        n = ffi.new("uint32_t *", 0)
        rc = fn(h, n, ffi.NULL)
        if rc:
            self._fail(call, rc)
        props = ffi.new(f"{ctype}[]", n[0] or 1)
        for i in range(n[0]):
            props[i].stype = stype
        rc = fn(h, n, props)
        if rc:
            self._fail(call, rc)
        return [props[i] for i in range(n[0])]

    def _compute_ordinal(self, ffi, lib, h) -> int:
        groups = self._query_all(ffi, lib.zeDeviceGetCommandQueueGroupProperties,
                                 "zeDeviceGetCommandQueueGroupProperties", h,
                                 "ze_command_queue_group_properties_t",
                                 lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_GROUP_PROPERTIES)
        for i, group in enumerate(groups):
            if group.flags & lib.ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COMPUTE:
                return i
        raise AcceleratorError(f"{LIBRARY}: the device has no compute command queue group",
                               library=LIBRARY, call="zeDeviceGetCommandQueueGroupProperties")

    def _total_memory(self, ffi, lib, h) -> int:
        memories = self._query_all(ffi, lib.zeDeviceGetMemoryProperties, "zeDeviceGetMemoryProperties", h,
                                   "ze_device_memory_properties_t",
                                   lib.ZE_STRUCTURE_TYPE_DEVICE_MEMORY_PROPERTIES)
        return sum(m.totalSize for m in memories)

    def _map_sysman(self) -> None:
        """Pair each core device with its Sysman card (and tile) for mem_info, by identity: the
        card whose uuid is the device's (a whole card) or the tile's without its tile part, and
        skip a device no card (or more than one) matches.  Not by position: zesDeviceGet's order
        is "NOT affected by the ZE_AFFINITY_MASK, ZE_ENABLE_PCI_ID_DEVICE_ORDER, or
        ZE_FLAT_DEVICE_HIERARCHY environment variables" (level-zero-spec sysman device.yml, 1.7),
        zeDeviceGet's is.  Only devices of a driver with API 1.5+ (zesInit's version): the loader
        answers zesInit when any of its drivers has it, and an older driver's devices then have
        no Sysman card to pair with."""
        cards = self._sysman_cards
        if cards is None:
            cards = self._sysman_cards = self._sysman_read_cards()
        for dev in self._devices:
            if dev.api_version < _API_1_5:
                continue
            tile = dev.subdevice_id
            ids = {dev.uuid} if tile is None else _card_uuids(dev.uuid, tile)
            found = [handle for handle, tiles, uuid in cards
                     if uuid in ids and (tile is None or tile < max(tiles, 1))]
            if len(found) == 1:
                dev.sysman, dev.sysman_tile = found[0], tile

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
            uuid=bytes(dev.uuid), unified_memory=bool(dev.flags & self._lib[1].ZE_DEVICE_PROPERTY_FLAG_INTEGRATED),
            # ze_device_properties_t.deviceId is the PCI device id; Level Zero core gives no PCI
            # address, L2 size or warp (it has sub-group sizes: extra["sub_group_sizes"])
            pci_device_id=dev.props_extra.get("device_id"),
            extra=dict(dev.props_extra))

    def set_device(self, index: int) -> None:
        self._device(index)
        self._tls.device = index

    def get_device(self) -> int:
        return getattr(self._tls, "device", 0)


