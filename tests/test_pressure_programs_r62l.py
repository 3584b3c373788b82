"""Long-running programs under memory pressure (r62l), the way training jobs run.

Each test is one program: a loop of a few hundred iterations on a small simulated device
(``ACCEL_SIM_MEMORY``) with a low per-process memory fraction, on device 1 while device 0 is
current, that hits ``OutOfMemoryError`` now and then, catches it, empties the cache and goes on
(smaller batches, dropped buffers).  Unlike test_alloc_stress.py (random operations from
threads) and test_soak_objects_r45.py (object cycles without pressure), these are whole
programs whose results are checked byte for byte, whose OOMs are counted by the program itself
and compared with ``num_ooms``, and after which:

* every ``memory_stats`` invariant holds (allocated <= reserved, active >= allocated,
  peak >= current, allocation/segment counters balance, empty when nothing is live),
* the simulator's live allocations and handles are back to the baseline taken before the loop,
* no accel Python object outlives the program (gc census by type),
* later valid calls still work on both devices.
"""

from __future__ import annotations

import collections
import gc
import threading

import numpy as np
import pytest

import accel
from accel import OutOfMemoryError, memory, sim

from conftest import SIMS, use_sim

pytestmark = pytest.mark.usefixtures("frozen_module_heap")

MiB = 1 << 20
#: memory per simulated device: small, so that a fraction of it is a few MiB
DEVICE_MEMORY = "64M"


def _dev(kind: str) -> int:
    """The device the programs run on: 1, while device 0 stays current (Metal has one device)."""
    return 0 if kind == "mps" else 1


# ------------------------------------------------------------------------------- checks
def _pressure(monkeypatch, kind: str, conf: str = "") -> str:
    env = {"ACCEL_SIM_MEMORY": DEVICE_MEMORY}
    if conf:
        env["ACCEL_ALLOC_CONF"] = conf
    use_sim(monkeypatch, kind, **env)
    return kind


def _sim_counts(kind: str) -> dict:
    """The simulator's live memory objects and handles (per backend)."""
    st = sim.state()
    if kind == "xpu":
        keys = ("ze_live_allocations", "ze_live_events", "ze_live_event_pools", "ze_live_command_lists",
                "ze_live_command_queues", "ze_vmm_reservations", "ze_vmm_handles", "ze_vmm_mappings",
                "ze_vmm_physical_bytes", "ze_device_used")
        return {k: getattr(st, k) for k in keys}
    if kind == "mps":
        out = {f"metal.{k}": v for k, v in st.metal_live_objects.items()}
        out["leaked_autoreleases"] = st.metal_leaked_autoreleases
        return out
    keys = ("live_allocations", "live_bytes", "streams", "events", "graphs", "graph_execs", "captures",
            "vmm_reservations", "vmm_handles", "vmm_mappings", "vmm_physical_bytes")
    return {k: getattr(st, k) for k in keys}


#: simulator counts of what accel caches for reuse (events, event pools): bounded by the peak
#: of concurrent use, as torch's event pool, not by live objects; a later run must not raise them
_CACHES = ("events", "ze_live_events", "ze_live_event_pools", "metal.MTLEvent", "metal.MTLSharedEvent")


def _split(counts: dict):
    cached = {k: v for k, v in counts.items() if k in _CACHES}
    return {k: v for k, v in counts.items() if k not in _CACHES and v not in (0, {}, [0, 0])}, cached


def _accel_objects() -> collections.Counter:
    gc.collect()
    accel._finalize.drain()
    gc.collect()
    out = collections.Counter()
    for obj in gc.get_objects():
        mod = getattr(type(obj), "__module__", "")
        if not isinstance(mod, str):
            continue
        # the simulators' own objects (a retired queue is swept now and then: bounded, not
        # by live objects) are checked through their handle counts (_sim_counts) instead
        if (mod == "accel" or mod.startswith("accel.")) and not mod.startswith("accel.sim"):
            out[type(obj).__qualname__] += 1
    return out


def _check_stats(dev: int, where: str) -> dict:
    s = memory.memory_stats(dev)
    assert s["allocated_bytes.all.current"] <= s["reserved_bytes.all.current"], (where, s)
    assert s["active_bytes.all.current"] >= s["allocated_bytes.all.current"], (where, s)
    pooled = type(memory.device_allocator(dev)).__name__ == "AsyncPoolAllocator"
    if not pooled:
        # (cudaMallocAsync keeps no block counts: only bytes, from the pool, as torch)
        assert s["active.all.current"] >= s["allocation.all.current"], (where, s)
    for key, value in s.items():
        if key.endswith(".current"):
            base = key[:-len(".current")]
            assert value >= 0, (where, key, value)
            assert s[base + ".peak"] >= value, (where, key, value, s[base + ".peak"])
            if not base.startswith(("reserved", "segment", "inactive")) and not (
                    pooled and not base.startswith(("allocation.", "requested_bytes."))):
                assert s[base + ".allocated"] - s[base + ".freed"] == value, (where, key)
    return s


def _baseline(kind: str):
    """Initialize both devices and the allocators' lazy parts; (sim counts, accel objects)."""
    for d in _devices(kind):
        accel.Buffer(MiB, device=d).fill_(1).close()
        accel.synchronize(d)
    memory.empty_cache()
    return _sim_counts(kind), _accel_objects()


def _devices(kind: str):
    return (0,) if kind == "mps" else (0, 1)


def _census(kind: str):
    """After a warm-up run of a program: (the simulator's cached handles, the accel objects);
    a later run as long must not add any."""
    for d in _devices(kind):
        accel.synchronize(d)
    memory.empty_cache()
    return _split(_sim_counts(kind))[1], _accel_objects()


def _check_clean(kind: str, base, where: str, ooms=None, objects=None) -> None:
    """Everything the program made is gone; the stats and the simulator say so.  ``objects``:
    the census after a warm-up run (default: the baseline's)."""
    counts, base_objects = base
    cached, objects = (_split(counts)[1], base_objects) if objects is None else objects
    for d in _devices(kind):
        accel.synchronize(d)
    memory.empty_cache()
    for d in _devices(kind):
        s = _check_stats(d, where)
        assert s["allocated_bytes.all.current"] == 0, (where, d, s["allocated_bytes.all.current"])
        assert s["active_bytes.all.current"] == 0, (where, d)
        assert s["allocation.all.allocated"] == s["allocation.all.freed"], (where, d)
        assert s["reserved_bytes.all.current"] == 0, (where, d, "empty_cache left reserved memory")
        assert memory.memory_allocated(d) == 0
    now_objects = _accel_objects()
    grown = {k: (objects.get(k, 0), v) for k, v in now_objects.items() if v > objects.get(k, 0)}
    assert not grown, (where, "accel objects outlived the program", grown)
    if ooms is not None:
        assert memory.memory_stats(_dev(kind))["num_ooms"] == ooms, (where, "num_ooms", ooms)
    live, now_cached = _split(_sim_counts(kind))
    assert live == _split(counts)[0], (where, "simulator state")
    grown = {k: (cached.get(k, 0), v) for k, v in now_cached.items() if v > cached.get(k, 0)}
    assert not grown, (where, "simulator caches grew", grown)
    # later valid calls still work on both devices
    for d in _devices(kind):
        b = accel.Buffer(3 * MiB, device=d).fill_(7)
        assert (b.to_numpy()[::MiB] == 7).all()
        b.close()
    memory.empty_cache()


def _cap(dev: int, fraction: float = 0.25) -> int:
    """Cap device ``dev`` at ``fraction`` of its memory; the cap in bytes."""
    memory.set_per_process_memory_fraction(fraction, dev)
    return int(fraction * memory.get_memory_info(dev)[1])


# ---------------------------------------------------------------- 1/2 training with backoff
_CONFS = [("cuda", ""), ("cuda", "expandable_segments:True"), ("cuda", "expandable_segments:False"),
          ("cuda", "backend:cudaMallocAsync"), ("xpu", ""), ("xpu", "expandable_segments:True"),
          ("xpu", "expandable_segments:False"), ("mps", "")]


def _train(dev: int, cap: int, steps: int = 300) -> int:
    """The training program; returns the OOMs it caught."""
    rng = np.random.default_rng(0)
    ooms = 0
    before = memory.memory_stats(dev)["num_ooms"]
    batch = 2
    weights = accel.Buffer(2 * MiB, device=dev).fill_(3)
    grad = accel.Buffer(MiB, device=dev).fill_(0)
    steps_done = 0
    for step in range(steps):
        acts = []
        try:
            for i in range(batch):
                acts.append(accel.Buffer(int(rng.integers(1, 3)) * MiB - int(rng.integers(0, 4096)), device=dev))
                acts[-1].fill_((step + i) % 251)
            # "backward": a temporary into the gradient
            grad.copy_from(accel.Buffer(MiB, device=dev).fill_(step % 256))
            steps_done += 1
        except OutOfMemoryError as exc:
            ooms += 1
            assert f"GPU {dev} " in str(exc) or f"device {dev} " in str(exc), str(exc)
            acts.clear()
            memory.empty_cache()
            batch = max(1, batch // 2)
            continue
        assert memory.memory_allocated(dev) <= cap
        if step % 37 == 0:                            # check the data now and then
            for i in range(len(acts)):
                assert (acts[i].to_numpy()[::4096] == (step + i) % 251).all()
            assert (grad.to_numpy()[::4096] == step % 256).all()
        acts.clear()
        batch += 1                                    # grow until the cap bites again
        if step % 50 == 0:
            _check_stats(dev, f"step {step}")
    assert ooms > steps // 30 and steps_done > steps // 3, (ooms, steps_done)
    assert memory.memory_stats(dev)["num_ooms"] - before == ooms
    assert (weights.to_numpy()[::4096] == 3).all()
    del acts
    assert memory.memory_allocated(dev) == weights.nbytes + grad.nbytes
    weights.close()
    grad.close()
    accel.synchronize(dev)
    assert memory.memory_allocated(dev) == 0
    s = _check_stats(dev, "end")
    assert s["reserved_bytes.all.peak"] <= cap, (s["reserved_bytes.all.peak"], cap)
    assert accel.current_device_index() == 0
    return ooms


@pytest.mark.parametrize("kind,conf", [c for c in _CONFS if c[0] in SIMS], ids=lambda v: v or "default")
def test_training_loop_backs_off_on_oom(monkeypatch, kind, conf):
    """A training loop on device 1: weights, a growing batch of activations, a gradient
    reduction; an OOM drops the partial batch, empties the cache and halves the batch."""
    _pressure(monkeypatch, kind, conf)
    base = _baseline(kind)
    dev = _dev(kind)
    cap = _cap(dev, 0.25)                             # 16 MiB of 64
    ooms = _train(dev, cap, 300)
    objects = _census(kind)
    ooms += _train(dev, cap, 300)
    _check_clean(kind, base, "training", ooms, objects)


# -------------------------------------------------- 3 producer/consumer with record_stream
def _pipeline(dev: int, steps: int) -> int:
    """Producer stream fills a buffer, the consumer stream (behind a queue of its own work)
    copies it out; the producer frees the buffer at once after record_stream.  Returns OOMs."""
    prod, cons = accel.Stream(dev), accel.Stream(dev)
    scratch = accel.Buffer(MiB, device=dev, stream=cons)
    outs = []                      # (expected value, result buffer on the consumer)
    ooms = 0
    size = 3 * MiB
    for step in range(steps):
        value = step % 253 + 1
        try:
            x = accel.Buffer(size - 512 * (step % 7), device=dev, stream=prod)
        except OutOfMemoryError:
            ooms += 1
            # the consumer's copies hold the memory: check and drop the results, then retry
            _drain(outs, cons)
            memory.empty_cache()
            continue
        x.fill_(value, stream=prod)
        cons.wait_stream(prod)
        for _ in range(3):                          # the consumer is behind: more work first
            scratch.fill_(step % 256, stream=cons)
        try:
            r = accel.Buffer(MiB // 2, device=dev, stream=cons)
        except OutOfMemoryError:
            ooms += 1
            x.record_stream(cons)
            x.close()
            _drain(outs, cons)
            memory.empty_cache()
            continue
        with cons:
            # half a MiB from the middle or the start of x, as a typed view
            r.copy_from(x.as_array(np.uint8, (MiB // 2,), offset=(size // 2) * (step % 2)), non_blocking=True)
        x.record_stream(cons)
        x.close()                                   # freed on the producer while the consumer reads
        outs.append((value, r))
        del r, x
        if len(outs) > 12:
            _drain(outs[:6], cons)
            del outs[:6]
    _drain(outs, cons)
    outs.clear()
    scratch.close()
    accel.synchronize(dev)
    return ooms


def _drain(outs, after=None) -> None:
    """Check and free the results; the reads wait for the consumer stream ``after``."""
    if outs and after is not None:
        accel.current_stream(outs[0][1].device_index).wait_stream(after)
    for value, r in outs:
        got = r.to_numpy()
        assert (got == value).all(), (value, np.unique(got))
        r.close()
    outs.clear() if isinstance(outs, list) else None


@pytest.mark.parametrize("conf", ["", "expandable_segments:False", "backend:cudaMallocAsync"],
                         ids=lambda v: v or "default")
def test_producer_consumer_frees_under_pressure(monkeypatch, sim_backend, conf):
    kind = sim_backend
    if conf and kind != "cuda" and "cudaMallocAsync" in conf or (conf and kind == "mps"):
        pytest.skip("cudaMallocAsync is CUDA's; Metal has no expandable segments")
    _pressure(monkeypatch, kind, conf)
    monkeypatch.setenv("ACCEL_SIM_DELAY_US", "150")     # the consumer's queue really lags
    base = _baseline(kind)
    dev = _dev(kind)
    cap = _cap(dev, 0.2)                               # ~12.8 MiB: a handful of 3 MiB buffers
    before = memory.memory_stats(dev)["num_ooms"]
    ooms = _pipeline(dev, 250)
    objects = _census(kind)
    ooms += _pipeline(dev, 250)
    assert memory.memory_stats(dev)["num_ooms"] - before == ooms
    if "cudaMallocAsync" not in conf:       # (the driver's pool: the cap counts used bytes, as torch)
        assert memory.memory_stats(dev)["reserved_bytes.all.peak"] <= cap
    _check_clean(kind, base, "pipeline", memory.memory_stats(dev)["num_ooms"], objects)
