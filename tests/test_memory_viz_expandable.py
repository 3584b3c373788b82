"""memory_summary and the snapshot timeline (accel/memory/_viz.py) with expandable segments:
snapshot segments marked ``is_expandable`` (torch reports each mapped run as one) and the
``segment_map``/``segment_unmap`` trace events.  A real snapshot from the simulated CUDA
runtime (which enforces the driver's map/unmap rules)."""

import json

import pytest

from accel import _lazy, memory
from accel.memory import _summary, _viz
from accel.sim import _vmm
from conftest import use_sim

MiB = 1 << 20

pytestmark = pytest.mark.skipif(not _vmm.supported(), reason="this host cannot play virtual memory (mmap)")


@pytest.fixture
def snapshot(monkeypatch, tmp_path):
    """Map three runs (the middle one joins its neighbours), unmap the free middle one with
    empty_cache, map again; returns (path of the dumped snapshot, its dict, the summaries)."""
    use_sim(monkeypatch, "cuda")
    monkeypatch.setenv("ACCEL_ALLOC_CONF", "expandable_segments:True")
    _lazy.lazy_init()
    memory.record_history(True)
    alloc = memory.device_allocator(0)
    summaries = {}
    try:
        p = alloc.malloc(5 * MiB, 0)
        q = alloc.malloc(3 * MiB, 0)
        r = alloc.malloc(7 * MiB, 0)
        summaries["mapped"] = memory.memory_summary(), memory.memory_reserved()
        alloc.free(q)
        memory.empty_cache()
        summaries["unmapped"] = memory.memory_summary(), memory.memory_reserved()
        s = alloc.malloc(MiB, 0)
        path = tmp_path / "snap.json"
        memory.dump_snapshot(str(path))
        for ptr in (p, r, s):
            alloc.free(ptr)
        memory.empty_cache()
        summaries["empty"] = memory.memory_summary(), memory.memory_reserved()
    finally:
        memory.record_history(False)
    return path, json.loads(path.read_text()), summaries


def _reserved_row(text):
    row = next(line for line in text.splitlines() if line.startswith("| GPU reserved memory"))   # torch's label
    return row.split("|")[2].split()                  # Cur Usage: value and unit


def test_snapshot_has_maps_unmaps_and_expandable_runs(snapshot):
    _, data, _ = snapshot
    actions = [e["action"] for e in data["device_traces"][0]]
    assert actions.count("segment_map") >= 3 and "segment_unmap" in actions
    assert "segment_alloc" not in actions
    assert data["segments"] and all(s["is_expandable"] for s in data["segments"])


def test_reserved_follows_maps_and_unmaps(snapshot):
    path, data, _ = snapshot
    tl = _viz.load(str(path))[0]
    events = data["device_traces"][0]
    expected, level = [0], 0
    for e in events:
        level += {"segment_map": e["size"], "segment_unmap": -e["size"]}.get(e["action"], 0)
        expected.append(level)
    assert [v for _, v in tl.reserved] == expected
    assert tl.reserved[0][1] == 0                     # nothing was mapped before recording
    assert tl.reserved[-1][1] == sum(s["total_size"] for s in data["segments"])
    unmaps = [t for t, e in enumerate(events, 1) if e["action"] == "segment_unmap"]
    assert unmaps and all(expected[t] < expected[t - 1] for t in unmaps)


def test_expandable_lane_shows_its_mapped_runs(snapshot):
    path, data, _ = snapshot
    tl = _viz.load(str(path))[0]
    events = data["device_traces"][0]
    assert tl.expandable and tl.expandable == set(tl.segments)
    # each lane starts at its first map, not at time 0
    first_map = min(t for t, e in enumerate(events, 1) if e["action"] == "segment_map")
    assert min(tl.segments[b][0] for b in tl.expandable) == first_map
    # the runs still mapped at the end are exactly the snapshot's expandable segments
    final = sorted((r[3], r[4]) for r in tl.runs if r[2] is None)
    assert final == sorted((s["address"], s["total_size"]) for s in data["segments"])
    # an unmap ended a run: some run closed at the unmap event
    unmap_t = [t for t, e in enumerate(events, 1) if e["action"] == "segment_unmap"]
    assert any(r[2] in unmap_t for r in tl.runs)
    # runs lie inside their lanes; every block lies inside a lane
    for lane, start, end, addr, size, _ in tl.runs:
        assert lane <= addr and addr + size <= lane + tl.segments[lane][2]
    allocs = [e for e in events if e["action"] == "alloc"]
    assert len(tl.blocks) == len(allocs)
    for lane, _, _, addr, size, _ in tl.blocks:
        assert lane <= addr and addr + size <= lane + tl.segments[lane][2]


def test_html_draws_runs(snapshot, tmp_path):
    path, data, _ = snapshot
    out = tmp_path / "t.html"
    _viz.render(str(path), str(out))
    text = out.read_text()
    tl = _viz.load(str(path))[0]
    assert text.count("<title>mapped run ") == len(tl.runs) >= 3
    assert "expandable segment" in text and "mapped runs)" in text
    for seg in data["segments"]:
        assert f"mapped run {seg['address']:#x} " in text


def test_summary_reserved_grows_on_map_and_shrinks_on_unmap(snapshot):
    _, data, summaries = snapshot
    mapped, unmapped, empty = (summaries[k][1] for k in ("mapped", "unmapped", "empty"))
    assert mapped >= 15 * MiB and 0 < unmapped < mapped and empty == 0
    for text, reserved in summaries.values():
        # torch's units: KiB until 768 MiB, so 16 MiB reads "16384 KiB"
        assert _reserved_row(text) == _summary._format_size(reserved, reserved).split()


def test_trace_cut_short_starts_from_the_right_mapped_state():
    """max_entries drops early events: maps made before the kept trace are undone from the
    snapshot backwards, so they count as reserved from the start (torch's viewer does the same)."""
    seg = {"device": 0, "address": 0x10000000, "total_size": 4 * MiB, "stream": 0,
           "segment_type": "large", "is_expandable": True,
           "blocks": [{"address": 0x10000000, "size": 4 * MiB, "state": "inactive"}]}
    events = [{"action": "segment_unmap", "addr": 0x10400000, "size": 2 * MiB, "stream": 0},
              {"action": "segment_map", "addr": 0x10200000, "size": 2 * MiB, "stream": 0}]
    tl = _viz.Timeline(0, [seg], events)
    assert [v for _, v in tl.reserved] == [4 * MiB, 2 * MiB, 4 * MiB]
    assert tl.segments == {0x10000000: [0, None, 6 * MiB, "expandable large"]}
    # before: two runs with a hole; the unmap ends the upper one, the map fills the hole
    assert sorted(r[1:5] for r in tl.runs) == [(0, 1, 0x10400000, 2 * MiB), (0, 2, 0x10000000, 2 * MiB),
                                                (2, None, 0x10000000, 4 * MiB)]
