"""PyTorch's bad-fork tests, ported to accel (issue 16): test/test_multiprocessing.py
(test_cuda_bad_call, test_wrong_cuda_fork), the device lazy-init fork tests
(TestDeviceLazyInit: test_cuda_fork_poison_on_lazy_init, test_cuda_registration_idempotent)
and test/test_cuda.py::test_is_pinned_no_context.

The rule they check (DESIGN.md "Fork safety"): queries never initialize the runtime, so a
process may fork after them and the child can use the device; a child forked after the
parent initialized gets torch's clear "Cannot re-initialize CUDA in forked subprocess ...
'spawn' start method" RuntimeError instead of a hang or a crash.  ``torch.cuda.init()`` is
``accel.current_device_index()`` (which initializes), a CUDA tensor is an ``accel.Buffer``.
"""

import multiprocessing
import re
import subprocess
import sys

import numpy as np

import accel
from accel import memory

FORK_MESSAGE = ("Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, "
                "you must use the 'spawn' start method")


def _queue_get_exception(inq, outq):
    # test_multiprocessing.py's queue_get_exception: the child uses the device
    try:
        inq.get(timeout=60)
        accel.Buffer(4 * 25).copy_from(np.zeros(25, np.float32))
    except Exception as e:  # noqa: BLE001
        outq.put(e)
    else:
        outq.put("no exception")


def test_multiprocessing__test_cuda_bad_call(sim_cuda):
    # Initialize the device in the parent
    t = accel.Buffer(4 * 25).copy_from(np.zeros(25, np.float32)).to_numpy(np.float32)
    ctx = multiprocessing.get_context("fork")
    inq, outq = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_queue_get_exception, args=(inq, outq))
    p.start()
    inq.put(t)
    p.join(60)
    result = outq.get(timeout=60)
    assert isinstance(result, RuntimeError), result
    assert str(result) == FORK_MESSAGE


def test_multiprocessing__test_wrong_cuda_fork():
    script = """\
import multiprocessing
import accel

def run(rank):
    accel.set_device_index(rank)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("fork")
    size = 2
    processes = []
    for rank in range(size):
        # it would work fine without the line below
        x = accel.Buffer(4 * 40).fill_(1)
        p = ctx.Process(target=run, args=(rank,))
        p.start()
        processes.append(p)
    for p in processes:
        p.join()
"""
    out = subprocess.run([sys.executable, "-c", script], env={"PATH": "/usr/bin:/bin", "ACCEL_SIM": "cuda"},
                         capture_output=True, text=True, timeout=120)
    assert "Cannot re-initialize CUDA in forked subprocess." in out.stderr, out.stderr


def _child_init(q):
    try:
        accel.current_device_index()          # torch.cuda.init()
    except Exception as e:  # noqa: BLE001
        q.put(e)


def test_device_lazy_init__test_cuda_fork_poison_on_lazy_init(sim_cuda):
    accel.current_device_index()              # torch.cuda.init()
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_init, args=(q,))
    p.start()
    p.join(60)
    exc = q.get(timeout=60)
    assert isinstance(exc, RuntimeError)
    assert re.search(r"forked subprocess.*spawn", str(exc))


def _child_count_twice(q):
    try:
        accel.device_count()
        accel.device_count()
        accel.is_available()
    except Exception as e:  # noqa: BLE001
        q.put(e)


def test_device_lazy_init__test_cuda_registration_idempotent(sim_cuda):
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_count_twice, args=(q,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert q.empty()


def test_cuda__test_is_pinned_no_context():
    """Asking whether host memory is pinned creates no device context, so a fork afterwards
    can still use the device (accel's is_pinned: the host allocator's owns())."""
    script = """\
import multiprocessing
import numpy as np
import accel
from accel import memory


def worker(conn):
    try:
        b = accel.Buffer(4 * 10).copy_from(np.ones(10, np.float32))
        conn.send(float(b.to_numpy(np.float32)[0]))
    except Exception as e:
        conn.send("Error " + str(e))
    finally:
        conn.close()


x = np.random.rand(10)
# check that is_pinned won't poison future fork
assert memory.host_allocator().owns(x.ctypes.data, x.nbytes) is None
assert memory.host_memory_stats() == {}
assert not accel.is_initialized()
ctx = multiprocessing.get_context("fork")
parent_conn, child_conn = ctx.Pipe()
p = ctx.Process(target=worker, args=(child_conn,))
p.start()
result = parent_conn.recv()
p.join()
if isinstance(result, str) and result.startswith("Error"):
    raise RuntimeError(result)
print(result)
"""
    out = subprocess.run([sys.executable, "-c", script], env={"PATH": "/usr/bin:/bin", "ACCEL_SIM": "cuda"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1.0"


def test_cuda__test_fork_after_pinned_query_in_process(sim_cuda):
    # the same in this process: the query leaves the runtime uninitialized
    x = np.zeros(10)
    assert memory.host_allocator().owns(x.ctypes.data, x.nbytes) is None
    assert not accel.is_initialized()


def _child_synchronize(q):
    out = []
    for call in (accel.synchronize, lambda: accel.synchronize(1), lambda: accel.synchronize("cuda:0")):
        try:
            call()
            out.append("returned")
        except Exception as e:  # noqa: BLE001
            out.append(f"{type(e).__name__}: {e}")
    q.put(out)


def test_accelerator_synchronize_in_a_bad_fork_raises(sim_cuda):
    """torch.accelerator.synchronize() in a child forked after init: the current-device lookup
    runs the lazy init, which refuses ("Cannot re-initialize CUDA in forked subprocess"); accel
    returned quietly there before r59.  With an index it returns at once, as torch's
    _accelerator_synchronizeDevice does: the child's at-fork handler marks the device as never
    initialized (r70e; this test said it raised there too)."""
    accel.current_device_index()
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_synchronize, args=(q,))
    p.start()
    out = q.get(timeout=60)
    p.join(60)
    assert re.match(r"RuntimeError: Cannot re-initialize CUDA in forked subprocess", out[0]), out
    assert out[1:] == ["returned", "returned"], out
