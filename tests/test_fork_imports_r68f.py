"""A child forked while another thread is in the middle of accel's first call must not hang (r68f).

test_user_programs_r67h's ``test_child_forked_during_a_lazy_import_does_not_hang`` failed about
one run in two.  Its meta-path finder meant to hold the fork inside the import of accel's lazy
module, but CPython (3.11 to 3.13) calls finders under the global import lock, which ``os.fork``
takes too: the fork waited for the finder's 0.5 s to run out and landed at a random point of the
rest of the first call.  Two defects were there, which these programs hit every time by holding
the main thread inside the *body* of one module (a loader's ``exec_module`` waits, no import
lock held) while another thread forks:

1. the modules accel's lazy import imports (``secrets``, ``json``, ``inspect``...), and a user's
   module importing accel, stayed half-imported in the child with their module locks owned by a
   thread the child does not have: the child's own first call hung on them.  And
   ``_drop_stale_imports`` read the package attribute with ``getattr``, so for a half-imported
   ``accel.memory`` / ``accel.random`` / ``accel.sim`` ``accel.__getattr__`` imported the module
   again *inside the fork hook* (before the child's ``signal.alarm`` ran) and hung there;
2. ``device_count()`` holds the backend's counting locks (CUDA ``_count_lock``, ``_choice_lock``,
   ``accel.backends.cuda.libs._probe_lock``; Level Zero's and Metal's backend lock) while it imports the
   simulator or loads libraries: the child's first call waited for them for good.

A child that hangs gets SIGALRM (exit -14) from an at-fork hook registered before accel's.
"""
import textwrap

import pytest

from conftest import SIMS, use_sim
from test_user_programs import run_program

_PROGRAM = r'''
import importlib.abc, importlib.machinery, os, signal, sys, threading, time
os.register_at_fork(after_in_child=lambda: signal.alarm(5))   # a hang in accel's hooks ends too
import accel
WHERE, PAUSE, WAITER = sys.argv[1], sys.argv[2], sys.argv[3] == "waiter"
if WHERE == "backend":
    first_call = lambda: accel.device_count()
    child_call = lambda: accel.Buffer(16).close()
else:
    accel.device_count()
    first_call = lambda: getattr(accel, WHERE)
    child_call = {"memory": lambda: accel.memory.memory_allocated(0),
                  "random": lambda: accel.random.manual_seed(1)}[WHERE]
entered, forked = threading.Event(), threading.Event()
MAIN = threading.get_ident()


class PauseInBody(importlib.abc.MetaPathFinder):
    """The main thread's import of PAUSE waits in the module's body (in sys.modules, half run,
    its lock and those of the modules importing it held; not the global import lock, which
    finders run under) until the other thread forked."""
    def find_spec(self, name, path, target=None):
        if name != PAUSE or threading.get_ident() != MAIN:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run_body = spec.loader.exec_module

        def exec_module(module):
            entered.set()
            forked.wait(10)
            run_body(module)
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, PauseInBody())
status = {}


def waiter():
    import usermod      # its body imports accel's module: waits for the main thread's import


def forker():
    if not entered.wait(10):
        print("no pause")
        forked.set()
        return
    if WAITER:
        w = threading.Thread(target=waiter, daemon=True)
        w.start()
        from importlib import _bootstrap
        for _ in range(500):
            waits = getattr(_bootstrap._blocking_on, "data", _bootstrap._blocking_on)
            if w.ident in waits:
                break
            time.sleep(0.01)
        else:
            print("the waiter never waited")
    pid = os.fork()
    if pid == 0:
        try:
            child_call()
            if WAITER:
                import usermod
            os.write(1, b"child: works\n")
        except RuntimeError as exc:
            os.write(1, ("child: %s\n" % exc).encode())
        os._exit(0)
    forked.set()
    _, st = os.waitpid(pid, 0)
    status["child"] = os.waitstatus_to_exitcode(st)


t = threading.Thread(target=forker, daemon=True)
t.start()
first_call()
t.join(30)
print("child exit", status.get("child"))
'''

#: (simulator, first call, the module whose body the main thread is in when the other forks)
_CASES = [
    ("cuda", "backend", "accel.backends.cuda"),       # the r67h case, held where it meant to be
    ("cuda", "backend", "accel.sim.core"),            # accel.sim is half run: getattr imported it
    ("cuda", "backend", "inspect"),                    # the count lock held, a stdlib module half run
    ("cuda", "backend", "accel.backends.cuda.libs"),  # the runtime choice's lock held
    ("xpu", "backend", "accel.backends.xpu.discovery"),
    ("xpu", "backend", "ctypes"),                      # Level Zero's backend lock held
    ("mps", "backend", "accel.sim.metal"),
    ("mps", "backend", "dataclasses"),                 # Metal's backend lock held
    ("cuda", "memory", "accel.memory._caching"),       # accel.memory half run: getattr imported it
    ("cuda", "memory", "json.decoder"),
    ("cuda", "random", "secrets"),                     # the child's accel.random imports secrets
    ("cuda", "random", "hmac"),
    ("cuda", "random", "accel.random.generator"),
]


def _run(where, pause, waiter="alone", tmp_path=None):
    head = "import sys; sys.argv[1:] = %r\n" % ([where, pause, waiter],)
    if tmp_path is not None:
        head += "sys.path.insert(0, %r)\n" % str(tmp_path)
    proc = run_program(head + _PROGRAM, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "no pause" not in lines and "the waiter never waited" not in lines, proc.stdout
    assert "child exit 0" in lines, (proc.stdout, proc.stderr[-3000:])
    child = [line for line in lines if line.startswith("child:")]
    assert child and ("works" in child[0] or "forked subprocess" in child[0]), proc.stdout


@pytest.mark.parametrize("kind, where, pause", [c for c in _CASES if c[0] in SIMS])
def test_child_forked_inside_an_import_of_the_first_call_does_not_hang(monkeypatch, kind, where, pause):
    """The main thread makes its first call (``device_count()``; the first use of
    ``accel.memory`` / ``accel.random``) and is inside the body of ``pause`` when another thread
    forks; the child's own first call works (nothing was initialized) instead of hanging."""
    use_sim(monkeypatch, kind)
    _run(where, pause)


@pytest.mark.skipif("cuda" not in SIMS, reason="CUDA simulator not selected")
@pytest.mark.parametrize("pause", ["accel.random", "secrets"])
def test_a_user_module_waiting_for_accel_import_is_imported_afresh_in_the_child(monkeypatch, tmp_path, pause):
    """A second thread imports the user's module, whose body imports ``accel.random`` and so
    waits for the main thread's import of it; a third thread forks.  The user's module is half
    run in the child, its lock owned by the gone waiter: it leaves with the interrupted accel
    import, and the child imports it afresh."""
    (tmp_path / "usermod.py").write_text("import accel.random\nVALUE = 1\n")
    use_sim(monkeypatch, "cuda")
    _run("random", pause, "waiter", tmp_path)


_TABLES = r'''
import os, sys, threading, types, weakref
from importlib import _bootstrap
import accel
from accel import _lazy
me = threading.get_ident()
GONE = me + 1        # a thread the child does not have

def lock_of(name, owner=None, inner_held=False, waiting=False):
    lock = _bootstrap._ModuleLock(name)
    if owner is not None:
        lock.owner = owner
        lock.count = 1 if isinstance(lock.count, int) else [True]
    if inner_held:
        lock.lock.acquire()
    if waiting:
        lock.wakeup.acquire()
        lock.waiters = 1 if isinstance(lock.waiters, int) else [None]
    _bootstrap._module_locks[name] = weakref.ref(lock)
    return lock

def half_module(name):
    spec = _bootstrap.ModuleSpec(name, None)
    spec._initializing = True
    module = types.ModuleType(name)
    module.__spec__ = spec
    sys.modules[name] = module
    return module

keep = []
# an accel module and the stdlib module it imports, half run by a gone thread
keep += [lock_of("accel.r68f_half", GONE), lock_of("r68f_std_half", GONE)]
accel_half, std_half = half_module("accel.r68f_half"), half_module("r68f_std_half")
accel.__dict__["r68f_half"] = accel_half
# an unrelated import of another gone thread: CPython's business, left as it is
keep.append(lock_of("r68f_unrelated", GONE + 1))
unrelated = half_module("r68f_unrelated")
# a free lock a gone thread left inside its inner lock; one whose waiter is gone
keep += [lock_of("r68f_inner_held", None, inner_held=True), lock_of("r68f_woken", None, waiting=True)]
# a lock this thread owns, with a gone waiter: repaired in place, still owned
mine = lock_of("r68f_mine", me, inner_held=True, waiting=True)
keep.append(mine)

_lazy._drop_stale_imports()
locks = _bootstrap._module_locks
print("accel half dropped", "accel.r68f_half" not in sys.modules and "accel.r68f_half" not in locks
      and "r68f_half" not in vars(accel))
print("std half dropped", "r68f_std_half" not in sys.modules and "r68f_std_half" not in locks)
print("unrelated kept", sys.modules.get("r68f_unrelated") is unrelated and locks["r68f_unrelated"]() is keep[2])
print("broken free locks replaced", "r68f_inner_held" not in locks and "r68f_woken" not in locks)
print("mine repaired", locks["r68f_mine"]() is mine and mine.owner == me and not mine.waiters
      and mine.lock.acquire(False) and mine.wakeup.acquire(False))
'''


def test_drop_stale_imports_on_made_up_tables(monkeypatch):
    """``_drop_stale_imports`` on import tables as a fork leaves them (made up in a fresh
    interpreter): the half-run accel module, and the module it was importing, owned by a gone
    thread, leave ``sys.modules``, the package and ``_module_locks`` (the package attribute read
    from its dict: accel's ``__getattr__`` would import); an unrelated import of another gone
    thread is left alone; free locks a gone thread left mid-update are replaced; a lock this
    thread owns keeps its owner, its inner and wake-up locks free and no waiter."""
    use_sim(monkeypatch, "cuda" if "cuda" in SIMS else SIMS[0])
    proc = run_program(textwrap.dedent(_TABLES), timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for what in ("accel half dropped", "std half dropped", "unrelated kept", "broken free locks replaced",
                 "mine repaired"):
        assert f"{what} True" in lines, proc.stdout
