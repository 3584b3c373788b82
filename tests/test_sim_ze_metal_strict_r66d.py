"""Level Zero and Metal simulators against the vendor documents, round r66d: rules of functions
accel calls that the earlier audits (tests/test_sim_ze_metal_strict.py, test_ze_metal_strict.py,
test_sim_ze_strict2.py, test_sim_ze_spec_r62d.py, test_sim_metal_*.py) did not cover yet.

Each test calls the simulated library as a Level Zero or Metal program would and failed before
the simulator was fixed (the document is quoted at the test and next to the rule in accel/sim):

* ``zeCommandListAppendWaitOnEvents`` with ``phEvents`` NULL (ze_api.h: INVALID_NULL_POINTER for
  ``nullptr == phEvents``, whatever the count) was taken as an empty wait;
* ``zeCommandQueueExecuteCommandLists`` with ``phCommandLists`` NULL raised a Python error out of the
  driver instead of INVALID_NULL_POINTER;
* ``zeKernelCreate`` took ``desc->flags`` above 0x3 (ze_api.h: INVALID_ENUMERATION);
* ``zeEventQueryKernelTimestamp`` answered for an event of a pool without
  ``ZE_EVENT_POOL_FLAG_HOST_VISIBLE``, whose signal state the host cannot see (zeEventQueryStatus
  already refused it);
* Metal: ``newBufferWithBytes:length:options:`` copied CPU bytes into private storage ("Private
  resources aren't CPU-accessible"), and ``MTLResourceHazardTrackingModeUntracked`` buffers were
  made and then tracked anyway (the simulator orders every command, so a missing fence never
  showed).

Last, accel's own paths (the xpu and mps backends) still run on the stricter simulators.
"""

import numpy as np
import pytest

import accel
from accel import sim
from accel.backends import _objc
from accel.sim import metal
from conftest import use_sim
from test_sim_ze_metal_strict import M_NEW_BUFFER, ffi, mtl, ze  # noqa: F401 (mtl, ze: the fixtures)
from test_user_kernels import spirv_module

_UINT64_MAX = (1 << 64) - 1
FILL = "accel_test_fill_u32"     # registered by accel.sim: fill(ptr out, u64 n, u32 value)

M_NEW_BUFFER_BYTES = _objc.Message("newBufferWithBytes:length:options:", "id", "const void *",
                                   "NSUInteger", "NSUInteger")
SHARED, PRIVATE = 0x00, 0x20                       # MTLResourceStorageMode{Shared,Private} << 4
UNTRACKED, TRACKED = 0x100, 0x200                  # MTLResourceHazardTrackingMode{Untracked,Tracked} << 8


# -- Level Zero --------------------------------------------------------------------------------

def test_wait_on_events_with_a_null_array_is_refused(ze):
    """ze_api.h, zeCommandListAppendWaitOnEvents @returns: ZE_RESULT_ERROR_INVALID_NULL_POINTER for
    `nullptr == phEvents` (no count condition, unlike the `(nullptr == phWaitEvents) && (0 <
    numWaitEvents)` of the other appends). The simulator appended an empty wait."""
    z = ze()
    lib = z.lib
    cl = z.immediate()
    for count in (0, 1):
        assert lib.zeCommandListAppendWaitOnEvents(cl, count, ffi.NULL) == lib.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    # an array, even of no events, is within the rules, and the list still works
    assert lib.zeCommandListAppendWaitOnEvents(cl, 0, ffi.new("ze_event_handle_t[1]")) == 0
    p = z.alloc(64)
    assert z.fill(cl, p, 64, 7) == 0
    assert lib.zeCommandListHostSynchronize(cl, _UINT64_MAX) == 0
    assert bytes(ffi.buffer(ffi.cast("char *", p), 64)) == b"\x07" * 64


def test_execute_with_a_null_list_array_is_refused_with_a_code(ze):
    """ze_api.h, zeCommandQueueExecuteCommandLists @returns: INVALID_NULL_POINTER for `nullptr ==
    phCommandLists`. The simulator dereferenced it and raised a Python RuntimeError out of the
    driver call."""
    z = ze()
    lib = z.lib
    q = z.queue()
    assert lib.zeCommandQueueExecuteCommandLists(q, 1, ffi.NULL, ffi.NULL) == lib.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    # the queue is untouched: a closed list still executes on it
    cl = z.regular()
    p = z.alloc(64)
    assert z.fill(cl, p, 64, 3) == 0
    assert lib.zeCommandListClose(cl) == 0
    assert lib.zeCommandQueueExecuteCommandLists(q, 1, ffi.new("ze_command_list_handle_t[1]", [cl]), ffi.NULL) == 0
    assert lib.zeCommandQueueSynchronize(q, _UINT64_MAX) == 0
    assert bytes(ffi.buffer(ffi.cast("char *", p), 64)) == b"\x03" * 64


def _module(z, dev=0):
    image = spirv_module(FILL)
    data = ffi.new("uint8_t[]", image)
    desc = ffi.new("ze_module_desc_t *", {"stype": z.lib.ZE_STRUCTURE_TYPE_MODULE_DESC,
                                         "format": z.lib.ZE_MODULE_FORMAT_IL_SPIRV, "inputSize": len(image),
                                         "pInputModule": data})
    p = ffi.new("ze_module_handle_t *")
    assert z.lib.zeModuleCreate(z.ctx, z.devices[dev], desc, p, ffi.NULL) == 0
    return p[0]


@pytest.mark.parametrize("flags", [0x4, 0x8, 0x80000000])
def test_kernel_create_flags_beyond_the_spec_are_refused(ze, flags):
    """ze_api.h, zeKernelCreate @returns: ZE_RESULT_ERROR_INVALID_ENUMERATION for `0x3 <
    desc->flags` (ze_kernel_flag_t: FORCE_RESIDENCY 0x1, EXPLICIT_RESIDENCY 0x2). The simulator
    made the kernel."""
    z = ze()
    lib = z.lib
    mod = _module(z)
    name = ffi.new("char[]", FILL.encode())
    desc = ffi.new("ze_kernel_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_KERNEL_DESC, "flags": flags,
                                         "pKernelName": name})
    k = ffi.new("ze_kernel_handle_t *")
    assert lib.zeKernelCreate(mod, desc, k) == lib.ZE_RESULT_ERROR_INVALID_ENUMERATION
    assert sim.state().ze_live_kernels == 0
    desc.flags = 0x3          # both defined flags: made
    assert lib.zeKernelCreate(mod, desc, k) == 0
    assert lib.zeKernelDestroy(k[0]) == 0
    assert lib.zeModuleDestroy(mod) == 0


def test_kernel_timestamp_of_an_event_the_host_cannot_see_is_refused(ze):
    """ze_api.h, zeEventQueryKernelTimestamp: "Queries an event's timestamp value on the host",
    ZE_RESULT_NOT_READY while "not signaled" -- a host reading of the signal state, which only
    ZE_EVENT_POOL_FLAG_HOST_VISIBLE makes "also visible to host". zeEventQueryStatus already refused
    such an event (INVALID_ARGUMENT); the timestamp query answered for it."""
    z = ze()
    lib = z.lib
    cl = z.immediate()
    p = z.alloc(64)
    hidden = z.pool(flags=lib.ZE_EVENT_POOL_FLAG_KERNEL_TIMESTAMP)
    seen = z.pool(flags=lib.ZE_EVENT_POOL_FLAG_KERNEL_TIMESTAMP | lib.ZE_EVENT_POOL_FLAG_HOST_VISIBLE)
    ev_hidden, ev_seen = z.event(hidden), z.event(seen)
    assert z.fill(cl, p, 64, 1, ev_hidden) == 0
    assert z.fill(cl, p, 64, 2, ev_seen) == 0
    assert lib.zeCommandListHostSynchronize(cl, _UINT64_MAX) == 0
    ts = ffi.new("ze_kernel_timestamp_result_t *")
    assert lib.zeEventQueryStatus(ev_hidden) == lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
    assert lib.zeEventQueryKernelTimestamp(ev_hidden, ts) == lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
    assert lib.zeEventQueryKernelTimestamp(ev_seen, ts) == 0
    assert ts.context.kernelEnd >= ts.context.kernelStart
    for ev, pool in ((ev_hidden, hidden), (ev_seen, seen)):
        assert lib.zeEventDestroy(ev) == 0
        assert lib.zeEventPoolDestroy(pool) == 0


# -- Metal -------------------------------------------------------------------------------------

def test_buffer_with_bytes_in_private_storage_is_refused(mtl):
    """Apple, newBufferWithBytes:length:options: "initializes its contents by copying existing data
    into it" (a CPU copy), and MTLBuffer.contents: "Private resources aren't CPU-accessible". The
    documentation is silent on private storage here (Metal's API validation asserts): refused.
    The simulator copied the bytes into the private buffer. Shared storage is unchanged."""
    rt = mtl.rt
    data = mtl.ffi.new("uint8_t[]", bytes(range(64)))
    before = metal.state().live_counts()
    with pytest.raises(metal.MetalValidationError, match="private"):
        rt.release(rt.send(mtl.device, M_NEW_BUFFER_BYTES, data, 64, PRIVATE))
    assert metal.state().live_counts() == before
    buf = rt.send(mtl.device, M_NEW_BUFFER_BYTES, data, 64, SHARED)
    assert buf
    rt.release(buf)


@pytest.mark.parametrize("how", ["withLength", "withBytes"])
def test_untracked_buffers_are_refused_not_silently_tracked(mtl, how):
    """Apple, MTLHazardTrackingMode.untracked: "Metal doesn't track memory dependencies for untracked
    resources, which means you're responsible for ensuring that commands access those resources
    safely with barriers, fences, or events." The simulator made the buffer and then ordered every
    command as if tracked, so a program missing its fences passed: refused (not simulated), as
    managed storage is. Default (0) and explicitly tracked (0x200) buffers are still made."""
    rt = mtl.rt
    data = mtl.ffi.new("uint8_t[]", 64)

    def make(options):
        if how == "withLength":
            return rt.send(mtl.device, M_NEW_BUFFER, 64, options)
        return rt.send(mtl.device, M_NEW_BUFFER_BYTES, data, 64, options)
    before = metal.state().live_counts()
    for options in (UNTRACKED, UNTRACKED | PRIVATE):
        if how == "withBytes" and options & PRIVATE:
            continue
        with pytest.raises(metal.MetalValidationError, match="Untracked"):
            rt.release(make(options))
    assert metal.state().live_counts() == before
    for options in (0, TRACKED):
        buf = make(options)
        assert buf
        rt.release(buf)


# -- accel on the stricter simulators -----------------------------------------------------------

@pytest.mark.parametrize("kind", ["xpu", "mps"])
def test_accel_streams_events_timing_and_kernels_run_on_the_stricter_simulators(monkeypatch, kind):
    """accel's paths that reach the rules above: cross-stream waits (zeCommandListAppendWaitOnEvents
    / encodeWaitForEvent), timed events (zeEventQueryKernelTimestamp), kernels (zeKernelCreate),
    graph replays (zeCommandQueueExecuteCommandLists) on xpu; buffers and staging copies
    (newBufferWithBytes) on mps."""
    use_sim(monkeypatch, kind)
    rng = np.random.default_rng(66)
    host = rng.integers(0, 255, 4096, dtype=np.uint8)
    s1, s2 = accel.Stream(), accel.Stream()
    a, b = accel.Buffer(4096), accel.Buffer(4096)
    start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    start.record(s1)
    a.copy_from(host, stream=s1)
    end.record(s1)
    s2.wait_event(end)
    b.copy_from(a, stream=s2)
    assert (b.to_numpy(stream=s2) == host).all()
    end.synchronize()
    assert start.elapsed_time(end) >= 0.0
    msl = ("kernel void accel_test_fill_u32(device uint *out [[buffer(0)]], constant ulong &n [[buffer(1)]],\n"
           "                                constant uint &value [[buffer(2)]]) {}\n")
    k = accel.Module(spirv_module(FILL) if kind == "xpu" else msl).function(FILL, "ptr, u64, u32")
    accel.launch(k, 1, 64, a, 64, 0x66D)
    assert (a.to_numpy(dtype="uint32")[:64] == 0x66D).all()
    if kind == "xpu":
        g = accel.Graph()
        b.fill_(0)
        accel.synchronize()
        with accel.graph(g, stream=s1):
            b.copy_from(a, stream=s1)
        g.replay()
        accel.synchronize()
        assert (b.to_numpy() == a.to_numpy()).all()
