"""Shared helpers of the kernel tests: the CPU shim provider, dtypes, random data, tolerances."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ember_cupy.ops import _cuda

from .shim.launcher import ShimProvider

DTYPES = ("float32", "float16", "bfloat16")
TOLERANCE = {"float32": 2e-5, "float16": 1e-2, "bfloat16": 6e-2}
PROVIDER = ShimProvider()


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def randn(rng: np.random.Generator, shape, dtype: str, scale: float = 1.0) -> np.ndarray:
    """Random normal data (never zeros) rounded to `dtype`."""
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np_dtype(dtype))


def f32(array) -> np.ndarray:
    return np.asarray(array).astype(np.float32)


def on_kernel(op, *args, **kwargs):
    """Call an op with every kernel dispatched through the CPU shim."""
    with _cuda.use_provider(PROVIDER):
        return op(*args, **kwargs)


def assert_close(got, want, dtype: str, scale: float = 1.0) -> None:
    tol = TOLERANCE[dtype] * scale
    np.testing.assert_allclose(f32(got), f32(want), rtol=tol, atol=tol)
