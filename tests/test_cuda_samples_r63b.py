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


def module_maker(refs: dict, sigs: dict, cuda_src: str, msl_src: str, filename: str):
    """A fixture body: registers the reference kernels ``refs`` (signatures ``sigs``), yields
    ``make(dev) -> (Module, {name: Kernel})`` for the current simulator (CUDA C through NVRTC,
    SPIR-V entry points, MSL), and unregisters them after."""
    for name, fn in refs.items():
        sim.register_kernel(name, fn, sigs[name])
    images = {}

    def make(dev):
        kind = accel.current_accelerator().type
        if kind not in images:
            if kind == "cuda":
                try:
                    images[kind] = accel.compile(cuda_src, name=filename).ptx
                except accel.CompileError:
                    raise
                except RuntimeError as exc:
                    pytest.skip(f"NVRTC absent: {str(exc).splitlines()[0]}")
            elif kind == "xpu":
                from test_user_kernels import spirv_module
                images[kind] = spirv_module(*refs)
            else:
                images[kind] = msl_src
        mod = accel.Module(images[kind], device=dev)
        return mod, {name: mod.function(name, None if kind == "cuda" else sigs[name]) for name in refs}
    try:
        yield make
    finally:
        for name in refs:
            sim.unregister_kernel(name)


@pytest.fixture
def kernels():
    """``make(dev) -> (Module, {name: Kernel})``: the samples' module for the current simulator."""
    yield from module_maker(REFS, SIGS, CUDA_SRC, MSL_SRC, "samples.cu")


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
    with accel.current_stream():          # a thread's `with stream:` stack is made at its first block
        pass
    importlib.import_module("accel._dlpack")   # its enums are module state, not program state
    importlib.import_module("accel.graphs")    # its module lock too (the file alone imported it in a program)
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
        done = None
        for i in range(n):
            s = accel.Stream(dev)
            if done is not None:
                s.wait_event(done)        # the requests write in turn
            weights.fill_(i % 256, stream=s)
            done = s.record_event()
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


# -- 5. simpleMultiGPU (0_Introduction) -------------------------------------------------------------
@pytest.mark.parametrize("kind", SIMS)
def test_simple_multi_gpu(monkeypatch, kernels, kind):
    """simpleMultiGPU: per GPU (``cudaSetDevice(i)`` in each loop): a stream, d_Data, d_Sum, pinned
    h_Data and h_Sum_from_device; then per GPU: H2D async, reduceKernel (ACCUM_N partial sums),
    D2H async, all on its stream; then per GPU: stream synchronize and the host sum; then per GPU:
    frees and stream destroy.  The sample leaves the last device current; here the program sets
    device 0 again at the end."""
    base = _start(monkeypatch, kind)
    devs = _devices()
    gpu_n = len(devs)
    mods = [kernels(d) for d in devs]
    data_n, accum_n = 8192 * gpu_n, 1024
    rng = np.random.default_rng(1)
    plan = []
    for i in devs:
        accel.set_device_index(i)
        p = {"stream": accel.Stream(), "dataN": data_n // gpu_n}
        p["d_Data"] = accel.Buffer(4 * p["dataN"])
        p["d_Sum"] = accel.Buffer(4 * accum_n)
        p["h_Sum_from_device"] = accel.empty_pinned(accum_n, np.float32)
        p["h_Data"] = accel.empty_pinned(p["dataN"], np.float32)
        p["h_Data"][:] = rng.random(p["dataN"], dtype=np.float32)
        plan.append(p)
    for i in devs:
        accel.set_device_index(i)
        p = plan[i]
        with p["stream"]:
            p["d_Data"].copy_from(p["h_Data"], non_blocking=True)
            accel.launch(mods[i][1]["reduce"], accum_n // 256, 256, p["d_Data"], p["d_Sum"], p["dataN"], accum_n)
            p["d_Sum"].copy_to(p["h_Sum_from_device"], non_blocking=True)
    sums = []
    for i in devs:
        accel.set_device_index(i)
        plan[i]["stream"].synchronize()
        assert plan[i]["h_Sum_from_device"].tobytes() == reduce_host(plan[i]["h_Data"], accum_n).tobytes()
        sums.append(plan[i]["h_Sum_from_device"].astype(np.float64).sum())
    for i in devs:
        accel.set_device_index(i)
        p = plan[i]
        p["d_Sum"].close()
        p["d_Data"].close()
        p["h_Sum_from_device"] = p["h_Data"] = None               # cudaFreeHost
        p["stream"].close()
    assert accel.current_device_index() == devs[-1]
    accel.set_device_index(0)
    assert np.isfinite(sum(sums))
    del plan, p, mods
    _check_end(base, "simpleMultiGPU")


# -- 6. simpleZeroCopy and vectorAdd (0_Introduction) -----------------------------------------------
@pytest.mark.parametrize("case", _cases(SIMS), ids=_ids)
def test_simple_zero_copy_and_vector_add(monkeypatch, kernels, case):
    """simpleZeroCopy (cudaHostAlloc path; accel has no cudaHostRegister): mapped pinned a, b, c
    passed to vectorAddGPU by address, cudaDeviceSynchronize, c == a + b, cudaFreeHost.  Then
    vectorAdd: d_A, d_B, d_C, synchronous copies in, the kernel, the copy out, the check, frees."""
    kind, dev = case
    base = _start(monkeypatch, kind)
    mod, k = kernels(dev)
    nelem = 1 << 14
    rng = np.random.default_rng(2)
    a = accel.empty_pinned(nelem, np.float32)
    b = accel.empty_pinned(nelem, np.float32)
    c = accel.empty_pinned(nelem, np.float32)
    a[:] = rng.random(nelem, dtype=np.float32)
    b[:] = rng.random(nelem, dtype=np.float32)
    accel.launch(k["vectorAdd"], nelem // 256, 256, a.ctypes.data, b.ctypes.data, c.ctypes.data, nelem,
                 stream=accel.current_stream(dev))
    accel.synchronize(dev)                                        # cudaDeviceSynchronize
    assert c.tobytes() == (a + b).tobytes()
    del a, b, c                                                   # cudaFreeHost

    n = 50000
    h_A, h_B = rng.random(n, dtype=np.float32), rng.random(n, dtype=np.float32)
    d_A, d_B, d_C = (accel.Buffer(4 * n, device=dev) for _ in range(3))
    d_A.copy_from(h_A)
    d_B.copy_from(h_B)
    threads = 256
    accel.launch(k["vectorAdd"], (n + threads - 1) // threads, threads, d_A, d_B, d_C, n)
    h_C = d_C.to_numpy(np.float32)
    assert h_C.tobytes() == (h_A + h_B).tobytes()
    for d in (d_A, d_B, d_C):
        d.close()
    assert accel.current_device_index() == 0
    del d_A, d_B, d_C, d, k, mod
    _check_end(base, "simpleZeroCopy/vectorAdd")


# -- 7. streamOrderedAllocation (2_Concepts_and_Techniques) ----------------------------------------
@pytest.mark.parametrize("case", _cases(SIMS) + [("cuda-async", 1)], ids=_ids)
def test_stream_ordered_allocation(monkeypatch, kernels, case):
    """streamOrderedAllocation: basicStreamOrderedAllocation (cudaMallocAsync of A, B, C on a
    non-blocking stream, H2D, vectorAddGPU, cudaFreeAsync A and B, D2H, cudaFreeAsync C, stream
    synchronize, check) then streamOrderedAllocationPostSync (release threshold UINT64_MAX on the
    pool; the same body MAX_ITER times, one synchronize after the loop; the memory stays
    reserved; check).  On "cuda-async" under ``backend:cudaMallocAsync`` with accel's
    ``release_threshold``; elsewhere the caching allocator keeps its segments likewise."""
    kind, dev = case
    env = {}
    if kind == "cuda-async":
        kind = "cuda"
        env["ACCEL_ALLOC_CONF"] = "backend:cudaMallocAsync,release_threshold:1G"
    base = _start(monkeypatch, kind, ACCEL_SIM_DELAY_US=50, **env)
    mod, k = kernels(dev)
    nelem = 1 << 14
    nbytes = 4 * nelem
    rng = np.random.default_rng(3)
    a, b = accel.empty_pinned(nelem, np.float32), accel.empty_pinned(nelem, np.float32)
    c = accel.empty_pinned(nelem, np.float32)
    a[:] = rng.random(nelem, dtype=np.float32)
    b[:] = rng.random(nelem, dtype=np.float32)

    def body(stream):
        d_A = accel.Buffer(nbytes, device=dev, stream=stream)     # cudaMallocAsync
        d_B = accel.Buffer(nbytes, device=dev, stream=stream)
        d_C = accel.Buffer(nbytes, device=dev, stream=stream)
        d_A.copy_from(a, stream=stream, non_blocking=True)
        d_B.copy_from(b, stream=stream, non_blocking=True)
        accel.launch(k["vectorAdd"], nelem // 256, 256, d_A, d_B, d_C, nelem, stream=stream)
        d_A.close()                                               # cudaFreeAsync (its stream)
        d_B.close()
        d_C.copy_to(c, stream=stream, non_blocking=True)
        d_C.close()

    stream = accel.Stream(dev)                                    # basicStreamOrderedAllocation
    c[:] = 0
    body(stream)
    stream.synchronize()
    assert c.tobytes() == (a + b).tobytes()
    stream.close()

    stream = accel.Stream(dev)                                    # streamOrderedAllocationPostSync
    c[:] = 0
    for _ in range(20):
        body(stream)
    stream.synchronize()
    assert c.tobytes() == (a + b).tobytes()
    assert memory.memory_allocated(dev) == 0
    assert memory.memory_reserved(dev) > 0                        # the threshold kept it
    _check_stats(dev, "postSync")
    stream.close()
    del a, b, c, k, mod, stream
    _check_end(base, "streamOrderedAllocation")


# -- 8. graphMemoryNodes (3_CUDA_Features) ---------------------------------------------------------
def _negate_squares_in_stream(stream1, k, dev, host, keep_out=False, side=None):
    """doNegateSquaresInStream: two streams, three events; d_input and d_square allocated on
    stream1, d_input freed on stream1 after the square kernel, d_negSquare allocated in its
    place, d_square freed on stream2 (record_stream + close: accel frees on the allocation
    stream, after the streams it was recorded on) after both its readers; stream1 joins stream2.
    Returns d_negSquare when ``keep_out`` (the graph output the sample frees later).

    The sample destroys stream2 at the end, inside the capture when captured; accel refuses to
    close a stream that takes part in a capture (until the capture ends), so a capture passes
    ``side``, a list that gets stream2 to close after the capture."""
    nbytes, n = host["bytes"], host["numElements"]
    blocks, threads = (n + 255) // 256, 256
    stream2 = accel.Stream(dev)
    square_done, negate_done, square_free = (accel.Event(dev) for _ in range(3))
    d_input = accel.Buffer(nbytes, device=dev, stream=stream1)
    d_square = accel.Buffer(nbytes, device=dev, stream=stream1)
    d_input.copy_from(host["input"], stream=stream1, non_blocking=True)
    accel.launch(k["squareArray"], blocks, threads, d_input, d_square, n, stream=stream1)
    square_done.record(stream1)
    stream2.wait_event(square_done)
    d_square.copy_to(host["square"], stream=stream2, non_blocking=True)
    d_input.close()                                               # cudaFreeAsync(d_input, stream1)
    d_neg = accel.Buffer(nbytes, device=dev, stream=stream1)
    accel.launch(k["negateArray"], blocks, threads, d_square, d_neg, n, stream=stream1)
    negate_done.record(stream1)
    d_neg.copy_to(host["negSquare"], stream=stream1, non_blocking=True)
    if not keep_out:
        d_neg.close()
        d_neg = None
    stream2.wait_event(negate_done)
    d_square.record_stream(stream2)                               # cudaFreeAsync(d_square, stream2)
    d_square.close()
    square_free.record(stream2)
    stream1.wait_event(square_free)
    if side is None:
        stream2.close()
    else:
        side.append(stream2)
    for e in (square_done, negate_done, square_free):
        e.close()
    return d_neg


@pytest.mark.parametrize("case", _cases(SIMS), ids=_ids)
def test_graph_memory_nodes(monkeypatch, kernels, case):
    """graphMemoryNodes: negateSquares in a stream (validated), then the same captured from a
    non-blocking stream (the side stream created, the allocations made and freed, the events
    destroyed, all inside the capture), launched and validated; then captured keeping
    d_negSquare (allocated by the graph, freed outside it: the sample's createFreeGraph, here a
    close after the launch), launched twice, the output read on the device too.  Host arrays are
    pinned (a capture refuses pageable copies).  Metal has no capture: the stream part only."""
    kind, dev = case
    base = _start(monkeypatch, kind, ACCEL_SIM_DELAY_US=50)
    mod, k = kernels(dev)
    n = 4096
    rng = np.random.default_rng(4)
    host = {"numElements": n, "bytes": 4 * n}
    for name in ("input", "square", "negSquare"):
        host[name] = accel.empty_pinned(n, np.float32)
        host[name][:] = rng.random(n, dtype=np.float32)
    want_sq = host["input"] * host["input"]
    want_neg = want_sq * np.float32(-1)

    def validate():
        assert host["square"].tobytes() == want_sq.tobytes()
        assert host["negSquare"].tobytes() == want_neg.tobytes()
        host["square"][:] = 0                                     # resetOutputArrays
        host["negSquare"][:] = 0

    stream = accel.Stream(dev)
    _negate_squares_in_stream(stream, k, dev, host)
    stream.synchronize()
    validate()
    if kind == "xpu":
        # Level Zero: a capture records no events (one command list, no cross-stream capture):
        # refused with the capture ended and discarded, nothing else changed
        cap = accel.Stream(dev)
        graph = accel.Graph()
        with pytest.raises(accel.CaptureError, match="cross-stream capture is not supported"):
            with cap, graph:
                _negate_squares_in_stream(cap, k, dev, host)
        assert not cap.is_capturing() and process_state() == base[2]
        graph.reset()
        cap.close()
        del graph, cap
    if kind == "cuda":
        # the sample's order (stream2 destroyed inside the capture): refused, and nothing changed
        cap = accel.Stream(dev)
        graph = accel.Graph()
        with pytest.raises(RuntimeError, match="a graph capture on it is underway; end the capture first"):
            with cap, graph:
                _negate_squares_in_stream(cap, k, dev, host)
        assert not cap.is_capturing() and process_state() == base[2]
        graph.reset()
        cap.close()
        settle()
        host["square"][:] = 0
        host["negSquare"][:] = 0

        cap = accel.Stream(dev)                                   # createNegateSquaresGraphWithStreamCapture
        graph = accel.Graph()
        side = []
        with cap, graph:
            _negate_squares_in_stream(cap, k, dev, host, side=side)
        side.pop().close()
        cap.close()
        with stream:
            graph.replay()                                        # cudaGraphLaunch(graphExec, stream)
        stream.synchronize()
        validate()
        graph.reset()

        cap = accel.Stream(dev)
        graph = accel.Graph()
        with cap, graph:
            d_neg = _negate_squares_in_stream(cap, k, dev, host, keep_out=True, side=side)
        side.pop().close()
        cap.close()
        for _ in range(2):
            with stream:
                graph.replay()
            stream.synchronize()
            validate()
        assert d_neg.to_numpy(np.float32, stream=stream).tobytes() == want_neg.tobytes()
        d_neg.close()                                             # the free graph / cudaFreeAsync
        graph.reset()
        del graph, cap, d_neg, side
    stream.close()
    assert accel.current_device_index() == 0
    del host, stream, k, mod
    _check_end(base, "graphMemoryNodes")


# -- 9. jacobiCudaGraphs (3_CUDA_Features) ---------------------------------------------------------
@pytest.mark.parametrize("case", _cases(GRAPH_SIMS), ids=_ids)
def test_jacobi_cuda_graphs(monkeypatch, kernels, case):
    """jacobiCudaGraphs (JacobiMethodGpuCudaGraphExecKernelSetParams): iteration 0 captures
    memset(d_sum), JacobiMethod(x, x_new), memcpy d_sum -> pinned h_sum on a non-blocking stream;
    later iterations swap x and x_new in the kernel node and launch; after each launch the
    stream is synchronized and h_sum checked against the threshold.  accel has no
    cudaGraphExecKernelNodeSetParams / cudaGraphExecUpdate: the odd iterations' graph is a
    second capture (sharing the first one's pool), and the loop alternates them.  The iterations,
    the sums and the final x must equal numpy's, byte for byte."""
    kind, dev = case
    base = _start(monkeypatch, kind)
    mod, k = kernels(dev)
    N, conv_threshold, max_iter = 48, np.float32(1e-4), 200
    rng = np.random.default_rng(5)
    A = rng.random((N, N), dtype=np.float32)
    A[np.arange(N), np.arange(N)] = np.float32(N + 1)             # diagonally dominant, as the sample
    b = rng.random(N, dtype=np.float32) * np.float32(N)
    stream = accel.Stream(dev)
    d_A = accel.Buffer(4 * N * N, device=dev, stream=stream)
    d_b = accel.Buffer(4 * N, device=dev, stream=stream)
    d_x = accel.Buffer(4 * N, device=dev, stream=stream).fill_(0, stream=stream)
    d_x_new = accel.Buffer(4 * N, device=dev, stream=stream).fill_(0, stream=stream)
    d_sum = accel.Buffer(4, device=dev, stream=stream)
    h_sum = accel.empty_pinned(1, np.float32)
    d_A.copy_from(A, stream=stream)
    d_b.copy_from(b, stream=stream)
    graphs = []
    iters = None
    for kk in range(max_iter):
        if kk < 2:
            g = accel.Graph() if kk == 0 else accel.Graph(pool=graphs[0].pool())
            src, dst = (d_x, d_x_new) if kk % 2 == 0 else (d_x_new, d_x)
            with stream, g:
                d_sum.fill_(0)                                    # cudaMemsetAsync(d_sum, 0)
                accel.launch(k["JacobiMethod"], (N + 31) // 32, 32, d_A, d_b, src, dst, d_sum, N)
                d_sum.copy_to(h_sum, non_blocking=True)
            graphs.append(g)
        with stream:
            graphs[kk % 2].replay()
        stream.synchronize()
        if h_sum[0] <= conv_threshold:
            iters = kk + 1
            break
    # numpy's run of the same iteration
    x, want_iters = np.zeros(N, np.float32), None
    for kk in range(max_iter):
        x, total = jacobi_host(A, b, x)
        if total <= conv_threshold:
            want_iters = kk + 1
            break
    assert iters == want_iters and iters is not None and iters > 2
    result = (d_x_new if iters % 2 else d_x).to_numpy(np.float32, stream=stream)
    assert result.tobytes() == x.tobytes()
    for g in graphs:
        g.reset()
    for buf in (d_A, d_b, d_x, d_x_new, d_sum):
        buf.close()
    stream.close()
    del graphs, g, h_sum, d_A, d_b, d_x, d_x_new, d_sum, buf, stream, k, mod, src, dst
    _check_end(base, "jacobiCudaGraphs")
