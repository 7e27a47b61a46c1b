"""Rotary position embedding (NumPy twin of cuda/rotary.cu).

Two layouts of the rotated pairs within a head of size D:
  neox / rotate-half (HF): pairs (i, i + D/2);
  adjacent (GPT-J, llama.cpp's GGML RoPE): pairs (2i, 2i + 1).
"""
from __future__ import annotations

import math

import numpy as np

from ember_cupy.ops import _cuda, _host
from ember_cupy.ops._kernel import array_module, i32, int32_array, kernel, stride


THREADS = 128


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    """Inverse frequencies, [D/2] float64, with linear or llama3 scaling applied."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, factor, scaling)
    if kind in ("default", None):
        return inv_freq
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


def _llama3_inv_freq(inv_freq: np.ndarray, factor: float, scaling: dict) -> np.ndarray:
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return np.where(wavelen > low_freq_wavelen, inv_freq / factor,
                    np.where(wavelen < high_freq_wavelen, inv_freq, smoothed))


def rope_cos_sin_cache(head_dim: int, max_positions: int, theta: float,
                       scaling: dict | None = None, freq_factors=None) -> np.ndarray:
    """[max_positions, D] float32: cos of every frequency in the first half, sin in the second.

    freq_factors [D/2]: each frequency divided by its factor, as llama.cpp applies a GGUF's
    `rope_freqs` tensor (how its converter stores Llama 3.1+'s llama3 scaling)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    if freq_factors is not None:
        factors = np.asarray(freq_factors, dtype=np.float64).reshape(-1)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs has {factors.size} factors; head_dim {head_dim} needs {inv_freq.size}")
        inv_freq = inv_freq / factors
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)


class RopeTable:
    """A model's `rope_cos_sin_cache`, grown as positions need it (doubling, up to its context
    length): Gemma 3's 32k-position tables took 0.4 s of every load and 64 MB that a short
    context never reads. Row p is the same whatever the table's length."""

    INITIAL_ROWS = 4096

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None,
                 freq_factors=None, xp=np):
        self.max_positions = max(max_positions, 1)
        self._build = lambda rows: xp.asarray(rope_cos_sin_cache(head_dim, rows, theta, scaling, freq_factors))
        self.table = self._build(min(self.INITIAL_ROWS, self.max_positions))

    def reserve(self, positions: int):
        """Make `table` cover positions [0, positions) (at most the context length); returns it."""
        rows = len(self.table)
        if positions > rows and rows < self.max_positions:
            while rows < positions:
                rows *= 2
            self.table = self._build(min(rows, self.max_positions))
        return self.table


def apply_rope(q: np.ndarray, k: np.ndarray, positions: np.ndarray, cos_sin_cache: np.ndarray,
               is_neox: bool = True) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place by each token's position [T]."""
    if _cuda.wants_kernel(q):
        return _apply_rope_kernel(q, k, positions, cos_sin_cache, is_neox)
    library = _host.active()
    if (library is not None and q.dtype == k.dtype == cos_sin_cache.dtype == np.float32
            and q.strides[-1] == k.strides[-1] == 4 and cos_sin_cache.flags.c_contiguous):
        positions = np.ascontiguousarray(positions, dtype=np.int32)
        if len(positions) and (positions.min() < 0 or positions.max() >= len(cos_sin_cache)):
            raise ValueError("apply_rope: a position outside the cos/sin cache")
        library.lib.ember_rope(q.ctypes.data, q.strides[0] // 4, q.strides[1] // 4, q.shape[1],
                               k.ctypes.data, k.strides[0] // 4, k.strides[1] // 4, k.shape[1],
                               q.shape[2], positions.ctypes.data, cos_sin_cache.ctypes.data,
                               int(bool(is_neox)), q.shape[0])
        return None
    return apply_rope_numpy(q, k, positions, cos_sin_cache, is_neox)


def apply_rope_numpy(q: np.ndarray, k: np.ndarray, positions: np.ndarray, cos_sin_cache: np.ndarray,
                     is_neox: bool = True) -> None:
    """The NumPy twin of apply_rope (and of cpu/elementwise.c's ember_rope)."""
    half = q.shape[-1] // 2
    cos_sin = cos_sin_cache[positions]
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    for x in (q, k):
        if is_neox:
            first, second = x[..., :half], x[..., half:]
        else:
            first, second = x[..., 0::2], x[..., 1::2]
        rotated_first = first * cos - second * sin
        second[...] = second * cos + first * sin
        first[...] = rotated_first


def _apply_rope_kernel(q, k, positions, cos_sin_cache, is_neox: bool) -> None:
    xp = array_module(q)
    num_tokens, num_heads, head_dim = q.shape
    if not num_tokens:
        return
    cos_sin = xp.ascontiguousarray(cos_sin_cache, dtype=xp.float32)
    kernel("rotary.cu", "rotary", q.dtype)(
        (num_tokens,), (THREADS,),
        (q, k, int32_array(xp, positions), cos_sin, i32(num_heads), i32(k.shape[1]), i32(head_dim),
         stride(q, 0), stride(q, 1), stride(k, 0), stride(k, 1), i32(bool(is_neox))))
