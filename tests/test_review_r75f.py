"""r75f: review of the r75a fixes (CAI export marks per stream, DLPack refusal of a consumer
outside a capture, Graph.replay noting the captured buffers on the replay stream), at their edges:
bounded state, threads, reset/recapture, recycled handles, device 1 non-current, graph-pool and
non-owning buffers, XPU."""

import gc
import sys
import threading

import pytest

import accel
from accel import _dlpack as D
from accel import _finalize as _fin

from conftest import SIMS, use_sim
from torch_port_util import hold

DEV = 1
N = 256


@pytest.fixture
def cuda(monkeypatch):
    if "cuda" not in SIMS:
        pytest.skip("ACCEL_TEST_SIMS leaves out cuda")
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=50)
    accel.set_device_index(0)
    return accel._lazy.lazy_init()


@pytest.fixture
def xpu(monkeypatch):
    if "xpu" not in SIMS:
        pytest.skip("ACCEL_TEST_SIMS leaves out xpu")
    use_sim(monkeypatch, "xpu")
    accel.set_device_index(0)
    return accel._lazy.lazy_init()


def _alive(handle):
    from accel.sim import cudart
    return handle in cudart._R.streams


def _capture(g, stream, body):
    with stream:
        g.capture_begin()
        try:
            body()
        finally:
            g.capture_end()


def _uses(buf):
    """The (handle, device) uses the allocator noted on an owned buffer."""
    live, gone = buf._alloc.stream_uses(buf.ptr)
    return sorted(live), len(gone)


# -- CAI export marks ---------------------------------------------------------------------------

def test_cai_many_short_lived_streams_closed_while_exported_destroyed_at_buffer_close(cuda):
    with accel.device_index(DEV):
        buf = accel.Buffer(N)
        handles = []
        for i in range(20):
            s = accel.Stream()
            buf.fill_(i, stream=s)
            assert buf.__cuda_array_interface__["stream"] == s.handle
            assert buf.__cuda_array_interface__["stream"] == s.handle     # again: no second mark
            assert len(s._busy) == 1
            handles.append(s.handle)
            s.close()
            del s
        gc.collect()
        assert len(buf._export) == 20
        assert all(_alive(h) for h in handles)
        buf.close()
        assert buf._export is None
        accel.synchronize()
        assert not any(_alive(h) for h in handles)


def test_cai_marks_released_when_the_buffer_is_collected_unclosed(cuda):
    with accel.device_index(DEV):
        buf = accel.Buffer(N)
        streams = [accel.Stream() for _ in range(3)]
        for i, s in enumerate(streams):
            buf.fill_(i, stream=s)
            buf.__cuda_array_interface__
        handles = [s.handle for s in streams]
        for s in streams:
            s.close()
        assert all(_alive(h) for h in handles)
        del buf, streams, s
        gc.collect()
        _fin.drain()                    # the marks' deferred destroys
        accel.synchronize()
        assert not any(_alive(h) for h in handles)


def test_cai_exports_from_several_threads_keep_every_stream_alive(cuda):
    """Threads exporting one buffer, each after a use on its own stream (the marks' dict made by
    a first export: its creation racing is test_cai_two_first_exports_at_once_...)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for _ in range(3):
            with accel.device_index(DEV):
                buf = accel.Buffer(N)
                streams = [accel.Stream() for _ in range(8)]
                buf.fill_(0, stream=streams[0])
                first = buf.__cuda_array_interface__["stream"]
                accel.synchronize()
            barrier = threading.Barrier(len(streams))
            errors, exported = [], {first}

            def export(s):
                try:
                    barrier.wait()
                    for _ in range(10):
                        buf.record_stream(s)
                        exported.add(buf.__cuda_array_interface__["stream"])
                except BaseException as exc:      # pragma: no cover
                    errors.append(exc)

            threads = [threading.Thread(target=export, args=(s,)) for s in streams]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors
            by_handle = {s.handle: s for s in streams}
            assert exported <= set(by_handle)
            assert {id(by_handle[h]) for h in exported} == set(buf._export)
            assert all(len(s._busy) == (s.handle in exported) for s in streams), \
                "an exported stream is not kept alive (or is marked twice)"
            handles = list(exported)
            for s in streams:
                s.close()
            assert all(_alive(h) for h in handles)
            buf.close()
            accel.synchronize(DEV)
            assert not any(_alive(h) for h in handles)
    finally:
        sys.setswitchinterval(old)


# -- Graph.replay noting -------------------------------------------------------------------------

def _graph_on(s, buf, value=7):
    g = accel.Graph()
    _capture(g, s, lambda: buf.fill_(value))
    return g


def test_replay_loop_grows_nothing_per_replay(cuda):
    from accel.streams import _capture_events
    with accel.device_index(DEV):
        s, r = accel.Stream(), accel.Stream()
        owned = accel.Buffer(N, stream=s)
        base = accel.Buffer(N, stream=s)
        view = accel.Buffer.from_ptr(base.ptr, N, owner=base)
        accel.synchronize()
        g = accel.Graph()

        def body():
            owned.fill_(1)
            view.fill_(2)
        _capture(g, s, body)
        assert len(g._buffers) == 2 and not _capture_events
        with r:
            g.replay()
        g.replay()                  # and the current stream (device 1's default)
        accel.synchronize()
        sizes = (len(g._noted), _uses(owned), len(view._uses), len(r._busy), len(g._buffers))
        for _ in range(50):
            with r:
                g.replay()
            g.replay()
        accel.synchronize()
        assert sizes[0] == 2 and not _capture_events
        assert (len(g._noted), _uses(owned), len(view._uses), len(r._busy), len(g._buffers)) == sizes
        g.reset()
        view.close()
        base.close()
        owned.close()


def test_replay_on_device_1_with_device_0_current_orders_the_consumer(cuda):
    with accel.device_index(DEV):
        s, r, consumer = accel.Stream(), accel.Stream(), accel.Stream()
        buf = accel.Buffer(N, stream=s).fill_(0, stream=s)
        accel.synchronize()
        g = _graph_on(s, buf)
        accel.set_stream(r)
    assert accel.current_device_index() == 0
    gate = hold(r)
    try:
        g.replay()                                  # device 1's current stream: r
        assert (DEV, r.handle) in [(d, h) for h, d in _uses(buf)[0]]
        capsule = buf.__dlpack__(stream=consumer.handle, max_version=(1, 0))
        buf.fill_(9, stream=consumer)
    finally:
        gate.set()
    accel.synchronize(DEV)
    assert set(buf.to_numpy().tolist()) == {9}
    assert accel.current_device_index() == 0
    del capsule
    with accel.device_index(DEV):
        accel.set_stream(accel.default_stream())
    g.reset()
    buf.close()


def test_reset_and_recapture_forgets_the_noted_streams_and_buffers(cuda):
    with accel.device_index(DEV):
        s, r, consumer = accel.Stream(), accel.Stream(), accel.Stream()
        first = accel.Buffer(N, stream=s).fill_(0, stream=s)
        second = accel.Buffer(N, stream=s).fill_(0, stream=s)
        accel.synchronize()
        g = _graph_on(s, first, 1)
        with r:
            g.replay()
        accel.synchronize()
        assert len(g._noted) == 1
        g.reset()
        assert g._buffers is None and g._noted is None
        _capture(g, s, lambda: second.fill_(7))
        assert list(g._buffers.values()) == [second] and g._noted is None
        gate = hold(r)
        try:
            with r:
                g.replay()                          # r again: noted on the new capture's buffer
            assert (r.handle, DEV) in _uses(second)[0]
            capsule = second.__dlpack__(stream=consumer.handle, max_version=(1, 0))
            second.fill_(9, stream=consumer)
        finally:
            gate.set()
        accel.synchronize()
        assert set(second.to_numpy().tolist()) == {9}
        del capsule
        g.reset()
        first.close()
        second.close()


def test_replay_stream_closed_and_a_new_stream_on_its_handle_is_noted_again(cuda):
    with accel.device_index(DEV):
        s, consumer = accel.Stream(), accel.Stream()
        base = accel.Buffer(N, stream=s).fill_(0, stream=s)
        owned = accel.Buffer(N, stream=s).fill_(0, stream=s)
        view = accel.Buffer.from_ptr(base.ptr, N, owner=base)
        accel.synchronize()
        g = accel.Graph()

        def body():
            owned.fill_(7)
            view.fill_(7)
        _capture(g, s, body)
        r = accel.Stream()
        with r:
            g.replay()
        old = r.handle
        r.close()
        accel.synchronize()
        r2 = accel.Stream()
        if r2.handle != old:
            pytest.skip("the simulator gave the new stream another handle")
        with r2:
            g.replay()          # (unheld: the RNG's last use on the closed r is waited for on the host)
        accel.synchronize()
        assert (r2.handle, DEV) in _uses(owned)[0] and r2 in view._uses.values()
        for buf in (owned, view):       # (the closed r's uses: waited for once, on the host)
            buf.__dlpack__(stream=consumer.handle, max_version=(1, 0))
            buf.fill_(7, stream=s)      # s the last use again, r2 another
        gate = hold(r2)
        try:
            with r2:
                g.replay()
            for buf in (owned, view):
                capsule = buf.__dlpack__(stream=consumer.handle, max_version=(1, 0))
                buf.fill_(9, stream=consumer)
                del capsule
        finally:
            gate.set()
        accel.synchronize()
        assert set(owned.to_numpy().tolist()) == {9}
        assert set(view.to_numpy().tolist()) == {9}
        g.reset()
        view.close()
        base.close()
        owned.close()


def test_replays_on_many_short_lived_streams_keep_the_buffers_state_bounded(cuda):
    with accel.device_index(DEV):
        s = accel.Stream()
        owned = accel.Buffer(N, stream=s)
        base = accel.Buffer(N, stream=s)
        view = accel.Buffer.from_ptr(base.ptr, N, owner=base)
        accel.synchronize()
        g = accel.Graph()

        def body():
            owned.fill_(1)
            view.fill_(2)
        _capture(g, s, body)
        sizes = []
        for i in range(40):
            r = accel.Stream()
            with r:
                g.replay()
            r.close()
            del r
            if i % 10 == 9:
                gc.collect()
                accel.synchronize()
                block = owned._alloc._blocks[owned.ptr]
                sizes.append((len(g._noted), len(block.uses or ()), len(view._uses)))
        assert sizes[-1] == sizes[0], f"grows with every short-lived replay stream: {sizes}"
        g.reset()
        view.close()
        base.close()
        owned.close()


# -- DLPack export during a capture --------------------------------------------------------------

def test_dlpack_during_capture_stream_variants(cuda):
    """stream=None/1/2 and a non-capturing stream refused, as one in another (here a foreign,
    raw) capture; -1 and the capturing stream served; the refusals leave both captures going."""
    be = cuda
    with accel.device_index(DEV):
        s, t, outside = accel.Stream(), accel.Stream(), accel.Stream()
        buf = accel.Buffer(N, stream=s).fill_(0, stream=s)
        accel.synchronize()
        live = D.live_exports()
        g = accel.Graph()
        be.capture_begin(t.handle, "relaxed")      # another library's capture on device 1
        try:
            with s:
                g.capture_begin()
            try:
                buf.fill_(3, stream=s)
                for stream, words in ((None, "legacy default"), (1, "legacy default"), (2, "not capturing"),
                                      (outside.handle, "not capturing"), (t.handle, "another stream capture")):
                    with pytest.raises(accel.CaptureError, match=words):
                        buf.__dlpack__(stream=stream, max_version=(1, 0))
                    assert buf.last_stream == s and D.live_exports() == live
                assert be.capture_id(t.handle) is not None and be.capture_id(outside.handle) is None
                unsynced = buf.__dlpack__(stream=-1, max_version=(1, 0))
                own = buf.__dlpack__(stream=s.handle, max_version=(1, 0))
                assert buf.last_stream == s
            finally:
                with s:
                    g.capture_end()
        finally:
            be.graph_destroy(be.capture_end(t.handle))
        del unsynced, own
        gc.collect()
        assert D.live_exports() == live
        g.replay()
        accel.synchronize()
        assert set(buf.to_numpy().tolist()) == {3}
        g.reset()
        buf.close()


def test_graph_pool_buffer_allocated_in_the_capture_orders_a_consumer_after_the_replay(cuda):
    with accel.device_index(DEV):
        s, r, consumer = accel.Stream(), accel.Stream(), accel.Stream()
        accel.synchronize()
        g = accel.Graph()
        made = []
        with s:
            g.capture_begin()
            try:
                made.append(accel.Buffer(N).fill_(7))
            finally:
                g.capture_end()
        buf = made.pop()
        assert list(g._buffers.values()) == [buf]
        with r:
            g.replay()          # (unheld: a first replay on r)
        accel.synchronize()
        gate = hold(r)
        try:
            with r:
                g.replay()
            capsule = buf.__dlpack__(stream=consumer.handle, max_version=(1, 0))
            buf.fill_(9, stream=consumer)
        finally:
            gate.set()
        accel.synchronize()
        assert set(buf.to_numpy().tolist()) == {9}, "the consumer's write ran before the replay's"
        del capsule
        buf.close()
        g.replay()              # the closed pool buffer skipped
        accel.synchronize()
        g.reset()


def test_buffer_closed_between_replays_then_a_new_replay_stream(cuda):
    with accel.device_index(DEV):
        s, r, r2 = accel.Stream(), accel.Stream(), accel.Stream()
        a = accel.Buffer(N, stream=s).fill_(0, stream=s)
        b = accel.Buffer(N, stream=s).fill_(0, stream=s)
        base = accel.Buffer(N, stream=s)
        view = accel.Buffer.from_ptr(base.ptr, N, owner=base)
        accel.synchronize()
        g = accel.Graph()

        def body(a=a, b=b, view=view):
            a.fill_(1)
            b.fill_(2)
            view.fill_(3)
        _capture(g, s, body)
        with r:
            g.replay()
        a.close()
        view.close()
        with r2:
            g.replay()          # a new stream: the closed ones skipped, b noted
        accel.synchronize()
        assert (r2.handle, DEV) in _uses(b)[0]
        assert len(g._buffers) == 3     # (the closed ones stay until collected)
        del a, view, body
        gc.collect()
        assert list(g._buffers.values()) == [b]
        with r:
            g.replay()
        accel.synchronize()
        assert set(b.to_numpy().tolist()) == {2}
        g.reset()
        b.close()
        base.close()


def test_buffer_of_device_0_read_in_a_device_1_capture_orders_its_writer_after_the_replay(cuda):
    src = accel.Buffer(N, device=0).fill_(5)
    accel.synchronize(0)
    with accel.device_index(DEV):
        s, r = accel.Stream(), accel.Stream()
        dst = accel.Buffer(N, stream=s)
        dst.copy_from(src, stream=s)                # (a warm-up: peer access granted before the capture)
        accel.synchronize()
        g = accel.Graph()
        _capture(g, s, lambda: dst.copy_from(src))
        assert src in list(g._buffers.values())
        with r:
            g.replay()
        accel.synchronize()
        assert (r.handle, DEV) in _uses(src)[0]
        gate = hold(r)
        try:
            with r:
                g.replay()                          # reads src, pending
            consumer = accel.Stream(0)
            capsule = src.__dlpack__(stream=consumer.handle, max_version=(1, 0))
            src.fill_(9, stream=consumer)           # the consumer overwrites src on device 0
        finally:
            gate.set()
        accel.synchronize()
    accel.synchronize(0)
    assert set(dst.to_numpy().tolist()) == {5}, "device 0's consumer overwrote src before the replay read it"
    del capsule
    g.reset()
    dst.close()
    src.close()


def test_xpu_replay_notes_the_stream_and_dlpack_in_capture_refuses_another_stream(xpu):
    with accel.device_index(DEV):
        s, r, outside = accel.Stream(), accel.Stream(), accel.Stream()
        buf = accel.Buffer(N, stream=s).fill_(0, stream=s)
        base = accel.Buffer(N, stream=s)
        view = accel.Buffer.from_ptr(base.ptr, N, owner=base)
        accel.synchronize()
        live = D.live_exports()
        g = accel.Graph()
        with s:
            g.capture_begin()
            try:
                buf.fill_(7)
                view.fill_(7)
                with pytest.raises(accel.CaptureError):
                    buf.__dlpack__(stream=outside)
                with pytest.raises(accel.CaptureError):
                    buf.__dlpack__(stream=None)
                own = buf.__dlpack__(stream=s)
                assert D.live_exports() == live + 1
            finally:
                g.capture_end()
        del own
        gc.collect()
        assert D.live_exports() == live
        for _ in range(5):
            with r:
                g.replay()
        accel.synchronize()
        assert (r.handle, DEV) in _uses(buf)[0] and r in view._uses.values()
        assert len(g._noted) == 1
        g.reset()
        view.close()
        base.close()
        buf.close()


# -- CAI exports racing each other / a close() ---------------------------------------------------

def _at_line(fn, text, action):
    """Run ``action()`` once, in this thread, just before ``fn``'s line containing ``text`` runs:
    what another thread could do at a GIL switch there (deterministically)."""
    import inspect
    lines, first = inspect.getsourcelines(fn)
    target = first + next(i for i, line in enumerate(lines) if text in line)
    code, done = fn.__code__, []

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == target and not done:
            done.append(True)
            action()
        return local

    def glob(frame, event, arg):
        return local if frame.f_code is code else None
    return glob, done


# (r75f found; fixed in session 36)
def test_cai_two_first_exports_at_once_both_keep_their_streams(cuda):
    with accel.device_index(DEV):
        a, b = accel.Stream(), accel.Stream()
        buf = accel.Buffer(N)
        buf.fill_(1, stream=a)
        accel.synchronize()
        fget = type(buf).__cuda_array_interface__.fget

        def other_thread():             # thread B's whole export, at thread A's switch
            buf._last = b
            buf.__cuda_array_interface__
            buf._last = a
        tracer, done = _at_line(fget, "with _export_lock:", other_thread)
        sys.settrace(tracer)
        try:
            buf.__cuda_array_interface__            # thread A's export of a
        finally:
            sys.settrace(None)
        assert done
        _fin.drain()
        assert len(a._busy) == 1, "a's mark was lost"
        assert len(b._busy) == 1, "b's mark was lost: b is destroyed by a close() while the buffer lives"
        buf.close()
        a.close()
        b.close()


# (r75f found; fixed in session 36)
def test_cai_export_racing_a_close_leaves_no_mark_behind(cuda):
    with accel.device_index(DEV):
        a = accel.Stream()
        buf = accel.Buffer(N)
        buf.fill_(1, stream=a)
        accel.synchronize()
        fget = type(buf).__cuda_array_interface__.fget
        tracer, done = _at_line(fget, "if mark is not None:", buf.close)    # another thread's close()
        sys.settrace(tracer)
        try:
            buf.__cuda_array_interface__
        finally:
            sys.settrace(None)
        assert done and buf._closed
        handle = a.handle
        a.close()
        accel.synchronize()
        assert not a._busy and not _alive(handle), "the export's mark outlived the buffer's close()"


def test_mps_buffers_keep_no_export_marks_and_dlpack_exports_still_work(monkeypatch):
    if "mps" not in SIMS:
        pytest.skip("ACCEL_TEST_SIMS leaves out mps")
    use_sim(monkeypatch, "mps")
    accel.set_device_index(0)
    s = accel.Stream()
    buf = accel.Buffer(N).fill_(4, stream=s)
    assert not hasattr(buf, "__cuda_array_interface__")
    live = D.live_exports()
    for stream in (None, -1, s):
        capsule = buf.__dlpack__(stream=stream, max_version=(1, 0))
        del capsule
    gc.collect()
    assert D.live_exports() == live and buf._export is None
    with pytest.raises(Exception):
        accel.Graph().capture_begin()
    buf.close()
    s.close()


def test_first_replay_on_a_stream_during_another_devices_capture_leaves_that_capture_valid(cuda):
    with accel.device_index(DEV):
        s, r = accel.Stream(), accel.Stream()
        owned = accel.Buffer(N, stream=s).fill_(0, stream=s)
        base = accel.Buffer(N, stream=s)
        view = accel.Buffer.from_ptr(base.ptr, N, owner=base)
        accel.synchronize()
        g = accel.Graph()

        def body():
            owned.fill_(6)
            view.fill_(6)
        _capture(g, s, body)
    s0 = accel.Stream(0)
    other = accel.Buffer(N, device=0, stream=s0)
    accel.synchronize(0)
    g0 = accel.Graph()
    with s0:
        g0.capture_begin()              # global mode, device 0
        try:
            other.fill_(2)
            with accel.device_index(DEV), r:
                g.replay()              # first replay on r: notes owned and view
            other.fill_(3)
        finally:
            g0.capture_end()
    assert (r.handle, DEV) in _uses(owned)[0] and r in view._uses.values()
    g0.replay()
    accel.synchronize(0)
    accel.synchronize(DEV)
    assert set(other.to_numpy().tolist()) == {3} and set(owned.to_numpy().tolist()) == {6}
    g0.reset()
    g.reset()
    for b in (other, view, base, owned):
        b.close()


def _export_in_capture_then_foreign_write(cuda, via):
    """A buffer accel last used before the capture is exported inside it (``via``) to another
    library, which writes it there (a raw memset on the stream it was given): captured, so each
    replay writes it.  Returns (whether the graph noted the buffer, the bytes after a consumer
    of a later export wrote 9 while the replay was held)."""
    import time
    with accel.device_index(DEV):
        s, r, consumer, forked = accel.Stream(), accel.Stream(), accel.Stream(), accel.Stream()
        buf = accel.Buffer(N, stream=s).fill_(0, stream=s)
        accel.synchronize()
        g = accel.Graph()

        def body():
            if via == "cai":
                cuda.memset_async(buf.ptr, 7, N, buf.__cuda_array_interface__["stream"])
            elif via == "dlpack, the capturing stream":
                buf.__dlpack__(stream=s.handle, max_version=(1, 0))     # (dropped: the writer's work queued)
                cuda.memset_async(buf.ptr, 7, N, s.handle)
            else:
                forked.wait_stream(s)
                capsule = buf.__dlpack__(stream=forked.handle, max_version=(1, 0))
                cuda.memset_async(buf.ptr, 7, N, forked.handle)
                del capsule
                s.wait_stream(forked)
        _capture(g, s, body)
        noted = g._buffers is not None and buf in list(g._buffers.values())
        with r:
            g.replay()
        accel.synchronize()
        gate = hold(r)
        try:
            with r:
                g.replay()
            capsule = buf.__dlpack__(stream=consumer.handle, max_version=(1, 0))
            buf.fill_(9, stream=consumer)
            for _ in range(200):        # (unordered: it runs now; ordered: it waits for the gate)
                if consumer.query():
                    break
                time.sleep(0.001)
        finally:
            gate.set()
        accel.synchronize()
        result = set(buf.to_numpy().tolist())
        del capsule
        g.reset()
        buf.close()
        return noted, result


def test_dlpack_export_inside_a_capture_to_a_forked_stream_notes_the_buffer(cuda):
    assert _export_in_capture_then_foreign_write(cuda, "dlpack, a forked stream") == (True, {9})


# (r75f found; fixed in session 36)
@pytest.mark.parametrize("via", ["cai", "dlpack, the capturing stream"])
def test_export_inside_a_capture_notes_the_buffer_for_replays(cuda, via):
    assert _export_in_capture_then_foreign_write(cuda, via) == (True, {9})
