"""The decode kernel's split-KV (flash-decoding) path and merge, the tiled prefill kernel's
templated head dims, and the Python split decision (cuda/attention_decode.cu,
cuda/attention_prefill.cu vs the NumPy twin in ember_cupy/ops/attention.py)."""
from __future__ import annotations

import numpy as np
import pytest

from ember_cupy.ops import attention

from .helpers import DTYPES
from .test_kernel_attention import check, make_batch


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_decode_splits(dtype, splits):
    """16 splits of contexts 1, 17 and 140 leave most key ranges empty (16-key granules)."""
    rng = np.random.default_rng(40 + splits)
    with attention.forced_decode_splits(splits):
        check(*make_batch(rng, [1, 17, 140, 70], [1] * 4, 16, 6, 2, 64, dtype), dtype)


@pytest.mark.parametrize("heads", [(4, 4, 64), (9, 3, 64), (16, 2, 64)], ids=["gqa1", "gqa3", "gqa8"])
@pytest.mark.parametrize("window", [0, 7, 100])
def test_mixed_batch_split_decodes_and_prefill_tiles(heads, window):
    """Decodes split 4 ways beside a chunk whose query tiles straddle pages of 5 keys and the window."""
    rng = np.random.default_rng(41 + window)
    with attention.forced_decode_splits(4):
        check(*make_batch(rng, [150, 70, 1, 45], [1, 70, 1, 20], 5, *heads, "float32"), "float32", window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(8, 2, 128), (4, 1, 256)], ids=["d128", "d256"])
def test_large_head_dims(dtype, heads):
    rng = np.random.default_rng(42)
    with attention.forced_decode_splits(2):
        check(*make_batch(rng, [40, 33, 3], [1, 33, 2], 16, *heads, dtype), dtype, window=24)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generic_head_dim_rows(dtype):
    """head_dim 80 has no templated entry: every row (decode and prefill) takes the generic one."""
    rng = np.random.default_rng(43)
    check(*make_batch(rng, [90, 30, 1], [1, 12, 1], 8, 6, 2, 80, dtype), dtype, window=40)


def test_split_decision(monkeypatch):
    monkeypatch.setattr(attention, "sm_count", lambda xp: 132)
    assert attention.decode_splits(np, 64, 8, 4096) == 1                  # 512 blocks fill 132 SMs
    assert attention.decode_splits(np, 1, 3, 512) == 512 // attention.MIN_KEYS_PER_SPLIT
    assert attention.decode_splits(np, 1, 3, 1 << 20) == attention.MAX_SPLITS
    assert attention.decode_splits(np, 16, 8, 1 << 20) == 3               # 128 blocks -> ~2 per SM
    assert attention.decode_splits(np, 1, 1, 10) == 1
    with attention.forced_decode_splits(7):
        assert attention.decode_splits(np, 64, 8, 4096) == 7


def test_shim_sm_count_and_forced_split_validation():
    assert attention.sm_count(np) == attention.SHIM_SM_COUNT
    with pytest.raises(ValueError, match="splits"):
        with attention.forced_decode_splits(0):
            pass


def test_rejects_group_over_decode_capacity():
    rng = np.random.default_rng(44)
    args = make_batch(rng, [3], [1], 4, 20, 1, 256, "float16")   # f16 head_dim 256 holds 4 heads a KV head
    with pytest.raises(ValueError, match="at most 4 query heads"):
        check(*args, "float16")
