"""accel's allocator settings parser against torch 2.13's CUDA-build parsers, read as source (r78g).

The CPU wheel installed here runs only the device-generic parser (c10/core/AllocatorConfig.cpp):
the CUDA-only keys are skipped there, never validated (tests/test_review_r77b.py covers what the
wheel can say).  The rules below are derived from the C++ source of the CUDA build:

* ``AllocatorConfig.h`` (2.13.0, the header shipped in the installed wheel, exact):
  ConfigTokenizer L35-53 (``, : [ ]`` are tokens of their own, every std::isspace character is
  dropped wherever it is, no empty token is made), toSizeT L70-73 (``std::stoull``), toDouble
  L75-78 (``std::stod``), toBool L80-96 (exactly ``True``/``False``), setAllocatorSettings
  L372-375 (the generic parseArgs, then the device hook: CUDAAllocatorConfig::parseArgs, on the
  same string, at run time too).
* ``c10/cuda/CUDAAllocatorConfig.h`` (2.13.0, wheel header, exact): pinned_max_register_threads
  L97-102 (128), instance() L133-154 (PYTORCH_CUDA_ALLOC_CONF, PYTORCH_HIP_ALLOC_CONF only under
  USE_ROCM, then PYTORCH_ALLOC_CONF; parsed once), getKeys L158-177 (the CUDA-only keys; no
  expandable-segments handle-type key), the parse* declarations L184-208.
* ``c10/cuda/CUDAAllocatorConfig.cpp``: not in the wheel; the newest version stored in the
  search index (pytorch/pytorch, one commit after 2.13: it adds expandable_segments_reserve*, which
  the 2.13 header does not declare; the 2.13 keys' code is the same as in the 2.13-era copy
  whose key list matches the 2.13 header).  Line numbers ("cpp Lnn") are that file's:
  parseAllocatorConfig L14-57 (non-ROCm: L43-54), parseArgs L59-133 (unknown key L112-120,
  separator L123-125, the cudaMallocAsync warning L128-132), parsePinnedUseCudaHostRegister
  L135-141, parseGraphCaptureRecordStreamReuse L143-149, parsePerProcessMemoryFraction L151-161,
  parsePinnedNumRegisterThreads L163-181, parsePinnedReserveSegmentSize L183-192,
  parsePinnedFreeCatchAll L194-200, parseThrowOnCudaMallocOom L202-.
* ``std::stoull`` / ``std::stod`` (libstdc++ __stoa): strtoull(.., 10) / strtod on the token;
  no digits read -> invalid_argument, errno ERANGE -> out_of_range; what follows the number is
  ignored.  strtoull negates a ``-`` number modulo 2**64 when its magnitude fits (glibc).  The
  oracle below calls this machine's glibc strtoull/strtod through ctypes (the same functions
  libc10 calls), and the CPU wheel confirms the stod rule on garbage_collection_threshold.

Bugs (strict xfail, reasons start "r78g:"): see each test.
"""

import ctypes
import warnings

import pytest

import accel
import accel.memory as M
from accel._errors import AllocatorConfigError
from accel.memory import _config

MiB = 1 << 20

_libc = ctypes.CDLL(None, use_errno=True)
_libc.strtoull.restype = ctypes.c_ulonglong
_libc.strtoull.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p), ctypes.c_int]
_libc.strtod.restype = ctypes.c_double
_libc.strtod.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]

ERANGE = 34


def _std_sto(fn, token, *base):
    """What std::stoull / std::stod return for ``token`` (None where they throw)."""
    raw = token.encode()
    buf = ctypes.create_string_buffer(raw)
    end = ctypes.c_char_p()
    ctypes.set_errno(0)
    value = fn(buf, ctypes.byref(end), *base)
    errno = ctypes.get_errno()
    consumed = ctypes.cast(end, ctypes.c_void_p).value - ctypes.addressof(buf)
    if consumed == 0 or errno == ERANGE:
        return None
    return value


def stoull(token):
    return _std_sto(_libc.strtoull, token, 10)


def stod(token):
    return _std_sto(_libc.strtod, token)


def _accepts(text, source="ACCEL_ALLOC_CONF"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            _config.parse(text, source)
            return True
        except AllocatorConfigError:
            return False


#: the CUDA-only True/False keys (CUDAAllocatorConfig.cpp L70-77 release_lock_on_{cuda,hip}malloc,
#: L135-141 pinned_use_{cuda,hip}_host_register, L143-149, L194-200, L202-)
BOOL_KEYS = ("release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
             "pinned_use_hip_host_register", "graph_capture_record_stream_reuse", "pinned_free_catch_all",
             "throw_on_cudamalloc_oom")


# ------------------------------------------------------------------ the True/False keys
@pytest.mark.parametrize("key", BOOL_KEYS)
def test_cuda_only_bool_keys_take_exactly_True_or_False(key):
    """toBool (AllocatorConfig.h L80-96) compares the token with "True" and "False" only; the
    tokenizer (L35-53) has already dropped white space inside it, so "Tr ue" is True, and a
    missing value is an out-of-range index (checkIndex, L124-127): refused."""
    for value in ("True", "False", " True", "Tr\tue", "Fal se\n"):
        assert _accepts(f"{key}:{value}"), value
    for value in ("true", "TRUE", "1", "0", "yes", "True1", "Truee", "T", "", "True\u00a0"):
        assert not _accepts(f"{key}:{value}"), value
    assert not _accepts(key)
    assert not _accepts(f"{key}:")


# ------------------------------------------------------------------ pinned_num_register_threads
def _threads_torch_accepts(token):
    """parsePinnedNumRegisterThreads (cpp L163-181): stoull, a power of two, <= 128 (.h L97-102)."""
    value = stoull(token)
    return value is not None and value != 0 and value & (value - 1) == 0 and value <= 128


THREADS_AGREE = ("1", "2", "4", "8", "64", "128", "+8", "08", "8MB", "16threads", "1e2", "2.9", "0x8", "0",
                 "-0", "3", "6", "127", "256", "1024", "-1", "-8", "18446744073709551616",
                 "-18446744073709551616", "99999999999999999999", "x", "", "+", "-")


@pytest.mark.parametrize("token", THREADS_AGREE)
def test_pinned_num_register_threads_as_stoull_and_power_of_two_check(token):
    """cpp L163-181: std::stoull then llvm::isPowerOf2_64 (0 is not one) then <= 128 ("Number of
    register threads should be less than or equal to 128").  ``0x8`` is read as 0 (base 10),
    ``8MB`` and ``1e2`` by their prefix (8, 1), ``-8`` wraps to 2**64 - 8 (not a power of two),
    past 2**64 - 1 is out_of_range."""
    assert _accepts(f"pinned_num_register_threads:{token}") == _threads_torch_accepts(token), token


# (r78g found; fixed in session 38)
def test_pinned_num_register_threads_negative_wraps_as_stoull():
    """std::stoull("-18446744073709551488") is 2**64 - (2**64 - 128) = 128 (glibc strtoull
    negates modulo 2**64, no ERANGE), which parsePinnedNumRegisterThreads (cpp L167-180)
    accepts; likewise "-18446744073709551615" is 1.  accel reads the int and refuses it as <= 0,
    though its docstring promises every setting torch accepts is accepted."""
    for token, value in (("-18446744073709551488", 128), ("-18446744073709551615", 1),
                         ("-18446744073709551614", 2)):
        assert stoull(token) == value
        assert _threads_torch_accepts(token)
        assert _accepts(f"pinned_num_register_threads:{token}"), token


# ------------------------------------------------------------------ pinned_reserve_segment_size_mb
def _reserve_torch_accepts(token):
    """parsePinnedReserveSegmentSize (cpp L183-192): stoull, then > 0."""
    value = stoull(token)
    return value is not None and value > 0


RESERVE_AGREE = ("1", "64", "+64", "0064", "64MB", "1.5", "18446744073709551615", "0", "-0", "x", "",
                 "-18446744073709551616")


@pytest.mark.parametrize("token", RESERVE_AGREE)
def test_pinned_reserve_segment_size_mb_as_stoull_and_positive_check(token):
    """cpp L183-192: ``val2 > 0`` on std::stoull's value ("Pinned reserve segment size has to
    be greater than 0"); prefix reads (64MB is 64, 1.5 is 1), 0 and -0 refused, out_of_range
    refused."""
    assert _accepts(f"pinned_reserve_segment_size_mb:{token}") == _reserve_torch_accepts(token), token


# (r78g found; fixed in session 38)
def test_pinned_reserve_segment_size_mb_negative_wraps_positive():
    """std::stoull("-1") is 2**64 - 1 and "-18446744073709551615" is 1: both > 0, so the CUDA
    build accepts them (cpp L187-189).  accel refuses them ("has to be greater than 0")."""
    for token in ("-1", "-64", "-18446744073709551615"):
        assert _reserve_torch_accepts(token)
        assert _accepts(f"pinned_reserve_segment_size_mb:{token}"), token


# (r78g found; fixed in session 38)
def test_pinned_reserve_segment_size_mb_past_size_t_refused():
    """std::stoull("18446744073709551616") sets ERANGE: std::out_of_range, the setting is refused
    (cpp L187).  accel's _parse_int has no upper bound for this key."""
    for token in ("18446744073709551616", "99999999999999999999", "340282366920938463463374607431768211456"):
        assert not _reserve_torch_accepts(token)
        assert not _accepts(f"pinned_reserve_segment_size_mb:{token}"), token


# ------------------------------------------------------------------ per_process_memory_fraction
def _fraction_torch_accepts(token):
    """parsePerProcessMemoryFraction (cpp L151-161): std::stod, then 0.0 <= v <= 1.0 (NaN fails)."""
    value = stod(token)
    return value is not None and 0.0 <= value <= 1.0


FRACTION_AGREE = ("0", "1", "0.5", ".5", "1.", "-0", "-0.0", "+0.25", "1e0", "5e-1", "0x1p-1", "0X.8",
                  "0.5abc", "0.5MB", "1.0000000000000001", "1e-300", "2.2250738585072014e-308", "1.0000001",
                  "-0.1", "2", "nan", "-nan", "inf", "-inf", "infinity", "1e-320", "4.9e-324", "x", "", "e5",
                  "0x")


@pytest.mark.parametrize("token", FRACTION_AGREE)
def test_per_process_memory_fraction_as_stod_and_closed_range(token):
    """cpp L151-161: std::stod (hexadecimal, inf, nan, prefix reads: "0.5abc" is 0.5), then
    [0.0, 1.0] closed ("per_process_memory_fraction is invalid, set it in [0.0, 1.0]"); NaN
    fails both comparisons; an inexact subnormal sets ERANGE: out_of_range."""
    assert _accepts(f"per_process_memory_fraction:{token}") == _fraction_torch_accepts(token), token


# (r78g found; fixed in session 38)
def test_exact_subnormal_fraction_accepted_as_stod():
    """glibc strtod returns 0x1p-1074 (= 5e-324, exact) without ERANGE, so std::stod returns it
    and parsePerProcessMemoryFraction (cpp L155-160) accepts it (>= 0.0).  The CPU wheel shows the
    same stod rule on the generic garbage_collection_threshold (checked by hand for r78g, not here:
    importing torch takes seconds): torch._C._accelerator_setAllocatorSettings accepts
    "garbage_collection_threshold:0x1p-1074" and refuses "...:1e-320" (IndexError "stod").  accel's _parse_float refuses any
    number below sys.float_info.min ("out of the range of a normal double")."""
    for token in ("0x1p-1074", "0x0.8p-1022", "0x1.8p-1070"):
        assert _fraction_torch_accepts(token)
        assert _accepts(f"per_process_memory_fraction:{token}"), token


# (r78g found; fixed in session 38)
@pytest.mark.parametrize("token", ["1e-400", "-1e-400", "0.0000001e-400", "0x1p-1080"])
def test_fraction_underflowing_to_zero_refused_as_stod(token):
    """glibc strtod returns 0 (or -0) with ERANGE for a nonzero number below the subnormals, and
    std::stod throws out_of_range on ERANGE (cpp L155 toDouble, .h L75-78): refused.  accel's
    _parse_float checks for a subnormal only when the value is nonzero, so it reads 0.0 and
    accepts the setting."""
    assert stod(token) is None
    assert not _accepts(f"per_process_memory_fraction:{token}")


# ------------------------------------------------------------------ backend
@pytest.mark.parametrize("value, ok", [("native", True), ("cudaMallocAsync", True), (" native ", True),
                                       ("cuda Malloc\tAsync", True), ("hipMallocAsync", False),
                                       ("Native", False), ("cudamallocasync", False), ("", False),
                                       ("native1", False), ("cudaMallocAsync[", False)])
def test_backend_values_as_cuda_build(value, ok):
    """parseAllocatorConfig, non-ROCm (cpp L43-47): the token is "native" or "cudaMallocAsync"
    ("Unknown allocator backend, options are native and cudaMallocAsync"); hipMallocAsync only
    under USE_ROCM (L26-31).  White space inside is dropped by the tokenizer (.h L46)."""
    assert _accepts(f"backend:{value}") == ok


def test_backend_named_twice_with_the_same_value_accepted():
    """Each backend token is checked against the one allocator chosen at load time (cpp L48-54):
    the same value twice passes both checks."""
    for value in ("native", "cudaMallocAsync"):
        assert _accepts(f"backend:{value},backend:{value}")
        assert _config.parse(f"backend:{value},backend:{value}").backend == value


# (r78g found; fixed in session 38)
@pytest.mark.parametrize("text", ["backend:native,backend:cudaMallocAsync", "backend:cudaMallocAsync,backend:native"])
def test_backend_named_twice_with_different_values_refused(text):
    """TORCH_INTERNAL_ASSERT(tokenizer[i] == get()->name(), "Allocator backend parsed at runtime
    != allocator backend parsed at load time") (cpp L48-54) runs for every backend token: with two
    different values one of them differs from the one allocator loaded, whichever it is."""
    assert not _accepts(text)


def test_backend_at_run_time_only_the_current_one(sim_cuda):
    """At run time setAllocatorSettings (.h L372-375) runs CUDAAllocatorConfig::parseArgs, whose
    backend check (cpp L48-54) accepts only the backend loaded at start: backend:native is
    accepted, backend:cudaMallocAsync refused.  accel: refused before anything changes, on both
    devices (torch's generic options of the same string may already have changed: not copied)."""
    a = accel.Buffer(MiB, device=0)
    b = accel.Buffer(MiB, device=1)
    M.set_allocator_settings("backend:native,max_split_size_mb:64")
    allocs = list(M._allocators.values())
    assert len(allocs) == 2
    with pytest.raises(AllocatorConfigError):
        M.set_allocator_settings("max_split_size_mb:128,backend:cudaMallocAsync")
    assert all(alloc.config.backend == "native" for alloc in allocs)
    assert all(alloc.config.max_split_size == 64 * MiB for alloc in allocs)
    assert M.get_allocator_settings() == "backend:native,max_split_size_mb:64"
    del a, b


def test_backend_cuda_malloc_async_from_environment_then_native_at_run_time_refused(monkeypatch):
    """The backend loaded from PYTORCH_CUDA_ALLOC_CONF stays: a run-time backend:native differs
    from get()->name() == "cudaMallocAsync" (cpp L48-54)."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    base = _config.from_environment()
    assert base.backend == "cudaMallocAsync"
    with pytest.raises(AllocatorConfigError):
        _config.changed(base, "backend:native")
    assert _config.changed(base, "backend:cudaMallocAsync")[0].backend == "cudaMallocAsync"


# ------------------------------------------------------------------ the cudaMallocAsync warning
# (r78g found; fixed in session 38)
def test_cuda_malloc_async_with_native_option_warns():
    """parseArgs sets used_native_specific_option for each CUDA-only key (cpp L63-111) and, with
    backend:cudaMallocAsync in the same string, TORCH_WARNs "backend:cudaMallocAsync ignores ..."
    (L128-132).  accel documents that only per_process_memory_fraction acts under
    cudaMallocAsync, yet it says nothing of throw_on_cudamalloc_oom, which it then ignores."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _config.parse("backend:cudaMallocAsync,throw_on_cudamalloc_oom:True")
    assert caught, "no warning"


def test_torch_only_cuda_keys_warn_once_per_setting():
    """accel's own rule for the CUDA-only keys it does not implement (TORCH_ONLY): one
    UserWarning per (variable, setting); no error."""
    text = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8,release_lock_on_cudamalloc:False"
    _config._warned.discard(("ACCEL_ALLOC_CONF", text))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _config.parse(text)
        _config.parse(text)
    assert len([w for w in caught if "pinned_use_cuda_host_register" in str(w.message)]) == 1


# ------------------------------------------------------------------ keys
@pytest.mark.parametrize("key", ["expandable_segments_handle_type", "expandable_segments_reserve",
                                 "expandable_segments_reserve_by_class", "handle_type", "backends",
                                 "Release_lock_on_cudamalloc", "pinned_use_host_register", ","])
def test_keys_the_cuda_build_does_not_know_refused(key):
    """cpp L112-120: a key outside AcceleratorAllocatorConfig::getKeys (generic keys plus
    CUDAAllocatorConfig.h L158-177) is "Unrecognized key '...' in CUDA allocator config." The
    expandable-segments handle type is set by the allocator (set_expandable_segments_handle_type,
    .h L53-56), never parsed; expandable_segments_reserve* came after 2.13."""
    assert not _accepts(f"{key}:1")


# ------------------------------------------------------------------ tokenizer: white space, empty items
def test_every_isspace_character_dropped_anywhere_in_cuda_keys():
    """ConfigTokenizer (.h L46): std::isspace characters (space, \\t \\n \\v \\f \\r) are dropped
    wherever they are, inside keys and values too; NBSP (0xA0) is not one of them."""
    text = " pinned_num_reg\tister_threads : 1\n6 ,\vrelease_lock_on_cudamalloc:\fTr\rue , backend: nat ive "
    assert _accepts(text)
    assert _config.parse(text).backend == "native"
    assert not _accepts("release_lock_on_cudamalloc:\u00a0True")
    # the NBSP ends std::stoull's number: "1<NBSP>6" is read as 1 (a power of two), as accel's prefix read
    assert stoull("1\u00a06") == 1 and _accepts("pinned_num_register_threads:1\u00a06")


def test_one_trailing_comma_and_empty_setting_accepted():
    """A trailing comma is consumed as the separator (cpp L123-125) and the loop ends; an empty or
    all-white-space setting has no token at all."""
    for text in ("release_lock_on_cudamalloc:True,", "pinned_free_catch_all:False ,  ", "", " \t\n"):
        assert _accepts(text), repr(text)


# (r78g found; fixed in session 38)
@pytest.mark.parametrize("text", [",release_lock_on_cudamalloc:True",
                                  "release_lock_on_cudamalloc:True,,pinned_free_catch_all:False",
                                  "throw_on_cudamalloc_oom:False,,", ",", " , "])
def test_leading_or_doubled_comma_refused_as_cuda_build(text):
    """The tokenizer emits each ',' as a token and makes no empty ones (.h L40-45): a leading
    comma, or a second one in a row, is where parseArgs expects a key (cpp L62-63), and ',' is
    no key (L112-120).  (The CPU wheel's generic parser accepts one such comma: r77b.)"""
    assert not _accepts(text)


# ------------------------------------------------------------------ run time: kept, not reset
def test_cuda_only_keys_kept_across_run_time_changes(sim_cuda):
    """CUDAAllocatorConfig::parseArgs resets nothing (cpp L59-133): a run-time setting that does
    not name throw_on_cudamalloc_oom / per_process_memory_fraction leaves them; only
    max_split_size, roundup_power2_divisions and garbage_collection_threshold are reset (generic
    parseArgs).  Both devices."""
    bufs = [accel.Buffer(MiB, device=d) for d in (0, 1)]
    M.set_allocator_settings("throw_on_cudamalloc_oom:True,max_split_size_mb:64")
    M.set_allocator_settings("garbage_collection_threshold:0.5")
    allocs = list(M._allocators.values())
    assert len(allocs) == 2
    for alloc in allocs:
        assert alloc.config.throw_on_cudamalloc_oom is True
        assert alloc.config.max_split_size == _config.UNLIMITED
        assert alloc.config.garbage_collection_threshold == 0.5
    del bufs


def test_cuda_only_values_validated_at_run_time(sim_cuda):
    """setAllocatorSettings (.h L372-375) runs the CUDA hook: a bad CUDA-only value is refused at
    run time as at start (cpp L163-181 / L183-192 / L80-96); accel's refused call changes
    nothing on either device."""
    bufs = [accel.Buffer(MiB, device=d) for d in (1, 0)]
    M.set_allocator_settings("max_split_size_mb:64")
    for bad in ("pinned_num_register_threads:3", "pinned_reserve_segment_size_mb:0",
                "release_lock_on_cudamalloc:1", "per_process_memory_fraction:1.5", "graph_capture_record_stream_reuse:",
                "backend:hipMallocAsync", "bogus_key:1"):
        with pytest.raises(AllocatorConfigError):
            M.set_allocator_settings("max_split_size_mb:128," + bad)
        assert all(a.config.max_split_size == 64 * MiB for a in M._allocators.values()), bad
    assert M.get_allocator_settings() == "max_split_size_mb:64"
    del bufs


# ------------------------------------------------------------------ environment variables
@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_bad_cuda_only_value_in_the_variable_cuda_reads_refused(monkeypatch, var):
    """CUDAAllocatorConfig::instance (.h L133-154) parses PYTORCH_CUDA_ALLOC_CONF, else
    PYTORCH_ALLOC_CONF, with the CUDA-only checks (cpp L163-181)."""
    monkeypatch.setenv(var, "pinned_num_register_threads:3")
    with pytest.raises(AllocatorConfigError):
        _config.from_environment()
    monkeypatch.setenv(var, "pinned_num_register_threads:4,pinned_reserve_segment_size_mb:8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _config.from_environment().source == var


def test_empty_cuda_variable_shadows_pytorch_alloc_conf(monkeypatch):
    """.h L136-148: get_env(...).has_value() decides, so an empty PYTORCH_CUDA_ALLOC_CONF is the
    one parsed and PYTORCH_ALLOC_CONF's bad value is never read."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "pinned_num_register_threads:3")
    config = _config.from_environment()
    assert config.source == "PYTORCH_CUDA_ALLOC_CONF" and config.text == ""


# (r78g found; fixed in session 38)
def test_hip_variable_cuda_only_keys_not_validated_on_cuda_build(monkeypatch):
    """On a non-ROCm build CUDAAllocatorConfig::instance reads PYTORCH_CUDA_ALLOC_CONF and
    PYTORCH_ALLOC_CONF only (.h L136-147); the generic parser, which does read
    PYTORCH_HIP_ALLOC_CONF, skips the CUDA keys (skipKey, .h L100-121; the CPU wheel accepts
    "pinned_num_register_threads:3").  So torch starts with this variable; accel raises."""
    monkeypatch.setenv("PYTORCH_HIP_ALLOC_CONF", "pinned_num_register_threads:3")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _config.from_environment()
