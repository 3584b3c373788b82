"""The checks of ``python -m accel.selftest``, one function each.

Every check takes a :class:`Context` and returns a dict of details (what it
measured) or raises :class:`CheckFailed` (or any exception) to fail.  The
self-test runs each in its own process, so a check that crashes, hangs or
leaves the device in a sticky error state cannot affect the next one;
``tests/test_device_real.py`` runs the same functions the same way.
"""

from __future__ import annotations

import os
import signal
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

from . import _selftest_peers

MiB = 1 << 20
GiB = 1 << 30
SEED = 0x5EED_1234_ABCD_0042


class CheckFailed(AssertionError):
    """A check's expectation did not hold; ``details`` say what was seen."""

    def __init__(self, message: str, details: Optional[dict] = None):
        super().__init__(message)
        self.details = details or {}


class Context:
    """What a check runs against: ``device`` index, ``quick`` (small sizes), ``simulated``."""

    def __init__(self, device: int = 0, quick: bool = False):
        import accel
        from . import _lazy
        self.device = device
        self.quick = quick
        self.backend = _lazy.backend()
        self.simulated = bool(getattr(self.backend, "simulated", False))
        if device >= accel.device_count():
            raise CheckFailed(f"device {device} does not exist: {accel.device_count()} visible")

    @property
    def max_bytes(self) -> int:
        """Largest single transfer or buffer a check should use."""
        if self.quick:
            return MiB
        return 16 * MiB if self.simulated else GiB


def _expect(cond: bool, message: str, details: dict) -> None:
    if not cond:
        raise CheckFailed(message, details)


def _pattern(nbytes: int):
    """``nbytes`` of non-repeating-looking bytes, fast for 1 GiB (no RNG)."""
    import numpy as np
    words = np.arange((nbytes + 3) // 4, dtype=np.uint32)
    words *= np.uint32(2654435761)      # Knuth's multiplicative hash: every byte lane varies
    words ^= words >> np.uint32(13)
    return words.view(np.uint8)[:nbytes]


def _first_mismatch(got, want) -> Optional[int]:
    import numpy as np
    diff = np.flatnonzero(got != want)
    return int(diff[0]) if diff.size else None


def _host_available() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4 * GiB


# -- count and properties vs NVML --------------------------------------------------------
def _nvml_devices(backend) -> Optional[List[dict]]:
    """Every device NVML sees (uuid, name, total memory, compute capability), or None
    without NVML.  Uses the CUDA backend's NVML handle (opened for counting)."""
    opener = getattr(backend, "_nvml_lib", None)
    nvml = opener() if opener is not None else None
    if nvml is None:
        return None
    ffi, lib, _ = nvml
    count = ffi.new("unsigned int *")
    if lib.nvmlDeviceGetCount_v2(count) != 0:
        return None
    out = []
    handle = ffi.new("nvmlDevice_t *")
    buf = ffi.new("char[]", 96)
    mem = ffi.new("nvmlMemory_t *")
    major, minor = ffi.new("int *"), ffi.new("int *")
    for i in range(count[0]):
        info: Dict[str, object] = {"nvml_index": i}
        if lib.nvmlDeviceGetHandleByIndex_v2(i, handle) != 0:
            info["error"] = "nvmlDeviceGetHandleByIndex_v2 failed"
            out.append(info)
            continue
        if lib.nvmlDeviceGetUUID(handle[0], buf, 96) == 0:
            info["uuid"] = ffi.string(buf).decode()
        if lib.nvmlDeviceGetName(handle[0], buf, 96) == 0:
            info["name"] = ffi.string(buf).decode()
        if lib.nvmlDeviceGetMemoryInfo(handle[0], mem) == 0:
            info["total_memory"] = int(mem.total)
        if lib.nvmlDeviceGetCudaComputeCapability(handle[0], major, minor) == 0:
            info["compute_capability"] = (major[0], minor[0])
        out.append(info)
    return out


def check_devices(ctx: Context) -> dict:
    """device_count and every device's properties agree with NVML (CUDA) or are sane."""
    import accel
    n = accel.device_count()
    props = [accel.get_device_properties(i) for i in range(n)]
    free, total = accel.memory.get_memory_info(ctx.device)
    details: dict = {"backend": ctx.backend.name, "count": n, "devices": [
        {"index": p.index, "name": p.name, "uuid": None if p.uuid is None else str(p.uuid), "total_memory": p.total_memory,
         "compute_capability": list(p.compute_capability), "multi_processor_count": p.multi_processor_count}
        for p in props], "mem_info": {"free": free, "total": total}}
    _expect(n > 0, "no device counted", details)
    for p in props:
        # Metal reports no multiprocessor count (0); CUDA and Level Zero do
        _expect(bool(p.name) and p.total_memory > 0 and p.multi_processor_count >= 0,
                f"device {p.index} has empty properties (name {p.name!r}, total_memory {p.total_memory})",
                details)
        if ctx.backend.name != "mps":
            _expect(p.multi_processor_count > 0, f"device {p.index} reports no multiprocessors", details)
    mine = props[ctx.device]
    _expect(0 < free <= total and abs(total - mine.total_memory) <= total // 10,
            "get_memory_info disagrees with the device's total memory", details)
    if ctx.backend.name != "cuda":
        details["nvml"] = "not a CUDA backend: properties checked for sanity only"
        return details
    nv = _nvml_devices(ctx.backend)
    _expect(nv is not None, "NVML is not available, so the count cannot be cross-checked "
            "(a machine with an NVIDIA driver has libnvidia-ml.so.1)", details)
    details["nvml"] = nv
    by_uuid = {d.get("uuid"): d for d in nv}
    if os.environ.get("CUDA_VISIBLE_DEVICES") is None:
        _expect(n == len(nv), f"device_count() {n} != NVML's {len(nv)} with CUDA_VISIBLE_DEVICES unset",
                details)
    else:
        _expect(n <= len(nv), f"device_count() {n} > NVML's {len(nv)}", details)
    problems = []
    for p in props:
        d = by_uuid.get(f"GPU-{p.uuid}")    # NVML gives nvidia-smi's form; props.uuid is a uuid.UUID
        if d is None:
            problems.append(f"device {p.index} uuid GPU-{p.uuid} is not among NVML's")
            continue
        if d.get("name") != p.name:
            problems.append(f"device {p.index} name {p.name!r} != NVML {d.get('name')!r}")
        nv_total = d.get("total_memory", 0)
        # the runtime reports less than NVML: the driver reserves some memory
        if not 0.85 * nv_total <= p.total_memory <= 1.01 * nv_total:
            problems.append(f"device {p.index} total_memory {p.total_memory} vs NVML {nv_total}")
        if "compute_capability" in d and tuple(d["compute_capability"]) != tuple(p.compute_capability):
            problems.append(f"device {p.index} compute capability {p.compute_capability} "
                            f"vs NVML {d['compute_capability']}")
    _expect(not problems, "; ".join(problems), details)
    return details


# -- alloc/copy round trips ----------------------------------------------------------------------
def check_alloc_copy(ctx: Context) -> dict:
    """Host->device, device->device, device->host (pageable and pinned staging) for
    1 B .. 1 GiB in powers of 4 (capped by free memory), plus a few odd sizes."""
    import accel
    free, _ = accel.memory.get_memory_info(ctx.device)
    cap = min(ctx.max_bytes, free // 4, _host_available() // 4)
    sizes = [4 ** k for k in range(16) if 4 ** k <= cap] + [3, 4097, 1_000_003]
    sizes = sorted(s for s in set(sizes) if s <= cap)
    rows = []
    s = accel.Stream(ctx.device)
    for size in sizes:
        host = _pattern(size)
        t0 = time.perf_counter()
        a = accel.Buffer(size, stream=s).copy_from(host, stream=s)
        t1 = time.perf_counter()
        b = accel.Buffer(size, stream=s).copy_from(a, stream=s)
        t2 = time.perf_counter()
        out = b.to_numpy(stream=s)
        t3 = time.perf_counter()
        c = accel.Buffer(size, stream=s).copy_from(host, stream=s, non_blocking=True)
        s.synchronize()
        pinned = c.to_numpy(stream=s)
        row = {"bytes": size}
        if size >= 16 * MiB:
            row.update(h2d_gbps=round(size / (t1 - t0) / 1e9, 2), d2d_gbps=round(2 * size / (t2 - t1) / 1e9, 2),
                       d2h_gbps=round(size / (t3 - t2) / 1e9, 2))
        rows.append(row)
        for what, got in (("pageable round trip", out), ("pinned staging copy", pinned)):
            bad = _first_mismatch(got, host)
            _expect(bad is None, f"{what} of {size} bytes differs at byte {bad}",
                    {"sizes": rows, "cap_bytes": cap})
        for buf in (a, b, c):
            buf.close()
        del host, out, pinned
    s.close()
    return {"sizes": rows, "largest": sizes[-1], "cap_bytes": cap}


# -- stream/event ordering -------------------------------------------------------------------------
def check_stream_event_order(ctx: Context) -> dict:
    """Work on one stream waits for another's through an event and through wait_stream;
    timing events measure a positive interval; query() turns True after synchronize."""
    import accel
    nbytes = min(64 * MiB, ctx.max_bytes)
    s1, s2 = accel.Stream(ctx.device), accel.Stream(ctx.device)
    a, b = accel.Buffer(nbytes, stream=s1), accel.Buffer(nbytes, stream=s2)
    details: dict = {"bytes": nbytes, "rounds": []}
    for rnd in range(5):
        b.fill_(0, s2)
        s2.synchronize()
        for v in range(1, 9):           # a long chain on s1, so s2 would overtake without the wait
            a.fill_((rnd * 8 + v) & 0xFF, s1)
        want = (rnd * 8 + 8) & 0xFF
        if rnd % 2 == 0:
            e = accel.Event()
            e.record(s1)
            s2.wait_event(e)
            how = "wait_event"
        else:
            s2.wait_stream(s1)
            how = "wait_stream"
        b.copy_from(a, stream=s2, non_blocking=True)
        s2.synchronize()
        got = b.to_numpy(stream=s2)
        ok = bool((got == want).all())
        details["rounds"].append({"via": how, "ok": ok})
        _expect(ok, f"copy on s2 after {how} saw {int(got[0])} (and {int((got != want).sum())} wrong "
                f"bytes), expected {want}: stream ordering broken", details)
    start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    start.record(s1)
    for v in range(8):
        a.fill_(v, s1)
    end.record(s1)
    end.synchronize()
    ms = start.elapsed_time(end)
    details["elapsed_ms_8_fills"] = ms
    _expect(ms >= 0, f"elapsed_time {ms} < 0", details)
    s1.synchronize()
    _expect(s1.query() and end.query(), "query() is False after synchronize()", details)
    for x in (a, b):
        x.close()
    s1.close()
    s2.close()
    return details


# -- graphs -------------------------------------------------------------------------------------------
def check_graph_capture_replay(ctx: Context) -> dict:
    """A captured sequence of fills and copies replays with the eager effect, many times;
    a captured Philox fill draws fresh numbers on every replay (graph-safe RNG)."""
    import numpy as np

    import accel
    import accel.random as R
    from accel.random import philox
    if not ctx.backend.supports_graphs:
        return {"skipped": f"{ctx.backend.name} has no stream capture"}
    n = 4096
    s = accel.Stream(ctx.device)
    a, b = accel.Buffer(n, stream=s), accel.Buffer(n, stream=s)

    def program(x, y):
        x.fill_(1, s)
        y.copy_from(x, s, non_blocking=True)
        x.fill_(2, s)

    a.fill_(0, s)
    b.fill_(0, s)
    s.synchronize()
    g = accel.Graph()
    with s, g:
        program(a, b)
    s.synchronize()
    details: dict = {}
    _expect(not a.to_numpy(stream=s).any() and not b.to_numpy(stream=s).any(),
            "capture executed the work instead of recording it", details)
    ea, eb = accel.Buffer(n, stream=s), accel.Buffer(n, stream=s)
    program(ea, eb)
    want_a, want_b = ea.to_numpy(stream=s), eb.to_numpy(stream=s)
    replays = 5 if ctx.quick else 50
    for i in range(replays):
        a.fill_(9, s)
        b.fill_(9, s)
        with s:
            g.replay()
        s.synchronize()
        _expect(np.array_equal(a.to_numpy(stream=s), want_a) and np.array_equal(b.to_numpy(stream=s), want_b),
                f"replay {i} differs from eager execution", details)
    details["replays"] = replays

    # graph-safe RNG: every replay draws the words at the generator's offset then
    from accel.random import _device
    fns = _device.kernel_functions(ctx.backend, ctx.device) or {}
    if "accel_philox_raw_u32" not in fns:
        details["rng_replays"] = f"skipped: {ctx.backend.name} has no Philox kernel to capture"
        for x in (a, b, ea, eb):
            x.close()
        g.reset()
        s.close()
        return details
    R.manual_seed(SEED)
    gen = R.default_generator(ctx.device)
    r = accel.Buffer(4 * 1024, stream=s)
    rg = accel.Graph()
    with s, rg:
        R.random_raw_(r)
    seen = []
    for i in range(4):
        offset = gen.offset
        with s:
            rg.replay()
        s.synchronize()
        got = r.to_numpy("uint32", stream=s)
        want = philox.raw_words(gen.initial_seed(), offset, 1024)
        _expect(np.array_equal(got, want), f"captured random_raw_ replay {i} at offset {offset} is not the "
                f"host Philox stream", details)
        seen.append(int(got[0]))
    _expect(len(set(seen)) == len(seen), "graph replays repeated the same random numbers", details)
    details["rng_replays"] = len(seen)
    for x in (a, b, ea, eb, r):
        x.close()
    g.reset()
    rg.reset()
    s.close()
    return details


# -- two or more devices ------------------------------------------------------------------------------------
class _Steps:
    """Runs named steps, recording each as "ok" or its error, so one broken step does not hide
    the others; also checks that no step changed the current device."""

    def __init__(self, current: int):
        self.current = current
        self.results: Dict[str, str] = {}

    def run(self, name: str, fn: Callable[[], Optional[str]]) -> None:
        import accel
        try:
            problem = fn()
            now = accel.current_device_index()
            if problem is None and now != self.current:
                problem = f"changed the current device from {self.current} to {now}"
        except Exception as exc:  # noqa: BLE001 - reported per step
            problem = f"{type(exc).__name__}: {exc}"
            try:
                accel.set_device_index(self.current)
            except Exception:  # noqa: BLE001 - a sticky device error; the next steps report it
                pass
        self.results[name] = problem or "ok"

    @property
    def failed(self) -> List[str]:
        return [name for name, result in self.results.items() if result != "ok"]


def check_multi_device(ctx: Context) -> dict:
    """With 2+ devices: streams, events, fills, copies, RNG fills and graph replay on another
    device while this one is current; copies between the devices; pinned copies to both in turn."""
    import numpy as np

    import accel
    n = accel.device_count()
    if n < 2:
        return {"skipped": f"needs 2 or more devices: {n} visible"}
    here = ctx.device
    other = 1 if here == 0 else 0
    accel.set_device_index(here)
    nbytes = min(16 * MiB, ctx.max_bytes)
    host = _pattern(nbytes)
    steps = _Steps(here)
    details: dict = {"devices": n, "current": here, "other": other, "bytes": nbytes, "steps": steps.results}

    def same(buf, want, stream=None) -> Optional[str]:
        got = buf.to_numpy(stream=stream)
        bad = _first_mismatch(got, want)
        return None if bad is None else f"{buf.device} differs at byte {bad}: {int(got[bad])} != {int(want[bad])}"

    def streams_and_events():
        s1, s2 = accel.Stream(other), accel.Stream(other)
        a, b = accel.Buffer(nbytes, stream=s1), accel.Buffer(nbytes, stream=s2)
        try:
            b.fill_(0, s2)
            for v in range(1, 9):            # a chain s2 would overtake without the wait
                a.fill_(v, s1)
            e = accel.Event()
            e.record(s1)
            s2.wait_event(e)
            b.copy_from(a, stream=s2, non_blocking=True)
            problem = same(b, np.full(nbytes, 8, np.uint8), s2)
            e.synchronize()
            if problem is None and not e.query():
                problem = "event not complete after synchronize()"
            a.copy_from(host, stream=s1)
            s2.wait_stream(s1)
            b.copy_from(a, stream=s2)
            return problem or same(b, host, s2)
        finally:
            a.close()
            b.close()
            s1.close()
            s2.close()

    def default_stream_of_other():
        d = accel.default_stream(other)
        buf = accel.Buffer(nbytes, other)
        try:
            for v in range(1, 4):
                buf.fill_(v, d)
            e = accel.Event()
            e.record(d)
            e.synchronize()
            d.synchronize()
            if not d.query():
                return "default stream of the other device not idle after synchronize()"
            return same(buf, np.full(nbytes, 3, np.uint8), d)
        finally:
            buf.close()

    def cross_device_copy():
        s0, s1 = accel.Stream(here), accel.Stream(other)
        a, b = accel.Buffer(nbytes, stream=s0), accel.Buffer(nbytes, stream=s1)
        try:
            a.copy_from(host, stream=s0)
            b.fill_(0, s1)                                # not what an earlier step left there
            b.copy_from(a, stream=s1)                     # here -> other
            problem = same(b, host, s1)
            if problem:
                return f"{here} -> {other}: {problem}"
            a.fill_(0, s0)
            s0.synchronize()
            a.copy_from(b, stream=s0)                     # other -> here
            problem = same(a, host, s0)
            if problem:
                return f"{other} -> {here}: {problem}"
            for v in range(1, 5):
                a.fill_(v, s0)
            e = accel.Event()
            e.record(s0)
            s1.wait_event(e)
            b.copy_from(a, stream=s1, non_blocking=True)  # ordered by an event of the source device
            problem = same(b, np.full(nbytes, 4, np.uint8), s1)
            s0.synchronize()
            return f"non_blocking {here} -> {other} after wait_event: {problem}" if problem else None
        finally:
            a.close()
            b.close()
            s0.close()
            s1.close()

    def pinned_to_both():
        for dev in (here, other, here, other):        # one at a time: a staging block is reused at once
            with accel.Buffer(nbytes, dev) as buf:
                problem = same(buf.copy_from(host, non_blocking=True), host)
            if problem:
                return f"pinned copy, one at a time: {problem}"
        bufs = []                                     # and all in flight
        try:
            for i, dev in enumerate((here, other, here, other)):
                src = _pattern(nbytes + i)[i:]
                bufs.append((accel.Buffer(nbytes, dev).copy_from(src, non_blocking=True), src.copy()))
                src[:] = 0                                # staged: the source may be reused at once
            for buf, want in bufs:
                problem = same(buf, want)
                if problem:
                    return f"pinned copy: {problem}"
            return None
        finally:
            for buf, _ in bufs:
                buf.close()

    def rng_on_other():
        import accel.random as R
        from accel.random import philox
        R.manual_seed_all(SEED)
        gen = R.default_generator(other)
        words = 1 << 16
        buf = accel.Buffer(4 * words, other)
        try:
            offset = gen.offset
            R.random_raw_(buf)
            got = buf.to_numpy("uint32")
            want = philox.raw_words(gen.initial_seed(), offset, words)
            bad = _first_mismatch(got, want)
            return None if bad is None else f"random_raw_ on device {other} differs from the host at word {bad}"
        finally:
            buf.close()

    def graph_on_other():
        if not ctx.backend.supports_graphs:
            return None
        s = accel.Stream(other)
        a, b = accel.Buffer(4096, stream=s), accel.Buffer(4096, stream=s)
        g = accel.Graph()
        try:
            a.fill_(0, s)
            b.fill_(0, s)
            with s, g:                                # capture needs the stream's device current
                a.fill_(1, s)
                b.copy_from(a, s, non_blocking=True)
                a.fill_(2, s)
            accel.set_device_index(here)
            accel.set_stream(s)                       # the other device's current stream ...
            accel.set_device_index(here)              # ... while this one is current
            for i in range(3):
                a.fill_(9, s)
                b.fill_(9, s)
                g.replay()
                if accel.current_device_index() != here:
                    return "Graph.replay changed the current device"
                got_a, got_b = a.to_numpy(stream=s), b.to_numpy(stream=s)
                if not ((got_a == 2).all() and (got_b == 1).all()):
                    return f"replay {i} on device {other}: a={int(got_a[0])} b={int(got_b[0])}, expected 2 and 1"
            return None
        finally:
            accel.set_stream(accel.default_stream(other))
            accel.set_device_index(here)
            g.reset()
            a.close()
            b.close()
            s.close()

    def memory_stats_per_device():
        before_here = accel.memory.memory_allocated(here)
        before_other = accel.memory.memory_allocated(other)
        buf = accel.Buffer(MiB, other)
        try:
            grew = accel.memory.memory_allocated(other) - before_other
            if grew != MiB or accel.memory.memory_allocated(here) != before_here:
                return (f"a 1 MiB buffer on device {other} changed memory_allocated by {grew} there and "
                        f"{accel.memory.memory_allocated(here) - before_here} on device {here}")
            return None
        finally:
            buf.close()

    for name, fn in (("streams_events_on_other", streams_and_events),
                     ("default_stream_of_other", default_stream_of_other),
                     ("cross_device_copy", cross_device_copy),
                     ("pinned_copies_to_both", pinned_to_both),
                     ("rng_fill_on_other", rng_on_other),
                     ("graph_replay_on_other", graph_on_other),
                     ("memory_stats_per_device", memory_stats_per_device)):
        steps.run(name, fn)
    if not ctx.backend.supports_graphs:
        steps.results["graph_replay_on_other"] = f"not run: {ctx.backend.no_capture_reason}"
    failed = [f for f in steps.failed if not steps.results[f].startswith("not run")]
    # A device fault is sticky (CUDA: every later call returns it), so the first failing step is
    # the one to read; the later ones may only repeat its error.
    _expect(not failed, "multi-device: " + "; ".join(f"{name}: {steps.results[name]}" for name in failed), details)
    return details


# -- Philox kernel vs host path ------------------------------------------------------------------------
def _rng_cases():
    import accel.random as R
    from accel.random import _fills
    return {
        "raw_u32": (lambda b: R.random_raw_(b), lambda nb: _fills.plan_raw(nb), "uint32"),
        "uniform_f32": (lambda b: R.uniform_(b, "float32", -2.0, 3.0),
                        lambda nb: _fills.plan_uniform(nb, "float32", -2.0, 3.0), "float32"),
        "uniform_f64": (lambda b: R.uniform_(b, "float64"), lambda nb: _fills.plan_uniform(nb, "float64", 0.0, 1.0),
                        "float64"),
        "normal_f32": (lambda b: R.normal_(b, 1.0, 2.0, "float32"),
                       lambda nb: _fills.plan_normal(nb, "float32", 1.0, 2.0), "float32"),
        "normal_f64": (lambda b: R.normal_(b, 0.0, 1.0, "float64"),
                       lambda nb: _fills.plan_normal(nb, "float64", 0.0, 1.0), "float64"),
        "randint_i32": (lambda b: R.randint_(b, -7, 1000, "int32"),
                        lambda nb: _fills.plan_randint(nb, "int32", -7, 1000), "int32"),
        "randint_i64": (lambda b: R.randint_(b, 0, 10, "int64"),
                        lambda nb: _fills.plan_randint(nb, "int64", 0, 10), "int64"),
        "randint_i32_wide": (lambda b: R.randint_(b, -(2 ** 31), 2 ** 31 - 1, "int32"),
                             lambda nb: _fills.plan_randint(nb, "int32", -(2 ** 31), 2 ** 31 - 1), "int32"),
        "randint_i64_wide": (lambda b: R.randint_(b, -(2 ** 62), 2 ** 62, "int64"),
                             lambda nb: _fills.plan_randint(nb, "int64", -(2 ** 62), 2 ** 62), "int64"),
    }


def check_philox_kernel(ctx: Context) -> dict:
    """Every accel.random fill on the device is bit-equal to the host path for the same
    (seed, offset, n); raw words equal accel.random.philox directly."""
    import numpy as np

    import accel
    import accel.random as R
    from accel import _lazy
    from accel.random import _device, philox
    be = _lazy.lazy_init()
    details: dict = {"kernel_language": be.kernel_language}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fns = _device.kernel_functions(be, ctx.device)
    details["warnings"] = [str(w.message) for w in caught]
    if be.kernel_language in _device._SOURCES:     # a backend accel ships Philox kernels for
        _expect(bool(fns), f"the Philox {be.kernel_language} kernels did not load on {be.name}:{ctx.device}; "
                "fills would silently use the host path", details)
        details["kernels"] = sorted(fns)
    else:
        details["kernels"] = "none: this backend fills on the host and copies"
    counts = [1, 3, 6, 1027, 4 * 1024 * 256 + 37]       # tails of every shape, many grid-stride passes
    if not ctx.quick and not ctx.simulated:
        counts.append(16 * MiB + 5)
    if ctx.quick:
        counts = counts[:4]
    R.manual_seed(SEED)
    gen = R.default_generator(ctx.device)
    mismatches = {}
    # The kernels store 16 bytes at a time where the buffer is 16-byte aligned and one element
    # at a time elsewhere: a view one element into a buffer (as a DLPack import of a slice
    # may be) takes the second path.
    misaligned_counts = counts[1:4]
    with accel.device_index(ctx.device):
        for kind, (fill, plan_for, dtype) in _rng_cases().items():
            itemsize = np.dtype(dtype).itemsize
            for n, skew in [(n, 0) for n in counts] + [(n, itemsize) for n in misaligned_counts]:
                nbytes = n * itemsize
                base = accel.Buffer(nbytes + skew, ctx.device)
                buf = accel.Buffer.from_ptr(base.ptr + skew, nbytes, ctx.device, owner=base) if skew else base
                offset = gen.offset
                fill(buf)
                got = buf.to_numpy(dtype)
                want = plan_for(nbytes).host(gen.initial_seed(), offset)
                refs = [("", want)]
                if kind == "raw_u32":     # and the Philox stream itself, not only the fill plan
                    refs.append((" vs philox.raw_words", philox.raw_words(gen.initial_seed(), offset, n)))
                where = f"{kind}[n={n}" + (f", {skew} bytes into a buffer]" if skew else "]")
                for label, ref in refs:
                    bad = np.flatnonzero(got.view(np.uint8) != ref.view(np.uint8))
                    if bad.size:
                        i = int(bad[0]) // got.itemsize
                        mismatches[where + label] = {
                            "bytes_differing": int(bad.size), "first_element": i,
                            "device": repr(got[i]), "host": repr(ref[i])}
                if skew:
                    buf.close()
                base.close()
    details["cases"] = len(_rng_cases()) * (len(counts) + len(misaligned_counts))
    details["counts"] = counts
    details["mismatches"] = mismatches
    _expect(not mismatches, f"device fills differ from the host path: {', '.join(mismatches)}", details)
    return details


# -- a user kernel: NVRTC -> Module -> launch (issue 18) -------------------------------------------------
_SAXPY = "accel_selftest_saxpy"
_SAXPY_CU = r"""
extern "C" __global__ void accel_selftest_saxpy(float a, const float *x, float *y, unsigned long long n)
{
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        y[i] = a * x[i] + y[i];
}
"""


def _saxpy_reference(grid, block, view, a, x, y, n):
    """saxpy in numpy, run by the simulator in a dry run."""
    import numpy as np
    n = min(n, grid[0] * block[0])
    ys = view(y, 4 * n, np.float32)
    ys[:] = np.float32(a) * view(x, 4 * n, np.float32) + ys


def check_user_kernel(ctx: Context) -> dict:
    """SAXPY in CUDA C through accel.compile (NVRTC), Module and launch equals numpy bit for bit.

    Skipped, with the reason, without NVRTC or on a backend other than CUDA.  In a dry run
    (``--allow-sim``) the launch runs the registered Python reference, and the details say
    ``ran_on: simulator``, never a device."""
    import accel
    if ctx.backend.name != "cuda":
        return {"skipped": f"accel.compile makes PTX for CUDA; this is {ctx.backend.name}"}
    from .backends.cuda import nvrtc as _nvrtc
    why = _nvrtc.missing()
    if why:
        return {"skipped": f"NVRTC is not available: {why}"}
    # In a dry run the simulator runs this reference; on a device the kernel runs for real and the
    # reference is not consulted (nothing registered), so the device is what numpy is checked against.
    details: dict = {"ran_on": "simulator (dry run: the registered Python reference ran)" if ctx.simulated
                     else f"device {ctx.device}"}
    if ctx.simulated:
        import accel.sim
        accel.sim.register_kernel(_SAXPY, _saxpy_reference, "f32, ptr, ptr, u64", replace=True)
    try:
        with accel.device_index(ctx.device):
            _run_saxpy(ctx, details)
    finally:
        if ctx.simulated:
            accel.sim.unregister_kernel(_SAXPY)
    return details


def _run_saxpy(ctx: Context, details: dict) -> None:
    import numpy as np

    import accel
    # --fmad=false: a*x rounded, then + y rounded, exactly numpy's two float32 operations
    program = accel.compile(_SAXPY_CU, name="selftest_saxpy.cu", options=("--fmad=false",))
    details.update(arch=program.arch, entries=list(program.entries), ptx_bytes=len(program.ptx))
    n = 1000 if ctx.quick else (1 << 22) + 3
    rng = np.random.default_rng(18)
    x = rng.standard_normal(n, dtype=np.float32)
    y = rng.standard_normal(n, dtype=np.float32)
    a = np.float32(-1.75)
    module = accel.Module(program.ptx)
    dx = dy = None
    try:
        kernel = module.function(_SAXPY)
        dx = accel.Buffer(x.nbytes).copy_from(x)
        dy = accel.Buffer(y.nbytes).copy_from(y)
        block = 256
        accel.launch(kernel, (n + block - 1) // block, block, a, dx, dy, n)
        got = dy.to_numpy(np.float32)
    finally:
        for b in (dx, dy):
            if b is not None:
                b.close()
        module.close()
    want = a * x + y
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    details.update(n=n, block=block, mismatches=int(bad.size))
    if bad.size:
        i = int(bad[0])
        details.update(first_mismatch=i, device=repr(got[i]), numpy=repr(want[i]))
    _expect(not bad.size, f"saxpy differs from numpy in {bad.size} of {n} elements", details)


# -- OOM recovery ------------------------------------------------------------------------------------------
def check_oom_recovery(ctx: Context) -> dict:
    """Allocate until OutOfMemoryError, free everything, and allocate again."""
    import accel
    free0, total = accel.memory.get_memory_info(ctx.device)
    chunk = max(64 * MiB, (total // 32) // (2 * MiB) * (2 * MiB))
    details: dict = {"total": total, "free_before": free0, "chunk": chunk}
    bufs = []
    error = None
    limit = total // chunk + 64
    try:
        for _ in range(limit):
            bufs.append(accel.Buffer(chunk, ctx.device))
    except accel.OutOfMemoryError as exc:
        error = exc
    details["allocated_chunks"] = len(bufs)
    _expect(error is not None, f"no OutOfMemoryError after {len(bufs)} chunks of {chunk} bytes", details)
    message = str(error)
    details["message"] = message
    stats = accel.memory.memory_stats(ctx.device)
    details["num_ooms"] = stats.get("num_ooms")
    details["num_alloc_retries"] = stats.get("num_alloc_retries")
    _expect(stats.get("num_ooms", 0) >= 1, "memory_stats()['num_ooms'] did not count the OOM", details)
    _expect("ACCEL_ALLOC_CONF" in message, "the OOM message lacks the ACCEL_ALLOC_CONF hint", details)
    for b in bufs:
        b.close()
    bufs.clear()
    accel.memory.empty_cache()
    free1, _ = accel.memory.get_memory_info(ctx.device)
    details["free_after_empty_cache"] = free1
    details["reserved_after_empty_cache"] = accel.memory.memory_reserved(ctx.device)
    _expect(details["reserved_after_empty_cache"] == 0, "memory stays reserved after freeing everything "
            "and empty_cache()", details)
    _expect(free1 >= free0 - total // 50, "device memory did not come back after empty_cache()", details)
    again = accel.Buffer(max(chunk, free1 // 2 // (2 * MiB) * (2 * MiB)), ctx.device)
    again.fill_(0x5A)
    tail = accel.Buffer(16, ctx.device, stream=again.stream)
    from . import _lazy
    # read back only the last bytes: the buffer may be far larger than host memory
    _lazy.lazy_init().memcpy_async(tail.ptr, again.ptr + again.nbytes - 16, 16, again.stream.handle)
    _expect(bytes(tail.to_numpy()) == bytes([0x5A] * 16), "memory allocated after the OOM is not usable",
            details)
    details["allocated_again"] = again.nbytes
    again.close()
    tail.close()
    return details


def check_vmm(ctx: Context) -> dict:
    """Virtual memory (the allocator's expandable segments): reserve, create two handles, map them
    side by side with access, copy a pattern across the seam and back, unmap one and map it
    elsewhere (contents kept), release, free; device memory comes back.  With 2+ devices, a handle
    of the other device is mapped and granted to this one, and copied from on this device's stream.
    Skipped where the backend or the device has no virtual memory."""
    import numpy as np
    from . import _lazy
    b = _lazy.lazy_init()        # the vmm_* methods are used directly: initialize as the API would
    d = ctx.device
    if not b.supports_vmm or not b.vmm_supported(d):
        return {"skipped": f"{b.name} device {d} has no virtual memory management"}
    g = b.vmm_granularity(d)
    details: dict = {"granularity": g}
    prev = b.get_device()
    b.set_device(d)
    s = b.stream_create()
    va = b.vmm_reserve(d, 8 * g)
    handles, maps = [], []
    try:
        free0 = b.mem_info()[0]
        h1 = b.vmm_create(d, g)
        handles.append(h1)
        h2 = b.vmm_create(d, 2 * g)
        handles.append(h2)
        details["free_drop"] = free0 - b.mem_info()[0]
        b.vmm_map(va, g, h1, d)
        maps.append((va, g))
        b.vmm_map(va + g, 2 * g, h2, d)
        maps.append((va + g, 2 * g))
        n = min(g, 1 << 20)
        pattern = np.frombuffer(_pattern(n), dtype=np.uint8).copy()
        out = np.zeros_like(pattern)
        b.memcpy_async(va + g - n // 2, pattern.ctypes.data, n, s)      # across the two handles
        b.memcpy_async(out.ctypes.data, va + g - n // 2, n, s)
        b.stream_synchronize(s)
        _expect(_first_mismatch(out, pattern) is None, "a copy across two mapped handles came back different",
                details)
        b.stream_synchronize(s)              # unmap does not wait for queued work
        b.vmm_unmap(va, g)
        maps.remove((va, g))
        b.vmm_map(va + 4 * g, g, h1, d)      # the same physical memory elsewhere
        maps.append((va + 4 * g, g))
        out[:] = 0
        b.memcpy_async(out.ctypes.data, va + 5 * g - n // 2, n // 2, s)
        b.stream_synchronize(s)
        _expect(_first_mismatch(out[:n // 2], pattern[:n // 2]) is None,
                "a handle mapped again elsewhere lost its contents", details)
        if b.count() > 1:
            other = 1 if d == 0 else 0
            # memory of another device is reachable here only through peer access (cuMemSetAccess
            # refuses a device that cudaDeviceCanAccessPeer says cannot reach it)
            if b.vmm_supported(other) and b.can_access_peer(d, other):
                h3 = b.vmm_create(other, g)
                handles.append(h3)
                b.vmm_map(va + 6 * g, g, h3, other)
                maps.append((va + 6 * g, g))
                b.vmm_set_access(va + 6 * g, g, d)
                b.memcpy_async(va + 6 * g, pattern.ctypes.data, n, s)
                b.memcpy_async(out.ctypes.data, va + 6 * g, n, s)
                b.stream_synchronize(s)
                _expect(_first_mismatch(out, pattern) is None,
                        f"memory of device {other} mapped with access for device {d} copied wrong", details)
                details["peer_device"] = other
    finally:
        b.stream_synchronize(s)
        for base, size in maps:
            b.vmm_unmap(base, size)
        for h in handles:
            b.vmm_release(h)
        b.vmm_free(va, 8 * g)
        b.stream_destroy(s)
        free1 = b.mem_info()[0]
        b.set_device(prev)
    details["free_back"] = free1 >= free0 - g
    _expect(details["free_back"], "device memory did not come back after release", details)
    return details


# -- fork rules -----------------------------------------------------------------------------------------------
def _in_child(fn: Callable[[], str], timeout: float = 60.0) -> Tuple[str, str]:
    """Run ``fn`` in a forked child; ("ok"|"failed"|"hung", message)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:     # child: never return into the caller's stack
        code = 1
        try:
            os.close(r)
            msg = fn()
            code = 0
        except BaseException as exc:  # noqa: BLE001 - report anything to the parent
            msg = f"{type(exc).__name__}: {exc}"
        try:
            os.write(w, str(msg).encode(errors="replace")[:8000])
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + timeout
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        return "hung", f"child did not finish in {timeout:.0f} s"
    chunks = []
    while True:
        data = os.read(r, 65536)
        if not data:
            break
        chunks.append(data)
    os.close(r)
    text = b"".join(chunks).decode(errors="replace")
    return ("ok" if os.waitstatus_to_exitcode(status) == 0 else "failed"), text


def _child_uses_device() -> str:
    import accel
    b = accel.Buffer(64)
    b.fill_(3)
    if not (b.to_numpy() == 3).all():
        raise AssertionError("child's buffer does not hold what it wrote")
    return "child initialized and used the device"


def _child_expects_fork_error() -> str:
    import accel
    try:
        accel.Buffer(64)
    except RuntimeError as exc:
        if "forked subprocess" in str(exc) and "spawn" in str(exc):
            return str(exc)
        raise
    raise AssertionError("a child forked after initialization used the device without an error")


def _spawn_child(device: int) -> int:
    import accel
    b = accel.Buffer(64, device)
    b.fill_(5)
    return int(b.to_numpy().sum())


def check_fork_rules(ctx: Context) -> dict:
    """Fork before init: the child initializes and works.  Fork after init: the child gets
    the clear 'Cannot re-initialize ... forked subprocess' error, never a hang.  A 'spawn'
    child after init works."""
    import multiprocessing

    import accel
    from accel import _lazy
    details: dict = {}
    accel.is_available()
    accel.device_count()
    _expect(not _lazy.is_initialized(), "the runtime was initialized before the check started", details)
    status, text = _in_child(_child_uses_device)
    details["fork_before_init"] = {"status": status, "message": text}
    _expect(status == "ok", f"child forked before init could not use the device: {text}", details)
    b = accel.Buffer(64, ctx.device)         # initializes the runtime here
    b.fill_(1)
    _expect(_lazy.is_initialized(), "allocating did not initialize the runtime", details)
    status, text = _in_child(_child_expects_fork_error)
    details["fork_after_init"] = {"status": status, "message": text}
    _expect(status == "ok", f"child forked after init: {status}: {text}", details)
    mp = multiprocessing.get_context("spawn")
    with mp.Pool(1) as pool:
        total = pool.apply_async(_spawn_child, (ctx.device,)).get(timeout=120)
    details["spawn_after_init"] = {"sum": total}
    _expect(total == 5 * 64, f"spawned child read back {total}, expected {5 * 64}", details)
    _expect(bool((b.to_numpy() == 1).all()), "the parent's buffer changed after forking", details)
    b.close()
    return details


# -- benchmarks ----------------------------------------------------------------------------------------------
def bench_rng_bandwidth(ctx: Context) -> dict:
    """RNG fill GB/s on the device vs its memory bandwidth (device-to-device copy, memset)."""
    import accel
    from . import _selftest_bench
    free, _ = accel.memory.get_memory_info(ctx.device)
    nbytes = min(ctx.max_bytes, free // 4) // (4 * MiB) * (4 * MiB) or MiB
    with accel.device_index(ctx.device):
        return _selftest_bench.rng_vs_bandwidth(nbytes, reps=2 if ctx.quick else 5, rounds=2 if ctx.quick else 3,
                                                device=ctx.device)


def bench_alloc(ctx: Context) -> dict:
    """Cached 1 MiB alloc+free µs per pair vs the bare runtime allocate+free pair."""
    from .memory import _bench
    out = _bench.alloc_free_cost(MiB, n=2000 if ctx.quick else 20000, repeats=3 if ctx.quick else 5,
                                 device=ctx.device)
    out["target_cached_pair_us"] = 3.0
    out["meets_target"] = out["cached_pair_us"] <= 3.0
    return out


def bench_graph(ctx: Context) -> dict:
    """Host time per iteration: 100 small fills replayed from a graph vs issued eagerly."""
    import accel
    from . import _selftest_bench
    if not ctx.backend.supports_graphs:
        return {"skipped": f"{ctx.backend.name} has no stream capture"}
    with accel.device_index(ctx.device):
        return _selftest_bench.graph_vs_eager(100, rounds=3 if ctx.quick else 9,
                                              batch_s=0.01 if ctx.quick else 0.05, device=ctx.device)


def bench_allocator_traces(ctx: Context) -> dict:
    """The shared allocation traces replayed on the device: expandable vs classic segments (µs/op,
    the allocator's own µs/op, peak reserved / allocated, map calls), and one 2 MiB page's
    create+map+access / unmap+release cost in µs."""
    import time

    from . import _lazy
    from .memory import _bench, _config
    be = _lazy.lazy_init()
    out: dict = {}
    variants = {"classic": "expandable_segments:False"}
    if be.vmm_supported(ctx.device):
        variants["expandable"] = "expandable_segments:True"
    for path in _bench.default_traces():
        trace = _bench.load_trace(path)
        name = os.path.basename(path).rsplit(".", 1)[0]
        row = {}
        for label, conf in variants.items():
            got = _bench.replay(trace, _config.parse(conf, f"selftest {label}"), ctx.device, rounds=1 if ctx.quick else 3)
            row[label] = {k: round(got[k], 3) for k in ("ratio", "us_per_op", "allocator_us_per_op", "map_calls")
                          if k in got}
        if "expandable" in row and row["classic"].get("us_per_op"):
            row["expandable_over_classic_us"] = round(row["expandable"]["us_per_op"] / row["classic"]["us_per_op"], 3)
        out[name] = row
    if "expandable" in variants:
        gran = be.vmm_granularity(ctx.device)
        va = be.vmm_reserve(ctx.device, gran)
        n = 20 if ctx.quick else 200
        t_map = t_unmap = 0.0
        try:
            for _ in range(n):
                t0 = time.perf_counter()
                h = be.vmm_create(ctx.device, gran)
                be.vmm_map(va, gran, h, ctx.device)
                be.vmm_set_access(va, gran, ctx.device)
                t1 = time.perf_counter()
                be.vmm_unmap(va, gran)
                be.vmm_release(h)
                t_map += t1 - t0
                t_unmap += time.perf_counter() - t1
        finally:
            be.vmm_free(va, gran)
        out["page_create_map_access_us"] = round(t_map / n * 1e6, 2)
        out["page_unmap_release_us"] = round(t_unmap / n * 1e6, 2)
    return out


#: name -> (function, timeout in seconds).  Order matters only for reading the report.
CHECKS: Dict[str, Tuple[Callable[[Context], dict], float]] = {
    "devices": (check_devices, 60),
    "alloc_copy": (check_alloc_copy, 150),
    "stream_event_order": (check_stream_event_order, 60),
    "graph_capture_replay": (check_graph_capture_replay, 60),
    "multi_device": (check_multi_device, 90),
    "philox_kernel": (check_philox_kernel, 120),
    "user_kernel": (check_user_kernel, 90),
    "oom_recovery": (check_oom_recovery, 120),
    "vmm": (check_vmm, 60),
    "fork_rules": (check_fork_rules, 120),
    "interop_peers": (_selftest_peers.check_interop_peers, 90),
    "bench_rng_bandwidth": (bench_rng_bandwidth, 90),
    "bench_alloc": (bench_alloc, 60),
    "bench_graph": (bench_graph, 60),
    "bench_peers": (_selftest_peers.bench_peers, 120),
    "bench_allocator_traces": (bench_allocator_traces, 120),
}
