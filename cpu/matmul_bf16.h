/* Prompt rows in bf16 (included by cpu/matmul_q.c after matmul_amx.h): on AMX-BF16 tiles where
 * the CPU has them and Linux grants them, else on AVX512-BF16 vectors (VDPBF16PS: Zen 4, Cooper
 * Lake), which the avx512vnni library is built with and asks CPUID for before it uses them.
 *
 * y[M, N] = bf16(x)[M, K] @ bf16(W)[N, K]^T, float32 sums: x rounded to bf16 once per call, each
 * 32-column block of a pair of weight groups (16 rows) decoded by the int8 path's pair_block
 * (matmul_amx.h), scaled to float32 as the NumPy twin's dequantize_values does (the same
 * multiplications, no FMA), rounded to bf16 into the block's 16 dword rows: dword n of row k2 =
 * (w[n][2 k2], w[n][2 k2 + 1]), AMX's tile B and VDPBF16PS's operand alike. Each pair is decoded
 * once for every row of x, and there is no float step per block: the sums run over the whole of
 * K. The int8 path stores each block's sums and scales them with vector instructions (its time at
 * 512 rows went there); these paths store once per K.
 *
 * Tiles: a task's two pairs (32 outputs) against 32 rows of x at a time (two tiles A, two B, four
 * C). Vectors: one pair's 16 dword rows of a block in 16 registers, up to BF16_VECTOR_ROWS rows of
 * x against them, each row's 16 sums in a register, x's pairs broadcast from memory.
 *
 * Numerics: bf16 keeps 8 bits of x (the int8 path's two passes ~15), and the sums are rounded as
 * the hardware does (close to, not bit for bit, a float32 chain; the tiles and the vectors differ
 * in the last bits): not one of the bit-identical ISA paths. The engine runs prompt rows here, and
 * a row's role, not the batch, picks the kernel, so a row's bits depend on nothing but its own
 * values (cpu/layer.c): on the vectors each row's sums run in the same order whatever rows are
 * beside it. NumPy twin: ember_cupy/ops/linear.py matmul_q_bf16_numpy (x and W rounded alike,
 * sums in float64).
 */
#ifndef EMBER_CPU_MATMUL_BF16_H
#define EMBER_CPU_MATMUL_BF16_H

#if defined(PAIRED_GROUPS) && defined(__AVX512BF16__)
#include <cpuid.h>
#if defined(AMX_TILES) && defined(__AMX_BF16__)
#define BF16_ON_TILES 1
#endif

#define BF16_C00 0                     /* tiles C: x's two tiles A by the two pairs' tiles B */
#define BF16_C01 1
#define BF16_C10 2
#define BF16_C11 3
#define BF16_A0 4
#define BF16_A1 5
#define BF16_B0 6
#define BF16_B1 7
#define BF16_BAND 32                   /* rows of x a pass: two tiles A */

static int avx512_bf16_supported(void) {   /* CPUID.(7, 1):EAX[5] */
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1);
}

#if defined(BF16_ON_TILES)
static int bf16_tiles_supported(void) {   /* CPUID.(7, 0):EDX[22] AMX-BF16, and AVX512-BF16 for x */
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1) && avx512_bf16_supported();
}

EMBER_EXPORT int ember_bf16_tiles_ready(void) { return bf16_tiles_supported() && amx_permission() > 0; }
#else
EMBER_EXPORT int ember_bf16_tiles_ready(void) { return 0; }
#endif

/* Whether ember_matmul_parts_bf16 runs here: on the tiles, or on AVX512-BF16 vectors. */
EMBER_EXPORT int ember_bf16_prompts_ready(void) { return ember_bf16_tiles_ready() || avx512_bf16_supported(); }

/* 32 floats -> 32 bf16 (a's 16, then b's): VCVTNE2PS2BF16, nearest even, subnormal floats as zero
 * (the twin's round_to_bf16). */
static inline __m512i bf16_pack(__m512 a, __m512 b) { return (__m512i)_mm512_cvtne2ps_pbh(b, a); }

struct bf16_x_job { const float *x; int64_t K, ldx; uint16_t *out; };

static void bf16_x_rows(void *ctx, int64_t begin, int64_t end) {
    const struct bf16_x_job *j = ctx;
    for (int64_t m = begin; m < end; m++)
        for (int64_t k = 0; k < j->K; k += 32)   /* K: a multiple of QK */
            _mm512_storeu_si512(j->out + m * j->K + k, bf16_pack(_mm512_loadu_ps(j->x + m * j->ldx + k),
                                                                 _mm512_loadu_ps(j->x + m * j->ldx + k + 16)));
}

/* The pair's (groups at ga, gb) tiles B, one a block: 16 rows k2 of 16 dwords, dword n = (w[n][2 k2],
 * w[n][2 k2 + 1]) in bf16. V_j (k = 4j..4j+3 of the 16 rows, byte 4r + i) gives rows k2 = 2j
 * (i = 0, 1) and 2j + 1 (i = 2, 3). */
static void bf16_pair_tiles(const uint8_t *ga, const uint8_t *gb, int32_t wtype, int64_t nb, uint16_t *tiles) {
    static const int32_t even[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const __m512i take_even = _mm512_loadu_si512(even), take_odd = _mm512_add_epi32(take_even, _mm512_set1_epi32(1));
    const __m512i quarter_rows = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2);
    const int k_quant = is_k_quant(wtype), adds_min = wtype == WTYPE_Q4_1 || wtype == WTYPE_Q5_1;
    for (int64_t b = 0; b < nb; b++) {
        __m512i v[8];
        __m512 dw, mw, sc[2];
        pair_block(ga, gb, wtype, b, v, &dw, &mw, sc);
        __m512 scale[2][4], minimum[4];    /* lane l of quarter q is row 4q + l / 4 (per half for Q6_K) */
        for (int q = 0; q < 4; q++) {
            const __m512i rows_of_lanes = _mm512_add_epi32(_mm512_set1_epi32(4 * q), quarter_rows);
            for (int h = 0; h < 2; h++)
                scale[h][q] = _mm512_permutexvar_ps(rows_of_lanes, wtype == WTYPE_Q6_K ? _mm512_mul_ps(dw, sc[h]) : dw);
            minimum[q] = _mm512_permutexvar_ps(rows_of_lanes, mw);
        }
        for (int j = 0; j < 8; j++) {
            __m512 w[4];
            for (int q = 0; q < 4; q++) {
                w[q] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v[j], q))),
                                     scale[j / 4][q]);
                if (k_quant) w[q] = _mm512_sub_ps(w[q], minimum[q]);
                else if (adds_min) w[q] = _mm512_add_ps(w[q], minimum[q]);
            }
            const __m512i lo = bf16_pack(w[0], w[1]), hi = bf16_pack(w[2], w[3]);
            _mm512_store_si512((__m512i *)(tiles + (b * 16 + 2 * j) * 32), _mm512_permutex2var_epi32(lo, take_even, hi));
            _mm512_store_si512((__m512i *)(tiles + (b * 16 + 2 * j + 1) * 32), _mm512_permutex2var_epi32(lo, take_odd, hi));
        }
    }
}

struct bf16_job {
    const uint8_t *w; int32_t wtype; int64_t groups, N, K, rows, ldy;
    const uint16_t *x; float *y; int32_t on_tiles;
};

/* Pair p's tiles B for every block (groups 2p and 2p + 1; a lone last group twice). */
static void bf16_pair(const struct bf16_job *j, int64_t p, uint16_t *tiles) {
    const int64_t nb = j->K / QK, group_bytes = (nb / FORMATS[j->wtype].blocks) * record_bytes(j->wtype);
    const uint8_t *ga = j->w + 2 * p * group_bytes;
    bf16_pair_tiles(ga, 2 * p + 1 < j->groups ? ga + group_bytes : ga, j->wtype, nb, tiles);
}

#if defined(BF16_ON_TILES)
/* 32 rows of x from m against two pairs' tiles; columns from n0, `pairs` (1 or 2) of them valid. */
static void bf16_band(const struct bf16_job *j, int64_t m, const uint16_t *tiles0, const uint16_t *tiles1,
                      int64_t n0, float out[BF16_BAND][32]) {
    const int64_t nb = j->K / QK, stride = 2 * j->K;
    const uint16_t *x0 = j->x + m * j->K, *x1 = x0 + 16 * j->K;
    _tile_zero(BF16_C00); _tile_zero(BF16_C01); _tile_zero(BF16_C10); _tile_zero(BF16_C11);
    for (int64_t b = 0; b < nb; b++) {
        _tile_loadd(BF16_A0, x0 + b * QK, stride);
        _tile_loadd(BF16_A1, x1 + b * QK, stride);
        _tile_loadd(BF16_B0, tiles0 + b * 512, 64);
        _tile_loadd(BF16_B1, tiles1 + b * 512, 64);
        _tile_dpbf16ps(BF16_C00, BF16_A0, BF16_B0);
        _tile_dpbf16ps(BF16_C01, BF16_A0, BF16_B1);
        _tile_dpbf16ps(BF16_C10, BF16_A1, BF16_B0);
        _tile_dpbf16ps(BF16_C11, BF16_A1, BF16_B1);
    }
    const int full = m + BF16_BAND <= j->rows && n0 + 32 <= j->N;
    float *direct = j->y + m * j->ldy + n0;
    if (full) {
        const int64_t ld = 4 * j->ldy;
        _tile_stored(BF16_C00, direct, ld);
        _tile_stored(BF16_C01, direct + 16, ld);
        _tile_stored(BF16_C10, direct + 16 * j->ldy, ld);
        _tile_stored(BF16_C11, direct + 16 * j->ldy + 16, ld);
        return;
    }
    _tile_stored(BF16_C00, &out[0][0], 128);
    _tile_stored(BF16_C01, &out[0][16], 128);
    _tile_stored(BF16_C10, &out[16][0], 128);
    _tile_stored(BF16_C11, &out[16][16], 128);
    const int64_t rows = j->rows - m < BF16_BAND ? j->rows - m : BF16_BAND;
    const int64_t cols = j->N - n0 < 32 ? j->N - n0 : 32;
    for (int64_t r = 0; r < rows; r++) memcpy(direct + r * j->ldy, out[r], sizeof(float) * (size_t)cols);
}

#endif

#define BF16_VECTOR_ROWS 12             /* rows of x a pass: with two pairs, 24 registers of sums */

/* R rows of x from m against two pairs' blocks (tiles0, tiles1: nb x 16 dword rows each), into
 * y's 32 columns from n0 (fewer at the matrix's edge, where a lone last pair's second copy
 * stores nothing). Each broadcast pair of x serves both pairs' rows; R a constant: the sums stay
 * in registers. */
static inline __attribute__((always_inline)) void bf16_vector_rows(const struct bf16_job *j, int64_t m, const int R,
                                                                   const uint16_t *tiles0, const uint16_t *tiles1,
                                                                   int64_t n0) {
    const int64_t nb = j->K / QK;
    const uint16_t *x = j->x + m * j->K;
    __m512 sum0[BF16_VECTOR_ROWS], sum1[BF16_VECTOR_ROWS];
    for (int r = 0; r < R; r++) sum0[r] = sum1[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++)
        for (int k2 = 0; k2 < 16; k2++) {
            const __m512bh w0 = (__m512bh)_mm512_load_si512((const __m512i *)(tiles0 + (b * 16 + k2) * 32));
            const __m512bh w1 = (__m512bh)_mm512_load_si512((const __m512i *)(tiles1 + (b * 16 + k2) * 32));
            for (int r = 0; r < R; r++) {
                uint32_t pair;
                memcpy(&pair, x + r * j->K + b * QK + 2 * k2, 4);
                const __m512bh xr = (__m512bh)_mm512_set1_epi32((int)pair);
                sum0[r] = _mm512_dpbf16_ps(sum0[r], xr, w0);
                sum1[r] = _mm512_dpbf16_ps(sum1[r], xr, w1);
            }
        }
    for (int half = 0; half < 2; half++) {
        const int64_t left = j->N - n0 - 16 * half, cols = left < 16 ? left : 16;
        if (cols <= 0) break;
        const __mmask16 keep = (__mmask16)((1u << cols) - 1);
        for (int r = 0; r < R; r++)
            _mm512_mask_storeu_ps(j->y + (m + r) * j->ldy + n0 + 16 * half, keep, half ? sum1[r] : sum0[r]);
    }
}

static void bf16_vector_pairs(const struct bf16_job *j, const uint16_t *tiles0, const uint16_t *tiles1, int64_t n0) {
    int64_t m = 0;
#define ROWS_OF(R) bf16_vector_rows(j, m, R, tiles0, tiles1, n0)
    for (; m + BF16_VECTOR_ROWS <= j->rows; m += BF16_VECTOR_ROWS) ROWS_OF(BF16_VECTOR_ROWS);
    switch (j->rows - m) {
    case 11: ROWS_OF(11); break; case 10: ROWS_OF(10); break; case 9: ROWS_OF(9); break; case 8: ROWS_OF(8); break;
    case 7: ROWS_OF(7); break;   case 6: ROWS_OF(6); break;   case 5: ROWS_OF(5); break; case 4: ROWS_OF(4); break;
    case 3: ROWS_OF(3); break;   case 2: ROWS_OF(2); break;   case 1: ROWS_OF(1); break; default: break;
    }
#undef ROWS_OF
}

/* A task: two pairs (32 outputs), each decoded once, against every row of x: 32 rows at a time
 * on the tiles, else BF16_VECTOR_ROWS on the vectors (a lone last pair twice: its second copy's
 * columns lie past N and are not stored). */
static void bf16_tasks(void *ctx, int64_t begin, int64_t end) {
    const struct bf16_job *j = ctx;
    const int64_t pairs = (j->groups + 1) / 2;
    const size_t tile_bytes = (size_t)(j->K / QK) * 1024;
    uint16_t *tiles0 = aligned_alloc(64, 2 * tile_bytes);
    if (!tiles0) return;   /* bf16_part checked that this much can be allocated */
    uint16_t *tiles1 = tiles0 + tile_bytes / sizeof(uint16_t);
#if defined(BF16_ON_TILES)
    float out[BF16_BAND][32] __attribute__((aligned(64)));
    if (j->on_tiles) configure_tiles(BF16_TILES);
#endif
    for (int64_t u = begin; u < end; u++) {
        const int64_t p = 2 * u;
        bf16_pair(j, p, tiles0);
        if (p + 1 < pairs) bf16_pair(j, p + 1, tiles1);
        const uint16_t *second = p + 1 < pairs ? tiles1 : tiles0;
#if defined(BF16_ON_TILES)
        if (j->on_tiles) {
            for (int64_t m = 0; m < j->rows; m += BF16_BAND) bf16_band(j, m, tiles0, second, 16 * p, out);
            continue;
        }
#endif
        bf16_vector_pairs(j, tiles0, second, 16 * p);
    }
    free(tiles0);
}

/* One quantized part; x already in bf16 (rows padded to BF16_BAND with zeros). */
static int bf16_part(const EmberWeightPart *part, const uint16_t *xb, int64_t M, int64_t K, float *y, int64_t ldy) {
    if (part->rows == 0) return 0;
    const int64_t groups = (part->rows + ROWS - 1) / ROWS, pairs = (groups + 1) / 2;
    const int64_t nb = K / QK;
    void *probe = aligned_alloc(64, (size_t)nb * 2048);   /* what a task allocates */
    if (!probe) return -2;
    free(probe);
    struct bf16_job job = {part->w, part->wtype, groups, part->rows, K, M, ldy, xb, y, ember_bf16_tiles_ready()};
    ember_parallel_for((pairs + 1) / 2, bf16_tasks, &job);
    return 0;
}

EMBER_EXPORT int ember_matmul_parts_bf16(const float *x, int64_t M, int64_t K, int64_t ldx, const EmberWeightPart *parts,
                                         int32_t count, float *y, int64_t ldy) {
    if (K <= 0 || M < 0 || count < 0 || (count > 0 && !parts) || ldx < K) return -1;
    const int32_t quantized_parts = quantized_part_count(parts, count, K);
    if (quantized_parts < 0) return -1;
    if (!ember_bf16_prompts_ready()) return -3;
    if (M == 0 || count == 0) return 0;
    uint16_t *xb = NULL;
    if (quantized_parts) {
        const int64_t padded = (M + BF16_BAND - 1) / BF16_BAND * BF16_BAND;
        xb = aligned_alloc(64, (size_t)(padded * K) * sizeof(uint16_t));
        if (!xb) return -2;
        memset(xb + M * K, 0, (size_t)((padded - M) * K) * sizeof(uint16_t));
        struct bf16_x_job xjob = {x, K, ldx, xb};
        if (M >= 8) ember_parallel_for(M, bf16_x_rows, &xjob);
        else bf16_x_rows(&xjob, 0, M);
    }
    int status = 0;
    int64_t column = 0;
    for (int32_t p = 0; p < count && !status; p++) {
        if (ember_is_16bit(parts[p].wtype))
            status = ember_matmul_16bit(x, M, K, ldx, (const uint16_t *)parts[p].w, parts[p].rows, parts[p].wtype,
                                        y + column, ldy);
        else
            status = bf16_part(&parts[p], xb, M, K, y + column, ldy);
        column += parts[p].rows;
    }
    free(xb);
    return status;
}
#else
EMBER_EXPORT int ember_bf16_tiles_ready(void) { return 0; }
EMBER_EXPORT int ember_bf16_prompts_ready(void) { return 0; }

EMBER_EXPORT int ember_matmul_parts_bf16(const float *x, int64_t M, int64_t K, int64_t ldx, const EmberWeightPart *parts,
                                         int32_t count, float *y, int64_t ldy) {
    (void)x, (void)M, (void)K, (void)ldx, (void)parts, (void)count, (void)y, (void)ldy;
    return -3;
}
#endif

#endif
