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


def test_stale_buffer_finalizer_leaves_the_new_runtime_alone(monkeypatch):
    """A Buffer of the old runtime collected after a reset must not free a block of the new
    runtime's allocator: on the XPU simulator the new allocator's first block sits at the old
    one's address, and freeing it under a live owner corrupted the cache (a reservation freed
    under live mappings in tests/test_load.py's eight-thread run)."""
    for kind in ("cuda", "xpu"):
        use_sim(monkeypatch, kind)
        old = accel.Buffer(1 << 20)
        use_sim(monkeypatch, kind)               # a new runtime and new allocators
        new = accel.Buffer(1 << 20)
        allocated = accel.memory.memory_allocated(0)
        del old                                  # the old runtime's buffer dies now
        gc.collect()
        assert accel.memory.memory_allocated(0) == allocated == 1 << 20
        new.fill_(7)
        assert (new.to_numpy()[:4] == 7).all()
        new.close()
        assert accel.memory.memory_allocated(0) == 0
