"""A chat reply's text -> the message a client reads: reasoning split off (`--reasoning-parser`),
then tool calls (`--tool-call-parser`, or the built-in formats), whole or delta by delta. The
structured-output constraint of a reasoning server holds the answer only (after_reasoning.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ember_cupy import tool_calls
from ember_cupy.reasoning import ReasoningStream, check_parser, prompt_opens_thinking, split_reasoning
from ember_cupy.structured.after_reasoning import after_thinking
from ember_cupy.tool_parsers import ToolParser, get_parser


@dataclass(frozen=True)
class OutputParsers:
    reasoning: str | None = None
    tools: ToolParser | None = None

    @classmethod
    def named(cls, reasoning: str | None, tools: str | None) -> "OutputParsers":
        """ValueError naming the choices for an unknown parser."""
        return cls(check_parser(reasoning), get_parser(tools))

    def constrain_answer(self, params, prompt: str):
        """params with their output constraint moved after the thinking, on a reasoning server."""
        if self.reasoning is None or params.structured_outputs is None:
            return params
        opened = self.reasoning == "deepseek_r1" or prompt_opens_thinking(prompt)
        return dataclasses.replace(params, structured_outputs=after_thinking(params.structured_outputs, opened))

    def full_message(self, choice: dict, text: str, prompt: str, tools: tool_calls.ToolSpec,
                     template_supports_tools: bool) -> None:
        """Fill a chat choice's message (and finish_reason) from the reply's whole text."""
        if self.reasoning is not None:
            split = split_reasoning(self.reasoning, text, prompt)
            choice["message"]["reasoning_content"] = choice["message"]["reasoning"] = split.reasoning
            choice["message"]["content"] = split.content
            text = split.content or ""
        if tools.active:
            tool_calls.set_full_choice(choice, text, tools, template_supports_tools, self.tools)


class ChatDeltas:
    """One choice's stream: each output's new text -> the chunk's delta."""

    def __init__(self, parsers: OutputParsers, prompt: str, tools: tool_calls.ToolSpec,
                 template_supports_tools: bool):
        self.reasoning = ReasoningStream(parsers.reasoning, prompt) if parsers.reasoning else None
        self.tools = tool_calls.ToolCallStream(tools, template_supports_tools, parsers.tools) \
            if tools.active else None

    def delta(self, text: str, finished: bool) -> tuple[dict, bool]:
        """(the delta, whether it carries tool calls)."""
        thought = ""
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text, finished)
        called = False
        if self.tools is not None:
            delta, called = tool_calls.stream_delta(self.tools, text, finished)
        else:
            delta = {"content": text} if text else {}
        if thought:
            delta = {"reasoning_content": thought, "reasoning": thought, **delta}
        return delta, called
