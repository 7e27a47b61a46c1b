"""RMSNorm and fused residual-add + RMSNorm: NumPy twins, host kernels (cpu/elementwise.c) and
launches of cuda/norm.cu."""
from __future__ import annotations

import numpy as np

from ember_cupy.ops import _cuda, _host
from ember_cupy.ops._kernel import array_module, i32, kernel, stride


THREADS = 256


def rms_norm(x, weight, eps: float):
    """x [T, H] -> x / rms(x) * weight, in a new array."""
    if _cuda.wants_kernel(x):
        return _rms_norm_kernel(x, weight, eps)
    library = _host.active()
    if library is not None and _host.rows_f32(x, weight):
        out = np.empty(x.shape, np.float32)
        library.lib.ember_rms_norm(x.ctypes.data, _host.row_stride(x), weight.ctypes.data, out.ctypes.data,
                                   x.shape[1], x.shape[0], x.shape[1], eps)
        return out
    return rms_norm_numpy(x, weight, eps)


def rms_norm_numpy(x, weight, eps: float):
    variance = np.einsum("ij,ij->i", x, x, dtype=np.float32) / x.shape[-1]
    scale = 1.0 / np.sqrt(variance + np.float32(eps), dtype=np.float32)
    return (x * scale[:, None]) * weight


def fused_add_rms_norm(x, residual, weight, eps: float):
    """In place: residual += x; x = rms_norm(residual) * weight. Returns (x, residual)."""
    if _cuda.wants_kernel(x):
        return _fused_add_rms_norm_kernel(x, residual, weight, eps)
    library = _host.active()
    if library is not None and _host.rows_f32(x, residual, weight) and x.shape == residual.shape:
        library.lib.ember_fused_add_rms_norm(x.ctypes.data, _host.row_stride(x), residual.ctypes.data,
                                             _host.row_stride(residual), weight.ctypes.data,
                                             x.shape[0], x.shape[1], eps)
        return x, residual
    return fused_add_rms_norm_numpy(x, residual, weight, eps)


def fused_add_rms_norm_numpy(x, residual, weight, eps: float):
    residual += x
    variance = np.einsum("ij,ij->i", residual, residual, dtype=np.float32) / x.shape[-1]
    scale = 1.0 / np.sqrt(variance + np.float32(eps), dtype=np.float32)
    np.multiply(residual, scale[:, None], out=x)
    x *= weight
    return x, residual


def _rms_norm_kernel(x, weight, eps: float):
    num_tokens, hidden = x.shape
    out = array_module(x).empty((num_tokens, hidden), dtype=x.dtype)
    if num_tokens:
        kernel("norm.cu", "rms_norm", x.dtype)(
            (num_tokens,), (THREADS,), (out, x, weight, i32(hidden), stride(x, 0), np.float32(eps)))
    return out


def _fused_add_rms_norm_kernel(x, residual, weight, eps: float):
    num_tokens, hidden = x.shape
    if num_tokens:
        kernel("norm.cu", "fused_add_rms_norm", x.dtype)(
            (num_tokens,), (THREADS,),
            (x, residual, weight, i32(hidden), stride(x, 0), stride(residual, 0), np.float32(eps)))
    return x, residual
