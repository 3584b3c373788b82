"""torch.cuda's management-library queries on accel (issue 16, last bullet).

``utilization``, ``memory_usage``, ``temperature``, ``power_draw``, ``clock_rate``,
``device_memory_used``, ``list_gpu_processes`` and ``can_device_access_peer``, with the
semantics, units and output of torch 2.13 (``torch/cuda/__init__.py``, ``torch/cuda/memory.py``).
Test names follow PyTorch's test/test_cuda.py and test/test_cuda_multigpu.py where a test of the
same function exists there (``test_cuda::test_device_memory_used`` ...); the rest say what they check.

On the simulator the readings are the documented model of ``accel/sim/nvml.py`` (CUDA) and
``accel/sim/ze/sysman.py`` (Level Zero Sysman): an idle device reads its idle values.
"""

import os
import re

import pytest

import accel
from accel import _lazy
from accel.sim import core as sim_core

from conftest import use_sim

QUERIES = ("utilization", "memory_usage", "temperature", "power_draw", "clock_rate", "device_memory_used")


def _sim_state():
    import accel.sim
    return accel.sim.state()


# -- CUDA (NVML) -----------------------------------------------------------------------------------

def test_cuda_queries_are_exported_as_torch_cuda_names(sim_cuda):
    for name in QUERIES + ("list_gpu_processes", "can_device_access_peer"):
        assert callable(getattr(accel, name)), name
        assert name in accel.__all__


def test_cuda_idle_readings_and_units(sim_cuda):
    # the simulated NVML's idle model (accel/sim/nvml.py): 0 % busy, 35 C, 70 W, SM clock 345 MHz
    for i in range(accel.device_count()):
        assert accel.utilization(i) == 0
        assert accel.memory_usage(i) == 0
        assert accel.temperature(i) == 35
        assert accel.power_draw(i) == 70_000          # mW, as nvmlDeviceGetPowerUsage
        assert accel.clock_rate(i) == 345             # MHz, NVML_CLOCK_SM
        for name in QUERIES:
            assert type(getattr(accel, name)(i)) is int, name


def test_cuda_queries_never_initialize_the_runtime(sim_cuda):
    # torch reads these through pynvml only (no cuInit): with an explicit index, and before init
    # the current device is device 0, so None needs no runtime either
    for name in QUERIES:
        getattr(accel, name)(1)
        getattr(accel, name)()
        getattr(accel, name)("cuda:1")
    accel.list_gpu_processes(1)
    assert not accel.is_initialized()
    assert not _sim_state().runtime_initialized
    assert not _lazy.backend().driver_started


def _hold_stream(stream):
    """Queue an operation on ``stream`` that runs until the returned gate is set (simulator only;
    ACCEL_SIM_DELAY_US makes every operation go through the stream's worker thread)."""
    import threading
    from accel.sim import cudart
    gate = threading.Event()
    cudart._R.streams[stream.handle].q.submit(lambda: gate.wait(30))
    return gate


def test_cuda_busy_device_reads_busy_values_only_on_that_device(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=1)
    s = accel.Stream(device=1)
    gate = _hold_stream(s)
    try:
        assert not s.query()                        # work is running on device 1
        assert accel.utilization(1) == 100
        assert accel.memory_usage(1) == 100
        assert accel.temperature(1) == 65
        assert accel.power_draw(1) == 350_000
        assert accel.clock_rate(1) == 1980           # the cudaDevAttrClockRate the device reports (kHz / 1000)
        assert accel.utilization(0) == 0             # the other device is idle
        assert accel.clock_rate(0) == 345
    finally:
        gate.set()
        s.synchronize()
    assert accel.utilization(1) == 0


def test_cuda_queries_follow_cuda_visible_devices(monkeypatch):
    # accel device 0 is physical device 1: NVML is asked about physical 1 (torch's
    # _get_nvml_device_index), whose memory the allocation below uses
    use_sim(monkeypatch, "cuda", CUDA_VISIBLE_DEVICES="1")
    assert accel.device_count() == 1
    before = accel.device_memory_used(0)
    b = accel.Buffer(64 << 20, device=0)
    try:
        assert accel.device_memory_used(0) >= before + (64 << 20)
        text = accel.list_gpu_processes(0)
        assert text.splitlines()[0] == "GPU:1"          # torch prints the NVML index
    finally:
        del b
    with pytest.raises(ValueError, match="device index 1 is out of range"):
        accel.utilization(1)


def test_cuda_device_memory_used(sim_cuda):
    # test_cuda::test_device_memory_used: NVML's used memory grows with an allocation
    before = accel.device_memory_used(1)
    b = accel.Buffer(256 << 20, device=1)
    try:
        after = accel.device_memory_used(1)
        assert after - before >= 256 << 20
        assert accel.device_memory_used(0) < after        # device 0 holds only its context
    finally:
        del b


def test_cuda_list_gpu_processes_format(sim_cuda):
    # before the runtime starts this process has no context: torch's "no processes" text
    assert accel.list_gpu_processes(0) == "GPU:0\nno processes are running"
    b = accel.Buffer(32 << 20, device=1)
    try:
        lines = accel.list_gpu_processes(1).splitlines()
        assert lines[0] == "GPU:1"
        m = re.fullmatch(r"process (.{10}) uses (.{12}) MB GPU memory", lines[1])
        assert m, lines
        assert int(m.group(1)) == os.getpid()
        assert float(m.group(2)) * (1 << 20) >= 32 << 20
        assert len(lines) == 2
    finally:
        del b


def test_cuda_not_supported_is_a_clear_error(sim_cuda):
    # NVML_ERROR_NOT_SUPPORTED (some products have no power sensor): the error names the call
    sim_core.inject_error("nvmlDeviceGetPowerUsage", 3)
    with pytest.raises(accel.AcceleratorError, match=r"nvmlDeviceGetPowerUsage.*NVML_ERROR_NOT_SUPPORTED|"
                                                     r"nvmlDeviceGetPowerUsage.*Not Supported"):
        accel.power_draw(0)
    assert accel.power_draw(0) == 70_000                # one failure only


def test_cuda_without_nvml_says_so(monkeypatch):
    from accel import sim
    use_sim(monkeypatch, "cuda")
    sim.configure(nvml=False)
    assert accel.device_count() == 2                  # counted by the runtime instead
    with pytest.raises(accel.AcceleratorError, match="NVML"):
        accel.utilization(0)
    # torch returns a message instead of raising when pynvml is missing
    assert "NVML" in accel.list_gpu_processes(0)


def test_cuda_bad_device_arguments(sim_cuda):
    with pytest.raises(ValueError, match="out of range"):
        accel.temperature(2)
    with pytest.raises(ValueError, match="out of range"):
        accel.temperature(-1)
    with pytest.raises(TypeError):
        accel.temperature(1.5)


# -- can_device_access_peer and peer copies ---------------------------------------------------------

def test_cuda_multigpu_can_device_access_peer(sim_cuda):
    # test_cuda_multigpu::test_can_device_access_peer-style: distinct devices can, a device with itself not
    assert accel.can_device_access_peer(0, 1) is True
    assert accel.can_device_access_peer(1, 0) is True
    assert accel.can_device_access_peer(0, 0) is False
    assert accel.can_device_access_peer("cuda:1", "cuda:0") is True
    assert accel.can_device_access_peer(None, 1) is True       # None: the current device (0)


def test_can_device_access_peer_bad_ids(sim_backend):
    n = accel.device_count()
    with pytest.raises(AssertionError, match="Invalid device id"):
        accel.can_device_access_peer(n, 0)
    with pytest.raises(AssertionError, match="Invalid peer device id"):
        accel.can_device_access_peer(0, n)
    with pytest.raises(ValueError, match="Expected a torch.device with a specified index"):
        accel.can_device_access_peer(0, None)


def test_peer_copy_between_devices_agrees_with_can_device_access_peer(sim_backend):
    np = pytest.importorskip("numpy")
    if accel.device_count() < 2:
        assert accel.can_device_access_peer(0, 0) is False     # Metal: one device, no peer
        return
    assert accel.can_device_access_peer(0, 1)
    data = np.arange(1024, dtype=np.uint8)
    a = accel.Buffer(1024, device=0)
    b = accel.Buffer(1024, device=1)
    a.copy_from(data)
    b.copy_from(a)
    assert (b.to_numpy() == data).all()
    a.copy_from(np.zeros(1024, np.uint8))
    a.copy_from(b)
    assert (a.to_numpy() == data).all()


def test_mps_has_one_device_and_no_peer(monkeypatch):
    use_sim(monkeypatch, "mps")
    assert accel.device_count() == 1
    assert accel.can_device_access_peer(0, 0) is False


# -- every simulated backend ------------------------------------------------------------------------

def test_queries_on_every_backend_both_devices(sim_backend):
    if sim_backend == "mps":
        with pytest.raises(accel.AcceleratorError, match="mps has no management library"):
            accel.utilization(0)
        assert "mps" in accel.list_gpu_processes(0)
        return
    for i in range(accel.device_count()):
        for name in ("temperature", "clock_rate", "device_memory_used"):
            value = getattr(accel, name)(i)
            assert type(value) is int and value >= 0, (name, value)
        assert accel.temperature(i) > 0 and accel.clock_rate(i) > 0
        assert accel.device_memory_used(i) == 0        # no runtime started: no context holds memory
        assert accel.list_gpu_processes(i).startswith(f"GPU:{i}\n")
    assert not accel.is_initialized()


# -- Level Zero (Sysman) --------------------------------------------------------------------------------

def test_xpu_sysman_readings_without_core_init(monkeypatch):
    # the simulated Sysman's model (accel/sim/ze/sysman.py): idle GPU sensor 35 C, GPU frequency 300 MHz
    use_sim(monkeypatch, "xpu")
    for i in range(2):
        assert accel.temperature(i) == 35
        assert accel.clock_rate(i) == 300
        assert accel.list_gpu_processes(i) == f"GPU:{i}\nno processes are running"
    assert not accel.is_initialized()
    b = accel.Buffer(16 << 20, device=1)
    try:
        assert accel.device_memory_used(1) >= 16 << 20
        lines = accel.list_gpu_processes(1).splitlines()
        assert lines[1].startswith(f"process {os.getpid():>10d} uses ")
        assert accel.device_memory_used(0) < accel.device_memory_used(1)
    finally:
        del b


# Sysman counters sampled twice (accel/backends/xpu/telemetry.py) over the simulator's counter
# model (accel/sim/_ze_counters.py): idle 0 %, 60 W per card, shared by its tiles.

def _xpu_counters(index: int) -> dict:
    """The raw Sysman counters of visible XPU device ``index`` (white box: the backend's handles)."""
    be = _lazy.backend()
    ffi, lib, handle, tile, _ = be._smi_target(index)
    out = {}
    for e in be._engines(ffi, lib, handle, tile, index):
        st = ffi.new("zes_engine_stats_t *")
        assert lib.zesEngineGetActivity(e, st) == 0
        out.setdefault("active", []).append((st.activeTime, st.timestamp))
    for m in be._enum(ffi, lib, "zesDeviceEnumMemoryModules", "zes_mem_handle_t",
                      lambda n, a: lib.zesDeviceEnumMemoryModules(handle, n, a)):
        bw = ffi.new("zes_mem_bandwidth_t *")
        if lib.zesMemoryGetBandwidth(m, bw) == 0:
            out.setdefault("traffic", []).append((bw.readCounter, bw.writeCounter, bw.timestamp))
    e = ffi.new("zes_power_energy_counter_t *")
    assert lib.zesPowerGetEnergyCounter(be._power_domain(ffi, lib, handle, tile, index), e) == 0
    out["energy"] = (e.energy, e.timestamp)
    return out


def test_xpu_idle_counters_read_zero_and_idle_power(monkeypatch):
    # two samples of idle counters: no active time, no bytes moved, the idle draw exactly; the
    # readings are Sysman's only (no runtime started)
    use_sim(monkeypatch, "xpu")
    for i in range(2):
        assert accel.utilization(i) == 0
        assert accel.memory_usage(i) == 0
        assert accel.power_draw(i) == 60_000
    for i in range(2):      # later calls use the previous readings
        assert (accel.utilization(i), accel.memory_usage(i), accel.power_draw(i)) == (0, 0, 60_000)
    assert not accel.is_initialized()


def test_xpu_counters_follow_the_work_on_the_non_current_device(monkeypatch):
    # copies on device 1 (device 0 stays current and idle): its engines are active, it draws more
    # than idle, and its memory moved bytes (a tiny nominal bandwidth makes that 100 %)
    from accel.sim import _ze_counters
    use_sim(monkeypatch, "xpu", ACCEL_SIM_DELAY_US=20_000)
    monkeypatch.setattr(_ze_counters, "MAX_BANDWIDTH", 1)
    a, b = accel.Buffer(1 << 20, device=1), accel.Buffer(1 << 20, device=1)
    for i in range(2):        # the baselines
        accel.utilization(i), accel.memory_usage(i), accel.power_draw(i)
    s1 = accel.Stream(1)
    for _ in range(5):
        b.copy_from(a, stream=s1)
    s1.synchronize()
    assert accel.current_device_index() == 0
    assert accel.utilization(1) > 0 and accel.power_draw(1) > 60_000 and accel.memory_usage(1) == 100
    assert (accel.utilization(0), accel.memory_usage(0), accel.power_draw(0)) == (0, 0, 60_000)
    del a, b


def test_xpu_sim_counters_are_monotonic_and_driven_by_work(monkeypatch):
    # zes_api.h: activeTime, read/write counters and energy are monotonic; the simulator's grow
    # with the work it runs: active time by at least the simulated latency of each copy, traffic by
    # exactly the bytes read from and written to device memory
    use_sim(monkeypatch, "xpu", ACCEL_SIM_DELAY_US=10_000)
    a, b = accel.Buffer(4096, device=1), accel.Buffer(4096, device=1)
    s1 = accel.Stream(1)
    before = _xpu_counters(1)
    b.copy_from(a, stream=s1)                                   # device -> device: 4096 read, 4096 written
    b.copy_from(bytes(4096), stream=s1)                         # host -> device: 4096 written
    b.fill_(7, stream=s1)                                       # 4096 written
    s1.synchronize()
    after = _xpu_counters(1)
    (act0, ts0), = before["active"]
    (act1, ts1), = after["active"]
    assert ts1 > ts0 and act1 - act0 >= 2 * 10_000            # at least the copy and the fill (us)
    (r0, w0, _), = before["traffic"]
    (r1, w1, _), = after["traffic"]
    assert r1 - r0 >= 4096 and (w1 - w0) - (r1 - r0) >= 2 * 4096
    assert after["energy"][0] > before["energy"][0] and after["energy"][1] > before["energy"][1]
    idle = _xpu_counters(0)
    assert idle["active"][0][0] == 0 and idle["traffic"][0][:2] == (0, 0)
    del a, b


def test_xpu_tiles_have_their_own_counters(monkeypatch):
    # ZE_FLAT_DEVICE_HIERARCHY=FLAT: two cards of two tiles are four devices; work on tile 1 of
    # card 0 (device 1) leaves its sibling tile (device 0) idle; each tile draws half the card's idle power
    use_sim(monkeypatch, "xpu", ACCEL_SIM_ZE_TILES=2, ZE_FLAT_DEVICE_HIERARCHY="FLAT", ACCEL_SIM_DELAY_US=20_000)
    assert accel.device_count() == 4
    for i in range(4):
        assert accel.power_draw(i) == 30_000 and accel.utilization(i) == 0
    a = accel.Buffer(1 << 16, device=1)
    s1 = accel.Stream(1)
    for _ in range(3):
        a.fill_(1, stream=s1)
    s1.synchronize()
    assert accel.utilization(1) > 0 and accel.power_draw(1) > 30_000
    assert accel.utilization(0) == 0 and accel.power_draw(0) == 30_000
    del a


def test_xpu_sampling_state_is_one_reading_per_counter(monkeypatch):
    # bounded: one previous reading per engine group, memory module and power domain used
    use_sim(monkeypatch, "xpu")
    for _ in range(3):
        for i in range(2):
            accel.utilization(i), accel.memory_usage(i), accel.power_draw(i)
    table = _lazy.backend()._smi_prev[1]
    assert len(table) == 2 * 3          # per device: its compute engine group, HBM module, card power domain
    assert sorted({kind for kind, _ in table}) == ["bandwidth", "engine", "power"]


def test_xpu_memory_usage_without_permission_says_so(monkeypatch):
    # zesMemoryGetBandwidth may answer ZE_RESULT_ERROR_INSUFFICIENT_PERMISSIONS: memory_usage
    # raises with the call and code; utilization reads other counters and still answers
    use_sim(monkeypatch, "xpu")
    code = sim_core.constants_of("_ze").ZE_RESULT_ERROR_INSUFFICIENT_PERMISSIONS
    sim_core.inject_error("zesMemoryGetBandwidth", code, times=-1)
    try:
        with pytest.raises(accel.AcceleratorError, match="zesMemoryGetBandwidth.*INSUFFICIENT_PERMISSIONS"):
            accel.memory_usage(0)
        assert accel.utilization(0) == 0
    finally:
        sim_core.clear_faults()


def test_xpu_old_loader_samples_after_init(monkeypatch):
    # legacy Sysman on core handles (1.8.12 loader, ZES_ENABLE_SYSMAN=1 at zeInit)
    use_sim(monkeypatch, "xpu", ACCEL_SIM_ZE_LOADER="1.8.12")
    with pytest.raises(accel.AcceleratorError, match="zesInit"):
        accel.utilization(0)
    b = accel.Buffer(16, device=1)
    assert (accel.utilization(1), accel.memory_usage(1), accel.power_draw(1)) == (0, 0, 60_000)
    del b


def test_xpu_can_device_access_peer_follows_level_zero(monkeypatch):
    # ze_api.h, zeDeviceCanAccessPeer: "If both device and peer device are the same then return true"
    use_sim(monkeypatch, "xpu")
    assert accel.can_device_access_peer(0, 1) is True
    assert accel.can_device_access_peer(1, 1) is True


def test_python_m_accel_shows_the_readings(sim_backend):
    from accel import __main__ as main
    report = main.collect()
    assert report["devices"]
    for d in report["devices"]:
        r = d["readings"]
        if sim_backend == "cuda":
            assert (r["utilization_percent"], r["temperature_c"], r["power_draw_mw"]) == (0, 35, 70_000)
        if sim_backend == "mps":
            assert r["peers"] == [] and r["temperature_c"].startswith("n/a (mps has no management library")
        else:
            assert r["peers"] == [1 - d["index"]]
            assert isinstance(r["clock_rate_mhz"], int)
    assert "now: utilization" in main.render(report)


def test_fork_after_the_readings_still_works(sim_cuda):
    # the readings use NVML only: a child forked afterwards can still start CUDA (torch's promise)
    from conftest import run_forked
    assert accel.temperature(1) == 35 and accel.list_gpu_processes(0).startswith("GPU:0")
    assert not _lazy.backend().driver_started
    assert run_forked(lambda: 0 if accel.Buffer(16, device=1).nbytes == 16 else 7) == 0


def test_xpu_old_loader_reads_sysman_after_init(monkeypatch):
    # Debian's 1.8.12 loader has no zesInit: Sysman answers on core handles once zeInit ran with
    # ZES_ENABLE_SYSMAN=1 (the backend sets it), so before init the readings say what is missing
    use_sim(monkeypatch, "xpu", ACCEL_SIM_ZE_LOADER="1.8.12")
    assert "zesInit" in accel.list_gpu_processes(0)
    with pytest.raises(accel.AcceleratorError, match="zesInit"):
        accel.temperature(0)
    b = accel.Buffer(16, device=1)
    assert accel.temperature(1) == 35 and accel.clock_rate(0) == 300
    assert accel.list_gpu_processes(1).splitlines()[1].startswith(f"process {os.getpid():>10d}")
    del b
