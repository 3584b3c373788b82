"""The mps backend: unavailable on Linux with a reason; everything else under ACCEL_SIM=mps.

The simulator (accel.sim.metal) replaces libobjc and Metal only: the backend
code that runs here is the code that runs on a Mac, including every
objc_msgSend cast, which the simulator checks against Apple's declarations.
"""

import ctypes
import os
import subprocess
import sys
import threading

import pytest

import accel
from accel import _lazy, backends
from accel._errors import AcceleratorError, OutOfMemoryError
from accel.backends import _objc
from accel.sim import core, metal
from conftest import use_sim

np = pytest.importorskip("numpy")

not_macos = pytest.mark.skipif(sys.platform == "darwin", reason="checks the Linux (no Metal) behaviour")


# -- on Linux: unavailable, with a reason, no exception ------------------------------------

@not_macos
def test_linux_mps_is_unavailable_with_a_reason(monkeypatch):
    monkeypatch.setenv("ACCEL_BACKEND", "mps")
    _lazy._reset_for_tests()
    assert accel.is_available() is False
    assert accel.device_count() == 0
    report = backends.get("mps").report()
    assert report["count"] == 0
    assert "libobjc/Metal not found" in report["reason"]
    assert "libobjc" in report["load_error"]
    assert backends.get("mps").loads() is False


@not_macos
def test_linux_mps_init_raises_accelerator_error(monkeypatch):
    monkeypatch.setenv("ACCEL_BACKEND", "mps")
    _lazy._reset_for_tests()
    with pytest.raises(AcceleratorError, match="libobjc/Metal not found"):
        backends.get("mps").init()


@not_macos
def test_linux_python_m_accel_explains_mps():
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    env["ACCEL_BACKEND"] = "mps"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "accel"], capture_output=True, text=True, env=env,
                          cwd=root, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "mps: 0 device(s)" in proc.stdout
    assert "libobjc/Metal not found" in proc.stdout


# -- the Objective-C helper ---------------------------------------------------------------

def test_method_families_decide_ownership():
    for sel in ("new", "newCommandQueue", "newBufferWithLength:options:", "alloc", "copy",
                "mutableCopy", "copyWithZone:"):
        assert _objc.returns_retained(sel), sel
    for sel in ("commandBuffer", "newline", "copyright", "contents", "blitCommandEncoder", "name"):
        assert not _objc.returns_retained(sel), sel


def test_message_signature_is_exact():
    m = _objc.Message("fillBuffer:range:value:", "void", "id", "NSRange", "uint8_t")
    assert m.ctype == "void (*)(void *, void *, void *, NSRange, uint8_t)"
    with pytest.raises(ValueError, match="takes 2 arguments"):
        _objc.Message("setBuffer:offset:", "void", "id")
    with pytest.raises(ValueError, match="unknown Objective-C type"):
        _objc.Message("length", "size_t")


# -- the simulated backend -----------------------------------------------------------------

def _fresh_sim(monkeypatch, **env):
    use_sim(monkeypatch, "mps", **env)
    metal.reset()
    core.reset()   # re-read ACCEL_SIM_* for this test


@pytest.fixture
def be(monkeypatch):
    _fresh_sim(monkeypatch)
    backend = backends.get("mps")
    backend.init()
    yield backend
    backend.close()


def _host(data: bytes):
    buf = ctypes.create_string_buffer(data, len(data))
    return buf, ctypes.addressof(buf)


def _read(be, ptr, n, stream=0):
    out = ctypes.create_string_buffer(n)
    be.memcpy_async(ctypes.addressof(out), ptr, n, stream)
    return out.raw


def test_sim_counts_one_device_without_initializing(monkeypatch):
    _fresh_sim(monkeypatch)
    b = backends.get("mps")
    assert b.count() == 1
    assert b.report()["simulated"] is True
    assert accel.is_available() and accel.device_count() == 1
    assert metal.state().runtime_initialized is False


def test_sim_with_no_device(monkeypatch):
    _fresh_sim(monkeypatch, ACCEL_SIM_DEVICES=0)
    b = backends.get("mps")
    assert b.count() == 0 and accel.is_available() is False
    assert "0 devices" in b.report()["reason"]
    with pytest.raises(AcceleratorError, match="MTLCreateSystemDefaultDevice returned nil"):
        b.init()


def test_properties_and_device_index(be):
    p = be.properties(0)
    assert p.unified_memory is True and p.total_memory == 8 << 30
    assert "float64" not in p.supported_dtypes and "float32" in p.supported_dtypes
    assert p.uuid is None and p.extra["registry_id"] > 0   # Metal has no device UUID
    be.set_device(0)
    assert be.get_device() == 0 and be.default_stream(0) == 0
    with pytest.raises(ValueError, match="one device"):
        be.set_device(1)
    with pytest.raises(TypeError):
        be.properties("0")


def test_alloc_free_and_mem_info(be):
    free0, total = be.mem_info()
    assert total == 8 << 30 and free0 == total - metal.PAGE  # the timing scratch buffer
    p = be.mem_alloc(100_000)
    assert be.mem_info()[0] == free0 - 7 * metal.PAGE    # Metal counts whole pages
    h = be.host_alloc(10)
    assert be.mem_alloc(0) == 0
    be.mem_free(0)
    with pytest.raises(ValueError, match="host_alloc"):
        be.host_free(p)             # device memory is not pinned host memory
    be.host_free(h)
    be.mem_free(p)
    assert be.mem_info()[0] == free0
    with pytest.raises(ValueError, match="not a live pointer"):
        be.mem_free(p)              # double free
    with pytest.raises(AcceleratorError):
        be.mem_free(p)              # ... is also an AcceleratorError, as the vendor's error would be
    with pytest.raises(ValueError, match="negative"):
        be.mem_alloc(-1)


def test_out_of_memory(monkeypatch):
    _fresh_sim(monkeypatch, ACCEL_SIM_MEMORY="1M")
    b = backends.get("mps")
    b.init()
    try:
        keep = b.mem_alloc(512 * 1024)
        with pytest.raises(OutOfMemoryError, match="out of memory") as info:
            b.mem_alloc(600 * 1024)
        assert info.value.call == "newBufferWithLength:options:"
        core.inject_oom()
        with pytest.raises(OutOfMemoryError):
            b.mem_alloc(16)
        b.mem_free(b.mem_alloc(16))  # the injected fault was used up
        b.mem_free(keep)
    finally:
        b.close()


def test_one_buffer_above_max_buffer_length_names_the_limit(monkeypatch):
    _fresh_sim(monkeypatch, ACCEL_SIM_MEMORY="1M")
    b = backends.get("mps")
    b.init()
    try:
        limit = b.properties(0).extra["max_buffer_length"]
        assert limit < b.mem_info()[0]   # memory is free, the buffer is just too large
        with pytest.raises(OutOfMemoryError, match=f"maxBufferLength is {limit} bytes"):
            b.mem_alloc(limit + 16384)
        b.mem_free(b.mem_alloc(limit))
    finally:
        b.close()


def test_copies_and_fills_including_interior_and_unaligned(be):
    n = 4096
    data = bytes(range(256)) * (n // 256)
    keep, src = _host(data)
    a, b = be.mem_alloc(n), be.mem_alloc(n)
    be.memcpy_async(a, src, n, 0)              # pageable -> device (staged)
    be.memcpy_async(b, a, n, 0)                # device -> device (blit)
    assert _read(be, b, n) == data             # device -> pageable (sync + host copy)
    be.memcpy_async(b + 8, a + 100, 40, 0)     # interior pointers, aligned
    be.memcpy_async(b + 1, a + 3, 5, 0)        # unaligned: host path, still in order
    expect = bytearray(data)
    expect[8:48] = data[100:140]
    expect[1:6] = data[3:8]
    assert _read(be, b, n) == bytes(expect)
    be.memset_async(b, 0xAB, 64, 0)
    be.memset_async(b + 64, 0x1CD, 3, 0)       # unaligned; value taken mod 256
    got = _read(be, b, 80)
    assert got[:64] == b"\xab" * 64 and got[64:67] == b"\xcd" * 3 and got[67:80] == bytes(expect[67:80])
    h = be.host_alloc(n)
    be.memcpy_async(h, b, n, 0)                # pinned host is a Metal buffer too: blit
    be.stream_synchronize(0)
    assert ctypes.string_at(h, 64) == b"\xab" * 64
    with pytest.raises(ValueError, match="overrun"):
        be.memcpy_async(b + n - 4, a, 8, 0)
    with pytest.raises(ValueError, match="memset needs memory"):
        be.memset_async(src, 0, 4, 0)
    for p in (a, b):
        be.mem_free(p)
    be.host_free(h)
    del keep


def test_stream_order_and_cross_queue_events_under_delay(monkeypatch):
    _fresh_sim(monkeypatch, ACCEL_SIM_DELAY_US=3000)
    b = backends.get("mps")
    b.init()
    try:
        s1, s2 = b.stream_create(), b.stream_create()
        src, dst = b.mem_alloc(256), b.mem_alloc(256)
        for v in (1, 2, 3, 9):
            b.memset_async(src, v, 256, s1)    # slow, in order on s1
        e = b.event_create()
        assert b.event_query(e)                # never recorded: complete
        b.event_record(e, s1)
        b.stream_wait_event(s2, e)             # s2's copy runs after s1's fills
        b.memcpy_async(dst, src, 256, s2)
        b.stream_synchronize(s2)
        assert b.event_query(e) and b.stream_query(s2)
        assert _read(b, dst, 256, s2) == b"\x09" * 256
        b.event_synchronize(e)
        b.device_synchronize()
        assert b.stream_query(s1)
        b.event_destroy(e)
        for s in (s1, s2):
            b.stream_destroy(s)
        with pytest.raises(ValueError, match="not a live stream"):
            b.stream_synchronize(s1)
        with pytest.raises(ValueError, match="cannot be destroyed"):
            b.stream_destroy(0)
        b.mem_free(src)
        b.mem_free(dst)
    finally:
        b.close()


def test_elapsed_time(be):
    s = be.stream_create()
    p = be.mem_alloc(1 << 16)
    e0, e1 = be.event_create(enable_timing=True), be.event_create(enable_timing=True)
    plain = be.event_create()
    be.event_record(e0, s)
    be.memset_async(p, 1, 1 << 16, s)
    be.event_record(e1, s)
    be.event_synchronize(e1)
    be.event_synchronize(e0)
    assert be.event_elapsed_ms(e0, e1) >= 0.0
    with pytest.raises(ValueError, match="enable_timing"):
        be.event_elapsed_ms(plain, e1)
    fresh = be.event_create(enable_timing=True)
    with pytest.raises(ValueError, match="has not been recorded"):
        be.event_elapsed_ms(e0, fresh)


def test_command_buffer_error_is_reported(be):
    core.inject_error("commit", 8)  # MTLCommandBufferErrorOutOfMemory
    p = be.mem_alloc(64)
    be.memset_async(p, 1, 64, 0)
    with pytest.raises(AcceleratorError) as info:
        be.stream_synchronize(0)
    assert info.value.code_name == "MTLCommandBufferErrorOutOfMemory" and info.value.code == 8
    be.memset_async(p, 2, 64, 0)   # the queue keeps working
    be.stream_synchronize(0)
    assert _read(be, p, 4) == b"\x02" * 4


def test_graphs_are_not_supported(be):
    assert be.supports_graphs is False
    for call, args in (("capture_begin", (0, "global")), ("capture_end", (0,)),
                       ("graph_instantiate", (1,)), ("graph_launch", (1, 0))):
        with pytest.raises(NotImplementedError, match="no stream capture"):
            getattr(be, call)(*args)
    assert be.stream_is_capturing(0) is False


TEST_MSL = b"""
#include <metal_stdlib>
using namespace metal;
kernel void accel_test_fill_u32(device uint *out [[buffer(0)]], constant ulong &n [[buffer(1)]],
                                constant uint &value [[buffer(2)]], uint i [[thread_position_in_grid]]) {
    if (i < n) out[i] = value;
}
"""


def test_kernels_compile_and_launch(be):
    assert be.kernel_language == "msl"
    m = be.module_load(TEST_MSL)
    f = be.module_function(m, "accel_test_fill_u32")
    p = be.mem_alloc(64)
    s = be.stream_create()
    be.launch(f, (1, 1, 1), (16, 1, 1), [("ptr", p), ("u64", 16), ("u32", 0xDEADBEEF)], 0, s)
    be.stream_synchronize(s)
    assert np.frombuffer(_read(be, p, 64), np.uint32).tolist() == [0xDEADBEEF] * 16
    with pytest.raises(ValueError, match="no kernel named"):
        be.module_function(m, "nope")
    with pytest.raises(ValueError, match="64-bit float"):
        be.launch(f, (1, 1, 1), (1, 1, 1), [("ptr", p), ("u64", 1), ("f64", 1.0)], 0, s)
    with pytest.raises(ValueError, match="threads"):
        be.launch(f, (1, 1, 1), (2048, 1, 1), [("ptr", p), ("u64", 1), ("u32", 1)], 0, s)
    with pytest.raises(AcceleratorError, match="boom"):
        be.module_load(b"#error boom\n" + TEST_MSL)
    be.module_unload(m)
    with pytest.raises(ValueError, match="not a live kernel"):
        be.launch(f, (1, 1, 1), (1, 1, 1), [], 0, s)


def test_philox_metal_source_loads_through_the_backend(be):
    from accel.sim import kernels
    path = os.path.join(os.path.dirname(accel.__file__), "random", "kernels", "philox.metal")
    with open(path, "rb") as fh:
        m = be.module_load(fh.read())
    if kernels.lookup("accel_philox_raw_u32") is None:
        pytest.skip("no simulator reference for the Philox kernels yet (accel/sim/philox_kernels.py)")
    from accel.random import philox
    f = be.module_function(m, "accel_philox_raw_u32")
    n = 37
    out = be.mem_alloc(4 * n)
    args = [("ptr", out), ("u64", n), ("u64", 7), ("u64", 8), ("ptr", 0), ("ptr", 0)]
    be.launch(f, (2, 1, 1), (4, 1, 1), args, 0, 0)
    assert np.array_equal(np.frombuffer(_read(be, out, 4 * n), np.uint32), philox.raw_words(7, 8, n))


def test_no_objc_object_leaks(monkeypatch):
    _fresh_sim(monkeypatch)
    st = metal.state()
    b = backends.get("mps")
    b.init()
    baseline = st.live_counts()
    s = b.stream_create()
    e = b.event_create(enable_timing=True)
    p, q = b.mem_alloc(1024), b.mem_alloc(1024)
    keep, src = _host(b"x" * 1024)
    b.memcpy_async(p, src, 1024, s)
    b.memcpy_async(q, p, 1024, s)
    b.memset_async(q, 0, 1024, s)
    b.event_record(e, s)
    b.stream_wait_event(0, e)
    m = b.module_load(TEST_MSL)
    f = b.module_function(m, "accel_test_fill_u32")
    b.launch(f, (1, 1, 1), (8, 1, 1), [("ptr", p), ("u64", 8), ("u32", 1)], 0, 0)
    b.device_synchronize()
    b.properties(0)
    b.module_unload(m)
    b.event_destroy(e)
    b.stream_destroy(s)
    b.mem_free(p)
    b.mem_free(q)
    b.device_synchronize()
    assert st.live_counts() == baseline
    b.close()
    assert st.live() == []
    assert st.leaked_autoreleases == 0
    assert st.engine_errors == []


def test_threads_share_the_backend(be):
    errors = []

    def work(k):
        try:
            s = be.stream_create()
            for _ in range(20):
                p = be.mem_alloc(256)
                be.memset_async(p, k, 256, s)
                assert _read(be, p, 256, s) == bytes([k]) * 256
                be.mem_free(p)
            be.stream_destroy(s)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_selectors_and_casts_are_cached(be, monkeypatch):
    from accel.backends.mps import _library as mps_lib
    rt = be._rt
    registered = []
    real = rt.lib.sel_registerName
    monkeypatch.setattr(rt.lib, "sel_registerName", lambda name: registered.append(name) or real(name))
    p = be.mem_alloc(64)
    with rt.pool():
        buf = be._resolve(p, 64)[0].obj
        assert rt.send(buf, mps_lib.M_LENGTH) == 64
        assert rt.send(buf, mps_lib.M_LENGTH) == 64
    assert registered == [b"length"]
    # one cast per C signature, shared by every selector with that signature
    assert rt._sender(mps_lib.M_COMMIT) is rt._sender(mps_lib.M_WAIT) is rt._sender(mps_lib.M_END_ENCODING)
    assert rt._sender(mps_lib.M_COMMIT) is not rt._sender(mps_lib.M_STATUS)
    be.mem_free(p)


# -- the simulator catches what would break on a Mac ------------------------------------------

def test_sim_rejects_a_cast_that_does_not_match_the_declaration(be):
    rt = be._rt
    bad = _objc.Message("newBufferWithLength:options:", "id", "uint8_t", "NSUInteger")
    with pytest.raises(metal.MetalValidationError, match="ABI would not match"):
        rt.send(be._device, bad, 16, 0)
    with pytest.raises(metal.MetalValidationError, match="variadic"):
        rt.lib.objc_msgSend(be._device)


def test_sim_enforces_metal_validation_rules(be):
    rt = be._rt
    from accel.backends.mps import _library as mps_lib
    with rt.pool():
        a = rt.send(be._device, mps_lib.M_NEW_BUFFER, 64, 0)
        cb = rt.send(rt.send(be._device, mps_lib.M_NEW_QUEUE), mps_lib.M_COMMAND_BUFFER)
        enc = rt.send(cb, mps_lib.M_BLIT_ENCODER)
        with pytest.raises(metal.MetalValidationError, match="multiple of 4"):
            rt.send(enc, mps_lib.M_COPY, a, 1, a, 8, 4)
        with pytest.raises(metal.MetalValidationError, match="active encoder"):
            rt.send(cb, mps_lib.M_COMMIT)
        rt.send(enc, mps_lib.M_END_ENCODING)
        with pytest.raises(metal.MetalValidationError, match="never committed"):
            rt.send(cb, mps_lib.M_WAIT)
        rt.release(a)
        with pytest.raises(metal.MetalValidationError, match="deallocated"):
            rt.send(a, mps_lib.M_LENGTH)
