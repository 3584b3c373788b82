"""Stream-ordered reuse on the simulator with real asynchrony (ACCEL_SIM_DELAY_US).

A block written by a slow stream after it was freed must not be handed to
another allocation before that write is done.  The second test switches the
allocator's event handling off and checks that the same scenario then does
see the corruption, so the first test can fail.
"""

import pytest

from accel import _lazy, memory
from accel.memory._caching import DeviceCachingAllocator

N = 1 << 16
DELAY_US = 30000          # every stream operation takes 30 ms


@pytest.fixture
def slow_sim(monkeypatch, sim_backend):
    monkeypatch.setenv("ACCEL_SIM_DELAY_US", str(DELAY_US))
    _lazy._reset_for_tests()
    return _lazy.lazy_init()


def reuse_scenario(be):
    """Free a block that a slow stream is about to overwrite, allocate again, and
    write the new allocation; returns (old ptr, new ptr, bytes read back)."""
    np = pytest.importorskip("numpy")
    alloc = memory.device_allocator(0)
    mine, slow = be.stream_create(), be.stream_create()
    scratch = be.mem_alloc(N)
    ptr = alloc.malloc(N, mine)
    for _ in range(3):                      # the slow stream is busy for ~90 ms ...
        be.memset_async(scratch, 0, N, slow)
    be.memset_async(ptr, 0xAA, N, slow)     # ... before it writes the block
    alloc.record_stream(ptr, slow)
    alloc.free(ptr)
    new = alloc.malloc(N, mine)
    be.memset_async(new, 0x55, N, mine)     # done after ~30 ms
    out = np.zeros(N, dtype=np.uint8)
    be.stream_synchronize(mine)
    be.stream_synchronize(slow)
    be.memcpy_async(out.ctypes.data, new, N, mine)
    be.stream_synchronize(mine)
    alloc.free(new)
    be.mem_free(scratch)
    for s in (mine, slow):
        be.stream_destroy(s)
    return ptr, new, out


def test_reuse_waits_for_recorded_streams(slow_sim):
    ptr, new, data = reuse_scenario(slow_sim)
    assert new != ptr, "the block was reused while another stream still wrote it"
    assert (data == 0x55).all(), "the new allocation was overwritten by the other stream"
    # the block stays active (pending) until its event is seen; empty_cache waits for it
    assert memory.memory_stats()["active.all.current"] == 1
    memory.empty_cache()
    assert memory.memory_stats()["active.all.current"] == 0
    assert memory.memory_reserved() == 0


def test_scenario_catches_reuse_that_ignores_events(slow_sim, monkeypatch):
    # Event handling off: a block freed after record_stream is cached at once.
    monkeypatch.setattr(DeviceCachingAllocator, "_free_with_uses",
                        lambda self, block: self._free_block(block, 0))
    ptr, new, data = reuse_scenario(slow_sim)
    assert new == ptr
    assert not (data == 0x55).all(), "the check above must see the corruption"


def test_pinned_host_block_waits_for_copy(slow_sim):
    be = slow_sim
    host = memory.host_allocator()
    stream = be.stream_create()
    dev = be.mem_alloc(N)
    h = host.malloc(N)
    be.memcpy_async(dev, h, N, stream)      # reads the pinned block ~30 ms from now
    host.record_stream(h, stream)
    host.free(h)
    assert host.malloc(N) != h, "pinned block reused under a pending copy"
    be.stream_synchronize(stream)
    assert host.malloc(N) == h
    be.mem_free(dev)
    be.stream_destroy(stream)
