"""Quantized weight tensors in GGUF block formats, and the conversions between them.

A `QuantizedTensor` is a matrix [rows, cols] stored row by row as GGUF blocks of 32 columns
(`data`: uint8 [rows, row_bytes]), exactly as a GGUF file holds it; or as 16-bit floats (qtype
F16 or BF16: 2 bytes a value, from a GGUF file or a safetensors checkpoint), which the host
serves as stored (ember_cupy/half_weight.py). The host kernels read a
`PackedWeight` (ember_cupy/packed_weight.py): the same blocks with 8 rows interleaved.
The CUDA kernels read a `DeviceQuantizedWeight`: Q8_0, Q4_0, Q4_1, Q4_K or Q6_K blocks split into
quants and scales (layout in cuda/matmul_q.cu), on the device, the same bytes per weight.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby

import numpy as np

from ember_cupy.gguf_values import BLOCK, dequantize_values, gguf_values

HALF_TYPES = ("F16", "BF16")     # 16-bit float matrices: widened in registers, never quantized
# formats cuda/matmul_q.cu computes on, and the bytes of a GGUF block (32 weights; 256 for the K-quants)
DEVICE_FORMATS = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q6_K": 210}
# where a block's scales lie in it (first byte, bytes); the rest are its quants
_DEVICE_SCALES = {"Q8_0": (0, 2), "Q4_0": (0, 2), "Q4_1": (0, 4), "Q4_K": (0, 16), "Q6_K": (192, 18)}
K_QUANT_BLOCK = 256


def block_columns(qtype: str) -> int:
    """Columns of a GGUF block of `qtype`: 256 for the K-quants, else 32."""
    return K_QUANT_BLOCK if qtype.endswith("_K") else BLOCK


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
        data = self.data if rows is None else self.data[rows]
        if self.qtype in HALF_TYPES:
            return widen(np.ascontiguousarray(data).view(np.uint16), self.qtype).reshape(data.shape[0], self.shape[1])
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        values = dequantize(data, GGMLQuantizationType[self.qtype])
        return values.astype(np.float32, copy=False).reshape(data.shape[0], self.shape[1])

    def take_rows(self, index) -> QuantizedTensor:
        data = np.ascontiguousarray(self.data[index])
        return QuantizedTensor(self.qtype, data, (data.shape[0], self.shape[1]))


def widen(bits: np.ndarray, qtype: str) -> np.ndarray:
    """16-bit float bits (uint16) of `qtype` (F16 or BF16) -> their float32 values (exact)."""
    if qtype == "F16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def half_tensor(bits: np.ndarray, qtype: str) -> QuantizedTensor:
    """A 2-D array of 16-bit floats (uint16 bits, float16 or bfloat16) as a QuantizedTensor."""
    bits = np.ascontiguousarray(bits)
    return QuantizedTensor(qtype, bits.view(np.uint8).reshape(bits.shape[0], -1), tuple(bits.shape))


def quantize_q8_0(weight: np.ndarray) -> QuantizedTensor:
    """float [rows, cols] -> Q8_0 (llama.cpp's reference rounding, via the gguf package)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if weight.ndim != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"Q8_0 needs a matrix with a multiple of {BLOCK} columns, got {weight.shape}")
    return QuantizedTensor("Q8_0", quantize(weight, GGMLQuantizationType.Q8_0), weight.shape)


class RowParts:
    """A matrix stacked from `parts` by rows (one width): its shape, bytes and values."""
    parts: tuple

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self) -> np.ndarray:
        return np.concatenate([p.dequantize() for p in self.parts])


@dataclass(frozen=True)
class QuantizedStack(RowParts):
    """Row ranges of one matrix in their GGUF formats (a fused q/k/v or gate/up as the file holds
    its parts; a K-quant file's differ in format)."""
    parts: tuple[QuantizedTensor, ...]

    def runs(self) -> list[list[QuantizedTensor]]:
        """The parts in runs of one format: each run becomes one matrix of the serving format."""
        return [list(run) for _, run in groupby(self.parts, key=lambda part: part.qtype)]


def concat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Stack matrices of one format and width (q/k/v or gate/up fused into one matmul)."""
    if len({(p.qtype, p.shape[1]) for p in parts}) != 1:
        raise ValueError("concat_rows needs parts of one format and width")
    data = np.concatenate([p.data for p in parts])
    return QuantizedTensor(parts[0].qtype, data, (data.shape[0], parts[0].shape[1]))


@dataclass(frozen=True)
class ActivationQuantization:
    """How the host's quantized matmul quantizes its input x, in blocks of 32 (cpu/matmul_q.c).
    passes=1: to int8 (llama.cpp's scheme). passes=2: to 16 bits, held as two int8 rows q = 255 hi
    + lo whose dot products the kernels combine exactly, in the blocks that carry most of a row's
    rounding error, those whose d^2 (of the int8 scale) is at least `second_pass_threshold` times
    the row's mean d^2 (0: every block); the others keep 255 hi alone (about int8)."""
    passes: int = 1
    second_pass_threshold: float = 0.0

    def __post_init__(self):
        if self.passes not in (1, 2) or not self.second_pass_threshold >= 0:
            raise ValueError(f"activation quantization: passes must be 1 or 2 and the second-pass "
                             f"threshold >= 0, got {self.passes} and {self.second_pass_threshold}")


ONE_PASS = ActivationQuantization()


SPLIT_BASE = 255                  # two passes: q = SPLIT_BASE hi + lo, hi and lo int8 within +-127
SPLIT_LEVELS = SPLIT_BASE * 127 + 127


def fake_quantize_activations(x: np.ndarray, scheme: ActivationQuantization = ONE_PASS) -> np.ndarray:
    """x [M, K] float32 through the kernels' activation blocks and back: per 32 values
    d = max|x| / levels, q = rint(x / d) (as x * (1/d), the kernels' exact float32 steps), levels
    127 (one pass) or SPLIT_LEVELS (two passes; q as 255 hi alone in the blocks the threshold
    leaves out, hi = floor((q + 127) / 255))."""
    rows, cols = x.shape
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(rows, cols // BLOCK, BLOCK)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    if scheme.passes == 1:
        d = amax / np.float32(127.0)
        return (np.rint(blocks * _inverse(d)) * d).reshape(rows, cols)
    d = amax / np.float32(SPLIT_LEVELS)
    inverse = _inverse(d)
    tiny = np.isinf(inverse)                      # 1 / d overflows: the kernels' zero block
    q = np.rint(blocks * np.where(tiny, np.float32(0.0), inverse))
    square = (amax[..., 0] / np.float32(127.0)).astype(np.float64) ** 2
    kept = square >= scheme.second_pass_threshold * square.mean(axis=1, keepdims=True)
    hi_only = SPLIT_BASE * np.floor((q + 127) / SPLIT_BASE)
    q = np.where(kept[..., None], q, hi_only)
    return (q.astype(np.float64) * np.where(tiny, 0.0, d)).reshape(rows, cols)


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", over="ignore"):
        return np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)


@dataclass(frozen=True)
class DeviceQuantizedWeight:
    """A matrix [rows, cols] in a DEVICE_FORMATS format as cuda/matmul_q.cu reads it: each GGUF
    block split into its scales and its quants. Q8_0 / Q4_0 / Q4_1: `quants` uint8 [rows, cols]
    (Q8_0's int8 values) or [rows, cols / 2] (the GGUF nibbles), `scales` float16 [rows, cols / 32]
    (d) or, for Q4_1, [rows, cols / 32, 2] (d, m). Q4_K / Q6_K: `quants` uint8 [rows, blocks *
    (block bytes - scale bytes)], each block's quant bytes as stored, `scales` uint8 [rows, blocks,
    16 or 18], each block's header bytes as stored. The arrays live on the backend's device (NumPy
    arrays in the kernel tests)."""
    qtype: str
    quants: object
    scales: object
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return int(self.quants.nbytes) + int(self.scales.nbytes)

    def dequantize(self, rows=None) -> np.ndarray:
        """float32 [rows, cols] from host arrays (the kernels' NumPy twin); w = d*q, d*(q - 8),
        d*q + m; the K-quants through the host kernels' reference (gguf_values)."""
        quants, scales = np.asarray(self.quants), np.asarray(self.scales)
        if rows is not None:
            index = np.asarray(rows, dtype=np.int64).reshape(-1)
            quants, scales = quants[index], scales[index]
        count = quants.shape[0]
        if self.qtype.endswith("_K"):
            tensor = QuantizedTensor(self.qtype, gguf_blocks(self.qtype, quants, scales), (count, self.shape[1]))
            return dequantize_values(self.qtype, *gguf_values(tensor))
        nb = self.shape[1] // BLOCK
        d = (scales[..., 0] if self.qtype == "Q4_1" else scales).astype(np.float32)[..., None]
        if self.qtype == "Q8_0":
            values = quants.view(np.int8).reshape(count, nb, BLOCK) * d
        else:
            nibbles = quants.reshape(count, nb, BLOCK // 2)
            q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.float32)
            values = q * d + scales[..., 1:].astype(np.float32) if self.qtype == "Q4_1" else (q - 8) * d
        return values.reshape(count, self.shape[1]).astype(np.float32, copy=False)


@dataclass(frozen=True)
class DeviceStack(RowParts):
    """A matrix whose consecutive row ranges are DeviceQuantizedWeights of different formats (a
    K-quant file's q/k/v or gate/up: Q4_K and Q6_K parts); a matmul computes the parts in turn."""
    parts: tuple[DeviceQuantizedWeight, ...]


def to_device_format(tensor: QuantizedTensor, put_raw) -> DeviceQuantizedWeight:
    """GGUF rows in a DEVICE_FORMATS format -> quants and scales, each moved by `put_raw` (e.g. cupy.asarray)."""
    if tensor.qtype not in DEVICE_FORMATS:
        raise ValueError(f"no CUDA kernel for {tensor.qtype} blocks (supported: {', '.join(DEVICE_FORMATS)})")
    rows, cols = tensor.shape
    first, size = _DEVICE_SCALES[tensor.qtype]
    blocks = tensor.data.reshape(rows, cols // block_columns(tensor.qtype), DEVICE_FORMATS[tensor.qtype])
    scales = np.ascontiguousarray(blocks[..., first:first + size])
    quants = np.concatenate([blocks[..., :first], blocks[..., first + size:]], axis=-1).reshape(rows, -1)
    if not tensor.qtype.endswith("_K"):
        scales = scales.view(np.float16)
        scales = scales.reshape(rows, cols // BLOCK, 2) if tensor.qtype == "Q4_1" else scales.reshape(rows, -1)
    return DeviceQuantizedWeight(tensor.qtype, put_raw(quants), put_raw(scales), tensor.shape)


def gguf_blocks(qtype: str, quants: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The GGUF blocks uint8 [rows, row_bytes] of a K-quant's device arrays (to_device_format's inverse)."""
    rows, blocks, first = scales.shape[0], scales.shape[1], _DEVICE_SCALES[qtype][0]
    quants = quants.reshape(rows, blocks, -1)
    return np.concatenate([quants[..., :first], scales, quants[..., first:]], axis=-1).reshape(rows, -1)
