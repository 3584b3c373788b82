"""r80a: adversarial review of session 39's fixes.

0d072cd (a graph's replay notes the buffers its capture used: accel.buffer.capture.note_captured,
buffer.pins._Noting, kernels._launch, random._device, graphs' replay), 3464460 (Stream.__enter__
reads its saved state after any collection; the block's frame skips contextlib's frames) and
dee3ea4 (the simulated cudaDeviceReset ends what lived in the primary context; driver entry-point
look-ups make no context), seen from accel's public API.
"""

import asyncio
import contextlib
import gc
import threading
import warnings

import numpy as np
import pytest

import accel
from accel import Graph
from accel.streams import _state

from conftest import use_sim
from torch_port_util import hold
from test_user_kernels import SAXPY_PTX, saxpy_reference

N = 256
DEV = 1


@pytest.fixture
def cuda(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=50)
    accel.set_device_index(0)
    accel._lazy.lazy_init()
    return "cuda"


def _captured(stream, work, g=None):
    g = Graph() if g is None else g
    with stream:
        g.capture_begin()
        try:
            work()
        finally:
            g.capture_end()
    return g


def _saxpy(device=DEV):
    accel.sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64", replace=True)
    return accel.Module(SAXPY_PTX, device=device).function("saxpy")


def _later(gate, delay=0.1):
    t = threading.Timer(delay, gate.set)
    t.start()
    return t


class SubBuffer(accel.Buffer):
    """A user's Buffer subclass: __eq__ without __hash__ (so unhashable)."""

    def __eq__(self, other):
        return self is other


# == 0d072cd: what a capture notes ===================================================================

# r80a, fixed in session 39: kernels._launch.launch: a Buffer subclass passed to a captured launch is
# not pinned (type(a) is Buffer only), so note_captured([b for b, _ in pins]) leaves it out and a
# replay on another stream does not become its last-use stream
def test_a_buffer_subclass_passed_to_a_captured_launch_is_noted(cuda):
    with accel.device_index(DEV):
        x = accel.Buffer(N * 4).fill_(0)
        y = SubBuffer(N * 4).fill_(0)
        accel.synchronize()
        s, r = accel.Stream(), accel.Stream()
        kernel = _saxpy()
        g = _captured(s, lambda: accel.launch(kernel, 1, 64, 2.0, x, y, N))
        with r:
            g.replay()
        accel.synchronize()
        accel.sim.unregister_kernel("saxpy")
        assert x.last_stream == r
        assert y.last_stream == r


def test_a_buffer_subclass_without_hash_is_noted_by_fills_and_copies(cuda):
    with accel.device_index(DEV):
        a = SubBuffer(N).fill_(0)
        b = SubBuffer(N).fill_(0)
        accel.synchronize()
        with pytest.raises(TypeError):
            hash(a)
        s, r = accel.Stream(), accel.Stream()
        g = _captured(s, lambda: (a.fill_(5), b.copy_from(a)))
        assert len(g._buffers) == 2
        with r:
            g.replay()
        accel.synchronize()
        assert a.last_stream == r and b.last_stream == r
        assert set(b.to_numpy().tolist()) == {5}


def test_an_array_view_passed_to_a_captured_launch_notes_its_buffer(cuda):
    with accel.device_index(DEV):
        x = accel.Buffer(N * 4).fill_(0)
        y = accel.Buffer(N * 4).fill_(0)
        accel.synchronize()
        s, r = accel.Stream(), accel.Stream()
        kernel = _saxpy()
        xv, yv = x.as_array(np.float32), y.as_array(np.float32)
        g = _captured(s, lambda: accel.launch(kernel, 1, 64, 2.0, xv, yv, N))
        with r:
            g.replay()
        accel.synchronize()
        accel.sim.unregister_kernel("saxpy")
        assert x.last_stream == r and y.last_stream == r


def test_array_view_copy_between_views_in_a_capture_notes_both(cuda):
    with accel.device_index(DEV):
        src = accel.Buffer(N * 4).copy_from(np.arange(N, dtype=np.float32))
        dst = accel.Buffer(N * 4).fill_(0)
        accel.synchronize()
        s, r = accel.Stream(), accel.Stream()
        sv, dv = src.as_array(np.float32), dst.as_array(np.float32)
        g = _captured(s, lambda: dv.copy_from(sv))
        assert len(g._buffers) == 2
        with r:
            g.replay()
        accel.synchronize()
        assert src.last_stream == r and dst.last_stream == r
        assert np.array_equal(dst.to_numpy(np.float32), np.arange(N, dtype=np.float32))


def test_a_copy_from_another_devices_buffer_in_a_capture_orders_its_export(cuda):
    """dst (device 0) copies from src (device 1) in a capture on device 0; a replay on R (device 0)
    is src's last use: src's CAI export (a stream of another device) waits for it on the host."""
    dst = accel.Buffer(N, device=0).fill_(0)
    src = accel.Buffer(N, device=1).fill_(9)
    accel.synchronize()
    dst.copy_from(src)          # a warm-up: device 0's access to device 1's memory is granted outside the capture
    accel.synchronize()
    s, r = accel.Stream(0), accel.Stream(0)
    g = _captured(s, lambda: dst.copy_from(src))
    assert {id(ref()) for ref in g._buffers} == {id(dst), id(src)}
    gate = hold(r)
    t = _later(gate)
    try:
        with r:
            g.replay()
        assert src.last_stream == r and dst.last_stream == r
        cai = src.__cuda_array_interface__
        assert r.query()            # the export waited for the replay on the host
        assert cai["stream"] == (accel.current_stream(1).handle or 1)
    finally:
        gate.set()
        t.join(5)
    accel.synchronize()
    assert set(dst.to_numpy().tolist()) == {9}


def test_copy_to_pinned_memory_in_a_capture_is_noted(cuda):
    with accel.device_index(DEV):
        buf = accel.Buffer(N).fill_(4)
        out = accel.empty_pinned(N, np.uint8)
        accel.synchronize()
        s, r = accel.Stream(), accel.Stream()
        g = _captured(s, lambda: buf.copy_to(out, non_blocking=True))
        with r:
            g.replay()
        assert buf.last_stream == r
        accel.synchronize()
        assert set(out.tolist()) == {4}


def test_copy_from_pinned_memory_in_a_capture_is_noted(cuda):
    with accel.device_index(DEV):
        buf = accel.Buffer(N).fill_(0)
        src = accel.empty_pinned(N, np.uint8)
        src[:] = 6
        accel.synchronize()
        s, r = accel.Stream(), accel.Stream()
        g = _captured(s, lambda: buf.copy_from(src, non_blocking=True))
        with r:
            g.replay()
        assert buf.last_stream == r
        accel.synchronize()
        assert set(buf.to_numpy().tolist()) == {6}


def test_a_non_owning_buffers_release_waits_for_a_replay_on_another_stream(cuda):
    with accel.device_index(DEV):
        owner = accel.Buffer(N).fill_(0)
        accel.synchronize()
        view = accel.Buffer.from_ptr(owner.ptr, N, device=DEV, owner=owner)
        s, r = accel.Stream(), accel.Stream()
        g = _captured(s, lambda: view.fill_(8))
        gate = hold(r)
        t = _later(gate)
        try:
            with r:
                g.replay()
            assert view.last_stream == r
            view.close()
            assert r.query()        # the release waited for the replay's work
        finally:
            gate.set()
            t.join(5)
        accel.synchronize()
        assert set(owner.to_numpy().tolist()) == {8}


def test_dlpack_import_used_in_a_capture_is_noted(cuda):
    with accel.device_index(DEV):
        owner = accel.Buffer(N).fill_(0)
        accel.synchronize()
        imported = accel.from_dlpack(owner)
        s, r = accel.Stream(), accel.Stream()
        g = _captured(s, lambda: imported.fill_(3))
        with r:
            g.replay()
        assert imported.last_stream == r
        accel.synchronize()
        assert set(owner.to_numpy().tolist()) == {3}


def _free_under_pending_work(queue, prepare=lambda buf: None):
    """``queue(buf, r)`` queues a write of 7 on a held stream ``r``; buf is then closed and a new
    buffer of its size takes 1 on the allocation stream.  Returns (the new buffer got the block while
    r's work was still pending, the new buffer's bytes once everything ran)."""
    with accel.device_index(DEV):
        buf = accel.Buffer(N).fill_(0)
        accel.synchronize()
        r = accel.Stream()
        prepared = prepare(buf)
        accel.synchronize()
        gate = hold(r)
        try:
            queue(buf, r, prepared)
            ptr = buf.ptr
            buf.close()
            fresh = accel.Buffer(N).fill_(1)
            reused_early = fresh.ptr == ptr and not r.query()
        finally:
            gate.set()
        accel.synchronize()
        return reused_early, set(fresh.to_numpy().tolist())


def test_owning_buffer_freed_after_a_fill_on_another_stream_is_not_reused_under_it(cuda):
    """Buffer's documented rule: "a use on a stream other than the allocation stream is recorded
    with the allocator (record_stream), which keeps the memory from reuse until that work has run"."""
    assert _free_under_pending_work(lambda buf, r, _: buf.fill_(7, stream=r)) == (False, {1})


# r80a, fixed in session 39: Graph.replay notes the captured buffers with Buffer._used (the last-use
# stream only), not Buffer._record: the allocator never learns the replay stream, so a close() after a
# replay on another stream hands the block to the next allocation while the replay still writes it
def test_owning_buffer_freed_after_a_replay_on_another_stream_is_not_reused_under_it(cuda):
    """The same rule for a replay: the replay on r writes buf as a fill on r does (and since
    0d072cd it is buf's last use, as an ordinary call's), so its close() must keep the block
    until the replay ran."""
    def prepare(buf):
        s = accel.Stream()      # kept open: a closed recorded stream makes the free wait for its whole device
        return _captured(s, lambda: buf.fill_(7)), s

    def queue(buf, r, prepared):
        g, _ = prepared
        with r:
            g.replay()
        assert buf.last_stream == r

    assert _free_under_pending_work(queue, prepare) == (False, {1})


def test_a_reset_graph_captured_again_keeps_only_its_new_buffers(cuda):
    with accel.device_index(DEV):
        a = accel.Buffer(N).fill_(0)
        b = accel.Buffer(N).fill_(0)
        accel.synchronize()
        s, r = accel.Stream(), accel.Stream()
        g = _captured(s, lambda: a.fill_(1))
        g.reset()
        assert g._buffers == ()
        _captured(s, lambda: b.fill_(2), g)
        assert [ref() for ref in g._buffers] == [b]
        with r:
            g.replay()
        accel.synchronize()
        assert b.last_stream == r and a.last_stream == s


def test_a_discarded_capture_keeps_no_buffers(cuda):
    """A capture invalidated inside (a query of the capturing stream, which the CUDA Programming
    Guide's "Prohibited and Unhandled Operations" rules out during capture; cudaStreamEndCapture:
    "If capture was invalidated, due to a violation of the rules of stream capture, then a NULL
    graph will be returned") ends in an error; the graph keeps no buffer and the table is gone,
    though the fill before the query was noted in it."""
    with accel.device_index(DEV):
        a = accel.Buffer(N).fill_(0)
        accel.synchronize()
        s = accel.Stream()
        g = Graph()
        with s:
            g.capture_begin()
            a.fill_(1)
            assert len(next(iter(accel.streams._capture_events.values()))["buffers"]) == 1
            with pytest.raises(Exception):
                s.query()
            with pytest.raises(Exception):
                g.capture_end()
        assert g._buffers == ()
        assert not accel.streams._capture_events
        accel.synchronize()


def test_two_graphs_capturing_at_once_on_two_devices_note_their_own(cuda):
    a0 = accel.Buffer(N, device=0).fill_(0)
    a1 = accel.Buffer(N, device=1).fill_(0)
    accel.synchronize()
    s0, s1 = accel.Stream(0), accel.Stream(1)
    g0, g1 = Graph(), Graph()
    both = threading.Barrier(2, timeout=10)
    errors = []

    def capture(g, s, buf, value):
        try:
            with s:
                g.capture_error_mode = "thread_local"
                g.capture_begin()
                both.wait()
                buf.fill_(value)
                both.wait()
                g.capture_end()
        except BaseException as exc:    # pragma: no cover - reported below
            errors.append(exc)
            both.abort()

    ts = [threading.Thread(target=capture, args=(g0, s0, a0, 10)),
          threading.Thread(target=capture, args=(g1, s1, a1, 11))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    assert errors == []
    assert [ref() for ref in g0._buffers] == [a0] and [ref() for ref in g1._buffers] == [a1]
    r0, r1 = accel.Stream(0), accel.Stream(1)
    with r1:
        g1.replay()         # device 1's graph, device 0 current
    assert accel.current_device_index() == 0
    with r0:
        g0.replay()
    assert a0.last_stream == r0 and a1.last_stream == r1
    accel.synchronize(0)
    accel.synchronize(1)
    assert set(a0.to_numpy().tolist()) == {10} and set(a1.to_numpy().tolist()) == {11}


def test_replays_from_two_threads(cuda):
    with accel.device_index(DEV):
        a = accel.Buffer(N).fill_(0)
        accel.synchronize()
        s = accel.Stream()
        g = _captured(s, lambda: a.fill_(2))
    rs = [accel.Stream(DEV), accel.Stream(DEV)]
    errors = []

    def replay(r):
        try:
            for _ in range(50):
                with r:
                    g.replay()
        except BaseException as exc:    # pragma: no cover
            errors.append(exc)

    ts = [threading.Thread(target=replay, args=(r,)) for r in rs]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    assert errors == []
    assert a.last_stream in rs
    accel.synchronize(DEV)


def test_cai_after_a_replay_on_device_1_names_the_replay_stream(cuda):
    with accel.device_index(DEV):
        a = accel.Buffer(N).fill_(0)
        accel.synchronize()
        s, r = accel.Stream(), accel.Stream()
        g = _captured(s, lambda: a.fill_(2))
    with accel.device_index(DEV):
        with r:
            pass
    accel.set_stream(r)             # (sets device 1 current, as torch's set_stream)
    accel.set_device_index(0)
    g.replay()
    assert accel.current_device_index() == 0
    assert a.__cuda_array_interface__["stream"] == r.handle
    accel.set_stream(accel.default_stream(DEV))
    accel.set_device_index(0)
    accel.synchronize(DEV)


def test_a_thousand_replays_grow_nothing(cuda):
    with accel.device_index(DEV):
        owner = accel.Buffer(N).fill_(0)
        a = accel.Buffer(N).fill_(0)
        accel.synchronize()
        view = accel.Buffer.from_ptr(owner.ptr, N, device=DEV, owner=owner)
        s, r = accel.Stream(), accel.Stream()
        g = _captured(s, lambda: (a.fill_(1), view.copy_from(a)))
        with r:
            g.replay()
        accel.synchronize()
        before = (len(g._buffers), len(view._uses), len(accel.streams._capture_events), len(a._export or ()))
        with r:
            for _ in range(1000):
                g.replay()
        accel.synchronize()
        a.__cuda_array_interface__
        after = (len(g._buffers), len(view._uses), len(accel.streams._capture_events), len(a._export or ()))
        assert before[:3] == after[:3] == (2, 2, 0)      # view's uses: the capture stream and r
        view.close()


def test_refused_calls_inside_a_capture_note_nothing(cuda):
    with accel.device_index(DEV):
        used = accel.Buffer(N).fill_(0)
        x = accel.Buffer(N * 4).fill_(0)
        y = accel.Buffer(N * 4).fill_(0)
        small = accel.Buffer(N // 2).fill_(0)
        accel.synchronize()
        kernel = _saxpy()
        s, r = accel.Stream(), accel.Stream()

        def work():
            used.fill_(1)
            with pytest.raises(ValueError):
                small.copy_from(x)                          # size mismatch
            with pytest.raises(ValueError):
                x.copy_from(np.zeros(3, np.uint8))          # size mismatch, host
            with pytest.raises(TypeError):
                accel.launch(kernel, 1, 64, 2.0, x, y)      # an argument missing
            with pytest.raises(ValueError):
                accel.launch(kernel, 1, 4096, 2.0, x, y, N)     # above the block limit
            with pytest.raises(accel.CaptureError):
                y.as_array(np.float32).copy_from(np.zeros(N, np.float32))   # pageable host memory
            with pytest.raises(accel.CaptureError):
                y.copy_from(np.zeros(N * 4, np.uint8))                      # pageable host memory

        g = _captured(s, work)
        assert [ref() for ref in g._buffers] == [used]
        with r:
            g.replay()
        accel.synchronize()
        accel.sim.unregister_kernel("saxpy")
        assert x.last_stream != r and y.last_stream != r and small.last_stream != r


def test_nothing_is_asked_outside_captures(cuda, monkeypatch):
    from accel.buffer import capture, pins
    from accel.random import _device
    calls = []

    def counting(stream):
        calls.append(stream)
        return None

    for mod in (capture, pins, _device):
        monkeypatch.setattr(mod, "captured_table", counting)
    with accel.device_index(DEV):
        x = accel.Buffer(N * 4).fill_(0)
        y = accel.Buffer(N * 4)
        y.copy_from(x)
        y.copy_from(np.zeros(N * 4, np.uint8))
        y.to_numpy()
        y.as_array(np.float32).copy_from(x.as_array(np.float32))
        accel.random.uniform_(y)
        accel.launch(_saxpy(), 1, 64, 2.0, x, y, N)
        accel.synchronize()
        accel.sim.unregister_kernel("saxpy")
    assert calls == []


def test_a_refused_random_fill_inside_a_capture_notes_nothing(cuda):
    with accel.device_index(DEV):
        used = accel.Buffer(N).fill_(0)
        odd = accel.Buffer(3).fill_(0)
        accel.synchronize()
        s = accel.Stream()

        def work():
            used.fill_(1)
            with pytest.raises((ValueError, TypeError)):
                accel.random.uniform_(odd)      # 3 bytes: no whole float32

        g = _captured(s, work)
        assert [ref() for ref in g._buffers] == [used]


# == 3464460: `with stream:` blocks, ExitStack and the retry on the thread's stack ===================

def _stack():
    return list(getattr(_state._tls, "stack", []) or [])


def _defaults():
    return accel.current_stream(0) == accel.default_stream(0) and accel.current_stream(1) == accel.default_stream(1)


def _join(t):
    t.join(10)
    assert not t.is_alive()


def test_exit_stack_on_two_devices_with_an_exception_inside_restores_both(cuda):
    s0, s1 = accel.Stream(0), accel.Stream(1)
    with pytest.raises(KeyError):
        with contextlib.ExitStack() as es:
            es.enter_context(s1)
            es.enter_context(s0)
            assert accel.current_device_index() == 0
            assert accel.current_stream(1) == s1 and accel.current_stream(0) == s0
            raise KeyError("inside")
    assert _stack() == [] and _defaults() and accel.current_device_index() == 0
    with contextlib.ExitStack() as outer:
        outer.enter_context(s1)
        with s0:
            with contextlib.ExitStack() as inner:
                inner.enter_context(accel.Stream(1))
            assert accel.current_stream(1) == s1
        assert accel.current_device_index() == 1
    assert _stack() == [] and _defaults() and accel.current_device_index() == 0


def test_exit_stack_pop_all_closed_in_a_generator_on_another_thread(cuda):
    """Blocks entered through one ExitStack, moved (pop_all) into one a generator holds, the
    generator closed on another thread: the entering thread's stack empties and its streams are
    the defaults; the closing thread's streams stay."""
    s0, s1 = accel.Stream(0), accel.Stream(1)

    def gen():
        with contextlib.ExitStack() as es:
            es.enter_context(s1)
            es.enter_context(s0)
            moved = es.pop_all()
        with moved:
            yield

    g = gen()
    next(g)
    assert accel.current_stream(1) == s1 and accel.current_stream(0) == s0
    seen = []

    def close():
        mine = accel.Stream(1)
        accel.set_stream(mine)
        g.close()
        seen.append(accel.current_stream(1) == mine)
    t = threading.Thread(target=close)
    t.start()
    _join(t)
    assert seen == [True]
    assert _stack() == [] and _defaults() and accel.current_device_index() == 0


def test_a_contextmanager_wrapper_closed_on_another_thread(cuda):
    s1 = accel.Stream(1)

    @contextlib.contextmanager
    def on(s):
        with s:
            yield s

    def gen():
        with on(s1):
            yield

    g = gen()
    next(g)
    assert accel.current_stream(1) == s1
    t = threading.Thread(target=g.close)
    t.start()
    _join(t)
    assert _stack() == [] and _defaults()


def test_async_exit_stacks_of_two_tasks_leave_out_of_order(cuda):
    s0, s1 = accel.Stream(0), accel.Stream(1)
    first_in, second_in, first_may_leave = asyncio.Event, asyncio.Event, asyncio.Event
    order = []

    async def task(s, entered, wait_for):
        async with contextlib.AsyncExitStack() as es:
            es.enter_context(s)
            entered.set()
            await wait_for.wait()
        order.append(s)

    async def main():
        a_in, b_in, go_a, go_b = first_in(), second_in(), first_may_leave(), asyncio.Event()
        ta = asyncio.ensure_future(task(s1, a_in, go_a))
        await a_in.wait()
        tb = asyncio.ensure_future(task(s0, b_in, go_b))
        await b_in.wait()
        assert accel.current_stream(1) == s1 and accel.current_stream(0) == s0
        go_a.set()          # the older block leaves first
        await ta
        assert accel.current_stream(0) == s0      # the newer one's stream stays current
        go_b.set()
        await tb

    asyncio.run(main())
    assert order == [s1, s0]
    assert _stack() == [] and _defaults() and accel.current_device_index() == 0


def test_an_enter_whose_set_stream_fails_leaves_nothing(cuda, monkeypatch):
    from accel.streams import stream as stream_mod
    s1 = accel.Stream(1)
    real = stream_mod.set_stream
    with s1:
        changes = _state._tls.stack.changes

        def failing(s):
            raise OSError("set_stream failed")
        monkeypatch.setattr(stream_mod, "set_stream", failing)
        s0 = accel.Stream(0)
        with pytest.raises(OSError):
            with s0:
                pass    # pragma: no cover
        monkeypatch.setattr(stream_mod, "set_stream", real)
        assert len(_stack()) == 1 and _state._tls.stack.changes == changes + 1
        assert accel.current_stream(1) == s1 and accel.current_stream(0) == accel.default_stream(0)
        with s0:
            assert accel.current_stream(0) == s0
    assert _stack() == [] and _defaults()


class SubStream(accel.Stream):
    """A user's Stream subclass whose __enter__/__exit__ add to the base class's (a common pattern:
    logging, NVTX ranges)."""

    def __enter__(self):
        return super().__enter__()

    def __exit__(self, *exc):
        return super().__exit__(*exc)


def test_a_stream_subclass_block_on_the_thread_that_entered_it(cuda):
    s1 = SubStream(1)
    with s1:
        assert accel.current_stream(1) == s1
        with contextlib.ExitStack() as es:
            es.enter_context(SubStream(0))
    assert _stack() == [] and _defaults()


# r80a, fixed in session 39: streams.stream._block_frame: a Stream subclass whose __enter__/__exit__
# call super() keys the block by its own __enter__ frame (sys._getframe(2)), not the with statement's,
# so a generator suspended in the block and closed on another thread is not found: RuntimeError, the
# entry left on the entering thread's stack
def test_a_stream_subclass_block_in_a_generator_closed_on_another_thread(cuda):
    s1 = SubStream(1)

    def gen():
        with s1:
            yield

    g = gen()
    next(g)
    errors = []

    def close():
        try:
            g.close()
        except BaseException as exc:
            errors.append(exc)
    t = threading.Thread(target=close)
    t.start()
    _join(t)
    assert errors == []
    assert _stack() == [] and _defaults()


def test_a_thread_ending_inside_an_exit_stack_block_of_a_generator(cuda):
    s1 = accel.Stream(1)

    def gen():
        with contextlib.ExitStack() as es:
            es.enter_context(s1)
            yield

    holder = []

    def enter():
        g = gen()
        next(g)
        holder.append(g)
    t = threading.Thread(target=enter)
    t.start()
    _join(t)
    mine = accel.Stream(1)
    accel.set_stream(mine)
    holder.pop().close()            # its thread has ended: nothing to restore anywhere
    assert accel.current_stream(1) == mine
    accel.set_stream(accel.default_stream(1))
    accel.set_device_index(0)
    assert _stack() == []


def test_a_collection_during_enter_closing_a_generators_block_is_read_again(cuda, monkeypatch):
    """The saved state is read after the allocations, and read again when a block was taken out
    meanwhile: a generator suspended in `with s1:` closed as the new block reads the current
    stream (as a collection would) leaves the new block saving the default stream, not s1."""
    from accel.streams import stream as stream_mod
    s1, s2 = accel.Stream(1), accel.Stream(1)

    def gen():
        with s1:
            yield

    g = gen()
    next(g)
    real = stream_mod.current_stream
    calls = []

    def reading(index=None):
        calls.append(index)
        if len(calls) == 1:
            g.close()       # a block of this thread taken out between the count and the lock
        return real(index)

    monkeypatch.setattr(stream_mod, "current_stream", reading)
    with s2:
        monkeypatch.setattr(stream_mod, "current_stream", real)
        assert accel.current_stream(1) == s2
    assert len(calls) == 2          # one retry, no spin
    assert accel.current_stream(1) == accel.default_stream(1)
    assert _stack() == []


def test_the_retry_ends_when_every_read_closes_a_block(cuda, monkeypatch):
    """Ten generators in blocks, one closed at each read: ten retries, then the entry."""
    from accel.streams import stream as stream_mod
    streams_ = [accel.Stream(1) for _ in range(10)]

    def gen(s):
        with s:
            yield

    gens = []
    for s in streams_:
        g = gen(s)
        next(g)
        gens.append(g)
    real = stream_mod.current_stream
    calls = []

    def reading(index=None):
        calls.append(index)
        if gens:
            gens.pop(0).close()     # oldest first: out of order
        return real(index)

    monkeypatch.setattr(stream_mod, "current_stream", reading)
    last = accel.Stream(1)
    with last:
        monkeypatch.setattr(stream_mod, "current_stream", real)
        assert accel.current_stream(1) == last
    assert len(calls) == 11
    assert _stack() == [] and _defaults()


# == dee3ea4: a foreign library's cudaDeviceReset through the same libcudart; entry points =============

def _contexts():
    return list(accel.sim.state().primary_contexts)


def _foreign_reset(device=0):
    """Another library resets ``device`` through the same libcudart, on this thread, and puts the
    thread's device back as it found it."""
    lib = accel.sim.open_library("cudart")
    before = accel._lazy._initialized_backend.get_device()
    assert lib.cudaSetDevice(device) == 0
    assert lib.cudaDeviceReset() == 0
    assert lib.cudaSetDevice(before) == 0 if before != device else True


def test_first_calls_on_device_1_make_no_context_on_device_0(monkeypatch):
    """Driver entry points looked up with no context anywhere (dee3ea4: they make none): accel's
    first work is a module and a launch on device 1 and a device scope; device 0, current but
    unused, gets no primary context, and the launch runs."""
    use_sim(monkeypatch, "cuda")
    accel.sim.reset()
    accel._lazy.lazy_init()
    with accel.device_index(1):
        pass
    assert _contexts() == [False, True]     # cudaSetDevice(1) initializes device 1's (CUDA 12), not 0's
    kernel = _saxpy(1)
    x = accel.Buffer(N * 4, device=1).copy_from(np.ones(N, np.float32))
    y = accel.Buffer(N * 4, device=1).fill_(0)
    accel.launch(kernel, 1, N, 3.0, x, y, N)
    accel.synchronize(1)
    accel.sim.unregister_kernel("saxpy")
    assert np.all(y.to_numpy(np.float32) == 3.0)
    assert _contexts()[1] is True
    assert accel.current_device_index() == 0
    assert _contexts()[0] is False


_DEAD_HANDLES = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@_DEAD_HANDLES      # the finalizers of objects the reset destroyed report their failed destroys
def test_work_after_a_foreign_reset_of_the_current_device(cuda):
    """Device 0 reset by another library: accel's new buffers, modules, launches, streams and graphs
    work; what the reset destroyed (the old graph's exec, an old stream, an old event) is refused
    with AcceleratorError, never another exception; device 1's work is untouched."""
    kernel = _saxpy(0)
    x = accel.Buffer(N * 4, device=0).fill_(0)
    keep1 = accel.Buffer(N, device=1).fill_(6)
    old_stream = accel.Stream(0)
    g = _captured(old_stream, lambda: x.fill_(1))
    accel.synchronize()
    _foreign_reset(0)
    with pytest.raises(accel.AcceleratorError):
        g.replay()
    with pytest.raises(accel.AcceleratorError):
        old_stream.query()
    fresh = accel.Buffer(N * 4, device=0).copy_from(np.full(N, 2, np.float32))
    out = accel.Buffer(N * 4, device=0).fill_(0)
    accel.launch(kernel, 1, N, 1.0, fresh, out, N)     # a cudaLibrary's kernel: context-independent
    again = accel.Module(SAXPY_PTX, device=0).function("saxpy")
    accel.launch(again, 1, N, 1.0, fresh, out, N)
    accel.synchronize()             # (the launches ran on the default stream: done before s's replay)
    assert np.all(out.to_numpy(np.float32) == 4.0)
    s = accel.Stream(0)
    g2 = _captured(s, lambda: out.fill_(9))
    with s:
        g2.replay()
    accel.synchronize()
    accel.sim.unregister_kernel("saxpy")
    assert set(out.to_numpy().tolist()) == {9}
    assert set(keep1.to_numpy().tolist()) == {6}
    del g
    gc.collect()


@_DEAD_HANDLES
# r80a, fixed in session 39: graphs.held._destroy_held put back a handle whose destroy failed with
# cudaErrorInvalidResourceHandle (an exec the foreign cudaDeviceReset destroyed), so every reset() raised
# and the graph could never be captured again; now it warns and forgets it, as torch's CUDAGraph::reset
def test_a_graph_whose_exec_a_foreign_reset_destroyed_can_be_reset_and_captured_again(cuda):
    """CUDA Runtime API, cudaDeviceReset: "Explicitly destroys and cleans up all resources associated
    with the current device in the current process" (the simulator drops the device's graph execs
    since dee3ea4).  The graph's reset() must still leave it empty, as torch's does, so it can be
    captured again."""
    x = accel.Buffer(N, device=0).fill_(0)
    s = accel.Stream(0)
    g = _captured(s, lambda: x.fill_(1))
    g.replay()
    accel.synchronize()
    _foreign_reset(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # torch warns here; a warning is fine
        try:
            g.reset()
        except accel.AcceleratorError:
            pass                            # (even an error is fine, if the graph is then empty)
    s2 = accel.Stream(0)
    _captured(s2, lambda: x.fill_(4), g)
    with s2:
        g.replay()
    accel.synchronize()
    assert set(x.to_numpy().tolist()) == {4}
    del s
    gc.collect()


# r80a, fixed in session 39: backends.cuda.devices.has_primary_context cached "active" for good, so after a
# foreign cudaDeviceReset a device scope's exit made device 0's primary context again; now it asks
# cuDevicePrimaryCtxGetState each time, as torch's _hasPrimaryContext
def test_a_scope_exit_after_a_foreign_reset_makes_no_context_again(cuda):
    """CUDA Runtime API, "Interactions with the CUDA Driver API": "Primary contexts will remain active
    until they are explicitly deinitialized using cudaDeviceReset(). The function cudaDeviceReset()
    will deinitialize the primary context for the calling thread's current device immediately";
    cudaSetDevice: "This function will also immediately initialize the runtime state on the primary
    context".  torch's _hasPrimaryContext (CUDAHooks.cpp) asks cuDevicePrimaryCtxGetState at each call.  accel defers a scope's restore
    to a device without a primary context (c10::cuda::MaybeSetDevice), so the exit below should
    leave device 0's context as the reset left it."""
    x = accel.Buffer(N, device=0).fill_(1)
    with accel.device_index(1):
        accel.Buffer(N).fill_(2)
    accel.synchronize()
    assert _contexts() == [True, True]
    del x
    _foreign_reset(0)
    assert _contexts()[0] is False
    with accel.device_index(1):
        accel.Buffer(N).fill_(3)
    assert _contexts()[0] is False
    assert accel.current_device_index() == 0


@_DEAD_HANDLES
# r80a, fixed in session 39: streams (Stream creation / Stream.close): after a foreign cudaDeviceReset
# the runtime gives a new stream the handle of one the reset destroyed; accel's old wrapper still owns
# that handle, and its close() destroys the new stream under accel
def test_closing_a_stream_a_foreign_reset_destroyed_leaves_the_new_stream_with_its_handle(cuda):
    """CUDA Runtime API, cudaDeviceReset: "Explicitly destroys and cleans up all resources associated
    with the current device in the current process"; the runtime then hands out the destroyed
    handle again (the simulator does; the docs do not say it cannot).  accel sees the collision as
    the new stream is made (its registry of live streams holds the old wrapper under that handle),
    so the old wrapper's close() must not destroy the new stream."""
    old = accel.Stream(0)
    old.query()
    _foreign_reset(0)
    new = accel.Stream(0)
    buf = accel.Buffer(N, device=0)
    try:
        old.close()
    except accel.AcceleratorError:
        pass
    buf.fill_(5, stream=new)
    new.synchronize()
    assert set(buf.to_numpy().tolist()) == {5}


@pytest.mark.parametrize("consumer", ["legacy", "accel stream"])
def test_dlpack_export_to_another_consumer_stream_orders_after_a_replay_on_device_1(cuda, consumer):
    """The array API's __dlpack__(stream=...): the producer makes the data safe to use on the
    consumer's stream (for CUDA, 1 is the legacy default stream).  The replay on R (device 1, with
    device 0 current) is held back until the consumer's copy is queued: the copy sees its bytes."""
    with accel.device_index(DEV):
        buf = accel.Buffer(N).fill_(0)
        out = accel.Buffer(N).fill_(1)
        accel.synchronize()
        s, r = accel.Stream(), accel.Stream()
        g = _captured(s, lambda: buf.fill_(7))
        other = accel.Stream()
    target = accel.default_stream(DEV) if consumer == "legacy" else other
    accel.synchronize()
    gate = hold(r)
    try:
        with accel.device_index(DEV), r:
            g.replay()
        assert accel.current_device_index() == 0
        capsule = buf.__dlpack__(stream=target.handle or 1)
        out.copy_from(buf, stream=target, non_blocking=True)
        del capsule
    finally:
        gate.set()
    accel.synchronize(DEV)          # (device 0 is current: its synchronize would not cover `other`)
    assert set(out.to_numpy().tolist()) == {7}


class _Ring:
    def __init__(self, obj):
        self.obj, self.me = obj, self


def test_an_exit_stack_generator_in_a_cycle_collected_on_another_thread(cuda):
    """A generator suspended in two ExitStack blocks (devices 1 and 0), in a reference cycle, closed
    by a collection another thread runs: the entering thread's stack empties, its streams are the
    defaults again, the collecting thread's streams stay."""
    s0, s1 = accel.Stream(0), accel.Stream(1)

    def gen():
        with contextlib.ExitStack() as es:
            es.enter_context(s1)
            es.enter_context(s0)
            yield

    g = gen()
    next(g)
    _Ring(g)
    del g
    seen = []

    def collect():
        mine = accel.Stream(1)
        accel.set_stream(mine)
        gc.collect()
        seen.append(accel.current_stream(1) == mine and accel.current_stream(0) == accel.default_stream(0))
    gc.disable()
    try:
        t = threading.Thread(target=collect)
        t.start()
        _join(t)
    finally:
        gc.enable()
    assert seen == [True]
    assert _stack() == [] and _defaults() and accel.current_device_index() == 0
