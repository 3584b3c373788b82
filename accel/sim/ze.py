"""Simulated Level Zero loader (``libze_loader``: core ``ze*`` and Sysman ``zes*``).

``ACCEL_SIM=xpu`` makes :mod:`accel.backends.xpu` use :func:`open_ze` instead
of the real loader.  The backend calls the same functions with the same cffi
arguments (descriptor structs and out-pointers made with the generated
``accel._ffi._ze`` FFI) and gets the same ``ze_result_t`` codes, so the code
above the library is the code that runs on an Intel GPU.

What is simulated, and how faithfully:

* **Driver and devices.** One GPU driver with ``ACCEL_SIM_DEVICES`` cards of
  ``tiles`` tiles each.  ``zeInit`` reads ``ZE_FLAT_DEVICE_HIERARCHY`` and
  ``ZE_AFFINITY_MASK`` as Intel's driver does (its own implementation, kept
  independent of the backend's so tests cross-check the two); no card, or
  ``configure(driver=False)``, makes ``zeInit`` fail with
  ``ZE_RESULT_ERROR_UNINITIALIZED`` like a loader with no driver.  Every core
  call before ``zeInit`` returns that code too.  ``runtime_initialized`` in
  :func:`state` tells whether ``zeInit`` succeeded.
* **Sysman.** ``zesInit``/``zesDriverGet``/``zesDeviceGet`` list whole cards
  and ignore the two variables, as the real Sysman does.  Core device handles
  also work as Sysman handles when ``ZES_ENABLE_SYSMAN=1`` was set at
  ``zeInit`` (the legacy mode the 1.8.12 loader needs).  Each card has one
  HBM module per tile (``onSubdevice`` when it has several) and one system
  memory module, with free bytes tracking allocations.  Engine activity,
  memory bandwidth and energy are counters driven by the simulated work
  (:mod:`accel.sim._ze_counters`).
* **Loader version.** ``configure_ze(loader="1.8.12")`` (or
  ``ACCEL_SIM_ZE_LOADER=1.8.12``) removes ``zesInit``, ``zesDriverGet``,
  ``zesDeviceGet``, ``zeInitDrivers`` and ``zeCommandListHostSynchronize``,
  which that loader lacks.
* **Memory.** USM device and host allocations are host buffers at real
  addresses (:mod:`accel.sim._memory`).  Copies and fills accept USM pointers
  only: pageable host memory is rejected (strict, so a backend that forgets
  to stage it is caught).  Using freed memory in queued work faults the
  device (``ZE_RESULT_ERROR_DEVICE_LOST`` from then on).
* **Command lists.** Immediate lists are in-order queues of the shared
  engine (:mod:`accel.sim._engine`), with ``ACCEL_SIM_DELAY_US`` latency per
  operation.  Regular lists record operations; ``zeCommandQueueExecuteCommandLists``
  replays them on the queue's worker, and refuses a list the device still
  references (the spec forbids resubmitting it before it completes).
* **Events.** Each event counts the signals submitted for it and remembers
  how many had been submitted at its latest reset; a wait is satisfied by
  the first signal submitted after the reset that precedes it, so waits,
  signals and resets keep their order exactly as in-order lists execute them,
  without blocking a host thread.  Kernel timestamps use a ``timer_hz`` clock
  masked to ``timestamp_bits`` (``timestamp_start`` sets its initial value,
  to test wrap-around); ``timerResolution`` is nanoseconds per tick for
  ``ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES`` and ticks per second for
  ``..._1_2``, as the spec says.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import asdict, dataclass, fields, replace
from typing import Dict, List, Optional, Tuple

from . import _engine, _memory, _vmm, _ze_counters, core
from .core import ffi

__all__ = ["ZeConfig", "open_ze", "open_library", "configure_ze", "ze_config", "state", "reset",
           "export_config", "import_config"]

_UINT64_MAX = (1 << 64) - 1
_VOIDP = ffi.typeof("void *")


# -- configuration --------------------------------------------------------------

@dataclass(frozen=True)
class ZeConfig:
    """Level Zero specifics of the simulated machine (the rest is :func:`core.config`).

    ``tiles`` sub-devices per card; ``loader`` ``"new"`` or ``"1.8.12"``
    (Debian's loader, without zesInit and friends); ``api_version`` the
    driver's API (IN_ORDER list flags need 1.7); ``sysman_env`` whether the
    driver honours ``ZES_ENABLE_SYSMAN=1``; the timestamp clock;
    ``default_hierarchy`` how ``zeInit`` exposes multi-tile cards when
    ``ZE_FLAT_DEVICE_HIERARCHY`` is unset or not a mode name: ``"FLAT"`` (each
    tile a device: the default of current drivers, compute-runtime
    ``setDeviceHierarchyMode``) or ``"COMPOSITE"`` (each card a device: what
    drivers from before the variable existed do), so the count accel makes
    before init, which assumes FLAT, can differ from the initialized driver's.
    """

    tiles: int = 1
    loader: str = "new"
    api_version: Tuple[int, int] = (1, 9)
    sysman_env: bool = True
    timer_hz: int = 19_200_000
    timestamp_bits: int = 32
    timestamp_start: int = 0
    fp64: bool = True
    default_hierarchy: str = "FLAT"


_ze_overrides: Dict[str, object] = {}
_ze_config: Optional[ZeConfig] = None


def _parse_api(text) -> Tuple[int, int]:
    if isinstance(text, (tuple, list)) and len(text) == 2:
        return int(text[0]), int(text[1])
    parts = str(text).strip().split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"Level Zero API version {text!r} is not MAJOR.MINOR, e.g. '1.9'")
    return int(parts[0]), int(parts[1])


def _validate(cfg: ZeConfig) -> ZeConfig:
    if not isinstance(cfg.tiles, int) or cfg.tiles < 1:
        raise ValueError(f"tiles must be an integer >= 1, got {cfg.tiles!r}")
    if cfg.loader not in ("new", "1.8.12"):
        raise ValueError(f"loader must be 'new' or '1.8.12', got {cfg.loader!r}")
    if cfg.timer_hz <= 0 or not 8 <= cfg.timestamp_bits <= 64:
        raise ValueError("timer_hz must be > 0 and timestamp_bits in 8..64")
    if cfg.default_hierarchy not in ("FLAT", "COMPOSITE"):
        raise ValueError(f"default_hierarchy must be 'FLAT' or 'COMPOSITE', got {cfg.default_hierarchy!r}")
    return cfg


def ze_config() -> ZeConfig:
    """The active Level Zero simulation settings (environment + :func:`configure_ze`)."""
    global _ze_config
    cfg = _ze_config
    if cfg is None:
        kw = {}
        env = os.environ
        if env.get("ACCEL_SIM_ZE_TILES"):
            try:
                kw["tiles"] = int(env["ACCEL_SIM_ZE_TILES"])
            except ValueError:
                raise ValueError(f"ACCEL_SIM_ZE_TILES={env['ACCEL_SIM_ZE_TILES']!r} is not an integer") from None
        if env.get("ACCEL_SIM_ZE_LOADER"):
            kw["loader"] = env["ACCEL_SIM_ZE_LOADER"].strip()
        if env.get("ACCEL_SIM_ZE_API"):
            kw["api_version"] = _parse_api(env["ACCEL_SIM_ZE_API"])
        if env.get("ACCEL_SIM_ZE_HIERARCHY"):
            kw["default_hierarchy"] = env["ACCEL_SIM_ZE_HIERARCHY"].strip()
        kw.update(_ze_overrides)
        cfg = _ze_config = _validate(ZeConfig(**kw))
    return cfg


def configure_ze(**settings) -> ZeConfig:
    """Override Level Zero simulation settings (see :class:`ZeConfig`); drops the simulated runtime."""
    global _ze_config
    names = {f.name for f in fields(ZeConfig)}
    unknown = set(settings) - names
    if unknown:
        raise TypeError(f"configure_ze() got unknown setting(s) {sorted(unknown)}; expected some of {sorted(names)}")
    if "api_version" in settings:
        settings["api_version"] = _parse_api(settings["api_version"])
    _validate(replace(ze_config(), **settings))
    _ze_overrides.update(settings)
    _ze_config = None
    _drop_state()
    return ze_config()


def export_config() -> dict:
    """The whole simulated machine as JSON-able data (for a counting child process)."""
    core_cfg = asdict(core.config())
    return {"core": core_cfg, "ze": asdict(ze_config())}


def import_config(data: dict) -> None:
    """Apply :func:`export_config` output in this (child) process."""
    core.configure(**data["core"])
    configure_ze(**data["ze"])


# -- simulated objects ------------------------------------------------------------

_handle_numbers = itertools.count(0x5E0000001000, 0x40)
#: Handle values of destroyed objects, reused first (LIFO) as the driver's allocator reuses the
#: freed object's memory: anything a caller keys by handle value must forget it at destroy.
#: Bounded by the most objects ever live at once.
_free_handles: List[int] = []


class _Obj:
    __slots__ = ("key", "kind", "live")

    def __init__(self, kind: str):
        try:
            value = _free_handles.pop()   # atomic: two threads never get the same value
        except IndexError:
            value = next(_handle_numbers)
        self.key = ffi.cast(_VOIDP, value)
        self.kind = kind
        self.live = True


class _Card(_Obj):
    """A physical device: what Sysman lists."""
    __slots__ = ("index", "tiles", "tile_used", "uuid", "modules", "sensors", "freqs", "meters", "t0",
                 "engines", "powers")

    def __init__(self, index: int, tiles: int):
        super().__init__("card")
        self.index, self.tiles = index, tiles
        self.tile_used = [0] * tiles
        self.uuid = bytes([0x86, 0x80, 0x0B, 0xD5, index & 0xFF, 0xFF, 0, 0] + [0] * 8)
        self.modules: List["_MemModule"] = []
        self.sensors: List["_Part"] = []   # zesDeviceEnumTemperatureSensors
        self.freqs: List["_Part"] = []     # zesDeviceEnumFrequencyDomains
        self.meters = [_ze_counters.Meter() for _ in range(tiles)]   # Sysman counters per tile
        self.t0 = _ze_counters.now_us()    # the energy counters start here
        self.engines: List["_Counter"] = []    # zesDeviceEnumEngineGroups
        self.powers: List["_Counter"] = []     # zesDeviceEnumPowerDomains; [0] is the card's


class _Counter(_Obj):
    """A Sysman component read as counters: an engine group ("engine", ``group`` one of
    _ze_counters.GROUPS) or a power domain ("power"), of tile ``tile`` or card-wide (None)."""
    __slots__ = ("card", "tile", "group")

    def __init__(self, kind: str, card: _Card, tile: Optional[int], group: Optional[str] = None):
        super().__init__(kind)
        self.card, self.tile, self.group = card, tile, group

    def meters(self):
        m = self.card.meters
        return m if self.tile is None else [m[self.tile]]


class _Part(_Obj):
    """A Sysman component of a card that is not memory: a temperature sensor ("tempsensor") or
    a frequency domain ("freqdomain"), card-wide (onSubdevice false)."""
    __slots__ = ("card",)

    def __init__(self, kind: str, card: _Card):
        super().__init__(kind)
        self.card = card


class _MemModule(_Obj):
    __slots__ = ("card", "tile", "location")

    def __init__(self, card: _Card, tile: Optional[int], location: int):
        super().__init__("memmodule")
        self.card, self.tile, self.location = card, tile, location


class _Device(_Obj):
    """A core device handle: a card, or one tile of it."""
    __slots__ = ("ordinal", "card", "tiles", "is_sub", "subdevices", "uuid")

    def __init__(self, ordinal: int, card: _Card, tiles: List[int], is_sub: bool):
        super().__init__("device")
        self.ordinal, self.card, self.tiles, self.is_sub = ordinal, card, tiles, is_sub
        self.subdevices: List["_Device"] = []
        uuid = bytearray(card.uuid)
        if is_sub:
            uuid[6], uuid[7] = 1, tiles[0]
        self.uuid = bytes(uuid)

    @property
    def memory(self) -> int:
        return core.config().memory * len(self.tiles)

    def used(self) -> int:
        return sum(self.card.tile_used[t] for t in self.tiles)


class _Event(_Obj):
    __slots__ = ("pool", "index", "eq", "signaled", "sig_submitted", "last_reset_sig", "ts", "refs")

    def __init__(self, pool, index, eq):
        super().__init__("event")
        self.pool, self.index, self.eq = pool, index, eq
        self.signaled = False
        self.sig_submitted = 0     # signal operations submitted (and host signals)
        self.last_reset_sig = 0    # sig_submitted when the latest reset was submitted
        self.ts = (0, 0)
        self.refs = 0              # submitted operations that signal, wait for or reset it, not yet run


class _Pool(_Obj):
    __slots__ = ("flags", "count", "events", "context", "devices")

    def __init__(self, flags, count, context, devices):
        super().__init__("eventpool")
        self.flags, self.count, self.context = flags, count, context
        self.devices: List["_Device"] = devices   # empty: visible to every device of the driver
        self.events: Dict[int, _Event] = {}

    def visible_to(self, dev: "_Device") -> bool:
        return not self.devices or any(dev is d or dev in d.subdevices for d in self.devices)


class _CmdList(_Obj):
    __slots__ = ("device", "immediate", "queue", "ops", "closed", "in_order", "executing", "ordinal", "ctx",
                 "submitted", "finished")

    def __init__(self, ctx, device, immediate, queue, in_order, ordinal):
        super().__init__("cmdlist")
        self.submitted = self.finished = 0     # operations of an immediate list: appended, run
        self.ctx, self.device, self.immediate, self.queue = ctx, device, immediate, queue
        self.ops: list = []
        self.closed = False
        self.in_order = in_order
        self.executing: Optional[Tuple[object, int]] = None   # (engine queue, last seq) of the latest submission
        self.ordinal = ordinal


class _CmdQueue(_Obj):
    __slots__ = ("device", "queue", "ordinal", "ctx")

    def __init__(self, ctx, device, queue, ordinal):
        super().__init__("cmdqueue")
        self.ctx, self.device, self.queue, self.ordinal = ctx, device, queue, ordinal


class _Runtime:
    """Everything the simulated driver knows; dropped on reset and in a forked child."""

    def __init__(self):
        self.cfg = core.config()
        self.zcfg = ze_config()
        self.C = core.constants_of("_ze")
        self.lock = threading.RLock()
        self.engine = _engine.Engine(self._on_error)
        self.objects: Dict[object, _Obj] = {}
        self.initialized = False
        self.sysman_initialized = False
        self.sysman_on_core = False
        self.lost: Optional[str] = None
        self.errors: List[str] = []
        self.driver = _Obj("driver")
        self.zes_driver = _Obj("zesdriver")
        self._add(self.driver)
        self._add(self.zes_driver)
        self.cards = [_Card(i, self.zcfg.tiles) for i in range(self.cfg.devices)]
        for card in self.cards:
            self._add(card)
            if card.tiles > 1:
                card.modules = [_MemModule(card, t, self.C.ZES_MEM_LOC_DEVICE) for t in range(card.tiles)]
            else:
                card.modules = [_MemModule(card, None, self.C.ZES_MEM_LOC_DEVICE)]
            card.modules.append(_MemModule(card, None, self.C.ZES_MEM_LOC_SYSTEM))
            card.sensors = [_Part("tempsensor", card)]
            card.freqs = [_Part("freqdomain", card)]
            # engine groups and power domains: card-wide on a one-tile card, else one per tile,
            # plus the card's own power domain (zesDeviceGetCardPowerDomain) first
            per_tile = [None] if card.tiles == 1 else list(range(card.tiles))
            card.engines = [_Counter("engine", card, t, g) for t in per_tile for g in _ze_counters.GROUPS]
            card.powers = [_Counter("power", card, None)]
            if card.tiles > 1:
                card.powers += [_Counter("power", card, t) for t in per_tile]
            for m in card.modules + card.sensors + card.freqs + card.engines + card.powers:
                self._add(m)
        self.devices: List[_Device] = []
        self.memory = _memory.MemoryTable()
        # virtual memory (zeVirtualMem*, zePhysicalMem*): physical pages charged to the devices' tiles
        self.vmm = _vmm.Space("ze", self.cfg.memory * max(1, self.zcfg.tiles), self._vmm_charge,
                              self._vmm_refund)
        self.vmm_ctx: Dict[int, _Obj] = {}          # reservation base -> its context
        self.vmm_handle_ctx: Dict[int, _Obj] = {}   # physical handle -> its context
        self.alloc_charge: Dict[int, List[Tuple[_Card, int, int]]] = {}
        self.alloc_ctx: Dict[int, _Obj] = {}   # allocation base -> the context it was made in
        self.alloc_refs: Dict[object, int] = {}   # allocation -> submitted operations not yet run
        self.busy: Dict[_Obj, int] = {}   # command list / kernel -> the thread inside a call on it (_one_thread)

    def _add(self, obj: _Obj) -> _Obj:
        self.objects[obj.key] = obj
        return obj

    def _forget(self, obj: _Obj) -> None:
        """A destroyed object: its handle is unknown from now on (until a new object reuses
        the value), so the runtime holds nothing per destroyed object (issue 12, item 8)."""
        obj.live = False
        if self.objects.pop(obj.key, None) is obj:
            _free_handles.append(int(ffi.cast("uintptr_t", obj.key)))

    def get(self, handle, kind: str):
        obj = self.objects.get(handle)
        if obj is None or obj.kind != kind or not obj.live:
            return None
        return obj

    def _on_error(self, queue, exc: BaseException) -> None:
        text = f"{queue.label}: {type(exc).__name__}: {exc}"
        self.errors.append(text)
        if self.lost is None:
            self.lost = text

    def ticks(self) -> int:
        z = self.zcfg
        return (z.timestamp_start + time.perf_counter_ns() * z.timer_hz // 1_000_000_000) & ((1 << z.timestamp_bits) - 1)

    def _vmm_charge(self, ordinal: int, size: int) -> bool:
        dev = self.devices[ordinal]
        with self.lock:
            if dev.used() + size > dev.memory:
                return False
            share, extra = divmod(size, len(dev.tiles))
            for i, t in enumerate(dev.tiles):
                dev.card.tile_used[t] += share + (extra if i == 0 else 0)
        return True

    def _vmm_refund(self, ordinal: int, size: int) -> None:
        dev = self.devices[ordinal]
        with self.lock:
            share, extra = divmod(size, len(dev.tiles))
            for i, t in enumerate(dev.tiles):
                dev.card.tile_used[t] -= share + (extra if i == 0 else 0)

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.memory.close()
        self.vmm.close()


_rt: Optional[_Runtime] = None
_rt_lock = threading.Lock()


def _runtime() -> _Runtime:
    global _rt
    rt = _rt
    if rt is None:
        with _rt_lock:
            if _rt is None:
                _rt = _Runtime()
            rt = _rt
    return rt


def _drop_state() -> None:
    global _rt
    rt, _rt = _rt, None
    if rt is not None:
        rt.shutdown()


def _fork_drop() -> None:
    # In a forked child the parent's worker threads do not exist and its locks may be
    # held by them: forget everything without taking a lock.
    global _rt, _rt_lock
    rt, _rt = _rt, None
    _rt_lock = threading.Lock()
    if rt is not None:
        _memory.forget(rt.memory)
        rt.vmm.close(unmap=False)


def reset() -> None:
    """Forget the simulated runtime and the Level Zero overrides (tests)."""
    global _ze_config
    _drop_state()
    _ze_overrides.clear()
    _ze_config = None


def _full_reset() -> None:
    reset()


core.on_reset("ze", _full_reset, _fork_drop)


def state() -> dict:
    """Facts tests assert on: initialization flags, live objects, device faults."""
    rt = _rt
    if rt is None:
        return {"ze_runtime_initialized": False, "ze_sysman_initialized": False, "ze_live_allocations": 0,
                "ze_live_events": 0, "ze_live_command_lists": 0, "ze_errors": []}
    live = [o for o in rt.objects.values() if o.live]
    return {
        "ze_runtime_initialized": rt.initialized,
        "ze_sysman_initialized": rt.sysman_initialized,
        "ze_live_allocations": len(rt.memory.all()),
        "ze_live_events": sum(1 for o in live if o.kind == "event"),
        "ze_live_event_pools": sum(1 for o in live if o.kind == "eventpool"),
        "ze_live_command_lists": sum(1 for o in live if o.kind == "cmdlist"),
        "ze_live_command_queues": sum(1 for o in live if o.kind == "cmdqueue"),
        "ze_live_modules": sum(1 for o in live if o.kind == "module"),        # _ze_kernels.py
        "ze_live_kernels": sum(1 for o in live if o.kind == "kernel"),
        "ze_live_build_logs": sum(1 for o in live if o.kind == "buildlog"),
        "ze_device_used": [d.used() for d in rt.devices],
        "ze_errors": list(rt.errors),
        **{"ze_" + k: v for k, v in rt.vmm.stats().items()},
    }


core.on_state("ze", state)


# -- helpers ------------------------------------------------------------------------

def _addr(x) -> int:
    return _memory.addr_of(x)


def _fill(pcount, parr, items) -> int:
    """The usual Level Zero enumeration: count query when *pCount is 0 or the array is NULL."""
    n = pcount[0]
    if n == 0 or not parr:
        pcount[0] = len(items)
        return 0
    k = min(n, len(items))
    for i in range(k):
        parr[i] = items[i].key
    pcount[0] = k
    return 0


def _mask_number(text: str) -> Optional[int]:
    """A ZE_AFFINITY_MASK index: ASCII decimal digits (the driver's C++ string-to-integer knows no
    others; Python's int() takes "١"), else None: the entry is ignored."""
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() else None


def _visible(rt: _Runtime) -> List[Tuple[_Card, List[int], bool]]:
    """Devices zeDeviceGet returns: (card, tiles, is_sub_device), as the driver builds them."""
    env = os.environ
    mode = env.get("ZE_FLAT_DEVICE_HIERARCHY", "")
    if mode not in ("FLAT", "COMPOSITE", "COMBINED"):
        mode = rt.zcfg.default_hierarchy    # unset or not a mode name: the driver's default
    expose_tiles = mode != "COMPOSITE"
    mask = env.get("ZE_AFFINITY_MASK", "")
    if expose_tiles:
        index_map = [(c, t) for c in rt.cards for t in range(c.tiles)]
    enabled: Dict[int, set] = {}
    if mask.strip() in ("", "default"):
        for c in rt.cards:
            enabled[c.index] = set(range(c.tiles))
    else:
        for entry in mask.split(","):
            parts = entry.split(".")
            idx = _mask_number(parts[0])
            if idx is None:
                continue
            if expose_tiles:
                if len(parts) > 1 or not 0 <= idx < len(index_map):
                    continue
                c, t = index_map[idx]
                enabled.setdefault(c.index, set()).add(t)
            else:
                if not 0 <= idx < len(rt.cards):
                    continue
                c = rt.cards[idx]
                if len(parts) == 1:
                    enabled.setdefault(c.index, set()).update(range(c.tiles))
                elif len(parts) == 2:
                    sub = _mask_number(parts[1])
                    if sub is not None and 0 <= sub < c.tiles:
                        enabled.setdefault(c.index, set()).add(sub)
    out = []
    for c in rt.cards:
        tiles = sorted(enabled.get(c.index, ()))
        if not tiles:
            continue
        if expose_tiles and c.tiles > 1:
            out.extend((c, [t], True) for t in tiles)
        elif len(tiles) == 1 and c.tiles > 1:
            out.append((c, tiles, True))   # one tile of a card: that tile is the device
        else:
            out.append((c, tiles, False))
    return out


# Every simulated function takes exactly the vendor function's parameters (the
# core's wrappers copy the signature), so the checks below are calls, not decorators.

def _ready():
    """(runtime, 0), or (None, code) for a core call before zeInit or after a device fault."""
    rt = _runtime()
    if not rt.initialized:
        return None, rt.C.ZE_RESULT_ERROR_UNINITIALIZED
    if rt.lost is not None:
        return None, rt.C.ZE_RESULT_ERROR_DEVICE_LOST
    return rt, 0


def _sysman(handle):
    """(runtime, Sysman object, 0) or (None, None, code): cards and memory modules after
    zesInit; core devices (and their modules) when ZES_ENABLE_SYSMAN=1 was set at zeInit."""
    rt = _runtime()
    obj = rt.objects.get(handle)
    if obj is None or not obj.live:
        return None, None, (rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE if not handle
                            else rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT)
    if obj.kind in ("card", "memmodule", "tempsensor", "freqdomain", "engine", "power") and rt.sysman_initialized:
        return rt, obj, 0
    if obj.kind in ("device", "memmodule", "tempsensor", "freqdomain", "engine", "power") and rt.sysman_on_core:
        return rt, obj, 0
    return None, None, rt.C.ZE_RESULT_ERROR_UNINITIALIZED


# -- initialization and discovery --------------------------------------------------------

def zeInit(flags):
    rt = _runtime()
    if flags & ~3:
        return rt.C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    if not rt.cfg.driver or not rt.cards or (flags & 3) == 2:   # VPU only: no GPU driver answers
        return rt.C.ZE_RESULT_ERROR_UNINITIALIZED
    with rt.lock:
        if not rt.initialized:
            rt.sysman_on_core = rt.zcfg.sysman_env and os.environ.get("ZES_ENABLE_SYSMAN") == "1"
            for ordinal, (card, tiles, is_sub) in enumerate(_visible(rt)):
                dev = rt._add(_Device(ordinal, card, tiles, is_sub))
                if not is_sub and len(tiles) > 1:
                    for t in tiles:
                        dev.subdevices.append(rt._add(_Device(ordinal, card, [t], True)))
                rt.devices.append(dev)
            rt.initialized = True
    return 0


def zesInit(flags):
    rt = _runtime()
    if flags != 0:
        return rt.C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    if not rt.cfg.driver or not rt.cards:
        return rt.C.ZE_RESULT_ERROR_UNINITIALIZED
    if rt.zcfg.api_version < (1, 5):
        # zesInit is Level Zero API 1.5. Loader source/loader/zes_ldrddi.cpp, zesInit: a driver whose
        # Sysman table has no pfnInit is skipped, and with no valid driver the result is
        # ZE_RESULT_ERROR_UNINITIALIZED, whatever the loader's own version.
        return rt.C.ZE_RESULT_ERROR_UNINITIALIZED
    rt.sysman_initialized = True
    return 0


def zesDriverGet(pCount, phDrivers):
    rt = _runtime()
    if not rt.sysman_initialized:
        return rt.C.ZE_RESULT_ERROR_UNINITIALIZED
    return _fill(pCount, phDrivers, [rt.zes_driver])


def zesDeviceGet(hDriver, pCount, phDevices):
    rt = _runtime()
    if not rt.sysman_initialized:
        return rt.C.ZE_RESULT_ERROR_UNINITIALIZED
    if rt.get(hDriver, "zesdriver") is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    return _fill(pCount, phDevices, rt.cards)


def zeDriverGet(pCount, phDrivers):
    rt, rc = _ready()
    if rc:
        return rc
    return _fill(pCount, phDrivers, [rt.driver])


def zeDriverGetApiVersion(hDriver, version):
    rt, rc = _ready()
    if rc:
        return rc
    if rt.get(hDriver, "driver") is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    major, minor = rt.zcfg.api_version
    version[0] = (major << 16) | minor
    return 0


def zeDriverGetProperties(hDriver, props):
    rt, rc = _ready()
    if rc:
        return rc
    if rt.get(hDriver, "driver") is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if props.stype != rt.C.ZE_STRUCTURE_TYPE_DRIVER_PROPERTIES:
        return rt.C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    props.uuid.id = list(b"accel-sim-ze-drv")
    props.driverVersion = 0x01030000 | 29735
    return 0


def zeDeviceGet(hDriver, pCount, phDevices):
    rt, rc = _ready()
    if rc:
        return rc
    if rt.get(hDriver, "driver") is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    return _fill(pCount, phDevices, rt.devices)


def zeDeviceGetSubDevices(hDevice, pCount, phSubdevices):
    rt, rc = _ready()
    if rc:
        return rc
    dev = rt.get(hDevice, "device")
    if dev is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    return _fill(pCount, phSubdevices, dev.subdevices)


def _write_core_properties(rt: _Runtime, props, dev_uuid: bytes, is_sub: bool, tile: int, tiles: int) -> int:
    C = rt.C
    if props.stype not in (C.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES, C.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES_1_2):
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    z = rt.zcfg
    props.type = C.ZE_DEVICE_TYPE_GPU
    props.vendorId = 0x8086
    props.deviceId = 0x0BD5
    props.flags = C.ZE_DEVICE_PROPERTY_FLAG_SUBDEVICE if is_sub else 0
    props.subdeviceId = tile if is_sub else 0
    props.coreClockRate = 1600
    props.maxMemAllocSize = core.config().memory * tiles
    props.maxHardwareContexts = 65536
    props.maxCommandQueuePriority = 0
    props.numThreadsPerEU = 8
    props.physicalEUSimdWidth = 16
    props.numEUsPerSubslice = 8
    props.numSubslicesPerSlice = 8 * tiles
    props.numSlices = 1
    if props.stype == C.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES_1_2:
        props.timerResolution = z.timer_hz                      # ticks per second
    else:
        props.timerResolution = round(1_000_000_000 / z.timer_hz)  # whole nanoseconds per tick
    props.timestampValidBits = z.timestamp_bits
    props.kernelTimestampValidBits = z.timestamp_bits
    props.uuid.id = list(dev_uuid)
    name = core.config().name.encode()[:255]
    props.name = name
    return 0


def zeDeviceGetProperties(hDevice, props):
    rt, rc = _ready()
    if rc:
        return rc
    dev = rt.get(hDevice, "device")
    if dev is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    return _write_core_properties(rt, props, dev.uuid, dev.is_sub, dev.tiles[0], len(dev.tiles))


def zeDeviceCanAccessPeer(hDevice, hPeerDevice, value):
    """ze_api.h, zeDeviceCanAccessPeer: true when the two devices are connected over PCIe (same
    root complex or a shared switch) or a scale-up fabric, sub-devices and parents included.  The
    simulated cards share one root complex, so every pair of devices answers true."""
    rt, rc = _ready()
    if rc:
        return rc
    dev, peer = rt.get(hDevice, "device"), rt.get(hPeerDevice, "device")
    if dev is None or peer is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if not value:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    value[0] = 1
    return 0


def zeDeviceGetComputeProperties(hDevice, props):
    rt, rc = _ready()
    if rc:
        return rc
    if rt.get(hDevice, "device") is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if props.stype != rt.C.ZE_STRUCTURE_TYPE_DEVICE_COMPUTE_PROPERTIES:
        return rt.C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    props.maxTotalGroupSize = 1024
    props.maxGroupSizeX = props.maxGroupSizeY = props.maxGroupSizeZ = 1024
    props.maxGroupCountX = props.maxGroupCountY = props.maxGroupCountZ = 0xFFFFFFFF
    props.maxSharedLocalMemory = 128 * 1024
    props.numSubGroupSizes = 2
    props.subGroupSizes[0], props.subGroupSizes[1] = 16, 32
    return 0


def zeDeviceGetModuleProperties(hDevice, props):
    rt, rc = _ready()
    if rc:
        return rc
    if rt.get(hDevice, "device") is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if props.stype != rt.C.ZE_STRUCTURE_TYPE_DEVICE_MODULE_PROPERTIES:
        return rt.C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    props.spirvVersionSupported = (1 << 16) | 2
    props.flags = rt.C.ZE_DEVICE_MODULE_FLAG_FP16 | (rt.C.ZE_DEVICE_MODULE_FLAG_FP64 if rt.zcfg.fp64 else 0)
    return 0


def zeDeviceGetMemoryProperties(hDevice, pCount, props):
    rt, rc = _ready()
    if rc:
        return rc
    dev = rt.get(hDevice, "device")
    if dev is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if pCount[0] == 0 or not props:
        pCount[0] = 1
        return 0
    if props[0].stype != rt.C.ZE_STRUCTURE_TYPE_DEVICE_MEMORY_PROPERTIES:
        return rt.C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    props[0].flags = 0
    props[0].maxClockRate = 3200
    props[0].maxBusWidth = 8192
    props[0].totalSize = dev.memory
    props[0].name = b"HBM"
    pCount[0] = 1
    return 0


# Ordinal 0 copies only and ordinal 1 computes, so a backend that assumes
# "ordinal 0 is compute" is caught (real PVC lists compute first).
_GROUPS = (("copy", 2), ("compute", 1))


def _fill_pattern_max(ordinal: int) -> int:
    """maxMemoryFillPatternSize of queue group ``ordinal``: 16 bytes on compute, 4 on copy engines."""
    return 16 if ordinal < len(_GROUPS) and _GROUPS[ordinal][0] == "compute" else 4


def zeDeviceGetCommandQueueGroupProperties(hDevice, pCount, props):
    rt, rc = _ready()
    if rc:
        return rc
    if rt.get(hDevice, "device") is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    C = rt.C
    if pCount[0] == 0 or not props:
        pCount[0] = len(_GROUPS)
        return 0
    k = min(pCount[0], len(_GROUPS))
    for i in range(k):
        kind, nq = _GROUPS[i]
        if props[i].stype != C.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_GROUP_PROPERTIES:
            return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
        flags = C.ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COPY
        if kind == "compute":
            flags |= C.ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COMPUTE | C.ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_METRICS
        props[i].flags = flags
        props[i].maxMemoryFillPatternSize = _fill_pattern_max(i)
        props[i].numQueues = nq
    pCount[0] = k
    return 0


def zeDeviceGetGlobalTimestamps(hDevice, hostTimestamp, deviceTimestamp):
    rt, rc = _ready()
    if rc:
        return rc
    if rt.get(hDevice, "device") is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    hostTimestamp[0] = time.monotonic_ns()
    deviceTimestamp[0] = rt.ticks()
    return 0


# -- contexts and memory --------------------------------------------------------------------

def zeContextCreate(hDriver, desc, phContext):
    rt, rc = _ready()
    if rc:
        return rc
    if rt.get(hDriver, "driver") is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if desc.stype != rt.C.ZE_STRUCTURE_TYPE_CONTEXT_DESC:
        return rt.C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    ctx = rt._add(_Obj("context"))
    phContext[0] = ctx.key
    return 0


#: The attribute naming the context an object was created from, per kind (zeContextDestroy; a
#: module, _ze_kernels._KObj, keeps it in its fields as "ctx").
_OWNER = {"cmdlist": "ctx", "cmdqueue": "ctx", "eventpool": "context"}


def zeContextDestroy(hContext):
    rt, rc = _ready()
    if rc:
        return rc
    ctx = rt.get(hContext, "context")
    if ctx is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    with rt.lock:
        # ze_api.h, zeContextDestroy: "The application must ensure the device is not currently
        # referencing the context before it is deleted" (@returns HANDLE_OBJECT_IN_USE): work
        # submitted to a list or queue of the context that has not run yet.  The header is silent
        # on what becomes of the context's other objects (it speaks of allocations only, below):
        # command lists and queues (zeCommandList*Create, zeCommandQueueCreate take hContext),
        # event pools and through them their events, modules and through them their kernels,
        # physical memory ("The application must only use the physical memory object on the
        # context for which it was created", zePhysicalMemCreate) and virtual reservations ("...
        # on the context for which it was created", zeVirtualMemReserve).  Using them after their
        # context is gone is undefined, and the last two could not even be released
        # (zePhysicalMemDestroy and zeVirtualMemFree take the destroyed hContext): the spec is
        # silent, so refused, idle or not, with the same code; nothing changes.  The application
        # destroys them first.  (The simulator destroyed the context and left every one of them
        # usable: tests/test_sim_ze_strict2.py.)
        for obj in list(rt.objects.values()):    # a snapshot: other threads create objects meanwhile
            owner = obj.f["ctx"] if obj.kind == "module" else getattr(obj, _OWNER.get(obj.kind, "-"), None)
            if owner is ctx and obj.live:
                return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
        if ctx in list(rt.vmm_ctx.values()) + list(rt.vmm_handle_ctx.values()):
            return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
        # "The implementation of this function may immediately free all Host and Device
        # allocations associated with this context": the simulator does, so nothing uses them
        # afterwards (a later access faults; the memory is the device's again).
        for a in rt.memory.all():
            if rt.alloc_ctx.get(a.base) is ctx:
                rt.memory.remove(a)
                del rt.alloc_ctx[a.base]
                for card, t, n in rt.alloc_charge.pop(a.base, ()):
                    card.tile_used[t] -= n
        rt._forget(ctx)
    return 0


# The largest alignment the simulator honours: ze_api.h names no upper bound; above this the
# simulator refuses (UNSUPPORTED_ALIGNMENT) rather than reserve that much address space.
_MAX_ALIGNMENT = 1 << 30


def _alloc_checks(rt, size, alignment, flags, max_flags) -> int:
    # ze_api.h, zeMemAllocDevice / zeMemAllocHost @returns: INVALID_ENUMERATION "0x7 <
    # device_desc->flags" / "0xf < host_desc->flags"; UNSUPPORTED_SIZE "0 == size";
    # UNSUPPORTED_ALIGNMENT "Must be zero or a power-of-two".
    if flags > max_flags:
        return rt.C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    if size == 0:
        return rt.C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE
    if alignment and alignment & (alignment - 1) or alignment > _MAX_ALIGNMENT:
        return rt.C.ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT
    return 0


def _allocate(size, kind, device, alignment):
    """The allocation, aligned as asked: ze_api.h, zeMemAlloc*: ``alignment`` is the "minimum
    alignment in bytes for the allocation" (0: the driver's choice, 256 bytes here)."""
    return _memory.allocate(size, kind, device, max(alignment, _memory.ALIGN))


def zeMemAllocDevice(hContext, desc, size, alignment, hDevice, pptr):
    rt, rc = _ready()
    if rc:
        return rc
    C = rt.C
    if rt.get(hContext, "context") is None:
        return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    dev = rt.get(hDevice, "device")
    if dev is None:
        return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if desc.stype != C.ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    rc = _alloc_checks(rt, size, alignment, desc.flags, 0x7)
    if rc:
        return rc
    if size > dev.memory:
        return C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE   # above maxMemAllocSize
    with rt.lock:
        if core.take_oom() or dev.used() + size > dev.memory:
            return C.ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY
        try:
            a = _allocate(size, _memory.DEVICE, dev.ordinal, alignment)
        except MemoryError:
            return C.ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY
        share, extra = divmod(size, len(dev.tiles))
        charge = []
        for i, t in enumerate(dev.tiles):
            n = share + (extra if i == 0 else 0)
            dev.card.tile_used[t] += n
            charge.append((dev.card, t, n))
        rt.alloc_charge[a.base] = charge
        rt.alloc_ctx[a.base] = rt.get(hContext, "context")
        rt.memory.add(a)
    pptr[0] = a.key
    return 0


def zeMemAllocHost(hContext, desc, size, alignment, pptr):
    rt, rc = _ready()
    if rc:
        return rc
    C = rt.C
    if rt.get(hContext, "context") is None:
        return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if desc.stype != C.ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    rc = _alloc_checks(rt, size, alignment, desc.flags, 0xF)
    if rc:
        return rc
    if core.take_oom():
        return C.ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY
    try:
        a = _allocate(size, _memory.HOST, -1, alignment)
    except MemoryError:
        return C.ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY
    rt.alloc_ctx[a.base] = rt.get(hContext, "context")
    rt.memory.add(a)
    pptr[0] = a.key
    return 0


def zeMemFree(hContext, ptr):
    rt, rc = _ready()
    if rc:
        return rc
    ctx = rt.get(hContext, "context")
    if ctx is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    with rt.lock:
        a = rt.memory.by_key.get(ptr)
        if a is None:
            return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
        # ze_api.h: memory belongs to the context it was allocated in; another context's
        # zeMemFree is refused (the documents are silent on the code: INVALID_ARGUMENT).
        if rt.alloc_ctx.get(a.base) is not ctx:
            return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
        # ze_api.h, zeMemFree: "The application must ensure the device is not currently
        # referencing the memory before it is freed" -- the words of zeEventDestroy and
        # zeKernelDestroy, refused likewise: submitted work that has not run yet touches it.
        if a in rt.alloc_refs:
            return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
        rt.memory.remove(a)
        rt.alloc_ctx.pop(a.base, None)
        for card, t, n in rt.alloc_charge.pop(a.base, ()):
            card.tile_used[t] -= n
    return 0


def zeMemGetAllocProperties(hContext, ptr, props, phDevice):
    rt, rc = _ready()
    if rc:
        return rc
    C = rt.C
    if rt.get(hContext, "context") is None:
        return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if props.stype != C.ZE_STRUCTURE_TYPE_MEMORY_ALLOCATION_PROPERTIES:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    a = rt.memory.find(_addr(ptr))
    if a is None:
        props.type, props.id, props.pageSize = C.ZE_MEMORY_TYPE_UNKNOWN, 0, 0
        if phDevice:
            phDevice[0] = ffi.NULL
        return 0
    props.type = C.ZE_MEMORY_TYPE_DEVICE if a.kind == _memory.DEVICE else C.ZE_MEMORY_TYPE_HOST
    props.id = a.base
    props.pageSize = 65536
    if phDevice:
        phDevice[0] = rt.devices[a.device].key if a.kind == _memory.DEVICE else ffi.NULL
    return 0


# -- events ------------------------------------------------------------------------------------

def zeEventPoolCreate(hContext, desc, numDevices, phDevices, phEventPool):
    rt, rc = _ready()
    if rc:
        return rc
    C = rt.C
    ctx = rt.get(hContext, "context")
    if ctx is None:
        return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if desc.stype != C.ZE_STRUCTURE_TYPE_EVENT_POOL_DESC:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    if desc.count == 0:
        return C.ZE_RESULT_ERROR_INVALID_SIZE
    if desc.flags & ~0xF:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    devices = []
    for i in range(numDevices):
        dev = rt.get(phDevices[i], "device")
        if dev is None:
            return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
        devices.append(dev)
    # ze_api.h, zeEventPoolCreate: phDevices are the "device handles which have visibility to the
    # event pool"; none means every device of the driver.
    pool = rt._add(_Pool(desc.flags, desc.count, ctx, devices))
    phEventPool[0] = pool.key
    return 0


def zeEventPoolDestroy(hEventPool):
    rt, rc = _ready()
    if rc:
        return rc
    pool = rt.get(hEventPool, "eventpool")
    if pool is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    # ze_api.h, zeEventPoolDestroy: "The application must destroy all event handles created from
    # the pool before destroying the pool itself."
    if pool.events:
        return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    rt._forget(pool)
    return 0


def zeEventCreate(hEventPool, desc, phEvent):
    rt, rc = _ready()
    if rc:
        return rc
    C = rt.C
    pool = rt.get(hEventPool, "eventpool")
    if pool is None:
        return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if desc.stype != C.ZE_STRUCTURE_TYPE_EVENT_DESC:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    if desc.index >= pool.count:
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    old = pool.events.get(desc.index)
    if old is not None and old.live:
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT   # index already holds an event
    ev = rt._add(_Event(pool, desc.index, rt.engine.queue(f"event-{desc.index}")))
    pool.events[desc.index] = ev
    phEvent[0] = ev.key
    return 0


def zeEventDestroy(hEvent):
    rt, rc = _ready()
    if rc:
        return rc
    ev = rt.get(hEvent, "event")
    if ev is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    with rt.lock:
        # ze_api.h, zeEventDestroy: "The application must ensure the device is not currently
        # referencing the event before it is deleted."
        if ev.refs:
            return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
        rt._forget(ev)
        if ev.pool.events.get(ev.index) is ev:
            del ev.pool.events[ev.index]
    rt.engine.close_later(ev.eq)   # lets the engine forget the event's queue
    return 0


def _signal_now(rt: _Runtime, ev: _Event) -> None:
    """The device (or host) signals ``ev``: runs when the signal operation executes."""
    t = rt.ticks()
    ev.ts = (t, t)
    ev.signaled = True
    ev.eq.submit(None, work=False)   # one more executed signal: wakes waits and host syncs


def _device_signal(rt: _Runtime, ev: _Event) -> None:
    """A submitted signal operation executes: the device's reference of ``ev`` ends as the signal
    becomes visible, in one step under ``rt.lock``, so a host thread that saw the signal may
    reset or destroy the event (zeEventHostReset, zeEventDestroy check ``refs`` under that lock).
    No engine lock is ever held while ``rt.lock`` is taken, so the marker submitted here is safe."""
    with rt.lock:
        ev.refs -= 1
        _signal_now(rt, ev)


def _host_event(rt: _Runtime, hEvent):
    """The event, or the code refusing a host signal/reset/query/wait on it."""
    ev = rt.get(hEvent, "event")
    if ev is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    # ze_api.h, ze_event_pool_flag_t: ZE_EVENT_POOL_FLAG_HOST_VISIBLE "signals and waits are also
    # visible to host". Without it the host cannot see the event; the documents name no result
    # code, so the simulator refuses with INVALID_ARGUMENT.
    if not ev.pool.flags & rt.C.ZE_EVENT_POOL_FLAG_HOST_VISIBLE:
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    return ev


def zeEventHostSignal(hEvent):
    rt, rc = _ready()
    if rc:
        return rc
    ev = _host_event(rt, hEvent)
    if isinstance(ev, int):
        return ev
    with rt.lock:
        ev.sig_submitted += 1
    _signal_now(rt, ev)
    return 0


def zeEventHostReset(hEvent):
    rt, rc = _ready()
    if rc:
        return rc
    ev = _host_event(rt, hEvent)
    if isinstance(ev, int):
        return ev
    with rt.lock:
        # ze_api.h, zeEventHostReset states no rule for an event that submitted work still
        # signals, waits for or resets: the reset would race the device (a later signal undoes
        # it, a wait may see either state). The documents are silent: refused, with the code
        # zeEventDestroy gives while "the device is ... currently referencing the event".
        if ev.refs:
            return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
        ev.last_reset_sig = ev.sig_submitted
        ev.signaled = False
    return 0


def zeEventQueryStatus(hEvent):
    rt, rc = _ready()
    if rc:
        return rc
    ev = _host_event(rt, hEvent)
    if isinstance(ev, int):
        return ev
    return 0 if ev.signaled else rt.C.ZE_RESULT_NOT_READY


def _host_wait(rt: _Runtime, cond, timeout_ns: int, cv, what: str) -> int:
    """Wait on ``cv`` (engine lock) until ``cond()``; the Level Zero timeout rules."""
    if cond():
        return 0
    if timeout_ns == 0:
        return rt.C.ZE_RESULT_NOT_READY
    limit = core.WAIT_TIMEOUT_S if timeout_ns == _UINT64_MAX else min(timeout_ns / 1e9, core.WAIT_TIMEOUT_S)
    deadline = time.monotonic() + limit
    with rt.engine.lock:
        while not cond():
            if rt.engine.closed:
                return rt.C.ZE_RESULT_ERROR_DEVICE_LOST
            left = deadline - time.monotonic()
            if left <= 0:
                if timeout_ns == _UINT64_MAX:
                    raise RuntimeError(f"accel.sim: {what} waited {limit:.0f} s for work that never completes "
                                       "(a wait on an event nothing will signal?)")
                return rt.C.ZE_RESULT_NOT_READY
            cv.wait(left)
    if rt.lost is not None:
        return rt.C.ZE_RESULT_ERROR_DEVICE_LOST
    return 0


def zeEventHostSynchronize(hEvent, timeout):
    rt, rc = _ready()
    if rc:
        return rc
    ev = _host_event(rt, hEvent)
    if isinstance(ev, int):
        return ev
    return _host_wait(rt, lambda: ev.signaled or rt.lost is not None, timeout, ev.eq.cv, "zeEventHostSynchronize")


def zeEventQueryKernelTimestamp(hEvent, dstptr):
    rt, rc = _ready()
    if rc:
        return rc
    C = rt.C
    ev = rt.get(hEvent, "event")
    if ev is None:
        return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if not ev.pool.flags & C.ZE_EVENT_POOL_FLAG_KERNEL_TIMESTAMP:
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if not ev.signaled:
        return C.ZE_RESULT_NOT_READY
    start, end = ev.ts
    wall = getattr(dstptr, "global")   # a C field named like a Python keyword
    wall.kernelStart, wall.kernelEnd = start, end
    dstptr.context.kernelStart, dstptr.context.kernelEnd = start, end
    return 0


# -- command lists and queues ---------------------------------------------------------------------

def _queue_target(hContext, hDevice, stype, expected_stype: str, ordinal):
    """The checks every creator of a queue or command list makes: ``(rc, rt, dev)``,
    with ``rc`` the result code to return when it is not 0."""
    rt, rc = _ready()
    if rc:
        return rc, rt, None
    C = rt.C
    if rt.get(hContext, "context") is None:
        return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE, rt, None
    dev = rt.get(hDevice, "device")
    if dev is None:
        return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE, rt, None
    if stype != getattr(C, expected_stype):
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION, rt, None
    if ordinal >= len(_GROUPS):
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT, rt, None
    return 0, rt, dev


def zeCommandListCreateImmediate(hContext, hDevice, altdesc, phCommandList):
    rc, rt, dev = _queue_target(hContext, hDevice, altdesc.stype, "ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC",
                                altdesc.ordinal)
    if rc:
        return rc
    C = rt.C
    in_order = bool(altdesc.flags & C.ZE_COMMAND_QUEUE_FLAG_IN_ORDER)
    if in_order and rt.zcfg.api_version < (1, 7):
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION   # the flag does not exist before API 1.7
    if altdesc.mode > C.ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    q = rt.engine.queue(f"xpu{dev.ordinal}-immediate")
    cl = rt._add(_CmdList(rt.get(hContext, "context"), dev, True, q, in_order, altdesc.ordinal))
    phCommandList[0] = cl.key
    return 0


def zeCommandListCreate(hContext, hDevice, desc, phCommandList):
    rc, rt, dev = _queue_target(hContext, hDevice, desc.stype, "ZE_STRUCTURE_TYPE_COMMAND_LIST_DESC",
                                desc.commandQueueGroupOrdinal)
    if rc:
        return rc
    C = rt.C
    in_order = bool(desc.flags & C.ZE_COMMAND_LIST_FLAG_IN_ORDER)
    if in_order and rt.zcfg.api_version < (1, 7):
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    cl = rt._add(_CmdList(rt.get(hContext, "context"), dev, False, None, in_order, desc.commandQueueGroupOrdinal))
    phCommandList[0] = cl.key
    return 0


def _busy(cl: _CmdList) -> bool:
    if cl.immediate:
        # Not the engine queue's count: it completes an operation only after the operation's
        # signal has woken the host, which may destroy the list at once (the device is done).
        return cl.finished < cl.submitted
    return cl.executing is not None and cl.executing[0].done < cl.executing[1]


def zeCommandListDestroy(hCommandList):
    rt, rc = _ready()
    if rc:
        return rc
    cl = rt.get(hCommandList, "cmdlist")
    if cl is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if _busy(cl):
        return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE   # the device still references it
    rt._forget(cl)
    cl.ops = []
    if cl.queue is not None:
        rt.engine.close_later(cl.queue)
    return 0


def zeCommandListClose(hCommandList):
    rt, rc = _ready()
    if rc:
        return rc
    cl = rt.get(hCommandList, "cmdlist")
    if cl is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if cl.immediate:
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    cl.closed = True
    return 0


def zeCommandListReset(hCommandList):
    rt, rc = _ready()
    if rc:
        return rc
    cl = rt.get(hCommandList, "cmdlist")
    if cl is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if _busy(cl):
        return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    cl.ops.clear()
    cl.closed = False
    return 0


class _Op:
    """One command: ``fn`` (the work, may be None), the events it waits for, signals and resets;
    ``traffic`` the (read, written) bytes of device memory it moves (the Sysman counters);
    ``kernel`` the kernel object a launch runs (_ze_kernels.py), referenced until it ran;
    ``memory`` the USM allocations it touches, likewise referenced (zeMemFree)."""
    __slots__ = ("fn", "waits", "signal", "reset", "work", "label", "traffic", "kernel", "memory")

    def __init__(self, fn, waits=(), signal=None, reset=None, work=True, label="", traffic=(0, 0), kernel=None):
        self.fn, self.waits, self.signal, self.reset, self.work, self.label = fn, waits, signal, reset, work, label
        self.traffic, self.kernel = traffic, kernel
        self.memory = ()


def _is_device_memory(a) -> bool:
    """A copy side: a USM allocation, or None for mapped virtual memory (device pages)."""
    return a is None or a.kind == _memory.DEVICE


def _submit(rt: _Runtime, queue, op: _Op, device: Optional[_Device] = None, ordinal: int = 0,
            owner: Optional["_CmdList"] = None) -> None:
    """Put ``op`` on an engine queue; the event bookkeeping happens in submission order.  Work
    (``op.fn``) run for ``device`` is charged to its tiles' Sysman counters (_ze_counters), to
    the engine group of queue group ``ordinal``, when it completes.  ``owner``: the immediate
    list it is appended to, which the device references until the operation ran (_busy)."""
    meters = [device.card.meters[t] for t in device.tiles] if device is not None and op.fn is not None else ()
    group = _GROUPS[ordinal][0] if ordinal < len(_GROUPS) else "all"
    reads, writes = op.traffic
    with rt.lock:
        deps = [(ev.eq, ev.last_reset_sig + 1) for ev in op.waits]
        sig, rst, fn = op.signal, op.reset, op.fn
        used = list(_op_events(op))
        for ev in used:
            ev.refs += 1   # the device references it until this operation ran (zeEventDestroy)
        kernel = op.kernel
        if kernel is not None:
            kernel.f["refs"] += 1   # likewise (zeKernelDestroy)
        memory = op.memory
        for a in memory:
            rt.alloc_refs[a] = rt.alloc_refs.get(a, 0) + 1   # likewise (zeMemFree)
        if owner is not None:
            owner.submitted += 1
        if sig is not None:
            sig.sig_submitted += 1
            used.remove(sig)        # (released as the signal becomes visible: _device_signal)
        if rst is not None:
            rst.last_reset_sig = rst.sig_submitted

        def release(start):
            # The device is done with the list, the kernel and the other events: released
            # before the signal, since a host thread that sees it may destroy them at once.
            with rt.lock:
                if meters:
                    _ze_counters.account(meters, group, start, _ze_counters.now_us(), reads, writes)
                for ev in used:
                    ev.refs -= 1
                if kernel is not None:
                    kernel.f["refs"] -= 1
                for a in memory:
                    n = rt.alloc_refs[a] - 1
                    if n:
                        rt.alloc_refs[a] = n
                    else:
                        del rt.alloc_refs[a]   # bounded by the operations not yet run
                if owner is not None:
                    owner.finished += 1

        def run():
            start = _ze_counters.now_us() - int(core.delay_s * 1e6) if meters else 0   # the engine slept first
            released = signalled = False
            try:
                if fn is not None:
                    fn()
                if rst is not None:
                    rst.signaled = False
                released = True
                release(start)
                if sig is not None:
                    signalled = True
                    _device_signal(rt, sig)
            finally:
                if not released:
                    release(start)
                if sig is not None and not signalled:
                    with rt.lock:
                        sig.refs -= 1
        # Always a "work" operation: the engine runs markers with its lock held, and
        # signalling an event takes that lock.
        queue.submit(run, deps, True)


def _events(rt, hSignalEvent, numWaitEvents, phWaitEvents):
    """(signal event or None, wait events) or an error code."""
    sig = None
    if hSignalEvent:
        sig = rt.get(hSignalEvent, "event")
        if sig is None:
            return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    waits = []
    if numWaitEvents:
        if not phWaitEvents:
            return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
        for i in range(numWaitEvents):
            ev = rt.get(phWaitEvents[i], "event")
            if ev is None:
                return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
            waits.append(ev)
    return sig, tuple(waits)


def _op_events(op: _Op) -> tuple:
    extra = tuple(ev for ev in (op.signal, op.reset) if ev is not None)
    return op.waits + extra if extra else op.waits


def _append(rt: _Runtime, hCommandList, op: _Op, memory=()) -> int:
    cl = rt.get(hCommandList, "cmdlist")
    if cl is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    for ev in _op_events(op):
        # ze_api.h, zeCommandListAppend*: "The application must ensure the events are accessible by
        # the device on which the command list was created" and "the command list and events were
        # created on the same context".
        if ev.pool.context is not cl.ctx or not ev.pool.visible_to(cl.device):
            return rt.C.ZE_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT
    for a in memory:
        # ze_api.h, zeCommandListAppendMemoryCopy/Fill: "... and the memory was allocated, on the
        # same context."
        if rt.alloc_ctx.get(a.base) is not cl.ctx:
            return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    op.memory = tuple(memory)
    if cl.immediate:
        _submit(rt, cl.queue, op, cl.device, cl.ordinal, owner=cl)
    else:
        if cl.closed:
            return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
        cl.ops.append(op)
    return 0


def _usm(rt: _Runtime, addr: int, size: int):
    """The live USM allocation holding [addr, addr+size), or None (pageable or out of range)."""
    a = rt.memory.find(addr)
    if a is None or addr + size > a.base + a.size:
        return None
    return a


def _checked_range(rt: _Runtime, addr: int, size: int, what: str, expected=None) -> None:
    # At execution: the memory must still be allocated (a freed buffer means a backend bug), and
    # be the allocation the command was appended with, not a later one at a reused address.
    a = _usm(rt, addr, size)
    if a is None or (expected is not None and a is not expected):
        raise RuntimeError(f"{what} touches {size} bytes at {addr:#x}, outside every live allocation "
                           "it was appended with (freed while queued work still used it?)")


def zeCommandListAppendMemoryCopy(hCommandList, dstptr, srcptr, size, hSignalEvent, numWaitEvents, phWaitEvents):
    rt, rc = _ready()
    if rc:
        return rc
    got = _events(rt, hSignalEvent, numWaitEvents, phWaitEvents)
    if isinstance(got, int):
        return got
    sig, waits = got
    dst, src = _addr(dstptr), _addr(srcptr)
    if not dst or not src:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if size and dst < src + size and src < dst + size:
        # ze_api.h, ZE_RESULT_ERROR_OVERLAPPING_REGIONS: "copy operations do not support
        # overlapping regions of memory" (zeCommandListAppendMemoryCopy's entry is silent:
        # refused with that code, for USM and virtual memory alike).
        return rt.C.ZE_RESULT_ERROR_OVERLAPPING_REGIONS
    memory = ()
    if size:
        memory = (_usm(rt, dst, size), _usm(rt, src, size))
        traffic = (size if _is_device_memory(memory[1]) else 0, size if _is_device_memory(memory[0]) else 0)
        if None in memory and rt.vmm.reservations:
            return _vmm_copy(rt, hCommandList, dst, src, size, memory, waits, sig, traffic)
        if None in memory:
            return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT   # not device-accessible USM memory

    def copy():
        if size:
            _checked_range(rt, src, size, "memory copy source", memory[1])
            _checked_range(rt, dst, size, "memory copy destination", memory[0])
            ffi.memmove(_memory.char_ptr(dst), _memory.char_ptr(src), size)
    return _append(rt, hCommandList, _Op(copy, waits, sig, label=f"copy {size}",
                                         traffic=traffic if size else (0, 0)), memory)


def zeCommandListAppendMemoryFill(hCommandList, ptr, pattern, pattern_size, size, hSignalEvent,
                                  numWaitEvents, phWaitEvents):
    rt, rc = _ready()
    if rc:
        return rc
    got = _events(rt, hSignalEvent, numWaitEvents, phWaitEvents)
    if isinstance(got, int):
        return got
    sig, waits = got
    dst = _addr(ptr)
    if not dst or not pattern:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    cl = rt.get(hCommandList, "cmdlist")
    # ze_api.h: "The pattern size must be a power-of-two and less than or equal to
    # ze_command_queue_group_properties_t.maxMemoryFillPatternSize" -- of the list's queue group.
    most = _fill_pattern_max(cl.ordinal) if cl is not None else 16
    if pattern_size == 0 or pattern_size & (pattern_size - 1) or pattern_size > most:
        return rt.C.ZE_RESULT_ERROR_INVALID_SIZE
    if size % pattern_size:
        return rt.C.ZE_RESULT_ERROR_INVALID_SIZE
    memory = (_usm(rt, dst, size),) if size else ()
    pat = bytes(ffi.buffer(ffi.cast("char *", pattern), pattern_size))   # read at append time
    if None in memory and rt.vmm.reservations:
        region = _vmm_range(rt, dst, size, True)
        if region is not None:
            data = pat * (size // pattern_size)
            return _vmm_append(rt, hCommandList, [(dst, region)], lambda: ffi.buffer(
                _memory.char_ptr(dst), size).__setitem__(slice(None), data), waits, sig, f"fill {size}", (),
                traffic=(0, size))
    if None in memory:
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT

    def fill():
        if size:
            _checked_range(rt, dst, size, "memory fill", memory[0])
            ffi.buffer(_memory.char_ptr(dst), size)[:] = pat * (size // pattern_size)
    return _append(rt, hCommandList, _Op(fill, waits, sig, label=f"fill {size}", traffic=(0, size)), memory)


def _vmm_copy(rt, hCommandList, dst, src, size, memory, waits, sig, traffic=(0, 0)):
    """A copy with a side in virtual memory (the other a USM allocation, or virtual memory too)."""
    sides, usm = [], []
    for addr, a, write in ((dst, memory[0], True), (src, memory[1], False)):
        if a is not None:
            usm.append(a)
            continue
        region = _vmm_range(rt, addr, size, write)
        if region is None:
            return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT      # neither USM nor virtual memory
        sides.append((addr, region))
    return _vmm_append(rt, hCommandList, sides, lambda: ffi.memmove(_memory.char_ptr(dst), _memory.char_ptr(src),
                                                                     size), waits, sig, f"copy {size}", tuple(usm),
                       usm_ranges=((dst, memory[0]), (src, memory[1])), size=size, traffic=traffic)


def _vmm_append(rt, hCommandList, sides, work, waits, sig, label, usm, usm_ranges=(), size=0, traffic=(0, 0)):
    """Append ``work`` touching virtual memory ``sides`` [(addr, Region | why)].  An access to an
    unmapped or inaccessible page is appended and faults when it runs (the device's page fault:
    the device is lost); the mappings are checked again when it runs, under the space's lock
    (zeVirtualMemUnmap does not wait for queued work)."""
    cl = rt.get(hCommandList, "cmdlist")
    if cl is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    for addr, _region in sides:
        if not _reservation_ctx(rt, addr, cl.ctx):
            return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    lock = rt.vmm.lock

    def run():
        with lock.shared():
            for addr, region in sides:
                why = region if region.__class__ is str else region.problem()
                if why:
                    raise RuntimeError(f"{label}: page fault at 0x{addr:x}: {why}")
            for addr, a in usm_ranges:
                if a is not None:
                    _checked_range(rt, addr, size, label, a)
            work()
    return _append(rt, hCommandList, _Op(run, waits, sig, label=label, traffic=traffic), usm)


def zeCommandListAppendSignalEvent(hCommandList, hEvent):
    rt, rc = _ready()
    if rc:
        return rc
    ev = rt.get(hEvent, "event")
    if ev is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    return _append(rt, hCommandList, _Op(None, (), ev, work=False, label="signal"))


def zeCommandListAppendWaitOnEvents(hCommandList, numEvents, phEvents):
    rt, rc = _ready()
    if rc:
        return rc
    got = _events(rt, None, numEvents, phEvents)
    if isinstance(got, int):
        return got
    return _append(rt, hCommandList, _Op(None, got[1], work=False, label="wait"))


def zeCommandListAppendEventReset(hCommandList, hEvent):
    rt, rc = _ready()
    if rc:
        return rc
    ev = rt.get(hEvent, "event")
    if ev is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    return _append(rt, hCommandList, _Op(None, (), None, ev, work=False, label="reset"))


def zeCommandListAppendBarrier(hCommandList, hSignalEvent, numWaitEvents, phWaitEvents):
    rt, rc = _ready()
    if rc:
        return rc
    got = _events(rt, hSignalEvent, numWaitEvents, phWaitEvents)
    if isinstance(got, int):
        return got
    return _append(rt, hCommandList, _Op(None, got[1], got[0], work=False, label="barrier"))


def zeCommandListHostSynchronize(hCommandList, timeout):
    rt, rc = _ready()
    if rc:
        return rc
    if rt.zcfg.api_version < (1, 6):
        # zeCommandListHostSynchronize is Level Zero API 1.6: an older driver's DDI table has no
        # pfnHostSynchronize. Loader source/lib/ze_libapi.cpp: a null entry after init returns
        # ZE_RESULT_ERROR_UNSUPPORTED_FEATURE (the multi-driver intercept in ze_ldrddi.cpp returns
        # ZE_RESULT_ERROR_UNINITIALIZED instead), whatever the loader's own version.
        return rt.C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE
    cl = rt.get(hCommandList, "cmdlist")
    if cl is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if not cl.immediate:
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    q = cl.queue
    target = q.enqueued
    return _host_wait(rt, lambda: q.done >= target or rt.lost is not None, timeout, q.cv,
                      "zeCommandListHostSynchronize")


def zeCommandQueueCreate(hContext, hDevice, desc, phCommandQueue):
    rc, rt, dev = _queue_target(hContext, hDevice, desc.stype, "ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC",
                                desc.ordinal)
    if rc:
        return rc
    C = rt.C
    if desc.flags & C.ZE_COMMAND_QUEUE_FLAG_IN_ORDER:
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT   # IN_ORDER is for immediate command lists only
    cq = rt._add(_CmdQueue(rt.get(hContext, "context"), dev, rt.engine.queue(f"xpu{dev.ordinal}-queue"),
                           desc.ordinal))
    phCommandQueue[0] = cq.key
    return 0


def zeCommandQueueDestroy(hCommandQueue):
    rt, rc = _ready()
    if rc:
        return rc
    cq = rt.get(hCommandQueue, "cmdqueue")
    if cq is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if not cq.queue.idle():
        return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    rt._forget(cq)
    rt.engine.close_later(cq.queue)
    return 0


def zeCommandQueueExecuteCommandLists(hCommandQueue, numCommandLists, phCommandLists, hFence):
    rt, rc = _ready()
    if rc:
        return rc
    C = rt.C
    cq = rt.get(hCommandQueue, "cmdqueue")
    if cq is None:
        return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if numCommandLists == 0:
        return C.ZE_RESULT_ERROR_INVALID_SIZE
    if hFence:
        return C.ZE_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT   # fences are not simulated
    with rt.lock:   # checked and marked as referenced in one step (two threads may execute at once)
        lists = _executable(rt, cq, numCommandLists, phCommandLists)
        if isinstance(lists, int):
            return lists
        for cl in lists:
            # ze_api.h: "The application must ensure the device is not currently referencing
            # the command list": referenced from here on, so a second execute meanwhile (another
            # thread, or the same list twice in this call) is refused by _busy.
            cl.executing = (cq.queue, _SUBMITTING)
    for cl in lists:
        for op in cl.ops:
            _submit(rt, cq.queue, op, cq.device, cq.ordinal)
        cl.executing = (cq.queue, cq.queue.enqueued)
    return 0


_SUBMITTING = float("inf")   # cl.executing's last sequence number while its operations are being submitted


def _executable(rt, cq, numCommandLists, phCommandLists):
    """The lists to execute on ``cq``, or the code refusing them (caller holds ``rt.lock``)."""
    C = rt.C
    lists = []
    for i in range(numCommandLists):
        cl = rt.get(phCommandLists[i], "cmdlist")
        if cl is None:
            return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
        if cl.immediate:
            return C.ZE_RESULT_ERROR_INVALID_COMMAND_LIST_TYPE
        # ze_api.h, zeCommandQueueExecuteCommandLists: the lists must be closed, created for the
        # queue's ordinal, and "the command queue, command list and fence were created on the same
        # context".
        if not cl.closed or cl.ordinal != cq.ordinal or cl.device is not cq.device or cl.ctx is not cq.ctx:
            return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
        if _busy(cl) or cl in lists:
            return C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE   # still referenced by a submission (or twice here)
        for op in cl.ops:
            # An event destroyed after it was recorded into the list: the device would use freed
            # driver memory. The documents are silent; the simulator refuses.
            if any(not ev.live for ev in _op_events(op)):
                return C.ZE_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT
            # Likewise a kernel destroyed after its launch was recorded: the documents are silent;
            # refused with the code any call gives a destroyed kernel handle.
            if op.kernel is not None and not op.kernel.live:
                return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
            # And memory freed after the command was recorded (zeMemFree: the device must not
            # reference freed memory); at run it would touch whatever now lives at that address.
            # The documents name no code: refused with INVALID_ARGUMENT, as foreign memory is.
            if any(not a.live for a in op.memory):
                return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
        lists.append(cl)
    return lists


def zeCommandQueueSynchronize(hCommandQueue, timeout):
    rt, rc = _ready()
    if rc:
        return rc
    cq = rt.get(hCommandQueue, "cmdqueue")
    if cq is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    q = cq.queue
    target = q.enqueued
    return _host_wait(rt, lambda: q.done >= target or rt.lost is not None, timeout, q.cv,
                      "zeCommandQueueSynchronize")


# -- Sysman -------------------------------------------------------------------------------------------

def _card_of(obj) -> _Card:
    return obj if obj.kind == "card" else obj.card


def zesDeviceGetProperties(hDevice, props):
    rt, dev, rc = _sysman(hDevice)
    if rc:
        return rc
    C = rt.C
    if props.stype != C.ZES_STRUCTURE_TYPE_DEVICE_PROPERTIES:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    card = _card_of(dev)
    props.core.stype = C.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES
    rc = _write_core_properties(rt, props.core, card.uuid, False, 0, card.tiles)
    if rc:
        return rc
    props.numSubdevices = card.tiles if card.tiles > 1 else 0
    props.serialNumber = b"unknown"
    props.boardNumber = b"unknown"
    props.brandName = b"Intel(R) Corporation (simulated)"
    props.modelName = core.config().name.encode()[:63]
    props.vendorName = b"Intel(R) Corporation"
    props.driverVersion = b"1.3.29735 (accel.sim)"
    return 0


def zesDeviceEnumMemoryModules(hDevice, pCount, phMemory):
    rt, dev, rc = _sysman(hDevice)
    if rc:
        return rc
    return _fill(pCount, phMemory, _card_of(dev).modules)


def zesMemoryGetProperties(hMemory, props):
    rt, mod, rc = _sysman(hMemory)
    if rc:
        return rc
    C = rt.C
    if mod.kind != "memmodule":
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if props.stype != C.ZES_STRUCTURE_TYPE_MEM_PROPERTIES:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    props.type = C.ZES_MEM_TYPE_HBM if mod.location == C.ZES_MEM_LOC_DEVICE else C.ZES_MEM_TYPE_DDR5
    props.onSubdevice = 1 if mod.tile is not None else 0
    props.subdeviceId = mod.tile or 0
    props.location = mod.location
    props.physicalSize = core.config().memory if mod.location == C.ZES_MEM_LOC_DEVICE else 64 << 30
    props.busWidth = -1
    props.numChannels = -1
    return 0


def zesMemoryGetState(hMemory, st):
    rt, mod, rc = _sysman(hMemory)
    if rc:
        return rc
    C = rt.C
    if mod.kind != "memmodule":
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if st.stype != C.ZES_STRUCTURE_TYPE_MEM_STATE:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    st.health = C.ZES_MEM_HEALTH_OK
    if mod.location != C.ZES_MEM_LOC_DEVICE:
        st.size, st.free = 64 << 30, 48 << 30
        return 0
    size = core.config().memory
    tiles = [mod.tile] if mod.tile is not None else list(range(mod.card.tiles))
    used = sum(mod.card.tile_used[t] for t in tiles)
    st.size = size
    st.free = max(size - used, 0)
    return 0


# Readings (simulated values).  Sysman reads sensors and clocks of the hardware; the simulator
# has neither.  A card is *busy* while a command list or queue of the simulated driver on it has
# work queued or running at the moment of the query (the same model as accel/sim/nvml.py), and:
#
#   reading (call)                                         idle     busy
#   temperature, C (zesTemperatureGetState, ZES_TEMP_SENSORS_GPU)  35   65
#   GPU frequency, MHz (zesFrequencyGetState .actual)      300      1600 (coreClockRate)
#
# Each card has one GPU temperature sensor and one GPU frequency domain (min 300, max 1600 MHz).
# zesDeviceProcessesGetState lists this process on each card a core device of zeInit stands for,
# using the card's allocated device memory (what zesMemoryGetState counts as used).

_TEMP_IDLE, _TEMP_BUSY = 35.0, 65.0
_FREQ_MIN, _FREQ_MAX = 300.0, 1600.0
_ENGINE_TYPE_FLAG_COMPUTE = 1 << 1     # zes_api.h, zes_engine_type_flag_t (not in the bindings)


def card_busy(card: _Card) -> bool:
    """True while a command list or queue on ``card`` has work queued or running."""
    rt = _rt
    if rt is None:
        return False
    for _ in range(8):      # another thread may create or destroy objects meanwhile
        try:
            objs = list(rt.objects.values())
            break
        except RuntimeError:
            continue
    else:
        return False
    for obj in objs:
        if obj.kind in ("cmdlist", "cmdqueue") and obj.live and obj.device.card is card and obj.queue is not None:
            if not obj.queue.idle():
                return True
    return False


def zesDeviceEnumTemperatureSensors(hDevice, pCount, phTemperature):
    rt, dev, rc = _sysman(hDevice)
    if rc:
        return rc
    if dev.kind not in ("card", "device"):
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    return _fill(pCount, phTemperature, _card_of(dev).sensors)


def zesTemperatureGetProperties(hTemperature, pProperties):
    rt, part, rc = _sysman(hTemperature)
    if rc:
        return rc
    C = rt.C
    if part.kind != "tempsensor":
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if not pProperties:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if pProperties.stype != C.ZES_STRUCTURE_TYPE_TEMP_PROPERTIES:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    pProperties.type = C.ZES_TEMP_SENSORS_GPU
    pProperties.onSubdevice = 0
    pProperties.subdeviceId = 0
    pProperties.maxTemperature = 105.0
    pProperties.isCriticalTempSupported = 0
    pProperties.isThreshold1Supported = 0
    pProperties.isThreshold2Supported = 0
    return 0


def zesTemperatureGetState(hTemperature, pTemperature):
    rt, part, rc = _sysman(hTemperature)
    if rc:
        return rc
    if part.kind != "tempsensor":
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if not pTemperature:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    pTemperature[0] = _TEMP_BUSY if card_busy(part.card) else _TEMP_IDLE
    return 0


def zesDeviceEnumFrequencyDomains(hDevice, pCount, phFrequency):
    rt, dev, rc = _sysman(hDevice)
    if rc:
        return rc
    if dev.kind not in ("card", "device"):
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    return _fill(pCount, phFrequency, _card_of(dev).freqs)


def zesFrequencyGetProperties(hFrequency, pProperties):
    rt, part, rc = _sysman(hFrequency)
    if rc:
        return rc
    C = rt.C
    if part.kind != "freqdomain":
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if not pProperties:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if pProperties.stype != C.ZES_STRUCTURE_TYPE_FREQ_PROPERTIES:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    pProperties.type = C.ZES_FREQ_DOMAIN_GPU
    pProperties.onSubdevice = 0
    pProperties.subdeviceId = 0
    pProperties.canControl = 0
    pProperties.isThrottleEventSupported = 0
    pProperties.min = _FREQ_MIN
    pProperties.max = _FREQ_MAX
    return 0


def zesFrequencyGetState(hFrequency, pState):
    rt, part, rc = _sysman(hFrequency)
    if rc:
        return rc
    C = rt.C
    if part.kind != "freqdomain":
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if not pState:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if pState.stype != C.ZES_STRUCTURE_TYPE_FREQ_STATE:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    actual = _FREQ_MAX if card_busy(part.card) else _FREQ_MIN
    pState.currentVoltage = -1.0      # zes_api.h: negative = not known
    pState.request = actual
    pState.tdp = _FREQ_MAX
    pState.efficient = _FREQ_MIN
    pState.actual = actual
    pState.throttleReasons = 0
    return 0


def zesDeviceProcessesGetState(hDevice, pCount, pProcesses):
    rt, dev, rc = _sysman(hDevice)
    if rc:
        return rc
    C = rt.C
    if dev.kind not in ("card", "device"):
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if not pCount:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    card = _card_of(dev)
    procs = []
    if rt.initialized and any(d.card is card for d in rt.devices):
        procs.append((os.getpid(), sum(card.tile_used)))
    # zes_api.h: *pCount 0 asks for the count; a larger count is lowered to the number of
    # processes; a smaller one gets that many and ZE_RESULT_ERROR_INVALID_SIZE.
    n = pCount[0]
    if n == 0:
        pCount[0] = len(procs)
        return 0
    if not pProcesses:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    for k, (pid, mem) in enumerate(procs[:n]):
        st = pProcesses[k]
        if st.stype != C.ZES_STRUCTURE_TYPE_PROCESS_STATE:
            return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
        st.processId = pid
        st.memSize = mem
        st.sharedSize = 0
        st.engines = _ENGINE_TYPE_FLAG_COMPUTE
    if n < len(procs):
        return C.ZE_RESULT_ERROR_INVALID_SIZE
    pCount[0] = len(procs)
    return 0


# Counters (zesEngineGetActivity, zesMemoryGetBandwidth, zesPowerGetEnergyCounter): the model is in
# accel/sim/_ze_counters.py.  Each card lists engine groups ALL, COMPUTE_ALL and COPY_ALL and power
# domains card-wide on a one-tile card, else per tile (onSubdevice), and its own card-level power domain
# first; zesDeviceGetCardPowerDomain returns that one.

_ENGINE_GROUP = {"all": "ZES_ENGINE_GROUP_ALL", "compute": "ZES_ENGINE_GROUP_COMPUTE_ALL",
                 "copy": "ZES_ENGINE_GROUP_COPY_ALL"}


def _component(handle, kind: str):
    """(runtime, component, 0) or (None, None, code) for a Sysman component of ``kind``."""
    rt, obj, rc = _sysman(handle)
    if rc:
        return None, None, rc
    if obj.kind != kind:
        return None, None, rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    return rt, obj, 0


def zesDeviceEnumEngineGroups(hDevice, pCount, phEngine):
    rt, dev, rc = _sysman(hDevice)
    if rc:
        return rc
    if dev.kind not in ("card", "device"):
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if not pCount:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    return _fill(pCount, phEngine, _card_of(dev).engines)


def zesEngineGetProperties(hEngine, pProperties):
    rt, eng, rc = _component(hEngine, "engine")
    if rc:
        return rc
    C = rt.C
    if not pProperties:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if pProperties.stype != C.ZES_STRUCTURE_TYPE_ENGINE_PROPERTIES:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    pProperties.type = getattr(C, _ENGINE_GROUP[eng.group])
    pProperties.onSubdevice = 0 if eng.tile is None else 1
    pProperties.subdeviceId = eng.tile or 0
    return 0


def zesEngineGetActivity(hEngine, pStats):
    rt, eng, rc = _component(hEngine, "engine")
    if rc:
        return rc
    if not pStats:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    with rt.lock:
        meters = eng.meters()
        # zes_engine_stats_t: activeTime, "monotonic counter for time in microseconds that this
        # resource is actively running workloads"; the card-wide group of a one-tile card is its tile
        pStats.activeTime = sum(m.active[eng.group] for m in meters) // len(meters)
        pStats.timestamp = _ze_counters.now_us()
    return 0


def zesMemoryGetBandwidth(hMemory, pBandwidth):
    rt, mod, rc = _component(hMemory, "memmodule")
    if rc:
        return rc
    C = rt.C
    if not pBandwidth:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if mod.location != C.ZES_MEM_LOC_DEVICE:
        # System memory traffic is not simulated; zes_api.h lists no code for a module without
        # bandwidth counters: the simulator refuses with the generic one.
        return C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE
    with rt.lock:
        meters = mod.card.meters if mod.tile is None else [mod.card.meters[mod.tile]]
        pBandwidth.readCounter = sum(m.read for m in meters)
        pBandwidth.writeCounter = sum(m.write for m in meters)
        pBandwidth.maxBandwidth = _ze_counters.MAX_BANDWIDTH * len(meters)
        pBandwidth.timestamp = _ze_counters.now_us()
    return 0


def zesDeviceEnumPowerDomains(hDevice, pCount, phPower):
    rt, dev, rc = _sysman(hDevice)
    if rc:
        return rc
    if dev.kind not in ("card", "device"):
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if not pCount:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    return _fill(pCount, phPower, _card_of(dev).powers)


def zesDeviceGetCardPowerDomain(hDevice, phPower):
    rt, dev, rc = _sysman(hDevice)
    if rc:
        return rc
    if dev.kind not in ("card", "device"):
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if not phPower:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    phPower[0] = _card_of(dev).powers[0].key     # "power domain handle for the entire PCIe card"
    return 0


def zesPowerGetProperties(hPower, pProperties):
    rt, pwr, rc = _component(hPower, "power")
    if rc:
        return rc
    C = rt.C
    if not pProperties:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if pProperties.stype != C.ZES_STRUCTURE_TYPE_POWER_PROPERTIES:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    pProperties.onSubdevice = 0 if pwr.tile is None else 1
    pProperties.subdeviceId = pwr.tile or 0
    pProperties.canControl = 0
    pProperties.isEnergyThresholdSupported = 0
    pProperties.defaultLimit = -1        # zes_api.h: (deprecated) -1 = not known
    pProperties.minLimit = -1
    pProperties.maxLimit = -1
    return 0


def zesPowerGetEnergyCounter(hPower, pEnergy):
    rt, pwr, rc = _component(hPower, "power")
    if rc:
        return rc
    if not pEnergy:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    with rt.lock:
        now = _ze_counters.now_us()
        # zes_power_energy_counter_t: energy, "the monotonic energy counter in microjoules"
        pEnergy.energy = _ze_counters.energy_uj(pwr.meters(), pwr.card.tiles, pwr.card.t0, now)
        pEnergy.timestamp = now
    return 0


# -- virtual memory (zeVirtualMem*, zePhysicalMem*) ---------------------------------------------
# Level Zero specification, "Virtual Memory Management" (ze_api.h, the entry of each function).
# Reservations, physical pages and mappings are accel.sim._vmm's (real host address ranges, pages
# of a per-device memory file charged to the device).  Access is one attribute per mapping for
# the whole context (zeVirtualMemMap / zeVirtualMemSetAccessAttribute take no device), kept
# under the accessor key _CTX_ACCESS.

_CTX_ACCESS = -1
_ZE_ACCESS = {0: None, 1: "rw", 2: "r"}      # ZE_MEMORY_ACCESS_ATTRIBUTE_NONE / _READWRITE / _READONLY
_ZE_ACCESS_VALUES = {None: 0, "rw": 1, "r": 2}


def _vmm_code(rt, kind: str) -> int:
    C = rt.C
    return {"invalid": C.ZE_RESULT_ERROR_INVALID_ARGUMENT, "oom": C.ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY,
            "in_use": C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE,
            "unsupported": C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE}[kind]


def _vmm_ready(hContext):
    """(runtime, context, 0) or (None, None, code)."""
    rt, rc = _ready()
    if rc:
        return None, None, rc
    ctx = rt.get(hContext, "context")
    if ctx is None:
        return None, None, rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if not _vmm.supported():
        return None, None, rt.C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE
    return rt, ctx, 0


def _page_aligned(*values) -> bool:
    return all(v % _vmm.GRANULARITY == 0 for v in values)


def _reservation_ctx(rt, addr: int, ctx) -> bool:
    # ze_api.h, zeVirtualMemReserve / zeVirtualMemMap: "The application must only use the memory
    # allocation on the context for which it was created."
    r = rt.vmm.reservation_of(addr)
    return r is not None and rt.vmm_ctx.get(r.base) is ctx


def zeVirtualMemQueryPageSize(hContext, hDevice, size, pagesize):
    rt, ctx, rc = _vmm_ready(hContext)
    if rc:
        return rc
    if rt.get(hDevice, "device") is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if not pagesize:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if size == 0:
        return rt.C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE
    pagesize[0] = _vmm.GRANULARITY
    return 0


def zeVirtualMemReserve(hContext, pStart, size, pptr):
    rt, ctx, rc = _vmm_ready(hContext)
    if rc:
        return rc
    C = rt.C
    # ze_api.h, zeVirtualMemReserve @returns: ZE_RESULT_ERROR_INVALID_NULL_POINTER for
    # `nullptr == pStart` (the prose calls a null start "implementation chooses"; the stricter
    # reading is enforced: pass a page-aligned hint) and `nullptr == pptr`; UNSUPPORTED_SIZE for
    # 0 == size; "The starting address and size must be page aligned".  A hint that is taken is
    # only a hint ("If not available then will find another suitable starting address").
    if not pStart or not pptr:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if size == 0:
        return C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE
    if not _page_aligned(size, _addr(pStart)):
        return C.ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT
    try:
        base = rt.vmm.reserve(size, _vmm.GRANULARITY)
    except _vmm.VmmError:
        return C.ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY
    rt.vmm_ctx[base] = ctx
    pptr[0] = ffi.cast("void *", base)
    return 0


def zeVirtualMemFree(hContext, ptr, size):
    rt, ctx, rc = _vmm_ready(hContext)
    if rc:
        return rc
    C = rt.C
    base = _addr(ptr)
    if not base:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if size == 0:
        return C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE
    if not _page_aligned(base, size):
        return C.ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT
    # The context entry goes before the range does (and comes back if the free fails): once
    # free, the range may be another thread's next reservation, whose entry must survive.
    with rt.lock:
        if rt.vmm_ctx.get(base) is not ctx:
            return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
        del rt.vmm_ctx[base]
    # ze_api.h, zeVirtualMemFree: "Any existing virtual mappings for the range will be unmapped"
    # (the physical objects stay).  Freeing part of a reservation is not described: refused.
    try:
        rt.vmm.free(base, size, unmap=True)
    except _vmm.VmmError as exc:
        rt.vmm_ctx[base] = ctx
        return _vmm_code(rt, exc.kind)
    return 0


def zePhysicalMemCreate(hContext, hDevice, desc, phPhysicalMemory):
    rt, ctx, rc = _vmm_ready(hContext)
    if rc:
        return rc
    C = rt.C
    dev = rt.get(hDevice, "device")
    if dev is None:
        return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if not desc or not phPhysicalMemory:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    # ze_api.h, zePhysicalMemCreate: INVALID_ENUMERATION for 0x1 < desc->flags, UNSUPPORTED_SIZE for
    # 0 == desc->size; "The size must be page aligned" (UNSUPPORTED_ALIGNMENT); the memory counts
    # against the device (OUT_OF_DEVICE_MEMORY).
    if desc.stype != C.ZE_STRUCTURE_TYPE_PHYSICAL_MEM_DESC or desc.pNext:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION if desc.stype != C.ZE_STRUCTURE_TYPE_PHYSICAL_MEM_DESC \
            else C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if desc.flags > 0x1:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    size = desc.size
    if size == 0:
        return C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE
    if not _page_aligned(size):
        return C.ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT
    if core.take_oom():
        return C.ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY
    try:
        h = rt.vmm.create(dev.ordinal, size)
    except _vmm.VmmError as exc:
        return _vmm_code(rt, exc.kind)
    rt.vmm_handle_ctx[h] = ctx
    phPhysicalMemory[0] = ffi.cast("void *", h)
    return 0


def zePhysicalMemDestroy(hContext, hPhysicalMemory):
    rt, ctx, rc = _vmm_ready(hContext)
    if rc:
        return rc
    h = _addr(hPhysicalMemory)
    if not h:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    with rt.lock:                  # forgotten first, as in zeVirtualMemFree
        if rt.vmm_handle_ctx.get(h) is not ctx:
            return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
        del rt.vmm_handle_ctx[h]
    # ze_api.h, zePhysicalMemDestroy: "The application must ensure the device is not currently
    # referencing the physical memory object before it is deleted" (ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE):
    # a mapped object is refused.
    try:
        rt.vmm.release(h, while_mapped=False)
    except _vmm.VmmError as exc:
        rt.vmm_handle_ctx[h] = ctx
        return _vmm_code(rt, exc.kind)
    return 0


def zeVirtualMemMap(hContext, ptr, size, hPhysicalMemory, offset, access):
    rt, ctx, rc = _vmm_ready(hContext)
    if rc:
        return rc
    C = rt.C
    base, h = _addr(ptr), _addr(hPhysicalMemory)
    if not h:
        return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if not base:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    # ze_api.h, zeVirtualMemMap: INVALID_ENUMERATION for READONLY < access; UNSUPPORTED_SIZE for
    # 0 == size; "The virtual address range must have been reserved using zeVirtualMemReserve";
    # "The virtual start address and size must be page aligned" (and the offset: "must be page
    # aligned").  Mapping over a live mapping is not described: refused (INVALID_ARGUMENT).
    if access > 2:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    if size == 0:
        return C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE
    if not _page_aligned(base, size, offset):
        return C.ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT
    if rt.vmm_handle_ctx.get(h) is not ctx or not _reservation_ctx(rt, base, ctx):
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    try:
        rt.vmm.map(base, size, h, offset, whole=False)
        flags = _ZE_ACCESS[access]
        if flags is not None:
            rt.vmm.set_access(base, size, [(_CTX_ACCESS, flags)])
    except _vmm.VmmError as exc:
        return _vmm_code(rt, exc.kind)
    finally:
        core.vmm_cost()
    return 0


def zeVirtualMemUnmap(hContext, ptr, size):
    rt, ctx, rc = _vmm_ready(hContext)
    if rc:
        return rc
    C = rt.C
    base = _addr(ptr)
    if not base:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if size == 0:
        return C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE
    if not _page_aligned(base):
        return C.ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT
    if not _page_aligned(size):
        return C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE      # ze_api.h: "Size must be page aligned"
    if not _reservation_ctx(rt, base, ctx):
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    # Unmapping part of a mapping is not described: refused (whole mappings only).  Like cuMemUnmap,
    # it does not wait: work still queued on the range faults when it runs.
    try:
        rt.vmm.unmap(base, size)
    except _vmm.VmmError as exc:
        return _vmm_code(rt, exc.kind)
    finally:
        core.vmm_cost()
    return 0


def zeVirtualMemSetAccessAttribute(hContext, ptr, size, access):
    rt, ctx, rc = _vmm_ready(hContext)
    if rc:
        return rc
    C = rt.C
    base = _addr(ptr)
    if not base:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if access > 2:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    if size == 0:
        return C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE
    if not _page_aligned(base, size):
        return C.ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT
    if not _reservation_ctx(rt, base, ctx):
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    try:
        rt.vmm.set_access(base, size, [(_CTX_ACCESS, _ZE_ACCESS[access])])
    except _vmm.VmmError as exc:
        return _vmm_code(rt, exc.kind)
    return 0


def zeVirtualMemGetAccessAttribute(hContext, ptr, size, access, outSize):
    rt, ctx, rc = _vmm_ready(hContext)
    if rc:
        return rc
    C = rt.C
    base = _addr(ptr)
    if not base or not access or not outSize:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if size == 0:
        return C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE
    if not _page_aligned(base, size):
        return C.ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT
    if not _reservation_ctx(rt, base, ctx):
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    m = rt.vmm.mapping_at(base)
    flags = m.access.get(_CTX_ACCESS) if m is not None else None
    access[0] = _ZE_ACCESS_VALUES[flags]
    # the length of the leading part of the range with the same attribute
    n = 0
    a = base
    while a < base + size:
        mm = rt.vmm.mapping_at(a)
        f = mm.access.get(_CTX_ACCESS) if mm is not None else None
        if f != flags:
            break
        step = (mm.end - a) if mm is not None else _vmm.GRANULARITY
        n += step
        a += step
    outSize[0] = min(n, size)
    return 0


def _vmm_range(rt, addr: int, size: int, write: bool):
    """For a copy or fill: None (not virtual memory), a _vmm.Region, or why it faults (str)."""
    if not rt.vmm.reservations:
        return None
    return rt.vmm.resolve(addr, size, _CTX_ACCESS, write)


# -- the library object ---------------------------------------------------------------------------------

#: Functions Debian's libze_loader 1.8.12 does not export.
NEW_LOADER_ONLY = ("zesInit", "zesDriverGet", "zesDeviceGet", "zeInitDrivers", "zeCommandListHostSynchronize")

_FUNCTIONS = (
    zeInit, zeDriverGet, zeDriverGetApiVersion, zeDriverGetProperties, zeDeviceGet, zeDeviceGetSubDevices,
    zeDeviceGetProperties, zeDeviceGetComputeProperties, zeDeviceGetModuleProperties,
    zeDeviceGetMemoryProperties, zeDeviceGetCommandQueueGroupProperties, zeDeviceGetGlobalTimestamps,
    zeContextCreate, zeContextDestroy, zeMemAllocDevice, zeMemAllocHost, zeMemFree, zeMemGetAllocProperties,
    zeEventPoolCreate, zeEventPoolDestroy, zeEventCreate, zeEventDestroy, zeEventHostSignal, zeEventHostReset,
    zeEventQueryStatus, zeEventHostSynchronize, zeEventQueryKernelTimestamp,
    zeCommandListCreateImmediate, zeCommandListCreate, zeCommandListDestroy, zeCommandListClose,
    zeCommandListReset, zeCommandListAppendMemoryCopy, zeCommandListAppendMemoryFill,
    zeCommandListAppendSignalEvent, zeCommandListAppendWaitOnEvents, zeCommandListAppendEventReset,
    zeCommandListAppendBarrier, zeCommandListHostSynchronize,
    zeCommandQueueCreate, zeCommandQueueDestroy, zeCommandQueueExecuteCommandLists, zeCommandQueueSynchronize,
    zesInit, zesDriverGet, zesDeviceGet, zesDeviceGetProperties, zesDeviceEnumMemoryModules,
    zesMemoryGetProperties, zesMemoryGetState,
    zeDeviceCanAccessPeer, zesDeviceEnumTemperatureSensors, zesTemperatureGetProperties, zesTemperatureGetState,
    zesDeviceEnumFrequencyDomains, zesFrequencyGetProperties, zesFrequencyGetState, zesDeviceProcessesGetState,
    zesDeviceEnumEngineGroups, zesEngineGetProperties, zesEngineGetActivity, zesMemoryGetBandwidth,
    zesDeviceEnumPowerDomains, zesDeviceGetCardPowerDomain, zesPowerGetProperties, zesPowerGetEnergyCounter,
    zeVirtualMemQueryPageSize, zeVirtualMemReserve, zeVirtualMemFree, zePhysicalMemCreate, zePhysicalMemDestroy,
    zeVirtualMemMap, zeVirtualMemUnmap, zeVirtualMemSetAccessAttribute, zeVirtualMemGetAccessAttribute,
)
from ._ze_kernels import FUNCTIONS as _KERNEL_FUNCTIONS   # noqa: E402 (modules, kernels, launches; issue 18)
_FUNCTIONS += _KERNEL_FUNCTIONS

#: ze_api.h: "The application must **not** call this function from simultaneous threads with the
#: same command list handle" (zeCommandListAppend*, Close, Reset, Destroy) / "... with the same
#: kernel handle" (zeKernelSetArgumentValue, zeKernelSetGroupSize) / "... with the same context
#: handle" (zeContextDestroy): function -> handle kind.
_ONE_THREAD = {name: "cmdlist" for name in (
    "zeCommandListAppendMemoryCopy", "zeCommandListAppendMemoryFill", "zeCommandListAppendSignalEvent",
    "zeCommandListAppendWaitOnEvents", "zeCommandListAppendEventReset", "zeCommandListAppendBarrier",
    "zeCommandListAppendLaunchKernel", "zeCommandListClose", "zeCommandListReset", "zeCommandListDestroy")}
_ONE_THREAD.update(zeKernelSetArgumentValue="kernel", zeKernelSetGroupSize="kernel")
# zeContextDestroy: "The application must **not** call this function from simultaneous threads
# with the same context handle" (the second destroyed the context under the first).
_ONE_THREAD.update(zeContextDestroy="context")


def _claim(handle, kind: str):
    """(object, 0) when the calling thread now holds ``handle`` (release with :func:`_release`);
    (None, 0) to call freely (no such live handle: the function says so; or this thread is
    already inside a call on it -- a command run inline signals and its waiter destroys);
    (None, HANDLE_OBJECT_IN_USE) while another thread is inside a call on it (the documents
    name no code; the call is refused and changes nothing)."""
    rt = _rt
    obj = rt.get(handle, kind) if rt is not None else None
    if obj is None:
        return None, 0
    busy, me = rt.busy, threading.get_ident()
    if busy.get(obj) == me:
        return None, 0
    if busy.setdefault(obj, me) != me:   # atomic: one thread gets the handle
        return None, rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    return obj, 0


def _release(obj) -> None:
    rt = _rt
    if rt is not None:
        rt.busy.pop(obj, None)            # bounded by the calls in progress


_ONE_THREAD_BODY = """\
        obj, rc = _claim(a0, _kind)
        if rc:
            return rc
        if obj is None:
            return _fn({args})
        try:
            return _fn({args})
        finally:
            _release(obj)
"""


def _one_thread(fn, kind: str):
    """``fn`` (first parameter: a ``kind`` handle) refusing a second thread meanwhile (_ONE_THREAD)."""
    return core.exact_wrapper(fn.__name__, fn, _ONE_THREAD_BODY, globals(), _fn=fn, _kind=kind)


def open_ze():
    """The simulated ``libze_loader``: an object called like the cffi ``lib`` of the real one.

    Raises OSError when ``configure(cudart=...)``-style switches say the library is
    absent (never, today: the loader is always "installed"; no driver is
    ``configure(driver=False)`` or ``ACCEL_SIM_DEVICES=0``).
    """
    zcfg = ze_config()
    _runtime()
    funcs = {f.__name__: (_one_thread(f, _ONE_THREAD[f.__name__]) if f.__name__ in _ONE_THREAD else f)
             for f in _FUNCTIONS}
    if zcfg.loader == "1.8.12":
        for name in NEW_LOADER_ONLY:
            funcs.pop(name, None)
    return core.build_library("ze", funcs, constants=core.constants_of("_ze"))


open_library = open_ze
