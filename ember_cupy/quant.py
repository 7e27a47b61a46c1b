"""Quantized weight tensors in GGUF block formats, and the conversions between them.

A `QuantizedTensor` is a matrix [rows, cols] stored row by row as GGUF blocks of 32 columns
(`data`: uint8 [rows, row_bytes]), exactly as a GGUF file holds it. The host kernels read
Q8_0 and Q4_1 directly; Q4_0 is repacked as Q4_1 (w = d*q - 8d is w = d*q + m with m = -8d,
exact in f16); every other GGUF type is requantized to Q8_0 from its dequantized values.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32
# formats the kernels compute on: block bytes, and the kernel's type code (cpu/matmul_q.c)
KERNEL_FORMATS = {"Q8_0": (34, 0), "Q4_1": (20, 1)}


@dataclass(frozen=True)
class QuantizedTensor:
    qtype: str                  # GGUF type name: "Q8_0", "Q4_1", "Q4_K", ...
    data: np.ndarray            # uint8 [rows, row_bytes], GGUF blocks
    shape: tuple[int, int]      # (rows, cols) of the logical matrix

    def __post_init__(self):
        if self.data.dtype != np.uint8 or self.data.ndim != 2 or self.data.shape[0] != self.shape[0]:
            raise ValueError(f"QuantizedTensor {self.qtype}: data {self.data.dtype}{self.data.shape} "
                             f"does not hold {self.shape[0]} rows")

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def dequantize(self, rows=None) -> np.ndarray:
        """float32 [rows, cols] (all rows, or the ones indexed by `rows`)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        data = self.data if rows is None else self.data[rows]
        values = dequantize(data, GGMLQuantizationType[self.qtype])
        return values.astype(np.float32, copy=False).reshape(data.shape[0], self.shape[1])

    def take_rows(self, index) -> QuantizedTensor:
        data = np.ascontiguousarray(self.data[index])
        return QuantizedTensor(self.qtype, data, (data.shape[0], self.shape[1]))


def quantize_q8_0(weight: np.ndarray) -> QuantizedTensor:
    """float [rows, cols] -> Q8_0 (llama.cpp's reference rounding, via the gguf package)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if weight.ndim != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"Q8_0 needs a matrix with a multiple of {BLOCK} columns, got {weight.shape}")
    return QuantizedTensor("Q8_0", quantize(weight, GGMLQuantizationType.Q8_0), weight.shape)


def q4_0_as_q4_1(tensor: QuantizedTensor) -> QuantizedTensor:
    """Repack Q4_0 blocks (f16 d, nibbles) as Q4_1 (f16 d, f16 m = -8d, the same nibbles)."""
    rows, cols = tensor.shape
    blocks = tensor.data.reshape(rows, cols // BLOCK, 18)
    d = blocks[..., :2].copy().view(np.float16)
    m = (d.astype(np.float32) * -8.0).astype(np.float16)
    if not np.isfinite(m).all():
        return quantize_q8_0(tensor.dequantize())
    out = np.empty((rows, cols // BLOCK, 20), np.uint8)
    out[..., :2] = d.view(np.uint8)
    out[..., 2:4] = m.view(np.uint8)
    out[..., 4:] = blocks[..., 2:]
    return QuantizedTensor("Q4_1", out.reshape(rows, -1), tensor.shape)


def to_kernel_format(tensor: QuantizedTensor) -> QuantizedTensor:
    """The tensor in a format the kernels read: as is, repacked (Q4_0), or requantized to Q8_0."""
    if tensor.qtype in KERNEL_FORMATS:
        return tensor
    if tensor.qtype == "Q4_0":
        return q4_0_as_q4_1(tensor)
    return quantize_q8_0(tensor.dequantize())


def concat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Stack matrices of one format and width (q/k/v or gate/up fused into one matmul)."""
    if len({(p.qtype, p.shape[1]) for p in parts}) != 1:
        raise ValueError("concat_rows needs parts of one format and width")
    data = np.concatenate([p.data for p in parts])
    return QuantizedTensor(parts[0].qtype, data, (data.shape[0], parts[0].shape[1]))


def fake_quantize_activations(x: np.ndarray) -> np.ndarray:
    """x [M, K] float32 through the kernels' int8 activation blocks and back: per 32 values
    d = max|x| / 127, q = rint(x / d) (as x * (1/d), the kernels' exact float32 steps)."""
    rows, cols = x.shape
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(rows, cols // BLOCK, BLOCK)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127.0)
    with np.errstate(divide="ignore"):
        inverse = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    q = np.rint(blocks * inverse)
    return (q * d).reshape(rows, cols)
