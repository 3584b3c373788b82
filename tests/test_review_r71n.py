"""Adversarial review of session 31's changes (round r71n): peer copies without peer access, NVML
matched by UUID, the loader's soname resolution, RNG seeding queued for init, graphs.

accel bugs shown (strict xfail), all in accel/backends/cuda/nvml.py smi_index/_nvml_index_of:

* the UUID match runs only when more than one device is visible (``len(ordinals) > 1``): with
  CUDA_VISIBLE_DEVICES=1 on a machine whose CUDA order is not its PCI order, telemetry of device 0
  reads the other GPU;
* the UUID comes from the runtime (cudaGetDeviceProperties) at the first reading: in a child forked
  after init the runtime refuses it (and must not be called there), and the reading falls back to
  the position, another GPU than the parent read;
* every NVML device's UUID is read (_nvml_uuids): one GPU NVML cannot read (GPU_IS_LOST) fails the
  readings of every healthy device once the runtime runs.

Checked and fine (passing tests below): the staged copy (XPU through pinned host memory, CUDA with
cudaMemcpyPeerAsync) runs after the source device's current stream and before its later work,
with the non-current device's memory, and leaves no staging memory behind.
"""


import pytest

import accel
from accel import sim
from conftest import run_forked, use_sim

MIB = 1 << 20


def _nvml_used_by_uuid(uuid_text):
    """NVML's memory used of the GPU with ``uuid_text`` (GPU-...), asked of the simulated NVML."""
    from accel._ffi import _nvml
    nffi = _nvml.ffi
    nvml = sim.open_library("nvml")
    assert nvml.nvmlInit_v2() == 0
    try:
        h = nffi.new("nvmlDevice_t *")
        assert nvml.nvmlDeviceGetHandleByUUID(uuid_text.encode(), h) == 0
        m = nffi.new("nvmlMemory_t *")
        assert nvml.nvmlDeviceGetMemoryInfo(h[0], m) == 0
        return int(m.used)
    finally:
        nvml.nvmlShutdown()


@pytest.fixture
def swapped_bus(monkeypatch):
    """Physical device 1 on the lower PCI bus: NVML index 0 is physical device 1."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_PCI_ORDER="1,0")
    yield
    sim.reset()


# (r71n) a single visible device skips the UUID match (len(ordinals) > 1)
# (r71n found; fixed in session 31)
def test_telemetry_one_visible_device_not_in_pci_order(swapped_bus, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert accel.device_count() == 1
    keep = accel.Buffer(256 * MIB, device=0)
    uuid = f"GPU-{accel.get_device_properties(0).uuid}"
    assert accel.device_memory_used(0) == _nvml_used_by_uuid(uuid)
    del keep


def test_telemetry_two_visible_devices_not_in_pci_order(swapped_bus):
    """What the fix covers: every device read by its UUID (both devices, the non-current too)."""
    keep = [accel.Buffer(256 * MIB, device=0), accel.Buffer(64 * MIB, device=1)]
    for d in (0, 1):
        uuid = f"GPU-{accel.get_device_properties(d).uuid}"
        assert accel.device_memory_used(d) == _nvml_used_by_uuid(uuid)
    del keep


# (r71n) in a child forked after init the runtime refuses cudaGetDeviceProperties (the UUID), and
# smi_index falls back to the position: the child reads the other GPU, where its parent read the right one
# (r71n found; fixed in session 31)
def test_telemetry_in_forked_child_not_in_pci_order(swapped_bus):
    keep = [accel.Buffer(4 * MIB, device=0), accel.Buffer(4 * MIB, device=1)]   # (the runtime runs)
    accel.synchronize(1)
    uuids = [f"GPU-{accel.get_device_properties(d).uuid}" for d in (0, 1)]
    want = [_nvml_index_of_uuid(u) for u in uuids]
    assert want == [1, 0]                   # CUDA's FASTEST_FIRST order against NVML's bus order

    def child():
        from accel import _lazy
        got = [_lazy.backend().smi_index(d) for d in (0, 1)]
        print("child: NVML indices", got, "by UUID", want)
        return 0 if got == want else 3
    assert run_forked(child) == 0
    del keep


def _nvml_index_of_uuid(uuid_text):
    from accel._ffi import _nvml
    nffi = _nvml.ffi
    nvml = sim.open_library("nvml")
    assert nvml.nvmlInit_v2() == 0
    try:
        h = nffi.new("nvmlDevice_t *")
        assert nvml.nvmlDeviceGetHandleByUUID(uuid_text.encode(), h) == 0
        idx = nffi.new("unsigned int *")
        assert nvml.nvmlDeviceGetIndex(h[0], idx) == 0
        return idx[0]
    finally:
        nvml.nvmlShutdown()


class _LostGpu:
    """The simulated NVML as accel opened it, but NVML device ``lost`` answers
    NVML_ERROR_GPU_IS_LOST (15) to nvmlDeviceGetUUID, as a GPU that fell off the bus (Xid 79) does."""

    def __init__(self, lib, nffi, lost):
        self._lib, self._ffi, self._lost = lib, nffi, lost

    def nvmlDeviceGetUUID(self, handle, buf, n):
        idx = self._ffi.new("unsigned int *")
        if self._lib.nvmlDeviceGetIndex(handle, idx) == 0 and idx[0] == self._lost:
            return 15
        return self._lib.nvmlDeviceGetUUID(handle, buf, n)

    def __getattr__(self, name):
        return getattr(self._lib, name)


@pytest.fixture
def sim_two(monkeypatch):
    use_sim(monkeypatch, "cuda")
    yield
    sim.reset()


# (r71n) _nvml_index_of reads every NVML device's UUID (_nvml_uuids): one unreadable GPU fails the
# readings of every other once the runtime runs (torch's _get_nvml_device_index, and accel before
# the runtime runs, touch only the device asked about)
# (r71n found; fixed in session 31)
def test_telemetry_of_a_healthy_device_when_another_gpu_is_lost(sim_two, monkeypatch):
    from accel import _lazy
    be = _lazy.backend()
    nffi, lib, path = be._nvml_lib()
    monkeypatch.setattr(be, "_nvml", (nffi, _LostGpu(lib, nffi, lost=1), path))
    before = accel.device_memory_used(0)        # before the runtime runs: by position, fine
    assert not be.driver_started
    keep = accel.Buffer(4 * MIB, device=0)      # the runtime runs
    assert be.driver_started and be._nvml[1].__class__ is _LostGpu
    assert accel.device_memory_used(0) >= before
    del keep


# -- checked and fine: the staged copy's order and its staging memory --------------------------------

@pytest.fixture(params=["xpu", "cuda"])
def no_peer_any(request, monkeypatch):
    use_sim(monkeypatch, request.param, ACCEL_SIM_PEER="none", ACCEL_ALLOC_CONF="expandable_segments:True")
    yield request.param
    sim.reset()


def test_staged_copy_runs_after_the_source_stream_and_before_its_later_work(no_peer_any):
    """Current device 1; the source on device 0 is written on device 0's current (non-default)
    stream just before a non-blocking copy on device 1's stream, and overwritten just after: the
    copy sees the first value, the source the second, and no staging memory is left behind."""
    from accel import _lazy
    be = _lazy.lazy_init()
    accel.set_device_index(1)
    s0 = accel.Stream(device=0)
    a = accel.Buffer(MIB, device=0)
    b = accel.Buffer(MIB, device=1)
    with s0:
        a.fill_(7)
        b.copy_from(a, non_blocking=True)
        a.fill_(8)
    assert (b.to_numpy() == 7).all()
    assert (a.to_numpy() == 8).all()
    accel.synchronize(0)
    accel.synchronize(1)
    if no_peer_any == "xpu":
        assert be._deferred == [] and len(be._host_allocs) == 0
        assert sim.state().ze_errors == []
    else:
        assert sim.state().errors == []
