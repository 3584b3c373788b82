"""Adversarial review (r71b) of sessions 29-30 (6044cf2..4fd6984): the library loader
(accel/_ffi: ``elf_problem``, ``_explicit``, ``LibraryNotFound.override``, the entry symbols), the
runtime choice (accel/backends/cuda/libs.py, discovery.py, nvrtc.py), seeding before
initialization and the int32 ``_wide`` randint rule (accel/random), and the fatbin/cubin readers
(accel/_cuda_containers.py).

Oracles: torch 2.13's CPU wheel (its Python and its installed ATen headers: DistributionsHelper.h
``uniform_int_from_to_distribution`` takes ``random64()`` from ``range >= 1ULL << 28`` for every
dtype), REFERENCE.md "Runtime vs driver versions", and the real libcudart 12.4/13.0 wheels and libm
of this machine (copied, truncated or renamed in tmp dirs).  Two simulated CUDA devices where a
device is needed.

Bugs (strict xfails; each reason names the cause):

1. A failing override given as a relative path (ACCEL_CUDART_PATH / ACCEL_NVRTC_PATH), or a lib/
   directory whose two runtimes both fail, is not recognised as the override: the message falls
   back to "set ACCEL_CUDART_PATH to the library's full path" (set already), and accel.compile says
   NVRTC "is not installed" (the r69g wording the override message replaced).
2. open_library("cudart") with ACCEL_CUDART_PATH naming another library raises cffi's "symbol not
   found" error, not LibraryNotFound (_open_first_cudart calls cudaRuntimeGetVersion unchecked).
3. A truncated libcudart reached by soname (LD_LIBRARY_PATH; sonames are searched first) still
   kills the process with SIGBUS: the ELF check runs only for candidates with a '/'.
4. A refused default_generator(i) (a bad index) ends the tracking of seeding before init: a later
   set_rng_state is no longer followed by the earlier manual_seed, as torch's queue has it.
5. elf_entries reads section headers at any e_shentsize (0: one header read e_shnum times).
6. fatbin_entries takes an entry whose payload runs past the container's declared end.
7. accel.backends.cuda.libs' module docstring says versions are read from file names (the code never does).
8. A runtime found through a relative sys.path entry (or a relative CUDA_HOME) is chosen by a
   relative path, opened at init: after a chdir it is "cannot open shared object file".
9. manual_seed_all before init seeds only the devices counted at the call; torch's queued call
   seeds every device counted at init (CUDA_VISIBLE_DEVICES widened in between).
10. A lib/ directory whose libcudart.so.12 is a dangling link is reported as holding no libcudart
    (os.path.exists drops the link; the link is never named).

Checked and found fine (guards below, or by hand): the int32/int64 one-word/two-word rule is
torch's (range >= 2**28, every dtype: the CPU wheel's generator consumption and its ATen headers),
and the host path, the simulated kernels (both devices) and tools/philox_kernel.cu, philox.ptx and
philox.metal agree on it; int32 bounds and refusals as torch.randint; the shipped fatbin holds every
kernel name in each SASS image and in its PTX; elf_problem passes all 1640 shared libraries of this
machine (no false "truncated"/"architecture"), and refuses truncated copies, foreign machines;
ELFCLASS32/big-endian files go to the loader's own refusal; malformed fatbin/cubin headers raise
ContainerError, never IndexError/struct.error; accel.device equals and hashes as torch.device; NVML
open+init under one lock, a failed init retried, the lock renewed in a forked child; seeding
before init against torch's queue for the orders r70g did not cover (guard).
"""

import json
import os
import shutil
import struct
import sys

import numpy as np
import pytest

import accel
import accel.random as R
from accel import _cuda_containers, _ffi
from accel.backends.cuda import libs as _cuda_libs
from accel.kernels import _module
from accel.random import _fills, _transforms
from conftest import use_sim
from test_runtime_loader_r70l import _fresh_python, _wheel12

_LIBM = next((p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib/x86_64-linux-gnu/libm.so.6",
                          "/lib64/libm.so.6", "/usr/lib64/libm.so.6") if os.path.exists(p)), None)


def _fresh_loader(monkeypatch):
    """Nothing opened yet as far as open_library/open_nvrtc can tell (this process may have)."""
    monkeypatch.setattr(_ffi, "_opened", {})
    for var in ("ACCEL_CUDART_PATH", "ACCEL_NVRTC_PATH", "ACCEL_NVML_PATH", "CUDA_HOME", "CUDA_PATH",
                "CONDA_PREFIX"):
        monkeypatch.delenv(var, raising=False)


# =============================================================================================
# 1. the override message: relative values and directories
# =============================================================================================
def _open(which: str):
    if which == "cudart":
        return _ffi._open_first_cudart()
    return _ffi.open_nvrtc()


_FILES = {"cudart": "libcudart.so.12", "nvrtc": "libnvrtc.so.13"}
_VARS = {"cudart": "ACCEL_CUDART_PATH", "nvrtc": "ACCEL_NVRTC_PATH"}


@pytest.mark.parametrize("which", ["cudart", "nvrtc"])
def test_guard_an_absolute_override_that_fails_is_named_as_the_override(monkeypatch, tmp_path, which):
    _fresh_loader(monkeypatch)
    monkeypatch.setenv(_VARS[which], str(tmp_path / "nolib" / _FILES[which]))
    with pytest.raises(_ffi.LibraryNotFound) as info:
        _open(which)
    assert info.value.override == _VARS[which], str(info.value)
    assert "to the library's full path" not in str(info.value)


# (r71b found; fixed in session 31)
@pytest.mark.parametrize("which", ["cudart", "nvrtc"])
def test_a_relative_override_that_fails_is_named_as_the_override(monkeypatch, tmp_path, which):
    _fresh_loader(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(_VARS[which], os.path.join("nolib", _FILES[which]))
    with pytest.raises(_ffi.LibraryNotFound) as info:
        _open(which)
    assert info.value.override == _VARS[which], str(info.value)
    assert "to the library's full path" not in str(info.value)


# (r71b found; fixed in session 31)
def test_accel_compile_with_a_bad_relative_nvrtc_path_names_the_variable(monkeypatch, tmp_path):
    from accel.backends.cuda import nvrtc as _nvrtc
    _fresh_loader(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ACCEL_NVRTC_PATH", os.path.join("nolib", "libnvrtc.so.13"))
    with pytest.raises(accel.AcceleratorError) as info:
        _nvrtc.open_lib()
    text = str(info.value)
    assert "ACCEL_NVRTC_PATH=" in text and "not installed" not in text, text


# (r71b found; fixed in session 31)
def test_a_cudart_directory_whose_two_runtimes_fail_is_named_as_the_override(monkeypatch, tmp_path):
    _fresh_loader(monkeypatch)
    lib = tmp_path / "lib"
    lib.mkdir()
    for name in ("libcudart.so.13", "libcudart.so.12"):
        (lib / name).write_text("INPUT(-lcudart_static)\n")
    monkeypatch.setenv("ACCEL_CUDART_PATH", str(lib))
    with pytest.raises(_ffi.LibraryNotFound) as info:
        _ffi._open_first_cudart()
    assert len(info.value.tried) == 2
    assert info.value.override == "ACCEL_CUDART_PATH", str(info.value)


# (r71b found; fixed in session 31)
def test_a_runtime_found_through_a_relative_sys_path_entry_still_opens_after_a_chdir(monkeypatch, tmp_path):
    w12 = _wheel12()
    _fresh_loader(monkeypatch)
    rel = f"deps_{tmp_path.name}"            # unique: probes are cached per path string
    lib = tmp_path / rel / "nvidia" / "cuda_runtime" / "lib"
    lib.mkdir(parents=True)
    os.symlink(w12, lib / "libcudart.so.12")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [rel] + sys.path)        # a script's sys.path.insert(0, "deps")
    monkeypatch.setattr(_ffi, "_cudart_by_path", {})
    choice = _cuda_libs.choose_real(12040, "test: a CUDA 12.4 driver")
    assert choice.usable and choice.chosen.version == 12040, choice.as_dict()
    assert choice.chosen.source == "pip nvidia-cuda-runtime-cu12"
    monkeypatch.chdir("/")                   # the program moves to its output directory, then inits
    _ffi.open_cudart(choice.chosen.path, 12)


# (r71b found; fixed in session 31)
def test_a_cudart_directory_with_a_dangling_link_names_the_link(monkeypatch, tmp_path):
    _fresh_loader(monkeypatch)
    lib = tmp_path / "lib"
    lib.mkdir()
    os.symlink("libcudart.so.12.4.127", lib / "libcudart.so.12")    # copied without its target
    monkeypatch.setenv("ACCEL_CUDART_PATH", str(lib))
    choice = _cuda_libs.choose_real(12040, "test: a CUDA 12.4 driver")
    assert choice.chosen is None
    assert [c.path for c in choice.candidates] == [str(lib / "libcudart.so.12")], choice.as_dict()
    assert "symbolic link" in choice.error, choice.error


# =============================================================================================
# 2. open_library("cudart") on another library
# =============================================================================================
@pytest.mark.skipif(_LIBM is None, reason="needs a Linux libm to stand in for another library")
def test_guard_the_chooser_refuses_another_library_as_a_cudart(monkeypatch):
    _fresh_loader(monkeypatch)
    monkeypatch.setenv("ACCEL_CUDART_PATH", _LIBM)
    choice = _cuda_libs.choose_real(12040, "test: a CUDA 12.4 driver")
    assert choice.chosen is None and "not a libcudart" in choice.error


# (r71b found; fixed in session 31)
@pytest.mark.skipif(_LIBM is None, reason="needs a Linux libm to stand in for another library")
def test_open_library_cudart_on_another_library_is_library_not_found(monkeypatch):
    _fresh_loader(monkeypatch)
    monkeypatch.setenv("ACCEL_CUDART_PATH", _LIBM)
    with pytest.raises(_ffi.LibraryNotFound) as info:
        _ffi.open_library("cudart")
    assert "cudaRuntimeGetVersion" in str(info.value), str(info.value)


# =============================================================================================
# 3. a truncated libcudart reached by soname
# =============================================================================================
_CHOOSE = """
import json
from accel.backends.cuda import libs as _cuda_libs
ch = _cuda_libs.choose_real(12040, "test: a CUDA 12.4 driver")
print(json.dumps(ch.as_dict()))
"""


def _truncated_copy(tmp_path, name: str) -> str:
    w12 = _wheel12()
    d = tmp_path / "ldpath"
    d.mkdir()
    data = open(w12, "rb").read()
    (d / name).write_bytes(data[:len(data) // 2])       # an interrupted copy
    return str(d)


def test_guard_a_truncated_libcudart_under_cuda_home_is_skipped(tmp_path):
    d = _truncated_copy(tmp_path, "libcudart.so.12")
    home = tmp_path / "cuda"
    home.mkdir()
    os.symlink(d, home / "lib64")
    out = _fresh_python(_CHOOSE, check=False, CUDA_HOME=str(home))
    assert out.returncode == 0, out.returncode


# (r71b found; fixed in session 31)
def test_a_truncated_libcudart_found_by_soname_does_not_kill_the_process(tmp_path):
    d = _truncated_copy(tmp_path, "libcudart.so.12")
    out = _fresh_python(_CHOOSE, check=False, LD_LIBRARY_PATH=d)
    assert out.returncode == 0, f"the process died: exit status {out.returncode}"
    got = json.loads(out.stdout.strip().splitlines()[-1])
    mine = [c for c in got["candidates"] if c["path"] == "libcudart.so.12"]
    assert mine and mine[0]["verdict"] == "rejected" and "truncated" in mine[0]["reason"], mine


# =============================================================================================
# 4. seeding before initialization: a refused call changes nothing
# =============================================================================================
_S = struct.pack("<Qq", 1234, 40)


def test_guard_a_seed_lands_after_a_later_state_set_before_init(monkeypatch):
    """torch's queue: set_rng_state (plain) runs before the latest manual_seed at _lazy_init."""
    use_sim(monkeypatch, "cuda")
    R.manual_seed(5)
    R.set_rng_state(np.frombuffer(_S, np.uint8).copy(), 0)
    assert not accel.is_initialized()
    assert bytes(R.get_rng_state(0)) == struct.pack("<Qq", 5, 0)


# (r71b found; fixed in session 31)
@pytest.mark.parametrize("bad", [2, -1, "1"])
def test_a_refused_default_generator_call_keeps_the_seed_queue(monkeypatch, bad):
    """torch: ``torch.cuda.default_generators[i]`` before init is an empty tuple's IndexError and
    initializes nothing; the queued manual_seed(5) still runs after set_rng_state at init."""
    use_sim(monkeypatch, "cuda")
    R.manual_seed(5)
    with pytest.raises((IndexError, ValueError, TypeError)):
        R.default_generator(bad)
    R.set_rng_state(np.frombuffer(_S, np.uint8).copy(), 0)
    assert not accel.is_initialized()
    assert bytes(R.get_rng_state(0)) == struct.pack("<Qq", 5, 0)
    assert bytes(R.get_rng_state(1)) != _S


def test_guard_the_count_before_init_follows_cuda_visible_devices(monkeypatch):
    use_sim(monkeypatch, "cuda", CUDA_VISIBLE_DEVICES="0")
    assert accel.device_count() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert accel.device_count() == 2 and not accel.is_initialized()


# (r71b found; fixed in session 31)
def test_seed_all_before_init_reaches_a_device_made_visible_before_init(monkeypatch):
    use_sim(monkeypatch, "cuda", CUDA_VISIBLE_DEVICES="0")
    R.manual_seed_all(7)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    accel.current_device_index()                   # initializes: two devices
    assert bytes(R.get_rng_state(0)) == struct.pack("<Qq", 7, 0)
    assert bytes(R.get_rng_state(1)) == struct.pack("<Qq", 7, 0)


# =============================================================================================
# 5. randint's one-word / two-word rule: host path, simulated kernels and torch
# =============================================================================================
def _torch_words_per_value(span: int, dtype) -> int:
    """How many 32-bit mt19937 draws torch 2.13's CPU randint takes per value for ``span``
    (the generator's state after n values against n or 2n one-word draws)."""
    torch = pytest.importorskip("torch")
    n = 8
    g = torch.Generator().manual_seed(11)
    low = -(span // 2)
    torch.randint(low, low + span, (n,), generator=g, dtype=dtype)
    after = g.get_state()
    for words in (1, 2):
        h = torch.Generator().manual_seed(11)
        torch.randint(0, 2, (n * words,), generator=h, dtype=torch.int64)
        if torch.equal(h.get_state(), after):
            return words
    raise AssertionError("torch took neither 1 nor 2 words per value")


@pytest.mark.parametrize("dtype", ["int32", "int64"])
@pytest.mark.parametrize("span", [(1 << 28) - 1, 1 << 28, (1 << 31) + 5])
def test_guard_the_wide_rule_is_torchs(dtype, span):
    torch = pytest.importorskip("torch")
    want = _torch_words_per_value(span, getattr(torch, dtype))
    kind = _transforms.randint_kind(-(span // 2), -(span // 2) + span, dtype)
    assert _transforms.words_for(kind, 1) == want, (kind, want)


@pytest.mark.parametrize("dtype", ["int32", "int64"])
@pytest.mark.parametrize("low, high", [(-(1 << 27), (1 << 27) - 1), (-(1 << 27), 1 << 27),
                                       (-(1 << 31), 1 << 31), (7, 7 + (1 << 28) + 3)])
def test_guard_host_and_device_randint_agree_on_both_devices(monkeypatch, dtype, low, high):
    """The simulated kernels (accel/sim/philox_kernels.py) and the host rule (_transforms.randint)
    give the same values and advance the offset by the same words, on device 1 too."""
    use_sim(monkeypatch, "cuda")
    n = 37
    itemsize = np.dtype(dtype).itemsize
    plan = _fills.plan_randint(n * itemsize, dtype, low, high)
    for dev in (0, 1):
        gen = R.Generator(dev, seed=99)
        buf = accel.Buffer(n * itemsize, device=dev)
        R.randint_(buf, low, high, dtype=dtype, generator=gen)
        got = buf.to_numpy(dtype)
        want = plan.host(99, 0)
        assert np.array_equal(got, want), (dev, got[:4], want[:4])
        assert gen.offset == (plan.words + 3) // 4 * 4
        assert got.min() >= low and got.max() < high
        buf.close()


@pytest.mark.parametrize("low, high, ok", [(-(1 << 31), 1 << 31, True), (-(1 << 31) - 1, 0, False),
                                           (0, (1 << 31) + 1, False), (5, 5, False)])
def test_guard_int32_bounds_are_torchs(low, high, ok):
    torch = pytest.importorskip("torch")
    try:
        torch.randint(low, high, (2,), dtype=torch.int32)
        torch_ok = True
    except RuntimeError:
        torch_ok = False
    assert torch_ok == ok
    if ok:
        _fills.plan_randint(8, "int32", low, high)
    else:
        with pytest.raises(ValueError):
            _fills.plan_randint(8, "int32", low, high)


# =============================================================================================
# 6. the fatbin and cubin readers on malformed input
# =============================================================================================
def _cubin(shentsize: int, shnum: int) -> bytes:
    """An ELF64 whose section header table (at 64) is one SHT_SYMTAB of one global FUNC symbol
    marked STO_CUDA_ENTRY named "k", its strings in the same section's bytes."""
    elf = bytearray(64)
    elf[:4], elf[4], elf[5] = b"\x7fELF", 2, 1
    struct.pack_into("<Q", elf, 0x28, 64)
    struct.pack_into("<HH", elf, 0x3A, shentsize, shnum)
    symtab_off = 64 + 64
    header = struct.pack("<IIQQQQIIQQ", 0, 2, 0, 0, symtab_off, 24, 0, 0, 0, 24)
    sym = struct.pack("<IBBHQQ", 24, 0x12, 0x10, 0, 0, 0)      # name at symtab_off + 24
    return bytes(elf) + header + sym + b"k\0"


def test_guard_the_cubin_builder_gives_one_kernel():
    assert _cuda_containers.elf_entries(_cubin(64, 1)) == ["k"]


# (r71b found; fixed in session 31)
def test_a_cubin_with_section_headers_of_0_bytes_is_a_container_error():
    with pytest.raises(_cuda_containers.ContainerError):
        _cuda_containers.elf_entries(_cubin(0, 3))


_PTX = b".version 6.3\n.target sm_75\n.address_size 64\n.visible .entry k()\n{\nret;\n}\n\0"


def _fatbin(fat_size: int) -> bytes:
    entry = (struct.pack("<HHIQ", _cuda_containers.KIND_PTX, 0x101, 64, len(_PTX)) + bytes(12)
             + struct.pack("<I", 75) + bytes(8) + struct.pack("<Q", 0) + bytes(16))
    return struct.pack("<IHHQ", _cuda_containers.FATBIN_MAGIC, 1, 16, fat_size) + entry + _PTX


def test_guard_a_whole_fatbin_is_read():
    assert [k for k, _sm, _b in _cuda_containers.fatbin_entries(_fatbin(64 + len(_PTX)))] == [1]


# (r71b found; fixed in session 31)
def test_a_fatbin_entry_past_the_containers_end_is_a_container_error():
    image = _fatbin(64)                 # the declared container holds the entry's header only
    with pytest.raises(_cuda_containers.ContainerError):
        _cuda_containers.fatbin_entries(image)
    assert _module._image_info(image, "fatbin") == ({}, {})


@pytest.mark.parametrize("image", [
    b"", b"\x7fELF", b"\x7fELF" + bytes(60), _cubin(64, 1)[:100], _cubin(64, 1)[:-1],
    _fatbin(64 + len(_PTX))[:20], _fatbin(64 + len(_PTX))[:-3], _fatbin(1 << 62),
    struct.pack("<IHHQ", _cuda_containers.FATBIN_MAGIC, 1, 0, 64) + bytes(64),
])
def test_guard_malformed_containers_raise_container_error_or_read_nothing(image):
    """Truncated headers, entries and sizes past the data: ContainerError (a ValueError), never
    IndexError or struct.error; Module's reader turns it into "nothing known" for the driver."""
    for fn in (_cuda_containers.elf_entries, _cuda_containers.fatbin_entries):
        try:
            fn(image)
        except _cuda_containers.ContainerError:
            pass
    for kind in ("cubin", "fatbin"):
        entries, required = _module._image_info(image, kind)
        assert isinstance(entries, dict) and isinstance(required, dict)


# =============================================================================================
# 7. docstrings
# =============================================================================================
# (r71b found; fixed in session 31)
def test_cuda_libs_docstring_says_where_versions_come_from(tmp_path):
    w12 = _wheel12()
    named = tmp_path / "libcudart.so.13.0.96"
    shutil.copyfile(w12, named)
    c = _cuda_libs.probe(_cuda_libs.Candidate(str(named), "test"))
    assert c.version == 12040 and c.version_from == "cudaRuntimeGetVersion"
    assert "real file name" not in _cuda_libs.__doc__, _cuda_libs.__doc__[:600]


# =============================================================================================
# 8. accel.device and torch.device (accel/_device.py, session 30)
# =============================================================================================
@pytest.mark.parametrize("text", ["cuda:0", "cuda:1", "cuda"])
def test_guard_accel_device_equals_and_hashes_as_torch_device(monkeypatch, text):
    torch = pytest.importorskip("torch")
    use_sim(monkeypatch, "cuda")
    a, t = accel.device(text), torch.device(text)
    assert a == t and t == a and hash(a) == hash(t)
    assert {t: 1}[a] == 1 and {a: 1}[t] == 1
    assert a != torch.device("cuda:1" if text != "cuda:1" else "cuda:0")


def test_guard_the_shipped_fatbin_holds_every_philox_kernel_in_each_image():
    from accel import _ptx
    path = os.path.join(os.path.dirname(_fills.__file__), "kernels", "philox.fatbin")
    entries = _cuda_containers.fatbin_entries(open(path, "rb").read())
    want = set(_fills.KERNEL_NAMES)
    assert {k for k, _sm, _b in entries} == {_cuda_containers.KIND_PTX, _cuda_containers.KIND_ELF}
    for kind, sm, body in entries:
        names = (set(_ptx.ptx_entries(body)) if kind == _cuda_containers.KIND_PTX
                 else set(_cuda_containers.elf_entries(body)))
        assert want <= names, (kind, sm, want - names)
