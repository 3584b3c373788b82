"""Allocator configuration written for torch must not break accel (issue 16, "Config written
for torch"): every key torch 2.13 accepts in PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF is
accepted, with torch's value checks (c10/core/AllocatorConfig.cpp,
c10/cuda/CUDAAllocatorConfig.cpp); a key accel does not implement gives one warning and is
ignored; accel-only keys are read only from ACCEL_ALLOC_CONF.  Named after the PyTorch
tests they port (test/test_cuda.py)."""

import warnings

import pytest

from accel import memory
from accel.memory import _config

from conftest import use_sim

MiB = 1 << 20

#: every key torch's parsers accept (REFERENCE.md), with a value torch accepts
TORCH_SETTING = ("backend:native,expandable_segments:False,max_split_size_mb:20,max_non_split_rounding_mb:40,"
                 "roundup_power2_divisions:[64:8,256:2,1024:1,>:1],garbage_collection_threshold:0.6,"
                 "release_lock_on_cudamalloc:True,release_lock_on_hipmalloc:False,"
                 "pinned_use_cuda_host_register:True,pinned_use_hip_host_register:False,"
                 "pinned_num_register_threads:8,pinned_use_background_threads:True,"
                 "pinned_reserve_segment_size_mb:64,graph_capture_record_stream_reuse:True,"
                 "per_process_memory_fraction:0.0")
NOT_IMPLEMENTED = ("release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
                   "pinned_use_hip_host_register", "pinned_num_register_threads",
                   "pinned_use_background_threads", "pinned_reserve_segment_size_mb",
                   "graph_capture_record_stream_reuse")


@pytest.mark.parametrize("variable", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_cuda__test_allocator_settings_every_torch_key(monkeypatch, variable):
    """Every key torch accepts parses; the implemented ones apply; the others give ONE
    warning (not one per device, not one per key) naming them, and are ignored."""
    use_sim(monkeypatch, "cuda", **{variable: TORCH_SETTING})
    with pytest.warns(UserWarning) as record:
        conf = memory.device_allocator(0).config
        memory.device_allocator(1)
    ours = [w for w in record if variable in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in record]
    message = str(ours[0].message)
    assert all(key in message for key in NOT_IMPLEMENTED) and "ignored" in message
    assert conf.max_split_size == 20 * MiB and conf.max_non_split_rounding == 40 * MiB
    assert conf.garbage_collection_threshold == 0.6 and conf.expandable_segments is False
    assert conf.per_process_memory_fraction == 0.0 and conf.backend == "native"
    assert conf.divisions_for(MiB) == 8 and conf.divisions_for(1 << 30) == 1


def test_cuda__test_allocator_settings_implemented_keys_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _config.parse("expandable_segments:True,max_split_size_mb:64", "PYTORCH_CUDA_ALLOC_CONF")


@pytest.mark.parametrize("variable", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_cuda__test_allocator_settings_accel_keys_only_from_accel_variable(monkeypatch, variable):
    """policy and release_threshold are accel's: from a PYTORCH_ variable (which torch also
    reads, and would refuse) they give one warning and are ignored, never an error."""
    monkeypatch.setenv(variable, "policy:torch,release_threshold:1G,max_split_size_mb:64")
    with pytest.warns(UserWarning, match=r"(?s)policy.*release_threshold.*ACCEL_ALLOC_CONF") as record:
        conf = _config.from_environment()
    assert len(record) == 1
    assert conf.policy == "accel" and conf.release_threshold is None and conf.max_split_size == 64 * MiB
    monkeypatch.setenv(variable, "policy:nonsense")           # not even validated: torch's variable
    with pytest.warns(UserWarning):
        assert _config.from_environment().policy == "accel"
    monkeypatch.setenv("ACCEL_ALLOC_CONF", "policy:torch,release_threshold:1G")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        conf = _config.from_environment()
    assert conf.policy == "torch" and conf.release_threshold == 1 << 30


@pytest.mark.parametrize("text, words", [
    ("expandable_segments:true", "Expected a single True/False argument for expandable_segments"),
    ("expandable_segments:1", "Expected a single True/False argument for expandable_segments"),
    ("release_lock_on_cudamalloc:none", "Expected a single True/False argument for release_lock_on_cudamalloc"),
    ("pinned_use_cuda_host_register:none", "True/False argument for pinned_use_cuda_host_register"),
    ("pinned_use_background_threads:yes", "True/False argument for pinned_use_background_threads"),
    ("graph_capture_record_stream_reuse:0", "True/False argument for graph_capture_record_stream_reuse"),
    ("pinned_num_register_threads:none", "pinned_num_register_threads"),
    ("pinned_num_register_threads:1024", "Number of register threads should be less than or equal to 128"),
    ("pinned_num_register_threads:3", "Number of register threads has to be power of 2"),
    ("pinned_num_register_threads:0", "Number of register threads has to be power of 2"),
    ("pinned_reserve_segment_size_mb:0", "greater than 0"),
    ("garbage_collection_threshold:1.2", "garbage_collection_threshold"),
    ("max_split_size_mb:2", "max_split_size_mb"),
    ("per_process_memory_fraction:1.5", "per_process_memory_fraction"),
    ("foo:1,bar:2", "foo"),
])
def test_cuda__test_allocator_settings_errors(text, words):
    """test_cuda.py::test_allocator_settings: the values torch refuses are refused (torch
    raises RuntimeError or ValueError; accel's error is both)."""
    for variable in ("ACCEL_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(ValueError, match=words):
                _config.parse(text, variable)
            with pytest.raises(RuntimeError, match=words):
                _config.parse(text, variable)


def test_cuda__test_allocator_settings_bounds_as_torch():
    """torch's bounds: max_split_size_mb >= 20 (20 itself is valid), 0 <= fraction <= 1."""
    assert _config.parse("max_split_size_mb:20").max_split_size == 20 * MiB
    assert _config.parse("per_process_memory_fraction:0").per_process_memory_fraction == 0.0
    assert _config.parse("per_process_memory_fraction:1").per_process_memory_fraction == 1.0


def test_cuda__test_set_per_process_memory_fraction_from_config(monkeypatch):
    """ACCEL_ALLOC_CONF=per_process_memory_fraction:F is the starting value (0.0 valid, as torch)."""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="per_process_memory_fraction:0.0")
    assert memory.get_per_process_memory_fraction() == 0.0
