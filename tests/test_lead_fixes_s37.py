"""Session 37's fix of r75e's first case: a ``with stream:`` block that a generator or coroutine
entered on a thread that has ended since is left quietly on whichever thread resumes it (its
entry went with that thread's stack; the resuming thread's streams were never changed)."""

import inspect

import pytest

import accel
from accel.streams import stream as stream_module
from test_review_r75e import _on_thread, _stack


def test_suspendable_flags_are_inspect_s():
    """accel.streams.stream spells the code flags out (inspect is not imported for them)."""
    assert stream_module._SUSPENDABLE == inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def test_a_coroutine_entered_on_a_thread_that_ended_finishes_on_another(sim_cuda):
    """A coroutine stepped by hand (as an event loop would) on a worker thread that has ended:
    the main thread finishes it, its current device and streams unchanged."""
    accel.set_device_index(0)
    s = accel.Stream(1)

    async def step():
        with s:
            await _Yield()
        return "done"

    coro = step()
    _on_thread(coro.send, None)
    before = (accel.current_device_index(), accel.current_stream(0), accel.current_stream(1))
    try:
        coro.send(None)
    except StopIteration as stop:
        assert stop.value == "done"
    assert before == (accel.current_device_index(), accel.current_stream(0), accel.current_stream(1))
    assert _stack() == []
    s.close()


def test_a_plain_unmatched_exit_still_raises(sim_cuda):
    """Only a suspendable frame is let go: a function calling __exit__ with no block open still
    gets the RuntimeError that says so."""
    s = accel.Stream(1)
    with pytest.raises(RuntimeError, match="__enter__"):
        s.__exit__(None, None, None)
    s.close()


class _Yield:
    def __await__(self):
        yield
