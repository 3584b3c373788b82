"""r73g: the Metal (mps) backend used as a program on an Apple-silicon Mac uses it, on the Metal
simulator (one device, unified memory), next to torch 2.13's documented ``torch.mps`` API.

What the other mps files do not already run (tests/test_mps*.py, test_torch_mps.py,
test_torch_ports_mps_r61.py, test_sim_metal_*.py, test_interop_audit_r72f.py): a training loop's
allocation churn under ``set_per_process_memory_fraction`` into an OutOfMemoryError and back out;
the fraction's refusals (torch.mps takes 0~2 where accel takes 0~1) leaving the cap as it was;
a two-stream pipeline re-recording its events while earlier records are still pending; host reads
of a buffer a command buffer is still writing (to_numpy, non_blocking to_numpy, a DLPack host copy);
DLPack out and in on kDLMetal with numpy and torch CPU; an MSL kernel, copies and the allocator
driven by several threads at once; a forked child; interpreter exit with a daemon thread still
queueing work.  Each check asks for the right bytes, no hang (joins and waits with a timeout),
errors that name the value and the fix, nothing changed by a refusal, and Metal objects bounded
by the live accel objects.

torch.mps names used as the oracle (docs.pytorch.org, torch.mps): ``current_allocated_memory``
is ``memory.memory_allocated()``, ``driver_allocated_memory`` is ``total - free`` of
``memory.get_memory_info()``, ``recommended_max_memory`` is ``total_memory``;
``torch.mps.event.Event`` has ``record``, ``wait``, ``query``, ``synchronize``, ``elapsed_time``.

Found (strict xfails): on a Mac pinned host memory and device memory are one pool (shared
MTLBuffers under one recommendedMaxWorkingSetSize; torch's MPS pinned allocator takes its buffers
from the same MPSHeapAllocatorImpl, whose OOM path frees every cached pool), but accel's pinned
and device caching allocators each free only their own cache before reporting out of memory, and
the pinned allocator's power-of-two rounding can pass maxBufferLength for a request that fits it;
an OOM caused by ``set_per_process_memory_fraction(0.0)`` (torch.mps: "no limit") never names the
fraction.
"""

import gc
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import accel
from accel import _dlpack, memory
from accel.sim import metal

from conftest import run_forked, use_sim

MiB = 1 << 20
SIM_MEMORY = 256 * MiB


def _driver_allocated() -> int:
    free, total = memory.get_memory_info()
    return total - free


def _join(threads, timeout=20.0):
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"


_EXPORTS_AT_START = [0]


def _exports() -> int:
    """Live DLPack exports made since the test began (an earlier test's capsule may still await
    its collection: counted from the fixture's baseline, session 34)."""
    return _dlpack.live_exports() - _EXPORTS_AT_START[0]


@pytest.fixture(autouse=True)
def _export_baseline():
    gc.collect()
    _EXPORTS_AT_START[0] = _dlpack.live_exports()


@pytest.fixture
def mps(monkeypatch):
    use_sim(monkeypatch, "mps", ACCEL_SIM_MEMORY=str(SIM_MEMORY))
    assert accel.device_count() == 1
    return accel.get_device_properties()


@pytest.fixture
def mps_delayed(monkeypatch):
    use_sim(monkeypatch, "mps", ACCEL_SIM_MEMORY=str(SIM_MEMORY), ACCEL_SIM_DELAY_US="300")
    return accel.get_device_properties()


# == allocation churn, set_per_process_memory_fraction, OutOfMemoryError, recovery ===============
def test_training_loop_churn_under_a_fraction_until_oom_then_recovers(mps):
    total = mps.total_memory
    assert total == memory.get_memory_info()[1]           # torch.mps.recommended_max_memory
    memory.empty_cache()
    driver_before = _driver_allocated()
    memory.set_per_process_memory_fraction(0.5)
    rng = np.random.default_rng(7)
    params = [accel.Buffer(2 * MiB).fill_(i + 1) for i in range(4)]   # the model: kept throughout
    for step in range(24):
        acts = [accel.Buffer(int(n) * 4096) for n in rng.integers(16, 1500, size=5)]
        for i, a in enumerate(acts):
            a.fill_((step + i) % 251)
        grads = [accel.Buffer(p.nbytes) for p in params]
        for g, p in zip(grads, params):
            g.copy_from(p)
        assert all((g.to_numpy()[::4096] == i + 1).all() for i, g in enumerate(grads))
        del acts, grads, a, g, p         # (the loop variables hold the last ones too)
        if step % 8 == 7:
            memory.empty_cache()                        # torch.mps.empty_cache
        assert memory.memory_reserved() <= total // 2
    assert memory.memory_allocated() == sum(p.nbytes for p in params)  # torch.mps.current_allocated_memory

    # Memory grows past a lower cap: the next segment is refused with the cap in the message.
    memory.set_per_process_memory_fraction(0.125)       # 32 MiB of the 256 MiB working set
    hold = []
    with pytest.raises(accel.OutOfMemoryError) as info:
        for i in range(64):
            hold.append(accel.Buffer(4 * MiB).fill_(i))
    assert "32.00 MiB allowed" in str(info.value) and "Tried to allocate 4.00 MiB" in str(info.value)
    del info
    allocated = memory.memory_allocated()
    assert allocated == sum(b.nbytes for b in params + hold)   # the refused request counted nothing
    assert memory.memory_reserved() <= total // 8
    assert all((b.to_numpy()[::MiB] == i).all() for i, b in enumerate(hold))   # nothing lost
    assert all((p.to_numpy()[::MiB] == i + 1).all() for i, p in enumerate(params))

    # Recovery: drop half the working set and the same request succeeds under the same cap.
    del hold[::2]
    again = accel.Buffer(4 * MiB).fill_(99)
    assert (again.to_numpy()[::MiB] == 99).all()
    del again, hold, params
    assert memory.memory_allocated() == 0
    memory.empty_cache()
    assert memory.memory_reserved() == 0
    assert _driver_allocated() == driver_before          # torch.mps.driver_allocated_memory
    memory.set_per_process_memory_fraction(1.0)
    assert accel.Buffer(total // 2).nbytes == total // 2


@pytest.mark.parametrize("bad, kind", [(1.5, ValueError), (2.0, ValueError), (float("nan"), ValueError),
                                       (-0.25, ValueError), (1, TypeError), ("0.5", TypeError),
                                       (np.float32(0.5), TypeError)])
def test_fraction_torch_mps_accepts_is_refused_naming_it_and_the_cap_stays(mps, bad, kind):
    """torch.mps.set_per_process_memory_fraction takes 0~2 (above 1: past the recommended working
    set); accel takes torch.cuda's 0~1 on every backend (README).  A refused value names itself
    and the range, and the cap set before stays in force."""
    memory.set_per_process_memory_fraction(0.25)
    with pytest.raises(kind) as info:
        memory.set_per_process_memory_fraction(bad)
    text = str(info.value)
    assert ("0~1" in text) if kind is ValueError else ("float" in text and repr(bad) in text)
    if kind is ValueError:
        assert str(bad) in text
    assert memory.get_per_process_memory_fraction() == 0.25
    with pytest.raises(accel.OutOfMemoryError, match="64.00 MiB allowed"):
        accel.Buffer(80 * MiB)
    assert memory.memory_allocated() == 0


@pytest.mark.parametrize("device", [1, "mps:1", -1])
def test_fraction_for_a_device_metal_does_not_have_names_the_index(mps, device):
    memory.set_per_process_memory_fraction(0.25)
    with pytest.raises(accel.InvalidDeviceError, match=r"1 mps device visible \(valid indices 0..0\)"):
        memory.set_per_process_memory_fraction(0.5, device)
    assert memory.get_per_process_memory_fraction() == 0.25
    assert memory.get_per_process_memory_fraction("mps:0") == 0.25


# (r73g found; fixed in session 34)
def test_oom_from_a_zero_fraction_names_the_fraction_and_how_to_lift_it(mps):
    """A Mac user's ``torch.mps.set_per_process_memory_fraction(0.0)`` ("Passing 0 to fraction
    means unlimited allocations") ported as is: accel takes 0.0 as torch.cuda does (every new
    segment fails).  The error must then say that the per-process fraction refused it and how
    to lift it, as torch.mps's own OOM names its knob ("Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0
    to disable upper limit")."""
    memory.set_per_process_memory_fraction(0.0)
    with pytest.raises(accel.OutOfMemoryError) as info:
        accel.Buffer(1024)
    assert "set_per_process_memory_fraction" in str(info.value) or "per_process_memory_fraction" in str(info.value)


# == unified memory: pinned host memory and device memory are one pool on a Mac ==================
@pytest.fixture
def mps_small(monkeypatch):
    """A 64 MiB Metal device: recommendedMaxWorkingSetSize 64 MiB, maxBufferLength 48 MiB."""
    use_sim(monkeypatch, "mps", ACCEL_SIM_MEMORY="64M")
    props = accel.get_device_properties()
    assert props.unified_memory and props.extra["max_buffer_length"] == 48 * MiB
    return props


def test_pinned_and_device_memory_come_from_one_metal_pool(mps_small):
    """accel's pinned memory on Metal is a shared MTLBuffer (as torch's MPS pinned allocator): it
    counts in currentAllocatedSize (torch.mps.driver_allocated_memory) as device memory does."""
    base = _driver_allocated()
    pinned = accel.empty_pinned(4 * MiB, np.uint8)
    assert _driver_allocated() - base == 4 * MiB
    pinned[:] = 7
    dev = accel.Buffer(pinned.nbytes).copy_from(pinned)
    assert (dev.to_numpy() == 7).all()
    del pinned, dev
    memory.empty_cache()
    memory.empty_host_cache()
    assert _driver_allocated() == base


# (r73g found; fixed in session 34)
def test_a_pinned_request_that_fits_one_metal_buffer_is_not_rounded_past_it(mps_small):
    """torch's MPS pinned allocator takes a shared buffer of the MPS allocator (MPSPinnedAllocator
    over _getSharedAllocator(), MPSAllocator.mm): no power-of-two rounding.  accel rounds as
    torch's CUDA CachingHostAllocator does, and on Metal a rounded size can pass maxBufferLength,
    the most one MTLBuffer holds; the request itself then still fits and must be served."""
    pinned = accel.empty_pinned(40 * MiB, np.uint8)
    pinned[::MiB] = 1
    assert pinned.nbytes == 40 * MiB


# (r73g found; fixed in session 36)
def test_a_device_allocation_on_unified_memory_frees_the_pinned_cache_before_oom(mps_small):
    """On a Mac pinned host memory and device memory are one pool (shared MTLBuffers, one
    recommendedMaxWorkingSetSize), and torch's MPS allocator frees every cached pool, the shared
    ones that back pinned memory included, before it reports out of memory
    (MPSHeapAllocatorImpl::release_cached_buffers).  A data loader's freed pinned batches must
    not make a device allocation fail."""
    staged = accel.empty_pinned(32 * MiB, np.uint8)     # a data loader's pinned batch, then freed
    staged[:] = 1
    del staged
    assert memory.get_memory_info()[0] < 40 * MiB       # its block stays cached (pinned)
    big = accel.Buffer(40 * MiB)                         # fits once the pinned cache is released
    assert big.nbytes == 40 * MiB


# (r73g found; fixed in session 36)
def test_a_pinned_allocation_on_unified_memory_frees_the_device_cache_before_oom(mps_small):
    activations = accel.Buffer(40 * MiB)                 # a forward pass's memory, then freed: cached
    del activations
    assert memory.memory_reserved() == 40 * MiB and memory.memory_allocated() == 0
    # (32 MiB, a power of two: since session 34 a rounded pinned request that fails falls back to
    # its own size, which 20 MiB here would fit beside the cache without releasing it)
    pinned = accel.empty_pinned(32 * MiB, np.uint8)      # fits once the device cache is released
    assert pinned.nbytes == 32 * MiB


# == streams and events: a pipeline that re-records its events ==================================
def test_two_stream_pipeline_rerecording_events_gives_every_batch_and_bounded_metal_state(mps_delayed):
    """Producer stream fills one of two staging buffers, consumer stream copies it out; each side
    waits for the other's event before reusing a buffer (torch.mps.Event record/wait), and every
    event is re-recorded while its previous record may still be pending."""
    baseline = metal.state().live_counts().get("MTLSharedEvent", 0)
    producer, consumer = accel.Stream(), accel.Stream()
    staging = [accel.Buffer(4096, stream=producer) for _ in range(2)]
    filled = [accel.Event() for _ in range(2)]
    drained = [accel.Event() for _ in range(2)]
    n = 16
    outs = [accel.Buffer(4096, stream=consumer) for _ in range(n)]
    for i in range(n):
        k = i % 2
        drained[k].wait(producer)                  # the consumer is done reading staging[k]
        staging[k].fill_(i + 1, stream=producer)
        filled[k].record(producer)
        filled[k].wait(consumer)
        outs[i].copy_from(staging[k], stream=consumer)
        drained[k].record(consumer)
    done = accel.Event()
    done.record(consumer)
    done.synchronize()
    assert done.query()
    for i, out in enumerate(outs):
        assert (out.to_numpy(stream=consumer) == i + 1).all(), f"batch {i} lost or overwritten"
    # re-records made fresh MTLSharedEvents (accel's r63e rule); none stays once the events go
    assert metal.state().live_counts().get("MTLSharedEvent", 0) <= baseline + 5
    del filled, drained, done
    accel.synchronize()
    assert metal.state().live_counts().get("MTLSharedEvent", 0) == baseline


def test_timing_events_on_two_streams_torch_mps_event_api(mps_delayed):
    s = accel.Stream()
    start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    buf = accel.Buffer(1 << 16)
    start.record(s)
    for v in range(8):
        buf.fill_(v, stream=s)
    end.record(s)
    ms = start.elapsed_time(end)                   # waits for both (torch.mps's waits too)
    assert ms >= 0.0 and end.query() and start.query()
    plain = accel.Event()
    plain.record(s)
    with pytest.raises(ValueError, match="enable_timing=True"):     # torch's words
        start.elapsed_time(plain)
    assert (buf.to_numpy(stream=s) == 7).all()
    for kwargs, word in ((dict(external=True), "external"), (dict(interprocess=True), "interprocess")):
        with pytest.raises(NotImplementedError, match=word):
            accel.Event(**kwargs)


# == host views of unified memory while a command buffer still writes ============================
def test_host_reads_wait_for_the_command_buffer_still_writing(mps_delayed):
    side = accel.Stream()
    buf = accel.Buffer(1 << 16)
    for v in range(1, 33):
        buf.fill_(v, stream=side)                  # 32 delayed fills, the last one 32
    assert (buf.to_numpy(stream=side) == 32).all()

    for v in range(40, 48):
        buf.fill_(v, stream=side)
    ev = accel.Event()
    ev.record(side)
    ev.wait(accel.current_stream())                 # the program orders its own read
    assert (buf.to_numpy() == 47).all()

    for v in range(50, 58):
        buf.fill_(v, stream=side)
    arr, ready = buf.to_numpy(stream=side, non_blocking=True)
    ready.synchronize()
    assert (arr == 57).all()

    for v in range(60, 68):
        buf.fill_(v, stream=side)                  # the buffer's last use is on `side`
    host = np.from_dlpack(buf, device="cpu", copy=True)   # accel's host copy waits for it
    assert host.dtype == np.uint8 and (host == 67).all()
    view = buf.as_array(np.uint32, (128, 128))
    for v in range(70, 74):
        buf.fill_(v, stream=side)
    got = view.to_numpy(stream=side)
    assert got.shape == (128, 128) and (got == np.uint32(int.from_bytes(bytes([73]) * 4, "little"))).all()


def test_numpy_implicit_conversion_of_metal_memory_is_refused_with_the_fix(mps):
    buf = accel.Buffer(64).fill_(1)
    with pytest.raises(TypeError, match=r"to_numpy"):
        np.asarray(buf)
    assert (np.from_dlpack(buf, device="cpu") == 1).all()     # copy=None: a host copy (r80b, session 39)
    assert _exports() == 0
    assert (buf.to_numpy() == 1).all()


# == DLPack on kDLMetal ===========================================================================
def test_dlpack_round_trip_on_metal_shares_the_bytes_and_frees_every_export(mps):
    buf = accel.Buffer(1024).fill_(0)
    assert tuple(buf.__dlpack_device__()) == (8, 0)            # kDLMetal, device 0
    view = buf.as_array(np.float32, (16, 8), offset=512)
    assert tuple(view.__dlpack_device__()) == (8, 0)
    alias = accel.from_dlpack(view)
    assert alias.nbytes == 512 and alias.device == accel.device("mps", 0)
    alias.fill_(0x3F)
    got = buf.to_numpy()
    assert (got[:512] == 0).all() and (got[512:] == 0x3F).all()
    assert _exports() == 1                          # the alias holds one export
    alias.close()
    assert _exports() == 0
    assert (buf.to_numpy()[512:] == 0x3F).all()                 # the alias never owned the memory


def test_host_tensors_are_refused_by_from_dlpack_naming_the_copy(mps):
    # (a torch CPU tensor takes the same path: its __dlpack_device__ is (kDLCPU, 0) too; torch is
    # not imported here, its import alone would cost a quarter of this file's time budget)
    host = np.arange(16, dtype=np.float32)
    before = memory.memory_allocated()
    with pytest.raises(BufferError, match=r"host memory \(kDLCPU\).*copy_from"):
        accel.from_dlpack(host)
    assert memory.memory_allocated() == before and _exports() == 0
    dev = accel.Buffer(64).copy_from(np.from_dlpack(host))     # the fix the message names
    assert np.array_equal(dev.to_numpy(np.float32), np.arange(16, dtype=np.float32))


class _Producer:
    """A DLPack producer on another device type (a CUDA tensor handed to a Mac program)."""

    def __init__(self, kind):
        self.kind = kind
        self.asked = 0

    def __dlpack_device__(self):
        return (self.kind, 0)

    def __dlpack__(self, **kwargs):
        self.asked += 1
        raise AssertionError("accel must refuse before asking for the capsule")


@pytest.mark.parametrize("kind, name", [(2, "kDLCUDA"), (14, "kDLOneAPI"), (7, "kDLVulkan")])
def test_another_device_types_tensor_is_refused_before_the_capsule_is_made(mps, kind, name):
    p = _Producer(kind)
    with pytest.raises(BufferError, match=rf"{name}, not on the current accelerator \(mps, kDLMetal\)"):
        accel.from_dlpack(p)
    assert p.asked == 0 and _exports() == 0


# == threads: kernels, copies, events and the allocator at once ==================================
SAXPY = r"""
#include <metal_stdlib>
using namespace metal;
kernel void r73g_saxpy(constant float &a [[buffer(0)]], device const float *x [[buffer(1)]],
                       device float *y [[buffer(2)]], constant uint &n [[buffer(3)]],
                       uint i [[thread_position_in_grid]])
{
    if (i < n) y[i] = a * x[i] + y[i];
}
"""


def _saxpy_reference(grid, block, view, a, x, y, n):
    n = min(n, grid[0] * block[0])
    xs, ys = view(x, 4 * n, np.float32), view(y, 4 * n, np.float32)
    ys[:] = np.float32(a) * xs + ys


def test_threads_launch_copy_record_and_churn_the_allocator_at_once(mps_delayed):
    accel.sim.register_kernel("r73g_saxpy", _saxpy_reference, "f32, ptr, ptr, u32", replace=True)
    kernel = accel.Module(SAXPY).function("r73g_saxpy", signature="f32, ptr, ptr, u32")
    baseline_queues = metal.state().live_counts().get("MTLCommandQueue", 0)
    errors, n = [], 1000

    def worker(t):
        try:
            s = accel.Stream()
            x = np.full(n, t + 1, np.float32)
            for it in range(6):
                dx = accel.Buffer(x.nbytes, stream=s).copy_from(x, stream=s)
                dy = accel.Buffer(x.nbytes, stream=s).fill_(0, stream=s)
                accel.launch(kernel, (n + 255) // 256, 256, 2.0, dx, dy, n, stream=s)
                ev = accel.Event()
                ev.record(s)
                ev.synchronize()
                got = dy.to_numpy(np.float32, stream=s)
                if not (got == 2.0 * (t + 1)).all():
                    errors.append(f"thread {t} iteration {it}: {got[:4]}")
                scratch = accel.Buffer((t + 1) * 300_000, stream=s).fill_(t, stream=s)   # churn
                del dx, dy, scratch
            s.close()
        except BaseException as exc:       # reported in the main thread
            errors.append(f"thread {t}: {type(exc).__name__}: {exc}")

    def housekeeper(stop):
        try:
            while not stop.is_set():
                memory.empty_cache()
                memory.memory_stats()
                memory.get_memory_info()
        except BaseException as exc:
            errors.append(f"housekeeper: {type(exc).__name__}: {exc}")

    stop = threading.Event()
    keeper = threading.Thread(target=housekeeper, args=(stop,))
    keeper.start()
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    _join(threads)
    stop.set()
    _join([keeper])
    assert errors == []
    accel.synchronize()
    assert memory.memory_allocated() == 0
    memory.empty_cache()
    assert memory.memory_reserved() == 0
    assert metal.state().live_counts().get("MTLCommandQueue", 0) == baseline_queues
    assert metal.state().engine_errors == []


def test_streams_and_events_made_and_dropped_in_a_loop_leave_metal_as_it_was(mps):
    accel.synchronize()
    before = metal.state().live_counts()
    buf = accel.Buffer(4096)
    for i in range(150):
        s = accel.Stream()
        e = accel.Event(enable_timing=bool(i % 2))
        buf.fill_(i % 256, stream=s)
        e.record(s)
        e.wait(accel.current_stream())
    del s, e
    accel.synchronize()
    assert (buf.to_numpy() == 149).all()
    del buf
    memory.empty_cache()
    accel.synchronize()
    after = metal.state().live_counts()
    for cls in ("MTLCommandQueue", "MTLSharedEvent", "MTLBuffer", "MTLCommandBuffer"):
        assert after.get(cls, 0) <= before.get(cls, 0), (cls, before, after)


# == misuse: one Metal device, refusals that change nothing ======================================
def test_device_arguments_metal_does_not_have_are_refused_and_change_nothing(mps):
    accel.Buffer(16)
    before = (memory.memory_allocated(), memory.memory_reserved(), accel.current_device_index())
    for call in (lambda: accel.set_device_index(1), lambda: accel.Buffer(16, device="mps:1"),
                 lambda: accel.Stream(device="mps:1"), lambda: accel.default_stream(1),
                 lambda: memory.get_memory_info(1)):
        with pytest.raises(accel.InvalidDeviceError, match=r"1 mps device visible"):
            call()
    with pytest.raises(ValueError, match="cuda doesn't match the current accelerator mps"):
        accel.Buffer(16, device="cuda")
    assert (memory.memory_allocated(), memory.memory_reserved(), accel.current_device_index()) == before


# == fork after init ==============================================================================
def test_forked_child_refuses_metal_clearly_and_the_parent_keeps_working(mps):
    buf = accel.Buffer(256).fill_(5)
    s = accel.Stream()
    message = "Cannot re-initialize MPS in forked subprocess"

    def child():
        calls = [("Buffer", lambda: accel.Buffer(16)), ("to_numpy", buf.to_numpy),
                 ("fill_", lambda: buf.fill_(1)), ("synchronize", accel.synchronize),
                 ("Stream", accel.Stream), ("stream.synchronize", s.synchronize),
                 ("Event.record", lambda: accel.Event().record()),
                 ("set_per_process_memory_fraction", lambda: memory.set_per_process_memory_fraction(0.5)),
                 ("from_dlpack", lambda: accel.from_dlpack(buf)), ("get_memory_info", memory.get_memory_info)]
        bad = []
        for name, fn in calls:
            try:
                fn()
                bad.append(f"{name}: no error")
            except RuntimeError as exc:
                if message not in str(exc) or "spawn" not in str(exc):
                    bad.append(f"{name}: {exc}")
            except BaseException as exc:
                bad.append(f"{name}: {type(exc).__name__}: {exc}")
        if bad:
            print("\n".join(bad), file=sys.stderr)
            return 1
        return 0

    assert run_forked(child, timeout=30) == 0
    assert (buf.to_numpy() == 5).all()             # (filled on the default stream)
    s.close()
    assert (accel.Buffer(64).fill_(9).to_numpy() == 9).all()


# == interpreter exit with work queued ============================================================
def test_interpreter_exit_with_a_daemon_thread_still_queueing_metal_work():
    code = textwrap.dedent("""
        import threading, time, numpy as np, accel
        started = threading.Event()
        def spin():
            s = accel.Stream()
            b = accel.Buffer(1 << 16, stream=s)
            e = accel.Event()
            while True:
                b.fill_(3, stream=s)
                e.record(s)
                started.set()
                time.sleep(0.001)       # a monitoring thread's pace
        threading.Thread(target=spin, daemon=True).start()
        assert started.wait(20)
        keep = accel.Buffer(1 << 20)
        for v in range(16):
            keep.fill_(v, stream=accel.Stream())
        arr, ev = keep.to_numpy(non_blocking=True)
        print("queued", flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    env.update(ACCEL_SIM="mps", ACCEL_SIM_DELAY_US="200",
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(accel.__file__)),
                                                       env.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "queued"
    for bad in ("Traceback", "Exception ignored", "MetalValidationError", "Fatal Python error"):
        assert bad not in proc.stderr, proc.stderr
