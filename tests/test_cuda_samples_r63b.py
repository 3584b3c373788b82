"""NVIDIA cuda-samples translated into accel's API (r63b).

Each program follows one sample of NVIDIA/cuda-samples (Samples/0_Introduction,
2_Concepts_and_Techniques, 3_CUDA_Features) step by step: the same streams, the same current
device, the same synchronizations and the same frees in the same order, with the sample's own
check of the results (here byte for byte against numpy).  Kernels are the samples' kernels: CUDA C
compiled with NVRTC (``accel.compile``), MSL on Metal, SPIR-V entry points on Level Zero; the
simulators run the numpy references registered for them.

Where a sample calls ``cudaSetDevice(dev)`` the translation runs on device 1 while device 0 stays
current (and once on device 0); Metal has one device.  After each program: the results are right,
``memory_stats`` balance and are back to zero after ``empty_cache``, the simulator's live handles
are back at the baseline, no accel object outlives the program, the current device and streams are
unchanged, and later valid calls still work.

Where accel has no API for what a sample does (``cudaStreamAddCallback``, ``cudaGraphExecUpdate``,
``cudaGraphClone``, explicit graph nodes, ``cudaHostRegister``, peer access, the legacy default
stream's implicit synchronization) a comment says so and the nearest thing accel offers is used.
"""

from __future__ import annotations

import importlib
import threading

import numpy as np
import pytest

import accel
from accel import memory, sim
from conftest import SIMS, use_sim
from test_pressure_programs_r62l import _accel_objects, _check_stats, _holders, _sim_counts, _split
from test_user_programs import process_state, settle

pytestmark = pytest.mark.usefixtures("frozen_module_heap")

GRAPH_SIMS = [s for s in SIMS if s != "mps"]
MiB = 1 << 20

# -- the samples' kernels ---------------------------------------------------------------------------
CUDA_SRC = r"""
// asyncAPI: increment_kernel; cudaOpenMP: kernelAddConstant (the same body)
extern "C" __global__ void increment_kernel(int *g_data, int inc_value) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    g_data[idx] = g_data[idx] + inc_value;
}
// simpleStreams
extern "C" __global__ void init_array(int *g_data, int *factor, int num_iterations) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    for (int i = 0; i < num_iterations; i++) g_data[idx] += *factor;
}
// vectorAdd, simpleZeroCopy (vectorAddGPU), streamOrderedAllocation (vectorAddGPU)
extern "C" __global__ void vectorAdd(const float *A, const float *B, float *C, int numElements) {
    int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i < numElements) C[i] = A[i] + B[i];
}
// simpleCudaGraphs (reduce, reduceFinal) and simpleMultiGPU (reduceKernel): partial sums
extern "C" __global__ void reduce(const float *inputVec, float *outputVec, size_t inputSize,
                                  size_t outputSize) {
    size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (t < outputSize) { float s = 0; for (size_t i = t; i < inputSize; i += outputSize) s += inputVec[i];
                          outputVec[t] = s; }
}
extern "C" __global__ void reduceFinal(const float *inputVec, float *result, size_t inputSize) {
    if (blockIdx.x == 0 && threadIdx.x == 0) { float s = 0; for (size_t i = 0; i < inputSize; i++) s += inputVec[i];
                                               *result = s; }
}
// graphMemoryNodes
extern "C" __global__ void squareArray(const float *input, float *output, int numElements) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < numElements) output[idx] = input[idx] * input[idx];
}
extern "C" __global__ void negateArray(const float *input, float *output, int numElements) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < numElements) output[idx] = input[idx] * -1;
}
// jacobiCudaGraphs: JacobiMethod (float here: Metal has no double)
extern "C" __global__ void JacobiMethod(const float *A, const float *b, const float *x, float *x_new,
                                        float *sum, int N) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) { float r = 0; for (int j = 0; j < N; j++) if (j != i) r += A[i * N + j] * x[j];
                 x_new[i] = (b[i] - r) / A[i * N + i]; atomicAdd(sum, fabsf(x_new[i] - x[i])); }
}
"""

MSL_SRC = """
#include <metal_stdlib>
using namespace metal;
kernel void increment_kernel(device int *g [[buffer(0)]], constant int &v [[buffer(1)]],
                             uint i [[thread_position_in_grid]]) { g[i] = g[i] + v; }
kernel void init_array(device int *g [[buffer(0)]], device const int *f [[buffer(1)]],
                       constant int &n [[buffer(2)]], uint i [[thread_position_in_grid]]) {
    for (int k = 0; k < n; k++) g[i] += *f; }
kernel void vectorAdd(device const float *A [[buffer(0)]], device const float *B [[buffer(1)]],
                      device float *C [[buffer(2)]], constant int &n [[buffer(3)]],
                      uint i [[thread_position_in_grid]]) { if ((int)i < n) C[i] = A[i] + B[i]; }
kernel void reduce(device const float *in [[buffer(0)]], device float *out [[buffer(1)]],
                   constant ulong &n [[buffer(2)]], constant ulong &m [[buffer(3)]],
                   uint t [[thread_position_in_grid]]) {
    if (t < m) { float s = 0; for (ulong i = t; i < n; i += m) s += in[i]; out[t] = s; } }
kernel void reduceFinal(device const float *in [[buffer(0)]], device float *r [[buffer(1)]],
                        constant ulong &n [[buffer(2)]], uint t [[thread_position_in_grid]]) {
    if (t == 0) { float s = 0; for (ulong i = 0; i < n; i++) s += in[i]; *r = s; } }
kernel void squareArray(device const float *in [[buffer(0)]], device float *out [[buffer(1)]],
                        constant int &n [[buffer(2)]], uint i [[thread_position_in_grid]]) {
    if ((int)i < n) out[i] = in[i] * in[i]; }
kernel void negateArray(device const float *in [[buffer(0)]], device float *out [[buffer(1)]],
                        constant int &n [[buffer(2)]], uint i [[thread_position_in_grid]]) {
    if ((int)i < n) out[i] = in[i] * -1; }
kernel void JacobiMethod(device const float *A [[buffer(0)]], device const float *b [[buffer(1)]],
                         device const float *x [[buffer(2)]], device float *xn [[buffer(3)]],
                         device atomic_float *sum [[buffer(4)]], constant int &N [[buffer(5)]],
                         uint i [[thread_position_in_grid]]) {
    if ((int)i < N) { float r = 0; for (int j = 0; j < N; j++) if (j != (int)i) r += A[i * N + j] * x[j];
        xn[i] = (b[i] - r) / A[i * N + i]; atomic_fetch_add_explicit(sum, fabs(xn[i] - x[i]), memory_order_relaxed); } }
"""

SIGS = {"increment_kernel": "ptr, i32", "init_array": "ptr, ptr, i32", "vectorAdd": "ptr, ptr, ptr, i32",
        "reduce": "ptr, ptr, u64, u64", "reduceFinal": "ptr, ptr, u64", "squareArray": "ptr, ptr, i32",
        "negateArray": "ptr, ptr, i32", "JacobiMethod": "ptr, ptr, ptr, ptr, ptr, i32"}


def _threads(grid, block) -> int:
    return grid[0] * grid[1] * grid[2] * block[0] * block[1] * block[2]


def _increment(grid, block, view, g, v):
    n = _threads(grid, block)
    a = view(g, 4 * n, np.int32)
    a[:] = a + np.int32(v)


def _init_array(grid, block, view, g, factor, iters):
    n = _threads(grid, block)
    a, f = view(g, 4 * n, np.int32), view(factor, 4, np.int32)[0]
    for _ in range(iters):
        a += f


def _vector_add(grid, block, view, a, b, c, n):
    n = min(n, _threads(grid, block))
    view(c, 4 * n, np.float32)[:] = view(a, 4 * n, np.float32) + view(b, 4 * n, np.float32)


def _seq_sum(values) -> np.float32:
    """A thread's loop ``s += v`` in float32, one rounding per step."""
    s = np.float32(0)
    for v in values:
        s = np.float32(s + v)
    return s


def reduce_host(x: np.ndarray, m: int) -> np.ndarray:
    """What ``reduce`` computes: output[t] = the float32 sum of x[t::m], in order."""
    cols = np.zeros(m, np.float32)
    for start in range(0, len(x), m):
        part = x[start:start + m]
        cols[:len(part)] = cols[:len(part)] + part          # one rounding per step, per thread
    return cols


def _reduce(grid, block, view, inp, out, n, m):
    m = min(m, _threads(grid, block))
    view(out, 4 * m, np.float32)[:] = reduce_host(view(inp, 4 * n, np.float32).copy(), m)


def _reduce_final(grid, block, view, inp, result, n):
    view(result, 4, np.float32)[0] = _seq_sum(view(inp, 4 * n, np.float32))


def _square(grid, block, view, inp, out, n):
    n = min(n, _threads(grid, block))
    x = view(inp, 4 * n, np.float32)
    view(out, 4 * n, np.float32)[:] = x * x


def _negate(grid, block, view, inp, out, n):
    n = min(n, _threads(grid, block))
    view(out, 4 * n, np.float32)[:] = view(inp, 4 * n, np.float32) * np.float32(-1)


def jacobi_host(A: np.ndarray, b: np.ndarray, x: np.ndarray):
    """One Jacobi step as ``JacobiMethod`` computes it: (x_new, sum of |x_new - x|)."""
    n = len(b)
    off = A.copy()
    off[np.arange(n), np.arange(n)] = 0
    r = np.zeros(n, np.float32)
    for j in range(n):                                       # r += A[i, j] * x[j], j in order
        r = r + off[:, j] * x[j]
    x_new = (b - r) / A[np.arange(n), np.arange(n)]
    return x_new.astype(np.float32), _seq_sum(np.abs(x_new - x))


def _jacobi(grid, block, view, A, b, x, x_new, total, n):
    a = view(A, 4 * n * n, np.float32).reshape(n, n).copy()
    xn, s = jacobi_host(a, view(b, 4 * n, np.float32).copy(), view(x, 4 * n, np.float32).copy())
    view(x_new, 4 * n, np.float32)[:] = xn
    t = view(total, 4, np.float32)
    t[0] = np.float32(t[0] + s)


REFS = {"increment_kernel": _increment, "init_array": _init_array, "vectorAdd": _vector_add,
        "reduce": _reduce, "reduceFinal": _reduce_final, "squareArray": _square, "negateArray": _negate,
        "JacobiMethod": _jacobi}


@pytest.fixture
def kernels():
    """``make(dev) -> (Module, {name: Kernel})``: the samples' module for the current simulator."""
    for name, fn in REFS.items():
        sim.register_kernel(name, fn, SIGS[name])
    images = {}

    def make(dev):
        kind = accel.current_accelerator().type
        if kind not in images:
            if kind == "cuda":
                try:
                    images[kind] = accel.compile(CUDA_SRC, name="samples.cu").ptx
                except accel.CompileError:
                    raise
                except RuntimeError as exc:
                    pytest.skip(f"NVRTC absent: {str(exc).splitlines()[0]}")
            elif kind == "xpu":
                from test_user_kernels import spirv_module
                images[kind] = spirv_module(*REFS)
            else:
                images[kind] = MSL_SRC
        mod = accel.Module(images[kind], device=dev)
        return mod, {name: mod.function(name, None if kind == "cuda" else SIGS[name]) for name in REFS}
    yield make
    for name in REFS:
        sim.unregister_kernel(name)


# -- program harness --------------------------------------------------------------------------------
def _devices():
    return list(range(accel.device_count()))


def _cases(kinds):
    """(kind, device) pairs: device 1 while device 0 is current, and device 0 (Metal: one device)."""
    return [(k, d) for k in kinds for d in ((0,) if k == "mps" else (1, 0))]


def _ids(case):
    return f"{case[0]}-dev{case[1]}"


def _start(monkeypatch, kind: str, **env):
    """Switch to ``kind``; warm both devices up; the baseline the program must come back to."""
    use_sim(monkeypatch, kind, **env)
    assert accel.current_device_index() == 0
    for d in _devices():
        accel.Buffer(MiB, device=d).fill_(1).close()
        warm = accel.Buffer(64, device=d)
        accel.random.uniform_(warm, generator=accel.random.default_generator(d))
        del warm
        accel.synchronize(d)
    accel.empty_pinned(16)                # the host allocator is made at the first pinned array
    importlib.import_module("accel._dlpack")   # its enums are module state, not program state
    settle()
    return _sim_counts(kind), _accel_objects(), process_state(), kind


def _check_end(base, where: str = "") -> None:
    """Everything the program made is gone; stats balance; later valid calls still work."""
    counts, objects, state, kind = base
    settle()
    # (Level Zero: event slots a freed block waited for are recycled, and the closed streams
    # they name dropped, at the backend's next sweep, which a later operation runs)
    for d in _devices():
        accel.Buffer(512, device=d).fill_(0).close()
    settle()
    for d in _devices():
        s = _check_stats(d, where)
        assert s["allocated_bytes.all.current"] == 0, (where, d)
        assert s["active_bytes.all.current"] == 0, (where, d)
        assert s["reserved_bytes.all.current"] == 0, (where, d, "empty_cache left reserved memory")
        assert s["requested_bytes.all.current"] == 0, (where, d)
    assert memory.host_memory_stats()["allocated_bytes.current"] == 0, where
    # (Level Zero event slots are pooled, 64 a pool, one pool per device and kind (timing or
    # not): a cache bounded by concurrent use, counted by _split's cached handles instead)
    grown = {k: (objects.get(k, 0), v) for k, v in _accel_objects().items()
             if v > objects.get(k, 0) and not (k == "_Slot" and v <= 64 * 2 * len(_devices()))}
    assert not grown, (where, "accel objects outlived the program", grown, _holders(grown))
    live, cached = _split(_sim_counts(kind))
    assert live == _split(counts)[0], (where, "simulator state", live, _split(counts)[0])
    assert process_state() == state, where
    for d in _devices():
        b = accel.Buffer(4096, device=d)
        b.copy_from(np.arange(1024, dtype=np.float32))
        assert b.to_numpy(np.float32).tobytes() == np.arange(1024, dtype=np.float32).tobytes()
        b.close()
    settle()


# -- 1. asyncAPI (0_Introduction) -------------------------------------------------------------------
@pytest.mark.parametrize("case", _cases(SIMS), ids=_ids)
def test_async_api(monkeypatch, kernels, case):
    """asyncAPI: pinned ``a`` zeroed, ``d_a`` memset to 255, then all to stream 0 of the device:
    event start, H2D copy, increment_kernel, D2H copy, event stop; the CPU counts while
    ``cudaEventQuery(stop)`` is not ready (ACCEL_SIM_DELAY_US makes it wait), reads the elapsed
    time, checks ``a == value``, destroys the events, frees ``a`` then ``d_a``."""
    kind, dev = case
    base = _start(monkeypatch, kind, ACCEL_SIM_DELAY_US=300)
    mod, k = kernels(dev)
    n, value = 64 * 1024, 26
    a = accel.empty_pinned(n, np.int32)                           # cudaMallocHost
    a[:] = 0                                                      # memset(a, 0, nbytes)
    d_a = accel.Buffer(4 * n, device=dev)                         # cudaMalloc
    d_a.fill_(255)                                                # cudaMemset(d_a, 255, nbytes)
    threads, blocks = 512, n // 512
    start = accel.Event(dev, enable_timing=True)
    stop = accel.Event(dev, enable_timing=True)
    accel.synchronize(dev)                                        # cudaDeviceSynchronize
    s0 = accel.current_stream(dev)                                # "stream 0" of that device
    start.record(s0)
    d_a.copy_from(a, stream=s0, non_blocking=True)
    accel.launch(k["increment_kernel"], blocks, threads, d_a, value, stream=s0)
    d_a.copy_to(a, stream=s0, non_blocking=True)
    stop.record(s0)
    counter = 0
    while not stop.query():
        counter += 1
    gpu_time = start.elapsed_time(stop)
    assert gpu_time >= 0.0 and counter > 0
    assert accel.current_device_index() == 0
    assert a.tobytes() == np.full(n, value, np.int32).tobytes()
    start.close()                                                 # cudaEventDestroy
    stop.close()
    del a                                                         # cudaFreeHost
    d_a.close()                                                   # cudaFree
    del k, mod, start, stop, d_a, s0
    _check_end(base, "asyncAPI")


# -- 2. simpleStreams (0_Introduction) --------------------------------------------------------------
@pytest.mark.parametrize("case", _cases(SIMS), ids=_ids)
def test_simple_streams(monkeypatch, kernels, case):
    """simpleStreams (cudaMallocHost path): d_a memset 0, d_c = 5; four streams; blocking-sync
    events; a timed D2H on streams[0] and a timed kernel; the non-streamed reference (kernel and
    synchronous copy, nreps times); then host set to all ones bits, d_a to zero, and nreps rounds
    of one init_array per stream on its quarter followed by one D2H per stream; stop recorded on
    stream 0 and synchronized; the result must be c * nreps * niterations everywhere.  Release:
    streams, events, host memory, d_a, d_c.

    accel's streams are non-blocking (as torch's): the legacy default stream's implicit wait for
    the other streams, on which the sample's ``cudaEventRecord(stop_event, 0)`` relies, is written
    out as ``wait_stream`` of each stream."""
    kind, dev = case
    base = _start(monkeypatch, kind, ACCEL_SIM_DELAY_US=100)
    mod, k = kernels(dev)
    nstreams, nreps, niterations, c = 4, 3, 5, 5
    n = 32 * 1024
    nbytes = 4 * n
    h_a = accel.empty_pinned(n, np.int32)                         # cudaMallocHost
    d_a = accel.Buffer(nbytes, device=dev).fill_(0)               # cudaMalloc + cudaMemset
    d_c = accel.Buffer(4, device=dev)
    d_c.copy_from(np.array([c], np.int32))                        # cudaMemcpy (synchronous)
    streams = [accel.Stream(dev) for _ in range(nstreams)]
    start_event = accel.Event(dev, enable_timing=True, blocking=True)   # cudaEventBlockingSync
    stop_event = accel.Event(dev, enable_timing=True, blocking=True)
    s0 = accel.current_stream(dev)

    def legacy_join():          # what the legacy stream 0 would wait for implicitly
        for s in streams:
            s0.wait_stream(s)

    start_event.record(s0)
    d_a.copy_to(h_a, stream=streams[0], non_blocking=True)
    legacy_join()
    stop_event.record(s0)
    stop_event.synchronize()
    assert start_event.elapsed_time(stop_event) >= 0
    assert not h_a.any()

    start_event.record(s0)
    legacy_join()
    accel.launch(k["init_array"], n // 512, 512, d_a, d_c, niterations, stream=streams[0])
    legacy_join()
    stop_event.record(s0)
    stop_event.synchronize()
    start_event.elapsed_time(stop_event)

    start_event.record(s0)                                        # non-streamed reference
    for _ in range(nreps):
        accel.launch(k["init_array"], n // 512, 512, d_a, d_c, niterations, stream=s0)
        d_a.copy_to(h_a, stream=s0)                               # cudaMemcpy D2H
    stop_event.record(s0)
    stop_event.synchronize()
    assert h_a.tobytes() == np.full(n, c * niterations * (nreps + 1), np.int32).tobytes()

    h_a[:] = -1                                                   # memset(hAligned_a, 255)
    d_a.fill_(0, stream=s0)                                       # cudaMemset (stream 0)
    for s in streams:          # the legacy stream's memset finishes before the streams' work
        s.wait_stream(s0)
    start_event.record(s0)
    quarter = n // nstreams
    # d_a + i * n / nstreams: a non-owning Buffer over each quarter (ArrayView has no copy_to)
    parts = [accel.Buffer.from_ptr(d_a.ptr + 4 * i * quarter, 4 * quarter, dev, owner=d_a)
             for i in range(nstreams)]
    for _ in range(nreps):
        for i, s in enumerate(streams):
            accel.launch(k["init_array"], quarter // 512, 512, parts[i], d_c, niterations, stream=s)
        for i, s in enumerate(streams):
            parts[i].copy_to(h_a[i * quarter:(i + 1) * quarter], stream=s, non_blocking=True)
    legacy_join()
    stop_event.record(s0)
    stop_event.synchronize()
    start_event.elapsed_time(stop_event)
    assert accel.current_device_index() == 0
    assert h_a.tobytes() == np.full(n, c * nreps * niterations, np.int32).tobytes()   # correct_data

    for p in parts:
        p.close()
    for s in streams:                                             # cudaStreamDestroy
        s.close()
    start_event.close()
    stop_event.close()
    del h_a, parts, p                                               # cudaFreeHost
    d_a.close()
    d_c.close()
    del streams, s, k, mod, d_a, d_c, start_event, stop_event, s0
    _check_end(base, "simpleStreams")


# -- 3. cudaOpenMP (0_Introduction): one host thread per device (two per device here) ---------------
@pytest.mark.parametrize("kind", SIMS)
def test_cuda_openmp_threads_per_device(monkeypatch, kernels, kind):
    """cudaOpenMP: ``omp_set_num_threads(2 * num_gpus)``; each thread ``cudaSetDevice(id %
    num_gpus)``, allocates its part, ``cudaMemset`` 0, copies its pageable part in, runs
    kernelAddConstant (increment_kernel), copies back, frees; the host checks a[i] == i + b.  The
    threads leave their device current when they end (as OpenMP's do); the main thread's device
    and streams are untouched."""
    base = _start(monkeypatch, kind)
    devs = _devices()
    num_gpus = len(devs)
    mods = [kernels(d) for d in devs]
    n, b = 8 * 1024 * len(devs) * 2, 3
    a = np.arange(n, dtype=np.int32)                              # pageable, as malloc
    nthreads = 2 * num_gpus
    per = n // nthreads
    errors = []

    def body(cpu_thread_id):
        try:
            accel.set_device_index(cpu_thread_id % num_gpus)      # cudaSetDevice
            gpu_id = accel.current_device_index()                 # cudaGetDevice
            assert gpu_id == cpu_thread_id % num_gpus
            sub_a = a[cpu_thread_id * per:(cpu_thread_id + 1) * per]
            d_a = accel.Buffer(4 * per)                           # cudaMalloc on the current device
            assert d_a.device_index == gpu_id
            d_a.fill_(0)                                          # cudaMemset
            d_a.copy_from(sub_a)                                  # cudaMemcpy H2D
            accel.launch(mods[gpu_id][1]["increment_kernel"], per // 128, 128, d_a, b)
            d_a.copy_to(sub_a)                                    # cudaMemcpy D2H
            d_a.close()                                           # cudaFree
        except BaseException as exc:                              # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(nthreads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert a.tobytes() == (np.arange(n, dtype=np.int32) + b).tobytes()
    assert accel.current_device_index() == 0
    del mods, threads
    _check_end(base, "cudaOpenMP")


# -- 4. simpleCallback (0_Introduction) -------------------------------------------------------------
@pytest.mark.parametrize("kind", SIMS)
def test_simple_callback_postprocess_threads(monkeypatch, kernels, kind):
    """simpleCallback: eight workloads spread over the devices (workload i on device i % N); for
    each: ``cudaSetDevice``, a stream, pinned h_data, d_data, H2D, incKernel, D2H, then
    ``cudaStreamAddCallback`` whose callback starts a post-processing thread that sets the
    device, checks the data, frees d_data and h_data, destroys the stream and signals a barrier.
    accel has no host callbacks: an event recorded where the callback would be queued, and a
    thread that waits on it, run the same post-processing (it closes objects of a device that is
    not its current one).  The main thread waits on the barrier."""
    base = _start(monkeypatch, kind, ACCEL_SIM_DELAY_US=100)
    devs = _devices()
    mods = {d: kernels(d) for d in devs}
    n_workloads, n = 8, 4096
    barrier = threading.Barrier(n_workloads + 1, timeout=30)
    errors, post = [], []

    def postprocess(w):
        try:
            accel.set_device_index(w["dev"])
            w["done"].synchronize()
            assert w["h_data"].tobytes() == (np.arange(n, dtype=np.int32) + w["id"] + 1).tobytes()
            w["d_data"].close()                                   # cudaFree
            w["h_data"] = None                                    # cudaFreeHost
            w["stream"].close()                                   # cudaStreamDestroy
            w["done"].close()
            w.clear()
        except BaseException as exc:                              # noqa: BLE001
            errors.append(exc)
        finally:
            barrier.wait()

    workloads = []
    for i in range(n_workloads):
        dev = devs[i % len(devs)]
        with accel.device_index(dev):                             # cudaSetDevice (restored after)
            w = {"id": i, "dev": dev}
            w["stream"] = accel.Stream()
            w["h_data"] = accel.empty_pinned(n, np.int32)
            w["d_data"] = accel.Buffer(4 * n)
            w["h_data"][:] = np.arange(n, dtype=np.int32) + i
            with w["stream"]:
                w["d_data"].copy_from(w["h_data"], non_blocking=True)
                accel.launch(mods[dev][1]["increment_kernel"], n // 256, 256, w["d_data"], 1)
                w["d_data"].copy_to(w["h_data"], non_blocking=True)
                w["done"] = w["stream"].record_event()            # where the callback would run
            t = threading.Thread(target=postprocess, args=(w,))
            t.start()
            post.append(t)
        workloads.append(w)
    barrier.wait()
    for t in post:
        t.join(30)
    assert not errors, errors
    assert all(not w for w in workloads)
    del workloads, w, post, t, mods
    _check_end(base, "simpleCallback")


# -- a bug the samples found ------------------------------------------------------------------------
def _vendor_events(kind: str) -> int:
    c = _sim_counts(kind)
    return sum(v for k, v in c.items() if k in ("events", "ze_live_events", "metal.MTLSharedEvent", "metal.MTLEvent"))


@pytest.mark.xfail(strict=True, reason="r63b: a live block keeps one vendor event per closed stream it was "
                   "used on (accel/memory/_caching.py _forget_stream/uses_forgotten: the gate is added to "
                   "block.uses and only released when the block is freed, even once it has completed)")
@pytest.mark.parametrize("case", _cases(SIMS), ids=_ids)
def test_closed_streams_leave_no_events_on_a_live_buffer(monkeypatch, case):
    """Found translating simpleStreams and simpleCallback: a program keeps a buffer (weights, a
    scratch area) and makes a stream per request (per workload), uses the buffer on it (a kernel
    launch notes it as used there, as record_stream does) and destroys the stream.  Each closed
    stream leaves a vendor event (a cudaEvent, a Level Zero event slot, an MTLSharedEvent) in the
    block's uses until the buffer is freed, even after the stream's work completed and the
    device was synchronized: 200 requests hold 200 events more than 20 requests did.  State must
    be bounded by live objects (one buffer, no live stream)."""
    kind, dev = case
    base = _start(monkeypatch, kind)
    weights = accel.Buffer(4096, device=dev).fill_(0)

    def requests(n):
        for i in range(n):
            s = accel.Stream(dev)
            weights.fill_(i % 256, stream=s)
            weights.record_stream(s)
            s.close()
        accel.synchronize(dev)
        memory.empty_cache()
        return _vendor_events(kind)

    first = requests(20)
    later = requests(200)
    assert (weights.to_numpy() == 199 % 256).all()
    weights.close()
    del weights
    _check_end(base, "closed streams")
    assert later <= first, f"{later - first} more vendor events after 200 more closed streams ({kind})"
