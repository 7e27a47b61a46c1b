"""Linear layers: y = x @ W for a float weight stored [in, out], or for a `QuantizedTensor`
[out, in] kept in its GGUF blocks (x quantized to int8 blocks per call, integer dot products).

`matmul_q` has two implementations with one signature: the host kernel (cpu/matmul_q.c) and its
NumPy twin `matmul_q_numpy` (fake-quantized x @ dequantized W, the same arithmetic in real
numbers). A CUDA quantized GEMM slots in beside them by the same dispatch.
"""
from __future__ import annotations

import numpy as np

from ember_cupy.ops import _host
from ember_cupy.quant import PackedWeight, QuantizedTensor, fake_quantize_activations


def linear(x, weight, passes: int = 1):
    """x [T, in] -> [T, out]; `passes` int8 passes over x for a quantized weight (matmul_q)."""
    if isinstance(weight, PackedWeight):
        return matmul_q(x, weight, passes=passes)
    return x @ weight


def embedding(table, ids):
    """Rows `ids` of an embedding table (float, or quantized and dequantized row by row)."""
    if isinstance(table, (QuantizedTensor, PackedWeight)):
        return table.dequantize(np.asarray(ids))
    return table[ids]


def matmul_q(x: np.ndarray, weight: PackedWeight, library=None, passes: int = 1) -> np.ndarray:
    """x [M, K] float32 @ weight[N, K]^T -> [M, N] float32; host kernel when one is active.
    passes=2 quantizes x in two int8 passes (x and its residual) for ~14-bit activations."""
    library = library or _host.active()
    if library is None:
        return matmul_q_numpy(x, weight, passes)
    _check(x, weight)
    if x.dtype != np.float32 or x.strides[-1] != 4:
        x = np.ascontiguousarray(x, dtype=np.float32)
    rows, cols = weight.shape
    out = np.empty((x.shape[0], rows), dtype=np.float32)
    status = library.lib.ember_matmul_q(
        x.ctypes.data, x.shape[0], cols, x.strides[0] // 4, weight.data.ctypes.data, rows,
        weight.kernel_type, out.ctypes.data, rows, passes)
    if status:
        raise RuntimeError(f"ember_matmul_q failed with status {status}")
    return out


def matmul_q_numpy(x: np.ndarray, weight: PackedWeight, passes: int = 1) -> np.ndarray:
    """The NumPy twin of the host kernel: the int8 activation blocks, and W as its blocks say."""
    _check(x, weight)
    x = fake_quantize_activations(np.asarray(x, dtype=np.float32), passes)
    return (x @ weight.dequantize().T).astype(np.float32)


def _check(x, weight: PackedWeight) -> None:
    if not isinstance(weight, PackedWeight):
        raise ValueError(f"matmul_q needs a PackedWeight (quant.to_kernel_format), got {type(weight).__name__}")
    if x.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"matmul_q: x {x.shape} does not match weight {weight.shape}")
    if not weight.data.flags.c_contiguous:
        raise ValueError("matmul_q: weight blocks must be C-contiguous")
