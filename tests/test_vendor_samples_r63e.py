"""Vendor sample programs for Metal and Level Zero / SYCL translated into accel's API (r63e).

Each program keeps the order of operations of its source:

* Apple, "Performing Calculations on a GPU" (MetalComputeBasic, ``MetalAdder``: ``add_arrays``,
  random inputs written by the CPU, one command buffer, ``waitUntilCompleted``, ``verifyResults``);
* Apple, "Synchronizing CPU and GPU Work" (``AAPLRenderer``: ``MaxFramesInFlight = 3``, a dispatch
  semaphore waited before the CPU writes the frame's buffer and signalled by the command buffer's
  completed handler);
* Apple, "Synchronizing Events Within a Single Device" / "... Between a GPU and the CPU"
  (``encodeSignalEvent:value:`` on one queue, ``encodeWaitForEvent:value:`` on another, a CPU
  listener notified at a value);
* Apple, "Implementing a Multistage Image Filter Using Heaps and Events" (``MTLHeap``
  sub-allocation, aliasable buffers reused within the heap);
* PyTorch's ``torch.mps`` docs and tests (``synchronize``, ``empty_cache``,
  ``current_allocated_memory``, ``driver_allocated_memory``, ``recommended_max_memory``,
  ``set_per_process_memory_fraction``, ``torch.mps.Event(enable_timing=True).elapsed_time``);
* oneAPI SYCL / Level Zero (in-order queues, ``depends_on`` events between two queues, USM
  ``malloc_host``/``malloc_device`` memcpy chains across devices, the all-devices loop).

Where a sample runs on one device, the translation runs on device 1 while device 0 is current
and on device 0 (Metal: one device).  Every program ends with r63b's checks: results byte for
byte, ``memory_stats`` balanced and back to zero after ``empty_cache``, the simulator's live
handles back at the baseline, no accel object left, current device and streams unchanged.

Where accel has no counterpart (a CPU-set ``signaledValue``, completed handlers, ``MTLHeap``
sizes) a comment says what is used instead.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest

import accel
from accel import memory
from conftest import SIMS
from test_cuda_samples_r63b import _cases, _check_end, _devices, _ids, _start, module_maker
from test_pressure_programs_r62l import _accel_objects

pytestmark = pytest.mark.usefixtures("frozen_module_heap")

MiB = 1 << 20

# -- the samples' kernels ---------------------------------------------------------------------------
CUDA_SRC = r"""
extern "C" __global__ void add_arrays(const float *inA, const float *inB, float *result) {
    unsigned int index = blockIdx.x * blockDim.x + threadIdx.x;
    result[index] = inA[index] + inB[index];
}
extern "C" __global__ void render_frame(const float *src, float *dst, float frame, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i] * 2.0f + frame;
}
extern "C" __global__ void consume(const float *src, float *dst, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i] + 1.0f;
}
"""

# MetalComputeBasic's add.metal, and two kernels written the same way
MSL_SRC = """
#include <metal_stdlib>
using namespace metal;
kernel void add_arrays(device const float* inA [[buffer(0)]], device const float* inB [[buffer(1)]],
                       device float* result [[buffer(2)]], uint index [[thread_position_in_grid]])
{ result[index] = inA[index] + inB[index]; }
kernel void render_frame(device const float *src [[buffer(0)]], device float *dst [[buffer(1)]],
                         constant float &frame [[buffer(2)]], constant uint &n [[buffer(3)]],
                         uint i [[thread_position_in_grid]])
{ if (i < n) dst[i] = src[i] * 2.0f + frame; }
kernel void consume(device const float *src [[buffer(0)]], device float *dst [[buffer(1)]],
                    constant uint &n [[buffer(2)]], uint i [[thread_position_in_grid]])
{ if (i < n) dst[i] = src[i] + 1.0f; }
"""

SIGS = {"add_arrays": "ptr, ptr, ptr", "render_frame": "ptr, ptr, f32, u32", "consume": "ptr, ptr, u32"}


def _threads(grid, block) -> int:
    return grid[0] * grid[1] * grid[2] * block[0] * block[1] * block[2]


def _add_arrays(grid, block, view, a, b, r):
    n = _threads(grid, block)
    view(r, 4 * n, np.float32)[:] = view(a, 4 * n, np.float32) + view(b, 4 * n, np.float32)


def _render_frame(grid, block, view, src, dst, frame, n):
    n = min(n, _threads(grid, block))
    view(dst, 4 * n, np.float32)[:] = view(src, 4 * n, np.float32) * np.float32(2) + np.float32(frame)


def _consume(grid, block, view, src, dst, n):
    n = min(n, _threads(grid, block))
    view(dst, 4 * n, np.float32)[:] = view(src, 4 * n, np.float32) + np.float32(1)


REFS = {"add_arrays": _add_arrays, "render_frame": _render_frame, "consume": _consume}


@pytest.fixture
def kernels():
    """``make(dev) -> (Module, {name: Kernel})`` for the current simulator."""
    yield from module_maker(REFS, SIGS, CUDA_SRC, MSL_SRC, "vendor.cu")


def _grid(n: int, block: int = 256):
    return (n + block - 1) // block, block


# -- 1. MetalComputeBasic: MetalAdder ---------------------------------------------------------------
@pytest.mark.parametrize("case", _cases(SIMS), ids=_ids)
def test_metal_compute_basic_add_arrays(monkeypatch, kernels, case):
    """MetalAdder: initWithDevice (library, add_arrays function, pipeline, command queue);
    prepareData (three buffers, ``generateRandomFloatData`` into A and B through ``contents``);
    sendComputeCommand (command buffer, encoder, ``dispatchThreads`` with a threadgroup of
    ``min(maxTotalThreadsPerThreadgroup, arrayLength)``, commit, ``waitUntilCompleted``);
    verifyResults (``result[i] == a[i] + b[i]``, here byte for byte).  The sample's
    ``arrayLength`` is 1 << 24; 1 << 18 here keeps the test fast."""
    kind, dev = case
    base = _start(monkeypatch, kind, ACCEL_SIM_DELAY_US=200)
    mod, k = kernels(dev)                                         # newDefaultLibrary, newFunction, PSO
    command_queue = accel.Stream(dev)                             # newCommandQueue
    array_length = 1 << 18
    buffer_size = 4 * array_length
    buf_a = accel.Buffer(buffer_size, device=dev)                 # newBufferWithLength (shared)
    buf_b = accel.Buffer(buffer_size, device=dev)
    buf_result = accel.Buffer(buffer_size, device=dev)
    rng = np.random.default_rng(63)
    a = (rng.integers(0, 1 << 31, array_length) / np.float32(1 << 31)).astype(np.float32)  # rand()/RAND_MAX
    b = (rng.integers(0, 1 << 31, array_length) / np.float32(1 << 31)).astype(np.float32)
    buf_a.copy_from(a)                                            # the CPU writes contents
    buf_b.copy_from(b)
    threads = min(1024, array_length)                             # maxTotalThreadsPerThreadgroup
    accel.launch(k["add_arrays"], array_length // threads, threads, buf_a, buf_b, buf_result,
                 stream=command_queue)                            # encode, endEncoding, commit
    command_queue.synchronize()                                   # waitUntilCompleted
    assert accel.current_device_index() == 0
    result = buf_result.to_numpy(np.float32, stream=command_queue)
    assert result.tobytes() == (a + b).tobytes()                  # verifyResults
    for buf in (buf_a, buf_b, buf_result):
        buf.close()
    command_queue.close()
    del k, mod, command_queue, buf_a, buf_b, buf_result, buf
    _check_end(base, "MetalAdder")


# -- 2. Synchronizing CPU and GPU Work: three frames in flight -------------------------------------
@pytest.mark.parametrize("case", _cases(SIMS), ids=_ids)
def test_triple_buffering_with_a_semaphore_of_three_frames(monkeypatch, kernels, case):
    """AAPLRenderer: ``MaxFramesInFlight = 3`` shared buffers and a semaphore of 3.  Each frame:
    wait on the semaphore, advance ``_currentBuffer``, the CPU writes that frame's vertex data
    (``updateState``), the GPU renders from it, a completed handler signals the semaphore, commit.

    accel has no completed handlers: a host thread synchronizes each frame's event in commit
    order, checks the frame's output (the readback the handler would see) and signals.  The
    shared buffer the CPU writes is a pinned array uploaded with a non-blocking copy: the
    semaphore is what keeps the CPU from rewriting it while that copy may still read it."""
    kind, dev = case
    base = _start(monkeypatch, kind, ACCEL_SIM_DELAY_US=1500)
    mod, k = kernels(dev)
    frames_in_flight, n_frames, n = 3, 10, 4096
    in_flight = threading.Semaphore(frames_in_flight)            # dispatch_semaphore_create(3)
    queue_ = accel.Stream(dev)                                    # the view's command queue
    vertex = [accel.empty_pinned(n, np.float32) for _ in range(frames_in_flight)]
    readback = [accel.empty_pinned(n, np.float32) for _ in range(frames_in_flight)]
    gpu_in = [accel.Buffer(4 * n, device=dev) for _ in range(frames_in_flight)]
    gpu_out = [accel.Buffer(4 * n, device=dev) for _ in range(frames_in_flight)]
    done = [accel.Event(dev) for _ in range(frames_in_flight)]
    handlers: "queue.Queue" = queue.Queue()
    seen, errors = [], []

    def vertices(frame):
        return (np.arange(n, dtype=np.float32) + np.float32(frame * 0.5)).astype(np.float32)

    def completed_handlers():                                     # addCompletedHandler, in order
        while True:
            item = handlers.get()
            if item is None:
                return
            frame, slot = item
            try:
                done[slot].synchronize()
                want = vertices(frame) * np.float32(2) + np.float32(frame)
                if readback[slot].tobytes() != want.tobytes():
                    errors.append(frame)
                seen.append(frame)
            except BaseException as exc:                          # noqa: BLE001 (reported below)
                errors.append(exc)
            finally:
                in_flight.release()                               # dispatch_semaphore_signal

    worker = threading.Thread(target=completed_handlers)
    worker.start()
    current = 0
    try:
        for frame in range(n_frames):                             # drawInMTKView
            in_flight.acquire()                                   # dispatch_semaphore_wait
            current = (current + 1) % frames_in_flight
            vertex[current][:] = vertices(frame)                  # updateState: CPU writes contents
            gpu_in[current].copy_from(vertex[current], stream=queue_, non_blocking=True)
            grid, block = _grid(n)
            accel.launch(k["render_frame"], grid, block, gpu_in[current], gpu_out[current],
                         float(frame), n, stream=queue_)
            gpu_out[current].copy_to(readback[current], stream=queue_, non_blocking=True)
            done[current].record(queue_)                          # commit
            handlers.put((frame, current))
    finally:
        handlers.put(None)
        worker.join()
    assert errors == [] and seen == list(range(n_frames))
    for _ in range(frames_in_flight):                             # every frame has completed
        assert in_flight.acquire(blocking=False)
    assert accel.current_device_index() == 0
    assert accel.current_stream(0) == accel.default_stream(0)
    for buf in gpu_in + gpu_out:
        buf.close()
    for ev in done:
        ev.close()
    queue_.close()
    del vertex, readback, gpu_in, gpu_out, done, queue_, k, mod, buf, ev, worker
    _check_end(base, "triple buffering")


# -- 3. Synchronizing events within a device / with the CPU ----------------------------------------
@pytest.mark.parametrize("case", _cases(SIMS), ids=_ids)
def test_shared_event_producer_consumer(monkeypatch, kernels, case):
    """"Synchronizing Events Within a Single Device": commandBuffer0 on queue 0 produces and
    ``encodeSignalEvent:event value:i``; commandBuffer1 on queue 1 ``encodeWaitForEvent:event
    value:i`` and consumes; one event signalled with a growing value, once per chunk.  "Between a
    GPU and the CPU": a listener notified when the value is reached reads the consumer's output
    (here a host thread that synchronizes the consumer's event).  The CPU's own
    ``setSignaledValue:`` has no accel counterpart (events are recorded by streams only)."""
    kind, dev = case
    base = _start(monkeypatch, kind, ACCEL_SIM_DELAY_US=800)
    mod, k = kernels(dev)
    q0, q1 = accel.Stream(dev), accel.Stream(dev)                 # two command queues
    chunks, n = 6, 2048
    produced = accel.Event(dev)                                   # newSharedEvent
    consumed = accel.Event(dev)
    src = accel.Buffer(4 * n * chunks, device=dev)
    mid = accel.Buffer(4 * n * chunks, device=dev)
    out = accel.Buffer(4 * n * chunks, device=dev)
    host = accel.empty_pinned(n * chunks, np.float32)
    data = np.arange(n * chunks, dtype=np.float32) * np.float32(0.25)
    src.copy_from(data)
    views_src = [src.as_array(np.float32, (n,), offset=4 * n * i) for i in range(chunks)]
    views_mid = [mid.as_array(np.float32, (n,), offset=4 * n * i) for i in range(chunks)]
    views_out = [out.as_array(np.float32, (n,), offset=4 * n * i) for i in range(chunks)]
    listened = []
    grid, block = _grid(n)
    for i in range(chunks):
        accel.launch(k["consume"], grid, block, views_src[i], views_mid[i], n, stream=q0)   # produce
        produced.record(q0)                                       # encodeSignalEvent value:i+1
        produced.wait(q1)                                         # encodeWaitForEvent value:i+1
        accel.launch(k["consume"], grid, block, views_mid[i], views_out[i], n, stream=q1)   # consume
        consumed.record(q1)

        def listener(i=i):          # notifyListener:atValue:block: on the listener's queue
            consumed.synchronize()
            listened.append((i, views_out[i].to_numpy().tobytes()))
        t = threading.Thread(target=listener)
        t.start()
        t.join()
    out.copy_to(host, stream=q1, non_blocking=True)
    consumed.record(q1)
    consumed.synchronize()
    want = data + np.float32(1) + np.float32(1)
    assert listened == [(i, want[i * n:(i + 1) * n].tobytes()) for i in range(chunks)]
    assert host.tobytes() == want.tobytes()
    assert accel.current_device_index() == 0
    del views_src, views_mid, views_out
    for b in (src, mid, out):
        b.close()
    for e in (produced, consumed):
        e.close()
    q0.close()
    q1.close()
    del host, src, mid, out, produced, consumed, q0, q1, k, mod, b, e, t
    _check_end(base, "shared event")


@pytest.mark.parametrize("kind", SIMS)
def test_an_event_rerecorded_on_another_stream_leaves_earlier_waits_alone(monkeypatch, kind):
    """One event, two producer queues taking turns (a renderer's 'frame ready' event recorded by
    whichever queue produced the frame).  ``Event.wait`` "make[s] ``stream`` wait for this
    event's recorded work": the record current when ``wait`` was called, as torch and
    ``cudaStreamWaitEvent`` ("the most recent call to cudaEventRecord").  A later record on an
    idle queue must not release the consumer before the slow producer's work is done.

    On Metal, accel's event is one MTLSharedEvent whose value grows at each record and a wait
    encodes ``encodeWaitForEvent:value:``, which MTLEvent.h satisfies when "the event's signaled
    value reaches value or higher": the idle queue's later signal (value 2) releases the wait
    for value 1 while the first producer still runs, and the consumer copied stale data (until
    r63: a record made while the previous one is pending now signals a new MTLSharedEvent)."""
    base = _start(monkeypatch, kind, ACCEL_SIM_DELAY_US=20000)
    n = 1 << 12
    x, y = accel.Buffer(4 * n).fill_(0), accel.Buffer(4 * n).fill_(0)
    accel.synchronize()
    slow, idle, consumer = accel.Stream(), accel.Stream(), accel.Stream()
    ready = accel.Event()
    for i in range(12):
        x.fill_(i + 1, stream=slow)                               # the slow producer's frame
    ready.record(slow)
    ready.wait(consumer)                                          # the consumer waits for it
    ready.record(idle)                                            # the next frame's producer
    idle.synchronize()
    y.copy_from(x, stream=consumer, non_blocking=True)
    consumer.synchronize()
    got = y.to_numpy(np.uint8)
    accel.synchronize()
    try:
        assert (got == 12).all(), f"the consumer ran before the producer it waited for: {np.unique(got)}"
    finally:
        for obj in (x, y, ready, slow, idle, consumer):
            obj.close()
        del x, y, ready, slow, idle, consumer, obj
    _check_end(base, "re-recorded event")


# -- 4. MTLHeap sub-allocation: a multistage filter in a heap, aliasable intermediates --------------
@pytest.mark.parametrize("case", _cases(SIMS), ids=_ids)
def test_heap_suballocation_with_aliasable_intermediates(monkeypatch, kernels, case):
    """"Implementing a Multistage Image Filter Using Heaps and Events": one heap made up front
    (here a MemPool of the device), per image two filter stages whose intermediates come from the
    heap, each made aliasable (freed to the heap) as soon as the stage that reads it is encoded,
    so the next intermediate reuses its memory; the images' sources live outside the heap.  The
    heap does not grow after the first image (``MTLHeap.currentAllocatedSize`` constant: the
    pool's reserved bytes); every block of the pool says so in its snapshot; once the heap is
    released nothing stays reserved."""
    kind, dev = case
    base = _start(monkeypatch, kind, ACCEL_SIM_DELAY_US=300)
    mod, k = kernels(dev)
    q = accel.Stream(dev)
    n, images = 1 << 15, 4
    with accel.device_index(dev):
        heap = accel.MemPool()                                    # newHeapWithDescriptor
    assert heap.device_index == dev
    sources = [accel.Buffer(4 * n, device=dev).copy_from(np.full(n, i, np.float32)) for i in range(images)]
    results = [accel.empty_pinned(n, np.float32) for _ in range(images)]
    reserved, grid = [], _grid(n)
    for i in range(images):
        with q, memory.use_mem_pool(heap, device=dev):
            stage1 = accel.Buffer(4 * n, device=dev)              # heap newBufferWithLength
            accel.launch(k["consume"], *grid, sources[i], stage1, n, stream=q)
            stage2 = accel.Buffer(4 * n, device=dev)
            accel.launch(k["consume"], *grid, stage1, stage2, n, stream=q)
            stage1.close()                                        # makeAliasable
            stage3 = accel.Buffer(4 * n, device=dev)              # may alias stage1's memory
            accel.launch(k["consume"], *grid, stage2, stage3, n, stream=q)
            stage2.close()
            stage3.copy_to(results[i], stream=q, non_blocking=True)
            stage3.close()
        reserved.append(memory.memory_reserved(dev))
        segs = heap.snapshot()
        assert segs and all(s["segment_pool_id"] == heap.id for s in segs), segs
    q.synchronize()
    for i in range(images):
        assert results[i].tobytes() == np.full(n, i + 3, np.float32).tobytes(), i
    assert reserved[1:] == reserved[:1] * (images - 1), reserved        # the heap did not grow
    assert accel.current_device_index() == 0 and accel.current_stream(dev) == accel.default_stream(dev)
    for b in sources:
        b.close()
    q.close()
    del heap, sources, results, stage1, stage2, stage3, b, q, k, mod, segs
    _check_end(base, "heap")


# -- 5. torch.mps memory and timing API, as its docs and tests use it --------------------------------
@pytest.mark.parametrize("case", _cases(SIMS), ids=_ids)
def test_torch_mps_memory_and_timing_program(monkeypatch, case):
    """torch.mps docs/tests: ``set_per_process_memory_fraction(0.5)``; allocate, read
    ``current_allocated_memory`` (memory_allocated) and ``driver_allocated_memory`` (memory
    reserved, at least as much); a request past the limit raises OutOfMemoryError and changes
    no statistic but the OOM and retry counts; free, ``empty_cache``, retry; time the work between two
    ``torch.mps.Event(enable_timing=True)`` records; ``synchronize``; back to no limit.
    ``recommended_max_memory`` is the device's ``recommended_max_working_set_size`` on Metal.
    The limit set for the program's device leaves the other device's alone."""
    kind, dev = case
    base = _start(monkeypatch, kind, ACCEL_SIM_MEMORY="256M", ACCEL_SIM_DELAY_US=200)
    # A device's allocator keeps its own options once its fraction was set (one AllocConfig per
    # device, replaced at each call): state of the device, not of the program, so the baseline
    # is taken with it there.
    memory.set_per_process_memory_fraction(1.0, dev)
    base = (base[0], _accel_objects(), base[2], base[3])
    total = accel.get_device_properties(dev).total_memory
    if kind == "mps":
        assert accel.get_device_properties(dev).extra["recommended_max_working_set_size"] == total
    memory.set_per_process_memory_fraction(0.5, dev)
    assert memory.get_per_process_memory_fraction(dev) == 0.5
    assert all(memory.get_per_process_memory_fraction(d) == 1.0 for d in _devices() if d != dev)
    x = accel.Buffer(64 * MiB, device=dev).fill_(7)
    assert memory.memory_allocated(dev) == 64 * MiB                  # current_allocated_memory
    assert memory.memory_reserved(dev) >= memory.memory_allocated(dev)   # driver_allocated_memory
    before = memory.memory_stats(dev)
    with pytest.raises(accel.OutOfMemoryError) as info:
        accel.Buffer(96 * MiB, device=dev)
    assert "Tried to allocate" in str(info.value)
    after = memory.memory_stats(dev)
    counters = ("num_ooms", "num_alloc_retries")                     # torch counts these too
    moved = {key for key in before if before[key] != after.get(key) and key not in counters}
    assert not moved, {key: (before[key], after.get(key)) for key in moved}
    assert after["num_ooms"] == before["num_ooms"] + 1
    if dev != 0:                                                      # device 0 has no limit
        accel.Buffer(160 * MiB, device=0).close()
    x.close()
    memory.empty_cache()                                              # torch.mps.empty_cache()
    start, end = accel.Event(dev, enable_timing=True), accel.Event(dev, enable_timing=True)
    s = accel.current_stream(dev)
    start.record(s)
    y = accel.Buffer(96 * MiB, device=dev).fill_(3, stream=s)        # the retry fits now
    end.record(s)
    accel.synchronize(dev)                                            # torch.mps.synchronize()
    assert start.elapsed_time(end) >= 0.0
    assert y.to_numpy(np.uint8, stream=s)[-4:].tobytes() == b"\x03" * 4
    y.close()
    memory.set_per_process_memory_fraction(1.0, dev)
    del x, y, start, end, s, info
    _check_end(base, "torch.mps memory")


# -- 6. SYCL: two in-order queues on two devices, a USM memcpy chain with depends_on events ---------
@pytest.mark.parametrize("case", _cases([s for s in SIMS if s != "mps"]), ids=_ids)
def test_sycl_usm_memcpy_chain_across_two_queues_and_devices(monkeypatch, kernels, case):
    """A oneAPI USM program: ``malloc_host`` source and destination, ``malloc_device`` on the
    program's device (A) and the other one (B), one in-order queue each.  qA: memcpy host -> dA,
    ``add_arrays(dA, dA, dA2)``; qB (``depends_on`` the kernel's event): memcpy dA2 -> dB,
    ``consume(dB, dB2)``; qA (``depends_on`` that): memcpy dB2 -> dA, memcpy dA -> host; both
    queues ``wait()``; ``free`` in reverse order.  Every byte arrives, under a per-operation delay
    that would expose a missing dependency."""
    kind, dev = case
    base = _start(monkeypatch, kind, ACCEL_SIM_DELAY_US=1500)
    other = 1 - dev
    mod_a, ka = kernels(dev)
    mod_b, kb = kernels(other)
    qa, qb = accel.Stream(dev), accel.Stream(other)               # sycl::queue{dev, in_order}
    n = 1 << 14
    h_src = accel.empty_pinned(n, np.float32)                     # malloc_host
    h_dst = accel.empty_pinned(n, np.float32)
    h_src[:] = np.linspace(-3, 3, n, dtype=np.float32)
    h_dst[:] = np.nan
    d_a = accel.Buffer(4 * n, device=dev, stream=qa)              # malloc_device(n, qA)
    d_a2 = accel.Buffer(4 * n, device=dev, stream=qa)
    d_b = accel.Buffer(4 * n, device=other, stream=qb)
    d_b2 = accel.Buffer(4 * n, device=other, stream=qb)
    grid = _grid(n)
    e_kernel, e_b = accel.Event(dev), accel.Event(other)
    d_a.copy_from(h_src, stream=qa, non_blocking=True)            # qA.memcpy
    accel.launch(ka["add_arrays"], *grid, d_a, d_a, d_a2, stream=qa)   # qA.parallel_for
    e_kernel.record(qa)
    e_kernel.wait(qb)                                             # depends_on(e_kernel)
    d_b.copy_from(d_a2, stream=qb, non_blocking=True)             # qB.memcpy(dB, dA2)
    accel.launch(kb["consume"], *grid, d_b, d_b2, n, stream=qb)
    e_b.record(qb)
    e_b.wait(qa)
    d_a.copy_from(d_b2, stream=qa, non_blocking=True)             # qA.memcpy(dA, dB2)
    d_a.copy_to(h_dst, stream=qa, non_blocking=True)              # qA.memcpy(host, dA)
    qa.synchronize()                                              # qA.wait()
    qb.synchronize()
    want = h_src * np.float32(2) + np.float32(1)
    assert h_dst.tobytes() == want.tobytes()
    assert accel.current_device_index() == 0
    for b in (d_b2, d_b, d_a2, d_a):                              # sycl::free
        b.close()
    for e in (e_kernel, e_b):
        e.close()
    qa.close()
    qb.close()
    del h_src, h_dst, d_a, d_a2, d_b, d_b2, b, e, e_kernel, e_b, qa, qb, ka, kb, mod_a, mod_b, want
    _check_end(base, "USM chain")


# -- 7. oneAPI: the same work on every device, all in flight, then wait for all ---------------------
@pytest.mark.parametrize("env", [{}, {"ACCEL_SIM_DEVICES": 1, "ACCEL_SIM_ZE_TILES": 2},
                                 {"ACCEL_SIM_ZE_TILES": 2, "ZE_FLAT_DEVICE_HIERARCHY": "COMPOSITE"}],
                         ids=["cards", "flat-tiles", "composite-cards"])
def test_all_devices_loop_then_wait_for_all(monkeypatch, kernels, env):
    """The oneAPI multi-GPU loop (``for (auto &d : platform.get_devices())``): a queue, USM
    device buffers and a vector add per device, each result copied to host memory without
    waiting; then ``q.wait()`` for each queue.  Devices are walked from the last to the first,
    so device 1's work is queued while device 0 is current; the tile hierarchy decides how many
    devices there are.  A timed event pair per queue measures its device's work."""
    for key in ("ZE_FLAT_DEVICE_HIERARCHY",):
        if key in env:
            monkeypatch.setenv(key, env[key])
    sim_env = {k: v for k, v in env.items() if k.startswith("ACCEL_")}
    base = _start(monkeypatch, "xpu", ACCEL_SIM_DELAY_US=1000, **sim_env)
    devices = _devices()[::-1]
    assert devices == [1, 0]            # two cards, two tiles of one card, two composite cards
    n = 1 << 14
    work = []
    for d in devices:
        mod, k = kernels(d)
        q = accel.Stream(d)
        a = accel.Buffer(4 * n, device=d, stream=q)
        b = accel.Buffer(4 * n, device=d, stream=q)
        c = accel.Buffer(4 * n, device=d, stream=q)
        ha = np.full(n, d + 1, np.float32)
        hb = np.arange(n, dtype=np.float32)
        out = accel.empty_pinned(n, np.float32)
        t0, t1 = accel.Event(d, enable_timing=True), accel.Event(d, enable_timing=True)
        t0.record(q)
        a.copy_from(ha, stream=q, non_blocking=True)
        b.copy_from(hb, stream=q, non_blocking=True)
        accel.launch(k["add_arrays"], *_grid(n), a, b, c, stream=q)
        c.copy_to(out, stream=q, non_blocking=True)
        t1.record(q)
        work.append((d, mod, k, q, (a, b, c), out, (t0, t1), ha + hb))
        assert accel.current_device_index() == 0
    for d, mod, k, q, bufs, out, (t0, t1), want in work:
        q.synchronize()                                           # q.wait()
        assert out.tobytes() == want.tobytes(), d
        assert t0.elapsed_time(t1) >= 0
    for d, mod, k, q, bufs, out, evs, want in work:
        for x in bufs:
            x.close()
        for e in evs:
            e.close()
        q.close()
    del work, mod, k, q, bufs, out, evs, want, a, b, c, t0, t1, x, e
    _check_end(base, "all devices")
