"""Command queues and command buffers: encoding, commit, execution on the engine, completion.

Each ``MTLCommandQueue`` is a queue of the shared simulator engine (:mod:`accel.sim._engine`)
and allows 64 uncompleted command buffers.  A command buffer collects its encoders' commands
(:mod:`.encoders`) and event signals and waits (:mod:`.events`), retaining what they use; at
``commit`` each command becomes one engine operation, in order, a wait making the next
operation depend on the point that signals its value (a value no committed command buffer
signals is refused rather than waited for), and a final operation completes the buffer.  A
command that fails (an injected ``commit`` fault, a kernel reference raising, a wait whose
signal was skipped) ends the buffer in ``MTLCommandBufferStatusError`` and skips the rest,
its signals included.  GPU start and end times read 0.0 until it finishes.
"""

from __future__ import annotations

import time
from typing import Any, List, Optional, Tuple

from .. import core
from .encoders import MTLBlitCommandEncoder, MTLComputeCommandEncoder, _Encoder
from .events import MTLSharedEvent
from .objects import NSError, SimObject
from .rules import _MAX_UNCOMPLETED, MetalValidationError, _as


# MTLCommandBufferStatus
NOT_ENQUEUED, ENQUEUED, COMMITTED, SCHEDULED, COMPLETED, ERROR = range(6)
_ERR_INTERNAL = 1  # MTLCommandBufferErrorInternal
_ERR_TIMEOUT = 2   # MTLCommandBufferErrorTimeout


class MTLCommandBuffer(SimObject):
    cls_name = "MTLCommandBuffer"

    def __init__(self, rt, queue: "MTLCommandQueue"):
        super().__init__(rt)
        self.queue = rt.retain(queue)
        self.status = NOT_ENQUEUED
        queue.uncommitted += 1
        # ("op", fn) | ("wait", event, value) | ("signal", event, value), in encoding order
        self.commands: List[tuple] = []
        self.held: List[SimObject] = []
        self.encoder: Optional[_Encoder] = None
        self.error_obj: Optional[NSError] = None
        self.failure: Optional[Tuple[int, str]] = None
        self.start = self.end = 0.0
        self.final_seq = 0

    def dealloc(self):
        self._drop_held()
        if self.status == NOT_ENQUEUED:
            self.queue.uncommitted -= 1
        self.rt.release(self.queue)
        if self.error_obj is not None:
            self.rt.release(self.error_obj)

    def _drop_held(self):
        held, self.held = self.held, []
        for obj in held:
            self.rt.release(obj)

    def retain_obj(self, obj):
        self.held.append(self.rt.retain(obj))

    def uses(self, *bufs):
        for b in bufs:
            self.retain_obj(b)

    def _encodable(self, selector: str) -> None:
        if self.status != NOT_ENQUEUED:
            raise MetalValidationError(f"{selector}: command buffer {self.addr:#x} is already committed")
        if self.encoder is not None:
            raise MetalValidationError(f"{selector}: command buffer {self.addr:#x} has an active encoder; "
                                       f"call endEncoding first")

    def _new_encoder(self, kind):
        self._encodable(kind.cls_name)
        self.encoder = kind(self.rt, self)
        return self.rt.autorelease(self.encoder)

    def m_blitCommandEncoder(self):
        return self._new_encoder(MTLBlitCommandEncoder)

    def m_computeCommandEncoder(self):
        return self._new_encoder(MTLComputeCommandEncoder)

    def m_encodeSignalEvent_value_(self, event, value):
        self._encodable("encodeSignalEvent:value:")
        event = _as(self.rt, event, MTLSharedEvent)
        self.retain_obj(event)
        self.commands.append(("signal", event, value))

    def m_encodeWaitForEvent_value_(self, event, value):
        self._encodable("encodeWaitForEvent:value:")
        event = _as(self.rt, event, MTLSharedEvent)
        self.retain_obj(event)
        self.commands.append(("wait", event, value))

    def m_commit(self):
        """Each command becomes one operation of the queue's engine queue, in
        order; an event wait makes the next operation depend on the point
        where the awaited value is signaled; a final marker completes the
        command buffer."""
        if self.status != NOT_ENQUEUED:
            raise MetalValidationError(f"commit: command buffer {self.addr:#x} was already committed")
        if self.encoder is not None:
            raise MetalValidationError("commit: command buffer has an active encoder; call endEncoding first")
        self.queue.uncommitted -= 1
        code = core.take_fault("commit")
        if code:
            # The injected failure comes first: none of the buffer's commands run, its
            # encodeSignalEvent:value: included (the strictest place: the GPU may fail at any
            # command, and Apple's docs do not say whether a failed buffer still signals).
            self.commands.insert(0, ("op", lambda c=code: _fail(c, "injected fault")))
        q = self.queue.q
        deps: List[Tuple[Any, int]] = []
        awaited: List[Tuple[MTLSharedEvent, int]] = []   # waits the next operation checks
        plan = []
        for cmd in self.commands:
            if cmd[0] == "wait":
                _, event, value = cmd
                point = event.point_for(value)
                if point is False:
                    raise MetalValidationError(
                        f"encodeWaitForEvent: value {value} of event {event.addr:#x} is signaled by no "
                        f"committed command buffer (the simulator cannot wait for future signals; "
                        f"Metal would wait, possibly forever)")
                if point is not None:
                    deps.append(point)
                awaited.append((event, value))
            elif cmd[0] == "signal":
                plan.append((self._signal_op(cmd[1], cmd[2], q, awaited), tuple(deps), cmd[1], cmd[2]))
                deps, awaited = [], []
            else:
                plan.append((self._op(cmd[1], awaited), tuple(deps), None, None))
                deps, awaited = [], []
        self.commands = []
        self.status = COMMITTED
        self.rt.retain(self)  # the queue keeps a committed buffer alive until it completes
        for fn, op_deps, event, value in plan:
            seq = q.submit(fn, op_deps)
            if event is not None:
                with self.rt.lock:
                    if fn.skipped:            # it ran (inline) and skipped its signal
                        event.signal_skipped(value, (q, seq))
                    elif value > event.value:   # a value already reached needs no point
                        event.points.append((value, (q, seq)))
                        fn.seq = seq
        self.final_seq = q.submit(lambda: self._finish(awaited), tuple(deps), work=False)

    def _started(self) -> None:
        if self.status == COMMITTED:
            with self.rt.lock:
                if self.status == COMMITTED:
                    self.status = SCHEDULED
                    self.start = time.perf_counter()

    def _check_waits(self, awaited) -> None:
        """Fail the buffer at an encodeWaitForEvent:value: whose value was never signaled.

        The operation runs after the engine point that was to signal each awaited value, so a
        value still unreached means that signal was skipped: its command buffer failed first.
        Apple's docs are silent on this case (MTLCommandBuffer encodeWaitForEvent:value: only
        says the GPU "waits until the event reaches the value"; MTLSharedEvent and
        MTLCommandBufferError say nothing of a signal a failed command buffer never performs):
        the GPU would wait until its watchdog ends the command buffer.  The simulator does not
        wait (it cannot know of future signals) and does not proceed as if signaled: the waiter
        ends in MTLCommandBufferStatusError with MTLCommandBufferErrorTimeout ("the command
        buffer took too long to execute"), its remaining commands and signals skipped.
        """
        if self.failure is not None:
            return
        for event, value in awaited:
            if event.value < value:
                self.failure = (_ERR_TIMEOUT, (
                    f"encodeWaitForEvent: value {value} of MTLSharedEvent {event.addr:#x} was never "
                    f"signaled (signaledValue {event.value}): the command buffer that encoded the "
                    f"signal failed before it. Apple's docs are silent on this case (Metal would wait "
                    f"until the GPU watchdog ends this command buffer); the accel simulator fails it "
                    f"with MTLCommandBufferErrorTimeout"))
                return

    def _op(self, fn, awaited=()):
        def run():
            self._started()
            self._check_waits(awaited)
            if self.failure is not None:
                return  # an earlier command failed: the rest of the buffer does not run
            try:
                fn()
            except _CommandFailure as exc:
                self.failure = exc.args
            except Exception as exc:  # a kernel reference failed: the GPU would fault
                self.failure = (_ERR_INTERNAL, f"{type(exc).__name__}: {exc}")
        return run

    def _signal_op(self, event, value, q, awaited=()):
        def run():
            self._started()
            self._check_waits(awaited)
            if self.failure is None:
                event.signal(value)
                return
            with self.rt.lock:   # commit lists the point (run.seq) or reads run.skipped under it
                if run.seq is not None:
                    event.signal_skipped(value, (q, run.seq))
                else:
                    run.skipped = True
        run.seq = None
        run.skipped = False
        return run

    def _finish(self, awaited=()) -> None:
        self._started()
        self._check_waits(awaited)
        with self.rt.lock:
            self.end = time.perf_counter()
            if self.failure is not None:
                self.error_obj = NSError(self.rt, *self.failure)
                self.status = ERROR
            else:
                self.status = COMPLETED
            self._drop_held()
            self.rt.release(self)

    def m_waitUntilCompleted(self):
        if self.status == NOT_ENQUEUED:
            raise MetalValidationError("waitUntilCompleted on a command buffer that was never committed "
                                       "(Metal would block forever)")
        self.queue.q.wait(self.final_seq)

    def m_status(self):
        return self.status

    def m_error(self):
        return self.error_obj

    def _finished(self) -> bool:
        return self.status in (COMPLETED, ERROR)

    # Apple, MTLCommandBuffer gpuStartTime / gpuEndTime (Discussion): "The GPU start and end times
    # remain 0.0 until the GPU finishes running the command buffer. Check this value after the
    # waitUntilCompleted() method returns" (r69e: the start time was answered while it ran).
    def m_GPUStartTime(self):
        return self.start if self._finished() else 0.0

    def m_GPUEndTime(self):
        return self.end if self._finished() else 0.0


class _CommandFailure(Exception):
    """(code, text): a command buffer ends in MTLCommandBufferStatusError."""


def _fail(code: int, text: str) -> None:
    raise _CommandFailure(code, text)


class MTLCommandQueue(SimObject):
    cls_name = "MTLCommandQueue"

    def __init__(self, rt, device):
        super().__init__(rt)
        self.device = device
        self.q = rt.engine.queue(f"metal-queue-{self.addr:#x}", owner=self)
        self.uncommitted = 0        # command buffers made and not yet committed

    def dealloc(self):
        # committed buffers hold the queue: nothing is pending here
        self.rt.engine.close_later(self.q)

    def m_commandBuffer(self):
        if self.uncommitted >= _MAX_UNCOMPLETED:
            # newCommandQueue: the queue allows "up to 64 uncompleted command buffers", and
            # commandBuffer "blocks the calling CPU thread when the queue doesn't have any free
            # command buffers": with 64 never committed, none can complete, and a Mac blocks forever
            raise MetalValidationError(f"commandBuffer: the queue holds {self.uncommitted} uncommitted command "
                                       f"buffers; on a Mac this call would block forever")
        return self.rt.autorelease(MTLCommandBuffer(self.rt, self))
