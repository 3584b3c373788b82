"""Reliability leftovers (r40): a raised error leaves every state as it was.

1. A copy whose vendor call fails (the runtime refuses the copy: nothing was queued) must not
   leave a stream use on the copied buffers' allocator blocks: freeing the buffer then makes
   its block reusable at once on its own stream, with no event pending.  Before r40
   ``Buffer.copy_from``, ``ArrayView.copy_from`` (and ``fill_``, ``copy_to``, ``to_numpy``) recorded
   the use before the copy was queued.
2. The Metal backend's ``properties()`` and ``mem_info()`` racing ``close()`` in another thread:
   a valid answer or a clear AcceleratorError, never a message to the released MTLDevice (a Mac
   crashes; the simulator raises MetalValidationError, as NSZombie reports it).
3. XPU capture ids: ``id(capture)`` comes back for a later capture once the first is collected
   (CPython reuses the address), and accel/graphs/'s table of a capture (its external events, its
   pinned host blocks) is keyed by it: a capture ended before its table was forgotten took the
   next capture's table with it.
"""

import threading

import numpy as np
import pytest

import accel
from accel import _lazy, memory

N = 4096


def _last_device() -> int:
    return accel.device_count() - 1


def _block_uses(buf):
    return memory.device_allocator(buf.device.index)._blocks[buf.ptr].uses


class _Refused(accel.AcceleratorError):
    pass


def _refuse_copies(monkeypatch, backend):
    """The backend's memcpy_async and memset_async fail as a vendor refusal does: they raise
    before queuing."""
    def memcpy_async(*args, **kwargs):
        raise _Refused("memcpy_async refused (injected by the test)")
    monkeypatch.setattr(backend, "memcpy_async", memcpy_async)
    monkeypatch.setattr(backend, "memset_async", memcpy_async)


_COPIES = {
    "buffer<-buffer": lambda dst, src, s: dst.copy_from(src, stream=s),
    "buffer<-buffer non_blocking": lambda dst, src, s: dst.copy_from(src, stream=s, non_blocking=True),
    "buffer<-host": lambda dst, src, s: dst.copy_from(np.ones(N // 4, np.float32), stream=s),
    "buffer<-host non_blocking": lambda dst, src, s: dst.copy_from(np.ones(N // 4, np.float32), stream=s,
                                                                    non_blocking=True),
    "view<-host": lambda dst, src, s: dst.as_array(np.float32).copy_from(np.ones(N // 4, np.float32), stream=s),
    "strided view<-host": lambda dst, src, s: dst.as_array(np.float32, (N // 8,), (8,)).copy_from(
        np.ones(N // 8, np.float32), stream=s),
    "view<-view": lambda dst, src, s: dst.as_array(np.float32).copy_from(src.as_array(np.float32), stream=s),
    "view<-buffer": lambda dst, src, s: dst.as_array(np.float32).copy_from(src, stream=s),
    # the other calls that queue work on a buffer (the destination here), refused the same way
    "fill_": lambda dst, src, s: dst.fill_(1, stream=s),
    "copy_to": lambda dst, src, s: dst.copy_to(np.empty(N, np.uint8), stream=s),
    "copy_to pinned non_blocking": lambda dst, src, s: dst.copy_to(accel.empty_pinned(N, np.uint8), stream=s,
                                                                    non_blocking=True),
    "to_numpy": lambda dst, src, s: dst.to_numpy(stream=s),
    "to_numpy non_blocking": lambda dst, src, s: dst.to_numpy(stream=s, non_blocking=True),
    "view.to_numpy": lambda dst, src, s: dst.as_array(np.float32).to_numpy(stream=s),
    "strided view.to_numpy": lambda dst, src, s: dst.as_array(np.float32, (N // 8,), (8,)).to_numpy(stream=s),
}


@pytest.mark.parametrize("case", sorted(_COPIES))
def test_a_refused_copy_or_fill_records_no_stream_use(sim_backend, monkeypatch, case):
    dev = _last_device()
    backend = _lazy.lazy_init()
    dst, src = accel.Buffer(N, device=dev), accel.Buffer(N, device=dev)
    s = accel.Stream(device=dev)
    last = (dst._last, src._last)
    _refuse_copies(monkeypatch, backend)
    with pytest.raises(_Refused):
        _COPIES[case](dst, src, s)
    monkeypatch.undo()
    assert _block_uses(dst) is None, f"{case}: the failed copy left a use of its stream on the destination"
    assert _block_uses(src) is None, f"{case}: the failed copy left a use of its stream on the source"
    assert (dst._last, src._last) == last, f"{case}: the failed copy changed a buffer's last-use stream"
    ptr = dst.ptr
    dst.close()
    alloc = memory.device_allocator(dev)
    assert alloc._pending_events == [], f"{case}: the freed block waits for an event of the failed copy's stream"
    again = accel.Buffer(N, device=dev)
    assert again.ptr == ptr
    # and a copy that works still protects both blocks
    _COPIES[case](again, src, s)
    s.synchronize()
    if case.endswith("buffer") or case.endswith("view"):
        assert _block_uses(src) is not None
    assert _block_uses(again) is not None


def test_a_copy_refused_by_the_simulated_runtime_records_no_use(sim_cuda):
    from accel import sim
    dev = _last_device()
    dst, src = accel.Buffer(N, device=dev), accel.Buffer(N, device=dev)
    s = accel.Stream(device=dev)
    sim.inject_error("cudaMemcpyAsync", 1)
    with pytest.raises(accel.AcceleratorError, match="cudaMemcpyAsync"):
        dst.copy_from(src, stream=s)
    assert _block_uses(dst) is None and _block_uses(src) is None


# -- 2. Metal: queries racing close() ------------------------------------------------------------

class _WatchedLock:
    """The backend's lock, telling ``settled`` when the thread ``closer`` must wait for it."""

    def __init__(self, real, settled: threading.Event):
        self.real, self.settled, self.closer = real, settled, None

    def __enter__(self):
        if threading.get_ident() == self.closer and not self.real.acquire(False):
            self.settled.set()      # the close waits for the query: the gate may open
            self.real.acquire()
        elif threading.get_ident() != self.closer:
            self.real.acquire()

    def __exit__(self, *exc):
        self.real.release()

    def __getattr__(self, name):
        return getattr(self.real, name)


_QUERIES = {
    # (the call, the message it is stopped at; the stop is before that message is sent)
    "properties at name": (lambda be: be.properties(0), "name"),
    "properties at maxBufferLength": (lambda be: be.properties(0), "maxBufferLength"),
    "mem_info at recommendedMaxWorkingSetSize": (lambda be: be.mem_info(), "recommendedMaxWorkingSetSize"),
    "mem_info at currentAllocatedSize": (lambda be: be.mem_info(), "currentAllocatedSize"),
    "mem_alloc at newBufferWithLength": (lambda be: be.mem_alloc(64), "newBufferWithLength:options:"),
}


@pytest.mark.parametrize("case", sorted(_QUERIES))
def test_mps_query_racing_close_never_messages_a_released_device(monkeypatch, case):
    from conftest import use_sim
    use_sim(monkeypatch, "mps")
    be = _lazy.lazy_init()
    query, selector = _QUERIES[case]
    rt = be._rt
    real_send = rt.send
    arrived, gate, settled = threading.Event(), threading.Event(), threading.Event()
    lock = _WatchedLock(be._lock, settled)
    monkeypatch.setattr(be, "_lock", lock)
    querier = []

    def send(receiver, msg, *args):
        if querier and threading.get_ident() == querier[0] and msg.selector == selector and not arrived.is_set():
            arrived.set()
            gate.wait()
        return real_send(receiver, msg, *args)

    monkeypatch.setattr(rt, "send", send)
    outcome = {}

    def run_query():
        querier.append(threading.get_ident())
        try:
            outcome["query"] = query(be)
        except BaseException as exc:        # noqa: B902 - reported below
            outcome["query"] = exc
        finally:
            arrived.set()

    def run_close():
        lock.closer = threading.get_ident()
        try:
            be.close()
        except BaseException as exc:
            outcome["close"] = exc
        finally:
            settled.set()                   # the close ran to its end without waiting

    q = threading.Thread(target=run_query, daemon=True)
    q.start()
    assert arrived.wait(60)
    c = threading.Thread(target=run_close, daemon=True)
    c.start()
    assert settled.wait(60)
    gate.set()
    q.join(60)
    c.join(60)
    assert not q.is_alive() and not c.is_alive()
    got = outcome["query"]
    assert "close" not in outcome, outcome
    if isinstance(got, BaseException):
        assert isinstance(got, accel.AcceleratorError), f"{case}: {got!r} (a Mac crashes here)"
        assert "not initialized" in str(got) or "closed" in str(got), f"{case}: {got}"
    assert be._device is None
    # after the close: a clear error, as before any init
    for call, _ in _QUERIES.values():
        with pytest.raises(accel.AcceleratorError, match="not initialized"):
            call(be)


# -- 3. XPU: capture ids ----------------------------------------------------------------------

def test_xpu_capture_ids_are_not_reused(monkeypatch):
    from conftest import use_sim
    use_sim(monkeypatch, "xpu")
    be = _lazy.lazy_init()
    s = accel.Stream(device=_last_device())
    seen = set()
    for _ in range(32):
        be.capture_begin(s.handle, "global")
        ident = be.capture_id(s.handle)
        assert ident not in seen, "a capture got the id of an earlier one"
        seen.add(ident)
        be.graph_destroy(be.capture_end(s.handle))


def test_xpu_a_late_forget_of_an_ended_capture_keeps_the_next_captures_table(monkeypatch):
    from conftest import use_sim
    from accel import streams
    from accel.backends.xpu import graphs as xpu_graphs
    use_sim(monkeypatch, "xpu")
    be = _lazy.lazy_init()
    # CPython gives a collected capture's address to the next object of its size: every capture
    # at one address makes the collision certain (what id(capture) gave at random)
    monkeypatch.setattr(xpu_graphs, "id", lambda obj: 0x1000, raising=False)
    sa, sb = accel.Stream(device=0), accel.Stream(device=_last_device())
    ga, gb = accel.Graph(), accel.Graph()
    buf = accel.Buffer(64, device=sb.device_index)
    real_end = be.capture_end

    def capture_end(handle):
        if handle != sa.handle:
            return real_end(handle)
        be._invalidate(be._stream(handle).capture, "invalidated by the test")
        try:
            return real_end(handle)
        finally:
            # (for another thread:) a capture begins after this one ended, before accel/graphs/ forgot
            # this one's table
            with sb:
                gb.capture_begin()

    monkeypatch.setattr(be, "capture_end", capture_end)
    with sa:
        ga.capture_begin()
    with sa, pytest.raises(accel.CaptureError, match="invalidated by the test"):
        ga.capture_end()
    monkeypatch.setattr(be, "capture_end", real_end)
    try:
        assert gb._capture_id in streams._capture_events, "the ended capture took the new capture's table"
        assert streams._capture_of(be, sb) == gb._capture_id
        buf.fill_(7, stream=sb)
    finally:
        with sb:
            gb.capture_end()
    gb.replay()
    sb.synchronize()
    assert (buf.to_numpy(stream=sb) == 7).all()


def test_a_copy_on_a_destroyed_foreign_stream_is_refused_before_it_is_queued(sim_backend):
    """(The uses are noted after the copy now: the wrapper's liveness is checked before it.)"""
    backend = _lazy.lazy_init()
    dev = _last_device()
    with accel.device_index(dev):
        raw = backend.stream_create()
    wrapper = accel.Stream.from_handle(raw)
    dst, src = accel.Buffer(N, device=dev), accel.Buffer(N, device=dev)
    dst.fill_(4)
    backend.stream_destroy(raw)
    for copy in (lambda: dst.copy_from(src, stream=wrapper),
                 lambda: dst.copy_from(np.zeros(N, np.uint8), stream=wrapper),
                 lambda: dst.as_array("u1").copy_from(src.as_array("u1"), stream=wrapper),
                 lambda: dst.as_array("u1").copy_from(np.zeros(N, np.uint8), stream=wrapper)):
        with pytest.raises(ValueError, match="destroyed"):
            copy()
    assert _block_uses(dst) is None and _block_uses(src) is None
    assert (dst.to_numpy() == 4).all()
