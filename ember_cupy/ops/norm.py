"""RMSNorm and fused residual-add + RMSNorm (NumPy twins of cuda/norm.cu)."""
from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x [T, H] -> x / rms(x) * weight, in a new array."""
    variance = np.einsum("ij,ij->i", x, x, dtype=np.float32) / x.shape[-1]
    scale = 1.0 / np.sqrt(variance + np.float32(eps), dtype=np.float32)
    return (x * scale[:, None]) * weight


def fused_add_rms_norm(x: np.ndarray, residual: np.ndarray, weight: np.ndarray,
                       eps: float) -> tuple[np.ndarray, np.ndarray]:
    """In place: residual += x; x = rms_norm(residual) * weight. Returns (x, residual)."""
    residual += x
    variance = np.einsum("ij,ij->i", residual, residual, dtype=np.float32) / x.shape[-1]
    scale = 1.0 / np.sqrt(variance + np.float32(eps), dtype=np.float32)
    np.multiply(residual, scale[:, None], out=x)
    x *= weight
    return x, residual
