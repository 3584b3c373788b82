"""A handle destroyed by another thread while a call that passes it is in flight.

On an H100 (tools/cuda_conformance.py, scenario launch_after_library_unload, 2026-12-05) a
kernel launched after its library was unloaded killed the process (SIGSEGV), and a destroyed
graph exec or library handle passed to the runtime is undefined there.  accel checks that an
object is open when a call begins; these tests close or reset the object from another thread
after that check and before the runtime call, and require the call to complete on the handle it
began with, the destroy to happen after it, and nothing to leak.  On the simulator the
destroyed handle is refused (an AcceleratorError); on hardware it may crash.
"""

import threading

import pytest

import accel
from accel import _lazy


def _in_other_thread(fn, wait=0.2):
    """Run ``fn`` in a new thread; give it ``wait`` seconds (it may wait for the caller); return
    the thread (joined later) and the list its result or exception lands in."""
    out = []

    def body():
        try:
            out.append(("ok", fn()))
        except BaseException as exc:   # noqa: BLE001 - reported to the test
            out.append(("raised", exc))
    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(wait)
    return t, out


def _captured_fill(device, keep_graph=False):
    with accel.device_index(device):
        s = accel.Stream()
        buf = accel.Buffer(256, stream=s)
        g = accel.Graph(keep_graph=keep_graph)
        with accel.graph(g, stream=s):
            buf.fill_(7, stream=s)
    return g, buf


def _replay_while_another_thread_runs(monkeypatch, g, device, other):
    """Replay ``g`` on ``device``; just before its cudaGraphLaunch, ``other()`` starts in another
    thread (and may wait for the launch).  Returns what ``other`` returned or raised."""
    backend = _lazy.lazy_init()
    real_launch = backend.graph_launch
    others = []

    def launch(exec_handle, stream_handle):
        others.append(_in_other_thread(other))
        return real_launch(exec_handle, stream_handle)
    monkeypatch.setattr(backend, "graph_launch", launch)
    with accel.device_index(device):
        g.replay()
    monkeypatch.setattr(backend, "graph_launch", real_launch)
    (t, out), = others
    t.join(10)
    assert not t.is_alive()
    return out


@pytest.mark.parametrize("device", [0, 1])
def test_graph_reset_in_another_thread_waits_for_a_replay_in_flight(sim_cuda, monkeypatch, device):
    g, buf = _captured_fill(device)
    g.replay()                                  # instantiated
    assert _replay_while_another_thread_runs(monkeypatch, g, device, g.reset) == [("ok", None)]
    accel.synchronize(device)
    assert bytes(buf.to_numpy()) == b"\x07" * 256
    with pytest.raises(RuntimeError, match="no capture"):
        g.replay()                              # reset: nothing to replay until captured again


@pytest.mark.parametrize("device", [0, 1])
def test_instantiate_in_another_thread_waits_for_a_replay_in_flight(sim_cuda, monkeypatch, device):
    # instantiate() of a keep_graph graph destroys the executable it replaces
    g, buf = _captured_fill(device, keep_graph=True)
    g.replay()
    assert _replay_while_another_thread_runs(monkeypatch, g, device, g.instantiate) == [("ok", None)]
    buf.fill_(0)
    with accel.device_index(device):
        g.replay()                              # the new executable
    accel.synchronize(device)
    assert bytes(buf.to_numpy()) == b"\x07" * 256


# -- a kernel launch and Module.close() -------------------------------------------------------------

@pytest.fixture
def saxpy(sim_cuda):
    from accel import sim
    from test_user_kernels import saxpy_reference
    sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64")
    yield
    sim.unregister_kernel("saxpy")


def _live_modules():
    from accel import sim
    return sim.state().modules if hasattr(sim.state(), "modules") else None


@pytest.mark.parametrize("device", [0, 1])
def test_module_close_in_another_thread_waits_for_a_launch_in_flight(saxpy, monkeypatch, device):
    import numpy as np
    from test_user_kernels import SAXPY_PTX, expected
    m = accel.Module(SAXPY_PTX, device=device)
    k = m.function("saxpy")
    x = np.arange(64, dtype=np.float32)
    y = np.ones(64, dtype=np.float32)
    with accel.device_index(device):
        bx, by = accel.Buffer(256), accel.Buffer(256)
        bx.copy_from(x)
        by.copy_from(y)
    backend = _lazy.lazy_init()
    real_launch = backend.launch
    others = []

    def launch(*args, **kwargs):
        others.append(_in_other_thread(m.close))
        return real_launch(*args, **kwargs)
    monkeypatch.setattr(backend, "launch", launch)
    accel.launch(k, 1, 64, 2.0, bx, by, 64)
    monkeypatch.setattr(backend, "launch", real_launch)
    (t, out), = others
    t.join(10)
    assert out == [("ok", None)]
    assert m.closed
    assert by.to_numpy("float32").tobytes() == expected(2.0, x, y).tobytes()
    with pytest.raises(ValueError, match="closed"):
        accel.launch(k, 1, 64, 2.0, bx, by, 64)


@pytest.mark.parametrize("device", [0, 1])
def test_module_close_in_another_thread_waits_for_a_kernel_lookup_in_flight(saxpy, monkeypatch, device):
    from test_user_kernels import SAXPY_PTX
    m = accel.Module(SAXPY_PTX, device=device)
    backend = _lazy.lazy_init()
    real_lookup = backend.module_function
    others = []

    def lookup(*args, **kwargs):
        others.append(_in_other_thread(m.close))
        return real_lookup(*args, **kwargs)
    monkeypatch.setattr(backend, "module_function", lookup)
    k = m.function("saxpy")
    monkeypatch.setattr(backend, "module_function", real_lookup)
    (t, out), = others
    t.join(10)
    assert out == [("ok", None)]
    assert m.closed and k.name == "saxpy"


class _RecordingLock:
    """A module's lock that notes the order replays take it in."""

    def __init__(self, name, log):
        self._lock, self._name, self._log = threading.Lock(), name, log

    def acquire(self, *args, **kwargs):
        self._log.append(self._name)
        return self._lock.acquire(*args, **kwargs)

    def release(self):
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()


@pytest.mark.parametrize("device", [0, 1])
def test_replays_take_their_modules_locks_in_one_order(saxpy, device):
    # Two graphs launching kernels of the same two modules, captured in opposite orders: if each
    # replay locked its modules in capture order, two threads replaying them at once could each
    # hold one lock and wait for the other's.
    from test_user_kernels import SAXPY_PTX
    with accel.device_index(device):
        ma, mb = accel.Module(SAXPY_PTX), accel.Module(SAXPY_PTX)
        ka, kb = ma.function("saxpy"), mb.function("saxpy")
        s = accel.Stream()
        bx, by = accel.Buffer(256, stream=s), accel.Buffer(256, stream=s)
        graphs = []
        for first, second in ((ka, kb), (kb, ka)):
            g = accel.Graph()
            with accel.graph(g, stream=s):
                accel.launch(first, 1, 64, 1.0, bx, by, 64, stream=s)
                accel.launch(second, 1, 64, 1.0, bx, by, 64, stream=s)
            graphs.append(g)
    log = []
    ma._lock, mb._lock = _RecordingLock("a", log), _RecordingLock("b", log)
    orders = []
    for g in graphs:
        del log[:]
        with accel.device_index(device):
            g.replay()
        orders.append(tuple(log))
    assert orders[0] == orders[1], orders
    accel.synchronize(device)
