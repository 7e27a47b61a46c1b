"""One small case per sampling kernel (cuda/sampling.cu), the set CI also runs under ThreadSanitizer
and AddressSanitizer (threads mode, tools/ci_kernels.sh)."""
import numpy as np

from ember_cupy import SamplingParams
from ember_cupy.engine import sampler as S

from .helpers import on_kernel
from .sampling_cases import assert_same_tokens, make_batch, rows_of_every_kind


def test_small_logit_edits():
    vocab = 64
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25, min_tokens=5,
                             stop_token_ids=[9], logit_bias={3: 2.0, 40: -7.5}),
              SamplingParams(), SamplingParams(repetition_penalty=0.8, logit_bias={1: 1.0})]
    batch = make_batch(params, vocab, seed=1, eos=(2,), outputs=[4])
    logits = rows_of_every_kind(np.random.default_rng(1), 3, vocab)
    want, got = logits.copy(), logits.copy()
    S.apply_logit_edits_numpy(want, batch)
    on_kernel(S.apply_logit_edits, got, batch)
    np.testing.assert_array_equal(got, want)


def test_small_sample_rows():
    vocab = 600     # 96 threads a row: three warps
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=5, top_p=0.8),
              SamplingParams(temperature=1.3, min_p=0.1), SamplingParams(temperature=0.6),
              SamplingParams(top_p=0.5), SamplingParams(temperature=0.0)]
    batch = make_batch(params, vocab, seed=2)
    logits = rows_of_every_kind(np.random.default_rng(2), len(params), vocab)   # NaN, +inf rows among them
    want = S.sample_tokens_numpy(logits, batch)
    assert_same_tokens(on_kernel(S.sample_tokens, logits, batch), want, logits, batch, min_clear=1.0)


def test_small_raw_logprobs():
    vocab = 64
    params = [SamplingParams(logprobs=20), SamplingParams(), SamplingParams(logprobs=3), SamplingParams(logprobs=0)]
    batch = make_batch(params, vocab, seed=3)
    logits = rows_of_every_kind(np.random.default_rng(3), len(params), vocab)
    tokens = np.array([5, 0, 63, 7], np.int32)
    want = S.raw_logprobs_numpy(logits, batch, tokens)
    ids, values, chosen = on_kernel(S.raw_logprobs, logits, batch, tokens)
    np.testing.assert_array_equal(ids[0], want[0][0])
    np.testing.assert_array_equal(ids[1, :3], want[0][1, :3])
    np.testing.assert_allclose(values[0], want[1][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(chosen, want[2], rtol=1e-5, atol=1e-5)
