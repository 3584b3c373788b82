"""The Level Zero and Metal simulators are at least as strict as the real libraries.

Each test calls the simulated library directly, as a Level Zero or Metal program
would, and checks one rule that accel/sim/README.md lists under "Enforced".
"""

import os

import pytest

from accel import sim
from accel._ffi._ze import ffi
from accel.sim import core, ze as sim_ze

_UINT64_MAX = (1 << 64) - 1


def driver_and_devices(lib):
    """zeInit, then the first driver and its devices: ``(driver, [device, ...])``."""
    assert lib.zeInit(lib.ZE_INIT_FLAG_GPU_ONLY) == 0
    n = ffi.new("uint32_t *", 1)
    drv = ffi.new("ze_driver_handle_t[1]")
    assert lib.zeDriverGet(n, drv) == 0
    n = ffi.new("uint32_t *", 0)
    assert lib.zeDeviceGet(drv[0], n, ffi.NULL) == 0
    devs = ffi.new("ze_device_handle_t[]", n[0])
    assert lib.zeDeviceGet(drv[0], n, devs) == 0
    return drv[0], [devs[i] for i in range(n[0])]


class Ze:
    """zeInit + the driver, its devices and one context, on the simulated loader."""

    def __init__(self, init=True):
        self.lib = sim_ze.open_ze()
        self.C = self.lib
        if init:
            self.init()

    def init(self):
        self.driver, self.devices = driver_and_devices(self.lib)
        self.ctx = self.context()

    def context(self):
        desc = ffi.new("ze_context_desc_t *", {"stype": self.lib.ZE_STRUCTURE_TYPE_CONTEXT_DESC})
        p = ffi.new("ze_context_handle_t *")
        assert self.lib.zeContextCreate(self.driver, desc, p) == 0
        return p[0]

    def immediate(self, dev=0, ctx=None):
        lib = self.lib
        desc = ffi.new("ze_command_queue_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC,
                                                    "ordinal": 1, "flags": lib.ZE_COMMAND_QUEUE_FLAG_IN_ORDER,
                                                    "mode": lib.ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS})
        p = ffi.new("ze_command_list_handle_t *")
        assert lib.zeCommandListCreateImmediate(ctx or self.ctx, self.devices[dev], desc, p) == 0
        return p[0]

    def regular(self, dev=0):
        lib = self.lib
        desc = ffi.new("ze_command_list_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_COMMAND_LIST_DESC,
                                                   "commandQueueGroupOrdinal": 1})
        p = ffi.new("ze_command_list_handle_t *")
        assert lib.zeCommandListCreate(self.ctx, self.devices[dev], desc, p) == 0
        return p[0]

    def queue(self, dev=0):
        lib = self.lib
        desc = ffi.new("ze_command_queue_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC,
                                                    "ordinal": 1})
        p = ffi.new("ze_command_queue_handle_t *")
        assert lib.zeCommandQueueCreate(self.ctx, self.devices[dev], desc, p) == 0
        return p[0]

    def pool(self, count=4, flags=None, devices=(), ctx=None):
        lib = self.lib
        if flags is None:
            flags = lib.ZE_EVENT_POOL_FLAG_HOST_VISIBLE
        desc = ffi.new("ze_event_pool_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_EVENT_POOL_DESC,
                                                 "flags": flags, "count": count})
        p = ffi.new("ze_event_pool_handle_t *")
        devs = ffi.new("ze_device_handle_t[]", [self.devices[d] for d in devices]) if devices else ffi.NULL
        assert lib.zeEventPoolCreate(ctx or self.ctx, desc, len(devices), devs, p) == 0
        return p[0]

    def event(self, pool, index=0):
        # HOST signal and wait scopes, as accel makes its events: the tests host-query device
        # signals and wait across lists, which a scope-0 event does not allow (ze_api.h,
        # ze_event_desc_t.signal: the default is "synchronization within the command list only")
        desc = ffi.new("ze_event_desc_t *", {"stype": self.lib.ZE_STRUCTURE_TYPE_EVENT_DESC, "index": index,
                                             "signal": self.lib.ZE_EVENT_SCOPE_FLAG_HOST,
                                             "wait": self.lib.ZE_EVENT_SCOPE_FLAG_HOST})
        p = ffi.new("ze_event_handle_t *")
        assert self.lib.zeEventCreate(pool, desc, p) == 0
        return p[0]

    def alloc(self, n=64, dev=0, ctx=None):
        desc = ffi.new("ze_device_mem_alloc_desc_t *", {"stype": self.lib.ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC})
        p = ffi.new("void **")
        assert self.lib.zeMemAllocDevice(ctx or self.ctx, desc, n, 0, self.devices[dev], p) == 0
        return p[0]

    def fill(self, cl, ptr, n=64, value=1, signal=ffi.NULL):
        pat = ffi.new("uint8_t *", value)
        return self.lib.zeCommandListAppendMemoryFill(cl, ptr, pat, 1, n, signal, 0, ffi.NULL)


@pytest.fixture
def ze(monkeypatch):
    """A fresh simulated Level Zero machine (two devices); ``ze(**settings)`` applies configure_ze first."""
    monkeypatch.setenv("ACCEL_SIM", "xpu")
    sim.reset()

    def make(init=True, **settings):
        if settings:
            sim_ze.configure_ze(**settings)
        return Ze(init)
    yield make
    sim.reset()


# -- driver API version decides the optional entry points ----------------------------------------

def test_zesinit_needs_a_1_5_driver_even_when_the_loader_has_it(ze):
    z = ze(init=False, api_version="1.4")
    # loader source/loader/zes_ldrddi.cpp, zesInit: a driver whose Sysman table has no pfnInit is
    # skipped; with no valid driver the loader returns ZE_RESULT_ERROR_UNINITIALIZED.
    assert z.lib.zesInit(0) == z.C.ZE_RESULT_ERROR_UNINITIALIZED
    n = ffi.new("uint32_t *", 0)
    assert z.lib.zesDriverGet(n, ffi.NULL) == z.C.ZE_RESULT_ERROR_UNINITIALIZED
    z2 = ze(init=False, api_version="1.5")
    assert z2.lib.zesInit(0) == 0


def test_host_synchronize_needs_a_1_6_driver_even_when_the_loader_has_it(ze):
    z = ze(api_version="1.5")
    lib = z.lib
    desc = ffi.new("ze_command_queue_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC,
                                                "ordinal": 1, "mode": lib.ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS})
    p = ffi.new("ze_command_list_handle_t *")
    assert lib.zeCommandListCreateImmediate(z.ctx, z.devices[0], desc, p) == 0   # no IN_ORDER before 1.7
    cl = p[0]
    # loader source/lib/ze_libapi.cpp, zeCommandListHostSynchronize: the driver's DDI table has no
    # pfnHostSynchronize (added in API 1.6) -> ZE_RESULT_ERROR_UNSUPPORTED_FEATURE after init.
    assert lib.zeCommandListHostSynchronize(cl, 0) == z.C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE
    z2 = ze(api_version="1.6")
    cl2 = z2.lib.zeCommandListCreateImmediate
    p = ffi.new("ze_command_list_handle_t *")
    assert cl2(z2.ctx, z2.devices[0], desc, p) == 0
    assert z2.lib.zeCommandListHostSynchronize(p[0], 0) == 0


def test_driver_api_version_from_the_environment(ze, monkeypatch):
    monkeypatch.setenv("ACCEL_SIM_ZE_API", "1.3")
    z = ze(init=False)
    assert z.lib.zesInit(0) == z.C.ZE_RESULT_ERROR_UNINITIALIZED
    z.init()
    v = ffi.new("ze_api_version_t *")
    assert z.lib.zeDriverGetApiVersion(z.driver, v) == 0 and v[0] == (1 << 16) | 3


# -- handle lifetime -------------------------------------------------------------------------------

def test_event_destroy_while_the_device_references_it_is_refused(ze):
    z = ze()
    lib = z.lib
    cl = z.immediate()
    pool = z.pool(2)
    gate, ev = z.event(pool, 0), z.event(pool, 1)
    g = ffi.new("ze_event_handle_t[1]", [gate])
    assert lib.zeCommandListAppendWaitOnEvents(cl, 1, g) == 0
    assert lib.zeCommandListAppendSignalEvent(cl, ev) == 0
    # ze_api.h, zeEventDestroy: "The application must ensure the device is not currently referencing
    # the event before it is deleted." -> ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    assert lib.zeEventDestroy(ev) == z.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    assert lib.zeEventDestroy(gate) == z.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    assert lib.zeEventHostSignal(gate) == 0
    assert lib.zeCommandListHostSynchronize(cl, _UINT64_MAX) == 0
    assert lib.zeEventDestroy(ev) == 0 and lib.zeEventDestroy(gate) == 0
    assert lib.zeEventPoolDestroy(pool) == 0
    assert lib.zeCommandListDestroy(cl) == 0


def test_destroyed_handles_are_refused(ze):
    z = ze()
    lib = z.lib
    cl = z.immediate()
    pool = z.pool(1)
    ev = z.event(pool)
    assert lib.zeEventDestroy(ev) == 0
    assert lib.zeEventHostSignal(ev) == z.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    assert lib.zeCommandListAppendSignalEvent(cl, ev) == z.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    assert lib.zeCommandListDestroy(cl) == 0
    assert z.fill(cl, z.alloc()) == z.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE


def test_regular_list_recorded_with_an_event_destroyed_since_is_refused(ze):
    z = ze()
    lib = z.lib
    cl, q = z.regular(), z.queue()
    pool = z.pool(1)
    ev = z.event(pool)
    assert lib.zeCommandListAppendSignalEvent(cl, ev) == 0
    assert lib.zeCommandListClose(cl) == 0
    assert lib.zeEventDestroy(ev) == 0   # allowed: the device does not reference it yet
    lists = ffi.new("ze_command_list_handle_t[1]", [cl])
    # The list would signal freed driver memory: the documents are silent, the simulator refuses.
    assert lib.zeCommandQueueExecuteCommandLists(q, 1, lists, ffi.NULL) == \
        z.C.ZE_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT


def test_regular_list_rules(ze):
    z = ze()
    lib = z.lib
    cl, q = z.regular(), z.queue()
    lists = ffi.new("ze_command_list_handle_t[1]", [cl])
    p = z.alloc()
    assert z.fill(cl, p) == 0
    # ze_api.h, zeCommandQueueExecuteCommandLists: "The application must ensure the command lists
    # are ... closed" -> not closed is refused.
    assert lib.zeCommandQueueExecuteCommandLists(q, 1, lists, ffi.NULL) == z.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    assert lib.zeCommandListClose(cl) == 0
    assert z.fill(cl, p) == z.C.ZE_RESULT_ERROR_INVALID_ARGUMENT   # appending to a closed list
    assert lib.zeCommandQueueExecuteCommandLists(q, 1, lists, ffi.NULL) == 0
    assert lib.zeCommandQueueSynchronize(q, _UINT64_MAX) == 0


# -- contexts and devices --------------------------------------------------------------------------

def test_events_of_another_context_are_refused(ze):
    z = ze()
    lib = z.lib
    cl = z.immediate()
    other = z.context()
    ev = z.event(z.pool(ctx=other))
    # ze_api.h, zeCommandListAppendSignalEvent: "The application must ensure the command list and
    # events were created on the same context."
    assert lib.zeCommandListAppendSignalEvent(cl, ev) == z.C.ZE_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT
    assert z.fill(cl, z.alloc(), signal=ev) == z.C.ZE_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT


def test_events_of_a_pool_the_device_cannot_see_are_refused(ze):
    z = ze()
    cl1 = z.immediate(dev=1)
    ev = z.event(z.pool(devices=(0,)))
    # ze_api.h, zeCommandListAppendSignalEvent: "The application must ensure the events are
    # accessible by the device on which the command list was created"; zeEventPoolCreate: phDevices
    # are "device handles which have visibility to the event pool".
    assert z.lib.zeCommandListAppendSignalEvent(cl1, ev) == z.C.ZE_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT
    cl0 = z.immediate(dev=0)
    assert z.lib.zeCommandListAppendSignalEvent(cl0, ev) == 0


def test_memory_of_another_context_is_refused(ze):
    z = ze()
    lib = z.lib
    other = z.context()
    p = z.alloc(ctx=other)
    cl = z.immediate()
    # ze_api.h, zeCommandListAppendMemoryFill: "The application must ensure the command list and
    # events were created, and the memory was allocated, on the same context."
    assert z.fill(cl, p) == z.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    # zeMemFree through another context than the allocation's is refused as well.
    assert lib.zeMemFree(z.ctx, p) == z.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    assert lib.zeMemFree(other, p) == 0


def test_host_calls_need_a_host_visible_pool(ze):
    z = ze()
    lib = z.lib
    ev = z.event(z.pool(flags=0))
    # ze_api.h, ze_event_pool_flag_t: ZE_EVENT_POOL_FLAG_HOST_VISIBLE "signals and waits are also
    # visible to host"; without it the host cannot see them: refused.
    assert lib.zeEventHostSignal(ev) == z.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    assert lib.zeEventQueryStatus(ev) == z.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    assert lib.zeEventHostSynchronize(ev, 0) == z.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    assert lib.zeEventHostReset(ev) == z.C.ZE_RESULT_ERROR_INVALID_ARGUMENT


# -- fork ------------------------------------------------------------------------------------------

def test_forked_child_must_call_zeinit_again_and_parent_objects_fail(ze):
    z = ze()
    cl = z.immediate()
    p = z.alloc()
    pid = os.fork()
    if pid == 0:   # pragma: no cover - child
        code = 10
        try:
            lib = sim_ze.open_ze()
            n = ffi.new("uint32_t *", 0)
            # ze_api.h, zeInit: "Each forked process must call this function."
            if lib.zeDriverGet(n, ffi.NULL) != lib.ZE_RESULT_ERROR_UNINITIALIZED:
                os._exit(11)
            if lib.zeInit(0) != 0:
                os._exit(12)
            pat = ffi.new("uint8_t *", 1)
            if lib.zeCommandListAppendMemoryFill(cl, p, pat, 1, 64, ffi.NULL, 0, ffi.NULL) == 0:
                os._exit(13)   # the parent's command list must not work in the child
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert z.fill(cl, p) == 0   # the parent is unaffected


# -- state bounded by live objects (issue 12, item 8) ------------------------------------------------

def test_ze_state_is_bounded_by_live_objects(ze):
    z = ze()
    lib = z.lib
    rt = sim_ze._rt
    base_objects = len(rt.objects)
    p = z.alloc()
    for i in range(5000):
        cl = z.immediate(dev=i % 2)
        pool = z.pool(1)
        ev = z.event(pool)
        assert z.fill(cl, p, signal=ev) == 0
        assert lib.zeCommandListHostSynchronize(cl, _UINT64_MAX) == 0
        assert lib.zeEventDestroy(ev) == 0 and lib.zeEventPoolDestroy(pool) == 0
        assert lib.zeCommandListDestroy(cl) == 0
        if i % 10 == 0:
            q = z.queue()
            assert lib.zeCommandQueueDestroy(q) == 0
            r = z.regular()
            assert lib.zeCommandListDestroy(r) == 0
    assert len(rt.objects) <= base_objects + 1
    assert len(rt.engine.queues) <= 300   # the engine forgets drained, destroyed queues every 256


# == Metal =========================================================================================

from accel.backends import _objc  # noqa: E402
from accel.sim import metal  # noqa: E402

M_QUEUE = _objc.Message("newCommandQueue")
M_CB = _objc.Message("commandBuffer")
M_COMMIT = _objc.Message("commit", "void")
M_WAIT = _objc.Message("waitUntilCompleted", "void")
M_STATUS = _objc.Message("status", "NSUInteger")
M_BLIT = _objc.Message("blitCommandEncoder")
M_END = _objc.Message("endEncoding", "void")
M_FILL = _objc.Message("fillBuffer:range:value:", "void", "id", "NSRange", "uint8_t")
M_NEW_BUFFER = _objc.Message("newBufferWithLength:options:", "id", "NSUInteger", "NSUInteger")
M_MAX_BUFFER = _objc.Message("maxBufferLength", "NSUInteger")
M_LENGTH = _objc.Message("length", "NSUInteger")
M_EVENT = _objc.Message("newSharedEvent")
M_SIGNAL = _objc.Message("encodeSignalEvent:value:", "void", "id", "uint64_t")
M_VALUE = _objc.Message("signaledValue", "uint64_t")


class Mtl:
    """libobjc + Metal as a program on a Mac uses them: the system device and the objc runtime."""

    def __init__(self):
        (ffi_, objc_lib, _), (_, metal_lib, _) = metal.open_libraries()
        self.ffi = ffi_
        self.rt = _objc.Runtime(ffi_, objc_lib)
        self.device = metal_lib.MTLCreateSystemDefaultDevice()
        self.state = metal.state()

    def fill(self, queue, buf, n=64, value=1, event=None, value_to_signal=0):
        rt = self.rt
        with rt.pool():
            cb = rt.send(queue, M_CB)
            enc = rt.send(cb, M_BLIT)
            rt.send(enc, M_FILL, buf, self.ffi.new("NSRange *", (0, n))[0], value)
            rt.send(enc, M_END)
            if event is not None:
                rt.send(cb, M_SIGNAL, event, value_to_signal)
            rt.send(cb, M_COMMIT)
            rt.send(cb, M_WAIT)
            return rt.send(cb, M_STATUS)


@pytest.fixture
def mtl(monkeypatch):
    monkeypatch.setenv("ACCEL_SIM", "mps")
    sim.reset()
    metal.reset()
    m = Mtl()
    yield m
    metal.reset()
    sim.reset()


def test_metal_command_buffer_rules(mtl):
    rt = mtl.rt
    q = rt.send(mtl.device, M_QUEUE)
    buf = rt.send(mtl.device, M_NEW_BUFFER, 64, 0)
    with rt.pool():
        cb = rt.send(q, M_CB)
        enc = rt.send(cb, M_BLIT)
        rt.send(enc, M_END)
        # MTLCommandEncoder.endEncoding: after it "the encoder can no longer encode commands".
        with pytest.raises(metal.MetalValidationError, match="already ended"):
            rt.send(enc, M_FILL, buf, mtl.ffi.new("NSRange *", (0, 4))[0], 1)
        rt.send(cb, M_COMMIT)
        # MTLCommandBuffer.commit: a command buffer is committed once.
        with pytest.raises(metal.MetalValidationError, match="already committed"):
            rt.send(cb, M_COMMIT)
        rt.send(cb, M_WAIT)
    rt.release(buf)
    # A released buffer is gone: any message to it fails (a Mac crashes).
    with pytest.raises(metal.MetalValidationError, match="deallocated"):
        rt.send(buf, M_LENGTH)
    rt.release(q)


def test_metal_buffer_above_max_buffer_length_is_nil(mtl):
    rt = mtl.rt
    limit = rt.send(mtl.device, M_MAX_BUFFER)
    # MTLDevice.maxBufferLength: "the largest amount of memory, in bytes, that a single buffer can
    # allocate"; beyond it newBufferWithLength:options: answers nil, even with memory free.
    assert limit < core.config().memory
    assert rt.send(mtl.device, M_NEW_BUFFER, limit + 1, 0) == rt.nil
    buf = rt.send(mtl.device, M_NEW_BUFFER, limit, 0)
    assert buf != rt.nil
    rt.release(buf)


def test_metal_objects_fail_in_a_forked_child(mtl):
    rt = mtl.rt
    q = rt.send(mtl.device, M_QUEUE)
    buf = rt.send(mtl.device, M_NEW_BUFFER, 64, 0)
    pid = os.fork()
    if pid == 0:   # pragma: no cover - child
        code = 10
        try:
            try:
                mtl.fill(q, buf)
                code = 11          # the parent's queue worked in the child
            except metal.MetalForkError:
                code = 0
            try:
                rt.send(buf, M_LENGTH)
                code = code or 12
            except metal.MetalForkError:
                pass
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert mtl.fill(q, buf) == metal.COMPLETED   # the parent is unaffected
    rt.release(buf)
    rt.release(q)


def test_metal_state_is_bounded_by_live_objects(mtl):
    rt = mtl.rt
    st = mtl.state
    buf = rt.send(mtl.device, M_NEW_BUFFER, 64, 0)
    event = rt.send(mtl.device, M_EVENT)
    base = len(st.objects)
    for i in range(5000):
        q = rt.send(mtl.device, M_QUEUE)
        assert mtl.fill(q, buf, event=event, value_to_signal=i + 1) == metal.COMPLETED
        rt.release(q)
    assert rt.send(event, M_VALUE) == 5000
    assert len(st.objects) == base
    assert len(st.zombies) <= metal.ZOMBIES_KEPT
    assert len(st.engine.queues) <= 300   # the engine forgets drained, destroyed queues every 256
    assert len(st.get(int(mtl.ffi.cast("uintptr_t", event))).points) <= 1
    rt.release(event)
    rt.release(buf)


def test_metal_loaded_but_never_started_works_in_a_forked_child(monkeypatch):
    monkeypatch.setenv("ACCEL_SIM", "mps")
    sim.reset()
    metal.reset()
    (ffi_, objc_lib, _), (_, metal_lib, _) = metal.open_libraries()   # loaded, no device yet
    pid = os.fork()
    if pid == 0:   # pragma: no cover - child
        code = 10
        try:
            rt = _objc.Runtime(ffi_, objc_lib)
            device = metal_lib.MTLCreateSystemDefaultDevice()
            buf = rt.send(device, M_NEW_BUFFER, 64, 0)
            q = rt.send(device, M_QUEUE)
            m = Mtl.__new__(Mtl)
            m.ffi, m.rt = ffi_, rt
            code = 0 if m.fill(q, buf) == metal.COMPLETED else 11
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    metal.reset()
    sim.reset()
    assert os.waitstatus_to_exitcode(status) == 0
