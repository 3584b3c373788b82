"""Adversarial checks of accel.memory.attach_out_of_memory_observer / detach_out_of_memory_observer
and _set_memory_metadata / _get_memory_metadata (r51): re-entrant observers (allocating, running
out of memory themselves, freeing, emptying the cache, attaching and detaching), every OOM path,
several threads, device 1 while 0 is current, and metadata through history, snapshots, pickles
and the viewer."""

import contextlib
import pickle
import sys
import threading

import pytest

import accel
from accel import OutOfMemoryError, memory
from accel.memory import _oom_hooks

from conftest import run_forked, use_sim

MiB = 1 << 20


@pytest.fixture(params=[0, 1], ids=["device0", "device1"])
def device(request, monkeypatch):
    use_sim(monkeypatch, "cuda")
    return request.param


@pytest.fixture(params=["native", "backend:cudaMallocAsync"])
def any_backend(request, monkeypatch):
    if request.param == "native":
        use_sim(monkeypatch, "cuda")
    else:
        use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF=request.param)
    return request.param


def _total(device):
    return memory.get_memory_info(device)[1]


def _allocated(device):
    return memory.memory_stats(device)["allocated_bytes.all.current"]


def _works(device):
    """The allocator of ``device`` still hands out and takes back memory, and has nothing allocated."""
    b = accel.Buffer(MiB, device=device)
    b.close()
    assert _allocated(device) == 0


# ------------------------------------------------------------------ re-entrant observers
@pytest.mark.parametrize("where", ["same", "other"])
def test_an_observer_may_allocate_on_either_device(any_backend, where):
    got = []

    def cb(dev, *rest):
        target = dev if where == "same" else 1 - dev
        b = accel.Buffer(MiB, device=target)
        got.append((dev, target, _allocated(target)))
        b.close()

    memory.attach_out_of_memory_observer(cb)
    with accel.device_index(0):
        with pytest.raises(OutOfMemoryError):
            accel.Buffer(2 * _total(1), device=1)
    assert got == [(1, 1 if where == "same" else 0, MiB)]
    _works(0)
    _works(1)


@pytest.mark.parametrize("where", ["same", "other"])
def test_an_observer_whose_own_allocation_runs_out_of_memory(any_backend, where):
    """An observer that itself asks for too much: its OOM goes to the observers again (as
    torch's, which calls them on every OOM): one level deeper, not without end, when the
    observer only allocates at the top level.  No deadlock, and both allocators still work."""
    depth = []

    def cb(dev, tried, allowed, free):
        depth.append(dev)
        if len(depth) == 1:
            target = dev if where == "same" else 1 - dev
            accel.Buffer(2 * _total(target), device=target)

    memory.attach_out_of_memory_observer(cb)
    with pytest.raises(OutOfMemoryError) as info:
        accel.Buffer(2 * _total(1), device=1)
    assert depth == [1, 1 if where == "same" else 0]
    # the observer's OOM propagates, with the first OOM as its context
    assert isinstance(info.value.__context__, OutOfMemoryError)
    assert memory.memory_stats(1)["num_ooms"] == (2 if where == "same" else 1)
    _works(0)
    _works(1)


def test_nested_observer_ooms_twenty_deep(any_backend):
    """An observer that allocates too much again on each of its first twenty calls: each OOM
    calls the observers again (as torch's), each level's OOM is the next one's context, and
    the allocators are left as they were."""
    calls = []

    def cb(dev, *rest):
        calls.append(dev)
        if len(calls) <= 20:
            accel.Buffer(2 * _total(1 - dev), device=1 - dev)     # alternate the devices

    memory.attach_out_of_memory_observer(cb)
    with pytest.raises(OutOfMemoryError) as info:
        accel.Buffer(2 * _total(1), device=1)
    assert calls == [1, 0] * 10 + [1]
    depth, exc = 0, info.value
    while exc is not None:       # (cudaMallocAsync's OOMs carry the runtime's, suppressed, as context)
        depth, exc = depth + (exc.observer_args is not None), exc.__context__
    assert depth == 21
    assert memory.memory_stats(0)["num_ooms"] == 10 and memory.memory_stats(1)["num_ooms"] == 11
    _works(0)
    _works(1)


def test_an_observer_that_always_allocates_too_much_ends_in_recursionerror(any_backend, monkeypatch):
    """A careless observer allocates too much on every call: the recursion ends in RecursionError
    (as torch's), which then strikes at any call inside the allocator, under its lock or not.
    Whatever depth it strikes at, the allocators are left consistent.  (The simulator's cffi
    callbacks may meet it too: their errors are unraisable, and the call returns 999.)"""
    monkeypatch.setattr(sys, "unraisablehook", lambda args: None)
    total = _total(1)

    def cb(dev, *rest):
        accel.Buffer(2 * total, device=dev)

    memory.attach_out_of_memory_observer(cb)
    old = sys.getrecursionlimit()
    for extra in range(40, 300, 7):
        keep = accel.Buffer(3 * MiB, device=1)
        sys.setrecursionlimit(len(__import__("inspect").stack(0)) + extra)
        try:
            with pytest.raises((RecursionError, OutOfMemoryError, accel.AcceleratorError)):
                accel.Buffer(2 * total, device=1)
        finally:
            sys.setrecursionlimit(old)
        keep.close()
        assert _allocated(1) == 0, extra
    memory.detach_out_of_memory_observer(cb)
    _works(0)
    _works(1)
    memory.empty_cache()
    assert memory.memory_reserved(1) == 0


def test_an_observer_that_frees_and_empties_the_cache(any_backend):
    keep = [accel.Buffer(4 * MiB, device=1), accel.Buffer(4 * MiB, device=0)]
    seen = []

    def cb(dev, *rest):
        while keep:
            keep.pop().close()
        memory.empty_cache()
        with accel.device_index(dev):
            memory.empty_cache()
        seen.append((_allocated(0), _allocated(1), memory.memory_reserved(1)))

    memory.attach_out_of_memory_observer(cb)
    with pytest.raises(OutOfMemoryError):
        accel.Buffer(2 * _total(1), device=1)
    assert seen == [(0, 0, 0)]
    _works(1)


def test_an_observer_that_drops_the_last_reference_to_a_buffer(any_backend):
    """The Buffer's finalizer frees in the observer: the lock is not held then."""
    box = {"b": accel.Buffer(MiB, device=1)}

    def cb(*args):
        del box["b"]

    memory.attach_out_of_memory_observer(cb)
    with pytest.raises(OutOfMemoryError):
        accel.Buffer(2 * _total(1), device=1)
    assert _allocated(1) == 0


def test_attach_and_detach_during_the_call(any_backend):
    calls = []

    def late(*a):
        calls.append("late")

    def second(*a):
        calls.append("second")

    def first(*a):
        calls.append("first")
        memory.detach_out_of_memory_observer(first)
        memory.detach_out_of_memory_observer(second)   # already taken for this OOM: still called
        memory.attach_out_of_memory_observer(late)     # from the next OOM on

    memory.attach_out_of_memory_observer(first)
    memory.attach_out_of_memory_observer(second)
    with pytest.raises(OutOfMemoryError):
        accel.Buffer(2 * _total(0), device=0)
    assert calls == ["first", "second"]
    with pytest.raises(OutOfMemoryError):
        accel.Buffer(2 * _total(1), device=1)
    assert calls == ["first", "second", "late"]


def test_the_same_observer_attached_twice_is_called_twice(device):
    calls = []

    def cb(*args):
        calls.append(args)

    memory.attach_out_of_memory_observer(cb)
    memory.attach_out_of_memory_observer(cb)
    with pytest.raises(OutOfMemoryError):
        accel.Buffer(2 * _total(device), device=device)
    assert len(calls) == 2
    memory.detach_out_of_memory_observer(cb)
    with pytest.raises(OutOfMemoryError):
        accel.Buffer(2 * _total(device), device=device)
    assert len(calls) == 3


def test_an_observer_raising_keyboardinterrupt(any_backend):
    def cb(*args):
        raise KeyboardInterrupt

    later = []
    memory.attach_out_of_memory_observer(cb)
    memory.attach_out_of_memory_observer(later.append)
    with pytest.raises(KeyboardInterrupt) as info:
        accel.Buffer(2 * _total(1), device=1)
    assert isinstance(info.value.__context__, OutOfMemoryError)
    assert later == []                          # the observers after it are not called, as torch's
    memory.detach_out_of_memory_observer(cb)
    _works(1)
    _works(0)


def test_an_observer_raising_systemexit_and_generatorexit(device):
    for exc in (SystemExit(3), GeneratorExit()):
        def cb(*args, exc=exc):
            raise exc
        memory.attach_out_of_memory_observer(cb)
        with pytest.raises(type(exc)):
            accel.Buffer(2 * _total(device), device=device)
        memory.detach_out_of_memory_observer(cb)
    _works(device)


# ------------------------------------------------------------------ every OOM path calls them once
def test_device_allocator_malloc_on_device1_while_0_is_current(any_backend):
    called = []
    memory.attach_out_of_memory_observer(lambda *a: called.append(a))
    total = _total(1)
    with accel.device_index(0):
        with pytest.raises(OutOfMemoryError):
            memory.device_allocator(1).malloc(total + 8 * MiB)
    assert len(called) == 1
    dev, tried, allowed, free = called[0]
    assert dev == 1 and tried >= total + 8 * MiB and allowed == total and 0 <= free <= total
    assert accel.current_device_index() == 0


def test_fraction_on_device1_while_0_is_current(any_backend):
    called = []
    memory.attach_out_of_memory_observer(lambda *a: called.append(a))
    total = _total(1)
    with accel.device_index(0):
        memory.set_per_process_memory_fraction(0.3, 1)
        with pytest.raises(OutOfMemoryError):
            accel.Buffer(total // 2, device=1)
        b = accel.Buffer(total // 2, device=0)      # device 0 has no cap
        b.close()
    assert len(called) == 1
    assert called[0][0] == 1 and called[0][2] == int(total * 0.3)
    # the allowed bytes the observer sees are the ones the message states
    memory.set_per_process_memory_fraction(1.0, 1)
    with pytest.raises(OutOfMemoryError):
        accel.Buffer(2 * total, device=1)
    assert called[1][2] == total


def test_the_fraction_cap_reached_by_many_small_allocations(device):
    called = []
    memory.attach_out_of_memory_observer(lambda *a: called.append(a))
    memory.set_per_process_memory_fraction(0.1, device)
    held = []
    with pytest.raises(OutOfMemoryError):
        for _ in range(10_000):
            held.append(accel.Buffer(8 * MiB, device=device))
    assert len(called) == 1 and called[0][0] == device
    assert called[0][2] == int(_total(device) * 0.1)
    assert called[0][1] == 8 * MiB
    for b in held:
        b.close()


def test_expandable_segments_grow_oom(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="expandable_segments:True")
    called = []
    memory.attach_out_of_memory_observer(lambda *a: called.append(a))
    total = _total(1)
    a = accel.Buffer(total // 2, device=1)
    with accel.device_index(0):
        with pytest.raises(OutOfMemoryError):
            accel.Buffer(total // 2 + 64 * MiB, device=1)
    assert len(called) == 1 and called[0][0] == 1 and called[0][2] == total
    a.close()
    _works(1)


def test_a_mempool_allocation_oom(device):
    called = []
    memory.attach_out_of_memory_observer(lambda *a: called.append(a))
    with accel.device_index(device):
        pool = memory.MemPool()
        with memory.use_mem_pool(pool):
            b = accel.Buffer(MiB, device=device)
            with pytest.raises(OutOfMemoryError):
                accel.Buffer(2 * _total(device), device=device)
            b.close()
    assert len(called) == 1 and called[0][0] == device


@pytest.mark.filterwarnings("ignore:The .* Graph is empty")
def test_an_observer_during_a_graph_capture(sim_graph_backend):
    """An OOM in a capture (the graph's private pool): the observer is called once and may
    query the allocator; the capture can still be ended."""
    from accel.graphs import Graph
    called = []

    def cb(*a):
        called.append((a, memory.memory_stats(a[0])["num_ooms"]))

    memory.attach_out_of_memory_observer(cb)
    s = accel.Stream()
    with s:
        g = Graph()
        g.capture_begin()
        try:
            with pytest.raises(OutOfMemoryError):
                accel.Buffer(2 * _total(0))
        finally:
            g.capture_end()
    assert len(called) == 1 and called[0][0][0] == 0 and called[0][1] == 1


def test_pinned_host_oom_calls_no_device_observer(device):
    called = []
    memory.attach_out_of_memory_observer(lambda *a: called.append(a))
    with pytest.raises(OutOfMemoryError):
        memory.host_allocator().malloc(1 << 61)
    assert called == []


def test_observers_from_several_threads_at_once(any_backend):
    """Eight threads run out of memory together (four per device): each OOM calls the
    observer once with its own device, and a slow observer blocks no other thread's allocator."""
    calls = []
    gate = threading.Barrier(8)
    inside = threading.Barrier(8, timeout=60)

    def cb(dev, *rest):
        inside.wait()          # all eight are in an observer at once: no lock is held
        calls.append(dev)

    memory.attach_out_of_memory_observer(cb)
    errors = []
    totals = {0: _total(0), 1: _total(1)}

    def worker(dev):
        gate.wait()
        try:
            accel.Buffer(2 * totals[dev], device=dev)
        except OutOfMemoryError:
            pass
        except BaseException as exc:       # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i % 2,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert sorted(calls) == [0] * 4 + [1] * 4


def test_observers_survive_a_reset(device):
    """_lazy._reset_for_tests forgets the observers (a fresh process state); a forked child keeps them."""
    from accel import _lazy
    calls = []
    memory.attach_out_of_memory_observer(lambda *a: calls.append(a))

    def child():
        try:
            accel.Buffer(2 * _total(device), device=device)
        except OutOfMemoryError:
            pass
        return 0 if len(calls) == 1 else 5

    assert run_forked(child) == 0
    _lazy._reset_for_tests()
    assert _oom_hooks._oom_observers == []


def test_observer_args_are_plain_ints(any_backend):
    called = []
    memory.attach_out_of_memory_observer(lambda *a: called.append(a))
    with pytest.raises(OutOfMemoryError):
        accel.Buffer(2 * _total(1), device=1)
    assert len(called[0]) == 4 and all(type(x) is int for x in called[0])


# ------------------------------------------------------------------ metadata
@contextlib.contextmanager
def _history(*args, **kwargs):
    """Memory history recorded (``_record_memory_history(*args, **kwargs)``) for the block only."""
    memory._record_memory_history(*args, **kwargs)
    try:
        yield
    finally:
        memory._record_memory_history(None)


def _events(device):
    return memory._snapshot()["device_traces"][device]


def test_metadata_set_on_device1_while_0_is_current_and_allocating_from_0(device):
    with _history():
        with accel.device_index(1):
            memory._set_memory_metadata("dev1 tag")
        with accel.device_index(0):
            assert memory._get_memory_metadata() == ""
            b1 = accel.Buffer(MiB, device=1)
            b0 = accel.Buffer(MiB, device=0)
        assert {e["user_metadata"] for e in _events(1)} == {"dev1 tag"}
        assert {e["user_metadata"] for e in _events(0)} == {""}
        b1.close()
        b0.close()


def test_metadata_set_while_history_is_off_is_recorded_once_it_is_on(device):
    with accel.device_index(device):
        memory._set_memory_metadata("before history")
        accel.Buffer(MiB, device=device).close()
        with _history():
            accel.Buffer(MiB, device=device).close()
            first = [e["user_metadata"] for e in _events(device)]
            memory._record_memory_history(None)
            memory._set_memory_metadata("while off")
            memory._record_memory_history()
            accel.Buffer(MiB, device=device).close()
            tags = [e["user_metadata"] for e in _events(device)]
    assert first and set(first) == {"before history"}
    assert tags and tags[-1] == "while off"


@pytest.mark.parametrize("context", [None, "state", "alloc", "all"])
def test_metadata_under_every_context(device, context):
    with _history("all", context=context):
        with accel.device_index(device):
            memory._set_memory_metadata(f"ctx={context}")
            b = accel.Buffer(MiB, device=device)
            b.close()
        events = _events(device)
        assert events and {e["user_metadata"] for e in events} == {f"ctx={context}"}


def test_metadata_on_the_oom_entry_of_device1(device):
    with _history():
        with accel.device_index(1):
            memory._set_memory_metadata("oom phase")
        with accel.device_index(0):
            with pytest.raises(OutOfMemoryError):
                accel.Buffer(2 * _total(1), device=1)
        ooms = [e for e in _events(1) if e["action"] == "oom"]
        assert len(ooms) == 1 and ooms[0]["user_metadata"] == "oom phase"


def test_metadata_set_from_an_observer_tags_later_entries(device):
    with _history():
        def cb(dev, *rest):
            with accel.device_index(dev):
                memory._set_memory_metadata("after oom")

        memory.attach_out_of_memory_observer(cb)
        with pytest.raises(OutOfMemoryError):
            accel.Buffer(2 * _total(device), device=device)
        accel.Buffer(MiB, device=device).close()
        events = _events(device)
        oom = [i for i, e in enumerate(events) if e["action"] == "oom"][0]
        assert events[oom]["user_metadata"] == ""
        assert {e["user_metadata"] for e in events[oom + 1:]} == {"after oom"}


@pytest.mark.parametrize("value", ["x" * 1_000_000, "日本語 ✓ \U0001F600 \x00 nul", "\ud800"])
def test_long_and_unicode_metadata_through_dump_snapshot(device, value, tmp_path):
    path = tmp_path / "snap.pickle"
    with _history():
        with accel.device_index(device):
            memory._set_memory_metadata(value)
            assert memory._get_memory_metadata() == value
            accel.Buffer(MiB, device=device).close()
        memory.dump_snapshot(str(path))
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert {e["user_metadata"] for e in snap["device_traces"][device]} == {value}


# r51 found: a str subclass was kept as it is (_get_memory_metadata returned it; dump_snapshot pickled
# its class, which the viewer refuses, or failed on an unpicklable one); a plain str is stored now.


class _Tag(str):
    """A str subclass (an enum-like tag): torch stores a std::string, so a plain str comes back."""


def test_a_str_subclass_is_stored_as_a_plain_str(any_backend):
    device = 1
    with accel.device_index(device):
        memory._set_memory_metadata(_Tag("phase"))
        got = memory._get_memory_metadata()
    assert got == "phase" and type(got) is str


def test_a_str_subclass_metadata_leaves_a_plain_data_snapshot(any_backend, tmp_path):
    """The snapshot pickle must hold plain data: accel's viewer reads it with an unpickler that
    builds no object, as torch's std::string leaves a plain str."""
    from accel.memory import _viz
    device = 1
    path = tmp_path / "snap.pickle"
    with _history():
        with accel.device_index(device):
            memory._set_memory_metadata(_Tag("phase"))
            accel.Buffer(MiB, device=device).close()
        memory.dump_snapshot(str(path))
    assert _viz.read_snapshot(str(path))["device_traces"][device]
    with open(path, "rb") as f:
        assert b"_Tag" not in f.read()


def test_a_str_subclass_that_cannot_be_pickled_does_not_break_dump_snapshot(any_backend, tmp_path):
    device = 1

    class Local(str):
        def __reduce__(self):
            raise TypeError("not picklable")

    with _history():
        with accel.device_index(device):
            memory._set_memory_metadata(Local("phase"))
            accel.Buffer(MiB, device=device).close()
        memory.dump_snapshot(str(tmp_path / "snap.pickle"))


@pytest.mark.parametrize("bad", [None, 1, b"bytes", ["x"], 3.5])
def test_non_str_metadata_is_refused_and_leaves_the_old_value(device, bad):
    with accel.device_index(device):
        memory._set_memory_metadata("kept")
        with pytest.raises(TypeError):
            memory._set_memory_metadata(bad)
        assert memory._get_memory_metadata() == "kept"


def test_metadata_is_forgotten_by_a_reset(device):
    from accel import _lazy
    with accel.device_index(device):
        memory._set_memory_metadata("old")
    _lazy._reset_for_tests()
    with accel.device_index(device):
        assert memory._get_memory_metadata() == ""


def test_metadata_from_several_threads(device):
    """Each thread sets its own tag and allocates; the entries carry some thread's tag, never
    a torn or foreign value (the metadata is per device, not per thread, as torch's)."""
    tags = {f"thread{i}" for i in range(4)}
    with _history():
        gate = threading.Barrier(4)

        def worker(i):
            gate.wait()
            with accel.device_index(device):
                for _ in range(50):
                    memory._set_memory_metadata(f"thread{i}")
                    accel.Buffer(MiB, device=device).close()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert {e["user_metadata"] for e in _events(device)} <= tags


def test_memory_snapshot_segments_are_unchanged_by_metadata(device):
    with accel.device_index(device):
        memory._set_memory_metadata("tag")
        b = accel.Buffer(MiB, device=device)
    segs = memory.memory_snapshot()
    assert any(s["device"] == device for s in segs)
    pickle.loads(pickle.dumps(segs))
    b.close()


# ------------------------------------------------------------------ what an observer may do
def test_an_observer_that_dumps_a_snapshot_sees_the_oom_entry(device, tmp_path):
    """The common use: dump the memory history when memory runs out.  The oom entry is there
    (recorded before the observers run) and the dump works with the allocator unlocked."""
    paths = []

    def cb(dev, tried, allowed, free):
        path = tmp_path / f"oom{len(paths)}.pickle"
        memory.dump_snapshot(str(path))
        paths.append(path)

    with _history():
        memory.attach_out_of_memory_observer(cb)
        with pytest.raises(OutOfMemoryError):
            accel.Buffer(2 * _total(device), device=device)
    with open(paths[0], "rb") as f:
        snap = pickle.load(f)
    assert [e["action"] for e in snap["device_traces"][device]][-1] == "oom"


def test_an_observer_that_changes_settings_history_and_fraction(device):
    """Settings take _settings_lock then the allocator's lock: no deadlock from an observer."""
    def cb(dev, *rest):
        memory.set_allocator_settings("garbage_collection_threshold:0.9")
        memory.set_per_process_memory_fraction(0.5, dev)
        memory._record_memory_history()
        with accel.device_index(dev):
            memory._set_memory_metadata("after")

    try:
        memory.attach_out_of_memory_observer(cb)
        with pytest.raises(OutOfMemoryError):
            accel.Buffer(2 * _total(device), device=device)
        assert memory.get_per_process_memory_fraction(device) == 0.5
        accel.Buffer(MiB, device=device).close()
        assert {e["user_metadata"] for e in _events(device)} == {"after"}
    finally:
        memory._record_memory_history(None)


def test_no_observer_call_when_the_cache_release_retry_succeeds(device):
    called = []
    memory.attach_out_of_memory_observer(lambda *a: called.append(a))
    total = _total(device)
    a = accel.Buffer(total // 2, device=device)
    a.close()                                   # cached, not released
    b = accel.Buffer(total // 2 + 64 * MiB, device=device)    # needs the cache released first
    b.close()
    assert called == [] and memory.memory_stats(device)["num_ooms"] == 0


def test_no_observer_call_when_a_use_on_oom_pool_serves_the_request(device):
    called = []
    memory.attach_out_of_memory_observer(lambda *a: called.append(a))
    with accel.device_index(device):
        memory.set_per_process_memory_fraction(80 * MiB / _total(device), device)
        pool = memory.MemPool(use_on_oom=True)
        with memory.use_mem_pool(pool):
            b = accel.Buffer(40 * MiB, device=device)
        other = accel.Buffer(30 * MiB, device=device)
        b.close()
        c = accel.Buffer(30 * MiB, device=device)      # falls back on the pool: no OOM
        assert called == []
        with pytest.raises(OutOfMemoryError):
            accel.Buffer(30 * MiB, device=device)
        assert len(called) == 1 and called[0][0] == device
        c.close()
        other.close()
        del pool


def test_an_observer_attached_before_the_runtime_starts(monkeypatch):
    from accel import _lazy
    _lazy._reset_for_tests()
    called = []
    memory.attach_out_of_memory_observer(lambda *a: called.append(a))
    use_sim(monkeypatch, "cuda")      # a reset forgets it
    assert _oom_hooks._oom_observers == []
    memory.attach_out_of_memory_observer(lambda *a: called.append(a))
    assert not _lazy.is_initialized() if hasattr(_lazy, "is_initialized") else True
    with pytest.raises(OutOfMemoryError):
        accel.Buffer(2 * _total(1), device=1)
    assert len(called) == 1


# ------------------------------------------------------------------ the simulator's callback errors
# r51 found: _callback_error passed an object of its own to sys.unraisablehook, which CPython's
# default hook refuses with TypeError (seen when an OOM observer's recursion reached the callbacks)
def test_a_driver_callback_error_is_reported_by_the_default_unraisablehook(monkeypatch, capsys):
    from accel.sim import cuda_driver
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    try:
        raise ValueError("callback failed")
    except ValueError as exc:
        cuda_driver._callback_error(ValueError, exc, exc.__traceback__)
    assert "callback failed" in capsys.readouterr().err
