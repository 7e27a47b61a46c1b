/* The quantized matmul of cpu/matmul_q.c as a program, for an ISA path this machine cannot run
 * (tests/test_host_aarch64.py builds it statically with the aarch64 cross compiler and runs it
 * under qemu-user). Reads cases from argv[1], writes each case's y to argv[2] in turn, prints the
 * library's path. A case: int64 M, K, N, wtype, passes, packed weight bytes; float32 threshold;
 * then x [M, K] float32 and the weight bytes. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "matmul_q.h"

const char *ember_isa(void);

static int read_exact(FILE *f, void *p, size_t bytes) { return fread(p, 1, bytes, f) == bytes; }

static int run_case(FILE *in, FILE *out) {
    int64_t head[6];
    float threshold;
    if (!read_exact(in, head, sizeof head)) return 0;
    if (!read_exact(in, &threshold, sizeof threshold)) return -1;
    const int64_t M = head[0], K = head[1], N = head[2], bytes = head[5];
    float *x = malloc(sizeof(float) * (size_t)(M * K)), *y = malloc(sizeof(float) * (size_t)(M * N));
    uint8_t *w = malloc((size_t)bytes);
    int status = -1;
    if (x && y && w && read_exact(in, x, sizeof(float) * (size_t)(M * K)) && read_exact(in, w, (size_t)bytes) &&
        ember_matmul_q(x, M, K, K, w, N, (int32_t)head[3], y, N, (int32_t)head[4], threshold) == 0 &&
        fwrite(y, sizeof(float), (size_t)(M * N), out) == (size_t)(M * N))
        status = 1;
    free(x);
    free(y);
    free(w);
    return status;
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
    int status, cases = 0;
    while ((status = run_case(in, out)) == 1) cases++;
    fclose(in);
    if (fclose(out) != 0 || status < 0) {
        fprintf(stderr, "case %d failed\n", cases);
        return 1;
    }
    printf("%s %d\n", ember_isa(), cases);
    return 0;
}
