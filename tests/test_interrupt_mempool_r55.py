"""A Ctrl-C anywhere as ``with accel.use_mem_pool(pool):`` is entered or left leaves the
calling thread's allocations routed to the pool only while the block runs (r55).

``use_mem_pool`` routes the thread's allocations with the allocator's begin_allocate_to_pool,
which publishes the route before its lock is released: a KeyboardInterrupt as the lock's
release returned raised from the call with the route in place, before the context manager's
``try`` (whose ``finally`` ends the route), so every later allocation of the thread went to the
pool and the pool refused every other use ("already recording to mempool_id").  Each point is
injected in a fresh runtime (an interrupted run changes the next one's path, which would move
its points), on the non-current device of each simulator with a caching allocator.  The window
left is an interrupt exactly as the route's end starts (accel/memory/_mempool.py), as for
contextlib's ``__exit__``.
"""

import os

import pytest

import accel
from accel import _lazy
from conftest import use_sim
from test_interrupt_backends import _Inject

pytestmark = pytest.mark.usefixtures("frozen_heap")   # (conftest: a collection per point)


def _routed(dev: int) -> bool:
    """Whether any thread's allocations on ``dev`` are routed to a pool."""
    from accel import memory
    return bool(memory.device_allocator(dev)._threads)


@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_a_ctrl_c_anywhere_in_use_mem_pool_leaves_no_route(monkeypatch, kind):
    import accel.memory._caching
    import accel.memory._mempool
    import accel.memory._private_pools
    import accel.memory._requests
    use_sim(monkeypatch, kind)
    targets = {os.path.abspath(m.__file__) for m in (accel.memory._caching, accel.memory._mempool,
                                                     accel.memory._private_pools, accel.memory._requests)}
    dev = accel.device_count() - 1

    def fresh():
        _lazy._reset_for_tests()
        with accel.device_index(dev):
            pool = accel.MemPool()
        with accel.use_mem_pool(pool, device=dev):
            accel.Buffer(1 << 12, device=dev).close()
        return pool

    def run(point, pool, body):
        with point:
            with accel.use_mem_pool(pool, device=dev):
                buf = accel.Buffer(1 << 12, device=dev)
                body.append(buf)
            buf.close()

    counter = _Inject(0, targets)
    run(counter, fresh(), [])
    assert not _routed(dev)
    assert counter.count > 5
    left, window = [], []
    for n in range(1, counter.count + 1):
        pool, body = fresh(), []
        point = _Inject(n, targets)
        try:
            run(point, pool, body)
        except KeyboardInterrupt:
            pass
        if _routed(dev):
            # the one window left: exactly as the route's end (a deferred function) starts,
            # after the block ran (the module's comment on _route)
            if body and point.stack[:2] == ("call", "use_mem_pool"):
                window.append(point.site)
            else:
                left.append(point.site)
    assert not left, left
    assert len(window) <= 1, window
