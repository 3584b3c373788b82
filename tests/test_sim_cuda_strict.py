"""The simulated CUDA runtime is at least as strict as real CUDA (issue 12).

Each test calls the simulated libcudart directly, as a CUDA program would,
and checks one documented hardware rule the simulator enforces.  The helpers
are the ones tests/test_sim_cuda.py drives the library with.
"""

import threading

import pytest

from accel import sim
from accel.sim import kernels
from accel._ffi._cudart import ffi
from test_sim_cuda import (NULL_STREAM, capture, end_capture, event, get_kernel, lib, launch,  # noqa: F401
                           load, malloc, ok, stream)


def fill_kernel(lib):
    rc, mod = load(lib, kernels.TEST_PTX)
    ok(rc)
    rc, k = get_kernel(lib, mod, b"accel_test_fill_u32")
    ok(rc)
    return k


def fill(lib, k, ptr, n, value, s, shared=0):
    return launch(lib, k, [("ptr", ptr), ("u64", n), ("u32", value)], s)


def memset_graph(lib, s, ptr):
    """A graph of one 4-byte memset captured on ``s``, and its executable: (graph, exec)."""
    capture(lib, s)
    ok(lib.cudaMemsetAsync(ptr, 7, 4, s))
    rc, graph = end_capture(lib, s)
    ok(rc)
    x = ffi.new("cudaGraphExec_t *")
    ok(lib.cudaGraphInstantiate(x, graph, 0))
    return graph, x[0]


# -- rule 1: launches go to the current device's streams; no peer access, no peer memory --------

def test_launch_into_a_stream_of_another_device_is_an_invalid_handle(lib):
    k = fill_kernel(lib)
    ok(lib.cudaSetDevice(1))
    s1 = stream(lib)
    d1 = malloc(lib, 16)
    _, x1 = memset_graph(lib, s1, d1)
    ok(lib.cudaSetDevice(0))                  # device 0 current, stream of device 1
    assert fill(lib, k, d1, 4, 1, s1) == lib.cudaErrorInvalidResourceHandle
    assert lib.cudaGraphLaunch(x1, s1) == lib.cudaErrorInvalidResourceHandle
    assert lib.cudaGetLastError() == lib.cudaErrorInvalidResourceHandle
    # a graph of device 1 cannot run on device 0's default stream either
    assert lib.cudaGraphLaunch(x1, NULL_STREAM) == lib.cudaErrorInvalidResourceHandle
    ok(lib.cudaSetDevice(1))                  # with device 1 current all of these work
    ok(fill(lib, k, d1, 4, 1, s1))
    ok(lib.cudaGraphLaunch(x1, s1))
    ok(fill(lib, k, d1, 4, 2, NULL_STREAM))   # handle 0 is the *current* device's legacy stream
    ok(lib.cudaDeviceSynchronize())
    assert kernels.read(d1, 4) == (2).to_bytes(4, "little")


def test_kernel_touching_another_devices_memory_needs_peer_access(lib):
    k = fill_kernel(lib)
    ok(lib.cudaSetDevice(1))
    d1 = malloc(lib, 16)
    ok(lib.cudaSetDevice(0))
    ok(lib.cudaDeviceEnablePeerAccess(1, 0))
    assert lib.cudaDeviceEnablePeerAccess(1, 0) == lib.cudaErrorPeerAccessAlreadyEnabled
    # itself: as an H100 (tests/conformance/cuda_h100_2026-12-05.json, scenario peer_access_one_device)
    assert lib.cudaDeviceEnablePeerAccess(0, 0) == lib.cudaErrorPeerAccessUnsupported
    assert lib.cudaDeviceEnablePeerAccess(1, 1) == lib.cudaErrorInvalidValue      # flags must be 0
    ok(fill(lib, k, d1, 4, 5, NULL_STREAM))                # device 0 writes device 1's memory
    ok(lib.cudaDeviceSynchronize())
    assert kernels.read(d1, 4) == (5).to_bytes(4, "little")
    ok(lib.cudaSetDevice(1))
    assert lib.cudaDeviceDisablePeerAccess(0) == lib.cudaErrorPeerAccessNotEnabled  # access is one-way
    ok(lib.cudaSetDevice(0))
    ok(lib.cudaDeviceDisablePeerAccess(1))
    ok(fill(lib, k, d1, 4, 6, NULL_STREAM))                # the launch itself is accepted ...
    assert lib.cudaDeviceSynchronize() == lib.cudaErrorIllegalAddress   # ... the kernel faults
    assert "without peer access" in sim.state().errors[0][1]
    assert kernels.read(d1, 4) == (5).to_bytes(4, "little")


# -- rule 2: sticky errors poison the process; other errors are the thread's last error -----------

def _fault_on_device_0(lib):
    kernels.register("accel_test_oob", ("ptr",), lambda g, b, view, p: view(p, 1 << 20)[0], replace=True)
    try:
        rc, mod = load(lib, b".visible .entry accel_test_oob(.param .u64 p) { ret; }")
        ok(rc)
        rc, k = get_kernel(lib, mod, b"accel_test_oob")
        ok(rc)
        d = malloc(lib, 16)
        ok(launch(lib, k, [("ptr", d)], NULL_STREAM))
        assert lib.cudaDeviceSynchronize() == lib.cudaErrorIllegalAddress
    finally:
        kernels.unregister("accel_test_oob")


def test_a_device_fault_is_sticky_for_every_later_call_in_the_process(lib):
    ok(lib.cudaSetDevice(1))
    s1 = stream(lib)
    ok(lib.cudaSetDevice(0))
    _fault_on_device_0(lib)
    bad = lib.cudaErrorIllegalAddress
    p, n = ffi.new("void **"), ffi.new("int *")
    assert lib.cudaSetDevice(1) == bad                     # any call, any device ...
    assert lib.cudaMalloc(p, 16) == bad
    assert lib.cudaStreamSynchronize(s1) == bad
    assert lib.cudaStreamCreateWithPriority(ffi.new("cudaStream_t *"), 1, 0) == bad
    assert lib.cudaGetDeviceCount(n) == bad
    out = []
    t = threading.Thread(target=lambda: out.append(lib.cudaGetDevice(n)))   # ... any thread
    t.start()
    t.join()
    assert out == [bad]
    assert lib.cudaDeviceReset() == bad                    # a reset does not recover the process
    assert lib.cudaMalloc(p, 16) == bad
    assert lib.cudaGetLastError() == bad and lib.cudaGetLastError() == bad   # not cleared
    assert lib.cudaPeekAtLastError() == bad
    ok(lib.cudaRuntimeGetVersion(n))                       # no-init calls keep working
    assert ffi.string(lib.cudaGetErrorName(bad)) == b"cudaErrorIllegalAddress"


def test_non_sticky_errors_are_the_threads_last_error_until_read(lib):
    assert lib.cudaSetDevice(9) == lib.cudaErrorInvalidDevice
    ok(lib.cudaMalloc(ffi.new("void **"), 16))             # a success does not clear it
    assert lib.cudaPeekAtLastError() == lib.cudaErrorInvalidDevice
    assert lib.cudaPeekAtLastError() == lib.cudaErrorInvalidDevice
    assert lib.cudaGetLastError() == lib.cudaErrorInvalidDevice
    assert lib.cudaGetLastError() == 0
    ok(lib.cudaSetDevice(1))                               # the error was not sticky
    sim.configure(delay_us=1)
    s = stream(lib)
    ok(lib.cudaMemsetAsync(malloc(lib, 1 << 20), 0, 1 << 20, s))
    lib.cudaStreamQuery(s)                                 # cudaErrorNotReady is not an error ...
    assert lib.cudaGetLastError() == 0                     # ... and is never the last error
    ok(lib.cudaStreamSynchronize(s))


# -- rule 3: potentially unsafe calls during a capture ---------------------------------------------

def _unsafe_calls(lib):
    """name -> a call CUDA lists as potentially unsafe during stream capture; none touches the
    capturing stream (device 0, non-blocking) itself."""
    other = stream(lib)
    e = event(lib)
    ok(lib.cudaEventRecord(e, other))
    d, h = malloc(lib, 64), ffi.new("void **")
    ok(lib.cudaHostAlloc(h, 64, 0))
    spare_d, spare_h = malloc(lib, 64), ffi.new("void **")
    ok(lib.cudaHostAlloc(spare_h, 64, 0))

    def device_sync_of_device_1():
        ok(lib.cudaSetDevice(1))
        try:
            return lib.cudaDeviceSynchronize()
        finally:
            lib.cudaSetDevice(0)
    return {
        "cudaEventQuery": lambda: lib.cudaEventQuery(e),
        "cudaEventSynchronize": lambda: lib.cudaEventSynchronize(e),
        "cudaStreamQuery(other)": lambda: lib.cudaStreamQuery(other),
        "cudaStreamSynchronize(other)": lambda: lib.cudaStreamSynchronize(other),
        "cudaDeviceSynchronize(device 1)": device_sync_of_device_1,
        "cudaMemcpy": lambda: lib.cudaMemcpy(d, h[0], 64, lib.cudaMemcpyHostToDevice),
        "cudaMemset": lambda: lib.cudaMemset(d, 0, 64),
        "cudaMalloc": lambda: lib.cudaMalloc(ffi.new("void **"), 64),
        "cudaFree": lambda: lib.cudaFree(spare_d),
        "cudaHostAlloc": lambda: lib.cudaHostAlloc(ffi.new("void **"), 64, 0),
        "cudaFreeHost": lambda: lib.cudaFreeHost(spare_h[0]),
    }


UNSAFE = ["cudaEventQuery", "cudaEventSynchronize", "cudaStreamQuery(other)", "cudaStreamSynchronize(other)",
          "cudaDeviceSynchronize(device 1)", "cudaMemcpy", "cudaMemset", "cudaMalloc", "cudaFree",
          "cudaHostAlloc", "cudaFreeHost"]


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@pytest.mark.parametrize("name", UNSAFE)
def test_unsafe_call_during_a_global_capture_fails_and_invalidates_it(lib, name):
    calls = _unsafe_calls(lib)
    s = stream(lib)
    capture(lib, s, lib.cudaStreamCaptureModeGlobal)
    assert calls[name]() == lib.cudaErrorStreamCaptureUnsupported
    assert end_capture(lib, s)[0] == lib.cudaErrorStreamCaptureInvalidated
    # from another thread too: a global capture prohibits unsafe calls in every thread
    capture(lib, s, lib.cudaStreamCaptureModeGlobal)
    assert _in_thread(calls[name]) == lib.cudaErrorStreamCaptureUnsupported
    assert end_capture(lib, s)[0] == lib.cudaErrorStreamCaptureInvalidated


@pytest.mark.parametrize("name", UNSAFE)
def test_unsafe_call_is_allowed_in_relaxed_mode_and_beside_thread_local_captures(lib, name):
    calls = _unsafe_calls(lib)
    s = stream(lib)
    capture(lib, s, lib.cudaStreamCaptureModeGlobal)
    mode = ffi.new("enum cudaStreamCaptureMode *", lib.cudaStreamCaptureModeRelaxed)
    ok(lib.cudaThreadExchangeStreamCaptureMode(mode))
    try:
        ok(calls[name]())
    finally:
        ok(lib.cudaThreadExchangeStreamCaptureMode(mode))
    ok(end_capture(lib, s)[0])
    calls = _unsafe_calls(lib)
    capture(lib, s, lib.cudaStreamCaptureModeThreadLocal)
    assert _in_thread(calls[name]) == 0              # another thread's thread-local capture
    ok(end_capture(lib, s)[0])


# -- rule 4: the driver recycles handle values ------------------------------------------------------

def _value(handle):
    return int(ffi.cast("uintptr_t", handle))


def test_destroyed_stream_and_event_handles_are_handed_out_again(lib):
    a, b = stream(lib, flags=1), stream(lib, flags=1)
    ok(lib.cudaStreamDestroy(a))
    ok(lib.cudaStreamDestroy(b))
    c = stream(lib, flags=0)
    assert _value(c) == _value(b)                  # the most recently freed value first
    ok(lib.cudaSetDevice(1))
    d = stream(lib, flags=0)                       # values are not per device
    assert _value(d) == _value(a)
    flags = ffi.new("unsigned int *")
    ok(lib.cudaStreamGetFlags(a, flags))           # the stale handle now names the new stream
    assert flags[0] == 0
    dev = ffi.new("int *")
    ok(lib.cudaStreamGetDevice(a, dev))
    assert dev[0] == 1
    ok(lib.cudaSetDevice(0))
    e = event(lib)
    ok(lib.cudaEventRecord(e, c))
    ok(lib.cudaEventDestroy(e))
    f = event(lib, lib.cudaEventDisableTiming)
    assert _value(f) == _value(e)
    ok(lib.cudaEventQuery(e))                      # never recorded since it was created again
    ms = ffi.new("float *")
    assert lib.cudaEventElapsedTime(ms, e, e) == lib.cudaErrorInvalidResourceHandle   # no timing now


# -- rule 5: a child forked after the driver started cannot use CUDA ----------------------------------

def _in_child(fn) -> int:
    """Run fn() in an os.fork child; its return value is the exit status (never hangs)."""
    import os
    import signal
    import time
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            code = fn()
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status_ = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WEXITSTATUS(status_)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("forked child hung")


def _child_sees_initialization_error(lib) -> int:
    init = lib.cudaErrorInitializationError
    n, p = ffi.new("int *"), ffi.new("void **")
    got = [lib.cudaGetDeviceCount(n), lib.cudaSetDevice(0), lib.cudaMalloc(p, 16),
           lib.cudaStreamCreateWithPriority(ffi.new("cudaStream_t *"), 1, 0), lib.cudaDeviceSynchronize(),
           lib.cudaGetDeviceCount(n)]
    if got != [init] * len(got):
        print("child got", got)
        return 1
    if lib.cudaRuntimeGetVersion(n) != 0 or ffi.string(lib.cudaGetErrorName(init)) != b"cudaErrorInitializationError":
        return 2
    return 0


@pytest.mark.parametrize("first_call", ["cudaMalloc", "cudaGetDeviceCount"])
def test_child_forked_after_the_driver_started_gets_initialization_error(lib, first_call):
    n = ffi.new("int *")
    if first_call == "cudaMalloc":
        malloc(lib, 16)                       # the runtime (and a context) started
    else:
        ok(lib.cudaGetDeviceCount(n))        # only cuInit: counting starts the driver
    assert _in_child(lambda: _child_sees_initialization_error(lib)) == 0
    ok(lib.cudaGetDeviceCount(n))            # the parent is unaffected
    assert n[0] == 2


def test_child_forked_before_any_call_uses_cuda_normally(lib):
    v = ffi.new("int *")
    ok(lib.cudaRuntimeGetVersion(v))          # needs no initialization
    ok(lib.cudaDriverGetVersion(v))

    def child():
        n = ffi.new("int *")
        ok(lib.cudaGetDeviceCount(n))
        d = malloc(lib, 8)
        ok(lib.cudaMemset(d, 3, 8))
        return 0 if (n[0], kernels.read(d, 8)) == (2, b"\x03" * 8) else 1
    assert _in_child(child) == 0


# -- rule 6: dynamic shared memory opt-in, elapsed time across devices, context memory -------------

MAX_DYNAMIC_SHARED = 8     # cudaFuncAttributeMaxDynamicSharedMemorySize (driver_types.h)


def launch_shared(lib, k, ptr, shared, s=NULL_STREAM):
    values = [ffi.new("void **", ptr), ffi.new("uint64_t *", 1), ffi.new("uint32_t *", 1)]
    argv = ffi.new("void *[]", [ffi.cast("void *", v) for v in values])
    return lib.cudaLaunchKernel(ffi.cast("void *", k), ffi.new("dim3 *", (1, 1, 1))[0],
                                ffi.new("dim3 *", (32, 1, 1))[0], argv, shared, s)


def test_dynamic_shared_memory_above_48_kib_needs_cudaFuncSetAttribute(lib):
    k = fill_kernel(lib)
    d = malloc(lib, 16)
    kk = ffi.cast("void *", k)
    ok(launch_shared(lib, k, d, 48 * 1024))
    assert launch_shared(lib, k, d, 48 * 1024 + 1) == lib.cudaErrorInvalidValue
    ok(lib.cudaFuncSetAttribute(kk, MAX_DYNAMIC_SHARED, 100 * 1024))
    ok(launch_shared(lib, k, d, 100 * 1024))
    assert launch_shared(lib, k, d, 100 * 1024 + 1) == lib.cudaErrorInvalidValue
    assert lib.cudaFuncSetAttribute(kk, MAX_DYNAMIC_SHARED, 228 * 1024) == lib.cudaErrorInvalidValue  # > opt-in max
    assert lib.cudaFuncSetAttribute(kk, 1234, 1) == lib.cudaErrorInvalidValue
    assert lib.cudaFuncSetAttribute(ffi.cast("void *", 0x999), MAX_DYNAMIC_SHARED, 1) \
        == lib.cudaErrorInvalidDeviceFunction
    ok(lib.cudaSetDevice(1))                 # the opt-in was made for device 0's function
    d1 = malloc(lib, 16)
    assert launch_shared(lib, k, d1, 100 * 1024) == lib.cudaErrorInvalidValue
    ok(lib.cudaDeviceSynchronize())


def test_elapsed_time_between_events_of_two_devices_fails(lib):
    a = event(lib)
    ok(lib.cudaEventRecord(a, NULL_STREAM))
    ok(lib.cudaSetDevice(1))
    b = event(lib)
    ok(lib.cudaEventRecord(b, NULL_STREAM))
    ok(lib.cudaDeviceSynchronize())
    ms = ffi.new("float *")
    assert lib.cudaEventElapsedTime(ms, a, b) == lib.cudaErrorInvalidResourceHandle
    c = event(lib)
    ok(lib.cudaEventRecord(c, NULL_STREAM))
    ok(lib.cudaEventSynchronize(c))
    ok(lib.cudaEventElapsedTime(ms, b, c))


def test_the_context_holds_device_memory(lib):
    from accel._ffi import _nvml
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    ok(lib.cudaMemGetInfo(free, total))
    assert 0 < free[0] < total[0] == sim.config().memory      # nothing allocated, yet not all free
    reserved = total[0] - free[0]
    p = ffi.new("void **")
    assert lib.cudaMalloc(p, free[0] + 256) == lib.cudaErrorMemoryAllocation
    ok(lib.cudaMalloc(p, 1 << 20))
    ok(lib.cudaMemGetInfo(free, total))
    assert total[0] - free[0] == reserved + (1 << 20)
    nvml = sim.open_library("nvml")
    assert nvml.nvmlInit_v2() == 0
    try:
        h, mem = _nvml.ffi.new("nvmlDevice_t *"), _nvml.ffi.new("nvmlMemory_t *")
        assert nvml.nvmlDeviceGetHandleByIndex_v2(0, h) == 0
        assert nvml.nvmlDeviceGetMemoryInfo(h[0], mem) == 0
        assert (mem.total, mem.used, mem.free) == (total[0], total[0] - free[0], free[0])   # NVML agrees
    finally:
        nvml.nvmlShutdown()


# -- rule 8: no state per destroyed stream -------------------------------------------------------

def _tracked(R):
    return (len(R.engine.queues), sum(len(d.queues) for d in R.devices), sum(len(d.blocking) for d in R.devices),
            len(R.streams))


def test_state_is_bounded_by_live_streams(lib):
    import gc
    import tracemalloc
    from accel.sim import cudart
    d0 = malloc(lib, 64)
    ok(lib.cudaSetDevice(1))
    d1 = malloc(lib, 64)
    e = event(lib)

    def cycles(n):
        for i in range(n):
            dev = i % 2
            ok(lib.cudaSetDevice(dev))
            s = stream(lib, flags=i % 3 == 0)
            ok(lib.cudaMemsetAsync(d1 if dev else d0, i & 0xFF, 64, s))
            if dev:
                ok(lib.cudaEventRecord(e, s))
            ok(lib.cudaStreamDestroy(s))

    R = cudart.runtime()
    cycles(500)                                          # warm up: free lists, caches
    live = [stream(lib) for _ in range(3)]               # three live streams on device 1
    ok(lib.cudaSetDevice(0))
    ok(lib.cudaDeviceSynchronize())
    gc.collect()
    before = _tracked(R)
    tracemalloc.start()
    try:
        snap = tracemalloc.take_snapshot()
        cycles(5000)
        gc.collect()
        grown = sum(st.size_diff for st in tracemalloc.take_snapshot().compare_to(snap, "filename"))
    finally:
        tracemalloc.stop()
    after = _tracked(R)
    # queues: one legacy per device + the live streams; nothing per destroyed stream
    assert after == before, (before, after)
    assert after[0] == len(R.devices) + len(live)
    assert grown < 64 * 1024, f"{grown} bytes kept after 5,000 stream cycles"


def test_per_thread_default_streams_of_finished_threads_are_forgotten(lib):
    from accel.sim import cudart
    d = malloc(lib, 64)

    def use_per_thread_stream():
        ok(lib.cudaMemsetAsync(d, 1, 64, ffi.cast("cudaStream_t", 2)))    # cudaStreamPerThread
        ok(lib.cudaStreamSynchronize(ffi.cast("cudaStream_t", 2)))
    for _ in range(50):
        t = threading.Thread(target=use_per_thread_stream)
        t.start()
        t.join()
    stream(lib)                                      # any later stream creation sweeps them
    R = cudart.runtime()
    assert _tracked(R)[:3] == (len(R.devices) + 1, len(R.devices) + 1, 0), _tracked(R)


def test_busy_destroyed_streams_are_forgotten_once_their_work_ran(lib):
    from accel.sim import cudart
    sim.configure(delay_us=1)                    # all work goes through the stream workers
    R = cudart.runtime() or (lib.cudaGetDeviceCount(ffi.new("int *")), cudart.runtime())[1]
    before = _tracked(R)
    d = malloc(lib, 1 << 16)
    for _ in range(40):
        s = stream(lib, flags=0)
        for _ in range(3):
            ok(lib.cudaMemsetAsync(d, 1, 1 << 16, s))
        ok(lib.cudaStreamDestroy(s))             # work still queued: the queue drains, then goes
    ok(lib.cudaDeviceSynchronize())
    assert _tracked(R) == before
