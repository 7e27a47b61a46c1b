// activation.cu -- SiLU(gate) * up over a fused [T, 2I] gate_up matrix (gate first).
// One block per row. NumPy twin: ember_cupy/ops/activation.py.
#include "common.cuh"

namespace ember {

template <class T>
__device__ void silu_and_mul(T* __restrict__ out, const T* __restrict__ gate_up, int inter, int in_stride) {
  const T* gate = gate_up + (long long)blockIdx.x * in_stride;
  const T* up = gate + inter;
  T* dst = out + (long long)blockIdx.x * inter;
  for (int i = threadIdx.x; i < inter; i += blockDim.x) {
    const float g = to_float(gate[i]);
    dst[i] = from_float<T>(g / (1.0f + expf(-g)) * to_float(up[i]));
  }
}

}  // namespace ember

#define EMBER_ACTIVATION_ENTRIES(suffix, T)                                                 \
  extern "C" __global__ void silu_and_mul_##suffix(T* out, const T* gate_up, int inter,     \
                                                   int in_stride) {                         \
    ember::silu_and_mul<T>(out, gate_up, inter, in_stride);                                 \
  }
EMBER_FOR_EACH_DTYPE(EMBER_ACTIVATION_ENTRIES)
