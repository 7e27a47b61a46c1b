"""Write new K/V rows into the paged cache (NumPy twin of cuda/cache.cu)."""
from __future__ import annotations

import numpy as np


def write_kv(key: np.ndarray, value: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
             slot_mapping: np.ndarray) -> None:
    """key/value [T, Hk, D] go to slot slot_mapping[t] = block * block_size + offset; -1 = skip.

    Caches are [num_blocks, block_size, Hk, D].
    """
    keep = slot_mapping >= 0
    if not keep.all():
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.reshape(-1, num_kv_heads, head_dim)[slot_mapping] = key
    v_cache.reshape(-1, num_kv_heads, head_dim)[slot_mapping] = value
