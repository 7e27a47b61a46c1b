/* y[M, N] = x[M, K] @ W[N, K]^T with W quantized in blocks of 32 (llama.cpp's scheme).
 *
 * x is quantized once per call to int8 blocks (d = max|x| / 127, q = rint(x / d), s = d * sum q).
 * With two passes a block goes to 16 bits, q = rint(x / d) with d = max|x| / 32512, split into two
 * int8 rows q = 255 hi + lo (both within +-127, as one-pass values are); the kernels combine the
 * two rows' exact int32 dot products as 255 dot(hi) + dot(lo) and scale the pair once. Only the
 * blocks that carry most of the row's rounding error keep their lo (d1^2 >= threshold * the mean
 * d1^2 of the row, d1 = max|x| / 127: the error of a block grows with d1^2); the others are
 * 255 hi alone, and the portable and NEON paths skip their lo row.
 * W is repacked at load (ember_cupy/quant.py) so that 8 weight rows share each 32-byte load:
 *   Q4_1x8, per 8 rows and block: f16 d[8], f16 m[8], then 4 chunks of 32 bytes; byte 4r+i of
 *           chunk c holds row r's value at k = 8c+i in its low nibble and k = 8c+4+i in its high
 *           nibble (w = d*q + m; Q4_0 becomes Q4_1 with m = -8d);
 *   Q8_0x8, per 8 rows and block: f16 d[8], then 8 chunks of 32 int8; byte 4r+i of chunk j is
 *           row r's value at k = 4j+i (w = d*q).
 * A chunk times 4 broadcast bytes of x gives the 8 rows' partial dot products in 8 int32 lanes,
 * so the per-block scaling is one vector FMA per 8 outputs. Each output is one accumulation
 * chain over the blocks, whatever the batch: results are batch invariant.
 * NumPy twin: ember_cupy/ops/linear.py (fake-quantized x @ dequantized W).
 */
#define _GNU_SOURCE                  /* syscall(), for the AMX permission */
#include "common.h"
#include "matmul_q.h"
#include "threadpool.h"

#include <math.h>
#include <stdlib.h>

#define QK 32
#define ROWS 8                       /* weight rows interleaved together */
#define MR 8                         /* int8 rows of x per tile (with two passes, 4 rows of x) */
#define SPLIT_BASE 255               /* two passes: q = SPLIT_BASE hi + lo */
#define GROUPS_PER_TASK 4            /* 32 weight rows per thread task */
#ifndef X_TILE_BYTES
#define X_TILE_BYTES 8192             /* int8 rows of x swept per weight group: they stay in L1 */
#endif
#ifndef WEIGHT_BLOCK_BYTES
#define WEIGHT_BLOCK_BYTES (256 << 10) /* weight groups swept per pass over x: they stay in L2 */
#endif
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 1024          /* weights streamed from DRAM: ask for them this far ahead */
#endif
/* A 16-row tile reads two adjacent groups at once, two streams. Each stream's prefetch, once past
 * its group's end, would ask for bytes the other stream is reading now; it skips them instead
 * (one group further), so the next tile's two groups both start warm. Without this the second
 * group of every tile started cold: from DRAM, K = 2048 matrices (a group of 9.5 KB) read at
 * 20-25 GB/s against 30 on the one-stream 256-bit path (tools/bench_matmul.py --from-dram). */
static inline const uint8_t *pair_prefetch_target(const uint8_t *at, const uint8_t *group_end, int64_t group_bytes) {
    const uint8_t *target = at + PREFETCH_BYTES;
    return target >= group_end ? target + group_bytes : target;
}

enum { WTYPE_Q8_0 = 0, WTYPE_Q4_1 = 1 };   /* the others: cpu/matmul_formats.h */
#if !defined(EMBER_NEON)                /* the NEON paths step by record_of() */
static const int64_t RECORD_BYTES[] = {16 + 256, 32 + 128};
#endif

EMBER_EXPORT const char *ember_isa(void) { return EMBER_ISA; }

/* ---- activation quantization ---------------------------------------------------------- */
/* max |x| over a block; NaN where a value is NaN or inf */
static inline float block_max_abs(const float *xb) {
#if defined(__AVX512F__)
    const __m512 a0 = _mm512_abs_ps(_mm512_loadu_ps(xb)), a1 = _mm512_abs_ps(_mm512_loadu_ps(xb + 16));
    const __m512 largest = _mm512_set1_ps(3.402823466e38f);
    const __mmask16 finite = _mm512_cmp_ps_mask(a0, largest, _CMP_LE_OQ) & _mm512_cmp_ps_mask(a1, largest, _CMP_LE_OQ);
    return finite == 0xFFFF ? _mm512_reduce_max_ps(_mm512_max_ps(a0, a1)) : __builtin_nanf("");   /* max is exact */
#elif defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f), largest = _mm256_set1_ps(3.402823466e38f);
    __m256 amax = _mm256_setzero_ps();
    int finite = 1;
    for (int i = 0; i < QK; i += 8) {
        const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i));
        finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, largest, _CMP_LE_OQ)) == 0xFF;
        amax = _mm256_max_ps(amax, a);
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return finite ? _mm_cvtss_f32(m) : __builtin_nanf("");
#else
    float amax = 0.0f;
    int finite = 1;
    for (int i = 0; i < QK; i++) {
        float a = xb[i] < 0 ? -xb[i] : xb[i];
        amax = a > amax ? a : amax;
        finite &= a <= 3.402823466e38f;
    }
    return finite ? amax : __builtin_nanf("");
#endif
}

/* A block holding NaN or inf gets d = NaN and q = 0 (its outputs NaN, as the twin's): converting
 * NaN or inf to int is undefined in C, and x86 and ARM do give different garbage. */
static void quantize_block(const float *xb, int8_t *q, float *d_out, float *s_out, int32_t *sum_out,
                           int32_t *sum_lo_out) {
    const float amax = block_max_abs(xb);
    if (amax != amax) {
        memset(q, 0, QK);
        *d_out = *s_out = __builtin_nanf("");
        if (sum_out) *sum_out = 0;
        if (sum_lo_out) *sum_lo_out = 0;
        return;
    }
    float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0, sum_lo = 0;
    for (int i = 0; i < QK; i++) {
        int v = (int)__builtin_rintf(xb[i] * id);
        q[i] = (int8_t)v;
        sum += v;
        if (i == QK / 2 - 1) sum_lo = sum;
    }
    *d_out = d;
    *s_out = d * (float)sum;
    if (sum_out) *sum_out = sum;
    if (sum_lo_out) *sum_lo_out = sum_lo;
}

/* xsum, xsum_lo (may be NULL): each block's sum of q and that of its first 16, for the offsets
 * of the formats whose values are unsigned (Q8_0 as w + 128 in the VNNI kernels, Q5_0, Q6_K, ...) */
static void quantize_row(const float *x, int64_t K, int8_t *q, float *d_out, float *s_out, int32_t *xsum,
                         int32_t *xsum_lo) {
    for (int64_t b = 0; b < K / QK; b++)
        quantize_block(x + b * QK, q + b * QK, d_out + b, s_out + b, xsum ? xsum + b : NULL,
                       xsum_lo ? xsum_lo + b : NULL);
}

struct quantize_job {
    const float *x; int64_t K, ldx; double threshold; int8_t *xq; float *xd, *xs; int32_t *xsum, *xsum_lo;
};

static void quantize_rows(void *ctx, int64_t begin, int64_t end) {
    const struct quantize_job *job = ctx;
    const int64_t nb = job->K / QK;
    for (int64_t m = begin; m < end; m++)
        quantize_row(job->x + m * job->ldx, job->K, job->xq + m * job->K, job->xd + m * nb, job->xs + m * nb,
                     job->xsum ? job->xsum + m * nb : NULL, job->xsum_lo ? job->xsum_lo + m * nb : NULL);
}

static void quantize_one_pass(const float *x, int64_t M, int64_t K, int64_t ldx, int8_t *xq, float *xd,
                              float *xs, int32_t *xsum, int32_t *xsum_lo) {
    struct quantize_job job = {x, K, ldx, 0.0, xq, xd, xs, xsum, xsum_lo};
    if (M >= 8) ember_parallel_for(M, quantize_rows, &job);
    else quantize_rows(&job, 0, M);
}

EMBER_EXPORT void ember_quantize_q8(const float *x, int64_t M, int64_t K, int64_t ldx,
                                    int8_t *xq, float *xd, float *xs) {
    quantize_one_pass(x, M, K, ldx, xq, xd, xs, NULL, NULL);
}

/* ---- one group of 8 weight rows against R rows of x ------------------------------------- */
#if defined(__AVX2__)
static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

static inline __m256 load_f16x8(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* Two passes: a pair's exact sum SPLIT_BASE dot(hi) + dot(lo) */
static inline __m256i split_combine8(__m256i hi, __m256i lo) {
    return _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(hi, 8), hi), lo);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT_ACC(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#endif

/* A Q4_1 block's dot products with one int8 row of x (lo, hi: its chunks' low and high nibbles) */
static inline __m256i q4_1_dot8(const __m256i lo[4], const __m256i hi[4], const int8_t *xb) {
#if defined(DOT_ACC)
    __m256i sum = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        sum = DOT_ACC(sum, lo[c], bcast4(xb + 8 * c));
        sum = DOT_ACC(sum, hi[c], bcast4(xb + 8 * c + 4));
    }
    return sum;
#else
    /* 16-bit sums cannot overflow: 8 x 2 x 15 x 127 in both together */
    __m256i even = _mm256_maddubs_epi16(lo[0], bcast4(xb));
    __m256i odd = _mm256_maddubs_epi16(hi[0], bcast4(xb + 4));
    for (int c = 1; c < 4; c++) {
        even = _mm256_add_epi16(even, _mm256_maddubs_epi16(lo[c], bcast4(xb + 8 * c)));
        odd = _mm256_add_epi16(odd, _mm256_maddubs_epi16(hi[c], bcast4(xb + 8 * c + 4)));
    }
    return _mm256_madd_epi16(_mm256_add_epi16(even, odd), _mm256_set1_epi16(1));
#endif
}

/* A Q8_0 block's dot products with one int8 row of x (x takes w's signs, |w| is unsigned) */
static inline __m256i q8_0_dot8(const __m256i wq[8], const __m256i wabs[8], const int8_t *xb) {
    __m256i sum = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        const __m256i xs_signed = _mm256_sign_epi8(bcast4(xb + 4 * j), wq[j]);
#if defined(DOT_ACC)
        sum = DOT_ACC(sum, wabs[j], xs_signed);
#else
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(wabs[j], xs_signed), _mm256_set1_epi16(1)));
#endif
    }
    return sum;
}

/* R int8 rows of x, R / P rows of y (P: the passes, a constant) */
static inline __attribute__((always_inline)) void group_tile(
        const uint8_t *g, int32_t wtype, int64_t nb, const int8_t *xq, int64_t K,
        const float *xd, const float *xs, const int R, const int P, float out[MR][ROWS]) {
    const int64_t rb = RECORD_BYTES[wtype];
    __m256 acc[MR];
    for (int r = 0; r < R / P; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rec = g + b * rb;
        _mm_prefetch((const char *)(rec + PREFETCH_BYTES), _MM_HINT_T0);
        _mm_prefetch((const char *)(rec + PREFETCH_BYTES + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(rec + PREFETCH_BYTES + 128), _MM_HINT_T0);
        const __m256 dw = load_f16x8(rec);
        if (wtype == WTYPE_Q4_1) {
            const __m256 mw = load_f16x8(rec + 16);
            const __m256i low = _mm256_set1_epi8(0x0f);
            __m256i lo[4], hi[4];
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(rec + 32 + 32 * c));
                lo[c] = _mm256_and_si256(v, low);
                hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            for (int r = 0; r < R; r += P) {
                const int8_t *xb = xq + r * K + b * QK;
                __m256i isum = q4_1_dot8(lo, hi, xb);
                if (P == 2) isum = split_combine8(isum, q4_1_dot8(lo, hi, xb + K));
                const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(xd[r * nb + b]));
                acc[r / P] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[r * nb + b]),
                                             _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[r / P]));
            }
        } else {
            __m256i wq[8], wabs[8];
            for (int j = 0; j < 8; j++) {
                wq[j] = _mm256_loadu_si256((const __m256i *)(rec + 16 + 32 * j));
                wabs[j] = _mm256_sign_epi8(wq[j], wq[j]);
            }
            for (int r = 0; r < R; r += P) {
                const int8_t *xb = xq + r * K + b * QK;
                __m256i isum = q8_0_dot8(wq, wabs, xb);
                if (P == 2) isum = split_combine8(isum, q8_0_dot8(wq, wabs, xb + K));
                const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(xd[r * nb + b]));
                acc[r / P] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[r / P]);
            }
        }
    }
    for (int r = 0; r < R / P; r++) _mm256_storeu_ps(out[r], acc[r]);
}
#elif !defined(EMBER_NEON)                /* NEON: cpu/matmul_neon.h */
/* weight row n of a Q8_0 / Q4_1 block record times one int8 row of x */
static inline int32_t row_dot_portable(const uint8_t *rec, int32_t wtype, int n, const int8_t *xb) {
    int32_t sum = 0;
    if (wtype == WTYPE_Q4_1) {
        for (int c = 0; c < 4; c++)
            for (int i = 0; i < 4; i++) {
                const uint8_t v = rec[32 + 32 * c + 4 * n + i];
                sum += (v & 0x0f) * xb[8 * c + i] + (v >> 4) * xb[8 * c + 4 + i];
            }
    } else {
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < 4; i++) sum += (int8_t)rec[16 + 32 * j + 4 * n + i] * xb[4 * j + i];
    }
    return sum;
}

static inline void group_tile(const uint8_t *g, int32_t wtype, int64_t nb, const int8_t *xq,
                              int64_t K, const float *xd, const float *xs, const int R, const int P,
                              float out[MR][ROWS]) {
    const int64_t rb = RECORD_BYTES[wtype];
    for (int r = 0; r < R / P; r++)
        for (int n = 0; n < ROWS; n++) out[r][n] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rec = g + b * rb;
        for (int r = 0; r < R; r += P) {
            const int8_t *xb = xq + r * K + b * QK;
            const int lo_kept = P == 2 && xd[(r + 1) * nb + b] != 0.0f;
            float *o = out[r / P];
            for (int n = 0; n < ROWS; n++) {
                int32_t sum = row_dot_portable(rec, wtype, n, xb);
                if (P == 2) sum = SPLIT_BASE * sum + (lo_kept ? row_dot_portable(rec, wtype, n, xb + K) : 0);
                const float dw = ember_f16_to_f32(ember_load_u16(rec + 2 * n));
                o[n] = fmaf((float)sum, dw * xd[r * nb + b], o[n]);
                if (wtype == WTYPE_Q4_1) o[n] = fmaf(ember_f16_to_f32(ember_load_u16(rec + 16 + 2 * n)), xs[r * nb + b], o[n]);
            }
        }
    }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* Two weight groups (16 rows) per 512-bit register: half the dot-product instructions per MAC.
 * Each lane computes what the 256-bit path computes for its row, in the same order: the two
 * paths agree bit for bit. Q8_0 weights are made unsigned (w + 128, an xor of the sign bit) for
 * vpdpbusd, and 128 x the block's sum of q is taken off the exact int32 sum afterwards. */
#define PAIRED_GROUPS 1
static inline __m512i load_pair(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

static inline __m512 load_f16x16(const uint8_t *a, const uint8_t *b) {
    return _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128((const __m128i *)b),
                                            _mm_loadu_si128((const __m128i *)a)));
}

static inline __m512i split_combine16(__m512i hi, __m512i lo) {          /* split_combine8's */
    return _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(hi, 8), hi), lo);
}

static inline __m512i bcast4x16(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* Chunk c of a Q4_1 block pair as its low (k = 8c..8c+3) and high (k = 8c+4..8c+7) nibbles. */
static inline void unpack_q4_chunk(const uint8_t *ra, const uint8_t *rc, int c, __m512i *lo, __m512i *hi) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    const __m512i v = load_pair(ra + 32 + 32 * c, rc + 32 + 32 * c);
    *lo = _mm512_and_si512(v, low);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
}

/* Lanes 0-7 of each accumulator are the first group's rows, lanes 8-15 the second's. */
static inline void store_pair_rows(const __m512 *acc, int R, float out_a[][ROWS], float out_b[][ROWS]) {
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out_a[r], _mm512_castps512_ps256(acc[r]));
        _mm256_storeu_ps(out_b[r], _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)));
    }
}

static inline __m512i q4_1_dot16(const __m512i lo[4], const __m512i hi[4], const int8_t *xb) {
    __m512i sum = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        sum = _mm512_dpbusd_epi32(sum, lo[c], bcast4x16(xb + 8 * c));
        sum = _mm512_dpbusd_epi32(sum, hi[c], bcast4x16(xb + 8 * c + 4));
    }
    return sum;
}

static inline __m512i q8_0_dot16(const __m512i wu[8], const int8_t *xb) {    /* wu: w + 128 */
    __m512i sum = _mm512_setzero_si512();
    for (int j = 0; j < 8; j++) sum = _mm512_dpbusd_epi32(sum, wu[j], bcast4x16(xb + 4 * j));
    return sum;
}

/* R int8 rows of x, R / P rows of y (P: the passes, a constant) */
static inline __attribute__((always_inline)) void group_pair_tile(
        const uint8_t *ga, const uint8_t *gb, int32_t wtype, int64_t nb, const int8_t *xq, int64_t K,
        const float *xd, const float *xs, const int32_t *xsum, const int R, const int P,
        float out_a[][ROWS], float out_b[][ROWS]) {
    const int64_t rb = RECORD_BYTES[wtype];
    __m512 acc[MR];
    for (int r = 0; r < R / P; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *ra = ga + b * rb, *rc = gb + b * rb;
        const uint8_t *pa = pair_prefetch_target(ra, gb, gb - ga), *pb = pair_prefetch_target(rc, gb + (gb - ga), gb - ga);
        for (int line = 0; line < 3; line++) {
            _mm_prefetch((const char *)(pa + 64 * line), _MM_HINT_T0);
            _mm_prefetch((const char *)(pb + 64 * line), _MM_HINT_T0);
        }
        const __m512 dw = load_f16x16(ra, rc);
        if (wtype == WTYPE_Q4_1) {
            const __m512 mw = load_f16x16(ra + 16, rc + 16);
            __m512i lo[4], hi[4];
            for (int c = 0; c < 4; c++) unpack_q4_chunk(ra, rc, c, &lo[c], &hi[c]);
            for (int r = 0; r < R; r += P) {
                const int8_t *xb = xq + r * K + b * QK;
                __m512i isum = q4_1_dot16(lo, hi, xb);
                if (P == 2) isum = split_combine16(isum, q4_1_dot16(lo, hi, xb + K));
                const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(xd[r * nb + b]));
                acc[r / P] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[r * nb + b]),
                                             _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[r / P]));
            }
        } else {
            const __m512i sign = _mm512_set1_epi8((char)0x80);
            __m512i wu[8];
            for (int j = 0; j < 8; j++) wu[j] = _mm512_xor_si512(load_pair(ra + 16 + 32 * j, rc + 16 + 32 * j), sign);
            for (int r = 0; r < R; r += P) {
                const int8_t *xb = xq + r * K + b * QK;
                __m512i isum = q8_0_dot16(wu, xb);
                if (P == 2) isum = split_combine16(isum, q8_0_dot16(wu, xb + K));
                isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * xsum[r * nb + b]));
                const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(xd[r * nb + b]));
                acc[r / P] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[r / P]);
            }
        }
    }
    store_pair_rows(acc, R / P, out_a, out_b);
}
#endif

#include "matmul_formats.h"
#if defined(EMBER_NEON)
#include "matmul_neon.h"
#endif

/* A tile's outputs: R int8 rows of x are R / P rows of y (two passes: a row pair is one row). */
static void store_tile(float out[][ROWS], int R, int32_t P, int64_t n0, int64_t N, float *y, int64_t ldy) {
    if (N - n0 >= ROWS) {   /* a constant size: moves, not a call to memcpy per row */
        for (int r = 0; r < R / P; r++) memcpy(y + r * ldy + n0, out[r], sizeof(float) * ROWS);
        return;
    }
    for (int r = 0; r < R / P; r++) memcpy(y + r * ldy + n0, out[r], sizeof(float) * (size_t)(N - n0));
}

/* The rows left after the full tiles of MR, one instantiation per count (R a constant). */
#define TAIL_TILES(left, TILE_OF) do { switch (left) { \
        case 7: TILE_OF(7); break; case 6: TILE_OF(6); break; case 5: TILE_OF(5); break; \
        case 4: TILE_OF(4); break; case 3: TILE_OF(3); break; case 2: TILE_OF(2); break; \
        case 1: TILE_OF(1); break; default: break; } } while (0)

#if defined(PAIRED_GROUPS)
/* With two passes a pair of groups takes up to 12 int8 rows in one tile when that is all there is
 * (6 rows of x: 6 accumulators with both groups' columns each), so that a weight block is decoded
 * once for them: a 5-token verification step, 10 int8 rows, was a tile of 8 and one of 2, two
 * sweeps of the weights (bench_matmul, 5 rows: 13-15% faster). From 14 rows tiles of 8 were as
 * fast or faster. */
#define SMALL_PAIR_ROWS 12
#define PAIR_TILES(m, m1, P, PAIR) do { \
        if ((P) == 2 && (m1) - (m) <= SMALL_PAIR_ROWS) { \
            switch ((m1) - (m)) { \
            case 12: PAIR(12); break; case 10: PAIR(10); break; case 8: PAIR(8); break; \
            case 6: PAIR(6); break; case 4: PAIR(4); break; case 2: PAIR(2); break; default: break; } \
        } else { \
            for (; (m) + MR <= (m1); (m) += MR) PAIR(MR); \
            TAIL_TILES((m1) - (m), PAIR); \
        } } while (0)
#endif

/* One row of x (a decode step) takes the weight groups one at a time, one stream of weights per
 * thread, unless its rows are long. From DRAM, 2 Zen 4 cores, 1B shapes (K = 2048): gate_up
 * 27-31 -> 32-41 GB/s on every format; Gemma 3's 262k x 640 Q8_0 LM head 7.0-8.2 -> 5.2-5.4 ms
 * (22-26 -> 33-34 GB/s: a pair's two streams are each only 5 KB long there). From K = 8192 the
 * pairs were 10-20% faster (down): they halve the dot-product instructions, and long streams
 * keep the prefetchers busy. The two ways give the same bits. */
#define LONE_ROW_PAIRS_FROM_K 4096
#define PAIRS_FOR(K, rows, P) ((rows) > (P) || (K) > LONE_ROW_PAIRS_FROM_K)

/* x as the kernels read it: int8 rows, per block d, d * sum q, sum q and the sum of its first 16 */
struct quantized_x { const int8_t *q; const float *d, *s; const int32_t *sum, *sum_lo; int64_t K, nb;
                     const int8_t *q_tiles; };   /* two passes on AMX: q's row pairs as 256 hi + lo (matmul_amx.h) */

static inline __attribute__((always_inline)) struct quantized_x x_from(const struct quantized_x *x, int64_t m) {
    struct quantized_x at = *x;
    at.q += m * x->K; at.d += m * x->nb; at.s += m * x->nb; at.sum += m * x->nb; at.sum_lo += m * x->nb;
    if (at.q_tiles) at.q_tiles += m * x->K;
    return at;
}

/* Groups [g0, g1) of an unsigned-value format W against int8 rows [m0, m1) of x; W and P (the
 * passes) constants. */
static inline __attribute__((always_inline)) void format_groups(
        const int32_t W, const uint8_t *w, const struct quantized_x *x, const int32_t P, int64_t m0, int64_t m1,
        int64_t g0, int64_t g1, int64_t N, float *y, int64_t ldy) {
    const int64_t group_bytes = (x->nb / FORMATS[W].blocks) * record_bytes(W);
    float out[MR][ROWS];
    int64_t g = g0;
#if defined(PAIRED_GROUPS)
    float out_b[MR][ROWS];
    for (; g + 1 < g1 && PAIRS_FOR(x->K, m1 - m0, P); g += 2) {
        const uint8_t *gw = w + g * group_bytes;
        int64_t m = m0;
#define PAIR(R) do { const struct quantized_x at = x_from(x, m); \
                     group_pair_tile_formats(gw, gw + group_bytes, W, x->nb, at.q, x->K, at.d, at.s, at.sum, \
                                             at.sum_lo, R, P, out, out_b); \
                     store_tile(out, R, P, g * ROWS, N, y + (m / P) * ldy, ldy); \
                     store_tile(out_b, R, P, (g + 1) * ROWS, N, y + (m / P) * ldy, ldy); } while (0)
        PAIR_TILES(m, m1, P, PAIR);
#undef PAIR
    }
#endif
    for (; g < g1; g++) {
        const uint8_t *gw = w + g * group_bytes;
        int64_t m = m0;
#if defined(__AVX2__) || defined(EMBER_NEON)
#define TILE(R) do { const struct quantized_x at = x_from(x, m); \
                     group_tile_formats(gw, W, x->nb, at.q, x->K, at.d, at.s, at.sum, at.sum_lo, R, P, out); \
                     store_tile(out, R, P, g * ROWS, N, y + (m / P) * ldy, ldy); } while (0)
#else
#define TILE(R) do { const struct quantized_x at = x_from(x, m); \
                     group_tile_formats_portable(gw, W, x->nb, at.q, x->K, at.d, at.s, at.sum, at.sum_lo, R, P, out); \
                     store_tile(out, R, P, g * ROWS, N, y + (m / P) * ldy, ldy); } while (0)
#endif
        for (; m + MR <= m1; m += MR) TILE(MR);
        TAIL_TILES(m1 - m, TILE);
#undef TILE
    }
}

static void groups_against_x_formats(const uint8_t *w, int32_t wtype, const struct quantized_x *x, int32_t passes,
                                     int64_t m0, int64_t m1, int64_t g0, int64_t g1, int64_t N, float *y, int64_t ldy) {
#define FORMAT(W) do { if (passes == 2) format_groups(W, w, x, 2, m0, m1, g0, g1, N, y, ldy); \
                       else format_groups(W, w, x, 1, m0, m1, g0, g1, N, y, ldy); } while (0)
    switch (wtype) {
    case WTYPE_Q4_K: FORMAT(WTYPE_Q4_K); break;
    case WTYPE_Q5_K: FORMAT(WTYPE_Q5_K); break;
    case WTYPE_Q6_K: FORMAT(WTYPE_Q6_K); break;
    case WTYPE_Q5_0: FORMAT(WTYPE_Q5_0); break;
    case WTYPE_Q5_1: FORMAT(WTYPE_Q5_1); break;
    case WTYPE_Q4_0: FORMAT(WTYPE_Q4_0); break;
    default: break;
    }
#undef FORMAT
}

/* Groups [g0, g1) of Q8_0 / Q4_1 against int8 rows [m0, m1) of x, in pairs where the ISA has
 * them; P (the passes) a constant. */
static inline __attribute__((always_inline)) void q8_groups(
        const uint8_t *w, int32_t wtype, const struct quantized_x *x, const int32_t P, int64_t m0, int64_t m1,
        int64_t g0, int64_t g1, int64_t N, float *y, int64_t ldy) {
    const int64_t nb = x->nb, K = x->K, group_bytes = nb * record_bytes(wtype);
    const int8_t *xq = x->q;
    const float *xd = x->d, *xs = x->s;
    float out[MR][ROWS];
    int64_t g = g0;
#if defined(PAIRED_GROUPS)
    const int32_t *xsum = x->sum;
    float out_b[MR][ROWS];
    for (; g + 1 < g1 && PAIRS_FOR(x->K, m1 - m0, P); g += 2) {
        const uint8_t *gw = w + g * group_bytes;
        int64_t m = m0;
#define PAIR(R) do { group_pair_tile(gw, gw + group_bytes, wtype, nb, xq + m * K, K, xd + m * nb, \
                                     xs + m * nb, xsum + m * nb, R, P, out, out_b); \
                     store_tile(out, R, P, g * ROWS, N, y + (m / P) * ldy, ldy); \
                     store_tile(out_b, R, P, (g + 1) * ROWS, N, y + (m / P) * ldy, ldy); } while (0)
        PAIR_TILES(m, m1, P, PAIR);
#undef PAIR
    }
#endif
    for (; g < g1; g++) {
        const uint8_t *gw = w + g * group_bytes;
        int64_t m = m0;
#define TILE(R) do { group_tile(gw, wtype, nb, xq + m * K, K, xd + m * nb, xs + m * nb, R, P, out); \
                     store_tile(out, R, P, g * ROWS, N, y + (m / P) * ldy, ldy); } while (0)
        for (; m + MR <= m1; m += MR) TILE(MR);
        TAIL_TILES(m1 - m, TILE);
#undef TILE
    }
}

static void groups_against_x(const uint8_t *w, int32_t wtype, const struct quantized_x *x, int32_t passes,
                             int64_t m0, int64_t m1, int64_t g0, int64_t g1, int64_t N, float *y, int64_t ldy) {
    if (is_unsigned_format(wtype)) groups_against_x_formats(w, wtype, x, passes, m0, m1, g0, g1, N, y, ldy);
    else if (passes == 2) q8_groups(w, wtype, x, 2, m0, m1, g0, g1, N, y, ldy);
    else q8_groups(w, wtype, x, 1, m0, m1, g0, g1, N, y, ldy);
}

struct matmul_job {
    const uint8_t *w; int32_t wtype, passes, amx; int64_t groups, N, ldy, rows, chunk;
    struct quantized_x x; float *y;
};

#include "matmul_amx.h"

/* A thread's tasks (GROUPS_PER_TASK weight groups each), a block of groups at a time (about
 * WEIGHT_BLOCK_BYTES: they stay in L2, read from memory once), the block against every chunk of
 * x in turn (the chunk's int8 rows stay in L1 while the block's groups pass over them). */
static void matmul_tasks(void *ctx, int64_t begin, int64_t end) {
    const struct matmul_job *j = ctx;
    const int64_t g0 = begin * GROUPS_PER_TASK;
    const int64_t g1 = end * GROUPS_PER_TASK < j->groups ? end * GROUPS_PER_TASK : j->groups;
#if defined(AMX_TILES)
    if (j->amx && groups_amx(j, g0, g1)) return;
#endif
    const int64_t group_bytes = j->x.nb / FORMATS[j->wtype].blocks * record_bytes(j->wtype);
    int64_t block = WEIGHT_BLOCK_BYTES / group_bytes / 2 * 2;      /* even: the pairs stay whole */
    if (block < 2) block = 2;
    for (int64_t b0 = g0; b0 < g1; b0 += block) {
        const int64_t b1 = b0 + block < g1 ? b0 + block : g1;
        for (int64_t m0 = 0; m0 < j->rows; m0 += j->chunk) {
            const int64_t m1 = m0 + j->chunk < j->rows ? m0 + j->chunk : j->rows;
            groups_against_x(j->w, j->wtype, &j->x, j->passes, m0, m1, b0, b1, j->N, j->y, j->ldy);
        }
    }
}

/* Two passes, x to 16 bits: row 2m holds each block's hi, row 2m+1 its lo (q = SPLIT_BASE hi + lo).
 * The pair's block scale, sums and d * sum q (over the 16-bit q) are row 2m's entries; row 2m+1's
 * d is d again where the block keeps its lo and 0 where the threshold drops it (lo all zero: a
 * skip mark for the paths that branch), its other entries 0. A non-finite block (amax NaN: block_max_abs):
 * row 2m's d and s NaN, q 0. A block too small for 1 / d to be finite is a zero block. */
_Static_assert(SPLIT_BASE == 255, "split16 and split8 multiply by 255 as (h << 8) - h");
#if defined(__AVX512F__)
/* 16 values of quantize_split_block's loop at once, the same integers: q = rint(x id) (x id
 * rounded first, as -ffp-contract=off keeps the scalar loop), h = floor((q + 127) / 255) by a
 * correctly rounded float division (exact: the numerator is a whole number below 2^17, so the
 * quotient is k exactly or at least 1/255 from any whole k), lo = q - 255 h (or 0); returns the
 * sum of 255 h + lo. */
static inline int32_t split16(const float *xb, __m512 id, int keep_lo, int8_t *hi, int8_t *lo) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb), id));
    const __m512 numerator = _mm512_cvtepi32_ps(_mm512_add_epi32(q, _mm512_set1_epi32(127 + SPLIT_BASE * 128)));
    const __m512 quotient = _mm512_roundscale_ps(_mm512_div_ps(numerator, _mm512_set1_ps((float)SPLIT_BASE)),
                                                 _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512i h = _mm512_sub_epi32(_mm512_cvtps_epi32(quotient), _mm512_set1_epi32(128));
    const __m512i h255 = _mm512_sub_epi32(_mm512_slli_epi32(h, 8), h);
    const __m512i l = keep_lo ? _mm512_sub_epi32(q, h255) : _mm512_setzero_si512();
    _mm_storeu_si128((__m128i *)hi, _mm512_cvtepi32_epi8(h));
    _mm_storeu_si128((__m128i *)lo, _mm512_cvtepi32_epi8(l));
    return _mm512_reduce_add_epi32(_mm512_add_epi32(h255, l));
}
#elif defined(__AVX2__)
static inline void store_i32x8_as_i8(int8_t *out, __m256i v) {   /* values within int8 */
    const __m128i v16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64((__m128i *)out, _mm_packs_epi16(v16, v16));
}

/* 8 values of quantize_split_block's loop at once, as split16 takes 16 on the AVX-512 builds. */
static inline int32_t split8(const float *xb, __m256 id, int keep_lo, int8_t *hi, int8_t *lo) {
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb), id));
    const __m256 numerator = _mm256_cvtepi32_ps(_mm256_add_epi32(q, _mm256_set1_epi32(127 + SPLIT_BASE * 128)));
    const __m256 quotient = _mm256_floor_ps(_mm256_div_ps(numerator, _mm256_set1_ps((float)SPLIT_BASE)));
    const __m256i h = _mm256_sub_epi32(_mm256_cvtps_epi32(quotient), _mm256_set1_epi32(128));
    const __m256i h255 = _mm256_sub_epi32(_mm256_slli_epi32(h, 8), h);
    const __m256i l = keep_lo ? _mm256_sub_epi32(q, h255) : _mm256_setzero_si256();
    store_i32x8_as_i8(hi, h);
    store_i32x8_as_i8(lo, l);
    const __m256i both = _mm256_add_epi32(h255, l);
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(t);
}
#endif

static void quantize_split_block(const float *xb, float amax, int keep_lo, int8_t *hi, int8_t *lo, float *d_out,
                                 float *s_out, int32_t *sum_out, int32_t *sum_lo_out, float *d_lo_out) {
    memset(hi, 0, QK);
    memset(lo, 0, QK);
    *sum_out = *sum_lo_out = 0;
    *d_lo_out = 0.0f;
    if (amax != amax) {
        *d_out = *s_out = __builtin_nanf("");
        return;
    }
    const float d = amax / (float)(SPLIT_BASE * 127 + 127);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    if (!(id <= 3.402823466e38f)) {
        *d_out = *s_out = 0.0f;
        return;
    }
    int32_t sum = 0;
#if defined(__AVX512F__)
    const __m512 vid = _mm512_set1_ps(id);
    for (int half = 0; half < 2; half++) {
        sum += split16(xb + 16 * half, vid, keep_lo, hi + 16 * half, lo + 16 * half);
        if (half == 0) *sum_lo_out = sum;
    }
#elif defined(__AVX2__)
    const __m256 vid = _mm256_set1_ps(id);
    for (int i = 0; i < QK; i += 8) {
        sum += split8(xb + i, vid, keep_lo, hi + i, lo + i);
        if (i + 8 == QK / 2) *sum_lo_out = sum;
    }
#else
    for (int i = 0; i < QK; i++) {
        const int32_t q = (int32_t)__builtin_rintf(xb[i] * id);
        const int32_t h = (q + 127 + SPLIT_BASE * 128) / SPLIT_BASE - 128;   /* floor((q + 127) / 255) */
        hi[i] = (int8_t)h;
        lo[i] = keep_lo ? (int8_t)(q - SPLIT_BASE * h) : 0;
        sum += SPLIT_BASE * h + lo[i];
        if (i == QK / 2 - 1) *sum_lo_out = sum;
    }
#endif
    *d_out = d;
    *s_out = d * (float)sum;
    *sum_out = sum;
    *d_lo_out = keep_lo ? d : 0.0f;
}

static void quantize_two_pass_rows(void *ctx, int64_t begin, int64_t end) {
    const struct quantize_job *job = ctx;
    const int64_t K = job->K, nb = K / QK;
    for (int64_t m = begin; m < end; m++) {
        const float *x = job->x + m * job->ldx;
        int8_t *q = job->xq + 2 * m * K;
        float *d = job->xd + 2 * m * nb, *s = job->xs + 2 * m * nb;
        int32_t *sum = job->xsum + 2 * m * nb, *sum_lo = job->xsum_lo + 2 * m * nb;
        double mean_square = 0.0;
        for (int64_t b = 0; b < nb; b++) {
            d[nb + b] = block_max_abs(x + b * QK);  /* row 2m+1's d: scratch until the block is quantized */
            const double d1 = (double)(d[nb + b] / 127.0f);
            mean_square += d1 * d1;
        }
        const double cut = job->threshold * (mean_square / (double)nb);
        for (int64_t b = 0; b < nb; b++) {
            const float amax = d[nb + b];
            const double d1 = (double)(amax / 127.0f);
            quantize_split_block(x + b * QK, amax, d1 * d1 >= cut, q + b * QK, q + K + b * QK, d + b, s + b, sum + b,
                                 sum_lo + b, d + nb + b);
            s[nb + b] = 0.0f;
            sum[nb + b] = sum_lo[nb + b] = 0;
        }
    }
}

static void quantize_two_pass(const float *x, int64_t M, int64_t K, int64_t ldx, double threshold,
                              int8_t *xq, float *xd, float *xs, int32_t *xsum, int32_t *xsum_lo) {
    struct quantize_job job = {x, K, ldx, threshold, xq, xd, xs, xsum, xsum_lo};
    if (M >= 8) ember_parallel_for(M, quantize_two_pass_rows, &job);
    else quantize_two_pass_rows(&job, 0, M);
}

static int valid_part(const EmberWeightPart *part, int64_t K) {
    return part->wtype >= 0 && part->wtype < WTYPE_COUNT && part->rows >= 0 &&
           K % (QK * FORMATS[part->wtype].blocks) == 0 && (part->rows == 0 || part->w != NULL);
}

/* The quantized parts among `parts` (16-bit ones are not), or -1 where a part is not valid. */
static int32_t quantized_part_count(const EmberWeightPart *parts, int32_t count, int64_t K) {
    int32_t quantized = 0;
    for (int32_t p = 0; p < count; p++) {
        if (ember_is_16bit(parts[p].wtype)) {
            if (parts[p].rows < 0 || (parts[p].rows > 0 && !parts[p].w)) return -1;
            continue;
        }
        if (K % QK != 0 || !valid_part(&parts[p], K)) return -1;
        quantized++;
    }
    return quantized;
}

/* One part's rows of y (columns [column, column + rows)), x quantized already. */
static void matmul_part(const EmberWeightPart *part, const struct quantized_x *x, int64_t rows, int32_t passes,
                        float *y, int64_t ldy) {
    if (part->rows == 0) return;
    int64_t chunk = X_TILE_BYTES / x->K / MR * MR;   /* a multiple of MR: two-pass pairs stay whole */
    if (chunk < MR) chunk = MR;
#if defined(PAIRED_GROUPS)
    if (passes == 2 && rows <= SMALL_PAIR_ROWS) chunk = rows;   /* one tile (PAIR_TILES) */
#endif
#if defined(AMX_TILES)
    const int32_t amx = amx_takes(rows);
#else
    const int32_t amx = 0;
#endif
    const int64_t groups = (part->rows + ROWS - 1) / ROWS;
    struct matmul_job job = {part->w, part->wtype, passes, amx, groups, part->rows, ldy, rows, chunk, *x, y};
    ember_parallel_for((groups + GROUPS_PER_TASK - 1) / GROUPS_PER_TASK, matmul_tasks, &job);
}

/* y[:, offsets of the parts] = x @ [W_0; W_1; ...]^T: x quantized once for every quantized part
 * (each packed as above in its own format; a 16-bit part multiplies x as it is: cpu/matmul_16bit.c).
 * passes: 1 (int8 x) or 2 (x and its residual, in the blocks that second_pass_threshold selects:
 * 0 selects all). Returns 0, -1 for a bad argument, -2 out of memory. */
EMBER_EXPORT int ember_matmul_parts(const float *x, int64_t M, int64_t K, int64_t ldx, const EmberWeightPart *parts,
                                    int32_t count, float *y, int64_t ldy, int32_t passes, float second_pass_threshold) {
    if (K <= 0 || M < 0 || count < 0 || (count > 0 && !parts)) return -1;
    if ((passes != 1 && passes != 2) || !(second_pass_threshold >= 0.0f)) return -1;
    const int32_t quantized_parts = quantized_part_count(parts, count, K);
    if (quantized_parts < 0) return -1;
    if (M == 0 || count == 0) return 0;
    const int64_t nb = K / QK, rows = M * passes;
    int8_t *xq = NULL, *xt = NULL;
    float *xd = NULL;
    struct quantized_x quantized = {0};
    if (quantized_parts) {
        const int64_t padded_rows = (rows + 15) / 16 * 16;      /* AMX reads x 16 rows at a time */
        xq = (int8_t *)malloc((size_t)(padded_rows * K + 64));
        xd = (float *)malloc(sizeof(float) * (size_t)(rows * nb) * 4);
        if (!xq || !xd) { free(xq); free(xd); return -2; }
        memset(xq + rows * K, 0, (size_t)((padded_rows - rows) * K));
        float *xs = xd + rows * nb;
        int32_t *xsum = (int32_t *)(xs + rows * nb), *xsum_lo = xsum + rows * nb;
        if (passes == 2) quantize_two_pass(x, M, K, ldx, second_pass_threshold, xq, xd, xs, xsum, xsum_lo);
        else quantize_one_pass(x, M, K, ldx, xq, xd, xs, xsum, xsum_lo);
        quantized = (struct quantized_x){xq, xd, xs, xsum, xsum_lo, K, nb, NULL};
#if defined(AMX_TILES)
        int32_t tiles = 0;
        for (int32_t p = 0; p < count; p++) tiles |= !ember_is_16bit(parts[p].wtype) && amx_takes(rows);
        if (passes == 2 && tiles) {
            xt = (int8_t *)malloc((size_t)(padded_rows * K + 64));
            if (!xt) { free(xq); free(xd); return -2; }
            memset(xt + rows * K, 0, (size_t)((padded_rows - rows) * K));
            split_for_tiles(xq, M, K, xt);
            quantized.q_tiles = xt;
        }
#endif
    }
    int status = 0;
    int64_t column = 0;
    for (int32_t p = 0; p < count && !status; p++) {
        if (ember_is_16bit(parts[p].wtype))     /* x as it is */
            status = ember_matmul_16bit(x, M, K, ldx, (const uint16_t *)parts[p].w, parts[p].rows, parts[p].wtype,
                                        y + column, ldy);
        else
            matmul_part(&parts[p], &quantized, rows, passes, y + column, ldy);
        column += parts[p].rows;
    }
    free(xq);
    free(xt);
    free(xd);
    return status;
}

/* One matrix of one format: w packed as above, ceil(N / 8) groups. */
EMBER_EXPORT int ember_matmul_q(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                                int64_t N, int32_t wtype, float *y, int64_t ldy, int32_t passes,
                                float second_pass_threshold) {
    if (N < 0) return -1;
    const EmberWeightPart part = {w, N, wtype};
    return ember_matmul_parts(x, M, K, ldx, &part, 1, y, ldy, passes, second_pass_threshold);
}

#include "matmul_bf16.h"
