"""Level Zero simulator, round r69f: command lists without IN_ORDER are not in-order.

The Core Programming Guide (PROG.rst, level-zero-spec), Barriers > Execution Barriers: "Commands
executed on a command list are only guaranteed to start in the same order in which they are
submitted; i.e. there is no implicit definition of the order of completion"; Memory Barriers:
"Commands executed on a command list are *not* guaranteed to maintain memory coherency with other
commands". Only ZE_COMMAND_LIST_FLAG_IN_ORDER (ZE_COMMAND_QUEUE_FLAG_IN_ORDER for an immediate list,
both API 1.7) has the driver enforce "dependencies between them"; otherwise zeCommandListAppendBarrier
("all previous commands ... must complete prior to the execution of the barrier", and it "blocks all
following commands from beginning"), event waits, and on an immediate list the host having seen the
work complete, are what order commands.

The simulator ran such lists strictly in order, so a missing barrier worked here and raced on a GPU.
accel uses lists without IN_ORDER on drivers older than API 1.7 (streams put a barrier before every
command; captures record into regular lists the same way), where a forgotten barrier would be a real
bug the simulator hid. Now (accel/sim/ze/commands.py, "lists without IN_ORDER") the simulator still
runs the commands in order but faults the device (ZE_RESULT_ERROR_DEVICE_LOST, the reason in
``sim.state().ze_errors``, as for its other device faults) when the order mattered:

* two commands of one such list that nothing orders touch overlapping bytes, one of them writing:
  the later one faults as it runs (copies and fills by their ranges, kernels by what their reference
  viewed and changed, so two kernels reading one buffer are fine);
* a zeCommandListAppendSignalEvent of a host-visible event with earlier work of the list not ordered
  before it: the signal may complete first and the host go on early (Intel's SYCL runtime waits on the
  last command's event, or signals from a barrier, before such a signal on these lists).

Why faults rather than running the commands in another order: a reordering makes a missing barrier
visible only where the results happen to differ, and a signal that may overtake its work cannot be
shown deterministically to a host thread; the fault names both commands and the rule.

Then accel's pre-1.7 paths (API 1.5: marker-event syncs; 1.6: zeCommandListHostSynchronize): copies,
fills, kernels, events across streams, graphs, stream close run with no fault, and the same programs
with accel's barrier removed (a mutant) fault, so the rule would catch a forgotten barrier in accel.
Fences: accel uses none (not in its symbol list), and the simulator refuses them; not simulated.
"""

import time

import numpy as np
import pytest

import accel
from accel import backends, sim
from accel._errors import AcceleratorError
from accel.backends.xpu import _library as xpu_library
from accel.backends.xpu.streams import StreamsMixin
from accel.sim import ze as sim_ze

from conftest import use_sim
from test_sim_ze_metal_strict import ffi, ze  # noqa: F401 (ze: the fixture)
from test_user_kernels import spirv_module

_UINT64_MAX = (1 << 64) - 1
N = 64


# -- helpers (the simulated loader, called as a Level Zero program would) ---------------------------

def regular(z, in_order=False):
    lib = z.lib
    desc = ffi.new("ze_command_list_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_COMMAND_LIST_DESC,
                                               "commandQueueGroupOrdinal": 1,
                                               "flags": lib.ZE_COMMAND_LIST_FLAG_IN_ORDER if in_order else 0})
    p = ffi.new("ze_command_list_handle_t *")
    assert lib.zeCommandListCreate(z.ctx, z.devices[0], desc, p) == 0
    return p[0]


def unordered_immediate(z):
    """An immediate list without ZE_COMMAND_QUEUE_FLAG_IN_ORDER (what accel makes before API 1.7)."""
    lib = z.lib
    desc = ffi.new("ze_command_queue_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC,
                                                "ordinal": 1, "mode": lib.ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS})
    p = ffi.new("ze_command_list_handle_t *")
    assert lib.zeCommandListCreateImmediate(z.ctx, z.devices[0], desc, p) == 0
    return p[0]


def host_alloc(z, n=N):
    desc = ffi.new("ze_host_mem_alloc_desc_t *", {"stype": z.lib.ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC})
    h = ffi.new("void **")
    assert z.lib.zeMemAllocHost(z.ctx, desc, n, 0, h) == 0
    return h[0]


def copy(z, cl, dst, src, n=N, signal=ffi.NULL, waits=()):
    arr = ffi.new("ze_event_handle_t[]", list(waits)) if waits else ffi.NULL
    return z.lib.zeCommandListAppendMemoryCopy(cl, dst, src, n, signal, len(waits), arr)


def barrier(z, cl, signal=ffi.NULL, waits=()):
    arr = ffi.new("ze_event_handle_t[]", list(waits)) if waits else ffi.NULL
    return z.lib.zeCommandListAppendBarrier(cl, signal, len(waits), arr)


def execute(z, cl):
    """Close ``cl``, execute it on a fresh queue and synchronize: the synchronize's result."""
    lib = z.lib
    assert lib.zeCommandListClose(cl) == 0
    q = z.queue()
    arr = ffi.new("ze_command_list_handle_t[]", [cl])
    assert lib.zeCommandQueueExecuteCommandLists(q, 1, arr, ffi.NULL) == 0
    return lib.zeCommandQueueSynchronize(q, _UINT64_MAX)


def device_bytes(z, ptr, n=N):
    """The bytes at ``ptr``, read through an in-order immediate list (API 1.7+)."""
    lib = z.lib
    h = host_alloc(z, n)
    cl = z.immediate()
    assert copy(z, cl, h, ptr, n) == 0
    assert lib.zeCommandListHostSynchronize(cl, _UINT64_MAX) == 0
    out = bytes(ffi.buffer(ffi.cast("char *", h), n))
    assert lib.zeMemFree(z.ctx, h) == 0
    assert lib.zeCommandListDestroy(cl) == 0
    return out


def errors():
    return sim.state().ze_errors


# -- two unordered commands touching one range: the later one faults --------------------------------

HAZARDS = {
    # name: (first command, second command), each f(z, cl, a, b) -> rc; a is filled with 7 first
    "read after write": (lambda z, cl, a, b: z.fill(cl, a, N, 9), lambda z, cl, a, b: copy(z, cl, b, a)),
    "write after write": (lambda z, cl, a, b: z.fill(cl, a, N, 9), lambda z, cl, a, b: z.fill(cl, a, N, 5)),
    "write after read": (lambda z, cl, a, b: copy(z, cl, b, a), lambda z, cl, a, b: z.fill(cl, a, N, 5)),
    "partial overlap": (lambda z, cl, a, b: z.fill(cl, a, N, 9),
                        lambda z, cl, a, b: copy(z, cl, b, ffi.cast("char *", a) + N - 8, 8)),
}


@pytest.mark.parametrize("hazard", sorted(HAZARDS))
def test_unordered_commands_of_a_regular_list_touching_one_range_fault(ze, hazard):
    """Without IN_ORDER and with no barrier between them, the two commands may overlap or complete in
    either order: the second faults as it runs, the queue's synchronize answers DEVICE_LOST, and the
    reason names both commands and the Programming Guide's rule. Before r69f both ran, in order."""
    z = ze()
    a, b = z.alloc(), z.alloc()
    cl = regular(z)
    first, second = HAZARDS[hazard]
    assert first(z, cl, a, b) == 0
    assert second(z, cl, a, b) == 0
    assert execute(z, cl) == z.lib.ZE_RESULT_ERROR_DEVICE_LOST
    (why,) = errors()
    assert "command 2 (" in why and "and command 1 (" in why and "one writing" in why
    assert "no implicit definition of the order of completion" in why and "zeCommandListAppendBarrier" in why


ORDERINGS = ("barrier", "signal event waited by the command", "zeCommandListAppendWaitOnEvents",
             "barrier with wait events", "disjoint ranges", "both only read", "IN_ORDER list")


@pytest.mark.parametrize("how", ORDERINGS)
def test_ordered_or_independent_commands_run(ze, how):
    """What orders two commands of a list without IN_ORDER (a barrier; the second waiting, itself or
    through a wait command or a barrier with wait events, for an event the first signals), or what
    makes their order irrelevant (disjoint bytes, reads only): the list runs, with the right bytes.
    An IN_ORDER list (API 1.7+) needs nothing."""
    z = ze()
    lib = z.lib
    a, b, c = z.alloc(), z.alloc(), z.alloc()
    ev = z.event(z.pool())
    cl = regular(z, in_order=how == "IN_ORDER list")
    if how == "both only read":
        init = z.immediate()
        assert z.fill(init, a, N, 9) == 0
        assert lib.zeCommandListHostSynchronize(init, _UINT64_MAX) == 0
        assert copy(z, cl, b, a) == 0
        assert copy(z, cl, c, a) == 0
    elif how == "disjoint ranges":
        assert z.fill(cl, a, N, 9) == 0
        assert z.fill(cl, b, N, 9) == 0
        assert z.fill(cl, c, N, 9) == 0
    else:
        signal = ev if how != "barrier" and how != "IN_ORDER list" else ffi.NULL
        assert z.fill(cl, a, N, 9, signal) == 0
        if how == "barrier":
            assert barrier(z, cl) == 0
        elif how == "zeCommandListAppendWaitOnEvents":
            assert lib.zeCommandListAppendWaitOnEvents(cl, 1, ffi.new("ze_event_handle_t[1]", [ev])) == 0
        elif how == "barrier with wait events":
            assert barrier(z, cl, waits=[ev]) == 0
        waits = [ev] if how == "signal event waited by the command" else []
        assert copy(z, cl, b, a, waits=waits) == 0
        assert copy(z, cl, c, a, waits=waits) == 0     # reads a too: no conflict with the copy to b
    assert execute(z, cl) == 0
    assert errors() == []
    assert device_bytes(z, b) == device_bytes(z, c) == bytes([9]) * N


def test_a_wait_orders_only_after_the_signalling_command(ze):
    """A wait for the event of one command does not order the command after other, earlier ones
    ("If numWaitEvents is non-zero, then only all phWaitEvents must be signaled"): the copy waits for
    the fill of ``b`` but races the fill of ``a``, which it reads."""
    z = ze()
    a, b, c = z.alloc(), z.alloc(), z.alloc()
    ev = z.event(z.pool())
    cl = regular(z)
    assert z.fill(cl, a, N, 9) == 0
    assert z.fill(cl, b, N, 9, ev) == 0
    assert copy(z, cl, c, a, waits=[ev]) == 0
    assert execute(z, cl) == z.lib.ZE_RESULT_ERROR_DEVICE_LOST
    (why,) = errors()
    assert "command 3 (copy 64) and command 1 (fill 64)" in why


def test_a_barrier_orders_a_reexecuted_list_again(ze):
    """The rules hold for each execution of a regular list, and zeCommandListReset starts afresh: the
    list re-recorded with a barrier runs twice without a fault."""
    z = ze()
    lib = z.lib
    a, b = z.alloc(), z.alloc()
    cl = regular(z)
    assert z.fill(cl, a, N, 9) == 0
    assert barrier(z, cl) == 0
    assert copy(z, cl, b, a) == 0
    assert execute(z, cl) == 0
    q = z.queue()
    arr = ffi.new("ze_command_list_handle_t[]", [cl])
    assert lib.zeCommandQueueExecuteCommandLists(q, 1, arr, ffi.NULL) == 0
    assert lib.zeCommandQueueSynchronize(q, _UINT64_MAX) == 0
    assert lib.zeCommandListReset(cl) == 0
    assert z.fill(cl, a, N, 3) == 0
    assert copy(z, cl, b, a) == 0                   # no barrier this time
    assert execute(z, cl) == lib.ZE_RESULT_ERROR_DEVICE_LOST


# -- immediate lists without IN_ORDER: the host's synchronization orders too ------------------------

@pytest.mark.parametrize("host_sync", [None, "zeCommandListHostSynchronize", "zeEventHostSynchronize",
                                       "zeEventQueryStatus"])
def test_unordered_immediate_list(ze, host_sync):
    """An immediate list without ZE_COMMAND_QUEUE_FLAG_IN_ORDER: a copy reading what the fill before
    it wrote faults, unless the host saw the fill complete before appending the copy (the list's host
    synchronize, or the fill's host-visible signal event synchronized or queried)."""
    z = ze()
    lib = z.lib
    a, b = z.alloc(), z.alloc()
    ev = z.event(z.pool())
    cl = unordered_immediate(z)
    assert z.fill(cl, a, N, 9, ev) == 0
    if host_sync == "zeCommandListHostSynchronize":
        assert lib.zeCommandListHostSynchronize(cl, _UINT64_MAX) == 0
    elif host_sync == "zeEventHostSynchronize":
        assert lib.zeEventHostSynchronize(ev, _UINT64_MAX) == 0
    elif host_sync == "zeEventQueryStatus":
        while (rc := lib.zeEventQueryStatus(ev)) == lib.ZE_RESULT_NOT_READY:   # (with ACCEL_SIM_DELAY_US)
            time.sleep(0.001)
        assert rc == 0
    assert copy(z, cl, b, a) == 0
    rc = lib.zeCommandListHostSynchronize(cl, _UINT64_MAX)
    if host_sync is None:
        assert rc == lib.ZE_RESULT_ERROR_DEVICE_LOST
        assert "command 2 (copy 64) and command 1 (fill 64)" in errors()[0]
    else:
        assert rc == 0 and errors() == []
        assert device_bytes(z, b) == bytes([9]) * N


def test_host_seeing_a_later_command_does_not_order_an_unordered_earlier_one(ze):
    """The host seeing the signal of the second fill says nothing of the first (nothing orders them):
    a copy appended afterwards reading the first fill's bytes still races it."""
    z = ze()
    lib = z.lib
    a, b, c = z.alloc(), z.alloc(), z.alloc()
    ev = z.event(z.pool())
    cl = unordered_immediate(z)
    assert z.fill(cl, a, N, 9) == 0
    assert z.fill(cl, b, N, 9, ev) == 0
    assert lib.zeEventHostSynchronize(ev, _UINT64_MAX) == 0
    assert copy(z, cl, c, a) == 0
    assert lib.zeCommandListHostSynchronize(cl, _UINT64_MAX) == lib.ZE_RESULT_ERROR_DEVICE_LOST
    assert "command 3 (copy 64) and command 1 (fill 64)" in errors()[0]


# -- a plain signal of a host-visible event after unordered work ---------------------------------

@pytest.mark.parametrize("how", ["signal", "barrier with wait events"])
def test_a_host_visible_signal_not_ordered_after_earlier_work_faults(ze, how):
    """zeCommandListAppendSignalEvent right after a fill, on a list without IN_ORDER: the signal may
    complete before the fill, and the host synchronizing on it go on while the fill still runs. The
    signal faults (it is never seen); zeEventHostSynchronize answers DEVICE_LOST. Before r69f the
    host saw the signal after the fill, always."""
    z = ze()
    lib = z.lib
    a = z.alloc()
    pool = z.pool(count=2)
    ev, other = z.event(pool), z.event(pool, 1)
    assert lib.zeEventHostSignal(other) == 0
    cl = regular(z)
    assert z.fill(cl, a, N, 9) == 0
    if how == "signal":
        assert lib.zeCommandListAppendSignalEvent(cl, ev) == 0
    else:
        assert barrier(z, cl, ev, waits=[other]) == 0
    assert lib.zeCommandListClose(cl) == 0
    q = z.queue()
    assert lib.zeCommandQueueExecuteCommandLists(q, 1, ffi.new("ze_command_list_handle_t[]", [cl]), ffi.NULL) == 0
    assert lib.zeEventHostSynchronize(ev, _UINT64_MAX) == lib.ZE_RESULT_ERROR_DEVICE_LOST
    (why,) = errors()
    assert "host-visible event" in why and "follows command 1 (fill 64)" in why
    assert "zeCommandListAppendBarrier(hCommandList, hEvent, 0, nullptr)" in why


@pytest.mark.parametrize("how", ["barrier signal", "barrier then signal", "the fill's own signal event",
                                 "pool not host-visible", "signal waits for the fill's event"])
def test_signals_that_cover_the_work_or_no_host_run(ze, how):
    """A barrier's signal (or a signal after a barrier) comes after all earlier commands; a command's
    own signal event is signalled "on completion" of that command; a signal of an event the host
    cannot see is not checked (only the commands of the list are analysed); a signal after a wait on
    the fill's event is ordered after it."""
    z = ze()
    lib = z.lib
    a = z.alloc()
    pool = z.pool(count=2, flags=0 if how == "pool not host-visible" else None)
    ev, fill_ev = z.event(pool), z.event(pool, 1)
    cl = regular(z)
    if how == "barrier signal":
        assert z.fill(cl, a, N, 9) == 0
        assert barrier(z, cl, ev) == 0
    elif how == "barrier then signal":
        assert z.fill(cl, a, N, 9) == 0
        assert barrier(z, cl) == 0
        assert lib.zeCommandListAppendSignalEvent(cl, ev) == 0
    elif how == "the fill's own signal event":
        assert z.fill(cl, a, N, 9, ev) == 0
    elif how == "signal waits for the fill's event":
        assert z.fill(cl, a, N, 9, fill_ev) == 0
        assert lib.zeCommandListAppendWaitOnEvents(cl, 1, ffi.new("ze_event_handle_t[1]", [fill_ev])) == 0
        assert lib.zeCommandListAppendSignalEvent(cl, ev) == 0
    else:
        assert z.fill(cl, a, N, 9) == 0
        assert lib.zeCommandListAppendSignalEvent(cl, ev) == 0
    assert execute(z, cl) == 0
    if how != "pool not host-visible":
        assert lib.zeEventHostSynchronize(ev, _UINT64_MAX) == 0
    assert errors() == []
    assert device_bytes(z, a) == bytes([9]) * N


def test_fences_are_not_simulated_and_accel_uses_none(ze):
    """Fences (zeFenceCreate/HostSynchronize/QueryStatus/Reset): not in accel's symbol lists, not in
    its generated declarations, and zeCommandQueueExecuteCommandLists refuses one (not simulated)."""
    z = ze()
    names = xpu_library.REQUIRED_SYMBOLS + xpu_library.OPTIONAL_SYMBOLS
    assert not [n for n in names if "Fence" in n]
    assert not hasattr(z.lib, "zeFenceCreate")
    cl = regular(z)
    assert z.lib.zeCommandListClose(cl) == 0
    fake = ffi.cast("ze_fence_handle_t", 0x1000)
    assert z.lib.zeCommandQueueExecuteCommandLists(z.queue(), 1, ffi.new("ze_command_list_handle_t[]", [cl]),
                                                    fake) == z.lib.ZE_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT


# -- accel's paths on drivers before API 1.7 -------------------------------------------------------

def _axpy(grid, block, view, a, x, y, n):
    xs = view(x, n * 4, np.float32)
    ys = view(y, n * 4, np.float32)
    ys[:] = np.float32(a) * xs + ys


def _scale(grid, block, view, x, out, n, a):
    view(out, n * 4, np.float32)[:] = np.float32(a) * view(x, n * 4, np.float32)


@pytest.fixture
def kernels_registered():
    sim.register_kernel("r69f_axpy", _axpy, "f32, ptr, ptr, u64")
    sim.register_kernel("r69f_scale", _scale, "ptr, ptr, u64, f32")
    yield
    sim.unregister_kernel("r69f_axpy")
    sim.unregister_kernel("r69f_scale")


def _old_driver(monkeypatch, api, mutant=False):
    """accel on a simulated pre-1.7 driver; ``mutant``: accel's barrier before each command removed
    (the bug the rules must catch)."""
    use_sim(monkeypatch, "xpu", ACCEL_SIM_ZE_API=api)
    if mutant:
        def append_without_barrier(self, s, call, fn, *args):
            self._check_live(s)
            rc = fn(*args)
            if rc:
                self._fail(call, rc)
        monkeypatch.setattr(StreamsMixin, "_append", append_without_barrier)
    be = backends.get("xpu")
    be.init()
    assert not be._devices[0].in_order
    return be


def _program(n=256):
    """A program over accel's public API: host->device copies, fills, kernels on two streams joined
    by events, a captured graph replayed twice, device->host copies. Returns its results."""
    rng = np.random.default_rng(69)
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    m = accel.Module(spirv_module("r69f_axpy", "r69f_scale"))
    axpy = m.function("r69f_axpy", "f32, ptr, ptr, u64")
    scale = m.function("r69f_scale", "ptr, ptr, u64, f32")
    s1, s2 = accel.Stream(), accel.Stream()
    bx, by, bz = accel.Buffer(x.nbytes, stream=s1), accel.Buffer(y.nbytes, stream=s1), accel.Buffer(4 * n, stream=s1)
    with s1:
        bx.copy_from(x, stream=s1)
        by.copy_from(y, stream=s1)
        accel.launch(axpy, 1, n, 2.0, bx, by, n)       # y = 2x + y
        accel.launch(axpy, 1, n, 1.0, bx, by, n)       # y += x
        done = accel.Event()
        done.record(s1)
    s2.wait_event(done)
    with s2:
        accel.launch(scale, 1, n, by, bz, n, 0.5)      # z = y / 2, on the other stream
    s2.synchronize()
    g = accel.Graph()
    with s1, g:
        accel.launch(axpy, 1, n, 1.0, bx, bz, n)       # z += x
        accel.launch(scale, 1, n, bz, bz, n, 2.0)      # z *= 2
    g.replay()
    g.replay()
    s1.synchronize()
    bw = accel.Buffer(4 * n, stream=s1).fill_(0, stream=s1)
    s1.synchronize()
    # timed events (signalled from barriers), a non-blocking upload, a copy to the other device
    e0, e1 = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    e0.record(s1)
    bv = accel.Buffer(4 * n, stream=s1)
    bv.copy_from(y, stream=s1, non_blocking=True)
    with s1:
        accel.launch(scale, 1, n, bv, bv, n, 3.0)
    e1.record(s1)
    e1.synchronize()
    assert e0.elapsed_time(e1) >= 0
    on1 = accel.Buffer(4 * n, device=1).copy_from(bv)
    results = (by.to_numpy("float32"), bz.to_numpy("float32"), bw.to_numpy("float32"), on1.to_numpy("float32"))
    s2.close()
    expected_y = (np.float32(2.0) * x + y) + x
    z = expected_y * np.float32(0.5)
    for _ in range(2):
        z = (z + x) * np.float32(2.0)
    return results, (expected_y, z, np.zeros(n, np.float32), np.float32(3.0) * y)


@pytest.mark.parametrize("api", ["1.5", "1.6"], ids=["marker-event-syncs", "host-synchronize"])
def test_accel_old_driver_paths_are_ordered(monkeypatch, kernels_registered, api):
    """accel's streams, events, kernels, copies, fills, graphs and stream close on a driver without
    in-order lists: right results, and no command raced another (no fault)."""
    be = _old_driver(monkeypatch, api)
    sim.reset_call_counts()
    results, expected = _program()
    for got, want in zip(results, expected):
        np.testing.assert_array_equal(got, want)
    assert errors() == []
    assert sim.calls("zeCommandListAppendBarrier") > 0
    assert all(s.list is not None and sim_ze._rt.get(s.list, "cmdlist").order is not None
               for s in be._streams.values())                            # the rules were live


@pytest.mark.parametrize("api, why", [("1.5", "the signal of host-visible event"),
                                      ("1.6", "nothing orders them on a command list without IN_ORDER")],
                         ids=["marker-event-syncs", "host-synchronize"])
def test_a_forgotten_barrier_in_accel_would_be_caught(monkeypatch, kernels_registered, api, why):
    """The same program with accel's barrier removed: the simulator faults (an AcceleratorError naming
    ZE_RESULT_ERROR_DEVICE_LOST) and says why: on API 1.5 the stream's first sync marker (a plain
    signal) follows the copy with nothing ordering it after it; on 1.6 (the list's host synchronize,
    no marker) the kernel writing ``y`` races the copy into it."""
    _old_driver(monkeypatch, api, mutant=True)
    with pytest.raises(AcceleratorError, match="DEVICE_LOST"):
        _program()
    assert why in errors()[0]


def test_two_kernels_reading_one_buffer_need_no_barrier(monkeypatch, kernels_registered):
    """A kernel's reads are the bytes its reference viewed and its writes the bytes it changed: two
    launches reading one buffer into separate outputs do not race, even with no barrier (the mutant);
    a third one writing the buffer the first two read does."""
    _old_driver(monkeypatch, "1.6", mutant=True)
    n = 128
    x = np.arange(n, dtype=np.float32)
    m = accel.Module(spirv_module("r69f_scale"))
    scale = m.function("r69f_scale", "ptr, ptr, u64, f32")
    s = accel.Stream()
    bx, b1, b2 = (accel.Buffer(4 * n, stream=s) for _ in range(3))
    bx.copy_from(x, stream=s)
    s.synchronize()
    with s:
        accel.launch(scale, 1, n, bx, b1, n, 2.0)
        accel.launch(scale, 1, n, bx, b2, n, 3.0)
    s.synchronize()
    assert errors() == []
    np.testing.assert_array_equal(b1.to_numpy("float32"), 2 * x)
    np.testing.assert_array_equal(b2.to_numpy("float32"), 3 * x)
    with s:
        accel.launch(scale, 1, n, b1, bx, n, 1.0)       # writes x
        accel.launch(scale, 1, n, bx, b2, n, 1.0)       # reads x: races the launch before
    with pytest.raises(AcceleratorError, match="DEVICE_LOST"):
        s.synchronize()
    assert "kernel r69f_scale" in errors()[0]
