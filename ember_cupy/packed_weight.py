"""Quantized matrices as the host kernels read them (cpu/matmul_q.c): the GGUF blocks of 8 rows
regrouped so that one 32-byte load holds 4 columns of all 8 rows, in the bytes per weight the
file stores (K-quants: +4 bytes per 256 weights for their sub-block scales as whole bytes).

Every format is a 32-column block of unsigned values u (Q8_0: its int8 values) with a float
rule per block, exactly the values `gguf.quants.dequantize` gives:
  Q8_0 d*q     Q4_1, Q5_1 d*u + m     Q4_0 d*(u - 8)     Q5_0 d*(u - 16)
  Q4_K, Q5_K (d*sc)*u - dmin*mn, sc and mn the 6-bit scale and min of the block's sub-block
  Q6_K (d*sc)*(u - 32), an int8 sc per 16 columns.
A group of 8 rows is a run of records, one per 32 columns (one per 256 for the K-quants): first
the header fields, each value for the 8 rows side by side (f16 d[8], ...), then per 32-column
block its high bits (if any) and its low nibbles (Q8_0: its 256 int8 values):
  values   V_j (j = 0..7) holds k = 4j..4j+3 of the 8 rows: byte 4r+i is row r at k = 4j+i;
  nibbles  4 chunks of 32 bytes: chunk c is V_2c in its low nibbles, V_2c+1 in its high ones;
  H1       (Q5_x) 32 bytes: bit j of byte 4r+i is bit 4 of V_j's byte 4r+i;
  H2       (Q6_K) 64 bytes: bits 2j, 2j+1 of half h's byte 4r+i are bits 4-5 of V_4h+j's byte.
Rows are padded to a multiple of 8 with zeros. A `StackedWeight` is a matrix whose row ranges
are stored in different formats (q/k/v or gate/up of a K-quant file): one matmul, parts in turn.
A `DequantizedWeight` is either, dequantized once at load where no host kernel can run.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ember_cupy.half_weight import pack_16bit
from ember_cupy.gguf_values import dequantize_values, gguf_values
from ember_cupy.quant import BLOCK, HALF_TYPES, QuantizedTensor, RowParts

ROWS_PER_GROUP = 8


@dataclass(frozen=True)
class Layout:
    code: int                                 # the kernel's type code (cpu/matmul_q.c)
    columns: int                              # columns per record: 32, or 256 (K-quants)
    header: tuple[tuple[str, str, int], ...]  # (field, dtype, values per row per record)
    high_bits: int = 0                        # bits above the nibbles: 0, 1 (H1) or 2 (H2)
    raw_bytes: bool = False                   # Q8_0: the int8 values themselves

    @property
    def blocks(self) -> int:
        return self.columns // BLOCK

    @property
    def header_bytes(self) -> int:
        return sum(np.dtype(dtype).itemsize * count * ROWS_PER_GROUP for _, dtype, count in self.header)

    @property
    def block_bytes(self) -> int:
        return 256 if self.raw_bytes else 128 + 32 * self.high_bits

    @property
    def record_bytes(self) -> int:
        return self.header_bytes + self.blocks * self.block_bytes


_K_HEADER = (("d", "f2", 1), ("dmin", "f2", 1), ("sc", "u1", 8), ("mn", "u1", 8))
LAYOUTS = {
    "Q8_0": Layout(0, 32, (("d", "f2", 1),), raw_bytes=True),
    "Q4_1": Layout(1, 32, (("d", "f2", 1), ("m", "f2", 1))),
    "Q4_K": Layout(2, 256, _K_HEADER),
    "Q5_K": Layout(3, 256, _K_HEADER, high_bits=1),
    "Q6_K": Layout(4, 256, (("d", "f2", 1), ("sc", "i1", 16)), high_bits=2),
    "Q5_0": Layout(5, 32, (("d", "f2", 1),), high_bits=1),
    "Q5_1": Layout(6, 32, (("d", "f2", 1), ("m", "f2", 1)), high_bits=1),
    "Q4_0": Layout(7, 32, (("d", "f2", 1),)),
}
KERNEL_FORMATS = {name: layout.code for name, layout in LAYOUTS.items()}


# --- values and fields <-> the interleaved records --------------------------------------
def _pad_rows(a: np.ndarray, groups: int) -> np.ndarray:
    out = np.zeros((groups * ROWS_PER_GROUP, *a.shape[1:]), a.dtype)
    out[:a.shape[0]] = a
    return out


def _block_bodies(layout: Layout, u: np.ndarray, groups: int) -> np.ndarray:
    """u [G*8, blocks, 32] -> [G, blocks, block_bytes]."""
    v = u.reshape(groups, ROWS_PER_GROUP, -1, 8, 4).transpose(0, 2, 3, 1, 4)      # [G, b, j, r, i]
    if layout.raw_bytes:
        return v.reshape(groups, v.shape[1], 256)
    parts = []
    if layout.high_bits == 1:
        bits = ((v >> 4) & 1) << np.arange(8, dtype=np.uint8).reshape(8, 1, 1)
        parts.append(np.bitwise_or.reduce(bits, axis=2))                           # [G, b, r, i]
    elif layout.high_bits == 2:
        bits = ((v.reshape(groups, -1, 2, 4, 8, 4) >> 4) & 3) << (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1, 1)
        parts.append(np.bitwise_or.reduce(bits, axis=3))                           # [G, b, h, r, i]
    parts.append((v[:, :, 0::2] & 0x0F) | ((v[:, :, 1::2] & 0x0F) << 4))           # [G, b, c, r, i]
    return np.concatenate([p.reshape(groups, p.shape[1], -1) for p in parts], axis=-1)


def _values_from_bodies(layout: Layout, bodies: np.ndarray) -> np.ndarray:
    """[G, blocks, block_bytes] -> u [G*8, blocks, 32]."""
    groups, blocks = bodies.shape[:2]
    if layout.raw_bytes:
        v = bodies.reshape(groups, blocks, 8, 8, 4)
    else:
        nib = bodies[..., -128:].reshape(groups, blocks, 4, 1, 8, 4)
        v = np.concatenate([nib & 0x0F, nib >> 4], axis=3).reshape(groups, blocks, 8, 8, 4)
        if layout.high_bits == 1:
            h = bodies[..., :32].reshape(groups, blocks, 1, 8, 4)
            v = v | (((h >> np.arange(8, dtype=np.uint8).reshape(8, 1, 1)) & 1) << 4)
        elif layout.high_bits == 2:
            h = bodies[..., :64].reshape(groups, blocks, 2, 1, 8, 4)
            shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1, 1)
            v = v | ((((h >> shifts) & 3) << 4).reshape(groups, blocks, 8, 8, 4))
    return v.transpose(0, 3, 1, 2, 4).reshape(groups * ROWS_PER_GROUP, blocks, BLOCK)


def _pack_values(qtype: str, u: np.ndarray, fields: dict[str, np.ndarray], shape) -> PackedWeight:
    layout = LAYOUTS[qtype]
    groups = -(-shape[0] // ROWS_PER_GROUP)
    records = shape[1] // layout.columns
    header = []
    for name, dtype, count in layout.header:
        value = _pad_rows(fields[name].reshape(shape[0], records, count).astype(dtype), groups)
        value = value.reshape(groups, ROWS_PER_GROUP, records, count).transpose(0, 2, 3, 1)
        header.append(np.ascontiguousarray(value).view(np.uint8).reshape(groups, records, -1))
    bodies = _block_bodies(layout, _pad_rows(u, groups), groups).reshape(groups, records, -1)
    data = np.concatenate([*header, bodies], axis=-1).reshape(groups, -1)
    return PackedWeight(qtype, np.ascontiguousarray(data), tuple(shape))


def _unpack_values(weight: PackedWeight) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """u [G*8, blocks, 32] and the fields [G*8, records, count] of every (padded) row."""
    layout = LAYOUTS[weight.qtype]
    groups, records = weight.data.shape[0], weight.shape[1] // layout.columns
    data = weight.data.reshape(groups, records, layout.record_bytes)
    fields, offset = {}, 0
    for name, dtype, count in layout.header:
        size = np.dtype(dtype).itemsize * count * ROWS_PER_GROUP
        value = np.ascontiguousarray(data[..., offset:offset + size]).view(dtype)
        fields[name] = value.reshape(groups, records, count, ROWS_PER_GROUP).transpose(0, 3, 1, 2).reshape(
            groups * ROWS_PER_GROUP, records, count)
        offset += size
    bodies = data[..., offset:].reshape(groups, records * layout.blocks, layout.block_bytes)
    return _values_from_bodies(layout, bodies), fields


# --- the weights -------------------------------------------------------------------------
@dataclass(frozen=True)
class PackedWeight:
    """A quantized matrix [rows, cols] in the host kernels' layout: data uint8 [groups, bytes]."""
    qtype: str
    data: np.ndarray
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def kernel_type(self) -> int:
        return KERNEL_FORMATS[self.qtype]

    @property
    def parts(self) -> tuple[PackedWeight, ...]:
        return (self,)

    def dequantize(self, rows=None) -> np.ndarray:
        """float32 [rows, cols]; with `rows`, only their groups are unpacked (embedding lookups)."""
        if rows is None:
            u, fields = _unpack_values(self)
            return dequantize_values(self.qtype, u, fields)[:self.shape[0]]
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        groups, position = np.unique(rows // ROWS_PER_GROUP, return_inverse=True)
        subset = PackedWeight(self.qtype, self.data[groups], (len(groups) * ROWS_PER_GROUP, self.shape[1]))
        u, fields = _unpack_values(subset)
        picked = position * ROWS_PER_GROUP + rows % ROWS_PER_GROUP
        return dequantize_values(self.qtype, u[picked], {k: v[picked] for k, v in fields.items()})


@dataclass(frozen=True)
class StackedWeight(RowParts):
    """A matrix whose consecutive row ranges are PackedWeights of different formats."""
    parts: tuple[PackedWeight, ...]

    def __post_init__(self):   # parts: PackedWeights, or HalfWeights (ember_cupy/half_weight.py)
        if len({p.shape[1] for p in self.parts}) != 1:
            raise ValueError("StackedWeight needs parts of one width")

    def dequantize(self, rows=None) -> np.ndarray:
        full = super().dequantize()
        return full if rows is None else full[np.asarray(rows, dtype=np.int64).reshape(-1)]


@dataclass(frozen=True, eq=False)
class DequantizedWeight:
    """A host-quantized matrix dequantized once at load, for when no host kernel can run: the
    float32 values [rows, cols] its packed form's dequantize() gives, so the NumPy twin
    (ops/linear.py matmul_q_numpy) computes exactly what it computes on the packed weight,
    without dequantizing it again on every call. packed_bytes: its size packed."""
    matrix: np.ndarray
    packed_bytes: int

    @classmethod
    def of(cls, parts: list[QuantizedTensor]) -> DequantizedWeight:
        """The matrix whose row ranges are `parts` (one, or a stack's), straight from the GGUF
        blocks: the packed weight's values without packing it (the default model's Q8_0
        embedding: 0.34 s instead of 1.7 s)."""
        parts = [kernel_type(part) for part in parts]
        for part in parts:
            check_packable(part)
        values = [dequantize_values(part.qtype, *gguf_values(part)) for part in parts]
        matrix = values[0] if len(values) == 1 else np.concatenate(values)
        # column-major: matrix.T, what a matmul multiplies by, is a C-contiguous [in, out]
        # (ops/linear.py float_matmul: its rows' bits hold in that layout)
        return cls(np.asfortranarray(matrix), sum(packed_nbytes(part) for part in parts))

    @property
    def shape(self) -> tuple[int, int]:
        return self.matrix.shape

    @property
    def nbytes(self) -> int:
        return self.matrix.nbytes

    def dequantize(self, rows=None) -> np.ndarray:
        return self.matrix if rows is None else self.matrix[np.asarray(rows, dtype=np.int64).reshape(-1)]


def check_packable(tensor: QuantizedTensor) -> None:
    if tensor.qtype not in LAYOUTS:
        raise ValueError(f"no host kernel for {tensor.qtype} blocks (supported: {', '.join(LAYOUTS)})")
    if tensor.shape[1] % LAYOUTS[tensor.qtype].columns:
        raise ValueError(f"{tensor.qtype} needs a multiple of {LAYOUTS[tensor.qtype].columns} columns, "
                         f"got {tensor.shape}")


def packed_nbytes(tensor: QuantizedTensor) -> int:
    """The bytes of `tensor` packed (its rows padded to whole groups of 8)."""
    layout = LAYOUTS[tensor.qtype]
    return -(-tensor.shape[0] // ROWS_PER_GROUP) * (tensor.shape[1] // layout.columns) * layout.record_bytes


def kernel_type(tensor: QuantizedTensor) -> QuantizedTensor:
    """The tensor in a format with a kernel: as stored, or requantized to Q8_0 from its values."""
    from ember_cupy.quant import quantize_q8_0
    return tensor if tensor.qtype in LAYOUTS else quantize_q8_0(tensor.dequantize())


def pack(tensor: QuantizedTensor) -> PackedWeight:
    """GGUF rows of a kernel format -> the interleaved layout (the NumPy twin of cpu/pack.c)."""
    check_packable(tensor)
    u, fields = gguf_values(tensor)
    return _pack_values(tensor.qtype, u, fields, tensor.shape)


def to_kernel_format(tensor: QuantizedTensor):
    """The tensor as the kernels read it: packed as stored (16-bit floats: a HalfWeight), or (a
    type without a kernel) requantized to Q8_0 from its dequantized values. In NumPy; ops/pack.py
    packs with the host kernel."""
    if tensor.qtype in HALF_TYPES:
        return pack_16bit(tensor)
    return pack(kernel_type(tensor))


def stack(parts: list[PackedWeight]) -> PackedWeight | StackedWeight:
    return parts[0] if len(parts) == 1 else StackedWeight(tuple(parts))
