"""``ACCEL_ALLOC_CONF``: options of the caching allocator.

The syntax and option names are PyTorch's ``PYTORCH_CUDA_ALLOC_CONF``
(``c10/core/AllocatorConfig.cpp``): comma-separated ``key:value`` pairs, e.g.
``max_split_size_mb:128,garbage_collection_threshold:0.8``.  ``ACCEL_ALLOC_CONF``
wins; when it is unset the first of ``PYTORCH_CUDA_ALLOC_CONF``, ``PYTORCH_HIP_ALLOC_CONF`` and
``PYTORCH_ALLOC_CONF`` that is set is read (torch's order), so a torch configuration carries
over.  The string is parsed at the allocator's first use.  ``accel.memory.set_allocator_settings`` changes the options while the
program runs, by torch's rules (``changed``; ``RESET_AT_RUN_TIME``, ``FIXED_AT_RUN_TIME``).

A setting written for torch never breaks accel: every key torch 2.13 accepts is
accepted, with torch's value checks (booleans exactly ``True``/``False``,
``pinned_num_register_threads`` a power of two <= 128, MiB counts read as ``std::stoull``
reads them, so ``-1`` is no limit and ``64MB`` is 64, ...), and a setting torch's CUDA build
refuses is refused (an empty option, two different ``backend`` values, a fraction that
underflows).  The torch keys accel
does not implement (``TORCH_ONLY``) give one warning and are ignored.  accel's own
keys (``policy``, ``release_threshold``) are read only from ``ACCEL_ALLOC_CONF``: in
a PYTORCH_ variable, which torch refuses them from, they give one warning and are
ignored.  A key neither knows, or a bad value, raises
:class:`accel._errors.AllocatorConfigError` (a ValueError and a RuntimeError, as
torch's) naming the option and listing the valid ones.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from fractions import Fraction
from typing import NamedTuple, Optional, Tuple

from .._errors import AllocatorConfigError

MiB = 1 << 20
_SPACE = re.compile("[ \t\n\v\f\r]")
#: "no limit" for max_split_size, as torch's SIZE_MAX; memory_stats reports it as -1.
UNLIMITED = (1 << 64) - 1
#: torch keeps one roundup_power2_divisions entry per power-of-two interval from
#: 1 MiB (2**20) to 64 GiB (2**36).
_POW2_START = 20
_POW2_INTERVALS = 16

#: values of the ``backend`` key, spelled as torch spells them
BACKENDS = ("native", "cudaMallocAsync")

# torch 2.13 reads the first of PYTORCH_CUDA_ALLOC_CONF, PYTORCH_HIP_ALLOC_CONF, PYTORCH_ALLOC_CONF
# that is set, an empty one too, whatever the device (c10/core/AllocatorConfig.cpp,
# AcceleratorAllocatorConfig::instance; measured with the 2.13 wheel, tests/test_torch_ports_r70b.py,
# tests/test_review_r70g.py); accel's own variable comes first.
ENV_VARS = ("ACCEL_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

OPTIONS = {
    "max_split_size_mb": "blocks at least this large (MiB, >= large_segment_size_mb) are never split",
    "max_non_split_rounding_mb": "an oversize request may take a cached block up to this much larger "
                                 "(MiB, >= large_segment_size_mb)",
    "large_segment_size_mb": "the segment that requests of 1 to 10 MiB share under policy:torch (MiB, > 10; "
                             "default 20); the least max_split_size_mb and max_non_split_rounding_mb",
    "garbage_collection_threshold": "release unused cached segments when reserved memory exceeds "
                                    "this fraction (0 < t < 1) of the allowed memory",
    "roundup_power2_divisions": "round request sizes up to one of N divisions per power of two "
                                "(N, or a list such as [256:1,512:2,>:4] keyed by MiB)",
    "release_threshold": "(ACCEL_ALLOC_CONF only) bytes (suffix K/M/G allowed) of completely free segments "
                         "(with expandable segments: free mapped pages) kept cached; more are returned to the "
                         "device when a block is freed",
    "expandable_segments": "True/False: grow one virtual address range per stream and pool by mapping "
                           "2 MiB pages where the backend has virtual memory (default: True there; False under policy:torch, as torch)",
    "per_process_memory_fraction": "cap reserved memory at this fraction [0, 1] of the device's total",
    "throw_on_cudamalloc_oom": "True/False: refuse a request whose new segment or pages would take reserved "
                               "memory past the fraction's cap (or the device's total) at once, without "
                               "freeing the cache and retrying; counted in num_oom_rejections",
    "policy": "(ACCEL_ALLOC_CONF only) accel (default: tight segments, release-before-grow) or torch (PyTorch's sizing rules)",
    "backend": "native (accel's caching allocator, the default) or cudaMallocAsync (the driver's "
               "stream-ordered pool, where the backend has one; only per_process_memory_fraction applies)",
    "pinned_use_background_threads": "True/False; accepted for PyTorch compatibility, no effect",
    "pinned_use_cuda_host_register": "True/False; accepted for PyTorch compatibility, no effect",
    "pinned_use_hip_host_register": "True/False; accepted for PyTorch compatibility, no effect",
    "pinned_num_register_threads": "a power of two <= 128; accepted for PyTorch compatibility, no effect",
    "pinned_reserve_segment_size_mb": "MiB > 0; accepted for PyTorch compatibility, no effect",
    "release_lock_on_cudamalloc": "True/False; accepted for PyTorch compatibility, no effect",
    "release_lock_on_hipmalloc": "True/False; accepted for PyTorch compatibility, no effect",
    "graph_capture_record_stream_reuse": "True/False; accepted for PyTorch compatibility, no effect",
    "pinned_free_catch_all": "True/False; accepted for PyTorch compatibility, no effect",
    "pinned_max_round_threshold_mb": "pinned host requests above this size (MiB) are not rounded up to a power "
                                     "of two (default: no limit)",
    "pinned_max_cached_size_mb": "freed pinned host blocks above this size (MiB) are not cached: they are unpinned "
                                 "once their streams' work completed; requests above it are not rounded up "
                                 "(default: no limit)",
}

#: keys only accel knows: read from ACCEL_ALLOC_CONF only (torch refuses them)
ACCEL_ONLY = ("policy", "release_threshold")
#: the keys only torch's CUDA parser reads (CUDAAllocatorConfig::getKeys, torch 2.13), which on a
#: CUDA (non-ROCm) build reads PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF only: in
#: PYTORCH_HIP_ALLOC_CONF the generic parser skips them, unchecked
_CUDA_PARSER_KEYS = ("backend", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
                     "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
                     "graph_capture_record_stream_reuse", "pinned_reserve_segment_size_mb",
                     "pinned_num_register_threads", "per_process_memory_fraction", "pinned_free_catch_all",
                     "throw_on_cudamalloc_oom")
#: options of the caching allocator (backend:native) that backend:cudaMallocAsync ignores
_NATIVE_ONLY = ("max_split_size_mb", "max_non_split_rounding_mb", "large_segment_size_mb",
                "garbage_collection_threshold", "roundup_power2_divisions", "expandable_segments",
                "throw_on_cudamalloc_oom", "policy")
#: keys torch accepts that accel parses and validates as torch does, then ignores (one warning)
TORCH_ONLY = ("pinned_use_background_threads", "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
              "pinned_num_register_threads", "pinned_reserve_segment_size_mb", "release_lock_on_cudamalloc",
              "release_lock_on_hipmalloc", "graph_capture_record_stream_reuse", "pinned_free_catch_all")
#: torch's pinned_max_register_threads() (c10/cuda/CUDAAllocatorConfig.h)
_MAX_REGISTER_THREADS = 128
#: torch's kMinLargeAlloc in MiB: a large segment must be larger (parseLargeSegmentSize)
_MIN_LARGE_ALLOC_MB = 10
#: (variable, setting) pairs already warned about: one warning per process, not per device
_warned = set()


class AllocConfig(NamedTuple):
    """Parsed allocator options (defaults as PyTorch's where the option is shared)."""

    max_split_size: int = UNLIMITED
    max_non_split_rounding: int = 20 * MiB
    #: torch's kLargeBuffer, large_segment_size_mb (torch 2.13)
    large_segment_size: int = 20 * MiB
    garbage_collection_threshold: float = 0.0
    #: divisions per power-of-two interval (all 0 = plain 512-byte rounding)
    roundup_power2_divisions: Tuple[int, ...] = (0,) * _POW2_INTERVALS
    release_threshold: Optional[int] = None
    #: None = the default: on where the backend has virtual memory, off under policy:torch
    expandable_segments: Optional[bool] = None
    per_process_memory_fraction: float = 1.0
    throw_on_cudamalloc_oom: bool = False
    policy: str = "accel"
    #: "native" (DeviceCachingAllocator) or "cudaMallocAsync" (accel.memory._async)
    backend: str = "native"
    #: pinned_max_round_threshold_mb in bytes: larger pinned host requests are not rounded up to a
    #: power of two (torch 2.13's CachingHostAllocator; UNLIMITED: no limit)
    pinned_max_round_threshold: int = UNLIMITED
    #: pinned_max_cached_size_mb in bytes: larger freed pinned blocks are unpinned, not cached
    pinned_max_cached_size: int = UNLIMITED
    source: str = ""
    #: the option string these were parsed from (torch's ``last_allocator_settings``)
    text: str = ""

    def divisions_for(self, size: int) -> int:
        """torch's ``roundup_power2_divisions(size)``: the entry for size's power-of-two interval."""
        index = max(size.bit_length() - 1 - _POW2_START, 0)
        return self.roundup_power2_divisions[min(index, _POW2_INTERVALS - 1)]


def _fail(key: str, value: str, why: str, source: str) -> AllocatorConfigError:
    return AllocatorConfigError(f"{source}: invalid value {value!r} for option {key!r}: {why}")


def _parse_bool(key, value, source):
    # torch: exactly True or False (AllocatorConfig.cpp, "Expected a single True/False argument")
    if value == "True":
        return True
    if value == "False":
        return False
    raise _fail(key, value, f"Expected a single True/False argument for {key}", source)


#: the number std::stod reads at the start of a value (strtod: decimal, hexadecimal, inf, nan),
#: which ignores what follows it: torch reads ``0.6abc`` as 0.6
_LEADING_FLOAT = re.compile(r"[ \t\n\v\f\r]*(?:(?P<hex>[+-]?0x(?:[0-9a-f]+\.?[0-9a-f]*|\.[0-9a-f]+)(?:p[+-]?[0-9]+)?)"
                            r"|(?P<dec>[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?|inf(?:inity)?|nan)))",
                            re.IGNORECASE)


def _exact(match) -> Fraction:
    """The exact value of a number :data:`_LEADING_FLOAT` matched (inf and nan are never
    small, so never asked)."""
    if match["dec"]:
        return Fraction(match["dec"])
    text = match["hex"].lower()
    sign = -1 if text.startswith("-") else 1
    digits, _, exponent = text.lstrip("+-")[2:].partition("p")
    whole, _, fraction = digits.partition(".")
    return sign * Fraction(int(whole + fraction or "0", 16), 16 ** len(fraction)) * Fraction(2) ** int(exponent or 0)


def _parse_float(key, value, source, lo, hi, lo_open=True, hi_open=False):
    match = _LEADING_FLOAT.match(value) if _one_token(value) else None
    if match is None:
        raise _fail(key, value, "expected a number", source)
    number = float.fromhex(match["hex"]) if match["hex"] else float(match["dec"])
    if abs(number) < sys.float_info.min and _exact(match) != number:
        # strtod's ERANGE for a result that underflows (to zero or an inexact subnormal), which
        # std::stod throws as out_of_range
        raise _fail(key, value, "underflows a double (std::stod: out of range)", source)
    if not ((lo < number if lo_open else lo <= number) and (number < hi if hi_open else number <= hi)):
        raise _fail(key, value, f"expected {lo:g} {'<' if lo_open else '<='} value {'<' if hi_open else '<='} "
                                f"{hi:g}", source)
    return number


#: a whole integer: ASCII digits, an optional sign (Python's int() also takes "1_000" and
#: non-ASCII digits), for accel's own byte counts (:func:`_parse_bytes`), which take no trailing text
_DECIMAL = re.compile(r"[+-]?[0-9]+")
#: the integer std::stoull/stoi read at the start of a value, after white space; they ignore what
#: follows it, so torch reads ``max_split_size_mb:64MB`` as 64 and ``1_000`` as 1
_LEADING_DECIMAL = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")


def _one_token(value: str) -> bool:
    """Whether ``value`` is one token of torch's tokenizer, which ends a token at ``:``, ``[``,
    ``]`` and ``,``: a number read by its prefix must not swallow the next token (torch refuses
    ``max_split_size_mb:64:1``)."""
    return not any(ch in value for ch in ":[],")


def _parse_int(key, value, source):
    match = _LEADING_DECIMAL.match(value) if _one_token(value) else None
    if match is None:
        raise _fail(key, value, "expected an integer", source)
    return int(match.group(1))


def _parse_size_t(key, value, source):
    """A size_t as std::stoull reads one (torch's ConfigTokenizer::toSizeT): a negative number
    wraps modulo 2**64 (``-1`` is 2**64 - 1), anything past what a size_t holds is refused."""
    number = _parse_int(key, value, source)
    if number < 0 and -number <= UNLIMITED:
        number += UNLIMITED + 1
    if not 0 <= number <= UNLIMITED:
        raise _fail(key, value, f"more than a size_t holds (at most {UNLIMITED})", source)
    return number


def _parse_mb(key, value, source):
    """A MiB count as torch reads one (:func:`_parse_size_t`, then parseMaxSplitSize's clamp):
    ``-1`` is no limit, and the count is clamped to SIZE_MAX / 1 MiB so the byte count fits a
    size_t."""
    return min(_parse_size_t(key, value, source), UNLIMITED // MiB)


def _mb_bytes(mb: int) -> int:
    """The bytes of a MiB count from :func:`_parse_mb`.  Its clamp, torch's "no limit" (SIZE_MAX
    less one MiB in bytes), is accel's UNLIMITED (SIZE_MAX)."""
    return UNLIMITED if mb == UNLIMITED // MiB else mb * MiB


def _parse_bytes(key, value, source):
    text = value.strip().upper().rstrip("B").rstrip("I")
    scale = 1
    if text and text[-1] in "KMGT":
        scale = 1 << (10 * ("KMGT".index(text[-1]) + 1))
        text = text[:-1]
    if not _DECIMAL.fullmatch(text):
        raise _fail(key, value, "expected a byte count such as 1048576, 512M or 2G", source)
    number = int(text)
    if number < 0:
        raise _fail(key, value, "must not be negative", source)
    return number * scale


def _parse_divisions(key, value, source, table=None):
    """One ``roundup_power2_divisions`` value onto ``table``, the one an earlier occurrence in the
    same string built (torch fills one table per parse: ``8,...:[256:4]`` keeps 8 above 256 MiB)."""
    def check(div_text, in_list):
        div = _parse_int(key, div_text, source)
        if div > UNLIMITED:     # torch reads it with std::stoull, which refuses it
            raise _fail(key, value, f"more than a size_t holds (at most {UNLIMITED})", source)
        if div == 0 and not in_list:    # torch: 0 only in a list (a single count must be a power of 2)
            raise _fail(key, value, "a single division count must be a power of two (0 turns an "
                                    "interval off only in a list such as [256:0,>:4])", source)
        if div != 0 and (div < 1 or div & (div - 1)):
            raise _fail(key, value, "divisions must be a power of two (or 0 to disable)", source)
        return 1 if div == 1 else div

    if not value.startswith("["):
        return (check(value, False),) * _POW2_INTERVALS
    if not value.endswith("]"):
        raise _fail(key, value, "a list must look like [256:1,512:2,>:4]", source)
    items = value[1:-1].split(",")
    if items[-1] == "":
        items.pop()             # one trailing comma (or "[]"), as torch's tokenizer
    if "" in items:
        raise _fail(key, value, "a list entry is empty (two commas in a row, or a leading one)", source)
    # torch's parseRoundUpPower2Divisions (c10/core/AllocatorConfig.cpp, checked against
    # libc10 2.13): the first size key also fills every interval below its own, each later key
    # sets only its own, ">" fills the intervals above the last key seen; the rest stay 0.
    table = list(table) if table is not None else [0] * _POW2_INTERVALS
    last, first = 0, True
    for item in items:
        size_text, sep, div_text = item.partition(":")
        if not sep:
            raise _fail(key, value, f"list entry {item!r} is not size_mb:divisions", source)
        div = check(div_text.strip(), True)
        size_text = size_text.strip()
        if size_text == ">":
            for i in range(last + 1, _POW2_INTERVALS):
                table[i] = div
            continue
        mb = _parse_int(key, size_text, source)
        if mb > UNLIMITED:
            raise _fail(key, value, f"list key {size_text!r} is more than a size_t holds", source)
        if mb <= 0 or mb & (mb - 1):
            raise _fail(key, value, f"list key {size_text!r} must be a power-of-two MiB count", source)
        index = min(mb.bit_length() - 1, _POW2_INTERVALS - 1)
        if first:
            table[:index] = [div] * index
            first = False
        table[index] = div
        last = index
    return tuple(table)


def _split_options(text: str):
    """Split on commas outside brackets ("roundup_power2_divisions:[256:1,>:4]")."""
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            yield text[start:i]
            start = i + 1
    yield text[start:]


def parse(text: str, source: str = "ACCEL_ALLOC_CONF") -> AllocConfig:
    """Parse an option string read from the variable ``source``; AllocatorConfigError (a
    ValueError and RuntimeError) for unknown keys or bad values.  From a ``PYTORCH_``
    variable, accel-only keys are skipped; the skipped and the not-implemented torch keys
    give one UserWarning per (variable, setting) in the process."""
    values = _values(text, source)
    return _check_minimums(AllocConfig(**values), source, values)


def _check_minimums(config: AllocConfig, source: str, named) -> AllocConfig:
    """torch's checks of a max_split_size_mb or max_non_split_rounding_mb the setting names (the
    fields in ``named``) against the large segment size in effect, whatever the order of the keys
    ("too small, must be >= 20")."""
    large_mb = config.large_segment_size // MiB
    for key, field in (("max_split_size_mb", "max_split_size"),
                       ("max_non_split_rounding_mb", "max_non_split_rounding")):
        size = getattr(config, field)
        if field in named and size < config.large_segment_size:
            raise _fail(key, str(size // MiB), f"too small, must be >= {large_mb} (MiB, large_segment_size_mb)",
                        source)
    return config


def _values(text: str, source: str) -> dict:
    """parse()'s work: the AllocConfig fields ``text`` names, with ``source`` and ``text``."""
    values = {"source": source, "text": text}
    from_torch = source.startswith("PYTORCH_")
    skipped, ignored, unread, named = [], [], [], set()
    # torch's ConfigTokenizer skips every white-space character (std::isspace: a tab, a newline
    # or CR of a setting read from a file), wherever it is
    items = list(_split_options(_SPACE.sub("", text)))
    if items[-1] == "":
        items.pop()     # one trailing comma (or nothing at all), as torch's CUDA parser takes it
    for item in items:
        if not item:
            # torch's CUDA parser reads the second comma as a key (CUDAAllocatorConfig::parseArgs:
            # "Unrecognized key ','"); the generic one reads one empty item and asserts on two
            raise AllocatorConfigError(f"{source}: an empty option (a comma at the start, or two in a "
                                       f"row) in {text!r}; separate key:value options with one comma")
        key, sep, value = item.partition(":")
        named.add(key)
        if not sep:
            # "key=value" is not torch syntax, but an easy slip worth a precise message.
            raise AllocatorConfigError(f"{source}: option {item!r} must be written key:value "
                             f"(e.g. max_split_size_mb:128)")
        if key not in OPTIONS:
            valid = "\n".join(f"  {name}: {doc}" for name, doc in OPTIONS.items())
            raise AllocatorConfigError(f"{source}: unknown allocator option {key!r}; valid options are:\n{valid}")
        if from_torch and key in ACCEL_ONLY:
            skipped.append(key)          # torch refuses it; a shared variable must not break torch
            continue
        if source == "PYTORCH_HIP_ALLOC_CONF" and key in _CUDA_PARSER_KEYS:
            unread.append(key)           # as torch's CUDA build, which never reads them there
            continue
        if key in TORCH_ONLY:
            ignored.append(key)
        if key == "max_split_size_mb":
            # (at least large_segment_size_mb: _check_minimums, once every key is read)
            values["max_split_size"] = _mb_bytes(_parse_mb(key, value, source))
        elif key == "max_non_split_rounding_mb":
            values["max_non_split_rounding"] = _mb_bytes(_parse_mb(key, value, source))
        elif key == "large_segment_size_mb":
            mb = _parse_mb(key, value, source)
            if mb <= _MIN_LARGE_ALLOC_MB:      # torch: "large_segment_size_mb must be > 10 MB"
                raise _fail(key, value, f"must be > {_MIN_LARGE_ALLOC_MB} (MiB, the largest request that "
                                        f"shares a large segment)", source)
            values["large_segment_size"] = _mb_bytes(mb)
        elif key == "throw_on_cudamalloc_oom":
            values["throw_on_cudamalloc_oom"] = _parse_bool(key, value, source)
        elif key == "garbage_collection_threshold":
            # torch: "garbage_collect_threshold too small, set it 0.0~1.0" / "too big": 0 < t < 1
            values["garbage_collection_threshold"] = _parse_float(key, value, source, 0.0, 1.0, hi_open=True)
        elif key == "roundup_power2_divisions":
            values["roundup_power2_divisions"] = _parse_divisions(key, value, source,
                                                                  values.get("roundup_power2_divisions"))
        elif key == "release_threshold":
            values["release_threshold"] = _parse_bytes(key, value, source)
        elif key == "expandable_segments":
            values["expandable_segments"] = _parse_bool(key, value, source)
        elif key == "per_process_memory_fraction":
            # torch: "per_process_memory_fraction is invalid, set it in [0.0, 1.0]"
            values["per_process_memory_fraction"] = _parse_float(key, value, source, 0.0, 1.0, lo_open=False)
        elif key == "policy":
            if value not in ("accel", "torch"):
                raise _fail(key, value, "expected accel or torch", source)
            values["policy"] = value
        elif key == "backend":
            if value not in BACKENDS:
                raise _fail(key, value, f"expected {' or '.join(BACKENDS)} (torch's spelling)", source)
            if values.get("backend", value) != value:
                # torch asserts each backend token equals the one allocator loaded
                # (CUDAAllocatorConfig::parseAllocatorConfig), so one of two different ones fails
                raise _fail(key, value, f"backend is already {values['backend']} in this setting; "
                                        f"name one backend", source)
            values["backend"] = value
        elif key == "pinned_num_register_threads":
            threads = _parse_size_t(key, value, source)
            if threads <= 0 or threads & (threads - 1):
                raise _fail(key, value, "Number of register threads has to be power of 2", source)
            if threads > _MAX_REGISTER_THREADS:
                raise _fail(key, value, "Number of register threads should be less than or equal to "
                                        f"{_MAX_REGISTER_THREADS}", source)
        elif key == "pinned_reserve_segment_size_mb":
            if _parse_size_t(key, value, source) <= 0:
                raise _fail(key, value, "Pinned reserve segment size has to be greater than 0", source)
        elif key in ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"):
            values[key[:-3]] = _mb_bytes(_parse_mb(key, value, source))
        elif key in TORCH_ONLY:                   # the True/False ones
            _parse_bool(key, value, source)
    _check_pinned_limits(values)
    # torch warns too (CUDAAllocatorConfig::parseArgs, "backend:cudaMallocAsync ignores ...")
    unused = [key for key in _NATIVE_ONLY if key in named] if values.get("backend") == "cudaMallocAsync" else []
    if (skipped or ignored or unread or unused) and (source, text) not in _warned:
        _warned.add((source, text))
        parts = []
        if ignored:
            parts.append(f"{', '.join(ignored)} (torch options accel does not implement)")
        if unused:
            parts.append(f"{', '.join(unused)} (options of the native allocator, which "
                         f"backend:cudaMallocAsync replaces)")
        if skipped:
            parts.append(f"{', '.join(skipped)} (accel options, read only from ACCEL_ALLOC_CONF; "
                         f"torch refuses them)")
        if unread:
            parts.append(f"{', '.join(unread)} (CUDA options, which torch's CUDA build reads only from "
                         f"PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF)")
        warnings.warn(f"{source}: ignored {' and '.join(parts)}", UserWarning, stacklevel=4)
    return values


def _check_pinned_limits(values: dict) -> None:
    """torch's warning (AcceleratorAllocatorConfig::parseArgs, once per process) when one setting
    names both pinned limits and the round threshold is the larger: the cache limit wins, as
    requests above it are never rounded up."""
    rounds, cached = values.get("pinned_max_round_threshold"), values.get("pinned_max_cached_size")
    if rounds is None or cached is None or rounds <= cached or _PINNED_PRECEDENCE in _warned:
        return
    _warned.add(_PINNED_PRECEDENCE)
    warnings.warn(f"pinned_max_round_threshold_mb ({rounds >> 20}) > pinned_max_cached_size_mb ({cached >> 20}). "
                  f"The cache size limit takes precedence: allocations above pinned_max_cached_size_mb are "
                  f"never rounded up.", UserWarning, stacklevel=5)


#: the _warned key of _check_pinned_limits' warning (torch: TORCH_WARN_ONCE)
_PINNED_PRECEDENCE = ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb")


#: Options a run-time change sets back to their defaults unless it names them; the others keep
#: their values.  torch's rule: AcceleratorAllocatorConfig::parseArgs (c10/core/AllocatorConfig.cpp),
#: "The following option will be reset to its default value if not explicitly set each time."
RESET_AT_RUN_TIME = ("max_split_size", "roundup_power2_divisions", "garbage_collection_threshold")
#: Options fixed once an allocator started (torch: "Allocator backend parsed at runtime !=
#: allocator backend parsed at load time"); a change may name them with their current values.
FIXED_AT_RUN_TIME = ("backend", "policy")
SET_AT_RUN_TIME = "set_allocator_settings"

#: The options set at run time (accel.memory.set_allocator_settings), or None: the environment's.
_runtime: Optional[AllocConfig] = None


def current() -> AllocConfig:
    """The options an allocator created now starts with: the last run-time change, else the
    environment's."""
    config = _runtime
    return config if config is not None else from_environment()


def changed(base: AllocConfig, text: str) -> Tuple[AllocConfig, frozenset]:
    """``base`` changed by the option string ``text`` at run time, as torch changes its options
    (``RESET_AT_RUN_TIME``), and the fields ``text`` names.  AllocatorConfigError for a bad
    option or one of ``FIXED_AT_RUN_TIME`` given another value."""
    values = _values(text, SET_AT_RUN_TIME)
    named = frozenset(values) - {"source", "text"}
    defaults = AllocConfig()
    reset = {field: getattr(defaults, field) for field in RESET_AT_RUN_TIME}
    config = _check_minimums(base._replace(**{**reset, **values}), SET_AT_RUN_TIME, named)
    check_fixed(base, config)
    return config, named


def check_fixed(before: AllocConfig, after: AllocConfig) -> None:
    """AllocatorConfigError when ``after`` gives an option of ``FIXED_AT_RUN_TIME`` another value."""
    for field in FIXED_AT_RUN_TIME:
        if getattr(after, field) != getattr(before, field):
            raise AllocatorConfigError(
                f"{SET_AT_RUN_TIME}: option '{field}:{getattr(after, field)}' cannot change at run time "
                f"({field} is {getattr(before, field)}); set it in ACCEL_ALLOC_CONF before the program "
                f"starts, or leave it out")


def from_environment() -> AllocConfig:
    """The configuration from the first of :data:`ENV_VARS` that is set, even to "" (defaults
    when none is), in torch's order."""
    for name in ENV_VARS:
        text = os.environ.get(name)
        if text is not None:
            return parse(text, name)
    return AllocConfig()
