"""truncate_prompt_tokens (vLLM's) on /v1/completions, /v1/chat/completions and /v1/embeddings:
a prompt's last k tokens run (-1: as many as the context holds), as if those tokens alone had been
sent (echo: the text of those tokens); bad values are 400s. The Python API's twin: tests/test_llm_prompts.py."""
from __future__ import annotations

import json

import pytest
from server_helpers import MAX_MODEL_LEN, MODEL, http

LONG = "the quick brown fox jumps over the lazy dog " * 80     # ~720 tokens: past MAX_MODEL_LEN


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    status, _, raw = http(url, "POST", path, {"model": MODEL, **body})
    return status, json.loads(raw)


def _ids(url: str, text: str) -> list[int]:
    return _post(url, "/tokenize", {"prompt": text})[1]["tokens"]


def test_completions_run_the_prompts_last_tokens(base_url):
    ids = _ids(base_url, LONG)
    assert len(ids) > MAX_MODEL_LEN
    greedy = {"max_tokens": 4, "temperature": 0}
    status, body = _post(base_url, "/v1/completions", {"prompt": LONG, "truncate_prompt_tokens": 20, **greedy})
    assert status == 200 and body["usage"]["prompt_tokens"] == 20
    _, alone = _post(base_url, "/v1/completions", {"prompt": ids[-20:], **greedy})
    assert body["choices"][0]["text"] == alone["choices"][0]["text"]
    status, body = _post(base_url, "/v1/completions", {"prompt": ids, "truncate_prompt_tokens": -1, **greedy})
    assert status == 200 and body["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 4      # room for max_tokens
    status, body = _post(base_url, "/v1/completions", {"prompt": ids, "truncate_prompt_tokens": -1,
                                                       "max_tokens": None, "ignore_eos": True})
    assert status == 200 and body["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 16     # OpenAI's default max_tokens
    assert body["usage"]["completion_tokens"] == 16
    status, body = _post(base_url, "/v1/completions", {"prompt": LONG, "truncate_prompt_tokens": 20, "echo": True,
                                                       "logprobs": 1, **greedy})
    echoed = _post(base_url, "/detokenize", {"tokens": ids[-20:]})[1]["prompt"]   # the prompt that ran
    assert status == 200 and body["choices"][0]["text"] == echoed + alone["choices"][0]["text"]
    assert len(body["choices"][0]["logprobs"]["tokens"]) == 20 + 4
    status, body = _post(base_url, "/v1/completions", {"prompt": LONG, **greedy})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"      # without it: refused


def test_chat_and_embeddings_take_it_too(base_url):
    messages = [{"role": "user", "content": LONG}]
    status, body = _post(base_url, "/v1/chat/completions", {"messages": messages, "truncate_prompt_tokens": 50,
                                                            "max_tokens": 2})
    assert status == 200 and body["usage"]["prompt_tokens"] == 50
    status, body = _post(base_url, "/v1/chat/completions", {"messages": messages, "truncate_prompt_tokens": -1,
                                                            "ignore_eos": True})
    assert status == 200 and body["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 1      # no max_tokens: one
    assert body["usage"]["completion_tokens"] == 1
    status, body = _post(base_url, "/v1/embeddings", {"input": LONG, "truncate_prompt_tokens": -1})
    assert status == 200 and body["usage"]["prompt_tokens"] == MAX_MODEL_LEN
    _, alone = _post(base_url, "/v1/embeddings", {"input": _ids(base_url, LONG)[-MAX_MODEL_LEN:]})
    assert body["data"][0]["embedding"] == pytest.approx(alone["data"][0]["embedding"], abs=1e-6)


@pytest.mark.parametrize("path, body, param, code", [
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "invalid_value"),
    ("/v1/embeddings", {"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "invalid_value"),
])
def test_bad_values_are_400s_naming_the_field(base_url, path, body, param, code):
    status, reply = _post(base_url, path, body)
    assert status == 400 and reply["error"]["param"] == param and reply["error"]["code"] == code, reply


def test_the_servers_prompt_bound_counts_the_truncated_prompt(start_server):
    """--max-prompt-tokens-per-request bounds what runs: a document longer than it, cut to fit, passes."""
    url = start_server(settings={"max_prompt_tokens_per_request": 300}).url
    status, body = _post(url, "/v1/embeddings", {"input": LONG, "truncate_prompt_tokens": 100})
    assert status == 200 and body["usage"]["prompt_tokens"] == 100
    status, body = _post(url, "/v1/embeddings", {"input": LONG})
    assert status == 400
