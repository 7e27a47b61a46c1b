"""Weights in the format the model computes with, by `EngineConfig.quantization`:

  auto  served as stored: every GGUF type with a host kernel (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
        Q5_K, Q6_K) in its own blocks, a matrix whose parts differ in format (q/k/v, gate/up) as
        a StackedWeight of its parts; other GGUF types requantized to Q8_0; 16-bit float matrices
        (F16/BF16 GGUF tensors, f16/bf16 safetensors) as their 16 bits (a HalfWeight); float32
        tensors stay float32;
  none  everything dequantized to float (the exact reference mode), but for 16-bit float matrices
        on the host: the kernel multiplies their exact values in float32 (no rounding of W or x
        that fp32 would not have), so they keep their 16 bits here too;
  q8_0  every matrix quantized to Q8_0 (fp16/bf16/fp32 checkpoints too).

Where the host kernels cannot load (no C compiler, a failed build; not EMBER_HOST_KERNELS=0, which keeps the
twins as written), a host-quantized matrix is dequantized once at load (a DequantizedWeight): the
NumPy twin computes the same, without dequantizing every matrix on every call, at 4-7x the memory
(32 bits a weight against the 4.5-8.5 of the blocks); a 16-bit float matrix is widened once to a
float32 one (NumPy's GEMM: its twin's emulated FMAs would be far slower).

On a device (xp is not NumPy) the CUDA kernels (cuda/matmul_q.cu) serve Q8_0, Q4_0, Q4_1, Q4_K
and Q6_K (quant.DEVICE_FORMATS) as stored, on the device, a stack of parts in different ones as
a DeviceStack; with auto, other GGUF types (and a stack with a part in one, and 16-bit floats)
are dequantized to the device dtype instead.

A float linear weight is stored [in, out] (`x @ W`), a quantized one [out, in] as GGUF rows.
"""
from __future__ import annotations

import numpy as np

from ember_cupy.gguf_file import release_pages
from ember_cupy.half_weight import HalfWeight, is_half
from ember_cupy.ops import _host
from ember_cupy.ops.pack import to_kernel_format
from ember_cupy.packed_weight import DequantizedWeight, PackedWeight, StackedWeight, stack
from ember_cupy.quant import (DEVICE_FORMATS, DeviceQuantizedWeight, DeviceStack, QuantizedStack, QuantizedTensor,
                              concat_rows, quantize_q8_0, to_device_format)


def _quantized(tensor: QuantizedTensor | QuantizedStack, quantization: str, xp, cache=None):
    """cache: a WeightCache (ember_cupy/model/weight_cache.py) the host format is packed into or
    mapped from; None packs into memory."""
    if xp is np and _host.unavailable() is None:
        build = lambda alloc: _host_format(tensor, quantization, alloc)  # noqa: E731
        served = build(np.empty) if cache is None else cache.served(_runs(tensor), build)
        for run in _runs(tensor):
            for part in run:
                release_pages(part.data)
        return served
    runs = _runs(_serving_format(tensor, quantization))
    if xp is not np:
        matrices = [to_device_format(concat_rows(run) if len(run) > 1 else run[0], xp.asarray) for run in runs]
        return matrices[0] if len(matrices) == 1 else DeviceStack(tuple(matrices))
    return DequantizedWeight.of([part for run in runs for part in run])


def _serving_format(tensor, quantization: str):
    if quantization == "q8_0" and (isinstance(tensor, QuantizedStack) or tensor.qtype != "Q8_0"):
        return quantize_q8_0(tensor.dequantize())
    return tensor


def _runs(tensor) -> list[list[QuantizedTensor]]:
    return tensor.runs() if isinstance(tensor, QuantizedStack) else [[tensor]]


def _host_format(tensor, quantization: str, alloc):
    """The host kernels' format of the matrix, its arrays from alloc(shape, dtype)."""
    return stack([to_kernel_format(run, alloc=alloc) for run in _runs(_serving_format(tensor, quantization))])


def _served_as_float(tensor: QuantizedTensor | QuantizedStack, quantization: str, xp) -> bool:
    if xp is np and quantization != "q8_0" and is_half(tensor):
        return _host.unavailable() is not None
    if quantization == "none":
        return True
    parts = tensor.parts if isinstance(tensor, QuantizedStack) else (tensor,)
    on_device_as_float = any(part.qtype not in DEVICE_FORMATS for part in parts)
    return xp is not np and quantization == "auto" and on_device_as_float


def linear_weight(weight, quantization: str, put, xp=np, cache=None):
    """A linear layer's weight (float [in, out], or QuantizedTensor / QuantizedStack [out, in]) in
    serving format; `put` moves a float array to the backend in its dtype, `xp` is the backend."""
    if isinstance(weight, (QuantizedTensor, QuantizedStack)):
        if _served_as_float(weight, quantization, xp):
            return put(weight.dequantize().T)
        return _quantized(weight, quantization, xp, cache)
    if quantization == "q8_0":
        return _quantized(quantize_q8_0(np.asarray(weight).T), quantization, xp, cache)
    return put(weight)


def vocab_matrix(weight, quantization: str, put, xp=np, cache=None):
    """The embedding table or the LM head, [vocab, hidden], in serving format."""
    if isinstance(weight, QuantizedTensor):
        if _served_as_float(weight, quantization, xp):
            return put(weight.dequantize())
        return _quantized(weight, quantization, xp, cache)
    if quantization == "q8_0":
        return _quantized(quantize_q8_0(weight), quantization, xp, cache)
    return put(weight)


def is_quantized(weight) -> bool:
    """Served by ops/linear.py matmul_q: quantized, or 16-bit floats in the host kernel's panels."""
    return isinstance(weight, (PackedWeight, StackedWeight, HalfWeight, DequantizedWeight, DeviceQuantizedWeight,
                               DeviceStack))
