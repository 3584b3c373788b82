"""Out-of-memory observers and user metadata in the memory history: torch's
``torch._C._cuda_attach_out_of_memory_observer`` (test_cuda.py's test_notifies_oom) and
``torch.cuda.memory._set_memory_metadata`` / ``_get_memory_metadata`` (test_memory_plots_metadata),
as ``accel.memory.attach_out_of_memory_observer`` and ``accel.memory._set_memory_metadata``."""

import pytest

import accel
from accel import OutOfMemoryError, memory

from conftest import use_sim

MiB = 1 << 20


@pytest.fixture(params=[0, 1], ids=["device0", "device1"])
def device(request, monkeypatch):
    use_sim(monkeypatch, "cuda")
    return request.param


# ------------------------------------------------------------------ out-of-memory observers
def test_cuda__test_notifies_oom(device):
    called = []

    def cb(device_index, alloc, device_alloc, device_free):
        called.append((device_index, alloc, device_alloc, device_free))

    memory.attach_out_of_memory_observer(cb)
    _, total = memory.get_memory_info(device)
    with pytest.raises(OutOfMemoryError, match="out of memory"):
        accel.Buffer(total + 64 * MiB, device=device)
    assert len(called) == 1
    index, alloc, limit, free = called[0]
    assert index == device
    assert alloc >= total + 64 * MiB           # the segment it tried to make
    assert limit == total                      # no fraction set: the device's total
    assert 0 <= free <= total


def test_the_observer_sees_the_allowed_bytes_under_a_fraction(device):
    called = []
    memory.attach_out_of_memory_observer(lambda *args: called.append(args))
    memory.set_per_process_memory_fraction(0.25, device)
    _, total = memory.get_memory_info(device)
    with pytest.raises(OutOfMemoryError):
        accel.Buffer(total // 2, device=device)
    assert called[0][2] == int(total * 0.25)


def test_an_observer_runs_without_the_allocator_lock(device):
    """torch unlocks before calling observers ("which might need hold the GIL"): an observer may
    query the allocator, or free memory, without a deadlock."""
    keep = accel.Buffer(MiB, device=device)
    seen = []

    def cb(*args):
        seen.append(memory.memory_stats(device)["allocated_bytes.all.current"])
        memory.empty_cache()

    memory.attach_out_of_memory_observer(cb)
    _, total = memory.get_memory_info(device)
    with pytest.raises(OutOfMemoryError):
        accel.Buffer(2 * total, device=device)
    assert seen == [MiB]
    keep.close()


def test_an_observer_error_propagates_with_the_oom_as_its_context(device):
    def cb(*args):
        raise KeyError("observer failed")

    memory.attach_out_of_memory_observer(cb)
    _, total = memory.get_memory_info(device)
    with pytest.raises(KeyError) as info:
        accel.Buffer(2 * total, device=device)
    assert isinstance(info.value.__context__, OutOfMemoryError)
    assert memory.memory_stats(device)["num_ooms"] == 1
    b = accel.Buffer(MiB, device=device)      # the allocator still works
    b.close()


def test_observers_are_called_in_order_and_can_be_detached(device):
    calls = []
    first = lambda *a: calls.append("first")      # noqa: E731
    second = lambda *a: calls.append("second")    # noqa: E731
    memory.attach_out_of_memory_observer(first)
    memory.attach_out_of_memory_observer(second)
    _, total = memory.get_memory_info(device)
    with pytest.raises(OutOfMemoryError):
        accel.Buffer(2 * total, device=device)
    assert calls == ["first", "second"]
    memory.detach_out_of_memory_observer(first)
    with pytest.raises(OutOfMemoryError):
        accel.Buffer(2 * total, device=device)
    assert calls == ["first", "second", "second"]
    with pytest.raises(ValueError, match="not attached"):
        memory.detach_out_of_memory_observer(first)


def test_an_observer_must_be_callable(device):
    with pytest.raises(TypeError, match="callable"):
        memory.attach_out_of_memory_observer(42)


def test_no_observer_for_the_exabyte_refusal(device):
    # torch refuses >= 1 EB before the cache is touched, without calling observers
    called = []
    memory.attach_out_of_memory_observer(lambda *a: called.append(a))
    with pytest.raises(OutOfMemoryError, match="1EB"):
        memory.device_allocator(device).malloc(1 << 60)
    assert called == []


def test_the_cudamallocasync_backend_notifies_too(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="backend:cudaMallocAsync")
    called = []
    memory.attach_out_of_memory_observer(lambda *a: called.append(a))
    _, total = memory.get_memory_info(1)
    with pytest.raises(OutOfMemoryError):
        accel.Buffer(2 * total, device=1)
    assert len(called) == 1 and called[0][0] == 1 and called[0][1] == 2 * total


# ------------------------------------------------------------------ user metadata
@pytest.mark.parametrize("context", ["alloc", "all", "state"])
def test_cuda__test_memory_plots_metadata(device, context):
    """torch's test: every trace entry recorded while the metadata is set carries it."""
    try:
        with accel.device_index(device):
            memory.empty_cache()
            memory._set_memory_metadata("metadata test")
            assert memory._get_memory_metadata() == "metadata test"
            memory._record_memory_history(context=context)
            x = accel.Buffer(3 * 4 * 4, device=device)
            del x
            memory.empty_cache()
            memory._set_memory_metadata("")
            ss = memory._snapshot()
        events = ss["device_traces"][device]
        assert events
        for event in events:
            assert event["user_metadata"] == "metadata test"
    finally:
        memory._record_memory_history(None)


def test_metadata_belongs_to_the_current_device(device):
    other = 1 - device
    with accel.device_index(device):
        memory._set_memory_metadata("phase A")
    with accel.device_index(other):
        assert memory._get_memory_metadata() == ""
    with accel.device_index(device):
        assert memory._get_memory_metadata() == "phase A"


def test_metadata_changes_between_entries(device):
    try:
        memory._record_memory_history()
        with accel.device_index(device):
            memory._set_memory_metadata("training")
            a = accel.Buffer(MiB, device=device)
            memory._set_memory_metadata("validation")
            b = accel.Buffer(MiB, device=device)
            memory._set_memory_metadata("")
            a.close()
        events = [(e["action"], e["user_metadata"]) for e in memory._snapshot()["device_traces"][device]]
        assert events[-3:] == [("alloc", "validation"), ("free_requested", ""), ("free_completed", "")]
        assert ("alloc", "training") in events
        b.close()
    finally:
        memory._record_memory_history(None)


def test_metadata_must_be_a_str(device):
    with pytest.raises(TypeError, match="str"):
        memory._set_memory_metadata(None)
    with pytest.raises(TypeError, match="str"):
        memory._set_memory_metadata({"pool": "x"})


def test_metadata_under_the_cudamallocasync_backend(monkeypatch):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="backend:cudaMallocAsync")
    try:
        memory._record_memory_history()
        memory._set_memory_metadata("async phase")
        assert memory._get_memory_metadata() == "async phase"
        accel.Buffer(MiB).close()
        events = memory._snapshot()["device_traces"][0]
        assert events and {e["user_metadata"] for e in events} == {"async phase"}
    finally:
        memory._record_memory_history(None)


def test_a_forked_child_keeps_the_observers(device):
    from conftest import run_forked
    seen = []
    memory.attach_out_of_memory_observer(seen.append)

    def child():
        return 0 if memory._oom_hooks._oom_observers == [seen.append] else 3

    assert run_forked(child) == 0
