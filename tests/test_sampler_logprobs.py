"""Raw logprobs (vLLM v1's default), non-finite logits, and the real bytes of chat logprob tokens."""
import math

import numpy as np
import pytest

from ember_cupy import SamplingParams
from ember_cupy.engine.sampler import Sampler, TokenLogprobs
from ember_cupy.engine.sequence import Sequence

PROMPT = "The capital of France is"


# --- logprobs are the model's, before any processing ----------------------------------------
@pytest.fixture(scope="module")
def llm(checkpoint):
    from ember_cupy import LLM
    return LLM(checkpoint, enable_prefix_caching=False)   # every run computes the prompt the same way


@pytest.fixture(scope="module")
def unbiased(llm):
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, logprobs=20))[0].outputs[0].logprobs[0]


def test_a_token_forced_by_logit_bias_reports_its_model_logprob(llm, unbiased):
    forced, model_logprob = unbiased.top[7]            # a plausible token, but not the greedy one
    assert model_logprob < -1.0
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, logprobs=20,
                                              logit_bias={forced: 100}))[0].outputs[0]
    assert out.token_ids == [forced]
    entry = out.logprobs[0]
    assert entry.token_id == forced
    assert entry.logprob == pytest.approx(model_logprob, abs=1e-5)    # not 0.0
    assert [t for t, _ in entry.top] == [t for t, _ in unbiased.top]
    assert [v for _, v in entry.top] == pytest.approx([v for _, v in unbiased.top], abs=1e-5)
    assert out.cumulative_logprob == pytest.approx(model_logprob, abs=1e-5)


@pytest.mark.parametrize("params", [dict(repetition_penalty=1.8), dict(temperature=1.7, seed=4),
                                    dict(temperature=0.6, top_k=3, seed=4, logit_bias={13: -50})])
def test_penalties_and_temperature_do_not_change_the_logprobs(llm, unbiased, params):
    out = llm.generate(PROMPT, SamplingParams(**{"temperature": 0, "max_tokens": 1, "logprobs": 20, **params}))
    entry = out[0].outputs[0].logprobs[0]
    assert [t for t, _ in entry.top] == [t for t, _ in unbiased.top]
    assert [v for _, v in entry.top] == pytest.approx([v for _, v in unbiased.top], abs=1e-5)


# --- non-finite logits ----------------------------------------------------------------------
def _seqs(*params):
    return [Sequence(f"s{i}", [0], p, 10, rng=np.random.default_rng(i)) for i, p in enumerate(params)]


ALL_KINDS = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=1.0, logprobs=3),
             SamplingParams(temperature=0.8, top_p=0.9, logprobs=3), SamplingParams(temperature=0.8, top_k=5),
             SamplingParams(temperature=1.2, min_p=0.1), SamplingParams(temperature=0.5, top_k=4, top_p=0.5)]


@pytest.mark.filterwarnings("error")
def test_nan_logits_are_never_sampled_and_do_not_poison_the_row():
    rng = np.random.default_rng(0)
    sampler = Sampler(eos_token_ids=())
    for _ in range(200):
        logits = rng.standard_normal((len(ALL_KINDS), 60)).astype(np.float32)
        nan = rng.random(logits.shape) < 0.3
        nan[:, 0] = True                              # np.argmax would pick a NaN at index 0
        logits[nan] = np.nan
        out = sampler(logits, _seqs(*ALL_KINDS))
        for row, token in enumerate(out.token_ids):
            assert not nan[row, token]
        assert out.token_ids[0] == int(np.argmax(np.where(nan[0], -np.inf, logits[0])))
        for entry in out.logprobs[:3]:
            assert math.isfinite(entry.logprob) and all(math.isfinite(v) for _, v in entry.top)


@pytest.mark.filterwarnings("error")
def test_plus_inf_logits_give_the_limit_distribution():
    logits = np.zeros((len(ALL_KINDS), 40), dtype=np.float32)
    logits[:, [7, 30]] = np.inf
    logits[:, 5] = np.nan
    sampler = Sampler(eos_token_ids=())
    seen = set()
    for _ in range(50):
        out = sampler(logits, _seqs(*ALL_KINDS))
        assert out.token_ids[0] == 7 and set(out.token_ids) <= {7, 30}
        seen.update(out.token_ids[1:])
        for entry in out.logprobs[:3]:
            assert entry.logprob == pytest.approx(math.log(0.5))
            assert {t for t, _ in entry.top[:2]} == {7, 30} and entry.top[2][1] == -np.inf
    assert seen == {7, 30}


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("fill", [np.nan, -np.inf])
def test_a_row_without_finite_logits_falls_back_to_greedy(fill):
    logits = np.full((len(ALL_KINDS) + 1, 30), fill, dtype=np.float32)
    logits[-1] = np.linspace(0, 1, 30)                # a healthy row alongside
    out = Sampler(eos_token_ids=())(logits, _seqs(*ALL_KINDS, SamplingParams(temperature=0)))
    assert out.token_ids == [0] * len(ALL_KINDS) + [29]
    assert all(entry.logprob == -np.inf for entry in out.logprobs[:3])


# --- chat logprob bytes ---------------------------------------------------------------------
def test_chat_logprob_bytes_are_each_tokens_own_bytes(tokenizer):
    from ember_cupy.server.completion_bodies import LogprobFormatter
    ids = tokenizer.encode("🚀")
    assert len(ids) == 3                              # one character, three byte-level tokens
    entries = [TokenLogprobs(i, -0.25, [(i, -0.25), (ids[(n + 1) % 3], -2.0)]) for n, i in enumerate(ids)]
    content = LogprobFormatter(tokenizer).chat(entries)["content"]
    assert b"".join(bytes(c["bytes"]) for c in content) == "🚀".encode("utf-8")
    for n, c in enumerate(content):
        assert c["bytes"] == c["top_logprobs"][0]["bytes"] == list(tokenizer.token_bytes(ids[n]))
        assert c["top_logprobs"][1]["bytes"] == list(tokenizer.token_bytes(ids[(n + 1) % 3]))
    text = "Hi 🚀 naïve<|im_end|>"
    content = LogprobFormatter(tokenizer).chat([TokenLogprobs(i, 0.0, []) for i in tokenizer.encode(text)])["content"]
    assert b"".join(bytes(c["bytes"]) for c in content) == text.encode("utf-8")


def test_token_bytes_agree_with_the_decoder_over_the_whole_vocabulary(tokenizer):
    for token_id in range(tokenizer.vocab_size):
        raw = tokenizer.token_bytes(token_id)
        assert raw.decode("utf-8", errors="replace") == tokenizer.token_bytes_text(token_id), token_id
