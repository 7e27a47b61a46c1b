"""SiLU(gate) * up: NumPy twin and launch of cuda/activation.cu."""
from __future__ import annotations

import numpy as np

from ember_cupy.ops import _cuda
from ember_cupy.ops._kernel import array_module, i32, kernel, stride

THREADS = 256


def silu_and_mul(gate_up):
    """gate_up [T, 2I] (gate first) -> silu(gate) * up, [T, I]."""
    if _cuda.wants_kernel(gate_up):
        return _silu_and_mul_kernel(gate_up)
    half = gate_up.shape[-1] // 2
    gate, up = gate_up[:, :half], gate_up[:, half:]
    out = np.negative(gate)
    np.exp(out, out=out)
    out += 1.0
    np.divide(gate, out, out=out)
    out *= up
    return out


def _silu_and_mul_kernel(gate_up):
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = array_module(gate_up).empty((num_tokens, inter), dtype=gate_up.dtype)
    if num_tokens:
        kernel("activation.cu", "silu_and_mul", gate_up.dtype)(
            (num_tokens,), (THREADS,), (out, gate_up, i32(inter), stride(gate_up, 0)))
    return out
