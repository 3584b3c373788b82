"""What most calls share: the initialization check, writing structures and out-pointers, the
visible devices (ZE_AFFINITY_MASK, ZE_FLAT_DEVICE_HIERARCHY) and the Sysman handle check.
"""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

from .. import _memory
# A mask index is a number as compute-runtime's StringHelpers::toUint32t reads it (std::stoul, base 0):
# "0x2" is 2, "010" is 8, "1abc" is 1 (the docstring of strtoul cites the source).
from ...backends._ze_visible import split, strtoul
from .objects import _Card, _Runtime, _runtime


# -- helpers ------------------------------------------------------------------------

def _addr(x) -> int:
    return _memory.addr_of(x)


def _fill(pcount, parr, items) -> int:
    """The usual Level Zero enumeration: count query when *pCount is 0 or the array is NULL.
    (r70h) A NULL ``pCount`` is ZE_RESULT_ERROR_INVALID_NULL_POINTER (ze_api.h / zes_api.h @returns:
    "nullptr == pCount"); the simulator raised a Python error out of the library."""
    if not pcount:
        return _runtime().C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    n = pcount[0]
    if n == 0 or not parr:
        pcount[0] = len(items)
        return 0
    k = min(n, len(items))
    for i in range(k):
        parr[i] = items[i].key
    pcount[0] = k
    return 0


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
    if mask in ("", "default"):     # exactly, as parseAffinityMask (r84a)
        for c in rt.cards:
            enabled[c.index] = set(range(c.tiles))
    else:
        for entry in split(mask, ","):
            parts = split(entry, ".")
            idx = strtoul(parts[0]) if parts else None    # (an empty entry: ignored, as accel does)
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
                    sub = strtoul(parts[1])
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


def _ready_get(ready, handle, kind: str):
    """(runtime, object, 0), or (None, None, code): ``ready()``, then the live handle of ``kind``
    (ZE_RESULT_ERROR_INVALID_NULL_HANDLE for none).  ``ready`` is the calling module's ``_ready``,
    looked up there at each call: the tests wrap a module's ``_ready`` to act between two calls."""
    rt, rc = ready()
    if rc:
        return None, None, rc
    obj = rt.get(handle, kind)
    if obj is None:
        return None, None, rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    return rt, obj, 0


# (r72a) pNext of every property structure: "[in,out][optional] must be null or a pointer to an
# extension-specific structure (i.e. contains sType and pNext)" (ze_api.h).  A chained structure asks
# the driver to fill an extension's properties too (ze_device_ip_version_ext_t,
# ze_device_memory_ext_properties_t, ze_device_luid_ext_properties_t, ze_external_memory_export_fd_t
# on zeMemGetAllocProperties, ...).  The simulator has no extension: it returned success and left the
# chained structure as the caller wrote it, so a program read its own zeros (or garbage) as the
# driver's answer.  Refused now, as the creation descriptors' chains are (memory.py, _no_extension):
# ZE_RESULT_ERROR_UNSUPPORTED_FEATURE, nothing written.
def _struct_code(C, struct, stype_name: str) -> int:
    """0, or the code refusing a structure (ze_* or zes_*, in or out) of another stype
    (ZE_RESULT_ERROR_INVALID_ENUMERATION) or with an extension structure chained to it (r72a)."""
    if struct.stype != getattr(C, stype_name):
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    if struct.pNext:
        return C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE
    return 0


def _struct_arg_code(C, struct, stype_name: str, *out_pointers) -> int:
    """0, or the code refusing a NULL ``struct`` or out-pointer (ZE_RESULT_ERROR_INVALID_NULL_POINTER:
    "nullptr == desc", "nullptr == pProperties", ... in each function's @returns), then _struct_code."""
    if not struct or not all(out_pointers):
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    return _struct_code(C, struct, stype_name)


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


# (r79b) The flags each creator accepts, by the driver's API version: each version's ze_api.h lists
# ZE_RESULT_ERROR_INVALID_ENUMERATION for "`0x7 < desc->flags`" and the like in the function's @returns.
# v1.4: /usr/include/level_zero/ze_api.h (v1.4-r1.4.8).  Other versions: the headers of the spec
# releases in github.com/oneapi-src/level-zero include/ze_api.h ("@version v1.1-r1.1.8" ... "v1.3-r1.3.7"
# as v1.4; v1.5-r1.5.4, v1.6-r1.6.0, v1.7-r1.7.0, v1.8-r1.8.0; v1.9-r1.9.1 and v1.9-r1.9.3 for the
# simulator's default 1.9; v1.11 to v1.13 as v1.9; v1.14-r1.14.33, v1.15-r1.15.31, v1.17 as v1.15).
# (first version, mask), newest first.  The bits added: pool 0x8 KERNEL_MAPPED_TIMESTAMP (1.6); list
# 0x8 IN_ORDER (1.7), 0x10 EXP_CLONEABLE (1.9), 0x20 COPY_OFFLOAD_HINT (1.15); queue desc (also
# zeCommandListCreateImmediate's altdesc) 0x2 IN_ORDER (1.7), 0x4 COPY_OFFLOAD_HINT (1.14).
_FLAG_MASKS = {
    "zeEventPoolCreate": (((1, 6), 0xF), ((1, 0), 0x7)),
    "zeCommandListCreate": (((1, 15), 0x3F), ((1, 9), 0x1F), ((1, 7), 0xF), ((1, 0), 0x7)),
    "zeCommandQueueCreate": (((1, 14), 0x7), ((1, 7), 0x3), ((1, 0), 0x1)),
}
_FLAG_MASKS["zeCommandListCreateImmediate"] = _FLAG_MASKS["zeCommandQueueCreate"]


def _flags_unknown(rt: _Runtime, call: str, flags: int) -> bool:
    """True when ``flags`` has a bit the header of the driver's API version does not define for ``call``."""
    table = _FLAG_MASKS[call]
    mask = next((m for first, m in table if rt.zcfg.api_version >= first), table[-1][1])
    return flags > mask
