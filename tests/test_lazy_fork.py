"""Lazy initialization, the deferred-call queue, and fork rules (issue: foundation)."""

import multiprocessing

import pytest

import accel
from accel import _lazy
from conftest import run_forked

FORK_MESSAGE = ("Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, "
                "you must use the 'spawn' start method")


def _child_uses_device() -> int:
    accel.set_device_index(1)
    buf = accel.Buffer(64)
    buf.copy_from(bytes(range(64)))
    return 0 if buf.to_numpy().tobytes() == bytes(range(64)) else 3


def _child_expects_fork_error() -> int:
    try:
        accel.Buffer(16)
    except RuntimeError as exc:
        return 0 if str(exc) == FORK_MESSAGE else 4
    return 5


def test_fork_after_queries_and_lazy_call_child_works(sim_cuda):
    from accel import sim
    calls = []
    assert accel.is_available() and accel.device_count() == 2
    _lazy.lazy_call(lambda: calls.append("seeded"), seed=True)
    assert not accel.is_initialized() and not sim.state().runtime_initialized
    assert run_forked(lambda: 0 if (_child_uses_device() == 0 and calls == ["seeded"]) else 6) == 0
    assert not accel.is_initialized()  # the parent is still free to fork
    assert calls == []


def test_fork_after_init_child_gets_clear_error(sim_cuda):
    accel.current_device_index()
    assert accel.is_initialized()
    assert run_forked(_child_expects_fork_error) == 0
    # queries keep working in the child
    assert run_forked(lambda: 0 if accel.device_count() == 2 and not accel.is_initialized() else 7) == 0


def _mp_child(queue):
    try:
        accel.Buffer(16)
        queue.put("no error")
    except RuntimeError as exc:
        queue.put(str(exc))


def _mp_child_works(queue):
    try:
        queue.put(_child_uses_device())
    except Exception as exc:
        queue.put(repr(exc))


@pytest.mark.parametrize("initialize_first", [False, True])
def test_multiprocessing_fork(sim_cuda, initialize_first):
    ctx = multiprocessing.get_context("fork")
    accel.device_count()
    if initialize_first:
        accel.current_device_index()
    queue = ctx.Queue()
    proc = ctx.Process(target=_mp_child if initialize_first else _mp_child_works, args=(queue,))
    proc.start()
    try:
        result = queue.get(timeout=60)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert result == (FORK_MESSAGE if initialize_first else 0)


def test_lazy_call_runs_at_init_in_order_and_seed_keeps_latest(sim_cuda):
    order = []
    _lazy.lazy_call(lambda: order.append("a"))
    _lazy.lazy_call(lambda: order.append("seed1"), seed=True)
    _lazy.lazy_call(lambda: order.append("seed2"), seed=True)
    _lazy.lazy_call(lambda: order.append("all"), seed_all=True)
    _lazy.lazy_call(lambda: order.append("b"))
    assert order == []
    accel.current_device_index()
    assert order == ["a", "b", "seed2", "all"]      # torch's _lazy_init: plain calls, then the seeds
    _lazy.lazy_call(lambda: order.append("now"))
    assert order[-1] == "now"


def test_failing_queued_call_reports_where_it_was_queued(sim_cuda):
    def explode():
        raise ValueError("boom")

    def queue_it_here():
        _lazy.lazy_call(explode)

    queue_it_here()
    with pytest.raises(accel.DeferredCallError) as info:
        accel.current_device_index()
    text = str(info.value)
    assert "CUDA call failed lazily at initialization with error: boom" in text
    assert "CUDA call was originally invoked at:" in text
    assert "queue_it_here" in text
