"""Realistic user programs, r67b: what a demanding torch.accelerator user writes, run on all three
simulators (CUDA, Level Zero "xpu", Metal "mps"; two devices where the runtime has them).

Earlier rounds (test_user_programs.py, test_user_programs2.py, _r41, _r42, _r56, _r58, _r62c,
_r62f, _r66b) took loader rings, pipelines across devices, graphs replayed from threads,
MemPools, OOM loops, fork and DLPack keywords.  These combine what they did not:

1. a training loop on the non-current device whose activations live in a ``MemPool`` and whose
   step is captured into a shared graph pool, while ``set_allocator_settings`` changes
   (expandable segments on, rounding and a GC threshold, expandable off again) between steps
   and memory history records; after every step the trace (``_snapshot()["device_traces"]``),
   replayed from an empty device, must give exactly the snapshot's segments and live blocks,
   the pool's own snapshot must match the program's ledger, and ``memory_stats`` must add up;
2. a producer/consumer pipeline across two devices: the producer works on device 0, the
   consumer on device 1 (never current) waits with events and ``wait_stream``, pulls batches
   with a cross-device ``Buffer.copy_from``, and is cancelled half way: streams and buffers
   closed while copies are still queued;
3. accel mixed with numpy and DLPack (``from_dlpack``, ``__dlpack__(stream=...)``), and the
   mistakes users make there: a wrong ``stream`` type, a capsule taken twice, a read after
   ``close()``; each mistake must raise a clear error and change nothing;
4. OutOfMemoryError under ``set_per_process_memory_fraction``, caught, memory freed,
   ``empty_cache()``, retried: the process must end with the stats (and snapshot) a fresh run
   has;
5. every program on Level Zero and Metal as well, where the API exists (Metal has no graphs and
   one device).

Results are compared with numpy byte for byte.  Every accel bug found is a strict xfail naming
the cause.
"""

import gc
import threading

import numpy as np
import pytest

import accel
from conftest import SIMS, use_sim
from test_user_programs import JOIN_S, _devices, join_all, process_state, settle
from test_user_programs_r56 import saxpy  # noqa: F401  (fixture: the saxpy kernel per simulator)
from test_user_programs2 import assert_same_footprint
from test_user_programs_r66b import (_bounded_footprint, _dev_stats, _last, _native, _slow, _trace,
                                     check_stat_invariants)
from test_user_kernels import expected as saxpy_np

MiB = 1 << 20

def _run_warm(program, runs: int = 2):
    """Run ``program`` ``runs`` times to warm up, take the footprint, run it once more: same
    footprint.  A program that changes the allocator's settings leaves up to one AllocConfig per
    device and one for the run-time settings: bounded (checked), but not always as many."""
    def fp():
        live, tables, objs = _bounded_footprint()
        assert objs.get("AllocConfig", 0) <= len(_devices()) + 1, objs
        objs.pop("AllocConfig", None)
        return live, tables, objs

    for run in range(runs):
        program(run)
    before = fp()
    program(runs)
    assert_same_footprint(before, fp())


# -- the trace, replayed ------------------------------------------------------------------------
def replay_trace(device: int):
    """Replay device ``device``'s trace (history recorded from an empty device) into what it says
    is reserved and live: ``(reserved ranges {addr: size}, live blocks {addr: (size, pool_id)})``.
    Every step is checked for what a trace must never say: a block allocated twice, a free of a
    block not allocated, a segment released that was never made."""
    entries = accel.memory._snapshot()["device_traces"][device]
    mapped, live, requested = {}, {}, {}
    for i, e in enumerate(entries):
        act, addr, size = e["action"], e.get("addr"), e.get("size")
        where = (device, i, act, addr, size)
        if act in ("segment_alloc", "segment_map"):
            assert addr not in mapped, ("reserved twice", where)
            mapped[addr] = size
        elif act in ("segment_free", "segment_unmap"):
            if addr in mapped and mapped[addr] == size:
                del mapped[addr]
            else:
                # an unmap may take the tail or head of a mapped range (expandable segments)
                hit = [a for a, s in mapped.items() if a <= addr and addr + size <= a + s]
                assert hit, ("released, never reserved", where, sorted(mapped.items()))
                a = hit[0]
                s = mapped.pop(a)
                if a < addr:
                    mapped[a] = addr - a
                if addr + size < a + s:
                    mapped[addr + size] = a + s - addr - size
        elif act == "alloc":
            assert addr not in live, ("allocated twice", where)
            live[addr] = (size, tuple(e["pool_id"]))
        elif act == "free_requested":
            assert addr in live and addr not in requested, ("free of no live block", where)
            requested[addr] = size
        elif act == "free_completed":
            assert addr in live, ("completed free of no live block", where)
            requested.pop(addr, None)
            del live[addr]
    return mapped, live


def check_trace_matches_snapshot(device: int, where: str = "") -> None:
    """The replayed trace gives the snapshot's reserved bytes, its live blocks (address, requested
    size) and each live block's pool."""
    mapped, live = replay_trace(device)
    segs = [s for s in accel.memory.memory_snapshot() if s["device"] == device]
    reserved = sum(s["total_size"] for s in segs)
    assert sum(mapped.values()) == reserved, (where, device, "reserved", sum(mapped.values()), reserved)
    snap_live = {}
    for s in segs:
        for b in s["blocks"]:
            if b["state"] == "active_allocated":
                snap_live[b["address"]] = (b["requested_size"], tuple(s["segment_pool_id"]))
    assert live == snap_live, (where, device, "live blocks",
                               {a: live.get(a) for a in set(live) ^ set(snap_live)},
                               {a: snap_live.get(a) for a in set(live) ^ set(snap_live)})
    # every live block lies in a reserved range (adjacent mapped ranges merged: an expandable
    # segment grows by mapping the pages after its end)
    merged = []
    for a, s in sorted(mapped.items()):
        if merged and merged[-1][1] == a:
            merged[-1][1] = a + s
        else:
            merged.append([a, a + s])
    for addr, (size, _) in live.items():
        assert any(a <= addr and addr + max(size, 1) <= e for a, e in merged), (where, "outside", addr, size)


def check_snapshot_layout(device: int, where: str = "") -> None:
    """Each segment of ``device`` in the snapshot is tiled by its blocks (the first at the
    segment's address, each starting where the last ended, sizes adding up to total_size), and
    its allocated/active/requested sizes are its blocks' sums (torch's memory_snapshot layout);
    inactive_split counts the free blocks of split classic segments, as memory_stats says."""
    segs = [s for s in accel.memory.memory_snapshot() if s["device"] == device]
    split_n = split_bytes = 0
    for s in segs:
        at = s["address"]
        for b in s["blocks"]:
            assert b["address"] == at, (where, "gap or overlap", hex(s["address"]), hex(b["address"]), hex(at))
            at += b["size"]
        assert at == s["address"] + s["total_size"], (where, "blocks do not fill the segment", s["total_size"])
        alloc = [b for b in s["blocks"] if b["state"] == "active_allocated"]
        active = [b for b in s["blocks"] if b["state"].startswith("active")]
        assert s["allocated_size"] == sum(b["size"] for b in alloc), (where, "allocated_size")
        assert s["active_size"] == sum(b["size"] for b in active), (where, "active_size")
        assert s["requested_size"] == sum(b["requested_size"] for b in active), (where, "requested_size")
        for b in s["blocks"]:
            assert b["requested_size"] <= b["size"], (where, b)
        if len(s["blocks"]) > 1 and not s["is_expandable"]:
            # torch's free_block leaves expandable segments out of inactive_split ("fully free
            # pages of expandable blocks can always be freed"; accel/memory/_expandable.py E14)
            free = [b for b in s["blocks"] if b["state"] == "inactive"]
            split_n += len(free)
            split_bytes += sum(b["size"] for b in free)
    if _native():
        st = accel.memory.memory_stats(device)
        assert (st["inactive_split.all.current"], st["inactive_split_bytes.all.current"]) == (split_n, split_bytes), \
            (where, "inactive_split", st["inactive_split.all.current"], st["inactive_split_bytes.all.current"],
             split_n, split_bytes)


# -- 1. training loop: MemPool activations, graph pool, settings changed, history checked --------
def _act_sizes(step: int) -> list:
    rng = np.random.default_rng([67, step])
    return [int(x) for x in rng.integers(1, 300_000, 5)] + [int(rng.integers(3 * MiB, 6 * MiB))]


@pytest.mark.parametrize("kind", SIMS)
def test_training_loop_pools_settings_history_consistent(monkeypatch, kind, saxpy):
    """A training loop on the last device (device 0 stays current) keeps each step's activations
    in a MemPool (``use_mem_pool``) and frees the older half a step later; the weight update is
    the saxpy kernel; from step 1 on a graph captured into a shared ``graph_pool_handle()`` pool
    computes a side statistic (a second graph joins the pool at step 5).  Between steps the
    allocator's settings change: expandable segments on at step 2, roundup_power2_divisions and
    a GC threshold at step 4 (expandable stays on: torch keeps what a call does not name),
    expandable off at step 6.  Memory history records all along (torch's signature).

    After every step: the weights equal numpy's; ``memory_stats`` adds up and matches the
    snapshot; the MemPool's snapshot equals ``memory_snapshot(pool.id)`` and its live blocks are
    exactly the live activations (requested sizes); the trace replayed from the empty start gives
    the snapshot's reserved bytes and live blocks.  At the end, with everything dropped, the
    device holds nothing, and a second run leaves the same footprint."""
    use_sim(monkeypatch, kind)
    if not _native():
        pytest.skip("backend:cudaMallocAsync has no MemPool (its driver pool has no private pools)")
    accel.set_device_index(0)
    dev = _last()
    graphs = kind != "mps"
    n = 4096
    state = process_state()
    lr = np.float32(-0.25)

    def program(run):
        mem = accel.memory
        kernel = saxpy(dev)
        mem.set_allocator_settings("expandable_segments:False")
        settle()
        assert mem.memory_reserved(dev) == 0
        base = _dev_stats(dev)
        mem._record_memory_history("all", max_entries=1_000_000, clear_history=True)
        try:
            w_host = np.linspace(-1, 1, n, dtype=np.float32)
            w = accel.Buffer(4 * n, device=dev).copy_from(w_host)
            with accel.device_index(dev):
                pool = accel.MemPool()
            gpool = accel.graphs.graph_pool_handle() if graphs else None
            side = accel.Stream(dev)
            live_acts = {}                                # id -> (buffer, nbytes)
            older = []
            g_list, stats_in, stats_out = [], None, None
            for step in range(8):
                if step == 2:
                    mem.set_allocator_settings("expandable_segments:True")
                elif step == 4:
                    mem.set_allocator_settings("roundup_power2_divisions:4,garbage_collection_threshold:0.8")
                elif step == 6:
                    mem.set_allocator_settings("expandable_segments:False")
                # forward: activations into the pool (the first one is this step's gradient input)
                acts = []
                with accel.use_mem_pool(pool, device=dev):
                    for k, size in enumerate(_act_sizes(step)):
                        b = accel.Buffer(size, device=dev)
                        b.copy_from(np.full(size, (step * 7 + k) & 0xFF, np.uint8))
                        acts.append(b)
                        live_acts[id(b)] = (b, size)
                g_host = np.random.default_rng([step, 1]).standard_normal(n).astype(np.float32)
                grad = accel.Buffer(4 * n, device=dev).copy_from(g_host)
                accel.launch(kernel, (n + 255) // 256, 256, lr, grad, w, n, stream=accel.current_stream(dev))
                w_host = saxpy_np(lr, g_host, w_host)
                del grad
                # the older half of last step's activations go
                for b in older:
                    del live_acts[id(b)]
                    b.close()
                older = acts[: len(acts) // 2]
                del acts, b
                if graphs and step in (1, 5):
                    # a side statistic, captured: stats_out = 2 * stats_in + stats_out
                    if stats_in is None:
                        stats_in = accel.Buffer(4 * n, device=dev).copy_from(g_host)
                        stats_out = accel.Buffer(4 * n, device=dev).fill_(0)
                    side.wait_stream(accel.current_stream(dev))
                    g = accel.Graph(pool=gpool)
                    with accel.device_index(dev), side:
                        g.capture_begin()
                        tmp = accel.Buffer(4 * n, device=dev)     # from the graph pool
                        tmp.copy_from(stats_in)
                        accel.launch(kernel, (n + 255) // 256, 256, np.float32(2.0), tmp, stats_out, n)
                        del tmp
                        g.capture_end()
                    accel.current_stream(dev).wait_stream(side)
                    g_list.append(g)
                    del g
                with accel.device_index(dev):
                    for g in g_list:
                        g.replay()
                accel.synchronize(dev)
                assert np.array_equal(w.to_numpy(np.float32), w_host), (run, step)
                where = f"run {run} step {step}"
                check_stat_invariants(dev, where)
                assert pool.snapshot() == mem.memory_snapshot(pool.id), where
                pool_live = sorted(b["requested_size"] for s in pool.snapshot() for b in s["blocks"]
                                   if b["state"] == "active_allocated")
                assert pool_live == sorted(sz for _, sz in live_acts.values()), (where, "pool")
                check_trace_matches_snapshot(dev, where)
                check_snapshot_layout(dev, where)
            if graphs:
                replays = sum(8 - s for s in (1, 5))
                s_host = np.random.default_rng([1, 1]).standard_normal(n).astype(np.float32)
                want = np.zeros(n, np.float32)
                for _ in range(replays):
                    want = saxpy_np(2.0, s_host, want)
                assert np.array_equal(stats_out.to_numpy(np.float32), want), run
            # the end: drop everything, the device holds nothing and the trace says so
            del older, live_acts, w, pool, side, g_list, stats_in, stats_out, kernel
            g = None
            settle()
            assert mem.memory_reserved(dev) == 0, [(s["segment_pool_id"], s["stream"], s["is_expandable"], [(b["state"], b["size"], b["requested_size"], [(f["name"], f["line"]) for f in b.get("frames", [])][:4]) for b in s["blocks"]]) for s in mem.memory_snapshot()]
            assert _dev_stats(dev) == base
            check_trace_matches_snapshot(dev, f"run {run} end")
            assert replay_trace(dev) == ({}, {})
        finally:
            mem._record_memory_history(None)
            mem.set_allocator_settings("expandable_segments:False")
        assert process_state() == state

    _run_warm(program)


# -- 2. producer on device 0, consumer on device 1 (never current), cancelled half way ----------
@pytest.mark.parametrize("kind", SIMS)
def test_cross_device_pipeline_cancelled_with_work_queued(monkeypatch, kind, saxpy):
    """A producer thread makes each batch on device 0 (upload, then ``out = 3 * x`` with the saxpy
    kernel on its stream), records an event and hands the batch on.  A consumer thread works on
    the last device without ever making it current: its stream waits for the event, pulls the
    batch with a cross-device ``copy_from`` into a buffer of its own, frees the producer's buffer
    (its use on the consumer's stream is what keeps the memory from reuse), and downloads on a
    second stream ordered by ``wait_stream``.

    After ``keep`` batches the consumer cancels: it closes both its streams while its last
    copies are still queued (a per-operation delay keeps them queued), closes the buffers of the
    batches it will not process, and the producer, told to stop, closes its stream with its
    kernels queued.  Every batch the consumer took equals numpy's (3 * x) byte for byte, even
    those whose copies ran after their streams were closed; nothing hangs; memory, streams and
    events return to what they were (a second run leaves the same footprint)."""
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    prod, cons = 0, _last()
    n, batches, keep = 2048, 10, 6
    state = process_state()

    def batch(b):
        return np.random.default_rng([67, b]).integers(-100, 100, n).astype(np.float32)

    def program(run):
        kernel = saxpy(prod)
        settle()
        base = {d: _dev_stats(d) for d in _devices()}
        handoff = __import__("queue").Queue()
        stop = threading.Event()
        errors, results = [], []

        def producer():
            ps = accel.Stream(prod)
            try:
                for b in range(batches):
                    if stop.is_set():
                        break
                    x = accel.Buffer(4 * n, device=prod, stream=ps).copy_from(batch(b), stream=ps)
                    out = accel.Buffer(4 * n, device=prod, stream=ps).fill_(0, stream=ps)
                    accel.launch(kernel, (n + 255) // 256, 256, np.float32(3.0), x, out, n, stream=ps)
                    x.close()                                    # freed with its kernel queued
                    ev = accel.Event(prod)
                    ev.record(ps)
                    handoff.put((b, out, ev))
                    del out, ev
                assert accel.current_device_index() == 0
            except BaseException as exc:
                errors.append(exc)
            finally:
                handoff.put(None)
                ps.close()                                       # kernels may still be queued

        def consumer():
            cs, ds = accel.Stream(cons), accel.Stream(cons)
            try:
                taken = 0
                while True:
                    item = handoff.get(timeout=JOIN_S)
                    if item is None:
                        break
                    b, out, ev = item
                    del item
                    if taken == keep:                            # cancelled: drop what is left
                        stop.set()
                        out.close()
                        del out, ev
                        continue
                    cs.wait_event(ev)
                    z = accel.Buffer(4 * n, device=cons, stream=cs)
                    z.copy_from(out, stream=cs, non_blocking=True)      # device 0 -> device 1
                    out.close()                                  # its use on cs holds the memory
                    del out
                    ds.wait_stream(cs)
                    host = accel.empty_pinned(n, np.float32)
                    z.copy_to(host, stream=ds, non_blocking=True)
                    results.append((b, host, ds.record_event()))
                    z.close()                                    # freed with its download queued
                    del z, host, ev
                    taken += 1
                    if taken == keep:
                        cs.close()                               # copies still queued on both
                        ds.close()
                assert accel.current_device_index() == 0
            except BaseException as exc:
                errors.append(exc)
                stop.set()
                while handoff.get(timeout=JOIN_S) is not None:
                    pass

        threads = [threading.Thread(target=producer, name="producer"),
                   threading.Thread(target=consumer, name="consumer")]
        with _slow(300 if run == 0 else 30):
            for t in threads:
                t.start()
            join_all(threads)
        assert not errors, _trace(errors[0])
        assert [b for b, _, _ in results] == list(range(keep))
        for b, host, done in results:
            done.synchronize()
            assert np.array_equal(host, saxpy_np(3.0, batch(b), np.zeros(n, np.float32))), (run, b)
        del results, host, done, kernel
        assert process_state() == state
        settle()
        assert {d: _dev_stats(d) for d in _devices()} == base

    _run_warm(program)


# -- 4. OutOfMemoryError under a memory fraction, caught, freed, retried: as a fresh run ----------
def _fresh_reference(dev: int) -> tuple:
    """What a fresh run leaves on ``dev`` once its counters are reset: memory_stats, the device's
    free memory, the host allocator's current counters."""
    mem = accel.memory
    settle()
    mem.reset_accumulated_memory_stats(dev)
    mem.reset_peak_memory_stats(dev)
    host = {k: v for k, v in mem.host_memory_stats().items() if k.endswith(".current")}
    return dict(mem.memory_stats(dev)), mem.get_memory_info(dev)[0], host


@pytest.mark.parametrize("kind", SIMS)
def test_oom_under_fraction_recovered_ends_as_a_fresh_run(monkeypatch, kind):
    """A batch-size finder as people write it: with a memory fraction of 1 % on the last device,
    memory history on and torch's OOM recipe attached (an observer that pickles ``_snapshot()``
    and reads ``memory_summary``), batches grow until OutOfMemoryError, inside a MemPool for
    half of the activations; the program catches it, frees, calls ``empty_cache()`` and retries
    at half the size, which must work and compute the right bytes.  The same happens to a
    ``copy.deepcopy`` of a large buffer, to a graph capture (CUDA, XPU: the capture must be
    over, the graph empty and reusable) and to pinned host memory larger than the host.

    The observer sees each device OOM once with the cap the error names; the trace has one
    ``oom`` entry per device OOM, and replayed it still gives the snapshot.  At the end, with
    the fraction back at 1.0 and the counters reset, ``memory_stats``, the device's free memory
    and the host allocator's counters are those of a fresh run, and a second run leaves the
    same footprint."""
    import copy
    import io
    import pickle
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    dev = _last()
    graphs = kind != "mps"
    mem = accel.memory
    accel.Buffer(1, device=dev).close()
    fresh = _fresh_reference(dev)
    state = process_state()
    MB = MiB

    def program(run):
        seen = []

        def on_oom(device, tried, allowed, free):
            blob = io.BytesIO()
            pickle.dump(mem._snapshot(), blob, protocol=4)         # torch's memory_viz recipe
            seen.append((device, tried, allowed, free, len(blob.getvalue()) > 0,
                         "memory summary" in mem.memory_summary(device)))

        mem._record_memory_history("all", max_entries=1_000_000, clear_history=True)
        mem.attach_out_of_memory_observer(on_oom)
        total = mem.get_memory_info(dev)[1]
        try:
            mem.set_per_process_memory_fraction(0.01, dev)
            cap = int(total * 0.01)
            native = _native()          # backend:cudaMallocAsync: no MemPool, no segments in snapshots
            if native:
                with accel.device_index(dev):
                    pool = accel.MemPool()
            else:
                pool = None
            ooms = 0
            def step(bs):
                """One step's activations, the middle one in the pool."""
                acts = []
                for k in range(3):
                    if k % 2 and pool is not None:
                        with accel.use_mem_pool(pool, device=dev):
                            acts.append(accel.Buffer(bs * MB + 512 * k, device=dev))
                    else:
                        acts.append(accel.Buffer(bs * MB + 512 * k, device=dev))
                    acts[-1].fill_((bs + k) & 0xFF)
                return acts

            # 1. the batch-size finder
            bs, good = 1, None
            while True:
                try:
                    step(bs)
                    good = bs
                    bs *= 2
                except accel.OutOfMemoryError as exc:
                    ooms += 1
                    assert f"{cap / MB:.2f} MiB" in str(exc), str(exc)     # the cap, in either backend's words
                    break
            assert good is not None and bs > good
            mem.empty_cache()
            retry = step(good)
            for k, b in enumerate(retry):
                assert np.array_equal(b.to_numpy(), np.full(good * MB + 512 * k, (good + k) & 0xFF, np.uint8)), (run, k)
            check_stat_invariants(dev, f"run {run} after the retry")
            if native:
                check_trace_matches_snapshot(dev, f"run {run} after the retry")
            # 2. a deepcopy that does not fit (the half-made copy is given back)
            big = retry[0]
            del retry, b
            before = mem.memory_allocated(dev)
            with pytest.raises(accel.OutOfMemoryError):
                [copy.deepcopy(big) for _ in range(8)]
            ooms += 1
            assert mem.memory_allocated(dev) == before, "the copies made before the OOM were kept"
            del big
            # 3. a capture that does not fit: over, and the graph reusable
            if graphs:
                side = accel.Stream(dev)
                g = accel.Graph()
                with pytest.raises(accel.OutOfMemoryError):
                    with accel.device_index(dev), side, g:
                        tmp = accel.Buffer(2 * cap, device=dev)
                ooms += 1
                assert not accel.is_current_stream_capturing()
                assert "empty" in repr(g), g
                with accel.device_index(dev), side, g:
                    tmp = accel.Buffer(MB, device=dev)
                    tmp.fill_(0x5A)
                with accel.device_index(dev):
                    g.replay()
                assert np.array_equal(tmp.to_numpy(), np.full(MB, 0x5A, np.uint8))
                del tmp, g, side
            # 4. pinned host memory larger than the host
            from accel.sim import _memory as simmem
            if kind != "mps" and simmem._PHYSICAL is not None:
                h = {k: v for k, v in mem.host_memory_stats().items() if k.endswith("allocations.current")}
                with pytest.raises(accel.OutOfMemoryError):
                    accel.empty_pinned(2 * simmem._PHYSICAL, np.uint8)
                assert {k: v for k, v in mem.host_memory_stats().items() if k.endswith("allocations.current")} == h
                ok = accel.empty_pinned(4096, np.uint8)
                accel.Buffer(4096, device=dev).fill_(3).copy_to(ok)
                assert (ok == 3).all()
                del ok
            # what the program saw
            assert len(seen) == ooms, (seen, ooms)
            for device, tried, allowed, free, pickled, summary in seen:
                assert (device, allowed) == (dev, cap) and pickled and summary, seen
            trace = mem._snapshot()["device_traces"][dev]
            if native:                  # backend:cudaMallocAsync records alloc and free only
                assert sum(1 for e in trace if e["action"] == "oom") == ooms
            del pool
            settle()
            if native:
                check_trace_matches_snapshot(dev, f"run {run} end")
                assert replay_trace(dev) == ({}, {})
        finally:
            mem.detach_out_of_memory_observer(on_oom)
            mem._record_memory_history(None)
            mem.set_per_process_memory_fraction(1.0, dev)
        assert process_state() == state
        assert _fresh_reference(dev) == fresh

    _run_warm(program)


# -- 3. numpy + DLPack, and the mistakes users make there ----------------------------------------
def _refused(fn, exc, match=None):
    """``fn()`` raises ``exc`` (matching ``match``); returns the exception."""
    with pytest.raises(exc, match=match) as info:
        fn()
    return info.value


@pytest.mark.parametrize("kind", SIMS)
def test_numpy_dlpack_pipeline_and_user_mistakes(monkeypatch, kind, saxpy):
    """Features arrive as numpy arrays, go through pinned memory onto the last device (device 0
    current), are viewed as float32 matrices and handed by DLPack to a "consumer library" (accel's
    own ``from_dlpack``) working on another stream, given as an accel.Stream (and on CUDA as a raw
    ``cudaStream_t`` int, and as -1 with the producer synchronized by hand).  The consumer scales
    the rows with the saxpy kernel in place; a second consumer on device 0 copies device 1's
    import across.  numpy is the oracle for every byte.

    Between the steps, the mistakes: ``__dlpack__(stream="1")``, ``stream=1.5``, ``stream=0``,
    a consumed capsule taken again, ``numpy.from_dlpack`` of device memory, ``from_dlpack`` of a
    numpy array, a host ``dl_device`` with ``copy=False``, reads of closed buffers.  Each raises
    its clear error and changes nothing: no export left behind, the buffer's last-use stream
    and bytes as they were, and the first import still valid.  Closing the producer before the
    import keeps the memory until the import is closed too."""
    from accel import _dlpack
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    dev = _last()
    cuda = kind == "cuda"
    rows, cols = 6, 256
    state = process_state()

    def features(i):
        return np.random.default_rng([67, 3, i]).standard_normal((rows, cols)).astype(np.float32)

    def program(run):
        kernel = saxpy(dev)
        settle()
        exports0, alloc0 = _dlpack.live_exports(), _dev_stats(dev)
        up, work = accel.Stream(dev), accel.Stream(dev)
        for i, how in enumerate(("stream", "handle", "none")):
            if how == "handle" and not cuda:
                how = "stream"
            x = features(i)
            pinned = accel.empty_pinned(x.shape, np.float32)
            pinned[...] = x
            buf = accel.Buffer(x.nbytes, device=dev, stream=up)
            buf.copy_from(pinned, stream=up, non_blocking=True)
            view = buf.as_array(np.float32, (rows, cols))
            # the consumer takes it on its stream
            if how == "stream":
                imp = accel.from_dlpack(view, stream=work)
            elif how == "handle":
                imp = accel.from_dlpack(view, stream=work.handle)
            else:
                up.synchronize()                        # -1: the consumer synchronized by hand
                imp = accel.from_dlpack(view.__dlpack__(stream=-1, max_version=(1, 0)))
            assert imp.nbytes == x.nbytes and imp.ptr == buf.ptr and not imp.owns_memory
            ones = accel.Buffer(x.nbytes, device=dev, stream=work).copy_from(np.ones_like(x), stream=work)
            # imp += (i + 1) * ones, in place, on the consumer's stream
            accel.launch(kernel, (x.size + 255) // 256, 256, np.float32(i + 1), ones, imp, x.size, stream=work)
            want = saxpy_np(np.float32(i + 1), np.ones_like(x).ravel(), x.ravel()).reshape(x.shape)
            assert np.array_equal(imp.to_numpy(np.float32, x.shape, stream=work), want), (run, how)
            # a second consumer on device 0 copies device 1's import across
            home = accel.Buffer(x.nbytes, device=0).copy_from(imp)
            assert np.array_equal(home.to_numpy(np.float32, x.shape), want), (run, how)

            # -- the mistakes: each refused, nothing changed ---------------------------------
            last, n_exports = buf.last_stream, _dlpack.live_exports()
            _refused(lambda: buf.__dlpack__(stream="1"), TypeError, "stream must be None, -1, an accel.Stream")
            _refused(lambda: accel.from_dlpack(buf, stream=1.5), TypeError, "stream must be None")
            _refused(lambda: buf.__dlpack__(stream=0), ValueError, "stream=0")
            _refused(lambda: accel.from_dlpack(x), BufferError, "host memory")
            _refused(lambda: buf.__dlpack__(dl_device=(1, 0), copy=False), ValueError, "copy=False")
            capsule = buf.__dlpack__(stream=-1)
            again = accel.from_dlpack(capsule)
            _refused(lambda: accel.from_dlpack(capsule), BufferError, "consumed")
            again.close()
            del capsule, again
            gc.collect()
            assert buf.last_stream is last and _dlpack.live_exports() == n_exports
            assert np.array_equal(buf.to_numpy(np.float32, x.shape), want)
            # numpy cannot read device memory: it refuses (accel's documented SystemError route)
            with pytest.raises((SystemError, RuntimeError, BufferError)):
                with warnings_off():
                    np.from_dlpack(buf)
            gc.collect()
            assert _dlpack.live_exports() == n_exports

            # -- close the producer first: the import keeps the memory -----------------------
            held = mem_allocated(dev)
            buf.close()
            _refused(lambda: buf.to_numpy(), RuntimeError, "closed")
            _refused(lambda: view.__dlpack__(), RuntimeError, "closed")
            assert mem_allocated(dev) == held                      # the import still holds it
            assert np.array_equal(imp.to_numpy(np.float32, x.shape), want)
            imp.close()
            _refused(lambda: imp.to_numpy(), RuntimeError, "closed")
            settle()
            del buf, view, imp, ones, home, pinned
        del up, work, kernel
        settle()
        assert _dlpack.live_exports() == exports0
        assert _dev_stats(dev) == alloc0
        assert process_state() == state

    _run_warm(program)


def mem_allocated(dev: int) -> int:
    return accel.memory.memory_allocated(dev)


class warnings_off:
    """numpy's refusal reaches accel's capsule destructor with its error set; accel reports it
    through sys.unraisablehook (accel/_dlpack/exporting.py, module comment): keep it out of the output."""

    def __enter__(self):
        import sys
        self._hook = sys.unraisablehook
        sys.unraisablehook = lambda unraisable: None

    def __exit__(self, *exc):
        import sys
        gc.collect()
        sys.unraisablehook = self._hook


# -- numpy's implicit conversion of device memory ------------------------------------------------
@pytest.mark.parametrize("kind", SIMS)
def test_numpy_asarray_of_device_memory_is_refused(monkeypatch, kind):
    """A user checks a result with numpy the way they would a host array: ``np.asarray(buf)``,
    ``np.testing.assert_array_equal(view, want)``.  Device memory cannot become a numpy array
    without a copy, so numpy's implicit conversion must be refused with a TypeError naming the
    explicit way (torch: "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu()";
    CuPy: "Implicit conversion to a NumPy array is not allowed. Please use `.get()`").  Today
    numpy wraps the object in a 0-d object array: ``np.asarray(buf) == 1`` is silently False and
    comparisons fail far from the mistake."""
    use_sim(monkeypatch, kind)
    buf = accel.Buffer(16).fill_(1)
    view = buf.as_array(np.uint8, (16,))
    for obj in (buf, view):
        with pytest.raises(TypeError, match="to_numpy"):
            np.asarray(obj)


@pytest.mark.parametrize("kind", SIMS)
def test_pipeline_cancelled_by_closing_its_streams_from_another_thread(monkeypatch, kind):
    """A controller cancels a running cross-device pipeline the blunt way: it closes two of the
    three streams (the producer's on device 0, the consumer's copy and download streams on the
    last device) from the main thread while the worker thread is using them.  The worker's next
    call on a closed stream must raise RuntimeError saying it was closed (nothing else, no hang);
    every batch it finished still arrives intact (work queued before a close still runs); and
    once the worker is gone the devices hold what they held before, with the simulator's live
    objects as they were.  Six rounds close each pair of streams twice, at a different point."""
    import time
    from test_user_programs import live_objects
    use_sim(monkeypatch, kind)
    accel.set_device_index(0)
    devs = _devices()
    cons = devs[-1]
    n = 1 << 14
    settle()
    base = {d: _dev_stats(d) for d in devs}
    objects = live_objects()
    for trial in range(6):
        ps, cs, ds = accel.Stream(0), accel.Stream(cons), accel.Stream(cons)
        errors, done = [], []
        started = threading.Event()

        def worker():
            try:
                for b in range(400):
                    x = accel.Buffer(n, device=0, stream=ps).fill_(b & 0xFF, stream=ps)
                    cs.wait_event(ps.record_event())
                    z = accel.Buffer(n, device=cons, stream=cs)
                    z.copy_from(x, stream=cs, non_blocking=True)       # device 0 -> last device
                    x.close()
                    ds.wait_stream(cs)
                    host = accel.empty_pinned(n, np.uint8)
                    z.copy_to(host, stream=ds, non_blocking=True)
                    done.append((b, host, ds.record_event()))
                    z.close()
                    started.set()
            except RuntimeError as exc:
                if "closed" not in str(exc):
                    errors.append(exc)
            except BaseException as exc:
                errors.append(exc)
            finally:
                started.set()

        t = threading.Thread(target=worker, name=f"worker{trial}")
        with _slow(100):
            t.start()
            started.wait(JOIN_S)
            time.sleep(0.001 * (trial % 3))
            streams = [ps, cs, ds]
            streams[trial % 3].close()
            streams[(trial + 1) % 3].close()
            join_all([t])
        assert not errors, _trace(errors[0])
        assert done, "the worker finished no batch before the cancel"
        for b, host, ev in done:
            ev.synchronize()
            assert (host == (b & 0xFF)).all(), (trial, b)
        del done, t, host, ev
        for s in (ps, cs, ds):
            s.close()
        del ps, cs, ds, s
        settle()
        assert {d: _dev_stats(d) for d in devs} == base, trial
        assert live_objects() == objects, trial
