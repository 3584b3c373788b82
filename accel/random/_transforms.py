"""How 32-bit Philox words become values: the one definition host and kernels share.

Every rule here uses only operations IEEE 754 rounds exactly the same way on
any conforming machine (``+ - * /``, ``sqrt``, exact conversions and scaling),
evaluated in a fixed order, so the CUDA kernel (built with ``-fmad=false``)
and this numpy code give bit-identical results.  That is why ``log`` and
``sin``/``cos`` for Box–Muller are written out below as fixed polynomials
instead of calling libm / CUDA's math library (which differ in the last bit).

Word use per element (``W`` is the fill's word stream, see ``philox``):

* ``random_raw`` (uint32): ``x[i] = W[i]``.  1 word per element.
* ``uniform`` float32: ``u = (W[i] >> 8) * 2**-24`` in [0, 1);
  ``x = fl32(fl32(u * scale) + low)`` with ``scale = fl32(high - low)``,
  ``low``/``high`` rounded to float32; a result ``>= high`` becomes ``low``
  (as torch's uniform does).  1 word per element.
* ``uniform`` float64: ``u = ((W[2i] >> 5) * 2**26 + (W[2i+1] >> 6)) * 2**-53``
  in [0, 1); ``x = u * scale + low`` in float64, same ``>= high`` rule.
  2 words per element.
* ``normal`` (Box–Muller, computed in float64): pair ``k`` (elements 2k, 2k+1)
  takes ``u1`` in (0, 1] and an angle ``2*pi*u2``, u2 in [0, 1):
  float32 output: ``u1 = (W[2k] + 1) * 2**-32``, ``u2 = W[2k+1] * 2**-32``;
  float64 output: 53-bit ``u1 = (A + 1) * 2**-53``, ``u2 = B * 2**-53`` with
  ``A = (W[4k] >> 5) * 2**26 + (W[4k+1] >> 6)``, ``B`` likewise from ``W[4k+2], W[4k+3]``.
  ``r = sqrt(-2 log u1)``; ``x[2k] = mean + std * r cos(2 pi u2)``,
  ``x[2k+1] = mean + std * r sin(2 pi u2)``, rounded to float32 for float32
  output.  An odd ``n`` still consumes the last pair's words.
  Float32: 2 words per pair; float64: 4 words per pair.
* ``randint`` in [low, high), ``R = high - low``: ``R < 2**28``: ``x = low + W[i] % R``
  (1 word per element); otherwise ``v = W[2i] | W[2i+1] << 32`` and
  ``x = low + v % R`` (2 words; ``R = 2**64`` takes ``v`` itself), all modulo 2**64, for int32
  and int64 alike (torch's rule: :data:`WIDE_SPAN`).

A fill then advances the generator offset by its words rounded up to a multiple of 4.
"""

from __future__ import annotations

import math
from typing import Tuple

import numpy as np

# --- constants (the kernel source gets these exact doubles from tools/regen_kernels.py) ---
#: atanh series for log(m), m in [sqrt(1/2), sqrt(2)): log m = s * sum c_k s^(2k), s = (m-1)/(m+1).
LOG_COEFFS = tuple(2.0 / (2 * k + 1) for k in range(12))
#: sin x = x * sum S_k x^(2k), cos x = sum C_k x^(2k), for |x| <= pi/4.
SIN_COEFFS = tuple((-1.0) ** k / math.factorial(2 * k + 1) for k in range(9))
COS_COEFFS = tuple((-1.0) ** k / math.factorial(2 * k) for k in range(10))
LN2_HI = 6.93147180369123816490e-01   # fdlibm's split of log(2): LN2_HI * e is exact for |e| < 2**11
LN2_LO = 1.90821492927058770002e-10
SQRT_HALF = 0.70710678118654752440
PI_4 = math.pi / 4

#: words consumed by a fill of n elements, per kind
def words_for(kind: str, n: int) -> int:
    """32-bit words a fill of ``n`` elements of ``kind`` consumes (before rounding to 4)."""
    if kind in ("raw_u32", "uniform_f32", "randint_i32", "randint_i64"):
        return n
    if kind in ("uniform_f64", "randint_i32_wide", "randint_i64_wide"):
        return 2 * n
    if kind == "normal_f32":
        return 2 * ((n + 1) // 2)
    if kind == "normal_f64":
        return 4 * ((n + 1) // 2)
    raise ValueError(f"unknown fill kind {kind!r}")


def offset_increment(words: int) -> int:
    """Offset advance for ``words`` consumed: rounded up to a multiple of 4 (CUDAGeneratorState::increase)."""
    return (words + 3) // 4 * 4


# --- uniform -------------------------------------------------------------------------------
def uniform_f32_params(low: float, high: float) -> Tuple[float, float, float]:
    """(low, scale, high) as the float32 values both paths use."""
    with np.errstate(over="ignore"):   # the caller rejects values that overflow float32
        lo32 = np.float32(low)
        hi32 = np.float32(high)
        scale = np.float32(float(high) - float(low))
    return lo32, scale, hi32


def uniform_f32(words: np.ndarray, low: float = 0.0, high: float = 1.0) -> np.ndarray:
    u = (words >> np.uint32(8)).astype(np.float32)
    u *= np.float32(2.0 ** -24)
    if low == 0.0 and high == 1.0:
        return u  # u*1 + 0 is u exactly
    lo32, scale, hi32 = uniform_f32_params(low, high)
    u *= scale
    u += lo32
    u[u >= hi32] = lo32
    return u


def uniform_f64(words: np.ndarray, low: float = 0.0, high: float = 1.0) -> np.ndarray:
    a = (words[0::2] >> np.uint32(5)).astype(np.float64)
    b = (words[1::2] >> np.uint32(6)).astype(np.float64)
    u = a * 67108864.0
    u += b
    u *= 2.0 ** -53
    if low == 0.0 and high == 1.0:
        return u
    low, high = float(low), float(high)
    u *= high - low
    u += low
    u[u >= high] = low
    return u


# --- Box–Muller ----------------------------------------------------------------------------
def _horner(coeffs, x2: np.ndarray) -> np.ndarray:
    p = np.full_like(x2, coeffs[-1])
    for c in coeffs[-2::-1]:
        p *= x2
        p += c
    return p


def log_f64(u: np.ndarray) -> np.ndarray:
    """log(u) for u > 0 in float64 with a fixed sequence of IEEE operations (error ~1 ulp)."""
    m, e = np.frexp(u)                     # u = m * 2**e, m in [0.5, 1)
    small = m < SQRT_HALF
    m = np.where(small, m * 2.0, m)        # exact
    e = np.where(small, e - 1, e).astype(np.float64)
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    logm = s * _horner(LOG_COEFFS, s2)
    return (e * LN2_LO + logm) + e * LN2_HI


def sincos_octant(octant: np.ndarray, frac: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """sin and cos of ``(octant + frac) * pi/4`` (octant 0..7, frac in [0, 1)), float64."""
    odd = (octant & 1).astype(bool)
    x = np.where(odd, 1.0 - frac, frac) * PI_4   # 1 - frac is exact
    x2 = x * x
    sn = x * _horner(SIN_COEFFS, x2)
    cs = _horner(COS_COEFFS, x2)
    s_phi = np.where(odd, cs, sn)                # angle within the quadrant
    c_phi = np.where(odd, sn, cs)
    q = octant >> 1
    sin = np.select([q == 0, q == 1, q == 2], [s_phi, c_phi, -s_phi], -c_phi)
    cos = np.select([q == 0, q == 1, q == 2], [c_phi, -s_phi, -c_phi], s_phi)
    return sin, cos


def _box_muller(u1: np.ndarray, octant: np.ndarray, frac: np.ndarray, n: int,
                mean: float, std: float) -> np.ndarray:
    r = np.sqrt(log_f64(u1) * -2.0)
    sin, cos = sincos_octant(octant, frac)
    z = np.empty(2 * u1.shape[0], dtype=np.float64)
    z[0::2] = r * cos
    z[1::2] = r * sin
    z = z[:n]
    z *= float(std)
    z += float(mean)
    return z


def normal_f32(words: np.ndarray, n: int, mean: float = 0.0, std: float = 1.0) -> np.ndarray:
    a = words[0::2].astype(np.float64)
    b = words[1::2]
    u1 = (a + 1.0) * 2.0 ** -32
    octant = (b >> np.uint32(29)).astype(np.int64)
    frac = (b & np.uint32(0x1FFFFFFF)).astype(np.float64) * 2.0 ** -29
    return _box_muller(u1, octant, frac, n, mean, std).astype(np.float32)


def _bits53(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    return ((hi >> np.uint32(5)).astype(np.uint64) << np.uint64(26)) | (lo >> np.uint32(6)).astype(np.uint64)


def normal_f64(words: np.ndarray, n: int, mean: float = 0.0, std: float = 1.0) -> np.ndarray:
    a = _bits53(words[0::4], words[1::4])
    b = _bits53(words[2::4], words[3::4])
    u1 = (a.astype(np.float64) + 1.0) * 2.0 ** -53
    octant = (b >> np.uint64(50)).astype(np.int64)
    frac = (b & np.uint64((1 << 50) - 1)).astype(np.float64) * 2.0 ** -50
    return _box_muller(u1, octant, frac, n, mean, std)


# --- randint ---------------------------------------------------------------------------------
#: Spans from 2**28 on take two words per value (a 64-bit draw), as torch's
#: uniform_int_from_to (ATen/core/DistributionsHelper.h, "allow approx 5% skew in uniform int
#: generation using %"): one 32-bit word modulo a span near 2**32 gives the low values up to
#: twice the odds of the high ones (r69b: 0.75 * 2**32 put half the draws in the lowest third).
WIDE_SPAN = 1 << 28


def randint_kind(low: int, high: int, dtype: str) -> str:
    """"randint_i32" / "randint_i64" (1 word each) below :data:`WIDE_SPAN`, else
    "randint_i32_wide" / "randint_i64_wide" (2 words each), for [low, high)."""
    wide = "_wide" if high - low >= WIDE_SPAN else ""
    return ("randint_i32" if dtype == "int32" else "randint_i64") + wide


def randint(words: np.ndarray, low: int, high: int, dtype: str) -> np.ndarray:
    span = high - low
    low_u = np.uint64(low & ((1 << 64) - 1))
    if span < WIDE_SPAN:
        v = words.astype(np.uint64) % np.uint64(span)
    else:
        v = words[0::2].astype(np.uint64) | (words[1::2].astype(np.uint64) << np.uint64(32))
        if span < 1 << 64:
            v %= np.uint64(span)
    v += low_u                                    # wraps modulo 2**64
    out = v.view(np.int64)
    return out.astype(np.int32) if dtype == "int32" else out
