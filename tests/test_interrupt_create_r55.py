"""A Ctrl-C anywhere while an Event's device event, an owned Stream or a kernel Module is being
made leaves no handle behind once the object is gone (r55).

r53 registered the release of each live Event's, Stream's and Module's handle (accel._finalize.owned), so
an interrupt as ``__del__`` starts loses nothing.  What it left: the handle exists from the moment
the runtime's create call returns, and is registered only some bytecodes later (the backend
reads and checks the out-parameter, the device scope is restored, the object stores it).  A
KeyboardInterrupt that lands in between used to leave a handle that nobody would ever destroy.

The injector is tests/test_interrupt_backends.py's: a point at every place CPython checks for a
signal in accel/streams/, accel/_finalize.py, accel/kernels and the backends, a simulated vendor call counting
as a C call (the point is as it returns), and no point where a backend blocked signals
(accel/backends/_signals.py: a real signal stays pending in the kernel there).  After each
interrupted creation, the object (if any) is dropped and the next API entry drains: the
simulator must hold exactly the streams and events it held before.
"""

import gc
import os

import pytest

import accel
from accel import _finalize, _lazy
from conftest import SIMS, use_sim
from test_interrupt_backends import _Inject, _targets, interrupted
from test_interrupt_del_r53 import _devices, _module_on, _modules, live

pytestmark = pytest.mark.usefixtures("frozen_heap")   # (conftest: a collection per point)


def _new_event(dev: int) -> accel.Event:
    ev = accel.Event(enable_timing=True)
    ev.record(accel.current_stream(dev))    # the device event is made here, on dev
    return ev


def _new_stream(dev: int) -> accel.Stream:
    return accel.Stream(dev)


_MAKERS = {"event": _new_event, "stream": _new_stream, "module": _module_on}


def _held() -> tuple:
    """The simulator's live streams, events and kernel modules."""
    return live() + ("modules", _modules())


def _settle(devices) -> None:
    gc.collect()
    _finalize.drain()
    for dev in devices:
        accel.synchronize(dev)
    _finalize.drain()


@pytest.mark.parametrize("kind", SIMS)
@pytest.mark.parametrize("what", sorted(_MAKERS))
def test_a_ctrl_c_anywhere_in_a_creation_leaves_no_handle(monkeypatch, kind, what):
    use_sim(monkeypatch, kind)
    import accel.kernels
    import accel.streams
    kernels = os.path.dirname(os.path.abspath(accel.kernels.__file__))
    streams = os.path.dirname(os.path.abspath(accel.streams.__file__))
    targets = _targets() | {os.path.abspath(_finalize.__file__)} | {
        os.path.join(package, name) for package in (kernels, streams) for name in os.listdir(package)
        if name.endswith(".py")}
    devices = _devices(kind)
    dev = devices[-1]           # device 1 where there are two: not the current device
    make = _MAKERS[what]
    for d in devices:           # first uses (default streams, command lists) made before counting
        make(d).close()
    _settle(devices)
    base = _held()
    counter = _Inject(0, targets)
    with counter:
        obj = make(dev)
    obj.close()
    del obj
    _settle(devices)
    assert _held() == base
    assert counter.count > 5
    leaks = []
    for n in range(1, counter.count + 1):
        point, obj = interrupted(n, targets, lambda: make(dev))
        del obj
        _settle(devices)
        after = _held()
        if after != base:
            leaks.append((point.site, after))
            base = after            # report each leaking point once
    assert not leaks, leaks
    assert not _finalize.owned and not _finalize.pending
    assert _lazy.lazy_init() is not None
