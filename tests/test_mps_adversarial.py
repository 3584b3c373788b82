"""Adversarial reliability of the mps backend over the Metal simulator (ACCEL_SIM=mps).

Each test is a misuse a demanding user or a hostile caller makes; the backend must answer
with a clear Python exception and leave the stream usable (a command buffer left with an
open encoder aborts a Mac at the next commit), or the simulator must refuse where Metal does.
"""

import ctypes

import pytest

from accel.sim import core, metal
from conftest import use_sim

np = pytest.importorskip("numpy")

MSL = b"kernel void accel_test_fill_u32(device uint *out [[buffer(0)]]) {}"


@pytest.fixture
def be(mps_backend):
    return mps_backend


def _read(be, ptr, n, stream=0):
    out = ctypes.create_string_buffer(n)
    be.memcpy_async(ctypes.addressof(out), ptr, n, stream)
    return out.raw


def _usable(be, stream=0):
    """The stream still takes work and synchronizes (no encoder left open)."""
    p = be.mem_alloc(16)
    try:
        be.memset_async(p, 7, 16, stream)
        be.stream_synchronize(stream)
        assert _read(be, p, 16, stream) == b"\x07" * 16
    finally:
        be.mem_free(p)


@pytest.mark.parametrize("value", ["a", 1.5, None])
def test_memset_with_a_non_int_value_is_refused_and_the_stream_stays_usable(be, value):
    s = be.stream_create()
    p = be.mem_alloc(64)
    with pytest.raises(TypeError, match="value"):
        be.memset_async(p, value, 64, s)
    _usable(be, s)
    be.device_synchronize()
    be.mem_free(p)
    be.stream_destroy(s)


@pytest.mark.parametrize("grid, block, shared", [
    ((1.5, 1, 1), (1, 1, 1), 0),          # a float in the grid
    ((1, 1, 1), (2.0, 1, 1), 0),          # a float in the block
    ((2 ** 32, 1, 1), (1, 1, 1), 0),      # a grid position is a 32-bit uint in MSL
    ((2 ** 64, 1, 1), (1, 1, 1), 0),      # more than an NSUInteger
    ((1, 1, 1), (1, 1, 1), -16),          # negative threadgroup memory
    ((1, 1, 1), (1, 1, 1), 1.5),          # float threadgroup memory
    ((1, 1, 1), (1, 1, 1), 1 << 20),      # beyond 32 KB of threadgroup memory
    ((True, 1, 1), (1, 1, 1), 0),         # a bool is not a size
])
def test_bad_launch_geometry_is_refused_before_encoding(be, grid, block, shared):
    m = be.module_load(MSL)
    f = be.module_function(m, "accel_test_fill_u32")
    p = be.mem_alloc(64)
    s = be.stream_create()
    with pytest.raises((TypeError, ValueError)):
        be.launch(f, grid, block, [("ptr", p), ("u64", 1), ("u32", 1)], shared, s)
    _usable(be, s)
    be.device_synchronize()
    be.stream_destroy(s)
    be.mem_free(p)
    be.module_unload(m)


def test_sim_refuses_threadgroup_memory_and_grids_metal_cannot_run(be):
    """The simulator is as strict as Metal: more than maxThreadgroupMemoryLength (32 KB) is a
    validation error, and a grid a 32-bit threadgroup position cannot address is refused."""
    from accel.backends.mps import _library as mps_lib
    rt = be._rt
    m = be.module_load(MSL)
    f = be.module_function(m, "accel_test_fill_u32")
    pipeline = be._functions[f][0]
    with rt.pool():
        queue = rt.send(be._device, mps_lib.M_NEW_QUEUE)
        cb = rt.send(queue, mps_lib.M_COMMAND_BUFFER)
        enc = rt.send(cb, mps_lib.M_COMPUTE_ENCODER)
        rt.send(enc, mps_lib.M_SET_PIPELINE, pipeline)
        with pytest.raises(metal.MetalValidationError, match="maxThreadgroupMemoryLength"):
            rt.send(enc, mps_lib.M_SET_THREADGROUP_MEMORY, 64 * 1024, 0)
        big = rt.ffi.new("MTLSize *", (2 ** 32, 1, 1))[0]
        one = rt.ffi.new("MTLSize *", (1, 1, 1))[0]
        with pytest.raises(metal.MetalValidationError, match="2\\*\\*32-1"):
            rt.send(enc, mps_lib.M_DISPATCH, big, one)
        rt.send(enc, mps_lib.M_END_ENCODING)
        rt.release(queue)
    be.module_unload(m)


def test_caching_allocator_oom_above_max_buffer_length_keeps_metals_reason(monkeypatch):
    """A request above maxBufferLength fails however much memory is free: the allocator's
    torch-style OOM ("8 GiB free ... fragmentation") must carry the backend's reason (the
    one-buffer limit) as its cause, not an unrelated IndexError from the free-list search."""
    import accel
    from accel import memory
    use_sim(monkeypatch, "mps")
    metal.reset()
    core.reset()
    with pytest.raises(accel.OutOfMemoryError) as info:
        accel.Buffer(7 << 30)        # the simulated device: 8 GiB, maxBufferLength 6 GiB
    cause = info.value.__cause__
    assert isinstance(cause, accel.OutOfMemoryError)
    assert "maxBufferLength" in str(cause)
    assert memory.memory_stats(0)["num_ooms"] == 1
    b = accel.Buffer(1 << 20)        # the allocator still works
    b.fill_(1)
    assert b.to_numpy()[0] == 1


@pytest.mark.parametrize("bad", [0, -8, 1 << 64])
@pytest.mark.parametrize("side", ["dst", "src"])
def test_memcpy_with_a_null_negative_or_too_wide_host_pointer_is_refused(be, bad, side):
    """Host pointers are copied through on the host (unified memory): a null, negative or
    wider-than-64-bit address crashed the process (as cudaMemcpy, it is cudaErrorInvalidValue)."""
    p = be.mem_alloc(64)
    be.memset_async(p, 9, 64, 0)
    dst, src = (bad, p) if side == "dst" else (p, bad)
    for n in (4, 3):                      # the blit path and the host path
        with pytest.raises(ValueError, match=f"{side}"):
            be.memcpy_async(dst, src, n, 0)
    assert _read(be, p, 64) == b"\x09" * 64
    be.mem_free(p)


def test_nbytes_true_is_not_one_byte(be):
    """bool is an int subclass: nbytes=True silently copied or filled one byte."""
    p = be.mem_alloc(8)
    be.memset_async(p, 0, 8, 0)
    with pytest.raises(ValueError, match="nbytes"):
        be.memcpy_async(p, p + 4, True, 0)
    with pytest.raises(ValueError, match="nbytes"):
        be.memset_async(p, 1, True, 0)
    assert _read(be, p, 8) == bytes(8)
    be.mem_free(p)


@pytest.mark.parametrize("name", [None, b"accel_test_fill_u32", 3])
def test_module_function_name_must_be_a_str(be, name):
    m = be.module_load(MSL)
    with pytest.raises(TypeError, match="kernel name must be a str"):
        be.module_function(m, name)
    be.module_function(m, "accel_test_fill_u32")
    be.module_unload(m)


def test_module_load_refuses_source_that_is_not_utf8(be):
    with pytest.raises(ValueError, match="UTF-8"):
        be.module_load(b"kernel void k() {} \xff")


@pytest.mark.parametrize("arg", [("u32", -1), ("i32", 1 << 31), ("u64", 1.5), ("f32", "x")])
def test_bad_scalar_kernel_argument_names_the_argument(be, arg):
    m = be.module_load(MSL)
    f = be.module_function(m, "accel_test_fill_u32")
    p = be.mem_alloc(16)
    with pytest.raises((TypeError, ValueError), match="kernel argument 2"):
        be.launch(f, (1, 1, 1), (1, 1, 1), [("ptr", p), ("u64", 1), arg], 0, 0)
    _usable(be)
    be.mem_free(p)
    be.module_unload(m)


def test_a_failed_command_buffer_is_not_lost_by_polling_the_stream(be):
    """stream_query dropped a command buffer that ended in MTLCommandBufferStatusError, so a
    caller that polls before synchronizing never learned that its work failed.  As
    cudaStreamQuery returns the stream's error, query reports it (once)."""
    from accel._errors import AcceleratorError
    s = be.stream_create()
    p = be.mem_alloc(64)
    core.inject_error("commit", 8)       # MTLCommandBufferErrorOutOfMemory
    be.memset_async(p, 1, 64, s)
    reported = []
    for _ in range(10_000):
        try:
            if be.stream_query(s):
                break
        except AcceleratorError as exc:
            reported.append(exc)
            break
    try:
        be.stream_synchronize(s)
    except AcceleratorError as exc:
        reported.append(exc)
    assert len(reported) == 1 and "MTLCommandBufferErrorOutOfMemory" in str(reported[0])
    _usable(be, s)                       # a failed command buffer does not break the queue
    be.mem_free(p)
    be.stream_destroy(s)


def test_elapsed_time_of_a_failed_record_says_it_failed(be):
    """After a timing event's command buffer failed, elapsed_ms told the caller to synchronize
    it -- which they had done (and got the error); it must say the work failed instead."""
    from accel._errors import AcceleratorError
    a, b = be.event_create(enable_timing=True), be.event_create(enable_timing=True)
    be.event_record(a, 0)
    be.event_synchronize(a)
    core.inject_error("commit", 1)       # MTLCommandBufferErrorInternal
    be.event_record(b, 0)
    with pytest.raises(AcceleratorError):
        be.event_synchronize(b)
    with pytest.raises(AcceleratorError, match="failed") as info:
        be.event_elapsed_ms(a, b)
    assert "synchronize it" not in str(info.value)
    be.device_synchronize()               # reported once: event_synchronize saw it first
    be.event_destroy(a)
    be.event_destroy(b)


def test_destroying_a_stream_while_another_thread_synchronizes_it(be, monkeypatch):
    """stream_destroy released the stream's in-flight command buffers but kept them listed, so
    a synchronize waiting on them in another thread released them a second time (a Mac
    crashes on the over-release).  The destroy happens, deterministically, while the first
    thread waits outside the lock."""
    import threading
    from accel.backends.mps import _library as mps_lib
    s = be.stream_create()
    p = be.mem_alloc(64)
    be.memset_async(p, 1, 64, s)
    rt = be._rt
    real_send = rt.send
    fired = []

    def send(receiver, msg, *args):
        if msg is mps_lib.M_WAIT and not fired:
            fired.append(True)
            other = threading.Thread(target=be.stream_destroy, args=(s,))
            other.start()
            other.join()
        return real_send(receiver, msg, *args)

    monkeypatch.setattr(rt, "send", send)
    be.stream_synchronize(s)
    monkeypatch.setattr(rt, "send", real_send)
    assert fired
    be.device_synchronize()
    assert _read(be, p, 4) == b"\x01" * 4
    be.mem_free(p)
    st = metal.state()
    assert st.engine_errors == []
