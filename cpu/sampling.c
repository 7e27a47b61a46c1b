/* Per-row k-th largest logit (the top-k threshold of the sampler), in one pass over the row with
 * a min-heap of the k largest values so far. NumPy twin: ember_cupy/engine/sampler.py
 * (kth_largest_numpy: np.partition). Per-row argmax (the greedy rows' tokens). Rows are split
 * over the thread pool. */
#include "common.h"
#include "threadpool.h"

#include <stdlib.h>

static void sift_down(float *heap, int64_t size, int64_t i) {
    for (;;) {
        int64_t smallest = i, left = 2 * i + 1, right = left + 1;
        if (left < size && heap[left] < heap[smallest]) smallest = left;
        if (right < size && heap[right] < heap[smallest]) smallest = right;
        if (smallest == i) return;
        float t = heap[i]; heap[i] = heap[smallest]; heap[smallest] = t;
        i = smallest;
    }
}

static float kth_largest(const float *row, int64_t vocab, int64_t k, float *heap) {
    for (int64_t i = 0; i < k; i++) heap[i] = row[i];
    for (int64_t i = k / 2 - 1; i >= 0; i--) sift_down(heap, k, i);
    int64_t i = k;
#if defined(__AVX2__)
    /* most blocks of 8 hold nothing above the heap's minimum: test them with one compare */
    for (; i + 8 <= vocab; i += 8) {
        const __m256 v = _mm256_loadu_ps(row + i);
        if (!_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(heap[0]), _CMP_GT_OQ))) continue;
        for (int64_t j = i; j < i + 8; j++)
            if (row[j] > heap[0]) { heap[0] = row[j]; sift_down(heap, k, 0); }
    }
#elif defined(EMBER_NEON)
    for (; i + 8 <= vocab; i += 8) {     /* the same skip: a block with nothing above the minimum */
        const float32x4_t least = vdupq_n_f32(heap[0]);
        const uint32x4_t above = vorrq_u32(vcgtq_f32(vld1q_f32(row + i), least),
                                           vcgtq_f32(vld1q_f32(row + i + 4), least));
        if (!vmaxvq_u32(above)) continue;
        for (int64_t j = i; j < i + 8; j++)
            if (row[j] > heap[0]) { heap[0] = row[j]; sift_down(heap, k, 0); }
    }
#endif
    for (; i < vocab; i++)
        if (row[i] > heap[0]) { heap[0] = row[i]; sift_down(heap, k, 0); }
    return heap[0];
}

struct kth_job { const float *x; int64_t vocab, ld; const int64_t *k; float *out; int failed; };

static void kth_rows(void *ctx, int64_t begin, int64_t end) {
    struct kth_job *j = ctx;
    int64_t most = 1;
    for (int64_t r = begin; r < end; r++) most = j->k[r] > most ? j->k[r] : most;
    float *heap = malloc(sizeof(float) * (size_t)most);
    if (!heap) { j->failed = 1; return; }
    for (int64_t r = begin; r < end; r++) j->out[r] = kth_largest(j->x + r * j->ld, j->vocab, j->k[r], heap);
    free(heap);
}

/* out[r] = the k[r]-th largest of x[r, :vocab] (1 <= k[r] <= vocab). 0, or -1 on a bad k, -2 OOM. */
EMBER_EXPORT int ember_kth_largest(const float *x, int64_t rows, int64_t vocab, int64_t ld,
                                   const int64_t *k, float *out) {
    for (int64_t r = 0; r < rows; r++)
        if (k[r] < 1 || k[r] > vocab) return -1;
    struct kth_job job = {x, vocab, ld, k, out, 0};
    if (rows >= 2) ember_parallel_for(rows, kth_rows, &job);
    else kth_rows(&job, 0, rows);
    return job.failed ? -2 : 0;
}

/* The first index of the row's largest value, NaN never winning; 0 when no value is above -inf
 * (as the twin, which takes NaN for -inf). A selection, no arithmetic: the same on every path. */
static int32_t row_argmax(const float *row, int64_t vocab) {
    float best = -__builtin_inff();
    int64_t at = -1, i = 0;
#if defined(__AVX512F__)
    if (vocab >= 16) {    /* per lane the first index of its largest value, then the lowest such index */
        __m512 most = _mm512_set1_ps(best);
        __m512i index = _mm512_set1_epi32(-1);
        __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (; i + 16 <= vocab; i += 16) {
            const __m512 v = _mm512_loadu_ps(row + i);
            const __mmask16 above = _mm512_cmp_ps_mask(v, most, _CMP_GT_OQ);   /* false for NaN */
            most = _mm512_mask_mov_ps(most, above, v);
            index = _mm512_mask_mov_epi32(index, above, lane);
            lane = _mm512_add_epi32(lane, _mm512_set1_epi32(16));
        }
        best = _mm512_reduce_max_ps(most);
        if (best > -__builtin_inff())
            at = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(most, _mm512_set1_ps(best), _CMP_EQ_OQ), index);
    }
#endif
    for (; i < vocab; i++)
        if (row[i] > best) { best = row[i]; at = i; }
    return at < 0 ? 0 : (int32_t)at;
}

struct argmax_job { const float *x; int64_t vocab, ld; int32_t *out; };

static void argmax_rows(void *ctx, int64_t begin, int64_t end) {
    const struct argmax_job *j = ctx;
    for (int64_t r = begin; r < end; r++) j->out[r] = row_argmax(j->x + r * j->ld, j->vocab);
}

/* out[r] = the greedy token of x[r, :vocab] (row_argmax). NumPy twin: ember_cupy/engine/sampler.py
 * (argmax_ignoring_nan_numpy). */
EMBER_EXPORT void ember_argmax_rows(const float *x, int64_t rows, int64_t vocab, int64_t ld, int32_t *out) {
    struct argmax_job job = {x, vocab, ld, out};
    if (rows >= 2) ember_parallel_for(rows, argmax_rows, &job);
    else argmax_rows(&job, 0, rows);
}

/* Token bitmask (llguidance's layout: token t allowed when bit t % 32 of word t / 32 is set):
 * x[rows[i], t] = -inf for every t < vocab not allowed by mask[i] (tokens past the mask's
 * words * 32 are not allowed). In place. NumPy twin: ember_cupy/structured/bitmask.py
 * (apply_token_bitmask_numpy). 0, or -1 on a bad row index. */
EMBER_EXPORT int ember_apply_token_bitmask(float *x, int64_t num_logit_rows, int64_t vocab, int64_t ld,
                                           const int32_t *mask, int64_t words, const int32_t *rows,
                                           int64_t num_rows) {
    for (int64_t i = 0; i < num_rows; i++)
        if (rows[i] < 0 || rows[i] >= num_logit_rows) return -1;
    const float minus_inf = -__builtin_inff();
    for (int64_t i = 0; i < num_rows; i++) {
        float *row = x + rows[i] * ld;
        const uint32_t *bits = (const uint32_t *)(mask + i * words);
        const int64_t covered = words * 32 < vocab ? words * 32 : vocab;
        int64_t w = 0;
        for (; (w + 1) * 32 <= covered; w++) {          /* whole words */
            float *out = row + w * 32;
            if (bits[w] == 0) {                          /* the common case under a grammar */
                for (int k = 0; k < 32; k++) out[k] = minus_inf;
                continue;
            }
            for (uint32_t clear = ~bits[w]; clear; clear &= clear - 1) out[__builtin_ctz(clear)] = minus_inf;
        }
        for (int64_t t = w * 32; t < covered; t++)       /* a last, partial word */
            if (!((bits[w] >> (t - w * 32)) & 1u)) row[t] = minus_inf;
        for (int64_t t = covered; t < vocab; t++) row[t] = minus_inf;
    }
    return 0;
}
