"""A dead weak reference does not say that an object's release already happened (r39).

The cyclic collector clears the weak references to its garbage *before* it runs the garbage's
finalizers, and accel's finalizers leave the release for after the collection
(accel._finalize).  So a registry of weak references (a WeakValueDictionary) can forget an
object whose release is still on its way, and a new object registered under the same key
meanwhile must not receive the old one's release (tests/test_orphan_reaping.py: the same class
of bug in the allocators' reaping).

Foreign streams (Stream.from_handle): accel forgets the handle (the destroy hooks: the
allocators' free lists and stream uses) when the last accel wrapper of it goes, the
``_ForeignAnchor`` every wrapper holds.  The anchors are found by handle in a
WeakValueDictionary.  A wrapper made while the old anchor's forget was pending made a new
anchor, and the old forget then forgot the handle under the new wrapper's feet (its
record_stream uses replaced by an event recorded then, its free lists moved away).

Each collection test runs a collection in another thread that stops inside a finalizer of the
garbage (a gate object), while the main thread wraps the handle again, on the last device."""

import gc
import threading

import pytest

import accel
from accel import _finalize, _lazy, streams
from conftest import SIMS, use_sim


# a collection stopped at a gate in another thread: tests/test_orphan_reaping.py's
from test_orphan_reaping import _Cycle, _collect_in_thread_while


@pytest.fixture
def forgets():
    """The handles the destroy hooks are called for, in order (a recording hook of its own)."""
    seen = []

    def hook(backend, index, handle, blocking):
        seen.append(handle)
        return True

    streams.on_stream_destroy(hook)
    try:
        yield seen
    finally:
        streams._destroy_hooks.remove(hook)


def _raw_stream(dev):
    """A stream made through the backend, as another library would make it."""
    backend = _lazy.lazy_init()
    with streams.on_device(backend, dev):
        return backend, backend.stream_create()


@pytest.mark.parametrize("kind", SIMS)
def test_a_foreign_stream_wrapped_again_during_a_collection_is_not_forgotten(monkeypatch, kind, forgets):
    use_sim(monkeypatch, kind)
    dev = accel.device_count() - 1
    backend, handle = _raw_stream(dev)
    try:
        old = accel.Stream.from_handle(handle, dev)

        def make(gate):
            nonlocal old
            _Cycle(old, gate)       # the last wrapper, and so its anchor, are garbage
            old = None

        # the collector cleared the weak reference to the old anchor: a new wrapper makes a new one
        new = _collect_in_thread_while(lambda: accel.Stream.from_handle(handle, dev), make)
        _finalize.drain()           # the old anchor's forget, after the collection
        assert handle not in forgets, "the handle was forgotten while a wrapper of it lives"
        buf = accel.Buffer(4096, device=dev, stream=new)
        buf.fill_(1)
        del buf
        del new                     # the last wrapper now: accel forgets the handle, once
        gc.collect()
        _finalize.drain()
        assert forgets.count(handle) == 1, forgets
    finally:
        gc.collect()
        _finalize.drain()
        backend.stream_destroy(handle)


@pytest.mark.parametrize("kind", SIMS)
def test_a_dying_anchor_is_not_taken_by_a_new_wrapper(monkeypatch, kind, forgets):
    """Outside a collection the anchor's __del__ runs before its weak reference is cleared: a
    wrapper made by another thread meanwhile found the dying anchor in the registry and took it
    (resurrected it), so the forget under way forgot a wrapped handle, and when that wrapper went
    the anchor, whose __del__ had run already, forgot nothing."""
    use_sim(monkeypatch, kind)
    dev = accel.device_count() - 1
    backend, handle = _raw_stream(dev)
    inside, done = threading.Event(), threading.Event()
    dropper = []
    real = type(backend).captures_underway

    def gated(self):
        # _forget's first call, in the thread dropping the last wrapper: stop there
        if dropper and threading.current_thread() is dropper[0] and not inside.is_set():
            inside.set()
            done.wait(10)
        return real(self)

    monkeypatch.setattr(type(backend), "captures_underway", gated)
    try:
        old = [accel.Stream.from_handle(handle, dev)]
        thread = threading.Thread(target=old.clear)     # drops the last wrapper: __del__ of the anchor
        dropper.append(thread)
        thread.start()
        assert inside.wait(10), "the anchor's forget never started"
        try:
            new = accel.Stream.from_handle(handle, dev)
        finally:
            done.set()
            thread.join(10)
        _finalize.drain()
        assert handle not in forgets, "the handle was forgotten while a wrapper of it lives"
        del new
        gc.collect()
        _finalize.drain()
        assert forgets.count(handle) == 1, f"forgotten {forgets.count(handle)} times once no wrapper was left"
    finally:
        monkeypatch.undo()
        gc.collect()
        _finalize.drain()
        backend.stream_destroy(handle)
