"""The lead's fixes of session 28.

``roundup_power2_divisions`` reads its divisions as torch's parser does (std::stoull, then a
power-of-two check): a count past what a size_t holds is refused, as torch 2.13 refuses it
(``torch._C._accelerator_setAllocatorSettings("roundup_power2_divisions:18446744073709551616")``
raises "stoull"); accel took 2**64 as a division count.
"""

import pytest

from accel.memory import _config


@pytest.mark.parametrize("text", ["roundup_power2_divisions:18446744073709551616",
                                  "roundup_power2_divisions:[256:18446744073709551616,>:4]",
                                  "roundup_power2_divisions:[>:36893488147419103232]"])
def test_divisions_past_a_size_t_are_refused(text):
    with pytest.raises(_config.AllocatorConfigError, match="size_t"):
        _config.parse(text)


@pytest.mark.parametrize("div", [1, 2, 4, 1 << 32, 1 << 63])
def test_divisions_a_size_t_holds_are_taken(div):
    assert set(_config.parse(f"roundup_power2_divisions:{div}").roundup_power2_divisions) == {div}


def test_a_list_key_past_a_size_t_is_refused():
    with pytest.raises(_config.AllocatorConfigError, match="size_t"):
        _config.parse("roundup_power2_divisions:[36893488147419103232:4]")


@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_pinned_out_of_memory_names_the_bytes_asked_for(monkeypatch, kind):
    """A pinned allocation the host cannot hold says how much was asked for on every backend
    (CUDA's message was only cudaErrorMemoryAllocation's text)."""
    import accel
    from conftest import use_sim
    use_sim(monkeypatch, kind)
    size = 1 << 45
    with pytest.raises(accel.OutOfMemoryError, match=str(size)):
        accel.memory.host_allocator().malloc(size)
    assert accel.memory.host_memory_stats()["allocations.current"] == 0


# roundup_power2_divisions tables from torch 2.13's own parser (libc10:
# c10::CachingAllocator::setAllocatorSettings, then
# AcceleratorAllocatorConfig::roundup_power2_divisions(), a 10-line C++ program against the wheel's
# headers).  accel filled every interval up to each key: 1024 MiB between 512 and 2048 took 8 (r68b).
TORCH_DIVISIONS = {
    "[128:8,256:16,512:1,2048:8,>:2]": (8, 8, 8, 8, 8, 8, 8, 8, 16, 1, 0, 8, 2, 2, 2, 2),
    "[256:4]": (4,) * 9 + (0,) * 7,
    "[1:2,4:8]": (2, 0, 8) + (0,) * 13,
    "[>:2]": (0,) + (2,) * 15,
    "[>:2,256:4]": (4,) * 9 + (2,) * 7,
    "[256:4,128:2]": (4,) * 7 + (2, 4) + (0,) * 7,
    "[256:4,256:8]": (4,) * 8 + (8,) + (0,) * 7,
    "[65536:4]": (4,) * 16,
    "[32768:4,>:8]": (4,) * 16,
    "[1:1]": (1,) + (0,) * 15,
    "[2:1,>:4]": (1, 1) + (4,) * 14,
    "[128:8,>:2,512:1]": (8,) * 8 + (2, 1) + (2,) * 6,
}


@pytest.mark.parametrize("text", sorted(TORCH_DIVISIONS))
def test_division_lists_fill_intervals_as_torch(text):
    assert _config.parse(f"roundup_power2_divisions:{text}").roundup_power2_divisions == TORCH_DIVISIONS[text]
