/* Row-wise ops of the forward pass: RMSNorm, residual-add + RMSNorm, SiLU(gate) * up,
 * GELU-tanh(gate) * up, RoPE.
 * NumPy twins: ember_cupy/ops/norm.py, activation.py, rotary.py. Rows are independent (batch
 * invariant); rows are split over the thread pool when there are enough of them. */
#include "common.h"
#include "threadpool.h"

#include <math.h>

#define PARALLEL_ROWS 8   /* fewer rows run on the calling thread alone */

static void silu_row(const float *gu, float *out, int64_t inter) {
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= inter; i += 8) {
        const __m256 g = _mm256_loadu_ps(gu + i), u = _mm256_loadu_ps(gu + inter + i);
        const __m256 e = ember_exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u));
    }
#elif defined(EMBER_NEON)
    for (; i + 8 <= inter; i += 8)       /* in eights as the 256-bit path: its steps, its tail, its bits */
        for (int64_t j = i; j < i + 8; j += 4) {
            const float32x4_t g = vld1q_f32(gu + j), u = vld1q_f32(gu + inter + j);
            const float32x4_t e = ember_exp4(vsubq_f32(vdupq_n_f32(0.0f), g));
            vst1q_f32(out + j, vmulq_f32(vdivq_f32(g, vaddq_f32(vdupq_n_f32(1.0f), e)), u));
        }
#endif
    for (; i < inter; i++) out[i] = gu[i] / (1.0f + expf(-gu[i])) * gu[inter + i];
}

/* GELU-tanh as a sigmoid: 0.5 g (1 + tanh(u)) = g / (1 + exp(-2u)), u = sqrt(2/pi) (g + 0.044715 g^3).
 * One exp instead of a tanh, and no cancellation in 1 + tanh(u) for negative g. */
#define GELU_SQRT_2_OVER_PI 0.7978845608028654f
#define GELU_CUBIC 0.044715f

static void gelu_tanh_row(const float *gu, float *out, int64_t inter) {
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256 one = _mm256_set1_ps(1.0f), cubic = _mm256_set1_ps(GELU_CUBIC);
    const __m256 minus_two_c = _mm256_set1_ps(-2.0f * GELU_SQRT_2_OVER_PI);
    for (; i + 8 <= inter; i += 8) {
        const __m256 g = _mm256_loadu_ps(gu + i), u = _mm256_loadu_ps(gu + inter + i);
        const __m256 poly = _mm256_mul_ps(g, _mm256_add_ps(one, _mm256_mul_ps(cubic, _mm256_mul_ps(g, g))));
        const __m256 e = ember_exp8(_mm256_mul_ps(minus_two_c, poly));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u));
    }
#elif defined(EMBER_NEON)
    for (; i + 8 <= inter; i += 8)
        for (int64_t j = i; j < i + 8; j += 4) {
            const float32x4_t g = vld1q_f32(gu + j), u = vld1q_f32(gu + inter + j), one = vdupq_n_f32(1.0f);
            const float32x4_t poly = vmulq_f32(g, vaddq_f32(one, vmulq_f32(vdupq_n_f32(GELU_CUBIC), vmulq_f32(g, g))));
            const float32x4_t e = ember_exp4(vmulq_f32(vdupq_n_f32(-2.0f * GELU_SQRT_2_OVER_PI), poly));
            vst1q_f32(out + j, vmulq_f32(vdivq_f32(g, vaddq_f32(one, e)), u));
        }
#endif
    for (; i < inter; i++) {
        const float g = gu[i], poly = g * (1.0f + GELU_CUBIC * (g * g));
        out[i] = g / (1.0f + expf(-2.0f * GELU_SQRT_2_OVER_PI * poly)) * gu[inter + i];
    }
}

static float sum_of_squares(const float *x, int64_t n) {
    int64_t i = 0;
    float total = 0.0f;
#if defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < 8; j++) total += lanes[j];
#elif defined(EMBER_NEON)
    float32x4_t low = vdupq_n_f32(0.0f), high = low;   /* the 256-bit path's 8 lanes */
    for (; i + 8 <= n; i += 8) {
        const float32x4_t a = vld1q_f32(x + i), b = vld1q_f32(x + i + 4);
        low = vfmaq_f32(low, a, a);
        high = vfmaq_f32(high, b, b);
    }
    float lanes[8];
    vst1q_f32(lanes, low);
    vst1q_f32(lanes + 4, high);
    for (int j = 0; j < 8; j++) total += lanes[j];
#endif
    for (; i < n; i++) total += x[i] * x[i];
    return total;
}

static inline float rms_scale(const float *x, int64_t hidden, float eps) {
    return 1.0f / sqrtf(sum_of_squares(x, hidden) / (float)hidden + eps);
}

/* ---- jobs ---------------------------------------------------------------------------------- */
struct rows_job {
    float *x; int64_t ldx; float *r; int64_t ldr; const float *w; float *out; int64_t ldo;
    int64_t width; float eps;
};

static void rms_norm_rows(void *ctx, int64_t begin, int64_t end) {
    const struct rows_job *j = ctx;
    for (int64_t t = begin; t < end; t++) {
        const float *x = j->x + t * j->ldx;
        float *o = j->out + t * j->ldo;
        const float scale = rms_scale(x, j->width, j->eps);
        for (int64_t i = 0; i < j->width; i++) o[i] = (x[i] * scale) * j->w[i];
    }
}

static void add_rms_norm_rows(void *ctx, int64_t begin, int64_t end) {
    const struct rows_job *j = ctx;
    for (int64_t t = begin; t < end; t++) {
        float *x = j->x + t * j->ldx, *r = j->r + t * j->ldr;
        for (int64_t i = 0; i < j->width; i++) r[i] += x[i];
        const float scale = rms_scale(r, j->width, j->eps);
        for (int64_t i = 0; i < j->width; i++) x[i] = (r[i] * scale) * j->w[i];
    }
}

static void silu_rows(void *ctx, int64_t begin, int64_t end) {
    const struct rows_job *j = ctx;
    for (int64_t t = begin; t < end; t++) silu_row(j->x + t * j->ldx, j->out + t * j->ldo, j->width);
}

static void gelu_tanh_rows(void *ctx, int64_t begin, int64_t end) {
    const struct rows_job *j = ctx;
    for (int64_t t = begin; t < end; t++) gelu_tanh_row(j->x + t * j->ldx, j->out + t * j->ldo, j->width);
}

static void run_rows(int64_t rows, ember_range_fn fn, struct rows_job *job) {
    if (rows >= PARALLEL_ROWS) ember_parallel_for(rows, fn, job);
    else fn(job, 0, rows);
}

EMBER_EXPORT void ember_rms_norm(const float *x, int64_t ldx, const float *w, float *out, int64_t ldo,
                                 int64_t rows, int64_t hidden, float eps) {
    struct rows_job job = {(float *)x, ldx, NULL, 0, w, out, ldo, hidden, eps};
    run_rows(rows, rms_norm_rows, &job);
}

EMBER_EXPORT void ember_fused_add_rms_norm(float *x, int64_t ldx, float *residual, int64_t ldr,
                                           const float *w, int64_t rows, int64_t hidden, float eps) {
    struct rows_job job = {x, ldx, residual, ldr, w, NULL, 0, hidden, eps};
    run_rows(rows, add_rms_norm_rows, &job);
}

EMBER_EXPORT void ember_silu_and_mul(const float *gate_up, int64_t ldg, float *out, int64_t ldo,
                                     int64_t rows, int64_t inter) {
    struct rows_job job = {(float *)gate_up, ldg, NULL, 0, NULL, out, ldo, inter, 0.0f};
    run_rows(rows, silu_rows, &job);
}

EMBER_EXPORT void ember_gelu_tanh_and_mul(const float *gate_up, int64_t ldg, float *out, int64_t ldo,
                                          int64_t rows, int64_t inter) {
    struct rows_job job = {(float *)gate_up, ldg, NULL, 0, NULL, out, ldo, inter, 0.0f};
    run_rows(rows, gelu_tanh_rows, &job);
}

/* ---- RoPE in place on q [T, Hq, D] and k [T, Hk, D] (element strides; last axis dense) ------ */
struct rope_job {
    float *q; int64_t qs0, qs1; int32_t hq; float *k; int64_t ks0, ks1; int32_t hk; int32_t dim;
    const int32_t *positions; const float *cos_sin; int32_t neox;
};

static void rotate(float *x, const float *cos, const float *sin, int32_t half, int32_t neox) {
    for (int32_t i = 0; i < half; i++) {
        float *a = neox ? x + i : x + 2 * i, *b = neox ? x + i + half : x + 2 * i + 1;
        const float first = *a, second = *b;
        *a = first * cos[i] - second * sin[i];
        *b = second * cos[i] + first * sin[i];
    }
}

static void rope_rows(void *ctx, int64_t begin, int64_t end) {
    const struct rope_job *j = ctx;
    const int32_t half = j->dim / 2;
    for (int64_t t = begin; t < end; t++) {
        const float *cos = j->cos_sin + (int64_t)j->positions[t] * j->dim, *sin = cos + half;
        for (int32_t h = 0; h < j->hq; h++) rotate(j->q + t * j->qs0 + h * j->qs1, cos, sin, half, j->neox);
        for (int32_t h = 0; h < j->hk; h++) rotate(j->k + t * j->ks0 + h * j->ks1, cos, sin, half, j->neox);
    }
}

EMBER_EXPORT void ember_rope(float *q, int64_t qs0, int64_t qs1, int32_t hq, float *k, int64_t ks0,
                             int64_t ks1, int32_t hk, int32_t dim, const int32_t *positions,
                             const float *cos_sin, int32_t neox, int64_t tokens) {
    struct rope_job job = {q, qs0, qs1, hq, k, ks0, ks1, hk, dim, positions, cos_sin, neox};
    if (tokens >= PARALLEL_ROWS) ember_parallel_for(tokens, rope_rows, &job);
    else rope_rows(&job, 0, tokens);
}
