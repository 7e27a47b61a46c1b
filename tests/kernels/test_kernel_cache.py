"""cuda/cache.cu vs the NumPy twin in ember_cupy/ops/cache.py."""
import numpy as np
import pytest

from ember_cupy import ops

from .helpers import DTYPES, on_kernel, randn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(3, 64, 16), (1, 8, 5), (8, 32, 3)])
def test_write_kv_scattered_slots_with_skips(dtype, num_kv_heads, head_dim, block_size):
    rng = np.random.default_rng(8)
    num_blocks, tokens = 7, 13
    kv = randn(rng, (tokens, 3, num_kv_heads, head_dim), dtype)   # strided views, as from fused qkv
    key, value = kv[:, 0], kv[:, 2]
    slots = rng.permutation(num_blocks * block_size)[:tokens].astype(np.int32)
    slots[[2, 7]] = -1
    k_cache, v_cache = (randn(rng, (num_blocks, block_size, num_kv_heads, head_dim), dtype) for _ in range(2))
    want_k, want_v = k_cache.copy(), v_cache.copy()
    ops.write_kv(key, value, want_k, want_v, slots)
    on_kernel(ops.write_kv, key, value, k_cache, v_cache, slots)
    np.testing.assert_array_equal(k_cache.view(np.uint8), want_k.view(np.uint8))
    np.testing.assert_array_equal(v_cache.view(np.uint8), want_v.view(np.uint8))
