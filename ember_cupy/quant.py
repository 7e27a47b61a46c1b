"""Quantized weight tensors in GGUF block formats, and the conversions between them.

A `QuantizedTensor` is a matrix [rows, cols] stored row by row as GGUF blocks of 32 columns
(`data`: uint8 [rows, row_bytes]), exactly as a GGUF file holds it. The host kernels read a
`PackedWeight`: Q8_0 or Q4_1 blocks with 8 rows interleaved (layout in cpu/matmul_q.c), the same
bytes per weight. Q4_0 becomes Q4_1 (w = d*q - 8d is w = d*q + m with m = -8d, exact in f16);
every other GGUF type is requantized to Q8_0 from its dequantized values.
The CUDA kernels read a `DeviceQuantizedWeight`: Q8_0, Q4_0 or Q4_1 blocks split into quants and
f16 scales (layout in cuda/matmul_q.cu), on the device, the same bytes per weight.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32
ROWS_PER_GROUP = 8
# formats the kernels compute on: the kernel's type code (cpu/matmul_q.c)
KERNEL_FORMATS = {"Q8_0": 0, "Q4_1": 1}
# formats cuda/matmul_q.cu computes on, and the bytes of a GGUF block (scales first, then quants)
DEVICE_FORMATS = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


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


@dataclass(frozen=True)
class PackedWeight:
    """A Q8_0 or Q4_1 matrix [rows, cols] repacked for the host kernels: per group of 8 rows and
    block of 32 columns, the 8 f16 scales (and offsets), then the values interleaved so that a
    32-byte load holds 4 columns of all 8 rows. Rows are padded to a multiple of 8."""
    qtype: str                  # "Q8_0" or "Q4_1"
    data: np.ndarray            # uint8 [groups, blocks * record bytes]
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def kernel_type(self) -> int:
        return KERNEL_FORMATS[self.qtype]

    def to_gguf(self) -> QuantizedTensor:
        return QuantizedTensor(self.qtype, _unpack(self), self.shape)

    def dequantize(self, rows=None) -> np.ndarray:
        """float32 [rows, cols]; with `rows`, only their groups are unpacked (embedding lookups)."""
        if rows is None:
            return self.to_gguf().dequantize()
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if self.qtype == "Q8_0":
            return self._q8_0_rows(rows)
        groups, position = np.unique(rows // ROWS_PER_GROUP, return_inverse=True)
        subset = PackedWeight(self.qtype, self.data[groups], (len(groups) * ROWS_PER_GROUP, self.shape[1]))
        return subset.to_gguf().dequantize(position * ROWS_PER_GROUP + rows % ROWS_PER_GROUP)


    def _q8_0_rows(self, rows: np.ndarray) -> np.ndarray:
        """Q8_0 rows straight from the interleaved records (an embedding lookup per step)."""
        nb = self.shape[1] // BLOCK
        records = self.data.reshape(-1, nb, 272)[rows // ROWS_PER_GROUP]            # [R, nb, 272]
        lane = rows % ROWS_PER_GROUP
        scales = records[:, :, :16].view(np.float16)[np.arange(len(rows)), :, lane]   # [R, nb]
        values = records[:, :, 16:].view(np.int8).reshape(len(rows), nb, 8, 8, 4)    # [R, nb, j, r, i]
        values = values[np.arange(len(rows)), :, :, lane]                            # [R, nb, j, i]
        return (values.reshape(len(rows), nb, BLOCK) * scales[..., None].astype(np.float32)).reshape(
            len(rows), self.shape[1]).astype(np.float32)


def pack(tensor: QuantizedTensor) -> PackedWeight:
    """GGUF Q8_0 / Q4_1 rows -> the interleaved layout of cpu/matmul_q.c."""
    rows, cols = tensor.shape
    groups, nb = -(-rows // ROWS_PER_GROUP), cols // BLOCK
    block_bytes = {"Q8_0": 34, "Q4_1": 20}[tensor.qtype]
    blocks = np.zeros((groups * ROWS_PER_GROUP, nb, block_bytes), np.uint8)
    blocks[:rows] = tensor.data.reshape(rows, nb, block_bytes)
    blocks = blocks.reshape(groups, ROWS_PER_GROUP, nb, block_bytes).transpose(0, 2, 1, 3)  # [G, nb, 8, B]
    scales = [blocks[..., :2].reshape(groups, nb, 16)]
    if tensor.qtype == "Q4_1":
        scales.append(blocks[..., 2:4].reshape(groups, nb, 16))
        nibbles = blocks[..., 4:]
        values = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)          # [G, nb, 8, 32]
        # [G, nb, r, c, half, i] -> chunk c, byte 4r+i: low nibble half 0, high nibble half 1
        values = values.reshape(groups, nb, 8, 4, 2, 4).transpose(0, 1, 3, 4, 2, 5)
        packed = (values[..., 0, :, :] | (values[..., 1, :, :] << 4)).reshape(groups, nb, 128)
    else:
        values = blocks[..., 2:].reshape(groups, nb, 8, 8, 4).transpose(0, 1, 3, 2, 4)  # [G,nb,j,r,i]
        packed = values.reshape(groups, nb, 256)
    data = np.concatenate([*scales, packed], axis=-1).reshape(groups, -1)
    return PackedWeight(tensor.qtype, np.ascontiguousarray(data), tensor.shape)


def _unpack(weight: PackedWeight) -> np.ndarray:
    rows, cols = weight.shape
    groups, nb = weight.data.shape[0], cols // BLOCK
    if weight.qtype == "Q4_1":
        record = weight.data.reshape(groups, nb, 160)
        d, m = record[..., :16], record[..., 16:32]
        chunks = record[..., 32:].reshape(groups, nb, 4, 8, 4)                      # [G, nb, c, r, i]
        values = np.stack([chunks & 0x0F, chunks >> 4], axis=3)                    # [G, nb, c, half, r, i]
        values = values.transpose(0, 1, 4, 2, 3, 5).reshape(groups, nb, 8, 32)     # [G, nb, r, k]
        nibbles = values[..., :16] | (values[..., 16:] << 4)
        blocks = np.concatenate([d.reshape(groups, nb, 8, 2), m.reshape(groups, nb, 8, 2), nibbles], -1)
    else:
        record = weight.data.reshape(groups, nb, 272)
        d = record[..., :16].reshape(groups, nb, 8, 2)
        values = record[..., 16:].reshape(groups, nb, 8, 8, 4).transpose(0, 1, 3, 2, 4)  # [G,nb,r,j,i]
        blocks = np.concatenate([d, values.reshape(groups, nb, 8, 32)], -1)
    blocks = blocks.transpose(0, 2, 1, 3).reshape(groups * 8, -1)
    return np.ascontiguousarray(blocks[:rows])


def to_kernel_format(tensor: QuantizedTensor) -> PackedWeight:
    """The tensor as the kernels read it: packed as is, repacked (Q4_0), or requantized to Q8_0."""
    if tensor.qtype not in KERNEL_FORMATS:
        tensor = q4_0_as_q4_1(tensor) if tensor.qtype == "Q4_0" else quantize_q8_0(tensor.dequantize())
    return pack(tensor)


def concat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Stack matrices of one format and width (q/k/v or gate/up fused into one matmul)."""
    if len({(p.qtype, p.shape[1]) for p in parts}) != 1:
        raise ValueError("concat_rows needs parts of one format and width")
    data = np.concatenate([p.data for p in parts])
    return QuantizedTensor(parts[0].qtype, data, (data.shape[0], parts[0].shape[1]))


@dataclass(frozen=True)
class ActivationQuantization:
    """How the host's quantized matmul quantizes its input x to int8 blocks of 32 (cpu/matmul_q.c).
    passes=1: once (llama.cpp's scheme). passes=2: the residual x - d q is quantized again (x to
    ~14 bits) in the blocks that carry most of a row's rounding error, those whose d^2 is at least
    `second_pass_threshold` times the row's mean d^2 (0: every block); the others skip it."""
    passes: int = 1
    second_pass_threshold: float = 0.0

    def __post_init__(self):
        if self.passes not in (1, 2) or not self.second_pass_threshold >= 0:
            raise ValueError(f"activation quantization: passes must be 1 or 2 and the second-pass "
                             f"threshold >= 0, got {self.passes} and {self.second_pass_threshold}")


ONE_PASS = ActivationQuantization()


def fake_quantize_activations(x: np.ndarray, scheme: ActivationQuantization = ONE_PASS) -> np.ndarray:
    """x [M, K] float32 through the kernels' int8 activation blocks and back: per 32 values
    d = max|x| / 127, q = rint(x / d) (as x * (1/d), the kernels' exact float32 steps); with two
    passes, plus the residual quantized the same way in the blocks the threshold selects."""
    rows, cols = x.shape
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(rows, cols // BLOCK, BLOCK)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127.0)
    with np.errstate(divide="ignore"):
        inverse = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    first = (np.rint(blocks * inverse) * d).reshape(rows, cols)
    if scheme.passes == 1:
        return first
    square = d[..., 0].astype(np.float64) ** 2
    second_pass = square >= scheme.second_pass_threshold * square.mean(axis=1, keepdims=True)
    residual = np.where(np.repeat(second_pass, BLOCK, axis=1), fake_quantize_activations(x - first), 0.0)
    return first.astype(np.float64) + residual


@dataclass(frozen=True)
class DeviceQuantizedWeight:
    """A Q8_0 / Q4_0 / Q4_1 matrix [rows, cols] as cuda/matmul_q.cu reads it: `quants` uint8
    [rows, cols] (Q8_0's int8 values) or [rows, cols / 2] (the GGUF nibbles), `scales` float16
    [rows, cols / 32] (d) or, for Q4_1, [rows, cols / 32, 2] (d, m). The arrays live on the
    backend's device (NumPy arrays in the kernel tests)."""
    qtype: str
    quants: object
    scales: object
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return int(self.quants.nbytes) + int(self.scales.nbytes)

    def dequantize(self, rows=None) -> np.ndarray:
        """float32 [rows, cols] from host arrays (the kernels' NumPy twin); w = d*q, d*(q - 8), d*q + m."""
        quants, scales = np.asarray(self.quants), np.asarray(self.scales)
        if rows is not None:
            index = np.asarray(rows, dtype=np.int64).reshape(-1)
            quants, scales = quants[index], scales[index]
        count, nb = quants.shape[0], self.shape[1] // BLOCK
        d = (scales[..., 0] if self.qtype == "Q4_1" else scales).astype(np.float32)[..., None]
        if self.qtype == "Q8_0":
            values = quants.view(np.int8).reshape(count, nb, BLOCK) * d
        else:
            nibbles = quants.reshape(count, nb, BLOCK // 2)
            q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.float32)
            values = q * d + scales[..., 1:].astype(np.float32) if self.qtype == "Q4_1" else (q - 8) * d
        return values.reshape(count, self.shape[1]).astype(np.float32, copy=False)


def to_device_format(tensor: QuantizedTensor, put_raw) -> DeviceQuantizedWeight:
    """GGUF Q8_0 / Q4_0 / Q4_1 rows -> quants and scales, each moved by `put_raw` (e.g. cupy.asarray)."""
    if tensor.qtype not in DEVICE_FORMATS:
        raise ValueError(f"no CUDA kernel for {tensor.qtype} blocks (supported: {', '.join(DEVICE_FORMATS)})")
    rows, cols = tensor.shape
    scale_bytes = 4 if tensor.qtype == "Q4_1" else 2
    blocks = tensor.data.reshape(rows, cols // BLOCK, DEVICE_FORMATS[tensor.qtype])
    scales = np.ascontiguousarray(blocks[..., :scale_bytes]).view(np.float16)
    scales = scales.reshape(rows, cols // BLOCK, 2) if tensor.qtype == "Q4_1" else scales.reshape(rows, -1)
    quants = np.ascontiguousarray(blocks[..., scale_bytes:]).reshape(rows, -1)
    return DeviceQuantizedWeight(tensor.qtype, put_raw(quants), put_raw(scales), tensor.shape)
