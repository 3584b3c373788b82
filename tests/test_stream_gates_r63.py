"""Memory used on streams that are then destroyed keeps no vendor event once that work is done.

When a stream is destroyed, every block it used waits for its work: the allocator records an
event on it (a gate) and the block waits for that event when it is freed.  A block that lives
on (weights, a pinned staging array, a cudaMallocAsync allocation) while a program makes a
stream per request used to keep every gate until its own free: one vendor event per request,
unbounded by live objects (r63b, translating simpleStreams).  A stream whose work is done
needs no gate, and a gate whose event completed is dropped (its event cached again) when
another stream's gate joins the block.
"""

from __future__ import annotations

import pytest

import accel
from accel import memory, sim

from conftest import SIMS, use_sim

MiB = 1 << 20


def _events(kind: str) -> int:
    st = sim.state()
    if kind == "xpu":
        return st.ze_live_events
    if kind == "mps":
        return st.metal_live_objects.get("MTLSharedEvent", 0) + st.metal_live_objects.get("MTLEvent", 0)
    return st.events


def _requests(kind, dev, n, use):
    """``n`` requests, each on a new stream that uses the kept memory (``use(stream, i)``) and
    is destroyed, its work perhaps still queued; then the device is synchronized.  The live
    vendor events then."""
    done = None
    for i in range(n):
        s = accel.Stream(dev)
        if done is not None:
            s.wait_event(done)          # the requests write in turn
        use(s, i)
        done = s.record_event()
        s.close()
    accel.synchronize(dev)
    memory.empty_cache()        # (cached events go; a gate the kept memory holds would stay)
    return _events(kind)


def _kept_buffer(dev):
    weights = accel.Buffer(4096, device=dev).fill_(0)

    def use(s, i):
        weights.fill_(i % 256, stream=s)
        weights.record_stream(s)
    return weights, use


def _kept_pinned(dev):
    host = accel.empty_pinned(4096)
    dst = accel.Buffer(4096, device=dev)

    def use(s, i):
        host[:] = i % 256
        dst.copy_from(host, stream=s, non_blocking=True)
        s.synchronize()
    return (host, dst), use


@pytest.mark.parametrize("conf", ["", "expandable_segments:False", "backend:cudaMallocAsync"],
                         ids=lambda v: v or "default")
@pytest.mark.parametrize("dev", [0, 1])
@pytest.mark.parametrize("kind", SIMS)
def test_a_kept_buffer_used_on_many_closed_streams_holds_no_events(monkeypatch, kind, dev, conf):
    if kind == "mps" and dev:
        pytest.skip("Metal has one device")
    if conf and kind == "mps" or ("cudaMallocAsync" in conf and kind != "cuda"):
        pytest.skip("cudaMallocAsync is CUDA's; Metal has no expandable segments")
    use_sim(monkeypatch, kind, **({"ACCEL_ALLOC_CONF": conf} if conf else {}))
    monkeypatch.setenv("ACCEL_SIM_DELAY_US", "50")
    kept, use = _kept_buffer(dev)
    first = _requests(kind, dev, 10, use)
    later = _requests(kind, dev, 100, use)
    assert later <= first, f"{later - first} more vendor events after 90 more closed streams"
    assert (kept.to_numpy() == 99).all()
    kept.close()
    accel.synchronize(dev)
    memory.empty_cache()


@pytest.mark.parametrize("dev", [0, 1])
@pytest.mark.parametrize("kind", SIMS)
def test_a_kept_pinned_array_used_on_many_closed_streams_holds_no_events(monkeypatch, kind, dev):
    if kind == "mps" and dev:
        pytest.skip("Metal has one device")
    use_sim(monkeypatch, kind)
    kept, use = _kept_pinned(dev)
    first = _requests(kind, dev, 10, use)
    later = _requests(kind, dev, 100, use)
    assert later <= first, f"{later - first} more vendor events after 90 more closed streams"
    assert (kept[1].to_numpy() == 99).all()
    del kept
    accel.synchronize(dev)
    memory.empty_cache()
