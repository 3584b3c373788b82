"""Level Zero simulator against the specification, round r62d: calls the simulator accepted that
ze_api.h (Level Zero 1.17, oneapi-src/level-zero include/ze_api.h; older headers such as the 1.4
one in /usr/include/level_zero allow fewer flag bits, never more) forbids or leaves undefined.

Each finding quotes the rule and is called through the simulated loader as a Level Zero program
calls it (device 1 where a device matters, device 0 being current).  Each was a strict xfail
first (22 cases), until accel/sim/ze and accel/sim/_ze_kernels.py enforced it.  The last test runs
accel's public API through the simulator: accel meets none of these rules (it ran first through
wrappers enforcing them, with no refusal).

Rules the simulator already enforces (tests/test_sim_ze_strict2.py, test_ze_metal_strict.py,
test_sim_ze_metal_strict.py, test_vmm_ze.py) are not repeated; checked again here on device 1
(passing): a regular list appended to after close, executed unclosed, reset / destroyed / executed
again / its memory freed while executing, executed on a queue of another ordinal or device,
immediate lists refused by execute; signalling a signalled event ("Signaling a signaled event ...
is valid and has no effect", PROG.rst, Events: must stay accepted); zeMemGetAllocProperties on an
interior pointer; kernel timestamps of a signalling barrier or copy.
"""

import numpy as np
import pytest

import accel
from accel import sim
from accel.sim import ze as sim_ze
from conftest import use_sim
from test_sim_ze_metal_strict import ffi, ze  # noqa: F401 (ze: the fixture)
from test_ze_metal_strict import _kernel

_UINT64_MAX = (1 << 64) - 1
_PAGE = 2 << 20
_COPY_ORDINAL, _COMPUTE_ORDINAL = 0, 1     # the simulated queue groups (sim/ze/discovery.py _GROUPS)


def _queue_desc(lib, **kw):
    fields = {"stype": lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC, "ordinal": _COMPUTE_ORDINAL,
              "mode": lib.ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS}
    fields.update(kw)
    return ffi.new("ze_command_queue_desc_t *", fields)


def _create_queue(z, dev=1, **kw):
    p = ffi.new("ze_command_queue_handle_t *")
    return z.lib.zeCommandQueueCreate(z.ctx, z.devices[dev], _queue_desc(z.lib, **kw), p), p[0]


def _create_immediate(z, dev=1, **kw):
    p = ffi.new("ze_command_list_handle_t *")
    return z.lib.zeCommandListCreateImmediate(z.ctx, z.devices[dev], _queue_desc(z.lib, **kw), p), p[0]


def _create_regular(z, dev=1, ordinal=_COMPUTE_ORDINAL, flags=0):
    lib = z.lib
    desc = ffi.new("ze_command_list_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_COMMAND_LIST_DESC,
                                               "commandQueueGroupOrdinal": ordinal, "flags": flags})
    p = ffi.new("ze_command_list_handle_t *")
    return lib.zeCommandListCreate(z.ctx, z.devices[dev], desc, p), p[0]


def _live(z):
    st = sim_ze.state()
    return (st["ze_live_command_lists"], st["ze_live_command_queues"], st["ze_live_events"],
            st["ze_live_event_pools"], st["ze_live_allocations"])


# -- passing: rules the simulator enforces (checked here on device 1) -----------------------------

def test_regular_list_state_rules_on_device_1(ze):
    z = ze()
    lib = z.lib
    rc, cl = _create_regular(z)
    assert rc == 0
    rc, q = _create_queue(z)
    assert rc == 0
    p = z.alloc(dev=1)
    lists = ffi.new("ze_command_list_handle_t[1]", [cl])
    assert z.fill(cl, p) == 0
    # "The application is responsible for calling close before submission" (PROG.rst, Submission)
    assert lib.zeCommandQueueExecuteCommandLists(q, 1, lists, ffi.NULL) == lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
    assert lib.zeCommandListClose(cl) == 0
    assert z.fill(cl, p) == lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
    # held on the device by a wait on a gate only the test signals (an immediate list can't be executed)
    rc, gated = _create_regular(z)
    pool = z.pool(1)
    gate = z.event(pool)
    assert lib.zeCommandListAppendWaitOnEvents(gated, 1, ffi.new("ze_event_handle_t[1]", [gate])) == 0
    assert lib.zeCommandListClose(gated) == 0
    both = ffi.new("ze_command_list_handle_t[2]", [gated, cl])
    assert lib.zeCommandQueueExecuteCommandLists(q, 2, both, ffi.NULL) == 0
    # zeCommandListReset / Destroy: "The application must ensure the device is not currently
    # referencing the command list"; zeCommandQueueExecuteCommandLists likewise.
    assert lib.zeCommandListReset(cl) == lib.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    assert lib.zeCommandListDestroy(cl) == lib.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    assert lib.zeCommandQueueExecuteCommandLists(q, 1, lists, ffi.NULL) == lib.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    assert lib.zeMemFree(z.ctx, p) == lib.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    assert lib.zeEventHostSignal(gate) == 0
    assert lib.zeCommandQueueSynchronize(q, _UINT64_MAX) == 0
    assert lib.zeCommandListReset(cl) == 0
    # another ordinal, device or context: "must only execute command lists created with an
    # identical command queue group ordinal", "... command queue, command list and fence were
    # created on the same context", lists "accessible by the device on which the command queue
    # was created"
    rc, copy_list = _create_regular(z, ordinal=_COPY_ORDINAL)
    rc0, dev0_list = _create_regular(z, dev=0)
    for other in (copy_list, dev0_list):
        assert lib.zeCommandListClose(other) == 0
        assert lib.zeCommandQueueExecuteCommandLists(q, 1, ffi.new("ze_command_list_handle_t[1]", [other]),
                                                     ffi.NULL) == lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
    # "Immediate command lists must not be passed to zeCommandQueueExecuteCommandLists"
    imm = z.immediate(dev=1)
    assert lib.zeCommandQueueExecuteCommandLists(q, 1, ffi.new("ze_command_list_handle_t[1]", [imm]),
                                                 ffi.NULL) == lib.ZE_RESULT_ERROR_INVALID_COMMAND_LIST_TYPE
    for h in (cl, gated, copy_list, dev0_list, imm):
        assert lib.zeCommandListDestroy(h) == 0
    assert lib.zeEventDestroy(gate) == 0 and lib.zeEventPoolDestroy(pool) == 0
    assert lib.zeCommandQueueDestroy(q) == 0 and lib.zeMemFree(z.ctx, p) == 0


def test_signalling_a_signalled_event_is_valid(ze):
    """PROG.rst, Events: "Signaling a signaled event (or resetting an unsignaled event) is valid
    and has no effect on the state of the event." -- the simulator must not refuse it."""
    z = ze()
    lib = z.lib
    cl = z.immediate(dev=1)
    ev = z.event(z.pool(1))
    assert lib.zeEventHostReset(ev) == 0
    assert lib.zeEventHostSignal(ev) == 0 and lib.zeEventHostSignal(ev) == 0
    assert lib.zeCommandListAppendSignalEvent(cl, ev) == 0
    assert lib.zeCommandListAppendSignalEvent(cl, ev) == 0
    assert lib.zeCommandListHostSynchronize(cl, _UINT64_MAX) == 0
    assert lib.zeEventQueryStatus(ev) == 0


def test_alloc_properties_of_an_interior_pointer_name_the_allocation(ze):
    z = ze()
    lib = z.lib
    p = z.alloc(4096, dev=1)
    props = ffi.new("ze_memory_allocation_properties_t *", {"stype": lib.ZE_STRUCTURE_TYPE_MEMORY_ALLOCATION_PROPERTIES})
    dev = ffi.new("ze_device_handle_t *")
    assert lib.zeMemGetAllocProperties(z.ctx, ffi.cast("char *", p) + 1000, props, dev) == 0
    assert props.type == lib.ZE_MEMORY_TYPE_DEVICE and dev[0] == z.devices[1]
    assert props.id == int(ffi.cast("uintptr_t", p))


# -- strict xfails: what the simulator accepts and the specification forbids ------------------------

_PRIORITY = "ze_api.h, zeCommandQueueCreate / zeCommandListCreateImmediate @returns ZE_RESULT_ERROR_INVALID_ENUMERATION "


@pytest.mark.parametrize("create, field", [("queue", "priority"), ("queue", "mode"), ("queue", "flags"),
                                           ("immediate", "priority"), ("immediate", "flags")])
def test_queue_descriptor_enumerations_beyond_the_spec_are_refused(ze, create, field):
    z = ze()
    lib = z.lib
    bad = {"priority": lib.ZE_COMMAND_QUEUE_PRIORITY_PRIORITY_HIGH + 1,
           "mode": lib.ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS + 1, "flags": 0x100}[field]
    before = _live(z)
    rc, h = (_create_queue if create == "queue" else _create_immediate)(z, **{field: bad})
    assert rc == lib.ZE_RESULT_ERROR_INVALID_ENUMERATION, f"{field}={bad} accepted (rc {rc:#x})"
    assert _live(z) == before


def test_immediate_list_mode_beyond_the_spec_is_refused(ze):
    z = ze()
    before = _live(z)
    rc, h = _create_immediate(z, mode=z.lib.ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS + 1)
    assert rc == z.lib.ZE_RESULT_ERROR_INVALID_ENUMERATION and _live(z) == before


@pytest.mark.parametrize("create", ["queue", "immediate"])
def test_queue_index_beyond_the_group_is_refused(ze, create):
    z = ze()
    before = _live(z)
    rc, h = (_create_queue if create == "queue" else _create_immediate)(z, index=7)
    assert rc != 0, "index 7 of a one-queue group accepted"
    assert _live(z) == before


@pytest.mark.parametrize("flags", [0x100, "in_order|relaxed"])
def test_command_list_flags_beyond_the_spec_are_refused(ze, flags):
    z = ze()
    lib = z.lib
    if flags == "in_order|relaxed":
        flags = lib.ZE_COMMAND_LIST_FLAG_IN_ORDER | lib.ZE_COMMAND_LIST_FLAG_RELAXED_ORDERING
    before = _live(z)
    rc, h = _create_regular(z, flags=flags)
    assert rc != 0, f"flags {flags:#x} accepted"
    assert _live(z) == before


@pytest.mark.parametrize("field", ["signal", "wait"])
def test_event_scope_flags_beyond_the_spec_are_refused(ze, field):
    z = ze()
    lib = z.lib
    pool = z.pool(1)
    desc = ffi.new("ze_event_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_EVENT_DESC, "index": 0, field: 0x8})
    p = ffi.new("ze_event_handle_t *")
    before = _live(z)
    assert lib.zeEventCreate(pool, desc, p) == lib.ZE_RESULT_ERROR_INVALID_ENUMERATION
    assert _live(z) == before


def test_event_pool_with_a_device_count_and_no_device_array_is_refused(ze):
    z = ze()
    lib = z.lib
    desc = ffi.new("ze_event_pool_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_EVENT_POOL_DESC,
                                             "flags": lib.ZE_EVENT_POOL_FLAG_HOST_VISIBLE, "count": 1})
    p = ffi.new("ze_event_pool_handle_t *")
    before = _live(z)
    assert lib.zeEventPoolCreate(z.ctx, desc, 2, ffi.NULL, p) == lib.ZE_RESULT_ERROR_INVALID_SIZE
    assert _live(z) == before


_MAPPED_TIMESTAMP = 0x8   # ZE_EVENT_POOL_FLAG_KERNEL_MAPPED_TIMESTAMP (API 1.6; not in accel's generated FFI)


def test_event_pool_with_both_timestamp_kinds_is_refused(ze):
    z = ze()
    lib = z.lib
    flags = lib.ZE_EVENT_POOL_FLAG_HOST_VISIBLE | lib.ZE_EVENT_POOL_FLAG_KERNEL_TIMESTAMP | _MAPPED_TIMESTAMP
    desc = ffi.new("ze_event_pool_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_EVENT_POOL_DESC,
                                             "flags": flags, "count": 1})
    p = ffi.new("ze_event_pool_handle_t *")
    before = _live(z)
    assert lib.zeEventPoolCreate(z.ctx, desc, 0, ffi.NULL, p) != 0, "KERNEL_TIMESTAMP | KERNEL_MAPPED_TIMESTAMP accepted"
    assert _live(z) == before


def test_context_flags_beyond_the_spec_are_refused(ze):
    z = ze()
    lib = z.lib
    desc = ffi.new("ze_context_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_CONTEXT_DESC, "flags": 0x2})
    p = ffi.new("ze_context_handle_t *")
    assert lib.zeContextCreate(z.driver, desc, p) == lib.ZE_RESULT_ERROR_INVALID_ENUMERATION


@pytest.mark.parametrize("kind", ["immediate", "regular"])
def test_fill_at_a_pointer_not_aligned_to_the_pattern_is_refused(ze, kind):
    z = ze()
    lib = z.lib
    cl = z.immediate(dev=1) if kind == "immediate" else _create_regular(z)[1]
    p = z.alloc(256, dev=1)
    pat = ffi.new("uint32_t *", 0x01020304)
    rc = lib.zeCommandListAppendMemoryFill(cl, ffi.cast("char *", p) + 2, pat, 4, 64, ffi.NULL, 0, ffi.NULL)
    if kind == "immediate":
        assert lib.zeCommandListHostSynchronize(cl, _UINT64_MAX) == 0
    assert rc == lib.ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT
    # aligned to the pattern: accepted
    assert lib.zeCommandListAppendMemoryFill(cl, ffi.cast("char *", p) + 4, pat, 4, 64, ffi.NULL, 0, ffi.NULL) == 0


def test_alloc_properties_through_another_context_are_unknown(ze):
    z = ze()
    lib = z.lib
    other = z.context()
    p = z.alloc(dev=1, ctx=other)
    props = ffi.new("ze_memory_allocation_properties_t *", {"stype": lib.ZE_STRUCTURE_TYPE_MEMORY_ALLOCATION_PROPERTIES})
    assert lib.zeMemGetAllocProperties(z.ctx, p, props, ffi.NULL) == 0
    assert props.type == lib.ZE_MEMORY_TYPE_UNKNOWN


def test_alloc_properties_of_a_null_pointer_are_refused(ze):
    z = ze()
    lib = z.lib
    props = ffi.new("ze_memory_allocation_properties_t *", {"stype": lib.ZE_STRUCTURE_TYPE_MEMORY_ALLOCATION_PROPERTIES})
    assert lib.zeMemGetAllocProperties(z.ctx, ffi.NULL, props, ffi.NULL) == lib.ZE_RESULT_ERROR_INVALID_NULL_POINTER


@pytest.mark.parametrize("kind", ["immediate", "regular"])
def test_kernel_launch_on_a_copy_only_list_is_refused(ze, kind):
    z = ze()
    lib = z.lib
    ran = []
    sim.register_kernel("r62d_mark", lambda grid, block, view, p: ran.append(1), "ptr")
    try:
        mod, k = _kernel(z, "r62d_mark", dev=1)
        p = z.alloc(dev=1)
        assert lib.zeKernelSetGroupSize(k[0], 1, 1, 1) == 0
        assert lib.zeKernelSetArgumentValue(k[0], 0, 8, ffi.new("void **", p)) == 0
        if kind == "immediate":
            rc, cl = _create_immediate(z, ordinal=_COPY_ORDINAL)
        else:
            rc, cl = _create_regular(z, ordinal=_COPY_ORDINAL)
        assert rc == 0
        args = ffi.new("ze_group_count_t *", (1, 1, 1))
        rc = lib.zeCommandListAppendLaunchKernel(cl, k[0], args, ffi.NULL, 0, ffi.NULL)
        if kind == "immediate":
            assert lib.zeCommandListHostSynchronize(cl, _UINT64_MAX) == 0
        assert rc == lib.ZE_RESULT_ERROR_INVALID_ARGUMENT and not ran
        assert lib.zeCommandListDestroy(cl) == 0
        assert lib.zeKernelDestroy(k[0]) == 0 and lib.zeModuleDestroy(mod) == 0
    finally:
        sim.unregister_kernel("r62d_mark")


def _timestamp(lib, ev):
    ts = ffi.new("ze_kernel_timestamp_result_t *")
    return lib.zeEventQueryKernelTimestamp(ev, ts), ts


@pytest.mark.parametrize("how", ["append_signal", "host_signal"])
def test_kernel_timestamp_of_a_plain_signal_is_not_a_plausible_value(ze, how):
    z = ze()
    lib = z.lib
    cl = z.immediate(dev=1)
    ev = z.event(z.pool(1, flags=lib.ZE_EVENT_POOL_FLAG_HOST_VISIBLE | lib.ZE_EVENT_POOL_FLAG_KERNEL_TIMESTAMP))
    if how == "append_signal":
        assert lib.zeCommandListAppendSignalEvent(cl, ev) == 0
        assert lib.zeCommandListHostSynchronize(cl, _UINT64_MAX) == 0
    else:
        assert lib.zeEventHostSignal(ev) == 0
    assert lib.zeEventQueryStatus(ev) == 0    # "the event will report correctly as signaled"
    rc, ts = _timestamp(lib, ev)
    assert rc != 0, ("undefined timestamps answered as a valid zero-length interval: "
                     f"{getattr(ts, 'global').kernelStart}..{getattr(ts, 'global').kernelEnd}")


def test_kernel_timestamp_of_a_signalling_barrier_or_copy_is_valid(ze):
    """Timestamps of real commands (what accel records with: a barrier that signals, as SYCL's
    profiled barrier) stay valid and ordered."""
    z = ze()
    lib = z.lib
    cl = z.immediate(dev=1)
    pool = z.pool(2, flags=lib.ZE_EVENT_POOL_FLAG_HOST_VISIBLE | lib.ZE_EVENT_POOL_FLAG_KERNEL_TIMESTAMP)
    a, b = z.event(pool, 0), z.event(pool, 1)
    assert lib.zeCommandListAppendBarrier(cl, a, 0, ffi.NULL) == 0
    assert z.fill(cl, z.alloc(dev=1), signal=b) == 0
    assert lib.zeCommandListHostSynchronize(cl, _UINT64_MAX) == 0
    (ra, ta), (rb, tb) = _timestamp(lib, a), _timestamp(lib, b)
    assert ra == rb == 0
    assert getattr(ta, "global").kernelEnd <= getattr(tb, "global").kernelEnd


# -- accel through a simulator strict on every rule above ------------------------------------------

def _accel_workload():
    """accel's public API on device 1 while device 0 is current: allocations, fills, copies,
    pinned staging, streams of every priority, events (timing and not) across streams, a graph
    captured and replayed, a kernel launch, pointer queries and DLPack."""
    from test_user_kernels import spirv_module
    assert accel.current_device_index() == 0
    out = {}
    streams = [accel.Stream(device=1, priority=p) for p in (1, 0, -1)]
    s = streams[-1]
    data = np.arange(1024, dtype=np.float32)
    b = accel.Buffer(4096, device=1, stream=s)
    b.copy_from(data, stream=s, non_blocking=True)
    c = accel.Buffer(4096, device=1, stream=s)
    c.fill_(7, stream=s)
    c.copy_from(b, stream=s)
    start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    start.record(s)
    b.fill_(1, stream=s)
    end.record(s)
    plain = accel.Event()
    plain.record(s)
    streams[0].wait_event(plain)
    end.synchronize()
    out["elapsed"] = start.elapsed_time(end)
    out["copy"] = c.to_numpy(np.float32, stream=s)[:4].tolist()
    g = accel.Graph()
    with s, g:
        b.fill_(3)
    with s:
        g.replay()
    out["graph"] = b.to_numpy(np.uint8, stream=s)[:2].tolist()
    pinned = accel.empty_pinned(4096)
    pinned[:] = 5
    c.copy_from(pinned, stream=s, non_blocking=True)
    out["pinned"] = c.to_numpy(np.uint8, stream=s)[:2].tolist()
    sim.register_kernel("r62d_inc", lambda grid, block, view, p, n: view(p, 4 * n, np.float32).__iadd__(1),
                        "ptr, u64", replace=True)
    try:
        k = accel.Module(spirv_module("r62d_inc"), device=1).function("r62d_inc", "ptr, u64")
        accel.launch(k, 1, 64, b, 1024, stream=s)
        out["kernel"] = b.to_numpy(np.float32, stream=s)[:2].tolist()
    finally:
        sim.unregister_kernel("r62d_inc")
    out["dlpack"] = tuple(b.__dlpack_device__())
    s.synchronize()
    assert accel.current_device_index() == 0
    return out


@pytest.mark.parametrize("env", [{}, {"ACCEL_SIM_ZE_API": "1.5", "ACCEL_SIM_ZE_LOADER": "1.8.12"},
                                 {"ACCEL_SIM_ZE_TILES": "2", "ZE_FLAT_DEVICE_HIERARCHY": "COMPOSITE"}],
                         ids=["api-1.x", "api-1.5-old-loader", "composite-2-tiles"])
def test_accel_never_meets_the_stricter_rules(monkeypatch, env):
    """accel's XPU backend through the simulator that enforces every rule above: the same results
    (a new driver; a pre-1.6 driver under the 1.8.12 loader, ordered with barriers; two-tile cards
    as root devices).  (r62d ran it first with the rules as wrappers, and saw no refusal.)"""
    use_sim(monkeypatch, "xpu", **env)
    out = _accel_workload()
    assert out["copy"] == [0.0, 1.0, 2.0, 3.0] and out["graph"] == [3.0, 3.0]
    assert out["pinned"] == [5, 5] and out["kernel"] == [1.0, 1.0] and out["elapsed"] >= 0
    accel.synchronize(1)
