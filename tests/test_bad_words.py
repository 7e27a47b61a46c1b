"""SamplingParams.bad_words (vLLM's): no output contains a bad word's token sequence (as it reads
alone or after a space), on the real model, through the Python API and /v1/completions; the
rest of the output is untouched until the first place the word would have come."""
from __future__ import annotations

import json

import pytest

from ember_cupy import SamplingParams

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm(checkpoint):
    from ember_cupy import LLM
    return LLM(checkpoint, max_model_len=256)


def _contains(ids: list[int], part: tuple[int, ...]) -> bool:
    return any(tuple(ids[i:i + len(part)]) == part for i in range(len(ids) - len(part) + 1))


def _forms(llm, word: str) -> list[tuple[int, ...]]:
    return [tuple(llm.tokenizer.encode(text, add_special_tokens=False)) for text in (word, " " + word)]


def test_a_one_token_word_is_never_sampled(llm):
    free = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
    assert "Paris" in free.text
    banned = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, bad_words=["Paris"]))[0].outputs[0]
    assert "Paris" not in banned.text
    assert not any(_contains(banned.token_ids, form) for form in _forms(llm, "Paris"))


def test_a_multi_token_word_is_never_completed(llm):
    """Its first tokens may come; the last never follows them in the output (vLLM's rule: the
    output, not the prompt, is what a ban looks back on)."""
    word, prompt = "Paris France", "Repeat after me: Paris France, Paris France, Paris France, Paris"
    forms = _forms(llm, word)
    assert all(len(form) == 2 for form in forms)
    free = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0))[0].outputs[0]
    assert any(_contains(free.token_ids, form) for form in forms)           # without the ban: it comes
    for params in (SamplingParams(max_tokens=20, temperature=0, bad_words=[word]),
                   SamplingParams(max_tokens=20, temperature=1.0, seed=2, n=3, bad_words=[word])):
        for completion in llm.generate(prompt, params)[0].outputs:
            assert not any(_contains(completion.token_ids, form) for form in forms), completion.text
            assert completion.token_ids[:1] == free.token_ids[:1] or params.temperature > 0


@pytest.mark.parametrize("value, message", [([""], "non-empty strings"), (["x"] * 65, "at most 64"),
                                            ([3], "must be a str or a list")])
def test_bad_lists_are_value_errors(value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(bad_words=value)


def test_token_ids_given_directly_are_checked_against_the_vocabulary(llm):
    """bad_words_token_ids is the input processor's to fill; one set by hand is still checked (an id
    past the vocabulary would ban a token of the next row of the batch)."""
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(PROMPT, SamplingParams(max_tokens=2, bad_words_token_ids=((10**7,),)))
    with pytest.raises(ValueError, match="tuple of non-empty tuples"):
        SamplingParams(bad_words_token_ids=((),))
