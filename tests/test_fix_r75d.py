"""r75d: a ``with stream:`` block closed by another thread's collection (accel.streams)."""

import gc
import threading

import accel
from accel import streams


def _in_stream(s):
    with s:
        yield


class _Ring:
    def __init__(self, obj):
        self.obj, self.me = obj, self


def _collect_in_thread() -> dict:
    """gc.collect() in a new thread, which keeps device 1 and a stream of it current: what it
    sees before and after."""
    seen = {}

    def run():
        mine = accel.Stream(1)
        accel.set_stream(mine)
        before = (accel.current_device_index(), accel.current_stream(0), accel.current_stream(1))
        gc.collect()
        seen["same"] = before == (accel.current_device_index(), accel.current_stream(0), accel.current_stream(1))
        seen["stack"] = len(getattr(streams._state._tls, "stack", []))
        mine.close()
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return seen


def test_a_block_closed_by_another_threads_collection_passes_its_state_on(sim_cuda):
    """The generator's block (device 0) is older than a block still open on this thread (device
    1): its entry goes from this thread's stack, the newer block's exit restores what the closed
    one saved, and the collecting thread's own streams and device stay as they were."""
    accel.set_device_index(0)
    before0 = accel.current_stream(0)
    s0, s1 = accel.Stream(0), accel.Stream(1)
    gc.disable()                # (the collection is the other thread's)
    try:
        gen = _in_stream(s0)
        next(gen)
        _Ring(gen)
        del gen
        with s1:
            assert accel.current_stream(0) == s0
            seen = _collect_in_thread()
            assert seen == {"same": True, "stack": 0}
            assert [e.entered for e in streams._state._tls.stack] == [s1]
            assert accel.current_stream(0) == before0     # nothing newer on device 0: restored at once
            assert accel.current_device_index() == 1
    finally:
        gc.enable()
    assert accel.current_device_index() == 0           # what the closed block saved
    assert accel.current_stream(1) == accel.default_stream(1)
    assert not streams._state._tls.stack
    s0.close()
    s1.close()


def test_a_thread_that_never_entered_the_block_is_still_refused(sim_cuda):
    """Only the frame that entered a block leaves it from another thread (a collection closing a
    generator); a plain ``__exit__`` elsewhere is refused and changes nothing."""
    s = accel.Stream(0)
    s.__enter__()
    errors = []

    def other():
        try:
            s.__exit__(None, None, None)
        except RuntimeError as exc:
            errors.append(exc)
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and "without a matching __enter__" in str(errors[0])
    assert accel.current_stream(0) == s and len(streams._state._tls.stack) == 1
    s.__exit__(None, None, None)
    assert not streams._state._tls.stack
    s.close()
