"""GGUF matrices packed for the host kernels at load: cpu/pack.c, in parallel over groups of 8
rows, or its NumPy twin `ember_cupy.packed_weight.pack` (the same bytes; tests/test_host_kernels.py);
16-bit float matrices in panels of 16 rows by cpu/matmul_16bit.c, or `half_weight.pack_16bit`."""
from __future__ import annotations

import numpy as np

from ember_cupy.half_weight import LANES, HalfWeight, half_bits, pack_16bit
from ember_cupy.ops import _host
from ember_cupy.packed_weight import LAYOUTS, ROWS_PER_GROUP, PackedWeight, check_packable, kernel_type, pack
from ember_cupy.quant import HALF_TYPES, QuantizedTensor, concat_rows


def pack_host(parts: list[QuantizedTensor], library, alloc=np.empty) -> PackedWeight:
    """The matrix stacked from `parts` by rows (one format and width), packed: each part straight
    into its rows of the packed matrix, so a fused q/k/v or gate/up is never first copied whole
    (one copy of the matrix less at load). Parts that leave a group of 8 rows unfinished before
    the last are concatenated first, as a group cannot be split. alloc(shape, dtype): where the
    packed bytes go (a file mapping: ember_cupy/model/weight_cache.py)."""
    for part in parts:
        check_packable(part)
    if any(part.shape[0] % ROWS_PER_GROUP for part in parts[:-1]):
        parts = [concat_rows(parts)]
    layout = LAYOUTS[parts[0].qtype]
    rows, cols = sum(part.shape[0] for part in parts), parts[0].shape[1]
    group_bytes = cols // layout.columns * layout.record_bytes
    data = alloc((-(-rows // ROWS_PER_GROUP), group_bytes), np.uint8)
    first_group = 0
    for part in parts:
        source = part.data if part.data.strides[1] == 1 else np.ascontiguousarray(part.data)
        status = library.lib.ember_pack_weight(layout.code, source.ctypes.data, source.strides[0], part.shape[0],
                                               cols, data[first_group:].ctypes.data, group_bytes)
        if status:
            raise RuntimeError(f"ember_pack_weight failed with status {status}")
        first_group += part.shape[0] // ROWS_PER_GROUP
    return PackedWeight(parts[0].qtype, data, (rows, cols))


def pack_16bit_host(tensor: QuantizedTensor, library, alloc=np.empty) -> HalfWeight:
    bits = half_bits(tensor)
    rows, cols = tensor.shape
    data = alloc((-(-rows // LANES), cols, LANES), np.uint16)
    status = library.lib.ember_pack_16bit(bits.ctypes.data, bits.strides[0] // 2, rows, cols, data.ctypes.data)
    if status:
        raise RuntimeError(f"ember_pack_16bit failed with status {status}")
    return HalfWeight(tensor.qtype, data, tuple(tensor.shape))


def to_kernel_format(tensor: QuantizedTensor | list[QuantizedTensor], library=None,
                     alloc=np.empty) -> PackedWeight | HalfWeight:
    """The tensor (or the one stacked by rows from a list of them, of one format) as the host
    kernels read it: packed as stored (16-bit floats in panels), or (a type without a kernel)
    requantized to Q8_0 from its dequantized values; packed by the host kernel when one is active
    (into alloc(shape, dtype)'s array)."""
    library = library or _host.active()
    parts = tensor if isinstance(tensor, list) else [tensor]
    if parts[0].qtype in HALF_TYPES:
        tensor = concat_rows(parts) if len(parts) > 1 else parts[0]
        return pack_16bit(tensor) if library is None else pack_16bit_host(tensor, library, alloc)
    parts = [kernel_type(part) for part in parts]
    if library is None:
        return pack(concat_rows(parts) if len(parts) > 1 else parts[0])
    return pack_host(parts, library, alloc)
