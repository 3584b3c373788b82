"""Counting Level Zero GPUs without initializing this process's runtime, for loaders
that have no ``zesInit`` (Debian's libze_loader 1.8.12).

Only ``zeInit`` can count there, and ``zeInit`` starts the driver in the
calling process, after which a forked child cannot use the device.  So:

1. :func:`probe_gpu_drivers` looks for the GPU driver library where the
   loader would (it ``dlopen``\\ s :data:`GPU_DRIVER_NAMES` by name): none
   found means no device, without loading anything.
2. Otherwise :func:`count_in_child` runs ``zeInit``/``zeDeviceGet`` in a
   short-lived child process (:func:`child_main`).  The child's driver
   applies ``ZE_AFFINITY_MASK`` and ``ZE_FLAT_DEVICE_HIERARCHY`` itself, as
   the parent's will at init.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional, Tuple

#: The GPU drivers the loader loads by name (besides ZE_ENABLE_ALT_DRIVERS): the Level Zero loader's
#: knownDriverNames (source/loader/linux/driver_discovery_lin.cpp); 1.8 has libze_intel_gpu.so.1,
#: 1.18+ also libze_intel_gpu_legacy1.so.1 (commit aa8e38f), the driver for older GPUs.
GPU_DRIVER_NAMES = ("libze_intel_gpu.so.1", "libze_intel_gpu_legacy1.so.1")

_SEARCH_DIRS = ("/lib", "/usr/lib", "/lib64", "/usr/lib64", "/usr/local/lib",
                "/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu",
                "/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu")

#: Environment variable carrying the simulated machine to the child (ACCEL_SIM=xpu).
SIM_CONFIG_ENV = "ACCEL_XPU_CHILD_SIM"


def probe_gpu_drivers() -> Optional[List[str]]:
    """GPU driver libraries the loader would find, or None when that cannot be told.

    Looks where the dynamic linker looks for a bare soname: LD_LIBRARY_PATH,
    the ld.so cache and the default directories.  None (unknowable) when
    ZE_ENABLE_ALT_DRIVERS names other drivers, or off Linux.
    """
    if not sys.platform.startswith("linux") or os.environ.get("ZE_ENABLE_ALT_DRIVERS"):
        return None
    from .._ffi import _startup_ld_library_path     # (ld.so reads it once, at start: r72d)
    dirs = [d for d in (_startup_ld_library_path() or "").split(":") if d] + list(_SEARCH_DIRS)
    try:
        with open("/etc/ld.so.cache", "rb") as f:
            cache = f.read()
    except OSError:
        cache = b""
    found = []
    for name in GPU_DRIVER_NAMES:
        if name.encode() in cache or any(os.path.exists(os.path.join(d, name)) for d in dirs):
            found.append(name)
    return found


#: The variables the driver applies to the devices zeDeviceGet returns, read at zeInit.
VISIBILITY_VARS = ("ZE_AFFINITY_MASK", "ZE_FLAT_DEVICE_HIERARCHY")


def count_in_child(sim_config: Optional[dict] = None, timeout: float = 120.0,
                   visibility: Optional[Tuple[Optional[str], Optional[str]]] = None) -> Tuple[int, str]:
    """(GPU count, reason when 0) from ``zeInit`` in a child process.

    ``sim_config`` (from ``accel.sim.ze.export_config()``) makes the child
    count on the simulator with the same machine instead of the real loader.
    ``visibility`` is the (``ZE_AFFINITY_MASK``, ``ZE_FLAT_DEVICE_HIERARCHY``)
    pair to count for (None: unset) in place of this process's values; by
    default the child inherits them.
    """
    import json  # here, not at import: `import accel` stays small
    import subprocess
    env = dict(os.environ)
    if sim_config is not None:
        env[SIM_CONFIG_ENV] = json.dumps(sim_config)
    else:
        env.pop(SIM_CONFIG_ENV, None)
    if visibility is not None:
        for name, value in zip(VISIBILITY_VARS, visibility):
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-c", "from accel.backends._ze_count import child_main; child_main()"]
    try:
        out = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        return 0, f"the counting child process failed: {exc}"
    lines = out.stdout.decode(errors="replace").strip().splitlines()
    try:
        data = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = out.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {out.returncode}"]
        return 0, f"the counting child process failed: {tail[0]}"
    return int(data.get("count", 0)), str(data.get("reason", ""))


def runtime_count(ffi, lib) -> Tuple[int, str]:
    """zeInit + zeDriverGet + zeDeviceGet: the number of GPU devices, and why it is 0."""
    rc = lib.zeInit(lib.ZE_INIT_FLAG_GPU_ONLY)
    if rc:
        names = ffi.typeof("ze_result_t").elements
        return 0, f"zeInit failed with {names.get(rc, 'an unknown ze_result_t')} ({rc:#010x})"
    n = ffi.new("uint32_t *", 0)
    if lib.zeDriverGet(n, ffi.NULL) or not n[0]:
        return 0, "zeDriverGet found no driver"
    drivers = ffi.new("ze_driver_handle_t[]", n[0])
    lib.zeDriverGet(n, drivers)
    total = 0
    for d in range(n[0]):
        m = ffi.new("uint32_t *", 0)
        if lib.zeDeviceGet(drivers[d], m, ffi.NULL) or not m[0]:
            continue
        devs = ffi.new("ze_device_handle_t[]", m[0])
        lib.zeDeviceGet(drivers[d], m, devs)
        for i in range(m[0]):
            props = ffi.new("ze_device_properties_t *")
            props.stype = lib.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES
            if lib.zeDeviceGetProperties(devs[i], props) == 0 and props.type == lib.ZE_DEVICE_TYPE_GPU:
                total += 1
    return total, "" if total else "zeDeviceGet found no GPU device"


def child_main() -> None:
    """The counting child: prints ``{"count": n, "reason": ...}`` as one JSON line."""
    import json
    try:
        cfg = os.environ.get(SIM_CONFIG_ENV)
        if cfg:
            from .._ffi import _ze
            from ..sim import ze as sim_ze
            sim_ze.import_config(json.loads(cfg))
            ffi, lib = _ze.ffi, sim_ze.open_ze()
        else:
            from .._ffi import open_library
            ffi, lib, _ = open_library("ze")
        count, reason = runtime_count(ffi, lib)
    except Exception as exc:   # the parent reads the reason; never a traceback
        count, reason = 0, f"{type(exc).__name__}: {exc}"
    print(json.dumps({"count": count, "reason": reason}))
