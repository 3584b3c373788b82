"""Messages and exception types where torch code and log scrapers match them (issue 16,
"Messages and types").  Each test is named after the PyTorch test it ports
(``test/test_cuda.py``, ``test/test_cuda_multigpu.py``, ``test/test_accelerator.py``);
torch's wording is quoted from ``c10/cuda/CUDACachingAllocator.cpp`` and
``torch/cuda/memory.py`` (torch 2.13).
"""

import re

import pytest

import accel
from accel import memory
from accel._errors import InvalidDeviceError, OutOfMemoryError

from conftest import use_sim

GiB = 1 << 30
MiB = 1 << 20


# ------------------------------------------------------------------ out of memory
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_cuda__test_out_of_memory(monkeypatch, kind):
    """test_cuda.py::test_out_of_memory: 800000000 GiB reads "Tried to allocate 800000000.00
    GiB. GPU 0 has a total capacity of"; at or above 1 EB (2**60 bytes) "Tried to allocate
    more than 1EB memory"; the allocator keeps working afterwards."""
    use_sim(monkeypatch, kind)
    alloc = memory.device_allocator(0)
    keep = alloc.malloc(1024)
    with pytest.raises(RuntimeError, match=r"Tried to allocate 800000000\.00 GiB\. GPU 0 has a total "
                                           r"capacity of \d+\.\d\d GiB of which .* is free\. "):
        alloc.malloc(1024 * 1024 * 1024 * 800000000)
    with pytest.raises(OutOfMemoryError, match=r"^[A-Z]+ out of memory\. Tried to allocate more than 1EB "
                                               r"memory\.$"):
        alloc.malloc(1024 * 1024 * 1024 * 8000000000)
    with pytest.raises(OutOfMemoryError, match="more than 1EB"):
        alloc.malloc(1 << 60)                   # torch: size < one_exa_bytes, so 2**60 is refused
    again = alloc.malloc(1024)                  # the OOM did not disturb the allocator
    alloc.free(again)
    alloc.free(keep)


def test_cuda__test_out_of_memory_device_1(sim_cuda):
    """The OOM names the allocating device as torch's "GPU <device_id>"."""
    with pytest.raises(OutOfMemoryError, match=r"Tried to allocate 500\.00 GiB\. GPU 1 has a total capacity"):
        memory.device_allocator(1).malloc(500 * GiB)


def test_cuda__test_set_per_process_memory_fraction_oom_says_allowed(sim_cuda):
    """With a fraction set, torch's message carries "<allowed> allowed; " before "Of the
    allocated memory"."""
    memory.set_per_process_memory_fraction(0.25, 0)
    total = memory.get_memory_info(0)[1]
    with pytest.raises(OutOfMemoryError, match=r"is free\. 2\.00 GiB allowed; Of the allocated memory "):
        memory.device_allocator(0).malloc(total // 2)
    assert total == 8 * GiB


# torch's OOM text names format_size(alloc_size), alloc_size = get_allocation_size(round_size(n))
# (DeviceCachingAllocator::malloc): the segment it asked the device for, with or without
# expandable segments.  Requests and what torch prints for them:
_TORCH_TRIED = [(100, "2.00 MiB"), (MiB, "2.00 MiB"), (MiB + 1, "20.00 MiB"),
                (9 * MiB + 5, "20.00 MiB"), (10 * MiB, "10.00 MiB"), (11 * MiB + 1, "12.00 MiB"),
                (33 * MiB, "34.00 MiB")]
# accel's own policy asks for 2 MiB for a small request and the request rounded up to 2 MiB
# otherwise (it has no 20 MiB bucket), and prints that
_ACCEL_TRIED = [(100, "2.00 MiB"), (MiB, "2.00 MiB"), (MiB + 1, "2.00 MiB"),
                (9 * MiB + 5, "10.00 MiB"), (10 * MiB, "10.00 MiB"), (11 * MiB + 1, "12.00 MiB")]


def _tried(alloc, nbytes: int) -> str:
    from accel import sim
    sim.inject_oom(times=1000)            # every device allocation fails, retries included
    try:
        with pytest.raises(OutOfMemoryError) as info:
            alloc.malloc(nbytes)
    finally:
        sim.clear_faults()
    return re.search(r"Tried to allocate (.*?)\. GPU 0 has", str(info.value)).group(1)


@pytest.mark.parametrize("expandable", ["True", "False"])
def test_cuda__test_out_of_memory_size_is_torchs_allocation_size(monkeypatch, expandable):
    """Under policy:torch the OOM names the quantity torch names for the same request: the
    segment size (2 MiB for <= 1 MiB, 20 MiB below 10 MiB, else rounded up to 2 MiB), also
    with expandable segments, where torch still prints get_allocation_size."""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF=f"policy:torch,expandable_segments:{expandable}")
    alloc = memory.device_allocator(0)
    assert [(n, _tried(alloc, n)) for n, _ in _TORCH_TRIED] == _TORCH_TRIED


def test_cuda__test_out_of_memory_size_rounds_power2_divisions(monkeypatch):
    """round_size first: with roundup_power2_divisions:4, 33 MiB rounds to 40 MiB."""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="policy:torch,roundup_power2_divisions:4")
    assert _tried(memory.device_allocator(0), 33 * MiB) == "40.00 MiB"


@pytest.mark.parametrize("expandable", ["True", "False"])
def test_out_of_memory_size_accel_policy(monkeypatch, expandable):
    """accel's own policy names the segment it would have made for the request."""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF=f"expandable_segments:{expandable}")
    alloc = memory.device_allocator(0)
    assert [(n, _tried(alloc, n)) for n, _ in _ACCEL_TRIED] == _ACCEL_TRIED


@pytest.mark.parametrize("conf", ["", "expandable_segments:False", "policy:torch", "backend:cudaMallocAsync"])
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_cuda__test_out_of_memory_1eb_refused_up_front(monkeypatch, kind, conf):
    """torch checks size < one_exa_bytes in allocate(), before the device allocator runs: no
    cache is freed, no stream synchronized, no retry or OOM counted."""
    if kind == "xpu" and "Async" in conf:
        pytest.skip("backend:cudaMallocAsync is CUDA's")
    use_sim(monkeypatch, kind, ACCEL_ALLOC_CONF=conf)
    alloc = memory.device_allocator(0)
    kept = alloc.malloc(3 * MiB)
    cached = alloc.malloc(30 * MiB)
    alloc.free(cached)                       # reserved but free: an OOM retry would release it
    before = alloc.stats()
    for nbytes in (1 << 60, 2**64, 2**70):
        with pytest.raises(OutOfMemoryError, match=r"^[A-Z]+ out of memory\. Tried to allocate more than 1EB "
                                                   r"memory\.$"):
            alloc.malloc(nbytes)
    after = alloc.stats()
    for key in ("reserved_bytes.all.current", "num_alloc_retries", "num_ooms", "num_sync_all_streams",
                "num_device_free", "allocation.all.current"):
        assert after[key] == before[key], key
    assert before["reserved_bytes.all.current"] >= 33 * MiB
    alloc.free(kept)


# ------------------------------------------------------------------ device strings and indices
def test_cuda_multigpu__test_get_device_index(sim_cuda):
    """test_cuda_multigpu.py::test_get_device_index: "cuda0" is a RuntimeError "Invalid
    device string"; a device of another type is a ValueError."""
    from accel._device import device_index
    with pytest.raises(RuntimeError, match="Invalid device string"):
        device_index("cuda0", optional=True)
    with pytest.raises(ValueError, match="doesn't match the current accelerator"):
        device_index(accel.device("cpu"), optional=True)


@pytest.mark.parametrize("text", ["cuda0", "cuda:x", "cuda:-1", "gpu:0", "cuda:0:1"])
def test_torch_device__invalid_device_string(text):
    """torch.device(<bad string>) raises RuntimeError; accel's error is also a ValueError, so
    code written for either keeps working."""
    with pytest.raises(RuntimeError, match="Invalid device string"):
        accel.device(text)
    with pytest.raises(ValueError, match="Invalid device string"):
        accel.device(text)
    with pytest.raises(InvalidDeviceError):
        accel.device(text)


def test_cuda__test_streams_multi_gpu_out_of_range_device(sim_cuda):
    """A stream on a device index past the count: torch raises RuntimeError with
    CUDAStream.cpp's "Device index value N is out of index range [0, count)"; accel's error is
    RuntimeError and ValueError, in torch's words plus the count it saw."""
    for bad in (2, "cuda:2", accel.device("cuda", 7)):
        with pytest.raises(RuntimeError, match=r"Device index value \d is out of index range \[0, 2\): "
                                               r"2 cuda devices visible"):
            accel.Stream(bad)
        with pytest.raises(ValueError):
            accel.Stream(bad)
    with pytest.raises(RuntimeError, match="out of range"):
        accel.set_device_index(5)


def test_cuda_multigpu__test_events_multi_gpu_errors_are_invalid_device_error(sim_cuda):
    """An event used with another device's stream or event: torch raises RuntimeError; accel
    raises its one device error class, InvalidDeviceError (RuntimeError and ValueError), with
    the messages it always had.  The old private name stays an alias."""
    from accel.streams import _DeviceMismatchError
    assert _DeviceMismatchError is InvalidDeviceError
    e0, e1 = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    e0.record(accel.Stream(0))
    e1.record(accel.Stream(1))
    with pytest.raises(InvalidDeviceError, match="elapsed_time needs two events of one device: this event "
                                                 "was recorded on device 0, end_event on device 1"):
        e0.elapsed_time(e1)
    with pytest.raises(InvalidDeviceError, match="cannot record: the event belongs to device 0 but the "
                                                 "stream is on device 1"):
        e0.record(accel.Stream(1))
    for call in (lambda: e1.elapsed_time(e0), lambda: e1.record(accel.Stream(0))):
        with pytest.raises(RuntimeError):
            call()
        with pytest.raises(ValueError):
            call()


# ------------------------------------------------------------------ memory_summary
_TORCH_LABELS = ["Allocated memory", "Active memory", "Requested memory", "GPU reserved memory",
                 "Non-releasable memory", "Allocations", "Active allocs", "GPU reserved segments",
                 "Non-releasable allocs", "Oversize allocations", "Oversize GPU segments"]


def test_cuda__test_memory_summary_labels_and_width(sim_cuda):
    """torch.cuda.memory_summary's layout: 75 columns plus the two '|' borders, torch's row
    labels, its OOM/retry line and its column header."""
    alloc = memory.device_allocator(0)
    ptr = alloc.malloc(5 * MiB)
    try:
        text = memory.memory_summary()
    finally:
        alloc.free(ptr)
    lines = text.splitlines()
    assert text.endswith("|\n")
    assert all(len(line) == 77 for line in lines), {len(line) for line in lines}
    assert lines[0] == "|" + "=" * 75 + "|"
    # torch: " {_:16} PyTorch CUDA memory summary, device ID {device:<17d} "; "accel" is 2 shorter
    assert lines[1] == "|" + " " * 18 + "accel CUDA memory summary, device ID 0" + " " * 19 + "|"
    assert lines[3] == ("|" + "  " + " " * 9 + " CUDA OOMs: 0            | " + " " * 6
                        + " cudaMalloc retries: 0         " + "|")
    assert lines[5] == "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |"
    labels = [line[1:].split("|")[0].strip() for line in lines if not line.startswith(("|-", "|="))][3:]
    assert [label for label in labels if not label.startswith("from")] == _TORCH_LABELS
    row = next(line for line in lines if line.startswith("| Allocated memory "))
    assert row == "| Allocated memory      |   5120 KiB |   5120 KiB |   5120 KiB |      0 B   |"
    short = memory.memory_summary(abbreviated=True)
    assert "from large pool" not in short and all(len(line) == 77 for line in short.splitlines())


def test_cuda__test_memory_summary_xpu(monkeypatch):
    """Other backends keep the widths with their own name and call: "XPU OOMs", and the
    device-allocation retries under the runtime's call name."""
    use_sim(monkeypatch, "xpu")
    memory.device_allocator(0)
    lines = memory.memory_summary().splitlines()
    assert all(len(line) == 77 for line in lines)
    assert "accel XPU memory summary, device ID 0" in lines[1]
    assert re.search(r"XPU OOMs: 0 +\| +zeMemAllocDevice retries: 0", lines[3]), lines[3]
