"""A graph's private pool released (Graph.reset) while a replay of it is still queued on another
stream (r61h).

Graph.reset releases the graph's memory pool.  A replay queued before it on a stream other than
the capture's still reads and writes the pool's blocks when it runs, so none of them may be
handed to an allocation that can run before it.  torch keeps a released pool's blocks out of
reuse until emptyCache frees them (c10/cuda/CUDACachingAllocator.cpp: releasePool only moves the
pool to graph_pools_freeable; release_cached_blocks frees its unsplit blocks with cudaFree, which
waits for the device).  accel does the same for a pool its graphs were replayed on another stream
(Graph.replay tells the allocator, pool_used_on); one replayed only on the stream of its free
lists joins the general cache at once, as before (P1 in accel/memory/_private_pools.py release_pool).
With backend:cudaMallocAsync a graph's temporaries are the driver's graph memory, which no
cudaMallocAsync gets: those cases pass as they did.

Each case queues the replay on a stream ``rs`` held back by slow fills on a third stream (the
simulator's ACCEL_SIM_DELAY_US), resets, allocates on the capture stream ``cs`` at once and fills
the new buffer with 0xab; a replay that ran after that fill overwrote it with the graph's 0x11.
No timed asserts: the order is fixed by the streams.  Each case also checks that nothing leaks
(memory_reserved back to where it was after synchronize + empty_cache).
"""

import gc

import pytest

import accel
from accel import memory

from conftest import THOROUGH, use_sim

# hundreds of short tests that collect: see conftest.frozen_module_heap
pytestmark = pytest.mark.usefixtures("frozen_module_heap")

BIG = 4 << 20       # a segment of its own (the large pool: not shared with the RNG holders)
CLASSIC = "expandable_segments:False"
CONFS = [CLASSIC, "expandable_segments:True", "policy:torch", "backend:cudaMallocAsync"]


#: every stream operation's latency (µs), and the fills that hold the replay stream back: the hold
#: (FILLS x DELAY_US) only has to outlast the few host calls between queuing the replay and the
#: capture stream's fill; the default run keeps 0.2 s of it with 5 ms per operation (every other
#: operation of a case pays the latency too).  THOROUGH: 8 fills of 50 ms, as before.
DELAY_US, FILLS = (50000, 8) if THOROUGH else (5000, 40)


def _busy_stream(dev):
    """A created stream whose next work waits for FILLS delayed fills on a third stream."""
    slow, rs = accel.Stream(dev), accel.Stream(dev)
    with accel.device_index(dev):
        pad = accel.Buffer(256, stream=slow)
    for _ in range(FILLS):
        pad.fill_(1, stream=slow)
    rs.wait_event(slow.record_event())
    return rs, (slow, pad)


def _settled_reserved(dev):
    for d in range(accel.device_count()):
        accel.synchronize(d)
    gc.collect()
    memory.empty_cache()
    return memory.memory_reserved(dev)


def _capture_temporary(g, cs, out, **kw):
    """Capture into ``g`` on ``cs``: a temporary of the graph's pool filled with 0x11, copied to
    ``out``, freed inside the capture."""
    with accel.graph(g, stream=cs, **kw):
        tmp = accel.Buffer(BIG, stream=cs)
        tmp.fill_(0x11, stream=cs)
        out.copy_from(tmp, stream=cs)
        tmp.close()


def _head(buf, cs):
    return buf.as_array("uint8", shape=(8,)).to_numpy(stream=cs).tobytes().hex()


def _sim(monkeypatch, conf):
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=DELAY_US, ACCEL_ALLOC_CONF=conf)


@pytest.mark.parametrize("conf", CONFS)
@pytest.mark.parametrize("dev", [0, 1])
def test_pool_released_by_reset_waits_for_a_replay_on_another_stream(monkeypatch, dev, conf):
    _sim(monkeypatch, conf)
    with accel.device_index(dev):
        base = _settled_reserved(dev)
        cs = accel.Stream()
        out = accel.Buffer(BIG)
        g = accel.Graph()
        _capture_temporary(g, cs, out)
        accel.synchronize()
        rs, keep = _busy_stream(dev)
        with rs:
            g.replay()
        reserved = memory.memory_reserved(dev)
        g.reset()
        # torch's releasePool: the pool's memory stays reserved (and counted) until emptyCache
        assert memory.memory_reserved(dev) == reserved
        new = accel.Buffer(BIG, stream=cs)      # made before rs ran the replay
        new.fill_(0xAB, stream=cs)
        cs.synchronize()
        rs.synchronize()
        assert _head(new, cs) == "ab" * 8
        assert _head(out, cs) == "11" * 8
        del new, out, keep, g
        assert _settled_reserved(dev) == base


@pytest.mark.parametrize("conf", [CLASSIC, "expandable_segments:True"])
@pytest.mark.parametrize("dev", [0, 1])
def test_pool_block_freed_after_the_reset_waits_for_the_replay(monkeypatch, dev, conf):
    """The graph's output (a block of its pool, still allocated at the reset) is freed after the
    reset, before the queued replay that writes it ran: the next allocation on the capture
    stream must not get it."""
    _sim(monkeypatch, conf)
    with accel.device_index(dev):
        base = _settled_reserved(dev)
        cs = accel.Stream()
        g = accel.Graph()
        with accel.graph(g, stream=cs):
            out = accel.Buffer(BIG, stream=cs)
            out.fill_(0x11, stream=cs)
        accel.synchronize()
        rs, keep = _busy_stream(dev)
        with rs:
            g.replay()
        g.reset()
        out.close()           # the pool's last live block; the replay still writes it
        new = accel.Buffer(BIG, stream=cs)
        new.fill_(0xAB, stream=cs)
        cs.synchronize()
        rs.synchronize()
        assert _head(new, cs) == "ab" * 8
        del new, keep, g
        assert _settled_reserved(dev) == base


@pytest.mark.parametrize("conf", [CLASSIC, "expandable_segments:True"])
@pytest.mark.parametrize("dev", [0, 1])
def test_replay_stream_closed_before_the_reset(monkeypatch, dev, conf):
    """The replay stream is closed (accel forgets its handle: the allocator covers its work with
    an event) before the graph is reset: the pool still waits for that work."""
    _sim(monkeypatch, conf)
    with accel.device_index(dev):
        base = _settled_reserved(dev)
        cs = accel.Stream()
        out = accel.Buffer(BIG)
        g = accel.Graph()
        _capture_temporary(g, cs, out)
        accel.synchronize()
        rs, keep = _busy_stream(dev)
        with rs:
            g.replay()
        rs.close()
        other = accel.Stream()          # may get rs's handle value back: inherits nothing
        g.reset()
        new = accel.Buffer(BIG, stream=cs)
        new.fill_(0xAB, stream=cs)
        cs.synchronize()
        accel.synchronize()
        assert _head(new, cs) == "ab" * 8
        del new, out, keep, g, other
        assert _settled_reserved(dev) == base


@pytest.mark.parametrize("conf", [CLASSIC, "expandable_segments:True", "backend:cudaMallocAsync"])
@pytest.mark.parametrize("dev", [0, 1])
def test_shared_pool_reset_of_one_graph_while_the_other_still_replays(monkeypatch, dev, conf):
    """Two graphs share a pool (Graph(pool=g1.pool())).  g1 is replayed on rs and reset while
    that replay is queued; the pool stays in use by g2, which is replayed on another stream (also
    queued) and then reset: neither queued replay may find its temporary handed out."""
    _sim(monkeypatch, conf)
    with accel.device_index(dev):
        base = _settled_reserved(dev)
        cs = accel.Stream()
        out1, out2 = accel.Buffer(BIG), accel.Buffer(BIG)
        g1 = accel.Graph()
        _capture_temporary(g1, cs, out1)
        g2 = accel.Graph(pool=g1.pool())
        _capture_temporary(g2, cs, out2)
        accel.synchronize()
        rs1, keep1 = _busy_stream(dev)
        with rs1:
            g1.replay()
        g1.reset()                       # the pool is still g2's
        first = accel.Buffer(BIG, stream=cs)
        first.fill_(0xAB, stream=cs)
        rs2, keep2 = _busy_stream(dev)
        with rs2:
            g2.replay()
        g2.reset()                       # now released, with both replays still queued
        second = accel.Buffer(BIG, stream=cs)
        second.fill_(0xCD, stream=cs)
        third = accel.Buffer(BIG, stream=rs1)     # on the first replay's stream: ordered after it
        third.fill_(0xEF, stream=rs1)
        accel.synchronize()
        assert _head(first, cs) == "ab" * 8
        assert _head(second, cs) == "cd" * 8
        assert _head(third, cs) == "ef" * 8
        del first, second, third, out1, out2, keep1, keep2, g1, g2
        assert _settled_reserved(dev) == base


def _pool_of(seg_addr):
    return {s["address"]: tuple(s["segment_pool_id"]) for s in memory.memory_snapshot()}.get(seg_addr)


@pytest.mark.parametrize("conf", ["policy:torch"])
def test_released_pool_is_kept_as_torch_keeps_it_until_empty_cache(monkeypatch, conf):
    """A pool replayed on another stream is kept once released, as torch keeps a released pool
    (graph_pools_freeable): its segment stays reserved and listed in the snapshot under the pool's
    id, no request gets it, even after the replay ran, until empty_cache returns it to the device.
    (torch's policy: accel's release-before-grow, and a grow of expandable segments under either
    policy (E10), return it to the device for ``early``'s miss instead, cudaFree waiting for the
    replay, rather than lift reserved memory past its high-water mark; the first test covers
    those.)"""
    _sim(monkeypatch, conf)
    dev = 1
    with accel.device_index(dev):
        alloc = memory.device_allocator(dev)
        base = _settled_reserved(dev)
        cs = accel.Stream()
        out = accel.Buffer(BIG)
        g = accel.Graph()
        _capture_temporary(g, cs, out)
        pool = g.pool()
        [seg] = [s["address"] for s in memory.memory_snapshot() if tuple(s["segment_pool_id"]) == pool]
        accel.synchronize()
        rs, keep = _busy_stream(dev)
        with rs:
            g.replay()
        reserved = memory.memory_reserved(dev)
        g.reset()
        assert alloc.pool_use_count(pool) == 0
        assert memory.memory_reserved(dev) == reserved
        early = accel.Buffer(BIG, stream=cs)
        assert early.ptr != seg and _pool_of(seg) == pool
        rs.synchronize()
        late = accel.Buffer(BIG, stream=cs)
        assert late.ptr != seg and _pool_of(seg) == pool
        assert memory.memory_reserved(dev) > reserved       # early's and late's own memory
        del early, late
        memory.empty_cache()
        assert _pool_of(seg) is None                         # returned to the device
        del out, keep, g
        assert _settled_reserved(dev) == base


@pytest.mark.parametrize("dev", [0, 1])
def test_replay_on_the_capture_stream_needs_no_wait(monkeypatch, dev):
    """A replay on the capture stream itself: the next allocation there is ordered after it, so
    the released segment joins the general cache at once and may serve it (stream order)."""
    _sim(monkeypatch, CLASSIC)
    with accel.device_index(dev):
        base = _settled_reserved(dev)
        cs = accel.Stream()
        out = accel.Buffer(BIG)
        g = accel.Graph()
        _capture_temporary(g, cs, out)
        accel.synchronize()
        pool = g.pool()
        [seg] = [s["address"] for s in memory.memory_snapshot() if tuple(s["segment_pool_id"]) == pool]
        with cs:
            g.replay()
        g.reset()
        assert _pool_of(seg) == (0, 0)          # joined the general cache, as before r61h
        new = accel.Buffer(BIG, stream=cs)
        new.fill_(0xAB, stream=cs)
        cs.synchronize()
        assert _head(new, cs) == "ab" * 8
        del new, out, g
        assert _settled_reserved(dev) == base


@pytest.mark.parametrize("dev", [0, 1])
def test_mempool_of_a_graph_replayed_elsewhere_goes_to_the_device(monkeypatch, dev):
    """A graph captured into a MemPool's pool, replayed on another stream; the graph is reset and
    the MemPool dropped while the replay is queued (torch's ~MemPool: releasePool, then emptyCache
    of the pool): the pool's whole segments go back to the device, cudaFree waiting for the
    replay, and the next allocation on the capture stream is not overwritten."""
    _sim(monkeypatch, CLASSIC)
    with accel.device_index(dev):
        base = _settled_reserved(dev)
        cs = accel.Stream()
        out = accel.Buffer(BIG)
        mp = memory.MemPool()
        g = accel.Graph()
        _capture_temporary(g, cs, out, pool=mp.id)
        pool = mp.id
        accel.synchronize()
        rs, keep = _busy_stream(dev)
        with rs:
            g.replay()
        g.reset()
        del mp
        gc.collect()
        assert pool not in memory.device_allocator(dev)._private
        new = accel.Buffer(BIG, stream=cs)
        new.fill_(0xAB, stream=cs)
        accel.synchronize()
        assert _head(new, cs) == "ab" * 8
        assert _head(out, cs) == "11" * 8
        del new, out, keep, g
        assert _settled_reserved(dev) == base


# -- the allocator alone (tests/test_memory_allocator.py's fake backend and invariants) -------------

def test_allocator_keeps_a_pool_replayed_on_another_stream():
    from test_memory_allocator import MiB, check_invariants, make
    for conf in ("", "policy:torch"):
        alloc, be = make(conf)
        pool = (7, 0)
        alloc.begin_allocate_to_pool(pool, 9)
        tmp = alloc.malloc(3 * MiB, 9)
        out = alloc.malloc(3 * MiB, 9)
        alloc.free(tmp)
        alloc.end_allocate_to_pool(pool)
        alloc.pool_used_on(pool, 9)          # on the capture stream: no wait needed
        alloc.pool_used_on(pool, 5)          # on another stream: kept once released
        alloc.pool_used_on(pool, 6)
        alloc.pool_used_on(pool, 7)          # (two are enough to know)
        assert len(alloc._private[pool].replays) == 2
        alloc.release_pool(pool)
        with pytest.raises(ValueError, match="no private pool"):
            alloc.pool_used_on(pool, 5)
        check_invariants(alloc, be)
        assert alloc.malloc(3 * MiB, 9) not in (tmp, out)
        alloc.free(out)                      # the last live block: its segment stays kept too
        assert pool in alloc._private
        assert {alloc._blocks[p].pool.owner for p in alloc._segments if p in (tmp, out)} == {alloc._private[pool]}
        check_invariants(alloc, be)
        owners = {tuple(s["segment_pool_id"]) for s in alloc.snapshot()["segments"]
                  if s["address"] <= out < s["address"] + s["total_size"]}
        assert owners == {pool}              # listed under the pool's id, as torch's freeable pools
        alloc.empty_cache()                  # frees the pool's segments (cudaFree waits for the device)
        assert pool not in alloc._private
        check_invariants(alloc, be)


def test_allocator_hands_over_a_pool_replayed_only_on_its_stream():
    from test_memory_allocator import MiB, check_invariants, make
    alloc, be = make()
    pool = (8, 0)
    alloc.begin_allocate_to_pool(pool, 9)
    tmp = alloc.malloc(3 * MiB, 9)
    alloc.free(tmp)
    alloc.end_allocate_to_pool(pool)
    alloc.pool_used_on(pool, 9)
    alloc.release_pool(pool)
    assert alloc._private == {}
    assert alloc.malloc(3 * MiB, 9) == tmp, "joined the general cache, as before r61h"
    check_invariants(alloc, be)
    # a pool with free lists on two streams (two captures shared it): a replay on one is not
    # ordered before the other's next allocation
    for stream in (9, 4):
        alloc.begin_allocate_to_pool(pool, stream)
        alloc.free(alloc.malloc(3 * MiB, stream))
        alloc.end_allocate_to_pool(pool)
    alloc.pool_used_on(pool, 9)
    alloc.release_pool(pool)
    alloc.release_pool(pool)
    assert pool in alloc._private and alloc._private[pool].kept
    check_invariants(alloc, be)
    alloc.empty_cache()
    assert alloc._private == {}
    check_invariants(alloc, be)


def test_shared_pool_is_kept_when_any_of_its_graphs_replayed_elsewhere():
    from test_memory_allocator import MiB, check_invariants, make
    alloc, be = make()
    pool = (10, 0)
    for _ in range(2):
        alloc.begin_allocate_to_pool(pool, 9)
        alloc.free(alloc.malloc(3 * MiB, 9))
        alloc.end_allocate_to_pool(pool)
    alloc.pool_used_on(pool, 5)          # the first graph's replay
    alloc.release_pool(pool)             # the first graph's reset: still the second's
    alloc.pool_used_on(pool, 9)          # the second graph's replay, on the capture stream
    alloc.release_pool(pool)
    assert alloc._private[pool].kept
    check_invariants(alloc, be)
    alloc.empty_cache()
    assert alloc._private == {} and be.live == {}
