// attention.cu -- paged causal attention over a flattened varlen batch: decode (q_len = 1) and
// chunked prefill (q_len > 1, attending to cached pages + the new chunk) in one kernel.
//
// Sequence s owns query rows [query_start_loc[s], query_start_loc[s+1]), the last q_len tokens
// of its context of context_lens[s] tokens; query i attends keys 0 .. position = context_len - q_len + i,
// or with a sliding window > 0 only the `window` keys position - window + 1 .. position.
// K/V pages [num_blocks, block_size, Hk, D] are read through block_tables[s].
//
// One block per (query token, KV head) serves the whole GQA group of that head, so each K/V row
// is read once per group. Keys are visited in tiles of kTile with a one-pass online softmax:
//   1. scores: thread j computes q.k of key j of the tile for every head of the group;
//   2. softmax: warp w updates the running max/sum of group heads w, w + warps, ...;
//   3. values: thread t accumulates elements t, t + blockDim of the [group, D] output.
// NumPy twin: ember_cupy/ops/attention.py.
#include "common.cuh"

namespace ember {

constexpr int kAttentionThreads = 128;
constexpr int kTile = 128;  // keys per tile
constexpr int kGroupChunk = 8;
constexpr int kMaxAccumulators = 16;  // group * head_dim <= kAttentionThreads * kMaxAccumulators

__device__ __forceinline__ int sequence_of(const int* query_start_loc, int num_seqs, int token) {
  int lo = 0, hi = num_seqs - 1;  // the last s with query_start_loc[s] <= token
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (query_start_loc[mid] <= token) lo = mid; else hi = mid - 1;
  }
  return lo;
}

struct AttentionShared {
  float* q;        // [group, D], pre-scaled
  float* probs;    // [group, kTile]: scores, then probabilities
  float* max;      // [group] running max
  float* sum;      // [group] running sum of exp
  float* rescale;  // [group] exp(old max - new max) of this tile
  int* slots;      // [kTile] cache slot of each key of the tile
};

__device__ __forceinline__ AttentionShared carve(float* base, int group, int head_dim) {
  AttentionShared s;
  s.q = base;
  s.probs = s.q + group * head_dim;
  s.max = s.probs + group * kTile;
  s.sum = s.max + group;
  s.rescale = s.sum + group;
  s.slots = reinterpret_cast<int*>(s.rescale + group);
  return s;
}

// Step 1: thread j scores key first + j against every head of the group (no cross-thread
// reduction); group heads are taken kGroupChunk at a time to bound the registers.
template <class T>
__device__ void tile_scores(const AttentionShared& s, const T* k_cache, const int* table, int first, int n,
                            int group, int head_dim, int block_size, long long kv_offset, int row) {
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const int key = first + j;
    const int slot = table[key / block_size] * block_size + key % block_size;
    const T* k = k_cache + (long long)slot * row + kv_offset;
    s.slots[j] = slot;
    for (int g0 = 0; g0 < group; g0 += kGroupChunk) {
      float dot[kGroupChunk];
#pragma unroll
      for (int c = 0; c < kGroupChunk; ++c) dot[c] = 0.0f;
      for (int d = 0; d < head_dim; ++d) {
        const float kd = to_float(k[d]);
#pragma unroll
        for (int c = 0; c < kGroupChunk; ++c)
          if (g0 + c < group) dot[c] += s.q[(g0 + c) * head_dim + d] * kd;
      }
#pragma unroll
      for (int c = 0; c < kGroupChunk; ++c)
        if (g0 + c < group) s.probs[(g0 + c) * kTile + j] = dot[c];
    }
  }
}

// Step 2: scores -> exp(score - new max); update running max and sum; record the rescale.
__device__ __forceinline__ void tile_softmax(const AttentionShared& s, int n, int group) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int g = threadIdx.x >> 5; g < group; g += warps) {
    float* p = s.probs + g * kTile;
    float tile_max = neg_inf();
    for (int j = lane; j < n; j += 32) tile_max = fmaxf(tile_max, p[j]);
    const float old_max = s.max[g];
    const float new_max = fmaxf(old_max, warp_max(tile_max));
    float tile_sum = 0.0f;
    for (int j = lane; j < n; j += 32) {
      p[j] = expf(p[j] - new_max);
      tile_sum += p[j];
    }
    tile_sum = warp_sum(tile_sum);
    __syncwarp();  // every lane has read s.max[g] before lane 0 updates it
    if (lane == 0) {
      const float rescale = expf(old_max - new_max);
      s.rescale[g] = rescale;
      s.sum[g] = s.sum[g] * rescale + tile_sum;
      s.max[g] = new_max;
    }
  }
}

// Step 3: acc = acc * rescale + probs @ V over the tile's keys.
template <class T>
__device__ __forceinline__ void tile_values(const AttentionShared& s, float (&acc)[kMaxAccumulators],
                                            const T* v_cache, int n, int group, int head_dim,
                                            long long kv_offset, int row) {
  const int total = group * head_dim;
#pragma unroll
  for (int c = 0; c < kMaxAccumulators; ++c) {
    const int e = threadIdx.x + c * blockDim.x;
    if (e < total) acc[c] *= s.rescale[e / head_dim];
  }
  for (int j = 0; j < n; ++j) {
    const T* v = v_cache + (long long)s.slots[j] * row + kv_offset;
#pragma unroll
    for (int c = 0; c < kMaxAccumulators; ++c) {
      const int e = threadIdx.x + c * blockDim.x;
      if (e < total) acc[c] += s.probs[(e / head_dim) * kTile + j] * to_float(v[e % head_dim]);
    }
  }
}

template <class T>
__device__ void paged_attention(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ k_cache,
                                const T* __restrict__ v_cache, const int* __restrict__ block_tables,
                                const int* __restrict__ context_lens, const int* __restrict__ query_start_loc,
                                int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                                int max_blocks, int q_token_stride, int q_head_stride, float scale,
                                int window) {
  const int token = blockIdx.x, kv_head = blockIdx.y, group = num_heads / num_kv_heads;
  const int seq = sequence_of(query_start_loc, num_seqs, token);
  const int q_start = query_start_loc[seq], q_len = query_start_loc[seq + 1] - q_start;
  const int num_keys = context_lens[seq] - q_len + (token - q_start) + 1;
  const int first_key = window > 0 ? max(num_keys - window, 0) : 0;
  const int* table = block_tables + (long long)seq * max_blocks;
  const int row = num_kv_heads * head_dim;
  const long long kv_offset = (long long)kv_head * head_dim;

  EMBER_DYNAMIC_SHARED(float, base);
  const AttentionShared s = carve(base, group, head_dim);
  for (int e = threadIdx.x; e < group * head_dim; e += blockDim.x) {
    const int head = kv_head * group + e / head_dim;
    s.q[e] = to_float(q[(long long)token * q_token_stride + head * q_head_stride + e % head_dim]) * scale;
  }
  for (int g = threadIdx.x; g < group; g += blockDim.x) {
    s.max[g] = neg_inf();
    s.sum[g] = 0.0f;
  }
  float acc[kMaxAccumulators];
#pragma unroll
  for (int c = 0; c < kMaxAccumulators; ++c) acc[c] = 0.0f;
  __syncthreads();

  for (int first = first_key; first < num_keys; first += kTile) {
    const int n = min(kTile, num_keys - first);
    tile_scores(s, k_cache, table, first, n, group, head_dim, block_size, kv_offset, row);
    __syncthreads();
    tile_softmax(s, n, group);
    __syncthreads();
    tile_values(s, acc, v_cache, n, group, head_dim, kv_offset, row);
    __syncthreads();
  }

  T* dst = out + ((long long)token * num_heads + kv_head * group) * head_dim;
#pragma unroll
  for (int c = 0; c < kMaxAccumulators; ++c) {
    const int e = threadIdx.x + c * blockDim.x;
    if (e < group * head_dim) dst[e] = from_float<T>(acc[c] / s.sum[e / head_dim]);
  }
}

}  // namespace ember

#define EMBER_ATTENTION_ENTRIES(suffix, T)                                                        \
  extern "C" __global__ void __launch_bounds__(ember::kAttentionThreads) paged_attention_##suffix( \
      T* out, const T* q, const T* k_cache, const T* v_cache, const int* block_tables,           \
      const int* context_lens, const int* query_start_loc, int num_seqs, int num_heads,          \
      int num_kv_heads, int head_dim, int block_size, int max_blocks, int q_token_stride,        \
      int q_head_stride, float scale, int window) {                                               \
    ember::paged_attention<T>(out, q, k_cache, v_cache, block_tables, context_lens,              \
                              query_start_loc, num_seqs, num_heads, num_kv_heads, head_dim,      \
                              block_size, max_blocks, q_token_stride, q_head_stride, scale,      \
                              window);                                                           \
  }
EMBER_FOR_EACH_DTYPE(EMBER_ATTENTION_ENTRIES)
