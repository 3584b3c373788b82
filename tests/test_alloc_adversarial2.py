"""Adversarial cases of the caching device allocator (round two, r20): combinations of
streams destroyed, work still queued, injected vendor failures, expandable segments on the
device that is not current (device 1 while device 0 is current), checked against the
allocator's invariants (``test_alloc_stress._check_caching``), its snapshot and the data of
live blocks, on the simulated CUDA runtime."""

import threading

import numpy as np
import pytest

from accel import _lazy, sim
from accel._errors import AcceleratorError
from accel.memory import _config
from accel.memory._caching import DeviceCachingAllocator
from accel.sim import _vmm
from conftest import use_sim
from test_alloc_stress import _check_caching

MiB = 1 << 20
CUDA_INVALID_VALUE = 1
DEV = 1          # the allocator's device; device 0 stays current throughout

CONFS = ["expandable_segments:True", "expandable_segments:False"]


@pytest.fixture
def be(monkeypatch):
    if not _vmm.supported():
        pytest.skip("this host cannot play virtual memory (mmap)")
    # queued work runs on the simulator's worker threads, so a stream can be kept busy (_hold)
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=20)
    yield _lazy.lazy_init()
    sim.clear_faults()


def _on(be, fn, *args):
    """``fn(*args)`` with device DEV current, device 0 current again after."""
    prev = be.get_device()
    be.set_device(DEV)
    try:
        return fn(*args)
    finally:
        be.set_device(prev)


def _hold(stream: int) -> threading.Event:
    """Queue on the simulated ``stream`` an operation that runs until the returned gate is set
    (torch_port_util.hold for a raw handle)."""
    from accel.sim import cudart
    gate = threading.Event()
    cudart._R.streams.get(stream).q.submit(lambda: gate.wait(60))
    return gate


def _read(be, ptr: int, nbytes: int, stream: int) -> np.ndarray:
    host = np.empty(nbytes, np.uint8)
    _on(be, be.memcpy_async, host.ctypes.data, ptr, nbytes, stream)
    _on(be, be.stream_synchronize, stream)
    return host


def _all_returned(be, alloc) -> None:
    _check_caching(alloc)
    st = alloc.stats()
    assert (st["reserved_bytes.all.current"], st["segment.all.current"], st["active.all.current"]) == (0, 0, 0)
    s = sim.state()
    assert (s.vmm_mappings, s.vmm_handles, s.vmm_reservations, s.live_allocations) == (0, 0, 0, {})
    assert (s.streams, s.events) == (0, 0)


# -- forget_stream that fails part-way -------------------------------------------------------

@pytest.mark.parametrize("conf", CONFS)
@pytest.mark.parametrize("fails_at", [0, 1, 2], ids=["stream-lists", "first-use", "second-use"])
def test_forget_stream_that_cannot_cover_its_work_changes_nothing(be, conf, fails_at):
    """forget_stream records an event on the dying stream for its free lists and one for each
    use (record_stream) of another stream's block on it; when a record fails and so does the
    wait for the stream instead, the error propagates and the stream stays alive (its owner
    does not destroy it).  Nothing may have changed then: before, the event for the lists had
    been recorded and the lists set aside (they joined the default stream's once that event
    completed), and a use covered before the failing one was replaced by that event, so work
    queued on the still-live stream afterwards was no longer waited for."""
    alloc = DeviceCachingAllocator(be, DEV, _config.parse(conf))
    s = _on(be, be.stream_create)
    d = be.default_stream(DEV)
    alloc.free(alloc.malloc(16 * MiB, d))      # room on d: nothing below grows (which waits for s)
    mine = alloc.malloc(3 * MiB, s)
    users = [alloc.malloc(2 * MiB, d), alloc.malloc(2 * MiB, d)]
    for ptr in users:
        alloc.record_stream(ptr, s, DEV)
    events = sim.state().events
    sim.inject_error("cudaEventRecord", CUDA_INVALID_VALUE, times=1, after=fails_at)
    sim.inject_error("cudaStreamSynchronize", CUDA_INVALID_VALUE, times=1)
    with pytest.raises(AcceleratorError, match="cudaStreamSynchronize"):
        alloc.forget_stream(s, DEV)
    sim.clear_faults()
    _check_caching(alloc)
    assert s in alloc._general, "the live stream's free lists were set aside"
    for ptr in users:
        assert (s, DEV) in alloc._blocks[ptr].uses, "a use on the live stream was replaced"
    assert not alloc._pending_events
    assert sim.state().events <= events + 3       # recorded events wait in the cache, not leaked
    # the stream lives on: work queued on it now still guards the memory it uses
    mark = _on(be, be.event_create)
    _on(be, be.event_record, mark, s)           # after every event forget_stream recorded
    gate = _hold(s)
    _on(be, be.memset_async, mine, 1, 3 * MiB, s)
    for ptr in users:
        _on(be, be.memset_async, ptr, 1, 2 * MiB, s)
    alloc.free(mine)
    for ptr in users:
        alloc.free(ptr)
    _on(be, be.event_synchronize, mark)         # (those events completed: no timing below)
    _on(be, be.event_destroy, mark)
    fresh = [alloc.malloc(3 * MiB, d), alloc.malloc(2 * MiB, d), alloc.malloc(2 * MiB, d)]
    for ptr, n in zip(fresh, (3 * MiB, 2 * MiB, 2 * MiB)):
        _on(be, be.memset_async, ptr, 2, n, d)
    gate.set()
    _on(be, be.stream_synchronize, s)
    for ptr, n in zip(fresh, (3 * MiB, 2 * MiB, 2 * MiB)):
        assert (_read(be, ptr, n, d) == 2).all(), "work of the live stream clobbered a block handed out since"
        alloc.free(ptr)
    _check_caching(alloc)
    alloc.forget_stream(s, DEV)
    _on(be, be.stream_destroy, s)
    alloc.empty_cache()
    _all_returned(be, alloc)
