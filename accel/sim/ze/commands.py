"""Command lists and queues: immediate and regular lists, copies, fills, event signals, waits
and resets, barriers, close / reset / destroy, queues executing lists, and host synchronize.
"""

from __future__ import annotations

from typing import Optional

from .. import _memory, _ze_counters, core
from ..core import ffi
from .objects import _CmdList, _CmdQueue, _Device, _Runtime
from .common import _addr, _flags_unknown, _ready, _ready_get, _struct_arg_code
from .discovery import _GROUPS, _fill_pattern_max
from .events import _device_signal, _host_wait, _host_waiting, _scope_problem
from .virtual_memory import _reservation_ctx, _vmm_range


# -- command lists and queues ---------------------------------------------------------------------

def _queue_target(hContext, hDevice, desc, out, expected_stype: str, ordinal_field: str):
    """The checks every creator of a queue or command list makes: ``(rc, rt, dev)``,
    with ``rc`` the result code to return when it is not 0."""
    rt, _context, rc = _ready_get(_ready, hContext, "context")
    if rc:
        return rc, rt, None
    C = rt.C
    dev = rt.get(hDevice, "device")
    if dev is None:
        return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE, rt, None
    # (r70h) ze_api.h @returns: "nullptr == desc" (altdesc), "nullptr == phCommandList" /
    # "nullptr == phCommandQueue" (memory.py, _null_pointers): the list or queue, with its
    # engine queue, was made and leaked before the write to a NULL out-pointer raised.
    # An extension structure (memory.py, _no_extension): not simulated, refused.
    rc = _struct_arg_code(C, desc, expected_stype, out)
    if rc:
        return rc, rt, None
    if getattr(desc, ordinal_field) >= len(_GROUPS):
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT, rt, None
    return 0, rt, dev


def _queue_desc_code(rt: _Runtime, call: str, desc) -> int:
    """The checks of a ze_command_queue_desc_t (zeCommandQueueCreate, zeCommandListCreateImmediate):
    ZE_RESULT_ERROR_INVALID_ENUMERATION for a flag the driver's API version does not define
    (common._FLAG_MASKS: "0x1 < desc->flags" in v1.4, 0x3 from 1.7), "ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS <
    desc->mode" and "ZE_COMMAND_QUEUE_PRIORITY_PRIORITY_HIGH < desc->priority" (ze_api.h); ``index``
    "must be zero if ZE_COMMAND_QUEUE_FLAG_EXPLICIT_ONLY is not set", and below the group's queue
    count when it is (ZE_RESULT_ERROR_INVALID_ARGUMENT: the header names no code)."""
    C = rt.C
    if (_flags_unknown(rt, call, desc.flags) or desc.mode > C.ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS
            or desc.priority > C.ZE_COMMAND_QUEUE_PRIORITY_PRIORITY_HIGH):
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    if desc.index and (not desc.flags & C.ZE_COMMAND_QUEUE_FLAG_EXPLICIT_ONLY
                       or desc.index >= _GROUPS[desc.ordinal][1]):
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    return 0


def zeCommandListCreateImmediate(hContext, hDevice, altdesc, phCommandList):
    rc, rt, dev = _queue_target(hContext, hDevice, altdesc, phCommandList, "ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC",
                                "ordinal")
    if rc:
        return rc
    C = rt.C
    rc = _queue_desc_code(rt, "zeCommandListCreateImmediate", altdesc)    # IN_ORDER from API 1.7
    if rc:
        return rc
    in_order = bool(altdesc.flags & C.ZE_COMMAND_QUEUE_FLAG_IN_ORDER)
    q = rt.engine.queue(f"xpu{dev.ordinal}-immediate")
    cl = rt._add(_CmdList(rt.get(hContext, "context"), dev, True, q, in_order, altdesc.ordinal))
    if not in_order:
        cl.order = _Order(True)     # (r69f) "lists without IN_ORDER" below
    phCommandList[0] = cl.key
    return 0


def zeCommandListCreate(hContext, hDevice, desc, phCommandList):
    rc, rt, dev = _queue_target(hContext, hDevice, desc, phCommandList, "ZE_STRUCTURE_TYPE_COMMAND_LIST_DESC",
                                "commandQueueGroupOrdinal")
    if rc:
        return rc
    C = rt.C
    in_order = bool(desc.flags & C.ZE_COMMAND_LIST_FLAG_IN_ORDER)
    # ze_api.h, zeCommandListCreate: INVALID_ENUMERATION for a flag the driver's API version does not
    # define (common._FLAG_MASKS: "0x7 < desc->flags" in v1.4, IN_ORDER from 1.7, 0x1f in 1.9);
    # ZE_COMMAND_LIST_FLAG_IN_ORDER "Cannot be combined with ZE_COMMAND_LIST_FLAG_RELAXED_ORDERING"
    if (_flags_unknown(rt, "zeCommandListCreate", desc.flags)
            or in_order and desc.flags & C.ZE_COMMAND_LIST_FLAG_RELAXED_ORDERING):
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    cl = rt._add(_CmdList(rt.get(hContext, "context"), dev, False, None, in_order, desc.commandQueueGroupOrdinal))
    if not in_order:
        cl.order = _Order(False)    # (r69f) "lists without IN_ORDER" below
    phCommandList[0] = cl.key
    return 0


def _busy(cl: _CmdList) -> bool:
    if cl.immediate:
        # Not the engine queue's count: it completes an operation only after the operation's
        # signal has woken the host, which may destroy the list at once (the device is done).
        return cl.finished < cl.submitted
    return cl.executing is not None and cl.executing[0].done < cl.executing[1]


def zeCommandListDestroy(hCommandList):
    rt, cl, rc = _ready_get(_ready, hCommandList, "cmdlist")
    if rc:
        return rc
    if _busy(cl):
        return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE   # the device still references it
    with rt.lock:
        if cl in rt.host_waits:
            # (r73c) another host thread is inside zeCommandListHostSynchronize on it (level-zero-spec
            # INTRO.rst, "Multithreading and Concurrency"; events._host_waiting): refused, nothing changed
            return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
        rt._forget(cl)
    cl.ops = []
    if cl.queue is not None:
        rt.engine.close_later(cl.queue)
    return 0


def zeCommandListClose(hCommandList):
    rt, cl, rc = _ready_get(_ready, hCommandList, "cmdlist")
    if rc:
        return rc
    if cl.immediate:
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if cl.closed:
        # (r71g) A second close of a closed list.  ze_api.h, zeCommandListClose ("Closes a command
        # list; ready to be executed by a command queue") lists no code for it and PROG.rst does not
        # say what closing a closed list does: the spec is silent, so it is refused, with the code
        # an append to a closed list gets (ZE_RESULT_ERROR_INVALID_ARGUMENT); the list stays closed
        # and executable.  Before r71g it was accepted.
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    cl.closed = True
    return 0


def zeCommandListReset(hCommandList):
    rt, cl, rc = _ready_get(_ready, hCommandList, "cmdlist")
    if rc:
        return rc
    if _busy(cl):
        return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    cl.ops.clear()
    cl.closed = False
    if cl.order is not None:
        cl.order = _Order(cl.immediate)     # a fresh list: nothing appended orders what comes next
    # Its earlier executions are forgotten: the next execution runs new contents, not a
    # re-execution (the event-reset rule in _executable).  Not busy, so nothing references it.
    cl.executing = None
    return 0


class _Op:
    """One command: ``fn`` (the work, may be None), the events it waits for, signals and resets;
    ``traffic`` the (read, written) bytes of device memory it moves (the Sysman counters);
    ``kernel`` the kernel object a launch runs (_ze_kernels.py), referenced until it ran;
    ``memory`` the USM allocations it touches, likewise referenced (zeMemFree).  (r69f) On a list
    without IN_ORDER: ``ranges`` the (reads, writes) address ranges a copy or fill touches (a
    kernel's are seen as it runs, _ze_kernels.py), and ``rec`` its place among the list's
    commands (:class:`_Rec`, set by :func:`_order`)."""
    __slots__ = ("fn", "waits", "signal", "reset", "work", "label", "traffic", "kernel", "memory", "ranges", "rec")

    def __init__(self, fn, waits=(), signal=None, reset=None, work=True, label="", traffic=(0, 0), kernel=None,
                 ranges=((), ())):
        self.fn, self.waits, self.signal, self.reset, self.work, self.label = fn, waits, signal, reset, work, label
        self.traffic, self.kernel = traffic, kernel
        self.memory = ()
        self.ranges = ranges
        self.rec = None


def _is_device_memory(a) -> bool:
    """A copy side: a USM allocation, or None for mapped virtual memory (device pages)."""
    return a is None or a.kind == _memory.DEVICE


def _submit(rt: _Runtime, queue, op: _Op, device: Optional[_Device] = None, ordinal: int = 0,
            owner: Optional["_CmdList"] = None, source: Optional["_CmdList"] = None) -> None:
    """Put ``op`` on an engine queue; the event bookkeeping happens in submission order.  Work
    (``op.fn``) run for ``device`` is charged to its tiles' Sysman counters (_ze_counters), to
    the engine group of queue group ``ordinal``, when it completes.  ``owner``: the immediate
    list it is appended to, which the device references until the operation ran (_busy).
    ``source``: the command list (immediate or regular) the operation belongs to, for the
    event-scope rules (events.py)."""
    meters = [device.card.meters[t] for t in device.tiles] if device is not None and op.fn is not None else ()
    group = _GROUPS[ordinal][0] if ordinal < len(_GROUPS) else "all"
    reads, writes = op.traffic
    with rt.lock:
        deps = [(ev.eq, ev.last_reset_sig + 1) for ev in op.waits]
        sig, rst, fn, waits, rec = op.signal, op.reset, op.fn, op.waits, op.rec
        # PROG.rst: "The duration of a kernel timestamp for zeCommandListAppendSignalEvent and
        # zeEventHostSignal is undefined": a plain signal leaves no timestamp to query
        timed = op.label != "signal"
        used = list(_op_events(op))
        for ev in used:
            ev.refs += 1   # the device references it until this operation ran (zeEventDestroy)
        kernel = op.kernel
        if kernel is not None:
            kernel.f["refs"] += 1   # likewise (zeKernelDestroy)
        memory = op.memory
        for a in memory:
            rt.alloc_refs[a] = rt.alloc_refs.get(a, 0) + 1   # likewise (zeMemFree)
        if owner is not None:
            owner.submitted += 1
        if sig is not None:
            sig.sig_submitted += 1
            used.remove(sig)        # (released as the signal becomes visible: _device_signal)
        if rst is not None:
            rst.last_reset_sig = rst.sig_submitted

        def release(start):
            # The device is done with the list, the kernel and the other events: released
            # before the signal, since a host thread that sees it may destroy them at once.
            with rt.lock:
                if meters:
                    _ze_counters.account(meters, group, start, _ze_counters.now_us(), reads, writes)
                for ev in used:
                    ev.refs -= 1
                if kernel is not None:
                    kernel.f["refs"] -= 1
                for a in memory:
                    n = rt.alloc_refs[a] - 1
                    if n:
                        rt.alloc_refs[a] = n
                    else:
                        del rt.alloc_refs[a]   # bounded by the operations not yet run
                if owner is not None:
                    owner.finished += 1

        def run():
            start = _ze_counters.now_us() - int(core.delay_s * 1e6) if meters else 0   # the engine slept first
            released = signalled = False
            try:
                if waits:
                    # ze_api.h, ze_event_desc_t.signal (events.py, "event scopes"): a wait released by
                    # another command list's signal whose scope does not reach this list (0: "within
                    # the command list only"; SUBDEVICE: "local sub-device access") would read what
                    # the signalling work left in caches it never flushed: the command faults, as on
                    # a page fault (the device is lost), instead of running as if synchronized.
                    with rt.lock:
                        why = next(filter(None, (_scope_problem(rt, ev, source) for ev in waits)), None)
                    if why:
                        raise RuntimeError(f"{op.label}: {why}")
                if rec is not None and rec.fault:
                    raise RuntimeError(rec.fault)   # (r69f) a signal not ordered after earlier work
                if fn is not None:
                    fn()
                if rec is not None and rec.peers:
                    why = _hazard(rec)              # (r69f) unordered commands touching one range
                    if why:
                        raise RuntimeError(why)
                if rst is not None:
                    rst.signaled = False
                released = True
                release(start)
                if sig is not None:
                    signalled = True
                    _device_signal(rt, sig, timed, source, rec)
            finally:
                if not released:
                    release(start)
                if sig is not None and not signalled:
                    with rt.lock:
                        sig.refs -= 1
        # Always a "work" operation: the engine runs markers with its lock held, and
        # signalling an event takes that lock.
        queue.submit(run, deps, True)


def _events(rt, hSignalEvent, numWaitEvents, phWaitEvents):
    """(signal event or None, wait events) or an error code."""
    sig = None
    if hSignalEvent:
        sig = rt.get(hSignalEvent, "event")
        if sig is None:
            return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    waits = []
    if numWaitEvents:
        if not phWaitEvents:
            return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
        for i in range(numWaitEvents):
            ev = rt.get(phWaitEvents[i], "event")
            if ev is None:
                return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
            waits.append(ev)
    return sig, tuple(waits)


def _op_events(op: _Op) -> tuple:
    extra = tuple(ev for ev in (op.signal, op.reset) if ev is not None)
    return op.waits + extra if extra else op.waits


# -- lists without IN_ORDER (r69f) -----------------------------------------------------------------
# PROG.rst, Barriers > Execution Barriers: "Commands executed on a command list are only guaranteed
# to start in the same order in which they are submitted; i.e. there is no implicit definition of
# the order of completion"; Memory Barriers: "Commands executed on a command list are *not*
# guaranteed to maintain memory coherency with other commands".  Only ZE_COMMAND_LIST_FLAG_IN_ORDER
# (ZE_COMMAND_QUEUE_FLAG_IN_ORDER for an immediate list; API 1.7) makes the driver enforce
# "dependencies between them"; otherwise the orderings are the application's:
# zeCommandListAppendBarrier with no wait events ("all previous commands ... must complete prior to
# the execution of the barrier"; "This command blocks all following commands from beginning until
# the execution of the barrier completes"), a barrier with wait events (it waits for those events
# only, and still blocks what follows), a command's phWaitEvents, zeCommandListAppendWaitOnEvents
# ("events to wait on before continuing"), and, on an immediate list, the host having seen work
# complete before appending more.  The simulator ran such lists in order: a program missing a
# barrier worked here and raced on a GPU (commands overlap, or complete out of order).  It still runs
# them in order, and faults (the device is lost, the reason in sim.state()["ze_errors"], as for the
# other device faults) when the order mattered:
#   * two commands of the list that nothing above orders touch overlapping bytes, one of them
#     writing: the later one faults as it runs (copies and fills by their ranges; a kernel by the
#     bytes its reference viewed, and changed: _ze_kernels.py);
#   * zeCommandListAppendSignalEvent (or a signalling barrier with wait events) of an event from a
#     ZE_EVENT_POOL_FLAG_HOST_VISIBLE pool while earlier work of the list is not ordered before it:
#     the signal may complete first, so the host waiting for it would go on before that work (its
#     only content is its place in the list, which such a list does not keep).  A command's own
#     signal event ("signal on completion") covers that command only and is not checked.
# Events signalled and waited for across lists, queues and the host are the existing rules
# (events.py); the commands of one list are analysed, with at most _OPEN_LIMIT unordered ones kept.

_OPEN_LIMIT = 1024


class _Rec:
    """One command of a list without IN_ORDER: ``n`` its number in the list; ``before`` the
    numbers of the earlier unordered work commands ordered before it (by events, waits); ``peers``
    the earlier work commands nothing orders before it; ``reads``/``writes`` the address ranges it
    touches (a kernel's: of its latest run); ``fault`` why it faults as it runs (a signal)."""
    __slots__ = ("n", "label", "work", "before", "peers", "reads", "writes", "fault", "order")

    def __init__(self, order, n, label, work, before):
        self.order, self.n, self.label, self.work, self.before = order, n, label, work, before
        self.peers = ()
        self.reads = self.writes = ()
        self.fault = None


class _Order:
    """What orders the commands of a command list without IN_ORDER (``cl.order``): ``open`` the
    work commands since the last barrier that later commands may still overlap; ``gate`` what every
    later command is ordered after (waits, barriers with wait events); ``signals`` event -> the
    command of the list whose signal of it comes last.  Changed under ``rt.lock``."""
    __slots__ = ("immediate", "open", "gate", "signals", "count")

    def __init__(self, immediate: bool):
        self.immediate = immediate
        self.count = 0
        self.open, self.gate, self.signals = [], frozenset(), {}

    def host_saw(self, rec: _Rec) -> None:
        """The host saw ``rec``'s signal (zeEventHostSynchronize / zeEventQueryStatus): on an
        immediate list, ``rec`` and what the list orders before it are ordered before every command
        appended from now on (caller holds rt.lock)."""
        if self.immediate:
            gone = rec.before | {rec.n}
            self.open = [r for r in self.open if r.n not in gone]

    def host_synchronized(self, upto: int) -> None:
        """zeCommandListHostSynchronize saw the immediate list's commands up to number ``upto``
        complete (caller holds rt.lock)."""
        self.open = [r for r in self.open if r.n > upto]


def _order(rt: _Runtime, o: _Order, op: _Op) -> None:
    """Place ``op``, being appended to a list without IN_ORDER, among the list's commands: what
    orders it after which earlier ones, and which earlier ones it may overlap (op.rec)."""
    with rt.lock:
        o.count += 1
        n = o.count
        label = op.label
        if label == "barrier" and not op.waits:
            # "all previous commands ... must complete prior to the execution of the barrier" and it
            # "blocks all following commands": everything before is ordered before everything after
            # (its own signal included)
            o.open, o.gate, o.signals = [], frozenset(), {}
            return
        if label == "reset":
            o.signals.pop(op.reset, None)   # a later wait is released by some later signal
            return
        live = {r.n for r in o.open}
        before = set(o.gate)
        for ev in op.waits:
            r = o.signals.get(ev)
            if r is not None:
                before.add(r.n)
                before |= r.before
        before = frozenset(before & live)
        if label in ("wait", "barrier"):
            # zeCommandListAppendWaitOnEvents, or a barrier with wait events: the commands after it
            # start once the events are signalled (and their signalling commands ran)
            o.gate = before
            if op.signal is None:
                return
        work = op.fn is not None
        rec = _Rec(o, n, f"command {n} ({label})", work, before)
        peers = tuple(r for r in o.open if r.n not in before)
        if work:
            rec.peers = peers
            rec.reads, rec.writes = op.ranges
            o.open.append(rec)
            if len(o.open) > _OPEN_LIMIT:
                del o.open[0]
        elif peers and op.signal.pool.flags & rt.C.ZE_EVENT_POOL_FLAG_HOST_VISIBLE:
            what = "signal" if label == "signal" else "barrier with wait events"
            rec.fault = (
                f"{rec.label}: the {what} of host-visible event {int(ffi.cast('uintptr_t', op.signal.key)):#x} "
                f"follows {peers[-1].label} with no barrier or event wait ordering it after that work, on a "
                f"command list without IN_ORDER: the signal may complete first, and a host waiting for it "
                f"go on before the work is done (PROG.rst, Barriers > Execution Barriers: \"Commands executed "
                f"on a command list are only guaranteed to start in the same order in which they are "
                f"submitted; i.e. there is no implicit definition of the order of completion\"); signal it "
                f"from zeCommandListAppendBarrier(hCommandList, hEvent, 0, nullptr), or create the list "
                f"with the IN_ORDER flag")
        if op.signal is not None:
            o.signals[op.signal] = rec
        op.rec = rec


def _overlap(a, b):
    """The first overlap of two lists of [lo, hi) ranges, or None."""
    for lo, hi in a:
        for lo2, hi2 in b:
            if lo < hi2 and lo2 < hi:
                return max(lo, lo2), min(hi, hi2)
    return None


def _hazard(rec: _Rec) -> Optional[str]:
    """Why ``rec``, having run, raced an earlier command of its list that nothing ordered before
    it (both touch a byte, one writing), or None."""
    for y in rec.peers:
        hit = _overlap(rec.writes, y.writes) or _overlap(rec.writes, y.reads) or _overlap(rec.reads, y.writes)
        if hit is not None:
            lo, hi = hit
            return (f"{rec.label} and {y.label}, appended before it, both touch [{lo:#x}, {hi:#x}), one "
                    f"writing, and nothing orders them on a command list without IN_ORDER (no barrier, "
                    f"event wait or host synchronization between them): they may run concurrently or "
                    f"complete in either order (PROG.rst, Barriers > Execution Barriers: \"Commands "
                    f"executed on a command list are only guaranteed to start in the same order in which "
                    f"they are submitted; i.e. there is no implicit definition of the order of "
                    f"completion\"; Memory Barriers: \"not guaranteed to maintain memory coherency with "
                    f"other commands\"); append zeCommandListAppendBarrier between them, or create the list "
                    f"with the IN_ORDER flag")
    return None


def _append(rt: _Runtime, hCommandList, op: _Op, memory=()) -> int:
    cl = rt.get(hCommandList, "cmdlist")
    if cl is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    for ev in _op_events(op):
        # ze_api.h, zeCommandListAppend*: "The application must ensure the events are accessible by
        # the device on which the command list was created" and "the command list and events were
        # created on the same context".
        if ev.pool.context is not cl.ctx or not ev.pool.visible_to(cl.device):
            return rt.C.ZE_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT
    for a in memory:
        # ze_api.h, zeCommandListAppendMemoryCopy/Fill: "... and the memory was allocated, on the
        # same context."
        if rt.alloc_ctx.get(a.base) is not cl.ctx:
            return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
        if _inaccessible(rt, cl.device, a):
            return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT     # (r71k) see _inaccessible
    op.memory = tuple(memory)
    if not cl.immediate and cl.closed:
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if cl.order is not None:
        _order(rt, cl.order, op)
    if cl.immediate:
        _submit(rt, cl.queue, op, cl.device, cl.ordinal, owner=cl, source=cl)
    else:
        cl.ops.append(op)
    return 0


def _inaccessible(rt: _Runtime, device: _Device, a) -> Optional[str]:
    """(r71k) Why ``device`` (a command list's) may not touch ``a``, device memory of a card it has
    no peer access to (zeDeviceCanAccessPeer false: ACCEL_SIM_PEER), or None.  ``a``: a USM
    allocation or a virtual-memory mapping (_vmm.Mapping), whose ``device`` is the owning device's
    ordinal.  Level Zero specification (ze_api.h 1.4 on this machine; level-zero-spec
    scripts/core/*.yml and PROG.rst):

    - zeMemAllocDevice: "In general, a device allocation may only be accessed by the device that
      owns it" and "The application must only use the memory allocation for the context and
      device, or its sub-devices, which was provided during allocation".
    - zeDeviceCanAccessPeer: "Queries if one device can directly access peer device allocations";
      PROG.rst, Memory: a device allocation is accessible by "Another Device: Optional (may
      require p2p)"; "Peer-to-Peer Access and Queries": "Copy data between devices over
      peer-to-peer fabric: zeCommandListAppendMemoryCopy".  So a peer device (the query true:
      same card, or cards on one root complex / fabric) may access it: nothing is refused then.
    - zeCommandListAppendMemoryCopy / AppendMemoryFill: "The application must ensure the memory
      pointed to by dstptr and srcptr is accessible by the device on which the command list was
      created"; zeCommandListAppendLaunchKernel: "the memory was allocated, on the same context".
    - PROG.rst, "P2P Access to Physical Memory on Another Device": "This cross-device physical
      memory access is only valid if zeDeviceCanAccessPeer returns success for the two devices
      involved. Attempting to use physical memory from a device without verified P2P access
      results in undefined behavior" (and likewise for one VA range mapped over two devices).

    No code is named for device memory the list's device cannot access (undefined behaviour):
    refused, with ZE_RESULT_ERROR_INVALID_ARGUMENT as memory of another context is, at append;
    where only the run sees it (a kernel's indirect access) the device faults (DEVICE_LOST).  Host
    allocations are reachable from every device ("Any Device: Yes"); a copy between two cards
    without peer access must be staged through host memory by the application."""
    if a is None or a.kind != _memory.DEVICE or not 0 <= a.device < len(rt.devices):
        return None
    owner = rt.devices[a.device]
    if owner.card is device.card or core.peer_capable(owner.card.index, device.card.index):
        return None
    return (f"device memory 0x{a.base:x}+{a.size} of device {a.device} (card {owner.card.index}) used by "
            f"device {device.ordinal} (card {device.card.index}), which cannot access it "
            f"(zeDeviceCanAccessPeer false; ACCEL_SIM_PEER): stage the copy through host memory")


def _usm(rt: _Runtime, addr: int, size: int):
    """The live USM allocation holding [addr, addr+size), or None (pageable or out of range)."""
    a = rt.memory.find(addr)
    if a is None or addr + size > a.base + a.size:
        return None
    return a


def _checked_range(rt: _Runtime, addr: int, size: int, what: str, expected=None) -> None:
    # At execution: the memory must still be allocated (a freed buffer means a backend bug), and
    # be the allocation the command was appended with, not a later one at a reused address.
    a = _usm(rt, addr, size)
    if a is None or (expected is not None and a is not expected):
        raise RuntimeError(f"{what} touches {size} bytes at {addr:#x}, outside every live allocation "
                           "it was appended with (freed while queued work still used it?)")


def zeCommandListAppendMemoryCopy(hCommandList, dstptr, srcptr, size, hSignalEvent, numWaitEvents, phWaitEvents):
    rt, rc = _ready()
    if rc:
        return rc
    got = _events(rt, hSignalEvent, numWaitEvents, phWaitEvents)
    if isinstance(got, int):
        return got
    sig, waits = got
    dst, src = _addr(dstptr), _addr(srcptr)
    if not dst or not src:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if size and dst < src + size and src < dst + size:
        # ze_api.h, ZE_RESULT_ERROR_OVERLAPPING_REGIONS: "copy operations do not support
        # overlapping regions of memory" (zeCommandListAppendMemoryCopy's entry is silent:
        # refused with that code, for USM and virtual memory alike).
        return rt.C.ZE_RESULT_ERROR_OVERLAPPING_REGIONS
    memory = ()
    if size:
        memory = (_usm(rt, dst, size), _usm(rt, src, size))
        traffic = (size if _is_device_memory(memory[1]) else 0, size if _is_device_memory(memory[0]) else 0)
        if None in memory and rt.vmm.reservations:
            return _vmm_copy(rt, hCommandList, dst, src, size, memory, waits, sig, traffic)
        if None in memory:
            return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT   # not device-accessible USM memory

    def copy():
        if size:
            _checked_range(rt, src, size, "memory copy source", memory[1])
            _checked_range(rt, dst, size, "memory copy destination", memory[0])
            ffi.memmove(_memory.char_ptr(dst), _memory.char_ptr(src), size)
    return _append(rt, hCommandList, _Op(copy, waits, sig, label=f"copy {size}",
                                         traffic=traffic if size else (0, 0),
                                         ranges=(((src, src + size),), ((dst, dst + size),))), memory)


def zeCommandListAppendMemoryFill(hCommandList, ptr, pattern, pattern_size, size, hSignalEvent,
                                  numWaitEvents, phWaitEvents):
    rt, rc = _ready()
    if rc:
        return rc
    got = _events(rt, hSignalEvent, numWaitEvents, phWaitEvents)
    if isinstance(got, int):
        return got
    sig, waits = got
    dst = _addr(ptr)
    if not dst or not pattern:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    cl = rt.get(hCommandList, "cmdlist")
    # ze_api.h: "The pattern size must be a power-of-two and less than or equal to
    # ze_command_queue_group_properties_t.maxMemoryFillPatternSize" -- of the list's queue group.
    most = _fill_pattern_max(cl.ordinal) if cl is not None else 16
    if pattern_size == 0 or pattern_size & (pattern_size - 1) or pattern_size > most:
        return rt.C.ZE_RESULT_ERROR_INVALID_SIZE
    if size % pattern_size:
        return rt.C.ZE_RESULT_ERROR_INVALID_SIZE
    if dst % pattern_size:
        # ze_api.h, zeCommandListAppendMemoryFill: "The ptr must be aligned to pattern_size"
        return rt.C.ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT
    memory = (_usm(rt, dst, size),) if size else ()
    pat = bytes(ffi.buffer(ffi.cast("char *", pattern), pattern_size))   # read at append time
    if None in memory and rt.vmm.reservations:
        region = _vmm_range(rt, dst, size, True)
        if region is not None:
            data = pat * (size // pattern_size)
            return _vmm_append(rt, hCommandList, [(dst, region)], lambda: ffi.buffer(
                _memory.char_ptr(dst), size).__setitem__(slice(None), data), waits, sig, f"fill {size}", (),
                traffic=(0, size), ranges=((), ((dst, dst + size),)))
    if None in memory:
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT

    def fill():
        if size:
            _checked_range(rt, dst, size, "memory fill", memory[0])
            ffi.buffer(_memory.char_ptr(dst), size)[:] = pat * (size // pattern_size)
    return _append(rt, hCommandList, _Op(fill, waits, sig, label=f"fill {size}", traffic=(0, size),
                                         ranges=((), ((dst, dst + size),))), memory)


def _vmm_copy(rt, hCommandList, dst, src, size, memory, waits, sig, traffic=(0, 0)):
    """A copy with a side in virtual memory (the other a USM allocation, or virtual memory too)."""
    sides, usm = [], []
    for addr, a, write in ((dst, memory[0], True), (src, memory[1], False)):
        if a is not None:
            usm.append(a)
            continue
        region = _vmm_range(rt, addr, size, write)
        if region is None:
            return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT      # neither USM nor virtual memory
        sides.append((addr, region))
    return _vmm_append(rt, hCommandList, sides, lambda: ffi.memmove(_memory.char_ptr(dst), _memory.char_ptr(src),
                                                                     size), waits, sig, f"copy {size}", tuple(usm),
                       usm_ranges=((dst, memory[0]), (src, memory[1])), size=size, traffic=traffic,
                       ranges=(((src, src + size),), ((dst, dst + size),)))


def _vmm_append(rt, hCommandList, sides, work, waits, sig, label, usm, usm_ranges=(), size=0, traffic=(0, 0),
                ranges=((), ())):
    """Append ``work`` touching virtual memory ``sides`` [(addr, Region | why)].  An access to an
    unmapped or inaccessible page is appended and faults when it runs (the device's page fault:
    the device is lost); the mappings are checked again when it runs, under the space's lock
    (zeVirtualMemUnmap does not wait for queued work)."""
    cl = rt.get(hCommandList, "cmdlist")
    if cl is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    for addr, region in sides:
        if not _reservation_ctx(rt, addr, cl.ctx):
            return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
        if region.__class__ is not str and any(_inaccessible(rt, cl.device, m) for m in region.maps):
            # (r71k) physical memory of a card without peer access, mapped here: PROG.rst "P2P
            # Access to Physical Memory on Another Device" ("only valid if zeDeviceCanAccessPeer
            # returns success"; _inaccessible): refused at append, as USM is
            return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    lock = rt.vmm.lock

    def run():
        with lock.shared():
            for addr, region in sides:
                why = region if region.__class__ is str else region.problem()
                if why:
                    raise RuntimeError(f"{label}: page fault at 0x{addr:x}: {why}")
            for addr, a in usm_ranges:
                if a is not None:
                    _checked_range(rt, addr, size, label, a)
            work()
    return _append(rt, hCommandList, _Op(run, waits, sig, label=label, traffic=traffic, ranges=ranges), usm)


def zeCommandListAppendSignalEvent(hCommandList, hEvent):
    rt, ev, rc = _ready_get(_ready, hEvent, "event")
    if rc:
        return rc
    return _append(rt, hCommandList, _Op(None, (), ev, work=False, label="signal"))


def zeCommandListAppendWaitOnEvents(hCommandList, numEvents, phEvents):
    rt, rc = _ready()
    if rc:
        return rc
    if not phEvents:
        # ze_api.h, zeCommandListAppendWaitOnEvents @returns: ZE_RESULT_ERROR_INVALID_NULL_POINTER
        # for `nullptr == phEvents`, whatever numEvents is (the loader's parameter validation
        # checks it unconditionally); the simulator took (0, NULL) as an empty wait.
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    got = _events(rt, None, numEvents, phEvents)
    if isinstance(got, int):
        return got
    return _append(rt, hCommandList, _Op(None, got[1], work=False, label="wait"))


def zeCommandListAppendEventReset(hCommandList, hEvent):
    rt, ev, rc = _ready_get(_ready, hEvent, "event")
    if rc:
        return rc
    return _append(rt, hCommandList, _Op(None, (), None, ev, work=False, label="reset"))


def zeCommandListAppendBarrier(hCommandList, hSignalEvent, numWaitEvents, phWaitEvents):
    rt, rc = _ready()
    if rc:
        return rc
    got = _events(rt, hSignalEvent, numWaitEvents, phWaitEvents)
    if isinstance(got, int):
        return got
    return _append(rt, hCommandList, _Op(None, got[1], got[0], work=False, label="barrier"))


def zeCommandListHostSynchronize(hCommandList, timeout):
    rt, rc = _ready()
    if rc:
        return rc
    if rt.zcfg.api_version < (1, 6):
        # zeCommandListHostSynchronize is Level Zero API 1.6: an older driver's DDI table has no
        # pfnHostSynchronize. Loader source/lib/ze_libapi.cpp: a null entry after init returns
        # ZE_RESULT_ERROR_UNSUPPORTED_FEATURE (the multi-driver intercept in ze_ldrddi.cpp returns
        # ZE_RESULT_ERROR_UNINITIALIZED instead), whatever the loader's own version.
        return rt.C.ZE_RESULT_ERROR_UNSUPPORTED_FEATURE
    cl = rt.get(hCommandList, "cmdlist")
    if cl is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    if not cl.immediate:
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    q = cl.queue
    target = q.enqueued
    upto = cl.order.count if cl.order is not None else 0
    with _host_waiting(rt, cl):     # (r73c) zeCommandListDestroy meanwhile is refused
        rc = _host_wait(rt, lambda: q.done >= target or rt.lost is not None, timeout, q.cv,
                        "zeCommandListHostSynchronize")
    if rc == 0 and cl.order is not None:
        with rt.lock:   # (r69f) the host saw them complete: ordered before what it appends next
            cl.order.host_synchronized(upto)
    return rc


def zeCommandQueueCreate(hContext, hDevice, desc, phCommandQueue):
    rc, rt, dev = _queue_target(hContext, hDevice, desc, phCommandQueue, "ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC",
                                "ordinal")
    if rc:
        return rc
    C = rt.C
    rc = _queue_desc_code(rt, "zeCommandQueueCreate", desc)
    if rc:
        return rc
    if desc.flags & C.ZE_COMMAND_QUEUE_FLAG_IN_ORDER:
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT   # IN_ORDER is for immediate command lists only
    cq = rt._add(_CmdQueue(rt.get(hContext, "context"), dev, rt.engine.queue(f"xpu{dev.ordinal}-queue"),
                           desc.ordinal))
    phCommandQueue[0] = cq.key
    return 0


def zeCommandQueueDestroy(hCommandQueue):
    rt, cq, rc = _ready_get(_ready, hCommandQueue, "cmdqueue")
    if rc:
        return rc
    if not cq.queue.idle():
        return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    with rt.lock:
        if cq in rt.host_waits:
            # (r73c) another host thread is inside zeCommandQueueSynchronize on it (events._host_waiting)
            return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
        rt._forget(cq)
    rt.engine.close_later(cq.queue)
    return 0


def zeCommandQueueExecuteCommandLists(hCommandQueue, numCommandLists, phCommandLists, hFence):
    rt, cq, rc = _ready_get(_ready, hCommandQueue, "cmdqueue")
    if rc:
        return rc
    C = rt.C
    if not phCommandLists:
        # ze_api.h, zeCommandQueueExecuteCommandLists @returns: INVALID_NULL_POINTER for
        # `nullptr == phCommandLists` (the simulator dereferenced it: a Python RuntimeError)
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    if numCommandLists == 0:
        return C.ZE_RESULT_ERROR_INVALID_SIZE
    if hFence:
        return C.ZE_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT   # fences are not simulated
    with rt.lock:   # checked and marked as referenced in one step (two threads may execute at once)
        lists = _executable(rt, cq, numCommandLists, phCommandLists)
        if isinstance(lists, int):
            return lists
        for cl in lists:
            # ze_api.h: "The application must ensure the device is not currently referencing
            # the command list": referenced from here on, so a second execute meanwhile (another
            # thread, or the same list twice in this call) is refused by _busy.
            cl.executing = (cq.queue, _SUBMITTING)
    for cl in lists:
        for op in cl.ops:
            _submit(rt, cq.queue, op, cq.device, cq.ordinal, source=cl)
        cl.executing = (cq.queue, cq.queue.enqueued)
    return 0


_SUBMITTING = float("inf")   # cl.executing's last sequence number while its operations are being submitted


def _executable(rt, cq, numCommandLists, phCommandLists):
    """The lists to execute on ``cq``, or the code refusing them (caller holds ``rt.lock``)."""
    C = rt.C
    lists = []
    pending = {}    # event -> whether it holds a signal with no reset after it, as the call submits
    for i in range(numCommandLists):
        cl = rt.get(phCommandLists[i], "cmdlist")
        if cl is None:
            return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
        if cl.immediate:
            return C.ZE_RESULT_ERROR_INVALID_COMMAND_LIST_TYPE
        # ze_api.h, zeCommandQueueExecuteCommandLists: the lists must be closed, created for the
        # queue's ordinal, and "the command queue, command list and fence were created on the same
        # context".
        if not cl.closed or cl.ordinal != cq.ordinal or cl.device is not cq.device or cl.ctx is not cq.ctx:
            return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
        if _busy(cl) or cl in lists:
            return C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE   # still referenced by a submission (or twice here)
        for op in cl.ops:
            # An event destroyed after it was recorded into the list: the device would use freed
            # driver memory. The documents are silent; the simulator refuses.
            if any(not ev.live for ev in _op_events(op)):
                return C.ZE_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT
            # Likewise a kernel destroyed after its launch was recorded: the documents are silent;
            # refused with the code any call gives a destroyed kernel handle.
            if op.kernel is not None and not op.kernel.live:
                return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
            # And memory freed after the command was recorded (zeMemFree: the device must not
            # reference freed memory); at run it would touch whatever now lives at that address.
            # The documents name no code: refused with INVALID_ARGUMENT, as foreign memory is.
            if any(not a.live for a in op.memory):
                return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
        if _unreset_signal(cl, pending):
            return C.ZE_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT
        lists.append(cl)
    return lists


def _unreset_signal(cl, pending: dict) -> bool:
    """Whether re-executing ``cl`` would signal an event that still holds a signal: PROG.rst,
    Command Lists > Submission: "A command list may be submitted multiple times.  It is up to
    the application to ensure that the command list can be executed multiple times.  For
    example, events must be explicitly reset prior to re-execution."  An event the list signals
    must have had a reset submitted (zeEventHostReset, zeCommandListAppendEventReset executed
    or appended to an immediate list, or a reset earlier in this list or in an earlier list of
    the same call) after its latest signal; else the new run's waiters -- the host, another list
    -- would pass at once, before the work they wait for (the simulator let them: a silent race
    on hardware).  The first execution after creation or zeCommandListReset is exempt: "Signaling
    a signaled event ... is valid and has no effect" (PROG.rst, Events).  Caller holds rt.lock;
    ``pending`` carries the state the earlier lists of the call leave (updated here)."""
    again = cl.executing is not None
    state = {}          # this list's effect, op by op: event -> signalled (True) or reset (False)
    for op in cl.ops:
        ev = op.reset
        if ev is not None:
            state[ev] = False
        ev = op.signal
        if ev is not None:
            if again and ev not in state and pending.get(ev, ev.sig_submitted > ev.last_reset_sig):
                return True
            state[ev] = True
    pending.update(state)
    return False


def zeCommandQueueSynchronize(hCommandQueue, timeout):
    rt, cq, rc = _ready_get(_ready, hCommandQueue, "cmdqueue")
    if rc:
        return rc
    q = cq.queue
    target = q.enqueued
    with _host_waiting(rt, cq):     # (r73c) zeCommandQueueDestroy meanwhile is refused
        return _host_wait(rt, lambda: q.done >= target or rt.lost is not None, timeout, q.cv,
                          "zeCommandQueueSynchronize")
