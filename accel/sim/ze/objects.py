"""The simulated Level Zero loader's state: its settings (:class:`ZeConfig`, the environment,
:func:`configure_ze`), the objects behind handles (cards, devices, memory modules, events and
pools, command lists and queues), the runtime that holds them, its reset and fork, and
:func:`state`.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import asdict, dataclass, fields, replace
from typing import Dict, List, Optional, Tuple

from .. import _engine, _memory, _vmm, _ze_counters, core
from ..core import ffi


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
    __slots__ = ("pool", "index", "eq", "signaled", "sig_submitted", "last_reset_sig", "ts", "refs",
                 "signal_scope", "origin", "origin_cmd")

    def __init__(self, pool, index, eq, signal_scope=0):
        super().__init__("event")
        self.pool, self.index, self.eq = pool, index, eq
        # ze_event_desc_t.signal: the caches a device signal flushes (ze_event_scope_flag_t); and
        # where the latest executed signal came from: None (the host) or the command list whose
        # operation signalled (events.py, commands.py: the event-scope rules)
        self.signal_scope = signal_scope
        self.origin: Optional["_CmdList"] = None
        # (r69f) the command of a list without IN_ORDER whose execution signalled it last (a
        # commands._Rec, else None): a host that sees the signal is ordered after that command and
        # what the list orders before it (commands.py, "lists without IN_ORDER")
        self.origin_cmd = None
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
                 "submitted", "finished", "order")

    def __init__(self, ctx, device, immediate, queue, in_order, ordinal):
        super().__init__("cmdlist")
        self.submitted = self.finished = 0     # operations of an immediate list: appended, run
        self.ctx, self.device, self.immediate, self.queue = ctx, device, immediate, queue
        self.ops: list = []
        self.closed = False
        self.in_order = in_order
        # (r69f) without IN_ORDER: what orders its commands (commands._Order), else None
        self.order = None
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
        # (r73c) event / command list / queue -> host threads inside a synchronize on it (events.py,
        # _host_waiting): a destroy meanwhile is refused; bounded by the calls in progress
        self.host_waits: Dict[_Obj, int] = {}

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
