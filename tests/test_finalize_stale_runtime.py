"""A finalizer of an object made by a runtime that was since reset (tests switch simulators;
``_lazy._reset_for_tests``) must not release anything in the new runtime: handle values are
recycled, so the stale handle may name a live object of the new one.  Seen when a Stream held
by an exception traceback was collected one test later and destroyed that test's side stream."""

import gc

import accel
from accel import _lazy
from conftest import use_sim


def test_stale_stream_finalizer_leaves_the_new_runtime_alone(monkeypatch):
    use_sim(monkeypatch, "cuda")
    old = accel.Stream()
    old_handle = old.handle
    use_sim(monkeypatch, "cuda")                 # a new runtime: handle values start over
    new = accel.Stream()
    assert new.handle == old_handle
    del old                                      # the old runtime's object dies now
    gc.collect()
    new.synchronize()                            # still a live stream of this runtime
    be = _lazy.lazy_init()
    assert be.stream_query(new.handle)
    new.close()


def test_stale_event_finalizer_leaves_the_new_runtime_alone(monkeypatch):
    use_sim(monkeypatch, "cuda")
    old = accel.Event()
    old.record()
    use_sim(monkeypatch, "cuda")
    new = accel.Event()
    new.record()
    assert new.handle == old.handle
    del old
    gc.collect()
    new.synchronize()
    assert new.query()
