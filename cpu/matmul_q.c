/* y[M, N] = x[M, K] @ W[N, K]^T with W kept in a GGUF block format (llama.cpp's scheme).
 *
 * x is quantized once per call to int8 blocks of 32 (scale d = max|x| / 127, q = rint(x / d),
 * and s = d * sum(q) for formats with an offset); each output is then a sum over blocks of
 * integer dot products times the two blocks' scales:
 *   Q8_0 (34 B: f16 d, int8 q[32]):          w = d * q
 *   Q4_1 (20 B: f16 d, f16 m, nibbles[16]):  w = d * q + m   (Q4_0 is repacked as Q4_1 at load)
 * NumPy twin: ember_cupy/ops/linear.py (fake-quantized x @ dequantized W).
 */
#include "common.h"

#include <stdlib.h>

#define QK 32
enum { WTYPE_Q8_0 = 0, WTYPE_Q4_1 = 1 };
static const int64_t BLOCK_BYTES[] = {34, 20};

/* Rows of x handled together against one weight row, and weight rows per thread task. */
#define MR 4
#define NR 4
#define N_TILE 16

EMBER_EXPORT const char *ember_isa(void) { return EMBER_ISA; }

EMBER_EXPORT int ember_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

EMBER_EXPORT void ember_set_num_threads(int n) {
#ifdef _OPENMP
    if (n > 0) omp_set_num_threads(n);
#else
    (void)n;
#endif
}

/* ---- activation quantization ---------------------------------------------------------- */
static void quantize_row(const float *x, int64_t K, int8_t *q, float *d_out, float *s_out) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) {
            float a = xb[i] < 0 ? -xb[i] : xb[i];
            amax = a > amax ? a : amax;
        }
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            int v = (int)__builtin_rintf(xb[i] * id);
            q[b * QK + i] = (int8_t)v;
            sum += v;
        }
        d_out[b] = d;
        s_out[b] = d * (float)sum;
    }
}

EMBER_EXPORT void ember_quantize_q8(const float *x, int64_t M, int64_t K, int64_t ldx,
                                    int8_t *xq, float *xd, float *xs) {
    int64_t nb = K / QK;
#pragma omp parallel for schedule(static) if (M >= 8)
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * ldx, K, xq + m * K, xd + m * nb, xs + m * nb);
}

/* ---- one block's integer dot product -------------------------------------------------- */
#if defined(__AVX2__)
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __m256i unpack_nibbles(const uint8_t *qs) {
    __m128i packed = _mm_loadu_si128((const __m128i *)qs);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* A tile: R rows of x against C weight rows (R, C compile-time constants after inlining). Each
 * output is one accumulation chain over the blocks, the same whatever the tile's shape, so the
 * results do not depend on the batch; the tile's shape only sets how many chains run at once. */
static inline __attribute__((always_inline)) void tile(
        const uint8_t *w, int64_t row_bytes, int32_t wtype, int64_t nb, const int8_t *xq, int64_t K,
        const float *xd, const float *xs, const int R, const int C, float *y, int64_t ldy) {
    const int64_t bb = BLOCK_BYTES[wtype];
#if defined(__AVX2__)
    __m256 acc[MR][NR];
    float offset[MR][NR];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) { acc[r][c] = _mm256_setzero_ps(); offset[r][c] = 0.0f; }
    for (int64_t b = 0; b < nb; b++) {
        __m256i xv[MR];
        for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_si256((const __m256i *)(xq + r * K + b * QK));
        for (int c = 0; c < C; c++) {
            const uint8_t *blk = w + c * row_bytes + b * bb;
            const float dw = ember_f16_to_f32(ember_load_u16(blk));
            if (wtype == WTYPE_Q4_1) {
                const float mw = ember_f16_to_f32(ember_load_u16(blk + 2));
                const __m256i wq = unpack_nibbles(blk + 4);
                for (int r = 0; r < R; r++) {
                    __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(wq, xv[r]));
                    acc[r][c] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dw * xd[r * nb + b]), acc[r][c]);
                    offset[r][c] += mw * xs[r * nb + b];
                }
            } else {
                const __m256i wq = _mm256_loadu_si256((const __m256i *)(blk + 2));
                const __m256i wabs = _mm256_sign_epi8(wq, wq);
                for (int r = 0; r < R; r++) {
                    __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(wabs, _mm256_sign_epi8(xv[r], wq)));
                    acc[r][c] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dw * xd[r * nb + b]), acc[r][c]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[r * ldy + c] = hsum(acc[r][c]) + offset[r][c];
#else
    for (int r = 0; r < R; r++) {
        const int8_t *xr = xq + r * K;
        for (int c = 0; c < C; c++) {
            float acc = 0.0f, offset = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = w + c * row_bytes + b * bb;
                float dw = ember_f16_to_f32(ember_load_u16(blk));
                int sum = 0;
                if (wtype == WTYPE_Q4_1) {
                    const uint8_t *qs = blk + 4;
                    for (int i = 0; i < QK / 2; i++)
                        sum += (qs[i] & 0x0f) * xr[b * QK + i] + (qs[i] >> 4) * xr[b * QK + i + QK / 2];
                    offset += ember_f16_to_f32(ember_load_u16(blk + 2)) * xs[r * nb + b];
                } else {
                    const int8_t *qs = (const int8_t *)(blk + 2);
                    for (int i = 0; i < QK; i++) sum += qs[i] * xr[b * QK + i];
                }
                acc += (float)sum * (dw * xd[r * nb + b]);
            }
            y[r * ldy + c] = acc + offset;
        }
    }
#endif
}

/* Weight rows [n0, n1) against all M rows of x, in tiles of MR x NR (narrower at the edges). */
static void rows_against_x(const uint8_t *w, int64_t row_bytes, int32_t wtype, int64_t nb,
                           const int8_t *xq, int64_t M, int64_t K, const float *xd, const float *xs,
                           int64_t n0, int64_t n1, float *y, int64_t ldy) {
#define TILE(R, C) tile(w + n * row_bytes, row_bytes, wtype, nb, xq + m * K, K, xd + m * nb, \
                        xs + m * nb, R, C, y + m * ldy + n, ldy)
    int64_t m = 0;
    for (; m + MR <= M; m += MR) {
        int64_t n = n0;
        for (; n + 2 <= n1; n += 2) TILE(MR, 2);
        for (; n < n1; n++) TILE(MR, 1);
    }
    const int64_t rest = M - m;   /* 0-3 rows left: more weight rows at once keep chains in flight */
    int64_t n = n0;
    if (rest == 1) {
        for (; n + NR <= n1; n += NR) TILE(1, NR);
        for (; n < n1; n++) TILE(1, 1);
    } else if (rest == 2) {
        for (; n + NR <= n1; n += NR) TILE(2, NR);
        for (; n < n1; n++) TILE(2, 1);
    } else if (rest == 3) {
        for (; n + 2 <= n1; n += 2) TILE(3, 2);
        for (; n < n1; n++) TILE(3, 1);
    }
#undef TILE
}

/* Returns 0, or -1 for a bad argument (K not a multiple of 32, unknown type), -2 out of memory. */
EMBER_EXPORT int ember_matmul_q(const float *x, int64_t M, int64_t K, int64_t ldx,
                                const uint8_t *w, int64_t N, int32_t wtype, float *y, int64_t ldy) {
    if (K % QK != 0 || (wtype != WTYPE_Q8_0 && wtype != WTYPE_Q4_1) || M < 0 || N < 0) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t nb = K / QK, row_bytes = nb * BLOCK_BYTES[wtype];
    int8_t *xq = (int8_t *)malloc((size_t)(M * K + 64));
    float *xd = (float *)malloc(sizeof(float) * (size_t)(M * nb) * 2);
    if (!xq || !xd) { free(xq); free(xd); return -2; }
    float *xs = xd + M * nb;
    ember_quantize_q8(x, M, K, ldx, xq, xd, xs);
    const int64_t n_tiles = (N + N_TILE - 1) / N_TILE;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < n_tiles; t++) {
        const int64_t n_end = (t + 1) * N_TILE < N ? (t + 1) * N_TILE : N;
        rows_against_x(w, row_bytes, wtype, nb, xq, M, K, xd, xs, t * N_TILE, n_end, y, ldy);
    }
    free(xq);
    free(xd);
    return 0;
}
