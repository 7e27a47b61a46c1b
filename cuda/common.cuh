// common.cuh -- helpers shared by the kernels in cuda/: dtype conversion, warp/block reductions,
// the dynamic shared memory macro, and the per-dtype entry point generator.
// Rules: no standard headers (NVRTC has none), no INFINITY macro, full-warp masks only.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// `extern __shared__` cannot be re-spelled by a macro, so kernels declare dynamic shared memory
// through this one; the CPU test shim (tests/kernels/shim) defines its own version first.
#ifndef EMBER_DYNAMIC_SHARED
#define EMBER_DYNAMIC_SHARED(T, name)                                   \
  extern __shared__ __align__(16) unsigned char ember_dynamic_shared_[]; \
  T* name = reinterpret_cast<T*>(ember_dynamic_shared_)
#endif

// X(suffix, type) for every storage dtype: one extern "C" entry point per dtype.
#define EMBER_FOR_EACH_DTYPE(X) X(f32, float) X(f16, __half) X(bf16, __nv_bfloat16)

namespace ember {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Sum over the whole block, returned to every thread. blockDim.x: a multiple of 32, at most 1024.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < int(blockDim.x >> 5) ? partial[lane] : 0.0f;
  v = warp_sum(v);
  __syncthreads();  // partial[] is reused by the next call
  return v;
}

}  // namespace ember
