"""16-bit float matrices (bf16 or f16 bits, one format a matrix) as the host kernel reads them
(cpu/matmul_16bit.c): panels of 16 rows, panel p holding W[16p + j, k] at data[p, k, j] (the
last panel's missing rows zeros), so one 32-byte load is one k of 16 outputs. The bytes the
checkpoint stores: 2 a weight (the float32 copy of a 16-bit checkpoint took 4).

Each output y[m, n] is one chain of fp32 FMAs over k in order, y = fma(x[m, k], w[n, k], y)
from +0: `matmul_16bit_numpy` is the kernel's twin, with the FMA emulated exactly (its bits
are the kernel's, but for the payload of a NaN).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ember_cupy.quant import HALF_TYPES, QuantizedTensor, widen

LANES = 16
KERNEL_TYPES = {"BF16": 8, "F16": 9}     # cpu/matmul_q.h EMBER_WTYPE_*


@dataclass(frozen=True, eq=False)
class HalfWeight:
    """A 16-bit float matrix [rows, cols] in panels: data uint16 [ceil(rows / 16), cols, 16]."""
    qtype: str
    data: np.ndarray
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def kernel_type(self) -> int:
        return KERNEL_TYPES[self.qtype]

    @property
    def parts(self) -> tuple[HalfWeight, ...]:
        return (self,)

    def bits(self, rows=None) -> np.ndarray:
        """uint16 [rows, cols]: every row, or those indexed by `rows`."""
        if rows is None:
            return self.data.transpose(0, 2, 1).reshape(-1, self.shape[1])[:self.shape[0]]
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        return self.data[rows // LANES, :, rows % LANES]

    def dequantize(self, rows=None) -> np.ndarray:
        """float32 [rows, cols] (the embedding lookup's rows, or all of them)."""
        return widen(np.ascontiguousarray(self.bits(rows)), self.qtype)


def is_half(tensor) -> bool:
    """A QuantizedTensor of 16-bit floats, or a stack holding one."""
    parts = getattr(tensor, "parts", (tensor,))
    return any(isinstance(part, QuantizedTensor) and part.qtype in HALF_TYPES for part in parts)


def half_bits(tensor: QuantizedTensor) -> np.ndarray:
    """The uint16 bits [rows, cols] of a F16 / BF16 QuantizedTensor (a view of its data)."""
    if tensor.qtype not in HALF_TYPES:
        raise ValueError(f"not a 16-bit float tensor: {tensor.qtype}")
    return tensor.data.view(np.uint16)


def pack_16bit(tensor: QuantizedTensor) -> HalfWeight:
    """Rows -> panels in NumPy (the twin of cpu/matmul_16bit.c ember_pack_16bit)."""
    bits = half_bits(tensor)
    rows, cols = tensor.shape
    padded = np.zeros((-(-rows // LANES) * LANES, cols), np.uint16)
    padded[:rows] = bits
    data = np.ascontiguousarray(padded.reshape(-1, LANES, cols).transpose(0, 2, 1))
    return HalfWeight(tensor.qtype, data, (rows, cols))


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 fma(a, b, c) = a*b + c rounded once, exactly, for float32 arrays (broadcast).
    a*b is exact in float64 (24 + 24 bits); s = fl64(a*b + c) with its error e (TwoSum) is
    the exact sum s + e. Rounding s to float32 is then right unless s lies exactly halfway
    between two float32s (no other float32 midpoint can lie between s and s + e: it would be
    a float64 nearer than s); there e != 0 breaks the tie."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    with np.errstate(invalid="ignore", over="ignore"):
        bb = s - p
        e = (p - (s - bb)) + (c64 - bb)
        r = s.astype(np.float32)
        r64 = r.astype(np.float64)
        toward = np.nextafter(r, np.where(s > r64, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32))
        tie = (s != r64) & (toward.astype(np.float64) - s == s - r64) & np.isfinite(s) & (e != 0)
        e_up = np.where(e > 0, s > r64, s < r64)    # e pushes s past the midpoint toward `toward`
    return np.where(tie & e_up, toward, r).astype(np.float32)


def matmul_16bit_numpy(x: np.ndarray, weight: HalfWeight) -> np.ndarray:
    """x [M, K] float32 @ weight[N, K]^T -> [M, N] float32, in the kernel's order (slow: K steps)."""
    x = np.asarray(x, dtype=np.float32)
    w = weight.dequantize()
    out = np.zeros((x.shape[0], weight.shape[0]), np.float32)
    for k in range(x.shape[1]):
        out = fma32(x[:, k:k + 1], w[None, :, k], out)
    return out
