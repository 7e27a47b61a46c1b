/* The unsigned-value formats of cpu/matmul_q.c: Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, each served
 * in its own blocks (layout: ember_cupy/packed_weight.py). A 32-column block of a group of 8 rows
 * decodes to 8 vectors of unsigned bytes V_j (V_j's byte 4r+i is row r at k = 4j+i: the Q8_0
 * chunk layout), so one dot product serves every format, then a per-format integer offset and
 * float rule:
 *   Q4_0, Q5_0  isum = dot - o * sum(x q) (o = 8, 16);   acc += isum * (d xd)
 *   Q5_1        acc += dot * (d xd); acc += m * xs
 *   Q4_K, Q5_K  acc += dot * ((d sc) xd); acc -= (dmin mn) * xs
 *   Q6_K        sum = float(sc_a (dot_a - 32 sx_a)) + float(sc_b (dot_b - 32 sx_b)) over the
 *               block's halves (with 16-bit x the two products' int32 sum could overflow);
 *               acc += sum * (d xd)
 * With two passes dot is SPLIT_BASE dot(hi) + dot(lo) of the row pair, sx the sum of the 16-bit q.
 * The integer sums are exact, the float steps the same on every path (FMA where the SIMD paths
 * fuse): the portable, 256-bit, 512-bit and AMX paths agree bit for bit. Included by matmul_q.c.
 */
#ifndef EMBER_CPU_MATMUL_FORMATS_H
#define EMBER_CPU_MATMUL_FORMATS_H

#include <math.h>

enum { WTYPE_Q4_K = 2, WTYPE_Q5_K = 3, WTYPE_Q6_K = 4, WTYPE_Q5_0 = 5, WTYPE_Q5_1 = 6, WTYPE_Q4_0 = 7,
       WTYPE_COUNT = 8 };

struct wformat {
    int32_t blocks;          /* 32-column blocks per record: 1, or 8 (K-quants) */
    int32_t header_bytes;    /* the record's scale fields, 8 rows side by side */
    int32_t block_bytes;     /* per block: high bits (32 per bit), then 128 bytes of nibbles */
    int32_t high_bits;
    int32_t offset;          /* subtracted from every value (Q4_0 8, Q5_0 16, Q6_K 32) */
};

/* Q8_0 and Q4_1 keep their own code paths in matmul_q.c; listed for the record sizes. */
static const struct wformat FORMATS[WTYPE_COUNT] = {
    [0] = {1, 16, 256, 0, 0},            [1] = {1, 32, 128, 0, 0},
    [WTYPE_Q4_K] = {8, 160, 128, 0, 0},  [WTYPE_Q5_K] = {8, 160, 160, 1, 0},
    [WTYPE_Q6_K] = {8, 144, 192, 2, 32}, [WTYPE_Q5_0] = {1, 16, 160, 1, 16},
    [WTYPE_Q5_1] = {1, 32, 160, 1, 0},   [WTYPE_Q4_0] = {1, 16, 128, 0, 8},
};

static inline int64_t record_bytes(int32_t wtype) {
    return FORMATS[wtype].header_bytes + (int64_t)FORMATS[wtype].blocks * FORMATS[wtype].block_bytes;
}

static inline int is_unsigned_format(int32_t wtype) { return wtype >= WTYPE_Q4_K && wtype < WTYPE_COUNT; }
static inline int is_k_quant(int32_t wtype) { return wtype == WTYPE_Q4_K || wtype == WTYPE_Q5_K; }

/* Block b of a group: its record and its body (high bits, nibbles). */
static inline __attribute__((always_inline)) const uint8_t *record_of(const uint8_t *group, int32_t wtype, int64_t b) {
    return group + (b / FORMATS[wtype].blocks) * record_bytes(wtype);
}

static inline __attribute__((always_inline)) const uint8_t *body_of(const uint8_t *group, int32_t wtype, int64_t b) {
    const struct wformat *f = &FORMATS[wtype];
    return record_of(group, wtype, b) + f->header_bytes + (b % f->blocks) * f->block_bytes;
}

/* ---- portable: one row n of a group, one block ----------------------------------------- */
static inline int value_at(const uint8_t *body, int32_t high_bits, int n, int k) {
    const int j = k / 4, i = k % 4, byte = 4 * n + i;
    const uint8_t nib = body[32 * high_bits + 32 * (j / 2) + byte];
    int v = j % 2 ? nib >> 4 : nib & 0x0f;
    if (high_bits == 1) v |= ((body[byte] >> j) & 1) << 4;
    if (high_bits == 2) v |= ((body[32 * (j / 4) + byte] >> (2 * (j % 4))) & 3) << 4;
    return v;
}

/* sum over k of (v - offset) x, in halves of 16 (the offset taken off per half) */
static inline void dot_halves(const uint8_t *body, int32_t wtype, int n, const int8_t *xb, int32_t half[2]) {
    for (int h = 0; h < 2; h++) {
        int32_t sum = 0;
        for (int k = 16 * h; k < 16 * h + 16; k++)
            sum += (value_at(body, FORMATS[wtype].high_bits, n, k) - FORMATS[wtype].offset) * xb[k];
        half[h] = sum;
    }
}

static inline float f16_field(const uint8_t *rec, int field, int n) {
    return ember_f16_to_f32(ember_load_u16(rec + 16 * field + 2 * n));
}

/* Row n of block b against one int8 row of x at xb (P = 2: and its lo row at xb + K, unless
 * lo_kept is 0) */
static inline void block_portable(const uint8_t *group, int32_t wtype, int64_t b, int n, const int8_t *xb, int64_t K,
                                  int P, int lo_kept, float xd, float xs, float *acc) {
    const uint8_t *rec = record_of(group, wtype, b), *body = body_of(group, wtype, b);
    const int bi = (int)(b % FORMATS[wtype].blocks);
    int32_t half[2], lo[2] = {0, 0};
    dot_halves(body, wtype, n, xb, half);
    if (P == 2) {
        if (lo_kept) dot_halves(body, wtype, n, xb + K, lo);
        for (int h = 0; h < 2; h++) half[h] = SPLIT_BASE * half[h] + lo[h];
    }
    const float d = f16_field(rec, 0, n);
    if (wtype == WTYPE_Q6_K) {
        const int8_t *sc = (const int8_t *)rec + 16 + 16 * bi;
        *acc = fmaf((float)(sc[n] * half[0]) + (float)(sc[8 + n] * half[1]), d * xd, *acc);
    } else if (is_k_quant(wtype)) {
        const float dw = d * (float)rec[32 + 8 * bi + n], mw = f16_field(rec, 1, n) * (float)rec[96 + 8 * bi + n];
        *acc = fmaf((float)(half[0] + half[1]), dw * xd, *acc);
        *acc = fmaf(-mw, xs, *acc);
    } else {
        *acc = fmaf((float)(half[0] + half[1]), d * xd, *acc);
        if (wtype == WTYPE_Q5_1) *acc = fmaf(f16_field(rec, 1, n), xs, *acc);
    }
}

#if !defined(__AVX2__) && !defined(EMBER_NEON)
/* R int8 rows of x, R / P rows of y (xsum, xsum_lo: the SIMD paths' signature) */
static void group_tile_formats_portable(const uint8_t *g, int32_t wtype, int64_t nb, const int8_t *xq, int64_t K,
                                        const float *xd, const float *xs, const int32_t *xsum, const int32_t *xsum_lo,
                                        const int R, const int P, float out[][8]) {
    (void)xsum, (void)xsum_lo;
    for (int r = 0; r < R; r += P)
        for (int n = 0; n < 8; n++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++)
                block_portable(g, wtype, b, n, xq + r * K + b * 32, K, P, P == 2 && xd[(r + 1) * nb + b] != 0.0f,
                                   xd[r * nb + b], xs[r * nb + b], &acc);
            out[r / P][n] = acc;
        }
}
#endif

#if defined(__AVX2__)
/* ---- 256-bit: one group of 8 rows ------------------------------------------------------ */
static inline __attribute__((always_inline)) void decode_values8(const uint8_t *body, const int high_bits, __m256i v[8]) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const uint8_t *nib = body + 32 * high_bits;
    for (int c = 0; c < 4; c++) {
        const __m256i n = _mm256_loadu_si256((const __m256i *)(nib + 32 * c));
        v[2 * c] = _mm256_and_si256(n, low);
        v[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(n, 4), low);
    }
    if (high_bits == 1) {                 /* bit j of each byte -> bit 4 of V_j */
        const __m256i h = _mm256_loadu_si256((const __m256i *)body), bit = _mm256_set1_epi8(0x10);
        v[0] = _mm256_or_si256(v[0], _mm256_and_si256(_mm256_slli_epi16(h, 4), bit));
        v[1] = _mm256_or_si256(v[1], _mm256_and_si256(_mm256_slli_epi16(h, 3), bit));
        v[2] = _mm256_or_si256(v[2], _mm256_and_si256(_mm256_slli_epi16(h, 2), bit));
        v[3] = _mm256_or_si256(v[3], _mm256_and_si256(_mm256_slli_epi16(h, 1), bit));
        v[4] = _mm256_or_si256(v[4], _mm256_and_si256(h, bit));
        v[5] = _mm256_or_si256(v[5], _mm256_and_si256(_mm256_srli_epi16(h, 1), bit));
        v[6] = _mm256_or_si256(v[6], _mm256_and_si256(_mm256_srli_epi16(h, 2), bit));
        v[7] = _mm256_or_si256(v[7], _mm256_and_si256(_mm256_srli_epi16(h, 3), bit));
    } else if (high_bits == 2) {          /* bits 2j, 2j+1 of half h's bytes -> bits 4-5 of V_4h+j */
        const __m256i bits = _mm256_set1_epi8(0x30);
        for (int h = 0; h < 2; h++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(body + 32 * h));
            v[4 * h] = _mm256_or_si256(v[4 * h], _mm256_and_si256(_mm256_slli_epi16(x, 4), bits));
            v[4 * h + 1] = _mm256_or_si256(v[4 * h + 1], _mm256_and_si256(_mm256_slli_epi16(x, 2), bits));
            v[4 * h + 2] = _mm256_or_si256(v[4 * h + 2], _mm256_and_si256(x, bits));
            v[4 * h + 3] = _mm256_or_si256(v[4 * h + 3], _mm256_and_si256(_mm256_srli_epi16(x, 2), bits));
        }
    }
}

/* sum over V_first..V_first+3 of V_j . x[4j..4j+3], per row (values up to 63: the 16-bit pair
 * sums of maddubs stay below 2 x 63 x 127 x 2) */
static inline __attribute__((always_inline)) __m256i dot4_values8(const __m256i *v, const int8_t *xb, int first) {
    __m256i sum = _mm256_setzero_si256();
    for (int j = first; j < first + 4; j += 2) {
#if defined(DOT_ACC)
        sum = DOT_ACC(sum, v[j], bcast4(xb + 4 * j));
        sum = DOT_ACC(sum, v[j + 1], bcast4(xb + 4 * j + 4));
#else
        const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(v[j], bcast4(xb + 4 * j)),
                                              _mm256_maddubs_epi16(v[j + 1], bcast4(xb + 4 * j + 4)));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pair, _mm256_set1_epi16(1)));
#endif
    }
    return sum;
}

/* dot4_values8 of one int8 row, or (P = 2) of a row pair, combined */
static inline __attribute__((always_inline)) __m256i dot4_rows8(const __m256i *v, const int8_t *xb, int64_t K, int first, const int P) {
    const __m256i sum = dot4_values8(v, xb, first);
    return P == 2 ? split_combine8(sum, dot4_values8(v, xb + K, first)) : sum;
}

static inline __m256 u8x8_ps(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline __m256i i8x8_epi32(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

/* R int8 rows of x, R / P rows of y */
static inline __attribute__((always_inline)) void group_tile_formats(
        const uint8_t *g, const int32_t wtype, int64_t nb, const int8_t *xq, int64_t K, const float *xd,
        const float *xs, const int32_t *xsum, const int32_t *xsum_lo, const int R, const int P, float out[][8]) {
    const struct wformat f = FORMATS[wtype];
    __m256 acc[8];
    for (int r = 0; r < R / P; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rec = record_of(g, wtype, b), *body = body_of(g, wtype, b);
        const int bi = (int)(b % f.blocks);
        _mm_prefetch((const char *)(body + PREFETCH_BYTES), _MM_HINT_T0);
        _mm_prefetch((const char *)(body + PREFETCH_BYTES + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(body + PREFETCH_BYTES + 128), _MM_HINT_T0);
        __m256i v[8];
        decode_values8(body, f.high_bits, v);
        __m256 dw = load_f16x8(rec), mw = _mm256_setzero_ps();
        if (is_k_quant(wtype)) {
            dw = _mm256_mul_ps(dw, u8x8_ps(rec + 32 + 8 * bi));
            mw = _mm256_mul_ps(load_f16x8(rec + 16), u8x8_ps(rec + 96 + 8 * bi));
        } else if (wtype == WTYPE_Q5_1) {
            mw = load_f16x8(rec + 16);
        }
        /* Q6_K's half sums times their int8 scales, in float: a half sum is below 2^24 in magnitude
         * (16 x 32512 x 32), so converting it is exact, and the float product rounds the exact
         * product once, as converting the int32 product does: the bits of the integer multiply. */
        const __m256 sc_lo = wtype == WTYPE_Q6_K ? _mm256_cvtepi32_ps(i8x8_epi32(rec + 16 + 16 * bi)) : dw;
        const __m256 sc_hi = wtype == WTYPE_Q6_K ? _mm256_cvtepi32_ps(i8x8_epi32(rec + 24 + 16 * bi)) : dw;
        for (int r = 0; r < R; r += P) {
            const int8_t *xb = xq + r * K + b * 32;
            __m256 fsum;
            if (wtype == WTYPE_Q6_K) {
                const __m256i lo = _mm256_sub_epi32(dot4_rows8(v, xb, K, 0, P), _mm256_set1_epi32(32 * xsum_lo[r * nb + b]));
                const __m256i hi = _mm256_sub_epi32(dot4_rows8(v, xb, K, 4, P),
                                                    _mm256_set1_epi32(32 * (xsum[r * nb + b] - xsum_lo[r * nb + b])));
                fsum = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lo), sc_lo), _mm256_mul_ps(_mm256_cvtepi32_ps(hi), sc_hi));
            } else {
                __m256i isum = _mm256_add_epi32(dot4_values8(v, xb, 0), dot4_values8(v, xb, 4));
                if (P == 2) isum = split_combine8(isum, _mm256_add_epi32(dot4_values8(v, xb + K, 0), dot4_values8(v, xb + K, 4)));
                if (f.offset) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(f.offset * xsum[r * nb + b]));
                fsum = _mm256_cvtepi32_ps(isum);
            }
            __m256 sum = _mm256_fmadd_ps(fsum, _mm256_mul_ps(dw, _mm256_set1_ps(xd[r * nb + b])), acc[r / P]);
            if (is_k_quant(wtype)) sum = _mm256_fnmadd_ps(mw, _mm256_set1_ps(xs[r * nb + b]), sum);
            else if (wtype == WTYPE_Q5_1) sum = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[r * nb + b]), sum);
            acc[r / P] = sum;
        }
    }
    for (int r = 0; r < R / P; r++) _mm256_storeu_ps(out[r], acc[r]);
}
#endif

#if defined(PAIRED_GROUPS)
/* ---- 512-bit: two groups (16 rows), lanes 0-7 the first ------------------------------- */
static inline __attribute__((always_inline)) void decode_values16(const uint8_t *ba, const uint8_t *bb, const int high_bits, __m512i v[8]) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int c = 0; c < 4; c++) {
        const __m512i n = load_pair(ba + 32 * high_bits + 32 * c, bb + 32 * high_bits + 32 * c);
        v[2 * c] = _mm512_and_si512(n, low);
        v[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(n, 4), low);
    }
    if (high_bits == 1) {
        const __m512i h = load_pair(ba, bb), bit = _mm512_set1_epi8(0x10);
        v[0] = _mm512_or_si512(v[0], _mm512_and_si512(_mm512_slli_epi16(h, 4), bit));
        v[1] = _mm512_or_si512(v[1], _mm512_and_si512(_mm512_slli_epi16(h, 3), bit));
        v[2] = _mm512_or_si512(v[2], _mm512_and_si512(_mm512_slli_epi16(h, 2), bit));
        v[3] = _mm512_or_si512(v[3], _mm512_and_si512(_mm512_slli_epi16(h, 1), bit));
        v[4] = _mm512_or_si512(v[4], _mm512_and_si512(h, bit));
        v[5] = _mm512_or_si512(v[5], _mm512_and_si512(_mm512_srli_epi16(h, 1), bit));
        v[6] = _mm512_or_si512(v[6], _mm512_and_si512(_mm512_srli_epi16(h, 2), bit));
        v[7] = _mm512_or_si512(v[7], _mm512_and_si512(_mm512_srli_epi16(h, 3), bit));
    } else if (high_bits == 2) {
        const __m512i bits = _mm512_set1_epi8(0x30);
        for (int h = 0; h < 2; h++) {
            const __m512i x = load_pair(ba + 32 * h, bb + 32 * h);
            v[4 * h] = _mm512_or_si512(v[4 * h], _mm512_and_si512(_mm512_slli_epi16(x, 4), bits));
            v[4 * h + 1] = _mm512_or_si512(v[4 * h + 1], _mm512_and_si512(_mm512_slli_epi16(x, 2), bits));
            v[4 * h + 2] = _mm512_or_si512(v[4 * h + 2], _mm512_and_si512(x, bits));
            v[4 * h + 3] = _mm512_or_si512(v[4 * h + 3], _mm512_and_si512(_mm512_srli_epi16(x, 2), bits));
        }
    }
}

static inline __attribute__((always_inline)) __m512i dot4_values16(const __m512i *v, const int8_t *xb, int first) {
    __m512i sum = _mm512_setzero_si512();
    for (int j = first; j < first + 4; j++) sum = _mm512_dpbusd_epi32(sum, v[j], bcast4x16(xb + 4 * j));
    return sum;
}

static inline __attribute__((always_inline)) __m512i dot4_rows16(const __m512i *v, const int8_t *xb, int64_t K, int first, const int P) {
    const __m512i sum = dot4_values16(v, xb, first);
    return P == 2 ? split_combine16(sum, dot4_values16(v, xb + K, first)) : sum;
}

static inline __m128i pair8(const uint8_t *a, const uint8_t *b) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b));
}

static inline __m512 u8x16_ps(const uint8_t *a, const uint8_t *b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(pair8(a, b))); }
static inline __m512i i8x16_epi32(const uint8_t *a, const uint8_t *b) { return _mm512_cvtepi8_epi32(pair8(a, b)); }

/* The pair's record scales d and m (Q5_1's m, the K-quants' dmin; zero without), and from them
 * block bi's float scales dw (d, or d sc) and mw (m, or dmin mn). */
static inline void record_scales(const uint8_t *ra, const uint8_t *rc, int32_t wtype, __m512 *d, __m512 *m) {
    *d = load_f16x16(ra, rc);
    *m = is_k_quant(wtype) || wtype == WTYPE_Q5_1 ? load_f16x16(ra + 16, rc + 16) : _mm512_setzero_ps();
}

static inline void pair_scales(const uint8_t *ra, const uint8_t *rc, int32_t wtype, int bi, __m512 d, __m512 m,
                               __m512 *dw, __m512 *mw) {
    *dw = d;
    *mw = m;
    if (is_k_quant(wtype)) {
        *dw = _mm512_mul_ps(d, u8x16_ps(ra + 32 + 8 * bi, rc + 32 + 8 * bi));
        *mw = _mm512_mul_ps(m, u8x16_ps(ra + 96 + 8 * bi, rc + 96 + 8 * bi));
    }
}

/* acc + sum (d xd) (+ or - mw xs): the float steps every path takes, in this order (Q4_1's min
 * as Q5_1's: the AMX path scales Q4_1 here too) */
static inline __m512 scale_block16(int32_t wtype, __m512 acc, __m512 fsum, __m512 dw, __m512 mw, float xd, float xs) {
    __m512 sum = _mm512_fmadd_ps(fsum, _mm512_mul_ps(dw, _mm512_set1_ps(xd)), acc);
    if (is_k_quant(wtype)) sum = _mm512_fnmadd_ps(mw, _mm512_set1_ps(xs), sum);
    else if (wtype == WTYPE_Q5_1 || wtype == WTYPE_Q4_1) sum = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs), sum);
    return sum;
}

static inline __attribute__((always_inline)) void group_pair_tile_formats(
        const uint8_t *ga, const uint8_t *gb, const int32_t wtype, int64_t nb, const int8_t *xq, int64_t K,
        const float *xd, const float *xs, const int32_t *xsum, const int32_t *xsum_lo, const int R, const int P,
        float out_a[][8], float out_b[][8]) {
    const struct wformat f = FORMATS[wtype];
    __m512 acc[8], d = _mm512_setzero_ps(), m = d;
    for (int r = 0; r < R / P; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *ra = record_of(ga, wtype, b), *rc = record_of(gb, wtype, b);
        const int bi = (int)(b % f.blocks);
        const uint8_t *ba = ra + f.header_bytes + bi * f.block_bytes, *bb = rc + f.header_bytes + bi * f.block_bytes;
        const uint8_t *pa = pair_prefetch_target(ba, gb, gb - ga), *pb = pair_prefetch_target(bb, gb + (gb - ga), gb - ga);
        for (int line = 0; line < 3; line++) {
            _mm_prefetch((const char *)(pa + 64 * line), _MM_HINT_T0);
            _mm_prefetch((const char *)(pb + 64 * line), _MM_HINT_T0);
        }
        __m512i v[8];
        decode_values16(ba, bb, f.high_bits, v);
        if (bi == 0) record_scales(ra, rc, wtype, &d, &m);
        __m512 dw, mw;
        pair_scales(ra, rc, wtype, bi, d, m, &dw, &mw);
        /* Q6_K's half scales as floats: the integer multiply's bits (see the 256-bit path) */
        const __m512 sc_lo = wtype == WTYPE_Q6_K ? _mm512_cvtepi32_ps(i8x16_epi32(ra + 16 + 16 * bi, rc + 16 + 16 * bi)) : dw;
        const __m512 sc_hi = wtype == WTYPE_Q6_K ? _mm512_cvtepi32_ps(i8x16_epi32(ra + 24 + 16 * bi, rc + 24 + 16 * bi)) : dw;
        for (int r = 0; r < R; r += P) {
            const int8_t *xb = xq + r * K + b * 32;
            __m512 fsum;
            if (wtype == WTYPE_Q6_K) {
                const int32_t lo_x = xsum_lo[r * nb + b], hi_x = xsum[r * nb + b] - lo_x;
                const __m512i lo = _mm512_sub_epi32(dot4_rows16(v, xb, K, 0, P), _mm512_set1_epi32(32 * lo_x));
                const __m512i hi = _mm512_sub_epi32(dot4_rows16(v, xb, K, 4, P), _mm512_set1_epi32(32 * hi_x));
                fsum = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo), sc_lo), _mm512_mul_ps(_mm512_cvtepi32_ps(hi), sc_hi));
            } else {
                __m512i isum = _mm512_add_epi32(dot4_values16(v, xb, 0), dot4_values16(v, xb, 4));
                if (P == 2)
                    isum = split_combine16(isum, _mm512_add_epi32(dot4_values16(v, xb + K, 0), dot4_values16(v, xb + K, 4)));
                if (f.offset) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(f.offset * xsum[r * nb + b]));
                fsum = _mm512_cvtepi32_ps(isum);
            }
            acc[r / P] = scale_block16(wtype, acc[r / P], fsum, dw, mw, xd[r * nb + b], xs[r * nb + b]);
        }
    }
    store_pair_rows(acc, R / P, out_a, out_b);
}
#endif

#endif
