"""Copies between pinned host memory and a Buffer captured into a graph (torch: "Cannot copy
between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned"): each
replay copies again, so the pinned block is held by the graph and is not reused before the
graph is released and its queued replays ran (accel.memory._host.CaptureHold)."""

import gc

import numpy as np
import pytest

import accel
from accel import _lazy
from accel._errors import CaptureError
from accel.graphs import Graph
from conftest import use_sim
from torch_port_util import hold


@pytest.fixture(params=["cuda", "xpu"])
def sim(request, monkeypatch):
    return use_sim(monkeypatch, request.param)


def _parked() -> int:
    return len(accel.memory.host_allocator()._parked)


@pytest.mark.parametrize("device", [0, 1])
def test_replays_read_and_write_the_pinned_memory_of_the_moment(sim, device):
    src = accel.empty_pinned(4, np.float32)
    dst = accel.empty_pinned(4, np.float32)
    with accel.device_index(device):
        buf = accel.Buffer(16)
        g = Graph()
        with accel.graph(g):
            buf.copy_from(src, non_blocking=True)
            buf.copy_to(dst, non_blocking=True)
        for value in (1.0, 2.5):
            src[:] = value
            g.replay()
            accel.synchronize(device)
            assert dst.tolist() == [value] * 4
        g.reset()
    assert _parked() == 0


def test_a_held_block_is_parked_until_the_graph_goes_then_reused(sim):
    data = accel.empty_pinned(8, np.float32)
    ptr = data.ctypes.data
    buf = accel.Buffer(32)
    g = Graph()
    with accel.graph(g):
        buf.copy_from(data, non_blocking=True)
    del data
    assert _parked() == 1
    assert accel.memory.host_allocator().stats()["pending"] == 1
    other = accel.empty_pinned(8, np.float32)
    assert other.ctypes.data != ptr            # the graph still copies from it
    g.replay()
    accel.synchronize()
    g.reset()
    assert _parked() == 0
    again = accel.empty_pinned(8, np.float32)
    assert again.ctypes.data == ptr            # released, its replay done: reused
    del other, again


def test_after_release_the_block_waits_for_replays_still_queued(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=100)
    data = accel.empty_pinned(8, np.float32)
    ptr = data.ctypes.data
    buf = accel.Buffer(32)
    s = accel.Stream()
    g = Graph()
    with accel.graph(g):
        buf.copy_from(data, non_blocking=True)
    del data
    gate = hold(s)
    try:
        with s:
            g.replay()                         # queued behind the gate: it has not read the block yet
        g.reset()
        assert _parked() == 0
        other = accel.empty_pinned(8, np.float32)
        assert other.ctypes.data != ptr        # the replay still reads it
    finally:
        gate.set()
        s.synchronize()
    again = accel.empty_pinned(8, np.float32)
    assert again.ctypes.data == ptr
    del other, again


def test_blocking_and_pageable_copies_are_refused_and_the_capture_goes_on(sim):
    pinned = accel.empty_pinned(4, np.float32)
    pinned[:] = 3
    buf = accel.Buffer(16)
    g = Graph()
    with accel.graph(g):
        with pytest.raises(CaptureError, match="pass non_blocking=True"):
            buf.copy_from(pinned)
        with pytest.raises(CaptureError, match="pass non_blocking=True"):
            buf.copy_to(pinned)
        with pytest.raises(CaptureError, match="unless the CPU memory is pinned"):
            buf.copy_from(np.ones(4, np.float32), non_blocking=True)
        with pytest.raises(CaptureError, match="unless the CPU memory is pinned"):
            buf.copy_to(np.ones(4, np.float32), non_blocking=True)
        buf.copy_from(pinned, non_blocking=True)
    g.replay()
    assert buf.to_numpy(np.float32).tolist() == [3] * 4
    g.reset()
    assert _parked() == 0


def test_a_capture_not_made_by_an_accel_graph_is_refused(monkeypatch):
    use_sim(monkeypatch, "cuda")
    be = _lazy.lazy_init()
    pinned = accel.empty_pinned(4, np.float32)
    buf = accel.Buffer(16)
    s = accel.Stream()
    be.capture_begin(s.handle, "thread_local")
    try:
        with pytest.raises(CaptureError, match="not into an accel.Graph"):
            buf.copy_from(pinned, non_blocking=True, stream=s)
    finally:
        handle = be.capture_end(s.handle)
        be.graph_destroy(handle)
    assert accel.memory.host_allocator()._blocks[pinned.ctypes.data].holds is None


def test_a_graph_dropped_mid_capture_or_failed_releases_its_blocks(sim):
    data = accel.empty_pinned(8, np.float32)
    buf = accel.Buffer(32)
    s = accel.Stream()
    g = Graph()
    with s:
        g.capture_begin()
        buf.copy_from(data, non_blocking=True)
    del data
    assert _parked() == 1
    del g
    gc.collect()
    accel.synchronize()                        # a safe point: the finalizer ends the capture
    assert _parked() == 0
    accel.memory.empty_host_cache()
    assert accel.memory.host_allocator()._blocks == {}


def test_many_graphs_leave_no_state_behind(sim):
    buf = accel.Buffer(64)
    for i in range(20):
        data = accel.empty_pinned(16, np.float32)
        data[:] = i
        g = Graph()
        with accel.graph(g):
            buf.copy_from(data, non_blocking=True)
        del data
        g.replay()
        g.reset()
    accel.synchronize()
    host = accel.memory.host_allocator()
    assert _parked() == 0 and not host._used_on or all(not v for v in host._used_on.values())
    assert buf.to_numpy(np.float32).tolist() == [19] * 16
    accel.memory.empty_host_cache()
    assert host._blocks == {}
