"""One failed vendor call leaves nothing behind (issue 13, item 4).

The targeted tests pin the leaks found by hand; the sweep injects one failure at
the 1st, 2nd, ... call of every vendor function a standard workload makes, then
tears down and checks that accel's memory statistics, the simulator's live
objects and a fresh workload all look as if the fault never happened.
"""

import numpy as np
import pytest

import accel
from accel import memory, sim
from accel._errors import AcceleratorError

# Non-sticky generic errors (a device fault, 700/719, poisons a CUDA process by design).
CUDA_INVALID_VALUE = 1


def _cuda_live():
    st = sim.state()
    return {"allocations": st.live_allocations, "host": st.host_allocations, "streams": st.streams,
            "events": st.events}


# -- the leaks found by hand ----------------------------------------------------------------

@pytest.mark.parametrize("call", ["cudaMemcpyAsync", "cudaSetDevice"])
def test_failed_staging_copy_frees_the_pinned_block(sim_cuda, call):
    buf = accel.Buffer(4096, device=1)
    s = accel.Stream(device=1)
    memory.host_allocator()
    sim.inject_error(call, CUDA_INVALID_VALUE)
    with pytest.raises(AcceleratorError, match=call):
        buf.copy_from(np.ones(1024, np.float32), stream=s, non_blocking=True)
    assert memory.host_allocator().stats()["allocated_bytes"] == 0
    memory.empty_host_cache()
    assert memory.host_allocator().stats()["reserved_bytes"] == 0
    assert sim.state().host_allocations == 0
    # the buffer and the stream still work
    buf.copy_from(np.full(1024, 2, np.float32), stream=s, non_blocking=True)
    assert (buf.to_numpy("float32", stream=s) == 2).all()


def test_failed_event_record_in_pinned_free_does_not_fail_the_copy(sim_cuda):
    """The copy arrived; the staging block's event could not be recorded, so the allocator
    waits for the stream instead.  Nothing to report, and nothing leaks."""
    buf = accel.Buffer(4096, device=1)
    s = accel.Stream(device=1)
    sim.inject_error("cudaEventRecord", CUDA_INVALID_VALUE)
    buf.copy_from(np.full(1024, 3, np.float32), stream=s, non_blocking=True)
    assert (buf.to_numpy("float32", stream=s) == 3).all()
    buf.close()
    s.close()
    memory.empty_cache()
    memory.empty_host_cache()
    assert memory.host_allocator().stats()["reserved_bytes"] == 0
    assert memory.memory_reserved(1) == 0
    assert _cuda_live() == {"allocations": {}, "host": 0, "streams": 0, "events": 0}


def test_failed_event_record_in_device_free(sim_cuda):
    s = accel.Stream(device=1)
    buf = accel.Buffer(4096, device=1)
    buf.fill_(1, stream=s)          # a use on another stream: free records an event there
    sim.inject_error("cudaEventRecord", CUDA_INVALID_VALUE)
    buf.close()                     # the stream is synchronized instead; no error to report
    assert memory.memory_allocated(1) == 0
    s.close()
    memory.empty_cache()
    assert memory.memory_reserved(1) == 0
    assert _cuda_live() == {"allocations": {}, "host": 0, "streams": 0, "events": 0}


def test_failed_free_in_empty_cache_keeps_the_segment(sim_cuda):
    accel.Buffer(4096, device=1).close()
    reserved = memory.memory_reserved(1)
    assert reserved > 0
    sim.inject_error("cudaFree", CUDA_INVALID_VALUE)
    with pytest.raises(AcceleratorError, match="cudaFree"):
        memory.empty_cache()
    # still cached, still the device's: counted as reserved and freed by the next empty_cache
    assert memory.memory_reserved(1) == reserved
    assert sim.state().live_allocations == {1: 1}
    memory.empty_cache()
    assert memory.memory_reserved(1) == 0
    assert sim.state().live_allocations == {}


def test_failed_event_query_keeps_each_event_once(sim_cuda):
    alloc = memory.device_allocator(1)
    streams = [accel.Stream(device=1) for _ in range(3)]
    bufs = [accel.Buffer(4096, device=1) for _ in range(3)]
    for b, s in zip(bufs, streams):
        b.fill_(1, stream=s)
    for b in bufs:
        b.close()
    for s in streams:
        s.synchronize()
    sim.inject_error("cudaEventQuery", CUDA_INVALID_VALUE, after=1)
    with pytest.raises(AcceleratorError, match="cudaEventQuery"):
        with alloc._lock:
            alloc._process_events()
    with alloc._lock:
        alloc._process_events()
    cached = [e for events in alloc._event_cache.values() for e in events]
    pending = [entry[0] for entry in alloc._pending_events]
    assert len(cached + pending) == len(set(cached + pending)) == 3
    for s in streams:
        s.close()
    memory.empty_cache()
    assert memory.memory_reserved(1) == 0
    assert _cuda_live() == {"allocations": {}, "host": 0, "streams": 0, "events": 0}
