"""r75e: review of r75d's fixes: ``with stream:`` blocks left from another thread
(accel.streams: _Stack, _exit_elsewhere, _take_out) and the gc marker cleared by a last callback
(and accel._locks' collection marker on another thread)."""

import contextlib
import gc
import sys
import threading

import pytest

import accel
from accel import streams


def _in_stream(s):
    with s:
        yield


def _in_exit_stack(s):
    with contextlib.ExitStack() as es:
        es.enter_context(s)
        yield


class _Ring:
    def __init__(self, obj):
        self.obj, self.me = obj, self


def _on_thread(fn, *args):
    out, err = [], []

    def run():
        try:
            out.append(fn(*args))
        except BaseException as exc:       # noqa: BLE001 - reported to the test
            err.append(exc)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


def _stack():
    return list(getattr(streams._state._tls, "stack", []) or [])


@contextlib.contextmanager
def _unraisable():
    seen = []
    old = sys.unraisablehook
    sys.unraisablehook = lambda u: seen.append(u.exc_value)
    try:
        yield seen
    finally:
        sys.unraisablehook = old


# ----------------------------------------------------------------------------- 1. streams
def test_gen_close_on_another_thread_restores_the_entering_thread_only(sim_cuda):
    """gen.close() called (not by gc) on thread B: the block entered on this thread (device 1,
    not current before) is taken out here; B's current streams and device stay."""
    accel.set_device_index(0)
    s1 = accel.Stream(1)
    gen = _in_stream(s1)
    next(gen)
    assert accel.current_device_index() == 1 and accel.current_stream(1) == s1

    def close():
        mine = accel.Stream(0)
        accel.set_stream(mine)
        before = (accel.current_device_index(), accel.current_stream(0), accel.current_stream(1))
        gen.close()
        after = (accel.current_device_index(), accel.current_stream(0), accel.current_stream(1))
        mine.close()
        return before == after
    assert _on_thread(close)
    assert _stack() == []
    assert accel.current_stream(1) == accel.default_stream(1)
    assert accel.current_device_index() == 1      # (documented: only a thread sets its own device)
    accel.set_device_index(0)
    s1.close()


# (r75e found; fixed in session 37)
def test_a_generator_entered_on_a_thread_that_ended_finishes_on_another(sim_cuda):
    """A generator's first batch made on a worker thread that has ended since; the main thread
    runs it to its end.  The block's exit has nothing left to restore (the worker's stack went
    with it): it must not raise into the consumer."""
    s = accel.Stream(1)

    def batches():
        with s:
            yield 1
            yield 2
    gen = batches()
    assert _on_thread(next, gen) == 1
    before = (accel.current_device_index(), accel.current_stream(0), accel.current_stream(1))
    assert list(gen) == [2]
    assert before == (accel.current_device_index(), accel.current_stream(0), accel.current_stream(1))
    s.close()


# r75e, fixed in session 39: _exit_elsewhere keyed the entry by the frame calling __enter__;
# ExitStack.enter_context's frame is not the one calling __exit__: RuntimeError, entry left
def test_exit_stack_generator_closed_on_another_thread(sim_cuda):
    """``ExitStack.enter_context(stream)`` in a generator closed by gen.close() on another thread:
    the entering frame is enter_context's, the exiting one ExitStack.__exit__'s."""
    accel.set_device_index(0)
    s = accel.Stream(0)
    gen = _in_exit_stack(s)
    next(gen)
    assert accel.current_stream(0) == s
    _on_thread(gen.close)
    assert _stack() == []
    assert accel.current_stream(0) == accel.default_stream(0)
    s.close()


def _sweep(thresholds):
    """For each gen-0 threshold: a generator suspended in ``with sg:`` is cyclic garbage, then
    ``with s0:`` makes a fresh stream current in its body (only the current-stream table holds
    it, so the block's exit frees it).  The collection comes at a different allocation for each
    threshold (a stand-in for the default 700 landing anywhere).  Yields what each one left:
    (threshold, stack entries, current stream of device 0 is sg, errors printed)."""
    accel.set_device_index(0)
    sg, s0 = accel.Stream(0), accel.Stream(0)
    dflt = accel.default_stream(0)
    old = gc.get_threshold()
    out = []
    try:
        with _unraisable() as seen:
            for t in thresholds:
                gc.disable()
                gc.collect()
                gen = _in_stream(sg)
                next(gen)
                _Ring(gen)
                del gen
                gc.set_threshold(t)
                gc.enable()
                with s0:
                    accel.set_stream(accel.Stream(0))
                gc.set_threshold(*old)
                gc.collect()
                out.append((t, len(_stack()), accel.current_stream(0) == sg, [type(e).__name__ for e in seen]))
                seen.clear()
                del streams._state._tls.stack[:]
                accel.set_stream(dflt)
    finally:
        gc.set_threshold(*old)
        gc.enable()
    sg.close()
    s0.close()
    return out


# (r75e found; fixed in session 36)
def test_a_collection_run_by_a_block_exit_can_close_a_generator_of_the_thread(sim_cuda, frozen_heap):
    bad = [r for r in _sweep(range(1, 60)) if r[1] or r[3]]
    assert bad == []


# r75e (also in torch's StreamContext, and before r75d), fixed in session 39: Stream.__enter__ read
# the current stream before _Entry and the stack lock; a collection between closed a generator's
# block, and the exit restored the dead generator's stream
def test_a_collection_as_a_block_enters_does_not_leave_a_dead_generators_stream(sim_cuda, frozen_heap):
    bad = [r for r in _sweep(range(1, 60)) if not r[1] and not r[3] and r[2]]
    assert bad == []


# ----------------------------------------------------------------------------- 3. more streams
def test_asyncio_tasks_leave_blocks_on_both_devices_out_of_order(sim_cuda):
    """Three tasks of one thread: a (device 0) leaves while b (device 1, not current before,
    nested) is inside; c (device 0) enters after a left and leaves after b left."""
    import asyncio
    accel.set_device_index(0)
    s0, s0c, s1, s1b = accel.Stream(0), accel.Stream(0), accel.Stream(1), accel.Stream(1)
    d0, d1 = accel.default_stream(0), accel.default_stream(1)
    seen = {}

    def now():
        return (accel.current_device_index(), accel.current_stream(0), accel.current_stream(1))

    async def a(ev):
        with s0:
            ev[1].set()
            await ev[2].wait()
        seen["a_left"] = now()
        ev[3].set()

    async def b(ev):
        await ev[1].wait()
        with s1:
            with s1b:
                ev[2].set()
                await ev[3].wait()
                seen["b_inside"] = now()
                ev[4].set()
                await ev[5].wait()
            seen["b_left_inner"] = now()
        seen["b_left"] = now()
        ev[6].set()

    async def c(ev):
        await ev[4].wait()
        with s0c:
            ev[5].set()
            await ev[6].wait()
            seen["c_inside"] = now()

    async def main():
        ev = [asyncio.Event() for _ in range(7)]
        await asyncio.gather(a(ev), b(ev), c(ev))
    asyncio.run(main())
    assert seen["a_left"] == (1, d0, s1b)
    assert seen["b_inside"] == (1, d0, s1b)
    assert seen["b_left_inner"] == (0, s0c, s1)
    assert seen["b_left"] == (0, s0c, d1) == seen["c_inside"]
    assert _stack() == []
    assert now() == (0, d0, d1)
    for s in (s0, s0c, s1, s1b):
        s.close()


def test_threads_that_end_inside_blocks_leave_no_stacks(sim_cuda):
    before = len(streams._stacks)
    gens = []

    def enter():
        s = accel.Stream(1)
        g = _in_stream(s)
        next(g)
        gens.append(g)
        s.__enter__()           # and one never left
    for _ in range(20):
        _on_thread(enter)
    gc.collect()
    assert len(streams._stacks) <= before + 1       # (a thread's stack goes with it)
    with _unraisable():
        del gens[:]
        gc.collect()
    assert len(streams._stacks) <= before + 1


def test_an_exception_and_a_close_inside_the_block(sim_cuda):
    accel.set_device_index(0)
    s1, s0 = accel.Stream(1), accel.Stream(0)
    with pytest.raises(ValueError):
        with s0:
            with s1:
                s0.close()      # the outer block's stream, closed while a newer block is in
                raise ValueError
    assert _stack() == []
    assert accel.current_device_index() == 0
    assert accel.current_stream(0) == accel.default_stream(0) and accel.current_stream(1) == accel.default_stream(1)
    gen = _in_stream(s1)
    next(gen)
    with s0 if not s0._closed else contextlib.nullcontext():
        pass
    s1.close()                  # the generator's stream, closed while it is suspended inside
    _on_thread(gen.close)
    assert _stack() == [] and accel.current_stream(1) == accel.default_stream(1)


def test_fork_inside_a_block_with_a_generator_of_another_thread_open(sim_cuda):
    """Parent: a worker thread holds a generator inside ``with s1:`` (its entry on the worker's
    stack) when this thread forks inside ``with s0:``.  The child leaves its block (refused as a
    forked child's call, entry gone) and closes the worker's generator: no hang, nothing left."""
    import os
    accel.set_device_index(0)
    s0, s1 = accel.Stream(0), accel.Stream(1)
    gens, go, done = [], threading.Event(), threading.Event()

    def worker():
        g = _in_stream(s1)
        next(g)
        gens.append(g)
        go.set()
        done.wait()
        g.close()
    t = threading.Thread(target=worker)
    t.start()
    go.wait()
    with s0:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                try:
                    s0.__exit__(None, None, None)
                except Exception:
                    pass
                left = _stack()
                try:
                    gens[0].close()
                except Exception:
                    pass
                code = 0 if left == [] else 2
            finally:
                os._exit(code)
    done.set()
    t.join()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert _stack() == []
    s0.close()
    s1.close()


# (r75e found; fixed in session 36)
def test_a_shared_stream_entered_on_both_threads_and_a_collection_inside_the_others_block(sim_cuda):
    """A side stream used by two threads: this thread's generator is suspended in ``with side:``
    (cyclic garbage); a worker, inside its own ``with side:``, runs the collection."""
    accel.set_device_index(0)
    side = accel.Stream(1)
    gc.disable()
    try:
        gen = _in_stream(side)
        next(gen)
        _Ring(gen)
        del gen

        def worker():
            with side:
                gc.collect()
                inside = accel.current_stream(1) == side
            return inside, accel.current_stream(1) == accel.default_stream(1), len(_stack())
        assert _on_thread(worker) == (True, True, 0)
    finally:
        gc.enable()
    assert _stack() == []
    assert accel.current_stream(1) == accel.default_stream(1)
    accel.set_device_index(0)
    side.close()


def test_a_generator_stepped_by_two_live_worker_threads(sim_cuda):
    """``run_in_executor(None, next, gen)`` style: entered on worker 1, finished on worker 2
    (both alive); worker 1's entry goes and its stream is restored, worker 2 keeps its own."""
    import queue
    s1 = accel.Stream(1)

    def batches():
        with s1:
            yield 1
            yield 2
    gen = batches()
    jobs = [queue.Queue(), queue.Queue()]
    results = queue.Queue()

    def worker(q):
        while True:
            fn = q.get()
            if fn is None:
                return
            try:
                results.put(fn())
            except BaseException as exc:        # noqa: BLE001 - reported to the test
                results.put(exc)
    threads = [threading.Thread(target=worker, args=(q,)) for q in jobs]
    for t in threads:
        t.start()
    try:
        jobs[0].put(lambda: next(gen))
        assert results.get() == 1
        jobs[0].put(lambda: (accel.current_stream(1) == s1, len(_stack())))
        assert results.get() == (True, 1)

        def finish():
            before = (accel.current_device_index(), accel.current_stream(1))
            rest = list(gen)
            return rest, before == (accel.current_device_index(), accel.current_stream(1))
        jobs[1].put(finish)
        assert results.get() == ([2], True)
        jobs[0].put(lambda: (accel.current_stream(1) == accel.default_stream(1), len(_stack())))
        assert results.get() == (True, 0)
    finally:
        for q in jobs:
            q.put(None)
        for t in threads:
            t.join()
    s1.close()
