"""r71p: accel on a machine whose devices cannot reach each other's memory (ACCEL_SIM_PEER=none).

The multi-device suites were rerun with ``ACCEL_TEST_SIM_PEER=none`` (tests/conftest.py); what a
user program can do there and that fails is kept here as a strict xfail, each test setting
ACCEL_SIM_PEER itself so it runs in the normal suite."""

import numpy as np
import pytest

import accel
from accel import sim

from conftest import use_sim


@pytest.fixture
def no_peer_cuda(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_PEER="none")      # default allocator: expandable segments
    yield
    sim.reset()


@pytest.fixture
def no_peer_async(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_PEER="none", ACCEL_ALLOC_CONF="backend:cudaMallocAsync")
    yield
    sim.reset()


def test_async_pool_add_peer_for_a_non_peer_device_is_a_no_op(no_peer_async):
    """What the pool allocator documents (and the caching allocator should match, below)."""
    accel.memory.device_allocator(0).add_peer(1)
    a = accel.Buffer(4096, device=0).fill_(2)
    b = accel.Buffer(4096, device=1)
    b.copy_from(a)
    assert (b.to_numpy() == 2).all()
    assert sim.state().errors == []


# (r71p found; fixed in session 31)
def test_caching_add_peer_for_a_non_peer_device_keeps_the_allocator_working(no_peer_cuda):
    """torch only calls enablePeerAccess for a pair that can (at::cuda::get_p2p_access); accel's
    public ``device_allocator(i).add_peer(j)`` checks only the index, so a program porting that
    call (or a warm-up granting access up front) makes device 1's allocator unusable: each new
    expandable-segment mapping grants the recorded peer access and the driver refuses it.  The
    async pool's add_peer is a documented no-op for such a device; this one should be too (or
    refuse it clearly, changing nothing)."""
    try:
        accel.memory.device_allocator(1).add_peer(0)
    except (ValueError, RuntimeError) as exc:       # a clear refusal would be fine too
        assert "peer" in str(exc) and "cuMemSetAccess" not in str(exc)
    buf = accel.Buffer(4096, device=1).fill_(3)   # (fails here: cuMemSetAccess ... INVALID_DEVICE)
    other = accel.Buffer(4096, device=0)
    other.copy_from(buf)
    assert (other.to_numpy() == 3).all()
    assert sim.state().errors == []


# (r71p found; fixed in session 31)
def test_caching_add_peer_for_a_non_peer_device_after_mapping_is_not_a_driver_error(no_peer_cuda):
    keep = accel.Buffer(4096, device=1).fill_(1)          # a mapping exists: add_peer grants it at once
    try:
        accel.memory.device_allocator(1).add_peer(0)
    except Exception as exc:
        assert "cuMemSetAccess" not in str(exc), str(exc)
    assert (keep.to_numpy() == 1).all()
    out = np.empty(4096, np.uint8)
    accel.Buffer(4096, device=0).copy_from(keep).copy_to(out)
    assert (out == 1).all()
