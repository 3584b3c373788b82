"""Level Zero (core and Sysman) and Metal simulators against the vendor documents, round r79b.

Audited: every ze*/zes* function accel's XPU backend calls (accel/backends/xpu/*.py) and every Metal
selector of the mps backend (accel/backends/mps/*.py), against ze_api.h / zes_api.h (v1.4, installed
at /usr/include/level_zero on this machine: each function's @returns list) and Apple's Metal
documentation.  Earlier rounds (tests/test_sim_ze_*.py, test_sim_ze_metal_strict*.py,
test_ze_metal_strict.py, test_sim_metal_*.py, test_vmm_ze.py, test_sim_strict_r72a.py) pin most
rules; this file checks only what none of them does.

Leniencies found (strict xfails first, each naming the simulator function at fault; fixed in session 39 and plain tests since):

* ``zesDeviceGetProperties`` and ``zesDeviceEnumMemoryModules`` (accel/sim/ze/sysman.py) take any
  Sysman handle as ``hDevice``: a memory module's or a temperature sensor's handle is answered as
  its card ("[in] Sysman handle of the device", zes_api.h).  The handle types are distinct C types
  (zes_device_handle_t vs zes_mem_handle_t / zes_temp_handle_t); a driver casts the handle to its
  device object, so another object's handle is undefined behaviour.  The docs are silent on the
  result, so the simulator must refuse; its sibling device calls (zesDeviceEnumTemperatureSensors,
  ...EnumFrequencyDomains, ...EnumEngineGroups, ...EnumPowerDomains, zesDeviceGetCardPowerDomain,
  zesDeviceProcessesGetState) already refuse with ZE_RESULT_ERROR_INVALID_ARGUMENT.
* ``zesDeviceGetProperties(hDevice, NULL)``, ``zesMemoryGetProperties(hMemory, NULL)`` and
  ``zesMemoryGetState(hMemory, NULL)`` raise a Python AttributeError out of the library instead of
  answering ZE_RESULT_ERROR_INVALID_NULL_POINTER (zes_api.h @returns: "`nullptr == pProperties`",
  "`nullptr == pState`").  r70h fixed the same for about 29 core calls; these three Sysman calls
  were left (the other Sysman property/state calls check).
* Flags a 1.4 driver does not know are accepted when the simulated driver is 1.4
  (``configure_ze(api_version="1.4")``): ze_api.h v1.4 lists ZE_RESULT_ERROR_INVALID_ENUMERATION for
  "`0x7 < desc->flags`" (zeEventPoolCreate, zeCommandListCreate) and "`0x1 < desc->flags`" /
  "`0x1 < altdesc->flags`" (zeCommandQueueCreate, zeCommandListCreateImmediate).  The simulator gates
  only the IN_ORDER flags by version (commands.py), and takes event-pool flag 0x8, list flags 0x10 /
  0x20 and queue flag 0x4 on every version (events.py zeEventPoolCreate, commands.py
  zeCommandListCreate, _queue_desc_code).

accel relies on none of these: it passes only zesDeviceGet / core device handles to the zesDevice*
calls, never NULL property pointers, and only HOST_VISIBLE|KERNEL_TIMESTAMP pool flags and IN_ORDER
(gated on 1.7) list/queue flags; the last tests run accel's Sysman paths on a simulator patched to
refuse non-device handles, and its XPU streams/events on a 1.4 driver.
"""

import struct

import pytest

from accel import _lazy, sim
from accel._ffi._ze import ffi
from accel.backends import _objc
from accel.sim import metal
from accel.sim import ze as sim_ze
from accel.sim.ze import objects as ze_objects
from conftest import use_sim

NULL = ffi.NULL
G = 2 << 20            # the simulated VMM page size


# -- helpers (small copies of what the other strict files do) --------------------------------------

@pytest.fixture
def fresh(monkeypatch):
    """A fresh simulated Level Zero machine; ``fresh(**settings)`` applies configure_ze first."""
    monkeypatch.setenv("ACCEL_SIM", "xpu")
    sim.reset()

    def make(**settings):
        if settings:
            sim_ze.configure_ze(**settings)
        return sim_ze.open_ze()
    yield make
    sim.reset()


def _core(lib):
    """zeInit, the driver, its devices and a context."""
    assert lib.zeInit(lib.ZE_INIT_FLAG_GPU_ONLY) == 0
    n = ffi.new("uint32_t *", 1)
    drv = ffi.new("ze_driver_handle_t[1]")
    assert lib.zeDriverGet(n, drv) == 0
    n = ffi.new("uint32_t *", 0)
    assert lib.zeDeviceGet(drv[0], n, NULL) == 0
    devs = ffi.new("ze_device_handle_t[]", n[0])
    assert lib.zeDeviceGet(drv[0], n, devs) == 0
    desc = ffi.new("ze_context_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_CONTEXT_DESC})
    ctx = ffi.new("ze_context_handle_t *")
    assert lib.zeContextCreate(drv[0], desc, ctx) == 0
    return drv[0], [devs[i] for i in range(n[0])], ctx[0]


def _enum(fn, handle, ctype):
    """The usual two-call enumeration: ``[handle, ...]``."""
    n = ffi.new("uint32_t *", 0)
    assert fn(handle, n, NULL) == 0
    arr = ffi.new(f"{ctype}[]", n[0])
    assert fn(handle, n, arr) == 0
    return [arr[i] for i in range(n[0])]


class _Sysman:
    """zesInit + the cards (Sysman device handles) and each kind of component of the first one."""

    def __init__(self, lib):
        self.lib = lib
        assert lib.zesInit(0) == 0
        n = ffi.new("uint32_t *", 1)
        drv = ffi.new("zes_driver_handle_t[1]")
        assert lib.zesDriverGet(n, drv) == 0
        self.cards = _enum(lib.zesDeviceGet, drv[0], "zes_device_handle_t")
        card = self.cards[0]
        self.comp = {
            "memory": _enum(lib.zesDeviceEnumMemoryModules, card, "zes_mem_handle_t")[0],
            "temperature": _enum(lib.zesDeviceEnumTemperatureSensors, card, "zes_temp_handle_t")[0],
            "frequency": _enum(lib.zesDeviceEnumFrequencyDomains, card, "zes_freq_handle_t")[0],
            "engine": _enum(lib.zesDeviceEnumEngineGroups, card, "zes_engine_handle_t")[0],
            "power": _enum(lib.zesDeviceEnumPowerDomains, card, "zes_pwr_handle_t")[0],
        }

    def as_device(self, kind):
        return ffi.cast("zes_device_handle_t", self.comp[kind])


# -- Sysman: a component handle where a device handle belongs --------------------------------------

@pytest.mark.parametrize("kind", ["memory", "temperature"])
# r79b, fixed in session 39: zesDeviceGetProperties answered a memory module's or sensor's handle as its card
def test_zes_device_get_properties_refuses_a_component_handle(fresh, kind):
    """zes_api.h, zesDeviceGetProperties: "hDevice [in] Sysman handle of the device".  Another
    object's handle is undefined (the docs are silent): refused, nothing written, as the sibling
    zesDevice* calls refuse it (INVALID_ARGUMENT)."""
    lib = fresh()
    s = _Sysman(lib)
    props = ffi.new("zes_device_properties_t *", {"stype": lib.ZES_STRUCTURE_TYPE_DEVICE_PROPERTIES})
    assert lib.zesDeviceGetProperties(s.as_device(kind), props) == lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
    assert props.numSubdevices == 0 and ffi.string(props.modelName) == b""


@pytest.mark.parametrize("kind", ["memory", "temperature"])
# r79b, fixed in session 39: zesDeviceEnumMemoryModules enumerated the card's modules for a component's handle
def test_zes_device_enum_memory_modules_refuses_a_component_handle(fresh, kind):
    """zes_api.h, zesDeviceEnumMemoryModules: "hDevice [in] Sysman handle of the device"; refused,
    the count untouched."""
    lib = fresh()
    s = _Sysman(lib)
    n = ffi.new("uint32_t *", 0)
    assert lib.zesDeviceEnumMemoryModules(s.as_device(kind), n, NULL) == lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
    assert n[0] == 0


def test_other_sysman_calls_refuse_a_handle_of_the_wrong_kind(fresh):
    """The rest of the Sysman calls accel makes check the handle's kind: a component handle given as
    a device, and a component of another kind, are INVALID_ARGUMENT."""
    lib = fresh()
    s = _Sysman(lib)
    bad = lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
    n = ffi.new("uint32_t *", 0)
    for kind in ("memory", "temperature"):
        dev = s.as_device(kind)
        assert lib.zesDeviceEnumTemperatureSensors(dev, n, NULL) == bad
        assert lib.zesDeviceEnumFrequencyDomains(dev, n, NULL) == bad
        assert lib.zesDeviceEnumEngineGroups(dev, n, NULL) == bad
        assert lib.zesDeviceEnumPowerDomains(dev, n, NULL) == bad
        assert lib.zesDeviceProcessesGetState(dev, n, NULL) == bad
        assert lib.zesDeviceGetCardPowerDomain(dev, ffi.new("zes_pwr_handle_t *")) == bad
    c = s.comp
    st = ffi.new("zes_mem_state_t *", {"stype": lib.ZES_STRUCTURE_TYPE_MEM_STATE})
    assert lib.zesMemoryGetState(ffi.cast("zes_mem_handle_t", c["temperature"]), st) == bad
    assert lib.zesMemoryGetState(ffi.cast("zes_mem_handle_t", s.cards[0]), st) == bad
    assert lib.zesMemoryGetBandwidth(ffi.cast("zes_mem_handle_t", c["power"]),
                                     ffi.new("zes_mem_bandwidth_t *")) == bad
    assert lib.zesTemperatureGetState(ffi.cast("zes_temp_handle_t", c["memory"]), ffi.new("double *")) == bad
    fs = ffi.new("zes_freq_state_t *", {"stype": lib.ZES_STRUCTURE_TYPE_FREQ_STATE})
    assert lib.zesFrequencyGetState(ffi.cast("zes_freq_handle_t", c["engine"]), fs) == bad
    assert lib.zesEngineGetActivity(ffi.cast("zes_engine_handle_t", c["power"]),
                                    ffi.new("zes_engine_stats_t *")) == bad
    assert lib.zesPowerGetEnergyCounter(ffi.cast("zes_pwr_handle_t", c["engine"]),
                                        ffi.new("zes_power_energy_counter_t *")) == bad
    # and the right handles still answer
    assert lib.zesMemoryGetState(ffi.cast("zes_mem_handle_t", c["memory"]), st) == 0 and st.size > 0


# -- Sysman: NULL out-pointers ---------------------------------------------------------------------

def _sysman_null_call(lib, s, which):
    if which == "zesDeviceGetProperties":
        return lib.zesDeviceGetProperties(s.cards[0], NULL)
    if which == "zesMemoryGetProperties":
        return lib.zesMemoryGetProperties(s.comp["memory"], NULL)
    return lib.zesMemoryGetState(s.comp["memory"], NULL)


@pytest.mark.parametrize("which", ["zesDeviceGetProperties", "zesMemoryGetProperties", "zesMemoryGetState"])
# r79b, fixed in session 39: zesDeviceGetProperties / zesMemoryGetProperties / zesMemoryGetState raised
# AttributeError on a NULL out-pointer instead of answering INVALID_NULL_POINTER
def test_sysman_property_and_state_calls_with_a_null_pointer_are_invalid_null_pointer(fresh, which):
    """zes_api.h @returns of each: ZE_RESULT_ERROR_INVALID_NULL_POINTER for "`nullptr ==
    pProperties`" (zesDeviceGetProperties, zesMemoryGetProperties) and "`nullptr == pState`"
    (zesMemoryGetState)."""
    lib = fresh()
    s = _Sysman(lib)
    assert _sysman_null_call(lib, s, which) == lib.ZE_RESULT_ERROR_INVALID_NULL_POINTER


def test_other_sysman_calls_with_a_null_pointer_are_invalid_null_pointer(fresh):
    """The other Sysman calls accel makes answer their @returns code for a NULL out-pointer."""
    lib = fresh()
    s = _Sysman(lib)
    c, card = s.comp, s.cards[0]
    code = lib.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    assert lib.zesDeviceEnumMemoryModules(card, NULL, NULL) == code
    assert lib.zesDeviceEnumTemperatureSensors(card, NULL, NULL) == code
    assert lib.zesDeviceEnumFrequencyDomains(card, NULL, NULL) == code
    assert lib.zesDeviceEnumEngineGroups(card, NULL, NULL) == code
    assert lib.zesDeviceEnumPowerDomains(card, NULL, NULL) == code
    assert lib.zesDeviceProcessesGetState(card, NULL, NULL) == code
    assert lib.zesDeviceGetCardPowerDomain(card, NULL) == code
    assert lib.zesTemperatureGetProperties(c["temperature"], NULL) == code
    assert lib.zesTemperatureGetState(c["temperature"], NULL) == code
    assert lib.zesFrequencyGetProperties(c["frequency"], NULL) == code
    assert lib.zesFrequencyGetState(c["frequency"], NULL) == code
    assert lib.zesEngineGetProperties(c["engine"], NULL) == code
    assert lib.zesEngineGetActivity(c["engine"], NULL) == code
    assert lib.zesMemoryGetBandwidth(c["memory"], NULL) == code
    assert lib.zesPowerGetProperties(c["power"], NULL) == code
    assert lib.zesPowerGetEnergyCounter(c["power"], NULL) == code


def test_processes_get_state_follows_the_count_rules(fresh):
    """zes_api.h, zesDeviceProcessesGetState: *pCount 0 asks for the count; a larger count "shall
    update the value with the correct number"; a non-zero one too small is INVALID_SIZE ("The
    provided value of pCount is not big enough")."""
    lib = fresh()
    drv, devs, ctx = _core(lib)
    s = _Sysman(lib)
    card = s.cards[0]
    # make this process hold device memory on the first card
    desc = ffi.new("ze_device_mem_alloc_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC})
    p = ffi.new("void **")
    assert lib.zeMemAllocDevice(ctx, desc, 4096, 0, devs[0], p) == 0
    n = ffi.new("uint32_t *", 0)
    assert lib.zesDeviceProcessesGetState(card, n, NULL) == 0
    assert n[0] >= 1
    have = n[0]
    n[0] = have + 3
    procs = ffi.new("zes_process_state_t[]", [{"stype": lib.ZES_STRUCTURE_TYPE_PROCESS_STATE}] * (have + 3))
    assert lib.zesDeviceProcessesGetState(card, n, procs) == 0
    assert n[0] == have and procs[0].memSize >= 4096
    if have > 1:        # only this process is simulated; kept for a model with more
        n[0] = have - 1
        assert lib.zesDeviceProcessesGetState(card, n, procs) == lib.ZE_RESULT_ERROR_INVALID_SIZE
    assert lib.zeMemFree(ctx, p[0]) == 0


# -- flags a 1.4 driver does not define ------------------------------------------------------------

_NEWER_FLAGS = [("zeEventPoolCreate", 0x8), ("zeEventPoolCreate", 0x9), ("zeCommandListCreate", 0x10),
                ("zeCommandListCreate", 0x20), ("zeCommandQueueCreate", 0x4),
                ("zeCommandListCreateImmediate", 0x4)]


def _create_with_flags(lib, ctx, dev, which, flags):
    if which == "zeEventPoolCreate":
        desc = ffi.new("ze_event_pool_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_EVENT_POOL_DESC,
                                                 "flags": flags, "count": 1})
        out = ffi.new("ze_event_pool_handle_t *")
        return lib.zeEventPoolCreate(ctx, desc, 0, NULL, out)
    if which == "zeCommandListCreate":
        desc = ffi.new("ze_command_list_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_COMMAND_LIST_DESC,
                                                   "commandQueueGroupOrdinal": 1, "flags": flags})
        return lib.zeCommandListCreate(ctx, dev, desc, ffi.new("ze_command_list_handle_t *"))
    desc = ffi.new("ze_command_queue_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC,
                                                "ordinal": 1, "flags": flags,
                                                "mode": lib.ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS})
    if which == "zeCommandQueueCreate":
        return lib.zeCommandQueueCreate(ctx, dev, desc, ffi.new("ze_command_queue_handle_t *"))
    return lib.zeCommandListCreateImmediate(ctx, dev, desc, ffi.new("ze_command_list_handle_t *"))


@pytest.mark.parametrize("which,flags", _NEWER_FLAGS)
# r79b, fixed in session 39: flags newer than the driver's API version were accepted (only IN_ORDER was
# gated by version); now common._FLAG_MASKS per version
def test_flags_newer_than_a_1_4_driver_are_invalid_enumeration(fresh, which, flags):
    """ze_api.h v1.4 (/usr/include/level_zero/ze_api.h), @returns ZE_RESULT_ERROR_INVALID_ENUMERATION:
    zeEventPoolCreate and zeCommandListCreate "`0x7 < desc->flags`"; zeCommandQueueCreate "`0x1 <
    desc->flags`"; zeCommandListCreateImmediate "`0x1 < altdesc->flags`".  A 1.4 driver knows no
    other flag; nothing is made."""
    lib = fresh(api_version="1.4")
    drv, devs, ctx = _core(lib)
    made = lambda: {k: v for k, v in vars(sim.state()).items() if k != "calls"}    # a refused call counts
    before = made()
    assert _create_with_flags(lib, ctx, devs[0], which, flags) == lib.ZE_RESULT_ERROR_INVALID_ENUMERATION
    assert made() == before


@pytest.mark.parametrize("which,flags", [("zeEventPoolCreate", 0x7), ("zeCommandListCreate", 0x7),
                                         ("zeCommandQueueCreate", 0x1), ("zeCommandListCreateImmediate", 0x1)])
def test_flags_a_1_4_driver_defines_are_taken(fresh, which, flags):
    """The same calls with every flag the v1.4 header defines (pool: HOST_VISIBLE|IPC|KERNEL_TIMESTAMP
    is refused as a combination, so 0x7 is refused for the pool; lists: RELAXED_ORDERING|
    MAXIMIZE_THROUGHPUT|EXPLICIT_ONLY; queues: EXPLICIT_ONLY) behave as documented."""
    lib = fresh(api_version="1.4")
    drv, devs, ctx = _core(lib)
    rc = _create_with_flags(lib, ctx, devs[0], which, flags)
    if which == "zeEventPoolCreate":
        # ze_event_pool_flag_t KERNEL_TIMESTAMP: "cannot be combined with ZE_EVENT_POOL_FLAG_IPC"
        assert rc == lib.ZE_RESULT_ERROR_INVALID_ENUMERATION
        assert _create_with_flags(lib, ctx, devs[0], which, 0x5) == 0
    else:
        assert rc == 0


# -- core rules checked and found enforced (not pinned elsewhere) ----------------------------------

def test_event_pool_and_event_index_rules(fresh):
    """ze_api.h, zeEventPoolCreate: INVALID_SIZE for "`0 == desc->count`"; zeEventCreate's index is
    "[in] index of the event within the pool; must be less-than the count specified during pool
    creation" (no code named: INVALID_ARGUMENT)."""
    lib = fresh()
    drv, devs, ctx = _core(lib)
    desc = ffi.new("ze_event_pool_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_EVENT_POOL_DESC,
                                             "flags": lib.ZE_EVENT_POOL_FLAG_HOST_VISIBLE, "count": 0})
    pool = ffi.new("ze_event_pool_handle_t *")
    assert lib.zeEventPoolCreate(ctx, desc, 0, NULL, pool) == lib.ZE_RESULT_ERROR_INVALID_SIZE
    desc.count = 2
    assert lib.zeEventPoolCreate(ctx, desc, 0, NULL, pool) == 0
    ed = ffi.new("ze_event_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_EVENT_DESC, "index": 2,
                                      "signal": lib.ZE_EVENT_SCOPE_FLAG_HOST, "wait": lib.ZE_EVENT_SCOPE_FLAG_HOST})
    ev = ffi.new("ze_event_handle_t *")
    assert lib.zeEventCreate(pool[0], ed, ev) == lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
    ed.index = 1
    assert lib.zeEventCreate(pool[0], ed, ev) == 0
    # zeEventHostSynchronize with timeout 0: "if zero, then operates exactly like zeEventQueryStatus"
    assert lib.zeEventHostSynchronize(ev[0], 0) == lib.ZE_RESULT_NOT_READY
    assert lib.zeEventQueryStatus(ev[0]) == lib.ZE_RESULT_NOT_READY
    # zeEventQueryKernelTimestamp of a pool without ZE_EVENT_POOL_FLAG_KERNEL_TIMESTAMP: refused
    assert lib.zeEventHostSignal(ev[0]) == 0
    assert lib.zeEventHostSynchronize(ev[0], 0) == 0
    ts = ffi.new("ze_kernel_timestamp_result_t *")
    assert lib.zeEventQueryKernelTimestamp(ev[0], ts) == lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
    assert lib.zeEventDestroy(ev[0]) == 0
    assert lib.zeEventPoolDestroy(pool[0]) == 0


def test_execute_zero_lists_and_close_an_immediate_list_are_refused(fresh):
    """ze_api.h, zeCommandQueueExecuteCommandLists: INVALID_SIZE for "`0 == numCommandLists`".
    zeCommandListClose on an immediate list: the spec closes regular lists for execution
    (PROG.rst, Command Lists); for an immediate list it is silent: refused (INVALID_ARGUMENT), and the
    list keeps working."""
    lib = fresh()
    drv, devs, ctx = _core(lib)
    qd = ffi.new("ze_command_queue_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC, "ordinal": 1,
                                              "mode": lib.ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS})
    q = ffi.new("ze_command_queue_handle_t *")
    assert lib.zeCommandQueueCreate(ctx, devs[0], qd, q) == 0
    lists = ffi.new("ze_command_list_handle_t[1]")
    assert lib.zeCommandQueueExecuteCommandLists(q[0], 0, lists, NULL) == lib.ZE_RESULT_ERROR_INVALID_SIZE
    im = ffi.new("ze_command_list_handle_t *")
    assert lib.zeCommandListCreateImmediate(ctx, devs[0], qd, im) == 0
    assert lib.zeCommandListClose(im[0]) == lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
    md = ffi.new("ze_device_mem_alloc_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC})
    p = ffi.new("void **")
    assert lib.zeMemAllocDevice(ctx, md, 64, 0, devs[0], p) == 0
    pat = ffi.new("uint8_t *", 5)
    assert lib.zeCommandListAppendMemoryFill(im[0], p[0], pat, 1, 64, NULL, 0, NULL) == 0
    assert lib.zeCommandListHostSynchronize(im[0], (1 << 64) - 1) == 0
    assert bytes(ffi.buffer(ffi.cast("char *", p[0]), 64)) == b"\x05" * 64
    for obj, destroy in ((im[0], lib.zeCommandListDestroy), (q[0], lib.zeCommandQueueDestroy)):
        assert destroy(obj) == 0
    assert lib.zeMemFree(ctx, p[0]) == 0


def test_allocation_and_free_rules(fresh):
    """ze_api.h: zeMemAllocDevice / zeMemAllocHost UNSUPPORTED_SIZE for "`0 == size`"; zeMemFree of
    an interior pointer or through another context is refused (its ``ptr`` is "[in][release] pointer to memory to
    free": the allocation's; "must only use the memory allocation for the context ... which was
    provided during allocation"), and the allocation stays usable."""
    lib = fresh()
    drv, devs, ctx = _core(lib)
    md = ffi.new("ze_device_mem_alloc_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC})
    hd = ffi.new("ze_host_mem_alloc_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC})
    p = ffi.new("void **")
    assert lib.zeMemAllocDevice(ctx, md, 0, 0, devs[0], p) == lib.ZE_RESULT_ERROR_UNSUPPORTED_SIZE
    assert lib.zeMemAllocHost(ctx, hd, 0, 0, p) == lib.ZE_RESULT_ERROR_UNSUPPORTED_SIZE
    assert lib.zeMemAllocDevice(ctx, md, 256, 0, devs[0], p) == 0
    other = ffi.new("ze_context_handle_t *")
    assert lib.zeContextCreate(drv, ffi.new("ze_context_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_CONTEXT_DESC}),
                               other) == 0
    assert lib.zeMemFree(ctx, ffi.cast("char *", p[0]) + 64) == lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
    assert lib.zeMemFree(other[0], p[0]) == lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
    assert lib.zeMemFree(ctx, p[0]) == 0
    assert lib.zeMemFree(ctx, p[0]) == lib.ZE_RESULT_ERROR_INVALID_ARGUMENT      # twice
    assert lib.zeContextDestroy(other[0]) == 0


def test_vmm_across_contexts_and_a_readonly_mapping(fresh):
    """ze_api.h, Virtual Memory Management: zeVirtualMemMap / zeVirtualMemUnmap / zeVirtualMemFree /
    zePhysicalMemDestroy take "[in] handle of the context object" the reservation or object was made
    in: another context's physical memory, or the calls through another context, are refused.  A page
    mapped ZE_MEMORY_ACCESS_ATTRIBUTE_READONLY ("the memory page supports read-only access") written
    by a device fill faults the device (DEVICE_LOST)."""
    lib = fresh()
    drv, devs, ctx = _core(lib)
    other = ffi.new("ze_context_handle_t *")
    assert lib.zeContextCreate(drv, ffi.new("ze_context_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_CONTEXT_DESC}),
                               other) == 0
    bad = lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
    out = ffi.new("void **")
    assert lib.zeVirtualMemReserve(ctx, ffi.cast("void *", 1 << 44), 4 * G, out) == 0
    va = out[0]
    pd = ffi.new("ze_physical_mem_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_PHYSICAL_MEM_DESC, "size": 2 * G})
    h_other = ffi.new("ze_physical_mem_handle_t *")
    assert lib.zePhysicalMemCreate(other[0], devs[0], pd, h_other) == 0
    rw, ro = lib.ZE_MEMORY_ACCESS_ATTRIBUTE_READWRITE, lib.ZE_MEMORY_ACCESS_ATTRIBUTE_READONLY
    assert lib.zeVirtualMemMap(ctx, va, 2 * G, h_other[0], 0, rw) == bad
    assert lib.zeVirtualMemMap(other[0], va, 2 * G, h_other[0], 0, rw) == bad
    assert lib.zeVirtualMemUnmap(ctx, ffi.cast("char *", va) + 2 * G, 2 * G) == bad    # nothing mapped
    assert lib.zeVirtualMemFree(ctx, va, 2 * G) == bad                                 # part of it
    assert lib.zeVirtualMemFree(other[0], va, 4 * G) == bad
    assert lib.zePhysicalMemDestroy(ctx, h_other[0]) == bad
    assert lib.zePhysicalMemDestroy(other[0], h_other[0]) == 0
    h = ffi.new("ze_physical_mem_handle_t *")
    assert lib.zePhysicalMemCreate(ctx, devs[0], pd, h) == 0
    assert lib.zeVirtualMemMap(ctx, va, 2 * G, h[0], 0, ro) == 0
    qd = ffi.new("ze_command_queue_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC, "ordinal": 1,
                                              "mode": lib.ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS})
    im = ffi.new("ze_command_list_handle_t *")
    assert lib.zeCommandListCreateImmediate(ctx, devs[0], qd, im) == 0
    pat = ffi.new("uint8_t *", 1)
    assert lib.zeCommandListAppendMemoryFill(im[0], va, pat, 1, 64, NULL, 0, NULL) == 0
    assert lib.zeCommandListHostSynchronize(im[0], (1 << 64) - 1) == lib.ZE_RESULT_ERROR_DEVICE_LOST
    assert any("no write access" in e for e in sim.state().ze_errors)


# -- Metal -----------------------------------------------------------------------------------------

M_QUEUE = _objc.Message("newCommandQueue")
M_CB = _objc.Message("commandBuffer")
M_COMMIT = _objc.Message("commit", "void")
M_WAIT = _objc.Message("waitUntilCompleted", "void")
M_STATUS = _objc.Message("status", "NSUInteger")
M_BLIT = _objc.Message("blitCommandEncoder")
M_COMPUTE = _objc.Message("computeCommandEncoder")
M_END = _objc.Message("endEncoding", "void")
M_FILL = _objc.Message("fillBuffer:range:value:", "void", "id", "NSRange", "uint8_t")
M_NEW_BUFFER = _objc.Message("newBufferWithLength:options:", "id", "NSUInteger", "NSUInteger")
M_CONTENTS = _objc.Message("contents", "void *")
M_SET_PIPELINE = _objc.Message("setComputePipelineState:", "void", "id")
M_SET_BUFFER = _objc.Message("setBuffer:offset:atIndex:", "void", "id", "NSUInteger", "NSUInteger")
M_SET_BYTES = _objc.Message("setBytes:length:atIndex:", "void", "const void *", "NSUInteger", "NSUInteger")
M_DISPATCH = _objc.Message("dispatchThreadgroups:threadsPerThreadgroup:", "void", "MTLSize", "MTLSize")
M_NEW_LIBRARY = _objc.Message("newLibraryWithSource:options:error:", "id", "id", "id", "id *")
M_NEW_FUNCTION = _objc.Message("newFunctionWithName:", "id", "id")
M_NEW_PIPELINE = _objc.Message("newComputePipelineStateWithFunction:error:", "id", "id", "id *")
COMPLETED = 4                                     # MTLCommandBufferStatusCompleted
FILL = "accel_test_fill_u32"                      # (ptr out, u64 n, u32 value), accel.sim.kernels
FILL_MSL = (f"kernel void {FILL}(device uint *out [[buffer(0)]], constant ulong &n [[buffer(1)]], "
            f"constant uint &v [[buffer(2)]], uint i [[thread_position_in_grid]]) {{ if (i < n) out[i] = v; }}\n")


@pytest.fixture
def mtl(monkeypatch):
    """(ffi, objc runtime, system device) of a fresh simulated Metal."""
    monkeypatch.setenv("ACCEL_SIM", "mps")
    sim.reset()
    metal.reset()
    (ffi_, objc_lib, _), (_, metal_lib, _) = metal.open_libraries()
    rt = _objc.Runtime(ffi_, objc_lib)
    yield ffi_, rt, metal_lib.MTLCreateSystemDefaultDevice()
    metal.reset()
    sim.reset()


def _pipeline(ffi_, rt, device):
    with rt.pool():
        err = ffi_.new("void **")
        lib = rt.send(device, M_NEW_LIBRARY, rt.ns_string(FILL_MSL), rt.nil, err)
        assert lib != rt.nil, rt.error_text(err[0])
        fn = rt.send(lib, M_NEW_FUNCTION, rt.ns_string(FILL))
        pipe = rt.send(device, M_NEW_PIPELINE, fn, err)
        rt.release(fn)
        rt.release(lib)
        assert pipe != rt.nil, rt.error_text(err[0])
    return pipe


def test_metal_end_encoding_twice_is_refused_and_the_buffer_still_commits(mtl):
    """MTLCommandEncoder.endEncoding: "Declares that all command generation from the encoder is
    completed"; after it the encoder "can no longer encode commands" -- a second endEncoding is
    refused (Metal's validation asserts), and the command buffer still commits and completes."""
    ffi_, rt, device = mtl
    q = rt.send(device, M_QUEUE)
    buf = rt.send(device, M_NEW_BUFFER, 64, 0)
    with rt.pool():
        cb = rt.send(q, M_CB)
        enc = rt.send(cb, M_BLIT)
        rt.send(enc, M_FILL, buf, ffi_.new("NSRange *", (0, 64))[0], 9)
        rt.send(enc, M_END)
        with pytest.raises(metal.MetalValidationError, match="already ended"):
            rt.send(enc, M_END)
        rt.send(cb, M_COMMIT)
        rt.send(cb, M_WAIT)
        assert int(rt.send(cb, M_STATUS)) == COMPLETED
    p = int(ffi_.cast("uintptr_t", rt.send(buf, M_CONTENTS)))
    assert bytes(ffi_.buffer(ffi_.cast("char *", p), 64)) == b"\x09" * 64
    rt.release(buf)
    rt.release(q)


def test_metal_dispatch_after_its_bound_buffer_was_released_never_runs_on_freed_memory(mtl):
    """A buffer bound with setBuffer:offset:atIndex: and released by the program before the dispatch:
    the simulator refuses the dispatch (retain of a deallocated buffer) rather than run the kernel on
    freed memory.  Apple, MTLCommandQueue makeCommandBuffer(): command buffers it makes "maintain
    strong references to the resources you encode into it, including buffers ... and pipeline
    states"; whether the binding alone is such an encoding is not said, so a Mac may keep the buffer
    alive here: the simulator is stricter (a possible false refusal), never more lenient.  accel binds
    and dispatches under one lock with its buffers alive (mps/kernels.py launch).  The encoder can
    still be ended and the command buffer completes."""
    ffi_, rt, device = mtl
    q = rt.send(device, M_QUEUE)
    pipe = _pipeline(ffi_, rt, device)
    buf = rt.send(device, M_NEW_BUFFER, 64, 0)
    with rt.pool():
        cb = rt.send(q, M_CB)
        enc = rt.send(cb, M_COMPUTE)
        rt.send(enc, M_SET_PIPELINE, pipe)
        rt.send(enc, M_SET_BUFFER, buf, 0, 0)
        rt.release(buf)
        rt.send(enc, M_SET_BYTES, struct.pack("<Q", 16), 8, 1)
        rt.send(enc, M_SET_BYTES, struct.pack("<I", 7), 4, 2)
        sizes = ffi_.new("MTLSize *", (1, 1, 1))[0], ffi_.new("MTLSize *", (16, 1, 1))[0]
        with pytest.raises(metal.MetalValidationError, match="deallocated"):
            rt.send(enc, M_DISPATCH, *sizes)
        rt.send(enc, M_END)
        rt.send(cb, M_COMMIT)
        rt.send(cb, M_WAIT)
        assert int(rt.send(cb, M_STATUS)) == COMPLETED
    rt.release(pipe)
    rt.release(q)


# -- accel relies on none of the leniencies --------------------------------------------------------

def _refuses_non_device(hDevice):
    """The code the fix would answer for ``hDevice`` (0: a card or core device handle)."""
    rt = ze_objects._rt
    obj = rt.objects.get(hDevice) if rt is not None else None
    if obj is not None and obj.kind not in ("card", "device"):
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    return 0


def _strict_sysman_functions():
    """accel.sim.ze's function table with zesDeviceGetProperties and zesDeviceEnumMemoryModules
    refusing a handle that is not a device, as the fix would (same parameters: the library is built
    from each function's own parameter list)."""
    real = {f.__name__: f for f in sim_ze._FUNCTIONS}
    get_props, enum_mem = real["zesDeviceGetProperties"], real["zesDeviceEnumMemoryModules"]

    def zesDeviceGetProperties(hDevice, props):
        return _refuses_non_device(hDevice) or get_props(hDevice, props)

    def zesDeviceEnumMemoryModules(hDevice, pCount, phMemory):
        return _refuses_non_device(hDevice) or enum_mem(hDevice, pCount, phMemory)
    swap = {"zesDeviceGetProperties": zesDeviceGetProperties,
            "zesDeviceEnumMemoryModules": zesDeviceEnumMemoryModules}
    return tuple(swap.get(f.__name__, f) for f in sim_ze._FUNCTIONS)


@pytest.mark.parametrize("legacy", [False, True])
def test_accel_sysman_paths_pass_device_handles_only(monkeypatch, legacy):
    """accel's XPU discovery, mem_info and smi_* readings on a simulator whose zesDeviceGetProperties
    and zesDeviceEnumMemoryModules refuse non-device handles (the fix): they still work, both with
    zesInit and with legacy Sysman (zesInit failing: ZES_ENABLE_SYSMAN on core handles)."""
    monkeypatch.setattr(sim_ze, "_FUNCTIONS", _strict_sysman_functions())
    use_sim(monkeypatch, "xpu")
    try:
        if legacy:
            sim.inject_error("zesInit", 0x78000001, times=-1)
        b = _lazy.lazy_init()
        free, total = b.mem_info()
        assert 0 < free <= total
        ptr = b.mem_alloc(1 << 20)
        assert b.smi_memory_used(0) >= 1 << 20
        assert b.smi_memory_usage(0) >= 0
        assert b.smi_temperature(0) > 0
        b.mem_free(ptr)
    finally:
        sim.clear_faults()
        sim.reset()


def _flag_spies(seen):
    """accel.sim.ze's function table with the four creators recording (name, flags) into ``seen``."""
    real = {f.__name__: f for f in sim_ze._FUNCTIONS}
    pool, lst, queue, imm = (real[n] for n in ("zeEventPoolCreate", "zeCommandListCreate", "zeCommandQueueCreate",
                                               "zeCommandListCreateImmediate"))

    def zeEventPoolCreate(hContext, desc, numDevices, phDevices, phEventPool):
        seen.append(("zeEventPoolCreate", int(desc.flags)))
        return pool(hContext, desc, numDevices, phDevices, phEventPool)

    def zeCommandListCreate(hContext, hDevice, desc, phCommandList):
        seen.append(("zeCommandListCreate", int(desc.flags)))
        return lst(hContext, hDevice, desc, phCommandList)

    def zeCommandQueueCreate(hContext, hDevice, desc, phCommandQueue):
        seen.append(("zeCommandQueueCreate", int(desc.flags)))
        return queue(hContext, hDevice, desc, phCommandQueue)

    def zeCommandListCreateImmediate(hContext, hDevice, altdesc, phCommandList):
        seen.append(("zeCommandListCreateImmediate", int(altdesc.flags)))
        return imm(hContext, hDevice, altdesc, phCommandList)
    swap = {f.__name__: f for f in (zeEventPoolCreate, zeCommandListCreate, zeCommandQueueCreate,
                                    zeCommandListCreateImmediate)}
    return tuple(swap.get(f.__name__, f) for f in sim_ze._FUNCTIONS)


_V1_4_MASK = {"zeEventPoolCreate": 0x7, "zeCommandListCreate": 0x7, "zeCommandQueueCreate": 0x1,
              "zeCommandListCreateImmediate": 0x1}


def test_accel_xpu_streams_and_events_on_a_1_4_driver_pass_only_1_4_flags(monkeypatch):
    """accel on a 1.4 driver (no IN_ORDER, no zeCommandListHostSynchronize): every pool, list and
    queue it creates while streams, events, timing and a graph-free copy run has flags the v1.4
    header defines, so the version rule above refuses nothing it does."""
    seen = []
    monkeypatch.setattr(sim_ze, "_FUNCTIONS", _flag_spies(seen))
    use_sim(monkeypatch, "xpu", ACCEL_SIM_ZE_API="1.4")
    try:
        import accel
        buf = accel.Buffer(256)
        s = accel.Stream()
        start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
        start.record(s)
        buf.fill_(3, stream=s)
        end.record(s)
        end.synchronize()
        assert start.elapsed_time(end) >= 0.0
        assert bytes(buf.to_numpy(stream=s).tobytes()) == b"\x03" * 256
        s.synchronize()
        assert accel.backends.get("xpu").report()["api_version"] == "1.4"
        assert {name for name, _ in seen} >= {"zeEventPoolCreate", "zeCommandListCreateImmediate"}
        assert [(n, f) for n, f in seen if f & ~_V1_4_MASK[n]] == []
        buf.close()
        s.close()
    finally:
        sim.reset()
