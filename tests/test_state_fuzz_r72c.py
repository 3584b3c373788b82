"""r72c: a seeded, model-based state fuzzer of accel's memory accounting on allocator and
simulator configurations the earlier fuzzers do not run.

tests/test_state_fuzz_r70c.py (hypothesis; bad calls and misuse in a capture) runs every
simulator under the default ``ACCEL_ALLOC_CONF`` and changes settings mid-run, but checks no
memory figure except "unchanged by a refused call"; tests/test_state_fuzz_r71m.py (a random walk
whose data is modelled) runs CUDA only, always with ``ACCEL_SIM_PEER=none`` and
``ACCEL_SIM_PCI_ORDER=1,0``, under three configs (default, ``expandable_segments:False``,
``backend:cudaMallocAsync``) and never touches MemPool, memory_snapshot, the peaks or
``set_allocator_settings``.  Here each case starts the simulator under one of ``CONFIGS``:
``max_split_size_mb`` / ``garbage_collection_threshold`` / ``roundup_power2_divisions`` (an int and
a per-interval list) / ``policy:torch`` / ``release_threshold`` / ``throw_on_cudamalloc_oom`` /
``max_non_split_rounding_mb`` / ``per_process_memory_fraction`` read from ``ACCEL_ALLOC_CONF`` or
``PYTORCH_CUDA_ALLOC_CONF``, ``backend:cudaMallocAsync`` with peer access and in PCI bus order,
Level Zero without peer access, on two devices, and Metal's one device, and walks a
``random.Random(seed)`` sequence of ``STEPS`` ops:

Buffers of many sizes (0 B to 25 MiB) allocated and freed (closed, or dropped and finalized) on
either device and on side streams; fills; copies between the devices (on a side stream of either
one, or blocking); record_stream on a stream of either device, then close; events recorded on
one device and waited on the other; a MemPool per device and ``use_mem_pool`` blocks left open
across ops, pools dropped while their Buffers live; graph capture on a side stream (fills,
allocations kept as outputs and ones freed in the capture) with replay from either device and
reset; empty_cache (of one device or all); reset_peak_memory_stats; a memory-fraction cap near
the current reservation and an allocation past it (OutOfMemoryError, nothing changed but
``num_ooms``), the cap kept for a while; ``set_allocator_settings`` changed mid-run; the current
device switched.

After each op, on each device, against a model of the live Buffers:
``requested_bytes.all.current`` is the sum of the live Buffers' sizes; ``memory_allocated`` is
at least their sizes rounded as the allocator rounds (512 B, or the power-of-two divisions in
force when each was made) and at most ``memory_reserved``; ``memory_stats`` agrees with
``memory_snapshot`` (reserved = the segments' total_size, allocated = their allocated_size,
active = active_size, allocation count = active_allocated blocks; none under
``backend:cudaMallocAsync``); every peak is at least its current value and
``max_memory_*`` are the peaks (equal to the currents right after reset_peak_memory_stats); the
reservation never passes a cap set below it, once it went under it; ``get_memory_info`` shows
the device's memory in use as its base plus ``memory_reserved`` (plus graph memory under
cudaMallocAsync); no device fault.  One random Buffer of known contents reads back as modelled.
At the end, everything closed and dropped, devices synchronized and the caches emptied:
``memory_allocated`` and ``memory_reserved`` are 0 on both devices, ``get_memory_info`` is back to
the base and the simulator's live handles are as at the start.

Also after each free that left its default-pool segment wholly free: with ``release_threshold``
the wholly free segments cached are at most the threshold.  A cap set with
``set_per_process_memory_fraction`` at the current reservation (plus 0 to 30 MiB) refuses a
request 20 MiB past it, and the same request succeeds once the cap is lifted.

STEPS / SEEDS: ACCEL_R72C_STEPS, ACCEL_R72C_SEEDS (defaults 85 (250 under ACCEL_TEST_THOROUGH) and 3);
ACCEL_R72C_KNOWN=1 also makes the calls of the bugs below (the fuzz then fails on them).

Bugs found (strict xfails at the end):

* (fixed by r72b, commit a6b6d95, while this was written; kept as a plain test)
  ``backend:cudaMallocAsync`` on peer-capable devices: a graph output (allocated in a capture)
  copied to the other device with ``Buffer.copy_from`` faulted the device (sticky
  cudaErrorIllegalAddress) unless an earlier cross-device copy made the pool's peer access
  before the capture.
* ``release_threshold`` never releases expandable segments, the default on CUDA and Level Zero
  (``_caching._whole_free_segments`` looks at classic segments only).
* ``release_threshold`` is not applied when a freed block of a released MemPool moves its whole
  segment to the general cache (``_caching._whole_segment_free``: the ``elif``).
* ``backend:cudaMallocAsync``: a graph reset before any replay gives its live outputs' addresses
  back; a later Buffer at such an address, freed first, forgets the stale record instead of its
  own (``_async.AsyncPoolAllocator.free``, "The stale one first"): requested_bytes and the
  allocation count stay wrong, and its memory held, until the stale Buffer is freed.
"""

import collections
import gc
import os
import random

import numpy as np
import pytest

import accel
import accel.memory as M
from accel import _finalize, sim
from conftest import THOROUGH, use_sim

pytestmark = pytest.mark.usefixtures("frozen_heap")

KiB, MiB = 1 << 10, 1 << 20
# default: 85 ops per case (33 cases; test_the_runs_reached_every_op still sees every op); THOROUGH: 250
STEPS = int(os.environ.get("ACCEL_R72C_STEPS", "0") or 0) or (250 if THOROUGH else 85)
SEEDS = range(int(os.environ.get("ACCEL_R72C_SEEDS", "0") or 0) or 3)

#: name -> (simulator, environment)
CONFIGS = {
    "cuda-classic-split-pow2-nopeer": ("cuda", dict(
        ACCEL_ALLOC_CONF="expandable_segments:False,max_split_size_mb:20,roundup_power2_divisions:4",
        ACCEL_SIM_PEER="none")),
    "cuda-gc-pow2list-pciorder": ("cuda", dict(
        ACCEL_ALLOC_CONF="garbage_collection_threshold:0.6,roundup_power2_divisions:[256:1,512:2,>:4]",
        ACCEL_SIM_PCI_ORDER="1,0")),
    "cuda-torchpolicy-nopeer-pcibus": ("cuda", dict(
        ACCEL_ALLOC_CONF="policy:torch,max_split_size_mb:40,garbage_collection_threshold:0.8",
        ACCEL_SIM_PEER="none", ACCEL_SIM_PCI_ORDER="1,0", CUDA_DEVICE_ORDER="PCI_BUS_ID")),
    "cuda-release-throw-nonsplit": ("cuda", dict(
        ACCEL_ALLOC_CONF="release_threshold:4M,throw_on_cudamalloc_oom:True,max_non_split_rounding_mb:40,"
                         "max_split_size_mb:30")),
    "cuda-pytorch-var-fraction": ("cuda", dict(
        PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True,max_split_size_mb:64,per_process_memory_fraction:0.5")),
    "cuda-async-peer": ("cuda", dict(ACCEL_ALLOC_CONF="backend:cudaMallocAsync")),
    "cuda-async-fraction-pcibus": ("cuda", dict(
        ACCEL_ALLOC_CONF="backend:cudaMallocAsync,per_process_memory_fraction:0.9",
        ACCEL_SIM_PCI_ORDER="1,0", CUDA_DEVICE_ORDER="PCI_BUS_ID")),
    "xpu-classic-split-nopeer": ("xpu", dict(
        ACCEL_ALLOC_CONF="expandable_segments:False,max_split_size_mb:20", ACCEL_SIM_PEER="none")),
    "xpu-gc-pow2-nopeer": ("xpu", dict(
        ACCEL_ALLOC_CONF="garbage_collection_threshold:0.5,roundup_power2_divisions:8", ACCEL_SIM_PEER="none")),
    "xpu-torchpolicy-release": ("xpu", dict(ACCEL_ALLOC_CONF="policy:torch,release_threshold:2M")),
    "mps-split-pow2": ("mps", dict(ACCEL_ALLOC_CONF="max_split_size_mb:20,roundup_power2_divisions:2")),
}

#: set_allocator_settings strings for the native allocator (each resets the three RESET keys
#: unless named); under policy:torch / backend:cudaMallocAsync only strings that keep them
NATIVE_SETTINGS = ["", "expandable_segments:False", "expandable_segments:True", "max_split_size_mb:20",
                   "roundup_power2_divisions:4", "roundup_power2_divisions:[256:1,512:2,>:8]",
                   "garbage_collection_threshold:0.7", "expandable_segments:False,max_split_size_mb:24",
                   "max_split_size_mb:22,garbage_collection_threshold:0.5,roundup_power2_divisions:2"]
ASYNC_SETTINGS = ["", "backend:cudaMallocAsync", "per_process_memory_fraction:1.0"]
#: a graph's generator state (seed and offset words): requested bytes and allocations
GRAPH_RNG_BYTES, GRAPH_RNG_ALLOCS = 16, 2
#: ACCEL_R72C_KNOWN=1: also make the calls of the bugs reproduced at the end (strict xfails)
_KNOWN = os.environ.get("ACCEL_R72C_KNOWN", "") not in ("", "0")
SIZES = [0, 1, 512, 1000, 4 * KiB, 100 * KiB, 1 * MiB, 1 * MiB + 1, 3 * MiB, 3 * MiB + 77, 12 * MiB, 25 * MiB]


def settle(n):
    gc.collect()
    _finalize.drain()
    for d in range(n):
        accel.synchronize(d)
    M.empty_cache()
    M.empty_host_cache()
    _finalize.drain()


def sim_fields():
    st = dict(vars(sim.state()))
    st.pop("calls")
    st.pop("config")
    return st


def live_handles(kind) -> dict:
    st = sim_fields()
    if kind == "cuda":
        return {k: st[k] for k in ("host_allocations", "streams", "events", "graphs", "graph_execs", "captures")} \
            | {"allocations": sum(st["live_allocations"].values())}
    if kind == "xpu":
        return {k: v for k, v in st.items() if k.startswith("ze_live_") and "event" not in k}
    return dict(st["metal_live_objects"])


def used(d):
    free, total = M.get_memory_info(d)
    return total - free


def pow2_round(nbytes, divisions):
    """accel's _round_pow2 (torch's round_size for a request above the small pool's rounding)."""
    if divisions > 1 and nbytes > 512 * divisions:
        if nbytes & (nbytes - 1) == 0:
            return nbytes
        floor = 1 << (nbytes.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        low = nbytes & ~(step - 1)
        return nbytes if low == nbytes else low + step
    return (nbytes + 511) & ~511


class Buf:
    def __init__(self, obj, dev, nbytes, rounded, where):
        self.obj, self.dev, self.nbytes, self.rounded, self.where = obj, dev, nbytes, rounded, where
        self.value = 0 if nbytes == 0 else None     # every byte's value, None when not known
        #: backend:cudaMallocAsync: a graph's output has memory only once a replay allocated it
        #: (a graph allocation node; touching it before is the user's error, as in torch)
        self.unbacked = False
        self.closed = False


class Violation(AssertionError):
    pass


class Fuzz:
    def __init__(self, kind, conf_name, rng):
        self.kind, self.conf, self.rng = kind, conf_name, rng
        self.n = accel.device_count()
        self.log = []
        self.count = collections.Counter()
        for d in range(self.n):     # first-use paths before the baselines
            with accel.Buffer(4 * KiB, d) as warm:
                warm.fill_(1)
                warm.to_numpy()
            M.memory_stats(d)
            if kind != "mps":
                s = accel.Stream(d)
                g = accel.Graph()
                with accel.Buffer(512, d) as b, accel.graph(g, stream=s):
                    b.fill_(0)
                g.reset()
                s.close()
        accel.set_device_index(0)
        settle(self.n)
        self.is_async = M.device_allocator(0).config.backend == "cudaMallocAsync"
        self.torch_policy = M.device_allocator(0).config.policy == "torch"
        self.base_used = [used(d) for d in range(self.n)]
        self.base_handles = live_handles(kind)
        for d in range(self.n):
            assert M.memory_reserved(d) == 0 and M.memory_allocated(d) == 0, (d, M.memory_reserved(d))
        self.bufs = []
        self.streams = {d: [] for d in range(self.n)}
        self.events = []
        self.graphs = []        # [graph, dev, ops [(Buf, value)], alive bufs made in the capture]
        self.pools = {}         # dev -> MemPool
        self.pool_ctx = {}      # dev -> open use_mem_pool context manager
        self.caps = {}          # dev -> (cap bytes, bound: the most reserved may be)
        self.cur = 0
        frac = M.get_per_process_memory_fraction(0)
        if frac < 1.0:
            for d in range(self.n):
                total = M.get_memory_info(d)[1]
                self.caps[d] = [int(frac * total), int(frac * total)]
        self.pending = {d: [] for d in range(self.n)}
        self.capturing = None
        self.graph_mem = set()      # devices that may hold graph memory (cudaMallocAsync)

    # -- helpers -----------------------------------------------------------------------------
    def note(self, text):
        self.log.append(text)

    def live(self, dev=None, pred=lambda b: True):
        return [b for b in self.bufs if not b.closed and (dev is None or b.dev == dev) and pred(b)]

    def stream(self, d, default_ok=True):
        choices = [s for s in self.streams[d] if not s.closed]
        if default_ok or not choices:
            choices.append(accel.default_stream(d))
        return self.rng.choice(choices)

    def divisions(self, d, nbytes):
        alloc = M.device_allocator(d)
        return alloc.config.divisions_for(nbytes)

    def where(self, d):
        return "pool" if d in self.pool_ctx else "default"

    def allocate(self, nbytes, d, stream=None):
        """A Buffer, or None when a cap refused it (checked: nothing changed but num_ooms)."""
        before = dict(M.memory_stats(d))
        rounded = 0 if nbytes == 0 or self.is_async else pow2_round(nbytes, self.divisions(d, nbytes))
        try:
            obj = accel.Buffer(nbytes, d, stream=stream)
        except accel.OutOfMemoryError as exc:
            after = dict(M.memory_stats(d))
            if d not in self.caps:
                raise Violation(f"Buffer({nbytes}, {d}): out of memory without a cap: {exc}") from None
            assert f"{d}" in str(exc), exc
            assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"], (before, after)
            # (the retry after freeing the cache frees the blocks whose free waited for events)
            assert self.model_requested(d) <= after["requested_bytes.all.current"] \
                <= before["requested_bytes.all.current"], (before, after)
            # (throw_on_cudamalloc_oom: a rejection, not counted in num_ooms)
            ooms = lambda st: st["num_ooms"] + st.get("num_oom_rejections", 0)     # noqa: E731
            assert ooms(after) == ooms(before) + 1, (before["num_ooms"], after["num_ooms"])
            self.count["oom"] += 1
            return None
        b = Buf(obj, d, nbytes, rounded, self.where(d))
        b.last = stream if stream is not None else accel.current_stream(d)
        self.bufs.append(b)
        return b

    def order(self, stream, b):
        """``stream`` waits for the last work on ``b`` (either device)."""
        last = getattr(b, "last", None)
        if last is not None and last != stream and not last.closed:
            stream.wait_stream(last)

    def close(self, b, drop=False):
        # whatever stream last used it: record_stream it (its memory waits for that work)
        last = getattr(b, "last", None)
        if last is not None and not last.closed and last.device_index == b.dev:
            b.obj.record_stream(last)
        elif last is not None and not last.closed:
            accel.synchronize(last.device_index)
        self.pending[b.dev].append(b.nbytes)    # (its free may wait for events until empty_cache)
        ptr = b.obj.ptr
        if drop:
            b.obj = None
            gc.collect()
            _finalize.drain()
        else:
            b.obj.close()
            b.obj = None
        b.closed = True
        if b.nbytes and not self.is_async and (b.where == "default" or _KNOWN):
            # (known: a freed block of a released MemPool or graph pool joins the general cache
            # unchecked, test_release_threshold_after_a_released_pools_block_is_freed)
            self.check_release_threshold(b.dev, ptr)

    def check_release_threshold(self, d, ptr):
        """release_threshold: "bytes of completely free segments kept cached; more are returned
        to the device when a block is freed" (accel/memory/_config.py).  Checked after a free
        that left its default-pool segment wholly free."""
        threshold = M.device_allocator(d).config.release_threshold
        if threshold is None:
            return
        segs = [s for s in M.memory_snapshot() if s["device"] == d and tuple(s["segment_pool_id"]) == (0, 0)]
        mine = [s for s in segs if s["address"] <= ptr < s["address"] + max(s["total_size"], 1)]
        if not mine or mine[0]["active_size"] or (mine[0]["is_expandable"] and not _KNOWN):
            return      # (its free waits for events, or another block is live there; expandable: known)
        # (known: expandable segments are never released by it,
        # test_release_threshold_with_expandable_segments)
        idle = sum(s["total_size"] for s in segs if not s["active_size"] and (_KNOWN or not s["is_expandable"]))
        if idle > threshold:
            raise Violation(f"device {d}: a free left {idle} B of wholly free segments cached "
                            f"({[(s['total_size'], s['is_expandable']) for s in segs if not s['active_size']]}), "
                            f"over release_threshold {threshold}")
        self.count["release_threshold"] += 1

    # -- ops ---------------------------------------------------------------------------------
    def op_alloc(self):
        d = self.rng.randrange(self.n)
        nbytes = self.rng.choice(SIZES)
        s = self.stream(d) if self.rng.random() < 0.4 else None
        b = self.allocate(nbytes, d, s)
        self.note(f"alloc {nbytes} on {d} stream={'given' if s is not None else 'current'}"
                  f" -> {'OOM' if b is None else b.where}")
        if b is not None and self.rng.random() < 0.5 and nbytes:
            v = self.rng.randrange(256)
            b.obj.fill_(v, stream=b.last)
            b.value = v

    def op_free(self):
        live = self.live()
        if live:
            b = self.rng.choice(live)
            drop = self.rng.random() < 0.3
            self.note(f"{'drop' if drop else 'close'} {b.nbytes} on {b.dev} ({b.where})")
            self.close(b, drop)

    def op_fill(self):
        live = self.live(pred=lambda b: b.nbytes and not b.unbacked)
        if not live:
            return
        b = self.rng.choice(live)
        s = self.stream(b.dev)
        self.order(s, b)
        v = self.rng.randrange(256)
        b.obj.fill_(v, stream=s)
        b.value, b.last = v, s
        self.note(f"fill {b.nbytes} on {b.dev} = {v}")

    def op_copy(self):
        live = self.live(pred=lambda b: b.nbytes and not b.unbacked)
        if len(live) < 2:
            return
        dst = self.rng.choice(live)
        srcs = [b for b in live if b is not dst and b.nbytes == dst.nbytes]
        if not srcs:
            src = self.allocate(dst.nbytes, 1 - dst.dev if self.n > 1 else dst.dev)
            if src is None:
                return
            v = self.rng.randrange(256)
            src.obj.fill_(v, stream=src.last)
            src.value = v
        else:
            src = self.rng.choice(srcs)
        how = self.rng.randrange(3)
        if how == 0:        # blocking, on the current streams
            for b in (src, dst):
                self.order(accel.current_stream(b.dev), b)
            dst.obj.copy_from(src.obj)
            dst.last = accel.current_stream(dst.dev)
        else:               # on a stream of the destination's device (accel: the Buffer's device)
            s = self.stream(dst.dev)
            self.order(s, src)
            self.order(s, dst)
            dst.obj.copy_from(src.obj, stream=s, non_blocking=how == 2)
            dst.last = src.last = s
        dst.value = src.value
        self.count["cross-device copy" if src.dev != dst.dev else "copy"] += 1
        self.note(f"copy {dst.nbytes} {src.dev}->{dst.dev} how={how}")

    def op_record_stream(self):
        live = self.live(pred=lambda b: b.nbytes and not b.unbacked)
        if not live:
            return
        b = self.rng.choice(live)
        d = self.rng.randrange(self.n)
        s = self.stream(d, default_ok=False)
        if s.device_index == b.dev:
            self.order(s, b)
            v = self.rng.randrange(256)
            b.obj.fill_(v, stream=s)
            b.value = v
            b.obj.record_stream(s)
        else:
            b.obj.record_stream(s)      # (torch takes another device's stream too)
        self.note(f"record_stream {b.nbytes} of {b.dev} on a stream of {s.device_index}, close")
        self.count["record_stream"] += 1
        if self.rng.random() < 0.7:
            b.obj.close()
            b.obj, b.closed = None, True
            self.pending[b.dev].append(b.nbytes)
        else:
            b.last = s if s.device_index == b.dev else b.last

    def op_stream(self):
        d = self.rng.randrange(self.n)
        live = [s for s in self.streams[d] if not s.closed]
        if live and (len(live) > 3 or self.rng.random() < 0.3):
            s = self.rng.choice(live)
            # (its Buffers' later frees record nothing on it: their last work waits here)
            for b in self.live():
                if getattr(b, "last", None) is s:
                    s.synchronize()
                    b.last = accel.current_stream(b.dev)
            s.close()
            self.note(f"close a stream of {d}")
        else:
            self.streams[d].append(accel.Stream(d, priority=self.rng.choice([0, -1])))
            self.note(f"new stream on {d}")

    def op_event(self):
        d = self.rng.randrange(self.n)
        s = self.stream(d)
        e = accel.Event(enable_timing=self.rng.random() < 0.5)
        e.record(s)
        o = self.stream(self.rng.randrange(self.n))
        e.wait(o)
        if self.rng.random() < 0.5:
            e.synchronize()
            assert e.query() is True
        self.events.append(e)
        if len(self.events) > 4:
            self.events.pop(0).close()
        self.count["event across devices" if o.device_index != d else "event"] += 1
        self.note(f"event on {d} waited on {o.device_index}")

    def op_device(self):
        d = self.rng.randrange(self.n)
        accel.set_device_index(d)
        self.cur = d
        self.note(f"set_device {d}")

    def op_pool(self):
        if self.is_async:
            return
        d = self.rng.randrange(self.n)
        if d in self.pool_ctx:
            self.pool_ctx.pop(d).__exit__(None, None, None)
            self.note(f"leave use_mem_pool on {d}")
            return
        if d in self.pools and self.rng.random() < 0.3:
            del self.pools[d]       # (its Buffers stay live; the pool goes once they are freed)
            gc.collect()
            _finalize.drain()
            self.note(f"drop the MemPool of {d}")
            self.count["drop pool"] += 1
            return
        if d not in self.pools:
            with accel.device_index(d):
                self.pools[d] = M.MemPool(no_split=self.rng.random() < 0.3)
        cm = M.use_mem_pool(self.pools[d], d)
        cm.__enter__()
        self.pool_ctx[d] = cm
        self.count["use_mem_pool"] += 1
        self.note(f"enter use_mem_pool on {d}")

    def op_graph(self):
        if self.kind == "mps":
            return
        d = self.rng.randrange(self.n)
        if d in self.pool_ctx or d in self.caps:
            return          # (a pool's routing would move into the capture; a cap may refuse its memory)
        side = accel.Stream(d)
        targets = self.live(d, lambda b: b.nbytes and not b.unbacked)[:3]
        for b in targets:
            self.order(side, b)
        side.wait_stream(accel.current_stream(d))
        g = accel.Graph()
        ops, made = [], []
        if self.is_async:
            self.graph_mem.add(d)
        with accel.graph(g, stream=side):
            self.capturing = d
            for b in targets:
                v = self.rng.randrange(256)
                b.obj.fill_(v)
                ops.append((b, v))
            for nbytes in self.rng.sample([512, 4 * KiB, 1 * MiB, 3 * MiB], 2):
                nb = Buf(accel.Buffer(nbytes, d), d, nbytes,
                         0 if self.is_async else pow2_round(nbytes, self.divisions(d, nbytes)), "graph")
                self.bufs.append(nb)
                nb.unbacked = self.is_async
                v = self.rng.randrange(256)
                nb.obj.fill_(v)
                made.append((nb, v))
            if self.rng.random() < 0.5:
                nb, _v = made.pop()
                nb.obj.close()          # freed in the capture
                nb.obj, nb.closed = None, True
                self.pending[d].append(nb.nbytes)
            self.check(f"in a capture on {d}")
        self.capturing = None
        side.synchronize()
        ops += made
        for b, v in ops:
            b.value = None          # not known until the graph runs
        side.close()
        for b in ops:
            b[0].last = accel.current_stream(d)
        self.graphs.append([g, d, ops])
        self.count["capture"] += 1
        self.note(f"capture on {d}: {len(ops)} fills")

    def op_replay(self):
        grs = [gr for gr in self.graphs if all(not b.closed for b, _v in gr[2])]
        if not grs:
            return
        g, d, ops = self.rng.choice(grs)
        on = self.rng.randrange(self.n)
        for b, _v in ops:
            self.order(accel.current_stream(d), b)
        with accel.device_index(on):
            g.replay()
        accel.synchronize(d)
        for b, v in ops:
            b.value, b.last, b.unbacked = v, accel.current_stream(d), False
        self.count["replay from the other device" if on != d else "replay"] += 1
        self.note(f"replay graph of {d} from {on}")

    def op_reset_graph(self):
        if self.graphs:
            gr = self.graphs[self.rng.randrange(len(self.graphs))]
            if not _KNOWN and any(b.unbacked and not b.closed for b, _v in gr[2]):
                return      # known: test_async_reset_graph_output_address_reused_misattributes_frees
            self.graphs.remove(gr)
            accel.synchronize(gr[1])
            gr[0].reset()
            self.note(f"reset graph of {gr[1]}")

    def op_empty_cache(self):
        d = self.rng.randrange(self.n)
        for e in range(self.n):
            accel.synchronize(e)
        if self.rng.random() < 0.5:
            M.empty_cache()
            devs = range(self.n)
            self.note("empty_cache")
        else:
            M.device_allocator(d).empty_cache()
            devs = [d]
            self.note(f"device_allocator({d}).empty_cache")
        for e in devs:
            # torch's emptyCache frees every block whose free waited for events first
            self.pending[e] = []
            if not any(gr[1] == e for gr in self.graphs) and not self.live(e, lambda b: b.where == "graph"):
                self.graph_mem.discard(e)
            got, want = M.memory_stats(e)["requested_bytes.all.current"], self.model_requested(e)
            if got != want:
                raise Violation(f"device {e}: after empty_cache, requested_bytes {got} != the live Buffers' {want}")
        if self.is_async:
            return
        for e in devs:
            # (the default pool keeps no wholly free memory: only private pools keep theirs)
            idle = [s for s in M.memory_snapshot() if s["device"] == e and tuple(s["segment_pool_id"]) == (0, 0)
                    and s["active_size"] == 0 and s["total_size"]]
            if idle:
                raise Violation(f"device {e}: after empty_cache, wholly free default-pool segments are kept: "
                                f"{[(s['total_size'], s['is_expandable']) for s in idle]}")

    def op_reset_peaks(self):
        d = self.rng.randrange(self.n)
        M.reset_peak_memory_stats(d)
        st = M.memory_stats(d)
        for key, value in st.items():
            if key.endswith(".peak"):
                cur = st[key[:-5] + ".current"]
                if value != cur:
                    raise Violation(f"device {d}: after reset_peak_memory_stats, {key} = {value} != current {cur}")
        assert M.max_memory_allocated(d) == M.memory_allocated(d)
        assert M.max_memory_reserved(d) == M.memory_reserved(d)
        self.note(f"reset_peak_memory_stats({d})")

    def op_cap(self):
        d = self.rng.randrange(self.n)
        total = M.get_memory_info(d)[1]
        reserved = M.memory_reserved(d)
        cap_bytes = reserved + self.rng.choice([0, 2 * MiB, 8 * MiB, 30 * MiB])
        frac = cap_bytes / total
        M.set_per_process_memory_fraction(frac, d)
        self.caps[d] = [int(frac * total), max(int(frac * total), reserved)]
        self.note(f"cap {d} at {cap_bytes} (reserved {reserved})")
        over = self.allocate(cap_bytes + 20 * MiB, d)
        if over is not None:
            raise Violation(f"device {d}: Buffer({cap_bytes + 20 * MiB}) accepted under a cap of {cap_bytes}")
        self.count["cap"] += 1
        if self.rng.random() < 0.4:
            # recovery: raise the cap, and the same request goes through
            self.check(f"after an OOM on {d}")
            self.op_uncap(d)
            again = self.allocate(cap_bytes + 20 * MiB, d)
            if again is None:
                raise Violation(f"device {d}: Buffer({cap_bytes + 20 * MiB}) refused after the cap was lifted")
            self.note(f"  uncapped: Buffer({cap_bytes + 20 * MiB}, {d}) made, and closed")
            self.check(f"after the OOM recovery on {d}")
            self.close(again)       # (a large Buffer kept would make every later copy slow)
            self.count["oom recovery"] += 1

    def op_uncap(self, d=None):
        d = self.rng.randrange(self.n) if d is None else d
        M.set_per_process_memory_fraction(1.0, d)
        self.caps.pop(d, None)
        self.note(f"uncap {d}")

    def op_settings(self):
        if self.is_async:
            text = self.rng.choice(ASYNC_SETTINGS)
        else:
            text = self.rng.choice(NATIVE_SETTINGS)
            if self.torch_policy and "expandable_segments:True" in text:
                text = ""
        M.set_allocator_settings(text)
        assert M.get_allocator_settings() == text
        if "per_process_memory_fraction:1.0" in text:
            self.caps.clear()
        if not self.is_async:
            want = 20 * MiB if "max_split_size_mb:20" in text else 24 * MiB if "max_split_size_mb:24" in text \
                else 22 * MiB if "max_split_size_mb:22" in text else -1
            for d in range(self.n):
                got = M.memory_stats(d)["max_split_size"]
                if got != want:
                    raise Violation(f"after set_allocator_settings({text!r}), device {d} max_split_size "
                                    f"{got} != {want}")
        self.count["settings"] += 1
        self.note(f"set_allocator_settings({text!r})")

    def op_read(self):
        known = self.live(pred=lambda b: b.value is not None and b.nbytes and not b.unbacked)
        if not known:
            return
        b = self.rng.choice(known)
        for d in range(self.n):
            accel.synchronize(d)
        got = b.obj.to_numpy()
        bad = np.flatnonzero(got != b.value)
        if bad.size:
            raise Violation(f"Buffer({b.nbytes}, {b.dev}) ({b.where}): {bad.size} bytes differ from {b.value}, "
                            f"first at {bad[0]}: {got[bad[0]]}")

    OPS = [("alloc", 8), ("free", 6), ("fill", 3), ("copy", 3), ("record_stream", 2), ("stream", 2),
           ("event", 2), ("device", 1), ("pool", 2), ("graph", 1), ("replay", 2), ("reset_graph", 1),
           ("empty_cache", 2), ("reset_peaks", 1), ("cap", 1), ("uncap", 1), ("settings", 2), ("read", 2)]

    # -- invariants --------------------------------------------------------------------------
    def graph_extra(self, d):
        """(requested bytes, allocations, rounded bytes) of the graphs of ``d`` not reset: each
        holds its generator's seed and offset (two 8-byte allocations), as torch's graph-safe
        RNG state does."""
        k = sum(1 for gr in self.graphs if gr[1] == d) + (self.capturing == d)
        return GRAPH_RNG_BYTES * k, GRAPH_RNG_ALLOCS * k, 0 if self.is_async else 512 * GRAPH_RNG_ALLOCS * k

    def model_requested(self, d):
        return sum(b.nbytes for b in self.live(d)) + self.graph_extra(d)[0]

    def check(self, where, full=True):
        """The invariants (``full``: the scalar queries and get_memory_info too)."""
        fields = sim_fields()
        errors = fields.get("errors") or fields.get("ze_errors")
        if errors:
            raise Violation(f"{where}: device fault {errors}")
        snap = M.memory_snapshot()
        for d in range(self.n):
            st = M.memory_stats(d)
            live = self.live(d)
            alloc, reserved = st["allocated_bytes.all.current"], st["reserved_bytes.all.current"]
            if full and ((M.memory_allocated(d), M.memory_reserved(d), M.max_memory_allocated(d),
                          M.max_memory_reserved(d)) != (alloc, reserved, st["allocated_bytes.all.peak"],
                                                         st["reserved_bytes.all.peak"])):
                raise Violation(f"{where}: device {d}: memory_allocated/reserved/max_* disagree with memory_stats")
            for key, value in st.items():
                if key.endswith(".current") and st.get(key[:-8] + ".peak", value) < value:
                    raise Violation(f"{where}: device {d}: {key[:-8]}.peak {st[key[:-8] + '.peak']} < current {value}")
            want = self.model_requested(d)
            got = st["requested_bytes.all.current"]
            if not want <= got <= want + sum(self.pending[d]):
                raise Violation(f"{where}: device {d}: requested_bytes {got} not in the live Buffers' {want} "
                                f"+ up to {sum(self.pending[d])} B whose free may wait ({len(live)} Buffers)")
            rounded = sum(b.rounded for b in live) + self.graph_extra(d)[2]
            if alloc < rounded:
                raise Violation(f"{where}: device {d}: memory_allocated {alloc} < the live Buffers' rounded {rounded}")
            if alloc > reserved:
                raise Violation(f"{where}: device {d}: memory_allocated {alloc} > memory_reserved {reserved}")
            want = sum(1 for b in live if b.nbytes) + self.graph_extra(d)[1]
            if st["allocation.all.current"] != want:
                raise Violation(f"{where}: device {d}: allocation.all.current {st['allocation.all.current']} != "
                                f"{want}: the live Buffers and graphs' RNG holders")
            segs = [s for s in snap if s["device"] == d]
            if self.is_async:
                if segs:
                    raise Violation(f"{where}: device {d}: cudaMallocAsync snapshot lists segments")
            else:
                for key, field in (("reserved_bytes", "total_size"), ("allocated_bytes", "allocated_size"),
                                   ("active_bytes", "active_size"), ("requested_bytes", "requested_size")):
                    total = sum(s[field] for s in segs)
                    if total != st[f"{key}.all.current"]:
                        raise Violation(f"{where}: device {d}: {key}.all.current {st[f'{key}.all.current']} != "
                                        f"snapshot's {field} sum {total}")
                    for pool, ptype in (("large_pool", "large"), ("small_pool", "small")):
                        part = sum(s[field] for s in segs if s["segment_type"] == ptype)
                        if part != st[f"{key}.{pool}.current"]:
                            raise Violation(f"{where}: device {d}: {key}.{pool}.current "
                                            f"{st[f'{key}.{pool}.current']} != snapshot's {ptype} {field} {part}")
                blocks = sum(1 for s in segs for blk in s["blocks"] if blk["state"] == "active_allocated")
                if blocks != st["allocation.all.current"]:
                    raise Violation(f"{where}: device {d}: allocation.all.current {st['allocation.all.current']} != "
                                    f"{blocks} active_allocated blocks in the snapshot")
                blocks_at = {blk["address"]: blk for s in segs for blk in s["blocks"]}
                for b in live:
                    if not b.nbytes:
                        continue
                    blk = blocks_at.get(b.obj.ptr)
                    if blk is None or blk["state"] != "active_allocated" or blk["requested_size"] != b.nbytes \
                            or blk["size"] < b.rounded:
                        raise Violation(f"{where}: device {d}: live Buffer({b.nbytes}) ({b.where}) at "
                                        f"{b.obj.ptr:#x}: snapshot block {blk} (rounded {b.rounded})")
                for s in segs:
                    if sum(blk["size"] for blk in s["blocks"]) != s["total_size"]:
                        raise Violation(f"{where}: device {d}: a segment's blocks do not add up to its total_size")
            cap = self.caps.get(d)
            if cap is not None:
                if reserved > cap[1]:
                    raise Violation(f"{where}: device {d}: memory_reserved {reserved} > the cap {cap[0]} "
                                    f"(bound {cap[1]})")
                cap[1] = max(cap[0], min(cap[1], reserved))
            if not full:
                continue
            in_use = used(d) - self.base_used[d]
            if d in self.graph_mem:
                # (cudaMallocAsync: graph memory is not the pool's, and stays with the device's
                # graph memory until empty_cache trims it once no graph or output uses it)
                ok = in_use >= reserved
            else:
                ok = in_use == reserved
            if not ok:
                raise Violation(f"{where}: device {d}: get_memory_info shows {in_use} B in use over the base, "
                                f"memory_reserved {reserved}")

    def run(self, steps):
        ops = [name for name, w in self.OPS for _ in range(w)]
        for i in range(steps):
            name = self.rng.choice(ops)
            getattr(self, "op_" + name)()
            self.count[name] += 1
            self.check(f"step {i} ({name})", full=i % 5 == 0 or name in ("empty_cache", "cap", "reset_graph"))
        self.teardown()

    def teardown(self):
        for d in list(self.pool_ctx):
            self.pool_ctx.pop(d).__exit__(None, None, None)
        for d in range(self.n):
            accel.synchronize(d)
        order = self.live()
        self.rng.shuffle(order)
        for b in order:
            self.close(b, drop=self.rng.random() < 0.3)
        for gr in self.graphs:
            gr[0].reset()
        self.graphs = []
        self.pools.clear()
        for e in self.events:
            e.close()
        for d in range(self.n):
            for s in self.streams[d]:
                if not s.closed:
                    s.close()
            M.set_per_process_memory_fraction(1.0, d)
        self.caps.clear()
        self.bufs = []
        settle(self.n)
        self.check("teardown")
        for d in range(self.n):
            if M.memory_allocated(d) or M.memory_reserved(d):
                raise Violation(f"teardown: device {d}: allocated {M.memory_allocated(d)}, reserved "
                                f"{M.memory_reserved(d)}")
            if used(d) != self.base_used[d]:
                raise Violation(f"teardown: device {d}: {used(d) - self.base_used[d]} B more in use than at the start")
        if live_handles(self.kind) != self.base_handles:
            raise Violation(f"teardown: live handles {live_handles(self.kind)} != {self.base_handles}")


def start(monkeypatch, name):
    kind, env = CONFIGS[name]
    use_sim(monkeypatch, kind, ACCEL_SIM_DEVICES=2, **env)
    return kind


RUNS = collections.Counter()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("conf", list(CONFIGS))
def test_state_fuzz_memory_model(monkeypatch, conf, seed):
    kind = start(monkeypatch, conf)
    fz = Fuzz(kind, conf, random.Random(f"r72c-{conf}-{seed}"))
    try:
        fz.run(STEPS)
    except Exception as exc:
        raise AssertionError(f"{conf} seed {seed}: {type(exc).__name__}: {exc}\nlast ops:\n  "
                             + "\n  ".join(fz.log[-25:])) from exc
    RUNS.update(fz.count)
    RUNS["cases"] += 1


def test_the_runs_reached_every_op():
    """Over all the cases above, each op ran and did its work somewhere (skipped unless every
    case ran before it in this process)."""
    if RUNS["cases"] < len(CONFIGS) * len(SEEDS):
        pytest.skip(f"only {RUNS['cases']} of the fuzz cases ran before this test")
    want = {name for name, _w in Fuzz.OPS} | {"cross-device copy", "record_stream", "event across devices",
                                              "use_mem_pool", "drop pool", "capture", "replay",
                                              "replay from the other device", "cap", "oom", "settings", "oom recovery"}
    assert want <= set(RUNS), sorted(want - set(RUNS))


# -- bugs the fuzzer found: minimal reproductions ----------------------------------------------
# (r72c found it too; r72b's fix, commit a6b6d95, landed while this file was written)
def test_async_graph_output_copied_to_a_peer_device(monkeypatch):
    """Found by cuda-async-fraction-pcibus seed 7 (ops: a capture on device 0 allocating and
    filling a Buffer, a replay, then ``Buffer(512, 1).copy_from(that Buffer)``).

    Under ``backend:cudaMallocAsync`` on two peer-capable devices, a Buffer a graph capture
    allocates on device 0 (a graph allocation node: its memory has the access device 0's pool
    gave when it was captured) and the graph replayed, ``Buffer(n, 1).copy_from(out)`` takes the
    direct path (buffer/buffer_class.py ``Buffer._copy_from``: ``can_access_peer`` is true, so
    ``device_allocator(0).add_peer(1)`` then ``cudaMemcpyAsync`` on device 1's stream).
    ``add_peer`` sets access on the pool (``cudaMemPoolSetAccess``), which does not reach graph
    allocations made before (memory/_async.py says so: "graph allocations keep the access the
    pool gave when they were captured"), so device 1 reads memory it has no access to: a device
    fault (cudaErrorIllegalAddress, sticky: every later call of the process fails), where a valid
    program should get its 7s (ACCEL_SIM_PEER=none, where the copy is staged, does).  Without a
    capture, or after any earlier cross-device copy from device 0's pool (add_peer before the
    capture), the same copy worked."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DEVICES=2, ACCEL_ALLOC_CONF="backend:cudaMallocAsync")
    side, g = accel.Stream(0), accel.Graph()
    with accel.graph(g, stream=side):
        out = accel.Buffer(512, 0)
        out.fill_(7)
    g.replay()
    accel.synchronize(0)
    dst = accel.Buffer(512, 1)
    dst.copy_from(out)
    accel.synchronize(1)
    assert not sim.state().errors, sim.state().errors[:1]
    assert (dst.to_numpy() == 7).all()


# (r72c found; fixed in session 32)
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_release_threshold_with_expandable_segments(monkeypatch, kind):
    """Found by cuda-release-throw-nonsplit (ops: ``Buffer(25 MiB, 0)``, then close it).

    ``release_threshold`` is documented as "bytes of completely free segments kept cached;
    more are returned to the device when a block is freed" (accel/memory/_config.py OPTIONS;
    README's ACCEL_ALLOC_CONF row lists it with no exception).  Under
    ``expandable_segments:False`` the freed 26 MiB segment goes back at once (reserved 0); under
    expandable segments, the default where the backend has virtual memory, the wholly free
    expandable segment (26 MiB mapped, listed by memory_snapshot with active_size 0) stays
    mapped: ``_caching.DeviceCachingAllocator._whole_free_segments`` looks at classic segments
    only, so ``_release_over_threshold`` never counts or unmaps it."""
    use_sim(monkeypatch, kind, ACCEL_SIM_DEVICES=2, ACCEL_ALLOC_CONF="release_threshold:4M")
    accel.Buffer(25 * MiB, 1).close()
    assert M.memory_snapshot()[0]["is_expandable"]
    assert M.memory_reserved(1) <= 4 * MiB, M.memory_reserved(1)


# (r72c found; fixed in session 32)
def test_release_threshold_after_a_released_pools_block_is_freed(monkeypatch):
    """Found by cuda-release-throw-nonsplit seed 0 (ops: two Buffers in a MemPool, the MemPool
    dropped, the Buffers closed).

    With ``release_threshold:4M,expandable_segments:False``, freeing the last blocks of a MemPool
    that was dropped moves its two wholly free 6 MiB segments to the general cache
    (``_whole_segment_free``: ``owner.released()`` -> ``_move_to_general``), and the
    ``elif`` there skips ``_apply_release_threshold``: 12 MiB of wholly free segments stay
    reserved over the 4 MiB threshold after "a block is freed" -- until some later free of a
    general-cache block applies it (then 2 MiB).  The same frees outside a pool leave at most
    4 MiB."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DEVICES=2,
            ACCEL_ALLOC_CONF="release_threshold:4M,expandable_segments:False")
    pool = M.MemPool()
    with M.use_mem_pool(pool):
        a, b = accel.Buffer(5 * MiB, 0), accel.Buffer(5 * MiB, 0)
    del pool
    gc.collect()
    _finalize.drain()
    a.close()
    b.close()
    idle = [s["total_size"] for s in M.memory_snapshot() if not s["active_size"]]
    assert sum(idle) <= 4 * MiB, idle


# (r72c found; fixed in session 34)
def test_async_reset_graph_output_address_reused_misattributes_frees(monkeypatch):
    """Found by cuda-async-peer seed 0 (step 95: requested_bytes 3584 B over the live Buffers
    after every pending free was flushed by empty_cache).

    Under ``backend:cudaMallocAsync``: graph A's capture allocates ``a = Buffer(512)`` (an output:
    no memory until a replay) and A is reset before any replay, so a's address goes back to the
    driver while ``a`` lives.  Graph B's capture then allocates ``b = Buffer(4096)`` at the same
    address.  ``b.close()`` should take 4096 B off ``requested_bytes`` (as it does when the
    addresses differ) and leave ``a``'s 512 counted; instead ``AsyncPoolAllocator.free``
    (memory/_async.py: "The stale one first") forgets a's stale 512 B record and keeps b's 4096 B
    allocation held and counted until ``a`` is closed: memory_stats reports 4112 B requested
    (and one allocation too many) for live Buffers of 512 B plus the two graphs' 16 B of RNG
    state, and b's memory is not given back when b is freed."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DEVICES=2, ACCEL_ALLOC_CONF="backend:cudaMallocAsync")
    side, tries = accel.Stream(0), []
    for _ in range(20):     # (the simulated pool's addresses are host allocations: reuse is likely, not sure)
        ga, gb = accel.Graph(), accel.Graph()
        with accel.graph(ga, stream=side):
            a = accel.Buffer(512, 0)
            a.fill_(1)
        ga.reset()
        with accel.graph(gb, stream=side):
            b = accel.Buffer(4096, 0)
            b.fill_(2)
        if b.ptr == a.ptr:  # the address the reset gave back: the bug needs it reused
            break
        tries.append((ga, gb, a, b))
    else:
        pytest.skip("the simulated pool never handed the reset graph's address out again")
    before = M.memory_stats(0)["requested_bytes.all.current"]
    b.close()
    after = M.memory_stats(0)["requested_bytes.all.current"]
    assert before - after == 4096, (before, after)
