"""The allocators under the hardware's rules (issue 12): destroyed (and recycled) stream
handles, captures underway, events on the stream's device, side streams that join a
capture, and the runtime's last error after OOM recovery.

Fake-backend tests pin the exact protocol (which calls happen when); simulator tests
run the same situations through accel.Stream / Buffer / Graph on two devices.
"""

import gc

import pytest

import accel
from accel import _lazy, memory, sim
from accel._errors import AcceleratorError, CaptureError
from accel.memory import _caching, _config
from accel.memory._caching import DeviceCachingAllocator
from accel.memory._host import HostCachingAllocator
from test_memory_allocator import check_invariants
from test_memory_fakes import FakeBackend

MiB = 1 << 20


class StrictFake(FakeBackend):
    """FakeBackend with CUDA's device rules: events and streams belong to a device,
    cudaEventRecord needs both on one device, destroyed handles are recycled, and
    event queries/synchronizes while a capture is underway fail (as 900 would)."""

    def __init__(self, recycle=True, **kw):
        super().__init__(**kw)
        self.recycle = recycle
        self.last_error = 0                    # the runtime's per-thread last error
        self.stream_device = {0: None}        # handle -> device (0: the current device's default)
        self.event_device = {}
        self.free_handles = []                 # destroyed handles, handed out again first
        self.records = []                      # (event, stream) in call order
        self.captures = 0
        self.capture_ids = {}                  # stream -> capture id

    def stream_create(self, priority=0):
        h = self.free_handles.pop() if self.free_handles else next(self._ids)
        self.stream_device[h] = self.get_device()
        return h

    def stream_destroy(self, stream):
        del self.stream_device[stream]
        if self.recycle:
            self.free_handles.append(stream)

    def mem_alloc(self, nbytes):
        try:
            return super().mem_alloc(nbytes)
        except Exception:
            self.last_error = 2                # cudaErrorMemoryAllocation stays as the last error
            raise

    def clear_error(self):
        self.last_error = 0

    def event_create(self, enable_timing=False, blocking=False):
        e = super().event_create()
        self.event_device[e] = self.get_device()
        return e

    def event_destroy(self, event):
        super().event_destroy(event)
        del self.event_device[event]

    def event_record(self, event, stream):
        if stream not in self.stream_device:
            raise AcceleratorError(f"fake: event_record on destroyed stream {stream}")
        dev = self.stream_device[stream]
        if self.event_device[event] != (self.get_device() if dev is None else dev):
            raise AcceleratorError(f"fake: event {event} and stream {stream} on different devices (400)")
        self.records.append((event, stream))
        super().event_record(event, stream)

    def _unsafe(self, what):
        if self.captures:
            raise CaptureError(f"fake: {what} while a capture is underway (900)")

    def event_query(self, event):
        self._unsafe("event_query")
        return super().event_query(event)

    def event_synchronize(self, event):
        self._unsafe("event_synchronize")
        return super().event_synchronize(event)

    def mem_free(self, ptr):
        self._unsafe("mem_free")
        return super().mem_free(ptr)

    def captures_underway(self):
        return self.captures

    def capture_id(self, stream):
        return self.capture_ids.get(stream)


def make(conf="", **kw):
    be = StrictFake(**kw)
    return DeviceCachingAllocator(be, 0, _config.parse(conf)), be


def free_lists(alloc):
    """Every free list the allocator keeps (general, private pools, retired)."""
    lists = [fl for pair in alloc._general.values() for fl in pair]
    lists += [fl for p in alloc._private.values() for pair in p.lists.values() for fl in pair]
    lists += [fl for entry in alloc._pending_events if type(entry[2]) is _caching._Retired
              for _, pair in entry[2].lists for fl in pair]
    return lists


# ---------------------------------------------------------------------------- destroyed streams
def test_destroyed_stream_keeps_no_free_lists_and_its_blocks_wait_for_its_work():
    alloc, be = make()
    s = be.stream_create()
    p = alloc.malloc(MiB, s)
    alloc.free(p)                  # cached on s; work queued on s may still use it
    alloc.forget_stream(s, 0)
    be.stream_destroy(s)
    assert s not in alloc._general, "no free list stays keyed by a dead handle"
    t = be.stream_create()
    assert t == s, "the fake recycles handles, as the driver does"
    q = alloc.malloc(MiB, t)
    assert q != p, "a new stream with the dead stream's handle must not inherit its blocks"
    r = alloc.malloc(MiB, 0)
    assert r != p, "nothing reuses the block before the dead stream's work completed"
    check_invariants(alloc, be)
    be.complete_events()
    alloc.free(r)
    alloc.free(q)
    assert alloc.malloc(MiB, 0) == p, "afterwards the memory serves the default stream"
    check_invariants(alloc, be)


def test_destroyed_streams_state_is_bounded():
    alloc, be = make(recycle=False)
    be.auto_complete = True
    for _ in range(200):
        s = be.stream_create()
        alloc.free(alloc.malloc(MiB, s))
        alloc.forget_stream(s, 0)
        be.stream_destroy(s)
    alloc.free(alloc.malloc(3 * MiB, 0))      # a miss processes completed events
    assert len(free_lists(alloc)) <= 4, "free lists of 200 dead streams were kept"
    assert len(alloc._segments) <= 3
    check_invariants(alloc, be)


def test_allocated_block_of_a_destroyed_stream_waits_for_its_work_when_freed():
    alloc, be = make("policy:torch")          # no release-before-grow: the segment stays cached
    s = be.stream_create()
    p = alloc.malloc(MiB, s)
    alloc.forget_stream(s, 0)
    be.stream_destroy(s)
    be.stream_create()                           # recycles s
    alloc.free(p)
    r = alloc.malloc(MiB, 0)
    assert r != p
    check_invariants(alloc, be)
    be.complete_events()
    alloc.free(alloc.malloc(4 * MiB, 0))         # miss: processes events
    block = alloc._blocks[p]
    assert block.state == _caching._FREE and block.pool in alloc._general[0], \
        "after the dead stream's work, the block is free on the default stream"
    alloc.free(r)
    check_invariants(alloc, be)


def test_record_stream_on_a_destroyed_stream_records_before_the_destroy():
    alloc, be = make()
    p = alloc.malloc(MiB, 0)
    s = be.stream_create()
    alloc.record_stream(p, s)
    alloc.forget_stream(s, 0)
    be.stream_destroy(s)
    recorded = len(be.records)
    assert recorded == 1 and be.records[0][1] == s, "one event recorded on s before it is destroyed"
    t = be.stream_create()                       # recycles s's handle
    alloc.free(p)
    assert len(be.records) == recorded, "no event may be recorded on the recycled handle"
    assert t == s
    assert alloc.malloc(MiB, 0) != p, "the block waits for s's work"
    be.complete_events()
    check_invariants(alloc, be)


def test_sim_closed_streams_leave_no_free_lists(sim_cuda):
    accel.set_device_index(0)
    allocs = [memory.device_allocator(0), memory.device_allocator(1)]
    for round in range(3):
        streams = [accel.Stream(i % 2) for i in range(20)]   # half on device 1, device 0 current
        for s in streams:
            b = accel.Buffer(MiB, stream=s)
            b.fill_(7)
            b.close()
        for i, s in enumerate(streams):
            if i % 3:
                s.close()
        del s, streams                            # the rest through the finalizer
        gc.collect()
    accel.synchronize()
    for dev, alloc in enumerate(allocs):
        with accel.Stream(dev) as s:
            accel.Buffer(8 * MiB, stream=s).close()   # a miss processes completed events
        assert len(free_lists(alloc)) <= 6, f"device {dev} keeps the free lists of dead streams"
    assert accel.current_device_index() == 0


def test_sim_recycled_handle_does_not_inherit_blocks(sim_cuda, monkeypatch):
    monkeypatch.setenv("ACCEL_SIM_DELAY_US", "20000")
    _lazy._reset_for_tests()
    alloc = memory.device_allocator(1)
    s = accel.Stream(1)
    h = s.handle
    b = accel.Buffer(MiB, stream=s)
    ptr = b.ptr
    b.fill_(1)                                    # still queued when the stream is closed
    b.close()
    s.close()
    # The driver hands h to the next stream it creates; the allocator must not give it
    # the dead stream's block while that stream's fill may still be running.
    assert alloc.malloc(MiB, h) != ptr
    t = accel.Stream(1)
    if t.handle == h:                             # the simulator recycles, as the driver does
        assert accel.Buffer(MiB, stream=t).ptr != ptr
    accel.synchronize()
    t.close()


# ---------------------------------------------------------------------------- captures underway
def test_no_event_query_or_sync_while_any_capture_is_underway():
    alloc, be = make()
    p = alloc.malloc(MiB, 0)
    s = be.stream_create()
    alloc.record_stream(p, s)
    alloc.free(p)                                 # pending on an event
    be.captures = 1                               # a capture elsewhere (another device/library)
    q = alloc.malloc(3 * MiB, 0)                  # a miss must not query events
    alloc.free(q)
    be.fail_allocs = 1
    r = alloc.malloc(MiB, 0)                      # OOM path must not synchronize or free
    alloc.free(r)
    with pytest.raises(CaptureError):
        alloc.empty_cache()
    x = alloc.malloc(MiB, 0)
    alloc.record_stream(x, s)
    n = len(be.records)
    alloc.free(x)
    assert len(be.records) == n, "events of frees during a capture are recorded after it"
    be.captures = 0
    be.complete_events()
    alloc.free(alloc.malloc(5 * MiB, 0))          # the capture is over: deferred work resumes
    assert len(be.records) == n + 1
    be.complete_events()
    alloc.empty_cache()
    assert be.live == {}
    check_invariants(alloc, be)


def test_capture_on_one_allocator_defers_queries_on_another():
    be = StrictFake()
    a0 = DeviceCachingAllocator(be, 0, _config.parse(""))
    a1 = DeviceCachingAllocator(be, 1, _config.parse(""))
    be.set_device(1)
    s1 = be.stream_create()
    be.set_device(0)
    p = a1.malloc(MiB, 0)
    a1.record_stream(p, s1, 1)
    a1.free(p)
    a0.begin_allocate_to_pool((0, 77), 5)         # accel's own capture on device 0 ...
    orig = be.event_query

    def query(event):
        raise AssertionError("event_query while a capture is underway")
    be.event_query = query
    a1.free(a1.malloc(3 * MiB, 0))                # ... so device 1's allocator defers too
    be.event_query = orig
    a0.end_allocate_to_pool((0, 77))
    a0.release_pool((0, 77))


def test_sim_pending_frees_do_not_invalidate_a_capture(sim_cuda):
    accel.set_device_index(0)
    side1 = accel.Stream(1)
    b1 = accel.Buffer(MiB, device=1)
    b1.fill_(1, stream=side1)                     # recorded use on side1
    b1.close()                                    # pending on an event on device 1
    g = accel.Graph()
    with accel.Stream(0):
        x = accel.Buffer(MiB)
        g.capture_begin()                         # global mode
        x.fill_(3)
        # device 1's allocator misses while device 0 captures: it must not query its event
        accel.Buffer(4 * MiB, device=1).close()
        g.capture_end()
        g.replay()
        assert (x.to_numpy() == 3).all()
    accel.synchronize()
    g.reset()


# ---------------------------------------------------------------------------- pinned host memory
def test_host_events_are_created_on_the_streams_device():
    be = StrictFake()
    host = HostCachingAllocator(be)
    be.set_device(0)
    s0 = be.stream_create()
    be.set_device(1)
    s1 = be.stream_create()
    for dev, s in ((0, s0), (1, s1), (0, s0)):
        be.set_device(dev)
        p = host.malloc(1000)
        host.record_stream(p, s)
        host.free(p)
        be.complete_events()
    be.set_device(0)
    assert host.stats()["allocated_bytes"] == 0
    host.empty_cache()
    assert be.host_live == {} and be.events == {}


def test_host_failed_record_does_not_leak_the_block():
    be = StrictFake()
    host = HostCachingAllocator(be)
    s = be.stream_create()
    p = host.malloc(1000)
    host.record_stream(p, s)
    be.stream_device.pop(s)                       # the record will fail
    host.free(p)              # the stream is synchronized instead: nothing to report (issue 13)
    be.stream_device[s] = 0
    assert host.stats()["allocated_bytes"] == 0
    host.empty_cache()
    assert be.host_live == {}, "the pinned block leaked"


def test_sim_non_blocking_copies_to_both_devices(sim_cuda):
    np = pytest.importorskip("numpy")
    accel.set_device_index(0)
    data = np.arange(4096, dtype=np.uint8)
    outs = []
    for dev in (0, 1, 0, 1):
        b = accel.Buffer(data.nbytes, device=dev)
        b.copy_from(data, non_blocking=True)
        outs.append(b)
    accel.synchronize()
    for b in outs:
        assert (b.to_numpy() == data).all()
    host = memory.host_allocator()
    assert host.stats()["allocated_bytes"] == 0
    memory.empty_host_cache()
    assert host.stats()["reserved_bytes"] == 0, "a pinned block leaked"


def test_host_destroyed_stream_is_not_recorded_on():
    be = StrictFake()
    host = HostCachingAllocator(be)
    s = be.stream_create()
    p = host.malloc(1000)
    host.record_stream(p, s)
    host.forget_stream(s, 0)
    be.stream_destroy(s)
    t = be.stream_create()                        # recycled
    n = len(be.records)
    host.free(p)
    assert len(be.records) == n, "no event on the recycled handle"
    assert host.malloc(1000) != p, "the block waits for the dead stream's work"
    be.complete_events()
    assert host.malloc(1000) == p
    del t


# ---------------------------------------------------------------------------- side streams in a capture
def test_side_stream_in_capture_allocates_from_the_private_pool():
    alloc, be = make()
    origin, side = be.stream_create(), be.stream_create()
    alloc.begin_allocate_to_pool((0, 9), origin)
    be.capture_ids[origin] = be.capture_ids[side] = 41     # side joined through an event wait
    p = alloc.malloc(MiB, side)
    assert alloc._blocks[p].pool.owner is alloc._private[(0, 9)]
    alloc.free(p)
    alloc.end_allocate_to_pool((0, 9))
    be.capture_ids.clear()
    assert alloc.malloc(MiB, side) != p, "eager code must not get the graph's memory"
    alloc.release_pool((0, 9))
    check_invariants(alloc, be)


def test_sim_side_stream_in_capture_allocates_from_the_private_pool(sim_cuda):
    accel.set_device_index(0)
    alloc = memory.device_allocator(0)
    g = accel.Graph()
    side = accel.Stream(0)
    with accel.graph(g):
        cap = accel.current_stream()
        side.wait_stream(cap)                     # the side stream joins the capture
        b = accel.Buffer(MiB, stream=side)
        b.fill_(5, stream=side)
        ptr = b.ptr
        cap.wait_stream(side)                     # and rejoins before the end
    seg = [sg for sg in alloc.snapshot()["segments"]
           if sg["address"] <= ptr < sg["address"] + sg["total_size"]]
    assert seg and seg[0]["segment_pool_id"] == g.pool(), "side-stream allocation left the graph's pool"
    b.close()
    e = accel.Buffer(MiB, stream=side)
    assert e.ptr != ptr, "eager code reuses memory every replay overwrites"
    e.close()
    g.reset()


# ---------------------------------------------------------------------------- last error
def test_oom_recovery_clears_the_last_error():
    alloc, be = make()
    alloc.free(alloc.malloc(30 * MiB, 0))
    be.fail_allocs = 1
    ptr = alloc.malloc(100 * MiB, 0)
    assert alloc.stats()["num_alloc_retries"] == 1
    assert be.last_error == 0, "a handled OOM left the runtime's last error set"
    alloc.free(ptr)


def test_sim_oom_recovery_clears_the_last_error(sim_cuda):
    alloc = memory.device_allocator(1)
    alloc.free(alloc.malloc(30 * MiB, 0))
    sim.inject_oom()
    ptr = alloc.malloc(100 * MiB, 0)
    be = _lazy.lazy_init()
    assert alloc.stats()["num_alloc_retries"] == 1
    assert be.lib.cudaPeekAtLastError() == 0, "a handled OOM left the runtime's last error set"
    alloc.free(ptr)


def test_sim_host_oom_recovery_clears_the_last_error(sim_cuda):
    host = memory.host_allocator()
    host.free(host.malloc(MiB))
    sim.inject_oom()
    host.free(host.malloc(2 * MiB))
    assert _lazy.lazy_init().lib.cudaPeekAtLastError() == 0


def test_sim_source_of_a_copy_to_another_device_is_freed_after_it(sim_cuda):
    np = pytest.importorskip("numpy")
    accel.set_device_index(0)
    src = accel.Buffer(4096, device=0)
    src.copy_from(np.full(4096, 9, np.uint8))
    s1 = accel.Stream(1)
    dst = accel.Buffer(4096, stream=s1)
    dst.copy_from(src, non_blocking=True)         # records src's use on a stream of device 1
    src.close()                                   # the event goes on device 1's stream
    assert (dst.to_numpy() == 9).all()
    accel.synchronize()
    assert accel.current_device_index() == 0
    s1.close()


def test_record_stream_of_another_device_records_there():
    alloc, be = make()
    be.set_device(1)
    s1 = be.stream_create()
    be.set_device(0)
    p = alloc.malloc(MiB, 0)
    alloc.record_stream(p, s1, 1)
    alloc.free(p)
    assert be.event_device[be.records[-1][0]] == 1 and be.get_device() == 0
    be.complete_events()
    check_invariants(alloc, be)


def test_sim_finalized_stream_waits_while_the_allocator_is_busy(sim_cuda):
    from accel import _finalize
    alloc = memory.device_allocator(0)
    s = accel.Stream(0)
    alloc.free(alloc.malloc(MiB, s.handle))
    with alloc._lock:                             # as if the finalizer ran inside malloc
        del s
        gc.collect()
        # (the registry's weak reference of the freed stream may be queued beside it: r53's
        # reclaim, which finds the entry taken by this destroy and does nothing)
        waiting = [item for item in _finalize.pending if type(item) is not _finalize._Owned]
        assert len(waiting) == 1, "the destroy waits: the handle must stay valid"
    accel.Stream(0).close()                       # finishes it
    assert not _finalize.pending
    assert len(alloc._general) <= 1


def test_host_owns_finds_the_enclosing_allocated_block_only():
    be = FakeBackend()
    host = HostCachingAllocator(be)
    ptrs = [host.malloc(n) for n in (100, 5000, 70000, 100, 5000)]
    for p in ptrs:
        size = host._blocks[p].size
        assert host.owns(p, size) == p
        assert host.owns(p + size - 8, 8) == p
        assert host.owns(p + size - 8, 16) is None       # runs past the block
        assert host.owns(p - 8, 16) is None                # starts before it
    host.free(ptrs[1])
    assert host.owns(ptrs[1], 8) is None                 # cached, not handed out
    host.empty_cache()
    assert host._starts == sorted(host._blocks)          # the released block left the index
    assert host.owns(ptrs[1], 8) is None
    for p in ptrs[:1] + ptrs[2:]:
        host.free(p)
    host.empty_cache()
    assert host._starts == [] and host._blocks == {} and be.host_live == {}
