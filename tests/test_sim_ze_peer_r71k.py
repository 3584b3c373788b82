"""Level Zero on cards without peer access (round r71k).

What the Level Zero specification says about a command list of device A touching device memory
allocated on device B (ze_api.h 1.4 on this machine; level-zero-spec scripts/core/*.yml, PROG.rst):

* zeMemAllocDevice: "In general, a device allocation may only be accessed by the device that owns
  it"; "The application must only use the memory allocation for the context and device, or its
  sub-devices, which was provided during allocation".
* zeDeviceCanAccessPeer: "Queries if one device can directly access peer device allocations"
  (true for a device and itself, tiles of one card, and cards on one root complex / fabric).
  PROG.rst, Memory table: a Device allocation, accessed by "Another Device: Optional (may require
  p2p)"; "Peer-to-Peer Access and Queries": "Copy data between devices over peer-to-peer fabric:
  zeCommandListAppendMemoryCopy"; "P2P Access to Physical Memory on Another Device": "only valid if
  zeDeviceCanAccessPeer returns success for the two devices involved. Attempting to use physical
  memory from a device without verified P2P access results in undefined behavior".
* zeCommandListAppendMemoryCopy / Fill: "The application must ensure the memory pointed to by
  dstptr and srcptr is accessible by the device on which the command list was created".

So (a) with zeDeviceCanAccessPeer(A, B) true a list of A may copy from / to, and a kernel of A
access, B's device memory; (b) with it false the spec names no code (undefined behaviour): the
simulator now refuses it (ze/commands.py ``_inaccessible``): INVALID_ARGUMENT at append for copies,
fills, kernel pointer arguments and mapped physical memory; a kernel reaching such memory
indirectly faults the device (DEVICE_LOST).  Host allocations ("Any Device: Yes") stay reachable, so
a copy between such cards is staged through host memory by the application.  Regular events need
no peer access (zeEventPoolCreate phDevices: "device handles which have visibility to the event
pool"; only counter-based events, not simulated, require it for waits).

accel on such a machine (ACCEL_SIM_PEER=none, two cards): Buffer.copy_from between the devices
(both allocator configurations), a captured cross-device copy and the selftest's multi_device check
fail: accel/backends/xpu has no memcpy_peer_async, so Backend.memcpy_peer_async's default
(memcpy_async: one zeCommandListAppendMemoryCopy naming both cards' memory) runs.
"""

import numpy as np
import pytest

import accel
from accel import sim
from accel._errors import AcceleratorError
from accel._ffi._ze import ffi

from conftest import use_sim
from test_sim_ze_metal_strict import ze  # noqa: F401 (the fixture)
from test_user_kernels import spirv_module

_UINT64_MAX = (1 << 64) - 1
G = 2 << 20
_NOT_STAGED = ("r71k: accel/backends/xpu/memory.py has no memcpy_peer_async: between cards without peer "
               "access Buffer.copy_from appends one zeCommandListAppendMemoryCopy naming both cards' memory "
               "(INVALID_ARGUMENT); it should stage through pinned host memory as cudaMemcpyPeerAsync does")


# -- the simulated library -------------------------------------------------------------------------

def _copy(z, cl, dst, src, n=64):
    return z.lib.zeCommandListAppendMemoryCopy(cl, dst, src, n, ffi.NULL, 0, ffi.NULL)


def _host(z, n=64):
    desc = ffi.new("ze_host_mem_alloc_desc_t *", {"stype": z.lib.ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC})
    p = ffi.new("void **")
    assert z.lib.zeMemAllocHost(z.ctx, desc, n, 0, p) == 0
    return p[0]


def _sync(z, cl):
    return z.lib.zeCommandListHostSynchronize(cl, _UINT64_MAX)


def _bytes(ptr, n=64):
    return bytes(ffi.buffer(ffi.cast("char *", ptr), n))


def _peer(z, a, b):
    v = ffi.new("ze_bool_t *", 7)
    assert z.lib.zeDeviceCanAccessPeer(z.devices[a], z.devices[b], v) == 0
    return v[0]


@pytest.fixture
def ze_no_peer(ze, monkeypatch):  # noqa: F811
    monkeypatch.setenv("ACCEL_SIM_PEER", "none")
    return ze


def test_ze_copies_and_fills_naming_another_cards_memory_are_refused(ze_no_peer):
    z = ze_no_peer()
    lib = z.lib
    assert _peer(z, 0, 1) == _peer(z, 1, 0) == 0
    a0, a1 = z.alloc(64, 0), z.alloc(64, 1)
    cl0, cl1 = z.immediate(0), z.immediate(1)
    bad = lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
    assert _copy(z, cl0, a0, a1) == bad            # device 0 reads device 1's memory
    assert _copy(z, cl0, a1, a0) == bad            # device 0 writes device 1's memory
    assert _copy(z, cl1, a0, a1) == bad            # and from the other card's list (work on device 1)
    assert _copy(z, cl1, a1, a0) == bad
    assert z.fill(cl0, a1) == bad
    assert z.fill(cl1, a0) == bad
    reg = z.regular(1)
    assert _copy(z, reg, a0, a1) == bad            # a regular list: refused at append too
    assert lib.zeCommandListClose(reg) == 0
    # nothing ran and no device was lost: each card still works on its own memory
    assert z.fill(cl0, a0, value=3) == 0 and z.fill(cl1, a1, value=4) == 0
    assert _sync(z, cl0) == 0 and _sync(z, cl1) == 0
    assert sim.state().ze_errors == []


def test_ze_a_copy_between_such_cards_staged_through_host_memory_works(ze_no_peer):
    z = ze_no_peer()
    a0, a1, h = z.alloc(64, 0), z.alloc(64, 1), _host(z)
    cl0, cl1 = z.immediate(0), z.immediate(1)
    assert z.fill(cl1, a1, value=9) == 0
    assert _copy(z, cl1, h, a1) == 0               # device 1: its memory -> host ("Any Device: Yes")
    assert _sync(z, cl1) == 0
    assert _copy(z, cl0, a0, h) == 0               # device 0: host -> its memory
    h2 = _host(z)
    assert _copy(z, cl0, h2, a0) == 0
    assert _sync(z, cl0) == 0
    assert _bytes(h2) == bytes([9]) * 64
    assert sim.state().ze_errors == []


def test_ze_peer_capable_cards_copy_each_others_memory(ze):  # noqa: F811
    """(a): zeDeviceCanAccessPeer true (the default ACCEL_SIM_PEER=all) -> copies and fills across."""
    z = ze()
    assert _peer(z, 0, 1) == 1
    a0, a1, h = z.alloc(64, 0), z.alloc(64, 1), _host(z)
    cl0 = z.immediate(0)
    assert z.fill(cl0, a1, value=5) == 0
    assert _copy(z, cl0, a0, a1) == 0
    assert _copy(z, cl0, h, a0) == 0
    assert _sync(z, cl0) == 0
    assert _bytes(h) == bytes([5]) * 64


def test_ze_tiles_of_one_card_stay_peers_when_cards_are_not(ze_no_peer):
    z = ze_no_peer(tiles=2)                        # FLAT: devices 0, 1 = card 0; 2, 3 = card 1
    assert len(z.devices) == 4
    assert _peer(z, 0, 1) == 1 and _peer(z, 0, 2) == 0
    t0, t1, c1 = z.alloc(64, 0), z.alloc(64, 1), z.alloc(64, 2)
    cl = z.immediate(1)
    assert z.fill(cl, t0, value=6) == 0            # "both are sub-devices and share the same parent"
    assert _copy(z, cl, t1, t0) == 0
    assert _copy(z, cl, c1, t1) == z.lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
    assert _sync(z, cl) == 0
    assert sim.state().ze_errors == []


def _module_kernel(z, name, dev=0):
    lib = z.lib
    image = spirv_module(name)
    data = ffi.new("uint8_t[]", image)
    desc = ffi.new("ze_module_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_MODULE_DESC,
                                         "format": lib.ZE_MODULE_FORMAT_IL_SPIRV, "inputSize": len(image),
                                         "pInputModule": data})
    mod = ffi.new("ze_module_handle_t *")
    assert lib.zeModuleCreate(z.ctx, z.devices[dev], desc, mod, ffi.NULL) == 0
    kname = ffi.new("char[]", name.encode())
    kdesc = ffi.new("ze_kernel_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_KERNEL_DESC, "pKernelName": kname})
    k = ffi.new("ze_kernel_handle_t *")
    assert lib.zeKernelCreate(mod[0], kdesc, k) == 0
    assert lib.zeKernelSetGroupSize(k[0], 64, 1, 1) == 0
    return k[0]


def _set_args(z, k, *args):
    for i, (fmt, value) in enumerate(args):
        v = ffi.new(fmt + " *", value)
        assert z.lib.zeKernelSetArgumentValue(k, i, ffi.sizeof(fmt), v) == 0


def _launch(z, cl, k):
    g = ffi.new("ze_group_count_t *", {"groupCountX": 1, "groupCountY": 1, "groupCountZ": 1})
    return z.lib.zeCommandListAppendLaunchKernel(cl, k, g, ffi.NULL, 0, ffi.NULL)


def test_ze_kernel_pointer_argument_into_another_cards_memory_is_refused(ze_no_peer):
    z = ze_no_peer()
    k = _module_kernel(z, "accel_test_fill_u32")   # fill(ptr out, u64 n, u32 value), accel.sim's
    a0, a1 = z.alloc(256, 0), z.alloc(256, 1)
    cl0 = z.immediate(0)
    _set_args(z, k, ("void *", a1), ("uint64_t", 64), ("uint32_t", 7))
    assert _launch(z, cl0, k) == z.lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
    _set_args(z, k, ("void *", a0), ("uint64_t", 64), ("uint32_t", 7))
    assert _launch(z, cl0, k) == 0
    assert _sync(z, cl0) == 0
    assert sim.state().ze_errors == []


def _indirect_copy(grid, block, view, dst, src, n):
    view(dst, n)[:] = view(src, n)                 # addresses passed as integers, not ``ptr``


@pytest.fixture
def indirect_kernel():
    sim.register_kernel("r71k_indirect", _indirect_copy, "u64, u64, u64")
    yield "r71k_indirect"
    sim.unregister_kernel("r71k_indirect")


@pytest.mark.parametrize("peer", ["none", "all"])
def test_ze_kernel_reaching_another_cards_memory_indirectly(ze, monkeypatch, indirect_kernel, peer):  # noqa: F811
    """Without peer access the access faults when the kernel runs (the device is lost, as any page
    fault); with it the kernel reads the other card's memory."""
    monkeypatch.setenv("ACCEL_SIM_PEER", peer)
    z = ze()
    k = _module_kernel(z, indirect_kernel)
    a0, a1, h = z.alloc(64, 0), z.alloc(64, 1), _host(z)
    cl1, cl0 = z.immediate(1), z.immediate(0)
    assert z.fill(cl1, a1, value=8) == 0 and _sync(z, cl1) == 0
    addr = lambda p: int(ffi.cast("uintptr_t", p))  # noqa: E731
    _set_args(z, k, ("uint64_t", addr(a0)), ("uint64_t", addr(a1)), ("uint64_t", 64))
    assert _launch(z, cl0, k) == 0
    if peer == "none":
        assert _sync(z, cl0) == z.lib.ZE_RESULT_ERROR_DEVICE_LOST
        assert any("cannot access it" in e for e in sim.state().ze_errors), sim.state().ze_errors
    else:
        assert _sync(z, cl0) == 0
        assert _copy(z, cl0, h, a0) == 0 and _sync(z, cl0) == 0
        assert _bytes(h) == bytes([8]) * 64


@pytest.mark.parametrize("peer", ["none", "all"])
def test_ze_mapped_physical_memory_of_another_card(ze, monkeypatch, peer):  # noqa: F811
    """PROG.rst, "P2P Access to Physical Memory on Another Device": valid only where
    zeDeviceCanAccessPeer is true."""
    monkeypatch.setenv("ACCEL_SIM_PEER", peer)
    z = ze()
    lib = z.lib
    out = ffi.new("void **")
    assert lib.zeVirtualMemReserve(z.ctx, ffi.cast("void *", 1 << 44), 2 * G, out) == 0
    va = out[0]
    desc = ffi.new("ze_physical_mem_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_PHYSICAL_MEM_DESC, "size": G})
    h = ffi.new("ze_physical_mem_handle_t *")
    assert lib.zePhysicalMemCreate(z.ctx, z.devices[1], desc, h) == 0      # on device 1 (card 1)
    assert lib.zeVirtualMemMap(z.ctx, va, G, h[0], 0, 1) == 0             # READWRITE
    a0 = z.alloc(64, 0)
    cl0, cl1 = z.immediate(0), z.immediate(1)
    assert z.fill(cl1, va, value=2) == 0 and _sync(z, cl1) == 0          # its own card: fine
    want = 0 if peer == "all" else lib.ZE_RESULT_ERROR_INVALID_ARGUMENT
    assert _copy(z, cl0, a0, va) == want
    assert z.fill(cl0, va, value=3) == want
    assert _sync(z, cl0) == 0
    assert lib.zeVirtualMemUnmap(z.ctx, va, G) == 0
    assert lib.zePhysicalMemDestroy(z.ctx, h[0]) == 0
    assert lib.zeVirtualMemFree(z.ctx, va, 2 * G) == 0
    assert sim.state().ze_errors == []


# -- accel on such a machine -----------------------------------------------------------------------

@pytest.fixture(params=["expandable_segments:False", "expandable_segments:True"], ids=["classic", "expandable"])
def xpu_no_peer(request, monkeypatch):
    use_sim(monkeypatch, "xpu", ACCEL_SIM_PEER="none", ACCEL_SIM_DEVICES=2, ACCEL_ALLOC_CONF=request.param)
    yield request.param
    sim.reset()


def _filled(n, device, value, stream=None):
    return accel.Buffer(n, device=device).fill_(value, stream)


def test_accel_xpu_reports_the_cards_are_not_peers(xpu_no_peer):
    assert accel.can_device_access_peer(0, 1) is False
    assert accel.can_device_access_peer(1, 0) is False
    assert accel.can_device_access_peer(1, 1) is True          # zeDeviceCanAccessPeer: the same device


# (r71k found; fixed in session 31: XpuBackend.memcpy_peer_async stages through host memory)
@pytest.mark.parametrize("current", [0, 1])
def test_accel_xpu_copy_from_between_cards_without_peer_access(xpu_no_peer, current):
    accel.set_device_index(current)
    a = _filled(4096, 0, 3)
    b = accel.Buffer(4096, device=1)
    b.copy_from(a)
    assert (b.to_numpy() == 3).all()
    b.fill_(4)
    a.copy_from(b)
    assert (a.to_numpy() == 4).all()
    assert sim.state().ze_errors == []


# (r71k found; fixed in session 31: refused up front with CaptureError, the capture discarded)
def test_accel_xpu_captured_copy_between_cards_without_peer_access(xpu_no_peer):
    """A copy between cards without peer access goes through host memory, which a graph of one
    card cannot hold: refused with CaptureError naming the fix; the copy then works eagerly and
    the graph captures again."""
    accel.set_device_index(0)
    a = _filled(4096, 0, 1)
    accel.synchronize(0)
    b = accel.Buffer(4096, device=1)
    s1 = accel.Stream(device=1)
    g = accel.Graph()
    with pytest.raises(accel.CaptureError, match="zeDeviceCanAccessPeer"):
        with s1, g:
            b.copy_from(a, s1)
    b.copy_from(a, s1)
    s1.synchronize()
    assert (b.to_numpy() == 1).all()
    with s1, g:
        b.fill_(2, s1)
    g.replay()
    s1.synchronize()
    assert (b.to_numpy() == 2).all()
    assert sim.state().ze_errors == []


# (r71k found; fixed in session 31)
def test_accel_xpu_selftest_multi_device_without_peer_access(xpu_no_peer):
    from accel import selftest
    record = selftest.run_check_here("multi_device", 0, quick=True)
    assert record["status"] == "pass", record.get("error")


@pytest.mark.parametrize("name", ["alloc_copy", "stream_event_order", "graph_capture_replay", "vmm"])
def test_accel_xpu_selftest_single_device_checks_pass_on_the_other_card(xpu_no_peer, name):
    from accel import selftest
    record = selftest.run_check_here(name, 1, quick=True)
    assert record["status"] == "pass", record.get("error")


def test_accel_xpu_cross_device_event_waits_without_peer_access(xpu_no_peer):
    """Regular events need no peer access: each device waits for the other's work."""
    accel.set_device_index(0)
    s0, s1 = accel.Stream(device=0), accel.Stream(device=1)
    a, b = accel.Buffer(4096, device=0), accel.Buffer(4096, device=1)
    a.fill_(8, s0)
    e0 = accel.Event(device=0)
    e0.record(s0)
    s1.wait_event(e0)                              # device 1 waits for device 0's event
    b.fill_(2, s1)
    e1 = s1.record_event()
    s0.wait_event(e1)                              # and device 0 for device 1's
    s0.wait_stream(s1)
    a.fill_(5, s0)
    s0.synchronize()
    assert (a.to_numpy() == 5).all() and (b.to_numpy() == 2).all()
    assert sim.state().ze_errors == []


def test_accel_xpu_each_cards_own_and_host_copies_work_without_peer_access(xpu_no_peer):
    accel.set_device_index(0)
    s1 = accel.Stream(device=1)                    # the non-current device
    for d, s in ((0, None), (1, s1)):
        x = _filled(4096, d, d + 1, s)
        y = accel.Buffer(4096, device=d)
        y.copy_from(x, s)
        y.copy_from(np.full(4096, d + 7, np.uint8), s, non_blocking=True)
        accel.synchronize(d)
        assert (y.to_numpy() == d + 7).all() and (x.to_numpy() == d + 1).all()
    # a copy between the cards staged by hand through the host works
    a, b = _filled(4096, 0, 6), accel.Buffer(4096, device=1)
    b.copy_from(a.to_numpy(), s1)
    s1.synchronize()
    assert (b.to_numpy() == 6).all()
    assert sim.state().ze_errors == []


def test_accel_xpu_graph_on_the_other_card_without_peer_access(xpu_no_peer):
    accel.set_device_index(0)
    x, y = _filled(4096, 1, 1), accel.Buffer(4096, device=1)
    s1 = accel.Stream(device=1)
    accel.synchronize(1)
    g = accel.Graph()
    with s1, g:
        y.copy_from(x, s1)
        x.fill_(2, s1)
    g.replay()
    s1.synchronize()
    assert (y.to_numpy() == 1).all() and (x.to_numpy() == 2).all()
    assert sim.state().ze_errors == []


def test_accel_xpu_refuses_a_kernel_on_another_cards_memory_up_front(xpu_no_peer):
    k = accel.Module(spirv_module("accel_test_fill_u32"), device=0).function("accel_test_fill_u32", "ptr, u64, u32")
    out1 = accel.Buffer(256, device=1)
    with pytest.raises(ValueError, match="memory of device 1"):
        accel.launch(k, 1, 64, out1, 64, 7)
    out0 = accel.Buffer(256, device=0)
    accel.launch(k, 1, 64, out0, 64, 7)
    assert (out0.to_numpy(np.uint32)[:64] == 7).all()
    assert sim.state().ze_errors == []
