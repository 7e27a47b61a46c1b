/* y[M, N] = x[M, K] @ W[N, K]^T for W in 16-bit floats (bf16 or f16 bits, one format a matrix):
 * float32 products and sums, W widened in registers (bf16: the bits shifted up 16; f16: F16C's
 * vcvtph2ps or NEON's fcvtl, or the exact bit conversion of common.h on the portable path).
 *
 * W is packed once at load (ember_cupy/half_weight.py, ember_pack_16bit below) in panels of 16
 * rows: panel p holds W[16p + j, k] at [p][k][j] (rows padded with zeros to a whole panel), so one
 * 32-byte load is one k of 16 outputs: a lone row of x streams W at 2 bytes a weight, and a tile
 * of rows x panels is register-blocked FMAs.
 *
 * Each output is ONE chain of FMAs over k = 0, 1, ..., K-1 from +0: y = fma(x[k], w[k], y). Its
 * bits depend on nothing but K: not on M, the tile it lands in, the thread count (threads split
 * the panels only) or the ISA path (portable C calls fmaf; -ffp-contract=off keeps the compiler
 * from fusing or reordering anything else). NumPy twin: half_weight.matmul_16bit_numpy, which
 * emulates fp32 FMA exactly. AVX-512 BF16/FP16 dot products (and AMX-BF16) sum pairs of k
 * before rounding, another order: not used.
 */
#include "common.h"
#include "matmul_q.h"
#include "threadpool.h"

#include <math.h>

#define LANES 16                      /* outputs of a panel */
#define PANELS_PER_TASK 2             /* a thread task: 32 outputs */

#if defined(__AVX512F__)
#define MR 8                          /* rows of x per tile: 8 x 2 panels = 16 accumulators */
#define PANELS_PER_TILE 2
static inline __m512 widen16(const uint16_t *p, const int32_t format) {
    const __m256i bits = _mm256_loadu_si256((const __m256i *)p);
    if (format == EMBER_WTYPE_F16) return _mm512_cvtph_ps(bits);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* Rows [0, R) of x against P (1 or 2) panels; out[r] holds the P x 16 outputs of row r. */
static inline __attribute__((always_inline)) void tile(const uint16_t *w, int64_t panel_stride, const int P,
                                                       const int32_t format, const float *x, int64_t ldx,
                                                       int64_t K, const int R, float out[][PANELS_PER_TILE * LANES]) {
    __m512 acc[MR][PANELS_PER_TILE];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m512 wk[PANELS_PER_TILE];
        for (int p = 0; p < P; p++) wk[p] = widen16(w + p * panel_stride + k * LANES, format);
        for (int r = 0; r < R; r++) {
            const __m512 xk = _mm512_set1_ps(x[r * ldx + k]);
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_fmadd_ps(xk, wk[p], acc[r][p]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) _mm512_storeu_ps(out[r] + p * LANES, acc[r][p]);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MR 6                          /* 6 rows x 2 halves of a panel = 12 accumulators */
#define PANELS_PER_TILE 1
static inline __m256 widen8(const uint16_t *p, const int32_t format) {
    const __m128i bits = _mm_loadu_si128((const __m128i *)p);
    if (format == EMBER_WTYPE_F16) return _mm256_cvtph_ps(bits);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

static inline __attribute__((always_inline)) void tile(const uint16_t *w, int64_t panel_stride, const int P,
                                                       const int32_t format, const float *x, int64_t ldx,
                                                       int64_t K, const int R, float out[][PANELS_PER_TILE * LANES]) {
    (void)panel_stride; (void)P;
    __m256 lo[MR], hi[MR];
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m256 wlo = widen8(w + k * LANES, format), whi = widen8(w + k * LANES + 8, format);
        for (int r = 0; r < R; r++) {
            const __m256 xk = _mm256_set1_ps(x[r * ldx + k]);
            lo[r] = _mm256_fmadd_ps(xk, wlo, lo[r]);
            hi[r] = _mm256_fmadd_ps(xk, whi, hi[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out[r], lo[r]);
        _mm256_storeu_ps(out[r] + 8, hi[r]);
    }
}
#elif defined(EMBER_NEON)
#define MR 4                          /* 4 rows x 4 quarters of a panel = 16 accumulators */
#define PANELS_PER_TILE 1
static inline float32x4_t widen4(const uint16_t *p, const int32_t format) {
    const uint16x4_t bits = vld1_u16(p);
    if (format == EMBER_WTYPE_F16) return vcvt_f32_f16(vreinterpret_f16_u16(bits));
    return vreinterpretq_f32_u32(vshll_n_u16(bits, 16));
}

static inline __attribute__((always_inline)) void tile(const uint16_t *w, int64_t panel_stride, const int P,
                                                       const int32_t format, const float *x, int64_t ldx,
                                                       int64_t K, const int R, float out[][PANELS_PER_TILE * LANES]) {
    (void)panel_stride; (void)P;
    float32x4_t acc[MR][4];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) acc[r][q] = vdupq_n_f32(0.0f);
    for (int64_t k = 0; k < K; k++) {
        float32x4_t wk[4];
        for (int q = 0; q < 4; q++) wk[q] = widen4(w + k * LANES + 4 * q, format);
        for (int r = 0; r < R; r++) {
            const float32x4_t xk = vdupq_n_f32(x[r * ldx + k]);
            for (int q = 0; q < 4; q++) acc[r][q] = vfmaq_f32(acc[r][q], xk, wk[q]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) vst1q_f32(out[r] + 4 * q, acc[r][q]);
}
#else
#define MR 4
#define PANELS_PER_TILE 1
static inline float widen1(uint16_t bits, const int32_t format) {
    if (format == EMBER_WTYPE_F16) return ember_f16_to_f32(bits);
    const uint32_t wide = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &wide, 4);
    return f;
}

static inline void tile(const uint16_t *w, int64_t panel_stride, const int P, const int32_t format,
                        const float *x, int64_t ldx, int64_t K, const int R, float out[][PANELS_PER_TILE * LANES]) {
    (void)panel_stride; (void)P;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < LANES; j++) out[r][j] = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        float wk[LANES];
        for (int j = 0; j < LANES; j++) wk[j] = widen1(w[k * LANES + j], format);
        for (int r = 0; r < R; r++) {
            const float xk = x[r * ldx + k];
            for (int j = 0; j < LANES; j++) out[r][j] = fmaf(xk, wk[j], out[r][j]);
        }
    }
}
#endif

struct job {
    const float *x; int64_t M, K, ldx; const uint16_t *w; int64_t N, panels; int32_t format; float *y; int64_t ldy;
};

static void store(const float out[][PANELS_PER_TILE * LANES], int R, int64_t n0, int64_t count,
                  float *y, int64_t ldy) {
    for (int r = 0; r < R; r++) memcpy(y + r * ldy + n0, out[r], sizeof(float) * (size_t)count);
}

/* Panels [p, p + P) against every row of x, MR rows at a time; format and P constants. */
static inline __attribute__((always_inline)) void panels_against_x(const struct job *j, int64_t p, const int P,
                                                                   const int32_t format) {
    const int64_t panel_stride = j->K * LANES, n0 = p * LANES;
    const int64_t count = j->N - n0 < P * LANES ? j->N - n0 : P * LANES;
    const uint16_t *w = j->w + p * panel_stride;
    float out[MR][PANELS_PER_TILE * LANES];
    int64_t m = 0;
    for (; m + MR <= j->M; m += MR) {
        tile(w, panel_stride, P, format, j->x + m * j->ldx, j->ldx, j->K, MR, out);
        store(out, MR, n0, count, j->y + m * j->ldy, j->ldy);
    }
    const int left = (int)(j->M - m);
    switch (left) {     /* one instantiation per count: R a constant, the accumulators in registers */
#define TAIL(R) case R: tile(w, panel_stride, P, format, j->x + m * j->ldx, j->ldx, j->K, R, out); \
                        store(out, R, n0, count, j->y + m * j->ldy, j->ldy); break;
#if MR > 7
    TAIL(7)
#endif
#if MR > 6
    TAIL(6)
#endif
#if MR > 5
    TAIL(5)
    TAIL(4)
#endif
    TAIL(3) TAIL(2) TAIL(1)
#undef TAIL
    default: break;
    }
}

static inline __attribute__((always_inline)) void format_tasks(const struct job *j, int64_t begin, int64_t end,
                                                               const int32_t format) {
    int64_t p = begin * PANELS_PER_TASK;
    const int64_t p1 = end * PANELS_PER_TASK < j->panels ? end * PANELS_PER_TASK : j->panels;
#if PANELS_PER_TILE == 2
    for (; p + 1 < p1; p += 2) panels_against_x(j, p, 2, format);
#endif
    for (; p < p1; p++) panels_against_x(j, p, 1, format);
}

static void tasks(void *ctx, int64_t begin, int64_t end) {
    const struct job *j = ctx;
    if (j->format == EMBER_WTYPE_F16) format_tasks(j, begin, end, EMBER_WTYPE_F16);
    else format_tasks(j, begin, end, EMBER_WTYPE_BF16);
}

/* w: ceil(N / 16) panels packed as above. Returns 0, or -1 for a bad argument. */
EMBER_EXPORT int ember_matmul_16bit(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w,
                                    int64_t N, int32_t format, float *y, int64_t ldy) {
    if (M < 0 || K < 0 || N < 0 || (format != EMBER_WTYPE_BF16 && format != EMBER_WTYPE_F16)) return -1;
    if (M == 0 || N == 0) return 0;
    if (!x || !w || !y || ldx < K || ldy < N) return -1;
    const int64_t panels = (N + LANES - 1) / LANES;
    const struct job j = {x, M, K, ldx, w, N, panels, format, y, ldy};
    ember_parallel_for((panels + PANELS_PER_TASK - 1) / PANELS_PER_TASK, tasks, (void *)&j);
    return 0;
}

/* ---- packing: W[N, K] rows (a row stride of ld elements) -> the panels ------------------- */
struct pack_job { const uint16_t *src; int64_t ld, N, K; uint16_t *dst; };

static void pack_panels(void *ctx, int64_t begin, int64_t end) {
    const struct pack_job *j = ctx;
    for (int64_t p = begin; p < end; p++) {
        uint16_t *panel = j->dst + p * j->K * LANES;
        for (int jj = 0; jj < LANES; jj++) {
            const int64_t n = p * LANES + jj;
            if (n >= j->N) {
                for (int64_t k = 0; k < j->K; k++) panel[k * LANES + jj] = 0;
                continue;
            }
            const uint16_t *row = j->src + n * j->ld;
            for (int64_t k = 0; k < j->K; k++) panel[k * LANES + jj] = row[k];
        }
    }
}

EMBER_EXPORT int ember_pack_16bit(const uint16_t *src, int64_t ld, int64_t N, int64_t K, uint16_t *dst) {
    if (N < 0 || K < 0 || ld < K || (N > 0 && K > 0 && (!src || !dst))) return -1;
    const struct pack_job j = {src, ld, N, K, dst};
    ember_parallel_for((N + LANES - 1) / LANES, pack_panels, (void *)&j);
    return 0;
}
