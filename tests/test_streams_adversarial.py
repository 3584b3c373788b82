"""Streams, events, devices and RNG used the way a demanding user and a hostile test would
(r7_streams): context managers re-entered or left with their saved state gone, bad
arguments, objects of device 1 used while device 0 is current, threads and finalizers.

Cases tests/test_adversarial.py already covers (closed streams/events, bad device strings
and indices, seeds out of range, RNG states of the wrong size) are not repeated here."""

from __future__ import annotations

import threading

import pytest

import accel


# -- device_index ------------------------------------------------------------------------------
def test_device_index_object_reentered_restores_the_outer_device(sim_graph_backend):
    """One device_index object entered twice (nested) restores the device current before
    the outer entry: the inner entry used to overwrite the saved index, so leaving the outer
    block kept device 1 current."""
    accel.set_device_index(0)
    ctx = accel.device_index(1)
    with ctx:
        with ctx:
            assert accel.current_device_index() == 1
        assert accel.current_device_index() == 1
    assert accel.current_device_index() == 0


def test_device_index_object_shared_by_threads_restores_each_threads_device(sim_graph_backend):
    """One device_index object used by two threads at once: each thread gets its own device back."""
    ctx = accel.device_index(1)
    entered, leave = threading.Barrier(2), threading.Event()
    seen = {}

    def body(start):
        accel.set_device_index(start)
        with ctx:
            entered.wait()
            if start == 1:
                leave.wait()        # leaves after the other thread
        seen[start] = accel.current_device_index()
        if start == 0:
            leave.set()

    threads = [threading.Thread(target=body, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {0: 0, 1: 1}


# -- the current stream ----------------------------------------------------------------------------
def test_stream_exit_does_not_restore_a_stream_closed_in_the_body(sim_backend):
    """`with b:` saved the current stream a; a closed in the body: leaving the block made the
    closed stream current again, so every later call on the current stream raised 'closed'.
    The device's default stream is current instead, as after closing the current stream."""
    a, b = accel.Stream(0), accel.Stream(0)
    accel.set_stream(a)
    with b:
        a.close()
    assert accel.current_stream(0) == accel.default_stream(0)
    accel.current_stream().synchronize()
    b.close()
