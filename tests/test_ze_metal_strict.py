"""Round two of the Level Zero and Metal strictness audit (task r14): rules the simulators did
not enforce yet, each checked through the simulated library as a program calls it, and, where
accel relied on the leniency, through accel.

The fixtures (``ze``, ``mtl``) are those of tests/test_sim_ze_metal_strict.py.
"""

import threading

import pytest

from accel import backends, sim
from accel._errors import CaptureError
from conftest import use_sim
from test_sim_ze_metal_strict import ffi, ze  # noqa: F401 (ze: the fixture)

_UINT64_MAX = (1 << 64) - 1


def _gate(z, cl, pool, index=0):
    """Hold immediate list ``cl`` at a wait on an event only the test signals."""
    gate = z.event(pool, index)
    assert z.lib.zeCommandListAppendWaitOnEvents(cl, 1, ffi.new("ze_event_handle_t[1]", [gate])) == 0
    return gate


def _addr(p) -> int:
    return int(ffi.cast("uintptr_t", p))


# -- memory allocation -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["device", "host"])
@pytest.mark.parametrize("alignment", [512, 4096, 65536, 1 << 21])
def test_allocations_honour_the_requested_alignment(ze, kind, alignment):
    z = ze()
    lib = z.lib
    p = ffi.new("void **")
    # ze_api.h, zeMemAllocDevice/zeMemAllocHost: alignment is the "minimum alignment in bytes for
    # the allocation"; the simulator handed out 256-byte aligned pointers whatever was asked.
    if kind == "device":
        desc = ffi.new("ze_device_mem_alloc_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC})
        assert lib.zeMemAllocDevice(z.ctx, desc, 64, alignment, z.devices[1], p) == 0
    else:
        desc = ffi.new("ze_host_mem_alloc_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC})
        assert lib.zeMemAllocHost(z.ctx, desc, 64, alignment, p) == 0
    assert _addr(p[0]) % alignment == 0
    cl = z.immediate(dev=1)
    assert z.fill(cl, p[0], 64, 5) == 0          # the whole allocation is usable
    assert lib.zeCommandListHostSynchronize(cl, _UINT64_MAX) == 0
    assert bytes(ffi.buffer(ffi.cast("char *", p[0]), 64)) == b"\x05" * 64
    assert lib.zeMemFree(z.ctx, p[0]) == 0


def test_allocation_flags_beyond_the_spec_are_refused(ze):
    z = ze()
    lib = z.lib
    p = ffi.new("void **")
    # ze_api.h, zeMemAllocDevice: ZE_RESULT_ERROR_INVALID_ENUMERATION "0x7 < device_desc->flags";
    # zeMemAllocHost: "0xf < host_desc->flags".
    desc = ffi.new("ze_device_mem_alloc_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC,
                                                   "flags": 0x8})
    assert lib.zeMemAllocDevice(z.ctx, desc, 64, 0, z.devices[0], p) == lib.ZE_RESULT_ERROR_INVALID_ENUMERATION
    desc.flags = 0x7
    assert lib.zeMemAllocDevice(z.ctx, desc, 64, 0, z.devices[0], p) == 0
    assert lib.zeMemFree(z.ctx, p[0]) == 0
    hdesc = ffi.new("ze_host_mem_alloc_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC,
                                                  "flags": 0x10})
    assert lib.zeMemAllocHost(z.ctx, hdesc, 64, 0, p) == lib.ZE_RESULT_ERROR_INVALID_ENUMERATION
    hdesc.flags = 0xF
    assert lib.zeMemAllocHost(z.ctx, hdesc, 64, 0, p) == 0
    assert lib.zeMemFree(z.ctx, p[0]) == 0


def test_fill_pattern_above_the_queue_groups_maximum_is_refused(ze):
    z = ze()
    lib = z.lib
    n = ffi.new("uint32_t *", 0)
    assert lib.zeDeviceGetCommandQueueGroupProperties(z.devices[0], n, ffi.NULL) == 0
    props = ffi.new("ze_command_queue_group_properties_t[]", n[0])
    for i in range(n[0]):
        props[i].stype = lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_GROUP_PROPERTIES
    assert lib.zeDeviceGetCommandQueueGroupProperties(z.devices[0], n, props) == 0
    p = z.alloc(64)
    pattern = ffi.new("uint8_t[16]", list(range(16)))
    for ordinal in range(n[0]):
        desc = ffi.new("ze_command_queue_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC,
                                                    "ordinal": ordinal})
        cl = ffi.new("ze_command_list_handle_t *")
        assert lib.zeCommandListCreateImmediate(z.ctx, z.devices[0], desc, cl) == 0
        most = props[ordinal].maxMemoryFillPatternSize
        # ze_api.h, zeCommandListAppendMemoryFill: "The pattern size must be a power-of-two and
        # less than or equal to ze_command_queue_group_properties_t.maxMemoryFillPatternSize"
        # (of the list's group: 4 on the copy engine here). The simulator took 16 on any list.
        assert lib.zeCommandListAppendMemoryFill(cl[0], p, pattern, most, 64, ffi.NULL, 0, ffi.NULL) == 0
        if most < 16:
            assert lib.zeCommandListAppendMemoryFill(cl[0], p, pattern, most * 2, 64, ffi.NULL, 0, ffi.NULL) == \
                lib.ZE_RESULT_ERROR_INVALID_SIZE
        assert lib.zeCommandListHostSynchronize(cl[0], _UINT64_MAX) == 0
        assert lib.zeCommandListDestroy(cl[0]) == 0
    assert any(props[i].maxMemoryFillPatternSize < 16 for i in range(n[0]))


def test_copy_between_overlapping_ranges_is_refused(ze):
    z = ze()
    lib = z.lib
    cl = z.immediate()
    p = z.alloc(256)
    q = _addr(p)
    # ze_api.h, ZE_RESULT_ERROR_OVERLAPPING_REGIONS: "copy operations do not support overlapping
    # regions of memory"; zeCommandListAppendMemoryCopy's own entry is silent: refused with it.
    # The simulator copied with memmove (as if overlap were defined).
    for dst, src in ((q + 16, q), (q, q + 16), (q, q)):
        assert lib.zeCommandListAppendMemoryCopy(cl, ffi.cast("void *", dst), ffi.cast("void *", src), 64,
                                                 ffi.NULL, 0, ffi.NULL) == lib.ZE_RESULT_ERROR_OVERLAPPING_REGIONS
    assert lib.zeCommandListAppendMemoryCopy(cl, ffi.cast("void *", q + 64), p, 64, ffi.NULL, 0, ffi.NULL) == 0
    assert lib.zeCommandListHostSynchronize(cl, _UINT64_MAX) == 0


# -- memory lifetime -------------------------------------------------------------------------------

def test_mem_free_while_submitted_work_uses_the_memory_is_refused(ze):
    z = ze()
    lib = z.lib
    cl = z.immediate(dev=1)
    pool = z.pool(1)
    gate = _gate(z, cl, pool)
    p = z.alloc(dev=1)
    assert z.fill(cl, p, 64, 3) == 0
    # ze_api.h, zeMemFree: "The application must ensure the device is not currently referencing
    # the memory before it is freed" (the words of zeEventDestroy, refused with IN_USE there too).
    # The simulator freed it, and the queued fill wrote into the next allocation at that address.
    assert lib.zeMemFree(z.ctx, p) == lib.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    assert lib.zeEventHostSignal(gate) == 0
    assert lib.zeCommandListHostSynchronize(cl, _UINT64_MAX) == 0
    assert bytes(ffi.buffer(ffi.cast("char *", p), 64)) == b"\x03" * 64     # still allocated: state unchanged
    assert lib.zeMemFree(z.ctx, p) == 0


def test_regular_list_touching_memory_freed_since_recording_is_refused(ze):
    z = ze()
    lib = z.lib
    cl, q = z.regular(), z.queue()
    p = z.alloc()
    assert z.fill(cl, p, 64, 9) == 0
    assert lib.zeCommandListClose(cl) == 0
    assert lib.zeMemFree(z.ctx, p) == 0          # allowed: the device does not reference it yet
    again = [z.alloc() for _ in range(8)]         # (before, one of these reused the freed address)
    for a in again:
        ffi.buffer(ffi.cast("char *", a), 64)[:] = b"\x00" * 64
    lists = ffi.new("ze_command_list_handle_t[1]", [cl])
    # The recorded fill targets an allocation that no longer exists (zeMemFree: the device must
    # not reference freed memory); the documents are silent on executing such a list: refused.
    # Before, it ran and filled whatever allocation the host allocator had put at that address.
    assert lib.zeCommandQueueExecuteCommandLists(q, 1, lists, ffi.NULL) == lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
    assert lib.zeCommandQueueSynchronize(q, _UINT64_MAX) == 0
    assert all(bytes(ffi.buffer(ffi.cast("char *", a), 64)) == b"\x00" * 64 for a in again)


def test_context_destroy_while_the_device_references_it_is_refused_and_frees_its_memory(ze):
    z = ze()
    lib = z.lib
    ctx = z.context()
    cl = z.immediate(dev=1, ctx=ctx)
    pool = z.pool(1, ctx=ctx)
    gate = _gate(z, cl, pool)
    p = z.alloc(dev=1, ctx=ctx)
    assert z.fill(cl, p, 64, 4) == 0
    # ze_api.h, zeContextDestroy: "The application must ensure the device is not currently
    # referencing the context before it is deleted" (@returns HANDLE_OBJECT_IN_USE). The
    # simulator destroyed it with the fill still queued.
    assert lib.zeContextDestroy(ctx) == lib.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    assert lib.zeEventHostSignal(gate) == 0
    assert lib.zeCommandListHostSynchronize(cl, _UINT64_MAX) == 0
    assert lib.zeCommandListDestroy(cl) == 0
    assert lib.zeEventDestroy(gate) == 0 and lib.zeEventPoolDestroy(pool) == 0
    props = ffi.new("ze_memory_allocation_properties_t *", {"stype": lib.ZE_STRUCTURE_TYPE_MEMORY_ALLOCATION_PROPERTIES})
    assert lib.zeMemGetAllocProperties(ctx, p, props, ffi.NULL) == 0 and props.type == lib.ZE_MEMORY_TYPE_DEVICE
    # through another context: "memory allocation unrelated to the context ... ZE_MEMORY_TYPE_UNKNOWN"
    assert lib.zeMemGetAllocProperties(z.ctx, p, props, ffi.NULL) == 0 and props.type == lib.ZE_MEMORY_TYPE_UNKNOWN
    assert lib.zeContextDestroy(ctx) == 0
    # "The implementation of this function may immediately free all Host and Device allocations
    # associated with this context": the simulator does, so nothing can go on using them (it
    # kept them allocated, and usable through another context's lookups, for ever).
    assert lib.zeMemGetAllocProperties(z.ctx, p, props, ffi.NULL) == 0 and props.type == lib.ZE_MEMORY_TYPE_UNKNOWN


def test_executing_a_list_twice_at_once_is_refused(ze, monkeypatch):
    """zeCommandQueueExecuteCommandLists: "The application must ensure the device is not
    currently referencing the command list" (a list still executing is refused with IN_USE
    already). The same list twice in one call, or from a second thread while the first call is
    submitting it, got in: the check and the submission were not one step."""
    from accel.sim import ze as sim_ze
    z = ze()
    lib = z.lib
    cl, q = z.regular(dev=1), z.queue(dev=1)
    p = z.alloc(dev=1)
    assert z.fill(cl, p, 64, 6) == 0
    assert lib.zeCommandListClose(cl) == 0
    twice = ffi.new("ze_command_list_handle_t[2]", [cl, cl])
    assert lib.zeCommandQueueExecuteCommandLists(q, 2, twice, ffi.NULL) == lib.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    once = ffi.new("ze_command_list_handle_t[1]", [cl])
    seen = []
    submit = sim_ze.commands._submit

    def meanwhile(*args, **kwargs):   # the first execute is submitting when another thread executes
        if not seen:
            seen.append(None)
            seen[0] = _from_another_thread(lambda: lib.zeCommandQueueExecuteCommandLists(q, 1, once, ffi.NULL))
        return submit(*args, **kwargs)
    monkeypatch.setattr(sim_ze.commands, "_submit", meanwhile)
    assert lib.zeCommandQueueExecuteCommandLists(q, 1, once, ffi.NULL) == 0
    assert seen == [lib.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE]
    monkeypatch.setattr(sim_ze.commands, "_submit", submit)
    assert lib.zeCommandQueueSynchronize(q, _UINT64_MAX) == 0
    assert lib.zeCommandQueueExecuteCommandLists(q, 1, once, ffi.NULL) == 0     # once it ran: fine
    assert lib.zeCommandQueueSynchronize(q, _UINT64_MAX) == 0


# -- events ----------------------------------------------------------------------------------------

def test_event_host_reset_while_the_device_references_it_is_refused(ze):
    z = ze()
    lib = z.lib
    cl = z.immediate()
    pool = z.pool(2)
    gate = _gate(z, cl, pool, 0)
    ev = z.event(pool, 1)
    assert lib.zeCommandListAppendSignalEvent(cl, ev) == 0
    # ze_api.h, zeEventHostReset says nothing about an event that submitted work still signals
    # or waits for; the outcome would race the device: refused, as zeEventDestroy is.
    assert lib.zeEventHostReset(ev) == lib.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    assert lib.zeEventHostReset(gate) == lib.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    assert lib.zeEventQueryStatus(ev) == lib.ZE_RESULT_NOT_READY
    assert lib.zeEventHostSignal(gate) == 0
    assert lib.zeCommandListHostSynchronize(cl, _UINT64_MAX) == 0
    assert lib.zeEventQueryStatus(ev) == 0
    assert lib.zeEventHostReset(ev) == 0 and lib.zeEventHostReset(gate) == 0
    assert lib.zeEventQueryStatus(ev) == lib.ZE_RESULT_NOT_READY


def test_event_whose_signal_the_host_saw_may_be_reset_at_once(ze, monkeypatch):
    """The device's reference of a signal operation ended only after the signal was visible: a
    host thread that saw it and reset the event at once got IN_USE from the rule above (accel's
    slot recycling on the 1.8.12 loader did, under threads: test_xpu_adversarial's
    test_threads_creating_and_destroying_streams_and_events_keep_state_bounded)."""
    from accel.sim import ze as sim_ze
    z = ze()
    lib = z.lib
    cl = z.immediate(dev=1)
    ev = z.event(z.pool(1))
    target = sim_ze._rt.get(ev, "event")
    results = []
    signal = sim_ze.events._signal_now

    def then_reset(rt, e, *timed):        # the host wakes here and resets the event at once
        signal(rt, e, *timed)
        if e is target:
            results.append(lib.zeEventHostReset(ev))
    monkeypatch.setattr(sim_ze.events, "_signal_now", then_reset)
    assert lib.zeCommandListAppendSignalEvent(cl, ev) == 0
    assert lib.zeCommandListHostSynchronize(cl, _UINT64_MAX) == 0
    assert results == [0]
    assert lib.zeEventQueryStatus(ev) == lib.ZE_RESULT_NOT_READY


def _kernel(z, name, dev=0):
    """(module, kernel pointer-to-handle) of a one-kernel SPIR-V module on device ``dev``."""
    from test_user_kernels import spirv_module
    lib = z.lib
    image = spirv_module(name)
    data = ffi.new("uint8_t[]", image)
    mdesc = ffi.new("ze_module_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_MODULE_DESC,
                                          "format": lib.ZE_MODULE_FORMAT_IL_SPIRV,
                                          "inputSize": len(image), "pInputModule": data})
    mod = ffi.new("ze_module_handle_t *")
    assert lib.zeModuleCreate(z.ctx, z.devices[dev], mdesc, mod, ffi.NULL) == 0
    cname = ffi.new("char[]", name.encode())
    kdesc = ffi.new("ze_kernel_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_KERNEL_DESC, "pKernelName": cname})
    k = ffi.new("ze_kernel_handle_t *")
    assert lib.zeKernelCreate(mod[0], kdesc, k) == 0
    return mod[0], k


def test_mem_free_while_a_submitted_launch_takes_the_memory_is_refused(ze):
    """The zeMemFree rule above, for a kernel's pointer argument: the launch references the
    allocation until it ran. The simulator freed it, and the kernel then wrote into whatever
    allocation the host allocator had put at that address."""
    z = ze()
    lib = z.lib
    def fill7(grid, block, view, p, n):
        view(p, n)[:] = b"\x07" * n
    sim.register_kernel("r14_fill7", fill7, "ptr, u64")
    try:
        mod, k = _kernel(z, "r14_fill7", dev=1)
        p = z.alloc(dev=1)
        assert lib.zeKernelSetGroupSize(k[0], 1, 1, 1) == 0
        assert lib.zeKernelSetArgumentValue(k[0], 0, 8, ffi.new("void **", p)) == 0
        assert lib.zeKernelSetArgumentValue(k[0], 1, 8, ffi.new("uint64_t *", 64)) == 0
        cl = z.immediate(dev=1)
        gate = _gate(z, cl, z.pool(1))
        args = ffi.new("ze_group_count_t *", (1, 1, 1))
        assert lib.zeCommandListAppendLaunchKernel(cl, k[0], args, ffi.NULL, 0, ffi.NULL) == 0
        assert lib.zeMemFree(z.ctx, p) == lib.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
        assert lib.zeEventHostSignal(gate) == 0
        assert lib.zeCommandListHostSynchronize(cl, _UINT64_MAX) == 0
        assert bytes(ffi.buffer(ffi.cast("char *", p), 64)) == b"\x07" * 64
        assert lib.zeMemFree(z.ctx, p) == 0
        assert lib.zeKernelDestroy(k[0]) == 0 and lib.zeModuleDestroy(mod) == 0
    finally:
        sim.unregister_kernel("r14_fill7")


def test_kernel_pointer_argument_of_another_context_is_refused(ze):
    """zeMemAllocDevice: "The application must only use the memory allocation for the context
    and device ... which was provided during allocation" -- for copies and fills the simulator
    refused it already; a kernel's pointer argument was not checked."""
    z = ze()
    lib = z.lib
    sim.register_kernel("r14_nop", lambda grid, block, view, p: None, "ptr")
    try:
        mod, k = _kernel(z, "r14_nop")
        foreign = z.alloc(ctx=z.context())
        assert lib.zeKernelSetGroupSize(k[0], 1, 1, 1) == 0
        assert lib.zeKernelSetArgumentValue(k[0], 0, 8, ffi.new("void **", foreign)) == 0
        cl = z.immediate()
        args = ffi.new("ze_group_count_t *", (1, 1, 1))
        assert lib.zeCommandListAppendLaunchKernel(cl, k[0], args, ffi.NULL, 0, ffi.NULL) == \
            lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
        assert lib.zeKernelDestroy(k[0]) == 0 and lib.zeModuleDestroy(mod) == 0
    finally:
        sim.unregister_kernel("r14_nop")


# -- one thread at a time per command list / kernel -------------------------------------------------

def _from_another_thread(call):
    out = []
    t = threading.Thread(target=lambda: out.append(call()))
    t.start()
    t.join(60)
    return out[0]


@pytest.mark.parametrize("second", ["append", "close", "reset", "destroy"])
def test_a_command_list_used_by_two_threads_at_once_is_refused(ze, monkeypatch, second):
    """ze_api.h, zeCommandListAppend*, zeCommandListClose/Reset/Destroy: "The application must
    **not** call this function from simultaneous threads with the same command list handle."
    No code is named: the second call is refused with HANDLE_OBJECT_IN_USE and changes nothing.
    The simulator let both run (the backend serializes each stream's list under its lock)."""
    from accel.sim import ze as sim_ze
    z = ze()
    lib = z.lib
    cl = z.regular(dev=1)
    p = z.alloc(dev=1)
    other = {"append": lambda: z.fill(cl, p, 64, 2),
             "close": lambda: lib.zeCommandListClose(cl),
             "reset": lambda: lib.zeCommandListReset(cl),
             "destroy": lambda: lib.zeCommandListDestroy(cl)}[second]
    seen = []
    events = sim_ze.commands._events

    def meanwhile(*args):     # the first append is inside the library when the other thread calls
        if not seen:
            seen.append(None)
            seen[0] = _from_another_thread(other)
        return events(*args)
    monkeypatch.setattr(sim_ze.commands, "_events", meanwhile)
    assert z.fill(cl, p, 64, 1) == 0
    assert seen == [lib.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE]
    monkeypatch.setattr(sim_ze.commands, "_events", events)
    assert other() == 0               # one at a time is fine
    if second in ("append", "reset"):
        assert lib.zeCommandListDestroy(cl) == 0


def test_a_kernel_set_up_by_two_threads_at_once_is_refused(ze, monkeypatch):
    """ze_api.h, zeKernelSetArgumentValue / zeKernelSetGroupSize: "must **not** call this
    function from simultaneous threads with the same kernel handle"."""
    from accel.sim import _ze_kernels
    z = ze()
    lib = z.lib
    mod, k = _kernel(z, "r14_k")
    value = ffi.new("uint64_t *", 7)
    seen = []
    get = _ze_kernels._get

    def meanwhile(rt, handle, kind):
        if kind == "kernel" and not seen:
            seen.append(None)
            seen[0] = _from_another_thread(lambda: lib.zeKernelSetGroupSize(k[0], 32, 1, 1))
        return get(rt, handle, kind)
    monkeypatch.setattr(_ze_kernels, "_get", meanwhile)
    assert lib.zeKernelSetArgumentValue(k[0], 0, 8, value) == 0
    assert seen == [lib.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE]
    monkeypatch.setattr(_ze_kernels, "_get", get)
    assert lib.zeKernelSetGroupSize(k[0], 32, 1, 1) == 0
    assert lib.zeKernelDestroy(k[0]) == 0 and lib.zeModuleDestroy(mod) == 0


# -- accel: event queries during a capture (CUDA's rules, as the CUDA backend) ----------------------

@pytest.fixture(params=["cuda", "xpu"])
def capturing(request, monkeypatch):
    use_sim(monkeypatch, request.param)
    be = backends.get(request.param)
    be.init()
    yield be


_CALLS = {
    "event_query": lambda be, ev, other: be.event_query(ev),
    "event_synchronize": lambda be, ev, other: be.event_synchronize(ev),
    "stream_query": lambda be, ev, other: be.stream_query(other),
    "stream_synchronize": lambda be, ev, other: be.stream_synchronize(other),
}


@pytest.mark.parametrize("call", list(_CALLS))
@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_event_query_during_a_capture_follows_cudas_rules_on_every_backend(capturing, call, mode):
    """CUDA Programming Guide, "Prohibited and Unhandled Operations": cudaEventQuery,
    cudaEventSynchronize and cudaStreamQuery/Synchronize of a stream not captured are unsafe
    during a capture (the capturing thread unless relaxed; other threads while a global capture
    runs).  Level Zero has no capture (accel records into a regular list) and its spec says
    nothing: the XPU backend allowed all four; it now applies CUDA's rules, as on CUDA."""
    be = capturing
    fn = _CALLS[call]
    s, other = be.stream_create(), be.stream_create()
    ev = be.event_create()
    p = be.mem_alloc(64)
    be.memset_async(p, 1, 64, other)
    be.event_record(ev, other)
    be.stream_synchronize(other)
    be.capture_begin(s, mode)
    if mode == "relaxed":
        fn(be, ev, other)
    else:
        with pytest.raises(CaptureError):
            fn(be, ev, other)
    result = []

    def in_other_thread():
        try:
            fn(be, ev, other)
            result.append("ok")
        except CaptureError:
            result.append("refused")
    t = threading.Thread(target=in_other_thread)
    t.start()
    t.join(60)
    if mode == "relaxed":
        assert result == ["ok"]
        be.graph_destroy(be.capture_end(s))
    else:
        # another thread is refused only while a global capture runs (the CUDA backend's thread
        # exchanges no capture mode, so it is global there too)
        assert result == (["refused"] if mode == "global" else ["ok"])
        with pytest.raises(CaptureError):
            be.capture_end(s)
    assert be.event_query(ev)          # after the capture: allowed again
    be.event_destroy(ev)
    be.mem_free(p)
    for h in (s, other):
        be.stream_destroy(h)


# == Metal =========================================================================================

from accel.backends import _objc  # noqa: E402
from accel.sim import metal  # noqa: E402
from test_sim_ze_metal_strict import mtl  # noqa: E402,F401 (the fixture)

M_NEW_LIBRARY = _objc.Message("newLibraryWithSource:options:error:", "id", "id", "id", "id *")
M_NEW_FUNCTION = _objc.Message("newFunctionWithName:", "id", "id")
M_NEW_PIPELINE = _objc.Message("newComputePipelineStateWithFunction:error:", "id", "id", "id *")


def _compile(m, source):
    """(library or nil, (error code, text))."""
    rt = m.rt
    with rt.pool():
        err = m.ffi.new("void **")
        lib = rt.send(m.device, M_NEW_LIBRARY, rt.ns_string(source), rt.nil, err)
        return lib, rt.error_text(err[0])


@pytest.mark.parametrize("decl", ["device double *x [[buffer(0)]]", "constant double &a [[buffer(0)]]",
                                  "device float *x [[buffer(0)]]) { long double t = 0; (void)t; } //",
                                  "device float *x [[buffer(0)]]) { double2 v; (void)v; } //"])
def test_msl_using_double_fails_to_compile(mtl, decl):
    # Metal Shading Language Specification, 2.1 "Scalar Data Types": Metal has no double (nor
    # long double, nor double vectors); the compiler reports "'double' is not supported in Metal"
    # and newLibraryWithSource:options:error: answers nil with MTLLibraryErrorCompileFailure (3).
    # The simulator compiled it.
    lib, (code, text) = _compile(mtl, "kernel void twice(" + decl + ") {}\n")
    assert lib == mtl.rt.nil
    assert code == 3 and "double" in text and "not supported" in text


def test_msl_mentioning_double_in_a_comment_or_name_compiles(mtl):
    lib, _ = _compile(mtl, "// a double-free is not a type\n/* double */\n"
                           "kernel void doubled(device float *x [[buffer(0)]]) { float double_it = 2; }\n")
    assert lib != mtl.rt.nil
    mtl.rt.release(lib)


def test_metal_pipeline_for_a_reference_taking_f64_is_refused(mtl):
    # A Metal kernel cannot declare a double parameter (above), so a Python reference that reads
    # one would decode bytes no Metal kernel passes: the pipeline is refused, as a kernel with no
    # reference is. The simulator made the pipeline and the launch failed later.
    sim.register_kernel("r14_takes_f64", lambda x, a, n: None, "ptr, f64, u64")
    try:
        rt = mtl.rt
        lib, _ = _compile(mtl, "kernel void r14_takes_f64(device float *x [[buffer(0)]]) {}\n")
        assert lib != rt.nil
        with rt.pool():
            fn = rt.send(lib, M_NEW_FUNCTION, rt.ns_string("r14_takes_f64"))
            err = mtl.ffi.new("void **")
            assert rt.send(mtl.device, M_NEW_PIPELINE, fn, err) == rt.nil
            code, text = rt.error_text(err[0])
        assert "f64" in text and "double" in text
        rt.release(fn)
        rt.release(lib)
    finally:
        sim.unregister_kernel("r14_takes_f64")


@pytest.fixture
def on_mps(monkeypatch):
    use_sim(monkeypatch, "mps")
    metal.reset()
    yield
    metal.reset()


def test_accel_refuses_an_f64_signature_for_a_metal_kernel(on_mps):
    import accel
    sim.register_kernel("r14_scale", lambda x, a: None, "ptr, f32")
    m = accel.Module("kernel void r14_scale(device float *x [[buffer(0)]], constant float &a [[buffer(1)]]) {}\n")
    # Metal has no double: Module.function accepted "ptr, f64" and every launch failed
    # ("Metal has no 64-bit float"); the signature is refused where it is given.
    with pytest.raises(ValueError, match=r"f64.*Metal has no 64-bit float"):
        m.function("r14_scale", "ptr, f64")
    m.function("r14_scale", "ptr, f32")
    m.close()
    sim.unregister_kernel("r14_scale")


def test_accel_refuses_msl_that_defines_no_kernel(on_mps):
    import accel
    # Metal compiles a library of helper functions alone (newLibraryWithSource: succeeds, with no
    # functionNames), but accel can launch nothing from it: refused at load, as PTX without
    # .entry and SPIR-V without OpEntryPoint Kernel are. It loaded, and every function() failed.
    with pytest.raises(ValueError, match="defines no kernel function"):
        accel.Module("float helper(float x) { return 2 * x; }\n")
