"""cuda/rotary.cu vs the NumPy twin in ember_cupy/ops/rotary.py, on q/k views into a fused qkv."""
import numpy as np
import pytest

from ember_cupy import ops

from .helpers import DTYPES, assert_close, f32, on_kernel, randn

SCALINGS = [None, {"rope_type": "linear", "factor": 4.0},
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 64}]


def fused_qkv(rng, tokens, num_heads, num_kv_heads, head_dim, dtype):
    qkv = randn(rng, (tokens, (num_heads + 2 * num_kv_heads) * head_dim), dtype)
    q = qkv[:, :num_heads * head_dim].reshape(tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].reshape(tokens, num_kv_heads, head_dim)
    return qkv, q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (8, 1, 16)])
@pytest.mark.parametrize("scaling", SCALINGS, ids=["plain", "linear", "llama3"])
def test_rope_in_place_on_fused_views(dtype, is_neox, heads, scaling):
    num_heads, num_kv_heads, head_dim = heads
    rng = np.random.default_rng(7)
    qkv, q, k = fused_qkv(rng, 11, num_heads, num_kv_heads, head_dim, dtype)
    cache = ops.rope_cos_sin_cache(head_dim, 300, 10000.0, scaling)
    positions = rng.integers(0, 300, size=11).astype(np.int32)
    want = f32(qkv)
    want_q = want[:, :num_heads * head_dim].reshape(q.shape)
    want_k = want[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].reshape(k.shape)
    ops.apply_rope(want_q, want_k, positions, cache, is_neox=is_neox)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim:].copy()
    on_kernel(ops.apply_rope, q, k, positions, cache, is_neox=is_neox)
    assert_close(qkv, want, dtype)
    np.testing.assert_array_equal(qkv[:, (num_heads + num_kv_heads) * head_dim:], v_before)
