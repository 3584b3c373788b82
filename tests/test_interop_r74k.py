"""Review (r74k) of the interop code session 34 added and session 35 reshaped (5535ba1):
``_dlpack.ordering.order_after_other_uses`` / ``_order_after_one`` / ``_host_wait``, ``_dlpack.importing.to_address``,
``Buffer.__cuda_array_interface__`` / ``__dlpack__`` / ``from_dlpack``, ``streams._ExportMark`` /
``_drop_export_mark`` and the allocators' ``stream_uses``.

Each accel bug was a strict xfail naming where it is; the rest pins what was checked and found
right.  Work is on device 1 (the non-current device) unless device 0 is the point.

Found: ``Buffer._drained`` (the closed streams an export already waited for) keys them by ``id()``:
of the allocator's gates/marks for an owning buffer (``stream_uses``' ``gone`` keys), of the Stream
objects for a non-owning one.  Those objects die while the buffer lives (empty_cache drops a
completed gate; ``Buffer._used`` keeps one closed stream per device once a handle is reused), so the
set grows by one int per closed stream for the buffer's life, and a new gate or Stream at a freed
one's address is taken as already waited for: the exported stream is not ordered after its work.
Fixed in session 35 (strict xfails first): the entries are held weakly, so one goes with its object.
"""

import gc
import threading

import numpy as np
import pytest

import accel
from accel import _dlpack, _lazy, sim
from accel import streams as _streams
from conftest import SIMS, use_sim
from torch_port_util import hold

D1 = 1


def _cuda(monkeypatch, **env):
    if "cuda" not in SIMS:
        pytest.skip("ACCEL_TEST_SIMS leaves out cuda")
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DEVICES=2, ACCEL_SIM_DELAY_US=50, **env)


@pytest.fixture
def d1(monkeypatch):
    _cuda(monkeypatch)
    return D1


def _done(handle, index):
    backend = _lazy.lazy_init()
    with _streams.on_device(backend, index):
        return backend.stream_query(handle)


def _export_in_thread(fn, wait=0.4):
    """``fn()`` in a thread; (finished within ``wait`` s, [result])."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(wait)
    return t, out


def _closed_use(buf, index):
    """A fresh stream of ``index`` that used ``buf`` (recorded) with work still queued, then closed
    (the allocator turns the use into a gate/mark).  Returns the gate to release that work."""
    s = accel.Stream(index)
    gate = hold(s)
    buf.record_stream(s)
    s.close()
    return gate


# -- Buffer._drained: the keys of the allocator's dropped gates --------------------------------------

# (r74k found; fixed in session 35)
@pytest.mark.parametrize("conf", ["native", "cudaMallocAsync"])
def test_drained_state_is_bounded_by_the_live_gates(monkeypatch, conf):
    env = {} if conf == "native" else {"ACCEL_ALLOC_CONF": "backend:cudaMallocAsync",
                                       "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    _cuda(monkeypatch, **env)
    w = accel.Stream(D1)
    buf = accel.Buffer(256, device=D1, stream=w).fill_(1, stream=w)
    alloc = accel.memory.device_allocator(D1)
    for _ in range(8):
        gate = _closed_use(buf, D1)
        gate.set()
        buf.record_stream(w)
        buf.__cuda_array_interface__        # the closed stream's work: a device synchronize
        accel.synchronize(D1)
        accel.memory.empty_cache()          # the completed gate leaves the block
    live, gone = alloc.stream_uses(buf.ptr)
    assert gone == []
    assert len(buf._drained or ()) <= len(gone), \
        f"{len(buf._drained)} drained keys for {len(gone)} live gates"
    buf.close()


# (r74k found; fixed in session 35)
def test_a_gate_at_a_recycled_address_is_still_waited_for(d1):
    w = accel.Stream(d1)
    buf = accel.Buffer(256, device=d1, stream=w).fill_(1, stream=w)
    alloc = accel.memory.device_allocator(d1)
    gate = None
    t = None
    try:
        for _ in range(40):
            first = _closed_use(buf, d1)
            first.set()
            buf.record_stream(w)
            buf.__cuda_array_interface__        # the closed stream's gate: waited for, once
            accel.synchronize(d1)
            dropped = {key for key, _ in alloc.stream_uses(buf.ptr)[1]}
            s = accel.Stream(d1)
            gate = hold(s)
            buf.record_stream(s)
            accel.memory.empty_cache()          # the completed gate leaves the block
            s.close()                           # a new gate for s's queued work
            del s
            _, gone = alloc.stream_uses(buf.ptr)
            if any(key in dropped for key, _ in gone):     # the new gate is where the dropped one was
                break
            gate.set()
            gate = None
            accel.synchronize(d1)
        else:
            pytest.skip("no gate landed at a dropped one's address in 40 tries")
        buf.record_stream(w)
        t, out = _export_in_thread(lambda: buf.__cuda_array_interface__["stream"])
        if not t.is_alive():                # not waiting on the host: w must wait for the closed work
            assert out == [w.handle]
            assert not _done(w.handle, d1), "the exported stream does not wait for the closed stream's work"
    finally:
        if gate is not None:
            gate.set()
        if t is not None:
            t.join(10)
    accel.synchronize(d1)
    buf.close()


# (r74k found; fixed in session 35)
def test_a_non_owning_buffer_waits_for_a_new_stream_at_a_dropped_streams_address(d1):
    owner = accel.Buffer(256, device=d1)
    accel.synchronize(d1)
    fb = accel.Buffer.from_ptr(owner.ptr, 256, device=d1, owner=owner)
    w = accel.Stream(d1)
    gate = t = None
    try:
        for _ in range(10):
            s1 = accel.Stream(d1)
            fb.fill_(1, stream=s1)
            s1.close()
            fb.record_stream(w)
            fb.__cuda_array_interface__         # s1 drained (a device synchronize)
            s2 = accel.Stream(d1)               # the driver hands s1's handle on
            fb.fill_(1, stream=s2)
            s2.close()
            fb.__cuda_array_interface__
            s3 = accel.Stream(d1)               # and again: s1 leaves fb's uses
            fb.fill_(1, stream=s3)
            old = id(s1)
            del s1, s2
            gc.collect()
            s4 = accel.Stream(d1)
            if id(s4) == old:
                break
            s3.close()
            s4.close()
        else:
            pytest.skip("no new Stream landed at the dropped one's address")
        accel.synchronize(d1)
        gate = hold(s4)
        fb.fill_(7, stream=s4)                  # queued behind the held operation
        s4.close()
        fb.record_stream(w)
        t, out = _export_in_thread(lambda: fb.__cuda_array_interface__["stream"])
        if not t.is_alive():
            assert out == [w.handle]
            assert not _done(w.handle, d1), "the exported stream does not wait for the closed s4's fill"
    finally:
        if gate is not None:
            gate.set()
        if t is not None:
            t.join(10)
    accel.synchronize(d1)
    fb.close()
    owner.close()


# -- 3+ streams on both devices ----------------------------------------------------------------------

@pytest.mark.parametrize("how", ["cai", "dlpack_handle", "dlpack_stream", "dlpack_legacy"])
def test_export_orders_after_work_on_three_streams_and_the_other_device(d1, how):
    w = accel.Stream(d1)
    a, b, c = (accel.Stream(d1) for _ in range(3))
    o = accel.Stream(0)                     # a stream of the other device, recorded on the buffer
    buf = accel.Buffer(256, device=d1, stream=a).fill_(1, stream=a)
    accel.synchronize(d1)
    gates = [hold(s) for s in (a, b, c, o)]
    t = None
    try:
        buf.record_stream(b)                # (the held operations stand for work on the buffer)
        buf.record_stream(c)
        buf.record_stream(o)
        buf.fill_(4, stream=w)              # last use: w, queued behind nothing
        if how == "cai":
            export = lambda: buf.__cuda_array_interface__["stream"]     # noqa: E731
            target = w.handle
        elif how == "dlpack_handle":
            z = accel.Stream(d1)
            export = lambda: buf.__dlpack__(stream=z.handle) and z.handle    # noqa: E731
            target = z.handle
        elif how == "dlpack_stream":
            z = accel.Stream(d1)
            export = lambda: buf.__dlpack__(stream=z) and z.handle    # noqa: E731
            target = z.handle
        else:
            export = lambda: buf.__dlpack__(stream=1) and 0    # noqa: E731
            target = 0
        t, out = _export_in_thread(export)
        if not t.is_alive():                # no host wait: the stream named must wait on the device
            assert out == [target]
            assert not _done(target, d1), "the exported stream does not wait for the other streams' work"
    finally:
        for g in gates:
            g.set()
        if t is not None:
            t.join(10)
    accel.synchronize(0)
    accel.synchronize(d1)
    assert set(buf.to_numpy().tolist()) == {4}
    buf.close()


def test_stream_closed_between_use_and_export_is_waited_for(d1):
    s, z = accel.Stream(d1), accel.Stream(d1)
    buf = accel.Buffer(256, device=d1, stream=s).fill_(1, stream=s)
    accel.synchronize(d1)
    gate = hold(s)
    buf.fill_(9, stream=s)
    s.close()
    try:
        t, out = _export_in_thread(lambda: buf.__dlpack__(stream=z.handle))
        finished = not t.is_alive()
    finally:
        gate.set()
        t.join(10)
    assert not finished, "the export returned before the closed stream's queued fill ran"
    assert buf.last_stream == z
    assert set(buf.to_numpy().tolist()) == {9}
    buf.close()


# -- captures of another stream ------------------------------------------------------------------------

def _capture(index, body, mode="global"):
    s0 = accel.Stream(index)
    x0 = accel.Buffer(256, device=index, stream=s0)
    g = accel.Graph(capture_error_mode=mode)
    with s0:
        g.capture_begin()
        try:
            x0.fill_(1, stream=s0)
            out = body()
        finally:
            g.capture_end()
    g.replay()
    accel.synchronize(index)
    assert set(x0.to_numpy().tolist()) == {1}      # the capture stayed valid
    return out


@pytest.mark.parametrize("where", [0, 1])
def test_exports_during_a_global_capture_of_another_stream(d1, where):
    w, a, z = accel.Stream(d1), accel.Stream(d1), accel.Stream(d1)
    buf = accel.Buffer(256, device=d1, stream=a).fill_(5, stream=a)
    a.synchronize()
    buf.fill_(6, stream=w)
    accel.synchronize(d1)
    live0 = _dlpack.live_exports()

    def body():
        cai = buf.__cuda_array_interface__
        cap = buf.__dlpack__(stream=z.handle)
        return cai, cap
    cai, cap = _capture(where, body)
    assert cai["stream"] == w.handle and buf.last_stream == z
    del cap
    assert _dlpack.live_exports() == live0
    assert set(buf.to_numpy().tolist()) == {6}
    buf.close()


def test_legacy_consumer_during_a_same_device_capture_is_refused_cleanly(d1):
    w = accel.Stream(d1)
    buf = accel.Buffer(256, device=d1, stream=w).fill_(6, stream=w)
    accel.synchronize(d1)
    refused = []

    def body():
        try:
            buf.__dlpack__(stream=None)
        except accel.CaptureError as exc:
            refused.append(exc)
    _capture(d1, body)
    assert set(buf.to_numpy().tolist()) == {6}
    buf.close()


# -- repeated exports: state bounded by live objects ---------------------------------------------------

def test_repeated_exports_leave_no_events_marks_or_exports(d1):
    w, s = accel.Stream(d1), accel.Stream(d1)
    buf = accel.Buffer(256, device=d1, stream=w).fill_(1, stream=w)
    buf.record_stream(s)
    accel.synchronize(d1)
    buf.__cuda_array_interface__
    buf.__dlpack__(stream=s.handle)
    gc.collect()
    accel.synchronize(d1)
    events, exports = sim.state().events, _dlpack.live_exports()
    for i in range(20):
        buf.fill_(i, stream=s if i % 2 else w)
        cap = buf.__dlpack__(stream=w.handle if i % 2 else s.handle)
        buf.__cuda_array_interface__
        view = buf.as_array("uint8", (64,), offset=64)
        view.__cuda_array_interface__
        capv = view.__dlpack__(stream=-1, max_version=(1, 0))
        del cap, capv, view
    gc.collect()
    accel.synchronize(d1)
    assert _dlpack.live_exports() == exports
    assert sim.state().events <= events
    assert len(s._busy) + len(w._busy) <= 2        # a live CAI mark per stream exported (r73e: CAI v3 lifetime)
    buf.close()
    assert not s._busy and not w._busy


def test_cai_mark_defers_the_close_until_buffer_close_then_destroys(d1):
    s = accel.Stream(d1)
    buf = accel.Buffer(256, device=d1, stream=s).fill_(3, stream=s)
    for _ in range(5):
        handle = buf.__cuda_array_interface__["stream"]
    assert len(s._busy) == 1
    streams0 = sim.state().streams
    s.close()
    assert sim.state().streams == streams0          # held back by the mark
    buf.close()
    assert sim.state().streams == streams0 - 1 and not s._busy and not s._releases
    assert handle == s._handle


# -- __dlpack__(stream=...) values on each backend ----------------------------------------------------

def test_dlpack_stream_values_on_each_backend(sim_backend):
    index = 1 if accel.device_count() > 1 else 0
    s = accel.Stream(index)
    buf = accel.Buffer(64, device=index, stream=s).fill_(7, stream=s)
    ok = [None, -1, s] + ([1, 2, s.handle] if sim_backend == "cuda" else [])
    bad = [0] + ([] if sim_backend == "cuda" else [1, 2])
    for value in ok:
        cap = buf.__dlpack__(stream=value)
        t = _dlpack.parse(cap)
        assert (t.device_type, t.device_id) == buf.__dlpack_device__()
        del cap, t
    for value in bad:
        with pytest.raises(ValueError):
            buf.__dlpack__(stream=value)
    for value in (True, 1.0, "1"):
        with pytest.raises(TypeError):
            buf.__dlpack__(stream=value)
    accel.synchronize(index)
    assert set(buf.to_numpy().tolist()) == {7}
    buf.close()


# -- from_dlpack of accel's own capsule, views, non-owning buffers --------------------------------------

def test_own_capsule_consumed_twice(sim_backend):
    index = 1 if accel.device_count() > 1 else 0
    buf = accel.Buffer(128, device=index).fill_(4)
    live0 = _dlpack.live_exports()
    cap = buf.__dlpack__(max_version=(1, 0))
    fb = accel.from_dlpack(cap)
    with pytest.raises(BufferError):
        accel.from_dlpack(cap)
    assert _dlpack.live_exports() == live0 + 1      # the refused second take released nothing
    assert fb.ptr == buf.ptr and fb.nbytes == 128 and not fb.owns_memory
    assert set(fb.to_numpy().tolist()) == {4}
    buf.close()                             # pinned: the memory stays for fb
    fb.fill_(8)
    assert set(fb.to_numpy().tolist()) == {8}
    fb.close()
    del cap
    gc.collect()
    assert _dlpack.live_exports() == live0
    assert not buf._pins and not buf._deferred


def test_view_slice_round_trip(sim_backend):
    index = 1 if accel.device_count() > 1 else 0
    buf = accel.Buffer(256, device=index)
    buf.copy_from(np.arange(256, dtype=np.uint8))
    view = buf.as_array("int32", (4, 4), strides=(32, 4), offset=64)   # rows with gaps
    fb = accel.from_dlpack(view)
    assert fb.ptr == buf.ptr + 64 and fb.nbytes == 3 * 32 + 16
    assert fb.to_numpy().tolist() == list(range(64, 64 + fb.nbytes))
    t = _dlpack.parse(view.__dlpack__(max_version=(1, 0)))
    _dlpack.to_address(_lazy.lazy_init(), t)
    assert t.data + t.byte_offset == buf.ptr + 64 and t.strides == (8, 1) and t.shape == (4, 4)
    del t
    fb.close()
    buf.close()


def test_non_owning_buffer_exports_order_after_its_streams(d1):
    owner = accel.Buffer(256, device=d1).fill_(1)
    accel.synchronize(d1)
    fb = accel.Buffer.from_ptr(owner.ptr, 256, device=d1, owner=owner)
    a, b, w, z = (accel.Stream(d1) for _ in range(4))
    gates = [hold(a), hold(b)]
    t = None
    try:
        fb.fill_(2, stream=a)
        fb.record_stream(b)
        fb.record_stream(w)
        t, out = _export_in_thread(lambda: fb.__dlpack__(stream=z.handle) and z.handle)
        if not t.is_alive():
            assert not _done(z.handle, d1), "the consumer stream does not wait for a and b"
    finally:
        for g in gates:
            g.set()
        if t is not None:
            t.join(10)
    accel.synchronize(d1)
    assert set(fb.to_numpy().tolist()) == {2}
    fb.close()
    owner.close()


def test_export_then_close_keeps_memory_until_the_consumer_is_done(d1):
    s, z = accel.Stream(d1), accel.Stream(d1)
    buf = accel.Buffer(1 << 20, device=d1, stream=s).fill_(5, stream=s)
    before = accel.memory.memory_allocated(d1)
    cap = buf.__dlpack__(stream=z.handle)
    buf.close()
    assert accel.memory.memory_allocated(d1) == before      # the capsule pins it
    fb = accel.from_dlpack(cap, stream=z)
    gate = hold(z)
    t = None
    try:
        fb.fill_(6, stream=z)                               # consumer work still queued
        t, _ = _export_in_thread(fb.close, 0.3)
        assert t.is_alive() or accel.memory.memory_allocated(d1) == before, \
            "the memory went back while the consumer's fill was queued"
    finally:
        gate.set()
        if t is not None:
            t.join(10)
    del cap
    gc.collect()
    assert accel.memory.memory_allocated(d1) == before - (1 << 20)
    assert _dlpack.live_exports() == 0


def test_capsules_of_a_closed_buffer_hand_the_memory_back_once(sim_backend):
    index = 1 if accel.device_count() > 1 else 0
    before = accel.memory.memory_allocated(index)
    buf = accel.Buffer(1 << 16, device=index).fill_(3)
    other = accel.Stream(index)
    unused = buf.__dlpack__(max_version=(1, 0))             # dropped unconsumed below
    taken = buf.__dlpack__(stream=other)                    # consumed after the close
    buf.close()
    assert accel.memory.memory_allocated(index) == before + (1 << 16)
    del unused
    gc.collect()
    assert accel.memory.memory_allocated(index) == before + (1 << 16)
    fb = accel.from_dlpack(taken, stream=other)
    assert set(fb.to_numpy(stream=other).tolist()) == {3}
    fb.close()
    fb.close()
    del taken
    gc.collect()
    assert accel.memory.memory_allocated(index) == before
    assert _dlpack.live_exports() == 0


def test_dlpack_consumer_on_the_other_device(sim_backend):
    s0 = accel.Stream(0)
    s1 = accel.Stream(accel.device_count() - 1)
    buf = accel.Buffer(256, device=s1.device_index, stream=s1).fill_(2, stream=s1)
    cap = buf.__dlpack__(stream=s0)
    assert buf.last_stream == s0
    assert _dlpack.parse(cap).device_id == s1.device_index
    buf.fill_(5, stream=s1)             # back on its own device's stream
    accel.synchronize(s1.device_index)
    assert set(buf.to_numpy().tolist()) == {5}
    del cap
    buf.close()
