"""r73f: audit of ``accel.random`` against torch 2.13 (torch CPU as the oracle where the API is
device-independent; torch/cuda/random.py, torch/cuda/__init__.py ``_lazy_call``/``is_initialized``
and torch/csrc/Generator.cpp for the rest), on two simulated devices with work on device 1 while
device 0 is current.

Found (strict xfails):

* ``Generator.set_state`` / ``set_offset`` / ``graphsafe_set_state`` return None; torch's return
  the generator (torch/csrc/Generator.cpp ``THPGenerator_setState``/``setOffset``/
  ``graphSafeSetState``: ``Py_INCREF(self); return self``; torch/_C/__init__.pyi ``-> Generator``;
  on CPU ``g.set_state(s) is g``).
* In a child forked after initialization (bad fork), ``manual_seed``, ``manual_seed_all``,
  ``seed``, ``seed_all``, ``set_rng_state`` and ``set_rng_state_all`` change the default
  generators.  torch's ``is_initialized()`` is ``_initialized and not _is_in_bad_fork()``, so
  ``_lazy_call`` queues every one of them there and never runs it: ``default_generators[i]``
  keep the parent's states.  And accel's ``manual_seed``/``seed`` there land on device 0 even
  when the parent's thread had device 1 current.

Checked and fine (guards below): a random walk of every seeding/state call and fills across
two devices (device switches after init) against torch's rules on the three simulators; a
graph on device 1 (device 0 current) drawing from the default generator and a registered user
state replays N different draws and advances each state by its own rounded words per replay;
threads drawing from one state through a ``graphsafe_get_state`` alias never share a word;
seeding from a thread with device 1 current seeds device 1 only.
"""

import random
import struct
import threading

import numpy as np
import pytest

import accel
import accel.random as R
from accel.random import philox
from conftest import run_forked, use_sim


def _state(d):
    return struct.unpack("<Qq", R.get_rng_state(d).tobytes())


def _bytes(seed, offset):
    return np.frombuffer(struct.pack("<Qq", seed, offset), np.uint8).copy()


# -- Generator setters return the generator ---------------------------------------------------
def test_torch_generator_set_state_returns_the_generator_oracle():
    """Oracle: torch 2.13's Generator.set_state and manual_seed return the generator itself (CPU;
    set_offset and graphsafe_set_state do the same in Generator.cpp, CPU generators refuse them)."""
    torch = pytest.importorskip("torch")
    g = torch.Generator()
    assert g.set_state(g.get_state()) is g
    assert g.manual_seed(3) is g


# (r73f found; fixed in session 34)
@pytest.mark.parametrize("method", ["set_state", "set_offset", "graphsafe_set_state"])
def test_generator_setters_return_the_generator_as_torch(sim_cuda, method):
    gen = R.Generator(1, 5)
    arg = {"set_state": _bytes(9, 8), "set_offset": 12, "graphsafe_set_state": R.Generator(1, 7)}[method]
    out = getattr(gen, method)(arg)
    assert out is gen       # e.g. gen.set_state(s).get_offset(), as with torch.Generator


# -- seeding in a child forked after initialization ---------------------------------------------
def test_torch_queues_seeding_in_a_bad_fork_child_oracle(monkeypatch):
    """Oracle: torch.cuda in a child forked after init (``_initialized`` True, ``_is_in_bad_fork()``
    True): is_initialized() is False, so every seeding call is queued by _lazy_call and none runs
    (torch.cuda.default_generators untouched); a query raises the fork error."""
    torch = pytest.importorskip("torch")
    import torch._utils
    tc = torch.cuda
    monkeypatch.setattr(tc, "_initialized", True)
    monkeypatch.setattr(tc, "_is_in_bad_fork", lambda: True)
    monkeypatch.setattr(tc, "_lazy_seed_tracker", torch._utils._LazySeedTracker())
    monkeypatch.setattr(tc, "_queued_calls", [])
    gens = tc.default_generators
    assert not tc.is_initialized()
    state = torch.tensor(list(struct.pack("<Qq", 3, 8)), dtype=torch.uint8)
    assert tc.manual_seed(6) is None and tc.manual_seed_all(7) is None
    assert tc.seed() is None and tc.seed_all() is None
    assert tc.set_rng_state(state, 1) is None and tc.set_rng_state_all([state, state]) is None
    assert len(tc._queued_calls) == 5 and all(tc._lazy_seed_tracker.get_calls())
    assert tc.default_generators is gens
    with pytest.raises(RuntimeError, match="Cannot re-initialize CUDA in forked subprocess"):
        tc.get_rng_state(0)


def _child_seeds_everything() -> int:
    before = [bytes(R.default_generator(i).get_state()) for i in (0, 1)]
    calls = (lambda: R.manual_seed(6), lambda: R.manual_seed_all(7), R.seed, R.seed_all,
             lambda: R.set_rng_state(_bytes(3, 8), 1), lambda: R.set_rng_state_all([_bytes(3, 8)] * 2))
    for k, call in enumerate(calls):
        try:
            call()
        except Exception:       # noqa: BLE001  (torch queues each one: no error)
            return 10 + k
        now = [bytes(R.default_generator(i).get_state()) for i in (0, 1)]
        if now != before:
            return 20 + k       # a seeding call landed on a default generator
    return 0


# (r73f found; fixed in session 36)
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_bad_fork_child_seeding_leaves_the_default_generators(monkeypatch, kind):
    """Parent: manual_seed_all(5), device 1 current, a fill there (initializes; device 1's offset
    4), fork.  torch's child: every seeding call is queued, so default_generators[i] keep the
    parent's states (and the queries raise, as accel's do)."""
    use_sim(monkeypatch, kind)
    R.manual_seed_all(5)
    accel.set_device_index(1)
    R.random_raw_(accel.Buffer(16, 1))
    assert _state(0) == (5, 0) and _state(1) == (5, 4)
    assert run_forked(_child_seeds_everything) == 0


def _child_manual_seed_and_seed() -> int:
    before = bytes(R.default_generator(0).get_state())
    R.manual_seed(6)
    if bytes(R.default_generator(0).get_state()) != before:
        return 3
    R.seed()
    if bytes(R.default_generator(0).get_state()) != before:
        return 4
    return 0


# (r73f found; fixed in session 36)
def test_bad_fork_child_manual_seed_does_not_seed_a_device_that_was_not_current(sim_cuda):
    """Even under accel's own rule ("the child may seed its generators"), the current device of
    the forking thread was 1: device 0's generator must not take the child's seed."""
    R.manual_seed_all(5)
    accel.set_device_index(1)
    R.random_raw_(accel.Buffer(16, 1))
    assert run_forked(_child_manual_seed_and_seed) == 0


# -- guards: what was found fine ------------------------------------------------------------------
def test_seeding_walk_across_devices_matches_torchs_rules(sim_backend):
    """After init, with the current device switched: manual_seed (current device, offset 0; mod
    2**64), manual_seed_all, seed/seed_all (53 bits, offset 0), set_rng_state (None: current),
    set_rng_state_all (a prefix of the devices), Generator.manual_seed/set_offset, and fills
    (the buffer's device, words rounded up to 4) leave get_rng_state_all as torch's rules say."""
    rng = random.Random(73)
    accel.Buffer(4)
    n = accel.device_count()
    model = [[R.initial_seed(i), R.default_generator(i).offset] for i in range(n)]
    cur = accel.current_device_index()
    for step in range(120):
        op = rng.choice(["ms", "msa", "dev", "set", "fill", "seed", "seed_all", "setall", "gen", "off"])
        if op == "ms":
            v = rng.randrange(-2 ** 63, 2 ** 64)
            R.manual_seed(v)
            model[cur] = [v % 2 ** 64, 0]
        elif op == "msa":
            v = rng.randrange(2 ** 64)
            R.manual_seed_all(v)
            model = [[v, 0] for _ in range(n)]
        elif op == "dev":
            cur = rng.randrange(n)
            accel.set_device_index(cur)
        elif op == "set":
            d = rng.choice([None] + list(range(n)))
            s, o = rng.randrange(2 ** 64), 4 * rng.randrange(2 ** 20)
            R.set_rng_state(_bytes(s, o), d)
            model[cur if d is None else d] = [s, o]
        elif op == "fill":
            d, w = rng.randrange(n), rng.randrange(40)
            R.random_raw_(accel.Buffer(4 * w, d))
            model[d][1] += (w + 3) // 4 * 4
        elif op == "seed":
            v = R.seed()
            assert 0 <= v < 2 ** 53
            model[cur] = [v, 0]
        elif op == "seed_all":
            v = R.seed_all()
            model = [[v, 0] for _ in range(n)]
        elif op == "setall":
            states = [(rng.randrange(2 ** 64), 4 * rng.randrange(100)) for _ in range(rng.randrange(n + 1))]
            R.set_rng_state_all([_bytes(*t) for t in states])
            for i, t in enumerate(states):
                model[i] = list(t)
        elif op == "gen":
            d, v = rng.randrange(n), rng.randrange(2 ** 64)
            R.default_generator(d).manual_seed(v)
            model[d] = [v, 0]
        else:
            d, o = rng.randrange(n), 4 * rng.randrange(1000)
            R.default_generator(d).set_offset(o)
            model[d][1] = o
        got = [list(struct.unpack("<Qq", s.tobytes())) for s in R.get_rng_state_all()]
        assert got == model and R.initial_seed() == model[cur][0], (step, op)


def test_graph_on_device1_replays_fresh_draws_from_default_and_registered_states(sim_cuda):
    """Device 0 current; a graph captured on device 1 draws 10 words from device 1's default
    generator and 3 + 3 from a registered user generator.  The capture moves no offset; each of 4
    replays draws the numbers eager draws at the states' offsets would (different each time) and
    advances them by 12 and 8 (torch: replay_prologue's wholegraph_increment, rounded per draw)."""
    accel.Buffer(4)
    R.manual_seed_all(11)
    gen1, user = R.default_generator(1), R.Generator(1, 77)
    s = accel.Stream(1)
    a, b = accel.Buffer(4 * 10, 1, stream=s), accel.Buffer(4 * 3, 1, stream=s)
    g = accel.Graph()
    g.register_generator_state(user)
    with accel.graph(g, stream=s):
        R.random_raw_(a)
        R.random_raw_(b, generator=user)
        R.random_raw_(b, generator=user)
    assert accel.current_device_index() == 0 and gen1.offset == 0 and user.offset == 0
    seen = set()
    for i in range(4):
        o1, ou = gen1.offset, user.offset
        g.replay()
        assert (gen1.offset - o1, user.offset - ou) == (12, 8)
        got = a.to_numpy("uint32", stream=accel.current_stream(1))
        assert np.array_equal(got, philox.raw_words(11, o1, 10))
        assert np.array_equal(b.to_numpy("uint32", stream=accel.current_stream(1)), philox.raw_words(77, ou + 4, 3))
        seen.add(got.tobytes())
    assert len(seen) == 4 and _state(0) == (11, 0)
    g.reset()


def test_threads_sharing_a_state_through_an_alias_never_share_a_word(sim_backend):
    """Two threads fill buffers of the last device, one with its default generator and one with
    a graphsafe_get_state() alias of it (one state): every word drawn is distinct and from the
    seed's stream below the final offset."""
    R.manual_seed_all(3)
    last = accel.device_count() - 1
    gen = R.default_generator(last)
    alias = gen.graphsafe_get_state()
    out = [[], []]
    barrier = threading.Barrier(2)
    errors = []

    def work(k, generator):
        try:
            s = accel.Stream(last)
            barrier.wait(30)
            with s:
                for i in range(25):
                    b = accel.Buffer(4 * (1 + (i * 7 + k) % 9), last)
                    R.random_raw_(b, generator=generator)
                    out[k].append(b.to_numpy("uint32", stream=s))
        except BaseException as exc:    # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(0, None)), threading.Thread(target=work, args=(1, alias))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    words = np.concatenate([x for o in out for x in o]).tolist()
    assert len(set(words)) == len(words)
    assert set(words) <= set(philox.raw_words(3, 0, gen.offset).tolist())


def test_seeding_from_a_thread_with_device1_current_seeds_device1_only(sim_cuda):
    R.manual_seed_all(1)
    accel.Buffer(4)
    got = {}

    def work():
        accel.set_device_index(1)
        R.manual_seed(9)
        got["after_manual"] = _state(1)
        got["seed"] = R.seed()

    t = threading.Thread(target=work)
    t.start()
    t.join(30)
    assert accel.current_device_index() == 0
    assert got["after_manual"] == (9, 0)
    assert _state(0) == (1, 0) and _state(1) == (got["seed"], 0)
