"""r80b: differential tests of accel's DLPack import and export against torch 2.13 (CPU wheel)
and the DLPack spec.

Sources the expectations rest on (quoted where a test relies on them):

* the Python array API standard, ``array.__dlpack__`` (draft, src/array_api_stubs/_draft/
  array_object.py) and ``from_dlpack`` (creation_functions.py);
* dmlc/dlpack ``include/dlpack/dlpack.h`` 1.x (DLPackVersion, DLPACK_FLAG_BITMASK_*,
  DLManagedTensorVersioned);
* torch 2.13: ``torch/_tensor.py`` ``Tensor.__dlpack__`` (its CUDA branch read as source, its
  CPU branch run here), ``torch/utils/dlpack.py`` ``from_dlpack`` (run here on CPU producers),
  and ATen's ``maybeCopyTensor`` (aten/src/ATen/DLConvertor.cpp: a dl_device other than the
  tensor's is copied to with copy=None, refused with ValueError with copy=False).

The odd producers are built twice: once over a torch CPU tensor (torch can consume it on a CPU
wheel) and once over an accel Buffer of simulated device 1 while device 0 is current (accel
consumes it); the decisions (accept or refuse, and where the spec names it, the exception) are
compared.  torch cannot consume a kDLCUDA capsule on a CPU wheel, so the two never share a
capsule.
"""

import ctypes
import gc

import numpy as np
import pytest

import accel
from accel import _dlpack
from tests.conftest import use_sim
from tests.test_dlpack import consume

torch = pytest.importorskip("torch")

_GetName = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))

KDLCPU, KDLCUDA = 1, 2
READ_ONLY, IS_COPIED = 1 << 0, 1 << 1      # dlpack.h DLPACK_FLAG_BITMASK_READ_ONLY / _IS_COPIED


def _outcome(fn):
    """("ok", result) or (exception type, exception)."""
    try:
        return "ok", fn()
    except Exception as exc:        # noqa: BLE001 - the type is what is compared
        return type(exc), exc


class Producer:
    """A DLPack producer whose __dlpack__ and __dlpack_device__ do what the test says."""

    def __init__(self, dlpack, device):
        self._dlpack, self._device, self.calls = dlpack, device, []

    def __dlpack_device__(self):
        return self._device() if callable(self._device) else self._device

    def __dlpack__(self, **kwargs):
        self.calls.append(kwargs)
        return self._dlpack(**kwargs)


@pytest.fixture
def dev1(sim_cuda):
    """A 64-byte buffer of device 1 holding 0..63, device 0 current."""
    assert accel.device_count() >= 2
    assert accel.current_device_index() == 0
    buf = accel.Buffer(64, device=1)
    buf.copy_from(np.arange(64, dtype=np.uint8))
    yield buf
    assert accel.current_device_index() == 0          # nothing below switched the current device


def _torch_tensor():
    return torch.arange(16, dtype=torch.uint8)


def _bump_major(capsule, major):
    _dlpack.DLManagedTensorVersioned.from_address(_dlpack.parse(capsule).address).version.major = major
    return capsule


# -- the import side: the same odd producers, torch (CPU) vs accel (CUDA device 1) -----------------
def _raise(exc):
    def produce(**kwargs):
        raise exc
    return produce


@pytest.mark.parametrize("exc", [BufferError("no export"), TypeError("bad keyword"), RuntimeError("oom"),
                                 MemoryError("no memory")])
def test_producer_exception_propagates_unchanged_both(dev1, exc):
    """array API from_dlpack, Raises: __dlpack__ "may raise BufferError when the data cannot be
    exported ... It may also raise other errors ... from_dlpack must propagate such exceptions"."""
    before = _dlpack.live_exports()
    t_kind, t_exc = _outcome(lambda: torch.from_dlpack(Producer(_raise(exc), (KDLCPU, 0))))
    a_kind, a_exc = _outcome(lambda: accel.from_dlpack(Producer(_raise(exc), (KDLCUDA, 1))))
    assert t_exc is exc and a_exc is exc
    assert _dlpack.live_exports() == before


def test_producer_typeerror_is_retried_without_max_version_both(dev1):
    """array API __dlpack__ notes: the consumer calls ``x.__dlpack__(max_version=(1, 0), ...)``
    and on TypeError ``x.__dlpack__(...)`` again: both consumers ask twice, the second time
    without max_version, and then give up with the producer's TypeError."""
    t_prod = Producer(_raise(TypeError("no")), (KDLCPU, 0))
    a_prod = Producer(_raise(TypeError("no")), (KDLCUDA, 1))
    assert _outcome(lambda: torch.from_dlpack(t_prod))[0] is TypeError
    assert _outcome(lambda: accel.from_dlpack(a_prod))[0] is TypeError
    assert t_prod.calls[0] == {"max_version": (1, 0)} and "max_version" not in t_prod.calls[-1]
    # accel is a CUDA consumer: the stream is passed both times (device 1's legacy default: 1)
    assert a_prod.calls == [{"stream": 1, "max_version": (1, 0)}, {"stream": 1}]


@pytest.mark.parametrize("wrong", [None, 5, "capsule", b"dltensor"])
def test_producer_returning_no_capsule_refused_both(dev1, wrong):
    """Both refuse what is no capsule (torch: RuntimeError 'invalid capsule'; accel names the
    broken producer with TypeError); nothing leaks on accel's side."""
    before = _dlpack.live_exports()
    t_kind, _ = _outcome(lambda: torch.from_dlpack(Producer(lambda **kw: wrong, (KDLCPU, 0))))
    a_kind, a_exc = _outcome(lambda: accel.from_dlpack(Producer(lambda **kw: wrong, (KDLCUDA, 1))))
    assert t_kind is RuntimeError
    assert a_kind is TypeError and "not a DLPack capsule" in str(a_exc)
    assert _dlpack.live_exports() == before


def test_producer_returning_consumed_capsule_refused_both(dev1):
    t_capsule = _torch_tensor().__dlpack__(max_version=(1, 0))
    torch.from_dlpack(t_capsule)
    a_capsule = dev1.__dlpack__(max_version=(1, 0))
    first = accel.from_dlpack(a_capsule)
    live = _dlpack.live_exports()
    t_kind, _ = _outcome(lambda: torch.from_dlpack(Producer(lambda **kw: t_capsule, (KDLCPU, 0))))
    a_kind, a_exc = _outcome(lambda: accel.from_dlpack(Producer(lambda **kw: a_capsule, (KDLCUDA, 1))))
    assert t_kind is RuntimeError
    assert a_kind is BufferError and "already consumed" in str(a_exc)
    assert _dlpack.live_exports() == live                 # the refusal took nothing
    first.close()
    assert _dlpack.live_exports() == live - 1             # the first consumer's deleter, once


def test_capsule_consumed_by_torch_refused_by_accel(sim_cuda):
    """A capsule torch consumed is named "used_dltensor": accel refuses it before anything else
    (even before its device, kDLCPU, would be refused)."""
    for kw, used in (({}, b"used_dltensor"), ({"max_version": (1, 0)}, b"used_dltensor_versioned")):
        capsule = _torch_tensor().__dlpack__(**kw)
        torch.from_dlpack(capsule)
        assert _GetName(capsule) == used
        with pytest.raises(BufferError, match="already consumed"):
            accel.from_dlpack(capsule)


def test_producer_ignoring_max_version_legacy_capsule_accepted_both(dev1):
    """array API: __dlpack__ "may return a capsule of version max_version ... or of a different
    version. This means the consumer must verify the version": a legacy "dltensor" capsule
    given to a consumer that asked for (1, 0) is taken by both."""
    t = torch.from_dlpack(Producer(lambda **kw: _torch_tensor().__dlpack__(), (KDLCPU, 0)))
    assert t.tolist() == list(range(16))
    prod = Producer(lambda **kw: dev1.__dlpack__(stream=kw.get("stream")), (KDLCUDA, 1))
    imported = accel.from_dlpack(prod)
    assert imported.ptr == dev1.ptr and imported.device_index == 1 and imported.nbytes == 64
    assert not imported.readonly
    assert (imported.to_numpy() == np.arange(64)).all()
    imported.close()


def test_old_producer_returning_versioned_capsule_accepted_both(dev1):
    """A producer without max_version (the consumer's second, fallback call) that nevertheless
    returns a "dltensor_versioned" capsule: both read the name, not what they asked for."""
    def t_produce(stream=None):
        return _torch_tensor().__dlpack__(max_version=(1, 0))

    def a_produce(stream=None):
        return dev1.__dlpack__(stream=stream, max_version=(1, 0))

    class Old:
        def __init__(self, fn, dev):
            self.__dlpack__, self._dev = fn, dev

        def __dlpack_device__(self):
            return self._dev

    assert torch.from_dlpack(Old(t_produce, (KDLCPU, 0))).tolist() == list(range(16))
    imported = accel.from_dlpack(Old(a_produce, (KDLCUDA, 1)))
    assert imported.ptr == dev1.ptr and imported.device_index == 1
    imported.close()


@pytest.mark.parametrize("major", [2, 0])
def test_versioned_capsule_of_another_major_refused_and_deleted(dev1, major):
    """dlpack.h DLPackVersion: "If an obtained DLPack tensor has a major version that disagrees
    with the version number specified in this header file (i.e. major != DLPACK_MAJOR_VERSION),
    the consumer must call the deleter (and it is safe to do so)".  torch refuses major 2 with
    RuntimeError ("unsupported DLPack capsule major version") and takes a major 0 (a lower one);
    accel refuses both with BufferError and calls the deleter: nothing leaks."""
    t_kind, _ = _outcome(lambda: torch.from_dlpack(
        Producer(lambda **kw: _bump_major(_torch_tensor().__dlpack__(max_version=(1, 0)), major), (KDLCPU, 0))))
    assert t_kind is (RuntimeError if major > 1 else "ok")
    before = _dlpack.live_exports()
    capsules = []

    def produce(**kw):
        capsules.append(_bump_major(dev1.__dlpack__(**kw), major))
        return capsules[-1]

    a_kind, a_exc = _outcome(lambda: accel.from_dlpack(Producer(produce, (KDLCUDA, 1))))
    assert a_kind is BufferError and "major version" in str(a_exc)
    assert _GetName(capsules[0]) == b"used_dltensor_versioned"      # taken, and its deleter called
    assert _dlpack.live_exports() == before


def test_dlpack_device_raising_propagates_both(dev1):
    exc = RuntimeError("device query failed")

    def lying():
        raise exc

    t_prod = Producer(lambda **kw: _torch_tensor().__dlpack__(**kw), lying)
    a_prod = Producer(lambda **kw: dev1.__dlpack__(**kw), lying)
    assert _outcome(lambda: torch.from_dlpack(t_prod))[1] is exc
    assert _outcome(lambda: accel.from_dlpack(a_prod))[1] is exc
    assert t_prod.calls == [] and a_prod.calls == []       # neither asked for a capsule


def test_dlpack_device_claiming_host_for_device_capsule(dev1):
    """A device producer whose __dlpack_device__ says kDLCPU: accel refuses before asking for a
    capsule (nothing exported, nothing to free); torch, told kDLCPU, asks without a stream."""
    prod = Producer(lambda **kw: dev1.__dlpack__(**kw), (KDLCPU, 0))
    before = _dlpack.live_exports()
    with pytest.raises(BufferError, match="host memory"):
        accel.from_dlpack(prod)
    assert prod.calls == [] and _dlpack.live_exports() == before
    t_prod = Producer(lambda **kw: _torch_tensor().__dlpack__(**kw), (KDLCPU, 0))
    torch.from_dlpack(t_prod)
    assert t_prod.calls == [{"max_version": (1, 0)}]


def test_dlpack_device_claiming_cuda_for_host_capsule(dev1):
    """A producer that says (kDLCUDA, 1) and returns torch's kDLCPU capsule: accel reads the
    capsule's own device, refuses it with BufferError and leaves it unconsumed (torch's
    destructor frees it)."""
    capsules = []

    def produce(**kw):
        capsules.append(_torch_tensor().__dlpack__(max_version=kw.get("max_version")))
        return capsules[-1]

    with pytest.raises(BufferError, match="kDLCPU"):
        accel.from_dlpack(Producer(produce, (KDLCUDA, 1)))
    assert _GetName(capsules[0]) == b"dltensor_versioned"


@pytest.mark.parametrize("value", ["cuda:1", (KDLCUDA,), (KDLCUDA, 1, 0), (True, 1), (KDLCUDA, 1.0), None])
def test_malformed_dlpack_device_refused_before_asking(dev1, value):
    prod = Producer(lambda **kw: dev1.__dlpack__(**kw), value)
    with pytest.raises(TypeError, match="__dlpack_device__"):
        accel.from_dlpack(prod)
    assert prod.calls == []


def test_dlpack_device_as_torch_intenum_accepted(dev1):
    kind = torch.utils.dlpack.DLDeviceType.kDLCUDA
    prod = Producer(lambda **kw: dev1.__dlpack__(**kw), (kind, 1))
    imported = accel.from_dlpack(prod)
    assert imported.device_index == 1 and prod.calls[0]["stream"] == 1
    imported.close()


def test_keywords_accel_and_torch_pass(dev1):
    """Both pass keywords only (a producer may make them keyword-only, as the standard's
    signature does): torch on a CPU producer max_version alone; accel on a CUDA producer the
    stream too -- device 1's current stream: 1 for its legacy default, else its handle."""
    t_prod = Producer(lambda **kw: _torch_tensor().__dlpack__(**kw), (KDLCPU, 0))
    torch.from_dlpack(t_prod)
    assert t_prod.calls == [{"max_version": (1, 0)}]
    a_prod = Producer(lambda **kw: dev1.__dlpack__(**kw), (KDLCUDA, 1))
    accel.from_dlpack(a_prod).close()
    side = accel.Stream(1)
    accel.set_stream(side)              # device 1's current stream (it switches to device 1 ...)
    accel.set_device_index(0)           # (... and back: device 0 current, device 1's stream kept)
    try:
        assert accel.current_stream(1) == side and accel.current_device_index() == 0
        accel.from_dlpack(a_prod).close()
    finally:
        accel.set_stream(accel.default_stream(1))
        accel.set_device_index(0)
    assert a_prod.calls == [{"stream": 1, "max_version": (1, 0)}, {"stream": side.handle, "max_version": (1, 0)}]
    side.synchronize()


def test_producer_without_stream_keyword_refused_with_typeerror(dev1):
    """A producer whose __dlpack__ takes no keyword at all: a CUDA consumer must pass a stream
    (array API: stream "is provided by the consumer"; torch's from_dlpack passes it for every
    kDLCUDA producer too), so both calls fail with TypeError and nothing is exported."""
    class NoKeywords:
        def __dlpack_device__(self):
            return (KDLCUDA, 1)

        def __dlpack__(self):
            return dev1.__dlpack__()

    before = _dlpack.live_exports()
    with pytest.raises(TypeError):
        accel.from_dlpack(NoKeywords())
    assert _dlpack.live_exports() == before


# -- the export side: argument checks vs torch.Tensor.__dlpack__ and the standard -----------------
@pytest.mark.parametrize("stream", [None, 1, 2, -1, np.int64(1)])
def test_export_stream_values_accepted_on_cuda(dev1, stream):
    """array API __dlpack__, CUDA: "None: producer must assume the legacy default stream",
    "1: the legacy default stream", "2: the per-thread default stream"; "-1 ... producer must
    not perform any synchronization".  (torch's CUDA branch refuses 2 with BufferError
    "per-thread default stream is not supported": accel follows the standard.)"""
    capsule = dev1.__dlpack__(stream=stream, max_version=(1, 0))
    fields, delete = consume(capsule)
    assert fields["device"] == (KDLCUDA, 1) and fields["data"] == dev1.ptr
    delete()


def test_export_own_stream_handles_accepted(dev1):
    """A cudaStream_t handle of the buffer's device (or the accel.Stream itself): accepted, and
    that stream becomes the buffer's last-use stream (the consumer works there next)."""
    s1 = accel.Stream(1)
    dev1.fill_(1, stream=accel.Stream(1))
    for stream in (s1.handle, s1):
        capsule = dev1.__dlpack__(stream=stream)
        assert _GetName(capsule) == b"dltensor"
        del capsule
        assert dev1.last_stream == s1
    s1.synchronize()


@pytest.mark.parametrize("stream,exc", [(0, ValueError), (-2, ValueError), (True, TypeError), (1.0, TypeError),
                                        ("1", TypeError), (2 ** 64, ValueError)])
def test_export_bad_stream_refused_without_state_change(dev1, stream, exc):
    """array API: "0 is disallowed due to its ambiguity"; "The pointer must be an integer larger
    than or equal to -1".  torch's CUDA branch: a non-int (bool included: ``type(stream) is not
    int``) is a TypeError, 0 an AssertionError ("unsupported stream on CUDA").  accel: ValueError
    for a bad int, TypeError for a non-int; the last-use stream and the live exports unchanged."""
    side = accel.Stream(1)
    dev1.fill_(2, stream=side)
    before = _dlpack.live_exports()
    with pytest.raises(exc):
        dev1.__dlpack__(stream=stream, max_version=(1, 0))
    assert dev1.last_stream == side and _dlpack.live_exports() == before
    side.synchronize()


def test_export_consumer_stream_waits_on_device1(monkeypatch):
    """The handshake for a device-1 buffer with device 0 current: stream=None and 1 name device
    1's legacy default stream (the buffer's device), which must wait for the slow work queued on
    device 1's side stream before the copy queued on it next reads the memory."""
    use_sim(monkeypatch, "cuda", ACCEL_SIM_DELAY_US=20000)
    for stream in (None, 1):
        buf = accel.Buffer(4096, device=1)
        side = accel.Stream(1)
        for value in (1, 2, 7):
            buf.fill_(value, stream=side)
        capsule = buf.__dlpack__(stream=stream, max_version=(1, 0))
        assert accel.current_device_index() == 0
        out = np.zeros(4096, dtype=np.uint8)
        buf.copy_to(out, stream=accel.default_stream(1))
        assert (out == 7).all()
        del capsule
        side.synchronize()


@pytest.mark.parametrize("stream", [None, -1, 0, 1, 2])
def test_host_copy_stream_rules_match_torch_cpu(dev1, stream):
    """array API: "when kDLCPU is in use, stream must be None"; torch's CPU branch (run here)
    takes None and -1 ("For non-CUDA devices, -1 is treated the same as None") and refuses the
    rest (AssertionError "stream should be None on cpu.").  accel's host copy makes the same
    decision, refusing with ValueError."""
    t_kind, _ = _outcome(lambda: _torch_tensor().__dlpack__(stream=stream, dl_device=(KDLCPU, 0), copy=True))
    a_kind, a_res = _outcome(lambda: dev1.__dlpack__(stream=stream, dl_device=(KDLCPU, 0), copy=True))
    assert (t_kind == "ok") == (a_kind == "ok")
    if a_kind != "ok":
        assert t_kind is AssertionError and a_kind is ValueError
    else:
        assert np.from_dlpack(_Wrap(a_res)).tolist() == list(range(64))


class _Wrap:
    """A capsule numpy can take through its from_dlpack (which wants __dlpack__)."""

    def __init__(self, capsule):
        self._capsule = capsule

    def __dlpack__(self, **kwargs):
        return self._capsule

    def __dlpack_device__(self):
        return (KDLCPU, 0)


@pytest.mark.parametrize("max_version,name", [(None, b"dltensor"), ((0, 8), b"dltensor"),
                                              ((1, 0), b"dltensor_versioned"), ((1, 5), b"dltensor_versioned"),
                                              ((2, 0), b"dltensor_versioned"), ([1, 0], b"dltensor_versioned"),
                                              ((np.int64(1), np.int64(0)), b"dltensor_versioned")])
def test_export_max_version_picks_struct_as_torch(dev1, max_version, name):
    """torch: ``if max_version is None or max_version[0] < 1`` the legacy capsule, else the
    versioned one (run on CPU); accel picks the same, and writes its own version (1, 1) whatever
    higher one was asked (array API: "return our own max version")."""
    assert _GetName(_torch_tensor().__dlpack__(max_version=max_version)) == name
    fields, delete = consume(dev1.__dlpack__(max_version=max_version))
    assert fields["name"] == name
    if name == b"dltensor_versioned":
        assert fields["version"] == (1, 1) and fields["flags"] == 0
    delete()


@pytest.mark.parametrize("bad", ["10", 1, (1,), (1, 0, 0), (1.0, 0), (1, "a")])
def test_export_malformed_max_version_typeerror(dev1, bad):
    """Malformed max_version: accel TypeError (torch is looser: it only indexes [0], so (1,)
    passes and "10" fails with TypeError from the comparison)."""
    before = _dlpack.live_exports()
    with pytest.raises(TypeError, match="max_version"):
        dev1.__dlpack__(max_version=bad)
    assert _dlpack.live_exports() == before


def test_export_dl_device_own_device_zero_copy(dev1):
    """array API: dl_device "Default is None, meaning the exported capsule should be on the same
    device as self is"; naming that device (as a tuple or torch's IntEnum), with copy None or
    False, is the zero-copy export of device 1 while device 0 is current."""
    kind = torch.utils.dlpack.DLDeviceType.kDLCUDA
    for dl_device, copy in (((KDLCUDA, 1), None), ((KDLCUDA, 1), False), ((kind, 1), None)):
        fields, delete = consume(dev1.__dlpack__(dl_device=dl_device, copy=copy, max_version=(1, 0)))
        assert fields["device"] == (KDLCUDA, 1) and fields["data"] == dev1.ptr and fields["flags"] == 0
        delete()


@pytest.mark.parametrize("dl_device,copy,exc", [((KDLCUDA, 0), None, BufferError), ((KDLCUDA, 0), False, BufferError),
                                                ((14, 1), None, BufferError), ((KDLCPU, 0), False, ValueError),
                                                ((3, 0), False, ValueError)])
def test_export_dl_device_refusals(dev1, dl_device, copy, exc):
    """array API dl_device: "If the device type cannot be handled by the producer, this function
    must raise BufferError"; "If a copy must be made to enable this support but copy is set to
    False, the function must raise ValueError" (torch's maybeCopyTensor: TORCH_CHECK_VALUE,
    ValueError, run here for a CPU tensor and dl_device=(kDLCUDA, 0), copy=False)."""
    if exc is ValueError and dl_device[0] == KDLCPU:
        t_kind, _ = _outcome(lambda: _torch_tensor().__dlpack__(dl_device=(KDLCUDA, 0), copy=False))
        assert t_kind is ValueError
    before = _dlpack.live_exports()
    with pytest.raises(exc):
        dev1.__dlpack__(dl_device=dl_device, copy=copy, max_version=(1, 0))
    assert _dlpack.live_exports() == before


@pytest.mark.parametrize("dl_device", ["cuda", (KDLCUDA,), (KDLCUDA, 1, 0), (True, 1), (KDLCUDA, 1.5)])
def test_export_malformed_dl_device_typeerror(dev1, dl_device):
    """torch: RuntimeError "dl_device must be either None or a tuple of ints"; accel TypeError."""
    with pytest.raises(TypeError, match="dl_device"):
        dev1.__dlpack__(dl_device=dl_device)


@pytest.mark.parametrize("copy", [1, 0, "yes"])
def test_export_non_bool_copy_typeerror_as_torch(dev1, copy):
    assert _outcome(lambda: _torch_tensor().__dlpack__(copy=copy))[0] is TypeError
    with pytest.raises(TypeError, match="copy"):
        dev1.__dlpack__(copy=copy)


@pytest.mark.parametrize("versioned", [True, False])
def test_host_copy_capsule_contents_and_flags(dev1, versioned):
    """array API copy: "When a copy happens, the DLPACK_FLAG_BITMASK_IS_COPIED flag must be
    set" (torch 2.13 leaves it 0 on its CPU clone; accel sets it).  The copy is kDLCPU, owns
    its bytes (not read-only), and the export of device 1 leaves device 0 current."""
    view = dev1.as_array(np.uint8, (4, 8), strides=(16, 1))
    fields, delete = consume(view.__dlpack__(dl_device=(KDLCPU, 0), copy=True,
                                             max_version=(1, 0) if versioned else None))
    assert fields["device"] == (KDLCPU, 0) and fields["shape"] == (4, 8)
    got = np.ctypeslib.as_array(ctypes.cast(fields["data"] + fields["byte_offset"],
                                            ctypes.POINTER(ctypes.c_uint8)), (32,))
    stride = fields["strides"][0]
    assert [got[i * stride:i * stride + 8].tolist() for i in range(4)] == [list(range(16 * i, 16 * i + 8))
                                                                             for i in range(4)]
    if versioned:
        assert fields["flags"] == IS_COPIED
    delete()


def test_torch_copy_flag_for_reference():
    """(What torch does, for the report: its copy=True capsule carries flags 0.)"""
    fields, delete = consume(_torch_tensor().__dlpack__(max_version=(1, 0), copy=True))
    assert fields["flags"] == 0
    delete()


# r80b, fixed in session 39: accel/_dlpack/exporting.py check_dl_device: dl_device=(kDLCPU, 0) with
# copy=None raises BufferError; the array API says copy=None must 'reuse the existing memory buffer if
# possible and copy otherwise' (torch's maybeCopyTensor copies), so numpy.from_dlpack(buf,
# device='cpu') fails although accel makes that very host copy for copy=True
def test_export_dl_device_cpu_copy_none_copies(dev1):
    seen = []

    class Spy:
        def __dlpack_device__(self):
            return dev1.__dlpack_device__()

        def __dlpack__(self, **kwargs):
            seen.append(kwargs)
            return dev1.__dlpack__(**kwargs)

    try:
        host = np.from_dlpack(Spy(), device="cpu")
    finally:
        assert seen and seen[0]["dl_device"] == (KDLCPU, 0) and seen[0]["copy"] is None   # what numpy asks
    assert host.tolist() == list(range(64))


# r80b, fixed in session 39: accel/_dlpack/exporting.py check_dl_device: copy=True on the buffer's own
# device raises BufferError; the array API says 'If True, the function must always copy (performed by
# the producer)' and torch clones (a new allocation, flagged IS_COPIED by the spec)
def test_export_copy_true_same_device_copies(dev1):
    fields, delete = consume(dev1.__dlpack__(copy=True, max_version=(1, 0)))
    try:
        assert fields["device"] == (KDLCUDA, 1) and fields["data"] != dev1.ptr
        assert fields["flags"] & IS_COPIED
    finally:
        delete()


# -- capsule contents: accel's exports vs torch's for the same layout -------------------------------
_DTYPES = [("int8", np.int8), ("uint8", np.uint8), ("int16", np.int16), ("uint16", np.uint16),
           ("int32", np.int32), ("uint32", np.uint32), ("int64", np.int64), ("uint64", np.uint64),
           ("float16", np.float16), ("float32", np.float32), ("float64", np.float64),
           ("complex64", np.complex64), ("complex128", np.complex128), ("bool", np.bool_)]


@pytest.mark.parametrize("tname,npdtype", _DTYPES)
def test_view_dtype_code_bits_lanes_as_torch(dev1, tname, npdtype):
    t_fields, t_delete = consume(torch.zeros(2, dtype=getattr(torch, tname)).__dlpack__(max_version=(1, 0)))
    t_delete()
    view = dev1.as_array(npdtype, (2,))
    fields, delete = consume(view.__dlpack__(max_version=(1, 0)))
    assert fields["dtype"] == t_fields["dtype"]
    assert fields["shape"] == (2,) and fields["strides"] == (1,) and fields["byte_offset"] == 0
    assert fields["device"] == (KDLCUDA, 1) and fields["data"] == dev1.ptr
    delete()


def test_view_layouts_as_torch(dev1):
    """Shape, element strides and byte_offset for the layouts torch exports the same way: C order,
    a transpose, a 0-d tensor, a broadcast (zero stride)."""
    layouts = [
        (torch.zeros(24, dtype=torch.int16).reshape(4, 6), dict(dtype=np.int16, shape=(4, 6))),
        (torch.zeros(24, dtype=torch.int16).reshape(4, 6).t(), dict(dtype=np.int16, shape=(6, 4), strides=(2, 12))),
        (torch.tensor(3, dtype=torch.int32), dict(dtype=np.int32, shape=())),
        (torch.zeros(3, dtype=torch.int32).expand(2, 3), dict(dtype=np.int32, shape=(2, 3), strides=(0, 4))),
    ]
    for t, spec in layouts:
        t_fields, t_delete = consume(t.__dlpack__(max_version=(1, 0)))
        t_delete()
        view = dev1.as_array(spec["dtype"], spec["shape"], spec.get("strides"))
        for max_version in ((1, 0), None):
            fields, delete = consume(view.__dlpack__(max_version=max_version))
            assert (fields["shape"], fields["strides"], fields["byte_offset"], fields["ndim"]) == (
                t_fields["shape"], t_fields["strides"], t_fields["byte_offset"], t_fields["ndim"]), spec
            assert fields["dtype"] == t_fields["dtype"] and fields["device"] == (KDLCUDA, 1)
            delete()


def test_view_with_offset_points_at_first_element(dev1):
    """A view at a byte offset: data is its first element, byte_offset 0 (as torch writes it)."""
    view = dev1.as_array(np.float32, (3, 2), strides=(8, 32), offset=4)
    fields, delete = consume(view.__dlpack__(max_version=(1, 0)))
    assert fields["data"] == dev1.ptr + 4 and fields["byte_offset"] == 0
    assert fields["shape"] == (3, 2) and fields["strides"] == (2, 8)
    delete()
    imported = accel.from_dlpack(view)
    # the span from the lowest to the highest element: 4 + (2*8 + 1*32 ... ) bytes
    assert imported.ptr == dev1.ptr + 4 and imported.nbytes == (2 * 2 + 1 * 8 + 1) * 4
    assert imported.device_index == 1
    imported.close()


def test_buffer_export_fields_device1(dev1):
    for max_version in ((1, 0), None):
        fields, delete = consume(dev1.__dlpack__(max_version=max_version))
        assert fields["device"] == (KDLCUDA, 1) == dev1.__dlpack_device__()
        assert fields["shape"] == (64,) and fields["strides"] == (1,) and fields["dtype"] == (1, 8, 1)
        assert fields["data"] == dev1.ptr and fields["byte_offset"] == 0 and fields["ndim"] == 1
        delete()


# -- read-only ---------------------------------------------------------------------------------
def test_read_only_flag_round_trip_and_legacy_refusal_as_numpy(dev1):
    """dlpack.h: DLPACK_FLAG_BITMASK_READ_ONLY "indicate that the tensor is read only".  A
    read-only import stays read-only on re-export; a legacy capsule, which cannot say so, is
    refused with BufferError as numpy refuses it for a read-only array (run here); a host copy
    is the consumer's own: IS_COPIED, not READ_ONLY, and a legacy one is fine."""
    ro = np.arange(3.0)
    ro.flags.writeable = False
    assert _outcome(lambda: ro.__dlpack__())[0] is BufferError
    capsule = _dlpack.export(dev1, dev1.ptr, KDLCUDA, 1, np.uint8, (64,), None, 0, versioned=True, readonly=True)
    imported = accel.from_dlpack(capsule)
    assert imported.readonly and imported.device_index == 1
    fields, delete = consume(imported.__dlpack__(max_version=(1, 0)))
    assert fields["flags"] == READ_ONLY and fields["data"] == dev1.ptr
    delete()
    before = _dlpack.live_exports()
    with pytest.raises(BufferError, match="read-only"):
        imported.__dlpack__()
    with pytest.raises(BufferError, match="read-only"):
        imported.__dlpack__(max_version=(0, 8))
    assert _dlpack.live_exports() == before
    fields, delete = consume(imported.__dlpack__(dl_device=(KDLCPU, 0), copy=True, max_version=(1, 0)))
    assert fields["flags"] == IS_COPIED
    delete()
    fields, delete = consume(imported.__dlpack__(dl_device=(KDLCPU, 0), copy=True))
    assert fields["name"] == b"dltensor"
    delete()
    imported.close()


# -- deleters: once, and the memory back to its baseline -----------------------------------------
def _alloc_counts(index):
    stats = accel.memory.memory_stats(index)
    return tuple(stats.get(f"allocation.all.{key}", 0) for key in ("allocated", "freed", "current"))


@pytest.mark.parametrize("versioned", [True, False])
def test_unconsumed_capsule_frees_once_after_close(sim_cuda, versioned):
    base = accel.memory.memory_allocated(1)
    allocated0, freed0, current0 = _alloc_counts(1)
    buf = accel.Buffer(1024, device=1)
    capsule = buf.__dlpack__(max_version=(1, 0) if versioned else None)
    buf.close()                                           # the export keeps the memory
    assert accel.memory.memory_allocated(1) == base + 1024
    del capsule                                           # unconsumed: its destructor runs the deleter
    gc.collect()
    assert accel.memory.memory_allocated(1) == base
    allocated, freed, current = _alloc_counts(1)
    assert (allocated - allocated0, freed - freed0, current) == (1, 1, current0)
    assert accel.current_device_index() == 0


def test_consumed_capsule_deleter_frees_once(sim_cuda):
    base = accel.memory.memory_allocated(1)
    allocated0, freed0, _ = _alloc_counts(1)
    buf = accel.Buffer(512, device=1)
    fields, delete = consume(buf.__dlpack__(max_version=(1, 0)))
    del buf
    gc.collect()
    assert accel.memory.memory_allocated(1) == base + 512     # the consumer still holds it
    delete()
    assert accel.memory.memory_allocated(1) == base
    delete()                                                  # a second call frees nothing more
    allocated, freed, _ = _alloc_counts(1)
    assert (allocated - allocated0, freed - freed0) == (1, 1)
    assert _dlpack.live_exports() == 0


def test_consuming_twice_refused_and_import_released_once(sim_cuda):
    base = accel.memory.memory_allocated(1)
    buf = accel.Buffer(2048, device=1)     # (a multiple of the allocator's 512-byte rounding)
    capsule = buf.__dlpack__(max_version=(1, 0))
    imported = accel.from_dlpack(capsule)
    with pytest.raises(BufferError, match="already consumed"):
        accel.from_dlpack(capsule)
    with pytest.raises(RuntimeError):
        torch.from_dlpack(capsule)                        # torch refuses the used capsule too
    buf.close()
    assert accel.memory.memory_allocated(1) == base + 2048
    imported.close()
    imported.close()
    del capsule
    gc.collect()
    assert accel.memory.memory_allocated(1) == base and _dlpack.live_exports() == 0


# -- the other DLPack consumers of accel: Buffer.copy_from and ArrayView.copy_from ------------------
@pytest.mark.parametrize("value", [(2.9, 1.7), (KDLCUDA, True)])
def test_buffer_copy_from_refuses_malformed_dlpack_device(dev1, value):
    """Buffer.copy_from reads __dlpack_device__ as accel.from_dlpack does (_dlpack._device_pair):
    a pair of ints or refused, before any capsule is asked for."""
    dst = accel.Buffer(64, device=1)
    prod = Producer(lambda **kw: dev1.__dlpack__(**kw), value)
    with pytest.raises(TypeError, match="__dlpack_device__"):
        dst.copy_from(prod)
    assert prod.calls == []


# r80b, fixed in session 39: accel/_array.py _source._from_dlpack (ArrayView.copy_from): reads
# __dlpack_device__ with int() and wraps what it raises: (2.9, 1.7) and (2, True) are taken as (2, 1),
# and a producer's BufferError becomes TypeError, where accel.from_dlpack and Buffer.copy_from
# (_dlpack._device_pair) refuse the first and propagate the second
def test_array_view_copy_from_reads_dlpack_device_as_from_dlpack(dev1):
    """array API from_dlpack, Raises: "The __dlpack__ and __dlpack_device__ methods on the input
    array may raise BufferError ... from_dlpack must propagate such exceptions"; __dlpack_device__
    returns "a tuple (device_type, device_id) in DLPack format"."""
    view = accel.Buffer(64, device=1).as_array(np.uint8, (64,))
    exc = BufferError("cannot say")

    def raising():
        raise exc

    failures = []
    outcome = _outcome(lambda: view.copy_from(Producer(lambda **kw: dev1.__dlpack__(**kw), raising)))
    if outcome[1] is not exc:
        failures.append(f"__dlpack_device__'s BufferError became {outcome[0].__name__}")
    for value in ((2.9, 1.7), (KDLCUDA, True)):
        prod = Producer(lambda **kw: dev1.__dlpack__(**kw), value)
        kind, _ = _outcome(lambda: view.copy_from(prod))
        if kind is not TypeError or prod.calls:
            failures.append(f"__dlpack_device__ {value!r} was taken")
    assert not failures, failures


@pytest.mark.parametrize("kwargs,exc", [({"stream": 0}, ValueError), ({"stream": True}, TypeError),
                                        ({"max_version": (1,)}, TypeError), ({"max_version": (-1, 0)}, ValueError),
                                        ({"dl_device": (KDLCUDA, 0)}, BufferError),
                                        ({"dl_device": (KDLCPU, 0), "copy": False}, ValueError),
                                        ({"copy": 1}, TypeError),
                                        ({"dl_device": (KDLCPU, 0), "copy": True, "stream": 1}, ValueError)])
def test_array_view_export_refusals_as_buffer(dev1, kwargs, exc):
    """ArrayView.__dlpack__ checks its arguments as Buffer.__dlpack__ does (same types), and a
    refusal changes nothing (last-use stream, live exports)."""
    side = accel.Stream(1)
    dev1.fill_(5, stream=side)
    view = dev1.as_array(np.int32, (4, 4))
    before = _dlpack.live_exports()
    for obj in (dev1, view):
        with pytest.raises(exc):
            obj.__dlpack__(**kwargs)
        assert dev1.last_stream == side and _dlpack.live_exports() == before
    side.synchronize()
