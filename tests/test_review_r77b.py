"""Differential tests of accel against the torch 2.13 CPU wheel (r77b).

The oracle is what torch computes without a GPU: libc10's device-generic allocator-settings
parser (``torch._C._accelerator_setAllocatorSettings`` / ``_accelerator_getAllocatorSettings``:
the CPU wheel checks the keys max_split_size_mb, max_non_split_rounding_mb,
large_segment_size_mb, garbage_collection_threshold, roundup_power2_divisions,
expandable_segments, pinned_use_background_threads, pinned_max_round_threshold_mb and
pinned_max_cached_size_mb, and skips the device allocator's keys), ``torch.device`` string
parsing, torch's own ``torch.accelerator._utils._get_device_index`` (run with its accelerator
queries pointed at accel's), and ``torch.Generator().manual_seed`` (the same 64-bit rule as
torch.cuda's).  The settings are compared one string at a time from a common baseline (noisy
well-formed strings, malformed ones, the PYTORCH_ variables) and as sequences of changes.  Inputs are
generated deterministically (seeded ``random.Random``, ``itertools.product``).  Simulated CUDA,
two devices.

Bug (strict xfail, reason starts "r77b:"): a value torch reads by its numeric prefix
(``std::stoull`` / ``std::stod`` stop at the first character that is not part of the number:
``max_split_size_mb:512MB`` is 512, ``garbage_collection_threshold:0.8#x`` is 0.8) is refused by
accel, whose ``_config`` docstring promises "A setting written for torch never breaks accel ...
MiB counts read as std::stoull reads them".

Differences where torch, not accel, is at fault, and so not tested as accel bugs: torch refuses a
setting with more than one empty item (``",,x"``, ``"x,,"``, ``",x,"``, ``"x,,,y"``) with an INTERNAL ASSERT
(AllocatorConfig.h, "Index out of bound"); accel refuses every empty item but one trailing comma, as
torch's CUDA parser does ("Unrecognized key ','", tests/test_review_r78g.py).  torch ignores stray tokens
after a value (``expandable_segments:False]``, ``max_split_size_mb:32:``); accel refuses them.
torch wraps device indices into its 8-bit DeviceIndex (``torch.device("cuda:128")`` is index
-128); accel keeps the index and checks it against the device count where it is used.  torch's
refused settings string still becomes its settings text; accel's refused call changes nothing.
"""

import itertools
import random
import warnings

import numpy as np
import pytest

import accel
import accel.memory as M
from accel.memory import _config

torch = pytest.importorskip("torch")

MiB = 1 << 20
SEED = 77

_TSET = torch._C._accelerator_setAllocatorSettings
_TGET = torch._C._accelerator_getAllocatorSettings

#: both parsers from the same state before each string (torch keeps large_segment_size_mb,
#: expandable_segments and the pinned limits across calls; accel's rule is the same)
BASELINE = ("large_segment_size_mb:20,max_non_split_rounding_mb:20,expandable_segments:False,"
            "pinned_use_background_threads:False,pinned_max_round_threshold_mb:-1,pinned_max_cached_size_mb:-1")

#: well-formed key:value atoms both accept alone
ATOMS = [("max_split_size_mb", "64"), ("max_split_size_mb", "-1"), ("max_non_split_rounding_mb", "32"),
         ("garbage_collection_threshold", "0.6"), ("roundup_power2_divisions", "4"),
         ("roundup_power2_divisions", "[256:2,>:4]"), ("roundup_power2_divisions", "[1:1,64:8]"),
         ("expandable_segments", "True"), ("expandable_segments", "False"), ("large_segment_size_mb", "24"),
         ("pinned_use_background_threads", "True"), ("pinned_max_round_threshold_mb", "8"),
         ("pinned_max_cached_size_mb", "64")]
#: std::isspace's characters, which torch's ConfigTokenizer skips wherever they are
_WS = " \t\n\v\f\r"


def _accepted(apply, text) -> bool:
    try:
        apply(text)
        return True
    except (ValueError, RuntimeError, IndexError):
        return False


def _both(text):
    """(torch accepted, accel accepted), each from BASELINE."""
    _TSET(BASELINE)
    M.set_allocator_settings(BASELINE)
    return _accepted(_TSET, text), _accepted(M.set_allocator_settings, text)


def _fields(config):
    return config._replace(source="", text="")


@pytest.fixture
def quiet_torch_settings():
    """Warnings off (ignored torch keys, the pinned-limits precedence warning); torch's parser
    left with its default options and an empty settings string, as other tests may read them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            _TSET(BASELINE)     # torch's defaults (accel's options: conftest's reset)
            _TSET("")


def _noisy(rng, atoms):
    """The atoms joined with commas, maybe one trailing comma added, and white space inserted
    anywhere.  (A leading or doubled comma is one empty item, which the CPU wheel's generic
    parser takes but torch's CUDA parser refuses, "Unrecognized key ','": accel refuses it as the
    CUDA build does since session 38; tests/test_review_r78g.py.)"""
    seps = [","] * (len(atoms) - 1)
    lead = ""
    trail = "," if rng.randrange(len(atoms) + 2) == 1 else ""
    parts = [f"{k}:{v}" for k, v in atoms]
    text = lead + "".join(p + sep for p, sep in zip(parts, seps)) + parts[-1] + trail
    chars = list(text)
    for _ in range(rng.randint(0, 5)):
        chars.insert(rng.randint(0, len(chars)), rng.choice(_WS) * rng.randint(1, 2))
    return "".join(chars)


def test_noisy_well_formed_settings_accepted_read_back_and_parsed_as_clean(sim_cuda, quiet_torch_settings):
    """300 seeded settings of one to three well-formed atoms (duplicates and every key order
    included), with white space inside keys, values and lists and a trailing comma: torch accepts each, so does accel; ``get_allocator_settings()`` gives back the string
    as torch's getter does; and accel's options equal those of the same string without the noise."""
    rng = random.Random(SEED)
    differ = []
    for _ in range(300):
        atoms = [rng.choice(ATOMS) for _ in range(rng.randint(1, 3))]
        text = _noisy(rng, atoms)
        clean = ",".join(f"{k}:{v}" for k, v in atoms)
        theirs, ours = _both(text)
        if not (theirs and ours):
            differ.append((text, theirs, ours))
            continue
        if _TGET() != M.get_allocator_settings() or M.get_allocator_settings() != text:
            differ.append((text, "read back", _TGET(), M.get_allocator_settings()))
        got = _fields(_config.current())
        M.set_allocator_settings(BASELINE)
        M.set_allocator_settings(clean)
        if got != _fields(_config.current()):
            differ.append((text, "parsed", got, _config.current()))
    assert differ == []
    # the options reach the allocator of the device that is not current
    accel.set_device_index(0)
    M.set_allocator_settings(BASELINE)
    M.set_allocator_settings(" max_split_size_mb : 6\t4 , roundup_power2_divisions:[ 256 : 2 , > : 4 ] ,")
    config = M.device_allocator(1).config
    assert config.max_split_size == 64 * MiB
    assert [config.divisions_for(n * MiB) for n in (100, 300, 600)] == [2, 2, 4]
    buf = accel.Buffer(3 * MiB, device=1)
    assert M.memory_allocated(1) >= 3 * MiB and M.memory_allocated(0) == 0
    buf.close()


#: malformations torch's parser refuses (tokenizer asserts, stoull/stod errors, value checks)
_SCALAR_BAD = ["{k}", "{k}:", ":{v}", "{k}={v}", "{k} {v}x:", "{k}::{v}", "{k}:{v}:1", "{k}:[{v}]", "{k}:[{v}",
               "{k}:+-{v}", "{k}:x{v}", "{k}:{v},["]
_LIST_BAD = ["[256:2", "256:2]", "[[256:2]]", "[,256:2]", "[256:2,,>:4]", "[256]", "[256:]", "[:2]", "[256:2:4]",
             "[255:2]", "[256:3]", "[0x100:2]", "[256:2,]expandable_segments:True", "3", "0", "-2"]


def _malformed():
    for (key, value), form in itertools.product(ATOMS, _SCALAR_BAD):
        if key == "roundup_power2_divisions" and "[" in form:
            continue
        if form == "{k} {v}x:" and not value[-1].isdigit():
            continue
        yield form.format(k=key, v=value)
    for value in _LIST_BAD:
        yield f"roundup_power2_divisions:{value}"
        yield f"expandable_segments:True,roundup_power2_divisions:{value},max_split_size_mb:64"


def test_malformed_settings_refused_by_both_and_change_nothing(sim_cuda, quiet_torch_settings):
    """Generated malformed settings (no colon, empty key or value, doubled colons, an extra
    ``:value``, brackets around or opening a scalar, a leading sign pair, unbalanced or broken
    ``roundup_power2_divisions`` lists, non-powers of two): torch 2.13's parser refuses every one,
    and accel does too, leaving its options and read-back string as they were."""
    cases = list(_malformed())
    assert len(cases) > 150
    differ = []
    for text in cases:
        theirs, ours = _both(text)
        if theirs or ours:
            differ.append((text, theirs, ours))
        elif M.get_allocator_settings() != BASELINE:
            differ.append((text, "changed", M.get_allocator_settings()))
    assert differ == []


def test_pytorch_alloc_conf_variables_agree_with_torch_parser(sim_cuda, monkeypatch, quiet_torch_settings):
    """The same strings through the environment (PYTORCH_ALLOC_CONF and PYTORCH_CUDA_ALLOC_CONF,
    read by ``_config.from_environment`` at an allocator's first use): accepted or refused as
    torch's parser does; an accepted one gives the options ACCEL_ALLOC_CONF gives, its text and
    the variable's name."""
    rng = random.Random(SEED + 1)
    good = [_noisy(rng, [rng.choice(ATOMS) for _ in range(rng.randint(1, 3))]) for _ in range(40)]
    bad = list(_malformed())[::7]
    differ = []
    for text, var in zip(good + bad, itertools.cycle(("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"))):
        for name in _config.ENV_VARS:       # (ACCEL_TEST_ALLOC_CONF may have set one)
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv(var, text)
        _TSET(BASELINE)
        theirs = _accepted(_TSET, text)
        try:
            config = _config.from_environment()
        except (ValueError, RuntimeError):
            config = None
        if theirs != (config is not None):
            differ.append((var, text, theirs, config))
        elif config is not None:
            want = _config.parse(text, "ACCEL_ALLOC_CONF")
            if _fields(config) != _fields(want) or config.text != text or config.source != var:
                differ.append((var, text, config, want))
    assert differ == []


#: values at and around each check, for the sequences below
_STEP_VALUES = {"max_split_size_mb": ["19", "20", "21", "24", "30", "-1", "64"],
                "max_non_split_rounding_mb": ["19", "20", "24", "30", "64"],
                "large_segment_size_mb": ["10", "11", "20", "24", "30"],
                "garbage_collection_threshold": ["0.5", "1"], "roundup_power2_divisions": ["4", "[256:2]", "3"],
                "expandable_segments": ["True", "False"], "pinned_max_round_threshold_mb": ["8", "64"],
                "pinned_max_cached_size_mb": ["8", "64"], "pinned_use_background_threads": ["True"]}


def test_settings_sequences_keep_and_reset_options_as_torch(sim_cuda, quiet_torch_settings):
    """250 seeded sequences of one to four run-time changes, each naming one or two keys, with no
    reset between the steps: torch keeps large_segment_size_mb (and the other options a change
    does not reset) from one call to the next, and checks max_split_size_mb and
    max_non_split_rounding_mb against the large segment size in effect.  Every step is accepted
    or refused by accel as by torch, and an accepted step reads back the same string.  A
    sequence ends at its first refusal (torch keeps what it parsed before the error and the
    refused string as its settings; accel's refused call changes nothing, as its docstring
    says).  The last accepted options reach device 1's allocator while device 0 is current."""
    rng = random.Random(SEED + 2)
    differ = []
    accel.set_device_index(0)
    last = None
    for _ in range(250):
        _TSET(BASELINE)
        M.set_allocator_settings(BASELINE)
        steps = []
        for _ in range(rng.randint(1, 4)):
            keys = rng.sample(sorted(_STEP_VALUES), rng.randint(1, 2))
            text = ",".join(f"{k}:{rng.choice(_STEP_VALUES[k])}" for k in keys)
            theirs, ours = _accepted(_TSET, text), _accepted(M.set_allocator_settings, text)
            steps.append(text)
            if theirs != ours or (theirs and _TGET() != M.get_allocator_settings()):
                differ.append((steps, theirs, ours))
            if not (theirs and ours):
                break
            last = _fields(_config.current())
    assert differ == []
    M.set_allocator_settings(BASELINE)
    M.set_allocator_settings("large_segment_size_mb:30,max_split_size_mb:30,roundup_power2_divisions:4")
    config = M.device_allocator(1).config
    assert (config.large_segment_size, config.max_split_size, config.divisions_for(64 * MiB)) == (30 * MiB, 30 * MiB, 4)
    assert last is not None


#: values torch reads by their numeric prefix; (key, value, what accel's option must hold)
_SUFFIXES = ["MB", "M", "MiB", "abc", "x1", "%", "#note"]
_PREFIXED = [("max_split_size_mb", "64", "max_split_size", 64 * MiB),
             ("max_non_split_rounding_mb", "32", "max_non_split_rounding", 32 * MiB),
             ("large_segment_size_mb", "24", "large_segment_size", 24 * MiB),
             ("pinned_max_cached_size_mb", "64", "pinned_max_cached_size", 64 * MiB),
             ("garbage_collection_threshold", "0.6", "garbage_collection_threshold", 0.6)]


def _suffixed_cases():
    cases = [(k, v + s, field, want) for (k, v, field, want), s in itertools.product(_PREFIXED, _SUFFIXES)]
    return cases + [("roundup_power2_divisions", "4" + s, None, None) for s in _SUFFIXES]


def test_torch_reads_suffixed_numbers_by_their_prefix(quiet_torch_settings):
    """The oracle of the next test, kept out of its xfail: torch 2.13's parser accepts every
    suffixed value below, and refuses the same values cut to a number it refuses (the check
    runs on the prefix: ``max_split_size_mb:19MB`` is "too small, must be >= 20")."""
    for key, value, _, _ in _suffixed_cases():
        _TSET(BASELINE)
        _TSET(f"{key}:{value}")
    for bad in ("max_split_size_mb:19MB", "garbage_collection_threshold:1.5abc", "roundup_power2_divisions:3x1"):
        _TSET(BASELINE)
        with pytest.raises(ValueError):
            _TSET(bad)


# (r77b found; fixed in session 38)
def test_number_with_trailing_text_read_by_its_prefix_as_torch(sim_cuda, quiet_torch_settings):
    """torch 2.13: ``max_split_size_mb:64MB`` is 64 MiB (std::stoull stops at "M"),
    ``garbage_collection_threshold:0.6abc`` is 0.6 (std::stod), ``roundup_power2_divisions:4x1``
    is 4; accel's _config promises that a setting written for torch never breaks accel and that
    MiB counts are read as std::stoull reads them, but refuses each of these."""
    differ = []
    for key, value, field, want in _suffixed_cases():
        text = f"{key}:{value}"
        M.set_allocator_settings(BASELINE)
        if not _accepted(M.set_allocator_settings, text):     # torch accepts every one (test above)
            differ.append(text)
        elif field is not None and getattr(_config.current(), field) != want:
            differ.append((text, getattr(_config.current(), field)))
    assert differ == []


# ============================================================================ device strings
_TYPES = ["cuda", "xpu", "mps", "cpu", "CUDA", "Cuda", "cud", "cuda ", " cuda", "", "cuda0"]
_INDICES = ["0", "1", "01", "00", "-1", "+1", " 1", "1 ", "1.0", "\u00b2", "\u0661", "-0", "0x1", "1a", "", "127"]


def test_device_strings_accepted_and_parsed_as_torch_device(sim_cuda):
    """Every ``type[:index]`` string of the product below: ``accel.device(s)`` is accepted
    exactly when ``torch.device(s)`` is, with the same type and index, and then equals the torch
    device and hashes as it does; ``accel.device(torch.device(s))`` is the same device.  (torch
    refuses indices that do not fit its DeviceIndex, and types accel has no backend for; both are
    left out: accel checks an index against the device count where it is used.)"""
    differ = []
    for kind, sep, index in itertools.product(_TYPES, ["", ":"], _INDICES):
        if not sep and index:
            continue
        text = kind + sep + index
        try:
            theirs = torch.device(text)
        except RuntimeError:
            theirs = None
        try:
            ours = accel.device(text)
        except (RuntimeError, ValueError):
            ours = None
        if (theirs is None) != (ours is None):
            differ.append((text, theirs, ours))
        elif ours is not None:
            if (ours.type, ours.index) != (theirs.type, theirs.index) or ours != theirs or hash(ours) != hash(theirs):
                differ.append((text, theirs, ours))
            if accel.device(theirs) != ours:
                differ.append((text, "from torch.device", accel.device(theirs)))
    assert differ == []
    # a parsed string and its torch.device reach device 1 while device 0 is current
    accel.set_device_index(0)
    for dev in (accel.device("cuda:1"), torch.device("cuda:1")):
        assert accel.current_stream(dev).device.index == 1
        assert M.memory_allocated(dev) == 0
    assert accel.current_device_index() == 0


# ============================================================================ seeds
def _torch_seed(value):
    try:
        return torch.Generator().manual_seed(value).initial_seed()
    except (RuntimeError, ValueError, TypeError, OverflowError) as exc:
        return type(exc)


def test_integer_seeds_wrap_and_overflow_as_torch_generator(sim_cuda):
    """Integers around every 64-bit edge (seeded sample plus the edges themselves, and numpy
    integers of every width at their limits): accel's
    ``manual_seed`` on device 1 (not current) takes a seed exactly when torch's CPU generator does
    (torch documents the same rule for CUDA: the seed is a uint64, a negative one wraps), gives
    the same ``initial_seed``, and its 16-byte state is (seed, offset 0) little-endian, as
    REFERENCE.md's CUDA state."""
    import accel.random as R
    rng = random.Random(SEED)
    edges = [0, 1, -1, 2 ** 63 - 1, 2 ** 63, -2 ** 63, -2 ** 63 - 1, 2 ** 64 - 1, 2 ** 64, -2 ** 64, 2 ** 65]
    values = edges + [rng.randint(-2 ** 64, 2 ** 64) for _ in range(60)] + [rng.getrandbits(64) for _ in range(20)]
    # numpy integers of every width at their limits: torch.cuda.manual_seed does int(seed) first
    # (torch/cuda/random.py), so the oracle is the Python int's rule (accel takes __index__)
    numpy_values = [dt(v) for dt in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
                    for v in (np.iinfo(dt).min, np.iinfo(dt).max, 1)]
    values += numpy_values
    accel.set_device_index(0)
    R.manual_seed_all(123)
    differ = []
    for value in values:
        want = _torch_seed(int(value))
        try:
            with accel.device_index(1):
                R.manual_seed(value)
            got = R.initial_seed(1)
        except (RuntimeError, ValueError, TypeError, OverflowError) as exc:
            got = exc
        if isinstance(want, int):
            state = bytes(R.get_rng_state(1)) if isinstance(got, int) else b""
            if got != want or state != want.to_bytes(8, "little") + bytes(8):
                differ.append((value, want, got, state))
        elif isinstance(got, int):
            differ.append((value, want, got))
    assert differ == []
    assert R.initial_seed(0) == 123


# ============================================================================ device-index parsing
def _torch_index(monkeypatch, value, optional):
    """torch/accelerator/_utils.py::_get_device_index run as on a CUDA machine whose current
    device is accel's (torch.accelerator.current_accelerator / current_device_index patched)."""
    from torch.accelerator import _utils
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", accel.current_device_index)
    try:
        return _utils._get_device_index(value, optional)
    except (RuntimeError, ValueError) as exc:
        return exc


def _device_inputs():
    yield None
    for i in (0, 1, 5, 127, -1, -2):
        yield i
    for kind, index in itertools.product(["cuda", "cpu", "xpu", "mps", "meta", "cuda:", "CUDA"],
                                         ["", ":0", ":1", ":7", ":127", ":01", ":-1", ":x", ": 1"]):
        yield kind + index
    for kind, index in itertools.product(["cuda", "cpu", "xpu", "meta"], [None, 0, 1, 9]):
        yield torch.device(kind, index)


def test_device_index_normalization_as_torch_get_device_index(sim_cuda, monkeypatch):
    """``accel._device.device_index`` (every public device argument goes through it) against
    torch 2.13's own ``_get_device_index`` over ints, strings and torch.device objects of every
    type, with ``optional`` False and True, while device 1 (then 0) is current: the same index,
    or an error of the same class (ValueError for a type mismatch or a missing index, with
    torch's message, except for "meta", a type accel does not know; RuntimeError for a string
    torch.device refuses).  Indices stay within
    torch's 8-bit DeviceIndex (torch.device("cuda:128") wraps to -128)."""
    from accel import _device
    differ = []
    for current in (1, 0):
        accel.set_device_index(current)
        for value, optional in itertools.product(list(_device_inputs()), (False, True)):
            want = _torch_index(monkeypatch, value, optional)
            try:
                got = _device.device_index(value, optional)
            except (RuntimeError, ValueError) as exc:
                got = exc
            if isinstance(want, int) or isinstance(got, int):
                if got != want or type(got) is not int:
                    differ.append((current, value, optional, want, got))
            elif not isinstance(got, type(want)):
                differ.append((current, value, optional, want, got))
            elif "meta" in str(value):
                continue    # a type accel has no backend for: accel.device refuses it (a ValueError too)
            elif "doesn't match" in str(want) or "Expected a torch.device" in str(want):
                if str(got) != str(want).replace("device(type='cuda')", "cuda"):
                    differ.append((current, value, optional, str(want), str(got)))
    assert differ == []
