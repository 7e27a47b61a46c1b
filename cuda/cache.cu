// cache.cu -- write new K/V rows [T, Hk, D] (strided views) into the paged caches
// [num_blocks, block_size, Hk, D] at slot_mapping[t] = block * block_size + offset; -1 = skip.
// One block per token. NumPy twin: ember_cupy/ops/cache.py.
#include "common.cuh"

namespace ember {

template <class T>
__device__ void write_kv(const T* __restrict__ key, const T* __restrict__ value, T* __restrict__ k_cache,
                         T* __restrict__ v_cache, const int* __restrict__ slot_mapping, int num_kv_heads,
                         int head_dim, int key_token_stride, int key_head_stride,
                         int value_token_stride, int value_head_stride) {
  const int token = blockIdx.x, slot = slot_mapping[token];
  if (slot < 0) return;
  const int row = num_kv_heads * head_dim;
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    const int head = i / head_dim, d = i % head_dim;
    const long long dst = (long long)slot * row + i;
    k_cache[dst] = key[(long long)token * key_token_stride + head * key_head_stride + d];
    v_cache[dst] = value[(long long)token * value_token_stride + head * value_head_stride + d];
  }
}

}  // namespace ember

#define EMBER_CACHE_ENTRIES(suffix, T)                                                         \
  extern "C" __global__ void write_kv_##suffix(const T* key, const T* value, T* k_cache,       \
                                               T* v_cache, const int* slot_mapping,            \
                                               int num_kv_heads, int head_dim,                 \
                                               int key_token_stride, int key_head_stride,      \
                                               int value_token_stride, int value_head_stride) { \
    ember::write_kv<T>(key, value, k_cache, v_cache, slot_mapping, num_kv_heads, head_dim,     \
                       key_token_stride, key_head_stride, value_token_stride, value_head_stride); \
  }
EMBER_FOR_EACH_DTYPE(EMBER_CACHE_ENTRIES)
