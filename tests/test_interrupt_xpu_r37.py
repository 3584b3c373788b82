"""A KeyboardInterrupt (Ctrl-C) at any point of the Level Zero backend's stream, event and
copy paths leaves the backend working: no event slot recycled while the device still signals
or waits on it, no command on a list that the backend did not count (a stream sync or a free
would not wait for it), no staging memory freed under a queued copy, nothing left behind (r37).

The paths are those of tests/test_user_programs.py's Ctrl-C program on two devices: streams
created and destroyed, fills, copies from pageable and pinned memory and across devices,
events recorded for stream waits, a record_stream's event on a side stream, a non-blocking
download and its event, host queries and syncs.  The injector is test_interrupt_backends.py's
(a simulated vendor call counts as one C call: the point is as it returns), over every point
of accel/backends/xpu/*.py and accel/backends/*.py.

Deterministic, no timing: before the interrupted op (when it does not wait for the device),
every stream of the workload waits on a *gate* event only the host signals, so all its work
stays queued.  With the gate still closed, what the hardware cannot tolerate is checked at
once: a sweep recycling slots (zeEventHostReset of an event the device references is refused
by the simulator), every command the lists hold is counted in the backend's stream numbers,
and no free slot is referenced.  Then the gate opens, the workload runs again, everything is
synchronized and freed: the bytes are right and neither the simulator nor the backend's
tables keep anything.
"""

import ctypes
import os

import numpy as np

import test_interrupt_backends as tib
from accel import _lazy, sim
from accel.streams import on_device
from conftest import THOROUGH, use_sim

N = 4096
_STRIDE = int(os.environ.get("ACCEL_INTERRUPT_STRIDE", "1" if THOROUGH else "8"))
# default (r74a): every 8th point of each op and the first point of each function the workload
# reaches (tib.first_of_each_site), so every backend function is still interrupted once, at
# about a third of every point's runs; ACCEL_TEST_THOROUGH (or ACCEL_INTERRUPT_STRIDE): stride only
_EVERY_SITE = tib._EVERY_SITE


class Gate:
    """A host-signalled event every stream of the workload waits on: their work stays queued."""

    def __init__(self, be, streams):
        self.be = be
        ffi, lib, _ = be._lib
        self.slot = be._acquire(be._devices[0], False)
        arr = ffi.new("ze_event_handle_t[1]", [self.slot.event])
        for s in streams:
            with s.lock:
                s.seq += 1
                self.slot.deps.append((s, s.seq))
                be._append(s, "zeCommandListAppendWaitOnEvents", lib.zeCommandListAppendWaitOnEvents,
                           s.list, 1, arr)

    def open(self):
        assert self.be._lib[1].zeEventHostSignal(self.slot.event) == 0
        self.be._retire(self.slot)


def _sim_rt():
    from accel.sim import ze
    return ze._rt


def _check_closed(be, streams, base):
    """With the gate closed: what must hold while the device still has the work queued."""
    rt = _sim_rt()
    for s in streams:
        cl = rt.get(s.list, "cmdlist")
        assert cl is not None, f"stream {s.handle:#x}: its list is gone"
        appended = cl.submitted - base[s][0]
        counted = s.seq - base[s][1]
        assert appended <= counted, (f"stream {s.handle:#x}: {appended} commands appended since the gate, "
                                     f"the backend counted {counted} (a sync or a free would not wait for the rest)")
    for key, free in be._free_slots.items():
        for slot in free:
            ev = rt.get(slot.event, "event")
            assert ev is not None and not ev.refs, "a free event slot is still referenced by queued work"
            assert not ev.signaled, "a free event slot is still signalled (it was never reset)"
    be._sweep()     # zeEventHostReset is refused for an event the device still references


class Work:
    """The Ctrl-C program's backend calls: a stream made on device 0 (t) and destroyed, buffers
    a (device 0), b (device 1), pinned h, pageable src/dst, a side stream on device 1, events."""

    def __init__(self, be):
        self.be = be
        self.s0, self.s1 = be.default_stream(0), be.default_stream(1)
        with on_device(be, 1):
            self.side = be.stream_create()
            self.b = be.mem_alloc(N)
        with on_device(be, 0):
            self.a = be.mem_alloc(N)
            self.h = be.host_alloc(N)
            self.e, self.u, self.v = be.event_create(), be.event_create(), be.event_create()
        self.src = np.full(N, 0x5A, np.uint8)
        self.dst = np.zeros(N, np.uint8)
        self.t = None
        self.dropped = []

    def streams(self):
        be = self.be
        out = [be._stream(self.s0), be._stream(self.s1), be._stream(self.side)]
        if self.t is not None and self.t in be._streams:
            out.append(be._stream(self.t))
        return out

    def ops(self):
        """(name, blocking, callable); blocking ops wait for the device (not gated)."""
        be = self.be

        def on0(fn):
            def op():
                with on_device(be, 0):
                    fn()
            return op

        def make_t():
            if self.t is None or self.t not in be._streams:
                self.t = be.stream_create()

        def drop_t():
            # as a program's Stream.close(): again after an interrupt, unless it was destroyed
            if self.t is not None and self.t in be._streams:
                be.stream_destroy(self.t)
            self.t = None

        def t():
            return self.t if self.t is not None else self.s0

        def remake_e():
            # as a program's Event dropped and made again: an interrupted destroy is retried at close
            old = self.e
            self.e = be.event_create()
            self.dropped.append(old)
            be.event_destroy(old)

        src = self.src.ctypes.data
        dst = self.dst.ctypes.data
        return [
            ("create t", False, on0(make_t)),
            ("fill a", False, on0(lambda: be.memset_async(self.a, 0x11, N, t()))),
            ("copy a<-pageable", False, on0(lambda: be.memcpy_async(self.a, src, N // 2, t()))),
            ("copy b<-a", False, on0(lambda: be.memcpy_async(self.b, self.a, N, t()))),
            ("record e", False, on0(lambda: be.event_record(self.e, t()))),
            ("side waits e", False, on0(lambda: be.stream_wait_event(self.side, self.e))),
            ("record u on side", False, on0(lambda: be.event_record(self.u, self.side))),
            ("copy h<-b on side", False, on0(lambda: be.memcpy_async(self.h, self.b, N, self.side))),
            ("record v on side", False, on0(lambda: be.event_record(self.v, self.side))),
            ("fill a again", False, on0(lambda: be.memset_async(self.a + N // 2, 0x22, N // 2, t()))),
            ("query u", True, on0(lambda: be.event_query(self.u))),
            ("sync v", True, on0(lambda: be.event_synchronize(self.v))),
            ("copy pageable<-a", True, on0(lambda: be.memcpy_async(dst, self.a, N, t()))),
            ("query side", True, on0(lambda: be.stream_query(self.side))),
            ("remake e", False, on0(remake_e)),
            ("destroy t", True, on0(drop_t)),
        ]

    def check(self):
        want = b"\x5a" * (N // 2) + b"\x11" * (N // 2)
        got = ctypes.string_at(self.h, N)
        assert got == want, f"pinned bytes: {got[:4]!r}..{got[-4:]!r}"
        assert bytes(self.dst) == b"\x5a" * (N // 2) + b"\x22" * (N // 2), "pageable bytes"

    def close(self):
        be = self.be
        with on_device(be, 0):
            if self.t is not None and self.t in be._streams:
                be.stream_destroy(self.t)
                self.t = None
            be.device_synchronize()
            for ev in {self.e, self.u, self.v, *self.dropped}:
                if ev in be._events:
                    be.event_destroy(ev)
            be.mem_free(self.a)
            be.host_free(self.h)
        with on_device(be, 1):
            be.device_synchronize()
            be.stream_destroy(self.side)
            be.mem_free(self.b)


def _tables(be):
    """What the backend keeps after everything was synchronized and freed (must match the baseline)."""
    be._sweep()
    busy = [s for s in be._retired if s.waiters or s.deps and not all(x.done >= q for x, q in s.deps)]
    return dict(streams=sorted(be._streams), events=sorted(be._events), retired=len(be._retired),
                free=sum(len(v) for v in be._free_slots.values()), pools=len(be._pools),
                busy=len(busy), deferred=len(be._deferred), orphans=list(be._orphans),
                allocs=len(be._allocs), host=len(be._host_allocs),
                waiting=[s.waiting for s in be._streams.values() if s.waiting],
                sim=tib._leaks(be, "xpu"), errors=list(_sim_rt().errors),
                lists=sim.state().ze_live_command_lists, sim_pools=sim.state().ze_live_event_pools)


def _one_run(be, i, n, closed_checks=True):
    """Ops before ``i`` plainly, op ``i`` interrupted at point ``n`` (gated unless it blocks),
    then the whole workload again, the bytes and the cleanup."""
    w = Work(be)
    ops = w.ops()
    for what, blocking, op in ops[:i]:
        op()
    what, blocking, op = ops[i]
    gate = None
    if not blocking:
        streams = w.streams()
        base = {s: (_sim_rt().get(s.list, "cmdlist").submitted, s.seq) for s in streams}
        gate = Gate(be, streams)
        base = {s: (c + 1, q + 1) for s, (c, q) in base.items()}
    inj = tib._Inject(n)
    try:
        try:
            with inj:
                op()
        except KeyboardInterrupt:
            pass
        if gate is not None and closed_checks:
            _check_closed(be, [s for s in streams if not s.dead], base)
    finally:
        if gate is not None:
            gate.open()
    for what2, blocking2, op2 in ops:
        op2()
    w.check()
    w.close()
    return inj


def _points(be):
    """The workload once without an interrupt: each op's number of points, and the tables after
    it (the baseline: pools made stay for the backend's life)."""
    w = Work(be)
    points = []
    for what, blocking, op in w.ops():
        inj = tib._Inject(0)
        with inj:
            op()
        points.append((what, inj.count))
    w.check()
    w.close()
    return points, _tables(be)


def _sites(be):
    """The workload once, plainly (as _points): each op's points' sites."""
    w = Work(be)
    sites = []
    for what, blocking, op in w.ops():
        rec = tib.site_recorder(tib._Inject)()
        with rec:
            op()
        sites.append(rec.sites)
    w.check()
    w.close()
    return sites


def _sweep(be, stride):
    points, base = _points(be)
    extra = tib.first_of_each_site(_sites(be), key=tib.function_of) if _EVERY_SITE else [()] * len(points)
    assert _tables(be) == base      # (the second run made nothing new: the runs below come back to base)
    runs, failures = 0, []
    for i, (what, total) in enumerate(points):
        for n in tib.picked(total, stride, i, extra[i]):
            runs += 1
            inj = None
            try:
                inj = _one_run(be, i, n)
                got = _tables(be)
                assert got == base, f"left behind: { {k: v for k, v in got.items() if base[k] != v} }"
            except BaseException as exc:   # noqa: BLE001 - a failure to report
                failures.append((f"{what} @{n}", (inj.site if inj else None),
                                 f"{type(exc).__name__}: {exc}"[:300]))
                _lazy._reset_for_tests()
                be = _lazy.lazy_init()
                base = _points(be)[1]
    return runs, failures


def test_keyboard_interrupt_anywhere_in_xpu_streams_events_and_copies(monkeypatch, traced):
    use_sim(monkeypatch, "xpu")
    be = _lazy.lazy_init()
    assert be.count() >= 2
    runs, failures = _sweep(be, _STRIDE)
    tib._report("xpu streams/events/copies (r37)", runs, failures, [])
    assert runs > 100
    assert not failures, "\n".join(map(str, failures[:8])) + f"\n({len(failures)} of {runs} runs)"


traced = tib.traced
