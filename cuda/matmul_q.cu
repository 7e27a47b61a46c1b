// matmul_q.cu -- weight-only quantized matmul, out[M, N] = x[M, K] @ W[N, K]^T with W in GGUF
// blocks (Q8_0, Q4_0, Q4_1; the K-quants Q4_K, Q6_K below) and x in f32/f16/bf16, fp32
// accumulation; and the row dequantizer
// (embedding lookups, and the scratch of the large-M path). The activations are not quantized.
// NumPy twins: ember_cupy/ops/linear.py (matmul_q_cuda_numpy, dequantize_rows_numpy).
//
// Device layout (ember_cupy/quant.py DeviceQuantizedWeight, split from the GGUF blocks at upload):
//   quants  uint8 [N, K]   Q8_0: the int8 values, in column order;
//           uint8 [N, K/2] Q4_0/Q4_1: GGUF's nibbles; byte j of a 32-wide block holds element j in
//                          its low nibble and element j + 16 in its high nibble;
//   scales  f16 [N, K/32] (d), or for Q4_1 f16 [N, K/32, 2] (d then m: one 4-byte load).
//   w = d*q (Q8_0), d*(q - 8) (Q4_0), d*q + m (Q4_1): the GGUF bytes, no more (Q4_1: 20 B / 32 w).
// Scales apart from quants make every quants row a whole number of 16-byte chunks (K % 32 == 0),
// 16-byte aligned: one uint4 load is one Q4 block, or half a Q8_0 block.
//
// GEMV (small M, decode): MR = 1 or 4 rows of x per weight read (96 registers at most: MR = 8
// needed 116 for Q4); grid (ceil(M / MR), ceil(N / kRowsPerBlock)); 4 warps of 2 weight rows.
// Lane l reads chunks l, l+32, ... of each of its rows (a warp reads 512 contiguous bytes a step),
// dequantizes them in registers and multiplies them with MR rows of x: per block Σ x*q, then
// acc += d * Σ x*q + m * Σ x. The M chunk is the fastest grid index, so the blocks that read the
// same weights run side by side and share them through L2. Partial sums are reduced through shared
// memory (one barrier) rather than 5 shuffles per accumulator.
// K-quants (blocks of 256 weights; K % 256 == 0), split from the GGUF blocks the same way:
//   Q4_K  quants uint8 [N, K/2]: each block's 128 bytes qs as stored (byte l of 32-byte group j:
//         element 64j + l in its low nibble, 64j + 32 + l in its high one);
//         scales uint8 [N, K/256, 16]: the block's header as stored (f16 d, f16 dmin, the 12 bytes
//         of 6-bit sub-block scales and mins): w = (d*sc)*q - dmin*mn (144 B / 256 w).
//   Q6_K  quants uint8 [N, 3K/4]: each block's ql (128 B) then qh (64 B), as stored;
//         scales uint8 [N, K/256, 18]: int8 sc[16] then f16 d: w = (d*sc)*(q - 32) (210 B / 256 w).
// A lane's unit is 32 weights in two groups of 16, each with its own scale: Q4_K 16 bytes of qs
// (low nibbles one sub-block, high nibbles the next: groups 32 apart), Q6_K 16 bytes of ql and
// the 16 of qh beside them (groups 64 apart; the lane of the other ql half reads the same qh,
// from L1: 4 registers a row more would have meant 128 for MR = 4). Each weight is dequantized to the twin's float32 value (the same
// single rounding) before the FMA with x, so a non-finite x gives the twin's inf or NaN.
// Large M (prefill) is not done here: ops/linear.py dequantizes slices of W into a scratch matrix
// with dequantize_range and runs cuBLAS on them (tensor cores; see its docstring for why).
#include "common.cuh"

namespace ember {

enum QFormat { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ4_K = 3, kQ6_K = 4 };

constexpr int kQBlock = 32;            // weights per GGUF block
constexpr int kWarps = 4;              // warps per block (both kernels)
constexpr int kRowsPerWarp = 2;        // GEMV: weight rows per warp
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;

// Bytes of quants per weight row, and weights per 16-byte chunk.
template <int F> __device__ __forceinline__ int row_bytes(int K) { return F == kQ8_0 ? K : K / 2; }
template <int F> __device__ __forceinline__ constexpr int chunk_weights() { return F == kQ8_0 ? 16 : 32; }

// d and m of block `b` of a row (m = -8d for Q4_0, unused for Q8_0).
template <int F>
__device__ __forceinline__ float2 block_scales(const __half* scales, long long row, int blocks, int b) {
  if (F == kQ4_1) {
    const __half2 dm = reinterpret_cast<const __half2*>(scales)[row * blocks + b];
    return make_float2(__low2float(dm), __high2float(dm));
  }
  const float d = __half2float(scales[row * blocks + b]);
  return make_float2(d, -8.0f * d);
}

__device__ __forceinline__ unsigned word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Four consecutive x values as float (16-byte f32 / 8-byte f16, bf16 load; aligned by the caller).
__device__ __forceinline__ void load4(const float* p, float (&v)[4]) {
  const float4 t = *reinterpret_cast<const float4*>(p);
  v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
}
__device__ __forceinline__ void load4(const __half* p, float (&v)[4]) {
  const uint2 t = *reinterpret_cast<const uint2*>(p);
  v[0] = __half2float(__ushort_as_half((unsigned short)(t.x & 0xffffu)));
  v[1] = __half2float(__ushort_as_half((unsigned short)(t.x >> 16)));
  v[2] = __half2float(__ushort_as_half((unsigned short)(t.y & 0xffffu)));
  v[3] = __half2float(__ushort_as_half((unsigned short)(t.y >> 16)));
}
__device__ __forceinline__ void load4(const __nv_bfloat16* p, float (&v)[4]) {
  const uint2 t = *reinterpret_cast<const uint2*>(p);   // bf16 -> f32 is a 16-bit shift
  v[0] = __int_as_float(int(t.x << 16)), v[1] = __int_as_float(int(t.x & 0xffff0000u));
  v[2] = __int_as_float(int(t.y << 16)), v[3] = __int_as_float(int(t.y & 0xffff0000u));
}

// An unsigned integer u < 2^23 as float without I2F (a quarter-rate instruction): the bits of
// 2^23 + u, minus 2^23 (one LOP3 with the extraction, one FADD; exact).
constexpr unsigned kMagicBits = 0x4B000000u;   // 2^23 as float
__device__ __forceinline__ float small_uint_to_float(unsigned u, float offset) {
  return __int_as_float(int(kMagicBits | u)) - offset;
}

// The 8 weights that word i of a chunk holds, as floats (q, before d and m): Q4 word i has
// elements 4i..4i+3 (low nibbles, lo[]) and 4i+16..4i+19 (high nibbles, hi[]); Q8_0 word i has
// elements 4i..4i+3 of the chunk (lo[]; hi[] unused): int8 q = (q ^ 0x80) - 128.
template <int F>
__device__ __forceinline__ void unpack(unsigned bits, float (&lo)[4], float (&hi)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (F == kQ8_0) {
      lo[j] = small_uint_to_float(((bits >> (8 * j)) & 0xffu) ^ 0x80u, 8388608.0f + 128.0f);
      hi[j] = 0.0f;
    } else {
      lo[j] = small_uint_to_float((bits >> (8 * j)) & 0xfu, 8388608.0f);
      hi[j] = small_uint_to_float((bits >> (8 * j + 4)) & 0xfu, 8388608.0f);
    }
  }
}

// The GEMV's end: each lane's acc[r][m] (weight row r of its warp, x row m) summed over the 32
// lanes through shared memory (one barrier) and written to out.
template <int MR, class O>
__device__ __forceinline__ void store_sums(O* __restrict__ out, const float (&acc)[kRowsPerWarp][MR], int M, int N) {
  __shared__ float partial[kWarps][kRowsPerWarp * MR][kQBlock + 1];   // +1: conflict-free column sums
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int m0 = blockIdx.x * MR, rows = min(MR, M - m0);
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int m = 0; m < MR; ++m) partial[warp][r * MR + m][lane] = acc[r][m];
  __syncthreads();
  // thread t sums the 32 lanes of one (warp, row, x row) and writes that output
  for (int t = threadIdx.x; t < kWarps * kRowsPerWarp * MR; t += blockDim.x) {
    const int w = t / (kRowsPerWarp * MR), j = t % (kRowsPerWarp * MR);
    const int n = blockIdx.y * kRowsPerBlock + w * kRowsPerWarp + j / MR, m = j % MR;
    if (n >= N || m >= rows) continue;
    float sum = 0.0f;
    for (int l = 0; l < 32; ++l) sum += partial[w][j][l];
    out[(long long)(m0 + m) * N + n] = from_float<O>(sum);
  }
}

// out[m, n] for MR rows of x starting at blockIdx.x * MR, 8 weight rows from blockIdx.y * 8.
template <int F, int MR, class T, class O>
__device__ void matmul_q_gemv(O* __restrict__ out, const T* __restrict__ x, const unsigned char* __restrict__ quants,
                              const __half* __restrict__ scales, int M, int N, int K, int x_stride) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int m0 = blockIdx.x * MR, rows = min(MR, M - m0);
  const int blocks = K / kQBlock, chunks = row_bytes<F>(K) / 16;
  const T* xs = x + (long long)m0 * x_stride;
  float acc[kRowsPerWarp][MR];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int m = 0; m < MR; ++m) acc[r][m] = 0.0f;

  const int n_first = blockIdx.y * kRowsPerBlock + warp * kRowsPerWarp;
  const int n_last = min(n_first + kRowsPerWarp, N);   // rows n_first .. n_last-1 exist
  for (int c = lane; c < chunks && n_first < N; c += 32) {
    uint4 raw[kRowsPerWarp];
    float2 dm[kRowsPerWarp];
    const int b = F == kQ8_0 ? c >> 1 : c;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int n = min(n_first + r, n_last - 1);        // a missing row re-reads the last one
      raw[r] = reinterpret_cast<const uint4*>(quants + (long long)n * row_bytes<F>(K))[c];
      dm[r] = block_scales<F>(scales, n, blocks, b);
    }
    const int k0 = c * chunk_weights<F>();
    float qx[kRowsPerWarp][MR], sx[MR];
#pragma unroll
    for (int m = 0; m < MR; ++m) {
      sx[m] = 0.0f;
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) qx[r][m] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float lo[kRowsPerWarp][4], hi[kRowsPerWarp][4];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) unpack<F>(word(raw[r], i), lo[r], hi[r]);
#pragma unroll
      for (int m = 0; m < MR; ++m) {
        if (m >= rows) break;
        float xa[4], xb[4];
        load4(xs + (long long)m * x_stride + k0 + 4 * i, xa);
        if (F != kQ8_0) load4(xs + (long long)m * x_stride + k0 + 16 + 4 * i, xb);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int r = 0; r < kRowsPerWarp; ++r) {
            qx[r][m] = fmaf(xa[j], lo[r][j], qx[r][m]);
            if (F != kQ8_0) qx[r][m] = fmaf(xb[j], hi[r][j], qx[r][m]);
          }
          if (F != kQ8_0) sx[m] += xa[j] + xb[j];
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
      for (int m = 0; m < MR; ++m) acc[r][m] = fmaf(dm[r].x, qx[r][m], fmaf(dm[r].y, sx[m], acc[r][m]));
  }

  store_sums<MR>(out, acc, M, N);
}

// out[i, :] = row (first_row + i) or ids[i] of W, dequantized; a warp per row, 4 rows per block.
template <int F, class T>
__device__ void dequantize_row(T* __restrict__ out, const unsigned char* __restrict__ quants,
                               const __half* __restrict__ scales, long long row, int K) {
  const int lane = threadIdx.x & 31, blocks = K / kQBlock, chunks = row_bytes<F>(K) / 16;
  for (int c = lane; c < chunks; c += 32) {
    const uint4 raw = reinterpret_cast<const uint4*>(quants + row * row_bytes<F>(K))[c];
    const float2 dm = block_scales<F>(scales, row, blocks, F == kQ8_0 ? c >> 1 : c);
    const int k0 = c * chunk_weights<F>();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float lo[4], hi[4];
      unpack<F>(word(raw, i), lo, hi);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (F == kQ8_0) {
          out[k0 + 4 * i + j] = from_float<T>(dm.x * lo[j]);
        } else {
          out[k0 + 4 * i + j] = from_float<T>(fmaf(dm.x, lo[j], dm.y));
          out[k0 + 16 + 4 * i + j] = from_float<T>(fmaf(dm.x, hi[j], dm.y));
        }
      }
    }
  }
}

template <int F, class T>
__device__ void dequantize_rows(T* __restrict__ out, const unsigned char* __restrict__ quants,
                                const __half* __restrict__ scales, const int* __restrict__ ids, int rows, int K) {
  const int i = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (i < rows) dequantize_row<F, T>(out + (long long)i * K, quants, scales, ids[i], K);
}

template <int F, class T>
__device__ void dequantize_range(T* __restrict__ out, const unsigned char* __restrict__ quants,
                                 const __half* __restrict__ scales, int first_row, int rows, int K) {
  const int i = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (i < rows) dequantize_row<F, T>(out + (long long)i * K, quants, scales, first_row + i, K);
}

// --- K-quants ------------------------------------------------------------------------------
constexpr int kSuperBlock = 256;
constexpr int kUnitWeights = 32;       // weights of a lane's unit: two groups of 16
template <int F> __device__ __forceinline__ constexpr int k_group_stride() { return F == kQ4_K ? 32 : 64; }
template <int F> __device__ __forceinline__ long long k_row_bytes(int K) {
  return F == kQ4_K ? K / 2 : K / 4 * 3;
}

// One lane's unit of a K-quant row: its raw bytes, the weights' scale a and offset b per group
// (w = a*q + b), and the column of its group 0 (group 1 starts k_group_stride further).
template <int F>
struct KUnit {
  uint4 raw[F == kQ4_K ? 1 : 2];
  float a[2], b[2];
  int k0;
  int shift;     // Q6_K: the qh bits of group 0 (group 1's are 4 higher)
};

__device__ __forceinline__ unsigned byte_of(const uint4& v, int i) {   // byte i (0..15) of v
  return (word(v, i >> 2) >> (8 * (i & 3))) & 0xffu;
}

// Q4_K sub-block `is` (0..7): its 6-bit scale and min from the header's 12 bytes (from byte 4),
// as ggml's get_scale_min_k4.
__device__ __forceinline__ void q4_k_scale_min(const uint4& head, int is, float& sc, float& mn) {
  if (is < 4) {
    sc = float(byte_of(head, 4 + is) & 63u);
    mn = float(byte_of(head, 8 + is) & 63u);
  } else {
    sc = float((byte_of(head, 8 + is) & 0xfu) | ((byte_of(head, is) >> 6) << 4));
    mn = float((byte_of(head, 8 + is) >> 4) | ((byte_of(head, 4 + is) >> 6) << 4));
  }
}

template <int F>
__device__ __forceinline__ void k_unit_load(KUnit<F>& unit, const unsigned char* __restrict__ quants,
                                            const unsigned char* __restrict__ heads, long long row, int K, int u) {
  const int supers = K / kSuperBlock;
  if (F == kQ4_K) {
    const int s = u >> 3, j = (u >> 1) & 3, h = u & 1;
    unit.raw[0] = reinterpret_cast<const uint4*>(quants + row * k_row_bytes<F>(K))[u];
    const uint4 head = *reinterpret_cast<const uint4*>(heads + (row * supers + s) * 16);
    const float d = __half2float(__ushort_as_half((unsigned short)(head.x & 0xffffu)));
    const float dmin = __half2float(__ushort_as_half((unsigned short)(head.x >> 16)));
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      float sc, mn;
      q4_k_scale_min(head, 2 * j + g, sc, mn);
      unit.a[g] = d * sc;
      unit.b[g] = -(dmin * mn);
    }
    unit.k0 = s * kSuperBlock + 64 * j + 16 * h;
    unit.shift = 0;
  } else {
    // ggml: ql byte 64n + 32p + l holds column 128n + 32p + l (low nibble) and that + 64 (high);
    // qh byte 32n + l bits 2t, 2t+1 column 128n + 32t + l; scale 8n + l/16 + 2t of that column
    const int s = u >> 3, n = (u >> 2) & 1, p = (u >> 1) & 1, l0 = 16 * (u & 1);
    const unsigned char* block = quants + row * k_row_bytes<F>(K) + s * 192;
    unit.raw[0] = *reinterpret_cast<const uint4*>(block + 64 * n + 32 * p + l0);
    unit.raw[1] = *reinterpret_cast<const uint4*>(block + 128 + 32 * n + l0);
    const unsigned char* head = heads + (row * supers + s) * 18;
    const float d = __half2float(*reinterpret_cast<const __half*>(head + 16));
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      unit.a[g] = d * float((signed char)head[8 * n + (l0 >> 4) + 2 * (p + 2 * g)]);
      unit.b[g] = 0.0f;
    }
    unit.k0 = s * kSuperBlock + 128 * n + 32 * p + l0;
    unit.shift = 2 * p;
  }
}

// Weights 4i..4i+3 of group g of a unit, dequantized: Q4_K fmaf(a, q, b) = (d*sc)*q - dmin*mn
// rounded once, Q6_K a * (q - 32); the twin's float32 values (d*sc and dmin*mn are exact).
template <int F>
__device__ __forceinline__ void k_unit_weights(const KUnit<F>& unit, int g, int i, float (&w)[4]) {
  const float a = g ? unit.a[1] : unit.a[0], b = g ? unit.b[1] : unit.b[0];   // no local array for a variable g
  unsigned bits;
  if (F == kQ4_K) {
    bits = (word(unit.raw[0], i) >> (4 * g)) & 0x0f0f0f0fu;
  } else {
    const unsigned low = (word(unit.raw[0], i) >> (4 * g)) & 0x0f0f0f0fu;            // ql nibbles
    const unsigned high = ((word(unit.raw[1], i) >> (unit.shift + 4 * g)) & 0x03030303u) << 4;  // qh bits
    bits = low | high;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (F == kQ4_K) {
      w[j] = fmaf(a, small_uint_to_float((bits >> (8 * j)) & 0xffu, 8388608.0f), b);
    } else {
      w[j] = a * small_uint_to_float((bits >> (8 * j)) & 0xffu, 8388608.0f + 32.0f);
    }
  }
}

// The K-quant GEMV: matmul_q_gemv's grid and reduction, a unit per lane a step.
template <int F, int MR, class T, class O>
__device__ void matmul_qk_gemv(O* __restrict__ out, const T* __restrict__ x, const unsigned char* __restrict__ quants,
                               const unsigned char* __restrict__ heads, int M, int N, int K, int x_stride) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int m0 = blockIdx.x * MR, rows = min(MR, M - m0);
  const int units = K / kUnitWeights;
  const T* xs = x + (long long)m0 * x_stride;
  float acc[kRowsPerWarp][MR];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int m = 0; m < MR; ++m) acc[r][m] = 0.0f;

  const int n_first = blockIdx.y * kRowsPerBlock + warp * kRowsPerWarp;
  const int n_last = min(n_first + kRowsPerWarp, N);
  for (int u = lane; u < units && n_first < N; u += 32) {
    KUnit<F> unit[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) k_unit_load<F>(unit[r], quants, heads, min(n_first + r, n_last - 1), K, u);
    const int k0 = unit[0].k0;
#pragma unroll 1   // the groups one after the other: unrolled, Q6_K needs 100 registers at MR = 4
    for (int g = 0; g < 2; ++g) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float w[kRowsPerWarp][4];
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) k_unit_weights<F>(unit[r], g, i, w[r]);
#pragma unroll
        for (int m = 0; m < MR; ++m) {
          if (m >= rows) break;
          float xa[4];
          load4(xs + (long long)m * x_stride + k0 + k_group_stride<F>() * g + 4 * i, xa);
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int r = 0; r < kRowsPerWarp; ++r) acc[r][m] = fmaf(xa[j], w[r][j], acc[r][m]);
        }
      }
    }
  }
  store_sums<MR>(out, acc, M, N);
}

template <int F, class T>
__device__ void dequantize_k_row(T* __restrict__ out, const unsigned char* __restrict__ quants,
                                 const unsigned char* __restrict__ heads, long long row, int K) {
  const int lane = threadIdx.x & 31, units = K / kUnitWeights;
  for (int u = lane; u < units; u += 32) {
    KUnit<F> unit;
    k_unit_load<F>(unit, quants, heads, row, K, u);
#pragma unroll
    for (int g = 0; g < 2; ++g)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float w[4];
        k_unit_weights<F>(unit, g, i, w);
#pragma unroll
        for (int j = 0; j < 4; ++j) out[unit.k0 + k_group_stride<F>() * g + 4 * i + j] = from_float<T>(w[j]);
      }
  }
}

template <int F, class T>
__device__ void dequantize_k_rows(T* __restrict__ out, const unsigned char* __restrict__ quants,
                                  const unsigned char* __restrict__ heads, const int* __restrict__ ids, int rows, int K) {
  const int i = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (i < rows) dequantize_k_row<F, T>(out + (long long)i * K, quants, heads, ids[i], K);
}

template <int F, class T>
__device__ void dequantize_k_range(T* __restrict__ out, const unsigned char* __restrict__ quants,
                                   const unsigned char* __restrict__ heads, int first_row, int rows, int K) {
  const int i = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (i < rows) dequantize_k_row<F, T>(out + (long long)i * K, quants, heads, first_row + i, K);
}

}  // namespace ember

// Entries: matmul_q_<fmt>_r<MR>[_f32out]_<x dtype> (output in x's dtype, or float32 for the LM
// head), dequantize_{rows,range}_<fmt>_<out dtype>. Launch with kWarps * 32 = 128 threads.
// K-quant entries take their scales as bytes (S = unsigned char) and the K-quant functions.
#define EMBER_MATMUL_Q_GEMV(fmt, F, MR, name, T, O, S, gemv)                                         \
  extern "C" __global__ void __launch_bounds__(128) matmul_q_##fmt##_r##MR##name(                    \
      O* out, const T* x, const unsigned char* quants, const S* scales, int M, int N, int K,         \
      int x_stride) {                                                                                \
    ember::gemv<F, MR, T, O>(out, x, quants, scales, M, N, K, x_stride);                             \
  }
#define EMBER_MATMUL_Q_FORMAT(fmt, F, S, gemv, rows_fn, range_fn)                                    \
  EMBER_MATMUL_Q_GEMV(fmt, F, 1, _f32, float, float, S, gemv)                                        \
  EMBER_MATMUL_Q_GEMV(fmt, F, 1, _f16, __half, __half, S, gemv)                                      \
  EMBER_MATMUL_Q_GEMV(fmt, F, 1, _bf16, __nv_bfloat16, __nv_bfloat16, S, gemv)                       \
  EMBER_MATMUL_Q_GEMV(fmt, F, 1, _f32out_f16, __half, float, S, gemv)                                \
  EMBER_MATMUL_Q_GEMV(fmt, F, 1, _f32out_bf16, __nv_bfloat16, float, S, gemv)                        \
  EMBER_MATMUL_Q_GEMV(fmt, F, 4, _f32, float, float, S, gemv)                                        \
  EMBER_MATMUL_Q_GEMV(fmt, F, 4, _f16, __half, __half, S, gemv)                                      \
  EMBER_MATMUL_Q_GEMV(fmt, F, 4, _bf16, __nv_bfloat16, __nv_bfloat16, S, gemv)                       \
  EMBER_MATMUL_Q_GEMV(fmt, F, 4, _f32out_f16, __half, float, S, gemv)                                \
  EMBER_MATMUL_Q_GEMV(fmt, F, 4, _f32out_bf16, __nv_bfloat16, float, S, gemv)                        \
  EMBER_DEQUANTIZE(fmt, F, f32, float, S, rows_fn, range_fn)                                         \
  EMBER_DEQUANTIZE(fmt, F, f16, __half, S, rows_fn, range_fn)                                        \
  EMBER_DEQUANTIZE(fmt, F, bf16, __nv_bfloat16, S, rows_fn, range_fn)
#define EMBER_DEQUANTIZE(fmt, F, suffix, T, S, rows_fn, range_fn)                                    \
  extern "C" __global__ void __launch_bounds__(128) dequantize_rows_##fmt##_##suffix(                \
      T* out, const unsigned char* quants, const S* scales, const int* ids, int rows, int K) {       \
    ember::rows_fn<F, T>(out, quants, scales, ids, rows, K);                                         \
  }                                                                                                  \
  extern "C" __global__ void __launch_bounds__(128) dequantize_range_##fmt##_##suffix(               \
      T* out, const unsigned char* quants, const S* scales, int first_row, int rows, int K) {        \
    ember::range_fn<F, T>(out, quants, scales, first_row, rows, K);                                  \
  }
#define EMBER_BLOCK_FORMAT(fmt, F) \
  EMBER_MATMUL_Q_FORMAT(fmt, F, __half, matmul_q_gemv, dequantize_rows, dequantize_range)
#define EMBER_K_FORMAT(fmt, F) \
  EMBER_MATMUL_Q_FORMAT(fmt, F, unsigned char, matmul_qk_gemv, dequantize_k_rows, dequantize_k_range)
EMBER_BLOCK_FORMAT(q8_0, ember::kQ8_0)
EMBER_BLOCK_FORMAT(q4_0, ember::kQ4_0)
EMBER_BLOCK_FORMAT(q4_1, ember::kQ4_1)
EMBER_K_FORMAT(q4_k, ember::kQ4_K)
EMBER_K_FORMAT(q6_k, ember::kQ6_K)
