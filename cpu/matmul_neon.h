/* The aarch64 NEON paths of cpu/matmul_q.c (included by it, after cpu/matmul_formats.h): one group
 * of 8 weight rows against R rows of x, for every format, in the packed layout the x86 paths read.
 * A value vector V_j (k = 4j..4j+3 of the 8 rows) is two 128-bit registers, rows 0-3 and rows 4-7;
 * 16 bytes of it times 4 bytes of x give 4 rows' partial dot products in 4 int32 lanes: one SDOT
 * by element on the neon-dotprod path (x's 16 bytes loaded once, a lane per V_j); on plain NEON,
 * x's 4 bytes broadcast, 8-bit products widened to 16 bits (SMULL, SMLAL: two V_j added there),
 * pair-added into 32 (SADALP), the pairs folded at the end (ADDP). Every value is below 128 (Q8_0
 * is int8 already), so one signed dot product serves all formats. The integer sums are exact and
 * the float steps are the portable path's (f16 -> f32 exact, fused multiply-adds, same order):
 * results equal the portable and x86 paths bit for bit (tests/test_host_aarch64.py). */
#ifndef EMBER_CPU_MATMUL_NEON_H
#define EMBER_CPU_MATMUL_NEON_H

#if !defined(__ARM_FEATURE_DOTPROD)
static inline __attribute__((always_inline)) int8x16_t bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return vreinterpretq_s8_s32(vdupq_n_s32(v));
}

/* 8 bytes of w and x: their 4-byte halves' products, V_j's and V_j+1's added in 16 bits (at most
 * 2 x 128 x 127 < 2^15: x is within +-127, values within -128..127) */
static inline __attribute__((always_inline)) int16x8_t products2(int8x8_t w0, int8x8_t x0, int8x8_t w1, int8x8_t x1) {
    return vmlal_s8(vmull_s8(w0, x0), w1, x1);
}
#endif

/* 8 f16 fields (the 8 rows) as rows 0-3 and 4-7 */
static inline __attribute__((always_inline)) void load_f16x8(const uint8_t *p, float32x4_t f[2]) {
    const uint16x8_t h = vld1q_u16((const uint16_t *)p);
    f[0] = vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h)));
    f[1] = vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(h)));
}

static inline __attribute__((always_inline)) void u8x8_f32(const uint8_t *p, float32x4_t f[2]) {
    const uint16x8_t u = vmovl_u8(vld1_u8(p));
    f[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(u)));
    f[1] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(u)));
}

static inline __attribute__((always_inline)) void i8x8_s32(const uint8_t *p, int32x4_t s[2]) {
    const int16x8_t v = vmovl_s8(vld1_s8((const int8_t *)p));
    s[0] = vmovl_s16(vget_low_s16(v));
    s[1] = vmovl_s16(vget_high_s16(v));
}

/* V_0..V_7 of a block body (Q8_0: its int8 values; else nibbles, then high bits as in
 * ember_cupy/packed_weight.py), v[j][h] rows 4h..4h+3 */
static inline __attribute__((always_inline)) void decode_values(const uint8_t *body, const int32_t wtype, int8x16_t v[8][2]) {
    if (wtype == WTYPE_Q8_0) {
        for (int j = 0; j < 8; j++)
            for (int h = 0; h < 2; h++) v[j][h] = vld1q_s8((const int8_t *)body + 32 * j + 16 * h);
        return;
    }
    const int high_bits = FORMATS[wtype].high_bits;
    const uint8_t *nib = body + 32 * high_bits;
    for (int h = 0; h < 2; h++) {
        uint8x16_t u[8];
        for (int c = 0; c < 4; c++) {
            const uint8x16_t n = vld1q_u8(nib + 32 * c + 16 * h);
            u[2 * c] = vandq_u8(n, vdupq_n_u8(0x0f));
            u[2 * c + 1] = vshrq_n_u8(n, 4);
        }
        if (high_bits == 1) {             /* bit j of each byte -> bit 4 of V_j */
            const uint8x16_t bits = vld1q_u8(body + 16 * h);
            for (int j = 0; j < 8; j++)
                u[j] = vorrq_u8(u[j], vandq_u8(vshlq_u8(bits, vdupq_n_s8((int8_t)(4 - j))), vdupq_n_u8(0x10)));
        } else if (high_bits == 2) {      /* bits 2j, 2j+1 of half q's bytes -> bits 4-5 of V_4q+j */
            for (int q = 0; q < 2; q++) {
                const uint8x16_t bits = vld1q_u8(body + 32 * q + 16 * h);
                for (int j = 0; j < 4; j++)
                    u[4 * q + j] = vorrq_u8(u[4 * q + j], vandq_u8(vshlq_u8(bits, vdupq_n_s8((int8_t)(4 - 2 * j))),
                                                                   vdupq_n_u8(0x30)));
            }
        }
        for (int j = 0; j < 8; j++) v[j][h] = vreinterpretq_s8_u8(u[j]);
    }
}

/* sum over V_first..V_first+3 of V_j . x[4j..4j+3], per row */
#if defined(__ARM_FEATURE_DOTPROD)
static inline __attribute__((always_inline)) void dot4_values(int8x16_t v[8][2], const int8_t *xb, int first, int32x4_t sum[2]) {
    const int8x16_t x = vld1q_s8(xb + 4 * first);    /* lane i: x[4(first+i)..], SDOT by element */
    for (int h = 0; h < 2; h++) {
        int32x4_t s = vdotq_laneq_s32(vdupq_n_s32(0), v[first][h], x, 0);
        s = vdotq_laneq_s32(s, v[first + 1][h], x, 1);
        s = vdotq_laneq_s32(s, v[first + 2][h], x, 2);
        sum[h] = vdotq_laneq_s32(s, v[first + 3][h], x, 3);
    }
}
#else
static inline __attribute__((always_inline)) void dot4_values(int8x16_t v[8][2], const int8_t *xb, int first, int32x4_t sum[2]) {
    for (int h = 0; h < 2; h++) {
        int32x4_t lo = vdupq_n_s32(0), hi = vdupq_n_s32(0);   /* lanes: rows 0, 0, 1, 1 / 2, 2, 3, 3 */
        for (int j = first; j < first + 4; j += 2) {
            const int8x16_t x0 = bcast4(xb + 4 * j), x1 = bcast4(xb + 4 * j + 4);
            lo = vpadalq_s16(lo, products2(vget_low_s8(v[j][h]), vget_low_s8(x0), vget_low_s8(v[j + 1][h]),
                                           vget_low_s8(x1)));
            hi = vpadalq_s16(hi, vmlal_high_s8(vmull_high_s8(v[j][h], x0), v[j + 1][h], x1));
        }
        sum[h] = vpaddq_s32(lo, hi);
    }
}
#endif

/* The block's float scales: dw (d, or d sc) and mw (m, or dmin mn; zero without) */
static inline __attribute__((always_inline)) void block_scales(const uint8_t *rec, const int32_t wtype, int bi, float32x4_t dw[2], float32x4_t mw[2]) {
    load_f16x8(rec, dw);
    mw[0] = mw[1] = vdupq_n_f32(0.0f);
    if (is_k_quant(wtype)) {
        float32x4_t sc[2], mn[2];
        u8x8_f32(rec + 32 + 8 * bi, sc);
        u8x8_f32(rec + 96 + 8 * bi, mn);
        load_f16x8(rec + 16, mw);
        for (int h = 0; h < 2; h++) {
            dw[h] = vmulq_f32(dw[h], sc[h]);
            mw[h] = vmulq_f32(mw[h], mn[h]);
        }
    } else if (wtype == WTYPE_Q4_1 || wtype == WTYPE_Q5_1) {
        load_f16x8(rec + 16, mw);
    }
}

#if defined(__ARM_FEATURE_MATMUL_INT8)
/* V_2p and V_2p+1 as SMMLA's 2 x 8 operands: w[p][q] holds rows 2q and 2q+1 at k = 8p..8p+7 */
static inline __attribute__((always_inline)) void values_by_row_pairs(int8x16_t v[8][2], int8x16_t w[4][4]) {
    for (int p = 0; p < 4; p++)
        for (int h = 0; h < 2; h++) {
            const int32x4_t a = vreinterpretq_s32_s8(v[2 * p][h]), c = vreinterpretq_s32_s8(v[2 * p + 1][h]);
            w[p][2 * h] = vreinterpretq_s8_s32(vzip1q_s32(a, c));
            w[p][2 * h + 1] = vreinterpretq_s8_s32(vzip2q_s32(a, c));
        }
}

/* sums over V_0..V_7 of V_j . x[4j..4j+3] for two rows of x at once, xa and xb: 16 SMMLA, each
 * 2 weight rows x 2 rows of x x 8 values of k */
static inline __attribute__((always_inline)) void dot_values_pair(int8x16_t w[4][4], const int8_t *xa, const int8_t *xb, int32x4_t sum_a[2],
                                   int32x4_t sum_b[2]) {
    int32x4_t acc[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
    for (int p = 0; p < 4; p += 2) {             /* x's 16 bytes of each row: k = 8p..8p+15 */
        const int64x2_t a = vreinterpretq_s64_s8(vld1q_s8(xa + 8 * p)), c = vreinterpretq_s64_s8(vld1q_s8(xb + 8 * p));
        const int8x16_t x0 = vreinterpretq_s8_s64(vzip1q_s64(a, c)), x1 = vreinterpretq_s8_s64(vzip2q_s64(a, c));
        for (int q = 0; q < 4; q++) acc[q] = vmmlaq_s32(vmmlaq_s32(acc[q], w[p][q], x0), w[p + 1][q], x1);
    }
    for (int h = 0; h < 2; h++) {       /* acc[q] lanes: rows 2q, 2q+1 times xa, xb: 2q.a 2q.b 2q+1.a 2q+1.b */
        sum_a[h] = vuzp1q_s32(acc[2 * h], acc[2 * h + 1]);
        sum_b[h] = vuzp2q_s32(acc[2 * h], acc[2 * h + 1]);
    }
}
#endif

/* A block's sum for the 8 rows from its exact dot sums over V_0..3 (lo) and V_4..7 (hi): values
 * less their offset, times x (Q6_K: its halves times their scales, each product made float) */
static inline __attribute__((always_inline)) void block_sum(const int32x4_t lo[2], const int32x4_t hi[2], const uint8_t *rec,
                             const int32_t wtype, int bi, int32_t xsum, int32_t xsum_lo, float32x4_t sum[2]) {
    if (wtype == WTYPE_Q6_K) {
        int32x4_t sc_lo[2], sc_hi[2];
        i8x8_s32(rec + 16 + 16 * bi, sc_lo);
        i8x8_s32(rec + 24 + 16 * bi, sc_hi);
        for (int h = 0; h < 2; h++) {
            const int32x4_t a = vsubq_s32(lo[h], vdupq_n_s32(32 * xsum_lo));
            const int32x4_t c = vsubq_s32(hi[h], vdupq_n_s32(32 * (xsum - xsum_lo)));
            sum[h] = vaddq_f32(vcvtq_f32_s32(vmulq_s32(a, sc_lo[h])), vcvtq_f32_s32(vmulq_s32(c, sc_hi[h])));
        }
        return;
    }
    for (int h = 0; h < 2; h++) {
        int32x4_t isum = vaddq_s32(lo[h], hi[h]);
        if (FORMATS[wtype].offset) isum = vsubq_s32(isum, vdupq_n_s32(FORMATS[wtype].offset * xsum));
        sum[h] = vcvtq_f32_s32(isum);
    }
}

/* Two passes: a row pair's dot sums (of hi, and of lo where lo_sums is not NULL) combined in place */
static inline __attribute__((always_inline)) void split_combine(int32x4_t sums[2], const int32x4_t *lo_sums) {
    for (int h = 0; h < 2; h++)
        sums[h] = vmlaq_n_s32(lo_sums ? lo_sums[h] : vdupq_n_s32(0), sums[h], SPLIT_BASE);
}

/* Row r of x's block b (its dot sums lo, hi) into the row's accumulators: the portable path's
 * float steps, in its order */
static inline __attribute__((always_inline)) void accumulate_row(float32x4_t acc[2], const int32x4_t lo[2], const int32x4_t hi[2],
                                  const uint8_t *rec, const int32_t wtype, int bi, const float32x4_t dw[2],
                                  const float32x4_t mw[2], float xd, float xs, int32_t xsum, int32_t xsum_lo) {
    float32x4_t sum[2];
    block_sum(lo, hi, rec, wtype, bi, xsum, xsum_lo, sum);
    for (int h = 0; h < 2; h++) {
        acc[h] = vfmaq_f32(acc[h], sum[h], vmulq_n_f32(dw[h], xd));
        if (is_k_quant(wtype)) acc[h] = vfmsq_f32(acc[h], mw[h], vdupq_n_f32(xs));
        else if (wtype == WTYPE_Q4_1 || wtype == WTYPE_Q5_1) acc[h] = vfmaq_f32(acc[h], mw[h], vdupq_n_f32(xs));
    }
}

/* R int8 rows of x, R / P rows of y (P: the passes, a constant); xsum, xsum_lo: read only for
 * the formats with an offset (may be NULL for Q8_0, Q4_1) */
static inline __attribute__((always_inline)) void group_tile_neon(
        const uint8_t *g, const int32_t wtype, int64_t nb, const int8_t *xq, int64_t K, const float *xd,
        const float *xs, const int32_t *xsum, const int32_t *xsum_lo, const int R, const int P, float out[][8]) {
    float32x4_t acc[MR][2];
    for (int r = 0; r < R / P; r++) acc[r][0] = acc[r][1] = vdupq_n_f32(0.0f);
#define ROW_ARGS(r) rec, wtype, bi, dw, mw, xd[(r) * nb + b], xs[(r) * nb + b], xsum ? xsum[(r) * nb + b] : 0, \
                    xsum_lo ? xsum_lo[(r) * nb + b] : 0
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rec = record_of(g, wtype, b), *body = body_of(g, wtype, b);
        const int bi = (int)(b % FORMATS[wtype].blocks);
        for (int line = 0; line < 3; line++) __builtin_prefetch(body + PREFETCH_BYTES + 64 * line);
        int8x16_t v[8][2];
        decode_values(body, wtype, v);
        float32x4_t dw[2], mw[2];
        block_scales(rec, wtype, bi, dw, mw);
        int r = 0;
#if defined(__ARM_FEATURE_MATMUL_INT8)
        if (R >= 2 && wtype != WTYPE_Q6_K) {         /* rows of x in pairs: SMMLA (Q6_K's two scales: SDOT) */
            int8x16_t w[4][4];
            values_by_row_pairs(v, w);
            const int32x4_t zero[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
            for (; r + 1 < R; r += 2) {               /* P = 2: the pair is hi and lo of one row */
                const int8_t *xa = xq + r * K + b * QK;
                int32x4_t sums[2][2];
                dot_values_pair(w, xa, xa + K, sums[0], sums[1]);
                if (P == 2) {
                    split_combine(sums[0], sums[1]);
                    accumulate_row(acc[r / 2], sums[0], zero, ROW_ARGS(r));
                    continue;
                }
                for (int i = 0; i < 2; i++) accumulate_row(acc[r + i], sums[i], zero, ROW_ARGS(r + i));
            }
        }
#endif
        for (; r < R; r += P) {
            int32x4_t lo[2], hi[2];
            dot4_values(v, xq + r * K + b * QK, 0, lo);
            dot4_values(v, xq + r * K + b * QK, 4, hi);
            if (P == 2) {
                const int lo_kept = xd[(r + 1) * nb + b] != 0.0f;    /* else the pair's lo row is zero */
                int32x4_t lo2[2], hi2[2];
                if (lo_kept) {
                    dot4_values(v, xq + (r + 1) * K + b * QK, 0, lo2);
                    dot4_values(v, xq + (r + 1) * K + b * QK, 4, hi2);
                }
                split_combine(lo, lo_kept ? lo2 : NULL);
                split_combine(hi, lo_kept ? hi2 : NULL);
            }
            accumulate_row(acc[r / P], lo, hi, ROW_ARGS(r));
        }
    }
#undef ROW_ARGS
    for (int r = 0; r < R / P; r++) {
        vst1q_f32(out[r], acc[r][0]);
        vst1q_f32(out[r] + 4, acc[r][1]);
    }
}

static inline __attribute__((always_inline)) void group_tile(
        const uint8_t *g, int32_t wtype, int64_t nb, const int8_t *xq, int64_t K,
        const float *xd, const float *xs, const int R, const int P, float out[MR][ROWS]) {
    group_tile_neon(g, wtype, nb, xq, K, xd, xs, NULL, NULL, R, P, out);
}

static inline __attribute__((always_inline)) void group_tile_formats(
        const uint8_t *g, const int32_t wtype, int64_t nb, const int8_t *xq, int64_t K, const float *xd,
        const float *xs, const int32_t *xsum, const int32_t *xsum_lo, const int R, const int P, float out[][8]) {
    group_tile_neon(g, wtype, nb, xq, K, xd, xs, xsum, xsum_lo, R, P, out);
}

#endif
