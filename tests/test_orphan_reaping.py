"""The allocators free the blocks of owners gone without freeing them (a Ctrl-C as malloc
returned or as ``__del__`` began: ``_reap_orphans``).  A dead weak reference alone does not
say that: the cyclic collector clears the weak references to its garbage *before* it runs the
garbage's finalizers, and a Buffer's release then waits until the collection is over
(accel._finalize.finalize_later).  Reaping such a block let the late release free the same
address again, by then another Buffer's (tests/test_gc_stress.py on Level Zero, about one run in
three: "pointer ... is not allocated" from a live Buffer's record_stream).

Each test runs a collection in another thread that stops inside a finalizer of the garbage,
where the weak reference to the garbage Buffer is already dead, and calls empty_cache (which
reaps) in the main thread meanwhile, on the last (non-current) device."""

import gc
import threading

import numpy as np
import pytest

import accel
from accel import _finalize, memory
from conftest import SIMS, use_sim


class _Cycle:
    def __init__(self, *objs):
        self.objs = objs
        self.me = self


class _Gate:
    """In the garbage: its finalizer tells the main thread the collection is under way, then
    waits until the main thread is done."""

    def __init__(self, inside: threading.Event, done: threading.Event):
        self.inside, self.done = inside, done
        self.me = self

    def __del__(self):
        self.inside.set()
        self.done.wait(10)


def _collect_in_thread_while(fn, make_garbage):
    inside, done = threading.Event(), threading.Event()
    make_garbage(_Gate(inside, done))
    gc.disable()            # only the thread's gc.collect() collects, and only once
    try:
        thread = threading.Thread(target=gc.collect)
        thread.start()
        assert inside.wait(10), "the collection never reached the gate"
        try:
            return fn()
        finally:
            done.set()
            thread.join(10)
    finally:
        gc.enable()


@pytest.mark.parametrize("kind", SIMS)
def test_a_buffer_collected_meanwhile_is_not_freed_twice(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    dev = accel.device_count() - 1
    alloc = memory.device_allocator(dev)
    keep = accel.Buffer(4096, device=dev)       # its segment stays: the freed block is reused
    garbage = accel.Buffer(4096, device=dev)
    ptr = garbage._ptr

    def make(gate):
        nonlocal garbage
        _Cycle(garbage, gate)
        garbage = None

    def meanwhile():
        alloc.empty_cache()                     # reaps blocks whose owner's weak reference died
        return accel.Buffer(4096, device=dev)   # may take the garbage's block, if it was reaped

    other = _collect_in_thread_while(meanwhile, make)
    _finalize.drain()                           # the garbage's release, after the collection
    other.fill_(7)                              # its block is still its own
    assert (other.to_numpy() == 7).all()
    assert alloc.stats()["allocation.all.current"] == 2, "a live block was freed (or one leaked)"
    del other, keep
    gc.collect()
    _finalize.drain()
    assert alloc.stats()["allocation.all.current"] == 0
    assert ptr                                  # (the address the garbage had)


@pytest.mark.parametrize("kind", SIMS)
def test_a_collected_buffer_stays_usable_by_a_finalizer_of_its_cycle(monkeypatch, kind):
    """The collector runs the finalizers of one cycle in any order (PEP 442): one may still read
    a Buffer of the cycle (accel keeps it open until the collection is over), so its memory must
    not be reaped, and given to another Buffer, meanwhile."""
    use_sim(monkeypatch, kind)
    dev = accel.device_count() - 1
    alloc = memory.device_allocator(dev)
    keep = accel.Buffer(4096, device=dev)
    held = accel.Buffer(4096, device=dev)
    held.fill_(3)
    seen = []

    class Reader:
        def __init__(self, buf):
            self.buf = buf
            self.me = self

        def __del__(self):
            seen.append(int(self.buf.to_numpy(np.uint8)[0]))

    def make(gate):
        nonlocal held
        reader = Reader(held)
        reader.gate = gate                      # one cycle: the gate's finalizer may run first
        gate.reader = reader
        held = None

    def meanwhile():
        alloc.empty_cache()
        other = accel.Buffer(4096, device=dev)
        other.fill_(9)
        return other

    other = _collect_in_thread_while(meanwhile, make)
    _finalize.drain()
    assert seen == [3], seen
    assert (other.to_numpy() == 9).all()
    del other, keep
    gc.collect()
    _finalize.drain()
    assert alloc.stats()["allocation.all.current"] == 0
