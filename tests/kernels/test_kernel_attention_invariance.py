"""Bitwise invariance of the attention kernels on the CPU shim (whose float operations follow the
kernels' order exactly, so equal bits here mean an order that does not depend on the batch):
a decode row gives the same bits alone and in batches of any size (its key parts are its own);
a prefill-kernel row the same bits in any chunk split (key tiles at multiples from position 0);
and in deterministic mode a query the same bits as a decode, a small chunk's row or a long
prefill's row (every row through the decode kernel)."""
from __future__ import annotations

import numpy as np
import pytest

from ember_cupy import ops
from ember_cupy.ops import attention

from .helpers import f32, on_kernel, randn

HEADS = (6, 2, 64)   # GQA 3, the templated decode kernel and the tiled prefill kernel
BLOCK = 8


class Pool:
    """K/V caches whose first blocks hold one target sequence of `length` keys (q rows for every
    position too); other sequences take the blocks after them."""

    def __init__(self, rng, length: int, dtype: str, blocks: int = 1200):
        num_heads, num_kv_heads, head_dim = HEADS
        self.rng, self.length, self.dtype = rng, length, dtype
        self.caches = [randn(rng, (blocks, BLOCK, num_kv_heads, head_dim), dtype) for _ in range(2)]
        self.q = randn(rng, (length, num_heads, head_dim), dtype)           # query of each position
        self.own = -(-length // BLOCK)
        self.next_block = self.own

    def other(self, context: int):
        """A random sequence of `context` keys decoding its last (blocks after the target's)."""
        n = -(-context // BLOCK)
        table = np.arange(self.next_block, self.next_block + n)
        self.next_block += n
        return table, context, randn(self.rng, (1, *HEADS[:1], HEADS[2]), self.dtype)

    def run(self, rows, window: int = 0, deterministic: bool = False):
        """rows: (table, context, q rows) per sequence -> the kernels' output [T, Hq, D]."""
        width = max(len(t) for t, _, _ in rows)
        tables = np.zeros((len(rows), width), np.int32)
        for s, (table, _, _) in enumerate(rows):
            tables[s, :len(table)] = table
        lens = np.array([c for _, c, _ in rows], np.int32)
        starts = np.concatenate([[0], np.cumsum([len(q) for _, _, q in rows])]).astype(np.int32)
        q = np.concatenate([q for _, _, q in rows])
        return on_kernel(ops.paged_attention, q, *self.caches, tables, lens, starts, HEADS[2] ** -0.5, window,
                         deterministic=deterministic)

    def target(self, first: int, last: int):
        """The target sequence with queries for positions first .. last - 1 (context last)."""
        return np.arange(self.own), last, self.q[first:last]

    def twin(self, window: int = 0):
        """The NumPy twin's output for every position of the target (one prefill)."""
        return ops.paged_attention(f32(self.q), f32(self.caches[0]), f32(self.caches[1]),
                                   np.arange(self.own)[None].astype(np.int32), np.array([self.length], np.int32),
                                   np.array([0, self.length], np.int32), HEADS[2] ** -0.5, window)


def bits(array) -> np.ndarray:
    return np.ascontiguousarray(array).view(np.uint8)


def test_a_decode_row_has_the_same_bits_alone_and_in_batches_of_any_size():
    """Context 300: 3 parts of 128 keys, merged; beside 0, 3 and 12 other decodes (contexts 1 to
    700: 1 to 6 parts), in first, middle and last place. Before, the batch size chose the split
    count (fewer splits for more sequences), so the row's sums ran in another order."""
    rng = np.random.default_rng(60)
    pool = Pool(rng, 300, "float32")   # 16-bit outputs round most order differences away
    others = [pool.other(int(c)) for c in rng.integers(1, 700, 12)]
    alone = pool.run([pool.target(299, 300)])
    np.testing.assert_allclose(f32(alone[0]), pool.twin()[299], rtol=2e-2, atol=2e-2)
    for batch, place in ((others[:3], 0), (others[3:], 5), (others[:12], 12)):
        rows = batch[:place] + [pool.target(299, 300)] + batch[place:]
        out = pool.run(rows)
        assert bits(out[place]).tobytes() == bits(alone[0]).tobytes(), (len(rows), place)


def test_decode_rows_launched_in_groups_give_the_same_bits(monkeypatch):
    """A workspace for one row's parts at a time: 13 decode launches, the same bits as one."""
    rng = np.random.default_rng(61)
    pool = Pool(rng, 300, "float32")
    rows = [pool.target(299, 300)] + [pool.other(int(c)) for c in rng.integers(1, 700, 12)]
    together = pool.run(rows)
    monkeypatch.setattr(attention, "PART_WORKSPACE_BYTES", 1)
    assert bits(pool.run(rows)).tobytes() == bits(together).tobytes()


@pytest.mark.parametrize("window", [0, 21])
def test_a_prefill_row_has_the_same_bits_in_any_chunk_split(window):
    """Positions 60..99 of a 100-token prompt, prefilled whole and in chunks starting at 37, 50
    and 60 (query tiles of 21 tokens start elsewhere each time). Before, a tile's key tiles started
    at its first token's first visible key, so with a window the rows' key tiling followed the split."""
    rng = np.random.default_rng(62)
    pool = Pool(rng, 100, "float32")
    whole = pool.run([pool.target(0, 100)], window)
    np.testing.assert_allclose(whole, pool.twin(window), rtol=2e-5, atol=2e-5)
    for first in (37, 50, 60):
        chunk = pool.run([pool.other(40), pool.target(first, 100)], window)[1:]
        assert bits(chunk[60 - first:]).tobytes() == bits(whole[60:]).tobytes(), first


@pytest.mark.parametrize("window", [0, 21])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deterministic_mode_gives_a_query_the_same_bits_as_decode_chunk_or_prefill_row(dtype, window):
    """Parts of 16 keys: positions 56..69 of a 70-token prompt as rows of a whole prefill, of a
    chunk of 14 after 56 cached, of chunks of 2 and as decodes (q_len 1), in batches with other
    rows: all the same bits, and the twin's values. Without deterministic the prefill kernel
    serves the chunk rows and the decode kernel the decodes: other orders, other bits."""
    rng = np.random.default_rng(63)
    pool = Pool(rng, 70, dtype)
    with attention.decode_split_keys(16):
        whole = pool.run([pool.target(0, 70), pool.other(33)], window, deterministic=True)[:70]
        np.testing.assert_allclose(f32(whole), pool.twin(window), rtol=3e-2, atol=3e-2)
        chunk = pool.run([pool.other(5), pool.target(56, 70)], window, deterministic=True)[1:]
        assert bits(chunk).tobytes() == bits(whole[56:]).tobytes()
        for position in range(56, 70, 2):
            pair = pool.run([pool.target(position, position + 2)], window, deterministic=True)
            decode = pool.run([pool.other(90), pool.target(position, position + 1)], window, deterministic=True)[1:]
            assert bits(pair).tobytes() == bits(whole[position:position + 2]).tobytes(), position
            assert bits(decode).tobytes() == bits(whole[position:position + 1]).tobytes(), position
