"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) through the
anthropic SDK on the real model. The endpoint runs on the chat path: a greedy message equals the
chat reply of the same conversation, and its input tokens equal chat's prompt tokens."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
from server_helpers import documented, MODEL, http

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

GREEDY = {"temperature": 0}   # as extra_body: the SDK (2.x) has no sampling arguments any more
ASK = [{"role": "user", "content": "The capital of France is"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}
FORCED = {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}, "max_tokens": 40,
          "messages": [{"role": "user", "content": "Weather in Paris?"}]}


@pytest.fixture(scope="module")
def claude(base_url):
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def create(claude, **fields):
    return claude.messages.create(model=MODEL, **{"max_tokens": 8, "extra_body": GREEDY, **fields})


def chat(client, messages, **fields):
    return client.chat.completions.create(model=MODEL, messages=messages, **{"max_tokens": 8, "temperature": 0,
                                                                              **fields})


def test_a_message_is_the_chat_reply_of_its_conversation(claude, client, spec):
    message = create(claude, messages=ASK)
    reply = chat(client, ASK)
    assert message.id.startswith("msg_") and (message.type, message.role, message.model) == (
        "message", "assistant", MODEL)
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == reply.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[reply.choices[0].finish_reason]
    assert (message.usage.input_tokens, message.usage.output_tokens) == (
        reply.usage.prompt_tokens, reply.usage.completion_tokens)
    documented(spec, "MessageResponse", message.model_dump(mode="json", exclude_unset=True))


def test_max_tokens_and_stop_sequences_end_the_message(claude):
    counting = [{"role": "user", "content": "Count from 1 to 30: 1, 2, 3,"}]
    long = create(claude, messages=counting, max_tokens=12)
    assert (long.stop_reason, long.stop_sequence, long.usage.output_tokens) == ("max_tokens", None, 12)
    text = long.content[0].text
    words = text.split()
    stop = words[len(words) // 2]
    assert text.find(stop) > 0, text
    stopped = create(claude, messages=counting, max_tokens=12, stop_sequences=["never seen", stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == text[:text.find(stop)]


def test_a_streamed_message_equals_the_whole_one(claude):
    whole = create(claude, messages=ASK)
    with claude.messages.stream(model=MODEL, max_tokens=8, messages=ASK, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert final.id.startswith("msg_") and final.id != whole.id
    assert (final.content[0].text, final.stop_reason, final.usage) == (text, whole.stop_reason, whole.usage)


def sse_events(raw: bytes) -> list[tuple[str, dict]]:
    events = []
    for block in raw.decode().strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_the_event_stream_is_anthropics(base_url):
    status, headers, raw = http(base_url, "POST", "/v1/messages", {
        "model": MODEL, "max_tokens": 4, "temperature": 0, "stream": True, "messages": ASK})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    deltas = names.count("content_block_delta")
    assert deltas >= 1 and names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * deltas,
                                     "content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert (start["content"], start["stop_reason"], start["usage"]["output_tokens"]) == ([], None, 0)
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    assert all(data["index"] == 0 and data["delta"]["type"] == "text_delta" for name, data in events
               if name == "content_block_delta")
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None} and end["usage"] == {"output_tokens": 4}
    status, _, whole = http(base_url, "POST", "/v1/messages", {"model": MODEL, "max_tokens": 4, "temperature": 0,
                                                                 "messages": ASK})
    assert json.loads(whole)["content"] == [{"type": "text", "text": text}]
    assert json.loads(whole)["usage"]["input_tokens"] == start["usage"]["input_tokens"]


def test_system_blocks_and_turns_make_the_chat_prompt(claude, client):
    turns = [{"role": "user", "content": "My name is Ada."},
             {"role": "assistant", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "Ada!"}]},
             {"role": "user", "content": [{"type": "text", "text": "What is my name?"}]}]
    message = create(claude, system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": " Be kind."}],
                     messages=turns)
    reply = chat(client, [{"role": "system", "content": "Be brief. Be kind."}, turns[0],
                          {"role": "assistant", "content": "Hello Ada!"},
                          {"role": "user", "content": "What is my name?"}])
    assert message.usage.input_tokens == reply.usage.prompt_tokens
    assert message.content[0].text == reply.choices[0].message.content
    as_string = claude.messages.count_tokens(model=MODEL, system="Be brief. Be kind.", messages=turns)
    assert as_string.input_tokens == message.usage.input_tokens


def test_a_forced_tool_gives_a_tool_use_block_that_fits_its_schema(claude, client, spec):
    message = create(claude, **FORCED)
    assert message.stop_reason == "tool_use"
    block, = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    jsonschema.validate(block.input, WEATHER["input_schema"])
    documented(spec, "MessageResponse", message.model_dump(mode="json", exclude_unset=True))
    # the same constraint as chat's named tool_choice: the same arguments
    called = chat(client, FORCED["messages"], tools=[CHAT_WEATHER], max_tokens=40,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(called.choices[0].message.tool_calls[0].function.arguments) == block.input
    with claude.messages.stream(model=MODEL, extra_body=GREEDY, **FORCED) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", "get_weather", block.input)]


def test_a_tool_result_goes_back_as_chat_tool_messages(claude, client, base_url):
    block = create(claude, **FORCED).content[0]
    question = FORCED["messages"][0]
    result = {"type": "tool_result", "tool_use_id": block.id, "content": [{"type": "text", "text": "21 C, sunny"}]}
    message = create(claude, tools=[WEATHER], messages=[
        question, {"role": "assistant", "content": [block.model_dump(exclude_none=True)]},
        {"role": "user", "content": [result, {"type": "text", "text": "Is that warm?"}]}])
    call = {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": json.dumps(block.input)}}
    reply = chat(client, [question, {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": block.id, "content": "21 C, sunny"},
        {"role": "user", "content": "Is that warm?"}], tools=[CHAT_WEATHER])
    assert message.usage.input_tokens == reply.usage.prompt_tokens
    failed = {**result, "is_error": True, "content": "no such city"}
    counted = claude.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=[
        question, {"role": "assistant", "content": [block.model_dump(exclude_none=True)]},
        {"role": "user", "content": [failed]}]).input_tokens
    status, _, raw = http(base_url, "POST", "/tokenize", {"model": MODEL, "tools": [CHAT_WEATHER], "messages": [
        question, {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": block.id, "content": "Error: no such city"}]})
    assert status == 200 and counted == json.loads(raw)["count"]    # is_error: the result says it failed
    choice = reply.choices[0]
    if choice.finish_reason == "tool_calls":
        assert [b.type for b in message.content] == ["tool_use"] and message.stop_reason == "tool_use"
    else:
        assert message.content[0].text == choice.message.content


def test_count_tokens_is_the_prompt_the_message_uses(claude, spec, base_url):
    tools = {"tools": [WEATHER], "tool_choice": {"type": "any"}, "messages": FORCED["messages"]}
    counts = []
    for fields in ({"messages": ASK}, {"system": "Be brief.", "messages": ASK}, tools):
        count = claude.messages.count_tokens(model=MODEL, **fields).input_tokens
        assert count == create(claude, max_tokens=1, **fields).usage.input_tokens
        counts.append(count)
    without_tools = claude.messages.count_tokens(model=MODEL, messages=FORCED["messages"]).input_tokens
    assert counts[1] != counts[0] and counts[2] > without_tools   # the system prompt and the tools count
    status, _, raw = http(base_url, "POST", "/v1/messages/count_tokens", {"model": MODEL, "messages": ASK})
    assert status == 200
    documented(spec, "CountTokensResponse", json.loads(raw))


def test_output_config_holds_the_text_to_a_json_schema(claude):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}},
              "required": ["capital"], "additionalProperties": False}
    message = create(claude, messages=ASK, max_tokens=30, extra_body={
        **GREEDY, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    jsonschema.validate(json.loads(message.content[0].text), schema)


def anthropic_error(exc: anthropic.APIStatusError, spec: dict, error_type: str) -> str:
    documented(spec, "AnthropicErrorResponse", exc.body)
    assert exc.body["error"]["type"] == error_type, exc.body
    return exc.body["error"]["message"]


def test_bad_requests_are_anthropic_errors(claude, spec, base_url):
    with pytest.raises(anthropic.BadRequestError) as missing:
        claude.post("/v1/messages", cast_to=anthropic.types.Message, body={"model": MODEL, "messages": ASK})
    assert "'max_tokens' is required" in anthropic_error(missing.value, spec, "invalid_request_error")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        create(claude, messages=[{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}])
    message = anthropic_error(refused.value, spec, "invalid_request_error")
    assert "messages[0].content[1]" in message and "image" in message and "text only" in message
    with pytest.raises(anthropic.BadRequestError) as no_tools:
        create(claude, messages=ASK, tool_choice={"type": "any"})
    assert "tools" in anthropic_error(no_tools.value, spec, "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError) as unknown:
        claude.messages.create(model="claude-unknown", max_tokens=1, messages=ASK)
    assert "claude-unknown" in anthropic_error(unknown.value, spec, "not_found_error")
    status, _, raw = http(base_url, "POST", "/v1/messages", b"{}", headers={"Content-Type": "text/plain"})
    assert status == 415 and json.loads(raw)["error"]["type"] == "invalid_request_error"
    documented(spec, "AnthropicErrorResponse", json.loads(raw))


def test_x_api_key_and_bearer_both_authenticate(start_server, spec):
    url = start_server(settings={"api_key": "sekret"}).url
    for client in (anthropic.Anthropic(base_url=url, api_key="sekret", max_retries=0),
                   anthropic.Anthropic(base_url=url, api_key=None, auth_token="sekret", max_retries=0)):
        assert client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as wrong:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=1, messages=ASK)
    assert anthropic_error(wrong.value, spec, "authentication_error") == "invalid API key"
    assert http(url, "GET", "/v1/models", headers={"x-api-key": "sekret"})[0] == 200   # every protected route
    status, _, raw = http(url, "GET", "/v1/models")
    assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"     # OpenAI's shape there


# --- a model that thinks, on a --reasoning-parser server ---------------------------------------------
@pytest.fixture(scope="module")
def thinking_server(start_server, checkpoint):
    from test_output_parsers_http import THINKING_TEMPLATE

    from ember_cupy.chat_template import ChatTemplate
    from ember_cupy.engine.llm_engine import LLMEngine
    tokenizer = copy.copy(checkpoint.tokenizer)
    tokenizer.chat_template = ChatTemplate(THINKING_TEMPLATE, bos_token="", eos_token="<|im_end|>")
    thinking = dataclasses.replace(checkpoint, tokenizer=tokenizer)
    return start_server(engine_factory=lambda _checkpoint, config: LLMEngine(thinking, config),
                        settings={"reasoning_parser": "deepseek_r1"}).url


def test_thinking_comes_in_a_thinking_block_whole_and_streamed(thinking_server):
    import openai
    from test_output_parsers_http import SHOT
    reply = openai.OpenAI(base_url=thinking_server + "/v1", api_key="unused", max_retries=0).chat.completions.create(
        model=MODEL, messages=SHOT, max_tokens=40, temperature=0).choices[0].message
    assert reply.reasoning_content, "the one-shot made the model think: the split is exercised"
    claude = anthropic.Anthropic(base_url=thinking_server, api_key="unused", max_retries=0)
    message = create(claude, messages=SHOT, max_tokens=40)
    expected = [("thinking", reply.reasoning_content)] + ([("text", reply.content)] if reply.content else [])
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == expected
    with claude.messages.stream(model=MODEL, messages=SHOT, max_tokens=40, extra_body=GREEDY) as stream:
        thought = "".join(e.thinking for e in stream if e.type == "thinking")
        final = stream.get_final_message()
    assert thought == reply.reasoning_content
    assert [b.model_dump(exclude_none=True) for b in final.content] == [
        b.model_dump(exclude_none=True) for b in message.content]


@pytest.mark.parametrize("path,model", [("/v1/messages", "MessagesRequest"),
                                        ("/v1/messages/count_tokens", "CountTokensRequest")])
def test_every_documented_field_is_accepted_and_no_other(spec, base_url, path, model):
    from test_openapi_spec import request_with
    schema = spec["components"]["schemas"][model]
    bodies = [request_with(spec, schema, list(schema["properties"]), everything=True)]
    bodies += [request_with(spec, schema, [name]) for name in schema["properties"]]
    for body in bodies:
        status, _, raw = http(base_url, "POST", path, body)
        assert status == 200, (body, raw[:300])
    status, _, raw = http(base_url, "POST", path, {**request_with(spec, schema, []), "temprature": 1})
    assert status == 400 and "temprature" in json.loads(raw)["error"]["message"]
