"""The lead's fixes and refactors of session 27.

``order_after`` on the device allocators: ``waiter`` waits on the device for the work queued
on another stream so far, through the allocator's own events (the graph RNG replay's ordering,
r66h, which used to reach into the allocator's private cache from accel.random).  Checked on
both simulated devices, the non-current one included, under the three allocator
configurations: True, a cudaStreamWaitEvent queued, no host wait, as many live events after as
before (that the order holds on the device is tests/test_rng_replay_no_host_wait_r66h.py's
log, with its guard); bad arguments raise before anything changes; a stream being captured is not waited for (the
waiter does not join the capture).
"""

import pytest

import accel
from accel import memory, sim
from conftest import use_sim

HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
CONFS = {"expandable": "", "classic": "expandable_segments:False", "async": "backend:cudaMallocAsync"}


def _host_waits() -> int:
    return sum(sim.calls(name) for name in HOST_WAITS)


@pytest.mark.parametrize("device", [0, 1])
@pytest.mark.parametrize("conf", sorted(CONFS))
def test_order_after_queues_a_device_wait_and_keeps_no_event(monkeypatch, conf, device):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF=CONFS[conf])
    accel.set_device_index(0)
    a, b = accel.Stream(device), accel.Stream(device)
    src = accel.Buffer(1 << 16, device=device, stream=a)
    alloc = memory.device_allocator(device)
    for value in range(1, 9):
        src.fill_(value, stream=a)          # a backlog on a
    events, waits, hosts = sim.state().events, sim.calls("cudaStreamWaitEvent"), _host_waits()
    assert alloc.order_after(b.handle, a.handle, device) is True
    assert sim.calls("cudaStreamWaitEvent") == waits + 1
    assert _host_waits() == hosts
    assert sim.state().events == events
    assert accel.current_device_index() == 0
    accel.synchronize(device)
    for obj in (src, a, b):
        obj.close()


@pytest.mark.parametrize("conf", sorted(CONFS))
@pytest.mark.parametrize("bad, error", [("1", TypeError), (-1, ValueError), (1 << 64, ValueError),
                                        (None, TypeError)])
def test_order_after_refuses_bad_streams_and_changes_nothing(monkeypatch, conf, bad, error):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF=CONFS[conf])
    s = accel.Stream(0)
    alloc = memory.device_allocator(0)
    before = sim.state().calls.copy()
    with pytest.raises(error, match="stream"):
        alloc.order_after(s.handle, bad)
    with pytest.raises(TypeError, match="device_index"):
        alloc.order_after(s.handle, s.handle, "0")
    with pytest.raises(ValueError):
        alloc.order_after(s.handle, s.handle, 7)
    assert sim.state().calls == before
    s.close()


@pytest.mark.parametrize("conf", sorted(CONFS))
def test_order_after_a_stream_being_captured_does_not_join_the_capture(monkeypatch, conf):
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF=CONFS[conf])
    a, b = accel.Stream(0), accel.Stream(0)
    buf = accel.Buffer(256, stream=a)
    g = accel.Graph()
    with a:
        g.capture_begin()
        try:
            buf.fill_(3, stream=a)
            records = sim.calls("cudaEventRecord")
            assert memory.device_allocator(0).order_after(b.handle, a.handle) is True
            assert sim.calls("cudaEventRecord") == records
            assert a.is_capturing() and not b.is_capturing()
        finally:
            g.capture_end()
    g.replay()
    accel.synchronize(0)
    g.reset()
    for obj in (buf, a, b):
        obj.close()


# -- Metal: a kernel's thread limit is known (its pipeline's maxTotalThreadsPerThreadgroup) ----

LIMITED_MSL = """
#include <metal_stdlib>
using namespace metal;
[[max_total_threads_per_threadgroup(256)]]
kernel void saxpy(constant float &a [[buffer(0)]], device const float *x [[buffer(1)]],
                  device float *y [[buffer(2)]], constant ulong &n [[buffer(3)]],
                  uint i [[thread_position_in_grid]]) {
    if (i < n) y[i] = fma(a, x[i], y[i]);
}
"""


def test_metal_kernel_reports_its_thread_limit_and_says_what_it_cannot(monkeypatch):
    from test_user_kernels import SAXPY_MSL, saxpy_reference
    use_sim(monkeypatch, "mps")
    sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64", replace=True)
    try:
        for source, most in ((SAXPY_MSL, 1024), (LIMITED_MSL, 256)):
            k = accel.Module(source).function("saxpy", "f32, ptr, ptr, u64")
            assert k.max_threads_per_block == most
            with pytest.raises(NotImplementedError, match="mps.*registers"):
                k.num_regs
            with pytest.raises(NotImplementedError, match="mps.*occupancy"):
                k.max_potential_block_size()
            x, y = accel.Buffer(4 * 512), accel.Buffer(4 * 512)
            with pytest.raises(ValueError, match=f"limit of {most}[ )]"):
                accel.launch(k, 1, most + 1, 1.0, x, y, 512)
            accel.launch(k, 1, most, 1.0, x, y, 512)
            accel.synchronize()
            x.close()
            y.close()
            k.module.close()
    finally:
        sim.unregister_kernel("saxpy")


def test_async_frees_used_on_other_streams_keep_events_bounded_when_destroy_fails(monkeypatch):
    """cudaMallocAsync: a free of memory used on another stream orders the free after that use
    through an event; with cudaEventDestroy failing on every call the failed ones wait for
    empty_cache, and each next wait reuses one of them (r67a's replay case, the free path)."""
    use_sim(monkeypatch, "cuda", ACCEL_ALLOC_CONF="backend:cudaMallocAsync")
    a, b = accel.Stream(1), accel.Stream(1)
    memory.empty_cache()
    events = sim.state().events
    sim.inject_error("cudaEventDestroy", 1, times=-1)
    try:
        for _ in range(6):
            buf = accel.Buffer(4096, device=1, stream=a)
            buf.fill_(1, stream=b)          # used on b: its free waits for that use
            buf.close()
        during = sim.state().events
    finally:
        sim.clear_faults()
    memory.empty_cache()
    accel.synchronize(1)
    assert during <= events + 1, f"{during - events} events kept by 6 frees"
    assert sim.state().events == events
    a.close()
    b.close()


# -- a Ctrl-C in the inlined hot paths leaves no use mark (r67e's "still open" 2 and 3) ----------

@pytest.mark.usefixtures("frozen_heap")
def test_a_ctrl_c_anywhere_in_the_hot_paths_leaves_no_use_mark(monkeypatch):
    """Stream.query / synchronize, Event.record / query / synchronize and Buffer(n, stream=) mark the stream or
    event in use while its handle is passed to the backend (a close() by another thread leaves
    the destroy to the last use).  The marks were appended before the ``try`` whose ``finally``
    drops them (and _Use recorded each mark one call after taking it), so a KeyboardInterrupt as
    an append returned left a mark for good: the object's close() then never destroyed its
    handle.  Swept at every interrupt point of accel's stream, buffer and allocator code."""
    from test_interrupt_holds_r67e import _sweep
    use_sim(monkeypatch, "cuda")
    s = accel.Stream(1)
    e = accel.Event()
    e.record(s)
    left = []

    def work():
        s.query()
        e.record(s)
        e.query()
        e.synchronize()
        s.synchronize()
        accel.Buffer(64, device=1, stream=s).close()

    def check(n, point, result):
        for obj in (s, e):
            if obj._busy:
                left.append((n, type(obj).__name__, point.site))
                obj._busy.clear()       # (so that the sweep goes on)

    points = _sweep(work, check)
    assert points > 20
    accel.synchronize(1)
    assert not left, f"a use mark was left at interrupt points {left[:8]} of {points}"
    e.close()
    s.close()
