"""A backend's close() racing calls in other threads (r43's audit).

Each test stops the racing call with a gate just before the step that the close must not cut
(its lock, or the vendor call), lets ``close()`` run to its end (or sees it wait for a lock,
through a failed non-blocking grab: no timing), then lets the call go on.  Wanted: a valid
answer, or accel's clear "not initialized" AcceleratorError (a handle error for a handle of an
earlier runtime); never a crash (the Metal simulator raises MetalValidationError where a Mac
crashes), a hang, or a vendor error text.

The CUDA backend has no close() (nothing releases its runtime objects while the process runs),
so it has no case here.
"""

import threading

import pytest

import accel
from accel import _lazy


class _Gate:
    """Shared state: the racing call's thread (``worker``) stops at ``arrived`` until ``gate``
    opens; ``settled`` is set when the closing thread (``closer``) finished or must wait for a
    lock."""

    def __init__(self):
        self.worker = self.closer = None
        self.arrived, self.gate, self.settled = threading.Event(), threading.Event(), threading.Event()

    def stop_here(self):
        self.arrived.set()
        assert self.gate.wait(60)


class _GatedLock:
    """The backend's lock: the worker stops before its ``nth`` acquire; the closer's blocked
    acquire sets ``settled``."""

    def __init__(self, real, g: _Gate, nth: int = 0):
        self.real, self.g, self.nth, self.count = real, g, nth, 0

    def __enter__(self):
        me = threading.get_ident()
        if me == self.g.worker:
            self.count += 1
            if self.count == self.nth:
                self.g.stop_here()
        elif me == self.g.closer and not self.real.acquire(False):
            self.g.settled.set()        # the close waits for the call: the gate may open
        else:
            return
        self.real.acquire()

    def __exit__(self, *exc):
        self.real.release()

    def acquire(self, *args, **kwargs):
        return self.real.acquire(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)


def _race(g: _Gate, call, close):
    """Run ``call()`` in a thread until it stops at the gate, then ``close()`` in another until
    it ends or waits; open the gate; return the call's result or exception."""
    outcome = {}

    def run_call():
        g.worker = threading.get_ident()
        try:
            outcome["call"] = call()
        except BaseException as exc:        # noqa: B902 - checked by the caller
            outcome["call"] = exc
        finally:
            g.arrived.set()

    def run_close():
        g.closer = threading.get_ident()
        try:
            close()
        except BaseException as exc:
            outcome["close"] = exc
        finally:
            g.settled.set()

    w = threading.Thread(target=run_call, daemon=True)
    w.start()
    assert g.arrived.wait(60)
    c = threading.Thread(target=run_close, daemon=True)
    c.start()
    assert g.settled.wait(60)
    g.gate.set()
    w.join(60)
    c.join(60)
    assert not w.is_alive() and not c.is_alive(), "close() and the call deadlocked"
    assert "close" not in outcome, outcome
    return outcome["call"]


def _not_initialized(got, what):
    assert isinstance(got, accel.AcceleratorError), f"{what}: {got!r}"
    assert "not initialized" in str(got), f"{what}: {got}"


# -- Metal --------------------------------------------------------------------------------------

def _mps(monkeypatch):
    from conftest import use_sim
    use_sim(monkeypatch, "mps")
    be = _lazy.lazy_init()
    s = be.stream_create()
    e = be.event_create()
    p, q = be.mem_alloc(64), be.mem_alloc(64)
    be.event_record(e, s)
    be.stream_synchronize(s)
    return be, dict(s=s, e=e, p=p, q=q)


_MSL = b"kernel void k(device float* a [[buffer(0)]]) {}"

#: calls stopped before their first hold of the backend lock (after any liveness check outside it)
_MPS_CALLS = {
    "stream_create": lambda be, h: be.stream_create(),
    "event_create": lambda be, h: be.event_create(),
    "module_load": lambda be, h: be.module_load(_MSL),
    "stream_query": lambda be, h: be.stream_query(h["s"]),
    "stream_synchronize": lambda be, h: be.stream_synchronize(h["s"]),
    "stream_destroy": lambda be, h: be.stream_destroy(h["s"]),
    "stream_wait_event": lambda be, h: be.stream_wait_event(h["s"], h["e"]),
    "event_record": lambda be, h: be.event_record(h["e"], h["s"]),
    "event_query": lambda be, h: be.event_query(h["e"]),
    "event_synchronize": lambda be, h: be.event_synchronize(h["e"]),
    "event_destroy": lambda be, h: be.event_destroy(h["e"]),
    "mem_free": lambda be, h: be.mem_free(h["p"]),
    "memset_async": lambda be, h: be.memset_async(h["p"], 1, 64, 0),
    "memcpy_async": lambda be, h: be.memcpy_async(h["p"], h["q"], 64, 0),
}


@pytest.mark.parametrize("case", sorted(_MPS_CALLS))
def test_mps_call_racing_close_says_not_initialized(monkeypatch, case):
    be, h = _mps(monkeypatch)
    g = _Gate()
    monkeypatch.setattr(be, "_lock", _GatedLock(be._lock, g, nth=1))
    got = _race(g, lambda: _MPS_CALLS[case](be, h), be.close)
    _not_initialized(got, case)


_MPS_COPIES = {
    # stopped after the pointers were looked up, before the work is encoded (a blit of the
    # looked-up MTLBuffers, which the close released)
    "memcpy_async": lambda be, h: be.memcpy_async(h["p"], h["q"], 64, 0),
    "memset_async": lambda be, h: be.memset_async(h["p"], 1, 64, 0),
    "memcpy_async from host": lambda be, h: be.memcpy_async(h["p"], h["host"], 64, 0),
}


@pytest.mark.parametrize("case", sorted(_MPS_COPIES))
def test_mps_copy_racing_close_and_init_never_uses_a_released_buffer(monkeypatch, case):
    import numpy as np
    be, h = _mps(monkeypatch)
    host = np.zeros(16, np.float32)
    h["host"] = host.ctypes.data
    g = _Gate()
    real = be._enqueue_copy if "memcpy" in case else be._enqueue_fill

    def enqueue(*args, **kwargs):
        g.stop_here()
        return real(*args, **kwargs)
    monkeypatch.setattr(be, "_enqueue_copy" if "memcpy" in case else "_enqueue_fill", enqueue)

    def close_and_init():
        be.close()
        be.init()       # stream 0 is live again: only the buffers are stale
    got = _race(g, lambda: _MPS_COPIES[case](be, h), close_and_init)
    assert isinstance(got, accel.AcceleratorError) and "not a live" in str(got), \
        f"{case}: {got!r} (a Mac crashes: the blit uses a released MTLBuffer)"


@pytest.mark.parametrize("reinit", [False, True], ids=["close", "close+init"])
def test_mps_host_path_copy_racing_close_never_writes_a_released_buffer(monkeypatch, reinit):
    be, h = _mps(monkeypatch)
    g = _Gate()
    real = be._before_host_write

    def before_host_write(d, stream):
        real(d, stream)
        if threading.get_ident() == g.worker:
            g.stop_here()       # ordered; next: the host copy through the buffers' contents
    monkeypatch.setattr(be, "_before_host_write", before_host_write)

    def close():
        be.close()
        if reinit:
            be.init()
    # 3 bytes: not a multiple of 4, so copied on the host after a stream synchronize
    got = _race(g, lambda: be.memcpy_async(h["p"], h["q"], 3, 0), close)
    assert isinstance(got, accel.AcceleratorError), \
        f"{got!r}: the host copy went through released MTLBuffers (freed memory on a Mac)"
    assert "not initialized" in str(got) or "not a live" in str(got), got


def test_mps_synchronize_waiting_while_close_releases_the_stream(monkeypatch):
    """A stream_synchronize waiting on a command buffer outside the lock while close() releases
    the stream: the close empties the stream's in-flight list, so the synchronize's cleanup
    does not release that buffer a second time."""
    from accel.backends.mps import _library as mps_lib
    be, h = _mps(monkeypatch)
    rt = be._rt
    real_send = rt.send
    stops = {}      # thread -> (arrived, gate): stopped at its first waitUntilCompleted

    def send(receiver, msg, *args):
        stop = stops.get(threading.get_ident())
        if stop is not None and msg is mps_lib.M_WAIT and not stop[0].is_set():
            stop[0].set()
            assert stop[1].wait(60)
        return real_send(receiver, msg, *args)
    monkeypatch.setattr(rt, "send", send)
    s, p, q = h["s"], h["p"], h["q"]
    outcome = {}

    def run(key, fn):
        def body():
            stops[threading.get_ident()] = stop
            try:
                fn()
            except BaseException as exc:
                outcome[key] = exc
        stop = (threading.Event(), threading.Event())
        t = threading.Thread(target=body, daemon=True)
        t.start()
        assert stop[0].wait(60)
        return t, stop[1]

    be.memcpy_async(p, q, 64, s)
    closer, close_gate = run("close", be.close)       # waits for the first command buffer
    be.memcpy_async(p, q, 64, s)                       # a second, committed by the synchronize
    syncer, sync_gate = run("sync", lambda: be.stream_synchronize(s))
    close_gate.set()
    closer.join(60)
    sync_gate.set()
    syncer.join(60)
    assert not closer.is_alive() and not syncer.is_alive()
    assert outcome == {}, f"{outcome} (a Mac crashes: a command buffer released twice)"


# -- Level Zero ---------------------------------------------------------------------------------

class _Deadlock(Exception):
    pass


class _WatchedLock(_GatedLock):
    """A stream's or the backend's lock.  The closer's blocked acquire sets ``settled`` and
    ``closer_waits``; the worker's acquire of a lock the closer holds while the closer waits for
    one the worker holds is the deadlock, raised in the worker (so the test ends)."""

    def __init__(self, real, g: _Gate, state: dict, name: str):
        super().__init__(real, g)
        self.state, self.name = state, name
        state.setdefault("held", {})[name] = 0

    def __enter__(self):
        me, held = threading.get_ident(), self.state["held"]
        if me == self.g.closer:
            if not self.real.acquire(False):
                self.state["closer_waits"] = self.name
                self.g.settled.set()
                self.real.acquire()
                self.state["closer_waits"] = None
            held[self.name] += 1
            return
        if me == self.g.worker and not self.real.acquire(False):
            if self.state.get("closer_waits") and held[self.name]:
                raise _Deadlock(f"the call waits for {self.name}, held by close(), which waits for "
                                f"{self.state['closer_waits']}, held by the call")
            self.real.acquire()
        elif me != self.g.worker:
            self.real.acquire()

    def __exit__(self, *exc):
        if threading.get_ident() == self.g.closer:
            self.state["held"][self.name] -= 1
        self.real.release()


class _GatedLib:
    """The loader's functions; the worker stops before its first call of ``name``."""

    def __init__(self, lib, g: _Gate, name: str):
        self.lib, self.g, self.name = lib, g, name

    def __getattr__(self, attr):
        fn = getattr(self.lib, attr)
        if attr != self.name:
            return fn

        def gated(*args):
            if threading.get_ident() == self.g.worker and not self.g.arrived.is_set():
                self.g.stop_here()
            return fn(*args)
        return gated


def test_xpu_record_racing_close_does_not_deadlock(monkeypatch):
    """event_record holds the stream's lock, then takes the backend's; close() held the
    backend's and then took the stream's (to synchronize it)."""
    from conftest import use_sim
    use_sim(monkeypatch, "xpu")
    be = _lazy.lazy_init()
    s, e = be.stream_create(), be.event_create()
    g, state = _Gate(), {}
    monkeypatch.setattr(be, "_lock", _WatchedLock(be._lock, g, state, "the backend lock"))
    for st in be._streams.values():
        st.lock = _WatchedLock(st.lock, g, state, f"stream {st.handle:#x}'s lock")
    ffi, lib, rest = be._lib
    monkeypatch.setattr(be, "_lib", (ffi, _GatedLib(lib, g, "zeCommandListAppendSignalEvent"), rest))
    got = _race(g, lambda: be.event_record(e, s), be.close)
    assert not isinstance(got, _Deadlock), got
    assert got is None or isinstance(got, (accel.AcceleratorError, ValueError)), repr(got)
    assert not be._devices
