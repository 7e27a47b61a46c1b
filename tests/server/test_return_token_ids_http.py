"""return_token_ids (vLLM's) on /v1/completions and /v1/chat/completions: the prompt's token ids
and the generated ones, full and streamed (prompt ids once, then each chunk's new ids: together
the whole output, held-back chunks included), equal to what /tokenize and the text say."""
from __future__ import annotations

import json

import pytest
from server_helpers import MODEL, http


def _post(url: str, path: str, body: dict):
    status, _, raw = http(url, "POST", path, {"model": MODEL, **body})
    assert status == 200, raw
    if body.get("stream"):
        return [json.loads(line[6:]) for line in raw.decode().splitlines()
                if line.startswith("data: {")]
    return json.loads(raw)


def _detokenize(url: str, ids: list[int]) -> str:
    return json.loads(http(url, "POST", "/detokenize", {"model": MODEL, "tokens": ids})[2])["prompt"]


PROMPT = "The capital of France is"
SAMPLING = {"max_tokens": 12, "temperature": 0, "return_token_ids": True, "stop": ["\n\n"]}


def test_completions(base_url):
    prompt_ids = json.loads(http(base_url, "POST", "/tokenize", {"model": MODEL, "prompt": PROMPT})[2])["tokens"]
    full = _post(base_url, "/v1/completions", {"prompt": PROMPT, "n": 2, **SAMPLING})
    for choice in full["choices"]:
        assert choice["prompt_token_ids"] == prompt_ids and _detokenize(base_url, choice["token_ids"]).startswith(
            choice["text"])
    chunks = _post(base_url, "/v1/completions", {"prompt": PROMPT, "stream": True, **SAMPLING})
    choices = [c for chunk in chunks for c in chunk["choices"]]
    assert choices[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c for c in choices[1:])
    assert [t for c in choices for t in c["token_ids"]] == full["choices"][0]["token_ids"]
    assert "token_ids" not in _post(base_url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})["choices"][0]


@pytest.mark.parametrize("stream", [False, True])
def test_chat(base_url, stream):
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt_ids = json.loads(http(base_url, "POST", "/tokenize", {"model": MODEL, "messages": messages})[2])["tokens"]
    reply = _post(base_url, "/v1/chat/completions", {"messages": messages, "stream": stream, **SAMPLING})
    if not stream:
        assert reply["prompt_token_ids"] == prompt_ids
        choice = reply["choices"][0]
        assert _detokenize(base_url, choice["token_ids"]).startswith(choice["message"]["content"])
        return
    assert reply[0]["prompt_token_ids"] == prompt_ids and all("prompt_token_ids" not in c for c in reply[1:])
    ids = [t for chunk in reply for c in chunk["choices"] for t in c.get("token_ids", [])]
    text = "".join(c["delta"].get("content") or "" for chunk in reply for c in chunk["choices"])
    assert ids and _detokenize(base_url, ids).startswith(text)
