"""Helpers for the tests ported from PyTorch's test suite (tests/test_torch_*.py).

``hold(stream)`` stands in for ``torch.cuda._sleep(cycles)``: torch keeps a stream busy with
a spin kernel for a fixed time; the ported tests instead queue one operation on the simulated
stream that runs until the returned gate is set, so "the stream is still busy" holds for
exactly as long as the test needs it (no timing, no sleeps).  CUDA simulator only, and only
with ``ACCEL_SIM_DELAY_US`` > 0 (otherwise the simulator runs each operation inline, in the
calling thread)."""

import collections
import contextlib
import threading

#: the longest a held stream waits for its gate before it lets go by itself (a failed test
#: must not leave a worker thread blocked forever)
HOLD_LIMIT_S = 60.0


def hold(stream) -> threading.Event:
    """Queue, on the simulated CUDA ``stream`` (an accel.Stream, the legacy default stream
    too), an operation that runs until the returned event is set."""
    from accel.sim import core, cudart
    if core.delay_s == 0.0:
        raise RuntimeError("hold() needs ACCEL_SIM_DELAY_US > 0 (operations run inline otherwise)")
    runtime = cudart._R
    sim_stream = runtime.streams.get(stream.handle)
    if sim_stream is cudart.state._LEGACY:
        sim_stream = runtime.devices[stream.device_index].legacy
    gate = threading.Event()
    sim_stream.q.submit(lambda: gate.wait(HOLD_LIMIT_S))
    return gate


@contextlib.contextmanager
def held(*streams):
    """Keep ``streams`` busy in the body; release them (and wait for them) on the way out."""
    gates = [hold(s) for s in streams]
    try:
        yield gates
    finally:
        for gate in gates:
            gate.set()
        for s in streams:
            s.synchronize()


def expected_memory_stats(segments) -> dict:
    """TestCudaMultiGPU._check_memory_stat_consistency's expectations: per device, the
    ``*.current`` counters of memory_stats() as the memory_snapshot() ``segments`` imply them
    (expandable segments count in no segment.* and their blocks in no inactive_split* counter;
    requested bytes are summed over active blocks, pending ones too).  Asserts each segment's
    requested_size is its active blocks' sum, as torch's test does."""
    expected_each_device = collections.defaultdict(lambda: collections.defaultdict(int))
    for segment in segments:
        expandable = segment["is_expandable"]
        expected = expected_each_device[segment["device"]]
        pool_str = segment["segment_type"] + "_pool"
        if not expandable:
            expected["segment.all.current"] += 1
            expected["segment." + pool_str + ".current"] += 1
        expected["allocated_bytes.all.current"] += segment["allocated_size"]
        expected["allocated_bytes." + pool_str + ".current"] += segment["allocated_size"]
        expected["reserved_bytes.all.current"] += segment["total_size"]
        expected["reserved_bytes." + pool_str + ".current"] += segment["total_size"]
        expected["active_bytes.all.current"] += segment["active_size"]
        expected["active_bytes." + pool_str + ".current"] += segment["active_size"]
        expected["requested_bytes.all.current"] += segment["requested_size"]
        expected["requested_bytes." + pool_str + ".current"] += segment["requested_size"]
        sum_requested = 0
        is_split = len(segment["blocks"]) > 1
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                expected["allocation.all.current"] += 1
                expected["allocation." + pool_str + ".current"] += 1
            if block["state"].startswith("active_"):
                sum_requested += block["requested_size"]
                expected["active.all.current"] += 1
                expected["active." + pool_str + ".current"] += 1
            if block["state"] == "inactive" and is_split and not expandable:
                expected["inactive_split.all.current"] += 1
                expected["inactive_split." + pool_str + ".current"] += 1
                expected["inactive_split_bytes.all.current"] += block["size"]
                expected["inactive_split_bytes." + pool_str + ".current"] += block["size"]
        assert sum_requested == segment["requested_size"]
    return expected_each_device


def power2_div(size, div_factor):
    """torch's test helper (test_cuda.py): ``size`` rounded up to one of ``div_factor`` divisions
    of its power-of-two interval, as roundup_power2_divisions rounds a request."""
    pow2 = 1
    while pow2 < size:
        pow2 *= 2
    if pow2 == size:
        return pow2
    step = pow2 / 2 / div_factor
    ret = pow2 / 2
    while ret < size:
        ret += step
    return ret
