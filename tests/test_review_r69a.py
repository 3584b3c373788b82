"""Adversarial review (r69a) of session 28's accel changes (1ef383b~1..6044cf2): the capture
gate and CUDA's relaxed capture mode, against torch 2.13 and the project's rules (a user's
``__del__`` that calls accel never hangs; a Ctrl-C or a failing vendor call leaves nothing
half-made: no leaked memory, no capture invalidated by accel's own cleanup, no thread state
changed).

Every risky part runs in a forked child or a thread joined with a timeout, so a deadlock fails
the test instead of hanging the run.  Interrupts are injected with the Ctrl-C sweeps' tracer
(tests/test_interrupt_backends.py ``_Inject``: a simulated vendor call counts as a C call,
after whose return CPython runs a pending signal handler), at every point of the CUDA
backend's code in one call, deterministically.

Bugs found (strict xfails; each reason names the cause):

1. **ABBA deadlock between capture_end and a free on another thread, through a user's owner.**
   The releases queued during a capture (``Backend._run_after_captures``) run with the capture
   gate held (CUDA: capture_end's own ``with self.capture_gate``; both: the loop's ``with``).
   A non-owning Buffer's owner (``Buffer.from_ptr(owner=...)``, a DLPack producer) is dropped
   there: the popped ``args`` tuple dies at the next ``popleft`` (or, on CUDA, as
   _run_after_captures returns inside capture_end's gate).  A user's owner whose ``__del__``
   closes an accel Buffer then takes the allocator's lock under the gate, while another
   thread's free of a buffer used on another stream holds the allocator's lock and waits for
   the gate.  r68i fixed accel's own ``_Pin.__del__`` on this path, not a user's finalizer.
2. **A failed restore of the thread's capture mode leaves the thread relaxed.**
   ``CudaBackend._relaxed_capture_mode().__exit__`` raises when
   ``cudaThreadExchangeStreamCaptureMode`` fails, and nothing restores the mode afterwards:
   the thread stays in relaxed mode for good (its later potentially unsafe calls no longer
   protected by CUDA's capture rules), though the error said the call failed.
3. **A Ctrl-C inside the relaxed-mode switch leaves the thread relaxed.** ``_Relaxed`` is a
   Python context manager: an interrupt as the exchange returns inside ``__enter__`` (the
   ``with`` never calls ``__exit__``), or at ``__exit__``'s start, skips the restore.
4. **A Ctrl-C as a capture-time cudaMalloc/cudaHostAlloc returns leaks the memory and
   invalidates the capture.** ``_alloc_maybe_capturing``'s cleanup calls ``cudaFree`` /
   ``cudaFreeHost`` after the mode was restored to global: a potentially unsafe call during a
   global capture, refused (cudaErrorStreamCaptureUnsupported, the capture invalidated: CUDA
   Runtime API, cudaStreamBeginCapture / cudaThreadExchangeStreamCaptureMode), and its
   return code is ignored, so the allocation stays and nobody knows it.
5. **A child forked while another thread takes a pool id hangs in generate_graph_pool_handle.**
   ``accel.memory._mempool._ids_lock`` (made an ``accel._locks.Lock`` this session) gets no
   fresh lock in a forked child, unlike memory's, random's and the backends' locks; the child's
   ``generate_graph_pool_handle()`` (no device needed: torch's works in a forked child) waits
   for good for the parent's thread.

Checked and found fine (no test here): roundup_power2_divisions against libc10 2.13 (28 more
strings: empty lists, blanks, leading zeros and signs, a key given twice in a list, '>' first,
keys past 32 GiB, malformed entries: same tables, errors where torch errs); pinned rounding and
num_host_alloc/num_host_free after reset_accumulated_host_memory_stats against
CachingHostAllocator.h on the three simulators (100 bytes -> 128, 0 bytes allowed).
"""

import glob
import os
import threading
import faulthandler
from types import SimpleNamespace

import pytest

import accel
from accel import CaptureError, _lazy, sim
from accel.streams import on_device
from conftest import run_forked, use_sim

import test_interrupt_backends as tib
from test_concurrency_gc_r68i import _OrderingLock, _child
from test_user_programs import settle

KiB = 1 << 10
GLOBAL, RELAXED = 0, 2          # cudaStreamCaptureMode
CHILD_S = 30.0                  # run_forked's limit (a test bug, never reached)
JOIN_S = 5.0                    # a thread not done after this is deadlocked (the work takes ms)
WAIT_S = 20.0


# =============================================================================================
# 1. capture_end drops a user's owner under the capture gate
# =============================================================================================
class _ClosingOwner:
    """A user's owner of foreign memory: its ``__del__`` hands the memory back by closing the
    accel Buffer it came from (a blocking free, as any user's code may make)."""

    def __init__(self, buf):
        self.buf = buf

    def __del__(self):
        self.buf.close()


def _capture_end_drops_a_closing_owner() -> int:
    def checks():
        dev = accel.device_count() - 1          # device 1, device 0 current
        alloc = accel.memory.device_allocator(dev)
        inner = accel.Buffer(4 * KiB, device=dev).fill_(3)
        v1 = accel.Buffer.from_ptr(inner.ptr, 4 * KiB, device=dev, owner=_ClosingOwner(inner))
        del inner
        spare = accel.Buffer(4 * KiB, device=dev)
        v2 = accel.Buffer.from_ptr(spare.ptr, 4 * KiB, device=dev, owner=None)
        other, s = accel.Stream(dev), accel.Stream(dev)
        b = accel.Buffer(64 * KiB, device=dev).fill_(1)
        b.record_stream(other)              # its free records events: allocator lock, then gate
        accel.synchronize(dev)
        a_asks = threading.Event()
        lock = alloc._lock = _OrderingLock(alloc._lock, a_asks)
        queued = threading.Event()

        def thread_a():
            g = accel.Graph()
            with accel.device_index(dev), s:
                g.capture_begin()
                out = accel.Buffer(4 * KiB)
                out.fill_(1)
                v1.close()          # a capture is underway: both releases wait for its end
                v2.close()
                queued.set()
                assert lock.b_holds.wait(WAIT_S)
                lock.a_ident = threading.get_ident()
                try:
                    g.capture_end()     # runs the queue with the gate held; the owner dies there
                finally:
                    a_asks.set()
            g.replay()

        def thread_b():
            assert queued.wait(WAIT_S)
            b.close()               # allocator lock held, then the capture gate

        threads = [threading.Thread(target=thread_a, name="r68i-A", daemon=True),
                   threading.Thread(target=thread_b, name="r68i-B", daemon=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_S)
        if any(t.is_alive() for t in threads):
            faulthandler.dump_traceback(all_threads=True)
            os._exit(3)
        alloc._lock = lock._real
        spare.close()
        settle()
        assert accel.memory.memory_allocated(dev) == 0
    return _child(checks, CHILD_S - 5)


# (r69a found; fixed: Backend.after_gate drops owners once the thread holds the capture gate no more)
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_capture_end_dropping_a_users_owner_that_frees_never_deadlocks(monkeypatch, kind):
    """Thread A captures on device 1 and closes, during the capture, two non-owning Buffers made
    with ``Buffer.from_ptr``; the first's owner is a user's object whose ``__del__`` closes the
    accel Buffer the memory came from.  Both releases wait for the end of the capture.  Thread B
    frees a buffer used on another stream (the allocator's lock, then the gate) and, holding the
    lock, waits until A asks for it.  A's capture_end runs the queue under the gate and drops
    the owner there: its close() waits for the allocator's lock that B holds while B waits for
    the gate.  Both must finish (the owners dropped after the gate is released), and the
    memory comes back."""
    use_sim(monkeypatch, kind)
    code = run_forked(_capture_end_drops_a_closing_owner, CHILD_S)
    assert code == 0, f"the threads deadlocked or failed (status {code}; stacks on stderr)"


# =============================================================================================
# 2. a failed restore of the capture mode
# =============================================================================================
def _thread_mode(be) -> int:
    """The calling thread's cudaStreamCaptureMode, read by exchanging it twice."""
    m = be.ffi.new("enum cudaStreamCaptureMode *", RELAXED)
    assert be.lib.cudaThreadExchangeStreamCaptureMode(m) == 0
    mode = m[0]
    assert be.lib.cudaThreadExchangeStreamCaptureMode(m) == 0
    return mode


def _set_mode(be, mode: int) -> None:
    m = be.ffi.new("enum cudaStreamCaptureMode *", mode)
    assert be.lib.cudaThreadExchangeStreamCaptureMode(m) == 0


# (r69a found; fixed: CudaBackend._call_relaxed tries a failed restore once more)
def test_a_failed_mode_restore_leaves_the_thread_in_its_capture_mode(monkeypatch):
    """A global-mode capture on device 1 (device 0 current) in a fresh thread; an allocation in
    it makes cudaMalloc in relaxed mode, and the restore of the thread's mode fails once (an
    injected error).  The thread must be back in its own mode, global, afterwards: a one-off
    failure must not leave every later potentially unsafe call of the thread unprotected by
    CUDA's capture rules.  (accel tries the restore once more, so the one-off failure costs
    nothing: the call succeeds.)"""
    use_sim(monkeypatch, "cuda")
    be = _lazy.lazy_init()
    out = {}

    def body():
        s, g = accel.Stream(1), accel.Graph()
        out["before"] = _thread_mode(be)
        sim.inject_error("cudaThreadExchangeStreamCaptureMode", 1, after=1)     # the restore
        try:
            with s, g:
                accel.Buffer(8192).fill_(1)
        except accel.AcceleratorError as exc:
            out["error"] = str(exc)
        finally:
            sim.clear_faults()
        out["after"] = _thread_mode(be)
        g.reset()

    t = threading.Thread(target=body, name="r69a-capture", daemon=True)
    t.start()
    t.join(WAIT_S)
    assert not t.is_alive()
    assert out["before"] == GLOBAL
    assert "error" not in out, out.get("error")
    assert out["after"] == GLOBAL, f"the thread was left in capture mode {out['after']} (2: relaxed)"


# =============================================================================================
# 3-4. a Ctrl-C at each point of a capture-time allocation
# =============================================================================================
def _live():
    st = sim.state()
    return sum(st.live_allocations.values()) + st.host_allocations


def _sweep(which: str) -> list:
    """Inject a KeyboardInterrupt at each point of the CUDA backend's code in one
    ``mem_alloc`` / ``host_alloc`` made during a global-mode capture of a device-1 stream
    (device 0 current), point 1, 2, ... until a run completes.  Per point: the thread's
    capture mode afterwards, whether the capture was still valid, and the simulator
    allocations left (the allocation a completed run returned is freed after the capture)."""
    be = _lazy.lazy_init()
    import accel.backends.cuda as cuda_package
    targets = {os.path.abspath(p) for p in glob.glob(os.path.join(os.path.dirname(cuda_package.__file__), "*.py"))}
    alloc, free = (be.mem_alloc, be.mem_free) if which == "device" else (be.host_alloc, be.host_free)
    with on_device(be, 1):
        stream = be.stream_create()
    assert be.get_device() == 0
    points = []
    n = 1
    while n < 200:
        before = _live()
        with on_device(be, 1):
            be.capture_begin(stream, "global")
            inj, ptr = tib._Inject(n, targets), None
            try:
                with inj:
                    ptr = alloc(4096)
            except KeyboardInterrupt:
                pass
            mode = _thread_mode(be)
            if mode != GLOBAL:
                _set_mode(be, GLOBAL)       # (each point from the same start)
            try:
                be.graph_destroy(be.capture_end(stream))
                valid = True
            except CaptureError:
                valid = False
        if ptr is not None:
            free(ptr)
        points.append(SimpleNamespace(n=n, site=inj.site, mode=mode, valid=valid, left=_live() - before))
        if inj.site is None:
            break       # the run completed: every point was injected
        n += 1
    with on_device(be, 1):
        be.stream_destroy(stream)
    assert points[-1].site is None and len(points) > 5, "the sweep did not complete"
    return points


# (r69a found; fixed: the cleanup frees through _call_maybe_capturing)
@pytest.mark.parametrize("which", ["device", "pinned"])
def test_ctrl_c_in_a_capture_time_allocation_leaks_nothing_and_keeps_the_capture(monkeypatch, which):
    """Every point: nothing is left allocated in the runtime that accel does not own, and the
    capture is still valid (accel's own cleanup must not invalidate it; the free of a memory
    the caller never got is made in relaxed mode, as the allocation was)."""
    use_sim(monkeypatch, "cuda")
    points = _sweep(which)
    bad = [f"point {p.n} ({p.site}): {p.left} allocation(s) left, capture {'valid' if p.valid else 'invalidated'}"
           for p in points if p.left or not p.valid]
    assert not bad, "\n".join(bad)


# (r69a found; fixed: CudaBackend._call_relaxed runs with signals deferred)
def test_ctrl_c_in_a_capture_time_allocation_leaves_the_thread_in_global_mode(monkeypatch):
    """Every point: the thread is back in global mode once the interrupted call returned."""
    use_sim(monkeypatch, "cuda")
    points = _sweep("device")
    bad = [f"point {p.n} ({p.site}): thread left in mode {p.mode}" for p in points if p.mode != GLOBAL]
    assert not bad, "\n".join(bad)


# (r69a found: fixed by accel._locks renewing every Lock in a forked child)
@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_fork_while_a_thread_takes_a_pool_id(monkeypatch, kind):
    """A thread holds ``_mempool._ids_lock`` (as one inside ``new_user_pool_id`` does) while the
    main thread forks, after the parent used device 1.  The child asks for a graph pool handle,
    which needs no device (torch.cuda.graph_pool_handle works in a forked child): it must get
    an id, not wait for the parent's thread."""
    use_sim(monkeypatch, kind)
    from accel.memory import _mempool
    accel.Buffer(64, device=accel.device_count() - 1).close()
    first = accel.graphs.generate_graph_pool_handle()
    held, go = threading.Event(), threading.Event()

    def holder():
        with _mempool._ids_lock:
            held.set()
            go.wait(WAIT_S)

    def child():
        def checks():
            pool = accel.graphs.generate_graph_pool_handle()
            assert pool[0] == 0 and pool[1] > first[1]
        return _child(checks, 3.0)      # (unheld, the call takes microseconds)

    t = threading.Thread(target=holder, name="r69a-holds-ids", daemon=True)
    t.start()
    try:
        assert held.wait(WAIT_S)
        code = run_forked(child, CHILD_S)
    finally:
        go.set()
        t.join(WAIT_S)
    assert code == 0, f"the child hung or failed (status {code}; its stack on stderr)"


def test_the_sweep_reaches_the_capture_time_allocation(monkeypatch):
    """Guard of the two sweeps above: points are injected in the allocation's own code (the
    backend's _alloc_maybe_capturing, after the vendor call), and an uninterrupted
    capture-time allocation keeps the capture valid, the mode global and frees cleanly (so
    the xfails above fail for the reasons they name).  (Points inside the relaxed-mode switch
    exist today; a fix that defers signals there removes them, so they are not required.)"""
    use_sim(monkeypatch, "cuda")
    points = _sweep("device")
    sites = {p.site for p in points if p.site}
    assert any("_alloc_maybe_capturing" in s for s in sites), sites
    last = points[-1]
    assert last.valid and last.mode == GLOBAL and last.left == 0
