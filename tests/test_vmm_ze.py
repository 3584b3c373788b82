"""Virtual memory on Level Zero (issue 15 items 1 and 3): the simulated zeVirtualMem*/zePhysicalMem*
rules called directly, and the XPU backend's vmm_* methods on both devices."""

import pytest

from accel import _lazy, sim
from accel._errors import AcceleratorError, CaptureError, OutOfMemoryError
from accel.sim import _vmm
from conftest import use_sim

G = 2 << 20
pytestmark = pytest.mark.skipif(not _vmm.supported(), reason="this host cannot play virtual memory (mmap)")


@pytest.fixture
def xpu(monkeypatch):
    use_sim(monkeypatch, "xpu")
    b = _lazy.lazy_init()
    yield b
    sim.reset()


def _ze(b):
    ffi, lib, _ = b._lib
    return ffi, lib


def _st():
    from accel.sim import ze
    s = ze.state()
    return (s["ze_vmm_reservations"], s["ze_vmm_handles"], s["ze_vmm_physical_bytes"], s["ze_vmm_mappings"])


def test_ze_rules_through_the_library(xpu):
    ffi, lib = _ze(xpu)
    dev = xpu._device(0)
    C = lib
    ps = ffi.new("size_t *")
    assert lib.zeVirtualMemQueryPageSize(dev.ctx, dev.handle, 4096, ps) == 0 and ps[0] == G
    assert lib.zeVirtualMemQueryPageSize(dev.ctx, dev.handle, 0, ps) == C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE
    out = ffi.new("void **")
    hint = ffi.cast("void *", 1 << 44)
    # @returns: a null pStart is ZE_RESULT_ERROR_INVALID_NULL_POINTER
    assert lib.zeVirtualMemReserve(dev.ctx, ffi.NULL, 4 * G, out) == C.ZE_RESULT_ERROR_INVALID_NULL_POINTER
    assert lib.zeVirtualMemReserve(dev.ctx, hint, 0, out) == C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE
    assert lib.zeVirtualMemReserve(dev.ctx, hint, G + 4096, out) == C.ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT
    assert lib.zeVirtualMemReserve(dev.ctx, hint, 4 * G, out) == 0
    va = int(ffi.cast("uintptr_t", out[0]))
    assert va % G == 0
    desc = ffi.new("ze_physical_mem_desc_t *")
    desc.stype = C.ZE_STRUCTURE_TYPE_PHYSICAL_MEM_DESC
    h = ffi.new("ze_physical_mem_handle_t *")
    desc.size = G + 1
    assert lib.zePhysicalMemCreate(dev.ctx, dev.handle, desc, h) == C.ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT
    desc.size, desc.flags = 2 * G, 2
    assert lib.zePhysicalMemCreate(dev.ctx, dev.handle, desc, h) == C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    desc.flags = 0
    assert lib.zePhysicalMemCreate(dev.ctx, dev.handle, desc, h) == 0
    p = ffi.cast("void *", va)
    assert lib.zeVirtualMemMap(dev.ctx, p, 2 * G, h[0], 0, 3) == C.ZE_RESULT_ERROR_INVALID_ENUMERATION
    assert lib.zeVirtualMemMap(dev.ctx, ffi.cast("void *", va + 4096), G, h[0], 0, 1) == \
        C.ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT
    assert lib.zeVirtualMemMap(dev.ctx, ffi.cast("void *", va + 3 * G), 2 * G, h[0], 0, 1) == \
        C.ZE_RESULT_ERROR_INVALID_ARGUMENT                   # runs past the reservation
    assert lib.zeVirtualMemMap(dev.ctx, p, G, h[0], 2 * G, 1) == C.ZE_RESULT_ERROR_INVALID_ARGUMENT  # offset
    assert lib.zeVirtualMemMap(dev.ctx, p, G, h[0], G, 0) == 0      # part of the object, no access
    assert lib.zeVirtualMemMap(dev.ctx, p, G, h[0], 0, 1) == C.ZE_RESULT_ERROR_INVALID_ARGUMENT   # double map
    acc, n = ffi.new("ze_memory_access_attribute_t *"), ffi.new("size_t *")
    assert lib.zeVirtualMemGetAccessAttribute(dev.ctx, p, G, acc, n) == 0 and acc[0] == 0 and n[0] == G
    assert lib.zeVirtualMemSetAccessAttribute(dev.ctx, p, G, 1) == 0
    assert lib.zeVirtualMemGetAccessAttribute(dev.ctx, p, G, acc, n) == 0 and acc[0] == 1
    # a mapped object cannot be destroyed (HANDLE_OBJECT_IN_USE); unmapping part of a mapping is refused
    assert lib.zePhysicalMemDestroy(dev.ctx, h[0]) == C.ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE
    assert lib.zeVirtualMemUnmap(dev.ctx, p, G // 2) == C.ZE_RESULT_ERROR_UNSUPPORTED_SIZE
    # zeVirtualMemFree unmaps what is left (ze_api.h), then the object can go
    assert lib.zeVirtualMemFree(dev.ctx, p, 4 * G) == 0
    assert lib.zePhysicalMemDestroy(dev.ctx, h[0]) == 0
    assert _st() == (0, 0, 0, 0)


def test_backend_vmm_on_both_devices_with_copies(xpu):
    import numpy as np
    xpu.set_device(0)
    for index in (0, 1):
        assert xpu.vmm_supported(index)
        g = xpu.vmm_granularity(index)
        assert g == G
        used0 = sim.state().ze_device_used[index]
        va = xpu.vmm_reserve(index, 4 * g)
        h = xpu.vmm_create(index, 2 * g)
        assert sim.state().ze_device_used[index] == used0 + 2 * g
        xpu.vmm_map(va, 2 * g, h, index)
        xpu.set_device(index)
        s = xpu.stream_create()
        src = np.arange(4096, dtype=np.uint8)
        out = np.zeros_like(src)
        xpu.memcpy_async(va + g - 2048, src.ctypes.data, 4096, s)     # spans the two pages
        xpu.memcpy_async(out.ctypes.data, va + g - 2048, 4096, s)
        xpu.stream_synchronize(s)
        assert (out == src).all()
        xpu.stream_destroy(s)
        xpu.set_device(0)
        xpu.vmm_unmap(va, 2 * g)
        xpu.vmm_release(h)
        xpu.vmm_free(va, 4 * g)
        assert sim.state().ze_device_used[index] == used0
    assert _st() == (0, 0, 0, 0)


def test_backend_oom_and_failing_calls_leak_nothing(xpu):
    with pytest.raises(OutOfMemoryError, match="zePhysicalMemCreate"):
        xpu.vmm_create(1, (sim.config().memory // G + 1) * G)
    sim.inject_oom()
    with pytest.raises(OutOfMemoryError):
        xpu.vmm_create(0, G)
    for call in ("zeVirtualMemReserve", "zePhysicalMemCreate", "zeVirtualMemMap", "zeVirtualMemUnmap",
                 "zePhysicalMemDestroy", "zeVirtualMemFree"):
        sim.inject_error(call, 0x78000004)          # ZE_RESULT_ERROR_INVALID_ARGUMENT
        va = h = None
        mapped = False
        with pytest.raises(AcceleratorError, match=call):
            try:
                va = xpu.vmm_reserve(0, 2 * G)
                h = xpu.vmm_create(0, G)
                xpu.vmm_map(va, G, h, 0)
                mapped = True
                xpu.vmm_unmap(va, G)
                mapped = False
                xpu.vmm_release(h)
                h = None
                xpu.vmm_free(va, 2 * G)
                va = None
            finally:
                if mapped:
                    xpu.vmm_unmap(va, G)
                if h is not None:
                    xpu.vmm_release(h)
                if va is not None:
                    xpu.vmm_free(va, 2 * G)
        assert _st() == (0, 0, 0, 0), call


def test_backend_copy_into_an_unmapped_page_faults(xpu):
    import numpy as np
    va = xpu.vmm_reserve(0, 4 * G)
    h = xpu.vmm_create(0, G)
    xpu.vmm_map(va, G, h, 0)
    s = xpu.stream_create()
    src = np.ones(64, dtype=np.uint8)
    xpu.memcpy_async(va + G - 32, src.ctypes.data, 64, s)     # the second half is not mapped
    with pytest.raises(AcceleratorError, match="DEVICE_LOST"):
        xpu.stream_synchronize(s)
    assert "not mapped" in sim.state().ze_errors[-1]


def test_backend_refuses_vmm_during_capture(xpu):
    va = xpu.vmm_reserve(0, 2 * G)
    h = xpu.vmm_create(0, G)
    s = xpu.stream_create()
    xpu.capture_begin(s, "global")
    try:
        with pytest.raises(CaptureError, match="stream capture is underway"):
            xpu.vmm_map(va, G, h, 0)
    finally:
        xpu.graph_destroy(xpu.capture_end(s))
    xpu.vmm_release(h)
    xpu.vmm_free(va, 2 * G)


def test_close_releases_what_is_left(xpu):
    va = xpu.vmm_reserve(0, 4 * G)
    h = xpu.vmm_create(1, G)
    xpu.vmm_map(va, G, h, 0)
    xpu.vmm_create(0, 2 * G)                   # never mapped
    assert _st() == (1, 2, 3 * G, 1)
    xpu.close()
    assert _st() == (0, 0, 0, 0)
    assert "_vmm_state" not in xpu.__dict__


class _LibWith:
    """The backend's library with one function wrapped: ``after(result, *args)`` runs right after
    the real call returns, where another thread could run (the backend's lock is not held)."""

    def __init__(self, lib, name, after):
        self._lib, self._name, self._after = lib, name, after

    def __getattr__(self, attr):
        real = getattr(self._lib, attr)
        if attr != self._name:
            return real

        def call(*args):
            rc = real(*args)
            self._after(rc, *args)
            return rc
        return call


def test_a_va_or_handle_reused_between_a_free_and_its_bookkeeping_stays_known(xpu):
    """Two device allocators reserve and free on their own threads.  zeVirtualMemFree hands the
    range back before vmm_free forgets it, and the driver gives the same address to the next
    reserve; the backend then forgot the *new* reservation (test_load's eight threads died with
    "0x... is in no reservation of this backend" right after a successful map).  Physical handles
    have the same window between zePhysicalMemDestroy and the table update."""
    ffi, lib = _ze(xpu)
    t = xpu._vmm_tables()
    va = xpu.vmm_reserve(1, 4 * G)
    got = {}

    def reserve_again(rc, *args):
        t["hint"] = va                              # the driver picks the freed range again
        got["va"] = xpu.vmm_reserve(1, 4 * G)
    xpu._lib = (ffi, _LibWith(lib, "zeVirtualMemFree", reserve_again), xpu._lib[2])
    try:
        xpu.vmm_free(va, 4 * G)
    finally:
        xpu._lib = (ffi, lib, xpu._lib[2])
    assert got["va"] == va
    h = xpu.vmm_create(1, G)
    xpu.vmm_map(va, G, h, 1)
    xpu.vmm_set_access(va, G, 1)                    # raised: "is in no reservation of this backend"
    xpu.vmm_unmap(va, G)

    reused = (xpu._device(1), G, xpu._device(1).ctx)

    def created_again(rc, *args):                   # a create on another thread gets the same value
        with xpu._lock:
            t["handles"][h] = reused
    xpu._lib = (ffi, _LibWith(lib, "zePhysicalMemDestroy", created_again), xpu._lib[2])
    try:
        xpu.vmm_release(h)
    finally:
        xpu._lib = (ffi, lib, xpu._lib[2])
    assert t["handles"].get(h) is reused            # was forgotten: the new owner's release failed
    del t["handles"][h]
    xpu.vmm_free(va, 4 * G)
    assert _st()[:3] == (0, 0, 0)


@pytest.mark.parametrize("kind", ["device", "host"])
def test_an_address_reused_between_zememfree_and_its_bookkeeping_stays_known(xpu, kind):
    """mem_free/host_free forgot the pointer after zeMemFree returned: an allocation another
    thread got at the same address in between was forgotten with it (its own free then raised
    'not a live ... allocation')."""
    ffi, lib = _ze(xpu)
    if kind == "device":
        ptr, table, free = xpu.mem_alloc(G), xpu._allocs, xpu.mem_free
    else:
        ptr, table, free = xpu.host_alloc(G), xpu._host_allocs, xpu.host_free
    reused = table[ptr]

    def allocated_again(rc, *args):                 # another thread's allocation gets the address
        with xpu._lock:
            table[ptr] = reused
    xpu._lib = (ffi, _LibWith(lib, "zeMemFree", allocated_again), xpu._lib[2])
    try:
        free(ptr)
    finally:
        xpu._lib = (ffi, lib, xpu._lib[2])
    assert table.get(ptr) is reused
    del table[ptr]


def test_simulator_keeps_a_reservation_made_at_a_just_freed_address(xpu, monkeypatch):
    """The simulated zeVirtualMemFree forgot the reservation's context after freeing the range:
    a zeVirtualMemReserve on another thread in between could get the same range, and its
    context entry was then dropped, so every zeVirtualMemMap into it failed with
    ZE_RESULT_ERROR_INVALID_ARGUMENT (test_load's xpu threads died this way)."""
    from accel.sim import ze
    ffi, lib = _ze(xpu)
    ctx = xpu._device(1).ctx
    rt = ze._runtime()
    out = ffi.new("void **")
    hint = ffi.cast("void *", 1 << 40)
    assert lib.zeVirtualMemReserve(ctx, hint, 2 * G, out) == 0
    base = int(ffi.cast("uintptr_t", out[0]))
    real_free, again = rt.vmm.free, {}

    def free_then_reserve(*args, **kwargs):
        real_free(*args, **kwargs)
        got = ffi.new("void **")
        assert lib.zeVirtualMemReserve(ctx, hint, 2 * G, got) == 0
        again["va"] = int(ffi.cast("uintptr_t", got[0]))
    monkeypatch.setattr(rt.vmm, "free", free_then_reserve)
    assert lib.zeVirtualMemFree(ctx, ffi.cast("void *", base), 2 * G) == 0
    monkeypatch.setattr(rt.vmm, "free", real_free)
    va = again["va"]
    h = ffi.new("ze_physical_mem_handle_t *")
    desc = ffi.new("ze_physical_mem_desc_t *")
    desc.stype = lib.ZE_STRUCTURE_TYPE_PHYSICAL_MEM_DESC
    desc.size = G
    assert lib.zePhysicalMemCreate(ctx, xpu._device(1).handle, desc, h) == 0
    assert lib.zeVirtualMemMap(ctx, ffi.cast("void *", va), G, h[0], 0, 1) == 0   # was INVALID_ARGUMENT
    assert lib.zeVirtualMemUnmap(ctx, ffi.cast("void *", va), G) == 0
    assert lib.zePhysicalMemDestroy(ctx, h[0]) == 0
    assert lib.zeVirtualMemFree(ctx, ffi.cast("void *", va), 2 * G) == 0
    assert _st()[:3] == (0, 0, 0)
