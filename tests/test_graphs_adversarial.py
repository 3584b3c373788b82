"""Adversarial use of streams, events and graph capture (task r4_graphs): every misuse raises a
clear Python exception and leaves the process usable, with no capture left underway."""

import gc
import threading

import numpy as np
import pytest

import accel
from accel import Graph, sim


def _captures() -> int:
    """Captures the simulated runtime has underway (CUDA: its count; Level Zero: streams in capture)."""
    st = vars(sim.state())
    return st.get("captures", 0) or 0


def _usable() -> None:
    """The next correct capture and replay works (nothing was left wedged)."""
    s = accel.Stream()
    b = accel.Buffer(64, stream=s)
    g = Graph()
    with s, g:
        b.fill_(3, s)
    g.replay()
    accel.synchronize()
    assert (b.to_numpy() == 3).all()
    g.reset()
    b.close()
    s.close()


def test_capture_end_from_another_thread_leaves_the_capture_endable(sim_graph_backend):
    # CUDA Runtime API, cudaStreamEndCapture: a capture begun in global or thread_local mode
    # must be ended by the thread that began it (cudaErrorStreamCaptureWrongThread); the
    # capture then goes on.  The graph must not forget it: the beginning thread ends it.
    s = accel.Stream()
    b = accel.Buffer(64, stream=s)
    b.fill_(0, s)
    g = Graph()
    with s:
        g.capture_begin()
    b.fill_(5, s)
    errors = []

    def end_elsewhere():
        try:
            with s:
                g.capture_end()
        except Exception as exc:     # CUDA: wrong thread; Level Zero has no such rule
            errors.append(exc)

    t = threading.Thread(target=end_elsewhere)
    t.start()
    t.join()
    if errors:
        assert "thread" in str(errors[0])
        assert s.is_capturing()
        with s:
            g.capture_end()          # the thread that began it can still end it
    assert not s.is_capturing() and _captures() == 0
    with s:
        g.replay()
    s.synchronize()
    assert (b.to_numpy() == 5).all()
    g.reset()
    _usable()
