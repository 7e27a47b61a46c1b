"""SamplingParams.allowed_token_ids (vLLM's): every sampled token is one of them, on the real model,
through the Python API (HTTP: tests/server/test_allowed_token_ids_http.py); with a grammar, only
the tokens both allow; bad lists are ValueErrors."""
from __future__ import annotations

import json

import pytest

from ember_cupy import SamplingParams
from ember_cupy.structured import StructuredOutputsParams

PROMPT = "My favourite animal is the"


@pytest.fixture(scope="module")
def llm(checkpoint):
    from ember_cupy import LLM
    return LLM(checkpoint, max_model_len=256)


def _first_ids(llm, words: list[str]) -> list[int]:
    return [llm.tokenizer.encode(w, add_special_tokens=False)[0] for w in words]


def test_sampled_tokens_stay_in_the_allowed_set(llm):
    allowed = _first_ids(llm, [" cat", " dog", " fish"])
    [output] = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=1.5, seed=4, n=4,
                                                   allowed_token_ids=allowed, logprobs=1))
    for completion in output.outputs:
        assert len(completion.token_ids) == 12 and set(completion.token_ids) <= set(allowed)
        assert all(entry.token_id in allowed for entry in completion.logprobs)   # raw logprobs: as before
    unconstrained = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=1.5, seed=4, n=4))[0]
    assert any(not set(c.token_ids) <= set(allowed) for c in unconstrained.outputs)


def test_greedy_takes_the_likeliest_allowed_token(llm):
    [free] = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, logprobs=20))
    top = [token for token, _ in free.outputs[0].logprobs[0].top]
    second, fifth = top[1], top[4]
    [masked] = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, allowed_token_ids=[fifth, second]))
    assert masked.outputs[0].token_ids == [second]


def test_with_a_grammar_only_tokens_both_allow(llm):
    choice = StructuredOutputsParams(choice=["yes", "no"])
    first_of = {word: llm.tokenizer.encode(word, add_special_tokens=False)[0] for word in ("yes", "no")}
    for word, token in first_of.items():
        allowed = [token, *llm.engine.tokenizer.eos_token_ids]
        [output] = llm.generate("Answer:", SamplingParams(max_tokens=4, temperature=0, structured_outputs=choice,
                                                          allowed_token_ids=allowed))
        assert output.outputs[0].text == word


@pytest.mark.parametrize("value, message", [([], "must not be empty"), ([10**7], "outside the vocabulary"),
                                            (["a"], "must be a int or a list of them")])
def test_bad_lists_are_value_errors(llm, value, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPT, SamplingParams(max_tokens=1, allowed_token_ids=value))



def test_no_drafts_for_a_limited_sequence(checkpoint):
    """Speculative decoding leaves such a sequence alone (drafts would be verified without the mask)."""
    from step_cost_stand_ins import FreeVerification

    from ember_cupy import LLM
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    llm = LLM(checkpoint, max_model_len=256, speculative_config=ngram)
    llm.engine.speculator.costs = FreeVerification()     # drafting always pays: the gate never says no
    fish = _first_ids(llm, [" fish"])
    repetitive = "one two three four one two three four one two three four one two"
    [output] = llm.generate(repetitive, SamplingParams(max_tokens=8, temperature=0, allowed_token_ids=fish))
    assert output.outputs[0].token_ids == fish * 8
    assert llm.engine.spec_decode_stats.num_drafts == 0
    llm.generate(repetitive, SamplingParams(max_tokens=8, temperature=0))
    assert llm.engine.spec_decode_stats.num_drafts > 0       # the same prompt, unlimited: drafted
