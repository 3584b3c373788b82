"""Fresh-eyes fuzzing (r34) of interop (DLPack / CAI / from_ptr) and user kernels the way other
programs use them: on the NON-current device, with every protocol value, with numpy and torch
(CPU) as oracles for what a DLPack capsule must hold.  Each case ends with the process state
unchanged: current device and streams, memory_allocated, live exports, deleters run once."""

import ctypes
import gc
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import accel
from accel import _dlpack as D
from accel import sim

from test_dlpack import dlpack_inside_a_capture


def _state():
    gc.collect()
    devices = range(accel.device_count())
    return (accel.current_device_index(), [accel.current_stream(i) for i in devices],
            [accel.memory_allocated(i) for i in devices], D.live_exports())


# -- producer: protocol arguments, on the non-current device -------------------------------------
def test_dlpack_protocol_values_on_the_non_current_device(sim_cuda):
    buf = accel.Buffer(64, device=1)
    view = buf.as_array(np.float32, (4, 4))
    s0, s1 = accel.Stream(0), accel.Stream(1)
    before = _state()
    ok = [None, -1, 1, 2, np.int64(1), s0, s1, accel.current_stream(1), s1.handle]
    bad = [(0, ValueError, "stream=0 is disallowed"), (-2, ValueError, ">= -1"), (1 << 64, ValueError, "64 bits"),
           (1.0, TypeError, "float"), ("1", TypeError, "str"), (True, TypeError, "bool")]
    for obj in (buf, view):
        for st in ok:
            for mv in (None, (1, 0), (1, 3), [2, 0]):
                capsule = obj.__dlpack__(stream=st, max_version=mv)
                assert D.parse(capsule).versioned == (mv is not None)
                del capsule
        for st, exc, match in bad:
            with pytest.raises(exc, match=match):
                obj.__dlpack__(stream=st)
        for mv, exc in (((1,), TypeError), ("10", TypeError), ((1.0, 0), TypeError), ((-1, 0), ValueError),
                        ((True, 0), ValueError)):
            with pytest.raises(exc, match="max_version"):
                obj.__dlpack__(max_version=mv)
        assert obj.__dlpack_device__() == (2, 1)
        # (copy=True and a host dl_device with copy None copy since session 39: r80b)
        for dl, copy, result in [((2, 1), None, None), ((2, 1), False, None), ((2, 1), True, None),
                                 ((np.int32(2), np.int64(1)), None, None), ((2, 0), None, BufferError),
                                 ((1, 0), None, None), ((1, 0), False, ValueError), ((2,), None, TypeError),
                                 ("cuda", None, TypeError), (None, 1, TypeError), (None, True, None)]:
            if result is None:
                obj.__dlpack__(dl_device=dl, copy=copy)
            else:
                with pytest.raises(result):
                    obj.__dlpack__(dl_device=dl, copy=copy)
    gc.collect()
    assert _state() == before


# -- what a capsule holds, with numpy and torch as the consumers ---------------------------------
class _HostProducer:
    """A host array exported through accel's own capsule code (kDLCPU), so numpy and torch (CPU)
    check the struct accel writes: dtype codes, 0-d, 0-size, strides, byte_offset, versions."""

    def __init__(self, array, byte_offset=0):
        self.array, self.byte_offset = array, byte_offset

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        a = self.array
        strides = tuple(s // a.itemsize for s in a.strides)
        return D.export(a, a.ctypes.data - self.byte_offset, 1, 0, a.dtype, a.shape, strides, self.byte_offset,
                        versioned=D.check_max_version(max_version), readonly=not a.flags.writeable)


_HOST_ARRAYS = {
    "0d": lambda: np.array(3.5, np.float32), "empty": lambda: np.zeros((0, 3), np.float32),
    "bool": lambda: np.array([True, False, True]), "complex64": lambda: np.arange(4).astype(np.complex64) * 1j,
    "complex128": lambda: np.arange(4).astype(np.complex128), "float16": lambda: np.arange(3, dtype=np.float16),
    "strided": lambda: np.arange(24, dtype=np.int16).reshape(4, 6)[:, ::2],
    "transposed": lambda: np.arange(6, dtype=np.float64).reshape(2, 3).T, "uint64": lambda: np.arange(3, dtype=np.uint64),
    "broadcast": lambda: np.broadcast_to(np.int8(7), (3, 4)),
}


@pytest.mark.parametrize("name", sorted(_HOST_ARRAYS))
def test_capsules_read_by_numpy_and_torch(sim_cuda, name):
    torch = pytest.importorskip("torch")
    a = _HOST_ARRAYS[name]()
    for consume in (np.from_dlpack, torch.from_dlpack):
        for offset in (0, a.itemsize):    # (torch: a byte_offset is a multiple of the itemsize)
            before = D.live_exports()
            got = consume(_HostProducer(a, offset))
            host = got.numpy() if hasattr(got, "numpy") else got
            assert host.shape == a.shape and host.dtype == a.dtype and np.array_equal(host, a)
            del got, host
            gc.collect()
            assert D.live_exports() == before       # the consumer's deleter ran


def test_read_only_buffer_refuses_a_legacy_capsule(sim_backend):
    """A legacy DLManagedTensor cannot say read-only: numpy refuses to export a read-only array
    that way (BufferError); accel handed the consumer a writable tensor of read-only memory.
    Failed first: no exception, a "dltensor" capsule was returned."""
    src = accel.Buffer(64, device=accel.device_count() - 1)
    kind, index = src.__dlpack_device__()
    capsule = D.export(src, src.ptr, kind, index, np.uint8, (64,), None, 0, versioned=True, readonly=True)
    ro = accel.from_dlpack(capsule)
    assert ro.readonly
    before = _state()
    for obj in (ro, ro.as_array(np.float32, (4, 4))):
        with pytest.raises(BufferError, match="read-only"):
            obj.__dlpack__()
        with pytest.raises(BufferError, match="read-only"):
            obj.__dlpack__(max_version=(0, 9))
        versioned = obj.__dlpack__(max_version=(1, 0))
        assert D.parse(versioned).readonly
        del versioned
        back = accel.from_dlpack(obj)         # accel asks for a versioned capsule: read-only kept
        assert back.readonly
        back.close()
    gc.collect()
    assert _state() == before
    ro.close()


# -- consumer: capsules other producers make, deleter counted ------------------------------------
_deleted = []
_DELETER = D.DELETER(lambda address: _deleted.append(address))
_PyCapsule_New = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))


def _capsule(keep, ptr, device, shape, strides=None, offset=0, versioned=True, major=1, flags=0, code=1, bits=8,
             lanes=1, device_type=2):
    m = D.DLManagedTensorVersioned() if versioned else D.DLManagedTensor()
    if versioned:
        m.version.major, m.version.minor, m.flags = major, 0, flags
    n = max(len(shape), 1)
    sh = (ctypes.c_int64 * n)(*shape)
    st = None if strides is None else (ctypes.c_int64 * n)(*strides)
    t = m.dl_tensor
    t.data, t.device.device_type, t.device.device_id, t.ndim = ptr, device_type, device, len(shape)
    t.dtype.code, t.dtype.bits, t.dtype.lanes = code, bits, lanes
    t.shape = ctypes.cast(sh, ctypes.POINTER(ctypes.c_int64))
    t.strides = None if st is None else ctypes.cast(st, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = offset
    m.deleter = ctypes.cast(_DELETER, ctypes.c_void_p).value
    keep.append((m, sh, st))
    return _PyCapsule_New(ctypes.addressof(m), b"dltensor_versioned" if versioned else b"dltensor", None)


@pytest.mark.parametrize("kw, span", [
    (dict(shape=(16,)), (0, 16)), (dict(shape=(4, 4)), (0, 16)), (dict(shape=(8,), offset=16), (16, 8)),
    (dict(shape=()), (0, 1)), (dict(shape=(0, 4)), (None, 0)), (dict(shape=(0,), ptr=0), (None, 0)),
    (dict(shape=(4,), flags=1), (0, 4)), (dict(shape=(4,), flags=2), (0, 4)), (dict(shape=(4,), versioned=False), (0, 4)),
    (dict(shape=(4,), code=6), (0, 4)), (dict(shape=(4,), code=5, bits=64), (0, 32)), (dict(shape=(4,), lanes=4), (0, 16)),
    (dict(shape=(4, 4), strides=(32, 2)), (0, 103)), (dict(shape=(4, 4), strides=(0, 0)), (0, 1)),
    (dict(shape=(4,), strides=(-1,), offset=8), (5, 4)), (dict(shape=(1,) * 40), (0, 1)),
])
def test_foreign_capsules_on_the_non_current_device(sim_cuda, kw, span):
    src = accel.Buffer(256, device=1)
    src.copy_from(np.arange(256, dtype=np.uint8))
    before, keep = _state(), []
    _deleted.clear()
    kw.setdefault("ptr", src.ptr)
    b = accel.from_dlpack(_capsule(keep, device=1, **kw))
    assert (b.ptr - src.ptr if b.ptr else None, b.nbytes) == span
    assert b.device == accel.device("cuda", 1) and b.readonly == bool(kw.get("flags", 0) & 1)
    if b.nbytes:
        assert (b.to_numpy() == np.arange(span[0], span[0] + span[1], dtype=np.uint8)).all()
    assert _deleted == []
    b.close()
    assert len(_deleted) == 1
    b.close()
    gc.collect()
    assert len(_deleted) == 1 and _state() == before


@pytest.mark.parametrize("kw, exc, match, deleted", [
    (dict(major=2), BufferError, "version 2.0", 1), (dict(major=0), BufferError, "version 0.0", 1),
    (dict(device=5), accel.InvalidDeviceError, "out of range", 0),
    (dict(device=-1), accel.InvalidDeviceError, "out of range", 0), (dict(device_type=1), BufferError, "host memory", 0),
    (dict(device_type=14), BufferError, "kDLOneAPI", 0), (dict(device=0), ValueError, "device memory of cuda:1", 1),
])
def test_refused_foreign_capsules(sim_cuda, kw, exc, match, deleted):
    """A refused capsule keeps its name (its producer frees it) unless it was taken: then its
    deleter ran exactly once."""
    src = accel.Buffer(64, device=1)
    before, keep = _state(), []
    _deleted.clear()
    kw = dict(dict(ptr=src.ptr, device=1, shape=(4,)), **kw)
    capsule = _capsule(keep, **kw)
    with pytest.raises(exc, match=match):
        accel.from_dlpack(capsule)
    assert len(_deleted) == deleted
    name = ctypes.string_at(D._PyCapsule_GetName(capsule))
    assert name.startswith(b"used_") == bool(deleted)
    gc.collect()
    assert _state() == before


def test_from_dlpack_stream_argument_and_bad_producers(sim_cuda):
    src = accel.Buffer(256, device=1)
    view = src.as_array(np.float32, (8, 8))
    s0, s1 = accel.Stream(0), accel.Stream(1)
    before = _state()
    for st in (None, -1, 1, 2, s0, s1, accel.current_stream(1), s1.handle):
        b = accel.from_dlpack(view, stream=st)
        assert (b.device.index, b.nbytes, b.ptr) == (1, 256, src.ptr)
        b.close()
    for st, exc in (("x", TypeError), (1.5, TypeError), (0, ValueError)):
        with pytest.raises(exc):
            accel.from_dlpack(view, stream=st)

    class Bad:
        def __init__(self, ret):
            self.ret = ret

        def __dlpack__(self, **kw):
            if isinstance(self.ret, Exception):
                raise self.ret
            return self.ret
    for ret, exc in ((None, TypeError), (5, TypeError), ("dltensor", TypeError), (ValueError("boom"), ValueError)):
        with pytest.raises(exc):
            accel.from_dlpack(Bad(ret))
    for host in (np.zeros(3), np.zeros(3).__dlpack__(max_version=(1, 0))):
        with pytest.raises(BufferError, match="host memory"):
            accel.from_dlpack(host)
    gc.collect()
    assert _state() == before


def test_dlpack_during_a_capture_leaves_the_capture_valid(sim_cuda):
    """__dlpack__(stream=None) of a buffer last used in a capture made the legacy default stream
    wait for the capturing stream: CUDA invalidates the capture (cudaErrorStreamCaptureImplicit).
    Failed first: CaptureError from cudaStreamWaitEvent, and capture_end then found the capture
    invalidated.  Now refused before anything is queued; the capture goes on."""
    def refused(buf, s):
        for st in (None, 1):
            with pytest.raises(accel.CaptureError, match="capturing"):
                buf.__dlpack__(stream=st)
            with pytest.raises(accel.CaptureError, match="capturing"):
                buf.as_array(np.float32).__dlpack__(stream=st)
        buf.__dlpack__(stream=-1)
        buf.__dlpack__(stream=s)
        accel.from_dlpack(buf).close()
    for dev in (0, 1):
        with accel.device_index(dev):
            dlpack_inside_a_capture(refused)


# -- user kernels --------------------------------------------------------------------------------
_SRC = r'''extern "C" __global__ void k(float a, const float *x, float *y, unsigned long long n, int m, double d,
                                     unsigned int u, long long ll)
{ unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i] + m + d + u + ll; }'''
_PTX = None


def _ref(grid, block, view, a, x, y, n, m, d, u, ll):
    if n:
        ys = view(y, 4 * n, np.float32)
        ys[:] = np.float32(a) * view(x, 4 * n, np.float32) + ys + np.float32(m + d + u + ll)


@pytest.fixture
def kern(sim_cuda):
    global _PTX
    if _PTX is None:
        try:
            _PTX = accel.compile(_SRC).ptx
        except Exception as exc:        # no NVRTC here: the PTX NVRTC 12 writes for _SRC
            pytest.skip(f"NVRTC unavailable: {exc}")
    mod = accel.Module(_PTX, device=1)
    k = mod.function("k")
    sim.register_kernel("k", _ref, ", ".join(k.params))
    try:
        yield mod, k
    finally:
        sim.unregister_kernel("k")
        mod.close()


def test_launch_argument_matrix_on_the_non_current_device(kern):
    mod, k = kern
    assert k.params == ("f32", "u64", "u64", "u64", "u32", "f64", "u32", "u64")    # NVRTC: int is .u32
    x, y, x0 = accel.Buffer(64, device=1), accel.Buffer(64, device=1), accel.Buffer(64, device=0)
    x.copy_from(np.ones(16, np.float32))
    y.copy_from(np.zeros(16, np.float32))
    before = _state()
    accel.launch(k, 1, 16, 2.0, x, y, 16, 1, 0.5, 1, 1)
    accel.launch(k, (1,), (16, 1), np.float32(1), x.as_array(np.float32), y.as_array(np.float32, (8,), offset=32),
                 np.uint64(8), np.uint8(0), np.float32(0), np.uint32(0), 0)
    assert (y.to_numpy(np.float32) == [5.5] * 8 + [6.5] * 8).all()
    good = (1.0, x, y, 0, 0, 0.0, 0, 0)
    for i, value, exc, match in [
        (0, 1j, TypeError, "complex"), (0, "1", TypeError, "str"), (0, 1e39, ValueError, "float32 range"),
        (0, np.float64(1), TypeError, "without loss"), (1, x0, ValueError, "device 0"), (1, -1, ValueError, "range"),
        (1, 1 << 64, ValueError, "range"), (1, np.zeros(4, np.float32), TypeError, "ndarray"),
        (1, memoryview(b"1234"), TypeError, "memoryview"), (3, np.int64(1), TypeError, "without loss"),
        (4, np.bool_(True), TypeError, "bool"), (4, True, TypeError, "bool"), (5, 10 ** 400, ValueError, "too large"),
        (5, np.longdouble(1), TypeError, "without loss") if np.dtype(np.longdouble).itemsize > 8 else (5, "x", TypeError, "str"),
        (6, -1, ValueError, "range"), (6, 1.5, TypeError, "float"),
    ]:
        args = list(good)
        args[i] = value
        with pytest.raises(exc, match=match):
            accel.launch(k, 1, 1, *args)
    for grid, block, exc in [(0, 1, ValueError), (1, 0, ValueError), ((1, 0), 1, ValueError), ((), 1, TypeError),
                             ((1, 1, 1, 1), 1, TypeError), (1 << 31, 1, ValueError), (1, 1 << 20, ValueError),
                             (-1, 1, ValueError), (1.0, 1, TypeError), ([1], 1, TypeError), (True, 1, TypeError),
                             ((1, 65536), 1, ValueError), (1, (32, 32, 2), ValueError)]:
        with pytest.raises(exc):
            accel.launch(k, grid, block, *good)
    for smem, exc in [(-1, ValueError), (1.5, ValueError), (True, ValueError), (None, ValueError), (10 ** 9, ValueError)]:
        with pytest.raises(exc, match="shared_mem"):
            accel.launch(k, 1, 1, *good, shared_mem=smem)
    accel.launch(k, np.int64(2), np.int32(3), *good, shared_mem=np.int64(64 * 1024))     # opted in above 48 KiB
    with pytest.raises(TypeError, match="8 argument"):
        accel.launch(k, 1, 1, *good[:2])
    with pytest.raises(TypeError, match="8 argument"):
        accel.launch(k, 1, 1, *good, 0)
    with pytest.raises(ValueError, match="device 0"):
        accel.launch(k, 1, 1, *good, stream=accel.current_stream(0))
    with pytest.raises(TypeError, match="stream"):
        accel.launch(k, 1, 1, *good, stream=5)
    closed = accel.Stream(1)
    closed.close()
    with pytest.raises(RuntimeError, match="closed"):
        accel.launch(k, 1, 1, *good, stream=closed)
    gone = accel.Buffer(4, device=1)
    gone.close()
    with pytest.raises(RuntimeError, match="closed"):
        accel.launch(k, 1, 1, 1.0, gone, y, 0, 0, 0.0, 0, 0)
    accel.synchronize(1)
    assert _state() == before
    mod.close()
    with pytest.raises(ValueError, match="closed"):
        accel.launch(k, 1, 1, *good)
    with pytest.raises(ValueError, match="closed"):
        mod.function("k")


def test_launch_captured_on_the_non_current_device(kern):
    mod, k = kern
    x, y = accel.Buffer(64, device=1), accel.Buffer(64, device=1)
    x.copy_from(np.ones(16, np.float32))
    y.copy_from(np.zeros(16, np.float32))
    g, s = accel.Graph(), accel.Stream(1)
    with accel.graph(g, stream=s):
        accel.launch(k, 1, 16, 1.0, x, y, 16, 0, 0.0, 0, 0)
        accel.launch(k, 1, 16, 1.0, x, y, 16, 0, 0.0, 0, 0, stream=s)
    assert accel.current_device_index() == 0
    assert (y.to_numpy(np.float32) == 0).all()     # captured, not run
    g.replay()
    g.replay()
    accel.synchronize(1)
    assert (y.to_numpy(np.float32) == 4).all()


def _run(code: str):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**__import__("os").environ, "ACCEL_SIM": "cuda"}, timeout=60)


def test_malformed_cubin_or_fatbin_is_refused_without_a_crash():
    """cuModuleLoadData/cudaLibraryLoadData take no length: the driver sizes a cubin or a fatbin
    by its header.  A header claiming more bytes than the image has made the driver read past
    the image.  Failed first: the process died with SIGSEGV (rc -11) in the simulator's
    image_bytes.  accel knows the length: it refuses such an image before the driver sees it."""
    r = _run("""
        import struct, accel
        elf = bytearray(b"\\x7fELF\\x02\\x01\\x01" + bytes(57))
        struct.pack_into("<Q", elf, 0x28, 1 << 40)          # e_shoff far past the image
        struct.pack_into("<HH", elf, 0x3A, 64, 100)
        fat = struct.pack("<IHHQ", 0xBA55ED50, 1, 16, 1 << 40)   # fat_size far past the image
        for image in (b"\\x7fELF" + b"x" * 30, bytes(elf), fat, fat[:8], b"\\x7fELF"):
            try:
                accel.Module(image)
            except ValueError as exc:
                assert "image" in str(exc), exc
            else:
                raise AssertionError(f"loaded {image!r}")
        print("refused")
    """)
    assert r.returncode == 0 and "refused" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])
