"""Simulated libobjc + Metal: the Objective-C message layer over host memory.

``ACCEL_SIM=mps`` makes :mod:`accel.backends.mps` open this instead of
``libobjc.A.dylib`` and ``Metal.framework``.  The backend code above is the
code that runs on a Mac: it calls ``objc_getClass``, ``sel_registerName``,
``objc_retain``/``objc_release``, the autorelease pool functions and
``MTLCreateSystemDefaultDevice`` on the simulated library, and casts
``objc_msgSend`` to each method's exact C type with ``ffi.cast``.  The
simulated ``ffi`` is the real objc FFI except that casting the simulated
``objc_msgSend`` yields a sender that

* checks the cast C type against the method's declaration in Apple's headers
  (return and argument types by kind and size: an ``unsigned int`` where
  ``NSUInteger`` is declared is an error, as it would corrupt registers on a
  Mac), and converts the arguments as cffi would;
* dispatches to a Python object implementing the selector, with the checks
  Metal's API validation layer makes (one active encoder per command buffer,
  no encoding after commit, blit offsets/sizes multiples of 4 on macOS, ranges
  inside buffers, ``waitUntilCompleted`` only after ``commit``...): a
  violation raises :class:`MetalValidationError` where a Mac would abort.

Objects are reference counted as Cocoa does: ``alloc``/``new``/``copy``
results start at +1, other results are autoreleased into the calling
thread's pool (an autorelease with no pool in place is counted as a leak);
command buffers retain the buffers their commands use until they complete;
a committed command buffer is kept alive by its queue until it completes.
:func:`state` exposes live objects so tests can assert that nothing leaks.

Execution: each ``MTLCommandQueue`` is a queue of the shared simulator
engine (:mod:`accel.sim._engine`, worker threads, ``ACCEL_SIM_DELAY_US`` of
latency per operation); a committed command buffer becomes one engine
operation per command, in order.  ``encodeWaitForEvent:value:`` makes the next
operation depend on the point where a committed command buffer signals that
value, so no wait can deadlock; waiting for a value that no committed command
buffer signals is reported (:class:`MetalValidationError`) instead of hanging.
A command buffer that fails skips its remaining commands, its signals included;
one that waits for a value only such a skipped signal was to reach ends in
``MTLCommandBufferStatusError`` with ``MTLCommandBufferErrorTimeout`` (the
docs are silent; the GPU would wait for its watchdog) instead of proceeding.
``newLibraryWithSource:`` finds ``kernel void NAME(`` entries in the MSL text
and a dispatch runs the numpy reference registered under NAME in
:mod:`accel.sim.kernels`.  Faults come from :mod:`accel.sim.core`:
``inject_oom`` (``newBufferWithLength:options:`` returns nil) and
``inject_error(selector, code)`` for ``newBufferWithLength:options:``,
``newLibraryWithSource:options:error:``, ``commit`` (the command buffer
ends in ``MTLCommandBufferStatusError`` with that code; none of its commands
run, its signals included) and the messages in
:data:`NIL_ON_FAULT` (they answer nil).  Those messages are counted in
``accel.sim.calls()``.

Configuration is :func:`accel.sim.core.config` (``ACCEL_SIM_DEVICES``: Metal
exposes one default device, 0 means none; ``ACCEL_SIM_MEMORY``: the
recommended working set, default 8 GiB; ``ACCEL_SIM_DELAY_US``).

The package, one concern a module: ``rules`` (the validation errors, the documented limits,
fault injection's message sets), ``signatures`` (the methods' declared C types),
``objects`` (the Objective-C object model, NSString, NSError), ``runtime`` (the runtime
state: objects by address, retain counts, zombies, autorelease pools, fork), ``messaging``
(``objc_msgSend`` and libobjc's functions), ``device`` (MTLCreateSystemDefaultDevice and
MTLDevice), ``buffers`` (MTLBuffer and the messages that make it), ``commands`` (command
queues and buffers), ``encoders`` (blit and compute encoders), ``events`` (MTLSharedEvent),
``compiler`` (MSL libraries, functions and pipelines).  This module opens the simulated
libraries and holds the one runtime state.
"""

from __future__ import annotations

import threading
from typing import Optional

from .. import core
from .buffers import MTLBuffer, max_buffer_length
from .commands import (COMMITTED, COMPLETED, ENQUEUED, ERROR, NOT_ENQUEUED, SCHEDULED, MTLCommandBuffer,
                       MTLCommandQueue)
from .compiler import MTLCompileOptions, MTLComputePipelineState, MTLFunction, MTLLibrary
from .device import MTLDevice, SimMetalLibrary, device_count
from .encoders import MTLBlitCommandEncoder, MTLComputeCommandEncoder
from .events import MTLSharedEvent
from .messaging import SimFFI, SimObjCLibrary
from .objects import NSError, NSString, SimClass, SimObject
from .rules import (COUNTED, MAX_THREADGROUP_MEMORY, NIL_ON_FAULT, PAGE, ZOMBIES_KEPT, MetalForkError,
                    MetalValidationError)
from .runtime import _State
from .signatures import DECLARED

__all__ = ["MetalValidationError", "open_library", "open_libraries", "device_count", "state", "reset",
           "DECLARED"]

#: What tests, tools and the mps backend read here besides; the rest is in the modules.
__all__ += ["COMMITTED", "COMPLETED", "COUNTED", "ENQUEUED", "ERROR", "MAX_THREADGROUP_MEMORY", "NIL_ON_FAULT",
            "NOT_ENQUEUED", "PAGE", "SCHEDULED", "ZOMBIES_KEPT", "MetalForkError", "MTLBlitCommandEncoder",
            "MTLBuffer", "MTLCommandBuffer", "MTLCommandQueue", "MTLCompileOptions", "MTLComputeCommandEncoder",
            "MTLComputePipelineState", "MTLDevice", "MTLFunction", "MTLLibrary", "MTLSharedEvent", "NSError",
            "NSString", "SimClass", "SimObject", "SimFFI", "SimObjCLibrary", "SimMetalLibrary", "max_buffer_length"]


# ---------------------------------------------------------------------------
# Module API
# ---------------------------------------------------------------------------
_lock = threading.Lock()
_libraries = None  # ((ffi, objc, path), (ffi, metal, path))
_state: Optional[_State] = None


def open_libraries():
    """``((ffi, objc_lib, path), (ffi, metal_lib, path))`` as ``accel._ffi.open_library`` gives them."""
    global _libraries, _state
    with _lock:
        if _libraries is None:
            from accel._ffi import _objc as objc_decls
            core.config()  # read the environment now, as opening a library does
            rt = _State(objc_decls.ffi)
            objc = SimObjCLibrary(rt)
            ffi = SimFFI(objc_decls.ffi, rt, objc.objc_msgSend)
            _state = rt
            _libraries = ((ffi, objc, "<accel simulated libobjc>"),
                          (ffi, SimMetalLibrary(rt), "<accel simulated Metal.framework>"))
        return _libraries


def open_library():
    """The simulated libobjc (``accel.sim.open_library("objc")``); the mps backend uses
    :func:`open_libraries`, which also gives the FFI whose ``cast`` of ``objc_msgSend``
    the simulator intercepts, and the simulated Metal."""
    return open_libraries()[0][1]


def state() -> _State:
    """The simulator's runtime state (opens the simulated libraries if needed)."""
    open_libraries()
    return _state


def reset() -> None:
    """Forget the simulated runtime; the next open starts fresh (faults and config are core's)."""
    global _libraries, _state
    with _lock:
        if _state is not None:
            _state.close()
        _libraries = None
        _state = None


def _forget_after_fork() -> None:
    # The parent's worker threads and locks do not exist in the child: drop, do not close.
    # Metal does not survive fork (its GPU connection and threads stay in the parent), so every
    # message to a Metal object the child inherited fails with MetalForkError, where a Mac
    # crashes or hangs; the child may open Metal afresh (open_libraries) and use new objects.
    global _libraries, _state, _lock
    _lock = threading.Lock()
    if _state is not None and _state.after_fork():
        return   # Metal was not started in the parent: the child goes on with the same libraries
    _libraries = None
    _state = None


core.on_reset("metal", reset, _forget_after_fork)
def _state_fields() -> dict:
    """accel.sim.state() fields: whether Metal started, the Objective-C objects not yet deallocated
    ({class name: count}; a leak test compares them) and autoreleases made with no pool in place
    (each one leaks on a Mac)."""
    st = _state
    return {"metal_runtime_initialized": bool(st is not None and st.runtime_initialized),
            "metal_live_objects": st.live_counts() if st is not None else {},
            "metal_leaked_autoreleases": st.leaked_autoreleases if st is not None else 0}


core.on_state("metal", _state_fields)
