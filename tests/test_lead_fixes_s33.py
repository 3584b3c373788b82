"""Session 33's own checks of the host copy ``__dlpack__(dl_device=(kDLCPU, 0), copy=True)``
(accel/_dlpack/exporting.py export_host_copy): what it refuses, before any download, and that the copy
holds the data queued last, on device 1 while device 0 is current."""

import gc

import numpy as np
import pytest

import accel
from accel import _dlpack as D
from conftest import SIMS, use_sim

CPU = (D.DLDeviceType.kDLCPU, 0)


@pytest.fixture(params=SIMS)
def last_device(request, monkeypatch):
    use_sim(monkeypatch, request.param, ACCEL_SIM_DEVICES=2, ACCEL_SIM_DELAY_US=200)
    return accel.device_count() - 1


def _exports():
    gc.collect()
    return D.live_exports(), len(D._capsules)


def test_host_copy_reads_the_work_queued_on_a_side_stream(last_device):
    """The copy waits for the buffer's last-use stream (a side stream of the last device, its
    fills delayed), whichever stream is current; it is numpy's memory, flagged IS_COPIED, and
    accel keeps nothing for it."""
    d = last_device
    side = accel.Stream(d)
    buf = accel.Buffer(4096, device=d, stream=side)
    view = buf.as_array(np.int32, (32, 32))
    before = _exports()
    for value in range(1, 6):
        buf.fill_(value, stream=side)
        capsule = view.__dlpack__(max_version=(1, 0), dl_device=CPU, copy=True)
        info = D.parse(capsule)
        assert (info.device_type, info.flags & D.FLAG_IS_COPIED, info.shape) == (1, D.FLAG_IS_COPIED, (32, 32))
        del capsule, info
    buf.fill_(9, stream=side)
    host = np.from_dlpack(view, device="cpu", copy=True)
    assert host.flags.writeable and (host.view(np.uint8) == 9).all()
    assert _exports() == before
    assert accel.current_device_index() == 0


def test_host_copy_refusals_change_nothing(last_device):
    """A consumer stream with a host copy (ValueError) and a dtype DLPack cannot describe
    (BufferError) are refused before any download; nothing stays exported; kDLCUDAHost and
    copy=True with the buffer's own device keep their refusals."""
    d = last_device
    buf = accel.Buffer(64, device=d)
    structured = buf.as_array([("a", "<i4"), ("b", "<f4")], (8,))
    before = _exports()
    with pytest.raises(ValueError, match="needs no consumer stream"):
        buf.__dlpack__(dl_device=CPU, copy=True, stream=5)
    with pytest.raises(BufferError, match="cannot describe"):
        structured.__dlpack__(dl_device=CPU, copy=True, max_version=(1, 0))
    with pytest.raises(BufferError):
        buf.__dlpack__(dl_device=(D.DLDeviceType.kDLCUDAHost, 0), copy=True)
    # (copy=True on its own device makes a device copy since session 39: r80b)
    assert _exports() == before
    assert accel.current_device_index() == 0
