/* Paged causal attention over a flattened varlen batch: the host twin of cuda/attention_decode.cu and attention_prefill.cu.
 * NumPy twin and semantics: ember_cupy/ops/attention.py.
 *
 * Sequence s owns queries q[qsl[s]:qsl[s+1]], the last q_len tokens of its context of ctx[s]
 * tokens; query i sits at position ctx - q_len + i and attends keys 0..position (with a sliding
 * window W > 0 only keys position-W+1..position; work items then skip the keys before the
 * window of their first query). K/V rows are
 * read in place from the pages [num_blocks, block_size, Hk, D] through the block table (no
 * gather copy); caches hold float32 or float16 (converted to fp32 a chunk of keys at a time).
 *
 * Work items: (sequence, KV head, query tile of QUERY_TILE queries, key range). One item scores
 * all G query heads of its KV head (x its queries) against each K row and accumulates each V row
 * for all of them, so K/V are read once per KV head and tile. Keys are streamed in chunks of
 * KEY_CHUNK with an online softmax in fp32 (running max, sum and unnormalised output per row).
 * A sequence with a single query tile (decodes, short chunks) is further split into its key
 * parts, one work item each, so that a lone decode sequence still gives every thread work.
 *
 * One reduction order per query, whatever runs with it (determinism across prefix-cache hits
 * and chunked-prefill splits): keys are cut in parts of KEY_SPLIT and chunks of KEY_CHUNK at
 * multiples of those sizes from position 0; each part is an online softmax over its chunks
 * from a fresh state, and a query's parts are merged left to right by merge_rows (the first
 * copied). A split item holds one part, merged by merge_task; an item of a multi-tile
 * sequence walks its parts and merges them as it goes: the same bits either way. Items run on the host kernels' thread pool
 * (cpu/threadpool.h), longest first, each thread claiming the next from a shared counter; the
 * next chunk's K/V rows are prefetched while a chunk is computed (decode is bandwidth-bound).
 *
 * SIMD: with AVX2+FMA (and head_dim a multiple of 8) scores are 8 keys per dot8_rows (an
 * accumulator per key, hadd trees), exp is a vectorised Cephes polynomial, and V rows are
 * accumulated 32 dims at a time; a query's GQA heads are updated ROW_BLOCK at a time, sharing
 * every K and V load (each row's steps are a lone row's); F16C converts f16 pages. The portable
 * path is plain C (expf, 8 partial sums per dot) that any compiler builds.
 *
 * Batch invariance: tiles and key ranges are cut from the sequence's own q_len and context
 * length only, and every output element is computed in the same order whatever else is in the
 * batch or whichever thread runs it.
 */
#include "common.h"
#include "threadpool.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>



#define KEY_CHUNK 32      /* keys scored together: one softmax rescale per row and chunk */
#define QUERY_TILE 16     /* queries per work item of a multi-tile (prefill) sequence */
#define KEY_SPLIT 128     /* keys per work item of a single-tile sequence */
#define MIN_PARALLEL_COST 512   /* row-key pairs below which the calling thread runs it all */
#define SCORE_ROWS 4      /* rows whose chunk scores are held at once (the most any path updates together) */
#define SCORE_STRIDE (KEY_CHUNK + 8)   /* floats per row of scores: a chunk padded to whole vectors */

enum { ATTN_OK = 0, ATTN_BAD_SHAPE = 1, ATTN_BAD_LENGTHS = 2, ATTN_BAD_BLOCK = 3, ATTN_NO_MEMORY = 4 };

typedef struct {
    const float *q;
    int64_t q_stride_t, q_stride_h;          /* elements */
    const void *k_cache, *v_cache;
    int f16;
    int32_t block_size, num_heads, num_kv_heads, head_dim, group;
    const int32_t *tables;
    int64_t table_stride;
    const int32_t *context_lens, *query_start_loc;
    float scale;
    int32_t window;                          /* keys a query sees, itself included; 0 = all */
    float *out;                              /* [T, Hq, D] contiguous */
} Problem;

/* The first key a query at `position` sees. */
static inline int32_t first_visible(int32_t position, int32_t window) {
    return window > 0 && position - window + 1 > 0 ? position - window + 1 : 0;
}

typedef struct {
    int32_t seq, head, q0, nq, nparts;
    int64_t ws;                              /* offset of its partial results (nparts > 1) */
} Task;

typedef struct {
    int32_t task, part, k0, k1;
    int64_t cost;
} Item;

typedef struct {
    float *qs, *acc, *m, *l, *s, *kbuf, *vbuf;
    float *merged_acc, *merged_m, *merged_l;   /* the parts before the current one */
} Scratch;

/* Parts of KEY_SPLIT keys, at multiples of KEY_SPLIT, that the key range [lo, hi) touches. */
static inline int32_t parts_spanned(int32_t lo, int32_t hi) {
    return (hi - 1) / KEY_SPLIT - lo / KEY_SPLIT + 1;
}

/* The end of the chunk of keys that starts at c0 (chunks at multiples of KEY_CHUNK). */
static inline int32_t chunk_end(int32_t c0, int32_t k1) {
    const int32_t end = (c0 / KEY_CHUNK + 1) * KEY_CHUNK;
    return end < k1 ? end : k1;
}

/* (m, l, acc) of R rows += a later part's (pm, pl, pacc): the one merge rule, out of line so
 * that every caller runs the same instructions. */
static __attribute__((noinline)) void merge_rows(float *m, float *l, float *acc, const float *pm, const float *pl,
                                                 const float *pacc, int R, int D) {
    for (int r = 0; r < R; r++) {
        const float m_old = m[r], mp = pm[r], m_new = mp > m_old ? mp : m_old;
        const float alpha = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
        const float beta = mp == -INFINITY ? 0.0f : expf(mp - m_new);
        float *a = acc + (int64_t)r * D;
        const float *b = pacc + (int64_t)r * D;
        for (int d = 0; d < D; d++) a[d] = a[d] * alpha + b[d] * beta;
        l[r] = l[r] * alpha + pl[r] * beta;
        m[r] = m_new;
    }
}

/* The state of the parts so far takes in the part just finished (the first is copied). */
static void fold_part(Scratch *sc, int R, int D, int first) {
    if (first) {
        memcpy(sc->merged_m, sc->m, sizeof(float) * (size_t)R);
        memcpy(sc->merged_l, sc->l, sizeof(float) * (size_t)R);
        memcpy(sc->merged_acc, sc->acc, sizeof(float) * (size_t)R * (size_t)D);
    } else {
        merge_rows(sc->merged_m, sc->merged_l, sc->merged_acc, sc->m, sc->l, sc->acc, R, D);
    }
    for (int r = 0; r < R; r++) { sc->m[r] = -INFINITY; sc->l[r] = 0.0f; }
    memset(sc->acc, 0, sizeof(float) * (size_t)R * (size_t)D);
}

/* ---- non-finite inputs ------------------------------------------------------------------
 * Every path gives the NumPy twin's dense softmax, NaN and inf included: a NaN score (or +inf,
 * through inf - inf) makes its row NaN; a -inf score weighs 0, its V row still multiplied by
 * that 0 (so an inf or NaN there gives NaN); a row whose keys all score -inf is 0/0 = NaN. */

/* What a chunk's scores are shifted by before exp: the running max, or 0 while that is still
 * -inf (every key so far scored -inf: exp(-inf - -inf) would be NaN, where the twin has 0). */
static inline float softmax_shift(float running_max) {
    return running_max == -INFINITY ? 0.0f : running_max;
}

/* ---- vector helpers ------------------------------------------------------------------- */
#if defined(__AVX2__) && defined(__FMA__)
#define ATTN_AVX2 1
#ifdef __AVX512VL__
#define ROW_BLOCK 4       /* query rows updated together (their accumulators: 32 registers) */
#else
#define ROW_BLOCK 2       /* 16 registers */
#endif
_Static_assert(ROW_BLOCK <= SCORE_ROWS, "the scratch holds SCORE_ROWS rows of scores");

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax256(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float dot1(const float *q, const float *k, int D) {
    __m256 a = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a);
    return hsum256(a);
}

/* The scores of nr query rows (q_stride floats apart) against 8 keys, each row's [q.k0, ...,
 * q.k7]: one accumulator per key summed over d in order, reduced by hadd trees of keys 0-3 and
 * 4-7 and one add across their halves. The rows share each K load; the keys go as two halves
 * of 4 so that the accumulators stay in registers (4 rows: 16 of them, in AVX-512VL's 32
 * registers). D a multiple of 8, nr a constant. */
static inline __attribute__((always_inline)) void dot8_rows(const float *q, int64_t q_stride, const float *const *k,
                                                            int D, const int nr, __m256 *out) {
    __m256 h[2][ROW_BLOCK];
    for (int half = 0; half < 2; half++) {
        const float *const *kh = k + 4 * half;
        __m256 a[ROW_BLOCK][4];
        for (int r = 0; r < nr; r++)
            for (int j = 0; j < 4; j++) a[r][j] = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) {
            const __m256 k0 = _mm256_loadu_ps(kh[0] + d), k1 = _mm256_loadu_ps(kh[1] + d);
            const __m256 k2 = _mm256_loadu_ps(kh[2] + d), k3 = _mm256_loadu_ps(kh[3] + d);
            for (int r = 0; r < nr; r++) {
                const __m256 qv = _mm256_loadu_ps(q + r * q_stride + d);
                a[r][0] = _mm256_fmadd_ps(qv, k0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(qv, k1, a[r][1]);
                a[r][2] = _mm256_fmadd_ps(qv, k2, a[r][2]);
                a[r][3] = _mm256_fmadd_ps(qv, k3, a[r][3]);
            }
        }
        for (int r = 0; r < nr; r++)
            h[half][r] = _mm256_hadd_ps(_mm256_hadd_ps(a[r][0], a[r][1]), _mm256_hadd_ps(a[r][2], a[r][3]));
    }
    for (int r = 0; r < nr; r++)
        out[r] = _mm256_add_ps(_mm256_permute2f128_ps(h[0][r], h[1][r], 0x20),
                               _mm256_permute2f128_ps(h[0][r], h[1][r], 0x31));
}

/* acc_r[d0, d0 + 8 nv) = acc_r * alpha_r (when rescale_r) + sum_c p_r[c] * v[c][d0 + ...] for nr
 * rows (acc and p strided): per element the rescale, then one FMA per key in order; the rows
 * share each V load. nr and nv constants. */
static inline __attribute__((always_inline)) void pv_rows(
        float *acc, int64_t acc_stride, const float *p, int64_t p_stride, const float *const *v, int n, int d0,
        const float *alpha, const int *rescale, const int nr, const int nv) {
    __m256 a[ROW_BLOCK][4];
    for (int r = 0; r < nr; r++) {
        const __m256 al = _mm256_set1_ps(alpha[r]);
        for (int i = 0; i < nv; i++) {
            a[r][i] = _mm256_loadu_ps(acc + r * acc_stride + d0 + 8 * i);
            if (rescale[r]) a[r][i] = _mm256_mul_ps(a[r][i], al);
        }
    }
    for (int c = 0; c < n; c++) {
        __m256 vc[4];
        for (int i = 0; i < nv; i++) vc[i] = _mm256_loadu_ps(v[c] + d0 + 8 * i);
        for (int r = 0; r < nr; r++) {
            const __m256 pc = _mm256_set1_ps(p[r * p_stride + c]);
            for (int i = 0; i < nv; i++) a[r][i] = _mm256_fmadd_ps(pc, vc[i], a[r][i]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < nv; i++) _mm256_storeu_ps(acc + r * acc_stride + d0 + 8 * i, a[r][i]);
}

/* exp, except that a NaN stays NaN (ember_exp8 flushes it to 0, which would drop a NaN key). */
static inline __m256 exp8_keeping_nan(__m256 x) {
    return _mm256_blendv_ps(ember_exp8(x), x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

/* One row's online-softmax step over its scores s[0, n) (padded to a multiple of 8 with -inf
 * here): s becomes exp(s - the new running max); m and l move on; alpha and rescale say how
 * the row's output is to be rescaled. */
static void softmax_chunk_avx2(float *s, int n, float *m, float *l, float *alpha, int *rescale) {
    const int padded = (n + 7) & ~7;
    for (int c = n; c < padded; c++) s[c] = -INFINITY;
    __m256 mx = _mm256_loadu_ps(s);
    for (int c = 8; c < padded; c += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + c));
    const float chunk_max = hmax256(mx), m_old = *m;
    const float m_new = chunk_max > m_old ? chunk_max : m_old;
    const __m256 mv = _mm256_set1_ps(softmax_shift(m_new));
    __m256 sum = _mm256_setzero_ps();
    for (int c = 0; c < padded; c += 8) {
        const __m256 p = exp8_keeping_nan(_mm256_sub_ps(_mm256_loadu_ps(s + c), mv));
        _mm256_storeu_ps(s + c, p);
        sum = _mm256_add_ps(sum, p);
    }
    *rescale = m_new != m_old;   /* the running max moved: rescale the sum and output */
    *alpha = !*rescale ? 1.0f : m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
    *l = (*rescale ? *l * *alpha : *l) + hsum256(sum);
    *m = m_new;
}

/* The online-softmax update of nr consecutive rows (q, acc: D floats apart; s: SCORE_STRIDE;
 * they see the same n keys of the chunk) with a row's bits whatever nr: the rows share the K
 * and V rows they read (a GQA group's query heads, the chunk read once for all). D a multiple
 * of 8; nr a constant. */
static inline __attribute__((always_inline)) void rows_chunk_avx2(
        const float *q, float *acc, float *m, float *l, const float *const *k, const float *const *v,
        int n, int D, float *s, const int nr) {
    int c = 0;
    for (; c + 8 <= n; c += 8) {
        __m256 scores[ROW_BLOCK];
        dot8_rows(q, D, k + c, D, nr, scores);
        for (int r = 0; r < nr; r++) _mm256_storeu_ps(s + r * SCORE_STRIDE + c, scores[r]);
    }
    for (; c < n; c++)
        for (int r = 0; r < nr; r++) s[r * SCORE_STRIDE + c] = dot1(q + (int64_t)r * D, k[c], D);
    float alpha[ROW_BLOCK];
    int rescale[ROW_BLOCK];
    for (int r = 0; r < nr; r++) softmax_chunk_avx2(s + r * SCORE_STRIDE, n, m + r, l + r, alpha + r, rescale + r);
    int d0 = 0;
    for (; d0 + 32 <= D; d0 += 32) pv_rows(acc, D, s, SCORE_STRIDE, v, n, d0, alpha, rescale, nr, 4);
    for (; d0 < D; d0 += 8) pv_rows(acc, D, s, SCORE_STRIDE, v, n, d0, alpha, rescale, nr, 1);
}

/* rows_chunk_avx2 for nr = 1..ROW_BLOCK rows, each count compiled with its registers. */
static void group_chunk_avx2(const float *q, float *acc, float *m, float *l, const float *const *k,
                             const float *const *v, int n, int D, float *s, int nr) {
    switch (nr) {
    case 1: rows_chunk_avx2(q, acc, m, l, k, v, n, D, s, 1); break;
#if ROW_BLOCK >= 2
    case 2: rows_chunk_avx2(q, acc, m, l, k, v, n, D, s, 2); break;
#endif
#if ROW_BLOCK >= 4
    case 3: rows_chunk_avx2(q, acc, m, l, k, v, n, D, s, 3); break;
    case 4: rows_chunk_avx2(q, acc, m, l, k, v, n, D, s, 4); break;
#endif
    }
}
#endif

#if defined(EMBER_NEON) && !defined(ATTN_AVX2)
/* ---- NEON: rows_chunk_avx2's arithmetic per row, op for op, on pairs of 4-lane registers ----
 * Eight 256-bit lanes are (lo, hi); _mm256_max_ps's rule (a > b ? a : b, so a NaN in the first
 * operand is dropped) is x86_max; hadd trees and hsum256 are written out in their order. The
 * ARM paths therefore give the x86 AVX2 path's bits (tests/test_host_aarch64.py). */
#define ATTN_NEON 1

typedef struct { float32x4_t lo, hi; } f32x8;

static inline float32x4_t x86_max(float32x4_t a, float32x4_t b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
static inline float x86_max1(float a, float b) { return a > b ? a : b; }

static inline float hsum8(f32x8 v) {     /* hsum256: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) */
    const float32x4_t t = vaddq_f32(v.lo, v.hi);
    return (vgetq_lane_f32(t, 0) + vgetq_lane_f32(t, 2)) + (vgetq_lane_f32(t, 1) + vgetq_lane_f32(t, 3));
}

static inline float hmax8(f32x8 v) {     /* hmax256, with _mm_max_ps's operand order */
    const float32x4_t t = x86_max(v.lo, v.hi);
    const float s0 = x86_max1(vgetq_lane_f32(t, 0), vgetq_lane_f32(t, 2));
    const float s1 = x86_max1(vgetq_lane_f32(t, 1), vgetq_lane_f32(t, 3));
    return x86_max1(s0, s1);
}

static inline f32x8 dot_lanes(const float *q, const float *k, int D) {   /* FMA per lane, d % 8 */
    f32x8 a = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
    for (int d = 0; d < D; d += 8) {
        a.lo = vfmaq_f32(a.lo, vld1q_f32(q + d), vld1q_f32(k + d));
        a.hi = vfmaq_f32(a.hi, vld1q_f32(q + d + 4), vld1q_f32(k + d + 4));
    }
    return a;
}

/* dot8_rows's score of one key: the hadd tree gives ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)). */
static inline float dot8_one(const float *q, const float *k, int D) {
    const f32x8 a = dot_lanes(q, k, D);
    const float32x4_t pairs = vpaddq_f32(a.lo, a.hi);
    const float32x4_t quads = vpaddq_f32(pairs, pairs);
    return vgetq_lane_f32(quads, 0) + vgetq_lane_f32(quads, 1);
}

static inline float32x4_t exp4_keeping_nan(float32x4_t x) {
    return vbslq_f32(vceqq_f32(x, x), ember_exp4(x), x);
}

static void row_chunk_neon(const float *q, float *acc, float *m, float *l, const float *const *k,
                           const float *const *v, int n, int D, float *s) {
    const int whole = n - n % 8;         /* dot8_rows for whole eights of keys, dot1 for the rest */
    for (int i = 0; i < whole; i++) s[i] = dot8_one(q, k[i], D);
    for (int i = whole; i < n; i++) s[i] = hsum8(dot_lanes(q, k[i], D));
    const int padded = (n + 7) & ~7;
    for (int i = n; i < padded; i++) s[i] = -INFINITY;
    f32x8 mx = {vld1q_f32(s), vld1q_f32(s + 4)};
    for (int i = 8; i < padded; i += 8) {
        mx.lo = x86_max(mx.lo, vld1q_f32(s + i));
        mx.hi = x86_max(mx.hi, vld1q_f32(s + i + 4));
    }
    const float chunk_max = hmax8(mx), m_old = *m;
    const float m_new = chunk_max > m_old ? chunk_max : m_old;
    const float32x4_t mv = vdupq_n_f32(softmax_shift(m_new));
    f32x8 sum = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
    for (int i = 0; i < padded; i += 8) {
        const float32x4_t p0 = exp4_keeping_nan(vsubq_f32(vld1q_f32(s + i), mv));
        const float32x4_t p1 = exp4_keeping_nan(vsubq_f32(vld1q_f32(s + i + 4), mv));
        vst1q_f32(s + i, p0);
        vst1q_f32(s + i + 4, p1);
        sum.lo = vaddq_f32(sum.lo, p0);
        sum.hi = vaddq_f32(sum.hi, p1);
    }
    const int rescale = m_new != m_old;
    const float alpha = !rescale ? 1.0f : m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
    *l = (rescale ? *l * alpha : *l) + hsum8(sum);
    *m = m_new;
    const float32x4_t al = vdupq_n_f32(alpha);
    for (int d = 0; d < D; d += 4) {    /* pv_rows per element: rescale, then one FMA per key */
        float32x4_t a = vld1q_f32(acc + d);
        if (rescale) a = vmulq_f32(a, al);
        for (int i = 0; i < n; i++) a = vfmaq_f32(a, vdupq_n_f32(s[i]), vld1q_f32(v[i] + d));
        vst1q_f32(acc + d, a);
    }
}
#endif

/* ---- portable path (any compiler; also head_dim not a multiple of 8) ------------------- */
static inline float dot_scalar(const float *q, const float *k, int D) {
    float p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int d = 0;
    for (; d + 8 <= D; d += 8)
        for (int j = 0; j < 8; j++) p[j] += q[d + j] * k[d + j];
    float sum = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
    for (; d < D; d++) sum += q[d] * k[d];
    return sum;
}

static void row_chunk_scalar(const float *q, float *acc, float *m, float *l, const float *const *k,
                             const float *const *v, int n, int D, float *s) {
    float chunk_max = -INFINITY;
    for (int c = 0; c < n; c++) {
        s[c] = dot_scalar(q, k[c], D);
        chunk_max = s[c] > chunk_max ? s[c] : chunk_max;
    }
    const float m_old = *m, m_new = chunk_max > m_old ? chunk_max : m_old, shift = softmax_shift(m_new);
    float sum = 0.0f;
    for (int c = 0; c < n; c++) {
        s[c] = expf(s[c] - shift);
        sum += s[c];
    }
    if (m_new != m_old) {
        const float alpha = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
        *l *= alpha;
        for (int d = 0; d < D; d++) acc[d] *= alpha;
    }
    *l += sum;
    *m = m_new;
    for (int c = 0; c < n; c++) {
        const float p = s[c], *vc = v[c];
        for (int d = 0; d < D; d++) acc[d] += p * vc[d];
    }
}

static void to_f32(float *dst, const uint16_t *src, int D) {
    int d = 0;
#if defined(__F16C__) && defined(__AVX2__)
    for (; d + 8 <= D; d += 8)
        _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + d))));
#endif
    for (; d < D; d++) dst[d] = ember_f16_to_f32(src[d]);
}

/* ---- one work item ---------------------------------------------------------------------- */
/* The task's output rows: acc / l. */
static void write_rows(const Problem *P, const Task *t, const float *acc, const float *l) {
    const int G = P->group, D = P->head_dim;
    const int32_t q_begin = P->query_start_loc[t->seq];
    for (int qi = 0; qi < t->nq; qi++)
        for (int g = 0; g < G; g++) {
            const int r = qi * G + g;
            float *dst = P->out + ((int64_t)(q_begin + t->q0 + qi) * P->num_heads + t->head * G + g) * D;
            const float *a = acc + (int64_t)r * D;
            for (int d = 0; d < D; d++) dst[d] = a[d] / l[r];
        }
}

static void run_item(const Problem *P, const Task *t, const Item *it, Scratch *sc, float *ws) {
    const int G = P->group, D = P->head_dim, Hk = P->num_kv_heads, bs = P->block_size;
    const int R = t->nq * G, seq = t->seq, head = t->head;
    const int32_t q_begin = P->query_start_loc[seq], q_len = P->query_start_loc[seq + 1] - q_begin;
    const int32_t first = P->context_lens[seq] - q_len;     /* position of the sequence's query 0 */
    const int32_t *table = P->tables + (int64_t)seq * P->table_stride;
    for (int qi = 0; qi < t->nq; qi++)
        for (int g = 0; g < G; g++) {
            const float *src = P->q + (int64_t)(q_begin + t->q0 + qi) * P->q_stride_t
                               + (int64_t)(head * G + g) * P->q_stride_h;
            float *dst = sc->qs + (int64_t)(qi * G + g) * D;
            for (int d = 0; d < D; d++) dst[d] = src[d] * P->scale;
        }
    for (int r = 0; r < R; r++) { sc->m[r] = -INFINITY; sc->l[r] = 0.0f; }
    memset(sc->acc, 0, sizeof(float) * (size_t)R * (size_t)D);
#if defined(ATTN_AVX2) || defined(ATTN_NEON)
    const int vector = D % 8 == 0;
#endif
    const float *krow[KEY_CHUNK], *vrow[KEY_CHUNK];
    int64_t rows[KEY_CHUNK], next[KEY_CHUNK];   /* element offsets of this and the next chunk's keys */
    const size_t elem = P->f16 ? 2 : 4;
    int32_t block = it->k0 / bs, offset = it->k0 % bs;   /* of the next key to locate */
    const int nk0 = chunk_end(it->k0, it->k1) - it->k0;
    for (int c = 0; c < nk0; c++) {
        next[c] = (((int64_t)table[block] * bs + offset) * Hk + head) * D;
        if (++offset == bs) { offset = 0; block++; }
    }
    int parts_done = 0;
    for (int32_t c0 = it->k0, nk; c0 < it->k1; c0 += nk) {
        nk = chunk_end(c0, it->k1) - c0;
        if (c0 % KEY_SPLIT == 0 && c0 > it->k0) fold_part(sc, R, D, parts_done++ == 0);
        memcpy(rows, next, sizeof(int64_t) * (size_t)nk);
        /* locate the next chunk's keys and prefetch them while this chunk is computed */
        const int32_t n1 = c0 + nk < it->k1 ? chunk_end(c0 + nk, it->k1) - (c0 + nk) : 0;
        for (int c = 0; c < n1; c++) {
            next[c] = (((int64_t)table[block] * bs + offset) * Hk + head) * D;
            if (++offset == bs) { offset = 0; block++; }
            const char *kp = (const char *)P->k_cache + next[c] * elem, *vp = (const char *)P->v_cache + next[c] * elem;
            for (size_t b = 0; b < (size_t)D * elem; b += 64) {
                __builtin_prefetch(kp + b);
                __builtin_prefetch(vp + b);
            }
        }
        for (int c = 0; c < nk; c++) {
            const int64_t row = rows[c];
            if (P->f16) {
                to_f32(sc->kbuf + c * D, (const uint16_t *)P->k_cache + row, D);
                to_f32(sc->vbuf + c * D, (const uint16_t *)P->v_cache + row, D);
                krow[c] = sc->kbuf + c * D;
                vrow[c] = sc->vbuf + c * D;
            } else {
                krow[c] = (const float *)P->k_cache + row;
                vrow[c] = (const float *)P->v_cache + row;
            }
        }
        for (int qi = 0; qi < t->nq; qi++) {
            const int32_t position = first + t->q0 + qi;
            const int32_t visible = position + 1 - c0;   /* keys of the chunk up to the query */
            const int32_t before = first_visible(position, P->window) - c0;   /* keys before its window */
            const int skip = before > 0 ? before : 0;
            const int n = (visible < nk ? visible : nk) - skip;
            if (n <= 0) continue;
#ifdef ATTN_AVX2
            if (vector) {   /* the query's G heads see the same keys: ROW_BLOCK of them at a time */
                for (int g = 0; g < G; g += ROW_BLOCK) {
                    const int r = qi * G + g, nr = G - g < ROW_BLOCK ? G - g : ROW_BLOCK;
                    group_chunk_avx2(sc->qs + (int64_t)r * D, sc->acc + (int64_t)r * D, sc->m + r, sc->l + r,
                                     krow + skip, vrow + skip, n, D, sc->s, nr);
                }
                continue;
            }
#endif
            for (int g = 0; g < G; g++) {
                const int r = qi * G + g;
#if defined(ATTN_NEON)
                if (vector) {
                    row_chunk_neon(sc->qs + (int64_t)r * D, sc->acc + (int64_t)r * D, sc->m + r, sc->l + r,
                                   krow + skip, vrow + skip, n, D, sc->s);
                    continue;
                }
#endif
                row_chunk_scalar(sc->qs + (int64_t)r * D, sc->acc + (int64_t)r * D, sc->m + r, sc->l + r,
                                 krow + skip, vrow + skip, n, D, sc->s);
            }
        }
    }
    const float *acc = sc->acc, *l = sc->l, *m = sc->m;
    if (parts_done) {
        fold_part(sc, R, D, 0);
        acc = sc->merged_acc, l = sc->merged_l, m = sc->merged_m;
    }
    if (t->nparts == 1) {   /* every row's own key is in range: l > 0 */
        write_rows(P, t, acc, l);
        return;
    }
    float *part = ws + t->ws + (int64_t)it->part * R * (D + 2);
    memcpy(part, m, sizeof(float) * (size_t)R);
    memcpy(part + R, l, sizeof(float) * (size_t)R);
    memcpy(part + 2 * R, acc, sizeof(float) * (size_t)R * (size_t)D);
}

/* Partial results of a split task, merged left to right into the first part's. */
static void merge_task(const Problem *P, const Task *t, float *ws) {
    const int D = P->head_dim, R = t->nq * P->group;
    const int64_t stride = (int64_t)R * (D + 2);
    float *first = ws + t->ws;
    for (int p = 1; p < t->nparts; p++) {
        const float *part = first + p * stride;
        merge_rows(first, first + R, first + 2 * R, part, part + R, part + 2 * R, R, D);
    }
    write_rows(P, t, first + 2 * R, first + R);
}

static int by_cost_descending(const void *a, const void *b) {
    const Item *x = a, *y = b;
    if (x->cost != y->cost) return x->cost > y->cost ? -1 : 1;
    return x->task != y->task ? (x->task < y->task ? -1 : 1) : (x->part < y->part ? -1 : x->part > y->part);
}

/* The pool runs one range per thread; each thread claims items (then tasks to merge) in order
 * from a shared counter, so long items do not leave the other threads idle. */
typedef struct {
    const Problem *P;
    const Task *tasks;
    const Item *items;
    int64_t num_items, num_tasks;
    float *ws, *scratch;
    int64_t scratch_floats, rows;
    atomic_int_fast64_t next;
} Job;

static void run_items(void *ctx, int64_t begin, int64_t end) {
    Job *job = ctx;
    (void)end;
    const int64_t rows = job->rows, D = job->P->head_dim;
    float *base = job->scratch + job->scratch_floats * begin;   /* begin: this thread's slot */
    float *kbuf = base + 2 * rows * D + 2 * rows + SCORE_ROWS * SCORE_STRIDE, *merged = kbuf + 2 * KEY_CHUNK * D;
    Scratch sc = {base, base + rows * D, base + 2 * rows * D, base + 2 * rows * D + rows,
                  base + 2 * rows * D + 2 * rows, kbuf, kbuf + KEY_CHUNK * D,
                  merged, merged + rows * D, merged + rows * D + rows};
    for (int64_t i; (i = atomic_fetch_add(&job->next, 1)) < job->num_items;)
        run_item(job->P, &job->tasks[job->items[i].task], &job->items[i], &sc, job->ws);
}

static void run_merges(void *ctx, int64_t begin, int64_t end) {
    Job *job = ctx;
    (void)begin;
    (void)end;
    for (int64_t t; (t = atomic_fetch_add(&job->next, 1)) < job->num_tasks;)
        if (job->tasks[t].nparts > 1) merge_task(job->P, &job->tasks[t], job->ws);
}

/* out [T, Hq, D] float32 (contiguous); q [T, Hq, D] float32 with strides (in elements)
 * q_stride_t, q_stride_h and a contiguous last axis; caches [num_blocks, block_size, Hk, D]
 * contiguous, float32 (cache_f16 = 0) or float16 (1); block_tables [num_seqs, max_blocks] int32
 * with row stride table_stride; context_lens [num_seqs], query_start_loc [num_seqs + 1] int32;
 * window: keys a query sees, itself included (0 = all).
 * Returns 0, or: 1 bad shape, 2 bad lengths, 3 a block id out of range, 4 out of memory. */
EMBER_EXPORT int ember_paged_attention_window(
        float *out, const float *q, int64_t q_stride_t, int64_t q_stride_h,
        const void *k_cache, const void *v_cache, int32_t cache_f16, int64_t num_blocks,
        int32_t block_size, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
        const int32_t *block_tables, int64_t table_stride, int32_t max_blocks,
        const int32_t *context_lens, const int32_t *query_start_loc, int32_t num_seqs, float scale,
        int32_t window) {
    if (num_heads <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads || head_dim <= 0 ||
        block_size <= 0 || num_seqs < 0 || max_blocks < 0 || window < 0)
        return ATTN_BAD_SHAPE;
    const int G = num_heads / num_kv_heads, D = head_dim;
    /* pass 1: validate, count tasks, items and partial-result floats */
    int64_t num_tasks = 0, num_items = 0, ws_floats = 0;
    for (int32_t s = 0; s < num_seqs; s++) {
        const int32_t q_len = query_start_loc[s + 1] - query_start_loc[s], ctx = context_lens[s];
        if (q_len < 0 || query_start_loc[s] < 0) return ATTN_BAD_LENGTHS;
        if (q_len == 0) continue;
        if (ctx < q_len || (int64_t)ctx > (int64_t)max_blocks * block_size) return ATTN_BAD_LENGTHS;
        const int32_t *table = block_tables + (int64_t)s * table_stride;
        for (int32_t b = 0; b < (ctx + block_size - 1) / block_size; b++)
            if (table[b] < 0 || table[b] >= num_blocks) return ATTN_BAD_BLOCK;
        const int32_t tiles = (q_len + QUERY_TILE - 1) / QUERY_TILE;
        num_tasks += (int64_t)tiles * num_kv_heads;
        if (tiles == 1) {
            const int32_t parts = parts_spanned(first_visible(ctx - q_len, window), ctx);
            num_items += (int64_t)parts * num_kv_heads;
            if (parts > 1) ws_floats += (int64_t)num_kv_heads * parts * q_len * G * (D + 2);
        } else {
            num_items += (int64_t)tiles * num_kv_heads;
        }
    }
    if (!num_items) return ATTN_OK;
    Task *tasks = malloc(sizeof(Task) * (size_t)num_tasks);
    Item *items = malloc(sizeof(Item) * (size_t)num_items);
    float *ws = ws_floats ? malloc(sizeof(float) * (size_t)ws_floats) : NULL;
    int threads = ember_max_threads();
    if (threads > num_items) threads = (int)num_items;
    const int64_t rows = (int64_t)QUERY_TILE * G;
    const int64_t scratch_floats = 3 * rows * D + 4 * rows + SCORE_ROWS * SCORE_STRIDE + 2 * (int64_t)KEY_CHUNK * D;
    float *scratch = malloc(sizeof(float) * (size_t)(scratch_floats * threads));
    if (!tasks || !items || (ws_floats && !ws) || !scratch) {
        free(tasks); free(items); free(ws); free(scratch);
        return ATTN_NO_MEMORY;
    }
    /* pass 2: the tasks and items */
    int64_t ti = 0, ii = 0, wo = 0;
    for (int32_t s = 0; s < num_seqs; s++) {
        const int32_t q_len = query_start_loc[s + 1] - query_start_loc[s], ctx = context_lens[s];
        if (q_len == 0) continue;
        const int32_t tiles = (q_len + QUERY_TILE - 1) / QUERY_TILE;
        for (int32_t tile = 0; tile < tiles; tile++)
            for (int32_t h = 0; h < num_kv_heads; h++) {
                Task *t = &tasks[ti];
                t->seq = s; t->head = h; t->q0 = tile * QUERY_TILE;
                t->nq = q_len - t->q0 < QUERY_TILE ? q_len - t->q0 : QUERY_TILE;
                const int32_t visible = ctx - q_len + t->q0 + t->nq;   /* keys up to its last query */
                const int32_t lo = first_visible(ctx - q_len + t->q0, window);   /* its first query's first */
                t->nparts = tiles == 1 ? parts_spanned(lo, visible) : 1;
                t->ws = wo;
                if (t->nparts > 1) wo += (int64_t)t->nparts * t->nq * G * (D + 2);
                for (int32_t p = 0; p < t->nparts; p++) {
                    Item *it = &items[ii++];
                    it->task = (int32_t)ti; it->part = p;
                    const int32_t start = (lo / KEY_SPLIT + p) * KEY_SPLIT, stop = start + KEY_SPLIT;
                    it->k0 = t->nparts == 1 || start < lo ? lo : start;
                    it->k1 = t->nparts == 1 || stop > visible ? visible : stop;
                    it->cost = (int64_t)(it->k1 - it->k0) * t->nq;
                }
                ti++;
            }
    }
    qsort(items, (size_t)num_items, sizeof(Item), by_cost_descending);   /* longest first */
    int64_t total_cost = 0;
    for (int64_t i = 0; i < num_items; i++) total_cost += items[i].cost * G;
    if (total_cost < MIN_PARALLEL_COST) threads = 1;   /* the fork would cost more than it saves */
    const Problem P = {q, q_stride_t, q_stride_h, k_cache, v_cache, cache_f16 != 0, block_size, num_heads,
                       num_kv_heads, head_dim, G, block_tables, table_stride, context_lens, query_start_loc,
                       scale, window, out};
    Job job = {&P, tasks, items, num_items, num_tasks, ws, scratch, scratch_floats, rows, 0};
    if (threads > 1) ember_parallel_for(threads, run_items, &job);
    else run_items(&job, 0, 1);
    if (ws_floats) {
        atomic_store(&job.next, 0);
        if (threads > 1) ember_parallel_for(threads, run_merges, &job);
        else run_merges(&job, 0, 1);
    }
    free(tasks); free(items); free(ws); free(scratch);
    return ATTN_OK;
}

/* Full causal attention (no window): the entry cpu/layer.c calls. */
EMBER_EXPORT int ember_paged_attention(
        float *out, const float *q, int64_t q_stride_t, int64_t q_stride_h,
        const void *k_cache, const void *v_cache, int32_t cache_f16, int64_t num_blocks,
        int32_t block_size, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
        const int32_t *block_tables, int64_t table_stride, int32_t max_blocks,
        const int32_t *context_lens, const int32_t *query_start_loc, int32_t num_seqs, float scale) {
    return ember_paged_attention_window(out, q, q_stride_t, q_stride_h, k_cache, v_cache, cache_f16,
                                        num_blocks, block_size, num_heads, num_kv_heads, head_dim,
                                        block_tables, table_stride, max_blocks, context_lens,
                                        query_start_loc, num_seqs, scale, 0);
}
