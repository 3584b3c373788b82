"""Adversarial review (r72g) of session 32's accel changes (git diff 5528875 HEAD -- accel).

Every accel bug is a strict xfail naming the accel function; the other tests pin down what was
checked and found right.  Two simulated devices; work on device 1 while device 0 is current.
"""
import gc

import numpy as np
import pytest

import accel
from accel import sim

from conftest import SIMS, use_sim
from test_interop_audit_r72f import producer_ran_past_the_copy

MiB = 1 << 20


def _need(kind):
    if kind not in SIMS:
        pytest.skip(f"ACCEL_TEST_SIMS leaves out {kind}")


def _sim_errors() -> list:
    return list(getattr(sim.state(), "errors", []) or [])


def _settle():
    """Collect, and run the releases a collection deferred, while the simulator still runs."""
    from accel import _finalize
    gc.collect()
    for index in range(accel.device_count()):
        accel.synchronize(index)
    accel.memory.empty_cache()
    if _finalize.pending:
        _finalize.drain()
    gc.collect()


class CAI:
    """Another library's CUDA Array Interface v3 object: a fixed dict."""

    def __init__(self, cai):
        self.__cuda_array_interface__ = cai


class DL:
    """Another library's DLPack object over an accel view (what torch.from_dlpack would hold)."""

    def __init__(self, view):
        self.view = view

    def __dlpack__(self, **kw):
        return self.view.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.view.__dlpack_device__()


def _graph_output_on_device1(monkeypatch):
    """backend:cudaMallocAsync, peer-capable devices: a graph captured on device 1 (device 0
    current) allocates ``out`` (filled with 5), replayed once; no cross-device copy before."""
    _need("cuda")
    use_sim(monkeypatch, "cuda", ACCEL_SIM_PEER="all", PYTORCH_ALLOC_CONF="backend:cudaMallocAsync")
    accel.set_device_index(0)
    s = accel.Stream(1)
    g = accel.Graph()
    with s, g:
        out = accel.Buffer(MiB, device=1)
        out.fill_(5)
    with s:
        g.replay()
    s.synchronize()
    return g, s, out


# == 1. AsyncPoolAllocator.reachable_from: an interior pointer ======================================
# (r72g found; fixed in session 32)
@pytest.mark.parametrize("how", ["cai", "dlpack"])
def test_graph_allocation_interior_pointer_copied_to_the_other_device(monkeypatch, how):
    """The r72b fix, reached through an interior pointer: the CAI of a typed view at byte 4096 of
    the graph's output (what CuPy or Numba would hand over for ``out[4096:8192]``).  torch copies
    any cudaMallocAsync memory between devices with cudaMemcpyPeerAsync (ATen cuda/Copy.cu)."""
    g = s = out = None
    try:
        g, s, out = _graph_output_on_device1(monkeypatch)
        view = out.as_array(np.uint8, (4096,), offset=4096)
        source = CAI(dict(view.__cuda_array_interface__)) if how == "cai" else DL(view)
        backend = accel._lazy.lazy_init()
        direct = []
        real = backend.memcpy_async
        lo = out.ptr                # (the graph allocation's bytes: lo .. lo + MiB)

        def spy(dst, src, nbytes, stream):
            if lo <= src < lo + MiB:
                # (not run: the direct read faults with a sticky 700 that spoils the teardown)
                direct.append(src)
                raise RuntimeError("direct copy from the graph allocation")
            return real(dst, src, nbytes, stream)

        monkeypatch.setattr(backend, "memcpy_async", spy)
        on0 = accel.Buffer(4096, device=0)
        try:
            on0.copy_from(source)
        except RuntimeError:
            pass
        monkeypatch.setattr(backend, "memcpy_async", real)
        got = None if direct else set(on0.to_numpy().tolist())
        errors, current = _sim_errors(), accel.current_device_index()
        on0.close()
        del view, source
    finally:
        del g, s, out
        _settle()
        sim.reset()
    assert direct == [], "copied directly by device 0 from a graph allocation it cannot access"
    assert got == {5} and errors == [] and current == 0


def test_graph_allocation_whole_and_own_view_copied_to_the_other_device(monkeypatch):
    """Fine: the allocation's start through a CAI, and accel's own offset view (copied as its
    Buffer, whose pointer is the allocation's), both go through the staged peer copy."""
    g = s = out = None
    try:
        g, s, out = _graph_output_on_device1(monkeypatch)
        whole = accel.Buffer(4096, device=0).copy_from(
            CAI(dict(out.as_array(np.uint8, (4096,), offset=0).__cuda_array_interface__)))
        inner = accel.Buffer(MiB, device=0).copy_from(out.as_array(np.uint8, (MiB,)))
        assert set(whole.to_numpy().tolist()) == {5} and set(inner.to_numpy().tolist()) == {5}
        assert _sim_errors() == [] and accel.current_device_index() == 0
        whole.close()
        inner.close()
    finally:
        del g, s, out
        _settle()
        sim.reset()


# == 2. memory.empty_cache under backend:cudaMallocAsync before any allocator ======================
# (r72g found; fixed in session 32)
def test_empty_cache_under_cuda_malloc_async_sets_up_no_unused_device(monkeypatch):
    _need("cuda")
    use_sim(monkeypatch, "cuda", PYTORCH_ALLOC_CONF="backend:cudaMallocAsync")
    accel.current_stream(0)                     # initialized; no allocator yet
    assert not sim.state().primary_contexts[1]
    accel.memory.empty_cache()
    assert accel.current_device_index() == 0
    assert 1 not in accel.memory._allocators
    assert not sim.state().primary_contexts[1]


def test_empty_cache_under_cuda_malloc_async_after_an_allocation_on_device0(monkeypatch):
    """Fine: once device 0's allocator exists (the options read), device 1 is left alone."""
    _need("cuda")
    use_sim(monkeypatch, "cuda", PYTORCH_ALLOC_CONF="backend:cudaMallocAsync")
    b = accel.Buffer(256, device=0)
    accel.memory.empty_cache()
    assert 1 not in accel.memory._allocators and not sim.state().primary_contexts[1]
    b.close()


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "per_process_memory_fraction:0.5"])
def test_empty_cache_caching_allocator_of_unused_device_touches_nothing(monkeypatch, conf):
    """Fine: the native allocator of device 1, made by empty_cache, creates no context there and
    leaves device 0 current; it counts num_sync_all_streams as torch's does."""
    _need("cuda")
    use_sim(monkeypatch, "cuda", PYTORCH_ALLOC_CONF=conf)
    accel.current_stream(0)
    accel.memory.empty_cache()
    assert accel.current_device_index() == 0
    assert not sim.state().primary_contexts[1]
    assert accel.memory.memory_stats(1)["num_sync_all_streams"] == 1


# == 3. CAI consumer ordering across devices (order_producer_after) ================================
def test_cai_non_blocking_copy_from_device1_orders_device1_producer_after_it(monkeypatch):
    """Fine: data and producer stream on device 1, the copy on a stream of device 0 (held): the
    producer's next write waits for the copy (the event is recorded on device 0's stream with
    device 0 current and waited for by device 1's stream), device 0 stays current."""
    _need("cuda")
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=50, ACCEL_SIM_PEER="all")
    accel.set_device_index(0)
    producer, consumer = accel.Stream(1), accel.Stream(0)
    src = accel.Buffer(256, device=1, stream=producer).fill_(1, stream=producer)
    dst = accel.Buffer(256, device=0, stream=consumer).fill_(0, stream=consumer)
    producer.synchronize()
    consumer.synchronize()
    cai = {"shape": (256,), "typestr": "|u1", "data": (src.ptr, False), "version": 3, "strides": None,
           "stream": np.uint64(producer.handle)}
    overwritten_first = producer_ran_past_the_copy(
        lambda: dst.copy_from(CAI(cai), stream=consumer, non_blocking=True), src, producer, consumer)
    assert accel.current_device_index() == 0
    assert not overwritten_first
    assert set(dst.to_numpy().tolist()) == {1}


# == 4. Buffer.fill_ on another device's stream (Stream._current_scope) ============================
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_fill_on_device1_stream_inside_a_capture_from_device0(monkeypatch, kind):
    """Fine: the fill switches to device 1 for the memset and back; the capture stays valid and
    the replay writes the bytes."""
    _need(kind)
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    s = accel.Stream(1)
    b = accel.Buffer(4096, device=1, stream=s).fill_(0, stream=s)
    s.synchronize()
    g = accel.Graph()
    with s, g:                  # (the stream's context makes device 1 current, as torch's)
        accel.set_device_index(0)   # the user's device 0 current inside the capture
        b.fill_(7, stream=s)
        assert accel.current_device_index() == 0
    assert accel.current_device_index() == 0
    assert set(b.to_numpy().tolist()) == {0}
    with s:
        g.replay()
    s.synchronize()
    assert set(b.to_numpy().tolist()) == {7} and accel.current_device_index() == 0
    del g
    gc.collect()



# == 5. CAI consumer inside a capture (wait_for_producer / _order_with_producer) ===================
# (r72g found; fixed in session 34)
def test_cai_copy_inside_a_capture_with_an_outside_producer_stream_leaves_the_capture_valid(monkeypatch):
    _need("cuda")
    use_sim(monkeypatch, "cuda")
    accel.set_device_index(0)
    producer, s = accel.Stream(1), accel.Stream(1)
    src = accel.Buffer(256, device=1, stream=producer).fill_(1, stream=producer)
    dst = accel.Buffer(256, device=1, stream=s).fill_(0, stream=s)
    producer.synchronize()
    s.synchronize()
    cai = {"shape": (256,), "typestr": "|u1", "data": (src.ptr, False), "version": 3, "strides": None,
           "stream": producer.handle}
    g = accel.Graph()
    refused = None
    with s, g:
        try:
            dst.copy_from(CAI(cai), stream=s, non_blocking=True)
        except accel.CaptureError as exc:
            refused = str(exc)
        dst.fill_(4, stream=s)          # the capture goes on (as accel's own refusals promise)
    assert refused is not None and "libcudart" not in refused, refused
    with s:
        g.replay()
    s.synchronize()
    assert set(dst.to_numpy().tolist()) == {4} and accel.current_device_index() == 0
    del g
    gc.collect()


# == 6. __cuda_array_interface__ waiting for another device's open stream (wait_for_stream) ========
# (r72g found; fixed in session 32)
def test_cai_of_buffer_last_used_on_device1_during_a_relaxed_capture_on_device0(monkeypatch):
    _need("cuda")
    use_sim(monkeypatch, "cuda")
    accel.set_device_index(0)
    s1 = accel.Stream(1)
    b = accel.Buffer(256, device=0).fill_(3)
    t = accel.Buffer(256, device=1, stream=s1)
    t.copy_from(b, stream=s1)               # b's last use: a stream of device 1
    s0 = accel.Stream(0)
    x = accel.Buffer(256, device=0, stream=s0)
    g = accel.Graph(capture_error_mode="relaxed")
    got = None
    with s0, g:
        x.fill_(1)
        s1.synchronize()                    # allowed in a relaxed capture: the capture goes on
        try:
            got = b.__cuda_array_interface__["stream"]
        except accel.CaptureError as exc:
            got = str(exc)
    assert accel.current_device_index() == 0
    assert isinstance(got, int), got
    del g
    gc.collect()


# == 7. Ctrl-C as the non-blocking CAI copy returns (Buffer._copy_from_foreign) ====================
# (r72g found; fixed in session 32)
def test_cai_non_blocking_copy_interrupted_as_queued_still_orders_the_producer(monkeypatch):
    _need("cuda")
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=50)
    accel.set_device_index(0)
    index = 1
    producer, consumer = accel.Stream(index), accel.Stream(index)
    src = accel.Buffer(256, device=index, stream=producer).fill_(1, stream=producer)
    dst = accel.Buffer(256, device=index, stream=consumer).fill_(0, stream=consumer)
    producer.synchronize()
    consumer.synchronize()
    cai = {"shape": (256,), "typestr": "|u1", "data": (src.ptr, False), "version": 3, "strides": None,
           "stream": producer.handle}
    backend = accel._lazy.lazy_init()
    real = backend.memcpy_async

    def interrupted(*args):
        real(*args)
        raise KeyboardInterrupt     # (a Ctrl-C as the C call returns: the copy is queued)

    def queue_copy():
        monkeypatch.setattr(backend, "memcpy_async", interrupted)
        with pytest.raises(KeyboardInterrupt):
            dst.copy_from(CAI(cai), stream=consumer, non_blocking=True)
        monkeypatch.setattr(backend, "memcpy_async", real)

    overwritten_first = producer_ran_past_the_copy(queue_copy, src, producer, consumer)
    assert accel.current_device_index() == 0
    assert not overwritten_first, "the producer's stream ran past the consumer's pending copy"
    assert set(dst.to_numpy().tolist()) == {1}


# == 8. order_producer_after keeps no state =========================================================
def test_many_non_blocking_cai_copies_leave_no_events(monkeypatch):
    """Fine: each handshake's event is destroyed (the simulator's live event count returns)."""
    _need("cuda")
    use_sim(monkeypatch, "cuda")
    accel.set_device_index(0)
    producer, consumer = accel.Stream(1), accel.Stream(0)
    src = accel.Buffer(64, device=1, stream=producer).fill_(2, stream=producer)
    dst = accel.Buffer(64, device=0, stream=consumer)
    cai = {"shape": (64,), "typestr": "|u1", "data": (src.ptr, False), "version": 3, "strides": None,
           "stream": producer.handle}
    dst.copy_from(CAI(cai), stream=consumer, non_blocking=True)
    consumer.synchronize()
    gc.collect()
    before = sim.state().events
    for _ in range(100):
        dst.copy_from(CAI(cai), stream=consumer, non_blocking=True)
    consumer.synchronize()
    producer.synchronize()
    gc.collect()
    assert sim.state().events == before
    assert set(dst.to_numpy().tolist()) == {2} and accel.current_device_index() == 0


# == 9. ArrayView CAI descr with padding (_array._cai_dtype) =======================================
# (r72g found; fixed in session 32)
def test_view_copy_from_cai_of_an_aligned_structure_with_padding(monkeypatch):
    """NumPy array interface, descr: ``dtype.descr`` gives unnamed void entries for the padding
    of an aligned structure; numpy.lib.format.descr_to_dtype reads them back as the same dtype."""
    _need("cuda")
    use_sim(monkeypatch, "cuda")
    from numpy.lib.format import descr_to_dtype
    dt = np.dtype([("a", "u1"), ("b", "<f4")], align=True)
    assert dt.descr[1] == ("", "|V3") and descr_to_dtype(dt.descr) == dt
    host = np.zeros(4, dt)
    host["a"], host["b"] = 3, 1.5
    a = accel.Buffer(32, device=1).as_array(dt, (4,))
    a.copy_from(host)
    b = accel.Buffer(32, device=1).as_array(dt, (4,))
    b.copy_from(CAI(dict(a.__cuda_array_interface__)))
    out = b.to_numpy()
    assert out.tobytes() == host.tobytes() or (out["a"] == 3).all() and (out["b"] == 1.5).all()
    assert accel.current_device_index() == 0
