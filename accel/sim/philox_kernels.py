"""numpy models of the Philox kernels in accel/random/kernels/philox.ptx.

Each reference models ``tools/philox_kernel.cu`` thread by thread: thread
``t = blockIdx.x * blockDim.x + threadIdx.x`` of ``T = gridDim.x * blockDim.x``
runs the grid-stride loop ``c = t, t + T, ...`` while ``c < n_ctr``, reads the
graph-safe state (``*seed_ptr``, ``*offset_ptr + offset``) when the pointers
are non-null, evaluates Philox at counter ``offset/4 + c`` and stores its
elements at the kernel's indices, with the kernel's tail checks.  The loop is
evaluated for all threads at once, but nothing here calls the host fill
functions: the only shared pieces are the Philox function itself and the
float64 log/sin/cos polynomials, so "device path equals host path" under the
simulator checks the kernels' indexing, offset and per-element arithmetic.
"""

from __future__ import annotations

import numpy as np

from accel.random import _transforms as _t
from accel.random.philox import philox4x32_10

from . import kernels

_COMMON = ("ptr", "u64", "u64", "u64", "ptr", "ptr")   # out, n, seed, offset, seed_ptr, offset_ptr


def _state(view, seed, offset, seed_ptr, offset_ptr):
    if seed_ptr:
        seed = int(view(seed_ptr, 8, np.uint64)[0])
    if offset_ptr:
        offset = (offset + int(view(offset_ptr, 8, np.uint64)[0])) % (1 << 64)
    return seed, offset


def _thread_counters(grid, block, n_ctr: int) -> np.ndarray:
    """Counter indices in the order the threads' grid-stride loops visit them."""
    threads = int(grid[0]) * int(block[0])
    if threads <= 0:
        raise ValueError(f"launch with an empty grid {grid} x block {block}")
    iters = -(-n_ctr // threads)
    t = np.arange(threads, dtype=np.uint64)
    k = np.arange(iters, dtype=np.uint64)
    c = (t[None, :] + k[:, None] * np.uint64(threads)).reshape(-1)
    return c[c < np.uint64(n_ctr)]


def _words(grid, block, view, n_ctr, seed, offset, seed_ptr, offset_ptr):
    """(c, words): the counters the threads handle and Philox's 4 words for each, (m, 4) uint32."""
    seed, offset = _state(view, seed, offset, seed_ptr, offset_ptr)
    c = _thread_counters(grid, block, n_ctr)
    ctr = (np.uint64(offset >> 2) + c) if c.size else c          # uint64 wraps like the kernel
    counters = np.zeros((c.size, 4), dtype=np.uint32)
    counters[:, 0] = (ctr & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    counters[:, 1] = (ctr >> np.uint64(32)).astype(np.uint32)
    key = np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint32)
    return c, philox4x32_10(counters, key)


def _store(view, out, n, dtype, c, values, per):
    """values (m, per): element per*c + j, stored where < n (the kernel's tail checks)."""
    dst = view(out, n * np.dtype(dtype).itemsize, dtype)
    idx = c[:, None] * np.uint64(per) + np.arange(per, dtype=np.uint64)[None, :]
    keep = idx < np.uint64(n)
    dst[idx[keep].astype(np.int64)] = values[keep]


def raw_u32(grid, block, view, out, n, seed, offset, seed_ptr, offset_ptr):
    c, w = _words(grid, block, view, (n + 3) // 4, seed, offset, seed_ptr, offset_ptr)
    _store(view, out, n, np.uint32, c, w, 4)


def uniform_f32(grid, block, view, out, n, seed, offset, seed_ptr, offset_ptr, low, scale, high):
    c, w = _words(grid, block, view, (n + 3) // 4, seed, offset, seed_ptr, offset_ptr)
    low, scale, high = np.float32(low), np.float32(scale), np.float32(high)
    u = (w >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24)
    v = u * scale + low                                   # float32 multiply, then float32 add
    _store(view, out, n, np.float32, c, np.where(v >= high, low, v), 4)


def uniform_f64(grid, block, view, out, n, seed, offset, seed_ptr, offset_ptr, low, scale, high):
    c, w = _words(grid, block, view, (n + 1) // 2, seed, offset, seed_ptr, offset_ptr)
    pairs = w.reshape(-1, 2, 2)                           # (counter, element, word)
    a = (pairs[..., 0] >> np.uint32(5)).astype(np.float64)
    b = (pairs[..., 1] >> np.uint32(6)).astype(np.float64)
    u = (a * 67108864.0 + b) * 2.0 ** -53
    v = u * scale + low
    _store(view, out, n, np.float64, c, np.where(v >= high, low, v), 2)


def _box_muller(u1, octant, frac):
    r = np.sqrt(_t.log_f64(u1) * -2.0)
    sin, cos = _t.sincos_octant(octant, frac)
    return r * cos, r * sin


def normal_f32(grid, block, view, out, n, seed, offset, seed_ptr, offset_ptr, mean, std):
    c, w = _words(grid, block, view, (n + 3) // 4, seed, offset, seed_ptr, offset_ptr)
    vals = np.empty(w.shape, dtype=np.float32)
    for j in (0, 2):                                      # Box–Muller on words (x, y) and (z, w)
        a, b = w[:, j], w[:, j + 1]
        z0, z1 = _box_muller((a.astype(np.float64) + 1.0) * 2.0 ** -32, (b >> np.uint32(29)).astype(np.int64),
                             (b & np.uint32(0x1FFFFFFF)).astype(np.float64) * 2.0 ** -29)
        vals[:, j] = (z0 * std + mean).astype(np.float32)
        vals[:, j + 1] = (z1 * std + mean).astype(np.float32)
    _store(view, out, n, np.float32, c, vals, 4)


def _bits53(hi, lo):
    return ((hi >> np.uint32(5)).astype(np.uint64) << np.uint64(26)) | (lo >> np.uint32(6)).astype(np.uint64)


def normal_f64(grid, block, view, out, n, seed, offset, seed_ptr, offset_ptr, mean, std):
    c, w = _words(grid, block, view, (n + 1) // 2, seed, offset, seed_ptr, offset_ptr)
    a, b = _bits53(w[:, 0], w[:, 1]), _bits53(w[:, 2], w[:, 3])
    z0, z1 = _box_muller((a.astype(np.float64) + 1.0) * 2.0 ** -53, (b >> np.uint64(50)).astype(np.int64),
                         (b & np.uint64((1 << 50) - 1)).astype(np.float64) * 2.0 ** -50)
    vals = np.stack([z0 * std + mean, z1 * std + mean], axis=1)
    _store(view, out, n, np.float64, c, vals, 2)


def _randint_narrow(dtype):
    def fn(grid, block, view, out, n, seed, offset, seed_ptr, offset_ptr, span, low):
        c, w = _words(grid, block, view, (n + 3) // 4, seed, offset, seed_ptr, offset_ptr)
        v = w.astype(np.uint64) % np.uint64(span) + np.uint64(low % (1 << 64))
        _store(view, out, n, dtype, c, v.view(np.int64).astype(dtype), 4)
    fn.__name__ = fn.__qualname__ = f"randint_{np.dtype(dtype).name}"
    return fn


def _randint_wide(dtype):
    def fn(grid, block, view, out, n, seed, offset, seed_ptr, offset_ptr, span, low):
        c, w = _words(grid, block, view, (n + 1) // 2, seed, offset, seed_ptr, offset_ptr)
        w64 = w.astype(np.uint64)
        v = np.stack([w64[:, 0] | (w64[:, 1] << np.uint64(32)), w64[:, 2] | (w64[:, 3] << np.uint64(32))], axis=1)
        if span:                                              # span 0 stands for 2**64
            v %= np.uint64(span)
        v += np.uint64(low % (1 << 64))
        _store(view, out, n, dtype, c, v.view(np.int64).astype(dtype), 2)
    fn.__name__ = fn.__qualname__ = f"randint_{np.dtype(dtype).name}_wide"
    return fn


def store_state(grid, block, view, seed_ptr, offset_ptr, seed, offset):
    view(seed_ptr, 8, np.uint64)[0] = seed
    view(offset_ptr, 8, np.uint64)[0] = offset


_F32 = ("f32", "f32", "f32")
_F64 = ("f64", "f64", "f64")
_RANGE = ("u64", "i64")
for _name, _extra, _fn in (
        ("raw_u32", (), raw_u32),
        ("uniform_f32", _F32, uniform_f32),
        ("uniform_f64", _F64, uniform_f64),
        ("normal_f32", ("f64", "f64"), normal_f32),
        ("normal_f64", ("f64", "f64"), normal_f64),
        ("randint_i32", _RANGE, _randint_narrow(np.int32)),
        ("randint_i64", _RANGE, _randint_narrow(np.int64)),
        ("randint_i32_wide", _RANGE, _randint_wide(np.int32)),
        ("randint_i64_wide", _RANGE, _randint_wide(np.int64))):
    kernels.register("accel_philox_" + _name, _COMMON + _extra, _fn)
kernels.register("accel_philox_store_state", ("ptr", "ptr", "u64", "u64"), store_state)
