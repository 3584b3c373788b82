"""Philox4x32-10 (Random123) in vectorized numpy, and the stream layout accel uses.

The generator is exactly Random123's ``philox4x32_R(10, ctr, key)``
(``include/Random123/philox.h``): multipliers ``0xD2511F53``/``0xCD9E8D57``,
Weyl key increments ``0x9E3779B9``/``0xBB67AE85``, the key bumped before
rounds 2..10.  :func:`philox4x32_10` is the plain array version (any
counters, any keys); :func:`raw_words` is the fast path for a run of
consecutive counters.

Number layout (the same on the host and in every device kernel)
----------------------------------------------------------------
A generator state is ``(seed, offset)``: a 64-bit seed and an offset counted
in 32-bit words.  The words a fill with that state consumes are::

    W[j] = philox4x32_10(ctr=[lo32(c), hi32(c), 0, 0],
                         key=[lo32(seed), hi32(seed)])[(offset + j) % 4]
    where c = (offset + j) // 4          (a 64-bit counter)

which is cuRAND's order: ``curand_init(seed, 0, offset, &s)`` followed by
``curand(&s)`` calls returns ``W[0], W[1], ...`` (subsequence 0; cuRAND puts
the subsequence in counter words 2..3 and the offset/4 in words 0..1).
Element ``i`` of a fill uses words from ``W`` by a fixed rule per
distribution (see ``accel.random._transforms``), and the fill advances the
offset by the words it consumed rounded up to a multiple of 4, as torch's
``CUDAGeneratorState::increase`` does, so consecutive fills continue one
stream and never reuse a word.
"""

from __future__ import annotations

import os
import threading
from typing import List, Optional, Tuple

import numpy as np

__all__ = [
    "M0", "M1", "W0", "W1", "philox4x32_10", "round_keys", "raw_words", "split_seed",
]

M0 = 0xD2511F53
M1 = 0xCD9E8D57
W0 = 0x9E3779B9
W1 = 0xBB67AE85
ROUNDS = 10
_MASK32 = 0xFFFFFFFF
_U64_MASK = np.uint64(_MASK32)


def split_seed(seed: int) -> Tuple[int, int]:
    """Philox key words for a 64-bit seed: ``(lo32(seed), hi32(seed))``, as cuRAND."""
    seed &= (1 << 64) - 1
    return seed & _MASK32, seed >> 32


def round_keys(k0: int, k1: int) -> List[Tuple[int, int]]:
    """The key used in each of the 10 rounds (round r uses key + r*W, mod 2^32)."""
    return [((k0 + r * W0) & _MASK32, (k1 + r * W1) & _MASK32) for r in range(ROUNDS)]


def philox4x32_10(ctr, key) -> np.ndarray:
    """Philox4x32-10 on arrays: ``ctr`` (..., 4) and ``key`` (..., 2), uint32.

    Shapes broadcast; the result is uint32 of shape (..., 4).  This is the
    reference form (one numpy expression per step); :func:`raw_words` is the
    fast path for consecutive counters.
    """
    ctr = np.asarray(ctr, dtype=np.uint32)
    key = np.asarray(key, dtype=np.uint32)
    if ctr.shape[-1:] != (4,) or key.shape[-1:] != (2,):
        raise ValueError(f"expected ctr (..., 4) and key (..., 2); got {ctr.shape} and {key.shape}")
    c0, c1, c2, c3 = (ctr[..., i].astype(np.uint64) for i in range(4))
    k0 = key[..., 0].astype(np.uint64)
    k1 = key[..., 1].astype(np.uint64)
    for r in range(ROUNDS):
        if r:
            k0 = (k0 + np.uint64(W0)) & _U64_MASK
            k1 = (k1 + np.uint64(W1)) & _U64_MASK
        p0 = c0 * np.uint64(M0)
        p1 = c2 * np.uint64(M1)
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _U64_MASK,
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _U64_MASK)
    return np.stack(np.broadcast_arrays(c0, c1, c2, c3), axis=-1).astype(np.uint32)


# --------------------------------------------------------------------------
# Fast path: counters [start, start + n) with a fixed key and counter words
# 2..3 zero.  Per round the two 32x32->64 products come from one uint64
# multiply; the next round's inputs are hi(P_r) ^ lo(P_{r-1}) ^ key.  That
# xor is done on uint32 views shifted by one word, so the hi half of each
# product meets the lo half of the previous one without shift/mask passes
# (the lo half of the result is garbage and is shifted out).  Rows swap
# meaning every round ([c0, c2] then [c2, c0]), which is why the multiplier
# and key columns alternate.  Rounds 0-2 are specialised for counter words
# 1..3 being constant within a chunk: their constant terms are folded into
# the keys, so they cost about as much as two ordinary rounds.
# --------------------------------------------------------------------------

_CHUNK = 65536  # counters per chunk (~5 MB of scratch): fastest here; smaller ones pay ufunc-call overhead
_MCOL = (np.array([[M0], [M1]], dtype=np.uint64), np.array([[M1], [M0]], dtype=np.uint64))


_SH32 = np.uint64(32)


class _Views:
    """Views of a workspace for chunks of ``m`` counters, built once (ufunc call overhead
    dominates small chunks, so nothing is sliced or converted inside the rounds)."""

    def __init__(self, ws: "_Workspace", m: int):
        self.m = m
        self.base_m0 = ws.base_m0[:m]
        self.q = ws.q[:m]
        bufs = [ws.pa[:, :m + 1], ws.pb[:, :m + 1]]
        self.p = [b[:, 1:] for b in bufs]
        p32 = [b.view(np.uint32) for b in bufs]
        self.p32_cur = [v[:, 2:] for v in p32]
        self.p32_prev = [v[::-1, 1:-1] for v in p32]   # other row, shifted one word down
        yb = ws.y[:, :m + 1]
        self.y = yb[:, 1:]
        self.y32 = yb.view(np.uint32)[:, 2:]
        # the next round's inputs are shifted down in place, so x is y
        self.x = self.y
        self.x0, self.x1 = self.x[0], self.x[1]


class _Workspace:
    """Per-thread scratch arrays for chunks of up to ``n`` counters."""

    def __init__(self, n: int):
        self.n = n
        self.base_m0 = np.arange(n, dtype=np.uint64) * np.uint64(M0)
        # Products and xor results keep one pad element in front of each row so
        # the uint32 view shifted by one word stays inside the row.
        self.pa = np.zeros((2, n + 1), dtype=np.uint64)
        self.pb = np.zeros((2, n + 1), dtype=np.uint64)
        self.y = np.zeros((2, n + 1), dtype=np.uint64)
        self.q = np.empty(n, dtype=np.uint64)
        self.full = _Views(self, n)

    def views(self, m: int) -> _Views:
        return self.full if m == self.n else _Views(self, m)


_tls = threading.local()


def _workspace(need: int) -> _Workspace:
    """This thread's workspace, grown (up to one full chunk, ~5 MB) to fit ``need`` counters."""
    ws = getattr(_tls, "ws", None)
    if ws is None or (ws.n < need and ws.n < _CHUNK):
        size = 1024
        while size < need and size < _CHUNK:
            size *= 2
        ws = _tls.ws = _Workspace(min(size, _CHUNK))
    return ws


class _Keys:
    """Per-seed constants of the rounds, as numpy scalars/columns (no conversions in the loop)."""

    def __init__(self, seed: int):
        ks = round_keys(*split_seed(seed))
        self.ks = ks
        self.k0_1 = np.uint64(ks[1][0])
        # round r >= 3 xors [k1, k0] after even rounds (rows [c2', c0']) and [k0, k1] after odd
        # ones; rounds 0-2 fold their constants into their keys in _chunk
        self.cols = [None, None, None] + [
            np.array([[k0], [k1]] if r & 1 else [[k1], [k0]], dtype=np.uint64) for r, (k0, k1) in
            enumerate(ks) if r >= 3]


def _chunk(ws: _Workspace, lo_start: int, hi: int, keys: _Keys, out64t: np.ndarray, m: int) -> None:
    """Philox outputs for counters [hi:lo_start .. hi:lo_start+m) into out64t (2, m) uint64.

    out64t[0, j] holds words 0,1 of counter j, out64t[1, j] words 2,3
    (little-endian), i.e. out64t is the transposed uint64 view of (m, 4) uint32.
    Requires lo_start + m <= 2**32 (counter word 1 constant).
    """
    v = ws.views(m)
    x, x0, x1, q = v.x, v.x0, v.x1, v.q
    k0, k1 = keys.ks[0]
    a = hi ^ k0                                   # round 0's c0' (and c1' = 0): a constant
    am0 = a * M0                                  # so round 1's product a*M0 is one too

    # Round 0: ctr = [lo, hi, 0, 0] -> c2' = hi(q) ^ k1, c3' = lo(q), with q = lo*M0.
    # Round 1 turns c3' into c2'' = hi(a*M0) ^ c3' ^ k1(round 1).  Both constants are
    # xored into q in one pass (k1 into the hi half, the other into the lo half), so a
    # shift and a mask split q into c2' (round 1's input) and c2'' (round 2's).
    np.add(v.base_m0, np.uint64((lo_start * M0) & ((1 << 64) - 1)), out=q)
    np.bitwise_xor(q, np.uint64((k1 << 32) | ((am0 >> 32) ^ keys.ks[1][1])), out=q)
    np.right_shift(q, _SH32, out=x0)                                             # c2'
    np.bitwise_and(q, _U64_MASK, out=x1)                                         # c2''
    # Round 1 (rows [c2', c0']): c0'' = hi(c2'*M1) ^ c1' (= 0) ^ k0(round 1), and
    # c1'' = lo(c2'*M1) stays in row 0 of p[0] for round 2.  c3'' = lo(a*M0) is a
    # constant, so round 2 folds it into its key rather than filling p[0] row 1 with it.
    p = v.p[0]
    np.multiply(x0, np.uint64(M1), out=p[0])
    np.right_shift(p[0], _SH32, out=x0)
    np.bitwise_xor(x0, keys.k0_1, out=x0)
    # Round 2 (rows [c0'', c2''] -> [c2''', c0''']): only row 1 takes the shifted-view
    # xor with the previous product; row 0's partner is the constant c3''.
    p = v.p[1]
    np.multiply(x, _MCOL[0], out=p)
    np.bitwise_xor(v.p32_cur[1][1], v.p32_prev[0][1], out=v.y32[1])
    np.right_shift(p[0], _SH32, out=x0)
    np.right_shift(v.y[1], _SH32, out=x1)
    k2 = keys.ks[2]
    np.bitwise_xor(x, np.array([[k2[1] ^ (am0 & _MASK32)], [k2[0]]], dtype=np.uint64), out=x)

    prev = 1
    for r in range(3, ROUNDS):
        cur = prev ^ 1
        np.multiply(x, _MCOL[r & 1], out=v.p[cur])
        # hi(P row i) ^ lo(previous P, other row): uint32 views offset by one word.
        np.bitwise_xor(v.p32_cur[cur], v.p32_prev[prev], out=v.y32)
        np.right_shift(x, _SH32, out=x)
        np.bitwise_xor(x, keys.cols[r], out=x)
        prev = cur
    # Round 10 (odd): p = [P1, P0]; x = [w0, w2]; words (w0, w1 = lo P1), (w2, w3 = lo P0).
    p = v.p[prev ^ 1]                      # the older product buffer is free: reuse it
    np.left_shift(v.p[prev], _SH32, out=p)
    np.bitwise_or(x, p, out=out64t)


def _fill_counters(seed: int, ctr_start: int, n_ctr: int, out: np.ndarray) -> None:
    """out: (n_ctr, 4) uint32, C-contiguous and 8-byte aligned."""
    keys = _Keys(seed)
    ws = _workspace(n_ctr)
    out64t = out.view(np.uint64).reshape(n_ctr, 2).T
    done = 0
    while done < n_ctr:
        c = (ctr_start + done) & ((1 << 64) - 1)
        lo, hi = c & _MASK32, c >> 32
        m = min(ws.n, n_ctr - done, (1 << 32) - lo)  # never cross a change of counter word 1
        _chunk(ws, lo, hi, keys, out64t[:, done:done + m], m)
        done += m


# Threads: numpy releases the GIL inside these ufunc loops, so large fills
# split across cores.  ACCEL_RNG_THREADS=1 turns it off.
_pool = None
_pool_lock = threading.Lock()
_PARALLEL_MIN = 4 * _CHUNK


def _threads() -> int:
    env = os.environ.get("ACCEL_RNG_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"ACCEL_RNG_THREADS={env!r} is not an integer; set a thread count >= 1 "
                             f"(1: no threads)") from None
        if n < 1:
            raise ValueError(f"ACCEL_RNG_THREADS={env!r}: the host Philox path needs at least 1 thread; "
                             f"set 1 for no extra threads")
        return n
    return max(1, min(os.cpu_count() or 1, 8))


def _executor(nthreads: int):
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers != nthreads:
            from concurrent.futures import ThreadPoolExecutor
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=nthreads, thread_name_prefix="accel-philox")
        return _pool


def _forget_pool_after_fork() -> None:
    global _pool, _pool_lock
    _pool = None  # worker threads do not exist in the child
    _pool_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def philox_counters(seed: int, ctr_start: int, n_ctr: int, out: Optional[np.ndarray] = None,
                    threads: Optional[int] = None) -> np.ndarray:
    """Outputs of counters ``[ctr_start, ctr_start + n_ctr)`` (words 2..3 zero) as (n_ctr, 4) uint32."""
    if n_ctr < 0:
        raise ValueError(f"n_ctr must be >= 0, got {n_ctr}")
    if out is None:
        out = np.empty((n_ctr, 4), dtype=np.uint32)
    if n_ctr == 0:
        return out
    nthreads = _threads() if threads is None else max(1, int(threads))
    if nthreads == 1 or n_ctr < _PARALLEL_MIN:
        _fill_counters(seed, ctr_start, n_ctr, out)
        return out
    # Split into per-thread parts on chunk boundaries.
    per = -(-n_ctr // nthreads)
    per = -(-per // _CHUNK) * _CHUNK
    parts = [(s, min(per, n_ctr - s)) for s in range(0, n_ctr, per)]
    pool = _executor(nthreads)
    futs = [pool.submit(_fill_counters, seed, ctr_start + s, m, out[s:s + m]) for s, m in parts]
    for f in futs:
        f.result()
    return out


def raw_words(seed: int, offset: int, n: int, threads: Optional[int] = None) -> np.ndarray:
    """The words ``W[0..n)`` of the stream at ``(seed, offset)`` as uint32 (see module doc).

    ``offset`` counts 32-bit words and need not be a multiple of 4 here
    (generator offsets always are).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    skip = offset & 3
    n_ctr = (skip + n + 3) // 4
    words = philox_counters(seed, offset >> 2, n_ctr, threads=threads).reshape(-1)
    return words[skip:skip + n]
