"""Level Zero simulator strictness, round two: what a context's destruction leaves behind.

ze_api.h, zeContextDestroy: "The application must ensure the device is not currently referencing
the context before it is deleted" and "The implementation of this function may immediately free
all Host and Device allocations associated with this context" (@returns lists
ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE).  What happens to the context's other objects (command
lists and queues, event pools and their events, modules and their kernels, physical memory,
virtual reservations) is not described; each of them was created from the context and several
can only be released through it (zePhysicalMemDestroy and zeVirtualMemFree take hContext), so
using them afterwards is undefined and the simulator refuses the destruction instead.  The
simulator used to destroy the context and leave every one of them usable.

The accel-level tests check that accel's XPU backend never destroys a context that still owns
something: its close() and its failed-init cleanup destroy lists, queues, events, pools, modules
and virtual memory first.
"""

import gc
import sys

import pytest

import accel
from accel import sim
from accel._ffi._ze import ffi
from accel.sim import ze as sim_ze
from conftest import use_sim
from test_sim_ze_metal_strict import driver_and_devices
from test_user_kernels import spirv_module

_UINT64_MAX = (1 << 64) - 1
_PAGE = 2 << 20


class Ze:
    """zeInit, the driver, its devices, and helpers making objects in a given context."""

    def __init__(self):
        self.lib = sim_ze.open_ze()
        self.driver, devices = driver_and_devices(self.lib)
        self.dev = devices[0]

    def context(self):
        desc = ffi.new("ze_context_desc_t *", {"stype": self.lib.ZE_STRUCTURE_TYPE_CONTEXT_DESC})
        p = ffi.new("ze_context_handle_t *")
        assert self.lib.zeContextCreate(self.driver, desc, p) == 0
        return p[0]

    def immediate(self, ctx):
        lib = self.lib
        desc = ffi.new("ze_command_queue_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC,
                                                    "ordinal": 1, "flags": lib.ZE_COMMAND_QUEUE_FLAG_IN_ORDER,
                                                    "mode": lib.ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS})
        p = ffi.new("ze_command_list_handle_t *")
        assert lib.zeCommandListCreateImmediate(ctx, self.dev, desc, p) == 0
        return p[0]

    def regular(self, ctx):
        lib = self.lib
        desc = ffi.new("ze_command_list_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_COMMAND_LIST_DESC,
                                                   "commandQueueGroupOrdinal": 1})
        p = ffi.new("ze_command_list_handle_t *")
        assert lib.zeCommandListCreate(ctx, self.dev, desc, p) == 0
        return p[0]

    def queue(self, ctx):
        lib = self.lib
        desc = ffi.new("ze_command_queue_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC,
                                                    "ordinal": 1})
        p = ffi.new("ze_command_queue_handle_t *")
        assert lib.zeCommandQueueCreate(ctx, self.dev, desc, p) == 0
        return p[0]

    def pool(self, ctx, count=1):
        lib = self.lib
        desc = ffi.new("ze_event_pool_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_EVENT_POOL_DESC,
                                                 "flags": lib.ZE_EVENT_POOL_FLAG_HOST_VISIBLE, "count": count})
        p = ffi.new("ze_event_pool_handle_t *")
        assert lib.zeEventPoolCreate(ctx, desc, 0, ffi.NULL, p) == 0
        return p[0]

    def event(self, pool, index=0):
        desc = ffi.new("ze_event_desc_t *", {"stype": self.lib.ZE_STRUCTURE_TYPE_EVENT_DESC, "index": index})
        p = ffi.new("ze_event_handle_t *")
        assert self.lib.zeEventCreate(pool, desc, p) == 0
        return p[0]

    def module(self, ctx, *names):
        lib = self.lib
        data = spirv_module(*names)
        buf = ffi.new("uint8_t[]", data)
        desc = ffi.new("ze_module_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_MODULE_DESC,
                                             "format": lib.ZE_MODULE_FORMAT_IL_SPIRV,
                                             "inputSize": len(data), "pInputModule": buf})
        p = ffi.new("ze_module_handle_t *")
        assert lib.zeModuleCreate(ctx, self.dev, desc, p, ffi.NULL) == 0
        return p[0]

    def kernel(self, module, name):
        cname = ffi.new("char[]", name.encode())
        desc = ffi.new("ze_kernel_desc_t *", {"stype": self.lib.ZE_STRUCTURE_TYPE_KERNEL_DESC,
                                             "pKernelName": cname})
        p = ffi.new("ze_kernel_handle_t *")
        assert self.lib.zeKernelCreate(module, desc, p) == 0
        return p[0]

    def physical(self, ctx, size=_PAGE):
        lib = self.lib
        desc = ffi.new("ze_physical_mem_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_PHYSICAL_MEM_DESC,
                                                   "size": size})
        p = ffi.new("ze_physical_mem_handle_t *")
        assert lib.zePhysicalMemCreate(ctx, self.dev, desc, p) == 0
        return p[0]

    def reserve(self, ctx, size=_PAGE):
        p = ffi.new("void **")
        assert self.lib.zeVirtualMemReserve(ctx, ffi.cast("void *", 1 << 40), size, p) == 0
        return p[0]

    def alloc(self, ctx, n=64):
        desc = ffi.new("ze_device_mem_alloc_desc_t *", {"stype": self.lib.ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC})
        p = ffi.new("void **")
        assert self.lib.zeMemAllocDevice(ctx, desc, n, 0, self.dev, p) == 0
        return p[0]

    def fill(self, cl, ptr, n=64, value=1):
        pat = ffi.new("uint8_t *", value)
        return self.lib.zeCommandListAppendMemoryFill(cl, ptr, pat, 1, n, ffi.NULL, 0, ffi.NULL)


@pytest.fixture
def ze(monkeypatch):
    monkeypatch.setenv("ACCEL_SIM", "xpu")
    sim.reset()
    yield Ze()
    sim.reset()


IN_USE = "ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE"


def _refused_then_destroyed(z, ctx, release):
    """zeContextDestroy is refused while ``ctx`` owns the object; ``release()`` destroys the
    object (through ``ctx``, which must still work), after which the context goes."""
    lib = z.lib
    assert lib.zeContextDestroy(ctx) == getattr(lib, IN_USE)
    assert release() == 0
    assert lib.zeContextDestroy(ctx) == 0
    assert lib.zeContextDestroy(ctx) == lib.ZE_RESULT_ERROR_INVALID_NULL_HANDLE


# -- the simulator ----------------------------------------------------------------------------------

def test_context_owning_an_immediate_list_is_not_destroyed(ze):
    z, lib = ze, ze.lib
    ctx = z.context()
    cl = z.immediate(ctx)
    # before: the context went and the list stayed usable, appending work for a context that
    # no longer existed
    _refused_then_destroyed(z, ctx, lambda: lib.zeCommandListDestroy(cl))


def test_context_owning_a_list_keeps_working_after_the_refusal(ze):
    z, lib = ze, ze.lib
    ctx = z.context()
    cl = z.immediate(ctx)
    p = z.alloc(ctx)
    assert lib.zeContextDestroy(ctx) == lib.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    # the refused call changed nothing: the list, the memory and the context all still work
    assert z.fill(cl, p, 64, 7) == 0
    assert lib.zeCommandListHostSynchronize(cl, _UINT64_MAX) == 0
    assert bytes(ffi.buffer(ffi.cast("char *", p), 64)) == b"\x07" * 64
    assert lib.zeCommandListDestroy(cl) == 0
    assert lib.zeMemFree(ctx, p) == 0
    assert lib.zeContextDestroy(ctx) == 0


def test_context_owning_a_regular_list_or_a_queue_is_not_destroyed(ze):
    z, lib = ze, ze.lib
    ctx = z.context()
    cl, q = z.regular(ctx), z.queue(ctx)
    assert lib.zeContextDestroy(ctx) == lib.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    assert lib.zeCommandListDestroy(cl) == 0
    _refused_then_destroyed(z, ctx, lambda: lib.zeCommandQueueDestroy(q))


def test_context_owning_an_event_pool_is_not_destroyed(ze):
    z, lib = ze, ze.lib
    ctx = z.context()
    pool = z.pool(ctx)
    ev = z.event(pool)
    assert lib.zeContextDestroy(ctx) == lib.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    assert lib.zeEventHostSignal(ev) == 0          # unchanged by the refusal
    assert lib.zeEventDestroy(ev) == 0
    # an empty pool is still the context's object
    _refused_then_destroyed(z, ctx, lambda: lib.zeEventPoolDestroy(pool))


def test_context_owning_a_module_is_not_destroyed(ze):
    z, lib = ze, ze.lib
    ctx = z.context()
    mod = z.module(ctx, "k")
    k = z.kernel(mod, "k")
    assert lib.zeContextDestroy(ctx) == lib.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    assert lib.zeKernelDestroy(k) == 0
    _refused_then_destroyed(z, ctx, lambda: lib.zeModuleDestroy(mod))


def test_context_owning_physical_memory_is_not_destroyed(ze):
    z, lib = ze, ze.lib
    ctx = z.context()
    used = sim_ze.state()["ze_device_used"][0]
    h = z.physical(ctx)
    # zePhysicalMemDestroy takes hContext: after the context went, nothing could release the
    # memory (before: destroyed, and the 2 MiB stayed charged to the device for ever)
    _refused_then_destroyed(z, ctx, lambda: lib.zePhysicalMemDestroy(ctx, h))
    assert sim_ze.state()["ze_device_used"][0] == used
    assert sim_ze._rt.vmm_handle_ctx == {}


def test_context_owning_a_reservation_is_not_destroyed(ze):
    z, lib = ze, ze.lib
    ctx = z.context()
    va = z.reserve(ctx)
    _refused_then_destroyed(z, ctx, lambda: lib.zeVirtualMemFree(ctx, va, _PAGE))
    assert sim_ze._rt.vmm_ctx == {}
    assert not sim_ze._rt.vmm.reservations


def test_context_owning_a_mapped_reservation_is_not_destroyed(ze):
    z, lib = ze, ze.lib
    ctx = z.context()
    va, h = z.reserve(ctx), z.physical(ctx)
    assert lib.zeVirtualMemMap(ctx, va, _PAGE, h, 0, lib.ZE_MEMORY_ACCESS_ATTRIBUTE_READWRITE) == 0
    assert lib.zeContextDestroy(ctx) == lib.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    assert lib.zeVirtualMemUnmap(ctx, va, _PAGE) == 0
    assert lib.zePhysicalMemDestroy(ctx, h) == 0
    _refused_then_destroyed(z, ctx, lambda: lib.zeVirtualMemFree(ctx, va, _PAGE))


def test_another_contexts_objects_do_not_hold_a_context(ze):
    z, lib = ze, ze.lib
    keep, ctx = z.context(), z.context()
    cl, pool, h, va = z.immediate(keep), z.pool(keep), z.physical(keep), z.reserve(keep)
    p = z.alloc(ctx)
    # allocations are freed with their context, as the header allows ("may immediately free")
    assert lib.zeContextDestroy(ctx) == 0
    assert lib.zeMemFree(keep, p) == lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
    assert lib.zeCommandListDestroy(cl) == 0 and lib.zeEventPoolDestroy(pool) == 0
    assert lib.zePhysicalMemDestroy(keep, h) == 0 and lib.zeVirtualMemFree(keep, va, _PAGE) == 0
    assert lib.zeContextDestroy(keep) == 0


# -- accel's XPU backend --------------------------------------------------------------------------

def _ze_live():
    st = sim_ze.state()
    return {k: st[k] for k in ("ze_live_allocations", "ze_live_events", "ze_live_event_pools",
                               "ze_live_command_lists", "ze_live_command_queues", "ze_live_modules",
                               "ze_live_kernels")}


def test_backend_close_destroys_every_object_before_its_context(monkeypatch):
    """accel's close() after streams, events, a graph, a module and expandable segments (virtual
    memory) on both devices: every zeContextDestroy succeeds (close raises on a refusal) and
    nothing the contexts owned is left."""
    use_sim(monkeypatch, "xpu", ACCEL_ALLOC_CONF="expandable_segments:True")
    sim.register_kernel("r21_twice", lambda grid, block, view, n, x: None, "u64, ptr")
    mods = []
    try:
        for d in range(accel.device_count()):
            with accel.device_index(d):
                s = accel.Stream()
                a = accel.Buffer(1 << 20, stream=s)          # expandable segment: zeVirtualMem*
                b = accel.Buffer(1 << 20, stream=s)
                c = accel.Buffer(3 << 20, stream=s)
                a.fill_(1)
                e = s.record_event()
                accel.current_stream().wait_event(e)
                m = accel.Module(spirv_module("r21_twice"), device=d)
                mods.append(m)
                accel.launch(m.function("r21_twice", "u64, ptr"), 1, 1, 16, a, stream=s)
                g = accel.Graph()
                with s, g:
                    a.fill_(2)
                    b.copy_from(a, non_blocking=True)
                g.replay()
                accel.synchronize()
                c.fill_(3)
                assert sim_ze.state()["ze_vmm_reservations"] > 0
        accel._lazy.backend().close()
        for m in mods:
            m._handle = None     # the backend forgot it with everything else (test_xpu_adversarial)
        # The last graph outlives the close too (close() is a test hook: a program never calls
        # it): its finalizer's destroys find the handles gone and report a leak, which is none.
        reports, hook = [], sys.unraisablehook
        sys.unraisablehook = reports.append
        try:
            del s, a, b, c, e, g
            gc.collect()
            accel._finalize.drain()
            gc.collect()
        finally:
            sys.unraisablehook = hook
        assert all(("backend is not initialized" in str(r.exc_value) or "is not a live XPU" in str(r.exc_value))
                   for r in reports), [str(r.exc_value) for r in reports]
    finally:
        sim.unregister_kernel("r21_twice")
    assert all(v == 0 for v in _ze_live().values()), _ze_live()
    rt = sim_ze._rt
    assert rt.vmm_ctx == {} and rt.vmm_handle_ctx == {}
    assert not [o for o in rt.objects.values() if o.kind == "context"]


def _contexts():
    rt = sim_ze._rt
    return [o for o in list(rt.objects.values()) if o.kind == "context"] if rt is not None else []


@pytest.mark.parametrize("list_destroy_fails", [False, True])
def test_failed_init_destroys_the_default_lists_before_the_context(monkeypatch, list_destroy_fails):
    """zeInit's setup fails at the second device's default stream: the first device's list goes
    before the shared context.  When that list's destroy fails too, the context's destroy is
    refused (it still owns the list) and both are kept, in that order, for the next sweep:
    nothing of the failed init is left once the backend is up and synchronized."""
    use_sim(monkeypatch, "xpu")
    sim.inject_error("zeCommandListCreateImmediate", 0x7FFFFFFE, after=1)
    if list_destroy_fails:
        sim.inject_error("zeCommandListDestroy", 0x7FFFFFFE)
    try:
        with pytest.raises(accel.AcceleratorError, match="zeCommandListCreateImmediate"):
            accel._lazy.lazy_init()
        if not list_destroy_fails:
            assert _contexts() == [] and sim_ze.state()["ze_live_command_lists"] == 0
        else:
            assert len(_contexts()) == 1 and sim_ze.state()["ze_live_command_lists"] == 1
    finally:
        sim.clear_faults()
    be = accel._lazy.lazy_init()
    accel.synchronize()                      # the sweep releases what the failed init kept
    assert len(_contexts()) == 1             # the working backend's own
    be.close()
    assert _contexts() == [] and all(v == 0 for v in _ze_live().values()), _ze_live()


def test_a_context_destroyed_by_two_threads_at_once_is_refused(ze, monkeypatch):
    """ze_api.h, zeContextDestroy: "The application must **not** call this function from
    simultaneous threads with the same context handle."  No code is named: the second call is
    refused with HANDLE_OBJECT_IN_USE (as for command lists and kernels) and changes nothing; the
    first destroys the context.  The simulator let the second destroy it under the first."""
    import threading
    lib = ze.lib
    ctx = ze.context()
    seen = []
    ready = sim_ze.memory._ready

    def meanwhile():        # the first call is inside zeContextDestroy when the other thread calls
        if not seen:
            seen.append(None)
            t = threading.Thread(target=lambda: seen.__setitem__(0, lib.zeContextDestroy(ctx)))
            t.start()
            t.join(60)
        return ready()
    monkeypatch.setattr(sim_ze.memory, "_ready", meanwhile)
    assert lib.zeContextDestroy(ctx) == 0
    assert seen == [lib.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE]
    monkeypatch.setattr(sim_ze.memory, "_ready", ready)
    assert lib.zeContextDestroy(ctx) == lib.ZE_RESULT_ERROR_INVALID_NULL_HANDLE


def test_backend_close_with_a_capture_underway(monkeypatch):
    """close() while a stream captures: the capture's regular list and its two event slots are
    the backend's too and go before their pool and context.  close() failed with
    'zeEventPoolDestroy failed with ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE' (the slots' events were
    never destroyed), leaving the pools, the capture's list and the contexts behind."""
    use_sim(monkeypatch, "xpu")
    s = accel.Stream(device=1)
    a = accel.Buffer(4096, stream=s)
    g = accel.Graph()
    with s:
        g.capture_begin()
        a.fill_(3)
    be = accel._lazy.backend()
    be.close()
    assert _contexts() == [] and all(v == 0 for v in _ze_live().values()), _ze_live()
    assert be.captures_underway() == 0
