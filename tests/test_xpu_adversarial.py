"""Adversarial use of the Level Zero (XPU) backend on its simulator (ACCEL_SIM=xpu, two devices):
ze* calls failing at each step of module/kernel, stream, event and graph creation and
destruction must leave no leaked handle and a usable backend; the simulated driver refuses what
the specification forbids (a kernel destroyed while the device still references it).

The generic misuse of every simulator is in tests/test_*_adversarial.py; the basics of this
backend in tests/test_xpu*.py."""

import gc
import warnings

import numpy as np
import pytest

import accel
from accel import _lazy, sim
from accel._errors import AcceleratorError
from accel.sim import ze as sim_ze

from conftest import use_sim
from test_user_kernels import expected, saxpy_reference, spirv_module
from test_xpu_sim import gate

#: A code no ze* call returns (the fault sweeps' too): the failure is the injected one.
FAULT = 0x7FFFFFFE
SIG = "f32, ptr, ptr, u64"
_COUNTS = ("ze_live_modules", "ze_live_kernels", "ze_live_build_logs", "ze_live_events", "ze_live_event_pools",
           "ze_live_command_lists", "ze_live_command_queues", "ze_live_allocations")


@pytest.fixture
def xpu(monkeypatch):
    """The simulated XPU backend (initialized) with the saxpy reference registered."""
    use_sim(monkeypatch, "xpu")
    sim.register_kernel("saxpy", saxpy_reference, SIG)
    try:
        yield _lazy.lazy_init()
    finally:
        sim.clear_faults()
        sim.unregister_kernel("saxpy")


@pytest.fixture
def old_loader(monkeypatch):
    """The simulated backend on Debian's 1.8.12 loader (no zeCommandListHostSynchronize: stream
    syncs and queries append a marker event)."""
    use_sim(monkeypatch, "xpu", ACCEL_SIM_ZE_LOADER="1.8.12")
    try:
        yield _lazy.lazy_init()
    finally:
        sim.clear_faults()


def live(keys=_COUNTS) -> dict:
    st = sim_ze.state()
    return {k: st.get(k, 0) for k in keys}


def modules() -> dict:
    return live(_COUNTS[:3])


def slots_held_twice(be) -> int:
    """Event slots in the free and retired lists more than once (two records would share one)."""
    held = [id(sl) for free in be._free_slots.values() for sl in free] + [id(sl) for sl in be._retired]
    return len(held) - len(set(held))


def slots_out_of_circulation(be) -> int:
    """Event slots of the backend's pools that nothing holds: neither the free lists nor the
    retired list, an event, a stream's marker, a graph or a capture (each lost for good)."""
    held = sum(len(v) for v in be._free_slots.values()) + len(be._retired)
    held += sum(1 for e in be._events.values() if e.slot is not None)
    held += sum(1 for s in be._streams.values() if s.marker is not None)
    for g in be._graphs.values():
        held += 2 + (g.completion is not None and g.completion.slot is not None)
    held += 2 * len(be._captures)
    return 64 * len(be._pools) - held


# -- modules and kernels ------------------------------------------------------------------------

@pytest.mark.parametrize("call", ["zeKernelDestroy", "zeModuleDestroy"])
def test_failed_unload_leaves_the_module_open_to_close_again(xpu, call):
    """Module.close() whose zeKernelDestroy or zeModuleDestroy fails raises and leaves the module
    loaded and known, so close() can be tried again (it used to forget the module first: the
    retry said 'not a loaded module' and the module and kernel stayed with the driver)."""
    before = modules()
    m = accel.Module(spirv_module("saxpy"), device=1)
    m.function("saxpy", SIG)
    sim.inject_error(call, FAULT)
    with pytest.raises(AcceleratorError, match=call):
        m.close()
    assert not m.closed
    k = m.function("saxpy", SIG)                    # still usable
    x, y = np.ones(64, np.float32), np.arange(64, dtype=np.float32)
    s1 = accel.Stream(device=1)
    bx, by = accel.Buffer(256, device=1), accel.Buffer(256, device=1)
    bx.copy_from(x, stream=s1)
    by.copy_from(y, stream=s1)
    accel.launch(k, 1, 64, 2.0, bx, by, 64, stream=s1)
    assert by.to_numpy("float32", stream=s1).tobytes() == expected(2.0, x, y).tobytes()
    m.close()
    bx.close(), by.close(), s1.close()
    assert m.closed and modules() == before


def test_failed_build_log_destroy_is_retried(xpu):
    """A zeModuleBuildLogDestroy that fails after a successful build: the module loads (the log
    was read) and the log is released later, not leaked."""
    before = modules()
    sim.inject_error("zeModuleBuildLogDestroy", FAULT)
    m = accel.Module(spirv_module("saxpy"))
    assert m.function("saxpy", SIG)
    accel.synchronize()                             # a sync releases what an error path kept
    m.close()
    assert modules() == before


def test_close_destroys_modules_and_kernels(xpu):
    """backend.close() destroys everything it made: modules and kernels too."""
    m = accel.Module(spirv_module("saxpy", "other"), device=1)
    m.function("saxpy", SIG)
    m.function("other", "ptr")
    xpu.close()
    st = sim_ze.state()
    assert (st["ze_live_modules"], st["ze_live_kernels"], st["ze_live_build_logs"]) == (0, 0, 0)
    m._handle = None                                # the backend forgot it with everything else


# -- the simulated driver: kernels the device still references ------------------------------------

def _raw_kernel(z, name="saxpy"):
    """(module, kernel) made directly on the simulated loader (tests/test_sim_ze_metal_strict.Ze)."""
    from accel._ffi._ze import ffi
    lib = z.lib
    data = spirv_module(name)
    image = ffi.new("uint8_t[]", data)
    desc = ffi.new("ze_module_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_MODULE_DESC,
                                         "format": lib.ZE_MODULE_FORMAT_IL_SPIRV, "inputSize": len(data),
                                         "pInputModule": image})
    mod = ffi.new("ze_module_handle_t *")
    assert lib.zeModuleCreate(z.ctx, z.devices[0], desc, mod, ffi.NULL) == 0
    cname = ffi.new("char[]", name.encode())
    kdesc = ffi.new("ze_kernel_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_KERNEL_DESC, "pKernelName": cname})
    k = ffi.new("ze_kernel_handle_t *")
    assert lib.zeKernelCreate(mod[0], kdesc, k) == 0
    assert lib.zeKernelSetGroupSize(k[0], 1, 1, 1) == 0
    p = z.alloc(64)
    for i, (ctype, value) in enumerate((("float", 1.0), ("void *", p), ("void *", p), ("uint64_t", 0))):
        v = ffi.new(ctype + " *", value)
        assert lib.zeKernelSetArgumentValue(k[0], i, ffi.sizeof(ctype), v) == 0
    return mod[0], k[0]


@pytest.fixture
def ze_raw(monkeypatch):
    from test_sim_ze_metal_strict import Ze
    monkeypatch.setenv("ACCEL_SIM", "xpu")
    sim.reset()
    sim.register_kernel("saxpy", saxpy_reference, SIG)
    try:
        yield Ze()
    finally:
        sim.unregister_kernel("saxpy")
        sim.reset()


def test_sim_refuses_destroying_a_kernel_the_device_references(ze_raw):
    """ze_api.h, zeKernelDestroy: "The application is responsible for making sure the device is
    not currently referencing the kernel before it is deleted": a launch submitted and not yet
    run keeps it (HANDLE_OBJECT_IN_USE, as zeEventDestroy of a referenced event)."""
    from accel._ffi._ze import ffi
    z = ze_raw
    lib = z.lib
    mod, k = _raw_kernel(z)
    cl = z.immediate()
    held = z.event(z.pool(1))
    arr = ffi.new("ze_event_handle_t[1]", [held])
    assert lib.zeCommandListAppendWaitOnEvents(cl, 1, arr) == 0
    count = ffi.new("ze_group_count_t *", (1, 1, 1))
    assert lib.zeCommandListAppendLaunchKernel(cl, k, count, ffi.NULL, 0, ffi.NULL) == 0
    assert lib.zeKernelDestroy(k) == lib.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    assert lib.zeEventHostSignal(held) == 0
    assert lib.zeCommandListHostSynchronize(cl, (1 << 64) - 1) == 0
    assert lib.zeKernelDestroy(k) == 0
    assert lib.zeModuleDestroy(mod) == 0


def test_sim_refuses_a_regular_list_launching_a_destroyed_kernel(ze_raw):
    """A closed regular list recorded a launch; the kernel is destroyed since (allowed: the
    device does not reference it yet).  Executing the list would run freed driver memory; the
    documents are silent, the simulator refuses (as for an event destroyed since)."""
    from accel._ffi._ze import ffi
    z = ze_raw
    lib = z.lib
    mod, k = _raw_kernel(z)
    cl, q = z.regular(), z.queue()
    count = ffi.new("ze_group_count_t *", (1, 1, 1))
    assert lib.zeCommandListAppendLaunchKernel(cl, k, count, ffi.NULL, 0, ffi.NULL) == 0
    assert lib.zeCommandListClose(cl) == 0
    assert lib.zeKernelDestroy(k) == 0
    lists = ffi.new("ze_command_list_handle_t[1]", [cl])
    assert lib.zeCommandQueueExecuteCommandLists(q, 1, lists, ffi.NULL) == lib.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    assert lib.zeModuleDestroy(mod) == 0


def test_module_close_waits_for_launches_still_queued(monkeypatch):
    """Module.close() right after a launch the device has not run yet: the backend waits for it
    before zeKernelDestroy (the kernel runs, and the module goes)."""
    use_sim(monkeypatch, "xpu", ACCEL_SIM_DELAY_US=20000)
    sim.register_kernel("saxpy", saxpy_reference, SIG)
    try:
        before = modules()
        m = accel.Module(spirv_module("saxpy"), device=1)
        k = m.function("saxpy", SIG)
        x, y = np.ones(64, np.float32), np.arange(64, dtype=np.float32)
        s1 = accel.Stream(device=1)
        bx, by = accel.Buffer(256, device=1, stream=s1), accel.Buffer(256, device=1, stream=s1)
        bx.copy_from(x, stream=s1, non_blocking=True)
        by.copy_from(y, stream=s1, non_blocking=True)
        accel.launch(k, 1, 64, 2.0, bx, by, 64, stream=s1)
        m.close()
        assert modules() == before
        assert by.to_numpy("float32", stream=s1).tobytes() == expected(2.0, x, y).tobytes()
        assert sim_ze.state()["ze_errors"] == []
    finally:
        sim.unregister_kernel("saxpy")


def test_module_close_waits_for_a_graph_replay_launching_its_kernel(monkeypatch):
    """Module.close() while a graph replay that launches its kernel still runs on the graph's
    command queue: the backend waits for the replay first; a later replay is refused."""
    use_sim(monkeypatch, "xpu", ACCEL_SIM_DELAY_US=20000)
    sim.register_kernel("saxpy", saxpy_reference, SIG)
    try:
        before = modules()
        m = accel.Module(spirv_module("saxpy"), device=1)
        k = m.function("saxpy", SIG)
        x, y = np.ones(64, np.float32), np.arange(64, dtype=np.float32)
        s1 = accel.Stream(device=1)
        bx, by = accel.Buffer(256, device=1, stream=s1), accel.Buffer(256, device=1, stream=s1)
        bx.copy_from(x, stream=s1)
        by.copy_from(y, stream=s1)
        g = accel.Graph()
        with s1, g:
            accel.launch(k, 1, 64, 2.0, bx, by, 64)
        with s1:
            g.replay()
        m.close()
        assert modules() == before
        assert by.to_numpy("float32", stream=s1).tobytes() == expected(2.0, x, y).tobytes()
        with s1, pytest.raises(RuntimeError, match="was closed, but this graph launches its kernels"):
            g.replay()
        g.reset()
        assert sim_ze.state()["ze_errors"] == []
    finally:
        sim.unregister_kernel("saxpy")


def test_backend_graph_launch_after_its_kernel_was_unloaded_is_refused(xpu):
    """The backend alone (accel.Graph's check bypassed): replaying a regular list whose kernel
    was destroyed is refused by the simulated driver; the stream, graph and backend stay usable
    and nothing leaks."""
    be = xpu
    m = accel.Module(spirv_module("saxpy"), device=0)
    k = m.function("saxpy", SIG)
    x = accel.Buffer(256)
    s = accel.Stream()
    be.capture_begin(s.handle, "global")
    be.launch(k.handle, (1, 1, 1), (64, 1, 1), [("f32", 1.0), ("ptr", x.ptr), ("ptr", x.ptr), ("u64", 0)],
              0, s.handle)
    graph = be.capture_end(s.handle)
    exe = be.graph_instantiate(graph)
    be.graph_launch(exe, s.handle)
    m.close()                                       # waits for the replay
    with pytest.raises(AcceleratorError, match="zeCommandQueueExecuteCommandLists failed with "
                                               "ZE_RESULT_ERROR_INVALID_NULL_HANDLE"):
        be.graph_launch(exe, s.handle)
    s.synchronize()
    x.fill_(3)
    assert (x.to_numpy("uint8") == 3).all()
    be.graph_exec_destroy(exe)
    be.graph_destroy(graph)
    s.close()
    x.close()
    accel.synchronize()
    assert slots_out_of_circulation(be) == 0


# -- event slots: failures while taking or using one ---------------------------------------------

def test_failed_marker_append_returns_its_event_slot(old_loader):
    """On the 1.8.12 loader a stream sync appends a marker event from a pool; an append that
    fails must give the slot back (each failure lost one for good, so the backend's close
    could not destroy the pool: zeEventPoolDestroy IN_USE)."""
    be = old_loader
    s = accel.Stream(device=1)
    b = accel.Buffer(4096, device=1, stream=s)
    for _ in range(3):
        be.memset_async(b.ptr, 1, 4096, s.handle)
        sim.inject_error("zeCommandListAppendSignalEvent", FAULT)
        with pytest.raises(AcceleratorError, match="zeCommandListAppendSignalEvent"):
            s.synchronize()
        s.synchronize()
    assert slots_out_of_circulation(be) == 0
    b.close()
    s.close()
    be.close()
    st = sim_ze.state()
    assert (st["ze_live_events"], st["ze_live_event_pools"]) == (0, 0)


def _leave_one_free_slot(be, dev_index=0):
    """Take every free untimed slot of the device's context but one; returns them to put back."""
    dev = be._devices[dev_index]
    free = be._free_slots.setdefault((id(dev.ctx), False), [])
    if not free:
        be._retire(be._acquire(dev, False))     # a pool made, its first slot retired
        be._sweep()
    taken = free[1:]
    del free[1:]
    return taken


@pytest.mark.parametrize("call", ["zeEventPoolCreate", "zeEventCreate"])
def test_capture_begin_whose_second_event_slot_fails_leaks_nothing(xpu, call):
    """capture_begin takes two event slots; when the pools hold one and making a new pool fails,
    the regular command list and the first slot must not be left behind."""
    be = xpu
    s = accel.Stream()
    accel.synchronize()
    taken = _leave_one_free_slot(be)
    before = live()
    sim.inject_error(call, FAULT)
    try:
        with pytest.raises(AcceleratorError, match=call):
            be.capture_begin(s.handle, "global")
    finally:
        sim.clear_faults()
        be._free_slots[(id(be._devices[0].ctx), False)].extend(taken)
    assert not be.stream_is_capturing(s.handle) and be.captures_underway() == 0
    accel.synchronize()
    assert live() == before
    assert slots_out_of_circulation(be) == 0
    g = accel.Graph()                               # capture still works on that stream
    b = accel.Buffer(64)
    with s, g:
        b.fill_(5)
    with s:
        g.replay()
    assert (b.to_numpy("uint8", stream=s) == 5).all()


# -- graph replays that fail half way ----------------------------------------------------------

def _read(be, ptr, stream, n=4096):
    from accel._hostmem import address_of
    out = np.zeros(n, np.uint8)
    be.memcpy_async(address_of(out), ptr, n, stream)        # pageable destination: synchronous
    return out


@pytest.mark.parametrize("step", ["wait", "reset", "execute"])
def test_replay_after_a_launch_that_failed_half_way_stays_in_stream_order(monkeypatch, step):
    """graph_launch signals the graph's gate event on the stream, executes the list, then makes
    the stream wait for (and reset) the list's done event.  When a step after the signal fails,
    an event is left signalled that the next replay takes as its own: its list ran before the
    stream's earlier work (a stale gate) or the stream went on before it finished (a stale done
    event).  Here the next replay's stream is held before the replay: the replay must not have
    run (done not signalled) until it is let go, and then it copies what the stream wrote."""
    use_sim(monkeypatch, "xpu")
    be = _lazy.lazy_init()
    lib = be._lib[1]
    n = 4096
    s, s2 = be.stream_create(), be.stream_create()
    a, b = be.mem_alloc(n), be.mem_alloc(n)
    be.capture_begin(s, "global")
    be.memcpy_async(b, a, n, s)                     # the graph copies a to b
    graph = be.capture_end(s)
    exe = be.graph_instantiate(graph)
    be.memset_async(a, 1, n, s)
    be.graph_launch(exe, s)
    assert (_read(be, b, s) == 1).all()
    call = {"wait": "zeCommandListAppendWaitOnEvents", "reset": "zeCommandListAppendEventReset",
            "execute": "zeCommandQueueExecuteCommandLists"}[step]
    sim.inject_error(call, FAULT)
    with pytest.raises(AcceleratorError, match=call):
        be.graph_launch(exe, s)
    be.device_synchronize()
    for value, stream in ((2, s2), (3, s)):
        release = gate(be, stream)
        be.memset_async(a, value, n, stream)
        be.graph_launch(exe, stream)
        assert lib.zeEventQueryStatus(be._execs[exe].done.event) == lib.ZE_RESULT_NOT_READY, \
            "the replay ran before the stream's earlier work, or its done event was left signalled"
        release()
        assert (_read(be, b, stream) == value).all()
    be.graph_exec_destroy(exe)
    be.graph_destroy(graph)
    be.stream_destroy(s)
    be.stream_destroy(s2)
    be.mem_free(a), be.mem_free(b)
    be.device_synchronize()
    assert slots_out_of_circulation(be) == 0
    assert sim_ze.state()["ze_errors"] == []


def test_sim_list_is_free_once_its_last_signal_is_visible(ze_raw, monkeypatch):
    """A host thread that saw the event signalled by an immediate list's last command may destroy
    the list: the device is done with it.  The simulator counted the command complete only after
    its signal had woken the host, so a destroy in that window failed with IN_USE (Stream.close
    on the 1.8.12 loader under threads, about 1 in 200)."""
    from accel._ffi._ze import ffi
    z = ze_raw
    lib = z.lib
    cl = z.immediate()
    ev = z.event(z.pool(1))
    target = sim_ze._rt.get(ev, "event")
    results = []
    signal = sim_ze.events._signal_now

    def then_destroy(rt, e, *timed):        # the host wakes here and destroys the list at once
        signal(rt, e, *timed)
        if e is target:
            results.append(lib.zeCommandListDestroy(cl))
    monkeypatch.setattr(sim_ze.events, "_signal_now", then_destroy)
    assert lib.zeCommandListAppendSignalEvent(cl, ev) == 0
    assert lib.zeEventHostSynchronize(ev, (1 << 64) - 1) == 0
    assert results == [0]
    assert sim_ze.state()["ze_live_command_lists"] == 0


# -- init ------------------------------------------------------------------------------------------

def _contexts() -> int:
    return sum(1 for o in sim_ze._rt.objects.values() if o.kind == "context" and o.live)


@pytest.mark.parametrize("call, after", [("zeDeviceGetModuleProperties", 0), ("zeDeviceGetComputeProperties", 1),
                                         ("zeCommandListCreateImmediate", 1)])
def test_failed_init_leaves_no_context_or_list_behind(monkeypatch, call, after):
    """A ze* call failing during init (after the context was made, on the first or the second
    device): init raises, the context and any default stream's list are destroyed, and a second
    init works and makes exactly one context."""
    use_sim(monkeypatch, "xpu")
    from accel import backends
    be = backends.get("xpu")
    sim.inject_error(call, FAULT, after=after)
    with pytest.raises(AcceleratorError, match=call):
        be.init()
    sim.clear_faults()
    assert _contexts() == 0
    assert sim_ze.state()["ze_live_command_lists"] == 0
    be.init()
    assert _contexts() == 1
    assert be.count() == 2
    s = be.stream_create()
    be.stream_destroy(s)


class _Hooked:
    """The loader with one function wrapped: ``after(result)`` runs once right after it returns."""

    def __init__(self, lib, name, after):
        self._lib, self._name, self._after = lib, name, after

    def __getattr__(self, attr):
        fn = getattr(self._lib, attr)
        if attr != self._name or self._after is None:
            return fn

        def wrapped(*args):
            rc = fn(*args)
            after, self._after = self._after, None
            after()
            return rc
        return wrapped


def test_a_wait_for_a_replay_does_not_forget_a_replay_launched_meanwhile(monkeypatch):
    """A free (or device_synchronize) waits for the graphs' queues without the graph's lock, then
    notes the graph idle.  A replay launched by another thread between that wait and the note
    was forgotten: the next replay resubmitted the list while the device still ran it
    (zeCommandQueueExecuteCommandLists IN_USE)."""
    import threading
    use_sim(monkeypatch, "xpu", ACCEL_SIM_DELAY_US=20000)
    be = _lazy.lazy_init()
    n = 4096
    s = be.stream_create()
    a, b = be.mem_alloc(n), be.mem_alloc(n)
    be.capture_begin(s, "global")
    be.memcpy_async(b, a, n, s)
    be.memset_async(a, 5, n, s)
    graph = be.capture_end(s)
    exe = be.graph_instantiate(graph)
    be.graph_launch(exe, s)
    other = threading.Thread(target=be.graph_launch, args=(exe, s))
    ffi, lib, path = be._lib
    monkeypatch.setattr(be, "_lib", (ffi, _Hooked(lib, "zeCommandQueueSynchronize",
                                                  lambda: (other.start(), other.join())), path))
    be.device_synchronize()         # its wait returns; the other thread launches the graph again
    monkeypatch.setattr(be, "_lib", (ffi, lib, path))
    be.graph_launch(exe, s)         # while that replay still runs
    be.device_synchronize()
    be.graph_exec_destroy(exe)
    be.graph_destroy(graph)
    be.stream_destroy(s)
    be.mem_free(a), be.mem_free(b)
    assert sim_ze.state()["ze_errors"] == []


# -- an event recorded again by another thread while it is queried ---------------------------------

def _race_on_first_read(obj, attr, action):
    """Make ``obj`` (a backend _Event or _Stream) run ``action`` when ``attr`` is first read:
    another thread's call landing between two steps of the caller."""
    cls = type(obj)
    base = getattr(cls, attr)
    state = {"action": action}

    def get(self):
        act, state["action"] = state["action"], None
        if act is not None:
            act()
        return base.__get__(self)

    obj.__class__ = type("_Racy" + cls.__name__, (cls,), {"__slots__": (), attr: property(get, base.__set__)})


def _race_between_reads(obj, attrs, action):
    """Run ``action`` just before the second read of any of ``attrs`` (those ``obj``'s class
    has): another thread's call landing between two reads of one call.  Returns a function
    that runs the action if it has not run (a call that read the fields once)."""
    cls = type(obj)
    state = {"reads": 0, "action": action}

    def fire():
        act, state["action"] = state["action"], None
        if act is not None:
            act()

    def make(base):
        def get(self):
            state["reads"] += 1
            if state["reads"] == 2:
                fire()
            return base.__get__(self)
        return property(get, getattr(base, "__set__", None))

    body = {"__slots__": ()}
    for attr in attrs:
        base = getattr(cls, attr, None)
        if base is not None:
            body[attr] = make(base)
    obj.__class__ = type("_Racy" + cls.__name__, (cls,), body)
    return fire


@pytest.mark.parametrize("call", ["event_query", "event_synchronize"])
def test_event_recorded_again_while_queried_does_not_advance_the_new_stream(xpu, call):
    """Thread A queries (or synchronizes) an event whose record completed; thread B records it
    again, between A's reads of the event's record, on a stream whose work is still pending.
    A read the old slot but the new stream and number, found the old slot signalled and noted
    the new stream complete up to the new record: the stream's query then said True while its
    work had not run (and event slots and staging memory it still used could be reused)."""
    be = xpu
    s0, s1 = be.stream_create(), be.stream_create()
    e = be.event_create()
    be.event_record(e, s0)
    be.stream_synchronize(s0)
    release = gate(be, s1)
    p = be.mem_alloc(4096)
    be.memset_async(p, 1, 4096, s1)
    late = _race_between_reads(be._events[e], ("slot", "stream", "seq", "rec"), lambda: be.event_record(e, s1))
    if call == "event_query":
        be.event_query(e)
    else:
        be.event_synchronize(e)         # a wait for the new record could not end: s1 is held
    late()
    assert not be.stream_query(s1), "the held stream was noted complete"
    assert not be.event_query(e)
    release()
    be.stream_synchronize(s1)
    assert be.event_query(e)
    be.mem_free(p)
    be.event_destroy(e)
    be.stream_destroy(s0), be.stream_destroy(s1)


def test_wait_on_an_event_recorded_again_meanwhile_waits_for_a_live_record(xpu):
    """Thread A makes stream s2 wait on an event; thread B records the event again meanwhile and
    the old record's slot is recycled (reset, then signalled by another event's record on a
    stream still held).  A appended its wait on the slot it had read first: s2 waited for that
    unrelated held work instead of for the event."""
    be = xpu
    s0, s1, s2 = be.stream_create(), be.stream_create(), be.stream_create()
    e, f = be.event_create(), be.event_create()
    be.event_record(e, s0)
    be.stream_synchronize(s0)
    release = gate(be, s1)

    def other_thread():
        be.event_record(e, s0)          # the old slot is retired ...
        be.stream_synchronize(s0)       # ... recycled once s0 passed it ...
        be.event_record(f, s1)          # ... and signalled by f's record, behind the held work
    _race_on_first_read(be._streams[s2], "capture", other_thread)
    be.stream_wait_event(s2, e)
    be.stream_synchronize(s0)
    assert be.stream_query(s2), "s2 waits for work unrelated to the event"
    release()
    be.stream_synchronize(s1)
    for ev in (e, f):
        be.event_destroy(ev)
    for st in (s0, s1, s2):
        be.stream_destroy(st)


def test_failed_wait_on_an_event_does_not_pin_its_slot(xpu):
    """A stream_wait_event whose append fails, on a stream destroyed afterwards: the event's slot
    still comes back to the pool (its use by the wait is passed)."""
    be = xpu
    s0, s1 = be.stream_create(), be.stream_create()
    e = be.event_create()
    be.event_record(e, s0)
    sim.inject_error("zeCommandListAppendWaitOnEvents", FAULT)
    with pytest.raises(AcceleratorError, match="zeCommandListAppendWaitOnEvents"):
        be.stream_wait_event(s1, e)
    be.stream_destroy(s1)
    slot = be._events[e].slot
    be.event_destroy(e)
    be.stream_destroy(s0)
    be.device_synchronize()
    assert slot not in be._retired and slots_out_of_circulation(be) == 0


class _Before:
    """The loader with one function wrapped once: ``before(args)`` runs first and returns the
    arguments to call it with."""

    def __init__(self, lib, name, before):
        self._lib, self._name, self._before = lib, name, before

    def __getattr__(self, attr):
        fn = getattr(self._lib, attr)
        if attr != self._name or self._before is None:
            return fn

        def wrapped(*args):
            before, self._before = self._before, None
            return fn(*before(args))
        return wrapped


def test_event_synchronize_keeps_the_slot_it_waits_on(xpu, monkeypatch):
    """Thread A synchronizes an event; before its zeEventHostSynchronize, thread B records the
    event again, learns the old record complete (a sync) and records another event on a held
    stream.  The old slot was reset and reused by that record: A waited for the held stream
    (for ever) instead of returning.  Here A's wait is made with timeout 0: its slot must be
    the signalled one."""
    be = xpu
    s0, s1, held = be.stream_create(), be.stream_create(), be.stream_create()
    e, f = be.event_create(), be.event_create()
    release = gate(be, held)
    be.event_record(e, s0)              # done on the device; the backend does not know yet

    def other_thread(args):
        be.event_record(e, s1)
        be.stream_synchronize(s0)
        be.event_record(f, held)
        return args[0], 0
    ffi, lib, path = be._lib
    monkeypatch.setattr(be, "_lib", (ffi, _Before(lib, "zeEventHostSynchronize", other_thread), path))
    be.event_synchronize(e)
    monkeypatch.setattr(be, "_lib", (ffi, lib, path))
    release()
    be.device_synchronize()
    for ev in (e, f):
        be.event_destroy(ev)
    for st in (s0, s1, held):
        be.stream_destroy(st)
    assert slots_out_of_circulation(be) == 0


# -- many threads; interpreter exit ---------------------------------------------------------------

@pytest.mark.parametrize("loader", ["new", "1.8.12"])
def test_threads_creating_and_destroying_streams_and_events_keep_state_bounded(monkeypatch, loader):
    """Four threads create streams and events on both devices, record, wait across devices,
    query and destroy them: no error, no slot lost, pools and lists bounded by what is live."""
    import threading
    use_sim(monkeypatch, "xpu", ACCEL_SIM_ZE_LOADER=loader, ACCEL_SIM_DELAY_US=50)
    be = _lazy.lazy_init()
    lists = sim_ze.state()["ze_live_command_lists"]
    errors = []

    def work(t):
        try:
            for i in range(40):
                d = (t + i) % 2
                s = accel.Stream(device=d)
                other = accel.Stream(device=1 - d)
                with accel.device_index(d):
                    e = accel.Event(enable_timing=bool(i % 2))
                e.record(s)
                other.wait_event(e)             # device d's event waited on the other device
                if i % 3 == 0:
                    e.synchronize()
                if i % 4 == 0:
                    s.query(), other.query()
                e.close()
                s.close()
                other.close()
        except BaseException as exc:        # noqa: B902 (reported below)
            errors.append(exc)
    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for d in (0, 1):
        with accel.device_index(d):
            accel.synchronize()
    assert slots_out_of_circulation(be) == 0
    assert len(be._pools) <= 4 and len(be._events) == 0
    assert sim_ze.state()["ze_live_command_lists"] == lists
    assert sim_ze.state()["ze_errors"] == []


_EXIT_SCRIPT = r"""
import sys
sys.path.insert(0, {tests!r})
import numpy as np, accel
from accel import sim
from test_user_kernels import spirv_module, saxpy_reference
sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64")
k = accel.Module(spirv_module("saxpy"), device=1).function("saxpy", "f32, ptr, ptr, u64")
s1 = accel.Stream(device=1)
x, y = accel.Buffer(1 << 16, device=1, stream=s1), accel.Buffer(1 << 16, device=1, stream=s1)
for _ in range(5):
    accel.launch(k, 1, 64, 2.0, x, y, 64, stream=s1)
g = accel.Graph()
with s1, g:
    accel.launch(k, 1, 64, 2.0, x, y, 64)
    y.fill_(1)
with s1:
    g.replay()
e = accel.Event(enable_timing=True)
e.record(s1)
s0 = accel.Stream(device=0)
s0.wait_event(e)
a = accel.Buffer(1 << 16, device=0, stream=s0)
a.copy_from(np.ones(1 << 14, np.float32), stream=s0, non_blocking=True)
print("live objects left for exit")
"""


@pytest.mark.parametrize("loader", ["new", "1.8.12"])
def test_interpreter_exit_with_live_objects_and_queued_work(loader, tmp_path):
    """A program that exits with modules, a graph replaying, events, streams on both devices and
    queued work still live: a clean exit, nothing on stderr."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ZE_"))}
    env.update(ACCEL_SIM="xpu", ACCEL_SIM_DEVICES="2", ACCEL_SIM_ZE_LOADER=loader, ACCEL_SIM_DELAY_US="2000")
    script = tmp_path / "exit.py"
    script.write_text(_EXIT_SCRIPT.format(tests=os.path.dirname(__file__)))
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout == "live objects left for exit\n"


# -- every ze* call of a kernel/graph/cross-device workload failing -------------------------------

def _workload(objs):
    """A module on device 1, launches, an event of device 1 waited on device 0, elapsed time, a
    graph launching the kernel replayed twice, the module closed, streams closed."""
    s0 = objs.add(accel.Stream(device=0))
    s1 = objs.add(accel.Stream(device=1))
    m = objs.add(accel.Module(spirv_module("saxpy"), device=1))
    k = m.function("saxpy", SIG)
    x = np.arange(64, dtype=np.float32)
    bx = objs.add(accel.Buffer(256, device=1, stream=s1))
    by = objs.add(accel.Buffer(256, device=1, stream=s1))
    bx.copy_from(x, stream=s1)
    by.copy_from(x, stream=s1)
    accel.launch(k, 1, 64, 2.0, bx, by, 64, stream=s1)
    start, end = objs.add(accel.Event(enable_timing=True)), objs.add(accel.Event(enable_timing=True))
    start.record(s1)
    end.record(s1)
    s0.wait_event(end)
    a = objs.add(accel.Buffer(256, device=0, stream=s0))
    a.fill_(3, stream=s0)
    end.synchronize()
    start.elapsed_time(end)
    g = objs.add(accel.Graph())
    with s1, g:
        accel.launch(k, 1, 64, 0.5, bx, by, 64)
        by.fill_(1)
    with s1:
        g.replay()
        g.replay()
    s1.synchronize()
    g.reset()
    m.close()
    s0.close()
    s1.close()


class _Objs(list):
    def add(self, obj):
        self.append(obj)
        return obj

    def close(self):
        for obj in self:
            if isinstance(obj, accel.Graph):
                obj.reset()
            else:
                obj.close()


def _teardown(objs):
    sim.clear_faults()
    accel.set_device_index(0)
    objs.close()
    for d in (0, 1):
        with accel.device_index(d):
            accel.synchronize()
    accel.memory.empty_cache()
    accel.memory.empty_host_cache()


def _state(be):
    return dict(live(), slots_lost=slots_out_of_circulation(be), orphans=len(be._orphans),
                used=sim_ze.state()["ze_device_used"])


@pytest.mark.parametrize("loader", ["new", "1.8.12"])
def test_fault_sweep_of_modules_graphs_and_cross_device_events(xpu, monkeypatch, loader):
    """Each ze* call of the workload fails (its first and its last call, once), one at a time:
    the workload raises an accel error or recovers; after teardown nothing is left with the
    driver (modules, kernels, logs, lists, queues, events, pools, memory), no event slot is
    lost, and a fresh workload works."""
    if loader != "new":
        use_sim(monkeypatch, "xpu", ACCEL_SIM_ZE_LOADER=loader)
        sim.register_kernel("saxpy", saxpy_reference, SIG, replace=True)
    be = _lazy.lazy_init()
    for _ in range(2):                  # caches, pools and lazily made state settle
        objs = _Objs()
        _workload(objs)
        _teardown(objs)
    base = _state(be)
    sim.reset_call_counts()
    objs = _Objs()
    _workload(objs)
    calls = sim.calls()
    _teardown(objs)
    for name in sorted(calls):
        for k in sorted({0, calls[name] - 1}):
            where = f"{name} failing at call {k + 1} of {calls[name]}"
            sim.inject_error(name, FAULT, after=k)
            objs = _Objs()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")     # "the XPU Graph is empty": a capture that failed
                try:
                    _workload(objs)
                except AcceleratorError:
                    pass
                finally:
                    _teardown(objs)
            gc.collect()
            accel.Buffer(8).close()     # an API entry runs deferred releases
            accel.memory.empty_cache()
            assert _state(be) == base, where
            objs = _Objs()
            try:
                _workload(objs)
            finally:
                _teardown(objs)


def test_backend_elapsed_time_across_devices_is_refused(xpu):
    """Kernel timestamps of two devices come from two clocks: their difference means nothing.
    The backend returned it (accel.Event refuses first; CUDA's runtime refuses too)."""
    be = xpu
    s0, s1 = be.default_stream(0), be.default_stream(1)
    a = be.event_create(True)
    with accel.device_index(1):
        b = be.event_create(True)
    be.event_record(a, s0)
    be.event_record(b, s1)
    be.event_synchronize(a), be.event_synchronize(b)
    with pytest.raises(AcceleratorError, match="recorded on XPU device 0 and device 1"):
        be.event_elapsed_ms(a, b)
    c = be.event_create(True)
    be.event_record(c, s0)
    be.event_synchronize(c)
    assert be.event_elapsed_ms(a, c) >= 0


def test_graph_launch_racing_the_destroy_of_its_exec_appends_nothing(xpu):
    """Thread A launches an exec while thread B destroys it and its graph (user error, refused):
    A found the exec, then B released the list, queue and gate events; A signalled the released
    gate slot on its stream (a slot the pool may give to another record) before failing."""
    be = xpu
    s = be.stream_create()
    p = be.mem_alloc(64)
    be.capture_begin(s, "global")
    be.memset_async(p, 1, 64, s)
    graph = be.capture_end(s)
    exe = be.graph_instantiate(graph)

    class Racy(dict):
        def get(self, key, default=None):
            value = dict.get(self, key, default)
            if key == exe and value is not None:
                be.graph_exec_destroy(exe)          # thread B, right after A found the exec
                be.graph_destroy(graph)
            return value
    be._execs = Racy(be._execs)
    seq = be._streams[s].seq
    with pytest.raises(ValueError, match="graph exec .* destroyed"):
        be.graph_launch(exe, s)
    assert be._streams[s].seq == seq
    be.device_synchronize()
    assert slots_out_of_circulation(be) == 0
    be.stream_destroy(s)
    be.mem_free(p)


def test_launch_racing_the_unload_of_its_module_is_refused(xpu):
    """Thread A launches a kernel while thread B unloads its module (user error, refused): A had
    found the kernel, B destroyed it (its handle value goes to the next kernel made), and A
    appended a launch of the destroyed handle.  Now a ValueError, nothing appended."""
    be = xpu
    m = accel.Module(spirv_module("saxpy"))
    k = m.function("saxpy", SIG)
    x = accel.Buffer(256)
    s = accel.Stream()
    modules_, kernels_, _ = be._kernel_state()
    handle = m._handle

    class Racy(dict):
        def get(self, key, default=None):
            value = dict.get(self, key, default)
            if key == k.handle and value is not None and handle in modules_:
                be.module_unload(handle)            # thread B, right after A found the kernel
            return value
    be._kstate = (modules_, Racy(kernels_), be._kstate[2])
    seq = be._streams[s.handle].seq
    with pytest.raises(ValueError, match="unloaded"):
        be.launch(k.handle, (1, 1, 1), (64, 1, 1), [("f32", 1.0), ("ptr", x.ptr), ("ptr", x.ptr), ("u64", 0)],
                  0, s.handle)
    assert be._streams[s.handle].seq == seq
    m._handle = None
    s.close()
    x.close()


@pytest.mark.parametrize("op", ["memset", "memcpy", "record", "wait", "launch", "graph"])
def test_work_on_a_stream_destroyed_by_another_thread_meanwhile_is_refused(xpu, op):
    """Thread A queues work on a stream; thread B destroys the stream after A looked it up and
    creates another, which the driver gives the same command list handle.  A's work went to
    B's new stream (or to a destroyed list).  Now a ValueError, and the new list gets nothing."""
    be = xpu
    victim = be.stream_create()
    p, q = be.mem_alloc(256), be.mem_alloc(256)
    e = be.event_create()
    be.event_record(e, be.default_stream(0))
    m = accel.Module(spirv_module("saxpy"))
    k = m.function("saxpy", SIG)
    side = be.stream_create()
    be.capture_begin(side, "global")
    be.memset_async(p, 2, 256, side)
    graph = be.capture_end(side)
    exe = be.graph_instantiate(graph)
    made = []

    class Racy(dict):
        def get(self, key, default=None):
            value = dict.get(self, key, default)
            if key == victim and value is not None and not made:
                made.append(None)
                be.stream_destroy(victim)           # thread B, right after A found the stream
                made[0] = be.stream_create()
            return value
    be._streams = Racy(be._streams)
    calls = {
        "memset": lambda: be.memset_async(p, 1, 256, victim),
        "memcpy": lambda: be.memcpy_async(q, p, 256, victim),
        "record": lambda: be.event_record(e, victim),
        "wait": lambda: be.stream_wait_event(victim, e),
        "launch": lambda: be.launch(k.handle, (1, 1, 1), (1, 1, 1),
                                    [("f32", 1.0), ("ptr", p), ("ptr", q), ("u64", 0)], 0, victim),
        "graph": lambda: be.graph_launch(exe, victim),
    }
    with pytest.raises(ValueError, match="destroyed"):
        calls[op]()
    new = made[0]
    assert new == victim                            # the driver reused the value (the hazard)
    assert sim_ze._rt.get(be._streams[new].list, "cmdlist").submitted == 0
    be._streams = dict(be._streams)
    be.device_synchronize()
    be.graph_exec_destroy(exe), be.graph_destroy(graph)
    for st in (new, side):
        be.stream_destroy(st)
    be.event_destroy(e)
    be.mem_free(p), be.mem_free(q)
    m.close()
    be.device_synchronize()
    assert slots_out_of_circulation(be) == 0


def _race_before_write(obj, attr, action):
    """Run ``action`` once, just before ``attr`` of ``obj`` is next written."""
    cls = type(obj)
    base = getattr(cls, attr)
    state = {"action": action}

    def set_(self, value):
        act, state["action"] = state["action"], None
        if act is not None:
            act()
        base.__set__(self, value)
    obj.__class__ = type("_Racy" + cls.__name__, (cls,), {"__slots__": (), attr: property(base.__get__, set_)})


@pytest.mark.parametrize("other", ["record", "destroy"])
def test_event_recorded_by_two_threads_at_once_keeps_each_slot_once(xpu, other):
    """Two threads record one event at once (or one records while the other destroys it): each
    took the previous record from the event and put its own: the previous slot went back to
    the pool twice (two later records shared it) and one new slot was lost, or the record of a
    destroyed event kept its slot for good."""
    import threading
    be = xpu
    s1, s2 = be.stream_create(), be.stream_create()
    e = be.event_create()
    be.event_record(e, s1)
    if other == "record":
        action = lambda: be.event_record(e, s2)     # noqa: E731
    else:
        action = lambda: be.event_destroy(e)        # noqa: E731
    errors = []

    def thread_b():
        try:
            action()
        except ValueError as exc:
            errors.append(exc)

    def between():
        b = threading.Thread(target=thread_b)
        b.start()
        b.join(0.5)      # B runs now, or waits for a lock A holds (then it runs after A)
        state["b"] = b
    state = {}
    _race_before_write(be._events[e], "rec", between)   # A has read the old record, not yet put its own
    try:
        be.event_record(e, s1)
    except ValueError:
        assert other == "destroy"
    state["b"].join()
    if e in be._events:
        be.event_destroy(e)
    be.device_synchronize()
    be.stream_destroy(s1), be.stream_destroy(s2)
    be.device_synchronize()
    assert slots_held_twice(be) == 0
    assert slots_out_of_circulation(be) == 0
