"""r75b: seeding in a child forked after initialization (bad fork) is dropped, as torch's
``_lazy_call`` queues it there for an initialization that never comes; the arguments are still
checked, so misuse raises in the child as it does in the parent."""

import struct

import numpy as np

import accel
import accel.random as R
from conftest import run_forked


def _child_misuse_still_raises() -> int:
    before = [bytes(R.default_generator(i).get_state()) for i in (0, 1)]
    bad = [(lambda: R.manual_seed(2 ** 64), ValueError, RuntimeError, TypeError),
           (lambda: R.manual_seed_all("x"), ValueError, RuntimeError, TypeError),
           (lambda: R.set_rng_state(np.zeros(3, np.uint8)), RuntimeError),
           (lambda: R.set_rng_state(np.zeros(16, np.uint8), 2), ValueError, RuntimeError, IndexError),
           (lambda: R.set_rng_state_all([np.zeros(16, np.uint8)] * 3), ValueError),
           (lambda: R.set_rng_state_all({0: 1}), TypeError)]
    for k, (call, *errors) in enumerate(bad):
        try:
            call()
        except tuple(errors):
            pass
        else:
            return 10 + k
    s, s_all = R.seed(), R.seed_all()
    if not (0 <= s < 2 ** 53 and 0 <= s_all < 2 ** 53):
        return 30
    if [bytes(R.default_generator(i).get_state()) for i in (0, 1)] != before:
        return 40
    return 0


def test_bad_fork_child_checks_seeding_arguments_then_drops_the_call(sim_cuda):
    R.manual_seed_all(5)
    R.random_raw_(accel.Buffer(16, 1))
    assert run_forked(_child_misuse_still_raises) == 0
    # the parent is untouched and still seeds as before
    assert struct.unpack("<Qq", R.get_rng_state(1).tobytes()) == (5, 4)
    R.manual_seed(6)
    assert R.initial_seed(0) == 6
