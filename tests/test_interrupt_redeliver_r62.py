"""A Ctrl-C whose handler runs inside an accel finalizer reaches the program (r62).

CPython discards an exception that leaves ``__del__`` (or a cffi destructor, or a weakref
callback): it prints "Exception ignored in ..." and goes on.  A SIGINT whose Python handler runs
at a check point inside accel's release of a dropped Event, Stream, Buffer or pinned array
raised its KeyboardInterrupt there, and the program never saw it (r62b: a loop of temporary
Events ignored about one Ctrl-C in twelve).  Here the release runs and then raises
KeyboardInterrupt, as the handler does at the first check point after a vendor call returns;
the interrupt must surface in the program's own code right after, and the release must have
happened (nothing leaks)."""

import gc

import numpy as np
import pytest

import accel
from accel import _hostmem, buffer, graphs, memory, sim, streams
from accel.kernels import _module as _module_impl
from accel.memory import _mempool


def _raising_after(monkeypatch, module, name):
    real = getattr(module, name)
    calls = []

    def release(*args):
        real(*args)
        calls.append(args)
        if len(calls) == 1:
            raise KeyboardInterrupt     # as the SIGINT handler at the check after the vendor call
    monkeypatch.setattr(module, name, release)
    return calls


def _drop_and_look(make):
    """Drop what ``make()`` returns; True when a KeyboardInterrupt reached this frame."""
    obj = make()
    try:
        del obj
        for _ in range(3):      # a backward jump: a check point of the program's own
            pass
    except KeyboardInterrupt:
        return True
    return False


def _event():
    e = accel.Event()
    e.record(accel.Stream(1))
    return e


def _graph():
    s = accel.Stream(0)
    b = accel.Buffer(256, device=0)
    g = accel.Graph()
    with accel.graph(g, stream=s):
        b.fill_(1)
    g.replay()
    accel.synchronize(0)
    return g


def _module():
    from test_user_kernels import SAXPY_PTX
    return accel.Module(SAXPY_PTX, device=1)


@pytest.mark.parametrize("what", ["event", "stream", "buffer", "pinned", "graph", "module", "mempool"])
def test_a_ctrl_c_inside_a_finalizer_reaches_the_program(sim_cuda, monkeypatch, what):
    gc.collect()
    accel.synchronize(1)
    if what == "event":
        calls = _raising_after(monkeypatch, streams.event, "_event_destroy")
        make = _event
    elif what == "stream":
        calls = _raising_after(monkeypatch, streams.stream, "_destroy")
        make = lambda: accel.Stream(1)                      # noqa: E731
    elif what == "buffer":
        calls = _raising_after(monkeypatch, buffer.buffer_class, "_free_from_finalizer")
        make = lambda: accel.Buffer(4096, device=1)         # noqa: E731
    elif what == "pinned":
        calls = _raising_after(monkeypatch, _hostmem, "_free_pinned")
        make = lambda: accel.empty_pinned(4096, np.uint8)   # noqa: E731
    elif what == "graph":
        calls = _raising_after(monkeypatch, graphs.graph_class, "_reclaim")    # (Graph.__del__'s)
        make = _graph
    elif what == "module":
        calls = _raising_after(monkeypatch, _module_impl, "_unload")
        make = _module
    else:
        calls = _raising_after(monkeypatch, _mempool, "_release")
        make = accel.MemPool
    assert _drop_and_look(make), "the KeyboardInterrupt raised inside the finalizer was lost"
    assert len(calls) == 1, "the release did not run"
    before = sim.state()
    assert _drop_and_look(make) is False          # the next one: released, nothing raised
    gc.collect()
    after = sim.state()
    assert (after.streams, after.events) == (before.streams, before.events)
    assert memory.memory_allocated(1) == 0


def test_an_interrupt_raised_in_another_threads_finalizer_stays_there(sim_cuda, monkeypatch):
    """Only the main thread runs signal handlers: a KeyboardInterrupt inside a finalizer on
    another thread (an asynchronous exception injected there) is not turned into a Ctrl-C of
    the main thread."""
    import threading
    gc.collect()
    calls = _raising_after(monkeypatch, streams.event, "_event_destroy")
    t = threading.Thread(target=lambda: _drop_and_look(_event))
    t.start()
    t.join(30)
    assert not t.is_alive() and len(calls) == 1
    try:
        for _ in range(3):
            pass
    except KeyboardInterrupt:      # pragma: no cover - the failure
        pytest.fail("an interrupt of another thread's finalizer reached the main thread")
