"""The lead's fixes of session 29 that no helper's test covers.

A fill may draw from a generator of another device (torch checks only the device type, r69b), but
not inside a capture: the captured kernel reads the generator's state from that generator's device
memory at every replay.  The refusal comes before anything moves: the generator's offset stays,
and the capture goes on.
"""

import numpy as np
import pytest

import accel
from accel import random as R
from conftest import use_sim


def test_a_capture_refuses_another_devices_generator_and_keeps_going(monkeypatch):
    """(CUDA: Level Zero and Metal capture no random fills at all.)"""
    use_sim(monkeypatch, "cuda")
    gen0 = R.Generator(0, seed=3)
    buf = accel.Buffer(4096, device=1)
    s, g = accel.Stream(1), accel.Graph()
    with s, g:
        with pytest.raises(ValueError, match="generator of device 0"):
            R.random_raw_(buf, generator=gen0)
        R.random_raw_(buf, generator=R.default_generator(1))
    assert gen0.offset == 0
    g.replay()
    accel.synchronize(1)
    assert buf.to_numpy("uint32").any()
    R.random_raw_(buf, generator=gen0)          # outside a capture it draws (device 0 current)
    assert gen0.offset == 1024
    assert np.array_equal(buf.to_numpy("uint32"), R.philox.raw_words(3, 0, 1024))
