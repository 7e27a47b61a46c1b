"""Delta streams over HTTP: several prompts x n streamed with logprobs give, choice by choice,
the text, logprobs and usage of the same request answered whole."""
from __future__ import annotations

import pytest
from server_helpers import MODEL, parallel

openai = pytest.importorskip("openai")


def test_streamed_deltas_add_up_to_the_whole_answer(client):
    kwargs = dict(model=MODEL, prompt=["Once upon a time", "The sky is"], n=2, max_tokens=8,
                  temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    full, chunks = parallel(lambda: client.completions.create(**kwargs), lambda: list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)))
    texts, tokens, finish = {}, {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.logprobs is not None:
                tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1, 2, 3]
    for choice in full.choices:
        assert texts[choice.index] == choice.text
        assert tokens[choice.index] == choice.logprobs.tokens
        assert finish[choice.index] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 4 * 8
