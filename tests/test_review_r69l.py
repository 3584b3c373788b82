"""r69l: review of the session's lock changes (65b6473, 60fa714): the caching allocators' locks are
RLocks now (accel._locks.OwnedLock), and every entry point probes (_caching._gc_probe) so that a
second hold by the holder -- user code run inside the allocator: a signal handler, a gc callback
at a collection's "stop", a __del__ run by a refcount drop -- is refused with AcceleratorError.

With a plain lock, a `with self._lock:` that no probe guards hung on such a re-entry; with an
RLock it *re-enters silently* and runs in the middle of the holder's half-done work.  The
cudaMallocAsync allocator's graph-record release (AsyncPoolAllocator._release_record, reached
from a dropped Graph's release after release_pool's probe refused) is such an unguarded path.

The user code "inside the allocator" is emulated by holding the allocator's lock on this thread
(what a signal handler or gc callback run inside malloc would see), deterministic and fast.
"""

import gc

import pytest

import accel
from accel import _finalize, memory
from accel._errors import AcceleratorError
from conftest import use_sim

MiB = 1 << 20


@pytest.fixture
def async_cuda(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="backend:cudaMallocAsync")
    yield
    gc.collect()


def _captured_graph_with_allocations():
    s = accel.Stream(device=1)
    g = accel.Graph()
    with accel.graph(g, stream=s):
        kept = accel.Buffer(MiB, device=1, stream=s)
        kept.fill_(3, s)
    g.replay()
    kept.close()
    g.replay()                      # allocated again by the launch, with no owner
    s.synchronize()
    return g, s


def test_stats_inside_the_async_allocators_lock_is_refused(async_cuda):
    """The contract the session's change gives: a call that re-enters the allocator from inside
    its own critical section is refused, not run half way through the holder's work."""
    alloc = memory.device_allocator(1)
    buf = accel.Buffer(MiB, device=1)
    with alloc._lock:
        with pytest.raises(AcceleratorError, match="re-enter"):
            memory.memory_allocated(1)
    buf.close()


# (r69l found; fixed in session 29: the release is probed, and _release_own keeps the record for the retry)
def test_graph_dropped_inside_the_async_allocator_is_not_released_under_its_lock(async_cuda):
    g, s = _captured_graph_with_allocations()
    record = g._h.allocs
    assert record is not None and not record.released
    alloc = memory.device_allocator(1)
    with alloc._lock:               # as a signal handler / gc 'stop' callback run inside malloc
        del g                       # the graph's release: release_pool refuses, then allocs.release()
        ran_under_lock = record.released
    gc.collect()
    _finalize.drain()               # (a release refused or deferred above runs now)
    s.close()
    # the release must wait until the holder's call is done (or be refused), not run inside it
    assert not ran_under_lock
    # ... and it is not lost: the finalizer's retry released the record (lead, session 29)
    assert record.released
