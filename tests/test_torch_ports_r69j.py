"""Round r69j: torch 2.13's own Python code as the oracle for device counting, the
``torch.accelerator`` device arguments and the memory-statistics functions.

torch's pure-Python helpers run here on the installed CPU wheel (torch 2.13.0+cpu) and their
answers are compared with accel's, case by case:

* test/test_cuda_nvml_based_avail.py's subject: ``torch.cuda._parse_visible_devices``,
  ``_transform_uuid_to_ordinals``, ``_device_count_nvml`` (``_raw_device_count_nvml`` /
  ``_raw_device_uuid_nvml`` answered from the simulated NVML) and ``_get_nvml_device_index``
  against ``accel.backends._visible`` and ``accel.device_count()`` on the CUDA simulator
  (seeded random CUDA_VISIBLE_DEVICES values: integers, UUID prefixes, MIG ids, "-1", gaps,
  duplicates, signs, junk);
* ``torch/accelerator/_utils.py::_get_device_index`` (with ``current_accelerator`` and
  ``current_device_index`` answered by accel) against ``accel._device.device_index``, and every
  public ``torch.accelerator`` function's handling of a device argument (negative index, index
  >= count, a string of another type, a ``torch.device``, None) against accel's same-named
  function, read with torch 2.13's C++ bindings (torch/csrc/DeviceAccelerator.cpp,
  c10/cuda/CUDAStream.cpp ``getCurrentCUDAStream``: index -1 is the current device);
* ``torch/cuda/memory.py`` and ``torch/accelerator/memory.py``: the flattening and sorting of the
  nested statistics (torch's code run on accel's nested dict), ``memory_summary`` (torch's
  formatter run on accel's statistics, abbreviated or not), the ``reset_*`` functions and
  ``max_memory_*`` after them, and the argument handling before initialization.

Device-1 cases run with device 0 current.  Strict xfails carry reasons starting "r69j:".
tests/TORCH_PORTS.md conventions; /work/notes/r69j_torch_ports.md lists every case.
"""

import collections
import os
import random
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.cuda as tcuda                      # noqa: E402
import torch.cuda.memory as tcuda_memory        # noqa: E402
import torch.accelerator as tacc                # noqa: E402
import torch.accelerator.memory as tacc_memory  # noqa: E402
from torch.accelerator import _utils as tacc_utils  # noqa: E402

import accel                                    # noqa: E402
import accel.memory as M                        # noqa: E402
from accel import _device, _lazy                # noqa: E402
from accel.backends import _visible             # noqa: E402

from conftest import run_forked, use_sim        # noqa: E402

SEED = 69


# ----------------------------------------------------------------------------- helpers
def _torch_parse(monkeypatch, value):
    """torch.cuda._parse_visible_devices() under CUDA_VISIBLE_DEVICES=value (None: unset)."""
    if value is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    return tcuda._parse_visible_devices()


def _sim_nvml():
    """(count, UUIDs) as the simulated NVML answers them (nvmlDeviceGetCount_v2,
    nvmlDeviceGetUUID): what torch's _raw_device_count_nvml / _raw_device_uuid_nvml read."""
    from accel import sim
    from accel._ffi import _nvml
    ffi, lib = _nvml.ffi, sim.open_library("nvml")
    assert lib.nvmlInit_v2() == 0
    n = ffi.new("unsigned int *")
    assert lib.nvmlDeviceGetCount_v2(n) == 0
    uuids = []
    handle, buf = ffi.new("nvmlDevice_t *"), ffi.new("char[]", 96)
    for i in range(n[0]):
        assert lib.nvmlDeviceGetHandleByIndex_v2(i, handle) == 0
        assert lib.nvmlDeviceGetUUID(handle[0], buf, 96) == 0
        uuids.append(ffi.string(buf).decode())
    lib.nvmlShutdown()
    return n[0], uuids


def _torch_count_nvml(monkeypatch, count, uuids):
    """torch.cuda._device_count_nvml() with NVML answering ``count`` and ``uuids``."""
    monkeypatch.setattr(tcuda, "_raw_device_count_nvml", lambda: count)
    monkeypatch.setattr(tcuda, "_raw_device_uuid_nvml", lambda: list(uuids))
    return tcuda._device_count_nvml()


def _sim_runtime_count(value, devices):
    """What the simulated libcudart counts at cuInit under CUDA_VISIBLE_DEVICES=value."""
    from accel.sim.cudart.state import visible_ordinals
    return len(visible_ordinals(value, devices))


def _random_visible_values(rng, uuids, n):
    """``n`` seeded CUDA_VISIBLE_DEVICES values: ordinals (in range, past the end, negative,
    signed, spaced, with trailing junk, repeated), UUID prefixes (unique, ambiguous, unknown,
    repeated, spaced), MIG ids and junk, one to four entries each."""
    atoms = ["0", "1", "2", "3", "5", "64", "-1", "+1", "-0", " 1", "1 ", "1gpu", "x", "", "00",
             "99999999999999999999",
             uuids[0], uuids[1], uuids[0][:8], uuids[1][:12], "GPU-acce", "GPU-ffff", " " + uuids[1][:12],
             "MIG-1a2b", "MIG-GPU-" + uuids[0][4:], "gpu-acce"]
    return [",".join(rng.choice(atoms) for _ in range(rng.randint(1, 4))) for _ in range(n)]


class _TorchAcceleratorIsAccel:
    """torch.accelerator's Python helpers with accel answering the two C++ questions they ask
    (``current_accelerator()`` and ``current_device_index()``): the CPU wheel has no accelerator."""

    def __init__(self, monkeypatch):
        acc = accel.current_accelerator()
        monkeypatch.setattr(tacc, "current_accelerator",
                            lambda check_available=False: torch.device(acc.type))
        monkeypatch.setattr(tacc, "current_device_index", accel.current_device_index)

    @staticmethod
    def get_device_index(dev, optional):
        """(index, None) or (None, exception) from torch's _get_device_index (an accel.device
        given as the torch.device it stands for)."""
        if isinstance(dev, accel.device):
            dev = torch.device(str(dev))
        try:
            return tacc_utils._get_device_index(dev, optional), None
        except Exception as exc:       # noqa: BLE001 - the oracle's answer, compared below
            return None, exc


def _outcome(fn):
    try:
        return fn(), None
    except Exception as exc:           # noqa: BLE001
        return None, exc


def _started():
    from accel import sim
    return sim.state().runtime_initialized


# ================================================= test_cuda_nvml_based_avail.py's functions
PARSE_CASES = [
    None, "", "-1", "0", "1", "0,1", "1,0", "0,0", "0,5,0", "5,0", "1,5,0", "0,-1,1", "+1", "-0",
    "1gpu2", "1gpu2,2ampere", "1 , 0", " 1", "1,,0", "0x1", "01", "00,0", "1.5", "1e1",
    "0, 1, 2, -1, 3", "0, 1, 2, 1", "2, +3, -0, 5", "one,two,3,4", "4,3,two,one",
    "GPU-", "GPU-9e8d35e3", "GPU-123, 2", "GPU-acce,GPU-x", "GPU-a, GPU-b", "GPU-a,GPU-a", "GPU-a,MIG-b",
    "MIG-89c850dc", "MIG-a,GPU-b", "MIG-a,MIG-a", "gpu-acce", "0,GPU-acce", "99999999999999999999",
]


@pytest.mark.parametrize("value", PARSE_CASES)
def test_cuda_nvml_based_avail__parse_visible_devices_agrees_with_torch(monkeypatch, value):
    # torch's parser returns list(range(64)) for an unset variable (then trimmed to the NVML
    # count); accel's returns the ALL marker (every device NVML counts)
    expected = _torch_parse(monkeypatch, value)
    got = _visible.parse(value)
    if value is None:
        assert got is _visible.ALL and expected == list(range(64))
    else:
        assert got == expected


@pytest.mark.parametrize("value, torch_reads", [
    ("+", ValueError), ("-", ValueError), ("²", ValueError), ("1,-", ValueError),
    ("١", [1]), ("٣,0", [3, 0]), ("0,٢", [0, 2]),
])
def test_cuda_nvml_based_avail__parse_visible_devices_c_strtoul_where_torch_differs(monkeypatch, value, torch_reads):
    # torch's _strtoul is str.isdigit-based: a lone sign or a superscript digit raises
    # ValueError out of _parse_visible_devices (and out of torch.cuda.device_count(), whose
    # _device_count_nvml catches OSError/AttributeError only); Arabic-Indic digits read as
    # numbers.  The CUDA runtime reads the variable with C strtoul, for which only ASCII digits
    # are digits: accel reads it so (_visible._strtoul), and its NVML count then agrees with the
    # runtime's count after init.  Not a bug: torch's count would disagree with CUDA's.
    if isinstance(torch_reads, list):
        assert _torch_parse(monkeypatch, value) == torch_reads
    else:
        with pytest.raises(torch_reads):
            _torch_parse(monkeypatch, value)
    c_reads = []
    for elem in value.split(","):
        elem = elem.strip()
        digits = len(elem) - len(elem.lstrip("0123456789"))
        if not digits:
            break
        c_reads.append(int(elem[:digits]))
    assert _visible.parse(value) == c_reads


def test_cuda_nvml_based_avail__transform_uuid_to_ordinals_agrees_with_torch():
    # seeded lists of candidates drawn from prefixes of torch's eight test UUIDs and of the
    # simulator's: unique, ambiguous ("GPU-e", "GPU-acce"), unknown, repeated, full
    from accel.sim import core
    torch_uuids = [
        "GPU-9942190a-aa31-4ff1-4aa9-c388d80f85f1", "GPU-9e8d35e3-a134-0fdd-0e01-23811fdbd293",
        "GPU-e429a63e-c61c-4795-b757-5132caeb8e70", "GPU-eee1dfbc-0a0f-6ad8-5ff6-dc942a8b9d98",
        "GPU-bbcd6503-5150-4e92-c266-97cc4390d04e", "GPU-472ea263-58d7-410d-cc82-f7fdece5bd28",
        "GPU-e56257c4-947f-6a5b-7ec9-0f45567ccf4e", "GPU-1c20e77d-1c1a-d9ed-fe37-18b8466a78ad",
    ]
    rng = random.Random(SEED)
    for uuids in (torch_uuids, [core.uuid_text(i) for i in range(4)]):
        pool = [u[:k] for u in uuids for k in (4, 5, 6, 8, 13, len(u))] + ["GPU-123", "GPU-zz"]
        for _ in range(400):
            candidates = [rng.choice(pool) for _ in range(rng.randint(1, 5))]
            assert _visible.uuids_to_ordinals(candidates, uuids) == \
                tcuda._transform_uuid_to_ordinals(candidates, uuids), candidates


@pytest.mark.parametrize("devices", [2, 4])
def test_cuda_nvml_based_avail__device_count_nvml_agrees_with_torch(monkeypatch, devices):
    # torch.cuda.device_count() before init = _device_count_nvml(), or cudaGetDeviceCount when
    # that says -1 (MIG ids; NVML failures).  accel.device_count() before init must give the
    # same number, start the runtime only where torch's falls back to it, and agree with the
    # runtime's own count after init (no reconcile warning).
    from accel.sim import core
    rng = random.Random(SEED + devices)
    uuids = [core.uuid_text(i) for i in range(devices)]
    values = [None] + PARSE_CASES[1:] + _random_visible_values(rng, uuids, 60)
    for value in values:
        env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
        if value is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        use_sim(monkeypatch, "cuda", ACCEL_SIM_DEVICES=devices, **env)
        count, nvml_uuids = _sim_nvml()
        assert (count, nvml_uuids) == (devices, uuids)
        expected = _torch_count_nvml(monkeypatch, count, nvml_uuids)
        falls_back = expected < 0
        if falls_back:
            expected = _sim_runtime_count(value, devices)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = accel.device_count()
            assert (got, _started()) == (expected, falls_back), value
            if got:
                accel.Buffer(8)
                assert accel.device_count() == got, value


def test_cuda_nvml_based_avail__device_count_falls_back_to_the_runtime_as_torch(monkeypatch):
    # no NVML (torch: CDLL raises OSError -> -1) and a failing nvmlDeviceGetCount_v2 (torch:
    # "Can't get nvml device count" -> -1): both ask cudaGetDeviceCount, which reads the variable
    from accel import sim
    use_sim(monkeypatch, "cuda", CUDA_VISIBLE_DEVICES="1")
    sim.configure(nvml=False)
    assert accel.device_count() == 1 and _started()
    use_sim(monkeypatch, "cuda", CUDA_VISIBLE_DEVICES="1,0")
    sim.inject_error("nvmlDeviceGetCount_v2", 999, times=-1)
    assert accel.device_count() == 2 and _started()
    # NVML loads but nvmlInit fails (torch: warns "Can't initialize NVML" -> -1): the runtime
    # counts; accel warns nothing (the reason is in accel.backends report()'s nvml_error)
    use_sim(monkeypatch, "cuda", CUDA_VISIBLE_DEVICES="0")
    sim.inject_error("nvmlInit_v2", 9, times=-1)          # NVML_ERROR_DRIVER_NOT_LOADED
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert accel.device_count() == 1 and _started()
    # a UUID NVML cannot read: torch's _raw_device_uuid_nvml returns None -> -1 -> the runtime
    use_sim(monkeypatch, "cuda", CUDA_VISIBLE_DEVICES="GPU-acce1111")
    sim.inject_error("nvmlDeviceGetUUID", 999, times=-1)
    assert accel.device_count() == 1 and _started()


@pytest.mark.parametrize("value", ["", "-1", "0,0", "x", "GPU-a,GPU-a"])
# (r69j found; fixed in session 29)
def test_cuda_nvml_based_avail__empty_visible_list_needs_no_library(monkeypatch, value):
    # torch.cuda.device_count(): _parse_visible_devices() is [] -> 0, nothing loaded, nothing
    # cached (not initialized); the variable changed before init is read again by the next count
    from accel import sim
    use_sim(monkeypatch, "cuda", CUDA_VISIBLE_DEVICES=value)
    sim.configure(nvml=False)
    assert accel.device_count() == 0
    assert not _started()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert accel.device_count() == 2


def _child_uses_device_1() -> int:
    os.environ["CUDA_VISIBLE_DEVICES"] = "1"
    try:
        accel.Buffer(8)
    except RuntimeError:
        return 10
    return 0


# (r69j found; fixed in session 29)
def test_cuda_nvml_based_avail__empty_visible_list_keeps_fork_usable(monkeypatch):
    # a CPU-only parent hides the GPUs, checks, then forks workers that each pick a GPU
    from accel import sim
    use_sim(monkeypatch, "cuda", CUDA_VISIBLE_DEVICES="")
    sim.configure(nvml=False)
    assert not accel.is_available()
    assert run_forked(_child_uses_device_1) == 0


@pytest.mark.parametrize("value", [None, "1,0", "1", "0,1,5", "GPU-acce1111", "GPU-acce1111,GPU-acce0000"])
def test_cuda_nvml_based_avail__get_nvml_device_index_agrees_with_torch(monkeypatch, value):
    # torch.cuda's NVML readings (temperature, utilization, ...) map a visible index to NVML's
    # with _get_nvml_device_index; accel's backend with smi_index.  Same NVML index for every
    # visible device; an index past the visible ones is a RuntimeError in both (torch's from
    # _get_nvml_device_index or pynvml, accel's InvalidDeviceError from the public reading)
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    use_sim(monkeypatch, "cuda", **env)
    count, uuids = _sim_nvml()
    monkeypatch.setattr(tcuda, "_raw_device_uuid_nvml", lambda: list(uuids))
    n = accel.device_count()
    backend = _lazy.backend()
    for index in range(n):
        assert backend.smi_index(index) == tcuda._get_nvml_device_index(index), (value, index)
    with pytest.raises(RuntimeError):
        accel.temperature(n)
    assert not _started()


# ============================================================== torch.accelerator: device arguments
DEVICE_ARGS = [
    None, 0, 1, 2, -1, -2, "cuda", "cuda:0", "cuda:1", "cuda:2", "cpu", "cpu:0", "xpu", "xpu:0", "xpu:1",
    "xpu:2", "mps", "foo", "cuda:-1", "xpu:-1", "cuda:01", "cuda: 1", "", "CUDA:1",
    ("torch", "cuda", 1), ("torch", "cuda", None), ("torch", "cpu", None), ("torch", "xpu", 0),
    ("torch", "xpu", 1), ("torch", "xpu", None), ("accel", "cuda", 1), ("accel", "cuda", None), ("accel", "xpu", 1),
]


def _make_arg(spec):
    if isinstance(spec, tuple):
        maker, kind, index = spec
        return (torch.device if maker == "torch" else accel.device)(kind, index) if index is not None \
            else (torch.device if maker == "torch" else accel.device)(kind)
    return spec


def _same_error(got, expected, arg):
    """accel's exception for ``arg`` is torch's kind: the same message for torch's own
    ValueErrors; for a string torch.device refuses, a RuntimeError (accel's
    InvalidDeviceError is a RuntimeError and a ValueError, with its own words)."""
    assert got is not None, f"{arg!r}: accel accepted what torch refuses ({expected!r})"
    assert isinstance(got, type(expected)), (arg, got, expected)
    if isinstance(expected, ValueError):
        assert str(got) == str(expected), arg


@pytest.mark.parametrize("optional", [False, True])
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_accelerator_utils__get_device_index_agrees_with_torch(monkeypatch, kind, optional):
    # torch/accelerator/_utils.py::_get_device_index, run with accel as the accelerator, against
    # accel._device.device_index, for every argument form; device 0 current, 2 devices
    use_sim(monkeypatch, kind)
    oracle = _TorchAcceleratorIsAccel(monkeypatch)
    accel.set_device_index(0)
    for spec in DEVICE_ARGS:
        arg = _make_arg(spec)
        expected, texc = oracle.get_device_index(arg, optional)
        got, gexc = _outcome(lambda: _device.device_index(arg, optional))
        if texc is not None:
            _same_error(gexc, texc, arg)
        else:
            assert gexc is None and got == expected, (arg, got, gexc, expected)


def test_accelerator_utils__argument_types_accel_refuses_on_purpose(monkeypatch):
    # accel/_device.py: "On top of torch, wrong types raise TypeError".  torch's _get_device_index
    # takes a bool as an int (True is device 1), and a float, list or bytes as "no index"
    # (ValueError where an index is needed, the current device where optional); a numpy integer
    # is no int to torch either, while accel takes it as the index it is.  Recorded, not a bug.
    use_sim(monkeypatch, "cuda")
    oracle = _TorchAcceleratorIsAccel(monkeypatch)
    accel.set_device_index(0)
    assert oracle.get_device_index(True, False) == (True, None)
    for arg in (1.0, [1], b"cuda:1", np.int64(1)):
        assert oracle.get_device_index(arg, True) == (0, None)
        assert isinstance(oracle.get_device_index(arg, False)[1], ValueError)
    for arg in (True, 1.0, [1], b"cuda:1"):
        for optional in (False, True):
            with pytest.raises(TypeError):
                _device.device_index(arg, optional)
    assert _device.device_index(np.int64(1)) == 1


def _torch_parse_refuses(monkeypatch, arg, optional):
    oracle = _TorchAcceleratorIsAccel(monkeypatch)
    return oracle.get_device_index(arg, optional)[1]


# (accel function, torch's optional flag) of the public functions taking a device argument
_ACCEL_DEVICE_FUNCTIONS = {
    "set_device_index": (lambda a: accel.set_device_index(a), False),
    "current_stream": (lambda a: accel.current_stream(a), True),
    "synchronize": (lambda a: accel.synchronize(a), True),
    "get_device_capability": (lambda a: accel.get_device_capability(a), True),
    "get_memory_info": (lambda a: accel.get_memory_info(a), True),
}


@pytest.mark.parametrize("name", sorted(_ACCEL_DEVICE_FUNCTIONS))
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_accelerator__refused_device_argument_before_init(monkeypatch, kind, name):
    # every argument torch's Python layer refuses (another device type, an index-less device
    # where one is needed, a malformed string, None for set_device_index) is refused by accel
    # with torch's error kind, and, as torch raises before any C++ call, starts nothing
    fn, optional = _ACCEL_DEVICE_FUNCTIONS[name]
    refused = []
    for spec in DEVICE_ARGS:
        use_sim(monkeypatch, kind)
        arg = _make_arg(spec)
        texc = _torch_parse_refuses(monkeypatch, arg, optional)
        if texc is None:
            continue
        refused.append(spec)
        got, gexc = _outcome(lambda: fn(arg))
        _same_error(gexc, texc, arg)
        if name not in ("current_stream", "get_device_capability"):
            assert not _lazy.is_initialized() and not _started(), arg
    assert len(refused) >= 12


@pytest.mark.parametrize("name", ["current_stream", "get_device_capability"])
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
# (r69j found; fixed in session 29)
def test_accelerator__refused_device_argument_starts_nothing(monkeypatch, kind, name):
    fn, optional = _ACCEL_DEVICE_FUNCTIONS[name]
    other = "xpu" if kind == "cuda" else "cuda"
    started = []
    for spec in ("cpu", f"{other}:1", "foo", f"{kind}:-1", ("torch", "cpu", None), ("torch", other, 0)):
        use_sim(monkeypatch, kind)
        arg = _make_arg(spec)
        with pytest.raises((ValueError, RuntimeError)):
            fn(arg)
        if _lazy.is_initialized():
            started.append(spec)
    assert started == []


def test_accelerator__set_device_index_indices(monkeypatch):
    # torch: a negative index is a no-op (checked before anything is initialized); an index
    # >= count is an error once initialized (cudaSetDevice: invalid device ordinal, a
    # RuntimeError); device 1 then device 0 through every form
    use_sim(monkeypatch, "cuda")
    for index in (-1, -2, -128):
        accel.set_device_index(index)
    assert not _started()
    accel.set_device_index(0)
    for arg in (1, "cuda:1", torch.device("cuda", 1), accel.device("cuda", 1), np.int64(1)):
        accel.set_device_index(0)
        accel.set_device_index(arg)
        assert accel.current_device_index() == 1, arg
    accel.set_device_index(-1)
    assert accel.current_device_index() == 1
    for arg in (2, "cuda:2", 127):
        with pytest.raises(RuntimeError):
            accel.set_device_index(arg)
        assert accel.current_device_index() == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accel.set_device_idx(0)
        assert accel.current_device_idx() == 0
    assert [str(w.message) for w in caught] == ["Use `set_device_index` instead.",
                                               "Use `current_device_index` instead."]
    assert all(w.category is FutureWarning for w in caught)


def test_accelerator__current_stream_indices(monkeypatch):
    # device 1's stream while device 0 is current, by every form; an index past the devices is
    # torch's check_gpu RuntimeError; current_stream() initializes
    use_sim(monkeypatch, "cuda")
    assert accel.current_stream().device_index == 0 and _started()
    s1 = accel.Stream(device=1)
    accel.set_stream(s1)
    assert accel.current_device_index() == 1          # set_stream switches the device first
    accel.set_device_index(0)
    for arg in (1, "cuda:1", torch.device("cuda", 1), accel.device("cuda", 1)):
        assert accel.current_stream(arg) is s1, arg
    for arg in (None, "cuda", torch.device("cuda")):
        assert accel.current_stream(arg).device_index == 0
    for arg in (2, -2, "cuda:2"):
        with pytest.raises(RuntimeError, match="out of index range"):
            accel.current_stream(arg)


# (r69j found; fixed in session 29)
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_accelerator__current_stream_minus_one_is_the_current_device(monkeypatch, kind):
    # (c10/xpu/XPUStream.cpp getCurrentXPUStream reads -1 the same way)
    use_sim(monkeypatch, kind)
    accel.set_device_index(1)
    s1 = accel.Stream(device=1)
    accel.set_stream(s1)
    assert accel.current_stream(-1) is s1


# (r69j found; fixed in session 29)
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_cuda__default_stream_minus_one_is_the_current_device(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    accel.set_device_index(1)
    assert accel.default_stream(-1) is accel.default_stream(1)


def test_accelerator__synchronize_and_device_index_indices(monkeypatch):
    # synchronize: before init a no-op for any index (torch's C++ checks is_device_initialized
    # before using it), after init an index outside the devices is a RuntimeError.  device_index:
    # None does nothing, device 1 is current in the body and 0 after.
    use_sim(monkeypatch, "cuda")
    for arg in (0, 1, 2, -1, "cuda:1", torch.device("cuda", 1)):
        accel.synchronize(arg)
    assert not _started()
    with accel.device_index(None):
        pass
    assert not _started()
    accel.set_device_index(0)
    for arg in (1, "cuda:1", torch.device("cuda", 1), None):
        accel.synchronize(arg)
    for arg in (2, -1):
        with pytest.raises(RuntimeError):
            accel.synchronize(arg)
    for arg in (1, "cuda:1", torch.device("cuda", 1), accel.device("cuda", 1)):
        with accel.device_index(arg) as entered:
            assert entered is None
            assert accel.current_device_index() == 1
        assert accel.current_device_index() == 0
    with pytest.raises(RuntimeError):
        with accel.device_index(2):
            pass
    assert accel.current_device_index() == 0


def test_accelerator__device_index_negative_is_a_no_op(monkeypatch):
    # torch.accelerator.device_index(-1) reaches c10::cuda::ExchangeDevice(-1) ->
    # cudaSetDevice(-1): "CUDA error: invalid device ordinal"; torch.cuda.device(-1) is a no-op.
    # accel's one device_index serves both and does nothing: code that runs under torch runs
    # here.  Recorded, not an xfail.
    use_sim(monkeypatch, "cuda")
    accel.set_device_index(1)
    with accel.device_index(-1):
        assert accel.current_device_index() == 1
    assert accel.current_device_index() == 1


def test_accelerator__current_accelerator_and_counts(monkeypatch):
    # torch.accelerator.current_accelerator(): the type, index None; check_available=True gives
    # None when no device is available; device_count()/is_available() start nothing
    use_sim(monkeypatch, "cuda")
    acc = accel.current_accelerator()
    assert (acc.type, acc.index) == ("cuda", None)
    assert accel.current_accelerator(check_available=True) == acc
    assert accel.device_count() == 2 and accel.is_available()
    assert not _started()
    use_sim(monkeypatch, "cuda", CUDA_VISIBLE_DEVICES="-1")
    assert accel.current_accelerator() == acc
    assert accel.current_accelerator(check_available=True) is None
    assert accel.device_count() == 0 and not accel.is_available()


# ==================================================================== memory: torch's code on accel's stats
def _two_device_backend(monkeypatch, kind):
    use_sim(monkeypatch, kind)
    if accel.device_count() < 2:
        pytest.skip("one simulated device (Metal)")
    accel.set_device_index(0)


def _allocate_on_device_1():
    """Live and freed blocks on device 1 of several sizes (small, large, oversize-free), device 0
    current; device 0 gets one small block."""
    keep0 = accel.Buffer(1000, device=0)
    with accel.device_index(1):
        keep = [accel.Buffer(n) for n in (512, 3000, 1 << 20, 5 << 20, 12 << 20)]
        for n in (700, 2 << 20, 25 << 20):
            accel.Buffer(n)                     # freed at once
    assert accel.current_device_index() == 0
    return keep0, keep


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_cuda_memory__memory_stats_flattening_is_torchs(monkeypatch, kind):
    # torch.cuda.memory.memory_stats(device) = torch's _recurse_add_to_result over
    # memory_stats_as_nested_dict(device), sorted; here torch's function runs on accel's nested
    # dict (a MemPool adds a reserved_bytes_by_private_pools entry keyed by a tuple)
    _two_device_backend(monkeypatch, kind)
    keep = _allocate_on_device_1()
    with accel.device_index(1):
        pool = M.MemPool()
        with M.use_mem_pool(pool):
            in_pool = accel.Buffer(4096)
    monkeypatch.setattr(tcuda_memory, "memory_stats_as_nested_dict",
                        lambda device=None: M.memory_stats_as_nested_dict(device))
    for dev in (1, "cuda:1" if kind == "cuda" else "xpu:1", accel.device(kind, 1), None):
        flat = tcuda_memory.memory_stats(device=dev)
        assert isinstance(flat, collections.OrderedDict)
        assert list(flat.items()) == list(M.memory_stats(dev).items()), dev
    assert any(k.startswith("reserved_bytes_by_private_pools.") for k in M.memory_stats(1))
    assert M.memory_stats(1) != M.memory_stats(0)
    del in_pool, keep


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_accelerator_memory__memory_stats_keys_and_values_are_torchs(monkeypatch, kind):
    # torch/accelerator/memory.py: flatten(_accelerator_getDeviceStats(index)), sorted; its C++
    # dict has 6 scalars, 9 pooled stats x {all,small_pool,large_pool} x 4 and 2 oversize x 4.
    # torch's Python runs here on accel's nested dict without the keys torch.accelerator's
    # binding lacks (num_oom_rejections, reserved_bytes_by_private_pools): the rest must be
    # accel's memory_stats, value for value; memory_allocated & co are its four keys
    _two_device_backend(monkeypatch, kind)
    keep = _allocate_on_device_1()
    nested = {k: v for k, v in M.memory_stats_as_nested_dict(1).items()
              if k not in ("num_oom_rejections", "reserved_bytes_by_private_pools")}
    monkeypatch.setattr(torch._C, "_accelerator_isAllocatorInitialized", lambda: True)
    monkeypatch.setattr(torch._C, "_accelerator_getDeviceStats", lambda i: nested if i == 1 else None)
    flat = tacc_memory.memory_stats(1)
    assert len(flat) == 6 + 9 * 3 * 4 + 2 * 4
    ours = M.memory_stats(1)
    assert set(ours) - set(flat) == {"num_oom_rejections"}
    assert list(flat.items()) == [(k, v) for k, v in ours.items() if k in flat]
    for name, key in (("memory_allocated", "allocated_bytes.all.current"),
                      ("max_memory_allocated", "allocated_bytes.all.peak"),
                      ("memory_reserved", "reserved_bytes.all.current"),
                      ("max_memory_reserved", "reserved_bytes.all.peak")):
        assert getattr(tacc_memory, name)(1) == getattr(M, name)(1) == ours[key] > 0, name
    del keep


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_accelerator_memory__reset_functions_on_device_1(monkeypatch, kind):
    # reset_peak_memory_stats: every peak becomes its current; reset_accumulated_memory_stats:
    # every allocated/freed counter and num_alloc_retries, num_ooms, num_sync_all_streams,
    # num_device_alloc, num_device_free become 0 (CUDACachingAllocator resetPeakStats /
    # resetAccumulatedStats); currents stay; device 0 untouched; max_memory_* follow the reset
    _two_device_backend(monkeypatch, kind)
    keep0, keep = _allocate_on_device_1()
    before0 = M.memory_stats(0)
    before = M.memory_stats(1)
    assert M.max_memory_allocated(1) > M.memory_allocated(1)
    assert M.max_memory_reserved(1) >= M.memory_reserved(1)
    M.reset_peak_memory_stats(f"{kind}:1")
    after = M.memory_stats(1)
    for key, value in after.items():
        if key.endswith(".peak"):
            assert value == after[key[:-len("peak")] + "current"], key
        else:
            assert value == before[key], key
    assert M.max_memory_allocated(1) == M.memory_allocated(1)
    assert M.max_memory_reserved(1) == M.memory_reserved(1)
    assert M.memory_stats(0) == before0
    M.reset_accumulated_memory_stats(torch.device(kind, 1))
    reset = M.memory_stats(1)
    zeroed = {"num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free"}
    for key, value in reset.items():
        if key.endswith((".allocated", ".freed")) or key in zeroed:
            assert value == 0, key
        else:
            assert value == after[key], key
    assert M.memory_stats(0) == before0
    # after a reset a new peak is counted from the current value
    with accel.device_index(1):
        extra = accel.Buffer(3 << 20)
    assert M.max_memory_allocated(1) == M.memory_allocated(1) == after["allocated_bytes.all.current"] + (3 << 20)
    del extra, keep, keep0


@pytest.mark.parametrize("abbreviated", [False, True])
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_cuda_memory__memory_summary_is_torchs_table(monkeypatch, kind, abbreviated):
    # torch.cuda.memory_summary's formatter run on accel's statistics of device 1 (device 0
    # current) gives accel's table but for the title (README: "accel CUDA memory summary") and,
    # off CUDA, the OOM/retry line's call name
    _two_device_backend(monkeypatch, kind)
    keep = _allocate_on_device_1()
    monkeypatch.setattr(tcuda_memory, "_get_device_index", lambda device, optional=False: device)
    monkeypatch.setattr(tcuda_memory, "memory_stats", lambda device=None: M.memory_stats(device))
    theirs = tcuda_memory.memory_summary(1, abbreviated=abbreviated).splitlines()
    ours = M.memory_summary(1, abbreviated=abbreviated).splitlines()
    assert len(ours) == len(theirs) and all(len(line) == 77 for line in ours)
    differing = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    assert differing == ([1] if kind == "cuda" else [1, 3])
    assert "memory summary, device ID 1 " in ours[1]
    del keep


def test_cuda_memory__memory_summary_units_fuzz():
    # torch's size/count formatting (units chosen from the row's first column, 768 KiB and
    # 750 K thresholds) on seeded random statistics from 0 to 2**52, abbreviated or not
    from accel.memory import _summary
    rng = random.Random(SEED)
    names = ("allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes", "inactive_split_bytes",
             "allocation", "active", "segment", "inactive_split")
    for trial in range(60):
        stats = {"num_ooms": rng.randrange(10 ** rng.randint(0, 6)),
                 "num_alloc_retries": rng.randrange(10 ** rng.randint(0, 6))}
        for name in names:
            for pool in ("all", "large_pool", "small_pool"):
                for metric in ("current", "peak", "allocated", "freed"):
                    stats[f"{name}.{pool}.{metric}"] = rng.randrange(1 << rng.randint(0, 52))
        for name in ("oversize_allocations", "oversize_segments"):
            for metric in ("current", "peak", "allocated", "freed"):
                stats[f"{name}.{metric}"] = rng.randrange(1 << rng.randint(0, 30))
        stats = collections.OrderedDict(sorted(stats.items()))
        device = rng.randrange(8)
        abbreviated = bool(trial % 2)
        theirs = _torch_summary(stats, device, abbreviated).splitlines()
        ours = _summary.summary(stats, device, "cuda", abbreviated).splitlines()
        assert [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b] == [1], trial
        assert len(ours) == len(theirs)


def _torch_summary(stats, device, abbreviated):
    saved = tcuda_memory._get_device_index, tcuda_memory.memory_stats
    tcuda_memory._get_device_index = lambda d, optional=False: d
    tcuda_memory.memory_stats = lambda device=None: stats
    try:
        return tcuda_memory.memory_summary(device, abbreviated=abbreviated)
    finally:
        tcuda_memory._get_device_index, tcuda_memory.memory_stats = saved


def test_accelerator_memory__queries_before_init_take_every_form(monkeypatch):
    # torch.accelerator.memory before the allocator is initialized: memory_stats is an empty
    # OrderedDict, the four scalars 0, the resets no-ops, whatever the device argument (torch
    # does not even parse it there); nothing starts.  accel also refuses, before init as after,
    # a malformed string and a negative index (accel/memory/__init__.py _form: recorded).
    use_sim(monkeypatch, "cuda")
    for arg in (None, 0, 1, 2, "cuda", "cuda:1", "cuda:7", "cpu", "xpu:1", accel.device("cuda", 1),
                torch.device("cuda", 1), torch.device("cuda")):
        assert M.memory_stats(arg) == collections.OrderedDict() and \
            isinstance(M.memory_stats(arg), collections.OrderedDict), arg
        assert M.memory_stats_as_nested_dict(arg) == {}
        for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
            assert getattr(M, name)(arg) == 0, (name, arg)
        M.reset_peak_memory_stats(arg)
        M.reset_accumulated_memory_stats(arg)
        M.empty_cache()
        M.empty_host_cache()
    assert not _started()
    for arg in (-1, "foo", "cuda:-1"):
        with pytest.raises(RuntimeError):
            M.memory_stats(arg)
    assert not _started()


# (r69j found; fixed in session 29)
def test_accelerator_memory__torch_device_of_another_type_before_init(monkeypatch):
    use_sim(monkeypatch, "cuda")
    assert M.memory_stats("cpu") == {}
    assert M.memory_stats(torch.device("cpu")) == {}
    assert M.memory_allocated(torch.device("xpu", 0)) == 0
    M.reset_peak_memory_stats(torch.device("cpu"))


def test_accelerator_memory__queries_after_init_refuse_as_torch(monkeypatch):
    # after init torch parses the argument: another type is the ValueError of _get_device_index,
    # an index outside the devices the allocator's "Invalid device argument" RuntimeError;
    # get_memory_info of device 1 with device 0 current leaves device 0 current
    use_sim(monkeypatch, "cuda")
    oracle = _TorchAcceleratorIsAccel(monkeypatch)
    accel.set_device_index(0)
    for fn in (M.memory_stats, M.memory_allocated, M.reset_peak_memory_stats,
               M.reset_accumulated_memory_stats, M.get_memory_info):
        for arg in ("cpu", "xpu:1", torch.device("cpu"), "mps:0"):
            texc = oracle.get_device_index(arg, True)[1]
            _same_error(_outcome(lambda: fn(arg))[1], texc, arg)
        for arg in (2, -1, "cuda:2"):
            with pytest.raises(RuntimeError):
                fn(arg)
    free, total = M.get_memory_info(1)
    assert 0 < free <= total
    assert M.get_memory_info("cuda:1") == (free, total) or M.get_memory_info("cuda:1")[1] == total
    assert accel.current_device_index() == 0
