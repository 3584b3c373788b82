"""In-order work queues run by worker threads: the simulated device's streams.

Every queue numbers its operations 1, 2, 3, ... (``enqueued``) and counts
how many have completed (``done``); a point ``(queue, seq)`` is complete when
``queue.done >= seq``.  Events, stream waits and synchronization are all
points, so "wait for the work captured by this record" never depends on
anything enqueued later.

Why no wait can deadlock: an operation's dependencies (its predecessor in
its own queue and any ``deps`` points) were all enqueued *before* it, under
the engine lock, so the wait-for graph follows enqueue order and has no
cycles; every queued operation has a worker thread (started on demand) or
runs inline in the submitting thread.  Internal waits still time out after
:data:`core.WAIT_TIMEOUT_S` with a RuntimeError so a simulator bug can never
hang a test.

Fast path: with no configured delay, an operation on an idle queue whose
dependencies are complete runs inline in the calling thread, so the common
case costs no thread hand-off.  With ``ACCEL_SIM_DELAY_US`` set, every work
operation goes through the worker, which sleeps that long first.
"""

from __future__ import annotations

import atexit
import collections
import os
import threading
import time
import weakref
from typing import Callable, Optional, Sequence, Tuple

from accel import _locks

from . import core

#: A worker thread with nothing to do for this long exits (a new one starts on demand).
_IDLE_EXIT_S = 5.0

_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()
_exiting = False


@atexit.register
def _drain_at_exit() -> None:
    # After atexit, finalizers (a Stream destroyed at interpreter teardown) may still submit
    # and wait, but a worker thread can no longer start or run then: let queued work finish
    # now, and run anything submitted later inline in the submitting thread.
    global _exiting
    _exiting = True
    me = os.getpid()
    for engine in list(_engines):
        if engine.pid != me:
            # inherited by a forked child: its workers did not survive the fork, and what they
            # were running never completes here
            continue
        for q in list(engine.queues):
            try:
                q.wait(timeout=core.WAIT_TIMEOUT_S)
            except RuntimeError:
                pass

Point = Tuple["Queue", int]

class EngineLock(_locks.Lock):
    """The engine's lock: a plain lock, except for a call made by a finalizer (a user's
    ``__del__``) that the cyclic garbage collector ran on this thread (accel._locks.Lock).

    The collector starts at any Python allocation, including inside the simulator's critical
    sections (queueing work), and a finalizer it runs there may queue work itself.  A real vendor
    library is C code, inside which no Python finalizer ever runs, so the simulator must not hang
    where the hardware would not: when the lock is busy and the collector runs on this thread
    (which may be the holder), the wait is bounded and then a RuntimeError says why (issue r18).
    Another thread holding the lock that long is possible but rare; the error says to retry."""

    __slots__ = ()

    def __init__(self):
        super().__init__("the simulated runtime")

    def _error(self) -> Exception:
        return RuntimeError(
            "accel.sim: a vendor call was made from a finalizer (__del__) that the garbage collector "
            "ran while this thread was inside the simulated runtime; calling it again from there would "
            "wait on a lock the thread already holds (a real driver runs no Python code inside its "
            "calls, so this happens only in the simulator).  Do not queue device work in __del__ of "
            "objects kept in reference cycles (use weakref.finalize, or release explicitly); if "
            "another thread held the lock, retry")


class Engine:
    """One lock for all queues of a simulated runtime, plus their error sink."""

    def __init__(self, on_error: Callable[["Queue", BaseException], None],
                 on_retire: Optional[Callable[["Queue"], None]] = None):
        self.lock = EngineLock()
        self.pid = os.getpid()
        self.closed = False
        self.on_error = on_error
        self.on_retire = on_retire  # called (lock held) when a closed queue has drained
        self.queues = {}            # live and draining queues (dict as an ordered set; for shutdown)
        self._closed_later = collections.deque()    # see close_later
        _engines.add(self)

    def queue(self, label: str, owner=None) -> "Queue":
        q = Queue(self, label, owner)
        with self.lock:
            queues = self.queues
            later = self._closed_later
            while later:
                # closed by close_later (a drained one is retired here, an undrained one by its
                # worker as it drains): the table holds live queues and the few closed since
                # the last queue was made, not every queue ever closed
                x = later.popleft()
                if x.done >= x.enqueued and x.worker is None:
                    self._retire(x)
            if len(queues) % 256 == 255:
                # Queues closed by setting ``closed`` directly (not through close()) and already
                # drained are forgotten here now and then.
                for x in [x for x in queues if x.closed and x.done >= x.enqueued and x.worker is None]:
                    self._retire(x)
            queues[q] = None
        return q

    def close_later(self, q: "Queue") -> None:
        """:meth:`close` for a caller that may not take the engine lock (it may hold it already:
        a Metal queue released by a command buffer's completion marker, run under that lock; or
        it holds a lock the engine's markers take): ``q`` takes no more work, its worker retires
        it when it drains, and the next :meth:`queue` retires it if it already had."""
        q.closed = True
        self._closed_later.append(q)     # (deque.append: atomic, no lock)

    def close(self, q: "Queue") -> None:
        """No more work will be submitted to ``q`` (its stream was destroyed): the queued work
        still runs, then the engine forgets the queue.  Call with the lock held."""
        q.closed = True
        if q.done >= q.enqueued:
            self._retire(q)
        if q._waiting:
            q.cv.notify_all()       # an idle worker exits now

    def _retire(self, q: "Queue") -> None:
        # State is bounded by live queues: a drained closed queue leaves every table.
        if self.queues.pop(q, 0) is None and self.on_retire is not None:
            self.on_retire(q)

    def shutdown(self, join_timeout: float = 2.0) -> None:
        """Abandon queued work, wake every waiter, stop the workers."""
        with self.lock:
            self.closed = True
            workers = []
            for q in list(self.queues):
                q.ops.clear()
                q.done = q.enqueued
                q.cv.notify_all()
                if q.worker is not None:
                    workers.append(q.worker)
        me = threading.current_thread()
        deadline = time.monotonic() + join_timeout
        for t in workers:
            if t is not me:
                t.join(max(0.0, deadline - time.monotonic()))


class Queue:
    """An in-order queue of operations (one simulated stream)."""

    __slots__ = ("engine", "cv", "ops", "enqueued", "done", "worker", "closed", "label", "owner", "_waiting")

    def __init__(self, engine: Engine, label: str, owner=None):
        self.engine = engine
        self.cv = threading.Condition(engine.lock)
        self.ops = collections.deque()   # (seq, fn, deps, work), not yet completed
        self.enqueued = 0
        self.done = 0
        self.worker: Optional[threading.Thread] = None
        self.closed = False
        self.label = label
        self.owner = owner
        # The condition's own waiter list: notify only when someone listens
        # (Condition.notify_all costs ~1 us even with nobody waiting).
        self._waiting = self.cv._waiters

    def idle(self) -> bool:
        return self.done >= self.enqueued

    def submit(self, fn: Optional[Callable[[], None]], deps: Sequence[Point] = (), work: bool = True) -> int:
        """Enqueue ``fn`` after everything already on this queue and after ``deps``.

        ``work`` operations sleep the configured delay first; markers
        (``work=False``) must be trivial and must not raise.  Returns the
        operation's sequence number.
        """
        engine = self.engine
        with engine.lock:
            if engine.closed:
                raise RuntimeError("accel.sim: the simulated runtime was reset while this call ran")
            seq = self.enqueued + 1
            self.enqueued = seq
            if (self.done == seq - 1 and (not work or core.delay_s == 0.0 or _exiting)
                    and (not deps or _complete(deps))):
                if work:
                    return self._run_inline(seq, fn)
                if fn is not None:
                    fn()
                self.done = seq
                if self._waiting:
                    self.cv.notify_all()
                return seq
            self.ops.append((seq, fn, tuple(deps), work))
            if self.worker is None:
                t = threading.Thread(target=_worker, args=(self,), name=f"accel-sim-{self.label}", daemon=True)
                self.worker = t
                t.start()
            elif self._waiting:
                self.cv.notify_all()
            return seq

    def _run_inline(self, seq: int, fn) -> int:
        # Called with the lock held; runs fn without it, then completes seq.
        lock = self.engine.lock
        lock.release()
        held = None
        try:
            if fn is not None:
                held = _run_whole(fn)
        except BaseException as exc:  # the device "faulted"; report, keep going
            self.engine.on_error(self, exc)
        finally:
            lock.acquire()
            if self.ops and self.ops[0][0] == seq:
                self.ops.popleft()
            if self.done < seq:
                self.done = seq
            if self._waiting:
                self.cv.notify_all()
        if held is not None:
            if core._Deferring.depth and threading.get_ident() == core._Deferring.main:
                core._Deferring.pending = held    # raised as the simulated call returns
            else:
                raise held
        return seq

    def wait(self, seq: Optional[int] = None, timeout: float = None) -> None:
        """Block the calling host thread until operation ``seq`` (default: all) completed."""
        if seq is None:
            seq = self.enqueued
        if self.done >= seq:
            return
        with self.engine.lock:
            _wait_locked(self, seq, timeout)


def _run_whole(fn) -> Optional[BaseException]:
    """Run a simulated operation on the caller's thread as hardware would: a Python signal
    handler's exception (Ctrl-C's KeyboardInterrupt) raised between two of its bytecodes does not
    stop the device's work.  The operation runs again from its start (simulated operations write
    whole results: copies, fills, kernels' references) and the exception is returned, for the
    caller to raise once the simulated call is done, as it would be right after a C call returned.
    (Signals are deferred for a simulated call, core "atomic for Python signal handlers", but a
    signal another thread took, e.g. OpenBLAS's, still runs its handler in the main thread.)"""
    interrupted = None
    while True:
        try:
            fn()
            return interrupted
        except Exception:
            raise
        except BaseException as exc:       # KeyboardInterrupt, SystemExit from a handler
            interrupted = exc


def _wait_locked(q: Queue, seq: int, timeout: Optional[float] = None) -> None:
    if q.done >= seq:
        return
    limit = core.WAIT_TIMEOUT_S if timeout is None else timeout
    deadline = time.monotonic() + limit
    while q.done < seq:
        if q.engine.closed:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(
                f"accel.sim: waited {limit:.0f} s for operation {seq} of {q.label} "
                f"(completed {q.done} of {q.enqueued}); a simulated operation is stuck or too slow")
        q.cv.wait(left)


def _complete(deps: Sequence[Point]) -> bool:
    for q, seq in deps:
        if q.done < seq:
            return False
    return True


def wait_points(points: Sequence[Point], timeout: float = None) -> None:
    """Block until every ``(queue, seq)`` point is complete."""
    for q, seq in points:
        if q.done < seq:
            q.wait(seq, timeout)


def _worker(q: Queue) -> None:
    core.block_signals_in_this_thread()     # signals go to the main thread, after its sim call
    engine = q.engine
    lock = engine.lock
    while True:
        with lock:
            idle_until = time.monotonic() + _IDLE_EXIT_S
            while not q.ops:
                if engine.closed or q.closed or time.monotonic() >= idle_until:
                    q.worker = None
                    return
                q.cv.wait(max(0.01, idle_until - time.monotonic()))
            seq, fn, deps, work = q.ops[0]
            try:
                _wait_locked(q, seq - 1)
                for dq, ds in deps:
                    _wait_locked(dq, ds)
            except RuntimeError as exc:
                err: Optional[BaseException] = exc
            else:
                err = None
            if engine.closed:
                q.worker = None
                return
        if err is None:
            if work and core.delay_s:
                time.sleep(core.delay_s)
            try:
                if fn is not None:
                    fn()
            except BaseException as exc:
                err = exc
        # let go of the operation now: its closure holds what it touched (a freed allocation's
        # memory goes back only when the last reference does), and this frame lives on idle
        fn = deps = None
        if err is not None:
            # Reported before the operation counts as complete: a host thread waiting on it
            # (cudaStreamSynchronize) must wake to the fault, not to success (CUDA Runtime API,
            # "Error Handling": the error is returned by the synchronizing call).
            engine.on_error(q, err)
        with lock:
            if q.ops and q.ops[0][0] == seq:
                q.ops.popleft()
            if q.done < seq:
                q.done = seq
            if q._waiting:
                q.cv.notify_all()
            if q.closed and q.done >= q.enqueued:
                engine._retire(q)
