/* The host kernels' other entry points (cpu/elementwise.c, cpu/attention.c, cpu/sampling.c), for
 * the C code that calls them: cpu/layer.c and the emulated test driver (tests/host_emulated/driver.c).
 * The quantized and 16-bit matmuls are declared in cpu/matmul_q.h. */
#ifndef EMBER_CPU_HOST_KERNELS_H
#define EMBER_CPU_HOST_KERNELS_H

#include <stdint.h>

const char *ember_isa(void);
void ember_rms_norm(const float *x, int64_t ldx, const float *w, float *out, int64_t ldo, int64_t rows,
                    int64_t hidden, float eps);
void ember_fused_add_rms_norm(float *x, int64_t ldx, float *residual, int64_t ldr, const float *w,
                              int64_t rows, int64_t hidden, float eps);
void ember_silu_and_mul(const float *gate_up, int64_t ldg, float *out, int64_t ldo, int64_t rows, int64_t inter);
void ember_gelu_tanh_and_mul(const float *gate_up, int64_t ldg, float *out, int64_t ldo, int64_t rows,
                             int64_t inter);
void ember_rope(float *q, int64_t qs0, int64_t qs1, int32_t hq, float *k, int64_t ks0, int64_t ks1, int32_t hk,
                int32_t dim, const int32_t *positions, const float *cos_sin, int32_t neox, int64_t tokens);
int ember_paged_attention_window(float *out, const float *q, int64_t q_stride_t, int64_t q_stride_h,
                                 const void *k_cache, const void *v_cache, int32_t cache_f16, int64_t num_blocks,
                                 int32_t block_size, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                                 const int32_t *block_tables, int64_t table_stride, int32_t max_blocks,
                                 const int32_t *context_lens, const int32_t *query_start_loc, int32_t num_seqs,
                                 float scale, int32_t window);
int ember_kth_largest(const float *x, int64_t rows, int64_t vocab, int64_t ld, const int64_t *k, float *out);
int ember_apply_token_bitmask(float *x, int64_t num_logit_rows, int64_t vocab, int64_t ld, const int32_t *mask,
                              int64_t words, const int32_t *rows, int64_t num_rows);

#endif
