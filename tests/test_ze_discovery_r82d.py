"""r82d: how the XPU backend (Level Zero) discovers, counts and initializes devices, against the
Level Zero specification, Intel's driver and loader sources, and the real Debian loader (libze1
1.8.12, no GPU driver) of this machine.

Not repeated here: tests/test_xpu_visible.py (the mask/hierarchy rules on 1-2 tile machines),
test_xpu_count_env_r64h.py (recounting when the variables change, fork after a count),
test_xpu_versions.py (driver API versions, failing zesInit, a COMPOSITE-default driver),
test_xpu.py / test_xpu_sim.py (symbol contract, the real loader without a driver),
test_runtime_loader_r82c.py (a GPU driver library that is no driver: count 0 with zeInit's reason;
a broken ACCEL_ZE_PATH), test_runtime_loader_r69g.py (legacy Sysman, old loaders).

Vendor texts the checks rest on:

- level-zero-spec scripts/core/PROG.rst, "Affinity Mask": "The affinity mask is specified via an
  environment variable as a comma-seperated list of device and/or subdevice ordinals" ...  "a Level
  Zero driver shall read first ZE_FLAT_DEVICE_HIERARCHY to determine the device handles to be used
  by the application and then interpret the values passed in ZE_AFFINITY_MASK based on the device
  model selected" ... "The order of the devices reported by the zeDeviceGet is implementation-specific
  and not affected by the order of devices in the affinity mask", and its worked examples for two
  parent devices of four tiles each (COMPOSITE: `0.0` "only tile 0 in parent device 0 is reported as
  device handle 0"; `1.1, 1.2` "only parent device 1 is reported as device handle 0; with its tiles 1
  and 2 reported as its sub-devices"; FLAT: `1, 2, 7` three devices; `0.0` "is not valid").
- PROG.rst, "Device Hierarchy": FLAT: "zeDeviceGet returns all the devices that do not have
  sub-devices ... with zeDeviceGetSubDevices returning always a count of 0"; COMBINED: "zeDeviceGet
  returns all the devices that do not have sub-devices".
- The spec's zeDeviceGet (scripts/core/device.yml): "The number and order of handles returned from
  this function is affected by the ZE_AFFINITY_MASK and ZE_ENABLE_PCI_ID_DEVICE_ORDER environment
  variables"; zesDeviceGet (scripts/sysman/device.yml, 1.7): "The number and order of handles
  returned from this function is NOT affected by the ZE_AFFINITY_MASK, ZE_ENABLE_PCI_ID_DEVICE_ORDER,
  or ZE_FLAT_DEVICE_HIERARCHY environment variables."  So the two lists may come in different orders.
- Intel compute-runtime (the driver accel's _ze_visible says it follows):
  ExecutionEnvironment::parseAffinityMask reads each index with StringHelpers::toUint32t, which is
  ``static_cast<uint32_t>(std::stoul(input, nullptr, 0))`` (shared/source/helpers/string_helpers.h):
  base 0, so ``0x2`` is 2, ``010`` is 8 (octal), and ``1abc`` is 1 (stoul stops at the first
  character that is no digit).  The spec is silent on the number syntax.
- Level Zero loader source/loader/linux/driver_discovery_lin.cpp, knownDriverNames, from v1.18.0
  (commit aa8e38f, "Add GPU-legacy1 driver to list of known names on Linux"):
  libze_intel_gpu.so.1, libze_intel_gpu_legacy1.so.1, libze_intel_vpu.so.1 (1.8.12 has only the
  first and the VPU one).

Bugs are strict xfails whose reason names the function at fault (tag r82d).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from accel import backends, sim
from accel.backends._ze_visible import visible_devices
from accel.sim import ze as sim_ze

from conftest import use_sim, vendor_calls_made_by

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CC = shutil.which("cc") or shutil.which("gcc")
ZE_LOADER = next((p for p in ("/usr/lib/x86_64-linux-gnu/libze_loader.so.1", "/lib/x86_64-linux-gnu/libze_loader.so.1")
                  if os.path.exists(p)), None)


# -- the simulated driver, raw: what zeInit/zeDeviceGet/zeDeviceGetSubDevices return ----------------

def _sim_devices(monkeypatch, mask, mode, cards=2, tiles=4):
    """[(is a sub-device, sub-device count)] of every device the simulated driver's zeDeviceGet
    returns after zeInit, for ``ZE_AFFINITY_MASK=mask`` and ``ZE_FLAT_DEVICE_HIERARCHY=mode``."""
    from accel._ffi import _ze
    ffi = _ze.ffi
    use_sim(monkeypatch, "xpu", ACCEL_SIM_DEVICES=cards, ACCEL_SIM_ZE_TILES=tiles)
    for name, value in (("ZE_AFFINITY_MASK", mask), ("ZE_FLAT_DEVICE_HIERARCHY", mode)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    sim.reset()
    try:
        lib = sim_ze.open_ze()
        assert lib.zeInit(lib.ZE_INIT_FLAG_GPU_ONLY) == 0
        n = ffi.new("uint32_t *", 0)
        assert lib.zeDriverGet(n, ffi.NULL) == 0 and n[0] == 1
        drv = ffi.new("ze_driver_handle_t[1]")
        assert lib.zeDriverGet(n, drv) == 0
        assert lib.zeDeviceGet(drv[0], n, ffi.NULL) == 0
        count = n[0]
        out = []
        if count:
            devs = ffi.new("ze_device_handle_t[]", count)
            assert lib.zeDeviceGet(drv[0], n, devs) == 0
            for i in range(count):
                props = ffi.new("ze_device_properties_t *")
                props.stype = lib.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES
                assert lib.zeDeviceGetProperties(devs[i], props) == 0
                m = ffi.new("uint32_t *", 0)
                assert lib.zeDeviceGetSubDevices(devs[i], m, ffi.NULL) == 0
                out.append((bool(props.flags & lib.ZE_DEVICE_PROPERTY_FLAG_SUBDEVICE), m[0]))
        return out
    finally:
        sim.reset()


# The spec's worked examples (PROG.rst "Affinity Mask", 1.7+): two parent devices of four tiles.
# (mask, mode, visible_devices' answer, the driver's [(is sub-device, its sub-device count)])
SPEC_EXAMPLES = [
    ("0, 1", "COMPOSITE", [(0, None), (1, None)], [(False, 4), (False, 4)]),
    ("0", "COMPOSITE", [(0, None)], [(False, 4)]),
    ("1", "COMPOSITE", [(1, None)], [(False, 4)]),
    ("0.0", "COMPOSITE", [(0, 0)], [(True, 0)]),
    ("1.1, 1.2", "COMPOSITE", [(1, None)], [(False, 2)]),
    ("0.2, 1.3, 1.0, 0.3", "COMPOSITE", [(0, None), (1, None)], [(False, 2), (False, 2)]),
    ("0, 1, 2, 3, 4, 5, 6, 7", "FLAT", [(c, t) for c in range(2) for t in range(4)], [(True, 0)] * 8),
    ("0", "FLAT", [(0, 0)], [(True, 0)]),
    ("1", "FLAT", [(0, 1)], [(True, 0)]),
    ("0, 4", "FLAT", [(0, 0), (1, 0)], [(True, 0)] * 2),
    ("1, 2, 7", "FLAT", [(0, 1), (0, 2), (1, 3)], [(True, 0)] * 3),
    ("0.0", "FLAT", [], []),
    # beyond the examples: COMBINED exposes what FLAT does (X.Y ignored: compute-runtime's
    # exposeSubDevices is "deviceHierarchyMode != composite"); a whole card and one of its
    # tiles in either order is the whole card (enableAllGenericSubDevices); the mask's order
    # and duplicates change nothing
    ("7, 0.1, 3", "COMBINED", [(0, 3), (1, 3)], [(True, 0)] * 2),
    ("1.0, 1", "COMPOSITE", [(1, None)], [(False, 4)]),
    ("1, 1.0", "COMPOSITE", [(1, None)], [(False, 4)]),
    ("1.3, 1.3", "COMPOSITE", [(1, 3)], [(True, 0)]),
    ("6, 2, 6, 2", None, [(0, 2), (1, 2)], [(True, 0)] * 2),
]


@pytest.mark.parametrize("mask, mode, visible, driver", SPEC_EXAMPLES)
def test_spec_affinity_examples_count_before_init_and_in_the_driver(monkeypatch, mask, mode, visible, driver):
    assert visible_devices([4, 4], mask, mode) == visible
    assert _sim_devices(monkeypatch, mask, mode) == driver


@pytest.mark.parametrize("mask, mode", [(m, h) for m, h, _v, _d in SPEC_EXAMPLES[:8]])
def test_the_backend_count_before_init_equals_the_initialized_driver_on_4_tile_cards(monkeypatch, mask, mode):
    """The public count (Sysman + the rules, no zeInit) is the initialized driver's count, with no
    reconcile warning, on the spec's machine (2 cards x 4 tiles)."""
    import warnings
    use_sim(monkeypatch, "xpu", ACCEL_SIM_DEVICES=2, ACCEL_SIM_ZE_TILES=4,
            ZE_AFFINITY_MASK=mask, ZE_FLAT_DEVICE_HIERARCHY=mode)
    be = backends.get("xpu")
    before = be.count()
    assert be.report()["count_path"] == "zesInit"
    assert not sim_ze.state()["ze_runtime_initialized"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        be.init()
    try:
        assert len(be._devices) == before
        assert be.report()["count"] == before and "count_before_init" not in be.report()
    finally:
        be.close()


# -- the number syntax of an index ---------------------------------------------------------------------

# (tiles per card, mask, what compute-runtime's std::stoul(..., 0) makes of it)
_STOUL = [
    ([1, 1, 1], "0x2", [(2, None)]),           # hexadecimal
    ([1] * 9, "010", [(8, None)]),             # octal: 8, not 10 (there is no device 10)
    ([1, 1, 1], "1abc", [(1, None)]),          # stoul stops at the first non-digit
]


# r82d, fixed in session 40: _ze_visible._index read a mask index as ASCII decimal only; the driver's
#   std::stoul(s, nullptr, 0) takes 0x.., 0.. (octal) and stops at the first non-digit (now _ze_visible.strtoul)
@pytest.mark.parametrize("tiles, mask, want", _STOUL)
def test_mask_indices_are_read_as_the_driver_reads_them(tiles, mask, want):
    assert visible_devices(tiles, mask, "FLAT") == want


# r82d, fixed in session 40: the simulated zeInit (common._mask_number) read mask indices as ASCII decimal
#   only; it now uses _ze_visible.strtoul, compute-runtime's std::stoul base 0
@pytest.mark.parametrize("tiles, mask, want", _STOUL)
def test_sim_driver_reads_mask_indices_as_intels_driver_does(monkeypatch, tiles, mask, want):
    got = _sim_devices(monkeypatch, mask, "FLAT", cards=len(tiles), tiles=1)
    assert len(got) == len(want)


def test_plain_decimal_spaces_and_out_of_range_entries_agree_with_the_driver(monkeypatch):
    """What both readings agree on: spaces around an entry, a leading 0 that is still the same
    number in octal ("01"), negative and huge entries (out of range either way)."""
    for mask, want in ((" 1 , 2 ", [(1, None), (2, None)]), ("01", [(1, None)]), ("-1", []), ("99", [])):
        assert visible_devices([1, 1, 1], mask, "FLAT") == want, mask
        assert len(_sim_devices(monkeypatch, mask, "FLAT", cards=3, tiles=1)) == len(want), mask


# -- FLAT has no sub-devices; COMPOSITE keeps them -----------------------------------------------------

def test_flat_devices_have_no_sub_devices_and_composite_cards_list_theirs(monkeypatch):
    """PROG.rst "Device Hierarchy": FLAT "zeDeviceGetSubDevices returning always a count of 0";
    COMPOSITE returns the devices "that do not have a root-device" (the cards, tiles below)."""
    assert _sim_devices(monkeypatch, None, "FLAT", tiles=2) == [(True, 0)] * 4
    assert _sim_devices(monkeypatch, None, "COMPOSITE", tiles=2) == [(False, 2)] * 2
    assert _sim_devices(monkeypatch, None, "COMBINED", tiles=2) == [(True, 0)] * 4


# -- Sysman's card order is not the core order ---------------------------------------------------------

def _sysman_cards_reversed(monkeypatch):
    """Make the simulated zesDeviceGet list the cards in the opposite order to zeDeviceGet's: the
    spec lets ZE_ENABLE_PCI_ID_DEVICE_ORDER (and the driver's own ordering: compute-runtime puts
    discrete cards before integrated ones, ExecutionEnvironment::comparePciIdBusNumber) reorder the
    core devices and not Sysman's."""
    from accel.sim.ze import discovery
    from accel.sim.ze.objects import _Card
    real = discovery._fill

    def fill(pcount, parr, items):
        if items and all(isinstance(i, _Card) for i in items):
            items = list(reversed(items))
        return real(pcount, parr, items)
    monkeypatch.setattr(discovery, "_fill", fill)


# r82d, fixed in session 40: DiscoveryMixin._map_sysman paired a tile with the Sysman card at the same
#   position; it now pairs by uuid (the tile's without its tile part)
def test_mem_info_of_a_tile_reads_its_own_card_when_sysman_lists_cards_in_another_order(monkeypatch):
    use_sim(monkeypatch, "xpu", ACCEL_SIM_DEVICES=2, ACCEL_SIM_ZE_TILES=2)
    _sysman_cards_reversed(monkeypatch)
    be = backends.get("xpu")
    assert be.count() == 4
    be.init()
    try:
        be.set_device(0)
        free0, _total = be.mem_info()
        ptr = be.mem_alloc(64 << 20)
        try:
            free1, _ = be.mem_info()
            assert be._mem_info_path == "sysman"
            # wrong pairing: the other card's tile 0, whose free memory did not move
            assert free0 - free1 >= 64 << 20, (free0, free1)
        finally:
            be.mem_free(ptr)
    finally:
        be.close()


def test_whole_cards_in_another_sysman_order_are_not_mispaired(monkeypatch):
    """COMPOSITE (whole cards) listed by Sysman in another order: each device pairs with its own
    card by uuid (since the r82d fix; before it, the position check refused the pairing and
    mem_info fell back to the device's own numbers), never with the other card."""
    use_sim(monkeypatch, "xpu", ACCEL_SIM_DEVICES=2, ACCEL_SIM_ZE_TILES=1)
    _sysman_cards_reversed(monkeypatch)
    be = backends.get("xpu")
    be.init()
    try:
        assert all(d.sysman is not None for d in be._devices)
        be.set_device(0)
        free0, _ = be.mem_info()
        ptr = be.mem_alloc(64 << 20)
        try:
            free1, _ = be.mem_info()
            assert free0 - free1 >= 64 << 20
        finally:
            be.mem_free(ptr)
    finally:
        be.close()


# -- fresh interpreters against the real loader ------------------------------------------------------

def _child(code, **env):
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("ACCEL_", "CUDA_VISIBLE_DEVICES", "ZE_", "ZES_", "LD_LIBRARY_PATH", "STUB_"))}
    full.update({k: str(v) for k, v in env.items()})
    full["PYTHONPATH"] = _REPO + (os.pathsep + full["PYTHONPATH"] if full.get("PYTHONPATH") else "")
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _build(dirpath, name, source, *flags):
    dirpath.mkdir(parents=True, exist_ok=True)
    src = dirpath / (name + ".c")
    src.write_text(source)
    out = dirpath / name
    subprocess.run([_CC, "-shared", "-fPIC", *flags, f"-Wl,-soname,{name}", "-o", str(out), str(src)],
                   check=True, capture_output=True, timeout=60)
    return str(out)


# A GPU driver library that records each process that loads it, and is no driver (the 1.8.12
# loader finds no zeGetGlobalProcAddrTable in it and drops it: zeInit UNINITIALIZED).
_LOGGING_DRIVER_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
__attribute__((constructor)) static void loaded(void) {
    const char *p = getenv("STUB_LOG"); FILE *f;
    if (p && (f = fopen(p, "a"))) { fprintf(f, "%d\n", (int)getpid()); fclose(f); }
}
int not_a_driver(void) { return 0; }
"""

_REPORT = r"""
import json, os, accel
from accel.backends import get
be = get("xpu")
out = {"pid": os.getpid(), "n": accel.device_count(), "avail": accel.is_available(),
       "acc": repr(accel.current_accelerator())}
r = be.report()
out.update(path=r.get("count_path"), reason=r.get("reason"), found=r.get("gpu_drivers_found"),
           initialized=r.get("initialized"))
log = os.environ["STUB_LOG"]
out["loaded_by"] = [int(x) for x in open(log).read().split()] if os.path.exists(log) else []
try:
    accel.current_device_index(); out["err"] = None
except Exception as e:
    out["err"] = "%s: %s" % (type(e).__name__, e)
    out["err_fields"] = [getattr(e, k, None) for k in ("library", "call", "code", "code_name")]
print(json.dumps(out))
"""

needs_real = pytest.mark.skipif(ZE_LOADER is None or _CC is None, reason="needs Debian's libze_loader and a C compiler")


@needs_real
def test_counting_loads_the_gpu_driver_only_in_a_child_process(tmp_path):
    """discovery.py: counting "never initializes the core runtime (it must be safe before fork)".
    With a GPU driver library found and the 1.8.12 loader (no zesInit), the driver library is
    loaded by the counting child only, never by this process, until the first device use."""
    d = tmp_path / "drv"
    _build(d, "libze_intel_gpu.so.1", _LOGGING_DRIVER_C)
    log = tmp_path / "loaded.log"
    got = _child(_REPORT, ACCEL_BACKEND="xpu", LD_LIBRARY_PATH=str(d), STUB_LOG=str(log))
    assert got["path"] == "child-zeInit" and got["found"] == ["libze_intel_gpu.so.1"]
    assert (got["n"], got["avail"], got["acc"], got["initialized"]) == (0, False, "device(type='xpu')", False)
    assert got["loaded_by"] and got["pid"] not in got["loaded_by"], got   # only the child loaded it
    assert "zeInit failed with ZE_RESULT_ERROR_UNINITIALIZED (0x78000001)" in got["reason"]
    # the first device use is what runs zeInit here: the library, the call, the code
    assert got["err_fields"] == ["libze_loader", "zeInit", 0x78000001, "ZE_RESULT_ERROR_UNINITIALIZED"], got
    assert got["pid"] in [int(x) for x in log.read_text().split()]


@needs_real
# r82d, fixed in session 40: DiscoveryMixin.init's zeInit error asked whether a driver was installed when the
#   probe had found one; it now names the driver file the loader could not use
def test_first_use_error_names_the_driver_that_was_found_but_not_usable(tmp_path):
    d = tmp_path / "drv"
    _build(d, "libze_intel_gpu.so.1", _LOGGING_DRIVER_C)
    got = _child(_REPORT, ACCEL_BACKEND="xpu", LD_LIBRARY_PATH=str(d), STUB_LOG=str(tmp_path / "log"))
    assert got["err"].startswith("AcceleratorError: libze_loader: zeInit"), got["err"]
    assert "libze_intel_gpu.so.1" in got["err"], got["err"]


@needs_real
def test_no_driver_and_any_mask_or_hierarchy_count_zero_without_init_and_explain(tmp_path):
    """The real loader, no GPU driver, garbage visibility variables: no exception from the queries,
    no zeInit in this process, the reason names the missing driver, and the first device use names
    the library, the call, the code and a fix."""
    got = _child(_REPORT, ACCEL_BACKEND="xpu", ZE_AFFINITY_MASK="0.1,x,,9.9.9,-3",
                 ZE_FLAT_DEVICE_HIERARCHY="COMPOSITE", STUB_LOG=str(tmp_path / "log"))
    assert (got["n"], got["avail"], got["acc"], got["initialized"]) == (0, False, "device(type='xpu')", False)
    assert got["path"] == "driver-probe" and "libze_intel_gpu.so.1" in got["reason"]
    assert got["err_fields"] == ["libze_loader", "zeInit", 0x78000001, "ZE_RESULT_ERROR_UNINITIALIZED"], got
    assert "intel-level-zero-gpu" in got["err"]


# A "new" loader (1.18+: exports zesInit and zeInitDrivers) whose zeInit finds one GPU when the
# legacy GPU driver can be loaded, as the real loader's knownDriverNames make it do.
_NEW_LOADER_C = r"""
#include <dlfcn.h>
#include <stdint.h>
/* by hand, not from the headers (Debian's are API 1.4): ze_result_t values, and
   ze_device_properties_t's first fields (stype, pNext, type; ZE_DEVICE_TYPE_GPU = 1) */
#define OK 0
#define UNINITIALIZED 0x78000001
#define UNSUPPORTED 0x78000003
struct props { uint32_t stype; void *pNext; uint32_t type; };
static int driver(void) { return dlopen("libze_intel_gpu_legacy1.so.1", RTLD_NOW) != 0; }
static int one(uint32_t *n, void **out, void *h) {
    if (*n == 0 || !out) { *n = 1; return OK; }
    out[0] = h; *n = 1; return OK; }
int zeInit(uint32_t f) { return driver() ? OK : UNINITIALIZED; }
int zeInitDrivers(uint32_t *n, void **d, void *desc) { return driver() ? one(n, d, (void *)0x10) : UNINITIALIZED; }
int zeDriverGet(uint32_t *n, void **d) { return one(n, d, (void *)0x10); }
int zeDeviceGet(void *drv, uint32_t *n, void **d) { return one(n, d, (void *)0x20); }
int zeDeviceGetProperties(void *h, struct props *p) { p->type = 1; return OK; }
int zeDriverGetApiVersion(void *d, uint32_t *v) { *v = (1u << 16) | 5; return OK; }
int zeContextCreate(void) { return UNSUPPORTED; }
int zeMemAllocDevice(void) { return UNSUPPORTED; }
int zeCommandListCreateImmediate(void) { return UNSUPPORTED; }
int zeEventPoolCreate(void) { return UNSUPPORTED; }
int zesInit(uint32_t f) { return UNINITIALIZED; }
int zesDriverGet(uint32_t *n, void **d) { return UNINITIALIZED; }
int zesDeviceGet(void *drv, uint32_t *n, void **d) { return UNINITIALIZED; }
"""

_PROBE = r"""
import json, accel
from accel.backends import _ze_count, get
r = get("xpu").report()
print(json.dumps({"probe": _ze_count.probe_gpu_drivers(), "n": accel.device_count(),
                  "path": r.get("count_path"), "reason": r.get("reason")}))
"""

needs_cc = pytest.mark.skipif(_CC is None, reason="needs a C compiler")


@needs_cc
# r82d, fixed in session 40: _ze_count.GPU_DRIVER_NAMES lacked libze_intel_gpu_legacy1.so.1, which loaders
#   1.18+ load as a GPU driver
def test_a_legacy_gpu_driver_is_counted_by_a_new_loader_with_legacy_sysman(tmp_path):
    loader = _build(tmp_path / "loader", "libze_loader.so.1", _NEW_LOADER_C, "-ldl")
    drv = tmp_path / "drv"
    _build(drv, "libze_intel_gpu_legacy1.so.1", "int not_the_real_driver(void) { return 0; }\n")
    got = _child(_PROBE, ACCEL_BACKEND="xpu", ACCEL_ZE_PATH=loader, LD_LIBRARY_PATH=str(drv),
                 ZES_ENABLE_SYSMAN="1")
    assert got["probe"] != [], got
    assert got["n"] == 1, got


@needs_cc
def test_the_stub_new_loader_counts_the_legacy_driver_when_sysman_is_not_forced(tmp_path):
    """Control for the xfail above: the same stand-in loader and driver, with the probe out of the
    way (ZE_ENABLE_ALT_DRIVERS makes it unknowable, None): the loader's zesInit fails (a driver
    older than API 1.5), so accel counts with zeInit in a child, which finds the GPU.  So the 0
    above comes from the probe alone (without ZES_ENABLE_SYSMAN the failing zesInit takes the same
    probe: the same bug)."""
    loader = _build(tmp_path / "loader", "libze_loader.so.1", _NEW_LOADER_C, "-ldl")
    drv = tmp_path / "drv"
    _build(drv, "libze_intel_gpu_legacy1.so.1", "int not_the_real_driver(void) { return 0; }\n")
    got = _child(_PROBE, ACCEL_BACKEND="xpu", ACCEL_ZE_PATH=loader, LD_LIBRARY_PATH=str(drv),
                 ZE_ENABLE_ALT_DRIVERS="libze_intel_gpu_legacy1.so.1")
    assert got["probe"] is None and got["path"] == "child-zeInit" and got["n"] == 1, got


# -- ZES_ENABLE_SYSMAN: the driver's reading of the value -----------------------------------------------
# compute-runtime reads it with EnvironmentVariableReader::getSetting(name, false), which is
# ``getSetting(name, int64_t(false)) ? true : false`` over ``atoll(envValue)``
# (shared/source/os_interface/debug_env_reader.cpp): any value atoll reads as non-zero ("2", "01",
# " 1", "1 ") turns legacy Sysman on, as "1" does; "0", "", "true" leave it off.

# r82d, fixed in session 40: DiscoveryMixin._zes_usable (and init's _sysman_legacy) took only
#   ZES_ENABLE_SYSMAN == '1' as legacy Sysman; now any value atoll reads as non-zero (_ze_visible.sysman_env_on)
@pytest.mark.parametrize("value", ["2", " 1", "01"])
def test_any_nonzero_zes_enable_sysman_is_legacy_sysman_and_gets_no_zesinit(monkeypatch, value):
    use_sim(monkeypatch, "xpu", ZES_ENABLE_SYSMAN=value)
    be = backends.get("xpu")
    calls = vendor_calls_made_by(be.count)
    assert "zesInit" not in calls, calls


@pytest.mark.parametrize("value", ["1", "0", "true"])
def test_zes_enable_sysman_values_accel_reads_as_the_driver_does(monkeypatch, value):
    """"1" asks for legacy Sysman (no zesInit, a child counts); "0" and "true" (atoll: 0) do not."""
    use_sim(monkeypatch, "xpu", ZES_ENABLE_SYSMAN=value)
    be = backends.get("xpu")
    calls = vendor_calls_made_by(be.count)
    assert ("zesInit" in calls) == (value != "1"), calls
    assert be.report()["count_path"] == ("child-zeInit" if value == "1" else "zesInit")


# r82d, fixed in session 40: the simulated zeInit turned legacy Sysman on only for ZES_ENABLE_SYSMAN == '1';
#   now any value atoll reads as non-zero
def test_sim_driver_takes_any_nonzero_zes_enable_sysman_as_legacy_sysman(monkeypatch):
    from accel._ffi import _ze
    ffi = _ze.ffi
    use_sim(monkeypatch, "xpu", ACCEL_SIM_ZE_LOADER="1.8.12", ZES_ENABLE_SYSMAN="2")
    sim.reset()
    try:
        lib = sim_ze.open_ze()
        assert lib.zeInit(0) == 0
        n = ffi.new("uint32_t *", 1)
        drivers = ffi.new("ze_driver_handle_t[1]")
        assert lib.zeDriverGet(n, drivers) == 0
        devices = ffi.new("ze_device_handle_t[1]")
        assert lib.zeDeviceGet(drivers[0], n, devices) == 0
        count = ffi.new("uint32_t *", 0)
        rc = lib.zesDeviceEnumMemoryModules(devices[0], count, ffi.NULL)
        assert rc == 0 and count[0] > 0, hex(rc)
    finally:
        sim.reset()


# Lead, session 40 (noticed by the r82d fix): telemetry.TelemetryMixin._smi_target read a device's
# Sysman card by its position in the visible list also after init, when _map_sysman has paired
# each device with its own card by uuid.
def test_readings_after_init_use_the_card_paired_by_identity(monkeypatch):
    use_sim(monkeypatch, "xpu", ACCEL_SIM_DEVICES=2, ACCEL_SIM_ZE_TILES=1)
    _sysman_cards_reversed(monkeypatch)
    be = backends.get("xpu")
    be.init()
    try:
        for index, dev in enumerate(be._devices):
            card = be.smi_index(index)
            assert be._sysman_cards[card][0] == dev.sysman, (index, card)
            assert be._sysman_cards[card][2] == dev.uuid
    finally:
        be.close()
