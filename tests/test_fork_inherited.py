"""Objects made before fork, used in the child (issue 13, item 5).

A child forked after the runtime started cannot use it; new work there already gets the
"Cannot re-initialize ... in forked subprocess" error from accel._lazy.  Objects the child
inherited (Buffer, Stream, Event, Graph, the default stream) must give the same error from every
method instead of a vendor error that never mentions fork (CUDA, XPU) or silent success (MPS),
and their finalizers must not call the vendor library.  Many children, each bounded by a timeout.
"""

import gc
import os
import time

import numpy  # noqa: F401  (imported once here, not by each child's to_numpy)
import pytest

import accel
from accel import _finalize, sim
from conftest import SIMS, THOROUGH, not_refused_with, use_sim, vendor_calls_made_by

#: Children per simulator: each forks, calls ~30 methods, exits (about 2-5 ms; ~70 ms in a full
#: run).  The children are identical: by default 30 each still repeat every call many times over.
CHILDREN = {k: 200 if THOROUGH else 30 for k in ("cuda", "xpu", "mps")}
CHILD_TIMEOUT_S = 20.0


def _message(kind: str) -> str:
    name = kind.upper()
    return (f"Cannot re-initialize {name} in forked subprocess. To use {name} with multiprocessing, "
            f"you must use the 'spawn' start method")


def _objects(kind):
    """Buffer, Stream and Event on the last device (device 0 stays current), a captured Graph where
    the backend has graphs, and the default stream."""
    last = accel.device_count() - 1
    assert accel.current_device_index() == 0
    s = accel.Stream(last)
    s2 = accel.Stream(last)
    b = accel.Buffer(64, device=last, stream=s)
    b.copy_from(bytes(range(64)))
    e = accel.Event(enable_timing=True)
    e.record(s)
    e2 = accel.Event(enable_timing=True)
    e2.record(s)
    g = None
    if kind in ("cuda", "xpu"):
        g = accel.Graph()
        with s, g:
            b.fill_(7)
        g.replay()
    s.synchronize()
    return {"b": b, "s": s, "s2": s2, "e": e, "e2": e2, "g": g, "d": accel.default_stream(last)}


def _calls(o, kind):
    """Every method of the inherited objects, as (name, thunk)."""
    b, s, s2, e, e2, g, d = o["b"], o["s"], o["s2"], o["e"], o["e2"], o["g"], o["d"]

    def enter(stream):
        with stream:
            pass

    calls = [
        ("Buffer.ptr", lambda: b.ptr),
        ("Buffer.copy_from", lambda: b.copy_from(bytes(64))),
        ("Buffer.copy_from non_blocking", lambda: b.copy_from(bytes(64), non_blocking=True)),
        ("Buffer.copy_to", lambda: b.copy_to(bytearray(64))),
        ("Buffer.to_numpy", lambda: b.to_numpy()),
        ("Buffer.fill_", lambda: b.fill_(1)),
        ("Buffer.fill_ on stream", lambda: b.fill_(1, stream=s)),
        ("Buffer.record_stream", lambda: b.record_stream(s2)),
        ("Stream.handle", lambda: s.handle),
        ("Stream.synchronize", s.synchronize),
        ("Stream.query", s.query),
        ("Stream.wait_event", lambda: s.wait_event(e)),
        ("Stream.wait_stream", lambda: s.wait_stream(s2)),
        ("Stream.record_event", lambda: s.record_event()),
        ("Stream.__enter__", lambda: enter(s)),
        ("set_stream", lambda: accel.set_stream(s)),
        ("default Stream.synchronize", d.synchronize),
        ("default Stream.query", d.query),
        ("Event.record", lambda: e.record(s)),
        ("Event.query", e.query),
        ("Event.synchronize", e.synchronize),
        ("Event.wait", lambda: e.wait(s)),
        ("Event.elapsed_time", lambda: e.elapsed_time(e2)),
        ("Event.close", e2.close),
        ("Stream.close", s2.close),
        ("Buffer.close", b.close),
    ]
    if g is not None:
        calls += [("Graph.replay", g.replay), ("Graph.instantiate", g.instantiate),
                  ("Graph.pool", g.pool), ("Graph.capture_begin", g.capture_begin),
                  ("Graph.capture_end", g.capture_end), ("Graph.reset", g.reset)]
    if kind == "cuda":
        calls.append(("Buffer.__cuda_array_interface__", lambda: b.__cuda_array_interface__))
    calls.append(("new Buffer", lambda: accel.Buffer(16)))   # already raised by accel._lazy
    return calls


def _child(objs, kind) -> int:
    """Runs in the forked child: every call raises the fork error; finalizers call nothing."""
    expected = _message(kind)
    bad = not_refused_with(_calls(objs, kind), expected)
    made = vendor_calls_made_by(lambda: (objs.clear(), gc.collect(), _finalize.drain()))
    if made:
        bad.append(f"finalizers called the vendor library: {made}")
    if bad:
        os.write(2, ("\n".join(bad) + "\n").encode())
        return 1
    return 0


def _fork_and_wait(objs, kind) -> int:
    pid = os.fork()
    if pid == 0:
        code = 2
        try:
            code = _child(objs, kind)
        except BaseException:
            import traceback
            os.write(2, traceback.format_exc().encode())
        finally:
            os._exit(code)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    delay = 0.0005
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail(f"a forked child using inherited {kind} objects hung for {CHILD_TIMEOUT_S} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


@pytest.mark.parametrize("kind", SIMS)
def test_inherited_objects_raise_the_fork_error(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    objs = _objects(kind)
    live_before = sim.calls()
    gc.collect()
    gc.freeze()     # the children's gc.collect() then skips the test runner's objects
    try:
        codes = [_fork_and_wait(objs, kind) for _ in range(CHILDREN[kind])]
    finally:
        gc.unfreeze()
    assert codes == [0] * len(codes), f"children failed: {sorted(set(codes))} (their stderr is above)"
    # The parent's objects still work, and nothing the children did reached the parent.
    assert sim.calls() == live_before
    objs["b"].fill_(3, stream=objs["s"])
    assert objs["b"].to_numpy(stream=objs["s"]).tolist() == [3] * 64
    if objs["g"] is not None:
        objs["g"].replay()
    objs["s"].synchronize()
    for o in ("b", "s", "s2", "e", "e2"):
        objs[o].close()
    if objs["g"] is not None:
        objs["g"].reset()


def test_finalizers_in_the_child_do_nothing(sim_cuda):
    """Objects the child inherited and drops: their finalizers call nothing, and the releases
    the parent left pending are not the child's to run."""
    s = accel.Stream(1)
    held = {"s": s, "b": accel.Buffer(64, device=1, stream=s)}
    del s
    _finalize.defer(os._exit, 7)                  # a release the parent left pending
    try:
        pid = os.fork()
        if pid == 0:
            code = 2
            try:
                before = dict(sim.calls())
                code = 3 if _finalize.pending else 4
                if not _finalize.pending:
                    held.clear()
                    gc.collect()
                    _finalize.drain()
                    code = 0 if dict(sim.calls()) == before else 5
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        _finalize.pending.clear()
    held["b"].close()
    held["s"].close()
