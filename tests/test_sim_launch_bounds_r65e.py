"""A kernel's own launch limits on the simulated CUDA runtime: PTX .maxntid / .reqntid and static
.shared memory (r65e).

What __launch_bounds__ and static __shared__ arrays compile to, and what the vendor documents:

* PTX ISA 11.4.2 ".maxntid nx[, ny[, nz]]": the product of the extents "is guaranteed not to be
  exceeded in any invocation of the kernel ... Exceeding the maximum number of threads results in
  a runtime error or kernel launch failure" (only the total is bounded, not each dimension).
* PTX ISA 11.4.3 ".reqntid": "The size of each CTA dimension specified in any invocation of the
  kernel is required to be equal to that specified in this directive.  Specifying a different CTA
  dimension at launch will result in a runtime error or kernel launch failure"; it "cannot be used
  in conjunction with the .maxntid directive".
* CUDA Runtime API, cudaFuncAttributes: maxThreadsPerBlock is "The maximum number of threads per
  block, beyond which a launch of the function would fail"; sharedSizeBytes "The size in bytes of
  statically-allocated shared memory per block required by this function";
  maxDynamicSharedSizeBytes: "Any launch must have a dynamic shared memory size smaller than this
  value"; cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize): "The sum of this value
  and the function attribute sharedSizeBytes cannot exceed the device attribute
  cudaDevAttrMaxSharedMemoryPerBlockOptin" (cudaErrorInvalidValue otherwise).
* CUDA Programming Guide, "Shared Memory" (7.x-9.0): more than 48 KB per block must be dynamic
  shared memory with an explicit opt-in (ptxas refuses a larger static declaration).

No error code is documented for a launch beyond .maxntid or off .reqntid; the simulator refuses
with cudaErrorLaunchOutOfResources (701) beyond the thread limit and cudaErrorInvalidValue for
another .reqntid shape (see accel/sim/cudart/modules.py).  Both kernel paths are checked: the
runtime's cudaLibrary* calls and, with ACCEL_SIM_CUDA_RUNTIME=12040, the driver's cuModule* ones.
The last tests check what accel.launch does with such kernels through the public API.
"""

import pytest

import accel
from accel import sim
from accel.sim import _cuda_images

from conftest import use_sim, vendor_calls_made_by

RUNTIMES = [None, "12040"]          # cudaLibrary* path; the driver's cuModule* path
KERNELS = ("r65e_max256", "r65e_max3d", "r65e_req128", "r65e_req3d", "r65e_static", "r65e_plain",
           "r65e_modshared")
OPTIN = 227 * 1024                  # cudaDevAttrMaxSharedMemoryPerBlockOptin of the simulated cc 9.0
STATIC = 40960                      # r65e_static's .shared tile

PTX = b"""
.version 8.0
.target sm_90
.address_size 64

// module-scope shared memory, used by r65e_modshared only
.shared .align 8 .b8 r65e_mod[1000];

.visible .entry r65e_max256(.param .u64 p) .maxntid 256
{
    ret;
}
.visible .entry r65e_max3d(.param .u64 p)
.maxntid 8, 8, 4
{
    ret;
}
.visible .entry r65e_req128(.param .u64 p) .reqntid 128 { ret; }
.visible .entry r65e_req3d(.param .u64 p) .reqntid 4, 4, 2 .minnctapersm 2 { ret; }
.visible .entry r65e_static(.param .u64 p)
{
    .reg .b32 %r<2>;
    .shared .align 16 .b8 tile[40960];
    .extern .shared .align 16 .b8 dyn[];
    ld.shared.u32 %r1, [tile];
    ret;
}
.visible .entry r65e_plain(.param .u64 p) { ret; }
.visible .entry r65e_modshared(.param .u64 p)
{
    .reg .b64 %rd<2>;
    .shared .f32 vals[6];
    mov.u64 %rd1, r65e_mod;
    ret;
}
"""


@pytest.fixture
def ran():
    """Register a reference for every kernel of PTX; yields the (name, grid, block) of each run."""
    runs = []
    for name in KERNELS:
        sim.register_kernel(name, lambda grid, block, view, p, _n=name: runs.append((_n, grid, block)), "u64",
                            replace=True)
    yield runs
    for name in KERNELS:
        sim.unregister_kernel(name)


def _kernels(monkeypatch, runtime):
    use_sim(monkeypatch, "cuda", **({"ACCEL_SIM_CUDA_RUNTIME": runtime} if runtime else {}))
    m = accel.Module(PTX)
    return {name: m.function(name) for name in KERNELS}


def _raw_launch(k, block, shared=0, stream=None):
    """The backend's launch (cudaLaunchKernel / cuLaunchKernel), below accel.launch's checks."""
    k._backend.launch(k.handle, (1, 1, 1), block, [("u64", 0)], shared, (stream or accel.current_stream()).handle)


def _refused(k, block, shared=0):
    with pytest.raises(accel.AcceleratorError) as info:
        _raw_launch(k, block, shared)
    return info.value.code


# -- the parser ------------------------------------------------------------------------------

def test_ptx_bounds_read_every_form():
    b = _cuda_images.ptx_bounds(PTX)
    assert (b["r65e_max256"].maxntid, b["r65e_max256"].reqntid) == ((256, 1, 1), None)
    assert b["r65e_max3d"].maxntid == (8, 8, 4) and b["r65e_max3d"].max_threads() == 256
    assert b["r65e_req128"].reqntid == (128, 1, 1) and b["r65e_req3d"].reqntid == (4, 4, 2)
    assert b["r65e_plain"].max_threads() == 1024 and b["r65e_plain"].shared == 0
    # the static tile, not the .extern (dynamic) array nor the ld.shared instruction
    assert b["r65e_static"].shared == STATIC
    # 1000 bytes of the module-scope array it names, then 6 floats at 4-byte alignment
    assert b["r65e_modshared"].shared == 1024
    assert _cuda_images.ptx_bounds(PTX.replace(b"// module-scope", b"/* x */ //"))["r65e_plain"].shared == 0


# -- attributes --------------------------------------------------------------------------------

@pytest.mark.parametrize("runtime", RUNTIMES)
def test_function_attributes_report_the_directives_and_static_shared(monkeypatch, runtime):
    """cudaFuncGetAttributes (cuFuncGetAttribute on the driver path) report each kernel's
    maxThreadsPerBlock and sharedSizeBytes, and the dynamic shared memory left of 48 KiB."""
    ks = _kernels(monkeypatch, runtime)
    want = {"r65e_max256": (256, 0), "r65e_max3d": (256, 0), "r65e_req128": (128, 0), "r65e_req3d": (32, 0),
            "r65e_static": (1024, STATIC), "r65e_plain": (1024, 0), "r65e_modshared": (1024, 1024)}
    calls = vendor_calls_made_by(lambda: [(k.max_threads_per_block, k.shared_size_bytes) for k in ks.values()])
    assert ("cuFuncGetAttribute" if runtime else "cudaFuncGetAttributes") in calls
    for name, k in ks.items():
        assert (k.max_threads_per_block, k.shared_size_bytes) == want[name], name
        attrs = k._backend.function_attributes(k.handle)
        assert attrs["max_dynamic_shared_size_bytes"] == 48 * 1024 - want[name][1], name
    # the occupancy search never proposes a block above the kernel's limit
    assert ks["r65e_max256"].max_potential_block_size()[1] <= 256
    assert ks["r65e_req3d"].max_potential_block_size()[1] <= 32
    assert ks["r65e_max256"]._backend.occupancy_max_active_blocks(ks["r65e_max256"].handle, 512, 0) == 0


# -- the simulator refuses launches beyond them -----------------------------------------------

@pytest.mark.parametrize("runtime", RUNTIMES)
def test_launch_beyond_maxntid_is_refused_at_the_limit_runs(monkeypatch, runtime, ran):
    ks = _kernels(monkeypatch, runtime)
    k, k3 = ks["r65e_max256"], ks["r65e_max3d"]
    for block in ((257, 1, 1), (16, 17, 1), (1024, 1, 1)):
        assert _refused(k, block) == 701, block
    # .maxntid 8, 8, 4 bounds the total only: (16, 16, 1) is 256 threads
    assert _refused(k3, (8, 8, 5)) == 701
    accel.synchronize()
    assert ran == []            # nothing was queued
    for kern, block in ((k, (256, 1, 1)), (k, (2, 2, 64)), (k3, (16, 16, 1)), (k3, (8, 8, 4)), (k3, (1, 1, 1))):
        _raw_launch(kern, block)
    accel.synchronize()
    assert [(n, b) for n, _g, b in ran] == [("r65e_max256", (256, 1, 1)), ("r65e_max256", (2, 2, 64)),
                                            ("r65e_max3d", (16, 16, 1)), ("r65e_max3d", (8, 8, 4)),
                                            ("r65e_max3d", (1, 1, 1))]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_reqntid_needs_the_exact_block_shape(monkeypatch, runtime, ran):
    ks = _kernels(monkeypatch, runtime)
    k, k3 = ks["r65e_req128"], ks["r65e_req3d"]
    assert _refused(k, (64, 1, 1)) == 1         # fewer threads
    assert _refused(k, (64, 2, 1)) == 1         # as many threads, another shape
    assert _refused(k, (1, 128, 1)) == 1
    assert _refused(k, (129, 1, 1)) == 701      # beyond maxThreadsPerBlock
    assert _refused(k3, (2, 4, 4)) == 1
    assert _refused(k3, (4, 4, 1)) == 1
    assert _refused(k3, (32, 1, 1)) == 1
    accel.synchronize()
    assert ran == []
    _raw_launch(k, (128, 1, 1))
    _raw_launch(k3, (4, 4, 2))
    accel.synchronize()
    assert [(n, b) for n, _g, b in ran] == [("r65e_req128", (128, 1, 1)), ("r65e_req3d", (4, 4, 2))]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_static_and_dynamic_shared_memory_share_the_block_limit(monkeypatch, runtime, ran):
    ks = _kernels(monkeypatch, runtime)
    k, backend = ks["r65e_static"], ks["r65e_static"]._backend
    left = 48 * 1024 - STATIC
    _raw_launch(k, (32, 1, 1), left)
    assert _refused(k, (32, 1, 1), left + 1) == 1
    assert _refused(k, (32, 1, 1), 48 * 1024) == 1
    # the opt-in may not take static + dynamic above the device's opt-in limit
    with pytest.raises(accel.AcceleratorError) as info:
        backend.function_set_max_dynamic_shared(k.handle, OPTIN - STATIC + 1)
    assert info.value.code == 1
    backend.function_set_max_dynamic_shared(k.handle, OPTIN - STATIC)
    assert k._backend.function_attributes(k.handle)["max_dynamic_shared_size_bytes"] == OPTIN - STATIC
    _raw_launch(k, (32, 1, 1), OPTIN - STATIC)
    assert _refused(k, (32, 1, 1), OPTIN - STATIC + 1) == 1
    # an attribute set below the default lowers the limit ("Any launch must have a dynamic
    # shared memory size smaller than this value")
    plain = ks["r65e_plain"]
    backend.function_set_max_dynamic_shared(plain.handle, 1000)
    assert _refused(plain, (32, 1, 1), 1001) == 1
    _raw_launch(plain, (32, 1, 1), 1000)
    accel.synchronize()
    assert [(n, s) for n, _g, s in ran] == [("r65e_static", (32, 1, 1))] * 2 + [("r65e_plain", (32, 1, 1))]


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("bad", ["both", "static"])
def test_ptx_the_jit_refuses_raises_kernel_image_error(monkeypatch, runtime, bad):
    """ptxas refuses .maxntid with .reqntid on one entry, and more than 48 KiB of static shared
    memory: cudaErrorInvalidPtx / CUDA_ERROR_INVALID_PTX (218), at load or first lookup."""
    use_sim(monkeypatch, "cuda", **({"ACCEL_SIM_CUDA_RUNTIME": runtime} if runtime else {}))
    image = (PTX.replace(b".maxntid 256", b".maxntid 256 .reqntid 256") if bad == "both" else
             PTX.replace(b"tile[40960]", b"tile[49153]"))
    with pytest.raises(accel.KernelImageError, match="CUDA_ERROR_INVALID_PTX" if runtime else "cudaErrorInvalidPtx"):
        accel.Module(image).function("r65e_plain")
    # exactly 48 KiB static is allowed
    m = accel.Module(PTX.replace(b"tile[40960]", b"tile[49152]"))
    assert m.function("r65e_static").shared_size_bytes == 48 * 1024


def test_graph_capture_refuses_the_launch_too(monkeypatch, ran):
    """A launch refused outside a capture is refused inside one (nothing captured)."""
    ks = _kernels(monkeypatch, None)
    s, g = accel.Stream(), accel.Graph()
    with pytest.raises(accel.AcceleratorError) as info:
        with accel.graph(g, stream=s):
            _raw_launch(ks["r65e_max256"], (512, 1, 1), stream=s)
    assert info.value.code == 701
    with accel.graph(g, stream=s):
        _raw_launch(ks["r65e_max256"], (256, 1, 1), stream=s)
    g.replay()
    accel.synchronize()
    assert [b for _n, _g, b in ran] == [(256, 1, 1)]


# -- accel.launch through the public API ------------------------------------------------------

@pytest.mark.parametrize("runtime", RUNTIMES)
def test_accel_launch_at_the_kernels_limits_runs(monkeypatch, runtime, ran):
    ks = _kernels(monkeypatch, runtime)
    accel.launch(ks["r65e_max256"], 2, 256, 0)
    accel.launch(ks["r65e_max3d"], 1, (16, 16), 0)
    accel.launch(ks["r65e_req3d"], 3, (4, 4, 2), 0)
    accel.launch(ks["r65e_static"], 1, 64, 0, shared_mem=48 * 1024 - STATIC)
    accel.synchronize()
    assert [n for n, _g, _b in ran] == ["r65e_max256", "r65e_max3d", "r65e_req3d", "r65e_static"]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_accel_launch_beyond_the_kernels_max_threads_names_its_limit(monkeypatch, runtime, ran):
    """Refused before queueing with a ValueError naming the kernel's own limit (as Metal's path
    names the pipeline's maxTotalThreadsPerThreadgroup), not the runtime's 701."""
    ks = _kernels(monkeypatch, runtime)
    with pytest.raises(ValueError, match=r"r65e_max256.*512 threads.*256"):
        accel.launch(ks["r65e_max256"], 1, 512, 0)
    accel.synchronize()
    assert ran == []


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_accel_launch_off_the_required_block_shape_names_it(monkeypatch, runtime, ran):
    ks = _kernels(monkeypatch, runtime)
    with pytest.raises(ValueError, match=r"r65e_req3d.*\(4, 4, 2\)"):
        accel.launch(ks["r65e_req3d"], 1, (2, 4, 4), 0)
    accel.synchronize()
    assert ran == []


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_accel_launch_opts_in_when_static_and_dynamic_pass_48k(monkeypatch, runtime, ran):
    """40 KiB static + 16 KiB dynamic fit the 227 KiB opt-in limit: the launch must opt in first."""
    ks = _kernels(monkeypatch, runtime)
    accel.launch(ks["r65e_static"], 1, 64, 0, shared_mem=16 * 1024)
    accel.synchronize()
    assert [n for n, _g, _b in ran] == ["r65e_static"]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_accel_launch_over_the_opt_in_limit_counts_static_shared(monkeypatch, runtime, ran):
    ks = _kernels(monkeypatch, runtime)
    smem = OPTIN - STATIC + 1           # within the device's dynamic limit alone
    with pytest.raises(ValueError, match=rf"r65e_static.*{STATIC} bytes of static shared memory"):
        accel.launch(ks["r65e_static"], 1, 64, 0, shared_mem=smem)
    accel.synchronize()
    assert ran == []
