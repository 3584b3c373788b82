"""The codes the simulated CUDA runtime and driver return where an H100 refuses with another code
than the simulator did (session r61b): each refusal as measured on an H100 (driver 580.159.04,
libcudart 13.0), tests/conformance/cuda_h100_2026-12-05.json, scenario named in each test, and
the state left unchanged by the refusal.  Device 1 (not the current one) is exercised too.

Codes (driver_types.h / cuda.h): cudaErrorInvalidValue 1, cudaErrorInvalidDevice 101,
cudaErrorPeerAccessUnsupported 217, cudaErrorIllegalState 401, cudaErrorNotSupported and
CUDA_ERROR_NOT_SUPPORTED 801.
"""

import pytest

from accel import sim
from accel._errors import AcceleratorError
from accel._ffi._cudart import ffi
from accel.sim import _vmm
from conftest import use_sim
from test_sim_cuda import ok, stream
from test_sim_cuda_graph_mem import access_descs, access_of, end_capture, instantiate, malloc_async, pool_of

INVALID_VALUE, INVALID_DEVICE, PEER_UNSUPPORTED, ILLEGAL_STATE, NOT_SUPPORTED = 1, 101, 217, 401, 801
PEER_NOT_ENABLED = 705
EXTERNAL = 1                    # cudaEventRecordExternal == cudaEventWaitExternal
NONE, READ, READ_WRITE = 0, 1, 3
LOCATION_DEVICE, LOCATION_HOST = 1, 2
GLOBAL = 0


@pytest.fixture
def lib(monkeypatch):
    use_sim(monkeypatch, "cuda")
    sim.reset()
    yield sim.open_library("cudart")
    sim.reset()


def event(lib):
    p = ffi.new("cudaEvent_t *")
    ok(lib.cudaEventCreateWithFlags(p, 2))
    return p[0]


# -- event_external_outside_capture ---------------------------------------------------------------

@pytest.mark.parametrize("device", [0, 1])
def test_external_event_flags_outside_capture_are_illegal_state(lib, device):
    ok(lib.cudaSetDevice(device))
    s, e = stream(lib), event(lib)
    assert lib.cudaEventRecordWithFlags(e, s, EXTERNAL) == ILLEGAL_STATE
    assert lib.cudaGetLastError() == ILLEGAL_STATE
    assert lib.cudaGetLastError() == 0
    ok(lib.cudaEventQuery(e))                        # still never recorded
    assert lib.cudaStreamWaitEvent(s, e, EXTERNAL) == ILLEGAL_STATE
    assert lib.cudaGetLastError() == ILLEGAL_STATE
    # another flag is still an invalid value, and the stream works as before
    assert lib.cudaEventRecordWithFlags(e, s, 2) == INVALID_VALUE
    assert lib.cudaStreamWaitEvent(s, e, 2) == INVALID_VALUE
    lib.cudaGetLastError()
    ok(lib.cudaEventRecordWithFlags(e, s, 0))
    ok(lib.cudaEventSynchronize(e))
    ok(lib.cudaStreamSynchronize(s))
    assert sim.state().captures == 0


# -- graph_mem_second_instantiation ---------------------------------------------------------------

@pytest.mark.parametrize("device", [0, 1])
@pytest.mark.parametrize("free_in_graph", [False, True])
def test_second_instantiation_of_a_graph_with_memory_nodes_is_not_supported(lib, device, free_in_graph):
    ok(lib.cudaSetDevice(device))
    s = stream(lib)
    ok(lib.cudaStreamBeginCapture(s, GLOBAL))
    p = malloc_async(lib, 1 << 20, s)
    ok(lib.cudaMemsetAsync(p, 0, 256, s))
    if free_in_graph:
        ok(lib.cudaFreeAsync(p, s))
    graph = end_capture(lib, s)
    first = instantiate(lib, graph)
    execs = sim.state().graph_execs
    y = ffi.new("cudaGraphExec_t *")
    assert lib.cudaGraphInstantiate(y, graph, 0) == NOT_SUPPORTED
    assert lib.cudaGetLastError() == NOT_SUPPORTED
    assert sim.state().graph_execs == execs          # nothing made
    ok(lib.cudaGraphLaunch(first, s))                # the first works as before
    ok(lib.cudaStreamSynchronize(s))
    ok(lib.cudaGraphExecDestroy(first))
    ok(lib.cudaGraphExecDestroy(instantiate(lib, graph)))   # once it is gone, a new one may be made
    ok(lib.cudaGraphDestroy(graph))


# -- peer_access_one_device -----------------------------------------------------------------------

@pytest.mark.parametrize("devices", [1, 2])
def test_enable_peer_access_to_itself_is_peer_access_unsupported(lib, devices):
    sim.configure(devices=devices)
    for d in range(devices):
        ok(lib.cudaSetDevice(d))
        can = ffi.new("int *")
        ok(lib.cudaDeviceCanAccessPeer(can, d, d))
        assert can[0] == 0
        assert lib.cudaDeviceEnablePeerAccess(d, 0) == PEER_UNSUPPORTED
        assert lib.cudaGetLastError() == PEER_UNSUPPORTED
        assert lib.cudaDeviceEnablePeerAccess(99, 0) == INVALID_DEVICE
        assert lib.cudaGetLastError() == INVALID_DEVICE
        assert lib.cudaDeviceDisablePeerAccess(d) == PEER_NOT_ENABLED     # nothing was enabled
        assert lib.cudaGetLastError() == PEER_NOT_ENABLED
    if devices == 2:
        ok(lib.cudaSetDevice(1))
        ok(lib.cudaDeviceEnablePeerAccess(0, 0))    # a real peer still can be
        ok(lib.cudaDeviceDisablePeerAccess(0))


# -- pool_rules_one_device ------------------------------------------------------------------------

@pytest.mark.parametrize("owner", [0, 1])
def test_pool_set_access_codes(lib, owner):
    other = 1 - owner
    pool = pool_of(lib, owner)
    cases = [((LOCATION_DEVICE, owner, READ), NOT_SUPPORTED),
             ((LOCATION_DEVICE, owner, NONE), INVALID_DEVICE),
             ((LOCATION_HOST, 0, READ_WRITE), NOT_SUPPORTED),
             ((LOCATION_DEVICE, 99, READ_WRITE), INVALID_DEVICE),
             ((LOCATION_DEVICE, owner, 2), INVALID_VALUE)]
    for bad, code in cases:
        assert lib.cudaMemPoolSetAccess(pool, access_descs(bad), 1) == code, bad
        assert lib.cudaGetLastError() == code, bad
        # in a list after a valid entry: the same code, and nothing applied
        assert lib.cudaMemPoolSetAccess(pool, access_descs((LOCATION_DEVICE, other, READ_WRITE), bad), 2) \
            == code, bad
        lib.cudaGetLastError()
        assert access_of(lib, pool, other) == NONE and access_of(lib, pool, owner) == READ_WRITE
    ok(lib.cudaMemPoolSetAccess(pool, access_descs((LOCATION_DEVICE, owner, READ_WRITE)), 1))
    ok(lib.cudaMemPoolSetAccess(pool, access_descs((LOCATION_DEVICE, other, READ)), 1))
    assert access_of(lib, pool, other) == READ


# -- vmm_rules ------------------------------------------------------------------------------------

vmm = pytest.mark.skipif(not _vmm.supported(), reason="this host cannot play virtual memory (mmap)")


@vmm
@pytest.mark.parametrize("device", [0, 1])
def test_partial_or_offset_mappings_are_not_supported(monkeypatch, device):
    from test_vmm import G, Driver
    use_sim(monkeypatch, "cuda")
    sim.reset()
    drv = Driver()
    va = drv.reserve(8 * G)
    h = drv.create(2 * G, device)
    assert drv.cuMemMap(va, G, G, h, 0) == NOT_SUPPORTED                 # offset 1 granule
    assert drv.cuMemMap(va, G, 0, h, 0) == NOT_SUPPORTED                 # 1 granule of 2
    assert drv.cuMemMap(va + 2 * G, 3 * G, 0, h, 0) == NOT_SUPPORTED     # 3 granules of 2
    assert drv.cuMemMap(va + 6 * G + 4096, G, 0, h, 0) == NOT_SUPPORTED  # unaligned, 1 granule of 2
    assert drv.cuMemMap(va, 2 * G, G, h, 0) == NOT_SUPPORTED             # whole size, offset 1 granule
    # not measured apart on the H100: still invalid values
    assert drv.cuMemMap(va + 4096, 2 * G, 0, h, 0) == INVALID_VALUE      # unaligned address, whole handle
    assert drv.cuMemMap(va, 2 * G, 0, h, 1) == INVALID_VALUE             # flags
    assert drv.cuMemMap(va, 2 * G, 0, 0x1234, 0) == INVALID_VALUE        # not a handle
    assert drv.cuMemMap(va + 7 * G, 2 * G, 0, h, 0) == INVALID_VALUE     # runs past the reservation
    assert sim.state().vmm_mappings == 0
    assert drv.cuMemMap(va + 2 * G, 2 * G, 0, h, 0) == 0                 # the whole handle maps
    assert drv.cuMemUnmap(va + 2 * G, 2 * G) == 0
    assert drv.cuMemRelease(h) == 0
    assert drv.cuMemAddressFree(va, 8 * G) == 0
    sim.reset()


@vmm
def test_backend_names_the_not_supported_map_and_keeps_state(monkeypatch):
    from test_vmm import G
    from accel import _lazy
    use_sim(monkeypatch, "cuda")
    cuda = _lazy.lazy_init()
    va = cuda.vmm_reserve(1, 4 * G)
    h = cuda.vmm_create(1, 2 * G)
    with pytest.raises(AcceleratorError, match=r"cuMemMap failed with CUDA_ERROR_NOT_SUPPORTED \(801\)"):
        cuda.vmm_map(va, G, h, 1)
    assert sim.state().vmm_mappings == 0
    cuda.vmm_map(va, 2 * G, h, 1)
    cuda.vmm_unmap(va, 2 * G)
    cuda.vmm_release(h)
    cuda.vmm_free(va, 4 * G)
    sim.reset()
