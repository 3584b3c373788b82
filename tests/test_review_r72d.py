"""r72d: adversarial review of 262508e^..5528875 (accel): cross-device Buffer.copy_from with and
without peer access, backend.memcpy_peer_async, NVML matched by UUID, the loader's soname
resolution, RNG seeding queued for init, graphs' pinned-hold restore, the accel._locks.Lock
conversions, and __cuda_array_interface__ of a buffer last used on another device's stream.

Each accel bug is a strict xfail naming the function; the passing tests are checks that were
fine.  Bugs, most severe first:

1. CudaNvmlMixin.smi_index: when _nvml_index_of finds no UUID (the GPU asked about is the one
   NVML cannot read) it falls back to the position, which on a machine whose CUDA order is not
   its PCI order is the other GPU: the lost GPU's telemetry is the healthy one's, silently.
2. Buffer._copy_from: a Ctrl-C as the copy call returns (queued) skips the second half of the
   two-way barrier; the source device's current stream runs on before the copy read.
3. accel._ffi.soname_file/_loader_dirs: LD_LIBRARY_PATH is read from os.environ at call time;
   ld.so uses the value the process started with, so the ELF check looks at another file than
   dlopen maps (a truncated one on the startup path passes: the SIGBUS the check prevents).
4. Graph._capture_end: the pinned hold passes through the stack between two pops; a Ctrl-C
   there loses it and the freed pinned block stays parked for good.
5. Buffer.__cuda_array_interface__: a last-use stream of another device is waited for with a
   device synchronize (unrelated work there blocks the getter); its message says only a device
   synchronize could wait for it.
6. XPU memcpy_peer_async in a capture: refused before anything is queued, yet the capture is
   invalidated and the CaptureError does not say so.
7. DeviceCachingAllocator.add_peer: on XPU its capture refusal names cuMemSetAccess.  Two simulated devices throughout, with work on the non-current device; nothing timed
(an ordering test gates a simulated stream with torch_port_util.hold instead).

Spec text relied on:
- torch ATen/native/cuda/Copy.cu, copy_device_to_device: a two-way barrier between the two
  devices' current streams; after the copy "dst waits on src barrier" and the source device's
  current stream's later work is ordered after it.
- nvml.h, nvmlDeviceGetHandleByIndex_v2: "The NVML index may not correlate with other APIs,
  such as the CUDA device index" (the reason accel matches by UUID).
- CUDA Array Interface v3, ``stream``: the consumer synchronizes on that stream.
"""

import threading

import numpy as np
import pytest

import accel
from accel import _lazy, sim

from conftest import SIMS, use_sim, vendor_calls_made_by
from torch_port_util import hold

MIB = 1 << 20


def _need(kind):
    if kind not in SIMS:
        pytest.skip(f"ACCEL_TEST_SIMS leaves out {kind}")


def _pattern(n=4096, seed=0):
    return ((np.arange(n) * 7 + seed) % 251).astype(np.uint8)


# -- 1. NVML: the device asked about is the one NVML cannot read ---------------------------------

class _LostGpu:
    """The simulated NVML as accel opened it, except that NVML device ``lost`` answers
    NVML_ERROR_GPU_IS_LOST (15) to nvmlDeviceGetUUID, as a GPU that fell off the bus (Xid 79)."""

    def __init__(self, lib, nffi, lost):
        self._lib, self._ffi, self._lost = lib, nffi, lost

    def nvmlDeviceGetUUID(self, handle, buf, n):
        idx = self._ffi.new("unsigned int *")
        if self._lib.nvmlDeviceGetIndex(handle, idx) == 0 and idx[0] == self._lost:
            return 15
        return self._lib.nvmlDeviceGetUUID(handle, buf, n)

    def __getattr__(self, name):
        return getattr(self._lib, name)


def _nvml_used_by_uuid(uuid_text):
    """The simulated NVML's memory used of the GPU with ``uuid_text`` (GPU-...), asked directly."""
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
    """Physical device 1 on the lower PCI bus: CUDA device 0 is NVML index 1 (ACCEL_SIM_PCI_ORDER)."""
    _need("cuda")
    use_sim(monkeypatch, "cuda", ACCEL_SIM_PCI_ORDER="1,0")
    yield
    sim.reset()


# (r72d found; fixed in session 32)
def test_telemetry_of_the_lost_gpu_itself_is_not_the_other_gpus(swapped_bus, monkeypatch):
    """CUDA device 0 is NVML index 1, which NVML cannot read.  _nvml_index_of passes the lost GPU
    over, finds no UUID, and smi_index returns the position, NVML index 0: device 0's readings are
    device 1's, silently (both devices read NVML index 0).  Refusing is fine; the other GPU is not."""
    be = _lazy.backend()
    nffi, lib, path = be._nvml_lib()
    monkeypatch.setattr(be, "_nvml", (nffi, _LostGpu(lib, nffi, lost=1), path))
    keep = [accel.Buffer(256 * MIB, device=0), accel.Buffer(8 * MIB, device=1)]   # the runtime runs
    accel.synchronize(1)
    uuid0 = f"GPU-{accel.get_device_properties(0).uuid}"
    uuid1 = f"GPU-{accel.get_device_properties(1).uuid}"
    assert _nvml_used_by_uuid(uuid0) != _nvml_used_by_uuid(uuid1)
    try:
        got = accel.device_memory_used(0)
    except accel.AcceleratorError:
        return                              # a refusal names the problem: fine
    assert got == _nvml_used_by_uuid(uuid0), "device 0's telemetry read device 1's GPU"
    del keep


def test_telemetry_of_the_healthy_gpu_when_the_other_is_lost_with_swapped_bus(swapped_bus, monkeypatch):
    """(checked, fine) The healthy device reads its own GPU by UUID."""
    be = _lazy.backend()
    nffi, lib, path = be._nvml_lib()
    monkeypatch.setattr(be, "_nvml", (nffi, _LostGpu(lib, nffi, lost=1), path))
    keep = [accel.Buffer(256 * MIB, device=0), accel.Buffer(8 * MIB, device=1)]
    accel.synchronize(1)
    uuid1 = f"GPU-{accel.get_device_properties(1).uuid}"
    assert accel.device_memory_used(1) == _nvml_used_by_uuid(uuid1)
    del keep


# -- 2. copy_from across devices: an interrupt as the copy returns skips the second barrier ------

@pytest.fixture(params=["all", "none"])
def gated(request, monkeypatch):
    """The CUDA simulator with queued operations (hold() gates a stream), with and without peers."""
    _need("cuda")
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=50, ACCEL_SIM_PEER=request.param)
    yield request.param
    sim.reset()


def _interrupted_copy(monkeypatch, be, peer, b, a, s1):
    """``b.copy_from(a, stream=s1)`` with a KeyboardInterrupt as the vendor copy call returns (the
    copy is queued: CPython runs a Ctrl-C's handler right after a C call)."""
    name = "memcpy_async" if peer == "all" else "memcpy_peer_async"
    original = getattr(be, name)

    def copy_then_interrupt(*args, **kw):
        original(*args, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(be, name, copy_then_interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            b.copy_from(a, stream=s1, non_blocking=True)
    finally:
        monkeypatch.setattr(be, name, original)


def _later_source_work_waits_for_the_copy(gated, monkeypatch, interrupt):
    """Queue ``b.copy_from(a)`` (a on device 0, the non-current device) behind a gate on s1, then
    record an event on device 0's current stream.  torch's barrier (Copy.cu) orders that stream's
    later work after the copy, so the event cannot complete before the gate opens: True when the
    event's synchronize returned only after the gate was opened (by a timer), False when it
    returned while the copy was still held (device 0's later work may overwrite the source
    under the queued read).  Causal, not timed: an ordered stream can never return early."""
    be = _lazy.lazy_init()
    a = accel.Buffer(4096, device=0).fill_(7)
    s1 = accel.Stream(device=1)
    b = accel.Buffer(4096, device=1, stream=s1)
    b.copy_from(a, stream=s1)                   # warm-up (peer access settled)
    accel.synchronize(0)
    accel.set_device_index(1)
    gate = hold(s1)
    timer = threading.Timer(1.0, gate.set)
    try:
        if interrupt:
            _interrupted_copy(monkeypatch, be, gated, b, a, s1)
        else:
            b.copy_from(a, stream=s1, non_blocking=True)
        later = accel.current_stream(0).record_event()     # device 0's work after the copy
        timer.start()
        later.synchronize()
        ordered = gate.is_set()
    finally:
        gate.set()
        timer.cancel()
    s1.synchronize()
    accel.synchronize(0)
    assert (b.to_numpy(stream=s1) == 7).all()
    assert sim.state().errors == []
    return ordered


def test_copy_from_orders_the_source_devices_later_work_after_the_copy(gated, monkeypatch):
    """(checked, fine) Without an interrupt device 0's later work waits for the copy."""
    assert _later_source_work_waits_for_the_copy(gated, monkeypatch, interrupt=False)


# (r72d found; fixed in session 32)
def test_copy_from_interrupted_as_the_copy_returns_still_orders_the_source_device(gated, monkeypatch):
    """The copy was queued (its uses are noted, _Noting), but ``barrier.wait_stream(stream)`` after
    it never runs: device 0's current stream is not ordered after the copy, and a program that
    goes on after the KeyboardInterrupt (a notebook) can overwrite the source under the queued
    read.  The second half of the barrier belongs in a ``finally`` once the copy was queued."""
    assert _later_source_work_waits_for_the_copy(gated, monkeypatch, interrupt=True), \
        "device 0's current stream ran on while the interrupted copy was still queued"


# -- 3. __cuda_array_interface__ of a buffer last used by another device's stream ----------------

@pytest.fixture(params=["all", "none"])
def cuda2(request, monkeypatch):
    _need("cuda")
    use_sim(monkeypatch, "cuda", ACCEL_SIM_PEER=request.param)
    yield request.param
    sim.reset()


# (r72d found; fixed in session 32)
def test_cai_getter_waits_for_the_last_use_stream_not_the_whole_other_device(cuda2):
    """The last-use stream s1 of device 1 is open (a stream synchronize, or the DLPack handshake's
    event, would do); the getter synchronizes the whole of device 1, so it waits for unrelated
    work there (another stream busy with a long kernel, or one waiting for what the caller does
    next: then it never returns)."""
    b0 = accel.Buffer(256).copy_from(_pattern(256))
    s1 = accel.Stream(1)
    d1 = accel.Buffer(256, device=1, stream=s1)
    d1.copy_from(b0, stream=s1)
    assert b0.last_stream == s1 and not s1.closed
    calls = vendor_calls_made_by(lambda: b0.__cuda_array_interface__)
    assert "cudaDeviceSynchronize" not in calls, calls


def test_cai_getter_of_a_buffer_read_on_device1_gives_device0_stream_and_right_bytes(cuda2):
    """(checked, fine) The stream given is device 0's current stream, and the bytes are ready."""
    b0 = accel.Buffer(256).copy_from(_pattern(256))
    s1 = accel.Stream(1)
    accel.Buffer(256, device=1, stream=s1).copy_from(b0, stream=s1, non_blocking=True)
    cai = b0.__cuda_array_interface__
    cur = accel.current_stream(0)
    assert cai["stream"] == (cur.handle or 1)
    assert (b0.to_numpy() == _pattern(256)).all()


# -- 4. XPU staged copy in a capture: the refusal invalidates the capture without saying so -------

@pytest.fixture
def xpu_no_peer(monkeypatch):
    _need("xpu")
    use_sim(monkeypatch, "xpu", ACCEL_SIM_PEER="none")
    yield
    sim.reset()


# (r72d found; fixed in session 32)
def test_xpu_refused_staged_copy_in_a_capture_says_the_capture_is_invalidated(xpu_no_peer):
    """The refusal is decided before any vendor call, yet the capture is invalidated; the message
    says only that the copy "cannot be captured", so a program that catches it and goes on (as
    after copy_from's other refusal in a capture, r71m, which leaves the capture going and says
    "nothing was copied") meets an unexplained CaptureError at capture_end.  Either keep the
    capture going or say it was invalidated (as memcpy_async's pageable refusal does)."""
    a = accel.Buffer(4096, device=0).copy_from(_pattern())
    b = accel.Buffer(4096, device=1)
    c = accel.Buffer(4096, device=1)
    s1 = accel.Stream(device=1)
    g = accel.Graph()
    with s1:
        g.capture_begin()
        c.fill_(3, s1)
        with pytest.raises(accel.CaptureError) as info:
            b.copy_from(a, stream=s1, non_blocking=True)
        try:
            g.capture_end()
            ended = True
        except accel.CaptureError:
            ended = False
    assert ended or "invalidat" in str(info.value), str(info.value)


# -- 5. graphs: a Ctrl-C as capture_end takes the pinned hold out of the capture's table -------------

class _SigintAsHostIsTaken(dict):
    """A capture's table (streams._capture_events[id]) whose ``pop("host")`` takes the hold, then
    receives SIGINT as it returns: the Python handler runs at the next bytecode boundary, with the
    popped value not yet stored (as CPython runs a signal's handler right after a C call).  A
    caller that defers signals there (accel.backends._signals.deferred) gets it afterwards."""

    def pop(self, key, *default):
        value = dict.pop(self, key, *default)
        if key == "host":
            import signal
            signal.raise_signal(signal.SIGINT)
        return value


def _parked() -> int:
    return len(accel.memory.host_allocator()._parked)


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
# (r72d found; fixed in session 32)
def test_ctrl_c_as_capture_end_takes_the_pinned_hold_keeps_it_with_the_graph(monkeypatch, kind):
    """r71a moved ``h.host = events.pop("host")`` before ``_finish_end`` so that an interrupt
    there keeps the hold with the graph; but the hold still passes through the stack: a SIGINT as
    ``events.pop("host")`` (or ``_capture_events.pop``) returns leaves it nowhere, and the pinned
    block freed by its owner stays parked for good (never reused, never unpinned)."""
    _need(kind)
    use_sim(monkeypatch, kind)
    _lazy.lazy_init()
    from accel import streams
    data = accel.empty_pinned(8, np.float32)
    data[:] = 2
    with accel.device_index(1):                 # the non-current device's capture
        buf = accel.Buffer(32)
        g = accel.Graph()
        try:
            with accel.graph(g):
                buf.copy_from(data, non_blocking=True)
                (cid, table), = streams._capture_events.items()
                assert "host" in table
                streams._capture_events[cid] = _SigintAsHostIsTaken(table)
        except KeyboardInterrupt:
            pass                    # (a fix that takes the hold another way may never pop it)
    del data                        # its owner frees the block: parked while the graph holds it
    g.reset()                       # releases what the graph holds
    accel.synchronize(1)
    assert _parked() == 0, "the interrupted capture_end lost the graph's pinned hold: the block stays parked"


# -- 6. the loader's soname resolution reads LD_LIBRARY_PATH as the program changed it ------------

_PROBE = "libr72dprobe.so.1"

_CHILD = """
import os, sys, cffi
os.environ.pop("LD_LIBRARY_PATH", None)        # the program drops it after starting
from accel._ffi import soname_file
found = soname_file(sys.argv[1])
cffi.FFI().dlopen(sys.argv[1])
mapped = sorted({line.split()[-1] for line in open("/proc/self/maps") if sys.argv[1] in line})
print(repr((found and os.path.realpath(found), mapped)))
"""


# (r72d found; fixed in session 32)
def test_soname_file_names_the_file_the_loader_maps(tmp_path):
    """glibc's ld.so reads LD_LIBRARY_PATH once, at process start (_dl_init_paths); setting or
    removing os.environ["LD_LIBRARY_PATH"] later changes nothing for dlopen.  soname_file reads
    the current os.environ, so it names another file than the loader maps: here none, while the
    loader maps the copy on the startup path.  Had that copy been truncated, loader_file_problem
    would have passed it (nothing found, nothing checked) and dlopen would have mapped it: the
    SIGBUS r71b set out to prevent; the other way round (a variable set after start) it blames a
    file the loader never opens.  The startup value is in /proc/self/environ."""
    import os
    import shutil
    import subprocess
    import sys
    from accel._ffi import soname_file
    source = soname_file("libm.so.6")
    if source is None:
        pytest.skip("no libm.so.6 where ld.so looks")
    shutil.copyfile(source, tmp_path / _PROBE)      # a whole, loadable library under a new name
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", _CHILD, _PROBE], env=env, capture_output=True, text=True,
                         timeout=60, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    found, mapped = eval(out.stdout.strip().splitlines()[-1])
    assert mapped == [os.path.realpath(tmp_path / _PROBE)], mapped     # what ld.so took
    assert found in mapped, f"soname_file named {found!r}; the loader mapped {mapped}"


# -- 7. XPU, peer-capable cards: the first copy between them in a capture names a CUDA call --------

@pytest.fixture
def xpu_peers(monkeypatch):
    _need("xpu")
    use_sim(monkeypatch, "xpu", ACCEL_SIM_PEER="all", ACCEL_ALLOC_CONF="expandable_segments:True")
    yield
    sim.reset()


# (r72d found; fixed in session 32)
def test_xpu_add_peer_refused_in_a_capture_names_the_level_zero_call(xpu_peers):
    """copy_from grants the destination card access to the source's mapped memory (add_peer) on
    the first copy between two peer cards; inside a capture that is refused, and the message says
    "(cuMemSetAccess is not allowed then)" on an XPU machine, where no CUDA call exists."""
    a = accel.Buffer(4096, device=0).copy_from(_pattern())
    b = accel.Buffer(4096, device=1)
    s1 = accel.Stream(device=1)
    g = accel.Graph()
    with pytest.raises(accel.CaptureError) as info:
        with s1, g:
            b.copy_from(a, stream=s1, non_blocking=True)
    assert "add_peer" in str(info.value)
    assert "cuMem" not in str(info.value), str(info.value)


# -- checked and fine: bytes of every cross-device source kind, both directions, either device current --

def _one_copy(kind, src_dev, cur, how, n=8192):
    dst_dev = 1 - src_dev
    accel.set_device_index(cur)
    want = _pattern(n, src_dev * 3 + cur)
    a = accel.Buffer(n + 512, device=src_dev).copy_from(np.concatenate([np.zeros(512, np.uint8), want]))
    view = a.as_array(np.uint8, (n,), offset=512)
    b = accel.Buffer(n, device=dst_dev)
    if how == "buffer":
        whole = accel.Buffer(n, device=src_dev)
        whole.copy_from(view)
        b.copy_from(whole)
    elif how == "view":
        b.copy_from(view)
    elif how == "cai":
        class Cai:
            pass
        src = Cai()
        cai = dict(a.__cuda_array_interface__)
        cai.update(shape=(n,), data=(a.ptr + 512, False))
        src.__cuda_array_interface__ = cai
        b.copy_from(src)
    else:                                               # a created, non-current stream of the destination
        s = accel.Stream(device=dst_dev)
        b.copy_from(view, stream=s, non_blocking=True)
        s.synchronize()
    return (b.to_numpy() == want).all()


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
@pytest.mark.parametrize("peer", ["all", "none"])
def test_cross_device_copies_of_every_source_kind(monkeypatch, kind, peer):
    _need(kind)
    use_sim(monkeypatch, kind, ACCEL_SIM_PEER=peer)
    bad = []
    for src_dev in (0, 1):
        for cur in (0, 1):
            for how in ("buffer", "view", "cai", "stream"):
                if how == "cai" and kind != "cuda":
                    continue
                if not _one_copy(kind, src_dev, cur, how):
                    bad.append((src_dev, cur, how))
    assert bad == []
    if kind == "cuda":
        assert sim.state().errors == []
    else:
        assert sim.state().ze_errors == []
    sim.reset()
