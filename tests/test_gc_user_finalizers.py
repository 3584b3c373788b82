"""A user's ``__del__`` that calls accel, run by the cyclic GC while this thread is inside accel.

The collector runs at any Python allocation, so a user's finalizer can start while the thread
holds one of accel's locks: the caching allocator's (inside ``malloc``), backend selection's (while
a backend module is imported) or lazy init's.  accel's own finalizers defer their work
(``accel._finalize``); a user's cannot be deferred, since it wants memory back now.  It must never
hang: either the call works, or it raises a clear error saying what happened, and accel stays
usable.  Each case runs in a subprocess with a watchdog, so a hang fails instead of hanging.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import SIMS, THOROUGH

#: Loop iterations: by default 300, still dozens of collections inside init, selection and malloc
#: (a collection every 20 allocations); THOROUGH runs today's 1000.
ITERATIONS = 1000 if THOROUGH else 300

_SCRIPT = textwrap.dedent(r'''
    import faulthandler, gc, sys
    faulthandler.dump_traceback_later(90, exit=True)
    import accel
    made, refused = [0], []

    class UserObject:
        """A user's object in a reference cycle whose __del__ allocates device memory."""
        def __init__(self):
            self.me = self
        def __del__(self):
            try:
                b = accel.Buffer(4096)
                made[0] += 1
                b.close()
            except (accel.AcceleratorError, RuntimeError) as exc:
                refused.append(str(exc))

    gc.set_threshold(20, 2, 2)       # collections often: inside init, selection and malloc
    for i in range(int(sys.argv[1])):
        UserObject()
        b = accel.Buffer(1 << 16)
        b.close()
    gc.set_threshold(700, 10, 10)
    gc.collect()
    with accel.Buffer(1 << 16) as b:  # still usable afterwards
        b.fill_(7)
        assert bytes(b.to_numpy()[:4]) == b"\x07" * 4
    assert all("finalizer" in r for r in refused), refused[:3]
    print("ok", made[0], len(refused))
''')


@pytest.mark.parametrize("kind", SIMS)
def test_user_finalizer_that_allocates_never_hangs(kind):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    env.update(ACCEL_SIM=kind, ACCEL_SIM_DEVICES="2")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(ITERATIONS)], env=env,
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ok, made, refused = proc.stdout.split()[-3:]
    assert ok == "ok" and int(made) > 0


_AT_EXIT = textwrap.dedent(r'''
    import builtins
    import accel
    s = accel.Stream()
    e = accel.Event()
    e.record(s)
    b = accel.Buffer(1024)
    b.fill_(1, stream=s)
    keep = [s, e, b, accel.Stream.from_handle(s.handle)] if hasattr(accel.Stream, "from_handle") else [s, e, b]
    if accel.current_accelerator().type == "cuda":
        g = accel.Graph()
        with accel.graph(g):
            out = accel.Buffer(1024)
            out.fill_(2)
        keep += [g, out]
    if hasattr(accel, "Module") and accel.current_accelerator().type == "cuda":
        ptx = (".version 8.0\n.target sm_90\n.address_size 64\n"
               ".visible .entry noop(.param .u64 p)\n{\n ret;\n}\n")
        keep.append(accel.Module(ptx.encode()))
    if hasattr(accel, "MemPool") and accel.current_accelerator().type != "mps":
        keep.append(accel.MemPool())
    # Objects still alive when the interpreter tears the accel modules down (builtins go last):
    # their __del__ runs after the module globals they read were set to None.
    builtins._accel_alive_at_exit = keep
    print("ok")
''')


@pytest.mark.parametrize("kind", SIMS)
def test_objects_alive_at_interpreter_exit_finalize_quietly(kind):
    """Streams, events, buffers, graphs and pools a program keeps until the interpreter
    exits print nothing from their finalizers ("Exception ignored in ... __del__"), and the
    exit status is 0: at shutdown the process's memory and handles go with it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    env.update(ACCEL_SIM=kind, ACCEL_SIM_DEVICES="2")
    proc = subprocess.run([sys.executable, "-c", _AT_EXIT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["ok"], proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-4000:]
