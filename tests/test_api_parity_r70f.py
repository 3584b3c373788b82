"""Round r70f: accel's public API against torch 2.13's, where a user's code would notice.

accel mirrors ``torch.accelerator`` (and ``torch.accelerator.memory``), and, under the same names,
the ``torch.cuda`` functions and classes it provides (streams, events, graphs, MemPool, the
memory snapshot/history functions, the NVML queries, ``torch.cuda.random``).  The installed
CPU wheel (torch 2.13.0+cpu) is the oracle wherever it can answer without a device:

* signatures (``inspect.signature``): every call torch accepts -- positional arguments,
  keywords, defaults -- must be accepted by accel's counterpart (test_reference_semantics.py
  already covers ``torch.accelerator`` and ``torch.cuda.random``; this file covers the
  ``torch.cuda`` counterparts, Stream/Event/Graph/MemPool methods and the C-level
  ``torch.Stream``/``torch.Event``/``torch.Generator`` forms, probed by calling them);
* return types: ints, bools, plain tuples (not named tuples), OrderedDicts with torch's key
  sets, ``record_event`` returning the event it was given, ``__enter__`` returning the stream,
  Graph/MemPool pool ids as ``tuple[int, int]``;
* objects: Stream identity (``device``, ``device_index``, ``device_type`` -- read back through
  ``torch.Stream(stream_id=, device_index=, device_type=)`` so the c10 numbers are torch's own),
  equality and hashing, Event before and after its first record, Generator methods;
* errors torch raises on the CPU wheel without a device: the same type and message from accel
  (``Event.elapsed_time`` refusals, non-bool Event flags, a positional Event flag, ``synchronize()``
  with no device, ``set_device_index(None)``, the deprecation warnings).

Deliberate differences accel documents (numpy instead of tensors, ``accel.device`` instead of
``torch.device``, ``Event(interprocess=True)`` refused at construction, TypeError for a
non-device argument) are not asserted against torch here.  Strict xfails carry reasons
starting "r70f:".
"""

import collections
import inspect
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.accelerator as tacc                # noqa: E402
import torch.cuda as tcuda                      # noqa: E402
import torch.cuda.memory as tcuda_memory        # noqa: E402
from torch.accelerator import _utils as tacc_utils  # noqa: E402

import accel                                    # noqa: E402
from accel import graphs as agraphs             # noqa: E402
from accel import memory as amemory             # noqa: E402
from accel import random as arandom             # noqa: E402

from conftest import use_sim                    # noqa: E402

_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)
_KEYWORD = (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY)


# ----------------------------------------------------------------------------- signatures
def _params(fn, drop_self: bool):
    params = list(inspect.signature(fn).parameters.values())
    return params[1:] if drop_self else params


def _refusals(theirs_fn, ours_fn, drop_theirs: bool = False, drop_ours: bool = False,
              ignore_torch_kwargs: bool = False) -> list:
    """Why a call ``theirs_fn`` accepts would be refused by ``ours_fn`` (empty: none would):
    a positional slot or keyword accel lacks, a default that differs, an argument accel
    requires that torch does not.  ``ignore_torch_kwargs``: torch's ``**kwargs`` only forwards
    named keywords to a C base (checked by name elsewhere)."""
    theirs, ours = _params(theirs_fn, drop_theirs), _params(ours_fn, drop_ours)
    by_name = {p.name: p for p in ours}
    ours_positional = [p for p in ours if p.kind in _POSITIONAL]
    var = {kind: any(p.kind == kind for p in ours) for kind in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)}
    problems = []
    for i, p in enumerate(theirs):
        if p.kind in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD):
            if not var[p.kind] and not (ignore_torch_kwargs and p.kind == _P.VAR_KEYWORD):
                problems.append(f"torch takes {'*' if p.kind == _P.VAR_POSITIONAL else '**'}{p.name}")
            continue
        mine = None
        if p.kind in _POSITIONAL:
            mine = ours_positional[i] if i < len(ours_positional) else None
            if mine is None and not var[_P.VAR_POSITIONAL]:
                problems.append(f"positional argument {i} ({p.name}) is not accepted")
                continue
        if p.kind in _KEYWORD:
            named = by_name.get(p.name)
            if (named is None or named.kind not in _KEYWORD) and not var[_P.VAR_KEYWORD]:
                problems.append(f"keyword {p.name}= is not accepted")
                continue
            mine = named if named is not None else mine
        if mine is not None and p.default is not _P.empty and mine.default != p.default:
            problems.append(f"{p.name}: default {mine.default!r}, torch's {p.default!r}")
    named = {p.name for p in theirs}
    for i, p in enumerate(ours):
        if p.kind in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD) or p.default is not _P.empty:
            continue
        slot = p.kind in _POSITIONAL and i < len(theirs) and theirs[i].kind in _POSITIONAL \
            and theirs[i].default is _P.empty
        if not slot and p.name not in named:
            problems.append(f"accel requires {p.name}, which torch does not")
    return problems


def _unwrapped(fn):
    return getattr(fn, "__wrapped__", fn)      # contextlib.contextmanager's wrapper


def _torch_cuda_pairs():
    """(label, torch's callable, accel's, drop torch's self, drop accel's self, ignore torch **kwargs)."""
    yield "Stream.__new__", tcuda.Stream.__new__, accel.Stream.__new__, True, True, True
    yield "ExternalStream", tcuda.ExternalStream.__new__, accel.ExternalStream, True, False, True
    for name in ("current_stream", "default_stream", "set_stream", "get_stream_from_external",
                 "get_device_properties", "is_current_stream_capturing", "is_initialized"):
        yield name, getattr(tcuda, name), getattr(accel, name), False, False, False
    yield "graph", tcuda.graph.__init__, _unwrapped(agraphs.graph), True, False, False
    yield "graph_pool_handle", tcuda.graph_pool_handle, agraphs.graph_pool_handle, False, False, False
    for name in ("can_device_access_peer", "clock_rate", "device_memory_used", "list_gpu_processes",
                 "memory_usage", "power_draw", "temperature", "utilization"):
        yield name, getattr(tcuda, name), getattr(accel, name), False, False, False
    for name in ("memory_summary", "memory_snapshot", "set_per_process_memory_fraction",
                 "get_per_process_memory_fraction", "host_memory_stats", "reset_peak_host_memory_stats",
                 "reset_accumulated_host_memory_stats", "empty_cache", "_record_memory_history",
                 "_snapshot", "_dump_snapshot", "_set_memory_metadata", "_get_memory_metadata",
                 "_allocation_traceback"):
        yield f"memory.{name}", getattr(tcuda_memory, name), getattr(amemory, name), False, False, False
    yield "MemPool", tcuda.MemPool.__init__, amemory.MemPool.__init__, True, True, False
    yield "MemPool.snapshot", tcuda.MemPool.snapshot, amemory.MemPool.snapshot, True, True, False
    yield "MemPool.use_count", tcuda.MemPool.use_count, amemory.MemPool.use_count, True, True, False
    yield "use_mem_pool", _unwrapped(tcuda_memory.use_mem_pool), _unwrapped(amemory.use_mem_pool), \
        False, False, False
    for name in ("record", "wait", "query", "elapsed_time", "synchronize"):
        yield f"Event.{name}", getattr(tcuda.Event, name), getattr(accel.Event, name), True, True, False
    for name in ("wait_event", "wait_stream", "record_event", "query", "synchronize"):
        yield f"Stream.{name}", getattr(tcuda.Stream, name), getattr(accel.Stream, name), True, True, False


@pytest.mark.parametrize("label, theirs, ours, drop_theirs, drop_ours, ignore_kwargs",
                         list(_torch_cuda_pairs()), ids=lambda v: v if isinstance(v, str) else "")
def test_torch_cuda_counterparts_accept_every_torch_call(label, theirs, ours, drop_theirs, drop_ours,
                                                        ignore_kwargs):
    """Each torch.cuda name accel provides takes torch.cuda's positional arguments, keywords and
    defaults (accel's torch.accelerator names -- synchronize, memory_stats, ... -- keep torch.
    accelerator's positional-only device and are checked in test_reference_semantics.py)."""
    assert _refusals(theirs, ours, drop_theirs, drop_ours, ignore_kwargs) == [], label


def test_stream_rebuild_keywords_torch_forwards_through_kwargs_are_accepted():
    """torch.cuda.Stream(**kwargs) forwards ``stream_id``, ``device_index``, ``device_type`` and
    ``priority`` to the C base (torch.Stream's second form); accel.Stream names them."""
    params = inspect.signature(accel.Stream).parameters
    for name in ("stream_id", "device_index", "device_type", "priority"):
        assert name in params and params[name].kind in _KEYWORD, name


def test_graph_methods_take_torch_accelerator_graph_calls():
    """accel.Graph is torch.accelerator.Graph (2.12+): the same constructor and methods; its
    keyword-only pool and capture_error_mode stay keyword-only, as torch's."""
    for name in ("__init__", "capture_begin", "capture_end", "instantiate", "replay", "reset", "pool",
                 "enable_debug_mode", "debug_dump", "__enter__", "__exit__"):
        assert _refusals(getattr(tacc.Graph, name), getattr(accel.Graph, name), True, True) == [], name
    ours = inspect.signature(accel.Graph.__init__).parameters
    assert ours["pool"].kind is _P.KEYWORD_ONLY and ours["capture_error_mode"].kind is _P.KEYWORD_ONLY
    assert ours["keep_graph"].default is False


# (r70f found; fixed in session 30)
def test_memory_stats_as_nested_dict_takes_torch_cuda_device_keyword():
    assert _refusals(tcuda_memory.memory_stats_as_nested_dict, amemory.memory_stats_as_nested_dict) == []


# ----------------------------------------------------------------------------- torch.accelerator queries
def _plain_int(value) -> bool:
    return type(value) is int


def test_queries_return_torch_accelerator_types(sim_backend):
    """The types torch.accelerator's functions return: int, bool, a device with no index, a
    plain 2-tuple (pybind's std::tuple, not a named tuple), an OrderedDict of ints sorted by key,
    a dict holding a set of supported dtypes."""
    last = accel.device_count() - 1
    assert _plain_int(accel.device_count()) and accel.is_available() is True
    acc = accel.current_accelerator()
    assert acc.type == sim_backend and acc.index is None and isinstance(acc.type, str)
    assert accel.current_accelerator(check_available=True) == acc
    assert _plain_int(accel.current_device_index())
    info = accel.get_memory_info(last)
    assert type(info) is tuple and len(info) == 2 and all(_plain_int(v) for v in info)
    assert 0 <= info[0] <= info[1]
    buf = accel.Buffer(1000, device=last)
    stats = accel.memory_stats(last)
    assert type(stats) is collections.OrderedDict and list(stats) == sorted(stats)
    assert all(_plain_int(v) for v in stats.values())
    for fn in (accel.memory_allocated, accel.max_memory_allocated, accel.memory_reserved,
               accel.max_memory_reserved):
        assert _plain_int(fn(last))
    assert accel.memory_allocated(last) == 1024
    for fn in (accel.reset_peak_memory_stats, accel.reset_accumulated_memory_stats):
        assert fn(last) is None
    assert accel.empty_cache() is None and accel.empty_host_cache() is None
    capability = accel.get_device_capability(last)
    assert type(capability) is dict and isinstance(capability["supported_dtypes"], set)
    assert accel.is_current_stream_capturing() is False
    assert accel.synchronize(last) is None and accel.set_device_index(0) is None
    del buf


def test_memory_stats_keys_are_torchs(sim_backend):
    """torch 2.13's memory_stats keys (torch/csrc/cuda/Module.cpp: ``allocation.*``, not the
    docstring's ``allocated.*``), plus the one extra accel's docstring names
    (``num_oom_rejections``); host_memory_stats has exactly the keys torch's docstring lists."""
    pooled = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
              "active_bytes", "inactive_split_bytes", "requested_bytes")
    metrics = ("current", "peak", "allocated", "freed")
    want = {f"{p}.{pool}.{m}" for p in pooled for pool in ("all", "small_pool", "large_pool") for m in metrics}
    want |= {f"{p}.{m}" for p in ("oversize_allocations", "oversize_segments") for m in metrics}
    want |= {"num_alloc_retries", "num_ooms", "max_split_size", "num_sync_all_streams",
             "num_device_alloc", "num_device_free"}
    buf = accel.Buffer(4096)
    keys = set(amemory.memory_stats())
    assert keys - want == {"num_oom_rejections"} and want <= keys
    assert "num_oom_rejections" in amemory.memory_stats.__doc__
    host_want = {f"{p}.{m}" for p in ("allocations", "allocated_bytes", "active_requests", "active_bytes")
                 for m in metrics}
    host_want |= {f"{p}.{m}" for p in ("host_alloc_time", "host_free_time")
                  for m in ("total", "max", "min", "count", "avg")}
    host_want |= {"num_host_alloc", "num_host_free"}
    pinned = accel.empty_pinned(64)
    host = amemory.host_memory_stats()
    assert type(host) is collections.OrderedDict and set(host) == host_want and list(host) == sorted(host)
    del buf, pinned


def test_snapshot_fields_are_torchs(sim_backend):
    """torch.cuda.memory._snapshot's documented layout (torch/cuda/memory.py Snapshot, Segment,
    Block, Frame, TraceEntry TypedDicts): accel's snapshot has at least those fields, with
    torch's value sets for segment_type and state and a (int, int) segment_pool_id."""
    amemory.record_history()
    try:
        keep = accel.Buffer(3000)
        gone = accel.Buffer(1 << 20)
        del gone
        snap = amemory._snapshot()
    finally:
        amemory.record_history(None)
    assert {"segments", "device_traces"} <= set(snap)
    assert snap["segments"]
    assert [seg["address"] for seg in snap["segments"]] == [seg["address"] for seg in amemory.memory_snapshot()]
    for seg in snap["segments"]:
        assert {"address", "total_size", "stream", "segment_type", "segment_pool_id", "allocated_size",
                "active_size", "blocks", "device"} <= set(seg)
        assert seg["segment_type"] in ("small", "large")
        pool = seg["segment_pool_id"]
        assert type(pool) is tuple and len(pool) == 2 and all(_plain_int(v) for v in pool)
        for block in seg["blocks"]:
            assert {"size", "requested_size", "address", "state", "frames"} <= set(block)
            assert block["state"] in ("active_allocated", "active_awaiting_free", "inactive")
    traces = [e for dev in snap["device_traces"] for e in dev]
    assert {"alloc", "free_requested", "free_completed"} <= {e["action"] for e in traces}
    for entry in traces:
        assert {"action", "frames", "size", "stream"} <= set(entry)
        for frame in entry["frames"]:
            assert {"filename", "line", "name"} <= set(frame)
    del keep


def test_deprecated_aliases_warn_as_torch(sim_backend):
    """current_device_idx / set_device_idx: torch's FutureWarning and text (read from torch's
    own deprecated wrappers, which warn before they find no device on the CPU wheel)."""
    def warning_of(fn, *args):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                fn(*args)
            except RuntimeError:
                pass                    # torch: no accelerator on the CPU wheel
        assert len(caught) == 1
        return caught[0].category, str(caught[0].message)

    assert warning_of(accel.current_device_idx) == warning_of(tacc.current_device_idx)
    assert warning_of(accel.set_device_idx, 0) == warning_of(tacc.set_device_idx, 0)


def test_set_device_index_none_error_is_torchs(sim_backend):
    """set_device_index(None): torch's ValueError and text, read from torch's _get_device_index
    (None needs no accelerator to be refused)."""
    with pytest.raises(ValueError) as theirs:
        tacc_utils._get_device_index(None, optional=False)
    with pytest.raises(ValueError) as ours:
        accel.set_device_index(None)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_no_device_answers_as_torch(monkeypatch, kind):
    """With the runtime's library but no device (a CUDA build of torch on a machine without a
    GPU): the defined answers torch gives, and synchronize() refused with the error the CPU
    wheel raises for it."""
    use_sim(monkeypatch, kind, ACCEL_SIM_DEVICES=0)
    assert accel.device_count() == 0 and accel.is_available() is False
    assert accel.current_accelerator(check_available=True) is None
    assert accel.memory_stats() == collections.OrderedDict() and accel.memory_allocated() == 0
    assert accel.empty_cache() is None
    assert accel.set_device_index(-1) is None
    with accel.device_index(None) as entered:
        assert entered is None
    with pytest.raises(RuntimeError) as theirs:
        tacc.synchronize()
    with pytest.raises(RuntimeError) as ours:
        accel.synchronize()
    assert (type(ours.value), str(ours.value)) == (type(theirs.value), str(theirs.value))
    with pytest.raises(RuntimeError):
        accel.current_device_index()


# ----------------------------------------------------------------------------- streams
def test_stream_identity_matches_torch_stream(sim_backend):
    """torch.Stream's attributes: device (with the index), device_index, device_type (the c10
    number: torch.Stream built from it names the same device type), stream_id and
    native_handle as ints; query() a bool; equal to the stream rebuilt from the three ids,
    with the same hash; unequal to other objects (``s == 1`` False, ``s != 1`` True)."""
    last = accel.device_count() - 1
    s = accel.Stream(last)
    assert s.device.type == sim_backend and s.device.index == s.device_index == last
    assert _plain_int(s.device_type) and _plain_int(s.stream_id) and _plain_int(s.native_handle)
    theirs = torch.Stream(stream_id=0, device_index=last, device_type=s.device_type)
    assert theirs.device.type == sim_backend and theirs.device_type == s.device_type
    same = accel.Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)
    assert same == s and hash(same) == hash(s)
    other = accel.Stream(last)
    assert other != s
    assert (s == 1) is False and (s != 1) is True
    assert s.query() is True and s.synchronize() is None and s.is_capturing() is False
    assert accel.default_stream(last).device_index == last
    assert accel.current_stream(last) == accel.current_stream(last) == accel.default_stream(last)


def test_stream_methods_return_what_torch_returns(sim_backend):
    """wait_event/wait_stream return None; record_event() a new recorded Event on the stream's
    device and record_event(event) that same event (torch returns the object it recorded);
    ``with stream`` enters as the stream itself and restores the current stream after."""
    last = accel.device_count() - 1
    s = accel.Stream(last)
    made = s.record_event()
    assert isinstance(made, accel.Event) and made.device == s.device and made.event_id != 0
    given = accel.Event()
    assert s.record_event(event=given) is given and given.device == s.device
    assert s.wait_event(given) is None and s.wait_stream(accel.default_stream(last)) is None
    before = accel.current_stream()
    with s as entered:
        assert entered is s and accel.current_stream() == s
        assert accel.current_device_index() == last
    assert accel.current_stream() == before
    assert accel.Stream.priority_range() == s.priority_range()
    least, greatest = accel.Stream.priority_range()
    assert type(least) is int and type(greatest) is int and greatest <= least
    assert accel.Stream(last, priority=greatest).priority == greatest


def test_set_stream_returns_none_and_switches_device(sim_backend):
    """torch.accelerator.set_stream: returns None and makes the stream's device current."""
    if accel.device_count() < 2:
        pytest.skip("needs two devices")
    s = accel.Stream(1)
    accel.set_device_index(0)
    assert accel.set_stream(s) is None
    assert accel.current_device_index() == 1 and accel.current_stream() == s


# ----------------------------------------------------------------------------- events
def test_event_before_and_after_record_as_torch_event(sim_backend):
    """torch.Event: device names only the type until recorded (index None), event_id 0, query()
    True; after record the recording stream's device and a nonzero id; elapsed_time a float;
    events compare by identity and are hashable."""
    last = accel.device_count() - 1
    start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    assert start.device.type == sim_backend and start.device.index is None
    assert start.event_id == 0 and start.query() is True
    assert start.synchronize() is None and start.wait() is None          # never recorded: no-ops
    s = accel.Stream(last)
    assert start.record(s) is None and end.record(stream=s) is None
    assert start.device == s.device and start.event_id != 0
    assert type(start.elapsed_time(end)) is float and start.elapsed_time(end_event=end) >= 0.0
    assert start.query() is True and end.wait(stream=s) is None
    assert start != end and start == start and len({start, end}) == 2


def test_event_refusals_are_torchs(sim_backend):
    """The refusals torch.Event makes on the CPU wheel, with their types and texts: elapsed_time
    between non-timing events, and between timing events not both recorded (ValueError); a
    non-bool flag and a flag given positionally (TypeError)."""
    def refusal(fn):
        with pytest.raises(Exception) as info:
            fn()
        return type(info.value), str(info.value)

    def theirs_plain():
        return torch.Event("cpu")

    def ours_plain():
        return accel.Event()

    for make_theirs, make_ours in ((theirs_plain, ours_plain),):
        t_err = refusal(lambda: make_theirs().elapsed_time(make_theirs()))
        o_err = refusal(lambda: make_ours().elapsed_time(make_ours()))
        assert o_err == t_err and t_err[0] is ValueError
    t_err = refusal(lambda: torch.Event("cpu", enable_timing=True).elapsed_time(
        torch.Event("cpu", enable_timing=True)))
    o_err = refusal(lambda: accel.Event(enable_timing=True).elapsed_time(accel.Event(enable_timing=True)))
    assert o_err == t_err and t_err[0] is ValueError
    for flag in ("enable_timing", "blocking"):
        assert refusal(lambda: torch.Event("cpu", **{flag: 1}))[0] is TypeError
        assert refusal(lambda: accel.Event(**{flag: 1}))[0] is TypeError
    assert refusal(lambda: torch.Event("cpu", True))[0] is TypeError
    assert refusal(lambda: accel.Event(accel.current_accelerator(), True))[0] is TypeError


def test_event_flags_are_keyword_only_as_torch_event():
    """torch.Event(device=None, *, enable_timing=False, blocking=False, interprocess=False)
    (torch.Event's docstring; the C class has no inspectable signature)."""
    params = inspect.signature(accel.Event).parameters
    assert list(params)[:4] == ["device", "enable_timing", "blocking", "interprocess"]
    assert params["device"].default is None and params["device"].kind in _POSITIONAL
    for name in ("enable_timing", "blocking", "interprocess"):
        assert params[name].kind is _P.KEYWORD_ONLY and params[name].default is False
    assert "Event(device=None, *, enable_timing=False" in (torch.Event.__doc__ or "")


# ----------------------------------------------------------------------------- graphs, pools
def test_graph_pool_ids_and_attributes_as_torch(sim_graph_backend):
    """torch.accelerator.Graph keeps ``graph_pool`` and ``capture_error_mode`` as attributes read
    at capture_begin (its reset() docstring: set them beforehand for the next capture);
    pool() and graph_pool_handle() and MemPool.id are plain (int, int) tuples; ``with g``
    enters as None."""
    handle = agraphs.graph_pool_handle()
    assert type(handle) is tuple and len(handle) == 2 and all(_plain_int(v) for v in handle)
    pool = amemory.MemPool()
    assert type(pool.id) is tuple and all(_plain_int(v) for v in pool.id)
    assert type(pool.use_count()) is int and type(pool.snapshot()) is list
    first = accel.Graph()
    assert first.graph_pool is None and first.capture_error_mode == "default"
    s = accel.Stream()
    with s:
        with first as entered:
            assert entered is None
            out = accel.Buffer(64, stream=s)
            out.fill_(1, s)
    assert type(first.pool()) is tuple and all(_plain_int(v) for v in first.pool())
    second = accel.Graph()
    second.graph_pool = first.pool()
    with s, second:
        out2 = accel.Buffer(64, stream=s)
        out2.fill_(2, s)
    assert second.pool() == first.pool()
    with accel.graph(accel.Graph(), pool=handle) as g:
        out3 = accel.Buffer(64, stream=accel.current_stream())
        out3.fill_(3, accel.current_stream())
    assert g.pool() == handle
    first.replay()
    second.replay()
    s.synchronize()
    del out, out2, out3


# ----------------------------------------------------------------------------- random
def test_generator_methods_return_torch_generator_types(sim_backend):
    """torch.Generator's methods: manual_seed returns the generator, seed()/initial_seed()/
    get_offset() ints, get_state() 16 bytes (accel: numpy uint8, documented), set_offset and
    set_state the generator, clone_state/graphsafe_get_state a Generator; device names the index.
    A negative seed is taken modulo 2**64 and 2**64 refused with ValueError, as torch's."""
    last = accel.device_count() - 1
    gen = arandom.Generator(last)
    assert gen.manual_seed(5) is gen and gen.initial_seed() == 5
    assert _plain_int(gen.seed()) and _plain_int(gen.initial_seed()) and gen.get_offset() == 0
    state = gen.get_state()
    assert state.dtype == np.uint8 and state.shape == (16,)
    # (torch's return the generator itself, THPGenerator_setOffset/setState: r73f)
    assert gen.set_offset(8) is gen and gen.get_offset() == 8 and gen.set_state(state) is gen
    assert isinstance(gen.clone_state(), arandom.Generator)
    assert isinstance(gen.graphsafe_get_state(), arandom.Generator)
    assert gen.device.type == sim_backend and gen.device.index == last
    assert gen.manual_seed(-1).initial_seed() == torch.Generator().manual_seed(-1).initial_seed()
    with pytest.raises(ValueError):
        torch.Generator().manual_seed(2 ** 64)
    with pytest.raises(ValueError):
        gen.manual_seed(2 ** 64)
    assert arandom.Generator(f"{sim_backend}:{last}").device.index == last    # torch's positional device


# (r70f found; fixed in session 30)
def test_generator_takes_torch_generator_device_keyword(sim_backend):
    last = accel.device_count() - 1
    gen = arandom.Generator(device=f"{sim_backend}:{last}")
    assert gen.device.index == last


# ----------------------------------------------------------------------------- devices
# (r70f found; fixed in session 30)
def test_accel_device_equals_the_torch_device_it_names(sim_backend):
    last = accel.device_count() - 1
    s = accel.Stream(last)
    theirs = torch.device(sim_backend, last)
    assert s.device == theirs and theirs == s.device
    assert {theirs: "found"}.get(s.device) == "found"
    assert accel.current_accelerator() == torch.device(sim_backend)
    assert s.device != torch.device("cpu")
