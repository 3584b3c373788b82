"""Adversarial use of user kernels (accel.Module / Kernel / launch) and of the simulator's
module and launch rules: odd argument objects, images the parsers must read as the driver
does, modules closed or collected while a graph still launches their kernels."""

import gc

import numpy as np
import pytest

import accel
from accel import sim

from test_user_kernels import SAXPY_MSL, SAXPY_PTX, _data, _device_arrays, expected, saxpy_reference

from conftest import use_sim


@pytest.fixture
def saxpy(sim_cuda):
    """The SAXPY kernel on the CUDA simulator (device 0) and two 4 KiB buffers."""
    sim.register_kernel("saxpy", saxpy_reference, "f32, ptr, ptr, u64")
    try:
        k = accel.Module(SAXPY_PTX).function("saxpy")
        yield k, accel.Buffer(4096), accel.Buffer(4096)
    finally:
        sim.unregister_kernel("saxpy")


# -- numpy arguments ----------------------------------------------------------------------

def test_a_0d_array_is_checked_by_its_dtype_every_time(saxpy):
    """launch remembers the numpy scalar types it accepted; a 0-d ndarray's dtype is not its
    type's, so a lossless one accepted first must not let a lossy one through later."""
    k, x, y = saxpy
    accel.launch(k, 1, 1, np.array(1.5, np.float32), x, y, 0)
    with pytest.raises(TypeError, match=r"argument 0 \(f32\).*float64 does not convert to float32"):
        accel.launch(k, 1, 1, np.array(1e300), x, y, 0)
    accel.launch(k, 1, 1, 1.0, x, y, np.array(3, np.uint16))
    with pytest.raises(TypeError, match=r"argument 3 \(u64\).*int64 does not convert to uint64"):
        accel.launch(k, 1, 1, 1.0, x, y, np.array(-1, np.int64))
    accel.synchronize()


def test_numpy_bool_is_refused_as_bool_is(saxpy):
    k, x, y = saxpy
    for value in (True, np.bool_(True)):
        with pytest.raises(TypeError, match=r"argument 3 \(u64\) is bool.*bool is not accepted; pass int"):
            accel.launch(k, 1, 1, 1.0, x, y, value)
        with pytest.raises(TypeError, match=r"argument 0 \(f32\) is bool.*bool is not accepted"):
            accel.launch(k, 1, 1, value, x, y, 0)


def test_float_subclass_is_a_float(saxpy):
    class Scale(float):
        pass

    k, x, y = saxpy
    x.copy_from(np.ones(1024, np.float32))
    y.copy_from(np.ones(1024, np.float32))
    accel.launch(k, 1, 16, Scale(2.0), x, y, 16)
    assert y.to_numpy("float32")[:16].tolist() == [3.0] * 16
    with pytest.raises(ValueError, match="beyond the float32 range"):
        accel.launch(k, 1, 16, Scale(1e300), x, y, 16)


def test_numpy_integers_as_dimensions_and_shared_memory(saxpy):
    """A grid computed with numpy (np.int64) works bare as it does inside a tuple; so does
    shared_mem; np.bool_ is refused as bool is."""
    k, x, y = saxpy
    n = np.int64(16)
    accel.launch(k, (n + 255) // 256, np.int32(256), 1.0, x, y, 16, shared_mem=np.uint32(64))
    accel.launch(k, (np.int64(1),), (np.int64(16), 1), 1.0, x, y, 16, shared_mem=np.int64(0))
    accel.synchronize()
    with pytest.raises(TypeError, match=r"grid must be an int or a tuple of 1 to 3 ints, got np.True_"):
        accel.launch(k, np.bool_(True), 1, 1.0, x, y, 0)
    with pytest.raises(ValueError, match=r"grid\[0\] is 0"):
        accel.launch(k, np.int64(0), 1, 1.0, x, y, 0)
    with pytest.raises(ValueError, match=r"block\[0\] is 2048, above the device's limit"):
        accel.launch(k, 1, np.int64(2048), 1.0, x, y, 0)
    for bad in (True, np.bool_(False), 1.0, -1, np.int64(-1), "8"):
        with pytest.raises((TypeError, ValueError), match=r"shared_mem must be an int >= 0 \(bytes\), got"):
            accel.launch(k, 1, 1, 1.0, x, y, 0, shared_mem=bad)


# -- images --------------------------------------------------------------------------------

# PTX ISA, ".entry": "`.entry kernel-name ( param-list ) kernel-body`" or "`.entry kernel-name
# kernel-body`": a kernel without parameters may have no list at all.
NO_PARAM_LIST_PTX = b"""//
.version 8.0
.target sm_90
.address_size 64

.visible .entry tick
{
    ret;
}

.visible .entry tock(
    .param .u32 tock_param_0
)
.maxntid 256, 1, 1
{
    ret;
}
"""


def test_entry_without_a_parameter_list(sim_cuda):
    ran = []
    sim.register_kernel("tick", lambda grid, block, view: ran.append(grid), "")
    try:
        m = accel.Module(NO_PARAM_LIST_PTX)
        assert m.entries == ("tick", "tock")
        k = m.function("tick")
        assert k.params == ()
        accel.launch(k, 3, 1)
        accel.synchronize()
        assert ran == [(3, 1, 1)]
        assert m.function("tock").params == ("u32",)
    finally:
        sim.unregister_kernel("tick")


def test_msl_that_is_not_utf8_is_a_clear_error(monkeypatch):
    use_sim(monkeypatch, "mps")
    with pytest.raises(ValueError, match=r"Metal takes MSL source text.*UTF-8.*byte 0xff at offset 0"):
        accel.Module(b"\xff" + SAXPY_MSL.encode())


# -- modules and graphs ------------------------------------------------------------------------

@pytest.mark.parametrize("device", [0, 1])
def test_a_graph_keeps_the_module_of_its_kernels_loaded(saxpy, device):
    """Collecting the Module and Kernel while a graph launches the kernel must not unload it:
    each replay launches it (on a device, a kernel of an unloaded module is a use after free)."""
    n = 300
    x, y = _data(n, 7)
    k = accel.Module(SAXPY_PTX, device=device).function("saxpy")
    s = accel.Stream(device=device)
    bx, by = _device_arrays(x, y, device=device, stream=s)
    g = accel.Graph()
    with s, g:
        accel.launch(k, 2, 256, 0.5, bx, by, n)
    before = sim.state().modules     # (a first capture may load accel's own RNG kernels)
    del k
    gc.collect()
    accel.Buffer(64)            # an API entry runs deferred releases
    assert sim.state().modules == before
    with s:
        g.replay()
    s.synchronize()
    assert by.to_numpy("float32", stream=s).tobytes() == expected(0.5, x, y).tobytes()
    del g
    gc.collect()
    accel.Buffer(64)
    assert sim.state().modules == before - 1       # the graph's going lets the module go


def test_replay_after_the_module_was_closed_is_refused(saxpy):
    n = 256
    x, y = _data(n, 8)
    m = accel.Module(SAXPY_PTX)
    k = m.function("saxpy")
    s = accel.Stream()
    bx, by = _device_arrays(x, y, stream=s)
    g = accel.Graph()
    with s, g:
        accel.launch(k, 1, 256, 0.5, bx, by, n)
    m.close()
    with s, pytest.raises(RuntimeError, match=r"replay\(\): <accel.Module ptx on cuda:0 .*closed> was closed, "
                                              r"but this graph launches its kernels"):
        g.replay()
    s.synchronize()
    assert by.to_numpy("float32", stream=s).tobytes() == y.tobytes()      # nothing ran
    g.reset()
    # a graph captured again with a module loaded again replays
    k = accel.Module(SAXPY_PTX).function("saxpy")
    with s, g:
        accel.launch(k, 1, 256, 0.5, bx, by, n)
    with s:
        g.replay()
    s.synchronize()
    assert by.to_numpy("float32", stream=s).tobytes() == expected(0.5, x, y).tobytes()


def test_simulator_refuses_a_graph_launching_a_kernel_of_an_unloaded_module(saxpy):
    """The simulated runtime alone (accel's checks bypassed): cudaLibraryUnload / cuModuleUnload
    say any use of the handle afterwards is undefined; the simulator refuses the graph launch."""
    backend = accel._lazy.lazy_init()
    k, x, y = saxpy
    m = accel.Module(SAXPY_PTX)
    k2 = m.function("saxpy")
    s = accel.Stream()
    backend.capture_begin(s.handle, "global")
    backend.launch(k2.handle, (1, 1, 1), (1, 1, 1), [("f32", 1.0), ("ptr", x.ptr), ("ptr", y.ptr), ("u64", 0)],
                   0, s.handle)
    graph = backend.capture_end(s.handle)
    exe = backend.graph_instantiate(graph)
    try:
        backend.graph_launch(exe, s.handle)
        s.synchronize()
        backend.module_unload(m._handle)
        m._handle = None
        with pytest.raises(accel.AcceleratorError, match="cudaGraphLaunch failed with cudaErrorInvalidDeviceFunction"):
            backend.graph_launch(exe, s.handle)
    finally:
        backend.graph_exec_destroy(exe)
        backend.graph_destroy(graph)
    accel.synchronize()


# -- accel.compile -----------------------------------------------------------------------------

from test_nvrtc import nvrtc  # noqa: E402,F401  (the fixture: skips without NVRTC)

TINY_CU = 'extern "C" __global__ void one(int *x) { x[0] = 1; }'


@pytest.mark.parametrize("options", [("-arch", "sm_90"), ("--gpu-architecture", "sm_90"), ("-arch=sm_90",)])
def test_architecture_option_as_two_strings(nvrtc, options):
    """NVRTC takes '-arch sm_90' as two options as well as '-arch=sm_90': the Program says the
    architecture compiled for and carries the cubin a real architecture gives."""
    prog = accel.compile(TINY_CU, options=options)
    assert prog.arch == "sm_90"
    assert prog.cubin is not None and prog.cubin[:4] == b"\x7fELF"
    with pytest.raises(ValueError, match="the architecture is given twice"):
        accel.compile(TINY_CU, options=options, arch="sm_90")


def test_simulated_driver_does_not_find_kernels_in_comments(sim_cuda):
    """The driver knows the kernels the PTX defines, not names in its comments (PTX ISA,
    "Comments": they are whitespace); accel.Module and the simulated driver agree."""
    ptx = NO_PARAM_LIST_PTX.replace(b".visible .entry tick", b"// .visible .entry ghost(\n/* .entry phantom */\n"
                                                            b".visible .entry tick")
    m = accel.Module(ptx)
    assert m.entries == ("tick", "tock")
    backend = accel._lazy.lazy_init()
    for name in ("ghost", "phantom"):
        with pytest.raises(accel.AcceleratorError, match="cudaLibraryGetKernel failed with cudaErrorSymbolNotFound"):
            backend.module_function(m._handle, name)
    assert backend.module_function(m._handle, "tick")


# -- failed vendor calls --------------------------------------------------------------------

def test_failed_load_acquires_nothing(saxpy):
    before = sim.state().modules
    sim.inject_error("cudaLibraryLoadData", 2)             # cudaErrorMemoryAllocation
    try:
        with pytest.raises(accel.AcceleratorError, match="cudaLibraryLoadData"):
            accel.Module(SAXPY_PTX)
    finally:
        sim.clear_faults()
    gc.collect()
    assert sim.state().modules == before
    accel.Module(SAXPY_PTX).close()
    assert sim.state().modules == before


def test_failed_unload_leaves_the_module_open_to_close_again(saxpy):
    """close() whose cudaLibraryUnload fails raises and leaves the module as it was (open and
    loaded), so close() can be tried again; nothing is left loaded with no handle to it."""
    before = sim.state().modules
    m = accel.Module(SAXPY_PTX)
    sim.inject_error("cudaLibraryUnload", 999)             # cudaErrorUnknown
    try:
        with pytest.raises(accel.AcceleratorError, match="cudaLibraryUnload"):
            m.close()
    finally:
        sim.clear_faults()
    assert not m.closed and sim.state().modules == before + 1
    m.function("saxpy")
    m.close()
    assert m.closed and sim.state().modules == before


def test_close_from_another_thread_never_unloads_under_a_launch(saxpy, monkeypatch):
    """Module.close in one thread while another thread is inside launch: the unload waits until
    the launch was queued (a driver launching a function of an unloaded module is undefined
    behaviour), and the next launch says the module is closed."""
    import threading
    k, x, y = saxpy
    backend = k._backend
    real = backend.launch
    closer = []

    def launch_while_closing(*args):
        t = threading.Thread(target=k.module.close)
        closer.append(t)
        t.start()
        t.join(0.3)             # the close must not get through while this launch is underway
        return real(*args)

    monkeypatch.setattr(backend, "launch", launch_while_closing)
    accel.launch(k, 1, 1, 1.0, x, y, 0)
    monkeypatch.undo()
    closer[0].join(10)
    assert not closer[0].is_alive() and k.module.closed
    with pytest.raises(ValueError, match="closed"):
        accel.launch(k, 1, 1, 1.0, x, y, 0)
    accel.synchronize()
