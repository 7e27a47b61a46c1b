"""The decode kernel's split-KV (flash-decoding) path and merge, the tiled prefill kernel's
templated head dims, and the Python partition (cuda/attention_decode.cu,
cuda/attention_prefill.cu vs the NumPy twin in ember_cupy/ops/attention.py). Bitwise batch
invariance and deterministic mode: test_kernel_attention_invariance.py."""
from __future__ import annotations

import numpy as np
import pytest

from ember_cupy.ops import attention

from .helpers import DTYPES
from .test_kernel_attention import check, make_batch


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_keys", [1000, 48, 4])
def test_decode_splits(dtype, split_keys):
    """Parts of 4 keys: context 140 has 35 > 32 parts, so its span doubles to 8 (18 parts) while
    context 1 has one part and the grid has 32 (blocks past a row's parts exit)."""
    rng = np.random.default_rng(40 + split_keys)
    with attention.decode_split_keys(split_keys):
        check(*make_batch(rng, [1, 17, 140, 70], [1] * 4, 16, 6, 2, 64, dtype), dtype)


@pytest.mark.parametrize("heads", [(4, 4, 64), (9, 3, 64), (16, 2, 64)], ids=["gqa1", "gqa3", "gqa8"])
@pytest.mark.parametrize("window", [0, 7, 100])
def test_mixed_batch_split_decodes_and_prefill_tiles(heads, window):
    """Decodes in parts of 40 keys beside a chunk whose query tiles straddle pages of 5 keys and
    the window (parts start at multiples of 40, so a window's first part is a partial one)."""
    rng = np.random.default_rng(41 + window)
    with attention.decode_split_keys(40):
        check(*make_batch(rng, [150, 70, 1, 45], [1, 70, 1, 20], 5, *heads, "float32"), "float32", window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(8, 2, 128), (4, 1, 256)], ids=["d128", "d256"])
def test_large_head_dims(dtype, heads):
    rng = np.random.default_rng(42)
    with attention.decode_split_keys(16):
        check(*make_batch(rng, [40, 33, 3], [1, 33, 2], 16, *heads, dtype), dtype, window=24)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generic_head_dim_rows(dtype):
    """head_dim 80 has no templated entry: every row (decode and prefill) takes the generic one,
    with its parts and merge."""
    rng = np.random.default_rng(43)
    with attention.decode_split_keys(32):
        check(*make_batch(rng, [90, 30, 1], [1, 12, 1], 8, 6, 2, 80, dtype), dtype, window=40)


def test_partition_is_the_rows_own():
    assert attention.decode_parts(1) == (128, 1)
    assert attention.decode_parts(128) == (128, 1) and attention.decode_parts(129) == (128, 2)
    assert attention.decode_parts(32 * 128) == (128, 32)
    assert attention.decode_parts(32 * 128 + 1) == (256, 17)               # the span doubles
    assert attention.decode_parts(300, first_key=250) == (128, 2)           # keys 250..299: parts 1 and 2
    assert attention.grid_splits(4096) == 32 and attention.grid_splits(10) == 1
    assert attention.grid_splits(1 << 20) == attention.MAX_DECODE_SPLITS
    with attention.decode_split_keys(7):
        assert attention.decode_parts(15) == (7, 3)


def test_split_keys_validation():
    with pytest.raises(ValueError, match="keys"):
        with attention.decode_split_keys(0):
            pass


def test_rejects_group_over_decode_capacity():
    rng = np.random.default_rng(44)
    args = make_batch(rng, [3], [1], 4, 20, 1, 256, "float16")   # f16 head_dim 256 holds 4 heads a KV head
    with pytest.raises(ValueError, match="at most 4 query heads"):
        check(*args, "float16")
