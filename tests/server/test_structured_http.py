"""Structured outputs and tool calls over HTTP on the real server: raw request shapes, the openai
SDK's parse and streams, and the client libraries that build on them (instructor, langchain-openai,
litellm), each skipped with a reason where it does not install."""
from __future__ import annotations

import json
import os
import re
import time

import jsonschema
import pydantic
import pytest
from server_helpers import MODEL, http

CITY_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "population": {"type": "integer", "minimum": 0, "maximum": 40000000}},
    "required": ["city", "population"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ASK_CITY = [{"role": "user", "content": "Name a big city and its population, as JSON."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0, le=40_000_000)


def chat(base_url, **fields):
    status, _, body = http(base_url, "POST", "/v1/chat/completions",
                           {"model": MODEL, "max_tokens": 64, "temperature": 0, **fields})
    return status, json.loads(body)


def sse_chunks(raw: bytes) -> list[dict]:
    lines = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# --- request shapes ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [None, 1, 2])
def test_response_format_json_schema(base_url, seed):
    sampling = {} if seed is None else {"temperature": 1.0, "seed": seed}
    status, body = chat(base_url, messages=ASK_CITY, **sampling, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), CITY_SCHEMA)


def test_response_format_json_object_and_text(base_url):
    status, body = chat(base_url, messages=ASK_CITY, response_format={"type": "json_object"})
    assert status == 200 and isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)
    status, body = chat(base_url, messages=ASK_CITY, max_tokens=4, response_format={"type": "text"})
    assert status == 200


@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
def test_llama_servers_response_format_with_a_bare_schema(base_url, kind):
    """llama-server's shape, {"type": ..., "schema": S}, constrains the text to S on both endpoints."""
    status, body = chat(base_url, messages=ASK_CITY, response_format={"type": kind, "schema": CITY_SCHEMA})
    assert status == 200, body
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), CITY_SCHEMA)
    status, _, raw = http(base_url, "POST", "/v1/completions", {
        "model": MODEL, "prompt": "A city as JSON:", "max_tokens": 64, "temperature": 0,
        "response_format": {"type": kind, "schema": CITY_SCHEMA}})
    assert status == 200, raw
    jsonschema.validate(json.loads(json.loads(raw)["choices"][0]["text"]), CITY_SCHEMA)


def test_structured_outputs_on_both_endpoints(base_url):
    status, body = chat(base_url, messages=ASK_CITY, structured_outputs={"choice": ["alpha", "beta"]})
    assert status == 200 and body["choices"][0]["message"]["content"] in ("alpha", "beta")
    status, _, raw = http(base_url, "POST", "/v1/completions", {
        "model": MODEL, "prompt": "My phone number is", "max_tokens": 20, "temperature": 1.0, "seed": 4,
        "structured_outputs": {"regex": r" [0-9]{3}-[0-9]{4}"}})
    assert status == 200
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", json.loads(raw)["choices"][0]["text"])


def test_a_small_vocabularys_grammar_tokenizer_is_built_once_the_started_server_is_idle(start_server, monkeypatch):
    """49k tokens: ~0.3 s holding the GIL, built on a grammar worker once the engine has been
    idle for a moment after start: not while the server first answers (/health waited for it),
    and not inside the first constrained request, which stalled the others (a 262k vocabulary
    waits for the first one: tests/test_gemma3.py)."""
    from ember_cupy.server import async_engine
    monkeypatch.setattr(async_engine, "GRAMMAR_TOKENIZER_IDLE_S", 3.0)   # a slow machine's margin
    fresh = start_server()
    grammars = fresh.engine.engine.grammars
    assert grammars.prepared_at_start
    status, _, _ = http(fresh.url, "GET", "/health")
    assert status == 200 and not grammars.tokenizer_built
    deadline = time.monotonic() + 30
    while not grammars.tokenizer_built and time.monotonic() < deadline:
        time.sleep(0.05)
    assert grammars.tokenizer_built


def test_streamed_json_schema(base_url):
    status, _, raw = http(base_url, "POST", "/v1/chat/completions", {
        "model": MODEL, "messages": ASK_CITY, "max_tokens": 64, "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}}})
    assert status == 200
    chunks = sse_chunks(raw)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    jsonschema.validate(json.loads(text), CITY_SCHEMA)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("fields,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     None, "Invalid type"),
    ({"structured_outputs": {"regex": "(ab"}}, None, "unclosed group"),
    ({"response_format": {"type": "json_schema", "schema": {}, "json_schema": {"name": "x"}}}, "response_format",
     "exactly one"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "exactly one"),
    ({"response_format": {"type": "text", "schema": {}}}, "response_format", "only when"),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, None, "nothing_here"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "response_format", "not both"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined"),
])
def test_bad_constraints_are_400s_naming_the_problem(base_url, fields, param, words):
    status, body = chat(base_url, messages=ASK_CITY, **fields)
    assert status == 400, body
    assert words in body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls(base_url, choice):
    status, body = chat(base_url, messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice=choice)
    assert status == 200, body
    choice_body = body["choices"][0]
    assert choice_body["finish_reason"] == "tool_calls" and choice_body["message"]["content"] is None
    (call,) = choice_body["message"]["tool_calls"][:1]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_TOOL["function"]["parameters"])


def test_streamed_tool_call(base_url):
    status, _, raw = http(base_url, "POST", "/v1/chat/completions", {
        "model": MODEL, "messages": ASK_WEATHER, "max_tokens": 64, "stream": True, "temperature": 0,
        "tools": [WEATHER_TOOL], "tool_choice": "required"})
    assert status == 200
    chunks = [c for c in sse_chunks(raw) if c["choices"]]
    pieces = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls") or []]
    assert pieces and pieces[0]["id"].startswith("call_") and pieces[0]["function"]["name"] == "get_weather"
    arguments = "".join(p["function"]["arguments"] for p in pieces if p["index"] == 0)
    jsonschema.validate(json.loads(arguments), WEATHER_TOOL["function"]["parameters"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_array_cut_by_max_tokens_is_content_with_finish_reason_length(base_url, stream):
    """No call goes out whose arguments are unfinished: the cut array's text is the content."""
    status, _, raw = http(base_url, "POST", "/v1/chat/completions", {
        "model": MODEL, "messages": ASK_WEATHER, "max_tokens": 6, "stream": stream, "temperature": 0,
        "tools": [WEATHER_TOOL], "tool_choice": "required"})
    assert status == 200
    if stream:
        chunks = [c for c in sse_chunks(raw) if c["choices"]]
        assert not any(c["choices"][0]["delta"].get("tool_calls") for c in chunks)
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        finish_reason = chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = json.loads(raw)["choices"][0]
        assert "tool_calls" not in choice["message"]
        content, finish_reason = choice["message"]["content"], choice["finish_reason"]
    assert finish_reason == "length"
    assert content.startswith('[{"name"'), content
    with pytest.raises(json.JSONDecodeError):
        json.loads(content)


def test_auto_chit_chat_is_text_and_tool_results_round_trip(base_url):
    status, body = chat(base_url, messages=[{"role": "user", "content": "Hi! How are you?"}],
                        tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=24)
    assert status == 200 and body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    call = {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    status, body = chat(base_url, tools=[WEATHER_TOOL], max_tokens=24, messages=ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_7", "content": "Sunny, 24 C"}])
    assert status == 200, body


# --- client libraries ----------------------------------------------------------------------------
def test_openai_sdk_parse(client):
    completion = client.chat.completions.parse(model=MODEL, messages=ASK_CITY, response_format=City,
                                               max_tokens=80, temperature=0)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City)


def test_openai_sdk_parse_stream(client):
    with client.chat.completions.stream(model=MODEL, messages=ASK_CITY, response_format=City,
                                        max_tokens=80, temperature=1.0, seed=3) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, City)


def test_openai_sdk_tools_parse(client):
    import openai
    tool = openai.pydantic_function_tool(City, name="record_city")
    completion = client.chat.completions.parse(model=MODEL, messages=ASK_CITY, tools=[tool],
                                               tool_choice="required", max_tokens=80, temperature=0)
    call = completion.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, City)


def test_instructor(base_url):
    instructor = pytest.importorskip("instructor", reason="instructor is not installed (test extra)")
    import openai
    client = instructor.from_openai(openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0),
                                    mode=instructor.Mode.TOOLS)
    city = client.chat.completions.create(model=MODEL, messages=ASK_CITY, response_model=City,
                                          max_tokens=80, temperature=0, max_retries=0)
    assert isinstance(city, City)
    partials = list(client.chat.completions.create_partial(model=MODEL, messages=ASK_CITY, response_model=City,
                                                           max_tokens=80, temperature=0, max_retries=0))
    assert partials and City.model_validate(partials[-1].model_dump())


def test_langchain_with_structured_output(base_url):
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed (test extra)")
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=base_url + "/v1", api_key="unused", temperature=0,
                                      max_tokens=80, max_retries=0)
    for method in ("json_schema", "function_calling"):
        structured = llm.with_structured_output(City, method=method)
        assert isinstance(structured.invoke(ASK_CITY[0]["content"]), City)
    chunks = list(llm.with_structured_output(City, method="json_schema").stream(ASK_CITY[0]["content"]))
    assert chunks and isinstance(chunks[-1], City)


def test_litellm_response_format(base_url):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no network fetch at import
    litellm = pytest.importorskip("litellm", reason="litellm is not installed (test extra)")
    kwargs = dict(model=f"openai/{MODEL}", api_base=base_url + "/v1", api_key="unused", messages=ASK_CITY,
                  response_format=City, max_tokens=80, temperature=0)
    response = litellm.completion(**kwargs)
    City.model_validate_json(response.choices[0].message.content)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in litellm.completion(stream=True, **kwargs))
    City.model_validate_json(text)
