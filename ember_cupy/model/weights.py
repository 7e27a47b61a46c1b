"""Weights in the format the model computes with, by `EngineConfig.quantization`:

  auto  served as stored: GGUF Q8_0 / Q4_1 blocks as they are, Q4_0 repacked as Q4_1, other GGUF
        types (K-quants, Q5_x, ...) requantized to Q8_0; float tensors stay float;
  none  everything dequantized to float (the exact reference mode);
  q8_0  every matrix quantized to Q8_0 (fp16/bf16/fp32 checkpoints too).

A float linear weight is stored [in, out] (`x @ W`), a quantized one [out, in] as GGUF rows.
"""
from __future__ import annotations

import numpy as np

from ember_cupy.quant import PackedWeight, QuantizedTensor, quantize_q8_0, to_kernel_format


def _quantized(tensor: QuantizedTensor, quantization: str) -> PackedWeight:
    if quantization == "q8_0" and tensor.qtype != "Q8_0":
        tensor = quantize_q8_0(tensor.dequantize())
    return to_kernel_format(tensor)


def linear_weight(weight, quantization: str, put):
    """A linear layer's weight (float [in, out] or QuantizedTensor [out, in]) in serving format;
    `put` moves a float array to the backend in its dtype."""
    if isinstance(weight, QuantizedTensor):
        if quantization == "none":
            return put(weight.dequantize().T)
        return _quantized(weight, quantization)
    if quantization == "q8_0":
        return to_kernel_format(quantize_q8_0(np.asarray(weight).T))
    return put(weight)


def vocab_matrix(weight, quantization: str, put):
    """The embedding table or the LM head, [vocab, hidden], in serving format."""
    if isinstance(weight, QuantizedTensor):
        if quantization == "none":
            return put(weight.dequantize())
        return _quantized(weight, quantization)
    if quantization == "q8_0":
        return to_kernel_format(quantize_q8_0(weight))
    return put(weight)


def is_quantized(weight) -> bool:
    return isinstance(weight, PackedWeight)
