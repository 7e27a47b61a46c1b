"""Array backend selection: CuPy when a CUDA device is usable, else NumPy.

`EMBER_BACKEND=numpy|cupy` overrides the automatic choice. Everything above `ops/` calls
`get_xp()` and stays backend-agnostic.
"""
from __future__ import annotations

import functools
import os
import types

import numpy as np

BACKENDS = ("numpy", "cupy")


class BackendError(RuntimeError):
    """The requested backend cannot be used on this machine."""


def _cupy_or_reason() -> tuple[types.ModuleType | None, str]:
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install raising at import
        return None, f"cupy is not importable ({exc})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "no CUDA device is visible"
        cupy.zeros(1).sum()  # a real allocation + kernel: catches driver mismatches
    except Exception as exc:
        return None, f"no usable CUDA device ({exc})"
    return cupy, ""


@functools.lru_cache(maxsize=None)
def get_backend_name() -> str:
    requested = os.environ.get("EMBER_BACKEND", "").strip().lower()
    if requested and requested not in BACKENDS:
        raise BackendError(f"EMBER_BACKEND={requested!r} is not one of {BACKENDS}")
    if requested == "numpy":
        return "numpy"
    cupy, reason = _cupy_or_reason()
    if requested == "cupy" and cupy is None:
        raise BackendError(f"EMBER_BACKEND=cupy was requested but {reason}")
    return "cupy" if cupy is not None else "numpy"


def get_xp() -> types.ModuleType:
    """The array module of the selected backend (numpy or cupy)."""
    if get_backend_name() == "cupy":
        import cupy
        return cupy
    return np


def to_numpy(array) -> np.ndarray:
    """A host copy of an array of either backend."""
    if isinstance(array, np.ndarray):
        return array
    return array.get()
