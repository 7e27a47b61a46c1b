"""Write new K/V rows into the paged cache: NumPy twin and launch of cuda/cache.cu."""
from __future__ import annotations

from ember_cupy.ops import _cuda
from ember_cupy.ops._kernel import (
    array_module,
    contiguous,
    i32,
    int32_array,
    kernel,
    stride,
)

THREADS = 128


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """key/value [T, Hk, D] go to slot slot_mapping[t] = block * block_size + offset; -1 = skip.

    Caches are [num_blocks, block_size, Hk, D].
    """
    if _cuda.wants_kernel(key):
        return _write_kv_kernel(key, value, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    if not keep.all():
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.reshape(-1, num_kv_heads, head_dim)[slot_mapping] = key
    v_cache.reshape(-1, num_kv_heads, head_dim)[slot_mapping] = value


def _write_kv_kernel(key, value, k_cache, v_cache, slot_mapping) -> None:
    xp = array_module(key)
    num_tokens, num_kv_heads, head_dim = key.shape
    if not num_tokens:
        return
    kernel("cache.cu", "write_kv", key.dtype)(
        (num_tokens,), (THREADS,),
        (key, value, contiguous(xp, k_cache, "k_cache"), contiguous(xp, v_cache, "v_cache"),
         int32_array(xp, slot_mapping), i32(num_kv_heads), i32(head_dim),
         stride(key, 0), stride(key, 1), stride(value, 0), stride(value, 1)))
