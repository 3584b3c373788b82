"""Shared fixtures: every test starts with accel's process state forgotten, and
``sim_backend`` runs a test once per simulated runtime.

Test-run knobs (kept from the caller's environment): ACCEL_TEST_SIMS, ACCEL_TEST_LOAD_S,
ACCEL_TEST_THOROUGH (the long soaks, fuzzers and sweeps at full size), ACCEL_TEST_ALLOC_CONF
(rerun under other allocator settings) and ACCEL_TEST_SIM_PEER (rerun with ACCEL_SIM_PEER set to it, e.g. ``none``: simulated devices that cannot reach each other's memory;
a test setting ACCEL_SIM_PEER itself overrides it; device tests never see it)."""

import contextlib
import gc
import os
import signal
import sys
import time

import pytest

from accel import _lazy

_ENV_PREFIXES = ("ACCEL_", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "ZE_AFFINITY_MASK", "ZES_ENABLE_SYSMAN",
                 "ZE_ENABLE_ALT_DRIVERS",
                 "ZE_FLAT_DEVICE_HIERARCHY", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF",
                 "CUDA_MODULE_LOADING")
_KEEP = ("ACCEL_TEST_SIMS", "ACCEL_TEST_LOAD_S", "ACCEL_TEST_ALLOC_CONF", "ACCEL_TEST_SIM_PEER", "ACCEL_TEST_THOROUGH")

#: What a real-device test (``pytest -m device``) keeps from the caller: which physical devices
#: it may use and in what order, which runtime, and where the vendor libraries are.  Without
#: them it would silently test physical device 0 with the default libraries.
_DEVICE_KEEP = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "ZE_AFFINITY_MASK", "ZE_FLAT_DEVICE_HIERARCHY",
                "ACCEL_BACKEND")

#: Simulators the shared suites run on; ACCEL_TEST_SIMS=cuda,xpu narrows it.
ALL_SIMS = ("cuda", "xpu", "mps")
SIMS = tuple(s for s in os.environ.get("ACCEL_TEST_SIMS", ",".join(ALL_SIMS)).split(",") if s)

#: ACCEL_TEST_THOROUGH=1: the long soaks, fuzzers and Ctrl-C sweeps at their full sizes (every
#: injection point, more seeds and steps).  The default run (CI) runs each at a part of that, so
#: the whole suite stays near 11 minutes on two cores (CI allows 20; each sweep keeps a point of every
#: site it covers, every test and parametrization runs).
THOROUGH = os.environ.get("ACCEL_TEST_THOROUGH", "") not in ("", "0")


# A run started in the background by a non-interactive shell (``pytest ... &``, ``nohup``)
# inherits SIGINT ignored (POSIX: an asynchronous list without job control gets SIG_IGN), and
# CPython then installs no KeyboardInterrupt handler: _thread.interrupt_main does nothing (the
# Ctrl-C redelivery tests failed) and every program a test starts inherits the ignored signal
# across exec (a child sent SIGINT never stopped: a 120 s hang).  The suite tests Ctrl-C, so it
# runs with the handler an interactive Python has.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def kept_for_device_tests(key: str) -> bool:
    """True for the variables a real-device test keeps (``_DEVICE_KEEP`` and ``ACCEL_*_PATH``)."""
    return key in _DEVICE_KEEP or (key.startswith("ACCEL_") and key.endswith("_PATH"))


def dropped_env(environ, device_test: bool) -> list:
    """The names in ``environ`` a test must not see: every accel, simulator, allocator and
    visible-device setting, except the test-run knobs and, for device tests, the caller's
    choice of devices and libraries."""
    return sorted(key for key in environ
                  if key.startswith(_ENV_PREFIXES) and key not in _KEEP
                  and not (device_test and kept_for_device_tests(key)))


@pytest.fixture(autouse=True)
def clean_state(request, monkeypatch):
    """No test sees the developer's ACCEL_*/visible-device variables or another test's state.

    Tests marked ``device`` keep CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER, ZE_AFFINITY_MASK,
    ZE_FLAT_DEVICE_HIERARCHY, ACCEL_BACKEND and ACCEL_*_PATH, so ``pytest -m device`` runs on
    the devices and libraries the caller chose; they still never see ACCEL_SIM*."""
    device_test = request.node.get_closest_marker("device") is not None
    for key in dropped_env(os.environ, device_test):
        monkeypatch.delenv(key)
    knob = os.environ.get("ACCEL_TEST_ALLOC_CONF")
    if knob:
        # rerun a suite under other allocator settings (as torch's test_cuda_expandable_segments.py
        # reruns test_cuda.py), through the variable read last, so that a test setting any of the
        # three itself overrides it; accel's own keys are read only from ACCEL_ALLOC_CONF
        from accel.memory._config import ACCEL_ONLY
        accel_keys = any(part.split(":")[0].strip() in ACCEL_ONLY for part in knob.split(","))
        monkeypatch.setenv("ACCEL_ALLOC_CONF" if accel_keys else "PYTORCH_ALLOC_CONF", knob)
    peer = os.environ.get("ACCEL_TEST_SIM_PEER")
    if peer and not device_test:
        # rerun a suite on a simulated machine whose devices are peers only as it says (r71p)
        monkeypatch.setenv("ACCEL_SIM_PEER", peer)
    _lazy._reset_for_tests()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    _lazy._reset_for_tests()
    # pytest keeps a failed (or xfailed) test's exception in sys.last_* for post-mortem debugging:
    # its frames hold the test's accel objects until the next failure, and a freeze of the heap
    # meanwhile (pytest_runtest_teardown) would make them immortal
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if getattr(sys, name, None) is not None:
            setattr(sys, name, None)
    left = signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    # A signal left blocked in pytest's main thread is blocked in every program a later test
    # starts (a child inherits the mask): a Ctrl-C test then never sees its SIGALRM (CI hung).
    assert left == mask, f"the test left the main thread's signal mask {sorted(left)}, not {sorted(mask)}"


@contextlib.contextmanager
def _heap_frozen(clean: bool = False):
    """``gc.freeze()`` of what lives now, after a collection, for the body.  With ``clean``, the
    heap is unfrozen first, so the collection also takes what earlier freezes kept that has
    become garbage since.  Nothing is unfrozen after the body: the next freeze of
    pytest_runtest_teardown unfreezes, collects and freezes the whole heap again."""
    if clean:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture
def frozen_heap():
    """``gc.freeze()`` for the test: a sweep that collects after each of its hundreds of runs
    then scans only the objects the test made, not every one the worker's earlier tests left
    (late in a full run each collection took tens of milliseconds, and the r55 sweeps ran 5 to
    10 times slower there than alone)."""
    with _heap_frozen():
        yield


@pytest.fixture(scope="module")
def frozen_module_heap():
    """``gc.freeze()`` for a whole test module (``pytestmark = pytest.mark.usefixtures(...)``):
    for a module of hundreds of short tests that each collect once or twice, where a freeze per
    test (:func:`frozen_heap`) would itself cost two full collections.  Late in a full run a
    collection scans every object the worker's earlier tests left; frozen, only the module's."""
    with _heap_frozen(clean=True):
        yield


#: tests between two freezes of the worker's heap (pytest_runtest_teardown below)
FREEZE_EVERY = 25
_since_freeze = [0]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Every FREEZE_EVERY tests, after a collection, freeze what earlier tests left alive
    (``gc.freeze``): a later test's collections then scan only the objects made since, not the
    whole heap a worker builds up over thousands of tests (late in a run each full collection
    took tens of milliseconds; see frozen_heap).  What was frozen and became garbage since is
    collected here at the latest (the freeze before is undone first)."""
    _since_freeze[0] += 1
    if _since_freeze[0] >= FREEZE_EVERY:
        _since_freeze[0] = 0
        # unfrozen first: what was alive at the last freeze and is garbage now (a module's
        # fixture, a cache a test emptied) is collected, not kept for the rest of the run
        gc.unfreeze()
        gc.collect()
        gc.freeze()


def use_sim(monkeypatch, kind: str, **env) -> str:
    """Switch this process to the ``kind`` simulator (fresh state), with extra env settings."""
    monkeypatch.setenv("ACCEL_SIM", kind)
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    _lazy._reset_for_tests()
    return kind


@pytest.fixture
def sim_cuda(monkeypatch):
    """The simulated CUDA runtime (2 devices by default)."""
    return use_sim(monkeypatch, "cuda")


@pytest.fixture(params=SIMS)
def sim_backend(request, monkeypatch):
    """Run the test once per simulated runtime; yields the backend name."""
    return use_sim(monkeypatch, request.param)


@pytest.fixture(params=[s for s in SIMS if s != "mps"])
def sim_graph_backend(request, monkeypatch):
    """Simulated runtimes with stream capture (Metal has none)."""
    return use_sim(monkeypatch, request.param)


def vendor_calls_made_by(fn) -> dict:
    """The simulated vendor functions ``fn()`` called: name -> how many times
    (``accel.sim.calls()`` before and after)."""
    from accel import sim
    before = dict(sim.calls())
    fn()
    after = dict(sim.calls())
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def not_refused_with(calls, message: str, exact: bool = True) -> list:
    """One line for each ``(name, fn)`` of ``calls`` whose ``fn()`` does not raise a RuntimeError
    with ``message`` (the whole message; with ``exact=False``, a part of it): another error, another
    message, or no error (a forked child's calls, each of which must raise the fork error)."""
    bad = []
    for name, fn in calls:
        try:
            fn()
        except RuntimeError as exc:
            if (str(exc) != message) if exact else (message not in str(exc)):
                bad.append(f"{name}: {type(exc).__name__}: {exc}")
        except BaseException as exc:
            bad.append(f"{name}: {type(exc).__name__}: {exc}")
        else:
            bad.append(f"{name}: no error")
    return bad


def pretend_collection(monkeypatch, here: bool = True) -> None:
    """As accel's gc.callbacks at a collection's start: one runs now, on this thread (``here``)
    or on another.  :func:`pretend_collection_ends` is its "stop"; the test's end undoes both."""
    from accel import _locks
    info = {"generation": 2, "collected": 0, "uncollectable": 0}
    monkeypatch.setitem(_locks._running, _locks._PHASES, info)
    if here:
        monkeypatch.setattr(_locks._mine, "start", info, raising=False)


def pretend_collection_ends(monkeypatch) -> None:
    from accel import _locks
    # (a real collection that ran meanwhile already ended it: its "stop" pops the same key)
    monkeypatch.delitem(_locks._running, _locks._PHASES, raising=False)


def deliver_then(signum: int, fn) -> None:
    """Raise ``signum`` while it is blocked, then unblock it and call ``fn`` (a C callable) in one
    C step: the first bytecode boundary after the signal arrives is the first one inside what
    ``fn`` starts, where CPython runs the Python handler (a ``__del__``'s first instruction, a
    collection's first Python callback).  libc's pthread_sigmask through cffi: Python's own runs
    the handler itself as it returns."""
    import functools
    import signal
    import _cffi_backend
    from accel import _locks
    from accel.backends import _signals
    ffi = _signals._ffi
    libc = _cffi_backend.load_library(None)
    sigemptyset = libc.load_function(ffi.typeof("int(*)(void *)"), "sigemptyset")
    sigaddset = libc.load_function(ffi.typeof("int(*)(void *, int)"), "sigaddset")
    one, old = ffi.new("char[]", 128), ffi.new("char[]", 128)
    sigemptyset(one)
    sigaddset(one, signum)
    _signals._mask(signal.SIG_BLOCK, one, old)
    try:
        signal.raise_signal(signum)                 # pending: blocked
        _locks._consume(map(_locks._call, (functools.partial(_signals._mask, signal.SIG_UNBLOCK, one, ffi.NULL),
                                           fn)))
    finally:
        _signals._mask(signal.SIG_SETMASK, old, ffi.NULL)


def shrink_plan(plan: list, fails) -> list:
    """The shortest sublist of a failing fuzz ``plan`` that still ``fails(plan)`` by deleting
    chunks of it (delta debugging, halving the chunk size until single steps), for the model
    fuzzers' shrinkers."""
    n = 2
    while len(plan) > 1:
        chunk = max(1, len(plan) // n)
        for i in range(0, len(plan), chunk):
            cand = plan[:i] + plan[i + chunk:]
            if cand and fails(cand):
                plan, n = cand, max(n - 1, 2)
                break
        else:
            if chunk == 1:
                break
            n = min(len(plan), 2 * n)
    return plan


def run_forked(fn, timeout: float = 60.0, hung: str = "forked child hung") -> int:
    """Run fn() in an os.fork child and return its exit status; a child still running after
    ``timeout`` seconds is killed and the test fails with ``hung`` (it never hangs the run)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = fn()
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail(hung)


@pytest.fixture
def mps_backend(monkeypatch):
    """The Metal backend, initialized on a fresh simulator; closed after the test, which must
    leave no Objective-C object alive, no autorelease outside a pool and no engine error."""
    from accel import backends
    from accel.sim import core, metal
    use_sim(monkeypatch, "mps")
    metal.reset()
    core.reset()
    backend = backends.get("mps")
    backend.init()
    yield backend
    backend.close()
    st = metal.state()
    assert st.live() == [] and st.leaked_autoreleases == 0 and st.engine_errors == []
