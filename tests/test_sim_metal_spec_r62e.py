"""Metal simulator against Apple's Metal documentation (r62e): calls the simulator accepted that
Metal forbids, leaves undefined, or (where the documentation is silent) that a Mac's API
validation refuses.  A lenient simulator turns accel's tests into false passes.

Each leniency has a test quoting the documentation (developer.apple.com, Metal framework
reference, as stored by the search tool); each was a strict xfail first, failing for the reason it
names, until accel/sim/metal (and accel/sim/kernels.py, for typed views at misaligned
addresses) refused it.  The module's last tests run accel's mps backend and public API through
the strict simulator: accel relied on none of the leniencies (they ran first on a monkeypatched
copy of the fixes).

Already covered elsewhere (not repeated): commit twice, encoding after commit, one active encoder,
endEncoding before commit/another encoder, waitUntilCompleted before commit, blit offsets/sizes
multiples of 4, over-release / use after release, encoder released without endEncoding,
maxBufferLength, threadgroup memory above 32 KB at one index, MSL double.

Metal exposes one device (MTLCreateSystemDefaultDevice), so the "device 1" rule of the brief does
not apply to this file; every test is Metal-specific (no sim_backend parametrization).
"""

import ctypes
import os
import subprocess
import sys
import threading

import pytest

import accel
from accel.backends import _objc
from accel.sim import core, metal
from conftest import use_sim
from test_sim_ze_metal_strict import (M_BLIT, M_CB, M_COMMIT, M_END, M_FILL,  # noqa: F401
                                      M_NEW_BUFFER, M_QUEUE, M_WAIT, mtl)

M_CONTENTS = _objc.Message("contents", "void *")
M_COPY = _objc.Message("copyFromBuffer:sourceOffset:toBuffer:destinationOffset:size:", "void",
                       "id", "NSUInteger", "id", "NSUInteger", "NSUInteger")
M_NEW_BUFFER_BYTES = _objc.Message("newBufferWithBytes:length:options:", "id", "const void *",
                                   "NSUInteger", "NSUInteger")
M_COMPUTE = _objc.Message("computeCommandEncoder")
M_SET_BYTES = _objc.Message("setBytes:length:atIndex:", "void", "const void *", "NSUInteger", "NSUInteger")
M_SET_BUFFER = _objc.Message("setBuffer:offset:atIndex:", "void", "id", "NSUInteger", "NSUInteger")
M_SET_TG = _objc.Message("setThreadgroupMemoryLength:atIndex:", "void", "NSUInteger", "NSUInteger")
M_SET_PIPELINE = _objc.Message("setComputePipelineState:", "void", "id")
M_DISPATCH = _objc.Message("dispatchThreadgroups:threadsPerThreadgroup:", "void", "MTLSize", "MTLSize")
M_NEW_LIBRARY = _objc.Message("newLibraryWithSource:options:error:", "id", "id", "id", "id *")
M_NEW_FUNCTION = _objc.Message("newFunctionWithName:", "id", "id")
M_NEW_PIPELINE = _objc.Message("newComputePipelineStateWithFunction:error:", "id", "id", "id *")

SHARED, MANAGED, PRIVATE = 0x00, 0x10, 0x20      # MTLResourceStorageMode{Shared,Managed,Private}
FILL_KERNEL = "accel_test_fill_u32"              # (device uint *out, ulong n, uint value)


# -- helpers ----------------------------------------------------------------------------------------

def _encode(m, queue, body, commit=True):
    """A command buffer of ``queue`` with one blit encoder running ``body(enc)``; committed and
    waited for unless ``commit`` is False (then returned retained)."""
    rt = m.rt
    with rt.pool():
        cb = rt.send(queue, M_CB)
        enc = rt.send(cb, M_BLIT)
        try:
            body(enc)
        finally:
            rt.send(enc, M_END)
        if not commit:
            return rt.retain(cb)
        rt.send(cb, M_COMMIT)
        rt.send(cb, M_WAIT)
    return None


def _rng(m, off, n):
    return m.ffi.new("NSRange *", (off, n))[0]


def _pipeline(m):
    rt = m.rt
    with rt.pool():
        err = m.ffi.new("void **")
        lib = rt.send(m.device, M_NEW_LIBRARY, rt.ns_string(
            f"kernel void {FILL_KERNEL}(device uint *out [[buffer(0)]], constant ulong &n [[buffer(1)]],"
            f" constant uint &v [[buffer(2)]], uint i [[thread_position_in_grid]]) {{ if (i < n) out[i] = v; }}\n"),
            rt.nil, err)
        fn = rt.send(lib, M_NEW_FUNCTION, rt.ns_string(FILL_KERNEL))
        pipe = rt.send(m.device, M_NEW_PIPELINE, fn, err)
    rt.release(fn)
    rt.release(lib)
    return pipe


def _compute(m, queue, pipe, body):
    """One compute encoder with ``pipe`` set, ``body(enc)`` run, ended; the buffer committed/waited."""
    rt = m.rt
    with rt.pool():
        cb = rt.send(queue, M_CB)
        enc = rt.send(cb, M_COMPUTE)
        try:
            rt.send(enc, M_SET_PIPELINE, pipe)
            body(enc)
        finally:
            rt.send(enc, M_END)
        rt.send(cb, M_COMMIT)
        rt.send(cb, M_WAIT)


def _bind_fill_args(m, enc, buf, offset, n, value=7):
    rt, ffi = m.rt, m.ffi
    rt.send(enc, M_SET_BUFFER, buf, offset, 0)
    rt.send(enc, M_SET_BYTES, ffi.new("uint64_t *", n), 8, 1)
    rt.send(enc, M_SET_BYTES, ffi.new("uint32_t *", value), 4, 2)


def _dispatch(m, enc, groups=1, threads=32):
    ffi = m.ffi
    m.rt.send(enc, M_DISPATCH, ffi.new("MTLSize *", (groups, 1, 1))[0], ffi.new("MTLSize *", (threads, 1, 1))[0])


def _host_bytes(m, buf, n):
    p = int(m.ffi.cast("uintptr_t", m.rt.send(buf, M_CONTENTS)))
    return ctypes.string_at(p, n)


# -- MTLBlitCommandEncoder --------------------------------------------------------------------------

def test_blit_fill_and_copy_within_the_rules_still_work(mtl):
    """The passing baseline for the blit tests below."""
    rt = mtl.rt
    q = rt.send(mtl.device, M_QUEUE)
    a, b = rt.send(mtl.device, M_NEW_BUFFER, 64, SHARED), rt.send(mtl.device, M_NEW_BUFFER, 64, SHARED)
    def body(enc):
        rt.send(enc, M_FILL, a, _rng(mtl, 0, 64), 0)
        rt.send(enc, M_FILL, b, _rng(mtl, 0, 64), 0)
        rt.send(enc, M_FILL, a, _rng(mtl, 4, 8), 9)
    _encode(mtl, q, body)
    _encode(mtl, q, lambda enc: rt.send(enc, M_COPY, a, 0, b, 16, 16))
    assert _host_bytes(mtl, b, 32) == bytes(16) + bytes(4) + b"\x09" * 8 + bytes(4)
    for o in (a, b, q):
        rt.release(o)


def test_fill_of_an_empty_range_is_refused(mtl):
    """Apple, MTLBlitCommandEncoder fillBuffer:range:value: (range): "The range's count property
    needs to be greater than 0." The simulator encoded a fill of (0, 0)."""
    rt = mtl.rt
    q = rt.send(mtl.device, M_QUEUE)
    buf = rt.send(mtl.device, M_NEW_BUFFER, 64, SHARED)
    try:
        with pytest.raises(metal.MetalValidationError, match="greater than 0|empty|zero"):
            _encode(mtl, q, lambda enc: rt.send(enc, M_FILL, buf, _rng(mtl, 0, 0), 1))
    finally:
        rt.release(buf)
        rt.release(q)


def test_copy_of_zero_bytes_is_refused(mtl):
    """copyFromBuffer:...:size: "The number of bytes the command copies" (the docs are silent on 0;
    the sibling fillBuffer:range:value: requires "greater than 0"): the simulator should refuse."""
    rt = mtl.rt
    q = rt.send(mtl.device, M_QUEUE)
    a, b = rt.send(mtl.device, M_NEW_BUFFER, 64, SHARED), rt.send(mtl.device, M_NEW_BUFFER, 64, SHARED)
    try:
        with pytest.raises(metal.MetalValidationError, match="size"):
            _encode(mtl, q, lambda enc: rt.send(enc, M_COPY, a, 0, b, 0, 0))
    finally:
        for o in (a, b, q):
            rt.release(o)


def test_copy_between_overlapping_ranges_of_one_buffer_is_refused(mtl):
    """Apple's copyFromBuffer:sourceOffset:toBuffer:destinationOffset:size: says nothing of a source
    range overlapping the destination range in the same buffer (the GPU copies in parallel, so the
    result is not memmove's). The simulator gives memmove's result, so a program relying on it
    passes; the simulator should refuse (as the Level Zero simulator does, ZE_RESULT_ERROR_
    OVERLAPPING_REGIONS)."""
    rt = mtl.rt
    q = rt.send(mtl.device, M_QUEUE)
    buf = rt.send(mtl.device, M_NEW_BUFFER, 64, SHARED)
    try:
        with pytest.raises(metal.MetalValidationError, match="overlap"):
            _encode(mtl, q, lambda enc: rt.send(enc, M_COPY, buf, 0, buf, 4, 32))
    finally:
        rt.release(buf)
        rt.release(q)


# -- MTLDevice / MTLBuffer --------------------------------------------------------------------------

def test_contents_of_a_private_buffer_is_null(mtl):
    """Apple, MTLBuffer contents, Return Value: "A pointer to the shared copy of the buffer data, or
    NULL for buffers allocated with a private resource storage mode (MTLStorageMode.private)."
    Discussion: "Private resources aren't CPU-accessible." The simulator handed out a pointer the CPU
    could read and write, so host code touching private memory passed."""
    rt = mtl.rt
    buf = rt.send(mtl.device, M_NEW_BUFFER, 64, PRIVATE)
    try:
        assert rt.send(buf, M_CONTENTS) == mtl.ffi.NULL
    finally:
        rt.release(buf)


def test_managed_buffer_written_by_the_cpu_without_did_modify_range_is_refused(mtl):
    """Apple, MTLBuffer didModifyRange:: "If you write information to a buffer created with the
    MTLStorageMode.managed storage mode, you need to call this method to inform the GPU that the
    information has changed. If you execute GPU commands that read from the modified sections
    without calling this method first, the behavior is undefined." The simulator does not declare
    didModifyRange: and cannot see CPU writes, yet creates managed buffers."""
    rt = mtl.rt
    q = rt.send(mtl.device, M_QUEUE)
    with pytest.raises(metal.MetalValidationError, match="[Mm]anaged"):
        src = rt.send(mtl.device, M_NEW_BUFFER, 64, MANAGED)
        dst = rt.send(mtl.device, M_NEW_BUFFER, 64, SHARED)
        try:
            ctypes.memset(int(mtl.ffi.cast("uintptr_t", rt.send(src, M_CONTENTS))), 5, 64)
            _encode(mtl, q, lambda enc: rt.send(enc, M_COPY, src, 0, dst, 0, 64))  # GPU reads it: undefined
        finally:
            rt.release(src)
            rt.release(dst)
    rt.release(q)


@pytest.mark.parametrize("options", [
    pytest.param(0x2, id="cpu-cache-mode-2"),
    pytest.param(0xF, id="cpu-cache-mode-15"),
    pytest.param(0x300, id="hazard-tracking-mode-3"),
    pytest.param(0x1000, id="undefined-bit-12"),
    pytest.param(1 << 40, id="undefined-bit-40"),
])
def test_resource_options_metal_does_not_define_are_refused(mtl, options):
    """Apple, MTLResourceOptions: CPU cache modes MTLResourceCPUCacheModeDefaultCache (0) and
    cpuCacheModeWriteCombined (1); storage modes shared/managed/private/memoryless (0x00..0x30);
    hazard tracking default/untracked/tracked (0, 0x100, 0x200). Nothing defines other values, so
    newBufferWithLength:options: with them is outside the API; the simulator made the buffer."""
    rt = mtl.rt
    before = metal.state().live_counts()
    with pytest.raises(metal.MetalValidationError, match="(?i)options"):
        buf = rt.send(mtl.device, M_NEW_BUFFER, 64, options)
        rt.release(buf)
    assert metal.state().live_counts() == before


def test_new_buffer_is_cleared_with_zero_values(mtl):
    """Apple, MTLDevice newBufferWithLength:options: (makeBuffer(length:options:)): "Creates a buffer
    the method clears with zero values." The simulator's buffers hold whatever the host allocator
    left (not a leniency: a Metal program relying on the documented zeros fails here)."""
    rt = mtl.rt
    bufs = [rt.send(mtl.device, M_NEW_BUFFER, 4096, SHARED) for _ in range(8)]
    try:
        assert all(_host_bytes(mtl, b, 4096) == bytes(4096) for b in bufs)
    finally:
        for b in bufs:
            rt.release(b)


def test_zero_length_buffer_is_refused(mtl):
    """Already strict (kept as a guard): a zero-length MTLBuffer is refused."""
    with pytest.raises(metal.MetalValidationError, match="greater than 0"):
        mtl.rt.send(mtl.device, M_NEW_BUFFER, 0, SHARED)


_NULL_CHILD = """
import os, sys
os.environ["ACCEL_SIM"] = "mps"
from accel.backends import _objc
from accel.sim import metal
(ffi, objc, _), (_, mtl, _) = metal.open_libraries()
rt = _objc.Runtime(ffi, objc)
dev = mtl.MTLCreateSystemDefaultDevice()
M_NEW_BUFFER_BYTES = _objc.Message("newBufferWithBytes:length:options:", "id", "const void *", "NSUInteger",
                                   "NSUInteger")
M_QUEUE, M_CB, M_END = _objc.Message("newCommandQueue"), _objc.Message("commandBuffer"), _objc.Message(
    "endEncoding", "void")
M_COMPUTE = _objc.Message("computeCommandEncoder")
M_SET_BYTES = _objc.Message("setBytes:length:atIndex:", "void", "const void *", "NSUInteger", "NSUInteger")
try:
    if sys.argv[1] == "newBufferWithBytes":
        rt.send(dev, M_NEW_BUFFER_BYTES, ffi.NULL, 64, 0)
    else:
        q = rt.send(dev, M_QUEUE)
        with rt.pool():
            enc = rt.send(rt.send(q, M_CB), M_COMPUTE)
            try:
                rt.send(enc, M_SET_BYTES, ffi.NULL, 4, 1)
            finally:
                rt.send(enc, M_END)
except (metal.MetalValidationError, TypeError, ValueError) as exc:
    print("refused:", exc)
    sys.exit(0)
sys.exit(1)
"""


def _null_child(which):
    """Exit status of a fresh interpreter sending ``which`` a NULL pointer: 0 refused, 1 accepted,
    -11 SIGSEGV (the simulator crashed)."""
    env = dict(os.environ, ACCEL_SIM="mps")
    return subprocess.run([sys.executable, "-c", _NULL_CHILD, which], env=env, capture_output=True,
                          timeout=120).returncode


def test_new_buffer_with_bytes_from_null_is_refused_not_a_crash():
    """Apple, newBufferWithBytes:length:options: "pointer: A pointer to the starting memory address
    the method copies the initialization data from." NULL is no such address: a Mac crashes, and
    so did the simulator (SIGSEGV), killing the test run instead of refusing."""
    status = _null_child("newBufferWithBytes")
    assert status == 0, f"child exit status {status} (-11: SIGSEGV; 1: the null pointer was accepted)"


def test_set_bytes_from_null_is_refused_not_a_crash():
    """setBytes:length:atIndex: copies ``length`` bytes from the pointer ("Use this method for single-
    use data smaller than 4 KB"); NULL with length 4 crashed the simulator (SIGSEGV)."""
    status = _null_child("setBytes")
    assert status == 0, f"child exit status {status} (-11: SIGSEGV; 1: the null pointer was accepted)"


# -- MTLComputeCommandEncoder -----------------------------------------------------------------------

def test_a_dispatch_within_the_rules_still_works(mtl):
    rt = mtl.rt
    q = rt.send(mtl.device, M_QUEUE)
    pipe = _pipeline(mtl)
    buf = rt.send(mtl.device, M_NEW_BUFFER, 64, SHARED)
    _encode(mtl, q, lambda enc: rt.send(enc, M_FILL, buf, _rng(mtl, 0, 64), 0))

    def body(enc):
        _bind_fill_args(mtl, enc, buf, 16, 4)
        rt.send(enc, M_SET_TG, 16 * 1024, 0)
        rt.send(enc, M_SET_TG, 16 * 1024, 1)        # 32 KB in all: at the limit
        _dispatch(mtl, enc)
    _compute(mtl, q, pipe, body)
    assert _host_bytes(mtl, buf, 32) == bytes(16) + b"\x07\x00\x00\x00" * 4
    for o in (buf, pipe, q):
        rt.release(o)


def test_threadgroup_memory_summed_over_indices_above_the_limit_is_refused(mtl):
    """Apple, setThreadgroupMemoryLength:atIndex: "Important: The sum of all threadgroup memory
    allocations (whether made using this method or directly in the shader) can't exceed the device
    limits for threadgroup memory." 32 KB at index 0 plus 32 KB at index 1 is 64 KB; the simulator
    checked each call alone and dispatched."""
    rt = mtl.rt
    q = rt.send(mtl.device, M_QUEUE)
    pipe = _pipeline(mtl)
    buf = rt.send(mtl.device, M_NEW_BUFFER, 64, SHARED)

    def body(enc):
        _bind_fill_args(mtl, enc, buf, 0, 4)
        rt.send(enc, M_SET_TG, metal.MAX_THREADGROUP_MEMORY, 0)
        rt.send(enc, M_SET_TG, metal.MAX_THREADGROUP_MEMORY, 1)
        _dispatch(mtl, enc)
    try:
        with pytest.raises(metal.MetalValidationError, match="threadgroup memory"):
            _compute(mtl, q, pipe, body)
    finally:
        for o in (buf, pipe, q):
            rt.release(o)


def test_threadgroup_memory_index_out_of_the_argument_table_is_refused(mtl):
    """setThreadgroupMemoryLength:atIndex: "index: The index in the threadgroup memory argument
    table" - the docs give no range; index 1000 is in no table, yet the simulator accepted it."""
    rt = mtl.rt
    q = rt.send(mtl.device, M_QUEUE)
    pipe = _pipeline(mtl)
    try:
        with pytest.raises(metal.MetalValidationError, match="index"):
            _compute(mtl, q, pipe, lambda enc: rt.send(enc, M_SET_TG, 16, 1000))
    finally:
        rt.release(pipe)
        rt.release(q)


def test_set_buffer_offset_at_the_end_of_the_buffer_is_refused(mtl):
    """setBuffer:offset:atIndex: "offset: The number of bytes to skip in the buffer before the first
    element of data" - at offset == length there is no first element (the docs are silent; Metal's
    API validation asserts offset < length: WebKit, "setVertexBuffer causes validation error when
    offset == buffer length"). The simulator bound it."""
    rt = mtl.rt
    q = rt.send(mtl.device, M_QUEUE)
    pipe = _pipeline(mtl)
    buf = rt.send(mtl.device, M_NEW_BUFFER, 64, SHARED)
    try:
        with pytest.raises(metal.MetalValidationError, match="offset"):
            _compute(mtl, q, pipe, lambda enc: rt.send(enc, M_SET_BUFFER, buf, 64, 0))
    finally:
        for o in (buf, pipe, q):
            rt.release(o)


def test_kernel_buffer_offset_misaligned_for_its_element_type_is_refused(mtl):
    """Apple, setBuffer:offset:atIndex: "For buffers binding to an argument using the device address
    space, align the offset to the data type's size." accel_test_fill_u32 writes uint (4 bytes)
    through buffer(0); offset 2 is misaligned, yet the simulator ran the kernel (numpy wrote
    unaligned words)."""
    rt = mtl.rt
    q = rt.send(mtl.device, M_QUEUE)
    pipe = _pipeline(mtl)
    buf = rt.send(mtl.device, M_NEW_BUFFER, 64, SHARED)
    status = None

    def body(enc):
        _bind_fill_args(mtl, enc, buf, 2, 4)
        _dispatch(mtl, enc)
    try:
        try:
            with rt.pool():
                cb = rt.send(q, M_CB)
                enc = rt.send(cb, M_COMPUTE)
                rt.send(enc, M_SET_PIPELINE, pipe)
                try:
                    body(enc)
                finally:
                    rt.send(enc, M_END)
                rt.send(cb, M_COMMIT)
                rt.send(cb, M_WAIT)
                status = int(rt.send(cb, _objc.Message("status", "NSUInteger")))
        except metal.MetalValidationError:
            status = "refused"
        assert status in ("refused", metal.ERROR), f"misaligned dispatch ran (status {status})"
    finally:
        for o in (buf, pipe, q):
            rt.release(o)


# -- MTLCommandQueue / MTLCommandBuffer -------------------------------------------------------------

def test_a_65th_command_buffer_while_64_are_uncommitted_is_refused(mtl):
    """Apple, MTLDevice newCommandQueue: "The command queues you create with this method allow up to
    64 uncompleted command buffers at time." MTLCommandQueue commandBuffer: "Each command queue has
    a fixed number of command buffers for its lifetime ... This method blocks the calling CPU thread
    when the queue doesn't have any free command buffers". With 64 uncommitted buffers none can
    complete: the 65th request blocks forever on a Mac. The simulator handed it out."""
    rt = mtl.rt
    q = rt.send(mtl.device, M_QUEUE)
    held = []
    try:
        with rt.pool():
            for _ in range(64):
                held.append(rt.retain(rt.send(q, M_CB)))
            with pytest.raises(metal.MetalValidationError, match="64|block"):
                held.append(rt.retain(rt.send(q, M_CB)))
    finally:
        for cb in held:
            rt.release(cb)
        rt.release(q)


def test_unsimulated_selectors_are_refused_not_ignored(mtl):
    """Guard: enqueue, handlers, waitUntilScheduled, didModifyRange: and friends are not simulated; the
    simulator refuses them (so a program using them cannot pass by accident)."""
    rt = mtl.rt
    q = rt.send(mtl.device, M_QUEUE)
    buf = rt.send(mtl.device, M_NEW_BUFFER, 64, SHARED)
    with rt.pool():
        cb = rt.send(q, M_CB)
        for target, msg in ((cb, _objc.Message("enqueue", "void")),
                            (cb, _objc.Message("waitUntilScheduled", "void")),
                            (cb, _objc.Message("addCompletedHandler:", "void", "id")),
                            (cb, _objc.Message("addScheduledHandler:", "void", "id")),
                            (buf, _objc.Message("didModifyRange:", "void", "NSRange"))):
            args = () if not msg.argtypes else ((rt.nil,) if msg.argtypes[0] == "id" else (_rng(mtl, 0, 4),))
            with pytest.raises(metal.MetalValidationError, match="does not implement"):
                rt.send(target, msg, *args)
    rt.release(buf)
    rt.release(q)


# -- does accel rely on any of these leniencies? ----------------------------------------------------

@pytest.fixture
def strict_be(mps_backend):
    return mps_backend


def test_accel_mps_backend_runs_on_the_strict_simulator(strict_be):
    """Every path of the mps backend that encodes Metal work (aligned fill, unaligned fill on the
    host, pageable upload through a staging buffer, buffer-to-buffer blit, download, timing events,
    cross-stream waits, a kernel with threadgroup memory, 200 records without a synchronize) under
    the strict simulator: accel does not rely on any leniency above."""
    be = strict_be
    s = be.stream_create()
    p, q = be.mem_alloc(256), be.mem_alloc(256)
    be.memset_async(p, 3, 256, s)
    be.memset_async(q, 0, 256, s)
    be.memset_async(p + 1, 4, 3, s)                   # unaligned: host path
    src = ctypes.create_string_buffer(b"\x11" * 64, 64)
    be.memcpy_async(q + 64, ctypes.addressof(src), 64, s)     # pageable: staging buffer + blit
    be.memcpy_async(q, p, 64, s)                      # device to device blit
    out = ctypes.create_string_buffer(192)
    be.memcpy_async(ctypes.addressof(out), q, 192, s)
    be.stream_synchronize(s)
    assert out.raw == b"\x03\x04\x04\x04" + b"\x03" * 60 + b"\x11" * 64 + bytes(64)
    start, end = be.event_create(enable_timing=True), be.event_create(enable_timing=True)
    be.event_record(start, s)
    be.event_record(end, s)
    be.stream_wait_event(0, end)
    be.memset_async(q, 0, 4, 0)
    be.event_synchronize(end)
    assert be.event_elapsed_ms(start, end) >= 0
    mod = be.module_load(f"kernel void {FILL_KERNEL}(device uint *out [[buffer(0)]], constant ulong &n "
                         f"[[buffer(1)]], constant uint &v [[buffer(2)]]) {{}}\n")
    fn = be.module_function(mod, FILL_KERNEL)
    be.launch(fn, (1, 1, 1), (32, 1, 1), [("ptr", p + 16), ("u64", 4), ("u32", 9)], 1000, s)
    for _ in range(200):                              # many records: no 64-buffer deadlock
        be.event_record(start, s)
    be.device_synchronize()
    assert ctypes.string_at(p + 16, 16) == b"\x09\x00\x00\x00" * 4
    be.module_unload(mod)
    for e in (start, end):
        be.event_destroy(e)
    be.mem_free(p)
    be.mem_free(q)
    be.stream_destroy(s)


def test_accel_public_api_runs_on_the_strict_simulator(monkeypatch):
    """The same through accel's objects (Buffer, Stream, Event, pinned memory) from two threads."""
    use_sim(monkeypatch, "mps")
    metal.reset()
    core.reset()
    np = pytest.importorskip("numpy")
    errors = []

    def work(k):
        try:
            s = accel.Stream()
            a = accel.Buffer(4096, stream=s).copy_from(np.full(4096, k, np.uint8))
            b = accel.Buffer(4096, stream=s)
            b.copy_from(a, s)
            b.fill_(k + 1, s)
            e = accel.Event(enable_timing=True)
            e.record(s)
            pinned = accel.empty_pinned((4096,), np.uint8)
            b.copy_to(pinned, s)
            s.synchronize()
            assert (pinned == k + 1).all()
            for o in (a, b, s):
                o.close()
        except BaseException as exc:      # reported by the main thread
            errors.append(exc)
    threads = [threading.Thread(target=work, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    accel.synchronize()
