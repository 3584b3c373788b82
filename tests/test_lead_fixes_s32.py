"""Fixes of session 32 by the lead.

* The CUDA simulator refused a kernel launch on a stream of a device that is not current (the
  Programming Guide says it fails) and allowed copies there (the guide says they succeed), but it
  also allowed ``cudaMemsetAsync`` there, which the guide does not mention: silent, so refused now
  (accel/sim/cudart/copies.py).  ``Buffer.fill_`` on an owned stream of the other device queued its
  memset with device 0 current and failed under the rule (``test_two_devices.py::
  test_stream_work_on_the_other_device[cuda-0]`` raised cudaErrorInvalidResourceHandle); it makes the
  stream's device current for the call now (``Stream._current_scope``).
"""

import pytest

import accel
from accel import sim
from accel._ffi._cudart import ffi
from conftest import use_sim
from test_sim_cuda import lib, malloc, ok, stream  # noqa: F401 (lib: the fixture)

INVALID_HANDLE = 400


def _read(lib, p, n):
    out = bytearray(n)
    ok(lib.cudaMemcpy(ffi.from_buffer(out), p, n, 2))      # cudaMemcpyDeviceToHost
    return bytes(out)


def test_memset_on_a_stream_of_a_device_that_is_not_current_is_refused(lib):
    ok(lib.cudaSetDevice(1))
    s1 = stream(lib)
    p = malloc(lib, 256)
    ok(lib.cudaMemsetAsync(p, 7, 256, s1))
    ok(lib.cudaStreamSynchronize(s1))
    ok(lib.cudaSetDevice(0))
    assert lib.cudaMemsetAsync(p, 9, 256, s1) == INVALID_HANDLE      # nothing queued
    lib.cudaGetLastError()
    ok(lib.cudaStreamSynchronize(s1))
    ok(lib.cudaSetDevice(1))
    assert _read(lib, p, 256) == b"\x07" * 256
    # a copy there is fine (the guide says so)
    src = malloc(lib, 256)
    ok(lib.cudaMemsetAsync(src, 3, 256, s1))
    ok(lib.cudaSetDevice(0))
    ok(lib.cudaMemcpyAsync(p, src, 256, 3, s1))                    # cudaMemcpyDeviceToDevice
    ok(lib.cudaStreamSynchronize(s1))
    assert _read(lib, p, 256) == b"\x03" * 256
    assert sim.state().errors == []


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
@pytest.mark.parametrize("current", [0, 1])
def test_fill_on_an_owned_stream_of_the_other_device(monkeypatch, kind, current):
    """(test_two_devices.py covers the same inside a capture and with copies around it)"""
    use_sim(monkeypatch, kind, ACCEL_SIM_DEVICES=2)
    accel.set_device_index(current)
    other = 1 - current
    s = accel.Stream(other)
    b = accel.Buffer(4096, stream=s)
    for v in (5, 6):
        b.fill_(v, s)
        assert accel.current_device_index() == current
    assert (b.to_numpy(stream=s) == 6).all()
    assert sim.state().errors == []
    b.close()
    s.close()

