"""cuda/attention_decode.cu + cuda/attention_prefill.cu (through ops.paged_attention's dispatch)
vs the NumPy twin in ember_cupy/ops/attention.py: decode, prefill, chunked prefill and mixed
batches; scattered block tables; GQA 1/3/8; fp32/fp16/bf16; q a view into qkv. head_dim 64 takes
the templated decode and tiled prefill kernels, 16 and 32 the generic row kernel. Split-KV:
test_kernel_attention_split.py."""
from __future__ import annotations

import numpy as np
import pytest

from ember_cupy import ops

from .helpers import DTYPES, assert_close, f32, on_kernel, randn


def make_batch(rng, context_lens, query_lens, block_size, num_heads, num_kv_heads, head_dim, dtype):
    """Random caches and q (a strided view into a fused qkv), scattered block tables."""
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    ids = rng.permutation(num_blocks)                           # scattered, no sharing
    tables = np.full((len(context_lens), max(blocks_per_seq) + 1), num_blocks - 1, dtype=np.int32)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = ids[used:used + n]
        used += n
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    tokens = int(query_start_loc[-1])
    qkv = randn(rng, (tokens, (num_heads + 2 * num_kv_heads) * head_dim), dtype)
    q = qkv[:, :num_heads * head_dim].reshape(tokens, num_heads, head_dim)
    caches = [randn(rng, (num_blocks, block_size, num_kv_heads, head_dim), dtype) for _ in range(2)]
    return q, *caches, tables, np.asarray(context_lens, np.int32), query_start_loc


def check(q, k_cache, v_cache, tables, context_lens, query_start_loc, dtype, window=0):
    scale = q.shape[-1] ** -0.5
    got = on_kernel(ops.paged_attention, q, k_cache, v_cache, tables, context_lens, query_start_loc, scale,
                    window)
    want = ops.paged_attention(f32(q), f32(k_cache), f32(v_cache), tables, context_lens, query_start_loc, scale,
                               window)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert_close(got, want, dtype)


GQA = [(4, 4, 32), (6, 2, 64), (16, 2, 16), (8, 1, 64)]   # ratios 1, 3, 8, 8


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h[0]}q{h[1]}kv{h[2]}d")
def test_decode(dtype, heads):
    rng = np.random.default_rng(10)
    contexts = [1, 17, 5, 140]                                  # context 1, odd, > one key tile
    check(*make_batch(rng, contexts, [1] * 4, 16, *heads, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", GQA[:3], ids=lambda h: f"{h[0]}q{h[1]}kv{h[2]}d")
def test_prefill_and_chunked_prefill_mixed_with_decode(dtype, heads):
    rng = np.random.default_rng(11)
    contexts, queries = [37, 50, 9, 1], [37, 13, 1, 1]          # full prefill, chunk after 37 cached
    check(*make_batch(rng, contexts, queries, 5, *heads, dtype), dtype)


@pytest.mark.parametrize("block_size", [1, 3, 16, 32])
def test_block_sizes_and_long_chunk(block_size):
    rng = np.random.default_rng(12)
    contexts, queries = [131, 70], [4, 70]
    check(*make_batch(rng, contexts, queries, block_size, 9, 3, 64, "float32"), "float32")


@pytest.mark.parametrize("window", [1, 7, 128, 200])
def test_sliding_window(window):
    """Decodes and chunks past the window, and shorter than it; windows below, at and above the key tile."""
    rng = np.random.default_rng(window)
    contexts, queries = [300, 140, 9, 260], [1, 30, 9, 260]
    check(*make_batch(rng, contexts, queries, 16, 6, 2, 64, "float32"), "float32", window)


def test_large_head_dim_group_8():
    rng = np.random.default_rng(13)
    check(*make_batch(rng, [3, 20], [1, 2], 16, 16, 2, 128, "float16"), "float16")


def test_rejects_group_too_large():
    rng = np.random.default_rng(14)
    args = make_batch(rng, [3], [1], 4, 32, 1, 128, "float32")
    with pytest.raises(ValueError, match="accumulators"):
        on_kernel(ops.paged_attention, *args, 0.1)
