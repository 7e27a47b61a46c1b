/* Host kernels of cpu/ as a program, for an ISA path this machine cannot run: tests/test_host_aarch64.py
 * builds it statically with the aarch64 cross compiler and runs it under qemu-user. Reads cases
 * from argv[1], writes each case's output to argv[2] in turn, prints the library's path and the
 * number of cases. A case starts with its int64 kind, then:
 *   0 matmul:    int64 M, K, N, wtype, passes, weight bytes; float32 threshold; x [M, K] float32,
 *                the packed weight; writes y [M, N] float32 (ember_matmul_q)
 *   1 attention: int64 tokens, heads, kv heads, head_dim, blocks, block_size, cache_f16, seqs,
 *                table width, window; float32 scale; q [tokens, heads, head_dim] float32, the K and
 *                V pages, tables [seqs, width], context_lens [seqs], query_start_loc [seqs + 1] int32;
 *                writes out like q (ember_paged_attention_window)
 *   2 rows:      int64 op (0 ember_rms_norm, 1 ember_silu_and_mul, 2 ember_gelu_tanh_and_mul), rows,
 *                width; float32 eps; x [rows, width] float32 (and op 0: weight [width]); writes
 *                [rows, width] (op 0) or [rows, width / 2]
 *   3 rope:      int64 tokens, q heads, k heads, head_dim, cache rows, neox; q [tokens, q heads, D],
 *                k [tokens, k heads, D] float32, positions [tokens] int32, cos_sin [cache rows, D];
 *                writes the rotated q, then k (ember_rope)
 *   4 sampling:  int64 op (0 ember_kth_largest, 1 ember_apply_token_bitmask, 2 ember_argmax_rows), rows,
 *                vocab, words; logits [rows, vocab] float32, then op 0: k [rows] int64, writes the k-th
 *                largest [rows]; op 1: mask [rows, words] int32 for logit rows 0..rows-1, writes the
 *                logits; op 2: writes each row's argmax [rows] as float32 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "host_kernels.h"
#include "matmul_q.h"

/* Up to 8 arrays read in order; freed together. */
struct arrays { void *p[8]; int n; };

static void *alloc_array(struct arrays *a, int64_t bytes) {
    void *p = malloc(bytes > 0 ? (size_t)bytes : 1);
    if (p) a->p[a->n++] = p;
    return p;
}

static void *read_array(FILE *in, struct arrays *a, int64_t bytes) {
    void *p = alloc_array(a, bytes);
    return p && fread(p, 1, (size_t)bytes, in) == (size_t)bytes ? p : NULL;
}

static void free_arrays(struct arrays *a) {
    for (int i = 0; i < a->n; i++) free(a->p[i]);
}

static int write_floats(FILE *out, const float *y, int64_t count) {
    return fwrite(y, sizeof(float), (size_t)count, out) == (size_t)count;
}

static int matmul_case(FILE *in, FILE *out, struct arrays *a) {
    int64_t h[6];
    float threshold;
    if (fread(h, sizeof h, 1, in) != 1 || fread(&threshold, 4, 1, in) != 1) return 0;
    const int64_t M = h[0], K = h[1], N = h[2];
    const float *x = read_array(in, a, 4 * M * K);
    const uint8_t *w = read_array(in, a, h[5]);
    float *y = alloc_array(a, 4 * M * N);
    return x && w && y && ember_matmul_q(x, M, K, K, w, N, (int32_t)h[3], y, N, (int32_t)h[4], threshold) == 0 &&
           write_floats(out, y, M * N);
}

static int attention_case(FILE *in, FILE *out, struct arrays *a) {
    int64_t h[10];
    float scale;
    if (fread(h, sizeof h, 1, in) != 1 || fread(&scale, 4, 1, in) != 1) return 0;
    const int64_t T = h[0], H = h[1], Hk = h[2], D = h[3], blocks = h[4], bs = h[5], f16 = h[6], S = h[7], W = h[8];
    const int64_t page_bytes = blocks * bs * Hk * D * (f16 ? 2 : 4);
    const float *q = read_array(in, a, 4 * T * H * D);
    const void *k = read_array(in, a, page_bytes), *v = read_array(in, a, page_bytes);
    const int32_t *tables = read_array(in, a, 4 * S * W), *lens = read_array(in, a, 4 * S);
    const int32_t *starts = read_array(in, a, 4 * (S + 1));
    float *o = alloc_array(a, 4 * T * H * D);
    return q && k && v && tables && lens && starts && o &&
           ember_paged_attention_window(o, q, H * D, D, k, v, (int32_t)f16, blocks, (int32_t)bs, (int32_t)H,
                                        (int32_t)Hk, (int32_t)D, tables, W, (int32_t)W, lens, starts, (int32_t)S,
                                        scale, (int32_t)h[9]) == 0 &&
           write_floats(out, o, T * H * D);
}

static int rows_case(FILE *in, FILE *out, struct arrays *a) {
    int64_t h[3];
    float eps;
    if (fread(h, sizeof h, 1, in) != 1 || fread(&eps, 4, 1, in) != 1) return 0;
    const int64_t op = h[0], rows = h[1], width = h[2], out_width = op == 0 ? width : width / 2;
    const float *x = read_array(in, a, 4 * rows * width), *w = op == 0 ? read_array(in, a, 4 * width) : x;
    float *y = alloc_array(a, 4 * rows * out_width);
    if (!x || !w || !y) return 0;
    if (op == 0) ember_rms_norm(x, width, w, y, width, rows, width, eps);
    else if (op == 1) ember_silu_and_mul(x, width, y, out_width, rows, out_width);
    else if (op == 2) ember_gelu_tanh_and_mul(x, width, y, out_width, rows, out_width);
    else return 0;
    return write_floats(out, y, rows * out_width);
}

static int rope_case(FILE *in, FILE *out, struct arrays *a) {
    int64_t h[6];
    if (fread(h, sizeof h, 1, in) != 1) return 0;
    const int64_t T = h[0], hq = h[1], hk = h[2], D = h[3];
    float *q = read_array(in, a, 4 * T * hq * D), *k = read_array(in, a, 4 * T * hk * D);
    const int32_t *positions = read_array(in, a, 4 * T);
    const float *cos_sin = read_array(in, a, 4 * h[4] * D);
    if (!q || !k || !positions || !cos_sin) return 0;
    ember_rope(q, hq * D, D, (int32_t)hq, k, hk * D, D, (int32_t)hk, (int32_t)D, positions, cos_sin, (int32_t)h[5], T);
    return write_floats(out, q, T * hq * D) && write_floats(out, k, T * hk * D);
}

static int sampling_case(FILE *in, FILE *out, struct arrays *a) {
    int64_t h[4];
    if (fread(h, sizeof h, 1, in) != 1) return 0;
    const int64_t rows = h[1], vocab = h[2], words = h[3];
    float *x = read_array(in, a, 4 * rows * vocab);
    if (!x) return 0;
    if (h[0] == 2) {
        int32_t *ids = alloc_array(a, 4 * rows);
        float *as_floats = alloc_array(a, 4 * rows);
        if (!ids || !as_floats) return 0;
        ember_argmax_rows(x, rows, vocab, vocab, ids);
        for (int64_t r = 0; r < rows; r++) as_floats[r] = (float)ids[r];
        return write_floats(out, as_floats, rows);
    }
    if (h[0] == 0) {
        const int64_t *k = read_array(in, a, 8 * rows);
        float *kth = alloc_array(a, 4 * rows);
        return k && kth && ember_kth_largest(x, rows, vocab, vocab, k, kth) == 0 && write_floats(out, kth, rows);
    }
    const int32_t *mask = read_array(in, a, 4 * rows * words);
    int32_t *ids = alloc_array(a, 4 * rows);
    if (!mask || !ids) return 0;
    for (int32_t r = 0; r < rows; r++) ids[r] = r;
    return ember_apply_token_bitmask(x, rows, vocab, vocab, mask, words, ids, rows) == 0 &&
           write_floats(out, x, rows * vocab);
}

static int run_case(int64_t kind, FILE *in, FILE *out, struct arrays *a) {
    switch (kind) {
    case 0: return matmul_case(in, out, a);
    case 1: return attention_case(in, out, a);
    case 2: return rows_case(in, out, a);
    case 3: return rope_case(in, out, a);
    case 4: return sampling_case(in, out, a);
    default: return 0;
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s CASES OUTPUT\n", argv[0]);
        return 2;
    }
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    if (!in || !out) {
        perror("open");
        return 2;
    }
    int64_t kind;
    int cases = 0, ok = 1;
    while (ok && fread(&kind, sizeof kind, 1, in) == 1) {
        struct arrays a = {{0}, 0};
        ok = run_case(kind, in, out, &a);
        free_arrays(&a);
        cases += ok;
    }
    fclose(in);
    if (fclose(out) != 0 || !ok) {
        fprintf(stderr, "case %d failed\n", cases);
        return 1;
    }
    printf("%s %d\n", ember_isa(), cases);
    return 0;
}
