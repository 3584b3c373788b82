"""accel used from several processes and threads (r62b), on the three simulators with two devices.

Earlier rounds took a 'spawn' Pool after the parent used the device (test_user_programs.py), a
fork child's clear error (test_fork_*.py, test_lazy_fork.py), pickle/copy of the main handle
objects (test_api_fuzz_r32.py, test_user_programs.py) and a four-thread pool of device/stream
blocks (test_user_programs_r58.py).  This file adds:

* 'spawn' and 'forkserver' (with accel preloaded in the server) children, as
  ``multiprocessing.Process`` and ``concurrent.futures.ProcessPoolExecutor`` workers, of a
  parent that initialized the runtime: they see the simulator through the environment, count
  devices without initializing, work on device 1 (streams, events, Philox from a Generator the
  parent pickled to them: the same numbers as the parent's copy), send accel exceptions back
  with their attributes, exit 0 (a raising child exits 1, a child that dies breaks only its
  pool); an accel.Buffer given to a child is refused in the parent, naming the Buffer.
* pickle / copy / deepcopy of every public exception class (built and really raised) and of
  Kernel, Module, ExternalStream, closed objects and Buffer subclasses.
* an 8-thread ThreadPoolExecutor doing set_device_index / with Stream(d) / Buffer / fill /
  Event.record / synchronize on alternating devices, synchronizing each other's events and
  leaving objects (some in reference cycles) for other threads to free; threads that end inside
  ``with stream:`` / ``with device_index`` / after ``set_stream``; a generator suspended inside
  ``with stream:`` closed on another thread.  Stats and the simulators' live handles come back;
  per-thread current device and stream never leak (torch: both are per thread).

Each risky case runs in a run_forked child or a subprocess with a timeout: a hang fails the
test, not the run.
"""

import copy
import gc
import os
import pickle
import signal
import subprocess
import sys
import threading
import weakref

import numpy as np
import pytest

import accel
from conftest import run_forked
from test_user_programs import (JOIN_S, _devices, allocated, communicate_or_abort, live_objects, process_state,
                                settle)

pytestmark = pytest.mark.usefixtures("frozen_module_heap")


def _last() -> int:
    return accel.device_count() - 1


# -- 1. spawn / forkserver children of a parent that initialized the runtime --------------------
_CHILDREN = r'''
import os
import sys

import accel


def info():
    """What a child sees before it touches the device."""
    return (os.environ.get("ACCEL_SIM"), accel.is_initialized(), accel.device_count(),
            accel.current_accelerator().type)


def work(dev, gen):
    """Work on ``dev`` while device 0 stays current: a stream, a buffer, events, a Philox fill
    from ``gen``; returns what the parent compares with its own run."""
    assert accel.current_device_index() == 0
    d = dev.index
    s = accel.Stream(d)
    with s:
        b = accel.Buffer(4096)
        b.fill_(7)
        ev = accel.Event(enable_timing=True)
        ev.record()
        accel.random.uniform_(b, generator=gen)
        done = accel.Event()
        done.record()
    done.synchronize()
    assert ev.query() and done.query()
    data = b.to_numpy().tobytes()
    where = (accel.current_device_index(), b.device_index, accel.memory.memory_allocated(d) > 0)
    del b, ev, done
    s.close()
    accel.synchronize(d)
    return where + (data, gen.offset)


def work_and_exit(dev, gen):
    work(dev, gen)          # returns: the process exits through normal interpreter shutdown


def fill(i):
    devs = accel.device_count()
    accel.set_device_index(i % devs)        # a pool worker keeps it for its next task, as torch
    b = accel.Buffer(1024).fill_(i)
    return accel.current_device_index(), b.device_index, int(b.to_numpy().sum())


def bad_device():
    accel.set_device_index(7)


def oom(d):
    accel.Buffer(1 << 50, device=d)


def raises():
    last = accel.device_count() - 1
    with accel.Stream(last):
        accel.Buffer(64).fill_(1)
        raise ValueError("child failed on purpose")


def exit_hard():
    accel.Buffer(64).fill_(1)
    os._exit(3)


_held = []


def exit_holding(dev):
    """Leave with device objects alive in a global, work queued, a side stream current."""
    d = dev.index
    s = accel.Stream(d)
    accel.set_stream(s)
    b = accel.Buffer(1 << 16, device=d)
    for i in range(8):
        b.fill_(i)
    ev = accel.Event()
    ev.record()
    _held.extend([s, b, ev, accel.memory.memory_stats(d)])


def busy(dev, started):
    """Fill and draw on ``dev`` until a signal ends the process."""
    d = dev.index
    s = accel.Stream(d)
    b = accel.Buffer(1 << 16, device=d)
    started.set()
    while True:
        with s:
            b.fill_(1)
            accel.random.uniform_(b)
            accel.Event().record()
        b.to_numpy()


def fork_refused():
    try:
        accel.Buffer(64)
    except RuntimeError as exc:
        sys.exit(0 if "spawn" in str(exc) else 2)
    sys.exit(1)
'''

_PARENT = r'''
import concurrent.futures as cf
import copy
import multiprocessing as mp
import os
import signal
import time

import accel
import r62b_children as C

T = 60
#: ACCEL_TEST_THOROUGH: every child under both start methods.  By default a 'spawn' child costs
#: ~1 s to start (a forkserver child is a cheap fork of the preloaded server), so 'spawn' runs one
#: Process (exit_holding: work, then exit with objects alive) and a one-worker pool that takes
#: every pool task; 'forkserver' runs every kind of child, the busy/signal ones and exit_hard too.
FULL = os.environ.get("ACCEL_TEST_THOROUGH", "") not in ("", "0")


def check_context(method, last, dev, gen, want, parent):
    ctx = mp.get_context(method)
    every = FULL or method == "forkserver"
    for target, args, code in ((C.info, (), 0), (C.work_and_exit, (dev, gen), 0), (C.raises, (), 1),
                               (C.exit_holding, (dev,), 0))[0 if every else 3:]:
        p = ctx.Process(target=target, args=args)
        p.start()
        p.join(T)
        assert p.exitcode == code, (method, target.__name__, p.exitcode)
    for sig, codes in ((signal.SIGINT, (1, -signal.SIGINT)), (signal.SIGTERM, (-signal.SIGTERM,)))[:2 if every else 0]:
        started = ctx.Event()
        p = ctx.Process(target=C.busy, args=(dev, started))
        p.start()
        assert started.wait(T), (method, "busy child never started")
        deadline = time.monotonic() + T
        while p.is_alive() and time.monotonic() < deadline:
            # SIGINT: a KeyboardInterrupt somewhere inside accel's calls; sent again, as a user
            # presses Ctrl-C again, because one landing in a __del__ is printed and ignored
            os.kill(p.pid, sig)
            p.join(0.5)
        p.join(T)
        assert p.exitcode in codes, (method, sig, p.exitcode)
    with cf.ProcessPoolExecutor(2 if every else 1, mp_context=ctx) as pool:
        got = pool.submit(C.info).result(T)
        assert got == (accel.current_accelerator().type, False, last + 1, accel.current_accelerator().type), \
            (method, got)
        got = pool.submit(C.work, dev, gen).result(T)
        assert got[:3] == (0, last, True), (method, got[:3])
        assert got[3:] == want, (method, "the child's Philox numbers differ from the parent's copy")
        exc = pool.submit(C.bad_device).exception(T)
        assert type(exc) is accel.InvalidDeviceError and "device index 7" in str(exc), (method, exc)
        exc = pool.submit(C.oom, last).exception(T)
        assert type(exc) is accel.OutOfMemoryError and "out of memory" in str(exc), (method, exc)
        assert exc.observer_args[:2] == (last, 1 << 50), exc.observer_args
        exc = pool.submit(C.info, parent).exception(T)          # pickled in the parent: refused
        assert type(exc) is TypeError and "accel.Buffer" in str(exc), (method, exc)
        got = list(pool.map(C.fill, range(6), timeout=T))       # the pool still works
        assert got == [(i % (last + 1), i % (last + 1), 1024 * i) for i in range(6)], got
    if method == ("spawn" if FULL else "forkserver"):
        with cf.ProcessPoolExecutor(1, mp_context=ctx) as pool:
            exc = pool.submit(C.exit_hard).exception(T)
            assert isinstance(exc, cf.process.BrokenProcessPool), exc
    if method == "spawn":
        p = ctx.Process(target=C.info, args=(parent,))
        try:
            p.start()
        except TypeError as exc:
            assert "accel.Buffer" in str(exc), exc
        else:
            p.join(T)
            raise SystemExit("a Buffer was pickled to a spawn child")


if __name__ == "__main__":
    last = accel.device_count() - 1
    parent = accel.Buffer(4096, device=last).fill_(9)       # the parent initialized the runtime
    assert accel.is_initialized()
    dev = accel.device(accel.current_accelerator().type, last)
    gen = accel.random.Generator(last, seed=1234)
    gen.set_offset(8)
    mine = copy.deepcopy(gen)
    want = C.work(dev, mine)[3:]
    assert mine.offset > gen.offset == 8
    p = mp.get_context("fork").Process(target=C.fork_refused)
    p.start()
    p.join(T)
    assert p.exitcode == 0, ("a fork child did not get the 'spawn' error", p.exitcode)
    mp.set_forkserver_preload(["accel", "numpy", "r62b_children"])
    for method in ("spawn", "forkserver"):
        check_context(method, last, dev, gen, want, parent)
    assert mp.active_children() == []
    assert gen.offset == 8, "pickling the generator to the children changed it"
    assert (parent.to_numpy() == 9).all()
    assert accel.current_device_index() == 0 and accel.current_stream(last) == accel.default_stream(last)
    print("OK")
'''


def _run_script(path, cwd, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run ``python path`` (the test's environment: ACCEL_SIM reaches it and its children) in
    its own process group; still running after ``timeout``: SIGABRT (faulthandler prints the
    stacks), then SIGKILL to the group, and the test fails."""
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    proc = subprocess.Popen([sys.executable, str(path)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = communicate_or_abort(proc, timeout)
    # the forkserver and resource tracker leave when they read EOF from the dead parent: give
    # them a moment, then nothing of the program may be left
    import time
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        left = subprocess.run(["ps", "-o", "pid,stat,args", "-g", str(proc.pid)], capture_output=True, text=True).stdout
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"a child of the program outlived it by 20 s:\n{left}\n{out}\n{err[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _ignored(stderr: str) -> list:
    """The exception type of each "Exception ignored in" report in ``stderr``."""
    out = []
    for part in stderr.split("Exception ignored")[1:]:
        lines = part.splitlines()[1:]
        last = next((ln for ln in lines if ln and not ln.startswith((" ", "Traceback"))), "")
        out.append(last.split(":")[0])
    return out


def test_spawn_and_forkserver_children_of_an_initialized_parent(sim_backend, tmp_path):
    """'spawn' and 'forkserver' children (Process and ProcessPoolExecutor) of a parent holding
    device memory: the simulator reaches them through the environment, they count devices
    without initializing, work on the last device while device 0 stays current, draw the same
    Philox numbers from a pickled Generator as the parent's copy, send InvalidDeviceError and
    OutOfMemoryError (with observer_args) back, exit 0 (1 when they raise, even inside ``with
    stream:``); a child that dies breaks its pool only; a Buffer argument is refused in the
    parent naming the Buffer and the pool keeps working.  A fork child gets the 'spawn' error."""
    (tmp_path / "r62b_children.py").write_text(_CHILDREN)
    (tmp_path / "r62b_parent.py").write_text(_PARENT)
    proc = _run_script(tmp_path / "r62b_parent.py", tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (proc.stdout, proc.stderr[-4000:])
    # the raising child's traceback, and nothing else went wrong on the way
    assert "child failed on purpose" in proc.stderr, proc.stderr[-4000:]
    # only the Ctrl-C that landed in a finalizer of the busy child may be printed and ignored
    assert set(_ignored(proc.stderr)) <= {"KeyboardInterrupt"}, proc.stderr[-4000:]
    for bad in ("Fatal Python error", "Segmentation fault", "leaked", "AcceleratorError"):
        assert bad not in proc.stderr, (bad, proc.stderr[-4000:])


# -- 2. pickle / copy / deepcopy -----------------------------------------------------------------
def _round_trips(exc) -> None:
    """``exc`` pickles (every protocol), copies and deep-copies to an equal exception."""
    fns = [(f"pickle{p}", lambda o, p=p: pickle.loads(pickle.dumps(o, protocol=p)))
           for p in range(pickle.HIGHEST_PROTOCOL + 1)]
    for how, fn in fns + [("copy", copy.copy), ("deepcopy", copy.deepcopy)]:
        out = fn(exc)
        assert type(out) is type(exc) and out is not exc, (how, exc)
        assert out.args == exc.args and str(out) == str(exc), (how, str(out), str(exc))
        assert vars(out) == vars(exc), (how, vars(out), vars(exc))


def test_exceptions_round_trip_with_their_attributes(sim_backend):
    """Every public exception class pickles, copies and deep-copies with its message and
    attributes (library, call, code, code_name, CompileError.log, OutOfMemoryError.observer_args),
    as torch's exceptions do: a ProcessPoolExecutor worker's errors reach the parent whole.
    Built by hand and really raised on the last device (device 0 current)."""
    built = [accel.AcceleratorError("m", library="cudart", call="cudaMalloc", code=2,
                                    code_name="cudaErrorMemoryAllocation"),
             accel.OutOfMemoryError("oom", library="cudart", code=2),
             accel.CaptureError("cap", call="cudaStreamSynchronize"),
             accel.KernelImageError("img", code=209, code_name="cudaErrorNoKernelImageForDevice"),
             accel.DeferredCallError("later"),
             accel.CompileError("bad", log="line 1: error", library="nvrtc", call="nvrtcCompileProgram", code=6,
                                code_name="NVRTC_ERROR_COMPILATION"),
             accel.InvalidDeviceError("device index 9 is out of range")]
    for exc in built:
        _round_trips(exc)
    last = _last()
    raised = []
    for fn in (lambda: accel.Buffer(1 << 50, device=last), lambda: accel.set_device_index(7),
               lambda: accel.Stream(device=last + 5)):
        with pytest.raises(Exception) as info:
            fn()
        raised.append(info.value)
    assert type(raised[0]) is accel.OutOfMemoryError and raised[0].observer_args[0] == last
    assert isinstance(raised[1], accel.InvalidDeviceError), raised[1]
    with pytest.raises(ValueError, match="max_split_size_mb") as info:      # AllocatorConfigError
        accel.memory.set_allocator_settings("max_split_size_mb:3")
    assert type(info.value).__name__ == "AllocatorConfigError"
    raised.append(info.value)
    for exc in raised:
        _round_trips(exc)
    assert accel.current_device_index() == 0


def test_kernel_copy_shares_the_module_and_refusals_name_the_type(sim_backend):
    """A Kernel owns no handle (its Module does): ``copy.copy`` gives a second Kernel of the
    same module, which launches, and which the module's close stops like the original (the
    module is unloaded once).  Module refuses copies and pickling naming Module."""
    from accel import sim
    from test_user_kernels import SAXPY_MSL, SAXPY_PTX, saxpy_reference, spirv_module
    last = _last()
    image = {"cuda": SAXPY_PTX, "mps": SAXPY_MSL, "xpu": spirv_module("saxpy")}[sim_backend]
    sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64")
    try:
        settle()
        base = live_objects()
        m = accel.Module(image, device=last)
        k = m.function("saxpy", "f32, ptr, ptr, u64")
        for how in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match="cannot .*'accel.Module'"):
                how(m)
        twin = copy.copy(k)
        assert type(twin) is accel.Kernel and twin.module is m and twin.handle == k.handle
        s = accel.Stream(last)
        x = accel.Buffer(64, device=last).copy_from(np.ones(16, np.float32))
        y = accel.Buffer(64, device=last).copy_from(np.full(16, 2, np.float32))
        del k
        gc.collect()
        accel.launch(twin, 1, 16, 3.0, x, y, 16, stream=s)
        assert (y.to_numpy(np.float32, stream=s) == 5).all()
        m.close()
        with pytest.raises(ValueError, match="closed"):
            accel.launch(twin, 1, 16, 3.0, x, y, 16, stream=s)
        assert accel.current_device_index() == 0
        del m, twin, s, x, y
        settle()
        assert live_objects() == base
    finally:
        sim.unregister_kernel("saxpy")


def test_kernel_pickle_refusal_names_the_kernel(sim_backend):
    """r62b, a strict xfail until fixed: pickle.dumps / copy.deepcopy of an accel.Kernel raised
    "cannot pickle 'accel.Module' object ... share the Module object itself" (Kernel had no
    refusal of its own).  copy.copy still shares the module."""
    from accel import sim
    from test_user_kernels import SAXPY_MSL, SAXPY_PTX, saxpy_reference, spirv_module
    image = {"cuda": SAXPY_PTX, "mps": SAXPY_MSL, "xpu": spirv_module("saxpy")}[sim_backend]
    sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64")
    try:
        k = accel.Module(image, device=_last()).function("saxpy", "f32, ptr, ptr, u64")
        for how in (pickle.dumps, copy.deepcopy):
            with pytest.raises(TypeError, match="'accel.Kernel'"):
                how(k)
    finally:
        sim.unregister_kernel("saxpy")


def test_closed_and_external_objects_refuse_copies_clearly(sim_backend):
    """Closed objects refuse copy/pickle as open ones do (a closed Buffer's deepcopy says it was
    closed); a wrapper of a foreign stream (ExternalStream, CUDA) refuses them too: a copy would
    forget the handle a second time.  Nothing changes state."""
    last = _last()
    settle()
    before = process_state(), live_objects(), allocated()
    objs = [accel.Stream(last), accel.Event(), accel.Buffer(256, device=last)]
    for o in objs:
        o.close()
    for o in objs:
        for how, fn in (("copy", copy.copy), ("pickle", pickle.dumps)):
            with pytest.raises(TypeError, match=f"cannot {how} 'accel.{type(o).__name__}'"):
                fn(o)
    with pytest.raises(TypeError, match="cannot deepcopy 'accel.Stream'"):
        copy.deepcopy(objs[0])
    with pytest.raises(RuntimeError, match="closed"):
        copy.deepcopy(objs[2])
    if sim_backend == "cuda":
        owner = accel.Stream(last)
        ext = accel.ExternalStream(owner.handle, device=last)
        for how, fn in (("copy", copy.copy), ("deepcopy", copy.deepcopy), ("pickle", pickle.dumps)):
            with pytest.raises(TypeError, match=f"cannot {how} 'accel.Stream'"):
                fn(ext)
        b = accel.Buffer(64, device=last, stream=ext).fill_(1, stream=ext)
        assert (b.to_numpy(stream=ext) == 1).all()
        del ext, b, owner
    del objs, o
    settle()
    assert (process_state(), live_objects(), allocated()) == before


def test_deepcopy_of_a_buffer_subclass_keeps_its_type_or_refuses(sim_backend):
    """r62b, a strict xfail until fixed: copy.deepcopy of a Buffer subclass's instance returned
    a plain accel.Buffer ('assert <class 'accel.buffer.Buffer'> is <class '...Tagged'>'), its
    attributes lost; torch's Tensor.__deepcopy__ keeps the subclass and deep-copies __dict__."""
    class Tagged(accel.Buffer):
        pass

    t = Tagged(256, device=_last())
    t.fill_(4)
    t.tag = {"name": "weights"}
    try:
        twin = copy.deepcopy(t)
    except TypeError as exc:
        assert "Tagged" in str(exc)
        return
    assert type(twin) is Tagged and twin.tag == t.tag and twin.tag is not t.tag
    assert (twin.to_numpy() == 4).all() and twin.ptr != t.ptr


# -- 3. threads -------------------------------------------------------------------------------------
def _forked(body, timeout: float = 90.0) -> None:
    """Run ``body()`` in a run_forked child (a deadlock fails the test, not the run)."""
    def child():
        body()
        return 0
    assert run_forked(child, timeout=timeout, hung=f"{body.__name__} hung (deadlock?)") == 0


def _thread_state(devs) -> tuple:
    return (accel.current_device_index(),) + tuple(accel.current_stream(d) for d in devs)


def test_thread_pool_of_eight_on_alternating_devices(sim_backend):
    """Eight pool threads run 240 tasks: ``set_device_index(d)`` (kept by the thread for its next
    task, as torch), ``with Stream(d):`` a Buffer, fill, Event record; every task synchronizes an
    event another task recorded and some leave their stream, buffer and event to other threads
    (in reference cycles, for the collector).  A task starts with its own thread's device and
    default streams only: nothing leaks from other threads or into the main thread (last
    device, its own stream).  Afterwards stats and live simulator handles are what they were."""
    import concurrent.futures

    def body():
        devs = _devices()
        last = devs[-1]
        settle()
        base_live, base_alloc = live_objects(), allocated()
        main_stream = accel.Stream(last)
        accel.set_device_index(last)
        accel.set_stream(main_stream)
        main_state = _thread_state(devs)
        lock = threading.Lock()
        events, kept = {}, []
        mine = {}              # thread ident -> the device its last task set (written by that thread only)

        def task(i):
            me = threading.get_ident()
            start = _thread_state(devs)
            want = (mine.get(me, 0),) + tuple(accel.default_stream(d) for d in devs)
            assert start == want, f"task {i} started with {start}, not {want}"
            d = devs[i % len(devs)]
            accel.set_device_index(d)
            with accel.Stream(d) as s:
                assert accel.current_stream() is s and accel.current_device_index() == d
                b = accel.Buffer(2048)
                b.fill_(i % 251)
                ev = accel.Event()
                ev.record()
                with lock:
                    events[i] = ev
                    other = events.pop(i - 8, None)
            if other is not None:
                other.synchronize()     # recorded by another thread, maybe on the other device
                assert other.query()
            ev.synchronize()
            assert (b.to_numpy() == i % 251).all(), i
            assert _thread_state(devs) == (d,) + tuple(accel.default_stream(x) for x in devs)
            if i % 5 == 0:
                cycle = [s, b, ev]
                cycle.append(cycle)     # freed by whichever thread collects
            elif i % 5 == 1:
                with lock:
                    kept.append((s, b, ev))
            mine[me] = d
            return i

        with concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="r62b") as pool:
            assert sorted(pool.map(task, range(240), timeout=JOIN_S)) == list(range(240))
            assert _thread_state(devs) == main_state
        assert len(mine) <= 8
        events.clear()
        kept.clear()             # the threads are gone: the main thread frees what they made
        settle()
        assert _thread_state(devs) == main_state
        accel.set_stream(accel.default_stream(last))
        accel.set_device_index(0)
        del main_stream, main_state
        settle()
        assert allocated() == base_alloc
        assert live_objects() == base_live
    _forked(body)


def test_threads_ending_inside_stream_and_device_blocks(sim_backend):
    """A thread that ends inside ``with stream:`` (and inside ``with device_index``, after a
    ``set_stream``) takes its per-thread state with it: its stream, buffer and event are freed
    by the collector on the main thread, whose device and stream never changed, and the live
    simulator handles and stats come back.  A generator suspended inside ``with stream:`` on a
    worker thread and closed on the main thread after the worker ended closes quietly (its entry
    went with the worker's stack; session 37, r75e) and changes nothing of the main thread's
    state."""
    def body():
        devs = _devices()
        last = devs[-1]
        settle()
        base_live, base_alloc = live_objects(), allocated()
        before = process_state()
        refs, errors = [], []

        def ends_inside(i):
            try:
                s = accel.Stream(last)
                s.__enter__()                           # never left
                accel.device_index(0 if i % 2 else last).__enter__()
                b = accel.Buffer(4096)
                b.fill_(i)
                ev = accel.Event()
                ev.record()
                other = accel.Stream(last)
                accel.set_stream(other)                 # left current
                refs.extend(weakref.ref(o) for o in (s, b, ev, other))
                cycle = [s, b, ev, other]
                cycle.append(cycle)
            except BaseException as exc:
                errors.append(exc)

        for i in range(6):
            t = threading.Thread(target=ends_inside, args=(i,))
            t.start()
            t.join(JOIN_S)
            assert not t.is_alive(), "thread hung"
        assert not errors, errors
        assert process_state() == before
        gc.collect()
        assert [r for r in refs if r() is not None] == []

        # a generator inside `with stream:` suspended on a worker, closed on the main thread
        gens, errors = [], []

        def steps():
            s = accel.Stream(last)
            with s:
                b = accel.Buffer(1024)
                yield b.fill_(3)
                yield b

        def worker():
            try:
                g = steps()
                next(g)
                gens.append(g)
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=worker)
        t.start()
        t.join(JOIN_S)
        assert not t.is_alive() and not errors, errors
        g = gens.pop()
        g.close()
        assert process_state() == before
        del g
        settle()
        assert process_state() == before
        assert allocated() == base_alloc
        assert live_objects() == base_live
    _forked(body)


def test_deepcopy_of_a_slotted_buffer_subclass_copies_its_slots(sim_backend):
    """A subclass with slots of its own: each set slot deep-copied into the copy (an unset one
    stays unset), the bytes copied on the device, the original untouched."""
    class Slotted(accel.Buffer):
        __slots__ = ("meta", "unset")

    t = Slotted(64, device=_last())
    t.fill_(7)
    t.meta = [1, 2]
    twin = copy.deepcopy(t)
    assert type(twin) is Slotted and twin.meta == [1, 2] and twin.meta is not t.meta
    assert not hasattr(twin, "unset")
    assert (twin.to_numpy() == 7).all() and twin.ptr != t.ptr and (t.to_numpy() == 7).all()
