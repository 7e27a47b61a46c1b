// norm.cu -- RMSNorm and fused residual-add + RMSNorm. One block per row, fp32 accumulation.
// NumPy twins: ember_cupy/ops/norm.py.
#include "common.cuh"

namespace ember {

// out[row] = x[row] / rms(x[row]) * weight
template <class T>
__device__ void rms_norm(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight,
                         int hidden, int x_stride, float eps) {
  const T* row = x + (long long)blockIdx.x * x_stride;
  float squares = 0.0f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = to_float(row[i]);
    squares += v * v;
  }
  const float scale = rsqrtf(block_sum(squares) / hidden + eps);
  T* dst = out + (long long)blockIdx.x * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x)
    dst[i] = from_float<T>(to_float(row[i]) * scale * to_float(weight[i]));
}

// In place: residual += x; x = rms_norm(residual) * weight. Each thread re-reads only the
// residual elements it wrote itself, so the one barrier is the one inside block_sum.
template <class T>
__device__ void fused_add_rms_norm(T* __restrict__ x, T* __restrict__ residual, const T* __restrict__ weight,
                                   int hidden, int x_stride, int residual_stride, float eps) {
  T* x_row = x + (long long)blockIdx.x * x_stride;
  T* r_row = residual + (long long)blockIdx.x * residual_stride;
  float squares = 0.0f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const T sum = from_float<T>(to_float(r_row[i]) + to_float(x_row[i]));
    r_row[i] = sum;
    const float v = to_float(sum);
    squares += v * v;
  }
  const float scale = rsqrtf(block_sum(squares) / hidden + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x)
    x_row[i] = from_float<T>(to_float(r_row[i]) * scale * to_float(weight[i]));
}

}  // namespace ember

#define EMBER_NORM_ENTRIES(suffix, T)                                                            \
  extern "C" __global__ void rms_norm_##suffix(T* out, const T* x, const T* weight, int hidden,  \
                                               int x_stride, float eps) {                        \
    ember::rms_norm<T>(out, x, weight, hidden, x_stride, eps);                                   \
  }                                                                                              \
  extern "C" __global__ void fused_add_rms_norm_##suffix(T* x, T* residual, const T* weight,     \
                                                         int hidden, int x_stride,               \
                                                         int residual_stride, float eps) {       \
    ember::fused_add_rms_norm<T>(x, residual, weight, hidden, x_stride, residual_stride, eps);    \
  }
EMBER_FOR_EACH_DTYPE(EMBER_NORM_ENTRIES)
