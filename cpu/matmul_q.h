/* The quantized matmul's entry points (cpu/matmul_q.c), for the kernels that call it (cpu/layer.c). */
#ifndef EMBER_CPU_MATMUL_Q_H
#define EMBER_CPU_MATMUL_Q_H

#include <stdint.h>

typedef struct {              /* rows of a matrix in one format (ember_cupy/packed_weight.py) */
    const uint8_t *w;         /* packed groups of 8 rows */
    int64_t rows;
    int32_t wtype;            /* Q8_0 0, Q4_1 1, Q4_K 2, Q5_K 3, Q6_K 4, Q5_0 5, Q5_1 6, Q4_0 7,
                                 16-bit floats: BF16 8, F16 9 (panels of 16 rows: cpu/matmul_16bit.c) */
} EmberWeightPart;

enum { EMBER_WTYPE_BF16 = 8, EMBER_WTYPE_F16 = 9 };

static inline int ember_is_16bit(int32_t wtype) { return wtype == EMBER_WTYPE_BF16 || wtype == EMBER_WTYPE_F16; }

int ember_matmul_q(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N,
                   int32_t wtype, float *y, int64_t ldy, int32_t passes, float second_pass_threshold);
int ember_matmul_parts(const float *x, int64_t M, int64_t K, int64_t ldx, const EmberWeightPart *parts,
                       int32_t count, float *y, int64_t ldy, int32_t passes, float second_pass_threshold);

int ember_matmul_parts_bf16(const float *x, int64_t M, int64_t K, int64_t ldx, const EmberWeightPart *parts,
                            int32_t count, float *y, int64_t ldy);

int ember_matmul_16bit(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, int64_t N,
                       int32_t format, float *y, int64_t ldy);

#endif
