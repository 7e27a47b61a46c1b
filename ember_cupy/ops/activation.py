"""SiLU(gate) * up (NumPy twin of cuda/activation.cu)."""
from __future__ import annotations

import numpy as np


def silu_and_mul(gate_up: np.ndarray) -> np.ndarray:
    """gate_up [T, 2I] (gate first) -> silu(gate) * up, [T, I]."""
    half = gate_up.shape[-1] // 2
    gate, up = gate_up[:, :half], gate_up[:, half:]
    out = np.negative(gate)
    np.exp(out, out=out)
    out += 1.0
    np.divide(gate, out, out=out)
    out *= up
    return out
