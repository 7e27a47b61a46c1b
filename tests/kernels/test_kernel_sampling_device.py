"""cuda/sampling.cu's apply_logit_edits, sample_rows and raw_logprobs against their NumPy twins
(the host path, ember_cupy/engine/sampler.py) on the CPU shim. Logits reach the sampler in float32
only (the runner keeps them float32 on every backend), so float32 is the one dtype tested."""
import numpy as np
import pytest

from ember_cupy import SamplingParams
from ember_cupy.engine import sampler as S

from .helpers import on_kernel
from .sampling_cases import assert_same_tokens, make_batch, random_params, rows_of_every_kind


def edit_params(rng, count, vocab):
    return [SamplingParams(temperature=0.8, repetition_penalty=[1.0, 1.3, 0.7][i % 3],
                           frequency_penalty=[0.0, 0.5, -0.3, 1.1][i % 4], presence_penalty=[0.0, 0.4, -1.0][i % 3],
                           min_tokens=[0, 10][i % 2], stop_token_ids=[9] if i % 5 else [],
                           logit_bias={int(t): float(rng.uniform(-100, 100))
                                       for t in rng.choice(vocab, i % 4, replace=False)})
            for i in range(count)]


@pytest.mark.parametrize("vocab,count", [(300, 12), (1000, 5)])
def test_logit_edits_equal_the_twin(vocab, count):
    rng = np.random.default_rng(vocab)
    batch = make_batch(edit_params(rng, count, vocab), vocab, seed=vocab, eos=(5, 6), outputs=[0, 3, 20, 7])
    assert batch.has_edits and (batch.entries[:, 2] > 1).any()     # repeated outputs are counted
    logits = (rng.standard_normal((count, vocab)) * 3).astype(np.float32)
    logits[0, :40] = np.nan
    logits[1, 20:30] = np.inf
    want, got = logits.copy(), logits.copy()
    S.apply_logit_edits_numpy(want, batch)
    on_kernel(S.apply_logit_edits, got, batch)
    assert not np.array_equal(want, logits, equal_nan=True)
    np.testing.assert_array_equal(got, want)      # bit-equal, NaN where NaN


@pytest.mark.parametrize("vocab,count,seed", [(300, 90, 0), (2000, 18, 1)])
def test_sampled_tokens_equal_the_twin(vocab, count, seed):
    rng = np.random.default_rng(seed)
    batch = make_batch(random_params(rng, count), vocab, seed)
    logits = rows_of_every_kind(rng, count, vocab)
    want = S.sample_tokens_numpy(logits, batch)
    got = on_kernel(S.sample_tokens, logits.copy(), batch)
    assert got.dtype == np.int32
    assert_same_tokens(got, want, logits, batch)


def test_one_row_drawn_many_times_follows_the_twin():
    """The same row under 50 uniforms for each filter: the kernel walks the same order."""
    vocab, draws = 500, 50
    row = (np.random.default_rng(5).standard_normal(vocab) * 2).astype(np.float32)
    row[[10, 20, 30]] = row.max()          # a tie at the top, ordered by id
    for params in (SamplingParams(top_k=25, top_p=0.9), SamplingParams(top_p=0.7, min_p=0.02),
                   SamplingParams(temperature=0.5), SamplingParams(top_k=3)):
        batch = make_batch([params] * draws, vocab, seed=6)
        logits = np.repeat(row[None], draws, axis=0)
        want = S.sample_tokens_numpy(logits, batch)
        got = on_kernel(S.sample_tokens, logits, batch)
        assert_same_tokens(got, want, logits, batch, min_clear=0.95)
        assert len(set(want.tolist())) > 1


@pytest.mark.parametrize("vocab", [50, 3000])
def test_raw_logprobs_equal_the_twin(vocab):
    rng = np.random.default_rng(vocab)
    count = 14
    params = [SamplingParams(temperature=0.0, logprobs=[0, 1, 5, 20][i % 4]) for i in range(count)]
    params[3] = SamplingParams(temperature=0.0)                     # a row without logprobs
    batch = make_batch(params, vocab, seed=vocab)
    logits = rows_of_every_kind(rng, count, vocab)
    tokens = rng.integers(0, vocab, count).astype(np.int32)
    want = S.raw_logprobs_numpy(logits, batch, tokens)
    got = on_kernel(S.raw_logprobs, logits, batch, tokens)
    ids, values, chosen = (np.asarray(a) for a in got)
    assert ids.shape == want[0].shape == (count - 1, 20)
    for j, n in enumerate(batch.logprob_counts):
        np.testing.assert_array_equal(ids[j, :n], want[0][j, :n])
        np.testing.assert_allclose(values[j, :n], want[1][j, :n], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(chosen, want[2], rtol=1e-5, atol=1e-5)


def test_sampler_on_the_kernels_equals_the_host_sampler():
    """Sampler end to end (edits, draw, logprobs) with every step on a kernel: the host's output."""
    from ember_cupy.engine.sequence import Sequence
    vocab = 400
    rng = np.random.default_rng(9)
    logits = rows_of_every_kind(rng, 8, vocab)

    def seqs():
        out = []
        for i in range(8):
            p = SamplingParams(temperature=[0.0, 0.9][i % 2], top_p=0.9, top_k=[0, 30][i % 3 == 0], seed=i,
                               logprobs=[None, 3][i % 2], repetition_penalty=1.2, frequency_penalty=0.3,
                               logit_bias={7: 4.0})
            seq = Sequence(f"s{i}", [3, 4, 5], p, 10)
            seq.token_ids += [7, 8, 7]
            out.append(seq)
        return out
    want = S.Sampler((2,))(logits.copy(), seqs())
    got = on_kernel(S.Sampler((2,)), logits.copy(), seqs())
    assert got.token_ids == want.token_ids
    for g, w in zip(got.logprobs, want.logprobs):
        assert (g is None) == (w is None)
        if g is not None:
            assert [t for t, _ in g.top] == [t for t, _ in w.top]
            np.testing.assert_allclose([v for _, v in g.top] + [g.logprob], [v for _, v in w.top] + [w.logprob],
                                       rtol=1e-5, atol=1e-5)


def test_a_vocabulary_smaller_than_the_logprobs_asked_for():
    from ember_cupy.engine.sequence import Sequence
    logits = np.random.default_rng(0).standard_normal((2, 12)).astype(np.float32)

    def seqs():
        return [Sequence("a", [1], SamplingParams(temperature=0.0, logprobs=20), 5),
                Sequence("b", [1], SamplingParams(temperature=1.0, seed=1, logprobs=3), 5)]
    want = S.Sampler((0,))(logits.copy(), seqs())
    got = on_kernel(S.Sampler((0,)), logits.copy(), seqs())
    assert got.token_ids == want.token_ids
    assert [[t for t, _ in e.top] for e in got.logprobs] == [[t for t, _ in e.top] for e in want.logprobs]
    assert len(got.logprobs[0].top) == 12
