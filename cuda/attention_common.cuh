// attention_common.cuh -- what the paged attention kernels (attention_decode.cu,
// attention_prefill.cu) share: the batch layout, page lookup, 16-byte vectors, visible key ranges.
//
// Sequence s owns query rows [query_start_loc[s], query_start_loc[s+1]), the last q_len tokens of
// its context of context_lens[s] tokens; its row i sits at position context_len - q_len + i and
// attends keys 0 .. position, or with a sliding window > 0 only position - window + 1 .. position.
// K/V pages [num_blocks, block_size, Hk, D] are read through block_tables[s].
#pragma once
#include "common.cuh"

namespace ember {

// The last s with query_start_loc[s] <= token.
__device__ __forceinline__ int sequence_of(const int* query_start_loc, int num_seqs, int token) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (query_start_loc[mid] <= token) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ int first_visible_key(int position, int window) {
  return window > 0 ? max(position - window + 1, 0) : 0;
}

// Cache row (slot) of key `key` of a sequence through its block table.
__device__ __forceinline__ int cache_slot(const int* table, int key, int block_size) {
  return table[key / block_size] * block_size + key % block_size;
}

// N elements of T loaded or stored as one access (16 bytes for the vectorised paths).
template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <class T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}

// exp(x - max) that is 0, not NaN, for a row that has seen no key yet (max = -inf).
__device__ __forceinline__ float exp_shifted(float x, float max) {
  return max == neg_inf() ? 0.0f : expf(x - max);
}

}  // namespace ember
