"""Adversarial reliability of the public memory API (accel.memory), ACCEL_ALLOC_CONF parsing,
lazy init and fork, and ``python -m accel`` / ``python -m accel.selftest`` with odd settings,
on every simulator with two devices.  A bad argument raises a clear Python exception naming
it, before and after lazy init, and changes nothing: in particular it does not initialize the
runtime (which would make every later forked child unable to use the device)."""


import numpy as np
import pytest

import accel
from accel import _lazy, backends, memory
from accel._errors import AllocatorConfigError, InvalidDeviceError, OutOfMemoryError
from accel.memory import _config
from conftest import run_forked, use_sim

MiB = 1 << 20

#: (argument, exception, text the message must contain) for a device argument that is wrong
#: whatever the device count: wrong types, malformed strings, negative indices.
BAD_FORMS = [
    (1.0, TypeError, "float 1.0"),
    (0.5, TypeError, "0.5"),
    (True, TypeError, "True"),
    (np.float64(1.0), TypeError, "1.0"),
    (object(), TypeError, "object"),
    ([0], TypeError, "[0]"),
    (b"0", TypeError, "b'0'"),
    ("garbage", InvalidDeviceError, "'garbage'"),
    ("", InvalidDeviceError, "''"),
    ("cuda:x", InvalidDeviceError, "'cuda:x'"),
    (-1, InvalidDeviceError, "-1"),
    (np.int64(-1), InvalidDeviceError, "-1"),
]

QUERIES = [memory.memory_stats, memory.memory_allocated, memory.max_memory_allocated, memory.memory_reserved,
           memory.max_memory_reserved, memory.reset_peak_memory_stats, memory.reset_accumulated_memory_stats,
           memory.memory_summary]


# -- device arguments before and after lazy init ---------------------------------------------------
@pytest.mark.parametrize("bad, exc, text", BAD_FORMS, ids=lambda v: repr(v)[:20])
def test_bad_device_form_raises_before_init_as_after(sim_backend, bad, exc, text):
    """A device argument that can never be valid raises the same error before lazy init as
    after, without initializing (before: memory_stats returned {}, the scalars 0, the resets and
    memory_summary did nothing -- a mistake that surfaced only once something else initialized)."""
    for phase in ("before init", "after init"):
        for fn in QUERIES:
            with pytest.raises(exc, match=None) as info:
                fn(bad)
            assert text in str(info.value), (phase, fn.__name__, str(info.value))
        assert _lazy.is_initialized() == (phase == "after init")
        memory.device_allocator(0)


def test_queries_before_init_keep_torchs_no_op_for_other_devices(sim_backend):
    """torch.accelerator's queries return before resolving a well-formed argument when the
    allocator is not initialized: another device type and an index past the count stay a
    no-op before init (tests/test_torch_memory_api.py), and nothing initializes."""
    other = "cpu"
    for fn in QUERIES[:-1]:
        fn(other)
        fn(7)
        fn(np.int64(1))
        fn(accel.device(sim_backend, 1) if sim_backend != "mps" else 0)
    assert memory.memory_stats(7) == {} and memory.memory_allocated(7) == 0
    assert not _lazy.is_initialized()


def test_memory_summary_before_init_names_the_device_asked_for(sim_backend):
    """memory_summary(1) before init rendered the table of "device ID 0"; an index past the
    count was accepted."""
    last = accel.device_count() - 1
    for dev in (last, f"{sim_backend}:{last}", np.int64(last)):
        assert f"device ID {last} " in memory.memory_summary(dev)
    with pytest.raises(InvalidDeviceError, match=f"device index {last + 1} is out of range"):
        memory.memory_summary(last + 1)
    assert "device ID 0 " in memory.memory_summary()
    assert not _lazy.is_initialized()
    memory.device_allocator(last)
    assert f"device ID {last} " in memory.memory_summary(last)


@pytest.mark.parametrize("call", [
    lambda bad: memory.get_memory_info(bad),
    lambda bad: memory.get_per_process_memory_fraction(bad),
    lambda bad: memory.set_per_process_memory_fraction(0.5, bad),
], ids=["get_memory_info", "get_fraction", "set_fraction"])
@pytest.mark.parametrize("bad, exc, text", BAD_FORMS, ids=lambda v: repr(v)[:20])
def test_initializing_calls_refuse_a_bad_device_without_initializing(sim_backend, call, bad, exc, text):
    """get_memory_info and the fraction functions initialize the runtime, as torch's -- but not
    for an argument they then refuse (they initialized first: a later fork child could no
    longer use the device because of a call that failed)."""
    with pytest.raises(exc) as info:
        call(bad)
    assert text in str(info.value)
    assert not _lazy.is_initialized()


@pytest.mark.parametrize("fraction, exc, text", [
    (1, TypeError, "int 1"), ("0.5", TypeError, "str '0.5'"), (None, TypeError, "None"),
    (True, TypeError, "bool True"), (np.float32(0.5), TypeError, "float32"),
    (float("nan"), ValueError, "nan"), (float("inf"), ValueError, "inf"), (-0.1, ValueError, "-0.1"),
    (1.5, ValueError, "1.5"),
])
def test_bad_fraction_names_the_value_and_initializes_nothing(sim_backend, fraction, exc, text):
    """torch's wording ("Invalid type for fraction argument, must be `float`", "Invalid
    fraction value: ... Allowed range: 0~1"), plus the value for the type error, raised before
    the runtime is initialized; after init the device's fraction is unchanged."""
    for phase in range(2):
        with pytest.raises(exc, match="Invalid type for fraction argument, must be `float`"
                           if exc is TypeError else "Invalid fraction value") as info:
            memory.set_per_process_memory_fraction(fraction, 0)
        assert text in str(info.value)
        assert _lazy.is_initialized() == bool(phase)
        memory.device_allocator(0)
    assert memory.get_per_process_memory_fraction(0) == 1.0


# -- the bad-fork child --------------------------------------------------------------------------
def test_forked_child_refuses_bad_arguments_and_hands_out_nothing(sim_backend):
    """After init, a forked child: queries report nothing (as torch's), bad arguments still
    raise, and every call that needs the runtime raises the fork error."""
    last = accel.device_count() - 1
    keep = accel.Buffer(MiB, device=last)

    def child():
        if memory.memory_stats(last) != {} or memory.memory_allocated(last) != 0:
            return 2
        try:
            memory.memory_stats(1.5)
            return 3
        except TypeError:
            pass
        for fn in (lambda: memory.get_memory_info(last), lambda: memory.device_allocator(last),
                   lambda: memory.set_per_process_memory_fraction(0.5, last), lambda: accel.MemPool()):
            try:
                fn()
                return 4
            except RuntimeError as exc:
                if "forked subprocess" not in str(exc):
                    return 5
        memory.empty_cache()
        return 0 if memory.memory_snapshot() == [] else 6

    assert run_forked(child) == 0
    assert memory.memory_allocated(last) == MiB
    del keep


def test_fork_while_another_thread_selects_a_backend_does_not_hang_the_child(sim_backend):
    """A thread of the parent inside backend selection (holding its lock) when another thread
    forks: the child, which may still initialize (the parent did not), must not wait forever
    for a lock whose holder does not exist in the child."""
    assert not _lazy.is_initialized()
    backends._lock.acquire()          # as a thread in the middle of backends.select()
    try:
        status = run_forked(lambda: 0 if accel.device_count() >= 1 and accel.Buffer(64).nbytes == 64 else 2,
                            timeout=30, hung="the forked child hung on the backend-selection lock")
    finally:
        backends._lock.release()
    assert status == 0, status


# -- MemPool ----------------------------------------------------------------------------------------
def _pool_blocks(pool):
    return {b["address"] for seg in pool.snapshot() for b in seg["blocks"] if b["state"] == "active_allocated"}


def test_nested_pools_on_two_devices_route_each_device_to_its_own(sim_graph_backend):   # Metal: 1 device
    p0 = accel.MemPool()
    with accel.device_index(1):
        p1 = accel.MemPool()
    with accel.use_mem_pool(p0):
        with accel.use_mem_pool(p1, device=1):
            on0, on1 = accel.Buffer(4096, device=0), accel.Buffer(4096, device=1)
        after0, after1 = accel.Buffer(100, device=0), accel.Buffer(100, device=1)
    assert _pool_blocks(p0) == {on0.ptr, after0.ptr} and _pool_blocks(p1) == {on1.ptr}
    assert after1.ptr not in _pool_blocks(p1)
    assert p0.use_count() == p1.use_count() == 1
    assert accel.current_device_index() == 0


def test_pool_misuse_changes_nothing(sim_graph_backend):
    """A pool of device 1 while device 0 is current, a device argument of the wrong type, a
    pool already routed: each raises and the pool keeps its one reference and no route."""
    with accel.device_index(1):
        pool = accel.MemPool()
    for device, exc in ((None, ValueError), (0, ValueError), (1.0, TypeError), ("bogus", InvalidDeviceError),
                        (7, InvalidDeviceError)):
        with pytest.raises(exc):
            with accel.use_mem_pool(pool, device=device):
                pass
        assert pool.use_count() == 1
    with accel.use_mem_pool(pool, device=f"{sim_graph_backend}:1"):
        with pytest.raises(RuntimeError, match="already"):
            with accel.use_mem_pool(pool, device=1):
                pass
        inside = accel.Buffer(64, device=1)
    assert pool.use_count() == 1 and _pool_blocks(pool) == {inside.ptr}
    assert memory.device_allocator(1)._threads == {} and memory.device_allocator(0)._threads == {}


def test_pool_in_a_forked_child_raises_the_fork_error(sim_backend):
    pool = accel.MemPool()

    def child():
        for fn in (pool.use_count, pool.snapshot, lambda: accel.use_mem_pool(pool).__enter__()):
            try:
                fn()
                return 2
            except RuntimeError as exc:
                if "forked subprocess" not in str(exc):
                    return 3
        return 0 if pool.id[0] == 0 and "MemPool" in repr(pool) else 4

    assert run_forked(child) == 0
    assert pool.use_count() == 1


# -- the caching and pinned allocators' entry points -------------------------------------------------
@pytest.mark.parametrize("nbytes", [1 << 60, (1 << 62) + 1, 1 << 63, (1 << 64) + 1, 1 << 70])
def test_pinned_malloc_of_an_absurd_size_is_out_of_memory(sim_backend, nbytes):
    """The pinned allocator refuses 1 EB or more as the device allocator does (before: an
    OverflowError "cannot fit 'int' into an index-sized integer" from the runtime binding for
    sizes past 2**63), and counts nothing."""
    host = memory.host_allocator()
    before = host.stats()
    with pytest.raises(OutOfMemoryError, match="more than 1EB"):
        host.malloc(nbytes)
    assert host.stats() == before


# -- ACCEL_ALLOC_CONF --------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["max_split_size_mb:\u0661\u0660\u0660", "max_non_split_rounding_mb:\uff12\uff10",
                                  "pinned_num_register_threads:_8", "roundup_power2_divisions:[_256:1]"])
def test_config_integers_are_plain_decimal(text):
    """Python's int() reads non-ASCII digits and "1_000"; torch's parser (std::stoull) does not:
    a value that does not start with ASCII digits is refused."""
    with pytest.raises(AllocatorConfigError, match="expected an integer"):
        _config.parse(text)
    with pytest.raises(AllocatorConfigError, match="expected a byte count"):
        _config.parse("release_threshold:1_000M")
    assert _config.parse(" max_split_size_mb : +128 ").max_split_size == 128 * MiB


def test_config_integers_read_by_their_prefix_as_std_stoull():
    """std::stoull stops at the first character that is not a digit, so torch 2.13 reads
    ``1_000`` as 1 (then refuses it as below 20 MiB) and ``[2_56:1]`` as an interval of 2 MiB;
    accel reads them so since session 38 (it refused them as not plain decimal)."""
    with pytest.raises(AllocatorConfigError, match="too small"):
        _config.parse("max_split_size_mb:1_000")
    assert _config.parse("max_split_size_mb:64_000").max_split_size == 64 * MiB
    assert (_config.parse("roundup_power2_divisions:[2_56:1]").roundup_power2_divisions
            == _config.parse("roundup_power2_divisions:[2:1]").roundup_power2_divisions)


@pytest.mark.parametrize("key, field", [("max_split_size_mb", "max_split_size"),
                                        ("max_non_split_rounding_mb", "max_non_split_rounding")])
def test_config_huge_sizes_clamp_as_torch_and_past_size_t_refuse(key, field):
    """torch clamps a MiB count to SIZE_MAX / 1 MiB and refuses one that std::stoull cannot
    hold (>= 2**64); accel kept any size, so memory_stats reported a max_split_size past int64."""
    top = _config.UNLIMITED // MiB
    assert getattr(_config.parse(f"{key}:{top}"), field) >= top * MiB
    for mb in (top + 1, 1 << 63):
        value = getattr(_config.parse(f"{key}:{mb}"), field)
        assert top * MiB <= value <= _config.UNLIMITED
    with pytest.raises(AllocatorConfigError, match=f"{1 << 64}.*{key}"):
        _config.parse(f"{key}:{1 << 64}")


def test_huge_max_split_size_reads_as_unlimited(monkeypatch):
    """A max_split_size_mb no device can reach is "no limit": memory_stats says -1 (torch's
    SIZE_MAX), not a number past int64."""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF=f"max_split_size_mb:{1 << 60}")
    memory.device_allocator(1).free(memory.device_allocator(1).malloc(MiB))
    assert memory.memory_stats(1)["max_split_size"] == -1


# -- python -m accel / python -m accel.selftest -----------------------------------------------------
@pytest.mark.parametrize("env, text", [
    ({"ACCEL_SIM_DEVICES": "abc"}, "ACCEL_SIM_DEVICES='abc' is not an integer"),
    ({"ACCEL_SIM_DEVICES": "-1"}, "got -1"),
    ({"ACCEL_SIM_MEMORY": "garbage"}, "ACCEL_SIM_MEMORY='garbage'"),
])
def test_main_reports_a_bad_simulator_setting(sim_backend, monkeypatch, capsys, env, text):
    """``python -m accel`` with a bad simulator setting prints the error and exits 1 (it died
    with a traceback from counting the devices)."""
    from accel.__main__ import main
    use_sim(monkeypatch, sim_backend, **env)
    assert main(["--no-smoke"]) == 1
    out = capsys.readouterr().out
    assert "error: " in out and text in out


def test_main_reports_a_failed_smoke_test(monkeypatch, capsys):
    """A bad ACCEL_ALLOC_CONF fails the smoke test: the report says why and exits 1 (it died
    with a traceback after printing nothing)."""
    from accel.__main__ import main
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="bogus:1")
    assert main([]) == 1
    out = capsys.readouterr().out
    assert "accelerator: cuda" in out and "smoke test failed" in out and "'bogus'" in out
    assert main(["--json"]) == 1
    import json
    report = json.loads(capsys.readouterr().out)
    assert "'bogus'" in report["smoke"]["error"]


@pytest.mark.parametrize("stream", [-1, 1 << 64, -(1 << 70)])
def test_malloc_refuses_a_stream_handle_no_stream_can_have(sim_backend, stream):
    """A handle outside [0, 2**64) was taken: the block was cached under a stream that does not
    exist (reused by nothing but that number), as record_stream already refuses."""
    alloc = memory.device_allocator(accel.device_count() - 1)
    before = alloc.stats()
    with pytest.raises(ValueError, match=f"got {stream}; pass Stream.handle"):
        alloc.malloc(4096, stream)
    assert alloc.stats() == before and stream not in alloc._general


@pytest.mark.parametrize("stream", [-1, 1 << 64])
def test_async_malloc_refuses_a_stream_handle_no_stream_can_have(monkeypatch, stream):
    """backend:cudaMallocAsync: 2**64 was wrapped by the binding onto the legacy stream 0 while
    the allocation was recorded as on stream 2**64."""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="backend:cudaMallocAsync")
    alloc = memory.device_allocator(1)
    with pytest.raises(ValueError, match=f"got {stream}; pass Stream.handle"):
        alloc.malloc(4096, stream)
    assert memory.memory_stats(1)["allocation.all.current"] == 0 and memory.memory_stats(1)["num_device_alloc"] == 0


# -- lazy init ------------------------------------------------------------------------------------
def test_a_call_queued_by_a_queued_call_runs_at_init(sim_backend):
    """A queued call that queues another while init runs the queue: the second ran never (the
    queue was copied before the run and cleared after); torch's _lazy_init iterates the live
    list, so it runs last, and the queue is empty afterwards."""
    order = []
    _lazy.lazy_call(lambda: (order.append("a"), _lazy.lazy_call(lambda: order.append("queued by a"))))
    _lazy.lazy_call(lambda: order.append("b"))
    accel.current_device_index()
    assert order == ["a", "b", "queued by a"]
    assert _lazy._queued == []
