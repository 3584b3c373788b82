"""tools/philox_kernel.cu, compiled for the host and run thread by thread, equals the host path.

The shipped kernels run only on a GPU, which CI has none of.  This compiles the same CUDA C
source with the host C++ compiler, the CUDA built-ins it uses (thread indices, __umulhi, the
_rn arithmetic, the vector types) defined in a small shim, and runs every thread of a grid in
turn.  It checks the kernel logic (which elements each counter writes, the tails, the 16-byte
stores taken only on aligned, whole counters, the scalar stores elsewhere) against
``plan.host()``, element for element, at buffers 16-byte aligned and one element off.  What it
cannot check is nvcc's and ptxas's code generation: the self-test does that on a device.
"""

import os
import shutil
import subprocess

import pytest

np = pytest.importorskip("numpy")

#: kind -> (plan for a byte count, element size), as the simulator's kernel models are checked
from test_random_kernels import PLAN_MAKERS as KINDS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")
CXX = shutil.which("g++") or shutil.which("clang++")

pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler (g++ or clang++)")

_SHIM = r"""
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#define __device__
#define __global__
#define __forceinline__ inline
struct Dim { unsigned x, y, z; };
static Dim blockIdx, threadIdx, blockDim, gridDim;
static inline uint32_t __umulhi(uint32_t a, uint32_t b) { return (uint32_t)(((uint64_t)a * b) >> 32); }
// -ffp-contract=off: no fused multiply-add, as nvcc -fmad=false
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
struct alignas(16) uint4 { uint32_t x, y, z, w; };
struct alignas(16) int4 { int32_t x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) double2 { double x, y; };
struct alignas(16) longlong2 { long long x, y; };
struct alignas(8) int2 { int32_t x, y; };
static inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
static inline int4 make_int4(int32_t a, int32_t b, int32_t c, int32_t d) { return {a, b, c, d}; }
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static inline double2 make_double2(double a, double b) { return {a, b}; }
static inline longlong2 make_longlong2(long long a, long long b) { return {a, b}; }
static inline int2 make_int2(int32_t a, int32_t b) { return {a, b}; }
// A vector store to an address not aligned to its size is a fault on a GPU: count them.
static long misaligned_vector_stores = 0;
template <typename T> static inline void check_vector_store(const void *p) {
    if (((uintptr_t)p & (alignof(T) - 1)) != 0) ++misaligned_vector_stores;
}
"""

_MAIN = r"""
// argv: kernel n seed offset skew grid block [kernel args as C literals...]; writes out[0, n) to stdout
int main(int argc, char **argv) {
    const char *kernel = argv[1];
    uint64_t n = strtoull(argv[2], 0, 0), seed = strtoull(argv[3], 0, 0), offset = strtoull(argv[4], 0, 0);
    unsigned skew = (unsigned)strtoul(argv[5], 0, 0), grid = (unsigned)strtoul(argv[6], 0, 0),
             block = (unsigned)strtoul(argv[7], 0, 0);
    size_t itemsize = strstr(kernel, "f64") || strstr(kernel, "i64") ? 8 : 4;
    size_t nbytes = (size_t)n * itemsize;
    unsigned char *raw = (unsigned char *)aligned_alloc(64, nbytes + 64);
    memset(raw, 0xA5, nbytes + 64);
    void *out = raw + skew;
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    for (unsigned b = 0; b < grid; ++b)
        for (unsigned t = 0; t < block; ++t) {
            blockIdx = {b, 0, 0};
            threadIdx = {t, 0, 0};
#define F(i) strtod(argv[8 + (i)], 0)
#define U(i) strtoull(argv[8 + (i)], 0, 0)
#define I(i) (int64_t)strtoll(argv[8 + (i)], 0, 0)
            if (!strcmp(kernel, "accel_philox_raw_u32"))
                accel_philox_raw_u32((uint32_t *)out, n, seed, offset, 0, 0);
            else if (!strcmp(kernel, "accel_philox_uniform_f32"))
                accel_philox_uniform_f32((float *)out, n, seed, offset, 0, 0, (float)F(0), (float)F(1), (float)F(2));
            else if (!strcmp(kernel, "accel_philox_uniform_f64"))
                accel_philox_uniform_f64((double *)out, n, seed, offset, 0, 0, F(0), F(1), F(2));
            else if (!strcmp(kernel, "accel_philox_normal_f32"))
                accel_philox_normal_f32((float *)out, n, seed, offset, 0, 0, F(0), F(1));
            else if (!strcmp(kernel, "accel_philox_normal_f64"))
                accel_philox_normal_f64((double *)out, n, seed, offset, 0, 0, F(0), F(1));
            else if (!strcmp(kernel, "accel_philox_randint_i32"))
                accel_philox_randint_i32((int32_t *)out, n, seed, offset, 0, 0, U(0), I(1));
            else if (!strcmp(kernel, "accel_philox_randint_i64"))
                accel_philox_randint_i64((int64_t *)out, n, seed, offset, 0, 0, U(0), I(1));
            else if (!strcmp(kernel, "accel_philox_randint_i32_wide"))
                accel_philox_randint_i32_wide((int32_t *)out, n, seed, offset, 0, 0, U(0), I(1));
            else if (!strcmp(kernel, "accel_philox_randint_i64_wide"))
                accel_philox_randint_i64_wide((int64_t *)out, n, seed, offset, 0, 0, U(0), I(1));
            else { fprintf(stderr, "unknown kernel %s\n", kernel); return 2; }
        }
    // the bytes after the buffer are untouched
    for (size_t i = nbytes + skew; i < nbytes + 64; ++i)
        if (raw[i] != 0xA5) { fprintf(stderr, "wrote past the end at byte %zu\n", i - skew); return 3; }
    if (misaligned_vector_stores) { fprintf(stderr, "%ld misaligned vector stores\n", misaligned_vector_stores); return 4; }
    fwrite(out, 1, nbytes, stdout);
    return 0;
}
"""


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("philox_host")
    with open(os.path.join(TOOLS, "philox_kernel.cu")) as fh:
        source = fh.read()
    # every vector store goes through check_vector_store first (a fault on a GPU if misaligned)
    source = source.replace("*reinterpret_cast<T4 *>((out) + (i)) =",
                            "check_vector_store<T4>((out) + (i)), *reinterpret_cast<T4 *>((out) + (i)) =")
    source = source.replace("*reinterpret_cast<T2 *>((out) + (i)) =",
                            "check_vector_store<T2>((out) + (i)), *reinterpret_cast<T2 *>((out) + (i)) =")
    assert source.count("check_vector_store<") == 2, "the STORE4/STORE2 macros changed: update this test"
    path = tmp / "philox_host.cpp"
    path.write_text(_SHIM + source + _MAIN)
    exe = tmp / "philox_host"
    subprocess.run([CXX, "-std=c++17", "-O1", "-ffp-contract=off", "-fno-strict-aliasing", "-I", TOOLS,
                    "-x", "c++", str(path), "-o", str(exe), "-lm"], check=True, capture_output=True)
    return str(exe)


def _arg(kind, value):
    return float(value).hex() if kind.startswith("f") else str(int(value))


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "one-element-off"])
def test_kernel_source_equals_the_host_path(host_kernels, kind, aligned):
    make, size = KINDS[kind]
    seed, offset = 0xFEEDFACE12345678, 4 * (2**32 - 3)   # the counter crosses into word 1
    for n in (1, 2, 3, 4, 5, 7, 8, 67):
        plan = make(n * size)
        for grid, block in ((1, 1), (3, 7), (2, 32)):
            args = [host_kernels, plan.kernel, str(plan.n), str(seed), str(offset),
                    "0" if aligned else str(size), str(grid), str(block)]
            args += [_arg(t, v) for t, v in plan.kernel_args]
            proc = subprocess.run(args, capture_output=True)
            assert proc.returncode == 0, (kind, n, grid, block, proc.stderr.decode())
            want = plan.host(seed, offset).view(np.uint8).tobytes()
            assert proc.stdout == want, (kind, n, grid, block)
