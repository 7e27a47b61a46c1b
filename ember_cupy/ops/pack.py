"""GGUF matrices packed for the host kernels at load: cpu/pack.c, in parallel over groups of 8
rows, or its NumPy twin `ember_cupy.packed_weight.pack` (the same bytes; tests/test_host_kernels.py);
16-bit float matrices in panels of 16 rows by cpu/matmul_16bit.c, or `half_weight.pack_16bit`."""
from __future__ import annotations

import numpy as np

from ember_cupy.half_weight import LANES, HalfWeight, half_bits, pack_16bit
from ember_cupy.ops import _host
from ember_cupy.packed_weight import LAYOUTS, ROWS_PER_GROUP, PackedWeight, check_packable, kernel_type, pack
from ember_cupy.quant import HALF_TYPES, QuantizedTensor


def pack_host(tensor: QuantizedTensor, library) -> PackedWeight:
    check_packable(tensor)
    layout = LAYOUTS[tensor.qtype]
    rows, cols = tensor.shape
    group_bytes = cols // layout.columns * layout.record_bytes
    data = np.empty((-(-rows // ROWS_PER_GROUP), group_bytes), np.uint8)
    source = tensor.data if tensor.data.strides[1] == 1 else np.ascontiguousarray(tensor.data)
    status = library.lib.ember_pack_weight(layout.code, source.ctypes.data, source.strides[0], rows, cols,
                                           data.ctypes.data, group_bytes)
    if status:
        raise RuntimeError(f"ember_pack_weight failed with status {status}")
    return PackedWeight(tensor.qtype, data, tuple(tensor.shape))


def pack_16bit_host(tensor: QuantizedTensor, library) -> HalfWeight:
    bits = half_bits(tensor)
    rows, cols = tensor.shape
    data = np.empty((-(-rows // LANES), cols, LANES), np.uint16)
    status = library.lib.ember_pack_16bit(bits.ctypes.data, bits.strides[0] // 2, rows, cols, data.ctypes.data)
    if status:
        raise RuntimeError(f"ember_pack_16bit failed with status {status}")
    return HalfWeight(tensor.qtype, data, tuple(tensor.shape))


def to_kernel_format(tensor: QuantizedTensor, library=None) -> PackedWeight | HalfWeight:
    """The tensor as the host kernels read it: packed as stored (16-bit floats in panels), or (a
    type without a kernel) requantized to Q8_0 from its dequantized values; packed by the host
    kernel when one is active."""
    library = library or _host.active()
    if tensor.qtype in HALF_TYPES:
        return pack_16bit(tensor) if library is None else pack_16bit_host(tensor, library)
    tensor = kernel_type(tensor)
    return pack(tensor) if library is None else pack_host(tensor, library)
