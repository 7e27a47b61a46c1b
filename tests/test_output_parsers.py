"""Reasoning and tool-call parsers on replies written in each family's published format (the
shapes their chat templates and model cards document), whole and streamed in random deltas: a
streamed reply must come out exactly as the whole one."""
from __future__ import annotations

import json
import random

import pytest

from ember_cupy import tool_calls as T
from ember_cupy.reasoning import ReasoningStream, split_reasoning
from ember_cupy.tool_parsers import PARSERS, get_parser

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}} for n in ("get_weather", "get_time")]
WEATHER = {"city": "Paris", "days": 3}
TIME = {"city": "Tokyo"}

# (parser, reply, expected content, expected calls) in each family's own format
REPLIES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Tokyo"}}\n</tool_call>',
     "Let me check.", [("get_weather", WEATHER), ("get_time", TIME)]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None,
     [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "get_time", "parameters": {"city": "Tokyo"}}', None,
     [("get_weather", WEATHER), ("get_time", TIME)]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                '{"name": "get_time", "arguments": {"city": "Tokyo"}}]', None,
     [("get_weather", WEATHER), ("get_time", TIME)]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]'
                '{"city": "Tokyo"}', "Sure.", [("get_weather", WEATHER), ("get_time", TIME)]),
    ("pythonic", '[get_weather(city="Paris", days=3), get_time(city=\'Tokyo\')]', None,
     [("get_weather", WEATHER), ("get_time", TIME)]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris", days=3)]<|python_end|>', None,
     [("get_weather", WEATHER)]),
    ("qwen3_xml", 'I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
                  '<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>', "I will look.",
     [("get_weather", WEATHER)]),
]
# replies that are not (valid) calls: all content
NOT_CALLS = [
    ("hermes", "The weather is fine."), ("hermes", '<tool_call>{"name": "get_weather", "arguments": 5}</tool_call>'),
    ("llama3_json", "{not json at all"), ("llama3_json", '{"name": "unknown_tool", "parameters": {}}'),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]{broken"), ("pythonic", "[1, 2, 3] are numbers"),
    ("pythonic", "[get_weather(*args)]"), ("qwen3_xml", "<tool_call>\n</tool_call>"),
]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _streamed(stream_feed, text: str, rng: random.Random):
    """The reply fed in random deltas of 1-7 characters, the outputs concatenated."""
    pieces, at = [], 0
    while at < len(text):
        step = rng.randint(1, 7)
        pieces.append(text[at:at + step])
        at += step
    outputs = [stream_feed(p, i == len(pieces) - 1) for i, p in enumerate(pieces)] or [stream_feed("", True)]
    return outputs


@pytest.mark.parametrize("parser, reply, content, calls", REPLIES)
def test_each_family_format_parses_whole_and_streamed(parser, reply, content, calls):
    spec = T.parse_tools(TOOLS, "auto")
    whole = T.parse_output(reply, spec, template_supports_tools=True, parser=get_parser(parser))
    assert whole[0] == content and _calls(whole[1]) == calls
    for seed in range(30):
        stream = T.ToolCallStream(spec, True, get_parser(parser))
        outputs = _streamed(stream.feed, reply, random.Random(seed))
        sent = "".join(o[0] for o in outputs)
        assert sent.strip() == (content or ""), (seed, sent)
        assert _calls([c for o in outputs for c in o[1]]) == calls
        assert all(not o[1] for o in outputs[:-1]), "calls go out whole, at the end"


@pytest.mark.parametrize("parser, reply", NOT_CALLS)
def test_what_does_not_parse_stays_content_whole_and_streamed(parser, reply):
    spec = T.parse_tools(TOOLS, "auto")
    assert T.parse_output(reply, spec, True, get_parser(parser)) == (reply, [])
    for seed in range(10):
        outputs = _streamed(T.ToolCallStream(spec, True, get_parser(parser)).feed, reply, random.Random(seed))
        assert "".join(o[0] for o in outputs) == reply and not any(o[1] for o in outputs)


def test_content_streams_before_the_calls_start():
    stream = T.ToolCallStream(T.parse_tools(TOOLS, "auto"), True, get_parser("hermes"))
    assert stream.feed("Let me check the weather", False) == ("Let me check the weather", [])
    assert stream.feed(" now.\n<tool", False) == (" now.\n", [])          # a marker may be starting
    assert stream.feed('_call>{"name": "get_time", ', False) == ("", [])


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="hermes"):
        get_parser("nope")
    assert set(PARSERS) >= {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml"}


# --- reasoning ------------------------------------------------------------------------------------
THINKING = [
    # parser, prompt's end, reply, reasoning, content
    ("deepseek_r1", "<｜Assistant｜><think>\n", "The user greets.\n</think>\n\nHello!", "The user greets.\n",
     "\n\nHello!"),
    ("deepseek_r1", "<｜Assistant｜>", "<think>Short.</think>Hi", "Short.", "Hi"),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Still thinking when cut off", "Still thinking when cut off", None),
    ("qwen3", "<|im_start|>assistant\n", "<think>\nCount: 1, 2.\n</think>\n\nTwo.", "\nCount: 1, 2.\n", "\n\nTwo."),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "Two.", None, "Two."),      # enable_thinking=False
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Counting.\n</think>\n\nTwo.", "Counting.\n", "\n\nTwo."),
    ("qwen3", "<|im_start|>assistant\n", "<thinking is a word", None, "<thinking is a word"),
]


@pytest.mark.parametrize("parser, prompt, reply, reasoning, content", THINKING)
def test_reasoning_splits_whole_and_streamed_alike(parser, prompt, reply, reasoning, content):
    whole = split_reasoning(parser, reply, prompt)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for seed in range(30):
        stream = ReasoningStream(parser, prompt)
        outputs = _streamed(stream.feed, reply, random.Random(seed))
        assert "".join(o[0] for o in outputs) == (reasoning or "")
        assert "".join(o[1] for o in outputs) == (content or "")
