"""The values of GGUF blocks, the NumPy reference of every quantized kernel: each format is a
32-column block of unsigned values u (Q8_0: its int8 values) with a float rule per block, exactly
the values `gguf.quants.dequantize` gives:
  Q8_0 d*q     Q4_1, Q5_1 d*u + m     Q4_0 d*(u - 8)     Q5_0 d*(u - 16)
  Q4_K, Q5_K (d*sc)*u - dmin*mn, sc and mn the 6-bit scale and min of the block's sub-block
  Q6_K (d*sc)*(u - 32), an int8 sc per 16 columns.
The host kernels' layout (packed_weight.py) and the device's (quant.DeviceQuantizedWeight) are
both dequantized through these functions by their twins.
"""
from __future__ import annotations

import numpy as np

BLOCK = 32          # columns of a block (the K-quants' blocks of 256 hold 8 of them)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes [..., 16] -> 32 values: the low nibbles first, then the high ones (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes [..., 4] of bit i = value i's bit 4 -> [..., 32] of 0 / 16."""
    return (np.unpackbits(qh, axis=-1, bitorder="little") << 4).astype(np.uint8)


def gguf_values(tensor) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """u [rows, blocks, 32] uint8 and the header fields [rows, records, count] of a tensor's GGUF
    blocks (anything with qtype, data uint8 [rows, row_bytes] and shape, as quant.QuantizedTensor)."""
    from gguf.quants import Q4_K
    rows, cols = tensor.shape
    q = tensor.qtype
    if q in ("Q8_0", "Q4_1", "Q4_0", "Q5_0", "Q5_1"):
        b = tensor.data.reshape(rows, cols // BLOCK, -1)
        fields = {"d": _f16(b[..., 0:2])}
        if q == "Q8_0":
            return np.ascontiguousarray(b[..., 2:]), fields
        if q in ("Q4_1", "Q5_1"):
            fields["m"] = _f16(b[..., 2:4])
        start = 4 if q in ("Q4_1", "Q5_1") else 2
        if q in ("Q4_0", "Q4_1"):
            return _nibbles(b[..., start:]), fields
        return _nibbles(b[..., start + 4:]) | _fifth_bits(b[..., start:start + 4]), fields
    sb = tensor.data.reshape(rows, cols // 256, -1)
    if q == "Q6_K":
        ql, qh = sb[..., :128].reshape(rows, -1, 2, 2, 32), sb[..., 128:192].reshape(rows, -1, 2, 1, 32)
        low = np.stack([ql & 0x0F, ql >> 4], axis=3).reshape(rows, -1, 2, 4, 32)       # [.., h, t, i]
        high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3               # [.., h, t, i]
        u = (low | (high << 4)).reshape(rows, -1, 32)
        return u, {"d": _f16(sb[..., 208:210]), "sc": np.ascontiguousarray(sb[..., 192:208]).view(np.int8)}
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(sb[..., 4:16]).reshape(-1, 12))
    fields = {"d": _f16(sb[..., 0:2]), "dmin": _f16(sb[..., 2:4]),
              "sc": sc.reshape(rows, -1, 8), "mn": mn.reshape(rows, -1, 8)}
    qs = sb[..., -128:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    u = (qs & 0x0F).reshape(rows, -1, 8, 32)
    if q == "Q5_K":
        qh = sb[..., 16:48].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
        u = u | ((qh & 1) << 4)
    return u.reshape(rows, -1, 32), fields


def dequantize_values(qtype: str, u: np.ndarray, fields: dict[str, np.ndarray]) -> np.ndarray:
    """float32 [rows, cols] from values u [rows, blocks, 32] and header fields: the twin's weights."""
    rows, blocks = u.shape[:2]
    per_block = lambda a: np.repeat(a.astype(np.float32), blocks // a.shape[1], axis=1)[..., None]  # noqa: E731
    d = per_block(fields["d"].reshape(rows, -1))
    if qtype == "Q8_0":
        w = d * u.view(np.int8).astype(np.float32)
    elif qtype in ("Q4_1", "Q5_1"):
        w = d * u.astype(np.float32) + fields["m"].reshape(rows, blocks, 1).astype(np.float32)
    elif qtype in ("Q4_0", "Q5_0"):
        w = d * (u.astype(np.float32) - (8 if qtype == "Q4_0" else 16))
    elif qtype == "Q6_K":
        scale = d.reshape(rows, blocks, 1, 1) * fields["sc"].reshape(rows, blocks, 2, 1).astype(np.float32)
        w = scale * (u.reshape(rows, blocks, 2, 16).astype(np.float32) - 32)
    else:
        scale = d * fields["sc"].reshape(rows, blocks, 1).astype(np.float32)
        minimum = per_block(fields["dmin"].reshape(rows, -1)) * fields["mn"].reshape(rows, blocks, 1).astype(np.float32)
        w = scale * u.astype(np.float32) - minimum
    return w.reshape(rows, blocks * BLOCK).astype(np.float32, copy=False)
