"""The fill kinds: argument checking, kernel arguments, and the host computation.

A *kind* names one kernel (``accel_philox_<kind>``) and one host rule in
:mod:`accel.random._transforms`.  :func:`plan` checks the user's arguments
and returns a :class:`Plan` holding everything both paths need, so the
device and host paths cannot disagree on parameters.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, List, NamedTuple, Tuple

#: kind -> (numpy dtype name, elements per Philox counter)
KINDS = {
    "raw_u32": ("uint32", 4),
    "uniform_f32": ("float32", 4),
    "uniform_f64": ("float64", 2),
    "normal_f32": ("float32", 4),
    "normal_f64": ("float64", 2),
    "randint_i32": ("int32", 4),
    "randint_i64": ("int64", 4),
    "randint_i32_wide": ("int32", 2),
    "randint_i64_wide": ("int64", 2),
}

KERNEL_PREFIX = "accel_philox_"
STORE_STATE = "accel_philox_store_state"
KERNEL_NAMES = tuple(KERNEL_PREFIX + k for k in KINDS) + (STORE_STATE,)


class Plan(NamedTuple):
    kind: str
    n: int                                   # elements
    words: int                               # 32-bit words consumed (before rounding to 4)
    kernel_args: List[Tuple[str, Any]]       # arguments after the common ones
    host: Callable[[int, int], Any]          # (seed, offset) -> numpy array of n values

    @property
    def kernel(self) -> str:
        return KERNEL_PREFIX + self.kind

    @property
    def counters(self) -> int:
        return -(-self.n // KINDS[self.kind][1])


def _dtype_name(dtype, allowed: Tuple[str, ...], what: str) -> str:
    """The numpy name of ``dtype`` when the fill writes it; TypeError otherwise, also for None
    (numpy reads it as float64) and a non-native byte order (the kernels write native values:
    '>f4' was filled as native float32, r67i)."""
    name = None
    if dtype is not None:
        try:
            import numpy as np
            d = np.dtype(dtype)
            if d.isnative:
                name = d.name
        except TypeError:
            pass
    if name not in allowed:
        raise TypeError(f"{what} supports dtype {' or '.join(repr(a) for a in allowed)} in native byte order, "
                        f"got {dtype!r}")
    return name


def _finite(value, what: str) -> float:
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    if isinstance(value, (bool, str, bytes, bytearray, complex)) or kind not in (None, "i", "u", "f"):
        # bool, numpy.bool; a str or bytes float() would parse (r67i: '0.5' was taken), numpy's
        # too; a numpy complex would lose its imaginary part (r67j)
        raise TypeError(f"{what} must be a real number, got {type(value).__name__} {value!r}")
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a real number, got {type(value).__name__} {value!r}") from None
    except OverflowError:
        raise ValueError(f"{what} must be finite, got a {type(value).__name__} too large for a float") from None
    if not math.isfinite(f):
        raise ValueError(f"{what} must be finite, got {f}")
    return f


def _int(value, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__} {value!r}") from None


def count_elements(nbytes: int, dtype: str, what: str) -> int:
    import numpy as np
    size = np.dtype(dtype).itemsize
    if nbytes % size:
        raise ValueError(f"{what}: the buffer's {nbytes} bytes are not a whole number of {dtype} "
                         f"({size}-byte) elements")
    return nbytes // size


def plan_uniform(nbytes: int, dtype, low, high) -> Plan:
    dtype = _dtype_name(dtype, ("float32", "float64"), "uniform_")
    low, high = _finite(low, "low"), _finite(high, "high")
    if low > high:
        raise ValueError(f"uniform_ expects to return a [low, high) range, but found low={low} > high={high}")
    if not math.isfinite(high - low):
        raise ValueError(f"uniform_: high - low overflows ({high} - {low})")
    n = count_elements(nbytes, dtype, "uniform_")
    from . import _transforms as t
    if dtype == "float32":
        lo32, scale, hi32 = t.uniform_f32_params(low, high)
        if not (math.isfinite(float(lo32)) and math.isfinite(float(hi32)) and math.isfinite(float(scale))):
            raise ValueError(f"uniform_: [{low}, {high}) does not fit in float32")
        args = [("f32", float(lo32)), ("f32", float(scale)), ("f32", float(hi32))]
        kind = "uniform_f32"
        host = lambda seed, offset: t.uniform_f32(_raw(seed, offset, n), low, high)
    else:
        args = [("f64", low), ("f64", high - low), ("f64", high)]
        kind = "uniform_f64"
        host = lambda seed, offset: t.uniform_f64(_raw(seed, offset, 2 * n), low, high)
    return Plan(kind, n, t.words_for(kind, n), args, host)


def plan_normal(nbytes: int, dtype, mean, std) -> Plan:
    dtype = _dtype_name(dtype, ("float32", "float64"), "normal_")
    mean, std = _finite(mean, "mean"), _finite(std, "std")
    if std < 0:
        raise ValueError(f"normal_ expects std >= 0.0, but found std {std}")
    n = count_elements(nbytes, dtype, "normal_")
    from . import _transforms as t
    kind = "normal_f32" if dtype == "float32" else "normal_f64"
    words = t.words_for(kind, n)
    fn = t.normal_f32 if dtype == "float32" else t.normal_f64
    host = lambda seed, offset: fn(_raw(seed, offset, words), n, mean, std)
    return Plan(kind, n, words, [("f64", mean), ("f64", std)], host)


def plan_randint(nbytes: int, dtype, low, high) -> Plan:
    dtype = _dtype_name(dtype, ("int64", "int32"), "randint_")
    low, high = _int(low, "low"), _int(high, "high")
    if low >= high:
        raise ValueError(f"randint_ expects 'low' to be less than 'high', but got low={low} >= high={high}")
    bits = 32 if dtype == "int32" else 64
    lo_lim, hi_lim = -(1 << (bits - 1)), 1 << (bits - 1)
    if low < lo_lim or high > hi_lim:
        raise ValueError(f"randint_: [{low}, {high}) is outside the {dtype} range "
                         f"[{lo_lim}, {hi_lim})")
    n = count_elements(nbytes, dtype, "randint_")
    from . import _transforms as t
    kind = t.randint_kind(low, high, dtype)
    words = t.words_for(kind, n)
    span = high - low
    args = [("u64", span % (1 << 64)), ("i64", low)]   # span 2**64 travels as 0
    host = lambda seed, offset: t.randint(_raw(seed, offset, words), low, high, dtype)
    return Plan(kind, n, words, args, host)


def plan_raw(nbytes: int) -> Plan:
    n = count_elements(nbytes, "uint32", "random_raw_")
    return Plan("raw_u32", n, n, [], lambda seed, offset: _raw(seed, offset, n))


def _raw(seed: int, offset: int, nwords: int):
    from . import philox
    return philox.raw_words(seed, offset, nwords)
