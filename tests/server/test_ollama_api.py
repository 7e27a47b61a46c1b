"""Ollama's native API (/api/chat, /api/generate, /api/embed, /api/embeddings, /api/tags, /api/ps,
/api/show, /api/version, /api/pull) through Ollama's own Python client and raw HTTP, on the real
model. The routes run on the OpenAI paths: a greedy /api/chat reply equals the chat completion of
the same conversation, a raw /api/generate the completion of the same prompt."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from server_helpers import documented, MAX_MODEL_LEN, MODEL, http

ollama = pytest.importorskip("ollama")
jsonschema = pytest.importorskip("jsonschema")

GREEDY = {"temperature": 0, "num_predict": 8}
ASK = [{"role": "user", "content": "The capital of France is"}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def llama(base_url):
    return ollama.Client(host=base_url, timeout=120)


def openai_chat(client, messages, **fields):
    return client.chat.completions.create(model=MODEL, messages=messages, **{"max_tokens": 8, "temperature": 0,
                                                                              **fields})


def ndjson(raw: bytes) -> list[dict]:
    return [json.loads(line) for line in raw.decode().splitlines() if line.strip()]


# --- chat ----------------------------------------------------------------------------------------
def test_a_chat_reply_is_the_chat_completion_of_its_conversation(llama, client, spec, base_url):
    reply = llama.chat(model=MODEL, messages=ASK, options=GREEDY)
    completion = openai_chat(client, ASK)
    assert reply.message.role == "assistant" and reply.message.content == completion.choices[0].message.content
    assert (reply.done, reply.done_reason) == (True, completion.choices[0].finish_reason)
    assert (reply.prompt_eval_count, reply.eval_count) == (completion.usage.prompt_tokens,
                                                           completion.usage.completion_tokens)
    assert reply.total_duration >= reply.eval_duration > 0 and reply.prompt_eval_duration > 0
    status, headers, raw = http(base_url, "POST", "/api/chat", {"model": MODEL, "messages": ASK, "stream": False,
                                                                "options": GREEDY})
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    documented(spec, "OllamaChatChunk", json.loads(raw))


def test_a_streamed_chat_is_ndjson_that_adds_up_to_the_whole_reply(llama, spec, base_url):
    whole = llama.chat(model=MODEL, messages=ASK, options=GREEDY)
    parts = list(llama.chat(model=MODEL + ":latest", messages=ASK, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert (parts[-1].done_reason, parts[-1].eval_count, parts[-1].model) == ("length", 8, MODEL + ":latest")
    status, headers, raw = http(base_url, "POST", "/api/chat", {"model": MODEL, "messages": ASK, "options": GREEDY})
    assert status == 200 and headers["Content-Type"].startswith("application/x-ndjson")   # stream by default
    for body in ndjson(raw):
        documented(spec, "OllamaChatChunk", body)


def test_options_become_sampling_params(llama, client):
    counting = [{"role": "user", "content": "Count from 1 to 30: 1, 2, 3,"}]
    long = llama.chat(model=MODEL, messages=counting, options={"temperature": 0, "num_predict": 12})
    text = long.message.content
    stop = text.split()[len(text.split()) // 2]
    assert text.find(stop) > 0, text
    stopped = llama.chat(model=MODEL, messages=counting, options={"temperature": 0, "num_predict": 12,
                                                                  "stop": ["never seen", stop]})
    assert (stopped.message.content, stopped.done_reason) == (text[:text.find(stop)], "stop")
    sampled = {"temperature": 1.0, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "repeat_penalty": 1.3,
               "presence_penalty": 0.5, "frequency_penalty": 0.2, "seed": 11, "num_predict": 16}
    first = llama.chat(model=MODEL, messages=counting, options=sampled).message.content
    again = llama.chat(model=MODEL, messages=counting, options=sampled).message.content
    same = openai_chat(client, counting, temperature=1.0, top_p=0.9, seed=11, max_tokens=16, presence_penalty=0.5,
                       frequency_penalty=0.2, extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.3})
    assert first == again == same.choices[0].message.content
    no_penalty = dict(sampled, repeat_last_n=0)
    plain = openai_chat(client, counting, **{k: v for k, v in same_fields(no_penalty).items()})
    assert llama.chat(model=MODEL, messages=counting, options=no_penalty).message.content == \
        plain.choices[0].message.content


def same_fields(options: dict) -> dict:
    """The OpenAI request fields of options without a repetition penalty."""
    return {"temperature": options["temperature"], "top_p": options["top_p"], "seed": options["seed"],
            "max_tokens": options["num_predict"], "presence_penalty": options["presence_penalty"],
            "frequency_penalty": options["frequency_penalty"],
            "extra_body": {"top_k": options["top_k"], "min_p": options["min_p"]}}


def test_format_holds_the_reply_to_json_or_a_schema(llama):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}},
              "required": ["capital"], "additionalProperties": False}
    reply = llama.chat(model=MODEL, messages=ASK, format=schema, options={"temperature": 0, "num_predict": 40})
    jsonschema.validate(json.loads(reply.message.content), schema)
    reply = llama.chat(model=MODEL, messages=ASK, format="json", options={"temperature": 0, "num_predict": 40})
    assert reply.message.content.lstrip().startswith(("{", "[", '"')) or reply.done_reason == "length"


def test_logprobs_are_the_chat_completions(llama, client):
    reply = llama.chat(model=MODEL, messages=ASK, options={"temperature": 0, "num_predict": 4}, logprobs=True,
                       top_logprobs=2)
    expected = openai_chat(client, ASK, max_tokens=4, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in reply.logprobs] == [(e.token, e.logprob) for e in expected]
    assert [[(t.token, t.logprob) for t in e.top_logprobs] for e in reply.logprobs] == \
        [[(t.token, t.logprob) for t in e.top_logprobs] for e in expected]
    streamed = [entry for part in llama.chat(model=MODEL, messages=ASK, options={"temperature": 0, "num_predict": 4},
                                             logprobs=True, stream=True) for entry in part.logprobs or []]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in expected]


def test_tool_calls_and_answers_render_as_on_chat_completions(llama, client):
    """An assistant's calls (arguments an object) and the tool's answer tied to them by tool_name:
    the same prompt as the chat completions conversation with the ids the mapping gives."""
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    ollama_turns = asked + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                          "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "Sunny, 24 C"}]
    openai_turns = asked + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1_0", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1_0", "name": "get_weather", "content": "Sunny, 24 C"}]
    reply = llama.chat(model=MODEL, messages=ollama_turns, tools=[WEATHER_TOOL], options=GREEDY)
    completion = openai_chat(client, openai_turns, tools=[WEATHER_TOOL])
    assert reply.prompt_eval_count == completion.usage.prompt_tokens
    assert reply.message.content == (completion.choices[0].message.content or "")


def test_tool_answers_are_tied_to_the_earliest_unanswered_call_of_their_tool():
    from ember_cupy.server.ollama_requests import chat_messages
    from ember_cupy.server.protocol.ollama import OllamaChatRequest

    def call(name, city):
        return {"function": {"name": name, "arguments": {"city": city}}}
    req = OllamaChatRequest.model_validate({"model": MODEL, "messages": [
        {"role": "user", "content": "Weather and time in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", "Paris"), call("get_time", "Paris"),
                                                           {"id": "mine", **call("get_weather", "Rome")}]},
        {"role": "tool", "tool_name": "get_time", "content": "noon"},
        {"role": "tool", "tool_name": "get_weather", "content": "sunny"},
        {"role": "tool", "tool_call_id": "mine", "content": "rain"},
        {"role": "tool", "content": "an answer to no call"}]})
    messages = chat_messages(req)
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["call_1_0", "call_1_1", "mine"]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert [(m["tool_call_id"], m.get("name")) for m in messages[2:]] == [
        ("call_1_1", "get_time"), ("call_1_0", "get_weather"), ("mine", None), ("call_answer_5", None)]


def test_a_tool_call_goes_out_whole_with_object_arguments():
    from ember_cupy import tool_calls
    from ember_cupy.engine.outputs import CompletionOutput, RequestOutput
    from ember_cupy.server.ollama_replies import OllamaReply
    from ember_cupy.server.output_parsers import OutputParsers
    spec = tool_calls.parse_tools([WEATHER_TOOL])
    reply = OllamaReply("chat", MODEL, "", OutputParsers(), spec, False, None, False)
    pieces = ['[{"name": "get_weather", ', '"arguments": {"city": "Paris"}}]']
    objects = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        c = CompletionOutput(0, piece, [i], delta_text=piece, finish_reason="stop" if last else None)
        objects += reply.feed(RequestOutput("r", "", [1, 2], [c], last))
    assert [o["done"] for o in objects] == [False, True]
    (call,) = objects[0]["message"]["tool_calls"]
    assert call["function"] == {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}
    assert objects[0]["message"]["content"] == "" and objects[1]["done_reason"] == "stop"
    assert reply.whole(objects)["message"]["tool_calls"] == [call]


# --- generate ------------------------------------------------------------------------------------
def test_generate_is_a_user_turn_and_raw_is_a_completion(llama, client, spec, base_url):
    generated = llama.generate(model=MODEL, prompt=ASK[0]["content"], options=GREEDY)
    assert generated.response == openai_chat(client, ASK).choices[0].message.content
    system = llama.generate(model=MODEL, prompt=ASK[0]["content"], system="Answer in French.", options=GREEDY)
    with_system = openai_chat(client, [{"role": "system", "content": "Answer in French."}] + ASK)
    assert system.response == with_system.choices[0].message.content
    assert len(generated.context) == generated.prompt_eval_count + generated.eval_count
    raw = llama.generate(model=MODEL, prompt="The capital of France is", raw=True, options=GREEDY)
    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                           temperature=0)
    assert raw.response == completion.choices[0].text
    assert raw.prompt_eval_count == completion.usage.prompt_tokens
    status, _, body = http(base_url, "POST", "/api/generate", {"model": MODEL, "prompt": "Hi", "raw": True,
                                                               "options": GREEDY})
    for part in ndjson(body):
        documented(spec, "OllamaGenerateChunk", part)


def test_context_continues_a_raw_generation(llama, client, base_url):
    first = llama.generate(model=MODEL, prompt="1, 2, 3,", raw=True, options=GREEDY)
    follow = llama.generate(model=MODEL, prompt=" 10,", raw=True, context=first.context, options=GREEDY)
    _, _, raw = http(base_url, "POST", "/tokenize", {"model": MODEL, "prompt": " 10,", "add_special_tokens": False})
    ids = list(first.context) + json.loads(raw)["tokens"]
    completion = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert follow.response == completion.choices[0].text
    assert list(follow.context[:len(ids)]) == ids


def test_a_raw_generation_without_num_predict_runs_to_the_end_of_the_context(llama):
    reply = llama.generate(model=MODEL, prompt="1, 2, 3,", raw=True, options={"temperature": 0, "stop": ["\n"]})
    assert reply.done_reason in ("stop", "length") and reply.eval_count > 0
    assert reply.prompt_eval_count + reply.eval_count <= MAX_MODEL_LEN


@pytest.mark.parametrize("raw", [True, False])
def test_a_num_predict_past_the_context_stops_where_it_ends(llama, base_url, raw):
    """Ollama generates on past its context; a 400 there would break a client that asks much."""
    _, _, ids = http(base_url, "POST", "/tokenize", {"model": MODEL, "prompt": "1, 2, 3, 4, " * 100})
    context = json.loads(ids)["tokens"][:MAX_MODEL_LEN - 40]
    reply = llama.generate(model=MODEL, prompt="5, 6,", raw=raw, context=context,
                           options={"temperature": 0, "num_predict": 10_000})
    assert reply.done_reason in ("stop", "length") and reply.eval_count > 0
    assert reply.prompt_eval_count + reply.eval_count <= MAX_MODEL_LEN
    assert reply.done_reason == "stop" or reply.prompt_eval_count + reply.eval_count == MAX_MODEL_LEN


@pytest.mark.parametrize("path,body,kind", [
    ("/api/chat", {"model": MODEL}, "message"), ("/api/generate", {"model": MODEL, "prompt": ""}, "response")])
def test_a_request_that_asks_nothing_loads_the_model(base_url, path, body, kind):
    status, _, raw = http(base_url, "POST", path, body)
    reply = json.loads(raw)
    assert status == 200 and (reply["done"], reply["done_reason"]) == (True, "load") and kind in reply


# --- embeddings ----------------------------------------------------------------------------------
def test_embed_equals_the_embeddings_route(llama, client, spec, base_url):
    texts = ["The capital of France is Paris.", "Cats sleep a lot."]
    embedded = llama.embed(model=MODEL, input=texts)
    expected = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert np.allclose(embedded.embeddings, [d.embedding for d in expected.data])
    assert embedded.prompt_eval_count == expected.usage.prompt_tokens
    single = llama.embed(model=MODEL, input=texts[0])
    assert np.allclose(single.embeddings, embedded.embeddings[:1])
    older = np.asarray(llama.embeddings(model=MODEL, prompt=texts[0]).embedding)
    assert not np.isclose(np.linalg.norm(older), 1.0)     # Ollama's older route: not normalised
    assert np.allclose(older / np.linalg.norm(older), single.embeddings[0], atol=1e-5)
    _, _, raw = http(base_url, "POST", "/api/embed", {"model": MODEL, "input": "Hi"})
    documented(spec, "OllamaEmbedResponse", json.loads(raw))


def test_embed_truncates_only_when_asked(base_url):
    long = "word " * (MAX_MODEL_LEN + 50)
    status, _, raw = http(base_url, "POST", "/api/embed", {"model": MODEL, "input": long, "truncate": False})
    assert status == 400 and "error" in json.loads(raw)
    status, _, raw = http(base_url, "POST", "/api/embed", {"model": MODEL, "input": long})
    assert status == 200 and json.loads(raw)["prompt_eval_count"] == MAX_MODEL_LEN


# --- the served model ----------------------------------------------------------------------------
def test_tags_ps_and_show_describe_the_served_model(llama, spec, server, base_url):
    info = server.engine.model_info()
    (listed,) = llama.list().models
    assert listed.model == MODEL + ":latest" and listed.size == os.path.getsize(info.source)
    details = listed.details
    assert (details.format, details.family, details.quantization_level, details.parameter_size) == (
        "gguf", "llama", "Q4_1", "134.52M")
    (running,) = llama.ps().models
    assert running.context_length == MAX_MODEL_LEN and running.digest == listed.digest
    assert running.size == info.weight_bytes and running.size_vram == 0
    shown = llama.show(MODEL)
    _, _, raw = http(base_url, "GET", "/tokenizer_info")
    assert shown.template == json.loads(raw)["chat_template"]
    assert shown.modelinfo["llama.context_length"] == MAX_MODEL_LEN
    assert shown.modelinfo["general.parameter_count"] == 134515008
    assert {"completion", "embedding"} <= set(shown.capabilities)
    for path, model in (("/api/tags", "OllamaTags"), ("/api/ps", "OllamaProcesses"), ("/api/version", "OllamaVersion")):
        status, _, raw = http(base_url, "GET", path)
        assert status == 200
        documented(spec, model, json.loads(raw))
    _, _, raw = http(base_url, "POST", "/api/show", {"name": MODEL})
    documented(spec, "OllamaShowResponse", json.loads(raw))


def test_pull_of_the_served_model_succeeds_and_nothing_else_is_fetched(llama, base_url):
    assert llama.pull(MODEL).status == "success"
    with pytest.raises(ollama.ResponseError) as refused:
        llama.pull("llama3.2")
    assert refused.value.status_code == 404 and "downloads nothing" in refused.value.error
    status, _, raw = http(base_url, "DELETE", "/api/delete", {"model": MODEL})
    assert status == 404 and "not supported" in json.loads(raw)["error"]


# --- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,words", [
    ("/api/chat", {"model": "nope", "messages": ASK}, "not found"),
    ("/api/chat", {"model": MODEL, "messages": ASK, "options": {"bogus": 1}}, "options.bogus"),
    ("/api/chat", {"model": MODEL, "messages": ASK, "options": {"temperature": "hot"}}, "temperature"),
    ("/api/chat", {"model": MODEL, "messages": ASK, "options": {"mirostat": 2}}, "mirostat"),
    ("/api/chat", {"model": MODEL, "messages": ASK, "options": {"typical_p": 0.5}}, "typical_p"),
    ("/api/chat", {"model": MODEL, "messages": ASK, "think": True}, "--reasoning-parser"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "Hi", "images": ["aGk="]}]}, "images"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "Hi", "tool_name": "x"}]}, "tool"),
    ("/api/chat", {"model": MODEL, "messages": ASK, "top_logprobs": 2}, "logprobs"),
    ("/api/chat", {"model": MODEL, "messages": ASK, "surprise": 1}, "surprise"),
    ("/api/generate", {"model": MODEL, "prompt": "Hi", "suffix": " end"}, "suffix"),
    ("/api/generate", {"model": MODEL, "prompt": "Hi", "template": "{{ .Prompt }}"}, "template"),
    ("/api/generate", {"model": MODEL, "prompt": "Hi", "raw": True, "system": "Be brief."}, "system"),
    ("/api/generate", {"model": MODEL, "prompt": "Hi", "context": [10 ** 9]}, "context"),
    ("/api/generate", {"model": MODEL, "prompt": "word " * (MAX_MODEL_LEN + 10)}, "context"),
    ("/api/embed", {"model": MODEL, "input": "Hi", "dimensions": 3}, "dimensions"),
    ("/api/show", {}, "model"),
])
def test_bad_requests_are_ollama_errors_naming_the_problem(base_url, path, body, words):
    status, headers, raw = http(base_url, "POST", path, body)
    assert 400 <= status < 500, raw
    error = json.loads(raw)
    assert list(error) == ["error"] and words in error["error"], error


def test_the_ollama_client_raises_the_servers_message(llama):
    with pytest.raises(ollama.ResponseError) as refused:
        llama.chat(model=MODEL, messages=ASK, options={"bogus": 1})
    assert refused.value.status_code == 400 and "options.bogus" in refused.value.error


def test_a_client_that_leaves_mid_stream_aborts_its_request(base_url):
    from server_helpers import leaving_mid_stream_aborts
    leaving_mid_stream_aborts(base_url, "/api/generate", {
        "model": MODEL, "prompt": "Tell me a story.", "options": {"num_predict": 300, "temperature": 0}})
