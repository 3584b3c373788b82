"""The sixth held-out trace set (r69k, ``tests/test_memory_traces/holdout6_r69k/``, recorded by
``tools/holdout6_workloads_r69k.py``): eight real allocation traces of workloads none of the
earlier 49 traces resembles (sampled-subgraph GraphSAGE, mixture-of-depths with early exit, an
RNN-T joint, a 3D U-Net, image-GPT sampling, MoCo's queue, chunked long-sequence attention,
quantization-aware training).  They were only measured, never tuned on.

What is checked, per trace, on the simulated CUDA device under expandable segments (the default
where the backend has virtual memory) and classic segments (``expandable_segments:False``, what
Metal gets): every op replays without error; peak reserved >= peak allocated >= peak live (the
bytes the trace asks for at its peak, exactly the allocator's peak requested bytes); and memory
returns to zero at the end: with the blocks the trace left live freed, nothing is allocated, and
after ``empty_cache`` nothing is reserved and the device's free memory is what it was before.
Also: the folder holds exactly the recorder's workloads in the shared format, and (with torch
2.13 installed) the recorder writes one of them byte for byte again.  No ratio is asserted:
the figures are a measurement, reported in the README's format by ``tools/replay_trace.py``.
"""

import glob
import os
import subprocess
import sys

import pytest

from conftest import use_sim

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER = os.path.join(REPO, "tests", "test_memory_traces", "holdout6_r69k")
TRACES = sorted(glob.glob(os.path.join(FOLDER, "*.json")))
TOOL = os.path.join(REPO, "tools", "holdout6_workloads_r69k.py")
MiB = 1 << 20

sys.path.insert(0, os.path.join(REPO, "tools"))
try:
    import holdout6_workloads_r69k as recorder
    import record_traces
finally:
    sys.path.pop(0)

CONFIGS = {"expandable": "expandable_segments:True", "classic": "expandable_segments:False"}


def test_the_folder_holds_the_recorders_eight_workloads():
    names = {os.path.basename(p)[:-5] for p in TRACES}
    assert names == set(recorder.WORKLOADS) and len(names) == 8
    assert all(os.path.getsize(p) < 300 * 1024 for p in TRACES)       # the corpus's size limit per trace
    # apart from holdout/: `replay_trace.py --holdout` and the corpus test keep their 38
    assert not names & {os.path.basename(p)[:-5]
                        for p in glob.glob(os.path.join(REPO, "tests", "test_memory_traces", "**", "*.json"),
                                           recursive=True) if os.path.dirname(p) != FOLDER}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("path", TRACES, ids=[os.path.basename(p)[:-5] for p in TRACES])
def test_trace_replays_and_memory_returns_to_zero(monkeypatch, path, config):
    use_sim(monkeypatch, "cuda")
    from accel import _lazy
    from accel.memory import _bench, _config
    from accel.memory._async import create_allocator

    trace = _bench.load_trace(path)           # checks every op: no free of a dead id, no reused live id
    assert trace["name"] == os.path.basename(path)[:-5]
    assert trace["source"].startswith(f"torch {record_traces.TORCH_VERSION} CPU profiler")
    ops = trace["ops"]
    assert 2000 <= len(ops) <= 16000 and all(op[2] > 0 for op in ops if op[0] == "a")
    need = _bench.peak_live(ops)
    assert 10 * MiB <= need <= 400 * MiB

    be = _lazy.lazy_init()
    be.set_device(0)
    free_before = be.mem_info()[0]
    alloc = create_allocator(be, 0, _config.parse(CONFIGS[config], "test"))
    stream = be.default_stream(0)
    live = {}
    for op in ops:
        if op[0] == "a":
            live[op[1]] = alloc.malloc(op[2], stream)
        else:
            alloc.free(live.pop(op[1]))
    stats = alloc.stats()
    assert stats["requested_bytes.all.peak"] == need
    assert need <= stats["allocated_bytes.all.peak"] <= stats["reserved_bytes.all.peak"]
    assert stats["reserved_bytes.all.peak"] < 2 * need            # a replay, not a leak per op
    if config == "expandable":
        assert alloc.map_stats()[_bench.MAP_STAT] > 0           # it did take expandable segments
    else:
        assert alloc.map_stats().get(_bench.MAP_STAT, 0) == 0

    left = len(live)                     # optimizer state, parameters' grads: live when recording stopped
    for ptr in live.values():
        alloc.free(ptr)
    stats = alloc.stats()
    assert stats["allocated_bytes.all.current"] == 0 and stats["requested_bytes.all.current"] == 0, left
    alloc.empty_cache()
    stats = alloc.stats()
    assert stats["reserved_bytes.all.current"] == 0
    assert be.mem_info()[0] == free_before


def test_recording_one_again_gives_the_same_bytes(tmp_path):
    """Seeded, one intra-op thread: the tool writes the committed file byte for byte (same torch,
    same CPU type: CPU kernels choose workspaces by ISA, as the corpus README says)."""
    torch = pytest.importorskip("torch")
    if not torch.__version__.startswith(record_traces.TORCH_VERSION):
        pytest.skip(f"recorded with torch {record_traces.TORCH_VERSION}, not {torch.__version__}")
    name = "graphsage_sampled_train"
    proc = subprocess.run([sys.executable, TOOL, name, "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(FOLDER, name + ".json")) as fh:
        assert (tmp_path / (name + ".json")).read_text() == fh.read()
