"""accel.ArrayView (``Buffer.as_array``, issue 17 item 2): typed, strided views of a Buffer.

Bounds and alignment are checked when the view is made; ``to_numpy`` of strided views;
``copy_from`` from host arrays, other views, buffers, CAI and DLPack producers; the typed
``__cuda_array_interface__``; two devices; use after close; round trips through numpy.
"""

import gc
import weakref

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import accel
from accel import _dlpack

from conftest import SIMS, use_sim


def _filled(nbytes: int, dtype="uint8", device=None):
    """A buffer holding arange(n) of ``dtype`` and that array."""
    dt = np.dtype(dtype)
    host = np.arange(nbytes // dt.itemsize).astype(dt)
    buf = accel.Buffer(nbytes, device)
    buf.copy_from(host)
    return buf, host


# -- construction: dtype, shape, strides, bounds, alignment -------------------------------------
def test_default_shape_is_every_item_after_offset(sim_backend):
    buf = accel.Buffer(64)
    v = buf.as_array(np.float32)
    assert isinstance(v, accel.ArrayView)
    assert (v.shape, v.strides, v.offset, v.size, v.nbytes, v.itemsize, v.ndim) == ((16,), (4,), 0, 16, 64, 4, 1)
    assert v.dtype == np.dtype("float32") and v.buffer is buf and v.device == buf.device
    assert v.c_contiguous and len(v) == 16
    w = buf.as_array("int16", offset=10)
    assert w.shape == (27,) and w.ptr == buf.ptr + 10
    assert buf.as_array("u1", offset=64).shape == (0,)


def test_default_shape_needs_whole_items(sim_backend):
    buf = accel.Buffer(10)
    with pytest.raises(ValueError, match=r"10 bytes after offset 0 are not a whole number of float32"):
        buf.as_array(np.float32)
    with pytest.raises(ValueError, match="strides given without a shape"):
        buf.as_array("u1", strides=(1,))


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype="f4", shape=(17,)), r"reaches byte 68 but the buffer has 64 bytes"),
    (dict(dtype="f4", shape=(4, 4), offset=4), r"reaches byte 68"),
    (dict(dtype="f4", shape=(4, 2), strides=(20, 4)), r"reaches byte 68"),
    (dict(dtype="u1", offset=65), r"offset 65 is outside the buffer of 64 bytes"),
    (dict(dtype="u1", offset=-1), r"offset -1 is outside"),
    (dict(dtype="f4", shape=(2, -1)), r"shape\[1\] is -1"),
    (dict(dtype="f4", shape=(4,), strides=(-4,)), r"strides\[0\] is -4; negative strides are refused"),
    (dict(dtype="f4", shape=(4,), strides=(6,)), r"strides\[0\] is 6 bytes, not a multiple of the itemsize 4"),
    (dict(dtype="f4", shape=(4, 2), strides=(8,)), r"has 1 entries but shape \(4, 2\) has 2"),
    (dict(dtype="f4", shape=(2,), offset=2), r"offset 2 is not aligned for float32 \(alignment 4"),
    (dict(dtype="f8", shape=(2,), offset=4), r"offset 4 is not aligned for float64"),
])
def test_bad_views_are_refused_naming_the_value(sim_backend, kwargs, match):
    buf = accel.Buffer(64)
    with pytest.raises(ValueError, match=match):
        buf.as_array(**kwargs)


@pytest.mark.parametrize("dtype, match", [
    (object, "Python object references"),
    (str, r"no fixed size \(itemsize 0\)"),
    (np.dtype([("a", "f4"), ("b", "O")]), "Python object references"),
    (np.dtype(("f4", (3,))), "sub-array dtype"),
    ("not-a-dtype", "pass a numpy dtype"),
])
def test_bad_dtypes(sim_backend, dtype, match):
    with pytest.raises(TypeError, match=match):
        accel.Buffer(64).as_array(dtype)


def test_shape_and_offset_types(sim_backend):
    buf = accel.Buffer(64)
    assert buf.as_array("u1", np.int64(8), offset=np.int32(8)).shape == (8,)
    with pytest.raises(TypeError, match="bool"):
        buf.as_array("u1", (True,))
    with pytest.raises(TypeError, match=r"shape\[0\] must be an int, got float"):
        buf.as_array("u1", (2.0,))
    with pytest.raises(TypeError, match="ArrayView needs an accel.Buffer"):
        accel.ArrayView(bytearray(8), "u1")


def test_alignment_of_the_address(sim_backend):
    buf = accel.Buffer(64)
    assert buf.ptr % 256 == 0        # the allocator hands out aligned blocks
    c = buf.as_array("c8", (2,), offset=4)     # complex64: 4-byte alignment
    assert c.ptr % 4 == 0
    with pytest.raises(ValueError, match="not aligned for complex128"):
        buf.as_array("c16", (2,), offset=4)
    packed = np.dtype([("a", "u1"), ("b", "<i4")])       # packed structure: alignment 1
    assert buf.as_array(packed, (3,), offset=1).itemsize == 5


def test_every_element_in_bounds_and_empty_views(sim_backend):
    buf = accel.Buffer(64)
    v = buf.as_array("f4", (4, 4), strides=(16, 4))
    assert v.c_contiguous and v.nbytes == 64
    corner = buf.as_array("f4", (2, 2), strides=(32, 4), offset=24)     # last byte 24+32+4+4-1 = 63
    assert corner.shape == (2, 2)
    empty = buf.as_array("f4", (0, 1000), strides=(4000, 4))            # no element: no byte touched
    assert empty.size == 0 and empty.to_numpy().shape == (0, 1000)
    zero = accel.Buffer(0).as_array("f8")
    assert zero.shape == (0,) and zero.to_numpy().shape == (0,)
    with pytest.raises(TypeError, match="0-d"):
        len(buf.as_array("f4", ()))
    assert buf.as_array("f4", ()).size == 1


# -- to_numpy / copy_from ------------------------------------------------------------------------
def test_to_numpy_of_strided_views(sim_backend):
    buf, host = _filled(4 * 64, "float32")
    grid = host.reshape(8, 8)
    cases = [
        (dict(shape=(8, 4), strides=(32, 8)), grid[:, ::2]),
        (dict(shape=(3, 8), strides=(64, 4), offset=32), grid[1::2][:3]),
        (dict(shape=(8, 8), strides=(4, 32)), grid.T),
        (dict(shape=(4, 3), strides=(0, 4), offset=8), np.broadcast_to(host[2:5], (4, 3))),
        (dict(shape=(2, 2, 2), strides=(128, 32, 4), offset=4), grid.reshape(2, 4, 8)[:, ::1][:, :2, 1:3]),
    ]
    for kwargs, want in cases:
        v = buf.as_array(np.float32, **kwargs)
        got = v.to_numpy()
        assert got.dtype == np.float32 and got.shape == want.shape and got.flags.c_contiguous
        np.testing.assert_array_equal(got, want, err_msg=str(kwargs))


def test_round_trip_through_numpy(sim_backend):
    rng = np.random.default_rng(7)
    buf = accel.Buffer(4096)
    for dtype in ("u1", "i2", "<u4", "f4", "f8", "c8", "c16", "?", "M8[s]", np.dtype([("x", "f4"), ("n", "i4")])):
        dt = np.dtype(dtype)
        n = 4096 // dt.itemsize // 2
        data = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8).view(dt)
        if dt.kind == "b":
            data = data.astype(bool)
        v = buf.as_array(dt, (n,), offset=dt.itemsize * 3)
        assert v.copy_from(data) is v
        back = v.to_numpy()
        assert back.dtype == dt
        assert back.tobytes() == data.tobytes(), dt


def test_copy_into_a_strided_view_leaves_the_gaps(sim_backend):
    buf, host = _filled(4 * 64, "int32")
    v = buf.as_array("i4", (8, 3), strides=(32, 8), offset=4)      # columns 1, 3, 5 of an 8x8 grid
    new = -np.arange(24, dtype=np.int32).reshape(8, 3)
    v.copy_from(new)
    want = host.reshape(8, 8).copy()
    want[:, 1:7:2] = new
    np.testing.assert_array_equal(buf.to_numpy("i4", (8, 8)), want)
    np.testing.assert_array_equal(v.to_numpy(), new)


def test_copy_from_device_sources(sim_backend):
    src_buf, host = _filled(256, "float32")
    dst_buf = accel.Buffer(512)
    dst_buf.fill_(0)
    grid = host.reshape(8, 8)
    dst = dst_buf.as_array("f4", (8, 8), strides=(64, 4))          # rows 64 bytes apart: half the buffer
    dst.copy_from(accel.ArrayView(src_buf, "f4", (8, 8), (4, 32)))         # a transpose
    np.testing.assert_array_equal(dst.to_numpy(), grid.T)
    np.testing.assert_array_equal(dst_buf.to_numpy("f4", (8, 16))[:, 8:], 0)
    # an untyped Buffer is taken as raw bytes
    flat = dst_buf.as_array("f4", (64,), offset=256)
    flat.copy_from(src_buf)
    np.testing.assert_array_equal(flat.to_numpy(), host)
    with pytest.raises(ValueError, match="source buffer has 256 bytes, the view 252"):
        dst_buf.as_array("f4", (63,)).copy_from(src_buf)
    # and bytes-like host objects too
    flat.copy_from(bytes(256))
    assert not flat.to_numpy().any()


def test_copy_from_checks_shape_dtype_and_overlap(sim_backend):
    buf, host = _filled(256, "float32")
    v = buf.as_array("f4", (8, 8))
    with pytest.raises(ValueError, match=r"source array has shape \(64,\), the view \(8, 8\)"):
        v.copy_from(host)
    with pytest.raises(TypeError, match=r"dtype float64, the view float32.*astype\('float32'\)"):
        v.copy_from(host.reshape(8, 8).astype(np.float64))
    with pytest.raises(TypeError, match="numpy.asarray"):
        v.copy_from([[0.0] * 8] * 8)
    with pytest.raises(ValueError, match="elements overlap"):
        buf.as_array("f4", (4, 4), strides=(0, 4)).copy_from(np.zeros((4, 4), np.float32))
    with pytest.raises(ValueError, match=r"overlaps the destination \(bytes .*\) in device memory"):
        buf.as_array("f4", (32,), offset=4).copy_from(buf.as_array("f4", (32,)))
    # interleaved views of one buffer whose spans overlap are refused too (copies run in order)
    with pytest.raises(ValueError, match="overlaps"):
        buf.as_array("f4", (32,), (8,)).copy_from(buf.as_array("f4", (32,), (8,), offset=4))
    np.testing.assert_array_equal(v.to_numpy().ravel(), host)       # nothing was written


def test_nested_non_overlapping_layout_is_writable(sim_backend):
    # strides (8, 12) for shape (3, 2) of 4-byte items: offsets 0 12 8 20 16 28, no shared byte
    buf = accel.Buffer(64)
    buf.fill_(0)
    v = buf.as_array("u4", (3, 2), strides=(8, 12))
    v.copy_from(np.arange(1, 7, dtype=np.uint32).reshape(3, 2))
    np.testing.assert_array_equal(v.to_numpy(), np.arange(1, 7).reshape(3, 2))


def test_many_short_runs_go_through_the_host(sim_backend, monkeypatch):
    from accel import _array
    monkeypatch.setattr(_array, "_MAX_COPIES", 16)
    src_buf, host = _filled(4 * 32 * 32, "float32")
    dst = accel.Buffer(src_buf.nbytes).as_array("f4", (32, 32))
    dst.copy_from(src_buf.as_array("f4", (32, 32), (4, 128)))          # 1024 one-element runs
    np.testing.assert_array_equal(dst.to_numpy(), host.reshape(32, 32).T)
    strided = accel.Buffer(2 * src_buf.nbytes).as_array("f4", (32, 32), (256, 8))
    with pytest.raises(ValueError, match=r"runs of 4 bytes, which would take 1024 separate copies"):
        strided.copy_from(np.zeros((32, 32), np.float32))


def test_a_refused_copy_changes_nothing(sim_backend):
    buf, host = _filled(256, "float32")
    other = accel.Buffer(128)
    side = accel.Stream()
    before = buf.last_stream
    v = buf.as_array("f4", (8, 8))
    for bad in (np.zeros(64, np.float32), np.zeros((8, 8), np.float64), buf.as_array("f4", (8, 8)), other,
                other.as_array("f4", (8, 4))):
        with pytest.raises((ValueError, TypeError)):
            v.copy_from(bad, stream=side)
    assert buf.last_stream == before and other.last_stream == other.stream
    np.testing.assert_array_equal(v.to_numpy().ravel(), host)


def test_device_copies_between_views_are_captured(sim_graph_backend):
    src_buf, host = _filled(256, "float32")
    dst_buf = accel.Buffer(256)
    dst_buf.fill_(0)
    src = src_buf.as_array("f4", (8, 8), (4, 32))
    dst = dst_buf.as_array("f4", (8, 8))
    s = accel.Stream()
    g = accel.Graph()
    with s, g:
        dst.copy_from(src)
        with pytest.raises(accel.CaptureError, match="graph capture"):
            dst.copy_from(np.zeros((8, 8), np.float32))      # host copies are refused, capture intact
        with pytest.raises(accel.CaptureError, match="graph capture"):
            src.to_numpy()
    assert not dst.to_numpy().any()                          # captured, not run
    g.replay()
    np.testing.assert_array_equal(dst.to_numpy(), host.reshape(8, 8).T)


def test_a_buffer_copies_from_a_contiguous_view_as_from_a_buffer(sim_graph_backend):
    """Buffer.copy_from(view) of accel's own C-contiguous view is a device copy of the view's
    span, captured like a Buffer copy (it was taken as another library's array, whose producer
    stream is synchronized: a capture broke, cudaErrorStreamCaptureIsolation on CUDA)."""
    dev = accel.device_count() - 1                     # the non-current device
    src_buf, host = _filled(4096, "float32", dev)
    out = accel.Buffer(1024, dev)
    out.fill_(0)
    view = src_buf.as_array("f4", (256,), offset=1024)   # elements 256..511
    s = accel.Stream(dev)
    g = accel.Graph()
    with accel.graph(g, stream=s):
        out.copy_from(view, non_blocking=True)
    assert not out.to_numpy(np.float32).any()          # captured, not run
    g.replay()
    np.testing.assert_array_equal(out.to_numpy(np.float32), host[256:512])
    out.fill_(0)
    out.copy_from(view)                                # and outside a capture
    np.testing.assert_array_equal(out.to_numpy(np.float32), host[256:512])
    with pytest.raises(ValueError, match="source view has 1020 bytes, destination 1024"):
        out.copy_from(src_buf.as_array("f4", (255,)))
    assert src_buf.copy_from(src_buf.as_array("f4")) is src_buf     # its own bytes: nothing to copy
    np.testing.assert_array_equal(src_buf.to_numpy(np.float32), host)
    src_buf.close()
    with pytest.raises(RuntimeError, match="was closed"):
        out.copy_from(view)


def test_read_only_imports_are_not_written(sim_backend):
    buf, host = _filled(64, "float32")
    kind, index = buf.__dlpack_device__()
    capsule = _dlpack.export(buf, buf.ptr, kind, index, np.float32, (16,), None, 0, versioned=True, readonly=True)
    alias = accel.from_dlpack(capsule)
    view = alias.as_array("f4", (4, 4))
    with pytest.raises(ValueError, match="read-only"):
        view.copy_from(np.zeros((4, 4), np.float32))
    np.testing.assert_array_equal(view.to_numpy().ravel(), host)
    if sim_backend == "cuda":
        assert view.__cuda_array_interface__["data"] == (buf.ptr, True)
    alias.close()


_ITEM = st.sampled_from(["u1", "i2", "f4", "f8", "c16"])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=_ITEM, data=st.data())
def test_views_match_numpy_as_strided(sim_cuda, dtype, data):
    """A view exists exactly when every element is inside the buffer, and reads what numpy's
    as_strided reads over the same bytes; a copy into it writes exactly its elements."""
    dt = np.dtype(dtype)
    nbytes = 256
    ndim = data.draw(st.integers(0, 3))
    shape = tuple(data.draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
    strides = tuple(dt.itemsize * k for k in data.draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    offset = dt.itemsize * data.draw(st.integers(0, 40))
    span = 0 if 0 in shape else sum((n - 1) * s for n, s in zip(shape, strides)) + dt.itemsize
    host = np.random.default_rng(len(shape)).integers(0, 256, nbytes, dtype=np.uint8)
    buf = accel.Buffer(nbytes).copy_from(host)
    if offset > nbytes or offset + span > nbytes:
        with pytest.raises(ValueError, match="outside the buffer|reaches byte"):
            buf.as_array(dt, shape, strides, offset)
        return
    view = buf.as_array(dt, shape, strides, offset)
    want = np.lib.stride_tricks.as_strided(host[offset:].view(np.uint8), shape=shape + (dt.itemsize,),
                                           strides=strides + (1,))
    got = view.to_numpy()
    assert got.shape == shape and got.dtype == dt
    assert got.tobytes() == np.ascontiguousarray(want).tobytes()
    offsets = [offset + sum(i * s for i, s in zip(idx, strides)) for idx in np.ndindex(*shape)]
    overlapping = any(abs(a - b) < dt.itemsize for k, a in enumerate(offsets) for b in offsets[k + 1:])
    new = np.random.default_rng(1).integers(0, 256, view.nbytes, dtype=np.uint8).view(dt).reshape(shape)
    if overlapping:
        with pytest.raises(ValueError, match="elements overlap"):
            view.copy_from(new)
        return
    view.copy_from(new)
    expect = host.copy()
    for o, item in zip(offsets, new.reshape(-1).view(np.uint8).reshape(-1, dt.itemsize)):
        expect[o:o + dt.itemsize] = item
    np.testing.assert_array_equal(buf.to_numpy(), expect)


# -- interop -------------------------------------------------------------------------------------
def test_cuda_array_interface_is_typed(sim_cuda):
    buf = accel.Buffer(256)
    v = buf.as_array("<f8", (4, 2), strides=(32, 8), offset=16)
    cai = v.__cuda_array_interface__
    assert cai == {"shape": (4, 2), "typestr": "<f8", "data": (buf.ptr + 16, False), "strides": (32, 8),
                   "version": 3, "stream": buf.__cuda_array_interface__["stream"]}
    c = buf.as_array(">i4", (2, 3)).__cuda_array_interface__
    assert c["typestr"] == ">i4" and c["strides"] is None and c["data"][0] == buf.ptr
    rec = np.dtype([("x", "<f4"), ("n", "<i2")])
    r = buf.as_array(rec, (4,)).__cuda_array_interface__
    assert r["typestr"] == rec.str and r["descr"] == rec.descr


def test_cuda_array_interface_stream_follows_the_buffer(sim_cuda):
    buf = accel.Buffer(64)
    s = accel.Stream()
    v = buf.as_array("u1")
    with s:
        assert v.__cuda_array_interface__["stream"] == buf.__cuda_array_interface__["stream"]
        buf.fill_(1)
        assert v.__cuda_array_interface__["stream"] == buf.__cuda_array_interface__["stream"]
    assert v.__cuda_array_interface__["stream"] == buf.__cuda_array_interface__["stream"]


def test_no_cuda_array_interface_elsewhere(sim_backend):
    v = accel.Buffer(64).as_array("f4")
    assert hasattr(v, "__cuda_array_interface__") == (sim_backend == "cuda")


class _CAIOnly:
    """A foreign producer exposing only ``__cuda_array_interface__`` (as Numba's device arrays)."""

    def __init__(self, cai):
        self.__cuda_array_interface__ = cai


class _DLPackOnly:
    """A foreign producer exposing only the DLPack protocol (as JAX arrays)."""

    def __init__(self, obj):
        self._obj = obj
        self.streams = []

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.streams.append(stream)
        return self._obj.__dlpack__(stream=stream, max_version=max_version)

    def __dlpack_device__(self):
        return self._obj.__dlpack_device__()


def test_copy_from_a_cuda_array_interface_producer(sim_cuda):
    src_buf, host = _filled(256, "int32")
    dst = accel.Buffer(256).as_array("i4", (8, 8))
    producer = accel.Stream()
    cai = src_buf.as_array("i4", (8, 8), (4, 32)).__cuda_array_interface__
    cai["stream"] = producer.handle            # the consumer must order after the producer's stream
    dst.copy_from(_CAIOnly(cai))
    np.testing.assert_array_equal(dst.to_numpy(), host.reshape(8, 8).T)
    cai["stream"] = 0
    with pytest.raises(ValueError, match="stream 0 is invalid"):
        dst.copy_from(_CAIOnly(cai))
    cai["stream"] = None
    cai["typestr"] = "<f4"
    with pytest.raises(TypeError, match="dtype float32, the view int32"):
        dst.copy_from(_CAIOnly(cai))


def test_copy_from_a_dlpack_producer(sim_backend):
    src_buf, host = _filled(256, "int32")
    dst = accel.Buffer(256).as_array("i4", (8, 8))
    producer = _DLPackOnly(src_buf.as_array("i4", (8, 8), (4, 32)))
    before = _dlpack.live_exports()
    dst.copy_from(producer)
    np.testing.assert_array_equal(dst.to_numpy(), host.reshape(8, 8).T)
    assert _dlpack.live_exports() == before          # the capsule's deleter ran
    if sim_backend == "cuda":
        handle = accel.current_stream().handle
        assert producer.streams == [handle if handle else 1]


def test_copy_from_a_host_dlpack_producer_copies_from_host(sim_backend):
    dst = accel.Buffer(64).as_array("f4", (4, 4))
    host = np.arange(16, dtype=np.float32).reshape(4, 4)
    dst.copy_from(_DLPackOnly(host))
    np.testing.assert_array_equal(dst.to_numpy(), host)


def test_dlpack_capsule_of_a_strided_view(sim_backend):
    buf, host = _filled(256, "float32")
    v = buf.as_array("f4", (4, 3), strides=(32, 8), offset=8)
    kind, index = v.__dlpack_device__()
    assert (kind, index) == buf.__dlpack_device__()
    for versioned in (False, True):
        before = _dlpack.live_exports()
        capsule = v.__dlpack__(max_version=(1, 0) if versioned else None)
        info = _dlpack.parse(capsule)
        assert info.versioned == versioned
        assert accel._lazy.lazy_init().dlpack_address(info.data, info.byte_offset) == buf.ptr + 8
        assert (info.device_type, info.device_id) == (kind, index)
        assert (info.code, info.bits, info.lanes) == (2, 32, 1)
        assert info.shape == (4, 3) and info.strides == (8, 2)
        assert _dlpack.live_exports() == before + 1
        del capsule, info                              # dropped unconsumed: the deleter runs once
        gc.collect()
        assert _dlpack.live_exports() == before
    copied = _dlpack.parse(v.__dlpack__(copy=True, max_version=(1, 0)))     # a device copy (r80b), C order
    assert copied.shape == (4, 3) and copied.strides in (None, (3, 1)) and copied.data != v.ptr
    assert copied.flags & _dlpack.FLAG_IS_COPIED
    del copied
    with pytest.raises(BufferError, match="DLPack cannot describe"):
        buf.as_array(np.dtype([("x", "f4")]), (4,)).__dlpack__()


def test_from_dlpack_of_a_view_shares_memory(sim_backend):
    buf, host = _filled(256, "int32")
    v = buf.as_array("i4", (16,), offset=64)
    alias = accel.from_dlpack(v)
    assert alias.ptr == v.ptr and alias.nbytes == 64
    alias.fill_(0)
    np.testing.assert_array_equal(buf.to_numpy("i4"), np.concatenate([host[:16], np.zeros(16), host[32:]]))
    alias.close()


# -- lifetime, devices ---------------------------------------------------------------------------
def test_view_keeps_the_buffer_alive(sim_backend):
    buf, host = _filled(64, "uint8")
    v = buf.as_array("u1", (8, 8))
    ref = weakref.ref(buf)
    del buf
    gc.collect()
    assert ref() is not None
    np.testing.assert_array_equal(v.to_numpy().ravel(), host)
    del v
    gc.collect()
    assert ref() is None


def test_use_after_close(sim_backend):
    buf = accel.Buffer(64)
    v = buf.as_array("f4", (4, 4))
    buf.close()
    assert not hasattr(v, "__cuda_array_interface__")
    assert "closed" in repr(v)
    with pytest.raises(RuntimeError, match="was closed"):
        v.to_numpy()
    with pytest.raises(RuntimeError, match="was closed"):
        v.copy_from(np.zeros((4, 4), np.float32))
    with pytest.raises(RuntimeError, match="was closed"):
        v.ptr
    with pytest.raises(RuntimeError, match="was closed"):
        v.__dlpack__()
    with pytest.raises(RuntimeError, match="was closed"):
        buf.as_array("f4")
    with pytest.raises(RuntimeError, match="was closed"):
        accel.Buffer(64).as_array("f4").copy_from(v)


@pytest.fixture(params=SIMS)
def two_devices(request, monkeypatch):
    kind = use_sim(monkeypatch, request.param, ACCEL_SIM_DELAY_US=100)
    if accel.device_count() < 2:
        pytest.skip(f"{kind}: the simulated runtime exposes {accel.device_count()} device")
    return kind


def test_views_on_the_other_device(two_devices):
    accel.set_device_index(0)
    buf, host = _filled(4 * 64, "float32", device=1)
    v = buf.as_array("f4", (8, 4), strides=(32, 8))
    assert v.device == accel.device(two_devices, 1)
    np.testing.assert_array_equal(v.to_numpy(), host.reshape(8, 8)[:, ::2])
    v.copy_from(np.full((8, 4), -1, np.float32))
    other = accel.Buffer(4 * 64, 1).as_array("f4", (8, 8))
    other.copy_from(buf.as_array("f4", (8, 8)))
    want = host.reshape(8, 8).copy()
    want[:, ::2] = -1
    np.testing.assert_array_equal(other.to_numpy(), want)
    if two_devices == "cuda":
        cai = v.__cuda_array_interface__
        assert cai["data"][0] == buf.ptr and cai["stream"] == buf.__cuda_array_interface__["stream"]
    assert v.__dlpack_device__()[1] == 1
    here = accel.Buffer(4 * 64, 0).as_array("f4", (8, 8))
    with pytest.raises(ValueError, match=r"source view is on .*:1, the view on .*:0"):
        here.copy_from(other)
    assert accel.current_device_index() == 0


def test_repr_and_public_name(sim_backend):
    v = accel.Buffer(64).as_array("f4", (4, 2), strides=(16, 4), offset=0)
    assert "shape=(4, 2)" in repr(v) and "strides=(16, 4)" in repr(v) and "float32" in repr(v)
    assert "ArrayView" in accel.__all__


def test_torch_without_cuda_refuses_a_view_cleanly(sim_cuda):
    """torch (CPU build) cannot take CUDA memory: it raises, and the capsule it was handed is
    released (no export left alive).  With a CUDA build it would share the memory."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if torch.cuda.is_available():
        pytest.skip("torch has CUDA here: it would consume the simulated device pointer")
    v = accel.Buffer(256).as_array("f4", (8, 4), strides=(32, 8))
    before = _dlpack.live_exports()
    with pytest.raises(Exception, match="CUDA"):
        torch.from_dlpack(v)
    gc.collect()
    assert _dlpack.live_exports() == before


def test_array_view_pickle_refusal_names_the_view_and_deepcopy_copies(sim_backend):
    """Pickling an ArrayView is refused naming the view and what to pickle instead (it said
    'accel.Buffer' and buf.to_numpy()); copy.deepcopy gives a view of a new Buffer with the same
    values."""
    import copy
    import pickle
    buf = accel.Buffer(64, device=accel.device_count() - 1)
    view = buf.as_array("float32", shape=(4,), offset=16)
    view.copy_from(np.arange(4, dtype=np.float32))
    with pytest.raises(TypeError, match=r"accel\.ArrayView.*view\.to_numpy\(\)"):
        pickle.dumps(view)
    twin = copy.deepcopy(view)
    assert twin.buffer is not buf and twin.buffer.device_index == buf.device_index
    assert (twin.to_numpy() == np.arange(4, dtype=np.float32)).all()
