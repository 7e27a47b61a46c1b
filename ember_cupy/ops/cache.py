"""Write new K/V rows into the paged cache: NumPy twin and launch of cuda/cache.cu; the KV
cache's storage dtype."""
from __future__ import annotations

import logging

import numpy as np

from ember_cupy.ops import _cuda, _host
from ember_cupy.ops._kernel import (
    array_module,
    contiguous,
    i32,
    int32_array,
    kernel,
    stride,
)

THREADS = 128

logger = logging.getLogger("ember_cupy.cache")


def resolve_kv_cache_dtype(name: str, model_dtype, xp, quantization: str = "auto") -> np.dtype:
    """EngineConfig.kv_cache_dtype -> storage dtype of the K/V pools.

    auto: float16 on the NumPy backend when the host kernels run attention (cpu/attention.c reads
    f16 pages in place, converting with F16C) for a float32 model: the 16-bit cache halves the
    bytes per block (the kv_cache_memory budget buys twice the tokens) and the bytes each decode
    step's attention reads, and its rounding (2^-11 relative) is far below the error of quantized
    weights. Otherwise the model dtype: quantization="none" asks for the exact fp32 reference, the
    NumPy twin gains nothing from f16 pages (it casts them back to fp32), and the CUDA kernels
    take the caches in the activations' dtype.
    """
    model_dtype = np.dtype(model_dtype)
    if name == "auto":
        if (xp is np and model_dtype == np.float32 and quantization != "none"
                and _host.active() is not None):
            return np.dtype(np.float16)
        return model_dtype
    dtype = np.dtype(name)
    if xp is not np and dtype != model_dtype:
        logger.warning("kv_cache_dtype=%s: the CUDA kernels keep the KV cache in the model dtype (%s)",
                       name, model_dtype)
        return model_dtype
    return dtype


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """key/value [T, Hk, D] go to slot slot_mapping[t] = block * block_size + offset; -1 = skip.

    Caches are [num_blocks, block_size, Hk, D], in the KV cache dtype (NumPy rounds float32 rows
    to a float16 cache on assignment, to nearest even).
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
