// attention_prefill.cu -- paged attention of prefill / chunked-prefill rows (q_len > 1), tiled as
// FlashAttention-2: one block per (query tile, KV head), K/V tiles staged in shared memory, an
// online softmax per query row. Batch layout and masking: attention_common.cuh. NumPy twin:
// ember_cupy/ops/attention.py. Decode rows (q_len = 1) are attention_decode.cu's.
//
// A query tile is kPrefillRows (token, head) rows of one sequence: kPrefillRows / group tokens x
// the group's heads, so every K/V tile is read once for the whole GQA group. Block x is the x-th
// tile of the batch's prefill sequences in order (blocks past the last tile exit). The tile
// attends keys from its first token's first visible key to its last token's position, in K/V
// tiles of kKeys keys at multiples of kKeys from position 0 (so a row's reduction order is its
// own, whatever tile, chunk or batch holds it): load K/V -> S = scale * Q K^T -> masked online
// softmax -> O += P V.
// Warps: kPrefillRows / 16 row groups x kColumnWarps, each warp owning 16 rows x 64 output
// columns (32 accumulators per thread). f16/bf16 on sm_80+ compute S and P V with mma.sync
// m16n8k16 (fp32 accumulate); everything else (f32, and the CPU shim) takes the portable path.
#include "attention_common.cuh"

namespace ember {

constexpr int kPrefillRows = 64;  // (token, head) rows per query tile
constexpr int kWarpRows = 16;     // rows per warp (the mma M)
constexpr int kWarpColumns = 64;  // output columns per warp

// (kPrefillRows / kWarpRows) row groups x (head_dim / kWarpColumns) column warps.
__host__ __device__ constexpr int prefill_threads(int head_dim) { return 32 * (kPrefillRows / kWarpRows) * (head_dim / kWarpColumns); }

template <class T, int kHeadDim>
struct PrefillLayout {
  static constexpr int kKeys = sizeof(T) * kHeadDim > 512 ? 16 : 32;  // K/V tile <= 32 KiB in all
  static constexpr int kScoreStride = kKeys + 4;                      // floats per S row
  static constexpr int kColumnWarps = kHeadDim / kWarpColumns;
  static constexpr int kThreads = prefill_threads(kHeadDim);
  static constexpr int kVec = int(16 / sizeof(T));
  static_assert(kHeadDim % kWarpColumns == 0, "head_dim: a multiple of 64");
};

// Rows of the tile: row r is token first_token + r / group, query head kv_head * group + r % group.
struct PrefillTile {
  int seq, first_token, rows, group, first_position, first_key, end_key, window;
  __device__ int position(int r) const { return first_position + r / group; }
  __device__ bool visible(int r, int key) const {
    return r < rows && key <= position(r) && key >= first_visible_key(position(r), window);
  }
};

// The block's tile, or seq = -1 when the batch has fewer prefill tiles than blocks.
__device__ __forceinline__ PrefillTile find_tile(const int* query_start_loc, const int* context_lens, int num_seqs,
                                                 int group, int window) {
  const int tokens_per_tile = kPrefillRows / group;
  PrefillTile tile;
  tile.seq = -1;
  for (int s = 0, seen = 0; s < num_seqs; ++s) {
    const int q_start = query_start_loc[s], q_len = query_start_loc[s + 1] - q_start;
    const int tiles = q_len > 1 ? (q_len + tokens_per_tile - 1) / tokens_per_tile : 0;
    if (int(blockIdx.x) < seen + tiles) {
      const int offset = (int(blockIdx.x) - seen) * tokens_per_tile;
      tile.seq = s;
      tile.first_token = q_start + offset;
      tile.rows = min(tokens_per_tile, q_len - offset) * group;
      tile.group = group;
      tile.first_position = context_lens[s] - q_len + offset;
      tile.first_key = first_visible_key(tile.first_position, window);
      tile.end_key = tile.position(tile.rows - 1) + 1;
      tile.window = window;
      return tile;
    }
    seen += tiles;
  }
  return tile;
}

__device__ __forceinline__ long long q_row_offset(const PrefillTile& tile, int r, int kv_head, int q_token_stride,
                                                  int q_head_stride) {
  return (long long)(tile.first_token + r / tile.group) * q_token_stride +
         (long long)(kv_head * tile.group + r % tile.group) * q_head_stride;
}

// K/V rows first .. first + kKeys - 1 into shared memory (zeros past end_key), 16-byte vectors.
template <class T, class L, int kHeadDim>
__device__ void load_kv_tile(T* k_tile, T* v_tile, const T* k_cache, const T* v_cache, const int* table,
                             int first, int end_key, int block_size, int row, long long kv_offset) {
  constexpr int kRowVectors = kHeadDim / L::kVec;
  for (int i = threadIdx.x; i < L::kKeys * kRowVectors; i += L::kThreads) {
    const int j = i / kRowVectors, d = (i % kRowVectors) * L::kVec, key = first + j;
    Vec<T, L::kVec> k, v;
    if (key < end_key) {
      const long long at = (long long)cache_slot(table, key, block_size) * row + kv_offset + d;
      k = load_vec<T, L::kVec>(k_cache + at);
      v = load_vec<T, L::kVec>(v_cache + at);
    } else {
#pragma unroll
      for (int e = 0; e < L::kVec; ++e) k.v[e] = v.v[e] = from_float<T>(0.0f);
    }
    *reinterpret_cast<Vec<T, L::kVec>*>(k_tile + j * kHeadDim + d) = k;
    *reinterpret_cast<Vec<T, L::kVec>*>(v_tile + j * kHeadDim + d) = v;
  }
}

// Portable S = scale * Q K^T: thread pairs (row, key) in turn; q read from global memory.
template <class T, class L, int kHeadDim>
__device__ void scores_portable(float* scores, const T* q, const T* k_tile, const PrefillTile& tile, int kv_head,
                                int q_token_stride, int q_head_stride, float scale) {
  for (int i = threadIdx.x; i < kPrefillRows * L::kKeys; i += L::kThreads) {
    const int r = i / L::kKeys, j = i % L::kKeys;
    if (r >= tile.rows) continue;
    const T* qr = q + q_row_offset(tile, r, kv_head, q_token_stride, q_head_stride);
    const T* kr = k_tile + j * kHeadDim;
    float dot = 0.0f;
#pragma unroll 8
    for (int d = 0; d < kHeadDim; ++d) dot += to_float(qr[d]) * to_float(kr[d]);
    scores[r * L::kScoreStride + j] = dot * scale;
  }
}

// Masked online softmax: thread r < kPrefillRows owns row r; S becomes P in place.
template <class L>
__device__ void prefill_softmax(float* scores, float* row_max, float* row_sum, float* rescale,
                                const PrefillTile& tile, int first) {
  const int r = threadIdx.x;
  if (r >= kPrefillRows) return;
  float* p = scores + r * L::kScoreStride;
  const float old_max = row_max[r];
  float new_max = old_max;
  for (int j = 0; j < L::kKeys; ++j)
    if (tile.visible(r, first + j)) new_max = fmaxf(new_max, p[j]);
  float sum = 0.0f;
  for (int j = 0; j < L::kKeys; ++j) {
    p[j] = tile.visible(r, first + j) ? expf(p[j] - new_max) : 0.0f;
    sum += p[j];
  }
  const float scale = exp_shifted(old_max, new_max);
  rescale[r] = scale;
  row_sum[r] = row_sum[r] * scale + sum;
  row_max[r] = new_max;
}

// Portable O = O * rescale + P V: lane owns row (lane / 2) of its warp's 16 and 32 columns.
template <class T, class L, int kHeadDim>
__device__ void values_portable(float (&acc)[32], const float* probs, const float* rescale, const T* v_tile,
                                int warp_row, int warp_column) {
  const int lane = threadIdx.x & 31, r = warp_row + lane / 2, column = warp_column + (lane & 1) * 32;
  const float scale = rescale[r];
#pragma unroll
  for (int c = 0; c < 32; ++c) acc[c] *= scale;
#pragma unroll
  for (int c0 = 0; c0 < 32; c0 += 8) {  // 8 columns at a time: few live registers
#pragma unroll 1
    for (int j = 0; j < L::kKeys; ++j) {
      const float p = probs[r * L::kScoreStride + j];
      const T* v = v_tile + j * kHeadDim + column + c0;
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[c0 + c] += p * to_float(v[c]);
    }
  }
}

template <class T, int kHeadDim>
__device__ void store_portable(T* out, const float (&acc)[32], const float* row_sum, const PrefillTile& tile,
                               int kv_head, int num_heads, int warp_row, int warp_column) {
  const int lane = threadIdx.x & 31, r = warp_row + lane / 2, column = warp_column + (lane & 1) * 32;
  if (r >= tile.rows) return;
  T* dst = out + ((long long)(tile.first_token + r / tile.group) * num_heads + kv_head * tile.group + r % tile.group) *
                     kHeadDim + column;
  for (int c = 0; c < 32; ++c) dst[c] = from_float<T>(acc[c] / row_sum[r]);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// --- tensor cores: mma.sync m16n8k16, A row-major 16x16, B col-major 16x8, C/D fp32 16x8 -------
// Fragments (gid = lane / 4, tid = lane % 4): A a0 (gid, 2tid..+1) a1 (gid+8, 2tid..) a2 (gid, 2tid+8..)
// a3 (gid+8, 2tid+8..); B b0 (k 2tid..+1, n gid) b1 (k 2tid+8..+9, n gid); C c0,c1 (gid, 2tid..+1)
// c2,c3 (gid+8, 2tid..+1). Lower 16 bits hold the lower index.
__device__ __forceinline__ unsigned short bits16(__half x) { return __half_as_ushort(x); }
__device__ __forceinline__ unsigned short bits16(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }

template <class T>
__device__ __forceinline__ unsigned pack2(T lo, T hi) {
  return unsigned(bits16(lo)) | (unsigned(bits16(hi)) << 16);
}

__device__ __forceinline__ void mma_16816(float* c, const unsigned (&a)[4], const unsigned (&b)[2], __half) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void mma_16816(float* c, const unsigned (&a)[4], const unsigned (&b)[2],
                                          __nv_bfloat16) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The warp's share of S: its 16 rows x (kKeys / kColumnWarps) keys, n-tiles of 8 keys.
template <class T, class L, int kHeadDim>
__device__ void scores_mma(float* scores, const T* q, const T* k_tile, const PrefillTile& tile, int kv_head,
                           int q_token_stride, int q_head_stride, float scale, int warp_row, int column_warp) {
  constexpr int kTiles = L::kKeys / 8 / L::kColumnWarps;
  const int lane = threadIdx.x & 31, gid = lane >> 2, tid = lane & 3;
  const int r0 = warp_row + gid, r1 = r0 + 8;
  const T* q0 = q + (r0 < tile.rows ? q_row_offset(tile, r0, kv_head, q_token_stride, q_head_stride) : 0);
  const T* q1 = q + (r1 < tile.rows ? q_row_offset(tile, r1, kv_head, q_token_stride, q_head_stride) : 0);
  const T zero = from_float<T>(0.0f);
#pragma unroll 1
  for (int n = 0; n < kTiles; ++n) {  // one n-tile at a time: few live registers
    const int key = (column_warp * kTiles + n) * 8;
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 1
    for (int k = 0; k < kHeadDim; k += 16) {
      const int d = k + 2 * tid;
      const unsigned a[4] = {r0 < tile.rows ? pack2(q0[d], q0[d + 1]) : pack2(zero, zero),
                             r1 < tile.rows ? pack2(q1[d], q1[d + 1]) : pack2(zero, zero),
                             r0 < tile.rows ? pack2(q0[d + 8], q0[d + 9]) : pack2(zero, zero),
                             r1 < tile.rows ? pack2(q1[d + 8], q1[d + 9]) : pack2(zero, zero)};
      const T* kr = k_tile + (key + gid) * kHeadDim + d;
      const unsigned b[2] = {*reinterpret_cast<const unsigned*>(kr), *reinterpret_cast<const unsigned*>(kr + 8)};
      mma_16816(c, a, b, T());
    }
    const int j = key + 2 * tid;
    scores[r0 * L::kScoreStride + j] = c[0] * scale;
    scores[r0 * L::kScoreStride + j + 1] = c[1] * scale;
    scores[r1 * L::kScoreStride + j] = c[2] * scale;
    scores[r1 * L::kScoreStride + j + 1] = c[3] * scale;
  }
}

// O (16 rows x 64 columns: 8 n-tiles of 4 accumulators) = O * rescale + P V.
template <class T, class L, int kHeadDim>
__device__ void values_mma(float (&acc)[32], const float* probs, const float* rescale, const T* v_tile,
                           int warp_row, int warp_column) {
  const int lane = threadIdx.x & 31, gid = lane >> 2, tid = lane & 3;
  const int r0 = warp_row + gid, r1 = r0 + 8;
  const float s0 = rescale[r0], s1 = rescale[r1];
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    acc[4 * n] *= s0;
    acc[4 * n + 1] *= s0;
    acc[4 * n + 2] *= s1;
    acc[4 * n + 3] *= s1;
  }
#pragma unroll
  for (int k = 0; k < L::kKeys; k += 16) {
    const float* p0 = probs + r0 * L::kScoreStride + k + 2 * tid;
    const float* p1 = probs + r1 * L::kScoreStride + k + 2 * tid;
    const unsigned a[4] = {pack2(from_float<T>(p0[0]), from_float<T>(p0[1])),
                           pack2(from_float<T>(p1[0]), from_float<T>(p1[1])),
                           pack2(from_float<T>(p0[8]), from_float<T>(p0[9])),
                           pack2(from_float<T>(p1[8]), from_float<T>(p1[9]))};
    const T* v = v_tile + (k + 2 * tid) * kHeadDim + warp_column + gid;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const unsigned b[2] = {pack2(v[n * 8], v[kHeadDim + n * 8]),
                             pack2(v[8 * kHeadDim + n * 8], v[9 * kHeadDim + n * 8])};
      mma_16816(acc + 4 * n, a, b, T());
    }
  }
}

template <class T, int kHeadDim>
__device__ void store_mma(T* out, const float (&acc)[32], const float* row_sum, const PrefillTile& tile,
                          int kv_head, int num_heads, int warp_row, int warp_column) {
  const int lane = threadIdx.x & 31, gid = lane >> 2, tid = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = warp_row + gid + 8 * half;
    if (r >= tile.rows) continue;
    const float inv = 1.0f / row_sum[r];
    T* dst = out + ((long long)(tile.first_token + r / tile.group) * num_heads + kv_head * tile.group +
                    r % tile.group) * kHeadDim + warp_column + 2 * tid;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      dst[n * 8] = from_float<T>(acc[4 * n + 2 * half] * inv);
      dst[n * 8 + 1] = from_float<T>(acc[4 * n + 2 * half + 1] * inv);
    }
  }
}
#define EMBER_PREFILL_MMA(T) (sizeof(T) == 2)
#else
#define EMBER_PREFILL_MMA(T) false
#endif

template <class T, int kHeadDim>
__device__ void prefill_attention(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ k_cache,
                                  const T* __restrict__ v_cache, const int* __restrict__ block_tables,
                                  const int* __restrict__ context_lens, const int* __restrict__ query_start_loc,
                                  int num_seqs, int num_heads, int num_kv_heads, int block_size, int max_blocks,
                                  int q_token_stride, int q_head_stride, float scale, int window) {
  using L = PrefillLayout<T, kHeadDim>;
  const int kv_head = blockIdx.y, group = num_heads / num_kv_heads;
  const PrefillTile tile = find_tile(query_start_loc, context_lens, num_seqs, group, window);
  if (tile.seq < 0) return;
  const int* table = block_tables + (long long)tile.seq * max_blocks;
  const int row = num_kv_heads * kHeadDim;
  const long long kv_offset = (long long)kv_head * kHeadDim;
  const int warp = threadIdx.x >> 5;
  const int warp_row = (warp / L::kColumnWarps) * kWarpRows, column_warp = warp % L::kColumnWarps;
  const int warp_column = column_warp * kWarpColumns;

  EMBER_DYNAMIC_SHARED(float, base);
  float* scores = base;                                  // [kPrefillRows, kScoreStride]
  float* row_max = scores + kPrefillRows * L::kScoreStride;
  float* row_sum = row_max + kPrefillRows;
  float* rescale = row_sum + kPrefillRows;
  T* k_tile = reinterpret_cast<T*>(rescale + kPrefillRows);  // [kKeys, head_dim]
  T* v_tile = k_tile + L::kKeys * kHeadDim;

  for (int r = threadIdx.x; r < kPrefillRows; r += L::kThreads) {
    row_max[r] = neg_inf();
    row_sum[r] = 0.0f;
  }
  float acc[32];
#pragma unroll
  for (int c = 0; c < 32; ++c) acc[c] = 0.0f;

  // Key tiles at multiples of kKeys from position 0, not from the tile's first key: a row's tiles
  // (its reduction order) then do not depend on which query tile, chunk or batch it is in; the
  // keys before a row's window or after its position are masked, exact no-ops for it.
  for (int first = tile.first_key / L::kKeys * L::kKeys; first < tile.end_key; first += L::kKeys) {
    load_kv_tile<T, L, kHeadDim>(k_tile, v_tile, k_cache, v_cache, table, first, tile.end_key, block_size, row,
                                 kv_offset);
    __syncthreads();
    if constexpr (EMBER_PREFILL_MMA(T)) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
      scores_mma<T, L, kHeadDim>(scores, q, k_tile, tile, kv_head, q_token_stride, q_head_stride, scale, warp_row,
                                 column_warp);
#endif
    } else {
      scores_portable<T, L, kHeadDim>(scores, q, k_tile, tile, kv_head, q_token_stride, q_head_stride, scale);
    }
    __syncthreads();
    prefill_softmax<L>(scores, row_max, row_sum, rescale, tile, first);
    __syncthreads();
    if constexpr (EMBER_PREFILL_MMA(T)) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
      values_mma<T, L, kHeadDim>(acc, scores, rescale, v_tile, warp_row, warp_column);
#endif
    } else {
      values_portable<T, L, kHeadDim>(acc, scores, rescale, v_tile, warp_row, warp_column);
    }
    __syncthreads();
  }
  if constexpr (EMBER_PREFILL_MMA(T)) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    store_mma<T, kHeadDim>(out, acc, row_sum, tile, kv_head, num_heads, warp_row, warp_column);
#endif
  } else {
    store_portable<T, kHeadDim>(out, acc, row_sum, tile, kv_head, num_heads, warp_row, warp_column);
  }
}

}  // namespace ember

// No __launch_bounds__: with it ptxas spends up to 128 registers (over the 96 budget) or spills;
// without it every entry takes <= 96 (tools/check_kernels.py), so even 512 threads launch.
#define EMBER_PREFILL_ENTRY(suffix, T, D)                                                              \
  extern "C" __global__ void                                                                           \
      paged_attention_prefill_d##D##_##suffix(                                                         \
          T* out, const T* q, const T* k_cache, const T* v_cache, const int* block_tables,             \
          const int* context_lens, const int* query_start_loc, int num_seqs, int num_heads,            \
          int num_kv_heads, int block_size, int max_blocks, int q_token_stride, int q_head_stride,     \
          float scale, int window) {                                                                   \
    ember::prefill_attention<T, D>(out, q, k_cache, v_cache, block_tables, context_lens,               \
                                   query_start_loc, num_seqs, num_heads, num_kv_heads, block_size,     \
                                   max_blocks, q_token_stride, q_head_stride, scale, window);          \
  }
#define EMBER_PREFILL_ENTRIES(suffix, T) \
  EMBER_PREFILL_ENTRY(suffix, T, 64) EMBER_PREFILL_ENTRY(suffix, T, 128) EMBER_PREFILL_ENTRY(suffix, T, 256)
EMBER_FOR_EACH_DTYPE(EMBER_PREFILL_ENTRIES)
