"""accel's memory snapshots read by torch's own tools (issue 17 item 6).

``accel.memory.dump_snapshot`` writes what ``torch.cuda.memory._dump_snapshot`` writes (a
pickle, protocol 4, of ``torch.cuda.memory._snapshot()``'s layout: torch/csrc/cuda/
memory_snapshot.cpp), so ``python -m torch.cuda._memory_viz`` and pytorch.org/memory_viz read
it.  A realistic workload runs on the simulated CUDA runtime (two devices, a side stream with
``record_stream``, an OOM); its allocations happen in this file's helpers, so every stack
starts at the helper's line, innermost first, as torch's Python frames do.

torch is needed only for its ``_memory_viz`` module (pure Python); CI installs torch==2.13.0
(``.ci/run``).  Without torch those tests are skipped with the reason.
"""

import base64
import json
import os
import pickle
import re
import subprocess
import sys

import pytest

import accel
from accel import memory
from accel._errors import OutOfMemoryError
from accel.memory import _caching, _requests
from accel.sim import _vmm
from conftest import THOROUGH, use_sim

MiB = 1 << 20
HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
TORCH_MISSING = "torch is not installed (pip install torch==2.13.0: its CPU build has torch.cuda._memory_viz)"


def _memory_viz():
    return pytest.importorskip("torch.cuda._memory_viz", reason=TORCH_MISSING)


# ---------------------------------------------------------------------------- the workload
# (Loops, not comprehensions: before Python 3.12 a comprehension is a frame of its own.)
def _init_weights(widths, device):
    """The user's function that allocates the model's parameters."""
    params = []
    for a, b in zip(widths, widths[1:]):
        params.append(accel.Buffer(a * b * 4, device=device))
    return params


def _forward(batch, widths, device, stream=None):
    """The user's function that allocates one step's activations (tiny ones included)."""
    acts = []
    for w in widths:
        acts.append(accel.Buffer(batch * w * 4, device=device, stream=stream))
    acts.append(accel.Buffer(8, device=device, stream=stream))         # a loss scalar
    return acts


def _alloc_here(nbytes=16, device=0):
    """The user's function for one allocation."""
    return accel.Buffer(nbytes, device=device)


def _grow_kv_cache(cache, step, device):
    """The user's function that grows a KV cache by copying into a larger buffer."""
    bigger = accel.Buffer((step + 1) * 256 * 1024, device=device)
    if cache is not None:
        cache.close()
    return bigger


def _ask_too_much(device):
    """The user's function whose allocation does not fit (1 PiB)."""
    return accel.Buffer(1 << 50, device=device)


def _workload():
    """Training steps on device 0 (activations on a side stream handed back with record_stream,
    freed while pending), KV-cache decode on device 1, and one OOM on each device.  Returns what
    stays alive (a free block of a live segment, a pending block, live blocks)."""
    widths = [512, 1024, 1024, 256]
    params = _init_weights(widths, 0)
    side = accel.Stream(device=0)
    keep = []
    for step in range(3):
        acts = _forward(16 + 8 * step, widths, 0, stream=side)
        for act in acts:
            act.record_stream(accel.current_stream(0))
        keep = acts[:2] if step == 2 else keep
        del acts
    cache = None
    for step in range(4):
        cache = _grow_kv_cache(cache, step, 1)
    for device in (0, 1):
        with pytest.raises(OutOfMemoryError):
            _ask_too_much(device)
    return params, keep, cache


def _record(monkeypatch, tmp_path, kind):
    """(the path of the pickle dump_snapshot wrote, its snapshot) after the workload."""
    use_sim(monkeypatch, "cuda")
    if kind == "expandable":
        if not _vmm.supported():
            pytest.skip("this host cannot play virtual memory (mmap)")
        monkeypatch.setenv("ACCEL_ALLOC_CONF", "expandable_segments:True")
    else:
        monkeypatch.setenv("ACCEL_ALLOC_CONF", "expandable_segments:False,max_split_size_mb:64")
    memory.record_history(True)
    try:
        alive = _workload()
        path = tmp_path / "snap.pickle"
        memory.dump_snapshot(str(path))
        del alive
    finally:
        memory.record_history(False)
    with open(path, "rb") as fh:
        data = pickle.load(fh)
    return path, data


@pytest.fixture(params=["classic", "expandable"])
def snap(request, monkeypatch, tmp_path):
    return _record(monkeypatch, tmp_path, request.param)


@pytest.fixture
def snap_classic(monkeypatch, tmp_path):
    return _record(monkeypatch, tmp_path, "classic")


def _names(frames):
    return [f["name"] for f in frames]


# ---------------------------------------------------------------------------- the file
def test_dump_snapshot_is_pickle_protocol_4_and_json_only_for_json(sim_cuda, tmp_path):
    memory.record_history(True)
    try:
        buf = accel.Buffer(1000)
        memory.dump_snapshot(str(tmp_path / "snap.pickle"))
        memory.dump_snapshot(str(tmp_path / "snap.json"))
        memory._dump_snapshot(str(tmp_path / "torch_name.pickle"))       # torch's name
        buf.close()
    finally:
        memory.record_history(False)
    raw = (tmp_path / "snap.pickle").read_bytes()
    assert raw[:2] == b"\x80\x04"            # PROTO 4: the memory_viz page reads protocol <= 4
    data = pickle.loads(raw)
    assert set(data) >= {"segments", "device_traces", "allocator_settings"}
    assert pickle.loads((tmp_path / "torch_name.pickle").read_bytes())["segments"]
    text = json.loads((tmp_path / "snap.json").read_text())
    # the json dump's trace also has the "snapshot" entry the pickle dump recorded (torch's
    # TraceEntry::SNAPSHOT, recorded after a snapshot reads the trace)
    assert [e["action"] for e in text["device_traces"][0]] == [e["action"] for e in data["device_traces"][0]] + ["snapshot"]
    # any other name is a pickle, as torch's
    memory.dump_snapshot(str(tmp_path / "snap"))
    assert (tmp_path / "snap").read_bytes()[:2] == b"\x80\x04"


def test_bad_path_raises_and_leaves_history(sim_cuda, tmp_path):
    memory.record_history(True)
    try:
        buf = accel.Buffer(1000)
        with pytest.raises(FileNotFoundError):
            memory.dump_snapshot(str(tmp_path / "missing-dir" / "snap.pickle"))
        # the failed dump took its snapshot (recorded as torch's "snapshot" entry) before the write
        assert [e["action"] for e in memory._snapshot()["device_traces"][0]][-2:] == ["alloc", "snapshot"]
        buf.close()
    finally:
        memory.record_history(False)


# ---------------------------------------------------------------------------- frames
def test_every_trace_entry_carries_frames_innermost_first(snap):
    _, data = snap
    assert len(data["device_traces"]) == 2
    for device_trace in data["device_traces"]:
        assert device_trace
        for entry in device_trace:
            assert isinstance(entry["frames"], list), entry
            for frame in entry["frames"]:
                assert set(frame) == {"filename", "line", "name"} and isinstance(frame["line"], int)
    allocs = [e for e in data["device_traces"][0] if e["action"] == "alloc"]
    # innermost first, from the user's line: the helper, then the workload that called it
    acts = [e for e in allocs if e["frames"][0]["name"] == "_forward"]
    assert len(acts) == 3 * 5
    for e in acts:
        assert e["frames"][0]["filename"] == HERE
        assert _names(e["frames"])[:3] == ["_forward", "_workload", "_record"]
        assert not any("/accel/" in f["filename"] for f in e["frames"])
    assert [e["frames"][0]["name"] for e in allocs if e["size"] == 512 * 1024 * 4] == ["_init_weights"]
    # a free carries the freeing line (torch's context "all"): `del acts` in _workload, or
    # _record where _workload's last locals die
    frees = [e for e in data["device_traces"][0] if e["action"] == "free_requested"]
    assert frees and all(e["frames"] for e in frees)
    assert {e["frames"][0]["name"] for e in frees} == {"_workload", "_record"}


def test_trace_sizes_are_torchs(snap):
    # torch records the requested size for alloc/free (orig_size, block->requested_size), the
    # segment's size for segment events
    _, data = snap
    trace = data["device_traces"][0]
    scalar = [e for e in trace if e["action"] == "alloc" and e["size"] == 8]
    assert len(scalar) == 3
    addr = scalar[0]["addr"]
    assert [e["size"] for e in trace if e.get("addr") == addr and e["action"] in ("free_requested", "free_completed")][:2] == [8, 8]


def test_segments_and_blocks_carry_frames(snap):
    path, data = snap
    assert data["segments"]
    for seg in data["segments"]:
        assert isinstance(seg["frames"], list)
        for block in seg["blocks"]:
            assert isinstance(block["frames"], list) and "requested_size" in block
            if block["state"] == "inactive":
                assert block["frames"] == [] and block["requested_size"] == 0
            else:
                assert block["frames"][0]["filename"] == HERE
    # each segment's stack is the allocation that created it (or mapped its first pages)
    seg_names = {seg["frames"][0]["name"] for seg in data["segments"]}
    assert seg_names <= {"_init_weights", "_forward", "_grow_kv_cache"}
    assert "_grow_kv_cache" in seg_names
    live = [b for seg in data["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"]
    assert {b["frames"][0]["name"] for b in live} == {"_init_weights", "_forward", "_grow_kv_cache"}
    pending = [b for seg in data["segments"] for b in seg["blocks"] if b["state"] == "active_pending_free"]
    for b in pending:             # a pending block still shows who allocated it, as torch's
        assert b["frames"][0]["name"] == "_forward"


def test_oom_entries(snap):
    _, data = snap
    for index, device_trace in enumerate(data["device_traces"]):
        (oom,) = [e for e in device_trace if e["action"] == "oom"]
        assert "addr" not in oom and oom["device_free"] > 0
        assert oom["size"] == 1 << 50                     # the (rounded) size asked
        assert oom["frames"][0]["name"] == "_ask_too_much"
        assert isinstance(oom["stream"], int)


def test_allocator_settings_has_torchs_keys(snap):
    path, data = snap
    settings = data["allocator_settings"]
    assert set(settings) == {"PYTORCH_CUDA_ALLOC_CONF", "max_split_size", "garbage_collection_threshold",
                             "expandable_segments", "pinned_num_register_threads", "release_lock_on_cudamalloc",
                             "pinned_use_cuda_host_register", "graph_capture_record_stream_reuse",
                             "roundup_power2_divisions"}
    expandable = "expandable_segments:True" in settings["PYTORCH_CUDA_ALLOC_CONF"]
    assert settings["expandable_segments"] is expandable
    assert settings["max_split_size"] == (-1 if expandable else 64 * MiB)
    assert settings["garbage_collection_threshold"] == 0.0
    assert settings["roundup_power2_divisions"] == {str(1 << i): 0 for i in range(16)}
    assert data["external_annotations"] == []


def test_expandable_snapshot_keeps_map_events(snap):
    _, data = snap
    actions = {e["action"] for t in data["device_traces"] for e in t}
    if data["allocator_settings"]["expandable_segments"]:
        assert "segment_map" in actions and "segment_alloc" not in actions
        assert all(s["is_expandable"] for s in data["segments"])
        maps = [e for t in data["device_traces"] for e in t if e["action"] == "segment_map"]
        assert all(e["frames"] for e in maps)
    else:
        assert "segment_alloc" in actions and "segment_map" not in actions


# ---------------------------------------------------------------------------- torch's tools
def test_torch_memory_viz_functions_read_it(snap):
    viz = _memory_viz()
    path, data = snap
    # stats: the segment summary checks that blocks add up to every segment
    summary = viz.segsum(data)
    assert f"segments: {len(data['segments'])}" in summary
    # trace: one section per device, with the OOM in torch's words
    text = viz.trace(data)
    assert "Device 0 ----" in text and "Device 1 ----" in text
    assert len(re.findall(r"raise OutOfMemoryError # 1\.0PiB requested, .* free in CUDA", text)) == 2
    # segments / memory: flamegraph lines "stream;seg;state;outer;...;inner size": torch reverses
    # the frames, so the innermost (the helper) ends each stack
    for lines in (viz.segments(data, format_flamegraph=lambda s: s), viz.memory(data, format_flamegraph=lambda s: s)):
        allocated = [line for line in lines.splitlines() if ";active_allocated;" in line]
        assert allocated
        inner = {line.rsplit(" ", 1)[0].split(";")[-1] for line in allocated}
        assert inner == {f"test_memory_snapshot_torch.py:{_line_of(name)}:{name}" for name in
                         ("_init_weights", "_forward", "_grow_kv_cache")}
    # trace_plot / segment_plot: HTML with the snapshot pickled inside
    for html in (viz.trace_plot(data), viz.trace_plot(data, plot_segments=True), viz.segment_plot(data)):
        files = json.loads(re.search(r"const local_files = (\[.*\])", html).group(1))
        inner = pickle.loads(base64.b64decode(files[0]["base64"]))
        assert inner["device_traces"] == data["device_traces"]


def _line_of(name):
    """The line in this file where helper ``name`` allocates."""
    with open(HERE) as fh:
        lines = fh.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"def {name}("))
    return next(i for i in range(start, len(lines)) if "accel.Buffer(" in lines[i]) + 1


def test_torch_memory_viz_cli_reads_it(snap_classic, tmp_path):
    _memory_viz()
    path, data = snap_classic
    env = dict(os.environ, HOME=str(tmp_path))
    # segments/memory pipe through flamegraph.pl, which torch downloads if missing: a stand-in
    os.makedirs(tmp_path / ".cache", exist_ok=True)
    script = tmp_path / ".cache" / "flamegraph.pl"
    script.write_text("#!/bin/sh\ncat\n")
    script.chmod(0o755)

    # Each command runs torch's CLI itself (the module as __main__, its argparse and output); the
    # default run runs all five in one interpreter (torch imported once, seconds each),
    # THOROUGH one process per command.
    driver = ("import contextlib, io, json, runpy, sys\n"
              "outs = []\n"
              "for argv in json.loads(sys.argv[1]):\n"
              "    sys.argv = ['_memory_viz.py', *argv]\n"
              "    buf = io.StringIO()\n"
              "    with contextlib.redirect_stdout(buf):\n"
              "        runpy.run_module('torch.cuda._memory_viz', run_name='__main__')\n"
              "    outs.append(buf.getvalue())\n"
              "print(json.dumps(outs))\n")

    def cli_runs(*argvs):
        proc = subprocess.run([sys.executable, "-c", driver, json.dumps(argvs)], capture_output=True,
                              text=True, timeout=300, cwd=str(tmp_path), env=env)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    argvs = [["trace_plot", str(path), "-o", str(tmp_path / "out.html")],
             ["segment_plot", str(path), "-o", str(tmp_path / "seg.html")],
             ["stats", str(path)], ["trace", str(path)],
             ["segments", str(path), "-o", str(tmp_path / "segments.txt")]]
    outs = [cli_runs(a)[0] for a in argvs] if THOROUGH else cli_runs(*argvs)
    assert len(outs) == len(argvs)
    out = tmp_path / "out.html"
    assert out.read_text().lstrip().startswith("<!DOCTYPE html>")
    assert "Allocator State History" in (tmp_path / "seg.html").read_text()
    assert "total_reserved" in outs[2]
    assert "raise OutOfMemoryError" in outs[3]
    lines = (tmp_path / "segments.txt").read_text().splitlines()
    assert any(line.rsplit(" ", 1)[0].endswith(":_grow_kv_cache") for line in lines)


# ---------------------------------------------------------------------------- torch's arguments
def _frames_of_last(action, device=0):
    entries = [e for e in memory._snapshot()["device_traces"][device] if e["action"] == action]
    return entries[-1].get("frames") if entries else None


def _free_here(buf):
    buf.close()


def test_record_memory_history_takes_torchs_arguments(sim_cuda):
    try:
        # torch 2.13's form: enabled, context, stacks, max_entries, device, clear_history, ...
        memory._record_memory_history("all", context="all", stacks="python", max_entries=1000,
                                      device=None, clear_history=True, compile_context=False,
                                      global_record_annotations=False, skip_actions=[])
        _free_here(_alloc_here())
        assert _frames_of_last("alloc")[0]["name"] == "_alloc_here"
        assert _frames_of_last("free_requested")[0]["name"] == "_free_here"     # context "all"
        # context "alloc": frees carry the allocation's stack
        memory._record_memory_history("all", context="alloc", stacks="all", clear_history=True)
        _free_here(_alloc_here())
        assert _frames_of_last("free_requested")[0]["name"] == "_alloc_here"
        # context "state": stacks only on live blocks, none in the trace
        memory._record_memory_history("all", context="state", clear_history=True)
        live = _alloc_here()
        assert "frames" not in memory._snapshot()["device_traces"][0][-1]
        blocks = [b for s in memory._snapshot()["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
        assert blocks and all(b["frames"][0]["name"] == "_alloc_here" for b in blocks)
        live.close()
        # context None: no stacks anywhere
        memory._record_memory_history("all", context=None, clear_history=True)
        live = _alloc_here()
        snap = memory._snapshot()
        assert "frames" not in snap["device_traces"][0][-1]
        assert all(b["frames"] == [] for s in snap["segments"] for b in s["blocks"])
        live.close()
        # max_entries keeps the newest; skip_actions leaves those out; "state" keeps one entry
        memory._record_memory_history("all", max_entries=2, clear_history=True, skip_actions=["free_completed"])
        _free_here(_alloc_here())
        assert [e["action"] for e in memory._snapshot()["device_traces"][0]] == ["alloc", "free_requested"]
        memory._record_memory_history("state", clear_history=True)
        _free_here(_alloc_here())
        assert len(memory._snapshot()["device_traces"][0]) == 1
        # the legacy boolean form (torch's _record_memory_history_legacy)
        memory._record_memory_history(True, record_context=True, trace_alloc_max_entries=10,
                                      trace_alloc_record_context=True, clear_history=True)
        _free_here(_alloc_here())
        assert _frames_of_last("alloc")[0]["name"] == "_alloc_here"
        memory._record_memory_history(None)
        assert memory._snapshot()["device_traces"][0] == []
        # accel's own spelling takes torch's values too
        memory.record_history("all", "all", "python", 100)
        _free_here(_alloc_here())
        assert _frames_of_last("free_requested")[0]["name"] == "_free_here"
    finally:
        memory.record_history(False)


@pytest.mark.parametrize("kwargs, match", [
    ({"enabled": "everything"}, "'everything'.*'state', 'all', or None"),
    ({"context": "some"}, "'some'.*'state', 'alloc', 'all', or None"),
    ({"stacks": "cpp"}, "'cpp'.*'python', or 'all'"),
    ({"skip_actions": ["allocate"]}, "'allocate'.*alloc"),
])
def test_record_history_bad_arguments(sim_cuda, kwargs, match):
    memory.record_history(True)
    try:
        accel.Buffer(100).close()
        before = memory._snapshot()["device_traces"]
        with pytest.raises(ValueError, match=match):
            memory._record_memory_history(**{"enabled": "all", **kwargs})
        accel.Buffer(100).close()
        # state unchanged: still recording as before, with stacks (+1: the snapshot `before` took)
        assert len(memory._snapshot()["device_traces"][0]) == len(before[0]) + 1 + 3
        assert _frames_of_last("alloc")[0]["name"] == "test_record_history_bad_arguments"
    finally:
        memory.record_history(False)


def test_stacks_are_not_walked_while_history_is_off(sim_cuda, monkeypatch):
    def boom(*args):
        raise AssertionError("a stack was captured while history is off")
    accel.Buffer(100).close()
    monkeypatch.setattr(_caching, "_stack", boom)
    monkeypatch.setattr(_requests, "_stack", boom)      # (the cudaMallocAsync allocator's _frames)
    side = accel.Stream()
    for _ in range(3):
        buf = accel.Buffer(3 * MiB)
        buf.record_stream(side)
        buf.close()
        with pytest.raises(OutOfMemoryError):
            _ask_too_much(0)
    memory.empty_cache()


def test_history_off_drops_segment_stacks(sim_cuda):
    memory.record_history(True)
    buf = accel.Buffer(3 * MiB)
    alloc = memory.device_allocator(0)
    assert alloc._seg_frames
    memory.record_history(False)
    assert not alloc._seg_frames
    buf.close()
    memory.empty_cache()
    assert memory._snapshot()["segments"] == [] and memory._snapshot()["device_traces"][0] == []
