"""Second strictness audit of the CUDA simulator (issue r13): rules real CUDA enforces (or
leaves undefined) that the simulator used to accept, and the accel code that relied on them.

Sim rules are driven through the simulated libcudart as a CUDA program calls it (helpers of
tests/test_sim_cuda.py); accel-level tests drive the public API on the simulator.
"""

import gc

import numpy as np
import pytest

import accel
from accel import _lazy, sim
from accel._ffi import _cudadrv, cudart_module
from accel.sim import cuda_driver, kernels
from accel._ffi._cudart import ffi
from conftest import use_sim
from test_sim_cuda_strict import memset_graph
from test_sim_cuda import capture, end_capture, event, host_alloc, lib, malloc, ok, read, stream, write  # noqa: F401

INVALID_VALUE, CAPTURE_UNSUPPORTED, CAPTURE_INVALIDATED = 1, 900, 901
DEFAULT, H2H, H2D, D2H, D2D = 4, 0, 1, 2, 3


# -- copies: "The memory areas may not overlap" (cudaMemcpy / cudaMemcpyAsync) -------------------

def test_overlapping_copies_are_refused(lib):
    d = malloc(lib, 64)
    s = stream(lib)
    write(d, bytes(range(64)))
    for dst, src in ((d + 8, d), (d, d + 8), (d, d)):     # forward, backward, identical
        assert lib.cudaMemcpyAsync(ffi.cast("void *", dst), ffi.cast("void *", src), 16, DEFAULT, s) == INVALID_VALUE
        assert lib.cudaGetLastError() == INVALID_VALUE
        assert lib.cudaMemcpy(ffi.cast("void *", dst), ffi.cast("void *", src), 16, DEFAULT) == INVALID_VALUE
    ok(lib.cudaStreamSynchronize(s))
    assert read(d, 64) == bytes(range(64))                # nothing was copied
    # adjacent ranges do not overlap
    ok(lib.cudaMemcpyAsync(ffi.cast("void *", d + 16), ffi.cast("void *", d), 16, DEFAULT, s))
    ok(lib.cudaStreamSynchronize(s))
    assert read(d, 32) == bytes(range(16)) * 2
    # pinned host memory too (host to host through the runtime)
    h = host_alloc(lib, 64)
    assert lib.cudaMemcpyAsync(ffi.cast("void *", h + 4), h, 8, DEFAULT, s) == INVALID_VALUE
    lib.cudaGetLastError()


# -- copies: "dst and src pointers that do not match the direction of the copy" -------------------

def test_copy_kind_must_match_the_pointers(lib):
    d1, d2 = malloc(lib, 64), malloc(lib, 64)
    h1, h2 = host_alloc(lib, 64), host_alloc(lib, 64)
    pageable = bytearray(64)
    pg = ffi.from_buffer(pageable)
    s = stream(lib)
    wrong = [(d1, d2, H2D), (h1, h2, H2D), (d1, d2, D2H), (h1, h2, D2H), (h1, d1, D2D), (d1, h1, D2D),
             (d1, h1, H2H), (h1, d1, H2H), (pg, h1, H2D), (d1, pg, D2H), (pg, d1, H2H)]
    for dst, src, kind in wrong:
        assert lib.cudaMemcpyAsync(dst, src, 16, kind, s) == INVALID_VALUE, (kind, dst, src)
        lib.cudaGetLastError()
    right = [(d1, h1, H2D), (d1, pg, H2D), (h1, d1, D2H), (pg, d1, D2H), (d1, d2, D2D), (h1, h2, H2H),
             (d1, h1, DEFAULT), (h1, d1, DEFAULT), (d1, d2, DEFAULT)]
    for dst, src, kind in right:
        ok(lib.cudaMemcpyAsync(dst, src, 16, kind, s))
    ok(lib.cudaStreamSynchronize(s))


# -- streams: destroying a stream that is capturing ------------------------------------------------

def test_destroying_a_capturing_stream_is_refused(lib):
    s, side = stream(lib), stream(lib)
    capture(lib, s)
    e = event(lib)
    ok(lib.cudaEventRecord(e, s))
    ok(lib.cudaStreamWaitEvent(side, e, 0))           # side joins the capture
    for victim in (s, side):
        assert lib.cudaStreamDestroy(victim) == CAPTURE_UNSUPPORTED
        assert lib.cudaGetLastError() == CAPTURE_UNSUPPORTED
    assert end_capture(lib, s)[0] == CAPTURE_INVALIDATED
    # ended: both streams can go, and no capture is left behind to block unsafe calls
    ok(lib.cudaStreamDestroy(side))
    ok(lib.cudaStreamDestroy(s))
    ok(lib.cudaMalloc(ffi.new("void **"), 64))


# -- events: waiting on an event last recorded in a capture that has ended -------------------------

def test_waiting_on_an_event_of_an_ended_capture_is_refused(lib):
    s, other = stream(lib), stream(lib)
    e = event(lib)
    capture(lib, s)
    ok(lib.cudaEventRecord(e, s))
    rc, graph = end_capture(lib, s)
    ok(rc)
    # cudaErrorInvalidValue, the code an H200 returns (tests/test_sim_cuda_conformance.py)
    assert lib.cudaStreamWaitEvent(other, e, 0) == INVALID_VALUE
    lib.cudaGetLastError()
    capture(lib, other)                                # from another capture too
    assert lib.cudaStreamWaitEvent(other, e, 0) == INVALID_VALUE
    assert end_capture(lib, other)[0] == CAPTURE_INVALIDATED
    ok(lib.cudaEventRecord(e, s))                      # recorded again outside capture: usable
    ok(lib.cudaStreamWaitEvent(other, e, 0))
    ok(lib.cudaStreamSynchronize(other))
    ok(lib.cudaGraphDestroy(graph))


# -- modules: loading (driver < 12.3) and unloading while a capture is underway -------------------

RFFI = cudart_module(13).ffi
D = _cudadrv.ffi


def _driver_fn(lib, name):
    fp = RFFI.new("void **")
    st = RFFI.new("enum cudaDriverEntryPointQueryResult *")
    assert lib.cudaGetDriverEntryPointByVersion(name.encode(), fp, 12000, 0, st) == 0 and st[0] == 0
    return D.cast(cuda_driver.SYMBOLS[name][0], int(RFFI.cast("uintptr_t", fp[0])))


def _runtime_load(lib):
    p = ffi.new("cudaLibrary_t *")
    rc = lib.cudaLibraryLoadData(p, ffi.new("char[]", kernels.TEST_PTX), ffi.NULL, ffi.NULL, 0, ffi.NULL,
                                 ffi.NULL, 0)
    return rc, p[0]


def _driver_load(lib):
    p = D.new("CUmodule *")
    rc = _driver_fn(lib, "cuModuleLoadData")(p, D.from_buffer(bytearray(kernels.TEST_PTX + b"\0")))
    return rc, p[0]


PATHS = {"runtime": (_runtime_load, lambda lib, m: lib.cudaLibraryUnload(m)),
         "driver": (_driver_load, lambda lib, m: _driver_fn(lib, "cuModuleUnload")(m))}


@pytest.mark.parametrize("path", PATHS)
def test_module_load_during_capture_needs_a_12_3_driver(lib, path):
    load, unload = PATHS[path]
    sim.configure(runtime_version="12.8", driver_version="12.2")   # minor version compatibility
    lib = sim.open_library("cudart")
    s = stream(lib)
    capture(lib, s)
    assert load(lib)[0] == CAPTURE_UNSUPPORTED
    assert end_capture(lib, s)[0] == CAPTURE_INVALIDATED
    capture(lib, s, lib.cudaStreamCaptureModeThreadLocal)     # relaxed mode allows it
    mode = ffi.new("enum cudaStreamCaptureMode *", lib.cudaStreamCaptureModeRelaxed)
    ok(lib.cudaThreadExchangeStreamCaptureMode(mode))
    try:
        rc, m = load(lib)
        ok(rc)
    finally:
        ok(lib.cudaThreadExchangeStreamCaptureMode(mode))
    ok(end_capture(lib, s)[0])
    ok(unload(lib, m))
    sim.configure(runtime_version="12.8", driver_version="12.3")   # 12.3+: loading during capture works
    lib = sim.open_library("cudart")
    s = stream(lib)
    capture(lib, s)
    rc, m = load(lib)
    ok(rc)
    ok(end_capture(lib, s)[0])
    ok(unload(lib, m))


@pytest.mark.parametrize("path", PATHS)
def test_module_unload_during_capture_is_refused(lib, path):
    load, unload = PATHS[path]
    rc, m = load(lib)
    ok(rc)
    s = stream(lib)
    capture(lib, s)
    assert unload(lib, m) == CAPTURE_UNSUPPORTED
    assert end_capture(lib, s)[0] == CAPTURE_INVALIDATED
    ok(unload(lib, m))                                 # still loaded; after the capture it goes


# -- accel: what relied on the leniencies -------------------------------------------------------------

def test_buffer_copy_between_overlapping_buffers_is_refused(sim_cuda):
    base = accel.Buffer(64)
    base.copy_from(np.arange(64, dtype=np.uint8))
    head = accel.Buffer.from_ptr(base.ptr, 32, owner=base)
    tail = accel.Buffer.from_ptr(base.ptr + 16, 32, owner=base)
    with pytest.raises(ValueError, match="overlaps"):
        tail.copy_from(head)
    with pytest.raises(ValueError, match="overlaps"):
        head.copy_from(tail)
    assert base.to_numpy().tolist() == list(range(64))    # nothing was copied
    base.copy_from(base)                                  # the same bytes: nothing to do (as torch)
    same = accel.Buffer.from_ptr(base.ptr, 64, owner=base)
    same.copy_from(base)
    assert base.to_numpy().tolist() == list(range(64))
    apart = accel.Buffer.from_ptr(base.ptr + 32, 32, owner=base)
    apart.copy_from(head)                                 # adjacent, no overlap
    assert base.to_numpy().tolist() == list(range(32)) * 2


def _fill(module, buf, value):
    k = module.function("accel_test_fill_u32")
    accel.launch(k, 1, 32, buf, buf.nbytes // 4, value)


@pytest.mark.parametrize("how", ["close", "collect"])
def test_module_released_during_a_capture_is_unloaded_after_it(sim_cuda, how):
    buf = accel.Buffer(64)
    keep = accel.Module(kernels.TEST_PTX)
    doomed = accel.Module(kernels.TEST_PTX)
    g = accel.Graph()
    with accel.graph(g):
        _fill(keep, buf, 5)
        loaded = sim.state().modules      # (the capture loaded accel's RNG kernels first)
        if how == "close":
            doomed.close()
        else:
            del doomed
            gc.collect()
        assert sim.state().modules == loaded          # not while the capture is underway
    g.replay()
    accel.synchronize()
    assert buf.to_numpy("uint32").tolist() == [5] * 16
    backend = _lazy.lazy_init()
    assert not backend._after_capture                  # run when the capture ended
    assert sim.state().modules == loaded - 1


@pytest.mark.parametrize("runtime", ["12.8", "12.4"])    # cudaLibraryLoadData, cuModuleLoadData
def test_module_load_during_a_capture_on_an_old_driver_is_a_clear_error(monkeypatch, runtime):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CUDA_RUNTIME=runtime, ACCEL_SIM_CUDA_DRIVER="12.2")
    buf = accel.Buffer(64)
    keep = accel.Module(kernels.TEST_PTX)
    g = accel.Graph()
    with accel.graph(g):
        with pytest.raises(accel.CaptureError, match=r"driver .*12\.2.* 12\.3"):
            accel.Module(kernels.TEST_PTX)
        _fill(keep, buf, 9)                               # the capture was not invalidated
    g.replay()
    accel.synchronize()
    assert buf.to_numpy("uint32").tolist() == [9] * 16


def test_module_load_during_a_capture_on_a_12_3_driver_works(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CUDA_RUNTIME="12.8", ACCEL_SIM_CUDA_DRIVER="12.3")
    buf = accel.Buffer(64)
    g = accel.Graph()
    with accel.graph(g):
        m = accel.Module(kernels.TEST_PTX)
        _fill(m, buf, 3)
    g.replay()
    accel.synchronize()
    assert buf.to_numpy("uint32").tolist() == [3] * 16


def test_closing_a_capturing_stream_is_refused_and_keeps_the_capture(sim_cuda):
    s = accel.Stream()
    buf = accel.Buffer(64, stream=s)
    g = accel.Graph()
    with accel.graph(g, stream=s):
        buf.fill_(1)
        with pytest.raises(RuntimeError, match="capture on it is underway"):
            s.close()                                     # accel refuses before the runtime would
        buf.fill_(2)                                      # the capture goes on
    g.replay()
    accel.synchronize()
    assert buf.to_numpy().tolist() == [2] * 64
    s.close()


# -- graphs: destroying a graph or an executable graph while a capture is underway -----------------

def test_graph_destroy_during_a_capture_is_refused(lib):
    s, other = stream(lib), stream(lib)
    g, x = memset_graph(lib, other, malloc(lib, 16))
    for destroy in (lambda: lib.cudaGraphExecDestroy(x), lambda: lib.cudaGraphDestroy(g)):
        capture(lib, s)
        assert destroy() == CAPTURE_UNSUPPORTED
        assert end_capture(lib, s)[0] == CAPTURE_INVALIDATED
    capture(lib, s)                                    # relaxed mode allows it
    mode = ffi.new("enum cudaStreamCaptureMode *", lib.cudaStreamCaptureModeRelaxed)
    ok(lib.cudaThreadExchangeStreamCaptureMode(mode))
    try:
        ok(lib.cudaGraphExecDestroy(x))
    finally:
        ok(lib.cudaThreadExchangeStreamCaptureMode(mode))
    ok(end_capture(lib, s)[0])
    ok(lib.cudaGraphDestroy(g))                        # no capture underway


@pytest.mark.parametrize("how", ["reset", "collect"])
def test_graph_released_during_another_capture_is_destroyed_after_it(sim_cuda, how):
    buf = accel.Buffer(64)
    old = accel.Graph()
    with accel.graph(old):
        buf.fill_(1)
    new = accel.Graph()
    with accel.graph(new):
        buf.fill_(2)
        if how == "reset":
            old.reset()
        else:
            del old
            gc.collect()
    new.replay()
    accel.synchronize()
    assert buf.to_numpy().tolist() == [2] * 64
    assert sim.state().graph_execs == 1                # the old one went when the capture ended
