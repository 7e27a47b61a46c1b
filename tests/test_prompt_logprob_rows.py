"""Prompt logprobs of many positions at once (engine/prompt_logprobs.py, issue 24) are the entries
the per-row rule gives (log_softmax of the step's rows, then sampler.top_logprobs of each), bit for
bit: ties at the k-th place, -inf, +inf and NaN logits included."""
import numpy as np
import pytest

from ember_cupy.engine.prompt_logprobs import prompt_logprob_entries
from ember_cupy.engine.sampler import TokenLogprobs, log_softmax, top_logprobs


def per_row(logits: np.ndarray, targets: list[int], k: int) -> list[TokenLogprobs]:
    logprobs = log_softmax(logits.astype(np.float32))
    return [TokenLogprobs(t, float(row[t]), top_logprobs(row, k)) for row, t in zip(logprobs, targets)]


def random_rows(rng, rows: int, vocab: int) -> np.ndarray:
    """Coarse values (ties everywhere, also at the k-th place), and rows with -inf, +inf and NaN."""
    logits = rng.integers(-6, 6, size=(rows, vocab)).astype(np.float32) / 2
    logits[1, rng.random(vocab) < 0.9] = -np.inf     # fewer finite values than k
    logits[2, [3, 5]] = np.inf
    logits[3, rng.random(vocab) < 0.2] = np.nan
    logits[4] = -np.inf
    logits[5] = rng.standard_normal(vocab)           # no ties: the fast path
    return logits


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # the -inf rows' own arithmetic
@pytest.mark.parametrize("k", [0, 1, 5, 20, 200])
def test_all_rows_at_once_equal_the_per_row_rule(k):
    rng = np.random.default_rng(k)
    for vocab in (7, 50, 300):
        logits = random_rows(rng, 12, vocab)
        targets = rng.integers(0, vocab, size=12).tolist()
        assert prompt_logprob_entries(logits, targets, k) == per_row(logits, targets, k)


def test_a_model_sized_step_of_distinct_logits_takes_the_fast_path_and_agrees():
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((64, 49152)) * 3).astype(np.float32)
    targets = rng.integers(0, 49152, size=64).tolist()
    assert prompt_logprob_entries(logits, targets, 20) == per_row(logits, targets, 20)
