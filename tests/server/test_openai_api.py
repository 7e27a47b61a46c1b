"""The server driven by the official `openai` client: shapes, n, logprobs, stop, seeds, usage."""
from __future__ import annotations

import uuid

import pytest
from server_helpers import MODEL, http, parallel

openai = pytest.importorskip("openai")

CHAT = [{"role": "user", "content": "Name three colors."}]


def tokenize(base_url, **body) -> int:
    status, _, raw = http(base_url, "POST", "/tokenize", body)
    assert status == 200, raw
    import json
    return json.loads(raw)["count"]


def test_completion_non_stream(client, base_url):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                  temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.choices[0].finish_reason in ("stop", "length")
    assert "Paris" in r.choices[0].text
    assert r.usage.prompt_tokens == tokenize(base_url, prompt="The capital of France is")
    assert r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_non_stream(client, base_url):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.usage.prompt_tokens == tokenize(base_url, messages=CHAT)
    assert r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop"


def test_completion_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.9, seed=1234)
    full, chunks = parallel(lambda: client.completions.create(**kwargs), lambda: list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=10, temperature=0.8, seed=7)
    full, chunks = parallel(lambda: client.chat.completions.create(**kwargs),
                            lambda: list(client.chat.completions.create(stream=True, **kwargs)))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_seed_reproducible_and_n2(client):
    kwargs = dict(model=MODEL, prompt="My favourite animal is", max_tokens=6, temperature=1.0, n=2, seed=99)
    a, b, c = parallel(lambda: client.completions.create(**kwargs), lambda: client.completions.create(**kwargs),
                       lambda: client.completions.create(logprobs=0, **kwargs))
    assert [ch.index for ch in a.choices] == [0, 1]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices] == [ch.text for ch in c.choices]
    assert a.choices[0].text != a.choices[1].text
    assert a.usage.completion_tokens == sum(len(ch.logprobs.tokens) for ch in c.choices)


def test_chat_n2_stream(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=2, seed=5,
                                                 stream=True))
    texts = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and all(texts.values())


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)   # greedy: the best one
    assert "".join(lp.tokens).startswith(r.choices[0].text)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode() == entry.token


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = base.choices[0].text
    assert "," in text
    stop = text[text.index(",") - 1:text.index(",") + 1] if text.index(",") else ","
    kwargs = dict(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop])
    r, streamed = parallel(lambda: client.completions.create(**kwargs), lambda: "".join(
        c.choices[0].text for c in client.completions.create(stream=True, **kwargs)))
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert text.startswith(r.choices[0].text)
    assert streamed == r.choices[0].text


def test_batched_prompts_and_token_prompt(client, base_url):
    import json
    _, _, raw = http(base_url, "POST", "/tokenize", {"prompt": "Hello there"})
    ids = json.loads(raw)["tokens"]
    kwargs = dict(model=MODEL, max_tokens=3, temperature=0)
    r, t, e = parallel(lambda: client.completions.create(prompt=["Hello there", "Goodbye"], n=2, **kwargs),
                       lambda: client.completions.create(prompt=ids, **kwargs),
                       lambda: client.completions.create(prompt="Hello there", echo=True, **kwargs))
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text   # greedy: both samples agree
    assert t.choices[0].text == r.choices[0].text
    assert e.choices[0].text == "Hello there" + r.choices[0].text


def test_cached_tokens_reported(client, base_url):
    prompt = f"Session {uuid.uuid4().hex}: " + "the quick brown fox jumps over the lazy dog " * 6
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    n = tokenize(base_url, prompt=prompt)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == n
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < n and cached % 16 == 0


def test_models_and_misc_routes(client, base_url):
    import json
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert http(base_url, "GET", "/health")[0] == 200
    status, _, raw = http(base_url, "GET", "/version")
    assert status == 200 and "version" in json.loads(raw)
    status, _, raw = http(base_url, "POST", "/detokenize", {"tokens": json.loads(
        http(base_url, "POST", "/tokenize", {"prompt": "round trip"})[2])["tokens"]})
    assert status == 200 and json.loads(raw)["prompt"] == "round trip"
    status, _, raw = http(base_url, "GET", "/openapi.json")
    spec = json.loads(raw)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                 "/tokenize", "/detokenize", "/version", "/openapi.json"):
        assert path in spec["paths"]


def test_vllm_extras_accepted(client):
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body={
        "top_k": 5, "min_p": 0.05, "ignore_eos": True, "min_tokens": 4, "repetition_penalty": 1.1,
        "priority": 0, "cache_salt": "tenant-a"}, presence_penalty=0.5, frequency_penalty=0.5,
        logit_bias={"42": -5}, seed=1)
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    c = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=3,
                                       response_format={"type": "text"})
    assert c.usage.completion_tokens <= 3


def test_openai_client_error_shape(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)


def test_tokenize_counts_a_conversation_with_tools_as_chat_does(client, base_url):
    """An assistant tool call and the tools render in the prompt as chat renders them."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=1, temperature=0)
    assert tokenize(base_url, messages=messages, tools=tools) == reply.usage.prompt_tokens
    assert tokenize(base_url, messages=messages) < reply.usage.prompt_tokens     # the tools count too
