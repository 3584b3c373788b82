"""Adversarial reliability of the interop layer (task r1_interop): DLPack capsules made and
taken, typed views, ``__cuda_array_interface__``, foreign streams and the DLPack stream
handshake, fed the values a hostile caller or a broken producer gives.  Each test pins a bug
that was found here: a clear Python exception naming the bad value, state unchanged, no crash,
no leak."""

import pytest

import accel
from accel import _dlpack

_INT64_MAX = (1 << 63) - 1


class CAI:
    """A minimal __cuda_array_interface__ v3 producer (as CuPy or Numba export)."""

    def __init__(self, ptr, shape=(16,), typestr="<f4", stream=None):
        self.ptr, self.shape, self.typestr, self.stream = ptr, shape, typestr, stream

    @property
    def __cuda_array_interface__(self):
        cai = {"shape": self.shape, "typestr": self.typestr, "data": (self.ptr, False), "version": 3,
               "strides": None}
        if self.stream is not None:
            cai["stream"] = self.stream
        return cai


class Proto:
    """Only the CUDA stream protocol (cuda.core / CuPy streams)."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


class Lying:
    """A DLPack producer whose capsule describes other memory than its device says (a broken
    or hostile producer): ``edit(managed_tensor)`` rewrites accel's own capsule."""

    def __init__(self, buf, edit):
        self.buf, self.edit = buf, edit

    def __dlpack_device__(self):
        return self.buf.__dlpack_device__()

    def __dlpack__(self, stream=None, max_version=None, **kw):
        capsule = self.buf.__dlpack__(max_version=(1, 0))
        info = _dlpack.parse(capsule)
        self.edit(_dlpack.DLManagedTensorVersioned.from_address(info.address).dl_tensor)
        return capsule


def _allocated(index=0):
    return accel.memory.memory_allocated(index)


# -- typed views: sizes DLPack's int64 cannot hold ------------------------------------------------
@pytest.mark.parametrize("shape, strides", [((1 << 63,), (0,)), ((1 << 64,), (0,)), ((1 << 62, 1 << 62), (0, 0)),
                                            ((1 << 61,), (0,))])
def test_view_larger_than_int64_bytes_is_refused(sim_backend, shape, strides):
    """A broadcast view (stride 0) of 2**63 elements or more used to be made and exported: its
    DLPack capsule then said shape (-2**63,) (ctypes wraps int64 silently)."""
    buf = accel.Buffer(64)
    with pytest.raises(ValueError, match=r"as_array: .*shape .* (bytes|elements)"):
        buf.as_array("f4", shape=shape, strides=strides)
    assert _dlpack.live_exports() == 0


def test_largest_broadcast_view_exports_its_true_shape(sim_cuda):
    buf = accel.Buffer(64)
    n = _INT64_MAX // 4
    view = buf.as_array("f4", shape=(n,), strides=(0,))
    info = _dlpack.parse(view.__dlpack__())
    assert info.shape == (n,) and info.strides == (0,)


def test_export_refuses_extents_outside_int64(sim_cuda):
    buf = accel.Buffer(64)
    for shape, strides in (((1 << 63,), None), ((4,), (1 << 63,)), ((4,), (-(1 << 63) - 1,))):
        with pytest.raises(ValueError, match="int64"):
            _dlpack.export(buf, buf.ptr, 2, 0, "uint8", shape, strides, 0, versioned=True)
    assert _dlpack.live_exports() == 0


