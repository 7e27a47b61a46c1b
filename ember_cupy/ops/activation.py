"""SiLU(gate) * up: NumPy twin, host kernel (cpu/elementwise.c) and launch of cuda/activation.cu;
GELU-tanh(gate) * up (Gemma): host kernel (cpu/elementwise.c) and its twin in array code, which is
also the device path."""
from __future__ import annotations

import numpy as np

from ember_cupy.ops import _cuda, _host
from ember_cupy.ops._kernel import array_module, i32, kernel, stride


THREADS = 256


def silu_and_mul(gate_up):
    """gate_up [T, 2I] (gate first) -> silu(gate) * up, [T, I]."""
    if _cuda.wants_kernel(gate_up):
        return _silu_and_mul_kernel(gate_up)
    library = _host.active()
    if library is not None and _host.rows_f32(gate_up):
        return _gated_host(library.lib.ember_silu_and_mul, gate_up)
    return silu_and_mul_numpy(gate_up)


def _gated_host(function, gate_up):
    """A host kernel of signature (gate_up, ldg, out, ldo, rows, inter) on float32 rows [T, 2I]."""
    inter = gate_up.shape[1] // 2
    out = np.empty((gate_up.shape[0], inter), np.float32)
    function(gate_up.ctypes.data, _host.row_stride(gate_up), out.ctypes.data, inter, gate_up.shape[0], inter)
    return out


def silu_and_mul_numpy(gate_up):
    half = gate_up.shape[-1] // 2
    gate, up = gate_up[:, :half], gate_up[:, half:]
    out = np.negative(gate)
    with np.errstate(over="ignore"):      # exp(-gate) = inf for gate < -88: silu -> -0
        np.exp(out, out=out)
    out += 1.0
    np.divide(gate, out, out=out)
    out *= up
    return out


def gelu_tanh_and_mul(gate_up):
    """gate_up [T, 2I] (gate first) -> gelu_tanh(gate) * up, [T, I] (PyTorch's
    gelu(approximate="tanh"), HF's gelu_pytorch_tanh)."""
    library = None if _cuda.wants_kernel(gate_up) else _host.active()
    if library is not None and _host.rows_f32(gate_up):
        return _gated_host(library.lib.ember_gelu_tanh_and_mul, gate_up)
    return gelu_tanh_and_mul_numpy(gate_up)


def gelu_tanh_and_mul_numpy(gate_up):
    """The twin of the host kernel, in elementwise array code (also the device path: no CUDA
    kernel of its own)."""
    xp = array_module(gate_up)
    half = gate_up.shape[-1] // 2
    gate, up = gate_up[:, :half], gate_up[:, half:]
    dtype = gate.dtype.type
    inner = gate * (dtype(1.0) + dtype(0.044715) * gate * gate) * dtype(np.sqrt(2.0 / np.pi))
    return dtype(0.5) * gate * (dtype(1.0) + xp.tanh(inner)) * up


def _silu_and_mul_kernel(gate_up):
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = array_module(gate_up).empty((num_tokens, inter), dtype=gate_up.dtype)
    if num_tokens:
        kernel("activation.cu", "silu_and_mul", gate_up.dtype)(
            (num_tokens,), (THREADS,), (out, gate_up, i32(inter), stride(gate_up, 0)))
    return out
