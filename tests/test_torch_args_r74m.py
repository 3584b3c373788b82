"""Argument handling of accel's module-level functions against torch 2.13 (r74m).

The oracle is the torch 2.13 CPU wheel where it answers without a GPU (``torch.manual_seed``,
``torch.cuda.manual_seed`` queues its callback but converts the seed at once, ``torch.Stream`` /
``torch.Event`` parse their device before needing one, ``torch._C._accelerator_*`` convert their
argument before looking for an accelerator), and torch's Python sources otherwise (quoted in each
test).  Intentional differences listed in README.md ("Where accel deliberately differs from
torch") are not tested here.
"""
import inspect
from decimal import Decimal

import numpy as np
import pytest

import accel
import accel.memory as M
import accel.random as R

try:
    import torch
except ImportError:     # pragma: no cover
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch (the oracle) is not installed")


class _IntOnly:
    """An object with ``__int__`` only (no ``__index__``), as int() takes it."""

    def __int__(self):
        return 7


# Seeds torch.cuda.manual_seed / manual_seed_all / torch.manual_seed take: each does
# ``seed = int(seed)`` first (torch/cuda/random.py, torch/random.py).  accel deliberately takes
# integers only (README, "Where accel deliberately differs from torch": a float or a string seed
# is a bug that int() would hide by truncating or parsing it); the refusal is a TypeError.
_INT_LIKE = [(1.5, 1), (True, 1), (np.float64(3.0), 3), ("42", 42), (_IntOnly(), 7), (Decimal(9), 9)]
_INT_LIKE_IDS = ["float", "bool", "np_float64", "digit_str", "__int__", "Decimal"]


@needs_torch
@pytest.mark.parametrize("value,expected", _INT_LIKE, ids=_INT_LIKE_IDS)
def test_manual_seed_refuses_what_torch_converts_with_int(sim_cuda, value, expected):
    assert torch.manual_seed(value).initial_seed() == expected     # oracle: torch/random.py int(seed)
    accel.set_device_index(1)
    R.manual_seed_all(1234)
    for seed_fn in (R.manual_seed, R.manual_seed_all):
        with pytest.raises(TypeError, match="seed"):
            seed_fn(value)
    assert (R.initial_seed(1), R.initial_seed(0)) == (1234, 1234)


@needs_torch
def test_manual_seed_integers_and_errors_match_torch(sim_cuda):
    """Where accel and torch agree: integer-likes, 64-bit wrap-around, overflow and None."""
    for value in (-1, -2 ** 63, 2 ** 64 - 1, np.int64(5), np.uint64(2 ** 64 - 1), torch.tensor(5)):
        want = torch.manual_seed(value).initial_seed()
        R.manual_seed_all(value)
        assert R.initial_seed(1) == want, value
    for value in (2 ** 64, -2 ** 63 - 1):
        with pytest.raises(ValueError):
            torch.manual_seed(value)
        with pytest.raises(ValueError):
            R.manual_seed(value)
    with pytest.raises(TypeError):
        torch.cuda.manual_seed(None)
    with pytest.raises(TypeError):
        R.manual_seed(None)
    with pytest.raises(TypeError):
        R.seed(1)           # torch.cuda.seed() takes no argument either


@needs_torch
def test_device_arguments_name_device_1_in_every_form(sim_cuda):
    """int, "cuda:1", accel.device and torch.device (README: same as torch.accelerator) reach
    device 1 from device 0 in the RNG, memory, stream and event functions."""
    for dev in (1, "cuda:1", accel.device("cuda", 1), torch.device("cuda", 1), np.int64(1)):
        accel.set_device_index(0)
        R.manual_seed_all(5)
        R.set_rng_state(R.get_rng_state(0), dev)
        assert R.initial_seed(dev) == 5 and bytes(R.get_rng_state(dev)) == bytes(R.get_rng_state(0))
        assert M.memory_allocated(dev) == 0
        M.reset_peak_memory_stats(dev)
        M.set_per_process_memory_fraction(0.5, dev)
        assert M.get_per_process_memory_fraction(dev) == 0.5
        assert accel.current_stream(dev).device.index == 1
        assert accel.Stream(dev).device.index == 1
        accel.Event(dev)
        accel.synchronize(dev)
        assert accel.current_device_index() == 0
        with accel.device_index(dev):
            assert accel.current_device_index() == 1
        accel.set_device_index(dev)
        assert accel.current_device_index() == 1
    assert M.get_per_process_memory_fraction(0) == 1.0


@needs_torch
def test_negative_and_float_devices_match_torch(sim_cuda):
    """torch.Stream(-1) / torch.Event(-1): RuntimeError "Device index must not be negative";
    1.0: TypeError (argument parsing); torch.accelerator.set_device_index(-1) is a no-op."""
    for make in (torch.Stream, torch.Event):
        with pytest.raises(RuntimeError, match="must not be negative"):
            make(-1)
        with pytest.raises(TypeError):
            make(1.0)
    torch.accelerator.set_device_index(-1)      # no accelerator needed for the no-op
    with pytest.raises(TypeError):
        torch._C._accelerator_setDeviceIndex(1.0)
    accel.set_device_index(1)
    accel.set_device_index(-1)
    assert accel.current_device_index() == 1
    for make in (accel.Stream, accel.Event):
        with pytest.raises(RuntimeError):
            make(-1)
    for fn in (accel.Stream, accel.Event, accel.set_device_index, accel.current_stream, accel.synchronize,
               R.initial_seed, M.memory_allocated):
        with pytest.raises(TypeError):
            fn(1.0)
    with pytest.raises(RuntimeError):
        accel.synchronize(-1)     # torch: c10::cuda::SetDevice(-1) "device id must be positive"
    assert accel.current_stream(-1).device.index == 1   # c10 getCurrentCUDAStream(-1): current device


@needs_torch
def test_event_flags_and_stream_priority_types_match_torch(sim_cuda):
    for kw in ("enable_timing", "blocking"):
        for bad in (1, None):
            with pytest.raises(TypeError):
                torch.Event("cpu", **{kw: bad})
            with pytest.raises(TypeError):
                accel.Event(1, **{kw: bad})
    for bad in (True, 1.0):
        with pytest.raises(TypeError):
            torch.Stream("cpu", priority=bad)
        with pytest.raises(TypeError):
            accel.Stream(1, priority=bad)
    assert accel.Stream(1, priority=np.int64(-1)).priority == -1


def test_set_per_process_memory_fraction_types_and_range_as_torch_cuda(sim_cuda):
    """torch/cuda/memory.py: ``if not isinstance(fraction, float): raise TypeError``;
    ``if fraction < 0 or fraction > 1: raise ValueError``.  np.float64 is a float, np.float32
    is not.  A refusal leaves the device's fraction as it was."""
    M.set_per_process_memory_fraction(np.float64(0.25), 1)
    for bad in (1, 0, True, np.float32(0.5), "0.5", None):
        with pytest.raises(TypeError, match="must be `float`"):
            M.set_per_process_memory_fraction(bad, 1)
    for bad in (1.5, -0.1, float("inf")):
        with pytest.raises(ValueError, match="Allowed range: 0~1"):
            M.set_per_process_memory_fraction(bad, 1)
    assert M.get_per_process_memory_fraction(1) == 0.25
    M.set_per_process_memory_fraction(0.0, device=1)
    M.set_per_process_memory_fraction(1.0, 1)
    assert M.get_per_process_memory_fraction(1) == 1.0


@needs_torch
def test_memory_queries_are_positional_only_as_torch_accelerator_memory(sim_cuda):
    """torch.accelerator.memory takes ``device_index=None, /`` (torch.cuda.memory's ``device=``
    keyword is not torch.accelerator's)."""
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
                 "memory_stats", "reset_peak_memory_stats", "reset_accumulated_memory_stats"):
        theirs = list(inspect.signature(getattr(torch.accelerator.memory, name)).parameters.values())
        ours = list(inspect.signature(getattr(M, name)).parameters.values())
        assert [(p.kind, p.default) for p in ours] == [(p.kind, p.default) for p in theirs], name
    assert M.memory_allocated(1) == 0
