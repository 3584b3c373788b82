"""Deterministic XPU stream-table races (issue 13 leftover: the flaky 8-thread load test).

The Level Zero driver hands a destroyed command list's handle value to the next object it
creates (the simulator models this: LIFO reuse of freed handle values), and the backend keys
its stream table by that value.  These tests force the interleavings the load test hit by
chance: the vendor call is wrapped so that "another thread" acts at the exact point in between.
"""

import pytest

from accel import backends
from accel._errors import AcceleratorError

from conftest import use_sim


@pytest.fixture(params=["1.9", "1.5"], ids=["host-sync", "event-marker"])
def be(request, monkeypatch):
    """An initialized simulated XPU backend; API 1.5 drivers have no zeCommandListHostSynchronize,
    so stream syncs wait on a marker event appended to the list instead."""
    use_sim(monkeypatch, "xpu", ACCEL_SIM_ZE_API=request.param)
    backend = backends.get("xpu")
    backend.init()
    return backend


def _wrap(monkeypatch, be, name, after):
    """Make lib.``name`` call ``after(rc, *args)`` once, right after the real call returns."""
    lib = be._lib[1]
    real = getattr(lib, name)
    fired = []

    def wrapped(*args):
        rc = real(*args)
        if not fired:
            fired.append(True)
            after(rc, *args)
        return rc

    monkeypatch.setattr(lib, name, wrapped)
    return fired


def test_stream_created_between_destroy_and_table_removal_stays_live(monkeypatch, be):
    """The load test's failure: thread A's stream_destroy released the list, thread B's
    stream_create got the same handle value and entered it in the table, then A removed the
    table entry by value, i.e. B's live stream: B's next copy said "not a live XPU stream"."""
    old = be.stream_create()
    created = []
    _wrap(monkeypatch, be, "zeCommandListDestroy", lambda rc, *a: created.append(be.stream_create()))
    be.stream_destroy(old)
    assert created == [old]            # the driver reused the value (what makes the race possible)
    new = created[0]
    be.stream_synchronize(new)         # raised ValueError: ... is not a live XPU stream handle
    assert be._streams[new].dead is False
    assert new in be._current().streams
    be.stream_destroy(new)
    with pytest.raises(ValueError, match="not a live XPU stream handle"):
        be.stream_synchronize(new)


def test_failed_destroy_keeps_the_stream_live(monkeypatch, be):
    """The entry is removed before the driver may reuse the value, and put back when the
    destroy fails: the stream is still the driver's, and a second destroy retries."""
    s = be.stream_create()
    lib = be._lib[1]
    real = lib.zeCommandListDestroy
    monkeypatch.setattr(lib, "zeCommandListDestroy", lambda h: lib.ZE_RESULT_ERROR_DEVICE_LOST)
    with pytest.raises(AcceleratorError, match="zeCommandListDestroy"):
        be.stream_destroy(s)
    monkeypatch.setattr(lib, "zeCommandListDestroy", real)
    be.stream_synchronize(s)
    be.stream_destroy(s)
    assert s not in be._streams


def test_created_handle_colliding_with_a_live_stream_is_refused(monkeypatch, be):
    """A driver (or a stale table) handing out the value of a live stream must not silently
    replace that stream's entry: the new stream is refused and the live one keeps working."""
    live = be.stream_create()
    lib, ffi = be._lib[1], be._lib[0]
    real = lib.zeCommandListCreateImmediate
    made = []

    def duplicate(ctx, dev, desc, out):
        rc = real(ctx, dev, desc, out)
        made.append(out[0])
        out[0] = ffi.cast("ze_command_list_handle_t", live)
        return rc

    monkeypatch.setattr(lib, "zeCommandListCreateImmediate", duplicate)
    entry = be._streams[live]
    with pytest.raises(AcceleratorError, match=f"{live:#x}.*already a live stream"):
        be.stream_create()
    monkeypatch.setattr(lib, "zeCommandListCreateImmediate", real)
    assert be._streams[live] is entry
    be.stream_synchronize(live)
    be.stream_destroy(live)
    assert lib.zeCommandListDestroy(made[0]) == 0   # the refused list, which the test made collide


def test_device_synchronize_skips_a_stream_destroyed_meanwhile(monkeypatch, be):
    """device_synchronize works on a snapshot of the device's streams; a stream closed by
    another thread after the snapshot has nothing left to wait for (its list is gone, or its
    handle value already belongs to another stream)."""
    victim = be.stream_create()
    other = be.stream_create()
    order = list(be._current().streams)
    first = order[0]
    assert first != victim
    call = "zeCommandListHostSynchronize" if be._host_sync else "zeEventHostSynchronize"
    _wrap(monkeypatch, be, call, lambda rc, *a: be.stream_destroy(victim))
    be.device_synchronize()            # raised: zeCommandListHostSynchronize on the destroyed list
    with pytest.raises(ValueError):
        be.stream_synchronize(victim)
    be.stream_destroy(other)


def test_a_marker_being_waited_on_is_not_recycled(monkeypatch, be):
    """Two threads syncing one stream (API < 1.6: each waits on a marker event): while thread A
    is about to wait on marker M1, thread B appends work and syncs, which retires M1 for a new
    marker, and the sweep after B's sync would reset M1 for reuse: A's wait on a reset event
    never returns.  A marker is recycled only once nobody waits on it."""
    if be._host_sync:
        pytest.skip("the driver has zeCommandListHostSynchronize: no marker events")
    s = be.stream_create()
    st = be._streams[s]
    lib = be._lib[1]
    real = lib.zeEventHostSynchronize
    seen = []

    def before(event, timeout):
        if not seen:
            seen.append(event)
            m1 = st.marker[0]
            assert m1.event == event
            ptr = be.mem_alloc(64)
            be.memset_async(ptr, 1, 64, s)       # "thread B": more work, then its own sync
            be.stream_synchronize(s)
            free = [sl for v in be._free_slots.values() for sl in v]
            assert m1 not in free, "the marker thread A is waiting on was reset for reuse"
            be.mem_free(ptr)
        return real(event, timeout)

    monkeypatch.setattr(lib, "zeEventHostSynchronize", before)
    be.stream_synchronize(s)
    assert seen
    be.stream_destroy(s)
