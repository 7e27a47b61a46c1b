// sampling.cu -- sampling helpers.
//
// apply_token_bitmask: the grammar mask of structured decoding (ember_cupy/structured/bitmask.py,
// whose apply_token_bitmask_numpy is its twin). logits [*, vocab] float32, row-major; bitmask
// [num_rows, words] int32, token t allowed when bit t % 32 of word t / 32 is set (llguidance's
// layout); rows [num_rows]: the logits row each mask row applies to. Grid (ceil(vocab / blockDim.x),
// num_rows), one thread per logit; a token past the mask's words counts as disallowed.
#include "common.cuh"

extern "C" __global__ void apply_token_bitmask(float* __restrict__ logits, const int* __restrict__ bitmask,
                                               const int* __restrict__ rows, int vocab, int words) {
  const int mask_row = blockIdx.y;
  const int token = blockIdx.x * blockDim.x + threadIdx.x;
  if (token >= vocab) return;
  const int word = token >> 5;
  const bool allowed =
      word < words && ((static_cast<unsigned>(bitmask[(long long)mask_row * words + word]) >> (token & 31)) & 1u);
  if (!allowed) logits[(long long)rows[mask_row] * vocab + token] = ember::neg_inf();
}
