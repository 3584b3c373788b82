// accel.random Philox4x32-10 fill kernels in Metal Shading Language (the mps backend
// compiles this text at run time with newLibraryWithSource:options:error:, fast math off).
//
// Same kernels, names and argument order as tools/philox_kernel.cu (the CUDA/PTX
// version), so one simulator reference serves both and the host rules in
// accel/random/_transforms.py define both: argument i binds to [[buffer(i)]]
// (pointers with setBuffer:offset:atIndex:, scalars with setBytes:length:atIndex:).
//
//   out, n            output and element count
//   seed, offset      generator state; offset in 32-bit words, a multiple of 4
//   seed_ptr, offset_ptr  graph-safe state pointers of the CUDA kernels: always
//                     bound to nil here and never read (Metal has no stream
//                     capture, so the mps backend has no graphs to replay)
//
// Thread t handles Philox counters c = t, t + threads_per_grid, ... (the CUDA
// grid-stride loop); counter c is philox(ctr = offset/4 + c, key = seed).
//
// Only the kinds that need no 64-bit float are here: Metal has no double, so
// uniform float64 and the Box-Muller normals (computed in float64 on the host
// and in CUDA) cannot be bit-identical in MSL and use the host path.
// Floating point: x + y and x * y are correctly rounded in Metal with fast math
// off; FP_CONTRACT OFF and one operation per statement keep u * scale + low
// from being fused into an fma, which numpy does not do.
//
// The file is also valid C++ with the small shim in tests/test_mps_philox.py,
// which runs these kernels on the CPU to check them against the host path.

#if defined(__METAL_VERSION__)
#include <metal_stdlib>
using namespace metal;
#endif

#pragma STDC FP_CONTRACT OFF

struct Words { uint x, y, z, w; };

static inline Words philox(ulong ctr, ulong seed) {
    uint c0 = uint(ctr), c1 = uint(ctr >> 32), c2 = 0u, c3 = 0u;
    uint k0 = uint(seed), k1 = uint(seed >> 32);
    for (int r = 0; r < 10; ++r) {
        if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        uint hi0 = mulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        uint hi1 = mulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        uint n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    }
    Words v = {c0, c1, c2, c3};
    return v;
}

#define FILL_PARAMS                                                              \
    constant ulong &n [[buffer(1)]], constant ulong &seed [[buffer(2)]],          \
    constant ulong &offset [[buffer(3)]],                                         \
    device const ulong *seed_ptr [[buffer(4)]],                                   \
    device const ulong *offset_ptr [[buffer(5)]]
#define THREAD_PARAMS                                                            \
    uint tid [[thread_position_in_grid]], uint nthreads [[threads_per_grid]]

kernel void accel_philox_raw_u32(device uint *out [[buffer(0)]], FILL_PARAMS, THREAD_PARAMS) {
    const ulong base = offset >> 2, n_ctr = (n + 3) / 4;
    for (ulong c = tid; c < n_ctr; c += nthreads) {
        Words v = philox(base + c, seed);
        ulong i = 4 * c;
        out[i] = v.x;
        if (i + 1 < n) out[i + 1] = v.y;
        if (i + 2 < n) out[i + 2] = v.z;
        if (i + 3 < n) out[i + 3] = v.w;
    }
}

static inline float uniform_f32(uint x, float low, float scale, float high) {
    float u = float(x >> 8);          // exact: 24 bits
    u = u * 5.9604644775390625e-08f;  // * 2**-24, exact
    float p = u * scale;
    float v = p + low;
    return v >= high ? low : v;
}

kernel void accel_philox_uniform_f32(device float *out [[buffer(0)]], FILL_PARAMS,
                                     constant float &low [[buffer(6)]],
                                     constant float &scale [[buffer(7)]],
                                     constant float &high [[buffer(8)]], THREAD_PARAMS) {
    const ulong base = offset >> 2, n_ctr = (n + 3) / 4;
    for (ulong c = tid; c < n_ctr; c += nthreads) {
        Words v = philox(base + c, seed);
        ulong i = 4 * c;
        out[i] = uniform_f32(v.x, low, scale, high);
        if (i + 1 < n) out[i + 1] = uniform_f32(v.y, low, scale, high);
        if (i + 2 < n) out[i + 2] = uniform_f32(v.z, low, scale, high);
        if (i + 3 < n) out[i + 3] = uniform_f32(v.w, low, scale, high);
    }
}

// randint: low + x % range (mod 2**64); range < 2**28 here, so one word per element.
kernel void accel_philox_randint_i32(device int *out [[buffer(0)]], FILL_PARAMS,
                                     constant ulong &range [[buffer(6)]],
                                     constant long &low [[buffer(7)]], THREAD_PARAMS) {
    const ulong base = offset >> 2, n_ctr = (n + 3) / 4;
    const ulong lo = as_type<ulong>(low);
    for (ulong c = tid; c < n_ctr; c += nthreads) {
        Words v = philox(base + c, seed);
        ulong i = 4 * c;
        out[i] = as_type<int>(uint(lo + ulong(v.x) % range));
        if (i + 1 < n) out[i + 1] = as_type<int>(uint(lo + ulong(v.y) % range));
        if (i + 2 < n) out[i + 2] = as_type<int>(uint(lo + ulong(v.z) % range));
        if (i + 3 < n) out[i + 3] = as_type<int>(uint(lo + ulong(v.w) % range));
    }
}

kernel void accel_philox_randint_i64(device long *out [[buffer(0)]], FILL_PARAMS,
                                     constant ulong &range [[buffer(6)]],
                                     constant long &low [[buffer(7)]], THREAD_PARAMS) {
    const ulong base = offset >> 2, n_ctr = (n + 3) / 4;
    const ulong lo = as_type<ulong>(low);
    for (ulong c = tid; c < n_ctr; c += nthreads) {
        Words v = philox(base + c, seed);
        ulong i = 4 * c;
        out[i] = as_type<long>(lo + ulong(v.x) % range);
        if (i + 1 < n) out[i + 1] = as_type<long>(lo + ulong(v.y) % range);
        if (i + 2 < n) out[i + 2] = as_type<long>(lo + ulong(v.z) % range);
        if (i + 3 < n) out[i + 3] = as_type<long>(lo + ulong(v.w) % range);
    }
}

// range >= 2**28: two words per element, v = W[2i] | W[2i+1] << 32 (one word modulo such a
// range is skewed: torch's uniform_int_from_to draws 64 bits from 2**28 on too).
kernel void accel_philox_randint_i32_wide(device int *out [[buffer(0)]], FILL_PARAMS,
                                          constant ulong &range [[buffer(6)]],
                                          constant long &low [[buffer(7)]], THREAD_PARAMS) {
    const ulong base = offset >> 2, n_ctr = (n + 1) / 2;
    const ulong lo = as_type<ulong>(low);
    for (ulong c = tid; c < n_ctr; c += nthreads) {
        Words v = philox(base + c, seed);
        ulong i = 2 * c;
        ulong a = ulong(v.x) | (ulong(v.y) << 32), b = ulong(v.z) | (ulong(v.w) << 32);
        out[i] = as_type<int>(uint(lo + a % range));
        if (i + 1 < n) out[i + 1] = as_type<int>(uint(lo + b % range));
    }
}

// range 0 stands for 2**64.
kernel void accel_philox_randint_i64_wide(device long *out [[buffer(0)]], FILL_PARAMS,
                                          constant ulong &range [[buffer(6)]],
                                          constant long &low [[buffer(7)]], THREAD_PARAMS) {
    const ulong base = offset >> 2, n_ctr = (n + 1) / 2;
    const ulong lo = as_type<ulong>(low);
    for (ulong c = tid; c < n_ctr; c += nthreads) {
        Words v = philox(base + c, seed);
        ulong i = 2 * c;
        ulong a = ulong(v.x) | (ulong(v.y) << 32), b = ulong(v.z) | (ulong(v.w) << 32);
        out[i] = as_type<long>(lo + (range ? a % range : a));
        if (i + 1 < n) out[i + 1] = as_type<long>(lo + (range ? b % range : b));
    }
}
