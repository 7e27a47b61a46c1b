"""Small helpers shared by the kernel launches in ops/: dtype suffixes, array module, strides."""
from __future__ import annotations

import numpy as np

from ember_cupy.ops import _cuda

SUFFIXES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


_suffix_of: dict = {}    # dtype (as passed) -> suffix: np.dtype(...).name costs ~5 us a launch


def kernel(source: str, name: str, dtype):
    """The per-dtype entry `name_<suffix>` of cuda/`source`."""
    suffix = _suffix_of.get(dtype)
    if suffix is None:
        suffix = SUFFIXES.get(np.dtype(dtype).name)
        if suffix is None:
            raise TypeError(f"{name}: no kernel for dtype {np.dtype(dtype)} (supported: {', '.join(SUFFIXES)})")
        _suffix_of[dtype] = suffix
    return _cuda.function(source, f"{name}_{suffix}")


def array_module(array):
    if isinstance(array, np.ndarray):
        return np
    import cupy
    return cupy


def i32(value) -> np.int32:
    value = int(value)
    if not -(1 << 31) <= value < (1 << 31):
        raise OverflowError(f"{value} does not fit the kernel's 32-bit argument")
    return np.int32(value)


def stride(array, axis: int) -> np.int32:
    """Element stride of `axis` (kernels index with element strides; the last axis must be dense)."""
    if array.strides[-1] != array.itemsize:
        raise ValueError(f"kernel operand with shape {array.shape} needs a contiguous last axis")
    return i32(array.strides[axis] // array.itemsize)


def int32_array(xp, array):
    """Metadata as contiguous int32 on the operands' device (no copy when it already is)."""
    return xp.ascontiguousarray(xp.asarray(array), dtype=xp.int32)


def contiguous(xp, array, name: str):
    if not array.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous for its kernel")
    return array
