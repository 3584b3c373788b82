"""Shared machinery of the simulated vendor libraries.

* :class:`Config` — what is simulated (device count, memory per device,
  compute capability, per-op latency, which libraries "exist"), read from the
  ``ACCEL_SIM_*`` environment when a simulated library is first opened, with
  :func:`configure` overrides for tests.
* Fault injection — :func:`inject_error` (a named call fails with a code) and
  :func:`inject_oom` (the Nth future allocation fails).
* Call counters and :func:`build_library`, which turns a dict of Python
  functions into an object that is called exactly like a cffi ``lib``.
* Reset and fork hooks: every simulated library registers a function that
  drops its state; :func:`reset` runs them all, and a forked child drops the
  parent's runtime state (its worker threads do not exist in the child).

Nothing here imports numpy or cffi's parser; ``ffi`` is a bare
``_cffi_backend.FFI()`` that knows the C primitive types only, which is all
the simulators need (structs and handles arrive as the caller's cdata).
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import threading
import time
from dataclasses import dataclass, fields, replace
from typing import Callable, Dict, List, Optional, Tuple

import _cffi_backend

#: Primitive-types-only FFI used for casts, buffers and memmove on any cdata.
ffi = _cffi_backend.FFI()

#: Longest any internal wait may block before it is treated as a simulator bug.
WAIT_TIMEOUT_S = 60.0

_GIB = 1 << 30


@dataclass(frozen=True)
class Config:
    """What the simulator pretends the machine has.

    ``devices`` physical devices of ``memory`` bytes each with compute
    capability ``compute_capability``; stream workers sleep ``delay_us``
    microseconds before each operation.  ``nvml``/``cudart`` False make
    opening that library fail like a missing shared library; ``driver``
    False simulates a runtime installed without a driver
    (cudaErrorInsufficientDriver, NVML_ERROR_DRIVER_NOT_LOADED).
    ``runtime_version`` is the simulated libcudart's CUDA version (it exposes
    exactly the functions of that real runtime: ``sim/cudart_symbols``) and
    ``driver_version`` the CUDA version the driver supports (NVML
    nvmlSystemGetCudaDriverVersion_v2, cudaDriverGetVersion), both as
    ``1000 * major + 10 * minor`` (13000, 12040).  ``runtimes`` are the
    libcudart versions installed side by side (a CUDA 12 wheel next to a
    CUDA 13 toolkit, say); accel's library choice picks one of them by the
    driver version and :func:`select_runtime` makes it the one opened.
    ``runtime_version`` is always one of them (the newest until a choice).
    ``vmm`` False makes the devices report no virtual memory management
    (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0, the cuMem* VMM calls
    CUDA_ERROR_NOT_SUPPORTED); ``vmm_cost_us`` is slept by every map and unmap
    (cuMemMap/cuMemUnmap, zeVirtualMemMap/Unmap), to make page remapping slow on purpose
    (env ``ACCEL_SIM_VMM_COST_US``).
    """

    devices: int = 2
    memory: int = 8 * _GIB
    compute_capability: Tuple[int, int] = (9, 0)
    delay_us: float = 0.0
    name: str = "Accel Simulated GPU"
    nvml: bool = True
    cudart: bool = True
    driver: bool = True
    runtime_version: int = 13000
    driver_version: int = 13000
    runtimes: Tuple[int, ...] = ()
    vmm: bool = True
    vmm_cost_us: float = 0.0
    #: (r71g) which pairs of physical devices are peer-capable: None every distinct pair (the
    #: default, as before), else the sorted pairs (a, b), a < b, that are (env ``ACCEL_SIM_PEER``:
    #: ``all``, ``none`` or ``0:1,2:3``); see :func:`peer_capable`.
    peer: Optional[Tuple[Tuple[int, int], ...]] = None
    #: (r71g) physical devices in ascending PCI bus id order (env ``ACCEL_SIM_PCI_ORDER``, e.g.
    #: ``1,0``); () is the identity.  See :func:`pci_bus` and :func:`pci_rank`.
    pci_order: Tuple[int, ...] = ()


#: Runtime versions the simulator can play: those with a committed export list.
RUNTIME_VERSIONS = (12040, 12080, 13000)


def parse_cuda_version(text, what: str) -> int:
    """``"12.4"`` / ``"13.0"`` / ``"12040"`` / 12040 -> 12040 (1000 * major + 10 * minor)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.match(r"^\s*(\d+)\.(\d+)\s*$", str(text))
        if m:
            value = 1000 * int(m.group(1)) + 10 * int(m.group(2))
        elif re.match(r"^\s*\d{4,6}\s*$", str(text)):
            value = int(text)
        else:
            raise ValueError(f"{what}={text!r} is not a CUDA version; use MAJOR.MINOR (e.g. '12.4') or "
                             f"1000*major+10*minor (e.g. 12040)")
    if value < 1000:
        raise ValueError(f"{what}={text!r} is not a CUDA version (1000*major+10*minor, e.g. 12040)")
    return value


def parse_cuda_versions(text, what: str) -> Tuple[int, ...]:
    """``"12.4,13.0"`` / ``"13.0"`` / 12040 / (12040, 13000) -> sorted distinct versions."""
    if isinstance(text, (tuple, list)):
        items = list(text)
    elif isinstance(text, str):
        items = [t for t in text.split(",") if t.strip()]
    else:
        items = [text]
    if not items:
        raise ValueError(f"{what}={text!r} names no CUDA version; use e.g. '12.4' or '12.4,13.0'")
    return tuple(sorted({parse_cuda_version(t, what) for t in items}))


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str, what: str = "size") -> int:
    """``"8G"``, ``"512M"``, ``"1.5GiB"``, ``"4096"`` -> bytes (binary units)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"{what}={text!r} is not a size; use bytes or a number with K/M/G/T, e.g. '8G'")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_cc(text) -> Tuple[int, int]:
    """``"9.0"`` / ``"8.6"`` / ``(9, 0)`` -> (major, minor)."""
    if isinstance(text, (tuple, list)) and len(text) == 2:
        major, minor = text
    else:
        m = re.match(r"^\s*(\d+)\.(\d+)\s*$", str(text))
        if not m:
            raise ValueError(f"compute capability {text!r} is not MAJOR.MINOR, e.g. '9.0'")
        major, minor = m.groups()
    major, minor = int(major), int(minor)
    if major < 1 or minor < 0:
        raise ValueError(f"compute capability {text!r} must be at least 1.0")
    return major, minor


def parse_peer(text, what: str = "ACCEL_SIM_PEER") -> Optional[Tuple[Tuple[int, int], ...]]:
    """``"all"`` / None -> None (every pair), ``"none"`` / ``""`` -> (), ``"0:1,2:3"`` (or pairs as
    a list) -> the sorted unordered pairs ``((0, 1), (2, 3))`` of physical devices that are
    peer-capable, both directions (JSON-able, for :func:`accel.sim.ze.export_config`)."""
    if text is None:
        return None
    if isinstance(text, (set, frozenset, list, tuple)):
        items = [tuple(p) for p in text]
    else:
        raw = str(text).strip().lower()
        if raw == "all":
            return None
        if raw in ("none", ""):
            return ()
        items = []
        for elem in raw.split(","):
            m = re.match(r"^\s*(\d+)\s*[:-]\s*(\d+)\s*$", elem)
            if not m:
                raise ValueError(f"{what}={text!r}: {elem!r} is not a pair of device indices; use 'all', "
                                 f"'none' or pairs such as '0:1,2:3'")
            items.append((int(m.group(1)), int(m.group(2))))
    out = set()
    for pair in items:
        if len(pair) != 2 or not all(type(i) is int and i >= 0 for i in pair) or pair[0] == pair[1]:
            raise ValueError(f"{what}={text!r}: {pair!r} is not a pair of two distinct device indices")
        out.add((min(pair), max(pair)))
    return tuple(sorted(out))


def parse_pci_order(text, what: str = "ACCEL_SIM_PCI_ORDER") -> Tuple[int, ...]:
    """``"1,0"`` / (1, 0) -> (1, 0): the physical devices in ascending PCI bus id order."""
    if text is None or text == "" or text == ():
        return ()
    try:
        items = tuple(int(t) for t in (text.split(",") if isinstance(text, str) else text))
    except (TypeError, ValueError):
        raise ValueError(f"{what}={text!r} is not a comma-separated list of device indices") from None
    if sorted(items) != list(range(len(items))):
        raise ValueError(f"{what}={text!r} must list each physical device 0..n-1 exactly once")
    return items


def peer_capable(a: int, b: int) -> bool:
    """(r71g) Whether physical devices ``a`` and ``b`` (distinct) can access each other's memory
    directly: ``Config.peer`` (ACCEL_SIM_PEER).  Real machines answer 0 for PCIe GPUs under
    different root complexes, mixed models and some VMs (CUDA Programming Guide, "Peer-to-Peer
    Memory Access": "depending on the system properties, specifically the PCIe and/or NVLINK
    topology, devices are able to address each other's memory"; ze_api.h, zeDeviceCanAccessPeer:
    true when "connected by a direct or indirect scale-up fabric or over PCIe (same root complex
    or shared PCIe switch)")."""
    if a == b:
        return False
    peer = config().peer
    return peer is None or (min(a, b), max(a, b)) in peer


def pci_rank(physical: int) -> int:
    """(r71g) Position of physical device ``physical`` in ascending PCI bus id order."""
    order = config().pci_order
    if order and physical < len(order):
        return order.index(physical)
    return physical


def by_pci_bus(count: int) -> List[int]:
    """(r71g) Physical devices 0..count-1 in ascending PCI bus id order (NVML's enumeration)."""
    return sorted(range(count), key=pci_rank)


def _env_config() -> Config:
    env = os.environ
    kw = {}
    raw = env.get("ACCEL_SIM_DEVICES")
    if raw is not None and raw.strip() != "":
        try:
            kw["devices"] = int(raw)
        except ValueError:
            raise ValueError(f"ACCEL_SIM_DEVICES={raw!r} is not an integer") from None
    raw = env.get("ACCEL_SIM_MEMORY")
    if raw:
        kw["memory"] = parse_size(raw, "ACCEL_SIM_MEMORY")
        _check_memory(kw["memory"], f"ACCEL_SIM_MEMORY={raw!r}")
    raw = env.get("ACCEL_SIM_CC")
    if raw:
        kw["compute_capability"] = parse_cc(raw)
    raw = env.get("ACCEL_SIM_DELAY_US")
    if raw:
        try:
            kw["delay_us"] = float(raw)
        except ValueError:
            raise ValueError(f"ACCEL_SIM_DELAY_US={raw!r} is not a number of microseconds") from None
        _check_latency(kw["delay_us"], f"ACCEL_SIM_DELAY_US={raw!r}")
    raw = env.get("ACCEL_SIM_VMM_COST_US")
    if raw:
        try:
            kw["vmm_cost_us"] = float(raw)
        except ValueError:
            raise ValueError(f"ACCEL_SIM_VMM_COST_US={raw!r} is not a number of microseconds") from None
        _check_latency(kw["vmm_cost_us"], f"ACCEL_SIM_VMM_COST_US={raw!r}")
    raw = env.get("ACCEL_SIM_CUDA_RUNTIME")
    if raw and raw.strip():
        # one version (the single installed runtime) or several: "12.4,13.0" = both installed
        kw["runtimes"] = parse_cuda_versions(raw, "ACCEL_SIM_CUDA_RUNTIME")
        kw["runtime_version"] = kw["runtimes"][-1]
    raw = env.get("ACCEL_SIM_CUDA_DRIVER")
    if raw and raw.strip():
        kw["driver_version"] = parse_cuda_version(raw, "ACCEL_SIM_CUDA_DRIVER")
    raw = env.get("ACCEL_SIM_PEER")
    if raw is not None:
        kw["peer"] = parse_peer(raw, "ACCEL_SIM_PEER")
    raw = env.get("ACCEL_SIM_PCI_ORDER")
    if raw and raw.strip():
        kw["pci_order"] = parse_pci_order(raw, "ACCEL_SIM_PCI_ORDER")
    return _validated(Config(**kw))


#: The longest simulated latency, microseconds: a longer one outlasts the simulator's own waits.
MAX_LATENCY_US = WAIT_TIMEOUT_S * 1e6


def _check_latency(value: float, what: str) -> None:
    """A latency time.sleep can take and the simulator's waits outlast; NaN fails both tests (the
    stream worker died in time.sleep on NaN and infinity, and the caller waited for it)."""
    if not 0.0 <= value <= MAX_LATENCY_US:
        raise ValueError(f"{what} is not a latency in microseconds from 0 to {MAX_LATENCY_US:.0f} "
                         f"(longer ones outlast the simulator's own {WAIT_TIMEOUT_S:.0f} s waits)")


#: The most simulated memory per device: what an int64 byte count holds (totalGlobalMem is a
#: size_t, NVML's total an unsigned long long, torch's statistics int64).
MAX_MEMORY = (1 << 63) - 1


def _check_memory(value: int, what: str) -> None:
    if not 0 < value <= MAX_MEMORY:
        raise ValueError(f"{what} is not a memory size per device from 1 byte to {MAX_MEMORY} "
                         f"(8 EiB - 1); use e.g. '8G'")


def _validated(cfg: Config) -> Config:
    if not isinstance(cfg.devices, int) or cfg.devices < 0:
        raise ValueError(f"simulated device count must be an integer >= 0, got {cfg.devices!r}")
    if not isinstance(cfg.memory, int):
        raise ValueError(f"simulated memory per device must be a positive byte count, got {cfg.memory!r}")
    _check_memory(cfg.memory, f"memory={cfg.memory!r}")
    _check_latency(cfg.delay_us, f"delay_us={cfg.delay_us!r}")
    _check_latency(cfg.vmm_cost_us, f"vmm_cost_us={cfg.vmm_cost_us!r}")
    if not cfg.runtimes:
        cfg = replace(cfg, runtimes=(cfg.runtime_version,))
    for version in cfg.runtimes + (cfg.runtime_version,):
        if version not in RUNTIME_VERSIONS:
            known = ", ".join(f"{v // 1000}.{v % 1000 // 10}" for v in RUNTIME_VERSIONS)
            raise ValueError(f"simulated CUDA runtime version {version!r} has no export list; "
                             f"use one of {known} (tools/cudart_exports.py adds others)")
    if cfg.runtime_version not in cfg.runtimes:
        raise ValueError(f"simulated runtime_version {cfg.runtime_version!r} is not among the installed "
                         f"runtimes {cfg.runtimes!r}")
    if not isinstance(cfg.driver_version, int) or cfg.driver_version < 1000:
        raise ValueError(f"simulated driver CUDA version must be an int like 12040, got {cfg.driver_version!r}")
    if cfg.pci_order and len(cfg.pci_order) != cfg.devices:
        raise ValueError(f"simulated PCI order {cfg.pci_order!r} must list each of the {cfg.devices} "
                         f"physical devices once (ACCEL_SIM_PCI_ORDER)")
    if not isinstance(cfg.name, str) or not cfg.name:
        raise ValueError(f"device name must be a non-empty str, got {cfg.name!r}")
    return cfg


_overrides: Dict[str, object] = {}
_config: Optional[Config] = None
_selected_runtime: Optional[int] = None   # select_runtime(): the installed runtime accel opened
#: Seconds to sleep before each stream operation (Config.delay_us / 1e6), read by workers.
delay_s = 0.0


def config() -> Config:
    """The active configuration (environment + :func:`configure` overrides), resolved once."""
    global _config, delay_s
    cfg = _config
    if cfg is None:
        cfg = _env_config()
        if _overrides:
            cfg = _validated(replace(cfg, **_overrides))
        if _selected_runtime in cfg.runtimes and cfg.runtime_version != _selected_runtime:
            cfg = replace(cfg, runtime_version=_selected_runtime)
        _config = cfg
        delay_s = cfg.delay_us / 1e6
    return cfg


_FIELDS = {f.name for f in fields(Config)}
#: Changing these rebuilds the simulated machine (its runtime state is dropped).
_STRUCTURAL = {"devices", "memory", "compute_capability", "name", "driver", "runtime_version", "driver_version",
               "runtimes", "vmm", "pci_order"}


def vmm_cost() -> None:
    """Sleep ``vmm_cost_us`` (``configure(vmm_cost_us=...)`` / ACCEL_SIM_VMM_COST_US): every
    simulated map and unmap (cuMemMap/cuMemUnmap, zeVirtualMemMap/Unmap) costs that long."""
    us = config().vmm_cost_us
    if us:
        time.sleep(us / 1e6)


def configure(**settings) -> Config:
    """Override the simulated machine for this process (tests); returns the new Config.

    Keys: ``devices`` (int), ``memory`` (bytes or "8G"), ``compute_capability``
    ("9.0" or (9, 0)), ``delay_us`` (float), ``vmm_cost_us`` (float), ``vmm`` (bool),
    ``name`` (str), ``nvml`` / ``cudart``
    (False: the library "is not installed"), ``driver`` (False: no driver),
    ``runtime_version`` / ``driver_version`` ("12.4" or 12040; ``runtime_version``
    also takes several, "12.4,13.0": all installed, the newest opened until
    :func:`select_runtime` picks another), ``peer`` ("all", "none", "0:1" or a set of
    pairs: which physical devices are peer-capable; applies at once) and ``pci_order``
    ("1,0": the physical devices in PCI bus id order; rebuilds the machine).

    ``delay_us``, ``nvml`` and ``cudart`` apply immediately.  Changing the
    machine itself (devices, memory, compute capability, name, driver) drops
    the simulated runtime state, as if the process restarted, so call it
    before the backend first uses the device.  :func:`reset` forgets overrides.
    """
    global _config, _selected_runtime
    unknown = set(settings) - _FIELDS
    if unknown:
        raise TypeError(f"configure() got unknown setting(s) {sorted(unknown)}; "
                        f"expected some of {sorted(_FIELDS)}")
    if "memory" in settings and isinstance(settings["memory"], str):
        settings["memory"] = parse_size(settings["memory"], "memory")
    if "compute_capability" in settings:
        settings["compute_capability"] = parse_cc(settings["compute_capability"])
    if "delay_us" in settings:
        settings["delay_us"] = float(settings["delay_us"])
    if "vmm_cost_us" in settings:
        settings["vmm_cost_us"] = float(settings["vmm_cost_us"])
    if "runtime_version" in settings:
        # one version keeps its meaning (the only installed runtime); several are all installed
        installed = parse_cuda_versions(settings["runtime_version"], "runtime_version")
        settings["runtime_version"] = installed[-1]
        settings.setdefault("runtimes", installed)
        _selected_runtime = None
    if "runtimes" in settings:
        settings["runtimes"] = parse_cuda_versions(settings["runtimes"], "runtimes")
        if "runtime_version" not in settings:
            settings["runtime_version"] = settings["runtimes"][-1]
            _selected_runtime = None
    if "driver_version" in settings:
        settings["driver_version"] = parse_cuda_version(settings["driver_version"], "driver_version")
    if "peer" in settings:
        settings["peer"] = parse_peer(settings["peer"], "peer")
    if "pci_order" in settings:
        settings["pci_order"] = parse_pci_order(settings["pci_order"], "pci_order")
    for key in ("nvml", "cudart", "driver", "vmm"):
        if key in settings and not isinstance(settings[key], bool):
            raise TypeError(f"configure({key}=...) takes a bool, got {settings[key]!r}")
    new = _validated(replace(config(), **settings))
    old = config()
    structural = any(k in _STRUCTURAL and getattr(old, k) != getattr(new, k) for k in settings)
    _overrides.update(settings)
    _config = None
    if structural:
        for reset_fn, _fork in list(_resetters.values()):
            reset_fn()
    return config()


def select_runtime(version) -> Config:
    """Make installed simulated runtime ``version`` the libcudart that is opened, as the
    dynamic loader would load the file accel's library choice picked.  Drops the simulated
    runtime's state when this changes the version (a process loads one libcudart)."""
    global _config, _selected_runtime
    version = parse_cuda_version(version, "runtime version")
    cfg = config()
    if version not in cfg.runtimes:
        installed = ", ".join(f"{v // 1000}.{v % 1000 // 10}" for v in cfg.runtimes)
        raise ValueError(f"simulated CUDA runtime {version // 1000}.{version % 1000 // 10} is not installed; "
                         f"installed: {installed} (set ACCEL_SIM_CUDA_RUNTIME, e.g. '12.4,13.0')")
    _selected_runtime = version
    if cfg.runtime_version != version:
        _config = None
        hooks = _resetters.get("cudart")
        if hooks is not None:
            hooks[0]()
    return config()


# -- fault injection ----------------------------------------------------------

_faults: Dict[str, List[int]] = {}          # call name -> [code, times left, calls to skip first]
_oom: List[int] = []                        # [allocations to let through, failures left] or empty
_fault_lock = threading.Lock()


def inject_error(call_name: str, code: int, times: int = 1, after: int = 0) -> None:
    """Make the simulated vendor function ``call_name`` return ``code``.

    The call fails ``times`` times (``-1``: until :func:`clear_faults`),
    starting after ``after`` calls that succeed normally.  A failed call
    does nothing else: out-pointers are left untouched.
    """
    if not isinstance(call_name, str) or not call_name:
        raise TypeError(f"call_name must be a vendor function name, got {call_name!r}")
    if not isinstance(code, int) or code == 0:
        raise ValueError(f"code must be a non-zero vendor error code, got {code!r}")
    if times == 0 or times < -1 or after < 0:
        raise ValueError(f"times must be >= 1 or -1 and after >= 0, got times={times}, after={after}")
    with _fault_lock:
        _faults[call_name] = [code, times, after]


def inject_oom(after: int = 0, times: int = 1) -> None:
    """Make a future device or pinned-host allocation fail with out-of-memory.

    ``after`` allocations (cudaMalloc, cudaHostAlloc, or another simulator's
    allocation call) still succeed; the next ``times`` ones fail.
    ``inject_oom()`` fails the very next allocation.
    """
    if after < 0 or times < 1:
        raise ValueError(f"after must be >= 0 and times >= 1, got after={after}, times={times}")
    with _fault_lock:
        _oom[:] = [after, times]


def clear_faults() -> None:
    """Forget every injected error and pending OOM."""
    with _fault_lock:
        _faults.clear()
        _oom.clear()


def take_fault(call_name: str) -> int:
    """The injected code for this call of ``call_name``, or 0 to run it normally."""
    with _fault_lock:
        entry = _faults.get(call_name)
        if entry is None:
            return 0
        if entry[2] > 0:
            entry[2] -= 1
            return 0
        code = entry[0]
        if entry[1] > 0:
            entry[1] -= 1
            if entry[1] == 0:
                del _faults[call_name]
        return code


def take_oom() -> bool:
    """Called by each simulated allocation: True when this one must fail."""
    if not _oom:
        return False
    with _fault_lock:
        if not _oom:
            return False
        if _oom[0] > 0:
            _oom[0] -= 1
            return False
        _oom[1] -= 1
        if _oom[1] <= 0:
            _oom.clear()
        return True


# -- call counting and the lib-like object ------------------------------------

# name -> [itertools.count]: next() on it is atomic under the GIL, unlike n += 1.
# The box itself is never replaced, so wrappers hold it; reset swaps its content.
_boxes: Dict[str, list] = {}
_box_lock = threading.Lock()


def counter_box(name: str) -> list:
    """The call counter of vendor function ``name``: ``next(box[0])`` counts one call."""
    box = _boxes.get(name)
    if box is None:
        with _box_lock:
            box = _boxes.setdefault(name, [itertools.count()])
    return box


def call_counts() -> Dict[str, int]:
    """{vendor function name: calls since the last reset} for every function called."""
    out = {}
    for name, box in list(_boxes.items()):
        text = repr(box[0])             # "count(5)": the next value is the number of calls
        if text != "count(0)":
            out[name] = int(text[6:-1])
    return out


def reset_call_counts() -> None:
    """Zero every call counter (state otherwise unchanged)."""
    for box in list(_boxes.values()):
        box[0] = itertools.count()


# -- a simulated call is atomic for Python signal handlers ------------------------------------
# A vendor library is C: a signal arriving during a call only sets CPython's flag, and the
# Python handler (Ctrl-C's KeyboardInterrupt, a SIGALRM handler that raises) runs after the call
# returns (Python docs, signal module, "Execution of Python signal handlers": "A long-running
# calculation implemented purely in C ... may run uninterrupted").  The simulators are Python,
# so a handler could otherwise stop a simulated call between two bytecodes and leave its state
# half-updated (a leaked lock, a reservation without its entry, a cffi callback's 999), which no
# hardware does.  So every simulated entry point blocks signals in the main thread (the only one
# that runs handlers) for the call, and the sim's worker threads block them for good (a signal
# the kernel hands to another thread would trip the same flag): the signal stays pending and
# its handler runs as the call returns.  Signals the caller had blocked stay blocked.  Not
# blocked: SIGKILL/SIGSTOP (cannot be), the synchronous faults, and SIGABRT (faulthandler's
# dump of a hung test).  Limit: a thread the program starts itself, or a native one that does not
# block signals (numpy's OpenBLAS pool), may still take the signal while the main thread blocks
# it; CPython then runs the handler in the main thread at its next check, inside the simulated
# call.  Nothing in Python can hold a handler back then (only the main thread's mask is ours), so
# programs that test Ctrl-C run numpy with one BLAS thread (tests/test_user_programs.py).

_SIG_SIZE = 128                              # bytes of sigset_t on glibc (1024 bits); macOS: 4
_deferral: Optional[dict] = None


class _Deferring:
    """``depth`` 1 while a simulated call of the main thread has signals blocked (a nested
    call does not block again); ``main`` the id of the thread that runs handlers; ``pending``
    a handler's exception that simulated device work held back (_engine._run_whole), raised
    as the outermost simulated call returns."""
    depth = 0
    main = threading.main_thread().ident
    pending = None


def deferral_cells() -> dict:
    """The closure cells :data:`DEFERRED_BODY` uses (libc's pthread_sigmask, the signal set
    deferred, the buffer keeping the main thread's mask of before the call)."""
    global _deferral
    if _deferral is None:
        import signal
        # libc's pthread_sigmask and the set of signals deferred: the backends' (one definition)
        from ..backends._signals import _DEFER as defer, _mask as pthread_sigmask
        old = ffi.new("char[]", _SIG_SIZE)
        pthread_sigmask(signal.SIG_BLOCK, ffi.NULL, old)
        _deferral = dict(_D=_Deferring, _ident=threading.get_ident, _mask=pthread_sigmask,
                         _BLOCK=signal.SIG_BLOCK, _SETMASK=signal.SIG_SETMASK, _DEFER=defer, _OLD=old,
                         _NULL=ffi.NULL, _gc=ffi.gc, _ANCHOR=ffi.new("char[]", _SIG_SIZE),
                         _BLOCKER=functools.partial(pthread_sigmask, signal.SIG_BLOCK, defer),
                         _RESTORE=functools.partial(pthread_sigmask, signal.SIG_SETMASK, old))
    return _deferral


def block_signals_in_this_thread() -> None:
    """For the sim's own threads: never take a signal (see "atomic for Python signal handlers")."""
    c = deferral_cells()
    c["_mask"](c["_BLOCK"], c["_DEFER"], c["_NULL"])


#: A wrapper body (:func:`exact_wrapper`, cells :func:`deferral_cells`) around ``{body}``, the
#: vendor function's: the main thread's outermost simulated call blocks signals for its length.
#: Ordering is deliberate: 3.11 runs pending handlers after a call returns, at function entry
#: and at backward jumps, so no handler can run between "depth = 1" and the block, and one that
#: runs right after the block (a signal already pending) lands inside the try, whose finally
#: unblocks; the finally sets depth first, as the handler runs after the unblocking call.
DEFERRED_BODY = """\
        _outer = _ident() == _D.main and not _D.depth
        try:
            if _outer:
                _D.depth = 1
                _mask(_BLOCK, _DEFER, _OLD)
{body}
        finally:
            if _outer:
                _D.depth = 0
                _mask(_SETMASK, _OLD, _NULL)
                if _D.pending is not None:
                    _held, _D.pending = _D.pending, None
                    raise _held
"""


#: :data:`DEFERRED_BODY` for a cffi callback (the driver entry points): a handler run inside
#: the callback would make cffi print it and return the error value (999).  So the unblocking is
#: done by the C-level destructor of a cffi gc object (``del``: no bytecode checks for pending
#: signals there, nor in the return that follows); the handler runs once the C caller returned.
#: The block and the unblock take the same depth of calls, so a RecursionError that lets one
#: run lets the other: cffi calls the destructor (a ``functools.partial``, which calls a cffi
#: function through ``tp_call``: two levels of CPython's recursion count) from the ``del``, and
#: the block goes through the same kind of partial.  Before, the block was one level and the
#: unblock three (a Python helper made the gc object): a RecursionError at the limit let the
#: block run and made the destructor fail ("Exception ignored"), leaving every signal blocked
#: in the main thread for good (r51's observer recursion test, seen by tests/conftest.py's
#: check of the signal mask; a program started later inherits the mask).
DEFERRED_CALLBACK_BODY = DEFERRED_BODY.replace("""\
                _mask(_BLOCK, _DEFER, _OLD)
""", """\
                _BLOCKER(_OLD)
""").replace("""\
                _mask(_SETMASK, _OLD, _NULL)
""", """\
                _g = _gc(_ANCHOR, _RESTORE)
                del _g
""")


def deferred(fn: Callable) -> Callable:
    """``fn`` (any signature) run with signals deferred, as :data:`DEFERRED_BODY` does; for
    entry points not built by :func:`exact_wrapper` (the Objective-C runtime's)."""
    import functools
    c = deferral_cells()
    D, ident, mask, block, setmask, defer, old, null = (c[k] for k in (
        "_D", "_ident", "_mask", "_BLOCK", "_SETMASK", "_DEFER", "_OLD", "_NULL"))

    @functools.wraps(fn)
    def call(*args):
        outer = ident() == D.main and not D.depth
        try:        # same order as DEFERRED_BODY
            if outer:
                D.depth = 1
                mask(block, defer, old)
            return fn(*args)
        finally:
            if outer:
                D.depth = 0
                mask(setmask, old, null)
                if D.pending is not None:
                    held, D.pending = D.pending, None
                    raise held
    return call


def deferred_body(body: str, callback: bool = False) -> str:
    """``body`` (a wrapper body for :func:`exact_wrapper`) run with signals deferred."""
    inner = "".join("    " + line if line.strip() else line for line in body.splitlines(True))
    return (DEFERRED_CALLBACK_BODY if callback else DEFERRED_BODY).replace("{body}\n", inner)


_factories: Dict[tuple, Callable] = {}


def exact_wrapper(name: str, fn: Callable, body: str, namespace: dict, skip: int = 0, **cells) -> Callable:
    """A wrapper taking exactly fn's parameters after the first ``skip``, running ``body``.

    Wrappers take the vendor function's parameters positionally, as a cffi
    function does (``*args`` forwarding costs more than the rest of a
    simulated call).  ``body`` is the indented function body; ``{args}`` in
    it is replaced by the parameter list.  It sees the names in
    ``namespace`` as its globals (module state is looked up live) and
    ``cells`` as closure values bound once.  One factory is compiled per
    (body, arity), so building a library compiles a handful of functions.
    """
    code = fn.__code__
    nparams = code.co_argcount - skip
    key = (body, nparams, tuple(sorted(cells)), id(namespace))
    factory = _factories.get(key)
    if factory is None:
        params = ", ".join(f"a{i}" for i in range(nparams))
        src = (f"def _factory({', '.join(sorted(cells))}):\n"
               f"    def call({params}):\n"
               + body.format(args=params)
               + "    return call\n")
        local: dict = {}
        exec(compile(src, "<accel.sim call wrapper>", "exec"), namespace, local)
        factory = _factories[key] = local["_factory"]
    call = factory(**cells)
    call.__name__ = call.__qualname__ = name
    call.__doc__ = fn.__doc__
    return call


_COUNTED_NS: dict = {}
_COUNTED = """\
        next(_box[0])
        if _faults and _name in _faults:
            _code = _take(_name)
            if _code:
                return _code
        return _fn({args})
"""
_COUNTED_BODY = deferred_body(_COUNTED)
_COUNTED_CALLBACK_BODY = deferred_body(_COUNTED, callback=True)


def counted(name: str, fn: Callable, callback: bool = False) -> Callable:
    """``fn`` wrapped with the call counter and fault injection of vendor function ``name``
    (signals deferred for the call: "atomic for Python signal handlers" above); ``callback``:
    it is called as a cffi callback (DEFERRED_CALLBACK_BODY)."""
    if callback:
        return exact_wrapper(name, fn, _COUNTED_CALLBACK_BODY, _COUNTED_NS, _box=counter_box(name),
                             _faults=_faults, _take=take_fault, _name=name, _fn=fn,
                             **deferral_cells())
    return exact_wrapper(name, fn, _COUNTED_BODY, _COUNTED_NS, _box=counter_box(name), _faults=_faults,
                         _take=take_fault, _name=name, _fn=fn, **deferral_cells())


class SimLibrary:
    """Looks like a cffi ``lib``: vendor functions as attributes, plus the
    vendor's enum and ``#define`` constants read from the generated
    declarations.  A function the generated module declares but this library
    lacks raises ``ffi.error``, as cffi does for a real library missing the
    symbol; a name not declared at all raises AttributeError (probe with
    ``accel._ffi.has_symbol``, which handles both)."""

    def __init__(self, name: str, constants=None, declared=()):
        self.__dict__["_sim_name"] = name
        self.__dict__["_sim_constants"] = constants
        self.__dict__["_sim_declared"] = frozenset(declared)

    def __getattr__(self, attr: str):
        consts = self.__dict__["_sim_constants"]
        if consts is not None and not attr.startswith("__"):
            try:
                value = getattr(consts, attr)
            except Exception:
                value = None
            if isinstance(value, int):
                self.__dict__[attr] = value
                return value
        if attr in self.__dict__["_sim_declared"]:
            raise _cffi_backend.FFI.error(f"symbol {attr!r} not found in library 'accel.sim "
                                          f"{self.__dict__['_sim_name']}': undefined symbol: {attr}")
        raise AttributeError(f"the simulated {self.__dict__['_sim_name']} library has no symbol {attr!r}")

    def __dir__(self):
        return sorted(k for k in self.__dict__ if not k.startswith("_sim_"))

    def __repr__(self):
        return f"<accel.sim {self.__dict__['_sim_name']} library>"


def build_library(name: str, functions: Dict[str, Callable], *, constants=None,
                  wrap: Callable[[str, Callable], Callable] = counted, declared=()) -> SimLibrary:
    """A :class:`SimLibrary` whose attribute ``f`` is ``wrap("f", functions["f"])``.

    The default ``wrap`` is :func:`counted` (call counter + fault injection);
    a library with extra per-call work (cudart: runtime init, last error)
    passes its own wrapper built with :func:`exact_wrapper` and :func:`counter_box`.
    ``constants`` serves the int attributes that are not functions, e.g.
    :func:`constants_of` the generated module.
    """
    lib = SimLibrary(name, constants, declared)
    for fname, fn in functions.items():
        lib.__dict__[fname] = wrap(fname, fn)
    return lib


def constants_of(module_name: str):
    """An object serving the enum/#define constants of generated module
    ``accel._ffi.<module_name>`` without loading the vendor library."""
    import importlib
    try:
        mod = importlib.import_module("accel._ffi." + module_name)
    except ImportError:
        return None
    try:
        # Constants need no symbol lookup; the process itself stands in for the library.
        return mod.ffi.dlopen(None)
    except OSError:
        return None


def library_not_found(name: str, soname: str) -> OSError:
    """The error the real loader raises when library ``name`` is absent
    (``accel._ffi.LibraryNotFound``, an OSError), for ``configure(<name>=False)``."""
    reason = f"{soname}: cannot open shared object file: No such file or directory (accel.sim: configured absent)"
    try:
        from accel._ffi import LibraryNotFound
    except ImportError:
        return OSError(f"cannot load the {name} library; tried:\n  {soname}: {reason}")
    return LibraryNotFound(name, [(soname, reason)])


# -- identities shared by the simulated libraries -----------------------------

def uuid_bytes(physical: int) -> bytes:
    """The 16 UUID bytes of simulated physical device ``physical`` (stable, distinct).

    The first group differs per device so short ``GPU-`` prefixes select one
    device, while ``GPU-acce`` matches them all (an ambiguous prefix)."""
    first = (0xACCE0000 + physical * 0x1111) & 0xFFFFFFFF
    return (first.to_bytes(4, "big") + (physical & 0xFFFF).to_bytes(2, "big") + b"\x40\x00\x80\x00"
            + b"SIM" + (physical & 0xFFFFFF).to_bytes(3, "big"))


def uuid_text(physical: int) -> str:
    """``GPU-acce0000-0000-4000-8000-53494d000000`` style, as nvmlDeviceGetUUID prints it."""
    h = uuid_bytes(physical).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def pci_bus(physical: int) -> int:
    """PCI bus number of simulated physical device ``physical`` (domain 0, device 0, function 0);
    (r71g) ascending in ``Config.pci_order`` (ACCEL_SIM_PCI_ORDER), the identity by default."""
    return (0x18 + 0x10 * pci_rank(physical)) & 0xFF


# -- reset and fork -------------------------------------------------------------

# name -> (full reset, runtime-state-only reset used after fork / configure)
_resetters: Dict[str, Tuple[Callable[[], None], Callable[[], None]]] = {}
_state_providers: Dict[str, Callable[[], dict]] = {}


def on_reset(name: str, reset_fn: Callable[[], None], fork_fn: Optional[Callable[[], None]] = None) -> None:
    """Register a simulated library's state dropper.

    ``reset_fn`` runs on :func:`reset` (tests); ``fork_fn`` (default
    ``reset_fn``) runs in a forked child and when :func:`configure` changes
    the machine; it must not touch locks or threads inherited from the parent.
    """
    _resetters[name] = (reset_fn, fork_fn or reset_fn)


def on_state(name: str, provider: Callable[[], dict]) -> None:
    """Register a function whose dict is merged into :func:`accel.sim.state`."""
    _state_providers[name] = provider


def state_fields() -> dict:
    out = {}
    for provider in list(_state_providers.values()):
        out.update(provider())
    return out


def reset() -> None:
    """Drop every simulated library's state, faults, counters and overrides."""
    global _config, _selected_runtime
    for reset_fn, _fork in list(_resetters.values()):
        reset_fn()
    clear_faults()
    reset_call_counts()
    _overrides.clear()
    _selected_runtime = None
    _config = None


def _after_fork_in_child() -> None:
    # Locks may have been held by parent threads that do not exist in the child.
    global _fault_lock, _box_lock
    _Deferring.main, _Deferring.depth = threading.get_ident(), 0   # the forking thread runs handlers now
    _fault_lock = threading.Lock()
    _box_lock = threading.Lock()
    for _reset, fork_fn in list(_resetters.values()):
        fork_fn()
    clear_faults()
    reset_call_counts()


os.register_at_fork(after_in_child=_after_fork_in_child)
