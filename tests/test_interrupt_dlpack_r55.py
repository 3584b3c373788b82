"""A Ctrl-C anywhere in a DLPack export leaves no export behind once its capsule is gone (r55).

``accel._dlpack.export`` registers the managed tensor (which keeps its owner, and pins an
accel.Buffer) before it makes the capsule, and the capsule's address after: a KeyboardInterrupt
between the capsule's creation and that registration dropped a capsule whose destructor could
not find its export, so the owner stayed alive, pinned, for the rest of the process.  Each point
of accel/_dlpack/ and accel/buffer/ in ``Buffer.__dlpack__`` is injected, in both capsule
kinds, on the non-current device of each simulator.  Before the fix the point as
PyCapsule_New returned crashed the interpreter: the destructor of the unregistered capsule
returned with the interrupt still pending ("returned a result with an exception set"), which
cleared the exception the interpreter was unwinding (Fatal Python error: Segmentation fault).
An interrupt as a ``_Pin.__del__`` starts (the export's pin of the buffer) is printed and ignored
by CPython: the buffer then stays pinned until it is freed (its allocator reclaims the block of
a dead owner), which this test does not count.
"""

import gc
import os

import pytest

from accel import _dlpack
from conftest import SIMS, use_sim
from test_interrupt_backends import _Inject, interrupted

pytestmark = pytest.mark.usefixtures("frozen_heap")   # (conftest: a collection per point)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("kind", SIMS)
@pytest.mark.parametrize("versioned", [False, True])
def test_a_ctrl_c_anywhere_in_an_export_leaves_no_export(monkeypatch, kind, versioned):
    import accel.buffer
    use_sim(monkeypatch, kind)
    targets = {os.path.abspath(m.__file__) for m in (_dlpack, accel.buffer)}
    dlpack = os.path.dirname(os.path.abspath(_dlpack.__file__))        # every module of accel/_dlpack/
    targets |= {os.path.join(dlpack, name) for name in os.listdir(dlpack) if name.endswith(".py")}
    buffer = os.path.dirname(os.path.abspath(accel.buffer.__file__))    # every module of accel/buffer/
    targets |= {os.path.join(buffer, name) for name in os.listdir(buffer) if name.endswith(".py")}
    dev = accel.device_count() - 1
    buf = accel.Buffer(256, device=dev)
    kwargs = {"max_version": (1, 0)} if versioned else {}
    capsule = buf.__dlpack__(**kwargs)
    del capsule
    gc.collect()
    assert _dlpack.live_exports() == 0
    counter = _Inject(0, targets)
    with counter:
        capsule = buf.__dlpack__(**kwargs)
    del capsule
    assert counter.count > 3
    left = []
    for n in range(1, counter.count + 1):
        point, capsule = interrupted(n, targets, lambda: buf.__dlpack__(**kwargs))
        del capsule
        gc.collect()
        if _dlpack.live_exports():
            left.append(point.site)
            _dlpack._exports.clear()        # (for the next point)
    buf.close()
    assert not left, left
