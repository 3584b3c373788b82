"""r75g review: (1) _exp_quiesce synchronizes only the streams owning the free pieces it unmaps
(3fbe24f), the whole device where accel cannot vouch for a handle (streams.announced); (2) on Metal
each caching allocator's OOM retry releases the other's cache (_release_unified).
"""

import gc
import sys
import threading
import time

import numpy as np
import pytest

import accel
from accel import memory
from accel import streams as _streams

from conftest import SIMS, use_sim
from torch_port_util import hold

DEV = 1          # the data's device; accel's current device stays 0
MiB = 1 << 20


# == helpers: what a foreign library linked to libcudart does ======================================
def _rt():
    return accel._lazy.lazy_init()


def _s(handle):
    return _rt().ffi.cast("cudaStream_t", handle)


def _ok(rc, call):
    assert rc == 0, f"{call} returned {rc}"


def raw_stream_create(device):
    be = _rt()
    with _streams.on_device(be, device):
        p = be.ffi.new("cudaStream_t *")
        _ok(be.lib.cudaStreamCreateWithFlags(p, 1), "cudaStreamCreateWithFlags")
    return int(be.ffi.cast("uintptr_t", p[0]))


def raw_stream_destroy(handle):
    _ok(_rt().lib.cudaStreamDestroy(_s(handle)), "cudaStreamDestroy")


def raw_hold(handle):
    from accel.sim import cudart
    gate = threading.Event()
    cudart._R.streams[handle].q.submit(lambda: gate.wait(10))
    return gate


def raw_memset(ptr, value, nbytes, handle, device=DEV):
    with _streams.on_device(_rt(), device):
        _ok(_rt().lib.cudaMemsetAsync(_rt().ffi.cast("void *", ptr), value, nbytes, _s(handle)), "cudaMemsetAsync")


def _release_when_blocked(gate, ident, done):
    """Set ``gate`` once thread ``ident`` blocks in a simulated host wait (or ``done`` is set)."""
    def run():
        while not done.is_set() and not gate.is_set():
            f = sys._current_frames().get(ident)
            while f is not None:
                if f.f_code.co_name == "_wait_locked" and f.f_code.co_filename.endswith("_engine.py"):
                    gate.set()
                    return
                f = f.f_back
            time.sleep(0.001)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.fixture
def cuda_exp(monkeypatch):
    if "cuda" not in SIMS:
        pytest.skip("ACCEL_TEST_SIMS leaves out cuda")
    for name in ("ACCEL_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.setenv(name, "expandable_segments:True")
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=50)
    accel.set_device_index(0)
    be = accel._lazy.lazy_init()
    yield be
    # leave no sticky error behind for the next test
    use_sim(monkeypatch, "cuda")


def _unmap_while_gated(gate, fn):
    """Run ``fn`` (which unmaps free pieces); the gated work is let through once this thread
    waits on the host (a correct quiesce), else after ``fn`` returned."""
    done = threading.Event()
    helper = _release_when_blocked(gate, threading.get_ident(), done)
    try:
        fn()
        waited = gate.is_set()
    finally:
        done.set()
        gate.set()
        helper.join()
    return waited


def _device_ok(device):
    try:
        accel.synchronize(device)
    except accel.AcceleratorError as exc:
        return f"{exc}"
    return None


# == 1. _exp_quiesce ==============================================================================
@pytest.mark.filterwarnings("ignore:could not make device")
# (r75g found; fixed in session 36)
def test_recycled_raw_handle_still_waits_for_the_destroyed_stream_s_work(cuda_exp):
    alloc = memory.device_allocator(DEV)
    raw = raw_stream_create(DEV)
    n = 2 * MiB
    ptr = alloc.malloc(n, stream=raw)
    gate = raw_hold(raw)
    raw_memset(ptr, 7, n, raw)                 # the foreign library's work, queued behind the gate
    alloc.free(ptr)                            # back to raw's free list, its work pending
    raw_stream_destroy(raw)                    # unannounced: the work still runs (cudaStreamDestroy)
    mine = accel.Stream(DEV)                   # the driver hands the value on
    assert mine.handle == raw
    before = memory.memory_reserved(DEV)
    waited = _unmap_while_gated(gate, alloc.empty_cache)
    assert memory.memory_reserved(DEV) < before          # the free page was unmapped
    err = _device_ok(DEV)
    assert waited and err is None, f"unmapped under queued work (waited={waited}): {err}"


def test_raw_handle_destroyed_unannounced_waits_for_the_whole_device(cuda_exp):
    """The fallback itself: the raw stream gone and its value not handed on, the unmap waits
    for the device (the destroyed stream's queued memset runs on mapped memory)."""
    alloc = memory.device_allocator(DEV)
    raw = raw_stream_create(DEV)
    n = 2 * MiB
    ptr = alloc.malloc(n, stream=raw)
    gate = raw_hold(raw)
    raw_memset(ptr, 7, n, raw)
    alloc.free(ptr)
    raw_stream_destroy(raw)
    waited = _unmap_while_gated(gate, alloc.empty_cache)
    assert memory.memory_reserved(DEV) == 0
    assert waited and _device_ok(DEV) is None


def test_live_raw_handle_is_synchronized_not_skipped(cuda_exp):
    """A raw int stream given to the allocator (caching_allocator_alloc's), still alive: its
    queued work is waited for before the unmap (whole device or the stream, either is safe)."""
    alloc = memory.device_allocator(DEV)
    raw = raw_stream_create(DEV)
    n = 4 * MiB
    ptr = alloc.malloc(n, stream=raw)
    gate = raw_hold(raw)
    raw_memset(ptr, 1, n, raw)
    alloc.free(ptr)
    waited = _unmap_while_gated(gate, alloc.empty_cache)
    assert waited and _device_ok(DEV) is None
    raw_stream_destroy(raw)


def test_block_used_on_a_held_stream_via_record_stream_is_not_unmapped_early(cuda_exp):
    """Allocated on A, used on B (record_stream, B held), freed: an allocation on C that would
    pass the high-water mark and the empty_cache after it must not unmap it under B's fill."""
    a, b, c = accel.Stream(DEV), accel.Stream(DEV), accel.Stream(DEV)
    big = accel.Buffer(4 * MiB, device=DEV, stream=a)
    accel.synchronize(DEV)
    gate = hold(b)
    big.fill_(9, stream=b)
    big.record_stream(b)
    big.close()
    alloc = memory.device_allocator(DEV)

    def work():
        accel.Buffer(4 * MiB, device=DEV, stream=c).close()
        alloc.empty_cache()
    waited = _unmap_while_gated(gate, work)
    assert waited and _device_ok(DEV) is None


def test_closed_stream_with_free_blocks_and_recycled_handle(cuda_exp):
    """An accel Stream closed with its work held and a free block on it; its handle goes to a
    new Stream; an unmap pass (release-before-grow on another stream, then empty_cache) must
    not unmap the block before the closed stream's fill ran."""
    a = accel.Stream(DEV)
    handle = a.handle
    buf = accel.Buffer(4 * MiB, device=DEV, stream=a)
    gate = hold(a)
    buf.fill_(5, stream=a)
    buf.close()
    a.close()
    fresh = accel.Stream(DEV)
    assert fresh.handle == handle
    alloc = memory.device_allocator(DEV)

    def work():
        accel.Buffer(4 * MiB, device=DEV, stream=fresh).fill_(1, stream=fresh).close()
        alloc.empty_cache()
    waited = _unmap_while_gated(gate, work)
    assert waited and _device_ok(DEV) is None
    assert memory.memory_reserved(DEV) == 0 or _device_ok(DEV) is None


def test_foreign_wrapper_dropped_with_held_work(cuda_exp):
    """A foreign stream wrapped (Stream.from_handle), a block allocated and freed on it with its
    work held, the wrapper dropped (its lists wait, then join the default stream's): an unmap
    pass must not run ahead of the foreign work."""
    raw = raw_stream_create(DEV)
    ext = accel.Stream.from_handle(raw, device=DEV)
    buf = accel.Buffer(4 * MiB, device=DEV, stream=ext)
    gate = raw_hold(raw)
    buf.fill_(3, stream=ext)
    buf.close()
    del ext
    gc.collect()
    alloc = memory.device_allocator(DEV)

    def work():
        accel.Buffer(8 * MiB, device=DEV).close()        # the default stream: may pass the mark
        alloc.empty_cache()
    try:
        waited = _unmap_while_gated(gate, work)
        assert waited and _device_ok(DEV) is None
    finally:
        raw_stream_destroy(raw)


def test_legacy_default_stream_block_on_the_non_current_device(cuda_exp):
    """A block of device 1's default (legacy) stream freed with its fill held, device 0 current:
    release-before-grow for stream C and empty_cache wait for the fill before unmapping."""
    assert accel.current_device_index() == 0
    buf = accel.Buffer(4 * MiB, device=DEV)
    gate = hold(accel.default_stream(DEV))
    buf.fill_(6)
    buf.close()
    c = accel.Stream(DEV)
    alloc = memory.device_allocator(DEV)

    def work():
        accel.Buffer(4 * MiB, device=DEV, stream=c).close()
        alloc.empty_cache()
    waited = _unmap_while_gated(gate, work)
    assert waited and _device_ok(DEV) is None
    assert accel.current_device_index() == 0


def test_capture_on_another_stream_while_an_allocation_passes_the_mark(cuda_exp):
    """A capture underway on device 1 (relaxed mode, so another stream may allocate) while a
    free page of stream A is mapped: an allocation on stream C neither unmaps (E6) nor breaks
    the capture, and A's free page stays usable after."""
    a, c, cap = accel.Stream(DEV), accel.Stream(DEV), accel.Stream(DEV)
    accel.Buffer(4 * MiB, device=DEV, stream=a).fill_(5, stream=a).close()
    accel.synchronize(DEV)
    reserved = memory.memory_reserved(DEV)
    g = accel.Graph(capture_error_mode="relaxed")
    with accel.graph(g, stream=cap):
        inside = accel.Buffer(1 * MiB, device=DEV, stream=cap).fill_(2, stream=cap)
        other = accel.Buffer(4 * MiB, device=DEV, stream=c)
        assert memory.memory_reserved(DEV) >= reserved      # nothing unmapped meanwhile
    g.replay()
    other.fill_(1, stream=c)
    accel.synchronize(DEV)
    assert (inside.to_numpy()[::4096] == 2).all()
    del inside, other, g
    memory.device_allocator(DEV).empty_cache()
    assert _device_ok(DEV) is None


# == 2. Metal: each allocator's OOM retry releases the other's cache ==============================
@pytest.fixture
def mps_small(monkeypatch):
    if "mps" not in SIMS:
        pytest.skip("ACCEL_TEST_SIMS leaves out mps")
    use_sim(monkeypatch, "mps", ACCEL_SIM_MEMORY="64M", ACCEL_SIM_DELAY_US="300")
    return accel._lazy.lazy_init()


def mps_hold(be, stream):
    """An operation on ``stream``'s simulated MTLCommandQueue that runs until the gate is set."""
    from accel.sim import metal
    st = be._streams[stream.handle]
    import cffi
    addr = int(cffi.FFI().cast("uintptr_t", st.queue))
    gate = threading.Event()
    metal.state().objects[addr].q.submit(lambda: gate.wait(10))
    return gate


def test_device_retry_keeps_a_pinned_block_queued_work_still_uses(mps_small):
    be = mps_small
    s = accel.Stream()
    dev = accel.Buffer(16 * MiB).fill_(7)
    accel.synchronize()
    pinned = accel.empty_pinned(16 * MiB, np.uint8)
    gate = mps_hold(be, s)
    try:
        dev.copy_to(pinned, stream=s, non_blocking=True)    # writes the pinned block, held
        view = pinned[::MiB]
        del pinned
        host = memory.host_allocator().stats()["reserved_bytes"]
        with pytest.raises(accel.OutOfMemoryError):
            accel.Buffer(40 * MiB)                           # retry: the pinned block is still in use
        assert memory.host_allocator().stats()["reserved_bytes"] == host
    finally:
        gate.set()
        s.synchronize()
    assert (view == 7).all()
    del view
    gc.collect()
    accel.synchronize()     # (in some whole-suite orders the block was not back without it: not understood)
    assert accel.Buffer(40 * MiB).nbytes == 40 * MiB         # now it goes


def test_pinned_retry_keeps_a_device_block_queued_work_still_uses(mps_small):
    """The device block freed after record_stream on a held stream stays (pending), so the pinned
    OOM propagates; both stats stay consistent with the snapshots."""
    be = mps_small
    s = accel.Stream()
    act = accel.Buffer(40 * MiB)
    gate = mps_hold(be, s)
    try:
        act.fill_(1, stream=s)
        act.record_stream(s)
        del act
        reserved = memory.memory_reserved()
        with pytest.raises(accel.OutOfMemoryError):
            accel.empty_pinned(32 * MiB, np.uint8)
        assert memory.memory_reserved() == reserved
    finally:
        gate.set()
        s.synchronize()
    assert accel.empty_pinned(32 * MiB, np.uint8).nbytes == 32 * MiB
    stats = memory.memory_stats()
    assert stats["reserved_bytes.all.current"] == memory.memory_reserved() == 0


def test_both_allocators_ooming_at_once_do_not_deadlock(mps_small):
    """Two threads: one's device request and the other's pinned request each need the other's
    cache; with each holding its own lock and calling into the other's, neither may wait.
    Each either succeeds or raises OutOfMemoryError; the counters agree afterwards."""
    for _ in range(5):
        staged = accel.empty_pinned(24 * MiB, np.uint8)
        act = accel.Buffer(24 * MiB)
        del staged, act
        results = {}
        start = threading.Barrier(2)

        def dev():
            start.wait(5)
            try:
                results["dev"] = accel.Buffer(36 * MiB)
            except accel.OutOfMemoryError as exc:
                results["dev"] = exc

        def pin():
            start.wait(5)
            try:
                results["pin"] = accel.empty_pinned(36 * MiB, np.uint8)
            except accel.OutOfMemoryError as exc:
                results["pin"] = exc
        ts = [threading.Thread(target=dev, daemon=True), threading.Thread(target=pin, daemon=True)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(10)
        assert not any(t.is_alive() for t in ts), "deadlock"
        assert set(results) == {"dev", "pin"}
        ok = [k for k, v in results.items() if not isinstance(v, Exception)]
        assert len(ok) <= 1 or False, results                 # 72 MiB of 64 cannot both fit
        stats = memory.memory_stats()
        live = results["dev"].nbytes if "dev" in ok else 0
        assert stats["allocated_bytes.all.current"] == memory.memory_allocated() == live
        assert stats["reserved_bytes.all.current"] == memory.memory_reserved()
        host = memory.host_memory_stats()
        assert host["allocations.current"] == (1 if "pin" in ok else 0)
        results.clear()
        memory.empty_cache()
        memory.empty_host_cache()
    # and with both caches gone, each request alone fits
    assert accel.Buffer(36 * MiB).nbytes == 36 * MiB
