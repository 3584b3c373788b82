"""r83a: adversarial review of 603692b (runtime loader: loads() with a refused libcudart, NVML
without libcuda, select() no longer caching 'nothing found'), 633f490 (Graph.replay's deferred
_note_replay and unpin retries, Stream.__new__ forgetting a stale handle on any device, wrappers of
closed accel streams refusing event work, _block_frame by subclass code objects) and 5e61c88.

Vendor rules the checks rest on:
- CUDA Runtime API, cudaStreamCreate: "Creates a new asynchronous stream on the context that is
  current to the calling host thread" and returns it as a ``cudaStream_t`` (an opaque pointer,
  ``typedef struct CUstream_st *cudaStream_t``): one address space per process, so two live
  streams never share a value whichever device they belong to.  Level Zero spec,
  zeCommandListCreateImmediate: "phCommandList [out] pointer to handle of command list object
  created" (a pointer again).  Metal: MTLCommandQueue objects (Apple, "MTLDevice
  makeCommandQueue()"); accel numbers its own.
- CUDA Runtime API, cudaFreeAsync: "The allocation must not be accessed after stream execution
  reaches the free" (a replay's use must be noted before the block can be handed on).
- CUDA programming guide, "Initialization": the runtime initializes lazily, and a child process
  forked after the parent initialized CUDA cannot use it (REFERENCE.md "Hardware rules"); the
  fork-safe count is NVML's (torch's _device_count_nvml).
- nvml.h, nvmlSystemGetCudaDriverVersion_v2: "NVML_ERROR_LIBRARY_NOT_FOUND if libcuda.so.1 or
  libcuda.dll is not found".
- Python's with statement and contextlib: docs are silent on subclass frames; the rule is accel's
  own (DESIGN: a block is keyed by the frame running the with statement).
"""

import contextlib
import functools
import gc
import os
import sys
import threading
import weakref

import pytest

import accel
from accel import Graph

import test_interrupt_allocator as tia
from conftest import use_sim
from torch_port_util import hold

DEV = 1
N = 1 << 12


@pytest.fixture
def cuda(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=50)
    accel.set_device_index(0)
    accel._lazy.lazy_init()
    return "cuda"


def _join(t):
    t.join(5)
    assert not t.is_alive()


def _later(gate, delay=0.05):
    t = threading.Timer(delay, gate.set)
    t.start()
    return t


def _sync_all():
    for i in range(accel.device_count()):
        accel.synchronize(i)


def _captured(stream, work, g=None):
    g = Graph() if g is None else g
    with stream:
        g.capture_begin()
        try:
            work()
        finally:
            g.capture_end()
    return g


def _stack():
    from accel.streams import _state
    return list(getattr(_state._tls, "stack", []) or [])


def _defaults():
    return all(accel.current_stream(i) == accel.default_stream(i) for i in range(accel.device_count()))


# == 633f490: Stream.__new__ forgets a stale wrapper of the new handle on any device ===============

@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_live_streams_of_two_devices_never_share_a_handle_and_none_is_forgotten(monkeypatch, kind):
    """Handles are process-wide values on each backend (cudaStream_t, ze_command_list_handle_t are
    pointers): creating, closing and re-creating streams on both devices in turn never closes a
    live stream of the other device, and a freed value reissued on the other device is the new
    stream's alone."""
    use_sim(monkeypatch, kind)
    accel._lazy.lazy_init()
    live = []
    for round_ in range(6):
        for dev in (0, 1):
            s = accel.Stream(dev)
            live.append(s)
        handles = [s.handle for s in live]
        assert len(set(handles)) == len(handles)
        assert not any(s._closed for s in live)
        victim = live.pop(round_ % len(live))
        victim.close()
    for s in live:
        e = s.record_event()
        e.synchronize()
        assert not s._closed
    for s in live:
        s.close()


def test_mps_handles_are_unique_across_streams(monkeypatch):
    use_sim(monkeypatch, "mps")
    accel._lazy.lazy_init()
    streams = [accel.Stream() for _ in range(4)]
    streams[1].close()
    streams.append(accel.Stream())
    assert len({s.handle for s in streams if not s._closed}) == 4
    assert not any(s._closed for i, s in enumerate(streams) if i != 1)


def test_stream_creation_counts_devices_without_reprobing(cuda):
    """The new loop asks backend.count() per Stream: after init that is the runtime's final count,
    no library call."""
    accel.Stream(1)
    before = dict(accel.sim.calls())
    for _ in range(20):
        accel.Stream(1).close()
    after = dict(accel.sim.calls())
    grown = {k for k in after if after[k] != before.get(k, 0)}
    assert not any(k.startswith(("nvml", "cudaGetDeviceCount")) for k in grown), grown


# == 633f490: _block_frame by a subclass's code objects ============================================

class _EnterExitMixin:
    """Not a Stream: its methods reach the base class's through the MRO."""

    def __enter__(self):
        return super().__enter__()

    def __exit__(self, *exc):
        return super().__exit__(*exc)


class MixedIn(_EnterExitMixin, accel.Stream):
    pass


class ViaStatic(accel.Stream):
    @staticmethod
    def _go(s):
        return accel.Stream.__enter__(s)

    @staticmethod
    def _leave(s, *exc):
        return accel.Stream.__exit__(s, *exc)

    def __enter__(self):
        return ViaStatic._go(self)

    def __exit__(self, *exc):
        return ViaStatic._leave(self, *exc)


class ViaClassmethod(accel.Stream):
    @classmethod
    def _go(cls, s):
        return accel.Stream.__enter__(s)

    @classmethod
    def _leave(cls, s, *exc):
        return accel.Stream.__exit__(s, *exc)

    def __enter__(self):
        return self._go(self)

    def __exit__(self, *exc):
        return self._leave(self, *exc)


class ViaProperty(accel.Stream):
    """__enter__ reaches the base class's through a property getter."""

    @property
    def _entered(self):
        return accel.Stream.__enter__(self)

    def __enter__(self):
        return self._entered


def _logged(fn):
    """An ordinary decorator defined outside the class (functools.wraps keeps the name)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


class Decorated(accel.Stream):
    @_logged
    def __enter__(self):
        return super().__enter__()

    @_logged
    def __exit__(self, *exc):
        return super().__exit__(*exc)


class ViaContextmanager(accel.Stream):
    """__enter__/__exit__ delegate to a generator-based contextmanager (whose generator frame runs
    the base class's methods: never passed, so the block is keyed by that generator's frame)."""

    @contextlib.contextmanager
    def _scope(self):
        accel.Stream.__enter__(self)
        try:
            yield self
        finally:
            accel.Stream.__exit__(self, None, None, None)

    def __enter__(self):
        self._cm = self._scope()
        return self._cm.__enter__()

    def __exit__(self, *exc):
        cm, self._cm = self._cm, None
        return cm.__exit__(*exc)


_SUBCLASSES = [MixedIn, ViaStatic, ViaClassmethod, ViaContextmanager]
_SUB_IDS = ["mixin", "staticmethod", "classmethod", "contextmanager"]


def _generator_closed_elsewhere(s1):
    def gen():
        with s1:
            yield

    g = gen()
    next(g)
    assert accel.current_stream(1) == s1
    errors = []

    def close():
        try:
            g.close()
        except BaseException as exc:
            errors.append(exc)
    t = threading.Thread(target=close)
    t.start()
    _join(t)
    return errors


@pytest.mark.parametrize("cls", _SUBCLASSES, ids=_SUB_IDS)
def test_subclass_blocks_in_a_generator_closed_on_another_thread(cuda, cls):
    errors = _generator_closed_elsewhere(cls(1))
    assert errors == []
    assert _stack() == [] and _defaults()


@pytest.mark.parametrize("cls", _SUBCLASSES + [ViaProperty, Decorated],
                         ids=_SUB_IDS + ["property", "decorated"])
def test_subclass_blocks_nested_on_one_thread(cuda, cls):
    a, b = cls(1), cls(0)
    with a:
        with b:
            assert accel.current_stream(0) == b and accel.current_stream(1) == a
        assert accel.current_stream(0) == accel.default_stream(0)
        assert accel.current_stream(1) == a
    assert _stack() == [] and _defaults()


# r83a, fixed in session 40: streams.stream._subclass_codes: a property getter's code
# (property.fget) is not collected, so the getter's frame keys the block: a generator closed on
# another thread leaves the entry on the entering thread's stack, its current stream not restored
def test_property_subclass_block_in_a_generator_closed_on_another_thread(cuda):
    errors = _generator_closed_elsewhere(ViaProperty(1))
    assert errors == []
    assert _stack() == [] and _defaults()


# r83a, fixed in session 40: streams.stream._block_frame/_subclass_codes: an __enter__/__exit__
# wrapped by a decorator defined outside the class runs in the decorator's wrapper code, which is
# not the subclass's: the wrapper frame keys the block, and a generator's close() on another
# thread finds no block
def test_decorated_subclass_block_in_a_generator_closed_on_another_thread(cuda):
    errors = _generator_closed_elsewhere(Decorated(1))
    assert errors == []
    assert _stack() == [] and _defaults()


def test_the_per_class_code_cache_is_bounded_by_live_classes(cuda):
    from accel.streams import stream as stream_mod
    cache = getattr(stream_mod, "_SUBCLASS_CODES", {})      # (none since the r83a fix: no cache)
    gc.collect()
    base = len(cache)
    refs = []
    for i in range(150):
        def enter(self):
            return accel.Stream.__enter__(self)

        def leave(self, *exc):
            return accel.Stream.__exit__(self, *exc)
        cls = type(f"Dyn{i}", (accel.Stream,), {"__enter__": enter, "__exit__": leave})
        s = cls(i % 2)
        with s:
            assert accel.current_stream(i % 2) == s
        s.close()
        refs.append(weakref.ref(cls))
        del cls, s
    gc.collect()
    assert sum(r() is not None for r in refs) == 0
    assert len(cache) <= base + 1


# == 633f490: Graph.replay's _note_replay and unpin ================================================

_CONFS = [(None, None), ("ACCEL_ALLOC_CONF", "expandable_segments:False"),
          ("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")]
_CONF_IDS = ["expandable", "classic", "async"]
_PINS = os.path.abspath(sys.modules["accel.buffer.pins"].__file__)
_GRAPH = os.path.abspath(sys.modules["accel.graphs.graph_class"].__file__)
_ASYNC = os.path.abspath(sys.modules["accel.memory._async"].__file__)


def _conf_sim(monkeypatch, conf, delay=2000):
    var, value = conf
    env = {"ACCEL_SIM_DELAY_US": delay}
    if var is not None:
        env[var] = value
    use_sim(monkeypatch, "cuda", **env)
    accel.set_device_index(0)
    accel._lazy.lazy_init()


def _graph_on_1():
    with accel.device_index(DEV):
        b = accel.Buffer(N).fill_(0)
        src = accel.Buffer(N).fill_(2)
        _sync_all()
        s, r = accel.Stream(), accel.Stream()
        out = {}
        g = _captured(s, lambda: (b.fill_(1), out.setdefault("t", accel.Buffer(N).copy_from(src))))
    return b, src, out.pop("t"), s, r, g


@pytest.mark.parametrize("conf", _CONFS, ids=_CONF_IDS)
def test_an_allocator_raising_in_the_replays_note_drains_and_propagates(monkeypatch, conf):
    """record_stream (the allocator, called by record_noted inside _note_replay) raises: the
    replay's stream is drained before the error propagates, no pin stays, no lock is held (the
    next replay, from another thread too, runs)."""
    _conf_sim(monkeypatch, conf)
    b, src, t, s, r, g = _graph_on_1()
    alloc = accel.memory.device_allocator(DEV)

    def boom(*a, **k):
        raise RuntimeError("r83a: allocator refused")
    monkeypatch.setattr(alloc, "record_stream", boom)
    gate = hold(r)
    timer = _later(gate)
    with pytest.raises(RuntimeError, match="r83a: allocator refused"):
        with accel.device_index(DEV), r:
            g.replay()
    drained = r.query()
    gate.set()
    _join(timer)
    assert drained
    assert not b._pins and not t._pins
    monkeypatch.setattr(alloc, "record_stream", type(alloc).record_stream.__get__(alloc))
    errors = []

    def again():
        try:
            with accel.device_index(DEV), r:
                g.replay()
        except BaseException as exc:
            errors.append(exc)
    th = threading.Thread(target=again)
    th.start()
    _join(th)
    assert errors == []
    _sync_all()
    assert b.last_stream == r and not b._pins
    assert set(b.to_numpy().tolist()) == {1}


@pytest.mark.parametrize("conf", _CONFS, ids=_CONF_IDS)
def test_a_replay_from_a_non_main_thread_records_its_uses(monkeypatch, conf):
    _conf_sim(monkeypatch, conf, delay=50)
    b, src, t, s, r, g = _graph_on_1()
    errors = []

    def work():
        try:
            with accel.device_index(DEV), r:
                g.replay()
        except BaseException as exc:
            errors.append(exc)
    th = threading.Thread(target=work)
    th.start()
    _join(th)
    assert errors == []
    assert b.last_stream == r and not b._pins and not t._pins
    _sync_all()
    assert set(b.to_numpy().tolist()) == {1} and set(t.to_numpy().tolist()) == {2}


def _calls():
    return dict(accel.sim.calls())


@pytest.mark.parametrize("conf", _CONFS, ids=_CONF_IDS)
def test_a_ctrl_c_at_every_point_of_a_device_1_replay(monkeypatch, conf):
    """KeyboardInterrupt at each eval-breaker point of graph_class.py, pins.py and _async.py during
    a replay on device 1: once the launch was queued and the stream not drained, b's use of r is
    recorded; no pin stays; the graph replays again afterwards."""
    _conf_sim(monkeypatch, conf, delay=500)
    b, src, t, s, r, g = _graph_on_1()
    targets = {_GRAPH, _PINS, _ASYNC}
    with tia._Inject(0, targets) as counting:
        with accel.device_index(DEV), r:
            g.replay()
    _sync_all()
    total = counting.count
    assert total > 0
    missing, leaked, streams = [], [], []
    for n in range(1, total + 1):
        with accel.device_index(DEV):
            b.fill_(0)
            r = accel.Stream()
        streams.append(r)
        _sync_all()
        gate = hold(r)
        timer = _later(gate, 0.02)
        before = _calls()
        try:
            with tia._Inject(n, targets) as inj:
                with accel.device_index(DEV), r:
                    g.replay()
        except KeyboardInterrupt:
            pass
        after = _calls()
        launched = after.get("cudaGraphLaunch", 0) != before.get("cudaGraphLaunch", 0)
        drained = r.query()
        gate.set()
        _join(timer)
        if launched and not drained and b.last_stream != r:
            missing.append(inj.site)
        _sync_all()
        if b._pins or t._pins:
            leaked.append(inj.site)
            b._pins.clear()
            t._pins.clear()
    assert not missing, f"uses left unrecorded at {missing} of {total} points"
    assert not leaked, f"pins left at {leaked} of {total} points"
    with accel.device_index(DEV):
        b.fill_(0)
        r = accel.Stream()
    _sync_all()     # (r is a non-blocking stream: the fill must be done before the replay)
    with accel.device_index(DEV), r:
        g.replay()
    _sync_all()
    assert set(b.to_numpy().tolist()) == {1}


# == 603692b: select() no longer keeps 'nothing found'; loads() with a refused libcudart =============
# (fresh interpreters with r82c's stand-in NVML / libcudart: a library is opened once per process)

import test_runtime_loader_r82c as r82c  # noqa: E402
from test_runtime_loader_r82c import TOOLKIT13, W13, ZE_LOADER, _child  # noqa: E402


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    """r82c's stand-ins (NVML answering from STUB_* variables, a logging libcudart.so.13)."""
    if r82c._CC is None:
        pytest.skip("needs a C compiler for the stand-in libraries")
    root = tmp_path_factory.mktemp("r83a")
    return {"nvml": r82c._build(root / "nvml", "libnvidia-ml.so.1", "libnvidia-ml.so.1", r82c._NVML_C),
            "cudart": r82c._build(root / "rt", "libcudart.so.13", "libcudart.so.13", r82c._CUDART_C),
            "root": root}

_SPY = r"""
import json, os, sys, threading
import cffi
opens = []
_real = cffi.FFI.dlopen
def _spy(self, name, *a, **k):
    opens.append(str(name))
    return _real(self, name, *a, **k)
cffi.FFI.dlopen = _spy
import ctypes
_real_cdll = ctypes.CDLL.__init__
def _cdll(self, name, *a, **k):
    opens.append("ctypes:" + str(name))
    return _real_cdll(self, name, *a, **k)
ctypes.CDLL.__init__ = _cdll
import accel
from accel import backends
def log():
    p = os.environ.get("STUB_LOG")
    return open(p).read().split() if p and os.path.exists(p) else []
"""


def test_counting_again_after_nothing_found_reopens_and_reprobes_nothing(stubs, tmp_path):
    """NVML sees no GPU: select() is not kept, so every query counts again, but each backend's
    count is memoized per visibility variables: no library opened again, NVML asked once."""
    log = tmp_path / "log"
    got = _child(_SPY + r"""
first = (accel.device_count(), accel.is_available(), repr(accel.current_accelerator()))
n_opens, n_log = len(opens), len(log())
errors = set()
for _ in range(50):
    accel.device_count(); accel.is_available(); accel.current_accelerator()
    try:
        accel.current_device_index()    # the first device use: refused each time, for the same reason
    except Exception as e:
        errors.add(type(e).__name__)
print(json.dumps({"first": first, "opens": opens, "more_opens": opens[n_opens:],
                  "log_first": n_log, "log_more": log()[n_log:], "init": accel.is_initialized(),
                  "selected": backends._selected_done, "errors": sorted(errors)}))
""", stubs, STUB_NVML_COUNT=0, STUB_NVML_CUDA=13000, STUB_LOG=log)
    assert got["first"][:2] == [0, False]
    assert got["more_opens"] == [] and got["log_more"] == [], got
    assert got["init"] is False and got["selected"] is False and len(got["errors"]) == 1


def test_without_nvml_the_runtime_fallback_count_is_not_repeated_per_query(stubs, tmp_path):
    """No NVML: the count asks the (stand-in) runtime's cudaGetDeviceCount (35: no driver); asking
    again after 'nothing found' must not call it, or open the library, once per query."""
    log = tmp_path / "log"
    got = _child(_SPY + r"""
accel.device_count()
n_opens, n_log = len(opens), len(log())
for _ in range(30):
    accel.device_count(); accel.is_available()
print(json.dumps({"more_opens": opens[n_opens:], "log_more": log()[n_log:], "log": log()}))
""", stubs, nvml=False, ACCEL_CUDART_PATH=stubs["cudart"], STUB_LOG=log, STUB_RT_DRIVER=0)
    assert got["log"].count("cudaGetDeviceCount") == 1, got["log"]
    assert got["more_opens"] == [] and got["log_more"] == [], got


def test_a_child_forked_after_a_count_of_none_counts_again_and_starts_nothing(stubs, tmp_path):
    """The parent counted 0 (CUDA_VISIBLE_DEVICES=''), so nothing was selected or kept; a forked
    child that widens the variable counts again from NVML (fork-safe: no cuInit anywhere) and
    finds CUDA; the parent is left as it was."""
    log = tmp_path / "log"
    got = _child(_SPY + r"""
parent_first = accel.device_count()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    os.environ["CUDA_VISIBLE_DEVICES"] = "1"
    out = {"n": accel.device_count(), "avail": accel.is_available(),
           "acc": repr(accel.current_accelerator()), "init": accel.is_initialized(),
           "started": [b.name for b in backends.started_drivers()]}
    os.write(w, json.dumps(out).encode())
    os._exit(0)
os.close(w)
child = json.loads(os.read(r, 65536).decode())
os.waitpid(pid, 0)
print(json.dumps({"parent_first": parent_first, "child": child, "parent_after": accel.device_count(),
                  "parent_init": accel.is_initialized(), "log": log(),
                  "started": [b.name for b in backends.started_drivers()]}))
""", stubs, STUB_NVML_CUDA=13000, CUDA_VISIBLE_DEVICES="", STUB_LOG=log)
    assert got["parent_first"] == 0 and got["parent_after"] == 0
    assert got["child"] == {"n": 1, "avail": True, "acc": "device(type='cuda')", "init": False, "started": []}, got
    assert got["parent_init"] is False and got["started"] == []
    assert "cudaGetDeviceCount" not in got["log"], got["log"]


def test_threads_counting_while_the_variable_is_widened(stubs):
    """Four threads call device_count() while the main thread widens CUDA_VISIBLE_DEVICES from ''
    to '0,1' before init: no error, every answer 0 or 2, the last ones 2, and CUDA is then kept."""
    got = _child(_SPY + r"""
seen, errors, stop = [], [], threading.Event()
def count():
    try:
        while not stop.is_set():
            seen.append(accel.device_count())
    except BaseException as e:
        errors.append(repr(e))
ts = [threading.Thread(target=count) for _ in range(4)]
for t in ts: t.start()
import time
time.sleep(0.05)
os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
time.sleep(0.05)
stop.set()
for t in ts: t.join(5)
print(json.dumps({"values": sorted(set(seen)), "errors": errors, "last": accel.device_count(),
                  "kept": backends._selected_done, "name": backends._selected.name if backends._selected else None,
                  "alive": any(t.is_alive() for t in ts), "opens": len(opens)}))
""", stubs, STUB_NVML_CUDA=13000, CUDA_VISIBLE_DEVICES="")
    assert got["errors"] == [] and not got["alive"]
    assert set(got["values"]) <= {0, 2} and got["last"] == 2
    assert got["kept"] is True and got["name"] == "cuda"


@pytest.mark.parametrize("var", ["ACCEL_BACKEND", None])
def test_a_requested_backend_is_kept_even_with_no_device_and_the_count_still_follows(stubs, var):
    env = {"STUB_NVML_CUDA": 13000, "CUDA_VISIBLE_DEVICES": ""}
    if var:
        env[var] = "cuda"
    got = _child(_SPY + r"""
first = (accel.device_count(), backends._selected_done)
os.environ["CUDA_VISIBLE_DEVICES"] = "0"
print(json.dumps({"first": first, "then": accel.device_count(), "kept": backends._selected_done,
                  "acc": repr(accel.current_accelerator())}))
""", stubs, **env)
    assert got["first"] == [0, bool(var)]
    assert got["then"] == 1 and got["kept"] is True and got["acc"] == "device(type='cuda')"


@pytest.mark.skipif(ZE_LOADER is None or not (W13 or TOOLKIT13), reason="needs libze_loader and a real libcudart")
@pytest.mark.parametrize("case", ["driver-11.8", "nvml-without-libcuda", "no-nvml-no-driver"])
def test_python_m_accel_with_a_refused_runtime_and_a_level_zero_loader(stubs, case):
    """Only runtimes the driver cannot run, and Debian's Level Zero loader with no GPU driver:
    ``python -m accel`` runs to the end (exit 0) and names libcudart's reason; the public queries
    agree (CUDA the accelerator type, not available)."""
    import subprocess
    env = {"driver-11.8": {"STUB_NVML_CUDA": 11080}, "nvml-without-libcuda": {"STUB_NVML_CUDA_RC": 12},
           "no-nvml-no-driver": {}}[case]
    got = _child(r"""
import json, subprocess, sys, accel
p = subprocess.run([sys.executable, "-m", "accel"], capture_output=True, text=True, timeout=60)
print(json.dumps({"rc": p.returncode, "out": p.stdout, "err": p.stderr[-2000:],
                  "acc": repr(accel.current_accelerator()), "avail": accel.is_available(),
                  "n": accel.device_count()}))
""", stubs, nvml=(case != "no-nvml-no-driver"), **env)
    assert subprocess and got["rc"] == 0, got["err"]
    assert got["acc"] == "device(type='cuda')" and got["avail"] is False and got["n"] == 0
    cuda_part = got["out"].split("  xpu:")[0]
    assert "cuda: 0 device(s)" in cuda_part and "reason:" in cuda_part
    want = {"driver-11.8": "11.8", "nvml-without-libcuda": "libcuda", "no-nvml-no-driver": "no NVIDIA driver"}[case]
    assert want in cuda_part, cuda_part


def _async_graph_with_a_freed_allocation(monkeypatch):
    _conf_sim(monkeypatch, _CONFS[2], delay=50)
    b, src, t, s, r, g = _graph_on_1()
    with accel.device_index(DEV), r:
        g.replay()
    _sync_all()
    t.close()       # the launch's allocation freed: allocated again by the next launch only
    _sync_all()
    return b, src, s, r, g


def test_an_async_graph_reset_after_replays_frees_only_what_a_launch_allocated(monkeypatch):
    """The control of the next test: no Ctrl-C, the reset and a later replay are fine."""
    b, src, s, r, g = _async_graph_with_a_freed_allocation(monkeypatch)
    with accel.device_index(DEV), r:
        g.replay()
    _sync_all()
    g.reset()
    _sync_all()


# CUDA Runtime API, cudaGraphAddMemAllocNode: "If the allocation is not freed in the same graph,
# then it can be accessed ... by stream operations ordered after the graph's execution but before the
# allocation is freed" (no launch: nothing allocated, and cudaFreeAsync of it answers
# cudaErrorInvalidValue, as the simulator does).
# r83a, fixed in session 40: graphs.graph_class.Graph.replay: a KeyboardInterrupt before
# cudaGraphLaunch (as backend.graph_launch starts) is taken for 'may have queued' (only an
# Exception clears queued), so _note_replay tells the cudaMallocAsync allocator of a launch that
# never ran (launches += 1): the graph's reset then cudaFreeAsync's memory no launch allocated
# (cudaErrorInvalidValue)
def test_an_async_graph_reset_after_a_ctrl_c_before_its_launch(monkeypatch):
    """A Ctrl-C as backend.graph_launch starts (a Python function: CPython checks for signals as it
    begins), before cudaGraphLaunch: nothing was queued, so the cudaMallocAsync allocator must not
    count a launch, or it later frees graph memory no launch allocated."""
    b, src, s, r, g = _async_graph_with_a_freed_allocation(monkeypatch)
    backend = accel._lazy._initialized_backend
    real = backend.graph_launch
    before = _calls()

    def interrupted(*a, **k):
        raise KeyboardInterrupt("r83a: as graph_launch starts")
    monkeypatch.setattr(backend, "graph_launch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with accel.device_index(DEV), r:
            g.replay()
    monkeypatch.setattr(backend, "graph_launch", real)
    assert _calls().get("cudaGraphLaunch", 0) == before.get("cudaGraphLaunch", 0)
    _sync_all()
    try:
        g.reset()
    finally:
        _sync_all()


# == 633f490: _subclass_codes, a class changed after its first block; with in a subclass method ======

class Scoped(accel.Stream):
    """A subclass method that holds its own ``with self:`` (a frame of the subclass's code)."""

    def scoped(self, fn):
        with self:
            return fn()


def test_a_with_inside_a_subclass_method_nested_in_a_block_of_the_same_stream(cuda):
    a = Scoped(1)
    with a:
        assert a.scoped(lambda: accel.current_stream(1)) == a
        assert accel.current_stream(1) == a and len(_stack()) == 1
    assert _stack() == [] and _defaults()
    b = Scoped(1)
    with a:
        assert b.scoped(lambda: accel.current_stream(1)) == b
        assert accel.current_stream(1) == a
    assert _stack() == [] and _defaults()


def _fresh_subclass():
    class Patched(accel.Stream):
        def __enter__(self):
            return super().__enter__()

        def __exit__(self, *exc):
            return super().__exit__(*exc)
    return Patched


# r83a, fixed in session 40: streams.stream._subclass_codes: the code set is cached per class at
# its first block, so an __exit__ replaced afterwards (mock.patch.object, a plugin) runs in code
# not in the set: its frame keys the exit, and a generator closed on another thread raises
# '__exit__ without a matching __enter__'
def test_a_subclass_whose_exit_is_replaced_after_its_first_block(cuda):
    cls = _fresh_subclass()
    with cls(1):
        pass

    def __exit__(self, *exc):
        return accel.Stream.__exit__(self, *exc)
    cls.__exit__ = __exit__
    errors = _generator_closed_elsewhere(cls(1))
    assert errors == []
    assert _stack() == [] and _defaults()


def test_a_subclass_whose_exit_is_replaced_before_its_first_block(cuda):
    cls = _fresh_subclass()

    def __exit__(self, *exc):
        return accel.Stream.__exit__(self, *exc)
    cls.__exit__ = __exit__
    errors = _generator_closed_elsewhere(cls(1))
    assert errors == []
    assert _stack() == [] and _defaults()


# == 5e61c88: the DLPack stream TypeError ===========================================================
# Array API standard, array.__dlpack__: stream is "for CUDA and ROCm, a Python integer representing a
# pointer to a stream, on devices that support streams"; "If stream is -1, the value may be used by the
# consumer to signal 'producer must not perform any synchronization'"; "For other device types which
# do have a stream, queue, or similar synchronization/ordering mechanism, the most appropriate type to
# use for stream is not yet determined" (accel takes an accel.Stream there).

@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_the_dlpack_stream_type_error_names_what_this_backend_takes(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    b = accel.Buffer(64).fill_(3)
    accel.synchronize()
    with pytest.raises(TypeError) as info:
        b.__dlpack__(stream=1.5)
    text = str(info.value)
    assert "accel.Stream" in text and kind in text and "1.5" in text
    assert ("cudaStream_t" in text) == (kind == "cuda")
    # the types it names are taken
    s = accel.Stream()
    cap = b.__dlpack__(stream=s)
    cap2 = b.__dlpack__(stream=-1)
    del cap, cap2
    gc.collect()
    if kind == "cuda":
        b.__dlpack__(stream=accel.current_stream().handle or 1)
    else:
        with pytest.raises(ValueError, match="accel.Stream"):
            b.__dlpack__(stream=5)
    gc.collect()
    assert b.to_numpy().tolist()[:1] == [3]
    b.close()
    s.close()


# r83a, fixed in session 40: graphs.graph_class.Graph.replay: a KeyboardInterrupt at the eval-
# breaker point as backend.graph_launch starts (backends/cuda/graphs.py, before cudaGraphLaunch)
# counts a launch with the cudaMallocAsync allocator; the graph's reset then cudaFreeAsync's
# memory no launch allocated (cudaErrorInvalidValue)
def test_a_ctrl_c_at_every_replay_point_then_a_reset_of_an_async_graph(monkeypatch):
    """The same as the test above, at CPython's eval-breaker points of graph_class.py (and the
    starts of the functions it calls): each time a fresh graph whose allocation was freed after
    its first launch, one interrupted replay, then its reset."""
    b, src, s, r, g = _async_graph_with_a_freed_allocation(monkeypatch)
    with tia._Inject(0, {_GRAPH}) as counting:
        with accel.device_index(DEV), r:
            g.replay()
    _sync_all()
    total = counting.count
    g.reset()
    bad = []
    for n in range(1, total + 1):
        with accel.device_index(DEV):
            s, r = accel.Stream(), accel.Stream()
            out = {}
            g = _captured(s, lambda: out.setdefault("t", accel.Buffer(N).copy_from(src)))
            with r:
                g.replay()
        _sync_all()
        out.pop("t").close()
        _sync_all()
        try:
            with tia._Inject(n, {_GRAPH}) as inj:
                with accel.device_index(DEV), r:
                    g.replay()
        except KeyboardInterrupt:
            pass
        _sync_all()
        try:
            g.reset()
        except Exception as exc:
            bad.append((inj.site, type(exc).__name__))
        _sync_all()
    assert not bad, f"resets failed after a Ctrl-C at {bad} of {total} points"


# == 633f490: wrappers of closed accel streams and the DLPack handshake ==============================

def _wrapper_of_closed_reissued(device=DEV):
    s = accel.Stream(device)
    w = accel.Stream.from_handle(s.handle)
    s.close()
    stranger = accel.Stream(device)
    assert stranger.handle == w.handle      # reissued to a stream w's user knows nothing of
    return w, stranger


def _delta(before, after):
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


@pytest.mark.parametrize("op", ["other.wait_stream(w)", "Event.wait(w)", "Event.record(w)", "with w: fill"])
def test_a_wrapper_of_a_closed_accel_stream_is_refused_as_an_argument_too(cuda, op):
    w, stranger = _wrapper_of_closed_reissued()
    with accel.device_index(DEV):
        other = accel.Stream()
        b = accel.Buffer(64).fill_(0)
        ev = other.record_event()
    _sync_all()
    before = _calls()
    with pytest.raises(ValueError, match="closed"):
        if op == "other.wait_stream(w)":
            other.wait_stream(w)
        elif op == "Event.wait(w)":
            ev.wait(w)
        elif op == "Event.record(w)":
            accel.Event().record(w)
        else:
            with w:
                b.fill_(1)
    d = _delta(before, _calls())
    assert not {"cudaStreamWaitEvent", "cudaEventRecord", "cudaEventRecordWithFlags", "cudaMemsetAsync"} & set(d), d
    assert _stack() == [] and _defaults()


# CUDA Runtime API, cudaStreamDestroy: "Use of the handle after this call is undefined behavior"
# (the rule r81a/r82a rest on); array API, __dlpack__: "stream is provided by the consumer to the
# producer to instruct the producer to ensure that operations can safely be performed on the array
# (e.g., by inserting a dependency between streams via 'wait for event')": event work on the
# consumer's stream, which 633f490 refuses on a wrapper of a closed accel stream (Event.wait(w) above).
# r83a, fixed in session 40: _dlpack.ordering._consumer_handle/sync_for_consumer: an accel.Stream
# consumer that wraps a closed accel stream is not checked (_check_alive): __dlpack__(stream=w)
# queues cudaStreamWaitEvent on the stranger stream the runtime reissued the handle to, and
# succeeds
def test_dlpack_with_a_wrapper_of_a_closed_accel_stream_as_the_consumer_is_refused(cuda):
    w, stranger = _wrapper_of_closed_reissued()
    with accel.device_index(DEV):
        other = accel.Stream()
        b = accel.Buffer(64)
        with other:
            b.fill_(0)      # the last use is another stream: the handshake queues a wait on w
    before = _calls()
    try:
        with pytest.raises(ValueError, match="closed"):
            b.__dlpack__(stream=w)
    finally:
        d = _delta(before, _calls())
        _sync_all()
    assert "cudaStreamWaitEvent" not in d, d


def test_dynamic_subclasses_entered_from_several_threads_at_once(cuda):
    """Four threads each make subclasses and enter blocks of them while others are collected: the
    per-class code cache (a WeakKeyDictionary) raises nothing and keeps no dead class."""
    from accel.streams import stream as stream_mod
    errors, refs = [], []

    def work(k):
        try:
            for i in range(25):
                cls = type(f"T{k}_{i}", (MixedIn,), {})
                s = cls(i % 2)
                with s:
                    assert accel.current_stream(i % 2) == s
                s.close()
                refs.append(weakref.ref(cls))
                del cls, s
                if i % 5 == 0:
                    gc.collect()
        except BaseException as exc:
            errors.append(exc)
    ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        _join(t)
    gc.collect()
    assert errors == []
    assert not any(r() is not None for r in refs)
    assert not any(c.__name__.startswith("T") and c.__name__[1:2].isdigit()
                   for c in list(getattr(stream_mod, "_SUBCLASS_CODES", {}).keys()))
