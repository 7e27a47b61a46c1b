/* GGUF rows -> the host kernels' packed groups of 8 rows (layout: ember_cupy/packed_weight.py,
 * which is this kernel's NumPy twin). A group is independent of the others: the groups are
 * packed in parallel, each record written once, so loading runs at the speed of reading the file.
 */
#include "common.h"
#include "threadpool.h"

enum { Q8_0 = 0, Q4_1 = 1, Q4_K = 2, Q5_K = 3, Q6_K = 4, Q5_0 = 5, Q5_1 = 6, Q4_0 = 7, FORMAT_COUNT = 8 };

static const int GGUF_BLOCK_BYTES[FORMAT_COUNT] = {34, 20, 144, 176, 210, 22, 24, 18};
static const int BLOCKS_PER_RECORD[FORMAT_COUNT] = {1, 1, 8, 8, 8, 1, 1, 1};
static const int HIGH_BITS[FORMAT_COUNT] = {0, 0, 0, 1, 2, 1, 1, 0};

/* One row's record: values u of its 32-column blocks and its header fields. */
typedef struct {
    uint8_t u[8][32];
    uint16_t d, m;             /* f16 bits: d, and m (Q4_1, Q5_1) or dmin (K-quants) */
    uint8_t sc[16], mn[8];     /* K-quants: 6-bit scale and min per block; Q6_K: int8 scale per 16 */
} row_record;

static void nibbles(const uint8_t *qs, uint8_t *u) {
    for (int i = 0; i < 16; i++) { u[i] = qs[i] & 15; u[16 + i] = qs[i] >> 4; }
}

static void fifth_bits(const uint8_t *qh, uint8_t *u) {
    uint32_t bits;
    memcpy(&bits, qh, 4);
    for (int i = 0; i < 32; i++) u[i] |= ((bits >> i) & 1) << 4;
}

static void k_scale_min(const uint8_t *s, int j, uint8_t *sc, uint8_t *mn) {
    if (j < 4) { *sc = s[j] & 63; *mn = s[j + 4] & 63; }
    else { *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4); *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}

static void read_k_quant(int fmt, const uint8_t *b, row_record *out) {
    out->d = ember_load_u16(b);
    out->m = ember_load_u16(b + 2);
    const uint8_t *qs = b + (fmt == Q5_K ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        k_scale_min(b + 4, j, &out->sc[j], &out->mn[j]);
        for (int i = 0; i < 32; i++) {
            out->u[j][i] = (qs[32 * (j / 2) + i] >> (4 * (j % 2))) & 15;
            if (fmt == Q5_K) out->u[j][i] |= ((b[16 + i] >> j) & 1) << 4;
        }
    }
}

static void read_q6_k(const uint8_t *b, row_record *out) {
    for (int c = 0; c < 8; c++) {
        const int h = c / 4, t = c % 4;
        for (int i = 0; i < 32; i++)
            out->u[c][i] = ((b[64 * h + 32 * (t % 2) + i] >> (4 * (t / 2))) & 15) |
                           (((b[128 + 32 * h + i] >> (2 * t)) & 3) << 4);
    }
    memcpy(out->sc, b + 192, 16);
    out->d = ember_load_u16(b + 208);
}

/* Record q of a GGUF row (blocks_per_record GGUF blocks of 32, or one of 256). */
static void read_record(int fmt, const uint8_t *row, int64_t q, row_record *out) {
    memset(out, 0, sizeof *out);
    if (BLOCKS_PER_RECORD[fmt] == 8) {
        const uint8_t *b = row + q * GGUF_BLOCK_BYTES[fmt];
        if (fmt == Q6_K) read_q6_k(b, out);
        else read_k_quant(fmt, b, out);
        return;
    }
    const uint8_t *b = row + q * GGUF_BLOCK_BYTES[fmt];
    out->d = ember_load_u16(b);
    switch (fmt) {
    case Q8_0: memcpy(out->u[0], b + 2, 32); break;
    case Q4_0: nibbles(b + 2, out->u[0]); break;
    case Q4_1: out->m = ember_load_u16(b + 2); nibbles(b + 4, out->u[0]); break;
    case Q5_0: nibbles(b + 6, out->u[0]); fifth_bits(b + 2, out->u[0]); break;
    case Q5_1: out->m = ember_load_u16(b + 2); nibbles(b + 8, out->u[0]); fifth_bits(b + 4, out->u[0]); break;
    }
}

static uint8_t *put_u16s(uint8_t *dst, const row_record *rows, int which) {
    for (int r = 0; r < 8; r++) memcpy(dst + 2 * r, which ? &rows[r].m : &rows[r].d, 2);
    return dst + 16;
}

static uint8_t *write_header(int fmt, const row_record *rows, uint8_t *dst) {
    dst = put_u16s(dst, rows, 0);
    if (fmt == Q4_1 || fmt == Q5_1 || fmt == Q4_K || fmt == Q5_K) dst = put_u16s(dst, rows, 1);
    if (fmt == Q4_K || fmt == Q5_K) {
        for (int j = 0; j < 8; j++) for (int r = 0; r < 8; r++) *dst++ = rows[r].sc[j];
        for (int j = 0; j < 8; j++) for (int r = 0; r < 8; r++) *dst++ = rows[r].mn[j];
    } else if (fmt == Q6_K) {
        for (int s = 0; s < 16; s++) for (int r = 0; r < 8; r++) *dst++ = rows[r].sc[s];
    }
    return dst;
}

/* Block j of the record: high bits, then nibbles (Q8_0: the values), 4 columns of 8 rows a chunk. */
static uint8_t *write_block(int fmt, const row_record *rows, int j, uint8_t *dst) {
    if (fmt == Q8_0) {
        for (int c = 0; c < 8; c++)
            for (int r = 0; r < 8; r++) for (int i = 0; i < 4; i++) *dst++ = rows[r].u[j][4 * c + i];
        return dst;
    }
    if (HIGH_BITS[fmt] == 1) {
        for (int r = 0; r < 8; r++)
            for (int i = 0; i < 4; i++) {
                uint8_t bits = 0;
                for (int c = 0; c < 8; c++) bits |= ((rows[r].u[j][4 * c + i] >> 4) & 1) << c;
                dst[4 * r + i] = bits;
            }
        dst += 32;
    } else if (HIGH_BITS[fmt] == 2) {
        for (int h = 0; h < 2; h++, dst += 32)
            for (int r = 0; r < 8; r++)
                for (int i = 0; i < 4; i++) {
                    uint8_t bits = 0;
                    for (int c = 0; c < 4; c++) bits |= ((rows[r].u[j][4 * (4 * h + c) + i] >> 4) & 3) << (2 * c);
                    dst[4 * r + i] = bits;
                }
    }
    for (int c = 0; c < 4; c++)
        for (int r = 0; r < 8; r++)
            for (int i = 0; i < 4; i++)
                *dst++ = (uint8_t)((rows[r].u[j][8 * c + i] & 15) | ((rows[r].u[j][8 * c + 4 + i] & 15) << 4));
    return dst;
}

struct pack_job { int fmt; const uint8_t *src; int64_t src_row_bytes, rows, records, group_bytes; uint8_t *dst; };

static void pack_groups(void *ctx, int64_t begin, int64_t end) {
    const struct pack_job *job = ctx;
    row_record rows[8];
    for (int64_t g = begin; g < end; g++) {
        uint8_t *dst = job->dst + g * job->group_bytes;
        for (int64_t q = 0; q < job->records; q++) {
            for (int r = 0; r < 8; r++) {
                const int64_t row = g * 8 + r;
                if (row < job->rows) read_record(job->fmt, job->src + row * job->src_row_bytes, q, &rows[r]);
                else memset(&rows[r], 0, sizeof rows[r]);
            }
            dst = write_header(job->fmt, rows, dst);
            for (int j = 0; j < BLOCKS_PER_RECORD[job->fmt]; j++) dst = write_block(job->fmt, rows, j, dst);
        }
    }
}

/* src: rows x cols of GGUF blocks in format fmt (the kernel's type code), src_row_bytes apart;
 * dst: ceil(rows / 8) groups of group_bytes (ember_cupy/packed_weight.py). 0, or -1. */
EMBER_EXPORT int ember_pack_weight(int32_t fmt, const uint8_t *src, int64_t src_row_bytes, int64_t rows, int64_t cols,
                                   uint8_t *dst, int64_t group_bytes) {
    if (fmt < 0 || fmt >= FORMAT_COUNT || rows < 0 || cols <= 0 || cols % (32 * BLOCKS_PER_RECORD[fmt])) return -1;
    const int64_t records = cols / (32 * BLOCKS_PER_RECORD[fmt]);
    const int64_t header = fmt == Q4_K || fmt == Q5_K ? 160 : fmt == Q6_K ? 144 : fmt == Q4_1 || fmt == Q5_1 ? 32 : 16;
    const int64_t block = fmt == Q8_0 ? 256 : 128 + 32 * HIGH_BITS[fmt];
    if (src_row_bytes < records * GGUF_BLOCK_BYTES[fmt] || group_bytes != records * (header + BLOCKS_PER_RECORD[fmt] * block))
        return -1;
    struct pack_job job = {fmt, src, src_row_bytes, rows, records, group_bytes, dst};
    ember_parallel_for((rows + 7) / 8, pack_groups, &job);
    return 0;
}
