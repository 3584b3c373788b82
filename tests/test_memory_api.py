"""accel.memory's public API on the simulators: torch.accelerator.memory semantics,
no runtime initialization from queries, leaks, OOM injection, threads, the
host allocator, snapshots and the timeline viewer."""

import json
import os
import random
import subprocess
import sys
import time
from collections import OrderedDict

import pytest

import accel
from accel import _lazy, memory, sim
from accel._errors import OutOfMemoryError
from test_memory_fakes import hammer

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def runtime_initialized() -> bool:
    """Whether any simulated vendor runtime was initialized (NVML counting is allowed)."""
    state = vars(sim.state())
    return any(v for k, v in state.items() if k.endswith("runtime_initialized")) or _lazy.is_initialized()


class CountingBackend:
    """Counts the backend's live device allocations (works for every simulator)."""

    def __init__(self, monkeypatch, be):
        self.live = set()
        alloc, free = be.mem_alloc, be.mem_free

        def mem_alloc(nbytes):
            ptr = alloc(nbytes)
            self.live.add(ptr)
            return ptr

        def mem_free(ptr):
            free(ptr)
            self.live.remove(ptr)

        monkeypatch.setattr(be, "mem_alloc", mem_alloc)
        monkeypatch.setattr(be, "mem_free", mem_free)


def test_queries_before_init_do_not_initialize(sim_backend):
    assert memory.memory_stats() == OrderedDict()
    assert isinstance(memory.memory_stats(), OrderedDict)
    for fn in (memory.memory_allocated, memory.max_memory_allocated, memory.memory_reserved,
               memory.max_memory_reserved):
        assert fn() == 0
        assert fn(0) == 0
    memory.reset_peak_memory_stats()
    memory.reset_accumulated_memory_stats()
    memory.empty_cache()
    memory.empty_host_cache()
    assert "memory summary" in memory.memory_summary()
    assert memory.memory_snapshot() == []
    assert not runtime_initialized()
    free, total = memory.get_memory_info()        # this one initializes, as torch's
    assert 0 < free <= total
    assert _lazy.is_initialized()


def test_stats_keys_and_device_arguments(sim_backend):
    alloc = memory.device_allocator(0)
    ptr = alloc.malloc(3000, None)
    stats = memory.memory_stats()
    assert len(stats) == 123 and list(stats) == sorted(stats)
    assert stats["allocation.all.current"] == 1
    assert memory.memory_allocated() == 3072
    assert memory.memory_allocated(0) == memory.memory_allocated(f"{sim_backend}:0") \
        == memory.memory_allocated(accel.device(sim_backend, 0)) == 3072
    assert memory.max_memory_allocated() == 3072
    assert memory.memory_reserved() == memory.max_memory_reserved() == 2 * MiB
    alloc.free(ptr)
    memory.reset_peak_memory_stats()
    assert memory.max_memory_allocated() == 0
    memory.reset_accumulated_memory_stats(0)
    assert memory.memory_stats()["allocation.all.allocated"] == 0
    with pytest.raises(ValueError, match="out of range"):
        memory.memory_stats(99)
    with pytest.raises(ValueError, match="doesn't match the current accelerator"):
        memory.memory_allocated("cpu:0" if sim_backend != "cpu" else "cuda:0")
    with pytest.raises(TypeError):
        memory.device_allocator("0")


def test_no_leaked_segments_after_empty_cache(sim_backend, monkeypatch):
    # classic segments (mem_alloc); expandable ones: tests/test_memory_expandable.py
    monkeypatch.setenv("ACCEL_ALLOC_CONF", "expandable_segments:False")
    be = _lazy.lazy_init()
    counting = CountingBackend(monkeypatch, be)
    alloc = memory.device_allocator(0)
    stream = be.default_stream(0)
    rng = random.Random(7)
    live = []
    for _ in range(300):
        if live and rng.random() < 0.45:
            alloc.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(alloc.malloc(rng.choice([700, 64 * 1024, MiB, 3 * MiB + 5, 12 * MiB]), stream))
    assert counting.live
    for ptr in live:
        alloc.free(ptr)
    memory.empty_cache()
    assert counting.live == set()
    assert memory.memory_reserved() == 0
    if sim_backend == "cuda":
        assert sim.state().live_allocations == {}


def test_second_device_has_its_own_allocator(sim_cuda, monkeypatch):
    # classic segments (cudaMalloc); expandable ones: tests/test_memory_expandable.py
    monkeypatch.setenv("ACCEL_ALLOC_CONF", "expandable_segments:False")
    a0, a1 = memory.device_allocator(0), memory.device_allocator(1)
    assert a0 is memory.device_allocator(0) and a0 is not a1
    ptr = a1.malloc(MiB, 0)
    assert memory.memory_allocated(1) == MiB and memory.memory_allocated(0) == 0
    assert sim.state().live_allocations == {1: 1}
    assert _lazy.lazy_init().get_device() == 0, "the allocator restores the current device"
    a1.free(ptr)
    memory.empty_cache()
    assert sim.state().live_allocations == {}


def test_injected_oom_frees_cache_and_retries(sim_cuda, monkeypatch):
    # classic segments (cudaMalloc); expandable ones: tests/test_memory_expandable.py
    monkeypatch.setenv("ACCEL_ALLOC_CONF", "expandable_segments:False")
    alloc = memory.device_allocator(0)
    ptrs = [alloc.malloc(30 * MiB, 0) for _ in range(3)]
    for p in ptrs:
        alloc.free(p)
    sim.inject_oom()                              # the next cudaMalloc fails
    ptr = alloc.malloc(100 * MiB, 0)
    stats = memory.memory_stats()
    assert stats["num_alloc_retries"] == 1 and stats["num_ooms"] == 0
    assert stats["num_device_free"] >= 1
    alloc.free(ptr)
    sim.inject_oom(times=2)                       # fails again after the cache is freed
    with pytest.raises(accel.OutOfMemoryError, match="Tried to allocate 200.00 MiB.*ACCEL_ALLOC_CONF"):
        alloc.malloc(200 * MiB, 0)
    assert memory.memory_stats()["num_ooms"] == 1


def test_oom_on_a_small_device(sim_cuda, monkeypatch):
    monkeypatch.setenv("ACCEL_SIM_MEMORY", "64M")
    _lazy._reset_for_tests()
    alloc = memory.device_allocator(0)
    keep = alloc.malloc(40 * MiB, 0)
    with pytest.raises(OutOfMemoryError) as info:
        alloc.malloc(40 * MiB, 0)
    assert "total capacity of 64.00 MiB" in str(info.value)
    assert isinstance(info.value, accel.AcceleratorError)
    alloc.free(keep)
    alloc.free(alloc.malloc(40 * MiB, 0))


def test_threads_on_the_simulator(sim_backend):
    stream = _lazy.lazy_init().default_stream(0)
    assert hammer(memory.device_allocator(0), [512, 5000, MiB, 5 * MiB], lambda seed: stream, 400) == []
    assert memory.memory_allocated() == 0
    memory.empty_cache()
    assert memory.memory_reserved() == 0


def test_summary_table(sim_cuda):
    alloc = memory.device_allocator(0)
    ptr = alloc.malloc(5 * MiB, 0)
    text = memory.memory_summary()
    lines = text.splitlines()
    assert "accel CUDA memory summary, device ID 0" in lines[1]
    assert all(len(line) == len(lines[0]) for line in lines)
    row = next(line for line in lines if line.startswith("| Allocated memory"))
    assert "5120 KiB" in row
    assert "from large pool" in text and "Oversize allocations" in text
    assert "from large pool" not in memory.memory_summary(abbreviated=True)
    alloc.free(ptr)


def test_snapshot_history_and_viz(sim_cuda, monkeypatch, tmp_path):
    # classic segments (cudaMalloc); expandable ones: tests/test_memory_expandable.py
    monkeypatch.setenv("ACCEL_ALLOC_CONF", "expandable_segments:False")
    memory.record_history(True)
    alloc = memory.device_allocator(0)
    # the small block first: one made after the large block would take its free tail
    # (a small segment would lift reserved past its high-water mark; see _small_in_large)
    b = alloc.malloc(1000, 0)
    a = alloc.malloc(3 * MiB, 0)
    alloc.free(a)
    segments = memory.memory_snapshot()
    assert {s["segment_type"] for s in segments} == {"small", "large"}
    small = next(s for s in segments if s["segment_type"] == "small")
    assert small["blocks"][0]["frames"][0]["name"] == "test_snapshot_history_and_viz"   # innermost first
    path = tmp_path / "snap.json"
    memory.dump_snapshot(str(path))
    data = json.loads(path.read_text())
    assert [e["action"] for e in data["device_traces"][0]][:2] == ["segment_alloc", "alloc"]
    out = tmp_path / "timeline.html"
    proc = subprocess.run([sys.executable, "-m", "accel.memory", "viz", str(path), "-o", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    html = out.read_text()
    assert html.startswith("<!DOCTYPE html>") and "<svg" in html and "<script src" not in html
    assert f"{small['address']:#x}" in html
    png = subprocess.run([sys.executable, "-m", "accel.memory", "viz", str(path), "-o",
                          str(tmp_path / "t.png")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert png.returncode != 0 and ".html" in png.stderr and "matplotlib" in png.stderr
    else:
        assert png.returncode == 0
    alloc.free(b)
    memory.record_history(False)


# ---------------------------------------------------------------------------- host allocator
def test_host_allocator_caches_and_waits_for_streams(sim_cuda):
    host = memory.host_allocator()
    assert host is memory.host_allocator()
    be = _lazy.lazy_init()
    a = host.malloc(3000)
    assert host.stats()["reserved_bytes"] == 4096, "power-of-two sizes"
    host.free(a)
    assert host.malloc(4000) == a, "cached and reused"
    stream = be.stream_create()
    host.record_stream(a, stream)
    host.free(a)
    be.stream_synchronize(stream)
    b = host.malloc(4000)
    assert b == a, "its event completed, so the block is reused"
    host.free(b)
    with pytest.raises(ValueError, match="double free"):
        host.free(b)
    with pytest.raises(ValueError, match="not allocated by the pinned host allocator"):
        host.free(12345)
    with pytest.raises(ValueError, match="negative"):
        host.malloc(-1)
    memory.empty_host_cache()
    assert host.stats()["reserved_bytes"] == 0
    assert sim.state().host_allocations == 0
    be.stream_destroy(stream)


def test_host_allocator_retries_after_oom(sim_cuda):
    host = memory.host_allocator()
    host.free(host.malloc(MiB))
    sim.inject_oom()
    ptr = host.malloc(2 * MiB)
    assert host.stats()["num_host_free"] == 1
    host.free(ptr)


def test_forked_child_cannot_use_the_parents_cache(sim_cuda):
    alloc = memory.device_allocator(0)
    alloc.free(alloc.malloc(MiB, 0))           # a cached block the child must not get
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            memory.device_allocator(0).malloc(MiB, 0)
        except RuntimeError as exc:
            code = 0 if "forked subprocess" in str(exc) else 4
        except BaseException:
            code = 5
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("forked child hung")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0
    assert memory.device_allocator(0) is alloc, "the parent keeps its allocator"
