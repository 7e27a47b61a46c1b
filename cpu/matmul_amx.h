/* The AMX path of cpu/matmul_q.c (included by it, after the 512-bit kernels and groups_against_x).
 *
 * A weight-group pair's block is one tile B (8 rows of 64 bytes: row k4 holds k = 4 k4..4 k4+3 of
 * the 16 weight rows, which is how the packed chunks already lie), 16 int8 rows of x are tile A
 * (their rows as quantized, stride K), and tile C = A B holds the block's exact int32 sums for 16 x
 * 16 outputs. They are then scaled with the 512-bit path's float steps in its order: the same bits.
 * Q6_K, whose blocks have a scale per half, takes each half as its own product (tiles A of 16
 * columns, B of 4 rows: the tiles' second layout), two sums per block.
 * Linux lends the tile registers to a process that asks (arch_prctl); where it refuses, the
 * 512-bit path runs.
 */
#ifndef EMBER_CPU_MATMUL_AMX_H
#define EMBER_CPU_MATMUL_AMX_H

#if defined(PAIRED_GROUPS)
/* Block b of the pair (groups at ga and gb): its 8 rows V_j of values less the format's offset,
 * dw and mw of the 16 rows, and Q6_K's half scales as floats (sc[0] the first half's, sc[1] the
 * second's). Shared by the AMX int8 tiles and the bf16 prompt paths (matmul_bf16.h). */
static inline __attribute__((always_inline)) void pair_block(const uint8_t *ga, const uint8_t *gb, int32_t wtype,
                                                             int64_t b, __m512i v[8], __m512 *dw, __m512 *mw,
                                                             __m512 sc[2]) {
    const int64_t rb = record_bytes(wtype);
    const uint8_t *ra = ga + b * rb, *rc = gb + b * rb;
    *mw = _mm512_setzero_ps();
    if (is_unsigned_format(wtype)) {
        decode_values16(body_of(ga, wtype, b), body_of(gb, wtype, b), FORMATS[wtype].high_bits, v);
        const __m512i offset = _mm512_set1_epi8((char)FORMATS[wtype].offset);
        for (int j = 0; j < 8; j++) v[j] = _mm512_sub_epi8(v[j], offset);
        const uint8_t *rec_a = record_of(ga, wtype, b), *rec_b = record_of(gb, wtype, b);
        const int bi = (int)(b % FORMATS[wtype].blocks);
        __m512 d, m;
        record_scales(rec_a, rec_b, wtype, &d, &m);
        pair_scales(rec_a, rec_b, wtype, bi, d, m, dw, mw);
        if (wtype == WTYPE_Q6_K) {
            sc[0] = _mm512_cvtepi32_ps(i8x16_epi32(rec_a + 16 + 16 * bi, rec_b + 16 + 16 * bi));
            sc[1] = _mm512_cvtepi32_ps(i8x16_epi32(rec_a + 24 + 16 * bi, rec_b + 24 + 16 * bi));
        }
    } else if (wtype == WTYPE_Q4_1) {
        for (int c = 0; c < 4; c++) unpack_q4_chunk(ra, rc, c, v + 2 * c, v + 2 * c + 1);
        *dw = load_f16x16(ra, rc);
        *mw = load_f16x16(ra + 16, rc + 16);
    } else {
        for (int j = 0; j < 8; j++) v[j] = load_pair(ra + 16 + 32 * j, rc + 16 + 32 * j);
        *dw = load_f16x16(ra, rc);
    }
}
#endif

#if defined(PAIRED_GROUPS) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_TILES 1
#define AMX_ROWS 16                  /* int8 rows of x per tile A */
#define AMX_MIN_ROWS 16              /* fewer int8 rows: the 512-bit path's tiles of up to 12 are faster (bench_matmul) */
#define AMX_PAIRS_PER_PASS 4         /* pairs built together, each tile A used for all of them (bench_matmul) */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
/* Tile register numbers (literals, for the intrinsics' asm). Whole blocks: two sets, so that the
 * tiles of block b + 1 load and multiply while block b's sums are stored. Halves (Q6_K): two sets
 * of sums (C, for the block's two halves) alternating with b, and one A and B per half. */
#define TILE_C0 0
#define TILE_A0 1
#define TILE_B0 2
#define TILE_C1 3
#define TILE_A1 4
#define TILE_B1 5
#define HALF_C0A 0
#define HALF_C0B 1
#define HALF_C1A 2
#define HALF_C1B 3
#define HALF_AA 4
#define HALF_BA 5
#define HALF_AB 6
#define HALF_BB 7
enum tile_layout { WHOLE_BLOCKS = 1, HALF_BLOCKS = 2, BF16_TILES = 3 };   /* BF16_TILES: matmul_bf16.h */

struct tile_config { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

static int amx_permission(void) {                /* 1 granted, -1 refused; asked once */
    static int state = 0;
    int seen = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (!seen) {
        seen = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&state, seen, __ATOMIC_RELEASE);
    }
    return seen;
}

EMBER_EXPORT int ember_amx_ready(void) { return amx_permission() > 0; }

/* Tiles B hold Q8_0's values, and the unsigned formats' values less their offset (Q4_0 8, Q5_0 16,
 * Q6_K 32), signed: the int32 sums are then those of the offset values, exactly what the 512-bit
 * path computes as sum(x u) - offset sum(x), without that step per row and block. */
static inline int signed_tile_values(int32_t wtype) { return wtype == WTYPE_Q8_0 || FORMATS[wtype].offset != 0; }

/* Whether a quantized matrix times `rows` int8 rows of x runs on the tiles. */
static int amx_takes(int64_t rows) { return rows >= AMX_MIN_ROWS && amx_permission() > 0; }

static void set_tile(struct tile_config *config, int tile, int rows, int colsb) {
    config->rows[tile] = (uint8_t)rows;
    config->colsb[tile] = (uint16_t)colsb;
}

/* Per thread: the tile shapes stay loaded until a matrix needs the other layout. */
static void configure_tiles(enum tile_layout layout) {
    static __thread enum tile_layout loaded = 0;
    if (loaded == layout) return;
    struct tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    if (layout == WHOLE_BLOCKS) {
        for (int set = 0; set < 2; set++) {
            set_tile(&config, set ? TILE_C1 : TILE_C0, AMX_ROWS, 2 * ROWS * 4);
            set_tile(&config, set ? TILE_A1 : TILE_A0, AMX_ROWS, QK);
            set_tile(&config, set ? TILE_B1 : TILE_B0, QK / 4, 2 * ROWS * 4);
        }
    } else if (layout == BF16_TILES) {      /* every tile 16 rows of 64 bytes */
        for (int tile = 0; tile < 8; tile++) set_tile(&config, tile, 16, 64);
    } else {
        for (int c = HALF_C0A; c <= HALF_C1B; c++) set_tile(&config, c, AMX_ROWS, 2 * ROWS * 4);
        set_tile(&config, HALF_AA, AMX_ROWS, QK / 2);
        set_tile(&config, HALF_AB, AMX_ROWS, QK / 2);
        set_tile(&config, HALF_BA, QK / 8, 2 * ROWS * 4);
        set_tile(&config, HALF_BB, QK / 8, 2 * ROWS * 4);
    }
    _tile_loadconfig(&config);
    loaded = layout;
}

/* A pair of groups as the tiles read it, built once for all its tiles A: each block's tile B (512
 * bytes: Q4_1's nibbles unpacked, chunk c's low nibbles are k4 = 2c, its high nibbles k4 = 2c + 1;
 * Q8_0's chunks as they are; the other formats' values decoded less their offset
 * (signed_tile_values), V_j is row k4 = j: Q6_K's halves are rows 0-3 and 4-7), the block's weight
 * scales dw and mw of the 16 rows (pair_scales) and Q6_K's half scales as floats (sc: 16 of the
 * first half, then 16 of the second), so that the per-tile loop only scales. */
struct pair_tiles { uint8_t *b; float *dw, *mw, *sc; };

static void build_pair_tiles(const uint8_t *ga, const uint8_t *gb, int32_t wtype, int64_t nb,
                             const struct pair_tiles *t) {
    for (int64_t b = 0; b < nb; b++) {
        __m512i v[8];
        __m512 dw, mw, sc[2];
        pair_block(ga, gb, wtype, b, v, &dw, &mw, sc);
        for (int j = 0; j < 8; j++) _mm512_store_si512((__m512i *)(t->b + b * 512) + j, v[j]);
        if (wtype == WTYPE_Q6_K) {
            _mm512_store_ps(t->sc + 32 * b, sc[0]);
            _mm512_store_ps(t->sc + 32 * b + 16, sc[1]);
        }
        _mm512_store_ps(t->dw + 16 * b, dw);
        _mm512_store_ps(t->mw + 16 * b, mw);
    }
}

/* Block b's products of 16 x rows against the pair, into the tiles C of set b & 1 (Q6_K: one per
 * half); W a constant. store_block stores them after block b + 1's products are issued: a
 * product's latency is ~3 times its issue interval, and a store right behind it waits it out. */
static inline __attribute__((always_inline)) void tile_block(const int32_t W, const uint8_t *tiles,
                                                             const int8_t *xq, int64_t K, int64_t b) {
#define TILE_BLOCK(C, A, B) do { \
        _tile_loadd(A, xq + b * QK, K); \
        _tile_loadd(B, tiles + b * 512, 64); \
        _tile_zero(C); \
        if (signed_tile_values(W)) _tile_dpbssd(C, A, B); \
        else _tile_dpbsud(C, A, B); } while (0)       /* signed x, unsigned values (no offset) */
#define TILE_HALF(C, A, B, h) do { \
        _tile_loadd(A, xq + b * QK + (QK / 2) * (h), K); \
        _tile_loadd(B, tiles + b * 512 + 256 * (h), 64); \
        _tile_zero(C); \
        _tile_dpbssd(C, A, B); } while (0)
    if (W == WTYPE_Q6_K) {
        if (b & 1) { TILE_HALF(HALF_C1A, HALF_AA, HALF_BA, 0); TILE_HALF(HALF_C1B, HALF_AB, HALF_BB, 1); }
        else { TILE_HALF(HALF_C0A, HALF_AA, HALF_BA, 0); TILE_HALF(HALF_C0B, HALF_AB, HALF_BB, 1); }
    } else if (b & 1) {
        TILE_BLOCK(TILE_C1, TILE_A1, TILE_B1);
    } else {
        TILE_BLOCK(TILE_C0, TILE_A0, TILE_B0);
    }
#undef TILE_HALF
#undef TILE_BLOCK
}

/* Block b's int32 sums from its tiles C into sums[0] (16 rows of 16; Q6_K: the first half's, and
 * the second half's into sums[1]). */
static inline __attribute__((always_inline)) void store_block(const int32_t W, int64_t b,
                                                              int32_t sums[2][AMX_ROWS][2 * ROWS]) {
    if (W == WTYPE_Q6_K) {
        if (b & 1) { _tile_stored(HALF_C1A, sums[0], 64); _tile_stored(HALF_C1B, sums[1], 64); }
        else { _tile_stored(HALF_C0A, sums[0], 64); _tile_stored(HALF_C0B, sums[1], 64); }
    } else if (b & 1) {
        _tile_stored(TILE_C1, sums[0], 64);
    } else {
        _tile_stored(TILE_C0, sums[0], 64);
    }
}

/* Two passes: x's row pairs q = 255 hi + lo (both within +-127) split again as q = 256 hi + lo
 * (hi within +-127, lo within -128..127: q is within +-32512), for the tiles alone: a pair's
 * sums then combine with a shift and an add instead of a multiply by 255 as three steps, and
 * they are the same integers, so the bits of every other path. Once per matmul: O(M K). */
struct split_job { const int8_t *xq; int64_t K; int8_t *out; };
_Static_assert(SPLIT_BASE == 255, "split_rows_for_tiles multiplies by 255 as (hi << 8) - hi");

static void split_rows_for_tiles(void *ctx, int64_t begin, int64_t end) {
    const struct split_job *job = ctx;
    const int8_t *xq = job->xq;
    const int64_t K = job->K;
    int8_t *out = job->out;
    for (int64_t m = begin; m < end; m++) {
        const int8_t *hi = xq + 2 * m * K, *lo = hi + K;
        int8_t *hi_out = out + 2 * m * K, *lo_out = hi_out + K;
        for (int64_t k = 0; k < K; k += 32) {         /* 32 at a time in int16: q within +-32512 */
            const __m512i hi16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(hi + k)));
            const __m512i q = _mm512_add_epi16(_mm512_sub_epi16(_mm512_slli_epi16(hi16, 8), hi16),
                                               _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(lo + k))));
            const __m512i h = _mm512_srai_epi16(_mm512_add_epi16(q, _mm512_set1_epi16(128)), 8);   /* floor((q + 128) / 256) */
            _mm256_storeu_si256((__m256i *)(hi_out + k), _mm512_cvtepi16_epi8(h));
            _mm256_storeu_si256((__m256i *)(lo_out + k), _mm512_cvtepi16_epi8(_mm512_sub_epi16(q, _mm512_slli_epi16(h, 8))));
        }
    }
}

static void split_for_tiles(const int8_t *xq, int64_t M, int64_t K, int8_t *out) {   /* as quantize_two_pass */
    struct split_job job = {xq, K, out};
    if (M >= 8) ember_parallel_for(M, split_rows_for_tiles, &job);
    else split_rows_for_tiles(&job, 0, M);
}

/* Row r's sums of one set (P = 2: rows r and r + 1, a row pair's 256 hi and lo, combined) */
static inline __m512i row_sums(const int32_t (*sums)[2 * ROWS], int r, const int P) {
    const __m512i sum = _mm512_load_si512(sums[r]);
    return P == 2 ? _mm512_add_epi32(_mm512_slli_epi32(sum, 8), _mm512_load_si512(sums[r + 1])) : sum;
}

/* Block b's sums of R int8 rows (R / P rows of y) into acc, with the 512-bit path's float steps
 * (scale_block16; Q6_K's halves as group_pair_tile_formats takes them). W and P constants. */
static inline __attribute__((always_inline)) void scale_tile_block(
        const int32_t W, int32_t sums[2][AMX_ROWS][2 * ROWS], const struct pair_tiles *t, const struct quantized_x *x,
        int64_t b, const int R, const int P, __m512 *acc) {
    const int64_t nb = x->nb;
    const __m512 dw = _mm512_load_ps(t->dw + 16 * b), mw = _mm512_load_ps(t->mw + 16 * b);
    for (int r = 0; r < R; r += P) {
        const float xd = x->d[r * nb + b], xs = x->s[r * nb + b];
        if (W == WTYPE_Q6_K) {
            const __m512i lo = row_sums((const int32_t (*)[2 * ROWS])sums[0], r, P);
            const __m512i hi = row_sums((const int32_t (*)[2 * ROWS])sums[1], r, P);
            const __m512 fsum = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo), _mm512_load_ps(t->sc + 32 * b)),
                                              _mm512_mul_ps(_mm512_cvtepi32_ps(hi), _mm512_load_ps(t->sc + 32 * b + 16)));
            acc[r / P] = scale_block16(W, acc[r / P], fsum, dw, mw, xd, xs);
            continue;
        }
        const __m512i isum = row_sums((const int32_t (*)[2 * ROWS])sums[0], r, P);
        acc[r / P] = scale_block16(W, acc[r / P], _mm512_cvtepi32_ps(isum), dw, mw, xd, xs);
    }
}

/* The weights of the next pass (the groups whose tiles are built next), asked into L2 a few lines
 * per block while this pass computes: the build then reads them from L2 instead of waiting on
 * DRAM with the tiles idle. Without it a pass's reads and its products took turns: at 8-16 rows
 * of x (batched decode, the LM head) the build waited on DRAM for a large part of the matmul. */
struct prefetch_cursor { const char *next, *end; int lines_per_block; };

static inline void prefetch_some(struct prefetch_cursor *c) {
    for (int i = 0; i < c->lines_per_block && c->next < c->end; i++, c->next += 64)
        _mm_prefetch(c->next, _MM_HINT_T1);
}

/* Up to 16 int8 rows of x (x->q holds 16 readable rows) against a pair whose tiles are built.
 * The tiles compute block b + 1 while the vector units scale block b. W, P and (for full tiles)
 * R constants: the accumulators then stay in registers. */
static inline __attribute__((always_inline)) void pair_tile_amx(
        const int32_t W, const struct pair_tiles *t, const struct quantized_x *x, const int R, const int P,
        struct prefetch_cursor *ahead, float out_a[][ROWS], float out_b[][ROWS]) {
    int32_t sums[2][AMX_ROWS][2 * ROWS] __attribute__((aligned(64)));
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < R / P; r++) acc[r] = _mm512_setzero_ps();
    const int64_t nb = x->nb;
    const int8_t *xq = P == 2 ? x->q_tiles : x->q;
    tile_block(W, t->b, xq, x->K, 0);
    for (int64_t b = 0; b < nb; b++) {
        if (b + 1 < nb) tile_block(W, t->b, xq, x->K, b + 1);
        prefetch_some(ahead);
        store_block(W, b, sums);
        scale_tile_block(W, sums, t, x, b, R, P, acc);
    }
    store_pair_rows(acc, R / P, out_a, out_b);
}

/* The cursor over the next pass's groups [g, min(g1, g + 2 AMX_PAIRS_PER_PASS)), spread over this
 * pass's blocks (its pairs x tiles A x nb). */
static struct prefetch_cursor next_pass(const uint8_t *w, int64_t group_bytes, int64_t g, int64_t g1, int pairs,
                                        int64_t rows, int64_t nb) {
    const int64_t groups = g1 - g < 2 * AMX_PAIRS_PER_PASS ? g1 - g : 2 * AMX_PAIRS_PER_PASS;
    const int64_t bytes = groups > 0 ? groups * group_bytes : 0, lines = (bytes + 63) / 64;
    const int64_t blocks = (int64_t)pairs * ((rows + AMX_ROWS - 1) / AMX_ROWS) * nb;
    const char *start = (const char *)(w + g * group_bytes);
    return (struct prefetch_cursor){start, start + bytes, (int)((lines + blocks - 1) / blocks)};
}

/* Groups [g0, g1) of format W against every row of x, AMX_PAIRS_PER_PASS pairs at a time: their
 * tiles built once for all the tiles A, and each tile A (a 1B layer's: 16 x 2-8 KB) read from the
 * caches once for them all rather than once a pair. W and P (the passes) constants. */
static inline __attribute__((always_inline)) int format_groups_amx(const int32_t W, const int32_t P,
                                                                   const struct matmul_job *j, int64_t g0, int64_t g1) {
    const int64_t nb = j->x.nb, group_bytes = (nb / FORMATS[W].blocks) * record_bytes(W);
    const size_t pair_bytes = (size_t)(nb * (512 + 2 * 64 + 128));
    uint8_t *buffer = aligned_alloc(64, AMX_PAIRS_PER_PASS * pair_bytes);
    if (!buffer) return 0;
    struct pair_tiles t[AMX_PAIRS_PER_PASS];
    for (int p = 0; p < AMX_PAIRS_PER_PASS; p++) {
        uint8_t *at = buffer + p * pair_bytes;
        t[p] = (struct pair_tiles){at, (float *)(at + nb * 512), (float *)(at + nb * 576), (float *)(at + nb * 640)};
    }
    configure_tiles(W == WTYPE_Q6_K ? HALF_BLOCKS : WHOLE_BLOCKS);
    float out[AMX_ROWS][ROWS], out_b[AMX_ROWS][ROWS];
    int64_t g = g0;
    while (g + 1 < g1) {
        int pairs = 0;
        for (; pairs < AMX_PAIRS_PER_PASS && g + 2 * pairs + 1 < g1; pairs++) {
            const uint8_t *ga = j->w + (g + 2 * pairs) * group_bytes;
            build_pair_tiles(ga, ga + group_bytes, W, nb, &t[pairs]);
        }
        struct prefetch_cursor ahead = next_pass(j->w, group_bytes, g + 2 * pairs, g1, pairs, j->rows, nb);
        for (int64_t m = 0; m < j->rows; m += AMX_ROWS) {
            const int R = j->rows - m < AMX_ROWS ? (int)(j->rows - m) : AMX_ROWS;
            const struct quantized_x at = x_from(&j->x, m);
            float *y = j->y + (m / P) * j->ldy;
            for (int p = 0; p < pairs; p++) {
                if (R == AMX_ROWS) pair_tile_amx(W, &t[p], &at, AMX_ROWS, P, &ahead, out, out_b);
                else pair_tile_amx(W, &t[p], &at, R, P, &ahead, out, out_b);
                store_tile(out, R, P, (g + 2 * p) * ROWS, j->N, y, j->ldy);
                store_tile(out_b, R, P, (g + 2 * p + 1) * ROWS, j->N, y, j->ldy);
            }
        }
        g += 2 * pairs;
    }
    free(buffer);
    if (g < g1) groups_against_x(j->w, W, &j->x, j->passes, 0, j->rows, g, g1, j->N, j->y, j->ldy);
    return 1;
}

static int groups_amx(const struct matmul_job *j, int64_t g0, int64_t g1) {
    if (j->passes == 2 && !j->x.q_tiles) return 0;   /* x not split for the tiles: the 512-bit path */
#define AMX(W) (j->passes == 2 ? format_groups_amx(W, 2, j, g0, g1) : format_groups_amx(W, 1, j, g0, g1))
    switch (j->wtype) {
    case WTYPE_Q8_0: return AMX(WTYPE_Q8_0);
    case WTYPE_Q4_1: return AMX(WTYPE_Q4_1);
    case WTYPE_Q4_K: return AMX(WTYPE_Q4_K);
    case WTYPE_Q5_K: return AMX(WTYPE_Q5_K);
    case WTYPE_Q6_K: return AMX(WTYPE_Q6_K);
    case WTYPE_Q5_0: return AMX(WTYPE_Q5_0);
    case WTYPE_Q5_1: return AMX(WTYPE_Q5_1);
    case WTYPE_Q4_0: return AMX(WTYPE_Q4_0);
    default: return 0;
    }
#undef AMX
}
#else
EMBER_EXPORT int ember_amx_ready(void) { return 0; }
#endif

#endif
