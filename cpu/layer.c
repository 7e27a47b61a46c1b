/* One Llama-family decoder layer (Llama, Mistral, Qwen2, Qwen3, Gemma 3) as a single call,
 * composed from the other host kernels (the NumPy twin is DecoderModel's op-by-op forward,
 * ember_cupy/model/decoder.py). At one token per step a layer is a dozen small kernels; calling
 * each from Python cost more than computing it.
 *
 *   attention(x) = attend(rope(qk_norm(x @ Wqkv + bias))) @ Wo   with the layer's window and RoPE
 *                  table; qk_norm (Qwen3, Gemma 3): RMSNorm of each q and k head, when given
 *   mlp(x)       = act(x @ Wgate, x @ Wup) @ Wdown                 act: SiLU*up or GELU-tanh*up
 *
 * Two ways of adding the blocks to the residual stream:
 *   Llama (no post norms): the stream is threaded apart, so that each add fuses with the next norm
 *     x = rmsnorm(hidden) (first layer) | fused_add_rmsnorm(hidden, residual)
 *     hidden = attention(x); x = fused_add_rmsnorm(hidden, residual); hidden = mlp(x)
 *   sandwich (Gemma 3: post_attn_norm, post_ffn_norm): hidden is the stream itself
 *     hidden += rmsnorm(attention(rmsnorm(hidden, attn_norm)), post_attn_norm)
 *     hidden += rmsnorm(mlp(rmsnorm(hidden, ffn_norm)), post_ffn_norm)
 */
#include "common.h"
#include "host_kernels.h"
#include "matmul_q.h"

#include <stdlib.h>

typedef struct {              /* fixed per layer (ember_cupy/ops/layer.py: LayerWeightsArgs) */
    const float *attn_norm, *ffn_norm, *qkv_bias;   /* qkv_bias may be NULL */
    const EmberWeightPart *qkv, *o, *gate_up, *down;   /* each its parts' formats (cpu/matmul_q.h) */
    int32_t qkv_parts, o_parts, gate_up_parts, down_parts;
    void *k_cache, *v_cache;                        /* [blocks, block_size, kv_heads, head_dim] */
    /* the other families' features; NULL / 0 is Llama's */
    const float *q_norm, *k_norm;                   /* [head_dim] each: qk_norm (Qwen3, Gemma 3) */
    const float *post_attn_norm, *post_ffn_norm;    /* [hidden] each: sandwich norms (Gemma 3) */
    int32_t window;                                 /* keys a query sees, itself included; 0 = all */
} LayerWeights;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

typedef struct {              /* per step (ember_cupy/ops/layer.py: StepArgs) */
    int64_t tokens, hidden, inter;
    int32_t heads, kv_heads, head_dim, passes, neox, cache_f16, block_size, num_seqs, max_blocks;
    int64_t num_blocks, table_stride;
    float eps, scale, second_pass_threshold;
    const int32_t *positions, *slot_mapping, *block_tables, *context_lens, *query_start_loc;
    const float *cos_sin;
    const float *local_cos_sin;   /* RoPE table of the windowed layers (Gemma 3's own base); NULL: cos_sin */
    int32_t activation;           /* ACT_SILU | ACT_GELU_TANH */
    const uint8_t *prompt_rows;   /* [tokens]: 1 = a prompt token's row, its matmuls in bf16 (matmul_bf16.h); NULL: none */
} StepArgs;

/* Statuses besides a kernel's own: matmul 10 + its code, attention 20 + its code. */
enum { LAYER_OK = 0, LAYER_NO_MEMORY = 2, LAYER_ATTENTION = 20, LAYER_BAD_SLOT = 30, LAYER_BAD_NORMS = 31,
       LAYER_BAD_ACTIVATION = 32, LAYER_NO_RESIDUAL = 33 };

/* A step's activations. The attention block's (qkv, attn) and the MLP's (gate_up, its activation
 * written over the gate half in place) are never live together, so they share `work`: at a
 * 512-token prefill of a 0.5B model that is 20 MB where five buffers took 37 MB, and a step's
 * scratch is most of the memory the engine holds beside its weights and KV cache. x: the
 * sandwich layout's block input only (NULL for Llama's). */
typedef struct { float *x, *work, *qkv, *attn, *gate_up; } Scratch;

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

/* y [T, N] = x [T, K] (rows ldx apart) @ W^T: each run of prompt rows in bf16, each run of the
 * others with the step's activation passes (a row's role picks its kernel, never the batch it is
 * in); 0, or 10 + the matmul's status. */
static int matmul(const StepArgs *s, const float *x, int64_t K, int64_t ldx, const EmberWeightPart *w, int32_t parts,
                  int64_t N, float *y) {
    for (int64_t start = 0, end; start < s->tokens; start = end) {
        const int prompt = s->prompt_rows && s->prompt_rows[start];
        for (end = start + 1; end < s->tokens && (s->prompt_rows && s->prompt_rows[end]) == prompt; end++) {}
        const float *xs = x + start * ldx;
        float *ys = y + start * N;
        const int status = prompt ? ember_matmul_parts_bf16(xs, end - start, K, ldx, w, parts, ys, N)
                                  : ember_matmul_parts(xs, end - start, K, ldx, w, parts, ys, N, s->passes,
                                                       s->second_pass_threshold);
        if (status) return 10 + status;
    }
    return 0;
}

/* What the kernels below do not check themselves: every new K/V row lands inside the pool, the
 * optional norms come in pairs, the activation is known. */
static int check_args(const LayerWeights *w, const StepArgs *s) {
    for (int64_t t = 0; t < s->tokens; t++)
        if (s->slot_mapping[t] >= s->num_blocks * s->block_size) return LAYER_BAD_SLOT;
    if (!w->q_norm != !w->k_norm || !w->post_attn_norm != !w->post_ffn_norm) return LAYER_BAD_NORMS;
    if (s->activation != ACT_SILU && s->activation != ACT_GELU_TANH) return LAYER_BAD_ACTIVATION;
    return LAYER_OK;
}

static void scratch_free(Scratch *b) {
    free(b->x); free(b->work);
}

static int scratch_alloc(Scratch *b, const StepArgs *s, int sandwich) {
    const int64_t T = s->tokens, q_size = (int64_t)s->heads * s->head_dim;
    const int64_t qkv_size = q_size + 2 * (int64_t)s->kv_heads * s->head_dim;
    const int64_t attention_floats = qkv_size + q_size, mlp_floats = 2 * s->inter;
    b->x = sandwich ? malloc(sizeof(float) * (size_t)(T * s->hidden)) : NULL;
    b->work = malloc(sizeof(float) * (size_t)(T * (attention_floats > mlp_floats ? attention_floats : mlp_floats)));
    b->qkv = b->work;
    b->attn = b->work + T * qkv_size;
    b->gate_up = b->work;
    if (b->work && (b->x || !sandwich)) return LAYER_OK;
    scratch_free(b);
    return LAYER_NO_MEMORY;
}

static void add_bias(float *rows, int64_t tokens, int64_t width, const float *bias) {
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t i = 0; i < width; i++) rows[t * width + i] += bias[i];
}

/* In place: RMSNorm of each of `heads` heads of head_dim floats, from `first` in every row of ld floats. */
static void norm_heads(const StepArgs *s, float *first, int64_t ld, int32_t heads, const float *weight) {
    const int64_t D = s->head_dim;
    for (int32_t h = 0; h < heads; h++) ember_rms_norm(first + h * D, ld, weight, first + h * D, ld, s->tokens, D, s->eps);
}

/* Windowed layers rotate by their own table (Gemma 3's local RoPE base), as DecoderModel._attention does. */
static const float *layer_cos_sin(const LayerWeights *w, const StepArgs *s) {
    return w->window && s->local_cos_sin ? s->local_cos_sin : s->cos_sin;
}

/* out [T, H] = attention(x [T, H]); out may be x (x is read first). */
static int attention_block(const LayerWeights *w, const StepArgs *s, const float *x, float *out, Scratch *b) {
    const int64_t T = s->tokens, H = s->hidden, D = s->head_dim;
    const int64_t q_size = (int64_t)s->heads * D, qkv_size = q_size + 2 * (int64_t)s->kv_heads * D;
    int status = matmul(s, x, H, H, w->qkv, w->qkv_parts, qkv_size, b->qkv);
    if (status) return status;
    if (w->qkv_bias) add_bias(b->qkv, T, qkv_size, w->qkv_bias);
    if (w->q_norm) {
        norm_heads(s, b->qkv, qkv_size, s->heads, w->q_norm);
        norm_heads(s, b->qkv + q_size, qkv_size, s->kv_heads, w->k_norm);
    }
    ember_rope(b->qkv, qkv_size, D, s->heads, b->qkv + q_size, qkv_size, D, s->kv_heads, (int32_t)D,
               s->positions, layer_cos_sin(w, s), s->neox, T);
    write_kv(s, w, b->qkv, qkv_size, q_size);
    status = ember_paged_attention_window(b->attn, b->qkv, qkv_size, D, w->k_cache, w->v_cache, s->cache_f16,
                                          s->num_blocks, s->block_size, s->heads, s->kv_heads, (int32_t)D,
                                          s->block_tables, s->table_stride, s->max_blocks, s->context_lens,
                                          s->query_start_loc, s->num_seqs, s->scale, w->window);
    if (status) return LAYER_ATTENTION + status;
    return matmul(s, b->attn, q_size, q_size, w->o, w->o_parts, H, out);
}

/* out [T, H] = mlp(x [T, H]); out may be x (x is read first). The activation overwrites the gate
 * half of each gate_up row (each element is read before it is written), and the down projection
 * reads those halves, 2I apart. */
static int mlp_block(const LayerWeights *w, const StepArgs *s, const float *x, float *out, Scratch *b) {
    const int64_t T = s->tokens, H = s->hidden, I = s->inter;
    const int status = matmul(s, x, H, H, w->gate_up, w->gate_up_parts, 2 * I, b->gate_up);
    if (status) return status;
    if (s->activation == ACT_GELU_TANH) ember_gelu_tanh_and_mul(b->gate_up, 2 * I, b->gate_up, 2 * I, T, I);
    else ember_silu_and_mul(b->gate_up, 2 * I, b->gate_up, 2 * I, T, I);
    return matmul(s, b->gate_up, I, 2 * I, w->down, w->down_parts, H, out);
}

typedef int (*Block)(const LayerWeights *, const StepArgs *, const float *, float *, Scratch *);

/* Llama: hidden, residual as in the header; the block's input normed in place in hidden. */
static int residual_stream_layer(const LayerWeights *w, const StepArgs *s, float *hidden, float *residual,
                                 int32_t first, Scratch *b) {
    const int64_t T = s->tokens, H = s->hidden;
    if (first) {
        memcpy(residual, hidden, sizeof(float) * (size_t)(T * H));
        ember_rms_norm(hidden, H, w->attn_norm, hidden, H, T, H, s->eps);
    } else {
        ember_fused_add_rms_norm(hidden, H, residual, H, w->attn_norm, T, H, s->eps);
    }
    const int status = attention_block(w, s, hidden, hidden, b);
    if (status) return status;
    ember_fused_add_rms_norm(hidden, H, residual, H, w->ffn_norm, T, H, s->eps);
    return mlp_block(w, s, hidden, hidden, b);
}

/* Sandwich: hidden += rmsnorm(block(rmsnorm(hidden, pre)), post). */
static int sandwiched(Block block, const float *pre, const float *post, const LayerWeights *w,
                      const StepArgs *s, float *hidden, Scratch *b) {
    const int64_t T = s->tokens, H = s->hidden;
    ember_rms_norm(hidden, H, pre, b->x, H, T, H, s->eps);
    const int status = block(w, s, b->x, b->x, b);
    if (status) return status;
    ember_rms_norm(b->x, H, post, b->x, H, T, H, s->eps);
    for (int64_t i = 0; i < T * H; i++) hidden[i] += b->x[i];
    return LAYER_OK;
}

static int sandwich_layer(const LayerWeights *w, const StepArgs *s, float *hidden, Scratch *b) {
    const int status = sandwiched(attention_block, w->attn_norm, w->post_attn_norm, w, s, hidden, b);
    return status ? status : sandwiched(mlp_block, w->ffn_norm, w->post_ffn_norm, w, s, hidden, b);
}

static int one_layer(const LayerWeights *w, const StepArgs *s, float *hidden, float *residual, int32_t first,
                     Scratch *b) {
    const int status = check_args(w, s);
    if (status) return status;
    if (!w->post_attn_norm && !residual) return LAYER_NO_RESIDUAL;
    return w->post_attn_norm ? sandwich_layer(w, s, hidden, b) : residual_stream_layer(w, s, hidden, residual, first, b);
}

/* hidden [T, H] in/out. Llama layout: residual [T, H] in/out (written from hidden when first != 0).
 * Sandwich layout (post norms given): residual and first unused (residual may be NULL).
 * Returns 0, or 2 out of memory, 10 + a matmul's status, 20 + the attention's, 30 a slot outside
 * the pool, 31 a norm given without its pair, 32 an unknown activation, 33 the Llama layout
 * without a residual. */
EMBER_EXPORT int ember_llama_layer(const LayerWeights *w, const StepArgs *s, float *hidden, float *residual,
                                   int32_t first) {
    if (s->tokens == 0) return LAYER_OK;
    Scratch b;
    int status = scratch_alloc(&b, s, w->post_attn_norm != NULL);
    if (status) return status;
    status = one_layer(w, s, hidden, residual, first, &b);
    scratch_free(&b);
    return status;
}

/* The model's layers 0..num_layers-1 one after the other, as ember_llama_layer on each (first for
 * layer 0): one call a step, so a caller that releases Python's GIL around it waits for the GIL
 * once a forward, not once a layer (a thread holding the GIL meanwhile makes each wait up to a
 * switch interval and its C call's remainder long). The status of the first layer that fails. */
EMBER_EXPORT int ember_decoder_layers(const LayerWeights *layers, int32_t num_layers, const StepArgs *s, float *hidden,
                                      float *residual) {
    if (s->tokens == 0) return LAYER_OK;
    int sandwich = 0;
    for (int32_t i = 0; i < num_layers; i++) sandwich |= layers[i].post_attn_norm != NULL;
    Scratch b;
    int status = scratch_alloc(&b, s, sandwich);
    if (status) return status;
    for (int32_t i = 0; i < num_layers && !status; i++) status = one_layer(&layers[i], s, hidden, residual, i == 0, &b);
    scratch_free(&b);
    return status;
}
