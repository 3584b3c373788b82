"""Realistic user programs, fourth round (r42).

Rounds one to three (test_user_programs.py, test_user_programs2.py, test_user_programs_r41.py,
test_examples.py) took streams, events, graphs, MemPools, OOM, fork and threads.  These take what
they left: accel.random (generators, checkpoints, graph-safe draws replayed), DLPack/CAI keyword
combinations and read-only imports, user kernels from threads and captures, events across
devices and dropped streams, and the environment (visible devices, ACCEL_ALLOC_CONF) in fresh
interpreters.
"""

import ctypes
import gc
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import accel
from accel import _dlpack
from test_user_programs import _devices, allocated, join_all, settle

R = accel.random


def _read_only_import(src: "accel.Buffer") -> "accel.Buffer":
    """What a producer of immutable arrays hands over: a versioned capsule flagged read-only."""
    cap = src.as_array(np.float32).__dlpack__(max_version=(1, 0))
    info = _dlpack.parse(cap)
    _dlpack.DLManagedTensorVersioned.from_address(info.address).flags |= _dlpack.FLAG_READ_ONLY
    return accel.from_dlpack(cap)


# -- 1. random fills into read-only memory -------------------------------------------------------
@pytest.mark.parametrize("fill", ["uniform_", "normal_", "randint_", "random_raw_"])
def test_random_fill_refuses_a_read_only_import(sim_backend, fill):
    """A user imports a read-only array (DLPack read-only flag) and, by mistake, fills it with
    random numbers: refused as fill_/copy_from refuse it, the producer's memory unchanged and
    the generator not advanced.  (The fills wrote into the read-only memory.)"""
    dev = _devices()[-1]
    data = np.arange(16, dtype=np.float32)
    src = accel.Buffer(data.nbytes, device=dev).copy_from(data)
    ro = _read_only_import(src)
    assert ro.readonly
    gen = R.Generator(dev, seed=3)
    args = {"randint_": (0, 5), }.get(fill, ())
    kw = {"dtype": "int32"} if fill == "randint_" else {}
    with pytest.raises(ValueError, match="read-only"):
        getattr(R, fill)(ro, *args, generator=gen, **kw)
    with pytest.raises(ValueError, match="read-only"):
        getattr(R, fill)(ro, *args, **kw)
    assert gen.offset == 0
    assert (src.to_numpy(np.float32) == data).all()
    del ro, src
    settle()


# -- 2. a generator run to the end of its offsets ------------------------------------------------
def test_generator_exhausted_offset_is_not_a_capture_error(sim_backend):
    """A long job sets a generator's offset near 2**63 (a checkpoint of a huge run) and draws:
    the refusal is a plain RuntimeError asking to reseed -- not accel.CaptureError, which says
    "illegal while a stream is being captured" when nothing captures -- and the generator then
    works after a reseed.  (It was raised as CaptureError.)"""
    dev = _devices()[-1]
    gen = R.Generator(dev, seed=1)
    gen.set_offset(2 ** 63 - 8)
    buf = accel.Buffer(4 * 64, device=dev)
    with pytest.raises(RuntimeError, match="reseed") as info:
        R.uniform_(buf, generator=gen)
    assert not isinstance(info.value, accel.CaptureError), repr(info.value)
    assert gen.offset == 2 ** 63 - 8
    default = R.default_generator(dev)
    saved = R.get_rng_state(dev)
    default.set_offset(2 ** 63 - 4)
    with pytest.raises(RuntimeError, match="reseed") as info:
        R.random_raw_(buf)
    assert not isinstance(info.value, accel.CaptureError), repr(info.value)
    R.set_rng_state(saved, dev)
    gen.manual_seed(1)
    R.uniform_(buf, generator=gen)
    assert gen.offset == 64


# -- 3. a __cuda_array_interface__ source on another device into a typed view -------------------
class _Foreign:
    """Another library's array over device memory (CuPy's cupy.asarray(view) looks like this)."""

    def __init__(self, cai: dict):
        self.__cuda_array_interface__ = cai


def test_view_copy_from_a_cai_array_of_another_device(sim_cuda):
    """A user wraps device 1's data in another library's array (CAI v3) and copies it into a typed
    view on device 0: refused with a clear error, as a view, Buffer or DLPack source of another
    device is, and both devices keep working; Buffer.copy_from (which copies between devices)
    takes the same source.  (The view queued the copy on device 0 reading device 1's memory
    without access: cudaErrorIllegalAddress, sticky -- every later call failed.)"""
    data = np.arange(64, dtype=np.float32)
    src = accel.Buffer(data.nbytes, device=1).copy_from(data)
    foreign = _Foreign(src.as_array(np.float32, (8, 8)).__cuda_array_interface__)
    strided = _Foreign(src.as_array(np.float32, (8, 4), strides=(32, 8)).__cuda_array_interface__)
    dst = accel.Buffer(data.nbytes, device=0)
    with pytest.raises(ValueError, match="device") as info:
        dst.as_array(np.float32, (8, 8)).copy_from(foreign)
    assert "cuda:1" in str(info.value) and "nothing was copied" in str(info.value), str(info.value)
    with pytest.raises(ValueError, match="device"):
        dst.as_array(np.float32, (8, 4)).copy_from(strided)
    assert (dst.fill_(0).to_numpy(np.float32) == 0).all()        # device 0 still works
    dst.copy_from(foreign)                                      # the Buffer path copies across
    assert (dst.to_numpy(np.float32) == data).all()
    mine = accel.Buffer(data.nbytes, device=1)
    mine.as_array(np.float32, (8, 4)).copy_from(strided)        # same device: a strided copy
    assert (mine.to_numpy(np.float32)[:32] == data.reshape(8, 8)[:, ::2].ravel()).all()
    del src, dst, mine, foreign, strided, info
    settle()
    assert allocated() == (0, 0)
