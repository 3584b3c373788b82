"""accel's own memory picture (``python -m accel.memory viz``, accel/memory/_viz.py), issue 17
item 7: allocation sites on hover, small sizes in KiB/B, per-stream and per-pool colours with
a legend, pending frees, OOM markers, and torch's pickle snapshots as input."""

from accel.memory import _viz

MiB = 1 << 20


def test_oom_entry_without_addr_is_read():
    """torch's (and accel's) ``oom`` entries carry ``device_free`` and no ``addr``."""
    events = [{"action": "alloc", "addr": 0x1000, "size": 512, "stream": 0, "frames": []},
              {"action": "oom", "device_free": 3 * MiB, "size": 8 * MiB, "stream": 0, "frames": []}]
    tl = _viz.Timeline(0, [], events)
    assert tl.steps == 2


# ----------------------------------------------------------------------------- helpers

import html as _html
import pickle
import re

import pytest

import accel
from accel import _lazy, memory
from accel.memory import __main__ as viz_main
from conftest import use_sim

KiB = 1 << 10


def _titles(page: str):
    """The hover texts of a page (each SVG <title>, unescaped)."""
    return [_html.unescape(t) for t in re.findall(r"<title>(.*?)</title>", page, re.S)]


def _block_titles(page: str, device: int = 0):
    return [_html.unescape(t) for t in re.findall(rf'id="d{device}b\d+" class="blk"[^>]*><title>(.*?)</title>',
                                                  page, re.S)]


# ----------------------------------------------------------------------------- units

@pytest.mark.parametrize("nbytes, text", [(0, "0 B"), (512, "512 B"), (1023, "1023 B"), (4 * KiB, "4.00 KiB"),
                                          (10485, "10.24 KiB"), (10486, "0.01 MiB"), (3 * MiB // 2, "1.50 MiB"),
                                          (3 << 30, "3.00 GiB")])
def test_sizes_under_a_hundredth_of_a_mib_read_in_kib_or_bytes(nbytes, text):
    assert _viz.format_size(nbytes) == text


# ----------------------------------------------------------------------------- a real workload

def allocate_activations(n, stream=None):
    return accel.Buffer(n, stream=stream)


def train_step(side):
    """Blocks on two streams, one freed while the other stream uses it, and an OOM."""
    kept = [allocate_activations(n) for n in (2 * MiB, 64 * KiB, 512)]
    kept += [allocate_activations(n, stream=side) for n in (3 * MiB, 6 * KiB)]
    shared = allocate_activations(MiB)
    shared.fill_(7, stream=side)           # used on the side stream: recorded with the allocator
    shared.close()                         # pending until the side stream's work is done
    kept += [allocate_activations(n) for n in (128 * KiB, 256)]   # events while it is pending
    side.synchronize()
    kept.append(allocate_activations(4 * KiB))   # the allocator sees the event: free completes
    with pytest.raises(accel.OutOfMemoryError):
        allocate_activations(accel.get_device_properties(0).total_memory * 2)
    with accel.Stream(device=1):           # the other device has its own picture
        kept.append(accel.Buffer(MiB, device=1))
    return kept


@pytest.fixture
def workload_snapshot(monkeypatch, tmp_path):
    """A pickle from dump_snapshot after train_step on the simulated CUDA runtime (classic
    segments), with history and stacks on."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=20000, ACCEL_ALLOC_CONF="expandable_segments:False")
    _lazy.lazy_init()
    memory.record_history(True)
    path = tmp_path / "snap.pickle"
    side = accel.Stream()
    kept = []
    try:
        kept = train_step(side)
        memory.dump_snapshot(str(path))
    finally:
        memory.record_history(False)
        for buf in kept:
            buf.close()
        side.synchronize()
    return path


def test_workload_page_shows_sites_units_streams_pools_pending_and_oom(workload_snapshot, tmp_path):
    out = tmp_path / "viz.html"
    assert viz_main.main(["viz", str(workload_snapshot), "-o", str(out)]) == 0
    page = out.read_text()
    blocks = _block_titles(page)
    assert len(blocks) >= 9
    # allocation sites: the innermost user frame first, file:line function
    line = allocate_activations.__code__.co_firstlineno + 1
    site = f"test_memory_viz.py:{line} allocate_activations"
    for text in blocks:
        where = text.split("allocated at:\n", 1)[1].splitlines()
        assert where[0].endswith(site) and "train_step" in "\n".join(where[1:3]), text
        assert "/accel/" not in "\n".join(where)        # accel's own frames are not the site
    # small sizes in KiB or bytes, never "0.00 MiB"
    assert any(t.startswith("block ") and " 512 B\n" in t for t in blocks)
    assert any(" 6.00 KiB\n" in t for t in blocks) and any(" 4.00 KiB\n" in t for t in blocks)
    assert "0.00 MiB" not in page
    # two streams with a legend, and the pool of each lane
    side = [t for t in blocks if "3.00 MiB" in t][0]
    assert "stream 0x" in side and "stream 0 (default)" in blocks[0]
    legend = re.search(r'<div class="legend" id="legend0">(.*?)</div></div>', page, re.S).group(1)
    assert "stream 0 (default)" in legend and re.search(r"stream 0x[0-9a-f]+", legend)
    assert "default pool" in legend and "pending free" in legend and "OOM" in legend
    # the pending free: hatched, and its hover says so
    pending = [t for t in blocks if "pending free from event" in t]
    assert len(pending) == 1 and pending[0].startswith("block ") and " 1.00 MiB" in pending[0]
    assert page.count('class="pend"') == 1
    # the OOM marker with the request, the device's free memory and the caller
    ooms = re.findall(r'<g id="d0oom(\d+)" class="oom"><title>(.*?)</title>', page, re.S)
    assert len(ooms) == 1
    text = _html.unescape(ooms[0][1])
    assert text.startswith("OUT OF MEMORY at event") and "free" in text and "test_memory_viz.py:" in text
    # device 1 is drawn too; the page is self-contained
    assert "<h2>device 1:" in page
    (other,) = _block_titles(page, 1)
    assert other.startswith("block ") and " 1.00 MiB\n" in other and "train_step" in other
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=|@import|url\(http", page)
    assert "<script>" in page and "data-tip" in page       # the hover box script


def test_workload_json_and_pickle_draw_the_same(workload_snapshot, tmp_path):
    data = _viz.read_snapshot(str(workload_snapshot))
    path = tmp_path / "snap.json"
    path.write_text(__import__("json").dumps(data))
    assert _viz.html_page(_viz.load(str(path)), "t") == _viz.html_page(_viz.load(str(workload_snapshot)), "t")


# ----------------------------------------------------------------------------- torch's format

def _frames(*user):
    """A torch stack with stacks="all": C++ frames innermost, torch's Python, then the user's."""
    return ([{"filename": "??", "line": 0, "name": "c10::cuda::CUDACachingAllocator::Native::malloc"},
             {"filename": "/usr/lib/python3.11/site-packages/torch/nn/modules/linear.py", "line": 125,
              "name": "forward"}]
            + [{"filename": f, "line": n, "name": name} for f, n, name in user])


def torch_snapshot():
    """A snapshot as torch.cuda.memory._snapshot() returns it (torch/cuda/memory.py's
    documented layout; pool ids are tuples), for a pickle written as _dump_snapshot does."""
    base, stream2 = 0x7F0000000000, 0x5612AB00
    user = ("/home/u/train.py", 42, "forward"), ("/home/u/train.py", 88, "main")
    segments = [{"device": 0, "address": base, "total_size": 20 * MiB, "stream": 0, "segment_type": "large",
                 "segment_pool_id": (0, 0), "allocated_size": 8 * MiB, "active_size": 12 * MiB,
                 "requested_size": 8 * MiB, "is_expandable": False, "frames": _frames(*user),
                 "blocks": [{"address": base, "size": 8 * MiB, "requested_size": 8 * MiB,
                             "state": "active_allocated", "frames": _frames(*user)},
                            {"address": base + 8 * MiB, "size": 4 * MiB, "requested_size": 4 * MiB,
                             "state": "active_pending_free", "frames": _frames(*user)},
                            {"address": base + 12 * MiB, "size": 8 * MiB, "requested_size": 0,
                             "state": "inactive", "frames": []}]},
                {"device": 0, "address": base + 64 * MiB, "total_size": 2 * MiB, "stream": stream2,
                 "segment_type": "small", "segment_pool_id": (3, 1), "allocated_size": 512,
                 "active_size": 512, "requested_size": 500, "is_expandable": False, "frames": [],
                 "blocks": [{"address": base + 64 * MiB, "size": 512, "requested_size": 500,
                             "state": "active_allocated",
                             "frames": _frames(("/home/u/graphs.py", 7, "capture"))},
                            {"address": base + 64 * MiB + 512, "size": 2 * MiB - 512, "requested_size": 0,
                             "state": "inactive", "frames": []}]}]

    def entry(action, addr, size, stream=0, frames=None, **kw):
        e = {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": 1000,
             "compile_context": "", "user_metadata": ""}
        e.update(kw)
        if frames is not None:
            e["frames"] = frames
        return e

    trace = [entry("segment_alloc", base, 20 * MiB, frames=_frames(*user)),
             entry("alloc", base, 8 * MiB, frames=_frames(*user)),
             entry("alloc", base + 8 * MiB, 4 * MiB, frames=_frames(*user)),
             entry("free_requested", base + 8 * MiB, 4 * MiB, frames=_frames(*user)),
             entry("alloc", base + 64 * MiB, 500, stream2, frames=_frames(("/home/u/graphs.py", 7, "capture"))),
             {"action": "oom", "device_free": 3 * MiB, "size": 40 * MiB, "stream": 0, "time_us": 1001,
              "compile_context": "", "user_metadata": "", "frames": _frames(*user)}]
    return {"segments": segments, "device_traces": [trace], "allocator_settings": {},
            "external_annotations": []}


def test_reads_torch_pickle_snapshot(tmp_path):
    path = tmp_path / "torch_snapshot.pickle"
    with open(path, "wb") as fh:
        pickle.dump(torch_snapshot(), fh, protocol=4)
    out = tmp_path / "torch.html"
    _viz.render(str(path), str(out))
    page = out.read_text()
    blocks = _block_titles(page)
    assert len(blocks) == 3
    main_block = next(t for t in blocks if t.startswith("block 0x7f0000000000 8.00 MiB"))
    # torch's C++ and torch's own Python frames are skipped: the user's line comes first
    assert main_block.split("allocated at:\n")[1].splitlines()[:2] == ["  /home/u/train.py:42 forward",
                                                                     "  /home/u/train.py:88 main"]
    pending = next(t for t in blocks if "0x7f0000800000" in t)
    assert "pending free from event 4 until the snapshot" in pending
    small = next(t for t in blocks if "0x7f0004000000" in t)
    assert small.startswith("block 0x7f0004000000 500 B\n")
    assert "stream 0x5612ab00, private pool (3, 1)" in small and "/home/u/graphs.py:7 capture" in small
    assert "private pool (3, 1)" in page and "stream 0x5612ab00" in page
    assert page.count('class="oom"') == 1 and "OUT OF MEMORY at event 6" in page
    assert "40.00 MiB requested on stream 0 (default); the device had 3.00 MiB free" in page


def test_pickle_with_objects_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("ran",))
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[Evil()]]}, protocol=4))
    with pytest.raises(ValueError, match=r"refers to builtins\.print"):
        _viz.load(str(path))
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x00\xffnot a snapshot")
    with pytest.raises(ValueError, match="neither a snapshot pickle nor JSON"):
        _viz.load(str(bad))


def test_cli_reports_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"x": 1}')
    assert viz_main.main(["viz", str(bad), "-o", str(tmp_path / "o.html")]) == 2
    assert "not a memory snapshot" in capsys.readouterr().err
    assert not (tmp_path / "o.html").exists()


def test_blocks_and_segments_from_before_a_cut_trace_start_at_zero():
    """max_entries dropped the allocations: a block and segment freed in the kept trace existed
    from the start (before, the block was dropped and the segment had no lane)."""
    events = [{"action": "free_requested", "addr": 0x2000, "size": 4 * KiB, "stream": 0},
              {"action": "free_completed", "addr": 0x2000, "size": 4 * KiB, "stream": 0},
              {"action": "segment_free", "addr": 0x2000, "size": 2 * MiB, "stream": 0}]
    tl = _viz.Timeline(0, [], events)
    assert tl.segments == {0x2000: [0, 3, 2 * MiB, ""]}
    assert [(b.start, b.end, b.addr, b.size) for b in tl.blocks] == [(0, 2, 0x2000, 4 * KiB)]
    assert [v for _, v in tl.active] == [4 * KiB, 4 * KiB, 0, 0]
    assert [v for _, v in tl.reserved] == [2 * MiB, 2 * MiB, 2 * MiB, 0]
