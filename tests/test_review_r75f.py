"""r75f: review of the r75a fixes (CAI export marks per stream, DLPack refusal of a consumer
outside a capture), at their edges: bounded state, threads, device 1 non-current, XPU.  (Its
tests of replay noting went with that change; replays note their buffers since session 39: tests/test_lead_fixes_s39.py.)"""

import gc
import sys
import threading

import pytest

import accel
from accel import _dlpack as D
from accel import _finalize as _fin

from conftest import SIMS, use_sim

from test_foreign_consumers_r73e import DEV, N, cuda  # noqa: F401  (the fixture: device 1 data, device 0 current)


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
