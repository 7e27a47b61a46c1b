// bugs.cu -- deliberately broken kernels: each one proves the CPU shim (or a sanitizer over it)
// catches one class of bug. Used only by tests/kernels/test_shim_harness.py.
#include "common.cuh"

// Reads a neighbour's shared value without a barrier: right in forward order, wrong in reverse.
extern "C" __global__ void missing_sync(float* out, float seed) {
  __shared__ float buf[64];
  const int t = threadIdx.x;
  buf[t] = seed + t + 1000.0f * blockIdx.x;
  out[blockIdx.x * 64 + t] = t > 0 ? buf[t - 1] : 0.0f;
}

extern "C" __global__ void fixed_sync(float* out, float seed) {
  __shared__ float buf[64];
  const int t = threadIdx.x;
  buf[t] = seed + t + 1000.0f * blockIdx.x;
  __syncthreads();
  out[blockIdx.x * 64 + t] = t > 0 ? buf[t - 1] : 0.0f;
}

// Half the block skips the barrier and exits.
extern "C" __global__ void divergent_sync(float* out) {
  if (threadIdx.x < 16) __syncthreads();
  out[threadIdx.x] = 1.0f;
}

// Both halves call a barrier, at different sites.
extern "C" __global__ void divergent_sites(float* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.0f;
}

// Lanes 16..31 exit; the rest shuffle with them.
extern "C" __global__ void shuffle_after_exit(float* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, float(threadIdx.x), 1);
}

// Lane 0 of each warp waits at the block barrier while its warp waits for it in a shuffle.
extern "C" __global__ void deadlock(float* out) {
  if (threadIdx.x % 32 == 0) __syncthreads();
  else out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

// Thread 0 reads dynamic shared memory nobody wrote: NaN poison comes out.
extern "C" __global__ void read_before_write(float* out) {
  EMBER_DYNAMIC_SHARED(float, buf);
  if (threadIdx.x > 0) buf[threadIdx.x] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = buf[threadIdx.x];
}

// The last thread reads one element past the input (AddressSanitizer).
extern "C" __global__ void out_of_bounds(float* out, const float* in, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i + 1];
}

// Every thread increments one counter without an atomic (ThreadSanitizer). No barrier comes
// first, so no two increments are ordered by the shim's own locking.
extern "C" __global__ void racy_count(int* out, int use_atomic) {
  if (use_atomic) atomicAdd(&out[blockIdx.x], 1); else out[blockIdx.x] += 1;
}

// A scalar-width trap for the launcher: n must come as np.int32.
extern "C" __global__ void scale(float* x, float factor, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= factor;
}
