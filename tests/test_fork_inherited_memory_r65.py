"""Memory a forked child inherits stays mapped there (r65).

fork(2): "The child process is created with a single thread ... The entire virtual address space
of the parent is replicated in the child".  A pinned array the parent allocated (cudaHostAlloc,
zeMemAllocHost, a shared MTLBuffer) is plain host memory in the child: reading it must work, and
accel's documented fork rule only concerns device calls (README "Lazy initialization and fork").
The simulator drops its runtime in the child; before this file, the runtime's allocations went
back to the simulator's arena then, and an arena chunk with no allocation left was unmapped, so
the child's first read of an inherited pinned array segfaulted once a garbage collection had run
(tests/test_fork_threads_r59.py's child checks crashed with -11 in about one run in two).
"""

import gc

import numpy as np
import pytest

import accel
from conftest import run_forked, use_sim


@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_inherited_pinned_array_reads_in_the_child_after_a_collection(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    pinned = accel.empty_pinned(1 << 16, dtype=np.float32)
    pinned[:] = 1.5
    b = accel.Buffer(1 << 18)           # device memory too: the child never reads it
    b.fill_(2)
    accel.synchronize()

    def child() -> int:
        gc.collect()
        gc.collect()
        return 0 if (pinned == 1.5).all() else 3

    assert run_forked(child) == 0
    assert (pinned == 1.5).all() and (b.to_numpy(np.uint8) == 2).all()
