"""Every other "is a capture underway? then make the call" window in accel, opened on purpose.

CUDA prohibits "potentially unsafe" calls (cudaMalloc/cudaFree, event and stream queries and
synchronizes, cudaDeviceSynchronize, synchronous copies, module loads before driver 12.3 and
unloads, graph and executable-graph destroys) by one thread while another thread has a global-mode
capture underway: the call fails with cudaErrorStreamCaptureUnsupported and invalidates that
capture (CUDA Runtime API, cudaStreamBeginCapture; Programming Guide, "Prohibited and Unhandled
Operations"; accel/sim/README.md for the module and graph rules).  accel checks whether a capture
is underway and then makes such a call; r63/r64 made check and call one step for the allocators
(``Backend.capture_gate``, taken by capture_begin around its count and cudaStreamBeginCapture).

Each test here opens one remaining window as tests/test_capture_gate_queries_r64.py does: the
checking thread ("check"), after a negative answer, waits up to WINDOW_S for another thread's
global-mode capture to begin (device 1, or the same device 0).  Where the gate covers the window
the capture cannot begin meanwhile: the wait times out, the call goes on, the capture begins
after it and replays correctly.  (Written by r64b with the open windows as strict xfails; each
failed before its fix: the capture invalidated, cudaErrorStreamCaptureInvalidated at capture_end.)  The backend's checks read ``CudaBackend._captures``; they are
watched through an int subclass whose truth test waits when read as 0 by the named function; the
allocators' through ``_guards.capture_underway``.  One window is held open by the capturing
thread instead: capture_end uncounts its capture before cudaStreamEndCapture.

Also here: internal synchronizes accel made with no capture check at all while another thread
captured (a foreign buffer's release, now deferred to the end of the captures; the CUDA array
interface and DLPack export of a buffer whose last-use stream was closed, now refused), the XPU
backend (which applies CUDA's rules itself, and had no gate), and a check coarser than the
simulator (a module load on an old driver, refused during any capture).
"""

from __future__ import annotations

import importlib
import sys
import threading

import pytest

import accel
from accel import _lazy, memory
from accel.memory import _caching, _guards, _uses
from accel.sim import kernels

from conftest import THOROUGH, use_sim

#: how long the checking thread holds its window open for the capture.  Each gated case waits it
#: out; an open window lets the capture begin in milliseconds (the threads rendezvous on events),
#: so the default run's 0.15 s still catches one (THOROUGH: 0.5 s, for a loaded machine).
WINDOW_S = 0.5 if THOROUGH else 0.15
PAYLOAD = bytes(range(256)) * 16


class _Race:
    """The two threads' rendezvous: the capture ("capture") begins once the checker ("check")
    opened its window, and captures its copy once the checker's act is done."""

    def __init__(self):
        self.began, self.window, self.done, self.armed, self.ready = (threading.Event() for _ in range(5))
        self.opened, self.errors, self.check_errors, self.results = [], [], [], []

    def assert_clean(self) -> None:
        """Neither thread failed, and the capture replayed its copy."""
        assert not self.errors + self.check_errors, self.errors + self.check_errors
        assert self.results == [True]

    def assert_capture_kept(self) -> None:
        """The capture replayed its copy; the checker's call at most refused (CaptureError, the
        capture left valid): a fix may refuse instead of synchronizing."""
        assert not self.errors, self.errors
        assert all(isinstance(e, accel.CaptureError) for e in self.check_errors), self.check_errors
        assert self.results == [True]

    def wait_here(self) -> None:
        """Called right after a check answered "no capture underway"."""
        if (self.armed.is_set() and threading.current_thread().name == "check"
                and not self.window.is_set()):
            self.opened.append(True)
            self.window.set()
            self.began.wait(WINDOW_S)       # another thread's capture would begin here


def _watch_captures(be, race: _Race, where: str) -> None:
    """Make ``be._captures`` (CudaBackend's count of captures underway) wait in ``race`` when a
    truth test of it in function ``where`` reads 0 (sums stay watched)."""

    class _Watched(int):
        def __bool__(self):
            zero = int(self) == 0
            if zero and sys._getframe(1).f_code.co_name == where:
                race.wait_here()
            return not zero

        def __add__(self, other):
            return _Watched(int(self) + other)

        __radd__ = __add__

        def __sub__(self, other):
            return _Watched(int(self) - other)

    be._captures = _Watched(be._captures)


def _run(race: _Race, capture_device: int, prepare, act, *, mode: str = "default", wait_window: bool = True):
    """The capture thread (on ``capture_device``) and the checking thread (device 0, running
    ``act(prepare())``); the capture must replay its copy."""

    def capture():
        try:
            with accel.device_index(capture_device):
                s, src, dst = accel.Stream(), accel.Buffer(4096), accel.Buffer(4096)
                src.copy_from(PAYLOAD)
                accel.synchronize()
                g = accel.Graph(capture_error_mode=mode)
                race.ready.set()                # set up before the checker's prepare (same device: no sharing)
                if wait_window:
                    race.window.wait(10)
                with s:
                    g.capture_begin()
                    race.began.set()
                    try:
                        race.done.wait(10)      # the checker's call ran while this captures
                        dst.copy_from(src, non_blocking=True)
                    finally:
                        g.capture_end()
                dst.fill_(0)
                g.replay()
                race.results.append(dst.to_numpy().tobytes() == PAYLOAD)
                g.reset()
                s.close()
        except Exception as exc:            # noqa: BLE001 - reported below
            race.errors.append(exc)
        finally:
            race.ready.set()
            race.began.set()

    def check():
        try:
            race.ready.wait(10)
            with accel.device_index(0):
                state = prepare()
                race.armed.set()
                act(state)
        except Exception as exc:            # noqa: BLE001
            race.check_errors.append(exc)
        finally:
            race.window.set()
            race.done.set()

    threads = [threading.Thread(target=capture, name="capture"), threading.Thread(target=check, name="check")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a thread hung"


def _warm():
    """Both devices' allocators made (before any race); the backend."""
    for d in (0, 1):
        accel.Buffer(256, device=d).close()
    return _lazy.lazy_init()


DEVICES = pytest.mark.parametrize("capture_device", [1, 0], ids=["capture-on-1", "capture-on-0"])


# -- 1. the deferred releases: "no capture underway? then destroy now" (CudaBackend._after_captures) --

def _captured_graph():
    buf = accel.Buffer(4096)
    g = accel.Graph()
    with accel.graph(g):
        buf.fill_(7)
    return g, buf


def _loaded_module():
    return accel.Module(kernels.TEST_PTX)


RELEASES = {
    # Graph.reset(): cudaGraphExecDestroy and cudaGraphDestroy (CudaBackend.graph_exec_destroy/graph_destroy)
    "graph-reset": (_captured_graph, lambda state: state[0].reset()),
    # Module.close(): cudaLibraryUnload (CudaBackend.module_unload)
    "module-close": (_loaded_module, lambda m: m.close()),
}


@DEVICES
@pytest.mark.parametrize("release", sorted(RELEASES))
def test_a_release_on_device_0_does_not_invalidate_a_capture_beginning_meanwhile(monkeypatch, capture_device,
                                                                                  release):
    use_sim(monkeypatch, "cuda")
    be = _warm()
    race = _Race()
    _watch_captures(be, race, "_after_captures")
    _run(race, capture_device, *RELEASES[release])
    assert race.opened, "no 'capture underway?' check before the release: the window was not opened"
    race.assert_clean()


# -- 2. the releases deferred during a capture, run as the last capture ends (_run_after_captures) --

@pytest.mark.parametrize("release", sorted(RELEASES))
@DEVICES
def test_releases_run_after_a_capture_do_not_invalidate_a_capture_beginning_meanwhile(monkeypatch, capture_device,
                                                                                     release):
    # The checker captures a graph X on the other device, releases a device-0 object during X
    # (deferred), and ends X: the deferred release runs as X ends, in the checker's thread.
    use_sim(monkeypatch, "cuda")
    be = _warm()
    race = _Race()
    make, drop = RELEASES[release]
    x_device = 1 - capture_device

    def prepare():
        return make()

    def act(state):
        buf = accel.Buffer(4096, device=x_device)
        x = accel.Graph()
        with accel.device_index(x_device), accel.graph(x):
            buf.fill_(3)
            with accel.device_index(0):
                drop(state)                 # deferred: a capture (X) is underway
            assert be._after_capture, "the release was not deferred"
            _watch_captures(be, race, "_run_after_captures")
        x.replay()
        x.reset()

    _run(race, capture_device, prepare, act)
    assert race.opened, "no deferred release ran as the capture ended: the window was not opened"
    race.assert_clean()


# -- 3. a module load on a driver before CUDA 12.3 (CudaBackend.module_load) ------------------------

@DEVICES
def test_a_module_load_on_an_old_driver_does_not_invalidate_a_capture_beginning_meanwhile(monkeypatch,
                                                                                          capture_device):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CUDA_RUNTIME="12.8", ACCEL_SIM_CUDA_DRIVER="12.2")
    be = _warm()
    accel.Module(kernels.TEST_PTX).close()      # the kernel path is resolved before the race
    race = _Race()
    _watch_captures(be, race, "module_load")
    loaded = []
    _run(race, capture_device, lambda: None, lambda _: loaded.append(accel.Module(kernels.TEST_PTX)))
    assert race.opened, "no 'capture underway?' check before the load: the window was not opened"
    race.assert_clean()
    assert len(loaded) == 1


@pytest.mark.parametrize("mode", ["relaxed", "thread_local"])
def test_a_module_load_on_an_old_driver_during_another_threads_capture_is_refused_and_the_capture_kept(
        monkeypatch, mode):
    # Coarser than the simulator: on a driver before CUDA 12.3 accel refuses a load while any
    # capture is counted, although the simulator (and the "potentially unsafe" rule it applies)
    # would allow it beside another thread's relaxed or thread-local capture.  The documents are
    # silent on module loads in capture (accel/sim/cudart/modules.py), so accel does not rely on
    # that: the refusal names the driver and the way out, and the capture goes on.
    use_sim(monkeypatch, "cuda", ACCEL_SIM_CUDA_RUNTIME="12.8", ACCEL_SIM_CUDA_DRIVER="12.2")
    _warm()
    accel.Module(kernels.TEST_PTX).close()
    race = _Race()

    def act(_):
        race.began.wait(10)                 # the other thread's capture is underway
        accel.Module(kernels.TEST_PTX)

    _run(race, 1, lambda: None, act, mode=mode, wait_window=False)
    race.assert_capture_kept()
    assert len(race.check_errors) == 1 and "CUDA 12.2" in str(race.check_errors[0])


# -- 4. a foreign buffer's release (accel/buffer/release.py _release_foreign) ------------------------

def _foreign_used_on_closed_stream():
    owner = accel.Buffer(4096)
    foreign = accel.Buffer.from_ptr(owner.ptr, 4096, owner=owner)
    s = accel.Stream()
    foreign.fill_(5, stream=s)
    s.close()                               # its queued work still runs: the release syncs the device
    return foreign


@DEVICES
def test_a_foreign_buffer_release_after_its_stream_closed_does_not_invalidate_a_capture_beginning_meanwhile(
        monkeypatch, capture_device):
    use_sim(monkeypatch, "cuda")
    be = _warm()
    race = _Race()
    _watch_captures(be, race, "_after_captures")    # (_release_foreign asks it, the gate held)
    _run(race, capture_device, _foreign_used_on_closed_stream, lambda foreign: foreign.close())
    assert race.opened, "no 'capture underway?' check before the device synchronize: the window was not opened"
    race.assert_clean()


def _foreign_used_on_open_stream():
    owner = accel.Buffer(4096)
    foreign = accel.Buffer.from_ptr(owner.ptr, 4096, owner=owner)
    s = accel.Stream()
    foreign.fill_(5, stream=s)
    return foreign, s


@DEVICES
def test_a_foreign_buffer_release_does_not_invalidate_another_threads_capture(monkeypatch, capture_device):
    use_sim(monkeypatch, "cuda")
    _warm()
    race = _Race()

    def act(state):
        foreign, s = state
        race.began.wait(10)                 # the other thread's capture is underway
        foreign.close()
        s.close()

    _run(race, capture_device, _foreign_used_on_open_stream, act, wait_window=False)
    race.assert_capture_kept()


# -- 5. export of a buffer whose last-use stream was closed (no check at all) ------------------------

def _buffer_last_used_on_closed_stream():
    buf = accel.Buffer(4096)
    s = accel.Stream()
    buf.fill_(6, stream=s)
    s.close()
    return buf, accel.Stream()


EXPORTS = {
    # accel/buffer/buffer_class.py:748 Buffer.__cuda_array_interface__ -> wait_for_closed (cudaDeviceSynchronize)
    "cuda-array-interface": lambda buf, consumer: buf.__cuda_array_interface__,
    # accel/_dlpack/ordering.py:104 _sync_for_consumer -> wait_for_closed (cudaDeviceSynchronize)
    "dlpack": lambda buf, consumer: buf.__dlpack__(stream=consumer),
}


@DEVICES
@pytest.mark.parametrize("export", sorted(EXPORTS))
def test_exporting_a_buffer_whose_stream_closed_does_not_invalidate_another_threads_capture(monkeypatch,
                                                                                             capture_device, export):
    use_sim(monkeypatch, "cuda")
    _warm()
    race = _Race()

    def act(state):
        buf, consumer = state
        race.began.wait(10)                 # the other thread's capture is underway
        EXPORTS[export](buf, consumer)

    _run(race, capture_device, _buffer_last_used_on_closed_stream, act, wait_window=False)
    race.assert_capture_kept()


# -- 6. the end of a capture: uncounted before cudaStreamEndCapture (CudaBackend.capture_end) -------

def _ending_cases():
    for device in (1, 0):
        # the allocators still count an accel.Graph capture then (_guards.pool_captures, until
        # end_allocate_to_pool): a guard
        yield pytest.param(device, "allocator-query", id=f"allocator-query-capture-on-{device}")
        yield pytest.param(device, "module-close", id=f"module-close-capture-on-{device}")


ENDING_ACTS = {
    "allocator-query": lambda: _pending_block_then(lambda _: accel.Buffer(1 << 16).close()),
    "module-close": lambda: (_loaded_module, lambda m: m.close()),
}


@pytest.mark.parametrize("capture_device, what", list(_ending_cases()))
def test_a_call_while_a_capture_ends_does_not_invalidate_it(monkeypatch, capture_device, what):
    # Here the capturing thread holds the window open: between capture_end's count going down and
    # its cudaStreamEndCapture it waits up to WINDOW_S for the other thread's call, which finds no
    # capture counted (the allocator: a freed block's cudaEventQuery; Module.close: cudaLibraryUnload).
    use_sim(monkeypatch, "cuda")
    be = _warm()
    ending, asked = threading.Event(), threading.Event()
    errors, check_errors, results = [], [], []
    end = be.lib.cudaStreamEndCapture

    def end_after_a_pause(*args):
        if threading.current_thread().name == "capture" and not ending.is_set():
            ending.set()
            asked.wait(WINDOW_S)            # another thread's check and query would run here
        return end(*args)
    monkeypatch.setattr(be.lib, "cudaStreamEndCapture", end_after_a_pause)

    def capture():
        try:
            with accel.device_index(capture_device):
                s, src, dst = accel.Stream(), accel.Buffer(4096), accel.Buffer(4096)
                src.copy_from(PAYLOAD)
                accel.synchronize()
                g = accel.Graph()
                with s:
                    g.capture_begin()
                    try:
                        dst.copy_from(src, non_blocking=True)
                    finally:
                        g.capture_end()
                dst.fill_(0)
                g.replay()
                results.append(dst.to_numpy().tobytes() == PAYLOAD)
                g.reset()
                s.close()
        except Exception as exc:            # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            ending.set()

    def check():
        try:
            with accel.device_index(0):
                prepare, act = ENDING_ACTS[what]()
                state = prepare()
                ending.wait(10)
                act(state)
        except Exception as exc:            # noqa: BLE001
            check_errors.append(exc)
        finally:
            asked.set()

    threads = [threading.Thread(target=capture, name="capture"), threading.Thread(target=check, name="check")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors + check_errors, errors + check_errors
    assert results == [True]


# -- 7. the allocators' gated windows, the capture on the same device too; and on XPU --------------
#
# The XPU backend applies CUDA's rule itself (GraphsMixin._unsafe: mem_free, host_free, event and
# stream queries and synchronizes, device_synchronize invalidate another thread's global-mode
# capture and raise), so it has a gate too (it had Backend's do-nothing one: every window below
# was open there).

def _pending_block_then(act):
    """A buffer used on a side stream and freed: its block waits for an event."""
    def prepare():
        s = accel.Stream()
        b = accel.Buffer(1 << 16)
        b.fill_(1, stream=s)
        b.record_stream(s)
        b.close()
        return s
    return prepare, act


def _kept_buffer_on_closed_stream():
    def prepare():
        keep = accel.Buffer(1 << 16)
        s = accel.Stream()
        keep.fill_(2, stream=s)
        keep.record_stream(s)
        return keep, s

    def act(state):
        keep, s = state
        s.close()                       # the idle check queries the dying stream
        keep.close()
    return prepare, act


def _pinned_pending():
    def prepare():
        s = accel.Stream()
        host = accel.empty_pinned(4096)
        dst = accel.Buffer(4096)
        dst.copy_from(host, stream=s, non_blocking=True)
        del host                        # its block waits for an event recorded on s
        return s, dst

    def act(_):
        accel.empty_pinned(4096)        # the pinned allocator queries the pending event
    return prepare, act


def _threshold_free():
    # release_threshold:0: a segment that becomes wholly free goes back to the device at once
    # (cudaFree / zeMemFree), unless a capture is underway
    # (32 MiB: a segment of its own, shared with no other buffer)
    return (lambda: accel.Buffer(32 << 20)), (lambda b: b.close())


def _mempool_release():
    def prepare():
        pool = memory.MemPool()
        with memory.use_mem_pool(pool):
            accel.Buffer(1 << 20).close()
        return [pool]

    def act(holder):
        holder.clear()                  # ~MemPool: its whole free segments go back to the device
    return prepare, act


ALLOCATOR_WINDOWS = {
    "malloc-processes-events": (lambda: _pending_block_then(lambda _: accel.Buffer(1 << 16).close()), ""),
    "empty-cache-synchronizes": (lambda: _pending_block_then(lambda _: memory.device_allocator(0).empty_cache()),
                                 ""),
    "closed-stream-idle-check": (_kept_buffer_on_closed_stream, ""),
    "pinned-events": (_pinned_pending, ""),
    "release-threshold-free": (_threshold_free, "expandable_segments:False,release_threshold:0"),
    "mempool-release": (_mempool_release, "expandable_segments:False"),
}

def _allocator_cases():
    """(kind, capture device, scenario).  On XPU with the capture on device 0 too, the device
    allocator's own lock, which capture_begin also takes (begin_allocate_to_pool), keeps the
    capture from beginning during the window; not the process-wide pinned allocator's."""
    for scenario in sorted(ALLOCATOR_WINDOWS):
        for device in (1, 0):
            for kind in ("cuda", "xpu"):
                yield pytest.param(kind, device, scenario, id=f"{scenario}-capture-on-{device}-{kind}")


def _watch_allocator_checks(monkeypatch, race: _Race) -> None:
    """Make the allocators' "capture underway?" check (``_guards.capture_underway``, also
    imported by _caching, _uses and the pinned allocator) wait in ``race`` after a negative answer."""
    check = _guards.capture_underway

    def check_then_wait(be):
        underway = check(be)
        if not underway:
            race.wait_here()            # another thread's capture would begin here
        return underway
    for module in (_guards, _caching, _uses, importlib.import_module("accel.memory._host")):
        monkeypatch.setattr(module, "capture_underway", check_then_wait)


@pytest.mark.parametrize("kind, capture_device, scenario", list(_allocator_cases()))
def test_an_allocator_call_does_not_invalidate_a_capture_beginning_meanwhile(monkeypatch, kind, capture_device,
                                                                            scenario):
    make, conf = ALLOCATOR_WINDOWS[scenario]
    use_sim(monkeypatch, kind, **({"ACCEL_ALLOC_CONF": conf} if conf else {}))
    _warm()
    race = _Race()
    _watch_allocator_checks(monkeypatch, race)
    _run(race, capture_device, *make())
    assert race.opened, "no check before the allocator's call: the window was not opened"
    race.assert_clean()
