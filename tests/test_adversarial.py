"""Bad calls across the public API, as a new user makes them, on every simulator.

Each case is ``(id, call, exception type, message substrings)``: the call must raise
that type, its message must contain every substring (case-insensitive; they name the
bad value and the fix), and the process state must be unchanged: memory stats of
every device, RNG states, current device and stream, pinned-host stats and the
simulator's live objects.  Calls that used to crash the interpreter (device bytes
written into ``PyObject*`` slots) run in a subprocess.

``python tests/test_adversarial.py`` prints the outcome counts per simulator (clear /
unclear message / silent acceptance / crash), for comparing the code before a fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import pytest

import accel
from accel import _lazy

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ALL_SIMS = ("cuda", "xpu", "mps")


class Case(NamedTuple):
    id: str
    call: Callable
    exc: type
    words: Sequence[str]
    subprocess: bool = False          # may crash the interpreter on a bad build
    frees_cache: bool = False          # cached memory may change (an OOM path returns it; a new stream's capture caches some)
    only: Optional[Tuple[str, ...]] = None   # simulators the case applies to
    mps: Optional[Tuple[type, Sequence[str]]] = None   # what Metal (no stream capture) raises instead


def _other_backend(c):
    return {"cuda": "xpu", "xpu": "mps", "mps": "cuda"}[c.kind]


# -- the shared context every case runs against --------------------------------------------
def make_context(kind: str, graphs: bool = True):
    c = types.SimpleNamespace(kind=kind)
    c.count = accel.device_count()
    c.s = accel.Stream(0)
    c.buf = accel.Buffer(64, device=0, stream=c.s)
    c.buf.fill_(1)
    c.buf3 = accel.Buffer(3, device=0)
    c.closed_buf = accel.Buffer(64, device=0)
    c.closed_buf.close()
    c.closed_stream = accel.Stream(0)
    c.closed_stream.close()
    c.closed_event = accel.Event()
    c.closed_event.close()
    c.ev = accel.Event()
    c.ev_recorded = accel.Event()
    c.ev_recorded.record(c.s)
    c.ev_timed = accel.Event(enable_timing=True)
    c.ev_timed.record(c.s)
    c.g = accel.Graph()
    c.s1 = accel.Stream(1) if c.count > 1 else None
    c.ev_timed1 = c.s1.record_event(accel.Event(enable_timing=True)) if c.s1 is not None else None
    c.closed_timed = accel.Event(enable_timing=True)
    c.closed_timed.record(c.s)
    c.closed_timed.close()
    c.dev_other = f"{_other_backend(c)}:0"
    c.dev_bad = f"{kind}:{c.count}"
    c.total = accel.get_device_properties(0).total_memory
    c.warm = None
    if graphs and kind != "mps":
        # A capture allocates the graph-safe RNG's seed/offset words of its graph (from the
        # capturing stream's cache, as torch 2.13's per-capture state): one capture first, so
        # the cache of c.s already has the blocks they take.
        c.warm = accel.Graph()
        with c.s:
            c.warm.capture_begin()
            c.warm.capture_end()
    accel.synchronize(0)
    return c


def close_context(c) -> None:
    """Release what make_context made, before the simulator is reset (handles are recycled)."""
    for name in ("buf", "buf3"):
        getattr(c, name).close()
    for name in ("ev", "ev_recorded", "ev_timed", "ev_timed1"):
        if getattr(c, name) is not None:
            getattr(c, name).close()
    if c.g._stream is None:
        c.g.reset()
    accel.synchronize()
    if c.warm is not None:
        c.warm.reset()
    for s in (c.s, c.s1):
        if s is not None:
            s.close()
    c.__dict__.clear()


def _obj(n=8):
    return np.empty(n, dtype=object)


def _with_capture(c, body):
    """Run ``body()`` inside a capture on a side stream, then end the capture."""
    g = accel.Graph()
    with c.s:
        g.capture_begin()
        try:
            body()
        finally:
            try:
                g.capture_end()
            finally:
                g.reset()


def _capture_twice(c):
    with c.s:
        c.g.capture_begin()
        try:
            c.g.capture_begin()
        finally:
            c.g.capture_end()
            c.g.reset()


def _reset_in_capture(c):
    with c.s:
        c.g.capture_begin()
        try:
            c.g.reset()
        finally:
            c.g.capture_end()
            c.g.reset()


def _end_on_other_stream(c):
    other = accel.Stream(0)
    try:
        with c.s:
            c.g.capture_begin()
    except BaseException:      # refused (mps has no capture): the other stream is not left open
        other.close()
        raise
    try:
        with other:
            c.g.capture_end()
    finally:
        with c.s:
            c.g.capture_end()
        c.g.reset()
        other.close()


def _capture_begin_default(c):
    with accel.default_stream(0):
        accel.Graph().capture_begin()


def _capture_sync(c):
    g = accel.Graph()
    try:
        with c.s, g:
            c.s.synchronize()
    finally:
        g.reset()


def _capture_host_copy(c):
    _with_capture(c, lambda: c.buf.copy_from(np.zeros(64, np.uint8), non_blocking=True))


def _graph_ctx_error(c):
    g = accel.Graph()
    try:
        with accel.graph(g, stream=c.s):
            c.buf.fill_(300)
    finally:
        g.reset()


def _stale_copy(c):
    """A device pointer that was freed, copied to host memory through the backend."""
    be = _lazy.lazy_init()
    ptr = be.mem_alloc(1 << 20)
    be.mem_free(ptr)
    out = np.zeros(1 << 20, np.uint8)
    from accel._hostmem import address_of
    be.memcpy_async(address_of(memoryview(out)), ptr, 1 << 20, be.default_stream(0))
    be.stream_synchronize(be.default_stream(0))


def _capture_blocking_copy_to(c):
    _with_capture(c, lambda: c.buf.copy_to(bytearray(64)))


def _capture_blocking_copy_from(c):
    _with_capture(c, lambda: c.buf.copy_from(bytearray(64)))


def _graph_with_error(c):
    g = accel.Graph()
    try:
        with c.s, g:
            c.buf.fill_(300)
    finally:
        g.reset()


def _close_capturing_stream(c):
    side = accel.Stream(0)
    g = accel.Graph()
    try:
        with side:
            g.capture_begin()
            try:
                side.close()
            finally:
                g.capture_end()
    finally:
        g.reset()
        side.close()


CASES: List[Case] = []


def case(id, call, exc, *words, **kw):
    CASES.append(Case(id, call, exc, words, **kw))


NOCAP = (NotImplementedError, ["mps", "stream capture"])

# -- device strings and indices --------------------------------------------------------------
case("device-superscript", lambda c: accel.device("cuda:\u00b2"), ValueError, "cuda:\u00b2", "e.g. 'cuda:0'")
case("device-fullwidth", lambda c: accel.device("cuda:\uff11"), ValueError, "cuda:\uff11", "e.g. 'cuda:0'")
case("device-arabic-indic", lambda c: accel.device("cuda:\u0661"), ValueError, "cuda:\u0661", "e.g. 'cuda:0'")
case("device-unknown-type", lambda c: accel.device("gpu:0"), ValueError, "gpu:0", "expected")
case("device-negative-str", lambda c: accel.device("cuda:-1"), ValueError, "cuda:-1", "non-negative")
case("device-negative-index", lambda c: accel.device("cuda", -1), ValueError, "-1", "negative")
case("device-float-index", lambda c: accel.device("cuda", 1.5), TypeError, "1.5", "int")
case("device-two-indices", lambda c: accel.device("cuda:0", 1), ValueError, "cuda:0", "index=1")
case("device-float-type", lambda c: accel.device(3.5), TypeError, "3.5", "'cuda:0'")   # (device(3): torch 2.13's cuda:3)
case("device-negative-int", lambda c: accel.device(-1), ValueError, "-1", "negative")
case("device-space-index", lambda c: accel.device("cuda: 1"), ValueError, "cuda: 1", "e.g. 'cuda:0'")
case("device-double-colon", lambda c: accel.device("cuda:0:1"), ValueError, "cuda:0:1", "e.g. 'cuda:0'")
case("device-empty", lambda c: accel.device(""), ValueError, "''", "expected")
case("device-none-type", lambda c: accel.device(None), TypeError, "None", "'cuda:0'")
case("device-immutable", lambda c: setattr(accel.device("cuda:0"), "_index", 1), AttributeError, "immutable")
case("set-device-out-of-range", lambda c: accel.set_device_index(c.count), ValueError, "out of range", "valid indices")
case("set-device-huge", lambda c: accel.set_device_index(2**70), ValueError, str(2**70), "valid indices")
case("set-device-float", lambda c: accel.set_device_index(1.5), TypeError, "1.5", "int")
case("set-device-bool", lambda c: accel.set_device_index(True), TypeError, "True", "int")
case("set-device-bad-str", lambda c: accel.set_device_index("cuda:x"), ValueError, "cuda:x", "e.g. 'cuda:0'")
case("set-device-wrong-type-str", lambda c: accel.set_device_index(c.dev_other), ValueError,
     "doesn't match the current accelerator")
case("set-device-str-range", lambda c: accel.set_device_index(c.dev_bad), ValueError, "out of range", "valid")
case("set-device-list", lambda c: accel.set_device_index([0]), TypeError, "[0]", "int")
case("set-device-superscript", lambda c: accel.set_device_index("cuda:\u00b2"), ValueError, "\u00b2", "e.g.")
case("device-index-ctx-range", lambda c: accel.device_index(c.count).__enter__(), ValueError, "out of range",
     "valid")
case("device-index-ctx-float", lambda c: accel.device_index(0.5).__enter__(), TypeError, "0.5", "int")
case("properties-range", lambda c: accel.get_device_properties(c.count), ValueError, "out of range", "valid")
case("properties-float", lambda c: accel.get_device_properties(0.0), TypeError, "0.0", "int")
case("properties-other-type", lambda c: accel.get_device_properties(c.dev_other), ValueError, "doesn't match")
case("capability-range", lambda c: accel.get_device_capability(c.count + 5), ValueError, "out of range", "valid")
case("capability-bad-str", lambda c: accel.get_device_capability("cuda:"), ValueError, "cuda:", "e.g. 'cuda:0'")
case("synchronize-range", lambda c: accel.synchronize(c.count), ValueError, "out of range", "valid")
case("synchronize-float", lambda c: accel.synchronize(2.0), TypeError, "2.0", "int")
case("synchronize-other-type", lambda c: accel.synchronize(c.dev_other), ValueError, "doesn't match")
case("current-stream-range", lambda c: accel.current_stream(c.count), ValueError, "out of index range", "valid")
case("current-stream-float", lambda c: accel.current_stream(0.0), TypeError, "0.0", "int")
case("default-stream-range", lambda c: accel.default_stream(c.count + 1), ValueError, "out of index range", "valid")
case("default-stream-bad-str", lambda c: accel.default_stream("cuda:one"), ValueError, "cuda:one", "e.g.")
case("set-stream-int", lambda c: accel.set_stream(5), TypeError, "int", "accel.Stream")
case("set-stream-none", lambda c: accel.set_stream(None), TypeError, "NoneType", "accel.Stream")
case("set-stream-closed", lambda c: accel.set_stream(c.closed_stream), RuntimeError, "closed", "create a new")
case("set-device-idx-range", lambda c: accel.set_device_idx(c.count), ValueError, "out of range", "valid")

# -- streams -----------------------------------------------------------------------------
case("stream-priority-str", lambda c: accel.Stream(priority="high"), TypeError, "'high'", "int")
case("stream-priority-float", lambda c: accel.Stream(priority=0.5), TypeError, "0.5", "int")
case("stream-priority-none", lambda c: accel.Stream(priority=None), TypeError, "None", "int")
case("stream-device-range", lambda c: accel.Stream(c.count), ValueError, "out of index range", "valid")
case("stream-device-negative", lambda c: accel.Stream(-1), ValueError, "-1", "valid")
case("stream-device-float", lambda c: accel.Stream(1.0), TypeError, "1.0", "int")
case("stream-device-bad-str", lambda c: accel.Stream("cuda:z"), ValueError, "cuda:z", "e.g.")
case("stream-device-other-type", lambda c: accel.Stream(c.dev_other), ValueError, "doesn't match")
case("stream-wait-event-int", lambda c: c.s.wait_event(5), TypeError, "int", "accel.Event")
case("stream-wait-stream-int", lambda c: c.s.wait_stream(5), TypeError, "int", "accel.Stream")
case("stream-wait-stream-none", lambda c: c.s.wait_stream(None), TypeError, "NoneType", "accel.Stream")
case("stream-record-event-int", lambda c: c.s.record_event(3), TypeError, "int", "accel.Event")
case("stream-record-event-str", lambda c: c.s.record_event("e"), TypeError, "str", "accel.Event")
case("closed-stream-sync", lambda c: c.closed_stream.synchronize(), RuntimeError, "closed", "create a new")
case("closed-stream-query", lambda c: c.closed_stream.query(), RuntimeError, "closed", "create a new")
case("closed-stream-record", lambda c: c.closed_stream.record_event(), RuntimeError, "closed", "create a new")
case("closed-stream-wait", lambda c: c.closed_stream.wait_stream(c.s), RuntimeError, "closed", "create a new")
case("closed-stream-waited-on", lambda c: c.s.wait_stream(c.closed_stream), RuntimeError, "closed",
     "create a new")
case("closed-stream-enter", lambda c: c.closed_stream.__enter__(), RuntimeError, "closed", "create a new")
case("closed-stream-handle", lambda c: c.closed_stream.handle, RuntimeError, "closed", "create a new")
case("default-stream-close", lambda c: accel.default_stream(0).close(), RuntimeError, "default stream",
     "cannot be closed")

# -- events ------------------------------------------------------------------------------
case("event-record-int", lambda c: c.ev.record(7), TypeError, "int", "accel.Stream")
case("event-wait-int", lambda c: c.ev.wait(7), TypeError, "int", "accel.Stream")
case("event-wait-closed-stream", lambda c: c.ev_recorded.wait(c.closed_stream), RuntimeError, "closed",
     "create a new")
case("event-record-closed-stream", lambda c: c.ev.record(c.closed_stream), RuntimeError, "closed",
     "create a new")
case("event-elapsed-int", lambda c: c.ev_timed.elapsed_time(1), TypeError, "int", "accel.Event")
case("event-elapsed-no-timing", lambda c: c.ev_recorded.elapsed_time(c.ev_recorded), ValueError,
     "enable_timing=True")
case("event-elapsed-unrecorded", lambda c: accel.Event(enable_timing=True).elapsed_time(c.ev_timed),
     ValueError, "recorded before")
case("event-elapsed-closed-end", lambda c: c.ev_timed.elapsed_time(c.closed_timed), RuntimeError, "closed",
     "create a new")
case("closed-event-record", lambda c: c.closed_event.record(c.s), RuntimeError, "closed", "create a new")
case("closed-event-wait", lambda c: c.closed_event.wait(c.s), RuntimeError, "closed", "create a new")
case("closed-event-query", lambda c: c.closed_event.query(), RuntimeError, "closed", "create a new")
case("closed-event-sync", lambda c: c.closed_event.synchronize(), RuntimeError, "closed", "create a new")
case("closed-event-elapsed", lambda c: c.closed_event.elapsed_time(c.ev_timed), RuntimeError, "closed",
     "create a new")
case("event-record-other-device", lambda c: c.ev_recorded.record(c.s1), ValueError, "device 0", "device 1",
     only=("cuda", "xpu"))
case("event-elapsed-two-devices",
     lambda c: c.ev_timed.elapsed_time(c.ev_timed1), ValueError,
     "device 0", "device 1", only=("cuda", "xpu"))

# -- buffers: construction ----------------------------------------------------------------
case("buffer-negative", lambda c: accel.Buffer(-1), ValueError, "-1", ">= 0")
case("buffer-float", lambda c: accel.Buffer(1.5), TypeError, "float", "int")
case("buffer-str", lambda c: accel.Buffer("64"), TypeError, "str", "int")
case("buffer-bool", lambda c: accel.Buffer(True), TypeError, "bool", "int")
case("buffer-none", lambda c: accel.Buffer(None), TypeError, "NoneType", "int")
case("buffer-numpy-float", lambda c: accel.Buffer(np.float64(8)), TypeError, "float64", "int")
case("buffer-device-range", lambda c: accel.Buffer(8, device=c.count), ValueError, "out of index range", "valid")
case("buffer-device-float", lambda c: accel.Buffer(8, device=0.0), TypeError, "0.0", "int")
case("buffer-device-bad-str", lambda c: accel.Buffer(8, device="cuda:\uff10"), ValueError, "\uff10", "e.g.")
case("buffer-device-other-type", lambda c: accel.Buffer(8, device=c.dev_other), ValueError, "doesn't match")
case("buffer-stream-int", lambda c: accel.Buffer(8, stream=5), TypeError, "int", "accel.Stream")
case("buffer-stream-closed", lambda c: accel.Buffer(8, stream=c.closed_stream), RuntimeError, "closed",
     "create a new")
case("buffer-stream-device-mismatch", lambda c: accel.Buffer(8, device=1, stream=c.s), ValueError,
     "device 0", "device 1", only=("cuda", "xpu"))
OOM = ("out of memory", "Tried to allocate", "total capacity")
# torch (CUDACachingAllocator.cpp allocate): a request of 2**60 bytes or more says only this,
# refused before the cache is touched (no memory freed)
OOM_1EB = ("out of memory", "Tried to allocate more than 1EB memory.")
case("buffer-2-64", lambda c: accel.Buffer(2**64), accel.OutOfMemoryError, *OOM_1EB)
case("buffer-above-capacity", lambda c: accel.Buffer(c.total + 1), accel.OutOfMemoryError, *OOM,
     frees_cache=True)
case("buffer-2-70", lambda c: accel.Buffer(2**70), accel.OutOfMemoryError, *OOM_1EB)
case("buffer-2-63", lambda c: accel.Buffer(2**63 - 1), accel.OutOfMemoryError, *OOM_1EB)

# -- buffers: copies -----------------------------------------------------------------------
case("copy-from-int", lambda c: c.buf.copy_from(5), TypeError, "int", "numpy array")
case("copy-from-str", lambda c: c.buf.copy_from("a" * 64), TypeError, "str", "bytes-like")
case("copy-from-list", lambda c: c.buf.copy_from([0] * 64), TypeError, "list", "numpy array")
case("copy-from-dict", lambda c: c.buf.copy_from({}), TypeError, "dict", "numpy array")
case("copy-from-none", lambda c: c.buf.copy_from(None), TypeError, "NoneType", "numpy array")
case("copy-from-short", lambda c: c.buf.copy_from(b"x" * 63), ValueError, "63", "64")
case("copy-from-long", lambda c: c.buf.copy_from(np.zeros(65, np.uint8)), ValueError, "65", "64")
case("copy-from-empty", lambda c: c.buf.copy_from(b""), ValueError, "0 bytes", "64")
case("copy-from-noncontig", lambda c: c.buf.copy_from(np.zeros(128, np.uint8)[::2]), ValueError,
     "C-contiguous", "ascontiguousarray")
case("copy-from-fortran", lambda c: c.buf.copy_from(np.zeros((8, 2), np.float32, order="F")), ValueError,
     "C-contiguous", "ascontiguousarray")
case("copy-from-object", lambda c: c.buf.copy_from(_obj()), TypeError, "object", "plain", subprocess=True)
case("copy-from-object-nb", lambda c: c.buf.copy_from(_obj(), non_blocking=True), TypeError, "object",
     "plain", subprocess=True)
case("copy-from-struct-object",
     lambda c: c.buf.copy_from(np.zeros(4, dtype=[("a", "i8"), ("b", object)])), TypeError, "object", "plain",
     subprocess=True)
case("copy-from-closed-src", lambda c: c.buf.copy_from(c.closed_buf), RuntimeError, "closed", "allocate a new")
case("copy-from-buffer-size", lambda c: c.buf.copy_from(c.buf3), ValueError, "3 bytes", "64")
case("copy-from-stream-int", lambda c: c.buf.copy_from(b"x" * 64, stream=1), TypeError, "int", "accel.Stream")
case("copy-from-stream-closed", lambda c: c.buf.copy_from(b"x" * 64, stream=c.closed_stream), RuntimeError,
     "closed", "create a new")
case("copy-from-stream-device", lambda c: c.buf.copy_from(b"x" * 64, stream=c.s1), ValueError, "device 1",
     "device 0", only=("cuda", "xpu"))
case("copy-from-nb-str", lambda c: c.buf.copy_from(0, non_blocking=True), TypeError, "int", "numpy array")
case("copy-from-nb-short", lambda c: c.buf.copy_from(b"x", non_blocking=True), ValueError, "1 bytes", "64")
case("closed-copy-from", lambda c: c.closed_buf.copy_from(b"x" * 64), RuntimeError, "closed",
     "allocate a new")
case("copy-to-object", lambda c: c.buf.copy_to(_obj()), TypeError, "object", "plain", subprocess=True)
case("copy-to-object-2d", lambda c: c.buf.copy_to(np.empty((2, 4), dtype=object)), TypeError, "object",
     "plain", subprocess=True)
case("copy-to-struct-object",
     lambda c: c.buf.copy_to(np.zeros(4, dtype=[("a", "i8"), ("b", object)])), TypeError, "object", "plain",
     subprocess=True)
case("copy-to-bytes", lambda c: c.buf.copy_to(b"x" * 64), ValueError, "read-only", "nothing was copied")
case("copy-to-readonly-array", lambda c: c.buf.copy_to(np.frombuffer(b"x" * 64, np.uint8)), ValueError,
     "read-only", "nothing was copied")
case("copy-to-noncontig", lambda c: c.buf.copy_to(np.zeros(128, np.uint8)[::2]), ValueError, "C-contiguous",
     "nothing was copied")
case("copy-to-short", lambda c: c.buf.copy_to(bytearray(10)), ValueError, "10 bytes", "64")
case("copy-to-int", lambda c: c.buf.copy_to(5), TypeError, "int", "writable numpy array")
case("copy-to-list", lambda c: c.buf.copy_to([0] * 64), TypeError, "list", "writable numpy array")
case("copy-to-none", lambda c: c.buf.copy_to(None), TypeError, "NoneType", "writable numpy array")
case("copy-to-stream-int", lambda c: c.buf.copy_to(bytearray(64), stream=2), TypeError, "int", "accel.Stream")
case("copy-to-stream-device", lambda c: c.buf.copy_to(bytearray(64), stream=c.s1), ValueError, "device 1",
     "device 0", only=("cuda", "xpu"))
case("closed-copy-to", lambda c: c.closed_buf.copy_to(bytearray(64)), RuntimeError, "closed", "allocate a new")
case("to-numpy-object", lambda c: c.buf.to_numpy(object), TypeError, "object", "plain", subprocess=True)
case("to-numpy-object-str", lambda c: c.buf.to_numpy("O"), TypeError, "object", "plain", subprocess=True)
case("to-numpy-bad-dtype", lambda c: c.buf.to_numpy("nonsense"), TypeError, "nonsense", "dtype")
case("to-numpy-not-whole", lambda c: c.buf3.to_numpy(np.float32), ValueError, "3 bytes", "float32")
case("to-numpy-bad-shape", lambda c: c.buf.to_numpy(np.uint8, shape=(3, 5)), ValueError, "(3, 5)", "64")
case("to-numpy-closed", lambda c: c.closed_buf.to_numpy(), RuntimeError, "closed", "allocate a new")
case("to-numpy-stream-int", lambda c: c.buf.to_numpy(stream=4), TypeError, "int", "accel.Stream")
case("fill-256", lambda c: c.buf.fill_(256), ValueError, "256", "0..255")
case("fill-negative", lambda c: c.buf.fill_(-1), ValueError, "-1", "0..255")
case("fill-float", lambda c: c.buf.fill_(1.5), ValueError, "1.5", "0..255")
case("fill-str", lambda c: c.buf.fill_("a"), ValueError, "'a'", "0..255")
case("fill-bool", lambda c: c.buf.fill_(True), ValueError, "True", "0..255")
case("fill-none", lambda c: c.buf.fill_(None), ValueError, "None", "0..255")
case("fill-closed", lambda c: c.closed_buf.fill_(0), RuntimeError, "closed", "allocate a new")
case("fill-stream-int", lambda c: c.buf.fill_(0, stream=9), TypeError, "int", "accel.Stream")
case("fill-stream-closed", lambda c: c.buf.fill_(0, stream=c.closed_stream), RuntimeError, "closed",
     "create a new")
case("fill-stream-device", lambda c: c.buf.fill_(0, stream=c.s1), ValueError, "device 1", "device 0",
     only=("cuda", "xpu"))
case("record-stream-int", lambda c: c.buf.record_stream(3), TypeError, "int", "accel.Stream")
case("record-stream-closed-buffer", lambda c: c.closed_buf.record_stream(c.s), RuntimeError, "closed",
     "allocate a new")
case("record-stream-closed-stream", lambda c: c.buf.record_stream(c.closed_stream), RuntimeError, "closed",
     "create a new")
case("ptr-closed", lambda c: c.closed_buf.ptr, RuntimeError, "closed", "allocate a new")

# -- graphs ----------------------------------------------------------------------------------
case("graph-bad-mode", lambda c: accel.Graph(capture_error_mode="strict"), ValueError, "strict", "`relaxed`")
case("graph-mode-int", lambda c: accel.Graph(capture_error_mode=1), ValueError, "1", "`relaxed`")
case("graph-end-without-begin", lambda c: c.g.capture_end(), RuntimeError, "capture_end", "capture_begin")
case("graph-replay-empty", lambda c: c.g.replay(), RuntimeError, "no capture", "capture one first")
case("graph-instantiate-empty", lambda c: c.g.instantiate(), RuntimeError, "instantiate", "capture one first")
case("graph-pool-before-begin", lambda c: c.g.pool(), RuntimeError, "pool()", "capture_begin")
def _dump_without_debug(c):
    # torch only warns here (CUDAGraph::debug_dump), as accel does since r71c: the warning, as an error
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.g.debug_dump("/tmp/x.dot")


case("graph-dump-no-debug", _dump_without_debug, UserWarning, "debug not enabled", "enable_debug_mode")
case("graph-begin-default-stream", _capture_begin_default, RuntimeError, "non-default stream", "accel.Stream()",
     mps=NOCAP)
case("graph-begin-twice", _capture_twice, RuntimeError, "capture_begin called twice", "already capturing",
     mps=NOCAP)
case("graph-reset-in-capture", _reset_in_capture, RuntimeError, "reset() during capture", "capture_end()",
     mps=NOCAP)
case("graph-end-other-stream", _end_on_other_stream, RuntimeError, "same stream", mps=NOCAP)
case("graph-pool-str", lambda c: (setattr(c.g, "graph_pool", "p"), _with_capture_pool(c)), TypeError, "'p'",
     "generate_graph_pool_handle", mps=NOCAP)
case("graph-pool-triple", lambda c: (setattr(c.g, "graph_pool", (1, 2, 3)), _with_capture_pool(c)),
     TypeError, "(1, 2, 3)", "generate_graph_pool_handle", mps=NOCAP)
case("graph-fn-int", lambda c: accel.graph(5).__enter__(), TypeError, "int", "accel.Graph")
case("graph-fn-mode", lambda c: accel.graph(accel.Graph(), capture_error_mode="x").__enter__(), ValueError,
     "got x", "`relaxed`")
case("graph-sync-in-capture", _capture_sync, accel.CaptureError, "synchronize", "captur", mps=NOCAP, subprocess=True)
case("graph-host-copy-in-capture", _capture_host_copy, RuntimeError,
     "Cannot copy between CPU and", "during", "graph capture", mps=NOCAP, subprocess=True)
case("graph-host-copy-to-in-capture", _capture_blocking_copy_to, RuntimeError,
     "Cannot copy between CPU and", "during", "graph capture", mps=NOCAP, subprocess=True)
case("graph-host-copy-from-in-capture", _capture_blocking_copy_from, RuntimeError,
     "Cannot copy between CPU and", "during", "graph capture", mps=NOCAP, subprocess=True)
case("graph-with-original-error", lambda c: _graph_with_error(c), ValueError, "300", "0..255", mps=NOCAP,
     subprocess=True)
case("backend-memcpy-freed-pointer", _stale_copy, ValueError, "neither pointer", "not been freed",
     subprocess=True)
case("graph-ctx-original-error", _graph_ctx_error, ValueError, "300", "0..255", mps=NOCAP, subprocess=True)
# (the capture allocates its own RNG holders on the new stream, which keeps that segment cached:
# torch 2.13's per-capture generator state)
case("graph-close-capturing-stream", _close_capturing_stream, RuntimeError, "capture", "underway", "capture_end",
     mps=NOCAP, subprocess=True, frees_cache=True)


def _with_capture_pool(c):
    with c.s:
        c.g.capture_begin()


# -- memory ------------------------------------------------------------------------------------
M = lambda: accel.memory  # noqa: E731
case("stats-range", lambda c: M().memory_stats(c.count), ValueError, "out of range", "valid")
case("stats-float", lambda c: M().memory_stats(0.0), TypeError, "0.0", "int")
case("stats-bad-str", lambda c: M().memory_stats("cuda:x"), ValueError, "cuda:x", "e.g.")
case("stats-other-type", lambda c: M().memory_stats(c.dev_other), ValueError, "doesn't match")
case("allocated-range", lambda c: M().memory_allocated(c.count), ValueError, "out of range", "valid")
case("max-allocated-range", lambda c: M().max_memory_allocated(c.count), ValueError, "out of range", "valid")
case("reserved-range", lambda c: M().memory_reserved(c.count), ValueError, "out of range", "valid")
case("max-reserved-range", lambda c: M().max_memory_reserved(c.count), ValueError, "out of range", "valid")
case("reset-peak-range", lambda c: M().reset_peak_memory_stats(c.count), ValueError, "out of range", "valid")
case("reset-accum-range", lambda c: M().reset_accumulated_memory_stats(c.count), ValueError, "out of range",
     "valid")
case("memory-info-range", lambda c: M().get_memory_info(c.count), ValueError, "out of range", "valid")
case("memory-info-negative", lambda c: M().get_memory_info(-1), ValueError, "-1", "valid")
case("summary-range", lambda c: M().memory_summary(c.count), ValueError, "out of range", "valid")
case("summary-float", lambda c: M().memory_summary(0.5), TypeError, "0.5", "int")
case("history-negative", lambda c: M().record_history(max_entries=-1), ValueError, "-1", "max_entries")
case("history-str", lambda c: M().record_history(max_entries="10"), TypeError, "'10'", "max_entries")
case("history-float", lambda c: M().record_history(max_entries=2.5), TypeError, "2.5", "max_entries")
case("device-allocator-str", lambda c: M().device_allocator("0"), TypeError, "'0'", "int")
case("device-allocator-range", lambda c: M().device_allocator(c.count), ValueError, "out of range", "valid")
case("dump-snapshot-bad-dir", lambda c: M().dump_snapshot("/nonexistent-dir/x.json"), FileNotFoundError,
     "/nonexistent-dir/x.json")

# -- random --------------------------------------------------------------------------------------
R = lambda: accel.random  # noqa: E731
case("seed-str", lambda c: R().manual_seed("42"), TypeError, "'42'", "int")
case("seed-float", lambda c: R().manual_seed(1.5), TypeError, "1.5", "int")
case("seed-too-big", lambda c: R().manual_seed(2**64), ValueError, str(2**64), "2**64")
case("seed-too-small", lambda c: R().manual_seed(-2**63 - 1), ValueError, str(-2**63 - 1), "-2**63")
case("seed-none", lambda c: R().manual_seed(None), TypeError, "None", "int")
case("seed-all-str", lambda c: R().manual_seed_all("1"), TypeError, "'1'", "int")
case("initial-seed-range", lambda c: R().initial_seed(c.count), ValueError, "out of range", "valid")
case("get-state-range", lambda c: R().get_rng_state(c.count), ValueError, "out of range", "valid")
case("get-state-float", lambda c: R().get_rng_state(0.0), TypeError, "0.0", "int")
case("set-state-short", lambda c: R().set_rng_state(np.zeros(3, np.uint8)), RuntimeError, "got 3", "16 bytes")
case("set-state-offset", lambda c: R().set_rng_state(np.array([0] * 8 + [1] + [0] * 7, np.uint8)), RuntimeError,
     "got 1", "multiple of 4")
case("set-state-str", lambda c: R().set_rng_state("state"), TypeError, "str", "get_rng_state")
case("set-state-range", lambda c: R().set_rng_state(R().get_rng_state(0), c.count), ValueError, "out of range",
     "valid")
case("set-state-all-too-many", lambda c: R().set_rng_state_all([R().get_rng_state(0)] * (c.count + 1)),
     ValueError, "states", "device")
case("set-state-all-bad-item", lambda c: R().set_rng_state_all([np.zeros(5, np.uint8)]), RuntimeError, "got 5",
     "16 bytes")
case("set-state-all-int", lambda c: R().set_rng_state_all(5), TypeError, "int 5", "get_rng_state_all")
case("uniform-not-buffer", lambda c: R().uniform_(np.zeros(4, np.float32)), TypeError, "ndarray", "accel.Buffer")
case("uniform-closed", lambda c: R().uniform_(c.closed_buf), RuntimeError, "closed", "allocate a new")
case("uniform-dtype", lambda c: R().uniform_(c.buf, dtype="int8"), TypeError, "int8", "float32")
case("uniform-not-whole", lambda c: R().uniform_(c.buf3), ValueError, "3", "float32")
case("uniform-bounds", lambda c: R().uniform_(c.buf, low=1.0, high=0.0), ValueError, "1.0", "0.0")
case("uniform-low-str", lambda c: R().uniform_(c.buf, low="a"), TypeError, "'a'", "low")
case("uniform-generator-int", lambda c: R().uniform_(c.buf, generator=3), TypeError, "int", "Generator")
# (a generator of another device draws outside a capture, as torch's: r69b; test_lead_fixes_s29)
case("normal-std-negative", lambda c: R().normal_(c.buf, std=-1.0), ValueError, "-1.0", "std")
case("normal-dtype", lambda c: R().normal_(c.buf, dtype="float16"), TypeError, "float16", "float32")
case("normal-mean-str", lambda c: R().normal_(c.buf, mean="m"), TypeError, "'m'", "mean")
case("randint-empty-range", lambda c: R().randint_(c.buf, 5, 5), ValueError, "low=5", "less than 'high'")
case("randint-dtype", lambda c: R().randint_(c.buf, 0, 10, dtype="float32"), TypeError, "float32", "int64")
case("randint-too-wide", lambda c: R().randint_(c.buf, 0, 2**70), ValueError, str(2**70), "int64")
case("randint-str", lambda c: R().randint_(c.buf, "a", 5), TypeError, "'a'", "int")
case("random-raw-not-whole", lambda c: R().random_raw_(c.buf3), ValueError, "3", "4")


# -- positive friendliness checks (item 7): __index__ integers are sizes and indices --------------
def test_numpy_integers_are_accepted_everywhere(sim_backend):
    n, one, zero = np.int64(16), np.int32(1), np.uint8(0)
    buf = accel.Buffer(n, device=zero)
    assert buf.nbytes == 16 and type(buf.nbytes) is int
    buf.fill_(np.uint8(3))
    assert (buf.to_numpy(np.uint8, shape=(np.int64(4), np.int64(4))) == 3).all()
    accel.set_device_index(zero)
    assert accel.current_device_index() == 0
    with accel.device_index(zero):
        pass
    assert accel.get_device_properties(zero).total_memory > 0
    accel.synchronize(zero)
    s = accel.Stream(zero, priority=np.int64(0))
    assert accel.current_stream(zero) is not None and s.device_index == 0
    assert accel.memory.memory_stats(zero)["allocated_bytes.all.current"] >= 16
    accel.memory.memory_allocated(zero)
    accel.memory.record_history(max_entries=np.int64(10))
    accel.memory.record_history(False)
    accel.random.manual_seed(np.int64(3))
    assert accel.random.initial_seed(zero) == 3
    accel.random.randint_(buf, np.int64(0), np.int64(10))
    assert accel.memory.device_allocator(zero) is accel.memory.device_allocator(0)
    assert accel.random.Generator(np.int64(0)).device_index == 0
    if accel.device_count() > 1:
        assert accel.Buffer(np.int64(8), device=one).device_index == 1
    if sim_backend != "mps":
        pool = accel.graphs.generate_graph_pool_handle()
        g = accel.Graph(pool=(np.int64(pool[0]), np.int64(pool[1])))
        with s, g:
            buf.fill_(1, s)
        g.reset()
    buf.close()
    s.close()


def test_device_strings_take_ascii_digits_only():
    for text in ("cuda:\u00b2", "cuda:\uff11", "cuda:\u0661", "cuda:\u2460"):
        with pytest.raises(ValueError, match="e.g. 'cuda:0'"):
            accel.device(text)
    assert accel.device("cuda:12").index == 12


# -- the harness -----------------------------------------------------------------------------------
def snapshot(c) -> dict:
    """Everything a bad call must leave as it was."""
    from accel import sim
    keys = ("allocated_bytes.all.current", "active_bytes.all.current", "requested_bytes.all.current",
            "allocation.all.current", "segment.all.current", "reserved_bytes.all.current")
    stats = [accel.memory.memory_stats(i) for i in range(c.count)]
    mem = {i: {k: stats[i].get(k, 0) for k in keys} for i in range(c.count)}
    host = {k: v for k, v in accel.memory.host_allocator().stats().items()
            if k.endswith(".current") or "current" in k}
    st = vars(sim.state())
    live = {k: v for k, v in st.items()
            if k not in ("calls", "config", "peak_bytes", "jit_compiles", "modules", "runtime_initialized",
                         "nvml_init_calls", "nvml_initialized", "ze_device_used", "ze_sysman_initialized")}
    if "metal_live_objects" in live:   # Metal's compiled kernels are a lazy cache, as "modules" are
        live["metal_live_objects"] = {k: v for k, v in live["metal_live_objects"].items()
                                      if k not in ("MTLLibrary", "MTLFunction", "MTLComputePipelineState")}
    rng = [bytes(np.asarray(x)) for x in accel.random.get_rng_state_all()]
    return {"device": accel.current_device_index(), "stream": accel.current_stream(0),
            "memory": mem, "host": host, "sim": live, "rng": rng}


def _state_diff(before: dict, after: dict, frees_cache: bool) -> List[str]:
    diffs = []
    for key in before:
        a, b = before[key], after[key]
        if key == "memory" and frees_cache:
            a = {i: {k: v for k, v in d.items() if not k.startswith(("reserved", "segment"))} for i, d in a.items()}
            b = {i: {k: v for k, v in d.items() if not k.startswith(("reserved", "segment"))} for i, d in b.items()}
        if key == "sim" and frees_cache:
            a = {k: v for k, v in a.items() if not any(w in k for w in ("alloc", "bytes", "reservations"))}
            b = {k: v for k, v in b.items() if not any(w in k for w in ("alloc", "bytes", "reservations"))}
        if a != b:
            if isinstance(a, dict) and isinstance(b, dict):
                diffs.extend(f"{key}.{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b), key=str)
                             if a.get(k) != b.get(k))
            else:
                diffs.append(f"{key}: {a!r} -> {b!r}")
    return diffs


def expected(case_: Case, kind: str) -> Tuple[type, Sequence[str]]:
    if kind == "mps" and case_.mps is not None:
        return case_.mps
    return case_.exc, case_.words


def run_case(case_: Case, kind: str) -> Tuple[str, str]:
    """Run one case in this process (simulator ``kind`` already selected): (outcome, detail)."""
    c = make_context(kind, graphs=case_.id.startswith("graph-"))
    try:
        return _run_case(case_, kind, c)
    finally:
        close_context(c)


def _run_case(case_: Case, kind: str, c) -> Tuple[str, str]:
    before = snapshot(c)
    exc_type, words = expected(case_, kind)
    try:
        case_.call(c)
    except Exception as exc:    # noqa: BLE001 - classifying is the point
        raised = exc
    else:
        raised = None
    try:
        accel.synchronize()
        after = snapshot(c)
    except Exception as exc:    # noqa: BLE001
        return "crash", f"process left unusable (wedged) after {raised!r}: {exc!r}"
    if raised is None:
        return "silent", "no exception"
    message = str(raised)
    missing = [w for w in words if w.lower() not in message.lower()]
    diffs = _state_diff(before, after, case_.frees_cache)
    if not isinstance(raised, exc_type) or missing or diffs:
        return "unclear", (f"{type(raised).__name__}: {message!r}; wanted {exc_type.__name__} with {missing}"
                           + (f"; state changed: {diffs}" if diffs else ""))
    return "clear", message


def applies(case_: Case, kind: str) -> bool:
    return case_.only is None or kind in case_.only


_batches: dict = {}


def run_isolated(case_id: str, kind: str) -> Tuple[str, str]:
    """Outcome of a crash-prone case, from one child process per simulator running them all;
    a case the child did not report (it crashed there) is rerun alone in its own child."""
    if kind not in _batches:
        ids = [x.id for x in CASES if x.subprocess and applies(x, kind)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "CUDA_VISIBLE", "ZE_"))}
        env["ACCEL_SIM"] = kind
        code = (f"import sys, json; sys.path.insert(0, {HERE!r}); import test_adversarial as t\n"
                f"for i in {ids!r}:\n"
                f"    print(json.dumps([i, *t.run_one(i, {kind!r})]), flush=True)\n")
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        import json
        _batches[kind] = {row[0]: (row[1], row[2]) for row in
                          (json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("["))}
    if case_id in _batches[kind]:
        return _batches[kind][case_id]
    return run_in_subprocess(case_id, kind)


def run_in_subprocess(case_id: str, kind: str) -> Tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "CUDA_VISIBLE", "ZE_"))}
    env["ACCEL_SIM"] = kind
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import test_adversarial as t; "
            f"o, d = t.run_one({case_id!r}, {kind!r}); print('OUTCOME', o); print('DETAIL', d)")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    lines = proc.stdout.splitlines()
    outcome = next((ln.split(" ", 1)[1] for ln in lines if ln.startswith("OUTCOME ")), None)
    if proc.returncode != 0 or outcome is None:
        return "crash", f"exit {proc.returncode}: {proc.stderr[-500:]}"
    return outcome, next((ln.split(" ", 1)[1] for ln in lines if ln.startswith("DETAIL ")), "")


def run_one(case_id: str, kind: str) -> Tuple[str, str]:
    os.environ["ACCEL_SIM"] = kind
    _lazy._reset_for_tests()
    try:
        return run_case(next(x for x in CASES if x.id == case_id), kind)
    finally:
        _lazy._reset_for_tests()


def test_enough_distinct_cases():
    ids = [x.id for x in CASES]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    assert len(ids) >= 150, len(ids)


@pytest.mark.parametrize("case_", CASES, ids=[x.id for x in CASES])
def test_bad_call(case_, sim_backend):
    if not applies(case_, sim_backend):
        pytest.skip(f"needs two devices of one backend; {sim_backend} simulates one")
    if case_.subprocess:
        outcome, detail = run_isolated(case_.id, sim_backend)
    else:
        outcome, detail = run_case(case_, sim_backend)
    assert outcome == "clear", detail


def main() -> None:
    counts = {}
    for kind in ALL_SIMS:
        tally = {"clear": 0, "unclear": 0, "silent": 0, "crash": 0}
        for case_ in CASES:
            if not applies(case_, kind):
                continue
            if case_.subprocess:
                outcome, detail = run_in_subprocess(case_.id, kind)
            else:
                outcome, detail = run_one(case_.id, kind)
            tally[outcome] += 1
            if outcome != "clear" and "-v" in sys.argv:
                print(f"  {kind} {case_.id}: {outcome}: {detail[:300]}")
        counts[kind] = tally
        print(kind, tally, flush=True)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()


# -- wedges: after one misuse the process must be fully usable --------------------------------------
def _usable(kind: str) -> None:
    """Synchronize, empty the caches, seed, copy through pinned memory, capture and replay."""
    accel.synchronize()
    accel.memory.empty_cache()
    accel.memory.empty_host_cache()
    accel.random.manual_seed(5)
    buf = accel.Buffer(256)
    buf.copy_from(np.full(256, 4, np.uint8), non_blocking=True)
    assert (buf.to_numpy() == 4).all()
    if kind != "mps":
        s, g = accel.Stream(), accel.Graph()
        with s, g:
            buf.fill_(6)
        g.replay()
        assert (buf.to_numpy() == 6).all()
        g.reset()
        s.close()
    buf.close()
    accel.memory.empty_host_cache()
    assert accel.memory.memory_allocated() == 0


def test_close_of_a_capturing_stream_is_refused_and_nothing_wedges(sim_graph_backend):
    s, g = accel.Stream(), accel.Graph()
    buf = accel.Buffer(64)
    with pytest.raises(RuntimeError, match="capture on it is underway"):
        with s, g:
            buf.fill_(1)
            s.close()
    assert not s.closed
    g.reset()
    s.close()
    buf.close()
    _usable(sim_graph_backend)


def test_host_copy_in_capture_is_refused_before_anything_is_taken(sim_graph_backend):
    s, g = accel.Stream(), accel.Graph()
    buf = accel.Buffer(64)
    pinned_before = accel.memory.host_allocator().stats()
    name = sim_graph_backend.upper()
    with pytest.raises(RuntimeError, match=f"Cannot copy between CPU and {name} tensors during {name} graph"):
        with s, g:
            buf.copy_from(np.zeros(64, np.uint8), non_blocking=True)
    assert accel.memory.host_allocator().stats() == pinned_before
    g.reset()
    s.close()
    buf.close()
    _usable(sim_graph_backend)


def test_failed_op_in_graph_block_raises_itself(sim_graph_backend):
    s = accel.Stream()
    for form in ("graph()", "with s, g"):
        g = accel.Graph()
        with pytest.raises(accel.CaptureError) as info:
            if form == "graph()":
                with accel.graph(g, stream=s):
                    accel.current_stream().synchronize()
            else:
                with s, g:
                    s.synchronize()
        # the synchronize's own error, not the one capture_end reports for the invalidated capture
        message = str(info.value)
        assert "synchroniz" in message.lower(), message
        assert "EndCapture" not in message and "invalidated by an illegal operation" not in message, message
        g.reset()
    s.close()
    _usable(sim_graph_backend)


def test_record_history_rejects_bad_max_entries_and_allocation_still_works(sim_backend):
    for bad in (-1, 0, "10", 2.5):
        with pytest.raises((ValueError, TypeError), match="max_entries"):
            accel.memory.record_history(max_entries=bad)
    _usable(sim_backend)
    accel.memory.record_history(False)
