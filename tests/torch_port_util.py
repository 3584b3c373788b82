"""Helpers for the tests ported from PyTorch's test suite (tests/test_torch_*.py).

``hold(stream)`` stands in for ``torch.cuda._sleep(cycles)``: torch keeps a stream busy with
a spin kernel for a fixed time; the ported tests instead queue one operation on the simulated
stream that runs until the returned gate is set, so "the stream is still busy" holds for
exactly as long as the test needs it (no timing, no sleeps).  CUDA simulator only, and only
with ``ACCEL_SIM_DELAY_US`` > 0 (otherwise the simulator runs each operation inline, in the
calling thread)."""

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
    if sim_stream is cudart._LEGACY:
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
