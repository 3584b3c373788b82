"""The Metal Philox kernels (accel/random/kernels/philox.metal) against the host path.

No Metal here, so the MSL file is compiled as C++ with a small shim (MSL's
scalar types, ``mulhi``, ``as_type``; address-space qualifiers and binding
attributes erased) and each kernel is run for every thread of a small grid on
the CPU.  That checks the kernels' logic bit for bit against
``accel.random.philox`` / ``_transforms`` (Philox rounds, counter layout,
grid-stride loop, float transform, randint arithmetic) — what the Metal
compiler does with it is checked only on a Mac.  Through the simulator the
same file is loaded by the mps backend (kernel names parsed from the source).
"""

import os
import shutil
import subprocess

import pytest

np = pytest.importorskip("numpy")

from accel.random import philox, _transforms  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METAL = os.path.join(ROOT, "accel", "random", "kernels", "philox.metal")

SHIM = r"""
#include <cstdint>
#include <cstring>
#include <sys/types.h>
typedef unsigned int uint;
typedef unsigned long ulong;
#define kernel
#define device
#define constant const
static inline uint mulhi(uint a, uint b) { return (uint)(((uint64_t)a * b) >> 32); }
template <typename T, typename F> static inline T as_type(F x) {
    static_assert(sizeof(T) == sizeof(F), "as_type needs equal sizes");
    T t; std::memcpy(&t, &x, sizeof t); return t;
}
"""

HARNESS = r"""
#include "%(metal)s"
#define GRID(call) for (uint t = 0; t < nthreads; ++t) call
extern "C" {
void raw_u32(uint *out, ulong n, ulong seed, ulong offset, uint nthreads) {
    GRID(accel_philox_raw_u32(out, n, seed, offset, nullptr, nullptr, t, nthreads));
}
void uniform_f32_k(float *out, ulong n, ulong seed, ulong offset, float low, float scale, float high,
                   uint nthreads) {
    GRID(accel_philox_uniform_f32(out, n, seed, offset, nullptr, nullptr, low, scale, high, t, nthreads));
}
void randint_i32(int *out, ulong n, ulong seed, ulong offset, ulong range, long low, uint nthreads) {
    GRID(accel_philox_randint_i32(out, n, seed, offset, nullptr, nullptr, range, low, t, nthreads));
}
void randint_i64(long *out, ulong n, ulong seed, ulong offset, ulong range, long low, uint nthreads) {
    GRID(accel_philox_randint_i64(out, n, seed, offset, nullptr, nullptr, range, low, t, nthreads));
}
void randint_i32_wide(int *out, ulong n, ulong seed, ulong offset, ulong range, long low,
                      uint nthreads) {
    GRID(accel_philox_randint_i32_wide(out, n, seed, offset, nullptr, nullptr, range, low, t, nthreads));
}
void randint_i64_wide(long *out, ulong n, ulong seed, ulong offset, ulong range, long low,
                      uint nthreads) {
    GRID(accel_philox_randint_i64_wide(out, n, seed, offset, nullptr, nullptr, range, low, t, nthreads));
}
}
"""

CDEF = """
void raw_u32(uint32_t *out, uint64_t n, uint64_t seed, uint64_t offset, uint32_t nthreads);
void uniform_f32_k(float *out, uint64_t n, uint64_t seed, uint64_t offset, float low, float scale,
                   float high, uint32_t nthreads);
void randint_i32(int32_t *out, uint64_t n, uint64_t seed, uint64_t offset, uint64_t range, int64_t low,
                 uint32_t nthreads);
void randint_i64(int64_t *out, uint64_t n, uint64_t seed, uint64_t offset, uint64_t range, int64_t low,
                 uint32_t nthreads);
void randint_i32_wide(int32_t *out, uint64_t n, uint64_t seed, uint64_t offset, uint64_t range,
                      int64_t low, uint32_t nthreads);
void randint_i64_wide(int64_t *out, uint64_t n, uint64_t seed, uint64_t offset, uint64_t range,
                      int64_t low, uint32_t nthreads);
"""


@pytest.fixture(scope="module")
def cpu_kernels(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("needs a C++ compiler to run the MSL kernels on the CPU")
    import cffi
    tmp = tmp_path_factory.mktemp("msl")
    (tmp / "shim.h").write_text(SHIM)
    (tmp / "harness.cpp").write_text(HARNESS % {"metal": METAL})
    lib_path = tmp / "libphilox_msl.so"
    proc = subprocess.run([cxx, "-std=c++17", "-O1", "-ffp-contract=off", "-Wno-attributes",
                           "-Wno-unknown-pragmas", "-shared", "-fPIC", "-include", str(tmp / "shim.h"),
                           str(tmp / "harness.cpp"), "-o", str(lib_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    return ffi, ffi.dlopen(str(lib_path))


STATES = [(0, 0), (42, 4), (0x0123456789ABCDEF, 1 << 20), ((1 << 64) - 1, (1 << 34) + 8)]
SIZES = [1, 3, 4, 5, 17, 1000]


def _ptr(ffi, arr):
    return ffi.cast("void *", arr.ctypes.data)


@pytest.mark.parametrize("seed,offset", STATES)
@pytest.mark.parametrize("n", SIZES)
def test_raw_u32_matches_host(cpu_kernels, seed, offset, n):
    ffi, lib = cpu_kernels
    out = np.zeros(n, dtype=np.uint32)
    lib.raw_u32(_ptr(ffi, out), n, seed, offset, 7)  # 7 threads: the grid-stride loop wraps
    assert np.array_equal(out, philox.raw_words(seed, offset, n))


def test_philox_known_answer_through_the_kernel(cpu_kernels):
    # Random123 KAT: ctr 0, key 0 -> 6627e8d5 e169c58d bc57ac4c 9b00dbd8 (counter 0 of seed 0).
    ffi, lib = cpu_kernels
    out = np.zeros(4, dtype=np.uint32)
    lib.raw_u32(_ptr(ffi, out), 4, 0, 0, 1)
    assert [hex(x) for x in out] == ["0x6627e8d5", "0xe169c58d", "0xbc57ac4c", "0x9b00dbd8"]


@pytest.mark.parametrize("low,high", [(0.0, 1.0), (-3.0, 5.5), (1e-3, 2e-3), (-1e6, 1e6)])
@pytest.mark.parametrize("seed,offset", STATES[:3])
def test_uniform_f32_matches_host(cpu_kernels, low, high, seed, offset):
    ffi, lib = cpu_kernels
    n = 1001
    lo32, scale, hi32 = _transforms.uniform_f32_params(low, high)
    out = np.zeros(n, dtype=np.float32)
    lib.uniform_f32_k(_ptr(ffi, out), n, seed, offset, float(lo32), float(scale), float(hi32), 5)
    want = _transforms.uniform_f32(philox.raw_words(seed, offset, n), low, high)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("low,high,dtype", [
    (0, 10, "int32"), (-5, 5, "int32"), (-(1 << 31), 1 << 31, "int32"), (0, 3 << 28, "int32"),
    (0, 1000, "int64"), (-(1 << 40), -(1 << 40) + (1 << 32), "int64"),
    (0, (1 << 32) + 1, "int64"), (-(1 << 63), (1 << 63) - 1, "int64"), (-(1 << 63), 1 << 63, "int64"),
])
def test_randint_matches_host(cpu_kernels, low, high, dtype):
    ffi, lib = cpu_kernels
    seed, offset, n = 1234, 8, 999
    kind = _transforms.randint_kind(low, high, dtype)
    words = philox.raw_words(seed, offset, _transforms.words_for(kind, n))
    want = _transforms.randint(words, low, high, dtype)
    span = (high - low) % (1 << 64)  # 2**64 -> 0, as the kernel takes it
    out = np.zeros(n, dtype=np.int32 if dtype == "int32" else np.int64)
    {"randint_i32": lib.randint_i32, "randint_i64": lib.randint_i64,
     "randint_i32_wide": lib.randint_i32_wide, "randint_i64_wide": lib.randint_i64_wide}[kind](_ptr(ffi, out), n, seed, offset, span, low, 3)
    assert np.array_equal(out, want)


def test_kernel_names_and_arguments_match_the_ptx_kernels():
    """Same names and argument counts as the CUDA kernels: one simulator reference serves both."""
    import re
    with open(METAL) as f:
        msl = f.read()
    with open(os.path.join(ROOT, "accel", "random", "kernels", "philox.ptx")) as f:
        ptx = f.read()
    ptx_args = {m.group(1): len(re.findall(r"\.param", m.group(2)))
                for m in re.finditer(r"\.entry\s+(\w+)\(([^)]*)\)", ptx)}
    msl_names = re.findall(r"\bkernel\s+void\s+(\w+)\s*\(", msl)
    assert msl_names, "no kernels found in philox.metal"
    for name in msl_names:
        assert name in ptx_args, f"{name} has no PTX twin"
        sig = re.search(r"kernel\s+void\s+%s\s*\((.*?)\)\s*\{" % name, msl, re.S).group(1)
        buffers = sorted(int(i) for i in re.findall(r"\[\[buffer\((\d+)\)\]\]", sig))
        buffers += [1, 2, 3, 4, 5] if "FILL_PARAMS" in sig else []
        assert sorted(buffers) == list(range(ptx_args[name])), name
