"""Adversarial review (r67j) of the lead's fix commits 45066e9, 389f801 and 38bc910 (with
2605ae7 for context), outside the simulator.

Looked at: ``check_stream_live`` (accel/memory/_uses.py), now called by the caching, host
and cudaMallocAsync allocators' record_stream; ``_refuse_waiting_from_capture``
(accel/_dlpack/ordering.py), the refusal of a DLPack wait for work outside a capture; ``_drop_stale_imports``
(accel/_lazy.py) in a forked child; the graph holder's ``discarded`` slot, ``_KeptInUse.of`` and
``_fin.defer`` queuing ``(finalize, (fn,) + args)``; ``_finite``/``_dtype_name`` of the random
fills; ``_check_pool``; ``with`` on a closed Buffer or Module.

Bugs found (each of these tests failed first; all fixed in session 27):

* Level Zero, a ``capture_error_mode="relaxed"`` capture: ``buffer.__dlpack__()`` (stream=None,
  a host wait for the buffer's last use, also what ``accel.from_dlpack`` asks) of a buffer last
  used outside the capture is now refused with CaptureError.  A relaxed capture permits that
  host wait (it worked before 389f801, and the capture stayed valid): ``_refuse_waiting_from_capture``
  refuses any host wait while this thread's current stream captures, whatever the mode.
* The same host wait while a *global* capture runs in another thread, or in this thread on
  another device, is not refused: the synchronize still reaches the backend and invalidates that
  capture (the check asks only whether this thread's current stream of the buffer's device
  captures).
* ``_finite`` takes a 0-d numpy array of str or bytes (``np.array('0.5')``: the numeric-str
  refusal r67i asked for, through numpy) and a numpy complex scalar (its imaginary part dropped
  with a ComplexWarning, where a Python complex is refused).

Passing guards (paths checked that hold): record_stream of default streams, of another device's
stream with device_index, of CUDA's legacy handle 1, of a raw CUDA handle accel did not make,
and of a stream another thread closed while it was held (all accepted; empty_cache works after);
a DLPack export to the capturing stream of a buffer last used on a side stream that joined the
capture; a fork while another thread runs an accel module's body (the child imports it afresh);
pool ids from MemPool().id, generate_graph_pool_handle() and numpy; the float and dtype forms the
fills take.
"""

import decimal
import fractions
import threading

import numpy as np
import pytest

import accel
import accel.random as R
from accel import _lazy, memory, streams
from conftest import SIMS, use_sim
from test_user_programs import run_program


def _need(kind):
    if kind not in SIMS:
        pytest.skip(f"ACCEL_TEST_SIMS leaves out {kind}")


# -- (1) record_stream's live-stream check: guards -------------------------------------------------
@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_record_stream_takes_every_live_stream_form(monkeypatch, kind):
    """Default streams (Buffer and allocator), another device's stream and default stream with
    device_index, CUDA's legacy handle 1 and a raw handle accel did not make, and a stream another
    thread closed while this one held it: all accepted, and the allocator frees and empties its
    cache afterwards (nothing kept wedges it)."""
    _need(kind)
    use_sim(monkeypatch, kind)
    be = _lazy.lazy_init()
    b = accel.Buffer(256)
    alloc = memory.device_allocator(0)
    b.record_stream(accel.default_stream(0))
    alloc.record_stream(b.ptr, be.default_stream(0))
    if accel.device_count() > 1:
        s1 = accel.Stream(1)
        alloc.record_stream(b.ptr, s1.handle, 1)
        alloc.record_stream(b.ptr, be.default_stream(1), 1)
    raw = None
    if kind == "cuda":
        alloc.record_stream(b.ptr, 1)               # cudaStreamLegacy
        raw = be.stream_create(0)
        alloc.record_stream(b.ptr, raw, 0)
    s = accel.Stream(0)
    hold = streams._Hold(s)
    hold.__enter__()
    t = threading.Thread(target=s.close)
    t.start()
    t.join(10)
    assert s._closed
    alloc.record_stream(b.ptr, s._handle, 0)        # still alive: its destroy waits for the hold
    hold.__exit__(None, None, None)
    b.close()
    accel.synchronize()
    memory.empty_cache()
    if raw is not None:
        be.stream_destroy(raw)
    assert memory.memory_allocated(0) == 0


# -- (2) DLPack waits inside a capture ---------------------------------------------------------------
def _filled_outside():
    b = accel.Buffer(64)
    b.fill_(1)
    accel.synchronize()
    return b


def test_xpu_relaxed_capture_allows_the_host_wait_of_a_dlpack_export(monkeypatch):
    """Level Zero, relaxed mode: __dlpack__() waits on the host for the buffer's last use (a
    stream outside the capture).  The backend permits a synchronize in a relaxed capture
    (XPU _unsafe, as CUDA's relaxed mode), so the export works and the capture stays valid."""
    _need("xpu")
    use_sim(monkeypatch, "xpu")
    b = _filled_outside()
    cap, target = accel.Stream(), accel.Buffer(64)
    g = accel.Graph(capture_error_mode="relaxed")
    exported = None
    with cap:
        g.capture_begin()
        target.fill_(2)
        try:
            exported = b.__dlpack__()
        finally:
            g.capture_end()
    target.fill_(0)
    g.replay()
    accel.synchronize()
    assert (target.to_numpy() == 2).all()
    assert exported is not None


def test_xpu_host_wait_export_during_another_threads_global_capture_leaves_it_valid(monkeypatch):
    """Another thread captures (global mode) on device 0; this thread exports a buffer last used
    on the default stream with stream=None (a host wait).  Refused or done, the other thread's
    capture must still end valid (a synchronize during a global capture invalidates it)."""
    _need("xpu")
    use_sim(monkeypatch, "xpu")
    b = _filled_outside()
    cap, target = accel.Stream(0), accel.Buffer(64)
    g = accel.Graph()
    begun, exported = threading.Event(), threading.Event()
    result = {}

    def capture():
        try:
            with cap:
                g.capture_begin()
                target.fill_(2)
                begun.set()
                exported.wait(10)
                g.capture_end()
            result["end"] = "ok"
        except Exception as exc:
            result["end"] = f"{type(exc).__name__}: {exc}"
        finally:
            begun.set()

    t = threading.Thread(target=capture)
    t.start()
    begun.wait(10)
    try:
        b.__dlpack__()
    except (RuntimeError, BufferError, ValueError):
        pass
    finally:
        exported.set()
        t.join(20)
    assert result.get("end") == "ok", result


def test_xpu_host_wait_export_while_capturing_on_another_device_leaves_it_valid(monkeypatch):
    """This thread captures (global mode) on device 1 and exports a device-0 buffer with
    stream=None: the host wait is a synchronize inside this thread's capture."""
    _need("xpu")
    use_sim(monkeypatch, "xpu")
    b = _filled_outside()
    cap, target = accel.Stream(1), accel.Buffer(64, device=1)
    g = accel.Graph()
    with cap:
        g.capture_begin()
        target.fill_(2)
        try:
            b.__dlpack__()
        except (RuntimeError, BufferError, ValueError):
            pass
        try:
            g.capture_end()
        except accel.CaptureError as exc:
            g.reset()
            pytest.fail(f"the export invalidated the capture: {exc}")
    target.fill_(0)
    g.replay()
    accel.synchronize(1)
    assert (target.to_numpy() == 2).all()


def test_cuda_export_to_the_capture_of_a_buffer_last_used_on_a_joined_side_stream(monkeypatch):
    """Guard: the buffer's last use is on a side stream that joined the capture (it waited for the
    capturing stream); an export to the capturing stream records and waits inside the capture,
    which CUDA allows: neither refused nor invalidating."""
    _need("cuda")
    use_sim(monkeypatch, "cuda")
    cap, side = accel.Stream(), accel.Stream()
    b, target = accel.Buffer(64), accel.Buffer(64)
    accel.synchronize()
    g = accel.Graph()
    with cap:
        g.capture_begin()
        side.wait_stream(cap)
        b.fill_(3, stream=side)
        assert b.last_stream == side
        b.__dlpack__(stream=cap.handle)
        target.copy_from(b, stream=cap)
        g.capture_end()
    target.fill_(0)
    g.replay()
    accel.synchronize()
    assert (target.to_numpy() == 3).all()


# -- (3) a fork while another thread runs an accel module's body ------------------------------------
_FORK_DURING_MODULE_BODY = r'''
import importlib.abc, importlib.machinery, os, signal, sys, threading
import accel
PARENT = os.getpid()
running, forked = threading.Event(), threading.Event()


class SlowLoader(importlib.abc.Loader):
    """accel._r67j_probe: its body waits (in the parent, at most 0.5 s) for the other thread's
    fork, so the fork lands while the module is in sys.modules, half run, its lock held."""
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.started = True
        if os.getpid() == PARENT:
            running.set()
            forked.wait(0.5)
        module.done = True


class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "accel._r67j_probe":
            return importlib.machinery.ModuleSpec(name, SlowLoader())
        return None


sys.meta_path.insert(0, Finder())
status = {}


def forker():
    running.wait(10)
    pid = os.fork()
    if pid == 0:
        signal.alarm(2)
        import accel._r67j_probe as probe
        os.write(1, b"child: done=%d\n" % bool(getattr(probe, "done", False)))
        os._exit(0)
    forked.set()
    _, st = os.waitpid(pid, 0)
    status["child"] = os.waitstatus_to_exitcode(st)


t = threading.Thread(target=forker)
t.start()
import accel._r67j_probe
t.join(30)
print("child exit", status.get("child"))
'''


def test_a_child_forked_while_another_thread_runs_an_accel_module_body_imports_it_afresh(monkeypatch):
    """Guard for _drop_stale_imports: the half-run module (in sys.modules, ``_initializing``) and
    its lock, owned by a thread the child does not have, are dropped: the child's import runs the
    body again to its end instead of returning the half module or hanging."""
    _need("cuda")
    use_sim(monkeypatch, "cuda")
    proc = run_program(_FORK_DURING_MODULE_BODY, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "child exit 0" in proc.stdout.splitlines(), proc.stdout
    assert "child: done=1" in proc.stdout.splitlines(), proc.stdout


# -- (4) random fills' arguments, pool ids -------------------------------------------------------------
_NOT_REAL = {
    "0-d str array": np.array("0.5"),
    "0-d bytes array": np.array(b"0.5"),
    "numpy complex": np.complex128(0.5 + 1j),
}


@pytest.mark.parametrize("what", list(_NOT_REAL))
def test_rng_float_arguments_refuse_numpy_strings_and_complex(monkeypatch, what):
    """As a str '0.5' and a Python complex are refused (TypeError, the state untouched), so are
    their numpy forms: ``mean=np.array('0.5')`` and ``mean=np.complex128(0.5+1j)``."""
    _need("cuda")
    use_sim(monkeypatch, "cuda")
    b = accel.Buffer(64)
    state = R.get_rng_state(0).tobytes()
    with pytest.raises(TypeError):
        R.normal_(b, mean=_NOT_REAL[what])
    assert R.get_rng_state(0).tobytes() == state


_REAL = {
    "float subclass": type("F", (float,), {})(0.5),
    "np.float16": np.float16(0.5),
    "np.float32": np.float32(0.5),
    "Decimal": decimal.Decimal("0.5"),
    "Fraction": fractions.Fraction(1, 2),
    "np.int64": np.int64(0),
}


@pytest.mark.parametrize("what", list(_REAL))
def test_rng_float_arguments_take_real_numbers(monkeypatch, what):
    _need("cuda")
    use_sim(monkeypatch, "cuda")
    b = accel.Buffer(64)
    R.normal_(b, mean=_REAL[what], std=1.0, dtype="float32")
    R.uniform_(b, "float32", low=_REAL[what], high=1.0)
    accel.synchronize()


@pytest.mark.parametrize("dtype", ["float32", np.float32, np.dtype("<f4"), "=f4", "f"])
def test_rng_dtype_forms_of_native_float32(monkeypatch, dtype):
    _need("cuda")
    use_sim(monkeypatch, "cuda")
    b = accel.Buffer(64)
    R.uniform_(b, dtype)
    accel.synchronize()
    out = b.to_numpy("float32")
    assert ((out >= 0) & (out < 1)).all()


def test_pool_ids_from_every_source_are_taken(monkeypatch):
    """Guard for _check_pool: MemPool().id, generate_graph_pool_handle() and numpy integer ids
    make a graph pool and filter memory_snapshot, as before."""
    _need("cuda")
    use_sim(monkeypatch, "cuda")
    from accel.graphs import _check_pool
    ids = [accel.MemPool().id, accel.graphs.generate_graph_pool_handle()]
    for pid in ids:
        assert _check_pool(pid) == tuple(pid)
        np_id = tuple(np.uint64(x) for x in pid)
        assert _check_pool(np_id) == tuple(pid)
        accel.Graph(pool=np_id)
        assert memory.memory_snapshot(mempool_id=np_id) == memory.memory_snapshot(mempool_id=pid)
    with pytest.raises(ValueError):
        _check_pool((-1, 0))
    with pytest.raises(TypeError):
        _check_pool((True, 1))
