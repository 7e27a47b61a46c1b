"""--reasoning-parser and --tool-call-parser through the HTTP server on the real model, with a
chat template that thinks (it opens <think> for the reply, as DeepSeek-R1's does) and renders
tools. A one-shot conversation makes SmolLM2 think and call in those formats; a server without
parsers gives the raw reply the parsing server must split the same way."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
from server_helpers import MODEL

from ember_cupy.chat_template import ChatTemplate
from ember_cupy.reasoning import split_reasoning

THINKING_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}")
SHOT = [{"role": "user", "content": "What is 1+1?"},
        {"role": "assistant", "content": "<think>\nOne plus one is two.\n</think>\n\nThe answer is 2."},
        {"role": "user", "content": "What is 2+2?"}, {"role": "user", "content": "What is 3+3?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_SHOT = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": '{"name": "get_weather", "parameters": {"city": "Paris"}}'},
             {"role": "user", "content": "Weather in Rome?"}]


@pytest.fixture(scope="module")
def thinking_checkpoint(checkpoint):
    tokenizer = copy.copy(checkpoint.tokenizer)
    tokenizer.chat_template = ChatTemplate(THINKING_TEMPLATE, bos_token="", eos_token="<|im_end|>")
    return dataclasses.replace(checkpoint, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def servers(start_server, thinking_checkpoint):
    from ember_cupy.engine.llm_engine import LLMEngine
    factory = lambda _checkpoint, config: LLMEngine(thinking_checkpoint, config)  # noqa: E731
    plain = start_server(engine_factory=factory)
    parsing = start_server(engine_factory=factory, settings={"reasoning_parser": "deepseek_r1"})
    calling = start_server(engine_factory=factory, settings={"tool_call_parser": "llama3_json"})
    return plain.url, parsing.url, calling.url


def _chat(url, stream=False, **body):
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    body = {"model": MODEL, "temperature": 0, "max_tokens": 40, **body}
    return client.chat.completions.create(stream=stream, **body)


def test_reasoning_is_split_from_the_answer_whole_and_streamed(servers):
    plain, parsing, _ = servers
    raw = _chat(plain, messages=SHOT).choices[0].message.content
    assert "</think>" in raw, raw      # the one-shot made the model think: the split is exercised
    expected = split_reasoning("deepseek_r1", raw)
    message = _chat(parsing, messages=SHOT).choices[0].message
    assert message.reasoning_content == expected.reasoning and message.content == expected.content
    assert message.model_extra["reasoning"] == expected.reasoning      # vLLM's newer field
    reasoning, content = "", ""
    for chunk in _chat(parsing, stream=True, messages=SHOT):
        delta = chunk.choices[0].delta if chunk.choices else None
        reasoning += (delta.model_extra or {}).get("reasoning_content") or "" if delta else ""
        content += delta.content or "" if delta else ""
    assert (reasoning, content) == (expected.reasoning, expected.content)


def test_structured_outputs_hold_the_answer_after_the_reasoning(servers):
    _, parsing, _ = servers
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    message = _chat(parsing, messages=SHOT, max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}).choices[0].message
    assert message.reasoning_content, "the thinking is free text"
    assert isinstance(json.loads(message.content)["answer"], int)


def test_a_grammar_with_a_reasoning_parser_is_refused(servers):
    import openai
    _, parsing, _ = servers
    with pytest.raises(openai.BadRequestError, match="reasoning parser"):
        _chat(parsing, messages=SHOT, extra_body={"structured_outputs": {"grammar": 'start: "a"'}})


def test_the_tool_call_parser_reads_the_familys_calls(servers):
    plain, _, parsing = servers
    raw = _chat(plain, messages=TOOL_SHOT, tools=TOOLS).choices[0].message.content
    assert '"get_weather"' in raw, raw
    choice = _chat(parsing, messages=TOOL_SHOT, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call, = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    streamed = [c for chunk in _chat(parsing, stream=True, messages=TOOL_SHOT, tools=TOOLS) if chunk.choices
                for c in chunk.choices[0].delta.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (call.function.name, call.function.arguments)]


def _responses(url, stream=False, **body):
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.responses.create(model=MODEL, temperature=0, max_output_tokens=40, stream=stream, **body)


def test_responses_put_the_reasoning_in_a_reasoning_item_whole_and_streamed(servers):
    plain, parsing, _ = servers
    expected = split_reasoning("deepseek_r1", _chat(plain, messages=SHOT).choices[0].message.content)
    response = _responses(parsing, input=SHOT)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == expected.reasoning
    assert message.type == "message" and response.output_text == expected.content
    events = list(_responses(parsing, stream=True, input=SHOT))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (deltas, text) == (expected.reasoning, expected.content)
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == expected.content
