"""cpu/sampling.c's ember_apply_token_bitmask against its NumPy twin (ember_cupy/structured/bitmask.py),
on every ISA path this CPU can run."""
import numpy as np
import pytest

from ember_cupy.ops import _host
from ember_cupy.structured import bitmask as B

RUNNABLE = [isa for isa in _host.ISA_FLAGS if isa == "portable" or isa in _host.supported_isas()]


@pytest.fixture(scope="module", params=RUNNABLE)
def library(request):
    return _host.load_library(request.param)


@pytest.mark.parametrize("batch,vocab,rows,words", [(1, 32, [0], 1), (3, 1000, [2, 0], 32), (5, 49152, [1, 3, 4], 1536),
                                                    (2, 70, [1], 3), (2, 70, [0, 1], 2)])
def test_host_bitmask_equals_the_twin(library, batch, vocab, rows, words):
    rng = np.random.default_rng(vocab + words)
    logits = rng.standard_normal((batch, vocab), dtype=np.float32)
    mask = rng.integers(-2**31, 2**31, size=(len(rows), words), dtype=np.int64).astype(np.int32)
    mask[0, 0] = -1                                   # a word that allows everything: skipped whole
    row_ids = np.asarray(rows, dtype=np.int32)
    want, got = logits.copy(), logits.copy()
    B.apply_token_bitmask_numpy(want, mask, row_ids)
    B.apply_token_bitmask_host(got, mask, row_ids, library)
    np.testing.assert_array_equal(got, want)
    untouched = [r for r in range(batch) if r not in rows]
    np.testing.assert_array_equal(got[untouched], logits[untouched])


def test_host_bitmask_reads_strided_rows_and_refuses_bad_rows(library):
    logits = np.zeros((3, 80), dtype=np.float32)[:, :40]            # row stride 80, 40 logits
    mask = np.array([[(1 << 3) | (1 << 31), 1 << 1]], dtype=np.uint32).view(np.int32)   # 3, 31, 33
    B.apply_token_bitmask_host(logits, mask, np.array([1], np.int32), library)
    assert np.flatnonzero(np.isfinite(logits[1])).tolist() == [3, 31, 33]
    assert np.isfinite(logits[[0, 2]]).all()
    with pytest.raises(ValueError, match="outside"):
        B.apply_token_bitmask_host(logits, mask, np.array([3], np.int32), library)
