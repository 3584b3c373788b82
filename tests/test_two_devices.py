"""Two simulated devices on every runtime that has two: work on the device that is not
current, copies between devices, pinned copies to both devices in turn, the default
stream of the other device, per-device memory stats, and the current device left
unchanged by every operation.

On real hardware a stream, event, launch or graph replay only works with its own
device current (CUDA Runtime API, cudaLaunchKernel / cudaEventRecord: a stream of
another device is cudaErrorInvalidResourceHandle), so accel must switch to the
object's device for each call and switch back.  The simulators enforce that; these
tests drive accel from the *other* device.  ``ACCEL_SIM_DELAY_US`` makes every queued
operation slow, so an operation issued to the wrong stream, or without the wait it
needs, shows up as wrong data rather than passing by luck.

Metal exposes one device (``MTLCreateSystemDefaultDevice``; torch.mps has one too), so
on mps the tests skip with that reason.
"""

import numpy as np
import pytest

import accel
from accel.random import philox

from conftest import SIMS, use_sim

N = 1 << 16      # bytes per buffer: big enough that a delayed copy is visibly incomplete
DELAY_US = 200   # per simulated stream operation


def _pattern(nbytes: int, salt: int = 0) -> np.ndarray:
    words = (np.arange((nbytes + 3) // 4, dtype=np.uint32) + np.uint32(salt)) * np.uint32(2654435761)
    return words.view(np.uint8)[:nbytes].copy()


@pytest.fixture(params=SIMS)
def backend2(request, monkeypatch):
    """A simulated runtime with two devices and a per-operation delay; skips where there is one."""
    kind = use_sim(monkeypatch, request.param, ACCEL_SIM_DELAY_US=DELAY_US)
    if accel.device_count() < 2:
        pytest.skip(f"{kind}: the simulated runtime exposes {accel.device_count()} device "
                    "(Metal has one system default device, as torch.mps)")
    return kind


@pytest.fixture(params=[s for s in SIMS if s != "mps"])
def graph_backend2(request, monkeypatch):
    kind = use_sim(monkeypatch, request.param, ACCEL_SIM_DELAY_US=DELAY_US)
    assert accel.device_count() >= 2, f"{kind} simulator should default to 2 devices"
    return kind


class Current:
    """Assert the current device is ``index`` now and at every ``check()``."""

    def __init__(self, index: int):
        accel.set_device_index(index)
        self.index = index

    def check(self, what: str = "") -> None:
        got = accel.current_device_index()
        assert got == self.index, f"{what} changed the current device from {self.index} to {got}"


def _other(current: int) -> int:
    return 1 - current


def test_default_config_has_two_devices_where_the_runtime_has_them(sim_backend):
    # cuda and xpu: ACCEL_SIM_DEVICES defaults to 2; Metal: one system default device
    assert accel.device_count() == (1 if sim_backend == "mps" else 2)


# -- streams, events, fills, copies on the other device ---------------------------------
@pytest.mark.parametrize("current", [0, 1])
def test_stream_work_on_the_other_device(backend2, current):
    cur = Current(current)
    other = _other(current)
    s = accel.Stream(other)
    cur.check("Stream(other)")
    assert s.device_index == other
    buf = accel.Buffer(N, stream=s)
    cur.check("Buffer on the other device")
    host = _pattern(N)
    buf.copy_from(host, stream=s)
    cur.check("copy_from")
    for v in range(1, 6):            # a queue of delayed fills: the read must come after all of them
        buf.fill_(v, s)
    cur.check("fill_")
    s.query()
    cur.check("Stream.query")
    got = buf.to_numpy(stream=s)
    cur.check("to_numpy")
    assert (got == 5).all(), f"read saw {int((got != 5).sum())} stale bytes"
    s.synchronize()
    assert s.query()
    cur.check("Stream.synchronize")
    accel.synchronize(other)
    cur.check("accel.synchronize(other)")
    buf.close()
    s.close()
    cur.check("close")


@pytest.mark.parametrize("current", [0, 1])
def test_events_order_two_streams_of_the_other_device(backend2, current):
    cur = Current(current)
    other = _other(current)
    s1, s2 = accel.Stream(other), accel.Stream(other)
    a, b = accel.Buffer(N, stream=s1), accel.Buffer(N, stream=s2)
    b.fill_(0, s2)
    for v in range(1, 9):            # a long chain on s1 that s2 would overtake without the wait
        a.fill_(v, s1)
    e = accel.Event()
    e.record(s1)
    cur.check("Event.record on the other device")
    assert e.device.index == other
    s2.wait_event(e)
    cur.check("wait_event")
    b.copy_from(a, stream=s2, non_blocking=True)
    got = b.to_numpy(stream=s2)
    assert (got == 8).all(), f"copy after wait_event saw {int((got != 8).sum())} bytes not 8"
    e.synchronize()
    assert e.query()
    cur.check("Event.synchronize/query")
    # wait_stream, then timing events, all on the other device
    for v in range(10, 14):
        a.fill_(v, s1)
    s2.wait_stream(s1)
    cur.check("wait_stream")
    b.copy_from(a, stream=s2, non_blocking=True)
    assert (b.to_numpy(stream=s2) == 13).all()
    start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    start.record(s1)
    a.fill_(1, s1)
    end.record(s1)
    assert start.elapsed_time(end) >= 0
    cur.check("elapsed_time")
    for x in (a, b, e, start, end):
        x.close()
    s1.close()
    s2.close()
    cur.check("close")


@pytest.mark.parametrize("current", [0, 1])
def test_default_stream_of_the_other_device(backend2, current):
    cur = Current(current)
    other = _other(current)
    d = accel.default_stream(other)
    cur.check("default_stream(other)")
    assert d.device_index == other and d == accel.current_stream(other)
    buf = accel.Buffer(N, other)          # allocated for the other device's default stream
    assert buf.stream == d
    for v in range(1, 6):
        buf.fill_(v, d)
    cur.check("fill_ on the other default stream")
    e = accel.Event()
    e.record(d)
    cur.check("Event.record on the other default stream")
    side = accel.Stream(other)
    side.wait_event(e)
    out = accel.Buffer(N, stream=side)
    out.copy_from(buf, stream=side, non_blocking=True)
    assert (out.to_numpy(stream=side) == 5).all()
    host = _pattern(N, 7)
    buf.copy_from(host, stream=d)
    cur.check("copy_from on the other default stream")
    d.query()
    d.synchronize()
    assert d.query()
    cur.check("default stream query/synchronize")
    assert np.array_equal(buf.to_numpy(stream=d), host)
    cur.check("to_numpy on the other default stream")
    for x in (buf, out, e):
        x.close()
    side.close()


def test_current_stream_of_the_other_device_is_kept_per_device(backend2):
    cur = Current(0)
    s1 = accel.Stream(1)
    accel.set_stream(s1)                  # switches to device 1, as torch
    assert accel.current_device_index() == 1
    accel.set_device_index(0)
    assert accel.current_stream(1) == s1 and accel.current_stream(0) == accel.default_stream(0)
    buf = accel.Buffer(N, 1)              # current stream of device 1, from device 0
    assert buf.stream == s1
    buf.fill_(9)
    assert (buf.to_numpy() == 9).all()
    cur.check("buffer on the other device's current stream")
    buf.close()


# -- copies between devices --------------------------------------------------------------------
@pytest.mark.parametrize("current", [0, 1])
def test_copy_between_devices(backend2, current):
    cur = Current(current)
    s0, s1 = accel.Stream(0), accel.Stream(1)
    a = accel.Buffer(N, stream=s0)
    b = accel.Buffer(N, stream=s1)
    host = _pattern(N, 3)
    a.copy_from(host, stream=s0)
    b.fill_(0, s1)
    s1.synchronize()
    b.copy_from(a, stream=s1)            # device 0 -> device 1, blocking
    cur.check("copy device 0 -> device 1")
    assert np.array_equal(b.to_numpy(stream=s1), host), "device 0 -> device 1 copy lost data"
    a.fill_(0, s0)
    s0.synchronize()
    a.copy_from(b, stream=s0)            # device 1 -> device 0
    cur.check("copy device 1 -> device 0")
    assert np.array_equal(a.to_numpy(stream=s0), host), "device 1 -> device 0 copy lost data"
    # non_blocking, ordered by an event of the source device's stream
    for v in range(1, 6):
        a.fill_(v, s0)
    e = accel.Event()
    e.record(s0)
    s1.wait_event(e)
    b.copy_from(a, stream=s1, non_blocking=True)
    cur.check("non_blocking copy device 0 -> device 1")
    got = b.to_numpy(stream=s1)
    assert (got == 5).all(), f"cross-device copy after wait_event saw {int((got != 5).sum())} stale bytes"
    s0.synchronize()
    for x in (a, b, e):
        x.close()
    s0.close()
    s1.close()
    cur.check("close")


# -- pinned (non_blocking) copies to both devices in turn ------------------------------------------
@pytest.mark.parametrize("current", [0, 1])
def test_pinned_copies_to_both_devices_in_turn(backend2, current):
    cur = Current(current)
    # one at a time: each copy's staging block (and its event) is done before the next copy
    for i, dev in enumerate([0, 1, 0, 1]):
        host = _pattern(N, i)
        buf = accel.Buffer(N, dev).copy_from(host, non_blocking=True)
        cur.check(f"non_blocking copy to device {dev}")
        assert np.array_equal(buf.to_numpy(), host), f"pinned copy to device {dev} lost data"
        buf.close()
    # all in flight at once
    bufs = []
    for i, dev in enumerate([0, 1, 0, 1, 1, 0]):
        host = _pattern(N, i)
        buf = accel.Buffer(N, dev).copy_from(host, non_blocking=True)
        cur.check(f"non_blocking copy to device {dev}")
        host[:] = 0                       # staging means the source may be reused at once
        bufs.append((buf, _pattern(N, i)))
    for buf, want in bufs:
        got = buf.to_numpy()
        assert np.array_equal(got, want), f"pinned copy to device {buf.device_index} lost data"
        buf.close()
    cur.check("to_numpy")
    accel.synchronize(0)
    accel.synchronize(1)
    accel.memory.empty_host_cache()
    host = accel.memory.host_allocator().stats()
    assert (host["allocated_bytes"], host["reserved_bytes"]) == (0, 0), f"pinned staging blocks leaked: {host}"
    assert accel.sim.state().host_allocations == 0, "pinned staging blocks leaked"


# -- RNG fills on the other device ------------------------------------------------------------------
@pytest.mark.parametrize("current", [0, 1])
def test_rng_fill_on_the_other_device(backend2, current):
    import accel.random as R
    cur = Current(current)
    other = _other(current)
    R.manual_seed(1234)
    gen = R.default_generator(other)
    n = 4096
    buf = accel.Buffer(4 * n, other)
    buf.fill_(0)
    offset = gen.offset
    R.random_raw_(buf)
    cur.check("random_raw_ on the other device")
    got = buf.to_numpy("uint32")
    want = philox.raw_words(gen.initial_seed(), offset, n)
    assert np.array_equal(got, want), f"{int((got != want).sum())} words differ from the host Philox stream"
    f = accel.Buffer(4 * n, other)
    R.uniform_(f, "float32", -1.0, 1.0)
    vals = f.to_numpy("float32")
    assert ((vals >= -1) & (vals < 1)).all() and len(set(vals.tolist())) > n // 2
    cur.check("uniform_ on the other device")
    # the other device's generator is the one that advanced
    assert R.default_generator(current).offset == 0
    buf.close()
    f.close()


# -- graphs on the other device ----------------------------------------------------------------------
@pytest.mark.parametrize("current", [0, 1])
def test_graph_replay_on_the_other_device(graph_backend2, current):
    other = _other(current)
    s = accel.Stream(other)
    a, b = accel.Buffer(N, stream=s), accel.Buffer(N, stream=s)
    a.fill_(0, s)
    b.fill_(0, s)
    s.synchronize()
    g = accel.Graph()
    accel.set_device_index(current)
    with s, g:                            # capture happens with the stream's device current
        a.fill_(1, s)
        b.copy_from(a, s, non_blocking=True)
        a.fill_(2, s)
    cur = Current(current)
    cur.check("capture on the other device")
    assert not b.to_numpy(stream=s).any(), "capture executed the work"
    # replay from `current` onto the other device's current stream: first its default stream,
    # then a side stream made current for that device
    side = accel.Stream(other)
    for replay_stream in (accel.default_stream(other), side):
        a.fill_(9, replay_stream)
        b.fill_(9, replay_stream)
        if replay_stream is side:
            accel.set_stream(side)
            accel.set_device_index(current)
        assert accel.current_stream(other) == replay_stream
        g.replay()
        cur.check("Graph.replay on the other device")
        got_a, got_b = a.to_numpy(stream=replay_stream), b.to_numpy(stream=replay_stream)
        assert (got_a == 2).all() and (got_b == 1).all(), \
            f"replay on {replay_stream}: a={got_a[0]} b={got_b[0]}, expected 2 and 1"
    g.reset()
    for x in (a, b):
        x.close()


@pytest.mark.parametrize("current", [0, 1])
def test_captured_rng_replays_on_the_other_device(graph_backend2, current):
    import accel.random as R
    from accel import _lazy
    from accel.random import _device
    other = _other(current)
    if not _device.kernel_functions(_lazy.lazy_init(), other):
        pytest.skip(f"{graph_backend2} has no Philox kernel to capture")
    R.manual_seed(99)
    gen = R.default_generator(other)
    s = accel.Stream(other)
    r = accel.Buffer(4 * 1024, stream=s)
    g = accel.Graph()
    with s, g:
        R.random_raw_(r)
    cur = Current(current)
    seen = set()
    for i in range(3):
        offset = gen.offset
        g.replay()                        # on the current stream of the graph's device
        cur.check("replay of a captured RNG fill")
        got = r.to_numpy("uint32", stream=accel.current_stream(other))
        assert np.array_equal(got, philox.raw_words(gen.initial_seed(), offset, 1024)), f"replay {i}"
        seen.add(int(got[0]))
    assert len(seen) == 3
    g.reset()
    r.close()


# -- memory stats per device --------------------------------------------------------------------------
@pytest.mark.parametrize("current", [0, 1])
def test_memory_stats_are_per_device(backend2, current):
    cur = Current(current)
    other = _other(current)
    base_cur = accel.memory.memory_allocated(current)
    bufs = [accel.Buffer(1 << 20, other) for _ in range(3)]
    cur.check("allocating on the other device")
    assert accel.memory.memory_allocated(other) == 3 << 20
    assert accel.memory.memory_allocated(current) == base_cur
    assert accel.memory.memory_stats(other)["allocation.all.current"] == 3
    assert accel.memory.max_memory_allocated(other) == 3 << 20
    free, total = accel.memory.get_memory_info(other)
    assert 0 < free < total
    cur.check("memory queries of the other device")
    for b in bufs:
        b.close()
    accel.synchronize(other)
    assert accel.memory.memory_allocated(other) == 0
    assert accel.memory.memory_reserved(other) > 0        # cached
    accel.memory.empty_cache()
    assert accel.memory.memory_reserved(other) == 0
    assert accel.memory.memory_stats(other)["allocation.all.allocated"] == 3
    assert accel.memory.memory_stats(current)["allocation.all.allocated"] == 0
    cur.check("empty_cache")
