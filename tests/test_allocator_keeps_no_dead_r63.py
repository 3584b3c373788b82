"""After empty_cache the allocator keeps no object of a destroyed stream or a freed segment.

A merge of two free blocks retires one block object, which the allocator keeps (``_spare``) for
the next split to reuse.  Until r63 it kept its old fields too: the free list of the stream it
was cached on (a stream destroyed since) and its neighbours, and through them the expandable
segment whose reservation empty_cache had freed.  The r62l pressure programs' census saw one
such free list (or block) in 1 run of 20 under load, depending on which merge came last.
"""

from __future__ import annotations

import gc

import pytest

import accel
from accel import memory
from accel.memory._blocks import _Block, _FreeList

from conftest import SIMS, use_sim

MiB = 1 << 20


@pytest.mark.parametrize("conf", ["", "expandable_segments:False"], ids=lambda v: v or "default")
@pytest.mark.parametrize("dev", [0, 1])
@pytest.mark.parametrize("kind", SIMS)
@pytest.mark.usefixtures("frozen_heap")     # its heap scan sees only this test's objects (r66i)
def test_no_free_list_of_a_destroyed_stream_outlives_empty_cache(monkeypatch, kind, dev, conf):
    if kind == "mps" and (dev or conf):
        pytest.skip("Metal has one device and no expandable segments")
    use_sim(monkeypatch, kind, **({"ACCEL_ALLOC_CONF": conf} if conf else {}))
    s = accel.Stream(dev)
    a = accel.Buffer(MiB, device=dev, stream=s)
    b = accel.Buffer(MiB, device=dev, stream=s)
    a.close()
    b.close()                   # b's block merges into a's (or a's into the rest): one retired
    handle = s.handle
    s.close()
    del s
    accel.synchronize(dev)
    memory.empty_cache()
    gc.collect()
    dead = [o for o in gc.get_objects() if type(o) is _FreeList and o.stream == handle]
    assert not dead, f"{len(dead)} free list(s) of the destroyed stream {handle:#x} still alive"
    alloc = memory.device_allocator(dev)
    kept = [o for o in gc.get_objects() if type(o) is _Block and o.ptr not in alloc._blocks]
    assert not kept, f"{len(kept)} block object(s) of no segment kept after empty_cache"
