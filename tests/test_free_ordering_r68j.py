"""A properly ordered cudaFreeAsync is never refused because of when the device ran (r68j).

Seen once under heavy machine load: ``test_api_state_machine[cuda-async]`` (derandomized, so the
steps were the same as in every passing run) failed with ``AcceleratorError: libcudart:
cudaFreeAsync failed with cudaErrorInvalidValue (1)``.  The refusal is r68d's rule (CUDA Runtime
API, cudaFreeAsync: "The allocation must not be accessed after stream execution reaches the free"):
a free on a stream not ordered after a pending use on another stream is refused.  accel was not
at fault: its free (accel.memory._async, ``_free_now``) records an event on each stream
``record_stream`` named and makes the allocation stream wait for it first, the Programming Guide's
pattern, and the state machine with every queued operation held until the host waits (400 random
examples, ~4000 frees, ~190 with a use still pending on another stream) had no unordered free.

The simulator was: ``common._ordered_after`` asked whether the use had completed *before* taking
the engine lock, then, under it, looked for a path of pending waits from the freeing stream to the
use.  When the use and the wait that orders the free after it (cudaStreamWaitEvent: "Makes all
future work submitted to stream wait for all work captured in event"; or the legacy stream's
implicit synchronization with blocking streams, "Stream synchronization behavior") both completed
in between, as when the host thread is preempted there, the walk found neither the pending use nor
the wait, and answered "not ordered": a false refusal.  Each test here opens that window on purpose:
the first time ``_ordered_after`` reaches for the engine lock, the gate holding the use is released
and every queue drained, then the call goes on.  Same window for ``cudaMallocAsync``'s rule
(``_unmade``: memory used on a stream ordered after the allocation by an event).
"""

import sys

import pytest

import accel
from accel import sim
from accel._ffi._cudart import ffi
from accel.sim.cudart import state as cudart_state
from conftest import use_sim
from test_sim_cuda import NULL_STREAM, _gates, event, gate, ok, stream
from torch_port_util import hold

INVALID_VALUE = 1
BLOCKING = 0                       # cudaStreamDefault (accel.Stream's flags)
DISABLE_TIMING = 2                 # cudaEventDisableTiming


class _Window:
    """Stands in for the runtime's engine during one call: the first read of ``.lock`` made by
    ``_ordered_after`` first lets ``gate`` go and waits until every queue drained (the device ran
    everything while the host thread was between its two looks).  Everything else is the engine's."""

    def __init__(self, engine, gate_):
        self._engine, self._gate, self.opened = engine, gate_, False

    def __getattr__(self, name):
        return getattr(self._engine, name)

    @property
    def lock(self):
        if not self.opened and sys._getframe(1).f_code.co_name == "_ordered_after":
            self.opened = True
            self._gate.set()
            for q in list(self._engine.queues):
                q.wait()
        return self._engine.lock


def _in_window(gate_, call):
    """``call()`` with the window open (see _Window); returns its result."""
    R = cudart_state.runtime()
    window = _Window(R.engine, gate_)
    R.engine = window
    try:
        result = call()
    finally:
        R.engine = window._engine
    assert window.opened, "the call never asked _ordered_after: the window was not tested"
    return result


@pytest.fixture
def lib():
    sim.reset()
    sim.configure(delay_us=1)      # every operation through the stream workers (no inline run)
    yield sim.open_library("cudart")
    for g in _gates.values():
        g.set()
    sim.reset()


def _made(lib, s, n=4096):
    p = ffi.new("void **")
    ok(lib.cudaMallocAsync(p, n, s))
    ok(lib.cudaStreamSynchronize(s))
    return p[0]


# -- the simulated runtime, called directly ---------------------------------------------------------

def test_free_ordered_by_an_event_wait_is_accepted_when_the_use_completes_meanwhile(lib):
    a, b = stream(lib), stream(lib)
    p = _made(lib, a)
    g = gate(lib, b, 6801)
    ok(lib.cudaMemsetAsync(p, 3, 4096, b))                  # the use, held on b
    done = event(lib, DISABLE_TIMING)
    ok(lib.cudaEventRecord(done, b))
    ok(lib.cudaStreamWaitEvent(a, done, 0))                  # a is ordered after it
    assert _in_window(g, lambda: lib.cudaFreeAsync(p, a)) == 0
    ok(lib.cudaDeviceSynchronize())
    assert sim.state().errors == []


def test_free_on_the_legacy_stream_after_a_blocking_streams_use_is_accepted_when_it_completes_meanwhile(lib):
    b = stream(lib, flags=BLOCKING)
    p = _made(lib, NULL_STREAM)
    g = gate(lib, b, 6802)
    ok(lib.cudaMemsetAsync(p, 3, 4096, b))                  # the legacy stream waits for b's work
    assert _in_window(g, lambda: lib.cudaFreeAsync(p, NULL_STREAM)) == 0
    ok(lib.cudaDeviceSynchronize())
    assert sim.state().errors == []


def test_use_ordered_after_the_allocation_by_an_event_is_accepted_when_it_completes_meanwhile(lib):
    a, b = stream(lib), stream(lib)
    g = gate(lib, a, 6803)
    p = ffi.new("void **")
    ok(lib.cudaMallocAsync(p, 4096, a))                     # the allocation point, held on a
    made = event(lib, DISABLE_TIMING)
    ok(lib.cudaEventRecord(made, a))
    ok(lib.cudaStreamWaitEvent(b, made, 0))
    assert _in_window(g, lambda: lib.cudaMemsetAsync(p[0], 3, 4096, b)) == 0
    ok(lib.cudaFreeAsync(p[0], b))
    ok(lib.cudaDeviceSynchronize())
    assert sim.state().errors == []


def test_an_unordered_free_is_still_refused(lib):
    # the window changes nothing when the free really races the use: at the decision the use is
    # pending (the gate is only released by the window, which this call never opens)
    a, b = stream(lib), stream(lib)
    p = _made(lib, a)
    g = gate(lib, b, 6804)
    ok(lib.cudaMemsetAsync(p, 3, 4096, b))
    assert lib.cudaFreeAsync(p, a) == INVALID_VALUE
    g.set()
    ok(lib.cudaDeviceSynchronize())
    ok(lib.cudaFreeAsync(p, a))
    ok(lib.cudaDeviceSynchronize())
    assert sim.state().errors == []


# -- accel under backend:cudaMallocAsync: the state machine's side_use_then_reuse step ---------------

@pytest.mark.parametrize("alloc_on", ["default stream", "another stream"])
def test_accel_free_after_record_stream_survives_the_window(monkeypatch, alloc_on):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="backend:cudaMallocAsync", ACCEL_SIM_DELAY_US=1,
            ACCEL_SIM_DEVICES=2)
    s = accel.Stream(0)
    other = accel.Stream(0) if alloc_on == "another stream" else None
    b = accel.Buffer(1 << 16, 0, stream=other)
    accel.synchronize(0)
    g = hold(s)
    try:
        b.fill_(7, stream=s)                    # pending behind the hold
        b.record_stream(s)
        _in_window(g, b.close)                  # the allocation stream waits for s, then frees
    finally:
        g.set()
    fresh = accel.Buffer(1 << 16, 0)
    fresh.fill_(8)
    assert (fresh.to_numpy() == 8).all()
    fresh.close()
    s.close()
    if other is not None:
        other.close()
    accel.synchronize(0)
    assert sim.state().errors == []
