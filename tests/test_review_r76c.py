"""r76c review: realistic user programs against accel's public API, each on every simulator
(cuda, xpu, mps; two devices where the backend has them), each mixing several features the way
real code does: stream pipelines on the non-current device with events and record_stream, a
training-step-like loop captured in a graph with a private pool and RNG replayed against the
eager result, timing events on both devices, memory stats and snapshots against the live
buffers, nested device/stream scopes unwound by exceptions, RNG state saved around a graph, and
pinned non-blocking copies synchronized through events.

Only the public API (``accel.*``, ``accel.memory.*``, ``accel.random.*``); torch 2.13's rules
(REFERENCE.md) are the expected behaviour.  These programs found no accel bug (no xfail here);
the refusals they meet (XPU's captured fills and event records, global-mode capture vs another
thread's synchronize, events recorded in a capture) are checked to be clear and to leave the
devices usable.
"""

import gc

import numpy as np
import pytest

import accel

from conftest import SIMS, use_sim

DEV = 1         # the non-current device where the backend has two (Metal has one)
N = 4096        # float32 elements per buffer (16 KiB)


def _dev():
    """The device a program runs its data on: 1 where there are two, else 0 (Metal)."""
    return DEV if accel.device_count() > 1 else 0


def _has_graphs():
    return accel.current_accelerator().type != "mps"


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _collect():
    gc.collect()
    accel.synchronize()


# -- Philox4x32-10 reference (REFERENCE.md: Random123; curand_init(seed, 0, offset) order) -------
M0, M1, W0, W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85


def _philox_block(ctr, key):
    c = [int(x) for x in ctr]
    k0, k1 = int(key[0]), int(key[1])
    for r in range(10):
        if r:
            k0 = (k0 + W0) & 0xFFFFFFFF
            k1 = (k1 + W1) & 0xFFFFFFFF
        p0, p1 = M0 * c[0], M1 * c[2]
        hi0, lo0, hi1, lo1 = p0 >> 32, p0 & 0xFFFFFFFF, p1 >> 32, p1 & 0xFFFFFFFF
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return c


def test_philox_reference_kat():
    assert _philox_block([0, 0, 0, 0], [0, 0]) == [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
    assert _philox_block([0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344], [0xa4093822, 0x299f31d0]) == \
        [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]


def _philox_words(seed, offset, n):
    """The first ``n`` 32-bit values of curand_init(seed, 0, offset) read one after another."""
    out = []
    block = offset // 4
    skip = offset % 4
    while len(out) < n + skip:
        out += _philox_block([block & 0xFFFFFFFF, block >> 32, 0, 0], [seed & 0xFFFFFFFF, seed >> 32])
        block += 1
    return np.array(out[skip:skip + n], dtype=np.uint32)


# -- 1. producer/consumer pipeline on the non-current device -------------------------------------

def test_pipeline_two_streams_non_current_device_record_stream_back_to_baseline(sim_backend):
    dev = _dev()
    accel.set_device_index(0)
    base_alloc = [accel.memory.memory_allocated(d) for d in range(accel.device_count())]
    results = []
    with accel.device_index(dev):
        producer, consumer = accel.Stream(), accel.Stream()
        assert producer.device_index == dev and consumer.device_index == dev
    for step in range(4):
        data = np.full(N, step + 1, np.float32)
        with accel.device_index(dev), producer:
            buf = accel.Buffer(4 * N)            # on dev, from the producer stream's cache
            assert buf.device_index == dev
            buf.copy_from(data, non_blocking=True)
            ready = accel.Event()
            ready.record()
        consumer.wait_event(ready)
        buf.record_stream(consumer)              # consumer reads it after the producer drops it
        out = accel.Buffer(4 * N, device=dev, stream=consumer)
        out.copy_from(buf, stream=consumer, non_blocking=True)
        del buf                                  # freed while the consumer may still read it
        host = out.to_numpy(np.float32, stream=consumer)
        results.append(float(host.sum()))
        del out
    assert accel.current_device_index() == 0
    assert accel.current_stream().device_index == 0
    assert results == [float((s + 1) * N) for s in range(4)]
    _collect()
    assert [accel.memory.memory_allocated(d) for d in range(accel.device_count())] == base_alloc
    stats = accel.memory.memory_stats(dev)
    # the last freed block waits for its record_stream event (torch: active until processed)
    assert stats["allocation.all.current"] == 0 and stats["active_bytes.all.current"] <= 4 * N
    producer.close()
    consumer.close()
    accel.memory.empty_cache()
    stats = accel.memory.memory_stats(dev)
    assert stats["active_bytes.all.current"] == 0
    assert accel.memory.memory_reserved(dev) == 0


def test_pipeline_consumer_sees_producer_through_wait_stream(sim_backend):
    """A ring of three buffers on the non-current device: the producer writes slot i while
    the consumer reduces slot i-1 into an accumulator, ordered only by wait_stream/events."""
    dev = _dev()
    with accel.device_index(dev):
        prod, cons = accel.Stream(), accel.Stream()
        ring = [accel.Buffer(4 * N) for _ in range(3)]
        free = [accel.Event() for _ in range(3)]
        acc = accel.Buffer(4 * N)
        acc.fill_(0)
    total = np.zeros(N, np.float32)
    for i in range(7):
        slot = i % 3
        with prod:
            prod.wait_event(free[slot])   # an unrecorded event: no wait (torch: no-op)
            ring[slot].copy_from(np.full(N, i, np.float32), non_blocking=True)
        cons.wait_stream(prod)
        part = ring[slot].to_numpy(np.float32, stream=cons)
        total += part
        free[slot].record(cons)
    assert accel.current_device_index() == 0
    assert total[0] == sum(range(7)) and (total == total[0]).all()


# -- 2. training-step loop captured in a graph with a private pool and RNG ------------------------

def _step(weights, noise, scratch_size):
    """One "training step": noise <- uniform; a scratch buffer allocated inside, filled from
    weights, copied back with noise mixed in by a byte-level copy."""
    accel.random.uniform_(noise)
    scratch = accel.Buffer(scratch_size)
    scratch.copy_from(noise)
    weights.copy_from(scratch)
    del scratch


def test_graph_training_loop_private_pool_rng_matches_eager_then_memory_returns(sim_backend):
    dev = _dev()
    if not _has_graphs():
        g = accel.Graph()                       # made, as torch.mps has none: capture refuses
        with pytest.raises(NotImplementedError, match="no stream capture"):
            with accel.graph(g, stream=accel.Stream()):
                pass
        assert not accel.is_current_stream_capturing()
        return
    with accel.device_index(dev):
        accel.synchronize()
        accel.memory.empty_cache()
        base_reserved = accel.memory.memory_reserved(dev)
        weights = accel.Buffer(4 * N)
        noise = accel.Buffer(4 * N)
        # eager: three steps from seed 1234
        accel.random.manual_seed(1234)
        eager = []
        for _ in range(3):
            _step(weights, noise, 4 * N)
            eager.append(weights.to_numpy(np.float32).copy())
        assert not np.array_equal(eager[0], eager[1])
        # captured: same seed, replayed three times
        accel.random.manual_seed(1234)
        s = accel.Stream()
        s.wait_stream(accel.current_stream())
        with s:                                   # warm-up on the side stream, as torch's recipe
            _step(weights, noise, 4 * N)
        accel.current_stream().wait_stream(s)
        accel.random.manual_seed(1234)
        g = accel.Graph()
        if accel.current_accelerator().type == "xpu":
            # XPU's fills run on the host: a capture of one is refused, cleanly
            with pytest.raises(accel.CaptureError, match="cannot be captured on xpu"):
                with accel.graph(g, stream=s):
                    _step(weights, noise, 4 * N)
            assert not s.is_capturing() and not accel.is_current_stream_capturing()
            assert accel.random.default_generator(dev).get_offset() == 0
            del g
            weights.close()
            noise.close()
            s.close()
            _collect()
            accel.memory.empty_cache()
            assert accel.memory.memory_allocated(dev) == 0
            assert accel.memory.memory_reserved(dev) == base_reserved
            return
        with accel.graph(g, stream=s):
            _step(weights, noise, 4 * N)
        pool = g.pool()
        assert isinstance(pool, tuple) and len(pool) == 2
        replayed = []
        for _ in range(3):
            g.replay()
            replayed.append(weights.to_numpy(np.float32).copy())
        for a, b in zip(eager, replayed):
            np.testing.assert_array_equal(a, b)
        del g
        weights.close()
        noise.close()
        s.close()
        _collect()
        accel.memory.empty_cache()
        assert accel.memory.memory_allocated(dev) == 0
        assert accel.memory.memory_reserved(dev) == base_reserved
    assert accel.current_device_index() == 0


def test_rng_state_saved_and_restored_around_graph_capture_and_replay(sim_backend):
    """Checkpoint-style code: save the RNG state, capture and replay a graph that draws, put the
    state back: the next eager draw repeats the draw taken right after the save."""
    dev = _dev()
    with accel.device_index(dev):
        accel.random.manual_seed(7)
        buf = accel.Buffer(4 * 1000)
        accel.random.uniform_(buf)      # advance a little
        saved = accel.random.get_rng_state(dev)
        saved_offset = accel.random.default_generator(dev).get_offset()
        accel.random.normal_(buf)
        expect = buf.to_numpy(np.float32).copy()
        accel.random.set_rng_state(saved, dev)
        if accel.current_accelerator().type == "cuda":      # xpu refuses captured fills
            s = accel.Stream()
            g = accel.Graph()
            with accel.graph(g, stream=s):
                accel.random.uniform_(buf)
            for _ in range(4):
                g.replay()
            accel.synchronize()
        else:
            for _ in range(4):
                accel.random.uniform_(buf)
        assert accel.random.default_generator(dev).get_offset() != saved_offset
        accel.random.set_rng_state(saved, dev)
        assert accel.random.default_generator(dev).get_offset() == saved_offset
        accel.random.normal_(buf)
        np.testing.assert_array_equal(buf.to_numpy(np.float32), expect)
        # device 0's generator never moved
        if accel.device_count() > 1:
            assert accel.random.default_generator(0).get_offset() == 0


def test_random_raw_matches_philox_reference_on_the_non_current_device(sim_backend):
    dev = _dev()
    accel.random.manual_seed_all(0x1234_5678_9ABC)
    buf = accel.Buffer(4 * 10, device=dev)
    accel.random.random_raw_(buf)
    got0 = buf.to_numpy(np.uint32)
    np.testing.assert_array_equal(got0, _philox_words(0x1234_5678_9ABC, 0, 10))
    # the second fill starts at the offset rounded up to 4 (10 words -> 12)
    assert accel.random.default_generator(dev).get_offset() == 12
    accel.random.random_raw_(buf)
    np.testing.assert_array_equal(buf.to_numpy(np.uint32), _philox_words(0x1234_5678_9ABC, 12, 10))
    if accel.device_count() > 1:            # device 0 seeded the same: the same numbers
        b0 = accel.Buffer(4 * 10, device=0)
        accel.random.random_raw_(b0)
        np.testing.assert_array_equal(b0.to_numpy(np.uint32), got0)


# -- 3. events and timing on both devices -------------------------------------------------------

def test_timing_events_per_device_and_cross_device_refusal(sim_backend):
    devs = list(range(accel.device_count()))
    pairs = {}
    for d in devs:
        with accel.device_index(d):
            s = accel.Stream()
            start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
            buf = accel.Buffer(1 << 20)
            with s:
                start.record()
                for i in range(4):
                    buf.fill_(i)
                end.record()
            pairs[d] = (start, end, s, buf)
    for d, (start, end, s, buf) in pairs.items():
        ms = start.elapsed_time(end)          # accel waits for both (documented difference)
        assert isinstance(ms, float) and ms >= 0.0
        assert end.query() and s.query()
        assert buf.to_numpy()[0] == 3
    if len(devs) > 1:
        with pytest.raises((ValueError, RuntimeError)) as info:
            pairs[0][0].elapsed_time(pairs[1][1])
        assert "device" in str(info.value)
    assert accel.current_device_index() == 0


def test_event_recorded_on_other_device_stream_orders_current_device_copy(sim_backend):
    """Device-1 work signals an event; device 0's current stream waits on it and copies the
    result across (cross-device copy), as multi-GPU code does."""
    if accel.device_count() < 2:
        pytest.skip("one device (Metal)")
    s1 = accel.Stream(device=1)
    src = accel.Buffer(4 * N, device=1)
    with s1:
        src.copy_from(np.arange(N, dtype=np.float32), non_blocking=True)
        done = s1.record_event()
    assert done.device.index == 1
    accel.current_stream().wait_event(done)
    dst = accel.Buffer(4 * N)              # device 0
    src.record_stream(accel.current_stream(1))
    dst.copy_from(src, non_blocking=True)
    np.testing.assert_array_equal(dst.to_numpy(np.float32), np.arange(N, dtype=np.float32))
    assert accel.current_device_index() == 0


# -- 4. memory stats and snapshot against the live buffers --------------------------------------

def test_memory_stats_and_snapshot_agree_with_live_buffers_on_both_devices(sim_backend):
    rng = np.random.default_rng(5)
    ndev = accel.device_count()
    live = {d: [] for d in range(ndev)}
    for i in range(40):
        d = int(rng.integers(ndev))
        size = int(rng.choice([1, 511, 512, 513, 4000, 1 << 20, (1 << 20) + 1, 3 << 20]))
        live[d].append(accel.Buffer(size, device=d))
        if i % 3 == 2:                         # free one at random
            d2 = int(rng.integers(ndev))
            if live[d2]:
                live[d2].pop(int(rng.integers(len(live[d2])))).close()
    accel.synchronize()
    snap = accel.memory.memory_snapshot()
    for d in range(ndev):
        stats = accel.memory.memory_stats(d)
        assert stats["allocation.all.current"] == len(live[d])
        assert stats["requested_bytes.all.current"] == sum(b.nbytes for b in live[d])
        assert stats["allocated_bytes.all.current"] == accel.memory.memory_allocated(d)
        assert stats["allocated_bytes.all.current"] >= sum(b.nbytes for b in live[d])
        assert stats["reserved_bytes.all.current"] == accel.memory.memory_reserved(d)
        segs = [s for s in snap if s["device"] == d]
        blocks = [b for s in segs for b in s["blocks"] if b["state"] == "active_allocated"]
        assert len(blocks) == len(live[d])
        assert sum(b["size"] for b in blocks) == stats["allocated_bytes.all.current"]
        assert sum(b["requested_size"] for b in blocks) == stats["requested_bytes.all.current"]
        assert sum(s["total_size"] for s in segs) == stats["reserved_bytes.all.current"]
        ptrs = {b.ptr for b in live[d]}
        assert {b["address"] for b in blocks} == ptrs
    for d in range(ndev):
        for b in live[d]:
            b.close()
    accel.memory.empty_cache()
    for d in range(ndev):
        assert accel.memory.memory_allocated(d) == 0
        assert accel.memory.memory_reserved(d) == 0
        assert accel.memory.max_memory_allocated(d) > 0
        accel.memory.reset_peak_memory_stats(d)
        assert accel.memory.max_memory_allocated(d) == 0


# -- 5. nested device/stream scopes unwound by exceptions --------------------------------------

class _Boom(Exception):
    pass


def test_nested_device_and_stream_scopes_restore_after_exceptions(sim_backend):
    dev = _dev()
    outer = accel.current_stream()
    assert accel.current_device_index() == 0
    s = accel.Stream(device=dev)
    t = accel.Stream(device=0)
    for _ in range(3):
        with pytest.raises(_Boom):
            with accel.device_index(dev):
                with s:
                    assert accel.current_stream() is s
                    assert accel.current_device_index() == dev
                    with t:                          # a device-0 stream inside: switches device
                        assert accel.current_device_index() == 0
                        assert accel.current_stream() is t
                        raise _Boom()
        assert accel.current_device_index() == 0
        assert accel.current_stream() is outer
        assert accel.current_stream(dev) == accel.default_stream(dev)
    # set_stream inside a device scope: torch's device_index restores the device only
    with accel.device_index(dev):
        accel.set_stream(s)
    assert accel.current_device_index() == 0
    assert accel.current_stream(dev) is s         # the stream stays current on its device
    accel.set_stream(accel.default_stream(dev))
    assert accel.current_device_index() == dev    # set_stream switches device (torch)
    accel.set_device_index(0)
    # work after the unwinding lands where the scopes say
    buf = accel.Buffer(64)
    assert buf.device_index == 0
    with s:
        b2 = accel.Buffer(64)
        b2.fill_(9)
    assert b2.device_index == dev
    assert b2.to_numpy(stream=s)[0] == 9


def test_stream_scope_left_by_exception_inside_graph_capture_leaves_no_capture(sim_backend):
    if not _has_graphs():
        pytest.skip("Metal has no stream capture")
    dev = _dev()
    with accel.device_index(dev):
        s = accel.Stream()
        buf = accel.Buffer(4 * N)
        g = accel.Graph()
        with pytest.raises(_Boom):
            with accel.graph(g, stream=s):
                buf.fill_(1)
                raise _Boom()
        assert not accel.is_current_stream_capturing()
        assert not s.is_capturing()
        assert accel.current_stream() == accel.default_stream(dev)
        # the device is usable: a fresh capture works and replays
        g2 = accel.Graph()
        with accel.graph(g2, stream=s):
            buf.fill_(5)
        g2.replay()
        assert buf.to_numpy()[0] == 5
    assert accel.current_device_index() == 0


# -- 6. pinned host copies, non-blocking, synchronized with events -------------------------------

def test_pinned_round_trip_non_blocking_then_event_sync_on_non_current_device(sim_backend):
    dev = _dev()
    host_in = accel.empty_pinned((N,), np.float32)
    host_out = accel.empty_pinned((N,), np.float32)
    host_in[:] = np.arange(N, dtype=np.float32)
    s = accel.Stream(device=dev)
    buf = accel.Buffer(4 * N, device=dev, stream=s)
    with s:
        buf.copy_from(host_in, non_blocking=True)
        buf.copy_to(host_out, non_blocking=True)
        ev = accel.Event()
        ev.record()
    ev.synchronize()
    assert ev.query()
    np.testing.assert_array_equal(host_out, host_in)
    # to_numpy(non_blocking) -> (array, event)
    with s:
        buf.fill_(2)
    arr, ev2 = buf.to_numpy(np.float32, stream=s, non_blocking=True)
    ev2.synchronize()
    assert arr.shape == (N,) and (arr.view(np.uint8) == 2).all()
    assert accel.current_device_index() == 0


def test_pinned_staging_buffer_reused_after_event_does_not_corrupt_uploads(sim_backend):
    """A loader reuses one pinned staging array: it refills it only after the event of the
    previous upload completed; every device buffer keeps its own batch."""
    dev = _dev()
    stage = accel.empty_pinned((N,), np.float32)
    s = accel.Stream(device=dev)
    bufs, ev = [], None
    for i in range(5):
        if ev is not None:
            ev.synchronize()
        stage[:] = i
        b = accel.Buffer(4 * N, device=dev, stream=s)
        b.copy_from(stage, stream=s, non_blocking=True)
        ev = s.record_event()
        bufs.append(b)
    for i, b in enumerate(bufs):
        assert (b.to_numpy(np.float32, stream=s) == i).all()


# -- 7. a MemPool on the non-current device, used from a side stream ---------------------------

def test_mempool_on_non_current_device_with_side_stream_then_released(sim_backend):
    dev = _dev()
    with accel.device_index(dev):
        pool = accel.MemPool()
        s = accel.Stream()
    assert accel.current_device_index() == 0
    with (pytest.raises(ValueError) if dev != 0 else _nothing()):
        with accel.use_mem_pool(pool):          # device 0 is current: the pool is device dev's
            pass
    with accel.use_mem_pool(pool, device=dev):
        bufs = [accel.Buffer(4096 * (i + 1), device=dev, stream=s) for i in range(4)]
        if dev != 0:
            outside = accel.Buffer(4096, device=0)  # another device: not the pool's
    if dev == 0:
        outside = accel.Buffer(4096, device=0)      # after the context: not the pool's
    segs = accel.memory.memory_snapshot(mempool_id=pool.id)
    pooled = {b["address"] for seg in segs for b in seg["blocks"] if b["state"] == "active_allocated"}
    assert pooled == {b.ptr for b in bufs}
    assert outside.ptr not in pooled
    assert all(seg["device"] == dev for seg in segs)
    for i, b in enumerate(bufs):
        b.fill_(i + 1, stream=s)
    assert [int(b.to_numpy(stream=s)[-1]) for b in bufs] == [1, 2, 3, 4]
    assert pool.use_count() == 1
    del bufs, b, outside
    _collect()
    del pool
    _collect()
    accel.memory.empty_cache()
    assert accel.memory.memory_allocated(dev) == 0
    assert accel.memory.memory_reserved(dev) == 0


# -- 8. per-thread current streams, each thread on a device of its own --------------------------

def test_threads_with_own_streams_and_devices_do_not_see_each_others_scopes(sim_backend):
    import threading
    ndev = accel.device_count()
    barrier = threading.Barrier(2)
    seen, errors = {}, []

    def worker(name, d, value):
        try:
            accel.set_device_index(d)            # per thread, as cudaSetDevice
            s = accel.Stream()
            with s:
                barrier.wait()
                buf = accel.Buffer(4 * N)
                buf.fill_(value)
                barrier.wait()
                seen[name] = (accel.current_device_index(), accel.current_stream() is s,
                              int(buf.to_numpy()[0]), buf.device_index)
        except BaseException as exc:             # pragma: no cover
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=("a", 0, 3)),
               threading.Thread(target=worker, args=("b", ndev - 1, 4))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors
    assert seen["a"] == (0, True, 3, 0)
    assert seen["b"] == (ndev - 1, True, 4, ndev - 1)
    assert accel.current_device_index() == 0       # the main thread's device is its own
    assert accel.current_stream() == accel.default_stream(0)


# -- 9. a user Generator on the non-current device, registered with a graph ---------------------

def test_user_generator_on_non_current_device_registered_in_graph_matches_eager(sim_backend):
    dev = _dev()
    gen = accel.random.Generator(device_index=dev)
    gen.manual_seed(99)
    with accel.device_index(dev):
        buf = accel.Buffer(4 * 256)
        eager = []
        for _ in range(3):
            accel.random.normal_(buf, generator=gen)
            eager.append(buf.to_numpy(np.float32).copy())
        gen.manual_seed(99)
        if accel.current_accelerator().type != "cuda":
            # xpu/mps: the same eager numbers again after reseeding (no capture of fills there)
            accel.random.normal_(buf, generator=gen)
            np.testing.assert_array_equal(buf.to_numpy(np.float32), eager[0])
            return
        g = accel.Graph()
        g.register_generator_state(gen)
        s = accel.Stream()
        default_before = accel.random.default_generator(dev).get_offset()
        with accel.graph(g, stream=s):
            accel.random.normal_(buf, generator=gen)
        for i in range(3):
            g.replay()
            np.testing.assert_array_equal(buf.to_numpy(np.float32), eager[i])
        assert accel.random.default_generator(dev).get_offset() == default_before
        # the eager draw after the replays continues where the third replay ended
        accel.random.normal_(buf, generator=gen)
        after_graph = buf.to_numpy(np.float32).copy()
        gen.manual_seed(99)
        for _ in range(4):
            accel.random.normal_(buf, generator=gen)
        np.testing.assert_array_equal(buf.to_numpy(np.float32), after_graph)


def test_rng_state_all_round_trip_and_seed_all(sim_backend):
    ndev = accel.device_count()
    accel.random.manual_seed_all(5)
    states = accel.random.get_rng_state_all()
    assert len(states) == ndev
    bufs = [accel.Buffer(4 * 64, device=d) for d in range(ndev)]
    for b in bufs:
        accel.random.uniform_(b)
    first = [b.to_numpy(np.float32).copy() for b in bufs]
    for a in first[1:]:
        np.testing.assert_array_equal(a, first[0])    # same seed, same numbers on every device
    new = accel.random.seed_all()
    assert all(accel.random.initial_seed(d) == new for d in range(ndev))
    accel.random.set_rng_state_all(states)
    for b in bufs:
        accel.random.uniform_(b)
    for b, a in zip(bufs, first):
        np.testing.assert_array_equal(b.to_numpy(np.float32), a)
    assert all(accel.random.initial_seed(d) == 5 for d in range(ndev))


# -- 10. a buffer copied between devices and deep-copied, closed in with-blocks ---------------

def test_cross_device_copies_and_deepcopy_keep_data_and_free_everything(sim_backend):
    import copy
    ndev = accel.device_count()
    data = np.arange(N, dtype=np.float32)
    with accel.Buffer(4 * N, device=ndev - 1) as a:
        a.copy_from(data)
        with accel.Buffer(4 * N, device=0) as b:
            b.copy_from(a)
            c = copy.deepcopy(a)
            assert c.device_index == a.device_index and c.ptr != a.ptr
            np.testing.assert_array_equal(b.to_numpy(np.float32), data)
            np.testing.assert_array_equal(c.to_numpy(np.float32), data)
            c.close()
    with pytest.raises(RuntimeError, match="closed"):
        a.to_numpy()                          # the with-block closed it
    _collect()
    for d in range(ndev):
        assert accel.memory.memory_allocated(d) == 0


# -- 11. graphs of the non-current device: static outputs, a shared pool, replay from device 0 ---

def test_graphs_on_other_device_share_a_pool_static_output_replayed_from_device_0(sim_backend):
    if not _has_graphs():
        pytest.skip("Metal has no stream capture")
    dev = _dev()
    with accel.device_index(dev):
        accel.synchronize()
        accel.memory.empty_cache()
        base = accel.memory.memory_reserved(dev)
        x = accel.Buffer(4 * N).copy_from(np.full(N, 1, np.float32))
        s = accel.Stream()
        g1 = accel.Graph()
        with accel.graph(g1, stream=s):
            y = accel.Buffer(4 * N)             # static output, from g1's private pool
            y.copy_from(x)
        g2 = accel.Graph(pool=g1.pool())
        with accel.graph(g2, pool=g1.pool(), stream=s):
            z = accel.Buffer(4 * N)
            z.copy_from(y)
        assert g2.pool() == g1.pool()
    assert accel.current_device_index() == 0
    x.copy_from(np.full(N, 7, np.float32))
    g1.replay()                 # replayed from device 0 current: runs on dev (torch: capture_dev_)
    g2.replay()
    assert accel.current_device_index() == 0
    np.testing.assert_array_equal(z.to_numpy(np.float32), np.full(N, 7, np.float32))
    np.testing.assert_array_equal(y.to_numpy(np.float32), np.full(N, 7, np.float32))
    del g1, g2
    _collect()
    np.testing.assert_array_equal(z.to_numpy(np.float32), np.full(N, 7, np.float32))  # outputs outlive
    assert accel.memory.memory_allocated(dev) >= 3 * 4 * N
    del y, z, x
    _collect()
    accel.memory.empty_cache()
    assert accel.memory.memory_allocated(dev) == 0
    assert accel.memory.memory_reserved(dev) == base


# -- 12. host arrays that are slices: a batch gathered into one pinned array ---------------------

def test_gather_batches_into_slices_of_one_pinned_array_non_blocking(sim_backend):
    dev = _dev()
    s = accel.Stream(device=dev)
    parts = []
    for i in range(4):
        b = accel.Buffer(4 * 256, device=dev, stream=s)
        b.copy_from(np.full(256, i, np.float32), stream=s)
        parts.append(b)
    out = accel.empty_pinned((4 * 256,), np.float32)
    for i, b in enumerate(parts):
        b.copy_to(out[i * 256:(i + 1) * 256], stream=s, non_blocking=True)
    done = s.record_event()
    done.synchronize()
    np.testing.assert_array_equal(out, np.repeat(np.arange(4, dtype=np.float32), 256))
    # a strided host destination: every other element
    dst = np.zeros(512, np.float32)
    with pytest.raises((ValueError, TypeError, BufferError)):
        parts[1].copy_to(dst[::2], stream=s)
    assert (dst == 0).all()
    # a 2-D upload from a C-contiguous host array, read back with a shape
    grid = np.arange(256, dtype=np.float32).reshape(16, 16)
    parts[0].copy_from(grid, stream=s)
    np.testing.assert_array_equal(parts[0].to_numpy(np.float32, (16, 16), stream=s), grid)
    summary = accel.memory.memory_summary(dev)
    assert "accel" in summary and "memory summary" in summary


# -- 13. a memory cap on the non-current device: OOM, recovery, stats per device ----------------

def test_memory_fraction_oom_on_non_current_device_recovers_and_counts_there_only(sim_backend):
    dev = _dev()
    MiB = 1 << 20
    total = accel.memory.get_memory_info(dev)[1]
    accel.memory.set_per_process_memory_fraction(64 * MiB / total, dev)
    held = []
    with pytest.raises(accel.OutOfMemoryError) as info:
        for _ in range(20):
            held.append(accel.Buffer(16 * MiB, device=dev))
    msg = str(info.value)
    assert str(dev) in msg
    assert isinstance(info.value, RuntimeError)        # torch.OutOfMemoryError is a RuntimeError
    assert 2 <= len(held) <= 4
    assert accel.memory.memory_stats(dev)["num_ooms"] == 1
    if dev != 0:
        assert accel.memory.memory_stats(0).get("num_ooms", 0) == 0
        big = accel.Buffer(128 * MiB, device=0)        # device 0 is not capped
        big.close()
    assert accel.current_device_index() == 0
    del held
    _collect()
    again = [accel.Buffer(16 * MiB, device=dev) for _ in range(2)]
    assert accel.memory.memory_allocated(dev) == 32 * MiB
    del again
    _collect()
    accel.memory.set_per_process_memory_fraction(1.0, dev)
    accel.memory.empty_cache()
    assert accel.memory.memory_reserved(dev) == 0


# -- 14. events: recorded on one device, reused on another, waited across devices --------------

def test_event_reuse_across_devices_and_cross_device_waits(sim_backend):
    if accel.device_count() < 2:
        pytest.skip("one device (Metal)")
    s0, s1 = accel.Stream(device=0), accel.Stream(device=1)
    ev = accel.Event()
    assert ev.query()                          # never recorded: complete (torch)
    ev.record(s1)
    assert ev.device.index == 1
    with pytest.raises((ValueError, RuntimeError)) as info:
        ev.record(s0)                          # torch: the event's device does not match
    assert "device" in str(info.value)
    a = accel.Buffer(4 * N, device=1)
    with s1:
        a.copy_from(np.full(N, 3, np.float32), non_blocking=True)
    s0.wait_stream(s1)                         # cross-device wait
    b = accel.Buffer(4 * N, device=0, stream=s0)
    b.copy_from(a, stream=s0)
    np.testing.assert_array_equal(b.to_numpy(np.float32, stream=s0), np.full(N, 3, np.float32))
    assert accel.current_device_index() == 0
    # synchronize the non-current device only
    accel.synchronize(1)
    assert s1.query()


# -- 15. uniform/randint numbers against the documented word rules, on a side stream ----------

def test_uniform_and_randint_follow_the_word_rules_on_side_stream_of_other_device(sim_backend):
    dev = _dev()
    seed = 2024
    s = accel.Stream(device=dev)
    gen = accel.random.Generator(device_index=dev, seed=seed)
    buf = accel.Buffer(4 * 37, device=dev, stream=s)
    with s:
        accel.random.uniform_(buf, low=-1.0, high=1.0, generator=gen)
    got = buf.to_numpy(np.float32, stream=s)
    w = _philox_words(seed, 0, 37)
    u = (w >> 8).astype(np.float32) * np.float32(2.0 ** -24)
    want = (u * np.float32(2.0) + np.float32(-1.0)).astype(np.float32)
    want[want >= 1.0] = -1.0
    np.testing.assert_array_equal(got, want)
    assert gen.get_offset() == 40
    assert got.min() >= -1.0 and got.max() < 1.0
    # randint, a narrow span (1 word each) then a wide one (2 words each), int64
    ib = accel.Buffer(8 * 9, device=dev, stream=s)
    with s:
        accel.random.randint_(ib, 10, 20, generator=gen)
    w = _philox_words(seed, 40, 9)
    np.testing.assert_array_equal(ib.to_numpy(np.int64, stream=s), 10 + (w % 10).astype(np.int64))
    assert gen.get_offset() == 52
    with s:
        accel.random.randint_(ib, 0, 1 << 40, generator=gen)
    w = _philox_words(seed, 52, 18).astype(np.uint64)
    v = w[0::2] | (w[1::2] << np.uint64(32))
    np.testing.assert_array_equal(ib.to_numpy(np.int64, stream=s), (v % np.uint64(1 << 40)).astype(np.int64))
    assert gen.get_offset() == 72
    # the default generators never moved
    assert all(accel.random.default_generator(d).get_offset() == 0 for d in range(accel.device_count()))


# -- 16. events recorded inside captures ---------------------------------------------------------

def test_event_recorded_in_capture_refused_clearly_and_external_event_works(sim_backend):
    kind = accel.current_accelerator().type
    if kind == "mps":
        pytest.skip("Metal has no stream capture")
    dev = _dev()
    s = accel.Stream(device=dev)
    x = accel.Buffer(4096, device=dev)
    ev = accel.Event()
    g = accel.Graph()
    if kind == "xpu":
        with pytest.raises(accel.CaptureError, match="cannot record events"):
            with accel.graph(g, stream=s):
                x.fill_(1)
                ev.record()
        assert not s.is_capturing()
        return
    with accel.graph(g, stream=s):
        x.fill_(1)
        ev.record()
        x.fill_(2)
    g.replay()
    for call in (ev.query, ev.synchronize, lambda: accel.current_stream(dev).wait_event(ev)):
        with pytest.raises(accel.CaptureError, match="recorded inside a graph capture"):
            call()
    ext = accel.Event(external=True)
    g2 = accel.Graph()
    with accel.graph(g2, stream=s):
        x.fill_(3)
        ext.record()
    g2.replay()
    accel.current_stream(dev).wait_event(ext)
    ext.synchronize()
    assert x.to_numpy()[0] == 3
    assert accel.current_device_index() == 0


# -- 17. a loader thread allocating on device 0 while device 1 captures ------------------------

@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_other_thread_work_during_capture_by_capture_mode(sim_backend, mode):
    import threading
    if not _has_graphs():
        pytest.skip("Metal has no stream capture")
    x = accel.Buffer(4096, device=DEV)
    s1 = accel.Stream(device=DEV)
    g = accel.Graph()
    inside, done = threading.Event(), threading.Event()
    res = {}

    def loader():
        inside.wait(5)
        try:
            b = accel.Buffer(8 << 20, device=0)
            b.fill_(3)
            res["other"] = int(b.to_numpy()[0])     # a stream synchronize
        except accel.CaptureError as exc:
            res["other"] = exc
        done.set()

    t = threading.Thread(target=loader)
    t.start()
    try:
        with accel.graph(g, stream=s1, capture_error_mode=mode):
            x.fill_(7)
            inside.set()
            done.wait(5)
        g.replay()
        res["main"] = int(x.to_numpy()[0])
    except accel.CaptureError as exc:
        res["main"] = exc
    t.join(5)
    if mode == "global":
        # as CUDA/torch: the other thread's synchronize is refused and invalidates the capture
        assert isinstance(res["other"], accel.CaptureError)
        assert isinstance(res["main"], accel.CaptureError)
        assert not s1.is_capturing()
        g2 = accel.Graph()                      # the device is usable again
        with accel.graph(g2, stream=s1):
            x.fill_(8)
        g2.replay()
        assert x.to_numpy()[0] == 8
    else:
        assert res == {"other": 3, "main": 7}


# -- 18. a buffer outliving the stream it was allocated on ---------------------------------------

def test_buffer_outlives_its_allocation_stream(sim_backend):
    dev = _dev()
    s = accel.Stream(device=dev)
    a = accel.Buffer(1 << 20, device=dev, stream=s)
    a.fill_(5, stream=s)
    s.synchronize()
    s.close()
    assert a.to_numpy()[0] == 5                 # read on the default stream
    with pytest.raises(RuntimeError, match="was closed"):
        a.fill_(1, stream=s)
    with pytest.raises(RuntimeError, match="was closed"):
        a.record_stream(s)
    a.fill_(6)                                  # default stream
    assert a.to_numpy()[-1] == 6
    del a
    _collect()
    assert accel.memory.memory_allocated(dev) == 0
    accel.memory.empty_cache()
    assert accel.memory.memory_reserved(dev) == 0


# -- 19. graph-safe generator states swapped between replays ------------------------------------

def test_graphsafe_set_state_after_capture_keeps_the_captured_state_as_torch(sim_backend):
    """torch 2.13: a captured fill reads the holders of the state its generator had at capture;
    ``graphsafe_set_state`` afterwards points the generator at another state, but the graph
    keeps drawing from (and advancing) the captured one; a registered state the graph draws
    nothing from is not advanced."""
    if accel.current_accelerator().type != "cuda":
        pytest.skip("captured fills: CUDA only (XPU refuses them, Metal has no capture)")
    n = 64
    x = accel.Buffer(4 * n, device=DEV)
    s1 = accel.Stream(device=DEV)
    gen = accel.random.Generator(device_index=DEV, seed=5)
    other = accel.random.Generator(device_index=DEV, seed=9).graphsafe_get_state()
    g = accel.Graph()
    g.register_generator_state(gen)
    g.register_generator_state(other)
    with accel.graph(g, stream=s1):
        accel.random.uniform_(x, generator=gen)
    g.replay()
    a = x.to_numpy(np.float32).copy()
    assert gen.get_offset() == 64
    gen.graphsafe_set_state(other)
    g.replay()
    b = x.to_numpy(np.float32).copy()
    assert gen.get_offset() == 0 and other.get_offset() == 0

    def eager(seed, offset):
        q = accel.random.Generator(device_index=DEV, seed=seed)
        q.set_offset(offset)
        ref = accel.Buffer(4 * n, device=DEV)
        accel.random.uniform_(ref, generator=q)
        return ref.to_numpy(np.float32)

    np.testing.assert_array_equal(a, eager(5, 0))
    np.testing.assert_array_equal(b, eager(5, 64))
    del g
    _collect()
    x.close()
    accel.memory.empty_cache()
    assert accel.memory.memory_allocated(DEV) == 0 and accel.memory.memory_reserved(DEV) == 0


# -- 20. pinned arrays dropped while their copies are still queued (simulated latency) ---------

@pytest.mark.parametrize("kind", SIMS)
def test_pinned_arrays_dropped_before_their_copies_ran_are_not_reused_early(monkeypatch, kind):
    use_sim(monkeypatch, kind, ACCEL_SIM_DELAY_US=5000)
    dev = _dev()
    b = accel.Buffer(1 << 16, device=dev)
    b.fill_(3)
    accel.synchronize(dev)
    arr, ev = b.to_numpy(np.uint8, non_blocking=True)
    del arr                                       # the download is still queued
    gc.collect()
    new = accel.empty_pinned((1 << 16,), np.uint8)
    new[:] = 7
    ev.synchronize()
    assert (new == 7).all(), "the queued download wrote into a reused pinned block"
    h = accel.empty_pinned((1 << 16,), np.uint8)
    h[:] = 9
    b.copy_from(h, non_blocking=True)
    del h                                         # the upload is still queued
    gc.collect()
    h2 = accel.empty_pinned((1 << 16,), np.uint8)
    h2[:] = 1
    got = b.to_numpy()
    assert (got == 9).all(), "the queued upload read a reused pinned block"
    del new, h2
    _collect()
    accel.memory.empty_host_cache()
    assert accel.memory.host_memory_stats()["allocations.current"] == 0


# -- 21. work on device 0 while device 1 captures ------------------------------------------------

def test_device_0_work_inside_a_device_1_capture(sim_backend):
    """Inside a capture of device 1: replaying a device-0 graph runs it eagerly on device 0's
    current stream; allocating on device 0 works; a blocking read on device 0 is refused (CUDA's
    global mode) and ends the capture; every case leaves the devices usable."""
    if not _has_graphs():
        pytest.skip("Metal has no stream capture")
    x0, x1 = accel.Buffer(4096, device=0), accel.Buffer(4096, device=DEV)
    s0, s1 = accel.Stream(device=0), accel.Stream(device=DEV)
    g0 = accel.Graph()
    with accel.graph(g0, stream=s0):
        x0.fill_(1)
    g1 = accel.Graph()
    with accel.graph(g1, stream=s1):
        x1.fill_(2)
        g0.replay()
        x1.fill_(3)
    assert x0.to_numpy()[0] == 1
    g1.replay()
    assert x1.to_numpy()[0] == 3
    g2 = accel.Graph()
    with accel.graph(g2, stream=s1):
        x1.fill_(4)
        b = accel.Buffer(8 << 20, device=0)
        b.fill_(5)
    assert b.to_numpy()[0] == 5
    g2.replay()
    assert x1.to_numpy()[0] == 4
    g3 = accel.Graph()
    with pytest.raises(accel.CaptureError):
        with accel.graph(g3, stream=s1):
            x1.fill_(6)
            with accel.device_index(0):
                y = accel.Buffer(4096)
                y.fill_(7)
                y.to_numpy()
    assert not s1.is_capturing() and not accel.is_current_stream_capturing()
    assert accel.current_device_index() == 0
    g4 = accel.Graph()
    with accel.graph(g4, stream=s1):
        x1.fill_(8)
    g4.replay()
    assert x1.to_numpy()[0] == 8


# -- 22. a graph deleted while its replays are still queued (simulated latency) -----------------

@pytest.mark.parametrize("kind", [k for k in SIMS if k != "mps"])
def test_graph_deleted_with_replays_queued_then_pool_memory_reused(monkeypatch, kind):
    use_sim(monkeypatch, kind, ACCEL_SIM_DELAY_US=5000)
    src = accel.Buffer(1 << 20, device=DEV)
    src.fill_(4)
    out = accel.Buffer(1 << 20, device=DEV)
    s = accel.Stream(device=DEV)
    g = accel.Graph()
    with accel.graph(g, stream=s):
        tmp = accel.Buffer(1 << 20, device=DEV)     # the graph's private temporary
        tmp.copy_from(src)
        out.copy_from(tmp)
        del tmp
    src.fill_(6)
    g.replay()
    g.replay()
    del g                                           # replays still queued
    gc.collect()
    accel.memory.empty_cache()
    other = accel.Buffer(1 << 20, device=DEV)       # may take the pool's memory back
    other.fill_(1)
    assert out.to_numpy()[0] == 6 and other.to_numpy()[0] == 1
    del other, out, src
    _collect()
    accel.memory.empty_cache()
    assert accel.memory.memory_allocated(DEV) == 0 and accel.memory.memory_reserved(DEV) == 0
