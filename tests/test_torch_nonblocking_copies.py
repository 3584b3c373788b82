"""Non-blocking downloads into pinned host memory (issue 16): torch's pattern
``t.to("cpu", non_blocking=True)`` / ``dst.copy_(src, non_blocking=True)`` into a pinned
destination returns at once; the data is there once the stream (or an event) is synchronized.
Ported from test/test_cuda.py::TestCuda::test_copy_non_blocking and
test_to_non_blocking (semantics: the copy is ordered on the stream, the call does not wait)."""

import gc

import numpy as np
import pytest

import accel
from accel import memory
from conftest import SIMS, use_sim

N = 1 << 16


@pytest.fixture(params=SIMS)
def slow_sim_backend(request, monkeypatch):
    """Each simulator with every stream operation delayed by 20 ms (the copy is still queued
    when a non-blocking call returns)."""
    return use_sim(monkeypatch, request.param, ACCEL_SIM_DELAY_US=20000)


def test_cuda__empty_pinned_is_pinned_and_freed_with_the_array(slow_sim_backend):
    before = memory.host_allocator().stats()["allocated_bytes"]
    a = accel.empty_pinned((4, N // 16), dtype=np.float32)
    assert a.shape == (4, N // 16) and a.dtype == np.float32 and a.flags.c_contiguous
    assert memory.host_allocator().owns(a.ctypes.data, a.nbytes)
    view = a[1:]                          # a view keeps the memory alive
    del a
    gc.collect()
    assert memory.host_allocator().stats()["allocated_bytes"] > before
    del view
    gc.collect()
    assert memory.host_allocator().stats()["allocated_bytes"] == before
    with pytest.raises(ValueError, match="shape"):
        accel.empty_pinned((-1,))


def test_cuda__copy_to_pinned_non_blocking_returns_before_the_copy(slow_sim_backend):
    s = accel.Stream()
    buf = accel.Buffer(N, stream=s)
    buf.fill_(7, s)
    s.synchronize()
    for _ in range(3):
        buf.fill_(9, s)                    # slow work queued before the copy
    out = accel.empty_pinned(N)
    out[:] = 0
    buf.copy_to(out, s, non_blocking=True)
    assert not s.query(), "copy_to(non_blocking=True) into pinned memory waited for the stream"
    s.synchronize()
    assert (out == 9).all()


def test_cuda__copy_to_pageable_non_blocking_is_a_blocking_copy(slow_sim_backend):
    s = accel.Stream()
    buf = accel.Buffer(N, stream=s)
    buf.fill_(3, s)
    out = np.zeros(N, np.uint8)
    buf.copy_to(out, s, non_blocking=True)     # pageable: as torch, correct data at return
    assert (out == 3).all()


def test_cuda__to_numpy_non_blocking_gives_a_pinned_array_and_an_event(slow_sim_backend):
    s = accel.Stream()
    buf = accel.Buffer(N, stream=s)
    for _ in range(3):
        buf.fill_(5, s)
    arr, event = buf.to_numpy(np.uint16, stream=s, non_blocking=True)
    assert memory.host_allocator().owns(arr.ctypes.data, arr.nbytes)
    assert arr.dtype == np.uint16 and arr.size == N // 2
    event.synchronize()
    assert (arr == 0x0505).all()
