// rotary.cu -- rotary position embedding, in place on q [T, Hq, D] and k [T, Hk, D] (strided views).
// cos_sin_cache [max_pos, D] float32: cos of each frequency in the first half, sin in the second
// (scaling is applied on the host). Pairs: (i, i + D/2) when is_neox, else (2i, 2i + 1).
// One block per token; each thread owns whole pairs, so no barrier is needed.
// NumPy twin: ember_cupy/ops/rotary.py.
#include "common.cuh"

namespace ember {

template <class T>
__device__ void rotary(T* q, T* k, const int* __restrict__ positions, const float* __restrict__ cos_sin,
                       int num_heads, int num_kv_heads, int head_dim, int q_token_stride,
                       int q_head_stride, int k_token_stride, int k_head_stride, int is_neox) {
  const int token = blockIdx.x, half = head_dim / 2;
  const float* cos = cos_sin + (long long)positions[token] * head_dim;
  const float* sin = cos + half;
  const int pairs = (num_heads + num_kv_heads) * half;
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int head = p / half, i = p % half;
    T* base = head < num_heads
                  ? q + (long long)token * q_token_stride + head * q_head_stride
                  : k + (long long)token * k_token_stride + (head - num_heads) * k_head_stride;
    const int a = is_neox ? i : 2 * i, b = is_neox ? i + half : 2 * i + 1;
    const float x = to_float(base[a]), y = to_float(base[b]);
    base[a] = from_float<T>(x * cos[i] - y * sin[i]);
    base[b] = from_float<T>(y * cos[i] + x * sin[i]);
  }
}

}  // namespace ember

#define EMBER_ROTARY_ENTRIES(suffix, T)                                                          \
  extern "C" __global__ void rotary_##suffix(T* q, T* k, const int* positions,                   \
                                             const float* cos_sin, int num_heads,                \
                                             int num_kv_heads, int head_dim, int q_token_stride, \
                                             int q_head_stride, int k_token_stride,              \
                                             int k_head_stride, int is_neox) {                   \
    ember::rotary<T>(q, k, positions, cos_sin, num_heads, num_kv_heads, head_dim,                \
                     q_token_stride, q_head_stride, k_token_stride, k_head_stride, is_neox);     \
  }
EMBER_FOR_EACH_DTYPE(EMBER_ROTARY_ENTRIES)
