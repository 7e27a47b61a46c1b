"""The NumPy paged attention against a dense float64 reference (decode groups, prefill, chunks)."""
import numpy as np
import pytest

from ember_cupy.ops import paged_attention


def dense_reference(q, k_rows, v_rows, context_len, scale, window=0):
    """q [t, Hq, D] are the last t positions of a context whose K/V rows are k_rows/v_rows;
    with a window, a query sees only itself and the window - 1 keys before it."""
    t, num_heads, _ = q.shape
    group = num_heads // k_rows.shape[1]
    out = np.empty(q.shape, dtype=np.float64)
    for i in range(t):
        position = context_len - t + i
        for h in range(num_heads):
            first = max(0, position + 1 - window) if window else 0
            keys = k_rows[first:position + 1, h // group].astype(np.float64)
            scores = keys @ q[i, h].astype(np.float64) * scale
            probs = np.exp(scores - scores.max())
            out[i, h] = probs / probs.sum() @ v_rows[first:position + 1, h // group]
    return out


@pytest.mark.parametrize("seed,window", [(0, 0), (1, 0), (2, 0), (3, 1), (4, 16), (5, 37), (6, 400)])
def test_paged_attention_matches_dense_reference(seed, window):
    rng = np.random.default_rng(seed)
    block_size, num_kv_heads, group, head_dim = 16, 3, 3, 64
    num_blocks = 512
    k_cache = rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim), dtype=np.float32)
    v_cache = rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim), dtype=np.float32)
    # 11 decodes (more than one group, lengths on both sides of 400 and of block edges),
    # one whole prefill and one chunk of a longer prompt
    context_lens = [1, 15, 16, 17, 399, 401, 416, 700, 33, 64, 250, 37, 300]
    query_lens = [1] * 11 + [37, 45]
    free = list(rng.permutation(num_blocks))
    tables = np.zeros((len(context_lens), 48), dtype=np.int32)
    for s, length in enumerate(context_lens):
        for b in range(-(-length // block_size)):
            tables[s, b] = free.pop()
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    q = rng.standard_normal((query_start_loc[-1], num_kv_heads * group, head_dim), dtype=np.float32)
    scale = head_dim ** -0.5
    out = paged_attention(q, k_cache, v_cache, tables, np.array(context_lens, np.int32),
                          query_start_loc, scale, window)
    for s, length in enumerate(context_lens):
        rows = slice(query_start_loc[s], query_start_loc[s + 1])
        blocks = tables[s, :-(-length // block_size)]
        k_rows = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)
        v_rows = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)
        expected = dense_reference(q[rows], k_rows, v_rows, length, scale, window)
        np.testing.assert_allclose(out[rows], expected, atol=2e-5, err_msg=f"sequence {s}")


@pytest.mark.parametrize("window", [-1, 2.5])
def test_bad_window_is_a_value_error(window):
    q = np.zeros((1, 1, 8), np.float32)
    cache = np.zeros((1, 4, 1, 8), np.float32)
    with pytest.raises(ValueError, match="window"):
        paged_attention(q, cache, cache, np.zeros((1, 1), np.int32), np.array([1], np.int32),
                        np.array([0, 1], np.int32), 1.0, window)
