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


# -- RNG -------------------------------------------------------------------------------------------
def test_default_generator_refuses_bool_even_once_device_1s_generator_exists(sim_graph_backend):
    """default_generator(True) returned device 1's generator once it existed (True == 1 as a
    dict key), and a TypeError before; numpy integers likewise worked only after creation."""
    import numpy as np
    R = accel.random
    R.get_rng_state(1)                      # creates device 1's default generator
    with pytest.raises(TypeError, match="True"):
        R.default_generator(True)
    with pytest.raises(TypeError, match="False"):
        R.default_generator(False)
    assert R.default_generator(np.int64(1)) is R.default_generator(1)
    assert R.default_generator(np.uint8(0)) is R.default_generator(0)


def test_generator_device_index_is_checked_against_the_devices(sim_graph_backend):
    """Generator(5) with two devices was accepted (it could never fill a buffer); -1 raised a
    TypeError for a value error."""
    R = accel.random
    with pytest.raises(ValueError, match=r"5.*valid indices 0\.\.1"):
        R.Generator(5)
    with pytest.raises(ValueError, match="-1"):
        R.Generator(-1)
    with pytest.raises(TypeError, match="True"):
        R.Generator(True)
    assert R.Generator(1).device_index == 1


def test_generator_without_a_device_takes_any_index(monkeypatch):
    """Generators stay plain host objects where no device exists (the host reference path)."""
    from conftest import use_sim
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DEVICES=0)
    assert accel.random.Generator(3).device_index == 3


def test_generator_set_offset_names_the_bad_value_and_changes_nothing():
    """set_offset(1.5) said only "'float' object cannot be interpreted as an integer",
    set_offset(True) "offset must be a multiple of 4", set_offset(6) did not say 6."""
    g = accel.random.Generator(0, seed=7)
    g.set_offset(8)
    before = bytes(g.get_state())
    for bad, exc, words in ((1.5, TypeError, ("offset", "1.5")), ("4", TypeError, ("offset", "'4'")),
                            (True, TypeError, ("offset", "True")), (None, TypeError, ("offset", "None")),
                            (6, RuntimeError, ("multiple of 4", "6")), (-4, RuntimeError, ("-4",)),
                            (2**63, RuntimeError, (str(2**63),))):
        with pytest.raises(exc) as info:
            g.set_offset(bad)
        assert all(w in str(info.value) for w in words), (bad, str(info.value))
        assert bytes(g.get_state()) == before


# -- Event flags -------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["enable_timing", "blocking", "interprocess", "external"])
@pytest.mark.parametrize("bad", ["no", None, 1, 0.0, [True]], ids=["str", "None", "int", "float", "list"])
def test_event_flags_must_be_bool(sim_backend, flag, bad):
    """Event(enable_timing="no") made a timing event (bool("no") is True) and
    Event(enable_timing=None) a plain one; torch.Event takes only a bool for each flag."""
    with pytest.raises(TypeError, match=rf"{flag}.*must be a bool.*{type(bad).__name__}"):
        accel.Event(**{flag: bad})


def test_event_flags_take_numpy_bools(sim_backend):
    import numpy as np
    e = accel.Event(enable_timing=np.bool_(True), blocking=np.bool_(False))
    assert e.enable_timing is True and e.blocking is False
    e.record()
    e.synchronize()
    e.close()


# -- closing from two threads -------------------------------------------------------------------------
def test_two_threads_closing_one_stream_destroy_it_once(sim_backend, monkeypatch):
    """Two threads in Stream.close() at once both passed the `closed` check (a backend call
    came between it and marking the stream closed) and both destroyed the handle: the second
    failed (invalid handle), or, had another thread created a stream in between, destroyed
    that stream, which the driver gives the freed handle value."""
    from accel import _lazy
    backend = _lazy.lazy_init()
    s = accel.Stream(0)
    handle = s.handle
    closers = {}
    gate = threading.Barrier(2, timeout=30)
    real_underway, real_destroy = backend.captures_underway, backend.stream_destroy
    destroyed = []

    def underway():
        if closers.get(threading.get_ident()) is None and threading.current_thread().name.startswith("closer"):
            closers[threading.get_ident()] = True
            gate.wait()                 # both threads are inside close() past the check
        return real_underway()

    def destroy(h):
        destroyed.append(h)
        return real_destroy(h)

    monkeypatch.setattr(backend, "captures_underway", underway)
    monkeypatch.setattr(backend, "stream_destroy", destroy)
    errors = []

    def close():
        try:
            s.close()
        except Exception as exc:    # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=close, name=f"closer{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and destroyed == [handle] and s.closed


def _live_events(kind, backend):
    from accel import sim
    return vars(sim.state())["events"] if kind == "cuda" else len(backend._events)


def test_two_threads_recording_a_new_event_create_one_handle(sim_backend, monkeypatch):
    """The first record creates the event's handle; two threads recording a new event at once
    both created one and the first was overwritten, never destroyed (a leaked driver event)."""
    from accel import _lazy
    backend = _lazy.lazy_init()
    s = accel.Stream(0)
    base = _live_events(sim_backend, backend)
    gate = threading.Barrier(2, timeout=1)
    real_create = backend.event_create

    def create(*args):
        try:
            gate.wait()                 # both threads are creating (gives up when serialized)
        except threading.BrokenBarrierError:
            pass
        return real_create(*args)

    monkeypatch.setattr(backend, "event_create", create)
    e = accel.Event()
    threads = [threading.Thread(target=e.record, args=(s,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _live_events(sim_backend, backend) == base + 1
    e.close()
    s.close()
    assert _live_events(sim_backend, backend) == base


def test_event_closed_during_its_first_record_keeps_no_handle(sim_backend, monkeypatch):
    """close() while another thread's first record was creating the handle found no handle to
    destroy; the record then stored one on the closed event, which nothing destroys.  (r61g: the
    record completes on the handle it made, and its end destroys it; until then it raised 'was
    closed', tests/test_use_during_close_sweep_r61.py::test_event_first_record_vs_close.)"""
    from accel import _lazy
    backend = _lazy.lazy_init()
    s = accel.Stream(0)
    base = _live_events(sim_backend, backend)
    creating, closed = threading.Event(), threading.Event()
    real_create = backend.event_create

    def create(*args):
        creating.set()
        closed.wait(30)
        return real_create(*args)

    monkeypatch.setattr(backend, "event_create", create)
    e = accel.Event()
    errors = []

    def record():
        try:
            e.record(s)
        except Exception as exc:    # noqa: BLE001 - checked below
            errors.append(exc)

    t = threading.Thread(target=record)
    t.start()
    assert creating.wait(30)
    e.close()
    closed.set()
    t.join()
    assert e.closed if hasattr(e, "closed") else e._closed
    assert errors == []
    assert _live_events(sim_backend, backend) == base
    s.close()


# -- identity after close -----------------------------------------------------------------------------
def test_closed_stream_is_not_equal_to_the_stream_that_got_its_handle(sim_backend):
    """The driver gives a destroyed stream's handle value to the next stream; the closed Stream
    compared (and hashed) equal to that unrelated live stream, so `current_stream() == old`
    and dicts keyed by streams answered for the wrong one."""
    old = accel.Stream(0)
    old.close()
    new = accel.Stream(0)
    assert old != new and not (old == new)
    assert {new: "new"}.get(old) is None
    assert old == old and new == accel.Stream(stream_id=new.stream_id, device_index=0,
                                              device_type=new.device_type)
    new.close()
