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
        out[i] = v.x;
        if (i + 1 < n) out[i + 1] = v.y;
        if (i + 2 < n) out[i + 2] = v.z;
        if (i + 3 < n) out[i + 3] = v.w;
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
        out[i] = uniform_f32(v.x, low, scale, high);
        if (i + 1 < n) out[i + 1] = uniform_f32(v.y, low, scale, high);
        if (i + 2 < n) out[i + 2] = uniform_f32(v.z, low, scale, high);
        if (i + 3 < n) out[i + 3] = uniform_f32(v.w, low, scale, high);
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
        out[i] = uniform_f64(v.x, v.y, low, scale, high);
        if (i + 1 < n) out[i + 1] = uniform_f64(v.z, v.w, low, scale, high);
    }
}

extern "C" __global__ void accel_philox_normal_f32(float *out, FILL_ARGS, double mean, double std) {
    load_state(seed, offset, seed_ptr, offset_ptr);
    const uint64_t base = offset >> 2, n_ctr = (n + 3) / 4;
    GRID_STRIDE(c, n_ctr) {
        Words v = philox(base + c, seed);
        uint64_t i = 4 * c;
        double z0, z1, z2, z3;
        box_muller(((double)v.x + 1.0) * 0x1p-32, v.y >> 29, (double)(v.y & 0x1FFFFFFFu) * 0x1p-29,
                   z0, z1);
        out[i] = (float)(z0 * std + mean);
        if (i + 1 < n) out[i + 1] = (float)(z1 * std + mean);
        if (i + 2 < n) {
            box_muller(((double)v.z + 1.0) * 0x1p-32, v.w >> 29,
                       (double)(v.w & 0x1FFFFFFFu) * 0x1p-29, z2, z3);
            out[i + 2] = (float)(z2 * std + mean);
            if (i + 3 < n) out[i + 3] = (float)(z3 * std + mean);
        }
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
        out[i] = z0 * std + mean;
        if (i + 1 < n) out[i + 1] = z1 * std + mean;
    }
}

// randint: low + x % range (mod 2**64); range <= 2**32 here, so one word per element.
extern "C" __global__ void accel_philox_randint_i32(int32_t *out, FILL_ARGS, uint64_t range,
                                                    int64_t low) {
    load_state(seed, offset, seed_ptr, offset_ptr);
    const uint64_t base = offset >> 2, n_ctr = (n + 3) / 4;
    const uint64_t lo = (uint64_t)low;
    GRID_STRIDE(c, n_ctr) {
        Words v = philox(base + c, seed);
        uint64_t i = 4 * c;
        out[i] = (int32_t)(lo + (uint64_t)v.x % range);
        if (i + 1 < n) out[i + 1] = (int32_t)(lo + (uint64_t)v.y % range);
        if (i + 2 < n) out[i + 2] = (int32_t)(lo + (uint64_t)v.z % range);
        if (i + 3 < n) out[i + 3] = (int32_t)(lo + (uint64_t)v.w % range);
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
        out[i] = (int64_t)(lo + (uint64_t)v.x % range);
        if (i + 1 < n) out[i + 1] = (int64_t)(lo + (uint64_t)v.y % range);
        if (i + 2 < n) out[i + 2] = (int64_t)(lo + (uint64_t)v.z % range);
        if (i + 3 < n) out[i + 3] = (int64_t)(lo + (uint64_t)v.w % range);
    }
}

// range > 2**32: two words per element, v = W[2i] | W[2i+1] << 32; range 0 stands for 2**64.
extern "C" __global__ void accel_philox_randint_i64_wide(int64_t *out, FILL_ARGS, uint64_t range,
                                                         int64_t low) {
    load_state(seed, offset, seed_ptr, offset_ptr);
    const uint64_t base = offset >> 2, n_ctr = (n + 1) / 2;
    const uint64_t lo = (uint64_t)low;
    GRID_STRIDE(c, n_ctr) {
        Words v = philox(base + c, seed);
        uint64_t i = 2 * c;
        uint64_t a = (uint64_t)v.x | ((uint64_t)v.y << 32), b = (uint64_t)v.z | ((uint64_t)v.w << 32);
        out[i] = (int64_t)(lo + (range ? a % range : a));
        if (i + 1 < n) out[i + 1] = (int64_t)(lo + (range ? b % range : b));
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
