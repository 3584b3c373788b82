"""The XPU backend on the simulated Level Zero loader (ACCEL_SIM=xpu): the code that
runs on an Intel GPU, over the simulator's result codes and semantics."""

import os
import threading

import numpy as np
import pytest

from accel import _lazy, backends, sim
from accel._errors import AcceleratorError, CaptureError, OutOfMemoryError
from accel._hostmem import address_of
from accel.sim import ze as sim_ze

from conftest import use_sim

C = sim.core.constants_of("_ze")
N = 4096


@pytest.fixture
def make(monkeypatch):
    """make(**env) -> an initialized simulated XPU backend (ze settings via ze_* keywords)."""
    monkeypatch.setenv("ZES_ENABLE_SYSMAN", "x")
    monkeypatch.delenv("ZES_ENABLE_SYSMAN")   # restored (unset) after the test, whatever init does

    def make(init=True, ze=None, core=None, **env):
        use_sim(monkeypatch, "xpu", **env)
        if core:
            sim.configure(**core)
        if ze:
            sim_ze.configure_ze(**ze)
        be = backends.get("xpu")
        if init:
            be.init()
        return be
    return make


def gate(be, stream):
    """Hold ``stream`` at a wait on an event only the test signals; returns the release function.

    Makes "work still pending" deterministic instead of depending on a delay.
    """
    ffi, lib, _ = be._lib
    dev = be._streams[stream].device
    desc = ffi.new("ze_event_pool_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_EVENT_POOL_DESC,
                                              "flags": lib.ZE_EVENT_POOL_FLAG_HOST_VISIBLE, "count": 1})
    pool = ffi.new("ze_event_pool_handle_t *")
    assert lib.zeEventPoolCreate(dev.ctx, desc, 0, ffi.NULL, pool) == 0
    edesc = ffi.new("ze_event_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_EVENT_DESC})
    ev = ffi.new("ze_event_handle_t[1]")
    assert lib.zeEventCreate(pool[0], edesc, ev) == 0
    assert lib.zeCommandListAppendWaitOnEvents(be._streams[stream].list, 1, ev) == 0
    return lambda: lib.zeEventHostSignal(ev[0])


def host(n=N, value=0):
    return np.full(n, value, np.uint8)


def read(be, ptr, stream, n=N):
    out = host(n)
    be.memcpy_async(address_of(out), ptr, n, stream)   # pageable destination: synchronous
    return out


# -- discovery and init ----------------------------------------------------------------------------

def test_count_uses_sysman_and_does_not_initialize(make):
    be = make(init=False, ACCEL_SIM_DEVICES=3)
    assert be.count() == 3
    info = be.report()
    assert info["count_path"] == "zesInit" and not info["initialized"]
    assert not sim_ze.state()["ze_runtime_initialized"] and sim_ze.state()["ze_sysman_initialized"]
    be.init()
    assert sim_ze.state()["ze_runtime_initialized"]
    info = be.report()
    assert info["stream_sync"] == "zeCommandListHostSynchronize" and info["api_version"] == "1.9"


def test_old_loader_counts_in_a_child_process(make, monkeypatch):
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0,2")
    be = make(init=False, ze={"loader": "1.8.12"}, ACCEL_SIM_DEVICES=3)
    assert be.count() == 2
    info = be.report()
    assert info["count_path"] == "child-zeInit"
    assert set(info["missing_optional_symbols"]) == {"zesInit", "zesDriverGet", "zesDeviceGet",
                                                     "zeCommandListHostSynchronize"}
    assert not sim_ze.state()["ze_runtime_initialized"]   # only the child called zeInit
    be.init()
    assert len(be._devices) == 2
    assert be.report()["stream_sync"] == "event after the last command"
    assert "ZES_ENABLE_SYSMAN" not in os.environ


def test_no_driver_counts_zero_and_init_names_the_error(make):
    be = make(init=False, core={"driver": False})
    assert be.count() == 0
    assert "ZE_RESULT_ERROR_UNINITIALIZED" in be.report()["reason"]
    with pytest.raises(AcceleratorError) as err:
        be.init()
    assert (err.value.call, err.value.code, err.value.code_name) == (
        "zeInit", 0x78000001, "ZE_RESULT_ERROR_UNINITIALIZED")


def test_no_driver_on_the_old_loader_too(make):
    be = make(init=False, ze={"loader": "1.8.12"}, ACCEL_SIM_DEVICES=0)
    assert be.count() == 0
    assert be.report()["count_path"] == "child-zeInit"
    assert "ZE_RESULT_ERROR_UNINITIALIZED" in be.report()["reason"]


def test_properties(make):
    be = make(ze={"fp64": False, "tiles": 2}, ACCEL_SIM_MEMORY="1G")
    assert be.count() == 4   # FLAT: two cards of two tiles
    p = be.properties(3)
    assert p.total_memory == 1 << 30 and p.compute_capability == (0, 0)
    assert "float64" not in p.supported_dtypes and "float16" in p.supported_dtypes
    assert p.extra["subdevice_id"] == 1 and p.multi_processor_count > 0
    with pytest.raises(ValueError, match="out of range"):
        be.properties(4)


def test_compute_queue_group_is_found_not_assumed(make):
    be = make()
    assert be._devices[0].ordinal == 1   # the simulator lists a copy-only group first


# -- memory ---------------------------------------------------------------------------------------------

def test_alloc_free_and_bad_input(make):
    be = make(ACCEL_SIM_MEMORY="1M")
    p = be.mem_alloc(1000)
    assert p % 256 == 0
    assert be.mem_alloc(0) == 0
    be.mem_free(0)
    be.mem_free(p)
    with pytest.raises(ValueError, match="not a live XPU device allocation"):
        be.mem_free(p)
    with pytest.raises(ValueError, match="negative"):
        be.mem_alloc(-1)
    with pytest.raises(TypeError):
        be.mem_alloc(1.5)
    with pytest.raises(AcceleratorError, match="maxMemAllocSize") as err:
        be.mem_alloc(2 << 20)
    assert err.value.code_name == "ZE_RESULT_ERROR_UNSUPPORTED_SIZE"


def test_out_of_memory(make):
    be = make(ACCEL_SIM_MEMORY="1M")
    a = be.mem_alloc(600 << 10)
    with pytest.raises(OutOfMemoryError) as err:
        be.mem_alloc(600 << 10)
    assert err.value.code_name == "ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY" and err.value.call == "zeMemAllocDevice"
    be.mem_free(a)
    sim.inject_oom()
    with pytest.raises(OutOfMemoryError):
        be.mem_alloc(16)
    sim.inject_oom()
    with pytest.raises(OutOfMemoryError) as err:
        be.host_alloc(16)
    assert err.value.code_name == "ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY"
    be.mem_free(be.mem_alloc(16))


def test_mem_info_from_sysman_per_tile(make):
    be = make(ze={"tiles": 2}, ACCEL_SIM_MEMORY="64M", ACCEL_SIM_DEVICES=1)
    assert be.mem_info() == (64 << 20, 64 << 20)
    p = be.mem_alloc(8 << 20)
    assert be.mem_info() == (56 << 20, 64 << 20)
    be.set_device(1)
    assert be.mem_info() == (64 << 20, 64 << 20)   # the other tile's memory is untouched
    be.set_device(0)
    assert be.report()["mem_info_path"] == "sysman"
    be.mem_free(p)


@pytest.mark.parametrize("sysman_env, path", [(True, "sysman"), (False, "device-properties")])
def test_mem_info_on_the_old_loader(make, sysman_env, path):
    be = make(ze={"loader": "1.8.12", "sysman_env": sysman_env}, ACCEL_SIM_MEMORY="64M")
    p = be.mem_alloc(1 << 20)
    assert be.mem_info() == (63 << 20, 64 << 20)
    assert be.report()["mem_info_path"].startswith(path)
    be.mem_free(p)


# -- copies ---------------------------------------------------------------------------------------------

def test_copies_fills_and_pinned_memory(make):
    be = make()
    s = be.default_stream(0)
    a, b = be.mem_alloc(N), be.mem_alloc(N)
    src = np.arange(N, dtype=np.uint32).astype(np.uint8)
    be.memcpy_async(a, address_of(src), N, s)         # pageable source: staged
    src[:] = 0                                        # ...so the caller may reuse it at once
    be.memcpy_async(b, a, N, s)
    assert (read(be, b, s) == np.arange(N, dtype=np.uint32).astype(np.uint8)).all()
    be.memset_async(b + 100, 0xAB, 50, s)
    out = read(be, b, s)
    assert (out[100:150] == 0xAB).all() and out[99] == 99 and out[150] == 150
    pinned = be.host_alloc(N)
    be.memcpy_async(pinned, b, N, s)
    be.stream_synchronize(s)
    view = np.frombuffer(sim.core.ffi.buffer(sim.core.ffi.cast("char *", pinned), N), np.uint8)
    assert view[120] == 0xAB
    x, y = host(16, 7), host(16)
    # Host to host is refused: a freed device pointer would look the same (and crash the memmove).
    with pytest.raises(ValueError, match="neither pointer is inside a live USM allocation"):
        be.memcpy_async(address_of(y), address_of(x), 16, s)
    be.host_free(pinned)
    with pytest.raises(ValueError):
        be.memset_async(a, 256, 1, s)
    with pytest.raises(ValueError, match="not a live XPU stream"):
        be.memcpy_async(a, b, 1, 12345)


def test_staging_memory_is_released(make):
    be = make()
    s = be.stream_create()
    a = be.mem_alloc(N)
    release = gate(be, s)
    for _ in range(5):
        be.memcpy_async(a, address_of(host()), N, s)
    assert len(be._deferred) == 5   # still queued behind the gate
    release()
    be.stream_synchronize(s)
    assert not be._deferred


# -- streams and events ---------------------------------------------------------------------------------------

def test_stream_wait_event_orders_under_delay(make):
    be = make(ACCEL_SIM_DELAY_US=1000)
    s1, s2 = be.stream_create(), be.stream_create()
    a, b = be.mem_alloc(N), be.mem_alloc(N)
    be.memset_async(a, 0, N, s1)
    be.stream_synchronize(s1)
    e = be.event_create()
    release = gate(be, s1)
    be.memset_async(a, 5, N, s1)
    be.event_record(e, s1)
    assert not be.stream_query(s1) and not be.event_query(e)
    be.stream_wait_event(s2, e)
    be.memcpy_async(b, a, N, s2)
    assert not be.stream_query(s2)
    release()
    assert (read(be, b, s2) == 5).all()
    assert be.event_query(e) and be.stream_query(s1)


def test_rerecorded_event_never_satisfies_a_later_wait_early(make):
    """Each wait sees the record that preceded it, though the event is re-recorded in a loop."""
    be = make(ACCEL_SIM_DELAY_US=500)
    s1, s2 = be.stream_create(), be.stream_create()
    a = be.mem_alloc(N)
    outs = [be.mem_alloc(N) for _ in range(6)]
    e = be.event_create()
    for i, out in enumerate(outs, 1):
        be.memset_async(a, i, N, s1)
        be.event_record(e, s1)
        be.stream_wait_event(s2, e)
        be.memcpy_async(out, a, N, s2)
        # s1 must not overwrite ``a`` before s2 copied it: order s1 after s2's copy
        f = be.event_create()
        be.event_record(f, s2)
        be.stream_wait_event(s1, f)
        be.event_destroy(f)
    for i, out in enumerate(outs, 1):
        assert (read(be, out, s2) == i).all()
    be.device_synchronize()
    assert len(be._retired) == 0   # every slot recycled once the streams passed it


@pytest.mark.parametrize("loader", ["new", "1.8.12"])
def test_event_pools_stay_bounded_without_syncs(make, loader):
    be = make(ze={"loader": loader})
    s = be.stream_create()
    e = be.event_create()
    for _ in range(1000):
        be.event_record(e, s)
    assert sim_ze.state()["ze_live_event_pools"] <= 2   # finished slots are recycled, not leaked


def test_unrecorded_events_and_bad_handles(make):
    be = make()
    e = be.event_create()
    s = be.default_stream(0)
    assert be.event_query(e)
    be.event_synchronize(e)
    be.stream_wait_event(s, e)   # nothing to wait for
    be.event_destroy(e)
    with pytest.raises(ValueError, match="not a live XPU event"):
        be.event_query(e)
    with pytest.raises(ValueError, match="cannot be destroyed"):
        be.stream_destroy(s)


def test_elapsed_time(make):
    be = make(ACCEL_SIM_DELAY_US=2000)
    s = be.stream_create()
    a = be.mem_alloc(N)
    e0, e1, e2 = (be.event_create(enable_timing=True) for _ in range(3))
    be.event_record(e0, s)
    be.memset_async(a, 1, N, s)
    be.event_record(e1, s)
    be.memset_async(a, 2, N, s)
    be.memset_async(a, 3, N, s)
    be.event_record(e2, s)
    be.event_synchronize(e2)
    t1, t2 = be.event_elapsed_ms(e0, e1), be.event_elapsed_ms(e0, e2)
    assert 0 < t1 < t2
    assert be.event_elapsed_ms(e2, e0) == pytest.approx(-t2)
    plain = be.event_create()
    be.event_record(plain, s)
    with pytest.raises(AcceleratorError, match="enable_timing"):
        be.event_elapsed_ms(e0, plain)
    with pytest.raises(AcceleratorError, match="recorded"):
        be.event_elapsed_ms(e0, be.event_create(enable_timing=True))


def test_elapsed_time_across_timestamp_wrap(make):
    # 32-bit kernel timestamps that start 2 ms before wrapping around
    be = make(ze={"timestamp_start": (1 << 32) - 38_400}, ACCEL_SIM_DELAY_US=2000)
    s = be.stream_create()
    a = be.mem_alloc(N)
    e0, e1 = be.event_create(True), be.event_create(True)
    be.event_record(e0, s)
    for v in range(3):
        be.memset_async(a, v, N, s)
    be.event_record(e1, s)
    be.event_synchronize(e1)
    assert 6 <= be.event_elapsed_ms(e0, e1) < 100_000   # a wrap mistake gives about ±223,000 ms


@pytest.mark.parametrize("api, ns", [("1.1", 52.0), ("1.9", 1e9 / 19_200_000)])
def test_timer_resolution_follows_the_properties_version(make, api, ns):
    be = make(ze={"api_version": api})
    assert be._devices[0].ns_per_tick == pytest.approx(ns)


def test_pre_1_7_driver_orders_with_barriers(make):
    be = make(ze={"api_version": "1.4"}, ACCEL_SIM_DELAY_US=300)
    assert not be._devices[0].in_order
    s = be.stream_create()
    a = be.mem_alloc(N)
    sim.reset_call_counts()
    be.memset_async(a, 1, N, s)
    be.memset_async(a, 2, N, s)
    assert sim.calls("zeCommandListAppendBarrier") == 2
    assert (read(be, a, s) == 2).all()


@pytest.mark.parametrize("api", ["1.4", "1.5"])
def test_new_loader_on_an_old_driver_counts_and_syncs_without_1_6_calls(make, api):
    # The loader has zesInit and zeCommandListHostSynchronize, but the driver decides: zesInit
    # needs API 1.5 and zeCommandListHostSynchronize 1.6 (accel/sim/README.md, Level Zero).
    be = make(init=False, ze={"api_version": api}, ACCEL_SIM_MEMORY="64M")
    assert be.count() == 2
    assert be.report()["count_path"] == ("zesInit" if api == "1.5" else "child-zeInit")
    be.init()
    assert be.report()["stream_sync"] == "event after the last command"
    for dev in (0, 1):
        s = be.stream_create() if dev == 0 else be.default_stream(1)
        a = be.mem_alloc(N) if dev == 0 else None
        if dev == 1:
            be.set_device(1)
            a = be.mem_alloc(N)
            be.set_device(0)   # device 1's stream and memory while device 0 is current
        be.memset_async(a, 3, N, s)
        be.stream_synchronize(s)
        assert be.stream_query(s)
        assert (read(be, a, s) == 3).all()
    be.set_device(1)
    assert be.mem_info()[1] == 64 << 20   # Sysman (zesInit or the legacy ZES_ENABLE_SYSMAN path)
    assert "ZES_ENABLE_SYSMAN" not in os.environ


def test_old_loader_stream_sync_and_query(make):
    be = make(ze={"loader": "1.8.12"})
    s = be.stream_create()
    a = be.mem_alloc(N)
    release = gate(be, s)
    be.memset_async(a, 4, N, s)
    sim.reset_call_counts()
    assert be.stream_query(s) is False
    assert be.stream_query(s) is False   # the same marker, no new command
    assert sim.calls("zeCommandListAppendSignalEvent") == 1
    release()
    be.stream_synchronize(s)
    assert be.stream_query(s) is True
    assert (read(be, a, s) == 4).all()


def test_stream_priorities_and_destroy(make):
    be = make()
    assert be.stream_priority_range() == (1, -1)
    handles = [be.stream_create(p) for p in (-1, 0, 1)]
    for h in handles:
        be.stream_destroy(h)
    with pytest.raises(ValueError):
        be.stream_synchronize(handles[0])


def test_device_fault_is_reported(make):
    be = make()
    s = be.default_stream(0)
    sim.inject_error("zeCommandListAppendMemoryFill", C.ZE_RESULT_ERROR_DEVICE_LOST)
    with pytest.raises(AcceleratorError) as err:
        be.memset_async(be.mem_alloc(16), 0, 16, s)
    assert err.value.code_name == "ZE_RESULT_ERROR_DEVICE_LOST" and "0x70000001" in str(err.value)


def test_threads_share_streams(make):
    be = make()
    s = be.stream_create()
    bufs = [be.mem_alloc(N) for _ in range(8)]
    errors = []

    def work(i):
        try:
            be.set_device(i % 2)
            for _ in range(20):
                be.memset_async(bufs[i], i, N, s)
        except Exception as exc:   # pragma: no cover - reported below
            errors.append(exc)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert all((read(be, bufs[i], s) == i).all() for i in range(8))
    assert be.get_device() == 0   # the current device is per thread


# -- graphs ---------------------------------------------------------------------------------------------

def _capture(be, stream, ops):
    be.capture_begin(stream, "global")
    ops()
    return be.capture_end(stream)


def test_graph_replays_in_stream_order(make):
    be = make(ACCEL_SIM_DELAY_US=1000)
    s, side = be.stream_create(), be.stream_create()
    a, b, c = be.mem_alloc(N), be.mem_alloc(N), be.mem_alloc(N)
    g = _capture(be, side, lambda: (be.memcpy_async(b, a, N, side), be.memset_async(a, 0, N, side)))
    x = be.graph_instantiate(g)
    be.graph_destroy(g)   # the exec keeps what it needs
    for i in range(1, 4):
        be.memset_async(a, i, N, s)         # earlier work on the stream: the replay must see it
        be.graph_launch(x, s)
        be.memcpy_async(c, b, N, s)         # later work: must see the replay's result
        assert (read(be, c, s) == i).all()
        assert (read(be, a, s) == 0).all()
    be.graph_exec_destroy(x)


def test_back_to_back_replays_on_alternating_streams(make):
    be = make(ACCEL_SIM_DELAY_US=300)
    s1, s2, side = be.stream_create(), be.stream_create(), be.stream_create()
    counter, one = be.mem_alloc(N), be.mem_alloc(N)
    be.memset_async(counter, 0, N, s1)
    # the graph shifts ``counter`` through ``one``: counter = one; one = counter + ... (a copy chain)
    g = _capture(be, side, lambda: be.memcpy_async(one, counter, N, side))
    x = be.graph_instantiate(g)
    for i in range(6):
        s = (s1, s2)[i % 2]
        be.memset_async(counter, i, N, s)
        be.graph_launch(x, s)
    be.device_synchronize()
    assert (read(be, one, s1) == 5).all()
    be.graph_exec_destroy(x)
    be.graph_destroy(g)


def test_capture_rules(make):
    be = make()
    s, other = be.stream_create(), be.stream_create()
    a = be.mem_alloc(N)
    # syncing the capturing stream invalidates the capture
    be.capture_begin(s, "relaxed")
    assert be.stream_is_capturing(s) and not be.stream_is_capturing(other)
    with pytest.raises(CaptureError):
        be.stream_synchronize(s)
    with pytest.raises(CaptureError, match="invalidated"):
        be.capture_end(s)
    # events cannot be recorded into an XPU capture
    be.capture_begin(s, "global")
    with pytest.raises(CaptureError, match="cross-stream"):
        be.event_record(be.event_create(), s)
    with pytest.raises(CaptureError):
        be.capture_end(s)
    # pageable copies cannot be captured
    be.capture_begin(s, "global")
    with pytest.raises(CaptureError, match="pageable"):
        be.memcpy_async(a, address_of(host()), N, s)
    with pytest.raises(CaptureError):
        be.capture_end(s)
    with pytest.raises(CaptureError, match="not capturing"):
        be.capture_end(s)
    with pytest.raises(ValueError, match="capture mode"):
        be.capture_begin(s, "default")


@pytest.mark.parametrize("mode, allowed", [("global", False), ("thread_local", True), ("relaxed", True)])
def test_capture_modes_for_frees(make, mode, allowed):
    """Frees wait for the device: CUDA's "potentially unsafe" rules apply to them."""
    be = make()
    s, other = be.stream_create(), be.stream_create()
    pinned = [be.host_alloc(64) for _ in range(3)]
    be.capture_begin(s, mode)
    result = []

    def free_in_other_thread():
        try:
            be.host_free(pinned[0])
            result.append("ok")
        except CaptureError:
            result.append("refused")
    t = threading.Thread(target=free_in_other_thread)
    t.start()
    t.join(30)
    assert result == ["ok" if allowed else "refused"]
    # Syncing another stream or querying an event is CUDA's "potentially unsafe" too: allowed in
    # the capturing thread only when its capture is relaxed (the backend allowed both before, r14).
    if mode == "relaxed":
        be.stream_synchronize(other)
        assert be.event_query(be.event_create())
    else:
        with pytest.raises(CaptureError, match="stream_synchronize"):
            be.stream_synchronize(other)
        with pytest.raises(CaptureError, match="event_query"):
            be.event_query(be.event_create())
    if mode == "relaxed":
        be.graph_destroy(be.capture_end(s))
    else:
        with pytest.raises(CaptureError, match="invalidated"):
            be.capture_end(s)
    # in the capturing thread itself, frees are refused unless the capture is relaxed
    be.capture_begin(s, mode)
    if mode == "relaxed":
        be.host_free(pinned[1])
        be.graph_destroy(be.capture_end(s))
    else:
        with pytest.raises(CaptureError):
            be.host_free(pinned[1])
        with pytest.raises(CaptureError):
            be.capture_end(s)
    # synchronizing the device that captures is always refused
    be.capture_begin(s, "relaxed")
    with pytest.raises(CaptureError):
        be.device_synchronize()
    with pytest.raises(CaptureError):
        be.capture_end(s)


def test_graph_debug_dot(make, tmp_path):
    be = make()
    s = be.stream_create()
    a = be.mem_alloc(N)
    g = _capture(be, s, lambda: be.memset_async(a, 3, N, s))
    be.graph_debug_dot(g, str(tmp_path / "g.dot"))
    text = (tmp_path / "g.dot").read_text()
    assert text.startswith("digraph") and "fill 4096 B with 0x03" in text
    be.graph_destroy(g)


def test_graphs_on_a_pre_1_7_driver_and_the_old_loader(make):
    be = make(ze={"api_version": "1.4", "loader": "1.8.12"}, ACCEL_SIM_DELAY_US=300)
    s, side = be.stream_create(), be.stream_create()
    a, b = be.mem_alloc(N), be.mem_alloc(N)
    g = _capture(be, side, lambda: be.memcpy_async(b, a, N, side))
    x = be.graph_instantiate(g)
    for i in (7, 8):
        be.memset_async(a, i, N, s)
        be.graph_launch(x, s)
        assert (read(be, b, s) == i).all()


# -- lifetime -------------------------------------------------------------------------------------------

def test_close_leaves_nothing_behind(make):
    be = make(ACCEL_SIM_DELAY_US=100)
    s = be.stream_create()
    a = be.mem_alloc(N)
    e = be.event_create(True)
    be.event_record(e, s)
    be.memcpy_async(a, address_of(host()), N, s)
    g = _capture(be, s, lambda: be.memset_async(a, 1, N, s))
    x = be.graph_instantiate(g)
    be.graph_launch(x, be.default_stream(1 if False else 0))
    be.host_alloc(100)
    be.close()
    st = sim_ze.state()
    assert st["ze_live_allocations"] == 0 and st["ze_live_events"] == 0 and st["ze_live_event_pools"] == 0
    assert st["ze_live_command_lists"] == 0 and st["ze_live_command_queues"] == 0
    assert st["ze_errors"] == []


def test_fork_after_count_child_initializes(make):
    be = make(init=False)
    assert be.count() == 2
    pid = os.fork()
    if pid == 0:   # pragma: no cover - child
        code = 1
        try:
            child = backends.get("xpu")
            child.init()
            s = child.default_stream(0)
            p = child.mem_alloc(64)
            child.memset_async(p, 1, 64, s)
            child.stream_synchronize(s)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not sim_ze.state()["ze_runtime_initialized"]
    _lazy._reset_for_tests()


def test_fork_after_a_sysman_count_child_calls_zesinit_again(make):
    # zes_api.h, zesInit: "Each forked process must call this function" -- the parent's Sysman
    # handles are not valid in the child, so the child's mem_info must come from its own zesInit.
    be = make(init=False, ACCEL_SIM_MEMORY="64M")
    assert be.count() == 2 and be.report()["count_path"] == "zesInit"
    pid = os.fork()
    if pid == 0:   # pragma: no cover - child
        code = 1
        try:
            child = backends.get("xpu")
            child.init()
            child.set_device(1)
            p = child.mem_alloc(1 << 20)
            free, total = child.mem_info()
            path = child.report()["mem_info_path"]
            code = 0 if (free, total, path) == (63 << 20, 64 << 20, "sysman") else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_capture_id_and_captures_underway(make):
    be = make()
    s, other = be.stream_create(), be.stream_create()
    assert be.capture_id(s) is None and be.captures_underway() == 0
    be.capture_begin(s, "global")
    try:
        assert be.capture_id(s) is not None and be.captures_underway() == 1
        assert be.capture_id(other) is None   # a Level Zero capture records its own list only
    finally:
        be.capture_end(s)
    assert be.capture_id(s) is None and be.captures_underway() == 0
