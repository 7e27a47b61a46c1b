"""cuda/sampling.cu's apply_token_bitmask against its NumPy twin (ember_cupy/structured/bitmask.py)."""
import numpy as np
import pytest

from ember_cupy.structured import bitmask as B

from .helpers import on_kernel


def random_case(rng, batch, vocab, rows):
    logits = rng.standard_normal((batch, vocab), dtype=np.float32)
    words = (vocab + 31) // 32
    mask = rng.integers(-2**31, 2**31, size=(len(rows), words), dtype=np.int64).astype(np.int32)
    return logits, mask, np.asarray(rows, dtype=np.int32)


@pytest.mark.parametrize("batch,vocab,rows", [(1, 32, [0]), (3, 1000, [2, 0]), (5, 49152, [1, 3, 4]),
                                              (2, 70, [1])])
def test_bitmask_kernel_equals_twin(batch, vocab, rows):
    logits, mask, row_ids = random_case(np.random.default_rng(vocab), batch, vocab, rows)
    want = logits.copy()
    B.apply_token_bitmask_numpy(want, mask, row_ids)
    got = logits.copy()
    on_kernel(B.apply_token_bitmask, got, mask, row_ids)
    np.testing.assert_array_equal(got, want)
    untouched = [r for r in range(batch) if r not in rows]
    np.testing.assert_array_equal(got[untouched], logits[untouched])


def test_twin_reads_llguidance_bit_order():
    logits = np.zeros((1, 40), dtype=np.float32)
    mask = np.array([[(1 << 3) | (1 << 31), 1 << 1]], dtype=np.uint32).view(np.int32)   # 3, 31, 33
    B.apply_token_bitmask_numpy(logits, mask, np.array([0], np.int32))
    assert np.flatnonzero(np.isfinite(logits[0])).tolist() == [3, 31, 33]


def test_narrow_mask_disallows_the_rest():
    """A mask with fewer words than the logits need leaves nothing allowed past its end."""
    logits = np.zeros((1, 70), dtype=np.float32)
    mask = np.full((1, 2), -1, dtype=np.int32)
    want = logits.copy()
    B.apply_token_bitmask_numpy(want, mask, np.array([0], np.int32))
    assert np.isfinite(want[0, :64]).all() and np.isinf(want[0, 64:]).all()
    on_kernel(B.apply_token_bitmask, logits, mask, np.array([0], np.int32))
    np.testing.assert_array_equal(logits, want)
