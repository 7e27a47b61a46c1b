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


# ---- the NumPy twin's own determinism (a machine without host kernels runs it) -----------------
def _twin_one_sequence(q, k_cache, v_cache, table, scale, context, queries, window, others=()):
    """The `queries` last queries of a sequence with `context` keys, in one twin call, after the
    sequences `others` ((q rows, table, context) each)."""
    from ember_cupy.ops.attention import paged_attention_numpy
    rows = [o[0] for o in others] + [q[context - queries:context]]
    lens = [o[2] for o in others] + [context]
    starts = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int32)
    tables = np.stack([o[1] for o in others] + [table])
    out = paged_attention_numpy(np.concatenate(rows), k_cache, v_cache, tables, np.array(lens, np.int32),
                                starts, scale, window)
    return out[starts[-2]:]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("window", [0, 100, 333])
@pytest.mark.parametrize("group", [1, 3])
def test_the_twin_gives_a_query_the_same_bits_in_any_chunk_and_batch(dtype, window, group):
    """The NumPy twin (no host kernels) is deterministic too: a query's result does not depend on
    how many queries of its sequence run with it (whole prompt, chunk, decode: a prefix-cache hit
    or a chunked-prefill split) nor on the other sequences of the batch (decodes of other
    lengths, chunks): each query reduces its keys over its own span of KEY_SPAN multiples."""
    from tests.test_host_attention import make_batch
    rng = np.random.default_rng(group * 10 + window)
    context = 700
    others_lens = [(5, 1), (130, 1), (700, 1), (40, 40), (300, 17)]
    args, clean = make_batch(rng, [(context, context)] + others_lens, group=group, dtype=dtype)
    q, k_cache, v_cache, _, lens, starts, scale = args
    table = clean[0]
    others = [(q[starts[i]:starts[i + 1]], clean[i], int(lens[i])) for i in range(1, len(lens))]
    whole = _twin_one_sequence(q, k_cache, v_cache, table, scale, context, context, window)
    for position in (0, 15, 127, 128, 129, 300, 511, 699):
        for queries in (1, 2, 7, 40, 129):
            end = min(context, position + queries - queries // 2)
            queries = min(queries, end)
            if not end - queries <= position < end:
                continue
            for batch in ((), others[:2], others):
                chunk = _twin_one_sequence(q, k_cache, v_cache, table, scale, end, queries, window, batch)
                np.testing.assert_array_equal(
                    chunk[position - (end - queries)], whole[position],
                    err_msg=f"query {position} in a chunk of {queries} ending at {end}, {len(batch)} others")
