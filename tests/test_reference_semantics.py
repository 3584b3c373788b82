"""The torch semantics /work/shared/REFERENCE.md states, one small test per behaviour that no
other test file checked (r17 audit).  Where torch 2.13 CPU is installed, accel's public
signatures are compared with torch's through ``inspect.signature``: every call torch accepts
(its positional arguments, its keywords, its defaults) must be accepted by accel too."""

import inspect
import struct

import numpy as np
import pytest

import accel
from accel import _lazy, memory
from accel import random as arandom

torch = pytest.importorskip("torch")

_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)
_KEYWORD = (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY)


def _params(fn, drop_self: bool):
    params = list(inspect.signature(fn).parameters.values())
    return params[1:] if drop_self and params and params[0].kind in _POSITIONAL else params


def _refusals(torch_fn, accel_fn, drop_self: bool = False) -> list:
    """Why some call ``torch_fn`` accepts would fail on ``accel_fn`` (empty: none would)."""
    theirs, ours = _params(torch_fn, drop_self), _params(accel_fn, drop_self)
    by_name = {p.name: p for p in ours}
    ours_positional = [p for p in ours if p.kind in _POSITIONAL]
    has_var = {kind: any(p.kind == kind for p in ours) for kind in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)}
    problems = []
    for i, p in enumerate(theirs):
        if p.kind in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD):
            if not has_var[p.kind]:
                problems.append(f"torch takes {'*' if p.kind == _P.VAR_POSITIONAL else '**'}{p.name}")
            continue
        if p.kind in _POSITIONAL:
            mine = ours_positional[i] if i < len(ours_positional) else None
            if mine is None and not has_var[_P.VAR_POSITIONAL]:
                problems.append(f"positional argument {i} ({p.name}) is not accepted")
                continue
        if p.kind in _KEYWORD:
            mine = by_name.get(p.name)
            if (mine is None or mine.kind not in _KEYWORD) and not has_var[_P.VAR_KEYWORD]:
                problems.append(f"keyword {p.name}= is not accepted")
                continue
        if mine is not None and p.default is not _P.empty and mine.default != p.default:
            problems.append(f"{p.name}: default {mine.default!r}, torch's {p.default!r}")
        if mine is not None and p.default is _P.empty and mine.default is not _P.empty:
            pass    # accel may default an argument torch requires
    named = {p.name for p in theirs}
    for i, p in enumerate(ours):
        if p.kind in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD) or p.default is not _P.empty:
            continue
        positional_slot = p.kind in _POSITIONAL and i < len(theirs) and theirs[i].kind in _POSITIONAL \
            and theirs[i].default is _P.empty
        if not positional_slot and p.name not in named:
            problems.append(f"accel requires {p.name}, which torch does not")
    return problems


def _torch_accelerator_pairs():
    import torch.accelerator as ta
    for name in ta.__all__:
        if name == "Graph":
            continue
        yield f"torch.accelerator.{name}", getattr(ta, name), getattr(accel, name)
    import torch.accelerator.memory as tm
    for name in tm.__all__:
        yield f"torch.accelerator.memory.{name}", getattr(tm, name), getattr(memory, name)
    tr = getattr(ta, "random", None)          # torch 2.14+
    for name in getattr(tr, "__all__", ()):
        yield f"torch.accelerator.random.{name}", getattr(tr, name), getattr(arandom, name)


@pytest.mark.parametrize("label, theirs, ours", list(_torch_accelerator_pairs()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_signature_accepts_every_torch_accelerator_call(label, theirs, ours):
    """REFERENCE "torch.accelerator semantics": same positional-only device arguments,
    keywords and defaults as torch.accelerator's functions."""
    assert _refusals(theirs, ours) == [], label


_GRAPH_METHODS = ("__init__", "capture_begin", "capture_end", "instantiate", "replay", "reset", "pool",
                  "enable_debug_mode", "debug_dump", "__enter__", "__exit__")


@pytest.mark.parametrize("method", _GRAPH_METHODS)
def test_graph_signature_accepts_every_torch_accelerator_graph_call(method):
    """REFERENCE: Graph(keep_graph=False, *, pool=None, capture_error_mode="default") and its
    methods, as torch.accelerator.Graph (2.12+)."""
    assert _refusals(getattr(torch.accelerator.Graph, method), getattr(accel.Graph, method),
                     drop_self=True) == [], method


@pytest.mark.parametrize("name", ["manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed",
                                  "get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all"])
def test_random_signature_accepts_every_torch_cuda_call(name):
    """REFERENCE: "manual_seed/seed/set_rng_state exist on torch.cuda (accel adds them here
    too)": accel.random's functions take torch.cuda.random's keywords (``manual_seed(seed=1)``,
    ``set_rng_state(state, device=1)``), apart from the "cuda" default of ``device`` (accel's
    None means the current device of whichever accelerator, as torch.accelerator.random)."""
    import torch.cuda.random as tcr
    problems = [p for p in _refusals(getattr(tcr, name), getattr(arandom, name))
                if not p.startswith("device: default None, torch's 'cuda'")]
    assert problems == [], name


# -- REFERENCE: Graph(..., capture_error_mode) -----------------------------------------------
def test_bad_capture_error_mode_is_a_runtime_error_as_torch(sim_graph_backend):
    """torch raises the bad-mode message from a TORCH_CHECK (RuntimeError) in capture_begin;
    accel refuses it at construction, with an error that is a RuntimeError too (and still the
    ValueError accel raised before)."""
    for make in (lambda: accel.Graph(capture_error_mode="bad"),
                 lambda: accel.graph(accel.Graph(), capture_error_mode="bad").__enter__()):
        with pytest.raises(RuntimeError, match="Unknown capture error mode. Expected `default`, `global`, "
                                               "`thread_local`, or `relaxed`, got bad") as info:
            make()
        assert isinstance(info.value, ValueError)
    g = accel.Graph()
    g.capture_error_mode = "sideways"       # torch reads the attribute at capture_begin
    with accel.Stream():
        with pytest.raises(RuntimeError, match="got sideways"):
            g.capture_begin()
        assert not accel.is_current_stream_capturing()


# -- REFERENCE: _lazy_call(fn, seed=, seed_all=) -----------------------------------------------
def test_lazy_call_runs_queued_calls_then_the_seeds_in_the_order_last_called(sim_cuda):
    """torch/cuda/__init__.py _lazy_init: the plain queued calls run first, then the kept
    seed calls (torch/_utils.py _LazySeedTracker: only the latest of each kind, in the order
    of those latest calls: manual_seed_all after manual_seed overwrites every device)."""
    order = []
    _lazy.lazy_call(lambda: order.append("seed1"), seed=True)
    _lazy.lazy_call(lambda: order.append("a"))
    _lazy.lazy_call(lambda: order.append("all1"), seed_all=True)
    _lazy.lazy_call(lambda: order.append("seed2"), seed=True)
    _lazy.lazy_call(lambda: order.append("all2"), seed_all=True)
    _lazy.lazy_call(lambda: order.append("b"))
    accel.current_device_index()
    assert order == ["a", "b", "seed2", "all2"]

    _lazy._reset_for_tests()
    order.clear()
    _lazy.lazy_call(lambda: order.append("all"), seed_all=True)
    _lazy.lazy_call(lambda: order.append("seed"), seed=True)
    accel.current_device_index()
    assert order == ["all", "seed"]


@pytest.mark.parametrize("last", ["manual_seed", "manual_seed_all"])
def test_seeding_before_init_keeps_torchs_order_of_latest_calls(sim_backend, last):
    """torch.cuda.manual_seed(2); manual_seed_all(1) before init leaves every device at 1;
    the other order leaves the current device at 2 and the others at 1."""
    if last == "manual_seed":
        arandom.manual_seed_all(1)
        arandom.manual_seed(2)
    else:
        arandom.manual_seed(2)
        arandom.manual_seed_all(1)
    accel.current_device_index()
    want = [2 if (i == 0 and last == "manual_seed") else 1 for i in range(accel.device_count())]
    assert [arandom.initial_seed(i) for i in range(accel.device_count())] == want


# -- REFERENCE: `with g:` = synchronize(); empty_cache(); empty_host_cache(); capture_begin() --
def test_graph_with_block_synchronizes_and_empties_both_caches_before_capture(sim_graph_backend, monkeypatch):
    calls = []
    from accel.graphs import graph_class as _graphs     # Graph.__enter__ looks it up there
    # "synchronize": the device synchronize `with g:` makes as one step with its no-capture check
    # (graphs.block._refuse_then_synchronize: under the capture gate, r65j), torch's synchronize()
    original_sync = _graphs._refuse_then_synchronize
    monkeypatch.setattr(_graphs, "_refuse_then_synchronize",
                        lambda *a: (calls.append("synchronize"), original_sync(*a))[1])
    for module, name in ((memory, "empty_cache"), (memory, "empty_host_cache")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _o=original, _n=name: (calls.append(_n), _o(*a))[1])
    original_begin = accel.Graph.capture_begin
    reserved = []
    monkeypatch.setattr(accel.Graph, "capture_begin", lambda self: (calls.append("capture_begin"),
                                                                    reserved.append(memory.memory_reserved(1)),
                                                                    original_begin(self))[2])
    s = accel.Stream(1)
    buf = accel.Buffer(4096, stream=s)
    with accel.device_index(1):
        del buf                                      # a cached block on device 1
        assert memory.memory_reserved(1) > 0
        g = accel.Graph()
        with s, g:
            assert calls == ["synchronize", "empty_cache", "empty_host_cache", "capture_begin"]
            work = accel.Buffer(64, stream=s)        # from the graph's private pool
            work.fill_(7, s)
    assert reserved == [0]          # the cache of the capture's device was empty when capture began
    g.replay()
    s.synchronize()
    assert (work.to_numpy() == 7).all()


# -- REFERENCE: memory_stats → empty OrderedDict before init ---------------------------------
def test_memory_stats_before_init_is_empty_whatever_the_device_argument(sim_backend):
    """torch.accelerator.memory_stats checks the allocator is initialized before it resolves
    the argument: another type or an index past the count give {} before init, errors after."""
    other = "xpu" if sim_backend != "xpu" else "cuda"
    for dev in (f"{other}:0", 5, None):
        stats = memory.memory_stats(dev)
        assert stats == {} and type(stats).__name__ == "OrderedDict"
    assert memory.memory_allocated(5) == 0 and memory.max_memory_reserved(f"{other}:0") == 0
    assert not _lazy.is_initialized()
    accel.current_device_index()
    with pytest.raises(ValueError, match=f"{other} doesn't match the current accelerator {sim_backend}."):
        memory.memory_stats(f"{other}:0")
    with pytest.raises(RuntimeError, match="out of range"):
        memory.memory_stats(5)
    assert len(memory.memory_stats(accel.device_count() - 1)) == 123   # a device nothing allocated on


# -- REFERENCE: flattened dotted keys; memory_allocated = allocated_bytes.all.current ... -----
def test_memory_query_functions_read_their_flat_keys(sim_backend):
    last = accel.device_count() - 1
    buf = accel.Buffer(3000, device=last)
    stats = memory.memory_stats(last)
    assert memory.memory_allocated(last) == stats["allocated_bytes.all.current"] == 3072
    assert memory.max_memory_allocated(last) == stats["allocated_bytes.all.peak"]
    assert memory.memory_reserved(last) == stats["reserved_bytes.all.current"]
    assert memory.max_memory_reserved(last) == stats["reserved_bytes.all.peak"]
    assert all(type(v) is int for v in stats.values())
    # non-negative, but for max_split_size: torch reports its "unlimited" default (SIZE_MAX
    # stored in an int64_t) as -1
    assert stats["max_split_size"] == -1
    assert all(v >= 0 for k, v in stats.items() if k != "max_split_size")
    del buf


# -- REFERENCE: CUDA RNG state: 16 bytes, seed uint64 then offset int64, host order ------------
def test_rng_state_layout_is_seed_then_offset_little_endian(sim_backend):
    last = accel.device_count() - 1
    arandom.set_rng_state(np.frombuffer(struct.pack("<Qq", 2**64 - 3, 40), np.uint8), last)
    state = arandom.get_rng_state(last)
    assert state.dtype == np.uint8 and state.shape == (16,)
    assert struct.unpack("<Qq", state.tobytes()) == (2**64 - 3, 40)
    assert arandom.initial_seed(last) == 2**64 - 3
    arandom.set_rng_state(np.frombuffer(struct.pack("<Q", 11), np.uint8), last)     # 8 bytes: seed only
    assert struct.unpack("<Qq", arandom.get_rng_state(last).tobytes()) == (11, 0)
    assert [s.tobytes() for s in arandom.get_rng_state_all()] == \
        [arandom.get_rng_state(i).tobytes() for i in range(accel.device_count())]


def test_lazy_call_failure_keeps_the_queue_without_doubling_the_seeds(sim_cuda):
    """A queued call that fails leaves the runtime uninitialized and the queue as it was (torch
    keeps _queued_calls); the next initialization runs the plain calls and each kept seed call
    once more, not twice."""
    order, fail = [], [True]

    def flaky():
        order.append("flaky")
        if fail[0]:
            raise ValueError("not yet")

    _lazy.lazy_call(flaky)
    _lazy.lazy_call(lambda: order.append("seed"), seed=True)
    with pytest.raises(accel.DeferredCallError, match="not yet"):
        accel.current_device_index()
    assert not accel.is_initialized()
    fail[0] = False
    accel.current_device_index()
    assert order == ["flaky", "flaky", "seed"]
    assert _lazy._queued == []


def test_random_functions_take_torch_cuda_keywords(sim_backend):
    """torch.cuda.manual_seed(seed=...), manual_seed_all(seed=...), get_rng_state(device=...),
    set_rng_state(new_state=..., device=...) work on accel.random as well."""
    last = accel.device_count() - 1
    arandom.manual_seed_all(seed=5)
    arandom.manual_seed(seed=9)
    assert arandom.initial_seed() == 9 and arandom.initial_seed(last) == (5 if last else 9)
    arandom.set_rng_state(new_state=np.frombuffer(struct.pack("<Qq", 3, 8), np.uint8), device=last)
    assert struct.unpack("<Qq", arandom.get_rng_state(device=last).tobytes()) == (3, 8)


# -- REFERENCE: set_stream(stream): type mismatch → RuntimeError ------------------------------
@pytest.mark.parametrize("kind", ["xpu", "mps"])
def test_set_stream_of_another_device_type_is_a_runtime_error(monkeypatch, kind):
    """torch.accelerator.set_stream refuses a stream of another device type with RuntimeError
    (TORCH_CHECK); a CUDA stream (``__cuda_stream__``) handed to accel on XPU or MPS is that
    case.  The error stays a ValueError too (accel's type before), and nothing changes."""
    from conftest import use_sim
    use_sim(monkeypatch, kind)

    class ForeignCudaStream:
        def __cuda_stream__(self):
            return (0, 4096)

    before = accel.current_stream()
    with pytest.raises(RuntimeError, match=f"is a CUDA stream .* but the accelerator is {kind}") as info:
        accel.set_stream(ForeignCudaStream())
    assert isinstance(info.value, ValueError)
    assert accel.current_stream() == before


# -- REFERENCE: current_accelerator(check_available) --------------------------------------------
@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_current_accelerator_names_the_type_without_index_and_none_when_unavailable(monkeypatch, kind):
    """A runtime whose library loads but shows no device: current_accelerator() is still its
    device type (index None), check_available=True gives None, device_count() 0; none of
    these initialize the runtime."""
    from conftest import use_sim
    use_sim(monkeypatch, kind, ACCEL_SIM_DEVICES=0)
    acc = accel.current_accelerator()
    assert acc == accel.device(kind) and acc.index is None
    assert accel.current_accelerator(check_available=True) is None
    assert accel.current_accelerator(True) is None
    assert accel.device_count() == 0 and accel.is_available() is False
    assert not _lazy.is_initialized()
    use_sim(monkeypatch, kind, ACCEL_SIM_DEVICES=2 if kind != "mps" else 1)
    assert accel.current_accelerator(check_available=True) == accel.device(kind)
    assert accel.current_accelerator(check_available=True).index is None


def test_get_device_properties_takes_torch_cuda_keyword(sim_backend):
    """torch.cuda.get_device_properties(device=None): accel's counterpart (torch.accelerator
    has none) takes the same keyword."""
    import torch.cuda
    assert _refusals(torch.cuda.get_device_properties, accel.get_device_properties) == []
    last = accel.device_count() - 1
    assert accel.get_device_properties(device=last) == accel.get_device_properties(last)


# -- REFERENCE: device_index(idx): enter exchanges the device, exit restores ---------------------
def test_device_index_exit_restores_even_when_it_named_the_current_device(sim_backend):
    """torch's __exit__ is maybeExchangeDevice(prev_idx), whatever the body did: entered on
    the device already current, a body that switches device is switched back."""
    if accel.device_count() < 2:
        pytest.skip("needs two devices")
    accel.set_device_index(1)
    with accel.device_index(1):
        accel.set_device_index(0)
    assert accel.current_device_index() == 1
    with accel.device_index(0):
        accel.set_device_index(1)
    assert accel.current_device_index() == 1


def test_stream_native_handle_and_event_id_are_torch_names_for_handle(sim_backend):
    """torch.Stream.native_handle and torch.Event.event_id (both torch attributes) are accel's
    ``handle``; event_id is 0 before the first record, and both raise once closed."""
    s = accel.Stream(accel.device_count() - 1)       # device 1 where there are two
    e = accel.Event()
    assert e.event_id == 0
    e.record(s)
    assert s.native_handle == s.handle != 0 and e.event_id == e.handle != 0
    e.synchronize()
    e.close()
    s.close()
    for obj, name in ((s, "native_handle"), (e, "event_id")):
        with pytest.raises((RuntimeError, ValueError)):
            getattr(obj, name)
