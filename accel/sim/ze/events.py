"""Event pools and events: create, destroy, signal and reset from the host, query, host
synchronize, kernel timestamps; and how a device signal or wait is ordered.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Optional

from .. import core
from ..core import ffi
from .objects import _UINT64_MAX, _Event, _Pool, _Runtime
from .common import _flags_unknown, _ready, _ready_get, _struct_arg_code


# -- events ------------------------------------------------------------------------------------

def zeEventPoolCreate(hContext, desc, numDevices, phDevices, phEventPool):
    rt, ctx, rc = _ready_get(_ready, hContext, "context")
    if rc:
        return rc
    C = rt.C
    # (r70h) "nullptr == desc", "nullptr == phEventPool" (memory.py, _null_pointers): the pool
    # was made and leaked before the write to a NULL phEventPool raised.  An extension structure:
    # memory.py, _no_extension.
    rc = _struct_arg_code(C, desc, "ZE_STRUCTURE_TYPE_EVENT_POOL_DESC", phEventPool)
    if rc:
        return rc
    if desc.count == 0:
        return C.ZE_RESULT_ERROR_INVALID_SIZE
    if _flags_unknown(rt, "zeEventPoolCreate", desc.flags):   # "0x7 < desc->flags" in v1.4, 0xf from 1.6
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    # ze_api.h: ZE_EVENT_POOL_FLAG_KERNEL_TIMESTAMP "cannot be combined with ZE_EVENT_POOL_FLAG_IPC", and
    # ZE_EVENT_POOL_FLAG_KERNEL_MAPPED_TIMESTAMP (0x8) "cannot be combined with
    # ZE_EVENT_POOL_FLAG_KERNEL_TIMESTAMP" (no code named: INVALID_ENUMERATION, as for other flags)
    if desc.flags & 0x6 == 0x6 or desc.flags & 0xC == 0xC:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    if numDevices and not phDevices:
        return C.ZE_RESULT_ERROR_INVALID_SIZE       # "(nullptr == phDevices) && (0 < numDevices)"
    devices = []
    for i in range(numDevices):
        dev = rt.get(phDevices[i], "device")
        if dev is None:
            return C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
        devices.append(dev)
    # ze_api.h, zeEventPoolCreate: phDevices are the "device handles which have visibility to the
    # event pool"; none means every device of the driver.
    pool = rt._add(_Pool(desc.flags, desc.count, ctx, devices))
    phEventPool[0] = pool.key
    return 0


def zeEventPoolDestroy(hEventPool):
    rt, pool, rc = _ready_get(_ready, hEventPool, "eventpool")
    if rc:
        return rc
    # ze_api.h, zeEventPoolDestroy: "The application must destroy all event handles created from
    # the pool before destroying the pool itself."
    if pool.events:
        return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    rt._forget(pool)
    return 0


def zeEventCreate(hEventPool, desc, phEvent):
    rt, pool, rc = _ready_get(_ready, hEventPool, "eventpool")
    if rc:
        return rc
    C = rt.C
    # (r70h) "nullptr == desc", "nullptr == phEvent" (memory.py, _null_pointers): the event was
    # made, and held its index of the pool for good, before the write to a NULL phEvent raised.
    # An extension structure: memory.py, _no_extension.
    rc = _struct_arg_code(C, desc, "ZE_STRUCTURE_TYPE_EVENT_DESC", phEvent)
    if rc:
        return rc
    if desc.signal > 0x7 or desc.wait > 0x7:
        return C.ZE_RESULT_ERROR_INVALID_ENUMERATION    # "0x7 < desc->signal", "0x7 < desc->wait"
    if desc.index >= pool.count:
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    old = pool.events.get(desc.index)
    if old is not None and old.live:
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT   # index already holds an event
    ev = rt._add(_Event(pool, desc.index, rt.engine.queue(f"event-{desc.index}"), desc.signal))
    pool.events[desc.index] = ev
    phEvent[0] = ev.key
    return 0


def zeEventDestroy(hEvent):
    rt, ev, rc = _ready_get(_ready, hEvent, "event")
    if rc:
        return rc
    with rt.lock:
        # ze_api.h, zeEventDestroy: "The application must ensure the device is not currently
        # referencing the event before it is deleted."
        if ev.refs:
            return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
        if ev in rt.host_waits:
            # (r73c) another host thread is inside zeEventHostSynchronize on it (_host_waiting)
            return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
        rt._forget(ev)
        if ev.pool.events.get(ev.index) is ev:
            del ev.pool.events[ev.index]
    rt.engine.close_later(ev.eq)   # lets the engine forget the event's queue
    return 0


def _signal_now(rt: _Runtime, ev: _Event, timed: bool = True) -> None:
    """The device (or host) signals ``ev``: runs when the signal operation executes.  Not
    ``timed`` (a plain signal): its kernel timestamp is undefined (zeEventQueryKernelTimestamp)."""
    t = rt.ticks()
    ev.ts = (t, t) if timed else None
    ev.signaled = True
    ev.eq.submit(None, work=False)   # one more executed signal: wakes waits and host syncs


def _device_signal(rt: _Runtime, ev: _Event, timed: bool = True, origin=None, cmd=None) -> None:
    """A submitted signal operation executes: the device's reference of ``ev`` ends as the signal
    becomes visible, in one step under ``rt.lock``, so a host thread that saw the signal may
    reset or destroy the event (zeEventHostReset, zeEventDestroy check ``refs`` under that lock).
    No engine lock is ever held while ``rt.lock`` is taken, so the marker submitted here is safe.
    ``origin``: the command list whose operation signals (the event-scope rules); ``cmd``: that
    operation's place in a list without IN_ORDER (commands._Rec, r69f), else None."""
    with rt.lock:
        ev.refs -= 1
        ev.origin = origin
        ev.origin_cmd = cmd
        _signal_now(rt, ev, timed)


# -- event scopes ------------------------------------------------------------------------------------
# ze_api.h, ze_event_desc_t.signal: "defines the scope of relevant cache hierarchies to flush on a
# signal action before the event is triggered ... default behavior is synchronization within the
# command list only, no additional cache hierarchies are flushed"; ze_event_scope_flag_t:
# ZE_EVENT_SCOPE_FLAG_SUBDEVICE "sufficient for local sub-device access", _DEVICE "sufficient for
# global device access and peer device access", _HOST "sufficient for device and host access". A
# wider flag covers the narrower accesses, so a scope reaches a level when its highest bit does.
# The simulator ignored the scopes: a scope-0 device signal released host waits and other lists'
# waits with the writes it orders visible everywhere. Not enforced: ze_event_desc_t.wait (Intel's
# SYCL runtime waits with wait scope 0 on signal=HOST events, intel/llvm PR 3413 "Avoid HOST .wait
# scope; .signal=HOST is expected to be enough": refusing it would be stricter than the vendor).

def _scope_needed(rt: _Runtime, origin, waiter) -> int:
    """The signal scope a wait in command list ``waiter`` (None: the host) needs for a signal by
    command list ``origin``: 0 in the same list; SUBDEVICE in another list of the same one-tile
    device; DEVICE on another device or tile (or a multi-tile root device, whose lists run on every
    tile); HOST for the host."""
    C = rt.C
    if waiter is None:
        return C.ZE_EVENT_SCOPE_FLAG_HOST
    if waiter is origin:
        return 0
    if waiter.device is origin.device and len(waiter.device.tiles) == 1:
        return C.ZE_EVENT_SCOPE_FLAG_SUBDEVICE
    return C.ZE_EVENT_SCOPE_FLAG_DEVICE


def _scope_problem(rt: _Runtime, ev: _Event, waiter) -> Optional[str]:
    """Why a wait (in ``waiter``, None: the host) released by ``ev``'s latest signal is not
    synchronized with the signalling work, or None. A host signal flushes no device cache."""
    origin = ev.origin
    if origin is None:
        return None
    need = _scope_needed(rt, origin, waiter)
    if ev.signal_scope >= need:     # need is one bit: the scope's highest bit reaches it
        return None
    where = "the host" if waiter is None else "another command list" if waiter.device is origin.device \
        else "another device"
    return (f"event {int(ffi.cast('uintptr_t', ev.key)):#x} was signalled by a command list with signal scope "
            f"{ev.signal_scope:#x} and waited for by {where}, which needs scope {need:#x} (ze_event_desc_t.signal: "
            f"the default is synchronization within the command list only)")


def _host_event(rt: _Runtime, hEvent):
    """The event, or the code refusing a host signal/reset/query/wait on it."""
    ev = rt.get(hEvent, "event")
    if ev is None:
        return rt.C.ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    # ze_api.h, ze_event_pool_flag_t: ZE_EVENT_POOL_FLAG_HOST_VISIBLE "signals and waits are also
    # visible to host". Without it the host cannot see the event; the documents name no result
    # code, so the simulator refuses with INVALID_ARGUMENT.
    if not ev.pool.flags & rt.C.ZE_EVENT_POOL_FLAG_HOST_VISIBLE:
        return rt.C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    return ev


def zeEventHostSignal(hEvent):
    rt, rc = _ready()
    if rc:
        return rc
    ev = _host_event(rt, hEvent)
    if isinstance(ev, int):
        return ev
    with rt.lock:
        ev.sig_submitted += 1
        ev.origin = None       # the host's own signal: visible to the host whatever the scope
        ev.origin_cmd = None
    _signal_now(rt, ev, timed=False)
    return 0


def zeEventHostReset(hEvent):
    rt, rc = _ready()
    if rc:
        return rc
    ev = _host_event(rt, hEvent)
    if isinstance(ev, int):
        return ev
    with rt.lock:
        # ze_api.h, zeEventHostReset states no rule for an event that submitted work still
        # signals, waits for or resets: the reset would race the device (a later signal undoes
        # it, a wait may see either state). The documents are silent: refused, with the code
        # zeEventDestroy gives while "the device is ... currently referencing the event".
        if ev.refs:
            return rt.C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
        ev.last_reset_sig = ev.sig_submitted
        ev.signaled = False
    return 0


def zeEventQueryStatus(hEvent):
    rt, rc = _ready()
    if rc:
        return rc
    ev = _host_event(rt, hEvent)
    if isinstance(ev, int):
        return ev
    if not ev.signaled:
        return rt.C.ZE_RESULT_NOT_READY
    return _host_sees(rt, ev)


def _host_sees(rt: _Runtime, ev: _Event) -> int:
    """0, or the refusal of a host wait on a signalled event whose device signal lacks
    ZE_EVENT_SCOPE_FLAG_HOST scope (the event-scope rules above): the host would go on before the
    device's writes reach it. zeEventHostSynchronize and zeEventQueryStatus list
    ZE_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT among their results: that code."""
    with rt.lock:
        why = _scope_problem(rt, ev, None)
        cmd = ev.origin_cmd
        if why is None and cmd is not None:
            # (r69f) the host saw the signal of a command of an immediate list without IN_ORDER:
            # that command, and what the list orders before it, are complete before anything the
            # host appends to the list from now on (commands.py, "lists without IN_ORDER")
            cmd.order.host_saw(cmd)
    return 0 if why is None else rt.C.ZE_RESULT_ERROR_INVALID_SYNCHRONIZATION_OBJECT


# (r73c) A host thread inside a synchronize holds the handle it waits on.  level-zero-spec
# scripts/core/INTRO.rst, "Multithreading and Concurrency": "APIs are not thread-safe with other APIs
# that use the same driver's object handle ... the application must ensure multiple threads do not
# enter these APIs when the handle is the same" (the synchronizes are free-threaded only among
# themselves: "The application may call this function from simultaneous threads"); and
# zeEventDestroy / zeCommandListDestroy / zeCommandQueueDestroy: "The application must **not** call
# this function from simultaneous threads with the same ... handle".  A destroy while another thread
# waits on the handle frees what that wait reads (on a GPU the waiter faults or never returns).  The
# simulator let it through; now such a destroy is refused with HANDLE_OBJECT_IN_USE (the code the
# destroys give while the device references the object; the documents name none for this) and
# nothing changes.  zeEventHostReset is not covered: it is free-threaded ("may call this function
# from simultaneous threads") and frees nothing.

@contextmanager
def _host_waiting(rt: _Runtime, obj):
    """The calling thread is inside a host synchronize on ``obj`` (rt.host_waits)."""
    with rt.lock:
        rt.host_waits[obj] = rt.host_waits.get(obj, 0) + 1
    try:
        yield
    finally:
        with rt.lock:
            n = rt.host_waits[obj] - 1
            if n:
                rt.host_waits[obj] = n
            else:
                del rt.host_waits[obj]


def _host_wait(rt: _Runtime, cond, timeout_ns: int, cv, what: str) -> int:
    """Wait on ``cv`` (engine lock) until ``cond()``; the Level Zero timeout rules."""
    if cond():
        # ``cond`` holds as well when the device was lost after the caller's _ready(): that is
        # DEVICE_LOST, as after the wait below (PROG.rst, Contexts: "If a device was hung or
        # reset ... all APIs will return ZE_RESULT_ERROR_DEVICE_LOST"); the simulator answered 0.
        return 0 if rt.lost is None else rt.C.ZE_RESULT_ERROR_DEVICE_LOST
    if timeout_ns == 0:
        return rt.C.ZE_RESULT_NOT_READY
    limit = core.WAIT_TIMEOUT_S if timeout_ns == _UINT64_MAX else min(timeout_ns / 1e9, core.WAIT_TIMEOUT_S)
    deadline = time.monotonic() + limit
    with rt.engine.lock:
        while not cond():
            if rt.engine.closed:
                return rt.C.ZE_RESULT_ERROR_DEVICE_LOST
            left = deadline - time.monotonic()
            if left <= 0:
                if timeout_ns == _UINT64_MAX:
                    raise RuntimeError(f"accel.sim: {what} waited {limit:.0f} s for work that never completes "
                                       "(a wait on an event nothing will signal?)")
                return rt.C.ZE_RESULT_NOT_READY
            cv.wait(left)
    if rt.lost is not None:
        return rt.C.ZE_RESULT_ERROR_DEVICE_LOST
    return 0


def zeEventHostSynchronize(hEvent, timeout):
    rt, rc = _ready()
    if rc:
        return rc
    ev = _host_event(rt, hEvent)
    if isinstance(ev, int):
        return ev
    with _host_waiting(rt, ev):     # (r73c) a destroy meanwhile is refused
        rc = _host_wait(rt, lambda: ev.signaled or rt.lost is not None, timeout, ev.eq.cv,
                        "zeEventHostSynchronize")
        return rc or _host_sees(rt, ev)


def zeEventQueryKernelTimestamp(hEvent, dstptr):
    rt, rc = _ready()
    if rc:
        return rc
    C = rt.C
    # ze_api.h, zeEventQueryKernelTimestamp: "Queries an event's timestamp value on the host", and
    # answers ZE_RESULT_NOT_READY while the event is "not signaled": a host observation of the
    # signal state, which only ZE_EVENT_POOL_FLAG_HOST_VISIBLE makes "also visible to host". The
    # documents are silent on a pool without it: refused as zeEventQueryStatus refuses it
    # (INVALID_ARGUMENT, _host_event); the simulator answered from such a pool.
    ev = _host_event(rt, hEvent)
    if isinstance(ev, int):
        return ev
    if not dstptr:
        return C.ZE_RESULT_ERROR_INVALID_NULL_POINTER   # (r70h) "nullptr == dstptr" (memory.py, _null_pointers)
    if not ev.pool.flags & C.ZE_EVENT_POOL_FLAG_KERNEL_TIMESTAMP:
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    if not ev.signaled:
        return C.ZE_RESULT_NOT_READY
    if ev.ts is None:
        # PROG.rst: "The duration of a kernel timestamp for zeCommandListAppendSignalEvent and
        # zeEventHostSignal is undefined": refused (no code named) rather than a made-up (t, t)
        return C.ZE_RESULT_ERROR_INVALID_ARGUMENT
    start, end = ev.ts
    wall = getattr(dstptr, "global")   # a C field named like a Python keyword
    wall.kernelStart, wall.kernelEnd = start, end
    dstptr.context.kernelStart, dstptr.context.kernelEnd = start, end
    return 0
