"""POST /v1/responses (OpenAI's Responses API) through the openai SDK on the real model."""
from __future__ import annotations

import json

import openai
import pytest
from server_helpers import MODEL, http

from ember_cupy.server.response_store import ResponseStore

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10}},
          "required": ["answer"], "additionalProperties": False}
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


def check_documented(spec: dict, body: dict) -> None:
    schema = {"$ref": "#/components/schemas/ResponseObject", "components": spec["components"]}
    jsonschema.Draft202012Validator(schema).validate(body)


def create(client, **fields):
    return client.responses.create(model=MODEL, **{"max_output_tokens": 4, "temperature": 0, **fields})


def test_text_in_text_out(client, spec):
    response = create(client, input="The capital of France is")
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text and response.output[0].type == "message"
    usage = response.usage
    assert usage.output_tokens == 4 and usage.input_tokens > 5
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    check_documented(spec, response.model_dump(mode="json", exclude_unset=True))


def prompt_tokens(base_url: str, messages: list[dict], **fields) -> int:
    """The tokens of the chat prompt of `messages` (as /v1/chat/completions renders it)."""
    status, _, raw = http(base_url, "POST", "/tokenize", {"model": MODEL, "messages": messages, **fields})
    assert status == 200, raw
    return json.loads(raw)["count"]


def test_instructions_and_message_items_make_the_prompt(client, base_url):
    instructed = create(client, input="Hi", instructions="Answer in French.", max_output_tokens=1)
    assert instructed.instructions == "Answer in French."
    assert instructed.usage.input_tokens == prompt_tokens(base_url, [
        {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}])
    items = create(client, max_output_tokens=1, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello there."}]},
        {"role": "user", "content": "How are you?"}])
    assert items.usage.input_tokens == prompt_tokens(base_url, [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."},
        {"role": "user", "content": "How are you?"}])


def test_function_call_items_make_the_chat_prompt(client):
    """Items of a tool round trip give the prompt the same chat messages give /v1/chat/completions."""
    question = {"role": "user", "content": "Weather in Paris?"}
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    result = {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature_celsius": 21}'}
    response = create(client, input=[question, call, result], tools=[WEATHER], max_output_tokens=1)
    chat = client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        question, {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": result["output"]}],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}])
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    without_output = create(client, input=[question, call], tools=[WEATHER], max_output_tokens=1)
    assert without_output.usage.input_tokens < response.usage.input_tokens - 10


def test_streamed_events(client, spec):
    events = list(create(client, input="Count: one, two,", max_output_tokens=5, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == TEXT_EVENTS[:4] and kinds[-4:-1] == TEXT_EVENTS[-3:]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.status == "incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and next(e for e in events if e.type == "response.output_text.done").text == text
    assert final.response.output_text == text and final.response.usage.output_tokens == 5
    assert events[0].response.status == "in_progress" and events[0].response.id == final.response.id
    for event in (events[0], final):
        check_documented(spec, event.response.model_dump(mode="json", exclude_unset=True))


def test_a_finished_stream_ends_completed(client):
    events = list(create(client, input="Say yes or no.", max_output_tokens=20, stream=True,
                         text={"format": {"type": "json_schema", "name": "yn", "schema": {"enum": ["yes", "no"]}}}))
    assert events[-1].type == "response.completed" and events[-1].response.status == "completed"
    assert json.loads(events[-1].response.output_text) in ("yes", "no")


def test_json_schema_output_validates(client):
    response = create(client, input="What is the capital of France? Reply in JSON.", max_output_tokens=40,
                      text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}})
    assert response.status == "completed", response.output_text
    jsonschema.validate(json.loads(response.output_text), ANSWER)
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_function_tool_gives_a_function_call_item(client, spec, stream):
    fields = dict(input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
                  max_output_tokens=40, parallel_tool_calls=False)
    if stream:
        events = list(create(client, stream=True, **fields))
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
        response = events[-1].response
    else:
        response = create(client, **fields)
        check_documented(spec, response.model_dump(mode="json", exclude_unset=True))
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and len(calls) == 1
    assert calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    # an agent's next turn: the call's output, on top of the stored conversation
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"celsius": 21}'}
    answer = create(client, input=[result], previous_response_id=response.id, tools=[WEATHER], max_output_tokens=1)
    assert answer.output[0].type == "message"
    assert answer.usage.input_tokens > response.usage.input_tokens + response.usage.output_tokens


def test_previous_response_id_continues_the_conversation(client):
    first = create(client, input="My name is Ada.", max_output_tokens=3)
    second = create(client, input="What is my name?", previous_response_id=first.id, max_output_tokens=1)
    alone = create(client, input="What is my name?", max_output_tokens=1)
    assert second.previous_response_id == first.id
    # the first turn's input and output are in the second's prompt
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens + 4
    third = create(client, input="And again?", previous_response_id=second.id, max_output_tokens=1)
    assert third.usage.input_tokens > second.usage.input_tokens
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()


def test_store_false_is_not_kept(client):
    unstored = create(client, input="Hi", store=False, max_output_tokens=1)
    assert unstored.store is False
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, input="Hi", previous_response_id=unstored.id)
    assert caught.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(unstored.id)
    assert caught.value.body["code"] == "response_not_found"


BAD = [
    ({"input": []}, "input", "invalid_value"),
    ({"input": 5}, "input", "invalid_type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]", "invalid_value"),
    ({"input": [{"role": "user"}]}, "input[0].message.content", "missing_required_parameter"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"input": "Hi", "temperature": "hot"}, "temperature", "invalid_type"),
    ({"input": "Hi", "max_tokens": 3}, "max_tokens", "unknown_parameter"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema"}}}, "text.format", "invalid_value"),
    ({"input": "Hi", "tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "invalid_value"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format", "invalid_value"),
    ({"input": "Hi", "stream": True, "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"input": "Hi", "background": True}, "background", "invalid_value"),
    ({"input": "Hi", "previous_response_id": "resp_missing"}, "previous_response_id",
     "previous_response_not_found"),
    # OpenAI's bounds on metadata: 16 pairs, keys of at most 64 characters, values of at most 512
    ({"input": "Hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "invalid_value"),
    ({"input": "Hi", "metadata": {"k" * 65: "v"}}, "metadata", "invalid_value"),
    ({"input": "Hi", "metadata": {"k": "v" * 513}}, "metadata", "invalid_value"),
]


@pytest.mark.parametrize("body,param,code", BAD, ids=[p for _, p, _ in BAD])
def test_bad_input_is_a_400_in_openai_shape(spec, base_url, body, param, code):
    status, _, raw = http(base_url, "POST", "/v1/responses", {"model": MODEL, **body})
    assert status == 400, raw
    reply = json.loads(raw)
    jsonschema.Draft202012Validator({"$ref": "#/components/schemas/ErrorResponse",
                                     "components": spec["components"]}).validate(reply)
    assert reply["error"]["param"] == param and reply["error"]["code"] == code, reply
    assert reply["error"]["type"] == "invalid_request_error"


def test_an_unknown_model_is_a_404(base_url):
    status, _, raw = http(base_url, "POST", "/v1/responses", {"model": "nope", "input": "Hi"})
    assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found"


def test_the_store_is_bounded_in_count_age_and_size():
    now = [0.0]
    store = ResponseStore(max_responses=2, ttl_seconds=10, max_bytes=200, clock=lambda: now[0])
    message = [{"role": "user", "content": "x" * 40}]
    for name in ("a", "b", "c"):
        store.put({"id": name}, message)
    assert store.get("a") is None and store.get("b") and store.get("c")   # count: the oldest went
    store.put({"id": "big"}, [{"role": "user", "content": "y" * 150}])
    assert store.get("big") and len(store) == 1                             # size: the rest evicted to fit
    store.put({"id": "huge"}, [{"role": "user", "content": "z" * 500}])
    assert store.get("huge") is None                                        # never fits
    now[0] = 11
    assert store.get("big") is None and len(store) == 0                     # age


def test_metadata_at_openai_limits_is_accepted_and_echoed(client):
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    assert create(client, input="Hi", store=False, max_output_tokens=1, metadata=metadata).metadata == metadata


def test_chat_metadata_has_the_same_limits(base_url):
    status, _, raw = http(base_url, "POST", "/v1/chat/completions",
                          {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                           "metadata": {f"k{i}": "v" for i in range(17)}})
    assert status == 400 and json.loads(raw)["error"]["param"] == "metadata", raw


def test_the_store_counts_every_stored_field_against_its_byte_bound(start_server):
    """text.format, instructions, tools and metadata are kept with the response: they count.
    Three responses with 40 KB of text.format description each cannot all stay in 100 KB."""
    small = start_server(settings={"response_store_bytes": 100_000})
    ids = []
    for index in range(3):
        text = {"format": {"type": "json_object", "description": f"{index}" + "d" * 40_000}}
        status, _, raw = http(small.url, "POST", "/v1/responses",
                              {"model": MODEL, "input": "Hi", "max_output_tokens": 1, "text": text})
        assert status == 200, raw
        ids.append(json.loads(raw)["id"])
    statuses = [http(small.url, "GET", f"/v1/responses/{i}")[0] for i in ids]
    assert statuses == [404, 200, 200]
    status, _, raw = http(small.url, "GET", f"/v1/responses/{ids[-1]}")
    assert json.loads(raw)["text"]["format"]["description"].startswith("2ddd")


def test_every_documented_field_is_accepted(spec, base_url):
    """One request with every field the spec documents for /v1/responses (ignored ones included)."""
    body = {"model": MODEL, "input": [{"type": "message", "role": "user", "content": "Hi"}],
            "instructions": "Be brief.", "store": False, "stream": False, "max_output_tokens": 2,
            "temperature": 0.5, "top_p": 0.9, "text": {"format": {"type": "json_object"}, "verbosity": "low"},
            "tools": [WEATHER], "tool_choice": "none", "parallel_tool_calls": False, "metadata": {"k": "v"},
            "user": "u", "safety_identifier": "s", "prompt_cache_key": "k", "service_tier": "auto",
            "truncation": "disabled", "reasoning": {}, "include": [], "background": False}
    documented = spec["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert set(documented) == set(body) | {"previous_response_id"}
    status, _, raw = http(base_url, "POST", "/v1/responses", body)
    assert status == 200, raw
    reply = json.loads(raw)
    check_documented(spec, reply)
    assert reply["metadata"] == {"k": "v"} and reply["store"] is False
    assert reply["text"]["format"]["type"] == "json_object"
