/* One Llama decoder layer as a single call, composed from the other host kernels (the NumPy
 * twin is LlamaModel's op-by-op forward, ember_cupy/model/llama.py). At one token per step a
 * layer is ten small kernels; calling each from Python cost more than computing it.
 *   x = rmsnorm(hidden) (first layer) | fused_add_rmsnorm(hidden, residual)
 *   qkv = x @ Wqkv (+ bias); rope(q, k); write k, v into the pages; a = attention(q)
 *   h = a @ Wo; x = fused_add_rmsnorm(h, residual); hidden = silu_mul(x @ Wgate_up) @ Wdown
 */
#include "common.h"
#include "matmul_q.h"

#include <stdlib.h>

void ember_rms_norm(const float *x, int64_t ldx, const float *w, float *out, int64_t ldo, int64_t rows,
                    int64_t hidden, float eps);
void ember_fused_add_rms_norm(float *x, int64_t ldx, float *residual, int64_t ldr, const float *w,
                              int64_t rows, int64_t hidden, float eps);
void ember_silu_and_mul(const float *gate_up, int64_t ldg, float *out, int64_t ldo, int64_t rows, int64_t inter);
void ember_rope(float *q, int64_t qs0, int64_t qs1, int32_t hq, float *k, int64_t ks0, int64_t ks1, int32_t hk,
                int32_t dim, const int32_t *positions, const float *cos_sin, int32_t neox, int64_t tokens);
int ember_paged_attention(float *out, const float *q, int64_t q_stride_t, int64_t q_stride_h,
                          const void *k_cache, const void *v_cache, int32_t cache_f16, int64_t num_blocks,
                          int32_t block_size, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                          const int32_t *block_tables, int64_t table_stride, int32_t max_blocks,
                          const int32_t *context_lens, const int32_t *query_start_loc, int32_t num_seqs,
                          float scale);

typedef struct {              /* fixed per layer (ember_cupy/ops/layer.py: LayerWeightsArgs) */
    const float *attn_norm, *ffn_norm, *qkv_bias;   /* qkv_bias may be NULL */
    const EmberWeightPart *qkv, *o, *gate_up, *down;   /* each its parts' formats (cpu/matmul_q.h) */
    int32_t qkv_parts, o_parts, gate_up_parts, down_parts;
    void *k_cache, *v_cache;                        /* [blocks, block_size, kv_heads, head_dim] */
} LayerWeights;

typedef struct {              /* per step (ember_cupy/ops/layer.py: StepArgs) */
    int64_t tokens, hidden, inter;
    int32_t heads, kv_heads, head_dim, passes, neox, cache_f16, block_size, num_seqs, max_blocks;
    int64_t num_blocks, table_stride;
    float eps, scale, second_pass_threshold;
    const int32_t *positions, *slot_mapping, *block_tables, *context_lens, *query_start_loc;
    const float *cos_sin;
} StepArgs;

static void write_kv(const StepArgs *s, const LayerWeights *w, const float *qkv, int64_t ld, int64_t q_size) {
    const int64_t row = (int64_t)s->kv_heads * s->head_dim, kv_size = row;
    for (int64_t t = 0; t < s->tokens; t++) {
        const int32_t slot = s->slot_mapping[t];
        if (slot < 0) continue;
        const float *k = qkv + t * ld + q_size, *v = k + kv_size;
        if (s->cache_f16) {
            uint16_t *kc = (uint16_t *)w->k_cache + (int64_t)slot * row, *vc = (uint16_t *)w->v_cache + (int64_t)slot * row;
            for (int64_t i = 0; i < row; i++) { kc[i] = ember_f32_to_f16(k[i]); vc[i] = ember_f32_to_f16(v[i]); }
        } else {
            memcpy((float *)w->k_cache + (int64_t)slot * row, k, sizeof(float) * (size_t)row);
            memcpy((float *)w->v_cache + (int64_t)slot * row, v, sizeof(float) * (size_t)row);
        }
    }
}

/* y [T, N] = x [T, K] @ W^T with the step's activation passes; 0, or 10 + the matmul's status. */
static int matmul(const StepArgs *s, const float *x, int64_t K, const EmberWeightPart *w, int32_t parts, int64_t N,
                  float *y) {
    const int status = ember_matmul_parts(x, s->tokens, K, K, w, parts, y, N, s->passes, s->second_pass_threshold);
    return status ? 10 + status : 0;
}

/* hidden [T, H] in/out; residual [T, H] in/out (written from hidden when first != 0).
 * Returns 0, or the first failing kernel's status (matmul: 10 + its code; attention: 20 + code). */
EMBER_EXPORT int ember_llama_layer(const LayerWeights *w, const StepArgs *s, float *hidden, float *residual,
                                   int32_t first) {
    const int64_t T = s->tokens, H = s->hidden, I = s->inter, D = s->head_dim;
    const int64_t q_size = (int64_t)s->heads * D, kv_size = (int64_t)s->kv_heads * D, qkv_size = q_size + 2 * kv_size;
    if (T == 0) return 0;
    for (int64_t t = 0; t < T; t++) {                 /* every new K/V row lands inside the pool */
        if (s->slot_mapping[t] >= s->num_blocks * s->block_size) return 30;
    }
    float *x = malloc(sizeof(float) * (size_t)(T * H));
    float *qkv = malloc(sizeof(float) * (size_t)(T * qkv_size));
    float *attn = malloc(sizeof(float) * (size_t)(T * q_size));
    float *gate_up = malloc(sizeof(float) * (size_t)(T * 2 * I));
    float *act = malloc(sizeof(float) * (size_t)(T * I));
    int status = 0;
    if (!x || !qkv || !attn || !gate_up || !act) { status = 2; goto done; }
    if (first) {
        memcpy(residual, hidden, sizeof(float) * (size_t)(T * H));
        ember_rms_norm(hidden, H, w->attn_norm, x, H, T, H, s->eps);
    } else {
        ember_fused_add_rms_norm(hidden, H, residual, H, w->attn_norm, T, H, s->eps);
        memcpy(x, hidden, sizeof(float) * (size_t)(T * H));
    }
    if ((status = matmul(s, x, H, w->qkv, w->qkv_parts, qkv_size, qkv))) goto done;
    if (w->qkv_bias)
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < qkv_size; i++) qkv[t * qkv_size + i] += w->qkv_bias[i];
    ember_rope(qkv, qkv_size, D, s->heads, qkv + q_size, qkv_size, D, s->kv_heads, (int32_t)D,
               s->positions, s->cos_sin, s->neox, T);
    write_kv(s, w, qkv, qkv_size, q_size);
    if ((status = ember_paged_attention(attn, qkv, qkv_size, D, w->k_cache, w->v_cache, s->cache_f16,
                                        s->num_blocks, s->block_size, s->heads, s->kv_heads, (int32_t)D,
                                        s->block_tables, s->table_stride, s->max_blocks, s->context_lens,
                                        s->query_start_loc, s->num_seqs, s->scale))) {
        status += 20; goto done;
    }
    if ((status = matmul(s, attn, q_size, w->o, w->o_parts, H, hidden))) goto done;
    ember_fused_add_rms_norm(hidden, H, residual, H, w->ffn_norm, T, H, s->eps);
    if ((status = matmul(s, hidden, H, w->gate_up, w->gate_up_parts, 2 * I, gate_up))) goto done;
    ember_silu_and_mul(gate_up, 2 * I, act, I, T, I);
    status = matmul(s, act, I, w->down, w->down_parts, H, hidden);
done:
    free(x); free(qkv); free(attn); free(gate_up); free(act);
    return status;
}
