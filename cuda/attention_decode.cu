// attention_decode.cu -- paged attention of single query rows (decode; also any row of a prefill
// when head_dim has no tiled prefill instantiation, or when the caller asks for one reduction
// order per query, deterministic mode), with split-KV (flash-decoding) and its merge.
// Batch layout and masking: attention_common.cuh. NumPy twin: ember_cupy/ops/attention.py.
//
// Grid (rows, KV heads, splits). all_rows = 0: block x is sequence row_base + x, served only when
// its q_len is 1 (a decode); all_rows = 1: block x is query row row_base + x of any sequence. One
// block serves the whole GQA group of its KV head, so each K/V row is read once per group.
//
// Split-KV, one partition per query (batch invariance): a row's visible keys are cut into parts
// of `span` keys at multiples of span from position 0, span = split_keys doubled until at most
// kMaxSplits parts remain (decode_row). Nothing of it depends on the batch, the grid or the
// device, so a query gets the same float operations alone, in any batch and as any row kind.
// Block z serves part z of its row (blocks past the row's parts exit; grid z is an upper bound);
// a one-part row writes its output, the others write their unnormalised output, running max and
// sum to part_out / part_stats, which merge_splits combines in part order.
//
// Thread layout: a K/V row of head_dim elements is read by a segment of kLanes lanes, each with
// kRowVectors 16-byte vectors (kVec elements), so a warp reads whole rows contiguously. Segments
// are spread over the group's heads (a lane keeps its slice of q and of the output, for up to
// kHeadSlots heads, in registers) and over key classes r = 0 .. R-1 (keys j = r mod R). Per
// tile of kDecodeTile keys: scores (dot over the lane's slice, reduced across the segment by
// shuffles) -> online softmax per head -> values (p * V into the registers). kUnroll rows are
// loaded before they are used, to keep several loads in flight.
#include "attention_common.cuh"

namespace ember {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeTile = 64;   // keys per tile
constexpr int kMaxSplits = 32;   // parts per query row at most (ops/attention.py MAX_DECODE_SPLITS)
// __launch_bounds__(128, 5): with it ptxas keeps every entry within the 96-register budget on
// sm_80 and sm_90 without spills (measured: 56-78); without the minimum, NVRTC's sm_80 generic
// f32 entry took 104.
constexpr int kDecodeMinBlocks = 5;
constexpr int kSlotFloats = 8;    // floats of q (and of the output) a thread keeps per row

// A query row of the launch and its key parts: a function of the row's own sequence only.
struct DecodeRow {
  int seq, token, q_len, num_keys, first_key, span, first_part, parts;
  __device__ int part_begin(int z) const { return max(first_key, (first_part + z) * span); }
  __device__ int part_end(int z) const { return min(num_keys, (first_part + z + 1) * span); }
};

__device__ __forceinline__ DecodeRow decode_row(const int* context_lens, const int* query_start_loc, int num_seqs,
                                                int row, int all_rows, int window, int split_keys) {
  DecodeRow r;
  r.seq = all_rows ? sequence_of(query_start_loc, num_seqs, row) : row;
  const int q_start = query_start_loc[r.seq];
  r.q_len = query_start_loc[r.seq + 1] - q_start;
  r.token = all_rows ? row : q_start;
  r.num_keys = context_lens[r.seq] - r.q_len + (r.token - q_start) + 1;
  r.first_key = first_visible_key(r.num_keys - 1, window);
  r.span = split_keys;
  while ((r.num_keys - 1) / r.span - r.first_key / r.span + 1 > kMaxSplits) r.span *= 2;
  r.first_part = r.first_key / r.span;
  r.parts = (r.num_keys - 1) / r.span - r.first_part + 1;
  return r;
}

template <class T, int kHeadDim>  // kHeadDim = 0: any head_dim <= 128, element loads
struct DecodeLayout {
  static constexpr bool kGeneric = kHeadDim == 0;
  static constexpr int kVec = kGeneric ? 1 : int(16 / sizeof(T));
  static constexpr int kVectors = kGeneric ? 128 : kHeadDim / kVec;           // per row
  static constexpr int kLanes = kVectors < 32 ? kVectors : 32;                 // per row
  static constexpr int kRowVectors = kVectors / kLanes;                        // per lane
  static constexpr int kSegments = kDecodeThreads / kLanes;
  static constexpr int kHeadSlots = kSlotFloats / (kVec * kRowVectors);
  static constexpr int kUnroll = kRowVectors >= 4 ? 1 : 4 / kRowVectors;
  static_assert(kGeneric || kHeadDim % (kVec * kLanes) == 0, "head_dim: a power of two >= 8 vectors");
  static_assert(kHeadSlots >= 1, "a thread must hold at least one head's slice");
};

// Which heads, key class and elements a thread owns (all block-uniform but lane/seg).
struct DecodeThread {
  int group, heads_per_segment, classes, head0, key_class, lane, segments;
  bool active;
  __device__ int head(int a) const { return head0 + a * segments; }
  __device__ bool owns(int a) const { return a < heads_per_segment && head(a) < group; }
};

template <class L>
__device__ __forceinline__ DecodeThread decode_thread(int group) {
  DecodeThread t;
  const int segment = threadIdx.x / L::kLanes;
  t.group = group;
  t.segments = L::kSegments;
  t.lane = threadIdx.x % L::kLanes;
  t.heads_per_segment = (group + L::kSegments - 1) / L::kSegments;
  const bool one_head = t.heads_per_segment == 1;
  t.classes = one_head ? L::kSegments / group : 1;
  t.head0 = one_head ? segment % group : segment;
  t.key_class = one_head ? segment / group : 0;
  t.active = t.key_class < t.classes;
  return t;
}

template <class L>
__device__ __forceinline__ int element(const DecodeThread& t, int nv) {  // first of kVec
  return (nv * L::kLanes + t.lane) * L::kVec;
}

// kUnroll rows of the tile (keys j0 + u * classes + key_class) as this thread's vectors.
template <class T, class L>
__device__ __forceinline__ void load_rows(Vec<T, L::kVec> (&rows)[L::kUnroll][L::kRowVectors],
                                          const T* cache, const int* slots, int j0, int n,
                                          const DecodeThread& t, int head_dim, long long kv_offset,
                                          int row) {
#pragma unroll
  for (int u = 0; u < L::kUnroll; ++u) {
    const int j = j0 + u * t.classes + t.key_class;
    const bool valid = t.active && j < n;
#pragma unroll
    for (int nv = 0; nv < L::kRowVectors; ++nv) {
      const int d = element<L>(t, nv);
      if (valid && d < head_dim) {
        rows[u][nv] = load_vec<T, L::kVec>(cache + (long long)slots[j] * row + kv_offset + d);
      } else {
#pragma unroll
        for (int e = 0; e < L::kVec; ++e) rows[u][nv].v[e] = from_float<T>(0.0f);
      }
    }
  }
}

template <class T, class L>
__device__ void decode_scores(float* scores, const float (&qv)[L::kHeadSlots][L::kRowVectors][L::kVec],
                              const T* k_cache, const int* slots, int n, const DecodeThread& t,
                              int head_dim, long long kv_offset, int row) {
  // every thread runs the same rounds: the segment reductions are full-warp shuffles
  for (int j0 = 0; j0 < n; j0 += t.classes * L::kUnroll) {
    Vec<T, L::kVec> rows[L::kUnroll][L::kRowVectors];
    load_rows<T, L>(rows, k_cache, slots, j0, n, t, head_dim, kv_offset, row);
#pragma unroll
    for (int u = 0; u < L::kUnroll; ++u) {
      const int j = j0 + u * t.classes + t.key_class;
#pragma unroll
      for (int a = 0; a < L::kHeadSlots; ++a) {
        if (a >= t.heads_per_segment) break;  // block-uniform
        float dot = 0.0f;
#pragma unroll
        for (int nv = 0; nv < L::kRowVectors; ++nv)
#pragma unroll
          for (int e = 0; e < L::kVec; ++e) dot += qv[a][nv][e] * to_float(rows[u][nv].v[e]);
        for (int offset = L::kLanes / 2; offset > 0; offset >>= 1) dot += __shfl_xor_sync(kFullMask, dot, offset);
        if (t.lane == 0 && t.active && j < n && t.owns(a)) scores[t.head(a) * kDecodeTile + j] = dot;
      }
    }
  }
}

// Scores -> exp(score - new max) in place; running max and sum per head; the tile's rescale.
__device__ __forceinline__ void decode_softmax(float* scores, float* row_max, float* row_sum, float* rescale,
                                               int n, int group) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int g = threadIdx.x >> 5; g < group; g += warps) {
    float* p = scores + g * kDecodeTile;
    float tile_max = neg_inf();
    for (int j = lane; j < n; j += 32) tile_max = fmaxf(tile_max, p[j]);
    const float old_max = row_max[g];
    const float new_max = fmaxf(old_max, warp_max(tile_max));
    float tile_sum = 0.0f;
    for (int j = lane; j < n; j += 32) {
      p[j] = expf(p[j] - new_max);
      tile_sum += p[j];
    }
    tile_sum = warp_sum(tile_sum);
    __syncwarp();  // every lane has read row_max[g] before lane 0 updates it
    if (lane == 0) {
      const float scale = exp_shifted(old_max, new_max);
      rescale[g] = scale;
      row_sum[g] = row_sum[g] * scale + tile_sum;
      row_max[g] = new_max;
    }
  }
}

template <class T, class L>
__device__ void decode_values(float (&acc)[L::kHeadSlots][L::kRowVectors][L::kVec], const float* probs,
                              const float* rescale, const T* v_cache, const int* slots, int n,
                              const DecodeThread& t, int head_dim, long long kv_offset, int row) {
#pragma unroll
  for (int a = 0; a < L::kHeadSlots; ++a) {
    const float scale = t.owns(a) ? rescale[t.head(a)] : 0.0f;
#pragma unroll
    for (int nv = 0; nv < L::kRowVectors; ++nv)
#pragma unroll
      for (int e = 0; e < L::kVec; ++e) acc[a][nv][e] *= scale;
  }
  for (int j0 = 0; j0 < n; j0 += t.classes * L::kUnroll) {
    Vec<T, L::kVec> rows[L::kUnroll][L::kRowVectors];
    load_rows<T, L>(rows, v_cache, slots, j0, n, t, head_dim, kv_offset, row);
#pragma unroll
    for (int u = 0; u < L::kUnroll; ++u) {
      const int j = j0 + u * t.classes + t.key_class;
      if (!t.active || j >= n) continue;
#pragma unroll
      for (int a = 0; a < L::kHeadSlots; ++a) {
        if (!t.owns(a)) continue;
        const float p = probs[t.head(a) * kDecodeTile + j];
#pragma unroll
        for (int nv = 0; nv < L::kRowVectors; ++nv)
#pragma unroll
          for (int e = 0; e < L::kVec; ++e) acc[a][nv][e] += p * to_float(rows[u][nv].v[e]);
      }
    }
  }
}

template <class T, int kHeadDim>
__device__ void decode_attention(T* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_stats,
                                 const T* __restrict__ q, const T* __restrict__ k_cache,
                                 const T* __restrict__ v_cache, const int* __restrict__ block_tables,
                                 const int* __restrict__ context_lens, const int* __restrict__ query_start_loc,
                                 int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                                 int max_blocks, int q_token_stride, int q_head_stride, float scale, int window,
                                 int all_rows, int row_base, int split_keys) {
  using L = DecodeLayout<T, kHeadDim>;
  const int kv_head = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
  const int group = num_heads / num_kv_heads;
  const DecodeRow dr = decode_row(context_lens, query_start_loc, num_seqs, row_base + blockIdx.x, all_rows, window,
                                  split_keys);
  if (!all_rows && dr.q_len != 1) return;  // a prefill row: attention_prefill.cu serves it
  if (split >= dr.parts) return;           // the row has fewer parts than the grid
  const int token = dr.token, seq = dr.seq;
  const int lo = dr.part_begin(split), hi = dr.part_end(split);
  const int* table = block_tables + (long long)seq * max_blocks;
  const int row = num_kv_heads * head_dim;
  const long long kv_offset = (long long)kv_head * head_dim;

  EMBER_DYNAMIC_SHARED(float, base);
  float* scores = base;                                  // [group, kDecodeTile]
  float* reduced = scores + group * kDecodeTile;         // [group, head_dim]
  float* row_max = reduced + group * head_dim;           // [group]
  float* row_sum = row_max + group;
  float* rescale = row_sum + group;
  int* slots = reinterpret_cast<int*>(rescale + group);  // [kDecodeTile]

  const DecodeThread t = decode_thread<L>(group);
  float qv[L::kHeadSlots][L::kRowVectors][L::kVec], acc[L::kHeadSlots][L::kRowVectors][L::kVec];
#pragma unroll
  for (int a = 0; a < L::kHeadSlots; ++a)
#pragma unroll
    for (int nv = 0; nv < L::kRowVectors; ++nv)
#pragma unroll
      for (int e = 0; e < L::kVec; ++e) {
        const int d = element<L>(t, nv) + e, head = kv_head * group + t.head(a);
        qv[a][nv][e] = t.owns(a) && d < head_dim
            ? to_float(q[(long long)token * q_token_stride + (long long)head * q_head_stride + d]) * scale
            : 0.0f;
        acc[a][nv][e] = 0.0f;
      }
  for (int g = threadIdx.x; g < group; g += blockDim.x) {
    row_max[g] = neg_inf();
    row_sum[g] = 0.0f;
  }
  for (int e = threadIdx.x; e < group * head_dim; e += blockDim.x) reduced[e] = 0.0f;
  __syncthreads();

  for (int first = lo; first < hi; first += kDecodeTile) {
    const int n = min(kDecodeTile, hi - first);
    for (int j = threadIdx.x; j < n; j += blockDim.x) slots[j] = cache_slot(table, first + j, block_size);
    __syncthreads();
    decode_scores<T, L>(scores, qv, k_cache, slots, n, t, head_dim, kv_offset, row);
    __syncthreads();
    decode_softmax(scores, row_max, row_sum, rescale, n, group);
    __syncthreads();
    decode_values<T, L>(acc, scores, rescale, v_cache, slots, n, t, head_dim, kv_offset, row);
    __syncthreads();
  }

  for (int c = 0; c < t.classes; ++c) {  // key classes add their outputs in turn
    if (t.active && t.key_class == c) {
#pragma unroll
      for (int a = 0; a < L::kHeadSlots; ++a)
#pragma unroll
        for (int nv = 0; nv < L::kRowVectors; ++nv)
#pragma unroll
          for (int e = 0; e < L::kVec; ++e) {
            const int d = element<L>(t, nv) + e;
            if (t.owns(a) && d < head_dim) reduced[t.head(a) * head_dim + d] += acc[a][nv][e];
          }
    }
    __syncthreads();
  }

  // of head g: + g * splits (rows of the launch, heads, grid splits)
  const long long part = ((long long)blockIdx.x * num_heads + kv_head * group) * splits + split;
  for (int e = threadIdx.x; e < group * head_dim; e += blockDim.x) {
    const int g = e / head_dim, d = e % head_dim;
    if (dr.parts == 1)
      out[((long long)token * num_heads + kv_head * group + g) * head_dim + d] = from_float<T>(reduced[e] / row_sum[g]);
    else
      part_out[(part + (long long)g * splits) * head_dim + d] = reduced[e];
  }
  if (dr.parts > 1) {
    for (int g = threadIdx.x; g < group; g += blockDim.x) {
      part_stats[(part + (long long)g * splits) * 2] = row_max[g];
      part_stats[(part + (long long)g * splits) * 2 + 1] = row_sum[g];
    }
  }
}

// One block per (row, query head) of a launch whose row has parts > 1, in part order:
// out = sum_z w_z acc_z / sum_z w_z sum_z, w_z = exp(max_z - max over z); an empty part weighs 0.
template <class T>
__device__ void merge_splits(T* __restrict__ out, const float* __restrict__ part_out,
                             const float* __restrict__ part_stats, const int* __restrict__ context_lens,
                             const int* __restrict__ query_start_loc, int num_seqs, int num_heads, int head_dim,
                             int splits, int window, int all_rows, int row_base, int split_keys) {
  const int head = blockIdx.y;
  const DecodeRow dr = decode_row(context_lens, query_start_loc, num_seqs, row_base + blockIdx.x, all_rows, window,
                                  split_keys);
  if ((!all_rows && dr.q_len != 1) || dr.parts == 1) return;
  const long long part = ((long long)blockIdx.x * num_heads + head) * splits;
  const float* stats = part_stats + part * 2;
  float top = neg_inf();
  for (int z = 0; z < dr.parts; ++z) top = fmaxf(top, stats[2 * z]);
  float total = 0.0f;
  for (int z = 0; z < dr.parts; ++z) total += exp_shifted(stats[2 * z], top) * stats[2 * z + 1];
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float sum = 0.0f;
    for (int z = 0; z < dr.parts; ++z) sum += exp_shifted(stats[2 * z], top) * part_out[(part + z) * head_dim + d];
    out[((long long)dr.token * num_heads + head) * head_dim + d] = from_float<T>(sum / total);
  }
}

}  // namespace ember

#define EMBER_DECODE_ENTRY(suffix, T, D)                                                               \
  extern "C" __global__ void __launch_bounds__(ember::kDecodeThreads, ember::kDecodeMinBlocks)          \
      paged_attention_decode_d##D##_##suffix(                                                          \
      T* out, float* part_out, float* part_stats, const T* q, const T* k_cache, const T* v_cache,     \
      const int* block_tables, const int* context_lens, const int* query_start_loc, int num_seqs,     \
      int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks, int q_token_stride, \
      int q_head_stride, float scale, int window, int all_rows, int row_base, int split_keys) {       \
    ember::decode_attention<T, D>(out, part_out, part_stats, q, k_cache, v_cache, block_tables,        \
                                  context_lens, query_start_loc, num_seqs, num_heads, num_kv_heads,    \
                                  head_dim, block_size, max_blocks, q_token_stride, q_head_stride,     \
                                  scale, window, all_rows, row_base, split_keys);                      \
  }

#define EMBER_DECODE_ENTRIES(suffix, T)                                                                \
  EMBER_DECODE_ENTRY(suffix, T, 0)                                                                     \
  EMBER_DECODE_ENTRY(suffix, T, 64)                                                                    \
  EMBER_DECODE_ENTRY(suffix, T, 128)                                                                   \
  EMBER_DECODE_ENTRY(suffix, T, 256)                                                                   \
  extern "C" __global__ void paged_attention_merge_##suffix(                                           \
      T* out, const float* part_out, const float* part_stats, const int* context_lens,                \
      const int* query_start_loc, int num_seqs, int num_heads, int head_dim, int splits, int window,  \
      int all_rows, int row_base, int split_keys) {                                                    \
    ember::merge_splits<T>(out, part_out, part_stats, context_lens, query_start_loc, num_seqs,         \
                           num_heads, head_dim, splits, window, all_rows, row_base, split_keys);       \
  }
EMBER_FOR_EACH_DTYPE(EMBER_DECODE_ENTRIES)
