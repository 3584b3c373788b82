"""Round r58: PyTorch tests TORCH_PORTS.md had never considered, ported to accel.

From test/test_dlpack.py (TestTorchDlPack: DLPack export/import, the stream handshake, versions,
dl_device/copy), test/test_numba_integration.py (the CUDA array interface) and
test/test_cuda_nvml_based_avail.py (counting devices leaves a later fork usable).  Conventions as
the other ports (tests/TORCH_PORTS.md): tensors are ``accel.Buffer``s or typed views of them
(``Buffer.as_array``), ``torch.from_dlpack`` is ``accel.from_dlpack`` (a non-owning Buffer, no
dtype: values are compared through ``to_numpy``), ``torch.cuda._sleep`` is ``torch_port_util.hold``.
Tests are named ``test_<torch file>__<torch test>``; torch's device-generic tests run on every
simulator and on devices 0 and 1.  The section "Round r58 additions" of TORCH_PORTS.md lists
what was not ported and why.
"""

import numpy as np
import pytest

import accel
from accel import _dlpack
from accel._dlpack import DLDeviceType

from conftest import run_forked, use_sim
from torch_port_util import hold

DTYPES = (np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8, np.uint8,
          np.uint16, np.uint32, np.uint64, np.complex64, np.complex128, np.bool_)
DEVICES = (0, 1)


@pytest.fixture
def sim_cuda_delayed(monkeypatch):
    """CUDA simulator whose stream operations run on the streams' worker threads (holdable)."""
    return use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=1)


def _values(dtype, n=5):
    """torch's make_tensor((n,), dtype): some values of ``dtype`` (not all zero)."""
    rng = np.random.default_rng(58)
    if dtype is np.bool_:
        return rng.integers(0, 2, n).astype(np.bool_)
    if np.issubdtype(dtype, np.complexfloating):
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype)
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(n).astype(dtype)
    return rng.integers(1, 100, n).astype(dtype)


def _need(device):
    """Skip device 1 where the simulator has one device (Metal)."""
    if device >= accel.device_count():
        pytest.skip(f"{accel.current_accelerator()} has {accel.device_count()} device(s)")


def _tensor(values, device):
    """A device array holding ``values``: a typed view of a new Buffer on ``device``."""
    buf = accel.Buffer(values.nbytes, device=device)
    buf.copy_from(np.ascontiguousarray(values))
    return buf.as_array(values.dtype, values.shape)


def _read(buffer, dtype, shape):
    return buffer.to_numpy().view(dtype).reshape(shape)


class _DLPackOnly:
    """torch's TensorDLPackWrapper: only __dlpack__ and __dlpack_device__ (no CAI, no buffer)."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __dlpack__(self, *args, **kwargs):
        return self.tensor.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self, *args, **kwargs):
        return self.tensor.__dlpack_device__(*args, **kwargs)


# ------------------------------------------------------------------ test_dlpack.py
@pytest.mark.parametrize("device", DEVICES)
def test_dlpack__test_dlpack_capsule_conversion(sim_backend, device):
    # from_dlpack(to_dlpack(x)): to_dlpack is x.__dlpack__() (the legacy capsule)
    _need(device)
    for dtype in DTYPES:
        x = _tensor(_values(dtype), device)
        z = accel.from_dlpack(x.__dlpack__())
        assert z.device_index == device and z.ptr == x.ptr and z.nbytes == x.nbytes
        np.testing.assert_array_equal(_read(z, dtype, (5,)), x.to_numpy())


@pytest.mark.parametrize("device", DEVICES)
def test_dlpack__test_dlpack_protocol_conversion(sim_backend, device):
    _need(device)
    for dtype in DTYPES:
        x = _tensor(_values(dtype), device)
        z = accel.from_dlpack(x)
        assert z.device_index == device and z.ptr == x.ptr
        np.testing.assert_array_equal(_read(z, dtype, (5,)), x.to_numpy())


@pytest.mark.parametrize("device", DEVICES)
def test_dlpack__test_dlpack_shared_storage(sim_backend, device):
    _need(device)
    x = _tensor(_values(np.float64), device)
    z = accel.from_dlpack(x.__dlpack__())
    host = _read(z, np.float64, (5,)).copy()
    host[0] += 20.0
    z.copy_from(host)                                  # z[0] = z[0] + 20.0
    np.testing.assert_array_equal(x.to_numpy(), host)  # x sees it: the same memory


@pytest.mark.parametrize("device", DEVICES)
def test_dlpack__test_from_dlpack_dtype(sim_backend, device):
    # torch.from_dlpack keeps the dtype: the capsule carries it (accel's Buffer is bytes)
    _need(device)
    for dtype in DTYPES:
        x = _tensor(_values(dtype), device)
        info = _dlpack.parse(x.__dlpack__(max_version=(1, 0)))
        assert (info.code, info.bits, info.lanes) == _dlpack.dl_dtype(np.dtype(dtype)), dtype
        assert info.shape == (5,) and info.device_id == device
        np.testing.assert_array_equal(_read(accel.from_dlpack(x), dtype, (5,)), x.to_numpy())


@pytest.mark.parametrize("device", DEVICES)
def test_dlpack__test_from_dlpack_noncontinguous(sim_backend, device):
    _need(device)
    base = _values(np.float32, 25)
    buf = accel.Buffer(base.nbytes, device=device).copy_from(base)
    host = base.reshape(5, 5)
    item = 4
    views = {                       # torch's x[0], x[:, 0], x[1, :], x[1], x.t()
        "x[0]": (buf.as_array(np.float32, (5,), (item,), 0), host[0]),
        "x[:, 0]": (buf.as_array(np.float32, (5,), (5 * item,), 0), host[:, 0]),
        "x[1, :]": (buf.as_array(np.float32, (5,), (item,), 5 * item), host[1, :]),
        "x.t()": (buf.as_array(np.float32, (5, 5), (item, 5 * item), 0), host.T),
    }
    for name, (view, expected) in views.items():
        info = _dlpack.parse(view.__dlpack__(max_version=(1, 0)))
        elem = None if info.strides is None else tuple(s * item for s in info.strides)
        z = accel.from_dlpack(view)          # the span from the lowest to the highest element
        assert z.ptr == view.ptr, name
        got = np.lib.stride_tricks.as_strided(z.to_numpy().view(np.float32), expected.shape,
                                              elem or view.strides)
        np.testing.assert_array_equal(got, expected, err_msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_dlpack__test_dlpack_conversion_with_streams(sim_cuda_delayed, device):
    # x is produced on `stream`; the consumer's current stream must wait for it (no explicit
    # sync).  Device 1 while device 0 is current: from_dlpack passes device 1's current stream
    values = _values(np.float32)
    src = _tensor(values, device)._buffer
    stream = accel.Stream(device)
    gate = hold(stream)
    try:
        x = accel.Buffer(values.nbytes, device=device)
        x.copy_from(src, stream=stream, non_blocking=True)   # behind the held operation
        consumer = accel.Stream(device)
        accel.set_stream(consumer)      # current on its device; device 0 stays the current device
        accel.set_device_index(0)
        z = accel.from_dlpack(x.as_array(np.float32))
        assert not consumer.query(), "the consumer's stream does not wait for the producer's"
    finally:
        gate.set()
        accel.set_stream(accel.default_stream(device))
        accel.set_device_index(0)
    consumer.synchronize()
    np.testing.assert_array_equal(_read(z, np.float32, (5,)), values)


@pytest.mark.parametrize("device", DEVICES)
def test_dlpack__test_dlpack_conversion_with_diff_streams(sim_cuda_delayed, device):
    values = _values(np.float32)
    src = _tensor(values, device)._buffer
    stream_a, stream_b = accel.Stream(device), accel.Stream(device)
    gate = hold(stream_a)
    try:
        with stream_a:
            x = accel.Buffer(values.nbytes, device=device)
            x.copy_from(src, non_blocking=True)    # on stream_a, behind the held operation
            capsule = x.as_array(np.float32).__dlpack__(stream=stream_b.handle)
        assert not stream_b.query(), "stream_b (the consumer's) does not wait for stream_a"
    finally:
        gate.set()
    stream_a.synchronize()
    stream_b.synchronize()
    z = accel.from_dlpack(capsule)
    np.testing.assert_array_equal(_read(z, np.float32, (5,)), values)


@pytest.mark.parametrize("device", DEVICES)
def test_dlpack__test_dlpack_default_stream(sim_cuda, device):
    seen = []

    class DLPackTensor:
        def __init__(self, tensor):
            self.tensor = tensor

        def __dlpack_device__(self):
            return self.tensor.__dlpack_device__()

        def __dlpack__(self, stream=None, **kwargs):
            seen.append(stream)
            return self.tensor.__dlpack__(stream=stream, **kwargs)

    with accel.device_index(device), accel.default_stream(device):
        x = DLPackTensor(_tensor(_values(np.float32), device))
        accel.from_dlpack(x)
    assert seen == [1]          # the legacy default stream is passed as 1 on CUDA


@pytest.mark.parametrize("device", DEVICES)
def test_dlpack__test_dlpack_convert_default_stream(sim_cuda_delayed, device):
    accel.default_stream(device).synchronize()
    side_stream = accel.Stream(device)
    with side_stream:
        x = accel.Buffer(4, device=device).fill_(0)
        gate = hold(side_stream)
        try:
            assert accel.default_stream(device).query()
            x.__dlpack__(stream=1)
            # the default stream now waits for the side stream (a pending cudaStreamWaitEvent)
            assert not accel.default_stream(device).query()
            assert accel.default_stream(1 - device).query()
        finally:
            gate.set()
    accel.synchronize(device)


@pytest.mark.parametrize("device", DEVICES)
def test_dlpack__test_dlpack_tensor_invalid_stream(sim_backend, device):
    _need(device)
    x = _tensor(_values(np.float32), device)
    with pytest.raises(TypeError):
        x.__dlpack__(stream=object())
    with pytest.raises(TypeError):
        x._buffer.__dlpack__(stream=object())


def test_dlpack__test_dlpack_cuda_per_thread_stream(sim_cuda):
    # torch refuses stream=2 ("per-thread default stream is not supported"); accel takes it as
    # cudaStreamPerThread (Buffer.__dlpack__'s docstring): the capsule is made
    x = _tensor(_values(np.float32), 0)
    info = _dlpack.parse(x.__dlpack__(stream=2))
    assert info.shape == (5,)


def test_dlpack__test_dlpack_invalid_cuda_streams(sim_cuda):
    # torch: AssertionError "unsupported stream on CUDA: 0"; accel: ValueError (0 is ambiguous)
    x = _tensor(_values(np.float32), 0)
    with pytest.raises(ValueError, match="stream=0 is disallowed"):
        x.__dlpack__(stream=0)


@pytest.mark.parametrize("device", DEVICES)
def test_dlpack__test_dlpack_tensor_on_different_device(sim_cuda, device):
    # torch refuses to export a CUDA tensor while another device is current ("Can't export
    # tensors on a different CUDA device index"); accel exports it, synchronized on the
    # buffer's own device, and the consumer reads the values
    other = 1 - device
    values = _values(np.float32)
    with accel.device_index(device):
        x = _tensor(values, device)
    with accel.device_index(other):
        z = accel.from_dlpack(x.__dlpack__())
        assert accel.current_device_index() == other
    assert z.device_index == device
    np.testing.assert_array_equal(_read(z, np.float32, (5,)), values)


@pytest.mark.parametrize("device", DEVICES)
def test_dlpack__test_max_version(sim_backend, device):
    _need(device)
    def capsule_name(kwargs):
        versioned = "max_version" in kwargs and kwargs["max_version"][0] >= 1
        return "dltensor_versioned" if versioned else "dltensor"

    for kwargs in ({}, {"max_version": (0, 8)}, {"max_version": (1, 0)}, {"max_version": (2, 0)}):
        inp = _tensor(_values(np.float32), device)
        capsule = inp.__dlpack__(**kwargs)
        assert f'capsule object "{capsule_name(kwargs)}" at' in str(capsule), kwargs
        out = accel.from_dlpack(capsule)
        np.testing.assert_array_equal(_read(out, np.float32, (5,)), inp.to_numpy())


@pytest.mark.parametrize("device", DEVICES)
def test_dlpack__test_automatically_select_in_creation(sim_backend, device):
    # torch.tensor(wrapper) goes through DLPack; accel's Buffer.copy_from takes the same wrapper
    _need(device)
    values = _values(np.float32, 10)
    tensor = _tensor(values, device)
    new = accel.Buffer(values.nbytes, device=device).copy_from(_DLPackOnly(tensor))
    assert new.ptr != tensor.ptr
    np.testing.assert_array_equal(_read(new, np.float32, (10,)), values)


def _from_dlpack(inp, dl_device=None, copy=None):
    """torch's _test_from_dlpack, the producer's half: export with dl_device/copy, then import."""
    return accel.from_dlpack(inp.__dlpack__(max_version=(1, 0), dl_device=dl_device, copy=copy))


@pytest.mark.parametrize("device", DEVICES)
def test_dlpack__test_no_copy(sim_backend, device):
    _need(device)
    inp = _tensor(_values(np.float32), device)
    own = inp.__dlpack_device__()
    for dl_device, copy in ((None, None), (None, False), (own, None), (own, False)):
        out = _from_dlpack(inp, dl_device, copy)
        assert out.ptr == inp.ptr and out.device_index == device, (dl_device, copy)
        np.testing.assert_array_equal(_read(out, np.float32, (5,)), inp.to_numpy())


@pytest.mark.parametrize("device", DEVICES)
def test_dlpack__test_copy(sim_backend, device):
    # torch copies for copy=True or a host dl_device; so does accel since session 39 (r80b; before,
    # only for a host dl_device with copy=True)
    _need(device)
    inp = _tensor(_values(np.float32), device)
    cpu = (DLDeviceType.kDLCPU, 0)
    own = tuple(inp.__dlpack_device__())
    for dl_device, copy, where in ((None, True, own), (own, True, own), (cpu, None, cpu)):
        info = _dlpack.parse(inp.__dlpack__(max_version=(1, 0), dl_device=dl_device, copy=copy))
        assert (info.device_type, info.device_id) == where and info.flags & _dlpack.FLAG_IS_COPIED
        assert info.data != inp.ptr
        del info
    capsule = inp.__dlpack__(max_version=(1, 0), dl_device=cpu, copy=True)
    info = _dlpack.parse(capsule)
    assert (info.device_type, info.flags & _dlpack.FLAG_IS_COPIED) == (DLDeviceType.kDLCPU, _dlpack.FLAG_IS_COPIED)
    assert info.data != inp.ptr
    np.testing.assert_array_equal(np.from_dlpack(inp, device="cpu", copy=True), inp.to_numpy())


@pytest.mark.parametrize("device", DEVICES)
def test_dlpack__test_needs_copy_error(sim_backend, device):
    _need(device)
    inp = _tensor(_values(np.float32), device)
    with pytest.raises(ValueError, match="copy=False"):
        inp.__dlpack__(max_version=(1, 0), dl_device=(DLDeviceType.kDLCPU, 0), copy=False)


@pytest.mark.parametrize("device", DEVICES)
def test_dlpack__test_unsupported_device_error(sim_backend, device):
    _need(device)
    inp = _tensor(_values(np.float32), device)
    with pytest.raises(BufferError, match="kDLHexagon"):     # torch: "Unsupported device_type: 16"
        inp.__dlpack__(max_version=(1, 0), dl_device=(DLDeviceType.kDLHexagon, 0))


@pytest.mark.parametrize("device", DEVICES)
def test_dlpack__test_dlpack_normalize_strides(sim_backend, device):
    # y = x[::3][:1]: shape (1,), stride (3,) elements; torch now exports the stride as given
    _need(device)
    buf = accel.Buffer(64, device=device)
    y = buf.as_array(np.float32, (1,), (12,))
    assert y.shape == (1,)
    info = _dlpack.parse(y.__dlpack__(max_version=(1, 0)))
    assert info.shape == (1,)
    # accel normalizes a size-1 dimension's stride (any value describes y): (1,), not torch's (3,)
    assert info.strides in (None, (1,), (3,))
    info = _dlpack.parse(y.__dlpack__())
    _dlpack.to_address(accel._lazy.lazy_init(), info)     # (kDLMetal: MTLBuffer + offset)
    assert info.span() == (y.ptr, 4)


# ------------------------------------------------------------------ test_numba_integration.py
CAI_DTYPES = (np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8, np.uint8)


@pytest.mark.parametrize("device", DEVICES)
def test_numba_integration__test_cuda_array_interface(sim_backend, device):
    _need(device)
    for npt in CAI_DTYPES:
        view = accel.Buffer(10 * np.dtype(npt).itemsize, device=device).as_array(npt, (10,))
        if sim_backend != "cuda":
            # torch's CPU tensors: no attribute, AttributeError on access (accel: non-CUDA memory)
            assert not hasattr(view, "__cuda_array_interface__")
            assert not hasattr(view._buffer, "__cuda_array_interface__")
            with pytest.raises(AttributeError):
                view.__cuda_array_interface__
            continue
        assert hasattr(view, "__cuda_array_interface__")
        ar_dict = view.__cuda_array_interface__
        # torch exports version 2 without "stream"; accel version 3 (the buffer's last-use stream)
        assert set(ar_dict) == {"shape", "strides", "typestr", "data", "version", "stream"}
        assert ar_dict["shape"] == (10,)
        assert ar_dict["strides"] is None
        assert ar_dict["typestr"] == np.dtype(npt).newbyteorder("<").str
        assert ar_dict["data"] == (view.ptr, False)
        assert ar_dict["version"] == 3


class _CAIOnly:
    """A numba DeviceNDArray stand-in: only __cuda_array_interface__ (and the owner it keeps)."""

    def __init__(self, view):
        self.view = view
        self.__cuda_array_interface__ = view.__cuda_array_interface__


@pytest.mark.parametrize("device", DEVICES)
def test_numba_integration__test_from_cuda_array_interface(sim_cuda, device):
    # torch.tensor(numba_ary, device="cuda") copies; torch.as_tensor shares: accel's
    # Buffer.copy_from(cai) copies, Buffer.from_ptr(data ptr, owner=obj) shares
    for dtype in (np.complex64, np.complex128, np.float64, np.float32, np.int64, np.int32, np.int16,
                  np.int8, np.uint8):
        host = np.arange(6).reshape(2, 3).astype(dtype)
        src = _CAIOnly(_tensor(host, device))
        copied = accel.Buffer(host.nbytes, device=device).copy_from(src)
        assert copied.ptr != src.view.ptr
        np.testing.assert_array_equal(_read(copied, dtype, (2, 3)), host)
        shared = accel.Buffer.from_ptr(src.__cuda_array_interface__["data"][0], host.nbytes, device, owner=src)
        shared.copy_from((host + 42).astype(dtype))
        np.testing.assert_array_equal(src.view.to_numpy(), host + 42)     # the same device memory
        np.testing.assert_array_equal(_read(copied, dtype, (2, 3)), host)  # the copy is not


def test_numba_integration__test_from_cuda_array_interface_lifetime(sim_cuda):
    # torch.as_tensor(obj) keeps obj alive: accel's from_ptr(..., owner=obj) does too
    host = np.arange(6, dtype=np.int64)
    src = _CAIOnly(_tensor(host, 0))
    shared = accel.Buffer.from_ptr(src.__cuda_array_interface__["data"][0], host.nbytes, 0, owner=src)
    assert shared.__cuda_array_interface__["data"][0] == src.__cuda_array_interface__["data"][0]
    del src
    np.testing.assert_array_equal(shared.to_numpy().view(np.int64), host)


def test_numba_integration__test_from_cuda_array_interface_active_device(sim_cuda):
    # device 0 memory taken onto device 1: a copy (different data pointer, same description)
    host = np.arange(6, dtype=np.int64)
    src = _CAIOnly(_tensor(host, 0))
    dst = accel.Buffer(host.nbytes, device=1).copy_from(src)
    assert dst.device_index == 1
    np.testing.assert_array_equal(dst.to_numpy().view(np.int64), host)
    if1 = dst.as_array(np.int64).__cuda_array_interface__
    if2 = dict(src.__cuda_array_interface__)
    assert if1["data"] != if2["data"]
    for d in (if1, if2):
        del d["data"], d["stream"]
    assert if1 == if2


# ------------------------------------------------------------------ test_cuda_nvml_based_avail.py
def _child_in_bad_fork() -> int:
    """TestExtendedCUDAIsAvail.in_bad_fork_test in the forked child: 10 when poisoned, 0 if not."""
    from accel import _lazy
    accel.is_available()
    return 10 if _lazy.is_in_bad_fork() else 0


@pytest.mark.parametrize("nvml_avail", [True, False])
def test_cuda_nvml_based_avail__test_cuda_is_available(monkeypatch, nvml_avail):
    # torch: is_available() counted with NVML leaves a forked child usable; counted with the
    # runtime (no NVML) it started CUDA, and the child is in a bad fork.  accel always counts
    # with NVML when it can (torch's PYTORCH_NVML_BASED_CUDA_CHECK=1)
    from accel import sim
    use_sim(monkeypatch, "cuda")
    if not nvml_avail:
        sim.configure(nvml=False)
    assert accel.is_available()
    status = run_forked(_child_in_bad_fork)
    assert status == (0 if nvml_avail else 10)
