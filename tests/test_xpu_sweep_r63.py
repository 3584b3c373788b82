"""Level Zero: once the device is synchronized, no event slot keeps a destroyed stream alive.

A freed block waits for events recorded on the streams that used it; on Level Zero those are
slots of accel's event pools, retired after use and recycled by the backend's sweep once every
stream they depend on passed them.  The sweep ran only when a new slot was needed or a stream
made progress, so after ``synchronize()`` and ``empty_cache()`` a retired slot still named the
closed streams it depended on (r63b, simpleCallback): their objects lived on until some later
operation.  ``device_synchronize`` now sweeps what it waited for.
"""

from __future__ import annotations

import gc

import pytest

import accel
from accel import memory

from conftest import use_sim


@pytest.mark.parametrize("dev", [1, 0])
@pytest.mark.usefixtures("frozen_heap")     # its heap scan sees only this test's objects (r66i)
def test_no_destroyed_stream_outlives_a_device_synchronize(monkeypatch, dev):
    use_sim(monkeypatch, "xpu", ACCEL_SIM_DELAY_US=2000)
    kept = accel.Buffer(4096, device=dev).fill_(0)
    for i in range(5):
        s = accel.Stream(dev)
        kept.fill_(i, stream=s)         # still queued when the stream is destroyed
        s.close()
    kept.close()
    del s
    accel.synchronize(dev)
    memory.empty_cache()
    gc.collect()
    dead = [o for o in gc.get_objects() if type(o).__name__ == "_Stream"
            and type(o).__module__ == "accel.backends.xpu.streams" and o.dead]
    assert not dead, f"{len(dead)} destroyed stream(s) still alive after synchronize() and empty_cache()"
