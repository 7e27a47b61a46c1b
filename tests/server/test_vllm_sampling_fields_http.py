"""vLLM's extra sampling fields on /v1/completions and /v1/chat/completions: allowed_token_ids
(every sampled token one of them) and bad_words (never completed); bad values are 400s naming the
field. The Python API's tests: tests/test_allowed_token_ids.py, tests/test_bad_words.py."""
from __future__ import annotations

import json

import pytest
from server_helpers import MODEL, http

WORDS = [" cat", " dog", " fish"]


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    status, _, raw = http(url, "POST", path, {"model": MODEL, **body})
    return status, json.loads(raw)


@pytest.fixture(scope="module")
def allowed(base_url) -> list[int]:
    return [_post(base_url, "/tokenize", {"prompt": w, "add_special_tokens": False})[1]["tokens"][0] for w in WORDS]


def test_completions_and_chat_sample_only_allowed_tokens(base_url, allowed):
    sampled = {"max_tokens": 6, "temperature": 1.5, "seed": 1, "allowed_token_ids": allowed}
    status, reply = _post(base_url, "/v1/completions", {"prompt": "My favourite animal is the", "logprobs": 0,
                                                        **sampled})
    assert status == 200, reply
    tokens = reply["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 6 and set(tokens) <= set(WORDS)
    status, reply = _post(base_url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "An animal?"}],
                                                             "logprobs": True, **sampled})
    assert status == 200, reply
    assert {entry["token"] for entry in reply["choices"][0]["logprobs"]["content"]} <= set(WORDS)


@pytest.mark.parametrize("bad", [[], [10**7], [1.5], "3"])
def test_bad_lists_are_400s(base_url, bad):
    status, reply = _post(base_url, "/v1/completions", {"prompt": "x", "allowed_token_ids": bad})
    assert status == 400 and reply["error"]["param"].startswith("allowed_token_ids"), reply


def test_bad_words_are_never_completed(base_url):
    prompt = "Repeat after me: Paris France, Paris France, Paris France, Paris"
    free = _post(base_url, "/v1/completions", {"prompt": prompt, "max_tokens": 20, "temperature": 0})[1]
    assert "Paris France" in free["choices"][0]["text"]
    for path, body in (("/v1/completions", {"prompt": prompt}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]})):
        status, reply = _post(base_url, path, {**body, "max_tokens": 20, "temperature": 0,
                                               "bad_words": ["Paris France"]})
        assert status == 200, reply
        choice = reply["choices"][0]
        assert "Paris France" not in (choice.get("text") or choice.get("message", {}).get("content"))
    status, reply = _post(base_url, "/v1/completions", {"prompt": "x", "bad_words": [""]})
    assert status == 400 and reply["error"]["param"] == "bad_words", reply
