// Philox4x32-10 fill kernels for accel.random (CUDA C; compiled to the shipped
// PTX accel/random/kernels/philox.ptx by tools/regen_kernels.py).
//
// Every kernel is the device side of one host rule in accel/random/_transforms.py
// and must stay bit-identical to it: compile with -fmad=false (no fused
// multiply-add contraction), use only IEEE-exact operations, and keep the
// order of operations of the numpy code.  Box-Muller uses the fixed
// polynomials from philox_constants.h (generated from _transforms.py), not
// libdevice's log/sin/cos, which differ from numpy's libm in the last bit.
//
// Arguments shared by all fill kernels:
//   out, n            output and element count
//   seed, offset      generator state; offset in 32-bit words, a multiple of 4
//   seed_ptr, offset_ptr  graph-safe mode when non-null (torch's PhiloxCudaState):
//                     seed = *seed_ptr, offset = *offset_ptr + offset (intragraph)
// Thread t handles Philox counters c = t, t + stride, ... (grid-stride loop);
// counter c is philox(ctr = offset/4 + c, key = seed) and yields 4 or 2 elements.

#include <stdint.h>
#include "philox_constants.h"

struct Words { uint32_t x, y, z, w; };

__device__ __forceinline__ Words philox(uint64_t ctr, uint64_t seed) {
    uint32_t c0 = (uint32_t)ctr, c1 = (uint32_t)(ctr >> 32), c2 = 0u, c3 = 0u;
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    }
    Words v = {c0, c1, c2, c3};
    return v;
}

__device__ __forceinline__ void load_state(uint64_t &seed, uint64_t &offset,
                                           const uint64_t *seed_ptr, const uint64_t *offset_ptr) {
    if (seed_ptr) seed = *seed_ptr;
    if (offset_ptr) offset += *offset_ptr;
}

#define FILL_ARGS uint64_t n, uint64_t seed, uint64_t offset, \
                  const uint64_t *seed_ptr, const uint64_t *offset_ptr
#define GRID_STRIDE(c, n_ctr)                                                   \
    for (uint64_t c = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; c < (n_ctr); \
         c += (uint64_t)gridDim.x * blockDim.x)

// One 16-byte store per counter where the counter's elements are all in range and `out` is
// 16-byte aligned (then every out + i is: i advances 16 bytes per counter).  A thread's four
// scalar stores 16 bytes apart touch each 32-byte sector of a warp's span twice per
// instruction: ncu on an H100 (2026-12-05) counted 2.0x the minimum L2 write sectors for the
// raw fill and 4.4x for uniform float32, which ran at 0.42x the raw fill's speed.  The tail
// (the last counter of an n not a multiple of its elements, or a misaligned view) stores one
// element at a time, computing only the elements in range.
__device__ __forceinline__ bool whole_and_aligned(const void *out, uint64_t i, uint64_t count,
                                                  uint64_t n) {
    return i + count <= n && ((uintptr_t)out & 15u) == 0;
}
#define STORE4(T4, make, out, i, n, e0, e1, e2, e3)                             \
    do {                                                                         \
        if (whole_and_aligned(out, i, 4, n)) {                                   \
            *reinterpret_cast<T4 *>((out) + (i)) = make(e0, e1, e2, e3);         \
        } else {                                                                 \
            (out)[i] = (e0);                                                     \
            if ((i) + 1 < (n)) (out)[(i) + 1] = (e1);                            \
            if ((i) + 2 < (n)) (out)[(i) + 2] = (e2);                            \
            if ((i) + 3 < (n)) (out)[(i) + 3] = (e3);                            \
        }                                                                        \
    } while (0)
#define STORE2(T2, make, out, i, n, e0, e1)                                     \
    do {                                                                         \
        if (whole_and_aligned(out, i, 2, n)) {                                   \
            *reinterpret_cast<T2 *>((out) + (i)) = make(e0, e1);                 \
        } else {                                                                 \
            (out)[i] = (e0);                                                     \
            if ((i) + 1 < (n)) (out)[(i) + 1] = (e1);                            \
        }                                                                        \
    } while (0)

// ---- math shared by the normal kernels (mirrors _transforms.log_f64 / sincos_octant) ----
__device__ __forceinline__ double horner_log(double s2) {
    double p = LOG_C[LOG_N - 1];
#pragma unroll
    for (int k = LOG_N - 2; k >= 0; --k) p = p * s2 + LOG_C[k];
    return p;
}
__device__ __forceinline__ double horner_sin(double x2) {
    double p = SIN_C[SIN_N - 1];
#pragma unroll
    for (int k = SIN_N - 2; k >= 0; --k) p = p * x2 + SIN_C[k];
    return p;
}
__device__ __forceinline__ double horner_cos(double x2) {
    double p = COS_C[COS_N - 1];
#pragma unroll
    for (int k = COS_N - 2; k >= 0; --k) p = p * x2 + COS_C[k];
    return p;
}

__device__ __forceinline__ double log_f64(double u) {
    int e;
    double m = frexp(u, &e);
    if (m < SQRT_HALF) { m = m * 2.0; e -= 1; }
    double s = (m - 1.0) / (m + 1.0);
    double s2 = s * s;
    double logm = s * horner_log(s2);
    double ef = (double)e;
    return (ef * LN2_LO + logm) + ef * LN2_HI;
}

// z0 = r cos(theta), z1 = r sin(theta); theta = (octant + frac) * pi/4
__device__ __forceinline__ void box_muller(double u1, uint32_t octant, double frac,
                                           double &z0, double &z1) {
    double r = sqrt(log_f64(u1) * -2.0);
    bool odd = octant & 1u;
    double x = (odd ? 1.0 - frac : frac) * PI_4;
    double x2 = x * x;
    double sn = x * horner_sin(x2);
    double cs = horner_cos(x2);
    double s_phi = odd ? cs : sn, c_phi = odd ? sn : cs;
    double sin_t, cos_t;
    switch (octant >> 1) {
        case 0: sin_t = s_phi;  cos_t = c_phi;  break;
        case 1: sin_t = c_phi;  cos_t = -s_phi; break;
        case 2: sin_t = -s_phi; cos_t = -c_phi; break;
        default: sin_t = -c_phi; cos_t = s_phi; break;
    }
    z0 = r * cos_t;
    z1 = r * sin_t;
}

__device__ __forceinline__ uint64_t bits53(uint32_t hi, uint32_t lo) {
    return ((uint64_t)(hi >> 5) << 26) | (uint64_t)(lo >> 6);
}

// ---- kernels ---------------------------------------------------------------------------
extern "C" __global__ void accel_philox_raw_u32(uint32_t *out, FILL_ARGS) {
    load_state(seed, offset, seed_ptr, offset_ptr);
    const uint64_t base = offset >> 2, n_ctr = (n + 3) / 4;
    GRID_STRIDE(c, n_ctr) {
        Words v = philox(base + c, seed);
        uint64_t i = 4 * c;
        STORE4(uint4, make_uint4, out, i, n, v.x, v.y, v.z, v.w);
    }
}

__device__ __forceinline__ float uniform_f32(uint32_t x, float low, float scale, float high) {
    float u = __fmul_rn((float)(x >> 8), 0x1p-24f);
    float v = __fadd_rn(__fmul_rn(u, scale), low);
    return v >= high ? low : v;
}

extern "C" __global__ void accel_philox_uniform_f32(float *out, FILL_ARGS, float low, float scale,
                                                    float high) {
    load_state(seed, offset, seed_ptr, offset_ptr);
    const uint64_t base = offset >> 2, n_ctr = (n + 3) / 4;
    GRID_STRIDE(c, n_ctr) {
        Words v = philox(base + c, seed);
        uint64_t i = 4 * c;
        STORE4(float4, make_float4, out, i, n, uniform_f32(v.x, low, scale, high),
               uniform_f32(v.y, low, scale, high), uniform_f32(v.z, low, scale, high),
               uniform_f32(v.w, low, scale, high));
    }
}

__device__ __forceinline__ double uniform_f64(uint32_t a, uint32_t b, double low, double scale,
                                              double high) {
    double u = __dmul_rn(__dadd_rn(__dmul_rn((double)(a >> 5), 67108864.0), (double)(b >> 6)),
                         0x1p-53);
    double v = __dadd_rn(__dmul_rn(u, scale), low);
    return v >= high ? low : v;
}

extern "C" __global__ void accel_philox_uniform_f64(double *out, FILL_ARGS, double low,
                                                    double scale, double high) {
    load_state(seed, offset, seed_ptr, offset_ptr);
    const uint64_t base = offset >> 2, n_ctr = (n + 1) / 2;
    GRID_STRIDE(c, n_ctr) {
        Words v = philox(base + c, seed);
        uint64_t i = 2 * c;
        STORE2(double2, make_double2, out, i, n, uniform_f64(v.x, v.y, low, scale, high),
               uniform_f64(v.z, v.w, low, scale, high));
    }
}

extern "C" __global__ void accel_philox_normal_f32(float *out, FILL_ARGS, double mean, double std) {
    load_state(seed, offset, seed_ptr, offset_ptr);
    const uint64_t base = offset >> 2, n_ctr = (n + 3) / 4;
    GRID_STRIDE(c, n_ctr) {
        Words v = philox(base + c, seed);
        uint64_t i = 4 * c;
        double z0, z1, z2 = 0.0, z3 = 0.0;
        box_muller(((double)v.x + 1.0) * 0x1p-32, v.y >> 29, (double)(v.y & 0x1FFFFFFFu) * 0x1p-29,
                   z0, z1);
        if (i + 2 < n)
            box_muller(((double)v.z + 1.0) * 0x1p-32, v.w >> 29,
                       (double)(v.w & 0x1FFFFFFFu) * 0x1p-29, z2, z3);
        STORE4(float4, make_float4, out, i, n, (float)(z0 * std + mean), (float)(z1 * std + mean),
               (float)(z2 * std + mean), (float)(z3 * std + mean));
    }
}

extern "C" __global__ void accel_philox_normal_f64(double *out, FILL_ARGS, double mean, double std) {
    load_state(seed, offset, seed_ptr, offset_ptr);
    const uint64_t base = offset >> 2, n_ctr = (n + 1) / 2;
    GRID_STRIDE(c, n_ctr) {
        Words v = philox(base + c, seed);
        uint64_t i = 2 * c;
        uint64_t a = bits53(v.x, v.y), b = bits53(v.z, v.w);
        double z0, z1;
        box_muller(((double)a + 1.0) * 0x1p-53, (uint32_t)(b >> 50),
                   (double)(b & ((1ull << 50) - 1)) * 0x1p-50, z0, z1);
        STORE2(double2, make_double2, out, i, n, z0 * std + mean, z1 * std + mean);
    }
}

// randint: low + x % range (mod 2**64); range < 2**28 here, so one word per element.
extern "C" __global__ void accel_philox_randint_i32(int32_t *out, FILL_ARGS, uint64_t range,
                                                    int64_t low) {
    load_state(seed, offset, seed_ptr, offset_ptr);
    const uint64_t base = offset >> 2, n_ctr = (n + 3) / 4;
    const uint64_t lo = (uint64_t)low;
    GRID_STRIDE(c, n_ctr) {
        Words v = philox(base + c, seed);
        uint64_t i = 4 * c;
        STORE4(int4, make_int4, out, i, n, (int32_t)(lo + (uint64_t)v.x % range),
               (int32_t)(lo + (uint64_t)v.y % range), (int32_t)(lo + (uint64_t)v.z % range),
               (int32_t)(lo + (uint64_t)v.w % range));
    }
}

extern "C" __global__ void accel_philox_randint_i64(int64_t *out, FILL_ARGS, uint64_t range,
                                                    int64_t low) {
    load_state(seed, offset, seed_ptr, offset_ptr);
    const uint64_t base = offset >> 2, n_ctr = (n + 3) / 4;
    const uint64_t lo = (uint64_t)low;
    GRID_STRIDE(c, n_ctr) {
        Words v = philox(base + c, seed);
        uint64_t i = 4 * c;
        // 32 bytes a counter: two 16-byte stores where all four are in range
        STORE2(longlong2, make_longlong2, out, i, n, (long long)(lo + (uint64_t)v.x % range),
               (long long)(lo + (uint64_t)v.y % range));
        if (i + 2 < n)
            STORE2(longlong2, make_longlong2, out, i + 2, n, (long long)(lo + (uint64_t)v.z % range),
                   (long long)(lo + (uint64_t)v.w % range));
    }
}

// range >= 2**28: two words per element, v = W[2i] | W[2i+1] << 32 (one word modulo such a
// range is skewed: torch's uniform_int_from_to draws 64 bits from 2**28 on too).
extern "C" __global__ void accel_philox_randint_i32_wide(int32_t *out, FILL_ARGS, uint64_t range,
                                                         int64_t low) {
    load_state(seed, offset, seed_ptr, offset_ptr);
    const uint64_t base = offset >> 2, n_ctr = (n + 1) / 2;
    const uint64_t lo = (uint64_t)low;
    GRID_STRIDE(c, n_ctr) {
        Words v = philox(base + c, seed);
        uint64_t i = 2 * c;
        uint64_t a = (uint64_t)v.x | ((uint64_t)v.y << 32), b = (uint64_t)v.z | ((uint64_t)v.w << 32);
        STORE2(int2, make_int2, out, i, n, (int32_t)(lo + a % range), (int32_t)(lo + b % range));
    }
}

// range 0 stands for 2**64.
extern "C" __global__ void accel_philox_randint_i64_wide(int64_t *out, FILL_ARGS, uint64_t range,
                                                         int64_t low) {
    load_state(seed, offset, seed_ptr, offset_ptr);
    const uint64_t base = offset >> 2, n_ctr = (n + 1) / 2;
    const uint64_t lo = (uint64_t)low;
    GRID_STRIDE(c, n_ctr) {
        Words v = philox(base + c, seed);
        uint64_t i = 2 * c;
        uint64_t a = (uint64_t)v.x | ((uint64_t)v.y << 32), b = (uint64_t)v.z | ((uint64_t)v.w << 32);
        STORE2(longlong2, make_longlong2, out, i, n, (long long)(lo + (range ? a % range : a)),
               (long long)(lo + (range ? b % range : b)));
    }
}

// Graph replay: write the generator state the captured kernels read.
extern "C" __global__ void accel_philox_store_state(uint64_t *seed_ptr, uint64_t *offset_ptr,
                                                    uint64_t seed, uint64_t offset) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        *seed_ptr = seed;
        *offset_ptr = offset;
    }
}
