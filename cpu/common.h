/* Shared by the host kernels in cpu/: exports, fp16 conversion, ISA selection, threads.
 *
 * Each kernel file is compiled once per machine by ember_cupy/ops/_host.py with flags chosen from
 * the CPU's features: the x86 SIMD paths below are picked by the compiler's own predefined macros
 * (__AVX512VNNI__, __AVX2__), so the same source also builds as plain C with any compiler. Every
 * aarch64 compiler has NEON, so the ARM paths are asked for by name (EMBER_USE_NEON, with
 * __ARM_FEATURE_DOTPROD from -march=armv8.2-a+dotprod, __ARM_FEATURE_MATMUL_INT8 from +i8mm): without it aarch64 builds plain C too.
 * Kernels compute every output element in an order that does not depend on the batch (the rows
 * of x processed together), so results are batch invariant.
 */
#ifndef EMBER_CPU_COMMON_H
#define EMBER_CPU_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(EMBER_USE_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define EMBER_NEON 1
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define EMBER_EXPORT __attribute__((visibility("default")))

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define EMBER_ISA "avx512amx"
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define EMBER_ISA "avx512vnni"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define EMBER_ISA "avx2"
#elif defined(EMBER_NEON) && defined(__ARM_FEATURE_DOTPROD) && defined(__ARM_FEATURE_MATMUL_INT8)
#define EMBER_ISA "neon-i8mm"
#elif defined(EMBER_NEON) && defined(__ARM_FEATURE_DOTPROD)
#define EMBER_ISA "neon-dotprod"
#elif defined(EMBER_NEON)
#define EMBER_ISA "neon"
#else
#define EMBER_ISA "portable"
#endif

static inline float ember_f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  /* subnormal: normalise */
        int shift = 0;
        while (!(man & 0x400u)) { man <<= 1; shift++; }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t ember_f32_to_f16(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t absx = x & 0x7fffffffu;
    if (absx >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0));
    if (absx >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);   /* rounds to inf */
    if (absx < 0x38800000u) {                                       /* f16 subnormal or zero */
        if (absx < 0x33000000u) return (uint16_t)sign;
        uint32_t man = (absx & 0x7fffffu) | 0x800000u;
        int shift = 126 - (int)(absx >> 23);                        /* 14..24 */
        uint32_t half = man >> shift, rest = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1u))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((absx >> 13) - (112u << 10)), rest = absx & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) half++;
    return (uint16_t)(sign | half);
#endif
}

#if defined(__AVX2__)
/* exp of 8 floats: range reduction by ln 2 and a degree-6 polynomial (~1 ulp); below -88.38
 * (and for -inf) exactly 0, so masked softmax scores vanish. */
static inline __m256 ember_exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-88.3762626647949f);
    const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), lo);
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, z, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(n)), keep);
}
#endif

#if defined(EMBER_NEON)
/* ember_exp8's steps on 4 lanes, op for op (NEON's FMA fuses as FMA3's does): the same bits. */
static inline float32x4_t ember_exp4(float32x4_t x) {
    const float32x4_t lo = vdupq_n_f32(-88.3762626647949f);
    const uint32x4_t keep = vcgeq_f32(x, lo);
    x = vmaxq_f32(vminq_f32(x, vdupq_n_f32(88.3762626647949f)), lo);
    const float32x4_t fx = vrndmq_f32(vfmaq_f32(vdupq_n_f32(0.5f), x, vdupq_n_f32(1.44269504088896341f)));
    x = vfmsq_f32(x, fx, vdupq_n_f32(0.693359375f));
    x = vfmsq_f32(x, fx, vdupq_n_f32(-2.12194440e-4f));
    const float32x4_t z = vmulq_f32(x, x);
    float32x4_t y = vdupq_n_f32(1.9875691500e-4f);
    y = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), y, x);
    y = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), y, x);
    y = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), y, x);
    y = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), y, x);
    y = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), y, x);
    y = vfmaq_f32(vaddq_f32(x, vdupq_n_f32(1.0f)), y, z);
    const int32x4_t n = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(fx), vdupq_n_s32(127)), 23);
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(vmulq_f32(y, vreinterpretq_f32_s32(n))), keep));
}
#endif

static inline uint16_t ember_load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

#endif
