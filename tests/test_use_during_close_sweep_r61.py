"""Sweep (r61e): every public call that passes a runtime handle, against every way another thread
destroys that handle while the call is in flight.

On an H100 a kernel launched after its library was unloaded killed the process (SIGSEGV); in CUDA
any destroyed handle (stream, event, graph exec, library, kernel, VMM handle, pool) passed to the
runtime is undefined, and a recycled handle value names another object.  accel's rule: a method
checks that its object is open, and a close()/reset()/free from another thread never destroys a
handle while a call that passes it is in flight: the close waits for the call (a lock), or the
destroy is deferred to the call's end (accel/streams.py: _Use, _Hold; Buffer pins).

The technique (tests/test_use_during_close_r61.py): the backend method that makes the runtime
call (or the allocator method that hands the memory on) is patched so that, just before the real
call, it runs the destroyer in another thread and joins it for 0.5 s (the destroyer may rightly
wait for the call), then makes the real call.  So the destroyer always comes after the call's own
"is it open?" check.  On the simulators a destroyed handle is refused (cudaErrorInvalidResourceHandle
400 on CUDA, ValueError on XPU, _InvalidHandle on MPS), so a missing guard fails the call.  Each
case also requires

* the call to complete normally, on the handle it began with;
* the destroyer to complete (after the call when it waits) without error;
* the destroy itself (the backend's destroy call, or the allocator's free of the memory) to be
  logged after the call returned (``_Race.log``);
* nothing to leak: the simulator's live counts and the allocated bytes are back where they were.

Cases run on the CUDA simulator on device 0 and on device 1 (not current), and where the backend
has the method on the XPU and MPS simulators too (MPS has one device and no graphs).  A case that
fails today is a bug, kept here as a strict xfail with the failure text.
"""

import gc
import threading

import numpy as np
import pytest

import accel
from accel import _lazy, sim

from conftest import THOROUGH, use_sim
from test_use_during_close_r61 import _in_other_thread

#: The destroyer's head start (joined for this long before the real call).  A destroyer that
#: rightly waits for the call costs all of it; one that does not (the bug) closes in milliseconds,
#: so by default 0.1 s is ample; THOROUGH keeps 0.2 s.
HEAD_START_S = 0.2 if THOROUGH else 0.1

# hundreds of short tests that collect: see conftest.frozen_module_heap
pytestmark = pytest.mark.usefixtures("frozen_module_heap")

# -- the harness ------------------------------------------------------------------------------------


#: The simulators' live counts of runtime objects (accel.sim.state()).
_COUNTED = ("streams", "events", "graphs", "graph_execs", "captures", "modules", "host_allocations",
            "ze_live_events", "ze_live_event_pools", "ze_live_command_lists", "ze_live_command_queues",
            "ze_live_modules", "ze_live_kernels")


def _settle():
    """Every device idle, garbage gone, caches emptied: what is left is live."""
    for d in range(accel.device_count()):
        accel.synchronize(d)
    gc.collect()
    accel.memory.empty_cache()
    accel.memory.empty_host_cache()


def _warm_up(devices=None, kernels=True):
    """Make what the runtime and the allocators keep once made (XPU's event pool, the allocators'
    cached events), so that a baseline taken after it counts only the case's objects.  The
    sweeps' largest tests (a fresh simulator per case) warm only the device the case uses and
    skip the random kernels when the case neither captures nor draws: what a case then makes
    that the warm-up did not is counted as a leak, so a too-small warm-up fails, never hides."""
    from accel.random import _device as random_kernels
    for d in (range(accel.device_count()) if devices is None or THOROUGH else devices):
        if kernels or THOROUGH:
            random_kernels.kernel_functions(_lazy.lazy_init(), d)     # loaded once, kept (a capture loads them)
        with accel.device_index(d):
            s = accel.Stream(d)
            b = accel.Buffer(64, stream=s)
            b.fill_(0, stream=s)
            b.record_stream(accel.current_stream(d))
            e = s.record_event()
            t = accel.Event(enable_timing=True)
            t.record(s)
            e.synchronize()
            t.synchronize()
            for obj in (b, e, t, s):
                obj.close()


def _live():
    """The live counts of runtime objects and the bytes allocated on each device."""
    st = vars(sim.state())
    out = {k: st[k] for k in _COUNTED if k in st}
    for k, v in (st.get("metal_live_objects") or {}).items():
        out["metal " + k] = v
    for d in range(accel.device_count()):
        out[f"allocated {d}"] = accel.memory.memory_allocated(d)
    return out


class _Race:
    """One case's instruments.

    ``before(target, "method", destroyer)``: the first call of ``target.method`` on the test's
    thread (for which ``when(*args)`` is true) first runs ``destroyer`` in another thread, then
    makes the real call, and logs ``"<method> returned"`` after it.  ``spy(target, "method",
    label)``: logs ``label`` at each call of ``target.method`` (for which ``match(*args)`` is true),
    from any thread: the destroys.  ``done()`` joins the destroyer and returns its outcome."""

    def __init__(self, monkeypatch):
        self.mp = monkeypatch
        self.log = []
        self.others = []
        self.fired = False
        self.me = threading.get_ident()
        self.baseline = None

    def settle_baseline(self, devices=None, kernels=True):
        _warm_up(devices, kernels)
        _settle()
        self.baseline = _live()

    def before(self, target, method, destroyer, when=None):
        real = getattr(target, method)
        race = self

        def hooked(*args, **kwargs):
            if race.fired or threading.get_ident() != race.me or (when is not None and not when(*args, **kwargs)):
                return real(*args, **kwargs)
            race.fired = True
            race.others.append(_in_other_thread(destroyer, HEAD_START_S))
            try:
                return real(*args, **kwargs)
            finally:
                race.log.append(f"{method} returned")
        self.mp.setattr(target, method, hooked)

    def spy(self, target, method, label, match=None):
        real = getattr(target, method)
        log = self.log

        def spied(*args, **kwargs):
            if match is None or match(*args, **kwargs):
                log.append(label)
            return real(*args, **kwargs)
        self.mp.setattr(target, method, spied)

    def done(self):
        """The destroyer's outcome, ``[("ok", value)]`` or ``[("raised", exc)]``, once it ended."""
        assert self.fired, "the hooked call was never made: the case does not reach the runtime call it targets"
        (t, out), = self.others
        t.join(10)
        assert not t.is_alive(), "the destroyer is still waiting 10 s after the call returned"
        return out

    def check(self, returned: str, destroyed: str):
        """The destroyer completed without error, and ``destroyed`` was logged after ``returned``."""
        out = self.done()
        assert [kind for kind, _ in out] == ["ok"], f"the destroyer raised: {out}"
        assert returned in self.log, f"{returned!r} not logged: {self.log}"
        assert destroyed in self.log, f"the destroy {destroyed!r} never happened: {self.log}"
        assert self.log.index(returned) < self.log.index(destroyed), \
            f"destroyed while the call was in flight: {self.log}"

    def no_leaks(self):
        self.mp.undo()      # the hooks and spies go first: the settle below runs unpatched
        _settle()
        assert _live() == self.baseline


@pytest.fixture
def race(monkeypatch):
    return _Race(monkeypatch)


@pytest.fixture(params=[0, 1])
def device(request, sim_backend):
    """Device 0, and device 1 (not current) where the simulator has two (MPS has one)."""
    if request.param >= accel.device_count():
        pytest.skip(f"{sim_backend} simulates {accel.device_count()} device(s)")
    return request.param


def _backend():
    return _lazy.lazy_init()


def _handle_is(h):
    """``match``/``when`` for a call whose first argument is the handle ``h``."""
    return lambda *args, **kwargs: args and args[0] == h


# -- accel.Stream ---------------------------------------------------------------------------------

def _stream(device):
    s = accel.Stream(device)
    with accel.device_index(device):
        accel.Buffer(64, stream=s).fill_(1, stream=s)      # some work queued on it
    return s


#: How another thread destroys a Stream or an Event: close() (then a synchronize, whose drain of
#: deferred releases must not run a destroy a call in flight put off, or an empty_cache), or the
#: test drops its last reference and collects (the call in flight still holds the object: its
#: __del__ runs when the call let go of it).
_DESTROYERS = {
    "close": lambda refs: refs[0].close(),
    "close+synchronize": lambda refs: (refs[0].close(), accel.synchronize(refs[1])),
    "close+empty_cache": lambda refs: (refs[0].close(), accel.memory.empty_cache()),
    "drop+collect": lambda refs: (refs.clear(), gc.collect()),
}


@pytest.mark.parametrize("destroyer", list(_DESTROYERS))
@pytest.mark.parametrize("method", ["synchronize", "query", "is_capturing"])
def test_stream_call_vs_close(race, device, method, destroyer):
    """Stream.synchronize / query / is_capturing while another thread closes the stream (or drops
    the last reference the test has): the destroy (stream_destroy) comes after the runtime call."""
    backend = _backend()
    race.settle_baseline(devices=(device,), kernels=False)
    refs = [_stream(device), device]
    h = refs[0].handle
    name = {"synchronize": "stream_synchronize", "query": "stream_query",
            "is_capturing": "stream_is_capturing"}[method]
    if method == "is_capturing" and not backend.supports_graphs:
        pytest.skip(f"{backend.name} has no capture: is_capturing() makes no runtime call")
    race.before(backend, name, lambda: _DESTROYERS[destroyer](refs), when=_handle_is(h))
    race.spy(backend, "stream_destroy", "destroyed", match=_handle_is(h))
    call = getattr(refs[0], method)
    call()
    del call            # the call's last reference (drop+collect: the stream goes now)
    gc.collect()
    race.check(f"{name} returned", "destroyed")
    race.no_leaks()


def test_stream_record_event_vs_stream_close(race, device):
    """Stream.record_event() while another thread closes the stream: the record (event_record on
    the stream's handle) completes, the stream is destroyed after it."""
    backend = _backend()
    race.settle_baseline()
    s = _stream(device)
    h = s.handle
    race.before(backend, "event_record", s.close, when=lambda ev, st, **kw: st == h)
    race.spy(backend, "stream_destroy", "destroyed", match=_handle_is(h))
    e = s.record_event()
    race.check("event_record returned", "destroyed")
    e.synchronize()
    e.close()
    race.no_leaks()


def test_stream_wait_stream_vs_close_of_the_stream_waited_for(race, device):
    """Stream.wait_stream(other) records an event on ``other``; another thread closes ``other``
    just then: the record completes on its handle, ``other`` is destroyed after it."""
    backend = _backend()
    race.settle_baseline()
    s, other = _stream(device), _stream(device)
    h = other.handle
    race.before(backend, "event_record", other.close, when=lambda ev, st, **kw: st == h)
    race.spy(backend, "stream_destroy", "destroyed", match=_handle_is(h))
    s.wait_stream(other)
    race.check("event_record returned", "destroyed")
    s.synchronize()
    s.close()
    race.no_leaks()


@pytest.mark.parametrize("closed", ["waiting stream", "event"])
def test_stream_wait_event_vs_close(race, device, closed):
    """Stream.wait_event(e) (Event.wait(stream)) while another thread closes the waiting stream, or
    the event: the wait (stream_wait_event) completes, the destroy comes after it."""
    backend = _backend()
    race.settle_baseline()
    s, other = _stream(device), _stream(device)
    e = other.record_event()
    hs, he = s.handle, e.handle
    victim, destroy, h = (s, "stream_destroy", hs) if closed == "waiting stream" else (e, "event_destroy", he)
    race.before(backend, "stream_wait_event", victim.close, when=lambda st, ev, **kw: st == hs and ev == he)
    race.spy(backend, destroy, "destroyed", match=_handle_is(h))
    s.wait_event(e)
    race.check("stream_wait_event returned", "destroyed")
    for obj in (s, other, e):
        obj.close()
    race.no_leaks()


# -- accel.Event ----------------------------------------------------------------------------------

def _event(device, stream, **flags):
    e = accel.Event(**flags)
    e.record(stream)
    return e


@pytest.mark.parametrize("destroyer", list(_DESTROYERS))
@pytest.mark.parametrize("method, call", [
    ("query", "event_query"),
    ("synchronize", "event_synchronize"),
    ("record", "event_record"),             # a record again: the event's handle exists
])
def test_event_call_vs_close(race, device, method, call, destroyer):
    """Event.query / synchronize / record (again) while another thread closes the event (or drops
    the test's last reference to it): the runtime call completes, event_destroy comes after it."""
    backend = _backend()
    race.settle_baseline(devices=(device,), kernels=False)
    s = _stream(device)
    refs = [_event(device, s), device]
    h = refs[0].handle
    race.before(backend, call, lambda: _DESTROYERS[destroyer](refs), when=_handle_is(h))
    race.spy(backend, "event_destroy", "destroyed", match=_handle_is(h))
    bound = getattr(refs[0], method)
    bound(*((s,) if method == "record" else ()))
    del bound
    gc.collect()
    race.check(f"{call} returned", "destroyed")
    s.close()
    race.no_leaks()


def test_event_first_record_vs_close(race, device):
    """The first Event.record() makes the device event (event_create); another thread closes the
    event just then: the record completes on the event it made, which is destroyed after it."""
    backend = _backend()
    race.settle_baseline()
    s = _stream(device)
    e = accel.Event()
    race.before(backend, "event_create", e.close)
    race.spy(backend, "event_destroy", "destroyed")
    e.record(s)
    race.check("event_create returned", "destroyed")
    s.close()
    race.no_leaks()


@pytest.mark.parametrize("closed", ["start", "end"])
def test_event_elapsed_time_vs_close(race, device, closed):
    """Event.elapsed_time(end) while another thread closes the start or the end event: the
    runtime's elapsed-time call completes on both handles, the destroy comes after it."""
    backend = _backend()
    race.settle_baseline()
    s = _stream(device)
    start = _event(device, s, enable_timing=True)
    accel.Buffer(64, device=device, stream=s).fill_(3, stream=s)
    end = _event(device, s, enable_timing=True)
    victim = start if closed == "start" else end
    h = victim.handle
    race.before(backend, "event_elapsed_ms", victim.close)
    race.spy(backend, "event_destroy", "destroyed", match=_handle_is(h))
    assert start.elapsed_time(end) >= 0
    race.check("event_elapsed_ms returned", "destroyed")
    for obj in (start, end, s):
        obj.close()
    race.no_leaks()


# -- accel.Buffer ---------------------------------------------------------------------------------
# A Buffer's "handle" is its memory: the destroy is the allocator's free of its block (spied on the
# device allocator), after which the next allocation may be handed the same bytes (or, with
# expandable segments, empty_cache unmaps them).  Each call is made on a created stream ``s``.

N = 256


def _dst_is(buf):
    return lambda dst, *a, **k: dst == buf._ptr


def _src_is(buf):
    return lambda dst, src, *a, **k: src == buf._ptr


def _pinned(n=N):
    return accel.empty_pinned(n, "uint8")


#: name -> (call(buf, stream, other) -> None, runtime call, when(buf) -> predicate on its arguments).
#: ``other`` is a second Buffer of the same device and size (a copy's source).
_BUFFER_CALLS = {
    "fill_": (lambda b, s, o: b.fill_(5, stream=s), "memset_async", _dst_is),
    "copy_from(numpy)": (lambda b, s, o: b.copy_from(np.full(N, 5, np.uint8), stream=s), "memcpy_async", _dst_is),
    "copy_from(numpy, non_blocking)": (lambda b, s, o: b.copy_from(np.full(N, 5, np.uint8), stream=s,
                                                                   non_blocking=True), "memcpy_async", _dst_is),
    "copy_from(pinned, non_blocking)": (lambda b, s, o: b.copy_from(_pinned(), stream=s, non_blocking=True),
                                        "memcpy_async", _dst_is),
    "copy_from(Buffer)": (lambda b, s, o: b.copy_from(o, stream=s), "memcpy_async", _dst_is),
    "Buffer copy_from(self)": (lambda b, s, o: o.copy_from(b, stream=s), "memcpy_async", _src_is),
    "copy_to(numpy)": (lambda b, s, o: b.copy_to(np.empty(N, np.uint8), stream=s), "memcpy_async", _src_is),
    "copy_to(pinned, non_blocking)": (lambda b, s, o: b.copy_to(_pinned(), stream=s, non_blocking=True),
                                      "memcpy_async", _src_is),
    "to_numpy": (lambda b, s, o: b.to_numpy(stream=s), "memcpy_async", _src_is),
    "to_numpy(non_blocking)": (lambda b, s, o: b.to_numpy(stream=s, non_blocking=True)[1].synchronize(),
                               "memcpy_async", _src_is),
    "as_array.copy_from(numpy)": (lambda b, s, o: b.as_array("float32").copy_from(np.ones(N // 4, np.float32),
                                                                                  stream=s),
                                  "memcpy_async", _dst_is),
    "as_array.copy_from(view)": (lambda b, s, o: b.as_array("float32").copy_from(o.as_array("float32"), stream=s),
                                 "memcpy_async", _dst_is),
    "as_array.to_numpy": (lambda b, s, o: b.as_array("float32").to_numpy(stream=s), "memcpy_async", _src_is),
    "as_array strided to_numpy": (lambda b, s, o: b.as_array("float32", shape=(N // 8,), strides=(8,)).to_numpy(
        stream=s), "memcpy_async", _src_is),
    # the view's checks ask the runtime whether a capture is underway before the view reads its
    # address (ArrayView.ptr): the close lands between the two
    "as_array.to_numpy (closed before the address is read)": (
        lambda b, s, o: b.as_array("float32").to_numpy(stream=s), "captures_underway", lambda b: None),
    "as_array.copy_from(numpy) (closed before the address is read)": (
        lambda b, s, o: b.as_array("float32").copy_from(np.ones(N // 4, np.float32), stream=s),
        "captures_underway", lambda b: None),
}


#: Cases that fail today: (call, "buffer" | "stream") -> the bug.
_BUFFER_XFAIL = {
}


def _buffer_params(victim):
    return [pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=_BUFFER_XFAIL[m, victim]))
            if (m, victim) in _BUFFER_XFAIL else m for m in _BUFFER_CALLS]


#: How another thread destroys the buffer's memory.
_BUFFER_DESTROYERS = {
    "close": lambda b: b.close(),
    "close+empty_cache": lambda b: (b.close(), accel.memory.empty_cache()),
    "close+synchronize": lambda b: (b.close(), accel.synchronize(b.device_index)),
}


def _spy_free(race, alloc, ptr):
    race.spy(alloc, "free", "freed", match=lambda p, *a, **k: p == ptr)
    if hasattr(alloc, "free_nowait"):
        race.spy(alloc, "free_nowait", "freed", match=lambda p, *a, **k: p == ptr)


@pytest.mark.parametrize("destroyer", list(_BUFFER_DESTROYERS))
@pytest.mark.parametrize("method", _buffer_params("buffer"))
def test_buffer_call_vs_buffer_destroyed(race, device, method, destroyer):
    """A Buffer call that hands the memory to the runtime while another thread closes the buffer
    (then empties the cache, or synchronizes the device): the copy or fill completes on the
    memory it began with, which the allocator frees only after it."""
    backend = _backend()
    call, runtime, when = _BUFFER_CALLS[method]
    race.settle_baseline(devices=(device,), kernels=False)
    s = _stream(device)
    with accel.device_index(device):
        buf, other = accel.Buffer(N, stream=s), accel.Buffer(N, stream=s)
    buf.fill_(1, stream=s)
    other.fill_(2, stream=s)
    s.synchronize()
    _spy_free(race, accel.memory.device_allocator(device), buf._ptr)
    race.before(backend, runtime, lambda: _BUFFER_DESTROYERS[destroyer](buf), when=when(buf))
    call(buf, s, other)
    race.check(f"{runtime} returned", "freed")
    assert buf._closed
    other.close()
    s.close()
    race.no_leaks()


@pytest.mark.parametrize("method", _buffer_params("stream"))
def test_buffer_call_vs_stream_close(race, device, method):
    """The same calls while another thread closes the stream they queue on: the destroy
    (stream_destroy) comes after the runtime call, and the call completes."""
    backend = _backend()
    call, runtime, when = _BUFFER_CALLS[method]
    race.settle_baseline(devices=(device,), kernels=False)
    s = _stream(device)
    h = s.handle
    with accel.device_index(device):
        buf, other = accel.Buffer(N, stream=s), accel.Buffer(N, stream=s)
    race.before(backend, runtime, s.close, when=when(buf))
    race.spy(backend, "stream_destroy", "destroyed", match=_handle_is(h))
    call(buf, s, other)
    race.check(f"{runtime} returned", "destroyed")
    buf.close()
    other.close()
    race.no_leaks()


@pytest.mark.parametrize("closed", ["buffer", "stream"])
def test_buffer_record_stream_vs_close(race, device, closed):
    """Buffer.record_stream(s2) hands the block and s2's handle to the allocator; another thread
    closes the buffer, or s2, just then: the use is recorded, and the free (which then waits for
    s2's work) or s2's destroy comes after it."""
    race.settle_baseline()
    s, s2 = _stream(device), _stream(device)
    with accel.device_index(device):
        buf = accel.Buffer(N, stream=s)
    alloc = accel.memory.device_allocator(device)
    if closed == "buffer":
        _spy_free(race, alloc, buf._ptr)
        victim, label = buf, "freed"
    else:
        race.spy(_backend(), "stream_destroy", "destroyed", match=_handle_is(s2.handle))
        victim, label = s2, "destroyed"
    race.before(alloc, "record_stream", victim.close)
    buf.record_stream(s2)
    race.check("record_stream returned", label)
    for obj in (buf, s, s2):
        obj.close()
    race.no_leaks()


def test_buffer_allocation_vs_stream_close(race, device):
    """Buffer(n, stream=s) allocates for s (the allocator keys the block by s's handle); another
    thread closes s just then: the allocation completes, s is destroyed after it."""
    race.settle_baseline()
    s = _stream(device)
    alloc = accel.memory.device_allocator(device)
    race.before(alloc, "malloc", s.close)
    race.spy(_backend(), "stream_destroy", "destroyed", match=_handle_is(s.handle))
    buf = accel.Buffer(N, device=device, stream=s)
    race.check("malloc returned", "destroyed")
    buf.fill_(1)
    buf.close()
    race.no_leaks()


def test_buffer_copy_from_other_device_vs_source_close(race, sim_backend):
    """copy_from a Buffer of the other device (a peer copy queued on the destination's device)
    while another thread closes the source: the copy completes, the source's block is freed after."""
    if accel.device_count() < 2:
        pytest.skip(f"{sim_backend} simulates one device")
    race.settle_baseline()
    with accel.device_index(1):
        dst = accel.Buffer(N)
    src = accel.Buffer(N, device=0)
    src.fill_(9)
    _spy_free(race, accel.memory.device_allocator(0), src._ptr)
    race.before(_backend(), "memcpy_async", src.close, when=_src_is(src))
    dst.copy_from(src)
    race.check("memcpy_async returned", "freed")
    assert bytes(dst.to_numpy()) == b"\x09" * N
    dst.close()
    race.no_leaks()


#: The DLPack export's stream handshake (sync_for_consumer): an event recorded on the buffer's
#: last-use stream, then the consumer's stream waits for it.


@pytest.mark.parametrize("closed", [
    "last-use stream",
    "consumer stream",
    "buffer",
    "buffer of a view",
])
def test_buffer_dlpack_export_vs_close(race, device, closed):
    """Buffer.__dlpack__(stream=consumer) while another thread closes the buffer's last-use
    stream (as the event is recorded on it), the consumer's stream (as it is made to wait), or the
    buffer itself (as the event is recorded): the handshake completes on the handles it began
    with, the export is made, and each destroy comes after its call (the buffer's memory after
    the capsule is released)."""
    from accel import _dlpack
    backend = _backend()
    race.settle_baseline()
    s, consumer = _stream(device), _stream(device)
    with accel.device_index(device):
        buf = accel.Buffer(N, stream=s)
    buf.fill_(4, stream=s)
    hs, hc = s.handle, consumer.handle
    if closed == "last-use stream":
        race.before(backend, "event_record", s.close, when=lambda ev, st, **kw: st == hs)
        race.spy(backend, "stream_destroy", "destroyed", match=_handle_is(hs))
        returned, label = "event_record returned", "destroyed"
    elif closed == "consumer stream":
        race.before(backend, "stream_wait_event", consumer.close, when=_handle_is(hc))
        race.spy(backend, "stream_destroy", "destroyed", match=_handle_is(hc))
        returned, label = "stream_wait_event returned", "destroyed"
    else:
        race.before(backend, "event_record", buf.close, when=lambda ev, st, **kw: st == hs)
        _spy_free(race, accel.memory.device_allocator(device), buf._ptr)
        race.spy(_dlpack.Imported, "release", "capsule released")
        returned, label = "event_record returned", "freed"
    exporter = buf.as_array("float32") if closed == "buffer of a view" else buf
    capsule = exporter.__dlpack__(stream=consumer, max_version=(1, 0))
    imported = accel.from_dlpack(capsule)
    assert imported.nbytes == N
    imported.close()
    race.check(returned, label)
    if closed != "last-use stream" and closed != "consumer stream":
        assert race.log.index("capsule released") < race.log.index("freed"), race.log
    for obj in (buf, s, consumer):
        obj.close()
    race.no_leaks()


def test_dlpack_export_of_a_buffer_its_caller_pinned(sim_backend):
    """accel._dlpack.export(..., held=True) (r61e): a caller that pinned the buffer before its open
    check exports it even when it was closed since (the close left the memory to the pins); the
    memory then goes with the capsule's deleter.  Without ``held`` a closed buffer is refused."""
    from accel import _dlpack
    from accel.buffer import _begin_use, _end_use
    buf = accel.Buffer(N)
    buf.fill_(6)
    ptr = buf._ptr
    allocated = accel.memory.memory_allocated()
    key = _begin_use(buf)               # as Buffer's _in_use, before the open check
    buf._live()
    buf.close()                         # (another thread's, after the check): left to the pin
    kind, index = buf.__dlpack_device__()
    with pytest.raises(RuntimeError, match="closed while it was being exported"):
        _dlpack.export(buf, ptr, kind, index, "uint8", (N,), None, 0, versioned=True)
    capsule = _dlpack.export(buf, ptr, kind, index, "uint8", (N,), None, 0, versioned=True, held=True)
    _end_use(buf, key)                  # the call ends: the capsule's pin keeps the memory
    assert accel.memory.memory_allocated() == allocated
    imported = accel.from_dlpack(capsule)
    assert imported.ptr == ptr and bytes(imported.to_numpy()) == b"\x06" * N
    imported.close()                    # the deleter: the buffer's memory goes now
    assert accel.memory.memory_allocated() < allocated


# -- the allocator configurations: memory handed back to the runtime --------------------------------
# With expandable segments empty_cache unmaps the free pages of a segment (cuMemUnmap, then the
# physical handle's cuMemRelease); without them it frees whole free segments (cudaFree); under
# backend:cudaMallocAsync a free is cudaFreeAsync and empty_cache trims the driver's pool.  A
# buffer in a call must be none of those until the call ends.

_CONFIGS = [("cuda", "expandable_segments:True"), ("cuda", "expandable_segments:False"),
            ("cuda", "backend:cudaMallocAsync"), ("xpu", "expandable_segments:True"),
            ("xpu", "expandable_segments:False")]


@pytest.fixture(params=_CONFIGS, ids=[f"{k}-{c}" for k, c in _CONFIGS])
def configured(request, monkeypatch):
    kind, conf = request.param
    use_sim(monkeypatch, kind, ACCEL_ALLOC_CONF=conf)
    return conf


def _spy_release_to_runtime(race, backend, ptr, nbytes):
    """Log "unmapped" when the runtime is handed back memory overlapping [ptr, ptr + nbytes)."""
    segments = [(s["address"], s["total_size"]) for s in accel.memory.memory_snapshot()
                if s["address"] <= ptr < s["address"] + s["total_size"]]

    def overlaps(va, size):
        return va < ptr + nbytes and ptr < va + size
    race.spy(backend, "vmm_unmap", "unmapped", match=lambda va, size, *a, **k: overlaps(va, size))
    race.spy(backend, "mem_free", "unmapped", match=lambda p, *a, **k: any(p == base for base, _ in segments))
    race.spy(backend, "mem_free_async", "unmapped", match=lambda p, *a, **k: p == ptr)


@pytest.mark.parametrize("nbytes", [N, 4 << 20], ids=["small", "large"])
@pytest.mark.parametrize("method", ["fill_", "copy_to(numpy)", "copy_from(Buffer)"])
@pytest.mark.parametrize("dev", [0, 1])
def test_buffer_call_vs_close_and_empty_cache_per_allocator(race, configured, dev, method, nbytes):
    """A fill or copy in flight while another thread closes the buffer and empties the cache, under
    each allocator configuration: the memory is neither reused nor handed back to the runtime
    (unmapped, cudaFree'd, cudaFreeAsync'd) before the call returned; afterwards it is."""
    backend = _backend()
    race.settle_baseline(devices=(dev,), kernels=False)
    s = _stream(dev)
    with accel.device_index(dev):
        buf, other = accel.Buffer(nbytes, stream=s), accel.Buffer(nbytes, stream=s)
    other.fill_(8, stream=s)
    s.synchronize()
    call = {"fill_": lambda: buf.fill_(5, stream=s),
            "copy_to(numpy)": lambda: buf.copy_to(np.empty(nbytes, np.uint8), stream=s),
            "copy_from(Buffer)": lambda: buf.copy_from(other, stream=s)}[method]
    runtime, when = ("memset_async", _dst_is(buf)) if method == "fill_" else \
        ("memcpy_async", _src_is(buf) if method == "copy_to(numpy)" else _dst_is(buf))
    _spy_free(race, accel.memory.device_allocator(dev), buf._ptr)
    _spy_release_to_runtime(race, backend, buf._ptr, nbytes)
    race.before(backend, runtime, lambda: (buf.close(), accel.memory.empty_cache()), when=when)
    call()
    race.check(f"{runtime} returned", "freed")
    assert "unmapped" not in race.log[:race.log.index(f"{runtime} returned")], race.log
    other.close()
    s.close()
    race.no_leaks()


def test_buffer_of_a_mempool_vs_pool_release(race, device):
    """A buffer allocated in an accel.MemPool has a fill in flight while another thread closes it,
    drops the pool (its release: the pool's free segments go back to the runtime) and empties
    the cache: the block is freed after the fill, and the segment is handed back only then."""
    backend = _backend()
    race.settle_baseline()
    s = _stream(device)
    with accel.device_index(device):
        pools = [accel.MemPool()]
        with accel.memory.use_mem_pool(pools[0]):
            buf = accel.Buffer(N, stream=s)
    assert accel.memory.memory_snapshot(pools[0].id)

    def destroy():
        buf.close()
        pools.clear()
        gc.collect()
        accel.memory.empty_cache()
    _spy_free(race, accel.memory.device_allocator(device), buf._ptr)
    _spy_release_to_runtime(race, backend, buf._ptr, N)
    race.before(backend, "memset_async", destroy, when=_dst_is(buf))
    buf.fill_(3, stream=s)
    race.check("memset_async returned", "freed")
    assert "unmapped" not in race.log[:race.log.index("memset_async returned")], race.log
    s.close()
    race.no_leaks()


# -- DLPack imports ---------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["fill_", "to_numpy", "copy_from(numpy)"])
def test_imported_buffer_call_vs_close(race, device, method):
    """A Buffer imported with accel.from_dlpack (here of another accel Buffer, already closed by its
    owner so that the capsule alone keeps its memory) has a call in flight while another thread
    closes it: the capsule's deleter (which hands the memory back to the producer, who frees it)
    runs after the call."""
    from accel import _dlpack
    backend = _backend()
    race.settle_baseline()
    s = _stream(device)
    with accel.device_index(device):
        producer = accel.Buffer(N, stream=s)
    producer.fill_(2, stream=s)
    ptr = producer._ptr
    imported = accel.from_dlpack(producer.__dlpack__(stream=s, max_version=(1, 0)))
    producer.close()                    # the capsule's pin keeps the memory
    call, runtime, when = {
        "fill_": (lambda: imported.fill_(7, stream=s), "memset_async", _dst_is(imported)),
        "to_numpy": (lambda: imported.to_numpy(stream=s), "memcpy_async", _src_is(imported)),
        "copy_from(numpy)": (lambda: imported.copy_from(np.zeros(N, np.uint8), stream=s), "memcpy_async",
                             _dst_is(imported)),
    }[method]
    race.spy(_dlpack.Imported, "release", "deleter ran")
    _spy_free(race, accel.memory.device_allocator(device), ptr)
    race.before(backend, runtime, imported.close, when=when)
    call()
    race.check(f"{runtime} returned", "deleter ran")
    assert race.log.index("deleter ran") < race.log.index("freed"), race.log
    s.close()
    race.no_leaks()


def test_from_dlpack_vs_close_of_the_consumer_stream(race, device):
    """accel.from_dlpack(obj) passes accel's current stream of the producer's device to
    obj.__dlpack__ (the producer makes it wait for its work); another thread closes that stream
    as the producer queues the wait: the wait completes on its handle, the destroy comes after."""
    backend = _backend()
    if backend.name != "cuda":
        pytest.skip(f"on {backend.name} from_dlpack passes the producer no stream (it waits on the host)")
    race.settle_baseline()
    s, current = _stream(device), _stream(device)
    with accel.device_index(device):
        producer = accel.Buffer(N, stream=s)
    producer.fill_(2, stream=s)
    hc = current.handle
    race.before(backend, "stream_wait_event", current.close, when=_handle_is(hc))
    race.spy(backend, "stream_destroy", "destroyed", match=_handle_is(hc))
    with accel.device_index(device), current:
        imported = accel.from_dlpack(producer)
    race.check("stream_wait_event returned", "destroyed")
    assert bytes(imported.to_numpy()) == b"\x02" * N
    for obj in (imported, producer, s):
        obj.close()
    race.no_leaks()


# -- pinned host memory -----------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["copy_from(pinned)", "copy_to(pinned)", "copy_from(numpy) via staging"])
def test_pinned_copy_vs_empty_host_cache(race, device, method):
    """A non_blocking copy between a Buffer and pinned host memory (an accel.empty_pinned array, or
    the staging block of a pageable source) while another thread empties the pinned cache: the
    block is not unpinned (host_free) under the copy; once the array is dropped and the copy ran,
    empty_host_cache unpins it."""
    backend = _backend()
    race.settle_baseline()
    s = _stream(device)
    with accel.device_index(device):
        buf = accel.Buffer(N, stream=s)
    host = accel.memory.host_allocator()
    arr = _pinned() if method != "copy_from(numpy) via staging" else np.full(N, 5, np.uint8)
    call, when = {
        "copy_from(pinned)": (lambda: buf.copy_from(arr, stream=s, non_blocking=True), _dst_is(buf)),
        "copy_to(pinned)": (lambda: buf.copy_to(arr, stream=s, non_blocking=True), _src_is(buf)),
        "copy_from(numpy) via staging": (lambda: buf.copy_from(arr, stream=s, non_blocking=True), _dst_is(buf)),
    }[method]
    blocks = []

    def note_block(dst, src, nbytes, stream, **kw):
        address = src if method != "copy_to(pinned)" else dst
        blocks.append(host.owns(address, nbytes))
        return True
    race.before(backend, "memcpy_async", accel.memory.empty_host_cache,
                when=lambda *a, **k: when(*a, **k) and note_block(*a, **k))
    race.spy(backend, "host_free", "unpinned", match=lambda p, *a, **k: p in blocks)
    call()
    assert blocks and blocks[0] is not None, "the copy's host memory is not a pinned block"
    del arr
    gc.collect()
    s.synchronize()
    accel.memory.empty_host_cache()
    race.check("memcpy_async returned", "unpinned")
    buf.close()
    s.close()
    race.no_leaks()


# -- accel.Module / accel.Kernel --------------------------------------------------------------------

@pytest.fixture
def saxpy():
    from test_user_kernels import saxpy_reference
    sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64")
    yield
    sim.unregister_kernel("saxpy")


def _module(device):
    from test_user_kernels import SAXPY_MSL, SAXPY_PTX, spirv_module
    image = {"cuda": SAXPY_PTX, "mps": SAXPY_MSL, "xpu": None}[_backend().name] or spirv_module("saxpy")
    return accel.Module(image, device=device)


def _kernel(m):
    return m.function("saxpy", "f32, ptr, ptr, u64")


def _saxpy_args(device, s):
    x = np.arange(64, dtype=np.float32)
    with accel.device_index(device):
        bx, by = accel.Buffer(256, stream=s), accel.Buffer(256, stream=s)
    bx.copy_from(x, stream=s)
    by.copy_from(np.ones(64, np.float32), stream=s)
    return x, bx, by


@pytest.mark.parametrize("closed", ["module", "stream", "buffer argument", "typed view argument"])
def test_launch_vs_close(race, saxpy, device, closed):
    """accel.launch(kernel, ...) while another thread closes the kernel's module (the unload waits
    for the launch: a launch of an unloaded library's kernel killed the process on an H100), the
    stream it queues on, or a Buffer it passes: the launch completes, the destroy comes after."""
    from test_user_kernels import expected
    backend = _backend()
    race.settle_baseline()
    s = _stream(device)
    m = _module(device)
    k = _kernel(m)
    x, bx, by = _saxpy_args(device, s)
    if closed == "module":
        race.spy(backend, "module_unload", "destroyed")
        victim = m
    elif closed == "stream":
        race.spy(backend, "stream_destroy", "destroyed", match=_handle_is(s.handle))
        victim = s
    else:
        _spy_free(race, accel.memory.device_allocator(device), by._ptr)
        race.before(backend, "launch", by.close)
        victim = None
        y = by.as_array("float32") if closed == "typed view argument" else by
        accel.launch(k, 1, 64, 2.0, bx, y, 64, stream=s)
        race.check("launch returned", "freed")
    if victim is not None:
        race.before(backend, "launch", victim.close)
        accel.launch(k, 1, 64, 2.0, bx, by, 64, stream=s)
        race.check("launch returned", "destroyed")
        accel.synchronize(device)
        assert by.to_numpy("float32", stream=accel.current_stream(device)).tobytes() == \
            expected(2.0, x, np.ones(64, np.float32)).tobytes()
    for obj in (m, bx, by, s):
        obj.close()
    race.no_leaks()


def test_launch_with_shared_memory_opt_in_vs_module_close(race, saxpy, device):
    """A launch above 48 KiB of dynamic shared memory first opts the kernel in
    (function_set_max_dynamic_shared on its handle); another thread closes the module just then:
    the opt-in and the launch complete, the unload comes after."""
    from accel.kernels._launch import _device_limits
    backend = _backend()
    lim = _device_limits(backend, device)
    if lim["max_shared_per_block_optin"] <= lim["max_shared_per_block"]:
        pytest.skip(f"{backend.name} has no shared memory opt-in")
    race.settle_baseline()
    s = _stream(device)
    m = _module(device)
    k = _kernel(m)
    _, bx, by = _saxpy_args(device, s)
    race.before(backend, "function_set_max_dynamic_shared", m.close)
    race.spy(backend, "module_unload", "destroyed")
    accel.launch(k, 1, 64, 2.0, bx, by, 64, shared_mem=lim["max_shared_per_block"] + 1024, stream=s)
    race.check("function_set_max_dynamic_shared returned", "destroyed")
    for obj in (bx, by, s):
        obj.close()
    race.no_leaks()


_KERNEL_QUERIES = {
    "Module.function": (lambda m, k: _kernel(m), "module_function"),
    "Kernel.max_threads_per_block": (lambda m, k: k.max_threads_per_block, "function_attributes"),
    "Kernel.num_regs": (lambda m, k: k.num_regs, "function_attributes"),
    "Kernel.shared_size_bytes": (lambda m, k: k.shared_size_bytes, "function_attributes"),
    "Kernel.max_potential_block_size": (lambda m, k: k.max_potential_block_size(), "occupancy_max_active_blocks"),
}


@pytest.mark.parametrize("query", list(_KERNEL_QUERIES))
def test_kernel_query_vs_module_close(race, saxpy, device, query):
    """Module.function and the Kernel's attribute and occupancy queries pass the library's or the
    kernel's handle to the runtime; another thread closes the module just then: the query
    completes, the unload comes after it."""
    backend = _backend()
    call, runtime = _KERNEL_QUERIES[query]
    race.settle_baseline(devices=(device,), kernels=False)
    m = _module(device)
    k = _kernel(m) if query != "Module.function" else None
    if k is not None:
        try:
            call(m, k)
        except NotImplementedError as exc:
            pytest.skip(f"{backend.name}: {exc}")
    race.before(backend, runtime, m.close)
    race.spy(backend, "module_unload", "destroyed")
    call(m, k)
    race.check(f"{runtime} returned", "destroyed")
    assert m.closed
    race.no_leaks()


# -- accel.Graph ------------------------------------------------------------------------------------

@pytest.fixture(params=[0, 1])
def gdevice(request, sim_graph_backend):
    """Device 0, and device 1 (not current), of the simulators with stream capture."""
    return request.param


def _capture(device, body, **graph_kwargs):
    """A graph captured on a created stream of ``device`` with ``body(stream)``; returns (graph, stream)."""
    with accel.device_index(device):
        s = accel.Stream()
        g = accel.Graph(**graph_kwargs)
        with accel.graph(g, stream=s):
            body(s)
    return g, s


def _fill_body(buf):
    return lambda s: buf.fill_(7, stream=s)


@pytest.mark.parametrize("destroyer, destroy", [
    ("reset", "graph_exec_destroy"),
    ("instantiate", "graph_exec_destroy"),      # keep_graph: it replaces the executable
    ("close of the replay stream", "stream_destroy"),
])
def test_graph_replay_vs_destroy(race, gdevice, destroyer, destroy):
    """Graph.replay() while another thread resets the graph, instantiates it again (which destroys
    the executable it replaces), or closes the stream the replay is queued on: the launch
    completes on the executable and the stream it began with, the destroy comes after it."""
    backend = _backend()
    race.settle_baseline()
    with accel.device_index(gdevice):
        buf = accel.Buffer(N)
    g, cs = _capture(gdevice, _fill_body(buf), keep_graph=destroyer == "instantiate")
    g.replay()
    rs = _stream(gdevice)
    exec_handle = g.raw_cuda_graph_exec()
    if destroyer == "close of the replay stream":
        race.before(backend, "graph_launch", rs.close)
        race.spy(backend, destroy, "destroyed", match=_handle_is(rs.handle))
    else:
        race.before(backend, "graph_launch", getattr(g, destroyer))
        race.spy(backend, destroy, "destroyed", match=_handle_is(exec_handle))
    buf.fill_(0)
    accel.synchronize(gdevice)
    with accel.device_index(gdevice), rs:
        g.replay()
    race.check("graph_launch returned", "destroyed")
    accel.synchronize(gdevice)
    assert bytes(buf.to_numpy()) == b"\x07" * N
    g.reset()
    for obj in (buf, cs, rs):
        obj.close()
    race.no_leaks()


def test_graph_replay_vs_module_close(race, saxpy, gdevice):
    """A graph that captured a kernel launch launches the kernel at every replay (the graph keeps
    its module, but not against close()); another thread closes the module as the replay
    launches: the replay completes, the unload comes after it."""
    backend = _backend()
    race.settle_baseline()
    m = _module(gdevice)
    k = _kernel(m)
    with accel.device_index(gdevice):
        s0 = accel.Stream()
    x, bx, by = _saxpy_args(gdevice, s0)
    s0.synchronize()
    g, cs = _capture(gdevice, lambda s: accel.launch(k, 1, 64, 2.0, bx, by, 64, stream=s))
    race.before(backend, "graph_launch", m.close)
    race.spy(backend, "module_unload", "destroyed")
    with accel.device_index(gdevice):
        g.replay()
    race.check("graph_launch returned", "destroyed")
    accel.synchronize(gdevice)
    g.reset()
    for obj in (bx, by, cs, s0):
        obj.close()
    race.no_leaks()


def test_graph_replay_vs_external_event_close(race, sim_cuda):
    """A graph whose capture recorded an Event(external=True) records it at every replay; another
    thread closes the event as the replay launches: the replay completes, the event is destroyed
    after it."""
    backend = _backend()
    for device in (0, 1):
        race.__init__(race.mp)
        race.settle_baseline()
        with accel.device_index(device):
            buf = accel.Buffer(N)
        e = accel.Event(external=True)

        def body(s):
            buf.fill_(3, stream=s)
            e.record(s)
        g, cs = _capture(device, body)
        race.before(backend, "graph_launch", e.close)
        race.spy(backend, "event_destroy", "destroyed", match=_handle_is(e.handle))
        with accel.device_index(device):
            g.replay()
        race.check("graph_launch returned", "destroyed")
        accel.synchronize(device)
        g.reset()
        for obj in (buf, cs):
            obj.close()
        race.no_leaks()


def _capturable_random(backend):
    from accel.random import _device as random_kernels
    fns = random_kernels.kernel_functions(backend, 0)
    if not fns or "accel_philox_uniform_f32" not in fns:
        pytest.skip(f"{backend.name} has no Philox kernel to capture a random fill with")


def test_graph_replay_with_random_state_vs_reset(race, gdevice):
    """A graph that captured a random fill first writes the generator's seed and offset to its
    device holders at every replay (a store-state kernel launch, or a copy), then launches; another
    thread resets the graph during that write: the write and the launch complete, then the
    executable is destroyed and the holders freed."""
    backend = _backend()
    _capturable_random(backend)
    race.settle_baseline()
    with accel.device_index(gdevice):
        buf = accel.Buffer(N)
    g, cs = _capture(gdevice, lambda s: accel.random.uniform_(buf))
    exec_handle = g.raw_cuda_graph_exec()
    state = accel.random.default_generator(gdevice)._state
    holders = state._holders[g._rng][:2]
    assert holders
    alloc = accel.memory.device_allocator(gdevice)
    race.spy(backend, "graph_exec_destroy", "destroyed", match=_handle_is(exec_handle))
    race.spy(alloc, "free", "holders freed", match=lambda p, *a, **k: p in holders)
    race.before(backend, "launch", g.reset)         # the replay's store-state kernel
    race.before(backend, "memcpy_async", g.reset)   # (or its copy, where there is no such kernel)
    with accel.device_index(gdevice):
        g.replay()
    first = next(entry for entry in race.log if entry.endswith("returned"))
    race.check(first, "destroyed")
    assert race.log.index("graph_launch returned" if "graph_launch returned" in race.log else first) \
        < race.log.index("holders freed"), race.log
    for obj in (buf, cs):
        obj.close()
    race.no_leaks()


def test_graph_replay_with_pinned_copy_vs_reset(race, gdevice):
    """A graph that captured a non_blocking copy from pinned memory holds the pinned block (each
    replay copies from it again); another thread resets the graph as a replay launches: the
    launch completes, and the block is unpinned (host_free) only after it ran and the graph let go."""
    backend = _backend()
    race.settle_baseline()
    with accel.device_index(gdevice):
        buf = accel.Buffer(N)
    src = _pinned()
    src[:] = 6
    host = accel.memory.host_allocator()
    block = host.owns(src.__array_interface__["data"][0], N)
    g, cs = _capture(gdevice, lambda s: buf.copy_from(src, stream=s, non_blocking=True))
    exec_handle = g.raw_cuda_graph_exec()
    race.before(backend, "graph_launch", g.reset)
    race.spy(backend, "graph_exec_destroy", "destroyed", match=_handle_is(exec_handle))
    race.spy(backend, "host_free", "unpinned", match=_handle_is(block))
    with accel.device_index(gdevice):
        g.replay()
    race.check("graph_launch returned", "destroyed")
    accel.synchronize(gdevice)
    assert bytes(buf.to_numpy()) == b"\x06" * N
    del src
    gc.collect()
    accel.memory.empty_host_cache()
    assert race.log.index("destroyed") < race.log.index("unpinned"), race.log
    for obj in (buf, cs):
        obj.close()
    race.no_leaks()


def test_graph_debug_dump_vs_reset(race, gdevice, tmp_path):
    """Graph.debug_dump(path) passes the kept graph's handle to the runtime; another thread resets
    the graph just then: the dump completes, the graph is destroyed after it."""
    backend = _backend()
    race.settle_baseline()
    with accel.device_index(gdevice):
        buf = accel.Buffer(N)
        s = accel.Stream()
        g = accel.Graph()
        g.enable_debug_mode()
        with accel.graph(g, stream=s):
            buf.fill_(1, stream=s)
    graph_handle = g._graph
    race.before(backend, "graph_debug_dot", g.reset)
    race.spy(backend, "graph_destroy", "destroyed", match=_handle_is(graph_handle))
    g.debug_dump(tmp_path / "g.dot")
    race.check("graph_debug_dot returned", "destroyed")
    assert (tmp_path / "g.dot").exists()
    for obj in (buf, s):
        obj.close()
    race.no_leaks()


def test_graph_replay_vs_reset_of_a_graph_sharing_its_pool(race, gdevice):
    """Two graphs captured into one pool: a replay of the first is in flight while another thread
    resets the second and empties the cache: the first's executable and its pool's memory stay
    (nothing unmapped or freed to the runtime under the replay)."""
    backend = _backend()
    race.settle_baseline()
    pool = accel.graphs.graph_pool_handle()
    with accel.device_index(gdevice):
        out = []
        g1, s1 = _capture(gdevice, lambda s: out.append(accel.Buffer(N, stream=s)) or out[-1].fill_(1, stream=s),
                          pool=pool)
        g2, s2 = _capture(gdevice, lambda s: out.append(accel.Buffer(N, stream=s)) or out[-1].fill_(2, stream=s),
                          pool=pool)
    mine = out[0]
    first = g1.raw_cuda_graph_exec()
    _spy_release_to_runtime(race, backend, mine._ptr, N)
    race.spy(backend, "graph_exec_destroy", "destroyed", match=_handle_is(first))
    race.before(backend, "graph_launch", lambda: (g2.reset(), accel.memory.empty_cache()), when=_handle_is(first))
    with accel.device_index(gdevice):
        g1.replay()
    accel.synchronize(gdevice)
    assert bytes(mine.to_numpy()) == b"\x01" * N
    for obj in out:
        obj.close()
    g1.reset()
    race.check("graph_launch returned", "destroyed")
    assert "unmapped" not in race.log[:race.log.index("graph_launch returned")], race.log
    for obj in (s1, s2):
        obj.close()
    race.no_leaks()


def test_capture_begin_vs_stream_close(race, gdevice):
    """capture_begin() while another thread closes the stream being captured: the close claims
    the stream after capture_begin's check and before the capture began.  Capturing on a stream
    whose destroy is pending would leave a capture no one can end, so the begun capture is ended
    and discarded and capture_begin raises saying so (graphs.held._begin_held, by design); the stream
    is destroyed after, and nothing is left behind."""
    backend = _backend()
    race.settle_baseline()
    s = _stream(gdevice)
    g = accel.Graph()
    race.before(backend, "capture_begin", s.close)
    race.spy(backend, "stream_destroy", "destroyed", match=_handle_is(s.handle))
    with accel.device_index(gdevice), s:
        with pytest.raises(RuntimeError, match="was closed by another thread while the capture began"):
            g.capture_begin()
    race.check("capture_begin returned", "destroyed")
    assert g._stream is None and not backend.captures_underway()
    race.no_leaks()


def test_stream_close_during_capture_is_refused(race, gdevice):
    """Another thread closes the capturing stream while a captured fill is being queued on it:
    the close is refused (destroying a capturing stream would leave a capture without an end) and
    the capture goes on; after capture_end the stream closes."""
    backend = _backend()
    race.settle_baseline()
    with accel.device_index(gdevice):
        buf = accel.Buffer(N)
        s = accel.Stream()
        g = accel.Graph()
        race.before(backend, "memset_async", s.close, when=_dst_is(buf))
        with accel.graph(g, stream=s):
            buf.fill_(4, stream=s)
    out = race.done()
    assert len(out) == 1 and out[0][0] == "raised" and "a graph capture on it is underway" in str(out[0][1])
    g.replay()
    accel.synchronize(gdevice)
    assert bytes(buf.to_numpy()) == b"\x04" * N
    g.reset()
    for obj in (buf, s):
        obj.close()
    race.no_leaks()


@pytest.mark.parametrize("dev", [0, 1])
def test_graph_replay_with_graph_allocations_vs_reset(race, monkeypatch, dev):
    """backend:cudaMallocAsync: a graph that captured an allocation allocates it again at every
    replay, and its reset frees what the replays allocated; another thread resets the graph as a
    replay launches: the launch (and the allocator's note of it) completes, then the executable
    is destroyed and the graph's memory freed."""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="backend:cudaMallocAsync")
    backend = _backend()
    race.settle_baseline()
    out = []

    def body(s):
        out.append(accel.Buffer(N, stream=s))
        out[-1].fill_(5, stream=s)
    g, cs = _capture(dev, body)
    exec_handle = g.raw_cuda_graph_exec()
    race.before(backend, "graph_launch", g.reset)
    race.spy(backend, "graph_exec_destroy", "destroyed", match=_handle_is(exec_handle))
    with accel.device_index(dev):
        g.replay()
    race.check("graph_launch returned", "destroyed")
    accel.synchronize(dev)
    assert bytes(out[0].to_numpy()) == b"\x05" * N
    out[0].close()
    cs.close()
    race.no_leaks()


# -- accel.random fills -----------------------------------------------------------------------------

@pytest.mark.parametrize("closed", ["buffer", "stream"])
@pytest.mark.parametrize("fill", ["uniform_", "normal_", "randint_", "random_raw_"])
def test_random_fill_vs_close(race, device, fill, closed):
    """A random fill (a Philox kernel launch, or the host path's staged copy) while another thread
    closes the buffer filled or the current stream it queues on: the fill completes, the free or
    the destroy comes after it."""
    backend = _backend()
    race.settle_baseline()
    s = _stream(device)
    with accel.device_index(device):
        buf = accel.Buffer(N, stream=s)
    if closed == "buffer":
        _spy_free(race, accel.memory.device_allocator(device), buf._ptr)
        victim, label = buf, "freed"
    else:
        race.spy(backend, "stream_destroy", "destroyed", match=_handle_is(s.handle))
        victim, label = s, "destroyed"
    race.before(backend, "launch", victim.close)
    race.before(backend, "memcpy_async", victim.close, when=_dst_is(buf))
    args = {"uniform_": (), "normal_": (), "randint_": (0, 10), "random_raw_": ()}[fill]
    with accel.device_index(device), s:
        getattr(accel.random, fill)(buf, *args)
    first = next(entry for entry in race.log if entry.endswith("returned"))
    race.check(first, label)
    for obj in (buf, s):
        obj.close()
    race.no_leaks()


# -- memory a reset frees while a replay queued on another stream still uses it ---------------------
# Not a handle passed by a host call in flight, but the same lifetime rule one level down: work a
# replay queued is in flight until the device ran it.  A stream kept busy by delayed operations
# (ACCEL_SIM_DELAY_US) holds a replay queued on it while the graph is reset and the capture
# stream allocates again.

def _busy_replay_stream(device):
    """A created stream whose next work waits for 8 delayed fills on a third stream."""
    slow, rs = accel.Stream(device), accel.Stream(device)
    with accel.device_index(device):
        pad = accel.Buffer(N, stream=slow)
    for _ in range(8):
        pad.fill_(1, stream=slow)
    rs.wait_event(slow.record_event())
    return rs, (slow, pad)


@pytest.mark.parametrize("dev", [0, 1])
def test_rng_holders_freed_by_reset_wait_for_a_replay_on_another_stream(monkeypatch, dev):
    """A graph that captured a random fill on stream cs is replayed on stream rs, whose queued
    replay first writes the generator's seed and offset into the holders (two blocks allocated on
    cs); the graph is reset before rs ran it: the holders must not be handed to the next
    allocation on cs until the replay ran (the allocator must know rs used them).  Before r61e the
    seed write landed in the new buffer (its first 8 bytes read 01d19cf1303d0000, the default
    seed 0x3d30f19cd101, instead of ab...)."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=50000, ACCEL_ALLOC_CONF="expandable_segments:False")
    with accel.device_index(dev):
        cs = accel.Stream()
        buf = accel.Buffer(N)
        g = accel.Graph()
        with accel.graph(g, stream=cs):
            accel.random.uniform_(buf)
        accel.synchronize()
        rs, keep = _busy_replay_stream(dev)
        with rs:
            g.replay()
        g.reset()
        new = accel.Buffer(16, stream=cs)
        new.fill_(0xAB, stream=cs)
        cs.synchronize()
        rs.synchronize()
        assert bytes(new.to_numpy(stream=cs)) == b"\xab" * 16


@pytest.mark.parametrize("dev", [0, 1])
def test_graph_pool_freed_by_reset_waits_for_a_replay_on_another_stream(monkeypatch, dev):
    """A graph whose capture allocated and freed a temporary (a block of its private pool) is
    replayed on another stream rs; reset before rs ran the replay: the pool's blocks must not be
    handed to the next allocation on the capture stream until the replay ran."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=50000, ACCEL_ALLOC_CONF="expandable_segments:False")
    big = 4 << 20       # a segment of its own (the large pool: not shared with the RNG holders)
    with accel.device_index(dev):
        cs = accel.Stream()
        out = accel.Buffer(big)
        g = accel.Graph()
        with accel.graph(g, stream=cs):
            tmp = accel.Buffer(big, stream=cs)
            tmp.fill_(0x11, stream=cs)
            out.copy_from(tmp, stream=cs)
            tmp.close()
        accel.synchronize()
        rs, keep = _busy_replay_stream(dev)
        with rs:
            g.replay()
        g.reset()
        new = accel.Buffer(big, stream=cs)      # made before rs ran the replay
        new.fill_(0xAB, stream=cs)
        cs.synchronize()
        rs.synchronize()
        assert new.as_array("uint8", shape=(8,)).to_numpy(stream=cs).tobytes().hex() == "ab" * 8


# -- foreign streams (Stream.from_handle) -----------------------------------------------------------
# accel never destroys a stream another library made: closing the last wrapper of it makes accel
# forget the handle (the allocators cover its queued work with an event and drop what they key by
# it), after which its owner may destroy it.  That forget is the wrapper's destroy: a call queuing
# on the wrapper must complete first.

@pytest.mark.parametrize("method", ["fill_", "copy_to(numpy)"])
def test_foreign_stream_call_vs_close_of_its_last_wrapper(race, device, method):
    """A Buffer call queued on a foreign stream's only wrapper while another thread closes the
    wrapper: the call completes, and the allocators forget the handle (letting its owner destroy
    it) only after it."""
    backend = _backend()
    race.settle_baseline()
    with accel.device_index(device):
        raw = backend.stream_create(0)
    w = accel.Stream.from_handle(raw, device)
    with accel.device_index(device):
        buf = accel.Buffer(N)
    call, runtime, when = {"fill_": (lambda: buf.fill_(3, stream=w), "memset_async", _dst_is(buf)),
                           "copy_to(numpy)": (lambda: buf.copy_to(np.empty(N, np.uint8), stream=w),
                                              "memcpy_async", _src_is(buf))}[method]
    race.spy(accel.memory.device_allocator(device), "forget_stream", "forgotten", match=_handle_is(raw))
    race.before(backend, runtime, w.close, when=when)
    call()
    gc.collect()
    race.check(f"{runtime} returned", "forgotten")
    buf.close()
    with accel.device_index(device):
        backend.stream_synchronize(raw)
        backend.stream_destroy(raw)
    race.no_leaks()


# -- a reset made by a finalizer ---------------------------------------------------------------------
# A user's __del__ may reset a graph while the cyclic collector runs; a finalizer must not wait for
# a lock (the collecting thread may hold it), so reset() then moves what the graph holds to a
# release queued for the next safe point (accel._finalize.pending), which any thread's next API
# entry drains.  A replay in flight in another thread must still complete first.

def _reset_in_a_collection(g):
    """``g.reset()`` as a finalizer running in a collection on this thread makes it (what the
    collector's gc.callbacks record, accel._locks), then the next safe point (a synchronize)."""
    from accel import _locks
    info = {"generation": 2, "collected": 0, "uncollectable": 0}
    _locks._running[_locks._PHASES] = info
    _locks._mine.start = info
    try:
        g.reset()
    finally:
        _locks._running.pop(_locks._PHASES, None)
        _locks._mine.start = None
    accel.synchronize()


def test_graph_replay_vs_reset_from_a_finalizer(race, gdevice):
    """Graph.replay() while a finalizer in another thread's collection resets the graph and that
    thread then reaches a safe point (which runs the release the reset queued): the launch
    completes on its executable, which is destroyed after it."""
    backend = _backend()
    race.settle_baseline()
    with accel.device_index(gdevice):
        buf = accel.Buffer(N)
    g, cs = _capture(gdevice, _fill_body(buf))
    exec_handle = g.raw_cuda_graph_exec()
    race.before(backend, "graph_launch", lambda: _reset_in_a_collection(g))
    race.spy(backend, "graph_exec_destroy", "destroyed", match=_handle_is(exec_handle))
    with accel.device_index(gdevice):
        g.replay()
    accel.synchronize()         # a safe point of this thread too
    race.check("graph_launch returned", "destroyed")
    for obj in (buf, cs):
        obj.close()
    race.no_leaks()


def _in_a_collection(fn):
    """``fn()`` as a finalizer the cyclic collector runs on this thread."""
    from accel import _locks
    info = {"generation": 2, "collected": 0, "uncollectable": 0}
    _locks._running[_locks._PHASES] = info
    _locks._mine.start = info
    try:
        return fn()
    finally:
        _locks._running.pop(_locks._PHASES, None)
        _locks._mine.start = None


@pytest.mark.parametrize("query", ["launch", "Kernel.num_regs"])
def test_module_close_from_a_finalizer_inside_its_own_launch(saxpy, sim_cuda, query):
    """A user's __del__ (run by the collector on the launching thread, inside accel.launch or a
    Kernel query, which hold the module's lock across the runtime call) closes the module: no
    finalizer waits for a lock its own thread may hold (accel._finalize), so the close must not
    deadlock; the call completes and the module is unloaded after it."""
    from conftest import run_forked

    def child():
        backend = _backend()
        m = _module(0)
        k = _kernel(m)
        s = accel.Stream()
        _, bx, by = _saxpy_args(0, s)
        name = "launch" if query == "launch" else "function_attributes"
        real = getattr(backend, name)
        log = []

        def hooked(*args, **kwargs):
            setattr(backend, name, real)
            _in_a_collection(m.close)
            out = real(*args, **kwargs)
            log.append("returned")
            return out
        setattr(backend, name, hooked)
        real_unload = backend.module_unload
        backend.module_unload = lambda h: (log.append("unloaded"), real_unload(h))[1]
        if query == "launch":
            accel.launch(k, 1, 64, 2.0, bx, by, 64, stream=s)
        else:
            k.num_regs
        accel.synchronize()         # a safe point
        return 0 if m.closed and log == ["returned", "unloaded"] else 3
    assert run_forked(child, timeout=30, hung="deadlock: Module.close() from a finalizer inside the module's "
                                               "own launch waited for the lock its thread holds") == 0


def test_graph_replay_vs_reset_of_another_graph_of_the_same_generator(race, gdevice):
    """Two graphs registered with one generator's state (each with holders of its own, r64): a
    replay of the first writes its holders while another thread resets the second and drops the
    generator: the first graph's holders stay until it is reset too."""
    backend = _backend()
    _capturable_random(backend)
    race.settle_baseline()
    with accel.device_index(gdevice):
        buf1, buf2 = accel.Buffer(N), accel.Buffer(N)
    gens = [accel.random.Generator(gdevice)]
    graphs = []
    for buf in (buf1, buf2):
        g = accel.Graph()
        g.register_generator_state(gens[0])
        with accel.device_index(gdevice):
            s = accel.Stream()
            with accel.graph(g, stream=s):
                accel.random.uniform_(buf, generator=gens[0])
        graphs.append((g, s))
    (g1, s1), (g2, s2) = graphs
    holders = gens[0]._state._holders[g1._rng][:2]
    alloc = accel.memory.device_allocator(gdevice)
    race.spy(alloc, "free", "holders freed", match=lambda p, *a, **k: p in holders)

    def destroy():
        g2.reset()
        gens.clear()
        gc.collect()
    race.before(backend, "launch", destroy)          # g1's store-state kernel
    with accel.device_index(gdevice):
        g1.replay()
    assert "holders freed" not in race.log, race.log
    g1.reset()
    race.check("launch returned", "holders freed")
    for obj in (buf1, buf2, s1, s2):
        obj.close()
    race.no_leaks()
